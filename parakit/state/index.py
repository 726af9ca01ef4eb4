"""The two formats a checkpoint folder may hold, read into one catalog (no communication).

parakit's: one file per writing rank, `rank{N}.bin`, each shard's bytes raw and row-major one
after another, and `index.json`, written last, which names for every tensor its global shape,
its dtype and its pieces: the file, the byte offset, the slice (a box, or a flat range).

    {"format": "parakit.state/1", "tensors": {"fc1.weight": {"shape": [10, 6], "dtype": "torch.float32",
     "pieces": [{"file": "rank0.bin", "byte_offset": 0, "offsets": [0], "lengths": [18], "flat": true}, ...]}}}

torch.distributed.checkpoint's (`dcp.save` with FileSystemWriter): `.distcp` files, each
chunk a torch.save'd tensor, and `.metadata`, written last, with each tensor's chunks
(offsets and sizes) and where each lies (file, byte offset, length).

`read_catalog` reads either into {name: Entry}: every stored piece as boxes (`Chunk`) with
the bytes holding it, what `load` and `Reader` plan from.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata
from torch.distributed.checkpoint.metadata import MetadataIndex

from parakit.state.boxes import Box, flat_boxes, flat_index, volume

__all__ = ["INDEX", "FORMAT", "CheckpointError", "Chunk", "Entry", "rank_file", "read_catalog", "read_index",
           "read_dcp", "is_complete", "latest"]

INDEX, FORMAT, DCP_METADATA = "index.json", "parakit.state/1", ".metadata"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded as asked; the message says what differs."""

    @classmethod
    def of_ranks(cls, what: str, errors: dict[int, str]) -> "CheckpointError":
        """One error for every rank: `what`, then each distinct message with the ranks that met it."""
        ranks: dict[str, list[int]] = {}
        for rank, text in sorted(errors.items()):
            ranks.setdefault(text, []).append(rank)
        return cls("\n".join([what] + [f"  rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}: {text}"
                                         for text, r in ranks.items()]))


@dataclass(frozen=True)
class Chunk:
    """A box of the global tensor `name` stored in `file` (relative to the folder): `nbytes`
    bytes at `byte_offset`, raw and row-major (`encoding` "raw", parakit's) or one
    torch.save'd tensor ("torch_save", DCP's)."""
    name: str
    box: Box
    dtype: torch.dtype
    file: str
    byte_offset: int
    nbytes: int
    encoding: str


@dataclass(frozen=True)
class Entry:
    """A stored tensor: its global shape, dtype and chunks; shape and dtype are None for an
    object DCP stored as bytes (not a tensor)."""
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    chunks: tuple[Chunk, ...]


def rank_file(rank: int) -> str:
    return f"rank{rank}.bin"


def dtype_named(text: str) -> torch.dtype:
    """The dtype `str(dtype)` wrote ("torch.bfloat16")."""
    dtype = getattr(torch, text.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"the index names the dtype {text!r}, which this torch does not know")
    return dtype


def piece_chunks(name: str, piece: dict, shape: tuple[int, ...], dtype: torch.dtype) -> list[Chunk]:
    """A piece of `name` in the index as chunks: itself, or each box of its flat range with its bytes."""
    offsets, lengths, size = tuple(piece["offsets"]), tuple(piece["lengths"]), dtype.itemsize
    if not piece["flat"]:
        return [Chunk(name, (offsets, lengths), dtype, piece["file"], piece["byte_offset"], volume(lengths) * size,
                      "raw")]
    start = offsets[0]
    return [Chunk(name, box, dtype, piece["file"], piece["byte_offset"] + (flat_index(box[0], shape) - start) * size,
                  volume(box[1]) * size, "raw") for box in flat_boxes(start, start + lengths[0], shape)]


def read_index(folder: Path) -> dict[str, Entry]:
    """parakit's index of `folder` as a catalog."""
    try:
        record = json.loads((Path(folder) / INDEX).read_text())
    except ValueError as error:
        raise CheckpointError(f"{Path(folder) / INDEX} is not an index ({error}): the checkpoint is damaged; load "
                              f"an earlier one") from None
    if record.get("format") != FORMAT:
        raise CheckpointError(f"{Path(folder) / INDEX} has format {record.get('format')!r}, not {FORMAT!r}: it was "
                              f"not written by this parakit.state")
    catalog = {}
    for name, t in record["tensors"].items():
        shape, dtype = tuple(t["shape"]), dtype_named(t["dtype"])
        chunks = (c for piece in t["pieces"] for c in piece_chunks(name, piece, shape, dtype))
        catalog[name] = Entry(shape, dtype, tuple(chunks))
    return catalog


def read_dcp(folder: Path) -> dict[str, Entry]:
    """A dcp.save checkpoint's metadata (FileSystemReader.read_metadata) as a catalog."""
    metadata, catalog = FileSystemReader(folder).read_metadata(), {}
    for name, stored in metadata.state_dict_metadata.items():
        if not isinstance(stored, TensorStorageMetadata):
            catalog[name] = Entry(None, None, ())
            continue
        chunks = []
        for c in stored.chunks:
            info = metadata.storage_data[MetadataIndex(name, c.offsets)]
            if info.transform_descriptors:
                raise CheckpointError(f"DCP checkpoint {folder}: tensor {name!r} went through the stream extensions "
                                      f"{list(info.transform_descriptors)}; parakit.state reads DCP's plain torch.save "
                                      f"chunks only: load it with dcp.load")
            chunks.append(Chunk(name, (tuple(c.offsets), tuple(c.sizes)), stored.properties.dtype, info.relative_path,
                                info.offset, info.length, "torch_save"))
        catalog[name] = Entry(tuple(stored.size), stored.properties.dtype, tuple(chunks))
    return catalog


def is_complete(folder: Path) -> bool:
    """Whether `folder` holds a whole checkpoint: its index (parakit) or .metadata (DCP),
    each written last, is there."""
    return (Path(folder) / INDEX).is_file() or (Path(folder) / DCP_METADATA).is_file()


def read_catalog(folder: Path) -> dict[str, Entry]:
    """Every tensor of the checkpoint in `folder`, parakit's or DCP's."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"there is no checkpoint folder {folder}: pass a folder written by "
                              f"parakit.state.save or dcp.save")
    if not is_complete(folder):
        raise CheckpointError(f"checkpoint {folder} is incomplete: it has no {INDEX} (nor DCP's {DCP_METADATA}), "
                              f"which a save writes last, so that save did not finish; load a complete one, e.g. "
                              f"parakit.state.latest({str(folder.parent)!r})")
    return read_index(folder) if (folder / INDEX).is_file() else read_dcp(folder)


def latest(root: Path) -> Path | None:
    """The complete checkpoint folder under `root` whose name ends in the largest number
    (step120 after step90), skipping those a save did not finish; None if there is none."""
    if not Path(root).is_dir():
        return None
    found = [(int(m.group()), p) for p in Path(root).iterdir()
             if p.is_dir() and is_complete(p) and (m := re.search(r"\d+$", p.name))]
    return max(found)[1] if found else None
