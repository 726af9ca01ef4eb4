"""The grading pipeline: lessons generated from solutions, validated, and a panel of fake
students autograded by `python -m autograde.course grade` with the scores expected.

Every lesson is tested the same way: add it to LESSONS with its panel (see tests/panel.py).
The toy notebook (tests/fixtures/toy.ipynb) runs the whole machinery in about a minute and
also carries the tests of the machinery itself; a real lesson's panel executes the lesson
once per fake student, so each lesson's panel is kept small (about eight executed notebooks).
"""
from __future__ import annotations

import csv
import html
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest

import hostile
import panel
from conftest import REPO, processes_with

os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
sys.path.insert(0, str(REPO))
from autograde import course  # noqa: E402  (after PATH: nbgrader calls `alembic`)

FIXTURES = Path(__file__).parent / "fixtures"


def toy_panel(lesson: Path, solution: Path) -> list[panel.Student]:
    hardcoded = 'def add(a, b):\n    return {(1, 2): 3, (-1, 1): 0, (0, 0): 0}[(a, b)]  # the visible cases only\n'
    untouched = panel.Student("untouched", {lesson.name: panel.load(lesson)}, {})  # a real lesson's is edited_tests
    return panel.standard_panel(lesson, solution, hardcoded={"add": hardcoded},
                                hardcoded_expected={"test_add_hidden": 0.0}, extra=[untouched])


TOY = pytest.param(panel.Lesson(FIXTURES / "toy.ipynb", toy_panel, timeout=15), id="toy")  # its kernel imports torch
ON_TOY_ONLY = pytest.mark.parametrize("built", [TOY], indirect=True)  # tests of the machinery itself
ON_00_ONLY = pytest.mark.parametrize("built", [pytest.param(lesson, id=lesson.name) for lesson in panel.course_lessons()
                                               if lesson.name == "00_collectives"], indirect=True)
LESSONS = [TOY] + [pytest.param(lesson, id=lesson.name) for lesson in panel.course_lessons()]


@dataclass
class Built:
    lesson: panel.Lesson
    solutions: Path      # a folder holding only this lesson's solution
    lessons: Path        # the generated student notebook lands here
    students: list[panel.Student]

    @property
    def released(self) -> Path:
        return self.lessons / f"{self.lesson.name}.ipynb"


@pytest.fixture(scope="module", params=LESSONS)
def built(request, tmp_path_factory) -> Built:
    lesson, tmp = request.param, tmp_path_factory.mktemp(request.param.name)
    solutions = tmp / "solutions"
    solutions.mkdir()
    shutil.copyfile(lesson.solution, solutions / lesson.solution.name)
    assert course.generate(tmp / "lessons", solutions) == []
    released = tmp / "lessons" / lesson.solution.name
    return Built(lesson, solutions, tmp / "lessons", lesson.panel(released, lesson.solution))


CODE: list[Path] = []  # where the copy of parakit and autograde that `run_course` runs lies


@pytest.fixture(scope="module", autouse=True)
def code_copy(tmp_path_factory) -> Path:
    """parakit and autograde, copied: a grade run on the checkout would grade with half of an
    edit made meanwhile."""
    root = tmp_path_factory.mktemp("code")
    for name in ("parakit", "autograde"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    CODE[:] = [root]
    return root


def on_the_copy() -> dict:
    """Where and how a command runs the copy of the code (`code_copy`): its folder, its path."""
    path = os.pathsep.join(filter(None, [str(CODE[0]), os.environ.get("PYTHONPATH")]))
    return {"cwd": CODE[0], "env": {**os.environ, "PYTHONPATH": path}}


def run_course(*args: str, timeout: float = 600, tmp: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m autograde.course *args` on the copy of the code (its temporary files in `tmp`)."""
    where = on_the_copy()
    if tmp is not None:
        where["env"]["TMPDIR"] = str(tmp)
    return subprocess.run([sys.executable, "-m", "autograde.course", *args], **where,
                          capture_output=True, text=True, timeout=timeout)


@dataclass
class Graded:
    run: subprocess.CompletedProcess
    scores: dict[str, dict[str, float]]      # student -> test -> points
    rows: dict[str, dict[str, str]]          # student -> grades.csv row
    root: Path
    out: Path

    def report_of(self, student: str) -> str:
        """The student's lines of the printed report (their score line and the notes under it)."""
        mine, inside = [], False
        for line in self.run.stdout.splitlines():
            if not line.startswith(" "):
                inside = line.split(" ", 1)[0] == student
            if inside:
                mine.append(line)
        return "\n".join(mine)


def grade_panel(built: Built, students: list[panel.Student], folder: Path, root: Path,
                stray: dict[str, str] = {}, jobs: int = 1, tmp: Path | None = None) -> Graded:
    shutil.rmtree(folder, ignore_errors=True)
    panel.write_panel(students, folder)
    for name, text in stray.items():
        (folder / name).write_text(text)
    run = run_course("--solutions", str(built.solutions), "grade", str(folder), "--root", str(root),
                     "--timeout", str(built.lesson.timeout), "--jobs", str(jobs), tmp=tmp)
    assert run.returncode == 0, run.stdout + run.stderr
    out = root / "grades"
    scores: dict[str, dict[str, float]] = {}
    with open(out / "grades_by_test.csv") as f:
        for row in csv.DictReader(f):
            scores.setdefault(row["student"], {})[row["test"]] = float(row["score"])
    with open(out / "grades.csv") as f:
        rows = {row["student"]: row for row in csv.DictReader(f)}
    return Graded(run, scores, rows, root, out)


@pytest.fixture(scope="module")
def graded(built, tmp_path_factory) -> Graded:
    tmp = tmp_path_factory.mktemp("graded")
    return grade_panel(built, built.students, tmp / "class", tmp / "course",
                       stray={"notes.txt": "a file outside any student folder"})


def expected_scores(built: Built, student: panel.Student) -> dict[str, float]:
    return {test: student.expected.get(test, 0.0) for test in panel.points(panel.load(built.released))}


# ---------------------------------------------------------------------------- execute

def execute(tmp_path, sources: list[str], **traits) -> list[str | None]:
    """Run code cells with the autograder's executor; return each cell's error name (or None)."""
    from autograde.execute import ResilientExecute
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources],
                                  metadata={"kernelspec": {"name": "python3", "language": "python",
                                                           "display_name": "Python 3"}})
    ResilientExecute(timeout=5, interrupt_grace=2, **traits).preprocess(nb, {"metadata": {"path": str(tmp_path)}})
    errors = [[o.ename for o in c.outputs if o.output_type == "error"] for c in nb.cells]
    return [e[-1] if e else None for e in errors], nb


def test_a_dead_kernel_fails_only_its_cell_and_the_cells_before_are_replayed(tmp_path):
    errors, nb = execute(tmp_path, ["x = 41", "import os\nos._exit(1)", "print(x + 1)"])
    assert errors == [None, "DeadKernelError", None]
    assert nb.cells[2].outputs[0].text == "42\n"


def test_a_kernel_that_ignores_the_interrupt_is_restarted(tmp_path):
    stubborn = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    time.sleep(0.1)"
    errors, nb = execute(tmp_path, ["x = 1", stubborn, "print(x)"])
    assert errors == [None, "UnresponsiveKernel", None]
    assert nb.cells[2].outputs[0].text == "1\n"


def test_after_max_restarts_the_cells_left_are_marked_not_run(tmp_path):
    crash = "import os\nos._exit(1)"
    errors, _ = execute(tmp_path, [crash, crash, "print(1)", "print(2)"], max_restarts=1)
    assert errors == ["DeadKernelError", "DeadKernelError", "KernelRestartLimit", "KernelRestartLimit"]


# ---------------------------------------------------------------------------- generate

def test_generated_lesson_has_stubs_no_solutions_no_hidden_tests_no_outputs(built):
    lesson, solution = panel.load(built.released), panel.load(built.lesson.solution)
    assert panel.grade_ids(lesson) == panel.grade_ids(solution)
    for cell in lesson.cells:
        assert "BEGIN SOLUTION" not in cell.source and "BEGIN HIDDEN TESTS" not in cell.source
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None
    for gid in panel.grade_ids(lesson, "answer"):
        assert "raise NotImplementedError()" in next(c for c in lesson.cells if panel.nbgrader_meta(c).get("grade_id") == gid).source
    for cell in lesson.cells:
        if panel.nbgrader_meta(cell).get("grade"):
            assert panel.nbgrader_meta(cell)["locked"] and cell.metadata["editable"] is False


def test_generation_is_reproducible_so_check_passes_on_what_it_wrote(built):
    first = built.released.read_bytes()
    assert course.generate(built.lessons, built.solutions, check=True) == []
    course.generate(built.lessons, built.solutions)
    assert built.released.read_bytes() == first


@ON_TOY_ONLY
def test_check_names_each_lesson_that_drifted_from_its_solution(built, tmp_path):
    lessons = tmp_path / "lessons"
    shutil.copytree(built.lessons, lessons)
    stale = panel.load(built.released)
    test_id = panel.grade_ids(stale, "test")[0]
    nbformat.write(panel.with_sources(stale, {test_id: "assert True\n"}), lessons / built.released.name)
    nbformat.write(stale, lessons / "99_orphan.ipynb")
    problems = course.generate(lessons, built.solutions, check=True)
    assert len(problems) == 2, problems
    assert built.released.name in problems[0] and f"({test_id}): source differ" in problems[0]
    assert "99_orphan.ipynb has no solution notebook" in problems[1]
    shutil.rmtree(lessons)
    assert course.generate(lessons, built.solutions, check=True) == [f"{lessons / built.released.name} is missing"]


@ON_TOY_ONLY
def test_check_exits_nonzero_from_the_command_line(built, tmp_path):
    shutil.copytree(built.lessons, tmp_path / "lessons")
    nb = panel.load(tmp_path / "lessons" / built.released.name)
    nb.cells[0].source += "\nedited by hand"
    nbformat.write(nb, tmp_path / "lessons" / built.released.name)
    run = run_course("--solutions", str(built.solutions), "generate", "--check", "--lessons", str(tmp_path / "lessons"))
    assert run.returncode == 1 and "cell 0: source differ" in run.stdout and "run `python -m autograde.course generate`" in run.stdout


def test_committed_lessons_match_the_solutions():
    """lessons/ is what nbgrader makes of solutions/ (regenerate with `python -m autograde.course generate`)."""
    if not list((REPO / "solutions").glob("*.ipynb")):
        pytest.skip("no solution notebooks yet")
    assert course.generate(REPO / "lessons", REPO / "solutions", check=True) == []
    for path in sorted((REPO / "lessons").glob("*.ipynb")):
        with_outputs = [i for i, c in enumerate(panel.load(path).cells) if c.cell_type == "code" and c.outputs]
        assert not with_outputs, f"{path.name} was committed with outputs in cells {with_outputs}: regenerate it"


@ON_TOY_ONLY
def test_an_instructors_files_saved_during_a_grade_run_are_kept_and_named_in_the_report(built, tmp_path):
    """grade never reverts or removes a course file: a new file in solutions/ and an edit of
    another lesson's solution, both saved while a notebook is being graded, are there afterwards."""
    solutions, root = tmp_path / "solutions", tmp_path / "course"
    tmp = Path(tempfile.mkdtemp(prefix="pk"))  # short: the broker's socket path must fit AF_UNIX's 108 bytes
    shutil.copytree(built.solutions, solutions)
    other = solutions / "next_week.ipynb"
    shutil.copyfile(built.lesson.solution, other)
    edited, new = other.read_text().replace("add", "added"), solutions / "notes.md"
    slow = panel.with_sources(panel.full_solution(panel.load(built.released), panel.load(built.lesson.solution)),
                              {"add": "import time\nslow = [1]\ndef add(a, b):\n    if slow:  # once a process\n"
                                      "        time.sleep(slow.pop())\n    return a + b\n"})

    def save_while_grading():  # once the run's scratch folder exists, its notebook is being graded
        for _ in range(6000):  # a bound on a run that never gets there: 600 s
            if list(tmp.glob("parakit-grading-*")):
                new.write_text("next week's plan\n")
                other.write_text(edited)
                return
            time.sleep(0.1)

    saver = threading.Thread(target=save_while_grading)
    saver.start()
    try:
        graded = grade_panel(Built(built.lesson, solutions, built.lessons, built.students),
                             [panel.Student("alice", {built.released.name: slow}, {})], tmp_path / "class", root,
                             tmp=tmp)
    finally:
        saver.join()
        shutil.rmtree(tmp)
    assert new.read_text() == "next week's plan\n" and other.read_text() == edited
    assert graded.scores["alice"] == panel.points(panel.load(built.released))  # nobody pays for the edit
    report = (graded.out / "report.txt").read_text()
    assert "2 course file(s) changed during this run, kept as they are" in report, report


# ---------------------------------------------------------------------------- validate

@ON_TOY_ONLY
def test_solution_passes_validate_and_untouched_lesson_passes_validate_invert(built):
    """The instructors' `validate` command on the toy lesson. Each real lesson's solution is not
    validated here: that would be a third whole run of it, and what it checks is checked twice
    already: nbval runs every solution's cells, test cells and hidden tests included, in a kernel
    (the suite collects solutions/), and each lesson's panel grades the solution's answers in the
    released lesson (its `full` student, every test at full marks) and the untouched lesson once
    its tests are restored (its `edited_tests` student, 0 on every test). Validating them as well
    cost the suite about 550 s of its two processes' time on CI's machine."""
    # the course's 300 s a cell, a bound on a hang only: the toy's 15 s was passed by a kernel importing torch under load
    assert course.validate(built.solutions, built.lessons) == []


@ON_TOY_ONLY
def test_validate_complains_about_a_lesson_whose_tests_pass(built, tmp_path):
    shutil.copytree(built.lessons, tmp_path / "lessons")
    solved = panel.full_solution(panel.load(built.released), panel.load(built.lesson.solution))
    nbformat.write(solved, tmp_path / "lessons" / built.released.name)
    problems = course.validate(built.solutions, tmp_path / "lessons")  # 300 s a cell: a hang bound
    assert len(problems) == len(panel.grade_ids(solved, "test"))
    assert all("a test cell passed" in p for p in problems)


# ---------------------------------------------------------------------------- grade

@pytest.mark.timeout(1500)  # grading the panel (the `graded` fixture) runs inside this test's limit
def test_panel_gets_the_expected_scores(built, graded):
    got = {s.name: graded.scores.get(s.name) for s in built.students}
    want = {s.name: expected_scores(built, s) for s in built.students}
    assert got == want


def test_report_says_what_happened_to_each_student(built, graded):
    for student in built.students:
        report = graded.report_of(student.name)
        assert report, f"{student.name} is missing from the report:\n{graded.run.stdout}"
        for text in student.report:
            assert text in report, f"{text!r} not in {student.name}'s report:\n{report}"
    assert "notes.txt: not in a student folder, ignored" in graded.run.stdout
    assert graded.rows["not_a_notebook"]["status"] == "not a notebook"
    assert graded.rows["wrong_name"]["status"] == "missing"


def test_edited_test_cells_are_graded_as_the_instructor_wrote_them(built, graded):
    solution = panel.load(built.lesson.solution)
    name = built.lesson.name
    autograded = panel.load(graded.out / "graded" / "edited_tests" / f"{name}.ipynb")
    for test_id in panel.grade_ids(solution, "test"):
        want = next(c.source for c in solution.cells if panel.nbgrader_meta(c).get("grade_id") == test_id)
        got = next(c.source for c in autograded.cells if panel.nbgrader_meta(c).get("grade_id") == test_id)
        assert got == want  # hidden tests included


def test_every_student_gets_feedback_and_a_csv_row(built, graded):
    for student in built.students:
        assert graded.rows[student.name]["max_score"] == f"{sum(panel.points(panel.load(built.released)).values()):g}"
        html = (graded.out / "feedback" / student.name / f"{built.lesson.name}.html").read_text()
        assert built.lesson.name in html
    assert "could not be graded" in (graded.out / "report.txt").read_text()


@ON_TOY_ONLY
def test_grading_again_regrades_from_scratch(built, graded, tmp_path):
    """Same course root, new hand-ins: the new ones are graded, nothing stale survives."""
    by_name = {s.name: s for s in built.students}
    swapped = [panel.Student("full", by_name["not_a_notebook"].files, {}),
               panel.Student("untouched", by_name["full"].files, by_name["full"].expected)]
    again = grade_panel(built, swapped, tmp_path / "class", graded.root)
    assert again.scores == {s.name: expected_scores(built, s) for s in swapped}
    assert again.rows["full"]["status"] == "not a notebook"
    assert not (again.out / "graded" / "full" / f"{built.lesson.name}.ipynb").exists()
    assert set(again.rows) == {"full", "untouched"}


@ON_TOY_ONLY
def test_a_grade_run_killed_midway_loses_nothing_graded_and_the_next_run_resumes(built, graded, tmp_path):
    """The grade command stopped (SIGTERM, as Ctrl-C) after its first notebook: the next run takes
    that notebook's grade from the journal, grades the rest, and writes the same grades.csv as one
    whole run. The notebook it was grading is not blamed: a crash would leave its mark in the
    journal, and the next run skip it (tests/test_handins.py)."""
    folder = tmp_path / "class"
    panel.write_panel(built.students, folder)
    (folder / "notes.txt").write_text("a file outside any student folder")
    out = tmp_path / "out"
    args = ["--solutions", str(built.solutions), "grade", str(folder), "--root", str(graded.root),
            "--timeout", str(built.lesson.timeout), "--out", str(out)]
    with open(tmp_path / "stderr", "w") as stderr:
        command = subprocess.Popen([sys.executable, "-m", "autograde.course", *args], **on_the_copy(), text=True,
                                   stdout=subprocess.PIPE, stderr=stderr, process_group=0)
        first = command.stdout.readline()
        os.killpg(command.pid, signal.SIGTERM)
        rest = command.stdout.read()
        command.wait()
    said = f"first line {first!r}, then {rest[:500]!r}; stderr {(tmp_path / 'stderr').read_text()[-1500:]}"
    assert command.returncode == 130, said
    assert (out / "journal" / "unfinished").exists() and not (out / "grades.csv").exists(), said
    assert list((out / "journal").glob("*.started")) == []
    again = run_course(*args)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.startswith(f"resuming: 1 of {len(graded.rows)} notebooks"), again.stdout[:300]
    graded_again = [line.split()[0] for line in again.stdout.splitlines()[1:] if line and not line[0].isspace()]
    assert first.split()[0] not in graded_again  # taken from the journal, not graded twice
    with open(out / "grades.csv") as f:
        assert {row["student"]: row for row in csv.DictReader(f)} == graded.rows
    assert not (out / "journal" / "unfinished").exists()


@ON_TOY_ONLY
def test_jobs_grade_the_same_as_one_at_a_time(built, graded, tmp_path):
    """Two notebooks at a time, same course root: the same grades.csv, row for row."""
    again = grade_panel(built, built.students, tmp_path / "class", graded.root, jobs=2,
                        stray={"notes.txt": "a file outside any student folder"})
    assert len(again.rows) >= 6
    assert (again.out / "grades.csv").read_text() == (graded.out / "grades.csv").read_text()


@ON_TOY_ONLY
def test_an_answer_that_misses_or_misnames_what_the_tests_need_is_said_in_one_line(built, tmp_path):
    full = panel.full_solution(panel.load(built.released), panel.load(built.lesson.solution))
    students = [panel.Student("no_def", {built.released.name: panel.with_sources(full, {"add": "plus = 1\n"})}, {}),
                panel.Student("wrong_args", {built.released.name: panel.with_sources(
                    full, {"add": "def add(a):\n    return a\n"})}, {}),
                panel.Student("bad_import", {built.released.name: panel.with_sources(
                    full, {"add": "import no_such_module\ndef add(a, b):\n    return a + b\n"})}, {})]
    graded = grade_panel(built, students, tmp_path / "class", tmp_path / "course")
    lines = {"no_def": "add: the answer cell does not define add (expected def add(a, b))",
             "wrong_args": "add: add is defined as add(a); expected def add(a, b)",
             "bad_import": "add: the answer cell raised ModuleNotFoundError: No module named 'no_such_module'"}
    full_marks = panel.points(panel.load(built.released))
    for student in students:
        assert lines[student.name] in graded.report_of(student.name)
        page = (graded.out / "feedback" / student.name / f"{built.lesson.name}.html").read_text()
        assert html.escape(lines[student.name]) in page
        assert graded.scores[student.name]["test_add"] == 0
        assert graded.scores[student.name]["test_mean"] == full_marks["test_mean"]


@ON_00_ONLY
def test_hostile_students_leave_nothing_behind(built, graded):
    """Their scores are in the panel; here: no process of theirs lives on, the judge never ran
    their pickle, and the course's files are as they were: the copy of parakit the grade ran and
    the checkout's."""
    assert processes_with(hostile.MARKER) == []
    assert not hostile.UNPICKLED.exists()
    for root in (CODE[0], REPO):
        for path in (root / "parakit" / "grading" / "__init__.py", root / "parakit" / "comm.py"):
            assert "PWNED" not in path.read_text()
    assert "passed in the submitted notebook's own run but fails" in graded.report_of("replaces_the_checks")
