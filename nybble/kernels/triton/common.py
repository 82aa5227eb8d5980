"""Guarded Triton import and the small helpers every Triton kernel module shares.

Importing this module raises ``ImportError`` with an actionable message when triton is not
installed, so ``nybble.kernels`` itself (the torch path) never depends on triton. Kernels run
on CUDA devices, or on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1``, which
must be set before triton is first imported).
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only without triton installed
    raise ImportError(
        "the triton kernels need the 'triton' package (pip install 'nybble[triton]')"
    ) from exc

__all__ = [
    "cdiv",
    "check_device",
    "dot",
    "is_interpreter",
    "m_bucket",
    "next_power_of_2",
    "tl",
    "tl_dtype_precision",
    "triton",
    "upcast_dot",
]


def is_interpreter() -> bool:
    """True when kernels run in the Triton CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """Smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def check_device(*tensors: torch.Tensor) -> None:
    """Check that Triton can run on the tensors' device.

    Raises:
        ValueError: tensors on different devices, or on CPU without ``TRITON_INTERPRET=1``.
    """
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    device = next(iter(devices))
    if device.type != "cuda" and not is_interpreter():
        raise ValueError(f"triton kernels need a CUDA device or TRITON_INTERPRET=1, got {device}")


def tl_dtype_precision(dtype: torch.dtype) -> str:
    """``input_precision`` for ``tl.dot``: exact fp32 ("ieee", not TF32) for fp32 operands."""
    return "ieee" if dtype == torch.float32 else "tf32"


def upcast_dot(dtype: torch.dtype) -> bool:
    """Whether :func:`dot` must upcast its operands to fp32.

    NOTE: the Triton 3.x interpreter computes bf16 ``tl.dot`` on the raw bit patterns (garbage),
    so under the interpreter bf16 tiles are multiplied in fp32 instead; on GPUs bf16 stays bf16.
    """
    return is_interpreter() and dtype == torch.bfloat16


@triton.jit
def dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``tl.dot(a, b)`` with fp32 result; ``UPCAST`` multiplies in fp32 (see :func:`upcast_dot`)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def capped_log2_scores(qk, scale, softcap, SOFTCAP: tl.constexpr):
    """Attention scores in log2 units from raw dot products ``qk``: ``qk * scale * log2(e)``,
    or with ``SOFTCAP`` Gemma 2's ``c * tanh(qk * scale / c) * log2(e)`` (``c = softcap``;
    tanh as ``1 - 2 / (exp(2x) + 1)``, exact at both infinities)."""
    if SOFTCAP:
        x = qk * (scale / softcap)
        return (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * (softcap * 1.4426950408889634)
    else:
        return qk * (scale * 1.4426950408889634)


def m_bucket(m: int) -> int:
    """Autotune bucket of a GEMM's M (rows): 1, 2, 4, ... up to 256, then 512 for anything larger.

    Keying autotune on the bucket rather than on M itself keeps the number of tunings small
    while still separating decode (M <= 16) from prefill shapes.
    """
    return min(next_power_of_2(max(m, 1)), 512)
