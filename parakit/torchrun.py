"""How a real job starts: torchrun's environment, and torchrun run from a notebook.

torchrun (`python -m torch.distributed.run`) starts `--nproc-per-node` copies of a script
on each node and gives each its place in the environment: RANK (0..WORLD_SIZE-1 over all
nodes), LOCAL_RANK (its index on this node, which picks its GPU), WORLD_SIZE,
LOCAL_WORLD_SIZE, and MASTER_ADDR/MASTER_PORT, where rank 0's store listens. A script joins
with `dist.init_process_group(backend)`, whose default init_method "env://" reads exactly
those variables, and leaves with `dist.destroy_process_group()`:

    with process_group():          # in a script run by torchrun, or on parakit.launch's ranks
        ...

`run("script.py", 2)` runs a script under torchrun from a notebook cell and shows its output.
"""
from __future__ import annotations

import contextlib
import gc
import os
import shlex
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from parakit import devices

__all__ = ["process_group", "node_backend", "run"]


def node_backend(backend: str, local_world_size: int, gpus: int, nccl_built: bool) -> str:
    """The backend for a node running `local_world_size` ranks with `gpus` GPUs: NCCL needs one
    GPU per rank on the node (torchrun's LOCAL_WORLD_SIZE); "auto" falls back to gloo, "nccl" is refused."""
    try:
        return devices.select_backend(backend, local_world_size, gpus, nccl_built)
    except ValueError as error:
        raise ValueError(f"on this node (LOCAL_WORLD_SIZE={local_world_size}): {error}") from None


@contextlib.contextmanager
def process_group(backend: str = "auto"):
    """The default process group for the block. Where none exists (a script under torchrun),
    join one from the environment (env://) with `backend` ("auto": NCCL when this node has a
    GPU for each of its ranks; else gloo) under `parakit.devices`' rule (each NCCL rank on
    GPU LOCAL_RANK, passed as device_id) and destroy it after; where one exists
    (parakit.launch's ranks), use it as it is."""
    if dist.is_initialized():
        yield
        return
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    try:
        chosen = devices.resolve_backend(backend, local_world_size)
    except ValueError as error:
        raise ValueError(f"on this node (LOCAL_WORLD_SIZE={local_world_size}): {error}") from None
    devices.join(chosen, int(os.environ.get("LOCAL_RANK", 0)))
    try:
        yield
    finally:
        gc.collect()  # objects holding the group (DDP's reducer, its buckets) go first, then every rank
        dist.barrier()  # leaves together: gloo aborts a process now and then when a peer tears down mid-exchange
        dist.destroy_process_group()


def run(script, nproc_per_node: int = 2, *script_args: str, timeout: float = 300) -> str:
    """Run `torchrun --standalone --nproc-per-node N script args` (as `python -m
    torch.distributed.run`, which is what the `torchrun` command runs) and print and return
    its output; raise RuntimeError with that output if it fails or takes longer than `timeout` s."""
    if not Path(script).is_file():
        raise FileNotFoundError(f"no script at {Path(script).resolve()}: run the %%writefile cell that writes it first")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc_per_node}",
               str(script), *map(str, script_args)]
    print("$ torchrun " + shlex.join(command[3:]), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as error:
        raise RuntimeError(f"torchrun did not finish in {timeout} s; its output:\n{error.stdout or ''}{error.stderr or ''}") from None
    output = done.stdout + _without_noise(done.stderr)
    print(output, end="")
    if done.returncode != 0:
        raise RuntimeError(f"torchrun exited with {done.returncode}: see its output above")
    return output


def _without_noise(stderr: str) -> str:
    """torchrun's stderr without its OMP_NUM_THREADS banner (it prints it on every start)."""
    return "".join(line for line in stderr.splitlines(keepends=True)
                   if "OMP_NUM_THREADS" not in line and not set(line.strip()) <= {"*"})
