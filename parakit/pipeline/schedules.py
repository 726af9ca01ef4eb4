"""Pipeline schedules as data: for each rank, the ordered list of actions it runs.

An action (actions.py) is the forward (F) or backward (B) of micro-batch i on stage s, or
the send or receive that moves an activation forward (SEND_F/RECV_F) or its gradient back
(SEND_B/RECV_B). Stage s lives on rank s % p; with v chunks per rank (interleaved 1F1B)
rank r holds stages r, r + p, ..., r + (v-1)p, looping over the ranks v times. Zero-bubble
schedules also split each backward into B (the input's gradient) and W (the weights'
gradient), and ZB-V places its 2p stages in a V: rank r holds stages r and 2p-1-r, so the
first and last stages share rank 0. The builders below only order each rank's F, B and W;
`with_communication` then places a send right after every compute whose result another
rank needs, and its receive at the step the message is sent when every action takes one
step: both ends of each message in the same step. The runtime posts each run of
consecutive sends and receives as one batch and waits for a message only at the compute
that needs it; with both ends in the batches of one step no batch waits for a later one,
which NCCL needs (a send waits for its receive; a rank's batches run one after another).
Each peer's messages are received in the order it sends them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from parakit.pipeline.actions import Action, Op
from parakit.pipeline.simulate import ScheduleError, format_grid, simulate

__all__ = ["Schedule", "gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble_h1", "zero_bubble_h2", "zero_bubble_v",
           "delayed_weight_passes", "build_schedule", "rank_of", "SCHEDULES"]


@dataclass(frozen=True)
class Schedule:
    name: str
    num_ranks: int  # p
    num_microbatches: int  # m
    chunks: int  # v, stages per rank
    actions: tuple[tuple[Action, ...], ...]  # actions[rank], in the order the rank runs them
    placement: str = "loop"  # stage s on rank s % p ("loop"), or a V over 2 chunks ("v")

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.chunks

    @functools.cached_property
    def splits_backward(self) -> bool:
        """Whether the backward is split into B (input gradient) and W (weight gradient)."""
        return any(a.op is Op.W for actions in self.actions for a in actions)

    def rank_of(self, stage: int) -> int:
        return rank_of(stage, self.num_ranks, self.placement)

    def stages_of(self, rank: int) -> list[int]:
        """The stages rank `rank` holds, in increasing order."""
        return [s for s in range(self.num_stages) if self.rank_of(s) == rank]

    def compute(self, rank: int) -> list[Action]:
        """The rank's F and B actions, without the communication."""
        return [a for a in self.actions[rank] if a.op.is_compute]

    def __str__(self) -> str:
        return format_grid(self)


def rank_of(stage: int, p: int, placement: str = "loop") -> int:
    """The rank holding `stage` of a pipeline over p ranks: stage % p, or in a V (2p stages)
    stage for the first p and 2p-1-stage for the rest."""
    if placement == "v":
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


def _check_sizes(p: int, m: int, v: int = 1) -> None:
    for name, value in (("number of ranks p", p), ("num_microbatches m", m), ("chunks per rank v", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every rank runs the forwards of all m micro-batches, then their backwards."""
    _check_sizes(p, m)
    orders = [[Action(Op.F, r, i) for i in range(m)] + [Action(Op.B, r, i) for i in range(m)] for r in range(p)]
    return with_communication("gpipe", orders, p, m, 1)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush): rank r warms up with p-1-r forwards, then alternates one
    forward and one backward, then cools down with the backwards left. Rank r holds at most
    p - r micro-batches' activations instead of GPipe's m."""
    _check_sizes(p, m)
    if m < p:
        raise ValueError(f"1F1B needs at least as many micro-batches as stages: num_microbatches={m} < {p} "
                         f"stages. Use num_microbatches >= {p}, or schedule='gpipe' (which takes any m)")
    orders = []
    for r in range(p):
        warmup = p - 1 - r
        order = [Action(Op.F, r, i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Action(Op.F, r, warmup + i), Action(Op.B, r, i)]
        orders.append(order + [Action(Op.B, r, i) for i in range(m - warmup, m)])
    return with_communication("1f1b", orders, p, m, 1)


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): each rank holds v chunks (stages r, r+p, ...).
    Micro-batches go through the chunks in groups of p; rank r warms up with
    2(p-1-r) + (v-1)p forwards, then alternates. v = 1 is plain 1F1B."""
    _check_sizes(p, m, v)
    if v == 1:
        return one_f_one_b(p, m)
    if m % p:
        raise ValueError(f"interleaved 1F1B sends micro-batches through the chunks in groups of p={p}: "
                         f"num_microbatches={m} is not a multiple of {p}; use m = {p * max(1, -(-m // p))}")
    orders = []
    for r in range(p):
        def unit(k, backward):  # the k-th forward (or backward) of this rank: (stage, micro-batch)
            group, within = divmod(k, p * v)
            chunk = within // p
            return (v - 1 - chunk if backward else chunk) * p + r, group * p + within % p
        total, warmup = m * v, min(2 * (p - 1 - r) + (v - 1) * p, m * v)
        order = [Action(Op.F, *unit(k, False)) for k in range(warmup)]
        for k in range(total - warmup):
            order += [Action(Op.F, *unit(warmup + k, False)), Action(Op.B, *unit(k, True))]
        orders.append(order + [Action(Op.B, *unit(k, True)) for k in range(total - warmup, total)])
    return with_communication("interleaved", orders, p, m, v)


def zero_bubble_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023): 1F1B's order of F and B, each backward split into B and W,
    rank r running each W r backwards late (W of micro-batch k right after B of k + r, the
    last r at the end). Rank r then holds 1F1B's p - r micro-batches plus r waiting for W:
    at most p, 1F1B's peak on rank 0, and its W's fill the waits of 1F1B's cool-down, which
    cuts the bubble to (p-1)(T_F + T_B - T_W)."""
    if m < p:
        raise ValueError(f"ZB-H1 needs at least as many micro-batches as stages: num_microbatches={m} < {p}; "
                         f"use num_microbatches >= {p}")
    base = one_f_one_b(p, m)
    return with_communication("zbh1", [delayed_weight_passes(base.compute(r), r) for r in range(p)], p, m, 1)


def delayed_weight_passes(order: list[Action], lag: int) -> list[Action]:
    """One rank's F/B order with a W after each B: the W of the B `lag` backwards earlier
    (same stage), and the W's still missing at the end, in order."""
    out, backwards = [], []
    for a in order:
        out.append(a)
        if a.op is Op.B:
            backwards.append(a)
            if len(backwards) > lag:
                out.append(Action(Op.W, *backwards[-1 - lag][1:3]))
    return out + [Action(Op.W, b.stage, b.microbatch) for b in backwards[max(0, len(backwards) - lag):]]


def zero_bubble_h2(p: int, m: int) -> Schedule:
    """ZB-H2: rank r runs 2(p-r)-1 forwards before its first B arrives, which fills the
    warm-up bubble too (the paper's parallelogram); it holds up to 2p-1 micro-batches on rank 0."""
    _check_sizes(p, m)
    if m < 2 * p - 1:
        raise ValueError(f"ZB-H2 fills its warm-up with 2p-1 = {2 * p - 1} forwards on rank 0: num_microbatches={m} "
                         f"is too few; use num_microbatches >= {2 * p - 1}, or schedule='zbh1'")
    return with_communication("zbh2", _fill_bubbles(p, m, 1, "loop", [2 * p - 1] * p), p, m, 1)


def zero_bubble_v(p: int, m: int) -> Schedule:
    """ZB-V: 2p stages in a V (rank r holds stages r and 2p-1-r, so the loss is on rank 0,
    where the forward started) with B and W split; every rank holds at most 2p stage-micro-batches
    (of half-size stages: 1F1B's memory)."""
    _check_sizes(p, m)
    if m < p:
        raise ValueError(f"ZB-V needs at least as many micro-batches as ranks: num_microbatches={m} < {p}; "
                         f"use num_microbatches >= {p}")
    return with_communication("zbv", _fill_bubbles(p, m, 2, "v", [2 * p] * p), p, m, 2, "v")


def _fill_bubbles(p: int, m: int, v: int, placement: str, cap: list[int]) -> list[list[Action]]:
    """Each rank's F/B/W order, found by running the pipeline on paper with F = B = W = 1 and
    free messages. At every time step a rank runs the B whose output gradient is there
    (oldest micro-batch first, then later stage), else an F whose input is there, if it holds
    fewer than cap[r] stage-micro-batches whose W has not run, else its oldest W left, else
    waits. Any durations keep this order runnable: it was run once."""
    stages = p * v
    owned = [[s for s in range(stages) if rank_of(s, p, placement) == r] for r in range(p)]
    ready = {(Op.F, 0, i): 0 for i in range(m)}  # (op, stage, i) -> time its input is there
    next_of = {(op, s): 0 for op in (Op.F, Op.B) for s in range(stages)}  # each stage's micro-batches in order
    held, waiting = [0] * p, [[] for _ in range(p)]  # stage-micro-batches from F to W; B's done, W's not
    orders: list[list[Action]] = [[] for _ in range(p)]
    t = 0
    while sum(map(len, orders)) < 3 * stages * m:
        chosen = [_choose(r, t, owned[r], ready, next_of, held[r] < cap[r], waiting[r], m) for r in range(p)]
        if not any(chosen) and all(when <= t for when in ready.values()):
            raise AssertionError(f"no rank can move at time {t} under caps {cap}: the caps are too small")
        for r, a in enumerate(chosen):
            if a is None:
                continue
            orders[r].append(a)
            if a.op is Op.W:
                held[r] -= 1
                continue
            next_of[(a.op, a.stage)] += 1
            nxt = a.stage + a.op.step
            if 0 <= nxt < stages:
                ready[(a.op, nxt, a.microbatch)] = t + 1
            if a.op is Op.F:
                held[r] += 1
                if a.stage == stages - 1:  # the loss: its gradient starts the backward here
                    ready[(Op.B, a.stage, a.microbatch)] = t + 1
            else:
                waiting[r].append(Action(Op.W, a.stage, a.microbatch))
        t += 1
    return orders


def _choose(r, t, owned, ready, next_of, may_forward, waiting, m) -> Action | None:
    """What rank r runs at time t under `_fill_bubbles`' rule."""
    def candidates(op):
        for s in owned:
            i = next_of[(op, s)]
            if i < m and ready.get((op, s, i), t + 1) <= t:
                yield i, -s, Action(op, s, i)
    for op, allowed in ((Op.B, True), (Op.F, may_forward)):
        found = sorted(candidates(op)) if allowed else []
        if found:
            return found[0][2]
    return waiting.pop(0) if waiting else None


SCHEDULES = {"gpipe": lambda p, m, v=1: gpipe(p, m), "1f1b": lambda p, m, v=1: one_f_one_b(p, m),
             "interleaved": interleaved_1f1b, "zbh1": lambda p, m, v=1: zero_bubble_h1(p, m),
             "zbh2": lambda p, m, v=1: zero_bubble_h2(p, m), "zbv": lambda p, m, v=2: zero_bubble_v(p, m)}
CHUNKS = {"interleaved": None, "zbv": 2}  # stages per rank where it is not 1 (None: any v)


def build_schedule(name: str, p: int, m: int, v: int | None = None) -> Schedule:
    """The schedule called `name` (one of SCHEDULES) for p ranks, m micro-batches and v
    stages per rank (default: 1, or 2 for "zbv", which needs 2)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: use one of {', '.join(map(repr, SCHEDULES))}")
    needs = CHUNKS.get(name, 1)
    v = (needs or 1) if v is None else v
    if needs is not None and v != needs:
        what = "one stage" if needs == 1 else f"{needs} stages"
        raise ValueError(f"schedule {name!r} runs {what} per rank but {v} stages per rank were given: "
                         f"use schedule='interleaved' for any number, or {what} per rank")
    return SCHEDULES[name](p, m, v)


def with_communication(name: str, orders: list[list[Action]], p: int, m: int, v: int,
                       placement: str = "loop") -> Schedule:
    """Add the sends and receives to each rank's F/B/W order (see the module docstring). An
    order that cannot run keeps each receive right before the compute that needs it, where
    `check_schedule` names the wait."""
    stages = p * v
    sent: dict[tuple[int, int], list[Action]] = {}  # (src, dst) -> the sends, in src's order
    with_sends = []
    for r, order in enumerate(orders):
        actions = []
        for a in order:
            actions.append(a)
            nxt = a.stage + a.op.step
            if a.op is not Op.W and 0 <= nxt < stages and rank_of(nxt, p, placement) != r:
                send = Action(a.op.send, a.stage, a.microbatch, rank_of(nxt, p, placement))
                actions.append(send)
                sent.setdefault((r, send.peer), []).append(send)
        with_sends.append(actions)
    needed = Schedule(name, p, m, v, tuple(tuple(_with_receives(r, acts, sent, p, stages, placement))
                                           for r, acts in enumerate(with_sends)), placement)
    try:
        steps = simulate(needed)
    except ScheduleError:
        return needed
    return Schedule(name, p, m, v, tuple(_in_steps(r, steps) for r in range(p)), placement)


def _with_receives(rank: int, actions: list[Action], sent: dict, p: int, stages: int, placement: str) -> list[Action]:
    """Before each compute that needs another rank's result, receive that peer's messages
    up to and including the one needed (unless an earlier receive took it), in the order
    the peer sends them."""
    taken = {src: 0 for (src, dst) in sent if dst == rank}
    out = []
    for a in actions:
        prev = a.stage - a.op.step
        if a.op in (Op.F, Op.B) and 0 <= prev < stages and rank_of(prev, p, placement) != rank:
            src, needed = rank_of(prev, p, placement), Action(a.op.send, prev, a.microbatch, rank)
            queue = sent[(src, rank)]
            while needed not in queue[:taken[src]]:
                message = queue[taken[src]]
                taken[src] += 1
                out.append(Action(message.op.recv, message.stage + message.op.step, message.microbatch, src))
        out.append(a)
    return out


def _in_steps(rank: int, timeline) -> tuple[Action, ...]:
    """Rank `rank`'s actions in the order of the step they run at in `timeline` (every action
    one step), each receive moved to the step its message is sent; within a step, the sends
    of the compute that just ended, then the receives, then the next compute."""
    sent_at = {(e.action.op.compute, e.action.stage + e.action.op.step, e.action.microbatch, e.rank): e.end
               for e in timeline.events if e.action.op in (Op.SEND_F, Op.SEND_B)}
    keyed = []
    for n, e in enumerate(x for x in timeline.events if x.rank == rank):
        a = e.action
        if a.op in (Op.RECV_F, Op.RECV_B):
            keyed.append(((sent_at[(a.op.compute, a.stage, a.microbatch, a.peer)], 1, n), a))
        else:
            keyed.append(((e.start, 0 if a.op in (Op.SEND_F, Op.SEND_B) else 2, n), a))
    return tuple(a for _, a in sorted(keyed))
