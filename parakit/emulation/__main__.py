"""Run pytest on the emulated box: every solution notebook under nbval by default.

    .venv/bin/python -m parakit.emulation                       # 4 GPUs, pytest solutions/
    .venv/bin/python -m parakit.emulation --gpus 8 tests/test_ddp.py -x

PARAKIT_EMULATE_GPUS is set for pytest and everything it starts (the notebooks' kernels,
their ranks), so each lesson runs as on a box with that many GPUs and NCCL.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

from parakit.emulation import ENV


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parakit.emulation", description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=4, help="how many GPUs to emulate (default 4)")
    options, pytest_args = parser.parse_known_args(argv)
    env = {**os.environ, ENV: str(options.gpus)}
    return subprocess.call([sys.executable, "-m", "pytest", *(pytest_args or ["solutions"])], env=env)


if __name__ == "__main__":
    sys.exit(main())
