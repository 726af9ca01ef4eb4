"""What ZeRO keeps per rank: the paper's formulas, and the bytes a rank really holds."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from parakit import comm

__all__ = ["zero_bytes", "zero_comm_bytes", "held_bytes", "MemoryMeter", "profile_stage"]


def zero_bytes(num_params: int, world_size: int, stage: int, k: float = 12, param_bytes: int = 2,
               grad_bytes: int = 2) -> dict[str, float]:
    """Bytes per rank of the ZeRO paper's table for Psi = num_params on N = world_size ranks.

    Stage 0 (DDP) keeps (param_bytes + grad_bytes + K) Psi; stage 1 divides the optimizer's
    K Psi by N, stage 2 also the gradients, stage 3 also the parameters. The paper's mixed
    precision: fp16 parameters and gradients (2 + 2) and K = 12 (fp32 master, momentum,
    variance); all in fp32 with Adam: 4 + 4 and K = 8; with SGD and momentum K = 4.
    """
    psi, n = num_params, world_size
    return {"parameters": param_bytes * psi / (n if stage >= 3 else 1),
            "gradients": grad_bytes * psi / (n if stage >= 2 else 1),
            "optimizer": k * psi / (n if stage >= 1 else 1)}


def zero_comm_bytes(num_params: int, world_size: int, stage: int, element_bytes: int = 2) -> float:
    """Bytes one rank sends per step: 2 Psi (N-1)/N for stages 0-2 (all-reduce, or reduce +
    broadcast), 3 Psi (N-1)/N for stage 3 (a second all-gather in backward)."""
    return (3 if stage >= 3 else 2) * num_params * element_bytes * (world_size - 1) / world_size


def held_bytes(module: nn.Module, optimizer=None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds now, counting each
    storage once (tied weights, views) at its current size (a freed buffer counts 0)."""
    if hasattr(module, "held_tensors"):  # FullyShardedDataParallel: shards, gathered buffers, gradients in flight
        groups = module.held_tensors()
    else:
        params = list(module.parameters())
        groups = {"parameters": params, "gradients": [p.grad for p in params if p.grad is not None]}
    state = optimizer.state.values() if optimizer is not None else []
    groups["optimizer"] = [t for s in state for t in s.values() if isinstance(t, torch.Tensor)]
    return {kind: _storage_bytes(tensors) for kind, tensors in groups.items()}


def _storage_bytes(tensors) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(size for ptr, size in storages.items() if ptr)


class MemoryMeter(TorchDispatchMode):
    """The peak of `held_bytes(module, optimizer)` over the block, sampled before and after
    every op that runs in it: `peak` (per kind, each at its own peak) and `peak_total`."""

    def __init__(self, module: nn.Module, optimizer=None):
        super().__init__()
        self.module, self.optimizer = module, optimizer
        self.peak: dict[str, int] = {}
        self.peak_total = 0

    def __enter__(self):
        self._sample()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sample()
        out = func(*args, **(kwargs or {}))
        self._sample()
        return out

    def _sample(self) -> None:
        held = held_bytes(self.module, self.optimizer)
        self.peak = {k: max(v, self.peak.get(k, 0)) for k, v in held.items()}
        self.peak_total = max(self.peak_total, sum(held.values()))


def profile_stage(model: nn.Module, stage: int, batch: tuple, loss_fn, optimizer_cls=torch.optim.AdamW,
                  steps: int = 2, group=None, **optimizer_kwargs) -> dict:
    """Train `model` on this rank's `batch` (x, y) for `steps` steps at ZeRO stage 0-3 and
    report the last step: bytes held at rest (after `optimizer.step()`), their peak during
    the step (MemoryMeter), and what this rank sent (CommLog). Stage 0 is plain data
    parallelism: each gradient all-reduced (2(N-1)/N of its bytes), then averaged; stage 3
    makes each child of `model` a unit.

    Returns {"rest": {kind: bytes}, "peak": {kind: bytes}, "wire_bytes": int (the ring model),
    "written_bytes": int or None (what the OS counted the process writing during the step, see
    `comm.CommLog.written_bytes`), "calls": {op: count}}.
    """
    from parakit.zero.fsdp import FullyShardedDataParallel
    from parakit.zero.optimizer import ShardedOptimizer

    n = dist.get_world_size(group)
    if stage == 3:
        model = FullyShardedDataParallel(model, units=list(model.children()), group=group)
    if stage in (1, 2):
        optimizer = ShardedOptimizer(model.parameters(), optimizer_cls, stage=stage, group=group, **optimizer_kwargs)
    else:
        optimizer = optimizer_cls(model.parameters(), **optimizer_kwargs)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        with comm.CommLog() as log, MemoryMeter(model, optimizer) as meter:
            loss_fn(model(batch[0]), batch[1]).backward()
            if stage == 0:
                for p in model.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad, group=group)
                        p.grad.div_(n)
            if stage == 3:
                model.finish_gradient_synchronization()
            optimizer.step()
    calls = {op: int(row["count"]) for op, row in log.summary().items()}
    return {"rest": held_bytes(model, optimizer), "peak": meter.peak, "wire_bytes": log.wire_bytes(),
            "written_bytes": log.written_bytes(), "calls": calls}
