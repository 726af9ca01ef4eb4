"""The four primitives of DataParallel (seed 003): scatter, replicate, parallel_apply,
gather, as autograd Functions over a list of devices, and the chunk sizes they split by."""
from __future__ import annotations

import copy
import functools
import threading
from typing import Sequence

import torch
from torch import nn

from parakit.devices import copying_to, current_meter, on_device, resolve_devices, to_device, where

# ------------------------------------------------------------------------- chunk sizes

def even_chunk_sizes(batch_size: int, num_devices: int) -> list[int]:
    """nn.DataParallel's default split (`torch.chunk`): ceil(batch/n) rows each, the last
    chunk smaller, trailing devices idle (0) when the batch runs out."""
    _check_split(batch_size, num_devices)
    size = -(-batch_size // num_devices)
    sizes = [min(size, batch_size - i * size) for i in range(num_devices)]
    return [max(s, 0) for s in sizes]


def balanced_chunk_sizes(batch_size: int, gpu0_bsz: int, num_devices: int) -> list[int]:
    """Rows per device with `gpu0_bsz` rows on device 0 (seed 003).

    The other devices share the rest evenly, `(batch - gpu0_bsz) // (n - 1)` each, and the
    remainder goes one row each to devices 1, 2, ... (52 rows, gpu0_bsz=16, 3 devices:
    [16, 18, 18]; 53 rows: [16, 19, 18]). gpu0_bsz=0 leaves device 0 out. When gpu0_bsz is
    not smaller than the others' share, it is the default even split.
    """
    _check_split(batch_size, num_devices)
    if not isinstance(gpu0_bsz, int) or not 0 <= gpu0_bsz <= batch_size:
        raise ValueError(f"gpu0_bsz={gpu0_bsz!r} must be an int between 0 and the batch size {batch_size}")
    if num_devices == 1:
        return [batch_size]
    unit = (batch_size - gpu0_bsz) // (num_devices - 1)
    if gpu0_bsz >= unit:
        return even_chunk_sizes(batch_size, num_devices)
    sizes = [gpu0_bsz] + [unit] * (num_devices - 1)
    for i in range(batch_size - sum(sizes)):
        sizes[i + 1] += 1
    return sizes


def _check_split(batch_size: int, num_devices: int) -> None:
    if num_devices < 1:
        raise ValueError("no devices: pass at least one device id, e.g. device_ids=[0, 1]")
    if batch_size < 1:
        raise ValueError(f"a batch of {batch_size} rows cannot be split: pass at least one row")


# ------------------------------------------------------------------------- the four primitives

class Scatter(torch.autograd.Function):
    """Forward: cut the input into chunks along `dim` and send chunk i to device i (bytes:
    the chunk's). Backward: gather the chunks' gradients back where the input was."""

    @staticmethod
    def forward(ctx, devices, chunk_sizes, dim, input):
        ctx.dim, ctx.source = dim, where(input) or input.device
        chunks = input.split(chunk_sizes, dim)  # [rows_i, ...] views
        return tuple(to_device(c, d) for c, d in zip(chunks, devices))

    @staticmethod
    def backward(ctx, *grads):
        return None, None, None, Gather.apply(ctx.source, ctx.dim, *grads)


class Gather(torch.autograd.Function):
    """Forward: concatenate every device's output on `device` (bytes: each output's, to
    it). Backward: scatter the gradient back to the devices the outputs came from."""

    @staticmethod
    def forward(ctx, device, dim, *outputs):
        ctx.dim, ctx.sizes = dim, [o.shape[dim] for o in outputs]
        ctx.devices = [where(o) or device for o in outputs]
        if device.type != "cpu":  # a GPU (CUDA, or the emulated box's fgpu)
            return torch.cat([o.to(device) for o in outputs], dim)
        with copying_to(device.index):
            return torch.cat(outputs, dim)  # [sum of rows, ...] made on `device`

    @staticmethod
    def backward(ctx, grad):
        return None, None, *Scatter.apply(ctx.devices, ctx.sizes, ctx.dim, grad)


class Broadcast(torch.autograd.Function):
    """Forward: copy every tensor to every device (bytes: all tensors' to each other
    device). Backward: reduce-add each tensor's gradients onto its source device."""

    @staticmethod
    def forward(ctx, devices, *tensors):
        ctx.sources, ctx.count = [where(t) or t.device for t in tensors], len(tensors)
        return tuple(to_device(t, d) for d in devices for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        per_tensor = [grads[k::ctx.count] for k in range(ctx.count)]
        return None, *(_reduce_add([g for g in gs if g is not None], src)
                       for src, gs in zip(ctx.sources, per_tensor))


def _reduce_add(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """The sum of one parameter's gradients from every replica, on `device`."""
    return functools.reduce(torch.add, [to_device(g, device) for g in grads]) if grads else None


def scatter(input: torch.Tensor, devices: Sequence[torch.device], chunk_sizes: Sequence[int],
            dim: int = 0) -> list[torch.Tensor]:
    """Chunk i (chunk_sizes[i] rows along `dim`) on devices[i]; devices given 0 rows get nothing."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"DataParallel scatters tensors; got a {type(input).__name__}: pass tensors")
    used = [(d, s) for d, s in zip(devices, chunk_sizes) if s > 0]
    return list(Scatter.apply([d for d, _ in used], [s for _, s in used], dim, input))


def replicate(module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
    """One copy of `module` per device; the copies' trainable parameters come from a
    Broadcast, so their gradients flow back into the module's own parameters."""
    trained = [p for p in module.parameters() if p.requires_grad]
    fixed = [p for p in module.parameters() if not p.requires_grad] + list(module.buffers())
    copies = Broadcast.apply(list(devices), *trained) if trained else ()
    with torch.no_grad():  # frozen parameters and buffers: copies without gradients
        fixed_copies = [to_device(t, d) for d in devices for t in fixed]
    replicas = []
    for i in range(len(devices)):
        memo = {id(p): c for p, c in zip(trained, copies[i * len(trained):])}
        memo.update({id(t): c for t, c in zip(fixed, fixed_copies[i * len(fixed):])})
        replicas.append(copy.deepcopy(module, memo))
    return replicas


def parallel_apply(replicas: Sequence[nn.Module], inputs: Sequence[tuple], devices: Sequence[torch.device]) -> list:
    """replicas[i](*inputs[i]) in a thread of its own with devices[i] current; an error in
    any thread is raised here."""
    meter, results = current_meter(), [None] * len(replicas)

    def work(i):
        try:
            with on_device(devices[i], meter), torch.enable_grad():
                results[i] = replicas[i](*inputs[i])
        except BaseException as error:  # handed to the caller's thread
            results[i] = _Failure(error, i)

    threads = [threading.Thread(target=work, args=(i,), name=f"replica {i} on {devices[i]}")
               for i in range(len(replicas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, _Failure):
            raise RuntimeError(f"replica {r.index} on device {devices[r.index]} failed: {r.error!r}") from r.error
    return results


class _Failure:
    def __init__(self, error, index):
        self.error, self.index = error, index


def gather(outputs: Sequence[torch.Tensor], device: torch.device, dim: int = 0) -> torch.Tensor:
    """The outputs concatenated along `dim` on `device`; 0-dim outputs (losses) become a vector."""
    outputs = [o.reshape(1) if o.dim() == 0 else o for o in outputs]
    return Gather.apply(device, dim, *outputs)


def data_parallel(module: nn.Module, inputs: Sequence[torch.Tensor], device_ids: Sequence[int | torch.device] | None = None,
                  output_device: int | None = None, chunk_sizes: Sequence[int] | None = None,
                  dim: int = 0) -> torch.Tensor:
    """The seed's `data_parallel`: scatter, replicate, parallel_apply, gather.

    `module` must be on device_ids[0]; every input is split into `chunk_sizes` (default
    `even_chunk_sizes`) along `dim`; the output lands on output_device (default device_ids[0]).
    """
    devices = resolve_devices(device_ids)
    out = devices[0] if output_device is None else _output_device(devices, output_device)
    check_inputs(inputs, dim)
    sizes = list(chunk_sizes or even_chunk_sizes(inputs[0].shape[dim], len(devices)))
    used = [d for d, s in zip(devices, sizes) if s > 0]
    per_input = [scatter(x, devices, sizes, dim) for x in inputs]
    replicas = replicate(module, used)
    outputs = parallel_apply(replicas, list(zip(*per_input)), used)
    return gather(outputs, out, dim)


def _output_device(devices: list[torch.device], output_device: int) -> torch.device:
    for d in devices:
        if d.index == output_device:
            return d
    raise ValueError(f"output_device={output_device} is not one of the devices {[d.index for d in devices]}")


def check_inputs(inputs, dim: int = 0) -> None:
    """Raise unless `inputs` are tensors, the first with at least one row along `dim`."""
    if not inputs:
        raise ValueError("DataParallel needs at least one input tensor to split")
    for x in inputs:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"DataParallel scatters tensors; got a {type(x).__name__}: pass tensors")
    shape = tuple(inputs[0].shape)
    if not shape:
        raise ValueError("a 0-dim tensor cannot be split: pass a batch with a dimension of rows")
    if not -len(shape) <= dim < len(shape):
        raise ValueError(f"dim={dim} is not a dimension of the batch of shape {shape}: "
                         f"pass dim between {-len(shape)} and {len(shape) - 1}")
    if shape[dim] == 0:
        raise ValueError(f"a batch of shape {shape} cannot be split along dim {dim}: pass at least one row")
