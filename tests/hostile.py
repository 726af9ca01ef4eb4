"""Students who attack the grading from inside their notebook, built on lesson 00.

Each attacks one exercise, with its other answers right: the sealed grade must give 0 on
the tests of the exercise it attacks and full marks elsewhere. The attacks are the ways a
notebook can reach the checks in its own kernel (replace them, switch the tripwires off,
fake the comparison, read the reference's result) and the ways a process can reach beyond
itself (a result whose unpickling runs code, a process left running, writes into the
course, C code through ctypes, the solutions read from disk, a forbidden call from a
thread, a faked tensor), and the ways past the audit hook that only the operating system's
walls stop (a process started by _posixsubprocess, a read through a folder's descriptor,
a signal to the process group). `SIDE_EFFECTS` names what none of them may leave behind.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import nbformat

import panel

MARKER = "PARAKIT_HOSTILE=1"                       # in the environment of a process a student starts
UNPICKLED = Path(tempfile.gettempdir()) / "parakit-hostile-unpickled"  # made if the judge ran a student's pickle

RIGHT_RING = '''    n, rank = dist.get_world_size(), dist.get_rank()
    flat = tensor.reshape(-1).clone()
    chunks = flat.tensor_split(n)
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(2 * (n - 1)):
        i = (rank - step) % n if step < n - 1 else (rank + n - step) % n
        j = (i - 1) % n
        incoming = torch.empty_like(chunks[j])
        req = dist.isend(chunks[i], right)
        dist.recv(incoming, left)
        req.wait()
        if step < n - 1:
            chunks[j].add_(incoming)
        else:
            chunks[j].copy_(incoming)
    tensor.copy_(flat.view_as(tensor))
    return tensor
'''

RIGHT_TWO_PHASE = '''    n = dist.get_world_size()
    flat = tensor.reshape(-1)
    size = -(-flat.numel() // n)
    padded = torch.zeros(n * size, dtype=flat.dtype, device=flat.device)
    padded[: flat.numel()] = flat
    piece = torch.empty(size, dtype=flat.dtype, device=flat.device)
    dist.reduce_scatter_single(piece, padded)
    dist.all_gather_single(padded, piece)
    tensor.copy_(padded[: flat.numel()].view_as(tensor))
    return tensor
'''

ATTACKS = {  # name -> (answer grade_id, source)
    "replaces_the_checks": ("ring_all_reduce", '''import parakit.grading as grading_module
grading_module.check = lambda *args, **kwargs: print("passed")
grading_module.check_local = lambda *args, **kwargs: print("passed")
def ring_all_reduce(tensor):
    return tensor
'''),
    "profiler_off_borrower": ("all_reduce_two_phase", '''import importlib, sys, threading
def all_reduce_two_phase(tensor):
    sys.setprofile(None)
    threading.setprofile(None)
    return importlib.import_module("parakit.comm").all_reduce_two_phase(tensor)
'''),
    "fakes_assert_close": ("ring_bytes_per_rank", '''import torch.testing
torch.testing.assert_close = lambda *args, **kwargs: None
def ring_bytes_per_rank(nbytes, world_size):
    return 0.0
'''),
    "reads_the_stack": ("ring_bytes_per_rank", '''import inspect
def ring_bytes_per_rank(nbytes, world_size):
    for frame in inspect.stack():
        for name in ("expected", "reference", "want"):
            if name in frame.frame.f_locals and isinstance(frame.frame.f_locals[name], float):
                return frame.frame.f_locals[name]
    return 0.0
'''),
    "pickle_bomb": ("ring_all_reduce", f'''import os
class Bomb:
    def __reduce__(self):
        return (os.system, ("touch {UNPICKLED}",))
def ring_all_reduce(tensor):
    return Bomb()
'''),
    "fake_tensor": ("ring_all_reduce", '''class Always(torch.Tensor):
    def __eq__(self, other):
        return True
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return True
def ring_all_reduce(tensor):
    return tensor.as_subclass(Always)
'''),
    "leaves_a_process": ("ring_all_reduce", f'''import os, subprocess
def ring_all_reduce(tensor):
    subprocess.Popen(["sleep", "600"], env={{**os.environ, "{MARKER.split("=")[0]}": "1"}})
{RIGHT_RING}'''),
    "writes_the_course": ("all_reduce_two_phase", '''import parakit.grading, parakit.comm
def all_reduce_two_phase(tensor):
    for path in (parakit.grading.__file__, parakit.comm.__file__):
        with open(path, "a") as f:
            f.write("\\nPWNED = True\\n")
''' + RIGHT_TWO_PHASE),
    "ctypes_unhooks": ("ring_all_reduce", '''import ctypes
def ring_all_reduce(tensor):
    ctypes.pythonapi.PySys_ResetWarnOptions()        # any call into C through ctypes
''' + RIGHT_RING),
    "reads_the_solution": ("ring_all_reduce", '''import json, pathlib, parakit
def ring_all_reduce(tensor):
    root = pathlib.Path(parakit.__file__).resolve().parents[1]
    cells = json.loads((root / "solutions" / "00_collectives.ipynb").read_text())["cells"]
    source = next("".join(c["source"]) for c in cells if "def ring_all_reduce" in "".join(c["source"]))
    scope = {"dist": dist, "torch": torch}
    exec(source, scope)
    return scope["ring_all_reduce"](tensor)
'''),
    "borrows_from_a_thread": ("ring_all_reduce", '''import threading
from parakit import comm as c
def ring_all_reduce(tensor):
    box = []
    thread = threading.Thread(target=lambda: box.append(c.ring_all_reduce(tensor)))
    thread.start()
    thread.join()
    return box[0]
'''),
    "spawns_past_the_hook": ("ring_all_reduce", '''import os, sys, multiprocessing.util
READ = ("import json, os, pathlib, parakit; root = pathlib.Path(parakit.__file__).resolve().parents[1]; "
        "cells = json.loads((root / 'solutions' / '00_collectives.ipynb').read_text())['cells']; "
        "os.write({fd}, next(''.join(c['source']) for c in cells if 'def ring_all_reduce' in ''.join(c['source'])).encode())")
def ring_all_reduce(tensor):
    r, w = os.pipe()                                 # _posixsubprocess.fork_exec: no audit event
    multiprocessing.util.spawnv_passfds(os.fsencode(sys.executable), [sys.executable, "-c", READ.format(fd=w)], [w])
    os.close(w)
    source = b"".join(iter(lambda: os.read(r, 1 << 16), b"")).decode()
    scope = {"dist": dist, "torch": torch}
    exec(source, scope)
    return scope["ring_all_reduce"](tensor)
'''),
    "reads_through_a_folder_fd": ("ring_all_reduce", '''import json, os, pathlib, parakit
def ring_all_reduce(tensor):
    root = os.open(pathlib.Path(parakit.__file__).resolve().parents[1], os.O_RDONLY | os.O_DIRECTORY)
    with open("solutions/00_collectives.ipynb", opener=lambda path, flags: os.open(path, flags, dir_fd=root)) as f:
        cells = json.load(f)["cells"]
    scope = {"dist": dist, "torch": torch}
    exec(next("".join(c["source"]) for c in cells if "def ring_all_reduce" in "".join(c["source"])), scope)
    return scope["ring_all_reduce"](tensor)
'''),
    "kills_its_process_group": ("all_reduce_two_phase", '''import os, signal
def all_reduce_two_phase(tensor):
    os.killpg(0, signal.SIGKILL)                     # once the zygote's group: every rank and the zygote
    return tensor
'''),
    "c10d_method": ("ring_all_reduce", '''def ring_all_reduce(tensor):
    dist.group.WORLD.allreduce([tensor]).wait()    # the process group's own method, no Python wrapper
    return tensor
'''),
}


USES_THE_RING = ["test_ring_bytes_per_rank"]  # checks the formula against the student's own ring


def students(lesson: Path, solution: Path) -> list[panel.Student]:
    """One hostile student per attack; `replaces_the_checks` also hands in test-cell outputs
    that say "passed", as its own kernel showed them, so the report must flag the disagreement.
    An attack on the ring also costs the test that runs the student's ring."""
    full = panel.full_solution(panel.load(lesson), panel.load(solution))
    pts, groups = panel.points(panel.load(lesson)), panel.exercises(panel.load(lesson))
    made = []
    for name, (answer, source) in ATTACKS.items():
        nb = panel.with_sources(full, {answer: source})
        report = []
        if name == "replaces_the_checks":
            for cell in nb.cells:
                if panel.nbgrader_meta(cell).get("grade_id") in groups[answer]:
                    cell.execution_count = 1
                    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="passed\n")]
            report = ["passed in the submitted notebook's own run but fails in the sealed grade"]
        lost = groups[answer] + (USES_THE_RING if answer == "ring_all_reduce" else [])
        made.append(panel.Student(name, {lesson.name: nb}, {**pts, **{t: 0.0 for t in lost}}, report))
    return made
