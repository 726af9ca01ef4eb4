"""Tensor parallelism: parakit's parallel block against the dense block and torch's own
tensor-parallel styles (torch.distributed.tensor.parallel ColwiseParallel / RowwiseParallel).

    .venv/bin/python benchmarks/bench_tensor_parallel.py [--t 2] [--repeats 5]

Measured in this run, for a pre-norm transformer block (hidden 256, 8 heads, MLP 1024,
batch 8 x seq 64, float32) on t ranks (gloo on CPU, or NCCL where there are t GPUs):
  - forward + backward step time (median over ranks of the median of --repeats steps) of
    parakit's ParallelTransformerBlock, of the same dense block parallelised with torch's
    styles (qkv and fc1 colwise, proj and fc2 rowwise), and of the dense block on one process;
  - parameter bytes per rank of each, and of the parallel MLP alone;
  - the largest difference of parakit's output from the dense block's.
The issue's bar (parallel MLP parameter bytes per rank exactly (dense - row bias)/t + row
bias) is printed with PASS or FAIL; nothing is asserted. On a 2-core CPU the times say what
the collectives cost, not what a GPU box would show.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import parakit
from parakit import tensor_parallel as tp

HIDDEN, HEADS, FFN, BATCH, SEQ = 256, 8, 1024, 8, 64


class DenseBlock(nn.Module):
    """The dense block parakit's shards: fused qkv laid out head by head, as ParallelSelfAttention's.
    `heads` is the number of heads this module computes (heads/t once torch has sharded qkv)."""

    def __init__(self):
        super().__init__()
        self.heads = HEADS
        self.norm1, self.qkv, self.proj = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.norm2, self.fc1, self.fc2 = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, self.heads, 3, -1).permute(3, 0, 2, 1, 4).unbind(0)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)  # the same full weights for every kind
    if kind == "parakit":
        return tp.ParallelTransformerBlock(HIDDEN, HEADS, FFN).to(parakit.device())
    block = DenseBlock().to(parakit.device())
    if kind == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh(parakit.device().type, (dist.get_world_size(),))
        parallelize_module(block, mesh, {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                                         "fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        block.heads = HEADS // dist.get_world_size()
    return block


def local_bytes(module: nn.Module) -> int:
    return sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in module.parameters())


def step(kind: str, repeats: int):
    """(median seconds of forward + backward, parameter bytes on this rank, output)."""
    block = build(kind)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(1)).to(parakit.device())
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        y = block(x)
        y.sum().backward()
        if parakit.device().type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]), local_bytes(block), y.detach().clone()


def mlp_bytes() -> int:
    return local_bytes(tp.ParallelMLP(HIDDEN, FFN))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--t", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    t = args.t
    dense_s, dense_bytes, dense_y = parakit.launch(step, "dense", args.repeats, world_size=1)[0]
    rows = {}
    for kind in ("parakit", "torch"):
        results = parakit.launch(step, kind, args.repeats, world_size=t)
        rows[kind] = (statistics.median(r[0] for r in results), results[0][1], max(float((r[2] - dense_y).abs().max())
                                                                                  for r in results))
    print(f"transformer block {HIDDEN} hidden, {HEADS} heads, MLP {FFN}, batch {BATCH} x seq {SEQ}, t = {t}")
    print(f"{'':>24} {'step ms':>9} {'vs dense':>9} {'vs torch':>9} {'param bytes/rank':>17} {'vs dense':>9} {'max |y - dense|':>16}")
    print(f"{'dense, one process':>24} {1e3 * dense_s:9.2f} {1:9.2f} {'':>9} {dense_bytes:17,} {1:9.3f} {0:16.1e}")
    for kind, (s, nbytes, diff) in rows.items():
        print(f"{kind + ' t=' + str(t):>24} {1e3 * s:9.2f} {s / dense_s:9.2f} {s / rows['torch'][0]:9.2f} "
              f"{nbytes:17,} {nbytes / dense_bytes:9.3f} {diff:16.1e}")
    dense_mlp = 4 * (HIDDEN * FFN + FFN + FFN * HIDDEN + HIDDEN)
    per_rank, want = parakit.launch(mlp_bytes, world_size=t)[0], (dense_mlp - 4 * HIDDEN) // t + 4 * HIDDEN
    print(f"\nbar: parallel MLP parameter bytes per rank {per_rank:,} == (dense {dense_mlp:,} - row bias "
          f"{4 * HIDDEN:,})/{t} + row bias = {want:,}: {'PASS' if per_rank == want else 'FAIL'}")
    print(f"bar: parakit's block equals the dense block (max |y - dense| {rows['parakit'][2]:.1e} <= 1e-4): "
          f"{'PASS' if rows['parakit'][2] <= 1e-4 else 'FAIL'}")
    parakit.shutdown()


if __name__ == "__main__":
    main()
