"""`parakit.launch`: run a function on N ranks from a notebook or a script.

    results = parakit.launch(fn, x, world_size=4)   # fn(x) on ranks 0..3, results in rank order

The ranks are a warm pool of worker processes (started by a forkserver that has imported
torch, never by forking the caller), each already in a process group (NCCL with one GPU per
rank where there are enough GPUs, else gloo on CPU; see `parakit.devices`); the forkserver
is torch.multiprocessing's. The function and its arguments travel by value (cloudpickle), so
functions and classes defined in a notebook cell work, but the bytes of their tensors travel
through shared memory (`parakit._shm`): written once, mapped by every rank. Each tensor in
the arguments, inside any object, arrives on the rank's device: under NCCL rank r's GPU r
(whatever device it had here: a notebook's cuda:0 tensor reaches rank 2 on cuda:2), under
gloo the CPU (a GPU tensor is copied there). Each rank's arguments are its own: a rank that
writes into one in place gets a private copy of the pages it writes, and neither the caller
nor the other ranks see the change. Results come back on the CPU, detached, inside any
object (lists, dicts of every kind, dataclasses, named tuples, modules), their tensors'
bytes through shared memory too. The shared files are removed when the call ends, however
it ends. While the ranks run, their output is printed here, each line prefixed by its rank.

When something goes wrong the call raises a `LaunchError` that says what each rank did:
the traceback of each rank that raised, how a dead rank died, or, for ranks that hang in
collectives that cannot complete, the op and sequence number each one waits in and the line
of code where it waits. Then the ranks are stopped and the next call starts a fresh pool.
Interrupting the caller (Ctrl-C, Jupyter's stop button) stops every rank.
"""
from __future__ import annotations

import atexit
import contextlib
import inspect
import itertools
import linecache
import multiprocessing.connection as mpc
import os
import pickle
import signal
import sys
import time
from collections import OrderedDict, deque

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parakit import _shm, _worker, emulation
from parakit.devices import accelerator, device, resolve_backend, select_backend

__all__ = ["launch", "device", "shutdown", "pool_generation", "LaunchError", "RankError", "RankDied", "CollectiveHang",
           "LaunchTimeout", "EmulatedHang"]

DEFAULT_TIMEOUT = 120.0
HANG_GRACE = 1.5  # seconds every unfinished rank waits in a collective that cannot complete
FAILURE_GRACE = 0.5  # seconds the other ranks get to report after one rank fails
STATUS_AFTER = 0.3  # a call running this long starts asking the ranks where they are
STATUS_EVERY = 0.4
START_TIMEOUT = 120.0
MAX_POOL_WORKERS = 16  # pools beyond this many live workers in all: the oldest is stopped


class LaunchError(RuntimeError):
    """A launched call failed. `failures` maps a rank to what went wrong there."""

    def __init__(self, message: str, failures: dict[int, str] | None = None):
        super().__init__(message)
        self.failures = failures or {}


class RankError(LaunchError):
    """One or more ranks raised an exception (each traceback is in the message)."""


class RankDied(LaunchError):
    """A rank's process ended (os._exit, a signal, a crash in C++) during the call."""


class CollectiveHang(LaunchError):
    """The ranks wait in collectives that cannot complete (mismatched or missing calls)."""


class LaunchTimeout(LaunchError, TimeoutError):
    """The call ran longer than its timeout."""


class EmulatedHang(CollectiveHang, RankError):
    """The emulated NCCL stopped ranks that NCCL would leave hanging (`parakit.emulation`):
    a CollectiveHang, that the ranks raised."""


def launch(fn, *args, world_size: int, backend: str = "auto", timeout: float = DEFAULT_TIMEOUT):
    """Run `fn(*args)` on `world_size` ranks and return the list of their results.

    Inside `fn`, torch.distributed is initialised (rank, world size, default group) and the
    torchrun variables RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set.
    `backend` is "auto", "gloo" or "nccl"; `timeout` is in seconds. Sends every rank the
    pickled call, its tensors' bytes once through shared memory for all ranks; each rank gets
    them on its own device (`parakit.device()`), and every result comes back on the CPU.
    The process groups `fn` makes (`dist.new_group`, a device mesh) are destroyed when it
    returns; those of a call that raised stay until the pool stops.
    """
    __tracebackhide__ = True
    _check_arguments(world_size, timeout)
    backend = resolve_backend(backend, world_size)
    task_id = next(_task_ids)
    with _shm.removed_after(f"parakit-{os.getpid()}-{task_id}-") as prefix:
        blob = _pickle_task(fn, args, prefix + "a")
        return _pool(world_size, backend).run(task_id, prefix, blob, float(timeout))


def shutdown(world_size: int | None = None) -> None:
    """Stop every pool's workers, or only the pools of `world_size` ranks (they restart on the
    next call)."""
    for (size, _), pool in list(_POOLS.items()):
        if world_size in (None, size):
            pool.stop()


def _check_arguments(world_size, timeout) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__} {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


def _pickle_task(fn, args, prefix) -> bytes:
    """(fn, args) by value, their CPU tensors' bytes in shared-memory files named prefix*."""
    if not callable(fn):
        raise TypeError(f"launch needs a function to run on every rank, got {type(fn).__name__} {fn!r}")
    try:
        return _shm.dumps((fn, args), prefix)
    except OSError:
        raise  # no space left in shared memory, say: not a pickling problem
    except Exception as error:
        raise TypeError(f"cannot send {_unsendable(fn, args)} to the ranks: it cannot be pickled "
                        f"({type(error).__name__}: {error}). Pass tensors and plain values; create "
                        f"locks, files, sockets and streams inside the function.") from None


def _unsendable(fn, args) -> str:
    """Names the first of `fn` and its arguments that cannot be pickled."""
    name = getattr(fn, "__name__", repr(fn))
    for position, arg in enumerate(args):
        try:
            _shm.check_picklable(arg)
        except Exception:
            return f"argument {position}{_parameter_name(fn, position)} of {name!r}, a {_type_name(arg)},"
    return f"{name!r} and its arguments"


def _parameter_name(fn, position) -> str:
    """' (name)' of `fn`'s positional parameter at `position`, or '' where it has none."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return ""
    names = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return f" ({names[position]})" if position < len(names) else ""


def _type_name(value) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


_task_ids = itertools.count(1)
_POOLS: "OrderedDict[tuple[int, str], _Pool]" = OrderedDict()


def _pool(world_size: int, backend: str) -> "_Pool":
    """The live pool for this world size and backend (started if there is none); least
    recently used pools are stopped while more than MAX_POOL_WORKERS workers would live."""
    key = (world_size, backend)
    pool = _POOLS.get(key)
    if pool is None:
        while _POOLS and sum(p.world_size for p in _POOLS.values()) + world_size > MAX_POOL_WORKERS:
            next(iter(_POOLS.values())).stop()
        pool = _POOLS[key] = _Pool(world_size, backend)
    _POOLS.move_to_end(key)
    return pool


def pool_generation(world_size: int, backend: str) -> int | None:
    """Which start of the live pool for `world_size` ranks and `backend` ("gloo" or "nccl")
    this is, counting every pool started in this process, or None if none lives: a changed
    number means new rank processes, so whatever earlier calls left on the ranks is gone."""
    pool = _POOLS.get((world_size, backend))
    return pool.generation if pool else None


def _context():
    """torch.multiprocessing's forkserver (spawn where there is none), preloading torch so
    workers start fast."""
    if "forkserver" in mp.get_all_start_methods():
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(["torch", "torch.distributed", "cloudpickle", "parakit._worker"])
        return context
    return mp.get_context("spawn")


@contextlib.contextmanager
def _main_module_hidden():
    """Start workers without multiprocessing re-running the caller's script in them: the
    function travels by value, so the workers never need the caller's __main__."""
    main = sys.modules["__main__"]
    saved = {name: main.__dict__.pop(name) for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


class _Rank:
    """The caller's handles on one worker: process, control connection, output pipes."""

    def __init__(self, rank, process, conn, out, err):
        self.rank, self.process, self.conn = rank, process, conn
        self.streams = {out: ("stdout", bytearray()), err: ("stderr", bytearray())}
        self.tail: deque[str] = deque(maxlen=20)  # last lines printed, for death reports
        self.dead = False  # its death was reported (its sentinel stays ready from then on)

    def pump(self, reader) -> None:
        """Print what `reader` holds now, each complete line prefixed by the rank."""
        target, pending = self.streams[reader]
        try:
            while chunk := os.read(reader.fileno(), 1 << 16):
                pending += chunk
        except BlockingIOError:
            pass
        except OSError:
            return
        *lines, rest = pending.split(b"\n")
        pending[:] = rest
        self._print(target, lines)

    def flush(self) -> None:
        for reader, (target, pending) in self.streams.items():
            self.pump(reader)
            if pending:
                self._print(target, [bytes(pending)])
                pending.clear()

    def _print(self, target, lines) -> None:
        if not lines:
            return
        text = [line.decode(errors="replace") for line in lines]
        self.tail.extend(text)
        stream = getattr(sys, target)  # looked up now: a notebook swaps it per cell
        stream.write("".join(f"[rank {self.rank}] {line}\n" for line in text))
        stream.flush()


class _Pool:
    """`world_size` warm workers in one process group, and the calls made on them."""

    _ids = itertools.count(1)

    def __init__(self, world_size: int, backend: str):
        self.world_size, self.backend = world_size, backend
        self.gpus = accelerator()[1]  # the emulated box's GPUs, for "fnccl"
        if backend == emulation.BACKEND:
            emulation.install(self.gpus)  # results may hold fgpu devices
        self.generation = next(self._ids)
        self.sent_sources: set[str] = set()
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        _shm.remove_orphans()
        context = _context()
        self.ranks = [self._start_rank(context, rank) for rank in range(world_size)]
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _start_rank(self, context, rank) -> _Rank:
        conn, child_conn = context.Pipe(duplex=True)
        out, out_w = context.Pipe(duplex=False)
        err, err_w = context.Pipe(duplex=False)
        process = context.Process(
            target=_worker.main, name=f"parakit-rank-{rank}",
            args=(rank, self.world_size, self.backend, self.gpus, self.store.port, child_conn, out_w, err_w,
                  START_TIMEOUT),
        )
        with _main_module_hidden():
            process.start()
        for end in (child_conn, out_w, err_w):
            end.close()
        for reader in (out, err):
            os.set_blocking(reader.fileno(), False)
        return _Rank(rank, process, conn, out, err)

    def _wait_ready(self) -> None:
        waiting, deadline = set(range(self.world_size)), time.monotonic() + START_TIMEOUT
        while waiting:
            if time.monotonic() > deadline:
                raise LaunchError(f"ranks {sorted(waiting)} did not start within {START_TIMEOUT:.0f} s")
            for rank, kind, message in self._events(1.0):
                if kind == "message" and message[0] == "ready":
                    waiting.discard(rank)
                elif kind == "died":
                    self.flush_output()
                    raise RankDied(f"rank {rank} died while starting: {_how_it_died(message)}\n"
                                   + "\n".join(self.ranks[rank].tail), {rank: _how_it_died(message)})

    def _events(self, timeout):
        """Wait up to `timeout` s; print output; yield (rank, "message"|"died", payload)."""
        handles = {}
        for r in self.ranks:
            handles[r.conn] = (r, "conn")
            if not r.dead:
                handles[r.process.sentinel] = (r, "sentinel")
            for reader in r.streams:
                handles[reader] = (r, "output")
        for ready in mpc.wait(list(handles), timeout):
            r, kind = handles[ready]
            if kind == "output":
                r.pump(ready)
            elif kind == "conn":
                try:
                    yield r.rank, "message", pickle.loads(r.conn.recv_bytes())
                except (EOFError, OSError):
                    pass  # the sentinel reports the death
            else:
                r.process.join(1.0)
                r.flush()
                r.dead = True
                yield r.rank, "died", r.process.exitcode

    def flush_output(self) -> None:
        for r in self.ranks:
            r.flush()

    def run(self, task_id: int, prefix: str, blob: bytes, timeout: float) -> list:
        """Send every rank the task (`blob`; its results go to files named prefix*) and
        return their results."""
        call = _Call(self, task_id, timeout)
        message = pickle.dumps(("run", task_id, (os.getcwd(), list(sys.path), self._new_sources(), prefix, blob)))
        try:
            for r in self.ranks:
                r.tail.clear()  # a death report shows this call's output only
                r.conn.send_bytes(message)
            return call.collect()
        except LaunchError:
            raise  # the call stopped the pool already where its process group is out of step
        except BaseException:  # KeyboardInterrupt included: no rank may run on
            self.stop()
            raise

    def _new_sources(self) -> dict[str, list[str]]:
        """Notebook cells' source lines the workers have not seen, for their tracebacks."""
        sources = {name: entry[2] for name, entry in list(linecache.cache.items())
                   if len(entry) == 4 and entry[1] is None and name not in self.sent_sources}
        self.sent_sources.update(sources)
        return sources

    def ask_status(self, ranks) -> None:
        for rank in ranks:
            try:
                self.ranks[rank].conn.send_bytes(pickle.dumps(("status",)))
            except OSError:
                pass

    def stop(self) -> None:
        """Kill every worker, close every pipe, socket and sentinel now (a failed call's
        traceback may keep this object alive), and forget this pool."""
        if _POOLS.get((self.world_size, self.backend)) is self:
            del _POOLS[(self.world_size, self.backend)]
        for r in getattr(self, "ranks", []):
            if r.process.is_alive():
                r.process.kill()
        for r in getattr(self, "ranks", []):
            r.process.join(5.0)
            r.flush()
            for handle in (r.conn, *r.streams):
                handle.close()
            if r.process.exitcode is not None:
                r.process.close()
        self.ranks, self.store = [], None


class _Call:
    """One call on a pool: gathers results, output and status; finds failures and hangs."""

    def __init__(self, pool: _Pool, task_id: int, timeout: float):
        self.pool, self.timeout, self.task_id = pool, timeout, task_id
        self.start = time.monotonic()
        self.replies: dict[int, tuple] = {}  # rank -> (kind, payload, calls, messages per peer)
        self.deaths: dict[int, int | None] = {}  # rank -> exit code
        self.status: dict[int, dict] = {}  # rank -> latest answer to "where are you?"
        self.failed_at: float | None = None
        self.last_ask = 0.0

    def unfinished(self) -> list[int]:
        return [r for r in range(self.pool.world_size) if r not in self.replies and r not in self.deaths]

    def collect(self) -> list:
        while self.unfinished():
            now = time.monotonic()
            if self.failed_at is not None and now - self.failed_at > FAILURE_GRACE:
                break
            if now - self.start > self.timeout:
                raise self._hang_error(LaunchTimeout, f"the call did not finish within its timeout of {self.timeout:g} s")
            if now - self.start > STATUS_AFTER and now - self.last_ask > STATUS_EVERY:
                self._ask()
            for rank, kind, payload in self.pool._events(0.05 if now - self.start > STATUS_AFTER else 0.5):
                self._record(rank, kind, payload)
            if self.failed_at is None and self._hung():
                raise self._hang_error(CollectiveHang, "the ranks wait in collectives that cannot complete")
        self.pool.flush_output()
        return self._result()

    def _refresh_status(self) -> None:
        """Ask the unfinished ranks where they are and wait up to 1 s for their answers."""
        self._ask()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and any(
                self.status.get(r, {}).get("received", 0) < self.last_ask for r in self.unfinished()):
            for rank, kind, payload in self.pool._events(0.05):
                self._record(rank, kind, payload)

    def _ask(self) -> None:
        self.last_ask = time.monotonic()
        self.pool.ask_status(self.unfinished())

    def _record(self, rank, kind, payload) -> None:
        if kind == "died":
            self.deaths[rank] = payload
        elif payload[0] == "status":
            if payload[1]["task"] in (self.task_id, None):
                self.status[rank] = dict(payload[1], received=time.monotonic())
            return
        elif payload[0] == "done" and payload[1] == self.task_id:
            self.replies[rank] = payload[2:]
            if payload[2] == "ok":
                return
        else:
            return
        if self.failed_at is None:
            self.failed_at = time.monotonic()
            self._ask()  # so the report can say where the others wait

    def _hung(self) -> bool:
        """Every unfinished rank has waited HANG_GRACE s in a communication call (by fresh
        reports), and none of them can complete it, judged from what each rank has called
        (see `can_complete`): not from time alone, so a rank slowed by a loaded machine is
        not taken for a hung one."""
        waiting = self.unfinished()
        fresh = {r: self.status.get(r) for r in waiting}
        if not waiting or any(s is None or s["current"] is None or s["received"] < self.last_ask
                              or s["waiting"] < HANG_GRACE for s in fresh.values()):
            return False
        calls = {r: (reply[2], reply[3]) for r, reply in self.replies.items()}
        calls.update({r: (s["current"][1], s["messages"]) for r, s in fresh.items()})
        current = {r: s["current"] for r, s in fresh.items()}
        return not any(can_complete(r, current, calls) for r in waiting)

    def _hang_error(self, kind, headline) -> LaunchError:
        self._refresh_status()
        lines = [f"{headline} (after {time.monotonic() - self.start:.1f} s):"]
        lines += [self._describe(rank) for rank in range(self.pool.world_size)]
        if kind is CollectiveHang:
            lines.append("Every rank must make the same collective calls in the same order.")
        lines.append("The ranks were stopped; the next call starts them again.")
        self.pool.stop()
        return kind("\n".join(lines), {r: self._describe(r) for r in self.unfinished()})

    def _describe(self, rank) -> str:
        if rank in self.deaths:
            return f"  rank {rank} died: {_how_it_died(self.deaths[rank])}"
        if rank in self.replies:
            kind, _, calls, _ = self.replies[rank]
            verb = "returned" if kind == "ok" else "raised"
            return f"  rank {rank} {verb} after {calls} communication call(s)"
        status = self.status.get(rank)
        if status is None:
            return f"  rank {rank} did not answer"
        where = "\n".join(f"      {line}" for line in status["stack"][-3:])
        if status["current"] is None:
            return f"  rank {rank} runs code outside any collective, after {status['calls']} call(s)\n{where}"
        op, seq, peer = status["current"]
        towards = "" if peer is None else f" ({'to' if 'send' in op else 'from'} rank {peer})"
        return f"  rank {rank} waits in {op} #{seq}{towards} for {status['waiting']:.1f} s, at\n{where}"

    def _result(self) -> list:
        if not self.deaths and all(reply[0] == "ok" for reply in self.replies.values()):
            return [_shm.loads(self.replies[r][1], shared=True) for r in range(self.pool.world_size)]
        error = self._failure_error()
        calls = {reply[2] for reply in self.replies.values()}
        broken = any(reply[0] == "broken" for reply in self.replies.values())  # an emulated NCCL that hung
        if self.deaths or self.unfinished() or len(calls) > 1 or broken:
            self.pool.stop()  # the process group may be out of step: start afresh next call
        raise error

    def _failure_error(self) -> LaunchError:
        """Deaths first, then tracebacks; errors that only echo a death get one line. Ranks
        that all stopped where NCCL would hang (the emulated NCCL's error): a CollectiveHang."""
        failed = {r: reply for r, reply in self.replies.items() if reply[0] != "ok"}
        if failed and not self.deaths and all(reply[0] == "broken" for reply in failed.values()):
            return _emulated_hang(failed)
        failures = {r: _how_it_died(code) for r, code in self.deaths.items()}
        failures.update({r: reply[1] for r, reply in self.replies.items() if reply[0] != "ok"})
        culprits = sorted(self.deaths) or sorted(failures)
        verb = "died" if self.deaths else "failed"
        lines = [f"rank{'s' if len(culprits) > 1 else ''} {', '.join(map(str, culprits))} {verb}:"]
        for rank in sorted(self.deaths):
            tail = "\n".join(self.pool.ranks[rank].tail if self.pool.ranks else [])
            lines.append(f"--- rank {rank} died: {failures[rank]}" + (f"; its last output:\n{tail}" if tail else ""))
        for rank in sorted(set(failures) - set(self.deaths)):
            text = failures[rank].rstrip()
            if self.deaths:  # most likely "connection reset by peer": say it in one line
                text = text.splitlines()[-1] + "  (after another rank died)"
            lines.append(f"--- rank {rank}:\n{text}")
        if self.unfinished():
            self._refresh_status()  # answers taken when the failure came may be a moment old
        others = [self._describe(r) for r in self.unfinished()]
        if others:
            lines += ["while the other ranks waited:"] + others
        return (RankDied if self.deaths else RankError)("\n".join(lines), failures)


def _emulated_hang(failed: dict[int, tuple]) -> EmulatedHang:
    """The emulated NCCL's account of the hang (every stopped rank got the same one)."""
    text = next(iter(failed.values()))[1].rstrip().rsplit("EmulatedNCCLError: ", 1)[-1]
    return EmulatedHang(f"{text}\nThe ranks were stopped; the next call starts them again.",
                          {rank: text for rank in failed})


def can_complete(rank: int, current: dict[int, tuple], calls: dict[int, tuple[int, dict]]) -> bool:
    """Whether `rank`, waiting in current[rank] = (op, seq, peer), can still complete it.

    current: the call each waiting rank is in; calls: every rank's (calls made, counting the
    one it waits in, {("send" | "recv", peer): messages}), the returned ranks' final. A recv
    completes when the peer has sent it at least as many messages as it has posted receives
    for; a send when the peer has posted as many receives; a collective (op, seq) when every
    other rank has made at least `seq` calls and, if it waits at `seq` itself, in the same op.
    """
    op, seq, peer = current[rank]
    if peer is not None:
        mine, want = ("recv", "send") if op in ("recv", "irecv") else ("send", "recv")
        return calls[peer][1].get((want, rank), 0) >= calls[rank][1].get((mine, peer), 0)
    for other, (made, _) in calls.items():
        if other != rank and (made < seq or made == seq and other in current and current[other][0] != op):
            return False
    return True


def _how_it_died(exitcode) -> str:
    if exitcode is None:
        return "its process vanished"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name}" + (" (an abort, often a crash in C++ code)" if name == "SIGABRT" else "")
    return f"exited with code {exitcode}"


atexit.register(shutdown)
