"""parakit.grading: the checks behind every lesson's test cells, and their tripwires."""
import threading

import pytest
import torch.distributed as dist

from parakit import comm, grading


def reference_sum(tensor):
    dist.all_reduce(tensor)
    return tensor


def random_vector(r):
    return (r.randn(r.randint(1, 30)),)


def wrong_sum(tensor):
    return tensor * dist.get_world_size()


def sum_with_all_reduce(tensor):
    dist.all_reduce(tensor)
    return tensor


def sum_with_parakit(tensor):
    return comm.ring_all_reduce(tensor)


def sum_catching_tripwire(tensor):
    try:
        dist.all_reduce(tensor)
    except AssertionError:
        pass
    return tensor


def test_check_passes_a_right_answer_and_says_so(capsys):
    grading.check(comm.ring_all_reduce, reference_sum, random_vector, world_sizes=[2, 3])
    assert "passed: ring_all_reduce matches the reference on 2, 3 ranks" in capsys.readouterr().out


def test_check_fails_a_wrong_answer_naming_rank_and_seed():
    with pytest.raises(AssertionError, match=r"wrong_sum on 2 ranks, rank \d, trial 1 \(seed \d+\)"):
        grading.check(wrong_sum, reference_sum, random_vector, world_sizes=[2])


def test_check_fails_a_wrong_type():
    with pytest.raises(AssertionError, match="returned a list, expected a Tensor"):
        grading.check(lambda t: t.tolist(), reference_sum, random_vector, world_sizes=[2])


def inputs_agree_in_shape_differ_in_values(tensor):
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, tensor.tolist())
    assert len({len(values) for values in seen}) == 1, seen
    assert seen[0] != seen[1], seen
    return tensor


def test_inputs_share_shapes_but_not_values_across_ranks():
    # passes only if every rank drew the same size, different values, and both functions got equal copies
    grading.check(inputs_agree_in_shape_differ_in_values, lambda t: t, random_vector, world_sizes=[3], quiet=True)


@pytest.mark.parametrize("student", [sum_with_all_reduce, sum_with_parakit, sum_catching_tripwire])
def test_tripwire_fails_a_student_who_calls_the_finished_thing(student):
    forbid = {dist.all_reduce: "build it from send and recv", comm.ring_all_reduce: "write your own"}
    with pytest.raises(grading.Tripwire, match=f"{student.__name__} called .*which this exercise forbids"):
        grading.check(student, reference_sum, random_vector, world_sizes=[2], forbid=forbid)


def test_tripwire_does_not_fire_for_the_reference():
    forbid = {dist.all_reduce: "build it from send and recv"}
    grading.check(comm.ring_all_reduce, reference_sum, random_vector, world_sizes=[2], forbid=forbid, quiet=True)


def test_check_reports_a_hanging_student_within_the_timeout():
    def hangs(tensor):
        if dist.get_rank() == 0:
            dist.all_reduce(tensor)
        return tensor

    with pytest.raises(AssertionError, match="(?s)hangs failed on 2 ranks.*rank 0 waits in all_reduce #2"):
        grading.check(hangs, reference_sum, random_vector, world_sizes=[2], timeout=20)


def test_check_local_compares_and_trips():
    grading.check_local(lambda a, b: a + b, lambda a, b: a + b, [(1.0, 2.0), (3.5, 4.0)], quiet=True)
    with pytest.raises(AssertionError, match=r"<lambda>\(1.0, 2.0\)"):
        grading.check_local(lambda a, b: a - b, lambda a, b: a + b, [(1.0, 2.0)], quiet=True)
    with pytest.raises(grading.Tripwire, match="ring_bytes"):
        grading.check_local(lambda m, n: float(comm.ring_bytes("all_reduce", m, n)), lambda m, n: 2 * (n - 1) / n * m,
                            [(1024, 4)], forbid={comm.ring_bytes: "use the formula"})


def test_tripwire_sees_calls_from_threads_the_student_starts():
    def in_a_thread(m, n):
        results = []

        def work():
            try:
                results.append(float(comm.ring_bytes("all_reduce", m, n)))
            except grading.Tripwire:  # caught in the thread: the check still fails
                pass

        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
        return results[0] if results else 0.0

    with pytest.raises(grading.Tripwire, match="ring_bytes"):
        grading.check_local(in_a_thread, lambda m, n: 2 * (n - 1) / n * m, [(1024, 4)],
                            forbid={comm.ring_bytes: "use the formula"})
    assert threading.getprofile() is None
