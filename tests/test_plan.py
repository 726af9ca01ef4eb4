"""The planner: the ZeRO paper's table and Korthikanti et al.'s activation formula reproduced
exactly, reasons for bad configurations, the search's order on a case checked by hand, and
its predictions against measured runs on gloo (bytes sent within 2%, peak bytes within 10%)."""
from __future__ import annotations

import json

import pytest

from parakit.plan import (Cluster, Config, Model, PlanError, in_flight, layer_activation_bytes, memory, search, stage_params,
                          stage_tensors, step_time, traffic, zero_layout, link, problems)
from parakit.plan.measure import compare, measure, measure_context_parallel, measure_expert_parallel, tiny_model
from parakit.sequence_parallel import paper_activation_bytes
from parakit.zero.paper import zero_bytes

GPT3 = Model(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200)  # Korthikanti et al.'s 175B
H100 = Cluster(devices_per_node=8, nodes=8, memory=80e9, flops=989e12)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_states_are_the_zero_papers_table(stage):
    model = Model(layers=4, hidden=256, heads=4, seq=128, vocab=1000)
    config = Config(dp=64, zero=stage)
    psi = sum(stage_params(model, config, 0))
    got = memory(model, None, config).items
    assert {k: got[k] for k in ("parameters", "gradients", "optimizer")} == zero_bytes(psi, 64, stage)
    # the paper's Figure 1 / Table 1 row: Psi = 7.5B on 64 devices, K = 12: 120, 31.4, 16.6, 1.9 GB
    paper = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}[stage]
    assert round(sum(zero_bytes(7.5e9, 64, stage).values()) / 1e9, 1) == paper


@pytest.mark.parametrize("t,sp,policy,expected", [
    (1, False, "none", lambda s, b, h, a, t: s * b * h * (34 + 5 * a * s / h)),
    (8, False, "none", lambda s, b, h, a, t: s * b * h * (10 + 24 / t + 5 * a * s / (h * t))),
    (8, True, "none", lambda s, b, h, a, t: s * b * h / t * (34 + 5 * a * s / h)),
    (8, True, "selective", lambda s, b, h, a, t: s * b * h / t * 34),
    (8, True, "full", lambda s, b, h, a, t: 2 * s * b * h / t),
])
def test_layer_activations_are_korthikanti_formula(t, sp, policy, expected):
    config = Config(tp=t, sp=sp, microbatch=1, checkpointing=policy)
    s, b, h, a = GPT3.seq, 1, GPT3.hidden, GPT3.heads
    assert layer_activation_bytes(GPT3, config) == expected(s, b, h, a, t)
    if policy == "none":
        assert layer_activation_bytes(GPT3, config) == paper_activation_bytes(s, b, h, a, t, sp)


def test_one_f_one_b_first_stage_holds_p_microbatches():
    assert in_flight(Config(pp=4, microbatches=8)) == [4, 3, 2, 1]
    assert in_flight(Config(pp=4, microbatches=8, schedule="gpipe")) == [8] * 4


def test_with_gradients_a_rank_holds_its_steady_state_or_a_later_backwards_micro_batches():
    from parakit.plan.memory import in_flight_with_gradients
    assert in_flight_with_gradients(Config(pp=4, microbatches=8)) == [4, 3, 2, 1]  # at each forward after a backward
    assert in_flight_with_gradients(Config(pp=4, microbatches=8, schedule="gpipe")) == [7] * 4  # at the second backward
    assert in_flight_with_gradients(Config(pp=2, microbatches=2)) == [1, 1]  # rank 0's second backward: F0 F1 B0 B1


def test_parakit_activation_model_counts_what_autograd_saves():
    import torch
    from parakit.checkpoint import saved_bytes
    from parakit.launcher import launch

    def saved(model, b, cp):
        import torch.distributed as dist
        from parakit.tensor_parallel import ParallelTransformerBlock
        if cp == 1:
            block = ParallelTransformerBlock(model.hidden, model.heads)
        else:  # ring attention over the world, no tp
            block = ParallelTransformerBlock(model.hidden, model.heads, group=dist.new_group([dist.get_rank()]),
                                             cp_group=dist.group.WORLD)
        return saved_bytes(block, torch.randn(b, model.seq // cp, model.hidden, requires_grad=True)).forward

    model = tiny_model()
    for tp, cp in ((1, 1), (2, 1), (1, 2)):
        got = launch(saved, model, 2, cp, world_size=tp * cp, backend="gloo")
        assert got == [layer_activation_bytes(model, Config(tp=tp, cp=cp, microbatch=2))] * tp * cp


def test_stage_tensors_are_the_trainers_parameters_in_order():
    from parakit.launcher import launch

    def numels(model):
        from parakit.plan.measure import _args
        from parakit.train import build_model
        return [p.numel() for p in build_model(_args(model, Config())).parameters()]

    model = tiny_model()
    for tp in (1, 2):
        assert launch(numels, model, world_size=tp, backend="gloo") == [stage_tensors(model, Config(tp=tp), 0)[0]] * tp


def test_stage_tensors_of_experts_are_the_trainers_dense_and_expert_parameters_in_order():
    from parakit.launcher import launch

    def numels(model):
        from parakit.mesh import Mesh
        from parakit.moe import ExpertParallelMoE
        from parakit.plan.measure import _args
        from parakit.train import build_model
        mesh = Mesh(2, 1, 1, ep=2)
        net = build_model(_args(model, Config(dp=2)), mesh.tp_group, ep_group=mesh.ep_group)
        experts = {id(p) for m in net.modules() if isinstance(m, ExpertParallelMoE) for p in m.experts.parameters()}
        return ([p.numel() for p in net.parameters() if id(p) not in experts],
                [p.numel() for p in net.parameters() if id(p) in experts])

    model = tiny_model(experts=4, top_k=2)
    dense, expert = stage_tensors(model, Config(dp=2, ep=2), 0)
    assert launch(numels, model, world_size=2, backend="gloo") == [(dense, expert)] * 2


def test_zero_layout_pads_each_bucket_to_its_largest_owner():
    # the tiny model on 4 ranks: one bucket; owners (largest first, to the emptiest rank) hold 28672, 28672, 26048, 25984
    layout = zero_layout(tuple(stage_tensors(tiny_model(), Config(), 0)[0]), 4, 4, owners=True)
    assert (layout.chunks, layout.owned, layout.padded) == ((28672,), 28672, 4 * 28672)
    even = zero_layout(tuple(stage_tensors(tiny_model(), Config(), 0)[0]), 4, 4, owners=False)
    assert (even.chunks, even.padded) == ((109376 // 4,), 109376)


@pytest.mark.parametrize("config,model,says", [
    (Config(dp=3, tp=2), GPT3, "dp x tp x pp x cp = 3 x 2 x 1 x 1 = 6 devices, but the cluster has 64 (+58)"),
    (Config(tp=64), GPT3, "heads = 96 does not split evenly over tp = 64 (remainder 32)"),
    (Config(dp=1, tp=8, pp=8, microbatches=8, v=1), Model(layers=100, hidden=12288, heads=96, seq=2048, vocab=51200),
     "layers = 100 does not split evenly over pp x v = 8 (remainder 4)"),
    (Config(dp=64, ep=3), Model(layers=4, hidden=256, heads=4, seq=128, vocab=1000, experts=8, top_k=2),
     "experts = 8 does not split evenly over ep = 3 (remainder 2)"),
    (Config(dp=8, pp=8, microbatches=4), GPT3, "1f1b needs microbatches >= pp: 4 < 8 (short by 4)"),
])
def test_bad_configurations_name_the_constraint_and_by_how_much(config, model, says):
    with pytest.raises(PlanError) as err:
        memory(model, H100, config)
    assert any(says in reason for reason in err.value.reasons), err.value.reasons


def test_a_configuration_that_does_not_fit_is_rejected_with_the_bytes_over():
    small = Cluster(devices_per_node=2, nodes=1, memory=0.5e9, flops=1e14)
    model = Model(layers=4, hidden=1024, heads=8, seq=512, vocab=32000)
    fits, rejected = search(model, small, global_batch=4, zero_stages=(0,), checkpointing=("none",))
    assert not fits
    over = [c for c in rejected if "GB over the device's 0.50 GB" in c.reasons[0]]
    assert over and all(c.reasons for c in rejected)
    assert "needs 1.05 GB on pipeline rank 0, 0.55 GB over" in next(c for c in over if str(c.config) == "pp2 1f1b m4 mb1 zero0 bf16").reasons[0]


def test_the_drawn_plan_of_a_configuration_that_cannot_run_says_why_in_place_of_a_step_time():
    import matplotlib.pyplot as plt
    from parakit.plan.figure import draw_plan

    small = Cluster(devices_per_node=2, nodes=1, memory=0.5e9, flops=1e14)
    model = Model(layers=4, hidden=1024, heads=8, seq=512, vocab=32000)
    cases = {Config(pp=2, microbatches=4, zero=0): "cannot run: needs 1.05 GB on pipeline rank 0, 0.55 GB over the "
                                                   "device's 0.50 GB",  # bars drawn, no step time
             Config(tp=2, pp=2, sp=True, microbatches=4): "dp x tp x pp x cp = 1 x 2 x 2 x 1 = 4 devices, but the "
                                                          "cluster has 2 (-2)"}
    for config, says in cases.items():
        figure = draw_plan(model, small, config)
        texts = [t.get_text() for axis in figure.axes for t in axis.texts]
        titles = [axis.get_title() for axis in figure.axes]
        plt.close(figure)
        assert any(says in t for t in texts), texts
        assert not any(" s" in t and ":" in t for t in titles), titles  # no step time anywhere


def test_lesson_10s_explorer_draws_every_choice_it_offers():
    """Its dropdowns (tp, pp over 32 GPUs, zero, checkpointing) on a 70B-shaped model: each value
    draws a plan or its reasons (tp8 pp8 asks for 64 devices; tp1 pp1 does not fit)."""
    import matplotlib.pyplot as plt
    from parakit.plan.figure import draw_plan

    model, cluster = Model(layers=80, hidden=8192, heads=64, ffn=28672, seq=4096, vocab=32000), Cluster(8, 4, 80e9, 989e12)
    choices = [(tp, pp, 1, "selective") for tp in (8, 1, 2, 4) for pp in (4, 1, 2, 8)]
    choices += [(8, 4, zero, checkpointing) for zero in (0, 2, 3) for checkpointing in ("selective", "none", "full")]
    said = {}
    for tp, pp, zero, checkpointing in choices:
        dp = max(32 // (tp * pp), 1)  # as the lesson's explore_70b
        figure = draw_plan(model, cluster, Config(dp=dp, tp=tp, pp=pp, sp=tp > 1, microbatches=64 // dp, microbatch=1,
                                                  zero=zero, checkpointing=checkpointing))
        said[tp, pp, zero, checkpointing] = " ".join(t.get_text() for axis in figure.axes for t in axis.texts)
        plt.close(figure)
    assert "64 devices, but the cluster has 32" in said[8, 8, 1, "selective"]
    assert "cannot run: needs" in said[1, 1, 1, "selective"] and "GB over the device's 80.00 GB" in said[1, 1, 1, "selective"]
    assert said[8, 4, 1, "selective"] == ""  # the lesson's first choice fits: bars and a step time


def test_search_with_free_links_puts_pipelines_last_and_splits_compute():
    free = Cluster(devices_per_node=2, nodes=1, memory=1e12, flops=1e12, intra_latency=0, intra_bandwidth=float("inf"))
    model = Model(layers=4, hidden=64, heads=4, seq=64, vocab=128)
    fits, _ = search(model, free, global_batch=4, microbatch_sizes=(1,), zero_stages=(0,), checkpointing=("none",))
    one = step_time(model, Cluster(1, 1, 1e12, 1e12), Config(microbatches=4)).total
    assert fits[0].seconds == pytest.approx(one / 2)  # by hand: no communication cost, half the work each
    assert [c.config.pp for c in fits][-1] == 2 and fits[-1].seconds > fits[0].seconds  # the bubble


def test_the_outermost_of_dp_and_pp_is_the_group_that_crosses_nodes():
    """dp2 x tp4 x pp2 on 2 nodes of 8: tp4 fills half a node, the middle dimension the other half."""
    cluster = Cluster(devices_per_node=8, nodes=2, memory=80e9, flops=1e15, intra_bandwidth=400e9, inter_bandwidth=50e9)
    for outer, across in (("dp", "dp"), ("pp", "pp")):
        config = Config(dp=2, tp=4, pp=2, microbatches=4, outer=outer)
        assert {g: link(cluster, config, g, 2)[1] for g in ("dp", "pp")} == {
            g: 50e9 if g == across else 400e9 for g in ("dp", "pp")}
    assert str(Config(dp=2, pp=2, microbatches=2, outer="pp")) == "dp2 pp2 1f1b m2 mb1 zero0 bf16 pp-outer"
    assert problems(GPT3, None, Config(outer="tp")) == ["outer = 'tp': the outermost dimension is 'dp' or 'pp'"]
    fits, _ = search(Model(layers=4, hidden=64, heads=4, seq=64, vocab=128), cluster, global_batch=8, microbatch_sizes=(1,),
                     zero_stages=(0,), checkpointing=("none",), outers=("dp", "pp"))
    both = [c.config for c in fits if c.config.dp > 1 and c.config.pp > 1]
    assert both and [c.outer for c in both].count("dp") == [c.outer for c in both].count("pp")


def test_zero_traffic_per_micro_batch_stage_1_reduces_once_stage_2_and_3_every_backward():
    """m micro-batches: ZeRO-1 accumulates whole gradients, ZeRO-2 keeps only its segment (one
    reduce-scatter per backward), ZeRO-3 gathers twice and reduces once per micro-batch."""
    model = tiny_model()
    for stage, reduces, gathers in ((1, [1, 1], [1, 1]), (2, [1, 3], [1, 1]), (3, [1, 3], [2, 6])):
        counts = [{op: sum(t.count for t in traffic(model, Config(dp=2, zero=stage, microbatches=m)) if t.op == op)
                   for op in ("reduce_scatter", "all_gather")} for m in (1, 3)]
        per_bucket = [counts[0]["reduce_scatter"]] * 2 if stage < 3 else [1, 1]
        assert [c["reduce_scatter"] for c in counts] == [r * b for r, b in zip(reduces, per_bucket)], stage
        assert [c["all_gather"] for c in counts] == [g * b for g, b in zip(gathers, per_bucket)], stage


def test_measure_refuses_zero_1_or_2_with_micro_batches_and_says_what_to_do():
    with pytest.raises(ValueError, match="ShardedOptimizer reduces as the first backward ends.*microbatches=1"):
        measure(tiny_model(), Config(dp=2, zero=2, microbatches=2, microbatch=4, dtype="fp32"))


MEASURED = [Config(dp=2, microbatches=2, microbatch=4, dtype="fp32", ddp_buckets=True),
            Config(tp=2, microbatches=2, microbatch=4, dtype="fp32", ddp_buckets=True),
            Config(pp=2, microbatches=2, microbatch=4, dtype="fp32", ddp_buckets=True),
            Config(dp=2, zero=1, microbatch=8, dtype="fp32"),
            Config(dp=2, zero=3, microbatches=2, microbatch=4, dtype="fp32"),
            Config(dp=2, tp=2, microbatches=2, microbatch=4, dtype="fp32", checkpointing="full", ddp_buckets=True),
            Config(dp=2, zero=2, microbatch=8, dtype="fp32"),
            Config(pp=2, microbatches=4, microbatch=2, schedule="gpipe", dtype="fp32", ddp_buckets=True),
            Config(dp=4, microbatch=4, dtype="fp32", ddp_buckets=True),
            Config(dp=2, pp=2, microbatches=2, microbatch=4, dtype="fp32", ddp_buckets=True),
            Config(dp=4, zero=3, microbatch=4, dtype="fp32"),
            Config(tp=2, pp=2, microbatches=2, microbatch=8, dtype="fp32", ddp_buckets=True, checkpointing="full"),
            Config(cp=2, microbatches=2, microbatch=4, dtype="fp32", ddp_buckets=True),
            Config(dp=2, cp=2, microbatches=2, microbatch=4, dtype="fp32", ddp_buckets=True),
            Config(tp=2, cp=2, microbatches=2, microbatch=4, dtype="fp32", ddp_buckets=True),
            Config(cp=2, microbatches=2, microbatch=4, dtype="fp32", ddp_buckets=True, checkpointing="full"),
            Config(pp=2, cp=2, microbatches=2, microbatch=4, dtype="fp32", ddp_buckets=True)]


@pytest.mark.parametrize("config", MEASURED, ids=str)
def test_predicted_bytes_sent_within_2_and_peak_within_10_percent_and_held_within_a_tenth(config):
    """Held at rest: parameters and optimizer state; the planner leaves out Adam's step
    counters (4 bytes per parameter tensor, kept on the CPU on a GPU)."""
    for row in compare(tiny_model(), config, measure(tiny_model(), config)):
        assert abs(row["sent_error"]) <= 0.02, row
        assert abs(row["peak_error"]) <= 0.10, row
        assert abs(row["held_error"]) <= 0.001, row


EXPERTS = [Config(dp=4, ep=2, microbatch=4, dtype="fp32", ddp_buckets=True),
           Config(dp=2, pp=2, ep=2, microbatches=2, microbatch=4, dtype="fp32", ddp_buckets=True),
           Config(cp=2, ep=2, microbatches=2, microbatch=4, dtype="fp32", ddp_buckets=True)]


@pytest.mark.parametrize("config", EXPERTS, ids=str)
def test_experts_in_the_trainer_sent_within_2_percent_with_the_rows_routed_and_held_within_a_tenth(config):
    """The tiny model with 4 experts, top-2, in every block (parakit.train --experts 4 --top-k 2).
    The planner's all-to-all bytes assume even routing; with the rows the routers really sent
    (exact, from the splits) the prediction holds to 2%. Its peak assumes even routing too, and
    a rank whose experts drew more than their share holds more (dp2 x pp2 x ep2: -8.6% at
    idle, -10.8% once under load): the peak bar is tested where routing is fixed, below."""
    model = tiny_model(experts=4, top_k=2)
    for row in compare(model, config, measure(model, config)):
        assert abs(row["routed_error"]) <= 0.02, row
        assert abs(row["held_error"]) <= 0.001, row


@pytest.mark.parametrize("config", EXPERTS, ids=str)
def test_experts_with_every_token_to_every_expert_sent_within_2_and_peak_within_10_percent(config):
    """Top-4 of 4 experts: every token goes to every expert, so each rank's experts get exactly
    the even share the planner assumes, and bytes and peak are the same on every run (peak
    errors -3.3%, -6.0% / +4.4%, +0.9%)."""
    model = tiny_model(experts=4, top_k=4)
    for row in compare(model, config, measure(model, config)):
        assert abs(row["sent_error"]) <= 0.02, row
        assert abs(row["peak_error"]) <= 0.10, row
        assert abs(row["held_error"]) <= 0.001, row


def test_parakit_activation_model_counts_what_a_moe_block_saves_exactly_over_its_ep_group():
    """In one process (every choice kept) the count is exact; split over ep ranks each rank saves
    for the rows it received, and with capacity for every choice the ep group's total is exact."""
    from parakit.launcher import launch

    def saved(model, b, ep):
        import torch
        import torch.distributed as dist
        from parakit.checkpoint import saved_bytes
        from parakit.moe import ExpertParallelMoE, MoE
        from parakit.tensor_parallel import ParallelTransformerBlock
        sizes = (model.hidden, model.ffn_hidden, model.experts, model.top_k, float(model.experts))
        mlp = MoE(*sizes) if ep == 1 else ExpertParallelMoE(*sizes)
        block = ParallelTransformerBlock(model.hidden, model.heads, mlp=mlp, group=dist.new_group([dist.get_rank()]))
        torch.manual_seed(1 + dist.get_rank())
        return saved_bytes(block, torch.randn(b, model.seq, model.hidden, requires_grad=True)).forward

    model = tiny_model(experts=4, top_k=2)
    for ep in (1, 2):
        got = launch(saved, model, 2, ep, world_size=ep, backend="gloo")
        assert sum(got) == ep * layer_activation_bytes(model, Config(dp=ep, ep=ep, microbatch=2))


def test_dp4_zero1_bytes_sent_exactly_and_its_peak_where_it_moves_with_load():
    """dp4 ZeRO-1: the bytes sent are exact. Its measured peak read 1,584,400 B on rank 0 in 12 of 12 runs
    at idle (+1.4% predicted), but about 1.457 MB once in CI at load 8 (+10.2%): how much of the bucket's
    reduction is in flight at the peak depends on when gloo's thread runs. Held here to 15%; lesson 10
    prints the figure."""
    config = Config(dp=4, zero=1, microbatch=4, dtype="fp32")
    for row in compare(tiny_model(), config, measure(tiny_model(), config)):
        assert abs(row["sent_error"]) <= 0.02, row
        assert abs(row["peak_error"]) <= 0.15, row
        assert abs(row["held_error"]) <= 0.001, row


def test_tensor_parallel_within_a_node_and_pipelines_across_ranks_first_as_narayanan_et_al_measured():
    """Narayanan et al. 2021, Figure 13: a 162.2B GPT on 64 A100s (8 per node), pipeline x tensor
    degrees (2, 32) ... (32, 2): throughput peaks at tensor 8 (one node) x pipeline 8."""
    model = Model(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200)
    a100s = Cluster(devices_per_node=8, nodes=8, memory=80e9, flops=312e12, intra_bandwidth=300e9, inter_bandwidth=25e9)
    times = {t: step_time(model, a100s, Config(tp=t, pp=64 // t, microbatches=64, checkpointing="full")).total
             for t in (2, 4, 8, 16, 32)}
    assert min(times, key=times.get) == 8
    assert times[16] > times[8] and times[32] > times[16] and times[2] > times[4] > times[8]


def run_config_on_a_gpu_host(model, config):
    """run_config on a rank of gloo (the CPU) in a process that sees 4 GPUs, as on a GPU box."""
    from unittest import mock
    import torch
    from parakit.plan.measure import run_config
    with mock.patch.object(torch.cuda, "is_available", lambda: True), \
            mock.patch.object(torch.cuda, "device_count", lambda: 4):
        return run_config(model, config)


@pytest.mark.parametrize("config", [Config(dp=2, zero=1, microbatch=4, dtype="fp32"),
                                    Config(dp=4, zero=3, microbatch=2, dtype="fp32")], ids=str)
def test_on_a_gpu_host_the_peak_is_metered_on_the_cpu_its_gloo_ranks_run_on(config):
    """The ranks run gloo on the CPU; a meter of GPU 0 would read 0 bytes (lesson 10 divides by it)."""
    from parakit.launcher import launch
    on_gpu_host = launch(run_config_on_a_gpu_host, tiny_model(), config, world_size=config.devices, backend="gloo")
    for row in compare(tiny_model(), config, on_gpu_host):
        assert row["measured_peak"] > row["measured_held"] > 0, row
        assert abs(row["peak_error"]) <= 0.15, row


EMULATED_PLAN = """
import json
from parakit.plan import Config
from parakit.plan.measure import compare, measure, tiny_model
config = Config(dp=2, zero=1, microbatch=4, dtype="fp32")
print(json.dumps(compare(tiny_model(), config, measure(tiny_model(), config))))
"""


def test_on_the_emulated_gpu_box_the_peak_is_metered_on_the_cpu_its_gloo_ranks_run_on(tmp_path):
    """Lesson 10's cell on a box with 4 (emulated) GPUs: a meter of GPU 0 read 0 bytes there, and
    compare divided by it."""
    from conftest import run_script
    done = run_script(tmp_path, "import os\nos.environ['PARAKIT_EMULATE_GPUS'] = '4'\n" + EMULATED_PLAN)
    assert done.returncode == 0, done.stdout + done.stderr
    for row in json.loads(done.stdout.splitlines()[-1]):
        assert row["measured_peak"] > row["measured_held"] > 0, row
        assert abs(row["peak_error"]) <= 0.15, row


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_bytes_sent_within_2_percent(cp):
    model = Model(layers=1, hidden=64, heads=4, seq=32, vocab=2, activations="parakit")
    for row in measure_context_parallel(model, Config(cp=cp, dp=1, microbatch=2, dtype="fp32")):
        assert abs(row["sent_error"]) <= 0.02, row


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_bytes_sent_within_2_percent_with_the_rows_routed(ep):
    model = Model(layers=1, hidden=32, heads=4, seq=1024, vocab=2, ffn=64, experts=8, top_k=2, activations="parakit")
    for row in measure_expert_parallel(model, Config(dp=ep, ep=ep, microbatch=1, dtype="fp32")):
        assert abs(row["sent_error"]) <= 0.02, row
