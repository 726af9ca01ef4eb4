"""Devices: the one this rank computes on, the backend rule, the memory each device holds, and
the clock of a rank's GPU (`CudaClock`: CUDA events read in perf_counter seconds, for work
the GPU runs after the call that queued it returned; DDP's and the pipeline runtime's timings).

The rule every technique and the launcher follow: NCCL with one GPU per rank where there
are enough GPUs (`select_backend`), else gloo on the CPU. Under NCCL each rank works on its
own GPU, GPU LOCAL_RANK, made current before the process group exists and passed to it as
`device_id`, so that NCCL connects every rank at once (`join`); `device()` is that GPU, the
CPU under gloo. The GPUs are CUDA's, or fgpu's on the emulated box
(PARAKIT_EMULATE_GPUS=N, see `parakit.emulation`), whose NCCL is the backend "fnccl".

For DataParallel, devices are GPUs where there are enough of them. On CPU they are
*logical*: `torch.device("cpu", i)` for i = 0..k-1, all backed by the CPU; which logical
device a tensor lives on is known to the `MemoryMeter` measuring, which counts every
storage on the device it was made on (see MemoryMeter). Without a meter, CPU tensors live
on the host, and copies between logical devices are plain copies.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from typing import Sequence

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from parakit import emulation

__all__ = ["device", "accelerator", "join", "resolve_backend", "select_backend", "resolve_devices", "MemoryMeter",
           "on_device", "where", "to_device", "copying_to", "current_meter", "CudaClock", "CudaSpan"]

BACKEND_ENV = "PARAKIT_BACKEND"  # what backend 'auto' means on a real machine, where set (resolve_backend)
_local = threading.local()  # per thread: .meter (the MemoryMeter measuring), .target (a copy's device)
if emulation.gpus() is not None:  # the emulated box: its GPUs exist from the first import of parakit
    emulation.install()


_GPU_OF = {"nccl": "cuda", emulation.BACKEND: emulation.DEVICE}  # NCCL's backends -> their device type


def device() -> torch.device:
    """The device this rank computes on: its GPU when the process group runs NCCL, else the CPU."""
    kind = _GPU_OF.get(dist.get_backend()) if dist.is_initialized() else None
    return torch.device(kind, _module(kind).current_device()) if kind else torch.device("cpu")


def synchronize(where: torch.device | None = None) -> None:
    """Wait until `where` (this rank's device by default) has run the work queued on it: a GPU's
    (CUDA's, or fgpu's on the emulated box) run asynchronously, so a clock read before this
    misses it; nothing to wait for on the CPU."""
    where = device() if where is None else torch.device(where)
    if where.type != "cpu":
        _module(where.type).synchronize(where)


def accelerator() -> tuple[str, int]:
    """The kind of GPU this machine gives its ranks and how many: ("fgpu", N) on the emulated
    box (PARAKIT_EMULATE_GPUS=N), else ("cuda", the CUDA devices visible, maybe 0)."""
    emulated = emulation.gpus()
    if emulated is not None:
        return emulation.DEVICE, emulated
    return "cuda", torch.cuda.device_count() if torch.cuda.is_available() else 0


def join(backend: str, local_rank: int, gpus: int | None = None, **init_kwargs) -> torch.device:
    """Join the default process group under the rule, and return this rank's device: under
    NCCL ("nccl", or "fnccl" with `gpus` emulated GPUs) GPU `local_rank`, made current first
    and passed as device_id, so NCCL connects every rank now instead of each pair at its first
    send; under gloo the CPU. `init_kwargs` go to init_process_group (store, rank, ...)."""
    if backend == emulation.BACKEND:
        emulation.install(gpus)
    kind = _GPU_OF.get(backend)
    rank_device = torch.device(kind, local_rank) if kind else None
    if kind:
        _module(kind).set_device(rank_device)
    dist.init_process_group(backend, device_id=rank_device, **init_kwargs)
    return rank_device or torch.device("cpu")


def resolve_backend(backend: str, world_size: int) -> str:
    """'auto' is NCCL when there is one GPU per rank (and NCCL is built in), else gloo; on the
    emulated box NCCL is its "fnccl". On a real machine PARAKIT_BACKEND, where set ("gloo" or
    "nccl"), is what 'auto' means: the test suite pins gloo with it, so that its CPU tests
    mean the same on a GPU host (the emulated box keeps its own rule)."""
    kind, gpus = accelerator()
    emulated = kind == emulation.DEVICE
    pinned = os.environ.get(BACKEND_ENV, "").strip().lower()
    if pinned and str(backend).lower() == "auto" and not emulated:
        if pinned not in ("gloo", "nccl"):
            raise ValueError(f"{BACKEND_ENV}={pinned!r}: set it to 'gloo' or 'nccl' (what 'auto' means), or unset it")
        backend = pinned
    asked = "nccl" if str(backend).lower() == emulation.BACKEND else backend
    if asked != backend and not emulated:
        raise ValueError(f"backend {backend!r} is the emulated NCCL: set {emulation.ENV}=N to emulate N GPUs, "
                         f"or use 'nccl', 'gloo' or 'auto'")
    chosen = select_backend(asked, world_size, gpus, emulated or dist.is_nccl_available(),
                            f"{gpus} emulated GPU(s) ({emulation.ENV}={gpus})" if emulated else None)
    return emulation.BACKEND if chosen == "nccl" and emulated else chosen


def select_backend(backend: str, world_size: int, gpus: int, nccl_built: bool, visible: str | None = None) -> str:
    """`resolve_backend`'s rule, given the visible GPUs (`visible` words them) and whether torch has NCCL."""
    choice = str(backend).lower()
    if choice == "auto":
        return "nccl" if nccl_built and gpus >= world_size else "gloo"
    if choice == "gloo":
        return "gloo"
    if choice == "nccl":
        if not nccl_built:
            raise ValueError("backend 'nccl' needs one GPU per rank and a CUDA build of torch, but this build of "
                             "torch has no NCCL; use backend='gloo' (or 'auto', which picks gloo here)")
        if gpus < world_size:
            fewer = f", or world_size={gpus} or fewer (rank {gpus} would have no GPU)" if gpus else ""
            raise ValueError(f"backend 'nccl' needs one GPU per rank: world_size={world_size} but "
                             f"{visible or f'{gpus} GPU(s) are visible'}; use backend='gloo' (or 'auto', which picks "
                             f"gloo here){fewer}")
        return "nccl"
    raise ValueError(f"backend {backend!r} is not supported: use 'auto', 'gloo' or 'nccl'")


def _module(kind: str):
    """torch.cuda, or torch.fgpu on the emulated box: the device's current-device and memory API."""
    if kind == emulation.DEVICE and not hasattr(torch, kind):
        emulation.install()
    return getattr(torch, kind)


def resolve_devices(device_ids: Sequence[int | torch.device] | None) -> list[torch.device]:
    """GPUs when there are enough of them (CUDA's, or fgpu's on the emulated box), else
    logical devices backed by the CPU (torch.device("cpu", i): the index names the logical
    device). A torch.device is kept as given, so torch.device("cpu", i) asks for logical
    devices on a GPU machine too."""
    kind, gpus = accelerator()
    if device_ids is None:
        device_ids = list(range(max(gpus, 1)))
    device_ids = list(device_ids)
    if not device_ids:
        raise ValueError("device_ids is empty: pass at least one device id, e.g. device_ids=[0, 1]")
    if all(isinstance(d, torch.device) for d in device_ids):
        return device_ids
    ids = [d.index if isinstance(d, torch.device) else d for d in device_ids]
    if max(ids) < gpus:
        _module(kind)
        return [torch.device(kind, i) for i in ids]
    return [torch.device("cpu", i) for i in ids]


def where(tensor: torch.Tensor) -> torch.device | None:
    """The device a tensor lives on: its GPU, or the logical device the measuring
    MemoryMeter placed it on (None when no meter knows it: host memory)."""
    if tensor.device.type != "cpu":
        return tensor.device
    meter = current_meter()
    index = meter.device_of(tensor) if meter else None
    return None if index is None else torch.device("cpu", index)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`: itself (a view) if it is there already, else a copy made there
    (a logical device's copy of a GPU tensor, or a copy to the host, lands on the host)."""
    if where(tensor) == device:
        return tensor.view_as(tensor)
    if device.type != "cpu" or tensor.device.type != "cpu":
        return tensor.to(device if device.type != "cpu" else "cpu", copy=True)
    with copying_to(device.index):
        return tensor.clone(memory_format=torch.contiguous_format)


def current_meter() -> "MemoryMeter | None":
    """The MemoryMeter measuring in this thread, if any."""
    return getattr(_local, "meter", None)


@contextlib.contextmanager
def copying_to(index: int):
    """Tensors made in this block (by a copy) land on logical device `index`."""
    _local.target = index
    try:
        yield
    finally:
        _local.target = None


# ------------------------------------------------------------------------- memory per device

class MemoryMeter:
    """Peak bytes per device while the `with` block runs, indexed like `device_ids`.

    On GPUs: torch.cuda.max_memory_allocated (torch.fgpu's on the emulated box; peaks reset
    on entry). On logical CPU devices: every tensor an operator returns in this thread, and
    in parallel_apply's threads, is placed on a device (the device of a copy's destination;
    else of its first input that has one; else the thread's current device, 0 in the
    caller's thread) and its storage counted there until the storage dies. Views share
    their storage and count once. Tensors made before the block count once `place`d (e.g.
    the parameters).
    """

    def __init__(self, device_ids: Sequence[int | torch.device] | None = None):
        self.devices = resolve_devices(device_ids)
        self.gpus = _module(self.devices[0].type) if self.devices[0].type != "cpu" else None
        self.live = {d.index: 0 for d in self.devices}
        self.peak = dict(self.live)
        self._storages: dict[int, tuple[int, int]] = {}  # storage id -> (device index, bytes)
        self._lock = threading.Lock()

    def __enter__(self) -> "MemoryMeter":
        for d in self.devices if self.gpus else ():
            self.gpus.synchronize(d)
            self.gpus.reset_peak_memory_stats(d)
        self._context = on_device(self.devices[0], self)
        self._context.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._context.__exit__(*exc)
        for d in self.devices if self.gpus else ():
            self.gpus.synchronize(d)
            self.peak[d.index] = self.gpus.max_memory_allocated(d)

    def peaks(self) -> list[int]:
        """Peak bytes of each device, in device order."""
        return [self.peak[d.index] for d in self.devices]

    def place(self, tensors, device_index: int) -> None:
        """Count these tensors' storages on a device (once; a storage already placed stays):
        on logical devices, a GPU's tensors count too (a lesson measuring on CPU logical
        devices while its ranks compute on GPUs)."""
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._count(t.untyped_storage(), device_index)

    def device_of(self, tensor: torch.Tensor) -> int | None:
        entry = self._storages.get(tensor.untyped_storage()._cdata)
        return entry[0] if entry else None

    def _count(self, storage, index: int) -> None:
        with self._lock:
            key = storage._cdata
            if key in self._storages:
                return
            nbytes = storage.nbytes()
            self._storages[key] = (index, nbytes)
            self.live[index] += nbytes
            self.peak[index] = max(self.peak[index], self.live[index])
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        with self._lock:
            index, nbytes = self._storages.pop(key)
            self.live[index] -= nbytes


class _Attribute(TorchDispatchMode):
    """Places every operator's output tensors with the meter (see MemoryMeter)."""

    def __init__(self, meter: MemoryMeter, device_index: int):
        super().__init__()
        self.meter, self.device_index = meter, device_index

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        index = getattr(_local, "target", None)
        if index is None:
            known = [self.meter.device_of(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            index = next((k for k in known if k is not None), self.device_index)
        self.meter.place(out, index)
        return out


class on_device:
    """In this thread: `device` is current (torch.cuda.device on GPUs, torch.fgpu.device on
    the emulated box) and `meter`, if any, measures (its dispatch mode is active)."""

    def __init__(self, device: torch.device, meter: MemoryMeter | None):
        self.device, self.meter = device, meter

    def __enter__(self):
        self.saved = getattr(_local, "meter", None), getattr(_local, "target", None)
        _local.meter, _local.target = self.meter, None
        self.contexts = []
        if self.device.type != "cpu":
            self.contexts.append(_module(self.device.type).device(self.device))
        elif self.meter is not None:
            self.contexts.append(_Attribute(self.meter, self.device.index))
        for c in self.contexts:
            c.__enter__()
        return self

    def __exit__(self, *exc):
        for c in reversed(self.contexts):
            c.__exit__(*exc)
        _local.meter, _local.target = self.saved


class CudaClock:
    """CUDA events on `device` in time.perf_counter() seconds: an anchor event recorded while
    the GPU is idle marks a known perf_counter time, and an event's seconds are the anchor's
    plus the GPU's time between them."""

    def __init__(self, device: torch.device):
        torch.cuda.synchronize(device)
        self.anchor = torch.cuda.Event(enable_timing=True)
        self.anchor.record()
        self.anchor.synchronize()
        self.at = time.perf_counter()

    def stamp(self) -> torch.cuda.Event:
        """An event recorded on the current stream: it completes when the GPU gets there."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, event: torch.cuda.Event) -> float:
        event.synchronize()
        return self.at + self.anchor.elapsed_time(event) / 1e3

    def span(self, start, end) -> "CudaSpan":
        return CudaSpan(self, start, end)


class CudaSpan:
    """(start, end) of a reduction as two CUDA events: unpacked, indexed or pickled, the two
    perf_counter seconds (waiting for the GPU to run them)."""

    def __init__(self, clock: CudaClock, start, end):
        self.clock, self.start, self.end = clock, start, end

    def __iter__(self):
        return iter((self.clock.seconds(self.start), self.clock.seconds(self.end)))

    def __getitem__(self, i):
        return tuple(self)[i]

    def __reduce__(self):
        return tuple, (tuple(self),)

    def __repr__(self):
        return repr(tuple(self))
