"""The sealed grades in nbgrader's gradebook, so the formgrader, manual grading and
`nbgrader export` see them.

After `grade`, the gradebook at the course root holds each student of the run, and for each
notebook the judge graded a submission whose every test cell carries the sealed score as its
auto score; the failed tests' messages are the auto comment of their exercise's answer cell.
The hand-in and the graded notebook (instructor's tests, verdicts) sit where nbgrader keeps
them (submitted/ and autograded/ under the course root). Grading again replaces a submission
and keeps what a person entered on it (manual scores, extra credit, comments, flags). A
notebook that is missing or not a notebook has no submission, as in nbgrader (export: 0). A
student whose folder is gone loses the submissions of the lessons this run graded, and leaves
the gradebook when none is left: each said in one line. A gradebook that is not this course's
is moved aside first, also in one line.
"""
from __future__ import annotations

import shutil
import sqlite3
import time
from datetime import datetime, timezone
from pathlib import Path

from nbgrader.api import Gradebook, MissingEntry

from autograde.sealed import Refused, read_handin

__all__ = ["set_aside_foreign", "record", "drop_absent", "exercises", "forget"]


def set_aside_foreign(root: Path, course_id: str) -> list[str]:
    """Move the course root's gradebook.db aside when it is not this course's (another course
    id, or not an nbgrader gradebook at all), so that nothing in it is lost or mixed in."""
    path = Path(root) / "gradebook.db"
    if not path.exists():
        return []
    why = foreign(path, course_id)
    if why is None:
        return []
    moved = path.with_name(f"gradebook.db.{time.strftime('%Y%m%d-%H%M%S')}.old")
    path.replace(moved)
    return [f"{path} {why}: moved to {moved.name} (nothing in it is changed); a new gradebook holds this course"]


def foreign(path: Path, course_id: str) -> str | None:
    """Why the gradebook at `path` is not this course's, or None."""
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if not {"assignment", "student", "submitted_assignment"} <= tables:
                return "is not an nbgrader gradebook (no assignment, student and submission tables)"
            courses = {row[0] for row in db.execute("SELECT id FROM course")} if "course" in tables else set()
            names = sorted(row[0] for row in db.execute("SELECT name FROM assignment"))
    except sqlite3.DatabaseError as error:
        return f"cannot be read as a gradebook ({error})"
    if course_id in courses or (not courses and not names):
        return None
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    return (f"belongs to another course ({', '.join(sorted(courses)) or 'no course id'}"
            f"{f'; assignments {shown}' if names else ''})")


def exercises(released) -> dict[str, str]:
    """test grade_id -> the answer cell it follows (its exercise), in a released notebook."""
    owner, current = {}, None
    for cell in released.cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if meta.get("solution"):
            current = meta.get("grade_id")
        elif meta.get("grade") and current is not None:
            owner[meta["grade_id"]] = current
    return owner


def record(db_url: str, course_id: str, root: Path, results, found: dict, graded: Path, submissions: Path,
           released: dict) -> None:
    """Each result in the gradebook at `db_url` (see the module): `found[student][assignment]`
    is the hand-in (under `submissions`, read as `sealed.read_handin` reads it: never through a
    link), `graded/<student>/<assignment>.ipynb` the graded notebook, `released` the assignment ->
    released notebook."""
    with Gradebook(db_url, course_id) as gb:
        for r in results:
            gb.update_or_create_student(r.student)
            kept = forget(gb, root, r.assignment, r.student)
            if r.status != "graded":
                continue
            try:
                handed, status = read_handin(found[r.student][r.assignment], submissions)
                stamp = datetime.fromtimestamp(status.st_mtime, timezone.utc)
            except Refused:  # made a link since it was graded, say: the graded notebook stands for it
                handed, stamp = None, datetime.now(timezone.utc)
            verdicts = graded / r.student / f"{r.assignment}.ipynb"
            autograded = verdicts.read_bytes() if verdicts.exists() else handed
            for step, data in (("submitted", handed or autograded), ("autograded", autograded)):
                folder = Path(root) / step / r.student / r.assignment
                folder.mkdir(parents=True, exist_ok=True)
                if data is not None:
                    (folder / f"{r.assignment}.ipynb").write_bytes(data)
                (folder / "timestamp.txt").write_text(stamp.strftime("%Y-%m-%d %H:%M:%S.%f UTC"))
            submission = gb.add_submission(r.assignment, r.student, timestamp=stamp)
            owner = exercises(released[r.assignment])
            for notebook in submission.notebooks:
                notebook.flagged = kept.get("flagged", False)
                for grade in notebook.grades:
                    if grade.name in r.tests:
                        grade.auto_score, grade.needs_manual_grade = r.tests[grade.name][0], False
                    else:  # a cell the judge does not grade: a person does
                        grade.auto_score, grade.needs_manual_grade = None, True
                    grade.manual_score, grade.extra_credit = kept.get(("grade", grade.name), (None, None))
                    if grade.manual_score is not None:
                        grade.needs_manual_grade = False
                for comment in notebook.comments:
                    failed = [f"{g} {s:g}/{m:g}: {r.messages.get(g, 'failed')}"
                              for g, (s, m) in r.tests.items() if s < m and owner.get(g) == comment.name]
                    comment.auto_comment = "\n".join(failed) or None
                    comment.manual_comment = kept.get(("comment", comment.name))
            gb.db.commit()


def forget(gb: Gradebook, root: Path, assignment: str, student: str) -> dict:
    """Remove the student's submission of `assignment` (gradebook and files, nbgrader's feedback
    of it too: it showed the old scores); return what a person had entered on it, to be kept by
    the next submission."""
    for step in ("submitted", "autograded", "feedback"):
        shutil.rmtree(Path(root) / step / student / assignment, ignore_errors=True)
    try:
        old = gb.find_submission(assignment, student)
    except MissingEntry:
        return {}
    kept = {}
    for notebook in old.notebooks:
        kept["flagged"] = kept.get("flagged", False) or bool(notebook.flagged)
        for grade in notebook.grades:
            if grade.manual_score is not None or grade.extra_credit is not None:
                kept[("grade", grade.name)] = (grade.manual_score, grade.extra_credit)
        for comment in notebook.comments:
            if comment.manual_comment:
                kept[("comment", comment.name)] = comment.manual_comment
    gb.remove_submission(assignment, student)
    return kept


def drop_absent(db_url: str, course_id: str, root: Path, assignments, present: set[str], folder: Path) -> list[str]:
    """Students with a submission of one of `assignments` in the gradebook whose folder is not
    among `present`: those submissions removed, the student too when none is left; one line each."""
    lines = []
    with Gradebook(db_url, course_id) as gb:
        for student in sorted(s.id for s in gb.students if s.id not in present):
            gone = []
            for assignment in assignments:
                try:
                    old = gb.find_submission(assignment, student)
                except MissingEntry:
                    continue
                gone.append(f"{assignment} ({old.score:g}/{old.max_score:g})")
                forget(gb, root, assignment, student)
            if not gone:
                continue
            left = gb.find_student(student).submissions
            if not left:
                gb.remove_student(student)
            lines.append(f"{student}: no folder in {folder} any more: removed from the gradebook "
                         f"{', '.join(gone)}" + ("" if left else ", and as a student (no submission left)"))
    return lines
