"""Gradient hooks that do not keep their owner alive.

A parameter keeps its post-accumulate-grad hooks where Python's garbage collector does not
look (torch 2.13), so a hook that is a bound method of a wrapper holding the parameter
(wrapper -> module -> parameter -> hook -> wrapper) is a cycle the collector never frees,
and with the wrapper its process group: under gloo a thread that wakes every 10 ms, under
NCCL a communicator's GPU memory. The hooks made here hold their owner weakly: once nothing
else holds it, the owner is freed and its hooks do nothing.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["register_post_accumulate_grad_hook"]


def register_post_accumulate_grad_hook(param: torch.Tensor, method: Callable[[torch.Tensor], None]) -> RemovableHandle:
    """`param.register_post_accumulate_grad_hook(method)`, with `method`'s object held weakly."""
    ref = weakref.WeakMethod(method)

    def hook(p: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(p)

    return param.register_post_accumulate_grad_hook(hook)
