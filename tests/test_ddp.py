"""parakit.ddp on real ranks (gloo on CPU): the four wrappers train exactly like one process
on the whole batch and like torch's DistributedDataParallel, with the collectives counted
exactly, and fail clearly on bad input."""
from __future__ import annotations

import copy
import gc
import random
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

import parakit
from parakit import CommLog, ddp
from parakit.ddp import BucketedDDP, FlatDDP, NaiveDDP, OverlapDDP

WRAPPERS = ["NaiveDDP", "FlatDDP", "OverlapDDP", "BucketedDDP"]


def mlp(seed: int, sizes=(6, 16, 16, 3)) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


class Tied(nn.Module):
    """An embedding whose weight is also the output layer's (tied weights)."""

    def __init__(self, vocab=3, dim=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x):  # x: [batch, 6]; its first column turned into token ids
        ids = (x[:, 0].abs() * 3).long().clamp(0, 2)  # [batch]
        return self.out(torch.tanh(self.hidden(self.embed(ids)))) + x[:, :3]  # [batch, vocab=3]


class FrozenNorm(nn.Module):
    """A frozen first layer, a BatchNorm (running stats are buffers), and a branch that is
    used only when `use_branch` says so."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(6, 12, bias=False)  # a bias before BatchNorm would get a zero gradient
        self.frozen.weight.requires_grad_(False)
        self.norm = nn.BatchNorm1d(12)
        self.head = nn.Linear(12, 3)
        self.branch = nn.Linear(12, 3)
        self.use_branch = True

    def forward(self, x):
        h = self.norm(self.frozen(x))
        return self.head(h) + (self.branch(h) if self.use_branch else 0)


def seeded(cls):
    """cls() built after torch.manual_seed(seed)."""
    return lambda seed: (torch.manual_seed(seed), cls())[1]


def train(model, params, x, y, steps, opt_name, finish=lambda: None, pieces=1):
    """`steps` steps of full-batch MSE training; `x`, `y` are this process's rows, fed in
    `pieces` equal slices of one forward each (the mean of their losses is the batch's loss;
    a BatchNorm normalises each slice on its own, as it does each rank's rows under DDP)."""
    opt = {"sgd": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9),
           "adamw": lambda: torch.optim.AdamW(params, lr=0.05)}[opt_name]()
    for step in range(steps):
        slices = zip(x[step].chunk(pieces), y[step].chunk(pieces))
        (sum(nn.functional.mse_loss(model(a), b) for a, b in slices) / pieces).backward()
        finish()
        opt.step()
        opt.zero_grad()  # set_to_none=True: every gradient is None at the next step


def shards(seed, n, steps=3, rows=4, features=6, outputs=3):
    """The whole batch for each step, and this rank's rows of it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, rows * n, features, generator=g)  # [steps, global batch, features]
    y = torch.randn(steps, rows * n, outputs, generator=g)
    r = dist.get_rank()
    return x, y, x[:, r * rows:(r + 1) * rows], y[:, r * rows:(r + 1) * rows]  # [steps, rows, ...]


def against_one_process(seed, make, opt_name):
    """Each wrapper trains 3 steps on this rank's rows; one process trains on all rows (in
    the ranks' slices)."""
    n = dist.get_world_size()
    x, y, my_x, my_y = shards(seed, n)
    reference = make(seed)
    train(reference, reference.parameters(), x, y, 3, opt_name, pieces=n)
    out = {}
    for kind in WRAPPERS:
        net = make(seed + dist.get_rank())  # different on each rank: the wrap broadcasts rank 0's
        model = getattr(ddp, kind)(net)
        train(model, model.parameters(), my_x, my_y, 3, opt_name, model.finish_gradient_synchronization)
        out[kind] = [(a - b).abs().max().item() for a, b in zip(net.parameters(), reference.parameters())]
    return out, [p.detach() for p in reference.parameters()]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_every_wrapper_trains_like_one_process_on_the_whole_batch(world_size, opt_name):
    seed = random.randrange(2**20)
    for make in (mlp, seeded(Tied), seeded(FrozenNorm)):
        results = parakit.launch(against_one_process, seed, make, opt_name, world_size=world_size)
        for rank, (errors, reference) in enumerate(results):
            for kind, per_param in errors.items():
                scale = max(p.abs().max().item() for p in reference)
                assert max(per_param) <= 1e-5 * scale + 1e-6, (kind, rank, per_param)


def against_torch(seed, make):
    """Gradients and parameters after 3 AdamW steps: each wrapper vs torch's DDP."""
    from torch.nn.parallel import DistributedDataParallel

    n = dist.get_world_size()
    _, _, my_x, my_y = shards(seed, n)
    net = make(seed + dist.get_rank())
    theirs = DistributedDataParallel(copy.deepcopy(net))
    train(theirs, theirs.parameters(), my_x, my_y, 3, "adamw")
    out = {}
    for kind in WRAPPERS:
        model = getattr(ddp, kind)(copy.deepcopy(net))
        train(model, model.parameters(), my_x, my_y, 3, "adamw", model.finish_gradient_synchronization)
        mine = list(model.module.parameters()) + list(model.module.buffers())
        ref = list(theirs.module.parameters()) + list(theirs.module.buffers())
        for a, b in zip(mine, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{kind}: {m}")
        out[kind] = [p.detach().clone() for p in model.module.parameters()]  # buffers: each rank's last forward
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_wrapper_matches_torch_ddp_on_mlp_tied_and_frozen_batchnorm_models(world_size):
    seed = random.randrange(2**20)
    for make in (mlp, seeded(Tied), seeded(FrozenNorm)):
        results = parakit.launch(against_torch, seed, make, world_size=world_size)
        for kind in WRAPPERS:  # and the replicas' parameters are equal
            for rank in range(1, world_size):
                torch.testing.assert_close(results[rank][kind], results[0][kind], rtol=0, atol=0)


def wide_mlp() -> nn.Sequential:
    """Four layers; weights 64 KiB, 256 KiB, 256 KiB, 10 KiB."""
    return mlp(0, sizes=(64, 256, 256, 256, 10))


def counts(kind, make, kwargs=None):
    """The all-reduces of one synchronised step (count, bytes each) and the number of parameters."""
    net = make()
    model = getattr(ddp, kind)(net, **(kwargs or {}))
    x = torch.randn(4, 64) if isinstance(net, nn.Sequential) else torch.randn(4, 6)
    with CommLog() as log:
        model(x).square().mean().backward()
        model.finish_gradient_synchronization()
    sizes = [r.nbytes for r in log.records if r.op == "all_reduce"]
    return log.count(), sizes, len(list(net.parameters()))


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_per_step_are_one_per_parameter_one_or_one_per_bucket(world_size):
    grad_bytes = 4 * sum(p.numel() for p in wide_mlp().parameters())
    for kind in ("NaiveDDP", "OverlapDDP"):
        for total, sizes, n_params in parakit.launch(counts, kind, wide_mlp, world_size=world_size):
            assert total == len(sizes) == n_params == 8 and sum(sizes) == grad_bytes
    for total, sizes, _ in parakit.launch(counts, "FlatDDP", wide_mlp, world_size=world_size):
        assert (total, sizes) == (1, [grad_bytes])
    # 0.3 MiB = 314572 B, in reverse order: [b4, w4, b3, w3 (256 KiB), b2] = 267.0 KiB, then w2 (256 KiB)
    # would not fit: [w2, b1] = 257 KiB, then w1 (64 KiB) would not fit: [w1]
    nbytes = lambda *numels: 4 * sum(numels)
    expected = [nbytes(10, 2560, 256, 65536, 256), nbytes(65536, 256), nbytes(16384)]
    for total, sizes, _ in parakit.launch(counts, "BucketedDDP", wide_mlp, {"bucket_size_mb": 0.3}, world_size=world_size):
        assert (total, sizes) == (3, expected)
    for total, sizes, _ in parakit.launch(counts, "BucketedDDP", wide_mlp, {"bucket_size_mb": None}, world_size=world_size):
        assert (total, sizes) == (1, [grad_bytes])
    buckets = ddp.assign_buckets(list(wide_mlp().parameters()), 0.3)
    assert [len(b) for b in buckets] == [5, 2, 1]


def during_backward(kind, kwargs):
    """The all-reduces issued inside loss.backward() of one step, and how many of them had
    been issued when the backward of layer 0 (the last to run) started."""
    net = wide_mlp()
    model = getattr(ddp, kind)(net, **kwargs)
    log, before_layer_0 = CommLog(), []
    net[0].register_full_backward_pre_hook(lambda *_: before_layer_0.append(log.count("all_reduce")))
    loss = model(torch.randn(4, 64)).square().mean()
    with log:
        loss.backward()
    model.finish_gradient_synchronization()
    return log.count("all_reduce"), before_layer_0


@pytest.mark.parametrize("kind, kwargs, during, before_layer_0", [
    ("NaiveDDP", {}, 8, 6), ("OverlapDDP", {}, 8, 6), ("FlatDDP", {}, 0, 0),
    ("BucketedDDP", {"bucket_size_mb": 0.3}, 3, 1),  # buckets [b4 w4 b3 w3 b2] [w2 b1] [w1]: the first only
    ("BucketedDDP", {"bucket_size_mb": None}, 1, 0)])
def test_all_reduces_start_during_backward_before_the_first_layer_s_backward(kind, kwargs, during, before_layer_0):
    for issued, before in parakit.launch(during_backward, kind, kwargs, world_size=2):
        assert (issued, before) == (during, [before_layer_0]), kind


def test_tied_weight_is_reduced_once():
    for kind in WRAPPERS:
        for total, sizes, n_params in parakit.launch(counts, kind, Tied, world_size=2):
            assert n_params == 3  # embed.weight (= out.weight), hidden.weight, hidden.bias
            assert sum(sizes) == 4 * sum(p.numel() for p in Tied().parameters())
            assert total == (n_params if kind in ("NaiveDDP", "OverlapDDP") else 1)


def unused_branch(seed, kind, used_on):
    """FrozenNorm with its branch used only on ranks in `used_on`; gradients after one step
    and the number of all-reduces (in backward, in all), with the reference: the average of
    every rank's gradient. With 1e-4 MiB buckets BucketedDDP has 5: [branch.bias]
    [branch.weight] [head.bias] [head.weight] [norm.bias norm.weight]."""
    torch.manual_seed(seed)
    net = FrozenNorm().eval()  # eval: batch statistics would make ranks' gradients differ from one process
    reference = copy.deepcopy(net)
    model = getattr(ddp, kind)(net, bucket_size_mb=1e-4) if kind == "BucketedDDP" else getattr(ddp, kind)(net)
    n, r = dist.get_world_size(), dist.get_rank()
    x, y, my_x, my_y = shards(seed, n, steps=1)
    net.use_branch = r in used_on
    loss = nn.functional.mse_loss(model(my_x[0]), my_y[0])
    with CommLog() as log:
        with CommLog() as in_backward:
            loss.backward()
        model.finish_gradient_synchronization()
    for rank in range(n):  # the reference: each rank's loss on its rows, averaged
        reference.use_branch = rank in used_on
        rows = slice(rank * 4, (rank + 1) * 4)
        (nn.functional.mse_loss(reference(x[0, rows]), y[0, rows]) / n).backward()
    grads = {name: p.grad for name, p in net.named_parameters()}
    expected = {name: p.grad for name, p in reference.named_parameters()}
    return grads, expected, (in_backward.count("all_reduce"), log.count("all_reduce"))


@pytest.mark.parametrize("kind", WRAPPERS)
def test_branch_unused_on_every_rank_does_not_stall_and_keeps_grad_none(kind):
    for grads, expected, all_reduces in parakit.launch(unused_branch, 3, kind, (), world_size=2):
        assert grads["branch.weight"] is None and grads["branch.bias"] is None
        assert grads["frozen.weight"] is None
        torch.testing.assert_close(grads, expected, rtol=1e-5, atol=1e-7)
        # BucketedDDP: the unused branch fills the first two buckets in forward, so all 5 go out in backward
        assert all_reduces == {"NaiveDDP": (4, 4), "OverlapDDP": (4, 4), "FlatDDP": (0, 1), "BucketedDDP": (5, 5)}[kind]


@pytest.mark.parametrize("kind", ["FlatDDP", "BucketedDDP"])
def test_branch_used_on_one_rank_only_gives_every_rank_the_average(kind):
    results = parakit.launch(unused_branch, 4, kind, (0,), world_size=2)
    for grads, expected, all_reduces in results:
        assert grads["branch.weight"] is not None
        torch.testing.assert_close(grads, expected, rtol=1e-5, atol=1e-7)
        assert all_reduces == {"FlatDDP": (0, 1), "BucketedDDP": (5, 5)}[kind]  # the same on both ranks


def loss_outside_forward():
    """BucketedDDP of FrozenNorm without its branch, and a loss that uses branch.weight
    outside forward: the error backward raises."""
    torch.manual_seed(0)
    net = FrozenNorm()
    net.use_branch = False
    model = BucketedDDP(net, bucket_size_mb=1e-4)
    loss = model(torch.randn(4, 6)).square().mean() + net.branch.weight.square().sum()
    try:
        loss.backward()
    except RuntimeError as error:
        return str(error)


def test_a_parameter_unused_by_forward_that_gets_a_gradient_anyway_raises():
    for message in parakit.launch(loss_outside_forward, world_size=2):
        assert message == ("parameter 'branch.weight' got a gradient, but the output of forward does not depend on "
                           "it, so BucketedDDP counted it as unused and reduces its bucket without that gradient: "
                           "use it inside the module's forward (a loss term on it too), not outside the model")
    assert parakit.launch(lambda: BucketedDDP(mlp(0)) is not None, world_size=2) == [True, True]  # the pool works


def accumulate(seed, kind, micro):
    """`micro` micro-batches: all but the last inside no_sync; the all-reduces inside and
    the gradients after, with one process's gradients on the whole batch."""
    n = dist.get_world_size()
    net = mlp(seed)
    reference = copy.deepcopy(net)
    model = getattr(ddp, kind)(net)
    x, y, my_x, my_y = shards(seed, n, steps=micro)
    with CommLog() as inside:
        with model.no_sync():
            for m in range(micro - 1):
                (nn.functional.mse_loss(model(my_x[m]), my_y[m]) / micro).backward()
    with CommLog() as last:
        (nn.functional.mse_loss(model(my_x[-1]), my_y[-1]) / micro).backward()
        model.finish_gradient_synchronization()
    (nn.functional.mse_loss(reference(x.flatten(0, 1)), y.flatten(0, 1))).backward()
    return [p.grad for p in net.parameters()], [p.grad for p in reference.parameters()], \
        inside.count(), last.count("all_reduce")


@pytest.mark.parametrize("world_size", [2, 4])
def test_no_sync_accumulates_locally_and_the_next_backward_equals_one_big_batch(world_size):
    seed = random.randrange(2**20)
    for kind in WRAPPERS:
        for grads, expected, inside, last in parakit.launch(accumulate, seed, kind, 3, world_size=world_size):
            torch.testing.assert_close(grads, expected, rtol=1e-5, atol=1e-6)
            assert inside == 0
            assert last == {"NaiveDDP": 6, "OverlapDDP": 6, "FlatDDP": 1, "BucketedDDP": 1}[kind]


def same_parameters(make):
    """For each wrapper: its parameters() are the wrapped module's, the same objects in order."""
    out = {}
    for kind in WRAPPERS:
        net = make(0)
        model = getattr(ddp, kind)(net)
        mine, theirs = list(model.parameters()), list(net.parameters())
        out[kind] = (len(mine), len(theirs), all(a is b for a, b in zip(mine, theirs)))
    return out


def test_every_wrapper_s_parameters_are_the_module_s_same_objects_in_the_same_order():
    for make, n_params in ((mlp, 6), (seeded(Tied), 3), (seeded(FrozenNorm), 7)):
        for per_kind in parakit.launch(same_parameters, make, world_size=2):
            assert per_kind == dict.fromkeys(WRAPPERS, (n_params, n_params, True))


def forget_finish(kind):
    model = getattr(ddp, kind)(mlp(0))
    x = torch.randn(4, 6)
    errors = []
    model(x).sum().backward()
    try:
        model(x)  # finish_gradient_synchronization() forgotten
    except RuntimeError as error:
        errors.append(str(error))
    out = model.module(x).sum()  # forward around the wrapper: the second backward is caught
    try:
        out.backward()
    except RuntimeError as error:
        errors.append(str(error))
    model.finish_gradient_synchronization()
    model(x).sum().backward()  # usable again once finished
    model.finish_gradient_synchronization()
    return errors


def test_forgetting_finish_gradient_synchronization_raises_at_the_next_forward_or_backward():
    for kind in WRAPPERS:
        for errors in parakit.launch(forget_finish, kind, world_size=2):
            assert len(errors) == 2, (kind, errors)
            assert all("call model.finish_gradient_synchronization() after loss.backward()" in e for e in errors)


def wrap_time_state(seed):
    """Different parameters, frozen weight and buffers on each rank before the wrap."""
    torch.manual_seed(seed + dist.get_rank())
    net = FrozenNorm()
    net.norm.running_mean.normal_()
    BucketedDDP(net)
    return list(net.parameters()) + list(net.buffers())


def test_wrap_broadcasts_parameters_frozen_ones_and_buffers_from_rank_0():
    first, *others = parakit.launch(wrap_time_state, random.randrange(2**20), world_size=4)
    for other in others:
        torch.testing.assert_close(other, first, rtol=0, atol=0)


def in_pairs(seed):
    """World of 4 as two data-parallel groups {0, 1} and {2, 3}: gradients averaged per pair."""
    r = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    net = mlp(seed + r // 2)  # each pair wraps its own model
    model = BucketedDDP(net, bucket_size_mb=0.001, process_group=groups[r // 2])
    x = torch.full((2, 6), float(r))
    with CommLog() as log:
        model(x).sum().backward()
        model.finish_gradient_synchronization()
    reference = mlp(seed + r // 2)
    reference(torch.cat([torch.full((2, 6), float(r // 2 * 2)), torch.full((2, 6), float(r // 2 * 2 + 1))])
              ).sum().div(2).backward()
    return [p.grad for p in net.parameters()], [p.grad for p in reference.parameters()], \
        {rec.group_size for rec in log.records}


def test_bucketed_ddp_averages_within_an_explicit_process_group():
    for grads, expected, group_sizes in parakit.launch(in_pairs, random.randrange(2**20), world_size=4):
        torch.testing.assert_close(grads, expected, rtol=1e-5, atol=1e-6)
        assert group_sizes == {2}


def compressed(seed, dtype):
    """Gradients with the bucket all-reduced in `dtype`, in float32, and the bytes sent."""
    net = mlp(seed, sizes=(6, 64, 3))
    exact = BucketedDDP(copy.deepcopy(net))
    low = BucketedDDP(net)
    low.register_comm_hook(ddp.compress_hook(dtype))
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(seed + dist.get_rank()))
    out = []
    for model in (exact, low):
        with CommLog() as log:
            model(x).square().sum().backward()
            model.finish_gradient_synchronization()
        out.append(([p.grad for p in model.parameters()], log.nbytes("all_reduce")))
    return out


@pytest.mark.parametrize("dtype, rtol", [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
def test_compress_hook_halves_the_bytes_within_the_low_dtype_rounding(dtype, rtol):
    for (exact, exact_bytes), (low, low_bytes) in parakit.launch(compressed, 5, dtype, world_size=2):
        assert low_bytes * 2 == exact_bytes == 4 * sum(g.numel() for g in exact)
        for e, l in zip(exact, low):
            torch.testing.assert_close(l, e, rtol=rtol, atol=rtol * e.abs().max().item())
            assert not torch.equal(l, e) or e.abs().max() == 0  # rounded: the hook did run


# ---------------------------------------------------------------- bad input


def wrap_raises(build):
    try:
        build()
    except (ValueError, RuntimeError) as error:
        return str(error)
    return None


def timed_buckets():
    """BucketedDDP with 3 buckets, each all-reduce timed: the spans and the gradients."""
    model = BucketedDDP(mlp(0, sizes=(6, 64, 64, 3)), bucket_size_mb=16 * 64 * 4 / 2**20)
    events = []
    model.register_comm_hook(ddp.timed_hook(ddp.allreduce_hook, events))
    model(torch.randn(4, 6)).sum().backward()
    model.finish_gradient_synchronization()
    return list(events), len(model.buckets)


def test_timed_hook_on_the_cpu_gives_one_span_per_bucket_each_ending_after_it_starts():
    for spans, buckets in parakit.launch(timed_buckets, world_size=2):
        assert len(spans) == buckets == 3
        assert all(isinstance(a, float) and a <= b for a, b in spans)


class FakeGpu:
    """A GPU stream as CUDA events see it: an event's time is when the stream gets to it, after
    the work queued before it (`busy`, seconds)."""

    def __init__(self):
        self.busy = 0.0
        gpu = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self, stream=None):
                self.at = gpu.busy

            def synchronize(self):
                pass

            def elapsed_time(self, end):  # ms, as torch.cuda.Event's
                return 1e3 * (end.at - self.at)

        self.Event = Event


def test_timed_hook_on_a_gpu_ends_when_the_stream_has_run_the_all_reduce_not_when_nccl_queued_it(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode
    gpu = FakeGpu()
    monkeypatch.setattr(torch.cuda, "Event", gpu.Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(parakit.devices, "device", lambda: torch.device("cuda", 0))  # this rank's GPU

    def queued(flat, group):  # NCCL's way: 5 ms of all-reduce queued on the GPU, the future complete at once
        gpu.busy += 0.005
        future = torch.futures.Future()
        future.set_result(flat)
        return future

    with FakeTensorMode():
        flat = torch.zeros(4, device="cuda")
    events = []
    ddp.timed_hook(queued, events)(flat, None).wait()
    [(start, end)] = events
    assert end - start == pytest.approx(0.005)  # the GPU's time of the all-reduce, not the microseconds to queue it


@pytest.mark.parametrize("size", [0, -1.0])
def test_bucket_size_must_be_positive(size):
    for message in parakit.launch(wrap_raises, lambda: BucketedDDP(mlp(0), bucket_size_mb=size), world_size=2):
        assert message == f"bucket_size_mb must be > 0 (or None for one bucket), got {size}"


def test_module_without_parameters_is_refused():
    for message in parakit.launch(wrap_raises, lambda: FlatDDP(nn.ReLU()), world_size=2):
        assert message == "ReLU has no parameters: there are no gradients to synchronise"


def test_parameters_of_different_shape_on_some_rank_are_named():
    build = lambda: OverlapDDP(mlp(0, sizes=(6, 16 + (dist.get_rank() == 1), 3)))
    for message in parakit.launch(wrap_raises, build, world_size=2):
        assert message == ("parameter '0.weight' is (16, 6) torch.float32 on rank 0 but '0.weight' is (17, 6) "
                           "torch.float32 on rank 1: every rank must wrap the same model")
    assert parakit.launch(lambda: NaiveDDP(mlp(0)) is not None, world_size=2) == [True, True]  # the pool still works


def test_wrapping_before_a_process_group_exists_says_what_to_do():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"NaiveDDP needs a process group: call dist.init_process_group\(\) first"):
        NaiveDDP(mlp(0))


def dropped_wrappers_are_freed() -> dict[str, bool]:
    """Each wrapper on a group of its own, after a synchronised step, dropped: freed (with its group)?"""
    freed = {}
    for kind in WRAPPERS:
        wrapper = getattr(ddp, kind)(mlp(0), process_group=dist.new_group([0, 1]))
        wrapper(torch.randn(4, 6)).sum().backward()
        wrapper.finish_gradient_synchronization()
        ref = weakref.ref(wrapper)
        del wrapper
        gc.collect()
        freed[kind] = ref() is None
    return freed


def test_a_dropped_wrapper_is_freed_with_its_process_group():
    """Its gradient hooks hold it weakly: a parameter keeps them where the garbage collector does not
    look, so a hook holding the wrapper would keep it, and its group's communicator, for good."""
    assert parakit.launch(dropped_wrappers_are_freed, world_size=2) == [dict.fromkeys(WRAPPERS, True)] * 2
