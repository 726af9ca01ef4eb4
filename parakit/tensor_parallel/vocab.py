"""The vocabulary split across the tensor-parallel group: embedding rows and output logits.

Rank i owns the ids [i*V/t, (i+1)*V/t). The embedding looks up the ids it owns, writes
zeros for the others, and an all-reduce (g) fills in every row. The cross-entropy never
gathers the [..., V] logits: it all-reduces the max (for a stable softmax), then the
target's logit and the sum of exponentials together, and computes its own slice of the
gradient, softmax - one_hot, with no communication in backward.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parakit.tensor_parallel.layers import check_divisible, tp_size_rank
from parakit.tensor_parallel.mappings import reduce_from_region

__all__ = ["VocabParallelEmbedding", "vocab_parallel_cross_entropy"]


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding with its rows split across the group: weight [vocab/t, dim] (the dense
    layer's rows, made once from the same seed and sliced). [...] ids -> [..., dim]; one
    all-reduce of the output forward, nothing backward. An id outside [0, vocab) raises, as
    in nn.Embedding."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None):
        super().__init__()
        t, rank = tp_size_rank(group)
        check_divisible("VocabParallelEmbedding", "num_embeddings", num_embeddings, t)
        self.num_embeddings, self.group = num_embeddings, group
        self.start = rank * (num_embeddings // t)
        self.weight = nn.Parameter(nn.Embedding(num_embeddings, embedding_dim).weight.detach().chunk(t, 0)[rank].clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        wrong = (ids < 0) | (ids >= self.num_embeddings)
        if wrong.any():  # another rank would not own it either: every rank would write zeros
            raise ValueError(f"VocabParallelEmbedding: id {int(ids[wrong][0])} is outside the vocabulary of "
                             f"{self.num_embeddings}: ids must lie in [0, {self.num_embeddings})")
        outside = (ids < self.start) | (ids >= self.start + self.weight.shape[0])  # ids another rank owns
        local = torch.where(outside, 0, ids - self.start)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # [..., dim]
        return reduce_from_region(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss log(sum_j e^{z_j}) - z_target from logits split by vocabulary.
    Forward: all-reduce (max) of [...] floats, then one all-reduce (sum) of 2 x [...]."""

    @staticmethod
    def forward(ctx, logits, target, group):  # logits [..., vocab/t], target [...]
        t, rank = tp_size_rank(group)
        part = logits.shape[-1]
        top = logits.detach().amax(dim=-1)  # [...]
        if t > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top.unsqueeze(-1)  # [..., vocab/t]
        mine = (target >= rank * part) & (target < (rank + 1) * part)
        local = torch.where(mine, target - rank * part, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine  # target logit, 0 off this rank
        exp = shifted.exp()
        sums = torch.stack([picked, exp.sum(dim=-1)])  # [2, ...]
        if t > 1:
            dist.all_reduce(sums, group=group)
        ctx.save_for_backward(exp / sums[1].unsqueeze(-1), local, mine)
        return sums[1].log() - sums[0]

    @staticmethod
    def backward(ctx, grad):  # grad [...]
        softmax, local, mine = ctx.saved_tensors
        one_hot = torch.zeros_like(softmax).scatter_(-1, local.unsqueeze(-1), mine.unsqueeze(-1).to(softmax.dtype))
        return (softmax - one_hot) * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None,
                                 reduction: str = "mean") -> torch.Tensor:
    """F.cross_entropy(full_logits.flatten(0, -2), target.flatten(), reduction=...) from this
    rank's logits [..., vocab/t] and the full target ids [...] (the same on every rank).
    Sends two all-reduces forward: the max ([...] floats) and target logit + sum-exp (2 x [...])."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}: use 'mean', 'sum' or 'none'")
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree: logits must be "
                         f"target's shape plus one last dimension, vocab/t")
    vocab = logits.shape[-1] * tp_size_rank(group)[0]
    if target.numel() and (target.min() < 0 or target.max() >= vocab):
        raise ValueError(f"target ids must lie in [0, {vocab}) (vocab/t = {logits.shape[-1]} on each of "
                         f"{vocab // logits.shape[-1]} ranks); got {int(target.min())}..{int(target.max())}")
    loss = _VocabParallelCrossEntropy.apply(logits, target, group)
    return loss.mean() if reduction == "mean" else loss.sum() if reduction == "sum" else loss
