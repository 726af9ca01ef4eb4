"""The step time and the traffic of one step, per device: compute at the cluster's achieved
FLOP/s, every collective by the alpha-beta model on the link its group crosses, what
overlaps with compute and what does not, and the bubble, from `parakit.pipeline`'s
simulator running the schedule with those times. Every figure is a model.

    collective on n ranks, M bytes     sent per rank        time (alpha-beta, ring)
    all-reduce                         2 (n-1)/n M          2 (n-1) alpha + 2 (n-1)/n M / bandwidth
    all-gather, reduce-scatter, a2a    (n-1)/n M            (n-1) alpha + (n-1)/n M / bandwidth
    send (pipeline, ring attention)    M                    alpha + M / bandwidth
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

from parakit.context_parallel import ring_bytes_per_rank
from parakit.pipeline import simulate
from parakit.plan.memory import PlanError, built_schedule, stage_tensors, zero_layout
from parakit.plan.spec import DTYPES, Cluster, Config, Model, problems
from parakit.zero.paper import zero_comm_bytes

__all__ = ["Traffic", "StepTime", "traffic", "step_flops", "step_time", "link"]

_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
           "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "send": lambda n: 1}
_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "send": lambda n: 1}


@dataclass(frozen=True)
class Traffic:
    """`count` calls of `op` over the `group` (tp, cp, ep, pp, dp) of `size` ranks, each on a
    tensor of `nbytes` (the full tensor; for a send the message); `overlap` names the compute
    it can hide behind ("" when it is on the critical path)."""

    group: str
    op: str
    nbytes: float
    count: int
    size: int
    overlap: str = ""

    @property
    def sent(self) -> float:
        """Bytes one rank sends, by the ring model."""
        return self.count * self.nbytes * _FACTOR[self.op](self.size)

    def seconds(self, alpha: float, bandwidth: float) -> float:
        steps = _STEPS.get(self.op, lambda n: n - 1)(self.size)
        return self.count * (steps * alpha + self.nbytes * _FACTOR[self.op](self.size) / bandwidth)


@dataclass
class StepTime:
    """Seconds of one step on the slowest pipeline rank: `compute`, `exposed` (per group,
    communication not hidden), `hidden` (per group, overlapped with compute), `bubble`;
    `total` = compute + exposed + bubble. A model."""

    compute: float
    exposed: dict[str, float]
    hidden: dict[str, float]
    bubble: float
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return self.compute + sum(self.exposed.values()) + self.bubble


def _stride(config: Config, group: str) -> int:
    """The rank distance between neighbours of a group, as parakit.mesh lays ranks out: tp
    innermost, then cp (ep within the replicas), then pp and dp, `config.outer` outermost."""
    middle = "pp" if config.outer == "dp" else "dp"
    inner = {"tp": 1, "cp": config.tp, "ep": config.tp, middle: config.tp * config.cp,
             config.outer: config.tp * config.cp * getattr(config, middle)}
    return inner[group]


def link(cluster: Cluster, config: Config, group: str, size: int) -> tuple[float, float]:
    """(alpha, bandwidth) of a group: inter-node when its ranks span more than one node."""
    if _stride(config, group) * size > cluster.devices_per_node:
        return cluster.inter_latency, cluster.inter_bandwidth
    return cluster.intra_latency, cluster.intra_bandwidth


def traffic(model: Model, config: Config, stage: int = 0, backend: str = "nccl") -> list[Traffic]:
    """What pipeline rank `stage` sends in one step, call by call. backend="gloo" models
    gloo's reduce-scatter, which writes twice the ring's bytes (see `parakit.comm`), and
    ZeRO-1/2 as parakit's ShardedOptimizer runs there (see `_zero_traffic`)."""
    act = DTYPES[config.dtype][3]
    b, s, h, t, m = config.microbatch, model.seq // config.cp, model.hidden, config.tp, config.microbatches
    layers = model.layers // config.pp
    recompute = config.checkpointing == "full"
    out = []
    if t > 1:  # two all-reduces forward, two backward per layer (SP: all-gather + reduce-scatter pairs, same bytes)
        calls = layers * m * (4 + (2 if recompute else 0))
        if config.sp:
            out += [Traffic("tp", "all_gather", b * s * h * act, calls, t), Traffic("tp", "reduce_scatter", b * s * h * act, calls, t)]
        else:
            out.append(Traffic("tp", "all_reduce", b * s * h * act, calls, t))
    if config.cp > 1:  # ring attention: K, V around the ring forward (again when recomputed); K, V, dK, dV backward
        shape = (b, model.heads // t, s, h // model.heads)
        per_layer = ring_bytes_per_rank(shape, config.cp, act, backward=True)
        per_layer += ring_bytes_per_rank(shape, config.cp, act) if recompute else 0
        message = 2 * b * s * h // t * act
        out.append(Traffic("cp", "send", message, round(per_layer / message) * layers * m, config.cp, "attention"))
    if config.ep > 1 and model.experts > 1:  # dispatch and combine, forward and backward; the counts first (int64)
        out += [Traffic("ep", "all_to_all", b * s * model.top_k * h * act / (t if config.sp else 1), 4 * layers * m, config.ep),
                Traffic("ep", "all_to_all", 8 * model.experts, layers * m, config.ep)]
    if config.pp > 1:
        v, p = config.v, config.pp
        message = b * s * h * act / (t if config.sp else 1)
        last = 0 if config.schedule == "zbv" else p - 1
        fwd = v - (1 if stage == last else 0)
        bwd = v - (1 if stage == 0 else 0)
        out.append(Traffic("pp", "send", message, (fwd + bwd) * m, p, "pipeline"))
    shards = config.dp * config.cp
    if shards > 1:
        grad = DTYPES[config.dtype][1]
        for tensors, n in zip(stage_tensors(model, config, stage), (shards, shards // config.ep)):
            if tensors and n > 1:
                out += _zero_traffic(tensors, n, config.zero, grad, m, backend)
    return out


def _zero_traffic(tensors: list[int], n: int, stage: int, element: int, m: int, backend: str) -> list[Traffic]:
    """The data-parallel traffic of parameters of these sizes on n ranks. Stage 0: one
    all-reduce, 2 Psi (n-1)/n (`zero.paper.zero_comm_bytes`). Stages 1-2 by buckets
    (`plan.memory.zero_layout`): each bucket's [n x chunk] gradients reduce-scattered from
    backward and its updated segments all-gathered after the step, the paper's 2 Psi (n-1)/n
    on NCCL; on gloo parakit all-reduces the bucket instead (2 (n-1) chunk) and lays it out by
    owners, padded. With m micro-batches, stage 1 accumulates whole gradients and reduces once;
    stage 2 keeps only its segment, so it reduces after every micro-batch's backward (m times; as
    DeepSpeed does: parakit's ShardedOptimizer refuses to accumulate at stage 2). Stage 3: 3 Psi
    per micro-batch (gathered for forward and again for backward, reduced after it; on gloo the
    reduction is an all-reduce: 4 Psi), as zero.FullyShardedDataParallel runs it."""
    psi = sum(tensors)
    if stage == 0:
        sent = zero_comm_bytes(psi, n, stage, element)
        return [Traffic("dp", "all_reduce", sent / _FACTOR["all_reduce"](n), 1, n, "backward")]
    if stage < 3:
        layout = zero_layout(tuple(tensors), n, element, backend == "gloo")
        reduce = "all_reduce" if backend == "gloo" else "reduce_scatter"
        sizes = Counter(n * chunk * element for chunk in layout.chunks)
        reduces = m if stage == 2 else 1
        return [Traffic("dp", op, nbytes, count * times, n, overlap) for nbytes, count in sorted(sizes.items())
                for op, overlap, times in ((reduce, "backward", reduces), ("all_gather", "", 1))]
    gather = psi * element
    reduce = "all_reduce" if backend == "gloo" else "reduce_scatter"  # as zero.FullyShardedDataParallel chooses
    scatter = Traffic("dp", reduce, gather, m, n, "backward")
    return [Traffic("dp", "all_gather", gather, 2 * m, n, "forward"), scatter]


def step_flops(model: Model, config: Config, stage: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of one micro-batch on pipeline rank `stage`: 2 per
    multiply-add in the layers' matrices and in attention (QK^T and AV), the output layer on
    the last stage; backward twice forward, plus a forward again under full checkpointing."""
    h, f, s = model.hidden, model.ffn_hidden, model.seq
    tokens = config.microbatch * s / config.cp
    per_token = 2 * (4 * h * h + 2 * h * f * model.top_k) + 4 * s * h
    fwd = tokens * per_token * model.layers / config.pp / config.tp
    if stage == config.pp - 1:
        fwd += tokens * 2 * h * model.vocab / config.tp
    extra = {"full": fwd, "selective": tokens * 4 * s * h * model.layers / config.pp / config.tp}.get(config.checkpointing, 0)
    return fwd, 2 * fwd + extra


@lru_cache(maxsize=4096)
def _pipeline(schedule: str, p: int, m: int, v: int | None, f: float, b: float, send: float):
    """(makespan, seconds each rank spends sending) of the schedule run by the simulator with
    these times for one F, one B (halved into B and W for zero-bubble) and one send."""
    times = {"F": f, "B": b, "W": 0, "SEND_F": send, "SEND_B": send}
    if schedule in ("zbh1", "zbv"):
        times.update(B=b / 2, W=b / 2)
    line = simulate(built_schedule(schedule, p, m, v), times)
    sends = [0.0] * p
    for e in line.events:
        if e.action.op in ("SEND_F", "SEND_B"):
            sends[e.rank] += float(e.end - e.start)
    return float(line.makespan), tuple(sends)


def step_time(model: Model, cluster: Cluster, config: Config) -> StepTime:
    """One step's time on the slowest pipeline rank. tp and ep collectives sit on the
    critical path (exposed, added to each F and B); pipeline sends delay the next stage
    (the simulator's SEND times, every stage paced by the slowest); ring attention's sends
    hide behind attention; the data-parallel reduction behind the last micro-batch's
    backward (ZeRO-3's gathers behind the forwards) where they fit."""
    reasons = problems(model, cluster, config)
    if reasons:
        raise PlanError(reasons)
    rate, m = cluster.flops * cluster.efficiency, config.microbatches
    stages = []
    for stage in range(config.pp):
        fwd, bwd = (x / rate for x in step_flops(model, config, stage))
        calls = traffic(model, config, stage)
        secs = {c: c.seconds(*link(cluster, config, c.group, c.size)) for c in calls}
        critical = sum(secs[c] for c in calls if c.group in ("tp", "ep")) / m
        stages.append((fwd, bwd, calls, secs, fwd + critical / 3, bwd + 2 * critical / 3))
    span, sends = 0.0, {}
    if config.pp > 1:
        f_time, b_time = max(x[4] for x in stages), max(x[5] for x in stages)
        send = max((secs[c] / c.count for _, _, calls, secs, _, _ in stages for c in calls if c.group == "pp"
                    and c.count), default=0.0)
        v = config.v if config.schedule in ("interleaved", "zbv") else None
        span, per_rank = _pipeline(config.schedule, config.pp, m, v, f_time / config.v, b_time / config.v, send)
        sends = dict(enumerate(per_rank))
    worst = None
    for stage, (fwd, bwd, calls, secs, f_time, b_time) in enumerate(stages):
        exposed, hidden = {}, {}
        for c in calls:
            if c.group in ("tp", "ep"):
                exposed[c.group] = exposed.get(c.group, 0.0) + secs[c]
            elif c.group in ("cp", "dp"):
                window = {"attention": bwd * m / 3, "backward": bwd, "forward": fwd * m}.get(c.overlap, 0.0)
                exposed[c.group] = exposed.get(c.group, 0.0) + max(0.0, secs[c] - window)
                hidden[c.group] = hidden.get(c.group, 0.0) + min(secs[c], window)
        bubble = 0.0
        if config.pp > 1:
            exposed["pp"] = sends.get(stage, 0.0)
            bubble = max(0.0, span - m * (f_time + b_time) - exposed["pp"])
        result = StepTime(m * (fwd + bwd), exposed, hidden, bubble)
        if worst is None or result.total > worst.total:
            worst = result
    return worst
