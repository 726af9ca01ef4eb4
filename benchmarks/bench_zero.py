"""ZeRO: parakit's ShardedOptimizer (stages 1 and 2) against torch's DDP + ZeroRedundancyOptimizer,
and parakit's FullyShardedDataParallel against torch's FSDP2 (`fully_shard`), on the same
model, data and AdamW, in fp32 and in bf16.

    .venv/bin/python benchmarks/bench_zero.py [--ranks 4] [--layers 4] [--hidden 512] [--steps 30] [--warmup 3]

On N gloo ranks, a stack of Linear(hidden, hidden) + ReLU layers (each layer a unit for the
FSDPs), a batch of 16 rows per rank. One launch per stage and precision builds parakit's and
torch's versions on the same ranks and times their steps interleaved (parakit, torch, parakit's
variant, parakit, torch, ...; a barrier before every step; `--warmup` rounds untimed, then
`--steps`): a step's time is its slowest rank's; the table gives each median, parakit's median
over torch's, and the quartiles of the per-round ratios (how much the pairs scatter).

bf16: parakit's ShardedOptimizer with compute_dtype=torch.bfloat16 (bf16 parameters, fp32
masters of the owned ones; the input cast to bf16) reducing the gradients in fp32, as torch
sums them, and beside it with reduce_dtype=None (bf16 gradients on the wire); torch's DDP over
the fp32 model with the forward under torch.autocast("cpu", torch.bfloat16) and
ZeroRedundancyOptimizer(AdamW). Stage 3: parakit's FullyShardedDataParallel(compute_dtype=bf16)
against fully_shard with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32). fp32:
fully_shard without a policy; ShardedOptimizer's other gradient collective (reduce-scatter,
where gloo's default is all-reduce) beside it.

Memory, each version measured on its own: the peak bytes a rank holds during its steps 2 to 6,
every allocation and free the CPU allocator saw since that version's model was built, on any
thread (see every_thread_counted), read from torch.profiler with profile_memory (which also sees buffers kept inside torch's DDP and FSDP2
and storages resized in place), parakit's over torch's; the bytes of parameters, gradients and
optimizer state (fp32 masters included) each rank holds after its last step (local shards
walked for both), over torch's and over the ZeRO paper's row (fp32: 4 + 4 + K = 8; bf16 the
paper's mixed precision: 2 + 2 + K = 12; parakit's ZeRO-3 keeps fp32 shards as the masters,
4 + 4 + 8, the same total); parakit's peak of parameters, gradients and state from
zero.HeldBytesPeak. The load average before and after. The issue's bars are marked PASS or
FAIL; nothing is asserted.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import parakit
from parakit import zero

SETUPS = ["DDP + AdamW", "ZeRO-1", "ZeRO-2", "ZeRO-3"]  # the first is torch's DDP alone: the reference row
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
PEAK_STEPS = 5  # the peak is the largest over steps 2 to 6: when a gloo thread frees a buffer varies from step to step
THEIRS = {0: "DDP", 1: "ZeroRedundancyOptimizer", 2: "ZeroRedundancyOptimizer", 3: "fully_shard"}


def versions(stage: int, dtype) -> list[tuple[str, bool, dict]]:
    """(name, parakit's?, options) of each version timed in one launch: the compared pair first."""
    if stage == 0:
        return [("torch DDP" + (" + autocast" if dtype else ""), False, {})]
    fp32_sums = {"reduce_dtype": torch.float32} if dtype and stage < 3 else {}
    pair = [("parakit" + (", fp32 reduce" if fp32_sums else ""), True, fp32_sums), (f"torch {THEIRS[stage]}", False, {})]
    if stage == 3:
        return pair
    if dtype:
        return pair + [("parakit, bf16 reduce", True, {"reduce_dtype": None})]
    return pair + [("parakit, reduce_scatter", True, {"gradient_collective": "reduce_scatter"})]


def build(stage: int, ours: bool, layers: int, hidden: int, dtype, options: dict):
    """The model, optimizer and one training step(x, y) of parakit's or torch's ZeRO-`stage`
    (0: torch's DDP) in fp32 (dtype None) or mixed precision."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(layers)])
    if stage == 3 and ours:  # casts the inputs itself
        model = zero.FullyShardedDataParallel(net, units=list(net), compute_dtype=dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, optimizer, functools.partial(train_step, model, optimizer, finish=model.finish_gradient_synchronization)
    if stage == 3:  # MixedPrecisionPolicy casts the root's inputs
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for unit in [*net, net]:
            fully_shard(unit, mesh=mesh, mp_policy=policy)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        return net, optimizer, functools.partial(train_step, net, optimizer)
    if ours:
        optimizer = zero.ShardedOptimizer(net.parameters(), torch.optim.AdamW, stage=stage, lr=1e-3,
                                          compute_dtype=dtype, **options)
        return net, optimizer, functools.partial(train_step, net, optimizer, cast=dtype)
    model = DistributedDataParallel(net)
    optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-3) if stage == 0 else
                 ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3))
    return model, optimizer, functools.partial(train_step, model, optimizer, autocast=dtype)


def train_step(model, optimizer, x, y, cast=None, autocast=None, finish=None) -> None:
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", torch.bfloat16 if autocast is None else autocast, enabled=autocast is not None):
        out = model(x if cast is None else x.to(cast))
    F.mse_loss(out.float(), y).backward()
    if finish is not None:
        finish()
    optimizer.step()


def local_bytes(tensors) -> int:
    """Bytes of this rank's part of each tensor (a DTensor's local shard), each storage once."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local}.values())


def at_rest(model, optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state (with parakit's fp32 masters) this rank holds."""
    state = getattr(optimizer, "optim", optimizer).state  # ZeroRedundancyOptimizer keeps its shard in .optim
    masters = optimizer.master_params() if hasattr(optimizer, "master_params") else []
    params = list(model.parameters())
    return {"parameters": local_bytes(params), "gradients": local_bytes([p.grad for p in params if p.grad is not None]),
            "optimizer": local_bytes([t for s in state.values() for t in s.values() if isinstance(t, torch.Tensor)]
                                     + masters)}


@contextlib.contextmanager
def every_thread_counted():
    """Have torch's CPU allocator keep its running total of live bytes on every thread. The
    profiler hears only of allocations and frees on the threads it profiles: gloo's threads drop
    the last reference to a buffer (a bucket held by its Work) as often as the main thread, and
    such a free went unseen (the peak read 4 Psi bytes, one fp32 bucket, higher in some runs).
    With c10's caffe2_report_cpu_memory_usage flag the total (`total_allocated` of each event)
    counts every thread's; kineto's profiler_start/stop lines on fd 2 are silenced."""
    flag = ctypes.c_bool.in_dll(ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")),
                                "FLAGS_caffe2_report_cpu_memory_usage")
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    flag.value = True
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        flag.value = False
        os.close(saved)
        os.close(null)


def allocated_peak(profiler, window: str) -> int:
    """The most bytes alive at once during the record_function `window`, counting every
    allocation and free the CPU allocator saw, on any thread, since `profiler` started (under
    every_thread_counted: the allocator's total at each event the profiler recorded, less the
    total before its first)."""
    nodes, marked = list(profiler.profiler.kineto_results.experimental_event_tree()), None
    totals = []
    while nodes:
        node = nodes.pop()
        nodes += node.children
        if node.tag == torch._C._profiler._EventType.Allocation:
            totals.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.total_allocated))
        elif node.name == window:
            marked = node
    totals.sort()
    before = totals[0][2] - totals[0][1]
    return max(total - before for start, _, total in totals if marked.start_time_ns <= start <= marked.end_time_ns)


def on_ranks(stage, dtype, layers, hidden, steps, warmup):
    """Each version built and stepped 1 + PEAK_STEPS times under its own profiler (its peak during
    the steps after the first), then all of them stepped in turn (`warmup` rounds, then `steps` timed): per version,
    the step times, the bytes held after the last step and (parakit's) zero.HeldBytesPeak's peak."""
    x, y = torch.randn(16, hidden), torch.randn(16, hidden)
    built, peaks = {}, {}
    for name, ours, options in versions(stage, dtype):
        gc.collect()  # nothing allocated before this profiler is freed inside it
        dist.barrier()
        with every_thread_counted(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                            profile_memory=True) as profiled:
            built[name] = build(stage, ours, layers, hidden, dtype, options)
            built[name][2](x, y)  # creates the optimizer state
            with torch.profiler.record_function("later steps"):
                for _ in range(PEAK_STEPS):
                    built[name][2](x, y)
        peaks[name] = allocated_peak(profiled, "later steps")
    times = {name: [] for name in built}
    for round_ in range(warmup + steps):
        for name, (_, _, step) in built.items():
            dist.barrier()
            start = time.perf_counter()
            step(x, y)
            if round_ >= warmup:
                times[name].append(time.perf_counter() - start)
    rest = {name: at_rest(model, optimizer) for name, (model, optimizer, _) in built.items()}
    walked = {}
    for name, ours, _ in versions(stage, dtype):
        if ours:  # one more step, metered (the meter samples before and after every op: not timed)
            model, optimizer, step = built[name]
            with zero.HeldBytesPeak(model, optimizer) as meter:
                step(x, y)
            walked[name] = meter.peak_total
    return times, rest, peaks, walked


def mark(ok):
    return "PASS" if ok else "FAIL"


def measure(stage, dtype, options, n, psi):
    """One launch: a table row per version, and the exact checks."""
    results = parakit.launch(on_ranks, stage, dtype, options.layers, options.hidden, options.steps, options.warmup,
                             world_size=n, timeout=600)
    names = [name for name, _, _ in versions(stage, dtype)]
    step = {name: [max(r[0][name][k] for r in results) for k in range(options.steps)] for name in names}  # slowest rank
    theirs = names[1] if stage else names[0]
    paper = sum(zero.zero_bytes(psi, n, stage, k=12 if dtype else 8, param_bytes=2 if dtype else 4,
                                grad_bytes=2 if dtype else 4).values())
    rows, checks = [], []
    for i, name in enumerate(names):
        median = statistics.median(step[name])
        held = max(sum(r[1][name].values()) for r in results)
        peak = max(r[2][name] for r in results)
        row = {"name": f"ZeRO-{stage} {name}" if stage else name, "ms": f"{median * 1e3:.1f}",
               "peak": f"{peak:,}", "held": f"{held:,}", "paper": f"{held / paper:.3f}",
               "walked": f"{max(r[3][name] for r in results):,}" if name in results[0][3] else ""}
        if name != theirs:
            ratio = median / statistics.median(step[theirs])
            pairs = statistics.quantiles([a / b for a, b in zip(step[name], step[theirs])], n=4)
            peak_ratio = peak / max(r[2][theirs] for r in results)
            row.update({"x": f"{ratio:.2f}", "pairs": f"{pairs[0]:.2f}-{pairs[2]:.2f}", "peak x": f"{peak_ratio:.2f}",
                        "held x": f"{held / max(sum(r[1][theirs].values()) for r in results):.2f}",
                        "time bar": mark(ratio <= 1.10) if i == 0 else "(beside)",
                        "peak bar": mark(peak_ratio <= 1.00) if i == 0 else "(beside)"})
        rows.append(row)
    ours, k = names[0], 12 if dtype else 8
    if stage == 1:  # the state (and masters) of whole parameters: off by at most the largest parameter's
        largest = k * options.hidden ** 2 + 4
        off = max(abs(r[1][ours]["optimizer"] - (k * psi + 8 * options.layers) / n) for r in results)
        checks.append((f"ZeRO-1 optimizer state per rank - (K = {k}) total/N", f"{off:,.0f}", f"<= {largest:,}",
                       mark(off <= largest)))
    if stage == 3:  # fp32 shards in both precisions
        off = max(r[1][ours]["parameters"] - 4 * psi / n for r in results)
        checks.append(("ZeRO-3 parameter bytes at rest - 4 Psi/N", f"{off:,.0f}", f"< {4 * options.layers * n}",
                       mark(0 <= off < 4 * options.layers * n)))
    return rows, checks


COLUMNS = [("name", "version", "<"), ("ms", "step ms", ">"), ("x", "/ torch", ">"), ("pairs", "pairs q1-q3", ">"),
           ("time bar", "<= 1.10", ">"), ("peak", "peak bytes", ">"), ("peak x", "/ torch", ">"),
           ("peak bar", "<= 1.00", ">"), ("walked", "parakit's walk", ">"), ("held", "held at rest", ">"),
           ("held x", "/ torch", ">"), ("paper", "/ paper", ">")]


def print_table(rows) -> None:
    widths = [max(len(title), *(len(r.get(key, "")) for r in rows)) for key, title, _ in COLUMNS]
    print("  " + "  ".join(f"{title:{align}{w}}" for (_, title, align), w in zip(COLUMNS, widths)))
    for r in rows:
        print("  " + "  ".join(f"{r.get(key, ''):{align}{w}}" for (key, _, align), w in zip(COLUMNS, widths)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30, help="timed rounds (each version one step per round)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    options = parser.parse_args()
    load_before = os.getloadavg()
    n, psi = options.ranks, options.layers * (options.hidden + 1) * options.hidden
    tables = {}
    for precision, dtype in PRECISIONS.items():
        tables[precision] = [measure(stage, dtype, options, n, psi) for stage in range(len(SETUPS))]
    print("load average (1, 5, 15 min) before: " + ", ".join(f"{v:.2f}" for v in load_before))
    print(f"ZeRO on {n} gloo ranks, {options.layers} x Linear({options.hidden}), Psi = {psi:,}, AdamW -- torch "
          f"{torch.__version__}, {os.cpu_count()} CPU cores; {options.steps} rounds interleaved after {options.warmup} "
          f"untimed, median step of the slowest rank; bytes per rank, max over ranks")
    for precision, measured in tables.items():
        print(f"\n{precision}" + (": parakit compute_dtype=bf16 + fp32 masters; torch autocast(bf16) / "
                                  "MixedPrecisionPolicy(bf16, reduce fp32); paper = 2 + 2 + K=12" if PRECISIONS[precision]
                                  else ": paper = 4 + 4 + K=8"))
        print_table([row for rows, _ in measured for row in rows])
    checks = [(f"{precision}: {name}", *rest) for precision, measured in tables.items()
              for _, found in measured for name, *rest in found]
    print()
    width = max(len(c[0]) for c in checks)
    for name, value, bar, verdict in checks:
        print(f"  {name:<{width}}  {value:>10}  {bar:>12}  {verdict}")
    print("load average (1, 5, 15 min) after: " + ", ".join(f"{v:.2f}" for v in os.getloadavg())
          + " (2 cores shared: above 2, the times are not to be trusted)")


if __name__ == "__main__":
    main()
