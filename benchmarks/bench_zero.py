"""ZeRO: parakit's ShardedOptimizer (stages 1 and 2) against torch's DDP + ZeroRedundancyOptimizer,
and parakit's FullyShardedDataParallel against torch's FSDP2 (`fully_shard`), on the same
model, data and AdamW.

    .venv/bin/python benchmarks/bench_zero.py [--ranks 4] [--layers 4] [--hidden 512] [--steps 5]

On N gloo ranks, a stack of Linear(hidden, hidden) + ReLU layers (each layer a unit for the
FSDPs), a batch of 16 rows per rank: the median step time of each (a barrier before every
step) and parakit's over torch's; the bytes of parameters, gradients and optimizer state each
rank holds after the step (local shards walked for both), parakit's over torch's; the peak
bytes a rank holds during its second step, for both: every allocation and free the CPU
allocator saw since the model was built, counted by torch.profiler with profile_memory (which
also sees buffers kept inside torch's DDP and FSDP2 and storages resized in place), parakit's
over torch's,
with parakit's peak of parameters, gradients and optimizer state from zero.HeldBytesPeak beside it;
parakit's bytes against the ZeRO table; ShardedOptimizer's other gradient collective (reduce-scatter, where
gloo's default is all-reduce) measured beside it; the load average before and after. The issue's bars are
marked PASS or FAIL; nothing is asserted.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import parakit
from parakit import zero

SETUPS = ["DDP + AdamW", "ZeRO-1", "ZeRO-2", "ZeRO-3"]  # the first is torch's DDP on both sides: the reference row


def local_bytes(tensors) -> int:
    """Bytes of this rank's part of each tensor (a DTensor's local shard), each storage once."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local}.values())


def build(setup: str, ours: bool, layers: int, hidden: int, collective=None):
    """The model and optimizer of `setup`, parakit's or torch's (`collective`: ShardedOptimizer's
    gradient_collective; None: its default for the backend)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(layers)])
    if setup == "ZeRO-3" and ours:
        model = zero.FullyShardedDataParallel(net, units=list(net))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    if setup == "ZeRO-3":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for unit in [*net, net]:
            fully_shard(unit, mesh=mesh)
        return net, torch.optim.AdamW(net.parameters(), lr=1e-3)
    if setup in ("ZeRO-1", "ZeRO-2") and ours:
        return net, zero.ShardedOptimizer(net.parameters(), torch.optim.AdamW, stage=int(setup[-1]), lr=1e-3,
                                          gradient_collective=collective)
    model = DistributedDataParallel(net)
    if setup == "DDP + AdamW":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)


def allocated_peak(profiler, window: str) -> int:
    """The most bytes alive at once during the record_function `window`, counting every
    allocation and free the CPU allocator saw since `profiler` started."""
    events = profiler.profiler.kineto_results.events()
    marked = next(e for e in events if e.name() == window)
    live, peak = 0, 0
    for start, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        live += nbytes
        if marked.start_ns() <= start <= marked.end_ns():
            peak = max(peak, live)
    return peak


def on_ranks(setup, ours, layers, hidden, steps, collective=None):
    """Step times, bytes held after the last step, the allocator's peak during the second
    step (everything allocated since the model was built counted), and parakit's peak of
    what zero.HeldBytesPeak walks."""
    x, y = torch.randn(16, hidden), torch.randn(16, hidden)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiled:
        model, optimizer = build(setup, ours, layers, hidden, collective)
        step_once(setup, ours, model, optimizer, x, y)  # creates the optimizer state
        with torch.profiler.record_function("second step"):
            step_once(setup, ours, model, optimizer, x, y)
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step_once(setup, ours, model, optimizer, x, y)
        times.append(time.perf_counter() - start)
    walked = None
    if ours:  # one more step, metered (the meter samples before and after every op: not timed)
        with zero.HeldBytesPeak(model, optimizer) as meter:
            step_once(setup, ours, model, optimizer, x, y)
        walked = meter.peak_total
    state = getattr(optimizer, "optim", optimizer).state  # ZeroRedundancyOptimizer keeps its shard in .optim
    params = list(model.parameters())
    rest = {"parameters": local_bytes(params), "gradients": local_bytes([p.grad for p in params if p.grad is not None]),
            "optimizer": local_bytes([t for s in state.values() for t in s.values() if isinstance(t, torch.Tensor)])}
    return times, rest, (allocated_peak(profiled, "second step"), walked)


def step_once(setup, ours, model, optimizer, x, y) -> None:
    optimizer.zero_grad(set_to_none=True)
    F.mse_loss(model(x), y).backward()
    if setup == "ZeRO-3" and ours:
        model.finish_gradient_synchronization()
    optimizer.step()


def mark(ok):
    return "PASS" if ok else "FAIL"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up)")
    options = parser.parse_args()
    load_before = os.getloadavg()[0]
    n, psi = options.ranks, options.layers * (options.hidden + 1) * options.hidden
    rows = []
    for stage, setup in enumerate(SETUPS):
        args = (options.layers, options.hidden, options.steps)
        ours = parakit.launch(on_ranks, setup, True, *args, world_size=n, timeout=600)
        theirs = ours if setup == "DDP + AdamW" else parakit.launch(on_ranks, setup, False, *args, world_size=n, timeout=600)
        step = [statistics.median(max(r[0][k] for r in results) for k in range(options.steps)) for results in (ours, theirs)]
        held = [max(sum(r[1].values()) for r in results) for results in (ours, theirs)]
        peak = [max(r[2][0] for r in results) for results in (ours, theirs)]
        formula = sum(zero.zero_bytes(psi, n, stage, k=8, param_bytes=4, grad_bytes=4).values())
        against = "itself" if setup == "DDP + AdamW" else ("fully_shard" if stage == 3 else "ZeroRedundancyOptimizer")
        rows += [(f"{setup}: parakit step", f"{step[0] * 1e3:10.1f} ms", "", ""),
                 (f"{setup}: parakit / torch ({against}) step time", f"{step[0] / step[1]:10.2f} x ", "", ""),
                 (f"{setup}: bytes held per rank at rest, parakit (max)", f"{held[0]:12,d}", "", ""),
                 (f"{setup}: ... parakit / torch", f"{held[0] / held[1]:10.2f} x ", "", ""),
                 (f"{setup}: ... parakit / ZeRO table (fp32, K = 8)", f"{held[0] / formula:10.3f} x ", "", ""),
                 (f"{setup}: peak bytes allocated per rank, parakit (max)", f"{peak[0]:12,d}", "", ""),
                 (f"{setup}: ... parakit / torch", f"{peak[0] / peak[1]:10.2f} x ", "", ""),
                 (f"{setup}: parakit peak of parameters, gradients, state", f"{max(r[2][1] for r in ours):12,d}", "", "")]
        if stage in (1, 2):
            rows += [(f"{setup}: step time / ZeroRedundancyOptimizer's", f"{step[0] / step[1]:10.2f} x ", "<= 1.10",
                      mark(step[0] <= 1.10 * step[1])),
                     (f"{setup}: peak bytes / ZeroRedundancyOptimizer's", f"{peak[0] / peak[1]:10.2f} x ", "<= 1.00",
                      mark(peak[0] <= peak[1]))]
            other = parakit.launch(on_ranks, setup, True, *args, "reduce_scatter", world_size=n, timeout=600)
            other_step = statistics.median(max(r[0][k] for r in other) for k in range(options.steps))
            rows += [(f"{setup} with reduce_scatter (gloo's): step / torch's", f"{other_step / step[1]:10.2f} x ", "", ""),
                     (f"{setup} with reduce_scatter (gloo's): peak / torch's",
                      f"{max(r[2][0] for r in other) / peak[1]:10.2f} x ", "", "")]
        if stage == 3:
            rows += [(f"{setup}: step time / fully_shard's", f"{step[0] / step[1]:10.2f} x ", "<= 1.10",
                      mark(step[0] <= 1.10 * step[1])),
                     (f"{setup}: peak bytes / fully_shard's", f"{peak[0] / peak[1]:10.2f} x ", "<= 1.00",
                      mark(peak[0] <= peak[1]))]
        if stage == 1:
            largest = 8 * options.hidden ** 2 + 4
            off = max(abs(r[1]["optimizer"] - (8 * psi + 8 * options.layers) / n) for r in ours)
            rows.append(("ZeRO-1 optimizer state per rank - total/N", f"{off:12,.0f}", f"<= {largest:,}", mark(off <= largest)))
        if stage == 3:
            off = max(r[1]["parameters"] - 4 * psi / n for r in ours)
            rows.append(("ZeRO-3 parameter bytes at rest - 4 Psi/N", f"{off:12,.0f}", f"< {4 * options.layers * n}",
                         mark(0 <= off < 4 * options.layers * n)))
    print(f"load average (1 min) before: {load_before:.2f}")
    print(f"ZeRO on {n} gloo ranks, {options.layers} x Linear({options.hidden}), Psi = {psi:,}, AdamW, fp32 -- torch "
          f"{torch.__version__}, {os.cpu_count()} CPU cores, median of {options.steps} steps")
    width = max(len(r[0]) for r in rows)
    for name, value, bar, verdict in rows:
        print(f"  {name:<{width}}  {value:>14}  {bar:>12}  {verdict}")
    print(f"load average (1 min) after: {os.getloadavg()[0]:.2f} (2 cores shared: above 2, the times are not to be trusted)")


if __name__ == "__main__":
    main()
