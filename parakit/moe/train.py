"""A tiny MoE model trained with EP x DP, and the same model trained in one process.

    TinyMoE:  y = head(x + moe(x))    (a residual around the MoE layer: dropped tokens pass through)

Both runs draw the same weights (one seed) and the same batches; rank r of the world gets
slice r of each step's batch and routes it as one group, as the one process routes the
world's slices as `groups=world` groups. The loss is the mean squared error plus
`aux_coef` times the load-balancing loss; SGD. Their losses agree to float rounding.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parakit.devices import device
from parakit.moe.layer import MoE
from parakit.moe.parallel import ExpertDataParallel, ExpertMesh, ExpertParallelMoE

__all__ = ["TinyMoE", "batch", "train_ep_dp", "train_one_process"]


class TinyMoE(nn.Module):
    """head(x + moe(x)); `group`: the EP group (an ExpertParallelMoE), or None for one process (a MoE)."""

    def __init__(self, hidden, ffn_hidden, num_experts, k=1, capacity_factor=1.25, *, parallel=False, group=None):
        super().__init__()
        args = (hidden, ffn_hidden, num_experts, k, capacity_factor)
        self.moe = ExpertParallelMoE(*args, group=group) if parallel else MoE(*args)
        self.head = nn.Linear(hidden, hidden)

    def forward(self, x, **kwargs):
        return self.head(x + self.moe(x, **kwargs))


def batch(step: int, tokens: int, hidden: int, seed: int = 0, skew: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s tokens [tokens, hidden] and targets: a fixed random map of the tokens.
    `skew` shifts every token along one fixed direction (a popular topic), which a router
    without the balancing loss is quick to send to one expert."""
    fixed = torch.Generator().manual_seed(seed)
    teacher, direction = torch.randn(hidden, hidden, generator=fixed) / hidden ** 0.5, torch.randn(hidden, generator=fixed)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed * 7919 + step + 1)) + skew * direction
    return x, torch.tanh(x @ teacher)


def _loss(model, moe, x, y, aux_coef, **kwargs):
    return F.mse_loss(model(x, **kwargs), y) + aux_coef * moe.aux_loss


def train_ep_dp(ep: int, steps: int = 5, *, hidden=8, ffn_hidden=16, num_experts=4, k=2, capacity_factor=1.25,
                tokens_per_rank=16, aux_coef=0.01, lr=0.1, seed=0, skew=0.0) -> dict:
    """Train on every rank of the world (ep must divide it); returns, the same on every rank:
    "loss" [steps] (the mean over ranks), "tokens_per_expert" [steps, E] (kept choices, every
    rank's tokens), "tokens_per_rank" [steps, world] (rows each rank's experts ran), "dropped"
    [steps] (choices dropped, all ranks)."""
    mesh = ExpertMesh(ep)
    torch.manual_seed(seed)
    net = TinyMoE(hidden, ffn_hidden, num_experts, k, capacity_factor, parallel=True, group=mesh.ep_group)
    model = ExpertDataParallel(net.to(device()), mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    world, rank, moe = mesh.world, dist.get_rank(), model.module.moe
    rows = {"loss": [], "tokens_per_expert": [], "tokens_per_rank": [], "dropped": []}
    for step in range(steps):
        x, y = (t.chunk(world)[rank].to(device()) for t in batch(step, world * tokens_per_rank, hidden, seed, skew))
        optimizer.zero_grad(set_to_none=True)
        loss = _loss(model, moe, x, y, aux_coef)
        loss.backward()
        model.finish_gradient_synchronization()
        optimizer.step()
        stats = torch.cat([loss.detach().reshape(1) / world, moe.routing.tokens_per_expert().float(),
                           F.one_hot(torch.tensor(rank), world).float().to(loss.device) * moe.recv_counts.sum(),
                           torch.tensor([float(moe.routing.dropped())], device=loss.device)])
        dist.all_reduce(stats)  # one small all-reduce of the statistics
        rows["loss"].append(stats[0].item())
        rows["tokens_per_expert"].append(stats[1:1 + num_experts].long().tolist())
        rows["tokens_per_rank"].append(stats[1 + num_experts:-1].long().tolist())
        rows["dropped"].append(int(stats[-1]))
    return rows


def train_one_process(world: int, steps: int = 5, *, hidden=8, ffn_hidden=16, num_experts=4, k=2,
                      capacity_factor=1.25, tokens_per_rank=16, aux_coef=0.01, lr=0.1, seed=0, skew=0.0) -> dict:
    """The same training in this process, the world's slices routed as `world` groups: "loss" [steps]."""
    torch.manual_seed(seed)
    model = TinyMoE(hidden, ffn_hidden, num_experts, k, capacity_factor)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = batch(step, world * tokens_per_rank, hidden, seed, skew)
        optimizer.zero_grad(set_to_none=True)
        loss = _loss(model, model.moe, x, y, aux_coef, groups=world)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"loss": losses}
