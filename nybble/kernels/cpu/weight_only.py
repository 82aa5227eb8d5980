"""CPU weight-only INT4/INT8 GEMM for decode batches, the weight repacked once at load.

The reference CPU path (:mod:`nybble.kernels.reference.quant`) dequantizes the whole weight
on every call; this one keeps the weight packed and dequantizes inside the GEMM
(:mod:`nybble.kernels.cpu.wo_gemm`, C with an AVX2+FMA path chosen at run time), so a
memory-bound decode step reads 0.5 (INT4) or 1 (INT8) byte per weight instead of 4:

* :func:`prepare` repacks ``q [K, N]`` into blocks of 32 output columns stored K-major (eight
  4-bit values per ``uint32``, or ``q - 128`` as ``int8``), with float32 scales and zero points
  ``[G, Np]`` (``N`` padded to a multiple of 32 with zero columns that are never written out).
* Act order (a non-trivial ``g_idx``) is reordered at load: input rows sorted by group make
  every group contiguous, and the kernel reads ``x`` through the same permutation.
* Any group size (the last group may be shorter, as GPTQ allows) and per-channel weights.

Numerics: float32 activations and accumulation, ``q - z`` exact. For one row the kernel sums
``x * q`` per group and subtracts ``z * sum(x)``; for more rows it forms ``q - z`` first. The
reference rounds ``s * (q - z)`` to the scale dtype (unit roundoff ``u_s``: ``2^-11`` for
float16 scales, ``2^-8`` bfloat16, ``2^-24`` float32) before an exact-order GEMM. Tolerance,
elementwise: ``|y - y_ref| <= gamma_n * (|x| @ A^T) + u_s * (|x| @ |W|^T)`` with
``A[n, k] = s * (|q| + |z|)``, ``W[n, k] = s * (q - z)``, ``gamma_n = n u / (1 - n u)``,
``u = 2^-24`` and
``n = L + G + 3`` (``L`` the group size, ``G`` the number of groups) — :func:`error_bound`,
tested in tests/kernels/cpu/test_weight_only.py. GGUF's float minimums (``W = s q + m``, zero
ignored) are added as ``m * sum(x)`` per group (one more float32 rounding per group). A call
takes any number of rows (in chunks of :data:`MAX_ROWS` per weight block, the weight read from
memory once); beyond :data:`KERNEL_ROWS` rows (prefill) the caller uses the reference path.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nybble.kernels.cpu import wo_gemm as cpu_wo_gemm
from nybble.kernels.cpu.qgemm_pack import group_order
from nybble.kernels.reference.quant import IntWeight

MAX_ROWS = cpu_wo_gemm.MAX_ROWS
"""Rows the kernel runs together over one weight block (its register/cache tile)."""
KERNEL_ROWS = 256
"""Rows (tokens) per call up to which a quantized layer runs this kernel. Longer calls (long
prefill chunks, ``nybble eval-ppl``) take the reference path (the weight dequantized once to
float32, then oneDNN/MKL's GEMM), which the dequantization's cost no longer outweighs there.
Measured on the 2-core AVX2 dev machine, one thread, SmolLM2-135M's INT4 g32 gate/up
``[576 -> 3072]`` (kernel vs reference, ms): 64 rows 5.4 vs 14.2, 128 rows 10.6 vs 18.2, 256
rows 23.2 vs 25.6, 512 rows 40.3 vs 41.3; its down ``[1536 -> 576]``: 256 rows 10.1 vs 10.5,
512 rows 23.2 vs 16.9."""
_COLS = cpu_wo_gemm.COLS
_SCALE_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8,
                   torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}


@dataclass(frozen=True)
class CpuWeight:
    """A 4- or 8-bit weight repacked for :func:`nybble.kernels.cpu.wo_gemm.wo_gemm`.

    Attributes:
        bits: 4 or 8. in_features ``K``, out_features ``N``, group_size: input rows per
            group (the last may be shorter).
        packed: uint8 bytes of the packed weight (``Np * K * bits / 8``).
        scales: ``[G, Np]`` float32, or uint16 float16 bits when every scale (and minimum)
            is a float16 value (lossless; half the bytes streamed).
        zeros: float32 ``[G, Np]`` (``z``; ``z - 128`` for 8 bits), or None when every
            zero is ``zero`` (symmetric types, float minimums: no bytes streamed).
        perm: int64 ``[K]`` input order (act order) or None.
        mins: ``[G, Np]`` per-group minimums (GGUF ``W = s q + m``) in the scales' dtype,
            or None.
        zero: the one zero point when ``zeros`` is None (``- 128`` applied for 8 bits).
    """

    bits: int
    in_features: int
    out_features: int
    group_size: int
    packed: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray | None
    perm: np.ndarray | None
    mins: np.ndarray | None = None
    zero: float = 0.0

    @property
    def streamed_bytes(self) -> int:
        """Bytes one call reads from memory: packed integers, scales, zeros, minimums."""
        return sum(a.nbytes for a in (self.packed, self.scales, self.zeros, self.mins)
                   if a is not None)


def _pad_columns(t: torch.Tensor, np_: int) -> torch.Tensor:
    """``[R, N] -> [R, Np]`` with zero columns appended."""
    return torch.nn.functional.pad(t, (0, np_ - t.shape[1]))


def _half_if_exact(t: torch.Tensor, other: torch.Tensor | None) -> np.ndarray:
    """``t`` (float32) as float16 bits (uint16) when it and ``other`` (the minimums for the
    scales, or the scales for the minimums: one dtype for both) are all float16 values, else
    as float32."""
    def exact(a: torch.Tensor | None) -> bool:
        return a is None or bool((a.half().float() == a).all())
    if exact(t) and exact(other):
        return t.half().numpy().view(np.uint16)
    return t.numpy()


def prepare(iw: IntWeight, scales: torch.Tensor) -> tuple[CpuWeight | None, str]:
    """Repack a quantized weight for the CPU kernel.

    Args:
        iw: the weight's integers. scales: ``[G, N]`` (fp16/bf16/fp32).

    Returns:
        ``(weight, description)``, or ``(None, reason)`` when the kernel cannot take it
        (the caller then keeps the reference path).
    """
    k, n = iw.q.shape
    if iw.bits not in (4, 8):
        return None, f"bits must be 4 or 8 for the CPU kernel, got {iw.bits}"
    gs = iw.group_size
    g = -(-k // gs)
    if scales.shape[0] != g or iw.zero.shape[0] != g:
        return None, f"group_size {gs} must split K={k} into {scales.shape[0]} groups"
    perm, why = group_order(iw)
    if why is not None:
        return None, why
    np_ = -(-n // _COLS) * _COLS
    q = (iw.q if perm is None else iw.q[perm]).to(torch.int64)  # [K, N], groups contiguous
    q = _pad_columns(q, np_).reshape(k, np_ // _COLS, _COLS)
    zero = iw.zero.to(torch.float32)
    if iw.mins is not None:   # W = s q + m: the zero point is not used
        zero = torch.zeros_like(zero)
    if iw.bits == 4:
        nib = q.reshape(k, np_ // _COLS, 4, 8) << (4 * torch.arange(8))
        words = nib.sum(dim=3).to(torch.int32)  # < 2^32: the top nibble wraps to int32 bits
        packed = words.transpose(0, 1).contiguous()  # [Np/32, K, 4]
    else:
        packed = (q - 128).to(torch.int8).transpose(0, 1).contiguous()  # [Np/32, K, 32]
        zero = zero - 128
    s32 = _pad_columns(scales.float(), np_).contiguous()
    m32 = None if iw.mins is None else _pad_columns(iw.mins.float(), np_).contiguous()
    z_pad = _pad_columns(zero, np_)
    z_pad[:, n:] = zero[0, 0] if zero.numel() else 0.0   # padding columns take any zero
    uniform = bool((z_pad == z_pad.reshape(-1)[0]).all()) if z_pad.numel() else True
    return (CpuWeight(iw.bits, k, n, gs, packed.numpy().view(np.uint8).reshape(-1),
                      _half_if_exact(s32, m32),
                      None if uniform else z_pad.contiguous().numpy(),
                      None if perm is None else perm.to(torch.int64).contiguous().numpy(),
                      None if m32 is None else _half_if_exact(m32, s32),
                      float(z_pad.reshape(-1)[0]) if uniform and z_pad.numel() else 0.0),
            f"int{iw.bits} weight-only kernel "
            f"({'AVX2' if cpu_wo_gemm.have_avx2() else 'portable C'}, fp32 activations)")


def linear(x: torch.Tensor, w: CpuWeight, bias: torch.Tensor | None,
           portable: bool = False) -> torch.Tensor:
    """``x [M, K] @ W^T + bias`` with a repacked weight, ``M >= 1``; returns ``[M, N]`` in
    ``x.dtype``. ``portable`` forces the portable C loop (tests).

    Raises:
        ValueError: ``x`` not ``[M, K]`` with ``M >= 1``.
    """
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be [M, {w.in_features}], got {list(x.shape)}")
    x32 = x.to(torch.float32).contiguous()
    y = torch.empty(x.shape[0], w.out_features, dtype=torch.float32)
    cpu_wo_gemm.wo_gemm(x32.numpy(), w, y.numpy(), portable)
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def error_bound(x: torch.Tensor, iw: IntWeight, scales: torch.Tensor,
                y_ref: torch.Tensor | None = None, *,
                reference_rounding: bool = True) -> torch.Tensor:
    """The documented elementwise tolerance of :func:`linear`, float64 ``[M, N]``.

    Against the reference dequantization (module docstring) by default; with
    ``reference_rounding=False``, against the exact product ``x @ (s * (q - z))^T``
    (float64 oracle), where only the kernel's own float32 rounding counts
    (``gamma_n * (|x| @ A^T)``). ``y_ref`` is unused (kept for callers that pass it).
    """
    k = iw.q.shape[0]
    gs = iw.group_size
    n_terms = gs + -(-k // gs) + 3
    u = 2.0 ** -24
    gamma = n_terms * u / (1 - n_terms * u)
    g = torch.arange(k) // gs if iw.g_idx is None else iw.g_idx
    s = scales.double()[g]  # [K, N]
    xa = x.double().abs()
    zero = iw.zero.double()[g] if iw.mins is None else torch.zeros_like(s)
    a = s * (iw.q.double().abs() + zero.abs())
    if iw.mins is not None:   # + m * sum(x): the group sum's and the product's roundings
        a = a + iw.mins.double().abs()[g]
    bound = gamma * (xa @ a)
    if reference_rounding:
        w = (s * (iw.q.double() - zero)).abs()
        if iw.mins is not None:   # the reference rounds s q, then s q + m
            w = w + (s * iw.q.double() + iw.mins.double()[g]).abs()
        bound = bound + _SCALE_ROUNDOFF[scales.dtype] * (xa @ w)
    return bound
