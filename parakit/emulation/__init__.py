"""A box with N GPUs and NCCL, emulated on the CPU, so that CI runs the course as such a
box would and fails where it would fail.

    PARAKIT_EMULATE_GPUS=4 .venv/bin/jupyter lab lessons/      # or pytest, or a script

With the variable set, `parakit.devices` sees 4 GPUs: `resolve_backend("auto", n)` picks the
emulated NCCL for n <= 4 and each rank computes on its own device. Its parts:

- `fgpu`: the devices fgpu:0 .. fgpu:N-1, tensors in CPU memory, refusing to mix devices
  as CUDA does; with `numerics` (a GPU's rounding: split-K products, reductions in another
  order, fused multiply-adds), `gpu_streams` (streams the host does not wait for, events,
  synchronize, record_stream), `rng` (a generator per device) and `native` (pinned host memory,
  from C++ hooks built once per environment);
- `replicas`: nn.DataParallel's copies between devices, which PyTorch makes with CUDA's kernels;
- `nccl` (with `streams` and `link`): the backend "fnccl", holding ranks to what NCCL enforces
  (their own device only, one device per rank, its unsupported operations), bound and split
  as NCCL's groups are when made with device_id, and stopping, with the order of each rank's
  operations, where NCCL would hang (per-stream order, sends that wait for their receives,
  communicators set up lazily without device_id); a rank whose process died leaves the others
  waiting until their group's timeout, when a watchdog ends them as NCCL's does.
"""
from __future__ import annotations

import os

from parakit.emulation import fgpu, nccl, replicas

__all__ = ["ENV", "DEVICE", "BACKEND", "gpus", "install", "idle", "broken"]

ENV = "PARAKIT_EMULATE_GPUS"
DEVICE = fgpu.NAME
BACKEND = nccl.BACKEND
idle, broken = nccl.idle, nccl.broken


def gpus() -> int | None:
    """How many GPUs the emulated box has (PARAKIT_EMULATE_GPUS), or None: no emulation."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{ENV}={value!r}: set it to the number of GPUs to emulate (1 or more), or unset it")
    return int(value)


def install(count: int | None = None) -> None:
    """Give this process the emulated devices (`count` of them, by default `gpus()`) and the
    "fnccl" backend; a later call may change the count."""
    fgpu.install(count or gpus() or fgpu.device_count() or 1)
    nccl.register()
    replicas.install()
