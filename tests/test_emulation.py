"""The emulated GPU box (parakit.emulation): fgpu devices that refuse to mix as CUDA does."""
from __future__ import annotations

import json

from conftest import run_script

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
    done = run_script(tmp_path, DEVICE_CHECKS)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["device"] == "fgpu:1" and found["view_shares_storage"]
    assert "Expected all tensors to be on the same device, but found at least two devices, fgpu:1 and cpu" in found["cpu"]
    assert "fgpu:1 and fgpu:2" in found["other_index"]
    assert "fgpu:4: invalid device ordinal: this box has 4 emulated GPUs" in found["no_such_device"]
    assert found["cpu_scalar"] == [3.0, 3.0, 3.0] and found["cpu_indices"] == "fgpu"
    assert found["grad"] == ["fgpu:2", True]
    assert found["memory"] == [4000, 0]
    assert found["pickled"] == "fgpu:1"
