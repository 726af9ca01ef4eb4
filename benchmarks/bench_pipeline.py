"""Pipeline parallelism: parakit's GPipe, 1F1B and zero-bubble schedules against
torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B and ScheduleZBVZeroBubble on the
same model and split, and the measured bubble against the simulator and the formula.

    .venv/bin/python benchmarks/bench_pipeline.py [--steps 5] [--hidden 1024] [--microbatch 64]

On p = 2 gloo ranks, m = 8 micro-batches, a stack of 8 Linear(hidden, hidden) + ReLU layers
split [4, 4] (ZB-V: [2, 2, 2, 2], two stages per rank in a V): the median step time of each
(a barrier before every step) and parakit's over torch's (ZB-H1 has no counterpart in torch
with one stage per rank: its time is set beside parakit's 1F1B); each rank's idle fraction
from parakit's runtime time line (the median step), beside the simulator replaying that
step's measured F, B and W times and beside (p-1)/(m+p-1). The simulator's bubble is also checked to equal the formulas exactly on a
grid of p, m (and v). Bars are marked PASS or FAIL; nothing is asserted. The figures are
also written to benchmarks/results/bench_pipeline.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import parakit
from parakit import pipeline

ROOT = Path(__file__).resolve().parents[1]
P, M = 2, 8


TORCH = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "zbv": "ScheduleZBVZeroBubble"}  # zbh1: none


def on_ranks(schedule, hidden, microbatch, steps):
    """Step times of parakit's and torch's `schedule` on this rank (torch's: [] where it has
    none), and parakit's RankRuns."""
    from torch.distributed import pipelining

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(8)]).to(parakit.device())
    x = torch.randn(M * microbatch, hidden, device=parakit.device())
    y = torch.randn(M * microbatch, hidden, device=parakit.device())
    balance = [2] * 2 * P if schedule == "zbv" else [8 // P] * P
    stages, plan = pipeline.split_stages(model, balance), pipeline.build_schedule(schedule, P, M)
    theirs = None
    if schedule in TORCH:
        mine = [pipelining.PipelineStage(stages[s], s, len(stages), parakit.device()) for s in plan.stages_of(rank)]
        theirs = getattr(pipelining, TORCH[schedule])(mine if len(mine) > 1 else mine[0], M, loss_fn=F.mse_loss)
    last = plan.rank_of(len(stages) - 1) == rank
    ours_times, theirs_times, runs = [], [], []
    for step in range(steps + 1):  # step 0 warms up
        dist.barrier()
        start = time.perf_counter()
        runs.append(pipeline.pipeline_run(model, balance, x, y, F.mse_loss, schedule, num_microbatches=M))
        dist.barrier()
        ours_times.append(time.perf_counter() - start)
        if theirs is not None:
            start = time.perf_counter()
            theirs.step(*([x] if rank == 0 else []), **(dict(target=y, losses=[]) if last else {}))
            dist.barrier()
            theirs_times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return ours_times[1:], theirs_times[1:], runs[1:]


def exact_grid() -> bool:
    """The simulator's bubble equals the formula exactly for every p, m (and v) on a grid."""
    ok = True
    for p in range(1, 9):
        for m in range(1, 33):
            ok &= pipeline.simulate(pipeline.build_schedule("gpipe", p, m)).bubble == pipeline.bubble_formula(p, m)
            if m >= p:
                ok &= pipeline.simulate(pipeline.build_schedule("1f1b", p, m)).bubble == pipeline.bubble_formula(p, m)
            if m % p == 0:
                for v in (2, 3):
                    timeline = pipeline.simulate(pipeline.build_schedule("interleaved", p, m, v))
                    ok &= timeline.bubble == pipeline.bubble_formula(p, m, v)
    return ok


def mark(ok):
    return "PASS" if ok else "FAIL"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per schedule (after one warm-up)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--microbatch", type=int, default=64, help="rows per micro-batch")
    options = parser.parse_args()

    rows, figures = [], {}
    for schedule in ("gpipe", "1f1b", "zbh1", "zbv"):
        results = parakit.launch(on_ranks, schedule, options.hidden, options.microbatch, options.steps,
                                 world_size=P, timeout=600)
        ours = statistics.median(max(r[0][k] for r in results) for k in range(options.steps))
        theirs = statistics.median(max(r[1][k] for r in results) for k in range(options.steps)) if results[0][1] else None
        timelines = [pipeline.timeline_of([r[2][k] for r in results]) for k in range(options.steps)]
        measured = sorted(timelines, key=lambda t: t.makespan)[len(timelines) // 2]
        simulated = pipeline.simulate(pipeline.build_schedule(schedule, P, M), measured.action_times())
        formula = float(pipeline.bubble_formula(P, M))
        gap = abs(float(measured.bubble) - float(simulated.bubble))
        want_peak = simulated.peak_activations  # the order's, whatever the times
        rows += [(f"{schedule}: parakit step time", f"{ours * 1e3:8.1f} ms", "", "")]
        if theirs is not None:
            rows += [(f"{schedule}: torch.distributed.pipelining step", f"{theirs * 1e3:8.1f} ms", "", ""),
                     (f"{schedule}: parakit / torch", f"{ours / theirs:8.2f} x ", "", "")]
        else:
            rows += [(f"{schedule}: parakit / parakit's 1f1b", f"{ours / figures['1f1b']['parakit_step_s']:8.2f} x ", "", "")]
        rows += [
            (f"{schedule}: idle fraction measured", f"{float(measured.bubble):8.3f}   ", "", ""),
            (f"{schedule}: idle fraction simulated", f"{float(simulated.bubble):8.3f}   ", "|diff| <= 0.1", mark(gap <= 0.1)),
            (f"{schedule}: (p-1)/(m+p-1)", f"{formula:8.3f}   ", "", ""),
            (f"{schedule}: peak activations measured", f"{str(measured.peak_activations):>11}", f"= {want_peak}",
             mark(measured.peak_activations == want_peak)),
        ]
        figures[schedule] = {"parakit_step_s": ours, "torch_step_s": theirs, "ratio": ours / theirs if theirs else None,
                             "idle_measured": float(measured.bubble), "idle_simulated": float(simulated.bubble),
                             "formula": formula, "peak_activations": measured.peak_activations,
                             "mean_forward_s": measured.mean_time("F"), "mean_backward_s": measured.mean_time("B")}
        if schedule.startswith("zb"):
            figures[schedule]["mean_weight_s"] = measured.mean_time("W")
    exact = exact_grid()
    rows.append(("simulator bubble = formula, p<=8, m<=32, v<=3", "exact" if exact else "differs", "exact", mark(exact)))

    print(f"pipeline parallelism, p={P}, m={M}, 8 x Linear({options.hidden}) split [4, 4], micro-batch "
          f"{options.microbatch} rows -- torch {torch.__version__}, {os.cpu_count()} CPU cores, gloo, "
          f"median of {options.steps} steps")
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'figure':>11}  {'bar':<14} result")
    print("-" * (width + 36))
    for name, figure, bar, result in rows:
        print(f"{name:<{width}}  {figure:>11}  {bar:<14} {result}".rstrip())
    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "bench_pipeline.json").write_text(json.dumps({"torch": torch.__version__, "cpu_count": os.cpu_count(),
                                                             "simulator_exact": exact, **figures}, indent=2))


if __name__ == "__main__":
    main()
