"""The search: every configuration of a cluster's devices for a model and a global batch,
the ones that fit ordered by predicted step time, the others with their reasons."""
from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product

from parakit.plan.memory import PlanError, memory
from parakit.plan.spec import Cluster, Config, Model
from parakit.plan.time import step_time

__all__ = ["Candidate", "search", "divisors"]


@dataclass
class Candidate:
    """A configuration with its predicted peak bytes and step seconds, or the reasons it
    cannot run (`reasons`, empty when it can)."""

    config: Config
    peak: float = 0.0
    seconds: float = float("inf")
    reasons: tuple[str, ...] = ()


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _candidates(model: Model, cluster: Cluster, global_batch: int, microbatch_sizes, zero_stages, checkpointing,
                max_pp: int):
    n = cluster.devices
    for tp, pp, cp in product(divisors(n), repeat=3):
        if n % (tp * pp * cp) or pp > max_pp or tp > cluster.devices_per_node:
            continue
        dp = n // (tp * pp * cp)
        for ep, mb, zero, ckpt in product(divisors(dp * cp) if model.experts > 1 else [1], microbatch_sizes,
                                          zero_stages, checkpointing):
            if global_batch % (dp * mb):
                continue
            m = global_batch // (dp * mb)
            schedules = [("1f1b", 1)] + ([("interleaved", 2)] if pp > 1 else [])
            for schedule, v in schedules:
                yield Config(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, sp=tp > 1, schedule=schedule, v=v, microbatches=m,
                             microbatch=mb, zero=zero, checkpointing=ckpt)


def search(model: Model, cluster: Cluster, global_batch: int, microbatch_sizes=(1, 2, 4), zero_stages=(0, 1, 2, 3),
           checkpointing=("none", "selective", "full"), max_pp: int = 8,
           outers=("dp",)) -> tuple[list[Candidate], list[Candidate]]:
    """(fitting, rejected): the configurations that fit, fastest first (ties: less memory),
    and the others with each reason (a broken constraint, or the bytes over the device's
    memory). sp is on wherever tp > 1; pipelines try 1F1B and interleaved 1F1B with v = 2;
    tp stays within a node and pp at most `max_pp` (the space the search walks); with dp > 1
    and pp > 1 a fitting configuration is timed with each of `outers` outermost (("dp", "pp"):
    both; the memory is the same, the links the groups cross are not)."""
    fits, rejected = [], []
    for config in _candidates(model, cluster, global_batch, microbatch_sizes, zero_stages, checkpointing, max_pp):
        try:
            mem = memory(model, cluster, config)
        except PlanError as err:
            rejected.append(Candidate(config, reasons=tuple(err.reasons)))
            continue
        if not mem.fits:
            rejected.append(Candidate(config, mem.peak, reasons=(mem.over(cluster),)))
            continue
        for layout in [replace(config, outer=o) for o in (outers if config.dp > 1 and config.pp > 1 else ("dp",))]:
            fits.append(Candidate(layout, mem.peak, step_time(model, cluster, layout).total))
    fits.sort(key=lambda c: (c.seconds, c.peak))
    return fits, rejected
