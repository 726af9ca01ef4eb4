"""3D hybrid parallelism: train a tiny transformer language model on a DP x PP x TP mesh.

    torchrun --nproc-per-node 8 -m parakit.train --dp 2 --pp 2 --tp 2 --steps 5
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m parakit.train --dp 2 --pp 2 --tp 2 --steps 5 --save ckpt

Each step: the pipeline (`parakit.pipeline.dp_pp_step`) runs this replica's share of the
batch through the stages of its pp group, micro-batch by micro-batch, with activations and
their gradients sent between stages; inside every block the tp group all-reduces
(tensor-parallel attention and MLP, `parakit.tensor_parallel`, when tp > 1); after the last
micro-batch's backward parakit's BucketedDDP all-reduces the stage gradients over the dp
group, bucket by bucket, once per step. The model is built from one seed and sharded, so
any mesh trains the same numbers as one process (--dp 1 --pp 1 --tp 1).
The data is synthetic and drawn from (seed, step), so a resumed run sees the same batches.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from parakit.ddp import BucketedDDP
from parakit.devices import device, select_backend
from parakit.mesh import Mesh
from parakit.pipeline import dp_pp_step, split_stages

__all__ = ["parse_args", "build_model", "train", "node_backend", "main"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m parakit.train", description=__doc__.split("\n")[0])
    for name, default in (("dp", 1), ("pp", 1), ("tp", 1), ("steps", 5), ("batch", 16), ("seq", 16), ("vocab", 64),
                          ("hidden", 32), ("heads", 4), ("layers", 2), ("microbatches", 2), ("seed", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="BucketedDDP's bucket size for the dp all-reduces")
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"))
    p.add_argument("--backend", default="auto", help="gloo, nccl, or auto: nccl when every rank on this node has a GPU")
    p.add_argument("--save", type=Path, help="folder for a checkpoint after the last step")
    p.add_argument("--resume", type=Path, help="folder of a checkpoint to start from")
    p.add_argument("--losses-to", type=Path, help="write the losses here as JSON (rank 0)")
    return p.parse_args(argv)


class Embedding(nn.Module):
    """Token and position embeddings, replicated on every tp rank: [batch, seq] -> [batch, seq, hidden]."""

    def __init__(self, vocab: int, seq: int, hidden: int):
        super().__init__()
        self.token, self.position = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)

    def forward(self, ids):
        return self.token(ids) + self.position(torch.arange(ids.shape[1], device=ids.device))


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP. With a tp group of t ranks, q, k, v and the
    MLP's first layer are column-parallel (heads/t and 4*hidden/t per rank), the output
    projections row-parallel: one all-reduce of [batch, seq, hidden] after each, forward,
    and one before each column-parallel layer's input gradient, backward."""

    def __init__(self, hidden: int, heads: int, linear):
        super().__init__()
        self.heads = heads  # on this rank: heads/t
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.q, self.k, self.v = (linear(hidden, hidden, "column") for _ in range(3))
        self.proj = linear(hidden, hidden, "row")
        self.fc1, self.fc2 = linear(hidden, 4 * hidden, "column"), linear(4 * hidden, hidden, "row")

    def forward(self, x):  # [batch, seq, hidden]
        b, s, _ = x.shape
        h = self.norm1(x)
        q, k, v = (f(h) for f in (self.q, self.k, self.v))  # [batch, seq, hidden/t]
        split = lambda t: t.view(b, s, self.heads, -1).transpose(1, 2)  # [batch, heads/t, seq, hidden/heads]
        att = nn.functional.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, -1))  # [batch, seq, hidden]
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


class Head(nn.Module):
    """Final layer norm and the vocabulary projection: [batch, seq, hidden] -> [batch, seq, vocab]."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(hidden), nn.Linear(hidden, vocab)

    def forward(self, x):
        return self.out(self.norm(x))


def _dense_linear(n_in, n_out, kind):
    return nn.Linear(n_in, n_out)


def build_model(args, tp_group=None) -> nn.Sequential:
    """The model as a Sequential of layers (embedding, blocks, head) from `args.seed`; with
    a tp group of more than one rank, each block's linears are this rank's shards of the
    same dense weights."""
    if args.hidden % args.heads:
        raise ValueError(f"hidden {args.hidden} is not divisible by heads {args.heads}: pick a multiple of {args.heads}")
    torch.manual_seed(args.seed)
    layers = [Embedding(args.vocab, args.seq, args.hidden),
              *(Block(args.hidden, args.heads, _dense_linear) for _ in range(args.layers)),
              Head(args.hidden, args.vocab)]
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        layers = [_shard_block(layer, args, tp_group) if isinstance(layer, Block) else layer for layer in layers]
    return nn.Sequential(*layers).to(device())


def _shard_block(dense: Block, args, tp_group) -> Block:
    """A Block whose linears are parakit.tensor_parallel layers holding this rank's slices of `dense`'s."""
    from parakit.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    t, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    if args.heads % t:
        raise ValueError(f"heads {args.heads} are not divisible by tp {t}: each tensor-parallel rank needs "
                         f"whole heads; pick tp dividing {args.heads}")

    def linear(n_in, n_out, kind):
        if kind == "column":
            return ColumnParallelLinear(n_in, n_out, gather_output=False, group=tp_group)
        return RowParallelLinear(n_in, n_out, input_is_parallel=True, group=tp_group)

    block = Block(args.hidden, args.heads // t, linear)
    with torch.no_grad():
        for name, module in block.named_children():
            source = getattr(dense, name)
            if isinstance(module, nn.LayerNorm):
                module.load_state_dict(source.state_dict())
            elif isinstance(module, ColumnParallelLinear):
                module.weight.copy_(source.weight.chunk(t, 0)[rank])  # [out/t, in]
                module.bias.copy_(source.bias.chunk(t, 0)[rank])
            else:
                module.weight.copy_(source.weight.chunk(t, 1)[rank])  # [out, in/t]
                module.bias.copy_(source.bias)
    return block


def batch_for(step: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: counting sequences (next token = token + 1 mod vocab) from
    random starts, drawn from (seed, step). Returns ids and targets, each [batch, seq]."""
    g = torch.Generator().manual_seed(args.seed * 100_003 + step)
    start = torch.randint(0, args.vocab, (args.batch, 1), generator=g)
    tokens = (start + torch.arange(args.seq + 1)) % args.vocab  # [batch, seq + 1]
    return tokens[:, :-1].to(device()), tokens[:, 1:].to(device())


def even_balance(num_layers: int, pp: int) -> list[int]:
    if num_layers < pp:
        raise ValueError(f"{num_layers} layers cannot fill {pp} pipeline stages: use --layers >= {pp - 2}")
    return [num_layers // pp + (s < num_layers % pp) for s in range(pp)]


def _lm_loss(logits, target):  # [batch, seq, vocab], [batch, seq]
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def train(args) -> list[float]:
    """Train `args.steps` steps on the mesh dp x pp x tp of the initialised world; every rank
    returns the global mean loss of each step (one all-reduce of a float per step)."""
    mesh = Mesh(args.dp, args.pp, args.tp)
    if args.batch % (args.dp * args.microbatches):
        raise ValueError(f"batch {args.batch} does not split into dp {args.dp} x {args.microbatches} micro-batches: "
                         f"pick a multiple of {args.dp * args.microbatches}")
    model = build_model(args, mesh.tp_group)
    balance = even_balance(len(model), args.pp)
    mine = nn.ModuleList(split_stages(model, balance)[mesh.pp_rank])
    optimizer = torch.optim.AdamW(mine.parameters(), lr=args.lr)
    first = _load(args.resume, mine, optimizer, mesh) if args.resume else 0
    replica = BucketedDDP(mine, args.bucket_mb, process_group=mesh.dp_group)  # averages over the dp group
    losses = []
    for step in range(first, first + args.steps):
        ids, target = (t.chunk(args.dp)[mesh.dp_rank] for t in batch_for(step, args))  # [batch/dp, seq]
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
    holds the same) summed over the world, one float."""
    total = torch.zeros(1, device=device()) if loss is None else loss.detach().reshape(1).clone()
    dist.all_reduce(total)
    return total.item() / (mesh.dp * mesh.tp)


def _save(folder: Path, stage, optimizer, step: int, mesh: Mesh) -> None:
    """Each rank writes its own stage's parameters and optimizer state, rank 0 the mesh
    (mesh.json); one barrier, no data sent."""
    folder.mkdir(parents=True, exist_ok=True)
    if mesh.rank == 0:
        (folder / "mesh.json").write_text(json.dumps({"dp": mesh.dp, "pp": mesh.pp, "tp": mesh.tp}))
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
    saved, asked = json.loads(record.read_text()), {"dp": mesh.dp, "pp": mesh.pp, "tp": mesh.tp}
    if saved != asked:
        raise ValueError("checkpoint {} was saved on the mesh dp={dp} x pp={pp} x tp={tp}".format(folder, **saved)
                         + ", but this run asks for dp={dp} x pp={pp} x tp={tp}".format(**asked)
                         + ": resume with --dp {dp} --pp {pp} --tp {tp}".format(**saved))
    state = torch.load(folder / f"rank{mesh.rank}.pt", map_location=device())
    stage.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"]


def node_backend(backend: str, local_world_size: int, gpus: int, nccl_built: bool) -> str:
    """The launcher's rule on one node: NCCL needs a GPU for each of the node's ranks
    (torchrun's LOCAL_WORLD_SIZE); "auto" falls back to gloo, "nccl" is refused."""
    try:
        return select_backend(backend, local_world_size, gpus, nccl_built)
    except ValueError as error:
        raise ValueError(f"on this node (LOCAL_WORLD_SIZE={local_world_size}): {error}") from None


def main(argv=None) -> list[float]:
    """Entry point under torchrun (or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    args = parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = node_backend(args.backend, int(os.environ.get("LOCAL_WORLD_SIZE", 1)), gpus, dist.is_nccl_available())
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    try:
        losses = train(args)
        if dist.get_rank() == 0:
            print("\n".join(f"step {n} loss {loss:.8f}" for n, loss in enumerate(losses, 1)), flush=True)
        if args.losses_to and dist.get_rank() == 0:
            args.losses_to.write_text(json.dumps(losses))
        return losses
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
