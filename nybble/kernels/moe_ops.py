"""Fused mixture-of-experts dispatch, as :mod:`nybble.kernels.quant_ops` dispatches the GEMMs:
on CUDA the Triton grouped GEMM (:mod:`nybble.kernels.triton.fused_moe`, imported lazily so
CPU-only installs never import Triton), elsewhere the torch reference
(:mod:`nybble.kernels.reference.moe`)."""
from __future__ import annotations

import torch

from nybble.kernels.reference import moe as reference


def _use_triton(x: torch.Tensor) -> bool:
    return x.device.type == "cuda"


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  expert_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` with stacked SwiGLU experts.

    Args:
        x: ``[T, H]`` float16/bfloat16/float32. w13: ``[E, 2I, H]`` (gate rows, then up rows).
        w2: ``[E, H, I]``. weights: ``[T, top_k]`` float32 or ``x.dtype``.
        expert_ids: ``[T, top_k]`` int in ``[0, E)``. activation: ``silu``.

    Returns:
        ``[T, H]`` in ``x.dtype``.

    Raises:
        ValueError: shapes that do not agree or an unknown activation.
    """
    if _use_triton(x):
        from nybble.kernels.triton import fused_moe

        return fused_moe.fused_experts(x, w13, w2, weights, expert_ids, activation)
    return reference.fused_experts(x, w13, w2, weights, expert_ids, activation)
