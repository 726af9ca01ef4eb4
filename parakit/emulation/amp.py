"""torch.autocast("fgpu"): CUDA's autocast rules on the emulated GPUs.

Inside `torch.autocast("fgpu", dtype=...)` every operator on fgpu tensors passes here first,
as on CUDA: the matrix products and convolutions of `LOWER` run in the autocast dtype, the
operators of `FP32` (reductions, norms, losses, exponentials) in float32, those of `PROMOTE`
in their widest input type, and every other operator as it is. The lists are CUDA's
(torch/csrc/autocast_mode.cpp), so lessons and tests that use autocast on the device get
the dtypes they would get on a GPU.
"""
from __future__ import annotations

import torch

__all__ = ["install", "LOWER", "FP32", "PROMOTE"]

LOWER = {"_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
         "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv",
         "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "lstm_cell",
         "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "scaled_dot_product_attention",
         "_scaled_dot_product_flash_attention"}
FP32 = {"acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
        "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm", "frobenius_norm",
        "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
        "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
        "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
        "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
        "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm", "linalg_matrix_norm", "sum"}
PROMOTE = {"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler", "index_put", "scatter_add",
           "tensordot"}
_KEY = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)
_LIBRARY = torch.library.Library("_", "IMPL")


def install(device_type: str) -> None:
    """Give the PrivateUse1 device (`device_type`) CUDA's autocast (once per process)."""
    def autocast(op, *args, **kwargs):
        name = op._schema.name.split("::")[-1]
        dtype = _target(name, torch.get_autocast_dtype(device_type), args, kwargs, device_type)
        if dtype is not None:
            args, kwargs = _cast(args, dtype, device_type), _cast(kwargs, dtype, device_type)
        with torch._C._ExcludeDispatchKeyGuard(_KEY):
            return op(*args, **kwargs)

    _LIBRARY.fallback(autocast, "AutocastPrivateUse1")


def _target(name: str, lower: torch.dtype, args, kwargs, device_type: str) -> torch.dtype | None:
    if name in LOWER:
        return lower
    if name in FP32:
        return torch.float32
    if name in PROMOTE:
        floats = [t.dtype for t in _tensors((args, kwargs)) if t.is_floating_point() and t.device.type == device_type]
        return max(floats, key=lambda d: torch.finfo(d).bits) if floats else None
    return None


def _cast(value, dtype: torch.dtype, device_type: str):
    """Floating-point tensors on the device in `value` (and its lists, tuples, dicts) cast to `dtype`."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.device.type == device_type else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype, device_type) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype, device_type) for k, v in value.items()}
    return value


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []
