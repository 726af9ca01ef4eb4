"""Lesson 09's fake students."""
from pathlib import Path

import panel
from conftest import REPO

TOKEN_MAJOR = '''def top_k_route(probs, k, capacity):
    if k > probs.shape[1]:
        raise ValueError(f"top_k={k} is larger than the number of experts {probs.shape[1]}")
    gates, experts = probs.topk(k, dim=-1)
    onehot = F.one_hot(experts.reshape(-1), probs.shape[1])   # token by token: a token's second choice before the next token's first
    place = ((onehot.cumsum(0) - 1) * onehot).sum(-1).view(experts.shape)
    return experts, gates, torch.where(place < capacity, place, -1)
'''

SENDS_DROPPED = '''class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits):
        ctx.splits = (output_splits, input_splits)
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        out = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), input_splits, output_splits)
        return out, None, None


def dispatch(x, experts, slots, num_experts):
    n, k = dist.get_world_size(), experts.shape[1]
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)        # every choice, the dropped ones too
    counts = torch.bincount(flat, minlength=num_experts)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts)
    recv_counts = recv_counts.view(n, num_experts // n)
    received = AllToAll.apply(x[order // k], recv_counts.sum(1).tolist(), counts.view(n, -1).sum(1).tolist())
    return received, recv_counts
'''

OVERWRITES = '''def combine(y, recv_counts, experts, gates, slots, num_experts):
    n, (tokens, k) = dist.get_world_size(), experts.shape
    flat, slot = experts.reshape(-1), slots.reshape(-1)
    kept = (slot >= 0).nonzero().squeeze(1)
    order = kept[(flat[kept] * slot.numel() + slot[kept]).argsort()]
    counts = torch.bincount(flat[kept], minlength=num_experts)
    back = AllToAll.apply(y, counts.view(n, -1).sum(1).tolist(), recv_counts.sum(1).tolist())
    weighted = back * gates.reshape(-1)[order].unsqueeze(-1)
    return y.new_zeros(tokens, y.shape[-1]).index_copy(0, order // k, weighted)   # a token's last choice wins
'''

PER_TOKEN = '''def load_balancing_loss(probs, experts, num_experts):
    f = torch.bincount(experts.reshape(-1), minlength=num_experts).to(probs.dtype) / experts.shape[0]   # not / (tokens * k)
    return num_experts * (f * probs.mean(0)).sum()
'''

BORROWED = {
    "top_k_route": "def top_k_route(probs, k, capacity):\n    return moe.top_k_route(probs, k, capacity)\n",
    "dispatch": "def dispatch(x, experts, slots, num_experts):\n    return moe.dispatch(x, experts, slots, num_experts)\n\n\n"
                "AllToAll = moe.AllToAll\n",
    "combine": "import torch.distributed.nn.functional as dist_nn\n\n"
               "def combine(y, recv_counts, experts, gates, slots, num_experts):\n"
               "    n, (tokens, k) = dist.get_world_size(), experts.shape\n"
               "    order, counts = moe.by_expert(experts, slots, num_experts)\n"
               "    out_splits, in_splits = counts.view(n, -1).sum(1).tolist(), recv_counts.sum(1).tolist()\n"
               "    back = dist_nn.all_to_all_single(y.new_empty(sum(out_splits), y.shape[1]), y, out_splits, in_splits)\n"
               "    return moe.weigh_and_sum(back, order, gates, tokens)\n",
    "load_balancing_loss": "def load_balancing_loss(probs, experts, num_experts):\n"
                           "    return moe.load_balancing_loss(probs, experts, num_experts)\n",
}


def students(lesson: Path, solution: Path) -> list[panel.Student]:
    """Lesson 09. The hard-coder hands out places token by token (right for top-1, wrong for
    top-2), dispatches dropped choices too (right while nothing is dropped), overwrites a
    token's output with its last choice instead of adding its choices (right for top-1), and
    divides the balancing loss's counts by the tokens instead of the choices (right for
    top-1): each fails its hidden tests. The borrower calls parakit's routing, dispatch,
    sort and loss, and torch's differentiable all-to-all: 0 on every exercise. The kernel
    hangs in the balancing loss and dies in the routing (no other answer uses them)."""
    hardcoded = {"top_k_route": TOKEN_MAJOR, "dispatch": SENDS_DROPPED, "combine": OVERWRITES,
                 "load_balancing_loss": PER_TOKEN}
    zeroed = ("test_top_k_route", "test_dispatch", "test_combine", "test_load_balancing_loss")
    return panel.standard_panel(
        lesson, solution, hang_in="load_balancing_loss", crash_in="top_k_route",
        hardcoded=hardcoded, hardcoded_expected=dict.fromkeys(zeroed, 0.0), borrowed=BORROWED)


LESSON = panel.Lesson(REPO / "solutions" / "09_mixture_of_experts.ipynb", students, timeout=60)
