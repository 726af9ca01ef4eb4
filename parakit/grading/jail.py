"""What a student's process may not do, enforced from inside it by means it cannot undo.

`withhold(fn, message)` replaces a function's code in place, so every name that reaches
it (an alias, `importlib`, a thread, a module patched back) calls a stub that reports the
trip to the judge and raises `Tripwire`. `lock(scratch, hidden)` installs a Python audit
hook, which no Python code can remove: from then on the process cannot start processes,
open sockets, load C code (ctypes), give a function new code, write anywhere but its
scratch folder, or read the course's own files (parakit's source, the solutions, the other
submissions), so it cannot load a second copy of a withheld function either. What it can
still do with the rights of the grader's user (exploit the interpreter, read what is
outside those folders) is why a real class is graded in a container.
"""
from __future__ import annotations

import inspect
import os
import sys
import threading

__all__ = ["Tripwire", "withhold", "lock", "Refused"]


class Tripwire(AssertionError):
    """The student's code called something the exercise forbids."""


class Refused(PermissionError):
    """The sealed grader does not let a student's process do this."""


_REFUSED = {
    "os.fork": "start processes", "os.forkpty": "start processes", "os.posix_spawn": "start processes",
    "os.spawn": "start processes", "os.exec": "start processes", "os.system": "start processes",
    "subprocess.Popen": "start processes", "pty.spawn": "start processes", "os.startfile": "start processes",
    "socket.__new__": "open sockets", "socket.connect": "open sockets", "socket.bind": "open sockets",
    "socket.sendto": "open sockets", "socket.getaddrinfo": "open sockets",
    "os.symlink": "make links", "os.link": "make links",
    "sys.setprofile": "replace the profiler", "sys.settrace": "replace the tracer",
}
_WRITES = {"os.remove", "os.rename", "os.replace", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
           "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.copymode",
           "shutil.copystat", "shutil.move", "shutil.chown", "os.chflags", "os.lchflags", "os.mkfifo", "os.mknod"}
_CTYPES = {"ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.call_function", "ctypes.cdata",
           "ctypes.cdata/buffer", "ctypes.addressof", "ctypes.string_at", "ctypes.wstring_at", "ctypes.PyObj_FromPtr"}


def withhold(fn, message: str, notify) -> bool:
    """Give `fn` (a Python function, method or decorated function) the code of a stub that
    calls `notify(message)` and raises Tripwire(message). False where fn has no Python code."""
    target = inspect.unwrap(getattr(fn, "__func__", fn))
    target = getattr(target, "__func__", target)
    code = getattr(target, "__code__", None)
    if code is None:
        return False
    target.__code__ = _stub(code.co_freevars, message, notify)
    return True


_NOTIFY: list = []


def _stub(freevars: tuple[str, ...], message: str, notify):
    """A code object with `freevars` (so it fits the function's closure) that trips."""
    _NOTIFY[:] = [notify]
    names = [f"_v{i}" for i in range(len(freevars))]
    source = "def _outer():\n" + "".join(f"    {n} = None\n" for n in names) + (
        "    def _withheld(*args, **kwargs):\n"
        + (f"        ({', '.join(names)},)\n" if names else "")
        + f"        __import__('parakit.grading.jail', fromlist=['_'])._trip({message!r})\n"
        "    return _withheld\n")
    scope: dict = {}
    exec(compile(source, "<withheld by the sealed grader>", "exec"), scope)
    return scope["_outer"]().__code__


def _trip(message: str):
    for notify in _NOTIFY:
        notify(message)
    raise Tripwire(message)


def lock(scratch: str, hidden: list[str], profilers: frozenset = frozenset(), raw: frozenset = frozenset()) -> None:
    """From now on refuse, in this process, what the module's docstring lists. `profilers`:
    the code objects that may still set a thread's profiler (`allow.Gate`'s, for new threads);
    `raw`: those that may still use ctypes themselves (the emulated GPU's `fgpu.RAW`)."""
    scratch = os.path.realpath(scratch)
    hidden = [os.path.realpath(h) for h in hidden]
    me = os.getpid()
    busy = threading.local()

    def inside(path: str, roots) -> bool:
        return any(path == r or path.startswith(r + os.sep) for r in roots)

    def check_path(path, writing: bool, event: str):
        if isinstance(path, int) or path is None:
            return
        try:
            real = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return
        if writing and not (inside(real, [scratch]) or real == os.devnull):
            raise Refused(f"a graded process may only write in its scratch folder, not {real} ({event})")
        if inside(real, hidden) and not inside(real, [scratch]):
            raise Refused(f"a graded process may not read the course's files: {real}")
        parts = real.split(os.sep)
        if len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and int(parts[2]) != me:
            raise Refused(f"a graded process may not look into other processes: {real}")

    def hook(event, args):
        if event == "object.__getattr__":  # a frame's f_code, read at each call the gate watches: nothing refused
            return
        if getattr(busy, "on", False):
            return
        busy.on = True
        try:
            if event == "sys.setprofile" and sys._getframe(1).f_code in profilers:
                return
            if event in _REFUSED:
                raise Refused(f"a graded process may not {_REFUSED[event]} ({event})")
            if event in _CTYPES and sys._getframe(1).f_code not in raw:
                raise Refused(f"a graded process may not reach C code or raw memory through ctypes ({event})")
            if event == "object.__setattr__" and len(args) > 1 and args[1] in ("__code__", "__globals__"):
                raise Refused(f"a graded process may not replace a function's {args[1]}")
            if event in ("os.kill", "os.killpg", "signal.pthread_kill") and args and args[0] not in (me, 0):
                raise Refused("a graded process may not signal other processes")
            if event == "open" and args:
                mode, flags = (args + (None, None))[1:3]
                writing = bool((mode and any(c in str(mode) for c in "wax+"))
                               or (isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)))
                check_path(args[0], writing, event)
            elif event in _WRITES and args:
                for path in args[:2]:
                    check_path(path, True, event)
        finally:
            busy.on = False

    sys.addaudithook(hook)
