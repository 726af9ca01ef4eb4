"""Real text every machine has: the Python standard library's own source, as bytes.

The corpus is every `*.py` file under `sysconfig.get_paths()["stdlib"]`, except those in a
folder named site-packages, dist-packages, test, tests, idle_test or __pycache__ (installed
packages and the test suites). Each file is read as bytes (vocabulary 256) and followed by
one 0 byte, the end-of-file token (source files hold no 0 bytes). A file is held out when the
CRC-32 of its path relative to the stdlib folder (posix form) is 0 mod `HELDOUT_EVERY`: a
stable rule, the same in every process and on every machine with the same Python.

Batches are drawn from (seed, step) alone, so every rank, and a resumed run, sees the same
batch at the same step. Each process holds a split's bytes once, as one uint8 tensor.
"""
from __future__ import annotations

import functools
import os
import sysconfig
import zlib
from pathlib import Path

import torch

from parakit.devices import device

__all__ = ["VOCAB", "HELDOUT_EVERY", "SPLITS", "stdlib_root", "source_files", "split_of", "corpus", "corpus_size",
           "batch_for"]

VOCAB = 256  # bytes
HELDOUT_EVERY = 10  # about one file in ten is held out
SPLITS = ("train", "heldout")
SKIPPED = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
END_OF_FILE = b"\0"


def stdlib_root() -> Path:
    """The folder of this Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=None)
def source_files() -> tuple[str, ...]:
    """The corpus's files: paths relative to `stdlib_root()`, posix form, sorted."""
    root, found = stdlib_root(), []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in SKIPPED]  # not walked into
        found += [Path(folder, n).relative_to(root).as_posix() for n in names if n.endswith(".py")]
    return tuple(sorted(found))


def split_of(path: str) -> str:
    """"heldout" or "train" for a relative path: CRC-32 of its bytes, mod HELDOUT_EVERY."""
    return "heldout" if zlib.crc32(path.encode()) % HELDOUT_EVERY == 0 else "train"


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {SPLITS}: use split='train' or split='heldout'")


@functools.lru_cache(maxsize=None)
def corpus(split: str = "train") -> torch.Tensor:
    """The split's files in `source_files()` order, each followed by a 0 byte, as one uint8
    tensor on the CPU ([bytes + files]); read once per process."""
    _check_split(split)
    data = bytearray()
    for path in source_files():
        if split_of(path) == split:
            data += (stdlib_root() / path).read_bytes() + END_OF_FILE
    return torch.frombuffer(data, dtype=torch.uint8)  # shares the bytearray's memory: held once


def corpus_size() -> dict[str, dict[str, int]]:
    """For each split: its number of files and their bytes (without the end-of-file tokens)."""
    sizes = {}
    for split in SPLITS:
        files = sum(split_of(p) == split for p in source_files())
        sizes[split] = {"files": files, "bytes": corpus(split).numel() - files}
    return sizes


def batch_for(step: int, batch: int, seq: int, seed: int = 0,
              split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: `batch` windows of seq + 1 bytes of `split` at starts drawn
    from (seed, step) by a CPU generator, so the same on every rank and device. Returns ids and
    targets (the next byte), each [batch, seq] int64 on `device()`. No communication."""
    text = corpus(split)
    if batch < 1 or not 1 <= seq < text.numel():
        raise ValueError(f"batch={batch}, seq={seq}: need batch >= 1 and 1 <= seq < {text.numel()} (the {split} "
                         f"split's length)")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, text.numel() - seq, (batch, 1), generator=g)  # [batch, 1]
    windows = text[starts + torch.arange(seq + 1)].long()  # [batch, seq + 1]
    return windows[:, :-1].to(device()), windows[:, 1:].to(device())
