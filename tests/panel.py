"""Fake students for the grading pipeline, built from a lesson and its solution notebook.

Cells are found by their nbgrader `grade_id`. A lesson supplies only what is its own (the
source of a hard-coded answer, of a student who calls the reference, ...) and the scores
it expects; `standard_panel` adds the students every lesson is graded against:

    full           the lesson with every answer cell taken back from the solution
    hardcoded      full, with some answers replaced by ones that only pass the visible tests
    edited_tests   the lesson as released, every test cell replaced by `pass`: once the grader
                   restores the tests, this is the untouched lesson, whose stubs score 0
    hang_and_crash full, one answer cell never returns and another kills the kernel
    missing_cells  full, the test cells of one exercise deleted
    not_a_notebook a file with the lesson's name that is not JSON
    wrong_name     the full solution saved as `<lesson>-Copy1.ipynb`
"""
from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import nbformat

PANELS = Path(__file__).parent / "lesson_panels"
HANG = "import time\ntime.sleep(10**6)  # this answer never returns\n"
CRASH = "import os\nos._exit(1)  # this answer takes the kernel down\n"
EDITED_TEST = "pass  # the student replaced the test\n"


def load(path) -> nbformat.NotebookNode:
    return nbformat.read(str(path), as_version=4)


def nbgrader_meta(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def grade_ids(nb, kind: str | None = None) -> list[str]:
    """grade_ids in notebook order; kind "answer" (solution cells) or "test" (graded cells)."""
    ids = []
    for cell in nb.cells:
        meta = nbgrader_meta(cell)
        if not meta.get("grade_id"):
            continue
        if kind is None or (kind == "answer" and meta.get("solution")) or (kind == "test" and meta.get("grade")):
            ids.append(meta["grade_id"])
    return ids


def points(nb) -> dict[str, float]:
    """test grade_id -> points."""
    return {nbgrader_meta(c)["grade_id"]: float(nbgrader_meta(c).get("points", 0))
            for c in nb.cells if nbgrader_meta(c).get("grade")}


def exercises(nb) -> dict[str, list[str]]:
    """answer grade_id -> the test cells that follow it, up to the next answer cell."""
    groups, current = {}, None
    for cell in nb.cells:
        meta = nbgrader_meta(cell)
        if meta.get("solution"):
            current = meta["grade_id"]
            groups[current] = []
        elif meta.get("grade") and current is not None:
            groups[current].append(meta["grade_id"])
    return groups


def with_sources(nb, sources: dict[str, str]):
    """A copy of `nb` with the cells named by grade_id given these sources."""
    nb = copy.deepcopy(nb)
    unknown = set(sources) - set(grade_ids(nb))
    if unknown:
        raise KeyError(f"no cells with grade_id {sorted(unknown)}; the notebook has {grade_ids(nb)}")
    for cell in nb.cells:
        gid = nbgrader_meta(cell).get("grade_id")
        if gid in sources:
            cell.source = sources[gid]
    return nb


def without(nb, ids) -> nbformat.NotebookNode:
    """A copy of `nb` without the cells named by grade_id."""
    nb = copy.deepcopy(nb)
    nb.cells = [c for c in nb.cells if nbgrader_meta(c).get("grade_id") not in set(ids)]
    return nb


def full_solution(lesson, solution):
    """The released lesson with every answer cell's source taken back from the solution."""
    answers = {nbgrader_meta(c)["grade_id"]: c.source for c in solution.cells if nbgrader_meta(c).get("solution")}
    return with_sources(lesson, {g: answers[g] for g in grade_ids(lesson, "answer")})


@dataclass
class Student:
    """A fake student: the files they hand in and what the grader should make of them."""
    name: str
    files: dict[str, object]          # file name -> NotebookNode, str or bytes
    expected: dict[str, float]        # test grade_id -> points (tests left out: 0)
    report: list[str] = field(default_factory=list)   # text each expected in the report

    def write(self, folder: Path) -> None:
        home = Path(folder) / self.name
        home.mkdir(parents=True, exist_ok=True)
        for name, content in self.files.items():
            if isinstance(content, nbformat.NotebookNode):
                nbformat.write(content, str(home / name))
            elif isinstance(content, bytes):
                (home / name).write_bytes(content)
            else:
                (home / name).write_text(content)


def write_panel(students: list[Student], folder: Path) -> Path:
    folder = Path(folder)
    for student in students:
        student.write(folder)
    return folder


def standard_panel(lesson_path, solution_path, *, hardcoded: dict[str, str],
                   hardcoded_expected: dict[str, float], hang_in: str | None = None,
                   crash_in: str | None = None, hang_source: str = HANG, crash_source: str = CRASH,
                   missing_exercise: str | None = None, borrowed: dict[str, str] | None = None,
                   extra: list[Student] = ()) -> list[Student]:
    """The standard fake class for one lesson.

    hardcoded: answer grade_id -> a source that passes the visible tests only;
    hardcoded_expected: the test scores that changes (others stay full).
    hang_in / crash_in / missing_exercise: the answer whose cell hangs / crashes / whose tests are
    deleted (default: the first answer; crash_in the next one). borrowed: answer grade_id -> a
    source that calls the finished thing (parakit's or torch's own), a student who scores 0 on
    every test by the tripwires. extra: the lesson's own students.
    """
    lesson, solution = load(lesson_path), load(solution_path)
    name = Path(lesson_path).name
    full, pts, groups = full_solution(lesson, solution), points(lesson), exercises(lesson)
    first = grade_ids(lesson, "answer")[0]

    def full_except(zeroed=(), **scores):
        expected = dict(pts)
        expected.update({t: 0.0 for a in zeroed for t in groups[a]})
        expected.update(scores)
        return expected

    hang_in = hang_in or first
    crash_in = crash_in or next(a for a in groups if a != hang_in)
    assert hang_in != crash_in, "one student hangs in one answer and crashes in another: name two answers"
    missing = groups[missing_exercise or first]
    return [
        Student("full", {name: full}, full_except()),
        Student("hardcoded", {name: with_sources(full, hardcoded)}, full_except(**hardcoded_expected)),
        Student("edited_tests", {name: with_sources(lesson, {t: EDITED_TEST for t in pts})}, {},
                report=["edited test cells, restored"]),
        Student("hang_and_crash", {name: with_sources(full, {hang_in: hang_source, crash_in: crash_source})},
                full_except([hang_in, crash_in]), report=["timed out", "the kernel died"]),
        Student("missing_cells", {name: without(full, missing)}, full_except(**{t: 0.0 for t in missing}),
                report=["missing test cells, scored 0: " + missing[0]]),
        Student("not_a_notebook", {name: "this is not a notebook {"}, {}, report=["not a notebook (invalid JSON"]),
        Student("wrong_name", {name.replace(".ipynb", "-Copy1.ipynb"): full}, {},
                report=["does not match any assignment (did you mean " + name]),
        *([Student("borrower", {name: with_sources(full, borrowed)}, {})] if borrowed else []),
        *extra,
    ]


@dataclass
class Lesson:
    solution: Path                                  # the instructor notebook
    panel: Callable[[Path, Path], list[Student]]   # (lesson, solution) -> students
    timeout: int                                    # seconds per cell while grading the panel

    @property
    def name(self) -> str:
        return self.solution.stem


def course_lessons() -> list[Lesson]:
    """Every lesson's panel: tests/lesson_panels/NN_name.py each defines LESSON."""
    modules = sorted(p.stem for p in PANELS.glob("[0-9][0-9]_*.py"))
    return [importlib.import_module(f"lesson_panels.{m}").LESSON for m in modules]
