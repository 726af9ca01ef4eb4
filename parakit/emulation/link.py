"""This process's link to its emulated world's coordinator (`streams.Coordinator`): the
events of its ranks' operations go out, and the coordinator's answers come in, read by one
thread; the transfers the coordinator releases run on another, in the order released.

Made with the world's first emulated group (`connect`): rank 0 starts the coordinator and
puts its address in the store, and every rank's process links to it, once. At the
interpreter's exit the transfer thread finishes what was released to it and stops
(`_Link.close`), before the interpreter ends.

A third thread is NCCL's watchdog: an operation still pending when its group's timeout
(init_process_group's `timeout`) has passed since it was posted fails with the watchdog's
message, followed by the coordinator's account (`Streams.expired`). What follows is NCCL's
default (TORCH_NCCL_ASYNC_ERROR_HANDLING=3, or 1): the message goes to stderr and the
process aborts (SIGABRT, exit code -6), as the watchdog's rethrown error does. With
TORCH_NCCL_BLOCKING_WAIT=1 (or the handling 0 or 2) the process stays up, and the wait for
that operation, and every later one, raises the message instead (`EmulatedNCCLError`).
That is how a rank killed mid-collective shows: its peers are not told (NCCL cannot know),
and wait for their timeouts. A transfer that fails because a party's process ended is
taken as one that never completes, for the same reason. Rank 0's process holds the
coordinator: when it ends, nothing more runs in that world, every operation waiting for
its timeout (on NCCL only those involving rank 0 would).
"""
from __future__ import annotations

import atexit
import itertools
import multiprocessing.connection as mpc
import os
import pickle
import queue
import resource
import sys
import threading
import time
import weakref
from collections import defaultdict

import torch
import torch.distributed as dist

from parakit.emulation import gpu_streams
from parakit.emulation.streams import Coordinator, Entry, Item, comm_name

__all__ = ["EmulatedNCCLError", "LINK", "connect", "broken", "idle", "Op", "Work"]

LINK: list["_Link"] = []  # this process's link (made with its world's first emulated group)
GONE_NOTICE = 5.0  # seconds a failed transfer waits to hear that a party's process ended (then it is an error)
ACCOUNT_WAIT = 5.0  # seconds a watchdog waits for the coordinator's account of an expired operation
_OP_TYPES = {"all_reduce": "ALLREDUCE", "barrier": "ALLREDUCE", "all_gather": "ALLGATHER",
             "all_gather_into_tensor": "_ALLGATHER_BASE", "reduce_scatter": "REDUCE_SCATTER",
             "reduce_scatter_tensor": "_REDUCE_SCATTER_BASE", "all_to_all_single": "ALLTOALL_BASE",
             "all_to_all": "ALLTOALL"}  # NCCL's OpType where it is not the operation's name in capitals


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
            if self.link.outlived(self.entry.items[index].parties):
                return  # a party's process ended: as NCCL's kernel, this one never completes (see the watchdog)
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
    """This process's connection to the coordinator: events out; "run", "ready", "fault",
    "gone" and "account" in, read by one thread; released items run by another, in the order
    they come; a third is the watchdog."""

    def __init__(self, address, authkey: bytes, rank: int):
        self.conn, self.rank, self.lock = mpc.Client(address, authkey=authkey), rank, threading.Lock()
        self.ids = itertools.count()
        self.pending: dict[int, Op] = {}
        self.ready: dict[tuple, threading.Event] = defaultdict(threading.Event)
        self.runs: queue.SimpleQueue = queue.SimpleQueue()
        self.fault: str | None = None
        self.gone: dict[int, float] = {}  # rank -> when its process was seen to end (for messages, not acted on)
        self.noticed = threading.Condition()  # notified with each entry of `gone`
        self.accounts: queue.SimpleQueue = queue.SimpleQueue()  # the coordinator's answers to "expired"
        self.tears_down = _tears_down()
        self.posted, self.watching = threading.Event(), float("inf")  # the watchdog sleeps until `watching`
        self.conn.send(("hello", rank))
        threading.Thread(target=self._read, daemon=True, name="fnccl-reader").start()
        self.stream = threading.Thread(target=self._execute, daemon=True, name="fnccl-stream")
        self.stream.start()
        threading.Thread(target=self._watch, daemon=True, name="fnccl-watchdog").start()
        atexit.register(self.close)

    def send(self, event: tuple) -> None:
        with self.lock:
            try:
                self.conn.send(event)
            except OSError:  # the coordinator is gone: nothing runs now, the operations wait for their timeouts
                self._lost(0)

    def post(self, op: Op, timeout) -> None:
        """Post `op`; its group's watchdog catches it `timeout` (a timedelta) from now."""
        self._raise()
        op.posted, op.timeout = time.monotonic(), timeout.total_seconds()
        self.pending[op.entry.id] = op
        if op.posted + op.timeout < self.watching:
            self.posted.set()
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
                return self._lost(0)  # rank 0's process held the coordinator
            if kind == "run":
                self.runs.put(args)
            elif kind == "ready":
                self.ready[args[0]].set()
            elif kind == "gone":
                self._lost(args[0])
            elif kind == "account":
                self.accounts.put(args)
            else:
                self._broken(args[0])

    def _lost(self, rank: int) -> None:
        with self.noticed:
            self.gone.setdefault(rank, time.monotonic())
            self.noticed.notify_all()
        if rank == 0:
            self.accounts.put(None)  # a watchdog waiting for an account gets none

    def outlived(self, parties: tuple) -> bool:
        """Whether the process of one of `parties` ended (waiting up to GONE_NOTICE s to hear of it)."""
        others = set(parties) - {self.rank}
        with self.noticed:
            return bool(self.noticed.wait_for(lambda: others & self.gone.keys(), GONE_NOTICE))

    # -------------------------------------------------------------------------- the watchdog

    def _watch(self) -> None:
        """NCCL's watchdog: sleep until the first pending operation's deadline, woken by a post
        with an earlier one; expire every operation past its deadline."""
        while True:
            self.posted.clear()
            self.watching = float("inf")  # a post from here on wakes it
            deadlines = [op.posted + op.timeout for op in list(self.pending.values()) if not op.done.is_set()]
            self.watching = min(deadlines, default=float("inf"))
            if self.watching <= time.monotonic():
                self._expire(min((op for op in list(self.pending.values()) if not op.done.is_set()),
                                 key=lambda op: op.posted + op.timeout))
            else:
                self.posted.wait(None if self.watching == float("inf") else self.watching - time.monotonic())

    def _expire(self, op: Op) -> None:
        """`op` passed its timeout: NCCL's watchdog message and the coordinator's account, then
        the process ends (NCCL's default) or, without teardown, this world is broken."""
        text = self._timed_out(op)
        if self.tears_down:
            sys.stderr.write(f"{text}\nTo avoid data inconsistency, we are taking the entire process down.\n")
            sys.stderr.flush()
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # an abort, without a core file of the emulation
            os.abort()
        self._broken(text)

    def _timed_out(self, op: Op) -> str:
        """The watchdog's message for `op`, then what the coordinator knows of the ranks it waits for."""
        item = op.entry.items[0]
        kind = "COALESCED" if len(op.entry.items) > 1 else _OP_TYPES.get(item.what, item.what.split()[0].upper())
        ran = (time.monotonic() - op.posted) * 1000
        lines = [f"[Rank {self.rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={item.key[-1] + 1}, "
                 f"OpType={kind}, Timeout(ms)={op.timeout * 1000:.0f}) ran for {ran:.0f} milliseconds before timing "
                 f"out. It is this rank's {op.entry.label()} on {comm_name(op.entry.comm)}."]
        if 0 not in self.gone:
            self.send(("expired", op.entry.id))
            account = _get(self.accounts, ACCOUNT_WAIT)  # (entry id, text), or None
            lines += [account[1]] if account and account[0] == op.entry.id else []
        if 0 in self.gone:
            lines.append("emulated NCCL: rank 0's process ended, and with it the coordinator: no operation of this "
                         "world runs any more, and each waits until its timeout")
        return "\n".join(lines)

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


def _tears_down() -> bool:
    """Whether a timed-out operation ends the process, as NCCL's watchdog does unless told not to."""
    blocking = os.environ.get("TORCH_NCCL_BLOCKING_WAIT", "0") == "1"
    return not blocking and os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3") in ("1", "3")


def _get(answers: queue.SimpleQueue, timeout: float):
    try:
        return answers.get(timeout=timeout)
    except queue.Empty:
        return None


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
    """An operation's work. `wait()` as NCCL's: the current stream waits for the operation and
    the host goes on (the bytes arrive when the stream gets there); a barrier's (`blocking`)
    makes the host wait, as NCCL's barrier does."""
    blocking = False

    def __init__(self, op: Op):
        super().__init__()
        self.op = op

    def wait(self, timeout=None):
        if self.blocking or self.op.done.is_set():
            self.op.link.wait(self.op)  # its error, or the world's, raised here
        else:
            self.op.link._raise()
            gpu_streams.wait_op(self.op, self._settle)
        return True

    def _settle(self) -> None:
        """On the stream that waits: block until the operation has run; raise its error or the
        world's (the host raises it where it next waits for that stream)."""
        self.op.done.wait()
        if self.op.error is not None:
            raise self.op.error
        self.op.link._raise()

    def is_completed(self):
        return self.op.done.is_set()

    def get_future(self):
        return self.op.future
