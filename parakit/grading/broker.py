"""The judge's end of the relay: every message of a sealed run's ranks comes here.

The `Broker` listens on a Unix socket for the ranks of one run, each proving its rank with
a token. It runs their requests by NCCL's rules (`parakit.emulation.streams`, one stream per
group, as NCCL's communicators with device_id given): a rank's calls on a group run in the
order it posted them, a collective when every member has reached it, a send only with its
receive (the n-th send from one rank to another on a group with the n-th receive), and a
`batch_isend_irecv` as one batch whose parts match one by one. It computes each collective
itself, answers each rank with the bytes of its outputs when its call has run, and keeps,
per rank, the list of calls it made (`Call`, a batch's parts marked with its number). Calls
that cannot all run end the run with the reason: ranks in different collectives, ranks
waiting on each other in an order NCCL would hang in (a ring whose sends and receives are
posted apart), a rank waiting on one that has returned or died, or every live rank
waiting, idle, on the others.

    broker = Broker(path, tokens); broker.serve(done, idle_ranks); broker.calls[rank] -> [Call, ...]
"""
from __future__ import annotations

import selectors
import socket
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from parakit import comm
from parakit.emulation.streams import Entry, Item, Streams
from parakit.grading.codec import (DTYPES, MAX_PAYLOAD, CodecError, recv_frame, send_frame, tensor_bytes, tensor_from,
                                  tensor_meta)

__all__ = ["Broker", "Call", "REDUCE"]

MAX_NOTES = 1000  # notes kept per rank: a rank that floods notes is not read further
REDUCE = {"SUM": torch.sum, "AVG": torch.mean, "PRODUCT": torch.prod,
          "MIN": lambda x, dim: x.amin(dim), "MAX": lambda x, dim: x.amax(dim)}


@dataclass(frozen=True)
class Call:
    """One call a rank made, as the broker saw it: `nbytes` counts the tensors the rank
    passed in (for recv the buffer it asked for), `wire_bytes` what it sends in a ring
    (comm's model: the relay moves the bytes itself, so this is what gloo's ring would send)."""

    op: str
    ranks: tuple[int, ...]
    peer: int | None
    root: int | None
    nbytes: int
    wire_bytes: int
    batch: int | None = None  # the number of the rank's batch_isend_irecv it was posted in (0, 1, ...)
    alongside: tuple[int, ...] = ()  # the rank's earlier calls (their indices) in flight as it was posted: not waited for


@dataclass
class _Request:
    rank: int
    rid: int
    header: dict
    inputs: list[torch.Tensor]
    item: Item | None = None


class Broker:
    """Listens on a Unix socket for one rank per token (each proving its rank with its
    token), serves their calls and records them. `serve(done, idle_ranks)` serves until
    `done()` is true, every rank has hung up, or the calls cannot complete (then `failure`
    says why). A rank's frame holds at most `max_payload` bytes of data and, once begun,
    arrives whole within `frame_timeout` s, or its connection is dropped (the judge may lower both)."""

    max_payload = MAX_PAYLOAD
    frame_timeout = 30.0

    def __init__(self, path: str, tokens: list[str]):
        self.tokens, self.world_size = tokens, len(tokens)
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(path)
        self.server.listen(len(tokens) + 4)
        self.calls: list[list[Call]] = [[] for _ in tokens]
        self.results: dict[int, tuple[dict, bytes]] = {}
        self.notes: dict[int, list[str]] = defaultdict(list)
        self.failure: str | None = None
        self.gone: set[int] = set()
        self._socks: dict[int, socket.socket] = {}
        self.streams = Streams(len(tokens))
        self._made: dict[tuple, int] = defaultdict(int)          # (rank, comm, kind, peer) -> calls made
        self._posted: dict[tuple, _Request] = {}                 # (rank, item key) -> request not yet run
        self._entries: dict[int, dict[int, int]] = defaultdict(dict)  # rank -> request id -> its entry's id
        self._parts: dict[tuple, list[_Request]] = defaultdict(list)  # (rank, entry id) -> its requests, in order
        self._batch: dict[int, Entry] = {}                       # rank -> its batch being posted
        self._batches: dict[int, int] = defaultdict(int)         # rank -> batches begun
        self._ran: dict[tuple, dict[int, _Request]] = defaultdict(dict)  # item key -> party -> request run
        self._waiting: dict[int, dict[int, _Request]] = defaultdict(dict)  # rank -> request id -> request
        self._events: dict[int, list[tuple[int, int, int]]] = defaultdict(list)  # rank -> (call index or -1, request id, node)
        self._call_of: dict[int, dict[int, int]] = defaultdict(dict)  # rank -> request id -> its index in calls[rank]
        self._unwaited: dict[int, dict[int, None]] = defaultdict(dict)  # rank -> ids of its calls not yet waited for
        self.last_activity = time.monotonic()

    # -- serving
    def serve(self, done, idle_ranks=lambda: set(), quiet: float = 2.0) -> None:
        """Serve until done() (checked every 50 ms), the calls fail, or every rank hung up.
        `idle_ranks()` names the ranks using no CPU: when every rank still connected waits,
        idle, on calls nothing can complete for `quiet` s, the run fails as a deadlock."""
        sel = selectors.DefaultSelector()
        sel.register(self.server, selectors.EVENT_READ, None)
        try:
            while self.failure is None and not done():
                for key, _ in sel.select(timeout=0.05):
                    if key.data is None:
                        sock, _ = self.server.accept()
                        sel.register(sock, selectors.EVENT_READ, [None])
                    else:
                        self._on_readable(sel, key)
                if len(self.gone) == self.world_size:
                    break
                self._check_stuck(idle_ranks, quiet)
        finally:
            sel.close()

    def close(self) -> None:
        for sock in [self.server, *self._socks.values()]:
            sock.close()

    def _on_readable(self, sel, key) -> None:
        sock, state = key.fileobj, key.data
        try:
            frame = recv_frame(sock, max_payload=self.max_payload, timeout=self.frame_timeout)
        except (CodecError, OSError) as error:
            frame = None
            if state[0] is not None:
                self.notes[state[0]].append(f"its connection to the judge broke: {error}")
        if frame is None:
            sel.unregister(sock)
            sock.close()
            if state[0] is not None:
                self._hung_up(state[0])
            return
        self.last_activity = time.monotonic()
        header, payload = frame
        if state[0] is None:
            rank = header.get("hello")
            if type(rank) is int and 0 <= rank < self.world_size and header.get("token") == self.tokens[rank] \
                    and rank not in self._socks:
                state[0] = rank
                self._socks[rank] = sock
            else:
                sel.unregister(sock)
                sock.close()
            return
        try:
            self._on_frame(state[0], header, payload)
        except (CodecError, KeyError, TypeError, ValueError, IndexError, RuntimeError) as error:
            self.failure = f"rank {state[0]} sent a malformed call ({type(error).__name__}: {error})"

    def _on_frame(self, rank: int, header: dict, payload: bytes) -> None:
        if "result" in header:
            if rank not in self.results:
                self.results[rank] = (header["result"], payload)
                self._apply(self.streams.idle(rank, True, 0))  # it posts nothing more
            return
        if "batch" in header:
            self._on_batch(rank, header["batch"])
            return
        if "note" in header:
            if len(self.notes[rank]) < MAX_NOTES:
                self.notes[rank].append(str(header["note"])[:2000])
            return
        if "wait" in header:
            rid = int(header["wait"])
            self._events[rank].append((-1, rid, int(header.get("node", 0))))
            self._unwaited[rank].pop(rid, None)
            if rid in self._entries[rank]:
                self._apply(self.streams.wait(rank, self._entries[rank][rid]))
            return
        inputs, start = [], 0
        for meta in header["inputs"]:
            t = tensor_from(meta, payload, start)
            inputs.append(t)
            start += t.numel() * t.element_size()
        request = _Request(rank, int(header["id"]), header, inputs)
        ranks = tuple(int(r) for r in header["ranks"])
        if rank not in ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < self.world_size for r in ranks):
            raise ValueError(f"group {list(ranks)} does not hold rank {rank}")
        op = header["op"]
        if op not in _COLLECTIVES and op not in ("send", "recv"):
            raise ValueError(f"unknown op {op!r}")
        alongside = tuple(self._call_of[rank][rid] for rid in self._unwaited[rank])
        self._call_of[rank][request.rid] = len(self.calls[rank])
        self._unwaited[rank][request.rid] = None
        self._events[rank].append((len(self.calls[rank]), request.rid, int(header.get("node", 0))))
        self._record(rank, op, ranks, header, inputs, alongside)
        self._post(request, ranks)

    def _record(self, rank, op, ranks, header, inputs, alongside: tuple[int, ...]) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in inputs)
        if op in ("recv", "broadcast"):
            nbytes = sum(_meta_bytes(m) for m in header["outputs"])
        if op in ("all_gather", "gather"):
            nbytes = sum(t.numel() * t.element_size() for t in inputs[:1])
        n, me = len(ranks), ranks.index(rank)
        root = header.get("root")
        peer = header.get("peer")
        model = comm.ring_bytes(op, nbytes, n, me, root)
        batch = self._batches[rank] - 1 if rank in self._batch else None
        self.calls[rank].append(Call(op, ranks, peer, root, nbytes, model, batch, alongside))

    def overlapped(self, rank: int) -> list[bool]:
        """For each call of `rank`: whether its backward went on while it was in flight, that
        is, whether the rank reached another autograd node (a later gradient's hook, say)
        between the call's start and its first wait (or the run's end). A blocking call, or
        one started at the backward's last hook and waited for after it, did not."""
        events = self._events[rank]
        first_wait: dict[int, int] = {}
        for position, (index, rid, _) in enumerate(events):
            if index < 0:
                first_wait.setdefault(rid, position)
        ahead: list[tuple[int, int]] = []  # the nearest later events of two different nodes (not 0)
        reached = [len(events)] * len(events)  # position of the first later event at a node other than 0 and its own
        for position in range(len(events) - 1, -1, -1):
            node = events[position][2]
            later = next((p for n, p in ahead if n != node), len(events))
            reached[position] = later
            if node:
                ahead = [(node, position)] + [(n, p) for n, p in ahead if n != node][:1]
        flags = [False] * len(self.calls[rank])
        for position, (index, rid, _) in enumerate(events):
            if index >= 0:
                flags[index] = reached[position] <= first_wait.get(rid, len(events) - 1)
        return flags

    # -- posting and running, by NCCL's rules
    def _post(self, request: _Request, ranks: tuple) -> None:
        """Put `request` on its rank's stream of its group (in the open batch, if one is)."""
        rank, op, comm_key = request.rank, request.header["op"], (ranks, "all")
        if op in ("send", "recv"):
            peer = int(request.header["peer"])
            if peer == rank or peer not in ranks:
                raise ValueError(f"rank {rank}'s {op} names rank {peer}, not another rank of group {list(ranks)}")
            src, dst = (rank, peer) if op == "send" else (peer, rank)
            n = self._count(rank, comm_key, op, peer)
            what = f"send to rank {peer}" if op == "send" else f"recv from rank {peer}"
            request.item = Item((comm_key, "p2p", src, dst, n), (src, dst), what)
        else:
            n = self._count(rank, comm_key, "coll", None)
            request.item = Item((comm_key, "coll", n), ranks, op)
        self._posted[rank, request.item.key] = request
        self._waiting[rank][request.rid] = request
        batch = self._batch.get(rank)
        if batch is None:
            self._entries[rank][request.rid] = request.rid
            self._parts[rank, request.rid].append(request)
            self._apply(self.streams.post(rank, Entry(rank, request.rid, comm_key, [request.item])))
            return
        if batch.items and batch.comm != comm_key:
            raise ValueError(f"rank {rank}'s batch mixes groups {list(batch.comm[0])} and {list(ranks)}")
        if not batch.items:
            batch.id, batch.comm = request.rid, comm_key
        self._entries[rank][request.rid] = batch.id
        self._parts[rank, batch.id].append(request)
        batch.items.append(request.item)

    def _count(self, rank: int, comm_key: tuple, kind: str, peer: int | None) -> int:
        """How many calls of this kind (to this peer) `rank` made on the group before: this one's number."""
        n = self._made[rank, comm_key, kind, peer]
        self._made[rank, comm_key, kind, peer] = n + 1
        return n

    def _on_batch(self, rank: int, mark: str) -> None:
        """A batch_isend_irecv begins (its parts come next) or ends: posted as one entry."""
        if mark == "begin" and rank not in self._batch:
            self._batches[rank] += 1
            self._batch[rank] = Entry(rank, -1, None)
        elif mark == "end" and rank in self._batch:
            batch = self._batch.pop(rank)
            if batch.items:
                self._apply(self.streams.post(rank, batch))
        else:
            raise ValueError(f"a batch {mark!r} out of place")

    def _apply(self, messages: list) -> None:
        """Act on what the streams say: run the items released (each once all its parties have), or fail."""
        for target, message in messages:
            if message[0] == "fault":
                self.failure = self.failure or message[1]
            elif message[0] == "run":
                request = self._parts[target, message[1]][message[2]]
                item = request.item
                del self._posted[target, item.key]
                ran = self._ran[item.key]
                ran[target] = request
                if len(ran) == len(item.parties):
                    del self._ran[item.key]
                    self._run([ran[party] for party in item.parties])

    def _run(self, members: list[_Request]) -> None:
        """A released item: a send's bytes to its receive, or a collective computed."""
        if members[0].item.key[1] == "p2p":
            send, recv = members
            self._answer(send, [])
            shapes = [_meta_numel(m) for m in recv.header["outputs"]]
            if [t.numel() for t in send.inputs] != shapes:
                self.failure = (f"rank {recv.rank} receives {shapes} elements from rank {send.rank}, "
                                f"which sent {[t.numel() for t in send.inputs]}")
                return
            self._answer(recv, send.inputs)
        else:
            self._complete(members)

    def _complete(self, members: list[_Request]) -> None:
        """A collective every member reached (the same op: the streams fail a mismatch), computed."""
        op = members[0].header["op"]
        try:
            outputs = _COLLECTIVES[op](members)
        except (RuntimeError, ValueError, IndexError) as error:
            self.failure = f"the ranks' {op} calls do not fit together: {error}"
            return
        for member, out in zip(members, outputs):
            self._answer(member, out)

    def _answer(self, request: _Request, tensors: list[torch.Tensor]) -> None:
        self._waiting[request.rank].pop(request.rid, None)
        metas = request.header["outputs"]
        if len(tensors) != len(metas) or any(t.numel() != _meta_numel(m) for t, m in zip(tensors, metas)):
            self.failure = (f"rank {request.rank}'s {request.header['op']} expects outputs of "
                            f"{[_meta_numel(m) for m in metas]} elements; the call makes {[t.numel() for t in tensors]}")
            return
        outs = [t.to(_dtype(m)).reshape(-1) for t, m in zip(tensors, metas)]
        sock = self._socks.get(request.rank)
        if sock is None:
            return
        try:
            send_frame(sock, {"id": request.rid, "outputs": [tensor_meta(t) for t in outs]},
                       b"".join(tensor_bytes(t) for t in outs))
        except OSError:
            pass

    # -- failure
    def _hung_up(self, rank: int) -> None:
        self.gone.add(rank)
        self._waiting.pop(rank, None)
        if rank not in self.results:
            self._apply(self.streams.idle(rank, True, 0))  # died: it posts nothing more

    def _check_stuck(self, idle_ranks, quiet: float) -> None:
        """A waiting rank whose peer (or a member of its collective) has hung up without
        posting its side can never go on; neither can ranks that all wait, idle, with nothing
        moving (the streams report the cycles as soon as the last rank of one waits)."""
        for rank, waits in list(self._waiting.items()):
            for request in waits.values():
                for other in request.item.parties:
                    if other in self.gone and (other, request.item.key) not in self._posted \
                            and other not in self._ran.get(request.item.key, {}):
                        self.failure = (f"rank {rank} waits in {request.item.what}, but rank {other} has already "
                                        f"returned or died")
                        return
        live = [r for r in range(self.world_size) if r not in self.gone and r in self._socks]
        waiting = [r for r in live if self._waiting.get(r)]
        if live and waiting == live and time.monotonic() - self.last_activity > quiet \
                and set(live) <= idle_ranks():
            self.failure = "deadlock: " + "; ".join(
                f"rank {r} waits in {', '.join(q.item.what for q in self._waiting[r].values())}" for r in live)


def _dtype(meta):
    return DTYPES[meta["dtype"]]


def _meta_numel(meta) -> int:
    n = 1
    for s in meta["shape"]:
        n *= int(s)
    return n


def _meta_bytes(meta) -> int:
    return _meta_numel(meta) * _dtype(meta).itemsize


def _stack(tensors):
    return torch.stack([t.reshape(-1) for t in tensors])


def _reduce(tensors, name):
    stacked = _stack(tensors)
    if name == "AVG" and not stacked.is_floating_point():
        raise ValueError("AVG of integer tensors")
    return REDUCE[name](stacked, dim=0)


def _all_reduce(members):
    n = len(members[0].inputs)
    sums = [_reduce([m.inputs[i] for m in members], members[0].header["reduce"]) for i in range(n)]
    return [sums for _ in members]


def _broadcast(members):
    root = members[0].header["root"]
    return [members[root].inputs for _ in members]


def _reduce_to_root(members):
    root = members[0].header["root"]
    total = _all_reduce(members)[0]
    return [total if i == root else [] for i in range(len(members))]


def _all_gather(members):
    pieces = [m.inputs[0] for m in members]
    return [pieces for _ in members]


def _reduce_scatter(members):
    name = members[0].header["reduce"]
    return [[_reduce([m.inputs[i] for m in members], name)] for i in range(len(members))]


def _all_to_all(members):
    return [[m.inputs[i] for m in members] for i in range(len(members))]


def _gather(members):
    root = members[0].header["root"]
    pieces = [m.inputs[0] for m in members]
    return [pieces if i == root else [] for i in range(len(members))]


def _scatter(members):
    root = members[0].header["root"]
    return [[members[root].inputs[i]] for i in range(len(members))]


_COLLECTIVES = {"all_reduce": _all_reduce, "broadcast": _broadcast, "reduce": _reduce_to_root,
                "all_gather": _all_gather, "reduce_scatter": _reduce_scatter, "all_to_all": _all_to_all,
                "gather": _gather, "scatter": _scatter, "barrier": lambda members: [[] for _ in members]}
