"""parakit.context_parallel (ring attention) and parakit.ulysses on real ranks (gloo on CPU) at
sizes 2 and 4: values and the gradients of q, k, v equal F.scaled_dot_product_attention on the
whole sequence in one process (causal and not, contiguous and zig-zag, random shapes); the
ring talks only to its neighbours and sends the bytes of the formula; Ulysses makes four
all-to-alls each way; the attention block stores 1/n of one rank's activations; zig-zag
balances causal work; bad sizes are refused with the sizes named. The ring's public backward,
from the forward's out and lse, equals autograd of one process at 1 and 3 ranks, and one
block's backward is autograd of that block. On GPUs: equal to PyTorch's own context_parallel."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import parakit
from p2p_order import assert_nccl_can_run, recording, run_emulated
from parakit import context_parallel as cp
from parakit import ulysses
from parakit.checkpoint import saved_bytes

CASES = list(itertools.product((False, True), cp.LAYOUTS))  # (causal, layout)


def _shape(g: torch.Generator, n: int) -> tuple[int, int, int, int]:
    """[batch, heads, seq, head_dim] with seq a multiple of 2n and heads of n."""
    pick = lambda lo, hi: int(torch.randint(lo, hi, (), generator=g))
    return pick(1, 3), n * pick(1, 3), 2 * n * pick(1, 5), pick(2, 9)


def _against_sdpa(seed: int):
    """Every case on a fresh random shape: ring attention (and Ulysses, contiguous) on this
    rank's part against SDPA on the whole sequence; returns the traffic per case."""
    import torch.distributed as dist
    n, r = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(seed)
    traffic = []
    for causal, layout in CASES:
        shape = _shape(g, n)
        q, k, v, dy = (torch.randn(shape, generator=g) for _ in range(4))
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = F.scaled_dot_product_attention(*whole, is_causal=causal)
        expected.backward(dy)
        part = lambda t: cp.shard_sequence(t, n, r, layout)
        mine = [part(t).requires_grad_() for t in (q, k, v)]
        with parakit.CommLog() as forward:
            out = cp.ring_attention(*mine, causal=causal, layout=layout)
        with parakit.CommLog() as backward:
            out.backward(part(dy))
        close = lambda a, b, what: torch.testing.assert_close(
            a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what} (causal={causal}, {layout}, {shape}): {m}")
        close(out, part(expected), "ring output")
        for name, got, want in zip("qkv", mine, whole):
            close(got.grad, part(want.grad), f"ring dL/d{name}")
        traffic.append(((causal, layout, shape), [(rec.op, rec.peer, rec.nbytes) for rec in forward.records],
                        [(rec.op, rec.peer, rec.nbytes) for rec in backward.records]))
        if layout == "contiguous":
            mine = [part(t).requires_grad_() for t in (q, k, v)]
            with parakit.CommLog() as log:
                out = ulysses.ulysses_attention(*mine, causal=causal)
                out.backward(part(dy))
            close(out, part(expected), "Ulysses output")
            for name, got, want in zip("qkv", mine, whole):
                close(got.grad, part(want.grad), f"Ulysses dL/d{name}")
            traffic.append(("ulysses", [r_.op for r_ in log.records], log.wire_bytes(), shape))
    return traffic


@pytest.mark.parametrize("n", [2, 4])
def test_ring_attention_and_ulysses_equal_sdpa_on_the_whole_sequence_in_values_and_gradients(n):
    for seed in (1, 2):
        for rank, traffic in enumerate(parakit.launch(_against_sdpa, seed, world_size=n)):
            after, before = (rank + 1) % n, (rank - 1) % n
            for (what, forward, backward, *rest) in traffic:
                if what == "ulysses":
                    ops, wire, shape = forward, backward, rest[0]
                    local = 4 * shape[0] * shape[1] * shape[2] * shape[3] // n
                    assert ops == ["all_to_all_single"] * 8  # q, k, v in and out back; the same backward
                    assert wire == ulysses.ulysses_bytes_per_rank((local // 4,), n, backward=True)
                    continue
                kv = 2 * 4 * what[2][0] * what[2][1] * what[2][2] * what[2][3] // n  # this rank's K and V, bytes
                assert forward == [("isend", after, kv), ("irecv", before, kv)] * (n - 1)
                assert sorted(backward) == sorted([("isend", after, kv), ("irecv", before, kv)] * (2 * n - 1))
                local = (what[2][0], what[2][1], what[2][2] // n, what[2][3])
                sent = sum(b for op, _, b in forward + backward if op == "isend")
                assert sent == cp.ring_bytes_per_rank(local, n, backward=True)


def _backward_against_autograd(seed: int):
    """Every case on a fresh random shape: cp.ring_attention_backward on this rank's part, from
    cp.ring_attention_forward's out and lse, against autograd of SDPA on the whole sequence."""
    import torch.distributed as dist
    n, r = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(seed)
    for causal, layout in CASES:
        shape = _shape(g, n)
        q, k, v, do = (torch.randn(shape, generator=g) for _ in range(4))
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(*whole, is_causal=causal).backward(do)
        part = lambda t: cp.shard_sequence(t, n, r, layout)
        mine = [part(t) for t in (q, k, v)]
        out, lse = cp.ring_attention_forward(*mine, causal=causal, layout=layout)
        grads = cp.ring_attention_backward(part(do), *mine, out, lse, causal=causal, layout=layout)
        for name, got, want in zip("qkv", grads, whole):
            torch.testing.assert_close(got, part(want.grad), rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"d{name} (causal={causal}, {layout}, {shape}): {m}")
    return True


@pytest.mark.parametrize("n", [1, 3])
def test_ring_attention_backward_from_the_forwards_out_and_lse_equals_autograd_of_one_process(n):
    assert parakit.launch(_backward_against_autograd, n, world_size=n) == [True] * n


def test_block_attention_backward_is_autograd_of_one_block_and_sums_over_blocks_of_keys():
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 3, 6, 4, generator=g) for _ in range(4))
    for diagonal in (False, True):
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = cp.block_attention(*whole, 0.5, diagonal)
        out.backward(do)
        delta = (do * out).detach().sum(-1)
        grads = cp.block_attention_backward(do, q, k, v, lse.detach(), delta, 0.5, diagonal)
        torch.testing.assert_close(grads, tuple(t.grad for t in whole))
    out, lse = cp.block_attention(q, k, v, 0.5)  # two blocks of keys, with the whole's lse and delta:
    dq, dk, dv = cp.block_attention_backward(do, q, k, v, lse, (do * out).sum(-1), 0.5)
    halves = [cp.block_attention_backward(do, q, k[:, :, i:i + 3], v[:, :, i:i + 3], lse, (do * out).sum(-1), 0.5)
              for i in (0, 3)]
    torch.testing.assert_close(halves[0][0] + halves[1][0], dq)  # dq sums over them
    torch.testing.assert_close(torch.cat([h[1] for h in halves], 2), dk)  # dk, dv are each block's own
    torch.testing.assert_close(torch.cat([h[2] for h in halves], 2), dv)


def ring_posts(causal, layout):
    import torch.distributed as dist
    n, r = dist.get_world_size(), dist.get_rank()
    q, k, v = (cp.shard_sequence(torch.randn(1, 2, 4 * n, 3), n, r, layout).requires_grad_() for _ in range(3))
    with recording() as posted:
        cp.ring_attention(q, k, v, causal=causal, layout=layout).sum().backward()
    return posted


@pytest.mark.parametrize("n", [2, 4])
def test_ring_attention_posts_each_steps_send_and_receive_in_one_batch_nccl_can_run(n):
    """Forward and backward, every transfer (K and V, and backward's dK, dV) goes out as one
    batch with its receive from the other side, and the two rings of the backward post in
    the same order on every rank: played as NCCL runs batches, no rank waits in a cycle."""
    for causal, layout in CASES:
        posted = parakit.launch(ring_posts, causal, layout, world_size=n)
        kv = 2 * 4 * 2 * 4 * 3  # K and V of [1, 2, 4, 3], fp32
        for rank, batches in enumerate(posted):
            step = [("send", (rank + 1) % n, kv), ("recv", (rank - 1) % n, kv)]
            assert batches == [step] * (n - 1 + 2 * n - 1), (causal, layout, rank)  # forward, then backward
        assert_nccl_can_run(posted)


EMULATED = '''import json, torch, torch.nn.functional as F, torch.distributed as dist
import parakit
from parakit import context_parallel as cp

def attention(q, k, v, dy, causal, layout):
    n, r = dist.get_world_size(), dist.get_rank()
    mine = [cp.shard_sequence(t, n, r, layout).requires_grad_() for t in (q, k, v)]
    out = cp.ring_attention(*mine, causal=causal, layout=layout)
    out.backward(cp.shard_sequence(dy, n, r, layout))
    return out, [t.grad for t in mine], out.device.type

found = {}
for n in (2, 4):
    q, k, v, dy = (torch.randn(1, 2, 4 * n, 3) for _ in range(4))
    for causal, layout in [(False, "contiguous"), (True, "zigzag")]:
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = F.scaled_dot_product_attention(*whole, is_causal=causal)
        expected.backward(dy)
        part = lambda t, r: cp.shard_sequence(t, n, r, layout)
        runs = parakit.launch(attention, q, k, v, dy, causal, layout, world_size=n)
        found[f"n={n} causal={causal} {layout}"] = [
            all(torch.allclose(out, part(expected, r), atol=1e-5) for r, (out, _, _) in enumerate(runs)),
            all(torch.allclose(g, part(w.grad, r), atol=1e-5) for r, (_, grads, _) in enumerate(runs)
                for g, w in zip(grads, whole)),
            sorted({kind for *_, kind in runs})]
print(json.dumps(found))
'''


def test_ring_attention_runs_on_the_emulated_nccl_at_2_and_4_ranks(tmp_path):
    """On emulated GPUs whose NCCL stops where NCCL would hang, forward and backward equal
    SDPA on the whole sequence, non-causal and causal zig-zag."""
    found = run_emulated(tmp_path, EMULATED)
    assert found == {f"n={n} causal={causal} {layout}": [True, True, ["fgpu"]] for n in (2, 4)
                     for causal, layout in [(False, "contiguous"), (True, "zigzag")]}


def test_the_online_softmax_merge_of_two_halves_is_attention_over_both():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g) for _ in range(3))
    whole = cp.block_attention(q, k, v, 0.5)
    halves = [cp.block_attention(q, k[:, :, i:i + 3], v[:, :, i:i + 3], 0.5) for i in (0, 3)]
    merged = cp.merge_partials(*halves[0], *halves[1])
    torch.testing.assert_close(merged, whole)
    torch.testing.assert_close(whole[0], F.scaled_dot_product_attention(q, k, v, scale=0.5))


@pytest.mark.parametrize("layout", cp.LAYOUTS)
def test_attention_work_counts_exactly_the_unmasked_scores_of_each_ranks_queries(layout):
    for n, seq in ((2, 8), (4, 16), (4, 40)):
        position = torch.arange(seq)
        for rank, work in enumerate(cp.attention_work(seq, n, layout)):
            mine = cp.shard_sequence(position.view(seq, 1), n, rank, layout).flatten()
            assert work == int((position.view(1, -1) <= mine.view(-1, 1)).sum())
        assert cp.attention_work(seq, n, layout, causal=False) == [seq * seq // n] * n


def test_zigzag_balances_causal_work_and_contiguous_does_not():
    zigzag, contiguous = cp.attention_work(4096, 4, "zigzag"), cp.attention_work(4096, 4, "contiguous")
    assert max(zigzag) == min(zigzag)  # the bar: within 10%
    assert max(contiguous) / min(contiguous) > 6  # rank 3 sees the whole sequence, rank 0 a quarter of a quarter


def _attention_block_saved(seq: int, layout: str) -> int:
    import torch.distributed as dist
    n, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    block = cp.ContextParallelSelfAttention(16, 4, causal=True, layout=layout)
    x = torch.randn(2, seq, 16, generator=torch.Generator().manual_seed(1))
    return saved_bytes(block, cp.shard_sequence(x, n, r, layout, dim=1).requires_grad_()).forward


@pytest.mark.parametrize("layout", cp.LAYOUTS)
def test_the_attention_block_stores_a_quarter_of_one_ranks_activations_on_four_ranks(layout):
    one = parakit.launch(_attention_block_saved, 64, layout, world_size=1)[0]
    assert parakit.launch(_attention_block_saved, 64, layout, world_size=4) == [one // 4] * 4
    assert one % 4 == 0


def _bad_inputs():
    import torch.distributed as dist
    n, errors = dist.get_world_size(), {}
    q = torch.zeros(1, 4, 6, 8)  # 6 local positions on each of 4 ranks
    cases = {"zigzag seq": lambda: cp.shard_sequence(torch.zeros(1, 4, 12, 8), n, 0, "zigzag"),
             "contiguous seq": lambda: cp.shard_sequence(torch.zeros(1, 4, 10, 8), n, 0),
             "local seq": lambda: cp.ring_attention(q[:, :, :5], q[:, :, :5], q[:, :, :5], layout="zigzag"),
             "qkv": lambda: cp.ring_attention(q, q[:, :, :4], q),
             "heads": lambda: ulysses.ulysses_attention(q[:, :3], q[:, :3], q[:, :3]),
             "layout": lambda: cp.chunk_ids(n, 0, "striped")}
    for name, call in cases.items():
        try:
            call()
            errors[name] = "no error"
        except ValueError as error:
            errors[name] = str(error)
    return errors


def test_bad_sizes_are_refused_with_the_sizes_and_what_would_divide():
    errors = parakit.launch(_bad_inputs, world_size=4)[0]
    assert errors == {
        "zigzag seq": "sequence length 12 is not divisible by 8 (2 x 4 ranks for the zig-zag split): make it a "
                      "multiple of 8, such as 16",
        "contiguous seq": "sequence length 10 is not divisible by 4 (4 ranks): make it a multiple of 4, such as 12",
        "local seq": "local sequence length 5 on each of 4 ranks (20 in all) is not divisible into the 2 chunks of "
                     "the zigzag split: make the whole sequence a multiple of 8",
        "qkv": "q, k and v must have the same shape [batch, heads, seq/n, head_dim]: got q [1, 4, 6, 8], "
               "k [1, 4, 4, 8], v [1, 4, 6, 8]",
        "heads": "3 heads are not divisible by the Ulysses degree 4: use a number of ranks that divides 3 (1, 3) "
                 "or a multiple of 4 heads",
        "layout": "layout 'striped' is not one of ('contiguous', 'zigzag')",
    }
    assert parakit.launch(lambda: 1, world_size=4) == [1] * 4  # the ranks are still usable


# ------------------------------------------------------------------------- GPUs

def _against_torch_context_parallel(seq: int = 256, heads: int = 4, head_dim: int = 32):
    """PyTorch's context_parallel (its head-tail load balancer is the zig-zag split) against
    parakit's ring attention on the same shards: outputs and the gradients of q, k, v."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    n, r = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    q, k, v, dy = (torch.randn(2, heads, seq, head_dim, generator=g).cuda() for _ in range(4))
    mesh = init_device_mesh("cuda", (n,))
    theirs = [t.clone() for t in (q, k, v, dy)]
    with context_parallel(mesh, buffers=theirs, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(theirs)):
        for t in theirs[:3]:
            t.requires_grad_()
        out_theirs = F.scaled_dot_product_attention(*theirs[:3], is_causal=True)
        out_theirs.backward(theirs[3])
    mine = [cp.shard_sequence(t, n, r, "zigzag").requires_grad_() for t in (q, k, v)]
    torch.testing.assert_close(mine[0].detach(), theirs[0].detach())  # the same shard of the sequence
    out = cp.ring_attention(*mine, causal=True, layout="zigzag")
    out.backward(cp.shard_sequence(dy, n, r, "zigzag"))
    tol = dict(rtol=1e-4, atol=1e-4)  # GPU kernels (flash / efficient attention, TF32 off by default)
    torch.testing.assert_close(out, out_theirs.detach(), **tol)
    for got, want in zip(mine, theirs):
        torch.testing.assert_close(got.grad, want.grad, **tol)
    return True


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two or more CUDA GPUs")
def test_on_gpus_ring_attention_equals_torch_context_parallel():
    assert parakit.launch(_against_torch_context_parallel, world_size=2) == [True, True]
