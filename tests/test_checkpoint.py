"""parakit.checkpoint: gradients equal to no checkpointing and to torch.utils.checkpoint
(dropout on, random MLPs and a transformer block), the RNG restored, several inputs and
outputs, nested checkpoints; exact bytes that autograd saves with and without segments;
inside a pipeline stage on real ranks; clear errors."""
from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import parakit
from parakit import checkpoint as ck
from parakit.pipeline import pipeline_step


def mlp(n: int, hidden: int, seed: int, dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(hidden, hidden), nn.Dropout(dropout), nn.ReLU()) for _ in range(n)])


def run(forward, model, *inputs, seed=1):
    """Output, input gradients and parameter gradients of one step (dropout drawn from `seed`)."""
    model.zero_grad(set_to_none=True)
    inputs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    torch.manual_seed(seed)
    out = forward(*inputs)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return [out.detach(), *[x.grad for x in inputs if x.requires_grad], *[p.grad for p in model.parameters()]]


def assert_same(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


# ---------------------------------------------------------------- gradients

@pytest.mark.parametrize("seed", range(4))
def test_checkpoint_sequential_equals_no_checkpoint_and_torch_with_dropout_on_random_mlps(seed):
    rng = random.Random(seed)
    n, hidden, batch = rng.randint(2, 9), rng.randint(3, 33), rng.randint(1, 17)
    segments = rng.randint(1, n)
    model, x = mlp(n, hidden, seed, dropout=0.3), torch.randn(batch, hidden, requires_grad=True)
    expected = run(model, model, x)
    assert_same(run(lambda x: ck.checkpoint_sequential(model, segments, x), model, x), expected)
    assert_same(run(lambda x: torch_checkpoint.checkpoint_sequential(model, segments, x, use_reentrant=False), model, x),
                expected)
    assert_same(run(lambda x: ck.checkpoint_sequential(model, segments, x, keep=ck.MATMULS), model, x), expected)


def transformer_block(seed: int) -> nn.TransformerEncoderLayer:
    torch.manual_seed(seed)
    return nn.TransformerEncoderLayer(d_model=16, nhead=4, dim_feedforward=32, dropout=0.2, batch_first=True)


@pytest.mark.parametrize("keep", [(), ck.MATMULS], ids=["full", "selective"])
def test_checkpointed_transformer_block_equals_no_checkpoint_and_torch_with_dropout(keep):
    block, x = transformer_block(3), torch.randn(2, 5, 16, requires_grad=True)  # [batch, seq, hidden]
    expected = run(block, block, x)
    assert_same(run(lambda x: ck.checkpoint(block, x, keep=keep), block, x), expected)
    assert_same(run(lambda x: torch_checkpoint.checkpoint(block, x, use_reentrant=False), block, x), expected)


class WritesIntoMatmul(nn.Module):
    """Linear layers whose matmul outputs are then changed in place (a bias and an
    activation added into them, as fused kernels do)."""

    def __init__(self, hidden: int):
        super().__init__()
        torch.manual_seed(5)
        self.first, self.second = nn.Parameter(torch.randn(hidden, hidden)), nn.Parameter(torch.randn(hidden, hidden))

    def forward(self, x):
        h = x @ self.first
        h.add_(1.0).view(-1)[::2].mul_(2.0)  # through a view too
        y = torch.sin(h) @ self.second
        return y.relu_()


def test_selective_checkpoint_replays_kept_outputs_as_they_were_before_fn_wrote_into_them():
    block, x = WritesIntoMatmul(6), torch.randn(3, 6, requires_grad=True)
    expected = run(block, block, x)
    assert_same(run(lambda x: ck.checkpoint(block, x, keep=ck.MATMULS), block, x), expected)
    block.zero_grad(set_to_none=True)
    out = ck.checkpoint(block, x, keep=ck.MATMULS)
    for _ in range(2):  # a second backward replays the same record
        out.sum().backward(retain_graph=True)
    torch.testing.assert_close(block.first.grad, 2 * torch.autograd.grad(block(x).sum(), block.first)[0])


def test_dropout_mask_differs_without_rng_restore_and_global_rng_advances_as_without_checkpoint():
    model, x = mlp(3, 8, 0, dropout=0.5), torch.randn(4, 8, requires_grad=True)
    expected = run(model, model, x)
    after_plain = torch.rand(3)  # the RNG right after a plain step (seed 1)
    restored = run(lambda x: ck.checkpoint(model, x), model, x)
    assert torch.equal(torch.rand(3), after_plain)
    assert_same(restored, expected)
    not_restored = run(lambda x: ck.checkpoint(model, x, preserve_rng_state=False), model, x)
    assert not torch.equal(not_restored[1], expected[1])


def test_parameters_get_gradients_when_no_input_requires_grad():
    model, x = mlp(3, 8, 1), torch.randn(4, 8)
    assert_same(run(lambda x: ck.checkpoint(model, x), model, x), run(model, model, x))


def test_several_inputs_outputs_and_non_tensor_arguments():
    linear = nn.Linear(6, 6)

    def fn(a, scale, b, mask):  # b does not require grad, scale is a float, mask is an int tensor
        h = linear(a) * scale + b
        return h.relu(), (h * mask).sum(-1), mask + 1

    a, b, mask = torch.randn(3, 6, requires_grad=True), torch.randn(3, 6), torch.randint(0, 2, (3, 6))

    def step(forward):
        linear.zero_grad(set_to_none=True)
        a.grad = None
        first, second, third = forward(a, 0.5, b, mask)
        (first.square().sum() + second.sum()).backward()
        return [first, second, third, a.grad, linear.weight.grad, linear.bias.grad]

    expected = step(fn)
    got = step(lambda *args: ck.checkpoint(fn, *args))
    assert_same(got, expected)
    assert not got[2].requires_grad and got[2].dtype == torch.int64


def test_nested_checkpoints_equal_no_checkpoint():
    model, x = mlp(6, 8, 2, dropout=0.2), torch.randn(5, 8, requires_grad=True)

    def nested(x):
        inner = lambda h: ck.checkpoint(model[2:4], ck.checkpoint(model[1], h))
        return model[5](ck.checkpoint(lambda h: model[4](inner(h)), model[0](x)))

    expected = run(model, model, x)
    assert_same(run(nested, model, x), expected)
    assert_same(run(lambda x: ck.checkpoint(nested, x), model, x), expected)


# ---------------------------------------------------------------- bytes saved, exactly

N, BATCH, HIDDEN = 16, 8, 32
UNIT = BATCH * HIDDEN * 4  # one [batch, hidden] float32 activation


def measured(segments=None, keep=()):
    model, x = mlp(N, HIDDEN, 0), torch.randn(BATCH, HIDDEN)
    forward = model if segments is None else lambda x: ck.checkpoint_sequential(model, segments, x, keep=keep)
    return ck.saved_bytes(forward, x, parameters=model.parameters())


def test_unchecked_mlp_saves_its_input_and_every_relu_output_and_weights_apart():
    saved = measured()
    assert (saved.forward, saved.peak) == ((N + 1) * UNIT, (N + 1) * UNIT)
    assert saved.parameters == (N - 1) * HIDDEN * HIDDEN * 4  # the first layer's weight is not needed: x needs no grad


@pytest.mark.parametrize("segments", [1, 2, 3, 4, 5, 8, 16])
def test_segments_keep_one_input_each_and_peak_at_k_plus_one_segment(segments):
    saved = measured(segments)
    assert saved.forward == segments * UNIT
    assert saved.peak == ck.peak_units(N, segments) * UNIT
    assert saved.parameters == measured().parameters


def test_bar_sixteen_layers_four_segments_save_at_most_035_and_peak_at_most_two_over_sqrt_n():
    plain, four = measured(), measured(4)
    assert four.forward / plain.forward == 4 / 17 <= 0.35
    assert four.peak / plain.peak == 8 / 17 <= 2 / math.sqrt(N)


def test_selective_checkpoint_also_keeps_every_matmul_output():
    assert measured(4, keep=ck.MATMULS).forward == (4 + N) * UNIT


def test_torch_checkpoint_sequential_leaves_its_last_segment_unchecked():
    model, x = mlp(N, HIDDEN, 0), torch.randn(BATCH, HIDDEN)
    saved = ck.saved_bytes(lambda x: torch_checkpoint.checkpoint_sequential(model, 4, x, use_reentrant=False), x,
                           parameters=model.parameters())
    assert saved.forward == (3 + 1 + 4) * UNIT  # three segment inputs, then the last segment's input and 4 outputs


def test_one_checkpointed_block_saves_exactly_its_inputs():
    block, x = transformer_block(0), torch.randn(2, 5, 16, requires_grad=True)
    mask = torch.zeros(5, 5)
    saved = ck.saved_bytes(lambda x, mask: ck.checkpoint(block, x, mask), x, mask, parameters=block.parameters())
    assert saved.forward == x.numel() * 4 + mask.numel() * 4
    assert ck.saved_bytes(block, x, parameters=block.parameters()).forward > 10 * saved.forward


def test_segment_arithmetic():
    assert ck.segment_sizes(10, 4) == [3, 3, 2, 2]
    assert ck.segment_sizes(16, 16) == [1] * 16
    assert [ck.peak_units(16, k) for k in (1, 2, 3, 4, 5, 8, 16)] == [17, 10, 8, 8, 8, 10, 17]
    for n in range(1, 200):
        best = ck.best_segments(n)
        assert ck.peak_units(n, best) == min(ck.peak_units(n, k) for k in range(1, n + 1))
        assert ck.peak_units(n, best) <= 2 * math.sqrt(n) + 1 and abs(best - math.sqrt(n)) <= math.sqrt(n) / 2 + 1


# ---------------------------------------------------------------- inside a pipeline stage

def stage_peak(model, x, y, checkpointed):
    """Peak saved bytes of this rank in one GPipe step (4 micro-batches), and its gradients."""
    stages = [ck.Checkpointed(model[:4]), ck.Checkpointed(model[4:])] if checkpointed else [model[:4], model[4:]]
    with ck.counting_saved(model.parameters()) as ledger:
        pipeline_step(nn.Sequential(*stages), [1, 1], x, y, F.mse_loss, schedule="gpipe", num_microbatches=4)
    return ledger.peak, [p.grad for p in model.parameters()]


def test_checkpointed_stages_in_a_gpipe_pipeline_keep_one_input_per_microbatch_and_same_gradients():
    model, x, y = mlp(8, HIDDEN, 4), torch.randn(4 * BATCH, HIDDEN), torch.randn(4 * BATCH, HIDDEN)
    plain = mlp(8, HIDDEN, 4)
    F.mse_loss(plain(x), y).backward()
    # In units of one micro-batch activation. Rank 0: x (the micro-batches are views of it, 4 units) and 4 ReLU
    # outputs per micro-batch, or the recomputation of one micro-batch. Rank 1: 4 received inputs, 4 ReLU outputs
    # per micro-batch (the last one also saved by the loss), y (4 units); checkpointed, when the last micro-batch
    # is recomputed: its 4 inputs, y, the outputs of the 3 other micro-batches (saved by their losses) and 4.
    expected = {False: [4 + 16, 4 + 16 + 4], True: [4 + 4, 4 + 4 + 3 + 4]}
    for checkpointed in (False, True):
        results = parakit.launch(stage_peak, model, x, y, checkpointed, world_size=2)
        assert [peak for peak, _ in results] == [units * UNIT for units in expected[checkpointed]]
        for rank, (_, grads) in enumerate(results):
            assert_same(grads[8 * rank:8 * rank + 8], [p.grad for p in plain.parameters()][8 * rank:8 * rank + 8])


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("segments", [0, 17])
def test_segments_out_of_range_say_what_to_choose(segments):
    with pytest.raises(ValueError, match=f"segments={segments} for 16 functions: choose 1 <= segments <= 16"):
        ck.checkpoint_sequential(mlp(16, 4, 0), segments, torch.randn(2, 4))


def test_function_returning_a_non_tensor_is_refused():
    with pytest.raises(TypeError, match="returned list: it must return a tensor or a tuple of tensors"):
        ck.checkpoint(lambda x: [x * 2], torch.randn(3, requires_grad=True))
    with pytest.raises(TypeError, match=r"function 1 \(function\) returned float: each function of checkpoint_sequential"):
        ck.checkpoint_sequential([torch.sin, lambda x: 1.0, torch.cos], 2, torch.randn(3))
