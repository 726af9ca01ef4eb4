"""A mixture-of-experts layer in one process: the reference the expert-parallel layer equals.

    y[t] = sum over t's kept choices c of  gates[t, c] * expert_{experts[t, c]}(x[t])

Each expert is a small MLP (hidden -> ffn_hidden -> hidden). A token's k choices cost k
expert MLPs of compute, while the layer holds E of them: parameters grow with E, compute per
token with k. `forward(x, groups=G)` routes G equal slices of the tokens separately, each
with its own capacity, as G ranks of an expert-parallel layer route their own tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parakit.moe.routing import Router, Routing, z_loss

__all__ = ["ExpertMLP", "MoE", "by_expert", "run_by_expert", "weigh_and_sum", "check_width"]


class ExpertMLP(nn.Module):
    """One expert: Linear(hidden, ffn_hidden), GeLU, Linear(ffn_hidden, hidden)."""

    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, ffn_hidden), nn.Linear(ffn_hidden, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def check_width(x: torch.Tensor, hidden: int) -> None:
    if x.shape[-1] != hidden:
        raise ValueError(f"tokens of width {x.shape[-1]} ({list(x.shape)}) for a layer of hidden size {hidden}: "
                         f"give it [..., {hidden}], or build the layer with hidden={x.shape[-1]}")


def by_expert(experts: torch.Tensor, slots: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): the kept choices (flat indices token * k + c) sorted by expert, each
    expert's in slot order, and how many each expert gets [E]. Row i of the experts' input is
    then x[order[i] // k]."""
    flat, slot = experts.reshape(-1), slots.reshape(-1)
    kept = (slot >= 0).nonzero().squeeze(1)  # [kept]
    key = flat[kept] * slot.numel() + slot[kept]  # expert first, then slot
    return kept[key.argsort()], torch.bincount(flat[kept], minlength=num_experts)


def run_by_expert(rows: torch.Tensor, counts: list[int], experts) -> torch.Tensor:
    """rows [sum(counts), hidden] in runs of counts[e] rows for expert e -> each run through its expert."""
    pieces = rows.split(counts)
    return torch.cat([expert(piece) for expert, piece in zip(experts, pieces)]) if pieces else rows


def weigh_and_sum(y: torch.Tensor, order: torch.Tensor, gates: torch.Tensor, tokens: int) -> torch.Tensor:
    """y [kept, hidden], the experts' outputs in `order` -> [tokens, hidden]: each scaled by its
    gate and added into its token's row (dropped choices add nothing)."""
    k = gates.shape[-1]
    weighted = y * gates.reshape(-1)[order].unsqueeze(-1).to(y.dtype)  # [kept, hidden]
    return y.new_zeros(tokens, y.shape[-1]).index_add(0, order // k, weighted)


class MoE(nn.Module):
    """Router and E experts in one process. After a forward: `routings` (one per group),
    `aux_loss` and `router_z_loss` (each the mean over groups). `normalize_gates`: see Router."""

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, k: int = 1, capacity_factor: float = 1.25,
                 normalize_gates: bool = False):
        super().__init__()
        self.hidden = hidden
        self.router = Router(hidden, num_experts, k, capacity_factor, normalize_gates)
        self.experts = nn.ModuleList(ExpertMLP(hidden, ffn_hidden) for _ in range(num_experts))
        self.routings: list[Routing] = []

    def forward(self, x: torch.Tensor, groups: int = 1) -> torch.Tensor:
        check_width(x, self.hidden)
        if x.is_meta:  # shapes only (a pipeline's activation_shapes): the routing needs values
            return torch.empty_like(x)
        tokens = x.reshape(-1, self.hidden)  # [tokens, hidden]
        if tokens.shape[0] % groups:
            raise ValueError(f"{tokens.shape[0]} tokens do not split into groups={groups} equal groups: "
                             f"use a multiple of {groups} tokens")
        outs, self.routings = [], []
        for part in tokens.chunk(groups) if groups > 1 else [tokens]:  # [tokens/groups, hidden]
            routing = self.router.route(part)
            order, counts = by_expert(routing.experts, routing.slots, len(self.experts))
            y = run_by_expert(part[order // self.router.k], counts.tolist(), self.experts)  # [kept, hidden]
            outs.append(weigh_and_sum(y, order, routing.gates, part.shape[0]))
            self.routings.append(routing)
        self.aux_loss = torch.stack([r.aux_loss() for r in self.routings]).mean()
        self.router_z_loss = torch.stack([z_loss(r.logits) for r in self.routings]).mean()
        return torch.cat(outs).view_as(x)
