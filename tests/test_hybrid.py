"""3D hybrid parallelism: the DP x PP x TP mesh's rank formula and groups (on paper, and as
real process groups on gloo), and bad mesh sizes refused by name."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import parakit
from parakit.mesh import Mesh, mesh_coords, mesh_groups, mesh_rank


# ---------------------------------------------------------------- the mesh on paper

@pytest.mark.parametrize("sizes", [(1, 1, 1), (2, 2, 2), (2, 3, 4), (3, 1, 2)])
def test_rank_formula_puts_tp_innermost_and_dp_outermost(sizes):
    dp, pp, tp = sizes
    coords = [mesh_coords(r, *sizes) for r in range(dp * pp * tp)]
    assert coords == [(d, p, t) for d in range(dp) for p in range(pp) for t in range(tp)]
    assert [mesh_rank(*c, *sizes) for c in coords] == list(range(dp * pp * tp))


@pytest.mark.parametrize("sizes", [(2, 2, 2), (2, 3, 4), (4, 1, 2)])
def test_each_kind_of_group_partitions_the_ranks_and_varies_one_coordinate(sizes):
    groups = mesh_groups(*sizes)
    for axis, kind in enumerate(("dp", "pp", "tp")):
        lists = groups[kind]
        assert sorted(r for g in lists for r in g) == list(range(sizes[0] * sizes[1] * sizes[2]))
        assert all(len(g) == sizes[axis] and g == sorted(g) for g in lists)
        for g in lists:
            coords = [mesh_coords(r, *sizes) for r in g]
            assert [c[axis] for c in coords] == list(range(sizes[axis]))
            assert len({c[:axis] + c[axis + 1:] for c in coords}) == 1


def test_the_2x2x2_mesh_groups_are_the_megatron_layout():
    assert mesh_groups(2, 2, 2) == {"dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
                                    "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                                    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]]}


@pytest.mark.parametrize("sizes", [(0, 2, 2), (2, -1, 1)])
def test_sizes_below_one_are_refused(sizes):
    with pytest.raises(ValueError, match=r"mesh sizes must be at least 1, got dp="):
        mesh_groups(*sizes)


# ---------------------------------------------------------------- real process groups

def mesh_sums(dp, pp, tp):
    mesh = Mesh(dp, pp, tp)
    sums = {}
    for kind in ("dp", "pp", "tp"):
        x = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(x, group=getattr(mesh, f"{kind}_group"))
        sums[kind] = (int(x), mesh.ranks[kind])
    return (mesh.dp_rank, mesh.pp_rank, mesh.tp_rank), sums


@pytest.mark.parametrize("sizes", [(1, 2, 2), (2, 1, 2), (2, 2, 1)])
def test_mesh_groups_on_four_ranks_sum_exactly_their_members(sizes):
    groups = mesh_groups(*sizes)
    for rank, (coords, sums) in enumerate(parakit.launch(mesh_sums, *sizes, world_size=4)):
        assert coords == mesh_coords(rank, *sizes)
        for kind, (total, ranks) in sums.items():
            assert rank in ranks and ranks in groups[kind]
            assert total == sum(ranks)


def bad_mesh():
    try:
        Mesh(2, 2, 2)
    except ValueError as error:
        return str(error)


def test_a_mesh_whose_product_is_not_the_world_size_is_refused_by_name():
    assert parakit.launch(bad_mesh, world_size=4) == [
        "mesh dp=2 x pp=2 x tp=2 = 8 ranks, but the world has 4: choose sizes whose product is 4"] * 4
