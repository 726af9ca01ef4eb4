"""Running a schedule on paper: the time line each rank would follow given how long each
action takes, its idle fraction (the bubble) and its peak count of stored activations.

The same loop is the deadlock check: a receive waits until its peer has sent, and only
the message that peer sent first and nobody has received yet can match it (the order in
which NCCL pairs point-to-point calls). If no rank can move, the schedule deadlocks.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Mapping, NamedTuple

from parakit.pipeline.actions import Action, Op

__all__ = ["Event", "Timeline", "simulate", "check_schedule", "format_grid", "bubble_formula", "ScheduleError"]


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
    channels: dict[tuple[int, int], deque] = {}  # (src, dst) -> (message, time sent)
    ready = [set() for _ in range(p)]  # inputs at hand: ("F", stage, i) activations, ("B", stage, i) gradients
    stored, peak, events = [0] * p, [0] * p, []
    while True:
        moved = False
        for r in range(p):
            while position[r] < len(schedule.actions[r]):
                a = schedule.actions[r][position[r]]
                start = _start_time(schedule, r, a, clock[r], channels, ready[r])
                if start is None:
                    break
                end = start + duration(a)
                _apply(schedule, r, a, end, channels, ready, stored)
                peak[r] = max(peak[r], stored[r])
                events.append(Event(r, a, start, end))
                clock[r], position[r], moved = end, position[r] + 1, True
        if all(position[r] == len(schedule.actions[r]) for r in range(p)):
            break
        if not moved:
            waits = "; ".join(f"rank {r} waits in {schedule.actions[r][position[r]]}" for r in range(p)
                              if position[r] < len(schedule.actions[r]))
            raise ScheduleError(f"schedule {schedule.name!r} deadlocks: {waits}")
    _check_complete(schedule, events, channels)
    return Timeline(p, events, peak)


def _op_times(schedule, times: Mapping[str, object]) -> dict:
    """Each op's duration; an unsplit B also does W's work."""
    t = {"F": 1, "B": 1, "W": 1 if schedule.splits_backward else 0, **times}
    if not schedule.splits_backward:
        t["B"] = t["B"] + t["W"]
    return t


def _start_time(schedule, r, a, now, channels, ready):
    """When `a` can start on rank r, or None while it must wait for a message."""
    S = schedule.num_stages
    if a.op in (Op.RECV_F, Op.RECV_B):
        queue = channels.get((a.peer, r))
        if not queue:
            return None
        message, sent_at = queue[0]
        expected = (a.op.compute, a.stage - a.op.step, a.microbatch)
        if message != expected:
            raise ScheduleError(f"rank {r} runs {a} but the next message from rank {a.peer} is "
                                f"{message[1]}SEND_{message[0]}{message[2]}: receives out of order")
        return max(now, sent_at)
    needs = {Op.F: (Op.F, a.stage, a.microbatch) if a.stage > 0 else None,
             Op.B: (Op.B, a.stage, a.microbatch) if a.stage < S - 1 else None}.get(a.op)
    if a.op is Op.B and ("F done", a.stage, a.microbatch) not in ready:
        raise ScheduleError(f"rank {r} runs {a} before its forward {a.stage}F{a.microbatch}")
    if a.op is Op.W and ("B done", a.stage, a.microbatch) not in ready:
        raise ScheduleError(f"rank {r} runs {a} before its backward {a.stage}B{a.microbatch}")
    if needs is not None and needs not in ready:
        raise ScheduleError(f"rank {r} runs {a} before its input arrives (no receive or local result before it)")
    return now


def _apply(schedule, r, a, end, channels, ready, stored):
    """The effect of `a` on rank r: results, messages, stored activations."""
    S = schedule.num_stages
    if a.op in (Op.RECV_F, Op.RECV_B):
        channels[(a.peer, r)].popleft()
        ready[r].add((a.op.compute, a.stage, a.microbatch))
    elif a.op in (Op.SEND_F, Op.SEND_B):
        channels.setdefault((r, a.peer), deque()).append(((a.op.compute, a.stage, a.microbatch), end))
    elif a.op is Op.W:
        stored[r] -= 1  # what B left for W is freed
    else:
        nxt = a.stage + a.op.step
        ready[r].add((f"{a.op} done", a.stage, a.microbatch))
        if 0 <= nxt < S and schedule.rank_of(nxt) == r:  # the next stage is on this rank: no message
            ready[r].add((a.op, nxt, a.microbatch))
        stored[r] += 1 if a.op is Op.F else (0 if schedule.splits_backward else -1)


def _check_complete(schedule, events, channels) -> None:
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


def check_schedule(schedule):
    """Raise ScheduleError unless the schedule runs to the end (no deadlock); return it."""
    simulate(schedule)
    return schedule


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
