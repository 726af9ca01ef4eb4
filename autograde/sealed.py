"""One submitted notebook graded by the sealed judge, and a class graded N notebooks at a time.

The judge (`parakit.grading.judge`) runs in a worker process that never executes or
unpickles anything a student wrote; the student's code runs on fresh ranks of its own,
the reference on ranks the student never touched. A worker keeps one judge per lesson, so
the reference's results for the class's (secretly seeded, shared) inputs are computed once.
`--jobs N` runs N workers; every notebook's grade is the same as with one.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import secrets
import stat
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

import nbformat
from nbgrader import utils as nbg_utils

from autograde import feedback

__all__ = ["Result", "Task", "Refused", "grade_all", "read_handin", "read_submission", "parse_notebook", "shape_problem",
           "inspect_submission", "course_salt"]


@dataclass
class Result:
    """One student's grade on one assignment."""
    student: str
    assignment: str
    max_score: float
    score: float = 0.0
    status: str = "graded"               # graded | missing | not a notebook
    tests: dict[str, tuple[float, float]] = field(default_factory=dict)   # grade_id -> (score, max)
    notes: list[str] = field(default_factory=list)                      # for the student and the instructor
    messages: dict[str, str] = field(default_factory=dict)               # grade_id -> why it failed
    seconds: float = 0.0                                                  # how long grading it took
    private: list[str] = field(default_factory=list)   # the instructor's only: copy, tamper and unsealed flags


@dataclass
class Task:
    """Grade `path` (None: nothing handed in) of `student` against `solution`."""
    student: str
    assignment: str
    path: str | None
    solution: str
    released: str
    out: str
    hidden: list[str]
    cell_timeout: float
    salt: str
    scratch: str
    submissions: str | None = None   # the folder of student folders: no link is followed below it
    started: str | None = None       # the journal's mark that this notebook is being graded (course.py)


def course_salt(root: Path) -> str:
    """The course's secret for drawing test inputs: made once, kept in the course root
    (git-ignored; students never see it), so every run and every worker draws the same."""
    path = Path(root) / ".sealed-salt"
    if not path.exists():
        path.write_text(secrets.token_hex(16))
    return path.read_text().strip()


def grade_all(tasks: list[Task], jobs: int = 1, on_result=lambda r: None) -> list[Result]:
    """Every task's Result, in the order of `tasks`; `jobs` notebooks graded at once. With
    jobs > 1, a notebook whose grading kills its process costs that notebook: the ones being
    graded beside it are graded again, each alone, and the one that kills its process again
    is scored 0 ("grader failed"). With one job a crash stops the run, and the journal's mark
    (`Task.started`) names the notebook for the next (see autograde.course)."""
    if jobs <= 1:
        results = []
        for task in tasks:
            results.append(grade_task(task))
            on_result(results[-1])
        _close_judges()
        return results
    done: dict[int, Result] = {}

    def keep(index: int, result: Result) -> None:
        done[index] = result
        on_result(result)

    pending, suspects = list(range(len(tasks))), []
    while pending:  # a pool that lost a process: what it was grading is suspect, the rest goes on
        lost = _grade_in_pool(tasks, pending, jobs, keep)
        started = [i for i in lost if tasks[i].started and Path(tasks[i].started).exists()]
        if lost and not started:
            raise RuntimeError("the grading processes died before grading any notebook")
        suspects += started
        pending = [i for i in lost if i not in started]
    for index in suspects:  # each alone: one that takes its process down again is the one
        if _grade_in_pool(tasks, [index], 1, keep):
            keep(index, grader_failed(tasks[index], "grading it killed the grader's process"))
    return [done[i] for i in range(len(tasks))]


def _grade_in_pool(tasks: list[Task], indices: list[int], jobs: int, keep) -> list[int]:
    """Grade tasks[i] for i in `indices` in a pool of `jobs` processes, keep(i, result) each;
    return the indices left ungraded because a process of the pool died."""
    lost = []
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
        futures = {pool.submit(grade_task, tasks[i]): i for i in indices}
        try:
            for future in as_completed(futures):
                try:
                    keep(futures[future], future.result())
                except BrokenProcessPool:
                    lost.append(futures[future])
        except BaseException:  # an interrupt: what is not started yet is not started at all
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    return sorted(lost)


_JUDGES: dict = {}


def _judge(task: Task):
    from parakit.grading.judge import Judge, JudgeConfig
    if task.assignment not in _JUDGES:
        config = JudgeConfig(task.cell_timeout, task.hidden, task.scratch, f"{task.salt}/{task.assignment}")
        _JUDGES[task.assignment] = Judge(nbformat.read(task.solution, as_version=4), config)
    return _JUDGES[task.assignment]


def _close_judges() -> None:
    for judge in _JUDGES.values():
        judge.close()
    _JUDGES.clear()


def grade_task(task: Task) -> Result:
    """The task's Result. The journal's mark is written first (a notebook that takes the grader
    down is named by it on the next run); an error of the grader itself while grading this
    notebook costs this notebook only, and the lesson's judge is started afresh for the next."""
    start = time.monotonic()
    if task.started:
        Path(task.started).write_text(json.dumps({"student": task.student, "assignment": task.assignment}))
    try:
        result = _grade_task(task)
    except Exception as error:  # noqa: BLE001: the grader's own failure, on this notebook alone
        judge = _JUDGES.pop(task.assignment, None)
        if judge is not None:
            with contextlib.suppress(Exception):  # its zygotes may be gone already
                judge.close()
        result = grader_failed(task, f"{type(error).__name__}: {str(error)[:300]}")
    result.seconds = time.monotonic() - start
    return result


def grader_failed(task: Task, why: str) -> Result:
    """The Result of a notebook the grader itself failed on: 0 on every test, and why."""
    result = Result(task.student, task.assignment, 0.0, status="grader failed")
    result.tests = {g: (0.0, p) for g, p in points_of(nbformat.read(task.released, as_version=4)).items()}
    result.max_score = sum(p for _, p in result.tests.values())
    result.notes.append("the grader itself failed on this notebook, which is scored 0 until it is graded again")
    result.private.append(f"the grader failed on this notebook ({why})")
    return result


def points_of(released) -> dict[str, float]:
    """test grade_id -> points, in the released notebook (the instructor's)."""
    return {m["grade_id"]: float(m.get("points", 0)) for m in map(_meta, released.cells) if m.get("grade")}


def _grade_task(task: Task) -> Result:
    released = nbformat.read(task.released, as_version=4)
    points = points_of(released)
    result = Result(task.student, task.assignment, sum(points.values()),
                    tests={g: (0.0, p) for g, p in points.items()})
    if task.path is None:
        result.status = "missing"
        result.notes.append(f"no {task.assignment}.ipynb submitted")
        return result
    try:
        nb, _ = read_submission(Path(task.path), task.submissions)
    except Refused as why:
        result.status = why.status
        result.notes.append(str(why))
        return result
    result.notes += inspect_submission(nb, released)
    verdicts, notes = _judge(task).grade(nb)
    present = {m["grade_id"] for m in map(_meta, nb.cells) if m.get("grade_id")}
    for v in verdicts:
        score = v.points if v.grade_id in present else 0.0
        result.tests[v.grade_id] = (score, v.max_points)
        if v.message:
            result.messages[v.grade_id] = v.message
    result.score = sum(s for s, _ in result.tests.values())
    public, private = split_private(notes)
    result.notes += public
    result.private += private + kernel_disagreements(nb, result)
    write_graded(task, nb, result, released)
    return result


PRIVATE = ("copied? (reported, not scored)", "NOT SEALED")  # the judge's flags that are the instructor's alone


def split_private(notes: list[str]) -> tuple[list[str], list[str]]:
    """The judge's notes for the student, and those for the instructor only (the copy flag,
    an unsealed run)."""
    private = [n for n in notes if any(mark in n for mark in PRIVATE)]
    return [n for n in notes if n not in private], private


def _meta(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def kernel_disagreements(nb, result: Result) -> list[str]:
    """Where the test cells' outputs saved in the submission (the student's own run) and
    the sealed grade disagree: a sign the notebook tampered with its checks, or a flaky answer."""
    lines = []
    for cell in nb.cells:
        gid = _meta(cell).get("grade_id")
        if gid not in result.tests or cell.cell_type != "code" or cell.get("execution_count") is None:
            continue
        passed_there = not any(o.get("output_type") == "error" for o in cell.get("outputs", []))
        score, most = result.tests[gid]
        if passed_there and score < most:
            lines.append(f"{gid}: passed in the submitted notebook's own run but fails in the sealed grade "
                         f"(tampered checks, or an answer that depends on the run)")
        elif not passed_there and score == most and most > 0:
            lines.append(f"{gid}: failed in the submitted notebook's own run but passes in the sealed grade")
    return lines


# ---------------------------------------------------------------------------- reading a hand-in

MAX_BYTES = 32 * 2**20  # the largest hand-in read; a lesson saved with its outputs is well under 5 MiB
MAX_DEPTH = 100         # JSON nesting (a notebook's is under 20: widget state in its metadata)
MAX_DIGITS = 100        # digits in one JSON number
OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a FIFO answers at once, and is refused


class Refused(Exception):
    """Why a hand-in is not graded: the report's line for it, said to the student too, and its
    status: "missing" for what is not read at all (a link, not a file, too large), "not a
    notebook" for what is read but is none."""

    def __init__(self, line: str, status: str = "missing"):
        super().__init__(line)
        self.status = status


def shown(name: str) -> str:
    """A name as one report line shows it: as it is, or quoted with its escapes where it holds a
    character that is not printable (a newline, a tab, a control character)."""
    return name if name.isprintable() else repr(name)


def read_handin(path, root=None) -> tuple[bytes, os.stat_result]:
    """The bytes of the regular file at `path` and its status, read from one descriptor opened
    without following a link: not at its name, nor at a folder between `root` (the submissions
    folder) and it. A link, a file of several names (a hard link), something else than a file, or
    more than MAX_BYTES raise Refused."""
    path = Path(path)
    parts = path.relative_to(root).parts if root else (path.name,)
    fds = [os.open(root or path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
    try:
        for index, name in enumerate(parts):
            fds.append(_open_at(fds[-1], name, last=index == len(parts) - 1))
        status = os.fstat(fds[-1])
        if not stat.S_ISREG(status.st_mode):
            raise Refused(f"{shown(path.name)} is not a file (a folder, a device or a pipe): hand in the notebook")
        if status.st_nlink > 1:
            raise Refused(f"{shown(path.name)} is a link (a hard link: the file has {status.st_nlink} names): "
                          f"hand in the notebook itself, not a link to it")
        chunks, size = [], 0
        while size <= min(status.st_size, MAX_BYTES):  # not one byte past the cap, whatever it grows to
            chunks.append(os.read(fds[-1], MAX_BYTES + 1 - size))
            size += len(chunks[-1])
            if not chunks[-1]:
                break
        if max(size, status.st_size) > MAX_BYTES:
            raise Refused(f"{shown(path.name)} is more than the {MAX_BYTES // 2**20} MiB a hand-in may be: "
                          f"clear its outputs and hand it in again")
        return b"".join(chunks), status
    finally:
        for fd in fds:
            os.close(fd)


def _open_at(folder: int, name: str, last: bool) -> int:
    """`name` in the folder open as `folder`, never through a link."""
    try:
        return os.open(name, OPEN | (0 if last else os.O_DIRECTORY), dir_fd=folder)
    except OSError as error:
        try:
            link = stat.S_ISLNK(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode)
        except OSError:
            link = False
        what = shown(name) + ("" if last else "/")
        if link and last:
            raise Refused(f"{what} is a link: hand in the notebook itself, not a link to it") from None
        if link:
            raise Refused(f"{what} is a link: a student's notebooks go in a folder of their own, not a link") from None
        raise Refused(f"{what} cannot be read ({error.strerror})") from None


def read_submission(path: Path, root=None):
    """The notebook at `path` (under the submissions folder `root`) and its bytes, read by
    `read_handin`, parsed by `parse_notebook` (its shape checked by `shape_problem`); or Refused,
    with the report's line."""
    data = read_handin(path, root)[0]
    try:
        return parse_notebook(data), data
    except Refused as why:
        raise Refused(f"{shown(Path(path).name)}: {why}", why.status) from None


def parse_notebook(data: bytes):
    """The notebook these bytes hold, or Refused: not UTF-8, not JSON, nested or numbered past
    what JSON readers take, or not shaped as a notebook (`shape_problem`)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _no_notebook(f"not UTF-8 text: byte {error.start} is {data[error.start]:#04x}") from None
    try:
        tree = json.loads(text, parse_int=_number(int), parse_float=_number(float), parse_constant=_constant)
    except RecursionError:
        raise _no_notebook(f"invalid JSON: nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as error:
        raise _no_notebook(f"invalid JSON: {error}") from None
    problem = shape_problem(tree)
    if problem:
        raise _no_notebook(problem)
    try:
        return nbformat.reads(text, as_version=4)
    except Exception as error:  # noqa: BLE001: nbformat raises several kinds for what it cannot convert
        raise _no_notebook(f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}") from None


def _no_notebook(why: str) -> Refused:
    return Refused(f"not a notebook ({why})", "not a notebook")


def _number(number):
    """A parser of JSON numbers (`number`: int or float) that refuses what JSON readers do not take alike."""
    def parse(text: str):
        if len(text) > MAX_DIGITS:
            raise ValueError(f"a number of {len(text)} characters, more than the {MAX_DIGITS} a notebook's may have")
        if not math.isfinite(number(text)):
            raise ValueError(f"{text} is past the largest number a JSON reader takes")
        return number(text)
    return parse


def _constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


KIND = {dict: "an object", list: "a list", str: "a string", bool: "true or false", type(None): "null",
        int: "a number", float: "a number"}


def kind(value) -> str:
    """What a JSON value is, in a report's words (never the value: it may be huge)."""
    return KIND[type(value)]


def shape_problem(tree) -> str | None:
    """Where the JSON `tree` is not shaped as a version-4 notebook in what the grader, nbgrader and
    nbformat read (the cell index and field), or None. Checked once, where a hand-in is read: a
    notebook that passes is safe for everything after it."""
    if not isinstance(tree, dict):
        return f"the file holds {kind(tree)}, not a notebook's object"
    if type(tree.get("nbformat")) is not int or tree["nbformat"] != 4:
        version = tree["nbformat"] if type(tree.get("nbformat")) is int else kind(tree.get("nbformat"))
        return f"nbformat is {version}, not 4: save it from a current Jupyter"
    if not isinstance(tree.get("cells"), list):
        return f"cells is {kind(tree.get('cells'))}, not a list"
    problem = _fields(tree, {"metadata": dict}, "") or _fields(tree.get("metadata", {}), METADATA, "metadata.")
    if problem:
        return problem
    for index, cell in enumerate(tree["cells"]):
        problem = _cell_problem(cell)
        if problem:
            return f"cell {index}: {problem}"
    return _depth_problem(tree)


SOURCE = (str, list)
METADATA = {"kernelspec": dict, "language_info": dict}
CELL = {"cell_type": str, "source": SOURCE, "metadata": dict, "attachments": dict}
CODE = {"outputs": list, "execution_count": (int, type(None))}
NBGRADER = {"grade_id": str, "grade": bool, "solution": bool, "locked": bool, "task": bool, "points": (int, float),
            "checksum": str}
OUTPUT = {"stream": {"name": str, "text": SOURCE}, "error": {"ename": str, "evalue": str, "traceback": list},
          "display_data": {"data": dict, "metadata": dict},
          "execute_result": {"data": dict, "metadata": dict, "execution_count": (int, type(None))}}


def _fields(value: dict, types: dict, where: str) -> str | None:
    """The first of `types`' fields that `value` holds with another type (true is not a number)."""
    for name, want in types.items():
        wants = want if isinstance(want, tuple) else (want,)
        if name in value and type(value[name]) not in wants:
            return f"{where}{name} is {kind(value[name])}, not " + " or ".join(dict.fromkeys(map(KIND.get, wants)))
    return None


def _lines_problem(value, where: str) -> str | None:
    if isinstance(value, list) and not all(isinstance(line, str) for line in value):
        return f"{where} is a list holding something else than strings"
    return None


def _named(value) -> str:
    """A short value as a report shows it: a string quoted (cut at 40 characters), else its kind."""
    return repr(value)[:40] if isinstance(value, str) else kind(value)


def _cell_problem(cell) -> str | None:
    if not isinstance(cell, dict):
        return f"the cell is {kind(cell)}, not an object"
    cell_type = cell.get("cell_type")
    if not isinstance(cell_type, str) or cell_type not in ("code", "markdown", "raw"):
        return f"cell_type is {_named(cell_type)}, not code, markdown or raw"
    if "source" not in cell:
        return "source is missing"
    problem = (_fields(cell, {**CELL, **(CODE if cell_type == "code" else {})}, "")
               or _lines_problem(cell["source"], "source") or _nbgrader_problem(cell.get("metadata", {})))
    if problem is None and "\0" in "".join(cell["source"]):
        problem = "source holds a NUL character, which Python cannot compile"
    for index, output in enumerate(cell.get("outputs", []) if cell_type == "code" else []):
        problem = problem or _output_problem(output, f"outputs[{index}]")
    return problem


def _nbgrader_problem(metadata: dict) -> str | None:
    if "nbgrader" not in metadata:
        return None
    meta = metadata["nbgrader"]
    if not isinstance(meta, dict):
        return f"metadata.nbgrader is {kind(meta)}, not an object"
    problem = _fields(meta, NBGRADER, "metadata.nbgrader.")
    if problem is None and meta.get("grade") and "points" not in meta:
        return "metadata.nbgrader.points is missing on a graded cell"
    if problem is None and (meta.get("grade") or meta.get("solution") or meta.get("locked")) and "grade_id" not in meta:
        return "metadata.nbgrader.grade_id is missing on a graded, answer or locked cell"
    return problem


def _output_problem(output, where: str) -> str | None:
    if not isinstance(output, dict):
        return f"{where} is {kind(output)}, not an object"
    if not isinstance(output.get("output_type"), str) or output["output_type"] not in OUTPUT:
        return f"{where}.output_type is {_named(output.get('output_type'))}, not one of {', '.join(OUTPUT)}"
    fields = OUTPUT[output["output_type"]]
    missing = [name for name in fields if name not in output and name not in ("metadata", "execution_count")]
    if missing:
        return f"{where}.{missing[0]} is missing"
    problem = _fields(output, fields, where + ".")
    if problem is None and output["output_type"] == "stream":
        problem = _lines_problem(output["text"], where + ".text")
    if problem is None and output["output_type"] == "error" and not all(isinstance(t, str) for t in output["traceback"]):
        problem = f"{where}.traceback is a list holding something else than strings"
    return problem


def _depth_problem(tree) -> str | None:
    """Nesting past MAX_DEPTH, found without recursion."""
    level = [(tree, 1)]
    while level:
        value, depth = level.pop()
        if depth > MAX_DEPTH:
            return f"nested deeper than {MAX_DEPTH} levels"
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        level += [(child, depth + 1) for child in children if isinstance(child, (dict, list))]
    return None


def graded_cells(nb) -> dict[str, dict]:
    """grade_id -> nbgrader metadata, for the answer and test cells of a notebook."""
    cells = {}
    for cell in nb.cells:
        meta = _meta(cell)
        if meta.get("grade_id") and (meta.get("grade") or meta.get("solution") or meta.get("locked")):
            cells[meta["grade_id"]] = dict(meta, _cell=cell)
    return cells


def inspect_submission(nb, released) -> list[str]:
    """Report lines for a submission's missing or edited graded cells."""
    notes, mine, theirs = [], graded_cells(nb), graded_cells(released)
    missing_tests = [g for g, m in theirs.items() if m.get("grade") and g not in mine]
    missing_answers = [g for g, m in theirs.items() if m.get("solution") and not m.get("grade") and g not in mine]
    if missing_tests:
        notes.append("missing test cells, scored 0: " + ", ".join(
            f"{g} ({theirs[g].get('points', 0):g} pt)" for g in missing_tests))
    if missing_answers:
        notes.append("missing answer cells (graded on what the notebook defines): " + ", ".join(missing_answers))
    edited = [g for g, m in theirs.items() if m.get("locked") and g in mine
              and nbg_utils.compute_checksum(mine[g]["_cell"]) != m.get("checksum")]
    if edited:
        notes.append("edited test cells, restored to the instructor's version: " + ", ".join(edited))
    return notes


def write_graded(task: Task, nb, result: Result, released) -> None:
    """The notebook as graded (test cells as the instructor wrote them, hidden tests
    included, each followed by its verdict) and the feedback page, under task.out."""
    solution = {(_meta(c).get("grade_id")): c for c in nbformat.read(task.solution, as_version=4).cells}
    graded = nbformat.from_dict(json.loads(json.dumps(nb)))
    for cell in graded.cells:
        gid = _meta(cell).get("grade_id")
        if gid in result.tests and gid in solution:
            cell.source = solution[gid].source
            score, most = result.tests[gid]
            text = f"{score:g}/{most:g}" + (f": {result.messages[gid]}" if gid in result.messages else "")
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text + "\n")]
    folder = Path(task.out) / "graded" / task.student
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(graded, str(folder / f"{task.assignment}.ipynb"))
    (Path(task.out) / "feedback" / task.student).mkdir(parents=True, exist_ok=True)
    (Path(task.out) / "feedback" / task.student / f"{task.assignment}.html").write_text(
        feedback.page(result, released), encoding="utf-8")


def fingerprints(paths: list[Path]) -> dict[Path, str]:
    """Every file under `paths` by the hash of its content."""
    files = {}
    for root in paths:
        for path in sorted(Path(root).rglob("*")) if Path(root).is_dir() else [Path(root)]:
            if path.is_file() and "__pycache__" not in path.parts:
                files[path] = hashlib.sha256(path.read_bytes()).hexdigest()
    return files


def changed_since(before: dict[Path, str], paths: list[Path]) -> list[str]:
    """The files under `paths` that changed, appeared or went since `before` was taken. Only
    reported: grading never writes, reverts or removes a course file (an instructor may be
    editing next week's lesson while a class is graded)."""
    now = fingerprints(paths)
    return [str(p) for p in sorted(set(before) | set(now)) if before.get(p) != now.get(p)]
