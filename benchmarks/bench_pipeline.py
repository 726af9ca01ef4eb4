"""Pipeline parallelism: parakit's GPipe and 1F1B against torch.distributed.pipelining's
ScheduleGPipe and Schedule1F1B on the same model and split, and the measured bubble
against the simulator and the formula.

    .venv/bin/python benchmarks/bench_pipeline.py [--steps 5] [--hidden 1024] [--microbatch 64]

On p = 2 gloo ranks, m = 8 micro-batches, a stack of 8 Linear(hidden, hidden) + ReLU layers
split [4, 4]: the median step time of each (a barrier before every step) and parakit's over
torch's; each rank's idle fraction from parakit's runtime time line (the median step),
beside the simulator replaying that step's measured F and B times and beside
(p-1)/(m+p-1). The simulator's bubble is also checked to equal the formulas exactly on a
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


def on_ranks(schedule, hidden, microbatch, steps):
    """Step times of parakit's and torch's `schedule` on this rank, and parakit's RankRuns."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(8)]).to(parakit.device())
    x = torch.randn(M * microbatch, hidden, device=parakit.device())
    y = torch.randn(M * microbatch, hidden, device=parakit.device())
    stage = PipelineStage(pipeline.split_stages(model, [4, 4])[rank], rank, P, parakit.device())
    theirs = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](stage, M, loss_fn=F.mse_loss)
    ours_times, theirs_times, runs = [], [], []
    for step in range(steps + 1):  # step 0 warms up
        dist.barrier()
        start = time.perf_counter()
        runs.append(pipeline.pipeline_run(model, [4, 4], x, y, F.mse_loss, schedule, num_microbatches=M))
        dist.barrier()
        ours_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        theirs.step(x) if rank == 0 else theirs.step(target=y, losses=[])
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
    for schedule in ("gpipe", "1f1b"):
        results = parakit.launch(on_ranks, schedule, options.hidden, options.microbatch, options.steps,
                                 world_size=P, timeout=600)
        ours = statistics.median(max(r[0][k] for r in results) for k in range(options.steps))
        theirs = statistics.median(max(r[1][k] for r in results) for k in range(options.steps))
        timelines = [pipeline.timeline_of([r[2][k] for r in results]) for k in range(options.steps)]
        measured = sorted(timelines, key=lambda t: t.makespan)[len(timelines) // 2]
        simulated = pipeline.simulate(pipeline.build_schedule(schedule, P, M), measured.action_times())
        formula = float(pipeline.bubble_formula(P, M))
        gap = abs(float(measured.bubble) - float(simulated.bubble))
        want_peak = [M] * P if schedule == "gpipe" else [P - r for r in range(P)]
        rows += [
            (f"{schedule}: parakit step time", f"{ours * 1e3:8.1f} ms", "", ""),
            (f"{schedule}: torch.distributed.pipelining step", f"{theirs * 1e3:8.1f} ms", "", ""),
            (f"{schedule}: parakit / torch", f"{ours / theirs:8.2f} x ", "", ""),
            (f"{schedule}: idle fraction measured", f"{float(measured.bubble):8.3f}   ", "", ""),
            (f"{schedule}: idle fraction simulated", f"{float(simulated.bubble):8.3f}   ", "|diff| <= 0.1", mark(gap <= 0.1)),
            (f"{schedule}: (p-1)/(m+p-1)", f"{formula:8.3f}   ", "", ""),
            (f"{schedule}: peak activations measured", f"{str(measured.peak_activations):>11}", f"= {want_peak}",
             mark(measured.peak_activations == want_peak)),
        ]
        figures[schedule] = {"parakit_step_s": ours, "torch_step_s": theirs, "ratio": ours / theirs,
                             "idle_measured": float(measured.bubble), "idle_simulated": float(simulated.bubble),
                             "formula": formula, "peak_activations": measured.peak_activations,
                             "mean_forward_s": measured.mean_time("F"), "mean_backward_s": measured.mean_time("B")}
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
