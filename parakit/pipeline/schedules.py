"""Pipeline schedules as data: for each rank, the ordered list of actions it runs.

An action (actions.py) is the forward (F) or backward (B) of micro-batch i on stage s, or
the send or receive that moves an activation forward (SEND_F/RECV_F) or its gradient back
(SEND_B/RECV_B). Stage s lives on rank s % p; with v chunks per rank (interleaved 1F1B)
rank r holds stages r, r + p, ..., r + (v-1)p. The builders below only order each rank's
F and B; `with_communication` then places a send right after every compute whose result
another rank needs and the receives right before the compute that needs them, taking each
peer's messages in the order that peer sends them (as NCCL's point-to-point calls match).
"""
from __future__ import annotations

from dataclasses import dataclass

from parakit.pipeline.actions import Action, Op
from parakit.pipeline.simulate import format_grid

__all__ = ["Schedule", "gpipe", "one_f_one_b", "interleaved_1f1b", "build_schedule", "SCHEDULES"]


@dataclass(frozen=True)
class Schedule:
    name: str
    num_ranks: int  # p
    num_microbatches: int  # m
    chunks: int  # v, stages per rank
    actions: tuple[tuple[Action, ...], ...]  # actions[rank], in the order the rank runs them

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.chunks

    def rank_of(self, stage: int) -> int:
        return stage % self.num_ranks

    def compute(self, rank: int) -> list[Action]:
        """The rank's F and B actions, without the communication."""
        return [a for a in self.actions[rank] if a.op.is_compute]

    def __str__(self) -> str:
        return format_grid(self)


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


SCHEDULES = {"gpipe": lambda p, m, v=1: gpipe(p, m), "1f1b": lambda p, m, v=1: one_f_one_b(p, m),
             "interleaved": interleaved_1f1b}


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule called `name` ("gpipe", "1f1b" or "interleaved") for p ranks, m micro-batches, v chunks."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: use one of {', '.join(map(repr, SCHEDULES))}")
    if v != 1 and name != "interleaved":
        raise ValueError(f"schedule {name!r} runs one stage per rank but {v} stages per rank were given: "
                         f"use schedule='interleaved' or one stage per rank")
    return SCHEDULES[name](p, m, v)


def with_communication(name: str, orders: list[list[Action]], p: int, m: int, v: int) -> Schedule:
    """Add the sends and receives to each rank's F/B order (see the module docstring)."""
    stages = p * v
    sent: dict[tuple[int, int], list[Action]] = {}  # (src, dst) -> the sends, in src's order
    with_sends = []
    for r, order in enumerate(orders):
        actions = []
        for a in order:
            actions.append(a)
            nxt = a.stage + a.op.step
            if 0 <= nxt < stages and nxt % p != r:
                send = Action(a.op.send, a.stage, a.microbatch, nxt % p)
                actions.append(send)
                sent.setdefault((r, nxt % p), []).append(send)
        with_sends.append(actions)
    return Schedule(name, p, m, v, tuple(tuple(_with_receives(r, acts, sent, p, stages))
                                         for r, acts in enumerate(with_sends)))


def _with_receives(rank: int, actions: list[Action], sent: dict, p: int, stages: int) -> list[Action]:
    """Before each compute that needs another rank's result, receive that peer's messages
    up to and including the one needed, in the order the peer sends them."""
    taken = {src: 0 for (src, dst) in sent if dst == rank}
    out = []
    for a in actions:
        prev = a.stage - a.op.step
        if a.op.is_compute and 0 <= prev < stages and prev % p != rank:
            src, needed = prev % p, Action(a.op.send, prev, a.microbatch, rank)
            queue = sent[(src, rank)]
            while True:
                message = queue[taken[src]]
                taken[src] += 1
                out.append(Action(message.op.recv, message.stage + message.op.step, message.microbatch, src))
                if message == needed:
                    break
        out.append(a)
    return out
