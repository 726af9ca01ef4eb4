"""Distributed data parallel from scratch, in the order lesson 02 builds it.

    model = BucketedDDP(net, bucket_size_mb=25.0)     # or NaiveDDP, FlatDDP, OverlapDDP
    loss_fn(model(x), y).backward()
    model.finish_gradient_synchronization()          # after backward, before optimizer.step()
    optimizer.step()

Every wrapper broadcasts the parameters (frozen ones too) and buffers of rank 0 of its
process group when it wraps, broadcasts the buffers again before each forward (as
torch's DDP does by default), averages the gradients over the group, and accumulates
locally inside `no_sync()`: the next synchronised backward then gives the gradients of one
big batch. They differ in when and how the gradients travel:

- `NaiveDDP`: a blocking all-reduce per parameter, from its gradient hook;
- `FlatDDP`: one all-reduce of all gradients flattened, after backward;
- `OverlapDDP`: an async all-reduce per parameter as soon as its gradient is accumulated;
- `BucketedDDP`: parameters in reverse order grouped into buckets of `bucket_size_mb`; a
  bucket's async all-reduce starts when its last gradient is ready, buckets in order.

A parameter shared by several modules (tied weights) is one tensor and is reduced once. A
parameter that gets no gradient this step does not stall anything. BucketedDDP, like torch's
DDP with `find_unused_parameters=True`, walks the autograd graph of forward's output and
counts the parameters it does not reach as ready at once (their current gradient, or zeros,
goes into their bucket), so every bucket goes out during backward; a parameter counted so
that then gets a gradient anyway (the loss used it outside forward) raises. FlatDDP reduces
such a parameter as zeros at `finish_gradient_synchronization()`. Both issue the same
all-reduces in the same order on every rank even when ranks disagree on which parameters
were used; a `.grad` stays None where no rank gave it a gradient, and where some ranks did,
every rank gets the average. NaiveDDP and OverlapDDP reduce only parameters with a
gradient, so ranks must agree on which parameters they use (else their all-reduces pair up
wrongly). Forgetting `finish_gradient_synchronization()` raises at the next forward or
backward.
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from parakit import devices
from parakit.groups import broadcast_from_first
from parakit.hooks import register_post_accumulate_grad_hook

__all__ = ["NaiveDDP", "FlatDDP", "OverlapDDP", "BucketedDDP", "assign_buckets", "allreduce_hook",
           "compress_hook", "timed_hook"]

_UNFINISHED = ("the gradients of the last backward were not synchronised: call "
               "model.finish_gradient_synchronization() after loss.backward() and before optimizer.step()")


class _DataParallel(nn.Module):
    """What the four wrappers share: checks, broadcasts, gradient hooks, no_sync.
    `check_parameters=False` skips the check that every rank wraps the same model (one
    all_gather_object of the parameters' names, shapes and dtypes)."""

    def __init__(self, module: nn.Module, process_group=None, check_parameters: bool = True):
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"{type(self).__name__} needs a process group: call dist.init_process_group() "
                               "first (parakit.launch and torchrun do it for you)")
        if not list(module.parameters()):
            raise ValueError(f"{type(module).__name__} has no parameters: there are no gradients to synchronise")
        self.module = module
        self.process_group = dist.group.WORLD if process_group is None else process_group
        self.world_size = dist.get_world_size(self.process_group)
        if check_parameters:
            _check_same_parameters(module, self.process_group)
        broadcast_from_first(list(module.parameters()) + list(module.buffers()), self.process_group)
        self._params = [p for p in module.parameters() if p.requires_grad]  # parameters() yields a tied one once
        self._ready: set[int] = set()  # ids of the parameters whose hook fired since the last finish
        self._sync = True
        for param in self._params:
            register_post_accumulate_grad_hook(param, self._grad_ready)  # held weakly: see parakit.hooks

    def forward(self, *args, **kwargs):
        if self._ready:
            raise RuntimeError(_UNFINISHED)
        broadcast_from_first(list(self.module.buffers()), self.process_group)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally, with no communication."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _grad_ready(self, param: nn.Parameter) -> None:
        if not self._sync:
            return
        if id(param) in self._ready:
            raise RuntimeError(_UNFINISHED)
        self._ready.add(id(param))
        self._on_grad_ready(param)

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        """Called once per synchronised backward for each parameter that got a gradient."""

    def finish_gradient_synchronization(self) -> None:
        """Completes the averaging; afterwards every rank holds the same gradients."""
        self._ready.clear()


def _check_same_parameters(module: nn.Module, group) -> None:
    """Sends the names, shapes and dtypes of the parameters (a few bytes each) to every rank,
    and raises on every rank if they differ."""
    mine = [(name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters()]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    first = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        for (name, shape, dtype), (name1, shape1, dtype1) in zip(first, theirs):
            if (name, shape, dtype) != (name1, shape1, dtype1):
                raise ValueError(f"parameter {name!r} is {shape} {dtype} on rank 0 but {name1!r} is {shape1} "
                                 f"{dtype1} on rank {rank}: every rank must wrap the same model")
        if len(theirs) != len(first):
            raise ValueError(f"rank 0 has {len(first)} parameters but rank {rank} has {len(theirs)}: "
                             "every rank must wrap the same model")


# ---------------------------------------------------------------- 1. naive


class NaiveDDP(_DataParallel):
    """One blocking all-reduce per parameter, issued from its gradient hook."""

    def _on_grad_ready(self, param):
        """Sends: an all-reduce of the parameter's gradient (numel x itemsize bytes) over the group."""
        dist.all_reduce(param.grad, group=self.process_group)
        param.grad.div_(self.world_size)


# ---------------------------------------------------------------- communication hooks for buckets


def allreduce_hook(flat: torch.Tensor, group) -> torch.futures.Future:
    """Sends: an async all-reduce (sum) of `flat` (numel x itemsize bytes) over `group`.
    Returns a future whose value is the reduced `flat`. A hook may return any object whose
    wait() gives the reduced tensor: a bucket only waits on it."""
    work = dist.all_reduce(flat, group=group, async_op=True)
    return work.get_future().then(lambda _: flat)


def compress_hook(dtype: torch.dtype):
    """A hook that all-reduces a copy of the bucket cast to `dtype` (torch.float16 or
    torch.bfloat16: half the bytes of float32) and writes the result back into the bucket."""

    def hook(flat: torch.Tensor, group) -> torch.futures.Future:
        """Sends: an async all-reduce of `flat` cast to the low dtype (numel x 2 bytes)."""
        low = flat.to(dtype)
        work = dist.all_reduce(low, group=group, async_op=True)
        return work.get_future().then(lambda _: flat.copy_(low))

    hook.__name__ = hook.__qualname__ = f"{str(dtype).removeprefix('torch.')}_compress_hook"
    return hook


def timed_hook(hook, events: list):
    """`hook`, timed: each reduction appends (start, end) in time.perf_counter() seconds to
    `events`, from the call (the bucket is full) to the reduction's completion. On the CPU
    (gloo) the end is stamped when the communication thread completes it. On a GPU, NCCL's
    future completes when the all-reduce is queued, so both are CUDA events on the stream: the
    start when the bucket's gradients are ready there, the end once the all-reduce has run; an
    entry is then a `CudaSpan`, read (unpacked) once the GPU has run it."""
    clocks = {}  # device -> its clock; this rank's GPU's is anchored here, outside backward

    def clock(device: torch.device):
        if device not in clocks:
            clocks[device] = devices.CudaClock(device) if device.type == "cuda" else _CPU_CLOCK
        return clocks[device]

    if devices.device().type == "cuda":
        clock(devices.device())

    def timed(flat, group):
        on = clock(flat.device)
        start = on.stamp()

        def done(future):
            events.append(on.span(start, on.stamp()))
            return future.value()

        return hook(flat, group).then(done)

    return timed


class _CpuClock:
    stamp = staticmethod(time.perf_counter)
    span = staticmethod(lambda start, end: (start, end))


_CPU_CLOCK = _CpuClock()


class _Bucket:
    """Parameters whose gradients travel together in one flat buffer."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        offsets = torch.tensor([0] + [p.numel() for p in params]).cumsum(0).tolist()
        self.slices = [slice(a, b) for a, b in zip(offsets, offsets[1:])]
        self.filled: set[int] = set()
        self.future = None

    def fill(self, index: int) -> None:
        """Copy the gradient of params[index] (zeros if it has none) into its place in the buffer."""
        grad, place = self.params[index].grad, self.buffer[self.slices[index]]  # place: [numel]
        place.zero_() if grad is None else place.copy_(grad.reshape(-1))
        self.filled.add(index)

    @property
    def full(self) -> bool:
        return len(self.filled) == len(self.params)

    def launch(self, hook, group, world_size: int) -> None:
        """Sends: what `hook` sends for the whole buffer (by default an all-reduce of its bytes).
        Parameters not filled yet go in as they are: their gradient or zeros."""
        for index in range(len(self.params)):
            if index not in self.filled:
                self.fill(index)
        self.buffer.div_(world_size)
        self.future = hook(self.buffer, group)

    @torch.no_grad()
    def unpack(self) -> None:
        """Wait for the reduction and copy the averages back into the gradients."""
        reduced = self.future.wait()
        for param, where in zip(self.params, self.slices):
            average = reduced[where].view_as(param)
            if param.grad is not None:
                param.grad.copy_(average)
            elif average.any():  # other ranks gave it a gradient: keep the replicas equal
                param.grad = average.clone()
        self.filled.clear()
        self.future = None


# ---------------------------------------------------------------- 2. flat


class FlatDDP(_DataParallel):
    """One all-reduce of every gradient flattened into one buffer, after backward;
    `comm_hook` reduces it (see allreduce_hook)."""

    def __init__(self, module: nn.Module, process_group=None, check_parameters: bool = True,
                 comm_hook=allreduce_hook):
        super().__init__(module, process_group, check_parameters)
        self._bucket = _Bucket(self._params) if self._params else None
        self.comm_hook = comm_hook

    def finish_gradient_synchronization(self):
        """Sends: one all-reduce of all gradients (sum of numel x itemsize bytes) over the group."""
        if self._ready and self._bucket is not None:
            self._bucket.launch(self.comm_hook, self.process_group, self.world_size)
            self._bucket.unpack()
        super().finish_gradient_synchronization()


# ---------------------------------------------------------------- 3. overlap


class OverlapDDP(_DataParallel):
    """An async all-reduce per parameter as soon as its gradient is accumulated."""

    def __init__(self, module: nn.Module, process_group=None, check_parameters: bool = True):
        super().__init__(module, process_group, check_parameters)
        self._pending: list[tuple[nn.Parameter, dist.Work]] = []

    def _on_grad_ready(self, param):
        """Sends: an async all-reduce of the parameter's gradient (numel x itemsize bytes)."""
        self._pending.append((param, dist.all_reduce(param.grad, group=self.process_group, async_op=True)))

    def finish_gradient_synchronization(self):
        for param, work in self._pending:
            work.wait()
            param.grad.div_(self.world_size)
        self._pending.clear()
        super().finish_gradient_synchronization()


# ---------------------------------------------------------------- 4. buckets + overlap


def assign_buckets(params: list[nn.Parameter], bucket_size_mb: float | None) -> list[list[nn.Parameter]]:
    """Group `params` in reverse order (the order backward produces their gradients) into
    buckets of at most `bucket_size_mb` MiB; a bigger parameter gets a bucket of its own, a
    change of dtype starts a new one. None: one bucket per dtype."""
    cap = float("inf") if bucket_size_mb is None else bucket_size_mb * 2**20
    buckets, size = [], 0
    for param in reversed(params):
        nbytes = param.numel() * param.element_size()
        if not buckets or size + nbytes > cap and size > 0 or param.dtype != buckets[-1][0].dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(param)
        size += nbytes
    return buckets


def _parameters_reached(output) -> set[int]:
    """The ids of the tensors that backward from `output` (any nest of tensors) accumulates
    gradients into: the AccumulateGrad nodes of its autograd graph, and leaves in `output`."""
    tensors = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    reached = {id(t) for t in tensors if t.requires_grad and t.grad_fn is None}
    todo, seen = [t.grad_fn for t in tensors if t.grad_fn is not None], set()
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            if hasattr(node, "variable"):  # AccumulateGrad
                reached.add(id(node.variable))
            todo.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return reached


class BucketedDDP(_DataParallel):
    """Buckets of gradients, each reduced asynchronously by `comm_hook` as soon as it is full."""

    def __init__(self, module: nn.Module, bucket_size_mb: float | None = 25.0, process_group=None,
                 check_parameters: bool = True, comm_hook=allreduce_hook):
        if bucket_size_mb is not None and not bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be > 0 (or None for one bucket), got {bucket_size_mb}")
        super().__init__(module, process_group, check_parameters)
        self.buckets = [_Bucket(params) for params in assign_buckets(self._params, bucket_size_mb)]
        self._place = {id(p): (b, i) for b, bucket in enumerate(self.buckets) for i, p in enumerate(bucket.params)}
        self._next = 0  # the next bucket to launch: buckets go in order, the same on every rank
        self._unused: set[int] = set()  # ids of the parameters the last forward's output does not reach
        self.comm_hook = comm_hook

    def register_comm_hook(self, hook) -> None:
        """Reduce each bucket with `hook(flat, group) -> Future[Tensor]` (see allreduce_hook)."""
        self.comm_hook = hook

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        self._mark_unused(output if self._sync and torch.is_grad_enabled() else None)
        return output

    def _mark_unused(self, output) -> None:
        """Count the parameters that `output` does not depend on (none if it is None) as
        ready: their gradient or zeros goes into their bucket now, so backward launches it."""
        for bucket in self.buckets:  # no hook has fired since the last finish: only old marks here
            bucket.filled.clear()
        reached = {id(p) for p in self._params} if output is None else _parameters_reached(output)
        self._unused = {id(p) for p in self._params if id(p) not in reached}
        for pid in self._unused:
            b, index = self._place[pid]
            self.buckets[b].fill(index)

    def _on_grad_ready(self, param):
        if id(param) in self._unused:
            name = next(n for n, p in self.module.named_parameters() if p is param)
            raise RuntimeError(f"parameter {name!r} got a gradient, but the output of forward does not depend on "
                               "it, so BucketedDDP counted it as unused and reduces its bucket without that gradient: "
                               "use it inside the module's forward (a loss term on it too), not outside the model")
        b, index = self._place[id(param)]
        self.buckets[b].fill(index)
        while self._next < len(self.buckets) and self.buckets[self._next].full:
            self._launch_next()

    def _launch_next(self) -> None:
        """Sends: one all-reduce of the bucket's bytes (or what the comm hook sends)."""
        self.buckets[self._next].launch(self.comm_hook, self.process_group, self.world_size)
        self._next += 1

    def finish_gradient_synchronization(self):
        """Launches the buckets whose parameters did not all get a gradient, then waits for all."""
        if self._ready:
            while self._next < len(self.buckets):
                self._launch_next()
            for bucket in self.buckets:
                bucket.unpack()
            self._next = 0
        self._unused.clear()
        super().finish_gradient_synchronization()
