"""parakit.state on real ranks (gloo on CPU): sharded checkpoints saved on one mesh and loaded
on another bit for bit (dp4 ZeRO-3 -> dp2 x tp2 -> dp4); each rank opens only the files that
hold its slices; a save that did not finish is ignored; torch.distributed.checkpoint loads
parakit's checkpoints and parakit loads DCP's; every bad input gets its error, on every rank,
and changes nothing.

Each launch checks several things inside the ranks (torch.equal there; a failure comes back
as the rank's traceback) and returns what the test asserts exactly: files read, error texts."""
from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
from torch import nn

import parakit
from parakit import state, zero
from parakit.mesh import Mesh
from parakit.state.boxes import flat_boxes
from parakit.tensor_parallel import ParallelMLP

HIDDEN, FFN = 6, 10  # fc1 70 elements, fc2 66, the norm 12: no unit splits evenly over 4 ranks


def draw(seed: int, *shape: int) -> torch.Tensor:
    """Fresh random numbers from `seed`, on this rank's device."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(parakit.device())


def zeros(*shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=parakit.device())


def test_flat_boxes_cut_a_flat_range_into_runs_of_consecutive_elements():
    assert flat_boxes(7, 53, (3, 4, 5)) == [((0, 1, 2), (1, 1, 3)), ((0, 2, 0), (1, 2, 5)), ((1, 0, 0), (1, 4, 5)),
                                            ((2, 0, 0), (1, 2, 5)), ((2, 2, 0), (1, 1, 3))]
    numbers = torch.arange(60).view(3, 4, 5)
    for start in range(60):
        for stop in range(start, 61):
            boxes = flat_boxes(start, stop, (3, 4, 5))
            held = [numbers[tuple(slice(o, o + n) for o, n in zip(*box))].reshape(-1) for box in boxes]
            assert sum((t.tolist() for t in held), []) == list(range(start, stop))
            assert len(boxes) <= 5  # 2 x ndim - 1


# ---------------------------------------------------------------- resharding

class DenseNet(nn.Module):
    """A layer norm and an MLP, named as TensorParallelNet's parameters are."""

    def __init__(self):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(HIDDEN), nn.Module()
        self.mlp.fc1, self.mlp.fc2 = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)


class TensorParallelNet(nn.Module):
    def __init__(self, group):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(HIDDEN), ParallelMLP(HIDDEN, FFN, group)


def random_state(seed: int) -> dict[str, torch.Tensor]:
    return {name: draw(seed + i, *p.shape) for i, (name, p) in enumerate(DenseNet().named_parameters())}


def zero3(full: dict[str, torch.Tensor] | None) -> zero.FullyShardedDataParallel:
    net = DenseNet().to(parakit.device())
    if full is not None:
        net.load_state_dict(full)
    return zero.FullyShardedDataParallel(net, units=[net.mlp.fc1, net.mlp.fc2])


def tp_slice(full: dict[str, torch.Tensor], name: str, t: int) -> torch.Tensor:
    dim = {"mlp.fc1.weight": 0, "mlp.fc1.bias": 0, "mlp.fc2.weight": 1}.get(name)
    return full[name] if dim is None else full[name].chunk(2, dim)[t]


def reshard(root, seed):
    full = random_state(seed)
    model = zero3(full)
    saved = [unit.shard.detach().clone() for unit in model.units]
    state.save(root / "dp4", state.fsdp_shards(model))

    mesh = Mesh(2, 1, 2)
    tp = TensorParallelNet(mesh.tp_group).to(parakit.device())  # initialised at random: other values
    read_at_tp = state.load(root / "dp4", state.tensor_parallel_shards(tp, mesh.tp_group, mesh.dp_group))
    for name, p in tp.named_parameters():
        assert torch.equal(p, tp_slice(full, name, mesh.tp_rank)), name
    state.save(root / "dp2tp2", state.tensor_parallel_shards(tp, mesh.tp_group, mesh.dp_group))

    back = zero3(None)
    read_back = state.load(root / "dp2tp2", state.fsdp_shards(back))
    assert all(torch.equal(unit.shard, s) for unit, s in zip(back.units, saved))
    assert all(torch.equal(back.gather_full_params()[name], t) for name, t in full.items())

    moments = [draw(seed + u, *unit.shard.shape) for u, unit in enumerate(model.units)]  # as AdamW's exp_avg
    state.save(root / "moments", state.fsdp_shards(model, "exp_avg.", moments))
    loaded = [torch.zeros_like(m) for m in moments]
    state.load(root / "moments", state.fsdp_shards(model, "exp_avg.", loaded))
    for unit, a, b in zip(model.units, loaded, moments):  # the padding after the last parameter is not state
        held = min(unit.chunk, max(unit.offsets[-1] - dist.get_rank() * unit.chunk, 0))
        assert torch.equal(a[:held], b[:held]) and not a[held:].any()
    return read_at_tp, read_back


def test_zero3_dp4_reshards_to_dp2_tp2_and_back_bit_for_bit(tmp_path):
    results = parakit.launch(reshard, tmp_path, 1234, world_size=4)
    ranks = [f"rank{r}.bin" for r in range(4)]
    assert [read_at_tp for read_at_tp, _ in results] == [ranks] * 4  # every rank holds some of the norm
    assert [read_back for _, read_back in results] == [ranks[:2]] * 4  # dp replicas wrote nothing
    assert sorted(os.listdir(tmp_path / "dp4")) == ["index.json", *ranks]
    assert sorted(os.listdir(tmp_path / "dp2tp2")) == ["index.json", *ranks[:2]]


def ops(log: parakit.CommLog) -> dict[str, int]:
    return {op: log.count(op) for op in {r.op for r in log.records}}


def files_read(root):
    rank, mesh = dist.get_rank(), Mesh(2, 1, 2)
    w, b = draw(7, 8, 3), draw(8, 5)  # the same on every rank
    with parakit.CommLog() as saving:
        state.save(root, [state.split("w", w.chunk(4)[rank].clone(), 0, None), state.replicated("b", b)])
    mine_w, mine_b = zeros(4, 3), zeros(5)
    with parakit.CommLog() as loading:
        read = state.load(root, [state.split("w", mine_w, 0, mesh.tp_group, mesh.dp_group),
                                 state.replicated("b", mine_b, mesh.tp_group, mesh.dp_group)])
    assert torch.equal(mine_w, w.chunk(2)[mesh.tp_rank]) and torch.equal(mine_b, b)
    return read, ops(saving), ops(loading)


def test_each_rank_opens_only_the_files_holding_its_slices(tmp_path):
    read, saving, loading = zip(*parakit.launch(files_read, tmp_path, world_size=4))
    assert list(read) == [["rank0.bin", "rank1.bin"], ["rank0.bin", "rank2.bin", "rank3.bin"]] * 2  # tp 0, tp 1
    # gather_object: an all_gather of sizes, a gather; broadcast_object_list: size, then bytes; all_gather_object: two
    assert saving == ({"all_gather": 1, "gather": 1, "broadcast": 2},) * 4
    assert loading == ({"all_gather": 2},) * 4
    sizes = [os.path.getsize(tmp_path / f"rank{r}.bin") for r in range(4)]
    assert sizes == [2 * 3 * 4 + 5 * 4, 2 * 3 * 4, 2 * 3 * 4, 2 * 3 * 4]  # the replicated b written once


# ---------------------------------------------------------------- torch.distributed.checkpoint

def dcp_both_ways(root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rank, mesh = dist.get_rank(), init_device_mesh(parakit.device().type, (2,))
    w, b, h = draw(11, 6, 4), draw(12, 3), draw(13, 7, 5).to(torch.bfloat16)
    flat_h = [(0, h.reshape(-1)[:18]), (18, h.reshape(-1)[18:])][rank]  # ZeRO-3 style: a flat range each
    state.save(root / "parakit", [state.split("w", w.chunk(2)[rank].clone(), 0, None), state.replicated("b", b),
                                  state.Shard("h", flat_h[1].clone(), (7, 5), (flat_h[0],), (len(flat_h[1]),), True)])
    into = {"w": DTensor.from_local(zeros(6, 2), mesh, [Shard(1)]), "b": zeros(3),
            "h": zeros(7, 5, dtype=torch.bfloat16)}
    dcp.load(into, storage_reader=state.Reader(root / "parakit"))
    assert torch.equal(into["w"].to_local(), w.chunk(2, 1)[rank]) and torch.equal(into["b"], b)
    assert torch.equal(into["h"], h)

    dcp.save({"w": DTensor.from_local(w.chunk(2)[rank], mesh, [Shard(0)]), "b": b, "h": h}, checkpoint_id=root / "dcp")
    got_w, got_b, got_h = zeros(6, 2), zeros(3), zeros(20 - 5 * rank, dtype=torch.bfloat16)
    read = state.load(root / "dcp", [state.split("w", got_w, 1, None), state.replicated("b", got_b),
                                     state.Shard("h", got_h, (7, 5), (20 * rank,), (len(got_h),), flat=True)])
    assert torch.equal(got_w, w.chunk(2, 1)[rank]) and torch.equal(got_b, b)
    assert torch.equal(got_h, h.reshape(-1)[20 * rank:][:20])
    return read


def test_dcp_loads_parakit_checkpoints_and_parakit_loads_dcp_checkpoints(tmp_path):
    assert parakit.launch(dcp_both_ways, tmp_path, world_size=2) == [["__0_0.distcp", "__1_0.distcp"]] * 2
    boxes = [c.box for c in state.read_catalog(tmp_path / "parakit")["h"].chunks]  # what DCP sees of the flat pieces
    assert boxes == [((0, 0), (3, 5)), ((3, 0), (1, 3)), ((3, 3), (1, 2)), ((4, 0), (3, 5))]


# ---------------------------------------------------------------- an unfinished save, bad inputs

def unfinished_save(root):
    rank = dist.get_rank()
    mine = draw(rank, 2, 3)
    state.save(root / "step1", [state.split("w", mine, 0, None)])
    if rank == 0:
        (root / "step2" / "rank1.bin").mkdir(parents=True)  # rank 1 cannot write its file: its save fails
    dist.barrier()
    errors = []
    for attempt in (lambda: state.save(root / "step2", [state.split("w", mine * 2, 0, None)]),
                    lambda: state.load(root / "step2", [state.split("w", zeros(2, 3), 0, None)])):
        try:
            attempt()
        except state.CheckpointError as error:
            errors.append(str(error))
    newest = state.latest(root)
    got = zeros(2, 3)
    state.load(newest, [state.split("w", got, 0, None)])
    assert torch.equal(got, mine)
    return errors, newest.name


def test_a_save_that_did_not_finish_is_ignored_and_the_previous_checkpoint_loads(tmp_path):
    step2 = tmp_path / "step2"
    for errors, newest in parakit.launch(unfinished_save, tmp_path, world_size=2):
        assert errors == [f"save to {step2} failed; no index.json written:\n  rank 1: cannot write {step2}/rank1.bin "
                          f"(Is a directory): pick a folder this process can write, with room for the shards",
                          f"load from {step2} failed; nothing was loaded:\n  ranks 0, 1: checkpoint {step2} is "
                          f"incomplete: it has no index.json (nor DCP's .metadata), which a save writes last, so that "
                          f"save did not finish; load a complete one, e.g. parakit.state.latest('{tmp_path}')"]
        assert newest == "step1"
    assert sorted(os.listdir(step2)) == ["rank0.bin", "rank1.bin"]  # rank 0's file, rank 1's obstacle; no index


def bad_inputs(root):
    rank = dist.get_rank()
    w, b = draw(5, 4, 3), draw(6, 3)
    good = root / "good"
    state.save(good, [state.split("w", w.chunk(2)[rank].clone(), 0, None), state.replicated("b", b)])
    if rank == 0:
        for damaged in ("nofile", "short"):
            shutil.copytree(good, root / damaged)
        os.remove(root / "nofile" / "rank1.bin")
        os.truncate(root / "short" / "rank0.bin", 10)
        (root / "afile").write_text("not a folder")
    dist.barrier()
    mine_w, mine_b = draw(10 + rank, 2, 3), draw(20 + rank, 3)
    before = mine_w.clone(), mine_b.clone()
    shards = [state.split("w", mine_w, 0, None), state.replicated("b", mine_b)]
    cases = {"missing name": lambda: state.load(good, shards + [state.replicated("c", zeros(2))]),
             "extra name": lambda: state.load(good, shards[:1]),
             "shape": lambda: state.load(good, [state.split("w", zeros(2, 4), 0, None), shards[1]]),
             "dtype": lambda: state.load(good, [shards[0], state.replicated("b", zeros(3, dtype=torch.float64))]),
             "missing file": lambda: state.load(root / "nofile", shards),
             "truncated file": lambda: state.load(root / "short", shards),
             "no folder": lambda: state.load(root / "nowhere", shards),
             "unwritable": lambda: state.save(root / "afile" / "step1", shards),
             "complete already": lambda: state.save(good, shards),
             "written twice": lambda: state.save(root / "twice", [shards[0], state.Shard("b", b, (3,), (0,), (3,))])}
    errors = {}
    for case, attempt in cases.items():
        try:
            attempt()
        except state.CheckpointError as error:
            errors[case] = str(error)
    assert torch.equal(mine_w, before[0]) and torch.equal(mine_b, before[1])  # nothing half-loaded
    state.load(good, shards)  # and the group still works
    assert torch.equal(mine_w, w.chunk(2)[rank]) and torch.equal(mine_b, b)
    return errors


def test_bad_checkpoints_raise_the_same_clear_error_on_every_rank_and_change_nothing(tmp_path):
    good, root = tmp_path / "good", tmp_path
    failed = f"load from {good} failed; nothing was loaded:\n  "
    expected = {
        "missing name": failed + f"ranks 0, 1: tensor 'c' is not in checkpoint {good}: load a checkpoint of this "
                                 f"model, or leave 'c' out of the shards",
        "extra name": f"load from {good} failed; nothing was loaded: the checkpoint holds ['b'], which no rank asked "
                      f"for: pass shards for them too, or load a checkpoint of this model",
        "shape": failed + f"ranks 0, 1: tensor 'w': global shape (4, 4) here, (4, 3) in checkpoint {good}: build the "
                          f"model with the sizes it was saved with",
        "dtype": failed + f"ranks 0, 1: tensor 'b': dtype torch.float64 here, torch.float32 in checkpoint {good}: make "
                          f"the model torch.float32 to load it (cast it after)",
        "missing file": f"load from {root}/nofile failed; nothing was loaded:\n  rank 1: shard file {root}/nofile/"
                        f"rank1.bin is missing (it holds part of tensor 'w'): the checkpoint is damaged; load an "
                        f"earlier one",
        "truncated file": f"load from {root}/short failed; nothing was loaded:\n  ranks 0, 1: shard file {root}/short/"
                          f"rank0.bin is truncated: tensor 'b' needs bytes up to 36, the file has 10; load an earlier "
                          f"checkpoint",
        "no folder": f"load from {root}/nowhere failed; nothing was loaded:\n  ranks 0, 1: there is no checkpoint "
                     f"folder {root}/nowhere: pass a folder written by parakit.state.save or dcp.save",
        "unwritable": f"save to {root}/afile/step1 failed; no index.json written:\n  ranks 0, 1: cannot write the "
                      f"checkpoint folder {root}/afile/step1 (Not a directory): pick a folder this process can create "
                      f"and write",
        "complete already": f"save to {good} failed; no index.json written:\n  ranks 0, 1: {good} already holds a "
                            f"complete checkpoint (index.json): save each checkpoint to a new folder (e.g. one per "
                            f"step), or delete that one first",
        "written twice": f"save to {root}/twice: rank0.bin and rank1.bin both hold the part ((0,), (3,)) (offsets, "
                         f"lengths) of 'b': a replicated tensor is written by one rank only (replicated(name, tensor, "
                         f"*groups) lets the first rank of its groups write it); no index.json written"}
    for errors in parakit.launch(bad_inputs, tmp_path, world_size=2):
        assert errors == expected
    assert not (tmp_path / "twice" / "index.json").exists()
