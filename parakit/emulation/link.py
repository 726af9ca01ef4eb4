"""This process's link to its emulated world's coordinator (`streams.Coordinator`): the
events of its ranks' operations go out, and the coordinator's answers come in, read by one
thread; the transfers the coordinator releases run on another, in the order released.

Made with the world's first emulated group (`connect`): rank 0 starts the coordinator and
puts its address in the store, and every rank's process links to it, once. At the
interpreter's exit the transfer thread finishes what was released to it and stops
(`_Link.close`), before the interpreter ends.
"""
from __future__ import annotations

import atexit
import itertools
import multiprocessing.connection as mpc
import os
import pickle
import queue
import threading
import weakref
from collections import defaultdict

import torch
import torch.distributed as dist

from parakit.emulation.streams import Coordinator, Entry, Item

__all__ = ["EmulatedNCCLError", "LINK", "connect", "broken", "idle", "Op", "Work"]

LINK: list["_Link"] = []  # this process's link (made with its world's first emulated group)


class EmulatedNCCLError(RuntimeError):
    """An operation NCCL would hang in (or a rule it breaks), found by the coordinator."""


def connect(store, rank: int, size: int) -> None:
    """Rank 0 starts the coordinator and puts its address in the store; every rank links to it."""
    world = dist.get_world_size() if dist.is_initialized() else size
    if size != world:
        raise ValueError(f"the first emulated NCCL group of a world must hold all its {world} ranks, not {size}: "
                         f"make the default group 'fnccl', or a new_group of every rank first")
    if rank == 0:
        authkey = os.urandom(16)
        store.set("fnccl/coordinator", pickle.dumps((Coordinator(size, authkey).address, authkey)))
    address, authkey = pickle.loads(store.get("fnccl/coordinator"))
    LINK[:] = [_Link(address, authkey, rank)]


def broken() -> str | None:
    """Why this process's emulated world can no longer communicate, or None."""
    return LINK[0].fault if LINK else None


def idle(flag: bool, task: int) -> None:
    """Tell the coordinator this rank has returned from launched call number `task` (it posts
    nothing more until the next), or starts it: ranks left waiting for it are told at once."""
    if LINK and not LINK[0].fault:
        LINK[0].send(("idle", flag, task))


class Op:
    """One entry of this rank's stream: its items' transfers, run on the link's thread."""

    def __init__(self, entry: Entry, link: "_Link"):
        self.entry, self.link = entry, link
        self.runs, self.outputs, self.left = [], [], 0
        self.done, self.error = threading.Event(), None
        self.future = _Future(self)

    def add(self, item: Item, run, outputs) -> None:
        self.entry.items.append(item)
        self.runs.append(run)
        self.outputs += outputs
        self.left += 1

    def run(self, index: int) -> None:
        try:
            self.runs[index]()
        except BaseException as error:  # raised where the rank waits
            self.error = self.error or error
        self.left -= 1
        if not self.left:
            self.finish()

    def finish(self) -> None:
        self.link.pending.pop(self.entry.id, None)
        self.runs = []  # the transfers, and the tensors they hold, go now: only the outputs stay, in the future
        self.done.set()
        if self.error is None:
            self.future.set_result(self.outputs)
        else:
            self.future.set_exception(self.error)


class _Link:
    """This process's connection to the coordinator: events out; "run", "ready" and "fault"
    in, read by one thread; released items run by another, in the order they come."""

    def __init__(self, address, authkey: bytes, rank: int):
        self.conn, self.rank, self.lock = mpc.Client(address, authkey=authkey), rank, threading.Lock()
        self.ids = itertools.count()
        self.pending: dict[int, Op] = {}
        self.ready: dict[tuple, threading.Event] = defaultdict(threading.Event)
        self.runs: queue.SimpleQueue = queue.SimpleQueue()
        self.fault: str | None = None
        self.send(("hello", rank))
        threading.Thread(target=self._read, daemon=True, name="fnccl-reader").start()
        self.stream = threading.Thread(target=self._execute, daemon=True, name="fnccl-stream")
        self.stream.start()
        atexit.register(self.close)

    def send(self, event: tuple) -> None:
        with self.lock:
            self.conn.send(event)

    def post(self, op: Op) -> None:
        self._raise()
        self.pending[op.entry.id] = op
        self.send(("post", op.entry))

    def setup(self, comm: tuple, members: tuple, device: str) -> None:
        """Make communicator `comm`: blocks until every member has begun it, as ncclCommInitRank does."""
        self._raise()
        self.send(("setup", comm, members, device))
        self.ready[comm].wait()
        self._raise()

    def wait(self, op: Op) -> None:
        """Block until `op` has run; raise its error, or the coordinator's if it never will."""
        if not op.done.is_set():
            self._raise()
            self.send(("wait", op.entry.id))
            op.done.wait()
        if op.error is not None:
            raise op.error
        self._raise()

    def _raise(self) -> None:
        if self.fault is not None:
            raise EmulatedNCCLError(self.fault)

    def _read(self) -> None:
        while True:
            try:
                kind, *args = self.conn.recv()
            except (EOFError, OSError):
                return self._broken("the emulated NCCL's coordinator is gone (rank 0's process ended)")
            if kind == "run":
                self.runs.put(args)
            elif kind == "ready":
                self.ready[args[0]].set()
            else:
                self._broken(args[0])

    def _broken(self, text: str) -> None:
        self.fault = self.fault or text
        for event in [*self.ready.values(), *(op.done for op in list(self.pending.values()))]:
            event.set()

    def _execute(self) -> None:
        for entry_id, index in iter(self.runs.get, None):  # None: `close`
            self.pending[entry_id].run(index)

    def close(self, timeout: float = 60) -> None:
        """At exit: run the transfers released so far, then end the transfer thread. Left
        running, it may be in torch's C++ code, the GIL released (a gloo transfer, completing
        an operation's future and its callbacks: `Op.finish` wakes the waiter first), when the
        interpreter ends; Python ends a thread that takes the GIL back then with pthread_exit,
        whose unwinding through C++ aborts the process ("terminate called without an active
        exception", exit code -6)."""
        self.runs.put(None)
        self.stream.join(timeout)


class _Future(torch.futures.Future):
    """An operation's future; waiting on it waits as `Work.wait` does (told to the coordinator)."""

    def __init__(self, op: Op):
        super().__init__()
        self.op = weakref.ref(op)  # no cycle: a finished operation's tensors die with its last reference

    def wait(self):
        op = self.op()
        if op is not None:
            op.link.wait(op)
        return super().wait()


class Work(dist.Work):
    def __init__(self, op: Op):
        super().__init__()
        self.op = op

    def wait(self, timeout=None):
        self.op.link.wait(self.op)
        return True

    def is_completed(self):
        return self.op.done.is_set()

    def get_future(self):
        return self.op.future
