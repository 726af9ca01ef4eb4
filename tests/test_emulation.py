"""The emulated GPU box (parakit.emulation): fgpu devices that refuse to mix as CUDA does, and
an NCCL that refuses what NCCL refuses and stops where NCCL would hang.

The model of NCCL's streams is tested as data; the rest in real processes, each test a fresh
interpreter with PARAKIT_EMULATE_GPUS=4 (the emulation is for a whole process, as a GPU box is).
"""
from __future__ import annotations

import json

import pytest

from conftest import run_script
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
w = torch.randn(3, 3, device="fgpu:2", requires_grad=True)
(w ** 2).sum().backward()
found["grad"] = [str(w.grad.device), torch.equal(w.grad.cpu(), 2 * w.detach().cpu())]
before = torch.fgpu.memory_allocated(3)
y = torch.empty(1000, device="fgpu:3")
found["memory"] = [torch.fgpu.memory_allocated(3) - before]
del y
found["memory"].append(torch.fgpu.memory_allocated(3) - before)
found["pickled"] = str(pickle.loads(pickle.dumps(x)).device)
print(json.dumps(found))
"""


def test_fgpu_tensors_refuse_to_mix_devices_as_cuda_does(tmp_path):
    found = run_emulated(tmp_path, DEVICE_CHECKS)
    assert found["device"] == "fgpu:1" and found["view_shares_storage"]
    assert "Expected all tensors to be on the same device, but found at least two devices, fgpu:1 and cpu" in found["cpu"]
    assert "fgpu:1 and fgpu:2" in found["other_index"]
    assert "fgpu:4: invalid device ordinal: this box has 4 emulated GPUs" in found["no_such_device"]
    assert found["cpu_scalar"] == [3.0, 3.0, 3.0] and found["cpu_indices"] == "fgpu"
    assert found["grad"] == ["fgpu:2", True]
    assert found["memory"] == [4000, 0]
    assert found["pickled"] == "fgpu:1"


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
    assert "rank 0 waits for its irecv from rank 1" in text and "rank 1 has returned from the launched function" in text


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
