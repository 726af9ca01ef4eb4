"""Helpers shared by the tests: which processes are alive, and running a small script in a
fresh interpreter (a cold caller, with its own forkserver)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# The notebook kernels nbval starts inherit this: no frontend there, so widgets draw figures.
os.environ.setdefault("PARAKIT_STATIC", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
# The suite's tests mean gloo on the CPU: 'auto' resolves to gloo here and in every process they
# start, on a GPU host too. The GPU suite (test_gpu.py) unsets it; the emulated box ignores it.
os.environ.setdefault("PARAKIT_BACKEND", "gloo")


@pytest.fixture(scope="module", autouse=True)
def pools_stopped_after_each_module():
    """No rank pool outlives its test module. Idle ranks cost little CPU (0.3% each), but beside
    two busy loops the 4 ranks test_zero.py left behind made lesson 01 under nbval take 20-30 s
    (3 runs) instead of 8-11 s (4 runs: no pool left, or it stopped). A restart from the
    forkserver costs about 30 ms."""
    yield
    if "parakit.launcher" in sys.modules:  # torch is not imported for the modules that need none
        sys.modules["parakit.launcher"].shutdown()


def pid_alive(pid: int) -> bool:
    """True while `pid` is a live process; a zombie (exited, not yet reaped) counts as gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("State:"):
                    return line.split()[1] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False
    return True


def wait_gone(pids, timeout: float = 60.0) -> list[int]:
    """Poll until every pid is gone or `timeout` s have passed; return those still alive.
    The default (was 5 s) bounds a hang only: it returns as soon as they are gone."""
    deadline = time.monotonic() + timeout
    alive = [p for p in pids if pid_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if pid_alive(p)]
    return alive


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def live_children(ppid: int) -> set[int]:
    """The live (not zombie) processes whose parent is `ppid`."""
    children = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if parent_of(int(entry)) == ppid and pid_alive(int(entry)):
                    children.add(int(entry))
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                pass
    return children


def processes_with(marker: str) -> list[int]:
    """The live processes whose environment holds the entry `marker` ("NAME=value"): every
    process a run starts inherits it, even those that left its session."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and marker.encode() in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                found.append(int(entry))
        except OSError:  # gone, or not ours
            pass
    return [pid for pid in found if pid_alive(pid)]


def write_script(tmp_path: Path, source: str, name: str = "script.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def script_env() -> dict[str, str]:
    """The environment for a child interpreter: parakit importable from this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_script(tmp_path: Path, source: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `source` as a script in a fresh interpreter; return its exit code and output."""
    path = write_script(tmp_path, source)
    return subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=script_env(),
                          capture_output=True, text=True, timeout=timeout)


def start_script(tmp_path: Path, source: str) -> subprocess.Popen:
    """Start `source` in a fresh interpreter, stdout (with stderr) readable line by line."""
    path = write_script(tmp_path, source)
    return subprocess.Popen([sys.executable, str(path)], cwd=tmp_path, env=script_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def read_until(process: subprocess.Popen, prefix: str, seen: list[str], timeout: float = 60) -> str:
    """Read the script's output lines (kept in `seen`) until one starts with `prefix`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        if line.startswith(prefix):
            return line
    raise AssertionError(f"the script never printed a line starting {prefix!r}; it printed:\n" + "".join(seen))


class EmulatedNotebooks:
    """nbval runs every solution notebook on the emulated GPU box (parakit.emulation): 4 GPUs and
    NCCL's rules, or as many as PARAKIT_EMULATE_GPUS says (set it empty for gloo and the CPU).
    Each notebook also runs top to bottom on gloo, in test_pipeline.py's validate: 160 s for
    all 11 under nbval on gloo, 286 s emulated, on a 2-core machine. (A plugin, not a conftest
    in solutions/: a second conftest module would take the name `conftest` from this one.)

    A cell tagged "pinned-memory" needs pinned host memory, which fgpu has from its C++ hooks
    (parakit/emulation/native.cpp, built once per environment): 02_ddp's PyTorch DDP with
    find_unused_parameters=True (its reducer copies the map of used parameters through pinned
    memory), 11_real_run's DCP, async_save and FSDP2 with DCP. Where the hooks cannot be built
    (no C++ compiler) those cells are skipped, with native's one-line reason; the GPU suite
    runs the notebooks whole on NCCL (test_gpu.py).

    Each explorer there draws at every value its controls offer (PARAKIT_SWEEP, see viz.explore):
    a value that raises fails its cell."""

    TAG = "pinned-memory"
    SWEEP = "PARAKIT_SWEEP"  # and every explorer draws at every value its controls offer (viz.explore)

    def __init__(self):
        self.set = []  # the variables this plugin set, for the cell running

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        """Before nbval starts a notebook's kernel (in its first cell's setup): the kernel, and
        the ranks it launches, inherit the emulated box."""
        if not hasattr(item, "cell") or (REPO / "solutions") not in Path(item.path).parents:
            return
        from parakit.emulation import ENV
        wanted = {ENV: "4", self.SWEEP: "1"}
        self.set = [name for name in wanted if name not in os.environ]
        os.environ.update({name: wanted[name] for name in self.set})
        if os.environ[ENV] and self.TAG in item.cell.get("metadata", {}).get("tags", []):
            from parakit.emulation import native
            if native.unavailable():
                pytest.skip(f"tagged {self.TAG}: {native.unavailable()}")

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item, nextitem):
        """After each cell (and the kernel's shutdown after the last), the environment as it was."""
        try:
            return (yield)
        finally:
            for name in self.set:
                os.environ.pop(name, None)
            self.set = []


def _scope(nodeid: str) -> str:
    """What one of the two pytest processes runs whole (-n 2 --dist loadscope): a test file, or
    a notebook's cells, so that a file's module fixtures and a notebook's kernel stay in one
    process; in test_pipeline.py, the tests of one lesson (its `built` and `graded` fixtures,
    the lesson's graded panel, are made once, in one process)."""
    path, _, test = nodeid.partition("::")
    if path.endswith("test_pipeline.py") and test.endswith("]"):
        return f"{path}::{test[test.index('[') + 1:-1]}"
    return path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduler with `_scope`'s scopes, taken in the order collected (the lessons
    first: `pytest_collection_modifyitems`)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByLesson(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)
    return ByLesson(config, log) if config.getvalue("dist") == "loadscope" else None


def pytest_collection_modifyitems(config, items):
    """test_pipeline.py's lessons, the longest scopes, first, so that neither process is left
    alone with one at the end."""
    items.sort(key=lambda item: "::" not in _scope(item.nodeid))


def pytest_configure(config):
    config.pluginmanager.register(EmulatedNotebooks(), "emulated-notebooks")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failure reported as plain text where pytest's report of it fails: Python 3.11.7's ast
    can be left raising "SystemError: AST constructor recursion depth mismatch" on every parse
    (CPython issue 106905; pytest issue 11724), and pytest parses the test's source to report a
    failure, so one such report ended a CI run with INTERNALERROR and every result after it
    lost. The text names each frame and the exception, as traceback does, without parsing."""
    try:
        return (yield)
    except SystemError as error:
        frames = [f for f in traceback.extract_tb(call.excinfo.tb) if "/_pytest/" not in f.filename
                  and "/pluggy/" not in f.filename] if call.excinfo else []
        text = (call.excinfo.exconly() if call.excinfo else "") + "\n"
        text += "".join(f"{f.filename}:{f.lineno} in {f.name}\n    {f.line}\n" for f in frames)
        return pytest.TestReport(item.nodeid, item.location, {k: 1 for k in item.keywords}, "failed",
                                 f"{text}(pytest could not report this failure: {error})", call.when,
                                 duration=call.duration, start=call.start, stop=call.stop)


def pytest_terminal_summary(terminalreporter):
    """One line on the GPU suite (tests/test_gpu.py): how many gpu-marked tests were skipped, and why."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if "gpu" in getattr(r, "keywords", {})]
    if skipped:
        import re
        import torch
        gpus = torch.cuda.device_count()
        wanted = sorted({int(n) for r in skipped for n in re.findall(r"needs (\d+) CUDA GPU", str(r.longrepr))})
        needing = f" (they need {wanted[0]}{f' to {wanted[-1]}' if len(wanted) > 1 else ''})" if wanted else ""
        terminalreporter.write_line(f"gpu: {len(skipped)} tests skipped{needing}: this machine has {gpus} CUDA "
                                    f"GPU{'' if gpus == 1 else 's'}; run `.venv/bin/python -m pytest -m gpu` on a GPU box")
