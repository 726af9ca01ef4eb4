"""Executing a schedule on real ranks: the runtime only runs the actions it is given.

    loss = pipeline_step(model, [2, 2], batch, target, F.mse_loss, schedule="1f1b", num_microbatches=4)

Every rank of the pipeline group calls it with the whole model, batch and target; rank r
runs its stages (r, r + p, ...; in ZB-V's V, r and 2p-1-r) on micro-batches cut from the
batch, activations and their gradients travel by point-to-point send/recv, the loss is
taken on the last stage, scaled by 1/m, so that each stage's gradients equal those of one
process on the whole batch.

Each run of consecutive sends and receives in a rank's actions is posted as one batch
(`dist.batch_isend_irecv`) where it stands, and a received message is waited for only by
the compute that needs it. The schedules put both ends of every message in batches of the
same step (see schedules.py), so no batch waits on a later one: NCCL, where a send waits for
its receive and a rank's batches run one after another on one stream, cannot deadlock.

In a zero-bubble schedule the backward is split. B asks autograd for the gradient of the
stage's input (what the previous stage waits for) and of each layer's output, keeping the
graph; W then asks, layer by layer, for the weights' gradients from those output gradients,
so it redoes no part of B (except inside a layer made of several ops). Between B and W the
rank holds the layers' outputs and their gradients, and the graph's saved tensors.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from parakit.comm import P2PBatch, post_batch
from parakit.devices import CudaClock, device
from parakit.pipeline.actions import Action, Op
from parakit.pipeline.schedules import CHUNKS, SCHEDULES, Schedule, build_schedule
from parakit.pipeline.simulate import Event, Timeline, batches, check_schedule
from parakit.pipeline.split import split_stages

__all__ = ["pipeline_step", "pipeline_run", "timeline_of", "dp_pp_step", "run_schedule", "split_microbatches", "activation_shapes", "RankRun"]


@dataclass
class RankRun:
    """What one rank did in one step: its events (perf_counter seconds, comparable between
    processes on one machine; on a GPU read from CUDA events on the rank's stream), its peak
    count of stored activations, and the loss (the sum of the scaled micro-batch losses) on
    the rank holding the last stage, else None. A send's event is its posting, a receive's
    runs from its posting until its message is there for the compute that needs it."""

    events: list[Event]
    peak_activations: int
    loss: torch.Tensor | None


def split_microbatches(batch: torch.Tensor, m: int) -> list[torch.Tensor]:
    """Cut `batch` along dim 0 into m equal micro-batches (views)."""
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"num_microbatches must be a positive int, got {m!r}")
    if len(batch) % m:
        raise ValueError(f"a batch of {len(batch)} samples does not split into {m} equal micro-batches: "
                         f"choose num_microbatches dividing {len(batch)}, or a batch size that is a multiple of {m}")
    return list(batch.chunk(m))  # m x [batch/m, ...]


def activation_shapes(stages: list[nn.Module], microbatch: torch.Tensor) -> list[tuple[torch.Size, torch.dtype]]:
    """Shape and dtype of each stage's input (and, last, of the model's output) for one
    micro-batch, found on the meta device without computing anything."""
    x = torch.empty_like(microbatch, device="meta")
    shapes = [(x.shape, x.dtype)]
    with torch.no_grad():
        for stage in stages:
            params = {k: torch.empty_like(t, device="meta") for k, t in [*stage.named_parameters(), *stage.named_buffers()]}
            x = torch.func.functional_call(stage, params, (x,))
            shapes.append((x.shape, x.dtype))
    return shapes


class _Runner:
    """One rank's state while it runs its actions."""

    def __init__(self, schedule, stages, microbatches, targets, loss_fn, shapes, group, replica):
        self.schedule, self.stages, self.shapes, self.group = schedule, stages, shapes, group
        self.microbatches, self.targets, self.loss_fn = microbatches, targets, loss_fn
        self.rank = dist.get_rank(group) if schedule.num_ranks > 1 else 0
        self.inbox: dict[tuple[Op, int, int], torch.Tensor] = {}  # inputs of F and B, by (op, stage, i)
        self.outbox: dict[tuple[Op, int, int], torch.Tensor] = {}  # results another rank needs
        self.stored: dict[tuple[int, int], tuple] = {}  # (stage, i) -> (input, layer outputs) kept for B (and W)
        self.weight_work: dict[tuple[int, int], list] = {}  # (stage, i) -> [(layer output, its gradient, weights)] for W
        self.loss, self.peak = None, 0
        self.replica = replica  # a parakit.ddp wrapper of this rank's stages, or None
        weights_op = Op.W if schedule.splits_backward else Op.B  # the action that computes weight gradients
        self.last_backward = {a.stage: a.microbatch for a in schedule.actions[self.rank] if a.op is weights_op}
        self.pending: dict[tuple[Op, int, int], tuple] = {}  # input -> (buffer, its batch, its RECV action)
        self.posted: list[tuple[P2PBatch, list]] = []  # every batch of the step, with the tensors it sends

    def run(self, a: Action) -> None:
        """Execute one compute action (the communication is in `post` and `take_input`)."""
        match a.op:
            case Op.F:
                self.forward(a)
            case Op.B:
                self.backward(a) if not self.schedule.splits_backward else self.input_backward(a)
            case Op.W:
                self.weight_backward(a)

    def forward(self, a: Action) -> None:
        last = a.stage == self.schedule.num_stages - 1
        x = self.microbatches[a.microbatch] if a.stage == 0 else self.inbox.pop((Op.F, a.stage, a.microbatch))
        outputs, y = [], x
        for layer in self.stages[a.stage]:
            y = layer(y)
            outputs.append(y)  # each layer's output: W starts from its gradient
        if last:
            y = self.loss_fn(y, self.targets[a.microbatch]) / self.schedule.num_microbatches
            self.loss = y.detach() if self.loss is None else self.loss + y.detach()
        self.stored[(a.stage, a.microbatch)] = (x, y, outputs)
        self.peak = max(self.peak, len(self.stored))
        if not last:
            self._hand_on(Op.F, a.stage + 1, a.microbatch, y.detach())

    def backward(self, a: Action) -> None:
        """The whole backward of one micro-batch on one stage: input and weight gradients."""
        x, y, _ = self.stored.pop((a.stage, a.microbatch))
        grad = None if a.stage == self.schedule.num_stages - 1 else self.inbox.pop((Op.B, a.stage, a.microbatch))
        with self._synchronised_if(a.microbatch == self.last_backward[a.stage]):
            torch.autograd.backward(y, grad)
        if a.stage > 0:
            self._hand_on(Op.B, a.stage - 1, a.microbatch, x.grad)

    def input_backward(self, a: Action) -> None:
        """B of a split backward: the gradient of the stage's input and of every layer's output
        that has weights, in one pass that computes no weight gradient and keeps the graph."""
        x, y, outputs = self.stored[(a.stage, a.microbatch)]
        grad = None if a.stage == self.schedule.num_stages - 1 else self.inbox.pop((Op.B, a.stage, a.microbatch))
        layers = [(h, [w for w in layer.parameters() if w.requires_grad])
                  for layer, h in zip(self.stages[a.stage], outputs)]
        layers = [(h, weights) for h, weights in layers if weights]
        wanted = ([x] if a.stage > 0 else []) + [h for h, _ in layers]
        grads = torch.autograd.grad(y, wanted, grad, retain_graph=True) if wanted else []
        if a.stage > 0:
            self._hand_on(Op.B, a.stage - 1, a.microbatch, grads[0])
        self.weight_work[(a.stage, a.microbatch)] = [(h, g, w) for (h, w), g in zip(layers, grads[len(wanted) - len(layers):])]

    def weight_backward(self, a: Action) -> None:
        """W of a split backward: each layer's weight gradients from its output's gradient
        (accumulated into .grad), then the micro-batch's graph is let go."""
        with self._synchronised_if(a.microbatch == self.last_backward[a.stage]):
            for h, g, weights in self.weight_work.pop((a.stage, a.microbatch)):
                torch.autograd.backward(h, g, inputs=weights)
        del self.stored[(a.stage, a.microbatch)]

    def _synchronised_if(self, last: bool):
        """The replica's gradient hooks fire only in a stage's last backward of the step."""
        return self.replica.no_sync() if self.replica is not None and not last else contextlib.nullcontext()

    def _hand_on(self, op: Op, stage: int, i: int, tensor: torch.Tensor) -> None:
        """Keep a result for `stage`: in this rank's inbox if it runs there, else to send."""
        if self.schedule.rank_of(stage) == self.rank:
            self.inbox[(op, stage, i)] = tensor.requires_grad_() if op is Op.F else tensor
        else:
            self.outbox[(op, stage, i)] = tensor.contiguous()

    def post(self, run: list[Action]) -> P2PBatch:
        """Post one batch: each SEND of `run` sends one activation (F) or gradient (B) of one
        micro-batch to rank a.peer of the group, each RECV receives one into a fresh buffer."""
        ops = []
        for a in run:
            if a.op in (Op.SEND_F, Op.SEND_B):
                ops.append(("send", self.outbox.pop((a.op.compute, a.stage + a.op.step, a.microbatch)), a.peer))
            else:
                shape, dtype = self.shapes[a.stage if a.op is Op.RECV_F else a.stage + 1]
                ops.append(("recv", torch.empty(shape, dtype=dtype, device=device()), a.peer))
        batch = post_batch(ops, self.group)
        self.posted.append((batch, [tensor for kind, tensor, _ in ops if kind == "send"]))  # alive until sent
        for a, (kind, buffer, _) in zip(run, ops):
            if kind == "recv":
                self.pending[(a.op.compute, a.stage, a.microbatch)] = (buffer, batch, a)
        return batch

    def take_input(self, a: Action) -> Action | None:
        """Wait for the message compute `a` needs, if it comes by a receive still pending, and
        put it in the inbox; returns that receive's action."""
        key = (a.op, a.stage, a.microbatch)
        if key not in self.pending:
            return None
        buffer, batch, recv = self.pending.pop(key)
        batch.wait()
        self.inbox[key] = buffer.requires_grad_() if a.op is Op.F else buffer
        return recv


def run_schedule(schedule: Schedule, stages: dict[int, nn.Module], microbatches, targets, loss_fn,
                 shapes, group=None, replica=None) -> RankRun:
    """Run this rank's actions of `schedule`; `stages` maps the stage indices of this rank
    to their modules, `shapes` is `activation_shapes` of the whole model. Each send or
    receive moves one micro-batch's activation (or gradient) between two ranks of `group`:
    prod(shape) x dtype bytes; each run of consecutive sends and receives is posted as one
    batch, and a compute waits only for the message it needs. Gradients accumulate in the
    stages' parameters; `replica` (see `dp_pp_step`) synchronises them in each stage's last
    backward."""
    runner = _Runner(schedule, stages, microbatches, targets, loss_fn, shapes, group, replica)
    clock = CudaClock(device()) if device().type == "cuda" else None  # the GPU runs the work after the calls return
    mark = clock.stamp if clock else time.perf_counter
    actions, runs = schedule.actions[runner.rank], iter(batches(schedule.actions[runner.rank]))
    marks: dict[int, list] = {}  # action index -> [start, end]; a receive's end is set when its message is taken
    recv_index = {a: i for i, a in enumerate(actions) if a.op in (Op.RECV_F, Op.RECV_B)}
    for i, a in enumerate(actions):
        if a.op.is_compute:
            recv = runner.take_input(a)
            if recv is not None:
                marks[recv_index[recv]][1] = mark()
            start = mark()
            runner.run(a)
            marks[i] = [start, mark()]
        elif i == 0 or actions[i - 1].op.is_compute:  # the first of a run of sends and receives: post them all
            run, start = next(runs), mark()
            runner.post(run)
            end = mark()
            for j in range(i, i + len(run)):
                marks[j] = [start, end]
    for batch, _ in runner.posted:
        batch.wait()
    seconds = clock.seconds if clock else float
    events = [Event(runner.rank, a, seconds(marks[i][0]), seconds(marks[i][1])) for i, a in enumerate(actions)]
    return RankRun(events, runner.peak, runner.loss)


def pipeline_step(model, balance, batch, target, loss_fn, schedule: str = "1f1b", num_microbatches: int | None = None,
                  group=None):
    """One training step of `model` cut into stages by `balance`, on the ranks of `group`
    (default: the world); call it on every rank of the group with the same arguments.

    `len(balance)` stages go to p ranks: one each for "gpipe" and "1f1b", v = len(balance)/p
    each for "interleaved"; `schedule` may also be a `Schedule` built for this step.
    `num_microbatches` defaults to p. `loss_fn(output, target)` must average over its
    micro-batch. Returns the loss on the rank holding the last stage
    (None on the others) and leaves the gradients in each rank's stages, i.e. in `model`.
    Sends p2p as in `run_schedule`.
    """
    return pipeline_run(model, balance, batch, target, loss_fn, schedule, num_microbatches, group).loss


def pipeline_run(model, balance, batch, target, loss_fn, schedule: str = "1f1b", num_microbatches: int | None = None,
                 group=None, replica=None) -> RankRun:
    """`pipeline_step`, returning this rank's `RankRun` (its measured events and peak
    stored activations) instead of the loss alone."""
    p = dist.get_world_size(group) if dist.is_initialized() else 1
    stages = split_stages(model, balance)
    plan = _plan(schedule, p, len(stages), num_microbatches)
    m = plan.num_microbatches
    microbatches, targets = split_microbatches(batch, m), split_microbatches(target, m)
    rank = dist.get_rank(group) if p > 1 else 0
    mine = {s: stages[s] for s in plan.stages_of(rank)}
    if replica is not None:
        _check_replica(replica, mine)
    return run_schedule(plan, mine, microbatches, targets, loss_fn, activation_shapes(stages, microbatches[0]), group,
                        replica)


def _check_replica(replica, mine: dict[int, nn.Module]) -> None:
    wrapped = {id(q) for q in replica.module.parameters()}
    missing = sum(id(q) not in wrapped for stage in mine.values() for q in stage.parameters())
    if missing:
        raise ValueError(f"the replica wraps {len(wrapped)} parameters but misses {missing} parameters of this "
                         f"rank's stages {sorted(mine)}: wrap exactly this rank's stages "
                         f"(split_stages(model, balance)[rank::p])")


def _plan(schedule: str | Schedule, p: int, num_stages: int, num_microbatches: int | None) -> Schedule:
    """The checked schedule for p ranks and `num_stages` stages: built by name, or given."""
    if isinstance(schedule, Schedule):
        if (schedule.num_ranks, schedule.num_stages) != (p, num_stages) or num_microbatches not in (None, schedule.num_microbatches):
            raise ValueError(f"schedule {schedule.name!r} is for {schedule.num_ranks} ranks, {schedule.num_stages} stages "
                             f"and {schedule.num_microbatches} micro-batches, but this step has {p} ranks, {num_stages} "
                             f"stages and num_microbatches={num_microbatches}: build it for this step")
        return check_schedule(schedule)
    per_rank = CHUNKS.get(schedule, 1) if schedule in SCHEDULES else 1  # None: any number
    if num_stages % p or (per_rank is not None and num_stages != per_rank * p):
        needs = "a multiple of" if per_rank is None else ("" if per_rank == 1 else f"{per_rank} x")
        raise ValueError(f"balance makes {num_stages} stages for {p} ranks: schedule {schedule!r} needs "
                         f"{needs + ' ' if needs else ''}{p} stages"
                         f"{', one per rank' if per_rank == 1 else ''}; change balance or the group size")
    return check_schedule(build_schedule(schedule, p, p if num_microbatches is None else num_microbatches, num_stages // p))


def timeline_of(runs: list[RankRun]) -> Timeline:
    """The measured time line of one step, from the RankRun of every rank (in rank order)."""
    return Timeline(len(runs), [e for run in runs for e in run.events], [run.peak_activations for run in runs])


def dp_pp_step(model, balance, batch, target, loss_fn, *, pp_group, replica, schedule: str = "1f1b",
               num_microbatches: int | None = None):
    """DP x PP: `pipeline_step` of this replica's `batch` on `pp_group`, with this rank's stage
    gradients averaged over the data-parallel group by `replica`, a `parakit.ddp` wrapper of
    those stages on that group (say `BucketedDDP(stage, process_group=dp_group)`, made once).
    Its hooks stay quiet in every micro-batch's backward but a stage's last, which launches
    the all-reduces (one per bucket, overlapping the rest of that backward); sends what the
    wrapper sends, once per step. Every replica gets the same share of the global batch;
    returns this pipeline's loss."""
    loss = pipeline_run(model, balance, batch, target, loss_fn, schedule, num_microbatches, pp_group, replica).loss
    replica.finish_gradient_synchronization()
    return loss
