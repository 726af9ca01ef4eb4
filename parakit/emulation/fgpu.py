"""fgpu: GPUs emulated on the CPU, one index per rank (fgpu:0, fgpu:1, ...).

PyTorch's PrivateUse1 device, renamed "fgpu" and served from Python: a tensor on fgpu:i
lives in CPU memory, and every operator on it runs PyTorch's CPU kernel on that memory
(`_kernel`), rounded as a GPU's kernels round (`numerics`). What makes it a GPU is what it refuses, as CUDA does: an operator whose
tensors live on two devices (fgpu:0 and fgpu:1, or fgpu:0 and the CPU) raises "Expected
all tensors to be on the same device"; only 0-dim CPU tensors pass, as scalars, and copies
(`.to`, `copy_`, `.cpu()`) move between devices.

And it runs asynchronously, as a GPU does (`gpu_streams`): a matrix product (mm, addmm, bmm,
baddbmm) is queued on the current stream, its output made at once and written when the
stream's thread gets there; every other operator runs on the host once that stream has run
what came before, so that a read (`.cpu()`, `.item()`, printing) waits and a timing without
`synchronize()` misses the queued work. A tensor freed on the host while another stream's
queued work still reads it has its memory handed out again (filled with NaN) unless
`record_stream` named that stream. Streams, events, `stream()`, `current_stream` and
`default_stream` as torch.cuda's.

`torch.fgpu` mirrors the part of `torch.cuda` the course uses: device_count,
current_device, set_device, device, synchronize, Stream, Event, stream, memory_allocated,
max_memory_allocated, reset_peak_memory_stats (every storage made on a device counts there until it dies).
Each device draws random numbers from its own generator, never the CPU's, where a seed starts
another stream than on the CPU, as on a CUDA device (`rng`; manual_seed, get_rng_state and their
kin as torch.cuda's; `torch.Generator("fgpu:i")` makes another such generator, which fgpu's
operators draw from when given it). Backward runs in the thread that
calls it (autograd's per-device threads need a device count a Python backend cannot give).
`torch.autocast("fgpu")` casts as CUDA's autocast does (`amp`).
`.to("fgpu")` without an index means fgpu:0 (PyTorch asks a device guard that a Python
backend cannot give), where factories (`torch.ones(2, device="fgpu")`) take the current
device: write the index, as `parakit.device()` does. A storage made on fgpu
(`torch.UntypedStorage(n, device="fgpu")`, as deepcopy and `storage.clone()` do) is made on
the CPU and handed over (`_new_storage`); `storage.resize_` trades memory (`_resize_storage`).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
import threading
import weakref

import torch

from parakit.emulation import amp, gpu_streams, numerics, rng

__all__ = ["NAME", "install", "cpu_view", "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats"]

NAME = "fgpu"
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_CPU_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
_aten = torch.ops.aten
_SET = _aten.set_.source_Storage_storage_offset
_state = {"count": 0, "default": 0, "installed": False}  # devices; the current device of new threads
_local = threading.local()  # .device: this thread's current device
_memory: dict[int, list[int]] = {}  # device index -> [live bytes, peak bytes]
_lock = threading.Lock()


# ----------------------------------------------------------------------------- torch.fgpu

def is_available() -> bool:
    return _state["count"] > 0


def is_initialized() -> bool:
    return _state["installed"]


def device_count() -> int:
    return _state["count"]


def current_device() -> int:
    return getattr(_local, "device", _state["default"])


def set_device(device) -> None:
    """Make `device` (an index or torch.device) current in this thread, and in threads started later."""
    index = _index(device)
    _local.device = index
    if threading.current_thread() is threading.main_thread():
        _state["default"] = index


class device(contextlib.ContextDecorator):
    """`with torch.fgpu.device(i):` makes fgpu:i current in the block, as torch.cuda.device does."""

    def __init__(self, device):
        self.index = _index(device)

    def __enter__(self):
        self.saved = current_device()
        _local.device = self.index

    def __exit__(self, *exc):
        _local.device = self.saved


def synchronize(device=None) -> None:
    """The host waits until every stream of `device` has run what was queued on it."""
    gpu_streams.synchronize(_index(device))


def current_stream(device=None) -> gpu_streams.Stream:
    return gpu_streams.current(_index(device))


def default_stream(device=None) -> gpu_streams.Stream:
    return gpu_streams.default(_index(device))


Stream, Event, stream = gpu_streams.Stream, gpu_streams.Event, gpu_streams.stream  # a stream: its work on its thread


def memory_allocated(device=None) -> int:
    """Bytes of the storages alive on `device` (the current one by default)."""
    return _memory.get(_index(device), [0, 0])[0]


def max_memory_allocated(device=None) -> int:
    """The most bytes alive on `device` at once since the last reset."""
    return _memory.get(_index(device), [0, 0])[1]


def reset_peak_memory_stats(device=None) -> None:
    with _lock:
        counts = _memory.setdefault(_index(device), [0, 0])
        counts[1] = counts[0]


def empty_cache() -> None:
    """No cache to empty: storages go back to the CPU's allocator when they die."""


_initialized = True  # torch.cuda's flag, which torch.utils.checkpoint asks before it saves a device's generators


def manual_seed(seed: int) -> None:
    """Seed the current device's generator (`torch.manual_seed` seeds every device's, and the CPU's)."""
    _generator(None).manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for index in range(device_count()):
        _generator(index).manual_seed(int(seed))


def seed() -> None:
    """Seed the current device's generator with a random number."""
    _generator(None).seed()


def seed_all() -> None:
    """Seed every device's generator with one random number, as torch.cuda.seed_all does."""
    manual_seed_all(_generator(0).seed())


def initial_seed() -> int:
    return _generator(None).initial_seed()


def get_rng_state(device=NAME) -> torch.Tensor:
    """The state of `device`'s generator (a CPU ByteTensor), as torch.cuda.get_rng_state."""
    return _generator(device).get_state()


def set_rng_state(new_state: torch.Tensor, device=NAME) -> None:
    _generator(device).set_state(new_state.clone())


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(index) for index in range(device_count())]


def set_rng_state_all(new_states) -> None:
    for index, state in enumerate(new_states):
        set_rng_state(state, index)


def _generator(device) -> rng.DeviceGenerator:
    """`device`'s generator, once the work queued there has run (CUDA counts a kernel's draws
    when it is queued, so its state, read or set by the host, is past every queued kernel)."""
    index = _index(device)
    synchronize(index)
    return rng.generator(index)


def get_amp_supported_dtype() -> list[torch.dtype]:
    """What torch.autocast("fgpu") may cast to (it asks before it starts)."""
    return [torch.float16, torch.bfloat16]


def _is_in_bad_fork() -> bool:
    return False


def _index(device) -> int:
    if device is None:
        return current_device()
    if isinstance(device, str):
        device = torch.device(device)
    index = device.index if isinstance(device, torch.device) else int(device)
    index = current_device() if index is None else index
    if not 0 <= index < _state["count"]:
        raise RuntimeError(f"{NAME}:{index}: invalid device ordinal: this box has {_state['count']} emulated "
                           f"GPUs ({NAME}:0 to {NAME}:{_state['count'] - 1})")
    return index


# ----------------------------------------------------------------------------- registration

_LIBRARY = torch.library.Library("_", "IMPL")
_ATEN = torch.library.Library("aten", "IMPL")


def install(count: int) -> None:
    """Register fgpu with `count` devices (once per process; a later call changes the count)."""
    _state["count"] = count
    if _state["installed"]:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend
    from parakit.emulation import native
    native.install()  # C++ hooks first (pinned memory): the Python registration keeps hooks already there
    _setup_privateuseone_for_python_backend(NAME, backend_module=sys.modules[__name__])
    torch._C._set_multithreading_enabled(False)  # backward in the calling thread (see the module's note)
    _LIBRARY.fallback(_kernel, "PrivateUse1")
    for op in _cpu_ops():
        _ATEN.impl(op, functools.partial(_kernel, op), "PrivateUse1")
    amp.install(NAME)
    torch.serialization.register_package(0, lambda storage: None, _load)
    _ORIGINAL.update(new=torch.UntypedStorage.__new__, resize_=torch.UntypedStorage.resize_)
    torch.UntypedStorage.__new__, torch.UntypedStorage.resize_ = _new_storage, _resize_storage
    torch.Generator = _Generator
    _state["installed"] = True


class _AnyGenerator(type):
    def __instancecheck__(cls, instance):
        return isinstance(instance, torch._C.Generator)


class _Generator(metaclass=_AnyGenerator):
    """torch.Generator, where one made for fgpu:i is a new `rng.DeviceGenerator` (a CPU generator
    seeded as a GPU's: PyTorch asks a Python backend for a generator of its own, which it cannot
    give), which fgpu's operators draw from when they are given it."""

    def __new__(cls, device="cpu"):
        if torch.device(device).type == NAME:
            _index(device)  # fgpu:N beyond the box is refused, as CUDA refuses it
            return rng.DeviceGenerator()
        return torch._C.Generator(device)


_ORIGINAL = {}  # torch.UntypedStorage's own __new__ and resize_


def _new_storage(cls, *args, device=None, **kwargs):
    """torch.UntypedStorage(..., device="fgpu:i"): made on the CPU and owned on fgpu:i (a
    Python backend has no allocator of its own: PyTorch would crash making it there)."""
    if device is not None and torch.device(device).type == NAME:
        return _storage_on(_ORIGINAL["new"](cls, *args, **kwargs), _index(device))
    return _ORIGINAL["new"](cls, *args, **kwargs) if device is None else _ORIGINAL["new"](cls, *args, device=device,
                                                                                         **kwargs)


def _cpu_ops():
    """The operators PyTorch runs with a kernel per device (not composed of others), and the
    copies between devices: each gets fgpu's kernel by name. (A Python fallback alone would
    do, but PyTorch cannot reach one while a TorchDispatchMode is active, and would run the
    structured operators as an empty tensor plus their out= form: two calls.)"""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    for name in torch._C._dispatch_get_all_op_names():
        if name.startswith("aten::") and has(name, "CPU") and not has(name, "CompositeExplicitAutograd") \
                and not has(name, "CompositeImplicitAutograd"):
            packet, _, overload = name[len("aten::"):].partition(".")
            yield getattr(getattr(_aten, packet), overload or "default")
    yield from _COPIES


def _load(storage, location: str):
    """torch.load (and pickle) of a storage saved from fgpu: its bytes, owned on that device."""
    if location.startswith(NAME):
        return _storage_on(storage, _index(location))
    return None


# ----------------------------------------------------------------------------- the kernel

def _kernel(op, *args, **kwargs):
    """Every operator on fgpu tensors: PyTorch's CPU kernel on the same memory, queued on the
    current stream (`_launch`: the matmul family), or run by the host once that stream has run
    what was queued before it (every other operator: it may read the data; views do not wait)."""
    if op in _METADATA:
        return op.redispatch(_CPU_KEYS, *args, **kwargs)
    if op in _COPIES:
        return _copy(op, *args)
    if op is _aten.record_stream.default:
        return _record_stream(*args)
    if op is _aten.resize_.default:
        return _resize(*args, **kwargs)
    call = _Call(op)
    args, kwargs = call.to_cpu(args), call.to_cpu(kwargs)
    index = current_device() if call.index is None else call.index
    if op in _LAUNCHED:
        return _launch(call, op, args, kwargs, index)
    if not op.is_view:
        gpu_streams.wait_current(index)
    out = _compute(op, args, kwargs, index)
    call.update_inputs()
    return call.to_fgpu(out)


def _launch(call: "_Call", op, args, kwargs, index: int):
    """A kernel launch, as on a GPU: the output made now on fgpu:index, empty, the work queued
    on the current stream, which writes it when it runs; the work keeps the memory it reads,
    not the tensors (the host may free those). Operands that do not fit run on the host at
    once, which raises PyTorch's error."""
    shape = _product_shape(op, args)
    if shape is None:
        gpu_streams.wait_current(index)
        return call.to_fgpu(_compute(op, args, kwargs, index))
    out = torch.empty(shape, dtype=args[-1].dtype)

    def run():
        out.copy_(_compute(op, args, kwargs, index))
    blocks = [_held[on._cdata][2] for _, on in call.storages.values() if on._cdata in _held]
    short = 2 * out.numel() * args[-2].shape[-1] < _SHORT_FLOPS
    gpu_streams.launch(index, run, frozenset(b.owner.data_ptr() for b in blocks), tuple(b.owner for b in blocks), short)
    return _tensor_on(_storage_on(out.untyped_storage(), index), out, index)


def _product_shape(op, args) -> tuple | None:
    """The shape of a matrix product `op` of `args` (mm, addmm, bmm, baddbmm: [..., n, m] @
    [..., m, p] -> [..., n, p], a bias broadcast to it), or None where they do not fit."""
    *bias, x, y = args[:3] if op in _ADDING else args[:2]
    batched = op in (_aten.bmm.default, _aten.baddbmm.default)
    if x.dim() != 2 + batched or y.dim() != 2 + batched or x.shape[-1] != y.shape[-2] or x.dtype != y.dtype \
            or (batched and x.shape[0] != y.shape[0]):
        return None
    shape = (*x.shape[:-1], y.shape[-1])
    for b in bias:
        if b.dtype != x.dtype or b.dim() > len(shape) or any(
                m not in (1, n) for m, n in zip(reversed(b.shape), reversed(shape))):
            return None
    return shape


def _record_stream(tensor: torch.Tensor, stream: torch.Stream) -> None:
    """tensor.record_stream(stream): its memory goes back to the allocator only once `stream`
    has run what was queued on it when the tensor died (`_release`)."""
    entry = _held.get(tensor.untyped_storage()._cdata)
    if entry is not None:
        entry[2].recorded.add(gpu_streams.resolve(stream))


def _compute(op, args, kwargs, index: int):
    """One operator's work on CPU views of fgpu:index's memory: drawn from that device's
    generator (`rng`), rounded as a GPU's kernels round (`numerics`)."""
    with torch._C._ExcludeDispatchKeyGuard(_CPU_AUTOCAST):  # autocast("cpu") is not for a GPU's tensors
        return numerics.call(*rng.drawing(op, args, kwargs, index))


class _Call:
    """One operator's tensors: fgpu inputs seen as CPU tensors on the same memory, and CPU
    outputs given back as fgpu tensors (a view of an input stays a view of its storage)."""

    def __init__(self, op):
        self.op, self.index, self.cpu_found = op, None, None
        self.storages: dict[int, tuple] = {}  # data pointer -> (CPU storage, fgpu storage) on that memory
        self.inputs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (CPU view, fgpu tensor)

    def to_cpu(self, value):
        if isinstance(value, torch.Tensor):
            return self._view(value) if value.device.type == NAME else self._cpu_input(value)
        if isinstance(value, torch.device) and value.type == NAME:
            self._on(_index(value))
            return torch.device("cpu")
        if isinstance(value, (list, tuple)):
            return type(value)(self.to_cpu(v) for v in value)
        if isinstance(value, dict):
            return {k: self.to_cpu(v) for k, v in value.items()}
        return value

    def _cpu_input(self, tensor):
        if tensor.dim() > 0 and self.op.overloadpacket not in _CPU_INDICES_OK:
            self.cpu_found = tensor.device
            self._check()
        return tensor

    def _on(self, index: int) -> None:
        if self.index is not None and index != self.index:
            raise _mixed(f"{NAME}:{self.index}", f"{NAME}:{index}", self.op)
        self.index = index
        self._check()

    def _check(self) -> None:
        if self.index is not None and self.cpu_found is not None:
            raise _mixed(f"{NAME}:{self.index}", str(self.cpu_found), self.op)

    def _view(self, tensor):
        self._on(tensor.device.index)
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:  # no memory (no elements): a kernel may grow it, `update_inputs` takes the new memory
            view = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype)
        else:
            ptr = storage.data_ptr()
            if ptr not in self.storages:
                cpu = torch._C._construct_storage_from_data_pointer(ptr, torch.device("cpu"), storage.nbytes())
                self.storages[ptr] = cpu, storage
            view = torch.empty(0, dtype=tensor.dtype).set_(self.storages[ptr][0], tensor.storage_offset(),
                                                            tensor.size(), tensor.stride())
        self.inputs.append((view, tensor))
        return view

    def update_inputs(self) -> None:
        """An in-place kernel that changed an input's shape or memory (resize_, transpose_):
        its fgpu tensor takes the CPU view's new shape and memory."""
        for view, tensor in self.inputs:
            same_shape = (view.size(), view.stride(), view.storage_offset()) == \
                (tensor.size(), tensor.stride(), tensor.storage_offset())
            memory = view.untyped_storage()
            if same_shape and (memory.nbytes() == 0 or memory.data_ptr() == tensor.untyped_storage().data_ptr()):
                continue
            _SET.redispatch(_CPU_KEYS, tensor, self._storage(view, tensor.device.index), view.storage_offset(),
                            view.size(), view.stride())

    def to_fgpu(self, value):
        if isinstance(value, torch.Tensor):
            for view, tensor in self.inputs:
                if value is view:
                    return tensor
            index = current_device() if self.index is None else self.index
            return _tensor_on(self._storage(value, index), value, index)
        if isinstance(value, (list, tuple)):
            return type(value)(self.to_fgpu(v) for v in value)
        return value

    def _storage(self, cpu: torch.Tensor, index: int):
        """The fgpu storage on `cpu`'s memory: an input's own, or new memory the kernel made."""
        storage = cpu.untyped_storage()
        ptr = storage.data_ptr()
        if storage.nbytes() == 0 or ptr not in self.storages:
            self.storages[ptr] = storage, _storage_on(storage, index)
        return self.storages[ptr][1]


def _mixed(a: str, b: str, op) -> RuntimeError:
    return RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                        f"{a} and {b}! (in {op})")


def _copy(op, src, dst, *rest):
    """`_copy_from(src, dst)` and `_copy_from_and_resize(src, dst)`: copies between devices."""
    if op is _aten._copy_from_and_resize.default and dst.shape != src.shape:
        dst.resize_(src.shape)
    for tensor in (src, dst):  # the host copies: each device's current stream first runs what came before
        if tensor.device.type == NAME:
            gpu_streams.wait_current(tensor.device.index)
    target = cpu_view(dst) if dst.device.type == NAME else dst
    target.copy_(cpu_view(src) if src.device.type == NAME else src)
    return dst


def _resize(tensor, size, memory_format=None):
    """resize_ on fgpu: within the storage it changes the shape; beyond it, the tensor
    moves to new memory that starts with its old bytes, as CUDA's resize_ does."""
    shape = torch.empty(size, dtype=tensor.dtype, device="meta", memory_format=memory_format or torch.contiguous_format)
    gpu_streams.wait_current(tensor.device.index)
    storage = tensor.untyped_storage()
    needed = tensor.storage_offset() * tensor.element_size() + shape.untyped_storage().nbytes()
    if needed > storage.nbytes():
        grown = torch.zeros(needed, dtype=torch.uint8)
        if storage.nbytes():
            grown[: storage.nbytes()].copy_(_bytes(storage))
        storage = _storage_on(grown.untyped_storage(), tensor.device.index)
    return _SET.redispatch(_CPU_KEYS, tensor, storage, tensor.storage_offset(), shape.size(), shape.stride())


def cpu_view(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor on the same memory as fgpu `tensor` (valid while `tensor` lives)."""
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype)
    return _bytes(storage).view(tensor.dtype).as_strided(tensor.size(), tensor.stride(), tensor.storage_offset())


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A CPU uint8 tensor on an fgpu storage's memory (valid while the storage lives)."""
    cpu = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), torch.device("cpu"), storage.nbytes())
    return torch.empty(0, dtype=torch.uint8).set_(cpu)


# ----------------------------------------------------------------------------- memory

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLTensor(ctypes.Structure):  # the head of DLPack's DLTensor: data, then device
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype, _capsule_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
_DL_EXT_DEV = 12  # DLPack's kDLExtDev: PyTorch reads it as the PrivateUse1 device


def _on_fgpu(cpu: torch.Tensor, index: int) -> torch.Tensor:
    """`cpu` (its memory, owned through DLPack) as a tensor on fgpu:index."""
    capsule = torch.utils.dlpack.to_dlpack(cpu)
    head = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    head.device.device_type, head.device.device_id = _DL_EXT_DEV, index
    return torch.utils.dlpack.from_dlpack(capsule)


RAW = frozenset({_on_fgpu.__code__})  # the code that reaches memory through ctypes (a sealed rank's jail lets it)


def _storage_on(storage: torch.UntypedStorage, index: int) -> torch.UntypedStorage:
    """An fgpu:index storage owning CPU `storage`'s memory, counted there until it dies."""
    owned = _on_fgpu(torch.empty(0, dtype=torch.uint8).set_(storage), index).untyped_storage()
    _held[owned._cdata] = [index, 0, _Block(storage, gpu_streams.current(index))]
    _recount(owned)
    weakref.finalize(owned, _release, owned._cdata)
    return owned


class _Block:
    """An fgpu storage's memory: its CPU owner, the stream current where it was made, and the
    streams given to record_stream (they trade places with the memory: `_resize_storage`)."""
    __slots__ = ("owner", "stream", "recorded")

    def __init__(self, owner: torch.UntypedStorage, stream):
        self.owner, self.stream, self.recorded = owner, stream, set()


_held: dict[int, list] = {}  # an fgpu storage (its StorageImpl) -> [device index, the bytes it holds, its _Block]


def _recount(storage: torch.UntypedStorage) -> None:
    """Count what `storage` holds now (it may have traded its memory: `_resize_storage`)."""
    with _lock:
        entry = _held[storage._cdata]
        counts = _memory.setdefault(entry[0], [0, 0])
        counts[0] += storage.nbytes() - entry[1]
        counts[1] = max(counts[1], counts[0])
        entry[1] = storage.nbytes()


def _release(key: int) -> None:
    """A storage died on the host: its memory goes back to the allocator as CUDA's caching
    allocator takes it, at once for the stream it was made on (whose later work comes after
    what is queued); after the work queued on the streams given to record_stream; and at once
    for another stream whose queued work still reads it, which then reads memory handed out
    again: filled here with 0xFF bytes (NaN) before it does."""
    with _lock:
        index, nbytes, block = _held.pop(key)
    others = [s for s in gpu_streams.busy(index) if s is not block.stream] if nbytes else []
    if any(block.owner.data_ptr() in job.reads for s in others if s not in block.recorded for job in list(s.jobs)):
        torch.empty(0, dtype=torch.uint8).set_(block.owner).fill_(255)
    gpu_streams.after([s for s in others if s in block.recorded], functools.partial(_uncount, index, nbytes))


def _uncount(index: int, nbytes: int) -> None:
    with _lock:
        _memory[index][0] -= nbytes


def _resize_storage(storage: torch.UntypedStorage, nbytes: int):
    """storage.resize_(n) on fgpu (FSDP frees a parameter's memory with resize_(0) and takes
    it back with resize_(n)): the storage trades its memory for new memory of n bytes that
    starts with its old bytes, as on CUDA; its tensors see the new memory."""
    if storage.device.type != NAME:
        return _ORIGINAL["resize_"](storage, nbytes)
    index, kept = storage.device.index, min(nbytes, storage.nbytes())
    gpu_streams.wait_current(index)
    grown = torch.zeros(nbytes, dtype=torch.uint8)
    grown[:kept].copy_(_bytes(storage)[:kept])
    trades = [_storage_on(torch.empty(0, dtype=torch.uint8).untyped_storage(), index),
              _storage_on(grown.untyped_storage(), index)]  # takes the old memory away; brings the new
    for other in trades if storage.nbytes() else trades[1:]:
        storage._swap_data_ptr_(other)  # one of the two holds no bytes, as this call requires
        mine, theirs = _held[storage._cdata], _held[other._cdata]
        mine[2], theirs[2] = theirs[2], mine[2]
        _recount(other)
    _recount(storage)
    return storage


def _tensor_on(storage: torch.UntypedStorage, like: torch.Tensor, index: int) -> torch.Tensor:
    """An fgpu tensor on `storage` with `like`'s dtype, offset, shape and strides."""
    tensor = _on_fgpu(torch.empty(0, dtype=like.dtype), index)
    return _SET.redispatch(_CPU_KEYS, tensor, storage, like.storage_offset(), like.size(), like.stride())


_METADATA = {_aten.set_.source_Storage, _aten.set_.source_Storage_storage_offset,
             _aten.set_.source_Tensor}  # shape and storage only: the CPU kernel's code serves any device
_LAUNCHED = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}  # queued (`_launch`)
_SHORT_FLOPS = 2 ** 24  # a product of fewer (about a millisecond of a CPU core) runs where the host next waits
_ADDING = {_aten.addmm.default, _aten.baddbmm.default}  # their first argument is a bias
_COPIES = {_aten._copy_from.default, _aten._copy_from_and_resize.default}
_CPU_INDICES_OK = {_aten.index, _aten.index_put_, _aten._index_put_impl_, _aten.index_put}  # as on CUDA, indices may stay on the CPU
