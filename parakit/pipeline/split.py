"""Cutting a model into pipeline stages: `balance` says how many layers each stage gets
(as torchgpipe's `balance=[2, 2]`), or split points say where the cuts go."""
from __future__ import annotations

from typing import Sequence

from torch import nn


def split_stages(model: nn.Sequential | Sequence[nn.Module], balance: Sequence[int]) -> list[nn.Sequential]:
    """The stages of `model`: stage s is an nn.Sequential of the next `balance[s]` layers.

    The stages share their layers (and parameters) with `model`: gradients computed in a
    stage land in the model's own parameters.
    """
    layers = list(model)
    balance = list(balance)
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in balance):
        raise ValueError(f"balance {balance} must list at least one layer per stage (positive ints)")
    if sum(balance) != len(layers):
        raise ValueError(f"balance {balance} sums to {sum(balance)} layers but the model has {len(layers)}: "
                         f"change balance so that its entries add up to {len(layers)}")
    bounds = [sum(balance[:s]) for s in range(len(balance) + 1)]
    return [nn.Sequential(*layers[a:b]) for a, b in zip(bounds, bounds[1:])]


def balance_from_split_points(split_points: Sequence[int], num_layers: int) -> list[int]:
    """The balance that cuts `num_layers` layers before each index in `split_points`:
    split points [2, 5] of 8 layers give stages of layers 0-1, 2-4 and 5-7, balance [2, 3, 3]."""
    points = [0, *split_points, num_layers]
    if any(b <= a for a, b in zip(points, points[1:])):
        raise ValueError(f"split points {list(split_points)} must increase strictly inside (0, {num_layers}): "
                         f"each stage needs at least one of the model's {num_layers} layers")
    return [b - a for a, b in zip(points, points[1:])]
