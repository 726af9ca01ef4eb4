"""The emulated NCCL: a torch.distributed backend, "fnccl", for ranks on fgpu devices. It
holds them to NCCL's rules and moves their bytes with gloo.

    dist.init_process_group("fnccl", device_id=torch.device("fgpu", rank))   # after emulation.install()

What NCCL refuses, it refuses: a tensor off the rank's device (a CPU tensor raises NCCL's
"No backend type associated with device type cpu"), two ranks' communicators on one device
("Duplicate GPU detected"), non-contiguous tensors in collectives, receiving from any
source, ReduceOp.BAND/BOR/BXOR, monitored_barrier. Where NCCL hangs, it stops: `streams`
keeps each communicator's stream in posting order, runs a send only with its receive, and
sets communicators up eagerly (device_id given: one per group) or lazily (one per pair, at
its first send or receive). With device_id a group is bound to that device (torch's
`bound_device_id`) and splits as NCCL's does (`supports_splitting`): a new group of its world
(new_group, split_group, DeviceMesh's dimensions) is split from its parent's communicator,
every rank of the parent taking part, and has a communicator of its own, made eagerly. A rank
that waits for an operation that can never run gets an `EmulatedNCCLError` naming every stuck
rank and the order of its operations, as soon as the last of them blocks; the world is broken
from then on, as an aborted NCCL communicator is. A rank whose process died cannot be seen
so: the ranks waiting for it wait until their group's timeout, when `link`'s watchdog ends
them with NCCL's "Watchdog caught collective operation timeout" (the process torn down, as
TORCH_NCCL_ASYNC_ERROR_HANDLING=3 does; raised instead with TORCH_NCCL_BLOCKING_WAIT=1).
`dist.batch_isend_irecv` on such a group
posts its operations as one batch, as NCCL does.
Its operations pass PyTorch's dispatcher as NCCL's do (each its c10d op, served on fgpu by
`_dispatched`), so that dispatch modes (CommDebugMode, side_by_side.CallCounter) see them.

The bytes move through a gloo group over the same ranks, between CPU views of the fgpu
tensors: each operation when the coordinator releases it, by one thread per process in the
coordinator's order, each once the stream current where it was posted has run what came
before (the host waits for that stream as it posts). `Work.wait()` makes the current stream
wait for the operation and returns, as NCCL's does (`gpu_streams`); a barrier's blocks the host.
"""
from __future__ import annotations

import contextlib
import functools
import types
import warnings
from collections import Counter

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from parakit.emulation import fgpu, gpu_streams
from parakit.emulation.link import LINK, EmulatedNCCLError, Op, Work, broken, connect, idle  # noqa: F401 (the API)
from parakit.emulation.streams import Entry, Item

__all__ = ["BACKEND", "EmulatedNCCL", "EmulatedNCCLError", "register", "broken", "idle", "refuse_off_device"]

BACKEND = "fnccl"
_ORIGINAL = {"batch_isend_irecv": c10d.batch_isend_irecv, "object_device": c10d._get_object_coll_device}


def register() -> None:
    """Make "fnccl" a torch.distributed backend in this process (once)."""
    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=[fgpu.NAME])
        dist.Backend.backend_capability[dist.Backend.GLOO].append(fgpu.NAME)  # as gloo serves CUDA's devices: so a
        # gloo group of a bound world (new_group(backend="gloo"), async_save's) has a backend for the bound fgpu
        with warnings.catch_warnings():  # c10d's own fgpu kernels would ask for a C++ backend this group has not
            warnings.filterwarnings("ignore", "Warning only once for all operators")
            for name in _DISPATCHED:
                _C10D.impl(name, functools.partial(_dispatched, getattr(torch.ops.c10d, name).default), "PrivateUse1")
        dist.batch_isend_irecv = c10d.batch_isend_irecv = _batch_isend_irecv
        c10d._get_object_coll_device = _object_device


_C10D = torch.library.Library("c10d", "IMPL")
_DISPATCHED = ("allreduce_", "allreduce_coalesced_", "broadcast_", "reduce_", "allgather_", "_allgather_base_",
               "allgather_into_tensor_coalesced_", "reduce_scatter_", "_reduce_scatter_base_",
               "reduce_scatter_tensor_coalesced_", "alltoall_base_", "alltoall_", "gather_", "scatter_", "send",
               "recv_")  # the c10d ops an emulated group's operations pass, as NCCL's do


def _dispatched(op, *args, **kwargs):
    """The fgpu kernel of c10d's `op`: the work its emulated group posted before dispatching it
    (`EmulatedNCCL._shown`), returned as NCCL's kernel returns its work (with the op's first
    argument, the tensors it writes, where the op returns them)."""
    group = next(dist.ProcessGroup.unbox(a) for a in args
                 if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()))
    if not isinstance(group, EmulatedNCCL) or not group.shown:
        raise RuntimeError(f"{op} on an fgpu tensor outside an emulated NCCL group's operation: call it "
                           f"through torch.distributed (dist.all_reduce, ...) or the group's methods")
    work = group.shown.pop().boxed()
    return work if len(op._schema.returns) == 1 else (args[0], work)


def _create(options, _backend_options):
    ranks = list(options.global_ranks_in_group) or list(range(options.group_size))
    if not options.global_ranks_in_group or not LINK:  # the world's first emulated group: its coordinator
        connect(options.store, options.group_rank, options.group_size)
    default = c10d._world.default_pg if dist.is_initialized() else None
    if isinstance(default, EmulatedNCCL) and default.eager:  # new_group on a bound world: split from the world's
        default._split()  # communicator (its other ranks: `perform_nocolor_split`); torch binds it next
    return EmulatedNCCL(options.store, options.group_rank, options.group_size, ranks, options.timeout,
                        options.group_id)


def _batch_isend_irecv(p2p_op_list):
    """torch's batch_isend_irecv, whose operations an emulated group posts as one batch."""
    group = p2p_op_list[0].group if p2p_op_list else None
    group = group or c10d._get_default_group()
    if not isinstance(group, EmulatedNCCL):
        return _ORIGINAL["batch_isend_irecv"](p2p_op_list)
    group._start_coalescing(None)
    try:
        works = _ORIGINAL["batch_isend_irecv"](p2p_op_list)
    except BaseException:
        group.batch = None
        raise
    group._end_coalescing(None)
    return works


def _object_device(group=None) -> str:
    """Where all_gather_object and its kind put their bytes: for an emulated group (or one
    registered as "fnccl", as the grading relay is on the emulated box) the rank's own fgpu,
    as NCCL's "cuda" means the current GPU (an fgpu without index would be fgpu:0 in `.to`,
    whose index PyTorch takes from a device guard a Python backend cannot give)."""
    group = group or c10d._get_default_group()
    if isinstance(group, EmulatedNCCL) or c10d.get_backend(group) == BACKEND:  # or a group standing in for it
        return str(getattr(group, "device", None) or torch.device(fgpu.NAME, fgpu.current_device()))
    return _ORIGINAL["object_device"](group)


def refuse_off_device(tensor: torch.Tensor, bound: torch.device | None, what: str, rank: int) -> None:
    """NCCL's rule for a tensor that `what` (an operation on `rank`) passes: on a GPU, the
    communicator's (`bound`, where it has one; else the current one), never the CPU."""
    expected = bound or torch.device(fgpu.NAME, fgpu.current_device())
    if tensor.device.type != fgpu.NAME:
        raise RuntimeError(
            f"No backend type associated with device type {tensor.device.type}: {what} on rank {rank} got a tensor "
            f"on {tensor.device}, but under NCCL this rank's tensors live on {expected}: make them there "
            f"(device=parakit.device()) or move them with .to(parakit.device())")
    if tensor.device != expected and bound is not None:
        raise ValueError(f"{what} on rank {rank} got a tensor on {tensor.device}, but this rank's NCCL communicator "
                         f"is on {bound} (one device per rank): move it there first")


# ------------------------------------------------------------------------------ the group

def _views(tensors) -> list[torch.Tensor]:
    return [fgpu.cpu_view(t) for t in tensors]


def _options(kind, **fields):
    options = kind()
    for name, value in fields.items():
        setattr(options, name, value)
    return options


_REFUSED = {dist.ReduceOp.BAND: "BAND", dist.ReduceOp.BOR: "BOR", dist.ReduceOp.BXOR: "BXOR"}


def _reduce(opts):
    """(the gloo op, whether to divide by the group's size): NCCL's AVG is gloo's SUM, divided."""
    op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
    for refused, name in _REFUSED.items():
        if op == refused:
            raise ValueError(f"Cannot use ReduceOp.{name} with NCCL")
    return (dist.ReduceOp.SUM, True) if op == dist.ReduceOp.AVG else (op, False)


class EmulatedNCCL(dist.ProcessGroup):
    """A process group of the global `ranks` under NCCL's rules (see the module), the bytes moved by gloo."""

    supports_splitting = True  # so init_process_group(device_id=...) binds it, and new groups split from it

    def __init__(self, store, rank: int, size: int, ranks: list[int], timeout, name: str):
        super().__init__(rank, size)
        self.ranks, self.name, self.link, self.store = ranks, name, LINK[0], store
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
        self.eager, self.device, self.batch, self.splits = False, None, None, 0
        self.options = types.SimpleNamespace(_timeout=timeout)  # NCCL's options, which split_group copies
        self.group_name_, self.group_desc_ = name, "undefined"
        self.connected: set[tuple] = set()
        self.counts: Counter = Counter()
        self.shown: list[Work] = []  # the work an operation posted, while it passes the dispatcher

    def getBackendName(self):
        return BACKEND

    def get_group_store(self):  # kept here too (ProcessGroup's store is for C++ backends): split_group registers it
        return self.store

    def getGroupName(self):  # kept here: torch keeps a group's name in its C++ backends, and this group has none
        return self.group_name_

    def setGroupName(self, name):
        self.group_name_ = name

    def getGroupDesc(self):
        return self.group_desc_

    def setGroupDesc(self, desc):
        self.group_desc_ = desc

    @property
    def _device_types(self):
        return [torch.device(fgpu.NAME)]

    def _get_backend(self, device):
        """The backend torch asks for `device` (an fgpu, its index or none): this group itself."""
        if torch.device(device).type != fgpu.NAME:
            raise RuntimeError(f"the emulated NCCL group has no backend for device type {torch.device(device).type}")
        return self

    def eager_connect_single_device(self, device):
        """init_process_group(device_id=device)'s eager start, and a new group's on a bound
        world: bound to `device`, the group makes its communicator now (every member taking part)."""
        self._bind(torch.device(device))

    def _bind(self, device: torch.device) -> None:
        if not self.eager:
            self.eager, self.device, self.bound_device_id = True, device, device
            self._connect(self._comm())

    # -------------------------------------------------------------------------- splitting

    def split_group(self, ranks, timeout=None, opts=None, group_name=None, group_desc=None, device_types=None):
        """ncclCommSplit, called by every rank of this group: a rank whose group ranks `ranks`
        hold its own gets the new group of them, bound to this group's device with a
        communicator of its own; any other (NCCL's no color) takes part and gets None. `opts`
        (a copy of `options`) and `device_types` set nothing here. Sends nothing but the split."""
        split = self._split()
        if self.rank() not in ranks:
            return None
        members = sorted(ranks)
        name = f"{self.name}:split:{split}:{[self.ranks[r] for r in members]}"  # one communicator per color
        child = EmulatedNCCL(dist.PrefixStore(f"{name}/", self.store), members.index(self.rank()), len(members),
                             [self.ranks[r] for r in members], timeout or self.options._timeout, name)
        child.setGroupName(group_name)
        child.setGroupDesc(group_desc)
        child._bind(self.device)
        return child

    def perform_nocolor_split(self, device):
        """A rank outside the group new_group makes takes part in its split, as NCCL's does."""
        self._split()

    def _set_sequence_number_for_group(self):
        """What split_group asks of a new group: NCCL numbers its collectives from here; this group's
        are numbered from its start already (`counts`)."""

    def comm_split_count(self) -> int:
        """How many splits this group's communicator has taken part in (no-color ones too), as NCCL counts."""
        return self.splits

    def _split(self) -> int:
        """Take part in a split of this group's communicator, a collective of all its ranks on
        its stream (so one rank's split against another's collective is a mismatch); its number."""
        self.link.wait(self._collective("ncclCommSplit", [], lambda: None, []).op)  # the host waits, as NCCL's
        self.splits += 1
        return self.splits - 1

    # -------------------------------------------------------------------------- posting

    def _me(self) -> int:
        return self.ranks[self.rank()]

    def _comm(self, peer: int | None = None) -> tuple:
        """The communicator an operation goes to: the group's, or (lazy, a single send or
        receive) its pair's."""
        if peer is None or self.eager or self.batch is not None:
            return self.name, "all"
        return (self.name, *sorted((self._me(), peer)))

    def _check(self, tensors, what: str, contiguous: bool = True) -> None:
        for tensor in tensors:
            refuse_off_device(tensor, self.device, what, self._me())
            self.device = self.device or tensor.device  # lazy: NCCL takes the first tensor's device
            if contiguous and not tensor.is_contiguous():
                raise ValueError("Tensors must be contiguous")

    def _connect(self, comm: tuple) -> None:
        members = tuple(self.ranks) if comm[1] == "all" else comm[1:]
        device = self.device or torch.device(fgpu.NAME, fgpu.current_device())
        self.link.setup(comm, members, str(device))
        self.connected.add(comm)

    def _add(self, comm: tuple, item: Item, run, outputs) -> Work:
        op = self.batch or Op(Entry(self._me(), next(self.link.ids), comm), self.link)
        op.add(item, run, outputs)
        if self.batch is None:
            self._post(op)
        return Work(op)

    def _post(self, op: Op) -> None:
        if op.entry.comm not in self.connected:
            self._connect(op.entry.comm)
        gpu_streams.wait_current(self.device.index if self.device else fgpu.current_device())  # its inputs written
        self.link.post(op, self.options._timeout)  # the watchdog catches it after the group's timeout

    def _collective(self, what: str, tensors, run, outputs) -> Work:
        self._check(tensors, what)
        comm = self._comm()
        self.counts[comm] += 1
        return self._add(comm, Item((comm, "coll", self.counts[comm] - 1), tuple(self.ranks), what), run, outputs)

    def _p2p(self, sending: bool, tensor, peer: int, run) -> Work:
        what = f"{'send to' if sending else 'recv from'} rank {self.ranks[peer]}"
        self._check([tensor], what, contiguous=False)
        src, dst = (self._me(), self.ranks[peer]) if sending else (self.ranks[peer], self._me())
        comm = self._comm(self.ranks[peer])
        self.counts[comm, src, dst] += 1
        key = (comm, "p2p", src, dst, self.counts[comm, src, dst] - 1)
        return self._add(comm, Item(key, (src, dst), what), run, [tensor])

    def _start_coalescing(self, device):
        """Operations from here to `_end_coalescing` go out as one batch (NCCL's group call)."""
        self.batch = Op(Entry(self._me(), next(self.link.ids), self._comm()), self.link)

    def _end_coalescing(self, device):
        op, self.batch = self.batch, None
        if op.entry.items:
            self._post(op)
        else:
            op.finish()
        return Work(op)

    # -------------------------------------------------------------------------- operations
    # Each posts its work, then shows it to PyTorch's dispatcher by calling ProcessGroup's own
    # method (`super()`, from the method of the same name: pybind calls C++'s, not this one),
    # which dispatches the c10d op as NCCL's group does. C++ callers reach these methods by
    # name, and fall back to an older name (allgather_into_tensor_coalesced, alltoall_base,
    # reduce_scatter_tensor_coalesced) where a group lacks the new one: a method here under an
    # older name would be called again from its own super() call, without end.

    @contextlib.contextmanager
    def _shown(self, work: Work):
        self.shown.append(work)
        try:
            yield
        finally:
            self.shown.clear()  # a dispatch mode that never runs the op leaves nothing behind

    def send(self, tensors, dst, tag=0):
        (tensor,) = tensors
        work = self._p2p(True, tensor, dst, lambda: self.gloo.send([fgpu.cpu_view(tensor).contiguous()], dst, 0).wait())
        with self._shown(work):
            super().send(tensors, dst, tag)
        return work

    def recv(self, tensors, src, tag=0):
        (tensor,) = tensors

        def run():
            view = fgpu.cpu_view(tensor)
            buffer = view if view.is_contiguous() else torch.empty_like(view, memory_format=torch.contiguous_format)
            self.gloo.recv([buffer], src, 0).wait()
            if buffer is not view:
                view.copy_(buffer)
        work = self._p2p(False, tensor, src, run)
        with self._shown(work):
            super().recv(tensors, src, tag)
        return work

    def recv_anysource(self, tensors, tag=0):
        raise RuntimeError("ProcessGroupNCCL does not support recvAnysource: name the sender (src=...)")

    def monitored_barrier(self, *args, **kwargs):
        raise RuntimeError("monitored_barrier is only implemented for the GLOO backend")

    def barrier(self, opts=None):  # not dispatched: ProcessGroup's barrier makes its tensor on the CPU
        work = self._collective("barrier", [], lambda: self.gloo.barrier(dist.BarrierOptions()).wait(), [])
        work.blocking = True
        return work

    def allreduce(self, tensors, opts=None):
        work = self._allreduce(tensors, opts)
        with self._shown(work):
            super().allreduce(tensors, *_given(opts))
        return work

    def allreduce_coalesced(self, tensors, opts=None):
        work = self._allreduce(tensors, opts)
        with self._shown(work):
            super().allreduce_coalesced(tensors, *_given(opts))
        return work

    def _allreduce(self, tensors, opts) -> Work:
        op, average = _reduce(opts)

        def run():
            views = _views(tensors)
            self.gloo.allreduce(views, _options(dist.AllreduceOptions, reduceOp=op)).wait()
            for view in views if average else ():
                view.div_(self.size())
        return self._collective("all_reduce", tensors, run, tensors)

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        work = self._collective("broadcast", tensors, lambda: self.gloo.broadcast(
            _views(tensors), _options(dist.BroadcastOptions, rootRank=root, rootTensor=0)).wait(), tensors)
        with self._shown(work):
            super().broadcast(tensors, *_given(opts))
        return work

    def reduce(self, tensors, opts=None):
        op, average = _reduce(opts)

        def run():
            views = _views(tensors)
            self.gloo.reduce(views, _options(dist.ReduceOptions, reduceOp=op, rootRank=opts.rootRank)).wait()
            for view in views if average and self.rank() == opts.rootRank else ():
                view.div_(self.size())
        work = self._collective("reduce", tensors, run, tensors)
        with self._shown(work):
            super().reduce(tensors, opts)
        return work

    def allgather(self, output_lists, inputs, opts=None):
        outputs = [t for ts in output_lists for t in ts]
        work = self._collective("all_gather", [*inputs, *outputs], lambda: self.gloo.allgather(
            [_views(ts) for ts in output_lists], _views(inputs)).wait(), outputs)
        with self._shown(work):
            super().allgather(output_lists, inputs, *_given(opts))
        return work

    def all_gather_single(self, output, input, opts=None):
        work = self._all_gather_single([output], [input])
        with self._shown(work):
            super().all_gather_single(output, input, *_given(opts))
        return work

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        work = self._all_gather_single(outputs, inputs)
        with self._shown(work):
            super().all_gather_single_coalesced(outputs, inputs, *_given(opts))
        return work

    _allgather_base = all_gather_single  # the older name (not the other older ones: see the section's note)

    def _all_gather_single(self, outputs, inputs) -> Work:
        def run():
            for output, input in zip(_views(outputs), _views(inputs)):
                self.gloo._allgather_base(output, input).wait()
        return self._collective("all_gather_into_tensor", [*inputs, *outputs], run, outputs)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        op, average = _reduce(opts)
        inputs = [t for ts in input_lists for t in ts]

        def run():
            views = _views(outputs)
            self.gloo.reduce_scatter(views, [_views(ts) for ts in input_lists],
                                     _options(dist.ReduceScatterOptions, reduceOp=op)).wait()
            for view in views if average else ():
                view.div_(self.size())
        work = self._collective("reduce_scatter", [*inputs, *outputs], run, outputs)
        with self._shown(work):
            super().reduce_scatter(outputs, input_lists, *_given(opts))
        return work

    def reduce_scatter_single(self, output, input, opts=None):
        work = self._reduce_scatter_single([output], [input], opts)
        with self._shown(work):
            super().reduce_scatter_single(output, input, *_given(opts))
        return work

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        work = self._reduce_scatter_single(outputs, inputs, opts)
        with self._shown(work):
            super().reduce_scatter_single_coalesced(outputs, inputs, *_given(opts))
        return work

    _reduce_scatter_base = reduce_scatter_single

    def _reduce_scatter_single(self, outputs, inputs, opts) -> Work:
        op, average = _reduce(opts)

        def run():
            for output, input in zip(_views(outputs), _views(inputs)):
                self.gloo._reduce_scatter_base(output, input, _options(dist.ReduceScatterOptions, reduceOp=op)).wait()
                if average:
                    output.div_(self.size())
        return self._collective("reduce_scatter_tensor", [*inputs, *outputs], run, outputs)

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        work = self._collective("all_to_all_single", [input, output], lambda: self.gloo.alltoall_base(
            fgpu.cpu_view(output), fgpu.cpu_view(input), list(output_splits or []), list(input_splits or []),
            dist.AllToAllOptions()).wait(), [output])
        with self._shown(work):
            super().all_to_all_single(output, input, output_splits, input_splits, *_given(opts))
        return work

    def alltoall(self, outputs, inputs, opts=None):
        work = self._collective("all_to_all", [*inputs, *outputs], lambda: self.gloo.alltoall(
            _views(outputs), _views(inputs), dist.AllToAllOptions()).wait(), outputs)
        with self._shown(work):
            super().alltoall(outputs, inputs, *_given(opts))
        return work

    def gather(self, output_lists, inputs, opts=None):
        outputs = [t for ts in output_lists for t in ts]
        work = self._collective("gather", [*inputs, *outputs], lambda: self.gloo.gather(
            [_views(ts) for ts in output_lists], _views(inputs),
            _options(dist.GatherOptions, rootRank=opts.rootRank)).wait(), outputs)
        with self._shown(work):
            super().gather(output_lists, inputs, opts)
        return work

    def scatter(self, outputs, input_lists, opts=None):
        inputs = [t for ts in input_lists for t in ts]
        work = self._collective("scatter", [*inputs, *outputs], lambda: self.gloo.scatter(
            _views(outputs), [_views(ts) for ts in input_lists],
            _options(dist.ScatterOptions, rootRank=opts.rootRank)).wait(), outputs)
        with self._shown(work):
            super().scatter(outputs, input_lists, opts)
        return work


def _given(opts) -> tuple:
    """An operation's options as passed on to ProcessGroup's method: none where none were given."""
    return () if opts is None else (opts,)
