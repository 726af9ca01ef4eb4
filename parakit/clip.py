"""Global-norm gradient clipping on a DP x TP x PP mesh, and the token-weighted loss.

The global norm is the 2-norm of every gradient element of the whole model, each counted
once, as `torch.nn.utils.clip_grad_norm_` computes it in one process. On a mesh each rank
holds some of those elements, and how it holds a parameter decides how it is counted:

    split over tp    ColumnParallelLinear's weight and bias, RowParallelLinear's weight,
                     VocabParallelEmbedding's weight: summed over the tp group
    replicated       every other parameter (layer norms, RowParallelLinear's bias,
    over tp          parakit.train's embeddings and head): counted on tp rank 0 only
    split over ep    ExpertParallelMoE's experts: summed over the ep group, the rest on ep rank 0
    FSDP shards      FullyShardedDataParallel's shards (its group is dp): summed over dp, the
                     rest on dp rank 0
    dp replicas      after DDP's all-reduce every replica holds the same gradient: not summed
    pp stages        each stage holds its own layers: summed over pp, last

parakit's layers carry no mark saying they are split: `split_places` reads it from the
module types above, walking the model (a layer split some other way, such as parallel3d's,
is not known to it and would count as replicated).
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parakit.devices import device
from parakit.mesh import Mesh
from parakit.moe import ExpertParallelMoE
from parakit.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from parakit.zero import FullyShardedDataParallel

__all__ = ["AXES", "split_places", "clip_grad_norm_", "token_weighted_loss"]

AXES = ("tp", "dp", "ep", "pp")  # the order of the all-reduces: within a stage first, pp last
_SPLIT_OVER_TP = {ColumnParallelLinear: ("weight", "bias"), RowParallelLinear: ("weight",),
                  VocabParallelEmbedding: ("weight",)}


def split_places(model: nn.Module) -> tuple[dict[tuple[int, str], str], list[tuple[str, str, object]]]:
    """Where `model` splits parameters: {(id(module), parameter name): axis} for each split
    parameter, and (layer type, axis, its group) for each splitting layer. No communication."""
    places, layers = {}, []
    for m in model.modules():
        names = next((n for kind, n in _SPLIT_OVER_TP.items() if isinstance(m, kind)), None)
        if names:
            places.update({(id(m), n): "tp" for n in names})
            layers.append((type(m).__name__, "tp", m.group))
        elif isinstance(m, ExpertParallelMoE):
            places.update({(id(sub), n): "ep" for sub in m.experts.modules() for n in sub._parameters})
            layers.append(("ExpertParallelMoE", "ep", m.group))
        elif isinstance(m, FullyShardedDataParallel):
            layers.append(("FullyShardedDataParallel", "dp", m.group))
    return places, layers


def _axis_groups(mesh_or_groups) -> dict:
    """{axis: process group} from a Mesh, or a dict of groups by axis (a group None: the world;
    an axis left out: one rank)."""
    if isinstance(mesh_or_groups, Mesh):
        return {a: getattr(mesh_or_groups, f"{a}_group") for a in AXES
                if getattr(mesh_or_groups, f"{a}_group") is not None}
    if not isinstance(mesh_or_groups, Mapping) or set(mesh_or_groups) - set(AXES):
        raise TypeError(f"mesh_or_groups must be a parakit.mesh.Mesh or a dict of process groups by axis, keys among "
                        f"{AXES}, got {mesh_or_groups!r}")
    return dict(mesh_or_groups)


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def _check_layers(layers, groups: dict) -> set[str]:
    """The axes the layers split over, after checking each layer's group is the mesh's."""
    for kind, axis, group in layers:
        size = dist.get_world_size(group)
        if axis in groups and _ranks(group) != _ranks(groups[axis]):
            raise ValueError(f"a {kind} of the model is split over ranks {_ranks(group)}, but the mesh's {axis} group "
                             f"is {_ranks(groups[axis])}: build the model with the mesh's {axis}_group")
        if axis not in groups and size > 1:
            raise ValueError(f"a {kind} of the model is split over {size} ranks {_ranks(group)}, but mesh_or_groups "
                             f"has no {axis} group: pass the mesh, or add {axis!r}: its group")
    return {axis for _, axis, _ in layers}


def _pieces(model: nn.Module, places: dict):
    """(gradient, the axes its elements are split over) for every gradient of the model,
    tied parameters once; an FSDP shard in one piece per parameter it holds a part of."""
    seen = set()
    for m in model.modules():
        if isinstance(m, FullyShardedDataParallel):
            seen |= {id(u.shard) for u in m.units}
            yield from _fsdp_pieces(m, places)
        for name, p in m._parameters.items():
            if p is not None and p.grad is not None and id(p) not in seen:
                seen.add(id(p))
                yield p.grad, {places.get((id(m), name))}


def _fsdp_pieces(fsdp: FullyShardedDataParallel, places: dict):
    """This rank's part of each parameter in each unit's shard ([chunk], padding left out)."""
    low = dist.get_rank(fsdp.group)
    for unit in fsdp.units:
        if unit.shard.grad is not None:
            start = low * unit.chunk
            for a, b, ((owner, name), *_) in zip(unit.offsets, unit.offsets[1:], unit.locations):
                part = unit.shard.grad[max(a - start, 0):max(min(b - start, unit.chunk), 0)]  # [this rank's part]
                yield part, {"dp", places.get((id(owner), name))}


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, mesh_or_groups) -> torch.Tensor:
    """Scale this rank's gradients of `model` (its stages, wrapped or not) in place so that the
    whole model's gradient 2-norm is at most `max_norm`, exactly as
    torch.nn.utils.clip_grad_norm_ does in one process; returns the norm before clipping.

    `mesh_or_groups`: a parakit.mesh.Mesh, or a dict {axis: process group} with axes among
    AXES (a group None: the world; an axis left out: one rank; {} in one process).
    Sends: one all-reduce of one float (4 bytes) over each of tp, dp (only with FSDP), ep (only
    with ExpertParallelMoE) and pp, where that group has more than one rank, in that order.
    Call it after the gradients are final (DDP's finish_gradient_synchronization). A non-finite
    norm raises FloatingPointError on every rank alike, the gradients untouched: skip the step.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}: it is the largest 2-norm the gradients may keep")
    groups = _axis_groups(mesh_or_groups)
    places, layers = split_places(model)
    summed = _check_layers(layers, groups) | {"tp", "pp"}  # dp and ep only where something is split over them
    reduced = [a for a in AXES if a in summed and a in groups and dist.get_world_size(groups[a]) > 1]
    not_first = {a for a in reduced if a != "pp" and dist.get_rank(groups[a]) > 0}  # rank 0 there counts the copies
    squares = torch.zeros(1, device=device())
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    for grad, axes in _pieces(model, places):
        if not not_first - axes:  # split over every axis where this rank is not the first
            squares += torch.linalg.vector_norm(grad, dtype=torch.float32).square()
    for axis in reduced:
        dist.all_reduce(squares, group=groups[axis])
    total = squares.sqrt()[0]
    if not math.isfinite(total.item()):
        raise FloatingPointError(f"the gradients' global norm is {total.item()}: some gradient holds inf or nan; "
                                 f"skip this step (or lower the loss scale), the gradients are left unclipped")
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)  # torch's: no change when the norm is below max_norm
    for grad in grads:
        grad.mul_(coef.to(grad.dtype))
    return total


class _TokenWeightedMean(torch.autograd.Function):
    """Forward: all-reduce (this rank's sum of token losses, its token count) over `group`,
    two float64s (16 bytes); the mean over every token. Backward: no communication; the local
    sum gets n / count (n ranks), so that DDP's mean over the group gives each token 1 / count,
    as in one process."""

    @staticmethod
    def forward(ctx, local_sum, local_count, group):
        totals = torch.stack([local_sum.detach().double(), local_count.double()])  # [2]
        dist.all_reduce(totals, group=group)
        if totals[1] == 0:
            raise ValueError("token_weighted_loss: no rank of the group has a token to average over (every target is "
                             "ignore_index): give each step some targets that are not ignored")
        ctx.scale = dist.get_world_size(group) / totals[1].item()
        return (totals[0] / totals[1]).to(local_sum.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None, None


def token_weighted_loss(logits: torch.Tensor, target: torch.Tensor, group=None, ignore_index: int = -100):
    """The cross-entropy averaged over every token that counts on every rank of `group` (the
    data-parallel group whose gradients are then averaged; None: the world), equal to one
    process's loss over all of them when ranks hold different numbers of tokens (padding,
    ignore_index). logits [..., vocab], target [...]. Sends one all-reduce of two float64s."""
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"token_weighted_loss: logits {tuple(logits.shape)} and target {tuple(target.shape)} "
                         f"disagree: logits must be target's shape plus the vocabulary dimension")
    losses = F.cross_entropy(logits.flatten(0, -2), target.flatten(), ignore_index=ignore_index, reduction="sum")
    count = (target != ignore_index).sum()
    return _TokenWeightedMean.apply(losses, count, group)
