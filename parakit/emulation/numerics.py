"""How the emulated GPU's kernels round: in another order than the CPU's, as a GPU's do.

A GPU's matmul and reduction kernels add in another order than the CPU's (cuBLAS splits a
long contraction across thread blocks, a reduction adds in a tree), and its fused
multiply-adds round once; so a result computed on a GPU and the same computed on the CPU,
or by two different kernels, differ in the last bits. fgpu does the same, deterministically,
so that an exact comparison between kernels fails on the emulated box as it would on a GPU:

- matrix products (mm, addmm, bmm, baddbmm, mv, addmv, dot; matmul, linear and the math
  path of SDPA arrive as these) cut the contraction at a third (`split`) and add the two
  partial products (split-K), each one a BLAS call, half precision accumulated in fp32;
- reductions (sum, mean, the 1- and 2-norms, softmax's and log_softmax's sums) cut the
  outermost reduced dimension at a third and combine the two partial results;
- the optimizers' fused multiply-adds (addcmul, addcdiv, lerp) round their last
  multiply-add once (an FMA, as nvcc compiles CUDA's kernels), where the CPU's round twice.

Every other operator is the CPU's kernel. The same operator on the same shapes gives the
same bits every time; the error stays that of fp32's rounding in another order (no
accuracy is lost: half and bf16 products and sums accumulate in fp32, as on a GPU).
"""
from __future__ import annotations

import math

import torch

__all__ = ["call", "split", "KERNELS"]

_aten = torch.ops.aten
_WIDE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}  # a GPU accumulates half precision in fp32


def call(op, args, kwargs):
    """`op` on CPU views of fgpu memory, rounded as a GPU's kernel rounds (`KERNELS`)."""
    kernel = KERNELS.get(op)
    return op(*args, **kwargs) if kernel is None else kernel(*args, **kwargs)


def split(n: int) -> int:
    """Where a contraction or reduction of length n is cut: at a third (0: not cut). A half
    would match the CPU's own blocking (MKL halves a contraction of 256 or 384 itself)."""
    return n // 3


# ----------------------------------------------------------------------------- matrix products

def _product(op, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """op(a, b) as split-K: the contraction (a's last dim, b's first after the batch) cut at a
    third, the two partial products added, in fp32 for half precision."""
    k, wide, kb = a.shape[-1], _WIDE.get(a.dtype, a.dtype), max(b.dim() - 2, 0)
    h = split(k)
    if h == 0 or not a.is_floating_point() or b.dim() == 0 or b.shape[kb] != k or b.dtype != a.dtype:
        return op(a, b)  # nothing to cut, or operands that do not fit: the CPU's kernel says why
    a, b = a.to(wide), b.to(wide)
    return op(a.narrow(-1, 0, h), b.narrow(kb, 0, h)).add_(op(a.narrow(-1, h, k - h), b.narrow(kb, h, k - h)))


def _plain(op):
    """op(a, b) (mm, bmm, mv, dot), split-K, in a's dtype."""
    def product(a, b):
        return _product(op, a, b).to(a.dtype)
    return product


def _scaled(op, cpu):
    """beta * self + alpha * op(a, b) (addmm, baddbmm, addmv), the product split-K (`cpu`: the
    CPU's kernel, where there is nothing to split)."""
    def product(self, a, b, *, beta=1, alpha=1):
        if split(a.shape[-1]) == 0 or not a.is_floating_point():
            return cpu(self, a, b, beta=beta, alpha=alpha)
        out = _product(op, a, b)
        if alpha != 1:
            out.mul_(alpha)
        if beta != 0:  # beta 0 ignores self, NaN included, as PyTorch's kernels do
            out.add_(self.to(out.dtype), alpha=beta)
        return out.to(a.dtype)
    return product


def _in_place(kernel):
    """The in-place form of `kernel` (addmm_, addcdiv_, ...): its result copied into self."""
    def in_place(self, *args, **kwargs):
        return self.copy_(kernel(self, *args, **kwargs))
    return in_place


# ----------------------------------------------------------------------------- reductions

def _dims(x: torch.Tensor, dim) -> list[int]:
    """The reduced dimensions, non-negative (all of them for None or []; none of a 0-dim x)."""
    if x.dim() == 0:
        return []
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.dim()))
    return [d % x.dim() for d in ([dim] if isinstance(dim, int) else dim)]


def _halves(x: torch.Tensor, dims: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x cut at a third of its outermost reduced dimension that can be cut (outermost: each
    part is one block of memory where x is), or None where none can."""
    cut = [d for d in sorted(dims) if split(x.shape[d])] if x.is_floating_point() and x.dim() else []
    if not cut:
        return None
    d, h = cut[0], split(x.shape[cut[0]])
    return x.narrow(d, 0, h), x.narrow(d, h, x.shape[d] - h)


def _sum(x, dim=None, keepdim=False, *, dtype=None):
    dims = _dims(x, dim)
    parts = _halves(x, dims)
    if parts is None or not (dtype or x.dtype).is_floating_point:
        return torch.sum(x, dim, keepdim, dtype=dtype)
    out = dtype or x.dtype
    wide = _WIDE.get(out, out)
    return (torch.sum(parts[0], dims, keepdim, dtype=wide) + torch.sum(parts[1], dims, keepdim, dtype=wide)).to(out)


def _mean(x, dim=None, keepdim=False, *, dtype=None):
    dims = _dims(x, dim)
    parts = _halves(x, dims)
    if parts is None:
        return torch.mean(x, dim, keepdim, dtype=dtype)
    out = dtype or x.dtype
    wide = _WIDE.get(out, out)
    total = torch.sum(parts[0], dims, keepdim, dtype=wide) + torch.sum(parts[1], dims, keepdim, dtype=wide)
    return total.div_(math.prod(x.shape[d] for d in dims)).to(out)


def _vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    """The 2-norm as the hypotenuse of its parts' norms, the 1-norm as their sum; the others
    (max, min, 0, p) as the CPU's (a max is exact in any order)."""
    dims = _dims(x, dim)
    parts = _halves(x, dims) if ord in (1, 2) and not x.is_complex() else None
    if parts is None:
        return torch.linalg.vector_norm(x, ord, dim, keepdim, dtype=dtype)
    out = dtype or x.dtype
    wide = _WIDE.get(out, out)
    n0, n1 = (torch.linalg.vector_norm(p, ord, dims, keepdim, dtype=wide) for p in parts)
    return (torch.hypot(n0, n1) if ord == 2 else n0.add_(n1)).to(out)


def _shifted(x, dim):
    """(x - max along dim, in fp32 for half precision; the sum of its exponentials, split)."""
    wide = x.to(_WIDE.get(x.dtype, x.dtype))
    shifted = wide - wide.amax(dim, keepdim=True)
    return shifted, _sum(shifted.exp(), [dim], True)


def _softmax(x, dim, half_to_float):
    if _halves(x, _dims(x, dim)) is None:
        return torch._softmax(x, dim, half_to_float)
    shifted, total = _shifted(x, dim)
    return shifted.exp_().div_(total).to(torch.float32 if half_to_float else x.dtype)


def _log_softmax(x, dim, half_to_float):
    if _halves(x, _dims(x, dim)) is None:
        return torch._log_softmax(x, dim, half_to_float)
    shifted, total = _shifted(x, dim)
    return shifted.sub_(total.log_()).to(torch.float32 if half_to_float else x.dtype)


# ----------------------------------------------------------------------------- fused multiply-adds

def _fused(base, value, other):
    """base + value * other (broadcast) rounded once, as CUDA's kernels contract it into an
    FMA: in fp64, where the product of two fp32 numbers is exact; value in fp32, as theirs."""
    base, other = torch.broadcast_tensors(base, other)
    return torch.addcmul(base.double(), torch.tensor(value, dtype=torch.float32).double(), other.double()).float()


def _addcmul(self, t1, t2, *, value=1):
    """CUDA's addcmul: self + value * (t1 * t2), the multiply-add rounded once (fp32)."""
    return _fused(self, value, t1 * t2) if self.dtype == torch.float32 else torch.addcmul(self, t1, t2, value=value)


def _addcdiv(self, t1, t2, *, value=1):
    """CUDA's addcdiv: self + value * (t1 / t2), the multiply-add rounded once (fp32)."""
    return _fused(self, value, t1 / t2) if self.dtype == torch.float32 else torch.addcdiv(self, t1, t2, value=value)


def _lerp(self, end, weight):
    """CUDA's lerp: self + w * (end - self) for |w| < 0.5, else end - (1 - w) * (end - self),
    the multiply-add rounded once (fp32, a scalar weight)."""
    if self.dtype != torch.float32 or isinstance(weight, torch.Tensor):
        return torch.lerp(self, end, weight)
    return _fused(self, weight, end - self) if abs(weight) < 0.5 else _fused(end, weight - 1, end - self)


# ----------------------------------------------------------------------------- the table

def _products() -> dict:
    found = {}
    for name in ("mm", "bmm", "mv", "dot"):
        found[getattr(_aten, name).default] = _plain(getattr(torch, name))
    for name, scaled in (("mm", "addmm"), ("bmm", "baddbmm"), ("mv", "addmv")):
        found[getattr(_aten, scaled).default] = _scaled(getattr(torch, name), getattr(torch, scaled))
    found[_aten.addmv_.default] = _in_place(found[_aten.addmv.default])
    found[_aten.addmm_.default] = _in_place(found[_aten.addmm.default])
    found[_aten.baddbmm_.default] = _in_place(found[_aten.baddbmm.default])
    return found


KERNELS = {  # op -> fgpu's kernel (every other op: the CPU's)
    **_products(),
    _aten.sum.dim_IntList: _sum, _aten.mean.dim: _mean, _aten.linalg_vector_norm.default: _vector_norm,
    _aten._softmax.default: _softmax, _aten._log_softmax.default: _log_softmax,
    _aten.addcmul.default: _addcmul, _aten.addcdiv.default: _addcdiv, _aten.lerp.Scalar: _lerp,
    _aten.addcmul_.default: _in_place(_addcmul), _aten.addcdiv_.default: _in_place(_addcdiv),
    _aten.lerp_.Scalar: _in_place(_lerp),
}
