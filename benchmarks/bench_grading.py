"""What the sealed grade costs: one full submission of each lesson graded by the sealed
judge against nbgrader's in-kernel autograde of the same notebook, and a class's throughput.

    .venv/bin/python benchmarks/bench_grading.py [--lessons 00 02] [--class-size 6]

Measured:
  - per lesson, one submission (every answer taken from the solution): the wall time of
    `autograde.course.grade` (sealed: nbgrader's release, the judge's start, every test) and
    of what `grade` did before: the same release, then nbgrader's autograde of the notebook
    in one kernel (`autograde.course.grade_in_kernel`); and their ratio;
  - the class: `--class-size` copies of lesson 00's full submission graded with --jobs 1
    and --jobs 2, in notebooks per minute.
Bar (issue 14): sealed at most 1.5x in-kernel for each lesson. Printed with PASS or FAIL;
nothing is asserted. The figures also go to benchmarks/results/bench_grading.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
from autograde import course  # noqa: E402  (after PATH: nbgrader calls `alembic`)


def full_submission(name: str) -> nbformat.NotebookNode:
    """The released lesson with every answer cell taken from the solution."""
    lesson = nbformat.read(REPO / "lessons" / f"{name}.ipynb", as_version=4)
    solution = nbformat.read(REPO / "solutions" / f"{name}.ipynb", as_version=4)
    answers = {c.metadata.nbgrader["grade_id"]: c.source for c in solution.cells
               if c.get("metadata", {}).get("nbgrader", {}).get("solution")}
    for cell in lesson.cells:
        gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
        if gid in answers:
            cell.source = answers[gid]
    return lesson


def setup(tmp: Path, name: str, students: int) -> tuple[Path, Path]:
    """A solutions folder with this lesson only, and a class of `students` full submissions."""
    solutions, submissions = tmp / "solutions", tmp / "class"
    solutions.mkdir(parents=True)
    shutil.copyfile(REPO / "solutions" / f"{name}.ipynb", solutions / f"{name}.ipynb")
    nb = full_submission(name)
    for i in range(students):
        (submissions / f"student{i}").mkdir(parents=True)
        nbformat.write(nb, str(submissions / f"student{i}" / f"{name}.ipynb"))
    return solutions, submissions


def sealed_seconds(tmp: Path, name: str, students: int = 1, jobs: int = 1) -> float:
    solutions, submissions = setup(tmp, name, students)
    start = time.perf_counter()
    results = course.grade(submissions, out=tmp / "out", root=tmp / "course", solutions=solutions, jobs=jobs)
    seconds = time.perf_counter() - start
    short = [r for r in results if r.score != r.max_score]
    if short:
        raise SystemExit(f"{name}: the full solution did not get full marks sealed: {short[0]}")
    return seconds


def in_kernel_seconds(tmp: Path, name: str) -> float:
    solutions, submissions = setup(tmp, name, 1)
    start = time.perf_counter()
    grader = course.Course(root=tmp / "course", solutions=solutions)
    released = grader.release()
    result = course.grade_in_kernel(grader, "student0", name, submissions / "student0" / f"{name}.ipynb",
                                    nbformat.read(released[name], as_version=4))
    seconds = time.perf_counter() - start
    if result.score != result.max_score:
        raise SystemExit(f"{name}: the full solution did not get full marks in the kernel: {result}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lessons", nargs="*", help="lesson numbers (default: all)")
    parser.add_argument("--class-size", type=int, default=6)
    args = parser.parse_args()
    names = sorted(p.stem for p in (REPO / "solutions").glob("*.ipynb")
                   if not args.lessons or p.stem[:2] in args.lessons)
    rows = []
    print(f"{'lesson':<22} {'sealed s':>9} {'in-kernel s':>12} {'ratio':>6}  bar <= 1.5x")
    for name in names:
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
            sealed, kernel = sealed_seconds(Path(a), name), in_kernel_seconds(Path(b), name)
        rows.append({"lesson": name, "sealed_s": sealed, "in_kernel_s": kernel, "ratio": sealed / kernel})
        print(f"{name:<22} {sealed:9.1f} {kernel:12.1f} {sealed / kernel:6.2f}  "
              f"{'PASS' if sealed <= 1.5 * kernel else 'FAIL'}", flush=True)
    throughput = {}
    for jobs in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            seconds = sealed_seconds(Path(tmp), "00_collectives", args.class_size, jobs)
        throughput[jobs] = 60 * args.class_size / seconds
        print(f"class of {args.class_size} x 00_collectives, --jobs {jobs}: {seconds:.1f} s, "
              f"{throughput[jobs]:.1f} notebooks/min", flush=True)
    out = REPO / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    (out / "bench_grading.json").write_text(json.dumps({"lessons": rows, "class_size": args.class_size,
                                                        "notebooks_per_minute": throughput,
                                                        "load": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()
