#!/usr/bin/env bash
# The part of the GPU suite that fits ONE GPU: tests/test_gpu.py's tests whose ranks need a
# single GPU (world size 1 on NCCL, the host-side checks, lesson 01's notebook), and
# tests/test_gpu_one.py, what one GPU shows and the emulated box cannot (CUDA's kernels
# against the CPU's, CUDA's generators, the caching allocator's figures, context_parallel on
# one rank, DCP with pinned staging); those that need more GPUs are skipped by their marks,
# and CUDA_VISIBLE_DEVICES shows one GPU even on a bigger box. About 2 minutes on an H200,
# set-up aside.
#
#     bash tests/gpu_one.sh [more pytest arguments]
#
# Set-up first (.ci/setup installs the CUDA build of PyTorch where nvidia-smi lists a GPU),
# unless PARAKIT_PYTHON names an interpreter that already has parakit's requirements. With
# $OUT set, a summary of what ran (the machine, each test's outcome, the totals) goes to
# $OUT/gpu_one.txt, with the `gpu-figure:` lines test_gpu_one.py measured (for
# benchmarks/RESULTS.md). Exits with pytest's status.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
if [ -z "${PARAKIT_PYTHON:-}" ]; then
  bash .ci/setup || exit
fi
PY=${PARAKIT_PYTHON:-.venv/bin/python}
log=$(mktemp)
export PARAKIT_GPU_FIGURES=$(mktemp)
"$PY" -m pytest -m gpu -q --timeout 300 -rA tests/test_gpu.py tests/test_gpu_one.py "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ]; then
  {
    echo "tests/gpu_one.sh: pytest exited $status after $((SECONDS - start)) s, set-up included"
    nvidia-smi -L 2>&1 | head -8
    "$PY" -c 'import torch; n = torch.cuda.device_count()
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {n} GPU(s) visible to the tests"
      + (f": {torch.cuda.get_device_name(0)}" if n else ""))' 2>&1
    grep -E "^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) |^gpu: |[0-9]+ (passed|failed|skipped|errors?)" "$log"
    cat "$PARAKIT_GPU_FIGURES"
  } > "$OUT/gpu_one.txt"
fi
rm -f "$log" "$PARAKIT_GPU_FIGURES"
exit "$status"
