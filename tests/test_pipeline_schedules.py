"""parakit.pipeline's schedules on paper: the builders' action orders, the simulator's
bubble (exactly the formulas, in integer time units), its peak stored activations, the
deadlock and order checks, the printed grid, and the errors for impossible requests."""
from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest
from torch import nn

from parakit.pipeline import (Action, Op, Schedule, ScheduleError, balance_from_split_points, bubble_formula,
                              build_schedule, check_batches, check_schedule, format_grid, simulate, split_stages)
from parakit.pipeline.schedules import with_communication

GRID = [(p, m) for p in (1, 2, 3, 4, 6) for m in (1, 2, 3, 4, 5, 8, 12, 16)]


def compute_names(schedule, rank):
    return [f"{a.op}{a.microbatch}" for a in schedule.compute(rank)]


def test_gpipe_runs_all_forwards_then_all_backwards():
    s = build_schedule("gpipe", 3, 4)
    for rank in range(3):
        assert compute_names(s, rank) == ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]


def test_1f1b_warms_up_alternates_and_cools_down():
    s = build_schedule("1f1b", 4, 6)
    assert compute_names(s, 0) == ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2", "B3", "B4", "B5"]
    assert compute_names(s, 2) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "F4", "B3", "F5", "B4", "B5"]
    assert compute_names(s, 3) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4", "F5", "B5"]


def test_sends_follow_their_compute_and_receives_stand_at_the_step_of_their_send():
    s = build_schedule("1f1b", 2, 2)
    assert [str(a) for a in s.actions[0]] == ["0F0", "0SEND_F0\u21921", "0F1", "0SEND_F1\u21921",
                                               "0RECV_B0\u21901", "0B0", "0RECV_B1\u21901", "0B1"]
    # rank 0 sends micro-batch 1 at step 2, when rank 1 has run F0: received there, before B0
    assert [str(a) for a in s.actions[1]] == ["1RECV_F0\u21900", "1F0", "1RECV_F1\u21900", "1B0", "1SEND_B0\u21920",
                                               "1F1", "1B1", "1SEND_B1\u21920"]


def receives_right_before_their_compute(schedule):
    """The schedule with each receive moved to just before the compute that needs its message
    (with the messages that peer sent before it): where with_communication put them before."""
    actions = []
    for rank_actions in schedule.actions:
        queues, out = {}, []
        for a in rank_actions:
            if a.op in (Op.RECV_F, Op.RECV_B):
                queues.setdefault(a.peer, []).append(a)
        for a in (a for a in rank_actions if a.op not in (Op.RECV_F, Op.RECV_B)):
            for queue in queues.values():
                brings = [(r.op.compute, r.stage, r.microbatch) for r in queue]
                if (a.op, a.stage, a.microbatch) in brings:
                    k = brings.index((a.op, a.stage, a.microbatch)) + 1
                    out, queue[:] = out + queue[:k], queue[k:]
            out.append(a)
        actions.append(tuple(out))
    return dataclasses.replace(schedule, actions=tuple(actions))


ALL = [(name, p, m, v) for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zbh1", 1),
                                      ("zbh2", 1), ("zbv", 2)) for p in (2, 3, 4, 8) for m in (p, 2 * p, 3 * p)
       if not (name == "zbh2" and m < 2 * p - 1)]


@pytest.mark.parametrize("name,p,m,v", ALL)
def test_every_schedule_runs_as_nccl_runs_its_batches_and_computes_when_it_did(name, p, m, v):
    """Both ends of each message in batches of one step: NCCL, where a send waits for its
    receive and a rank's batches run in turn, runs the schedule; and since a receive only
    posts, every compute starts and ends when it did with each receive right before it,
    whatever the actions take."""
    s = build_schedule(name, p, m, v)
    check_batches(s)
    uneven = {"F": Fraction(1), "B": Fraction(3), "W": Fraction(1, 2), "SEND_F": Fraction(1, 3)}
    for times in (None, {"F": 1, "B": 2}, uneven):
        new, old = simulate(s, times), simulate(receives_right_before_their_compute(s), times)
        compute = lambda line: sorted((e.rank, e.action, e.start, e.end) for e in line.events if e.action.op.is_compute)
        assert compute(new) == compute(old) and new.peak_activations == old.peak_activations, times


def test_receives_right_before_their_compute_deadlock_on_nccl_in_interleaved_1f1b():
    """Fine on paper, where a send is gone once made, but on NCCL rank 0's gradient send
    waits for rank 1, whose own send waits for rank 0's receive, posted after it."""
    old = receives_right_before_their_compute(build_schedule("interleaved", 2, 4, 2))
    simulate(old)
    with pytest.raises(ScheduleError, match=r"schedule 'interleaved' deadlocks on NCCL, where a send waits for its receive "
                                            r"and each rank's batches run one after another: rank 0 waits in "
                                            r"\[2SEND_B0\u21921\]; rank 1 waits in \[3SEND_B1\u21920, 1RECV_F2\u21900\]"):
        check_schedule(old)


def test_interleaved_places_chunk_c_of_rank_r_at_stage_c_p_plus_r():
    s = build_schedule("interleaved", 2, 4, 2)
    assert [(a.op, a.stage, a.microbatch) for a in s.compute(0)][:5] == [
        ("F", 0, 0), ("F", 0, 1), ("F", 2, 0), ("F", 2, 1), ("F", 0, 2)]
    assert {a.stage for a in s.compute(1)} == {1, 3}


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_simulated_bubble_is_exactly_p_minus_1_over_m_plus_p_minus_1(name):
    for p, m in GRID:
        if name == "1f1b" and m < p:
            continue
        timeline = simulate(build_schedule(name, p, m), {"F": 1, "B": 1})
        assert [timeline.idle_fraction(r) for r in range(p)] == [Fraction(p - 1, m + p - 1)] * p, (p, m)
        assert timeline.bubble == bubble_formula(p, m) and timeline.makespan == 2 * (m + p - 1)


def test_simulated_interleaved_bubble_is_exactly_p_minus_1_over_v_m_plus_p_minus_1():
    for p, m in GRID:
        for v in (2, 3, 4):
            if m % p == 0:
                timeline = simulate(build_schedule("interleaved", p, m, v))
                assert timeline.bubble == Fraction(p - 1, v * m + p - 1) == bubble_formula(p, m, v), (p, m, v)


def test_unequal_forward_and_backward_times_keep_the_gpipe_bubble_formula():
    timeline = simulate(build_schedule("gpipe", 4, 8), {"F": Fraction(1), "B": Fraction(2)})
    assert timeline.makespan == (8 + 3) * 3 and timeline.bubble == Fraction(3, 11)


def test_peak_stored_activations_gpipe_m_and_1f1b_p_minus_rank():
    for p, m in GRID:
        assert simulate(build_schedule("gpipe", p, m)).peak_activations == [m] * p
        if m >= p:
            assert simulate(build_schedule("1f1b", p, m)).peak_activations == [p - r for r in range(p)]


def test_grid_prints_one_row_per_time_step_and_dots_for_idle():
    lines = format_grid(build_schedule("gpipe", 2, 2)).splitlines()
    assert lines[0].split() == ["step", "rank", "0", "rank", "1"]
    assert [line.split()[1:] for line in lines[1:]] == [
        ["0F0", "."], ["0F1", "1F0"], [".", "1F1"], [".", "1B0"], ["0B0", "1B1"], ["0B1", "."]]
    assert str(build_schedule("gpipe", 2, 2)) == "\n".join(lines)


def test_a_schedule_that_deadlocks_is_refused_with_where_each_rank_waits():
    orders = [[Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)],
              [Action("F", 1, 0), Action("F", 1, 1), Action("B", 1, 0), Action("B", 1, 1)]]
    with pytest.raises(ScheduleError, match="schedule 'bad' deadlocks: rank 0 waits in 0RECV_B0\u21901; "
                                            "rank 1 waits in 1RECV_F1\u21900"):
        check_schedule(with_communication("bad", orders, 2, 2, 1))


def test_receives_out_of_order_compute_before_input_and_missing_actions_are_refused():
    good = build_schedule("gpipe", 2, 2)
    r1 = list(good.actions[1])
    swapped = r1[2:4] + r1[:2] + r1[4:]  # rank 1 receives micro-batch 1 first
    with pytest.raises(ScheduleError, match="rank 1 runs 1RECV_F1\u21900 but the next message from rank 0 is "
                                            "0SEND_F0: receives out of order"):
        simulate(Schedule("swapped", 2, 2, 1, (good.actions[0], tuple(swapped))))
    no_recv = tuple(a for a in r1 if a != Action("RECV_F", 1, 0, 0))
    with pytest.raises(ScheduleError, match=r"rank 1 runs 1F0 before its input arrives"):
        simulate(Schedule("no_recv", 2, 2, 1, (good.actions[0], no_recv)))
    one_rank = build_schedule("gpipe", 1, 2)
    with pytest.raises(ScheduleError, match=r"must run F and B of every stage and micro-batch once: "
                                            r"missing \[\('B', 0, 1\)\]"):
        simulate(Schedule("short", 1, 2, 1, (one_rank.actions[0][:-1],)))


@pytest.mark.parametrize("call,message", [
    (lambda: build_schedule("gpipe", 2, 0), "num_microbatches m must be a positive int, got 0"),
    (lambda: build_schedule("1f1b", 4, 3), r"1F1B needs at least as many micro-batches as stages: "
                                           r"num_microbatches=3 < 4 stages. Use num_microbatches >= 4, or schedule='gpipe'"),
    (lambda: build_schedule("interleaved", 2, 3, 2), "num_microbatches=3 is not a multiple of 2; use m = 4"),
    (lambda: build_schedule("1f1b", 2, 4, 2), "schedule '1f1b' runs one stage per rank but 2 stages per rank"),
    (lambda: build_schedule("zb", 2, 4), "unknown schedule 'zb': use one of 'gpipe', '1f1b', 'interleaved'"),
])
def test_impossible_schedules_are_refused_with_what_to_change(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_stages_share_the_models_layers_by_balance_and_split_points():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(5)])
    stages = split_stages(model, [2, 3])
    assert [len(s) for s in stages] == [2, 3] and stages[1][0] is model[2]
    assert balance_from_split_points([2, 3], 5) == [2, 1, 2]
    with pytest.raises(ValueError, match=r"balance \[2, 2\] sums to 4 layers but the model has 5: "
                                         r"change balance so that its entries add up to 5"):
        split_stages(model, [2, 2])
    with pytest.raises(ValueError, match=r"balance \[5, 0\] must list at least one layer per stage"):
        split_stages(model, [5, 0])
    with pytest.raises(ValueError, match=r"split points \[3, 3\] must increase strictly inside \(0, 5\)"):
        balance_from_split_points([3, 3], 5)


# ------------------------------------------------------------------------------ zero bubble

UNIT = {"F": 1, "B": 1, "W": 1}  # 1F1B's unsplit backward then takes B + W = 2


@pytest.mark.parametrize("p", range(2, 9))
def test_idle_inside_each_ranks_span_is_3_p_minus_1_for_1f1b_p_minus_1_for_zbh1_and_0_for_zbh2(p):
    for m in (2 * p, 2 * p + 1, 3 * p):
        idle = {name: max(simulate(build_schedule(name, p, m), UNIT).idle_in_span(r) for r in range(p))
                for name in ("1f1b", "zbh1", "zbh2")}
        assert idle == {"1f1b": 3 * (p - 1), "zbh1": p - 1, "zbh2": 0}, (p, m)


@pytest.mark.parametrize("p", range(2, 9))
def test_zbh1_holds_no_more_than_1f1b_and_zbh2_at_most_2p_minus_1(p):
    for m in (2 * p, 3 * p):
        one_f_one_b = simulate(build_schedule("1f1b", p, m), UNIT).peak_activations
        assert max(simulate(build_schedule("zbh1", p, m), UNIT).peak_activations) <= max(one_f_one_b) == p
        assert max(simulate(build_schedule("zbh2", p, m), UNIT).peak_activations) <= 2 * p - 1


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zbv_holds_1f1b_memory_in_half_stages_and_idles_less(p):
    m = 2 * p
    zbv = simulate(build_schedule("zbv", p, m), UNIT)  # 2p stages of half the layers: each op takes half as long
    one_f_one_b = simulate(build_schedule("1f1b", p, m), {"F": 2, "B": 2, "W": 2})
    assert zbv.peak_activations == [2 * p] * p  # 2p half-stage micro-batches = 1F1B's p whole ones on rank 0
    assert zbv.bubble < one_f_one_b.bubble
    s = build_schedule("zbv", p, m)
    assert [s.stages_of(r) for r in range(p)] == [[r, 2 * p - 1 - r] for r in range(p)]  # the V


def test_zbh1_runs_each_w_r_backwards_after_its_b_on_rank_r():
    p, m = 4, 8
    s = build_schedule("zbh1", p, m)
    for r in range(p):
        compute = s.compute(r)
        assert [a for a in compute if a.op != "W"] == build_schedule("1f1b", p, m).compute(r)  # 1F1B's F/B order
        backwards = [a.microbatch for a in compute if a.op == "B"]
        for i, a in enumerate(compute):
            if a.op == "W" and a.microbatch < m - r:  # not one of the r left for the end
                assert compute[i - 1] == Action("B", r, backwards[backwards.index(a.microbatch) + r])
        tail = compute[len(compute) - r:]  # the last r W's, in order
        assert [(a.op, a.microbatch) for a in tail] == [("W", i) for i in range(m - r, m)]


def test_a_w_before_its_b_is_refused_naming_rank_and_action():
    good = build_schedule("zbh1", 2, 2)
    r0 = list(good.actions[0])
    w = r0.index(Action("W", 0, 0))
    b = r0.index(Action("B", 0, 0))
    r0[w], r0[b] = r0[b], r0[w]
    early = dataclasses.replace(good, name="early", actions=(tuple(r0), good.actions[1]))
    with pytest.raises(ScheduleError, match=r"rank 0 runs 0W0 before its backward 0B0"):
        simulate(early)
    no_w = dataclasses.replace(good, name="no_w", actions=(tuple(a for a in good.actions[0] if a != Action("W", 0, 1)),
                                                           good.actions[1]))
    with pytest.raises(ScheduleError, match=r"must run F, B and W of every stage and micro-batch once: "
                                            r"missing \[\('W', 0, 1\)\]"):
        simulate(no_w)


@pytest.mark.parametrize("name,p,m,message", [
    ("zbh1", 4, 3, "ZB-H1 needs at least as many micro-batches as stages: num_microbatches=3 < 4; "
                   "use num_microbatches >= 4"),
    ("zbh2", 4, 6, r"ZB-H2 fills its warm-up with 2p-1 = 7 forwards on rank 0: num_microbatches=6 is too few; "
                   r"use num_microbatches >= 7"),
    ("zbv", 4, 3, "ZB-V needs at least as many micro-batches as ranks: num_microbatches=3 < 4; use num_microbatches >= 4"),
])
def test_too_few_microbatches_for_a_zero_bubble_schedule_name_the_minimum(name, p, m, message):
    with pytest.raises(ValueError, match=message):
        build_schedule(name, p, m)


def test_zbv_needs_two_stages_per_rank():
    with pytest.raises(ValueError, match="schedule 'zbv' runs 2 stages per rank but 1 stages per rank were given"):
        build_schedule("zbv", 2, 4, 1)


def test_the_grid_shows_w_as_its_own_step():
    lines = format_grid(build_schedule("zbh1", 2, 2)).splitlines()
    assert sum(line.count("W") for line in lines[1:]) == 4  # 2 stages x 2 micro-batches
