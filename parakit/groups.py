"""Process groups built one way: ranks on a grid, grouped by the coordinates they share.

A grid of sizes (n0, n1, ..., nk) puts rank r at coordinates (c0, c1, ..., ck) in row-major
order, the last axis fastest: r = (...(c0 * n1 + c1) * n2 + ...) * nk + ck. The ranks that
agree on every coordinate except those of some axes form one group along those axes.
parakit.mesh (dp x pp x tp) and parakit.parallel3d (the q x q x q cube) are such grids.

Every group is explicit: a function takes the parent `group` (None: the world) and returns
process groups; nothing is kept in module globals, so a kernel may build several meshes.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["grid_coords", "grid_rank", "grid_groups", "new_subgroups", "global_rank", "broadcast_from_first"]


def grid_coords(rank: int, sizes: Sequence[int]) -> tuple[int, ...]:
    """The coordinates of `rank` on a grid of `sizes`, last axis fastest."""
    coords = []
    for n in reversed(sizes):
        rank, c = divmod(rank, n)
        coords.append(c)
    return tuple(reversed(coords))


def grid_rank(coords: Sequence[int], sizes: Sequence[int]) -> int:
    """The rank at `coords` on a grid of `sizes` (the inverse of grid_coords)."""
    rank = 0
    for c, n in zip(coords, sizes):
        rank = rank * n + c
    return rank


def grid_groups(sizes: Sequence[int], axes: Sequence[int]) -> list[list[int]]:
    """Every group along `axes` (the ranks that differ only there) as ascending rank lists,
    ordered by their smallest rank; together they partition the grid's ranks."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(math.prod(sizes)):
        fixed = tuple(c for axis, c in enumerate(grid_coords(rank, sizes)) if axis not in axes)
        groups.setdefault(fixed, []).append(rank)
    return list(groups.values())


def global_rank(group, rank: int) -> int:
    """The world rank of `rank` of `group` (None: the world; no communication)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def new_subgroups(lists: Sequence[Sequence[int]], group=None) -> tuple[dist.ProcessGroup, list[int]]:
    """A process group for every list of ranks of `group` (None: the world); returns this
    rank's group and its list. Collective: every rank of `group` calls it with the same
    lists, and creates every group in the same order (`dist.new_group`)."""
    me, mine = dist.get_rank(group), None
    for ranks in lists:
        made = dist.new_group([global_rank(group, r) for r in ranks])
        if me in ranks:
            mine = made, list(ranks)
    if mine is None:
        raise ValueError(f"rank {me} is in none of the groups {[list(r) for r in lists]}: the lists must cover "
                         f"every rank of the group")
    return mine


@torch.no_grad()
def broadcast_from_first(tensors: Sequence[torch.Tensor], group=None) -> None:
    """Overwrite every tensor, in place, with rank 0 of `group`'s (None: the world): rank 0
    sends each tensor's bytes to every other rank (`dist.broadcast`, one per tensor)."""
    src = global_rank(group, 0)
    for tensor in tensors:
        dist.broadcast(tensor.data, src, group=group)
