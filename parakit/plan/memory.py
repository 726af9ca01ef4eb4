"""Bytes per device, itemised: parameters, gradients, optimizer state (the ZeRO paper's
formulas, `parakit.zero.paper`, applied to the parameters a rank's pipeline stage and tensor
slice hold; ZeRO-1/2 by the buckets of parakit's ShardedOptimizer, `zero_layout`), activations (Korthikanti et al.'s per-layer formula, `parakit.sequence_parallel`,
times the micro-batches the schedule keeps in flight, counted by `parakit.pipeline`'s
simulator) and transient buffers. Every figure is a model; `plan.measure` checks it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from parakit.pipeline import Schedule, build_schedule, simulate
from parakit.plan.spec import DTYPES, Cluster, Config, Model, problems
from parakit.sequence_parallel import paper_activation_bytes
from parakit.zero.optimizer import owner_buckets
from parakit.zero.paper import zero_bytes

__all__ = ["Memory", "PlanError", "ZeroLayout", "layer_tensors", "layer_params", "stage_tensors", "stage_params",
           "zero_layout", "layer_activation_bytes", "recompute_bytes", "in_flight", "in_flight_with_gradients", "memory"]


BUCKET_MB = 25.0  # ShardedOptimizer's and BucketedDDP's bucket_size_mb
_DTYPE = {2: torch.bfloat16, 4: torch.float32}


class PlanError(ValueError):
    """The configuration cannot run: `reasons` lists each constraint broken and by how much."""

    def __init__(self, reasons: list[str]):
        super().__init__("; ".join(reasons))
        self.reasons = reasons


@dataclass
class Memory:
    """Bytes on one device (pipeline rank `stage`): `items` maps parameters, gradients,
    optimizer, activations, transient, reductions (ZeRO-1/2's flat gradient buffers, in flight
    from backward to the step) to bytes; `fits` against the device's memory (None without a
    cluster). A model, not a measurement.

    Gradients are set to None between steps, so they appear with the first backward, and
    the reductions with them: `peak` is the larger of the most activations before it
    (`in_flight` micro-batches, no gradients), the most after it (`with_gradients`
    micro-batches, gradients too: a later backward's own micro-batch, or 1F1B's steady
    state) with the gradients flowing back through one layer of that backward (`backward`),
    and the end of the backward (gradients, no activations). `transient` holds, beside a
    backward's own buffers, BucketedDDP's flat gradient copy, kept for the wrapper's life."""

    stage: int
    items: dict[str, float]
    in_flight: int
    with_gradients: int = 0
    backward: float = 0.0
    fits: bool | None = None

    def over(self, cluster: Cluster) -> str:
        """Why this rank does not fit one of `cluster`'s devices, in one sentence."""
        return (f"needs {self.peak / 1e9:.2f} GB on pipeline rank {self.stage}, {(self.peak - cluster.memory) / 1e9:.2f} "
                f"GB over the device's {cluster.memory / 1e9:.2f} GB")

    @property
    def peak(self) -> float:
        total = sum(self.items.values())
        per_microbatch = self.items["activations"] / self.in_flight if self.in_flight else 0.0
        states = total - self.items["activations"]
        before = states - self.items["gradients"] - self.items["reductions"]
        return max(before + self.items["activations"],
                   states + self.with_gradients * per_microbatch + (self.backward if self.with_gradients else 0),
                   states)


def layer_tensors(model: Model, tp: int, ep: int = 1) -> tuple[list[int], list[int]]:
    """(dense, expert) elements of each parameter of one transformer layer on one tp rank, in
    parakit's module order (norm1, qkv, proj, norm2, then fc1, fc2, or the router and the
    experts' fc1, fc2): column layers (qkv, fc1) split weights and biases, row layers (proj,
    fc2) split weights and keep the whole bias, layer norms replicated; an MoE layer keeps
    experts/ep experts and the router."""
    h, f, t = model.hidden, model.ffn_hidden, tp
    attention = [h, h, 3 * h * h // t, 3 * h // t, h * h // t, h, h, h]
    mlp = [h * f // t, f // t, f * h // t, h]
    if model.experts == 1:
        return attention + mlp, []
    return attention + [h * model.experts], mlp * (model.experts // ep)


def layer_params(model: Model, tp: int, ep: int = 1) -> tuple[int, int]:
    """(dense, expert) parameters of one transformer layer on one tp rank (`layer_tensors` summed)."""
    dense, expert = layer_tensors(model, tp, ep)
    return sum(dense), sum(expert)


def stage_tensors(model: Model, config: Config, stage: int) -> tuple[list[int], list[int]]:
    """(dense, expert) elements of each parameter on pipeline rank `stage` of one tp slice, in
    module order: the embedding on the rank of the first stage, layers/pp blocks, the final
    norm and output layer on the rank of the last (with zbv's V placement that is rank 0 again)."""
    dense, expert = layer_tensors(model, config.tp, config.ep)
    blocks = model.layers // config.pp
    dense, expert = dense * blocks, expert * blocks
    v_split = config.tp if model.vocab_parallel else 1
    last = 0 if config.schedule == "zbv" and config.pp > 1 else config.pp - 1
    if stage == 0:
        dense = [model.vocab * model.hidden // v_split] + ([model.seq * model.hidden] if model.positions else []) + dense
    if stage == last:
        dense = dense + [model.hidden, model.hidden]
    if stage == last and not (model.tied_embeddings and config.pp == 1):
        dense = dense + [model.vocab * model.hidden // v_split] + ([model.vocab // v_split] if model.head_bias else [])
    return dense, expert


def stage_params(model: Model, config: Config, stage: int) -> tuple[int, int]:
    """(dense, expert) parameters on pipeline rank `stage` of one tp slice (`stage_tensors` summed)."""
    dense, expert = stage_tensors(model, config, stage)
    return sum(dense), sum(expert)


@dataclass(frozen=True)
class ZeroLayout:
    """ZeRO-1/2's buckets on `ranks` ranks, as `zero.ShardedOptimizer` makes them: `chunks`,
    each bucket's segment per rank (launch order; every rank's padded to the largest);
    `owned`, the elements of the rank that owns most; `unowned_last`, the elements of the
    last bucket launched that this rank does not own (ZeRO-2 drops them just after)."""

    ranks: int
    chunks: tuple[int, ...]
    owned: int
    unowned_last: int

    @property
    def padded(self) -> int:
        """Elements of all the buckets' flat [ranks x chunk] buffers."""
        return self.ranks * sum(self.chunks)


@lru_cache(maxsize=1024)
def zero_layout(numels: tuple[int, ...], ranks: int, element: int, owners: bool) -> ZeroLayout:
    """The buckets of parameters of these sizes (module order, `element` bytes each), as
    ShardedOptimizer makes them (`zero.optimizer.owner_buckets`, BUCKET_MB MiB, reverse order,
    closed where the owners' segments are even), run on meta tensors. `owners`: parakit's
    layout, each parameter whole to one owner, each rank's segment padded to the longest (at most a quarter of a bucket; 5% for the tiny model on 4
    ranks); else the paper's, 1/ranks of every bucket to each rank (a flat partition, as
    DeepSpeed's)."""
    params = [torch.empty(n, dtype=_DTYPE[element], device="meta") for n in numels]
    buckets = owner_buckets([params], ranks, BUCKET_MB)
    if owners:
        used = [[sum(p.numel() for p, o in zip(ps, os) if o == r) for r in range(ranks)] for ps, os in buckets]
    else:
        used = [[-(-sum(p.numel() for p in ps) // ranks)] * ranks for ps, _ in buckets]
    mine = max(range(ranks), key=lambda r: sum(u[r] for u in used))
    last = sum(p.numel() for p in buckets[-1][0])
    return ZeroLayout(ranks, tuple(max(u) for u in used), sum(u[mine] for u in used), last - used[-1][mine])


def layer_activation_bytes(model: Model, config: Config) -> float:
    """Bytes one layer stores for backward for one micro-batch on one rank, by the model's
    activation model and the checkpointing policy (full: only the layer's input)."""
    s, b, h, a, t = model.seq // config.cp, config.microbatch, model.hidden, model.heads, config.tp
    sp = config.sp and t > 1
    divide = t if sp else 1
    if config.checkpointing == "full":
        return s * b * h * DTYPES[config.dtype][3] / divide
    scores = a if config.checkpointing == "none" and config.cp == 1 else 0  # flash/ring attention keep no scores
    if model.activations == "megatron":
        extra = 19 * (model.top_k - 1) if model.experts > 1 else 0  # our extension: the MLP's 19 sbh per choice
        return paper_activation_bytes(s, b, h, scores, t, sp) + s * b * h * extra / t
    # parakit's fp32 block, counted from its code (tests check it). Ring attention's output is
    # [b, heads, s, d], so the projection's [b, s, h] input is a copy (SDPA's is a view of it)
    ring = h / t if config.cp > 1 else 0
    floats = 4 * h + 4 + (4 * h + a) / t + ring + _mlp_floats(model, config)
    per_layer = s * b * 4 * (floats / divide if sp else floats)
    return per_layer + (4 * model.experts if model.experts > 1 else 0)  # the balancing loss's [E] fractions


def _mlp_floats(model: Model, config: Config) -> float:
    """Floats (int64: two) the MLP saves per token, beside its input: the dense MLP its two
    [ffn/tp] activations; parakit.moe's layer, from its code, with the routers spreading the
    k choices evenly: the router's logits and probabilities [E] and logsumexp [1], each choice's
    top-k index (int64); each kept choice's row into its expert [h], the expert's two [ffn/tp],
    its output and its gated output [2h], its gate [1], three int64 indices (and with ep > 1
    two more, for the rows received)."""
    f, t, k = model.ffn_hidden, config.tp, model.top_k
    if model.experts == 1:
        return 2 * f / t
    indices = 3 + (2 if config.ep > 1 else 0)
    return 2 * model.experts + 1 + 2 * k + k * (3 * model.hidden + 1 + 2 * f / t + 2 * indices)


def recompute_bytes(model: Model, config: Config) -> float:
    """What full checkpointing's backward of one layer holds beyond the stored inputs: the
    layer's activations recomputed in full, and the gradients flowing back through it: its
    output's [microbatch, seq, hidden] and two of the MLP's [microbatch, seq, ffn/tp] (the
    gradient of fc2's input while fc1's output's is made; measured on plan.measure's runs).
    The planner counts it with the micro-batch's stored inputs, on top of all the gradients."""
    return layer_activation_bytes(model, replace(config, checkpointing="none")) + _flowing(model, config)


def _flowing(model: Model, config: Config) -> float:
    """The gradients flowing back through one layer in a backward: its output's [microbatch,
    seq, hidden] and two of the MLP's [microbatch, seq, ffn/tp]; a mixture's experts run their
    backwards one after another, each on its top_k / (experts/ep) share of the tokens."""
    s, b, act = model.seq // config.cp, config.microbatch, DTYPES[config.dtype][3]
    sp = config.sp and config.tp > 1
    share = model.top_k * config.ep / model.experts if model.experts > 1 else 1
    return s * b * act * (model.hidden / (config.tp if sp else 1) + 2 * model.ffn_hidden * share / config.tp)


def stage_extra_bytes(model: Model, config: Config, stage: int) -> float:
    """Activations outside the layers ("parakit" model only; Korthikanti's formula counts
    the layers): the token ids (int64) on the first stage; the final norm's input and
    output, its statistics and the log-softmax over the vocabulary on the last."""
    if model.activations != "parakit":
        return 0.0
    tokens = model.seq // config.cp * config.microbatch
    last = 0 if config.schedule == "zbv" and config.pp > 1 else config.pp - 1
    extra = 8 * tokens if stage == 0 else 0
    if stage == last:
        extra += tokens * 4 * (2 * model.hidden + 2 + model.vocab // (config.tp if model.vocab_parallel else 1))
    return extra


def in_flight(config: Config) -> list[int]:
    """Micro-batch activations (per stage chunk) each pipeline rank holds at its peak, from
    the simulator of `parakit.pipeline` running the configuration's schedule."""
    if config.pp == 1:
        return [1]
    v = config.v if config.schedule in ("interleaved", "zbv") else None
    return list(_peaks(config.schedule, config.pp, config.microbatches, v))


@lru_cache(maxsize=512)
def built_schedule(schedule: str, p: int, m: int, v: int | None) -> Schedule:
    """build_schedule's (frozen) Schedule, built once per shape: a search prices the same
    few shapes under many configurations' times."""
    return build_schedule(schedule, p, m, v)


@lru_cache(maxsize=512)
def _peaks(schedule: str, p: int, m: int, v: int | None) -> tuple[int, ...]:
    return tuple(simulate(built_schedule(schedule, p, m, v)).peak_activations)


def in_flight_with_gradients(config: Config) -> list[int]:
    """The most micro-batch activations each pipeline rank holds once it has run a backward
    (so gradients exist beside them): at a later forward (1F1B's steady state) or at the
    start of a later backward, its own micro-batch included (GPipe: m - 1). From the
    simulator's events, counted as it counts peaks."""
    if config.pp == 1:
        return [1 if config.microbatches > 1 else 0]
    v = config.v if config.schedule in ("interleaved", "zbv") else None
    return list(_after_backward(config.schedule, config.pp, config.microbatches, v))


@lru_cache(maxsize=512)
def _after_backward(schedule: str, p: int, m: int, v: int | None) -> tuple[int, ...]:
    line = simulate(built_schedule(schedule, p, m, v))
    split = any(e.action.op == "W" for e in line.events)
    release = "W" if split else "B"
    out = []
    for r in range(p):
        stored, seen, best = 0, False, 0
        for e in sorted((e for e in line.events if e.rank == r), key=lambda e: (e.start, e.end)):
            stored += 1 if e.action.op == "F" else -1 if e.action.op == release else 0
            if seen and e.action.op in ("F", "B"):  # a forward, or a backward with its own micro-batch, after the first
                best = max(best, stored + (1 if e.action.op == "B" and release == "B" else 0))
            seen = seen or e.action.op == "B"
        out.append(best)
    return tuple(out)


def memory(model: Model, cluster: Cluster | None, config: Config, stage: int | None = None,
           backend: str = "nccl") -> Memory:
    """Bytes on pipeline rank `stage` (default: the rank with the largest peak). Raises
    PlanError with every reason when the configuration cannot run. ZeRO-1/2 as parakit's
    ShardedOptimizer runs it: parameters in its buckets' flat buffers, every bucket's flat
    gradient copy in flight from backward to the step; backend="gloo" lays the buckets out
    as parakit does (`zero_layout`, owners), "nccl" (a GPU cluster) as the paper (even)."""
    reasons = problems(model, cluster, config)
    if reasons:
        raise PlanError(reasons)
    if stage is None:
        return max((memory(model, cluster, config, r, backend) for r in range(config.pp)), key=lambda m: m.peak)
    pbytes, gbytes, k, _ = DTYPES[config.dtype]
    states = dict.fromkeys(("parameters", "gradients", "optimizer", "reductions"), 0.0)
    shards = config.dp * config.cp
    for tensors, ranks in zip(stage_tensors(model, config, stage), (shards, shards // config.ep)):
        if not tensors:
            continue
        if config.zero in (1, 2) and ranks > 1:
            layout = zero_layout(tuple(tensors), ranks, gbytes, backend == "gloo")
            states["parameters"] += layout.padded * pbytes
            states["gradients"] += (sum(tensors) if config.zero == 1 else layout.owned) * gbytes
            states["optimizer"] += layout.owned * k
            # the flat buffers, a reduce-scatter's [chunk] outputs, and at stage 2 the last bucket's
            # gradients that are dropped only once its flat copy is made
            states["reductions"] += (layout.padded + (sum(layout.chunks) if backend != "gloo" else 0)
                                     + (layout.unowned_last if config.zero == 2 else 0)) * gbytes
            continue
        for kind, nbytes in zero_bytes(sum(tensors), ranks, config.zero, k, pbytes, gbytes).items():
            states[kind] += nbytes
    held = in_flight(config)[stage]
    layers_per_chunk = model.layers // (config.pp * config.v)
    per_layer = layer_activation_bytes(model, config)
    activations = held * (layers_per_chunk * per_layer + stage_extra_bytes(model, config, stage))
    transient = 0.0
    if config.checkpointing == "full":  # during a backward, with the gradients there: see recompute_bytes
        transient += recompute_bytes(model, config) + per_layer * layers_per_chunk
    if config.zero == 3:  # one unit (a layer) gathered, its full gradients, and their flat copy for the reduce-scatter
        transient += 3 * sum(layer_params(model, config.tp, config.ep)) * pbytes
    if config.ddp_buckets and config.zero == 0:  # the buckets hold a second copy of the gradients
        transient += states["gradients"]
    items = {**states, "activations": activations, "transient": transient}
    flowing = _flowing(model, config) if config.checkpointing != "full" else 0.0  # full: in the transient
    result = Memory(stage, items, held, in_flight_with_gradients(config)[stage], flowing)
    if cluster is not None:
        result.fits = result.peak <= cluster.memory
    return result
