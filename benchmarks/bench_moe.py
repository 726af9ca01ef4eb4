"""Mixture of experts: parakit's expert-parallel layer against the same layer in one process.

    .venv/bin/python benchmarks/bench_moe.py [--sizes 2 4] [--repeats 5]

Measured in this run, for an MoE layer (hidden 256, 8 experts of ffn 1024, top-2, capacity
factor 1.25, 512 tokens per rank, float32), on n ranks (gloo on CPU, or NCCL where there are
n GPUs) and on one process holding every expert and every rank's tokens (routed as n groups):
  - forward + backward step time (median over ranks of the median of --repeats steps);
  - the all-to-alls' share of an EP step: the seconds the comm meter counted inside
    all_to_all_single (counts, dispatch, combine, and the two backward), over the step;
  - bytes per rank: passed to the all-to-alls (CommLog nbytes), and written by the process
    during them (the OS's count; None under NCCL), against the even-routing model
    4 * (n-1)/n * kept rows * hidden * 4;
  - parameter bytes per rank.
The issue's bars (outputs and gradients equal to one process to 1e-5 of max(1, the largest element), dropped counts equal)
are printed with PASS or FAIL; nothing is asserted. PyTorch has no MoE layer to time
against: lesson 09's with_pytorch_09.py writes the same layer with torch's differentiable
all_to_all_single, and is measured here too. On a 2-core CPU the times say what the
exchange costs next to the experts' matmuls, not what a GPU box would show.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import parakit
from parakit import moe

HIDDEN, FFN, EXPERTS, K, FACTOR, TOKENS = 256, 1024, 8, 2, 1.25, 512


def tokens(n: int):
    draw = torch.Generator().manual_seed(1)
    return torch.randn(n * TOKENS, HIDDEN, generator=draw), torch.randn(n * TOKENS, HIDDEN, generator=draw)


def ep_step(repeats: int):
    """On every rank: (median step s, all-to-all s per step, nbytes, measured bytes, kept rows, param bytes,
    output, dL/dx, summed router grad, dropped)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    x_all, up_all = tokens(n)
    x, up = x_all.chunk(n)[rank].to(parakit.device()), up_all.chunk(n)[rank].to(parakit.device())
    torch.manual_seed(0)
    layer = moe.ExpertParallelMoE(HIDDEN, FFN, EXPERTS, K, FACTOR).to(parakit.device())
    times, a2a, logs = [], [], []
    for _ in range(repeats + 1):
        layer.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        dist.barrier()
        with parakit.CommLog() as log:
            start = time.perf_counter()
            y = layer(xg)
            y.backward(up)
            times.append(time.perf_counter() - start)
        a2a.append(log.seconds("all_to_all_single"))
        logs.append(log)
    router = layer.router.weight.grad.clone()
    dist.all_reduce(router)
    log = logs[-1]
    return (statistics.median(times[1:]), statistics.median(a2a[1:]), log.nbytes("all_to_all_single"),
            log.measured_bytes("all_to_all_single"), int(layer.routing.kept.sum()),
            sum(p.nbytes for p in layer.parameters()), y.detach(), xg.grad, router, layer.routing.dropped())


def one_process(n: int, repeats: int):
    """On one rank (a worker like the EP ranks): the whole layer on every rank's tokens, routed as n groups."""
    x_all, up_all = tokens(n)
    torch.manual_seed(0)
    layer = moe.MoE(HIDDEN, FFN, EXPERTS, K, FACTOR)
    times = []
    for _ in range(repeats + 1):
        layer.zero_grad(set_to_none=True)
        xg = x_all.clone().requires_grad_()
        start = time.perf_counter()
        y = layer(xg, groups=n)
        y.backward(up_all)
        times.append(time.perf_counter() - start)
    return (statistics.median(times[1:]), sum(p.nbytes for p in layer.parameters()), y.detach(), xg.grad,
            layer.router.weight.grad, [r.dropped() for r in layer.routings])


def torch_step(script, repeats: int):
    """The lesson's plain-PyTorch layer (torch.distributed.nn.functional.all_to_all_single), same sizes."""
    n, rank = dist.get_world_size(), dist.get_rank()
    x_all, up_all = tokens(n)
    x, up = x_all.chunk(n)[rank].to(parakit.device()), up_all.chunk(n)[rank].to(parakit.device())
    router, experts = script.make_layer()
    per_rank = EXPERTS // n
    local = experts[rank * per_rank:(rank + 1) * per_rank]
    times = []
    for _ in range(repeats + 1):
        xg = x.clone().requires_grad_()
        dist.barrier()
        start = time.perf_counter()
        script.expert_parallel(router, local, xg).backward(up)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def load_lesson_script():
    """with_pytorch_09.py as lesson 09's cell writes it."""
    import json
    import tempfile
    from parakit import side_by_side
    cells = json.loads((Path(__file__).resolve().parents[1] / "solutions" / "09_mixture_of_experts.ipynb").read_text())["cells"]
    source = next("".join(c["source"]) for c in cells if "".join(c["source"]).startswith("%%writefile with_pytorch_09.py"))
    path = Path(tempfile.mkdtemp()) / "with_pytorch_09.py"
    path.write_text(source.partition("\n")[2])
    return side_by_side.load_script(path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    script = load_lesson_script()
    for name, value in dict(HIDDEN=HIDDEN, FFN=FFN, EXPERTS=EXPERTS, K=K, CAPACITY_FACTOR=FACTOR).items():
        setattr(script, name, value)  # its functions travel by value, with these globals
    print(f"MoE layer: hidden {HIDDEN}, {EXPERTS} experts of ffn {FFN}, top-{K}, capacity factor {FACTOR}, "
          f"{TOKENS} tokens per rank; forward + backward")
    print(f"{'':>22} {'step ms':>9} {'vs 1 proc':>10} {'vs torch':>9} {'a2a ms':>8} {'a2a share':>10} "
          f"{'a2a bytes/rank':>15} {'measured':>11} {'model':>11} {'param bytes/rank':>17}")
    bars = []
    for n in args.sizes:
        single_s, single_bytes, y, dx, router, dropped = parakit.launch(one_process, n, args.repeats, world_size=1)[0]
        runs = parakit.launch(ep_step, args.repeats, world_size=n)
        torch_s = statistics.median(parakit.launch(torch_step, script, args.repeats, world_size=n))
        step_s = statistics.median(r[0] for r in runs)
        a2a_s = statistics.median(r[1] for r in runs)
        kept = runs[0][4]
        model = 4 * (n - 1) / n * kept * HIDDEN * 4
        measured = runs[0][3]
        print(f"{'one process, ' + str(n) + ' groups':>22} {1e3 * single_s:9.2f} {1:10.2f} {'':>9} {'':>8} {'':>10} "
              f"{'':>15} {'':>11} {'':>11} {single_bytes:17,}")
        print(f"{'parakit EP n=' + str(n):>22} {1e3 * step_s:9.2f} {step_s / single_s:10.2f} {step_s / torch_s:9.2f} "
              f"{1e3 * a2a_s:8.2f} {a2a_s / step_s:10.1%} {runs[0][2]:15,} "
              f"{measured if measured is not None else 'n/a':>11,} {model:11,.0f} {runs[0][5]:17,}")
        print(f"{'torch a2a EP n=' + str(n):>22} {1e3 * torch_s:9.2f} {torch_s / single_s:10.2f} {1:9.2f}")
        pairs = [(a, b) for i, r in enumerate(runs) for a, b in ((r[6], y.chunk(n)[i]), (r[7], dx.chunk(n)[i]), (r[8], router))]
        worst = max(float((a - b).abs().max()) / max(1.0, float(b.abs().max())) for a, b in pairs)
        bars.append((f"n={n}: outputs, dL/dx, router gradient equal to one process to 1e-5 (largest difference over "
                     f"max(1, largest element) {worst:.1e}; the router gradient sums {n * TOKENS} tokens)", worst <= 1e-5))
        bars.append((f"n={n}: dropped choices per rank {[r[9] for r in runs]} == one process's groups {dropped}",
                     [r[9] for r in runs] == dropped))
    print()
    for text, ok in bars:
        print(f"bar: {text}: {'PASS' if ok else 'FAIL'}")
    parakit.shutdown()


if __name__ == "__main__":
    main()
