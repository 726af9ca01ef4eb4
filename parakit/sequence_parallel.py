"""Sequence parallelism (Korthikanti et al. 2022): the layer norms and residuals of a
tensor-parallel block run on a slice of the sequence instead of a replica.

In a tensor-parallel block (parakit.tensor_parallel) every rank of the group holds the whole
[batch, seq, hidden] activations between the parallel regions and repeats the layer norms
on them. Sequence parallelism gives rank i the slice [batch, seq/t, hidden] there instead:

    f  (identity / all-reduce)  becomes  all-gather along seq / reduce-scatter   (entering a region)
    g  (all-reduce / identity)  becomes  reduce-scatter along seq / all-gather   (leaving it)

An all-reduce is a reduce-scatter followed by an all-gather, so a layer sends the bytes of
tensor parallelism's four all-reduces; every activation outside the regions is stored 1/t
as large. The pair itself lives with the other conjugate operators
(`tensor_parallel.gather_from_sequence_region`, `reduce_scatter_to_sequence_region`).
The paper also stores only the slice of a column layer's all-gathered input and all-gathers
it again in backward (`AllGatherLinear`, one more all-gather per column layer), so that a
layer's activations are the tensor-parallel ones divided by t:

    activations per layer (bytes, 16-bit, with dropout)   sbh (34 + 5as/h)          one rank
                                                            sbh (10 + 24/t + 5as/(ht))  tensor parallel
                                                            sbh/t (34 + 5as/h)      tensor + sequence parallel
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parakit.tensor_parallel import (ParallelMLP, ParallelSelfAttention, gather_from_sequence_region,
                                     reduce_scatter_to_sequence_region)

__all__ = ["AllGatherLinear", "SequenceParallelTransformerBlock", "split_sequence", "sync_sequence_parallel_grads",
           "gather_from_sequence_region", "reduce_scatter_to_sequence_region", "paper_activation_bytes"]


def split_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """[batch, seq, hidden] -> this rank's [batch, seq/t, hidden] (no communication)."""
    t, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[1] % t:
        raise ValueError(f"sequence length {x.shape[1]} is not divisible by the sequence-parallel size {t}: "
                         f"make it a multiple of {t}")
    return x.chunk(t, 1)[rank]


class AllGatherLinear(torch.autograd.Function):
    """y = all-gather(x) A^T + b, saving only this rank's slice x [batch, seq/t, in]. Forward
    all-gathers x; backward all-gathers it again (for dA) and reduce-scatters dL/dx."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.bias = group, bias is not None
        return F.linear(gather_from_sequence_region(x, group), weight, bias)  # [batch, seq, out/t]

    @staticmethod
    def backward(ctx, grad):  # grad [batch, seq, out/t]
        x, weight = ctx.saved_tensors
        full = gather_from_sequence_region(x, ctx.group)  # [batch, seq, in], again
        dx = reduce_scatter_to_sequence_region(grad @ weight, ctx.group)  # [batch, seq/t, in]
        dweight = grad.flatten(0, -2).t() @ full.flatten(0, -2)  # [out/t, in]
        dbias = grad.flatten(0, -2).sum(0) if ctx.bias else None
        return dx, dweight, dbias, None


class SequenceParallelTransformerBlock(nn.Module):
    """parakit's ParallelTransformerBlock (pre-norm, no dropout) on [batch, seq/t, hidden]:
    the same parameters from the same seed, the same output, sliced by sequence.

    Per layer, forward: two all-gathers (into attention's qkv and the MLP's fc1) and two
    reduce-scatters (out of proj and fc2); backward the same with the roles swapped, plus two
    all-gathers with regather=True (store slices only). The layer norms' parameters and the
    row layers' biases see only this rank's tokens: `sync_sequence_parallel_grads` sums
    their gradients over the group before the optimizer step.
    """

    def __init__(self, hidden: int, heads: int, ffn_hidden: int | None = None, causal: bool = True, group=None,
                 regather: bool = True):
        super().__init__()
        self.group, self.regather = group, regather
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = ParallelSelfAttention(hidden, heads, causal, group=group, sequence_parallel=True)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = ParallelMLP(hidden, ffn_hidden, group, sequence_parallel=True)

    def _column(self, layer, x: torch.Tensor) -> torch.Tensor:  # [batch, seq/t, in] -> [batch, seq, out/t]
        return AllGatherLinear.apply(x, layer.weight, layer.bias, self.group) if self.regather else layer(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [batch, seq/t, hidden]
        x = x + self.attn.proj(self.attn.attend(self._column(self.attn.qkv, self.norm1(x))))
        return x + self.mlp.fc2(F.gelu(self._column(self.mlp.fc1, self.norm2(x))))  # [batch, seq/t, hidden]

    def sequence_parameters(self) -> list[nn.Parameter]:
        """The parameters each rank applies to its own tokens only: their gradients are partial."""
        return [*self.norm1.parameters(), *self.norm2.parameters(), self.attn.proj.bias, self.mlp.fc2.bias]


def sync_sequence_parallel_grads(block: SequenceParallelTransformerBlock, group=None) -> None:
    """Sum the partial gradients of the block's sequence-region parameters over the group:
    one all-reduce of them all, 2(t-1)/t x their bytes per rank."""
    grads = [p.grad for p in block.sequence_parameters() if p.grad is not None]
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, group=group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def paper_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False) -> float:
    """Korthikanti et al.'s model of the bytes one transformer layer stores for backward
    (16-bit activations, 1-byte dropout masks, attention scores stored): sbh(34 + 5as/h) on one
    rank, sbh(10 + 24/t + 5as/(ht)) with t-way tensor parallelism, sbh/t (34 + 5as/h) with
    sequence parallelism too. A model, not a measurement."""
    if sequence_parallel:
        return s * b * h / t * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
