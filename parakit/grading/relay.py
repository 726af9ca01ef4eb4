"""A process group whose every message goes through the judge: what a rank sends is what
the judge saw it send.

In a sealed run the ranks hold no connection to each other. Each holds one socket to the
judge's `Broker`, and `RelayGroup` (a torch.distributed backend, "relay") turns every call
(send, recv, all_reduce, all_gather, ..., issued from Python or from C++ such as DDP's
reducer) into a request on it: the op, the group's global ranks, the peer or root, and the
bytes of the tensors it passes in; `dist.batch_isend_irecv`'s parts go out between the
marks of one batch, as NCCL's group call. The broker (`broker.py`) answers each request, once
it has run by NCCL's rules, with the bytes of the call's outputs, which a reader thread copies
into the output tensors.

On the emulated GPU box (`connect(..., gpu=True)`, the rank's fgpu made current first) the
relay stands in for the emulated NCCL: registered as its backend, "fnccl", so that
`parakit.device()` is the rank's GPU, and refusing what NCCL refuses of a call's tensors (one
on the CPU or on another rank's GPU).

    in a rank: connect(path, rank, token); dist.init_process_group("relay", store=dist.HashStore(), ...)
"""
from __future__ import annotations

import functools
import itertools
import socket
import threading

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.futures import Future

from parakit import emulation
from parakit.grading.broker import REDUCE
from parakit.grading.codec import recv_frame, send_frame, tensor_bytes, tensor_from, tensor_meta

__all__ = ["RelayGroup", "connect", "backend", "BACKEND"]

BACKEND = "relay"


# ---------------------------------------------------------------------------- in a rank

class _Link:
    """This rank's socket to the broker: requests out, answers in on a reader thread. Each
    request and the first wait on its Work say which autograd node was running then (0:
    none, outside a backward), so the broker can tell a call that overlapped the backward."""

    def __init__(self, sock: socket.socket, device: torch.device | None):
        self.sock, self.lock, self.ids = sock, threading.Lock(), itertools.count()
        self.device = device  # the rank's GPU on the emulated box, whose tensors alone a call may pass; else None
        self.pending: dict[int, tuple[Future, list[torch.Tensor]]] = {}
        self.nodes: list = []  # the autograd nodes seen, kept alive so that each keeps its number
        threading.Thread(target=self._read, daemon=True, name="relay-reader").start()

    def request(self, header: dict, inputs: list[torch.Tensor], outputs: list[torch.Tensor]):
        """Send one call; the Work completes when the broker's answer is copied into `outputs`."""
        with self.lock:
            rid = next(self.ids)
            future = _NotedFuture(_Once(lambda: self.send({"wait": rid, "node": self.node()})))
            self.pending[rid] = (future, outputs)
            send_frame(self.sock, {**header, "id": rid, "node": self.node(), "inputs": [tensor_meta(t) for t in inputs],
                                   "outputs": [tensor_meta(t) for t in outputs]},
                       b"".join(tensor_bytes(t) for t in inputs))
        return _RelayWork(future)

    def node(self) -> int:
        """The running autograd node's number on this rank (1, 2, ... as first seen), 0 outside a backward."""
        current = torch._C._current_autograd_node()
        if current is None:
            return 0
        for number, seen in enumerate(self.nodes, 1):
            if seen is current:
                return number
        self.nodes.append(current)
        return len(self.nodes)

    def send(self, header: dict, payload: bytes = b"") -> None:
        with self.lock:
            send_frame(self.sock, header, payload)

    def _read(self):
        while (frame := recv_frame(self.sock)) is not None:
            self._complete(*frame)
            del frame  # hold nothing of an answer while waiting for the next

    def _complete(self, header: dict, payload: bytes) -> None:
        future, outputs = self.pending.pop(header["id"])
        _fill(outputs, header["outputs"], payload)
        future.set_result(outputs)


class _Once:
    """Calls `fn` the first time it is called, never again."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self):
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()


class _NotedFuture(Future):
    """A call's future: the first wait on it, or on its Work, tells the broker where the rank
    waited (a future chained from it with `then` is waited on later, out of sight: the call
    counts as in flight until the run's end)."""

    def __init__(self, noted: _Once):
        super().__init__()
        self.noted = noted

    def wait(self):
        self.noted()
        return super().wait()


class _RelayWork(dist.Work):
    """A call in flight, its future a `_NotedFuture`."""

    def __init__(self, future: _NotedFuture):
        super().__init__()
        self.future = future

    def wait(self, timeout=None):
        self.future.wait()
        return True

    def is_completed(self):
        return self.future.done()

    def get_future(self):
        return self.future


def _fill(outputs: list[torch.Tensor], metas: list[dict], payload: bytes) -> None:
    """Copy the answer's bytes into the call's output tensors, as a transport writes a
    buffer: autograd does not see it, and nothing of it stays alive here."""
    start = 0
    with torch.no_grad():
        for out, meta in zip(outputs, metas):
            value = tensor_from(meta, payload, start)
            out.copy_(value.view(out.shape))
            start += value.numel() * value.element_size()


_LINK: list[_Link] = []


def connect(path: str, rank: int, token: str, gpu: bool = False) -> _Link:
    """Open this rank's link to the broker at `path` and register the backend `backend(gpu)`:
    "relay", or with `gpu` (the emulated box installed, the rank's fgpu current) "fnccl"."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    send_frame(sock, {"hello": rank, "token": token})
    here = torch.device(emulation.DEVICE, emulation.fgpu.current_device()) if gpu else None
    _LINK[:] = [_Link(sock, here)]
    dist.Backend.register_backend(backend(gpu), _create, extended_api=True, devices=[emulation.DEVICE if gpu else "cpu"])
    dist.batch_isend_irecv = c10d.batch_isend_irecv = _batch_isend_irecv
    return _LINK[0]


def backend(gpu: bool) -> str:
    """The name a sealed rank's process group is made with: the emulated NCCL's on the GPU box."""
    return emulation.BACKEND if gpu else BACKEND


_POSTS = c10d.batch_isend_irecv  # torch's: each part posted by itself on a group that cannot coalesce


@functools.wraps(_POSTS)
def _batch_isend_irecv(p2p_op_list):
    """torch's batch_isend_irecv, its operations marked as one batch for the broker."""
    _LINK[0].send({"batch": "begin"})
    try:
        return _POSTS(p2p_op_list)
    finally:
        _LINK[0].send({"batch": "end"})


def _create(options, _backend_options):
    ranks = list(options.global_ranks_in_group) or list(range(options.group_size))
    return RelayGroup(options.group_rank, options.group_size, ranks)


def _reduce_name(op) -> str:
    for name in REDUCE:
        if op == getattr(dist.ReduceOp, name):
            return name
    raise ValueError(f"reduce op {op} is not supported in a sealed run: use SUM, AVG, PRODUCT, MIN or MAX")


def _on_device(op: str, tensors: list[torch.Tensor]) -> None:
    """On the emulated box, NCCL's rule for a call's tensors: each on this rank's GPU."""
    for tensor in tensors if _LINK[0].device is not None else ():
        emulation.nccl.refuse_off_device(tensor, _LINK[0].device, op, dist.get_rank())


class RelayGroup(dist.ProcessGroup):
    """A process group of the global `ranks`, every call a request to the broker."""

    def __init__(self, rank: int, size: int, ranks: list[int]):
        super().__init__(rank, size)
        self.ranks = ranks

    def getBackendName(self):
        return backend(_LINK[0].device is not None)

    def _call(self, op, inputs, outputs, **fields):
        _on_device(op, [*inputs, *outputs])
        return _LINK[0].request({"op": op, "ranks": self.ranks, **fields}, list(inputs), list(outputs))

    def send(self, tensors, dst, tag=0):
        return self._call("send", tensors, [], peer=self.ranks[dst], tag=tag)

    def recv(self, tensors, src, tag=0):
        return self._call("recv", [], tensors, peer=self.ranks[src], tag=tag)

    def allreduce(self, tensors, opts=None):
        return self._call("all_reduce", tensors, tensors, reduce=_reduce_name(opts.reduceOp) if opts else "SUM")

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts else 0
        return self._call("broadcast", tensors if self.rank() == root else [], tensors, root=root)

    def reduce(self, tensors, opts=None):
        root = opts.rootRank if opts else 0
        return self._call("reduce", tensors, tensors if self.rank() == root else [], root=root,
                          reduce=_reduce_name(opts.reduceOp) if opts else "SUM")

    def allgather(self, output_lists, inputs, opts=None):
        return self._call("all_gather", inputs, [t for ts in output_lists for t in ts])

    def _allgather_base(self, output, input, opts=None):
        return self._call("all_gather", [input], list(output.chunk(self.size())))

    def all_gather_single(self, output, input, opts=None):
        return self._allgather_base(output, input, opts)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        return self._call("reduce_scatter", [t for ts in input_lists for t in ts], outputs,
                          reduce=_reduce_name(opts.reduceOp) if opts else "SUM")

    def _reduce_scatter_base(self, output, input, opts=None):
        return self._call("reduce_scatter", list(input.chunk(self.size())), [output],
                          reduce=_reduce_name(opts.reduceOp) if opts else "SUM")

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter_base(output, input, opts)

    def alltoall_base(self, output, input, output_splits, input_splits, opts=None):
        n = self.size()
        ins = input.split(list(input_splits) or [input.shape[0] // n] * n)
        outs = output.split(list(output_splits) or [output.shape[0] // n] * n)
        return self._call("all_to_all", ins, outs)

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        return self.alltoall_base(output, input, output_splits or [], input_splits or [], opts)

    def alltoall(self, outputs, inputs, opts=None):
        return self._call("all_to_all", inputs, outputs)

    def gather(self, output_lists, inputs, opts=None):
        return self._call("gather", inputs, [t for ts in output_lists for t in ts], root=opts.rootRank)

    def scatter(self, outputs, input_lists, opts=None):
        return self._call("scatter", [t for ts in input_lists for t in ts], outputs, root=opts.rootRank)

    def barrier(self, opts=None):
        return self._call("barrier", [], [])
