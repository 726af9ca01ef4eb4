"""parakit.tensor_parallel on real ranks (gloo on CPU), at tensor-parallel sizes 1, 2 and 4:
the conjugate operators' forward and backward; column- and row-parallel layers, the MLP,
self-attention (against nn.MultiheadAttention) and a transformer block equal to the dense
layers in outputs and every gradient; the exact collectives each costs (CommLog); parameter
bytes per rank; vocab-parallel embedding and cross-entropy against nn.Embedding and
F.cross_entropy; the RNG tracker; a tiny language model trained with t ranks equal to one
process; the same MLP as torch's ColwiseParallel/RowwiseParallel; errors for bad sizes.

Each launch checks several things inside the ranks (assert_close there; a failure comes
back as the rank's traceback)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import parakit
from parakit.tensor_parallel import (ColumnParallelLinear, ParallelMLP, ParallelSelfAttention, ParallelTransformerBlock,
                                     RNGTracker, RowParallelLinear, VocabParallelEmbedding, copy_to_region,
                                     gather_from_region, reduce_from_region, scatter_to_region,
                                     vocab_parallel_cross_entropy)

SIZES = [1, 2, 4]


def _counts(fn):
    """(result, {op: count}) of fn() under a CommLog."""
    with parakit.CommLog() as log:
        result = fn()
    return result, {op: log.count(op) for op in {r.op for r in log.records}}


def _close(got, expected, what):
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------- f, g, scatter, gather

def _draw(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _conjugates():
    """Each operator on inputs every rank can recompute for every other rank: rank k's x is
    _draw(k, ...), a tensor the same on all ranks is _draw(-1, ...), rank k's upstream
    gradient _draw(100 + k, ...)."""
    import torch.distributed as dist
    t, r = dist.get_world_size(), dist.get_rank()
    d = 4 * t
    mine, same, grad = (lambda k, *s: _draw(k, *s)), (lambda *s: _draw(-1, *s)), (lambda k, *s: _draw(100 + k, *s))
    ranks = range(t)
    cases = {  # name: (operator, x, upstream gradient, forward, dL/dx, forward ops, backward ops)
        "f": (copy_to_region, mine(r, 3, d), grad(r, 3, d), mine(r, 3, d), sum(grad(k, 3, d) for k in ranks),
              {}, {"all_reduce": 1}),
        "g": (reduce_from_region, mine(r, 3, d), grad(r, 3, d), sum(mine(k, 3, d) for k in ranks), grad(r, 3, d),
              {"all_reduce": 1}, {}),
        "scatter": (scatter_to_region, same(3, d), grad(r, 3, 4), same(3, d).chunk(t, -1)[r],
                    torch.cat([grad(k, 3, 4) for k in ranks], -1), {}, {"all_gather_single": 1}),
        "gather": (gather_from_region, mine(r, 3, 4), same(3, d), torch.cat([mine(k, 3, 4) for k in ranks], -1),
                   same(3, d).chunk(t, -1)[r], {"all_gather_single": 1}, {}),
    }
    for name, (op, x, dy, want_y, want_dx, fwd_ops, bwd_ops) in cases.items():
        x.requires_grad_()
        y, fwd = _counts(lambda: op(x))
        _, bwd = _counts(lambda: y.backward(dy))
        _close(y, want_y, f"{name} forward")
        _close(x.grad, want_dx, f"{name} backward")
        assert (fwd, bwd) == ((fwd_ops, bwd_ops) if t > 1 else ({}, {})), (name, fwd, bwd)


@pytest.mark.parametrize("t", SIZES)
def test_conjugate_operators_forward_backward_and_their_collectives(t):
    parakit.launch(_conjugates, world_size=t)


# ---------------------------------------------------------------- linear layers, MLP, parameter bytes

LINEAR_OPS = {  # (kind, gather_output or input_is_parallel): (forward, backward) collectives
    ("column", False): ({}, {"all_reduce": 1}),  # f: dL/dx summed
    ("column", True): ({"all_gather_single": 1}, {"all_reduce": 1}),  # and the output gathered
    ("row", True): ({"all_reduce": 1}, {}),  # g: the output summed
    ("row", False): ({"all_reduce": 1}, {"all_gather_single": 1}),  # and dL/dx of the kept chunk gathered
}


def _linears():
    import torch.distributed as dist
    t, r = dist.get_world_size(), dist.get_rank()
    for bias in (True, False):
        for flag in (False, True):
            for kind, cls, kwargs, dim in (("column", ColumnParallelLinear, {"gather_output": flag}, 0),
                                           ("row", RowParallelLinear, {"input_is_parallel": flag}, 1)):
                torch.manual_seed(bias + 2 * flag)
                layer = cls(8, 12, bias=bias, **kwargs)
                torch.manual_seed(bias + 2 * flag)
                dense = nn.Linear(8, 12, bias=bias)
                what = f"{kind} bias={bias} {kwargs}"
                _close(layer.weight, dense.weight.chunk(t, dim)[r], f"{what}: initial weight")
                x = _draw(5, 2, 3, 8).requires_grad_()
                x_in = x.chunk(t, -1)[r] if kind == "row" and flag else x  # [2, 3, 8/t] when parallel
                y, fwd = _counts(lambda: layer(x_in))
                y_full = gather_from_region(y) if kind == "column" and not flag else y  # [2, 3, 12]
                _, bwd = _counts(lambda: y_full.backward(_draw(6, 2, 3, 12)))
                assert (fwd, bwd) == (LINEAR_OPS[kind, flag] if t > 1 else ({}, {})), (what, fwd, bwd)
                x_ref = x.detach().clone().requires_grad_()
                dense(x_ref).backward(_draw(6, 2, 3, 12))
                _close(y_full, dense(x_ref), f"{what}: output")
                mine = (lambda g: g.chunk(t, -1)[r]) if kind == "row" and flag else (lambda g: g)  # x's slice in use
                _close(mine(x.grad), mine(x_ref.grad), f"{what}: dL/dx")
                _close(layer.weight.grad, dense.weight.grad.chunk(t, dim)[r], f"{what}: dL/dweight")
                if bias:
                    want = dense.bias.grad.chunk(t)[r] if kind == "column" else dense.bias.grad
                    _close(layer.bias.grad, want, f"{what}: dL/dbias")


@pytest.mark.parametrize("t", SIZES)
def test_column_and_row_linear_equal_dense_linear_and_send_exactly_their_collectives(t):
    parakit.launch(_linears, world_size=t)


def _mlp(group_ranks):
    """ParallelMLP on `group_ranks` (one tp group per block of that many ranks) against the
    dense Linear-GELU-Linear; returns (forward ops, backward ops, bytes, parameter bytes)."""
    import torch.distributed as dist
    world, me = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(s, s + group_ranks))) for s in range(0, world, group_ranks)]
    group = groups[me // group_ranks]
    t, r = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(3)
    mlp = ParallelMLP(8, 24, group=group)
    torch.manual_seed(3)
    fc1, fc2 = nn.Linear(8, 24), nn.Linear(24, 8)
    x = _draw(me // group_ranks, 4, 5, 8).requires_grad_()  # the same within a group, different across groups
    x_ref = x.detach().clone().requires_grad_()
    with parakit.CommLog() as fwd:
        y = mlp(x)
    with parakit.CommLog() as bwd:
        y.backward(_draw(9, 4, 5, 8))
    y_ref = fc2(F.gelu(fc1(x_ref)))
    y_ref.backward(_draw(9, 4, 5, 8))
    _close(y, y_ref, "output")
    _close(x.grad, x_ref.grad, "dL/dx")
    for (name, got), want in zip(mlp.named_parameters(), (fc1.weight.grad.chunk(t)[r], fc1.bias.grad.chunk(t)[r],
                                                         fc2.weight.grad.chunk(t, 1)[r], fc2.bias.grad)):
        _close(got.grad, want, f"dL/d{name}")
    assert all(rec.group_size == t for rec in fwd.records + bwd.records)
    param_bytes = sum(p.numel() * p.element_size() for p in mlp.parameters())
    return fwd.count("all_reduce"), fwd.count(), bwd.count("all_reduce"), bwd.count(), fwd.nbytes(), param_bytes


@pytest.mark.parametrize("t", SIZES)
def test_parallel_mlp_equals_dense_with_one_all_reduce_forward_and_one_backward(t):
    for fwd_all_reduce, fwd_all, bwd_all_reduce, bwd_all, nbytes, _ in parakit.launch(_mlp, t, world_size=t):
        busy = int(t > 1)
        assert (fwd_all_reduce, fwd_all, bwd_all_reduce, bwd_all) == (busy, busy, busy, busy)
        assert nbytes == busy * 4 * 5 * 8 * 4  # the [4, 5, 8] float32 output, once


def test_parallel_mlp_parameter_bytes_per_rank_are_dense_over_t_plus_the_row_bias():
    dense = (8 * 24 + 24 + 24 * 8 + 8) * 4
    for t in (2, 4):
        *_, param_bytes = parakit.launch(_mlp, t, world_size=t)[0]
        assert param_bytes == (dense - 8 * 4) // t + 8 * 4  # everything split t ways but fc2's bias [8]


def test_parallel_mlp_on_two_tensor_parallel_groups_of_a_four_rank_world():
    for counts in parakit.launch(_mlp, 2, world_size=4):  # groups {0, 1} and {2, 3}, different inputs
        assert counts[:4] == (1, 1, 1, 1)


# ---------------------------------------------------------------- attention and the block against torch's dense layers

def _to_mha_layout(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """Our fused qkv rows run (head, q/k/v, head_dim); nn.MultiheadAttention's (q/k/v, head, head_dim)."""
    return qkv.unflatten(0, (heads, 3, -1)).transpose(0, 1).flatten(0, 2)


def _from_mha_layout(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    return qkv.unflatten(0, (3, heads, -1)).transpose(0, 1).flatten(0, 2)


class DenseBlock(nn.Module):
    """The same pre-norm block from torch's dense layers, nn.MultiheadAttention inside."""

    def __init__(self, parallel_full: dict[str, torch.Tensor], hidden: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
        with torch.no_grad():
            self.attn.in_proj_weight.copy_(_to_mha_layout(parallel_full["attn.qkv.weight"], heads))
            self.attn.in_proj_bias.copy_(_to_mha_layout(parallel_full["attn.qkv.bias"], heads))
            self.attn.out_proj.weight.copy_(parallel_full["attn.proj.weight"])
            self.attn.out_proj.bias.copy_(parallel_full["attn.proj.bias"])
            for name in ("fc1", "fc2"):
                getattr(self, name).weight.copy_(parallel_full[f"mlp.{name}.weight"])
                getattr(self, name).bias.copy_(parallel_full[f"mlp.{name}.bias"])

    def forward(self, x):
        s = x.shape[1]
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)  # True: may not attend
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def _full(name: str, value: torch.Tensor, t: int) -> torch.Tensor:
    """The dense tensor of a parameter (or gradient) from every rank's slice: all-gathered
    along out (column layers) or in (row layers), as is for the replicated ones."""
    import torch.distributed as dist
    if t == 1 or name.endswith("proj.bias") or name.endswith("fc2.bias") or "norm" in name:
        return value
    dim = 1 if name.endswith("proj.weight") or name.endswith("fc2.weight") else 0
    pieces = [torch.empty_like(value) for _ in range(t)]
    dist.all_gather(pieces, value.contiguous())
    return torch.cat(pieces, dim)


def _block(heads):
    import torch.distributed as dist
    t = dist.get_world_size()
    torch.manual_seed(0)
    block = ParallelTransformerBlock(16, heads, ffn_hidden=32)
    full = {n: _full(n, p.detach(), t) for n, p in block.named_parameters()}
    dense = DenseBlock(full, 16, heads, 32)
    x = _draw(1, 2, 6, 16).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    with parakit.CommLog() as fwd:
        y = block(x)
    with parakit.CommLog() as bwd:
        y.backward(_draw(2, 2, 6, 16))
    y_ref = dense(x_ref)
    y_ref.backward(_draw(2, 2, 6, 16))
    _close(y, y_ref, "block output")
    _close(x.grad, x_ref.grad, "block dL/dx")
    dense_grads = {"attn.qkv.weight": _from_mha_layout(dense.attn.in_proj_weight.grad, heads),
                   "attn.qkv.bias": _from_mha_layout(dense.attn.in_proj_bias.grad, heads),
                   "attn.proj.weight": dense.attn.out_proj.weight.grad, "attn.proj.bias": dense.attn.out_proj.bias.grad,
                   **{n: p.grad for n, p in dense.named_parameters() if not n.startswith("attn.")}}
    dense_grads = {n.replace("fc", "mlp.fc") if n.startswith("fc") else n: g for n, g in dense_grads.items()}
    for name, p in block.named_parameters():
        _close(_full(name, p.grad, t), dense_grads[name], f"block dL/d{name}")
    return fwd.count("all_reduce"), fwd.count(), bwd.count("all_reduce"), bwd.count()


@pytest.mark.parametrize("t", SIZES)
def test_transformer_block_equals_dense_block_with_multihead_attention(t):
    busy = int(t > 1)
    for counts in parakit.launch(_block, 4, world_size=t):
        assert counts == (2 * busy,) * 4  # attention and MLP: one all-reduce each, forward and backward


# ---------------------------------------------------------------- the vocabulary split across ranks

def _vocab():
    import torch.distributed as dist
    t, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(4)
    embedding = VocabParallelEmbedding(12, 5)
    torch.manual_seed(4)
    dense = nn.Embedding(12, 5)
    ids = torch.randint(0, 12, (3, 7), generator=torch.Generator().manual_seed(8))
    out, fwd = _counts(lambda: embedding(ids))
    _, bwd = _counts(lambda: out.backward(_draw(3, 3, 7, 5)))
    want = dense(ids)
    want.backward(_draw(3, 3, 7, 5))
    _close(out, want, "embedding output")
    _close(embedding.weight.grad, dense.weight.grad.chunk(t)[r], "embedding dL/dweight")
    assert (fwd, bwd) == (({"all_reduce": 1}, {}) if t > 1 else ({}, {}))

    logits = _draw(5, 3, 7, 12).requires_grad_()
    mine = logits.detach().chunk(t, -1)[r].clone().requires_grad_()  # [3, 7, 12/t]
    for reduction in ("mean", "sum", "none"):
        mine.grad = logits.grad = None
        loss, fwd = _counts(lambda: vocab_parallel_cross_entropy(mine, ids, reduction=reduction))
        _, bwd = _counts(lambda: loss.backward(torch.ones_like(loss)))
        want = F.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction=reduction)
        want.backward(torch.ones_like(want))
        _close(loss, want.view_as(loss), f"cross-entropy ({reduction})")
        _close(mine.grad, logits.grad.chunk(t, -1)[r], f"cross-entropy dL/dlogits ({reduction})")
        assert (fwd, bwd) == (({"all_reduce": 2}, {}) if t > 1 else ({}, {}))
    big = _draw(6, 4, 12) * 1e4  # a softmax that overflows without the max
    loss = vocab_parallel_cross_entropy(big.chunk(t, -1)[r], ids[0, :4])
    _close(loss, F.cross_entropy(big, ids[0, :4]), "cross-entropy of large logits")


@pytest.mark.parametrize("t", SIZES)
def test_vocab_parallel_embedding_and_cross_entropy_equal_torch(t):
    parakit.launch(_vocab, world_size=t)


# ---------------------------------------------------------------- random numbers inside and outside regions

def _rng():
    import torch.distributed as dist
    torch.manual_seed(0)
    tracker = RNGTracker(seed=0)
    before = torch.get_rng_state()
    with tracker.fork():
        inside = F.dropout(torch.ones(64), 0.5)
    untouched = torch.equal(torch.get_rng_state(), before)
    outside = F.dropout(torch.ones(64), 0.5)
    with tracker.fork():
        inside_again = F.dropout(torch.ones(64), 0.5)
    masks = [torch.empty(3, 64) for _ in range(dist.get_world_size())]
    dist.all_gather(masks, torch.stack([inside, outside, inside_again]))
    return untouched, torch.stack(masks)  # [ranks, 3, 64]


def test_rng_tracker_draws_per_rank_inside_regions_and_alike_outside():
    results = parakit.launch(_rng, world_size=2)
    assert all(untouched for untouched, _ in results)
    masks = results[0][1]  # [rank, (inside, outside, inside again), 64]
    assert not torch.equal(masks[0, 0], masks[1, 0])  # inside: each rank its own mask
    assert torch.equal(masks[0, 1], masks[1, 1])  # outside: the same mask everywhere
    assert not torch.equal(masks[0, 0], masks[0, 2])  # the tracker's stream moves on


def _dropout_block():
    torch.manual_seed(0)
    block = ParallelTransformerBlock(16, 4, dropout=0.5, rng=RNGTracker(seed=0))
    x = _draw(1, 2, 6, 16)
    return block(x), block(x), block.eval()(x)


def test_block_with_dropout_gives_the_same_output_on_every_rank():
    results = parakit.launch(_dropout_block, world_size=2)
    for a, b in zip(results[0], results[1]):
        torch.testing.assert_close(a, b)  # the row layers' all-reduce and the shared residual mask
    assert not torch.allclose(results[0][0], results[0][1])  # two draws differ


# ---------------------------------------------------------------- a tiny language model trained on t ranks

class TinyLM(nn.Module):
    """Vocab-parallel embedding, parallel blocks, a column-parallel head and the
    vocab-parallel loss: the logits are never gathered."""

    def __init__(self, vocab=16, seq=8, hidden=16, heads=4, layers=2):
        super().__init__()
        self.tokens, self.position = VocabParallelEmbedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.Sequential(*(ParallelTransformerBlock(hidden, heads) for _ in range(layers)))
        self.norm, self.head = nn.LayerNorm(hidden), ColumnParallelLinear(hidden, vocab, bias=False)

    def forward(self, ids, target):
        x = self.tokens(ids) + self.position(torch.arange(ids.shape[1]))  # [batch, seq, hidden]
        return vocab_parallel_cross_entropy(self.head(self.norm(self.blocks(x))), target)  # logits [.., vocab/t]


def _train_lm(steps):
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        tokens = torch.randint(0, 16, (4, 9), generator=torch.Generator().manual_seed(step))
        loss = model(tokens[:, :-1], tokens[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_tiny_language_model_trains_on_2_and_4_ranks_as_on_one_process():
    one = parakit.launch(_train_lm, 4, world_size=1)[0]
    assert one[-1] < one[0]
    for t in (2, 4):
        for losses in parakit.launch(_train_lm, 4, world_size=t):
            assert losses == pytest.approx(one, rel=1e-5, abs=1e-5), (t, losses, one)


# ---------------------------------------------------------------- torch.distributed.tensor.parallel

def _against_torch():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    torch.manual_seed(2)
    ours = ParallelMLP(8, 24)
    torch.manual_seed(2)
    theirs = parallelize_module(nn.Sequential(nn.Linear(8, 24), nn.GELU(), nn.Linear(24, 8)),
                                init_device_mesh("cpu", (dist.get_world_size(),)),
                                {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = _draw(1, 4, 5, 8).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = ours(x), theirs(x_ref)
    y.backward(_draw(2, 4, 5, 8))
    y_ref.backward(_draw(2, 4, 5, 8))
    _close(y, y_ref, "output")
    _close(x.grad, x_ref.grad, "dL/dx")
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        _close(p, q.to_local(), f"{name} (torch's shard)")
        _close(p.grad, q.grad.to_local(), f"dL/d{name} (torch's shard)")


def test_parallel_mlp_equals_torch_colwise_rowwise_parallel_on_gloo():
    parakit.launch(_against_torch, world_size=2)


# ---------------------------------------------------------------- bad input

def _errors():
    attempts = {
        "column": lambda: ColumnParallelLinear(8, 10),
        "row": lambda: RowParallelLinear(6, 8),
        "heads": lambda: ParallelSelfAttention(12, 6),
        "hidden": lambda: ParallelSelfAttention(12, 8),
        "vocab": lambda: VocabParallelEmbedding(10, 4),
        "column input": lambda: ColumnParallelLinear(8, 8)(torch.ones(2, 7)),
        "row input": lambda: RowParallelLinear(8, 8)(torch.ones(2, 8)),
        "row full input": lambda: RowParallelLinear(8, 8, input_is_parallel=False)(torch.ones(2, 4)),
        "dropout": lambda: ParallelSelfAttention(16, 4, dropout=0.1),
        "target": lambda: vocab_parallel_cross_entropy(torch.ones(2, 4), torch.tensor([0, 16])),
        "id too large": lambda: VocabParallelEmbedding(16, 4)(torch.tensor([[3, 15], [16, 2]])),
        "negative id": lambda: VocabParallelEmbedding(16, 4)(torch.tensor([5, -1])),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
        except ValueError as error:
            messages[name] = str(error)
    return messages


def test_bad_sizes_and_ids_raise_errors_that_name_them():
    messages = parakit.launch(_errors, world_size=4)[0]
    expected = {
        "column": "ColumnParallelLinear: out_features=10 is not divisible by the tensor-parallel size 4",
        "row": "RowParallelLinear: in_features=6 is not divisible by the tensor-parallel size 4",
        "heads": "ParallelSelfAttention: heads=6 is not divisible by the tensor-parallel size 4",
        "hidden": "ParallelSelfAttention: hidden=12 is not divisible by heads=8",
        "vocab": "VocabParallelEmbedding: num_embeddings=10 is not divisible by the tensor-parallel size 4",
        "column input": "ColumnParallelLinear: the input's last dimension is 7 but this rank expects 8 (in_features)",
        "row input": "RowParallelLinear: the input's last dimension is 8 but this rank expects 2 (in_features/t = 8/4",
        "row full input": "RowParallelLinear: the input's last dimension is 4 but this rank expects 8 (in_features,",
        "dropout": "needs rng=RNGTracker(seed, group)",
        "target": "target ids must lie in [0, 16) (vocab/t = 4 on each of 4 ranks); got 0..16",
        "id too large": "VocabParallelEmbedding: id 16 is outside the vocabulary of 16: ids must lie in [0, 16)",
        "negative id": "VocabParallelEmbedding: id -1 is outside the vocabulary of 16: ids must lie in [0, 16)",
    }
    assert set(messages) == set(expected)
    for name, text in expected.items():
        assert text in messages[name], (name, messages[name])
    assert parakit.launch(lambda: 1, world_size=4) == [1] * 4  # the ranks are still usable


# ---------------------------------------------------------------- sequence parallelism (stretch)

def _sequence_parallel():
    import torch.distributed as dist
    t, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(5)
    norm, mlp = nn.LayerNorm(8), ParallelMLP(8, 16, sequence_parallel=True)
    torch.manual_seed(5)
    norm_ref, fc1, fc2 = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)
    x, dy = _draw(1, 2, 4 * t, 8), _draw(2, 2, 4 * t, 8)  # [batch, seq, hidden], the same on every rank
    mine = x.chunk(t, 1)[r].clone().requires_grad_()  # [batch, seq/t, hidden]
    with parakit.CommLog() as fwd:
        y = mlp(norm(mine))
    with parakit.CommLog() as bwd:
        y.backward(dy.chunk(t, 1)[r])
    x_ref = x.clone().requires_grad_()
    y_ref = fc2(F.gelu(fc1(norm_ref(x_ref))))
    y_ref.backward(dy)
    _close(y, y_ref.chunk(t, 1)[r], "sequence-parallel output slice")
    _close(mine.grad, x_ref.grad.chunk(t, 1)[r], "sequence-parallel dL/dx slice")
    _close(mlp.fc1.weight.grad, fc1.weight.grad.chunk(t)[r], "dL/dfc1.weight")
    _close(mlp.fc2.weight.grad, fc2.weight.grad.chunk(t, 1)[r], "dL/dfc2.weight")
    for got, want in ((mlp.fc2.bias.grad, fc2.bias.grad), (norm.weight.grad, norm_ref.weight.grad)):
        dist.all_reduce(got)  # replicated parameters in the sequence region: partial over this slice
        _close(got, want, "replicated parameter's gradient summed over the slices")
    ops = lambda log: sorted(rec.op for rec in log.records)
    return ops(fwd), ops(bwd), fwd.wire_bytes(), bwd.wire_bytes()


@pytest.mark.parametrize("t", [2, 4])
def test_sequence_parallel_mlp_equals_dense_and_sends_the_bytes_of_an_all_reduce(t):
    full = 2 * 4 * t * 8 * 4  # the [2, 4t, 8] float32 activations
    for fwd, bwd, fwd_bytes, bwd_bytes in parakit.launch(_sequence_parallel, world_size=t):
        assert fwd == bwd == ["all_gather_single", "reduce_scatter_single"]
        assert fwd_bytes == bwd_bytes == 2 * (t - 1) * full // t
