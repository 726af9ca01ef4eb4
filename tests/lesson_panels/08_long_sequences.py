"""Lesson 08's fake students."""
from pathlib import Path

import panel
from conftest import REPO

NAIVE_MERGE = '''def merge(out_a, lse_a, out_b, lse_b):
    total = torch.exp(lse_a) + torch.exp(lse_b)  # exp of the log-sum-exps themselves: overflows past ~88
    out = (torch.exp(lse_a) / total).unsqueeze(-1) * out_a + (torch.exp(lse_b) / total).unsqueeze(-1) * out_b
    return out, torch.log(total)
'''

NO_HEADS_CHECK = '''def seq_to_heads(x):
    n = dist.get_world_size()
    b, h, s, d = x.shape  # no check that n divides h: reshape fails with torch's own error
    send = x.reshape(b, n, h // n, s, d).movedim(1, 0).contiguous()
    got = torch.empty_like(send)
    dist.all_to_all_single(got, send)
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)
'''

BORROWED_PAIR = '''class GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return tp.gather_from_sequence_region(x)

    @staticmethod
    def backward(ctx, grad):
        return tp.reduce_scatter_to_sequence_region(grad)


class ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return tp.reduce_scatter_to_sequence_region(x)

    @staticmethod
    def backward(ctx, grad):
        return tp.gather_from_sequence_region(grad)
'''

BORROWED = {
    "merge": "def merge(out_a, lse_a, out_b, lse_b):\n    return cp.merge_partials(out_a, lse_a, out_b, lse_b)\n",
    "ring_forward": "def ring_forward(q, k, v):\n    return cp.ring_attention_forward(q, k, v)\n",
    "ring_forward_causal": "def ring_forward_causal(q, k, v):\n"
                           "    return cp.ring_attention_forward(q, k, v, causal=True, layout='zigzag')\n",
    "sequence_pair": BORROWED_PAIR,
    "seq_to_heads": "def seq_to_heads(x):\n    return ulysses.seq_to_heads(x)\n",
}


def students(lesson: Path, solution: Path) -> list[panel.Student]:
    """Lesson 08. The hard-coder merges with exp of the log-sum-exps themselves (overflows on
    the hidden large ones) and re-shards without checking that the ranks divide the heads:
    each fails its hidden tests. The borrower calls parakit's merge, ring, sequence pair and
    re-shard: 0 on every exercise. The kernel hangs in the causal ring and dies in the re-shard."""
    hardcoded = {"merge": NAIVE_MERGE, "seq_to_heads": NO_HEADS_CHECK}
    return panel.standard_panel(
        lesson, solution, hang_in="ring_forward_causal", crash_in="seq_to_heads", hardcoded=hardcoded,
        hardcoded_expected={"test_merge": 0.0, "test_seq_to_heads": 0.0}, borrowed=BORROWED)


LESSON = panel.Lesson(REPO / "solutions" / "08_long_sequences.ipynb", students, timeout=60)
