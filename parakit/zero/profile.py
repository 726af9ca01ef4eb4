"""One ZeRO stage measured on the ranks: bytes held, their peak, and bytes sent."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from parakit import comm
from parakit.zero.fsdp import FullyShardedDataParallel
from parakit.zero.held import HeldBytesPeak, held_bytes
from parakit.zero.optimizer import ShardedOptimizer

__all__ = ["profile_stage"]


def profile_stage(model: nn.Module, stage: int, batch: tuple, loss_fn, optimizer_cls=torch.optim.AdamW,
                  steps: int = 2, group=None, compute_dtype: torch.dtype | None = None, **optimizer_kwargs) -> dict:
    """Train `model` on this rank's `batch` (x, y) for `steps` steps at ZeRO stage 0-3 and
    report the last step: bytes held at rest (after `optimizer.step()`), their peak during
    the step (HeldBytesPeak), and what this rank sent (CommLog). Stage 0 is plain data
    parallelism: each gradient all-reduced (2(N-1)/N of its bytes), then averaged; stage 3
    makes each child of `model` a unit. `compute_dtype` (torch.bfloat16 or float16): mixed precision,
    the ZeRO paper's way: parameters and gradients in it, fp32 master weights in the optimizer
    (ShardedOptimizer's; at stage 0 every rank keeps all of them; at stage 3 the fp32 shards are
    the masters); the loss is computed in fp32.

    Returns {"rest": {kind: bytes}, "peak": {kind: bytes}, "wire_bytes": int (the ring model),
    "written_bytes": int or None (what the OS counted the process writing during the step, see
    `comm.CommLog.written_bytes`), "calls": {op: count}}.
    """
    n = dist.get_world_size(group)
    x = batch[0] if compute_dtype is None or stage == 3 else batch[0].to(compute_dtype)  # FSDP casts its inputs
    masters = {}  # stage 0 in mixed precision: an fp32 copy of every parameter, which the optimizer steps
    if stage == 0 and compute_dtype is not None:
        masters = {p: p.detach().to(torch.float32, copy=True) for p in model.parameters()}
        model.to(compute_dtype)
    if stage == 3:
        model = FullyShardedDataParallel(model, units=list(model.children()), compute_dtype=compute_dtype, group=group)
    if stage in (1, 2):
        optimizer = ShardedOptimizer(model.parameters(), optimizer_cls, stage=stage, group=group,
                                     compute_dtype=compute_dtype, **optimizer_kwargs)
    else:
        optimizer = optimizer_cls(list(masters.values()) or model.parameters(), **optimizer_kwargs)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        with comm.CommLog() as log, HeldBytesPeak(model, optimizer) as meter:
            loss_fn(model(x).float(), batch[1]).backward()
            if stage == 0:
                for p in model.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad, group=group)
                        p.grad.div_(n)
                        if p in masters:
                            masters[p].grad = p.grad.float()
            if stage == 3:
                model.finish_gradient_synchronization()
            optimizer.step()
            with torch.no_grad():
                for p, master in masters.items():
                    p.copy_(master)
                    master.grad = None
    calls = {op: int(row["count"]) for op, row in log.summary().items()}
    rest = held_bytes(model, optimizer)
    rest["optimizer"] += sum(4 * m.numel() for m in masters.values())
    return {"rest": rest, "peak": meter.peak, "wire_bytes": log.wire_bytes(),
            "written_bytes": log.written_bytes(), "calls": calls}
