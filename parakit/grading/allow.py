"""What of parakit a student's code may call: the exercise's allowlist, checked on the caller.

An exercise names what its student's code may call of parakit (`allow`): functions, classes
(their methods, inherited ones included, come along) and modules (their functions and
classes come along). Every other function and method of parakit is gated. While the
student's code runs, a profiler sees each call into gated code and looks up the stack for
the nearest frame that belongs to someone: the student's code (an answer cell), the
instructor's (a setup or test cell) or parakit's own source. Frames of torch, the standard
library and generated code (a dataclass's `__init__`) are passed over, so a helper reached
through `functools.partial`, `map`, `getattr` or a torch function that takes a callable is
still the student's call. The student's call trips; parakit calling its own helpers, the
instructor's code calling parakit, the autograd engine running a backward that parakit's
code put in the graph, and torch calling a test's probe inside the student's op (a dispatch
mode's handler, a saved-tensor hook in force) do not. Forbidding (`forbid`) still wins over
allowing. What the device emulation, the grading package and `parakit.devices` define is
never gated: they are the machine the code runs on, not helpers.

A trip is reported (`notify`, to the judge) before it raises `Tripwire` in the call, so a
student who catches it keeps nothing. From then on the student's code may not make code that
would pass for someone else's: compiling, or building a code object, under a parakit,
setup-cell or test-cell file name is refused.

Limits, as for `jail`: a student who sets out to undo the watch inside the process can (a
thread started with `_thread` directly after rewriting `threading`'s hook, a C extension);
a parakit function run as a thread's target, or as an autograd hook the student registers, is
not attributed to the student.
"""
from __future__ import annotations

import os
import sys
import threading
import types
from typing import Callable, Iterable

__all__ = ["gated", "Gate", "ALWAYS", "names", "message"]

ALWAYS = ("parakit.grading", "parakit.emulation", "parakit.devices")
INSTRUCTOR = ("<setup cell ", "<test ")   # the sealed judge's labels of the instructor's cells
STUDENT = ("<answer ",)                   # ... and of the student's answer cells


def gated(allow: Iterable) -> dict:
    """code object -> its name (module.qualname), for every function and method of the parakit
    modules imported now that `allow` does not name (nor ALWAYS): module-level functions, the
    functions of its classes (generated ones, a dataclass's `__init__`, included), property
    accessors, nested classes'. (A sealed rank's zygote has imported every module.)"""
    from parakit.grading.reach import code_of
    allow = list(allow)
    modules = tuple(m.__name__ for m in allow if isinstance(m, types.ModuleType)) + ALWAYS
    classes = {base for c in allow if isinstance(c, type) for base in c.__mro__}
    functions = {code_of(f) for f in allow if not isinstance(f, (type, types.ModuleType))}
    codes = {}
    for name, module in list(sys.modules.items()):
        if not (name == "parakit" or name.startswith("parakit.")) or module is None or \
                any(name == m or name.startswith(m + ".") for m in modules):
            continue
        for value in list(vars(module).values()):
            if getattr(value, "__module__", None) != name:
                continue
            if isinstance(value, type):
                _class_codes(value, classes, codes)
            elif code_of(value) is not None:
                codes[code_of(value)] = f"{name}.{value.__qualname__}"
    for code in functions:
        codes.pop(code, None)
    return codes


def _class_codes(cls, allowed: set, codes: dict) -> None:
    from parakit.grading.reach import code_of
    if cls in allowed:
        return
    for value in vars(cls).values():
        if isinstance(value, type) and value.__qualname__.startswith(cls.__qualname__ + "."):
            _class_codes(value, allowed, codes)
            continue
        for fn in (value, getattr(value, "__func__", None), getattr(value, "fget", None), getattr(value, "fset", None)):
            code = code_of(fn)
            if code is not None:
                codes[code] = f"{cls.__module__}.{cls.__qualname__}.{getattr(fn, '__name__', '?')}"


def message(name: str, allow: Iterable) -> str:
    """A trip's text for the student's function `name`, with {} for what it called (`Gate`)."""
    listed = names(allow).replace("{", "{{").replace("}", "}}")
    return (f"{name} called {{}}, which this exercise does not let your code call (it may call {listed}): write "
            f"that part yourself")


def names(allow: Iterable) -> str:
    """`allow` in words, for a trip's message."""
    said = [a.__name__ if isinstance(a, types.ModuleType) else
            f"{getattr(a, '__module__', '')}.{getattr(a, '__qualname__', a)}" for a in allow]
    said = [s.removeprefix("parakit.") for s in said]
    more = f" and {len(said) - 12} more" if len(said) > 12 else ""
    return ", ".join(said[:12]) + more + " of parakit's" if said else "nothing of parakit's"


def _torch_calls(code) -> bool:
    """Whether torch, not the student's code, calls `code` inside one of the student's ops: a
    dispatch mode's or tensor subclass's handler, or a saved-tensor hook in force (a test's probe
    counting what the student's ops allocate or save)."""
    import torch
    if code.co_name in ("__torch_dispatch__", "__torch_function__"):
        return True
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False) or ()
    return any(getattr(getattr(hook, "__func__", hook), "__code__", None) is code for hook in hooks)


class Gate:
    """The watch over one student's calls (see the module's docstring). `codes`: gated();
    `message(name)`: a trip's text; `student`, `trusted`: file-name prefixes of the student's
    code and of its instructor's."""

    def __init__(self, codes: dict, message: Callable[[str], str], notify: Callable[[str], None],
                 student: tuple[str, ...] = STUDENT, trusted: tuple[str, ...] = INSTRUCTOR):
        import parakit
        from torch.autograd import graph
        self.codes, self.message, self.notify, self.student = codes, message, notify, tuple(student)
        self.trusted = tuple(trusted) + (os.path.dirname(parakit.__file__) + os.sep,)
        self.engine = graph._engine_run_backward.__code__
        self.tripped: list[str] = []
        self.watch = self._watcher()

    def owner(self, frame) -> str | None:
        """'student', 'trusted' or None (no owner below: a thread's target, the engine's call)."""
        while frame is not None:
            code = frame.f_code
            if code is self.engine:
                return None
            name = code.co_filename
            if name.startswith(self.student):
                return "student"
            if name.startswith(self.trusted):
                return "trusted"
            frame = frame.f_back
        return None

    def _watcher(self):
        codes, owner, trip = self.codes, self.owner, self.trip

        def watch(frame, event, arg):
            if event == "call" and frame.f_code in codes and owner(frame.f_back) == "student" and \
                    not _torch_calls(frame.f_code):
                trip(codes[frame.f_code])
        return watch

    def trip(self, name: str):
        from parakit.grading.jail import Tripwire
        text = self.message(name)
        if not self.tripped:
            self.tripped.append(text)
            self.notify(text)
        raise Tripwire(text)

    def audit(self, event, args):
        """Refuse, to the student's code, code under someone else's file name."""
        if event in ("compile", "code.__new__") and len(args) > 1 and isinstance(args[1], (str, bytes)):
            name = os.fsdecode(args[1])
            if name.startswith(self.trusted) and self.owner(sys._getframe(1)) == "student":
                from parakit.grading.jail import Refused
                raise Refused(f"a graded student's code may not make code under the file name {name!r}: only the "
                              f"course's own code is that")

    def install(self) -> frozenset:
        """Watch this thread and every thread started from now on (by `threading`, or by
        `_thread` directly); refuse disguised code. For good: a sealed rank's watch is never
        taken off. Returns the code objects that set a new thread's profiler (`jail.lock`'s
        `profilers`: the only code that may still call sys.setprofile)."""
        import _thread
        sys.setprofile(self.watch)
        threading.setprofile(self.watch)
        start, watch = _thread.start_new_thread, self.watch

        def start_watched(function, args, kwargs=None):
            def watched(*a, **k):
                sys.setprofile(watch)
                return function(*a, **k)
            return start(watched, args, kwargs or {})
        _thread.start_new_thread = _thread.start_new = threading._start_new_thread = start_watched
        sys.addaudithook(self.audit)
        inner = next(c for c in start_watched.__code__.co_consts if isinstance(c, types.CodeType))
        return frozenset({inner, threading.Thread._bootstrap_inner.__code__})
