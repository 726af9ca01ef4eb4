"""Sharded checkpoints (lesson 11, a real run): each rank saves what it holds, an index
written last makes the folder a checkpoint, and any other mesh loads it.

    shards = fsdp_shards(model)                     # what this rank holds: ZeRO-3's flat shards
    save(root / "step100", shards)                  # rank{N}.bin per rank, then index.json
    shards = tensor_parallel_shards(tp_model, mesh.tp_group, mesh.dp_group)
    load(latest(root), shards)                      # dp4 ZeRO-3 -> dp2 x tp2: each rank its slices

A `Shard` says which slice of a named global tensor a rank's tensor holds: a box (offsets and
lengths per dimension) or, for ZeRO-3, a range of the tensor flattened. A replicated tensor
is written by one rank only. `save` writes every rank's file, then rank 0 writes the index
through a temporary name (a folder without one is a save that did not finish, and `latest`
skips it). `load` cuts stored pieces and wanted slices into boxes, copies the overlaps,
opens only the files that hold them, and checks everything on every rank before it copies
anything. torch.distributed.checkpoint reads parakit's checkpoints through `Reader`, and
`load` reads dcp.save's.

    boxes.py   boxes and flat ranges (the geometry)   shards.py  Shard and the layouts' helpers
    index.py   the two formats, one catalog; latest    save.py    save
    load.py    load                                    dcp.py     Reader, a DCP StorageReader
    resume.py  capture / restore: the data position and every generator, for an exact resume
"""
from parakit.state.dcp import Reader
from parakit.state.index import CheckpointError, is_complete, latest, read_catalog
from parakit.state.load import load
from parakit.state.resume import capture, restore
from parakit.state.save import save
from parakit.state.shards import Shard, fsdp_shards, replicated, split, tensor_parallel_shards

__all__ = ["Shard", "replicated", "split", "tensor_parallel_shards", "fsdp_shards", "save", "load", "latest",
           "is_complete", "read_catalog", "Reader", "CheckpointError", "capture", "restore"]
