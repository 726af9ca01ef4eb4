"""The DP x PP x TP mesh of 3D hybrid parallelism: which ranks form which process groups.

Rank r sits at (d, p, t) with r = (d * pp + p) * tp + t: tensor-parallel neighbours are
adjacent ranks (on one node, where links are fastest), pipeline stages next, data-parallel
replicas outermost (they talk least: once per step). Three kinds of groups:

    tp group   fixed (d, p), t = 0..tp-1   all-reduces inside every layer
    pp group   fixed (d, t), p = 0..pp-1   sends activations and gradients between stages
    dp group   fixed (p, t), d = 0..dp-1   all-reduces gradients once per step

The same code runs under parakit.launch and under torchrun on several nodes: the mesh only
needs an initialised default process group.
"""
from __future__ import annotations

import torch.distributed as dist

from parakit.groups import grid_coords, grid_groups, grid_rank, new_subgroups

__all__ = ["mesh_coords", "mesh_rank", "mesh_groups", "Mesh"]

KINDS = ("dp", "pp", "tp")


def _check_sizes(dp: int, pp: int, tp: int, world_size: int | None = None) -> None:
    if min(dp, pp, tp) < 1:
        raise ValueError(f"mesh sizes must be at least 1, got dp={dp}, pp={pp}, tp={tp}")
    if world_size is not None and dp * pp * tp != world_size:
        raise ValueError(f"mesh dp={dp} x pp={pp} x tp={tp} = {dp * pp * tp} ranks, but the world has "
                         f"{world_size}: choose sizes whose product is {world_size}")


def mesh_coords(rank: int, dp: int, pp: int, tp: int) -> tuple[int, int, int]:
    """(d, p, t) of `rank`: rank = (d * pp + p) * tp + t."""
    _check_sizes(dp, pp, tp)
    return grid_coords(rank, (dp, pp, tp))


def mesh_rank(d: int, p: int, t: int, dp: int, pp: int, tp: int) -> int:
    return grid_rank((d, p, t), (dp, pp, tp))


def mesh_groups(dp: int, pp: int, tp: int) -> dict[str, list[list[int]]]:
    """Every group of the mesh as ascending rank lists, without creating process groups:
    {"dp": dp groups... , "pp": ..., "tp": ...}; each kind partitions the dp*pp*tp ranks."""
    _check_sizes(dp, pp, tp)
    return {kind: grid_groups((dp, pp, tp), [axis]) for axis, kind in enumerate(KINDS)}


class Mesh:
    """This rank's place on a dp x pp x tp mesh and its three process groups.

    Every rank of the world builds the Mesh together (`dist.new_group` is collective).
    Attributes: sizes `dp`, `pp`, `tp`; coordinates `dp_rank`, `pp_rank`, `tp_rank`;
    groups `dp_group`, `pp_group`, `tp_group`; `ranks[kind]`, the global ranks of this
    rank's group of that kind.
    """

    def __init__(self, dp: int, pp: int, tp: int):
        _check_sizes(dp, pp, tp, dist.get_world_size())
        self.dp, self.pp, self.tp = dp, pp, tp
        self.rank = dist.get_rank()
        self.dp_rank, self.pp_rank, self.tp_rank = mesh_coords(self.rank, dp, pp, tp)
        self.ranks: dict[str, list[int]] = {}
        for kind, lists in mesh_groups(dp, pp, tp).items():
            group, self.ranks[kind] = new_subgroups(lists)
            setattr(self, f"{kind}_group", group)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def __repr__(self) -> str:
        return (f"Mesh(dp={self.dp}, pp={self.pp}, tp={self.tp}; rank {self.rank} at d={self.dp_rank}, "
                f"p={self.pp_rank}, t={self.tp_rank})")
