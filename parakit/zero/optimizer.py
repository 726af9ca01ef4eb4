"""ZeRO-1 and ZeRO-2: a sharded optimizer around any torch.optim class (see parakit.zero)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from parakit.groups import global_rank

__all__ = ["ShardedOptimizer", "partition_parameters"]


def partition_parameters(groups: list[list[torch.Tensor]], world_size: int) -> list[int]:
    """The owner rank of each parameter (groups in order, flattened): in each group largest
    first, to the rank holding the fewest elements so far (as ZeroRedundancyOptimizer)."""
    owners, sizes = [], [0] * world_size
    for params in groups:
        mine = [0] * len(params)
        for i in sorted(range(len(params)), key=lambda i: params[i].numel(), reverse=True):
            mine[i] = sizes.index(min(sizes))
            sizes[mine[i]] += params[i].numel()
        owners += mine
    return owners


class ShardedOptimizer:
    """ZeRO-1 (stage=1) or ZeRO-2 (stage=2) around any torch.optim class.

    `params`: tensors or param-group dicts, as for `optimizer_cls`; gradients are this rank's
    own (no DDP): the optimizer averages them, so every rank must give gradients to the same
    parameters. Each rank keeps the state of its parameters only; `state_dict()` gathers the
    whole state, as `optimizer_cls` would save it. Each gradient is reduced to its owner (in
    `step()` at stage 1, in backward at stage 2, where the other ranks drop it): a
    reduce-scatter whose pieces are whole parameters, one `dist.reduce` per piece.
    """

    def __init__(self, params, optimizer_cls, *, stage: int = 1, group=None, **defaults):
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer subclass such as torch.optim.AdamW "
                            f"(the class, not an instance), got {optimizer_cls!r}")
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 (shard optimizer state) or 2 (and gradients), got {stage!r}; "
                             f"for stage 3 wrap the model in FullyShardedDataParallel")
        groups = _param_groups(params)
        self.group, self.stage, self.optimizer_cls = group, stage, optimizer_cls
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.params = [p for g in groups for p in g["params"]]
        self.owners = partition_parameters([g["params"] for g in groups], self.world_size)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        mine = [{**g, "params": [p for p in g["params"] if self._owner_of(p) == self.rank]} for g in groups]
        self.optimizer = optimizer_cls(mine, **defaults)
        self.param_groups = [{**local, "params": g["params"]} for local, g in zip(self.optimizer.param_groups, groups)]
        for p in self.params:
            if stage == 2 and p.requires_grad:
                p.register_post_accumulate_grad_hook(self._reduce_gradient)

    def _owner_of(self, param: torch.Tensor) -> int:
        return self.owners[self._index[id(param)]]

    @property
    def state(self):
        """The optimizer state this rank holds: its own parameters' only."""
        return self.optimizer.state

    def _reduce_gradient(self, param: torch.Tensor) -> None:
        """Averages `param.grad` onto its owner: each rank divides by N and the sum goes to the
        owner only (dist.reduce: its bytes, along a chain; one piece of the reduce-scatter);
        the other ranks drop their copy at stage 2."""
        owner = self._owner_of(param)
        param.grad.div_(self.world_size)
        dist.reduce(param.grad, global_rank(self.group, owner), group=self.group)
        if owner != self.rank and self.stage == 2:
            param.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        """Average the gradients onto their owners (stage 1; stage 2 did it in backward), step
        this rank's parameters, and broadcast each parameter from its owner (its bytes)."""
        if self.stage == 1:
            for p in self.params:
                if p.grad is not None:
                    self._reduce_gradient(p)
        for full, local in zip(self.param_groups, self.optimizer.param_groups):
            local.update({k: v for k, v in full.items() if k != "params"})
        loss = self.optimizer.step(closure)
        for p, owner in zip(self.params, self.owners):
            dist.broadcast(p, global_rank(self.group, owner), group=self.group)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict:
        """The whole state, indexed as `optimizer_cls(params).state_dict()` would be, on every
        rank: each rank sends its parameters' state to all others (all_gather_object)."""
        local = self.optimizer.state_dict()["state"]
        to_global = [self._index[id(p)] for g in self.optimizer.param_groups for p in g["params"]]
        shards = [None] * self.world_size
        dist.all_gather_object(shards, {to_global[k]: s for k, s in local.items()}, group=self.group)
        state = {i: s for shard in shards for i, s in shard.items()}
        groups, start = [], 0
        for full in self.param_groups:
            groups.append({**full, "params": list(range(start, start + len(full["params"])))})
            start += len(full["params"])
        return {"state": {i: state[i] for i in sorted(state)}, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole state (from `state_dict()` at any world size, or from the unsharded
        optimizer): each rank keeps its own parameters' part."""
        sizes = [len(g["params"]) for g in state_dict["param_groups"]]
        if sizes != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(f"the state dict has param groups of {sizes} parameters but this optimizer has "
                             f"{[len(g['params']) for g in self.param_groups]}: load a state saved for the same model")
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        to_saved = [saved[self._index[id(p)]] for g in self.optimizer.param_groups for p in g["params"]]
        groups, start = [], 0
        for saved_group, local in zip(state_dict["param_groups"], self.optimizer.param_groups):
            groups.append({**saved_group, "params": list(range(start, start + len(local["params"])))})
            start += len(local["params"])
        self.optimizer.load_state_dict({"state": {k: state_dict["state"][i] for k, i in enumerate(to_saved)
                                                  if i in state_dict["state"]}, "param_groups": groups})
        for full, saved_group in zip(self.param_groups, state_dict["param_groups"]):
            full.update({k: v for k, v in saved_group.items() if k != "params"})


def _param_groups(params) -> list[dict]:
    groups = list(params)
    if not groups:
        raise ValueError("ShardedOptimizer got an empty parameter list: pass model.parameters() of a model "
                         "with parameters, or a list of param-group dicts")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    return [{**g, "params": list(g["params"])} for g in groups]
