"""nn.DataParallel from the inside: one process, one thread per device (seed 003).

Every step is the seed's loop: **scatter** the batch into chunks, one per device;
**replicate** the module onto every device; run the replicas side by side with
**parallel_apply** (a thread each); **gather** the outputs onto the output device (device
0), where the loss is computed; backward sends each output's gradient back to its device
and **reduces** the replicas' parameter gradients onto device 0, where the optimizer
updates the one real copy of the parameters.

Device 0 gathers the outputs, holds the loss and receives the reduced gradients, so it
needs more memory than the others. `BalancedDataParallel(gpu0_bsz, ...)` gives it a
smaller chunk (`balanced_chunk_sizes`); `LossInForward` computes the loss on every replica
so that only one number per device is gathered.

Devices are CUDA GPUs where they exist. On CPU they are *logical*: ids 0..k-1 all backed
by the CPU, with the same scatter/replicate/gather logic and a thread per replica.
`MemoryMeter` (owned by `parakit.devices`, re-exported here) measures each device's peak
bytes: torch.cuda's statistics on GPUs, and on CPU a dispatch mode that attributes the
storage of every tensor an operator makes to the logical device it lives on, counts it
live until the storage dies, and keeps the peak.
"""
from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch import nn

from parakit.devices import MemoryMeter, resolve_devices
from parakit.dp.primitives import (balanced_chunk_sizes, check_inputs, data_parallel, even_chunk_sizes, gather,
                                   parallel_apply, replicate, scatter)

__all__ = ["balanced_chunk_sizes", "even_chunk_sizes", "scatter", "replicate", "parallel_apply", "gather",
           "data_parallel", "DataParallel", "BalancedDataParallel", "LossInForward", "MemoryMeter", "step_peaks"]


# ------------------------------------------------------------------------- the wrappers

class DataParallel(nn.Module):
    """nn.DataParallel's interface: `DataParallel(module, device_ids, output_device, dim)`;
    `.module` is the wrapped module, which stays on device_ids[0]."""

    def __init__(self, module: nn.Module, device_ids: Sequence[int | torch.device] | None = None,
                 output_device: int | None = None, dim: int = 0):
        super().__init__()
        self.module, self.devices = module, resolve_devices(device_ids)
        self.device_ids = [d.index for d in self.devices]
        self.output_device, self.dim = output_device, dim

    def chunk_sizes(self, batch_size: int) -> list[int]:
        return even_chunk_sizes(batch_size, len(self.devices))

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        check_inputs(inputs, self.dim)
        sizes = self.chunk_sizes(inputs[0].shape[self.dim])
        return data_parallel(self.module, inputs, self.devices, self.output_device, sizes, self.dim)


class BalancedDataParallel(DataParallel):
    """DataParallel with `gpu0_bsz` rows on device 0 and the rest spread over the others."""

    def __init__(self, gpu0_bsz: int, module: nn.Module, device_ids: Sequence[int | torch.device] | None = None,
                 output_device: int | None = None, dim: int = 0):
        super().__init__(module, device_ids, output_device, dim)
        if not isinstance(gpu0_bsz, int) or gpu0_bsz < 0:
            raise ValueError(f"gpu0_bsz={gpu0_bsz!r} must be an int >= 0 (rows on device 0)")
        self.gpu0_bsz = gpu0_bsz

    def chunk_sizes(self, batch_size: int) -> list[int]:
        return balanced_chunk_sizes(batch_size, self.gpu0_bsz, len(self.devices))


class LossInForward(nn.Module):
    """`module` followed by its loss, so each replica computes the loss of its own chunk and
    device 0 gathers one number per device instead of every output row.

    forward(input, target) returns the chunk's summed loss, `loss_fn(...) * rows`, for a
    mean-reduced `loss_fn`: the batch's mean loss is `dp(input, target).sum() / batch`.
    Averaging the replicas' means instead is wrong when the chunks differ in size.
    """

    def __init__(self, module: nn.Module, loss_fn):
        super().__init__()
        self.module, self.loss_fn = module, loss_fn

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.module(input), target) * input.shape[0]  # [] per chunk


def step_peaks(module: nn.Module, input: torch.Tensor, target: torch.Tensor, loss_fn,
               device_ids: Sequence[int | torch.device] | None = None, *, gpu0_bsz: int | None = None,
               loss_in_forward: bool = False) -> list[int]:
    """Peak bytes per device over one DataParallel step (forward, loss, backward) on a copy
    of `module`: the even split, `BalancedDataParallel(gpu0_bsz)` when gpu0_bsz is given,
    and the loss computed on every replica (`LossInForward`) when loss_in_forward.
    Parameters, input and target start on device 0 and count there."""
    devices = resolve_devices(device_ids)
    home = devices[0] if devices[0].type != "cpu" else "cpu"
    module, input, target = copy.deepcopy(module).to(home), input.to(home), target.to(home)
    inner = LossInForward(module, loss_fn) if loss_in_forward else module
    net = DataParallel(inner, devices) if gpu0_bsz is None else BalancedDataParallel(gpu0_bsz, inner, devices)
    with MemoryMeter(devices) as meter:
        meter.place([*module.parameters(), *module.buffers(), input, target], devices[0].index)
        if loss_in_forward:
            loss = net(input, target).sum() / input.shape[0]
        else:
            loss = loss_fn(net(input), target)
        loss.backward()
    return meter.peaks()
