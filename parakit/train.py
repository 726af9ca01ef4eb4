"""3D hybrid parallelism: train a tiny transformer language model on a DP x PP x TP mesh.

    torchrun --nproc-per-node 8 -m parakit.train --dp 2 --pp 2 --tp 2 --steps 5
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m parakit.train --dp 2 --pp 2 --tp 2 --steps 5 --save ckpt

Each step: the pipeline (`parakit.pipeline.dp_pp_step`) runs this replica's share of the
batch through the stages of its pp group, micro-batch by micro-batch, with activations and
their gradients sent between stages; inside every block the tp group all-reduces
(`parakit.tensor_parallel.ParallelTransformerBlock`: heads and MLP columns split across
it); after the last micro-batch's backward parakit's BucketedDDP all-reduces the stage
gradients over the dp group, bucket by bucket, once per step. With --cp (context parallelism)
each rank holds its zig-zag share of every sequence, attention passes K and V around the cp
group (`parakit.context_parallel.ring_attention`), and the gradients are averaged over the
dp x cp group. With --experts every MLP is a mixture of experts (`parakit.moe`), and with
--ep its experts are split over ep ranks that hold different tokens (ep divides dp x cp):
tokens reach their experts by all-to-all, each expert's gradients are averaged over the ranks
holding it. The model is built from one seed and sharded, so any mesh trains the same
numbers as one process (--dp 1 --pp 1 --tp 1).
The data is synthetic and drawn from (seed, step), so a resumed run sees the same batches.
"""
from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from parakit.checkpoint import segment_sizes
from parakit.context_parallel import shard_sequence
from parakit.ddp import BucketedDDP, allreduce_hook
from parakit.devices import device
from parakit.mesh import Mesh
from parakit.moe import ExpertParallelMoE, MoE
from parakit.pipeline import dp_pp_step, split_stages
from parakit.tensor_parallel import ParallelTransformerBlock
from parakit.torchrun import process_group

__all__ = ["parse_args", "build_model", "batch_for", "local_batch", "replicate", "train", "main"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m parakit.train", description=__doc__.split("\n")[0])
    for name, default in (("dp", 1), ("pp", 1), ("tp", 1), ("cp", 1), ("ep", 1), ("steps", 5), ("batch", 16),
                          ("seq", 16), ("vocab", 64), ("hidden", 32), ("heads", 4), ("layers", 2), ("experts", 1),
                          ("top-k", 1), ("microbatches", 2), ("seed", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="BucketedDDP's bucket size for the dp all-reduces")
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"))
    p.add_argument("--outer", default="dp", choices=("dp", "pp"),
                   help="the outermost mesh dimension (parakit.mesh.Mesh's outer): dp replicas, or pp stages")
    p.add_argument("--backend", default="auto", help="gloo, nccl, or auto: nccl when every rank on this node has a GPU")
    p.add_argument("--save", type=Path, help="folder for a checkpoint after the last step")
    p.add_argument("--resume", type=Path, help="folder of a checkpoint to start from")
    p.add_argument("--losses-to", type=Path, help="write the losses here as JSON (rank 0)")
    return p.parse_args(argv)


class Embedding(nn.Module):
    """Token and position embeddings, replicated on every tp rank: [batch, seq] -> [batch, seq, hidden].
    With a `cp_group` the tokens are this rank's zig-zag share of the sequence, [batch, seq/cp],
    and take their positions in the whole."""

    def __init__(self, vocab: int, seq: int, hidden: int, cp_group=None):
        super().__init__()
        self.token, self.position = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.cp_group = cp_group

    def forward(self, ids):
        n = 1 if self.cp_group is None else dist.get_world_size(self.cp_group)
        at = torch.arange(ids.shape[1] * n, device=ids.device)  # [seq]
        at = at if self.cp_group is None else _cp_share(at, self.cp_group, 0)  # [seq/cp]
        return self.token(ids) + self.position(at)


class Head(nn.Module):
    """Final layer norm and the vocabulary projection: [batch, seq, hidden] -> [batch, seq, vocab]."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(hidden), nn.Linear(hidden, vocab)

    def forward(self, x):
        return self.out(self.norm(x))


def build_model(args, tp_group=None, cp_group=None, ep_group=None) -> nn.Sequential:
    """The model as a Sequential of layers (embedding, blocks, head) from `args.seed`. The
    blocks are tensor-parallel over `tp_group` (None: the world): each rank keeps its slice
    of the dense weights made from the same seed, so every tp size computes the same model.
    With a `cp_group` (None: no context parallelism) the model takes this rank's zig-zag
    share of the sequence (`local_batch`) and attends over the whole by ring attention.
    With `args.experts` > 1 each block's MLP is a mixture of experts, split over `ep_group`
    (None: all of them here); no token is dropped (capacity for every choice), so every ep
    routes as one process does."""
    experts = getattr(args, "experts", 1)
    if experts > 1 and tp_group is not None and dist.get_world_size(tp_group) > 1:
        raise ValueError(f"--experts {experts} with --tp {dist.get_world_size(tp_group)}: parakit.train's experts are "
                         f"not split over tp (every tp rank would run every expert); use --tp 1 with experts, "
                         f"or --experts 1")
    torch.manual_seed(args.seed)
    layers = [Embedding(args.vocab, args.seq, args.hidden, cp_group)]
    for _ in range(args.layers):  # each MoE is drawn whole (then sliced), before its block: the same for every ep
        moe = None if experts == 1 else _moe(args, ep_group)
        layers.append(ParallelTransformerBlock(args.hidden, args.heads, group=tp_group, cp_group=cp_group, mlp=moe))
    layers.append(Head(args.hidden, args.vocab))
    return nn.Sequential(*layers).to(device())


def _moe(args, ep_group) -> nn.Module:
    sizes = (args.hidden, 4 * args.hidden, args.experts, args.top_k, float(args.experts))  # capacity: every choice
    return MoE(*sizes) if ep_group is None else ExpertParallelMoE(*sizes, group=ep_group)


def batch_for(step: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: counting sequences (next token = token + 1 mod vocab) from
    random starts, drawn from (seed, step). Returns ids and targets, each [batch, seq]."""
    g = torch.Generator().manual_seed(args.seed * 100_003 + step)
    start = torch.randint(0, args.vocab, (args.batch, 1), generator=g)
    tokens = (start + torch.arange(args.seq + 1)) % args.vocab  # [batch, seq + 1]
    return tokens[:, :-1].to(device()), tokens[:, 1:].to(device())


def _cp_share(x: torch.Tensor, cp_group, dim: int) -> torch.Tensor:
    """This cp rank's zig-zag share of x along `dim` (no communication)."""
    return shard_sequence(x, dist.get_world_size(cp_group), dist.get_rank(cp_group), "zigzag", dim)


def local_batch(step: int, args, mesh: Mesh) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of `batch_for(step)`: its replica's rows, and with cp its zig-zag
    share of the sequence (no communication): ids and targets, each [batch/dp, seq/cp]."""
    ids, target = (t.chunk(mesh.dp)[mesh.dp_rank] for t in batch_for(step, args))  # [batch/dp, seq]
    if mesh.cp_group is None:
        return ids, target
    return _cp_share(ids, mesh.cp_group, 1), _cp_share(target, mesh.cp_group, 1)  # [batch/dp, seq/cp]


class _ExpertReplicas:
    """Gradient averaging of a stage whose experts are split over ep ranks: BucketedDDP over
    the replica group (dp x cp ranks) for everything but the experts, and over the
    expert-replica group (dp x cp / ep ranks holding the same experts) for the experts'
    gradients, divided by ep as well: an expert's gradient already sums the tokens of its ep
    group, and the mean is over every token of the replica group."""

    def __init__(self, stage: nn.Module, mesh: Mesh, bucket_mb: float):
        experts = {id(p) for m in stage.modules() if isinstance(m, ExpertParallelMoE) for p in m.experts.parameters()}
        self.module = stage
        self.wrappers = [BucketedDDP(nn.ParameterList(p for p in stage.parameters() if id(p) not in experts),
                                     bucket_mb, process_group=mesh.replica_group)]
        if experts:  # a stage of only the embedding or the head has none
            self.wrappers.append(BucketedDDP(nn.ParameterList(p for p in stage.parameters() if id(p) in experts),
                                             bucket_mb, process_group=mesh.expert_replica_group))
            self.wrappers[1].register_comm_hook(lambda flat, group: allreduce_hook(flat.div_(mesh.ep), group))

    @contextlib.contextmanager
    def no_sync(self):
        with contextlib.ExitStack() as stack:
            for wrapper in self.wrappers:
                stack.enter_context(wrapper.no_sync())
            yield

    def finish_gradient_synchronization(self) -> None:
        """Sends: the dense buckets' all-reduces over the replica group, then the experts'
        over the expert-replica group."""
        for wrapper in self.wrappers:
            wrapper.finish_gradient_synchronization()


def replicate(stage: nn.Module, mesh: Mesh, bucket_mb: float = 25.0):
    """The wrapper that averages `stage`'s gradients over its replicas, for `dp_pp_step`:
    BucketedDDP over the replica group, or with ep > 1 one per kind of parameter
    (`_ExpertReplicas`)."""
    if mesh.ep > 1:
        return _ExpertReplicas(stage, mesh, bucket_mb)
    return BucketedDDP(stage, bucket_mb, process_group=mesh.replica_group)


def _lm_loss(logits, target):  # [batch, seq, vocab], [batch, seq]
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def train(args) -> list[float]:
    """Train `args.steps` steps on the mesh dp x pp x cp x tp of the initialised world; every
    rank returns the global mean loss of each step (one all-reduce of a float per step)."""
    if args.ep > 1 and args.experts == 1:
        raise ValueError(f"--ep {args.ep} splits experts, but the model has none: add --experts (a multiple of "
                         f"{args.ep}), or use --ep 1")
    mesh = Mesh(args.dp, args.pp, args.tp, args.cp, args.ep, args.outer)
    if args.batch % (args.dp * args.microbatches):
        raise ValueError(f"batch {args.batch} does not split into dp {args.dp} x {args.microbatches} micro-batches: "
                         f"pick a multiple of {args.dp * args.microbatches}")
    model = build_model(args, mesh.tp_group, mesh.cp_group, mesh.ep_group)
    if len(model) < args.pp:
        raise ValueError(f"{len(model)} layers cannot fill {args.pp} pipeline stages: use --layers >= {args.pp - 2}")
    balance = segment_sizes(len(model), args.pp)  # layers per stage, as even as possible
    mine = nn.ModuleList(split_stages(model, balance)[mesh.pp_rank])
    optimizer = torch.optim.AdamW(mine.parameters(), lr=args.lr)
    first = _load(args.resume, mine, optimizer, mesh) if args.resume else 0
    replica = replicate(mine, mesh, args.bucket_mb)  # averages over dp (x cp)
    losses = []
    for step in range(first, first + args.steps):
        ids, target = local_batch(step, args, mesh)  # [batch/dp, seq/cp]
        optimizer.zero_grad(set_to_none=True)
        loss = dp_pp_step(model, balance, ids, target, _lm_loss, pp_group=mesh.pp_group, replica=replica,
                          schedule=args.schedule, num_microbatches=args.microbatches)
        optimizer.step()
        losses.append(_global_loss(loss, mesh))
    if args.save:
        _save(args.save, mine, optimizer, first + args.steps, mesh)
    return losses


def _global_loss(loss, mesh: Mesh) -> float:
    """The mean loss over the replicas, on every rank: the last stages' losses (each tp rank
    holds the same; each cp rank the mean over as many tokens) summed over the world, one float."""
    total = torch.zeros(1, device=device()) if loss is None else loss.detach().reshape(1).clone()
    dist.all_reduce(total)
    return total.item() / (mesh.dp * mesh.tp * mesh.cp)


def _sizes(mesh: Mesh) -> dict[str, int | str]:
    """The mesh's sizes as mesh.json records them (cp and ep only where more than 1, the
    order only where pp is outermost: each rank's file holds its place's stage)."""
    return {"dp": mesh.dp, "pp": mesh.pp, "tp": mesh.tp, **{k: n for k, n in (("cp", mesh.cp), ("ep", mesh.ep)) if n > 1},
            **({"outer": "pp"} if mesh.outer == "pp" else {})}


def _save(folder: Path, stage, optimizer, step: int, mesh: Mesh) -> None:
    """Each rank writes its own stage's parameters and optimizer state, rank 0 the mesh
    (mesh.json); one barrier, no data sent."""
    folder.mkdir(parents=True, exist_ok=True)
    if mesh.rank == 0:
        (folder / "mesh.json").write_text(json.dumps(_sizes(mesh)))
    torch.save({"step": step, "model": stage.state_dict(), "optimizer": optimizer.state_dict()},
               folder / f"rank{mesh.rank}.pt")
    dist.barrier()


def _load(folder: Path, stage, optimizer, mesh: Mesh) -> int:
    """This rank's stage and optimizer state from `folder`, after checking that it was saved
    on the same mesh; returns the step to go on from."""
    record = folder / "mesh.json"
    if not record.exists():
        raise FileNotFoundError(f"no checkpoint in {folder} ({record.name} is missing): --resume takes a folder "
                                f"written by --save")
    saved, asked = json.loads(record.read_text()), _sizes(mesh)
    if saved != asked:
        hint = {**saved, **({"outer": "dp"} if "outer" in asked and "outer" not in saved else {})}  # undo --outer pp
        raise ValueError(f"checkpoint {folder} was saved on the mesh {' x '.join(f'{k}={n}' for k, n in saved.items())}"
                         f", but this run asks for {' x '.join(f'{k}={n}' for k, n in asked.items())}"
                         f": resume with {' '.join(f'--{k} {n}' for k, n in hint.items())}")
    state = torch.load(folder / f"rank{mesh.rank}.pt", map_location=device())
    stage.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"]


def main(argv=None) -> list[float]:
    """Entry point under torchrun (or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    args = parse_args(argv)
    with process_group(args.backend):
        losses = train(args)
        if dist.get_rank() == 0:
            print("\n".join(f"step {n} loss {loss:.8f}" for n, loss in enumerate(losses, 1)), flush=True)
        if args.losses_to and dist.get_rank() == 0:
            args.losses_to.write_text(json.dumps(losses))
        return losses

if __name__ == "__main__":
    main()
