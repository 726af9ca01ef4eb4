"""Column- and row-parallel linear layers and the blocks built from them (Megatron-LM).

Y = XA with the weight A split across the t ranks of a tensor-parallel group:

    ColumnParallelLinear  A = [A_1 ... A_t] by columns: rank i computes Y_i = X A_i
                          ([..., out/t]); f before it, optional all-gather after it.
    RowParallelLinear     A split by rows, X by its last dimension: rank i computes
                          X_i A_i, and g (an all-reduce) sums them; the bias is added once.

A column layer followed by a row layer needs no communication between them, so a parallel
MLP (and self-attention, heads split across ranks) costs one all-reduce of the block's
output forward and one of its input gradient backward. Each layer makes the full dense
weight once, exactly as nn.Linear would from the same seed, and keeps its slice, so the
sharded model computes what the dense one does. Every rank of the group must be seeded
alike before building it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parakit.context_parallel import ring_attention
from parakit.tensor_parallel.mappings import (copy_to_region, gather_from_region, gather_from_sequence_region,
                                              reduce_from_region, reduce_scatter_to_sequence_region, scatter_to_region)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "ParallelSelfAttention",
           "ParallelTransformerBlock", "tp_size_rank", "check_divisible"]


def tp_size_rank(group=None) -> tuple[int, int]:
    """(t, this rank's index) in the tensor-parallel group (None: the world)."""
    return dist.get_world_size(group), dist.get_rank(group)


def check_divisible(layer: str, name: str, value: int, t: int) -> None:
    """Raise a ValueError naming `layer` and `name` unless t ranks split `value` evenly."""
    if value % t:
        raise ValueError(f"{layer}: {name}={value} is not divisible by the tensor-parallel size {t}: "
                         f"make {name} a multiple of {t} or use a tensor-parallel size that divides {value}")


def _check_last(layer: str, x: torch.Tensor, expected: int, what: str) -> None:
    if x.shape[-1] != expected:
        raise ValueError(f"{layer}: the input's last dimension is {x.shape[-1]} but this rank expects {expected} "
                         f"({what}); input shape {tuple(x.shape)}")


def _dense_slice(dense: nn.Linear, dim: int, t: int, rank: int) -> tuple[nn.Parameter, nn.Parameter | None]:
    """This rank's slice of a dense layer's weight along `dim` (0: out, 1: in), and of its bias
    along out (dim 0) or the whole bias (dim 1)."""
    weight = nn.Parameter(dense.weight.detach().chunk(t, dim)[rank].clone())
    if dense.bias is None:
        return weight, None
    bias = dense.bias.detach().chunk(t, 0)[rank] if dim == 0 else dense.bias.detach()
    return weight, nn.Parameter(bias.clone())


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A's out_features split across the group: weight [out/t, in], bias [out/t].

    Input [..., in] replicated on every rank; output [..., out/t] (or [..., out] with
    gather_output=True, one all-gather of it). Backward all-reduces dL/dx (f). With
    sequence_parallel=True the input is this rank's slice of the sequence [batch, seq/t, in],
    all-gathered forward and reduce-scattered backward instead.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 group=None, sequence_parallel: bool = False):
        super().__init__()
        t, rank = tp_size_rank(group)
        check_divisible("ColumnParallelLinear", "out_features", out_features, t)
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.weight, self.bias = _dense_slice(nn.Linear(in_features, out_features, bias=bias), 0, t, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_last("ColumnParallelLinear", x, self.in_features, "in_features")
        enter = gather_from_sequence_region if self.sequence_parallel else copy_to_region  # [b, s/t, in] -> [b, s, in]
        y = F.linear(enter(x, self.group), self.weight, self.bias)  # [..., out/t]
        return gather_from_region(y, self.group) if self.gather_output else y  # [..., out] if gathered

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}/t, gather_output={self.gather_output}"


class RowParallelLinear(nn.Module):
    """y = sum_i x_i A_i^T + b with A's in_features split across the group: weight [out, in/t],
    bias [out] replicated and added once, after the all-reduce.

    Input [..., in/t] (input_is_parallel=True) or [..., in] (this rank keeps its chunk);
    output [..., out] on every rank, one all-reduce of it (g). Backward sends nothing,
    except an all-gather of dL/dx when the input was not parallel. With sequence_parallel=True
    the sum is reduce-scattered instead: each rank gets its slice [batch, seq/t, out], and
    the bias's gradient (like a layer norm's in the sequence-parallel region) covers only
    that slice: all-reduce it over the group before the optimizer step.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 group=None, sequence_parallel: bool = False):
        super().__init__()
        t, rank = tp_size_rank(group)
        check_divisible("RowParallelLinear", "in_features", in_features, t)
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.weight, self.bias = _dense_slice(nn.Linear(in_features, out_features, bias=bias), 1, t, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_is_parallel:
            _check_last("RowParallelLinear", x, self.weight.shape[1], f"in_features/t = {self.in_features}/"
                        f"{self.in_features // self.weight.shape[1]}, input_is_parallel=True")
        else:
            _check_last("RowParallelLinear", x, self.in_features, "in_features, input_is_parallel=False")
            x = scatter_to_region(x, self.group)  # [..., in/t]
        leave = reduce_scatter_to_sequence_region if self.sequence_parallel else reduce_from_region
        y = leave(F.linear(x, self.weight), self.group)  # [..., out], or [batch, seq/t, out]
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}/t, out_features={self.out_features}, "
                f"input_is_parallel={self.input_is_parallel}")


class ParallelMLP(nn.Module):
    """Column (hidden -> ffn/t), GELU, row (ffn/t -> hidden): [..., hidden] -> [..., hidden].
    One all-reduce of the output forward, one of the input gradient backward; with
    sequence_parallel, [batch, seq/t, hidden] in and out, and an all-gather plus a
    reduce-scatter each way instead."""

    def __init__(self, hidden: int, ffn_hidden: int | None = None, group=None, sequence_parallel: bool = False):
        super().__init__()
        ffn_hidden = ffn_hidden or 4 * hidden
        self.fc1 = ColumnParallelLinear(hidden, ffn_hidden, gather_output=False, group=group,
                                        sequence_parallel=sequence_parallel)
        self.fc2 = RowParallelLinear(ffn_hidden, hidden, input_is_parallel=True, group=group,
                                     sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # fc1: [..., ffn/t], fc2: [..., hidden]


class ParallelSelfAttention(nn.Module):
    """Multi-head self-attention with heads/t heads per rank: [batch, seq, hidden] -> same.

    qkv is one column-parallel layer whose output features run head by head, [q_h, k_h, v_h]
    for h = 0..heads-1, so rank i's column slice holds whole heads; proj is row-parallel.
    With sequence_parallel=True the input and output are this rank's slice of the sequence,
    [batch, seq/t, hidden]: qkv all-gathers it, proj reduce-scatters.
    Attention dropout is inside the region: it draws from `rng` (an RNGTracker), a stream
    of its own on each rank, as a dense model draws different masks for different heads.
    With a `cp_group` (context parallelism) the input is this rank's share of the sequence,
    [batch, seq/cp, hidden] split by `layout`, and its heads attend over the whole sequence
    by ring attention (`parakit.context_parallel.ring_attention`: K and V of its heads go
    around the cp group); no dropout there.
    """

    def __init__(self, hidden: int, heads: int, causal: bool = True, dropout: float = 0.0, group=None, rng=None,
                 sequence_parallel: bool = False, cp_group=None, layout: str = "zigzag"):
        super().__init__()
        if dropout and cp_group is not None:
            raise ValueError(f"ParallelSelfAttention: dropout={dropout} with a cp_group: ring attention has no "
                             f"attention dropout, use dropout=0.0")
        t, _ = tp_size_rank(group)
        if hidden % heads:
            raise ValueError(f"ParallelSelfAttention: hidden={hidden} is not divisible by heads={heads}: "
                             f"make hidden a multiple of heads")
        check_divisible("ParallelSelfAttention", "heads", heads, t)
        if dropout and rng is None:
            raise ValueError(f"ParallelSelfAttention: dropout={dropout} inside a tensor-parallel region needs "
                             f"rng=RNGTracker(seed, group), so that each rank draws its own mask")
        self.heads, self.causal, self.dropout, self.rng = heads // t, causal, dropout, rng  # heads on this rank
        self.cp_group, self.layout = cp_group, layout
        self.qkv = ColumnParallelLinear(hidden, 3 * hidden, gather_output=False, group=group,
                                        sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(hidden, hidden, input_is_parallel=True, group=group,
                                      sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.attend(self.qkv(x)))  # [batch, seq, hidden] (or [batch, seq/t, hidden]) -> same

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """This rank's heads: [batch, seq, 3 hidden/t] -> [batch, seq, hidden/t] (no communication)."""
        b, s, _ = qkv.shape
        qkv = qkv.view(b, s, self.heads, 3, -1)  # [batch, seq, heads/t, 3, head_dim]
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each [batch, heads/t, seq, head_dim]
        p = self.dropout if self.training else 0.0
        if self.cp_group is not None:
            att = ring_attention(q, k, v, self.causal, self.layout, self.cp_group)  # [batch, heads/t, seq/cp, head_dim]
        elif p:
            with self.rng.fork():
                att = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        else:
            att = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return att.transpose(1, 2).reshape(b, s, -1)  # [batch, seq, hidden/t]


class ParallelTransformerBlock(nn.Module):
    """Pre-norm block x + attn(ln(x)), then x + mlp(ln(x)): two all-reduces forward, two
    backward. Layer norms and the residual dropout run outside the tensor-parallel regions,
    replicated: every rank draws the same residual-dropout mask from the default generator.
    With a `cp_group` the block runs on this rank's share of the sequence, attention by ring.
    `mlp` replaces the ParallelMLP (a mixture of experts: [batch, seq, hidden] in and out)."""

    def __init__(self, hidden: int, heads: int, ffn_hidden: int | None = None, causal: bool = True,
                 dropout: float = 0.0, group=None, rng=None, cp_group=None, mlp: nn.Module | None = None):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = ParallelSelfAttention(hidden, heads, causal, dropout, group, rng, cp_group=cp_group)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = ParallelMLP(hidden, ffn_hidden, group) if mlp is None else mlp
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [batch, seq, hidden]
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))
