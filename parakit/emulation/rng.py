"""Each emulated GPU's own generator (stub: the CPU's, for now)."""
from __future__ import annotations

import contextlib

__all__ = ["drawing"]


def drawing(op, index: int):
    """The context `op` runs in on fgpu:index: where its random numbers come from."""
    return contextlib.nullcontext()
