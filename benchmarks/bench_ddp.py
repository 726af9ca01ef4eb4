"""Step time of parakit's four DDP wrappers against torch's DistributedDataParallel.

    .venv/bin/python benchmarks/bench_ddp.py [--steps 12] [--rounds 3]

On world size 2 (gloo, CPU, parakit.launch), for MLPs of several sizes, one training step
(forward, backward, gradient synchronisation, SGD step, zero_grad) is timed on each rank
for each wrapper, the wrappers taking turns in --rounds rounds of --steps steps after two
warm-up steps each; a step's time is the slower rank's, and the figure is the median over
all timed steps. Every wrapper wraps a copy of the same model and sees the same data.
Printed as seconds per step and as ratios to torch's DDP (both bucket at 25 MiB); the
issue's bar (BucketedDDP within 1.10x of torch's DDP on the largest model) is marked PASS
or FAIL. The figures are also written to benchmarks/results/bench_ddp.json.
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import parakit

ROOT = Path(__file__).resolve().parents[1]
WRAPPERS = ["torch DDP", "NaiveDDP", "FlatDDP", "OverlapDDP", "BucketedDDP"]
MODELS = {"small (4 x 256)": (256, 4), "medium (4 x 1024)": (1024, 4), "large (6 x 2048)": (2048, 6)}
BAR = 1.10


def make_mlp(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def wrap(kind: str, net: nn.Module):
    """The wrapped model and the function that finishes its gradient synchronisation."""
    from parakit import ddp

    if kind == "torch DDP":
        model = nn.parallel.DistributedDataParallel(net)
        return model, lambda: None
    model = getattr(ddp, kind)(net)
    return model, model.finish_gradient_synchronization


def time_steps(width: int, depth: int, batch: int, steps: int, rounds: int) -> dict[str, list[float]]:
    """On each rank: seconds of each timed step per wrapper (the slower rank's, via all-reduce MAX)."""
    net = make_mlp(width, depth)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
    setups = {kind: wrap(kind, copy.deepcopy(net)) for kind in WRAPPERS}
    optims = {kind: torch.optim.SGD(model.parameters(), lr=1e-4) for kind, (model, _) in setups.items()}
    times = {kind: [] for kind in WRAPPERS}
    for round_ in range(rounds):
        for kind, (model, finish) in setups.items():
            for step in range(steps + (2 if round_ == 0 else 0)):
                dist.barrier()
                start = time.perf_counter()
                nn.functional.mse_loss(model(x), y).backward()
                finish()
                optims[kind].step()
                optims[kind].zero_grad()
                seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
                if round_ or step >= 2:
                    times[kind].append(seconds.item())
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    table = {}
    for name, (width, depth) in MODELS.items():
        times = parakit.launch(time_steps, width, depth, args.batch, args.steps, args.rounds,
                               world_size=2, backend="gloo", timeout=1800)[0]
        table[name] = {kind: statistics.median(ts) for kind, ts in times.items()}
    print(f"DDP step time, world size 2, gloo, batch {args.batch} per rank, median of "
          f"{args.steps * args.rounds} steps; ratio to torch's DDP in brackets")
    print(f"{'model':<20}{'MiB':>7}" + "".join(f"{kind:>20}" for kind in WRAPPERS))
    for name, row in table.items():
        width, depth = MODELS[name]
        mib = depth * (width * width + width) * 4 / 2**20
        cells = "".join(f"{row[k] * 1e3:>11.1f} ms ({row[k] / row['torch DDP']:.2f}x)" for k in WRAPPERS)
        print(f"{name:<20}{mib:>7.1f}{cells}")
    largest = list(table)[-1]
    ratio = table[largest]["BucketedDDP"] / table[largest]["torch DDP"]
    print(f"bar: BucketedDDP within {BAR:.2f}x of torch DDP on {largest}: {ratio:.3f}x "
          f"{'PASS' if ratio <= BAR else 'FAIL'}")
    results = {"models": table, "bucketed_over_torch_largest": ratio, "bar": BAR, "steps": args.steps,
               "rounds": args.rounds, "batch": args.batch, "machine": platform.platform(),
               "torch": torch.__version__}
    (ROOT / "benchmarks" / "results").mkdir(exist_ok=True)
    (ROOT / "benchmarks" / "results" / "bench_ddp.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
