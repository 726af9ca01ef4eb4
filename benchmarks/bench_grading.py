"""What grading a class costs with the sealed judge, and whether load ever costs a right answer.

    .venv/bin/python benchmarks/bench_grading.py [--students 30] [--lessons 00 02] [--jobs 1 2]
                                                 [--busy 3] [--in-kernel]

Measured:
  - the class: `--students` students, each handing in the full solution (every answer taken
    from the solution) of every lesson (all 11 by default: 330 notebooks for 30 students),
    graded by `autograde.course.grade` with each `--jobs`, in notebooks per minute, and the
    seconds per notebook of each lesson;
  - the projection for 300 students handing in every lesson on a 16-core server: a model,
    the measured throughput per core of the best --jobs here (notebooks per minute divided by
    min(jobs, cores)) times 16 cores;
  - with `--busy K`, K busy loops run beside the grading (a loaded grading server): every full solution must still get full marks (the judge's limit scales
    with the reference's own time);
  - with `--in-kernel`, per lesson, one submission graded sealed against nbgrader's in-kernel
    autograde of the same notebook (`autograde.course.grade_in_kernel`), and their ratio.
Bars (issue 30): every full solution graded at full marks; (issue 14) sealed at most 1.5x
in-kernel for each lesson. Printed with PASS or FAIL; nothing is asserted. The figures also go
to benchmarks/results/bench_grading.json.

The grader puts back any file of its code that changes while it grades: run this on a copy of
the repository, not on a checkout someone is editing.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
from autograde import course  # noqa: E402  (after PATH: nbgrader calls `alembic`)

warnings.filterwarnings("ignore", module="nbgrader")  # SQLAlchemy 2's notes on nbgrader's ORM, as the command does

SERVER_CORES, SERVER_STUDENTS = 16, 300


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


def class_of(tmp: Path, names: list[str], students: int) -> tuple[Path, Path]:
    """A solutions folder with these lessons, and a class whose every student hands in every
    lesson's full solution."""
    solutions, folder = tmp / "solutions", tmp / "class"
    solutions.mkdir(parents=True)
    for name in names:
        shutil.copyfile(REPO / "solutions" / f"{name}.ipynb", solutions / f"{name}.ipynb")
    full = {name: full_submission(name) for name in names}
    for i in range(students):
        (folder / f"student{i:02d}").mkdir(parents=True)
        for name in names:
            nbformat.write(full[name], str(folder / f"student{i:02d}" / f"{name}.ipynb"))
    return solutions, folder


def grade_class(tmp: Path, names: list[str], students: int, jobs: int) -> dict:
    """Grade the class once: seconds, notebooks per minute, seconds per notebook by lesson, and
    the notebooks that did not get full marks."""
    solutions, folder = class_of(tmp, names, students)
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # the report's lines: in out/report.txt
        results = course.grade(folder, out=tmp / "out", root=tmp / "course", solutions=solutions, jobs=jobs)
    seconds = time.perf_counter() - start
    per_lesson = {}
    for r in results:
        per_lesson.setdefault(r.assignment, []).append(r.seconds)
    short = [f"{r.student} {r.assignment} {r.score:g}/{r.max_score:g}: " + "; ".join(
        f"{g} {r.messages.get(g, '')[:200]}" for g, (s, m) in r.tests.items() if s < m)
        for r in results if r.status != "graded" or r.score < r.max_score]
    return {"jobs": jobs, "seconds": seconds, "notebooks": len(results),
            "notebooks_per_minute": 60 * len(results) / seconds,
            "seconds_per_notebook": {a: sum(v) / len(v) for a, v in sorted(per_lesson.items())},
            "short_of_full_marks": short}


def busy_loop() -> None:
    while True:
        pass


def in_kernel_ratio(names: list[str]) -> list[dict]:
    """Per lesson: one full submission graded sealed, and by nbgrader in one kernel."""
    rows = []
    print(f"\n{'lesson':<22} {'sealed s':>9} {'in-kernel s':>12} {'ratio':>6}  bar <= 1.5x")
    for name in names:
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
            sealed = grade_class(Path(a), [name], 1, 1)["seconds"]
            solutions, folder = class_of(Path(b), [name], 1)
            start = time.perf_counter()
            grader = course.Course(root=Path(b) / "course", solutions=solutions)
            released = grader.release([name])
            result = course.grade_in_kernel(grader, "student00", name, folder / "student00" / f"{name}.ipynb",
                                            nbformat.read(released[name], as_version=4))
            kernel = time.perf_counter() - start
        ok = result.score == result.max_score
        rows.append({"lesson": name, "sealed_s": sealed, "in_kernel_s": kernel, "ratio": sealed / kernel,
                     "in_kernel_full_marks": ok})
        print(f"{name:<22} {sealed:9.1f} {kernel:12.1f} {sealed / kernel:6.2f}  "
              f"{'PASS' if sealed <= 1.5 * kernel else 'FAIL'}" + ("" if ok else "  (in-kernel: not full marks)"),
              flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lessons", nargs="*", help="lesson numbers (default: all)")
    parser.add_argument("--students", type=int, default=30, help="students, each handing in every lesson (default 30)")
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2], help="--jobs values to measure (default 1 2)")
    parser.add_argument("--busy", type=int, default=0, help="busy loops running beside the grading (default 0)")
    parser.add_argument("--in-kernel", action="store_true", help="also: sealed against in-kernel, per lesson")
    args = parser.parse_args()
    names = sorted(p.stem for p in (REPO / "solutions").glob("*.ipynb")
                   if not args.lessons or p.stem[:2] in args.lessons)
    cores = os.cpu_count() or 1
    loops = [multiprocessing.Process(target=busy_loop, daemon=True) for _ in range(args.busy)]
    for loop in loops:
        loop.start()
    print(f"a class of {args.students} students, each handing in the full solution of {len(names)} lessons "
          f"({', '.join(n[:2] for n in names)}); {cores} cores here, load {os.getloadavg()[0]:.1f}; "
          f"{args.busy} busy loops beside", flush=True)
    runs = []
    try:
        for jobs in args.jobs:
            with tempfile.TemporaryDirectory() as tmp:
                run = grade_class(Path(tmp), names, args.students, jobs)
            runs.append(run)
            print(f"--jobs {jobs}: {run['seconds']:.0f} s for {run['notebooks']} notebooks (load {os.getloadavg()[0]:.1f}), "
                  f"{run['notebooks_per_minute']:.2f} notebooks/min; full marks for every one: "
                  f"{'PASS' if not run['short_of_full_marks'] else 'FAIL'}", flush=True)
            for line in run["short_of_full_marks"]:
                print(f"    {line}")
    finally:
        for loop in loops:
            loop.terminate()
    best = max(runs, key=lambda r: r["notebooks_per_minute"] / min(r["jobs"], cores))
    per_core = best["notebooks_per_minute"] / min(best["jobs"], cores)
    total = SERVER_STUDENTS * len(names)
    minutes = total / (per_core * SERVER_CORES)
    print(f"\nseconds per notebook (--jobs {best['jobs']}): " + ", ".join(
        f"{a[:2]} {s:.0f}" for a, s in best["seconds_per_notebook"].items()))
    print(f"projection (a model: {per_core:.2f} notebooks/min per core, as measured here with --jobs {best['jobs']}, "
          f"times {SERVER_CORES} cores): {SERVER_STUDENTS} students x {len(names)} lessons = {total} notebooks "
          f"in {minutes:.0f} min ({minutes / 60:.1f} h) on a {SERVER_CORES}-core server with --jobs {SERVER_CORES}")
    ratio = in_kernel_ratio(names) if args.in_kernel else []
    out = REPO / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    (out / "bench_grading.json").write_text(json.dumps({
        "lessons": names, "students": args.students, "busy": args.busy, "cores": cores, "runs": runs,
        "projection": {"students": SERVER_STUDENTS, "cores": SERVER_CORES, "minutes": minutes,
                       "notebooks_per_minute_per_core": per_core},
        "in_kernel": ratio, "load": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()
