"""CPU weight-only INT4/INT8 GEMM with torch's packed kernels, the weight repacked once at load.

The reference CPU path (:mod:`nybble.kernels.reference_quant`) dequantizes the whole weight
on every call; this one keeps the weight packed and lets torch's weight-only kernels
dequantize inside the GEMM:

* INT4: ``aten._convert_weight_to_int4pack_for_cpu(q int32 [N, K] in [0, 16), 1)`` -> uint8
  ``[N, K/2]``, then ``aten._weight_int4pack_mm_for_cpu(x [M, K], packed, group,
  scales_and_zeros [K/group, N, 2])`` computes ``x @ W^T`` with
  ``W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]``: ``zero`` is a float offset, so an
  integer zero point ``z`` becomes ``(8 - z) * scale``. Kernel group sizes: 32, 64, 128, 256;
  a checkpoint group that is a multiple of one of them (or a per-channel weight) repeats its
  scales. Needs ``N % 16 == 0``.
* INT8: ``aten._weight_int8pack_mm(x [M, K], w int8 [N, K], scales [N])`` computes
  ``x @ (w * scales)^T``, per output channel only. Grouped weights run one call per group on
  a contiguous ``[N, group]`` slice; stored values are ``q - 128``, and a zero point other
  than 128 adds ``- sum_k(x[m, k in g]) * scale[g, n] * (z[g, n] - 128)``.
* Act order (a non-trivial ``g_idx``) is reordered at load: input rows sorted by group make
  every group contiguous, and ``x`` is gathered by the same permutation at run time.

NOTE: both kernels are vectorized for bfloat16 only (their float32/float16 variants were
10-20x slower than an fp32 GEMV on the AVX2 dev machine), so activations, scales and the
folded zero offsets are rounded to bfloat16 and the products come back in bfloat16.
Tolerance (unit roundoff ``u = 2^-8``): ``|y - y_ref| <= 4u * (|x| @ A^T) + 2u * |y_ref|``
elementwise, with ``A[n, k] = scale * (|q - c| + |c - z|)``, ``c = 2^(bits-1)``
(:func:`error_bound`; tested in tests/kernels/test_cpu_weight_only.py). Beyond
:data:`MAX_ROWS` rows (prefill) the caller uses the reference path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nybble.kernels.reference_quant import IntWeight

MAX_ROWS = 16
"""Rows (tokens) per call up to which the packed kernels run: decode batches of up to 16
sequences. Longer calls (prefill) keep the exact reference path, so prompt logits and
``nybble eval-ppl`` are those of the published dequantization (the kernels would still be
faster there: 2x at 128 rows on the dev machine)."""
_INT4_GROUPS = (256, 128, 64, 32)
_ACT = torch.bfloat16


@dataclass(frozen=True)
class CpuInt4Weight:
    """A 4-bit weight repacked for ``_weight_int4pack_mm_for_cpu``.

    Attributes:
        packed: uint8 ``[N, K/2]``. scales_and_zeros: bfloat16 ``[K/group_size, N, 2]``.
        group_size: the kernel's group size. perm: int64 ``[K]`` input order (act order)
        or None.
    """

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    group_size: int
    perm: torch.Tensor | None


@dataclass(frozen=True)
class CpuInt8Weight:
    """An 8-bit weight split for ``_weight_int8pack_mm``.

    Attributes:
        weights: per group, int8 ``[N, group_size]`` holding ``q - 128`` (one ``[N, K]`` when
            per-channel). scales: per group, bfloat16 ``[N]``.
        offsets: float32 ``[G, N]`` = ``scale * (z - 128)``, or None when every zero point is
            128. group_size: input rows per group. perm: int64 ``[K]`` or None.
    """

    weights: tuple[torch.Tensor, ...]
    scales: tuple[torch.Tensor, ...]
    offsets: torch.Tensor | None
    group_size: int
    perm: torch.Tensor | None


CpuWeight = CpuInt4Weight | CpuInt8Weight


def _group_order(iw: IntWeight) -> tuple[torch.Tensor | None, str | None]:
    """Permutation making every group contiguous, or a reason why none exists."""
    if iw.g_idx is None:
        return None, None
    k = iw.q.shape[0]
    perm = torch.argsort(iw.g_idx, stable=True)
    expect = torch.arange(k, device=iw.g_idx.device) // iw.group_size
    if not torch.equal(iw.g_idx[perm], expect):
        return None, f"g_idx groups are not all {iw.group_size} rows wide"
    return (None if torch.equal(perm, torch.arange(k, device=perm.device)) else perm), None


def prepare(iw: IntWeight, scales: torch.Tensor) -> tuple[CpuWeight | None, str]:
    """Repack a quantized weight for the CPU kernels.

    Args:
        iw: the weight's integers. scales: ``[G, N]`` (fp16/bf16/fp32).

    Returns:
        ``(weight, description)``, or ``(None, reason)`` when the kernels cannot take it
        (the caller then keeps the reference path).
    """
    aten = torch.ops.aten
    k, n = iw.q.shape
    if iw.bits == 4 and not hasattr(aten, "_weight_int4pack_mm_for_cpu"):
        return None, f"torch {torch.__version__} has no _weight_int4pack_mm_for_cpu"
    if iw.bits == 8 and not hasattr(aten, "_weight_int8pack_mm"):
        return None, f"torch {torch.__version__} has no _weight_int8pack_mm"
    if iw.bits not in (4, 8):
        return None, f"bits must be 4 or 8 for the CPU kernels, got {iw.bits}"
    if k % iw.group_size or scales.shape[0] != k // iw.group_size:
        return None, f"group_size {iw.group_size} must divide K={k} into {scales.shape[0]} groups"
    perm, why = _group_order(iw)
    if why is not None:
        return None, why
    g = torch.arange(k) // iw.group_size if iw.g_idx is None else iw.g_idx
    q = iw.q if perm is None else iw.q[perm]  # [K, N], groups now contiguous
    if perm is not None:
        g = g[perm]
    zero = iw.zero.float()
    s = scales.float()
    if iw.bits == 4:
        kgs = next((c for c in _INT4_GROUPS if iw.group_size % c == 0), None)
        if kgs is None:
            return None, f"group_size {iw.group_size} is not a multiple of 32"
        if n % 16:
            return None, f"out_features must be a multiple of 16, got {n}"
        rep = iw.group_size // kgs
        s, zero = s.repeat_interleave(rep, 0), zero.repeat_interleave(rep, 0)
        sz = torch.stack([s, (8 - zero) * s], dim=2).to(_ACT).contiguous()
        packed = aten._convert_weight_to_int4pack_for_cpu(
            q.t().contiguous().to(torch.int32), 1)
        return CpuInt4Weight(packed, sz, kgs, perm), "int4pack kernel (bf16 activations)"
    q8 = (q.t().to(torch.int32) - 128).to(torch.int8)  # [N, K]
    gs = iw.group_size
    weights = tuple(q8[:, i:i + gs].contiguous() for i in range(0, k, gs))
    scale_rows = tuple(s[i].to(_ACT).contiguous() for i in range(s.shape[0]))
    off = s * (zero - 128)
    return (CpuInt8Weight(weights, scale_rows, off if bool(off.ne(0).any()) else None, gs,
                          perm),
            "int8pack kernel (bf16 activations)")


def linear(x: torch.Tensor, w: CpuWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] @ W^T + bias`` with a repacked weight; returns ``[M, N]`` in ``x.dtype``."""
    if w.perm is not None:
        x = x.index_select(1, w.perm)
    xb = x.to(_ACT).contiguous()
    if isinstance(w, CpuInt4Weight):
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w.packed, w.group_size,
                                                       w.scales_and_zeros).float()
    else:
        gs = w.group_size
        mm = torch.ops.aten._weight_int8pack_mm
        y = mm(xb[:, :gs].contiguous(), w.weights[0], w.scales[0]).float()
        for i in range(1, len(w.weights)):
            y += mm(xb[:, i * gs:(i + 1) * gs].contiguous(), w.weights[i], w.scales[i])
        if w.offsets is not None:
            # the same bf16-rounded x as the products, so large offsets cancel exactly
            y -= xb.float().reshape(xb.shape[0], -1, gs).sum(dim=2) @ w.offsets
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def error_bound(x: torch.Tensor, iw: IntWeight, scales: torch.Tensor,
                y_ref: torch.Tensor) -> torch.Tensor:
    """The documented elementwise tolerance of :func:`linear` against the reference
    (module docstring), float64 ``[M, N]``."""
    u = 2.0 ** -8
    k = iw.q.shape[0]
    c = 1 << (iw.bits - 1)
    g = torch.arange(k) // iw.group_size if iw.g_idx is None else iw.g_idx
    s = scales.double()[g]  # [K, N]
    a = s * ((iw.q.double() - c).abs() + (c - iw.zero.double()[g]).abs())
    return 4 * u * (x.double().abs() @ a) + 2 * u * y_ref.double().abs()
