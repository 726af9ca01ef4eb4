"""A real training run: parakit.train's small GPT on parakit.text (the standard library's
source as bytes), with sharded checkpoints, an exact resume, global-norm clipping, and faults
on demand (lesson 11).

    torchrun --nproc-per-node 4 --max-restarts 1 -m parakit.run --dp 2 --tp 2 --steps 30 \\
        --save-every 5 --ckpt-dir ckpt --fault kill:1:7

Each step: this replica's rows of the global batch `parakit.text.batch_for(step)` through the
model, micro-batch by micro-batch (the tp all-reduces in every block; the gradients averaged
over dp by BucketedDDP once, after the last; with --pp > 1 through the pipeline, `dp_pp_step`,
stage sends included), or with --zero3 (dp only) through parakit's FullyShardedDataParallel;
then `parakit.clip.clip_grad_norm_` over the mesh (one all-reduce of a float per group) and AdamW.
The blocks' residual dropout (--dropout) draws from torch's generator, so a resumed run must
restore it to repeat the unbroken run.

Every --save-every steps, into ckpt-dir/step{N}: each rank's resume state first
(resume{rank}.pt: parakit.state.capture, the step and every generator, and the mesh), then
parakit.state.save of every parameter and AdamW moment (each rank its own file, rank 0 the index
last). At start the run loads parakit.state.latest(ckpt-dir), if any: parameters and moments
(onto whatever mesh this run has), and, on the mesh that saved them, the generators; so a group
that torchrun restarts after a rank died goes on from the last complete checkpoint, bit for bit.

Faults, for the lesson: `--fault kill:RANK:STEP` kills rank RANK (SIGKILL) right after step
STEP; `--fault save:RANK:STEP` kills it in the middle of step STEP's checkpoint (after its
resume state, before its shards: no index is written). The n-th --fault applies to torchrun's
n-th attempt (TORCHELASTIC_RESTART_COUNT), so one job can fail more than once.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from parakit import state, text
from parakit.checkpoint import segment_sizes
from parakit.clip import clip_grad_norm_
from parakit.devices import device
from parakit.groups import global_rank
from parakit.mesh import Mesh
from parakit.pipeline import dp_pp_step, split_stages
from parakit.torchrun import process_group
from parakit.train import build_model, replicate
from parakit.zero import FullyShardedDataParallel

__all__ = ["parse_args", "check_args", "Run", "build", "checkpoint_shards", "save_checkpoint", "load_checkpoint",
           "train_step", "logits_of", "heldout_loss", "sample", "train", "main"]

FAULTS = ("kill", "save")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m parakit.run", description=__doc__.split("\n")[0])
    for name, default in (("dp", 1), ("pp", 1), ("tp", 1), ("steps", 30), ("batch", 8), ("seq", 32), ("hidden", 32),
                          ("heads", 4), ("layers", 2), ("microbatches", 1), ("seed", 0), ("save-every", 0),
                          ("eval-every", 0), ("eval-batch", 16), ("sample-bytes", 0), ("log-every", 1)):
        p.add_argument(f"--{name}", type=int, default=default)
    for name, default in (("lr", 3e-3), ("max-norm", 1.0), ("dropout", 0.1), ("temperature", 0.0),
                          ("bucket-mb", 25.0)):
        p.add_argument(f"--{name}", type=float, default=default)
    p.add_argument("--zero3", action="store_true", help="ZeRO-3 (FullyShardedDataParallel) over dp; needs pp=tp=1")
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"))
    p.add_argument("--ckpt-dir", type=Path, help="folder of the checkpoints (step{N} each); resume from its latest")
    p.add_argument("--losses-to", type=Path, help="rank 0 appends one JSON line per step here: attempt, step, loss")
    p.add_argument("--prompt", default="def ", help="the start of the samples (--sample-bytes)")
    p.add_argument("--fault", action="append", default=[], metavar="KIND:RANK:STEP",
                   help="kill:RANK:STEP or save:RANK:STEP; the n-th applies to torchrun's n-th attempt")
    p.add_argument("--backend", default="auto", help="gloo, nccl, or auto")
    args = p.parse_args(argv)
    args.vocab = text.VOCAB
    return args


def _fault(spec: str, args) -> tuple[str, int, int]:
    kind, *numbers = spec.split(":")
    if kind not in FAULTS or len(numbers) != 2 or not all(n.isdigit() for n in numbers):
        raise ValueError(f"--fault {spec!r}: write kill:RANK:STEP (kill a rank after a step) or save:RANK:STEP "
                         f"(kill it in the middle of that step's checkpoint), e.g. --fault kill:1:7")
    rank, step = map(int, numbers)
    if kind == "save" and (not args.save_every or step % args.save_every):
        raise ValueError(f"--fault {spec}: step {step} saves no checkpoint (--save-every {args.save_every}): pick a "
                         f"step that is a multiple of --save-every")
    return kind, rank, step


def check_args(args, world_size: int) -> None:
    """Raise ValueError saying what to change where the arguments cannot make a run on `world_size` ranks."""
    if args.dp * args.pp * args.tp != world_size:
        raise ValueError(f"--dp {args.dp} x --pp {args.pp} x --tp {args.tp} = {args.dp * args.pp * args.tp} ranks, "
                         f"but the job has {world_size}: choose sizes whose product is {world_size}")
    if args.zero3 and (args.pp, args.tp) != (1, 1):
        raise ValueError(f"--zero3 shards the whole model over dp: use it with --pp 1 --tp 1 (got --pp {args.pp} "
                         f"--tp {args.tp})")
    if args.batch % (args.dp * args.microbatches):
        raise ValueError(f"--batch {args.batch} does not split into --dp {args.dp} x --microbatches "
                         f"{args.microbatches}: pick a multiple of {args.dp * args.microbatches}")
    if args.hidden % args.heads or args.heads % args.tp:
        raise ValueError(f"--hidden {args.hidden}, --heads {args.heads}, --tp {args.tp}: heads must divide hidden and "
                         f"tp must divide heads")
    if args.layers + 2 < args.pp:
        raise ValueError(f"{args.layers + 2} layers cannot fill --pp {args.pp} stages: use --layers >= {args.pp - 2}")
    if min(args.steps, args.save_every, args.eval_every, args.sample_bytes, args.log_every, args.temperature) < 0 \
            or not 0 <= args.dropout < 1 or not args.bucket_mb > 0:
        raise ValueError("--steps, --save-every, --eval-every, --sample-bytes, --log-every and --temperature must be "
                         ">= 0, --dropout in [0, 1), --bucket-mb > 0")
    if args.save_every and args.ckpt_dir is None:
        raise ValueError(f"--save-every {args.save_every} needs --ckpt-dir: the folder the checkpoints go to")
    for spec in args.fault:
        kind, rank, step = _fault(spec, args)
        if not (0 <= rank < world_size and 1 <= step <= args.steps):
            raise ValueError(f"--fault {spec}: the rank must be in 0..{world_size - 1} and the step in 1..{args.steps}")


@dataclass
class Run:
    """One rank's part of the run: its mesh, the whole model (this rank's tp slices), the
    stages it runs (`mine`, layer indices `layers`), the optimizer and the gradient averager."""
    args: argparse.Namespace
    mesh: Mesh
    model: nn.Sequential
    balance: list[int]
    layers: list[int]
    mine: nn.Module
    optimizer: torch.optim.Optimizer
    replica: object

    @property
    def last_stage(self) -> bool:
        return self.mesh.pp_rank == self.args.pp - 1


def build(args) -> Run:
    """The model from args.seed (every generator seeded), split and wrapped for this rank."""
    check_args(args, dist.get_world_size())
    mesh = Mesh(args.dp, args.pp, args.tp)
    model = build_model(args, mesh.tp_group)  # seeds torch's generator with args.seed
    for block in model[1:-1]:
        block.drop.p = args.dropout  # the residual dropout, from torch's default generator
    balance = segment_sizes(len(model), args.pp)
    first = sum(balance[:mesh.pp_rank])
    layers = list(range(first, first + balance[mesh.pp_rank]))
    if args.zero3:
        mine = replica = FullyShardedDataParallel(model, units=list(model), group=mesh.dp_group)
    else:
        mine = nn.ModuleList(split_stages(model, balance)[mesh.pp_rank])
        replica = replicate(mine, mesh, args.bucket_mb)
    optimizer = torch.optim.AdamW(mine.parameters(), lr=args.lr, foreach=False)
    for p in mine.parameters():  # the moments exist from the start, so that a checkpoint can hold them
        optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                              "exp_avg_sq": torch.zeros_like(p)}
    return Run(args, mesh, model, balance, layers, mine, optimizer, replica)


def checkpoint_shards(run: Run) -> list[state.Shard]:
    """Every parameter and AdamW moment this rank holds, named by the whole model's layer
    index (the same names on every mesh): `2.mlp.fc1.weight`, `exp_avg.2.mlp.fc1.weight`, ...,
    and the optimizer's step count `adamw.step`."""
    if run.args.zero3:
        params = state.fsdp_shards(run.mine)
        moments = {k: state.fsdp_shards(run.mine, f"{k}.", [run.optimizer.state[u.shard][k] for u in run.mine.units])
                   for k in ("exp_avg", "exp_avg_sq")}
        steps = [run.optimizer.state[u.shard]["step"] for u in run.mine.units]
    else:
        by_param = {}
        params = []
        for index, layer in zip(run.layers, run.mine):
            shards = state.tensor_parallel_shards(layer, run.mesh.tp_group, run.mesh.dp_group, prefix=f"{index}.")
            by_param.update({id(p): s for p, s in zip(layer.parameters(), shards)})
            params += shards
        moments = {k: [state.Shard(f"{k}.{s.name}", run.optimizer.state[p][k], s.global_shape, s.offsets, s.lengths,
                                   s.flat, s.writes) for p in run.mine.parameters() for s in [by_param[id(p)]]]
                   for k in ("exp_avg", "exp_avg_sq")}
        steps = [run.optimizer.state[p]["step"] for p in run.mine.parameters()]
    return params + moments["exp_avg"] + moments["exp_avg_sq"] + [state.replicated("adamw.step", steps[0])]


def _sizes(run: Run) -> dict[str, int]:
    return {"dp": run.args.dp, "pp": run.args.pp, "tp": run.args.tp, "zero3": int(run.args.zero3)}


def save_checkpoint(run: Run, step: int, die: bool = False) -> Path:
    """ckpt-dir/step{step}: this rank's resume state, then the sharded state, index last.
    `die`: this rank is killed between the two (the --fault save:RANK:STEP)."""
    folder = run.args.ckpt_dir / f"step{step}"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"resume": state.capture(step, run.args.seed), "mesh": _sizes(run)},
               folder / f"resume{dist.get_rank()}.pt")
    if die:
        _die(f"in the middle of step {step}'s checkpoint (its resume state written, not its shards)")
    state.save(folder, checkpoint_shards(run))
    return folder


def _resume_record(run: Run, folder: Path) -> tuple[dict | None, dict]:
    """(this rank's saved record, or None where the saving mesh had fewer ranks; the resume state
    of rank 0, which holds the step and the seed). Raises what is wrong with them."""
    mine, first = folder / f"resume{dist.get_rank()}.pt", folder / "resume0.pt"
    if not first.is_file():
        raise state.CheckpointError(f"{folder} has no resume state ({first.name}): it was not written by parakit.run; "
                                    f"load it with parakit.state.load")
    record = torch.load(mine, weights_only=True) if mine.is_file() else None
    resume = (record or torch.load(first, weights_only=True))["resume"]
    if resume["seed"] != run.args.seed:
        raise ValueError(f"{folder} is a checkpoint of a run with --seed {resume['seed']}, this run has --seed "
                         f"{run.args.seed}: pass --seed {resume['seed']} (the data order follows it), or another "
                         f"--ckpt-dir")
    return record, resume


def load_checkpoint(run: Run, folder: Path) -> int:
    """Load `folder` into the run; returns the step to go on from. Everything is checked
    before anything changes: every rank reads its resume state and they agree (one
    all_gather_object of the problems), then parakit.state.load (which changes nothing unless
    every rank can load), then the generators, on the mesh that saved them."""
    try:
        (record, resume), problem = _resume_record(run, folder), None
    except (OSError, RuntimeError, ValueError) as error:  # a damaged or foreign file, another seed
        record, resume, problem = None, None, error
    _agree(problem)
    state.load(folder, checkpoint_shards(run))
    first = next(iter(run.mine.parameters()))
    for p in run.mine.parameters():  # one step count for every parameter, as AdamW keeps it
        run.optimizer.state[p]["step"] = run.optimizer.state[first]["step"].clone()
    if record is not None and record["mesh"] == _sizes(run):
        return state.restore(resume, run.args.seed)
    if dist.get_rank() == 0:
        print(f"resumed {folder} (saved at {record['mesh'] if record else 'another mesh'}) on {_sizes(run)}: "
              f"parameters and moments resharded; the generators are per rank and not restored, so the run goes on, "
              f"but not bit for bit", flush=True)
    return resume["step"]


def _lm_loss(logits, target):  # [batch, seq, vocab], [batch, seq]
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _global_loss(loss, run: Run) -> float:
    """The mean over the replicas of the last stages' losses (each tp rank holds the same): one all-reduce of a
    float."""
    total = torch.zeros(1, device=device()) if loss is None else loss.detach().reshape(1).clone()
    dist.all_reduce(total)
    return total.item() / (run.args.dp * run.args.tp)


def _rows(run: Run, step: int, batch: int, split: str = "train"):
    """This replica's rows of the global batch of `step`: ids and targets, each [batch/dp, seq]."""
    ids, target = text.batch_for(step, batch, run.args.seq, run.args.seed, split)
    return ids.chunk(run.args.dp)[run.mesh.dp_rank], target.chunk(run.args.dp)[run.mesh.dp_rank]


def train_step(run: Run, step: int) -> tuple[float, float]:
    """Step `step` (0-based): forward and backward, clipping, AdamW. Returns (the global mean
    loss, the gradients' global norm before clipping), the same on every rank."""
    ids, target = _rows(run, step, run.args.batch)  # [batch/dp, seq]
    run.optimizer.zero_grad(set_to_none=True)
    if run.args.pp > 1:
        loss = dp_pp_step(run.model, run.balance, ids, target, _lm_loss, pp_group=run.mesh.pp_group,
                          replica=run.replica, schedule=run.args.schedule, num_microbatches=run.args.microbatches)
    else:  # the whole model here: its micro-batches one after another, the gradients averaged over dp once
        loss, m = 0.0, run.args.microbatches
        for i, (ids_m, target_m) in enumerate(zip(ids.chunk(m), target.chunk(m))):
            quiet = run.replica.no_sync() if i < m - 1 and not run.args.zero3 else contextlib.nullcontext()
            with quiet:
                part = _lm_loss(run.mine(ids_m) if run.args.zero3 else run.model(ids_m), target_m) / m
                part.backward()
            if run.args.zero3:
                run.mine.finish_gradient_synchronization()  # ZeRO-3 reduce-scatters each micro-batch's gradients
            loss = loss + part.detach()
        if not run.args.zero3:
            run.replica.finish_gradient_synchronization()
    norm = clip_grad_norm_(run.mine, run.args.max_norm, run.mesh)
    run.optimizer.step()
    return _global_loss(loss, run), norm.item()


@torch.no_grad()
def logits_of(run: Run, ids: torch.Tensor) -> torch.Tensor | None:
    """The model's logits for ids [rows, seq] on the last pipeline stage ([rows, seq, vocab]),
    None on the others, in eval mode (no dropout, no generator drawn). Sends each stage's output
    to the next stage: rows x seq x hidden floats."""
    run.mine.eval()
    try:
        x, pp = ids, run.mesh.pp_group
        if run.mesh.pp_rank > 0:
            x = torch.empty(*ids.shape, run.args.hidden, device=device())  # [rows, seq, hidden]
            dist.recv(x, src=global_rank(pp, run.mesh.pp_rank - 1), group=pp)
        x = run.mine(x) if run.args.zero3 else _through(run.mine, x)
        if not run.last_stage:
            dist.send(x.contiguous(), dst=global_rank(pp, run.mesh.pp_rank + 1), group=pp)
            return None
        return x
    finally:
        run.mine.train()


def _through(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def heldout_loss(run: Run) -> float:
    """The mean loss on the held-out files' batch 0 (--eval-batch windows), the same on every rank."""
    ids, target = _rows(run, 0, run.args.eval_batch, "heldout")
    logits = logits_of(run, ids)
    return _global_loss(None if logits is None else _lm_loss(logits, target), run)


def sample(run: Run, prompt: bytes, length: int, temperatures=(0.0,), seed: int = 0) -> list[bytes]:
    """For each temperature, `length` bytes after `prompt`: each the most probable next byte
    (temperature 0) or drawn at that temperature from a generator of its own (torch's stays
    where it was); one row of a batch each, the model seeing the last --seq bytes. Every rank
    returns the same bytes: the last stage broadcasts each step's bytes over its pp group."""
    draw, rows = torch.Generator().manual_seed(seed), len(temperatures)
    ids = torch.tensor(list(prompt), device=device()).repeat(rows, 1)  # [rows, len(prompt)]
    for _ in range(length):
        logits = logits_of(run, ids[:, -run.args.seq:])
        nxt = torch.zeros(rows, 1, dtype=torch.long, device=device())  # [rows, 1]
        if logits is not None:
            for row, (last, t) in enumerate(zip(logits[:, -1].float().cpu(), temperatures)):  # [vocab] each
                nxt[row] = int(last.argmax()) if t == 0 else int(torch.multinomial((last / t).softmax(-1), 1,
                                                                                     generator=draw))
        if run.args.pp > 1:
            dist.broadcast(nxt, src=global_rank(run.mesh.pp_group, run.args.pp - 1), group=run.mesh.pp_group)
        ids = torch.cat([ids, nxt], dim=1)
    return [bytes(row[len(prompt):].tolist()) for row in ids]


def _die(where: str) -> None:
    print(f"[fault] rank {dist.get_rank()} killed {where}", flush=True)
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _agree(problem: Exception | None) -> None:
    """Raise on every rank the first problem any rank met (one all_gather_object of the messages), so that no rank
    goes on to a collective the others never reach."""
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, None if problem is None else (type(problem).__name__, str(problem)))
    found = next((p for p in problems if p), None)
    if found:
        raise (ValueError if found[0] == "ValueError" else state.CheckpointError)(found[1])


def _unwritable(folder: Path) -> Exception | None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe{dist.get_rank()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        return state.CheckpointError(f"--ckpt-dir {folder}: cannot write there ({error.strerror or error}): pick a "
                                     f"folder this process can create and write")
    return None


@contextlib.contextmanager
def _one_thread():
    """One intra-op thread, as torchrun gives each rank (OMP_NUM_THREADS=1): the same sums in any launcher."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train(args) -> dict:
    """Run (or resume) the job on the initialised world. Every rank returns {"attempt",
    "start" (the step it went on from), "steps", "loss", "norm", "heldout" ([step, loss]
    pairs), "samples" ({"before": ..., "after": ...} with --sample-bytes, on the sampling
    replica's ranks)}."""
    check_args(args, dist.get_world_size())
    faults = [_fault(spec, args) for spec in args.fault]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    kind, victim, at = faults[attempt] if attempt < len(faults) else (None, -1, -1)
    mine = dist.get_rank() == victim
    with _one_thread():
        run = build(args)
        start = 0
        if args.ckpt_dir is not None:
            _agree(_unwritable(args.ckpt_dir))
            folder = state.latest(args.ckpt_dir)
            start = load_checkpoint(run, folder) if folder is not None else 0
            _report_resume(args.ckpt_dir, folder, start)
        out = {"attempt": attempt, "start": start, "steps": [], "loss": [], "norm": [], "heldout": [], "samples": {}}
        # one replica samples (every dp rank under ZeRO-3, whose forward gathers over dp)
        prompt, sampling = args.prompt.encode(), args.sample_bytes and (run.mesh.dp_rank == 0 or args.zero3)
        if sampling:
            out["samples"]["before"] = sample(run, prompt, args.sample_bytes)[0].decode(errors="replace")
        for step in range(start, args.steps):
            loss, norm = train_step(run, step)
            for key, value in (("steps", step + 1), ("loss", loss), ("norm", norm)):
                out[key].append(value)
            _log(args, attempt, step + 1, loss)
            if kind == "kill" and mine and step + 1 == at:
                _die(f"after step {at}")
            if args.eval_every and (step + 1) % args.eval_every == 0:
                out["heldout"].append([step + 1, heldout_loss(run)])
            if args.save_every and (step + 1) % args.save_every == 0:
                save_checkpoint(run, step + 1, die=kind == "save" and mine and step + 1 == at)
        if sampling:
            temperatures = (0.0, args.temperature) if args.temperature else (0.0,)
            after = sample(run, prompt, args.sample_bytes, temperatures, args.seed)
            names = ["after", f"after, temperature {args.temperature:g}"]
            out["samples"].update({name: raw.decode(errors="replace") for name, raw in zip(names, after)})
    return out


def _report_resume(root: Path, folder: Path | None, start: int) -> None:
    """Rank 0 says where the run goes on from, and which newer folders it skipped (saves that did not finish)."""
    if dist.get_rank() != 0:
        return
    for skipped in sorted(p for p in root.iterdir() if p.is_dir() and not state.is_complete(p)):
        print(f"skipped {skipped.name}: no index.json, a save that did not finish (it holds "
              f"{', '.join(sorted(f.name for f in skipped.iterdir()))})", flush=True)
    if folder is not None:
        print(f"resumed from {folder.name}: step {start}", flush=True)


def _log(args, attempt: int, step: int, loss: float) -> None:
    if dist.get_rank() != 0:
        return
    if args.log_every and step % args.log_every == 0:
        print(f"step {step} loss {loss:.6f}", flush=True)
    if args.losses_to:
        with open(args.losses_to, "a") as f:
            f.write(json.dumps({"attempt": attempt, "step": step, "loss": loss}) + "\n")


def main(argv=None) -> dict:
    """Entry point under torchrun (or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR/PORT),
    or on parakit.launch's ranks."""
    args = parse_args(argv)
    with process_group(args.backend):
        return train(args)


if __name__ == "__main__":
    main()
