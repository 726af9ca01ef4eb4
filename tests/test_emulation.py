"""The emulated GPU box (parakit.emulation): fgpu devices that refuse to mix as CUDA does, and
an NCCL that refuses what NCCL refuses and stops where NCCL would hang.

The model of NCCL's streams is tested as data; the rest in real processes, each test a fresh
interpreter with PARAKIT_EMULATE_GPUS=4 (the emulation is for a whole process, as a GPU box is).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import run_script, script_env, write_script
from parakit import devices
from parakit.emulation.streams import Entry, Item, Streams

GROUP = ("0", "all")


def send(rank, to, n=0, comm=GROUP):
    return Item((comm, "p2p", rank, to, n), (rank, to), f"isend to rank {to}")


def recv(rank, source, n=0, comm=GROUP):
    return Item((comm, "p2p", source, rank, n), (source, rank), f"irecv from rank {source}")


def run_emulated(tmp_path, body: str) -> dict:
    """Run `body` (which prints one JSON line last) on an emulated box with 4 GPUs."""
    done = run_script(tmp_path, "import os\nos.environ['PARAKIT_EMULATE_GPUS'] = '4'\n" + body)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.splitlines()[-1])


# ---------------------------------------------------------------- fgpu

DEVICE_CHECKS = """
import json, pickle, torch
from parakit import emulation
emulation.install(4)
x = torch.ones(3, device="fgpu:1")
found = {"device": str((x * 2 + 1).device), "view_shares_storage": x[1:].untyped_storage() is x.untyped_storage()}
for name, bad in [("cpu", lambda: x + torch.ones(3)), ("other_index", lambda: x + torch.ones(3, device="fgpu:2")),
                  ("no_such_device", lambda: torch.ones(1, device="fgpu:4"))]:
    try:
        bad()
        found[name] = "no error"
    except RuntimeError as error:
        found[name] = str(error)
found["cpu_scalar"] = (x + torch.tensor(2.0)).cpu().tolist()
found["cpu_indices"] = x[torch.tensor([0, 2])].device.type
stream, event = torch.fgpu.Stream(priority=-1), torch.fgpu.Event()  # FSDP2's overlap, on one order: the host's
event.record(stream)
with torch.fgpu.stream(stream):
    x.record_stream(stream)
torch.fgpu.current_stream().wait_stream(stream)
found["no_rows"] = list(torch.nn.Linear(4, 2).to("fgpu:1")(torch.empty(0, 4, device="fgpu:1")).shape)  # an idle expert
w = torch.randn(3, 3, device="fgpu:2", requires_grad=True)
(w ** 2).sum().backward()
found["grad"] = [str(w.grad.device), torch.equal(w.grad.cpu(), 2 * w.detach().cpu())]
before = torch.fgpu.memory_allocated(3)
y = torch.empty(1000, device="fgpu:3")
found["memory"] = [torch.fgpu.memory_allocated(3) - before]
del y
found["memory"].append(torch.fgpu.memory_allocated(3) - before)
found["pickled"] = str(pickle.loads(pickle.dumps(x)).device)
w = torch.arange(250.0, device="fgpu:3")  # 1,000 bytes, freed and taken back as FSDP does
before = torch.fgpu.memory_allocated(3)
w.untyped_storage().resize_(0)
found["resized"] = [torch.fgpu.memory_allocated(3) - before]
w.untyped_storage().resize_(1000)
w.copy_(torch.ones(250))
found["resized"] += [torch.fgpu.memory_allocated(3) - before, w.sum().item()]
import copy
found["made_there"] = [str(copy.deepcopy(x).device), str(torch.UntypedStorage(8, device="fgpu:2").device)]
g = torch.Generator("fgpu:1").manual_seed(0)
found["generator"] = [isinstance(g, torch.Generator), torch.equal(torch.randn(3, generator=g, device="fgpu:1").cpu(),
                                                                   torch.randn(3, generator=torch.Generator().manual_seed(0)))]
with torch.autocast("fgpu", dtype=torch.bfloat16):
    m = torch.randn(4, 4, device="fgpu:1")
    found["autocast"] = [str((m @ m).dtype), str(m.softmax(-1).dtype), str((m + 1).dtype)]
with torch.autocast("cpu", dtype=torch.bfloat16):  # not for a GPU's tensors, as on CUDA
    found["autocast"].append(str((m @ m).dtype))
from torch.utils._python_dispatch import TorchDispatchMode
class Passing(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))
with Passing():  # as MemoryMeter's and torch's modes are
    found["under_a_mode"] = str(torch.tensor([1], device="fgpu:1").device)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
alone, xs, ys, rows_on = copy.deepcopy(model), torch.randn(12, 8), torch.randn(12, 4), []
model[0].register_forward_pre_hook(lambda layer, args: rows_on.append((str(args[0].device), len(args[0]))))
net = torch.nn.DataParallel(model.to("fgpu:0"))  # every emulated GPU: scatter, replicate, gather, reduce_add
out = net(xs.to("fgpu:0"))
torch.nn.functional.mse_loss(out, ys.to("fgpu:0")).backward()
torch.nn.functional.mse_loss(alone(xs), ys).backward()
found["data_parallel"] = [net.device_ids, sorted(rows_on), str(out.device), max(
    (a.cpu() - b).abs().max().item() for a, b in zip([out.detach(), *(p.grad for p in model.parameters())],
                                                     [alone(xs).detach(), *(p.grad for p in alone.parameters())]))]
print(json.dumps(found))
"""


def test_fgpu_tensors_refuse_to_mix_devices_as_cuda_does(tmp_path):
    found = run_emulated(tmp_path, DEVICE_CHECKS)
    assert found["device"] == "fgpu:1" and found["view_shares_storage"]
    assert "Expected all tensors to be on the same device, but found at least two devices, fgpu:1 and cpu" in found["cpu"]
    assert "fgpu:1 and fgpu:2" in found["other_index"]
    assert "fgpu:4: invalid device ordinal: this box has 4 emulated GPUs" in found["no_such_device"]
    assert found["cpu_scalar"] == [3.0, 3.0, 3.0] and found["cpu_indices"] == "fgpu" and found["no_rows"] == [0, 2]
    assert found["grad"] == ["fgpu:2", True]
    assert found["memory"] == [4000, 0]
    assert found["pickled"] == "fgpu:1"
    assert found["resized"] == [-1000, 0, 250.0]
    assert found["under_a_mode"] == "fgpu:1"
    assert found["made_there"] == ["fgpu:1", "fgpu:2"]  # PyTorch would crash allocating there (no allocator)
    assert found["generator"] == [True, False]  # an fgpu generator: seed 0 starts another stream than the CPU's, as on CUDA
    assert found["autocast"] == ["torch.bfloat16", "torch.float32", "torch.float32", "torch.float32"]  # CUDA's rules
    ids, rows_on, where, difference = found["data_parallel"]  # nn.DataParallel, as over 4 GPUs
    assert ids == [0, 1, 2, 3] and rows_on == [[f"fgpu:{i}", 3] for i in range(4)] and where == "fgpu:0"
    assert difference < 1e-5, difference


# ---------------------------------------------------------------- NCCL's streams, as data

def test_streams_run_a_batched_ring_at_once():
    streams, runs = Streams(3), []
    for rank in range(3):
        runs += streams.post(rank, Entry(rank, 0, GROUP, [send(rank, (rank + 1) % 3), recv(rank, (rank - 1) % 3)]))
    assert sorted(runs) == sorted((r, ("run", 0, i)) for r in range(3) for i in range(2))
    assert streams.fault is None


def test_streams_stop_a_ring_whose_ranks_all_send_first_naming_every_stream_in_order():
    streams = Streams(3)
    for rank in range(3):
        assert streams.post(rank, Entry(rank, 0, GROUP, [send(rank, (rank + 1) % 3)])) == []
        streams.post(rank, Entry(rank, 1, GROUP, [recv(rank, (rank - 1) % 3)]))
    faults = streams.wait(0, 0)
    assert {rank for rank, _ in faults} == {0, 1, 2}
    text = faults[0][1][1]
    assert text.startswith("emulated NCCL: rank 0 waits for operations that can never run (NCCL would hang here):")
    assert "  rank 0 waits for its isend to rank 1\n" in text
    for rank in range(3):
        assert (f"  rank {rank}'s stream on group 0 runs, in order: isend to rank {(rank + 1) % 3}, "
                f"irecv from rank {(rank - 1) % 3}\n") in text
    assert "a send waits for its receive" in text and "dist.batch_isend_irecv" in text


def test_streams_stop_an_irecv_posted_before_an_isend_to_the_same_peer():
    streams = Streams(2)
    for rank in range(2):
        streams.post(rank, Entry(rank, 0, GROUP, [recv(rank, 1 - rank)]))
        streams.post(rank, Entry(rank, 1, GROUP, [send(rank, 1 - rank)]))
    assert "rank 0 waits for its isend to rank 1" in streams.wait(0, 1)[0][1][1]


def test_streams_wait_for_a_slow_rank_without_calling_it_stuck():
    streams = Streams(2)
    streams.post(0, Entry(0, 0, GROUP, [recv(0, 1)]))
    assert streams.wait(0, 0) == []
    assert streams.post(1, Entry(1, 0, GROUP, [send(1, 0)])) == [(1, ("run", 0, 0)), (0, ("run", 0, 0))]
    assert streams.blocked == {} and streams.fault is None


def test_streams_report_a_receive_whose_sender_returned():
    streams = Streams(2)
    streams.post(0, Entry(0, 0, GROUP, [recv(0, 1)]))
    streams.wait(0, 0)
    assert streams.idle(1, False, 1) == []
    text = streams.idle(1, True, 1)[0][1][1]
    assert "rank 0 waits for its irecv from rank 1" in text and "rank 1 has left the launched function (returned or raised)" in text


def test_streams_take_a_rank_idle_after_an_older_call_for_one_about_to_start():
    streams = Streams(2)
    streams.idle(1, True, 1)
    streams.idle(0, False, 2)
    streams.post(0, Entry(0, 0, GROUP, [recv(0, 1)]))
    assert streams.wait(0, 0) == [] and streams.fault is None


def test_streams_stop_a_ring_of_lazy_pair_setups_naming_each_rank():
    streams = Streams(3)
    for rank in range(3):
        pair = tuple(sorted((rank, (rank + 1) % 3)))
        faults = streams.setup(rank, ("0", *pair), pair, f"fgpu:{rank}")
    text = faults[0][1][1]
    assert text.startswith("emulated NCCL: ranks 0, 1, 2 wait for operations that can never run")
    assert "rank 0 waits to set up the communicator of group 0's pair 0-1" in text and "which rank 1 has not begun" in text
    assert "rank 2 waits to set up the communicator of group 0's pair 0-2" in text
    assert "Pass device_id" in text


def test_streams_refuse_two_ranks_on_one_device():
    streams = Streams(2)
    streams.setup(0, GROUP, (0, 1), "fgpu:0")
    assert streams.setup(1, GROUP, (0, 1), "fgpu:0")[0][1][1].startswith(
        "Duplicate GPU detected: ranks 0 and 1 are both on fgpu:0")


def test_streams_refuse_mismatched_collectives():
    streams = Streams(2)
    streams.post(0, Entry(0, 0, GROUP, [Item((GROUP, "coll", 0), (0, 1), "all_reduce")]))
    faults = streams.post(1, Entry(1, 0, GROUP, [Item((GROUP, "coll", 0), (0, 1), "broadcast")]))
    assert faults[0][1][1].startswith("collective mismatch on group 0: its call #1 is ")


# ---------------------------------------------------------------- the device rule

def test_world_size_beyond_the_emulated_gpus_is_refused_naming_the_rank(monkeypatch):
    monkeypatch.setenv("PARAKIT_EMULATE_GPUS", "4")
    assert devices.resolve_backend("auto", 4) == "fnccl" and devices.resolve_backend("auto", 5) == "gloo"
    with pytest.raises(ValueError, match=r"^backend 'nccl' needs one GPU per rank: world_size=5 but 4 emulated GPU\(s\) "
                                         r"\(PARAKIT_EMULATE_GPUS=4\); use backend='gloo' \(or 'auto', which picks gloo "
                                         r"here\), or world_size=4 or fewer \(rank 4 would have no GPU\)$"):
        devices.resolve_backend("nccl", 5)


README = """
import json, parakit, torch, torch.distributed as dist
from parakit import _worker, launcher

def work(x):
    dist.all_reduce(x)            # the ranks are already in a process group
    return x

results = parakit.launch(work, torch.ones(3), world_size=4)
cell = "import torch, torch.distributed as dist, parakit\\nx = torch.ones(2, device=parakit.device()) * dist.get_rank()\\ndist.all_reduce(x)\\nx"
parakit.launch(_worker.run_cell, cell, "<ranks-cell-1>", world_size=4)  # what %%ranks 4 runs
where = parakit.launch(lambda: (str(parakit.device()), dist.get_backend()), world_size=4)
print(json.dumps({"results": [r.tolist() for r in results], "where": where}))
"""


def test_readme_example_runs_on_the_emulated_box(tmp_path):
    found = run_emulated(tmp_path, README)
    assert found["results"] == [[4.0, 4.0, 4.0]] * 4
    assert found["where"] == [[f"fgpu:{rank}", "fnccl"] for rank in range(4)]


PLACING = """
import collections, dataclasses, json, typing, parakit, torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol

Pair = typing.NamedTuple("Pair", [("a", torch.Tensor), ("b", int)])

@dataclasses.dataclass
class Box:
    t: torch.Tensor

def where(x, on_gpu, model, box):
    rank = dist.get_rank()
    seen = [str(t.device) for t in (x, x[1:], on_gpu, model.weight, box.t)]
    y = torch.full((2,), float(rank), device=parakit.device(), requires_grad=True) * 2
    counts = collections.defaultdict(int, ones=1)
    return seen, x[1:].untyped_storage() is x.untyped_storage(), {
        "ordered": collections.OrderedDict(y=y), "default": counts, "box": Box(y), "pair": Pair(y, rank),
        "model": model, "parameters": list(model.parameters()),
        "collective": funcol.all_reduce(torch.ones(2, device=parakit.device()), "sum", dist.group.WORLD),
        "functional": [funcol.all_gather_tensor(torch.full((1,), float(rank), device=parakit.device()), 0,
                                                dist.group.WORLD),  # as DTensor's ops call them, from C++
                       funcol.reduce_scatter_tensor(torch.ones(2, device=parakit.device()), "sum", 0, dist.group.WORLD),
                       funcol.all_to_all_single(torch.tensor([rank, 10.0 + rank], device=parakit.device()), [1, 1],
                                                [1, 1], dist.group.WORLD)]}

x, on_gpu = torch.arange(4.0), torch.ones(2, device="fgpu:0")
results = parakit.launch(where, x, on_gpu, torch.nn.Linear(2, 2), Box(torch.zeros(1)), world_size=2)
on_gloo = parakit.launch(lambda t: str(t.device), on_gpu, world_size=2, backend="gloo")

def devices_of(result):
    found = [result["ordered"]["y"], result["box"].t, result["pair"].a, result["model"].weight,
             *result["parameters"], result["collective"]]
    return sorted({str(t.device) for t in found}), any(t.requires_grad and t.grad_fn for t in found)

last = results[-1][2]
print(json.dumps({"seen": [r[0] for r in results], "views_share": [r[1] for r in results],
                  "back": [devices_of(r[2]) for r in results], "kinds": [type(last["ordered"]).__name__,
                  type(last["default"]).__name__, last["default"]["missing"], type(last["pair"]).__name__],
                  "values": [r[2]["pair"].a.tolist() for r in results], "on_gloo": on_gloo,
                  "collective": [[type(r[2]["collective"]).__name__, r[2]["collective"].tolist()] for r in results],
                  "functional": [[t.tolist() for t in r[2]["functional"]] for r in results]}))
"""


def test_launch_places_tensor_arguments_on_each_ranks_device_and_brings_results_back_to_the_cpu(tmp_path):
    found = run_emulated(tmp_path, PLACING)
    assert found["seen"] == [[f"fgpu:{rank}"] * 5 for rank in range(2)]  # the notebook's fgpu:0 lands on fgpu:1 too
    assert found["views_share"] == [True, True]
    assert found["back"] == [[["cpu"], False]] * 2
    assert found["kinds"] == ["OrderedDict", "defaultdict", 0, "Pair"]
    assert found["values"] == [[0.0, 0.0], [2.0, 2.0]]
    assert found["on_gloo"] == ["cpu", "cpu"]  # a GPU tensor to gloo ranks arrives on the CPU, as documented
    assert found["collective"] == [["Tensor", [2.0, 2.0]]] * 2  # DTensor's pending output: waited, a plain tensor
    assert found["functional"] == [[[0.0, 1.0], [2.0], [0.0, 1.0]], [[0.0, 1.0], [2.0], [10.0, 11.0]]]


BAD_INPUT = """
import json, parakit, torch, torch.distributed as dist
from parakit import launcher

def cpu_model():
    model = torch.nn.Linear(2, 2)  # left on the CPU
    dist.broadcast(model.weight.data, 0)

try:
    parakit.launch(cpu_model, world_size=2)
except parakit.RankError as error:
    text = str(error)
generation = launcher.pool_generation(2, "fnccl")
again = parakit.launch(lambda x: dist.all_reduce(x) or x, torch.ones(1), world_size=2)
print(json.dumps({"text": text, "same_pool": launcher.pool_generation(2, "fnccl") == generation,
                  "again": [t.item() for t in again]}))
"""


def test_module_left_on_the_cpu_under_nccl_fails_naming_rank_device_found_and_expected(tmp_path):
    found = run_emulated(tmp_path, BAD_INPUT)
    for rank in range(2):
        assert (f"RuntimeError: No backend type associated with device type cpu: broadcast on rank {rank} got a tensor "
                f"on cpu, but under NCCL this rank's tensors live on fgpu:{rank}: make them there "
                f"(device=parakit.device()) or move them with .to(parakit.device())") in found["text"]
    assert found["same_pool"] and found["again"] == [2.0, 2.0]


HANGS = """
import json, parakit, torch, torch.distributed as dist
from parakit import emulation, launcher

def ring_sends_first():
    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = torch.ones(2, device=parakit.device()), torch.empty(2, device=parakit.device())
    request = dist.isend(x, (rank + 1) % n)
    dist.recv(y, (rank - 1) % n)
    request.wait()

def batched_ring():
    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = torch.full((2,), float(rank), device=parakit.device()), torch.empty(2, device=parakit.device())
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, (rank + 1) % n),
                                        dist.P2POp(dist.irecv, y, (rank - 1) % n)]):
        work.wait()
    return y[0].item()

def lazy_ring():  # a group made without device_id: NCCL connects each pair at its first send
    emulation.install(4)
    torch.fgpu.set_device(dist.get_rank())
    group = dist.new_group(backend="fnccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = torch.ones(2, device=f"fgpu:{rank}"), torch.empty(2, device=f"fgpu:{rank}")
    request = dist.isend(x, (rank + 1) % n, group=group)
    dist.recv(y, (rank - 1) % n, group=group)
    request.wait()

def mismatched():  # calls of two kinds, which NCCL leaves undefined (lesson 00 says so)
    x = torch.ones(1, device=parakit.device())
    if dist.get_rank() == 0:
        dist.all_reduce(x)
    else:
        dist.broadcast(x, 0)

found = {}
for name, fn, n, backend in [("eager", ring_sends_first, 3, "nccl"), ("lazy", lazy_ring, 3, "gloo"),
                             ("mismatched", mismatched, 2, "nccl")]:
    try:
        launcher.launch(fn, world_size=n, backend=backend, timeout=60)
    except parakit.CollectiveHang as error:  # and a RankError: the ranks raised it
        found[name] = [str(error), launcher.pool_generation(n, "fnccl" if backend == "nccl" else backend),
                       isinstance(error, parakit.RankError)]
found["batched"] = [launcher.launch(batched_ring, world_size=n) for n in (3, 4)]
print(json.dumps(found))
"""


def test_hangs_nccl_would_hang_in_stop_at_once_as_a_collective_hang_naming_ranks_and_order(tmp_path):
    found = run_emulated(tmp_path, HANGS)
    eager, generation, raised = found["eager"]
    assert raised
    assert eager.startswith("emulated NCCL: rank") and eager.endswith("the next call starts them again.")
    for rank in range(3):
        assert (f"rank {rank}'s stream on group 0 runs, in order: send to rank {(rank + 1) % 3}" in eager
                or f"rank {rank} waits for its send to rank {(rank + 1) % 3}" in eager)
    assert generation is None  # the hung world is stopped: the next call starts new ranks
    lazy, _, _ = found["lazy"]
    assert "waits to set up the communicator of group 1's pair" in lazy and "Pass device_id" in lazy
    assert found["mismatched"][0].startswith("collective mismatch on group 0: its call #1 is ")
    assert "all_reduce on rank 0" in found["mismatched"][0] and "broadcast on rank 1" in found["mismatched"][0]
    assert found["batched"] == [[2.0, 0.0, 1.0], [3.0, 0.0, 1.0, 2.0]]


LESSON_01 = """
import json, torch, torch.nn as nn
from parakit import dp

def error(fn):
    try:
        fn()
    except RuntimeError as e:
        return str(e)

torch.manual_seed(0)
inputs, model = torch.randn(6, 8), nn.Linear(8, 10)
net = dp.DataParallel(model, device_ids=[0, 1, 2])             # lesson 01 as it stood: model and batch on the CPU
outputs = net(inputs)
found = {"devices": [str(d) for d in net.devices], "outputs": str(outputs.device),
         "compare": error(lambda: torch.allclose(outputs, model(inputs))),
         "nn_dp": error(lambda: nn.DataParallel(nn.Linear(8, 4), device_ids=[0, 1, 2])(inputs))}
on_gpu = dp.DataParallel(model.to("fgpu:0"), [0, 1, 2])(inputs.to("fgpu:0"))
found["fixed"] = torch.allclose(on_gpu, model(inputs.to("fgpu:0")))
with dp.MemoryMeter([0, 1, 2]) as meter:
    dp.DataParallel(model, [0, 1, 2])(inputs.to("fgpu:0")).sum().backward()
found["peaks"] = [peak > 0 for peak in meter.peaks()]
print(json.dumps(found))
"""


def test_lesson_01_device_mix_fails_on_the_emulated_box_as_on_three_gpus(tmp_path):
    found = run_emulated(tmp_path, LESSON_01)
    assert found["devices"] == ["fgpu:0", "fgpu:1", "fgpu:2"] and found["outputs"] == "fgpu:0"
    assert "Expected all tensors to be on the same device, but found at least two devices, fgpu:0 and cpu" \
        in found["compare"]
    assert found["nn_dp"] == ("module must have its parameters and buffers on device fgpu:0 (device_ids[0]) "
                              "but found one of them on device: cpu")
    assert found["fixed"] and found["peaks"] == [True, True, True]


TORCHRUN_JOB = """
import json, torch, torch.distributed as dist, parakit
from parakit.torchrun import process_group

with process_group():
    x = torch.ones(2, device=parakit.device()) * (dist.get_rank() + 1)
    dist.all_reduce(x)
    objects = [None, None]
    dist.all_gather_object(objects, dist.get_rank())
    world = dist.group.WORLD  # the emulated group: made eagerly on the rank's device (device_id was passed)
    with open(f"rank{dist.get_rank()}.json", "w") as out:  # the ranks' printed lines may interleave
        json.dump([dist.get_rank(), dist.get_backend(), world.eager and str(world.device), x.tolist(), objects], out)
"""


def test_torchrun_jobs_join_on_their_local_rank_gpu_passed_as_device_id(tmp_path):
    write_script(tmp_path, TORCHRUN_JOB, "job.py")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "job.py"],
                          cwd=tmp_path, env={**script_env(), "PARAKIT_EMULATE_GPUS": "2", "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    found = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert found == [[rank, "fnccl", f"fgpu:{rank}", [3.0, 3.0], [0, 1]] for rank in range(2)]
    assert "barrier()" not in done.stderr  # process_group's barrier is on the bound GPU, as NCCL's is: no warning


LEAVING = """
import json, time, torch, torch.distributed as dist, parakit
from parakit import devices

def completing(future):  # run by the transfer thread, in torch's code, taking the GIL back each millisecond ...
    for _ in range(500):
        time.sleep(0.001)

devices.join("fnccl", 0, store=dist.HashStore(), rank=0, world_size=1)
x = torch.ones(2, device=parakit.device())
world = dist.group.WORLD
world._start_coalescing(None)  # posted at its end: the callback is in place before the transfer runs
work = dist.all_reduce(x, async_op=True)
work.get_future().then(completing)
world._end_coalescing(None)
work.wait()
print(json.dumps(x.tolist()))  # ... when the script ends
"""


def test_a_process_ending_while_its_transfer_thread_is_in_torch_exits_cleanly(tmp_path):
    # the thread left in torch's C++ code aborted the interpreter's end: "terminate called without an active exception"
    assert run_emulated(tmp_path, LEAVING) == [1.0, 1.0]


FREED = """
import gc, json, time, weakref, torch, parakit, torch.distributed as dist
from parakit import dp

def gathered_then_dropped(shard):
    gc.disable()  # freed by reference counting alone, as CUDA memory is, or not at all
    full = torch.empty(2 * shard.numel(), device=shard.device)
    dist.all_gather_into_tensor(full, shard)
    alive = weakref.ref(full)
    del full
    for _ in range(100):  # the transfer thread may hold it a moment longer
        if alive() is None:
            break
        time.sleep(0.01)
    gc.enable()
    with dp.MemoryMeter([torch.device("cpu", 0)]) as meter:  # a logical meter counts a GPU's tensors too
        meter.place([shard], 0)
    return alive() is None, meter.peaks()[0]

print(json.dumps(parakit.launch(gathered_then_dropped, torch.randn(6), world_size=2)))
"""


def test_a_finished_collectives_tensors_die_with_their_last_reference_and_logical_meters_count_gpu_tensors(tmp_path):
    assert run_emulated(tmp_path, FREED) == [[True, 24], [True, 24]]


PIPELINE_WITH_TP = """
import json, parakit

def run_trainer(argv):
    from parakit import train
    return train.train(train.parse_args(argv))

small = ["--steps", "2", "--batch", "8", "--seq", "8", "--hidden", "16", "--heads", "4", "--vocab", "32"]
[one] = parakit.launch(run_trainer, small, world_size=1)
mesh = parakit.launch(run_trainer, small + ["--pp", "2", "--tp", "2"], world_size=4)
print(json.dumps({"one": one, "mesh": mesh}))
"""


def test_a_pipeline_of_tensor_parallel_stages_runs_on_the_emulated_box_as_one_process(tmp_path):
    """The pipeline finds its stages' shapes on meta tensors, through the tp all-reduces: NCCL
    has no backend for meta ("No backend type associated with device type meta"), so the
    operators send nothing there (parakit.train --pp 2 --tp 2 failed on every GPU box)."""
    found = run_emulated(tmp_path, PIPELINE_WITH_TP)
    for losses in found["mesh"]:
        assert losses == pytest.approx(found["one"], rel=1e-5, abs=1e-5)
