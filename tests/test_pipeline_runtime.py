"""parakit.pipeline's runtime on real ranks (gloo on CPU): every schedule leaves each rank's
stage gradients equal to one process on the whole batch, sends exactly the activations and
gradients the schedule names, holds the activations the simulator predicts, and agrees with
torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B, and its zero-bubble
schedules (ScheduleZBVZeroBubble, ScheduleInterleavedZeroBubble) on gloo."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import parakit
from p2p_order import assert_nccl_can_run, recording, run_emulated
from parakit import CollectiveHang, CommLog
from parakit.ddp import BucketedDDP
from parakit.pipeline import (Op, activation_shapes, batches, build_schedule, dp_pp_step, pipeline_step, run_schedule,
                              simulate, split_microbatches, split_stages)
from parakit.pipeline.schedules import rank_of

HIDDEN = 8


def mlp(layers: int, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(layers)])


def reference(model, x, y):
    """Loss and parameter gradients of one process on the whole batch."""
    model = copy.deepcopy(model)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return loss.detach(), [q.grad for q in model.parameters()]


def steps_on_ranks(cases):
    """pipeline_step for each (model, balance, x, y, schedule, m); this rank's loss and grads."""
    out = []
    for model, balance, x, y, schedule, m in cases:
        loss = pipeline_step(model, balance, x, y, F.mse_loss, schedule=schedule, num_microbatches=m)
        out.append((loss, [q.grad for q in model.parameters()]))
    return out


def assert_equal_to_one_process(results, cases, p):
    for c, (model, balance, x, y, schedule, m) in enumerate(cases):
        loss, grads = reference(model, x, y)
        stages, placement = len(balance), "v" if schedule == "zbv" else "loop"
        for rank in range(p):
            got_loss, got = results[rank][c]
            if rank == rank_of(stages - 1, p, placement):
                torch.testing.assert_close(got_loss, loss)
            else:
                assert got_loss is None
            mine = {id(q) for s, stage in enumerate(split_stages(model, balance)) if rank_of(s, p, placement) == rank
                    for q in stage.parameters()}
            for q, g_ref, g in zip(model.parameters(), grads, got):
                if id(q) in mine:
                    torch.testing.assert_close(g, g_ref, msg=lambda e: f"{schedule} p={p} m={m} rank {rank}: {e}")
                else:  # another rank's stage: this rank never touched it
                    assert g is None


@pytest.mark.parametrize("p", [2, 4])
def test_every_schedule_gives_each_stage_the_gradients_of_one_process(p):
    seed = int(torch.randint(2**31, ()))
    cases = []
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zbh1", 1), ("zbh2", 1), ("zbv", 2)):
        for m in ((2 * p, 4 * p) if schedule == "zbh2" else (p, 2 * p, 4 * p)):  # ZB-H2 needs 2p-1
            model = mlp(p * v, seed + m)
            cases.append((model, [1] * (p * v), torch.randn(4 * m, HIDDEN), torch.randn(4 * m, HIDDEN), schedule, m))
    cases.append((mlp(2 * p, seed), [2] * p, torch.randn(6, HIDDEN), torch.randn(6, HIDDEN), "gpipe", 3))  # m not a multiple of p
    n = 2 * (p + 1)  # uneven balance, m = p + 1
    cases.append((mlp(p + 1, seed), [2] + [1] * (p - 1), torch.randn(n, HIDDEN), torch.randn(n, HIDDEN), "1f1b", p + 1))
    assert_equal_to_one_process(parakit.launch(steps_on_ranks, cases, world_size=p), cases, p)


def measured_run(schedule_name, p, m, v=1):
    """run_schedule on this rank under a CommLog: its p2p records and its peak activations."""
    rank = dist.get_rank()
    model = mlp(p * v, 0)
    stages = split_stages(model, [1] * (p * v))
    schedule = build_schedule(schedule_name, p, m, v)
    x, y = torch.randn(2 * m, HIDDEN), torch.randn(2 * m, HIDDEN)
    mbs, tgts = split_microbatches(x, m), split_microbatches(y, m)
    with CommLog() as log:
        run = run_schedule(schedule, {s: stages[s] for s in schedule.stages_of(rank)}, mbs, tgts, F.mse_loss,
                           activation_shapes(stages, mbs[0]))
    sends = [(r.op, r.nbytes, r.peer) for r in log.records if r.op == "isend"]
    recvs = [(r.op, r.nbytes, r.peer) for r in log.records if r.op == "irecv"]
    return sends, recvs, log.count(), run.peak_activations, [e.action for e in run.events]


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2),
                                        ("zbh1", 4, 8, 1), ("zbv", 2, 4, 2)])
def test_runtime_sends_what_the_schedule_names_and_holds_the_simulated_peak(name, p, m, v):
    results = parakit.launch(measured_run, name, p, m, v, world_size=p)
    schedule = build_schedule(name, p, m, v)
    predicted = simulate(schedule).peak_activations
    mb_bytes = 2 * HIDDEN * 4  # one micro-batch of 2 samples, fp32
    for rank, (sends, recvs, total, peak, actions) in enumerate(results):
        assert actions == list(schedule.actions[rank])  # the runtime ran the schedule's actions, in order
        want_sends = [("isend", mb_bytes, a.peer) for a in schedule.actions[rank] if a.op.startswith("SEND")]
        want_recvs = [("irecv", mb_bytes, a.peer) for a in schedule.actions[rank] if a.op.startswith("RECV")]
        assert (sends, recvs, total) == (want_sends, want_recvs, len(want_sends) + len(want_recvs))  # in its order
        assert peak == predicted[rank]
    if name == "gpipe":
        assert [r[3] for r in results] == [m] * p
        assert [len(r[0]) for r in results] == [m, m]  # rank 0: m activations; rank 1: m gradients
    if name == "1f1b":
        assert [r[3] for r in results] == [p - r for r in range(p)]  # stage 0 holds p, not m


SCHEDULE_CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zbh1", 1), ("zbh2", 1), ("zbv", 2)]


def posted_batches(p):
    """For every schedule, the batches of point-to-point calls this rank posted in one step."""
    rank, out = dist.get_rank(), []
    for name, v in SCHEDULE_CASES:
        m = 2 * p
        stages = split_stages(mlp(p * v, 0), [1] * (p * v))
        schedule = build_schedule(name, p, m, v)
        mbs, tgts = split_microbatches(torch.randn(2 * m, HIDDEN), m), split_microbatches(torch.randn(2 * m, HIDDEN), m)
        with recording() as posted:
            run_schedule(schedule, {s: stages[s] for s in schedule.stages_of(rank)}, mbs, tgts, F.mse_loss,
                         activation_shapes(stages, mbs[0]))
        out.append(posted)
    return out


@pytest.mark.parametrize("p", [2, 4])
def test_each_rank_posts_its_schedules_batches_in_an_order_nccl_can_run(p):
    """Every run of consecutive sends and receives goes out as one batch where it stands, and
    played as NCCL runs them (a rank's batches in turn, a send waiting for its receive) no
    rank waits for a batch that cannot come: the condition per peer pair that the old
    runtime, which posted each peer's next receive ahead of its sends, broke."""
    results = parakit.launch(posted_batches, p, world_size=p)
    mb_bytes = 2 * HIDDEN * 4
    for c, (name, v) in enumerate(SCHEDULE_CASES):
        schedule = build_schedule(name, p, 2 * p, v)
        for rank in range(p):
            want = [[("send" if a.op in (Op.SEND_F, Op.SEND_B) else "recv", a.peer, mb_bytes) for a in run]
                    for run in batches(schedule.actions[rank])]
            assert results[rank][c] == want, (name, rank)
        assert_nccl_can_run([results[rank][c] for rank in range(p)])


def old_runtime_order(schedule, rank, nbytes):
    """The batches the runtime before this order posted: one receive from each peer at the
    start, the next from a peer when the last one arrived, every send alone."""
    actions = schedule.actions[rank]
    recvs = {}
    for a in actions:
        if a.op in (Op.RECV_F, Op.RECV_B):
            recvs.setdefault(a.peer, []).append(a)
    posted = [[("recv", peer, nbytes)] for peer in recvs]
    for a in actions:
        if a.op in (Op.SEND_F, Op.SEND_B):
            posted.append([("send", a.peer, nbytes)])
        elif a.op in (Op.RECV_F, Op.RECV_B) and recvs[a.peer].index(a) + 1 < len(recvs[a.peer]):
            posted.append([("recv", a.peer, nbytes)])
    return posted


def test_the_check_refuses_the_old_runtimes_receives_posted_ahead_of_sends():
    schedule = build_schedule("1f1b", 2, 4)
    with pytest.raises(AssertionError, match=r"NCCL would deadlock: rank 0 waits in batch 0: \[\('recv', 1, 64\)\]"):
        assert_nccl_can_run([old_runtime_order(schedule, rank, 64) for rank in range(2)])


def pipeline_without_rank_1():
    if dist.get_rank() == 0:
        pipeline_step(mlp(2, 0), [1, 1], torch.randn(4, HIDDEN), torch.randn(4, HIDDEN), F.mse_loss, "gpipe", 2)


def test_a_rank_waiting_for_a_message_that_never_comes_is_named_by_the_hang_check():
    """Rank 0 posts its two activations, then waits for the first gradient, which rank 1
    (gone) never sends: the launcher names the receive and its peer, before the timeout."""
    with pytest.raises(CollectiveHang) as caught:
        parakit.launch(pipeline_without_rank_1, world_size=2, timeout=45)
    text = str(caught.value)
    assert "rank 0 waits in irecv #3 (from rank 1)" in text and "rank 1 returned after 0 communication call(s)" in text
    assert parakit.launch(lambda: dist.get_rank(), world_size=2) == [0, 1]  # the pool still works


EMULATED = '''import json, torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist
import parakit
from parakit import pipeline
from parakit.pipeline import Op

CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zbh1", 1), ("zbh2", 1), ("zbv", 2)]

def mlp(layers, seed):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(layers)])

def step(name, v, m, x, y):
    p = dist.get_world_size()
    model = mlp(p * v, 0).to(parakit.device())
    loss = pipeline.pipeline_step(model, [1] * (p * v), x, y, F.mse_loss, name, m)
    return loss, [q.grad for q in model.parameters()], parakit.device().type

def old_runtime(m):
    """The runtime before: the first receive from the peer posted ahead, then the sends (1F1B, 2 ranks, no compute)."""
    rank, s = dist.get_rank(), pipeline.build_schedule("1f1b", 2, m)
    buffers, works = [], []
    recvs = [a for a in s.actions[rank] if a.op in (Op.RECV_F, Op.RECV_B)]
    posted = [dist.irecv(torch.empty(8, device=parakit.device()), 1 - rank)]
    for a in s.actions[rank]:
        if a.op in (Op.SEND_F, Op.SEND_B):
            works.append(dist.isend(torch.ones(8, device=parakit.device()), 1 - rank))
        elif a.op in (Op.RECV_F, Op.RECV_B):
            posted.pop(0).wait()
            if recvs.index(a) + 1 < len(recvs):
                posted.append(dist.irecv(torch.empty(8, device=parakit.device()), 1 - rank))
    for w in works:
        w.wait()

found = {}
for p in (2, 4):
    for name, v in CASES:
        m = 2 * p
        x, y = torch.randn(4 * m, 8), torch.randn(4 * m, 8)
        ref = mlp(p * v, 0)
        F.mse_loss(ref(x), y).backward()
        runs = parakit.launch(step, name, v, m, x, y, world_size=p)
        grads = [next(gs[i] for _, gs, _ in runs if gs[i] is not None) for i in range(len(runs[0][1]))]
        ok = all(torch.allclose(g, q.grad, atol=1e-6) for g, q in zip(grads, ref.parameters()))
        found[f"{name} p={p}"] = [ok, sorted({kind for *_, kind in runs})]
try:
    parakit.launch(old_runtime, 4, world_size=2, timeout=60)
    found["old"] = "ran"
except parakit.RankError as error:
    found["old"] = str(error)
print(json.dumps(found))
'''


def test_every_schedule_runs_on_the_emulated_nccl_where_the_old_order_hangs(tmp_path):
    """On 2 and 4 emulated GPUs, whose NCCL stops where NCCL would hang (one stream per
    group, a send waiting for its receive), every schedule gives one process's gradients;
    the runtime's old order, a receive posted ahead of the sends to the same peer, is stopped
    at once with each rank's stream."""
    found = run_emulated(tmp_path, EMULATED)
    old = found.pop("old")
    assert found == {f"{name} p={p}": [True, ["fgpu"]] for p in (2, 4) for name, _ in SCHEDULE_CASES}
    assert "NCCL would hang here" in old and "rank 0's stream on group 0 runs, in order: recv from rank 1" in old


def torch_pipelining(schedule_name, model, x, y, m):
    """torch.distributed.pipelining's schedule on the same split: losses and grads."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, p = dist.get_rank(), dist.get_world_size()
    stage = PipelineStage(split_stages(model, [2] * p)[rank], rank, p, torch.device("cpu"))
    schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name](stage, m, loss_fn=F.mse_loss)
    losses = []
    schedule.step(x) if rank == 0 else schedule.step(target=y, losses=losses)
    torch_grads = [q.grad for q in model.parameters()]
    model.zero_grad(set_to_none=True)
    loss = pipeline_step(model, [2] * p, x, y, F.mse_loss, schedule=schedule_name, num_microbatches=m)
    return (torch.stack(losses).mean() if losses else None), torch_grads, loss, [q.grad for q in model.parameters()]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_loss_and_gradients_match_torch_distributed_pipelining(schedule):
    model, x, y = mlp(4, int(torch.randint(2**31, ()))), torch.randn(16, HIDDEN), torch.randn(16, HIDDEN)
    for rank, (torch_loss, torch_grads, loss, grads) in enumerate(parakit.launch(torch_pipelining, schedule, model, x, y,
                                                                                 4, world_size=2)):
        assert sum(g is not None for g in grads) == 4  # two Linear layers: weight and bias each
        for g_torch, g in zip(torch_grads, grads):
            torch.testing.assert_close(g, g_torch)
        if rank == 1:
            torch.testing.assert_close(loss, torch_loss)


def torch_zero_bubble(theirs, ours, model, x, y, m):
    """torch.distributed.pipelining's zero-bubble schedule `theirs` and parakit's `ours`,
    two stages per rank placed alike: this rank's losses and grads."""
    from torch.distributed import pipelining

    rank, p = dist.get_rank(), dist.get_world_size()
    stages, placement = split_stages(model, [1] * (2 * p)), "v" if ours == "zbv" else "loop"
    mine = [s for s in range(2 * p) if rank_of(s, p, placement) == rank]
    schedule = getattr(pipelining, theirs)([pipelining.PipelineStage(stages[s], s, 2 * p, torch.device("cpu"))
                                            for s in mine], m, loss_fn=F.mse_loss)
    losses, last = [], rank_of(2 * p - 1, p, placement) == rank
    schedule.step(*([x] if rank == 0 else []), **(dict(target=y, losses=losses) if last else {}))
    torch_grads = [q.grad for q in model.parameters()]
    model.zero_grad(set_to_none=True)
    loss = pipeline_step(model, [1] * (2 * p), x, y, F.mse_loss, schedule=ours, num_microbatches=m)
    return (torch.stack(losses).mean() if losses else None), torch_grads, loss, [q.grad for q in model.parameters()]


@pytest.mark.parametrize("theirs,ours", [("ScheduleZBVZeroBubble", "zbv"), ("ScheduleInterleavedZeroBubble", "interleaved")])
def test_zero_bubble_gradients_match_torch_distributed_pipelining(theirs, ours):
    model, x, y = mlp(4, int(torch.randint(2**31, ()))), torch.randn(16, HIDDEN), torch.randn(16, HIDDEN)
    _, want = reference(model, x, y)
    for torch_loss, torch_grads, loss, grads in parakit.launch(torch_zero_bubble, theirs, ours, model, x, y, 4,
                                                                world_size=2):
        assert sum(g is not None for g in grads) == sum(g is not None for g in torch_grads) == 4  # 2 stages of 2 tensors
        for g_torch, g, g_one in zip(torch_grads, grads, want):
            if g is not None:
                torch.testing.assert_close(g, g_torch)
                torch.testing.assert_close(g, g_one)
        if loss is not None:
            torch.testing.assert_close(loss, torch_loss)


def dp_pp(model, x, y, bucket_size_mb):
    """2 pipelines of 2 ranks each ({0,1} and {2,3}); replica d gets half d of the batch."""
    rank = dist.get_rank()
    pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica = rank // 2
    stage = BucketedDDP(split_stages(model, [2, 2])[rank % 2], bucket_size_mb, process_group=dp_groups[rank % 2])
    with CommLog() as log:
        dp_pp_step(model, [2, 2], x.chunk(2)[replica], y.chunk(2)[replica], F.mse_loss,
                   pp_group=pp_groups[replica], replica=stage, num_microbatches=4)
    return [q.grad for q in model.parameters()], log.count("all_reduce"), log.nbytes("all_reduce")


@pytest.mark.parametrize("bucket_size_mb, buckets", [(None, 1), (1e-4, 4)])  # 1e-4 MB: a bucket per tensor
def test_dp_x_pp_equals_one_process_with_the_buckets_reduced_once_per_step(bucket_size_mb, buckets):
    model, x, y = mlp(4, int(torch.randint(2**31, ()))), torch.randn(16, HIDDEN), torch.randn(16, HIDDEN)
    _, want = reference(model, x, y)
    stage_bytes = 2 * (HIDDEN * HIDDEN + HIDDEN) * 4  # two Linear layers per stage, fp32
    for rank, (grads, all_reduces, nbytes) in enumerate(parakit.launch(dp_pp, model, x, y, bucket_size_mb,
                                                                       world_size=4)):
        assert (all_reduces, nbytes) == (buckets, stage_bytes)  # not once per micro-batch
        stage = rank % 2
        for i, (g, g_ref) in enumerate(zip(grads, want)):
            if i // 4 == stage:
                torch.testing.assert_close(g, g_ref)
            else:
                assert g is None


def replica_of_the_wrong_stage():
    model = mlp(2, 0)
    stage = BucketedDDP(copy.deepcopy(split_stages(model, [1, 1])[dist.get_rank()]))  # a copy, not the stage
    dp_pp_step(model, [1, 1], torch.randn(4, HIDDEN), torch.randn(4, HIDDEN), F.mse_loss, pp_group=None,
               replica=stage, num_microbatches=2)


def test_a_replica_that_does_not_wrap_this_ranks_stages_is_refused():
    with pytest.raises(parakit.launcher.RankError, match=r"misses 2 parameters of this rank's stages \[0\]"):
        parakit.launch(replica_of_the_wrong_stage, world_size=2)


def wrong_stage_count():
    return pipeline_step(mlp(3, 0), [1, 1, 1], torch.randn(4, HIDDEN), torch.randn(4, HIDDEN), F.mse_loss)


def test_stage_count_that_does_not_match_the_world_size_is_refused_on_every_rank():
    with pytest.raises(parakit.launcher.RankError, match=r"balance makes 3 stages for 2 ranks: "
                                                         r"schedule '1f1b' needs 2 stages, one per rank"):
        parakit.launch(wrong_stage_count, world_size=2)
    assert parakit.launch(lambda: dist.get_rank(), world_size=2) == [0, 1]  # the pool still works


@pytest.mark.parametrize("kwargs,batch,message", [
    (dict(num_microbatches=0), 4, "num_microbatches m must be a positive int, got 0"),
    (dict(num_microbatches=3), 4, "a batch of 4 samples does not split into 3 equal micro-batches"),
    (dict(schedule="zero-bubble"), 4, "unknown schedule 'zero-bubble'"),
    (dict(schedule=build_schedule("gpipe", 2, 2)), 4, "schedule 'gpipe' is for 2 ranks, 2 stages and 2 micro-batches, "
                                                      "but this step has 1 ranks, 1 stages and num_microbatches=None"),
])
def test_bad_step_arguments_are_refused_in_one_process(kwargs, batch, message):
    with pytest.raises(ValueError, match=message):
        pipeline_step(mlp(2, 0), [2], torch.randn(batch, HIDDEN), torch.randn(batch, HIDDEN), F.mse_loss, **kwargs)
