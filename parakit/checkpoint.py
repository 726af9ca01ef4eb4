"""Activation checkpointing: keep a block's inputs, recompute the block in backward.

Autograd saves, for every op of the forward, the tensors its backward needs (the input of a
linear layer, the output of a ReLU, a dropout mask ...) until that backward runs.
`checkpoint(fn, *args)` runs `fn` without saving any of them and keeps only `args`; in the
backward it runs `fn` again with the random-number state of the first run (so dropout draws
the same mask) and backpropagates through the recomputed graph. `checkpoint_sequential`
cuts a chain of n layers into segments and checkpoints each: the forward then keeps one
input per segment, and the backward holds at most one segment's activations on top, so
k segments cost k + n/k layer activations, least at k = sqrt(n) (Chen et al., 2016).

`keep=` makes the checkpoint selective: outputs of the ops named there (matmuls, say) are
saved in the forward and handed back during the recomputation instead of being recomputed.

`saved_bytes(fn, *args)` measures what autograd really saves (with saved-tensor hooks:
unique storages, parameters reported apart) and the peak of it during the backward;
`step_time` times forward + backward. Nothing here communicates.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from parakit.devices import synchronize

__all__ = ["checkpoint", "checkpoint_sequential", "Checkpointed", "segment_sizes", "peak_units", "best_segments",
           "SavedBytes", "saved_bytes", "counting_saved", "step_time", "MATMULS"]

aten = torch.ops.aten
MATMULS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default)


# ---------------------------------------------------------------- the checkpoint function

class Checkpoint(torch.autograd.Function):
    """Forward: run fn without saving its activations; save only the tensor inputs (and the
    outputs of `keep` ops). Backward: rerun fn from the forward's RNG state and backpropagate
    through the recomputed graph."""

    @staticmethod
    def forward(ctx, fn, keep, preserve_rng_state, returned, anchor, *args):
        ctx.fn, ctx.keep, ctx.preserve_rng_state = fn, keep, preserve_rng_state
        ctx.device_type, ctx.devices = _accelerator_devices(args)
        ctx.cpu_state = torch.get_rng_state()
        ctx.device_states = [torch.get_device_module(ctx.device_type).get_rng_state(d) for d in ctx.devices]
        record = _Record(keep)
        with record if keep else contextlib.nullcontext():
            result = fn(*args)
        outputs = _as_tuple(result)
        returned.append(torch.is_tensor(result))
        ctx.tensor_index = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*[args[i] for i in ctx.tensor_index], *record.outputs)
        ctx.written = record.written
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        inputs, kept = saved[:len(ctx.tensor_index)], list(saved[len(ctx.tensor_index):])
        args = list(ctx.others)
        for i, x in zip(ctx.tensor_index, inputs):
            args[i] = x.detach().requires_grad_(x.requires_grad)
        with torch.random.fork_rng(devices=ctx.devices, enabled=ctx.preserve_rng_state, device_type=ctx.device_type):
            if ctx.preserve_rng_state:
                torch.set_rng_state(ctx.cpu_state)
                for device, state in zip(ctx.devices, ctx.device_states):
                    torch.get_device_module(ctx.device_type).set_rng_state(state, device)
            with torch.enable_grad(), (_Replay(ctx.keep, kept, ctx.written) if kept else contextlib.nullcontext()):
                outputs = _as_tuple(ctx.fn(*args))
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward(*zip(*pairs))
        return (None, None, None, None, None, *[a.grad if torch.is_tensor(a) else None for a in args])


def checkpoint(fn: Callable, *args, keep: Iterable = (), preserve_rng_state: bool = True):
    """fn(*args), keeping only `args` (and the outputs of the aten ops in `keep`, such as
    `MATMULS`) for the backward, which recomputes fn. fn returns a tensor or a tuple of
    tensors; args may be anything (non-tensors are passed through).

    Gradients reach fn's parameters even when no input requires grad. The backward calls
    `torch.autograd.backward` on the recomputed outputs, so backpropagate with `.backward()`,
    not `torch.autograd.grad`, as with PyTorch's reentrant checkpoint. The RNG state (CPU, and
    the accelerator's, CUDA or the emulated box's fgpu, for the devices of the inputs and, once
    it is initialised, the current device) is restored for the recomputation so that dropout
    draws the same mask;
    `preserve_rng_state=False` skips that.
    """
    returned = []
    anchor = torch.empty(0, requires_grad=torch.is_grad_enabled())  # makes the outputs require grad
    outputs = Checkpoint.apply(fn, tuple(keep), preserve_rng_state, returned, anchor, *args)
    return outputs[0] if returned[0] else outputs


def _accelerator_devices(args) -> tuple[str, list[int]]:
    """The accelerator whose generators the recomputation replays (torch.accelerator's: CUDA,
    or fgpu on the emulated box; "cuda" on a CPU machine, with no devices) and its devices:
    the inputs', and the current device once it is initialised (fn may draw there from CPU inputs)."""
    accelerator = torch.accelerator.current_accelerator()
    kind = "cuda" if accelerator is None else accelerator.type
    module = torch.get_device_module(kind)
    devices = {a.get_device() for a in args if torch.is_tensor(a) and a.device.type == kind}
    if module.is_initialized():
        devices.add(module.current_device())
    return kind, sorted(devices)


def _as_tuple(result) -> tuple:
    outputs = result if isinstance(result, tuple) else (result,)
    wrong = [type(o).__name__ for o in outputs if not torch.is_tensor(o)]
    if wrong:
        raise TypeError(f"the checkpointed function returned {', '.join(wrong)}: it must return a tensor or a tuple "
                        f"of tensors (return the tensors and compute anything else outside the checkpoint)")
    return outputs


class _Record(TorchDispatchMode):
    """Collect the outputs of the ops in `keep`, in call order. An op of fn that later writes
    into a kept output (an in-place add, say) first swaps in a copy, so the record holds the
    value the replay must hand back; `written` lists the indices of those."""

    def __init__(self, keep):
        super().__init__()
        self.keep, self.outputs, self.written = keep, [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        targets = {_key(t) for t in _written(func, args, kwargs)}
        for i, kept in enumerate(self.outputs):
            if _key(kept) in targets:
                self.outputs[i] = kept.clone()
                self.written.add(i)
        out = func(*args, **kwargs)
        if func in self.keep:
            self.outputs.append(out)
        return out


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an aten op writes into: the arguments its schema marks as written."""
    schema = func._schema.arguments
    values = [*args, *(kwargs.get(a.name) for a in schema[len(args):])]
    return [v for a, v in zip(schema, values) if a.alias_info is not None and a.alias_info.is_write and torch.is_tensor(v)]


class _Replay(TorchDispatchMode):
    """Hand back the recorded outputs of the ops in `keep` instead of running them again (a
    copy of those fn writes into, so that the record stays intact for another backward)."""

    def __init__(self, keep, kept, written):
        super().__init__()
        self.keep, self.kept, self.written, self.calls = keep, kept, written, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.keep:
            n, self.calls = self.calls, self.calls + 1
            return self.kept[n].clone() if n in self.written else self.kept[n]
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------- segments

def segment_sizes(n: int, segments: int) -> list[int]:
    """Layers per segment when n layers are cut into `segments`: as equal as possible, the
    longer segments first (the backward then never holds more than k + n // k activations)."""
    if not 1 <= segments <= n:
        raise ValueError(f"segments={segments} for {n} functions: choose 1 <= segments <= {n}")
    return [n // segments + (s < n % segments) for s in range(segments)]


def checkpoint_sequential(functions: nn.Sequential | Sequence[Callable], segments: int, input: torch.Tensor,
                          keep: Iterable = ()) -> torch.Tensor:
    """Run `functions` in order on `input`, cut into `segments` (see `segment_sizes`), each
    checkpointed: the forward keeps one input per segment."""
    functions = list(functions)
    start = 0
    for size in segment_sizes(len(functions), segments):
        chain = functions[start:start + size]
        input = checkpoint(_chain(chain, start), input, keep=keep)
        start += size
    return input


def _chain(functions, first: int):
    def run(x):
        for i, f in enumerate(functions, first):
            x = f(x)
            if not torch.is_tensor(x):
                raise TypeError(f"function {i} ({type(f).__name__}) returned {type(x).__name__}: each function of "
                                f"checkpoint_sequential must return one tensor, the next function's input")
        return x
    return run


class Checkpointed(nn.Module):
    """`module`, checkpointed: forward(*args) = checkpoint(module, *args). Use it for the
    layers of a model that something else runs, such as a pipeline stage."""

    def __init__(self, module: nn.Module, keep: Iterable = ()):
        super().__init__()
        self.module, self.keep = module, tuple(keep)

    def forward(self, *args):
        return checkpoint(self.module, *args, keep=self.keep)


def peak_units(n: int, segments: int) -> int:
    """Activations held at the peak of the backward of n equal layers (one saved activation
    each) in `segments` checkpointed segments: the inputs of segments 0..j plus the layers of
    segment j while it is recomputed, at the worst j."""
    sizes = segment_sizes(n, segments)
    return max(j + 1 + size for j, size in enumerate(sizes))


def best_segments(n: int) -> int:
    """The segment count with the smallest `peak_units` for n layers (fewest on a tie); near sqrt(n)."""
    return min(range(1, n + 1), key=lambda k: (peak_units(n, k), k))


# ---------------------------------------------------------------- measuring

@dataclass
class SavedBytes:
    """What autograd saved for the backward, in bytes of unique storages.

    forward: activations alive when the forward has returned (everything saved that is not a
    parameter; the model's input counts when a layer saves it). peak: the most activations
    alive at once, forward and backward (recomputations included). parameters: the parameter
    storages that autograd also saved (they exist anyway; reported apart, never in the other two).
    """

    forward: int
    peak: int
    parameters: int


class _Ledger:
    """Saved-tensor hooks that count unique storages while they are alive."""

    def __init__(self, parameters: Iterable[torch.Tensor]):
        self.parameter_keys = {_key(p) for p in parameters}
        self.live: dict = {}  # storage key -> [references, nbytes]
        self.bytes = self.peak = 0
        self.parameters: dict = {}  # storage key -> nbytes

    @property
    def parameter_bytes(self) -> int:
        return sum(self.parameters.values())

    def pack(self, tensor):
        key, nbytes = _key(tensor), tensor.untyped_storage().nbytes()
        if key in self.parameter_keys:
            self.parameters[key] = nbytes
            return tensor
        entry = self.live.setdefault(key, [0, nbytes])
        if entry[0] == 0:
            self.bytes += nbytes
            self.peak = max(self.peak, self.bytes)
        entry[0] += 1
        return _Held(tensor, self, key)

    def release(self, key):
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.bytes -= entry[1]
            del self.live[key]


class _Held:
    """A saved tensor; autograd drops it when the backward that needed it has run."""

    def __init__(self, tensor, ledger, key):
        self.tensor, self.ledger, self.key = tensor, ledger, key

    def __del__(self):
        self.ledger.release(self.key)


def _key(tensor):
    storage = tensor.untyped_storage()
    return storage.device, storage.data_ptr()


def _unpack(packed):
    return packed.tensor if isinstance(packed, _Held) else packed


@contextlib.contextmanager
def counting_saved(parameters: Iterable[torch.Tensor] = ()):
    """Count what autograd saves inside the block: yields a ledger whose `bytes` are the
    activations saved and still alive, `peak` the most at once, `parameters` the parameter
    storages saved (counted apart). Backwards run inside the block free what they used."""
    ledger = _Ledger(parameters)
    with torch.autograd.graph.saved_tensors_hooks(ledger.pack, _unpack):
        yield ledger


def saved_bytes(fn: Callable, *args, parameters: Iterable[torch.Tensor] | None = None) -> SavedBytes:
    """Run fn(*args) and backpropagate the sum of its outputs, counting what autograd saves.

    `parameters` (default: fn's, when fn is an nn.Module) are counted apart. Saved tensors
    packed by another hook inside fn (PyTorch's non-reentrant checkpoint) are not seen.
    """
    if parameters is None:
        parameters = fn.parameters() if isinstance(fn, nn.Module) else ()
    with counting_saved(parameters) as ledger:
        outputs = _as_tuple(fn(*args))
        forward = ledger.bytes
        _backward_of_sum(outputs)
    return SavedBytes(forward, ledger.peak, ledger.parameter_bytes)


def _backward_of_sum(outputs):
    differentiable = [o for o in outputs if o.requires_grad]
    if not differentiable:
        raise ValueError("no output requires grad: give fn an input or a parameter that requires grad")
    torch.autograd.backward([o.sum() for o in differentiable])


def step_time(fn: Callable, *args, repeats: int = 5) -> float:
    """Median seconds of fn(*args) plus the backward of the sum of its outputs (after one warm-up)."""
    times, where = [], next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    for _ in range(repeats + 1):
        start = time.perf_counter()
        _backward_of_sum(_as_tuple(fn(*args)))
        synchronize(where)  # a GPU's work is queued: the clock stops when it has run
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])
