"""A technique two ways on the same ranks: parakit's (or yours) and PyTorch's own API.

Every lesson ends with the API its technique has in PyTorch. The lesson writes that code as
a script from a cell (`%%writefile with_pytorch_02.py`), so the same file runs on the
notebook's ranks and, unchanged, under torchrun on a box with GPUs:

    torch_ddp = side_by_side.load_script("with_pytorch_02.py")   # a module; its __main__ block does not run
    both = side_by_side.compare({"parakit": ours, "PyTorch": torch_ddp.step}, *inputs, world_size=2)
    both.check()      # every rank's results equal, version against version
    print(both)       # per rank: collectives, bytes written, peak memory, seconds
    parakit.torchrun.run("with_pytorch_02.py", nproc_per_node=2)      # the same file under torchrun

Both versions are measured by the same meter. Communication is counted where PyTorch
dispatches it (`CallCounter`, a dispatch mode like PyTorch's `CommDebugMode` without its
per-module tracking): every op of the c10d and functional-collective libraries, so also the
all-reduces DDP's reducer issues from C++ and the collectives DTensor issues, not only calls
of `torch.distributed`'s Python functions (parakit's `CommLog` sees those alone). Bytes are what the OS counted the
rank writing while the step ran (gloo on CPU); where the OS sees none of them (NCCL's
transfers are no write() calls), the ring model's bytes of the collectives counted
(`comm.ring_bytes`), marked "model". Nothing here communicates beyond what the measured functions do, plus one barrier
before each measured call so that no rank's clock starts while another is still busy.
"""
from __future__ import annotations

import importlib.util
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import cloudpickle
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from parakit import devices
from parakit.comm import CommLog, ring_bytes
from parakit.devices import MemoryMeter
from parakit.launcher import launch

__all__ = ["Measured", "Comparison", "CallCounter", "op_name", "measure", "rank_meter", "compare", "same_within",
           "load_script", "available"]


@dataclass
class Measured:
    """One rank's run of one version: what it returned and what it cost."""

    result: object
    collectives: dict[str, int]  # op -> calls, as PyTorch dispatched them: "allreduce", "allgather", "send", ...
    written: int  # bytes the OS counted the rank writing during the call, or the ring model's where it cannot (NCCL)
    peak: int | None  # peak bytes on this rank's device during the call (None when not measured)
    seconds: float
    written_by: str = "os"  # "os": the OS's count of writes; "model": the ring model of the collectives counted


def measure(fn, *args, memory: bool = True) -> Measured:
    """Run `fn(*args)` on this rank and measure it; collective: every rank of the default
    group must call it (it starts with a barrier). The peak is this rank's device's alone
    (`rank_meter`). The meters are dispatch modes, and PyTorch imports torch._dynamo at the
    first operator that passes one (about 1 s): done before the clock starts, so that a
    process's first measured call is not slowed by it (lesson 09's read 1,719 ms, 100 later)."""
    dist.barrier()
    import torch._dynamo  # noqa: F401  (a dispatch mode's first operator imports it, about 1 s: not in the timing)
    meter = rank_meter() if memory else None
    devices.synchronize()  # the work queued before is not this call's
    with CommLog() as log, CallCounter() as counter:
        start = time.perf_counter()
        if meter is None:
            result = fn(*args)
        else:
            with meter:
                result = fn(*args)
        devices.synchronize()  # a GPU's work is queued: the clock stops when it has run
        seconds = time.perf_counter() - start
    written = log.written_bytes()
    return Measured(result, dict(counter.calls), counter.model_bytes if written is None else written,
                    meter.peaks()[0] if meter else None, seconds, "model" if written is None else "os")


def rank_meter(device: torch.device | str | None = None) -> MemoryMeter:
    """A MemoryMeter of one device: `device`, by default this rank's (`parakit.device()`: its
    GPU under NCCL, else the CPU, as logical device 0). It resets, reads and makes current
    that device only, so a rank never meters, or moves onto, another rank's GPU."""
    device = devices.device() if device is None else torch.device(device)
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device() if device.type == "cuda" else 0)
    return MemoryMeter([device])


COMMUNICATION_LIBRARIES = ("c10d", "_c10d_functional", "c10d_functional")
NOT_COMMUNICATION = ("wait_tensor", "wrap_tensor_autograd")  # waits and autograd wrappers move no data


class CallCounter(TorchDispatchMode):
    """Counts the communication ops dispatched while it is active: `calls[op]`,
    `by_group[(op, ranks)]` with the global ranks of the group each ran on, and `model_bytes`,
    what this rank sends for them by the ring model (`model_bytes_sent`). It lets a DTensor
    turn its ops into collectives first (returns NotImplemented for it), as CommDebugMode
    does, so that the collectives are what it counts."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()
        self.by_group: Counter = Counter()
        self.model_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        name = func._overloadpacket.__name__.strip("_")
        if func.namespace in COMMUNICATION_LIBRARIES and name not in NOT_COMMUNICATION:
            op, ranks = op_name(name), _group_ranks(args)
            self.calls[op] += 1
            self.by_group[(op, ranks)] += 1
            self.model_bytes += model_bytes_sent(func, op, ranks, args, kwargs)
        return func(*args, **(kwargs or {}))


RING_OPS = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
            "alltoall": "all_to_all", "broadcast": "broadcast", "reduce": "reduce", "gather": "gather",
            "scatter": "scatter", "send": "send", "isend": "send"}  # op_name -> comm.ring_bytes's op; others send 0
INPUTS = ("tensors", "input_tensors", "input_tensor", "input", "inputs", "input_list", "tensor")  # never the outputs


def model_bytes_sent(func, op: str, ranks: tuple[int, ...], args, kwargs) -> int:
    """The bytes this rank sends for one dispatched communication op by the ring model
    (`comm.ring_bytes` of its input tensors on the group `ranks`); an all-to-all's exactly: its
    input less the piece addressed to this rank itself."""
    if op not in RING_OPS:
        return 0
    named = {**dict(zip((a.name for a in func._schema.arguments), args)), **(kwargs or {})}
    inputs = next(named[n] for n in INPUTS if n in named)
    tensors = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    me, n = (ranks.index(dist.get_rank()), len(ranks)) if dist.get_rank() in ranks else (0, 1)
    if op == "alltoall":
        if isinstance(inputs, torch.Tensor):  # [rows, ...] split along dim 0
            splits = named.get("input_split_sizes") or [inputs.shape[0] // n] * n
            return nbytes - splits[me] * (inputs[0].numel() if inputs.shape[0] else 0) * inputs.element_size()
        return nbytes - tensors[me].numel() * tensors[me].element_size()
    if op == "scatter":  # the root passes every rank's piece; ring_bytes counts in pieces
        nbytes //= n
    return ring_bytes(RING_OPS[op], nbytes, n, me, named.get("root_rank", named.get("src")))  # roots: group ranks


def _group_ranks(args) -> tuple[int, ...]:
    """The global ranks of the process group a c10d op (a ProcessGroup argument) or a
    functional collective (the group's name, its last str argument) runs on."""
    for a in args:
        if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
            return tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(a)))
    names = [a for a in args if isinstance(a, str)]
    return tuple(dist.get_process_group_ranks(c10d._resolve_process_group(names[-1]))) if names else ()


def op_name(name: str) -> str:
    """A dispatched op's name as one word whichever library issued it: 'allreduce_' and
    'all_reduce' -> 'allreduce'; '_allgather_base_' and 'all_gather_into_tensor' ->
    'allgather'; 'reduce_scatter_tensor' -> 'reducescatter'; 'recv_' -> 'recv'."""
    name = name.strip("_")
    for suffix in ("_base", "_into_tensor", "_tensor", "_coalesced", "_single"):
        name = name.removesuffix(suffix)
    return name.replace("_", "")


class Comparison:
    """The runs of several versions on the same ranks: `runs[name][rank]` is a Measured."""

    def __init__(self, runs: dict[str, list[Measured]]):
        self.runs = runs

    def check(self, rtol: float = 1.3e-6, atol: float = 1e-5, kernels: dict[str, str] | None = None) -> None:
        """Raise AssertionError, naming the version, rank and item, unless every version's
        results equal the first version's on every rank (tensors to rtol/atol, the rest exactly);
        `kernels` (version -> the kernels it runs) names them where they differ (`same_within`)."""
        (first, reference), *others = self.runs.items()
        kernels = kernels or {}
        for name, runs in others:
            for rank, (mine, theirs) in enumerate(zip(runs, reference)):
                named = (_ran(name, kernels), _ran(first, kernels)) if {name, first} & set(kernels) else None
                same_within(mine.result, theirs.result, named, rtol, atol, f"{name} differs from {first} on rank {rank}")

    def rows(self) -> list[dict]:
        """One row per version and rank: collectives, bytes written, peak bytes, milliseconds."""
        return [{"version": name, "rank": rank,
                 "collectives": ", ".join(f"{op} x{n}" for op, n in sorted(m.collectives.items())) or "none",
                 "bytes written": m.written if m.written_by == "os" else f"{m.written:,} (model)", "peak bytes": m.peak, "ms": round(1000 * m.seconds, 1)}
                for name, runs in self.runs.items() for rank, m in enumerate(runs)]

    def __str__(self) -> str:
        rows = self.rows()
        columns = list(rows[0])
        cells = [[_cell(row[c]) for c in columns] for row in rows]
        widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
        return "\n".join(lines)

    __repr__ = __str__


def same_within(mine, theirs, kernels: tuple[str, str] | None, rtol: float, atol: float, what: str = "") -> None:
    """Raise AssertionError unless `mine` (made by kernels[0]) equals `theirs` (by kernels[1]):
    tensors to rtol/atol, nested lists, tuples and dicts item by item, the rest exactly.

    Two different kernels (a GPU's and the CPU's, a fused and a single-tensor optimizer) add
    in another order and round differently, so their results differ in the last bits: the
    message names both kernels and the tolerance they need, the largest difference measured.
    With `kernels` None (one computation, not two kernels), it gives the difference alone."""
    try:
        torch.testing.assert_close(mine, theirs, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError as error:
        head = f"{what + ': ' if what else ''}"
        if kernels is not None:
            head += f"{kernels[0]} and {kernels[1]} differ beyond rtol={rtol:g}, atol={atol:g}{_needed(mine, theirs)}. "
        raise AssertionError(f"{head}{error}") from None


def _needed(mine, theirs) -> str:
    """' by up to d (relative r): ...': the largest absolute and relative difference between the
    floating-point tensors of two results of one structure, as the tolerance two kernels need
    ('' where none differ)."""
    pairs = [(a, b) for a, b in zip(pytree.tree_leaves(mine), pytree.tree_leaves(theirs))
             if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.is_floating_point()
             and a.shape == b.shape and b.is_floating_point()]
    gaps = [((a.detach().cpu().double() - b.detach().cpu().double()).abs(), b.detach().cpu().double().abs())
            for a, b in pairs]
    gaps = [(gap, size) for gap, size in gaps if gap.numel() and gap.nan_to_num(0).max() > 0]
    if not gaps:
        return ""
    absolute = max(float(gap.nan_to_num(0).max()) for gap, _ in gaps)
    relative = max(float((gap / size).nan_to_num(0, posinf=0).max()) for gap, size in gaps)
    return (f" by up to {absolute:.1e} (relative {relative:.1e}): two different kernels round differently and "
            f"need that tolerance, atol >= {absolute:.1e} or rtol >= {relative:.1e} (give it, saying why), or the "
            f"same kernel on both sides")


def _ran(version: str, kernels: dict[str, str]) -> str:
    return f"{version} ({kernels[version]})" if version in kernels else version


def _cell(value) -> str:
    if value is None:
        return "n/a"
    return f"{value:,}" if isinstance(value, int) else str(value)


def compare(versions: dict, *args, world_size: int, memory: bool = True, backend: str = "auto",
            timeout: float | None = None) -> Comparison:
    """Run each version (a function run on every rank with `*args`) on the same
    `world_size` ranks, one after the other, each measured by `measure`."""
    if len(versions) < 2:
        raise ValueError(f"compare needs at least two versions to set side by side, got {list(versions)}")
    options = {} if timeout is None else {"timeout": timeout}
    runs = {name: launch(_measured, fn, args, memory, world_size=world_size, backend=backend, **options)
            for name, fn in versions.items()}
    return Comparison(runs)


def _measured(fn, args, memory):
    return measure(fn, *args, memory=memory)


def load_script(path) -> "types.ModuleType":
    """The script at `path` (one a cell wrote with %%writefile) as a module: it runs, except
    its `if __name__ == "__main__":` block. Its functions and classes travel to the ranks by
    value, so ranks always run the file's text as it was when this was called."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no script at {path.resolve()}: run the %%writefile cell that writes it first")
    name = path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)
    return module


def available(api: str, gpus: int = 0) -> bool:
    """Whether `api`, which needs `gpus` CUDA GPUs (0: runs on CPU), can run here; if not,
    print one line saying it is skipped and what it would need."""
    if torch.cuda.device_count() >= gpus:
        return True
    print(f"skipped: {api} needs {gpus} CUDA GPU{'s' if gpus != 1 else ''}, "
          f"this machine has {torch.cuda.device_count()}")
    return False
