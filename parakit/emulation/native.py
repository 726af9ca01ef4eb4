"""fgpu's C++ hooks (native.cpp): pinned host memory for the emulated GPUs, which PyTorch's
C++ asks the device's hooks for (DDP's reducer with find_unused_parameters=True, a copy to
the host with non_blocking=True as DCP's writer makes, `tensor.pin_memory()`,
`torch.empty(..., pin_memory=True)`, DataLoader(pin_memory=True)) and a backend served from
Python cannot give.

Built once per environment and torch with the C++ compiler ($CXX, or g++) into
<sys.prefix>/share/parakit (~/.cache/parakit where that cannot be written), under a file lock
so that processes starting together (pytest's workers, a launch's ranks) build it once;
`.ci/setup` builds it at set-up. Where it cannot be built, fgpu has no pinned memory (PyTorch
then raises "implement `getPinnedMemoryAllocator` ... for PrivateUse1") and `unavailable()`
says why, in one line.
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

__all__ = ["install", "unavailable", "library", "main"]

SOURCE = Path(__file__).with_name("native.cpp")


def install() -> bool:
    """Make native.cpp's hooks PrivateUse1's (call before fgpu's Python registration, which
    then keeps them); False where they cannot be built (`unavailable()` says why)."""
    if unavailable():
        return False
    return bool(ctypes.CDLL(str(library())).parakit_register_hooks())


@functools.cache
def unavailable() -> str | None:
    """None where the hooks are built (building them if they are not yet), else why not (a
    build that failed is not tried again: its reason is kept beside the library)."""
    path, failed, compiler = library(), library().with_suffix(".failed"), _compiler()
    if path.exists():
        return None
    if shutil.which(compiler) is None:
        return f"pinned memory is not emulated: no C++ compiler {compiler!r} to build {SOURCE} (install g++, or " \
               f"set CXX to a C++ compiler)"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name("build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait, then find its result
        if not path.exists() and not failed.exists():
            reason = _build(path, compiler)
            if reason:
                failed.write_text(f"pinned memory is not emulated: {compiler} could not build {SOURCE} ({reason}; "
                                  f"delete {failed} to try again)")
    return failed.read_text() if failed.exists() else None


def library() -> Path:
    """Where this source's hooks, built with this compiler against this torch, live."""
    made_of = [SOURCE.read_bytes(), torch.__version__.encode(), torch.__file__.encode(), _compiler().encode()]
    key = hashlib.sha1(b"\0".join(made_of)).hexdigest()[:12]
    folder = Path(sys.prefix, "share") if os.access(sys.prefix, os.W_OK) else Path.home() / ".cache"
    return folder / "parakit" / f"fgpu_hooks-{key}.so"


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def _build(path: Path, compiler: str) -> str | None:
    """Compile native.cpp into `path` (atomically); None, or the compiler's first error."""
    from torch.utils import cpp_extension
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    command = [compiler, "-O2", "-std=c++20", "-shared", "-fPIC", str(SOURCE), "-o", str(partial),
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               *(f"-I{p}" for p in cpp_extension.include_paths()),
               *(f"-L{p}" for p in cpp_extension.library_paths()),
               *(f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        return next((line for line in lines if "error" in line), lines[-1])
    os.replace(partial, path)
    return None


def main() -> None:
    """`python -m parakit.emulation.native` (.ci/setup runs it): build the hooks where they are
    not yet; print one line on them."""
    start, built = time.perf_counter(), library().exists()
    reason = unavailable()
    how = "found" if built else f"built in {time.perf_counter() - start:.1f} s"
    print(reason or f"fgpu's pinned memory: C++ hooks {how} ({library()})")


if __name__ == "__main__":
    main()
