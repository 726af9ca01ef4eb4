"""Mutation testing of the graded checks (`python -m autograde.mutants`): each operator of autograde.mutations on
small sources, run (on 2 gloo ranks where it rewrites communication) against the source it mutated; then the
command on a fixture lesson (tests/fixtures/mutable.ipynb), graded for real: killed, survived, explained, not built,
and --list, which grades nothing."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import parakit
from conftest import REPO

sys.path.insert(0, str(REPO))
from autograde import mutants, mutations  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "mutable.ipynb"


def run_source(source: str, entry: str, *args):
    """`entry(*args)` of the module `source` (run on a rank by parakit.launch, or here)."""
    namespace = {"__name__": "mutant"}
    exec(compile(source, "<mutant>", "exec"), namespace)
    return namespace[entry](*args)


def on_two_ranks(source: str, entry: str, *args) -> list:
    return parakit.launch(run_source, source, entry, *args, world_size=2, timeout=30)


# ---------------------------------------------------------------------------- operators

RING_STEP = textwrap.dedent('''
    import torch
    import torch.distributed as dist


    def batched(x):
        """One ring step posted as a batch: x + rank sent right, the left neighbour's received."""
        rank, n = dist.get_rank(), dist.get_world_size()
        mine, incoming = x + rank, torch.empty_like(x)
        ops = [dist.P2POp(dist.isend, mine, (rank + 1) % n), dist.P2POp(dist.irecv, incoming, (rank - 1) % n)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        return incoming


    def posted(x):
        """The same step, its send and its receive posted apart, rank 0 sending first; an all-reduce in flight."""
        rank, n = dist.get_rank(), dist.get_world_size()
        mine, incoming, total = x + rank, torch.empty_like(x), x + rank
        work = dist.all_reduce(total, async_op=True)
        if rank == 0:
            sent = dist.isend(mine, (rank + 1) % n)
            received = dist.irecv(incoming, (rank - 1) % n)
        else:
            received = dist.irecv(incoming, (rank - 1) % n)
            sent = dist.isend(mine, (rank + 1) % n)
        sent.wait()
        received.wait()
        work.wait()
        if rank == 0:
            dist.isend(mine, 1).wait()
        else:
            dist.recv(incoming, 0)
        return incoming, total
''')


def test_blocking_waits_for_every_async_call_at_once_and_computes_the_same():
    assert mutations.sites(RING_STEP, "blocking") == [
        "line 11: dist.batch_isend_irecv(ops)", "line 20: dist.all_reduce(total, async_op=True)",
        "line 22: dist.isend(mine, (rank + 1) % n)", "line 23: dist.irecv(incoming, (rank - 1) % n)",
        "line 25: dist.irecv(incoming, (rank - 1) % n)", "line 26: dist.isend(mine, (rank + 1) % n)"]  # not line 31
    mutant = mutations.mutate(RING_STEP, "blocking")
    assert "sent = _waited(dist.isend(mine, (rank + 1) % n))" in mutant
    x = torch.arange(3.0)
    for entry in ("batched", "posted"):
        assert str(on_two_ranks(mutant, entry, x)) == str(on_two_ranks(RING_STEP, entry, x))


def test_separate_posts_posts_each_op_of_a_batch_by_itself_in_order():
    mutant = mutations.mutate(RING_STEP, "separate_posts")
    assert "for request in _posted_one_by_one(ops):" in mutant and "batch_isend_irecv(ops)" not in mutant
    x = torch.arange(3.0)
    assert str(on_two_ranks(mutant, "batched", x)) == str(on_two_ranks(RING_STEP, "batched", x))


def test_sends_and_receives_swapped_reverses_the_ops_and_swaps_adjacent_posts():
    where = mutations.sites(RING_STEP, "sends_and_receives_swapped")
    assert [s.split(":")[0] for s in where] == ["line 10", "line 22", "line 25"]
    mutant = mutations.mutate(RING_STEP, "sends_and_receives_swapped")
    assert "ops = [dist.P2POp(dist.irecv, incoming, (rank - 1) % n), dist.P2POp(dist.isend, mine" in mutant
    assert mutant.index("received = dist.irecv") < mutant.index("sent = dist.isend") < mutant.index("else:")
    x = torch.arange(3.0)
    for entry in ("batched", "posted"):
        assert str(on_two_ranks(mutant, entry, x)) == str(on_two_ranks(RING_STEP, entry, x))


SCATTER = textwrap.dedent('''
    import torch
    import torch.distributed as dist


    def scattered(x):
        """x + rank reduce-scattered, then broadcast from rank 0."""
        piece = torch.empty(x.numel() // dist.get_world_size())
        dist.reduce_scatter_tensor(piece, x + dist.get_rank())
        dist.broadcast(piece, src=0)
        return piece
''')


def test_all_reduce_and_slice_gives_each_rank_its_slice_of_the_sum():
    mutant = mutations.mutate(SCATTER, "all_reduce_and_slice")
    assert "_all_reduced_and_sliced(piece, x + dist.get_rank())" in mutant
    x = torch.arange(6.0)
    assert str(on_two_ranks(mutant, "scattered", x)) == str(on_two_ranks(SCATTER, "scattered", x))
    listed = mutant.replace("_all_reduced_and_sliced(piece, x + dist.get_rank())",
                            "_all_reduced_and_sliced(piece, list((x + dist.get_rank()).chunk(2)))")
    assert str(on_two_ranks(listed, "scattered", x)) == str(on_two_ranks(SCATTER, "scattered", x))  # reduce_scatter


def test_broadcast_removed_leaves_each_rank_what_it_had():
    mutant = mutations.mutate(SCATTER, "broadcast_removed")
    assert "_not_sent(piece, src=0)" in mutant
    x = torch.arange(4.0)
    same, mine = on_two_ranks(SCATTER, "scattered", x), on_two_ranks(mutant, "scattered", x)
    assert torch.equal(same[0], same[1]) and torch.equal(mine[0], same[0])
    assert torch.equal(same[1], torch.tensor([1.0, 3.0])) and torch.equal(mine[1], torch.tensor([5.0, 7.0]))  # its own


def test_rng_not_restored_makes_fork_rng_a_null_context_and_set_state_a_no_op():
    source = textwrap.dedent('''
        import torch


        def sample():
            state = torch.get_rng_state()
            a = torch.rand(3)
            torch.set_rng_state(state)
            b = torch.rand(3)
            with torch.random.fork_rng():
                torch.rand(5)
            return torch.equal(a, b), torch.rand(3)
    ''')
    assert [s.split(":")[0] for s in mutations.sites(source, "rng_not_restored")] == ["line 8", "line 10"]
    torch.manual_seed(0)
    same, after = run_source(source, "sample")
    torch.manual_seed(0)
    assert run_source(mutations.mutate(source, "rng_not_restored", 0), "sample")[0] is False and same
    torch.manual_seed(0)
    _, moved = run_source(mutations.mutate(source, "rng_not_restored", 1), "sample")
    assert not torch.equal(after, moved)  # the 5 numbers drawn inside are not given back


def test_finally_removed_runs_the_finally_block_unless_the_try_statement_raises():
    source = textwrap.dedent('''
        def guarded(log, fail):
            try:
                if fail:
                    raise ValueError(fail)
                return "done"
            finally:
                log.append("cleaned")
    ''')
    mutant, log = mutations.mutate(source, "finally_removed"), []
    assert run_source(mutant, "guarded", log, False) == "done" and log == ["cleaned"]
    with pytest.raises(ValueError):
        run_source(mutant, "guarded", log, True)
    try:
        raise KeyError("handled by the caller")
    except KeyError:
        assert run_source(mutant, "guarded", log, False) == "done"  # inside a handler: cleaned still
    assert log == ["cleaned", "cleaned"]


def test_buffer_kept_removes_del_resize_and_none_assignments_inside_the_solution_only():
    source = textwrap.dedent('''
        import types
        import torch


        def freed(n):
            held = torch.ones(n)
            del held
            ### BEGIN SOLUTION
            big = torch.ones(n)
            total, copy, box = big.sum(), big.clone(), types.SimpleNamespace(t=big)
            copy.untyped_storage().resize_(0)
            box.t = None
            del big
            ### END SOLUTION
            return total, copy.untyped_storage().nbytes(), box.t is None
    ''')
    assert [s.split(":")[0] for s in mutations.sites(source, "buffer_kept")] == ["line 12", "line 13", "line 14"]
    assert run_source(source, "freed", 4) == (4.0, 0, True)
    assert run_source(mutations.mutate(source, "buffer_kept"), "freed", 4) == (4.0, 16, False)
    assert run_source(mutations.mutate(source, "buffer_kept", 1), "freed", 4) == (4.0, 0, False)


def test_whole_reads_reads_the_rest_and_returns_the_same_bytes(tmp_path):
    source = textwrap.dedent('''
        import os


        def ranged(path, offset, n):
            with open(path, "rb") as f:
                f.seek(offset)
                first, second = f.read(n), f.read(n)
            fd = os.open(path, os.O_RDONLY)
            try:
                return first, second, os.pread(fd, n, offset), f.closed
            finally:
                os.close(fd)
    ''')
    (tmp_path / "data.bin").write_bytes(bytes(range(100)))
    mutant = mutations.mutate(source, "whole_reads")
    assert "first, second = (_read_rest_and_sliced(f, n), _read_rest_and_sliced(f, n))" in mutant
    assert "_pread_rest_and_sliced(fd, n, offset)" in mutant
    for offset, n in ((10, 7), (95, 10)):
        assert run_source(mutant, "ranged", tmp_path / "data.bin", offset, n) == \
            run_source(source, "ranged", tmp_path / "data.bin", offset, n)


def test_replicas_in_a_loop_runs_parallel_apply_and_threads_in_the_callers_thread():
    source = textwrap.dedent('''
        import threading
        import torch
        from parakit import dp


        def applied(x):
            devices = [torch.device("cpu", 0), torch.device("cpu", 1)]
            outputs = dp.parallel_apply([torch.nn.Identity(), torch.nn.Tanh()], [(x,), (x,)], devices)
            seen = []
            thread = threading.Thread(target=lambda: seen.append(threading.get_ident()))
            thread.start()
            thread.join()
            return outputs, seen == [threading.get_ident()]
    ''')
    x = torch.linspace(-2, 2, 5)
    outputs, here = run_source(source, "applied", x)
    mutant_outputs, mutant_here = run_source(mutations.mutate(source, "replicas_in_a_loop"), "applied", x)
    assert [torch.equal(a, b) for a, b in zip(outputs, mutant_outputs)] == [True, True]
    assert (here, mutant_here) == (False, True)


def test_a_helper_is_student_code_it_never_imports_parakit():
    for name in mutations.OPERATORS:
        helpers = mutations.mutate("import torch\n", name)
        assert "parakit" not in helpers, name


# ---------------------------------------------------------------------------- the command, graded

def test_every_mutant_of_the_course_catalog_builds_on_the_solutions_as_they_are():
    """The committed catalog (autograde/mutants.toml) against today's solutions: a hand mutant
    whose old text an edit of its answer cell moved, or that no longer compiles, is named
    here, not first in a long mutation run."""
    import nbformat
    import tomllib
    catalog = tomllib.loads((REPO / "autograde" / "mutants.toml").read_text())
    built = {lesson: mutants.build(lesson, nbformat.read(REPO / "solutions" / f"{lesson}.ipynb", as_version=4), catalog)
             for lesson in sorted({entry["lesson"] for entry in catalog["hand"]})}
    assert [f"{m.lesson} {m.student}: {m.problem}" for ms in built.values() for m in ms if m.problem] == []
    assert sum(len(ms) for ms in built.values()) >= len(catalog["hand"])


CATALOG = '''
[[hand]]
lesson = "mutable"
exercise = "add"
name = "subtracted"
what = "a - b: a value that changes"
old = "return a + b"
new = "return a - b"

[[hand]]
lesson = "mutable"
exercise = "add"
name = "commuted"
what = "b + a"
old = "return a + b"
new = "return b + a"

[[hand]]
lesson = "mutable"
exercise = "add"
name = "broken"
what = "a line that does not compile"
old = "return a + b"
new = "return a +"

[[hand]]
lesson = "mutable"
exercise = "no_such"
name = "elsewhere"
what = "a mutant of an answer cell the lesson lacks"
old = "x"
new = "y"

[survivors.mutable.sum_of_squares]
buffer_kept = "the exercise says the list may be freed: keeping it is allowed"
'''


def mutants_command(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m autograde.mutants` on the fixture lesson, its catalog and table in `tmp`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "autograde.mutants", "--solutions", str(tmp / "solutions"),
                           "--catalog", str(tmp / "catalog.toml"), "--table", str(tmp / "MUTANTS.md"), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def lesson(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("mutants")
    (tmp / "solutions").mkdir()
    shutil.copyfile(FIXTURE, tmp / "solutions" / "mutable.ipynb")
    (tmp / "catalog.toml").write_text(CATALOG)
    return tmp


@pytest.fixture(scope="module")
def graded(lesson) -> subprocess.CompletedProcess:
    return mutants_command(lesson, "--out", str(lesson / "out"))


def printed(run: subprocess.CompletedProcess, student: str) -> list[str]:
    return [line.strip() for line in run.stdout.splitlines() if line.strip().startswith(student + ":")]


@pytest.mark.timeout(900)
def test_a_value_changing_and_a_technique_changing_mutant_are_killed(graded):
    assert printed(graded, "add.subtracted") == ["add.subtracted: killed: test_add (AssertionError: add(1, 2): the "
                                                 "result is -1, the reference's 3)"], graded.stdout + graded.stderr
    assert printed(graded, "with_precision.finally_removed")[0].startswith(
        "with_precision.finally_removed: killed: test_with_precision"), graded.stdout


def test_an_unexplained_survivor_fails_the_run_and_is_named(graded):
    assert graded.returncode == 1
    assert graded.stdout.splitlines()[-1] == ("mutable add.commuted: SURVIVED, NOT EXPLAINED: a test to kill it, or "
                                              "a line in the catalog")


def test_an_explained_survivor_is_listed_with_its_line(graded, lesson):
    line = "the exercise says the list may be freed: keeping it is allowed"
    assert printed(graded, "sum_of_squares.buffer_kept") == [f"sum_of_squares.buffer_kept: survived: {line}"]
    assert f"| sum_of_squares | buffer_kept | line 6: del squares | survived: {line} |" in \
        (lesson / "MUTANTS.md").read_text()


def test_a_mutant_that_cannot_be_built_is_one_line_and_the_rest_is_graded(graded, lesson):
    assert printed(graded, "add.broken") == ["add.broken: not built: the mutated cell does not compile: "
                                             "invalid syntax (line 4)"]
    assert printed(graded, "no_such.elsewhere") == ["no_such.elsewhere: not built: no answer cell no_such in mutable"]
    table = (lesson / "MUTANTS.md").read_text()
    for row in ("| add | 2 | 1 | 1 | 1 |", "| with_precision | 1 | 1 | 0 | 0 |", "| sum_of_squares | 1 | 0 | 1 | 0 |",
                "| no_such | 0 | 0 | 0 | 1 |"):
        assert row in table, table


def test_the_solution_is_graded_whole_and_each_mutant_up_to_its_tests(lesson, graded):
    """The control has every cell; add's mutants stop after test_add (the tests after it score 0 unseen)."""
    report = (lesson / "out" / "mutable" / "grades" / "report.txt").read_text()
    assert "solution         mutable                4/4" in report, report
    assert "missing test cells, scored 0: test_with_precision (2 pt), test_sum_of_squares (1 pt)" in report


@pytest.mark.timeout(900)
def test_with_every_survivor_explained_the_run_passes_and_replaces_its_section(lesson, graded):
    again = mutants_command(lesson, "--exercise", "sum_of_squares")
    assert again.returncode == 0, again.stdout + again.stderr
    table = (lesson / "MUTANTS.md").read_text()
    assert table.count("## mutable") == 1 and "--exercise sum_of_squares: 1 mutant and the solution" in table
    assert "| add |" not in table


def test_list_prints_the_mutants_and_grades_nothing(lesson, capsys):
    assert mutants.main(["--list", "--solutions", str(lesson / "solutions"), "--catalog", str(lesson / "catalog.toml"),
                         "--table", str(lesson / "listed.md"), "--out", str(lesson / "listed")]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "mutable add.subtracted: a - b: a value that changes",
        "mutable add.commuted: b + a",
        "mutable add.broken: not built: the mutated cell does not compile: invalid syntax (line 4)",
        "mutable with_precision.finally_removed: line 6: try:",
        "mutable sum_of_squares.buffer_kept: line 6: del squares",
        "mutable no_such.elsewhere: not built: no answer cell no_such in mutable"]
    assert not (lesson / "listed").exists() and not (lesson / "listed.md").exists()


def test_an_operator_that_does_not_exist_is_refused_with_the_list(lesson):
    with pytest.raises(SystemExit, match="--operator blocked: no such operator or hand-written mutant; the operators "
                                         "are blocking, separate_posts,"):
        mutants.main(["--list", "--operator", "blocked", "--solutions", str(lesson / "solutions"),
                      "--catalog", str(lesson / "catalog.toml")])


def test_an_exercise_without_a_mutant_is_listed_with_its_reason_or_as_lacking_one():
    catalog = {"unmutated": {"mutable": {"add": "a function of its arguments: its value is graded"}}}
    built = mutants.Mutant("mutable", "sum_of_squares", "buffer_kept", "buffer_kept", "line 6: del squares")
    bare = mutants.unmutated("mutable", ["add", "with_precision", "sum_of_squares"], [built], catalog)
    assert bare == {"add": "a function of its arguments: its value is graded", "with_precision": ""}
    text = mutants.section("mutable", ["add", "with_precision", "sum_of_squares"], [built], "Run on ...", bare)
    assert "- add: a function of its arguments: its value is graded" in text
    assert "- with_precision: NO REASON: a mutant to write, or a line in the catalog" in text
    assert "| add | 0 | 0 | 0 | 0 |" in text and "| sum_of_squares | buffer_kept |" in text


@pytest.mark.timeout(900)
def test_a_sample_of_a_real_lessons_mutants_is_killed_the_device_generators_on_the_gpu_box(tmp_path):
    """CI's sample of the course's own mutants: lesson 05's checkpoint under rng_not_restored, graded by the command
    as it grades the course (the solution too): all sites at once, then each alone. Each loses the exercise's points,
    the device generator's restore (-3) too, which survived while every graded rank ran on the CPU: the emulated GPU
    box's hidden case has dropout draw from that generator."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-m", "autograde.mutants", "--lesson", "05", "--exercise", "my_checkpoint",
                          "--operator", "rng_not_restored", "--table", str(tmp_path / "MUTANTS.md"),
                          "--out", str(tmp_path / "out")], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    outcomes = [line.strip().split(": ")[:2] for line in run.stdout.splitlines() if "rng_not_restored" in line]
    assert outcomes == [[f"my_checkpoint.rng_not_restored{site}", "killed"] for site in ("", "-1", "-2", "-3")], \
        run.stdout
    assert "| my_checkpoint | 4 | 4 | 0 | 0 |" in (tmp_path / "MUTANTS.md").read_text()
