"""torch.distributed.checkpoint reading parakit's checkpoints: a StorageReader.

    dcp.load(state_dict, storage_reader=parakit.state.Reader(folder))

DCP asks the reader for metadata (each tensor's chunks, offsets and sizes), plans on every
rank which chunks overlap its tensors (plain tensors whole, DTensors their local shard), and
asks it to read. parakit's flat pieces (ZeRO-3's) become their boxes, so DCP sees boxes only.
The other way round (parakit's `load` reading a dcp.save checkpoint) needs no class:
`read_catalog` reads DCP's .metadata.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.distributed.checkpoint import ChunkStorageMetadata, Metadata, StorageReader, TensorStorageMetadata
from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta, TensorProperties
from torch.futures import Future

from parakit.state.index import CheckpointError, is_complete, read_catalog
from parakit.state.load import read_chunks

__all__ = ["Reader"]


class Reader(StorageReader):
    """A DCP StorageReader over the parakit checkpoint in `folder`. Reads files only; DCP's
    own planning exchanges the plans (one gather and one scatter of them)."""

    def __init__(self, folder: str | os.PathLike):
        super().__init__()
        self.folder, self.chunks = Path(folder), {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.folder = Path(checkpoint_id)
        self.chunks = {}

    def read_metadata(self) -> Metadata:
        """Each tensor of the index with its chunks; `storage_data` maps each chunk's
        MetadataIndex (name, offsets) to where its bytes lie."""
        tensors, storage = {}, {}
        for name, entry in read_catalog(self.folder).items():
            if entry.shape is None:
                raise CheckpointError(f"{name!r} in {self.folder} is not a tensor: parakit.state.Reader reads "
                                      f"tensors only; read this DCP checkpoint with dcp.FileSystemReader")
            chunks = [ChunkStorageMetadata(torch.Size(c.box[0]), torch.Size(c.box[1])) for c in entry.chunks]
            tensors[name] = TensorStorageMetadata(TensorProperties(dtype=entry.dtype), torch.Size(entry.shape), chunks)
            storage.update({MetadataIndex(name, torch.Size(c.box[0])): c for c in entry.chunks})
        return Metadata(tensors, storage_data=storage, storage_meta=StorageMeta(checkpoint_id=str(self.folder)))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool) -> None:
        self.chunks = metadata.storage_data

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner) -> Future:
        """Read the chunks the plan's items lie in (each file opened once) and copy each
        item's region into the tensor the planner resolves."""
        data, _ = read_chunks(self.folder, {self.chunks[item.storage_index] for item in plan.items})
        for item in plan.items:
            stored = data[self.chunks[item.storage_index]]
            part = stored[tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))]
            target = planner.resolve_tensor(item).detach()
            target.copy_(part)
            planner.commit_tensor(item, target)
        done = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return is_complete(Path(checkpoint_id))
