"""A GPU box emulated on the CPU, so that CI runs the course as a box with N GPUs and NCCL would.

    PARAKIT_EMULATE_GPUS=4 .venv/bin/jupyter lab lessons/      # or pytest, or a script

`fgpu` is the device: fgpu:0 .. fgpu:N-1, tensors in CPU memory, refusing to mix devices
as CUDA does.
"""
from __future__ import annotations

import os

from parakit.emulation import fgpu

__all__ = ["ENV", "DEVICE", "gpus", "install"]

ENV = "PARAKIT_EMULATE_GPUS"
DEVICE = fgpu.NAME


def gpus() -> int | None:
    """How many GPUs the emulated box has (PARAKIT_EMULATE_GPUS), or None: no emulation."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{ENV}={value!r}: set it to the number of GPUs to emulate (1 or more), or unset it")
    return int(value)


def install(count: int | None = None) -> None:
    """Give this process the emulated devices (`count`, by default `gpus()`)."""
    fgpu.install(count if count is not None else gpus() or 1)
