"""Each emulated GPU's own generator (parakit.emulation.rng): fgpu:i draws from fgpu:i's
generator, never from the CPU's, seeded and saved as torch.cuda's; so code that saves or
restores only the CPU's generator draws other dropout masks on fgpu, as on a GPU. parakit's
checkpoint, RNG tracker and resume state save, fork and restore the device's generator.

Each test a fresh interpreter with PARAKIT_EMULATE_GPUS=4 (`run_emulated`).
"""
from __future__ import annotations

import pytest

from test_emulation import run_emulated

GENERATORS = """
import json, torch
from parakit import emulation
emulation.install(4)
found = {}
torch.manual_seed(0)
cpu = torch.get_rng_state()
x = torch.ones(64, device="fgpu:0")
draws = [torch.randn(3, device="fgpu:0"), torch.rand(3, device="fgpu:0"), torch.randint(0, 9, (3,), device="fgpu:0"),
         torch.randperm(5, device="fgpu:0"), torch.multinomial(x, 2), x.clone().bernoulli_(0.5), x.clone().normal_(),
         torch.nn.functional.dropout(x, 0.5)]
found["cpu_untouched"] = torch.equal(torch.get_rng_state(), cpu)
found["seeded_alike"] = [torch.fgpu.initial_seed(), *[torch.equal(torch.fgpu.get_rng_state(i), torch.fgpu.get_rng_state(1))
                                                     for i in (2, 3)]]
torch.manual_seed(0)
found["own_stream"] = [torch.equal(torch.randn(3), draws[0].cpu()),  # a seed starts another stream, as on CUDA
                       torch.equal(torch.randn(3, device="fgpu:0").cpu(), draws[0].cpu())]  # not after the CPU's draw
states = torch.get_rng_state(), torch.fgpu.get_rng_state(0), torch.fgpu.get_rng_state(1)
with torch.fgpu.device(1):
    torch.fgpu.manual_seed(5)
    found["seeded_one"] = [torch.fgpu.initial_seed(), torch.equal(torch.get_rng_state(), states[0]),
                           torch.equal(torch.fgpu.get_rng_state(0), states[1]),
                           torch.equal(torch.fgpu.get_rng_state(1), states[2])]
saved = torch.fgpu.get_rng_state("fgpu:2")
first = torch.rand(4, device="fgpu:2")
torch.fgpu.set_rng_state(saved, "fgpu:2")
every = torch.fgpu.get_rng_state_all()
again = torch.rand(4, device="fgpu:2")
torch.fgpu.set_rng_state_all(every)
found["round_trip"] = [torch.equal(first.cpu(), again.cpu()), torch.equal(torch.rand(4, device="fgpu:2").cpu(), again.cpu())]
with torch.random.fork_rng(devices=[3], device_type="fgpu"):
    forked = torch.rand(4, device="fgpu:3")
found["fork_rng"] = torch.equal(torch.rand(4, device="fgpu:3").cpu(), forked.cpu())
own = torch.fgpu.get_rng_state(1)
given = torch.randn(3, device="fgpu:1", generator=torch.Generator("fgpu:1").manual_seed(7))
found["given_generator"] = [torch.equal(torch.fgpu.get_rng_state(1), own),
                            torch.equal(given.cpu(), torch.randn(3, generator=torch.Generator().manual_seed(7)))]
with torch.fgpu.device(1):
    torch.fgpu.manual_seed(7)
found["given_generator"].append(torch.equal(given.cpu(), torch.randn(3, device="fgpu:1").cpu()))
print(json.dumps(found))
"""


def test_each_fgpu_device_draws_from_its_own_generator_seeded_and_saved_as_cudas(tmp_path):
    found = run_emulated(tmp_path, GENERATORS)
    assert found["cpu_untouched"]  # eight kinds of draw on fgpu:0, the CPU's generator where it was
    assert found["seeded_alike"] == [0, True, True]  # torch.manual_seed seeds every device, as every CUDA device
    assert found["own_stream"] == [False, True]
    assert found["seeded_one"] == [5, True, True, False]  # torch.fgpu.manual_seed: the current device's only
    assert found["round_trip"] == [True, True]
    assert found["fork_rng"]
    assert found["given_generator"] == [True, False, True]  # drawn from, the device's left alone; a GPU's stream


MASKS = """
import json, torch
from torch import nn
from parakit import checkpoint as ck, emulation
emulation.install(4)

class CpuStateOnly(torch.autograd.Function):
    '''A checkpoint that saves and restores the CPU's generator only (it forgets the device's).'''
    @staticmethod
    def forward(ctx, fn, x):
        ctx.fn, ctx.state = fn, torch.get_rng_state()
        ctx.save_for_backward(x)
        return fn(x)
    @staticmethod
    def backward(ctx, grad):
        x = ctx.saved_tensors[0].detach().requires_grad_()
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(ctx.state)
            with torch.enable_grad():
                out = ctx.fn(x)
        out.backward(grad)
        return None, x.grad

torch.manual_seed(0)
block = nn.Sequential(nn.Linear(32, 64), nn.Dropout(0.5), nn.Linear(64, 32)).to("fgpu:1")
xb = torch.randn(8, 32)

def grads(forward, x):
    block.zero_grad()
    x = x.detach().requires_grad_()
    torch.manual_seed(1)
    forward(x).square().sum().backward()
    return [x.grad.cpu()] + [p.grad.cpu() for p in block.parameters()]

def same(a, b):
    return all(torch.equal(u, v) for u, v in zip(a, b))

on_gpu = xb.to("fgpu:1")
plain = grads(block, on_gpu)
torch.fgpu.set_device(1)
found = {"parakit": same(grads(lambda x: ck.checkpoint(block, x), on_gpu), plain),
         "pytorch": same(grads(lambda x: torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False), on_gpu), plain),
         "cpu_state_only": same(grads(lambda x: CpuStateOnly.apply(block, x), on_gpu), plain),
         "from_the_cpu": same(grads(lambda x: ck.checkpoint(lambda c: block(c.to("fgpu:1")), x), xb), grads(
             lambda x: block(x.to("fgpu:1")), xb))}  # a CPU input: the current device's generator is replayed
x = torch.ones(1000, device="fgpu:1")
torch.manual_seed(2)
states = torch.get_rng_state(), torch.fgpu.get_rng_state(1)
masks = [torch.nn.functional.dropout(x, 0.5).cpu()]
torch.set_rng_state(states[0])  # the CPU's generator back, the device's not
masks.append(torch.nn.functional.dropout(x, 0.5).cpu())
torch.fgpu.set_rng_state(states[1], 1)  # the device's back
masks.append(torch.nn.functional.dropout(x, 0.5).cpu())
found["masks"] = [torch.equal(masks[0], masks[1]), torch.equal(masks[0], masks[2])]
print(json.dumps(found))
"""


def test_checkpoint_on_fgpu_replays_the_devices_generator_and_one_that_forgets_it_draws_another_mask(tmp_path):
    found = run_emulated(tmp_path, MASKS)
    assert found["parakit"] and found["pytorch"] and found["from_the_cpu"]  # gradients as without checkpointing
    assert not found["cpu_state_only"]  # the recomputation drew another dropout mask
    assert found["masks"] == [False, True]  # restoring the CPU's generator alone: another mask


RANKS = """
import json, random, numpy as np, parakit, torch, torch.distributed as dist
import torch.nn.functional as F
from parakit.state.resume import capture, restore
from parakit.tensor_parallel import RNGTracker

def draws():
    here = parakit.device()
    torch.manual_seed(0)
    tracker = RNGTracker(seed=0)
    before = torch.get_rng_state(), torch.fgpu.get_rng_state(here)
    with tracker.fork():
        inside = F.dropout(torch.ones(64, device=here), 0.5)
    untouched = torch.equal(torch.get_rng_state(), before[0]) and torch.equal(torch.fgpu.get_rng_state(here), before[1])
    outside = F.dropout(torch.ones(64, device=here), 0.5)
    with tracker.fork():
        inside_again = F.dropout(torch.ones(64, device=here), 0.5)
    masks = [torch.empty(3, 64, device=here) for _ in range(dist.get_world_size())]
    dist.all_gather(masks, torch.stack([inside, outside, inside_again]))
    state = capture(3, 5, tracker)
    resumed = [F.dropout(torch.ones(64, device=here), 0.5)]
    with tracker.fork():
        resumed.append(F.dropout(torch.ones(64, device=here), 0.5))
    torch.manual_seed(9)
    restore(state, 5, tracker)
    again = [F.dropout(torch.ones(64, device=here), 0.5)]
    with tracker.fork():
        again.append(F.dropout(torch.ones(64, device=here), 0.5))
    return {"device": str(here), "untouched": untouched, "masks": torch.stack(masks).cpu().tolist(),
            "resumed": all(torch.equal(a, b) for a, b in zip(resumed, again))}

print(json.dumps(parakit.launch(draws, world_size=2)))
"""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What two ranks on fgpu:0 and fgpu:1 drew through an RNGTracker and a resume state."""
    return run_emulated(tmp_path_factory.mktemp("ranks"), RANKS)


def test_rng_tracker_on_fgpu_forks_the_ranks_device_generator_and_leaves_it_untouched(ranks):
    assert [r["device"] for r in ranks] == ["fgpu:0", "fgpu:1"]
    assert all(r["untouched"] for r in ranks)  # the CPU's and the device's default generators both
    masks = ranks[0]["masks"]  # [rank, (inside, outside, inside again), 64]
    assert masks[0][0] != masks[1][0]  # inside: each rank its own mask
    assert masks[0][1] == masks[1][1]  # outside: the same mask everywhere
    assert masks[0][0] != masks[0][2]  # the tracker's stream moves on


def test_resume_state_on_fgpu_puts_back_the_ranks_device_generator(ranks):
    assert all(r["resumed"] for r in ranks)  # outside and inside the tracker, the masks drawn after capture
