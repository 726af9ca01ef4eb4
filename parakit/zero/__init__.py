"""ZeRO: shard the optimizer state (stage 1), the gradients (stage 2) and the parameters
(stage 3, FSDP) over the data-parallel ranks, so that each rank keeps 1/N of them.

    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)   # stage=1 or 2
    loss_fn(model(x), y).backward(); optimizer.step()      # averages, steps its shard, shares

    model = FullyShardedDataParallel(net, units=list(net), compute_dtype=torch.bfloat16)
    loss_fn(model(x), y).backward(); model.finish_gradient_synchronization(); optimizer.step()

`ShardedOptimizer` gives each parameter (whole, as torch's ZeroRedundancyOptimizer does:
largest first, to the rank with the fewest elements so far) one owner, and lays the
parameters out in flat buckets by owner: each rank's parameters one after another in its
segment. As soon as backward has accumulated a bucket's gradients they are reduced together
(a reduce-scatter gives each rank the sum of exactly its segment; gloo gets an all-reduce,
see the class), overlapping the rest of backward; stage 2 drops the other ranks' gradients
then. The owner steps its parameters with its own `optimizer_cls` (any torch.optim class)
and one all-gather per bucket gives everyone the updated segments. A rank sends about
Psi(N-1)/N for the gradients and as much for the parameters: 2 Psi per step, as all-reduce
does. With `compute_dtype=torch.bfloat16` (or float16) it trains in mixed precision as the
paper counts it: 2-byte parameters and gradients, an fp32 master copy of the owned ones in
the optimizer (K = 12 with Adam); fp16 steps through `parakit.precision.LossScaler`.

`FullyShardedDataParallel` flattens the trainable parameters of each unit (a submodule you
name, the rest in the root unit), pads them to a multiple of N and keeps 1/N: the flat
shard, a Parameter of the wrapper (fp32 master weights; optimizers see these). Before a
unit runs, its shard is all-gathered (in `compute_dtype`) and the module's parameters
become views of the full buffer; after, the buffer's storage is freed. The next unit's
all-gather starts as one unit is gathered (prefetching, in forward and in backward). Autograd keeps the
views it saved; when backward unpacks them the unit is gathered again; when the gradients
of its parameters are all there, they are reduce-scattered (fp32, averaged) into the
shard's `.grad`. Step per unit: all-gather, all-gather, reduce-scatter: 3 Psi. Frozen
parameters are not sharded: each rank keeps them whole (in `compute_dtype`). The optimizer must work element
by element (SGD, Adam, AdamW: a flat shard mixes parameters), as for torch's FSDP1. With a
`replicate_group` it is HSDP: sharded over `group` (a node), replicated across the other
(the nodes), each unit's gradient shard all-reduced across the replicas after its
reduce-scatter: the gathers stay inside the node, one shard's bytes cross it.

    optimizer.py  ShardedOptimizer (stages 1 and 2)     fsdp.py     FullyShardedDataParallel
    paper.py      the paper's bytes per rank (formulas)  held.py     bytes a rank holds, and their peak
    profile.py    one stage trained and measured
"""
from parakit.zero.fsdp import FullyShardedDataParallel
from parakit.zero.held import HeldBytesPeak, held_bytes
from parakit.zero.optimizer import ShardedOptimizer, partition_parameters
from parakit.zero.paper import zero_bytes, zero_comm_bytes
from parakit.zero.profile import profile_stage

__all__ = ["ShardedOptimizer", "FullyShardedDataParallel", "partition_parameters", "zero_bytes",
           "zero_comm_bytes", "held_bytes", "HeldBytesPeak", "profile_stage"]
