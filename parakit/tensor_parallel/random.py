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
        """Inside the block, the device's default generator draws from this rank's stream;
        afterwards the default generator is back where it was, untouched."""
        cuda = self.device.type == "cuda"
        with torch.random.fork_rng(devices=[self.device] if cuda else []):
            set_state, get_state = ((lambda s: torch.cuda.set_rng_state(s, self.device)),
                                    (lambda: torch.cuda.get_rng_state(self.device))) if cuda else \
                                   (torch.set_rng_state, torch.get_rng_state)
            set_state(self.state)
            try:
                yield
            finally:
                self.state = get_state()
