"""One hand-in never costs the class: a toy class of every kind of bad hand-in (a link to the
solution, a hard link, a folder that is a link, notebooks of every wrong shape and size, folder
names that are no student id, a notebook that stopped the last run, an answer that writes its
scratch full) is graded in one run, with one report line each, the right student's full marks,
and exit code 0. A second run of one notebook shows `--force` grading the one that stopped. An
error of the grader itself on one notebook costs that notebook (no grade run: the judge never starts)."""
from __future__ import annotations

import csv
import json
import os
import re
from pathlib import Path

import nbformat

import panel
from autograde import course, sealed
from parakit.grading import isolation
from test_pipeline import ON_TOY_ONLY, built, code_copy, run_course  # noqa: F401 (fixtures)

FILL = ("def add(a, b):\n    for i in range(40):  # 8 MiB a file (the file cap), 320 MiB in all\n"
        "        with open(f'fill{i}', 'wb') as f:\n            f.write(bytes(8 * 2**20 - 1))\n    return a + b\n")


def shaped(nb, change) -> bytes:
    """The notebook's JSON after `change(tree)`: a hand-in of the wrong shape."""
    tree = json.loads(nbformat.writes(nb))
    change(tree)
    return json.dumps(tree).encode()


def index_of(nb, gid: str) -> int:
    return next(i for i, c in enumerate(nb.cells) if panel.nbgrader_meta(c).get("grade_id") == gid)


def malformed(full) -> dict[str, tuple[bytes, str]]:
    """student -> (the bytes handed in, the report's line), one per kind of notebook that is no notebook."""
    answer, test = index_of(full, "add"), index_of(full, "test_add")

    def cell(i, key, value):
        return lambda t: t["cells"][i].__setitem__(key, value)

    def nbgrader(i, key, value):
        return lambda t: t["cells"][i]["metadata"]["nbgrader"].__setitem__(key, value)

    deep = b'{"cells": [], "metadata": {"x": ' + b"[" * 5000 + b"]" * 5000 + b'}, "nbformat": 4, "nbformat_minor": 5}'
    return {
        "nbgrader_list": (shaped(full, cell(answer, "metadata", {"nbgrader": ["add"]})),
                          f"cell {answer}: metadata.nbgrader is a list, not an object"),
        "grade_id_number": (shaped(full, nbgrader(answer, "grade_id", 7)),
                            f"cell {answer}: metadata.nbgrader.grade_id is a number, not a string"),
        "points_string": (shaped(full, nbgrader(test, "points", "one")),
                          f"cell {test}: metadata.nbgrader.points is a string, not a number"),
        "cell_string": (shaped(full, lambda t: t["cells"].__setitem__(2, "a cell")),
                        "cell 2: the cell is a string, not an object"),
        "source_number": (shaped(full, cell(answer, "source", 42)),
                          f"cell {answer}: source is a number, not a string or a list"),
        "metadata_string": (shaped(full, cell(test, "metadata", "locked")),
                            f"cell {test}: metadata is a string, not an object"),
        "deep": (deep, "invalid JSON: nested deeper than 100 levels"),
        "big_number": (shaped(full, lambda t: None).replace(b'"nbformat": 4', b'"nbformat": 4' + b"0" * 5000),
                       "invalid JSON: a number of 5001 characters, more than the 100 a notebook's may have"),
        "not_utf8": (nbformat.writes(full).encode().replace(b"Toy lesson", b"Toy \xff lesson"),
                     "not UTF-8 text: byte"),
        "not_json": (b'{"cells": [', "invalid JSON: Expecting value"),
    }


def class_of(built, folder: Path) -> dict[str, str]:
    """Write the class into `folder`; student or folder name -> the one report line it must get."""
    name = built.released.name
    full = panel.full_solution(panel.load(built.released), panel.load(built.lesson.solution))
    students = [panel.Student("full", {name: full}, {}), panel.Student("stopper", {name: full}, {}),
                panel.Student("alice\n", {name: full}, {}), panel.Student("...", {name: full}, {}),
                panel.Student(".hidden", {name: full}, {}), panel.Student("symlinked", {}, {}),
                panel.Student("hardlinked", {}, {}), panel.Student("huge", {}, {})]
    if isolation.unavailable() is None:  # unconfined, the filler would write its 320 MiB to the disk
        students.append(panel.Student("filler", {name: panel.with_sources(full, {"add": FILL})}, {}))
    bad = malformed(full)
    students += [panel.Student(student, {name: data}, {}) for student, (data, _) in bad.items()]
    panel.write_panel(students, folder)
    (folder / "symlinked" / name).symlink_to(built.lesson.solution.resolve())
    nbformat.write(full, str(folder.parent / "elsewhere.ipynb"))
    os.link(folder.parent / "elsewhere.ipynb", folder / "hardlinked" / name)
    with open(folder / "huge" / name, "wb") as f:
        f.truncate(sealed.MAX_BYTES + 1)  # sparse: no disk spent
    (folder / "linked").symlink_to(folder / "full")
    return {"symlinked": f"- {name} is a link: hand in the notebook itself, not a link to it",
            "hardlinked": f"- {name} is a link (a hard link: the file has 2 names): hand in the notebook itself, "
                          f"not a link to it",
            "huge": f"- {name} is more than the 32 MiB a hand-in may be",
            "linked": "linked: a link, not a student folder, ignored",
            "alice\n": "'alice\\n': not usable as a student id",
            "...": "'...': a hidden folder (its name starts with a dot), ignored",
            ".hidden": "'.hidden': a hidden folder (its name starts with a dot), ignored",
            "stopper": "grading this notebook stopped the last grading run: scored 0 until it is graded again",
            **{student: f"{name}: not a notebook ({line}" for student, (_, line) in bad.items()}}


def stopped_the_last_run(built, folder: Path, out: Path, student: str) -> None:
    """The journal as a run leaves it when the grader died while grading `student`'s notebook."""
    task = sealed.Task(student, built.lesson.name, str(folder / student / built.released.name),
                       str(built.solutions / built.released.name), "", str(out), [], 0.0, "", "", str(folder))
    (out / course.JOURNAL).mkdir(parents=True, exist_ok=True)
    (out / course.JOURNAL / "unfinished").write_text("a run stopped\n")
    (out / course.JOURNAL / f"{course.fingerprint(task)}.started").write_text("{}")


def rows_of(out: Path) -> dict[str, tuple[str, float]]:
    with open(out / "grades.csv", encoding="utf-8") as f:
        return {row["student"]: (row["status"], float(row["score"])) for row in csv.DictReader(f)}


@ON_TOY_ONLY
def test_every_bad_hand_in_gets_one_line_and_the_rest_of_the_class_is_graded(built, tmp_path):
    folder, root, out = tmp_path / "class", tmp_path / "course", tmp_path / "out"
    lines = class_of(built, folder)
    stopped_the_last_run(built, folder, out, "stopper")
    args = ["--solutions", str(built.solutions), "grade", str(folder), "--root", str(root), "--out", str(out),
            "--timeout", str(built.lesson.timeout)]
    run = run_course(*args)
    assert run.returncode == 0, run.stdout + run.stderr
    report = (out / "report.txt").read_text(encoding="utf-8")
    for who, line in lines.items():
        assert len([l for l in report.splitlines() if line in l]) == 1, f"{who!r}: {line!r} not once in:\n{report}"
    rows = rows_of(out)
    refused = {s: ("missing", 0.0) for s in ("symlinked", "hardlinked", "huge")}
    shapes = {s: ("not a notebook", 0.0) for s in malformed(panel.load(built.released))}
    want = {"full": ("graded", 5.0), "stopper": ("stopped the run", 0.0), **refused, **shapes}
    if "filler" in {p.name for p in folder.iterdir()}:
        want["filler"] = ("graded", 2.0)  # its add fails, its mean is full marks
        page = (out / "feedback" / "filler" / f"{built.lesson.name}.html").read_text()
        assert "No space left on device (a graded rank writes at most 256 MiB in its scratch folder" in page, page
    assert rows == want
    students = "|".join(re.escape(s) for s in rows)
    broken = [l for l in report.splitlines()
              if not re.match(rf"({students}) |    [-!] |note: |grades: |feedback: |log: |\d+ students?, ", l)]
    assert broken == [], report
    assert "`grade --force` grades it again" in report
    assert not (out / course.JOURNAL / "unfinished").exists()

    stopped_the_last_run(built, folder, out, "stopper")
    again = run_course(*args, "--student", "stopper", "--force")  # stopped again: --force grades it
    assert again.returncode == 0, again.stdout + again.stderr
    assert rows_of(out) == {**want, "stopper": ("graded", 5.0)}


@ON_TOY_ONLY
def test_a_notebook_the_grader_itself_fails_on_costs_that_notebook_only(built, tmp_path):
    """An error of the grader's own (here: its solution gone) is that notebook's 0 and line, not
    the run's end; its journal mark was written before grading (the course removes it once the
    result is saved)."""
    full = panel.full_solution(panel.load(built.released), panel.load(built.lesson.solution))
    (tmp_path / "class" / "alice").mkdir(parents=True)
    nbformat.write(full, str(tmp_path / "class" / "alice" / built.released.name))
    task = sealed.Task("alice", built.lesson.name, str(tmp_path / "class" / "alice" / built.released.name),
                       str(tmp_path / "gone.ipynb"), str(built.released), str(tmp_path), [], 15.0, "salt",
                       str(tmp_path), str(tmp_path / "class"), str(tmp_path / "alice.started"))
    [result] = sealed.grade_all([task])
    assert (result.status, result.score, result.max_score) == ("grader failed", 0.0, 5.0)
    assert result.notes == ["the grader itself failed on this notebook, which is scored 0 until it is graded again"]
    assert result.private == [f"the grader failed on this notebook (FileNotFoundError: [Errno 2] No such file or "
                              f"directory: '{tmp_path / 'gone.ipynb'}')"]
    assert json.loads((tmp_path / "alice.started").read_text()) == {"student": "alice", "assignment": "toy"}
