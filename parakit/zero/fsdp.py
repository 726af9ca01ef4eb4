"""ZeRO-3: fully sharded data parallel, unit by unit (see parakit.zero); with a replicate
group, HSDP: sharded within a node, replicated across nodes."""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn

from parakit.groups import broadcast_from_first
from parakit.zero.optimizer import gradient_collective_for

__all__ = ["FullyShardedDataParallel"]


class _Unit:
    """One FSDP unit: its module, its trainable parameters flattened and padded to
    N * chunk elements, this rank's chunk (the fp32 master shard) and the full buffer."""

    def __init__(self, module: nn.Module, params: list[torch.Tensor], locations: list[list[tuple]], group, dtype):
        self.module, self.locations, self.group, self.dtype = module, locations, group, dtype
        self.shapes = [p.shape for p in params]
        self.offsets = [0] + list(torch.tensor([p.numel() for p in params]).cumsum(0).tolist())
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        self.chunk = -(-self.offsets[-1] // n)
        flat = torch.zeros(n * self.chunk, dtype=params[0].dtype, device=params[0].device)  # [N * chunk]
        torch.cat([p.detach().reshape(-1) for p in params], out=flat[: self.offsets[-1]])
        self.shard = nn.Parameter(flat[rank * self.chunk:(rank + 1) * self.chunk].clone())  # [chunk]
        self.full = torch.empty(0, dtype=dtype or flat.dtype, device=flat.device)  # [N * chunk] while gathered
        self._gathering = None  # (work, the chunk it sends) of an all-gather in flight
        self.reduced = False  # its gradients went in this backward (no prefetch after that)
        for places in locations:
            for owner, name in places:
                del owner._parameters[name]

    def gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def gather(self, wait: bool = True) -> list[torch.Tensor]:
        """All-gather the unit (each rank sends its chunk, in compute dtype, to the N-1 others)
        into the full buffer, unless it is there or on its way; return one view per parameter.
        wait=False (a prefetch): start the all-gather and return without waiting."""
        if not self.gathered():
            n = dist.get_world_size(self.group)
            if self.full.numel() == 0:
                self.full = torch.empty(n * self.chunk, dtype=self.full.dtype, device=self.full.device)
            else:
                self.full.untyped_storage().resize_(n * self.chunk * self.full.element_size())
            mine = self.shard.detach().to(self.full.dtype)  # [chunk]
            self._gathering = dist.all_gather_single(self.full.data, mine, group=self.group, async_op=True), mine
        if wait:
            self.wait()
        return [self.full[a:b].view(shape) for a, b, shape in zip(self.offsets, self.offsets[1:], self.shapes)]

    def wait(self) -> None:
        if self._gathering is not None:
            self._gathering[0].wait()
            self._gathering = None

    def free(self) -> None:
        """Free the full buffer's memory; the views keep their shapes and come back on gather."""
        self.wait()
        self.full.untyped_storage().resize_(0)


class _GatherUnit(torch.autograd.Function):
    """Forward: the unit's parameters, gathered. Backward: their gradients, reduce-scattered."""

    @staticmethod
    def forward(ctx, shard, fsdp, unit):
        # held weakly: the module keeps the gathered views, whose grad_fn keeps ctx, a cycle through
        # autograd's C++ graph that the garbage collector never frees (nor the wrapper's process group)
        ctx.fsdp, ctx.unit = weakref.ref(fsdp), weakref.ref(unit)
        ctx.set_materialize_grads(False)
        return tuple(unit.gather())

    @staticmethod
    def backward(ctx, *grads):
        ctx.fsdp()._reduce_scatter(ctx.unit(), grads)
        return None, None, None


class FullyShardedDataParallel(nn.Module):
    """ZeRO-3: each rank keeps 1/N of every unit's parameters, gradients and optimizer state.

    `units`: submodules of `module` gathered one at a time (e.g. its layers); the parameters
    outside them (and tied ones shared between units) form the root unit, gathered for the
    whole forward. `compute_dtype` (e.g. torch.bfloat16): the dtype of the gathered
    parameters and of the floating inputs; shards and gradients stay in fp32.

    Prefetching (`prefetch=True`): as a unit is gathered, the all-gather of the next one starts
    (in forward, the order of the last forward; in backward, as a unit's gradients go, the unit
    that saved parameters for backward before it), so that it travels while the next computes. The traffic is the
    same; a rank holds two gathered units at once instead of one.

    `gradient_collective`: how a unit's gradients are reduced, "reduce_scatter" (the default on
    NCCL) or "all_reduce" (the default on gloo, whose reduce-scatter is an all-reduce of a copy:
    see `zero.optimizer.gradient_collective_for`); each rank keeps its shard's segment.

    HSDP (`replicate_group`, e.g. the ranks with this rank's place on the other nodes): the
    parameters are sharded over `group` (S ranks, one node) only, and each shard is replicated
    on the R ranks of `replicate_group`, which must meet `group` in this rank alone. Gathers go
    over `group` as above; a unit's gradients are reduced over `group` into this rank's shard,
    then that shard (chunk * 4 bytes, fp32) is all-reduced over `replicate_group`: 2(R-1)/R of
    it sent, the only traffic across nodes in a step. Gradients are averaged over all S * R
    ranks, each of which trains on its own part of the batch; a rank holds 1/S of the parameters.
    Wrapping broadcasts the shards (and frozen parameters, buffers) from the replicate group's
    first rank, once: each shard's bytes across the nodes.
    """

    def __init__(self, module: nn.Module, units=(), compute_dtype: torch.dtype | None = None, group=None,
                 prefetch: bool = True, gradient_collective: str | None = None,
                 replicate_group=None):
        super().__init__()
        if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point):
            raise TypeError(f"compute_dtype must be a floating-point torch.dtype such as torch.bfloat16 or "
                            f"torch.float16 (or None to compute in the parameters' dtype), got {compute_dtype!r}")
        self.module, self.group, self.compute_dtype, self.prefetch = module, group, compute_dtype, prefetch
        self.replicate_group, self.replicas = replicate_group, _replicas(group, replicate_group)
        self._order, self._gathered = [], []  # units in the order the last forward gathered them / this one does
        self._saved = []  # units in the order this forward first saved a tensor of them for backward
        self.world_size = dist.get_world_size(group)
        self.gradient_collective = gradient_collective_for(group, gradient_collective)
        broadcast_from_first([*module.parameters(), *module.buffers()], group)
        self.names = {}  # original name -> (unit index, parameter index), or None where frozen
        self.units = self._build_units([module, *units])
        self.shards = nn.ParameterList([u.shard for u in self.units])
        if replicate_group is not None:  # every replica starts from the first one's shards (and frozen, buffers)
            frozen = [p for p in module.parameters() if not p.requires_grad]
            broadcast_from_first([*self.shards, *frozen, *module.buffers()], replicate_group)
        with torch.no_grad():
            for p in module.parameters():  # the frozen ones, kept whole, in the compute dtype
                p.data = p.data.to(compute_dtype or p.dtype)
        self._pending = None  # the reduce-scatter in flight: (unit, fp32 gradient buffer, its output, work)
        for unit in self.units:
            unit.module.register_forward_pre_hook(lambda mod, args, unit=unit: self._gather(unit))
            unit.module.register_forward_hook(lambda mod, args, out, unit=unit: unit.free())

    def _build_units(self, modules: list[nn.Module]) -> list[_Unit]:
        """Each trainable parameter joins the smallest unit holding every place it is used."""
        members = [{id(m) for m in unit.modules()} for unit in modules]
        if any(id(m) not in members[0] for m in modules[1:]):
            raise ValueError("every unit must be a submodule of the wrapped module: pass e.g. units=list(model)")
        places, params, names = {}, {}, {}
        for path, sub in self.module.named_modules(remove_duplicate=False):
            for name, p in sub._parameters.items():
                if p is None:
                    continue
                names[f"{path}.{name}" if path else name] = p
                where = places.setdefault(id(p), []) if p.requires_grad else []
                if p.requires_grad and not any(s is sub and n == name for s, n in where):
                    where.append((sub, name))
                    params[id(p)] = p
        chosen = [[] for _ in modules]
        for key, where in places.items():
            fits = [i for i, m in enumerate(members) if all(id(sub) in m for sub, _ in where)]
            chosen[min(fits, key=lambda i: len(members[i]))].append(key)
        units, position = [], {}
        for module, keys in zip(modules, chosen):
            if keys:
                position.update({key: (len(units), j) for j, key in enumerate(keys)})
                units.append(_Unit(module, [params[k] for k in keys], [places[k] for k in keys], self.group,
                                   self.compute_dtype))
        self.names = {name: position.get(id(p), p) for name, p in names.items()}  # (unit, index) or frozen tensor
        return units

    def _gather(self, unit: _Unit) -> None:
        """Before a unit runs: its parameters become views of its gathered full buffer; the unit
        that came after it in the last forward starts its all-gather."""
        views = _GatherUnit.apply(unit.shard, self, unit)
        at = len(self._gathered)
        self._gathered.append(unit)
        if self.prefetch and at + 1 < len(self._order) and self._order[at] is unit:
            self._order[at + 1].gather(wait=False)
        for view, places in zip(views, unit.locations):
            for owner, name in places:
                setattr(owner, name, view)

    def forward(self, *args, **kwargs):
        if self._pending is not None:
            raise RuntimeError("finish_gradient_synchronization() was not called after the last backward: call it "
                               "after backward and before optimizer.step()")
        if self.compute_dtype is not None:
            args, kwargs = _cast_floating((args, kwargs), self.compute_dtype)
        self._gathered, self._saved = [], []
        for unit in self.units:
            unit.reduced = False
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            out = self.module(*args, **kwargs)
        self._order = self._gathered
        return out

    def _pack(self, tensor: torch.Tensor):
        """What autograd saves: a view of a unit's buffer is tagged so that it is gathered again."""
        ptr = tensor.untyped_storage().data_ptr()
        unit = next((u for u in self.units if ptr and u.full.untyped_storage().data_ptr() == ptr), None)
        if unit is None:
            return tensor
        if not any(u is unit for u in self._saved):
            self._saved.append(unit)
        return unit, tensor

    @staticmethod
    def _unpack(packed):
        """Backward needs a saved view of a unit: gather it (again) unless it is there (or on its way)."""
        if not isinstance(packed, tuple):
            return packed
        packed[0].gather()
        return packed[1]

    def _reduce_scatter(self, unit: _Unit, grads) -> None:
        """Free the unit's full buffer and start reducing its gradients over `group` (fp32,
        padded: a reduce-scatter sends (N-1)/N of N * chunk * 4 bytes, an all-reduce twice
        that); one reduction in flight at a time (HSDP's all-reduce across replicas follows
        in `finish_gradient_synchronization`)."""
        self.finish_gradient_synchronization()
        unit.free()  # its backward is done: the parameters go before the gradients' flat copy comes
        unit.reduced = True
        flat = torch.zeros(self.world_size * unit.chunk, dtype=unit.shard.dtype, device=unit.shard.device)
        for grad, a, b in zip(grads, unit.offsets, unit.offsets[1:]):
            if grad is not None:
                flat[a:b] = grad.reshape(-1)  # [numel] into [N * chunk], cast to fp32
        if self.gradient_collective == "all_reduce":
            rank = dist.get_rank(self.group)
            out, work = flat[rank * unit.chunk:(rank + 1) * unit.chunk], dist.all_reduce(flat, group=self.group,
                                                                                        async_op=True)
        else:
            out = torch.empty_like(unit.shard)  # [chunk]
            work = dist.reduce_scatter_single(out, flat, group=self.group, async_op=True)
        self._pending = unit, flat, out, work
        saved = [i for i, u in enumerate(self._saved) if u is unit]
        if self.prefetch and saved and saved[0] > 0 and not self._saved[saved[0] - 1].reduced:
            self._saved[saved[0] - 1].gather(wait=False)  # the unit whose backward comes next

    def finish_gradient_synchronization(self) -> None:
        """Wait for the last reduce-scatter and add its average into the shard's `.grad`; with
        HSDP, first all-reduce the shard over `replicate_group` (chunk * 4 bytes in, 2(R-1)/R
        of them sent)."""
        if self._pending is None:
            return
        unit, flat, out, work = self._pending
        work.wait()
        if self.replicate_group is not None:
            dist.all_reduce(out, group=self.replicate_group)  # [chunk]: the sum over every replica's shard
        out = out.div(self.world_size * self.replicas)  # [chunk], out of the flat buffer
        flat.untyped_storage().resize_(0)  # freed now, not whenever the backend drops its reference
        unit.shard.grad = out if unit.shard.grad is None else unit.shard.grad.add_(out)
        self._pending = None

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole and fp32, by its name in the wrapped module (for saving):
        each unit's shard goes to every other rank (all_gather_single, (N-1) x its bytes)."""
        full = []
        for unit in self.units:
            flat = torch.empty(self.world_size * unit.chunk, dtype=unit.shard.dtype, device=unit.shard.device)
            dist.all_gather_single(flat, unit.shard.detach(), group=self.group)  # [N * chunk]
            full.append([flat[a:b].view(s).clone() for a, b, s in zip(unit.offsets, unit.offsets[1:], unit.shapes)])
        return {name: full[where[0]][where[1]] if isinstance(where, tuple) else where.detach().clone()
                for name, where in self.names.items()}

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The parameter and gradient tensors this rank holds now (shards, full buffers, frozen
        parameters, the gradient buffer of a reduce-scatter in flight)."""
        params = [*self.parameters(), *(u.full for u in self.units)]
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        return {"parameters": params, "gradients": grads + list(self._pending[1:3] if self._pending else [])}


def _replicas(group, replicate_group) -> int:
    """R, the ranks of `replicate_group` (1 without one), which must meet `group` in this rank only."""
    if replicate_group is None:
        return 1
    shared = set(dist.get_process_group_ranks(group or dist.group.WORLD))
    shared &= set(dist.get_process_group_ranks(replicate_group))
    if shared != {dist.get_rank()}:
        raise ValueError(f"group and replicate_group share ranks {sorted(shared)}: HSDP shards over group (the ranks "
                         f"of one node) and replicates across replicate_group (this rank's place on every node), "
                         f"which meet in rank {dist.get_rank()} only")
    return dist.get_world_size(replicate_group)


def _cast_floating(tree, dtype):
    if isinstance(tree, torch.Tensor):
        return tree.to(dtype) if tree.is_floating_point() else tree
    if isinstance(tree, (list, tuple)):
        return type(tree)(_cast_floating(t, dtype) for t in tree)
    if isinstance(tree, dict):
        return {k: _cast_floating(v, dtype) for k, v in tree.items()}
    return tree
