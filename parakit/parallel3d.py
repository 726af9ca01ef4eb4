"""3D tensor parallelism (seed 002): P = q**3 ranks as a q x q x q cube, Y = XA split on it.

Rank r sits at cube coordinates (i, j, l) with r = i*q*q + j*q + l. Three kinds of groups
run along the cube's axes: the weight group varies i, the input group varies j, the output
group varies l (each q ranks); products of two axes give groups of q*q ranks.

Linear3D, as in the seed, on rank (i, j, l):
    X_ijl  [batch/q**2, in/q]     row block i*q+j, column block l   (the input)
    A_lji  [in/q, out/q**2]       row block l, column block j*q+i   (the weight)
    all-gather X over the input group  -> X_il  [batch/q, in/q]
    all-gather A over the weight group -> A_lj  [in/q, out/q]
    X_il @ A_lj, reduce-scatter over the output group -> Y_ijl [batch/q**2, out/q]
Backward: all-gather dY over the output group, reduce-scatter dX = dY A^T over the input
group and dA = X^T dY over the weight group. Y comes out with the input and output axes
exchanged, so the next layer runs on `cube.swapped()` and two layers bring the layout back.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from parakit.groups import grid_coords, grid_groups, grid_rank, new_subgroups
from parakit.tensor_parallel.mappings import all_reduce_region, gather_from_region, reduce_from_region

__all__ = ["cube_side", "cube_coords", "cube_rank", "cube_groups", "Cube", "Linear3D", "LayerNorm3D",
           "ClassifierHead3D", "x_block", "a_block", "block_owners", "linear3d_forward", "linear3d_backward", "split_batch", "gather_batch",
           "split_weight", "linear3d_cost"]

AXES = ("weight", "input", "output")  # coordinate index 0 (i), 1 (j), 2 (l)


def cube_side(world_size: int) -> int:
    """q with q**3 == world_size, or a ValueError naming the size."""
    q = round(world_size ** (1 / 3))
    if q**3 != world_size:
        cubes = ", ".join(str(k**3) for k in range(1, 5))
        raise ValueError(f"world size {world_size} is not a cube: 3D tensor parallelism needs q**3 ranks ({cubes}, ...)")
    return q


def cube_coords(rank: int, q: int) -> tuple[int, int, int]:
    """(i, j, l) of `rank` on the q x q x q cube: rank = i*q*q + j*q + l."""
    return grid_coords(rank, (q, q, q))


def cube_rank(i: int, j: int, l: int, q: int) -> int:
    return grid_rank((i, j, l), (q, q, q))


def cube_groups(q: int) -> dict[tuple[str, ...], list[list[int]]]:
    """Every group of the cube, as rank lists, without creating any process group.

    Keys are one axis ("weight",), ("input",), ("output",) for groups of q ranks, or two
    axes ("weight", "output"), ... for groups of q*q ranks; ranks in each list ascend.
    """
    kinds = [(a,) for a in AXES] + [(a, b) for n, a in enumerate(AXES) for b in AXES[n + 1:]]
    return {kind: grid_groups((q, q, q), [AXES.index(a) for a in kind]) for kind in kinds}


class Cube:
    """This rank's place on the cube and its process groups (made with `dist.new_group`).

    Every rank of `group` (default: the world) must build the Cube together. `input_axis`
    and `output_axis` say which axes play the seed's input (j) and output (l) roles for the
    next Linear3D; `swapped()` exchanges them.
    """

    def __init__(self, group=None):
        self.group = group
        self.q = cube_side(dist.get_world_size(group))
        self.coords = cube_coords(dist.get_rank(group), self.q)
        self._groups = {kind: new_subgroups(lists, group)[0] for kind, lists in cube_groups(self.q).items()}
        self.input_axis, self.output_axis = "input", "output"

    @property
    def is_swapped(self) -> bool:
        return self.input_axis == "output"

    def swapped(self) -> "Cube":
        """The same groups with the input and output axes exchanged (for the next layer)."""
        other = copy.copy(self)
        other.input_axis, other.output_axis = self.output_axis, self.input_axis
        return other

    def __deepcopy__(self, memo) -> "Cube":
        return self  # process groups are shared handles: a copy would be the same cube

    def axis_group(self, *axes: str):
        """The process group along `axes` (one or two of "weight", "input", "output")."""
        return self._groups[tuple(sorted(axes, key=AXES.index))]

    def coord(self, axis: str) -> int:
        return self.coords[AXES.index(axis)]


def _check_divisible(what: str, size: int, by: int, q: int) -> None:
    if size % by:
        raise ValueError(f"{what} {size} is not divisible by {by} (q={q}): 3D tensor parallelism "
                         f"splits it into {by} blocks; pick a multiple of {by}")


def x_block(rank: int, q: int, swapped: bool = False) -> tuple[int, int]:
    """(row block of q*q, column block of q) of the activation `rank` holds: X_ijl is row
    block i*q+j, column block l (input and output axes exchanged when `swapped`)."""
    i, j, l = cube_coords(rank, q)
    return (i * q + l, j) if swapped else (i * q + j, l)


def a_block(rank: int, q: int, swapped: bool = False) -> tuple[int, int]:
    """(row block of q, column block of q*q) of the weight `rank` holds: A_lji is row block
    l, column block j*q+i (input and output axes exchanged when `swapped`)."""
    i, j, l = cube_coords(rank, q)
    return (j, l * q + i) if swapped else (l, j * q + i)


def block_owners(q: int, swapped: bool = False) -> dict[str, list[list[int]]]:
    """Which rank holds each block: {"X": [q*q rows][q cols], "A": [q rows][q*q cols]}."""
    owners = {"X": [[0] * q for _ in range(q * q)], "A": [[0] * (q * q) for _ in range(q)]}
    for rank in range(q**3):
        (xr, xc), (ar, ac) = x_block(rank, q, swapped), a_block(rank, q, swapped)
        owners["X"][xr][xc], owners["A"][ar][ac] = rank, rank
    return owners


def _rank_in(cube: Cube) -> int:
    return cube_rank(*cube.coords, cube.q)


def split_batch(x: torch.Tensor, cube: Cube) -> torch.Tensor:
    """This rank's block of a full activation x [batch, features] (no communication)."""
    q = cube.q
    _check_divisible("batch", x.shape[0], q * q, q)
    _check_divisible("features", x.shape[-1], q, q)
    row, col = x_block(_rank_in(cube), q, cube.is_swapped)
    return x.chunk(q * q, dim=0)[row].chunk(q, dim=-1)[col].contiguous()  # [batch/q^2, f/q]


def gather_batch(x: torch.Tensor, cube: Cube) -> torch.Tensor:
    """The full activation [batch, features] from every rank's block (the inverse of split_batch).

    All-gathers over the whole cube: each rank sends its block to the q**3 - 1 others,
    (q**3 - 1) * x.numel() * x.element_size() bytes.
    """
    q = cube.q
    blocks = _all_gather(x, cube.group, dim=0).chunk(q**3)  # q^3 x [batch/q^2, f/q]
    owners = block_owners(q, cube.is_swapped)["X"]
    return torch.cat([torch.cat([blocks[r] for r in row], dim=-1) for row in owners], dim=0)  # [batch, features]


def split_weight(a: torch.Tensor, cube: Cube) -> torch.Tensor:
    """This rank's block A_lji [in/q, out/q**2] of a full weight a [in, out] (no communication)."""
    q = cube.q
    _check_divisible("in_features", a.shape[0], q, q)
    _check_divisible("out_features", a.shape[1], q * q, q)
    row, col = a_block(_rank_in(cube), q, cube.is_swapped)
    return a.chunk(q, dim=0)[row].chunk(q * q, dim=1)[col].contiguous()


def _all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenate every group member's x along `dim`; sends (n-1) * x's bytes."""
    n = dist.get_world_size(group)
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)  # [n * x0, ...]
    dist.all_gather_single(out, x.contiguous(), group=group)
    return torch.cat(out.chunk(n), dim=dim)


def _reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Sum x over the group and keep this member's 1/n along `dim`; sends (n-1)/n of x's bytes."""
    n = dist.get_world_size(group)
    pieces = torch.cat(x.chunk(n, dim=dim))  # [n * x0, ...] when dim > 0
    out = torch.empty((pieces.shape[0] // n, *pieces.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(out, pieces, group=group)
    return out


def linear3d_forward(x: torch.Tensor, a: torch.Tensor, cube: Cube):
    """Y_ijl from X_ijl [batch/q**2, in/q] and A_lji [in/q, out/q**2]; returns (Y_ijl, X_il, A_lj).

    All-gathers X over the input group ((q-1) * X_ijl bytes) and A over the weight group
    ((q-1) * A_lji bytes), reduce-scatters X_il @ A_lj over the output group ((q-1)/q of its bytes).
    """
    x_il = _all_gather(x, cube.axis_group(cube.input_axis), dim=0)  # [batch/q, in/q]
    a_lj = _all_gather(a, cube.axis_group("weight"), dim=1)  # [in/q, out/q]
    y = _reduce_scatter(x_il @ a_lj, cube.axis_group(cube.output_axis), dim=0)  # [batch/q^2, out/q]
    return y, x_il, a_lj


def linear3d_backward(dy: torch.Tensor, x_il: torch.Tensor, a_lj: torch.Tensor, cube: Cube):
    """(dX_ijl, dA_lji) from dY_ijl and the forward's gathered X_il, A_lj.

    All-gathers dY over the output group ((q-1) * dY_ijl bytes), reduce-scatters dX = dY A^T
    over the input group and dA = X^T dY over the weight group ((q-1)/q of each one's bytes).
    """
    dy_ij = _all_gather(dy, cube.axis_group(cube.output_axis), dim=0)  # [batch/q, out/q]
    dx = _reduce_scatter(dy_ij @ a_lj.t(), cube.axis_group(cube.input_axis), dim=0)  # [batch/q^2, in/q]
    da = _reduce_scatter(x_il.t() @ dy_ij, cube.axis_group("weight"), dim=1)  # [in/q, out/q^2]
    return dx, da


class _Linear3DFunction(torch.autograd.Function):
    """Y = XA on the cube: the seed's forward and backward as one autograd function."""

    @staticmethod
    def forward(ctx, x, a, cube):
        y, x_il, a_lj = linear3d_forward(x, a, cube)
        ctx.save_for_backward(x_il, a_lj)
        ctx.cube = cube
        return y

    @staticmethod
    def backward(ctx, dy):
        return (*linear3d_backward(dy, *ctx.saved_tensors, ctx.cube), None)


class _GatherShard(torch.autograd.Function):
    """A parameter kept as 1/n shards: all-gather it for use (sends (n-1) * shard bytes),
    reduce-scatter its gradient (sends (n-1)/n of the full gradient's bytes)."""

    @staticmethod
    def forward(ctx, shard, group):
        ctx.group = group
        return _all_gather(shard, group, dim=0)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group, dim=0), None


def _shard_parameter(full: int, cube: Cube, what: str) -> nn.Parameter:
    _check_divisible(what, full, cube.q**3, cube.q)
    return nn.Parameter(torch.zeros(full // cube.q**3))


class Linear3D(nn.Module):
    """y = x @ A + b on the cube; x and y are this rank's blocks (see `split_batch`).

    weight: [in/q, out/q**2] (the seed's A_lji); bias: [out/q**3], all-gathered over the
    (weight, output) plane of q*q ranks when used. Runs on `cube`'s input/output roles; the
    output is laid out for `cube.swapped()`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, cube: Cube):
        super().__init__()
        q = cube.q
        _check_divisible("in_features", in_features, q, q)
        _check_divisible("out_features", out_features, q * q, q)
        self.cube, self.in_features, self.out_features = cube, in_features, out_features
        self.weight = nn.Parameter(torch.empty(in_features // q, out_features // q**2))  # [in/q, out/q^2]
        nn.init.normal_(self.weight, std=in_features**-0.5)
        self.bias = _shard_parameter(out_features, cube, "out_features") if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _Linear3DFunction.apply(x, self.weight, self.cube)  # [batch/q^2, out/q]
        if self.bias is None:
            return y
        return y + _GatherShard.apply(self.bias, self.cube.axis_group("weight", self.cube.output_axis))  # + [out/q]

    @torch.no_grad()
    def load_dense(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Linear3D":
        """Take this rank's blocks of a dense layer's weight [in, out] and bias [out]."""
        self.weight.copy_(split_weight(weight, self.cube))
        if bias is not None:
            self.bias.copy_(bias.chunk(self.cube.q, 0)[self.cube.coord(self.cube.input_axis)]
                            .chunk(self.cube.q**2, 0)[self._bias_block()])
        return self

    def _bias_block(self) -> int:
        return dist.get_rank(self.cube.axis_group("weight", self.cube.output_axis))


class LayerNorm3D(nn.Module):
    """Layer norm over features split across the cube's output axis.

    Sums and squared sums of each row are all-reduced over the output group (2 floats per
    row); gamma and beta are [features/q**3] shards gathered over the (weight, input) plane.
    """

    def __init__(self, features: int, eps: float = 1e-5, *, cube: Cube):
        super().__init__()
        self.cube, self.features, self.eps = cube, features, eps
        self.weight = _shard_parameter(features, cube, "features")
        self.bias = _shard_parameter(features, cube, "features")
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cube = self.cube
        stats = torch.stack([x.sum(-1), (x * x).sum(-1)], dim=-1)  # [rows, 2]
        stats = all_reduce_region(stats, cube.axis_group(cube.output_axis)) / self.features
        mean, var = stats[:, :1], stats[:, 1:] - stats[:, :1] ** 2  # [rows, 1]
        plane = cube.axis_group("weight", cube.input_axis)
        gamma, beta = _GatherShard.apply(self.weight, plane), _GatherShard.apply(self.bias, plane)  # [features/q]
        return (x - mean) * torch.rsqrt(var + self.eps) * gamma + beta

    @torch.no_grad()
    def load_dense(self, norm: nn.LayerNorm) -> "LayerNorm3D":
        cube = self.cube
        block = dist.get_rank(cube.axis_group("weight", cube.input_axis))
        for mine, full in ((self.weight, norm.weight), (self.bias, norm.bias)):
            mine.copy_(full.chunk(cube.q, 0)[cube.coord(cube.output_axis)].chunk(cube.q**2, 0)[block])
        return self


class ClassifierHead3D(nn.Module):
    """Logits by Linear3D, then mean cross-entropy over the whole batch.

    The logits' class blocks are all-gathered over the head's input group ((q-1) * logits
    bytes); each rank sums the loss of its rows and the sums are all-reduced over the
    (weight, output) plane (one float). Backward: each rank keeps its own class block.
    """

    def __init__(self, in_features: int, num_classes: int, *, cube: Cube):
        super().__init__()
        self.linear = Linear3D(in_features, num_classes, cube=cube)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """x: this rank's block [batch/q**2, in/q]; target: the full [batch] labels."""
        cube = self.linear.cube
        logits = gather_from_region(self.linear(x), cube.axis_group(cube.input_axis))  # [batch/q^2, classes]
        q, rows = cube.q, logits.shape[0]
        block = cube.coord("weight") * q + cube.coord(cube.output_axis)  # rows of the output layout
        mine = target[block * rows:(block + 1) * rows]
        total = nn.functional.cross_entropy(logits, mine, reduction="sum") / target.shape[0]
        return reduce_from_region(total, cube.axis_group("weight", cube.output_axis))  # every rank: the same loss


def linear3d_cost(batch: int, in_features: int, out_features: int, q: int, element_size: int = 4) -> dict[str, int]:
    """Bytes one rank sends for Linear3D (no bias) by the ring model, per collective.

    Each of the six collectives moves (q-1)/q**3 of one full matrix (X, A or Y): the seed's
    bandwidth O(6(q-1)/q**3), in 6(q-1) ring steps (its latency O(6(q-1))).
    """
    x, a, y = (element_size * m * n for m, n in ((batch, in_features), (in_features, out_features),
                                                  (batch, out_features)))
    share = lambda full: (q - 1) * full // q**3
    return {"forward: all-gather X": share(x), "forward: all-gather A": share(a),
            "forward: reduce-scatter Y": share(y), "backward: all-gather dY": share(y),
            "backward: reduce-scatter dX": share(x), "backward: reduce-scatter dA": share(a)}
