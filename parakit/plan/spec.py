"""What the planner is asked about: a transformer, a cluster and a parallel configuration,
and the checks that say why a configuration cannot run (which constraint, by how much).

Ranks are laid out as parakit's mesh lays them out, innermost first: tp, cp, ep, pp, dp
(tp neighbours share a node, where links are fastest; replicas talk least). ep groups are
carved out of the data-parallel ranks, as in Megatron's expert parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Model", "Cluster", "Config", "DTYPES", "SCHEDULES", "CHECKPOINTING", "problems", "degrees"]

DTYPES = {  # name -> (parameter bytes, gradient bytes, optimizer bytes K per parameter, activation bytes)
    "bf16": (2, 2, 12, 2),  # mixed precision with Adam: fp32 master, momentum, variance (the ZeRO paper's K = 12)
    "fp32": (4, 4, 8, 4),  # everything fp32 with Adam: momentum and variance
}
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbh1", "zbv")
CHECKPOINTING = ("none", "selective", "full")


@dataclass(frozen=True)
class Model:
    """A decoder-only transformer. `ffn` defaults to 4 hidden; `experts` > 1 makes every MLP
    a mixture of `experts` experts of width `ffn`, `top_k` of them per token. `activations`
    names the activation model: "megatron" (Korthikanti et al.: 16-bit, dropout masks,
    attention scores stored) or "parakit" (parakit's fp32 block: no dropout, attention
    without stored scores). `positions`: learned position embeddings; `vocab_parallel`:
    embedding and output layer split over tp (else replicated); `head_bias`: the output
    layer has a bias (parakit.train's model: positions, replicated vocabulary, a bias)."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ffn: int | None = None
    experts: int = 1
    top_k: int = 1
    tied_embeddings: bool = False
    positions: bool = False
    vocab_parallel: bool = True
    head_bias: bool = False
    activations: str = "megatron"

    @property
    def ffn_hidden(self) -> int:
        return self.ffn or 4 * self.hidden


@dataclass(frozen=True)
class Cluster:
    """`nodes` x `devices_per_node` devices of `memory` bytes and `flops` peak FLOP/s each,
    of which a step achieves `efficiency` (a model: 0.4 to 0.5 is what large runs report).
    Links by the alpha-beta model: a message of n bytes takes alpha + n / bandwidth (seconds,
    bytes per second per device), intra- or inter-node."""

    devices_per_node: int
    nodes: int
    memory: float
    flops: float
    intra_latency: float = 5e-6
    intra_bandwidth: float = 150e9
    inter_latency: float = 10e-6
    inter_bandwidth: float = 25e9
    efficiency: float = 0.45

    @property
    def devices(self) -> int:
        return self.devices_per_node * self.nodes


@dataclass(frozen=True)
class Config:
    """A parallel configuration. dp x tp x pp x cp devices (ep divides dp x cp: expert
    parallelism reuses those ranks); `v` stages per pipeline rank for "interleaved"/"zbv";
    `microbatches` m per step; `microbatch` sequences each; ZeRO `zero` stage 0-3 over dp;
    `sp` sequence parallelism on the tp group; `outer` the outermost of dp and pp in the
    ranks' layout (parakit.mesh.Mesh's `outer`): the one whose groups span the most nodes."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sp: bool = False
    schedule: str = "1f1b"
    v: int = 1
    microbatches: int = 1
    microbatch: int = 1
    zero: int = 0
    dtype: str = "bf16"
    checkpointing: str = "none"
    ddp_buckets: bool = False  # gradients also copied into flat buckets (parakit's BucketedDDP; torch DDP by default)
    outer: str = "dp"

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def global_batch(self) -> int:
        return self.dp * self.microbatches * self.microbatch

    def __str__(self) -> str:
        parts = [f"{k}{getattr(self, k)}" for k in ("dp", "tp", "pp", "cp", "ep") if getattr(self, k) > 1]
        if self.sp:
            parts.append("sp")
        if self.pp > 1:
            parts.append(f"{self.schedule}" + (f" v{self.v}" if self.v > 1 else ""))
        if self.pp > 1 or self.microbatches > 1:
            parts.append(f"m{self.microbatches}")
        parts += [f"mb{self.microbatch}", f"zero{self.zero}", self.dtype]
        if self.checkpointing != "none":
            parts.append(f"ckpt-{self.checkpointing}")
        if self.outer != "dp":
            parts.append(f"{self.outer}-outer")
        return " ".join(parts)


def degrees(config: Config) -> dict[str, int]:
    return {k: getattr(config, k) for k in ("dp", "tp", "pp", "cp", "ep")}


def problems(model: Model, cluster: Cluster | None, config: Config) -> list[str]:
    """Why `config` cannot run `model` on `cluster`, one sentence each naming the constraint
    and by how much ([] when it can; memory is checked by `plan.memory`)."""
    out = []
    bad = {k: n for k, n in degrees(config).items() if n < 1}
    if bad:
        return [f"degrees must be at least 1: {bad}"]
    if cluster is not None and config.devices != cluster.devices:
        out.append(f"dp x tp x pp x cp = {config.dp} x {config.tp} x {config.pp} x {config.cp} = {config.devices} "
                   f"devices, but the cluster has {cluster.devices} ({cluster.devices - config.devices:+d})")
    for what, n, by, d in (("heads", model.heads, "tp", config.tp), ("hidden", model.hidden, "heads", model.heads),
                           ("ffn", model.ffn_hidden, "tp", config.tp),
                           ("seq", model.seq, "2 cp (zig-zag chunks)", 2 * config.cp if config.cp > 1 else 1),
                           ("experts", model.experts, "ep", config.ep),
                           ("layers", model.layers, "pp x v", config.pp * config.v)):
        if n % d:
            out.append(f"{what} = {n} does not split evenly over {by} = {d} (remainder {n % d})")
    if config.sp and config.tp > 1 and model.seq % (config.tp * config.cp):
        out.append(f"sequence parallelism splits seq/cp = {model.seq // config.cp} over tp = {config.tp} "
                   f"(remainder {(model.seq // config.cp) % config.tp})")
    if config.ep > 1 and model.experts == 1:
        out.append(f"ep = {config.ep} but the model has no experts")
    if (config.dp * config.cp) % config.ep:
        out.append(f"ep = {config.ep} must divide dp x cp = {config.dp * config.cp} (remainder "
                   f"{(config.dp * config.cp) % config.ep})")
    if config.outer not in ("dp", "pp"):
        out.append(f"outer = {config.outer!r}: the outermost dimension is 'dp' or 'pp'")
    if config.schedule not in SCHEDULES:
        out.append(f"unknown schedule {config.schedule!r}: use one of {', '.join(SCHEDULES)}")
    elif config.pp > 1 and config.schedule in ("1f1b", "interleaved", "zbh1", "zbv") and config.microbatches < config.pp:
        out.append(f"{config.schedule} needs microbatches >= pp: {config.microbatches} < {config.pp} "
                   f"(short by {config.pp - config.microbatches})")
    if config.schedule == "zbv" and config.v != 2 and config.pp > 1:
        out.append(f"zbv runs v = 2 stages per rank, not {config.v}")
    if config.schedule not in ("interleaved", "zbv") and config.v != 1:
        out.append(f"v = {config.v} stages per rank needs schedule 'interleaved' (or 'zbv' with v = 2)")
    if config.zero not in (0, 1, 2, 3):
        out.append(f"ZeRO stage {config.zero} does not exist: use 0, 1, 2 or 3")
    if config.dtype not in DTYPES:
        out.append(f"unknown dtype {config.dtype!r}: use one of {', '.join(DTYPES)}")
    if config.checkpointing not in CHECKPOINTING:
        out.append(f"unknown checkpointing {config.checkpointing!r}: use one of {', '.join(CHECKPOINTING)}")
    if model.activations not in ("megatron", "parakit"):
        out.append(f"unknown activation model {model.activations!r}: use 'megatron' or 'parakit'")
    if model.top_k > model.experts:
        out.append(f"top_k = {model.top_k} exceeds experts = {model.experts}")
    return out
