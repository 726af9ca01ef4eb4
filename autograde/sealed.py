"""One submitted notebook graded by the sealed judge, and a class graded N notebooks at a time.

The judge (`parakit.grading.judge`) runs in a worker process that never executes or
unpickles anything a student wrote; the student's code runs on fresh ranks of its own,
the reference on ranks the student never touched. A worker keeps one judge per lesson, so
the reference's results for the class's (secretly seeded, shared) inputs are computed once.
`--jobs N` runs N workers; every notebook's grade is the same as with one.
"""
from __future__ import annotations

import hashlib
import json
import secrets
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

import nbformat
from nbgrader import utils as nbg_utils

from autograde import feedback

__all__ = ["Result", "Task", "grade_all", "read_submission", "inspect_submission", "course_salt"]


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


def course_salt(root: Path) -> str:
    """The course's secret for drawing test inputs: made once, kept in the course root
    (git-ignored; students never see it), so every run and every worker draws the same."""
    path = Path(root) / ".sealed-salt"
    if not path.exists():
        path.write_text(secrets.token_hex(16))
    return path.read_text().strip()


def grade_all(tasks: list[Task], jobs: int = 1, on_result=lambda r: None) -> list[Result]:
    """Every task's Result, in the order of `tasks`; `jobs` notebooks graded at once."""
    if jobs <= 1:
        results = []
        for task in tasks:
            results.append(grade_task(task))
            on_result(results[-1])
        _close_judges()
        return results
    done: dict[int, Result] = {}
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
        futures = {pool.submit(grade_task, task): i for i, task in enumerate(tasks)}
        for future in as_completed(futures):
            done[futures[future]] = future.result()
            on_result(done[futures[future]])
    return [done[i] for i in range(len(tasks))]


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
    start = time.monotonic()
    result = _grade_task(task)
    result.seconds = time.monotonic() - start
    return result


def _grade_task(task: Task) -> Result:
    released = nbformat.read(task.released, as_version=4)
    points = {m["grade_id"]: float(m.get("points", 0)) for m in map(_meta, released.cells) if m.get("grade")}
    result = Result(task.student, task.assignment, sum(points.values()),
                    tests={g: (0.0, p) for g, p in points.items()})
    if task.path is None:
        result.status = "missing"
        result.notes.append(f"no {task.assignment}.ipynb submitted")
        return result
    nb, problem = read_submission(Path(task.path))
    if nb is None:
        result.status = "not a notebook"
        result.notes.append(f"{Path(task.path).name}: {problem}")
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


def read_submission(path: Path):
    """The notebook at `path`, or the reason it is not one."""
    try:
        data = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        return None, f"not a notebook (invalid JSON: {error})"
    try:
        return nbformat.reads(json.dumps(data), as_version=4), None
    except Exception as error:  # nbformat raises several kinds for malformed notebooks
        return None, f"not a notebook ({type(error).__name__}: {str(error).splitlines()[0]})"


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
