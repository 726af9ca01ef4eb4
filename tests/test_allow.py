"""The allowlist (`parakit.grading.allow`): what of parakit a student's code may call, checked on
the caller, in a notebook's checks (real gloo ranks) and in the sealed judge's locked ranks."""
from __future__ import annotations

import functools
import importlib
import sys

import cloudpickle
import pytest
import torch

from parakit import checkpoint, comm, grading
from parakit.grading import Tripwire, allow
from parakit.grading.judge import JudgeConfig, Runner, Sealed, StudentName

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this test file


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


def through_checkpoint(x):
    """An allowed function whose autograd Function's backward the engine runs (not the student's call)."""
    x = x.clone().requires_grad_()
    checkpoint.checkpoint(torch.sin, x).sum().backward()
    return x.grad


CASES = [(8,), (12,)]


@pytest.mark.parametrize("student", [ring_bytes, by_partial, by_import, by_map, by_torch, by_caught_trip])
def test_a_call_into_parakit_that_the_exercise_does_not_allow_trips_by_any_route(student):
    with pytest.raises(Tripwire, match=rf"{student.__name__} called parakit\.comm\.ring_bytes, which this exercise "
                                       r"does not let your code call \(it may call comm\.CommLog of parakit's\)"):
        grading.check_local(student, ring_bytes, CASES, allow=[comm.CommLog], quiet=True)


def test_what_the_exercise_allows_passes_with_the_helpers_it_uses_and_the_engines_backward():
    grading.check_local(ring_bytes, ring_bytes, CASES, allow=[comm.ring_bytes], quiet=True)
    grading.check_local(by_torch, ring_bytes, CASES, allow=[comm], quiet=True)   # a module allows its functions
    grading.check_local(own_count, ring_bytes, CASES, allow=[comm.CommLog], quiet=True)
    grading.check_local(through_checkpoint, through_checkpoint, [(torch.randn(5),)], allow=[checkpoint.checkpoint],
                        quiet=True)
    with pytest.raises(Tripwire, match=r"parakit\.checkpoint\.checkpoint, which this exercise does not let"):
        grading.check_local(through_checkpoint, through_checkpoint, [(torch.randn(5),)], allow=[], quiet=True)


def test_a_distributed_check_gates_the_students_call_on_every_rank():
    grading.check(ring_bytes, ring_bytes, lambda r: (r.randint(1, 9),), world_sizes=[2], trials=1,
                  allow=[comm.ring_bytes], quiet=True)
    with pytest.raises(Tripwire, match=r"rank 0: by_partial called parakit\.comm\.ring_bytes"):
        grading.check(by_partial, ring_bytes, lambda r: (r.randint(1, 9),), world_sizes=[2], trials=1, allow=[],
                      quiet=True)


def test_a_check_without_an_allowlist_gates_nothing():
    grading.check_local(ring_bytes, ring_bytes, CASES, quiet=True)


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
    sealed.check_local(StudentName(("direct",)), ring_bytes, CASES, allow=[comm.ring_bytes])
    for name in ("direct", "in_a_thread", "caught"):
        with pytest.raises(Tripwire, match=rf"{name} called parakit\.comm\.ring_bytes, which this exercise does not"):
            sealed.check_local(StudentName((name,)), ring_bytes, CASES, allow=[comm.CommLog])


def test_in_a_sealed_rank_code_under_parakits_file_name_is_refused(sealed):
    with pytest.raises(AssertionError, match=r"may not make code under the file name '.*parakit/comm\.py'"):
        sealed.check_local(StudentName(("disguised",)), ring_bytes, CASES, allow=[])


def test_a_sealed_check_without_an_allowlist_gates_nothing(sealed):
    sealed.check_local(StudentName(("direct",)), ring_bytes, CASES)
