"""Resharding load: each rank fills its own slices, whatever mesh saved the checkpoint.

Three steps, and nothing changes until every rank of the group has passed the first two:
plan (which stored chunks overlap which of this rank's boxes, checked against names, shapes
and dtypes), read (only the files holding those chunks, each opened once, checked for
length first), copy (only the overlapping regions, into the shards' tensors in place).
"""
from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from parakit.state.boxes import overlap, region, volume
from parakit.state.index import CheckpointError, Chunk, Entry, read_catalog
from parakit.state.shards import Shard

__all__ = ["load", "plan", "read_chunks"]


@dataclass(frozen=True)
class Copy:
    """One region to copy: `source` indexes it inside `chunk`'s tensor, `target` is the view
    of a shard's tensor it fills."""
    chunk: Chunk
    source: tuple[slice, ...]
    target: torch.Tensor


def load(folder: str | Path, shards: Sequence[Shard], group=None) -> list[str]:
    """Fill every shard's tensor, in place, from the checkpoint in `folder` (parakit's or
    dcp.save's), saved on any mesh: each rank plans, checks and reads what its own slices
    need, then copies. Returns the files this rank read, sorted. It reads each stored chunk
    that overlaps its slices whole, and holds them until every rank's verdict is in.

    Sends: one all_gather_object over `group` (None: the world) of each rank's tensor names
    and verdict (no tensor data; the data comes from the files). If any rank found a problem,
    or the checkpoint holds a tensor no rank asked for, every rank raises the same
    CheckpointError and no tensor has changed."""
    folder = Path(folder)
    try:
        catalog = read_catalog(folder)
        copies = plan(folder, catalog, shards)
        data, files = read_chunks(folder, {c.chunk for c in copies})
        verdict = None
    except CheckpointError as error:
        catalog, copies, data, files, verdict = {}, [], {}, [], str(error)
    views = [None] * dist.get_world_size(group)
    dist.all_gather_object(views, ([s.name for s in shards], verdict), group=group)
    failed = {r: v for r, (_, v) in enumerate(views) if v is not None}
    if failed:
        raise CheckpointError.of_ranks(f"load from {folder} failed; nothing was loaded:", failed)
    extra = sorted(set(catalog) - {name for names, _ in views for name in names})
    if extra:
        raise CheckpointError(f"load from {folder} failed; nothing was loaded: the checkpoint holds {extra}, which "
                              f"no rank asked for: pass shards for them too, or load a checkpoint of this model")
    with torch.no_grad():
        for c in copies:
            c.target.copy_(data[c.chunk][c.source])
    return files


def plan(folder: Path, catalog: dict[str, Entry], shards: Sequence[Shard]) -> list[Copy]:
    """The copies that fill `shards` from the stored chunks, after checking each shard
    against the checkpoint; raises CheckpointError naming the tensor and what differs."""
    copies = []
    for shard in shards:
        _check(folder, shard, catalog.get(shard.name))
        filled, needed = 0, 0
        for box, view in shard.boxes():
            needed += volume(box[1])
            for chunk in catalog[shard.name].chunks:
                common = overlap(chunk.box, box)
                if common:
                    copies.append(Copy(chunk, region(common, chunk.box), view[region(common, box)]))
                    filled += volume(common[1])
        if filled != needed:
            raise CheckpointError(f"tensor {shard.name!r}: checkpoint {folder} holds {filled} of the {needed} elements "
                                  f"this rank's slice needs: it was saved incompletely; load another checkpoint")
    return copies


def _check(folder: Path, shard: Shard, entry: Entry | None) -> None:
    if entry is None:
        raise CheckpointError(f"tensor {shard.name!r} is not in checkpoint {folder}: load a checkpoint of this "
                              f"model, or leave {shard.name!r} out of the shards")
    if entry.shape is None:
        raise CheckpointError(f"{shard.name!r} is not a tensor in checkpoint {folder} (DCP stored it as bytes): "
                              f"load it with dcp.load")
    if tuple(shard.global_shape) != entry.shape:
        raise CheckpointError(f"tensor {shard.name!r}: global shape {tuple(shard.global_shape)} here, "
                              f"{entry.shape} in checkpoint {folder}: build the model with the sizes it was saved with")
    if shard.dtype != entry.dtype:
        raise CheckpointError(f"tensor {shard.name!r}: dtype {shard.dtype} here, {entry.dtype} in checkpoint "
                              f"{folder}: make the model {entry.dtype} to load it (cast it after)")


def read_chunks(folder: Path, chunks: Iterable[Chunk]) -> tuple[dict[Chunk, torch.Tensor], list[str]]:
    """Each chunk's tensor (on the CPU), opening each file once after checking that it holds
    the bytes asked of it; and the files read, sorted. No communication."""
    by_file: dict[str, list[Chunk]] = {}
    for chunk in chunks:
        by_file.setdefault(chunk.file, []).append(chunk)
    data = {}
    for name, mine in sorted(by_file.items()):
        path = folder / name
        _check_length(path, mine)
        with open(path, "rb") as f:
            for chunk in sorted(mine, key=lambda c: c.byte_offset):
                f.seek(chunk.byte_offset)
                data[chunk] = _decode(path, chunk, f.read(chunk.nbytes))
    return data, sorted(by_file)


def _check_length(path: Path, chunks: list[Chunk]) -> None:
    """Raise naming the file and a tensor in it if the file is missing or too short."""
    last = max(chunks, key=lambda c: c.byte_offset + c.nbytes)
    if not path.is_file():
        raise CheckpointError(f"shard file {path} is missing (it holds part of tensor {last.name!r}): the "
                              f"checkpoint is damaged; load an earlier one")
    size = os.path.getsize(path)
    if size < last.byte_offset + last.nbytes:
        raise CheckpointError(f"shard file {path} is truncated: tensor {last.name!r} needs bytes up to "
                              f"{last.byte_offset + last.nbytes}, the file has {size}; load an earlier checkpoint")


def _decode(path: Path, chunk: Chunk, raw: bytes) -> torch.Tensor:
    """A chunk's bytes as its tensor: raw row-major (parakit) or torch.save'd (DCP)."""
    if chunk.encoding == "raw":
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(chunk.dtype).view(chunk.box[1])
    try:
        tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as error:  # a damaged file: whatever torch.load raises, said as the file's fault
        raise CheckpointError(f"shard file {path}: tensor {chunk.name!r} at byte {chunk.byte_offset} does not load "
                              f"({type(error).__name__}: {error}); load an earlier checkpoint") from None
    if tuple(tensor.shape) != chunk.box[1] or tensor.dtype != chunk.dtype:
        raise CheckpointError(f"shard file {path}: tensor {chunk.name!r} at byte {chunk.byte_offset} is "
                              f"{tuple(tensor.shape)} {tensor.dtype}, its metadata says {chunk.box[1]} {chunk.dtype}")
    return tensor
