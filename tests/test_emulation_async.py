"""The emulated GPUs' asynchrony (parakit.emulation.gpu_streams): kernels queued on streams
the host does not wait for, so that the mistakes a GPU punishes show on the emulated box.

Each test is a fresh interpreter with PARAKIT_EMULATE_GPUS=4 (`run_emulated`). The first test
compares two times, the exception STYLE allows for a behaviour: a timing without synchronize
misses the kernels' time, asserted with a margin of 5x on work of more than 0.2 s.
"""
from __future__ import annotations

from test_emulation import run_emulated

SETUP = """
import json, time, torch
from parakit import emulation
emulation.install(4)
torch.set_num_threads(1)
dev = "fgpu:0"
a, b = torch.randn(1200, 1200, device=dev), torch.randn(1200, 1200, device=dev) / 40
(a @ b).cpu()  # the first launch's one-off costs, before anything is measured
found = {}
"""

TIMING = SETUP + """
def chain():
    y = a
    for _ in range(10):  # 10 x 3.5 GFLOP: 0.45 s on one core of this box, at least 0.2 s where CI runs
        y = y @ b
    return y

torch.fgpu.synchronize()
start = time.perf_counter()
chain()
found["unsynced"] = time.perf_counter() - start
torch.fgpu.synchronize()
start = time.perf_counter()
chain()
torch.fgpu.synchronize()
found["synced"] = time.perf_counter() - start
begin, end = torch.fgpu.Event(enable_timing=True), torch.fgpu.Event(enable_timing=True)
begin.record()
chain()
end.record()
try:
    begin.elapsed_time(end)
    found["elapsed_unsynced"] = "no error"
except RuntimeError as error:
    found["elapsed_unsynced"] = str(error)
end.synchronize()
found["elapsed"] = begin.elapsed_time(end) / 1e3
print(json.dumps(found))
"""


def test_a_timing_without_synchronize_misses_the_kernels_time_as_on_a_gpu(tmp_path):
    found = run_emulated(tmp_path, TIMING)
    assert found["synced"] >= 0.2, found  # the work is long enough for the margin below
    assert found["unsynced"] < found["synced"] / 5, found
    assert "device not ready" in found["elapsed_unsynced"]
    assert found["elapsed"] > found["synced"] / 5, found  # the events timed the kernels, not their launch


READS = SETUP + """
y = (a @ b) @ b
found["read"] = y.cpu()[0, :4].tolist()  # no synchronize: the copy to the CPU waits for the stream
found["item"] = ((a @ b) @ b)[0, 0].item()
torch.fgpu.synchronize()
found["after_synchronize"] = y.cpu()[0, :4].tolist()
side, ready = torch.fgpu.Stream(), torch.fgpu.Event()  # made first: the race below is the read alone
side.synchronize()
y = a
for _ in range(6):  # about 0.3 s of queued products on one core
    y = y @ b
ready.record()
with torch.fgpu.stream(side):
    early = y[0, :4] * 1  # on the side stream, not ordered after the matmuls
side.wait_event(ready)
with torch.fgpu.stream(side):
    late = y[0, :4] * 1
side.synchronize()
found["side"] = [early.cpu().tolist(), late.cpu().tolist(), y.cpu()[0, :4].tolist()]
print(json.dumps(found))
"""


def test_a_host_read_waits_for_the_stream_and_another_stream_only_for_an_event(tmp_path):
    found = run_emulated(tmp_path, READS)
    assert found["read"] == found["after_synchronize"]
    assert found["item"] == found["after_synchronize"][0]
    early, late, y = found["side"]
    assert late == y
    assert early != late  # read before the kernels wrote y: memory nobody has written yet


FREED = SETUP + """
def read_on_side_stream(record: bool):
    x = torch.ones(1200, 1200, device=dev)
    side = torch.fgpu.Stream()
    side.wait_stream(torch.fgpu.current_stream())
    with torch.fgpu.stream(side):
        busy = (a @ b) @ b  # keeps the side stream busy while the host frees x
        if record:
            x.record_stream(side)
        y = x @ torch.eye(1200, device=dev)
    before = torch.fgpu.memory_allocated(0)
    del x
    freed = before - torch.fgpu.memory_allocated(0)
    torch.fgpu.current_stream().wait_stream(side)
    torch.fgpu.synchronize()
    return {"values": y[0, :3].tolist(), "freed_at_del": freed, "freed_in_all": before - torch.fgpu.memory_allocated(0)}

found["without"], found["with"] = read_on_side_stream(False), read_on_side_stream(True)
print(json.dumps(found))
"""


def test_a_tensor_freed_while_another_stream_reads_it_is_reused_unless_recorded_there(tmp_path):
    found = run_emulated(tmp_path, FREED)
    x_bytes = 1200 * 1200 * 4
    assert str(found["without"]["values"]) == "[nan, nan, nan]"  # its memory handed out again, and overwritten
    assert found["without"]["freed_at_del"] == x_bytes
    assert found["with"]["values"] == [1.0, 1.0, 1.0]
    assert found["with"]["freed_at_del"] == 0  # record_stream: freed once the side stream has run its reads
    assert found["with"]["freed_in_all"] == x_bytes


WORK_WAIT = """
import json, time, torch, torch.distributed as dist, parakit

def ranks():
    rank, dev = dist.get_rank(), parakit.device()
    t, eye = torch.full((64, 64), float(rank + 1), device=dev), torch.eye(64, device=dev)
    if rank == 1:
        time.sleep(1.0)  # rank 0's all-reduce waits for rank 1 this long
    work = dist.all_reduce(t, async_op=True)
    start = time.perf_counter()
    work.wait()
    waited = time.perf_counter() - start
    side = torch.fgpu.Stream()
    with torch.fgpu.stream(side):
        early = t @ eye  # the side stream does not wait for the all-reduce
    after = t @ eye  # the current stream does
    torch.fgpu.current_stream().wait_stream(side)
    return {"waited": waited, "early": early[0, 0].item(), "after": after[0, 0].item()}

print(json.dumps(parakit.launch(ranks, world_size=2)[0]))
"""


def test_work_wait_orders_the_current_stream_and_returns_at_once_as_on_nccl(tmp_path):
    found = run_emulated(tmp_path, WORK_WAIT)
    assert found["waited"] < 1.0 / 5, found  # rank 1 posted its all-reduce 1 s later
    assert found["after"] == 3.0  # 1 + 2: read after the all-reduce
    assert found["early"] == 1.0  # rank 0's own value: read before the all-reduce arrived


PARAKITS_CLOCKS = SETUP + """
import torch.distributed as dist
from parakit import checkpoint, side_by_side
small = torch.randn(8, 8, device=dev)  # products under 2^24 FLOP stay queued until the host waits
weight = torch.randn(8, 8, device=dev, requires_grad=True)

def product(x):
    weight.grad = None  # backward ends with the product for weight's gradient, which it then only assigns
    return x @ weight

found["step_time_waits"] = (checkpoint.step_time(product, small, repeats=1), torch.fgpu.current_stream().query())[1]
dist.init_process_group("fnccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device(dev))
found["measure_waits"] = (side_by_side.measure(product, small, memory=False), torch.fgpu.current_stream().query())[1]
product(small).sum().backward()
found["unwaited_product_queued"] = not torch.fgpu.current_stream().query()  # what the two would leave without their wait
torch.fgpu.synchronize()
dist.destroy_process_group()
print(json.dumps(found))
"""


def test_parakits_own_clocks_stop_when_the_device_has_run_the_work(tmp_path):
    """checkpoint.step_time and side_by_side.measure synchronise the device before they read the
    clock: each leaves no queued work behind, where a bare product leaves its kernel queued."""
    found = run_emulated(tmp_path, PARAKITS_CLOCKS)
    assert found == {"step_time_waits": True, "measure_waits": True, "unwaited_product_queued": True}, found
