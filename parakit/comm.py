"""Communication, made visible: a meter for every collective and point-to-point call,
point-to-point calls posted in batches that NCCL cannot deadlock, and ring all-reduce built
from them.

    with CommLog() as log:
        dist.all_reduce(x)
    log.count("all_reduce"), log.nbytes("all_reduce"), log.measured_bytes(), log.wire_bytes()

Two byte counts sit side by side. `measured_bytes` is what the OS says this process wrote
during each call (gloo on CPU; see `written_bytes`); `wire_bytes` is a model: what the ring
(or chain) algorithm of `ring_bytes` would send. They agree for all_reduce and all_gather on
gloo; gloo's reduce_scatter writes twice the model (it reduces the whole tensor with an
all-reduce-like algorithm, then keeps its piece) and its broadcast is a tree (the root sends
to two ranks), while NCCL runs rings and chains close to the model, on the GPU, where the
OS counts nothing: there measured bytes are None and only the model is left.

The meter wraps the functions of `torch.distributed` (both `dist.X` and
`torch.distributed.distributed_c10d.X`) once, the first time it is used. Each wrapped call
is recorded as a `CommRecord` in every open `CommLog` and also moves `TRACKER`, which the
launcher reads to say where a rank waits when ranks hang. A call made from inside another
wrapped call (`all_gather_into_tensor` calling `all_gather_single`) is recorded once, as the
outer one. Collectives issued from C++ (the reducer of torch's DDP) are not seen.

`post_batch` posts sends and receives together (`dist.batch_isend_irecv`): NCCL runs a
batch as one group on the rank's one stream, so a ring whose every rank posts its step's
send and receive in one batch cannot wait in a cycle, where separate calls can (NCCL sets
up each pair of ranks at its first call and runs a send only once its receive is posted).
Its `wait` names the call it waits in to `TRACKER`, as a blocking call does.
"""
from __future__ import annotations

import inspect
import os
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["CommLog", "CommRecord", "ring_all_reduce", "all_reduce_two_phase", "ring_schedule", "ring_bytes",
           "written_bytes", "TRACKER", "post_batch", "P2PBatch"]

_PROC_IO = "/proc/self/io"
LAUNCHER_WRITES = [0]  # bytes parakit's launcher wrote from this process for itself (a rank's status answers)


def written_bytes() -> int | None:
    """Bytes this process has written so far, by the OS's count (`wchar` of /proc/self/io),
    less what parakit's launcher wrote for itself (`LAUNCHER_WRITES`: a worker's answers to
    "where are you?", which come only when a call runs long, so more on a loaded machine),
    or None where the platform has no such file (macOS, Windows).

    `wchar` counts every byte any thread of the process handed to write-like system calls
    (write, writev, send on a socket): gloo's TCP messages with their small headers, but also
    prints, pipes and files. It does not count bytes moved without such a call: NCCL's GPU
    transfers (copy engines, NVLink, RDMA), shared memory, or what the kernel resends.
    """
    try:
        with open(_PROC_IO, "rb") as f:
            for line in f:
                if line.startswith(b"wchar:"):
                    return int(line.split()[1]) - LAUNCHER_WRITES[0]
    except OSError:
        return None
    return None


@dataclass(frozen=True)
class CommRecord:
    """One call on this rank: `nbytes` is the size of the tensors this rank passes in
    (for all_gather its own input, for reduce_scatter the full input, for recv the buffer).

    `measured` is the bytes the process wrote while a blocking call ran (see `written_bytes`):
    every thread's writes, so async work in flight at the same time is counted in the call it
    overlaps. None, with the reason in `unmeasured`, where the OS cannot count them (NCCL,
    CUDA tensors, no /proc/self/io) and for an async call (isend, async_op=True), whose bytes
    may leave after it returns: `CommLog.written_bytes()` counts those over the whole block.
    `wire_bytes` (also `model_bytes`) is the ring model, not a measurement; for an all-to-all
    it is exact: the input less `stays`, the bytes addressed to this rank itself."""

    op: str
    nbytes: int
    group_size: int
    rank: int  # this rank's index in the group
    peer: int | None  # the other rank (global) of a send/recv, else None
    root: int | None  # src/dst of a rooted collective, as a rank in the group, else None
    seconds: float
    measured: int | None = None
    unmeasured: str = ""  # why `measured` is None
    stays: int | None = None  # all-to-all: the input's bytes for this rank itself
    group_ranks: tuple[int, ...] = ()  # the group's global ranks, ascending (() outside a process group)

    @property
    def wire_bytes(self) -> int:
        """Model: bytes this rank sends with the bandwidth-optimal (ring or chain) algorithm;
        an all-to-all sends every other rank its piece."""
        if self.stays is not None:
            return self.nbytes - self.stays if self.group_size > 1 else 0
        return ring_bytes(self.op, self.nbytes, self.group_size, self.rank, self.root)

    model_bytes = wire_bytes


def ring_bytes(op: str, nbytes: int, n: int, rank: int = 0, root: int | None = None) -> int:
    """Bytes one rank sends for `op` on `n` ranks in a ring (or chain) algorithm.

    all_reduce sends 2(n-1)/n of the tensor; reduce-scatter (n-1)/n of its full input;
    all-gather (n-1) times its own input; broadcast and reduce pass the whole tensor along
    a chain (the last rank of the chain sends nothing); gather sends the input to the root
    and scatter sends (n-1) pieces from the root.
    """
    kind = op.removeprefix("_").split("_base")[0]
    if kind in ("send", "isend"):
        return nbytes
    if n <= 1 or kind in ("recv", "irecv", "barrier"):
        return 0
    if kind == "all_reduce":
        return 2 * (n - 1) * nbytes // n
    if kind.startswith("reduce_scatter") or kind.startswith("all_to_all"):
        return (n - 1) * nbytes // n
    if kind.startswith("all_gather"):
        return (n - 1) * nbytes
    if kind in ("broadcast", "reduce"):
        last = ((root or 0) - 1) % n if kind == "broadcast" else root
        return 0 if rank == last else nbytes
    if kind == "gather":
        return 0 if rank == root else nbytes
    if kind == "scatter":
        return (n - 1) * nbytes if rank == root else 0
    raise ValueError(f"no ring model for op {op!r}")


class _Tracker:
    """Where this rank is in its communication: how many calls it made since `reset`, the
    call it is inside now (op, sequence number, peer of a send/recv or None, start time)
    or None, the last call it finished (op, sequence number, peer), and how many messages
    it sent to and posted receives for each peer: {("send" | "recv", global rank): count}."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.seq = 0
        self.current: tuple[str, int, int | None, float] | None = None
        self.last: tuple[str, int, int | None] | None = None
        self.messages: Counter = Counter()


TRACKER = _Tracker()
_OPEN_LOGS: list["CommLog"] = []
_WAIT_FOR_GPU = {"on": False}  # blocking calls wait for their GPU work (see install)
_thread = threading.local()  # .depth: 1 while this thread is inside a metered call

# op name -> (tensor arguments whose bytes count, name of the peer argument, name of the root argument)
_OPS = {
    "all_reduce": (("tensor",), None, None),
    "broadcast": (("tensor",), None, "src"),
    "reduce": (("tensor",), None, "dst"),
    "all_gather": (("tensor",), None, None),
    "all_gather_into_tensor": (("input_tensor",), None, None),
    "all_gather_single": (("input_tensor",), None, None),
    "_all_gather_base": (("input_tensor",), None, None),
    "reduce_scatter": (("input_list",), None, None),
    "reduce_scatter_tensor": (("input",), None, None),
    "reduce_scatter_single": (("input",), None, None),
    "_reduce_scatter_base": (("input",), None, None),
    "all_to_all": (("input_tensor_list",), None, None),
    "all_to_all_single": (("input",), None, None),
    "gather": (("tensor",), None, "dst"),
    "scatter": (("tensor",), None, "src"),
    "barrier": ((), None, None),
    "send": (("tensor",), "dst", None),
    "recv": (("tensor",), "src", None),
    "isend": (("tensor",), "dst", None),
    "irecv": (("tensor",), "src", None),
}


def _nbytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def _on_meta(bound, tensor_args) -> bool:
    tensors = [t for a in tensor_args for t in _tensors(bound.get(a))]
    return bool(tensors) and all(t.is_meta for t in tensors)


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _wrap(name: str, fn):
    tensor_args, peer_arg, root_arg = _OPS[name]
    signature = inspect.signature(fn)

    def metered(*args, **kwargs):
        if getattr(_thread, "depth", 0):  # called from inside another metered call: that one is recorded
            return fn(*args, **kwargs)
        bound = signature.bind_partial(*args, **kwargs).arguments if peer_arg or _OPEN_LOGS else {}
        peer = _rank_argument(bound, peer_arg, global_rank=True) if peer_arg else None
        TRACKER.seq += 1
        if peer_arg:
            TRACKER.messages["send" if "send" in name else "recv", peer] += 1
        current = TRACKER.current = (name, TRACKER.seq, peer, time.monotonic())
        _thread.depth = 1
        before = written_bytes() if _OPEN_LOGS else None
        work = None
        start = time.perf_counter()
        try:
            work = fn(*args, **kwargs)
            if (work is None or isinstance(work, int)) and _WAIT_FOR_GPU["on"]:  # blocking (recv: the sender)
                _wait_for_gpu(signature.bind_partial(*args, **kwargs).arguments, tensor_args)
            return work
        finally:
            seconds = time.perf_counter() - start
            after = written_bytes() if before is not None else None
            _thread.depth = 0
            TRACKER.last, TRACKER.current = current[:3], None
            if _OPEN_LOGS:
                bound = bound or signature.bind_partial(*args, **kwargs).arguments
                if not _on_meta(bound, tensor_args):  # meta tensors (shape propagation) move no bytes
                    record = _record(name, bound, tensor_args, peer, root_arg, seconds, before, after,
                                     asynchronous=isinstance(work, dist.Work))
                    for log in list(_OPEN_LOGS):
                        log.records.append(record)

    metered.__wrapped__ = fn
    metered.__doc__ = fn.__doc__
    metered.__name__ = fn.__name__
    metered.__qualname__ = fn.__qualname__
    metered.__module__ = fn.__module__
    metered._parakit_metered = True
    return metered


def _rank_argument(bound, name, global_rank: bool) -> int | None:
    """The rank named by argument `name` ("src", "dst") or by its "group_" form, as a
    global rank or as a rank in the call's group."""
    group = bound.get("group")
    value, group_value = bound.get(name), bound.get(f"group_{name}")
    if group is None or not dist.is_initialized():
        return value if value is not None else group_value
    if global_rank:
        return value if value is not None or group_value is None else dist.get_global_rank(group, group_value)
    return group_value if value is None else dist.get_group_rank(group, value)


def _record(name, bound, tensor_args, peer, root_arg, seconds, before, after, asynchronous) -> CommRecord:
    group = bound.get("group")
    in_group = dist.is_initialized()
    why = _unmeasurable(bound, tensor_args, group, in_group, before) or (ASYNC if asynchronous else "")
    return CommRecord(
        op=name,
        nbytes=sum(_nbytes(bound.get(a)) for a in tensor_args),
        group_size=dist.get_world_size(group) if in_group else 1,
        rank=dist.get_rank(group) if in_group else 0,
        peer=peer,
        root=_rank_argument(bound, root_arg, global_rank=False) if root_arg else None,
        seconds=seconds,
        measured=None if why else after - before,
        unmeasured=why,
        stays=_own_piece(name, bound, dist.get_rank(group) if in_group else 0,
                         dist.get_world_size(group) if in_group else 1),
        group_ranks=tuple(sorted(dist.get_process_group_ranks(group or dist.group.WORLD))) if in_group else (),
    )


def _own_piece(name, bound, rank: int, n: int) -> int | None:
    """An all-to-all's bytes addressed to `rank` itself (its own split), else None."""
    if name == "all_to_all":
        return _nbytes(bound["input_tensor_list"][rank])
    if name != "all_to_all_single":
        return None
    x, splits = bound["input"], bound.get("input_split_sizes")
    rows = splits[rank] if splits else x.shape[0] // n  # [rows, ...] split along dim 0
    return rows * (x[0].numel() if x.shape[0] else 0) * x.element_size()


ASYNC = ("async call (isend, irecv, async_op=True): its bytes may leave after it returns, inside other calls; "
         "CommLog.written_bytes() counts them over the whole block")


def _unmeasurable(bound, tensor_args, group, in_group, before) -> str:
    """Why the OS's write count cannot measure this call, or "" where it can."""
    if any(t.is_cuda for a in tensor_args for t in _tensors(bound.get(a))):
        return "CUDA tensors: NCCL moves them without a write() the OS counts; only the model is left"
    try:
        backend = dist.get_backend(group) if in_group else None
    except (RuntimeError, ValueError):  # a group this rank is not in
        backend = None
    if backend is not None and "gloo" not in str(backend):
        return f"backend {backend}: its transfers are not write() calls the OS counts; only the model is left"
    if before is None:
        return f"no {_PROC_IO} on this platform: the OS gives no per-process write count"
    return ""


def _wait_for_gpu(bound, tensor_args) -> None:
    """Block until the GPU has run what this call queued (NCCL returns at once)."""
    for tensor in (t for a in tensor_args for t in _tensors(bound.get(a))):
        if tensor.device.type not in ("cpu", "meta"):  # CUDA's, or the emulated box's (torch.fgpu)
            torch.get_device_module(tensor.device).current_stream(tensor.device).synchronize()
            return


def install(wait_for_gpu: bool | None = None) -> None:
    """Wrap torch.distributed's communication functions with the meter (idempotent).

    wait_for_gpu (left as it is when None; off at first): a blocking call (async_op=False)
    on CUDA tensors (or the emulated box's fgpu ones) returns only when the GPU has run it, as on
    gloo. The launcher's workers set it under NCCL (and the emulated NCCL) so that the meter's
    times are the collective's and ranks that hang in mismatched collectives wait inside
    the call, where the launcher can name it, instead of at some later synchronisation."""
    if wait_for_gpu is not None:
        _WAIT_FOR_GPU["on"] = wait_for_gpu
    for name in _OPS:
        fn = getattr(c10d, name, None)
        if fn is None or getattr(fn, "_parakit_metered", False):
            continue
        metered = _wrap(name, fn)
        setattr(c10d, name, metered)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, metered)


class CommLog:
    """Records every communication call this rank makes while the `with` block is open.

    Attributes: `records`, a list of CommRecord in call order. Bytes come two ways:
    `measured_bytes` (the OS's count of what the process wrote during each call, gloo only)
    and `wire_bytes` (the ring model). `written_bytes` is the OS's count over the whole block.
    """

    def __init__(self):
        self.records: list[CommRecord] = []
        self._written: list[int | None] = [None, None]  # written_bytes() at enter and exit

    def __enter__(self) -> "CommLog":
        install()
        self._written = [written_bytes(), None]
        _OPEN_LOGS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _OPEN_LOGS.remove(self)
        self._written[1] = written_bytes()

    def _select(self, op):
        ops = (op,) if isinstance(op, str) else op
        return [r for r in self.records if ops is None or r.op in ops]

    def count(self, op: str | tuple[str, ...] | None = None) -> int:
        """Number of calls (of `op`, or of any op)."""
        return len(self._select(op))

    def nbytes(self, op: str | tuple[str, ...] | None = None) -> int:
        """Tensor bytes passed in (of `op`, or of every call)."""
        return sum(r.nbytes for r in self._select(op))

    def wire_bytes(self, op: str | tuple[str, ...] | None = None) -> int:
        """Model: bytes this rank sends by the ring model for collectives, exactly for sends."""
        return sum(r.wire_bytes for r in self._select(op))

    model_bytes = wire_bytes

    def measured_bytes(self, op: str | tuple[str, ...] | None = None) -> int | None:
        """Bytes the OS counted this process writing during the calls (of `op`, or of every
        call), or None if any of them could not be measured (see `unmeasured`)."""
        values = [r.measured for r in self._select(op)]
        return None if None in values else sum(values)

    def unmeasured(self, op: str | tuple[str, ...] | None = None) -> str:
        """Why `measured_bytes(op)` is None ("" when it is not)."""
        return next((r.unmeasured for r in self._select(op) if r.unmeasured), "")

    def written_bytes(self) -> int | None:
        """Every byte the OS counted this process writing while the block was open (up to
        now if it still is): the calls' own bytes, plus whatever else it wrote (prints,
        files) and what async calls wrote after returning. None without /proc/self/io, or
        if a call in the block could not be measured (NCCL, CUDA tensors)."""
        if any(r.unmeasured and r.unmeasured != ASYNC for r in self.records):  # NCCL, another backend: unseen
            return None
        start, end = self._written[0], self._written[1] if self._written[1] is not None else written_bytes()
        return None if start is None or end is None else end - start

    def seconds(self, op: str | tuple[str, ...] | None = None) -> float:
        return sum(r.seconds for r in self._select(op))

    def summary(self) -> dict[str, dict[str, float]]:
        """{op: {"count", "nbytes", "wire_bytes", "seconds", "measured_bytes"}} in order of first
        use; "wire_bytes" is the ring model, "measured_bytes" the OS's count (None where a
        call could not be measured)."""
        rows: dict[str, dict[str, float]] = defaultdict(
            lambda: dict.fromkeys(("count", "nbytes", "wire_bytes", "seconds", "measured_bytes"), 0))
        for r in self.records:
            row = rows[r.op]
            row["count"] += 1
            row["nbytes"] += r.nbytes
            row["wire_bytes"] += r.wire_bytes
            row["seconds"] += r.seconds
            row["measured_bytes"] = None if row["measured_bytes"] is None or r.measured is None else row["measured_bytes"] + r.measured
        return dict(rows)

    def __repr__(self) -> str:
        parts = ", ".join(f"{op} x{int(row['count'])} ({int(row['nbytes'])} B)" for op, row in self.summary().items())
        return f"CommLog({parts or 'no calls'})"


_REDUCE = {
    dist.ReduceOp.SUM: torch.Tensor.add_,
    dist.ReduceOp.PRODUCT: torch.Tensor.mul_,
    dist.ReduceOp.MAX: lambda a, b: torch.maximum(a, b, out=a),
    dist.ReduceOp.MIN: lambda a, b: torch.minimum(a, b, out=a),
}


class P2PBatch:
    """Point-to-point calls posted together by `post_batch`, to wait on."""

    def __init__(self, works: list, calls: list[tuple], on_gpu: bool):
        self.works, self.on_gpu, self.done = works, on_gpu, False
        self.calls = calls  # (op, sequence number or None, global peer, how many such calls to that peer by then)

    def wait(self) -> None:
        """Wait for every call, the last posted first (under NCCL one Work covers the batch).
        While it waits, `TRACKER` names the call, as for a blocking call, where the
        launcher's hang check can judge it: when no later call of its kind to its peer was
        posted (the check counts every message posted to and from the peer). Under NCCL
        with the launcher's wait_for_gpu it returns only when the GPU has run the batch. A
        second wait returns at once."""
        if self.done:
            return
        calls = self.calls if len(self.works) == len(self.calls) else self.calls[-1:] * len(self.works)
        for work, call in reversed(list(zip(self.works, calls))):
            _wait_named(work, call, self.on_gpu and _WAIT_FOR_GPU["on"])
        self.done = True


def post_batch(ops: list[tuple[str, torch.Tensor, int]], group=None) -> P2PBatch:
    """Post `ops`, each ("send" | "recv", tensor, peer as a rank of `group`), as one
    `dist.batch_isend_irecv`: each send sends its tensor's bytes to its peer, each receive
    fills its tensor from its peer. Returns the P2PBatch to wait on. On the meta device (shape
    propagation, as `pipeline.activation_shapes` runs a stage) nothing is posted: no bytes."""
    if any(tensor.is_meta for _, tensor, _ in ops):
        return P2PBatch([], [], False)
    before = TRACKER.seq
    p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, group=group, group_peer=peer)
           for kind, tensor, peer in ops]
    works = dist.batch_isend_irecv(p2p) if p2p else []
    metered = TRACKER.seq - before == len(ops)
    calls = []
    for i, (kind, tensor, peer) in enumerate(ops):
        peer = dist.get_global_rank(group, peer) if group is not None else peer
        calls.append(("i" + kind, before + 1 + i if metered else None, peer,
                      TRACKER.messages[kind, peer] - sum(k == kind and q == peer for k, _, q in ops[i + 1:])))
    return P2PBatch(list(works), calls, any(t.device.type != "cpu" for _, t, _ in ops))  # CUDA's or fgpu's


def _wait_named(work, call, on_gpu: bool) -> None:
    op, seq, peer, nth = call
    kind = "send" if "send" in op else "recv"
    named = seq is not None and TRACKER.messages[kind, peer] == nth
    outer = TRACKER.current
    if named:
        TRACKER.current = (op, seq, peer, time.monotonic())
    try:
        work.wait()
        while on_gpu and not work.is_completed():  # NCCL's wait only makes the current stream wait
            time.sleep(0.0002)
    finally:
        TRACKER.current = outer


def ring_all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """All-reduce `tensor` in place with a ring of send/recv, and return it.

    The flat tensor is cut into n chunks (sizes differ by at most one element). In n-1
    reduce-scatter steps each rank sends one chunk to its right neighbour and adds the
    chunk it receives from the left; in n-1 all-gather steps the reduced chunks travel
    once around the ring. Each rank sends 2(n-1) chunks: 2(n-1)/n of the tensor's bytes.
    Each step's send and receive are posted as one batch.
    """
    if op not in _REDUCE:
        raise ValueError(f"ring_all_reduce supports SUM, PRODUCT, MAX and MIN, not {op}")
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return tensor
    flat = tensor.detach().reshape(-1).clone()  # [numel], contiguous
    chunks = flat.tensor_split(n)  # n views of ~numel/n elements
    right, left = (rank + 1) % n, (rank - 1) % n
    for phase, moves in ring_schedule(n):
        send, recv = (chunks[i] for i in moves[rank])
        if phase == "reduce-scatter":
            incoming = torch.empty_like(recv)
            _exchange(send, incoming, right, left, group)
            _REDUCE[op](recv, incoming)
        else:
            _exchange(send, recv, right, left, group)
    tensor.detach().copy_(flat.view_as(tensor))
    return tensor


def all_reduce_two_phase(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum `tensor` over the group in place as reduce-scatter then all-gather; return it.

    The flat tensor is zero-padded to a multiple of n; reduce-scatter leaves each rank the
    sum of its 1/n, all-gather brings the n sums back to every rank. Each rank sends
    (n-1)/n of the padded tensor in each phase: 2(n-1)/n in all, as in `ring_all_reduce`.
    """
    n = dist.get_world_size(group)
    flat = tensor.detach().reshape(-1)
    padded = torch.zeros(-(-flat.numel() // n) * n, dtype=flat.dtype, device=flat.device)  # [n * ceil(numel/n)]
    padded[: flat.numel()] = flat
    piece = torch.empty(padded.numel() // n, dtype=flat.dtype, device=flat.device)  # [ceil(numel/n)]
    dist.reduce_scatter_single(piece, padded, group=group)
    dist.all_gather_single(padded, piece, group=group)
    tensor.detach().copy_(padded[: flat.numel()].view_as(tensor))
    return tensor


def ring_schedule(n: int) -> list[tuple[str, list[tuple[int, int]]]]:
    """The 2(n-1) steps of ring all-reduce on n ranks, as data.

    Each step is (phase, moves) where moves[rank] = (chunk it sends right, chunk it
    receives from the left). After the n-1 "reduce-scatter" steps rank r holds the full
    sum of chunk (r+1) % n; the n-1 "all-gather" steps pass those sums around the ring.
    """
    reduce_scatter = [[((r - s) % n, (r - s - 1) % n) for r in range(n)] for s in range(n - 1)]
    all_gather = [[((r + 1 - s) % n, (r - s) % n) for r in range(n)] for s in range(n - 1)]
    return [("reduce-scatter", m) for m in reduce_scatter] + [("all-gather", m) for m in all_gather]


def _exchange(send: torch.Tensor, recv: torch.Tensor, right: int, left: int, group) -> None:
    """Send `send` to `right` while receiving `recv` from `left` (ranks of the group; both
    this many bytes), posted as one batch."""
    post_batch([("send", send, right), ("recv", recv, left)], group).wait()
