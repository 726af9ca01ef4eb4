"""Context parallelism: ring attention (Liu et al. 2023) with the online-softmax merge, causal
masking and the zig-zag split that balances it.

Each of the n ranks of `group` holds a block of the sequence's queries, keys and values,
[batch, heads, seq/n, head_dim]. K and V travel around the ring: at step i rank r holds the
block of rank r - i, posts the send of it to rank r + 1 and the receive of the next block
from rank r - 1 as one batch (so that NCCL cannot deadlock the ring), and computes on it
while they move. Each step gives a partial attention (its output and the log-sum-exp of its
scores), merged into the running result exactly:

    lse = log(e^lse_a + e^lse_b)        out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b

The backward passes K and V around once more; each block's dK, dV accumulator follows it one
step behind, each rank adding its share, and comes home after n steps (dq stays home); no
rank ever holds the whole sequence. The sequence is cut in chunks: n contiguous ones (rank r
holds chunk r), or 2n for the zig-zag split (rank r holds chunks r and 2n-1-r). Under a
causal mask a query chunk sees whole earlier chunks, half of its own, and nothing later;
chunk pairs fully masked are skipped, so with the contiguous split rank n-1 works about 2n-1
times as much as rank 0, and with zig-zag every rank does the same work.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from parakit.comm import post_batch

__all__ = ["LAYOUTS", "chunk_ids", "check_sequence", "shard_sequence", "unshard_sequence", "check_qkv", "block_attention",
           "block_attention_backward", "merge_partials", "pair_kind", "attention_work", "ring_attention",
           "ring_attention_forward", "ring_attention_backward", "RingAttention", "ring_bytes_per_rank",
           "ContextParallelSelfAttention"]

LAYOUTS = ("contiguous", "zigzag")


def chunk_ids(n: int, rank: int, layout: str = "contiguous") -> tuple[int, ...]:
    """The global chunks rank holds: (rank,) of n chunks, or (rank, 2n-1-rank) of 2n (zig-zag)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    return (rank,) if layout == "contiguous" else (rank, 2 * n - 1 - rank)


def _parts(n: int, layout: str) -> int:
    return n * len(chunk_ids(n, 0, layout))


def check_sequence(seq: int, n: int, layout: str) -> None:
    """Raise a ValueError naming the sizes unless the layout splits `seq` evenly on n ranks."""
    parts = _parts(n, layout)
    if seq % parts:
        how = f"2 x {n} ranks for the zig-zag split" if layout == "zigzag" else f"{n} ranks"
        raise ValueError(f"sequence length {seq} is not divisible by {parts} ({how}): make it a multiple of "
                         f"{parts}, such as {(seq // parts + 1) * parts}")


def shard_sequence(x: torch.Tensor, n: int, rank: int, layout: str = "contiguous", dim: int = -2) -> torch.Tensor:
    """This rank's part of the whole sequence x along `dim` (no communication): [..., seq, d] ->
    [..., seq/n, d], its chunks concatenated in the order of chunk_ids."""
    check_sequence(x.shape[dim], n, layout)
    chunks = x.chunk(_parts(n, layout), dim)
    return torch.cat([chunks[i] for i in chunk_ids(n, rank, layout)], dim)  # [..., seq/n, d]


def unshard_sequence(parts: list[torch.Tensor], layout: str = "contiguous", dim: int = -2) -> torch.Tensor:
    """The whole sequence from every rank's part, in rank order (one process: for checks and plots)."""
    n = len(parts)
    chunks = {}
    for rank, part in enumerate(parts):
        ids = chunk_ids(n, rank, layout)
        chunks.update(zip(ids, part.chunk(len(ids), dim)))
    return torch.cat([chunks[i] for i in range(len(chunks))], dim)  # [..., seq, d]


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise a ValueError unless q, k, v are all [batch, heads, seq, head_dim] of one shape."""
    if not (q.dim() == 4 and q.shape == k.shape == v.shape):
        raise ValueError(f"q, k and v must have the same shape [batch, heads, seq/n, head_dim]: got q "
                         f"{list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")


# ---------------------------------------------------------------- one block, and the merge

def pair_kind(q_chunk: int, k_chunk: int, causal: bool) -> str:
    """How a query chunk sees a key chunk: "full", "diagonal" (causal inside it) or "skip"."""
    if not causal or k_chunk < q_chunk:
        return "full"
    return "diagonal" if k_chunk == q_chunk else "skip"


def _scores(q, k, scale, diagonal):
    s = (q @ k.transpose(-1, -2)) * scale  # [b, h, c, c]
    if diagonal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def block_attention(q, k, v, scale: float, diagonal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q over one block of k, v (no communication): (out [b, h, c, d],
    lse [b, h, c], the log-sum-exp of each query's scores). `diagonal`: causal inside the block."""
    s = _scores(q, k, scale, diagonal)
    lse = torch.logsumexp(s, dim=-1)  # [b, h, c]
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


def block_attention_backward(do, q, k, v, lse, delta, scale: float, diagonal: bool = False):
    """dq, dk, dv [b, h, c, d] of q's attention over one block of k, v (no communication), from
    the final lse [b, h, c] of q's rows over the whole sequence and delta = rowsum(dout * out)
    [b, h, c]. With p = exp(q k^T scale - lse), this block's entries of the whole softmax:
    dv = p^T do, ds = p (do v^T - delta), dq = ds k scale, dk = ds^T q scale. Summed over every
    block, they are the whole attention's gradients. `diagonal`: causal inside the block."""
    p = torch.exp(_scores(q, k, scale, diagonal) - lse.unsqueeze(-1))  # [b, h, c, c]
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ v.transpose(-1, -2) - delta.unsqueeze(-1))
    return (ds @ k) * scale, (ds.transpose(-1, -2) @ q) * scale, dv


def merge_partials(out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same queries over disjoint keys, merged into the
    attention over both: (out, lse), exactly (the online softmax)."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = torch.exp(lse_a - lse).unsqueeze(-1) * out_a + torch.exp(lse_b - lse).unsqueeze(-1) * out_b
    return out, lse


def attention_work(seq: int, n: int, layout: str = "contiguous", causal: bool = True) -> list[int]:
    """Query-key scores each rank computes in ring attention (fully masked chunk pairs are
    skipped; a diagonal pair counts its c(c+1)/2 unmasked scores), per batch and head."""
    check_sequence(seq, n, layout)
    c = seq // _parts(n, layout)
    cost = {"full": c * c, "diagonal": c * (c + 1) // 2, "skip": 0}
    every = [i for r in range(n) for i in chunk_ids(n, r, layout)]
    return [sum(cost[pair_kind(i, j, causal)] for i in chunk_ids(n, r, layout) for j in every) for r in range(n)]


def ring_bytes_per_rank(shape_local: tuple[int, ...], n: int, element_size: int = 4, backward: bool = False) -> int:
    """Bytes one rank sends in ring attention: K and V, [b, h, seq/n, d] each, to the next rank
    n-1 times forward; backward once more n-1 times, and dK, dV n times."""
    kv = 2 * math.prod(shape_local) * element_size
    return (n - 1) * kv + ((n - 1) * kv + n * kv if backward and n > 1 else 0)


# ---------------------------------------------------------------- the ring

def _ring(group):
    """(n, this rank, the next rank, the previous rank), as ranks of `group`."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    return n, r, (r + 1) % n, (r - 1) % n


def _pass_on(tensor: torch.Tensor, after: int, before: int, group) -> tuple[torch.Tensor, list]:
    """Post the send of `tensor` to `after` and the receive of as many bytes from `before`
    as one batch; returns the receive buffer and the batch to wait on."""
    buffer = torch.empty_like(tensor)
    return buffer, [post_batch([("send", tensor, after), ("recv", buffer, before)], group)]


def _wait(batches):
    for batch in batches:
        batch.wait()


def _shape_check(q, k, v, n, layout):
    check_qkv(q, k, v)
    parts = len(chunk_ids(n, 0, layout))
    if q.shape[2] % parts:
        raise ValueError(f"local sequence length {q.shape[2]} on each of {n} ranks ({q.shape[2] * n} in all) is not "
                         f"divisible into the {parts} chunks of the {layout} split: make the whole sequence a "
                         f"multiple of {n * parts}")


def ring_attention_forward(q, k, v, causal: bool = False, layout: str = "contiguous", group=None,
                           scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's queries over the whole sequence, K and V passed around the ring
    (no autograd): (out [b, h, seq/n, d], lse [b, h, seq/n]). Sends its K and V, 2 x q.nbytes,
    to the next rank n-1 times; each transfer is posted before the block it overlaps is computed."""
    n, r, after, before = _ring(group)
    _shape_check(q, k, v, n, layout)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    mine = chunk_ids(n, r, layout)
    qs = q.chunk(len(mine), dim=2)  # [b, h, c, d] each
    acc: list = [None] * len(mine)
    kv = torch.stack([k, v]).contiguous()  # [2, b, h, seq/n, d]
    for step in range(n):
        owner = (r - step) % n
        nxt, requests = _pass_on(kv, after, before, group) if step < n - 1 else (None, [])
        theirs = chunk_ids(n, owner, layout)
        for a, (i, qc) in enumerate(zip(mine, qs)):
            for j, kc, vc in zip(theirs, kv[0].chunk(len(theirs), 2), kv[1].chunk(len(theirs), 2)):
                kind = pair_kind(i, j, causal)
                if kind == "skip":
                    continue
                part = block_attention(qc, kc, vc, scale, kind == "diagonal")
                acc[a] = part if acc[a] is None else merge_partials(*acc[a], *part)
        _wait(requests)
        kv = nxt
    return torch.cat([o for o, _ in acc], 2), torch.cat([lse for _, lse in acc], 2)


def ring_attention_backward(do, q, k, v, out, lse, causal: bool = False, layout: str = "contiguous", group=None,
                            scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv [b, h, seq/n, d] of this rank's blocks, from the forward's out and lse (no autograd).
    K and V go around the ring as in forward: 2 x q.nbytes to the next rank, n-1 times. Each block's
    dK, dV accumulator follows one step behind, 2 x q.nbytes to the next rank n times, and is home
    after n steps; dq stays home. Each step: post K, V on; compute; wait; add the accumulator that
    came from the previous rank to this rank's share of the block; post it on to the next rank."""
    n, r, after, before = _ring(group)
    _shape_check(q, k, v, n, layout)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    mine = chunk_ids(n, r, layout)
    split = lambda t: t.chunk(len(mine), dim=2)
    qs, dos, lses, deltas = split(q), split(do), split(lse), split((do * out).sum(-1))  # delta: [b, h, seq/n]
    dq = [torch.zeros_like(c) for c in qs]
    kv, incoming, in_flight = torch.stack([k, v]).contiguous(), None, []
    for step in range(n):
        nxt, requests = _pass_on(kv, after, before, group) if step < n - 1 else (None, [])
        theirs = chunk_ids(n, (r - step) % n, layout)
        share = torch.zeros_like(kv)  # [2, b, h, seq/n, d]: this rank's part of the block's dK, dV
        kcs, vcs = kv[0].chunk(len(theirs), 2), kv[1].chunk(len(theirs), 2)
        dks, dvs = share[0].chunk(len(theirs), 2), share[1].chunk(len(theirs), 2)
        for a, i in enumerate(mine):
            for b_, j in enumerate(theirs):
                kind = pair_kind(i, j, causal)
                if kind == "skip":
                    continue
                g_q, g_k, g_v = block_attention_backward(dos[a], qs[a], kcs[b_], vcs[b_], lses[a], deltas[a], scale,
                                                         kind == "diagonal")
                dq[a] += g_q
                dks[b_].add_(g_k)
                dvs[b_].add_(g_v)
        _wait(in_flight + requests)
        if incoming is not None:
            share += incoming  # what the ranks before this one added to the block
        if n > 1:
            incoming, in_flight = _pass_on(share, after, before, group)
        kv = nxt
    _wait(in_flight)
    dkv = incoming if n > 1 else share  # my own block's, home after n steps
    return torch.cat(dq, 2), dkv[0], dkv[1]


class RingAttention(torch.autograd.Function):
    """Ring attention with its backward around the ring. Saves this rank's q, k, v, out and
    lse only: [b, h, seq/n, d] each and [b, h, seq/n]."""

    @staticmethod
    def forward(ctx, q, k, v, causal, layout, group, scale):
        out, lse = ring_attention_forward(q, k, v, causal, layout, group, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = causal, layout, group, q.shape[-1] ** -0.5 if scale is None else scale
        return out

    @staticmethod
    def backward(ctx, do):
        dq, dk, dv = ring_attention_backward(do.contiguous(), *ctx.saved_tensors, *ctx.args)
        return dq, dk, dv, None, None, None, None


def ring_attention(q, k, v, causal: bool = False, layout: str = "contiguous", group=None,
                   scale: float | None = None) -> torch.Tensor:
    """[b, h, seq/n, d] x 3 -> [b, h, seq/n, d], this rank's rows of softmax(q k^T scale) v over
    the whole sequence split by `layout`. Forward sends K, V (2 x q.nbytes) n-1 times to the
    next rank; backward sends them n-1 times more and dK, dV n times."""
    return RingAttention.apply(q, k, v, causal, layout, group, scale)


class ContextParallelSelfAttention(nn.Module):
    """Self-attention on this rank's tokens [batch, seq/n, hidden] with ring attention between
    whole (replicated) qkv and proj layers: every activation it stores is this rank's 1/n.
    The layers' gradients cover this rank's tokens only: all-reduce them over the group
    (as data parallelism does) before the optimizer step."""

    def __init__(self, hidden: int, heads: int, causal: bool = True, layout: str = "zigzag", group=None):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden={hidden} is not divisible by heads={heads}: make hidden a multiple of heads")
        self.heads, self.causal, self.layout, self.group = heads, causal, layout, group
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)  # [b, heads, s/n, d]
        out = ring_attention(q, k, v, self.causal, self.layout, self.group)  # [b, heads, s/n, d]
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))  # [b, s/n, hidden]
