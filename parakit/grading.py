"""What the lessons' test cells call.

`check` runs the student's function and the reference on the same fresh random inputs on
N real ranks and compares every rank's results with `torch.testing.assert_close` (type,
dtype, shape, values). `check_local` does the same in this process for functions that do
not communicate. Both can set tripwires: while the student's function runs, calling a
forbidden function (the finished thing the exercise asks to build, such as
`dist.all_reduce` inside a ring all-reduce, or parakit's own answer) makes the check fail
and say why. A tripwire catches the call however the function was reached (`dist.x`,
`from torch.distributed import x`, an alias): it watches the function's code.
"""
from __future__ import annotations

import copy
import inspect
import random
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from parakit import launcher

__all__ = ["check", "check_local", "InputContext", "Tripwire"]


class Tripwire(AssertionError):
    """The student's code called something the exercise forbids."""


def check(student: Callable, reference: Callable, make_inputs: Callable, *, world_sizes: Iterable[int] = (2, 4),
          trials: int = 2, forbid: dict[Callable, str] | None = None, timeout: float = 60.0,
          rtol: float | None = None, atol: float | None = None, quiet: bool = False) -> None:
    """Compare `student(*inputs)` with `reference(*inputs)` on every rank, for each world size.

    `make_inputs(r)` returns the tuple of arguments for one rank, given an `InputContext`
    `r` (its rank, world size, a generator `r.shared` seeded alike on every rank for shapes,
    and `r.local` seeded per rank for values); both functions get their own deep copy. `forbid` maps forbidden functions to the reason.
    Raises AssertionError (or Tripwire) naming the world size, trial and rank that differ.
    """
    name = getattr(student, "__name__", "your function")
    world_sizes = list(world_sizes)
    for world_size in world_sizes:
        for trial in range(trials):
            seed = random.randrange(2**31)
            try:
                pairs = launcher.launch(_run_pair, student, reference, make_inputs, seed, forbid or {},
                                        world_size=world_size, timeout=timeout)
            except launcher.LaunchError as error:
                raise AssertionError(f"{name} failed on {world_size} ranks (trial {trial + 1}):\n{error}") from None
            for rank, (got, expected) in enumerate(pairs):
                if isinstance(got, Tripwire):
                    raise Tripwire(f"rank {rank}: {got}")
                _compare(got, expected, f"{name} on {world_size} ranks, rank {rank}, trial {trial + 1} "
                                        f"(seed {seed})", rtol, atol)
    if not quiet:
        print(f"passed: {name} matches the reference on {', '.join(map(str, world_sizes))} ranks "
              f"({trials} random input{'s' if trials > 1 else ''} each)")


def check_local(student: Callable, reference: Callable, cases: Iterable[tuple], *,
                forbid: dict[Callable, str] | None = None, rtol: float | None = None,
                atol: float | None = None, quiet: bool = False) -> None:
    """Compare `student(*case)` with `reference(*case)` in this process for every case."""
    name = getattr(student, "__name__", "your function")
    cases = list(cases)
    for case in cases:
        expected = reference(*copy.deepcopy(case))
        got = _call_guarded(student, copy.deepcopy(case), forbid or {})
        _compare(got, expected, f"{name}{tuple(case)!r}", rtol, atol)
    if not quiet:
        print(f"passed: {name} matches the reference on {len(cases)} case{'s' if len(cases) > 1 else ''}")


@dataclass
class InputContext:
    """What `make_inputs` gets on each rank."""

    rank: int
    world_size: int
    shared: torch.Generator  # the same stream on every rank: draw shapes and sizes from it
    local: torch.Generator  # a stream of this rank's own: draw values from it

    def randint(self, low: int, high: int) -> int:
        """An int in [low, high), the same on every rank."""
        return int(torch.randint(low, high, (), generator=self.shared))

    def randn(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Normal random values of this rank, on the rank's device (its GPU under NCCL)."""
        return torch.randn(shape, generator=self.local, dtype=dtype).to(launcher.device())


def _run_pair(student, reference, make_inputs, seed, forbid):
    """On one rank: the same inputs to both functions; the student's runs under tripwires."""
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    context = InputContext(rank, world_size, torch.Generator().manual_seed(seed),
                           torch.Generator().manual_seed(seed * 1009 + rank + 1))
    inputs = make_inputs(context)
    expected = reference(*copy.deepcopy(inputs))
    try:
        return _call_guarded(student, copy.deepcopy(inputs), forbid), expected
    except Tripwire as trip:  # sent back as a value: the message alone says it all
        return trip, expected


def _call_guarded(fn, args, forbid: dict[Callable, str]):
    """Call fn(*args); if it reaches any forbidden function, raise Tripwire."""
    codes = {inspect.unwrap(f).__code__: (f, why) for f, why in forbid.items()}
    tripped = []

    def watch(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            tripped.append(codes[frame.f_code])
            raise Tripwire(_trip_message(fn, *codes[frame.f_code]))

    previous, previous_threads = sys.getprofile(), threading.getprofile()
    if codes:  # this thread, and the threads fn starts (DataParallel's workers, say)
        sys.setprofile(watch)
        threading.setprofile(watch)
    try:
        result = fn(*args)
    finally:
        sys.setprofile(previous)
        threading.setprofile(previous_threads)
    if tripped:  # the student caught the Tripwire and went on
        raise Tripwire(_trip_message(fn, *tripped[0]))
    return result


def _trip_message(fn, forbidden, why) -> str:
    where = f"{getattr(forbidden, '__module__', '')}.{getattr(forbidden, '__qualname__', forbidden)}"
    return f"{getattr(fn, '__name__', 'your function')} called {where}, which this exercise forbids: {why}"


def _compare(got, expected, what: str, rtol, atol) -> None:
    if type(got) is not type(expected):
        raise AssertionError(f"{what}: returned a {type(got).__name__}, expected a {type(expected).__name__}")
    try:
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)
    except AssertionError as error:
        raise AssertionError(f"{what}: {error}") from None
