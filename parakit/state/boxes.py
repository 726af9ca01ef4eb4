"""Boxes: the geometry of resharding (no communication).

A box is a slice of a global tensor, an offset and a length per dimension. Every piece a
checkpoint holds and every piece a rank asks for is a box, or a range of the tensor
flattened in row-major order, which `flat_boxes` cuts into at most 2 x ndim - 1 boxes, each
one run of consecutive elements. Loading is then box against box: `overlap` finds the
common box, `region` indexes it inside either side.
"""
from __future__ import annotations

import math
from typing import Sequence

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, lengths), one of each per dimension

__all__ = ["Box", "flat_boxes", "flat_index", "overlap", "region", "volume"]


def volume(lengths: Sequence[int]) -> int:
    """Elements in a box of these lengths (1 for a scalar's empty tuple)."""
    return math.prod(lengths)


def flat_index(offsets: Sequence[int], shape: Sequence[int]) -> int:
    """The row-major position of the element at `offsets` in a tensor of `shape`."""
    index = 0
    for o, n in zip(offsets, shape):
        index = index * n + o
    return index


def flat_boxes(start: int, stop: int, shape: Sequence[int]) -> list[Box]:
    """The elements [start, stop) of a tensor of `shape` flattened row-major, as boxes in
    that order, each a run of consecutive elements: a partial first row, whole rows, a
    partial last row, and so on down the dimensions."""
    shape = tuple(shape)
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,) * len(shape), (stop - start,) * len(shape))]
    inner = volume(shape[1:])  # elements in one row of dim 0
    first, last = start // inner, (stop - 1) // inner
    if first == last:  # inside one row: cut that row
        return [((first, *o), (1, *n)) for o, n in flat_boxes(start - first * inner, stop - first * inner, shape[1:])]
    boxes = []
    if start % inner:  # the first row's tail
        boxes += flat_boxes(start, (first + 1) * inner, shape)
        first += 1
    whole = stop // inner  # rows [first, whole) are whole
    if whole > first:
        boxes.append(((first, *[0] * (len(shape) - 1)), (whole - first, *shape[1:])))
    return boxes + flat_boxes(max(whole, first) * inner, stop, shape)


def overlap(a: Box, b: Box) -> Box | None:
    """The box common to `a` and `b`, or None where they share no element."""
    offsets = tuple(max(oa, ob) for oa, ob in zip(a[0], b[0]))
    ends = tuple(min(oa + na, ob + nb) for oa, na, ob, nb in zip(a[0], a[1], b[0], b[1]))
    if any(e <= o for o, e in zip(offsets, ends)):
        return None
    return offsets, tuple(e - o for o, e in zip(offsets, ends))


def region(box: Box, within: Box) -> tuple[slice, ...]:
    """The index of `box` inside a tensor that holds the box `within`."""
    return tuple(slice(o - w, o - w + n) for o, n, w in zip(box[0], box[1], within[0]))
