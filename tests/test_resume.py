"""parakit.state.resume: a tiny byte-level GPT on tp=2 (dropout inside the tensor-parallel region
from an RNGTracker, outside it from torch's generator; inputs corrupted with Python's `random` and
numpy), trained on parakit.text's batches and clipped by parakit.clip, run 4 steps unbroken, and
run 2 steps, saved, and resumed in fresh processes for 2 more: the losses and parameters are
bit-identical. Resumed without the state, it is not. The state survives torch.save/torch.load
(weights_only) in one process; a state of another seed or tracker is refused."""
from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import parakit
from parakit.launcher import pool_generation
from parakit.state.resume import capture, restore

SEED, BATCH, SEQ = 5, 4, 16


# ---------------------------------------------------------------- on the ranks

def build():
    """The model (from SEED), its AdamW and the tracker of its tensor-parallel dropout; every
    generator seeded, as a run starts."""
    from parakit.tensor_parallel import ParallelTransformerBlock, RNGTracker
    torch.manual_seed(SEED), random.seed(SEED), np.random.seed(SEED)
    tracker = RNGTracker(SEED)
    model = nn.Sequential(nn.Embedding(256, 16), ParallelTransformerBlock(16, 4, dropout=0.2, rng=tracker),
                          nn.Linear(16, 256))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), tracker


def train_steps(model, optimizer, steps) -> list[float]:
    """Steps of parakit.text's batches, a tenth of the input bytes replaced (numpy picks which,
    Python's random with what), clipped at 1."""
    from parakit.clip import clip_grad_norm_
    from parakit.text import batch_for
    losses = []
    for step in steps:
        ids, target = batch_for(step, BATCH, SEQ, SEED)  # [batch, seq]
        ids[torch.from_numpy(np.random.rand(BATCH, SEQ) < 0.1)] = random.randrange(256)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(ids).flatten(0, 1), target.flatten())
        loss.backward()
        clip_grad_norm_(model, 1.0, {"tp": None})
        optimizer.step()
        losses.append(loss.item())
    return losses


def unbroken():
    model, optimizer, _ = build()
    return train_steps(model, optimizer, range(4)), [p.detach().clone() for p in model.parameters()]


def first_half(folder):
    model, optimizer, tracker = build()
    losses = train_steps(model, optimizer, range(2))
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "resume": capture(2, SEED, tracker)}, folder / f"rank{dist.get_rank()}.pt")
    return losses


def second_half(folder, with_state: bool):
    model, optimizer, tracker = build()
    saved = torch.load(folder / f"rank{dist.get_rank()}.pt")
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    first = restore(saved["resume"], SEED, tracker) if with_state else 2
    return train_steps(model, optimizer, range(first, 4)), [p.detach().clone() for p in model.parameters()]


def resumed(folder):
    from parakit.text import batch_for
    return second_half(folder, True), second_half(folder, False), batch_for(9, BATCH, SEQ, SEED)


# ---------------------------------------------------------------- the tests

def test_a_run_resumed_in_fresh_processes_equals_the_unbroken_run_bit_for_bit(tmp_path):
    from parakit.text import batch_for
    whole = parakit.launch(unbroken, world_size=2)
    before = parakit.launch(first_half, tmp_path, world_size=2)
    generation = pool_generation(2, "gloo")
    parakit.launcher.shutdown(world_size=2)  # this size's ranks only: the other pools stay warm
    after = parakit.launch(resumed, tmp_path, world_size=2)
    assert pool_generation(2, "gloo") != generation  # new rank processes
    for (losses, params), first, ((rest, resumed_params), (naive, naive_params), batch) in zip(whole, before, after):
        assert first + rest == losses
        assert all(torch.equal(p, q) for p, q in zip(params, resumed_params))
        assert naive != rest and not all(torch.equal(p, q) for p, q in zip(params, naive_params))
        assert all(torch.equal(a, b) for a, b in zip(batch, batch_for(9, BATCH, SEQ, SEED)))  # every process's data


def test_the_state_survives_torch_save_and_load_and_puts_every_generator_back(tmp_path):
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    torch.save(capture(3, SEED), tmp_path / "state.pt")
    draws = torch.rand(3), random.random(), np.random.rand()
    torch.manual_seed(2), random.seed(2), np.random.seed(2)
    assert restore(torch.load(tmp_path / "state.pt"), SEED) == 3
    again = torch.rand(3), random.random(), np.random.rand()
    assert torch.equal(again[0], draws[0]) and again[1:] == draws[1:]


def test_a_state_of_another_seed_or_without_the_runs_tracker_is_refused():
    tracker = SimpleNamespace(state=torch.zeros(16, dtype=torch.uint8))  # stands in for an RNGTracker
    with pytest.raises(ValueError, match=f"data seed {SEED}, but this run has seed 6: resume with seed {SEED}"):
        restore(capture(3, SEED), 6)
    with pytest.raises(ValueError, match="has an RNGTracker stream, but restore was given no tracker"):
        restore(capture(3, SEED, tracker), SEED)
    with pytest.raises(ValueError, match="has no RNGTracker stream, but restore was given a tracker"):
        restore(capture(3, SEED), SEED, tracker)
