"""The emulated NCCL's splits (parakit.emulation.nccl): a world made with device_id is bound to
the rank's device, and its new groups are split from its communicator as ncclCommSplit does,
every rank of the parent taking part; so DeviceMesh takes the path it takes on a GPU box
(`split_group`, one split per dimension), and NCCL's rules hold in the groups it makes. A world
made without device_id is not split, as NCCL's is not. Real processes, as in test_emulation.
"""
from __future__ import annotations

from test_emulation import run_emulated

MESH = """
import json, torch, torch.distributed as dist, parakit
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

def on_a_2d_mesh():
    rank, world = dist.get_rank(), dist.group.WORLD
    before = world.comm_split_count()  # the pool's world lives on from call to call
    mesh = init_device_mesh("fgpu", (2, 2), mesh_dim_names=("dp", "tp"))
    sums = {}
    for dim in ("dp", "tp"):
        x = torch.full((1,), float(rank), device=parakit.device())
        dist.all_reduce(x, group=mesh.get_group(dim))
        sums[dim] = x.item()
    rows = DTensor.from_local(torch.full((1, 2), float(rank), device=parakit.device()), mesh, [Shard(0), Shard(0)])
    return {"bound": str(world.bound_device_id), "splits": world.comm_split_count() - before, "sums": sums,
            "groups": {dim: [group.name, str(group.bound_device_id)]
                       for dim, group in zip(("dp", "tp"), mesh.get_all_groups())},
            "gathered": rows.redistribute(mesh, [Replicate(), Replicate()]).to_local()[:, 0].tolist(),
            "groups_made": len(dist.distributed_c10d._world.pg_map)}

calls = [parakit.launch(on_a_2d_mesh, world_size=4) for _ in range(2)]
left = parakit.launch(lambda: len(dist.distributed_c10d._world.pg_map), world_size=4)
print(json.dumps({"calls": calls, "left": left}))
"""


def test_a_2d_device_mesh_on_a_bound_world_is_split_once_per_dimension_and_its_groups_reduce_right(tmp_path):
    found = run_emulated(tmp_path, MESH)
    for index, call in enumerate(found["calls"]):  # the second's equal mesh, after the first's groups were destroyed
        dp_split, tp_split = 2 * index, 2 * index + 1  # the world's splits, numbered from the pool's start
        for rank, got in enumerate(call):
            row, column = divmod(rank, 2)  # rank 2 * dp + tp: the dp group is a column, the tp group a row
            assert got["bound"] == f"fgpu:{rank}"
            assert got["splits"] == 2  # split_group per dimension; new_group per group would split 4 times
            assert got["groups"] == {"dp": [f"0:split:{dp_split}:{[column, column + 2]}", f"fgpu:{rank}"],
                                     "tp": [f"0:split:{tp_split}:{[2 * row, 2 * row + 1]}", f"fgpu:{rank}"]}
            assert got["sums"] == {"dp": 2.0 * column + 2, "tp": 4.0 * row + 1}
            assert got["gathered"] == [0.0, 1.0, 2.0, 3.0]  # rows sharded over dp, then tp: in rank order
            assert got["groups_made"] == 3
    assert found["left"] == [1] * 4


SPLITS = """
import json, torch, torch.distributed as dist, parakit

def summed(group):
    if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
        return None
    x = torch.full((1,), float(dist.get_rank()), device=parakit.device())
    dist.all_reduce(x, group=group)
    return x.item()

def split_every_way():
    world = dist.group.WORLD
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank takes part in both splits
    after_new_group = world.comm_split_count()
    three = dist.split_group(split_ranks=[[0, 1, 2]])  # rank 3: no color, None
    x = torch.ones(1, device=parakit.device())
    dist.all_reduce(x)  # the world's stream goes on after the splits, on every rank
    return {"pairs": [summed(g) for g in pairs], "three": summed(three), "world": x.item(),
            "splits": [after_new_group, world.comm_split_count()],
            "three_bound": three is not None and str(three.bound_device_id)}

print(json.dumps(parakit.launch(split_every_way, world_size=4)))
"""


def test_new_group_and_split_group_on_a_bound_world_split_with_every_rank_and_non_members_go_on(tmp_path):
    found = run_emulated(tmp_path, SPLITS)
    assert [got["pairs"] for got in found] == [[1.0, None], [1.0, None], [None, 5.0], [None, 5.0]]
    assert [got["three"] for got in found] == [3.0, 3.0, 3.0, None]
    assert [got["three_bound"] for got in found] == ["fgpu:0", "fgpu:1", "fgpu:2", False]
    assert all(got["world"] == 4.0 and got["splits"] == [2, 3] for got in found)


MISMATCHES = """
import json, torch, torch.distributed as dist, parakit
from torch.distributed.device_mesh import init_device_mesh

def mismatched_in_tp():
    mesh = init_device_mesh("fgpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.ones(1, device=parakit.device())
    if dist.get_rank() == 0:
        dist.all_reduce(x, group=mesh.get_group("tp"))
    elif dist.get_rank() == 1:
        dist.broadcast(x, 1, group=mesh.get_group("tp"))

def split_against_a_collective():
    x = torch.ones(1, device=parakit.device())
    if dist.get_rank() == 0:
        dist.new_group([0, 1])
    else:
        dist.all_reduce(x)

found = []
for fn in (mismatched_in_tp, split_against_a_collective):
    try:
        parakit.launch(fn, world_size=4, timeout=60)
    except parakit.CollectiveHang as error:
        found.append(str(error))
print(json.dumps(found))
"""


def test_a_mismatch_in_a_split_group_and_a_split_against_a_collective_are_reported_as_nccl_hangs(tmp_path):
    in_tp, split = run_emulated(tmp_path, MISMATCHES)
    assert in_tp.startswith("collective mismatch on group 0:split:1:[0, 1]: its call #1 is ")
    assert "all_reduce on rank 0" in in_tp and "broadcast on rank 1" in in_tp
    assert split.startswith("collective mismatch on group 0: its call #1 is ")
    assert "ncclCommSplit on rank 0" in split and "all_reduce on rank 1" in split


LAZY = """
import json, multiprocessing, os, sys, torch, torch.distributed as dist

def rank_main(rank, path, results):
    from parakit import emulation
    from torch.distributed.device_mesh import init_device_mesh
    emulation.install(4)
    torch.fgpu.set_device(rank)
    dist.init_process_group("fnccl", init_method=f"file://{path}", rank=rank, world_size=4)  # no device_id
    mesh = init_device_mesh("fgpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.full((1,), float(rank), device=f"fgpu:{rank}")
    dist.all_reduce(x, group=mesh.get_group("tp"))
    try:
        dist.split_group(split_ranks=[[0, 1], [2, 3]])
        refused = "no error"
    except RuntimeError as error:
        refused = str(error)
    world = dist.group.WORLD
    results.put((rank, [world.bound_device_id, world.comm_split_count(), mesh.get_group("tp").name, x.item(), refused]))
    dist.destroy_process_group()

if __name__ == "__main__":
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    ranks = [spawn.Process(target=rank_main, args=(rank, os.path.abspath("store"), results)) for rank in range(4)]
    for process in ranks:
        process.start()
    found = dict(results.get(timeout=240) for _ in ranks)
    for process in ranks:
        process.join()
    print(json.dumps([found[rank] for rank in range(4)]))
"""


def test_a_world_made_without_device_id_is_not_bound_and_makes_mesh_groups_with_new_group_as_nccl_does(tmp_path):
    found = run_emulated(tmp_path, LAZY)
    refused = "No device associated with the default pg, not safe to split any process groups"
    tp = [("3", 1.0), ("3", 1.0), ("4", 5.0), ("4", 5.0)]  # new_group's names, one per group: dp's were 1 and 2
    assert found == [[None, 0, name, total, refused] for name, total in tp]
