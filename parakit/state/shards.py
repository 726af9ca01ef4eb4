"""What a rank holds of each global tensor: `Shard`, and the helpers that describe parakit's
layouts with it (no communication: each rank describes its own).

    replicated             the whole tensor on every rank of some groups; the first rank writes it
    split                  evenly split along one dim over a group (tensor-parallel columns or rows)
    tensor_parallel_shards every parameter of a model built from parakit.tensor_parallel layers
    fsdp_shards            ZeRO-3's flat shards: each parameter's share of its unit's flat buffer,
                           a range of the parameter flattened (not a box)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from parakit.state.boxes import Box, flat_boxes, flat_index, volume
from parakit.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

__all__ = ["Shard", "replicated", "split", "tensor_parallel_shards", "fsdp_shards"]


@dataclass(frozen=True, eq=False)
class Shard:
    """This rank's piece of the global tensor `name` of `global_shape`: `tensor` holds the box
    `offsets`/`lengths` (one each per dim), or with `flat=True` the elements
    [offsets[0], offsets[0] + lengths[0]) of the tensor flattened row-major (tensor 1-D).
    `save` writes it only where `writes` (one rank of those holding a replicated tensor);
    `load` copies into `tensor` in place."""
    name: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    flat: bool = False
    writes: bool = True

    def __post_init__(self):
        dims = 1 if self.flat else len(self.global_shape)
        size = (volume(self.global_shape),) if self.flat else tuple(self.global_shape)
        if len(self.offsets) != dims or len(self.lengths) != dims or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(self.offsets, self.lengths, size)):
            raise ValueError(f"shard {self.name!r}: offsets {self.offsets} and lengths {self.lengths} do not lie "
                             f"inside {'the flattened ' if self.flat else ''}global shape {tuple(size)}")
        if tuple(self.tensor.shape) != tuple(self.lengths):
            raise ValueError(f"shard {self.name!r}: its tensor has shape {tuple(self.tensor.shape)} but the slice "
                             f"it holds has lengths {self.lengths}: pass the tensor of exactly that slice")
        if self.flat and self.tensor.numel() > 1 and self.tensor.stride(0) != 1:
            raise ValueError(f"shard {self.name!r}: a flat shard's tensor must be contiguous (it is viewed as boxes); "
                             f"pass a slice of a contiguous 1-D tensor")

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def boxes(self) -> list[tuple[Box, torch.Tensor]]:
        """Each box of the global tensor this shard holds, with the view of `tensor` holding it."""
        if not self.flat:
            return [((tuple(self.offsets), tuple(self.lengths)), self.tensor)] if volume(self.lengths) else []
        start, out = self.offsets[0], []
        for box in flat_boxes(start, start + self.lengths[0], self.global_shape):
            first = flat_index(box[0], self.global_shape) - start
            out.append((box, self.tensor[first:first + volume(box[1])].view(box[1])))
        return out


def _first_everywhere(groups) -> bool:
    return all(dist.get_rank(g) == 0 for g in groups)


def replicated(name: str, tensor: torch.Tensor, *groups) -> Shard:
    """The whole `tensor`, held alike by every rank of `groups` (none given: the world);
    written only by the rank that is first in every one of them (the lowest rank holding it)."""
    shape = tuple(tensor.shape)
    return Shard(name, tensor, shape, (0,) * len(shape), shape, writes=_first_everywhere(groups or (None,)))


def split(name: str, tensor: torch.Tensor, dim: int, group, *replicas) -> Shard:
    """This rank's `tensor`, the rank-th of equal parts of the global tensor along `dim` over
    `group` (None: the world), as ColumnParallelLinear (dim 0) and RowParallelLinear (dim 1)
    keep their weights; held alike by every rank of `replicas` (e.g. the dp group), whose
    first rank writes it."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    dim = dim % tensor.dim()
    shape = tuple(s * n if d == dim else s for d, s in enumerate(tensor.shape))  # [..., dim * n, ...]
    offsets = tuple(rank * s if d == dim else 0 for d, s in enumerate(tensor.shape))
    return Shard(name, tensor, shape, offsets, tuple(tensor.shape), writes=_first_everywhere(replicas))


_SPLIT_DIMS = {(ColumnParallelLinear, "weight"): 0, (ColumnParallelLinear, "bias"): 0,
               (RowParallelLinear, "weight"): 1, (VocabParallelEmbedding, "weight"): 0}


def tensor_parallel_shards(module: nn.Module, tp_group, dp_group=None, prefix: str = "") -> list[Shard]:
    """Every parameter of `module` (named as named_parameters does, after `prefix`): the
    column-, row- and vocab-parallel layers' split over their layer's group, the rest (layer
    norms, a row layer's bias) replicated over `tp_group`; all of them replicated over
    `dp_group` where given (None: no data-parallel replicas)."""
    replicas = () if dp_group is None else (dp_group,)
    shards = []
    for name, p in module.named_parameters():
        path, _, key = name.rpartition(".")
        sub = module.get_submodule(path)
        dim = _SPLIT_DIMS.get((type(sub), key))
        shards.append(replicated(prefix + name, p.detach(), tp_group, *replicas) if dim is None else
                      split(prefix + name, p.detach(), dim, sub.group, *replicas))
    return shards


def fsdp_shards(fsdp, prefix: str = "", flats=None) -> list[Shard]:
    """What a rank of parakit's FullyShardedDataParallel holds: each trainable parameter's
    share of its unit's flat shard, a range of the parameter flattened (flat=True; maybe
    empty), under its first name (a tied parameter once); frozen parameters whole, replicated
    over the group; the padding at the end of a unit is not state and is not saved.
    `flats`: one tensor per unit laid out as its shard (e.g. AdamW's exp_avg of each shard,
    with prefix "exp_avg."); default the shards themselves."""
    rank = dist.get_rank(fsdp.group)
    flats = [unit.shard for unit in fsdp.units] if flats is None else flats
    shards, seen = [], set()
    for name, where in fsdp.names.items():
        if not isinstance(where, tuple):  # a frozen parameter, whole on every rank
            shards.append(replicated(prefix + name, where.detach(), fsdp.group))
        elif where not in seen:
            seen.add(where)
            unit, at = fsdp.units[where[0]], where[1]
            first, end = unit.offsets[at], unit.offsets[at + 1]  # the parameter in the unit's flat buffer
            lo, hi = max(first, rank * unit.chunk), min(end, (rank + 1) * unit.chunk)  # its part in this chunk
            mine = flats[where[0]].detach()[lo - rank * unit.chunk:][:max(hi - lo, 0)]  # [hi - lo]
            shards.append(Shard(prefix + name, mine, tuple(unit.shapes[at]), (min(lo, end) - first,),
                                (max(hi - lo, 0),), flat=True))
    return shards
