"""Each emulated GPU's own generator, as each CUDA device has: fgpu:i's random operators draw
from fgpu:i's generator, never from the CPU's, so code that saves or seeds only the CPU's
generator draws other values on fgpu, as it would on a GPU.

A device's generator is a `DeviceGenerator`: a CPU generator (PyTorch cannot make one for a
Python backend) on which a seed starts another stream than on the CPU's, as on CUDA (Philox,
not the CPU's Mersenne Twister), so a GPU's draws never equal the CPU's by sharing a seed. It
is made on first use with PyTorch's default seed, as a CUDA device's is; `torch.fgpu.manual_seed`
and its kin (in `fgpu`) seed and read it. An operator draws when PyTorch tags it
`nondeterministic_seeded`; given no generator, it is given its device's (`drawing`); given
one, it draws from that one. native_dropout (dropout on a GPU) takes no generator: on fgpu it
runs as `fgpu::native_dropout`, the same kernel with one.
"""
from __future__ import annotations

import threading

import torch

__all__ = ["DeviceGenerator", "generator", "drawing"]

_aten = torch.ops.aten
_generators: dict[int, DeviceGenerator] = {}  # device index -> its default generator
_lock = threading.Lock()


class DeviceGenerator(torch._C.Generator):
    """A generator of fgpu's (see the module's note): its seeds are the CPU's XOR `STREAM`."""

    def __init__(self):
        super().__init__()
        self.manual_seed(super().initial_seed())  # PyTorch's default seed, as a new CUDA generator's

    def manual_seed(self, seed: int) -> DeviceGenerator:
        return super().manual_seed(_other_stream(seed))

    def initial_seed(self) -> int:
        return _other_stream(super().initial_seed())

    def seed(self) -> int:
        """Seed with a random number, and return it."""
        seed = super().seed()
        self.manual_seed(seed)
        return seed


STREAM = 0x9E3779B97F4A7C15  # any 64 bits whose low 32 are not 0: the Mersenne Twister reads those


def _other_stream(seed: int) -> int:
    """The seed of the CPU's generator that draws the stream `seed` draws on fgpu (and back)."""
    seed = int(seed)
    return (seed + 0xffff_ffff_ffff_ffff if seed < 0 else seed) ^ STREAM  # a negative seed as torch.manual_seed reads it


def generator(index: int) -> DeviceGenerator:
    """fgpu:index's default generator."""
    found = _generators.get(index)
    if found is None:
        with _lock:
            found = _generators.setdefault(index, DeviceGenerator())
    return found


def drawing(op, args, kwargs, index: int):
    """(op, args, kwargs) as fgpu:index runs them: an operator that draws and was given no
    generator is given fgpu:index's (for any other operator, one dictionary lookup by id: an
    operator's own hash is a Python function, several times slower)."""
    seen = _SLOTS.get(id(op))
    if seen is None or seen[0] is not op:
        seen = _SLOTS[id(op)] = op, _slot(op)
    if seen[1] is None:
        return op, args, kwargs
    kernel, at = seen[1]
    if at < len(args):
        if args[at] is not None:
            return op, args, kwargs
        return kernel, (*args[:at], generator(index), *args[at + 1:]), kwargs
    if kwargs.get("generator") is not None:
        return op, args, kwargs
    return kernel, args, {**kwargs, "generator": generator(index)}


def _slot(op):
    """(the kernel to run, the position of its generator argument) for an operator that draws;
    None for one that does not (or takes no generator and draws nothing: _fused_sdp_choice)."""
    if torch.Tag.nondeterministic_seeded not in op.tags:
        return None
    kernel = _DROPOUT if op is _aten.native_dropout.default else op
    names = [argument.name for argument in kernel._schema.arguments]
    return (kernel, names.index("generator")) if "generator" in names else None


def _native_dropout(input, p, train, *, generator=None):
    """native_dropout drawing its mask from `generator`, as the CPU's kernel does from the CPU's."""
    if train is False or input.numel() == 0:
        return _aten.native_dropout.default(input, p, train)  # draws nothing
    mask = torch.empty_like(input, dtype=torch.bool).bernoulli_(1 - p, generator=generator)
    return input * mask * (0.0 if p == 1 else 1 / (1 - p)), mask


_LIBRARY = torch.library.Library("fgpu", "FRAGMENT")
_LIBRARY.define("native_dropout(Tensor input, float p, bool? train, *, Generator? generator=None) -> (Tensor, Tensor)")
_LIBRARY.impl("native_dropout", _native_dropout, "CPU")
_DROPOUT = torch.ops.fgpu.native_dropout.default
_SLOTS: dict[int, tuple] = {}  # id(operator) -> (operator, its `_slot`), found on first call
