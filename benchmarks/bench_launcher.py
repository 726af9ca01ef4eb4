"""How fast `parakit.launch` gets a function and its tensors onto N ranks, against
torch.multiprocessing.spawn and a plain memory copy.

    .venv/bin/python benchmarks/bench_launcher.py [--calls 100] [--repeats 3] [--skip-1gb]

Measured, each on the same function (one all_reduce of a 4-float tensor):
  - a call on the warm pool, world size 2 and 4: p50 and p95 over --calls calls;
  - a cold pool at world size 4: from a fresh interpreter (its own forkserver, run in a
    subprocess; `import parakit` is timed apart), and with the forkserver already warm
    (after `parakit.shutdown()`); the median of --repeats starts each;
  - `torch.multiprocessing.spawn` at world size 4, each process doing init_process_group on
    a free port itself: the median of --repeats runs, and its ratio to the warm call.
Then the data path, at world size 4, the median of --repeats each:
  - a 1 MB, 100 MB and 1 GB float32 argument (each rank reads its first and last element),
    and a 100 MB result from each rank: `parakit.launch` on the warm pool, against
    `torch.multiprocessing.spawn` passing the same tensor (processes started for the call;
    a result comes back through a torch.multiprocessing queue), and against `clone()` of
    the same bytes (one copy for an argument, one per rank's result).
The bars are printed next to the figures with PASS or FAIL; nothing is asserted. The
figures are also written to benchmarks/results/bench_launcher.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import parakit

ROOT = Path(__file__).resolve().parents[1]


def one_all_reduce():
    """The benchmarked function: one small all_reduce, the result back to the caller."""
    t = torch.ones(4)
    dist.all_reduce(t)
    return t


def spawned(rank, world_size, port):
    """What mp.spawn runs: set up the process group itself, then the same function."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        one_all_reduce()
    finally:
        dist.destroy_process_group()


def first_and_last(x):
    """What each rank does with a tensor argument: reads one element at each end."""
    return float(x[0] + x[-1])


def spawned_argument(rank, x):
    first_and_last(x)


def full_of_rank(numel):
    """Each rank's result: `numel` float32 values, all equal to its rank."""
    return torch.full((numel,), float(dist.get_rank()))


def spawned_result(rank, numel, queue, received):
    """Send this rank's result, then stay until the caller has it: the caller takes the
    tensor's shared memory from this process."""
    queue.put(torch.full((numel,), float(rank)))
    received.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def warm_calls(world_size, calls):
    """Seconds per call on a warm pool (after a few calls that start and warm it)."""
    for _ in range(5):
        parakit.launch(one_all_reduce, world_size=world_size)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        parakit.launch(one_all_reduce, world_size=world_size)
        times.append(time.perf_counter() - start)
    return times


COLD_SCRIPT = textwrap.dedent("""
    import time
    start = time.perf_counter()
    import parakit, torch, torch.distributed as dist
    imported = time.perf_counter()

    def one_all_reduce():
        t = torch.ones(4)
        dist.all_reduce(t)
        return t

    parakit.launch(one_all_reduce, world_size={world_size})
    ready = time.perf_counter()
    print("COLD", imported - start, ready - imported)
""")


def cold_from_fresh_interpreter(world_size):
    """(import parakit s, first call s) in a new interpreter: its forkserver starts cold."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", COLD_SCRIPT.format(world_size=world_size)], env=env,
                          capture_output=True, text=True, timeout=300, check=True)
    line = next(line for line in done.stdout.splitlines() if line.startswith("COLD"))
    imported, ready = map(float, line.split()[1:])
    return imported, ready


def cold_with_warm_forkserver(world_size):
    """Seconds for the first call after parakit.shutdown(): new workers, forkserver warm."""
    parakit.launch(one_all_reduce, world_size=world_size)  # the forkserver is up
    parakit.shutdown()
    start = time.perf_counter()
    parakit.launch(one_all_reduce, world_size=world_size)
    return time.perf_counter() - start


def spawn_once(world_size):
    start = time.perf_counter()
    mp.spawn(spawned, args=(world_size, free_port()), nprocs=world_size, join=True)
    return time.perf_counter() - start


def timed(run, repeats):
    """The median of `repeats` timed runs of `run()` (seconds)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def spawn_with_argument(x, world_size):
    """Seconds for mp.spawn to start `world_size` processes that each read `x`."""
    start = time.perf_counter()
    mp.spawn(spawned_argument, args=(x,), nprocs=world_size, join=True)
    return time.perf_counter() - start


def spawn_with_results(numel, world_size):
    """The ranks' results through a torch.multiprocessing queue, as mp.spawn users do."""
    context = mp.get_context("spawn")
    queue, received = context.SimpleQueue(), context.Event()
    ranks = mp.spawn(spawned_result, args=(numel, queue, received), nprocs=world_size, join=False)
    results = [queue.get() for _ in range(world_size)]
    received.set()
    ranks.join()
    return results


def data_path(sizes, repeats, world_size=4):
    """Rows (what, MB, launch s, spawn s, copy s): arguments of each size, then results.
    spawn gets a fresh tensor each time: it moves its argument into shared memory, once."""
    rows = []
    for name, nbytes in sizes.items():
        x = torch.randn(nbytes // 4)
        parakit.launch(first_and_last, x, world_size=world_size)  # the pool is warm
        launch = timed(lambda: parakit.launch(first_and_last, x, world_size=world_size), repeats)
        spawn = statistics.median(spawn_with_argument(x.clone(), world_size) for _ in range(repeats))
        copy = timed(x.clone, repeats)
        rows.append((f"{name} argument to {world_size} ranks", nbytes, launch, spawn, copy))
        del x
    numel = 100 * 2**20 // 4
    launch = timed(lambda: parakit.launch(full_of_rank, numel, world_size=world_size), repeats)
    spawn = timed(lambda: spawn_with_results(numel, world_size), repeats)
    results = parakit.launch(full_of_rank, numel, world_size=world_size)
    copy = timed(lambda: [r.clone() for r in results], repeats)
    rows.append((f"100 MB result from each of {world_size} ranks", world_size * 100 * 2**20, launch, spawn, copy))
    return rows


def print_data_path(rows):
    print("\ntensors to and from the ranks, world size 4 (medians; spawn/launch: how many times faster "
          "parakit.launch is;\nlaunch/clone: parakit.launch's time in copies of the same bytes)")
    header = (f"{'what':<36} {'MB':>6} {'launch':>9} {'mp.spawn':>9} {'clone':>9} "
              f"{'spawn/launch':>13} {'launch/clone':>13}")
    print(header)
    print("-" * len(header))
    for what, nbytes, launch, spawn, copy in rows:
        print(f"{what:<36} {nbytes / 2**20:6.0f} {launch:8.3f}s {spawn:8.3f}s {copy:8.3f}s "
              f"{spawn / launch:11.0f} x {launch / copy:11.2f} x")
    arg100 = next(launch for what, nbytes, launch, _, _ in rows if nbytes == 100 * 2**20)
    print(f"bar: 100 MB argument to 4 ranks <= 0.2 s: {arg100:.3f} s {mark(arg100 <= 0.2)}")


def mark(ok):
    return "PASS" if ok else "FAIL"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=100, help="warm calls timed per world size")
    parser.add_argument("--repeats", type=int, default=3, help="cold starts, spawns and data-path calls timed (median)")
    parser.add_argument("--skip-1gb", action="store_true", help="leave out the 1 GB argument (about 4 GB of memory)")
    options = parser.parse_args()

    warm = {ws: warm_calls(ws, options.calls) for ws in (2, 4)}
    forkserver_warm = statistics.median(cold_with_warm_forkserver(4) for _ in range(options.repeats))
    parakit.shutdown()
    fresh = [cold_from_fresh_interpreter(4) for _ in range(options.repeats)]
    fresh_import = statistics.median(i for i, _ in fresh)
    fresh_ready = statistics.median(r for _, r in fresh)
    spawn = statistics.median(spawn_once(4) for _ in range(options.repeats))

    p50 = {ws: percentile(t, 50) for ws, t in warm.items()}
    p95 = {ws: percentile(t, 95) for ws, t in warm.items()}
    ratio = spawn / p50[4]
    rows = [
        ("warm call, world size 2, p50", f"{p50[2] * 1e3:8.2f} ms", "", ""),
        ("warm call, world size 2, p95", f"{p95[2] * 1e3:8.2f} ms", "", ""),
        ("warm call, world size 4, p50", f"{p50[4] * 1e3:8.2f} ms", "<= 20 ms", mark(p50[4] <= 0.020)),
        ("warm call, world size 4, p95", f"{p95[4] * 1e3:8.2f} ms", "", ""),
        ("cold pool ready, ws 4, fresh interpreter", f"{fresh_ready:8.2f} s ", "<= 3 s", mark(fresh_ready <= 3.0)),
        ("  (import parakit in it, not counted)", f"{fresh_import:8.2f} s ", "", ""),
        ("cold pool ready, ws 4, forkserver warm", f"{forkserver_warm:8.2f} s ", "", ""),
        ("torch.multiprocessing.spawn, ws 4", f"{spawn:8.2f} s ", "", ""),
        ("spawn / warm call (ws 4, p50)", f"{ratio:8.0f} x ", ">= 100 x", mark(ratio >= 100)),
    ]
    print(f"parakit.launch vs torch.multiprocessing.spawn -- torch {torch.__version__}, "
          f"{os.cpu_count()} CPU cores, {platform.python_implementation()} {platform.python_version()}, "
          f"gloo; {options.calls} warm calls, median of {options.repeats} cold starts/spawns")
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'figure':>11}  {'bar':<9} result")
    print("-" * (width + 30))
    for name, figure, bar, result in rows:
        print(f"{name:<{width}}  {figure:>11}  {bar:<9} {result}".rstrip())
    sizes = {"1 MB": 2**20, "100 MB": 100 * 2**20} | ({} if options.skip_1gb else {"1 GB": 2**30})
    data = data_path(sizes, options.repeats)
    print_data_path(data)

    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "bench_launcher.json").write_text(json.dumps({
        "torch": torch.__version__, "cpu_count": os.cpu_count(),
        "warm_p50_s": p50, "warm_p95_s": p95, "cold_fresh_ready_s": fresh_ready,
        "cold_fresh_import_s": fresh_import, "cold_forkserver_warm_s": forkserver_warm,
        "spawn_s": spawn, "spawn_over_warm_p50": ratio,
        "data_path": [dict(zip(("what", "bytes", "launch_s", "spawn_s", "clone_s"), row)) for row in data],
    }, indent=2))


if __name__ == "__main__":
    main()
