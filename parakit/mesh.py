"""The DP x PP x TP mesh of 3D hybrid parallelism: which ranks form which process groups.

Rank r sits at (d, p, t) with r = (d * pp + p) * tp + t: tensor-parallel neighbours are
adjacent ranks (on one node, where links are fastest), pipeline stages next, data-parallel
replicas outermost (they talk least: once per step). Three kinds of groups:

    tp group   fixed (d, p), t = 0..tp-1   all-reduces inside every layer
    pp group   fixed (d, t), p = 0..pp-1   sends activations and gradients between stages
    dp group   fixed (p, t), d = 0..dp-1   all-reduces gradients once per step

The same code runs under parakit.launch and under torchrun on several nodes: the mesh only
needs an initialised default process group.

`outer="pp"` swaps the two outer sizes: r = (p * dp + d) * tp + t, pipeline stages outermost
and replicas next, as Megatron-Core's default order (tp-cp-ep-dp-pp, innermost first) and
torchtitan's mesh ([pp, dp, cp, tp]) lay them out. Which of the two crosses the slow links
between nodes is the choice: the dp group's gradients (every step, all parameters) or the
pp group's activations (per micro-batch, one [b, s, h] each way).

A fourth size, cp (context parallelism), sits between pp and tp when asked for: rank
r = ((d * pp + p) * cp + c) * tp + t, the cp group (fixed d, p, t) passes K and V around
its ring inside every attention, and the replicas that average gradients are then the
dp x cp group (fixed p, t): each cp rank's gradients cover its tokens only.

A fifth, ep (expert parallelism), adds no ranks: it divides dp x cp, and each replica group
(its ranks in order, d then c) is cut into runs of ep ranks. An ep group splits the experts
of every MoE layer and all-to-alls tokens inside it; the expert-replica group (the ranks at
the same place of every run) holds the same experts and averages their gradients.
"""
from __future__ import annotations

import torch.distributed as dist

from parakit.groups import grid_coords, grid_groups, grid_rank, new_subgroups

__all__ = ["mesh_coords", "mesh_rank", "mesh_groups", "Mesh"]

KINDS = ("dp", "pp", "tp")


def _check_sizes(dp: int, pp: int, tp: int, world_size: int | None = None, cp: int = 1, ep: int = 1) -> None:
    named = [f"dp={dp}", f"pp={pp}", f"tp={tp}"] + ([f"cp={cp}"] if cp != 1 else [])
    if min(dp, pp, tp, cp, ep) < 1:
        raise ValueError(f"mesh sizes must be at least 1, got {', '.join(named + ([f'ep={ep}'] if ep != 1 else []))}")
    if world_size is not None and dp * pp * tp * cp != world_size:
        raise ValueError(f"mesh {' x '.join(named)} = {dp * pp * tp * cp} ranks, but the world has "
                         f"{world_size}: choose sizes whose product is {world_size}")
    if (dp * cp) % ep:
        raise ValueError(f"ep={ep} must divide dp x cp = {dp * cp} (expert parallelism splits the experts over "
                         f"ranks that hold different tokens): choose ep among "
                         f"{[n for n in range(1, dp * cp + 1) if dp * cp % n == 0]}")


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
    """This rank's place on a dp x pp x tp mesh (or dp x pp x cp x tp) and its process groups.

    Every rank of the world builds the Mesh together (`dist.new_group` is collective).
    Attributes: sizes `dp`, `pp`, `tp`, `cp`, `ep`; coordinates `dp_rank`, `pp_rank`, `tp_rank`,
    `cp_rank`; groups `dp_group`, `pp_group`, `tp_group`, and `replica_group`, the ranks
    that average gradients (the dp group; dp x cp with cp > 1); with cp > 1 also `cp_group`
    (None without: no context parallelism); with ep > 1 also `ep_group` and
    `expert_replica_group` (None without); `ranks[kind]`, the global ranks of this rank's
    group of that kind; `outer`, "dp" or "pp" (see the module's docstring).
    """

    def __init__(self, dp: int, pp: int, tp: int, cp: int = 1, ep: int = 1, outer: str = "dp"):
        _check_sizes(dp, pp, tp, dist.get_world_size(), cp, ep)
        if outer not in ("dp", "pp"):
            raise ValueError(f"outer must be 'dp' (replicas outermost) or 'pp' (pipeline stages outermost), "
                             f"got {outer!r}")
        self.dp, self.pp, self.tp, self.cp, self.ep, self.outer = dp, pp, tp, cp, ep, outer
        self.rank = dist.get_rank()
        names = ("dp", "pp", "cp", "tp") if outer == "dp" else ("pp", "dp", "cp", "tp")  # outermost first
        sizes, at = tuple(getattr(self, n) for n in names), {n: i for i, n in enumerate(names)}
        coords = dict(zip(names, grid_coords(self.rank, sizes)))
        self.dp_rank, self.pp_rank, self.cp_rank, self.tp_rank = (coords[n] for n in ("dp", "pp", "cp", "tp"))
        replica = sorted([at["dp"], at["cp"]])
        axes = {"dp": [at["dp"]], "pp": [at["pp"]], "tp": [at["tp"]],
                **({"cp": [at["cp"]], "replica": replica} if cp > 1 else {})}
        self.ranks: dict[str, list[int]] = {}
        self.cp_group = None  # made below when cp > 1
        for kind, along in axes.items():
            group, self.ranks[kind] = new_subgroups(grid_groups(sizes, along))
            setattr(self, f"{kind}_group", group)
        if cp == 1:
            self.replica_group, self.ranks["replica"] = self.dp_group, self.ranks["dp"]
        self.ep_group = self.expert_replica_group = None  # made below when ep > 1
        if ep > 1:
            replicas = grid_groups(sizes, replica)  # ascending: d, then c
            self.ep_group, self.ranks["ep"] = new_subgroups([g[i:i + ep] for g in replicas
                                                             for i in range(0, len(g), ep)])
            self.expert_replica_group, self.ranks["expert_replica"] = new_subgroups([g[j::ep] for g in replicas
                                                                                     for j in range(ep)])

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def __repr__(self) -> str:
        cp = (f", cp={self.cp}" if self.cp > 1 else "") + (f", ep={self.ep}" if self.ep > 1 else "")
        at = f", c={self.cp_rank}" if self.cp > 1 else ""
        cp += ", outer='pp'" if self.outer == "pp" else ""
        return (f"Mesh(dp={self.dp}, pp={self.pp}, tp={self.tp}{cp}; rank {self.rank} at d={self.dp_rank}, "
                f"p={self.pp_rank}{at}, t={self.tp_rank})")
