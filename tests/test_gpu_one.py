"""What one CUDA GPU shows and the emulated box cannot (issue #42, item 8): CUDA's own kernels
against the CPU's where a lesson compares two kernels (lesson 03's AdamW, lesson 08's attention), CUDA's generators in parakit's RNG paths, the
caching allocator's figures against the bytes the lessons count, PyTorch's context_parallel on
one rank, and DCP's async_save staging CUDA tensors in pinned host memory.

    bash tests/gpu_one.sh            # with the rest of the GPU suite's one-GPU part

Every test needs one GPU (skipped without, as the rest of test_gpu.py). Each writes the figures
it measured as one line, `gpu-figure: ...`, to the file PARAKIT_GPU_FIGURES names (gpu_one.sh
collects them for benchmarks/RESULTS.md) and to its output. Times are never asserted.
"""
from __future__ import annotations

import os
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

import parakit
import test_side_by_side
from parakit import checkpoint as ck
from parakit import side_by_side
from parakit.devices import MemoryMeter
from parakit.state import resume
from parakit.tensor_parallel import RNGTracker
from test_gpu import needs, nccl

pytestmark = [pytest.mark.gpu, needs(1)]


def figure(text: str) -> None:
    """One measured line for RESULTS.md: printed, and appended to PARAKIT_GPU_FIGURES if set."""
    line = f"gpu-figure: {text}"
    print(line)
    if os.environ.get("PARAKIT_GPU_FIGURES"):
        with open(os.environ["PARAKIT_GPU_FIGURES"], "a") as out:
            out.write(line + "\n")


# ---------------------------------------------------------------- CUDA's kernels where a lesson compares kernels

ADAMW_ATOL = 1e-6  # lesson 03's offload check: AdamW on the device against AdamW on the CPU (sized on fgpu)


def adamw_on_both(seed):
    """3 AdamW steps on the same parameters and gradients: foreach kernels on this GPU, single-
    tensor kernels on the CPU (fully_shard without and with CPUOffloadPolicy, lesson 03)."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(256, 256, generator=g), torch.randn(256, generator=g)]
    grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(3)]
    finals = []
    for device, foreach in ((parakit.device(), True), (torch.device("cpu"), False)):
        mine = [p.to(device, copy=True).requires_grad_() for p in params]
        opt = torch.optim.AdamW(mine, lr=1e-2, foreach=foreach)
        for step in grads:
            for p, grad in zip(mine, step):
                p.grad = grad.to(device)
            opt.step()
        finals.append([p.detach().cpu() for p in mine])
    return [((a - b).abs().max().item(), int((a != b).sum())) for a, b in zip(*finals)]


def test_adamw_foreach_on_cuda_and_single_tensor_on_the_cpu_differ_within_lesson_03s_tolerance():
    found = nccl(adamw_on_both, random.randrange(2**31), world_size=1)[0]
    figure(f"AdamW, 3 steps, foreach on cuda:0 vs single-tensor on the CPU: largest difference "
           f"{max(d for d, _ in found):.2e}, {sum(n for _, n in found)} of {256 * 256 + 256} elements differ; "
           f"lesson 03's atol {ADAMW_ATOL:.0e}")
    assert max(d for d, _ in found) <= ADAMW_ATOL


def ring_against_sdpa(seed):
    """parakit's causal ring (one rank: one block) against CUDA's SDPA, lesson 08's shapes."""
    from parakit import context_parallel as cp
    g = torch.Generator().manual_seed(seed)
    q, k, v, upstream = (torch.randn(1, 4, 1024, 32, generator=g).to(parakit.device()) for _ in range(4))
    results = []
    for attend in (lambda *t: cp.ring_attention(*t, causal=True, layout="zigzag"),
                   lambda *t: torch.nn.functional.scaled_dot_product_attention(*t, is_causal=True)):
        mine = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*mine)
        out.backward(upstream)
        results.append([out.detach()] + [m.grad for m in mine])
    return max((a - b).abs().max().item() for a, b in zip(*results))


def test_parakits_ring_and_cudas_fused_attention_differ_within_lesson_08s_tolerance(tmp_path):
    script = lesson_script(tmp_path, "with_pytorch_08.py")
    worst = nccl(ring_against_sdpa, random.randrange(2**31), world_size=1)[0]
    figure(f"parakit's ring (1 rank) vs CUDA's SDPA, [1, 4, 1024, 32] causal, out and grads: largest difference "
           f"{worst:.2e}; lesson 08's tolerance {script.TOLERANCE:.0e}")
    assert worst <= script.TOLERANCE


# ---------------------------------------------------------------- context_parallel on one rank

def lesson_script(tmp_path, name: str):
    (text,) = [text for _, script, text in test_side_by_side.lesson_scripts() if script == name]
    path = tmp_path / name
    path.write_text(text)
    return side_by_side.load_script(path)


def context_parallel_on_this_gpu(script):
    return script.check_context_parallel(dist.get_world_size(), parakit.device())


def test_context_parallel_on_one_gpu_equals_sdpa_on_the_whole_sequence_within_the_lessons_tolerance(tmp_path):
    script = lesson_script(tmp_path, "with_pytorch_08.py")
    (worst,) = nccl(context_parallel_on_this_gpu, script, world_size=1)
    figure(f"context_parallel (1 rank, both rotations) vs SDPA on the whole sequence: largest difference {worst:.2e}, "
           f"lesson 08's tolerance {script.TOLERANCE:.0e}")
    assert worst <= script.TOLERANCE


# ---------------------------------------------------------------- DCP with CUDA tensors

def saves_and_loads_on_this_gpu(folder, how):
    import torch.distributed.checkpoint as dcp
    dev = parakit.device()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64)).to(dev)
    state = model.state_dict()
    if how == "async_save":
        dcp.async_save(state, checkpoint_id=folder).result()
    else:
        dcp.save(state, checkpoint_id=folder)
    fresh = {name: torch.zeros_like(t) for name, t in state.items()}
    dcp.load(fresh, checkpoint_id=folder)
    return ({name: (str(t.device), torch.equal(t, state[name])) for name, t in fresh.items()},
            sum(t.nbytes for t in state.values()))


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_dcp_saves_cuda_tensors_and_loads_them_back_bit_for_bit(tmp_path, how):
    (found, nbytes) = nccl(saves_and_loads_on_this_gpu, tmp_path / "ckpt", how, world_size=1)[0]
    figure(f"dcp.{how} of {nbytes} B of cuda:0 tensors, dcp.load back: {sum(eq for _, eq in found.values())} of "
           f"{len(found)} tensors equal")
    assert found and all(device == "cuda:0" and equal for device, equal in found.values()), found


def async_save_stages_in_pinned_memory():
    """Whether the host copies async_save stages into are pinned (torch's default stager pins them)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False, use_async_staging=False,
                                          use_non_blocking_copy=True))
    staged = stager.stage({"w": torch.randn(1024, 1024, device=parakit.device())})
    stager.close()
    return staged["w"].device.type, staged["w"].is_pinned()


def test_async_saves_stager_copies_cuda_tensors_into_pinned_host_memory():
    device_type, pinned = nccl(async_save_stages_in_pinned_memory, world_size=1)[0]
    figure(f"async_save's DefaultStager: staged copy on {device_type}, pinned {pinned}")
    assert (device_type, pinned) == ("cpu", True)


# ---------------------------------------------------------------- CUDA's generators in parakit's RNG paths

def tracker_draws(seed):
    torch.manual_seed(seed)
    dev = parakit.device()
    tracker = RNGTracker(seed)
    before = torch.cuda.get_rng_state(dev)
    with tracker.fork():
        inside = torch.rand(1000, device=dev)
    untouched = torch.equal(torch.cuda.get_rng_state(dev), before)
    outside = torch.rand(1000, device=dev)
    with tracker.fork():
        again = torch.rand(1000, device=dev)
    return untouched, torch.equal(inside, outside), torch.equal(inside, again)


def test_the_tensor_parallel_tracker_forks_cudas_generator_and_leaves_the_default_one_untouched():
    untouched, inside_is_outside, repeats = nccl(tracker_draws, random.randrange(2**31), world_size=1)[0]
    figure(f"RNGTracker on cuda:0: default CUDA generator untouched {untouched}, fork's draws differ from the "
           f"default's {not inside_is_outside}, the stream goes on (second fork differs) {not repeats}")
    assert untouched and not inside_is_outside and not repeats


def resumed_draws(seed):
    torch.manual_seed(seed)
    dev = parakit.device()
    torch.rand(10, device=dev)
    saved = resume.capture(7, seed)
    expected = torch.rand(1000, device=dev)
    torch.rand(10, device=dev)  # the generator moves on, as a crashed run's would
    step = resume.restore(saved, seed)
    return step, torch.equal(torch.rand(1000, device=dev), expected)


def test_the_resume_state_restores_cudas_generator_so_the_next_draws_repeat():
    step, same = nccl(resumed_draws, random.randrange(2**31), world_size=1)[0]
    figure(f"state.resume on cuda:0: restored step {step}, the next 1000 CUDA draws equal {same}")
    assert (step, same) == (7, True)


# ---------------------------------------------------------------- the caching allocator against counted bytes

WIDTH, BATCH = 256, 64  # every activation 64 KiB: a multiple of the allocator's 512-byte blocks


def mlp(dev):
    torch.manual_seed(0)
    return nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(WIDTH, WIDTH), nn.ReLU())]).to(dev)


def saved_against_allocated():
    """parakit's count of what autograd saves, and the allocator's growth over the forward."""
    dev = parakit.device()
    model, x = mlp(dev), torch.randn(BATCH, WIDTH, device=dev, requires_grad=True)
    model(x).sum().backward()  # warm-up: cuBLAS's workspace, the allocator's first blocks
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    with ck.counting_saved(model.parameters()) as ledger:
        out = model(x)
        torch.cuda.synchronize(dev)
        grown = torch.cuda.memory_allocated(dev) - before
        saved = ledger.bytes
    return saved, grown, out.nbytes, x.nbytes


def test_saved_activation_bytes_equal_the_caching_allocators_growth_over_the_forward():
    saved, grown, output, given = nccl(saved_against_allocated, world_size=1)[0]
    figure(f"4-layer MLP, batch {BATCH}, width {WIDTH}, fp32 on cuda:0: parakit counts {saved} B saved "
           f"(the input's {given} B among them); the allocator grew {grown} B over the forward, the output's "
           f"{output} B among them")
    assert grown - output == saved - given


def meter_peaks():
    """The peak of one forward and backward above what was allocated before it: counted on a
    logical CPU device (every operator's outputs, `MemoryMeter`), and read from CUDA's allocator."""
    dev = parakit.device()
    counted = []
    for device_ids in (None, [dev]):
        model = mlp("cpu" if device_ids is None else dev)
        x = torch.randn(BATCH, WIDTH, device=next(model.parameters()).device)
        model(x).sum().backward()  # warm-up: the gradients exist from here on, as cuBLAS's workspace
        entry = torch.cuda.memory_allocated(dev) if device_ids else 0
        with MemoryMeter(device_ids) as meter:
            model(x).sum().backward()
        counted.append(meter.peaks()[0] - entry)
    return counted


def test_the_logical_devices_peak_and_cudas_max_memory_allocated_agree_on_one_forward_and_backward():
    on_cpu, on_cuda = nccl(meter_peaks, world_size=1)[0]
    figure(f"MemoryMeter peak of one forward+backward above its start: {on_cpu} B counted on a logical CPU device, "
           f"{on_cuda} B from torch.cuda.max_memory_allocated (CUDA's backward kernels make other temporaries)")
    assert on_cpu / 2 <= on_cuda <= 2 * on_cpu, (on_cpu, on_cuda)
