"""The resume state: what a rank keeps, besides its parameters and optimizer, so that a run
stopped after step j and resumed in fresh processes goes on exactly as the unbroken run,
bit for bit, dropout included.

    torch.save(capture(step, seed, tracker), path)          # after step j
    step = restore(torch.load(path), seed, tracker)          # fresh process, before step j + 1

What it holds (plain tensors, ints and tuples: torch.load's weights_only reads it back):

    step, seed    the data position: parakit.text.batch_for and parakit.train.batch_for draw
                  a step's batch from (seed, step) alone, so these are the sampler's state
    rng           the generators a step draws from: torch's CPU generator (dropout on CPU),
                  the rank's GPU generator (dropout on GPU; None on a CPU rank), Python's
                  `random` and numpy's global generator (a data pipeline's)
    tracker       an RNGTracker's stream, for dropout inside tensor-parallel regions (None
                  without one)

Each rank captures and restores its own: the tracker and GPU streams differ from rank to
rank. No communication.
"""
from __future__ import annotations

import random

import numpy as np
import torch

from parakit.devices import device

__all__ = ["capture", "restore"]


def _device_generator():
    """The torch module of this rank's GPU (torch.cuda, or fgpu's), or None on a CPU rank."""
    here = device()
    return None if here.type == "cpu" else getattr(torch, here.type)


def _numpy_state() -> tuple:
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    return kind, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(gauss)  # [624] uint32 as int64


def capture(step: int, seed: int, tracker=None) -> dict:
    """This rank's resume state after `step` steps of a run whose data comes from `seed`."""
    gpu = _device_generator()
    return {"step": step, "seed": seed,
            "rng": {"torch": torch.get_rng_state(), "device": None if gpu is None else gpu.get_rng_state(device()),
                    "python": random.getstate(), "numpy": _numpy_state()},
            "tracker": None if tracker is None else tracker.state.clone()}


def _check(state: dict, seed: int, tracker) -> None:
    """Raise a ValueError naming what differs between the state and this run."""
    if state["seed"] != seed:
        raise ValueError(f"the resume state is of a run with data seed {state['seed']}, but this run has seed {seed}: "
                         f"resume with seed {state['seed']}, or the data order would change")
    if (state["tracker"] is None) != (tracker is None):
        had, given = ("an", "no tracker") if tracker is None else ("no", "a tracker")
        raise ValueError(f"the resume state has {had} RNGTracker stream, but restore was given {given}: pass the "
                         f"model's RNGTracker to both capture and restore, or to neither")
    if (state["rng"]["device"] is None) != (_device_generator() is None):
        raise ValueError(f"the resume state was captured on a {'CPU' if state['rng']['device'] is None else 'GPU'} "
                         f"rank, but this rank computes on {device()}: resume with the backend it was captured on")


def restore(state: dict, seed: int, tracker=None) -> int:
    """Put back the generators `capture` took (and the tracker's stream into `tracker`);
    returns the step to go on from."""
    _check(state, seed, tracker)
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    if rng["device"] is not None:
        _device_generator().set_rng_state(rng["device"], device())
    random.setstate(rng["python"])
    kind, key, pos, has_gauss, gauss = rng["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if tracker is not None:
        tracker.state = state["tracker"].clone()
    return state["step"]
