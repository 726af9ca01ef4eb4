"""Activation checkpointing: saved bytes and step time with and without checkpointing,
parakit's against torch.utils.checkpoint.

    .venv/bin/python benchmarks/bench_checkpoint.py [--repeats 15] [--sizes 64x256 128x1024]

Measured in this run, one process, float32, for a 16-layer MLP (Linear + ReLU) at each
BATCHxHIDDEN size:
  - activations autograd saves after the forward and at the peak (`ck.saved_bytes`: unique
    storages seen by saved-tensor hooks, parameters apart) for no checkpointing, parakit's
    `checkpoint_sequential` with 4 segments, and torch's reentrant `checkpoint_sequential`
    (torch's non-reentrant one packs its tensors with hooks of its own, which these hooks
    cannot see);
  - the median forward + backward step time of each, torch's non-reentrant variant included,
    the variants taken in turn within every repeat so that a busy machine slows all alike.
Printed as ratios to no checkpointing and parakit's time as a ratio to torch's. The issue's
bars (saved bytes at 4 segments <= 0.35 of none, step time <= 1.5x) get PASS or FAIL;
nothing is asserted. On small layers the fixed cost of a checkpoint (RNG state, one more
autograd node) weighs more than on large ones, hence two sizes.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from parakit import checkpoint as ck

LAYERS, SEGMENTS = 16, 4


def variants(model: nn.Sequential) -> dict:
    return {
        "none": model,
        "parakit": lambda x: ck.checkpoint_sequential(model, SEGMENTS, x),
        "torch reentrant": lambda x: torch_checkpoint.checkpoint_sequential(model, SEGMENTS, x, use_reentrant=True),
        "torch non-reentrant": lambda x: torch_checkpoint.checkpoint_sequential(model, SEGMENTS, x,
                                                                                use_reentrant=False),
    }


def step_times(runs: dict, x: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median seconds of forward + backward per variant, the variants interleaved."""
    times = {name: [] for name in runs}
    for repeat in range(repeats + 1):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn(x).sum().backward()
            if repeat:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def bench(batch: int, hidden: int, repeats: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(LAYERS)])
    x = torch.randn(batch, hidden, requires_grad=True)
    runs = variants(model)
    saved = {name: ck.saved_bytes(runs[name], x, parameters=model.parameters())
             for name in ("none", "parakit", "torch reentrant")}
    seconds = step_times(runs, x, repeats)
    print(f"\n{LAYERS}-layer MLP, batch {batch}, hidden {hidden}, {SEGMENTS} segments "
          f"(no checkpointing: {seconds['none'] * 1e3:.1f} ms per step)")
    print(f"{'variant':>20} {'after forward':>14} {'peak':>10} {'step':>7}")
    for name in runs:
        bytes_ = (f"{saved[name].forward / saved['none'].forward:>13.3f}x {saved[name].peak / saved['none'].peak:>9.3f}x"
                  if name in saved else f"{'(hooks blind)':>14} {'':>10}")
        print(f"{name:>20} {bytes_} {seconds[name] / seconds['none']:>6.2f}x")
    print(f"parakit / torch: step {seconds['parakit'] / seconds['torch reentrant']:.2f}x reentrant, "
          f"{seconds['parakit'] / seconds['torch non-reentrant']:.2f}x non-reentrant; saved after forward "
          f"{saved['parakit'].forward / saved['torch reentrant'].forward:.2f}x reentrant")
    return {"saved": saved["parakit"].forward / saved["none"].forward, "time": seconds["parakit"] / seconds["none"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--sizes", nargs="+", default=["64x256", "128x1024"], help="BATCHxHIDDEN, one or more")
    args = parser.parse_args()
    results = {size: bench(*map(int, size.split("x")), args.repeats) for size in args.sizes}
    print("\nbars (16 layers, 4 segments):")
    for size, r in results.items():
        print(f"  {size}: saved bytes {r['saved']:.3f} of none (<= 0.35: {'PASS' if r['saved'] <= 0.35 else 'FAIL'}), "
              f"step time {r['time']:.2f}x (<= 1.5x: {'PASS' if r['time'] <= 1.5 else 'FAIL'})")


if __name__ == "__main__":
    main()
