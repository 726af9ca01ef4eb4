"""3D hybrid parallelism: the DP x PP x TP mesh's rank formula and groups (on paper, and as
real process groups on gloo), and bad mesh sizes refused by name."""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, processes_with

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

def mesh_sums(dp, pp, tp, outer="dp"):
    """Each group's sum of its members' ranks, its members, and the members CommLog records."""
    from parakit import comm
    mesh = Mesh(dp, pp, tp, outer=outer)
    sums = {}
    for kind in ("dp", "pp", "tp"):
        x = torch.tensor([float(dist.get_rank())])
        with comm.CommLog() as log:
            dist.all_reduce(x, group=getattr(mesh, f"{kind}_group"))
        sums[kind] = (int(x), mesh.ranks[kind], list(log.records[0].group_ranks))
    return (mesh.dp_rank, mesh.pp_rank, mesh.tp_rank), sums


@pytest.mark.parametrize("sizes", [(1, 2, 2), (2, 1, 2), (2, 2, 1)])
def test_mesh_groups_on_four_ranks_sum_exactly_their_members(sizes):
    groups = mesh_groups(*sizes)
    for rank, (coords, sums) in enumerate(parakit.launch(mesh_sums, *sizes, world_size=4)):
        assert coords == mesh_coords(rank, *sizes)
        for kind, (total, ranks, recorded) in sums.items():
            assert rank in ranks and ranks in groups[kind]
            assert total == sum(ranks) and recorded == ranks


def test_with_pp_outermost_stages_are_furthest_apart_and_replicas_next():
    """r = (p * dp + d) * tp + t: on 8 ranks (dp2 pp2 tp2) the pp groups span both halves."""
    expected = {"dp": [[0, 2], [1, 3], [4, 6], [5, 7]], "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
                "tp": [[0, 1], [2, 3], [4, 5], [6, 7]]}
    for rank, (coords, sums) in enumerate(parakit.launch(mesh_sums, 2, 2, 2, "pp", world_size=8)):
        assert coords == (rank // 2 % 2, rank // 4, rank % 2)
        for kind, (total, ranks, recorded) in sums.items():
            assert ranks in expected[kind] and rank in ranks and total == sum(ranks) and recorded == ranks


def cp_mesh_sums(dp, tp, cp):
    mesh = Mesh(dp, 1, tp, cp)
    sums = {}
    for kind in ("cp", "replica"):
        x = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(x, group=getattr(mesh, f"{kind}_group"))
        sums[kind] = (int(x), mesh.ranks[kind])
    return (mesh.dp_rank, mesh.cp_rank, mesh.tp_rank), sums


@pytest.mark.parametrize("dp, tp, cp, expected", [
    (2, 1, 2, {"cp": [[0, 1], [2, 3]], "replica": [[0, 1, 2, 3]]}),
    (1, 2, 2, {"cp": [[0, 2], [1, 3]], "replica": [[0, 2], [1, 3]]})])
def test_cp_sits_between_pp_and_tp_and_gradients_average_over_dp_x_cp(dp, tp, cp, expected):
    for rank, (coords, sums) in enumerate(parakit.launch(cp_mesh_sums, dp, tp, cp, world_size=4)):
        assert coords == (rank // (cp * tp), rank // tp % cp, rank % tp)  # r = (d * cp + c) * tp + t
        for kind, (total, ranks) in sums.items():
            assert rank in ranks and ranks in expected[kind] and total == sum(ranks)


def bad_mesh():
    try:
        Mesh(2, 2, 2)
    except ValueError as error:
        return str(error)


def test_a_mesh_whose_product_is_not_the_world_size_is_refused_by_name():
    assert parakit.launch(bad_mesh, world_size=4) == [
        "mesh dp=2 x pp=2 x tp=2 = 8 ranks, but the world has 4: choose sizes whose product is 4"] * 4


# ---------------------------------------------------------------- the hybrid trainer

def run_trainer(argv):
    from parakit import train
    return train.train(train.parse_args(argv))


TWO_NODE_MESH = ["--dp", "2", "--pp", "2", "--tp", "2"]
SMALL = ["--steps", "5", "--batch", "8", "--seq", "8", "--hidden", "16", "--heads", "4", "--vocab", "32"]


@pytest.fixture(scope="module")
def one_process_losses():
    [losses] = parakit.launch(run_trainer, SMALL, world_size=1)
    return losses


@pytest.fixture(scope="module")
def mesh_losses():
    """Every rank's losses over five steps at dp=2, pp=2, tp=2."""
    return parakit.launch(run_trainer, SMALL + TWO_NODE_MESH, world_size=8, timeout=300)


def steps(n: int) -> list[str]:
    return ["--steps", str(n)] + SMALL[2:]


@pytest.fixture(scope="module")
def saved_after_three_steps(tmp_path_factory):
    """A checkpoint of the dp=2, pp=2, tp=2 run after three of its five steps, and those losses."""
    folder = tmp_path_factory.mktemp("resume") / "ckpt"
    losses = parakit.launch(run_trainer, steps(3) + TWO_NODE_MESH + ["--save", str(folder)], world_size=8, timeout=300)
    return folder, losses[0]


def test_dp2_pp2_tp2_trainer_matches_one_process_for_five_steps(one_process_losses, mesh_losses):
    assert len(one_process_losses) == 5 and one_process_losses[-1] < one_process_losses[0]
    for losses in mesh_losses:  # every rank reports the same global loss
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(one_process_losses), rtol=1e-5, atol=1e-5)


def test_resume_at_dp2_pp2_tp2_gives_the_same_next_losses(mesh_losses, saved_after_three_steps):
    folder, first = saved_after_three_steps
    resumed = parakit.launch(run_trainer, steps(2) + TWO_NODE_MESH + ["--resume", str(folder)], world_size=8,
                             timeout=300)[0]
    assert sorted(p.name for p in folder.iterdir()) == ["mesh.json"] + [f"rank{r}.pt" for r in range(8)]
    assert first + resumed == mesh_losses[0]  # bit for bit: same data, weights and AdamW state


def trainer_error(argv):
    try:
        run_trainer(argv)
    except ValueError as error:
        return str(error)


@pytest.mark.parametrize("world_size, mesh", [(8, (4, 1, 2)), (4, (1, 2, 2))])
def test_resuming_on_another_mesh_is_refused_naming_both_meshes(saved_after_three_steps, world_size, mesh):
    folder, _ = saved_after_three_steps
    argv = steps(1) + ["--dp", str(mesh[0]), "--pp", str(mesh[1]), "--tp", str(mesh[2]), "--resume", str(folder)]
    assert set(parakit.launch(trainer_error, argv, world_size=world_size)) == {
        f"checkpoint {folder} was saved on the mesh dp=2 x pp=2 x tp=2, but this run asks for dp={mesh[0]} x "
        f"pp={mesh[1]} x tp={mesh[2]}: resume with --dp 2 --pp 2 --tp 2"}


def test_resuming_with_the_other_outermost_dimension_is_refused_naming_it(saved_after_three_steps):
    folder, _ = saved_after_three_steps
    argv = steps(1) + TWO_NODE_MESH + ["--outer", "pp", "--resume", str(folder)]
    assert set(parakit.launch(trainer_error, argv, world_size=8)) == {
        f"checkpoint {folder} was saved on the mesh dp=2 x pp=2 x tp=2, but this run asks for dp=2 x pp=2 x tp=2 x "
        f"outer=pp: resume with --dp 2 --pp 2 --tp 2 --outer dp"}


def test_a_batch_that_does_not_split_across_replicas_and_microbatches_is_refused():
    argv = ["--batch", "6", "--dp", "2", "--pp", "2", "--microbatches", "2"]
    assert set(parakit.launch(trainer_error, argv, world_size=4)) == {
        "batch 6 does not split into dp 2 x 2 micro-batches: pick a multiple of 4"}


# ---------------------------------------------------------------- context parallelism in the trainer

def first_step(argv):
    """The trainer's first step on this rank, as `train` runs it: the loss averaged over the
    world's tokens and this rank's parameter gradients after the dp x cp all-reduce (its
    experts named by their index in the whole layer)."""
    from parakit import train
    from parakit.moe import ExpertParallelMoE
    from parakit.pipeline import dp_pp_step
    args = train.parse_args(argv)
    mesh = Mesh(args.dp, 1, 1, args.cp, args.ep)
    model = train.build_model(args, mesh.tp_group, mesh.cp_group, mesh.ep_group)
    ids, target = train.local_batch(0, args, mesh)  # [batch/dp, seq/cp]
    replica = train.replicate(model, mesh)
    loss = dp_pp_step(model, [len(model)], ids, target, lambda y, t: torch.nn.functional.cross_entropy(
        y.flatten(0, 1), t.flatten()), pp_group=mesh.pp_group, replica=replica, num_microbatches=2)
    total = loss.detach().reshape(1)
    dist.all_reduce(total)
    grads = {n: p.grad for n, p in model.named_parameters()}
    for prefix, layer in model.named_modules():
        if isinstance(layer, ExpertParallelMoE):
            for i, expert in enumerate(layer.experts):
                for n, p in expert.named_parameters():
                    del grads[f"{prefix}.experts.{i}.{n}"]
                    grads[f"{prefix}.experts.{layer.first_expert + i}.{n}"] = p.grad
    return total.item() / dist.get_world_size(), grads


CP_MESHES = {"cp2": (["--cp", "2"], 2), "dp2_cp2": (["--dp", "2", "--cp", "2"], 4),
             "tp2_cp2": (["--tp", "2", "--cp", "2"], 4), "pp2_cp2": (["--pp", "2", "--cp", "2"], 4)}


@pytest.mark.parametrize("mesh", ["cp2", "dp2_cp2"])
def test_ring_attention_in_the_trainer_gives_one_process_loss_and_gradients(mesh):
    [(loss, grads)] = parakit.launch(first_step, SMALL, world_size=1)
    argv, world_size = CP_MESHES[mesh]
    ranks = parakit.launch(first_step, SMALL + argv, world_size=world_size)
    for rank_loss, rank_grads in ranks:  # each rank: its zig-zag share of the sequence, gradients averaged
        assert rank_loss == pytest.approx(loss, rel=1e-5)
        torch.testing.assert_close(rank_grads, grads, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mesh", list(CP_MESHES))
def test_cp_trainer_matches_one_process_for_five_steps(one_process_losses, mesh):
    argv, world_size = CP_MESHES[mesh]
    for losses in parakit.launch(run_trainer, SMALL + argv, world_size=world_size):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(one_process_losses), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend, local_world_size, gpus, nccl_built, chosen", [
    ("auto", 4, 4, True, "nccl"), ("auto", 4, 2, True, "gloo"), ("auto", 4, 4, False, "gloo"),
    ("gloo", 4, 8, True, "gloo"), ("nccl", 4, 4, True, "nccl")])
def test_trainer_picks_nccl_only_with_a_gpu_for_every_rank_on_its_node(backend, local_world_size, gpus, nccl_built,
                                                                        chosen):
    from parakit.torchrun import node_backend
    assert node_backend(backend, local_world_size, gpus, nccl_built) == chosen


def test_trainer_refuses_nccl_with_fewer_gpus_than_ranks_on_its_node():
    from parakit.torchrun import node_backend
    with pytest.raises(ValueError, match=r"^on this node \(LOCAL_WORLD_SIZE=4\): backend 'nccl' needs one GPU per rank: "
                                         r"world_size=4 but 2 GPU\(s\) are visible; use backend='gloo'"):
        node_backend("nccl", 4, 2, True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_trainer_cli_refuses_nccl_without_gpus_before_joining_the_world(monkeypatch):
    from parakit.train import main
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"^on this node \(LOCAL_WORLD_SIZE=2\): backend 'nccl' needs one GPU per rank"):
        main(["--backend", "nccl"])
    assert not dist.is_initialized()


# ---------------------------------------------------------------- two torchrun "nodes" on this machine's loopback

def free_port() -> int:
    """A free port below the range the kernel hands out itself (binding port 0, connecting):
    the rendezvous binds it seconds later, and a port from that range could meanwhile be taken
    by a gloo group of the other pytest process."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    for port in random.sample(range(low // 2, low), 100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:  # taken: another
                continue
    raise AssertionError(f"no free port in {low // 2}-{low - 1} (100 tried)")


def stop_run(nodes, marker: str) -> list[int]:
    """Stop each torchrun agent's process group (SIGTERM: the agent stops its workers; SIGKILL
    if it has not within 30 s), reap them, and return the pids of the run still alive."""
    for node in nodes:
        for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(node.pid, sig)
            except ProcessLookupError:  # the group is empty: the agent and all it left there are gone
                break
            try:
                node.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
    return processes_with(marker)


def test_two_torchrun_nodes_of_four_processes_give_the_same_losses(tmp_path, one_process_losses):
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "4",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "parakit-test",
               "-m", "parakit.train", *TWO_NODE_MESH, *SMALL, "--backend", "gloo"]
    run_id = f"{os.getpid()}-{port}"  # in the environment of the agents and of their workers
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PARAKIT_TORCHRUN_TEST": run_id}
    logs = [open(tmp_path / f"node{n}.txt", "w+") for n in range(2)]  # files, not pipes: nothing blocks on a full pipe
    nodes = [subprocess.Popen(command + (["--losses-to", str(tmp_path / "losses.json")] if n == 0 else []),
                              cwd=tmp_path, env=env, stdout=logs[n], stderr=subprocess.STDOUT, process_group=0)
             for n in range(2)]
    deadline = time.monotonic() + 300
    try:  # a node that fails leaves the other waiting in the rendezvous: stop at the first failure
        while any(node.poll() is None for node in nodes) and time.monotonic() < deadline:
            if any(node.returncode for node in nodes):
                break
            time.sleep(0.5)
    finally:
        left = stop_run(nodes, f"PARAKIT_TORCHRUN_TEST={run_id}")
        for pid in left:  # the workers torchrun starts in sessions of their own
            os.kill(pid, signal.SIGKILL)
        for log in logs:
            log.close()
    outputs = [(tmp_path / f"node{n}.txt").read_text() for n in range(2)]
    assert left == [], f"processes {left} of the torchrun run outlived it"
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)
    logged = [p for p in tmp_path.glob("losses.json")]
    printed = [line for out in outputs for line in out.splitlines() if " loss " in line]
    assert len(printed) == 5  # rank 0, on whichever node the rendezvous made it
    losses = json.loads(logged[0].read_text()) if logged else None
    losses = losses or [float(line.split()[-1]) for line in printed]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one_process_losses), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- expert parallelism in the trainer

MOE = ["--experts", "4", "--top-k", "2"]
EP_MESHES = {"dp2_ep2": (["--dp", "2", "--ep", "2"], 2), "cp2_ep2": (["--cp", "2", "--ep", "2"], 2),
             "dp4_ep2": (["--dp", "4", "--ep", "2"], 4), "dp2_pp2_ep2": (["--dp", "2", "--pp", "2", "--ep", "2"], 4)}


@pytest.mark.parametrize("mesh", ["dp2_ep2", "cp2_ep2", "dp4_ep2"])
def test_experts_split_over_ep_give_one_process_loss_and_gradients(mesh):
    """Every expert's gradient, on the rank that holds it, equals one process's: it sums its ep
    group's tokens (all-to-all backward), then the expert replicas' (dp4_ep2: 2 of them), over dp x cp."""
    [(loss, grads)] = parakit.launch(first_step, SMALL + MOE, world_size=1)
    argv, world_size = EP_MESHES[mesh]
    held = set()
    for rank_loss, rank_grads in parakit.launch(first_step, SMALL + MOE + argv, world_size=world_size):
        assert rank_loss == pytest.approx(loss, rel=1e-5)
        assert len(rank_grads) < len(grads)  # half the experts
        torch.testing.assert_close(rank_grads, {n: grads[n] for n in rank_grads}, rtol=1e-4, atol=1e-6)
        held |= set(rank_grads)
    assert held == set(grads)


def test_ep_trainer_with_a_pipeline_matches_one_process_for_five_steps():
    [reference] = parakit.launch(run_trainer, SMALL + MOE, world_size=1)
    argv, world_size = EP_MESHES["dp2_pp2_ep2"]
    for losses in parakit.launch(run_trainer, SMALL + MOE + argv, world_size=world_size):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=1e-5)


def ep_mesh_groups(dp, cp, ep):
    mesh = Mesh(dp, 1, 1, cp, ep)
    return mesh.ranks["ep"], mesh.ranks["expert_replica"]


def test_ep_groups_cut_the_replicas_into_runs_and_expert_replicas_take_every_ep_th():
    assert parakit.launch(ep_mesh_groups, 2, 2, 2, world_size=4) == [([0, 1], [0, 2]), ([0, 1], [1, 3]),
                                                                    ([2, 3], [0, 2]), ([2, 3], [1, 3])]


@pytest.mark.parametrize("argv, world_size, message", [
    (["--dp", "2", "--ep", "4"], 2, "ep=4 must divide dp x cp = 2"),
    (["--tp", "2"], 2, "parakit.train's experts are not split over tp"),
    (["--dp", "2", "--ep", "2", "--experts", "1"], 2, "--ep 2 splits experts, but the model has none")])
def test_ep_that_does_not_divide_the_replicas_or_experts_with_tp_or_ep_without_experts_are_refused(argv, world_size,
                                                                                                    message):
    with pytest.raises(parakit.RankError, match=message):
        parakit.launch(run_trainer, SMALL + MOE + argv, world_size=world_size)
