"""Mutation testing of the graded checks: each lesson's answers rewritten into other techniques that compute the
same values, each graded by the sealed grader, each killed or explained.

    python -m autograde.mutants [--lesson 00_collectives ...] [--exercise GRADE_ID ...] [--operator NAME ...]
                                [--out DIR] [--table benchmarks/MUTANTS.md] [--jobs N] [--list]
                                [--solutions DIR] [--catalog autograde/mutants.toml] [--whole]

A mutant is one student: the lesson as released, every answer cell taken from the solution, one of them
mutated, by an operator of autograde.mutations (all its sites in the cell, and each site alone when it has
several) or by a hand-written mutant of the catalog (old text -> new text in one answer cell). Its notebook
stops after the mutated exercise's last test cell (--whole: keeps every cell). A lesson's mutants are graded
in one run of `autograde.course.grade`, beside the solution itself, which must score full marks on every
exercise. A mutant is killed when the mutated exercise's tests (the test cells between its answer cell and
the next) score less than full; it survives otherwise, and a survivor is explained in the catalog
([survivors.LESSON.EXERCISE], MUTANT or OPERATOR = why the exercise's text allows it). A mutant that cannot
be built (no such answer cell, no such old text, a mutated cell that does not compile) is one `not built`
line. An exercise no mutant rewrites needs a reason in the catalog too ([unmutated.LESSON], EXERCISE = why:
a function of its arguments that its values grade, say). Each lesson run replaces its section of the table
(per exercise: mutants, killed, survivors and why, not built; the unmutated exercises and why). The exit
status is 1 if a survivor is unexplained, a mutant could not be judged (the solution short of full marks,
the grader failed) or, in a run of whole lessons (no --exercise, no --operator), an exercise has no mutant
and no reason, else 0. --list prints the mutants and grades nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import shutil
import sys
import tempfile
import time
import tomllib
import warnings
from dataclasses import dataclass
from pathlib import Path

import nbformat

from autograde import course, mutations
from parakit.grading.notebook import meta, python_source

HERE = Path(__file__).resolve().parent
CATALOG = HERE / "mutants.toml"
TABLE = course.REPO / "benchmarks" / "MUTANTS.md"
CONTROL = "solution"  # the student who hands in the solution unmutated


@dataclass
class Mutant:
    """One answer cell of a lesson, mutated; after grading, what its exercise's tests made of it."""
    lesson: str
    exercise: str
    name: str                   # the operator ("blocking"), one site of it ("blocking-2"), or a hand-written name
    operator: str               # the operator, or the hand-written mutant's name
    where: str = ""             # what it rewrites
    source: str | None = None   # the mutated answer cell
    problem: str = ""           # why it could not be built
    outcome: str = ""           # killed | survived | not judged
    how: str = ""               # killed: the first failing test and its message; survived: why, if explained

    @property
    def student(self) -> str:
        return f"{self.exercise}.{self.name}"


# ---------------------------------------------------------------------------- building

def answers(nb) -> dict[str, str]:
    """Answer grade_id -> the cell's source, for the code cells nbgrader marks `solution` (and not `grade`)."""
    return {meta(c)["grade_id"]: c.source for c in nb.cells
            if c.cell_type == "code" and meta(c).get("solution") and not meta(c).get("grade")}


def tests_of(nb) -> dict[str, list[str]]:
    """Answer grade_id -> the test cells that follow it, up to the next answer cell."""
    groups, current, cells = {}, None, answers(nb)
    for cell in nb.cells:
        if meta(cell).get("grade_id") in cells:
            current = meta(cell)["grade_id"]
            groups[current] = []
        elif meta(cell).get("grade") and current is not None:
            groups[current].append(meta(cell)["grade_id"])
    return groups


def operator_mutants(lesson: str, exercise: str, source: str, operators: list[str]) -> list[Mutant]:
    """The mutants the operators make of one answer cell: all sites of each, then each site alone."""
    try:
        plain = python_source(source)
        found = {name: mutations.sites(plain, name) for name in operators}
    except SyntaxError as error:
        return [Mutant(lesson, exercise, "*", "*", problem=f"the answer cell does not parse: {error.msg}")]
    made = []
    for name, where in found.items():
        made += [Mutant(lesson, exercise, name, name, "; ".join(where), mutations.mutate(plain, name))] if where else []
        made += [Mutant(lesson, exercise, f"{name}-{k + 1}", name, site, mutations.mutate(plain, name, k))
                 for k, site in enumerate(where) if len(where) > 1]
    return made


def hand_mutant(entry: dict, cells: dict[str, str]) -> Mutant:
    """A hand-written mutant of the catalog: in the answer cell `exercise`, each `old` text (a string, or a list)
    replaced by the `new` one of the same place, each found exactly once."""
    m = Mutant(entry["lesson"], entry["exercise"], entry["name"], entry["name"], entry["what"])
    source = cells.get(m.exercise)
    if source is None:
        m.problem = f"no answer cell {m.exercise} in {m.lesson}"
        return m
    olds, news = ([entry[k]] if isinstance(entry[k], str) else entry[k] for k in ("old", "new"))
    for old, new in zip(olds, news, strict=True):
        if source.count(old) != 1:
            m.problem = f"the old text {old.strip()[:60]!r} is in the answer cell {source.count(old)} times, not once"
            return m
        source = source.replace(old, new)
    m.source = source
    return m


def compiled(m: Mutant) -> Mutant:
    """`m`, its problem said if its source does not compile."""
    if m.source is not None:
        try:
            compile(python_source(m.source), m.student, "exec")
        except SyntaxError as error:
            m.problem, m.source = f"the mutated cell does not compile: {error.msg} (line {error.lineno})", None
    return m


def build(lesson: str, solution, catalog: dict, exercises=None, operators=None) -> list[Mutant]:
    """Every mutant of the lesson (of the exercises and operators asked, when asked)."""
    cells = answers(solution)
    chosen = [e for e in cells if not exercises or e in exercises]
    names = [o for o in mutations.OPERATORS if not operators or o in operators]
    made = [m for e in chosen for m in operator_mutants(lesson, e, cells[e], names)]
    made += [hand_mutant(h, cells) for h in catalog.get("hand", []) if h["lesson"] == lesson
             and (not exercises or h["exercise"] in exercises) and (not operators or h["name"] in operators)]
    tests = tests_of(solution)
    for m in made:
        if m.exercise in tests and not tests[m.exercise]:
            m.problem, m.source = m.problem or "no test cell follows the answer cell", None
    order = {exercise: i for i, exercise in enumerate(cells)}
    return [compiled(m) for m in sorted(made, key=lambda m: order.get(m.exercise, len(order)))]


# ---------------------------------------------------------------------------- grading

def with_answers(nb, sources: dict[str, str]):
    """A copy of `nb` with the answer cells named given these sources."""
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        if meta(cell).get("grade_id") in sources:
            cell.source = sources[meta(cell)["grade_id"]]
    return nb


def cut_after(nb, last_test: str):
    """`nb` without the cells after the test cell `last_test`."""
    index = next(i for i, c in enumerate(nb.cells) if meta(c).get("grade_id") == last_test)
    nb.cells = nb.cells[:index + 1]
    return nb


def write_class(folder: Path, lesson: str, released, solution, mutants: list[Mutant], whole: bool) -> None:
    """One student folder per mutant, and the control's: the solution unmutated."""
    full, tests = with_answers(released, answers(solution)), tests_of(solution)
    notebooks = {CONTROL: full}
    for m in mutants:
        notebook = with_answers(full, {m.exercise: m.source})
        notebooks[m.student] = notebook if whole else cut_after(notebook, tests[m.exercise][-1])
    for student, notebook in notebooks.items():
        (folder / student).mkdir(parents=True)
        nbformat.write(notebook, str(folder / student / f"{lesson}.ipynb"))


def grade(lesson: str, solutions: Path, mutants: list[Mutant], out: Path, jobs: int, whole: bool) -> dict:
    """Grade the mutants and the control in one grade run under out/LESSON; student -> Result."""
    work = out / lesson
    shutil.rmtree(work, ignore_errors=True)
    (work / "solutions").mkdir(parents=True)
    shutil.copyfile(solutions / f"{lesson}.ipynb", work / "solutions" / f"{lesson}.ipynb")  # as it is now
    course.generate(work / "lessons", work / "solutions")
    released = nbformat.read(work / "lessons" / f"{lesson}.ipynb", as_version=4)
    solution = nbformat.read(work / "solutions" / f"{lesson}.ipynb", as_version=4)
    write_class(work / "class", lesson, released, solution, mutants, whole)
    with open(work / "grade.out", "w") as printed, contextlib.redirect_stdout(printed):
        results = course.grade(work / "class", out=work / "grades", root=work / "course", solutions=work / "solutions",
                               lessons=[lesson], jobs=jobs)
    return {r.student: r for r in results}


def full_marks(result, tests: list[str]) -> bool:
    """Whether `result` scored every point of the tests named."""
    return all(result.tests[t][0] >= result.tests[t][1] for t in tests)


def judge(m: Mutant, results: dict, tests: list[str], catalog: dict) -> None:
    """Set m's outcome from its result: killed, survived (and why, if explained), or not judged."""
    result, control = results.get(m.student), results.get(CONTROL)
    if control is None or control.status != "graded" or not full_marks(control, tests):
        m.outcome, m.how = "not judged", "the solution itself is short of full marks on this exercise"
    elif result is None or result.status != "graded":
        m.outcome, m.how = "not judged", f"not graded: {result.status if result else 'no result'}"
    elif not full_marks(result, tests):
        failed = next(t for t in tests if not full_marks(result, [t]))
        message = " ".join(result.messages.get(failed, "").split())
        message = message if len(message) <= 240 else f"{message[:110]} ... {message[-125:]}"  # what differs: its end
        m.outcome, m.how = "killed", failed + (f" ({message})" if message else "")
    else:
        m.outcome, m.how = "survived", explanation(catalog, m)


def explanations(catalog: dict, m: Mutant) -> dict[str, str]:
    """The catalog's explanations of survivors of m's exercise: mutant or operator -> why."""
    return catalog.get("survivors", {}).get(m.lesson, {}).get(m.exercise, {})


def explanation(catalog: dict, m: Mutant) -> str:
    """Why the catalog says the exercise's text allows `m` ("": it does not say)."""
    said = explanations(catalog, m)
    return said.get(m.name) or said.get(m.operator) or ""


# ---------------------------------------------------------------------------- reporting

def verdict(m: Mutant) -> str:
    if m.problem:
        return f"not built: {m.problem}"
    if m.outcome == "survived":
        return f"survived: {m.how}" if m.how else "SURVIVED, NOT EXPLAINED: a test to kill it, or a line in the catalog"
    return f"{m.outcome}: {m.how}"


def unexplained(mutants: list[Mutant]) -> list[Mutant]:
    """The mutants that fail the run: survivors nobody explained, and those that could not be judged."""
    return [m for m in mutants if (m.outcome == "survived" and not m.how) or m.outcome == "not judged"]


def counts(mutants: list[Mutant]) -> list[int]:
    """Mutants built, killed, survived, not built."""
    built = [m for m in mutants if not m.problem]
    return [len(built), sum(m.outcome == "killed" for m in built), sum(m.outcome == "survived" for m in built),
            len(mutants) - len(built)]


def unmutated(lesson: str, exercises: list[str], mutants: list[Mutant], catalog: dict) -> dict[str, str]:
    """The exercises no mutant rewrites -> why (the catalog's [unmutated.LESSON]), or "" where it gives none."""
    reasons = catalog.get("unmutated", {}).get(lesson, {})
    return {e: reasons.get(e, "") for e in exercises if not any(m.exercise == e for m in mutants)}


def section(lesson: str, exercises: list[str], mutants: list[Mutant], heading: str, bare: dict[str, str]) -> str:
    """The table's section of one lesson: its run, a summary row per exercise (those without mutants too), a row
    per mutant, and why each exercise without one has none."""
    rows = ["| exercise | mutants | killed | survived | not built |", "|---|---|---|---|---|"]
    for exercise in dict.fromkeys([*exercises, *(m.exercise for m in mutants)]):
        rows.append(f"| {exercise} | " + " | ".join(map(str, counts([m for m in mutants if m.exercise == exercise])))
                    + " |")
    if mutants:
        rows += ["", "| exercise | mutant | rewrites | outcome |", "|---|---|---|---|"]
        rows += [f"| {m.exercise} | {m.name} | {cell(m.where)} | {cell(verdict(m))} |" for m in mutants]
    if bare:
        rows += ["", "Not mutated:", ""]
        rows += [f"- {e}: {why or 'NO REASON: a mutant to write, or a line in the catalog'}" for e, why in bare.items()]
    return f"## {lesson}\n\n{heading}\n\n" + "\n".join(rows) + "\n"


def cell(text: str) -> str:
    """`text` fit for a table cell: one line, no column bars."""
    return " ".join(text.split()).replace("|", "\\|")


PREAMBLE = """# Mutation testing of the graded checks

Written by `python -m autograde.mutants` (autograde/mutants.py); a lesson's section is replaced when the
lesson is run again. A mutant is the lesson's solution with one answer cell rewritten into another technique
that computes the same values (autograde/mutations.py's operators, and the hand-written mutants of
autograde/mutants.toml), graded by the sealed grader beside the solution itself. killed: the exercise's tests
scored less than full marks, the first failing test named; survived: full marks, and why the exercise's text
allows it (autograde/mutants.toml), or NOT EXPLAINED: a gap in the tests, or a line the catalog lacks.
"""


def write_table(path: Path, lesson: str, text: str) -> None:
    """Replace (or add, in lesson order) the lesson's section of the table at `path`."""
    old = path.read_text() if path.exists() else PREAMBLE
    head, *parts = old.split("\n## ")
    sections = {p.split("\n", 1)[0]: "## " + p.rstrip("\n") + "\n" for p in parts}
    sections[lesson] = text
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([head.rstrip("\n") + "\n", *(sections[k] for k in sorted(sections))]))


# ---------------------------------------------------------------------------- command line

def run_lesson(lesson: str, args, catalog: dict, out: Path) -> tuple[list[Mutant], list[str]]:
    """Build, grade and judge one lesson's mutants; print them, write its section of the table. Returns the
    mutants and the exercises without a mutant or a reason (none where --exercise or --operator narrows the run)."""
    solution = nbformat.read(args.solutions / f"{lesson}.ipynb", as_version=4)
    mutants = build(lesson, solution, catalog, args.exercise, args.operator)
    ready = [m for m in mutants if not m.problem]
    if args.list:
        for m in mutants:
            print(f"{lesson} {m.student}: " + (f"not built: {m.problem}" if m.problem else m.where))
        return [], []
    print(f"{lesson}: grading {course.count(len(ready), 'mutant')} and the solution in one grade run "
          f"(log: {out / lesson})", flush=True)
    start = time.monotonic()
    results = grade(lesson, args.solutions, ready, out, args.jobs, args.whole) if ready else {}
    tests = tests_of(solution)
    for m in ready:
        judge(m, results, tests[m.exercise], catalog)
    for m in mutants:
        print(f"  {m.student}: {verdict(m)}")
    exercises = [e for e in answers(solution) if not args.exercise or e in args.exercise]
    heading = run_line(args, mutants, time.monotonic() - start)
    bare = {} if args.exercise or args.operator else unmutated(lesson, exercises, mutants, catalog)
    for exercise, why in bare.items():
        print(f"  {exercise}: not mutated: {why or 'NO REASON'}")
    write_table(args.table, lesson, section(lesson, exercises, mutants, heading, bare))
    return mutants, [f"{lesson} {e}" for e, why in bare.items() if not why]


def run_line(args, mutants: list[Mutant], seconds: float) -> str:
    """The line under a lesson's heading in the table: when, what was asked, how many, how long."""
    asked = "".join(f" --{k} {' '.join(v)}" for k, v in (("exercise", args.exercise), ("operator", args.operator)) if v)
    whole = " (whole notebooks)" if args.whole else ""
    return (f"Run on {time.strftime('%Y-%m-%d')}{asked}: {course.count(counts(mutants)[0], 'mutant')} and the "
            f"solution, one grade run, {seconds:.0f} s with --jobs {args.jobs}{whole}.")


def check_operators(asked: list[str] | None, catalog: dict) -> None:
    """Stop with what there is when --operator names neither an operator nor a hand-written mutant."""
    known = set(mutations.OPERATORS) | {h["name"] for h in catalog.get("hand", [])}
    unknown = sorted(set(asked or ()) - known)
    if unknown:
        raise SystemExit(f"--operator {' '.join(unknown)}: no such operator or hand-written mutant; the operators are "
                         f"{', '.join(mutations.OPERATORS)}")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m autograde.mutants", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lesson", action="append", help="this lesson only (00, 00_collectives); again for more")
    parser.add_argument("--exercise", action="append", help="this answer cell's grade_id only; again for more")
    parser.add_argument("--operator", action="append",
                        help=f"this operator ({', '.join(mutations.OPERATORS)}) or hand-written mutant only")
    parser.add_argument("--out", type=Path, help="where the mutants' class, grades and logs go (default: a "
                                                 "temporary folder, removed after)")
    parser.add_argument("--table", type=Path, default=TABLE, help="the results table (default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks graded at once (default 1)")
    parser.add_argument("--list", action="store_true", help="print the mutants it would build; grade nothing")
    parser.add_argument("--solutions", type=Path, default=course.REPO / "solutions", help="instructor notebooks")
    parser.add_argument("--catalog", type=Path, default=CATALOG, help="hand-written mutants and explained survivors")
    parser.add_argument("--whole", action="store_true", help="keep the cells after the mutated exercise's tests")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", module="nbgrader")  # SQLAlchemy 2 noise from nbgrader's ORM
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    args = parse_args(argv)
    catalog = tomllib.loads(args.catalog.read_text())
    check_operators(args.operator, catalog)
    names = sorted(p.stem for p in args.solutions.glob("*.ipynb"))
    lessons = course.choose({}, {}, names, args.lesson, None)[1] if args.lesson else names
    with tempfile.TemporaryDirectory(prefix="parakit-mutants-") as scratch:
        out = args.out or Path(scratch)
        runs = [run_lesson(lesson, args, catalog, out) for lesson in lessons]
    mutants, reasonless = [m for run in runs for m in run[0]], [e for run in runs for e in run[1]]
    for m in (m for m in mutants if m.outcome == "killed" and m.name in explanations(catalog, m)):
        print(f"note: {m.lesson} {m.student} was killed: the catalog's line explaining it as a survivor can go")
    failing = unexplained(mutants)
    for m in failing:
        print(f"{m.lesson} {m.student}: {verdict(m)}")
    for exercise in reasonless:
        print(f"{exercise}: no mutant and no reason in the catalog's [unmutated]")
    return 1 if failing or reasonless else 0


if __name__ == "__main__":
    sys.exit(main())
