"""Quantized GEMM dispatch (signatures: docs/interfaces.md "Kernels").

On CUDA these call the fused Triton kernels in ``nybble.kernels.triton.quant_gemm`` (imported
lazily, so CPU-only installs never import Triton); elsewhere they dequantize with the
references in :mod:`nybble.kernels.reference.quant` and run one matmul in ``x.dtype``.
"""
from __future__ import annotations

import torch

from nybble.kernels.reference.quant import dequantize_awq, dequantize_gptq, int8_w8a8_linear


def _use_triton(x: torch.Tensor) -> bool:
    return x.device.type == "cuda"


def _matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x @ w.to(x.dtype).t()
    return y if bias is None else y + bias.to(x.dtype)


def gptq_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
              scales: torch.Tensor, g_idx: torch.Tensor | None, bits: int, group_size: int,
              zero_offset: int, sym: bool, bias: torch.Tensor | None = None,
              mins: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x @ dequant_gptq(...)^T + bias``.

    Args:
        x: ``[M, K]`` fp16/bf16/fp32. qweight: int32 ``[K*bits/32, N]``.
        qzeros: int32 ``[G, N*bits/32]``. scales: ``[G, N]``. g_idx: int32 ``[K]`` or None.
        bits: 4 or 8. group_size: -1 (= K) or the group width.
        zero_offset: 1 for gptq v1, 0 for gptq_v2. sym: fixed zero ``2^(bits-1)``.
        bias: ``[N]`` or None. mins: ``[G, N]`` float per-group minimum (``W = s * q + m``,
            the zeros ignored; GGUF's Q4_1/Q4_K/Q5_1/Q5_K) or None.

    Returns:
        ``[M, N]`` in ``x.dtype``.
    """
    if _use_triton(x):
        from nybble.kernels.triton import quant_gemm as triton_quant_gemm

        return triton_quant_gemm.gptq_gemm(x, qweight, qzeros, scales, g_idx, bits, group_size,
                                           zero_offset, sym, bias, mins=mins)
    w = dequantize_gptq(qweight, qzeros, scales, g_idx, bits, group_size, zero_offset, sym,
                        mins)
    return _matmul(x, w, bias)


def awq_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
             scales: torch.Tensor, group_size: int,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x @ dequant_awq(...)^T + bias`` (4-bit AWQ GEMM layout).

    Args:
        x: ``[M, K]``. qweight: int32 ``[K, N/8]`` (interleaved). qzeros: int32 ``[G, N/8]``.
        scales: ``[G, N]``. group_size: -1 or the group width. bias: ``[N]`` or None.

    Returns:
        ``[M, N]`` in ``x.dtype``.
    """
    if _use_triton(x):
        from nybble.kernels.triton import quant_gemm as triton_quant_gemm

        return triton_quant_gemm.awq_gemm(x, qweight, qzeros, scales, group_size, bias)
    return _matmul(x, dequantize_awq(qweight, qzeros, scales, group_size), bias)


def w8a8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dynamic per-token int8 activations x int8 per-channel weights (compressed-tensors W8A8).

    Args:
        x: ``[M, K]``. weight: int8 ``[N, K]``. weight_scale: ``[N, 1]``. bias: ``[N]`` or None.

    Returns:
        ``[M, N]`` in ``x.dtype``. Torch reference on every device (no fused kernel yet).
    """
    return int8_w8a8_linear(x, weight, weight_scale, bias)
