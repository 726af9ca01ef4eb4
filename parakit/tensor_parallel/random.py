"""Random numbers inside and outside tensor-parallel regions.

Outside a region every rank holds the same tensor, so dropout there must draw the same
mask on every rank: the default generator, seeded alike (torch.manual_seed(seed)).
Inside a region each rank holds a different slice (its own heads, its own columns), and a
dense model would draw a different mask for each slice: there the ranks draw from
`RNGTracker.fork()`, a stream seeded seed + 2718 + rank (Megatron's offset), one per rank.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from parakit.devices import device

__all__ = ["RNGTracker"]

OFFSET = 2718


class RNGTracker:
    """The tensor-parallel random stream of this rank, on this rank's device (no communication)."""

    def __init__(self, seed: int, group=None):
        self.device = device()
        self.state = torch.Generator(self.device).manual_seed(seed + OFFSET + dist.get_rank(group)).get_state()

    @contextlib.contextmanager
    def fork(self):
        """Inside the block, the device's default generator (the CPU's, or the GPU's: CUDA's, or
        fgpu's on the emulated box) draws from this rank's stream; afterwards the default
        generator is back where it was, untouched."""
        kind = self.device.type
        generators = torch if kind == "cpu" else torch.get_device_module(kind)
        on = () if kind == "cpu" else (self.device,)  # torch.get_rng_state takes no device, torch.cuda's one
        with torch.random.fork_rng(devices=list(on), device_type=kind):
            generators.set_rng_state(self.state, *on)
            try:
                yield
            finally:
                self.state = generators.get_rng_state(*on)
