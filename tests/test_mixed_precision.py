"""Mixed precision on real ranks (gloo on CPU): parakit's ZeRO-1/2/3 in bf16 and fp16 with fp32
master weights against PyTorch's own mixed precision (DistributedDataParallel under
torch.autocast, torch.amp.GradScaler), the bytes of the ZeRO paper's mixed-precision row, and
parakit.precision.LossScaler against GradScaler in one process."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import parakit
from parakit import zero
from parakit import precision
from parakit.precision import LossScaler

STEPS = 20
SCALE = dict(init_scale=2.0 ** 30, growth_interval=3)  # overflows first, then grows and overflows again


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))


def my_batches():
    """STEPS batches of 8 rows, the same on every rank; this rank's share of each."""
    g, n, rank = torch.Generator().manual_seed(1), dist.get_world_size(), dist.get_rank()
    for _ in range(STEPS):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
        yield x.chunk(n)[rank], y.chunk(n)[rank]


def pytorch_amp(dtype):
    """PyTorch's reference: fp32 parameters (the masters) in DDP, forward under autocast in
    `dtype`, AdamW; fp16 through GradScaler. Returns the losses, the scales, and the parameters
    in fp32 and rounded to `dtype` (the masters and what the forward computes with)."""
    model = nn.parallel.DistributedDataParallel(mlp())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(parakit.device().type, **SCALE, enabled=dtype == torch.float16)
    losses, scales = [], []
    for x, y in my_batches():
        optimizer.zero_grad()
        with precision.autocast(dtype, x):  # on x's device: autocast("cpu") would leave CUDA ops in fp32
            out = model(x)
        loss = F.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    return losses, scales, {"fp32": [p.detach() for p in model.parameters()],
                            "rounded": [p.detach().to(dtype).float() for p in model.parameters()]}


def parakit_amp(stage, dtype, reduce_dtype=torch.float32):
    """parakit's ZeRO-`stage` with compute in `dtype` and fp32 masters; fp16 through LossScaler.
    Returns the losses, the scales, the parameters (stage 3: the fp32 masters, gathered; else the
    compute copies) and the skipped steps."""
    net = mlp()
    if stage == 3:
        model = zero.FullyShardedDataParallel(net, units=[m for m in net if isinstance(m, nn.Linear)], compute_dtype=dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        model = net
        optimizer = zero.ShardedOptimizer(net.parameters(), torch.optim.AdamW, stage=stage, lr=1e-2,
                                          compute_dtype=dtype, reduce_dtype=reduce_dtype)
    scaler = LossScaler(**SCALE, group=dist.group.WORLD if stage == 3 else None)
    fp16 = dtype == torch.float16
    losses, scales = [], []
    for x, y in my_batches():
        optimizer.zero_grad()
        loss = F.mse_loss(model(x.to(dtype)).float(), y)
        (scaler.scale(loss) if fp16 else loss).backward()
        if stage == 3:
            model.finish_gradient_synchronization()
        scaler.step(optimizer) if fp16 else optimizer.step()
        if fp16:
            scaler.update()
        losses.append(loss.item())
        scales.append(scaler.get_scale() if fp16 else 1.0)
    params = model.gather_full_params().values() if stage == 3 else [p.detach().float() for p in net.parameters()]
    return losses, scales if fp16 else [1.0] * STEPS, list(params), scaler.skipped


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_twenty_steps_equal_pytorch_amp_at_every_stage_and_fp16_skips_the_same_steps(dtype):
    """Gradients reduced in fp32 (summed as DDP sums them): equal to the last bit, 20 steps on
    2 ranks. In fp16 both start at a scale of 2^30: the same steps overflow, are skipped and
    back off; the scale grows every 3 clean steps and overflows again."""
    losses, scales, params = parakit.launch(pytorch_amp, dtype, world_size=2)[0]
    if dtype == torch.float16:
        assert scales != [1.0] * STEPS
    skips = sum(later < earlier for earlier, later in zip([SCALE["init_scale"]] + scales, scales))
    for stage in (1, 2, 3):
        got = parakit.launch(parakit_amp, stage, dtype, world_size=2)[0]
        assert got[0] == losses, stage
        if dtype == torch.float16:
            assert got[1] == scales and got[3] == skips > 1, stage
        for mine, theirs in zip(got[2], params["fp32" if stage == 3 else "rounded"]):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_bf16_gradients_reduced_in_bf16_stay_within_the_lessons_tolerance():
    """The paper's way (gradients summed in bf16) differs from fp32 sums by rounding: within
    the tolerance lesson 03 states (atol 2e-2 on the parameters after 20 steps, on 4 ranks)."""
    _, _, params = parakit.launch(pytorch_amp, torch.bfloat16, world_size=4)[0]
    for stage in (1, 2):
        got = parakit.launch(parakit_amp, stage, torch.bfloat16, None, world_size=4)[0]
        for mine, theirs in zip(got[2], params["rounded"]):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=2e-2)


def bf16_save_and_load(saved, steps):
    """ZeRO-2 in bf16: train `steps` of the batches (after loading `saved`: the rest); return the model's and
    the optimizer's state dicts (the masters inside the latter)."""
    model = mlp()
    optimizer = zero.ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-2,
                                      compute_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    batches = list(my_batches())[:6]
    if saved is not None:
        model.load_state_dict(saved[0])
        optimizer.load_state_dict(saved[1])
    for x, y in batches[:steps] if saved is None else batches[steps:]:
        optimizer.zero_grad()
        F.mse_loss(model(x.bfloat16()).float(), y).backward()
        optimizer.step()
    return model.state_dict(), optimizer.state_dict()


def test_a_bf16_checkpoint_keeps_the_fp32_masters_and_resumes_at_another_world_size():
    """Saved after 3 steps and resumed for 3 more on 4 ranks: the same bf16 parameters and fp32 masters, to the
    last bit, as 6 steps without a break (resuming from the bf16 parameters alone loses the masters' low bits:
    this fails then). Saved on 2 ranks and resumed on 4: every entry carries its fp32 master, and the result is
    within bf16 rounding of the unbroken run (the first 3 steps summed the rows over 2 ranks, in another order)."""
    whole = parakit.launch(bf16_save_and_load, None, 6, world_size=4)[0]
    saved = parakit.launch(bf16_save_and_load, None, 3, world_size=4)[0]
    resumed = parakit.launch(bf16_save_and_load, saved, 3, world_size=4)[0]
    torch.testing.assert_close(resumed[0], whole[0], rtol=0, atol=0)
    for i, entry in whole[1]["state"].items():
        torch.testing.assert_close(resumed[1]["state"][i]["master"], entry["master"], rtol=0, atol=0)
    on_two = parakit.launch(bf16_save_and_load, None, 3, world_size=2)[0]
    assert all(entry["master"].dtype == torch.float32 for entry in on_two[1]["state"].values())
    resumed = parakit.launch(bf16_save_and_load, on_two, 3, world_size=4)[0]
    torch.testing.assert_close(resumed[0], whole[0], rtol=0, atol=2e-2)


# ---------------------------------------------------------------- bytes: the ZeRO paper's mixed-precision row

LAYERS = [(64, 47), (47, 41), (41, 63), (63, 25)]
PARAMS = [s for i, o in LAYERS for s in (i * o, o)]
UNITS = [i * o + o for i, o in LAYERS]


def profile(stage):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(i, o) for i, o in LAYERS])
    batch = (torch.randn(8, LAYERS[0][0]), torch.randn(8, LAYERS[-1][1]))
    return zero.profile_stage(model, stage, batch, F.mse_loss, lr=1e-3, compute_dtype=torch.bfloat16)["rest"]


def test_bytes_at_rest_are_the_papers_mixed_precision_row():
    """(2 + 2 + K) Psi with K = 12 (fp32 master, momentum, variance), divided by N stage by stage;
    exact per rank, with the padding and AdamW's 4-byte `step` per tensor counted."""
    n, psi = 4, sum(PARAMS)
    owners = zero.partition_parameters([[torch.empty(s) for s in PARAMS]], n)
    mine = [[s for s, o in zip(PARAMS, owners) if o == r] for r in range(n)]
    chunk = max(sum(m) for m in mine)  # ShardedOptimizer's one bucket: each rank's segment padded to the largest
    for stage in range(4):
        got = parakit.launch(profile, stage, world_size=n)
        for rank, rest in enumerate(got):
            if stage == 0:
                expected = {"parameters": 2 * psi, "gradients": 2 * psi, "optimizer": 12 * psi + 4 * len(PARAMS)}
            elif stage < 3:
                expected = {"parameters": 2 * n * chunk, "gradients": 2 * (psi if stage == 1 else sum(mine[rank])),
                            "optimizer": sum(12 * s + 4 for s in mine[rank])}
            else:  # the fp32 shard is the master: 4 + 4 (fp32 gradient shard) + 8 = the row's 2 + 2 + 12
                chunks = [-(-u // n) for u in UNITS]
                expected = {"parameters": 4 * sum(chunks), "gradients": 4 * sum(chunks),
                            "optimizer": sum(8 * c + 4 for c in chunks)}
            assert rest == expected, (stage, rank)
        row = zero.zero_bytes(psi, n, stage, k=12, param_bytes=2, grad_bytes=2)
        steps = 4 * len(PARAMS if stage < 3 else UNITS)
        if stage in (1, 2):  # together the ranks hold the row's sharded parts exactly
            assert sum(r["optimizer"] for r in got) == n * row["optimizer"] + steps
        if stage == 2:
            assert sum(r["gradients"] for r in got) == n * row["gradients"]
        if stage == 3:
            padding = n * sum(chunks) - psi
            assert sum(sum(r.values()) for r in got) == n * sum(row.values()) + 16 * padding + n * steps  # each rank steps every unit


def test_autocast_casts_on_the_device_type_of_the_data():
    from torch._subclasses.fake_tensor import FakeTensorMode
    x = torch.randn(2, 4)
    with precision.autocast(torch.bfloat16, x):
        assert (x @ x.T).dtype == torch.bfloat16
    with FakeTensorMode():
        on_gpu = torch.randn(2, 4, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA here: torch disables the context, and says so
        assert precision.autocast(torch.bfloat16, on_gpu).device == "cuda"   # not "cpu"
    assert precision.autocast(torch.float16).device == parakit.device().type  # no data: this rank's device
    with pytest.raises(ValueError, match="the data lives on cpu and cuda: autocast casts the operators of one device"):
        precision.autocast(torch.bfloat16, x, on_gpu)


# ---------------------------------------------------------------- LossScaler against GradScaler, one process

def test_loss_scaler_follows_grad_scaler_step_for_step():
    """The same gradients (some with inf or NaN) through both: the same scale after every update,
    the same skipped steps, the same unscaled gradients."""
    torch.manual_seed(0)
    ours, theirs = nn.Linear(4, 3), nn.Linear(4, 3)
    theirs.load_state_dict(ours.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    scaler, reference = LossScaler(init_scale=8.0, growth_interval=2), torch.amp.GradScaler("cpu", init_scale=8.0,
                                                                                            growth_interval=2)
    bad = {2: float("inf"), 3: float("nan"), 7: float("inf")}
    skipped = 0
    for step in range(10):
        x = torch.randn(5, 4)
        for model, s, opt in ((ours, scaler, opts[0]), (theirs, reference, opts[1])):
            opt.zero_grad()
            s.scale(model(x).square().mean() * bad.get(step, 1.0)).backward()
            s.step(opt)
            s.update()
        skipped += step in bad
        assert scaler.get_scale() == reference.get_scale(), step
        torch.testing.assert_close(ours.weight, theirs.weight, rtol=0, atol=0)
    assert scaler.skipped == skipped == 3


def test_loss_scaler_refuses_fp16_gradients_and_a_second_unscale():
    model = nn.Linear(2, 2).half()
    model(torch.ones(1, 2, dtype=torch.float16)).sum().backward()
    with pytest.raises(TypeError, match="the optimizer's gradients are fp16: keep fp32 master weights"):
        LossScaler().unscale_(torch.optim.SGD(model.parameters(), lr=0.1))
    model = nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    scaler, opt = LossScaler(), torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_ was already called since the last update"):
        scaler.unscale_(opt)


# ---------------------------------------------------------------- bad input on the ranks

def fp16_without_a_scaler():
    model = mlp()
    optimizer = zero.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, compute_dtype=torch.float16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in list(my_batches())[:3]:
            optimizer.zero_grad()
            F.mse_loss(model(x.half()).float(), y).backward()
            optimizer.step()
    return [str(w.message) for w in caught]


def test_fp16_without_a_loss_scaler_warns_once_with_the_fix():
    for messages in parakit.launch(fp16_without_a_scaler, world_size=2):
        assert len(messages) == 1 and "step through parakit.precision.LossScaler" in messages[0]


def reduce_in(dtype):
    model = mlp()
    optimizer = zero.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, reduce_dtype=dtype)
    x, y = next(my_batches())
    try:
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    except TypeError as error:
        return str(error)


def test_a_dtype_the_backend_cannot_reduce_is_named_with_the_backend():
    for message in parakit.launch(reduce_in, torch.float8_e4m3fn, world_size=2):
        assert message.startswith("the gloo backend cannot reduce torch.float8_e4m3fn tensors")
        assert "choose reduce_dtype=torch.float32" in message
