"""parakit.launch on real worker processes (gloo on CPU): results, the warm pool, each
rank's output, failures (exceptions, deaths, hangs, timeouts), bad input, interrupts and
orphans. After every kind of failure the next call is shown to work."""
from __future__ import annotations

import collections
import dataclasses
import gc
import os
import resource
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import parakit
from parakit import CollectiveHang, LaunchError, LaunchTimeout, RankDied, RankError, _shm, launcher
from conftest import live_children, parent_of, pid_alive, read_until, run_script, start_script, wait_gone


# ---------------------------------------------------------------- functions the ranks run
# Defined at module level, so cloudpickle sends them by reference: the workers import this
# module from the caller's sys.path.

def rank_and_size():
    return dist.get_rank(), dist.get_world_size(), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def scaled_rank(scale, offset):
    return scale * dist.get_rank() + offset


def summed_ranks():
    """Each rank all-reduces its rank number: every rank returns 0 + 1 + ... + (N-1)."""
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def assert_pool_works(world_size):
    """A call with a collective returns the right result on every rank."""
    total = world_size * (world_size - 1) / 2
    assert parakit.launch(summed_ranks, world_size=world_size) == [total] * world_size


class Accumulator:
    def __init__(self, start):
        self.value = start

    def add(self, x):
        self.value += x
        return self


def worker_pids(world_size):
    return parakit.launch(os.getpid, world_size=world_size)


# ---------------------------------------------------------------- results

@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_in_rank_order(world_size):
    assert parakit.launch(rank_and_size, world_size=world_size) == [
        (r, world_size, r, world_size) for r in range(world_size)]
    assert parakit.launch(scaled_rank, 10, 3, world_size=world_size) == [10 * r + 3 for r in range(world_size)]


def test_tensors_come_back_on_cpu_detached_inside_containers():
    def make():
        w = torch.full((2, 3), float(dist.get_rank()), requires_grad=True)
        return {"w": w * 2, "pair": (w.sum(), [torch.arange(3)])}

    results = parakit.launch(make, world_size=2)
    for rank, result in enumerate(results):
        tensors = [result["w"], result["pair"][0], result["pair"][1][0]]
        assert all(t.device.type == "cpu" and not t.requires_grad for t in tensors)
        torch.testing.assert_close(result["w"], torch.full((2, 3), 2.0 * rank))
        torch.testing.assert_close(result["pair"][0], torch.tensor(6.0 * rank))
        torch.testing.assert_close(result["pair"][1][0], torch.arange(3))


Point = collections.namedtuple("Point", "x label")


@dataclasses.dataclass
class Holder:
    tensor: torch.Tensor


def test_tensors_come_back_detached_through_every_kind_of_container():
    def make():
        w = torch.ones(2, requires_grad=True) * (dist.get_rank() + 1)
        return {"ordered": collections.OrderedDict(w=w), "default": collections.defaultdict(list, w=[w]),
                "holder": Holder(w), "point": Point(w, "w"), "parameter": torch.nn.Parameter(torch.ones(1))}

    for rank, result in enumerate(parakit.launch(make, world_size=2)):
        assert type(result["ordered"]) is collections.OrderedDict and type(result["point"]) is Point
        assert result["default"].default_factory is list and result["point"].label == "w"
        for t in (result["ordered"]["w"], result["default"]["w"][0], result["holder"].tensor, result["point"].x):
            assert t.device.type == "cpu" and not t.requires_grad
            torch.testing.assert_close(t, torch.full((2,), rank + 1.0))
        assert type(result["parameter"]) is torch.nn.Parameter and result["parameter"].requires_grad


def test_meta_tensor_arguments_arrive_as_meta_tensors():
    assert parakit.launch(lambda m: (m.device.type, tuple(m.shape)), torch.empty(3, 4, device="meta"),
                          world_size=2) == [("meta", (3, 4))] * 2


def test_lambda_closure_and_classes_from_the_test_module_run_on_every_rank():
    offset = 100

    def closure(x):  # captures `offset` and a class defined in this function
        class Local:
            def twice(self, v):
                return 2 * v
        return Local().twice(x) + offset + dist.get_rank()

    assert parakit.launch(lambda a, b: a * b + dist.get_rank(), 6, 7, world_size=2) == [42, 43]
    assert parakit.launch(closure, 1, world_size=2) == [102, 103]
    results = parakit.launch(lambda: Accumulator(dist.get_rank()).add(5), world_size=2)
    assert [type(a).__name__ for a in results] == ["Accumulator"] * 2
    assert [a.value for a in results] == [5, 6]


MAIN_SCRIPT = """
    import os
    import torch
    import torch.distributed as dist
    import parakit

    print("top level runs", os.getpid())

    class Box:
        def __init__(self, v):
            self.v = v

    def double_box(x):
        t = x.sum().reshape(1)
        dist.all_reduce(t)
        return Box(2 * t)

    boxes = parakit.launch(double_box, torch.full((100_000,), 0.00003, dtype=torch.float64), world_size=2)
    print("result", [round(b.v.item(), 6) for b in boxes], type(boxes[0]).__name__)
"""


def test_function_and_class_from_unguarded_main_script_run_without_rerunning_it(tmp_path):
    done = run_script(tmp_path, MAIN_SCRIPT)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len([line for line in lines if "top level runs" in line]) == 1, done.stdout  # no recursion
    assert "result [12.0, 12.0] Box" in lines, done.stdout


# ---------------------------------------------------------------- tensors through shared memory

def shared_memory_files(pids):
    """The files in shared memory that these processes made: parakit's and torch's own."""
    prefixes = tuple(f"{kind}{pid}{sep}" for pid in pids for kind, sep in (("parakit-", "-"), ("torch_", "_")))
    return sorted(name for name in os.listdir(_shm.DIR) if name.startswith(prefixes))


def open_fds(collect=False):
    """How many file descriptors this process has open; with `collect`, after collecting the
    garbage of earlier tests (a baseline taken so stays exact if a call leaves nothing)."""
    if collect:
        gc.collect()
    return len(os.listdir("/proc/self/fd"))


def mapped_shared_files():
    """The parakit shared-memory files this process maps now, by name."""
    with open("/proc/self/maps") as maps:
        paths = [line.split(None, 5)[5].strip() for line in maps if "/parakit-" in line]
    return sorted({os.path.basename(path.removesuffix(" (deleted)")) for path in paths})


def held_by_rank():
    """What this rank holds between calls: shared-memory mappings and open fds."""
    return mapped_shared_files(), open_fds()


def what_rank_got(x, model):
    """What the rank sees of its arguments, and the files it maps while it holds them."""
    tied = model[0].weight is model[1].weight
    return x, x.stride(), model[0].weight, tied, model[0].weight.requires_grad, mapped_shared_files()


def test_tensor_arguments_reach_every_rank_through_one_shared_file_each_storage():
    base = torch.randn(200, 200).to(torch.bfloat16)  # 80 000 bytes: over _shm.INLINE_BYTES
    x = base[1:4, ::2]  # a view: its storage travels whole, its strides stay
    model = torch.nn.Sequential(torch.nn.Embedding(100, 200), torch.nn.Embedding(100, 200))
    model[1].weight = model[0].weight  # tied weights stay tied
    results = parakit.launch(what_rank_got, x, model, world_size=2)
    for got, stride, weight, tied, requires_grad, mapped in results:
        assert got.dtype == torch.bfloat16 and stride == (200, 2) and torch.equal(got, x)
        assert torch.equal(weight, model[0].weight) and tied and requires_grad
        assert len(mapped) == 2 and all(name.startswith(f"parakit-{os.getpid()}-") for name in mapped)
        assert [name.rsplit("-", 1)[1] for name in mapped] == ["a0", "a1"]  # base's storage, the weight's
    assert results[0][5] == results[1][5]  # both ranks map the same two files


def write_own_rank(x):
    """Each rank writes its rank into its argument, waits for the others to write too, and
    returns what it sees."""
    x[0] = dist.get_rank()
    dist.barrier()
    return x


@pytest.mark.parametrize("numel", [10, 300_000])  # inside the pickle; through a shared file
def test_rank_writing_into_its_argument_changes_neither_the_caller_nor_other_ranks(numel):
    x = torch.full((numel,), 7.0)
    results = parakit.launch(write_own_rank, x, world_size=4)
    assert torch.equal(x, torch.full((numel,), 7.0))
    for rank, got in enumerate(results):
        assert got[0].item() == rank and torch.equal(got[1:], x[1:])


def test_small_tensor_arguments_travel_inside_the_pickle_and_stay_tied():
    model = torch.nn.Sequential(torch.nn.Embedding(4, 3), torch.nn.Embedding(4, 3))
    model[1].weight = model[0].weight
    for got, _, weight, tied, _, mapped in parakit.launch(what_rank_got, torch.ones(3), model, world_size=2):
        assert torch.equal(weight, model[0].weight) and tied and mapped == []


def test_tensor_results_come_back_through_shared_memory_that_the_caller_may_write():
    before = mapped_shared_files()
    results = parakit.launch(lambda: torch.full((100_000,), float(dist.get_rank())), world_size=2)
    new = sorted(set(mapped_shared_files()) - set(before))
    assert [name.split("-", 3)[3] for name in new] == ["r0-0", "r1-0"]  # parakit-<pid>-<call>-r<rank>-<n>
    assert new[0].startswith(f"parakit-{os.getpid()}-")
    results[0] += 5  # writable in place
    assert torch.equal(results[0], torch.full((100_000,), 5.0)) and torch.equal(results[1], torch.ones(100_000))
    del results
    assert mapped_shared_files() == before


def write_then_raise(x):
    x.add_(1)
    raise ValueError(f"rank {dist.get_rank()} gives up")


def test_tensor_calls_and_failures_leave_no_shared_file_mapping_or_fd_behind():
    x, model = torch.randn(1000, 100), torch.nn.Linear(100, 100)
    pids = [os.getpid(), *worker_pids(2)]
    fds, held = open_fds(collect=True), parakit.launch(held_by_rank, world_size=2)
    for _ in range(3):
        assert len(parakit.launch(lambda x, m: (m(x), x.clone()), x, model, world_size=2)) == 2
    with pytest.raises(RankError, match="ValueError: rank 1 gives up"):
        parakit.launch(write_then_raise, x, world_size=2)
    assert [mapped for mapped, _ in held] == [[], []]
    assert parakit.launch(held_by_rank, world_size=2) == held  # no mapping, same fds on each rank
    assert shared_memory_files(pids) == [] and open_fds() == fds


def hold_then_die(x):
    """Every rank maps x and returns a result as big; rank 1 kills itself instead."""
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return x * 2


def test_rank_killed_while_holding_shared_tensors_leaves_no_files_or_fds():
    x = torch.randn(1 << 20)  # 4 MB
    pids = [os.getpid(), *worker_pids(4)]
    fds = open_fds(collect=True)
    with pytest.raises(RankDied, match="--- rank 1 died: killed by SIGKILL"):
        parakit.launch(hold_then_die, x, world_size=4)
    assert shared_memory_files(pids) == []
    assert_pool_works(4)  # a new pool: as many pipes and sockets as the old one had
    assert open_fds() == fds


def test_files_of_a_caller_that_died_are_removed_and_a_live_caller_files_kept():
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan, ours = (os.path.join(_shm.DIR, f"parakit-{pid}-1-a0") for pid in (dead.pid, os.getpid()))
    for path in (orphan, ours):
        open(path, "wb").close()
    try:
        _shm.remove_orphans()
        assert (os.path.exists(orphan), os.path.exists(ours)) == (False, True)
    finally:
        for path in (orphan, ours):
            if os.path.exists(path):
                os.unlink(path)


# ---------------------------------------------------------------- the pool

def test_pool_stays_warm_between_calls_and_is_not_forked_from_the_caller():
    first = worker_pids(2)
    assert worker_pids(2) == first
    assert os.getpid() not in first and len(set(first)) == 2
    assert all(parent_of(pid) != os.getpid() for pid in first)  # a forkserver's children


def groups_and_gloo_threads(make=0):
    """This rank's process groups and gloo threads, after making `make` more groups (used once each)."""
    for _ in range(make):
        dist.all_reduce(torch.ones(1), group=dist.new_group(list(range(dist.get_world_size()))))
    threads = [t for t in os.listdir("/proc/self/task")
               if open(f"/proc/self/task/{t}/comm").read().strip() == "gloo_tcp_loop"]
    return len(dist.distributed_c10d._world.pg_map), len(threads)


def test_the_process_groups_a_call_makes_are_destroyed_when_it_returns():
    """Each holds a gloo thread that wakes every 10 ms (an NCCL communicator's GPU memory): a pool
    that kept them would hold one more per group each call makes, for as long as it lives."""
    before = launcher.launch(groups_and_gloo_threads, world_size=2, backend="gloo")
    inside = launcher.launch(groups_and_gloo_threads, 5, world_size=2, backend="gloo")
    after = launcher.launch(groups_and_gloo_threads, world_size=2, backend="gloo")
    assert all(made == (groups + 5, threads + 5) for made, (groups, threads) in zip(inside, before))
    assert after == before


def doubled_on_a_fresh_mesh(value):
    """A Partial DTensor on a new 1-D mesh over a new group, times 1, made whole: 2 * value on 2 ranks.
    Each call's mesh equals the last one's (a mesh's equality leaves its groups out), so DTensor's
    sharding caches hand back the last call's mesh, whose group is destroyed, unless they are cleared."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial
    mesh = DeviceMesh.from_group(dist.new_group([0, 1]), "cpu")
    return (DTensor.from_local(torch.full((2,), float(value)), mesh, [Partial()]) * 1).full_tensor()


def test_a_call_after_one_whose_groups_were_destroyed_runs_dtensor_on_an_equal_mesh():
    for value in (1, 2):
        assert all(torch.equal(t, torch.full((2,), 2.0 * value))
                   for t in launcher.launch(doubled_on_a_fresh_mesh, value, world_size=2, backend="gloo"))


def test_pools_of_two_and_four_ranks_coexist():
    two, four = worker_pids(2), worker_pids(4)
    assert not set(two) & set(four)
    assert worker_pids(2) == two and worker_pids(4) == four
    assert_pool_works(2)
    assert_pool_works(4)


def test_least_recently_used_pool_is_stopped_when_too_many_workers_would_live(monkeypatch):
    monkeypatch.setattr(launcher, "MAX_POOL_WORKERS", 7)
    launcher.shutdown()
    two, four = worker_pids(2), worker_pids(4)  # 6 workers; the 2-rank pool is the older
    three = worker_pids(3)                      # 9 > 7: the 2-rank pool stops, the 4-rank one stays
    assert wait_gone(two) == [] and worker_pids(4) == four
    again = worker_pids(2)                      # 9 > 7 again: now the 3-rank pool is the oldest
    assert wait_gone(three) == [] and not set(again) & set(two) and worker_pids(4) == four
    assert_pool_works(2)
    assert_pool_works(3)


def test_pool_generation_is_kept_by_calls_and_changes_when_the_pool_restarts():
    assert_pool_works(2)
    first = launcher.pool_generation(2, "gloo")
    assert_pool_works(2)
    assert launcher.pool_generation(2, "gloo") == first
    with pytest.raises(RankDied):
        parakit.launch(die, "exit", world_size=2)
    assert launcher.pool_generation(2, "gloo") is None
    assert_pool_works(2)
    assert launcher.pool_generation(2, "gloo") > first


def test_explicit_gloo_backend_runs_on_the_auto_pool():
    assert parakit.launch(dist.get_backend, world_size=2, backend="gloo") == ["gloo", "gloo"]
    assert parakit.launch(os.getpid, world_size=2, backend="gloo") == worker_pids(2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_nccl_backend_without_gpus_says_it_needs_one_gpu_per_rank():
    with pytest.raises(ValueError, match="one GPU per rank"):
        parakit.launch(os.getpid, world_size=2, backend="nccl")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_nccl_backend_without_gpus_is_rejected_pointing_to_gloo():
    with pytest.raises(ValueError, match="backend='gloo'"):
        parakit.launch(os.getpid, world_size=2, backend="nccl")
    assert_pool_works(2)


@pytest.mark.parametrize("backend, world_size, gpus, nccl_built, chosen", [
    ("auto", 4, 4, True, "nccl"), ("auto", 4, 8, True, "nccl"), ("auto", 4, 3, True, "gloo"),
    ("auto", 2, 2, False, "gloo"), ("AUTO", 1, 1, True, "nccl"), ("gloo", 2, 8, True, "gloo"),
    ("nccl", 2, 2, True, "nccl")])
def test_auto_picks_nccl_only_with_a_gpu_per_rank_and_nccl_built(backend, world_size, gpus, nccl_built, chosen):
    assert launcher.select_backend(backend, world_size, gpus, nccl_built) == chosen


def test_nccl_with_too_few_gpus_or_without_nccl_is_refused_saying_why():
    with pytest.raises(ValueError, match=r"world_size=4 but 2 GPU\(s\) are visible"):
        launcher.select_backend("nccl", 4, 2, True)
    with pytest.raises(ValueError, match="this build of torch has no NCCL"):
        launcher.select_backend("nccl", 2, 2, False)


def test_parakit_backend_says_what_auto_means_on_a_gpu_host(monkeypatch):
    """On a host with 4 GPUs and NCCL, 'auto' is NCCL; PARAKIT_BACKEND=gloo (the suite's own pin)
    makes it gloo and leaves a backend asked by name alone; a wrong value is refused."""
    from parakit import devices
    monkeypatch.setattr(devices, "accelerator", lambda: ("cuda", 4))
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.delenv("PARAKIT_BACKEND")
    assert devices.resolve_backend("auto", 4) == "nccl"
    monkeypatch.setenv("PARAKIT_BACKEND", "gloo")
    assert devices.resolve_backend("auto", 4) == "gloo" and devices.resolve_backend("nccl", 4) == "nccl"
    monkeypatch.setenv("PARAKIT_BACKEND", "mpi")
    with pytest.raises(ValueError, match=r"^PARAKIT_BACKEND='mpi': set it to 'gloo' or 'nccl'"):
        devices.resolve_backend("auto", 2)


@pytest.mark.parametrize("backend", ["mpi", "junk"])
def test_unknown_backend_is_rejected_naming_the_supported_ones(backend):
    with pytest.raises(ValueError, match=f"backend '{backend}' is not supported: use 'auto', 'gloo' or 'nccl'"):
        parakit.launch(os.getpid, world_size=2, backend=backend)


# ---------------------------------------------------------------- output

def talk():
    print(f"hello from {dist.get_rank()}")
    print(f"warning from {dist.get_rank()}", file=sys.stderr)


def test_each_rank_output_reaches_the_caller_prefixed_with_capsys(capsys):
    parakit.launch(talk, world_size=2)
    out, err = capsys.readouterr()
    assert sorted(out.splitlines()) == ["[rank 0] hello from 0", "[rank 1] hello from 1"]
    assert sorted(err.splitlines()) == ["[rank 0] warning from 0", "[rank 1] warning from 1"]


def test_each_rank_output_reaches_the_caller_prefixed_with_capfd(capfd):
    parakit.launch(talk, world_size=2)
    out, err = capfd.readouterr()
    assert sorted(out.splitlines()) == ["[rank 0] hello from 0", "[rank 1] hello from 1"]
    assert sorted(err.splitlines()) == ["[rank 0] warning from 0", "[rank 1] warning from 1"]


def test_c_level_output_and_unfinished_lines_are_prefixed(capsys):
    def c_level():
        os.write(1, f"c out {dist.get_rank()}\n".encode())
        os.write(2, f"c err {dist.get_rank()}\n".encode())
        print("no newline", end="")

    parakit.launch(c_level, world_size=2)
    out, err = capsys.readouterr()
    assert sorted(out.splitlines()) == ["[rank 0] c out 0", "[rank 0] no newline",
                                        "[rank 1] c out 1", "[rank 1] no newline"]
    assert sorted(err.splitlines()) == ["[rank 0] c err 0", "[rank 1] c err 1"]


def test_ten_megabytes_of_output_from_one_rank_do_not_block(capsys):
    lines, width = 100_000, 99  # 100 bytes a line with its newline: 10 MB

    def flood():
        if dist.get_rank() == 0:
            for start in range(0, lines, 1000):
                sys.stdout.write("".join(f"{i:0{width}d}\n" for i in range(start, start + 1000)))
        return summed_ranks()

    assert parakit.launch(flood, world_size=2) == [1.0, 1.0]
    out = capsys.readouterr().out.splitlines()
    assert len(out) == lines
    assert out[0] == "[rank 0] " + "0" * width
    assert out[-1] == f"[rank 0] {lines - 1:0{width}d}"


# ---------------------------------------------------------------- exceptions

def raise_on(ranks, message):
    if dist.get_rank() in ranks:
        check_value(message)
    return dist.get_rank()


def check_value(message):
    raise ValueError(f"{message} on rank {dist.get_rank()}")


def test_rank_exception_raises_rank_error_with_its_traceback():
    with pytest.raises(RankError) as caught:
        parakit.launch(raise_on, {1}, "bad value", world_size=2)
    text = str(caught.value)
    assert text.startswith("rank 1 failed:")
    assert "Traceback (most recent call last)" in text
    assert "in raise_on" in text and "in check_value" in text  # the rank's own frames
    assert "ValueError: bad value on rank 1" in text
    assert "_worker.py" not in text  # the launcher's frames are left out
    assert set(caught.value.failures) == {1}
    assert parakit.launch(raise_on, set(), "", world_size=2) == [0, 1]


def test_two_failing_ranks_show_both_tracebacks():
    with pytest.raises(RankError) as caught:
        parakit.launch(raise_on, {1, 3}, "bad value", world_size=4)
    text = str(caught.value)
    assert text.startswith("ranks 1, 3 failed:")
    assert "--- rank 1:" in text and "--- rank 3:" in text
    assert "ValueError: bad value on rank 1" in text and "ValueError: bad value on rank 3" in text
    assert set(caught.value.failures) == {1, 3}
    assert_pool_works(4)


def fail_while_others_all_reduce(fail_after, reduce_after):
    """Rank 1 raises after `fail_after` s; the others enter an all_reduce after `reduce_after` s."""
    if dist.get_rank() == 1:
        time.sleep(fail_after)
        raise ValueError("rank 1 gives up")
    time.sleep(reduce_after)
    dist.all_reduce(torch.ones(3))


def test_rank_exception_while_others_wait_in_all_reduce_names_where_they_wait():
    assert_pool_works(4)  # warm, so the time measured is the call's
    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        parakit.launch(fail_while_others_all_reduce, 0.5, 0.0, world_size=4)
    assert time.monotonic() - start < 35.0  # not the 120 s timeout: 10x the 3.4 s measured at load 8 (1.0-1.3 s idle)
    text = str(caught.value)
    assert text.startswith("rank 1 failed:") and "ValueError: rank 1 gives up" in text
    waiting = text.split("while the other ranks waited:\n", 1)[1]
    for rank in (0, 2, 3):
        assert f"rank {rank} waits in all_reduce #1 for" in waiting, text
    assert waiting.count("in fail_while_others_all_reduce: dist.all_reduce(torch.ones(3))") == 3
    assert_pool_works(4)


def test_rank_exception_names_ranks_that_reach_the_all_reduce_just_after_it():
    assert_pool_works(4)  # warm: the ranks have imported this module, the call starts at once
    with pytest.raises(RankError) as caught:
        parakit.launch(fail_while_others_all_reduce, 0.0, 0.2, world_size=4)
    text = str(caught.value)
    for rank in (0, 2, 3):
        assert f"rank {rank} waits in all_reduce #1" in text, text


# ---------------------------------------------------------------- deaths

def die(how):
    if dist.get_rank() == 1:
        print("last words", flush=True)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file from os.abort
        if how == "exit":
            os._exit(3)
        elif how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            os.abort()
    return dist.get_rank()


@pytest.mark.parametrize("how, said", [("exit", "exited with code 3"), ("kill", "killed by SIGKILL"),
                                       ("abort", "killed by SIGABRT")])
def test_rank_that_dies_raises_rank_died_saying_how(how, said, capsys):
    with pytest.raises(RankDied) as caught:
        parakit.launch(die, how, world_size=2)
    text = str(caught.value)
    assert f"--- rank 1 died: {said}" in text
    assert "; its last output:\n" in text and text.endswith("\nlast words")
    assert list(caught.value.failures) == [1] and said in caught.value.failures[1]
    assert "[rank 1] last words" in capsys.readouterr().out
    assert_pool_works(2)


def test_dead_rank_last_output_holds_only_this_call_output(capsys):
    parakit.launch(print, "from an earlier call", world_size=2)
    with pytest.raises(RankDied) as caught:
        parakit.launch(die, "exit", world_size=2)
    assert str(caught.value).endswith("--- rank 1 died: exited with code 3; its last output:\nlast words")


def test_rank_dying_while_others_wait_in_all_reduce_raises_rank_died():
    def die_then_reduce():
        if dist.get_rank() == 2:
            os._exit(3)
        dist.all_reduce(torch.ones(3))

    assert_pool_works(4)  # warm, so the time measured is the call's
    start = time.monotonic()
    with pytest.raises(RankDied, match="--- rank 2 died: exited with code 3"):
        parakit.launch(die_then_reduce, world_size=4, timeout=30)
    assert time.monotonic() - start < 10.0  # not the timeout: 10x the 0.8 s measured at load 8 (0.5 s idle)
    assert_pool_works(4)


# ---------------------------------------------------------------- hangs and timeouts

HANG_TIMEOUT = 45  # s: hangs are found in 1.7-2.2 s idle, 3.6-4.2 s at load 8; 10x that


def mismatched_collectives():
    t = torch.ones(4)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, src=0)


def test_mismatched_collectives_raise_collective_hang_naming_each_op():
    assert_pool_works(2)  # warm, so the time measured is the call's
    start = time.monotonic()
    with pytest.raises(CollectiveHang) as caught:
        parakit.launch(mismatched_collectives, world_size=2, timeout=HANG_TIMEOUT)
    assert time.monotonic() - start < HANG_TIMEOUT  # found, reported and stopped before the timeout
    text = str(caught.value)
    assert text.startswith("the ranks wait in collectives that cannot complete")
    assert "rank 0 waits in all_reduce #1" in text and "in mismatched_collectives: dist.all_reduce(t)" in text
    assert "rank 1 waits in broadcast #1" in text and "dist.broadcast(t, src=0)" in text
    assert "Every rank must make the same collective calls in the same order" in text
    assert set(caught.value.failures) == {0, 1}
    assert_pool_works(2)


def skip_second_all_reduce():
    dist.all_reduce(torch.ones(2))
    if dist.get_rank() == 2:
        return "skipped"
    dist.all_reduce(torch.ones(2))


def test_rank_skipping_a_collective_raises_collective_hang_naming_the_waiting_ranks():
    assert_pool_works(4)  # warm, so the time measured is the call's
    start = time.monotonic()
    with pytest.raises(CollectiveHang) as caught:
        parakit.launch(skip_second_all_reduce, world_size=4, timeout=HANG_TIMEOUT)
    assert time.monotonic() - start < HANG_TIMEOUT  # found, reported and stopped before the timeout
    text = str(caught.value)
    assert "rank 2 returned after 1 communication call(s)" in text
    for rank in (0, 1, 3):
        assert f"rank {rank} waits in all_reduce #2" in text
    assert set(caught.value.failures) == {0, 1, 3}
    assert_pool_works(4)


def both_ranks_first(op):
    """Both ranks send to (or receive from) each other first: a classic deadlock of
    blocking point-to-point calls, as in a ring all-reduce that sends before it receives."""
    peer = 1 - dist.get_rank()
    if op == "send":
        dist.send(torch.ones(1000), peer)
        dist.recv(torch.empty(1000), peer)
    else:
        dist.recv(torch.empty(1000), peer)
        dist.send(torch.ones(1000), peer)


@pytest.mark.parametrize("op", ["send", "recv"])
def test_ranks_that_all_block_in_send_or_all_in_recv_raise_collective_hang(op):
    assert_pool_works(2)  # warm, so the time measured is the call's
    start = time.monotonic()
    with pytest.raises(CollectiveHang) as caught:
        parakit.launch(both_ranks_first, op, world_size=2, timeout=HANG_TIMEOUT)
    assert time.monotonic() - start < HANG_TIMEOUT  # found, reported and stopped before the timeout
    assert f"rank 0 waits in {op} #1" in str(caught.value) and f"rank 1 waits in {op} #1" in str(caught.value)


def test_a_waiting_call_can_complete_when_the_others_have_made_their_side_of_it():
    """The launcher's rule, from what each rank has called: a slow rank is not a hung one."""
    ring = {("send", 0): 2, ("recv", 1): 2}  # rank 2 of a ring step: isend to 0, recv from 1, returned
    assert launcher.can_complete(0, {0: ("recv", 4, 2)}, {0: (4, {("send", 1): 2, ("recv", 2): 2}), 2: (4, ring)})
    assert not launcher.can_complete(0, {0: ("recv", 5, 2)}, {0: (5, {("recv", 2): 3}), 2: (4, ring)})
    both_send = {0: ("send", 1, 1), 1: ("send", 1, 0)}
    assert not launcher.can_complete(0, both_send, {0: (1, {("send", 1): 1}), 1: (1, {("send", 0): 1})})
    assert launcher.can_complete(0, {0: ("send", 1, 1), 1: ("recv", 1, 0)},
                                 {0: (1, {("send", 1): 1}), 1: (1, {("recv", 0): 1})})
    behind = {0: ("all_reduce", 3, None), 1: ("all_reduce", 4, None)}  # rank 1 finished #3 first
    assert launcher.can_complete(0, behind, {0: (3, {}), 1: (4, {})})
    assert not launcher.can_complete(1, behind, {0: (3, {}), 1: (4, {})})
    mismatched = {0: ("all_reduce", 1, None), 1: ("broadcast", 1, None)}
    assert not any(launcher.can_complete(r, mismatched, {0: (1, {}), 1: (1, {})}) for r in (0, 1))
    assert launcher.can_complete(0, {0: ("all_gather", 2, None)}, {0: (2, {}), 1: (2, {})})  # rank 1 returned after it
    assert not launcher.can_complete(0, {0: ("all_reduce", 1, None)}, {0: (1, {}), 1: (0, {})})  # rank 1 skipped it


def test_busy_rank_past_the_timeout_raises_launch_timeout():
    assert_pool_works(2)  # warm, so the time measured is the call's
    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as caught:
        parakit.launch(time.sleep, 30, world_size=2, timeout=2)
    assert time.monotonic() - start < 7.0  # the timeout, then 10x the 0.44 s past it at load 8 (0.02 s idle)
    assert isinstance(caught.value, TimeoutError) and isinstance(caught.value, LaunchError)
    assert "the call did not finish within its timeout of 2 s" in str(caught.value)
    assert "rank 0 runs code outside any collective" in str(caught.value)
    assert_pool_works(2)


# ---------------------------------------------------------------- code in the seeds' style

def seed_style_main():
    dist.init_process_group("gloo", init_method="env://")
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = dist.get_world_size()
    t = torch.tensor([float(local_rank)])
    dist.all_reduce(t)
    dist.barrier()
    dist.destroy_process_group()
    return local_rank, world_size, t.item()


def test_seed_style_code_runs_unchanged_and_the_pool_survives_destroy():
    assert parakit.launch(seed_style_main, world_size=4) == [(r, 4, 6.0) for r in range(4)]
    assert parakit.launch(seed_style_main, world_size=4) == [(r, 4, 6.0) for r in range(4)]
    assert_pool_works(4)


def test_init_process_group_nccl_in_a_gloo_pool_says_which_backend_to_ask_for():
    with pytest.raises(RankError) as caught:
        parakit.launch(lambda: dist.init_process_group("nccl"), world_size=2)
    text = str(caught.value)
    assert "ValueError: init_process_group('nccl'): the ranks of this pool run backend 'gloo'" in text
    assert "parakit.launch(..., backend='nccl')" in text
    assert_pool_works(2)


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("world_size", [0, -1])
def test_world_size_below_one_is_rejected(world_size):
    with pytest.raises(ValueError, match=f"world_size must be at least 1, got {world_size}"):
        parakit.launch(os.getpid, world_size=world_size)
    assert_pool_works(2)


@pytest.mark.parametrize("world_size", ["2", 2.0, True])
def test_world_size_that_is_not_an_int_is_rejected(world_size):
    with pytest.raises(TypeError, match="world_size must be an int"):
        parakit.launch(os.getpid, world_size=world_size)
    assert_pool_works(2)


@pytest.mark.parametrize("timeout", [0, -1])
def test_timeout_not_positive_is_rejected(timeout):
    with pytest.raises(ValueError, match=f"timeout must be a positive number of seconds, got {timeout}"):
        parakit.launch(os.getpid, world_size=2, timeout=timeout)
    assert_pool_works(2)


def test_function_capturing_a_lock_cannot_be_pickled():
    lock = threading.Lock()
    with pytest.raises(TypeError) as caught:
        parakit.launch(lambda x: lock.locked(), 1, world_size=2)
    assert str(caught.value).startswith("cannot send '<lambda>' and its arguments to the ranks: it cannot be "
                                        "pickled (TypeError: cannot pickle '_thread.lock' object).")
    assert "create locks, files, sockets and streams inside the function" in str(caught.value)
    assert_pool_works(2)


def hold(x, resource):
    return resource


@pytest.mark.parametrize("make, kind, cause", [
    (threading.Lock, "_thread.lock", "TypeError: cannot pickle '_thread.lock' object"),
    (lambda: (i for i in range(3)), "generator", "TypeError: cannot pickle 'generator' object"),
    (lambda: open(os.devnull, "w"), "_io.TextIOWrapper",
     "PicklingError: Cannot pickle files that are not opened for reading: w")])
def test_argument_that_cannot_be_pickled_is_named_with_its_type_before_any_rank_starts(make, kind, cause):
    resource = make()
    assert launcher.pool_generation(5, "gloo") is None  # no test starts a pool of 5 ranks
    with pytest.raises(TypeError) as caught:
        parakit.launch(hold, torch.ones(100_000), resource, world_size=5)
    assert str(caught.value) == (f"cannot send argument 1 (resource) of 'hold', a {kind}, to the ranks: it "
                                 f"cannot be pickled ({cause}). Pass tensors and plain values; create locks, "
                                 f"files, sockets and streams inside the function.")
    assert launcher.pool_generation(5, "gloo") is None
    assert shared_memory_files([os.getpid()]) == []  # the tensor before it was written, then removed


def test_returning_a_lock_says_it_cannot_be_sent_back():
    with pytest.raises(LaunchError) as caught:
        parakit.launch(threading.Lock, world_size=2)
    text = str(caught.value)
    assert "rank 0 returned a lock that cannot be sent back" in text
    assert "rank 1 returned a lock that cannot be sent back" in text
    assert_pool_works(2)


def test_non_callable_is_rejected():
    with pytest.raises(TypeError, match="launch needs a function to run on every rank"):
        parakit.launch(42, world_size=2)


# ---------------------------------------------------------------- no orphans

def test_pool_restart_after_a_failure_stops_the_old_workers():
    old = worker_pids(2)
    with pytest.raises(RankDied):
        parakit.launch(die, "exit", world_size=2)
    assert wait_gone(old) == []
    new = worker_pids(2)
    assert not set(new) & set(old)


def test_shutdown_stops_every_worker_and_the_next_call_restarts_them():
    old = worker_pids(2) + worker_pids(4)
    parakit.shutdown()
    assert wait_gone(old) == []
    assert_pool_works(2)


ORPHAN_SCRIPT = """
    import os, sys, time
    import parakit

    pids = parakit.launch(os.getpid, world_size=2)
    forkserver = int(open(f"/proc/{pids[0]}/stat").read().rsplit(")", 1)[1].split()[1])
    print("pids", forkserver, *pids, flush=True)
    if sys.argv[-1] == "sleep":
        time.sleep(120)
"""


def test_workers_and_forkserver_end_when_the_caller_exits(tmp_path):
    done = run_script(tmp_path, ORPHAN_SCRIPT)
    assert done.returncode == 0, done.stdout + done.stderr
    pids = [int(p) for p in done.stdout.split("pids", 1)[1].split()]
    assert wait_gone(pids) == []


def test_workers_and_forkserver_end_when_the_caller_is_killed(tmp_path):
    script = start_script(tmp_path, ORPHAN_SCRIPT.replace('sys.argv[-1] == "sleep"', "True"))
    try:
        pids = [int(p) for p in read_until(script, "pids", []).split()[1:]]
        assert all(pid_alive(p) for p in pids)
        script.kill()
        script.wait(10)
        assert wait_gone(pids) == []
    finally:
        script.kill()
        script.wait(10)


INTERRUPT_SCRIPT = """
    import os, signal, time
    import torch
    import parakit

    # as in a terminal or a kernel: Ctrl-C raises KeyboardInterrupt (a shell that starts this in
    # the background, as some CI runners do, hands it SIGINT ignored, and then no SIGINT would count)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def alive(pid):
        try:
            return "State:\\tZ" not in open(f"/proc/{pid}/status").read()
        except FileNotFoundError:
            return False

    def sleeper(x):
        print("sleeping", flush=True)
        time.sleep(600)

    pids = parakit.launch(os.getpid, world_size=2)
    print("pids", *pids, flush=True)
    try:
        parakit.launch(sleeper, torch.ones(100_000), world_size=2)
        print("not interrupted")
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        deadline = time.monotonic() + 60  # killed and joined already; a bound for a loaded machine
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        print("alive", *[alive(p) for p in pids], flush=True)
        print("files", [n for n in os.listdir("/dev/shm") if n.startswith(f"parakit-{os.getpid()}-")], flush=True)
    print("again", parakit.launch(lambda: 7, world_size=2), flush=True)
"""


def test_keyboard_interrupt_stops_every_rank_and_the_next_call_works(tmp_path):
    script = start_script(tmp_path, INTERRUPT_SCRIPT)
    seen: list[str] = []
    try:
        pids = [int(p) for p in read_until(script, "pids", seen).split()[1:]]
        for rank in (0, 1):  # both ranks running (under load one can lag), in either order
            if not any(line.startswith(f"[rank {rank}] sleeping") for line in seen):
                read_until(script, f"[rank {rank}] sleeping", seen)
        script.send_signal(signal.SIGINT)
        # a bound on a hang only: the ranks sleep 600 s; the rest takes 2-4 s (idle), ~15 s loaded
        output, _ = script.communicate(timeout=300)
    finally:
        script.kill()
    output = "".join(seen) + output
    assert script.returncode == 0, output
    assert "interrupted\nalive False False\nfiles []\n" in output
    assert "again [7, 7]" in output
    assert wait_gone(pids, 1.0) == []


# ---------------------------------------------------------------- many calls

def every_tenth_fails(i, x):
    """Call i (from 0) with a tensor x of ones: every 10th, from the first, raises on rank 1,
    half of those while the others wait in an all_reduce (the pool restarts), half before any
    collective (the pool stays); the others return x's sum over the ranks and a tensor; the
    200th call (i = 199) works."""
    if i % 10 == 0 and dist.get_rank() == 1:
        raise ValueError(f"call {i} fails")
    if i % 20 == 0 or i % 10 != 0:
        t = x.sum().reshape(1)
        dist.all_reduce(t)
        return t.item(), x * 2
    return None


def test_two_hundred_calls_with_failures_leave_no_extra_processes_shared_files_or_fds():
    x = torch.ones(50_000)
    forkserver = parent_of(worker_pids(4)[0])
    before = live_children(forkserver)
    callers_children = live_children(os.getpid())
    fds = open_fds(collect=True)
    failures = restarts = 0
    ranks_ever = set()
    for i in range(200):
        pids = set(worker_pids(4)) if i % 10 == 0 else None
        ranks_ever |= pids or set()
        try:
            results = parakit.launch(every_tenth_fails, i, x, world_size=4)
            assert [total for total, _ in results] == [200_000.0] * 4
            assert all(torch.equal(doubled, x * 2) for _, doubled in results)
        except RankError as error:
            assert f"ValueError: call {i} fails" in str(error)
            failures += 1
            restarts += pids != set(worker_pids(4))
    assert (failures, restarts) == (20, 10)  # and the 200th call, i = 199, returned its results
    deadline = time.monotonic() + 60  # a bound for a hang only: the killed workers are reaped at once idle
    while len(live_children(forkserver)) != len(before) and time.monotonic() < deadline:
        time.sleep(0.05)
    after = live_children(forkserver)
    assert len(after) == len(before) and set(worker_pids(4)) <= after
    assert live_children(os.getpid()) == callers_children
    del results
    assert shared_memory_files([os.getpid(), *ranks_ever]) == [] and mapped_shared_files() == []
    assert open_fds() == fds
