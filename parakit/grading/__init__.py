"""What the lessons' test cells call.

`check` runs the student's function and the reference on the same fresh random inputs on
N real ranks and compares every rank's results with `torch.testing.assert_close` (type,
dtype, shape, values). `check_local` does the same in this process for functions that do
not communicate. Both can set tripwires: while the student's function runs, calling a
forbidden function (the finished thing the exercise asks to build, such as
`dist.all_reduce` inside a ring all-reduce, or parakit's own answer) makes the check fail
and say why. A tripwire catches the call however the function was reached (`dist.x`,
`from torch.distributed import x`, an alias): it watches the function's code.

`check(..., same_traffic=True)` also compares how the two functions communicate, from the
comm meter: on each rank the same collectives (by kind) and point-to-point calls only with
the peers the reference talks to, and the same bytes sent by all ranks together. A ring
all-reduce then has to be a ring, not a gather to rank 0 written with send and recv.

In a sealed grade (`parakit.grading.judge`) the same calls run nothing in the judge's
process: each side runs on fresh ranks of its own and only plain data comes back.
"""
from __future__ import annotations

import copy
import dis
import functools
import inspect
import os
import random
import sys
import threading
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from parakit import comm, launcher

from parakit.grading.jail import Tripwire

__all__ = ["check", "check_local", "InputContext", "Traffic", "Tripwire", "OrderDiffers", "compare_values",
           "compare_traffic", "compare_overlap", "kind_of", "SEALED"]

SEALED: list = []  # while the sealed judge runs a test cell: its `Sealed`, which runs the checks instead


class OrderDiffers(AssertionError):
    """A rank's calls, one by one, are not the reference's (`same_order=True`): a test that
    accepts several orders catches this and tries the next."""


def check(student: Callable, reference: Callable, make_inputs: Callable, *, world_sizes: Iterable[int] = (2, 4),
          trials: int = 2, forbid: dict[Callable, str] | None = None, allow: Iterable | None = None,
          timeout: float = 60.0,
          rtol: float | None = None, atol: float | None = None, same_traffic: bool = False,
          same_order: bool = False, same_overlap: bool = False, gpu: bool = False, quiet: bool = False) -> None:
    """Compare `student(*inputs)` with `reference(*inputs)` on every rank, for each world size.

    `make_inputs(r)` returns the tuple of arguments for one rank, given an `InputContext`
    `r` (its rank, world size, a generator `r.shared` seeded alike on every rank for shapes,
    and `r.local` seeded per rank for values); both functions get their own deep copy.
    `forbid` maps forbidden functions to the reason; `allow` names what of parakit the student's
    code may call (functions, classes, modules: `allow.gated`), and anything else of parakit's
    it calls trips (every lesson's check names one; None gates nothing here, and the sealed
    judge refuses to grade it). `same_traffic`: the communication must match too (see the
    module's docstring); `same_order`: each rank's calls, one by one, in the reference's order,
    each of the same kind, with the same peer and bytes; `same_overlap` (sealed grading only,
    where the relay sees it): as many of each rank's calls in flight while its backward went on
    as the reference's (a blocking call, or one started at the backward's last hook, overlaps
    nothing). `gpu` (sealed grading only): both sides' ranks compute on the emulated GPU box,
    rank r on fgpu:r with its own generator, under NCCL's rule that a call's tensors are on the
    rank's GPU (`parakit.device()`), so that forgetting the device shows as on a GPU; in a
    notebook the ranks compute where the notebook's do. Raises AssertionError (or Tripwire)
    naming the world size, trial and rank that differ.
    """
    if SEALED:
        return SEALED[0].check(student, reference, make_inputs, world_sizes=world_sizes, trials=trials,
                               forbid=forbid, allow=allow, timeout=timeout, rtol=rtol, atol=atol,
                               same_traffic=same_traffic, same_order=same_order, same_overlap=same_overlap, gpu=gpu)
    name, cells = getattr(student, "__name__", "your function"), _cells_of(student, reference)
    world_sizes = list(world_sizes)
    for world_size in world_sizes:
        for trial in range(trials):
            seed = random.randrange(2**31)
            try:
                runs = launcher.launch(_run_pair, student, reference, make_inputs, seed, forbid or {}, allow, cells,
                                       world_size=world_size, timeout=timeout)
            except launcher.LaunchError as error:
                raise AssertionError(f"{name} failed on {world_size} ranks (trial {trial + 1}):\n{error}") from None
            for rank, (got, expected, _) in enumerate(runs):
                if isinstance(got, Tripwire):
                    raise Tripwire(f"rank {rank}: {got}")
                compare_values(got, expected, f"{name} on {world_size} ranks, rank {rank}, trial {trial + 1} "
                                              f"(seed {seed})", rtol, atol, world_size,
                               [traffic for _, _, traffic in runs])
            if same_traffic or same_order:
                compare_traffic([traffic for _, _, traffic in runs],
                                f"{name} on {world_size} ranks, trial {trial + 1} (seed {seed})", same_order)
    if not quiet:
        print(f"passed: {name} matches the reference on {', '.join(map(str, world_sizes))} ranks "
              f"({trials} random input{'s' if trials > 1 else ''} each)")


def check_local(student: Callable, reference: Callable, cases: Iterable[tuple], *,
                forbid: dict[Callable, str] | None = None, allow: Iterable | None = None,
                rtol: float | None = None, atol: float | None = None, gpu: bool = False, quiet: bool = False) -> None:
    """Compare `student(*case)` with `reference(*case)` in this process for every case
    (`forbid`, `allow`, `gpu`: as for `check`; with `gpu` the cases' tensors come to the CPU
    and the functions move them to `parakit.device()`, fgpu:0)."""
    if SEALED:
        return SEALED[0].check_local(student, reference, cases, forbid=forbid, allow=allow, rtol=rtol, atol=atol,
                                     gpu=gpu)
    name = getattr(student, "__name__", "your function")
    cases, cells = list(cases), _cells_of(student, reference)
    for case in cases:
        expected = reference(*copy.deepcopy(case))
        got = _call_guarded(student, copy.deepcopy(case), forbid or {}, allow, cells)
        compare_values(got, expected, f"{name}{tuple(case)!r}", rtol, atol)
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


def _run_pair(student, reference, make_inputs, seed, forbid, allow, cells):
    """On one rank: the same inputs to both functions; the student's runs under tripwires.
    Returns (student's result or Tripwire, reference's result, (their Traffic, its Traffic))."""
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    context = InputContext(rank, world_size, torch.Generator().manual_seed(seed),
                           torch.Generator().manual_seed(seed * 1009 + rank + 1))
    inputs = make_inputs(context)
    with comm.CommLog() as theirs:
        expected = reference(*copy.deepcopy(inputs))
    with comm.CommLog() as mine:
        try:
            got = _call_guarded(student, copy.deepcopy(inputs), forbid, allow, cells)
        except Tripwire as trip:  # sent back as a value: the message alone says it all
            got = trip
    return got, expected, (Traffic.of(mine), Traffic.of(theirs))


@dataclass(frozen=True)
class Traffic:
    """How one rank communicated in one call: collectives by kind, the peers of its
    point-to-point calls, and the bytes it sent (comm's ring model for collectives)."""

    collectives: Counter
    sent_to: frozenset
    received_from: frozenset
    bytes_sent: int
    messages: int  # point-to-point sends
    order: tuple = ()  # (kind, peer, bytes passed in) of each call, in order
    overlapped: int | None = None  # calls in flight while the backward went on (None: not seen)

    @classmethod
    def of(cls, log: "comm.CommLog") -> "Traffic":
        return cls.of_calls(log.records)

    @classmethod
    def of_calls(cls, calls, overlapped: list[bool] | None = None) -> "Traffic":
        """From a CommLog's records or the judge's relay `Call`s (both have op, peer, nbytes and
        wire_bytes), and the relay's flags of which calls overlapped the backward."""
        kinds = [kind_of(c.op) for c in calls]
        return cls(Counter(k for k in kinds if k not in ("send", "recv")),
                   frozenset(c.peer for c, k in zip(calls, kinds) if k == "send"),
                   frozenset(c.peer for c, k in zip(calls, kinds) if k == "recv"),
                   sum(c.wire_bytes for c in calls), kinds.count("send"),
                   tuple((k, c.peer, c.nbytes) for c, k in zip(calls, kinds)),
                   None if overlapped is None else sum(overlapped))


def kind_of(op: str) -> str:
    """send/isend -> send, all_gather_into_tensor -> all_gather, _reduce_scatter_base -> reduce_scatter, ..."""
    op = op.lstrip("_")
    if op in ("isend", "irecv"):
        return op[1:]
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        if op.startswith(kind):
            return kind
    return op


def compare_traffic(traffic: list[tuple[Traffic, Traffic]], where: str, order: bool = False) -> None:
    """Same collectives on each rank, point-to-point only with the reference's peers, and the
    same bytes sent by all ranks together (how the bytes split over ranks may differ); with
    `order`, each rank's calls one by one as the reference's (kind, peer, bytes)."""
    for rank, (mine, theirs) in enumerate(traffic):
        if order and mine.order != theirs.order:
            raise OrderDiffers(f"{where}, rank {rank}: {_order_difference(mine.order, theirs.order)}")
        if mine.collectives != theirs.collectives:
            raise AssertionError(f"{where}, rank {rank}: it called {_calls(mine.collectives)}; the reference calls "
                                 f"{_calls(theirs.collectives)}")
        for verb, got, want in (("sent to", mine.sent_to, theirs.sent_to),
                                ("received from", mine.received_from, theirs.received_from)):
            if not got <= want:
                raise AssertionError(f"{where}, rank {rank}: it {verb} ranks {sorted(got)}; the reference only "
                                     f"{verb} {sorted(want) or 'no rank'}")
    got, want = (sum(t[i].bytes_sent for t in traffic) for i in (0, 1))
    if got != want:
        raise AssertionError(f"{where}: the ranks sent {got:,} bytes in all; the reference sends {want:,}")


def compare_overlap(traffic: list[tuple[Traffic, Traffic]], where: str) -> None:
    """As many calls in flight while the backward went on, on each rank, as the reference."""
    for rank, (mine, theirs) in enumerate(traffic):
        if mine.overlapped is not None and mine.overlapped != theirs.overlapped:
            raise AssertionError(
                f"{where}, rank {rank}: {mine.overlapped} of its {len(mine.order)} calls were in flight while the "
                f"backward went on; the reference's {theirs.overlapped} of {len(theirs.order)}. Start each one "
                f"(async_op=True) as soon as its gradients are ready, and wait only after the backward")


def _order_difference(mine: tuple, theirs: tuple) -> str:
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            return f"its call #{i + 1} is {_call_text(a)}; the reference's is {_call_text(b)}"
    return f"it made {len(mine)} calls; the reference makes {len(theirs)}"


def _call_text(call: tuple) -> str:
    kind, peer, nbytes = call
    return f"a {kind}" + (f" with rank {peer}" if peer is not None else "") + f" of {nbytes:,} bytes"


def _calls(collectives: Counter) -> str:
    return ", ".join(f"{kind} x{n}" for kind, n in sorted(collectives.items())) or "no collective"


def _call_guarded(fn, args, forbid: dict[Callable, str], allow: list | None, cells: tuple[str, ...]):
    """Call fn(*args); if it reaches any forbidden function, or anything of parakit's that
    `allow` does not name from the student's own code (code in the files `cells`: `_cells_of`),
    raise Tripwire."""
    from parakit.grading import allow as allowing
    codes = {inspect.unwrap(f).__code__: (f, why) for f, why in forbid.items()}
    tripped = []
    name = getattr(fn, "__name__", "your function")
    gate = None if allow is None else allowing.Gate(allowing.gated(allow), allowing.message(name, allow).format,
                                                    tripped.append, student=cells, trusted=())

    def watch(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            tripped.append(_trip_message(fn, *codes[frame.f_code]))
            raise Tripwire(tripped[-1])
        if gate is not None:
            gate.watch(frame, event, arg)

    previous, previous_threads = sys.getprofile(), threading.getprofile()
    if codes or gate is not None:  # this thread, and the threads fn starts (DataParallel's workers, say)
        sys.setprofile(watch)
        threading.setprofile(watch)
    try:
        result = fn(*args)
    finally:
        sys.setprofile(previous)
        threading.setprofile(previous_threads)
    if tripped:  # the student caught the Tripwire and went on
        raise Tripwire(tripped[0])
    return result


_PARAKIT = str(Path(__file__).parents[1]) + os.sep


def _cells_of(fn, reference) -> tuple[str, ...]:
    """The files of the student's code in a notebook: the cells that `fn` reaches and the
    reference does not, except those of the code calling the check now (a test's wrapper
    around the student's function is the instructor's, as are the helpers both sides use)."""
    calling = {frame.f_code.co_filename for frame, _ in traceback.walk_stack(None)}
    return tuple(sorted(_reached(fn) - _reached(reference) - calling)) or ("<no student code>",)


def _reached(fn) -> set[str]:
    """The cells (files outside Python's, the venv's and parakit's folders) of fn's code, of
    the functions and classes it holds (a closure's, a functools.partial's) and of those its
    code names as globals: one step, as far as a test's wrapper reaches the answer."""
    fn, near = inspect.unwrap(fn), []
    while isinstance(fn, functools.partial):
        near += [*fn.args, *fn.keywords.values()]
        fn = inspect.unwrap(fn.func)
    code = getattr(fn, "__code__", None)
    near += [c.cell_contents for c in getattr(fn, "__closure__", None) or ()]
    if code is not None:
        names = {i.argval for c in _codes_in(code) for i in dis.get_instructions(c) if i.opname == "LOAD_GLOBAL"}
        near += [v for n, v in getattr(fn, "__globals__", {}).items() if n in names]
    files = set()
    for f in [fn] + [f for f in near if callable(f)]:
        methods = [v for v in vars(f).values() if inspect.isfunction(v)] if inspect.isclass(f) else [f]
        for m in methods:
            file = getattr(getattr(inspect.unwrap(m), "__code__", None), "co_filename", None)
            if file is not None and not file.startswith((sys.prefix, sys.base_prefix, _PARAKIT)):
                files.add(file)
    return files


def _codes_in(code):
    """A code object and the ones nested in it (its lambdas, comprehensions, inner functions)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, type(code)):
            yield from _codes_in(const)


def _trip_message(fn, forbidden, why) -> str:
    where = f"{getattr(forbidden, '__module__', '')}.{getattr(forbidden, '__qualname__', forbidden)}"
    return f"{getattr(fn, '__name__', 'your function')} called {where}, which this exercise forbids: {why}"


def compare_values(got, expected, what: str, rtol, atol, parts: int | None = None,
                   traffic: list[tuple[Traffic, Traffic]] | None = None) -> None:
    """Raise AssertionError unless `got` equals `expected`, saying where they differ: the
    item, the first element, the chunk when a tensor is cut in `parts` pieces (one per rank),
    and how each rank's messages differ from the reference's when `traffic` (mine, theirs
    per rank) is given.

    Equal means: the same type at every level (a list is not a tuple, a bool not an int, an
    int not a float), dicts with the same keys, equal strings, ints and None; floats and
    tensors (same dtype, shape and device; a nested Parameter may stand for a tensor) close
    to rtol/atol, by default the dtype's as in `torch.testing.assert_close`, NaN never
    close. Where every expected value is nearer zero than atol (largest magnitude s, 0 < s
    < atol), zeros would pass on atol alone: then atol counts at that scale, as atol * s."""
    if type(got) is not type(expected):
        raise AssertionError(f"{what}: returned a {type(got).__name__}, expected a {type(expected).__name__}")
    where = _first_difference(got, expected, rtol, atol, parts)
    if where:
        raise AssertionError(f"{what}: {where}{_traffic_difference(traffic or [])}")


_TOLERANCE = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float32: (1.3e-6, 1e-5),
              torch.float64: (1e-7, 1e-7), torch.complex64: (1.3e-6, 1e-5), torch.complex128: (1e-7, 1e-7)}


def _first_difference(got, expected, rtol, atol, parts, path: str = "") -> str | None:
    """The first place two nested values differ, in words (None where they are equal)."""
    name = f"item {path}" if path else "the result"
    if isinstance(got, torch.Tensor) and isinstance(expected, torch.Tensor):
        return _tensor_difference(got, expected, rtol, atol, parts, f"item {path}: " if path else "")
    if type(got) is not type(expected):
        return f"{name} is a {type(got).__name__}, the reference's a {type(expected).__name__}"
    if isinstance(got, (list, tuple)):
        if len(got) != len(expected):
            return f"{name} has {len(got)} items, the reference's {len(expected)}"
        return _first_of(((a, b, f"{path}[{i}]") for i, (a, b) in enumerate(zip(got, expected))), rtol, atol, parts)
    if isinstance(got, dict):
        return _key_difference(got, expected, name) or \
            _first_of(((got[k], expected[k], f"{path}[{k!r}]") for k in expected), rtol, atol, parts)
    if type(got).__module__ == "numpy" and hasattr(got, "dtype"):  # arrays and numpy scalars: as tensors
        return _tensor_difference(torch.as_tensor(got), torch.as_tensor(expected), rtol, atol, parts,
                                  f"item {path}: " if path else "")
    if isinstance(got, (float, complex)) and _scalar_close(got, expected, rtol, atol):
        return None
    return None if _equal(got, expected) else f"{name} is {got!r}, the reference's {expected!r}"


def _first_of(pairs, rtol, atol, parts) -> str | None:
    for a, b, path in pairs:
        found = _first_difference(a, b, rtol, atol, parts, path)
        if found:
            return found
    return None


def _key_difference(got: dict, expected: dict, name: str) -> str | None:
    missing = [k for k in expected if k not in got]
    if missing:
        return f"{name} lacks the key {missing[0]!r}"
    extra = [k for k in got if k not in expected]
    return f"{name} has a key {extra[0]!r} the reference's does not" if extra else None


def _equal(got, expected) -> bool:
    try:
        return bool(got == expected)
    except Exception:  # an object whose == does not give one answer (an array, say): not equal here
        return False


def _scalar_close(got, expected, rtol, atol) -> bool:
    """A Python float (or complex) within float64's tolerances of the expected one."""
    r, t = _tolerances(torch.float64, rtol, atol)
    t = _at_scale(t, abs(expected))
    return got == expected or abs(got - expected) <= t + r * abs(expected)


def _tolerances(dtype: torch.dtype, rtol, atol) -> tuple[float, float]:
    """(rtol, atol) as given, else the dtype's defaults (assert_close's)."""
    r, t = _TOLERANCE.get(dtype, (0.0, 0.0))
    return rtol if rtol is not None else r, atol if atol is not None else t


def _at_scale(atol: float, scale: float) -> float:
    """atol, or atol * scale where every expected value is nearer zero than atol (0 < scale < atol)."""
    return atol * scale if 0 < scale < atol else atol


def _tensor_difference(got: torch.Tensor, expected: torch.Tensor, rtol, atol, parts, item: str) -> str | None:
    """The first element where two tensors differ, in words (None where they are close)."""
    if got.shape != expected.shape or got.dtype != expected.dtype or got.device != expected.device:
        return f"{item}a {got.dtype} tensor of shape {list(got.shape)} on {got.device}, the reference's a " \
               f"{expected.dtype} of shape {list(expected.shape)} on {expected.device}"
    a, b = got.detach().cpu().reshape(-1), expected.detach().cpu().reshape(-1)
    note = ""
    if a.is_floating_point() or a.is_complex():
        wide = torch.complex128 if a.is_complex() else torch.float64
        a, b = a.to(wide), b.to(wide)
        finite = b[b.isfinite()].abs()
        scale = float(finite.max()) if finite.numel() else 0.0
        r, t = _tolerances(expected.dtype, rtol, atol)
        wrong = ~torch.isclose(a, b, rtol=r, atol=_at_scale(t, scale))
        if _at_scale(t, scale) != t:
            note = f"; the reference's values are all below atol {t:g}, so atol counts at their scale: {t * scale:.3g}"
    else:
        wrong = a != b
    index = wrong.nonzero().flatten().tolist()
    if not index:
        return None
    first = list(torch.unravel_index(torch.tensor(index[0]), expected.shape)) if expected.dim() else []
    text = (f"{item}{len(index)} of {a.numel()} elements differ, the first at {[int(i) for i in first]} "
            f"(got {a[index[0]].item():.6g}, expected {b[index[0]].item():.6g}){note}")
    if parts and parts > 1 and a.numel() >= parts:
        bounds = torch.tensor([len(c) for c in a.tensor_split(parts)]).cumsum(0)
        chunks = sorted({int(torch.searchsorted(bounds, i, right=True)) for i in index})
        text += f"; they lie in chunk{'s' if len(chunks) > 1 else ''} {', '.join(map(str, chunks))} of {parts} " \
                f"(the flattened tensor cut in one chunk per rank)"
    return text


def _traffic_difference(traffic: list[tuple[Traffic, Traffic]]) -> str:
    lines = [f"rank {rank} sent {mine.messages} message{'s' if mine.messages != 1 else ''} "
             f"({mine.bytes_sent:,} bytes); the reference sends {theirs.messages} ({theirs.bytes_sent:,} bytes)"
             for rank, (mine, theirs) in enumerate(traffic)
             if (mine.messages, mine.bytes_sent) != (theirs.messages, theirs.bytes_sent)]
    return ". How it communicated: " + "; ".join(lines) if lines else ""
