"""The conjugate operators of tensor parallelism, each forward beside its backward.

    f  copy_to_region      forward: identity             backward: all-reduce
    g  reduce_from_region  forward: all-reduce           backward: identity
       scatter_to_region   forward: keep my last-dim chunk  backward: all-gather
       gather_from_region  forward: all-gather (last dim)   backward: keep my chunk
       all_reduce_region   forward: all-reduce           backward: all-reduce

       gather_from_sequence_region   forward: all-gather (seq)   backward: reduce-scatter
       reduce_scatter_to_sequence_region  forward: reduce-scatter (seq)  backward: all-gather

f and g are conjugate: where one communicates in forward, the other communicates in
backward. all_reduce_region is its own conjugate: each rank's result depends on every
rank's input (a layer norm's statistics over features split across ranks). A
column-parallel layer starts with f, a row-parallel layer ends with g, so a column layer
followed by a row layer costs one all-reduce forward and one backward.
`group` is the tensor-parallel process group (None: the world). On a group of one rank
every operator is the identity and sends nothing; on meta tensors (a pipeline finding its
stages' shapes, `pipeline.activation_shapes`) only the shapes are computed and nothing is
sent: NCCL has no backend for the meta device. The sequence-parallel pair replaces f and
g when the regions between blocks (layer norm, dropout) hold a slice of the sequence
([batch, seq/t, hidden]) instead of a replica: an all-reduce is a reduce-scatter followed by
an all-gather, and the same bytes are sent.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["copy_to_region", "reduce_from_region", "scatter_to_region", "gather_from_region",
           "all_reduce_region", "gather_from_sequence_region", "reduce_scatter_to_sequence_region",
           "CopyToRegion", "ReduceFromRegion", "ScatterToRegion", "GatherFromRegion", "AllReduceRegion",
           "GatherFromSequenceRegion", "ReduceScatterToSequenceRegion"]


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of x over the group, in a new tensor: sends 2(t-1)/t * x.nbytes (ring)."""
    if dist.get_world_size(group) == 1 or x.is_meta:
        return x
    x = x.clone(memory_format=torch.contiguous_format)  # the caller's tensor (a shared gradient) stays as it is
    dist.all_reduce(x, group=group)
    return x


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's chunk of the last dimension (no communication)."""
    t = dist.get_world_size(group)
    if x.shape[-1] % t:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by the tensor-parallel size {t}: "
                         f"make it a multiple of {t}")
    return x.chunk(t, dim=-1)[dist.get_rank(group)].contiguous()  # [..., d/t]


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's x concatenated along the last dimension in rank order: each rank
    sends its x.nbytes to each of the t-1 others (all_gather_single)."""
    t = dist.get_world_size(group)
    if t == 1:
        return x
    x = x.contiguous().view(1, *x.shape)  # [1, ..., d]
    out = torch.empty((t, *x.shape[1:]), dtype=x.dtype, device=x.device)  # [t, ..., d]
    if not x.is_meta:
        dist.all_gather_single(out, x, group=group)
    return out.movedim(0, -2).reshape(*x.shape[1:-1], t * x.shape[-1])  # [..., t*d]


def _gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """[b, s/t, h] -> [b, s, h], the ranks' slices in rank order: each rank sends its
    x.nbytes to each of the t-1 others (all_gather_single)."""
    t = dist.get_world_size(group)
    if t == 1:
        return x
    x = x.movedim(1, 0).contiguous()  # [s/t, b, h]
    out = torch.empty((t * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)  # [s, b, h]
    if not x.is_meta:
        dist.all_gather_single(out, x, group=group)
    return out.movedim(0, 1)  # [b, s, h]


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """[b, s, h] summed over the group, this rank's slice [b, s/t, h]: each rank sends
    (t-1)/t * x.nbytes (reduce_scatter_single)."""
    t = dist.get_world_size(group)
    if t == 1:
        return x
    if x.shape[1] % t:
        raise ValueError(f"sequence length {x.shape[1]} is not divisible by the tensor-parallel size {t}: "
                         f"make it a multiple of {t}")
    x = x.movedim(1, 0).contiguous()  # [s, b, h]
    out = torch.empty((x.shape[0] // t, *x.shape[1:]), dtype=x.dtype, device=x.device)  # [s/t, b, h]
    if not x.is_meta:
        dist.reduce_scatter_single(out, x, group=group)
    return out.movedim(0, 1)  # [b, s/t, h]


class CopyToRegion(torch.autograd.Function):
    """f: enter a tensor-parallel region with a replicated input."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # every rank holds a partial dL/dx: sum them
        return _all_reduce(grad, ctx.group), None


class ReduceFromRegion(torch.autograd.Function):
    """g: leave a tensor-parallel region by summing the ranks' partial outputs."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):  # the sum's gradient reaches every addend unchanged
        return grad, None


class ScatterToRegion(torch.autograd.Function):
    """Enter a region by keeping this rank's chunk of the last dimension."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class GatherFromRegion(torch.autograd.Function):
    """Leave a region by concatenating the ranks' chunks of the last dimension."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class AllReduceRegion(torch.autograd.Function):
    """Sum over the group both ways: every rank's output feeds on every rank's input."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):  # each rank's dL/dsum reaches every addend: sum them
        return _all_reduce(grad, ctx.group), None


class GatherFromSequenceRegion(torch.autograd.Function):
    """Sequence parallel's f: enter a region from a sequence slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):  # every rank holds a partial dL/dx of the whole sequence: sum, keep my slice
        return _reduce_scatter_seq(grad, ctx.group), None


class ReduceScatterToSequenceRegion(torch.autograd.Function):
    """Sequence parallel's g: leave a region by summing the partial outputs, each rank keeping its slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


def copy_to_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """f. Forward sends nothing; backward all-reduces dL/dx (2(t-1)/t * x.nbytes per rank)."""
    return CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """g. Forward all-reduces x (2(t-1)/t * x.nbytes per rank); backward sends nothing."""
    return ReduceFromRegion.apply(x, group)


def scatter_to_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """[..., d] -> [..., d/t]. Forward sends nothing; backward all-gathers dL/dx
    (each rank sends its [..., d/t] gradient to the t-1 others)."""
    return ScatterToRegion.apply(x, group)


def gather_from_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """[..., d/t] -> [..., d]. Forward all-gathers x (each rank sends x.nbytes to the t-1
    others); backward sends nothing."""
    return GatherFromRegion.apply(x, group)


def all_reduce_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Forward all-reduces x, backward all-reduces dL/dx (2(t-1)/t * x.nbytes per rank each way)."""
    return AllReduceRegion.apply(x, group)


def gather_from_sequence_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """[batch, seq/t, hidden] -> [batch, seq, hidden]. Forward all-gathers x (each rank sends
    x.nbytes to the t-1 others); backward reduce-scatters dL/dx ((t-1)/t of the full gradient)."""
    return GatherFromSequenceRegion.apply(x, group)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """[batch, seq, hidden] partial sums -> this rank's [batch, seq/t, hidden] of the sum.
    Forward reduce-scatters ((t-1)/t * x.nbytes per rank); backward all-gathers dL/dy."""
    return ReduceScatterToSequenceRegion.apply(x, group)
