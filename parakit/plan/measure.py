"""The planner against real ranks: parakit.train's tiny transformer trained one step on a
configuration (dp x pp x cp x tp with BucketedDDP and a pipeline schedule, cp by ring
attention in the blocks, ep by experts split over ranks, or dp alone at a ZeRO stage, blocks
checkpointed or not), measured
on every rank: bytes written on the wire by the OS (`comm.CommLog.written_bytes`, gloo), the
ring model's bytes, and the peak of live tensor bytes on the device the rank runs on
(`side_by_side.rank_meter`, the CPU's under gloo even on a GPU host: parameters, gradients,
optimizer state and everything the step allocates). `compare` puts the planner's predictions
beside them.
"""
from __future__ import annotations

from argparse import Namespace
from dataclasses import replace

import torch
from torch import nn

from parakit import comm
from parakit.checkpoint import Checkpointed, segment_sizes
from parakit.launcher import launch
from parakit.mesh import Mesh
from parakit.pipeline import dp_pp_step, split_stages
from parakit.plan.memory import memory
from parakit.plan.spec import DTYPES, Config, Model
from parakit.plan.time import traffic
from parakit.side_by_side import rank_meter
from parakit.zero.fsdp import FullyShardedDataParallel
from parakit.zero.optimizer import ShardedOptimizer

__all__ = ["tiny_model", "run_config", "measure", "compare", "measure_context_parallel", "measure_expert_parallel"]


def tiny_model(layers: int = 2, hidden: int = 64, heads: int = 4, seq: int = 16, vocab: int = 64,
               experts: int = 1, top_k: int = 1) -> Model:
    """parakit.train's model as the planner sees it: learned positions, the vocabulary
    replicated on every tp rank, an output bias, the fp32 "parakit" activation model."""
    return Model(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab, experts=experts, top_k=top_k,
                 positions=True, vocab_parallel=False, head_bias=True, activations="parakit")


def _args(model: Model, config: Config) -> Namespace:
    return Namespace(seed=0, vocab=model.vocab, seq=model.seq, hidden=model.hidden, heads=model.heads,
                     layers=model.layers, batch=config.global_batch, experts=model.experts, top_k=model.top_k)


def _lm_loss(logits, target):  # [batch, seq, vocab], [batch, seq]
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def run_config(model: Model, config: Config) -> dict:
    """On each rank (inside parakit.launch): two steps, the second measured. `config.ddp_buckets` should be True at ZeRO 0 (BucketedDDP). Returns
    {"written": OS bytes written, "wire": ring-model bytes, "all_to_all": the all-to-alls' bytes
    (exact: the rows the routing sent off the rank), "peak": peak live bytes, "stage": pp rank}."""
    from parakit.train import build_model, local_batch, replicate  # the trainer's own model, data and replicas
    if config.ep > 1 and config.zero:
        raise ValueError(f"ep={config.ep} with ZeRO-{config.zero}: parakit's ZeRO shards over the replica group, "
                         f"which holds different experts; measure ep at zero=0")
    args = _args(model, config)
    mesh = Mesh(config.dp, config.pp, config.tp, config.cp, config.ep)
    net = build_model(args, mesh.tp_group, mesh.cp_group, mesh.ep_group)
    if config.checkpointing == "full":
        net = nn.Sequential(net[0], *(Checkpointed(block) for block in net[1:-1]), net[-1])
    balance = segment_sizes(len(net), config.pp)
    mine = nn.ModuleList(split_stages(net, balance)[mesh.pp_rank])
    if config.zero == 3:
        mine = net = FullyShardedDataParallel(net, units=list(net.children()), group=mesh.replica_group)
    if config.zero in (1, 2):
        optimizer = ShardedOptimizer(mine.parameters(), torch.optim.AdamW, stage=config.zero, group=mesh.replica_group,
                                     foreach=False)
    else:
        optimizer = torch.optim.AdamW(mine.parameters(), foreach=False)
    replica = replicate(mine, mesh) if config.zero == 0 else None
    buckets = [b.buffer for w in getattr(replica, "wrappers", [replica]) for b in w.buckets] if replica else []
    for step in range(2):
        ids, target = local_batch(step, args, mesh)  # [batch/dp, seq/cp]
        optimizer.zero_grad(set_to_none=True)
        held = [*mine.parameters(), *(t for s in optimizer.state.values() for t in s.values()
                                      if isinstance(t, torch.Tensor))]
        with comm.CommLog() as log, rank_meter() as meter:  # the device this rank runs on, not GPU 0
            meter.place(held + buckets, meter.devices[0].index)
            if replica is not None:
                dp_pp_step(net, balance, ids, target, _lm_loss, pp_group=mesh.pp_group, replica=replica,
                           schedule=config.schedule, num_microbatches=config.microbatches)
            else:  # ZeRO: each micro-batch's forward and backward, the gradients accumulated
                for ids_m, target_m in zip(ids.chunk(config.microbatches), target.chunk(config.microbatches)):
                    (_lm_loss(net(ids_m), target_m) / config.microbatches).backward()
                    if config.zero == 3:
                        net.finish_gradient_synchronization()
            optimizer.step()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}  # views count once
    return {"written": log.written_bytes(), "wire": log.wire_bytes(), "peak": meter.peaks()[0], "stage": mesh.pp_rank,
            "held": sum(storages.values()),
            "all_to_all": sum(r.wire_bytes for r in log.records if r.op.startswith("all_to_all"))}


def measure(model: Model, config: Config) -> list[dict]:
    """`run_config` on dp x pp x cp x tp ranks of gloo; one dict per rank."""
    if config.zero in (1, 2) and config.microbatches > 1:
        raise ValueError(f"ZeRO-{config.zero} with {config.microbatches} micro-batches: parakit's ShardedOptimizer "
                         f"reduces as the first backward ends (stage 2 refuses a second); measure it at microbatches=1, "
                         f"or accumulate with zero=3 or zero=0")
    return launch(run_config, model, config, world_size=config.devices, backend="gloo")


GLOO_FRAMING = {"all_reduce": 576, "all_gather": 288, "all_to_all": 144, "send": 144}  # bytes per call and peer step


def gloo_sent(model: Model, config: Config, stage: int) -> float:
    """The planner's bytes sent by pipeline rank `stage`, as gloo sends them: the traffic of
    `plan.traffic(..., backend="gloo")` plus gloo's headers, fitted once to the OS's counts on
    2 and 4 ranks (`GLOO_FRAMING`: each all-reduce writes 576 (n-1) bytes of them, each
    all-gather 288 (n-1), each all-to-all 144 (n-1), each send 144)."""
    return sum(c.sent + c.count * GLOO_FRAMING.get(c.op, 0) * (c.size - 1 if c.op != "send" else 1)
               for c in traffic(model, config, stage, backend="gloo"))


def compare(model: Model, config: Config, measured: list[dict]) -> list[dict]:
    """Each rank's predicted and measured bytes sent and peak bytes, and the errors
    (predicted / measured - 1). With experts the planner assumes the routers spread the
    choices evenly; "routed" is its prediction with the all-to-alls' bytes the routing really
    sent (exact, from the splits), "routed_error" its error. "held" is the parameters and
    optimizer state at rest, which the planner predicts for the rank of each pipeline stage
    that holds most (ZeRO-1/2's largest owner): "held_error" is against that rank's."""
    rows, most = [], {}
    for got in measured:
        most[got["stage"]] = max(most.get(got["stage"], 0), got["held"])
    for rank, got in enumerate(measured):
        stage = got["stage"]
        sent = gloo_sent(model, config, stage)
        even = sum(c.sent for c in traffic(model, config, stage, backend="gloo") if c.op == "all_to_all")
        routed = sent - even + got["all_to_all"]
        predicted = memory(model, None, config, stage, backend="gloo")
        peak, held = predicted.peak, predicted.items["parameters"] + predicted.items["optimizer"]
        written = got["written"] or float("nan")
        rows.append({"rank": rank, "sent": sent, "written": got["written"], "wire": got["wire"],
                     "sent_error": sent / written - 1, "routed": routed, "routed_error": routed / written - 1,
                     "peak": peak, "measured_peak": got["peak"], "peak_error": peak / got["peak"] - 1,
                     "held": held, "measured_held": got["held"], "held_error": held / most[stage] - 1})
    return rows


def _ring_attention_step(model: Model, config: Config) -> int:
    """On each rank: one forward and backward of a ContextParallelSelfAttention layer (lesson
    08's ring attention, zig-zag) on this rank's [microbatch, seq/cp, hidden]; the OS's bytes."""
    from parakit.context_parallel import ContextParallelSelfAttention
    torch.manual_seed(0)
    layer = ContextParallelSelfAttention(model.hidden, model.heads)
    x = torch.randn(config.microbatch, model.seq // config.cp, model.hidden, requires_grad=True)  # [b, seq/cp, hidden]
    with comm.CommLog() as log:
        layer(x).sum().backward()
    return log.written_bytes()


def measure_context_parallel(model: Model, config: Config) -> list[dict]:
    """Ring attention's bytes on `config.cp` gloo ranks, one layer and micro-batch, against the
    planner's cp term (with gloo's framing per message): [{"rank", "sent", "written", "sent_error"}].
    Only the attention layer runs, so only the cp traffic is compared (no peak)."""
    one = replace(config, microbatches=1)
    layer = replace(model, layers=1)
    sent = sum(c.sent + c.count * GLOO_FRAMING["send"] for c in traffic(layer, one) if c.group == "cp")
    written = launch(_ring_attention_step, layer, one, world_size=config.cp, backend="gloo")
    return [{"rank": r, "sent": sent, "written": w, "sent_error": sent / w - 1} for r, w in enumerate(written)]


def _moe_step(model: Model, config: Config) -> tuple[int, int]:
    """On each rank: one forward and backward of lesson 09's ExpertParallelMoE (capacity for
    every choice: nothing dropped) on this rank's microbatch x seq tokens; (the OS's bytes,
    the rows its four row all-to-alls send off the rank: its choices for other ranks' experts
    out and back, dispatch and combine, and as many for the choices it received)."""
    from parakit.moe import ExpertParallelMoE
    from parakit.moe.layer import by_expert
    torch.manual_seed(0)
    layer = ExpertParallelMoE(model.hidden, model.ffn_hidden, model.experts, model.top_k,
                              capacity_factor=float(model.experts))
    torch.manual_seed(1 + torch.distributed.get_rank())
    x = torch.randn(config.microbatch * model.seq, model.hidden, requires_grad=True)  # [tokens, hidden]
    with comm.CommLog() as log:
        layer(x).sum().backward()
    rank, n = torch.distributed.get_rank(), config.ep
    sent = by_expert(layer.routing.experts, layer.routing.slots, model.experts)[1].view(n, -1).sum(1)  # [n] rows to each rank
    received = layer.recv_counts.sum(1)  # [n] rows from each rank
    off_rank = sent.sum() - sent[rank] + received.sum() - received[rank]
    return log.written_bytes(), 2 * int(off_rank)


def measure_expert_parallel(model: Model, config: Config) -> list[dict]:
    """Expert parallelism's bytes on `config.ep` gloo ranks, one MoE layer and micro-batch,
    against the planner's ep term (with gloo's framing per call): dispatch and combine, forward
    and backward, each sending (ep-1)/ep of the rank's tokens x top_k, and the counts. The
    planner assumes the router spreads choices evenly ("even", "even_error"); "sent" is the
    same term with the rows this rank's router and the others' really sent off it."""
    one = replace(config, microbatches=1, dp=config.ep)
    layer = replace(model, layers=1)
    calls = [c for c in traffic(layer, one) if c.group == "ep"]
    even = sum(c.sent + c.count * GLOO_FRAMING["all_to_all"] * (c.size - 1) for c in calls)
    row = model.hidden * DTYPES[config.dtype][3]
    even_rows = calls[0].sent / row  # 4 (ep-1)/ep tokens x top_k
    rows = []
    for r, (written, off_rank) in enumerate(launch(_moe_step, layer, one, world_size=config.ep, backend="gloo")):
        sent = even + (off_rank - even_rows) * row
        rows.append({"rank": r, "sent": sent, "written": written, "sent_error": sent / written - 1,
                     "even": even, "even_error": even / written - 1})
    return rows
