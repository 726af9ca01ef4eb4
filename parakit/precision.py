"""Mixed precision: autocast on the data's device, dynamic loss scaling with
torch.amp.GradScaler's rules, and the error for a dtype the backend cannot reduce.

    scaler = LossScaler()
    with autocast(torch.float16, x):   # torch.autocast on x's device type (its GPU's, or the CPU's)
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()      # gradients of loss x scale: small fp16 gradients survive
    scaler.step(optimizer)             # unscale, find inf/NaN, step only if there was none
    scaler.update()                    # back off after an overflow; grow after growth_interval clean steps

fp16 keeps 5 bits of exponent: gradients below 2^-24 flush to zero. Multiplying the loss by
S multiplies every gradient by S, lifting them into range; the optimizer must see them
divided by S again, and a step whose gradients overflowed (inf or NaN anywhere) is skipped
and S halved. bf16 has fp32's exponent and needs no scaling.

Where gradients are sharded (ZeRO: each rank unscales only the gradients it steps) the ranks
must agree to skip: `unscale_` all-reduces the found-inf flag (one element, MAX) over the
optimizer's `group` (ShardedOptimizer) or the scaler's own `group`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parakit.devices import device

__all__ = ["LossScaler", "autocast", "unsupported_dtype"]


def autocast(dtype: torch.dtype, *data: torch.Tensor, enabled: bool = True) -> torch.autocast:
    """torch.autocast for the device the data lives on: the device type of `data` (tensors), or
    of this rank's device (`parakit.device()`) when none is given. (autocast("cpu") around CUDA
    data casts nothing, silently: the block runs in fp32.)"""
    types = sorted({t.device.type for t in data}) or [device().type]
    if len(types) > 1:
        raise ValueError(f"the data lives on {' and '.join(types)}: autocast casts the operators of one device "
                         f"type; move it all to this rank's device (parakit.device(): {device()})")
    return torch.autocast(types[0], dtype, enabled=enabled)


class LossScaler:
    """GradScaler's dynamic loss scale: starts at `init_scale`, times `backoff_factor` after a
    step with inf/NaN gradients (skipped), times `growth_factor` after `growth_interval`
    steps in a row without. `skipped` counts the skipped steps. `group`: the ranks whose
    gradients together make the model's (sharded), over which the overflow flag is agreed."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, group=None):
        if not init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {init_scale}")
        if not (growth_factor > 1 and 0 < backoff_factor < 1):
            raise ValueError(f"growth_factor must be > 1 and backoff_factor in (0, 1), "
                             f"got {growth_factor} and {backoff_factor}")
        if not (isinstance(growth_interval, int) and growth_interval > 0):
            raise ValueError(f"growth_interval must be a positive int, got {growth_interval!r}")
        self.scale_factor = torch.tensor(float(init_scale))  # fp32, as GradScaler's
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.group = group
        self.clean_steps = 0  # steps without overflow since the scale last changed
        self.skipped = 0
        self._found_inf: bool | None = None  # this step's verdict, once unscaled

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """loss x scale, in fp32."""
        return loss.float() * self.scale_factor

    def unscale_(self, optimizer) -> bool:
        """Divide the gradients `optimizer` steps by the scale (its `local_param_groups` where it
        has them: a ShardedOptimizer's own parameters, after it finishes reducing) and return
        whether any is inf or NaN, agreed over the group (sends one element per rank)."""
        if self._found_inf is not None:
            raise RuntimeError("unscale_ was already called since the last update(): call it once per step")
        finish = getattr(optimizer, "finish_gradient_synchronization", None)
        if finish is not None:
            finish()
        groups = getattr(optimizer, "local_param_groups", optimizer.param_groups)
        grads = [p.grad for g in groups for p in g["params"] if p.grad is not None]
        found = torch.zeros(1, device=device())
        if grads:
            if any(g.dtype == torch.float16 for g in grads):
                raise TypeError("the optimizer's gradients are fp16: keep fp32 master weights (a ShardedOptimizer "
                                "over fp16 parameters does) or fp32 parameters under torch.autocast, and unscale those")
            found = torch.stack([torch.logical_not(g.isfinite().all()) for g in grads]).any().float().reshape(1).to(found)
            torch._foreach_mul_(grads, self.scale_factor.double().reciprocal().float().item())
        group = getattr(optimizer, "group", None) if hasattr(optimizer, "local_param_groups") else self.group
        if dist.is_initialized() and (group is not None or hasattr(optimizer, "local_param_groups")):
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        self._found_inf = bool(found.item())
        if hasattr(optimizer, "gradients_unscaled"):
            optimizer.gradients_unscaled = True
        return self._found_inf

    def step(self, optimizer, *args, **kwargs):
        """Unscale (if not yet), then `optimizer.step()` unless a gradient overflowed; returns its
        result, or None for a skipped step."""
        found_inf = self.unscale_(optimizer) if self._found_inf is None else self._found_inf
        if found_inf:
            self.skipped += 1
            return None
        return optimizer.step(*args, **kwargs)

    def update(self) -> None:
        """After an overflow: scale x backoff_factor. After growth_interval clean steps: x growth_factor."""
        if self._found_inf is None:
            raise RuntimeError("update() needs a step first: scaler.scale(loss).backward(); scaler.step(optimizer)")
        if self._found_inf:
            self.scale_factor *= self.backoff_factor
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                self.scale_factor *= self.growth_factor
                self.clean_steps = 0
        self._found_inf = None

    def get_scale(self) -> float:
        return self.scale_factor.item()


def unsupported_dtype(error: RuntimeError, dtype: torch.dtype, group=None) -> TypeError:
    """The error to raise when the group's backend refused a collective on `dtype` (gloo has no
    float8): it names the dtype and the backend, and what to change."""
    return TypeError(f"the {dist.get_backend(group)} backend cannot reduce {dtype} tensors ({error}): "
                     f"choose reduce_dtype=torch.float32 (or torch.bfloat16, which gloo and NCCL reduce)")
