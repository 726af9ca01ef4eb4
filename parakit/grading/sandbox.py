"""Fresh processes for a sealed run, started from a zygote that no student code touched.

`Zygote()` starts one trusted process that imports torch and every parakit module once and
then forks a child per rank on request (a fork after the imports costs milliseconds, a
fresh interpreter about a second). The zygote is a child subreaper: a process a student's
child leaves behind is re-parented to it, so `sweep()` finds and kills it. Each child
closes every file it inherited, writes its output to a capped file in its own scratch
folder, connects to the judge's broker (`relay`), runs a `Job` and sends back its result
as plain data (`codec`), then exits. A student's child is locked (`jail`) before the
student's first line runs; where the machine allows it is also confined (`isolation`), its
scratch folder then a tmpfs of SCRATCH_LIMIT / world size bytes.

    zygote = Zygote(); pids = [zygote.fork(spec) for spec in specs]; ...; zygote.sweep()
"""
from __future__ import annotations

import copy
import errno
import linecache
import os
import pickle
import random
import resource
import signal
import struct
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass, field

__all__ = ["Zygote", "Job", "student_object"]

LOG_LIMIT = 8 * 2**20         # bytes a child may write to its output file
SCRATCH_LIMIT = 256 * 2**20   # bytes a student's run may hold in its ranks' scratch folders, shared out evenly
FULL: str | None = None       # a confined rank: what its scratch holds at most, said when it is full
NAMESPACE: dict | None = None  # a student's child: the names its cells defined


@dataclass
class Job:
    """What every rank of one sealed run does. `cells`: sources run in order in one
    namespace (student cells have `student=True`, their exceptions are kept, not raised).
    `call`: cloudpickled (fn, make_inputs, seed) for a check, or (fn, cases) for a local
    check. `forbid`: cloudpickled [(function, message)] withheld, and the process locked,
    after the instructor's cells and before the first student cell; `allow`: cloudpickled
    (allowed, message) for `allow.Gate`, set up then too (the message has a {} for what the
    student's code called; a reference's job, not `locked`, is watched alike and never trips).
    `gpu`: the ranks compute on the emulated GPU box, rank r on fgpu:r (`relay` stands in for
    its NCCL), where the technique involves the device: its generator, placement, streams."""

    call: bytes
    local: bool
    cells: list[tuple[str, str, bool]] = field(default_factory=list)   # (label, source, student)
    forbid: bytes = b""
    locked: bool = False
    hidden: list[str] = field(default_factory=list)
    report_cells: bool = False
    allow: bytes = b""
    gpu: bool = False


def student_object(path: tuple[str, ...]):
    """What a `StudentName` proxy of the judge becomes in a student's child: the object its
    cells bound to that name (attributes followed)."""
    if NAMESPACE is None:
        raise RuntimeError(f"{'.'.join(path)} is the student's code: only a student's process can run it")
    if path[0] not in NAMESPACE:
        raise NameError(f"name {path[0]!r} is not defined: the answer cell that defines it did not run "
                        f"(or does not define it)")
    value = NAMESPACE[path[0]]
    for attr in path[1:]:
        value = getattr(value, attr)
    return value


# ---------------------------------------------------------------------------- the zygote

_LEN = struct.Struct("!I")


class Zygote:
    """The trusted process that forks ranks (see the module's docstring)."""

    def __init__(self):
        env = {**os.environ, "PYTHONHASHSEED": "0", "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "parakit.grading.sandbox"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, process_group=0)
        self.ready = False  # it imports while the caller goes on: several zygotes start at once

    def fork(self, spec: dict) -> int:
        """Fork a child that runs `spec` (see `_child`); its pid."""
        if not self.ready:
            self._expect("ready")
            self.ready = True
        return int(self._ask({"fork": spec}))

    def sweep(self) -> int:
        """Kill every process the zygote has forked or adopted; how many were alive."""
        if not self.ready:
            self._expect("ready")
            self.ready = True
        return int(self._ask({"sweep": True}))

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._ask({"exit": True})
            except (OSError, EOFError, ValueError):
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _ask(self, message: dict) -> str:
        data = pickle.dumps(message)
        self.proc.stdin.write(_LEN.pack(len(data)) + data)
        self.proc.stdin.flush()
        return self._expect()

    def _expect(self, word: str | None = None) -> str:
        line = self.proc.stdout.readline().decode().strip()
        if not line or (word and line != word):
            raise RuntimeError(f"the grading zygote stopped answering (said {line!r})")
        return line


def _zygote_main() -> None:
    """Import everything once, become a subreaper, then fork children on request."""
    import ctypes
    import importlib
    import pkgutil

    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)   # PR_SET_CHILD_SUBREAPER: orphans come to us
    import cloudpickle  # noqa: F401
    import torch  # noqa: F401
    import parakit
    for module in pkgutil.walk_packages(parakit.__path__, "parakit."):
        importlib.import_module(module.name)
    _warm_up()
    signal.signal(signal.SIGCHLD, lambda *_: _reap())
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    stdout.write(b"ready\n")
    stdout.flush()
    while True:
        head = stdin.read(_LEN.size)
        if len(head) < _LEN.size:
            return
        message = pickle.loads(stdin.read(_LEN.unpack(head)[0]))  # from the judge, which started us
        if "exit" in message:
            _kill_children()
            stdout.write(b"0\n")
            stdout.flush()
            return
        if "sweep" in message:
            answer = _kill_children()
        else:
            answer = _fork(message["fork"])
        stdout.write(f"{answer}\n".encode())
        stdout.flush()


WARM_MODULES = ("torch.distributed.fsdp", "torch.distributed.optim", "torch.distributed.pipelining",
                "torch.distributed.tensor", "torch.distributed.tensor.parallel", "torch.distributed.nn",
                "torch.utils.checkpoint", "matplotlib.pyplot")


def _warm_up() -> None:
    """Pay here, once, for what torch imports lazily on first use (an optimizer's first step
    pulls in some 800 modules, 0.7 s) and for the modules the lessons' checks name, so that
    a rank forked from the zygote does not pay it again."""
    import importlib

    import torch

    from parakit.grading import reach
    for name in WARM_MODULES:
        importlib.import_module(name)
    reach.load_parakit()  # every module a judge may withhold from, loaded before the rank's view hides them
    model = torch.nn.Linear(2, 2)
    for optimizer in (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                      torch.optim.AdamW(model.parameters(), lr=0.1)):
        model(torch.randn(1, 2)).square().sum().backward()
        optimizer.step()


def _fork(spec: dict) -> int:
    """Fork a child for `spec`; its pid. A student's rank is confined where the machine
    allows (`isolation`): the child enters new namespaces and forks the rank, process 1
    there, whose pid (as the zygote sees it) comes back through a pipe; the child waits."""
    if not (spec["job"].locked and spec.get("confine")):
        pid = os.fork()
        if pid == 0:
            _child(spec)
        return pid
    from parakit.grading import isolation
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the zygote's handler would reap the rank
        try:
            rank = isolation.enter_pid_namespace()
        except BaseException:  # noqa: BLE001 (the judge reads the failure from the pipe)
            os.write(write, b"0")
            os._exit(1)
        if rank == 0:
            os.close(write)
            _child(spec)
        os.write(write, str(rank).encode())
        os.close(write)
        _, status = os.waitpid(rank, 0)
        os._exit(0 if os.WIFEXITED(status) else 1)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        rank = int(answer.read() or b"0")
    if rank == 0:
        raise RuntimeError("a rank could not enter its namespaces")
    return rank


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _descendants() -> list[int]:
    """Every live process below this one (children, theirs, and orphans it adopted). The
    tree is walked through zombies too: a rank that has just exited can still be its
    children's parent for a moment, before they come to the zygote."""
    parents, dead = {}, set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry)] = int(fields[1])
            if fields[0] in "ZX":
                dead.add(int(entry))
    found, frontier = [], [os.getpid()]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        found += frontier
    return [pid for pid in found if pid not in dead]


def _kill_children() -> int:
    """SIGKILL every process below the zygote until none is left twice in a row; how many."""
    import time
    killed, empty = set(), 0
    for _ in range(400):
        alive = _descendants()
        empty = 0 if alive else empty + 1
        if empty == 2:
            break
        for pid in alive:
            killed.add(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)
        _reap()
    return len(killed)


# ---------------------------------------------------------------------------- a child

def _child(spec: dict) -> None:
    """Run one rank of a job and exit; never returns. It leads a process group of its own,
    so a rank that signals its group (os.killpg(0, ...)) reaches only itself (a group in the
    judge's session, not a session of its own: the kernel here schedules sessions as groups,
    and a zygote in its own session once got 2% of a core for minutes beside a loaded CI run)."""
    try:
        os.setpgid(0, 0)
        _isolate(spec["scratch"], spec["rank"])
        _run(spec)
    except BaseException:  # noqa: BLE001 (the process ends here whatever happened)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _isolate(scratch: str, rank: int) -> None:
    """Close what the zygote holds open; output to a capped file; work in `scratch`."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.closerange(3, 65536)
    log = os.open(os.path.join(scratch, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LOG_LIMIT, LOG_LIMIT))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.chdir(scratch)
    os.environ.update(HOME=scratch, TMPDIR=scratch, MPLCONFIGDIR=scratch)
    tempfile.tempdir = None  # the zygote's choice (/tmp) forgotten: tempfile reads TMPDIR again


def _run(spec: dict) -> None:
    global NAMESPACE, FULL
    import cloudpickle
    import torch
    import torch.distributed as dist
    import parakit
    from parakit import emulation
    from parakit.grading import allow, codec, jail, relay

    torch.set_num_threads(1)
    rank, world_size, job = spec["rank"], spec["world_size"], spec["job"]
    if job.gpu:
        emulation.install(world_size)
        emulation.fgpu.set_device(rank)
    link = relay.connect(spec["path"], rank, spec["token"], job.gpu)
    if job.locked and spec.get("confine"):  # the OS's walls first (the link is connected already)
        from parakit.grading import isolation
        linecache.clearcache()
        limits = isolation.Limits(scratch_size=SCRATCH_LIMIT // world_size)
        isolation.confine(spec["scratch"], [sys.base_prefix, sys.prefix], [*parakit.__path__, *job.hidden], limits)
        FULL = (f"a graded rank writes at most {limits.scratch_size // 2**20} MiB in its scratch folder (a run's "
                f"{SCRATCH_LIMIT // 2**20} MiB shared by its {world_size} ranks), {limits.tmp_size // 2**20} MiB in "
                f"/tmp and in /dev/shm, {limits.file_size // 2**20} MiB in one file: this write went past them")
    dist.init_process_group(relay.backend(job.gpu), store=dist.HashStore(), rank=rank, world_size=world_size)

    def seal():  # the instructor's setup has run; from the student's first line on:
        notify = lambda text: link.send({"note": "tripped: " + text})  # noqa: E731
        gate = None
        if job.allow:
            allowed, message = cloudpickle.loads(job.allow)
            gate = allow.Gate(allow.gated(allowed), message.format, notify)  # the codes before any is withheld
        for fn, message in cloudpickle.loads(job.forbid) if job.forbid else ():
            jail.withhold(fn, message, notify)
        raw = emulation.fgpu.RAW if job.gpu else frozenset()  # the emulated GPU makes its tensors through ctypes
        jail.lock(spec["scratch"], job.hidden, gate.install() if gate else frozenset(), raw)

    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    if job.locked:  # a student's rank: its cells' names are what StudentName proxies become
        NAMESPACE = namespace
    sealed = not job.locked
    for index, (label, source, student) in enumerate(job.cells):
        if student and not sealed:
            seal()
            sealed = True
        error = _exec_cell(label, source, namespace, student)
        if job.report_cells:
            link.send({"note": f"cell {index} " + (f"error {error}" if error else "ok")})
    if not sealed:
        seal()
    elif not job.locked and job.allow:
        # a reference's rank is watched as a student's is (the watch costs 2-5x on parakit's own Python),
        # so that a student's limit, ten times the reference's time, compares like with like; it owns no code
        allowed, message = cloudpickle.loads(job.allow)
        allow.Gate(allow.gated(allowed), message.format, print, student=()).install()
    result = _call(job, rank, world_size, cloudpickle)
    try:
        header, payload = codec.encode(result)
    except codec.CodecError as error:
        header, payload = codec.encode({"error": f"CodecError: {error}", "tripwire": False})
    link.send({"result": header}, payload)
    dist.destroy_process_group()


def _exec_cell(label: str, source: str, namespace: dict, student: bool) -> str | None:
    """Run one cell; a student cell's exception is printed and returned as text."""
    try:
        exec(compile(source, label, "exec"), namespace)
    except Exception as error:  # noqa: BLE001
        if not student:
            raise
        traceback.print_exc()
        return failure(error)
    return None


def failure(error: Exception) -> str:
    """A student's exception as the judge reports it; a write past a confined rank's caps says so."""
    text = f"{type(error).__name__}: {error}"
    if FULL and isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        text += f" ({FULL})"
    return text


def _call(job: Job, rank: int, world_size: int, cloudpickle):
    """The job's call: {"value": ...} or {"error": text, "tripwire": bool}; a local check
    gives one of those per case."""
    import torch
    from parakit.grading import InputContext, jail

    def guarded(fn, args):
        try:
            return {"value": fn(*args)}
        except Exception as error:  # noqa: BLE001
            traceback.print_exc()
            return {"error": failure(error)[:4000], "tripwire": isinstance(error, jail.Tripwire)}

    def reseed(seed):  # the same global random state on the student's and the reference's ranks
        random.seed(seed)
        torch.manual_seed(seed)

    try:
        call = cloudpickle.loads(job.call)
    except Exception as error:  # noqa: BLE001: the student's names it needs are missing, say
        traceback.print_exc()
        return {"error": f"{type(error).__name__}: {error}"[:4000], "tripwire": False}
    if job.local:
        fn, cases = call
        outcomes = []
        for index, case in enumerate(cases):
            reseed(index)
            outcomes.append(guarded(fn, copy.deepcopy(case)))
        return outcomes
    fn, make_inputs, seed = call
    context = InputContext(rank, world_size, torch.Generator().manual_seed(seed),
                           torch.Generator().manual_seed(seed * 1009 + rank + 1))
    reseed(seed + rank)
    inputs = make_inputs(context)
    reseed(seed * 7 + rank)
    return guarded(fn, copy.deepcopy(inputs))


if __name__ == "__main__":  # run as `python -m`: work in the importable module, where NAMESPACE lives
    from parakit.grading import sandbox
    sandbox._zygote_main()
