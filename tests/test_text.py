"""parakit.text: the standard library's sources as a byte corpus: which files (no tests, no
site-packages), the held-out split by a stable hash of the path, each split's bytes held once and
exactly its files', and batches drawn from (seed, step) alone, in the vocabulary of 256 bytes."""
from __future__ import annotations

import pytest
import torch

from parakit import text


def test_the_corpus_is_the_stdlib_sources_without_tests_or_installed_packages():
    files = text.source_files()
    assert {"os.py", "json/__init__.py", "random.py"} <= set(files)
    assert all(f.endswith(".py") and not set(f.split("/")[:-1]) & text.SKIPPED for f in files)
    assert files == tuple(sorted(files))


def test_the_split_is_a_stable_hash_of_the_path_holding_out_about_one_file_in_ten():
    assert [text.split_of(p) for p in ("os.py", "random.py", "asyncio/events.py", "json/__init__.py")] == \
        ["train", "heldout", "heldout", "train"]  # CRC-32: the same in every process, on every machine
    sizes = text.corpus_size()
    assert sizes["train"]["files"] + sizes["heldout"]["files"] == len(text.source_files())
    assert 0.05 < sizes["heldout"]["files"] / len(text.source_files()) < 0.15


@pytest.mark.parametrize("split", text.SPLITS)
def test_each_split_is_exactly_its_own_files_bytes_so_held_out_files_never_reach_train(split):
    mine = [p for p in text.source_files() if text.split_of(p) == split]
    expected = b"".join((text.stdlib_root() / p).read_bytes() + b"\0" for p in mine)
    data = text.corpus(split)
    assert data.dtype == torch.uint8 and bytes(data.numpy()) == expected
    assert text.corpus_size()[split] == {"files": len(mine), "bytes": len(expected) - len(mine)}
    assert text.corpus(split) is data  # read once per process


def test_batches_come_from_seed_and_step_alone_as_next_byte_pairs():
    ids, targets = text.batch_for(7, 4, 32, seed=3)
    again = text.batch_for(7, 4, 32, seed=3)
    assert torch.equal(ids, again[0]) and torch.equal(targets, again[1])
    assert ids.shape == targets.shape == (4, 32) and ids.dtype == torch.int64
    assert torch.equal(ids[:, 1:], targets[:, :-1])
    assert 0 <= int(ids.min()) and int(torch.maximum(ids, targets).max()) < text.VOCAB
    corpus = bytes(text.corpus("train").numpy())
    assert all(bytes(row[:1].tolist() + t.tolist()) in corpus for row, t in zip(ids, targets))
    assert not torch.equal(ids, text.batch_for(8, 4, 32, seed=3)[0])
    assert not torch.equal(ids, text.batch_for(7, 4, 32, seed=4)[0])
    assert not torch.equal(ids, text.batch_for(7, 4, 32, seed=3, split="heldout")[0])


def test_a_bad_split_or_window_is_refused_with_what_to_use():
    with pytest.raises(ValueError, match=r"split 'test' is not one of \('train', 'heldout'\)"):
        text.batch_for(0, 2, 8, split="test")
    with pytest.raises(ValueError, match=r"need batch >= 1 and 1 <= seq <"):
        text.batch_for(0, 2, 0)
