"""Pinned host memory on the emulated GPU box (parakit/emulation/native.cpp, fgpu's C++ hooks):
CPU tensors that say they are pinned, as on a CUDA box, so that what PyTorch's C++ pins (DDP's
reducer with find_unused_parameters=True, DCP's copies to the host) runs there; without a
compiler to build the hooks, the box runs without it and says why. Each test a fresh
interpreter with PARAKIT_EMULATE_GPUS=4, as in test_emulation.py.
"""
from __future__ import annotations

from parakit.emulation import native
from test_emulation import run_emulated

PINNING = """
import json, torch
from parakit import emulation
emulation.install(4)
pinned = torch.arange(6.0).pin_memory()
inside = torch._C._construct_storage_from_data_pointer(pinned.data_ptr() + 20, torch.device("cpu"), 4)
past = torch._C._construct_storage_from_data_pointer(pinned.data_ptr() + 24, torch.device("cpu"), 4)

def is_pinned(storage):
    return torch.empty(0, dtype=torch.uint8).set_(storage).is_pinned()

found = {"pinned": [pinned.is_pinned(), str(pinned.device), pinned.tolist()], "again": pinned.pin_memory() is pinned,
         "inside": is_pinned(inside), "past_the_end": is_pinned(past),
         "plain": [torch.ones(3).is_pinned(), torch.ones(3, device="fgpu:1").is_pinned()],
         "empty": [torch.empty(2, pin_memory=True).is_pinned(), torch.empty(0, pin_memory=True).is_pinned()],
         "to_fgpu": pinned.to("fgpu:2", non_blocking=True).cpu().tolist(),
         "loader": [batch.is_pinned() for batch in torch.utils.data.DataLoader(torch.arange(8.0), batch_size=4,
                                                                               pin_memory=True)]}
freed = torch.empty(4, pin_memory=True)
address = freed.data_ptr()
del freed
found["freed"] = is_pinned(torch._C._construct_storage_from_data_pointer(address, torch.device("cpu"), 4))
print(json.dumps(found))
"""


def test_pinned_cpu_tensors_are_pinned_over_their_whole_block_until_freed_as_on_cuda(tmp_path):
    found = run_emulated(tmp_path, PINNING)
    assert found["pinned"] == [True, "cpu", [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]
    assert found["again"] is True  # pinning a pinned tensor returns it
    assert (found["inside"], found["past_the_end"], found["freed"]) == (True, False, False)
    assert found["plain"] == [False, False]
    assert found["empty"] == [True, False]  # no bytes, no block: as CUDA's host allocator
    assert found["to_fgpu"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert found["loader"] == [True, True]


UNUSED_HEAD = """
import json, parakit, torch, torch.distributed as dist

class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head0, self.head1 = torch.nn.Linear(6, 8), torch.nn.Linear(8, 2), torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.head0(torch.relu(self.body(x)))  # head1 never used

def train(model, x, y, steps=3):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return model

def on_ranks(model, x, y):
    rank = dist.get_rank()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[parakit.device()], find_unused_parameters=True)
    train(ddp, x[4 * rank: 4 * rank + 4], y[4 * rank: 4 * rank + 4])
    return [p.detach() for p in model.parameters()], model.head1.weight.grad is None

torch.manual_seed(0)
model, x, y = TwoHeads(), torch.randn(8, 6), torch.randn(8, 2)
ranks = parakit.launch(on_ranks, model, x, y, world_size=2)
reference = [p.detach() for p in train(model, x, y).parameters()]
print(json.dumps({"apart": [max((a - b).abs().max().item() for a, b in zip(params, reference)) for params, _ in ranks],
                  "head1_no_grad": [none for _, none in ranks],
                  "head1_kept": [torch.equal(params[-1], reference[-1]) for params, _ in ranks]}))
"""


def test_ddp_with_find_unused_parameters_trains_on_two_emulated_gpus_as_one_process_does(tmp_path):
    found = run_emulated(tmp_path, UNUSED_HEAD)
    # 1e-5: the two ranks' mean of halves against one process's mean of the whole batch, in fp32 (a few ulps)
    assert all(apart <= 1e-5 for apart in found["apart"]), found["apart"]
    assert found["head1_no_grad"] == [True, True]
    assert found["head1_kept"] == [True, True]


SAVES = """
import json, os, parakit, torch, torch.distributed as dist

def saved_and_loaded(root, weight):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh(parakit.device().type, (2,))

    def state(w):
        return {"weight": distribute_tensor(w, mesh, [Shard(0)]), "step": torch.full((), 7.0, device=parakit.device())}

    dcp.save(state(weight), checkpoint_id=f"{root}/blocking")  # fgpu to CPU with non_blocking=True: into pinned memory
    pinned_cache = dcp.FileSystemWriter(f"{root}/async", cache_staged_state_dict=True)  # staged once into pinned memory
    dcp.async_save(state(weight), storage_writer=pinned_cache, process_group=dist.new_group(backend="gloo")).result()
    found = []
    for name in ("blocking", "async"):
        back = state(torch.zeros_like(weight))
        dcp.load(back, checkpoint_id=f"{root}/{name}")
        found.append([torch.equal(back["weight"].full_tensor().cpu(), weight.cpu()), back["step"].item(),
                      str(back["weight"].device)])
    return found

weight = torch.randn(4, 3)
print(json.dumps(parakit.launch(saved_and_loaded, os.path.abspath("checkpoints"), weight, world_size=2)))
"""


def test_dcp_save_and_async_save_with_a_pinned_cache_on_emulated_gpus_load_back_equal(tmp_path):
    assert run_emulated(tmp_path, SAVES) == [[[True, 7.0, f"fgpu:{rank}"]] * 2 for rank in range(2)]


NO_COMPILER = """
import json, os
os.environ["CXX"] = "no-such-compiler"
import torch
from parakit import emulation
from parakit.emulation import native
emulation.install(4)
try:
    torch.ones(2).pin_memory()
    pinned = "no error"
except RuntimeError as error:
    pinned = str(error)
print(json.dumps({"reason": native.unavailable(), "pinned": pinned,
                  "computes": (torch.ones(2, device="fgpu:1") * 2).cpu().tolist()}))
"""


def test_without_a_compiler_the_emulated_box_runs_without_pinned_memory_and_says_why(tmp_path):
    found = run_emulated(tmp_path, NO_COMPILER)
    assert found["reason"] == (f"pinned memory is not emulated: no C++ compiler 'no-such-compiler' to build "
                               f"{native.SOURCE} (install g++, or set CXX to a C++ compiler)")
    assert "implement `getPinnedMemoryAllocator` at the same time for PrivateUse1" in found["pinned"]
    assert found["computes"] == [2.0, 2.0]
