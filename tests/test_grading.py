"""parakit.grading: the checks behind every lesson's test cells, and their tripwires."""
import threading

import pytest
import torch
import torch.distributed as dist

import parakit
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


# ---------------------------------------------------------------- same_traffic

def sum_through_rank_0(tensor):
    """Right values, wrong algorithm: everyone sends to rank 0, which sends the sum back."""
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        for peer in range(1, n):
            incoming = torch.empty_like(tensor)
            dist.recv(incoming, peer)
            tensor += incoming
        for peer in range(1, n):
            dist.send(tensor, peer)
    else:
        dist.send(tensor, 0)
        dist.recv(tensor, 0)
    return tensor


def ring_passing_whole_tensors(tensor):
    """Right values and neighbours, too many bytes: the whole tensor goes around the ring."""
    rank, n = dist.get_rank(), dist.get_world_size()
    passing, total = tensor.clone(), tensor.clone()
    for _ in range(n - 1):
        incoming = torch.empty_like(passing)
        request = dist.isend(passing, (rank + 1) % n)
        dist.recv(incoming, (rank - 1) % n)
        request.wait()
        passing = incoming
        total += incoming
    return tensor.copy_(total)


def ring_with_remainder_last(tensor):
    """A right ring whose last chunk takes the remainder (parakit's first chunks do): the
    ranks send other bytes each than parakit's ring, the same bytes in all."""
    n, rank = dist.get_world_size(), dist.get_rank()
    flat = tensor.reshape(-1).clone()
    sizes = [flat.numel() // n] * n
    sizes[-1] += flat.numel() % n
    chunks = flat.split(sizes)
    for phase, moves in comm.ring_schedule(n):
        send, recv = (chunks[i] for i in moves[rank])
        incoming = torch.empty_like(recv)
        request = dist.isend(send, (rank + 1) % n)
        dist.recv(incoming, (rank - 1) % n)
        request.wait()
        recv.add_(incoming) if phase == "reduce-scatter" else recv.copy_(incoming)
    return tensor.copy_(flat.view_as(tensor))


def bytes_sent_each_way(tensor):
    with comm.CommLog() as mine:
        ring_with_remainder_last(tensor.clone())
    with comm.CommLog() as theirs:
        comm.ring_all_reduce(tensor.clone())
    return mine.wire_bytes(), theirs.wire_bytes()


def sum_with_reduce_and_broadcast(tensor):
    dist.reduce(tensor, 0)
    dist.broadcast(tensor, 0)
    return tensor


def odd_vector(r):
    return (r.randn(4 * r.randint(1, 5) + 3),)


def test_same_traffic_passes_a_ring_that_splits_the_bytes_over_ranks_differently(capsys):
    mine, theirs = zip(*parakit.launch(bytes_sent_each_way, torch.ones(4 * 5 + 3), world_size=4))
    assert mine != theirs and sum(mine) == sum(theirs)  # the case the check must let through
    grading.check(ring_with_remainder_last, comm.ring_all_reduce, odd_vector, world_sizes=[4], same_traffic=True)
    assert "passed: ring_with_remainder_last" in capsys.readouterr().out


def test_same_traffic_fails_a_gather_to_rank_0_written_with_send_and_recv():
    grading.check(sum_through_rank_0, comm.ring_all_reduce, odd_vector, world_sizes=[4], quiet=True)  # values agree
    with pytest.raises(AssertionError, match=r"sum_through_rank_0 on 4 ranks, trial 1 \(seed \d+\), rank 0: it sent "
                                             r"to ranks \[1, 2, 3\]; the reference only sent to \[1\]"):
        grading.check(sum_through_rank_0, comm.ring_all_reduce, odd_vector, world_sizes=[4], same_traffic=True)


def test_same_traffic_fails_a_ring_that_sends_more_bytes_in_all():
    with pytest.raises(AssertionError, match=r"the ranks sent (\d|,)+ bytes in all; the reference sends (\d|,)+"):
        grading.check(ring_passing_whole_tensors, comm.ring_all_reduce, odd_vector, world_sizes=[4],
                      same_traffic=True)


def test_same_traffic_fails_other_collectives_naming_both_sets():
    with pytest.raises(AssertionError, match=r"rank 0: it called broadcast x1, reduce x1; the reference calls "
                                             r"all_gather x1, reduce_scatter x1"):
        grading.check(sum_with_reduce_and_broadcast, comm.all_reduce_two_phase, odd_vector, world_sizes=[2],
                      same_traffic=True)
