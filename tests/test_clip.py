"""parakit.clip on real ranks (gloo): global-norm clipping of parakit.train's GPT on dp2 x tp2,
pp2 x tp2, dp2 x tp2 under FSDP, dp4 x ep2 and dp2 x pp2 x tp2 equal to
torch.nn.utils.clip_grad_norm_ on the one-process model (every rank also builds that model,
on a group of its own); plausible wrong countings (replicated gradients summed over tp, or
summed over dp) differ; the token-weighted loss and its gradients equal one process's with
uneven padding per rank, where the mean of the ranks' means does not; errors for bad input."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import parakit
from parakit.clip import clip_grad_norm_, token_weighted_loss

MAX_NORM = 0.5
SMALL = ["--batch", "8", "--seq", "8", "--hidden", "16", "--heads", "4", "--vocab", "32", "--microbatches", "2"]
MOE = ["--experts", "4", "--top-k", "2"]


# ---------------------------------------------------------------- on the ranks

def lm_loss(logits, target):  # [batch, seq, vocab], [batch, seq]
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def dense_reference(args, own_group):
    """One process's first step on the whole batch: the norm and the clipped gradients (torch's clipping)."""
    from parakit import train
    model = train.build_model(args, own_group)
    ids, target = train.batch_for(0, args)  # [batch, seq]
    lm_loss(model(ids), target).backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    return norm, {n: p.grad for n, p in model.named_parameters()}


def slicing(model) -> dict[str, tuple[int | None, str]]:
    """name -> (the dim a tp layer splits it along, None if replicated; its name in the dense model)."""
    from parakit.moe import ExpertParallelMoE
    from parakit.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    out = {n: (None, n) for n, _ in model.named_parameters()}
    for prefix, m in model.named_modules():
        dims = {ColumnParallelLinear: {"weight": 0, "bias": 0}, RowParallelLinear: {"weight": 1}}.get(type(m), {})
        out.update({f"{prefix}.{n}": (d, f"{prefix}.{n}") for n, d in dims.items()})
        if isinstance(m, ExpertParallelMoE):
            for i, expert in enumerate(m.experts):
                for n, _ in expert.named_parameters():
                    out[f"{prefix}.experts.{i}.{n}"] = (None, f"{prefix}.experts.{m.first_expert + i}.{n}")
    return out


def naive_norms(params, mesh) -> tuple[float, float]:
    """Wrong global norms: every local gradient summed over tp and pp (replicated ones counted tp
    times), and over the whole world (dp replicas summed too)."""
    local = sum(p.grad.square().sum() for p in params).reshape(1)
    world = local.clone()
    for group in (mesh.tp_group, mesh.pp_group):
        dist.all_reduce(local, group=group)
    dist.all_reduce(world)
    return local.sqrt().item(), world.sqrt().item()


def clip_on_mesh(argv, dp, pp, tp, ep=1, fsdp=False):
    """This rank's first step of parakit.train on the mesh, clipped; with the one-process reference."""
    from parakit import train
    from parakit.checkpoint import segment_sizes
    from parakit.groups import new_subgroups
    from parakit.mesh import Mesh
    from parakit.pipeline import dp_pp_step, split_stages
    from parakit.zero import FullyShardedDataParallel
    args = train.parse_args(SMALL + argv)
    own, _ = new_subgroups([[r] for r in range(dist.get_world_size())])
    ref_norm, ref_grads = dense_reference(args, own)
    mesh = Mesh(dp, pp, tp, ep=ep)
    model = train.build_model(args, mesh.tp_group, ep_group=mesh.ep_group)
    names = slicing(model)
    ids, target = train.local_batch(0, args, mesh)  # [batch/dp, seq]
    if fsdp:
        mine = FullyShardedDataParallel(model, units=list(model), group=mesh.dp_group)
        lm_loss(mine(ids), target).backward()
        mine.finish_gradient_synchronization()
    else:
        balance = segment_sizes(len(model), pp)
        mine = nn.ModuleList(split_stages(model, balance)[mesh.pp_rank])
        dp_pp_step(model, balance, ids, target, lm_loss, pp_group=mesh.pp_group,
                   replica=train.replicate(mine, mesh), num_microbatches=2)
    wrong = naive_norms([p for p in mine.parameters() if p.grad is not None], mesh)
    norm = clip_grad_norm_(mine, MAX_NORM, mesh)
    grads = full_grads(mine) if fsdp else {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    mine_vs_ref = {names[n][1]: (g, dense_slice(ref_grads[names[n][1]], names[n][0], mesh)) for n, g in grads.items()}
    return norm.item(), ref_norm.item(), wrong, mine_vs_ref, len(ref_grads)


def dense_slice(grad, dim, mesh):
    return grad if dim is None else grad.chunk(mesh.tp, dim)[mesh.tp_rank]


def full_grads(fsdp) -> dict[str, torch.Tensor]:
    """Every parameter's clipped gradient, whole over dp: each unit's shard gradients all-gathered."""
    n, units = dist.get_world_size(fsdp.group), []
    for u in fsdp.units:
        flat = torch.empty(n * u.chunk)  # [N * chunk]
        dist.all_gather_single(flat, u.shard.grad, group=fsdp.group)
        units.append([flat[a:b].view(s) for a, b, s in zip(u.offsets, u.offsets[1:], u.shapes)])
    return {name: units[at[0]][at[1]] for name, at in fsdp.names.items()}


def token_losses(seed, lengths):
    """Rank r holds lengths[r] real tokens of 8 (the rest ignore_index): the token-weighted loss
    and the Linear's gradient averaged over ranks (as DDP would); the same in one process over
    every token; and the mean of the ranks' means."""
    torch.manual_seed(seed)
    model, x = nn.Linear(6, 5), torch.randn(len(lengths), 8, 6)  # [ranks, tokens, features]
    target = torch.randint(0, 5, (len(lengths), 8))
    for r, n in enumerate(lengths):
        target[r, n:] = -100
    whole = F.cross_entropy(model(x).flatten(0, 1), target.flatten())
    (reference,) = torch.autograd.grad(whole, model.weight)
    rank = dist.get_rank()
    loss = token_weighted_loss(model(x[rank]), target[rank])
    loss.backward()
    dist.all_reduce(model.weight.grad)
    mean_of_means = F.cross_entropy(model(x[rank]), target[rank]).detach().reshape(1)
    dist.all_reduce(mean_of_means)
    return loss.item(), whole.item(), model.weight.grad / len(lengths), reference, mean_of_means.item() / len(lengths)


def four_ranks():
    meshes = {"dp2_tp2": clip_on_mesh([], 2, 1, 2), "pp2_tp2": clip_on_mesh([], 1, 2, 2),
              "fsdp_dp2_tp2": clip_on_mesh([], 2, 1, 2, fsdp=True), "dp4_ep2": clip_on_mesh(MOE, 4, 1, 1, ep=2)}
    return meshes, token_losses(0, [8, 5, 2, 7]), mismatched_groups() + [no_tokens()]


def no_tokens() -> str:
    """The error when every rank's targets are all ignore_index."""
    try:
        token_weighted_loss(torch.zeros(3, 5), torch.full((3,), -100))
    except ValueError as e:
        return str(e)


def mismatched_groups():
    """The errors for a tp model clipped over groups that are not its own."""
    from parakit import train
    from parakit.mesh import Mesh
    mesh = Mesh(1, 1, 4)
    model = train.build_model(train.parse_args(SMALL), mesh.tp_group)
    errors = []
    for groups in ({"pp": mesh.pp_group}, {"tp": mesh.dp_group}):
        try:
            clip_grad_norm_(model, MAX_NORM, groups)
        except ValueError as e:
            errors.append(str(e))
    return errors


# ---------------------------------------------------------------- the tests

@pytest.fixture(scope="module")
def at_four():
    """Every rank's (meshes, token losses, errors) of one launch on 4 ranks."""
    return parakit.launch(four_ranks, world_size=4)


@pytest.fixture(scope="module")
def meshes(at_four):
    """Mesh name -> every rank's `clip_on_mesh`."""
    four = {mesh: [r[0][mesh] for r in at_four] for mesh in at_four[0][0]}
    return {**four, "dp2_pp2_tp2": parakit.launch(clip_on_mesh, [], 2, 2, 2, world_size=8)}


def test_clipped_gradients_equal_one_process_on_every_mesh(meshes):
    for mesh, ranks in meshes.items():
        for rank, (norm, ref_norm, _, grads, _) in enumerate(ranks):
            assert ref_norm > MAX_NORM, "the reference must clip for the test to mean something"
            assert norm == pytest.approx(ref_norm, rel=1e-6, abs=1e-6), (mesh, rank)
            for name, (got, expected) in grads.items():
                torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6, msg=lambda m: f"{mesh} rank {rank} "
                                           f"{name}: {m}")
        assert len({name for r in ranks for name in r[3]}) == ranks[0][4], f"{mesh}: some parameter on no rank"


def test_counting_replicated_gradients_tp_times_or_summing_dp_replicas_gives_another_norm(meshes):
    for mesh, ranks in meshes.items():
        if mesh.startswith("fsdp"):
            continue  # its naive sums see only shards
        for norm, ref_norm, (over_tp, over_world), _, _ in ranks:
            if "tp" in mesh:
                assert abs(over_tp - ref_norm) > 1e-3 * ref_norm, mesh
            if "dp" in mesh:
                assert abs(over_world - ref_norm) > 1e-3 * ref_norm, mesh


def test_token_weighted_loss_equals_one_process_over_unevenly_padded_ranks(at_four):
    for loss, whole, grad, reference, mean_of_means in (r[1] for r in at_four):
        assert loss == pytest.approx(whole, rel=1e-6)
        torch.testing.assert_close(grad, reference, rtol=1e-6, atol=1e-7)
        assert abs(mean_of_means - whole) > 1e-3  # the plausible wrong average


def test_a_group_that_is_not_the_models_is_refused_by_name(at_four):
    for rank, (_, _, (no_tp, other_tp, _)) in enumerate(at_four):
        assert "split over 4 ranks [0, 1, 2, 3], but mesh_or_groups has no tp group" in no_tp
        assert f"split over ranks [0, 1, 2, 3], but the mesh's tp group is [{rank}]" in other_tp


@pytest.mark.parametrize("max_norm", [0.0, -1.0, float("nan")])
def test_max_norm_not_above_zero_is_refused(max_norm):
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        clip_grad_norm_(nn.Linear(2, 2), max_norm, {})


def test_a_non_finite_norm_raises_and_leaves_the_gradients():
    model = nn.Linear(2, 2)
    model.weight.grad, model.bias.grad = torch.tensor([[1.0, float("inf")], [0.0, 0.0]]), torch.ones(2)
    with pytest.raises(FloatingPointError, match="skip this step"):
        clip_grad_norm_(model, 1.0, {})
    assert torch.equal(model.bias.grad, torch.ones(2))


def test_one_process_without_groups_equals_torch():
    torch.manual_seed(0)
    ours = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    ours(torch.randn(3, 4)).square().sum().backward()
    theirs = [nn.Parameter(p.detach().clone()) for p in ours.parameters()]
    for p, q in zip(ours.parameters(), theirs):
        q.grad = p.grad.clone()
    torch.testing.assert_close(clip_grad_norm_(ours, 0.1, {}), nn.utils.clip_grad_norm_(theirs, 0.1), rtol=1e-6, atol=0)
    torch.testing.assert_close([p.grad for p in ours.parameters()], [q.grad for q in theirs], rtol=1e-6, atol=1e-7)


def test_mesh_or_groups_of_another_kind_is_refused():
    with pytest.raises(TypeError, match=r"a parakit.mesh.Mesh or a dict of process groups by axis, keys among"):
        clip_grad_norm_(nn.Linear(2, 2), 1.0, {"data": None})


def test_token_weighted_loss_refuses_no_tokens_on_any_rank_and_mismatched_shapes(at_four):
    assert all("no rank of the group has a token to average over" in r[2][2] for r in at_four)
    with pytest.raises(ValueError, match=r"logits \(2, 3, 5\) and target \(2, 4\) disagree"):
        token_weighted_loss(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
