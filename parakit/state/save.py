"""Sharded save: every rank writes its own file, rank 0 writes the index last."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from parakit.groups import global_rank
from parakit.state.boxes import overlap, volume
from parakit.state.index import FORMAT, INDEX, CheckpointError, dtype_named, piece_chunks, rank_file
from parakit.state.shards import Shard

__all__ = ["save"]


def save(folder: str | Path, shards: Sequence[Shard], group=None) -> None:
    """Save a sharded state into `folder` (new, or left by a save that did not finish), on a
    file system every rank of `group` (None: the world) shares. Each rank writes the shards it
    `writes` to its own file, rank{N}.bin (N: its rank in the group; none if it writes
    nothing); then rank 0 checks that the pieces tile every tensor exactly once and writes
    index.json last, to a temporary name renamed into place: a folder without it is ignored.

    Sends: one gather_object of each rank's pieces to rank 0 (names, shapes, slices: about a
    hundred bytes a shard; no tensor data), one broadcast_object_list of rank 0's verdict.
    Raises CheckpointError on every rank if any rank failed (no index is written then)."""
    folder, rank, first = Path(folder), dist.get_rank(group), global_rank(group, 0)
    try:
        report = {"pieces": _write_rank_file(folder, shards, rank)}
    except CheckpointError as error:
        report = {"error": str(error)}
    reports = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object(report, reports, dst=first, group=group)
    verdict = [_commit(folder, reports) if rank == 0 else None]
    dist.broadcast_object_list(verdict, src=first, group=group)
    if verdict[0] is not None:
        raise CheckpointError(verdict[0])


def _write_rank_file(folder: Path, shards: Sequence[Shard], rank: int) -> list[tuple]:
    """Write this rank's shards; return (name, shape, dtype, piece or None) for every shard."""
    names = [s.name for s in shards]
    if len(set(names)) < len(names):
        raise CheckpointError(f"the shards name {sorted({n for n in names if names.count(n) > 1})} more than once: "
                              f"give each of this rank's shards its own name")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CheckpointError(f"cannot write the checkpoint folder {folder} ({error.strerror or error}): pick a "
                              f"folder this process can create and write") from None
    if (folder / INDEX).exists():
        raise CheckpointError(f"{folder} already holds a complete checkpoint ({INDEX}): save each checkpoint to a "
                              f"new folder (e.g. one per step), or delete that one first")
    mine = [s for s in shards if s.writes and s.tensor.numel()]
    pieces, path = {}, folder / rank_file(rank)
    try:
        if mine:
            with open(path, "wb") as f:
                for s in mine:
                    pieces[s.name] = {"file": path.name, "byte_offset": f.tell(), "offsets": list(s.offsets),
                                      "lengths": list(s.lengths), "flat": s.flat}
                    f.write(_raw(s.tensor))
                f.flush()
                os.fsync(f.fileno())  # on disk before the index names it
    except OSError as error:
        raise CheckpointError(f"cannot write {path} ({error.strerror or error}): pick a folder this process can "
                              f"write, with room for the shards") from None
    return [(s.name, tuple(s.global_shape), str(s.dtype), pieces.get(s.name)) for s in shards]


def _raw(tensor: torch.Tensor):
    """The tensor's bytes, row-major, as a buffer."""
    return tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()  # [numel * itemsize]


def _commit(folder: Path, reports: list[dict]) -> str | None:
    """On rank 0: merge the ranks' pieces, check them, write the index; the error, or None."""
    failed = {r: rep["error"] for r, rep in enumerate(reports) if "error" in rep}
    if failed:
        return str(CheckpointError.of_ranks(f"save to {folder} failed; no {INDEX} written:", failed))
    tensors, seen = {}, {}
    for r, rep in enumerate(reports):
        for name, shape, dtype, piece in rep["pieces"]:
            entry = tensors.setdefault(name, {"shape": list(shape), "dtype": dtype, "pieces": []})
            seen.setdefault(name, r)
            if (tuple(entry["shape"]), entry["dtype"]) != (shape, dtype):
                return (f"save to {folder}: rank {seen[name]} holds {name!r} as global shape {tuple(entry['shape'])}"
                        f" {entry['dtype']} but rank {r} as {shape} {dtype}: describe it alike on every rank")
            if piece is not None:
                entry["pieces"].append(piece)
    problem = next(filter(None, (_tiling_problem(name, t) for name, t in tensors.items())), None)
    if problem:
        return f"save to {folder}: {problem}; no {INDEX} written"
    return _write_index(folder, tensors)


def _tiling_problem(name: str, tensor: dict) -> str | None:
    """Why the written pieces of `tensor` do not hold each element exactly once, or None."""
    shape = tuple(tensor["shape"])
    chunks = [c for piece in tensor["pieces"] for c in piece_chunks(name, piece, shape, dtype_named(tensor["dtype"]))]
    for i, a in enumerate(chunks):
        for b in chunks[i + 1:]:
            if overlap(a.box, b.box):
                return (f"{a.file} and {b.file} both hold the part {overlap(a.box, b.box)} (offsets, lengths) of "
                        f"{name!r}: a replicated tensor is written by one rank only (replicated(name, tensor, "
                        f"*groups) lets the first rank of its groups write it)")
    held = sum(volume(c.box[1]) for c in chunks)
    if held != volume(shape):
        return (f"the ranks write {held} of the {volume(shape)} elements of {name!r} {shape}: every part must be "
                f"written by some rank (a Shard with writes=True)")
    return None


def _write_index(folder: Path, tensors: dict) -> str | None:
    """Write index.json through a temporary name and os.replace; the error, or None."""
    temporary = folder / (INDEX + ".tmp")
    try:
        with open(temporary, "w") as f:
            json.dump({"format": FORMAT, "tensors": tensors}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, folder / INDEX)
    except OSError as error:
        return f"cannot write {folder / INDEX} ({error.strerror or error}); the checkpoint is incomplete"
    return None
