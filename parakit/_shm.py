"""The launcher's data path: objects pickled by value, their tensors' bytes in shared memory.

    data = dumps(obj, "parakit-123-7-a")   # cloudpickle, but each storage -> one file
    obj = loads(data, shared=False)        # every storage mapped from its file, copy-on-write

`dumps` pickles with cloudpickle (so functions and classes from a notebook cell travel by
value, their code still naming the cell's file, not cloudpickle's "<dynamic-code>"), except
the bytes of every CPU storage, the memory under tensors, parameters and models: each
storage is written once into a file in /dev/shm named after the prefix, and the pickle only
names the file, as `torch.save` names its storages. Storages under 64 KiB travel inside the
pickle instead (a file costs more than copying them). Tensors that share a storage (a view,
tied weights) still share it after `loads`.

`loads(shared=False)` maps each file copy-on-write (MAP_PRIVATE): every process that loads
the same data reads the same pages, and a process that writes into a tensor gets private
copies of the pages it writes, so neither the file nor the other processes see the change.
`loads(shared=True)` maps them writable in place, for a process that is the only reader.
The files are removed by `removed_after(prefix)` when the call that made them ends; a
mapping keeps its pages after that, and frees them with the last tensor that uses them (a
rank that keeps an argument in a global or a %%ranks name keeps its pages until it drops it).

Devices: a storage on a GPU travels as its bytes copied to the CPU, so `dumps` brings every
tensor to the CPU, inside any object; `loads(device=...)` puts every storage on that device
(views still share); `dumps(detach=True)` sends tensors that require grad detached, as the
values they hold (parameters stay parameters). A functional collective's pending output (an
AsyncCollectiveTensor, which DTensor's ops return) is waited for and travels as the plain
tensor it holds: the wrapper would keep its device, and a collective a process cannot finish.

Why not torch.multiprocessing's own reductions: they move the sender's storage into shared
memory in place, keep a file descriptor open per storage in every process (Linux's default
file_descriptor strategy), and give every receiver the same writable pages, so a rank's
in-place write would reach the caller.
"""
from __future__ import annotations

import contextlib
import glob
import io
import os
import pickle
import tempfile
import types

import cloudpickle
import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor

DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
INLINE_BYTES = 64 * 1024  # smaller storages travel inside the pickle


def dumps(obj, prefix: str, detach: bool = False) -> bytes:
    """`obj` pickled by value, each storage's bytes (on the CPU) written to the file
    DIR/prefix<n>; tensors that require grad detached if `detach`."""
    buffer = io.BytesIO()
    _Pickler(buffer, prefix, write=True, detach=detach).dump(obj)
    return buffer.getvalue()


def check_picklable(obj) -> None:
    """Raise what `dumps(obj)` would raise for an object that cannot be pickled; write nothing."""
    _Pickler(io.BytesIO(), "", write=False).dump(obj)


def loads(data: bytes, shared: bool, device: torch.device | None = None):
    """The object `dumps` made, its storages mapped from their files: copy-on-write, or
    writable in place when `shared` (for the only process that reads these files); or, for a
    `device` other than the CPU, copied onto it."""
    return _Unpickler(io.BytesIO(data), shared, device).load()


@contextlib.contextmanager
def removed_after(prefix: str):
    """Remove every file DIR/prefix* when the block ends, however it ends."""
    try:
        yield prefix
    finally:
        for path in glob.glob(os.path.join(DIR, glob.escape(prefix) + "*")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def remove_orphans() -> None:
    """Remove the files DIR/parakit-<pid>-* of callers that died without removing them."""
    for path in glob.glob(os.path.join(DIR, "parakit-*-*")):
        pid = os.path.basename(path).split("-")[1]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(OSError):  # gone already, or another user's
                os.unlink(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


class _Pickler(cloudpickle.Pickler):
    def __init__(self, file, prefix: str, write: bool, detach: bool = False):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.prefix, self.write, self.detach = prefix, write, detach
        self.names: dict[int, tuple] = {}  # storage (its StorageImpl) -> (name, its bytes or their number)
        self.copies: list[torch.UntypedStorage] = []  # GPU storages' CPU copies, alive while pickling

    def reducer_override(self, obj):
        if isinstance(obj, AsyncCollectiveTensor):
            obj = obj.wait()
            if not (self.detach and obj.requires_grad):
                return obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        if self.detach and type(obj) is torch.Tensor and obj.requires_grad:
            return obj.detach().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        if type(obj) is types.CodeType:
            return _code_with_its_file(obj)
        return super().reducer_override(obj)

    def persistent_id(self, obj):
        """A storage is pickled as (name, its bytes or, for a file, their number, dtype), a
        GPU's as its bytes copied to the CPU; anything else as usual."""
        if isinstance(obj, torch.storage.TypedStorage):
            storage, dtype = obj._untyped_storage, obj.dtype
        elif isinstance(obj, torch.UntypedStorage):
            storage, dtype = obj, None
        else:
            return None
        if storage.device.type == "meta":
            return None  # no bytes: pickled as torch pickles it
        if storage._cdata not in self.names and storage.device.type != "cpu":
            self.copies.append(storage.cpu())
            self.names[storage._cdata] = self._name(self.copies[-1])
        return *self._name(storage), dtype

    def _name(self, storage: torch.UntypedStorage) -> tuple:
        """(name, its bytes or their number) of a CPU storage, its file written the first time."""
        if storage._cdata not in self.names:
            name = f"{self.prefix}{len(self.names)}"
            if storage.nbytes() < INLINE_BYTES:
                self.names[storage._cdata] = name, bytes(storage)
            else:
                self.names[storage._cdata] = name, storage.nbytes()
                if self.write:
                    _write(storage, os.path.join(DIR, name))
        return self.names[storage._cdata]


def _code_with_its_file(code: types.CodeType) -> tuple:
    """cloudpickle's reduction of a code object, with the file it came from instead of
    cloudpickle's "<dynamic-code>": a rank's traceback then names the notebook's cell (its
    lines travel with the call), and a grading gate tells the student's cells from the
    instructor's."""
    make, args = cloudpickle.cloudpickle._code_reduce(code)
    return make, tuple(code.co_filename if arg == "<dynamic-code>" else arg for arg in args)


def _write(storage: torch.UntypedStorage, path: str) -> None:
    """Copy the storage's bytes into a new file only this user can read."""
    with os.fdopen(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600), "wb") as file:
        file.write(torch.empty(0, dtype=torch.uint8).set_(storage).numpy().data)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, shared: bool, device: torch.device | None):
        super().__init__(file)
        self.shared, self.device = shared, device
        self.storages: dict[str, torch.UntypedStorage] = {}

    def persistent_load(self, pid):
        name, content, dtype = pid
        if name not in self.storages:
            storage = (torch.UntypedStorage.from_buffer(content, dtype=torch.uint8) if isinstance(content, bytes)
                       else torch.UntypedStorage.from_file(os.path.join(DIR, name), self.shared, content))
            if self.device is not None and self.device.type != "cpu":
                storage = torch.empty(0, dtype=torch.uint8).set_(storage).to(self.device).untyped_storage()
            self.storages[name] = storage
        storage = self.storages[name]
        return storage if dtype is None else torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype,
                                                                         _internal=True)
