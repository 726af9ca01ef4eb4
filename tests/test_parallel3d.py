"""parakit.parallel3d on real ranks (gloo on CPU): the cube's rank formula and groups, Linear3D
and the seed's MLP equal to one process in forward and backward at q = 2 (8 ranks), the
seed's printed shapes, parameter bytes 1/q**3 of dense, and the bytes each collective sends
equal to the seed's cost table for these sizes.

Eight ranks on two cores are slow to start, so each 8-rank launch checks several things."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import parakit
from parakit import CommLog
from parakit.parallel3d import (ClassifierHead3D, block_owners, Cube, LayerNorm3D, Linear3D, cube_coords, cube_groups,
                                cube_rank, cube_side, gather_batch, linear3d_cost, split_batch)


# ---------------------------------------------------------------- rank formula and groups (no processes)

@pytest.mark.parametrize("q", [1, 2, 3])
def test_rank_formula_round_trips_and_is_i_major(q):
    seen = [cube_coords(r, q) for r in range(q**3)]
    assert seen == [(i, j, l) for i in range(q) for j in range(q) for l in range(q)]
    assert [cube_rank(*c, q) for c in seen] == list(range(q**3))


@pytest.mark.parametrize("q", [1, 2, 3])
def test_each_axis_group_varies_one_coordinate_and_products_two(q):
    groups = cube_groups(q)
    for kind, lists in groups.items():
        varying = {"weight": 0, "input": 1, "output": 2}
        free = {varying[a] for a in kind}
        assert len(lists) == q ** (3 - len(kind)) and all(len(g) == q ** len(kind) for g in lists)
        assert sorted(r for g in lists for r in g) == list(range(q**3))  # a partition of the cube
        for g in lists:
            coords = [cube_coords(r, q) for r in g]
            assert g == sorted(g)
            for axis in range(3):
                assert (len({c[axis] for c in coords}) == q) == (axis in free) or q == 1
    assert set(groups) == {("weight",), ("input",), ("output",), ("weight", "input"), ("weight", "output"),
                           ("input", "output")}


def test_q3_groups_match_the_seed_description():
    groups = cube_groups(3)
    # processor (1, 2, 0): X gathered over (1, 0..q, 0), A over (0..q, 2, 0), Y reduce-scattered over (1, 2, 0..q)
    me = cube_rank(1, 2, 0, 3)
    mine = {kind[0]: g for kind, lists in groups.items() if len(kind) == 1 for g in lists if me in g}
    assert mine["input"] == [cube_rank(1, j, 0, 3) for j in range(3)] == [9, 12, 15]
    assert mine["weight"] == [cube_rank(i, 2, 0, 3) for i in range(3)] == [6, 15, 24]
    assert mine["output"] == [cube_rank(1, 2, l, 3) for l in range(3)] == [15, 16, 17]


def test_block_owners_at_q2_are_the_seeds_layout():
    # the seed: X_ijl and A_lji on processor (i, j, l), X in 4 x 2 blocks and A in 2 x 4
    assert block_owners(2) == {"X": [[0, 1], [2, 3], [4, 5], [6, 7]], "A": [[0, 4, 2, 6], [1, 5, 3, 7]]}
    # the next layer (axes swapped) reads the output layout: Y_ijl is row block i*q+l, column block j
    assert block_owners(2, swapped=True)["X"] == [[0, 2], [1, 3], [4, 6], [5, 7]]


@pytest.mark.parametrize("world_size", [2, 4, 6, 9, 26])
def test_a_world_size_that_is_not_a_cube_is_refused_by_name(world_size):
    with pytest.raises(ValueError, match=rf"world size {world_size} is not a cube: 3D tensor parallelism needs q\*\*3 ranks \(1, 8, 27"):
        cube_side(world_size)


def test_cube_side_of_cubes():
    assert [cube_side(n) for n in (1, 8, 27, 64)] == [1, 2, 3, 4]


# ---------------------------------------------------------------- q = 2 on 8 ranks: Linear3D and the seed's MLP

def dense_mlp(dim, seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))


def seed_mlp_on_cube(seed):
    """The seed's MLP (256 -> 1024 -> 256) on the cube and on one process, same weights and input."""
    cube = Cube()
    dense = dense_mlp(256, seed)
    first = Linear3D(256, 1024, cube=cube).load_dense(dense[0].weight.t(), dense[0].bias)
    second = Linear3D(1024, 256, cube=cube.swapped()).load_dense(dense[2].weight.t(), dense[2].bias)
    torch.manual_seed(seed + 1)
    x, dy = torch.randn(16, 256), torch.randn(16, 256)
    x_local = split_batch(x, cube).requires_grad_()
    with CommLog() as forward_log:
        h = first(x_local)
        y = second(nn.functional.gelu(h))
    with CommLog() as backward_log:
        y.backward(split_batch(dy, cube))
    x_full = x.clone().requires_grad_()
    y_dense = dense(x_full)
    y_dense.backward(dy)
    shapes = [tuple(t.shape) for t in (first.weight, second.weight, x_local, h, y)]
    ours = {"y": gather_batch(y.detach(), cube), "dx": gather_batch(x_local.grad, cube)}
    for name, layer in (("first", first), ("second", second)):
        ours[f"{name}.weight"] = gather_weight(layer.weight.grad, layer.cube)
        ours[f"{name}.bias"] = gather_bias(layer.bias.grad, layer.cube)
    reference = {"y": y_dense.detach(), "dx": x_full.grad,
                 "first.weight": dense[0].weight.grad.t(), "first.bias": dense[0].bias.grad,
                 "second.weight": dense[2].weight.grad.t(), "second.bias": dense[2].bias.grad}
    params = sum(p.numel() * p.element_size() for m in (first, second) for p in m.parameters())
    logs = [[(r.op, r.group_size, r.nbytes, r.wire_bytes) for r in log.records] for log in (forward_log, backward_log)]
    return shapes, ours, reference, params, logs


def gather_weight(block, cube):
    """The full [in, out] from every rank's A_lji block (test helper: all-gathers over the cube)."""
    q = cube.q
    blocks = [torch.empty_like(block) for _ in range(q**3)]
    dist.all_gather(blocks, block.contiguous())
    rows = [[None] * (q * q) for _ in range(q)]
    for rank, b in enumerate(blocks):
        c = dict(zip(("weight", "input", "output"), cube_coords(rank, q)))
        rows[c[cube.output_axis]][c[cube.input_axis] * q + c["weight"]] = b
    return torch.cat([torch.cat(r, dim=1) for r in rows], dim=0)


def gather_bias(shard, cube):
    """The full bias from every rank's shard: block input_axis of q, then the plane's q*q shards."""
    q = cube.q
    shards = [torch.empty_like(shard) for _ in range(q**3)]
    dist.all_gather(shards, shard.contiguous())
    full = [[None] * (q * q) for _ in range(q)]
    for rank, s in enumerate(shards):
        c = dict(zip(("weight", "input", "output"), cube_coords(rank, q)))
        full[c[cube.input_axis]][c["weight"] * q + c[cube.output_axis]] = s
    return torch.cat([torch.cat(r) for r in full])


@pytest.fixture(scope="module")
def seed_mlp_results():
    return parakit.launch(seed_mlp_on_cube, 7, world_size=8, timeout=240)


def test_seed_mlp_prints_the_seeds_weight_and_activation_shapes(seed_mlp_results):
    for shapes, *_ in seed_mlp_results:
        assert shapes == [(128, 256), (512, 64), (4, 128), (4, 512), (4, 128)]


def test_seed_mlp_equals_one_process_in_output_and_every_gradient(seed_mlp_results):
    for _, ours, reference, _, _ in seed_mlp_results:
        assert set(ours) == set(reference)
        for name in reference:
            torch.testing.assert_close(ours[name], reference[name], rtol=1e-5, atol=1e-5, msg=name)


def test_parameter_bytes_per_rank_are_one_eighth_of_dense(seed_mlp_results):
    dense = sum(p.numel() * 4 for p in dense_mlp(256, 0).parameters())
    assert [params for *_, params, _ in seed_mlp_results] == [dense // 8] * 8


def test_bytes_sent_equal_the_seeds_cost_table(seed_mlp_results):
    table = {**linear3d_cost(16, 256, 1024, 2)}
    second = linear3d_cost(16, 1024, 256, 2)
    for *_, (forward, backward) in seed_mlp_results:
        # per layer: all-gather X, all-gather A, reduce-scatter Y, then the bias's all-gather over a plane of 4
        ops = [(op, size) for op, size, _, _ in forward]
        assert ops == [("all_gather_single", 2), ("all_gather_single", 2), ("reduce_scatter_single", 2),
                       ("all_gather_single", 4)] * 2
        wire = [w for *_, w in forward]
        assert wire[:3] == [table["forward: all-gather X"], table["forward: all-gather A"],
                            table["forward: reduce-scatter Y"]] == [2048, 131072, 8192]
        assert wire[4:7] == [second["forward: all-gather X"], second["forward: all-gather A"],
                             second["forward: reduce-scatter Y"]] == [8192, 131072, 2048]
        assert (wire[3], wire[7]) == (3 * 1024 // 8 * 4, 3 * 256 // 8 * 4)  # bias: 3 shards of out/q^3 floats
        # backward: the second layer first, each: bias reduce-scatter, all-gather dY, reduce-scatter dX and dA
        wire_back = [w for *_, w in backward]
        assert [op for op, *_ in backward].count("reduce_scatter_single") == 6
        layer_bytes = sum(second[k] for k in second if k.startswith("backward")) + sum(
            table[k] for k in table if k.startswith("backward"))
        bias_bytes = 3 * (256 + 1024) // 8 * 4  # reduce-scatter of a [out/q] gradient over 4 ranks
        assert sum(wire_back) == layer_bytes + bias_bytes
    # six collectives, each (q-1)/q^3 of X, A or Y (every matrix twice): the seed's 6(q-1)/q^3
    assert sum(table.values()) == 2 * (2 - 1) * (16 * 256 + 256 * 1024 + 16 * 1024) * 4 // 2**3


# ---------------------------------------------------------------- a classifier with layer norm trains on the cube

def classifier_steps(seed, steps):
    cube = Cube()
    torch.manual_seed(seed)
    dense = nn.ModuleList([nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8)])
    x, target = torch.randn(8, 8), torch.randint(0, 8, (8,))
    hidden = Linear3D(8, 16, cube=cube).load_dense(dense[0].weight.t(), dense[0].bias)
    norm = LayerNorm3D(16, cube=cube.swapped()).load_dense(dense[1])
    head = ClassifierHead3D(16, 8, cube=cube.swapped())
    head.linear.load_dense(dense[2].weight.t(), dense[2].bias)
    ours = nn.ModuleList([hidden, norm, head])
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ours, dense)]
    losses = []
    for _ in range(steps):
        for opt in optimizers:
            opt.zero_grad()
        loss = head(torch.tanh(norm(hidden(split_batch(x, cube)))), target)
        loss.backward()
        dense_loss = nn.functional.cross_entropy(dense[2](torch.tanh(dense[1](dense[0](x)))), target)
        dense_loss.backward()
        for opt in optimizers:
            opt.step()
        losses.append((loss.item(), dense_loss.item()))
    return losses


def test_classifier_with_layer_norm_trains_like_one_process():
    for losses in parakit.launch(classifier_steps, 3, 4, world_size=8, timeout=240):
        ours, dense = zip(*losses)
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(dense), rtol=1e-5, atol=1e-5)
        assert dense[-1] < dense[0]


# ---------------------------------------------------------------- q = 1, and bad input

def one_rank_linear():
    cube = Cube()
    torch.manual_seed(0)
    dense = nn.Linear(6, 10)
    layer = Linear3D(6, 10, cube=cube).load_dense(dense.weight.t(), dense.bias)
    x = torch.randn(5, 6)
    with CommLog() as log:
        y = layer(split_batch(x, cube))
    return y, dense(x).detach(), log.wire_bytes()


def test_q1_is_a_plain_linear_that_sends_nothing():
    [(y, expected, wire)] = parakit.launch(one_rank_linear, world_size=1)
    torch.testing.assert_close(y, expected)
    assert wire == 0


def refuse_bad_sizes():
    try:
        Cube()
    except ValueError as error:
        return [str(error)]
    return []


def test_cube_on_two_ranks_names_the_world_size():
    assert parakit.launch(refuse_bad_sizes, world_size=2) == [
        ["world size 2 is not a cube: 3D tensor parallelism needs q**3 ranks (1, 8, 27, 64, ...)"]] * 2


def bad_shapes_on_cube():
    cube = Cube()
    tries = {"in": lambda: Linear3D(5, 16, cube=cube), "out": lambda: Linear3D(8, 6, cube=cube),
             "batch": lambda: split_batch(torch.zeros(6, 8), cube), "norm": lambda: LayerNorm3D(12, cube=cube)}
    messages = {}
    for name, make in tries.items():
        try:
            make()
        except ValueError as error:
            messages[name] = str(error)
    return messages


def test_sizes_not_divisible_by_q_or_q_squared_are_refused_by_name():
    [messages] = parakit.launch(bad_shapes_on_cube, world_size=8, timeout=240)[:1]
    assert messages == {
        "in": "in_features 5 is not divisible by 2 (q=2): 3D tensor parallelism splits it into 2 blocks; pick a multiple of 2",
        "out": "out_features 6 is not divisible by 4 (q=2): 3D tensor parallelism splits it into 4 blocks; pick a multiple of 4",
        "batch": "batch 6 is not divisible by 4 (q=2): 3D tensor parallelism splits it into 4 blocks; pick a multiple of 4",
        "norm": "features 12 is not divisible by 8 (q=2): 3D tensor parallelism splits it into 8 blocks; pick a multiple of 8",
    }
