"""The operating system's walls around a student's rank (`parakit.grading.isolation`), tried
without the audit hook, by the routes the hook never sees; then through the zygote, where a
rank that signals its group or forks past the hook costs only itself."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from multiprocessing import shared_memory

import cloudpickle
import pytest

from conftest import REPO, script_env
from parakit.grading import isolation, sandbox
from parakit.grading.judge import JudgeConfig, Runner

pytestmark = pytest.mark.skipif(isolation.unavailable() is not None,
                                reason=f"no OS confinement here: {isolation.unavailable()}")

# Each attempt runs in a confined process with no audit hook; what it returned, or the error.
ATTEMPTS = {
    "fork_exec": "import subprocess; subprocess.run(['/bin/true'])",
    "spawnv_passfds": "import multiprocessing.util, os, sys; multiprocessing.util.spawnv_passfds(os.fsencode(sys.executable), [sys.executable, '-c', 'pass'], [])",
    "spawn_context": "import multiprocessing as mp; mp.get_context('spawn').Process(target=print).start()",
    "os_fork": "import os; os.fork()",
    "read_by_path": f"open({str(REPO / 'README.md')!r}).read(10)",
    "read_by_folder_fd": f"import os; fd = os.open({str(REPO)!r}, os.O_RDONLY | os.O_DIRECTORY); "
                         "open('README.md', opener=lambda p, f: os.open(p, f, dir_fd=fd)).read(10)",
    "write_the_venv": f"open({sys.prefix + '/escape'!r}, 'w').write('x')",
    "read_beside_its_scratch": "import os; open(os.path.join(os.path.dirname(os.getcwd()), 'confined.py')).read()",
    "tcp_to_the_host": "import socket; socket.create_connection(('127.0.0.1', PORT), timeout=2)",
    "abstract_socket": "import socket; s = socket.socket(socket.AF_UNIX); s.connect(ABSTRACT)",
    "host_shared_memory": "from multiprocessing import shared_memory; shared_memory.SharedMemory(SHM).buf[0]",
    "signal_the_parent": "import os, signal; os.kill(PARENT, signal.SIGKILL)",
    "mount": "import ctypes; ctypes.CDLL(None, use_errno=True).mount(b'none', b'/', b'tmpfs', 0, None) == 0 or 1/0",
    "eight_gigabytes": "bytearray(8 * 2**30)",
}
ALLOWED = {
    "thread": "import threading; t = threading.Thread(target=lambda: None); t.start(); t.join()",
    "write_scratch": "open('mine.txt', 'w').write('ok')",
    "processes_seen": "import os; sorted(int(p) for p in os.listdir('/proc') if p.isdigit())",
    "listdir_root": "import os; sorted(os.listdir('/'))",
    "read_a_visible_folder_in_tmp": "open(VISIBLE + '/data.txt').read()",  # VISIBLE: a link to the folder
    "write_a_visible_folder": "open(VISIBLE + '/data.txt', 'w').write('x')",
}

SCRIPT = """
    import json, os, socket, sys, time
    from parakit.grading import isolation
    PORT, ABSTRACT, SHM, PARENT, VISIBLE = {port}, {abstract!r}, {shm!r}, os.getpid(), sys.argv[5]
    attempts = json.loads(sys.argv[1])
    out = os.open(sys.argv[2], os.O_WRONLY)
    pid = os.fork()
    if pid == 0:
        inner = isolation.enter_pid_namespace()
        if inner:
            os.waitpid(inner, 0)
            os._exit(0)
        os.setpgid(0, 0)
        isolation.confine(sys.argv[3], [sys.base_prefix, sys.prefix, VISIBLE], [],
                          isolation.Limits(cpu_seconds=int(sys.argv[4])))
        results = {{}}
        for name, source in attempts.items():
            *lines, last = source.split("; ")
            scope = dict(PORT=PORT, ABSTRACT=ABSTRACT, SHM=SHM, PARENT=PARENT, VISIBLE=VISIBLE)
            try:
                exec("; ".join(lines), scope)
                results[name] = ["ok", repr(eval(last, scope))[:200]]
            except BaseException as error:
                results[name] = [type(error).__name__, str(error)[:200]]
        os.write(out, json.dumps(results).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    print("parent alive", flush=True)
"""


def confined(tmp_path, attempts: dict[str, str], cpu_seconds: int = 60) -> tuple[dict, str]:
    """Run each attempt in a process confined by `isolation` (no audit hook); (results, stdout)."""
    scratch, visible = tmp_path / "rank0", tmp_path / "venv"  # both in /tmp, which becomes the new root
    scratch.mkdir()
    visible.mkdir()
    (visible / "data.txt").write_text("shown")
    (tmp_path / "linked_venv").symlink_to(visible)  # given by its link, as a venv can be: read through it
    server = socket.create_server(("127.0.0.1", 0))
    listener = socket.socket(socket.AF_UNIX)
    listener.bind("\0parakit-isolation-test-%d" % os.getpid())
    listener.listen()
    shm = shared_memory.SharedMemory(create=True, size=16)
    out = tmp_path / "out"
    out.write_text("")
    script = tmp_path / "confined.py"
    script.write_text(textwrap.dedent(SCRIPT.format(port=server.getsockname()[1], abstract=listener.getsockname(),
                                                     shm=shm.name)))
    try:
        done = subprocess.run([sys.executable, str(script), json.dumps(attempts), str(out), str(scratch),
                               str(cpu_seconds), str(tmp_path / "linked_venv")], capture_output=True, text=True, env=script_env(), timeout=300)
    finally:
        server.close()
        listener.close()
        shm.close()
        shm.unlink()
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    return (json.loads(text) if text else {}), done.stdout


def test_a_confined_process_is_refused_every_way_past_the_audit_hook_and_keeps_threads_and_scratch(tmp_path):
    results, stdout = confined(tmp_path, {**ATTEMPTS, **ALLOWED})
    assert stdout == "parent alive\n"
    refused = {name: results[name] for name in ATTEMPTS if results[name][0] == "ok"}
    assert refused == {}, f"these got through: {refused}"
    assert results["fork_exec"][0] == results["spawnv_passfds"][0] == results["os_fork"][0] == "PermissionError"
    assert results["read_by_path"][0] == results["read_by_folder_fd"][0] == "FileNotFoundError"
    assert results["write_the_venv"] == ["OSError", f"[Errno 30] Read-only file system: '{sys.prefix}/escape'"]
    assert results["signal_the_parent"][0] == "ProcessLookupError"
    assert results["read_beside_its_scratch"][0] == "FileNotFoundError"
    assert results["eight_gigabytes"][0] == "MemoryError"
    assert results["thread"] == ["ok", "None"] and results["write_scratch"] == ["ok", "2"]
    assert results["processes_seen"] == ["ok", "[1]"]  # itself, process 1 of its namespace
    tops = {os.path.realpath(p).split("/")[1] for p in (sys.base_prefix, sys.prefix, tmp_path)}
    tops |= {d.strip("/") for d in isolation.SYSTEM_DIRS if os.path.exists(d)} | {"dev", "proc", "tmp"}
    assert results["listdir_root"] == ["ok", repr(sorted(tops))]  # the system, Python, the venv: nothing else
    assert results["read_a_visible_folder_in_tmp"] == ["ok", "'shown'"]
    assert results["write_a_visible_folder"][1].startswith("[Errno 30] Read-only file system")
    assert not os.path.exists(sys.prefix + "/escape")


def test_a_confined_process_past_its_cpu_seconds_is_killed(tmp_path):
    results, stdout = confined(tmp_path, {"spin": "sum(iter(int, 1))"}, cpu_seconds=1)
    assert results == {} and stdout == "parent alive\n"  # killed by SIGXCPU before it could answer


def test_a_rank_that_forks_or_signals_its_group_costs_only_itself_and_the_zygote_answers():
    runner = Runner(JudgeConfig())
    try:
        assert runner.unsealed is None
        cells = [("<kill>", "import os, signal\nos.killpg(0, signal.SIGKILL)", True),
                 ("<fork>", "import multiprocessing.util, os, sys\n"
                            "multiprocessing.util.spawnv_passfds(os.fsencode(sys.executable), [sys.executable, '-c', 'pass'], [])",
                  True),
                 ("<after>", "x = 1", True)]
        job = sandbox.Job(cloudpickle.dumps((int, [])), True, cells, b"", True, [], report_cells=True)
        run = runner.run(job, 2, 60)
        assert run.failure is None, run.failure
        for notes in run.notes:
            assert notes[0] == "cell 0 ok"  # process 1 of its namespace: a signal from inside does not reach it
            assert notes[1].startswith("cell 1 error PermissionError")  # past the hook, refused by the kernel
            assert notes[2] == "cell 2 ok"
        assert runner.run(job, 1, 60).failure is None  # the zygote still forks
    finally:
        runner.close()
