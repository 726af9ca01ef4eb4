"""Running a schedule on paper: the time line each rank would follow given how long each
action takes, its idle fraction (the bubble) and its peak count of stored activations.

The same loop is the deadlock check: a receive is posted where it stands and matches the
message its peer sends next to this rank (the order in which NCCL pairs point-to-point
calls); the compute that needs it waits until that message is sent. If no rank can move,
the schedule deadlocks.

`check_schedule` also plays the order as NCCL runs it (`check_batches`): the runtime posts
each run of consecutive sends and receives as one batch, a rank's batches run one after
another on one stream, and a send does not complete before its receive is posted.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Mapping, NamedTuple

from parakit.pipeline.actions import Action, Op

__all__ = ["Event", "Timeline", "simulate", "check_schedule", "check_batches", "batches", "format_grid",
           "bubble_formula", "ScheduleError"]


class ScheduleError(ValueError):
    """The schedule deadlocks, computes before its input arrives, or misses an action."""


class Event(NamedTuple):
    rank: int
    action: Action
    start: float
    end: float


@dataclass
class Timeline:
    """Events of every rank (compute and communication); `peak_activations[r]` is the
    most micro-batch activations rank r held at once (forwards whose backward has not run;
    where the backward is split, whose W has not run)."""

    num_ranks: int
    events: list[Event]
    peak_activations: list[int]

    @property
    def compute(self) -> list[Event]:
        return [e for e in self.events if e.action.op.is_compute]

    @property
    def start(self):
        """When the first forward starts (a rank that waits before it, e.g. for a late peer, is not yet in the step)."""
        return min(e.start for e in self.compute)

    @property
    def makespan(self):
        """From the first forward's start to the last backward's end."""
        return max(e.end for e in self.compute) - self.start

    def action_times(self) -> dict[Action, float]:
        """How long each F and B took: pass it to `simulate` to replay these times."""
        return {e.action: e.end - e.start for e in self.compute}

    def busy(self, rank: int):
        """Time rank `rank` spends computing (F, B and W); sends and waits count as idle."""
        return sum(e.end - e.start for e in self.compute if e.rank == rank)

    def idle_in_span(self, rank: int):
        """Time rank `rank` waits between the start of its first compute and the end of its
        last: its own bubble, not counting the step's start and end, which other ranks set."""
        mine = [e for e in self.compute if e.rank == rank]
        return max(e.end for e in mine) - min(e.start for e in mine) - self.busy(rank)

    def idle_fraction(self, rank: int):
        return 1 - self.busy(rank) / self.makespan

    @property
    def bubble(self):
        """The mean idle fraction over the ranks."""
        return sum(self.idle_fraction(r) for r in range(self.num_ranks)) / self.num_ranks

    def mean_time(self, op: str) -> float:
        times = [e.end - e.start for e in self.events if e.action.op == op]
        return sum(times) / len(times)


def simulate(schedule, times: Mapping[str, object] | Callable[[Action], object] | None = None) -> Timeline:
    """Run `schedule` (a `Schedule`) on paper. `times` maps an op ("F", "B", "W", "SEND_F",
    ...) to its duration (default F = B = 1, and W = 1 where the schedule splits the
    backward; communication 0; use ints or Fractions for exact results), or maps each compute
    action to its own duration (`Timeline.action_times`), or is a function of the action. In a
    schedule without W actions a B is the whole backward: it takes times["B"] + times["W"].
    Raises ScheduleError if the schedule cannot run."""
    if callable(times):
        duration = times
    elif times and isinstance(next(iter(times)), Action):
        duration = lambda a: times.get(a, 0)  # noqa: E731
    else:
        duration = lambda a, t=_op_times(schedule, times or {}): t.get(a.op, 0)  # noqa: E731
    p = schedule.num_ranks
    position, clock = [0] * p, [Fraction(0)] * p
    channels: dict[tuple[int, int], deque] = {}  # (src, dst) -> messages sent, not yet matched: (message, time sent)
    posted: dict[tuple[int, int], deque] = {}  # (src, dst) -> receives dst posted, not yet matched
    waiting = [{} for _ in range(p)]  # the same, by the input they bring: ("F" | "B", stage, i) -> receive
    ready = [{} for _ in range(p)]  # input at hand -> when: ("F", stage, i) activations, ("B", stage, i) gradients
    stored, peak, events = [0] * p, [0] * p, []
    while True:
        moved = False
        for r in range(p):
            while position[r] < len(schedule.actions[r]):
                a = schedule.actions[r][position[r]]
                start = _start_time(schedule, r, a, clock[r], waiting[r], ready[r])
                if start is None:
                    break
                end = start + duration(a)
                _apply(schedule, r, a, end, channels, posted, waiting, ready, stored)
                peak[r] = max(peak[r], stored[r])
                events.append(Event(r, a, start, end))
                clock[r], position[r], moved = end, position[r] + 1, True
        if all(position[r] == len(schedule.actions[r]) for r in range(p)):
            break
        if not moved:
            waits = "; ".join(f"rank {r} waits in {waiting[r].get(_needs(schedule, a), a)}" for r in range(p)
                              if position[r] < len(schedule.actions[r]) for a in [schedule.actions[r][position[r]]])
            raise ScheduleError(f"schedule {schedule.name!r} deadlocks: {waits}")
    _check_complete(schedule, events, channels, posted)
    return Timeline(p, events, peak)


def _op_times(schedule, times: Mapping[str, object]) -> dict:
    """Each op's duration; an unsplit B also does W's work."""
    t = {"F": 1, "B": 1, "W": 1 if schedule.splits_backward else 0, **times}
    if not schedule.splits_backward:
        t["B"] = t["B"] + t["W"]
    return t


def _needs(schedule, a):
    """The input a compute takes from its previous stage: ("F" | "B", stage, i), or None."""
    if a.op is Op.F and a.stage > 0 or a.op is Op.B and a.stage < schedule.num_stages - 1:
        return (a.op, a.stage, a.microbatch)
    return None


def _start_time(schedule, r, a, now, waiting, ready):
    """When `a` can start on rank r, or None while its input is on its way. A send or a
    receive only posts: the compute that needs the message waits for it."""
    if not a.op.is_compute:
        return now
    if a.op is Op.B and ("F done", a.stage, a.microbatch) not in ready:
        raise ScheduleError(f"rank {r} runs {a} before its forward {a.stage}F{a.microbatch}")
    if a.op is Op.W and ("B done", a.stage, a.microbatch) not in ready:
        raise ScheduleError(f"rank {r} runs {a} before its backward {a.stage}B{a.microbatch}")
    needs = _needs(schedule, a)
    if needs is None or needs in ready:
        return now if needs is None else max(now, ready[needs])
    if needs in waiting:
        return None  # posted, its message not sent yet
    raise ScheduleError(f"rank {r} runs {a} before its input arrives (no receive or local result before it)")


def _apply(schedule, r, a, end, channels, posted, waiting, ready, stored):
    """The effect of `a` on rank r: results, messages, stored activations."""
    S = schedule.num_stages
    if a.op in (Op.RECV_F, Op.RECV_B):
        posted.setdefault((a.peer, r), deque()).append(a)
        waiting[r][(a.op.compute, a.stage, a.microbatch)] = a
        _match(channels, posted, waiting, ready, a.peer, r)
    elif a.op in (Op.SEND_F, Op.SEND_B):
        channels.setdefault((r, a.peer), deque()).append(((a.op.compute, a.stage, a.microbatch), end))
        _match(channels, posted, waiting, ready, r, a.peer)
    elif a.op is Op.W:
        stored[r] -= 1  # what B left for W is freed
    else:
        nxt = a.stage + a.op.step
        ready[r][(f"{a.op} done", a.stage, a.microbatch)] = end
        if 0 <= nxt < S and schedule.rank_of(nxt) == r:  # the next stage is on this rank: no message
            ready[r][(a.op, nxt, a.microbatch)] = end
        stored[r] += 1 if a.op is Op.F else (0 if schedule.splits_backward else -1)


def _match(channels, posted, waiting, ready, src, dst):
    """Pair the messages src sent dst with dst's receives from src, first with first."""
    messages, receives = channels.get((src, dst)), posted.get((src, dst))
    while messages and receives:
        (message, sent_at), recv = messages[0], receives[0]
        if message != (recv.op.compute, recv.stage - recv.op.step, recv.microbatch):
            raise ScheduleError(f"rank {dst} runs {recv} but the next message from rank {src} is "
                                f"{message[1]}SEND_{message[0]}{message[2]}: receives out of order")
        messages.popleft(), receives.popleft()
        key = (recv.op.compute, recv.stage, recv.microbatch)
        ready[dst][key] = sent_at
        waiting[dst].pop(key, None)


def _check_complete(schedule, events, channels, posted) -> None:
    done = sorted((str(e.action.op), e.action.stage, e.action.microbatch) for e in events if e.action.op.is_compute)
    ops = (Op.F, Op.B, Op.W) if schedule.splits_backward else (Op.F, Op.B)
    want = sorted((str(op), s, i) for op in ops for s in range(schedule.num_stages)
                  for i in range(schedule.num_microbatches))
    if done != want:
        raise ScheduleError(f"schedule {schedule.name!r} must run {', '.join(ops[:-1])} and {ops[-1]} of every stage and micro-batch once: "
                            f"missing {sorted(set(want) - set(done))[:4]}, extra {len(done) - len(set(done))}")
    left = [f"{src}\u2192{dst}" for (src, dst), q in channels.items() if q]
    if left:
        raise ScheduleError(f"schedule {schedule.name!r} sends messages nobody receives on {', '.join(left)}")
    unsent = [str(recv) for queue in posted.values() for recv in queue]
    if unsent:
        raise ScheduleError(f"schedule {schedule.name!r} receives messages nobody sends: {', '.join(unsent)}")


def check_schedule(schedule):
    """Raise ScheduleError unless the schedule runs to the end, on paper (`simulate`) and as
    NCCL runs its batches (`check_batches`); return it."""
    simulate(schedule)
    check_batches(schedule)
    return schedule


def batches(actions) -> list[list[Action]]:
    """One rank's runs of consecutive sends and receives: what the runtime posts together,
    as one `batch_isend_irecv`."""
    runs, run = [], []
    for a in actions:
        if a.op.is_compute:
            runs, run = runs + [run] if run else runs, []
        else:
            run.append(a)
    return runs + [run] if run else runs


def check_batches(schedule):
    """Raise ScheduleError unless each rank's `batches` can run as NCCL runs them: one after
    another on the rank's stream, a batch done once every message in it is matched, and a
    message matched once both ranks have reached the batches holding its two ends (a send
    is taken to wait for its receive, as a large one does). Messages pair first with first
    on each (sender, receiver). Return the schedule."""
    runs = [batches(actions) for actions in schedule.actions]
    where: dict[tuple, tuple[int, int]] = {}  # (send?, src, dst, k) -> (rank, batch) of the k-th message's end
    for r, rank_runs in enumerate(runs):
        count: dict[tuple, int] = {}
        for j, run in enumerate(rank_runs):
            for a in run:
                end = (True, r, a.peer) if a.op in (Op.SEND_F, Op.SEND_B) else (False, a.peer, r)
                count[end] = count.get(end, -1) + 1
                where[end + (count[end],)] = (r, j)
    lone = [key for key in where if (not key[0],) + key[1:] not in where]
    if lone:
        raise ScheduleError(f"schedule {schedule.name!r} has {len(lone)} message(s) without their other end, the "
                            f"first from rank {lone[0][1]} to rank {lone[0][2]}: every send needs its receive")
    waits = {(r, j): [] for r, rank_runs in enumerate(runs) for j in range(len(rank_runs))}
    for (send, src, dst, k), (r, j) in where.items():
        waits[(r, j)].append(where[(not send, src, dst, k)])  # the other end: (rank, batch) that rank must reach
    reached = [0] * len(runs)
    while True:
        moved = False
        for r, rank_runs in enumerate(runs):
            while reached[r] < len(rank_runs) and all(reached[q] >= j for q, j in waits[(r, reached[r])]):
                reached[r], moved = reached[r] + 1, True
        if all(reached[r] == len(rank_runs) for r, rank_runs in enumerate(runs)):
            return schedule
        if not moved:
            stuck = "; ".join(f"rank {r} waits in [{', '.join(map(str, runs[r][reached[r]]))}]"
                              for r in range(len(runs)) if reached[r] < len(runs[r]))
            raise ScheduleError(f"schedule {schedule.name!r} deadlocks on NCCL, where a send waits for its receive "
                                f"and each rank's batches run one after another: {stuck}. Receive each message in the "
                                f"batch of the step its sender sends it (as with_communication does)")


def format_grid(schedule) -> str:
    """The schedule as a time-step by rank grid (F = B = W = 1 time step; '.' is idle)."""
    timeline = simulate(schedule)
    steps = int(timeline.makespan)
    grid = [["."] * schedule.num_ranks for _ in range(steps)]
    for e in timeline.events:
        if e.action.op.is_compute:
            grid[int(e.start)][e.rank] = f"{e.action.stage}{e.action.op}{e.action.microbatch}"
    width = max(6, *(len(c) + 1 for row in grid for c in row))
    header = "step " + "".join(f"rank {r}".ljust(width + 1) for r in range(schedule.num_ranks))
    return "\n".join([header] + [f"{t:>4} " + "".join(c.ljust(width + 1) for c in row) for t, row in enumerate(grid)])


def bubble_formula(p: int, m: int, v: int = 1) -> Fraction:
    """Idle fraction of GPipe and 1F1B, (p-1)/(m+p-1); with v chunks per rank, (p-1)/(vm+p-1)."""
    return Fraction(p - 1, v * m + p - 1)
