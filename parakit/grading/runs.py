"""Runs of a job on fresh ranks, and what comes back from them.

`Runner(config)` owns one zygote; `run(job, world_size, timeout)` forks the ranks, serves
their calls through a new broker until each has sent its result (or the calls fail, or the
time is up), kills every process left and returns a `Run`: each rank's result decoded as
plain data, the calls the broker saw, the notes the ranks sent, and why it failed.
"""
from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass, field

from parakit.grading import codec, isolation, sandbox
from parakit.grading.broker import Broker, Call

__all__ = ["JudgeConfig", "Run", "Runner", "outcome"]


@dataclass
class JudgeConfig:
    """How the judge runs: per-cell timeout (a student's cell gets ten times the solution's
    own time for it, at least `cell_floor`, at most `cell_timeout`; a check's run ten times the
    reference's, at least `cell_floor` or the check's own smaller timeout), the course's folders a
    student's rank may not read, where scratch folders go, the salt that makes inputs
    unguessable, and whether a student's ranks are confined by the operating system."""

    cell_timeout: float = 300.0
    hidden: list[str] = field(default_factory=list)
    scratch: str | None = None
    salt: str = "parakit"
    confine: bool = True  # a student's ranks in the OS's walls (`isolation`) where the machine allows
    cell_floor: float = 15.0


@dataclass
class Run:
    """What came back from one run on fresh ranks."""

    values: list[dict | None]       # per rank: {"value": ...} or {"error": text, "tripwire": bool}, or None
    calls: list[list[Call]]
    notes: list[list[str]]
    failure: str | None = None
    overlapped: list[list[bool]] | None = None  # per rank and call: the backward went on while it was in flight
    note_seconds: list[float] = field(default_factory=list)  # per_note runs: how long before each of rank 0's notes


class Runner:
    """Runs jobs on fresh ranks of one zygote, each job with its own broker."""

    def __init__(self, config: JudgeConfig):
        self.config, self.zygote = config, sandbox.Zygote()
        self.unsealed = isolation.unavailable() if config.confine else "confinement was switched off"

    def close(self):
        self.zygote.close()

    def run(self, job: sandbox.Job, world_size: int, timeout, per_note: bool = False) -> Run:
        """`job` on `world_size` new ranks; at most `timeout` s (with `per_note`, counted
        from the last note a rank sent: a cell's time, for a job that reports its cells; a
        list then gives each cell its own, the last for any beyond). `timeout` may be a
        function, asked again at each look: a limit that can still grow."""
        folder = tempfile.mkdtemp(prefix="sealed-", dir=self.config.scratch)
        try:
            tokens = [secrets.token_hex(16) for _ in range(world_size)]
            broker = Broker(os.path.join(folder, "broker"), tokens)
            pids = []
            for rank in range(world_size):
                scratch = os.path.join(folder, f"rank{rank}")
                os.mkdir(scratch)
                pids.append(self.zygote.fork({"rank": rank, "world_size": world_size, "path": broker.server.getsockname(),
                                              "token": tokens[rank], "scratch": scratch, "job": job,
                                              "confine": self.unsealed is None}))
            clock = _Clock(timeout, broker, per_note)
            broker.serve(lambda: len(broker.results) == world_size or clock.expired(), _IdleWatch(pids))
            self.zygote.sweep()
            broker.close()
            values = [_decode(broker.results.get(r)) for r in range(world_size)]
            failure = broker.failure
            if failure is None and clock.expired() and None in values:
                failure = f"did not finish within {clock.limit():g} s"
            for rank, value in enumerate(values):
                if value is None and failure is None:
                    failure = f"rank {rank} ended without a result: its process died{_tail(folder, rank)}"
            return Run(values, broker.calls, [broker.notes.get(r, []) for r in range(world_size)], failure,
                       [broker.overlapped(r) for r in range(world_size)], clock.note_seconds)
        finally:
            shutil.rmtree(folder, ignore_errors=True)


class _Clock:
    """The run's limit, and with per_note each of rank 0's notes' time since the one before
    (as the broker's loop sees them: to its polling interval)."""

    def __init__(self, timeout, broker, per_note):
        if isinstance(timeout, (list, tuple)):
            self.limit = lambda: timeout[min(self.seen, len(timeout) - 1)]
        else:
            self.limit = timeout if callable(timeout) else lambda: timeout
        self.broker, self.per_note = broker, per_note
        self.start, self.seen, self.note_seconds = time.monotonic(), 0, []

    def expired(self) -> bool:
        if self.per_note and len(self.broker.notes.get(0, [])) != self.seen:
            now = time.monotonic()
            self.note_seconds += [now - self.start] + [0.0] * (len(self.broker.notes[0]) - self.seen - 1)
            self.seen, self.start = len(self.broker.notes[0]), now
        return time.monotonic() - self.start > self.limit()


class _IdleWatch:
    """Which ranks used no CPU since the last look (read from /proc by the judge)."""

    def __init__(self, pids):
        self.pids, self.last = pids, {}

    def __call__(self) -> set[int]:
        idle = set()
        for rank, pid in enumerate(self.pids):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                ticks = int(fields[11]) + int(fields[12])
            except (OSError, IndexError, ValueError):
                idle.add(rank)
                continue
            if self.last.get(rank) == ticks:
                idle.add(rank)
            self.last[rank] = ticks
        return idle


def _decode(frame):
    """A rank's result frame as plain data (None: no frame)."""
    if frame is None:
        return None
    try:
        return codec.decode(*frame)
    except codec.CodecError as error:
        return {"error": f"its result could not be read as plain data ({error})", "tripwire": False}


def outcome(value) -> dict:
    """{"value": ...} or {"error": text, "tripwire": bool}, whatever a rank sent."""
    if isinstance(value, dict) and set(value) == {"value"}:
        return value
    if isinstance(value, dict) and set(value) == {"error", "tripwire"} and isinstance(value["error"], str):
        return {"error": value["error"], "tripwire": value["tripwire"] is True}
    return {"error": "it sent back something the grader did not make", "tripwire": False}


def _tail(folder: str, rank: int) -> str:
    path = os.path.join(folder, f"rank{rank}", f"rank{rank}.log")
    try:
        if os.path.getsize(path) >= sandbox.LOG_LIMIT:
            return f": it wrote {sandbox.LOG_LIMIT // 2**20} MiB of output, the most a rank may write, and was stopped"
        with open(path, errors="replace") as f:
            f.seek(max(0, os.path.getsize(path) - 3000))
            lines = [l.rstrip() for l in f.read().splitlines() if l.strip()]
    except OSError:
        return ""
    return (": " + " | ".join(lines[-4:]))[:600] if lines else " (os._exit, a crash or out of memory)"
