"""The sealed judge: a notebook's tests decided by a process that runs none of its student's code.

The judge reads the student's answer cells as text only. It runs the instructor's cells
that define what the tests use (imports, functions, classes, the assignments they need;
no demo), with each name an answer cell defines bound to a `StudentName`, then runs every
test cell (hidden tests included, always the instructor's version). There `grading.check`
and `check_local` do not call anything: each run of the student's function happens on
fresh ranks forked by a zygote (`sandbox`), which run the instructor's setup and the
student's cells, with the exercise's forbidden functions and what only they use (`reach`)
withheld and the process locked (`jail`); the reference runs the same way on other fresh
ranks with no student code. Both talk only through the judge's broker (`relay`, `broker`),
which records every call they make, and send back plain data (`codec`). Values, traffic,
forbidden calls: all compared here.

    judge = Judge(solution_nb, config); verdicts = judge.grade(submission_nb)
"""
from __future__ import annotations

import ast
import builtins
import contextlib
import difflib
import hashlib
import io
import math
import random
import threading
import time
from dataclasses import dataclass

import cloudpickle
import torch

from parakit.grading import allow, reach, sandbox
from parakit.grading.jail import Tripwire
from parakit.grading.notebook import defined_names, meta, parse, python_source, setup_statements, shape, signature, used_names
from parakit.grading.runs import JudgeConfig, Run, Runner, outcome

__all__ = ["Judge", "JudgeConfig", "Verdict", "StudentName", "Runner"]


class StudentName:
    """Stands in the judge for what a student's answer cell defines. It cannot be called
    here; pickled into a student's rank, it becomes the student's object of that name."""

    def __init__(self, path: tuple[str, ...]):
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "__name__", path[-1])
        object.__setattr__(self, "__qualname__", ".".join(path))

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return StudentName(self._path + (attr,))

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{'.'.join(self._path)} is the student's code: the sealed judge never runs it "
                           f"(pass it to grading.check or check_local)")

    def __reduce__(self):
        return sandbox.student_object, (self._path,)

    def __repr__(self):
        return f"<student's {'.'.join(self._path)}>"


# ---------------------------------------------------------------------------- the checks

@dataclass
class Verdict:
    """One test cell's outcome."""

    grade_id: str
    points: float
    max_points: float
    message: str = ""


REFERENCE_TIMES = 10  # a student's run may take this many times the reference's on the same input


class Sealed:
    """`grading.check` and `check_local` as the judge runs them, for one submission."""

    def __init__(self, reference: Runner, student: Runner, cells: list[tuple[str, str, bool]],
                 hidden: list[str], cache: dict, kept: list[str], floor: float = math.inf):
        self.reference, self.student, self.cells, self.hidden = reference, student, cells, hidden
        self.kept = kept                # the instructor's sources: what they name is never withheld
        self.floor = floor              # a check's `timeout` above this is cut to it (JudgeConfig.cell_floor)
        self.cache = cache
        self.references: list = []      # the reference callables the checks used (for the copy report)

    def _pair(self, student_job, reference_job, world_size, timeout) -> tuple[Run, Run]:
        """The student's run and the reference's, side by side (the reference once per input).
        The student's limit is REFERENCE_TIMES the reference's own time on the same input, or
        `timeout` (at most the floor) where that is longer, and does not run out while the
        reference still runs: a loaded machine slows both alike, so it never zeroes a right
        answer, and a hang costs the floor (15 s; every full solution's runs took at most 3.5 s
        on 2 cores at load 4.5). The reference (the instructor's code) is bounded only against
        a hang, at REFERENCE_TIMES x `timeout`."""
        key = hashlib.sha256(reference_job.call + bytes([world_size, reference_job.gpu])).hexdigest()
        thread = None
        if key not in self.cache:
            def reference():
                start = time.monotonic()
                try:
                    run = self.reference.run(reference_job, world_size, REFERENCE_TIMES * timeout)
                except Exception as error:  # noqa: BLE001: said as the reference's failure, the limit set
                    run = Run([None] * world_size, [[] for _ in range(world_size)], [[] for _ in range(world_size)],
                              f"its run raised {type(error).__name__}: {error}")
                self.cache[key] = (run, time.monotonic() - start)
            thread = threading.Thread(target=reference)
            thread.start()
        least = min(timeout, self.floor)
        limit = lambda: max(least, REFERENCE_TIMES * self.cache[key][1]) if key in self.cache else math.inf  # noqa: E731
        mine = self.student.run(student_job, world_size, limit)
        if thread is not None:
            thread.join()
        elif (mine.failure or "").startswith("did not finish within"):
            mine = self._again_if_slower(mine, student_job, reference_job, world_size, key, limit())
        return mine, self.cache[key][0]

    def _again_if_slower(self, mine: Run, student_job, reference_job, world_size, key, given: float) -> Run:
        """A student's run that ran out of a limit set by the reference's time from an earlier
        student (the cache): the reference is timed again now, and where the machine has
        slowed so that its limit would be longer, the student's run is made again under it
        (two loaded moments are then compared, not a quiet one with a busy one). A hang costs
        one more reference run."""
        start = time.monotonic()
        self.reference.run(reference_job, world_size, REFERENCE_TIMES * given)
        now = REFERENCE_TIMES * (time.monotonic() - start)
        if now <= given:
            return mine
        self.cache[key] = (self.cache[key][0], now / REFERENCE_TIMES)
        return self.student.run(student_job, world_size, now)

    def _jobs(self, call_student: bytes, call_reference: bytes, local: bool, forbid, allowed, name: str, gpu: bool):
        """The student's job (its cells, the forbidden functions and what only they use withheld,
        what the exercise allows its code to call of parakit's, the rest gated) and the reference's,
        both on the emulated GPU box where `gpu`."""
        withheld = [(f, f"{name} called {_where(f)}, which this exercise forbids: {why}") for f, why in forbid.items()]
        withheld += [(f, f"{name} called {_where(f)}, which only the parts of parakit this exercise forbids use")
                     for f in reach.only_used_by(forbid, self.kept)]
        gate = b"" if allowed is None else cloudpickle.dumps((list(allowed), allow.message(name, allowed)))
        student = sandbox.Job(call_student, local, self.cells, cloudpickle.dumps(withheld), True, self.hidden,
                              allow=gate, gpu=gpu)
        return student, sandbox.Job(call_reference, local, allow=gate, gpu=gpu)

    def check(self, student, reference, make_inputs, *, world_sizes=(2, 4), trials=2, forbid=None, allow=None,
              timeout=60.0, rtol=None, atol=None, same_traffic=False, same_order=False, same_overlap=False,
              gpu=False) -> None:
        from parakit.grading import Traffic, compare_overlap, compare_traffic, compare_values
        name, forbid = getattr(student, "__name__", "your function"), forbid or {}
        _refuse_open(name, allow)
        self.references.append(reference)
        for world_size in list(world_sizes):
            for trial in range(trials):
                seed = random.randrange(2**31)
                jobs = self._jobs(cloudpickle.dumps((student, make_inputs, seed)),
                                  cloudpickle.dumps((reference, make_inputs, seed)), False, forbid, allow, name, gpu)
                mine, theirs = self._pair(*jobs, world_size, timeout)
                where = f"{name} on {world_size} ranks, trial {trial + 1}"
                _raise_failures(mine, theirs, where)
                _raise_forbidden(mine, theirs, forbid, name)
                flags = [run.overlapped or [None] * len(run.calls) for run in (mine, theirs)]
                traffic = [(Traffic.of_calls(a, fa), Traffic.of_calls(b, fb))
                           for a, fa, b, fb in zip(mine.calls, flags[0], theirs.calls, flags[1])]
                for rank, (got, expected) in enumerate(zip(mine.values, theirs.values)):
                    got = outcome(got)
                    _raise_error(got, f"{where}, rank {rank}")
                    compare_values(got["value"], expected["value"], f"{where}, rank {rank} (seed {seed})", rtol, atol,
                                   world_size, traffic)
                if same_traffic or same_order:
                    compare_traffic(traffic, f"{where} (seed {seed})", same_order)
                if same_overlap:
                    compare_overlap(traffic, f"{where} (seed {seed})")

    def check_local(self, student, reference, cases, *, forbid=None, allow=None, rtol=None, atol=None,
                    gpu=False) -> None:
        from parakit.grading import compare_values
        name, forbid, cases = getattr(student, "__name__", "your function"), forbid or {}, list(cases)
        _refuse_open(name, allow)
        self.references.append(reference)
        jobs = self._jobs(cloudpickle.dumps((student, cases)), cloudpickle.dumps((reference, cases)), True, forbid,
                          allow, name, gpu)
        mine, theirs = self._pair(*jobs, 1, 60.0 + 0.5 * len(cases))
        _raise_failures(mine, theirs, name)
        _raise_forbidden(mine, theirs, forbid, name)
        got_all = mine.values[0]
        if not isinstance(got_all, list) or len(got_all) != len(cases):
            _raise_error(outcome(got_all), name)
            raise AssertionError(f"{name}: sent back {type(got_all).__name__}, not one result per case")
        for case, got, expected in zip(cases, got_all, theirs.values[0]):
            where = f"{name}{_short(case)}"
            got = outcome(got)
            _raise_error(got, where)
            compare_values(got["value"], expected["value"], where, rtol, atol)


def _refuse_open(name: str, allow) -> None:
    """A check that names no allowlist is not graded (it would grade open: any of parakit's
    finished answers could stand in for the student's)."""
    if allow is None:
        raise AssertionError(f"{name}: this exercise names no allowlist, so it is not graded: pass allow=[...] to its "
                             f"check (what of parakit the student's code may call; [] for nothing)")


def _where(fn) -> str:
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', fn)}"


def _short(case) -> str:
    text = repr(tuple(case))
    return text if len(text) < 120 else text[:117] + "...)"


def _raise_failures(mine: Run, theirs: Run, where: str) -> None:
    flat = [x for v in theirs.values for x in (v if isinstance(v, list) else [v])]
    if theirs.failure or any(not isinstance(v, dict) or "error" in v for v in flat):
        raise RuntimeError(f"the reference failed ({where}): {theirs.failure or [v for v in flat if 'error' in v][:1]}")
    if mine.failure:
        raise AssertionError(f"{where}: {mine.failure}")


def _raise_forbidden(mine: Run, theirs: Run, forbid: dict, name: str) -> None:
    """A forbidden function reached by any route: its stub reported the trip, or the
    broker saw the rank make a collective of a forbidden kind the reference never makes."""
    for notes in mine.notes:
        for note in notes:
            if note.startswith("tripped: "):
                raise Tripwire(note.removeprefix("tripped: "))
    from parakit.grading import kind_of
    theirs_kinds = {c.op for calls in theirs.calls for c in calls}
    kinds = {kind_of(f.__name__): why for f, why in forbid.items()   # c10d's own calls (not wrappers of them)
             if getattr(f, "__module__", "") == "torch.distributed.distributed_c10d" and kind_of(f.__name__) in _KINDS}
    for rank, calls in enumerate(mine.calls):
        for c in calls:
            if c.op in kinds and c.op not in theirs_kinds:
                raise Tripwire(f"rank {rank}: {name} made a {c.op} (seen by the judge's relay), which this exercise "
                               f"forbids: {kinds[c.op]}")


_KINDS = {"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter",
          "barrier", "send", "recv"}


def _raise_error(got: dict, where: str) -> None:
    if "error" in got:
        cls = Tripwire if got.get("tripwire") else AssertionError
        raise cls(f"{where}: raised {got['error']}")


# ---------------------------------------------------------------------------- a notebook

def _cell_key(label: str, source: str, student: bool) -> tuple:
    """A prelude cell as the solution's run and a student's share it: a setup statement by
    its label and source (one label holds a cell's several statements), an answer by label."""
    return label, None if student else source


class Judge:
    """Grades submissions of one lesson against its solution notebook (see the module)."""

    def __init__(self, solution, config: JudgeConfig):
        self.config = config
        self.cells = [c for c in solution.cells if c.cell_type == "code"]
        self.tests = {meta(c)["grade_id"]: c for c in self.cells if meta(c).get("grade")}
        self.answers = {meta(c)["grade_id"]: c for c in self.cells if meta(c).get("solution") and not meta(c).get("grade")}
        self.points = {g: float(meta(c).get("points", 0)) for g, c in self.tests.items()}
        self.answer_names = set().union(*(defined_names(parse(c.source)) for c in self.answers.values())) \
            if self.answers else set()
        self._runners: tuple[Runner, Runner] | None = None
        self.cache: dict = {}
        self._cell_seconds: dict | None = None  # the solution's own cells' times (cell_limits)

    def close(self):
        for runner in self._runners or ():
            runner.close()
        self._runners = None

    def runners(self) -> tuple[Runner, Runner]:
        if self._runners is None:
            self._runners = (Runner(self.config), Runner(self.config))
        return self._runners

    def _layout(self, answers: dict[str, str]):
        """The cells a student's rank runs: the instructor's setup statements first (before
        the rank is locked), then the answer cells in notebook order, as (label, source,
        student); and the setup alone, as (cell index, source)."""
        trees = []
        for index, cell in enumerate(self.cells):
            gid = meta(cell).get("grade_id")
            if gid in self.tests or gid in self.answers:
                continue
            trees.append((index, parse(cell.source)))
        needed = set().union(*(used_names(parse(s)) for s in [*answers.values(), *(c.source for c in self.tests.values())]))
        setup = setup_statements(trees, needed | self.answer_names)
        cells = [(f"<setup cell {i}>", s, False) for i, s in setup]
        for cell in self.cells:
            gid = meta(cell).get("grade_id")
            if gid in self.answers and gid in answers:
                cells.append((f"<answer {gid}>", python_source(answers[gid]), True))
        return cells, setup

    def _cells_job(self, cells) -> sandbox.Job:
        return sandbox.Job(cloudpickle.dumps((int, [])), True, list(cells), b"", True, self.config.hidden,
                           report_cells=True)

    def cell_limits(self, cells) -> list[float]:
        """Each cell's limit: REFERENCE_TIMES the solution's own time for the same cell (its
        setup run with its answers, once per judge, on the reference's runner), at least the
        config's cell_floor, at most its cell_timeout (also for a cell the solution lacks).
        A loaded machine slows the solution's cells too; a hung answer costs the floor, not
        the whole cell timeout."""
        if self._cell_seconds is None:
            mine, _ = self._layout({gid: cell.source for gid, cell in self.answers.items()})
            run = self.runners()[0].run(self._cells_job(mine), 1, self.config.cell_timeout, per_note=True)
            self._cell_seconds = dict(zip([_cell_key(*c) for c in mine], run.note_seconds))
        most, least = self.config.cell_timeout, self.config.cell_floor
        return [min(most, max(least, REFERENCE_TIMES * self._cell_seconds[_cell_key(*c)]))
                if _cell_key(*c) in self._cell_seconds else most for c in cells]

    def prelude(self, cells) -> tuple[list, list[str]]:
        """Run the cells once, alone, each within its `cell_limits`: answer cells that never
        return or kill their process are left out of every later run (and said so)."""
        runner = self.runners()[1]
        skipped, notes = set(), []
        while True:
            kept = [(i, c) for i, c in enumerate(cells) if i not in skipped]
            limits = self.cell_limits([c for _, c in kept])
            run = runner.run(self._cells_job([c for _, c in kept]), 1, limits, per_note=True)
            done = sum(1 for n in run.notes[0] if n.startswith("cell "))
            if run.failure is None or done >= len(kept):
                break
            index, (label, _, student) = kept[done]
            skipped.add(index)
            what = label.strip("<>").removeprefix("answer ")
            notes.append(f"{what}: the answer cell timed out (no return within {limits[done]:g} s); "
                         f"its tests score 0" if "did not finish" in run.failure else
                         f"{what}: the answer cell killed its process (the kernel died: os._exit, a crash or "
                         f"out of memory); its tests score 0")
            if not student:
                break
        kept = [c for i, c in enumerate(cells) if i not in skipped]
        for note in run.notes[0]:
            index, _, error = note.removeprefix("cell ").partition(" error ")
            if error and kept[int(index)][2]:
                notes.append(f"{kept[int(index)][0].strip('<>').removeprefix('answer ')}: the answer cell raised {error}")
        return kept, notes

    def grade(self, submission) -> tuple[list[Verdict], list[str]]:
        """Every test of the solution, judged on the submission's answer cells."""
        from parakit import grading
        answers = {meta(c)["grade_id"]: c.source for c in submission.cells
                   if c.cell_type == "code" and meta(c).get("grade_id") in self.answers}
        cells, setup = self._layout(answers)
        cells, notes = self.prelude(cells)
        notes += [line for gid, source in answers.items() for line in self.definitions(gid, source)]
        namespace = {"__name__": "__main__", "__builtins__": builtins}
        for name in self.answer_names:
            namespace[name] = StudentName((name,))
        for index, source in setup:
            with contextlib.suppress(Exception):
                exec(compile(source, f"<setup cell {index}>", "exec"), namespace)
        for name in self.answer_names:
            namespace[name] = StudentName((name,))
        kept = [python_source(c.source) for c in [*self.tests.values(), *self.answers.values()]]
        sealed = Sealed(*self.runners(), cells, self.config.hidden, self.cache,
                        [source for _, source, student in cells if not student] + kept, self.config.cell_floor)
        verdicts = []
        for gid, cell in self.tests.items():
            seed = int(hashlib.sha256(f"{self.config.salt}/{gid}".encode()).hexdigest()[:12], 16)
            random.seed(seed)
            torch.manual_seed(seed)
            grading.SEALED[:] = [sealed]
            try:
                with contextlib.redirect_stdout(io.StringIO()):  # what a test cell prints is for the student's kernel
                    exec(compile(python_source(cell.source), f"<test {gid}>", "exec"), namespace)
                verdicts.append(Verdict(gid, self.points[gid], self.points[gid]))
            except Exception as error:  # noqa: BLE001: any failure of a test cell fails it
                verdicts.append(Verdict(gid, 0.0, self.points[gid], f"{type(error).__name__}: {error}"[:3000]))
            finally:
                grading.SEALED.clear()
        notes += self.copies(answers, sealed.references)
        if self.runners()[1].unsealed:
            notes.append(f"NOT SEALED: the student's code ran without the operating system's walls "
                         f"({self.runners()[1].unsealed}); only the in-process jail held it")
        return verdicts, notes

    def definitions(self, gid: str, source: str) -> list[str]:
        """Report lines for what the solution's answer cell defines that this one does not,
        or defines with other parameters."""
        mine = {d.name: d for d in parse(source).body if isinstance(d, (ast.FunctionDef, ast.ClassDef))}
        lines = []
        for want in parse(self.answers[gid].source).body:
            if not isinstance(want, (ast.FunctionDef, ast.ClassDef)):
                continue
            got = mine.get(want.name)
            expected = f"{'class' if isinstance(want, ast.ClassDef) else 'def'} {want.name}{signature(want)}"
            if got is None:
                lines.append(f"{gid}: the answer cell does not define {want.name} (expected {expected})")
            elif isinstance(want, ast.FunctionDef) and signature(got) != signature(want):
                lines.append(f"{gid}: {want.name} is defined as {want.name}{signature(got)}; expected {expected}")
        return lines

    def copies(self, answers: dict[str, str], references) -> list[str]:
        """Report lines for answers whose syntax tree is close to the reference's."""
        import inspect
        sources = [c.source for c in self.answers.values()]
        for ref in references:
            with contextlib.suppress(TypeError, OSError):
                if getattr(ref, "__module__", "").startswith("parakit"):
                    sources.append(inspect.getsource(ref))
        refs = [shape(s) for s in sources]
        lines = []
        for gid, source in answers.items():
            mine = shape(source)
            if len(mine) < 12:
                continue
            best = max((difflib.SequenceMatcher(None, mine, r, autojunk=False).ratio() for r in refs if r), default=0)
            if best >= 0.8:
                lines.append(f"{gid}: close to the reference's code (similarity {best:.2f}): copied? (reported, not scored)")
        return lines
