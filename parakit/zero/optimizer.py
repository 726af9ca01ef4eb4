"""ZeRO-1 and ZeRO-2: a sharded optimizer around any torch.optim class (see parakit.zero)."""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from parakit.hooks import register_post_accumulate_grad_hook
from parakit.precision import unsupported_dtype

LOW_PRECISION = (torch.float16, torch.bfloat16)

__all__ = ["ShardedOptimizer", "partition_parameters", "owner_buckets", "gradient_collective_for"]


def gradient_collective_for(group, collective: str | None) -> str:
    """The collective that reduces sharded gradients: `collective` if given, else "all_reduce"
    on gloo and "reduce_scatter" elsewhere. gloo's reduce-scatter all-reduces a copy of the
    whole input and keeps one segment: the same bytes as its all-reduce (measured in lesson 00),
    plus a copy whose memory gloo's own thread frees when it likes; an all-reduce in place and
    each rank's segment of it is the same sum without the copy."""
    collective = collective or ("all_reduce" if dist.get_backend(group) == "gloo" else "reduce_scatter")
    if collective not in ("reduce_scatter", "all_reduce"):
        raise ValueError(f"gradient_collective must be 'reduce_scatter' or 'all_reduce', got {collective!r}")
    return collective


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


def owner_buckets(groups: list[list[torch.Tensor]], world_size: int,
                  bucket_size_mb: float | None) -> list[tuple[list[torch.Tensor], list[int]]]:
    """The parameters of `groups` (param groups, module order) in buckets, each with its
    parameters' owners (frozen ones too: they are owned, as ZeroRedundancyOptimizer owns them): in reverse order (as backward produces their gradients), a bucket
    closes once it holds `bucket_size_mb` MiB (None: no cap) and its owners' segments are even
    (padding each to the longest adds at most a quarter), or where the dtype changes; the last
    buckets are merged into the ones before while they pad more. Within a bucket the owners
    are `partition_parameters`'s (largest first, to the emptiest rank), so with one bucket they
    are ZeroRedundancyOptimizer's; a parameter larger than the cap shares its bucket with
    other ranks' parameters instead of padding to N times itself."""
    cap = float("inf") if bucket_size_mb is None else bucket_size_mb * 2**20
    order = [(g, p) for g, params in enumerate(groups) for p in params]  # module order

    def owners(bucket: list[int]) -> dict[int, int]:
        by_group = [[i for i in sorted(bucket) if order[i][0] == g] for g in range(len(groups))]
        mine = partition_parameters([[order[i][1] for i in ids] for ids in by_group], world_size)
        return dict(zip([i for ids in by_group for i in ids], mine))

    def even(bucket: list[int]) -> bool:
        sizes = [0] * world_size
        for i, owner in owners(bucket).items():
            sizes[owner] += order[i][1].numel()
        return 4 * (world_size * max(sizes) - sum(sizes)) <= sum(sizes)

    buckets, closed, nbytes = [], True, 0
    for i in reversed(range(len(order))):
        param = order[i][1]
        if closed or param.dtype != order[buckets[-1][0]][1].dtype:
            buckets.append([])
            nbytes = 0
        buckets[-1].append(i)
        nbytes += param.numel() * param.element_size()
        closed = nbytes >= cap and even(buckets[-1])
    while len(buckets) > 1 and order[buckets[-1][0]][1].dtype == order[buckets[-2][0]][1].dtype and not even(buckets[-1]):
        last = buckets.pop()
        buckets[-1] += last
    result = []
    for bucket in buckets:
        owner = owners(bucket)
        result.append(([order[i][1] for i in bucket], [owner[i] for i in bucket]))
    return result


class _OwnerBucket:
    """Parameters whose gradients and updated values travel together: laid out by owner, each
    rank's parameters one after another in its segment of `chunk` elements (the longest
    rank's; the others padded), so that a reduce-scatter gives each rank the sum of exactly
    the gradients it owns and an all-gather of the segments gives everyone every parameter.
    The parameters become views of `values`, the bucket's [N * chunk] buffer, so that the
    all-gather writes them in place (the padding is held too: fewer elements than the
    largest rank's share of the bucket less the smallest's). `dtype`: the parameters' new dtype
    (None: theirs)."""

    def __init__(self, params: list[torch.Tensor], owners: list[int], world_size: int, dtype: torch.dtype | None = None):
        self.params, self.owners, self.world_size = params, owners, world_size
        used = [0] * world_size
        self.places = []  # where each parameter sits in the flat [N * chunk] buffer
        for p, owner in zip(params, owners):
            self.places.append((owner, used[owner]))
            used[owner] += p.numel()
        self.chunk = max(used)
        self.slices = [slice(o * self.chunk + a, o * self.chunk + a + p.numel())
                       for (o, a), p in zip(self.places, params)]
        self.values = self.flat([p.detach() for p in params], dtype)  # [N * chunk]: the parameters live here
        for p, where in zip(params, self.slices):
            p.data = self.values[where].view_as(p)

    def flat(self, tensors, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A zeroed [N * chunk] buffer of `dtype` (None: the parameters') with each tensor (None:
        zeros) in its parameter's place."""
        flat = torch.zeros(self.world_size * self.chunk, dtype=dtype or self.params[0].dtype,
                           device=self.params[0].device)
        for t, where in zip(tensors, self.slices):
            if t is not None:
                flat[where] = t.reshape(-1)
        return flat


class ShardedOptimizer:
    """ZeRO-1 (stage=1) or ZeRO-2 (stage=2) around any torch.optim class.

    `params`: tensors or param-group dicts, as for `optimizer_cls`; gradients are this rank's
    own (no DDP): the optimizer averages them, so every rank must give gradients to the same
    parameters. Each rank keeps the state of its parameters only; `state_dict()` gathers the
    whole state, as `optimizer_cls` would save it.

    Communication goes by buckets of at least `bucket_size_mb` (parameters in reverse order, as
    BucketedDDP, closed where the owners' segments are even: `owner_buckets`; None: one bucket),
    each laid out by owner (`_OwnerBucket`). A bucket's
    gradients are reduce-scattered as soon as backward has accumulated its last one
    (asynchronously, overlapping the rest of backward; at stage 2 the other ranks' gradients
    are dropped then); `step()` waits for them, steps this rank's parameters and all-gathers
    every bucket's updated segments. `gradient_collective`: "reduce_scatter" (the default on
    NCCL: a ring sends (N-1)/N of the bucket) or "all_reduce" (the default on gloo: every rank
    gets the whole sum and keeps its segment). gloo's reduce-scatter reduces the whole bucket
    as its all-reduce does, so it writes as many bytes (2(N-1)/N, measured in lesson 00), and
    it also copies the bucket: on 4 gloo ranks it was slower and held more at its peak
    (benchmarks/bench_zero.py measures both).

    Mixed precision, as in the ZeRO paper: `compute_dtype=torch.bfloat16` (or float16) turns the
    model's trainable parameters into bf16 (views of the buckets; the inputs are yours to cast) and
    each rank keeps an fp32 master copy of the parameters it owns, which `optimizer_cls` steps
    (with Adam: master, momentum and variance, K = 12 bytes per element, over N); the updated
    masters are rounded into the parameters before the all-gather (2 bytes per element). The
    gradients are reduced in `reduce_dtype`: None (the default) in the gradients' own dtype, as
    the paper; torch.float32 copies them into an fp32 bucket, so the sum is accumulated in fp32
    (twice the bytes). fp16 needs `parakit.precision.LossScaler` (a warning says so once).
    """

    def __init__(self, params, optimizer_cls, *, stage: int = 1, group=None, bucket_size_mb: float | None = 25.0,
                 gradient_collective: str | None = None, compute_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, **defaults):
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer subclass such as torch.optim.AdamW "
                            f"(the class, not an instance), got {optimizer_cls!r}")
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 (shard optimizer state) or 2 (and gradients), got {stage!r}; "
                             f"for stage 3 wrap the model in FullyShardedDataParallel")
        if bucket_size_mb is not None and not bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be > 0 (or None for one bucket), got {bucket_size_mb}")
        groups = _param_groups(params)
        gradient_collective = gradient_collective_for(group, gradient_collective)
        self.group, self.stage, self.optimizer_cls = group, stage, optimizer_cls
        if compute_dtype is not None and compute_dtype not in LOW_PRECISION + (torch.float32,):
            raise TypeError(f"compute_dtype must be torch.bfloat16, torch.float16 or torch.float32 (or None: the "
                            f"parameters' dtype), got {compute_dtype!r}")
        if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point):
            raise TypeError(f"reduce_dtype must be a floating-point torch.dtype such as torch.float32, or None to reduce "
                            f"in the gradients' dtype, got {reduce_dtype!r}")
        self.gradient_collective, self.reduce_dtype = gradient_collective, reduce_dtype
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.params = [p for g in groups for p in g["params"]]
        buckets = owner_buckets([g["params"] for g in groups], self.world_size, bucket_size_mb)
        owner = {id(p): o for ps, os in buckets for p, o in zip(ps, os)}
        self.owners = [owner[id(p)] for p in self.params]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._master = {id(p): p.detach().to(torch.float32, copy=True) for p in self.params  # the owned ones, in fp32
                        if (compute_dtype or p.dtype) in LOW_PRECISION and p.requires_grad and self._owner_of(p) == self.rank}
        self._index.update({id(m): self._index[i] for i, m in self._master.items()})
        mine = [{**g, "params": [self._master.get(id(p), p) for p in g["params"] if self._owner_of(p) == self.rank]}
                for g in groups]
        self.optimizer = optimizer_cls(mine, **defaults)
        self.gradients_unscaled = False  # set by LossScaler.unscale_ before each step
        self._warned_fp16 = False
        self.param_groups = [{**local, "params": g["params"]} for local, g in zip(self.optimizer.param_groups, groups)]
        trainable = [p for p in self.params if p.requires_grad]
        buckets = [[(p, o) for p, o in zip(ps, os) if p.requires_grad] for ps, os in buckets]  # frozen: never sent
        self.buckets = [_OwnerBucket([p for p, _ in b], [o for _, o in b], self.world_size, compute_dtype)
                        for b in buckets if b]
        self._place = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket.params}
        self._ready = [set() for _ in self.buckets]  # ids of each bucket's parameters accumulated since the last step
        self._next = 0  # the next bucket to launch: in order, the same on every rank
        self._pending = []  # (bucket, flat gradient buffer, this rank's segment of it, work), in launch order
        self._stale = False  # a gradient accumulated after its bucket went: step() reduces everything again
        self._synchronized = False  # the averages are in .grad (until the next backward or zero_grad)
        for p in trainable:
            register_post_accumulate_grad_hook(p, self._grad_ready)  # held weakly: see parakit.hooks

    def _owner_of(self, param: torch.Tensor) -> int:
        return self.owners[self._index[id(param)]]

    @property
    def local_param_groups(self) -> list[dict]:
        """The parameter groups this rank steps: its own parameters (their fp32 masters, if any)."""
        return self.optimizer.param_groups

    def master_params(self) -> list[torch.Tensor]:
        """The fp32 master copies of this rank's low-precision parameters (empty in fp32)."""
        return list(self._master.values())

    @property
    def state(self):
        """The optimizer state this rank holds: its own parameters' only."""
        return self.optimizer.state

    def _grad_ready(self, param: torch.Tensor) -> None:
        """Backward accumulated `param.grad`: launch every bucket, in order, whose gradients are all there."""
        self._synchronized = False
        b = self._place[id(param)]
        if b < self._next or id(param) in self._ready[b]:
            if self.stage == 2:
                raise RuntimeError("ZeRO-2 reduces each gradient during backward and drops it elsewhere: call "
                                   "optimizer.step() (or zero_grad()) after each backward; to accumulate over "
                                   "several batches use stage=1")
            self._stale = True
            return
        self._ready[b].add(id(param))
        while self._next < len(self.buckets) and len(self._ready[self._next]) == len(self.buckets[self._next].params):
            self._launch_next()

    def _launch_next(self) -> None:
        """Sends: one reduce-scatter of the bucket's N * chunk elements (each rank receives the sum
        of its segment), or an all-reduce of them; at stage 2 the gradients go from `.grad`."""
        bucket = self.buckets[self._next]
        flat = bucket.flat([p.grad for p in bucket.params], self.reduce_dtype)  # [N * chunk], laid out by owner
        if self.stage == 2:
            for p in bucket.params:
                p.grad = p.grad if self._owner_of(p) == self.rank else None
        segment = slice(self.rank * bucket.chunk, (self.rank + 1) * bucket.chunk)
        try:
            if self.gradient_collective == "all_reduce":
                out, work = flat[segment], dist.all_reduce(flat, group=self.group, async_op=True)
            else:
                out = torch.empty(bucket.chunk, dtype=flat.dtype, device=flat.device)  # [chunk]
                work = dist.reduce_scatter_single(out, flat, group=self.group, async_op=True)
        except RuntimeError as error:
            raise unsupported_dtype(error, flat.dtype, self.group) from None
        self._pending.append((bucket, flat, out, work))
        self._next += 1

    def finish_gradient_synchronization(self) -> None:
        """Launch the buckets not launched yet (all of them if a gradient came after its bucket
        went), wait for every reduction and put the averages into the owned parameters' `.grad`
        (and, in fp32, into their masters' `.grad`). Once per backward: a second call does nothing."""
        if self._synchronized:
            return
        if self._stale:
            self._drop_pending()
        while self._next < len(self.buckets):
            self._launch_next()
        for bucket, flat, out, work in self._pending:
            try:
                work.wait()
            except RuntimeError as error:  # gloo checks the dtype when the reduction runs
                if "scalar type" not in str(error):
                    raise
                raise unsupported_dtype(error, out.dtype, self.group) from None
            out.div_(self.world_size)
            for p, (owner, a) in zip(bucket.params, bucket.places):
                if owner != self.rank:
                    continue
                average = out[a:a + p.numel()].view_as(p)
                if p.grad is not None:
                    p.grad.copy_(average)
                elif average.any():  # other ranks gave it a gradient
                    p.grad = average.to(p.dtype, copy=True)
                if id(p) in self._master and p.grad is not None:
                    self._master[id(p)].grad = average.to(torch.float32, copy=True)
            flat.untyped_storage().resize_(0)  # freed now, not whenever the backend drops its reference
        self._drop_pending()
        self._synchronized = True

    def _drop_pending(self) -> None:
        for *_, work in self._pending:
            work.wait()
        self._pending, self._next, self._stale = [], 0, False
        for ready in self._ready:
            ready.clear()

    def in_flight(self) -> list[torch.Tensor]:
        """The gradient buffers of the reductions not finished yet (for zero.held_bytes)."""
        return [t for _, flat, out, _ in self._pending for t in (flat, out)]

    @torch.no_grad()
    def step(self, closure=None):
        """Finish averaging the gradients onto their owners, step this rank's parameters, and
        all-gather each bucket's updated segments (sends (N-1) x chunk elements per bucket)."""
        self.finish_gradient_synchronization()
        if not self.gradients_unscaled and not self._warned_fp16 and any(p.dtype == torch.float16 for p in self.params):
            warnings.warn("fp16 gradients without loss scaling underflow to zero below 2**-24: step through "
                          "parakit.precision.LossScaler (scaler.scale(loss).backward(); scaler.step(optimizer); "
                          "scaler.update()), or train in torch.bfloat16", stacklevel=2)
            self._warned_fp16 = True
        self.gradients_unscaled = False
        for full, local in zip(self.param_groups, self.optimizer.param_groups):
            local.update({k: v for k, v in full.items() if k != "params"})
        loss = self.optimizer.step(closure)
        for p in self.params:  # the updated masters, rounded into the parameters (views of the buckets)
            master = self._master.get(id(p))
            if master is not None:
                p.detach().copy_(master)
                master.grad = None
        works = []
        for bucket in self.buckets:
            mine = bucket.values[self.rank * bucket.chunk:(self.rank + 1) * bucket.chunk].clone()  # [chunk]
            works.append(dist.all_gather_single(bucket.values, mine, group=self.group, async_op=True))
        for work in works:
            work.wait()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._drop_pending()
        self._synchronized = False
        for master in self._master.values():
            master.grad = None
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict:
        """The whole state, indexed as `optimizer_cls(params).state_dict()` would be, on every
        rank: each rank sends its parameters' state to all others (all_gather_object). In mixed
        precision each parameter's entry also holds its fp32 master ("master")."""
        inner = [p for g in self.optimizer.param_groups for p in g["params"]]
        masters = {id(m) for m in self._master.values()}
        local = {k: {**s, "master": inner[k].detach().clone()} if id(inner[k]) in masters else s
                 for k, s in self.optimizer.state_dict()["state"].items()}
        to_global = [self._index[id(p)] for p in inner]
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
        optimizer): each rank keeps its own parameters' part. In mixed precision the fp32 masters
        come from the saved ones ("master"), or else from the parameters as they are now (load the
        model's state first), and are rounded into the parameters."""
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
        entries = {k: dict(state_dict["state"][i]) for k, i in enumerate(to_saved) if i in state_dict["state"]}
        inner = [p for g in self.optimizer.param_groups for p in g["params"]]
        with torch.no_grad():
            for p in self.params:
                master = self._master.get(id(p))
                if master is not None:
                    saved = entries.get(next(k for k, q in enumerate(inner) if q is master), {}).pop("master", None)
                    master.copy_(p if saved is None else saved)
                    p.copy_(master)
        self.optimizer.load_state_dict({"state": entries, "param_groups": groups})
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
