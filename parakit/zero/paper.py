"""The ZeRO paper's formulas: bytes each rank keeps and sends per step, by stage (no communication)."""
from __future__ import annotations

__all__ = ["zero_bytes", "zero_comm_bytes"]


def zero_bytes(num_params: int, world_size: int, stage: int, k: float = 12, param_bytes: int = 2,
               grad_bytes: int = 2) -> dict[str, float]:
    """Bytes per rank of the ZeRO paper's table for Psi = num_params on N = world_size ranks.

    Stage 0 (DDP) keeps (param_bytes + grad_bytes + K) Psi; stage 1 divides the optimizer's
    K Psi by N, stage 2 also the gradients, stage 3 also the parameters. The paper's mixed
    precision: fp16 parameters and gradients (2 + 2) and K = 12 (fp32 master, momentum,
    variance); all in fp32 with Adam: 4 + 4 and K = 8; with SGD and momentum K = 4.
    """
    psi, n = num_params, world_size
    return {"parameters": param_bytes * psi / (n if stage >= 3 else 1),
            "gradients": grad_bytes * psi / (n if stage >= 2 else 1),
            "optimizer": k * psi / (n if stage >= 1 else 1)}


def zero_comm_bytes(num_params: int, world_size: int, stage: int, element_bytes: int = 2) -> float:
    """Bytes one rank sends per step: 2 Psi (N-1)/N for stages 0-2 (all-reduce, or reduce +
    broadcast), 3 Psi (N-1)/N for stage 3 (a second all-gather in backward)."""
    return (3 if stage >= 3 else 2) * num_params * element_bytes * (world_size - 1) / world_size
