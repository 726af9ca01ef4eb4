"""DeepSpeed-Ulysses (Jacobs et al. 2023): attention over a sequence split across the n ranks
of `group` by re-sharding around it with all-to-all.

Outside attention each rank holds a slice of the sequence with every head,
[batch, heads, seq/n, head_dim]. One all-to-all per tensor makes it every position of
heads/n heads, [batch, heads/n, seq, head_dim]; attention runs locally, heads being
independent; one all-to-all takes the output back to the sequence slice. Each all-to-all
sends (n-1)/n of the tensor, so a rank sends 4(n-1)/n x its q.nbytes forward (q, k, v, out),
and the same backward. Heads must be divisible by n. The split is contiguous (rank r holds
the r-th slice), so a causal mask applies unchanged after the re-shard.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parakit.context_parallel import check_qkv

__all__ = ["seq_to_heads", "heads_to_seq", "SeqToHeads", "HeadsToSeq", "ulysses_attention", "ulysses_bytes_per_rank"]


def check_heads(heads: int, n: int) -> None:
    """Raise a ValueError naming the sizes unless n ranks split `heads` evenly."""
    if heads % n:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(f"{heads} heads are not divisible by the Ulysses degree {n}: use a number of ranks that "
                         f"divides {heads} ({', '.join(map(str, divisors))}) or a multiple of {n} heads")


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[b, h, s/n, d] -> [b, h/n, s, d]: rank j gets my slice of its heads; sends (n-1)/n x x.nbytes."""
    n = dist.get_world_size(group)
    b, h, s, d = x.shape
    check_heads(h, n)
    if n == 1:
        return x
    send = x.reshape(b, n, h // n, s, d).movedim(1, 0).contiguous()  # [n, b, h/n, s/n, d]: row j goes to rank j
    got = torch.empty_like(send)  # [n, b, h/n, s/n, d]: row j is rank j's slice of my heads
    dist.all_to_all_single(got, send, group=group)
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)  # [b, h/n, s, d]


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """[b, h/n, s, d] -> [b, h, s/n, d]: rank j gets its slice of my heads; sends (n-1)/n x x.nbytes."""
    n = dist.get_world_size(group)
    if n == 1:
        return x
    b, hn, s, d = x.shape
    send = x.reshape(b, hn, n, s // n, d).movedim(2, 0).contiguous()  # [n, b, h/n, s/n, d]: row j to rank j
    got = torch.empty_like(send)  # [n, b, h/n, s/n, d]: row j holds rank j's heads
    dist.all_to_all_single(got, send, group=group)
    return got.movedim(0, 1).reshape(b, n * hn, s // n, d)  # [b, h, s/n, d]


class SeqToHeads(torch.autograd.Function):
    """Sequence-sharded to head-sharded; its backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), ctx.group), None


class HeadsToSeq(torch.autograd.Function):
    """Head-sharded back to sequence-sharded; its backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), ctx.group), None


def seq_to_heads(x: torch.Tensor, group=None) -> torch.Tensor:
    """[b, h, s/n, d] -> [b, h/n, s, d]. One all-to-all each way ((n-1)/n x x.nbytes per rank)."""
    return SeqToHeads.apply(x, group)


def heads_to_seq(x: torch.Tensor, group=None) -> torch.Tensor:
    """[b, h/n, s, d] -> [b, h, s/n, d]. One all-to-all each way ((n-1)/n x x.nbytes per rank)."""
    return HeadsToSeq.apply(x, group)


def ulysses_attention(q, k, v, causal: bool = False, group=None, scale: float | None = None) -> torch.Tensor:
    """[b, h, s/n, d] x 3 -> [b, h, s/n, d]: re-shard q, k, v to heads/n heads of the whole
    sequence, F.scaled_dot_product_attention, re-shard back. Four all-to-alls forward, four backward."""
    check_qkv(q, k, v)
    check_heads(q.shape[1], dist.get_world_size(group))
    q, k, v = (seq_to_heads(t, group) for t in (q, k, v))  # [b, h/n, s, d]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    return heads_to_seq(out, group)  # [b, h, s/n, d]


def ulysses_bytes_per_rank(shape_local: tuple[int, ...], n: int, element_size: int = 4, backward: bool = False) -> int:
    """Bytes one rank sends: four all-to-alls of a [b, h, seq/n, d] tensor, (n-1)/n of each."""
    nbytes = math.prod(shape_local) * element_size
    return 4 * (n - 1) * nbytes // n * (2 if backward else 1)
