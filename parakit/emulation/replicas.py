"""nn.DataParallel on fgpu: the copies between devices that `torch.nn.parallel.comm` makes with
CUDA's own kernels (torch._C._scatter, _gather, _broadcast_coalesced) are made here with
`.to(device)`, as those kernels copy on a GPU box; CPU and CUDA tensors still go to PyTorch's.
(`reduce_add_coalesced`, which backward uses, is Python and runs on fgpu as it is; it asks
whether NCCL can sum the tensors, which on PyTorch's CPU build warns each time: not here.)
"""
from __future__ import annotations

import warnings

import torch
from torch.nn.parallel import comm

from parakit.emulation import fgpu

__all__ = ["install"]

_ORIGINAL = {}  # comm's own scatter, gather and broadcast_coalesced


def install() -> None:
    """Serve comm's three CUDA-only copies for fgpu tensors (once per process)."""
    if not _ORIGINAL:
        _ORIGINAL.update(scatter=comm.scatter, gather=comm.gather, broadcast_coalesced=comm.broadcast_coalesced)
        comm.scatter, comm.gather, comm.broadcast_coalesced = _scatter, _gather, _broadcast_coalesced
        warnings.filterwarnings("ignore", "PyTorch is not compiled with NCCL support")


def _on(device) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(fgpu.NAME, device)


def _scatter(tensor, devices=None, chunk_sizes=None, dim=0, streams=None, *, out=None):
    """`tensor` split along `dim` (`chunk_sizes`, or evenly), chunk i copied to devices[i] (a
    chunk already there stays a view, as CUDA's does)."""
    if tensor.device.type != fgpu.NAME or out is not None:
        return _ORIGINAL["scatter"](tensor, devices, chunk_sizes, dim, streams, out=out)
    chunks = tensor.split(list(chunk_sizes), dim) if chunk_sizes else tensor.chunk(len(devices), dim)
    return tuple(chunk.to(_on(device)) for chunk, device in zip(chunks, devices))


def _gather(tensors, dim=0, destination=None, *, out=None):
    """The tensors concatenated along `dim` on `destination` (the current device by default, -1
    or "cpu" the CPU)."""
    if all(t.device.type != fgpu.NAME for t in tensors) or out is not None:
        return _ORIGINAL["gather"](tensors, dim, destination, out=out)
    if destination is None:
        destination = fgpu.current_device()
    target = torch.device("cpu") if destination in (-1, "cpu") else _on(destination)
    return torch.cat([t.to(target) for t in tensors], dim)


def _broadcast_coalesced(tensors, devices, buffer_size=10485760):
    """For each device, the tensors there: devices[0] keeps the originals (they must live there),
    the others get copies."""
    if all(t.device.type != fgpu.NAME for t in tensors):
        return _ORIGINAL["broadcast_coalesced"](tensors, devices, buffer_size)
    first = _on(devices[0])
    for tensor in tensors:
        if tensor.device != first:
            raise RuntimeError(f"broadcast_coalesced: every tensor must be on {first}, one is on {tensor.device}")
    return [list(tensors)] + [[t.to(_on(device)) for t in tensors] for device in devices[1:]]
