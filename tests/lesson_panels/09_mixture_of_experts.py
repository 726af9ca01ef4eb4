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


CLAMPS = """def top_k_route(probs, k, capacity):
    if k > probs.shape[1]:
        raise ValueError(f"top_k={k} is larger than the number of experts {probs.shape[1]}")
    gates, experts = probs.topk(k, dim=-1)
    onehot = F.one_hot(experts.t().reshape(-1), probs.shape[1])
    place = ((onehot.cumsum(0) - 1) * onehot).sum(-1).view(k, -1).t()
    return experts, gates, place.clamp(max=capacity - 1)   # a full expert takes the choice in its last place
"""

GATHERS_TOKENS = """class AllToAll(torch.autograd.Function):
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


class Gather(torch.autograd.Function):   # every rank's tokens to every rank
    @staticmethod
    def forward(ctx, x):
        out = x.new_empty((dist.get_world_size() * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        mine = grad.new_empty((grad.shape[0] // dist.get_world_size(), *grad.shape[1:]))
        dist.reduce_scatter_single(mine, grad.contiguous())
        return mine


def gather_all(t):
    out = t.new_empty((dist.get_world_size() * t.shape[0], *t.shape[1:]))
    dist.all_gather_single(out, t.contiguous())
    return out


def dispatch(x, experts, slots, num_experts):
    n, rank, (tokens, k) = dist.get_world_size(), dist.get_rank(), experts.shape
    lo, hi = rank * num_experts // n, (rank + 1) * num_experts // n
    every_x, every_e, every_s = Gather.apply(x), gather_all(experts), gather_all(slots)
    rows, recv_counts = [], []
    for s in range(n):   # pick, from every rank's tokens, the choices of my experts
        e, slot = every_e[s * tokens:(s + 1) * tokens].reshape(-1), every_s[s * tokens:(s + 1) * tokens].reshape(-1)
        kept = ((slot >= 0) & (e >= lo) & (e < hi)).nonzero().squeeze(1)
        kept = kept[(e[kept] * slot.numel() + slot[kept]).argsort()]
        rows.append(every_x[s * tokens + kept // k])
        recv_counts.append(torch.bincount(e[kept] - lo, minlength=hi - lo))
    return torch.cat(rows), torch.stack(recv_counts)
"""

EXPLICIT_SPLITS = """class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits):
        ctx.save = list(output_splits), list(input_splits)
        out = torch.empty(sum(output_splits), x.shape[1], dtype=x.dtype, device=x.device)
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=list(output_splits),
                               input_split_sizes=list(input_splits))
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.save
        back = torch.empty(sum(input_splits), grad.shape[1], dtype=grad.dtype, device=grad.device)
        dist.all_to_all_single(back, grad.contiguous(), output_split_sizes=input_splits,
                               input_split_sizes=output_splits)
        return back, None, None


def dispatch(x, experts, slots, num_experts):
    n, k = dist.get_world_size(), experts.shape[1]
    flat, slot = experts.flatten(), slots.flatten()
    by_slot = slot.argsort(stable=True)
    by_expert = by_slot[flat[by_slot].argsort(stable=True)]   # by expert, then slot: two stable sorts
    order = by_expert[slot[by_expert] >= 0]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device).index_add_(
        0, flat[order], torch.ones_like(flat[order]))
    recv_counts = torch.empty_like(counts)
    per_rank = [num_experts // n] * n
    dist.all_to_all_single(recv_counts, counts, output_split_sizes=per_rank, input_split_sizes=per_rank)
    recv_counts = recv_counts.reshape(n, -1)
    sends = [int(c) for c in counts.reshape(n, -1).sum(1)]
    return AllToAll.apply(x.index_select(0, order // k), [int(c) for c in recv_counts.sum(1)], sends), recv_counts
"""

GATHERS_OUTPUTS = """class Gather(torch.autograd.Function):   # every rank's expert outputs to every rank
    @staticmethod
    def forward(ctx, y):
        out = y.new_empty((dist.get_world_size() * y.shape[0], *y.shape[1:]))
        dist.all_gather_single(out, y.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        mine = grad.new_empty((grad.shape[0] // dist.get_world_size(), *grad.shape[1:]))
        dist.reduce_scatter_single(mine, grad.contiguous())
        return mine


def combine(y, recv_counts, experts, gates, slots, num_experts):
    n, rank, (tokens, k) = dist.get_world_size(), dist.get_rank(), experts.shape
    flat, slot = experts.reshape(-1), slots.reshape(-1)
    kept = (slot >= 0).nonzero().squeeze(1)
    order = kept[(flat[kept] * slot.numel() + slot[kept]).argsort()]
    sizes = torch.zeros(n, dtype=torch.int64, device=y.device)
    dist.all_gather_single(sizes, torch.tensor([y.shape[0]], device=y.device))
    every_counts = recv_counts.new_empty(n * recv_counts.numel())
    dist.all_gather_single(every_counts, recv_counts.reshape(-1))
    every_counts = every_counts.view(n, *recv_counts.shape)
    most = int(sizes.max())
    every_y = Gather.apply(torch.cat([y, y.new_zeros(most - y.shape[0], y.shape[1])])).view(n, most, -1)
    mine = []
    for s in range(n):   # my rows in rank s's outputs: after the rows of the ranks before me
        start = int(every_counts[s][:rank].sum())
        mine.append(every_y[s, start:start + int(every_counts[s][rank].sum())])
    back = torch.cat(mine)
    weighted = back * gates.reshape(-1)[order].unsqueeze(-1)
    return y.new_zeros(tokens, y.shape[-1]).index_add(0, order // k, weighted)
"""

SCATTER_ADD = """def combine(y, recv_counts, experts, gates, slots, num_experts):
    n, (tokens, k) = dist.get_world_size(), experts.shape
    flat, slot = experts.flatten(), slots.flatten()
    key = torch.where(slot >= 0, flat * slot.numel() + slot, num_experts * slot.numel())   # dropped ones last
    order = key.argsort()[:int((slot >= 0).sum())]
    sent = torch.bincount(flat[order], minlength=num_experts).view(n, -1).sum(1)
    back = AllToAll.apply(y, [int(c) for c in sent], [int(c) for c in recv_counts.sum(1)])
    weighted = back * gates.flatten().gather(0, order).unsqueeze(1)
    index = (order // k).unsqueeze(1).expand_as(weighted)
    return torch.zeros(tokens, y.shape[1], dtype=y.dtype, device=y.device).scatter_add(0, index, weighted)
"""

NO_GRADIENT = """def load_balancing_loss(probs, experts, num_experts):
    f = torch.bincount(experts.reshape(-1), minlength=num_experts).to(probs.dtype) / experts.numel()
    return num_experts * (f * probs.mean(0).detach()).sum()   # no gradient reaches the router
"""



def students(lesson: Path, solution: Path) -> list[panel.Student]:
    """Lesson 09. The hard-coder hands out places token by token (right for top-1, wrong for
    top-2), dispatches dropped choices too (right while nothing is dropped), overwrites a
    token's output with its last choice instead of adding its choices (right for top-1), and
    divides the balancing loss's counts by the tokens instead of the choices (right for
    top-1): each fails its hidden tests. The borrower calls parakit's routing, dispatch,
    sort and loss, and torch's differentiable all-to-all: 0 on every exercise. The kernel
    hangs in the balancing loss and dies in the routing (no other answer uses them).

    `wrong_techniques`, 0 on every exercise (one student, to keep the panel's executed notebooks
    few): puts a choice that finds its expert full in the last place instead of dropping it;
    all-gathers every rank's tokens and routing to every rank and picks its experts' rows (right
    rows, counts and dL/dx: the calls differ); sends the experts' outputs home by all-gathering
    them (the same); detaches P, so that no gradient reaches the router. `another_way`, full
    marks: sorts with two stable sorts and passes every split size by name; sorts the dropped
    choices last and adds with scatter_add."""
    hardcoded = {"top_k_route": TOKEN_MAJOR, "dispatch": SENDS_DROPPED, "combine": OVERWRITES,
                 "load_balancing_loss": PER_TOKEN}
    zeroed = ("test_top_k_route", "test_dispatch", "test_combine", "test_load_balancing_loss")
    full, name = panel.full_solution(panel.load(lesson), panel.load(solution)), lesson.name
    pts = panel.points(panel.load(lesson))

    def student(who, sources, zeroed=()):
        return panel.Student(who, {name: panel.with_sources(full, sources)}, {**pts, **dict.fromkeys(zeroed, 0.0)})

    return panel.standard_panel(
        lesson, solution, hang_in="load_balancing_loss", crash_in="top_k_route",
        hardcoded=hardcoded, hardcoded_expected=dict.fromkeys(zeroed, 0.0), borrowed=BORROWED,
        extra=[student("wrong_techniques", {"top_k_route": CLAMPS, "dispatch": GATHERS_TOKENS, "combine": GATHERS_OUTPUTS,
                                            "load_balancing_loss": NO_GRADIENT}, zeroed),
               student("another_way", {"dispatch": EXPLICIT_SPLITS, "combine": SCATTER_ADD})])


LESSON = panel.Lesson(REPO / "solutions" / "09_mixture_of_experts.ipynb", students, timeout=60)
