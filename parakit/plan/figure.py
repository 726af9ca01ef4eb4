"""The planner drawn: stacked memory bars per pipeline rank, and a step-time bar split into
compute, exposed communication and bubble (both models)."""
from __future__ import annotations

import matplotlib.pyplot as plt

from parakit.plan.memory import PlanError, memory
from parakit.plan.spec import Cluster, Config, Model
from parakit.plan.time import step_time

__all__ = ["draw_plan"]

KINDS = ("parameters", "gradients", "optimizer", "reductions", "activations", "transient")


def draw_plan(model: Model, cluster: Cluster, config: Config):
    """Left: bytes per pipeline rank, stacked by kind, against the device's memory. Right:
    one step's seconds: compute, exposed communication by group, bubble. A configuration that
    cannot run is drawn as its reasons; one whose bytes do not fit keeps its bars, and says so
    where its step time would be."""
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.2), gridspec_kw={"width_ratios": [max(config.pp, 2), 3]})
    try:
        stages = [memory(model, cluster, config, r) for r in range(config.pp)]
        time = step_time(model, cluster, config)
    except PlanError as err:
        for axis in (left, right):
            axis.axis("off")
        left.text(0, 0.5, "cannot run:\n" + "\n".join(err.reasons), fontsize=8, va="center", wrap=True)
        return figure
    bottom = [0.0] * config.pp
    for kind in KINDS:
        values = [s.items[kind] / 1e9 for s in stages]
        left.bar(range(config.pp), values, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values)]
    left.axhline(cluster.memory / 1e9, color="k", ls="--", lw=1, label="device memory")
    left.set(xlabel="pipeline rank", ylabel="GB per device (model)", xticks=range(config.pp))
    left.legend(fontsize=7, ncol=4, loc="lower left", bbox_to_anchor=(0, 1.02), frameon=False)  # above: off the bars
    worst = max(stages, key=lambda s: s.peak)
    if worst.fits is False:
        right.axis("off")
        right.text(0, 0.5, f"{config}\ncannot run: {worst.over(cluster)}", fontsize=8, va="center", wrap=True)
        figure.tight_layout()
        return figure
    parts = [("compute", time.compute)] + [(f"{g} exposed", s) for g, s in time.exposed.items()] + [("bubble", time.bubble)]
    start = 0.0
    for name, seconds in parts:
        right.barh(0, seconds, left=start, label=name)
        start += seconds
    right.set(yticks=[], xlabel="seconds per step (model)", title=f"{config}: {time.total:.2f} s")
    right.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    figure.tight_layout()
    return figure
