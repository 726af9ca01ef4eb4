"""parakit.moe on real ranks (gloo on CPU), at expert-parallel sizes 2 and 4: top-k routing
with capacity (slots and dropped choices exact, by hand and against a token-by-token count);
the capacity formula; the balancing loss at its two ends; the MoE layer against a
token-by-token sum; the expert-parallel layer equal to the single-process layer on fresh
random inputs (outputs, dL/dx, router and expert gradients, dropped counts, tokens per expert
exact); its all-to-alls counted exactly (calls, bytes passed, bytes leaving the rank); EP x DP
training equal to one process over 5 steps; errors for bad sizes, and the pool after them."""
from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import parakit
from parakit import moe


# ---------------------------------------------------------------- routing, one process

def test_top_k_route_hands_out_places_first_choices_first_and_drops_beyond_capacity():
    probs = torch.tensor([[.1, .2, .6, .1], [.5, .3, .1, .1], [.3, .1, .5, .1],
                          [.3, .4, .2, .1], [.1, .3, .5, .1], [.5, .3, .1, .1]])
    experts, gates, slots = moe.top_k_route(probs, k=2, capacity=2)
    assert experts.tolist() == [[2, 1], [0, 1], [2, 0], [1, 0], [2, 1], [0, 1]]
    torch.testing.assert_close(gates, probs.gather(1, experts))
    # first choices: expert 2 gets tokens 0, 2 (token 4 is third: dropped); expert 0 gets 1, 5; expert 1 gets 3
    # second choices come after: expert 1 has room for token 0 only; expert 0 is full
    assert slots.tolist() == [[0, 1], [0, -1], [1, -1], [0, -1], [-1, -1], [1, -1]]


def _places_by_counting(experts, capacity):
    """Token by token, first choices of every token before any second choice."""
    tokens, k = experts.shape
    used, slots = {}, torch.full_like(experts, -1)
    for c in range(k):
        for t in range(tokens):
            e = int(experts[t, c])
            if used.get(e, 0) < capacity:
                slots[t, c] = used.get(e, 0)
            used[e] = used.get(e, 0) + 1
    return slots


@pytest.mark.parametrize("trial", range(5))
def test_top_k_route_equals_counting_places_one_by_one(trial):
    rng = random.Random(trial)
    tokens, experts_n = rng.randint(1, 40), rng.randint(1, 9)
    k, capacity = rng.randint(1, experts_n), rng.randint(0, 12)
    probs = torch.randn(tokens, experts_n, generator=torch.Generator().manual_seed(trial)).softmax(-1)
    experts, _, slots = moe.top_k_route(probs, k, capacity)
    assert torch.equal(slots, _places_by_counting(experts, capacity))
    assert int((slots < 0).sum()) == sum(max(0, int(n) - capacity) for n in torch.bincount(experts.reshape(-1)))


def test_capacity_is_exact_for_decimal_factors():
    assert moe.expert_capacity(10, 1, 1, 1.1) == 11  # 10 * 1.1 in floats is 11.000000000000002
    assert moe.expert_capacity(8, 4, 1, 1.25) == 3
    assert moe.expert_capacity(16, 4, 2, 1.0) == 8
    assert moe.expert_capacity(3, 8, 1, 0.5) == 1


def test_balancing_loss_is_one_when_uniform_and_E_when_everything_goes_to_one_expert():
    uniform = torch.full((8, 4), 0.25)
    assert moe.load_balancing_loss(uniform, torch.arange(8).remainder(4).view(8, 1), 4).item() == pytest.approx(1.0)
    collapsed = F.one_hot(torch.zeros(8, dtype=torch.long), 4).float()
    assert moe.load_balancing_loss(collapsed, torch.zeros(8, 1, dtype=torch.long), 4).item() == pytest.approx(4.0)
    logits = torch.randn(6, 4, requires_grad=True)
    moe.load_balancing_loss(logits.softmax(-1), logits.topk(2).indices, 4).backward()
    assert logits.grad.abs().sum() > 0  # through P (the probabilities); f is a count


def test_moe_layer_is_the_gated_sum_of_its_experts_token_by_token():
    torch.manual_seed(0)
    layer = moe.MoE(8, 16, num_experts=4, k=2, capacity_factor=1.0)
    x = torch.randn(12, 8)
    y = layer(x, groups=2)
    for g, part in enumerate(x.chunk(2)):
        r = layer.router.route(part)
        expected = torch.zeros_like(part)
        for t in range(part.shape[0]):
            for c in range(2):
                if r.slots[t, c] >= 0:
                    expected[t] += r.gates[t, c] * layer.experts[int(r.experts[t, c])](part[t])
        torch.testing.assert_close(y.chunk(2)[g], expected)
    assert layer.routings[0].dropped() + layer.routings[1].dropped() > 0  # capacity 1.0 with 2 choices drops some


def test_normalized_gates_are_a_softmax_over_the_chosen_experts_logits_as_mixtrals():
    torch.manual_seed(0)
    plain, mixtral = moe.Router(8, 6, k=2), moe.Router(8, 6, k=2, normalize_gates=True)
    mixtral.load_state_dict(plain.state_dict())
    x = torch.randn(10, 8)
    a, b = plain.route(x), mixtral.route(x)
    assert torch.equal(a.experts, b.experts) and torch.equal(a.slots, b.slots)  # the same choices and places
    assert (a.gates.sum(-1) < 1).all()  # GShard's: probabilities under the softmax over all 6
    torch.testing.assert_close(b.gates, a.logits.gather(-1, a.experts).softmax(-1))
    torch.testing.assert_close(b.gates.sum(-1), torch.ones(10))


# ---------------------------------------------------------------- expert parallelism on real ranks

def _ep_against_one_process(seed, hidden, ffn, num_experts, k, capacity_factor, tokens, normalize=False):
    """EP on this rank's tokens against MoE in this process on every rank's tokens (groups = n)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    draw = torch.Generator().manual_seed(seed)
    x_all, upstream = torch.randn(n * tokens, hidden, generator=draw), torch.randn(n * tokens, hidden, generator=draw)
    torch.manual_seed(seed)
    reference = moe.MoE(hidden, ffn, num_experts, k, capacity_factor, normalize_gates=normalize)
    torch.manual_seed(seed)
    layer = moe.ExpertParallelMoE(hidden, ffn, num_experts, k, capacity_factor, normalize_gates=normalize)
    x = x_all.chunk(n)[rank].clone().requires_grad_()
    with parakit.CommLog() as forward:
        y = layer(x)
    with parakit.CommLog() as backward:
        y.backward(upstream.chunk(n)[rank])
    x_ref = x_all.clone().requires_grad_()
    y_ref = reference(x_ref, groups=n)
    y_ref.backward(upstream)

    close = lambda a, b, what: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
    close(y, y_ref.chunk(n)[rank], "output")
    close(x.grad, x_ref.grad.chunk(n)[rank], "dL/dx")
    router_grad = layer.router.weight.grad.clone()
    dist.all_reduce(router_grad)  # each rank's router saw its own tokens; the reference saw all of them
    close(router_grad, reference.router.weight.grad, "router gradient (summed over ranks)")
    for j, expert in enumerate(layer.experts):
        for (name, p), q in zip(expert.named_parameters(), reference.experts[layer.first_expert + j].parameters()):
            close(p.grad, q.grad, f"expert {layer.first_expert + j} {name} gradient")
    mine = reference.routings[rank]
    assert layer.routing.dropped() == mine.dropped()
    assert torch.equal(layer.routing.tokens_per_expert(), mine.tokens_per_expert())
    every = torch.stack([r.tokens_per_expert() for r in reference.routings])  # [n, E]
    per_rank = num_experts // n
    assert torch.equal(layer.recv_counts, every[:, rank * per_rank:(rank + 1) * per_rank])

    # the all-to-alls, exactly: counts (E int64), rows out, rows back; backward the two row exchanges reversed
    kept, received, row = int(mine.kept.sum()), int(layer.recv_counts.sum()), hidden * 4
    assert [r.op for r in forward.records] == ["all_to_all_single"] * 3
    assert [r.nbytes for r in forward.records] == [8 * num_experts, kept * row, received * row]
    assert [r.op for r in backward.records] == ["all_to_all_single"] * 2
    assert [r.nbytes for r in backward.records] == [kept * row, received * row]
    sends = mine.tokens_per_expert().view(n, per_rank).sum(1)  # rows to each rank
    leaving = (int(sends.sum()) - int(sends[rank])) * row
    measured = forward.records[1].measured
    assert measured is None or measured >= leaving  # the OS sees at least the rows that leave this rank
    return kept, received, mine.dropped()


@pytest.mark.parametrize("world_size", [2, 4])
def test_expert_parallel_layer_equals_one_process_in_outputs_gradients_and_drops(world_size):
    seen_drops = 0
    for num_experts, k, capacity_factor, tokens, normalize in [(4, 1, 1.0, 12, False), (8, 2, 1.25, 10, False),
                                                               (world_size, 2, 0.5, 7, False), (8, 2, 1.25, 10, True)]:
        seed = random.randrange(2**31)
        results = parakit.launch(_ep_against_one_process, seed, 8, 12, num_experts, k, capacity_factor, tokens,
                                 normalize, world_size=world_size)
        sent = sum(kept for kept, _, _ in results)
        assert sent == sum(received for _, received, _ in results)  # every row sent is received once
        seen_drops += sum(d for _, _, d in results)
    assert seen_drops > 0  # capacity factor 0.5 drops choices: the comparison covered dropping


def _ep_dp_losses(ep, steps):
    return moe.train_ep_dp(ep, steps, tokens_per_rank=8, num_experts=4, k=2, capacity_factor=1.0, aux_coef=0.1)


@pytest.mark.parametrize("world_size,ep", [(2, 2), (4, 2), (4, 4)])
def test_ep_dp_training_loss_equals_one_process_over_5_steps(world_size, ep):
    runs = parakit.launch(_ep_dp_losses, ep, 5, world_size=world_size)
    reference = moe.train_one_process(world_size, 5, tokens_per_rank=8, num_experts=4, k=2, capacity_factor=1.0,
                                      aux_coef=0.1)["loss"]
    for rank, run in enumerate(runs):
        assert run == runs[0], f"rank {rank} reports other statistics than rank 0"
    torch.testing.assert_close(torch.tensor(runs[0]["loss"]), torch.tensor(reference), rtol=0, atol=1e-5)
    per_step = [sum(row) for row in runs[0]["tokens_per_expert"]]
    assert per_step == [sum(row) for row in runs[0]["tokens_per_rank"]]  # every kept choice runs on one rank
    assert all(kept + dropped == world_size * 8 * 2 for kept, dropped in zip(per_step, runs[0]["dropped"]))


def _expert_gradients_after_sync(ep):
    """Every rank's expert gradients after EP x DP synchronisation, keyed by expert index."""
    mesh = moe.ExpertMesh(ep)
    torch.manual_seed(0)
    model = moe.ExpertDataParallel(moe.TinyMoE(8, 16, 4, 2, 2.0, parallel=True, group=mesh.ep_group), mesh)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    with parakit.CommLog() as log:
        model(x).square().mean().backward()
        model.finish_gradient_synchronization()
    layer = model.module.moe
    grads = {layer.first_expert + j: e.fc1.weight.grad for j, e in enumerate(layer.experts)}
    return grads, [(r.op, r.group_size) for r in log.records if r.op == "all_reduce"]


def test_ep_dp_syncs_expert_gradients_only_among_replicas_of_the_same_experts():
    results = parakit.launch(_expert_gradients_after_sync, 2, world_size=4)
    for rank, (grads, reduces) in enumerate(results):
        assert reduces == [("all_reduce", 4), ("all_reduce", 2)]  # dense over the world, experts over dp = 2
        replica = results[rank ^ 2][0]  # rank d * 2 + e holds the experts of rank (1 - d) * 2 + e
        assert grads.keys() == replica.keys()
        for e in grads:
            torch.testing.assert_close(grads[e], replica[e])


# ---------------------------------------------------------------- bad input

def _errors():
    messages = {}
    for name, make in {"divisible": lambda: moe.ExpertParallelMoE(8, 16, 6),
                       "mesh": lambda: moe.ExpertMesh(3)}.items():
        try:
            make()
        except ValueError as error:
            messages[name] = str(error)
    return messages


def test_bad_sizes_raise_errors_that_name_the_sizes_and_the_fix():
    messages = parakit.launch(_errors, world_size=4)[0]
    assert messages["divisible"] == ("num_experts=6 is not divisible by the expert-parallel size 4: use a multiple "
                                     "of 4 experts, or an EP size that divides 6")
    assert messages["mesh"].startswith("expert-parallel size 3 does not divide the world size 4: choose ep among [1, 2, 4]")
    with pytest.raises(ValueError, match=r"top_k=3 with num_experts=2: .* choose k <= 2"):
        moe.MoE(8, 16, num_experts=2, k=3)
    with pytest.raises(ValueError, match=r"top_k=5 with num_experts=4"):
        moe.top_k_route(torch.rand(3, 4), 5, 2)
    for factor in (0, -1.0):
        with pytest.raises(ValueError, match=rf"capacity_factor={factor} must be > 0"):
            moe.MoE(8, 16, num_experts=4, capacity_factor=factor)
    with pytest.raises(ValueError, match=r"tokens of width 7 \(\[3, 7\]\) for a layer of hidden size 8: give it \[\.\.\., 8\]"):
        moe.MoE(8, 16, 4)(torch.randn(3, 7))
    assert parakit.launch(dist.get_rank, world_size=4) == [0, 1, 2, 3]  # the pool still works
