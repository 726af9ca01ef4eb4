"""The bytes of model state a rank really holds: parameters, gradients, optimizer state.

`held_bytes` counts them now; `HeldBytesPeak` keeps their peak while a block runs. Neither
communicates. (Per-device peaks of every tensor, activations included, are
`parakit.devices.MemoryMeter`'s.)
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["held_bytes", "HeldBytesPeak"]


def held_bytes(module: nn.Module, optimizer=None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds now, counting each
    storage once (tied weights, views) at its current size (a freed buffer counts 0)."""
    if hasattr(module, "held_tensors"):  # FullyShardedDataParallel: shards, gathered buffers, gradients in flight
        groups = module.held_tensors()
    else:
        params = list(module.parameters())
        groups = {"parameters": params, "gradients": [p.grad for p in params if p.grad is not None]}
    groups["gradients"] = groups["gradients"] + (optimizer.in_flight() if hasattr(optimizer, "in_flight") else [])
    state = optimizer.state.values() if optimizer is not None else []
    masters = optimizer.master_params() if hasattr(optimizer, "master_params") else []  # fp32 copies: optimizer state
    groups["gradients"] += [m.grad for m in masters if m.grad is not None]
    groups["optimizer"] = [t for s in state for t in s.values() if isinstance(t, torch.Tensor)] + masters
    return {kind: _storage_bytes(tensors) for kind, tensors in groups.items()}


def _storage_bytes(tensors) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(size for ptr, size in storages.items() if ptr)


class HeldBytesPeak(TorchDispatchMode):
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
