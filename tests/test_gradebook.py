"""The sealed grades in nbgrader's world: the formgrader of a JupyterLab opened as the README
says, and the gradebook it shows.

A course of two lessons, toy and 01_toy (both tests/fixtures/toy.ipynb, 5 points), and one
class of three: alice hands in the full solution of toy, bob a wrong `mean` (3 of 5), carol the
lesson untouched (0); nobody hands in 01_toy. Every run is `python -m autograde.course grade` on
a copy of the code (the grader puts back any file of the code it runs that changes while it
grades: an edit made meanwhile in the checkout would be undone), and each costs some 15 s of
CPU however few notebooks it grades (imports, the judge's zygote, its reference), so the class is graded
once and every test of that grading reads the same gradebook, report and log. The runs that
test grading again follow one another, each in a copy of the course as the run before left it
(its tests read it as that run left it): the class again (bob's full solution, carol gone),
then `--lesson 01` (alice hands in 01_toy too), then `--student bob --in-kernel` (bob hands in
an answer that switches the checks off in his kernel). Bad input is one run of its own.
JupyterLab is started once, the README's way, with the course's configuration found through
the environment (.ci/setup's .venv/etc/jupyter/nbgrader_config.py) and the venv's bin folder
not on PATH.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
from nbgrader.api import Gradebook, SubmittedAssignment

import panel
from autograde.course import generate, main
from conftest import REPO

FIXTURES = Path(__file__).parent / "fixtures"
ENV_CONFIG = Path(sys.prefix) / "etc" / "jupyter" / "nbgrader_config.py"   # written by .ci/setup
BIN = str(Path(sys.executable).parent)
os.environ["PATH"] = os.pathsep.join([BIN, os.environ.get("PATH", "")])  # this process makes gradebooks too


@dataclass
class Course:
    code: Path          # the copy of parakit and autograde the commands run
    solutions: Path     # the toy's solution as toy and as 01_toy
    lessons: Path       # the toy as released
    root: Path          # nbgrader's course root: gradebook.db, submitted/, autograded/
    out: Path           # grades.csv, report.txt, feedback/

    def copy(self, tmp: Path) -> "Course":
        """This course as graded so far (course root and --out), in `tmp`: a run there leaves
        this one as its tests read it."""
        shutil.copytree(self.root, tmp / "course")
        shutil.copytree(self.out, tmp / "out")
        return dataclasses.replace(self, root=tmp / "course", out=tmp / "out")


@dataclass
class Graded:
    course: Course                     # its course root and --out, as this run left them
    run: subprocess.CompletedProcess   # its report printed


def run_course(course: Course, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """`python -m autograde.course --solutions ... *args` on the copy of the code, its report printed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(course.code), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-m", "autograde.course", "--solutions", str(course.solutions), *args],
                         cwd=course.code, env=env, capture_output=True, text=True, timeout=timeout)
    print(run.stdout, run.stderr)
    return run


def grade(course: Course, folder: Path, *args: str) -> subprocess.CompletedProcess:
    run = run_course(course, "grade", str(folder), "--root", str(course.root), "--out", str(course.out),
                     "--timeout", "60", *args)
    assert run.returncode == 0, run.stdout + run.stderr
    return run


def toy_students(course: Course) -> dict[str, nbformat.NotebookNode]:
    lesson, solution = panel.load(course.lessons / "toy.ipynb"), panel.load(FIXTURES / "toy.ipynb")
    full = panel.full_solution(lesson, solution)
    return {"alice": full, "bob": panel.with_sources(full, {"mean": "def mean(xs):\n    return xs[0]\n"}),
            "carol": lesson}


def hand_in(folder: Path, notebooks: dict[str, nbformat.NotebookNode]) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    for student, nb in notebooks.items():
        (folder / student).mkdir(parents=True)
        nbformat.write(nb, str(folder / student / "toy.ipynb"))
    return folder


@pytest.fixture(scope="module")
def course(tmp_path_factory) -> Course:
    """The two lessons, ungraded, the code copied and the lessons generated (in this process, as
    tests/test_pipeline.py does: generating runs no student's code)."""
    tmp = tmp_path_factory.mktemp("gradebook")
    for name in ("parakit", "autograde"):
        shutil.copytree(REPO / name, tmp / "code" / name, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp / "solutions").mkdir()
    for name in ("toy", "01_toy"):
        shutil.copyfile(FIXTURES / "toy.ipynb", tmp / "solutions" / f"{name}.ipynb")
    course = Course(tmp / "code", tmp / "solutions", tmp / "lessons", tmp / "course", tmp / "out")
    assert generate(course.lessons, course.solutions) == []
    return course


@pytest.fixture(scope="module")
def graded(course) -> Graded:
    """The class of three, graded."""
    return Graded(course, grade(course, hand_in(course.root.parent / "class", toy_students(course))))


@pytest.fixture(scope="module")
def regraded(graded, tmp_path_factory) -> Graded:
    """The class graded again, in a copy of the course: bob hands in the full solution (a person
    had written a comment on his submission) and carol's folder is gone."""
    course = graded.course.copy(tmp_path_factory.mktemp("regraded"))
    with Gradebook(f"sqlite:///{course.root}/gradebook.db", "parakit") as gb:
        gb.find_comment("mean", "toy", "toy", "bob").manual_comment = "see me"
        gb.db.commit()
    full = toy_students(course)["alice"]
    return Graded(course, grade(course, hand_in(course.root.parent / "class", {"alice": full, "bob": full})))


@pytest.fixture(scope="module")
def by_lesson(regraded, tmp_path_factory) -> Graded:
    """Then alice hands in 01_toy too, and `--lesson 01` is graded, in a copy."""
    course = regraded.course.copy(tmp_path_factory.mktemp("by_lesson"))
    folder = hand_in_lessons(course.root.parent / "class", course, {"alice": ["toy", "01_toy"], "bob": ["toy"]})
    return Graded(course, grade(course, folder, "--lesson", "01"))


CHEAT = "from parakit import grading\ngrading.check_local = lambda *a, **k: None\n\ndef add(a, b):\n    return a - b\n"


@pytest.fixture(scope="module")
def by_student(by_lesson, tmp_path_factory) -> Graded:
    """Then bob hands in toy again, an `add` that switches the checks off in his kernel (5/5
    there, 2/5 sealed), and `--student bob --in-kernel` is graded, in a copy."""
    course = by_lesson.course.copy(tmp_path_factory.mktemp("by_student"))
    folder = hand_in_lessons(course.root.parent / "class", course, {"alice": ["toy", "01_toy"], "bob": ["toy"]})
    nbformat.write(panel.with_sources(toy_students(course)["alice"], {"add": CHEAT}), str(folder / "bob" / "toy.ipynb"))
    # --timeout bounds the in-kernel run's cells too (nbgrader's, not scaled to the solution's
    # time): a cell that starts worker processes takes 5-20 s on 2 cores (nbgrader_config.py); 300 s
    # so that a loaded machine only bounds a hang
    return Graded(course, grade(course, folder, "--student", "bob", "--in-kernel", "--timeout", "300"))


# ---------------------------------------------------------------------------- the formgrader

class Lab:
    """`.venv/bin/jupyter lab` started as the README says, in a process group of its own, on a
    port the kernel picks (--port=0), read back from the server's runtime file: a port chosen
    here and closed could be taken by the other pytest process before the server binds it."""

    def __init__(self, root_dir: Path, course_root: Path, home: Path):
        assert ENV_CONFIG.exists(), f"{ENV_CONFIG} is missing: run `bash .ci/setup` (it writes it)"
        self.port, self.token = None, "parakit-test-token"
        # the test's own course root, in the user's Jupyter config (read first: JUPYTER_PREFER_ENV_PATH=0);
        # everything else comes from the environment's configuration, as in the README's JupyterLab
        (home / "jupyter").mkdir(parents=True, exist_ok=True)
        (home / "jupyter" / "nbgrader_config.py").write_text(f"c.CourseDirectory.root = {str(course_root)!r}\n")
        path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != BIN)
        runtime = home / "runtime"  # where the server writes jpserver-<pid>.json, with its port
        env = {**{k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "VIRTUAL_ENV"))},
               "PATH": path or "/usr/bin:/bin", "HOME": str(home), "JUPYTER_PREFER_ENV_PATH": "0",
               "JUPYTER_CONFIG_DIR": str(home / "jupyter"), "JUPYTER_DATA_DIR": str(home / "data"),
               "JUPYTER_RUNTIME_DIR": str(runtime)}
        self.log = home / "lab.log"
        args = [f"{BIN}/jupyter", "lab", "--no-browser", "--port=0", "--ServerApp.ip=127.0.0.1",
                f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={root_dir}"]
        if os.geteuid() == 0:
            args.append("--allow-root")
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(args, cwd=root_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            process_group=0)
        deadline = time.monotonic() + 240  # a loaded 2-core machine: a bound on a hang only
        while True:
            try:
                self.port = json.loads(next(runtime.glob("jpserver-*.json")).read_text())["port"]
                self.get("/api/status")
                return
            except (StopIteration, json.JSONDecodeError, urllib.error.URLError, ConnectionError):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise AssertionError(f"JupyterLab did not start:\n{self.log.read_text()}")
                time.sleep(0.5)

    def get(self, path: str):
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            body = answer.read().decode()
            return json.loads(body) if answer.headers.get_content_type() == "application/json" or \
                body[:1] in "[{" else body

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


@pytest.fixture
def lab(graded, tmp_path_factory):
    """Started once, for the one test that asks it, and stopped after it."""
    course = graded.course
    server = Lab(course.root.parent, course.root, tmp_path_factory.mktemp("home"))
    yield server
    server.close()


def test_the_readme_jupyterlab_finds_the_course_config_and_keeps_the_gradebook_in_autograde():
    """Started at the repository root, as the README says: the course root is autograde/ (inside
    the server's root, so the formgrader's links work), the gradebook autograde/gradebook.db,
    which git ignores; the venv's bin folder is put on PATH for `alembic`. Nothing is created."""
    script = ("import os\n"
              "from nbgrader.server_extensions.formgrader.formgrader import FormgradeExtension\n"
              "f = FormgradeExtension(); f.root_dir = os.getcwd(); f.initialize([])\n"
              "print(f.coursedir.root, f.url_prefix, f.coursedir.db_url, os.environ['PATH'].split(os.pathsep)[0])\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "VIRTUAL_ENV"))}
    env["PATH"] = "/usr/bin:/bin"
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    root, prefix, db_url, first_on_path = run.stdout.split()
    assert (root, prefix, db_url) == (str(REPO / "autograde"), "autograde", f"sqlite:///{REPO}/autograde/gradebook.db")
    assert first_on_path == BIN
    assert "No nbgrader_config.py file found" not in run.stderr
    ignored = subprocess.run(["git", "check-ignore", "autograde/gradebook.db"], cwd=REPO, capture_output=True)
    assert ignored.returncode == 0, "autograde/gradebook.db is not ignored by git"


SEALED = {"alice": 5.0, "bob": 3.0, "carol": 0.0}   # the class's sealed totals, of 5


def test_the_formgrader_api_returns_the_sealed_scores(lab):
    assert lab.get("/formgrader/api/status") == {"status": True}
    [toy] = lab.get("/formgrader/api/assignments")
    assert (toy["name"], toy["num_submissions"], toy["max_score"]) == ("toy", 3, 5.0)
    assert {s["id"]: s["score"] for s in lab.get("/formgrader/api/students")} == SEALED
    submissions = lab.get("/formgrader/api/submissions/toy")
    assert {s["student"]: s["score"] for s in submissions} == SEALED
    assert all(s["autograded"] and not s["needs_manual_grade"] for s in submissions)
    notebooks = lab.get("/formgrader/api/submitted_notebooks/toy/toy")
    assert {nb["student"]: nb["score"] for nb in notebooks} == SEALED
    [bob] = [nb for nb in notebooks if nb["student"] == "bob"]
    grades = lab.get(f"/formgrader/api/grades?submission_id={bob['id']}")
    assert {g["name"]: g["auto_score"] for g in grades} == {"test_add": 1.0, "test_add_hidden": 2.0, "test_mean": 0.0}
    [mean] = [c for c in lab.get(f"/formgrader/api/comments?submission_id={bob['id']}") if c["name"] == "mean"]
    assert mean["auto_comment"].startswith("test_mean 0/2: AssertionError: mean([1, 2, 3],): returned a int")
    page = lab.get("/formgrader/manage_assignments")
    assert "toy" in page or "nbgrader" in page
    log = lab.log.read_text()
    assert "No nbgrader_config.py file found" not in log
    assert "not a subdirectory of the notebook server root" not in log
    assert "Traceback" not in log, log


# ---------------------------------------------------------------------------- the gradebook

def nbgrader(course: Course, *args: str) -> subprocess.CompletedProcess:
    """The plain `nbgrader` command on the test's course root, PATH without the venv's bin."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "VIRTUAL_ENV"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p and p != BIN)
    run = subprocess.run([f"{BIN}/nbgrader", *args, f"--CourseDirectory.root={course.root}"], cwd=course.root,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    return run


def exported(course: Course) -> dict[str, tuple[float, float]]:
    """student -> (score, max score) of the toy, from `nbgrader export`'s CSV."""
    target = course.root.parent / "export.csv"
    nbgrader(course, "export", f"--CsvExportPlugin.to={target}")
    with open(target) as f:
        return {row["student_id"]: (float(row["score"]), float(row["max_score"]))
                for row in csv.DictReader(f) if row["assignment"] == "toy"}


def test_nbgrader_export_lists_the_sealed_totals(graded):
    assert exported(graded.course) == {s: (score, 5.0) for s, score in SEALED.items()}


def test_nbgraders_own_feedback_shows_the_sealed_scores(graded):
    """`nbgrader generate_feedback`, as the formgrader runs it after manual grading, builds its
    pages from the gradebook and autograded/: each student's page shows the sealed total."""
    course = graded.course.copy(graded.course.root.parent / "nbgrader_feedback")
    nbgrader(course, "generate_feedback", "toy")
    for student, score in SEALED.items():
        page = (course.root / "feedback" / student / "toy" / "toy.html").read_text(encoding="utf-8")
        assert f"Score: {score:.1f} / 5.0)" in page, (student, page[:2000])  # the notebook's total


def test_regrading_replaces_scores_keeps_manual_comments_and_drops_a_student_gone(regraded):
    """bob hands in the full solution and carol's folder is gone: bob 5/5 (a comment a person
    wrote on his submission kept), carol out of the gradebook, its files and the export, in one line."""
    course, run = regraded.course, regraded.run
    assert "carol: no folder in" in run.stdout and "removed from the gradebook toy (0/5)" in run.stdout
    assert exported(course) == {"alice": (5.0, 5.0), "bob": (5.0, 5.0)}
    with Gradebook(f"sqlite:///{course.root}/gradebook.db", "parakit") as gb:
        assert sorted(s.id for s in gb.students) == ["alice", "bob"]
        assert gb.find_comment("mean", "toy", "toy", "bob").manual_comment == "see me"
        assert gb.find_comment("mean", "toy", "toy", "bob").auto_comment is None
    for step in ("submitted", "autograded"):
        assert not (course.root / step / "carol").exists() or not any((course.root / step / "carol").iterdir())


# ---------------------------------------------------------------------------- one lesson, one student

def hand_in_lessons(folder: Path, course: Course, work: dict[str, list[str]]) -> Path:
    """Each student hands in the full solution of the lessons listed."""
    shutil.rmtree(folder, ignore_errors=True)
    full = toy_students(course)["alice"]
    for student, lessons in work.items():
        (folder / student).mkdir(parents=True)
        for lesson in lessons:
            nbformat.write(full, str(folder / student / f"{lesson}.ipynb"))
    return folder


def summary(run: subprocess.CompletedProcess) -> str:
    return next(line for line in run.stdout.splitlines() if " of " in line and "could not be graded" in line)


def rows(course: Course) -> set[tuple[str, str, str]]:
    with open(course.out / "grades.csv") as f:
        return {(row["student"], row["assignment"], row["status"]) for row in csv.DictReader(f)}


def test_grade_counts_only_what_was_handed_in_or_asked_for(graded, regraded, by_lesson, by_student):
    # everyone handed in toy only, graded and graded again: 01 is not graded, nobody is 'missing' it
    assert summary(graded.run) == "3 students, 3 notebooks of toy: 3 graded, 0 could not be graded (0 not handed in)"
    assert "01_toy" not in graded.run.stdout
    run = regraded.run
    assert summary(run) == "2 students, 2 notebooks of toy: 2 graded, 0 could not be graded (0 not handed in)"
    assert "01_toy" not in run.stdout
    # alice hands in 01 too; --lesson 01 grades 01 alone, and keeps toy's rows and pages
    course, run = by_lesson.course, by_lesson.run
    assert summary(run) == "2 students, 2 notebooks of 01_toy: 1 graded, 1 could not be graded (1 not handed in)"
    assert rows(course) == {("alice", "toy", "graded"), ("bob", "toy", "graded"),
                            ("alice", "01_toy", "graded"), ("bob", "01_toy", "missing")}
    assert (course.out / "feedback" / "bob" / "toy.html").exists()
    # --student bob (a new toy, 2/5): his lessons only (the one he handed in), everyone else's rows kept
    course, run = by_student.course, by_student.run
    assert summary(run) == "1 student, 1 notebook of toy: 1 graded, 0 could not be graded (0 not handed in)"
    assert len(rows(course)) == 4
    with Gradebook(f"sqlite:///{course.root}/gradebook.db", "parakit") as gb:
        assert {(s.student.id, s.assignment.name): s.score for s in gb.db.query(SubmittedAssignment)} == {
            ("alice", "toy"): 5.0, ("bob", "toy"): 2.0, ("alice", "01_toy"): 5.0}
    log = (course.out / "grading.log").read_text()
    assert "lessons toy; students bob; --jobs 1" in log
    assert "bob toy: 2/5 (graded) in " in log and "    test_mean 2/2" in log
    assert "gradebook sqlite:///" in log and "1 student, 1 notebook of toy" in log
    # the log keeps every run, each after its start line: the class's, its regrade, --lesson 01, then this one
    assert log.count("==== a grade run starts, ") == 4 and "3 students, 3 notebooks of toy" in log


def test_an_unknown_lesson_or_student_is_said_and_nothing_graded(course, tmp_path):
    """Said before anything is graded, so the command runs in this process (on the checkout)."""
    folder, root = hand_in_lessons(tmp_path / "class", course, {"alice": ["toy"]}), tmp_path / "course"
    for asked, said in (("--lesson 07", "--lesson 07: no such lesson; the lessons are 01_toy, toy"),
                        ("--student mallory", "--student mallory: no such student folder; the students are alice")):
        with pytest.raises(SystemExit) as stopped:  # a text: python prints it on stderr and exits 1
            main(["--solutions", str(course.solutions), "grade", str(folder), "--root", str(root),
                  "--out", str(tmp_path / "out"), *asked.split()])
        assert stopped.value.code not in (None, 0) and said in str(stopped.value.code)
        assert not root.exists()  # no gradebook, nothing released


# ---------------------------------------------------------------------------- feedback and bad input

def test_feedback_says_each_test_its_points_and_why_and_never_the_instructors_flags():
    from autograde.feedback import page
    from autograde.sealed import Result, split_private
    copied = "add: close to the reference's code (similarity 0.93): copied? (reported, not scored)"
    public, private = split_private(["add: the answer cell does not define add (expected def add(a, b))", copied,
                                     "NOT SEALED: not root"])
    assert private == [copied, "NOT SEALED: not root"]
    r = Result("carol", "toy", 5.0, 1.0, tests={"test_add": (0.0, 1.0), "test_add_hidden": (0.0, 2.0),
                                                "test_mean": (1.0, 2.0)},
               messages={"test_add": "AssertionError: add(1, 2): raised NotImplementedError: ",
                         "test_add_hidden": "AssertionError: add(0, 0): raised ValueError: "},
               notes=public, private=private + ["test_add: passed in the submitted notebook's own run but fails"])
    html = page(r, panel.load(FIXTURES / "toy.ipynb"))
    assert "<style>" in html and "<h2>Exercise <code>add</code></h2>" in html and "<h2>Exercise <code>mean</code>" in html
    assert ">0/1<" in html and ">0/2<" in html and ">1/2<" in html
    assert "raised NotImplementedError: the answer cell still holds the stub; replace `raise NotImplementedError()`" in html
    assert "raised ValueError (with no message)" in html
    assert "failed, and the check gave no reason: ask your instructor" in html  # test_mean: no message
    assert "does not define add" in html
    for flag in ("copied?", "NOT SEALED", "own run"):
        assert flag not in html
    for empty in ("<pre></pre>", "<ul></ul>", "<ul class=\"notes\"></ul>", "<td></td>"):
        assert empty not in html
    missing = page(Result("erin", "toy", 5.0, status="missing", notes=["no toy.ipynb submitted"]))
    assert "no <code>toy.ipynb</code> was handed in" in missing and "<table>" not in missing


def executed(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy whose test cells look run without an error: what a notebook that patched its
    checks in its own kernel saves."""
    nb = nbformat.from_dict(json.loads(json.dumps(nb)))
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            cell.execution_count, cell.outputs = i + 1, []
    return nb


def test_bad_input_gets_one_clear_line_each_and_the_rest_is_graded(course, tmp_path):
    """A folder with a space, one with letters beyond ASCII, one with a tab (unusable), a corrupt
    notebook, a notebook of an unknown name, a tampered notebook, and another course's gradebook
    in the course root: one line each, and everyone else graded. A course of the toy alone."""
    (tmp_path / "solutions").mkdir()
    shutil.copyfile(FIXTURES / "toy.ipynb", tmp_path / "solutions" / "toy.ipynb")
    toy_only, students = dataclasses.replace(course, solutions=tmp_path / "solutions"), toy_students(course)
    folder = hand_in(tmp_path / "class", {"alice": students["alice"], "ann lee": students["alice"],
                                          "zoë": students["bob"], "frank": executed(students["carol"])})
    (folder / "dave").mkdir()
    (folder / "dave" / "toy.ipynb").write_text('{"cells": [')
    (folder / "erin").mkdir()
    nbformat.write(students["alice"], str(folder / "erin" / "99_unknown.ipynb"))
    (folder / "tab\there").mkdir()
    nbformat.write(students["alice"], str(folder / "tab\there" / "toy.ipynb"))
    other, root = tmp_path / "other.db", tmp_path / "course"
    with Gradebook(f"sqlite:///{other}", "ml101") as gb:
        gb.add_assignment("hw1")
        gb.add_student("zed")
    root.mkdir()
    shutil.copyfile(other, root / "gradebook.db")
    out = tmp_path / "out"
    run = run_course(toy_only, "grade", str(folder), "--root", str(root), "--out", str(out), "--timeout", "60")
    assert run.returncode == 0, run.stdout + run.stderr
    report = (out / "report.txt").read_text()

    def lines_with(text: str) -> list[str]:
        return [line for line in report.splitlines() if text in line]

    assert len(lines_with("'ann lee': graded under this id, which has a space")) == 1
    assert len(lines_with("'zoë': graded under this id, which has letters beyond ASCII")) == 1
    assert len(lines_with("'tab\\there': not usable as a student id")) == 1
    assert len(lines_with("toy.ipynb: not a notebook (invalid JSON")) == 1
    assert len(lines_with("erin/99_unknown.ipynb does not match any assignment; expected one of toy.ipynb")) == 1
    assert len(lines_with("belongs to another course (ml101; assignments hw1): moved to gradebook.db.")) == 1
    assert len(lines_with("passed in the submitted notebook's own run but fails in the sealed grade")) == 3  # frank
    [aside] = root.glob("gradebook.db.*.old")
    assert aside.read_bytes() == other.read_bytes()
    with open(out / "grades.csv", encoding="utf-8") as f:
        got = {row["student"]: (row["status"], float(row["score"])) for row in csv.DictReader(f)}
    assert got == {"alice": ("graded", 5.0), "ann lee": ("graded", 5.0), "zoë": ("graded", 3.0),
                   "frank": ("graded", 0.0), "dave": ("not a notebook", 0.0), "erin": ("missing", 0.0)}
    with Gradebook(f"sqlite:///{root}/gradebook.db", "parakit") as gb:
        assert {s.student.id: s.score for s in gb.db.query(SubmittedAssignment)} == {
            "alice": 5.0, "ann lee": 5.0, "zoë": 3.0, "frank": 0.0}
        assert sorted(s.id for s in gb.students) == sorted(got)
    zoe = (out / "feedback" / "zoë" / "toy.html").read_text(encoding="utf-8")
    assert "mean([1, 2, 3],): returned a int, expected a float" in zoe and "<style>" in zoe
    frank = (out / "feedback" / "frank" / "toy.html").read_text(encoding="utf-8")
    assert "own run" not in frank and "the answer cell still holds the stub" in frank
    dave = (out / "feedback" / "dave" / "toy.html").read_text(encoding="utf-8")
    assert "could not be read" in dave and "invalid JSON" in dave


def test_in_kernel_differences_are_reported_and_the_gradebook_keeps_the_sealed_score(by_student):
    """--in-kernel also autogrades in one kernel, where bob's new answer cell switches the checks
    off: 5/5 there, 2/5 sealed. The gradebook holds 2; the report lists both tests that differ
    (for the instructor: not in the feedback)."""
    root, out = by_student.course.root, by_student.course.out
    report = (out / "report.txt").read_text()
    for test in ("test_add", "test_add_hidden"):
        assert f"! {test}: 1 in the kernel, 0 sealed" in report or f"! {test}: 2 in the kernel, 0 sealed" in report
    with Gradebook(f"sqlite:///{root}/gradebook.db", "parakit") as gb:
        assert gb.find_submission("toy", "bob").score == 2.0
    assert "in the kernel" not in (out / "feedback" / "bob" / "toy.html").read_text()
    assert not (root / "feedback" / "bob").exists()  # no nbgrader page with the kernel's 5/5 to release
