"""Expert parallelism: the experts split over the ranks of a group, tokens moved by all-to-all.

Rank r of an EP group of n ranks holds experts [r*E/n, (r+1)*E/n) and the whole router. A
forward on each rank's own tokens:

    route      top-k with capacity, on this rank's tokens alone            (no communication)
    dispatch   sort the kept choices by expert; all-to-all the counts (E int64 per rank),
               then all-to-all the rows with split sizes: rank s's rows for my experts
    experts    run each local expert on its rows, from every source rank
    combine    the inverse all-to-all (splits swapped) brings each row home; weigh by the
               gate and add into the token's output

Backward runs the two row all-to-alls again, splits swapped (`AllToAll`). Every rank sends
each other rank exactly the rows routed there: (rows sent off-rank) * hidden * itemsize bytes
each way, forward and backward. EP x DP (`ExpertMesh`, `ExpertDataParallel`) replicates
this on dp groups: expert gradients are summed only among replicas of the same experts,
the router's over every rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from parakit.groups import broadcast_from_first, grid_coords, grid_groups, new_subgroups
from parakit.moe.layer import MoE, by_expert, check_width, run_by_expert, weigh_and_sum
from parakit.moe.routing import z_loss

__all__ = ["AllToAll", "all_to_all", "exchange_counts", "dispatch", "run_local_experts", "combine",
           "ExpertParallelMoE", "ExpertMesh", "ExpertDataParallel", "check_divisible"]


def check_divisible(num_experts: int, ep: int) -> int:
    """Experts per rank; raises unless `ep` divides `num_experts`."""
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size {ep}: "
                         f"use a multiple of {ep} experts, or an EP size that divides {num_experts}")
    return num_experts // ep


class AllToAll(torch.autograd.Function):
    """Rows out by `input_splits`, in by `output_splits`; backward: the same, splits swapped."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):  # dL/d(my rows) are where my rows went: send them back the way they came
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


def _all_to_all(x, output_splits, input_splits, group):
    if dist.get_world_size(group) == 1:
        return x
    out = x.new_empty((sum(output_splits), *x.shape[1:]))  # [rows received, ...]
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group=None) -> torch.Tensor:
    """[sum(input_splits), ...] -> [sum(output_splits), ...]: input_splits[j] rows go to rank j,
    output_splits[j] rows come from rank j, in rank order. Sends (rows to other ranks) *
    row bytes; backward sends the gradient of what it received back the same way."""
    return AllToAll.apply(x, list(output_splits), list(input_splits), group)


def exchange_counts(counts: torch.Tensor, group=None) -> torch.Tensor:
    """counts [E] (rows this rank sends to each expert) -> [n, E/n]: row s holds what rank s
    sends to each of my experts. One all-to-all of E/n int64 to each rank."""
    n = dist.get_world_size(group)
    received = torch.empty_like(counts)
    if n == 1:
        received.copy_(counts)
    else:
        dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received.view(n, check_divisible(counts.numel(), n))


def dispatch(x: torch.Tensor, experts: torch.Tensor, slots: torch.Tensor, num_experts: int,
             group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Send each kept choice's token to its expert's rank: (received [rows, hidden], recv_counts [n, E/n]).

    x [tokens, hidden]; experts, slots [tokens, k] (slots -1: dropped). Rows are sent sorted
    by expert, each expert's in slot order; they arrive by source rank, then local expert,
    recv_counts[s, j] of them from rank s for local expert j. Two all-to-alls: the counts,
    then the rows (differentiable)."""
    n = dist.get_world_size(group)
    per_rank = check_divisible(num_experts, n)
    order, counts = by_expert(experts, slots, num_experts)
    recv_counts = exchange_counts(counts, group)  # [n, E/n]
    send = x[order // experts.shape[1]]  # [kept, hidden]
    return all_to_all(send, recv_counts.sum(1).tolist(), counts.view(n, per_rank).sum(1).tolist(), group), recv_counts


def run_local_experts(received: torch.Tensor, recv_counts: torch.Tensor, local_experts) -> torch.Tensor:
    """received [rows, hidden] by (source rank, local expert) -> each row through its expert,
    in the same order. No communication."""
    n, per_rank = recv_counts.shape
    expert_of_row = torch.arange(per_rank, device=received.device).repeat(n).repeat_interleave(recv_counts.reshape(-1))
    by_local = expert_of_row.argsort(stable=True)  # rows grouped by local expert, sources in order
    y = run_by_expert(received[by_local], recv_counts.sum(0).tolist(), local_experts)
    return y[by_local.argsort()]  # back to (source rank, local expert) order


def combine(y: torch.Tensor, recv_counts: torch.Tensor, experts: torch.Tensor, gates: torch.Tensor,
            slots: torch.Tensor, num_experts: int, group=None) -> torch.Tensor:
    """The experts' outputs y [rows, hidden] (as `dispatch` delivered them) back home: one
    all-to-all with dispatch's splits swapped, then each row times its gate, added into its
    token: [tokens, hidden]. Differentiable in y and gates."""
    n = dist.get_world_size(group)
    order, counts = by_expert(experts, slots, num_experts)
    back = all_to_all(y, counts.view(n, check_divisible(num_experts, n)).sum(1).tolist(),
                      recv_counts.sum(1).tolist(), group)  # [kept, hidden], in `order`
    return weigh_and_sum(back, order, gates, experts.shape[0])


class ExpertParallelMoE(nn.Module):
    """MoE with its experts split over `group` (None: the world): each rank keeps the router and
    E/n experts, routes its own tokens, and runs its experts on every rank's tokens for them.

    Made from the same random draws as `MoE(hidden, ffn_hidden, num_experts, k, capacity_factor,
    normalize_gates)` (the whole layer is drawn, then this rank keeps its slice), so from the
    same seed the two hold the same weights. After a forward: `routing`, `recv_counts` [n, E/n], `aux_loss`,
    `router_z_loss`."""

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, k: int = 1, capacity_factor: float = 1.25,
                 group=None, normalize_gates: bool = False):
        super().__init__()
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        per_rank = check_divisible(num_experts, n)
        whole = MoE(hidden, ffn_hidden, num_experts, k, capacity_factor, normalize_gates)
        self.hidden, self.num_experts, self.group = hidden, num_experts, group
        self.first_expert = rank * per_rank
        self.router = whole.router
        self.experts = nn.ModuleList(list(whole.experts)[self.first_expert:self.first_expert + per_rank])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_width(x, self.hidden)
        if x.is_meta:  # shapes only (a pipeline's activation_shapes): the routing needs values
            return torch.empty_like(x)
        tokens = x.reshape(-1, self.hidden)  # [tokens, hidden]
        r = self.routing = self.router.route(tokens)
        received, self.recv_counts = dispatch(tokens, r.experts, r.slots, self.num_experts, self.group)
        y = run_local_experts(received, self.recv_counts, self.experts)  # [rows, hidden]
        out = combine(y, self.recv_counts, r.experts, r.gates, r.slots, self.num_experts, self.group)
        self.aux_loss, self.router_z_loss = r.aux_loss(), z_loss(r.logits)
        return out.view_as(x)


class ExpertMesh:
    """The world as a dp x ep grid, rank = d * ep + e. `ep_group`: the ep ranks of replica d,
    which split the experts between them; `expert_dp_group`: the dp ranks holding the same
    experts (coordinate e). Collective: every rank builds it."""

    def __init__(self, ep: int):
        world = dist.get_world_size()
        if ep < 1 or world % ep:
            raise ValueError(f"expert-parallel size {ep} does not divide the world size {world}: "
                             f"choose ep among {[d for d in range(1, world + 1) if world % d == 0]}")
        self.ep, self.dp, self.world = ep, world // ep, world
        self.dp_rank, self.ep_rank = grid_coords(dist.get_rank(), (self.dp, ep))
        self.ep_group, self.ep_ranks = new_subgroups(grid_groups((self.dp, ep), [1]))
        self.expert_dp_group, self.expert_dp_ranks = new_subgroups(grid_groups((self.dp, ep), [0]))

    def __repr__(self):
        return f"ExpertMesh(dp={self.dp}, ep={self.ep}; d={self.dp_rank}, e={self.ep_rank})"


class ExpertDataParallel(nn.Module):
    """EP x DP: `module` (with ExpertParallelMoE layers on `mesh.ep_group`) replicated over dp.

    At wrap: the dense parameters (router, everything not an expert) are broadcast from world
    rank 0, each expert's from the first rank holding it. `finish_gradient_synchronization()`
    after backward: one all-reduce of the dense gradients over every rank, one of the expert
    gradients over `expert_dp_group`, both divided by the world size. (Not parakit.ddp: DDP
    divides by its group's size, dp, but an expert's gradient already sums the tokens of the
    ep ranks of its replica, so the mean over every token divides by dp * ep.)"""

    def __init__(self, module: nn.Module, mesh: ExpertMesh):
        super().__init__()
        self.module, self.mesh = module, mesh
        self.expert_params = [p for m in module.modules() if isinstance(m, ExpertParallelMoE)
                              for p in m.experts.parameters()]
        experts = {id(p) for p in self.expert_params}
        self.dense_params = [p for p in module.parameters() if id(p) not in experts]
        broadcast_from_first(self.dense_params)
        broadcast_from_first(self.expert_params, mesh.expert_dp_group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Sends: all-reduce of the dense gradients (flat) over the world; all-reduce of the
        expert gradients (flat) over the expert-data-parallel group (none when dp = 1)."""
        for params, group, size in ((self.dense_params, None, self.mesh.world),
                                    (self.expert_params, self.mesh.expert_dp_group, self.mesh.dp)):
            if not params:
                continue
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
            if size > 1:
                dist.all_reduce(flat, group=group)
            flat /= self.mesh.world
            for p, g in zip(params, flat.split([p.numel() for p in params])):
                p.grad = g.view_as(p).clone()
