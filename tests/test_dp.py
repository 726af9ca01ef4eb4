"""parakit.dp: DataParallel from scatter/replicate/parallel_apply/gather on logical CPU
devices against the module on one device, the seed's chunk-size rule, and the per-device
memory accounting (exact where it can be derived by hand, relations on a training step)."""
import random
import threading

import pytest
import torch
from torch import nn

from parakit import dp

B, T, D, H, V = 48, 16, 16, 128, 128  # the lesson's model and batch


def mlp(d_in=D, hidden=H, d_out=V, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                         nn.Linear(hidden, d_out))


def token_loss(logits, target):  # [batch, seq, V], [batch, seq]
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def outputs_and_grads(net, params, *inputs):
    out = net(*inputs)
    out.square().sum().backward()
    return out.detach(), [p.grad.clone() for p in params]


# ------------------------------------------------------------------------- chunk sizes

def test_balanced_chunk_sizes_reproduce_the_seeds_examples():
    assert dp.balanced_chunk_sizes(52, 16, 3) == [16, 18, 18]
    assert dp.balanced_chunk_sizes(53, 16, 3) == [16, 19, 18]      # the remainder goes to device 1 first
    assert dp.balanced_chunk_sizes(52, 8, 4) == [8, 15, 15, 14]      # two rows left over: devices 1 and 2
    assert dp.balanced_chunk_sizes(52, 0, 3) == [0, 26, 26]         # device 0 left out
    assert dp.balanced_chunk_sizes(52, 18, 3) == [18, 18, 16]       # not smaller than 17: the even split
    assert dp.balanced_chunk_sizes(7, 3, 1) == [7]


def test_even_chunk_sizes_are_torch_chunks_padded_with_idle_devices():
    for batch, n in [(6, 3), (7, 3), (5, 4), (2, 4), (1, 3), (13, 4)]:
        chunks = [len(c) for c in torch.arange(batch).chunk(n)]
        assert dp.even_chunk_sizes(batch, n) == chunks + [0] * (n - len(chunks))


def test_chunk_sizes_sum_to_the_batch_and_give_device0_gpu0_bsz_when_smaller():
    rng = random.Random(0)
    for _ in range(500):
        n, batch = rng.randint(1, 8), rng.randint(1, 200)
        gpu0 = rng.randint(0, batch)
        sizes = dp.balanced_chunk_sizes(batch, gpu0, n)
        assert len(sizes) == n and sum(sizes) == batch and min(sizes) >= 0
        if n > 1 and gpu0 < (batch - gpu0) // (n - 1):
            assert sizes[0] == gpu0 and max(sizes[1:]) - min(sizes[1:]) <= 1
        else:
            assert sizes == dp.even_chunk_sizes(batch, n)


# ------------------------------------------------------------------------- correctness

@pytest.mark.parametrize("num_devices", [1, 2, 3, 4])
def test_data_parallel_equals_one_device_on_random_batches(num_devices):
    seed = random.randrange(2**20)
    rng = random.Random(seed)
    # always: one row, fewer rows than devices, one row each, n + 1 rows (ceil gives 2 each: the last device of
    # 3 or 4 gets none), two rows each; then four random sizes
    fixed = [1, num_devices - 1, num_devices, num_devices + 1, 2 * num_devices]
    batches = sorted({b for b in fixed if b > 0}) + [rng.randint(1, 9) for _ in range(4)]
    for trial, batch in enumerate(batches):
        reference, model = mlp(8, 16, 5, seed=trial), mlp(8, 16, 5, seed=trial)
        x = torch.randn(batch, 3, 8, generator=torch.Generator().manual_seed(seed + trial))
        expected = outputs_and_grads(reference, list(reference.parameters()), x)
        got = outputs_and_grads(dp.DataParallel(model, list(range(num_devices))), list(model.parameters()), x)
        torch.testing.assert_close(got, expected, msg=lambda m: f"batch {batch} on {num_devices} devices "
                                                                f"(seed {seed}): {m}")
    if num_devices >= 3:
        assert dp.even_chunk_sizes(num_devices + 1, num_devices)[-1] == 0  # the idle-device case is among them


def test_balanced_data_parallel_and_dim1_equal_one_device():
    for trial in range(4):
        batch, gpu0 = random.randint(2, 12), random.randint(0, 2)
        reference, model = mlp(8, 16, 5, seed=trial), mlp(8, 16, 5, seed=trial)
        x = torch.randn(batch, 4, 8)
        expected = outputs_and_grads(reference, list(reference.parameters()), x)
        net = dp.BalancedDataParallel(gpu0, model, [0, 1, 2])
        torch.testing.assert_close(outputs_and_grads(net, list(model.parameters()), x), expected)
    model, reference = mlp(8, 16, 5), mlp(8, 16, 5)
    x = torch.randn(3, 7, 8)
    torch.testing.assert_close(outputs_and_grads(dp.DataParallel(model, [0, 1], dim=1), list(model.parameters()), x),
                               outputs_and_grads(reference, list(reference.parameters()), x))


def test_dim1_splits_the_rows_of_dim1_even_when_dim0_is_empty():
    model, reference = mlp(8, 16, 5), mlp(8, 16, 5)
    x = torch.randn(0, 5, 8)  # no rows along dim 0, five along dim 1
    out = dp.DataParallel(model, [0, 1], dim=1)(x)
    torch.testing.assert_close(out, reference(x))
    assert out.shape == (0, 5, 5)


def test_frozen_parameters_and_buffers_are_copied_without_gradients():
    reference, model = mlp(8, 16, 5), mlp(8, 16, 5)
    for m in (reference, model):
        m[0].requires_grad_(False)
        m.insert(1, nn.BatchNorm1d(16, affine=False).eval())
    x = torch.randn(5, 8)
    expected = outputs_and_grads(reference, list(reference.parameters())[2:], x)
    got = outputs_and_grads(dp.DataParallel(model, [0, 1, 2]), list(model.parameters())[2:], x)
    torch.testing.assert_close(got, expected)
    assert model[0].weight.grad is None and model[0].bias.grad is None


def test_loss_in_forward_gives_the_batch_mean_loss_and_its_gradients():
    for trial in range(3):
        batch, gpu0 = random.randint(3, 11), random.randint(0, 2)
        reference, model = mlp(8, 16, 5, seed=trial), mlp(8, 16, 5, seed=trial)
        x, y = torch.randn(batch, 3, 8), torch.randint(0, 5, (batch, 3))
        expected = token_loss(reference(x), y)
        expected.backward()
        net = dp.BalancedDataParallel(gpu0, dp.LossInForward(model, token_loss), [0, 1, 2])
        per_replica = net(x, y)
        assert per_replica.shape == (sum(s > 0 for s in dp.balanced_chunk_sizes(batch, gpu0, 3)),)
        loss = per_replica.sum() / batch
        loss.backward()
        torch.testing.assert_close(loss, expected)
        torch.testing.assert_close([p.grad for p in model.parameters()], [p.grad for p in reference.parameters()])


def test_replicas_run_at_the_same_time_each_in_its_own_thread():
    seen, together = [], threading.Barrier(3)

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(threading.current_thread())
            together.wait(timeout=10)  # breaks unless all three replicas are running at once
            return x * 2

    out = dp.DataParallel(Probe(), [0, 1, 2])(torch.ones(6, 1))
    assert out.tolist() == [[2.0]] * 6 and len(set(seen)) == 3 and threading.current_thread() not in seen


# ------------------------------------------------------------------------- memory

def test_meter_counts_a_storage_once_for_its_views_and_frees_it_when_it_dies():
    with dp.MemoryMeter([0, 1]) as meter:
        x = torch.zeros(1000)
        views = [x.view(10, 100), x[::2], x.t()]
        assert meter.live == {0: 4000, 1: 0}
        del x, views
        assert meter.live == {0: 0, 1: 0}
        y = torch.ones(10)
        z = y + 1
        assert meter.live == {0: 80, 1: 0}
    assert meter.peaks() == [4000, 0]
    del y, z


@pytest.mark.parametrize("gpu0_bsz", [8, 0])
def test_forward_memory_per_device_is_exact(gpu0_bsz):
    """One bias-free linear layer, forward only, bytes counted by hand: device 0 holds the
    weight, the input (its chunk is a view), its chunk's output and the gathered output;
    device i a copy of the weight, a copy of its input chunk and its output chunk. With
    gpu0_bsz=0, device 0 runs no replica."""
    layer, x = nn.Linear(D, V, bias=False), torch.randn(B, D)
    sizes = dp.balanced_chunk_sizes(B, gpu0_bsz, 3)                  # [8, 20, 20] or [0, 24, 24]
    with dp.MemoryMeter([0, 1, 2]) as meter:
        meter.place([layer.weight, x], 0)
        out = dp.BalancedDataParallel(gpu0_bsz, layer, [0, 1, 2])(x)
    weight, row_in, row_out = 4 * D * V, 4 * D, 4 * V
    assert meter.peaks() == [weight + B * row_in + sizes[0] * row_out + B * row_out,
                             weight + sizes[1] * (row_in + row_out), weight + sizes[2] * (row_in + row_out)]
    assert out.shape == (B, V)


def test_device0_peak_is_highest_and_balanced_split_and_loss_in_forward_lower_it():
    model, x, y = mlp(), torch.randn(B, T, D), torch.randint(0, V, (B, T))
    default = dp.step_peaks(model, x, y, token_loss, [0, 1, 2])
    balanced = dp.step_peaks(model, x, y, token_loss, [0, 1, 2], gpu0_bsz=4)
    in_forward = dp.step_peaks(model, x, y, token_loss, [0, 1, 2], loss_in_forward=True)
    assert default[0] > max(default[1:]) and default[1] == default[2]
    assert balanced[0] < default[0] and balanced[1] > default[1]
    assert in_forward[0] < balanced[0]
    # the gathered logits and their loss leave device 0: at least three [batch, seq, V] float tensors fewer
    assert default[0] - in_forward[0] >= 3 * 4 * B * T * V * 2 // 3
    assert dp.step_peaks(model, x, y, token_loss, [0, 1, 2], gpu0_bsz=4) == balanced  # reproducible to the byte


# ------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("call, error, text", [
    (lambda: dp.balanced_chunk_sizes(10, -1, 2), ValueError, "gpu0_bsz=-1 must be an int between 0 and the batch size 10"),
    (lambda: dp.balanced_chunk_sizes(10, 11, 2), ValueError, "gpu0_bsz=11 must be an int between 0"),
    (lambda: dp.balanced_chunk_sizes(0, 0, 2), ValueError, "a batch of 0 rows cannot be split: pass at least one row"),
    (lambda: dp.balanced_chunk_sizes(4, 1, 0), ValueError, "no devices: pass at least one device id"),
    (lambda: dp.DataParallel(nn.Linear(2, 2), []), ValueError, "device_ids is empty: pass at least one device id"),
    (lambda: dp.BalancedDataParallel(-2, nn.Linear(2, 2), [0, 1]), ValueError, "gpu0_bsz=-2 must be an int >= 0"),
    (lambda: dp.BalancedDataParallel(5, nn.Linear(2, 2), [0, 1])(torch.ones(3, 2)), ValueError,
     "gpu0_bsz=5 must be an int between 0 and the batch size 3"),
    (lambda: dp.DataParallel(nn.Linear(2, 2), [0, 1])(torch.ones(0, 2)), ValueError,
     "a batch of shape (0, 2) cannot be split along dim 0: pass at least one row"),
    (lambda: dp.DataParallel(nn.Linear(2, 2), [0, 1], dim=1)(torch.ones(3, 0, 2)), ValueError,
     "a batch of shape (3, 0, 2) cannot be split along dim 1: pass at least one row"),
    (lambda: dp.DataParallel(nn.Linear(2, 2), [0, 1], dim=2)(torch.ones(3, 2)), ValueError,
     "dim=2 is not a dimension of the batch of shape (3, 2): pass dim between -2 and 1"),
    (lambda: dp.DataParallel(nn.Linear(2, 2), [0, 1])(torch.tensor(1.0)), ValueError,
     "a 0-dim tensor cannot be split: pass a batch with a dimension of rows"),
    (lambda: dp.DataParallel(nn.Linear(2, 2), [0, 1])([[1.0, 2.0]]), TypeError,
     "DataParallel scatters tensors; got a list: pass tensors"),
    (lambda: dp.DataParallel(nn.Linear(2, 2), [0, 1], output_device=3)(torch.ones(2, 2)), ValueError,
     "output_device=3 is not one of the devices [0, 1]"),
])
def test_bad_input_says_what_to_change(call, error, text):
    with pytest.raises(error) as raised:
        call()
    assert text in str(raised.value)


def test_a_failing_replica_is_raised_in_the_caller_naming_its_device():
    class FailsOnShortChunks(nn.Module):
        def forward(self, x):
            if len(x) < 3:
                raise ValueError("chunk too short")
            return x

    with pytest.raises(RuntimeError, match=r"replica 1 on device cpu:1 failed: ValueError\('chunk too short'\)"):
        dp.BalancedDataParallel(3, FailsOnShortChunks(), [0, 1])(torch.ones(5, 1))
    assert dp.DataParallel(nn.Identity(), [0, 1])(torch.ones(4, 1)).shape == (4, 1)  # and it still works


# ------------------------------------------------------------------------- GPUs

@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two or more CUDA GPUs")
def test_on_gpus_equals_torch_data_parallel_and_cpu_accounting_tracks_cuda_peaks():
    n = min(torch.cuda.device_count(), 3)
    ids, logical = list(range(n)), [torch.device("cpu", i) for i in range(n)]
    model, x = mlp(64, 1024, 1024).cuda(), torch.randn(12 * n, 64, 64, device="cuda")
    ours = outputs_and_grads(dp.DataParallel(model, ids), list(model.parameters()), x)
    model.zero_grad()
    theirs = outputs_and_grads(nn.DataParallel(model, ids), list(model.parameters()), x)
    torch.testing.assert_close(ours, theirs)
    y = torch.randint(0, 1024, (12 * n, 64), device="cuda")
    variants = ({}, {"gpu0_bsz": 4}, {"loss_in_forward": True})
    dp.step_peaks(model, x, y, token_loss, ids)  # warm up: cuBLAS workspaces exist before measuring
    cuda = [dp.step_peaks(model, x, y, token_loss, ids, **kw) for kw in variants]
    cpu = [dp.step_peaks(model.cpu(), x.cpu(), y.cpu(), token_loss, logical, **kw) for kw in variants]
    for peaks in (cuda[0], cpu[0]):
        assert max(range(n), key=peaks.__getitem__) == 0, (cuda, cpu)
    # what balancing and the loss in forward save on device 0: tens of MB of activations, where the
    # caching allocator's 512-byte rounding and its persistent workspaces cancel out
    for k in (1, 2):
        saved_cuda, saved_cpu = cuda[0][0] - cuda[k][0], cpu[0][0] - cpu[k][0]
        assert saved_cpu > 0 and abs(saved_cuda - saved_cpu) <= 0.1 * saved_cpu, (variants[k], cuda, cpu)
