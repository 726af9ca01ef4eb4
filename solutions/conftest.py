"""nbval runs every solution notebook on the emulated GPU box (parakit.emulation): 4 GPUs and
NCCL's rules, or as many as PARAKIT_EMULATE_GPUS says (set it empty for gloo and the CPU).
Each notebook also runs top to bottom on gloo, in tests/test_pipeline.py's validate: 160 s
for all 11 under nbval on gloo, 286 s emulated, on this 2-core machine.

A cell tagged "not-emulated" is skipped here, for what the emulation cannot do:
- 02_ddp, PyTorch's DDP with find_unused_parameters=True: its reducer copies the map of used
  parameters through pinned host memory, which a device served from Python cannot allocate
  (PyTorch: "implement `getPinnedMemoryAllocator` ... for PrivateUse1"). The GPU suite runs
  the notebook whole on NCCL (tests/test_gpu.py).
"""
from __future__ import annotations

import os

import pytest

from parakit.emulation import ENV

TAG = "not-emulated"
SET = []  # ENV, while this file set it for a cell


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before nbval starts a notebook's kernel (in its first cell's setup): the kernel, and the
    ranks it launches, inherit the emulated box."""
    if ENV not in os.environ:
        os.environ[ENV] = "4"
        SET.append(ENV)
    if os.environ[ENV] and TAG in getattr(item, "cell", {}).get("metadata", {}).get("tags", []):
        pytest.skip(f"tagged {TAG}: the emulation cannot run it (solutions/conftest.py says why)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After each cell (and the kernel's shutdown after the last), the environment as it was."""
    try:
        return (yield)
    finally:
        while SET:
            os.environ.pop(SET.pop(), None)
