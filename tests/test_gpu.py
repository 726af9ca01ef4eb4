"""The GPU suite (issue #29, item 4): every module of parakit on NCCL with one CUDA GPU per
rank, and every solution notebook executed top to bottom where the lesson's ranks get NCCL.

    .venv/bin/python -m pytest -m gpu tests/test_gpu.py

Every test here is marked `gpu` and needs as many CUDA GPUs as its ranks (skipped with fewer,
the reason naming how many); world sizes are parameters, so on one GPU the world-size-1
cases run (NCCL at world size 1). Each compares with a reference computed on the CPU, in one
process (here, or on one gloo rank), on fresh random inputs, as the CPU tests do (their
models and helpers are imported from them), and checks what only a GPU box shows: the ranks'
tensors lived on their own GPU (`parakit.device()` is cuda:rank), results come back on the
CPU, bf16 where asked, the CUDA RNG in checkpointing. Times are never asserted.

On a machine without GPUs the emulated box (`python -m parakit.emulation`,
tests/test_emulation.py) checks NCCL's rules on the CPU instead.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import json
import random
import shutil
import subprocess
import sys
import typing

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils._pytree import tree_leaves

import parakit
import test_checkpoint
import test_ddp
import test_grading
import test_hybrid
import test_mixed_precision
import test_moe
import test_pipeline_runtime
import test_side_by_side
import test_tensor_parallel
import test_zero
from conftest import REPO, run_script, script_env
from p2p_order import assert_nccl_can_run, recording
from parakit import checkpoint as ck
from parakit import comm, ddp, grading, launcher, moe, side_by_side, torchrun, zero
from parakit import context_parallel as cp
from parakit import sequence_parallel as sp
from parakit import tensor_parallel as tp
from parakit import ulysses
from parakit.pipeline import build_schedule, pipeline_run, simulate

GPUS = torch.cuda.device_count()
pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def the_boxs_own_rule(monkeypatch):
    """The rest of the suite pins 'auto' to gloo (conftest's PARAKIT_BACKEND); here 'auto' means
    what it means on the GPU box, in this process and every one a test starts."""
    monkeypatch.delenv("PARAKIT_BACKEND", raising=False)


def needs(gpus: int):
    """Skip unless this machine has `gpus` CUDA GPUs (one per rank)."""
    return pytest.mark.skipif(GPUS < gpus, reason=f"needs {gpus} CUDA GPU{'s' if gpus > 1 else ''}, "
                                                  f"this machine has {GPUS}")


def ranks(*sizes: int) -> list:
    """World sizes as parameters, each skipped where there are fewer GPUs than ranks."""
    return [pytest.param(n, marks=needs(n), id=f"{n}gpu") for n in sizes]


def nccl(fn, *args, world_size: int, timeout: float = 300):
    return parakit.launch(fn, *args, world_size=world_size, backend="nccl", timeout=timeout)


def on_one_cpu_rank(fn, *args):
    """The one-process reference: fn on a single gloo rank, on the CPU."""
    return parakit.launch(fn, *args, world_size=1, backend="gloo")[0]


def devices_of(*objects) -> set[str]:
    """On a rank: the devices of every tensor inside `objects`, and this rank's device."""
    return {str(t.device) for t in tree_leaves(objects) if isinstance(t, torch.Tensor)} | {str(parakit.device())}


def assert_on_own_gpus(seen: list[set[str]]) -> None:
    """seen[r]: the devices rank r's tensors lived on (`devices_of`): its own GPU, cuda:r, alone."""
    for rank, devices in enumerate(seen):
        assert devices == {f"cuda:{rank}"}, f"rank {rank}'s tensors lived on {sorted(devices)}, not cuda:{rank} alone"


def assert_on_cpu(results) -> None:
    for t in tree_leaves(results):
        if isinstance(t, torch.Tensor):
            assert t.device.type == "cpu" and t.grad_fn is None, (t.device, t.grad_fn)


def close(got, expected, what: str, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """GPU against CPU: other kernels sum in other orders, so a little looser than CPU against CPU."""
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def seed() -> int:
    return random.randrange(2**31)


# ---------------------------------------------------------------- launcher

def readme_work(x):
    dist.all_reduce(x)            # the ranks are already in a process group
    return x


def backend_and_device():
    return dist.get_backend(), str(parakit.device())


@pytest.mark.parametrize("n", ranks(1, 2, 4))
def test_readme_example_sums_cpu_ones_on_each_ranks_gpu_and_returns_cpu_tensors(n):
    results = parakit.launch(readme_work, torch.ones(3), world_size=n)  # 'auto': NCCL, a GPU per rank
    assert_on_cpu(results)
    assert [r.tolist() for r in results] == [[float(n)] * 3] * n
    assert parakit.launch(backend_and_device, world_size=n) == [("nccl", f"cuda:{r}") for r in range(n)]


Pair = typing.NamedTuple("Pair", [("a", torch.Tensor), ("b", int)])


@dataclasses.dataclass
class Box:
    t: torch.Tensor


def where_arguments_live(x, on_gpu, model, box, pair):
    rank = dist.get_rank()
    seen = [str(t.device) for t in (x, x[1:], on_gpu, model.weight, box.t, pair.a)]
    y = torch.full((2,), float(rank), device=parakit.device(), requires_grad=True) * 2
    return seen, {"ordered": collections.OrderedDict(y=y), "box": Box(y), "pair": Pair(y, rank), "model": model}


@pytest.mark.parametrize("n", ranks(1, 2, 4))
def test_launch_places_cpu_and_cuda0_arguments_on_each_ranks_gpu_and_brings_results_back_to_the_cpu(n):
    on_gpu = torch.ones(2, device="cuda:0")  # a notebook's tensor on GPU 0 reaches rank r on GPU r
    results = nccl(where_arguments_live, torch.arange(4.0), on_gpu, nn.Linear(2, 2), Box(torch.zeros(1)),
                   Pair(torch.zeros(1), 0), world_size=n)
    for rank, (seen, back) in enumerate(results):
        assert seen == [f"cuda:{rank}"] * 6, (rank, seen)
        assert_on_cpu(back)
        assert type(back["ordered"]) is collections.OrderedDict and type(back["pair"]) is Pair
        assert back["box"].t.tolist() == back["pair"].a.tolist() == [2.0 * rank] * 2
        assert back["model"].weight.device.type == "cpu"
    assert parakit.launch(lambda t: str(t.device), on_gpu, world_size=n, backend="gloo") == ["cpu"] * n


def broadcast_a_module_left_on_the_cpu():
    model = nn.Linear(2, 2)  # never moved to parakit.device()
    dist.broadcast(model.weight.data, 0)


@pytest.mark.parametrize("n", ranks(1, 2))
def test_a_cpu_tensor_in_an_nccl_collective_fails_on_every_rank_and_the_pool_survives(n):
    with pytest.raises(parakit.RankError) as error:
        nccl(broadcast_a_module_left_on_the_cpu, world_size=n)
    failures = error.value.failures  # rank -> its traceback
    assert failures and all("No backend type associated with device type cpu" in text for text in failures.values()), \
        str(error.value)
    generation = launcher.pool_generation(n, "nccl")
    assert [t.item() for t in nccl(readme_work, torch.ones(1), world_size=n)] == [float(n)] * n
    assert launcher.pool_generation(n, "nccl") == generation


@needs(1)
def test_more_ranks_than_gpus_under_nccl_is_refused_naming_the_rank_without_a_gpu():
    with pytest.raises(ValueError, match=rf"^backend 'nccl' needs one GPU per rank: world_size={GPUS + 1} but {GPUS} "
                                         rf"GPU\(s\) are visible; .*rank {GPUS} would have no GPU\)$"):
        parakit.launch(int, world_size=GPUS + 1, backend="nccl")
    assert parakit.launch(backend_and_device, world_size=GPUS + 1)[0] == ("gloo", "cpu")  # 'auto' falls back


# ---------------------------------------------------------------- rings (comm, context_parallel, ulysses)

def rings_on_gpu(x):
    """x [n, ...]: row r is rank r's tensor. The ring, the two-phase all-reduce and the ring's
    MAX, and the batches the ring posted."""
    rank = dist.get_rank()
    mine = x[rank]
    summed = comm.ring_all_reduce(mine.clone())
    two_phase = comm.all_reduce_two_phase(mine.clone())
    largest = comm.ring_all_reduce(mine.clone(), op=dist.ReduceOp.MAX)
    with recording() as posted:
        comm.ring_all_reduce(mine[0].clone())  # 7 elements: chunks of unequal sizes at 2, 3 and 4 ranks
    return (summed, two_phase, largest), posted, devices_of(summed, two_phase, largest)


@pytest.mark.parametrize("n", ranks(1, 2, 3, 4))
def test_ring_all_reduce_and_two_phase_on_n_gpus_equal_the_sum_and_post_batches_nccl_can_run(n):
    x = torch.randn(n, 5, 7)
    results = nccl(rings_on_gpu, x, world_size=n)
    for rank, ((summed, two_phase, largest), _, _) in enumerate(results):
        close(summed, x.sum(0), f"rank {rank}: ring sum")
        close(two_phase, x.sum(0), f"rank {rank}: two-phase sum")
        close(largest, x.amax(0), f"rank {rank}: ring max")
    assert_on_own_gpus([seen for _, _, seen in results])
    assert_nccl_can_run([posted for _, posted, _ in results])


def attention_parts_on_gpu(q, k, v, dy, causal, layout):
    """Ring attention (and, contiguous, Ulysses) on this rank's part of the sequence: outputs
    and the gradients of q, k, v, per method."""
    n, r = dist.get_world_size(), dist.get_rank()
    part = lambda t: cp.shard_sequence(t, n, r, layout)
    found = {}
    methods = {"ring": lambda *qkv: cp.ring_attention(*qkv, causal=causal, layout=layout)}
    if layout == "contiguous":
        methods["ulysses"] = lambda *qkv: ulysses.ulysses_attention(*qkv, causal=causal)
    for name, attend in methods.items():
        mine = [part(t).clone().requires_grad_() for t in (q, k, v)]
        out = attend(*mine)
        out.backward(part(dy))
        found[name] = [out.detach()] + [t.grad for t in mine]
    return found, devices_of(found)


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("n", ranks(1, 2, 3, 4))
def test_ring_attention_and_ulysses_on_n_gpus_equal_sdpa_on_the_whole_sequence(n, causal, layout):
    q, k, v, dy = (torch.randn(2, 12, 24, 8) for _ in range(4))  # [batch, heads, seq, head_dim]: 12 and 24 split n ways
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*whole, is_causal=causal)
    expected.backward(dy)
    results = nccl(attention_parts_on_gpu, q, k, v, dy, causal, layout, world_size=n)
    for rank, (found, _) in enumerate(results):
        part = lambda t: cp.shard_sequence(t, n, rank, layout)
        for method, (out, dq, dk, dv) in found.items():
            for what, got, want in (("output", out, expected), ("dq", dq, whole[0].grad), ("dk", dk, whole[1].grad),
                                    ("dv", dv, whole[2].grad)):
                close(got, part(want.detach()), f"{method} {what} on rank {rank}", atol=1e-4)
    assert_on_own_gpus([seen for _, seen in results])


# ---------------------------------------------------------------- pipeline runtime, every schedule

SCHEDULES = test_pipeline_runtime.SCHEDULE_CASES  # (name, stages per rank)


def pipeline_steps_on_gpu(cases):
    out = test_pipeline_runtime.steps_on_ranks(cases)  # pipeline_step of each case, on this rank's GPU
    return out, devices_of(out, [model for model, *_ in cases])


@pytest.mark.parametrize("p", ranks(1, 2, 4))
def test_every_schedule_on_p_gpus_gives_each_stage_the_gradients_of_one_process(p):
    mlp, hidden, s = test_pipeline_runtime.mlp, test_pipeline_runtime.HIDDEN, seed()
    cases = []
    for name, v in SCHEDULES:
        for m in ((2 * p,) if name == "zbh2" else (p, 2 * p)):  # ZB-H2 needs 2p-1 micro-batches
            cases.append((mlp(p * v, s + m), [1] * (p * v), torch.randn(2 * m, hidden), torch.randn(2 * m, hidden),
                          name, m))
    cases.append((mlp(2 * p, s), [2] * p, torch.randn(6, hidden), torch.randn(6, hidden), "gpipe", 3))  # m not p's multiple
    cases.append((mlp(p + 1, s), [2] + [1] * (p - 1), torch.randn(2 * (p + 1), hidden),
                  torch.randn(2 * (p + 1), hidden), "1f1b", p + 1))  # uneven balance
    results = nccl(pipeline_steps_on_gpu, cases, world_size=p)
    test_pipeline_runtime.assert_equal_to_one_process([out for out, _ in results], cases, p)
    assert_on_own_gpus([seen for _, seen in results])


def schedule_run_on_gpu(name, p, m, v, model, x, y):
    """pipeline_run of one schedule on this rank: its sends and receives, its actions and peak."""
    with parakit.CommLog() as log:
        run = pipeline_run(model, [1] * (p * v), x, y, F.mse_loss, schedule=name, num_microbatches=m)
    calls = [(r.op, r.nbytes, r.peer) for r in log.records]  # in the order posted
    grads = [q.grad for q in model.parameters() if q.grad is not None]
    return calls, [e.action for e in run.events], run.peak_activations, devices_of(grads, run.loss)


@pytest.mark.parametrize("name,v", SCHEDULES, ids=[name for name, _ in SCHEDULES])
@pytest.mark.parametrize("p", ranks(2, 4))
def test_runtime_on_p_gpus_runs_the_schedules_actions_sending_what_it_names_holding_the_simulated_peak(p, name, v):
    m = 2 * p
    hidden = test_pipeline_runtime.HIDDEN
    model, x, y = test_pipeline_runtime.mlp(p * v, seed()), torch.randn(2 * m, hidden), torch.randn(2 * m, hidden)
    results = nccl(schedule_run_on_gpu, name, p, m, v, model, x, y, world_size=p)
    schedule = build_schedule(name, p, m, v)
    predicted = simulate(schedule).peak_activations
    mb_bytes = 2 * hidden * 4  # one micro-batch of 2 samples, fp32
    for rank, (calls, actions, peak, _) in enumerate(results):
        assert actions == list(schedule.actions[rank])
        want_sends = [("isend", mb_bytes, a.peer) for a in schedule.actions[rank] if a.op.startswith("SEND")]
        want_recvs = [("irecv", mb_bytes, a.peer) for a in schedule.actions[rank] if a.op.startswith("RECV")]
        assert [c for c in calls if c[0] == "isend"] == want_sends, rank  # in the schedule's order
        assert [c for c in calls if c[0] == "irecv"] == want_recvs, rank
        assert len(calls) == len(want_sends) + len(want_recvs), (rank, calls)
        assert peak == predicted[rank]
    assert_on_own_gpus([seen for *_, seen in results])


# ---------------------------------------------------------------- DDP wrappers

MODELS = {"mlp": test_ddp.mlp, "tied": test_ddp.seeded(test_ddp.Tied), "frozen_norm": test_ddp.seeded(test_ddp.FrozenNorm)}


def ddp_wrappers_on_gpu(s, model_name, opt_name):
    """Each wrapper trains 3 steps on this rank's rows on its GPU; one process trains on every
    row on the CPU. Returns each wrapper's largest difference per parameter, the reference's scale."""
    n, rank, device = dist.get_world_size(), dist.get_rank(), parakit.device()
    make = MODELS[model_name]
    x, y, my_x, my_y = test_ddp.shards(s, n)
    reference = make(s)
    test_ddp.train(reference, reference.parameters(), x, y, 3, opt_name, pieces=n)
    errors, seen = {}, set()
    for kind in test_ddp.WRAPPERS:
        net = make(s + rank).to(device)  # different on each rank: the wrap broadcasts rank 0's
        model = getattr(ddp, kind)(net)
        test_ddp.train(model, model.parameters(), my_x.to(device), my_y.to(device), 3, opt_name,
                       model.finish_gradient_synchronization)
        errors[kind] = [(a.detach().cpu() - b).abs().max().item() for a, b in zip(net.parameters(), reference.parameters())]
        seen |= devices_of(list(net.parameters()), [p.grad for p in net.parameters()], list(net.buffers()))
    return errors, max(p.abs().max().item() for p in reference.parameters()), seen


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("n", ranks(1, 2, 4))
def test_every_ddp_wrapper_on_n_gpus_trains_like_one_cpu_process_on_the_whole_batch(n, model_name, opt_name):
    results = nccl(ddp_wrappers_on_gpu, seed(), model_name, opt_name, world_size=n)
    for rank, (errors, scale, _) in enumerate(results):
        for kind, per_param in errors.items():
            assert max(per_param) <= 1e-4 * scale + 1e-5, (kind, rank, per_param)
    assert_on_own_gpus([seen for *_, seen in results])


def wrappers_against_torch_ddp_on_gpu(s):
    from torch.nn.parallel import DistributedDataParallel
    n, rank, device = dist.get_world_size(), dist.get_rank(), parakit.device()
    _, _, my_x, my_y = test_ddp.shards(s, n)
    my_x, my_y = my_x.to(device), my_y.to(device)
    net = test_ddp.mlp(s + rank).to(device)
    theirs = DistributedDataParallel(copy.deepcopy(net), device_ids=[device.index])
    test_ddp.train(theirs, theirs.parameters(), my_x, my_y, 3, "adamw")
    differences = {}
    for kind in test_ddp.WRAPPERS:
        model = getattr(ddp, kind)(copy.deepcopy(net))
        test_ddp.train(model, model.parameters(), my_x, my_y, 3, "adamw", model.finish_gradient_synchronization)
        differences[kind] = max((a - b).abs().max().item() for a, b in zip(model.module.parameters(),
                                                                           theirs.module.parameters()))
    return differences


@pytest.mark.parametrize("n", ranks(1, 2, 4))
def test_every_ddp_wrapper_on_n_gpus_equals_torch_ddp(n):
    for rank, differences in enumerate(nccl(wrappers_against_torch_ddp_on_gpu, seed(), world_size=n)):
        assert max(differences.values()) <= 1e-5, (rank, differences)


def timed_buckets_on_gpu():
    """BucketedDDP with 3 buckets on this rank's GPU, each all-reduce timed by CUDA events."""
    model = ddp.BucketedDDP(test_ddp.mlp(0, sizes=(6, 64, 64, 3)).to(parakit.device()),
                            bucket_size_mb=16 * 64 * 4 / 2**20)
    events = []
    model.register_comm_hook(ddp.timed_hook(ddp.allreduce_hook, events))
    model(torch.randn(4, 6, device=parakit.device())).sum().backward()
    model.finish_gradient_synchronization()
    return [tuple(span) for span in events], len(model.buckets), devices_of(list(model.parameters()))


@pytest.mark.parametrize("n", ranks(1, 2))
def test_timed_hook_on_n_gpus_gives_one_cuda_event_span_per_bucket_each_ending_after_it_starts(n):
    results = nccl(timed_buckets_on_gpu, world_size=n)
    for spans, buckets, _ in results:
        assert len(spans) == buckets == 3
        assert all(isinstance(a, float) and isinstance(b, float) and a <= b for a, b in spans), spans
    assert_on_own_gpus([seen for *_, seen in results])


# ---------------------------------------------------------------- ZeRO-1/2 and FSDP in bf16

SGD = dict(lr=0.1, momentum=0.9)


def zero_in_bf16_on_gpu(stage, s, batches):
    """ZeRO-`stage` on this rank's GPU computing in bf16 (fp32 masters), 3 SGD steps on this
    rank's rows. Stage 3 (FSDP) trains test_zero's TiedNet, stages 1 and 2 test_mixed_precision's MLP.
    Returns the full parameters in fp32, the dtypes seen, the collectives and the devices."""
    n, rank, device = dist.get_world_size(), dist.get_rank(), parakit.device()
    if stage == 3:
        net = test_zero.TiedNet(s).to(device)
        model = zero.FullyShardedDataParallel(net, units=net.units(), compute_dtype=torch.bfloat16)
        optimizer = torch.optim.SGD(model.parameters(), **SGD)
    else:
        net = model = test_mixed_precision.mlp().to(device)
        optimizer = zero.ShardedOptimizer(net.parameters(), torch.optim.SGD, stage=stage, compute_dtype=torch.bfloat16,
                                          **SGD)
    with parakit.CommLog() as log:
        for x, y in batches:
            out = model(x.chunk(n)[rank].bfloat16())
            F.mse_loss(out.float(), y.chunk(n)[rank]).backward()
            if stage == 3:
                model.finish_gradient_synchronization()
                gradients = {shard.grad.dtype for shard in model.shards}
            optimizer.step()
            optimizer.zero_grad()
    held = model.shards if stage == 3 else list(net.parameters())
    dtypes = {"output": out.dtype, "held": {t.dtype for t in held}, **({"gradients": gradients} if stage == 3 else {})}
    full = model.gather_full_params() if stage == 3 else {k: p.detach() for k, p in net.named_parameters()}
    return {k: v.float() for k, v in full.items()}, dtypes, {r.op for r in log.records}, devices_of(held, out)


def one_cpu_process(model, optimizer, batches):
    for x, y in batches:
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("n", ranks(1, 2, 4))
def test_zero_stage_on_n_gpus_in_bf16_keeps_fp32_masters_and_trains_like_one_cpu_process_in_fp32(n, stage):
    s = seed()
    if stage == 3:
        batches = test_zero.batches(s, n)  # 3 steps of 2 rows per rank
        expected = test_zero.train_one_process(s, n, "sgd")
    else:
        g = torch.Generator().manual_seed(s)
        batches = [(torch.randn(4 * n, 16, generator=g), torch.randn(4 * n, 8, generator=g)) for _ in range(3)]
        reference = test_mixed_precision.mlp()
        expected = one_cpu_process(reference, torch.optim.SGD(reference.parameters(), **SGD), batches)
    results = nccl(zero_in_bf16_on_gpu, stage, s, batches, world_size=n)
    for rank, (full, dtypes, ops, _) in enumerate(results):
        assert list(full) == list(expected), rank
        close(full, expected, f"rank {rank}", rtol=0, atol=test_zero.HALF_TOLERANCE[torch.bfloat16])
        assert dtypes["output"] == torch.bfloat16
        assert dtypes["held"] == ({torch.float32} if stage == 3 else {torch.bfloat16})  # FSDP's shards are the masters
        if stage == 3:
            assert dtypes["gradients"] == {torch.float32}
        if n > 1:  # NCCL's default: gradients reduce-scattered, not all-reduced
            assert "reduce_scatter_single" in ops and "all_reduce" not in ops, ops
            assert "all_gather_single" in ops, ops
    assert_on_own_gpus([seen for *_, seen in results])


# ---------------------------------------------------------------- checkpoint: the CUDA RNG

def checkpointed_dropout_on_gpu(s):
    """Dropout on this rank's GPU: one step with no checkpoint, then parakit's checkpoints
    (full, segments, selective), torch's, and parakit's without restoring the RNG, each from
    the same seed. Returns each step's output and gradients, and the CUDA RNG state after it."""
    device = parakit.device()
    mlp = test_checkpoint.mlp(4, 16, s, dropout=0.5).to(device)
    block = test_checkpoint.transformer_block(s).to(device)  # dropout inside attention (SDPA's kernel) too
    x, tokens = torch.randn(8, 16, device=device), torch.randn(2, 5, 16, device=device)

    def step(model, forward, x):
        model.zero_grad(set_to_none=True)
        x = x.detach().clone().requires_grad_()
        torch.manual_seed(s + 1)  # the CPU's and every CUDA generator
        out = forward(x)
        (out * torch.linspace(-1, 1, out.shape[-1], device=device)).sum().backward()
        return [out.detach(), x.grad, *[p.grad for p in model.parameters()]], torch.cuda.get_rng_state(device)

    found = {
        "mlp": {"plain": step(mlp, mlp, x), "checkpoint": step(mlp, lambda x: ck.checkpoint(mlp, x), x),
                "segments": step(mlp, lambda x: ck.checkpoint_sequential(mlp, 2, x), x),
                "selective": step(mlp, lambda x: ck.checkpoint_sequential(mlp, 2, x, keep=ck.MATMULS), x),
                "torch": step(mlp, lambda x: torch_checkpoint.checkpoint_sequential(mlp, 2, x, use_reentrant=False), x),
                "not_restored": step(mlp, lambda x: ck.checkpoint(mlp, x, preserve_rng_state=False), x)},
        "block": {"plain": step(block, block, tokens), "checkpoint": step(block, lambda x: ck.checkpoint(block, x), tokens),
                  "selective": step(block, lambda x: ck.checkpoint(block, x, keep=ck.MATMULS), tokens),
                  "torch": step(block, lambda x: torch_checkpoint.checkpoint(block, x, use_reentrant=False), tokens)},
    }
    seen = devices_of([tensors for runs in found.values() for tensors, _ in runs.values()])
    return found, seen


@pytest.mark.parametrize("n", ranks(1, 2))
def test_checkpoint_recomputation_on_each_ranks_gpu_draws_the_same_dropout_from_the_cuda_rng(n):
    results = nccl(checkpointed_dropout_on_gpu, seed(), world_size=n)
    for rank, (found, _) in enumerate(results):
        for model, runs in found.items():
            expected, state = runs["plain"]
            for name in set(runs) - {"plain", "not_restored"}:
                got, state_after = runs[name]
                assert len(got) == len(expected)
                for i, (g, e) in enumerate(zip(got, expected)):
                    close(g, e, f"rank {rank}, {model}, {name}, tensor {i}", rtol=1e-5, atol=1e-6)
                assert torch.equal(state_after, state), f"rank {rank}, {model}, {name}: the CUDA RNG advanced otherwise"
        not_restored = found["mlp"]["not_restored"][0]
        assert not torch.equal(not_restored[1], found["mlp"]["plain"][0][1]), "the recomputation drew the same mask " \
            "without the CUDA RNG restored: the test does not see the restore"
    assert_on_own_gpus([seen for _, seen in results])


# ---------------------------------------------------------------- tensor and sequence parallelism

HIDDEN, HEADS, FFN = 16, 4, 32


def block_on_gpu(x, dy, sequence_parallel):
    """parakit's tensor-parallel block (or its sequence-parallel twin on this rank's slice of
    the sequence) on this rank's GPU: output, dL/dx (this rank's slice where sequence
    parallel), and every parameter and its gradient whole (gathered from the ranks)."""
    t = dist.get_world_size()
    torch.manual_seed(0)
    cls = sp.SequenceParallelTransformerBlock if sequence_parallel else tp.ParallelTransformerBlock
    block = cls(HIDDEN, HEADS, FFN).to(parakit.device())
    full = {name: test_tensor_parallel._full(name, p.detach(), t) for name, p in block.named_parameters()}
    x_in = (sp.split_sequence(x) if sequence_parallel else x).clone().requires_grad_()
    with parakit.CommLog() as log:
        y = block(x_in)
        y.backward(sp.split_sequence(dy) if sequence_parallel else dy)
    if sequence_parallel:
        sp.sync_sequence_parallel_grads(block)
    grads = {name: test_tensor_parallel._full(name, p.grad, t) for name, p in block.named_parameters()}
    ops = sorted(r.op for r in log.records)
    return y.detach(), x_in.grad, full, grads, ops, devices_of(y, x_in.grad, list(block.parameters()))


def dense_gradients(dense: nn.Module) -> dict[str, torch.Tensor]:
    """test_tensor_parallel.DenseBlock's gradients under parakit's parameter names and layout."""
    back = test_tensor_parallel._from_mha_layout
    grads = {"attn.qkv.weight": back(dense.attn.in_proj_weight.grad, HEADS),
             "attn.qkv.bias": back(dense.attn.in_proj_bias.grad, HEADS),
             "attn.proj.weight": dense.attn.out_proj.weight.grad, "attn.proj.bias": dense.attn.out_proj.bias.grad,
             **{n: p.grad for n, p in dense.named_parameters() if not n.startswith("attn.")}}
    return {n.replace("fc", "mlp.fc") if n.startswith("fc") else n: g for n, g in grads.items()}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
@pytest.mark.parametrize("n", ranks(1, 2, 4))
def test_tensor_and_sequence_parallel_block_on_n_gpus_equals_torchs_dense_block_on_the_cpu(n, sequence_parallel):
    x, dy = torch.randn(2, 8, HIDDEN), torch.randn(2, 8, HIDDEN)  # [batch, seq, hidden]
    results = nccl(block_on_gpu, x, dy, sequence_parallel, world_size=n)
    dense = test_tensor_parallel.DenseBlock(results[0][2], HIDDEN, HEADS, FFN)  # rank 0's weights, whole, on the CPU
    x_ref = x.clone().requires_grad_()
    y_ref = dense(x_ref)
    y_ref.backward(dy)
    want = dense_gradients(dense)
    for rank, (y, dx, full, grads, ops, _) in enumerate(results):
        mine = (lambda t: t.chunk(n, 1)[rank]) if sequence_parallel else (lambda t: t)
        close(y, mine(y_ref.detach()), f"rank {rank}: output")
        close(dx, mine(x_ref.grad), f"rank {rank}: dL/dx")
        close(full, results[0][2], f"rank {rank}: the same whole weights as rank 0", rtol=0, atol=0)
        for name, g in grads.items():
            close(g, want[name], f"rank {rank}: dL/d{name}")
        if n > 1:
            assert set(ops) == ({"all_gather_single", "reduce_scatter_single"} if sequence_parallel else {"all_reduce"})
    assert_on_own_gpus([seen for *_, seen in results])


# ---------------------------------------------------------------- mixture of experts

def expert_parallel_on_gpu(s, x_all, upstream, num_experts, k, capacity_factor):
    """ExpertParallelMoE on this rank's tokens on its GPU: output, dL/dx, the router's gradient
    summed over ranks, each of its experts' gradients (by global index), and the drops."""
    n, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(s)
    layer = moe.ExpertParallelMoE(8, 12, num_experts, k, capacity_factor).to(parakit.device())
    x = x_all.chunk(n)[rank].clone().requires_grad_()
    y = layer(x)
    y.backward(upstream.chunk(n)[rank])
    router = layer.router.weight.grad.clone()
    dist.all_reduce(router)
    experts = {layer.first_expert + j: [p.grad for p in e.parameters()] for j, e in enumerate(layer.experts)}
    return y.detach(), x.grad, router, experts, layer.routing.dropped(), devices_of(y, x.grad, experts)


@pytest.mark.parametrize("n", ranks(1, 2, 4))
def test_expert_parallel_layer_on_n_gpus_equals_one_cpu_moe_in_outputs_gradients_and_drops(n):
    for num_experts, k, capacity_factor, tokens in [(4, 1, 1.0, 12), (8, 2, 0.5, 10)]:
        s = seed()
        x_all, upstream = torch.randn(n * tokens, 8), torch.randn(n * tokens, 8)
        torch.manual_seed(s)
        reference = moe.MoE(8, 12, num_experts, k, capacity_factor)
        x_ref = x_all.clone().requires_grad_()
        y_ref = reference(x_ref, groups=n)
        y_ref.backward(upstream)
        results = nccl(expert_parallel_on_gpu, s, x_all, upstream, num_experts, k, capacity_factor, world_size=n)
        for rank, (y, dx, router, experts, dropped, _) in enumerate(results):
            what = f"rank {rank}, E={num_experts}, k={k}, seed {s}"
            close(y, y_ref.detach().chunk(n)[rank], f"{what}: output")
            close(dx, x_ref.grad.chunk(n)[rank], f"{what}: dL/dx")
            close(router, reference.router.weight.grad, f"{what}: router gradient")
            for e, grads in experts.items():
                for g, p in zip(grads, reference.experts[e].parameters()):
                    assert (g is None) == (p.grad is None), f"{what}: expert {e} got a gradient on one side only"
                    if g is not None:
                        close(g, p.grad, f"{what}: expert {e}")
            assert dropped == reference.routings[rank].dropped(), what
        assert_on_own_gpus([seen for *_, seen in results])


@pytest.mark.parametrize("n,ep", [pytest.param(n, ep, marks=needs(n), id=f"{n}gpu-ep{ep}")
                                  for n, ep in ((1, 1), (2, 2), (4, 2), (4, 4))])
def test_ep_dp_training_on_n_gpus_has_the_losses_of_one_cpu_process(n, ep):
    runs = nccl(test_moe._ep_dp_losses, ep, 5, world_size=n)
    reference = moe.train_one_process(n, 5, tokens_per_rank=8, num_experts=4, k=2, capacity_factor=1.0,
                                      aux_coef=0.1)["loss"]
    assert all(run == runs[0] for run in runs)
    close(torch.tensor(runs[0]["loss"]), torch.tensor(reference), "losses", rtol=0, atol=1e-4)


# ---------------------------------------------------------------- side_by_side, plan.measure

def own_meter_and_device(x):
    covered = [str(d) for d in parakit.devices.current_meter().devices]
    y = x * 2
    dist.all_reduce(y)
    return covered, str(y.device)


def measured_on_gpu(x):
    return side_by_side.measure(own_meter_and_device, x)


@pytest.mark.parametrize("n", ranks(1, 2, 4))
def test_side_by_side_on_n_gpus_meters_each_ranks_own_gpu_and_writes_the_ring_model(n):
    x = torch.randn(1000)
    both = side_by_side.compare({"ring": test_side_by_side.by_ring, "torch": test_side_by_side.by_torch}, x,
                                world_size=n, backend="nccl")
    both.check(rtol=1e-5, atol=1e-5)
    model = 2 * (n - 1) * x.nbytes // n
    for rank in range(n):
        torch_run, ring_run = both.runs["torch"][rank], both.runs["ring"][rank]
        close(torch_run.result, x * n, f"rank {rank}")
        assert torch_run.result.device.type == "cpu"
        assert torch_run.collectives == {"allreduce": 1}
        assert ring_run.collectives == ({"send": 2 * (n - 1), "recv": 2 * (n - 1)} if n > 1 else {})
        assert torch_run.written_by == "model" and torch_run.written == model  # the OS counts none of NCCL's bytes
        if n > 1:  # (on one rank the ring sends nothing: nothing for the model to count)
            assert ring_run.written_by == "model" and ring_run.written == model
        assert torch_run.peak >= x.nbytes  # the clone, on this rank's GPU
    assert f"{model:,} (model)" in str(both)
    for rank, m in enumerate(nccl(measured_on_gpu, x, world_size=n)):
        assert m.result == ([f"cuda:{rank}"], f"cuda:{rank}")  # not every GPU, not GPU 0
        assert m.peak >= x.nbytes


@needs(1)
def test_plan_measure_on_a_gpu_host_meters_the_cpu_its_gloo_ranks_run_on():
    """Lesson 10's cell: gloo ranks on a host with GPUs; a meter of GPU 0 read 0 bytes there."""
    from parakit.plan import Config
    from parakit.plan.measure import compare, measure, tiny_model
    config = Config(dp=2, zero=1, microbatch=4, dtype="fp32")
    for row in compare(tiny_model(), config, measure(tiny_model(), config)):
        assert row["measured_peak"] > row["measured_held"] > 0, row
        assert abs(row["peak_error"]) <= 0.15, row


def run_config_on_gpu(model, config):
    from parakit.plan.measure import run_config
    return run_config(model, config), str(parakit.device()), torch.cuda.max_memory_allocated(parakit.device())


@pytest.mark.parametrize("n", ranks(1, 2, 4))
def test_plan_run_config_on_n_nccl_ranks_meters_each_ranks_gpu_and_holds_the_planners_bytes(n):
    from parakit.plan import Config
    from parakit.plan.measure import compare, tiny_model
    config = Config(dp=n, zero=1, microbatch=4, dtype="fp32")
    results = nccl(run_config_on_gpu, tiny_model(), config, world_size=n)
    assert [where for _, where, _ in results] == [f"cuda:{r}" for r in range(n)]
    for row, (got, _, gpu_peak) in zip(compare(tiny_model(), config, [got for got, _, _ in results]), results):
        assert got["written"] is None  # NCCL: the OS counts nothing
        assert gpu_peak >= row["measured_peak"] > row["measured_held"] > 0, row  # the rank's own GPU's allocator
        assert abs(row["held_error"]) <= 0.001, row


# ---------------------------------------------------------------- %%ranks, torchrun, train

RANKS_CELLS = '''
from IPython.testing.globalipapp import start_ipython
ip = start_ipython()
ip.run_line_magic("load_ext", "parakit")
ip.run_cell_magic("ranks", "{n}", """import parakit, torch, torch.distributed as dist
x = torch.ones(2, device=parakit.device()) * dist.get_rank()   # this rank's GPU under NCCL
dist.all_reduce(x)
x""")
ip.run_cell_magic("ranks", "{n} --backend nccl", "print('where', parakit.device(), x.device, dist.get_backend())")
'''


@pytest.mark.parametrize("n", ranks(1, 2, 4))
def test_ranks_magic_runs_its_docstring_cell_on_each_ranks_gpu_and_keeps_its_names(tmp_path, n):
    done = run_script(tmp_path, RANKS_CELLS.format(n=n), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    total = float(sum(range(n)))
    for rank in range(n):
        assert f"[rank {rank}] tensor([{total:.0f}., {total:.0f}.], device='cuda:{rank}')" in done.stdout, done.stdout
        assert f"[rank {rank}] where cuda:{rank} cuda:{rank} nccl" in done.stdout, done.stdout


TORCHRUN_JOB = """
import json, os, torch, torch.distributed as dist, parakit
from parakit.torchrun import process_group

with process_group():
    x = torch.ones(2, device=parakit.device()) * (dist.get_rank() + 1)
    dist.all_reduce(x)
    objects = [None] * dist.get_world_size()
    dist.all_gather_object(objects, dist.get_rank())
    bound = getattr(dist.group.WORLD, "bound_device_id", None)  # device_id passed: NCCL connected eagerly
    print("RESULT " + json.dumps([dist.get_rank(), int(os.environ["LOCAL_RANK"]), dist.get_backend(),
                                  str(parakit.device()), str(x.device), x.tolist(), objects, str(bound)]))
"""


@pytest.mark.parametrize("n", ranks(1, 2, 4))
def test_torchrun_jobs_join_nccl_on_their_local_rank_gpu_passed_as_device_id(tmp_path, n):
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_JOB)
    output = torchrun.run(script, n)
    lines = sorted(json.loads(line.removeprefix("RESULT ")) for line in output.splitlines() if line.startswith("RESULT "))
    total = float(sum(range(1, n + 1)))
    assert lines == [[r, r, "nccl", f"cuda:{r}", f"cuda:{r}", [total, total], list(range(n)), f"cuda:{r}"]
                     for r in range(n)]


def trainer_on_gpu(argv):
    return test_hybrid.run_trainer(argv), str(parakit.device())


def mesh_id(n: int, mesh: list[str]) -> str:
    return f"{n}gpu-" + ("-".join(f"{a.strip('-')}{b}" for a, b in zip(mesh[::2], mesh[1::2])) or "one")


@pytest.mark.parametrize("n,mesh", [pytest.param(n, mesh, marks=needs(n), id=mesh_id(n, mesh))
                                    for n, mesh in [(1, []), (2, ["--pp", "2"]), (2, ["--tp", "2"]),
                                                    (2, ["--cp", "2"]), (4, ["--pp", "2", "--tp", "2"]),
                                                    (4, ["--dp", "2", "--cp", "2"]), (8, test_hybrid.TWO_NODE_MESH)]])
def test_hybrid_trainer_on_n_gpus_has_the_losses_of_one_cpu_process(n, mesh):
    expected = on_one_cpu_rank(test_hybrid.run_trainer, test_hybrid.SMALL)
    results = nccl(trainer_on_gpu, test_hybrid.SMALL + mesh, world_size=n)
    assert [where for _, where in results] == [f"cuda:{r}" for r in range(n)]
    for rank, (losses, _) in enumerate(results):
        close(torch.tensor(losses), torch.tensor(expected), f"rank {rank}", rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("n", ranks(2))
def test_hybrid_trainer_on_gpus_resumes_from_its_checkpoint_with_the_same_losses(tmp_path, n):
    folder, argv = tmp_path / "ckpt", test_hybrid.SMALL[2:] + ["--pp", "2"]
    whole = nccl(test_hybrid.run_trainer, ["--steps", "5"] + argv, world_size=n)[0]
    first = nccl(test_hybrid.run_trainer, ["--steps", "3", "--save", str(folder)] + argv, world_size=n)[0]
    resumed = nccl(test_hybrid.run_trainer, ["--steps", "2", "--resume", str(folder)] + argv, world_size=n)[0]
    close(torch.tensor(first + resumed), torch.tensor(whole), "losses", rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- grading.check in the kernel

def where_inputs_live(tensor):
    return str(tensor.device)


def this_ranks_gpu(tensor):
    return f"cuda:{dist.get_rank()}"


@pytest.mark.parametrize("n", ranks(1, 2, 3, 4))
def test_grading_check_on_n_gpus_gives_inputs_on_each_ranks_gpu_and_grades_right_wrong_and_forbidden(n, capsys):
    grading.check(where_inputs_live, this_ranks_gpu, test_grading.random_vector, world_sizes=[n], quiet=True)
    grading.check(comm.ring_all_reduce, test_grading.reference_sum, test_grading.random_vector, world_sizes=[n])
    assert f"passed: ring_all_reduce matches the reference on {n} ranks" in capsys.readouterr().out
    if n > 1:
        with pytest.raises(AssertionError, match=rf"wrong_sum on {n} ranks, rank \d, trial 1"):
            grading.check(test_grading.wrong_sum, test_grading.reference_sum, test_grading.random_vector,
                          world_sizes=[n])
    with pytest.raises(grading.Tripwire, match="sum_with_all_reduce called .*which this exercise forbids"):
        grading.check(test_grading.sum_with_all_reduce, test_grading.reference_sum, test_grading.random_vector,
                      world_sizes=[n], forbid={dist.all_reduce: "build it from send and recv"})
    grading.check(comm.ring_all_reduce, test_grading.reference_sum, test_grading.random_vector, world_sizes=[n],
                  quiet=True)  # the pool still grades


# ---------------------------------------------------------------- every solution notebook with NCCL

# GPUs each lesson needs for every cell that can use NCCL to get it: its largest world size under
# backend 'auto' (launch, %%ranks, check's world_sizes, torchrun). Lesson 07's 2x2x2 cube cells
# (8 ranks) run on gloo below 8 GPUs, by the 'auto' rule, as lesson 10's measurements always do.
# Each lesson's GPUs: the largest world size its cells launch under "auto" on NCCL (07's 8-rank cells
# fall back to gloo on a box with fewer GPUs). tests/test_suite.py fails on a CPU machine when a
# solution notebook is missing here.
NOTEBOOK_GPUS = {"00_collectives": 4, "01_data_parallel": 1, "02_ddp": 4, "03_zero": 4, "04_pipeline": 4,
                 "05_checkpointing": 2, "06_tensor_parallel": 4, "07_3d_parallelism": 4, "08_long_sequences": 4,
                 "09_mixture_of_experts": 4, "10_planning": 2, "11_real_run": 4}
NOTEBOOKS = sorted((REPO / "solutions").glob("[0-9][0-9]_*.ipynb"))
CELL_TIMEOUT = 300  # seconds: a bound on a hang, not a measure

EXECUTE = """
import json, re, sys
import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

path, folder, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3])
notebook = nbformat.read(path, as_version=4)
client = NotebookClient(notebook, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": folder}})
stopped = []
try:
    client.execute()
except CellExecutionError:
    pass  # the error is in the cell's outputs, read below
except Exception as error:  # a cell past the timeout, a kernel that died
    stopped = [f"execution stopped: {type(error).__name__}: {error}"]
plain = lambda text: re.sub(r"\\x1b\\[[0-9;]*m", "", text)  # the traceback without its colours
errors = [f"cell {i} (execution {cell.get('execution_count')}): {out['ename']}: {plain(out['evalue'])}\\n"
          + plain("\\n".join(out.get("traceback", [])))[-3000:]
          for i, cell in enumerate(notebook.cells) for out in cell.get("outputs", [])
          if out.get("output_type") == "error" and "raises-exception" not in cell.metadata.get("tags", [])]
print("ERRORS " + json.dumps(errors + stopped))
"""


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("notebook", [pytest.param(nb, marks=needs(NOTEBOOK_GPUS.get(nb.stem, 4)),
                                                   id=f"{nb.stem}-{NOTEBOOK_GPUS.get(nb.stem, '?')}gpu")
                                      for nb in NOTEBOOKS])
def test_solution_notebook_runs_top_to_bottom_with_nccl(tmp_path, notebook):
    """The lesson in a kernel of this environment, in a folder of its own (the files its cells
    write stay there), each cell bounded by CELL_TIMEOUT; fails on any error output."""
    assert notebook.stem in NOTEBOOK_GPUS, f"add {notebook.stem} to NOTEBOOK_GPUS: its largest world size under 'auto'"
    copy_ = tmp_path / notebook.name
    shutil.copy(notebook, copy_)
    runner = tmp_path / "execute.py"
    runner.write_text(EXECUTE)
    done = subprocess.run([sys.executable, str(runner), str(copy_), str(tmp_path), str(CELL_TIMEOUT)], cwd=tmp_path,
                          env=script_env(), capture_output=True, text=True, timeout=3500)
    found = [line for line in done.stdout.splitlines() if line.startswith("ERRORS ")]
    assert done.returncode == 0 and found, done.stdout[-5000:] + done.stderr[-5000:]
    errors = json.loads(found[-1].removeprefix("ERRORS "))
    assert not errors, f"{notebook.name} on {GPUS} GPU(s):\n" + "\n\n".join(errors)
