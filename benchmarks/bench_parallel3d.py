"""3D tensor parallelism and the hybrid trainer, against PyTorch on one process.

    .venv/bin/python benchmarks/bench_parallel3d.py [--repeats 5]

Measured in this run:
  - the seed's MLP (256 -> 1024 -> 256, batch 16, float32) forward + backward: parakit's
    Linear3D on 8 ranks (q = 2; the median over ranks of the median of --repeats steps) and
    torch.nn.Linear on one process, their time ratio, the largest difference in output and
    input gradient, and the bytes rank 0 sent against the seed's table (linear3d_cost);
  - the trainer (parakit.train) for 5 steps on dp=2 x pp=2 x tp=2 (8 ranks) against one process:
    the largest loss difference and the time ratio.
The issue's bars are printed with PASS or FAIL; nothing is asserted. On a 2-core CPU the
times say how much the collectives cost, not what a GPU box would show.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import parakit
from parakit import CommLog
from parakit import parallel3d as p3d


def mlp_step(repeats: int, parallel: bool):
    """Median seconds of forward + backward; output and input gradient; rank 0's bytes."""
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    x = torch.randn(16, 256)
    if parallel:
        cube = p3d.Cube()
        first = p3d.Linear3D(256, 1024, bias=False, cube=cube).load_dense(dense[0].weight.t())
        second = p3d.Linear3D(1024, 256, bias=False, cube=cube.swapped()).load_dense(dense[2].weight.t())
        model, x = nn.Sequential(first, nn.GELU(), second), p3d.split_batch(x, cube)
    else:
        dense[0].bias, dense[2].bias = None, None
        model = dense
    times = []
    for _ in range(repeats + 1):  # the first step warms up and is not counted
        leaf = x.clone().requires_grad_()
        with CommLog() as log:
            start = time.perf_counter()
            y = model(leaf)
            y.sum().backward()
            times.append(time.perf_counter() - start)
    if parallel:
        y, grad = p3d.gather_batch(y.detach(), cube), p3d.gather_batch(leaf.grad, cube)
    else:
        y, grad = y.detach(), leaf.grad
    return statistics.median(times[1:]), y, grad, log.wire_bytes()


def trainer(argv):
    from parakit import train
    start = time.perf_counter()
    losses = train.train(train.parse_args(argv))
    return time.perf_counter() - start, losses


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    repeats = parser.parse_args().repeats
    single = parakit.launch(mlp_step, repeats, False, world_size=1)[0]
    cube = parakit.launch(mlp_step, repeats, True, world_size=8, timeout=300)
    cube_time = statistics.median(r[0] for r in cube)
    error = max((cube[0][1] - single[1]).abs().max().item(), (cube[0][2] - single[2]).abs().max().item())
    table = sum(p3d.linear3d_cost(16, 256, 1024, 2).values()) + sum(p3d.linear3d_cost(16, 1024, 256, 2).values())
    one_time, one_losses = parakit.launch(trainer, [], world_size=1)[0]
    mesh_time, mesh_losses = parakit.launch(trainer, ["--dp", "2", "--pp", "2", "--tp", "2"], world_size=8, timeout=300)[0]
    loss_error = max(abs(a - b) for a, b in zip(one_losses, mesh_losses))
    rows = [
        ("seed MLP fwd+bwd, torch.nn.Linear, 1 process", f"{single[0] * 1e3:.2f} ms", ""),
        ("seed MLP fwd+bwd, Linear3D, 8 ranks (q=2)", f"{cube_time * 1e3:.2f} ms", f"x{cube_time / single[0]:.1f} of torch"),
        ("  largest difference (output, input grad)", f"{error:.1e}", "PASS" if error <= 1e-5 else "FAIL"),
        ("  bytes sent by rank 0 / seed's table", f"{cube[0][3]:,} / {table:,}", "PASS" if cube[0][3] == table else "FAIL"),
        ("trainer 5 steps, 1 process", f"{one_time:.2f} s", ""),
        ("trainer 5 steps, dp=2 x pp=2 x tp=2 (8 ranks)", f"{mesh_time:.2f} s", f"x{mesh_time / one_time:.1f} of 1 process"),
        ("  largest loss difference over 5 steps", f"{loss_error:.1e}", "PASS" if loss_error <= 1e-5 else "FAIL"),
    ]
    for name, value, note in rows:
        print(f"{name:<50} {value:>22}  {note}")


if __name__ == "__main__":
    main()
