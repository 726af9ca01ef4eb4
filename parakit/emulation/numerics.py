"""How the emulated GPU's kernels round (stub: as the CPU's, for now)."""
from __future__ import annotations

__all__ = ["call"]


def call(op, args, kwargs):
    """`op` on CPU views of fgpu memory."""
    return op(*args, **kwargs)
