"""The allowlist (`parakit.grading.allow`): what of parakit a student's code may call, checked on
the caller, in a notebook's checks (real gloo ranks) and in the sealed judge's locked ranks."""
from __future__ import annotations

import functools
import sys

import cloudpickle
import pytest
import torch

from parakit import checkpoint, comm, grading
from parakit.grading import Tripwire, allow
from parakit.grading.judge import JudgeConfig, Runner, Sealed, StudentName

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this test file


# The student's answers, as a notebook's kernel holds them: compiled from a cell of their own (the
# cell calling a check, and what the reference reaches, are the instructor's).
CELL = '''
import functools, importlib
import torch
from parakit import checkpoint, comm

def ring_bytes(nbytes):
    return comm.ring_bytes("all_reduce", nbytes, 4)

def by_partial(nbytes):
    return functools.partial(comm.ring_bytes, "all_reduce")(nbytes, 4)

def by_import(nbytes):
    return getattr(importlib.import_module("parakit.comm"), "ring" + "_bytes")("all_reduce", nbytes, 4)

def by_map(nbytes):
    return next(map(functools.partial(comm.ring_bytes, "all_reduce", n=4), [nbytes]))

def by_torch(nbytes):
    """A torch function that takes a callable (pytree's map) calls the helper: still the student's call."""
    return torch.utils._pytree.tree_map(functools.partial(comm.ring_bytes, "all_reduce", n=4), [nbytes])[0]

def by_caught_trip(nbytes):
    try:
        return comm.ring_bytes("all_reduce", nbytes, 4)
    except AssertionError:
        return 2 * 3 * nbytes // 4

def own_count(nbytes):
    """An allowed class whose methods call parakit's helpers that the exercise does not allow."""
    with comm.CommLog() as log:
        pass
    return log.count() + 2 * 3 * nbytes // 4

def plain(nbytes):
    return 2 * 3 * nbytes // 4

def squares(x):
    return (x * x).sin().sum()

def through_checkpoint(x):
    """An allowed function whose autograd Function's backward the engine runs (not the student's call)."""
    x = x.clone().requires_grad_()
    checkpoint.checkpoint(torch.sin, x).sum().backward()
    return x.grad
'''
answers = {"__name__": "answers"}  # not importable: cloudpickle sends its functions by value
exec(compile(CELL, "/tmp/ipykernel_0/answers.py", "exec"), answers)
ring_bytes, by_partial, by_import, by_map, by_torch, by_caught_trip, own_count, plain, squares, through_checkpoint = (
    answers[n] for n in ("ring_bytes", "by_partial", "by_import", "by_map", "by_torch", "by_caught_trip", "own_count",
                         "plain", "squares", "through_checkpoint"))
# ... and a read-only cell of the instructor's helpers, which both the test and the reference call
helpers = {"__name__": "helpers", "comm": comm}
exec(compile("def logged(fn, nbytes):\n    with comm.CommLog() as log:\n        out = fn(nbytes)\n"
             "    return out + log.count()\n", "/tmp/ipykernel_0/helpers.py", "exec"), helpers)
logged = helpers["logged"]


def reference_bytes(nbytes):
    return comm.ring_bytes("all_reduce", nbytes, 4)


def reference_gradient(x):
    return torch.cos(x)


CASES = [(8,), (12,)]


@pytest.mark.parametrize("student", [ring_bytes, by_partial, by_import, by_map, by_torch, by_caught_trip])
def test_a_call_into_parakit_that_the_exercise_does_not_allow_trips_by_any_route(student):
    with pytest.raises(Tripwire, match=rf"{student.__name__} called parakit\.comm\.ring_bytes, which this exercise "
                                       r"does not let your code call \(it may call comm\.CommLog of parakit's\)"):
        grading.check_local(student, reference_bytes, CASES, allow=[comm.CommLog], quiet=True)


def test_what_the_exercise_allows_passes_with_the_helpers_it_uses_and_the_engines_backward():
    grading.check_local(ring_bytes, reference_bytes, CASES, allow=[comm.ring_bytes], quiet=True)
    grading.check_local(by_torch, reference_bytes, CASES, allow=[comm], quiet=True)   # a module allows its functions
    grading.check_local(own_count, reference_bytes, CASES, allow=[comm.CommLog], quiet=True)
    grading.check_local(through_checkpoint, reference_gradient, [(torch.randn(5),)], allow=[checkpoint.checkpoint],
                        quiet=True)
    with pytest.raises(Tripwire, match=r"parakit\.checkpoint\.checkpoint, which this exercise does not let"):
        grading.check_local(through_checkpoint, reference_gradient, [(torch.randn(5),)], allow=[], quiet=True)


def observed(step):
    """A test's probe around the student's function: the instructor's, it may use parakit."""
    def run(nbytes):
        with comm.CommLog() as log:
            return step(nbytes) + log.count()
    run.__name__ = step.__name__
    return run


def plain_logged(nbytes):
    return logged(plain, nbytes)


def ring_bytes_logged(nbytes):
    return logged(ring_bytes, nbytes)


def reference_logged(nbytes):
    return logged(reference_bytes, nbytes)


def test_in_a_notebook_the_tests_wrappers_and_the_helpers_the_reference_uses_are_the_instructors():
    """What parakit a test's probe or a helper cell calls is not the student's call; the answer's own call is."""
    grading.check_local(observed(plain), observed(reference_bytes), CASES, allow=[], quiet=True)
    grading.check_local(plain_logged, reference_logged, CASES, allow=[], quiet=True)
    grading.check_local(functools.partial(logged, plain), functools.partial(logged, reference_bytes), CASES, allow=[],
                        quiet=True)
    for wrapped, reference in ((observed(ring_bytes), observed(reference_bytes)), (ring_bytes_logged, reference_logged),
                               (functools.partial(logged, ring_bytes), functools.partial(logged, reference_bytes))):
        with pytest.raises(Tripwire, match=r"called parakit\.comm\.ring_bytes, which this exercise does not let your "
                                           r"code call \(it may call nothing of parakit's\): write that part yourself"):
            grading.check_local(wrapped, reference, CASES, allow=[], quiet=True)


def counted(fn):
    """A test's probe whose saved-tensor hooks (parakit's ledger) torch runs inside the student's ops."""
    def run(x):
        x = x.clone().requires_grad_()
        with checkpoint.counting_saved() as ledger:
            fn(x).backward()
        return x.grad, ledger.peak
    return run


def test_a_tests_probe_that_torch_runs_inside_the_students_ops_is_not_the_students_call():
    grading.check_local(counted(squares), counted(lambda x: (x * x).sin().sum()), [(torch.randn(6),)], allow=[],
                        quiet=True)


def test_a_distributed_check_gates_the_students_call_on_every_rank():
    grading.check(ring_bytes, reference_bytes, lambda r: (r.randint(1, 9),), world_sizes=[2], trials=1,
                  allow=[comm.ring_bytes], quiet=True)
    with pytest.raises(Tripwire, match=r"rank 0: by_partial called parakit\.comm\.ring_bytes"):
        grading.check(by_partial, reference_bytes, lambda r: (r.randint(1, 9),), world_sizes=[2], trials=1, allow=[],
                      quiet=True)


def test_a_check_without_an_allowlist_gates_nothing():
    grading.check_local(ring_bytes, reference_bytes, CASES, quiet=True)


def test_what_is_gated_is_everything_of_parakits_but_what_is_allowed_and_the_machine():
    every = allow.gated([])
    names = set(every.values())
    assert "parakit.comm.ring_bytes" in names and "parakit.comm.CommLog.count" in names
    assert not any(n.startswith(allow.ALWAYS) for n in names)
    assert "parakit.comm.CommLog.count" not in allow.gated([comm.CommLog]).values()
    assert not any(n.startswith("parakit.comm.") for n in allow.gated([comm]).values())


# ---------------------------------------------------------------------------- sealed

ANSWERS = '''
import threading, functools
from parakit import comm

def direct(nbytes):
    return comm.ring_bytes("all_reduce", nbytes, 4)

def in_a_thread(nbytes):
    out = []
    worker = threading.Thread(target=lambda: out.append(comm.ring_bytes("all_reduce", nbytes, 4)))
    worker.start()
    worker.join()
    return out[0]

def disguised(nbytes):
    scope = {"comm": comm}
    exec(compile("def f(n):\\n    return comm.ring_bytes('all_reduce', n, 4)", comm.__file__, "exec"), scope)
    return scope["f"](nbytes)

def caught(nbytes):
    try:
        return comm.ring_bytes("all_reduce", nbytes, 4)
    except BaseException:
        return 2 * 3 * nbytes // 4
'''


@pytest.fixture(scope="module")
def sealed():
    reference, student = Runner(JudgeConfig()), Runner(JudgeConfig())
    yield Sealed(reference, student, [("<answer a>", ANSWERS, True)], [], {}, [])
    reference.close()
    student.close()


def test_in_a_sealed_rank_the_allowed_helper_passes_and_the_rest_trips_the_judge_hears_of_it(sealed):
    sealed.check_local(StudentName(("direct",)), reference_bytes, CASES, allow=[comm.ring_bytes])
    for name in ("direct", "in_a_thread", "caught"):
        with pytest.raises(Tripwire, match=rf"{name} called parakit\.comm\.ring_bytes, which this exercise does not"):
            sealed.check_local(StudentName((name,)), reference_bytes, CASES, allow=[comm.CommLog])


def test_in_a_sealed_rank_code_under_parakits_file_name_is_refused(sealed):
    with pytest.raises(AssertionError, match=r"may not make code under the file name '.*parakit/comm\.py'"):
        sealed.check_local(StudentName(("disguised",)), reference_bytes, CASES, allow=[])


def test_a_sealed_check_without_an_allowlist_refuses_to_grade_in_one_line(sealed):
    """Not graded open: a right answer scores 0 there, and the instructor is told what to add."""
    for check in (lambda: sealed.check_local(StudentName(("direct",)), reference_bytes, CASES),
                  lambda: sealed.check(StudentName(("direct",)), reference_bytes, lambda r: (8,), world_sizes=(1,))):
        with pytest.raises(AssertionError, match=r"^direct: this exercise names no allowlist, so it is not graded: "
                                                 r"pass allow=\[\.\.\.\] to its check"):
            check()
