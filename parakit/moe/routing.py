"""Routing tokens to experts: a linear router, a softmax, the top k, and each expert's capacity.

    probs    = softmax(x @ W_r.T)                      [tokens, E]
    experts  = the k largest probs' indices            [tokens, k]   gates: those probs (renormalised
                                                                     to sum to 1: normalize_gates)
    slots    = each (token, choice)'s place in its expert's buffer, -1 where dropped
    capacity = ceil(capacity_factor * tokens * k / E)   places per expert

Places are handed out in priority order (GShard): every token's first choice, tokens in
order, then every token's second choice, and so on; a choice whose place would be
`capacity` or more is dropped (the token passes that expert by: its residual carries it).
The losses: load balancing (Switch Transformers: E * sum_e f_e * P_e, 1 when balanced) and
the router z-loss (ST-MoE: the mean squared log-sum-exp of the logits). Nothing here
communicates: a router sees only the tokens of its own rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["check_top_k", "expert_capacity", "top_k_route", "load_balancing_loss", "z_loss", "Routing", "Router"]


def check_top_k(k: int, num_experts: int) -> None:
    if not 1 <= k <= num_experts:
        raise ValueError(f"top_k={k} with num_experts={num_experts}: a token picks between 1 and {num_experts} "
                         f"distinct experts; choose k <= {num_experts}, or more experts")


def expert_capacity(tokens: int, num_experts: int, k: int, capacity_factor: float) -> int:
    """Places per expert: ceil(capacity_factor * tokens * k / num_experts), computed exactly
    (capacity_factor as the decimal it prints as, so 1.1 is 11/10)."""
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be > 0: it scales the tokens * k / experts "
                         f"places each expert gets (1.0: even share; 1.25 is common; a large one drops nothing)")
    check_top_k(k, num_experts)
    return math.ceil(Fraction(str(capacity_factor)) * tokens * k / num_experts)


def top_k_route(probs: torch.Tensor, k: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(experts, gates, slots), each [tokens, k], for router probabilities [tokens, E].

    experts: the k most probable experts of each token, most probable first; gates: their
    probabilities; slots: each choice's place in its expert's buffer in priority order (all
    first choices, tokens in order, then all second choices, ...), or -1 where that place is
    `capacity` or beyond (dropped)."""
    tokens, num_experts = probs.shape
    check_top_k(k, num_experts)
    gates, experts = probs.topk(k, dim=-1)  # [tokens, k]
    onehot = F.one_hot(experts.t().reshape(-1), num_experts)  # [k * tokens, E], in priority order
    place = ((onehot.cumsum(0) - 1) * onehot).sum(-1)  # [k * tokens]: earlier choices of the same expert
    slots = place.view(k, tokens).t()  # [tokens, k]
    return experts, gates, torch.where(slots < capacity, slots, -1)


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch Transformers' auxiliary loss, E * sum_e f_e * P_e: f_e is the fraction of the
    tokens' k choices that picked expert e (before dropping; no gradient), P_e the mean router
    probability of e. 1 when routing is uniform, up to E when every token picks one expert."""
    f = torch.bincount(experts.reshape(-1), minlength=num_experts).to(probs.dtype) / experts.numel()  # [E]
    return num_experts * (f * probs.mean(0)).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: mean over tokens of logsumexp(logits)^2 (keeps the logits small)."""
    return logits.logsumexp(-1).square().mean()


@dataclass
class Routing:
    """Where one group of tokens goes: experts, gates and slots [tokens, k] (slots -1 where
    dropped), the router's logits and probs [tokens, E], and the capacity used."""

    experts: torch.Tensor
    gates: torch.Tensor
    slots: torch.Tensor
    logits: torch.Tensor
    probs: torch.Tensor
    capacity: int

    @property
    def num_experts(self) -> int:
        return self.probs.shape[-1]

    @property
    def kept(self) -> torch.Tensor:
        return self.slots >= 0  # [tokens, k]

    def tokens_per_expert(self) -> torch.Tensor:
        """Choices each expert processes (kept ones), [E] int64."""
        return torch.bincount(self.experts[self.kept], minlength=self.num_experts)

    def dropped(self) -> int:
        return int((~self.kept).sum())

    def aux_loss(self) -> torch.Tensor:
        return load_balancing_loss(self.probs, self.experts, self.num_experts)


class Router(nn.Module):
    """A linear router (no bias): `forward(x)` gives the logits [tokens, E]; `route(x)` the
    Routing of tokens x [tokens, hidden] (softmax, top-k, capacity).

    The gates are the chosen experts' probabilities under the softmax over all E experts, as
    GShard and Switch Transformers weigh them (they sum to less than 1 for k < E). With
    `normalize_gates=True` they are renormalised over the k chosen (divided by their sum), as
    Mixtral's are: the same as a softmax over the k chosen logits."""

    def __init__(self, hidden: int, num_experts: int, k: int = 1, capacity_factor: float = 1.25,
                 normalize_gates: bool = False):
        super().__init__()
        expert_capacity(1, num_experts, k, capacity_factor)  # bad sizes fail here, with what to change
        self.num_experts, self.k, self.capacity_factor = num_experts, k, capacity_factor
        self.normalize_gates = normalize_gates
        self.weight = nn.Parameter(nn.Linear(hidden, num_experts, bias=False).weight.detach())  # [E, hidden]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[-1] != self.weight.shape[1]:
            raise ValueError(f"the router takes tokens [tokens, {self.weight.shape[1]}], got {list(x.shape)}: "
                             f"flatten the batch and give each token width {self.weight.shape[1]} (the hidden size)")
        return F.linear(x, self.weight)  # [tokens, E]

    def route(self, x: torch.Tensor) -> Routing:
        logits = self(x)
        probs = logits.float().softmax(-1).to(x.dtype)
        capacity = expert_capacity(x.shape[0], self.num_experts, self.k, self.capacity_factor)
        experts, gates, slots = top_k_route(probs, self.k, capacity)
        if self.normalize_gates:
            gates = gates / gates.sum(-1, keepdim=True)  # [tokens, k], each row summing to 1
        return Routing(experts, gates, slots, logits, probs, capacity)
