"""One rank of the launcher's pool. Runs in a process started by the forkserver, never in
the caller. Its stdout and stderr are pipes the caller reads; its control connection
carries tasks in and results and status reports out, pickled; the bytes of their CPU
tensors travel through shared-memory files (`parakit._shm`), which the caller removes.

Two threads: the main thread runs tasks one after the other; a listener thread reads the
control connection, queues tasks, answers status questions at once (even while the main
thread waits inside a collective), and ends the process when the caller goes away.

A task's process groups are destroyed when it returns (a %%ranks cell's stay, for the next
cell): a pool that kept them would hold a communicator for every group every call ever made.

Devices follow `parakit.devices`' rule: under NCCL rank r works on GPU r, made current before
its process group exists and passed as device_id; the task's tensors (inside any object)
arrive on that device, and the result's go back to the CPU, detached.
"""
from __future__ import annotations

import ast
import ctypes
import gc
import inspect
import io
import linecache
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from parakit import _shm, comm, devices, emulation

_THIS_FILE = __file__.removesuffix("c")
# frames from these folders are left out of the stacks a rank reports: torch, the emulated GPU box (whose
# NCCL is torch's on a GPU box), multiprocessing, threading
_INTERNAL_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(emulation.__file__) + os.sep,
                  os.path.dirname(os.__file__) + os.sep, "<frozen ")
_tasks: "queue.Queue[tuple]" = queue.Queue()
_send_lock = threading.Lock()
_state = {"task": None}  # id of the task the main thread runs now, or None


def main(rank, world_size, backend, gpus, store_port, conn, out_w, err_w, timeout_s):
    """Set the process up as rank `rank`, join the process group (on GPU `rank` under NCCL,
    of `gpus` emulated ones under "fnccl"), then serve tasks."""
    _redirect_output(out_w, err_w)
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller cancels us; Ctrl-C is its own
    _set_environment(rank, world_size, store_port)
    comm.install(wait_for_gpu=backend in ("nccl", emulation.BACKEND))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    devices.join(backend, rank, gpus, store=store, rank=rank, world_size=world_size, timeout=timedelta(minutes=30))
    _adopt_seed_style_calls(backend)
    threading.Thread(target=_listen, args=(conn,), daemon=True, name="parakit-listener").start()
    _send(conn, ("ready", rank))
    while True:
        task_id, payload = _tasks.get()
        _state["task"] = task_id
        reply = _run(rank, task_id, payload)
        sys.stdout.flush()
        sys.stderr.flush()
        _state["task"] = None
        _send(conn, ("done", task_id) + reply + (dict(comm.TRACKER.messages),))


def _run(rank, task_id, payload):
    """Run one task; returns ("ok", result bytes, comm calls) or ("error", text, comm calls),
    "broken" for "error" where the emulated NCCL can no longer communicate (the caller also
    gets the messages sent to and received from each peer). The arguments' tensors are on
    this rank's device, on the CPU mapped copy-on-write: this rank's writes into them stay
    its own. The result's tensors go to shared-memory files named after the task's prefix
    and this rank, on the CPU and detached."""
    comm.TRACKER.reset()
    emulation.idle(False, task_id)
    groups = _groups()
    try:
        cwd, path, sources, prefix, blob = payload
        _sync_caller_context(cwd, path, sources)
        fn, args = _shm.loads(blob, shared=False, device=devices.device())
        result = fn(*args)
        if devices.device().type == emulation.DEVICE:  # the emulated GPU runs the task's work: a hang shows here
            torch.fgpu.synchronize(devices.device())
    except BaseException as error:  # a student's code may raise anything, SystemExit too
        return ("broken" if emulation.broken() else "error", _format_error(error), comm.TRACKER.seq)
    finally:
        emulation.idle(True, task_id)
    if fn is not run_cell:  # a %%ranks cell's groups live on with its names, for the next cell
        _destroy_groups_since(groups)
    try:
        return ("ok", _shm.dumps(result, f"{prefix}r{rank}-", detach=True), comm.TRACKER.seq)
    except Exception as error:
        message = (f"rank {rank} returned a {type(result).__name__} that cannot be sent back "
                   f"({type(error).__name__}: {error}). Return tensors, numbers, strings or "
                   f"lists/dicts of them.")
        return ("unsendable", message, comm.TRACKER.seq)


def _groups() -> list:
    """This rank's process groups, the world's first, in the order they were made."""
    return list(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else []


def _destroy_groups_since(before) -> None:
    """Destroy the process groups a task made and returned from, the newest first, alike on
    every rank: each holds a communicator (under gloo a thread that wakes every 10 ms, under
    NCCL GPU memory) that would otherwise live as long as the pool."""
    made = [g for g in _groups() if g not in before]
    for group in reversed(made):
        _ORIGINAL["destroy"](group)
    if made:
        _forget_meshes()
        gc.collect()  # a group's objects often sit in reference cycles (meshes, modules)


def _forget_meshes() -> None:
    """Clear DTensor's caches that hand out DeviceMeshes (its sharding decisions, its redistribute
    planners): they are keyed by meshes, and a mesh's equality leaves its groups out, so the next
    task's equal mesh would get back the last one, whose groups are gone."""
    if "torch.distributed.tensor" in sys.modules:
        from torch.distributed.tensor import _redistribute, debug
        debug._clear_sharding_prop_cache()
        _redistribute.clear_redistribute_planner_cache()


def _listen(conn):
    """Read the control connection: queue tasks, answer status questions, exit on EOF."""
    main_id = threading.main_thread().ident
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)  # the caller is gone: leave no orphan behind
        if message[0] == "run":
            _tasks.put(message[1:])
        elif message[0] == "status":
            _send(conn, ("status", _status(main_id)))
        elif message[0] == "exit":
            os._exit(0)


def _status(main_id) -> dict:
    """Where the main thread is: its current task, the collective it waits in, its stack."""
    current = comm.TRACKER.current
    frame = sys._current_frames().get(main_id)
    return {
        "task": _state["task"],
        "calls": comm.TRACKER.seq,
        "current": current[:3] if current else None,
        "waiting": (time.monotonic() - current[3]) if current else 0.0,
        "messages": dict(comm.TRACKER.messages),
        "stack": _user_stack(frame) if frame is not None else [],
    }


def _user_stack(frame) -> list[str]:
    """The frames of `frame`'s stack inside the task, outermost first, without torch's."""
    frames = traceback.extract_stack(frame)
    starts = [i for i, summary in enumerate(frames) if summary.filename == _THIS_FILE]
    lines = []
    for summary in frames[starts[-1] + 1 if starts else 0:]:
        if summary.filename in (_THIS_FILE, comm.__file__) or summary.filename.startswith(_INTERNAL_DIRS):
            continue
        text = f"{summary.filename}:{summary.lineno} in {summary.name}"
        lines.append(text + (f": {summary.line}" if summary.line else ""))
    return lines


def _format_error(error: BaseException) -> str:
    """The traceback of `error` without this module's frames."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == _THIS_FILE:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(error), error, tb))


def _sync_caller_context(cwd, path, sources):
    """Work in the caller's folder, import from its sys.path, and know its cells' source
    (so tracebacks of code defined in a notebook show their lines)."""
    if os.getcwd() != cwd:
        os.chdir(cwd)
    if path is not None:
        sys.path[:] = path
    for filename, lines in sources.items():
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)


def _send(conn, message) -> None:
    data = pickle.dumps(message)
    with _send_lock:  # not the program's bytes: comm.written_bytes leaves them out (with send_bytes' length prefix)
        comm.LAUNCHER_WRITES[0] += len(data) + (4 if len(data) <= 0x7FFFFFFF else 12)
        conn.send_bytes(data)


def _redirect_output(out_w, err_w) -> None:
    """Send fd 1 and 2 (Python's and C's output alike) into the caller's pipes, line by line."""
    os.dup2(out_w.fileno(), 1)
    os.dup2(err_w.fileno(), 2)
    out_w.close()
    err_w.close()
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the forkserver (which dies with the caller) goes away."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _set_environment(rank, world_size, store_port) -> None:
    """The variables torchrun sets, so code written for torchrun runs unchanged."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store_port), PARAKIT_WORKER="1",
    )


_ORIGINAL = {"init": dist.init_process_group, "destroy": dist.destroy_process_group}


def _adopt_seed_style_calls(backend) -> None:
    """The pool owns the default process group: `init_process_group` with arguments that
    fit it returns at once, and `destroy_process_group()` of the default group keeps it."""

    signature = inspect.signature(_ORIGINAL["init"])

    def init_process_group(*args, **kwargs):
        asked = signature.bind(*args, **kwargs).arguments
        wanted = asked.get("backend")
        stands_in = backend == emulation.BACKEND and str(wanted).lower() == "nccl"  # the emulated box's NCCL
        if wanted and str(wanted).lower() not in (backend, "cpu:gloo,cuda:nccl") and not stands_in:
            raise ValueError(f"init_process_group({wanted!r}): the ranks of this pool run backend "
                             f"{backend!r}; call parakit.launch(..., backend={str(wanted)!r}) to use {wanted}")
        for name, actual in (("world_size", dist.get_world_size()), ("rank", dist.get_rank())):
            if asked.get(name, -1) not in (-1, None, actual):
                raise ValueError(f"init_process_group({name}={asked[name]}) but this process is "
                                 f"{name} {actual} of the launched pool")

    def destroy_process_group(group=None):
        if group is None or group is dist.GroupMember.WORLD:
            return None
        return _ORIGINAL["destroy"](group)

    init_process_group.__doc__ = _ORIGINAL["init"].__doc__
    destroy_process_group.__doc__ = _ORIGINAL["destroy"].__doc__
    dist.init_process_group = dist.distributed_c10d.init_process_group = init_process_group
    dist.destroy_process_group = dist.distributed_c10d.destroy_process_group = destroy_process_group


_CELL_NAMESPACE: dict = {"__name__": "__main__"}


def run_cell(source: str, filename: str) -> None:
    """Run a `%%ranks` cell in this rank's namespace, printing its last expression's value."""
    tree = ast.parse(source, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), _CELL_NAMESPACE)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), filename, "eval"), _CELL_NAMESPACE)
        if value is not None:
            print(repr(value))
