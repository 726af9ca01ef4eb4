"""parakit.sequence_parallel on real ranks (gloo on CPU) at sizes 2 and 4: the sequence-parallel
block equals parakit's tensor-parallel block (output, dL/dx, every parameter's gradient);
its collectives per layer are the paper's (two all-gathers and two reduce-scatters each way,
the bytes of tensor parallelism's four all-reduces; two more all-gathers backward when it
stores slices only); what autograd saves per rank is the one-rank block's divided by t,
exactly; a sequence the ranks cannot split is refused with the sizes named."""
from __future__ import annotations

import pytest
import torch

import parakit
from parakit import sequence_parallel as sp
from parakit import tensor_parallel as tp
from parakit.checkpoint import saved_bytes

AG, RS, AR = "all_gather_single", "reduce_scatter_single", "all_reduce"


def _draw(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _ops(log) -> list[str]:
    return sorted(record.op for record in log.records)


def _blocks(seed: int, regather: bool):
    """The tensor-parallel block on the whole sequence against the sequence-parallel one on
    this rank's slice, from the same seed and shapes drawn from it (the same on every rank)."""
    import torch.distributed as dist
    t = dist.get_world_size()
    g = torch.Generator().manual_seed(seed)
    heads = t * int(torch.randint(1, 3, (), generator=g))
    hidden, seq, batch = heads * int(torch.randint(2, 5, (), generator=g)), t * int(torch.randint(1, 5, (), generator=g)), \
        int(torch.randint(1, 3, (), generator=g))
    ffn, causal = t * int(torch.randint(1, 9, (), generator=g)), bool(torch.randint(0, 2, (), generator=g))
    x, dy = _draw(seed + 1, batch, seq, hidden), _draw(seed + 2, batch, seq, hidden)
    torch.manual_seed(seed)
    dense = tp.ParallelTransformerBlock(hidden, heads, ffn, causal)
    torch.manual_seed(seed)
    block = sp.SequenceParallelTransformerBlock(hidden, heads, ffn, causal, regather=regather)
    x_tp, x_sp = x.clone().requires_grad_(), sp.split_sequence(x).clone().requires_grad_()
    logs = [parakit.CommLog() for _ in range(4)]
    with logs[0]:
        y_tp = dense(x_tp)
    with logs[1]:
        y_tp.backward(dy)
    with logs[2]:
        y_sp = block(x_sp)
    with logs[3]:
        y_sp.backward(sp.split_sequence(dy))
    sp.sync_sequence_parallel_grads(block)
    close = lambda a, b, what: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
    close(y_sp, sp.split_sequence(y_tp), "output slice")
    close(x_sp.grad, sp.split_sequence(x_tp.grad), "dL/dx slice")
    for (name, p), q in zip(block.named_parameters(), dense.parameters()):
        close(p.grad, q.grad, f"d/d{name}")
    return [_ops(log) for log in logs], [log.wire_bytes() for log in logs]


@pytest.mark.parametrize("t", [2, 4])
def test_sequence_parallel_block_equals_the_tensor_parallel_block_with_the_papers_collectives(t):
    for regather in (False, True):
        for seed in (11, 12):
            for ops, wire in parakit.launch(_blocks, seed, regather, world_size=t):
                assert ops[0] == ops[1] == [AR, AR]  # tensor parallel: one all-reduce per region each way
                assert ops[2] == [AG, AG, RS, RS]  # sequence parallel forward: all-gather in, reduce-scatter out
                assert ops[3] == ([AG] * 4 if regather else [AG] * 2) + [RS, RS]
                assert wire[2] == wire[0]  # all-reduce = reduce-scatter + all-gather: the same bytes
                # backward too; with regather the inputs of qkv and fc1 all-gathered again: half as much more
                assert wire[3] == (wire[1] * 3 // 2 if regather else wire[1])


def _saved(seq_per_rank: int, batch: int = 2, hidden: int = 16, heads: int = 4):
    """Bytes autograd saves for the sequence-parallel block on t ranks and the dense block on one."""
    import torch.distributed as dist
    t = dist.get_world_size()
    x = _draw(0, batch, t * seq_per_rank, hidden)
    torch.manual_seed(0)
    block = sp.SequenceParallelTransformerBlock(hidden, heads)
    return saved_bytes(block, sp.split_sequence(x).clone().requires_grad_()).forward


def _one_rank(seq: int, batch: int = 2, hidden: int = 16, heads: int = 4) -> int:
    torch.manual_seed(0)
    return parakit.launch(lambda: saved_bytes(tp.ParallelTransformerBlock(hidden, heads),
                                              _draw(0, batch, seq, hidden).requires_grad_()).forward,
                          world_size=1)[0]


@pytest.mark.parametrize("t", [2, 4])
def test_sequence_parallel_block_saves_the_one_rank_activations_divided_by_t(t):
    whole = _one_rank(8 * t)
    assert parakit.launch(_saved, 8, world_size=t) == [whole // t] * t
    assert whole % t == 0


def test_paper_formula_divides_everything_by_t_with_sequence_parallelism():
    one = sp.paper_activation_bytes(2048, 1, 4096, 32)
    assert one == 2048 * 4096 * (34 + 5 * 32 * 2048 / 4096)
    assert sp.paper_activation_bytes(2048, 1, 4096, 32, t=8, sequence_parallel=True) == one / 8
    assert sp.paper_activation_bytes(2048, 1, 4096, 32, t=8) == 2048 * 4096 * (10 + 3 + 5 * 32 * 2048 / 4096 / 8)


def _bad_split():
    try:
        sp.split_sequence(torch.zeros(1, 6, 4))
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_sequence_the_ranks_cannot_split_is_refused_with_the_sizes():
    assert parakit.launch(_bad_split, world_size=4)[0] == ("sequence length 6 is not divisible by the "
                                                          "sequence-parallel size 4: make it a multiple of 4")
    assert parakit.launch(lambda: 1, world_size=4) == [1] * 4
