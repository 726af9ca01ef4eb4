"""The instructors' command: generate the student lessons, validate them, grade a class.

    python -m autograde.course generate [--check]     solutions/*.ipynb -> lessons/*.ipynb
    python -m autograde.course validate               solutions pass, untouched lessons fail
    python -m autograde.course grade SUBMISSIONS [--lesson 03] [--student alice] [--out DIR] [--jobs N] [--in-kernel]
                                                 [--force]

nbgrader generates the student lessons from the solutions and validates them (course root:
this folder, see nbgrader_config.py). SUBMISSIONS holds one folder per student with that
student's notebooks, named as the lessons are (`alice/00_collectives.ipynb`); each is graded
by the sealed judge (autograde.sealed, parakit.grading.judge), N at a time. Under --out
(default: autograde/grades/) land grades.csv (one row per student and lesson),
grades_by_test.csv, report.txt, grading.log, graded/<student>/<lesson>.ipynb and
feedback/<student>/<lesson>.html; the grades also go into nbgrader's gradebook
(autograde.gradebook). It grades the lessons asked (--lesson) or handed in, for the students
asked (--student) or all; a run replaces what it grades and keeps the rest.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import difflib
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path

import nbformat
from nbgrader.api import Gradebook
from nbgrader.apps.api import NbGraderAPI
from nbgrader.coursedir import CourseDirectory
from nbgrader.validator import Validator
from traitlets.config.loader import PyFileConfigLoader

from autograde import feedback, gradebook
from autograde.sealed import (Refused, Result, Task, changed_since, course_salt, fingerprints, grade_all, grader_failed,
                             inspect_submission, read_handin, read_submission, shown)
from parakit.grading import isolation

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
INTERRUPTED: list[int] = []  # the signals that asked this run to stop (see interrupt)


def prepare_environment() -> None:
    """What nbgrader and the graded kernels need from the environment, headless."""
    bindir = str(Path(sys.executable).parent)  # nbgrader creates its gradebook with `alembic`
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([bindir, os.environ.get("PATH", "")])
    os.environ.setdefault("PARAKIT_STATIC", "1")  # widgets draw static figures
    os.environ.setdefault("MPLBACKEND", "Agg")


PROBLEM_ERRORS = {  # error names the executor writes into a failed cell, as the report words them
    "DeadKernelError": "the kernel died (os._exit, a crash or out of memory)",
    "UnresponsiveKernel": "the kernel ignored the interrupt and was restarted",
    "CellTimeoutError": "timed out",
    "KernelRestartLimit": "not run: too many kernel restarts",
}


class Course:
    """An nbgrader course rooted at `root`, its assignments taken from `solutions/*.ipynb`."""

    def __init__(self, root: Path = HERE, solutions: Path = REPO / "solutions",
                 timeout: int | None = None, log: logging.Logger | None = None, database: bool = True):
        prepare_environment()
        self.root, self.solutions = Path(root).resolve(), Path(solutions).resolve()
        self.config = PyFileConfigLoader("nbgrader_config.py", path=str(HERE)).load_config()
        self.config.CourseDirectory.root = str(self.root)
        if timeout is not None:
            self.config.Execute.timeout = timeout
        if not database:  # `nbgrader generate_assignment --no-db`: the notebooks only, no gradebook
            self.config.SaveCells.enabled = False
            self.config.GenerateAssignment.no_database = True
        self.log = log or logging.getLogger("autograde")
        self._api = None

    @property
    def api(self) -> NbGraderAPI:
        if self._api is None:
            self.root.mkdir(parents=True, exist_ok=True)
            coursedir = CourseDirectory(config=self.config)
            traitlets_log = logging.getLogger("traitlets")
            level = traitlets_log.level
            traitlets_log.setLevel(logging.CRITICAL + 1)
            try:  # quiet: it complains that no exchange folder exists (none is needed here)
                self._api = NbGraderAPI(coursedir, config=self.config)
            finally:
                traitlets_log.setLevel(level)
            self._api.log.setLevel(logging.WARNING)
        return self._api

    def assignments(self) -> list[str]:
        """One assignment per solution notebook, named by its stem (`00_collectives`)."""
        names = sorted(p.stem for p in self.solutions.glob("*.ipynb"))
        if not names:
            raise SystemExit(f"no solution notebooks in {self.solutions}")
        return names

    def release(self, names: list[str] | None = None) -> dict[str, Path]:
        """Copy each solution (or those of `names`) into source/<name>/ and run nbgrader
        generate_assignment; return the student notebook (release/<name>/<name>.ipynb) of each."""
        released = {}
        for name in self.assignments() if names is None else names:
            source = self.root / "source" / name
            source.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.solutions / f"{name}.ipynb", source / f"{name}.ipynb")
            result = self.api.generate_assignment(name, force=True, create=True)
            if not result["success"]:
                raise SystemExit(f"nbgrader generate_assignment failed for {name}:\n"
                                 f"{result.get('log', '')}{result.get('error', '')}")
            released[name] = self.root / "release" / name / f"{name}.ipynb"
        return released

    def validator(self, invert: bool) -> Validator:
        validator = Validator(config=self.config)
        validator.invert = invert
        return validator


# ---------------------------------------------------------------------------- generate

VOLATILE = {"execution", "collapsed", "scrolled", "jupyter", "ExecuteTime"}  # set by running or viewing


def lesson_view(nb) -> dict:
    """What must agree between a committed lesson and a fresh one: cell types, sources and
    metadata (nbgrader's above all). Cell ids, execution counts and outputs are not compared."""
    return {"cells": [{"cell_type": c.cell_type, "source": c.source,
                       "metadata": {k: v for k, v in c.get("metadata", {}).items() if k not in VOLATILE}}
                      for c in nb.cells],
            "kernelspec": nb.metadata.get("kernelspec")}


def describe_drift(committed, fresh) -> str:
    a, b = lesson_view(committed)["cells"], lesson_view(fresh)["cells"]
    if len(a) != len(b):
        return f"{len(a)} cells committed, {len(b)} generated"
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            what = [k for k in x if x[k] != y[k]]
            gid = y["metadata"].get("nbgrader", {}).get("grade_id")
            return f"cell {i}{f' ({gid})' if gid else ''}: {', '.join(what)} differ"
    return "notebook metadata differs"


def generate(lessons: Path, solutions: Path, check: bool = False) -> list[str]:
    """Write lessons/<name>.ipynb for every solution; with `check`, write nothing and
    return the lines describing every lesson that is not what generation would make."""
    problems = []
    with tempfile.TemporaryDirectory(prefix="parakit-generate-") as scratch:
        course = Course(root=Path(scratch), solutions=solutions, database=False)
        for name, released in course.release().items():
            fresh = nbformat.read(released, as_version=4)
            for cell in fresh.cells:
                if cell.cell_type == "code":
                    cell.outputs, cell.execution_count = [], None
            target = lessons / f"{name}.ipynb"
            if not check:
                lessons.mkdir(parents=True, exist_ok=True)
                nbformat.write(fresh, target)
            elif not target.exists():
                problems.append(f"{target} is missing")
            else:
                committed = nbformat.read(target, as_version=4)
                if lesson_view(committed) != lesson_view(fresh):
                    problems.append(f"{target} differs from {solutions / (name + '.ipynb')}: "
                                    f"{describe_drift(committed, fresh)}")
        for stale in sorted(set(p.stem for p in lessons.glob("*.ipynb")) - set(course.assignments())):
            problems.append(f"{lessons / (stale + '.ipynb')} has no solution notebook")
    return problems


# ---------------------------------------------------------------------------- validate

def validate(solutions: Path, lessons: Path, timeout: int | None = None) -> list[str]:
    """Every solution passes its tests; every untouched lesson fails all of its tests."""
    course, problems = Course(solutions=solutions, timeout=timeout), []
    for name in course.assignments():
        for path, invert in [(solutions / f"{name}.ipynb", False), (lessons / f"{name}.ipynb", True)]:
            if not path.exists():
                problems.append(f"{path} is missing")
                continue
            results = course.validator(invert).validate(str(path))
            for kind, cells in results.items():
                for cell in cells:
                    first = cell["source"].splitlines()[0] if cell["source"] else ""
                    problems.append(f"{path}: a test cell {kind} ({first[:60]!r})")
    return problems


# ---------------------------------------------------------------------------- grade

def execution_notes(autograded: Path) -> list[str]:
    """Report lines for cells that timed out or took the kernel down while grading."""
    if not autograded.exists():
        return []
    notes = []
    for index, cell in enumerate(nbformat.read(autograded, as_version=4).cells):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error" and output.get("ename") in PROBLEM_ERRORS:
                gid = cell.metadata.get("nbgrader", {}).get("grade_id")
                where = gid or (cell.source.strip().splitlines() or [""])[0][:40]
                notes.append(f"cell {index} ({where}): {PROBLEM_ERRORS[output['ename']]}")
                break
    return notes


def zero_missing_grades(course: Course, assignment: str, student: str) -> None:
    """Test cells absent from the submission have no autograde score: make it 0."""
    with Gradebook(course.api.coursedir.db_url, course.api.coursedir.course_id) as gb:
        for notebook in gb.find_submission(assignment, student).notebooks:
            for grade in notebook.grades:
                if grade.auto_score is None and grade.manual_score is None:
                    grade.auto_score, grade.needs_manual_grade = 0.0, False
        gb.db.commit()


def scores(course: Course, assignment: str, student: str | None) -> tuple[float, dict]:
    """The max score and, for `student`, grade_id -> (score, max) from the gradebook."""
    with Gradebook(course.api.coursedir.db_url, course.api.coursedir.course_id) as gb:
        if student is None:
            a = gb.find_assignment(assignment)
            return a.max_score, {c.name: (0.0, c.max_score) for nb in a.notebooks for c in nb.grade_cells}
        sub = gb.find_submission(assignment, student)
        return sub.max_score, {g.name: (g.score, g.max_score) for nb in sub.notebooks for g in nb.grades}


def last_error(result: dict) -> str:
    text = (result.get("error") or "") + (result.get("log") or "")
    lines = [l for l in text.splitlines() if "Error" in l or "error" in l]
    return lines[-1].strip() if lines else "see grading.log"


def forget(course: Course, assignment: str, student: str) -> None:
    """Drop what an earlier run graded for this student and assignment (files and gradebook)."""
    with Gradebook(course.api.coursedir.db_url, course.api.coursedir.course_id) as gb:
        gradebook.forget(gb, course.root, assignment, student)


def grade_in_kernel(course: Course, student: str, assignment: str, path: Path | None, released,
                    submissions: Path | None = None) -> Result:
    """nbgrader's own autograde: the notebook, answers and tests together, in one kernel the student's
    code controls. Not what `grade` records (see autograde.sealed); kept to measure against it and to
    show where the two disagree (`grade --in-kernel`)."""
    max_score, tests = scores(course, assignment, None)
    result = Result(student, assignment, max_score, tests=tests)
    if path is None:
        result.status = "missing"
        result.notes.append(f"no {assignment}.ipynb submitted")
        forget(course, assignment, student)
        return result
    try:
        nb, data = read_submission(path, submissions)
    except Refused as why:
        result.status = why.status
        result.notes.append(str(why))
        forget(course, assignment, student)
        return result
    result.notes += inspect_submission(nb, released)
    submitted = course.root / "submitted" / student / assignment
    shutil.rmtree(submitted, ignore_errors=True)
    submitted.mkdir(parents=True)
    (submitted / f"{assignment}.ipynb").write_bytes(data)  # what was read and checked, not the path again
    graded = course.api.autograde(assignment, student, force=True, create=True)
    course.log.info("autograde %s %s:\n%s%s", student, assignment, graded.get("log", ""), graded.get("error") or "")
    if not graded["success"]:
        result.status = "autograde failed"
        result.notes.append(f"nbgrader could not grade it: {last_error(graded)}")
        return result
    zero_missing_grades(course, assignment, student)
    result.max_score, result.tests = scores(course, assignment, student)
    result.score = sum(s for s, _ in result.tests.values())
    result.notes += execution_notes(course.root / "autograded" / student / assignment / f"{assignment}.ipynb")
    return result  # no nbgrader feedback: its scores are not the grade (the feedback is feedback.page's)


STUDENT_ID = re.compile(r"\w(?:[\w.@ -]*[\w.@-])?")   # letters of any script, digits, _.@- and inner spaces
PLAIN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]*")


def student_problem(entry: Path) -> str | None:
    """Why the entry `entry` of the submissions folder is no student's folder (its report
    line), or None. The name is checked whole (a trailing newline is a character too)."""
    name = shown(entry.name)
    if entry.is_symlink():
        return f"{name}: a link, not a student folder, ignored: put the student's notebooks in a folder of that name"
    if not entry.is_dir():
        return f"{name}: not in a student folder, ignored"
    if entry.name.startswith("."):
        return f"{entry.name!r}: a hidden folder (its name starts with a dot), ignored"
    if not STUDENT_ID.fullmatch(entry.name) or len(entry.name) > 128:
        return (f"{entry.name!r}: not usable as a student id (letters, digits, _.@- and inner spaces, "
                f"at most 128), ignored: rename the folder and grade again")
    return None


def collect(submissions: Path, assignments: list[str]):
    """student -> assignment -> notebook path (None when absent); (student, assignment) ->
    report lines for files named like no assignment (assignment: the closest name, or None);
    report lines for everything else that is not where it should be, one each. Nothing is
    followed through a link: a student folder that is one is refused here, a notebook that is
    one when it is read (`sealed.read_handin`)."""
    found, strays, notes = {}, {}, []
    expected = sorted(f"{a}.ipynb" for a in assignments)
    for entry in sorted(submissions.iterdir()):
        problem = student_problem(entry)
        if problem:
            notes.append(problem)
            continue
        if not PLAIN_ID.fullmatch(entry.name):
            notes.append(f"{entry.name!r}: graded under this id, which has "
                         f"{'a space' if ' ' in entry.name else 'letters beyond ASCII'}: check that your LMS "
                         f"knows it (`nbgrader export` writes it as it is)")
        files = {p.name: p for p in entry.iterdir() if not p.name.startswith(".") and (p.is_symlink() or not p.is_dir())}
        found[entry.name] = {a: files.get(f"{a}.ipynb") for a in assignments}
        for name in sorted(set(files) - set(expected)):
            close = difflib.get_close_matches(name, expected, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}? rename it and grade again)" if close else ""
            strays.setdefault((entry.name, close[0][:-len(".ipynb")] if close else None), []).append(
                f"{shown(name)} does not match any assignment{hint}; expected one of " + ", ".join(expected))
    return found, strays, notes


def choose(found: dict, strays: dict, assignments: list[str], lessons: list[str] | None,
           students: list[str] | None) -> tuple[list[str], list[str]]:
    """The students and lessons to grade: those asked (`--lesson 03`, `--student alice`), else
    every student folder and every lesson some student handed in (or misnamed)."""
    if students:
        unknown = [s for s in students if s not in found]
        if unknown:
            raise SystemExit(f"--student {' '.join(unknown)}: no such student folder; "
                             f"the students are {', '.join(found) or 'none'}")
    chosen_students = [s for s in found if not students or s in students]
    if lessons:
        chosen = []
        for asked in lessons:
            match = [a for a in assignments if asked.removesuffix(".ipynb") in (a, a.split("_")[0])
                     or (asked.isdigit() and a.split("_")[0].isdigit() and int(asked) == int(a.split("_")[0]))]
            if len(match) != 1:
                raise SystemExit(f"--lesson {asked}: no such lesson; the lessons are {', '.join(assignments)}")
            chosen += [m for m in match if m not in chosen]
        return chosen_students, sorted(chosen)
    handed = {a for s in chosen_students for a, path in found[s].items() if path} | \
             {a for (s, a) in strays if a and s in chosen_students}
    return chosen_students, [a for a in assignments if a in handed]


def grade(submissions: Path, out: Path | None = None, root: Path = HERE,
          solutions: Path = REPO / "solutions", timeout: int | None = None, jobs: int = 1,
          in_kernel: bool = False, lessons: list[str] | None = None,
          students: list[str] | None = None, force: bool = False) -> list[Result]:
    """Grade the students' notebooks with the sealed judge (`jobs` at a time): the lessons and
    students asked, else every lesson someone handed in, for every student. Write the CSVs,
    the graded notebooks, feedback and the report under `out` (what this run graded replaces
    what an earlier one wrote of the same; the rest is kept), and the grades into nbgrader's
    gradebook. With `in_kernel`, also autograde each notebook the old way (nbgrader, in one
    kernel) and report where the two differ. A resumed run skips a notebook that stopped the
    run before (`stopped`), unless `force`."""
    submissions, out = Path(submissions), Path(out or Path(root) / "grades")
    if not submissions.is_dir():
        raise SystemExit(f"{submissions} is not a folder of student folders")
    if out.resolve() == Path(root).resolve():
        raise SystemExit("--out must not be the course root itself (nbgrader's folders live there)")
    if jobs < 1:
        raise SystemExit(f"--jobs {jobs}: give the number of notebooks to grade at once (1 or more)")
    out.mkdir(parents=True, exist_ok=True)
    unfinished = out / JOURNAL / "unfinished"
    resuming = unfinished.exists()  # the last run stopped before its end: keep what it graded
    if not resuming:
        shutil.rmtree(out / JOURNAL, ignore_errors=True)
    (out / JOURNAL).mkdir(exist_ok=True)
    log = logging.getLogger(f"autograde.{id(out)}")
    log.setLevel(logging.INFO)
    handler = logging.FileHandler(out / "grading.log", mode="a", encoding="utf-8")  # every run's, each after its start line
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.info("==== a grade run starts, %s", time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    notes: list[str] = []
    try:
        course = Course(root=root, solutions=solutions, timeout=timeout, log=log)
        course_id = course.config.CourseDirectory.course_id
        notes += gradebook.set_aside_foreign(course.root, course_id)  # before release() writes to it
        found, strays, found_notes = collect(submissions, course.assignments())
        notes += found_notes + [f"{s}/{line}" for (s, a), lines in strays.items() if a is None for line in lines]
        chosen_students, chosen_lessons = choose(found, strays, course.assignments(), lessons, students)
        log.info("grade %s: lessons %s; students %s; --jobs %d; out %s; course root %s", submissions,
                 ", ".join(chosen_lessons) or "none", ", ".join(chosen_students) or "none", jobs, out, course.root)
        for line in notes:
            log.info("note: %s", line)
        if not chosen_lessons or not chosen_students:
            raise SystemExit(f"nothing to grade in {submissions}: no student folder holds a notebook named as a "
                             f"lesson ({', '.join(course.assignments())}.ipynb)" + "".join(f"\nnote: {n}" for n in notes))
        guarded = [Path(parakit_dir()), course.solutions, *Path(HERE).glob("*.py")]
        before = fingerprints(guarded)
        unfinished.write_text("a grade run is under way, or stopped before its end: the next one resumes\n")
        released = course.release(chosen_lessons)
        pairs = [(s, a) for s in chosen_students for a in chosen_lessons]
        gone = set() if students else {(s, a) for s, a in previous_pairs(out) if s not in found and a in released}
        if not resuming:
            clear_outputs(out, set(pairs) | gone)

        unsealed = isolation.unavailable()
        if unsealed:
            print(f"WARNING: these grades are NOT SEALED: {unsealed}. Students' code will run without the "
                  f"operating system's walls (namespaces, a filesystem view of its own, no new processes); "
                  f"grade as root on Linux for sealed grades. Every report line says so.", file=sys.stderr, flush=True)
            log.info("NOT SEALED: %s", unsealed)
        scratch = tempfile.mkdtemp(prefix="parakit-grading-")
        hidden = [parakit_dir(), str(course.solutions), str(course.root), str(submissions.resolve()),
                  str(out.resolve()), scratch, *(str(REPO / d) for d in ("solutions", "autograde", "tests"))]
        tasks = [Task(student, assignment, str(found[student][assignment] or "") or None,
                      str(course.solutions / f"{assignment}.ipynb"), str(released[assignment]), str(out), hidden,
                      float(course.config.Execute.timeout), course_salt(course.root), scratch,
                      str(submissions))
                 for student, assignment in pairs]

        journal = {_key(task): out / JOURNAL / f"{fingerprint(task)}.json" for task in tasks}
        for task in tasks:
            task.started = str(journal[_key(task)].with_suffix(".started"))
        done = {key: load_result(path) for key, path in journal.items() if resuming and path.exists()}
        if done:
            print(f"resuming: {len(done)} of {len(tasks)} notebooks were graded by the run that stopped", flush=True)
            log.info("resuming: %d of %d notebooks taken from the journal", len(done), len(tasks))
        done.update({_key(t): stopped(t) for t in tasks if not force and _key(t) not in done and Path(t.started).exists()})

        def finished(result: Result) -> None:
            if INTERRUPTED:  # graded while the run was stopping (its ranks had the signal too): not kept
                raise KeyboardInterrupt  # again: the first may have been swallowed, raised in a finalizer
            result.notes += strays.get((result.student, result.assignment), [])
            if unsealed and not any(n.startswith("NOT SEALED") for n in result.private):
                result.private.append(f"NOT SEALED: {unsealed}")
            if result.status != STOPPED:  # its mark stays: the next resumed run skips it too
                save_result(result, journal[(result.student, result.assignment)])
                journal[(result.student, result.assignment)].with_suffix(".started").unlink(missing_ok=True)
            print(report_line(result), flush=True)
            log.info("%s", log_entry(result))

        for result in (r for r in done.values() if r.status == STOPPED):
            finished(result)
        try:
            fresh = iter(grade_all([t for t in tasks if _key(t) not in done], jobs, finished))
            results = [done.get(_key(t)) or next(fresh) for t in tasks]
        except KeyboardInterrupt:  # the instructor stopped it (Ctrl-C, SIGTERM): no notebook did
            for task in tasks:
                if _key(task) not in done:
                    Path(task.started).unlink(missing_ok=True)
            raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        changed = changed_since(before, guarded)
        if changed:
            notes.append(f"{len(changed)} course file(s) changed during this run, kept as they are (grading writes "
                         f"none; a student's ranks cannot reach them): " + ", ".join(changed[:5])
                         + (", ..." if len(changed) > 5 else ""))
        if in_kernel:
            for result in results:
                result.private += compare_in_kernel(course, result, found, released, submissions)
        db_url = course.api.coursedir.db_url
        if not students:
            notes += gradebook.drop_absent(db_url, course_id, course.root, chosen_lessons, set(found), submissions)
        gradebook.record(db_url, course_id, course.root, results, found, out / "graded", submissions,
                         {a: nbformat.read(p, as_version=4) for a, p in released.items()})
        log.info("gradebook %s: %d submissions written", db_url, sum(r.status == "graded" for r in results))
        summary = write_outputs(results, notes, out, keep=lambda s, a: (s, a) not in set(pairs) | gone)
        log.info("%s", "\n".join(summary))
        unfinished.unlink()
        return results
    finally:
        log.removeHandler(handler)
        handler.close()


def log_entry(r: Result) -> str:
    """A notebook's lines in grading.log: its score and time, every test with the judge's whole
    message, every note (the instructor's too)."""
    lines = [f"{r.student} {r.assignment}: {r.score:g}/{r.max_score:g} ({r.status}) in {r.seconds:.1f} s"]
    lines += [f"    {g} {s:g}/{m:g}" + (f": {r.messages[g]}" if g in r.messages else "")
              for g, (s, m) in r.tests.items()]
    return "\n".join(lines + [f"    note: {n}" for n in r.notes + r.private])


def previous_pairs(out: Path) -> list[tuple[str, str]]:
    """(student, assignment) of every row an earlier run left in out/grades.csv."""
    return [(row["student"], row["assignment"]) for row in read_rows(out / "grades.csv")]


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def clear_outputs(out: Path, pairs) -> None:
    """Remove what an earlier run wrote under `out` for these (student, assignment) pairs."""
    for student, assignment in pairs:
        for path in (out / "feedback" / student / f"{assignment}.html", out / "graded" / student / f"{assignment}.ipynb"):
            path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                path.parent.rmdir()  # when it was the student's last


JOURNAL = "journal"  # under --out: one file per notebook, written as it is graded
STOPPED = "stopped the run"  # the status of a notebook that was being graded when the last run stopped


def stopped(task: Task) -> Result:
    """The Result of a notebook skipped because the last run stopped while grading it: a crash
    of the grader itself (or a kill: SIGKILL, the OOM killer) while its mark was in the journal."""
    result = grader_failed(task, "skipped")
    result.status = STOPPED
    result.notes = ["grading this notebook stopped the last grading run: scored 0 until it is graded again"]
    result.private = ["grading this notebook stopped the last run (the grader crashed or was killed while grading "
                      "it): skipped; `grade --force` grades it again"]
    return result


def _key(task: Task) -> tuple[str, str]:
    return task.student, task.assignment


def fingerprint(task: Task) -> str:
    """The name of a notebook's journal entry: a changed hand-in or solution is graded anew."""
    digest = hashlib.sha256(f"{task.student}\0{task.assignment}\0".encode())
    try:  # the hand-in as the grader reads it: never through a link
        digest.update(read_handin(task.path, task.submissions)[0] if task.path else b"(none)")
    except Refused as why:
        digest.update(f"(refused: {why})".encode())
    digest.update(Path(task.solution).read_bytes())
    return digest.hexdigest()[:32]


def save_result(result: Result, path: Path) -> None:
    """Write `result` where a resumed run finds it, whole or not at all (renamed into place)."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(dataclasses.asdict(result)))
    partial.replace(path)


def load_result(path: Path) -> Result:
    data = json.loads(path.read_text())
    data["tests"] = {g: tuple(pair) for g, pair in data["tests"].items()}
    return Result(**data)


def parakit_dir() -> str:
    import parakit
    return str(Path(parakit.__file__).resolve().parent)


def compare_in_kernel(course: Course, sealed: Result, found, released, submissions: Path) -> list[str]:
    """Report lines where nbgrader's in-kernel autograde scores a test differently."""
    path = found[sealed.student][sealed.assignment]
    if sealed.status != "graded":
        return []
    theirs = grade_in_kernel(course, sealed.student, sealed.assignment, path,
                             nbformat.read(released[sealed.assignment], as_version=4), submissions)
    return [f"{g}: {theirs.tests[g][0]:g} in the kernel, {s:g} sealed (the sealed grade is the one recorded)"
            for g, (s, _) in sealed.tests.items() if g in theirs.tests and theirs.tests[g][0] != s]


def report_line(r: Result) -> str:
    head = f"{r.student:<16} {r.assignment:<22} {r.score:g}/{r.max_score:g}"
    if r.status != "graded":
        head += f"  [{r.status}]"
    elif r.score < r.max_score:
        head += "  failed: " + ", ".join(g for g, (s, m) in r.tests.items() if s < m)
    return head + "".join(f"\n    - {n}" for n in r.notes) + "".join(f"\n    ! {n}" for n in r.private)


def count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


CSV = {"grades.csv": ["student", "assignment", "score", "max_score", "status", "tests", "notes"],
       "grades_by_test.csv": ["student", "assignment", "test", "score", "max_score"]}


def csv_rows(r: Result) -> dict[str, list[list[str]]]:
    return {"grades.csv": [[r.student, r.assignment, f"{r.score:g}", f"{r.max_score:g}", r.status,
                            "; ".join(f"{g} {s:g}/{m:g}" for g, (s, m) in r.tests.items()),
                            " | ".join(r.notes + r.private)]],
            "grades_by_test.csv": [[r.student, r.assignment, g, f"{s:g}", f"{m:g}"] for g, (s, m) in r.tests.items()]}


def write_outputs(results: list[Result], notes: list[str], out: Path, keep=lambda student, assignment: False) -> list[str]:
    """The CSVs (this run's rows, and the rows an earlier run wrote that `keep` keeps), the
    feedback of what could not be graded, and report.txt (this run only); return the summary."""
    for name, header in CSV.items():
        rows = [[row[k] for k in header] for row in read_rows(out / name) if keep(row["student"], row["assignment"])]
        rows += [row for r in results for row in csv_rows(r)[name]]
        with open(out / name, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(header)
            w.writerows(sorted(rows, key=lambda row: (row[0], row[1])))
    for r in results:
        target = out / "feedback" / r.student / f"{r.assignment}.html"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(feedback.page(r), encoding="utf-8")
    lessons = sorted({r.assignment for r in results})
    summary = [f"{count(len({r.student for r in results}), 'student')}, {count(len(results), 'notebook')} of "
               f"{', '.join(lessons)}: "
               f"{sum(r.status == 'graded' for r in results)} graded, "
               f"{sum(r.status != 'graded' for r in results)} could not be graded "
               f"({sum(r.status == 'missing' for r in results)} not handed in)"]
    summary += [f"note: {n}" for n in notes]
    summary += [f"grades: {out / 'grades.csv'} (per test: {out / 'grades_by_test.csv'})",
                f"feedback: {out / 'feedback'} (graded notebooks: {out / 'graded'})",
                f"log: {out / 'grading.log'}"]
    (out / "report.txt").write_text("\n".join([report_line(r) for r in results] + summary) + "\n", encoding="utf-8")
    print("\n".join(summary))
    return summary


# ---------------------------------------------------------------------------- command line

def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", module="nbgrader")  # SQLAlchemy 2 noise from nbgrader's ORM
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    parser = argparse.ArgumentParser(prog="python -m autograde.course", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--solutions", type=Path, default=REPO / "solutions", help="instructor notebooks")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="solutions/*.ipynb -> lessons/*.ipynb with nbgrader")
    g.add_argument("--check", action="store_true", help="write nothing; fail if lessons/ is stale")
    g.add_argument("--lessons", type=Path, default=REPO / "lessons")
    v = sub.add_parser("validate", help="solutions pass their tests, untouched lessons fail them")
    v.add_argument("--lessons", type=Path, default=REPO / "lessons")
    v.add_argument("--timeout", type=int, help="seconds per cell (default: nbgrader_config.py)")
    r = sub.add_parser("grade", help="autograde a folder of <student>/<lesson>.ipynb")
    r.add_argument("submissions", type=Path)
    r.add_argument("--out", type=Path, help="where grades.csv, feedback/ and report.txt go (default: ROOT/grades)")
    r.add_argument("--root", type=Path, default=HERE, help="nbgrader course root (default: autograde/)")
    r.add_argument("--timeout", type=int, help="seconds per cell (default: nbgrader_config.py)")
    r.add_argument("--jobs", type=int, default=1, help="notebooks graded at once (default 1); same grades")
    r.add_argument("--lesson", action="append", metavar="LESSON",
                   help="grade this lesson only (03, 03_zero); again for more (default: every lesson handed in)")
    r.add_argument("--student", action="append", metavar="STUDENT",
                   help="grade this student only (their folder's name); again for more (default: every student)")
    r.add_argument("--force", action="store_true",
                   help="resuming a run that stopped: grade again the notebooks it was grading when it stopped "
                        "(by default each is skipped and said)")
    r.add_argument("--in-kernel", action="store_true",
                   help="also autograde each notebook in one kernel with nbgrader and report where it differs")
    args = parser.parse_args(argv)

    if args.command == "generate":
        problems = generate(args.lessons, args.solutions, check=args.check)
        for line in problems:
            print(line)
        if problems and args.check:
            print("lessons/ is out of date: run `python -m autograde.course generate` and commit lessons/")
        if problems:
            return 1
        print("lessons/ matches solutions/" if args.check else f"wrote {args.lessons}")
        return 0
    if args.command == "validate":
        problems = validate(args.solutions, args.lessons, timeout=args.timeout)
        print("\n".join(problems) if problems else "solutions pass, untouched lessons fail: ok")
        return 1 if problems else 0
    for number in (signal.SIGINT, signal.SIGTERM):  # a kill is an interrupt: no notebook is blamed
        signal.signal(number, interrupt)
    try:
        grade(args.submissions, out=args.out, root=args.root, solutions=args.solutions, timeout=args.timeout,
              jobs=args.jobs, in_kernel=args.in_kernel, lessons=args.lesson, students=args.student, force=args.force)
    except KeyboardInterrupt:
        print("grading stopped: the next `grade` resumes, keeping what this run graded", file=sys.stderr)
        return 130
    return 0


def interrupt(number, frame) -> None:
    """Ctrl-C or SIGTERM: raise KeyboardInterrupt, and remember it. Python drops an exception
    raised inside a finalizer ("Exception ignored in ..."), so the grade loop also stops at the
    next notebook it finishes when INTERRUPTED is set."""
    INTERRUPTED.append(number)
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
