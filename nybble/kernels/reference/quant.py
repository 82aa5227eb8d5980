"""Pure-torch dequantization references (the CPU path and, in float64, the test oracle).

Numerics follow docs/quant-formats.md §3.5/§4.3: form ``q - z`` as an integer, multiply by
the scale in float32, round once to the scale dtype. This reproduces the tools' fp16
dequantized weights bit for bit. All returned weights are in ``nn.Linear`` layout ``[N, K]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nybble.kernels.packing import AWQ_ORDER, unpack_cols, unpack_rows


def _scale_mul(qz: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``qz`` int ``[...]`` times same-shaped (or broadcast) scales: fp32 product rounded to
    ``scales.dtype`` (float64 scales stay float64)."""
    acc = torch.float64 if scales.dtype == torch.float64 else torch.float32
    return (qz.to(acc) * scales.to(acc)).to(scales.dtype)


def default_g_idx(k: int, group_size: int, device: torch.device | None = None) -> torch.Tensor:
    """``g_idx[k] = k // group_size`` (``group_size == -1``: all zeros), int64 ``[K]``."""
    gs = k if group_size == -1 else group_size
    return torch.arange(k, device=device) // gs


@dataclass(frozen=True)
class IntWeight:
    """A quantized weight as plain integers, whatever its checkpoint layout:
    ``W[n, k] = scale[g[k], n] * (q[k, n] - zero[g[k], n])``, or, with ``mins`` (GGUF's
    Q4_1/Q5_1/Q4_K/Q5_K, ``y = d * q + m``), ``W[n, k] = scale[g[k], n] * q[k, n] +
    mins[g[k], n]`` (``zero`` ignored).

    Attributes:
        q: int32 ``[K, N]`` in ``[0, 2^bits)`` (may be a transposed view).
        zero: int32 ``[G, N]`` integer zero points (``2^(bits-1)`` for symmetric grids).
        g_idx: int64 ``[K]`` group of every input row, or None for contiguous groups
            (``g[k] = k // group_size``).
        group_size: the real, positive group width. bits: 4 or 8 (2 for GPTQ).
        mins: float ``[G, N]`` per-group minimum added after the scaling, or None.
    """

    q: torch.Tensor
    zero: torch.Tensor
    g_idx: torch.Tensor | None
    group_size: int
    bits: int
    mins: torch.Tensor | None = None


def dequantize_int_weight(iw: IntWeight, scales: torch.Tensor) -> torch.Tensor:
    """``W [N, K]`` in ``scales.dtype`` from an :class:`IntWeight` and ``scales [G, N]``.

    ``q - zero`` is formed as an integer, multiplied by the scale in float32 (exact for
    |q - z| < 2^8 and fp16 scales) and rounded once to the scale dtype (§3.5/§4.3). With
    ``iw.mins``: ``scale * q`` rounded to the scale dtype, then ``+ mins`` rounded again
    (gguf-py's and ggml's order of operations, so float32 scales and mins give their
    dequantized weights bit for bit).

    Returns:
        a transposed view of a contiguous ``[K, N]`` tensor, so ``x @ W.t()`` reads it in
        place.
    """
    k, n = iw.q.shape
    gs = iw.group_size
    if iw.g_idx is None and k % gs == 0:  # contiguous groups: broadcast, no gather
        g = k // gs
        if iw.mins is not None:
            w = _scale_mul(iw.q.reshape(g, gs, n), scales.reshape(g, 1, n))
            return (w + iw.mins.reshape(g, 1, n).to(w.dtype)).reshape(k, n).t()
        qz = iw.q.reshape(g, gs, n) - iw.zero.reshape(g, 1, n)
        return _scale_mul(qz, scales.reshape(g, 1, n)).reshape(k, n).t()
    gi = default_g_idx(k, gs, iw.q.device) if iw.g_idx is None else iw.g_idx
    if iw.mins is not None:
        w = _scale_mul(iw.q, scales[gi])
        return (w + iw.mins[gi].to(w.dtype)).t()
    return _scale_mul(iw.q - iw.zero[gi], scales[gi]).t()


def gptq_int_weight(qweight: torch.Tensor, qzeros: torch.Tensor, g_idx: torch.Tensor | None,
                    bits: int, group_size: int, zero_offset: int, sym: bool,
                    mins: torch.Tensor | None = None) -> IntWeight:
    """The integers of a GPTQ weight (§3.2-3.4); arguments as :func:`dequantize_gptq`
    (``mins``: the float-minimum variant, :class:`IntWeight`)."""
    q = unpack_rows(qweight, bits)  # [K, N]
    n = q.shape[1]
    if sym:
        z = torch.full((qzeros.shape[0], n), 1 << (bits - 1), dtype=torch.int32,
                       device=q.device)
    else:
        z = (unpack_cols(qzeros, bits)[:, :n] + zero_offset) & ((1 << bits) - 1)
    gi = None if g_idx is None else g_idx.to(torch.int64)
    return IntWeight(q, z, gi, q.shape[0] if group_size == -1 else group_size, bits, mins)


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor | None, bits: int, group_size: int,
                    zero_offset: int, sym: bool,
                    mins: torch.Tensor | None = None) -> torch.Tensor:
    """GPTQ dequantization (§3.5).

    Args:
        qweight: int32 ``[K*bits/32, N]``, packed along K.
        qzeros: int32 ``[G, N*bits/32]``, packed along N (sequential fields).
        scales: ``[G, N]`` (fp16 in published checkpoints).
        g_idx: int ``[K]`` group of every input row; ``None`` -> ``k // group_size``.
        bits: 2, 4 or 8. group_size: -1 (one group) or a positive width.
        zero_offset: 1 for v1 ``"gptq"`` (field stores ``z - 1``), 0 for ``"gptq_v2"``.
        sym: True -> ``z = 2^(bits-1)`` for every group, ``qzeros`` ignored (§3.3).
        mins: ``[G, N]`` float per-group minimum (GGUF's ``y = d * q + m``), or None.

    Returns:
        ``W [N, K]`` in ``scales.dtype``: ``W[n, k] = scales[g, n] * (q[k, n] - z[g, n])``
        (``scales[g, n] * q[k, n] + mins[g, n]`` with ``mins``).
    """
    return dequantize_int_weight(
        gptq_int_weight(qweight, qzeros, g_idx, bits, group_size, zero_offset, sym, mins),
        scales)


def awq_int_weight(qweight: torch.Tensor, qzeros: torch.Tensor, group_size: int) -> IntWeight:
    """The integers of an AWQ GEMM 4-bit weight (§4.2); arguments as :func:`dequantize_awq`."""
    q = unpack_cols(qweight, 4, AWQ_ORDER)  # [K, N]
    z = unpack_cols(qzeros, 4, AWQ_ORDER)  # [G, N]
    return IntWeight(q, z, None, q.shape[0] if group_size == -1 else group_size, 4)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int) -> torch.Tensor:
    """AWQ GEMM dequantization (§4.2-4.3), 4-bit only.

    Args:
        qweight: int32 ``[K, N/8]`` (interleaved order 0,2,4,6,1,3,5,7).
        qzeros: int32 ``[G, N/8]``, same interleave. scales: ``[G, N]``.
        group_size: -1 (= K) or a divisor of K.

    Returns:
        ``W [N, K]`` in ``scales.dtype``.
    """
    return dequantize_int_weight(awq_int_weight(qweight, qzeros, group_size), scales)


def compressed_int_weight(weight_packed: torch.Tensor, weight_zero_point: torch.Tensor | None,
                          weight_g_idx: torch.Tensor | None, bits: int, group_size: int,
                          num_groups: int) -> IntWeight:
    """The integers of a compressed-tensors ``pack-quantized`` weight (§6.2); ``q`` and
    ``zero`` are transposed views of the ``[N, ...]`` tensors."""
    u = unpack_cols(weight_packed, bits)  # [N, K]
    n, k = u.shape
    if weight_zero_point is None:
        uz = torch.full((n, num_groups), 1 << (bits - 1), dtype=torch.int32, device=u.device)
    else:  # unpack along N: rows of the packed tensor hold pf output channels each
        uz = unpack_rows(weight_zero_point, bits)[:n]
    gi = None if weight_g_idx is None else weight_g_idx.to(torch.int64)
    return IntWeight(u.t(), uz.t(), gi, k if group_size == -1 else group_size, bits)


def dequantize_int8_channel(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors ``int-quantized`` weight: int8 ``[N, K]`` x scale ``[N, 1]`` -> ``[N, K]``
    in ``weight_scale.dtype`` (§6.2)."""
    return _scale_mul(weight.to(torch.int64), weight_scale.expand(weight.shape))


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric per-token int8 activation quantization (§6.2).

    Uses compressed-tensors' grid ``scale = amax(|x_row|) / 127.5`` (what the fixture's tool
    ran), ``q = clamp(round(x / scale), -128, 127)``.

    Args:
        x: ``[M, K]`` float.

    Returns:
        ``(q int8 [M, K], scale float32 [M, 1])``; an all-zero row gets scale 1.
    """
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True) / 127.5
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(xf / scale), -128, 127).to(torch.int8)
    return q, scale


def int8_w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8 reference: per-token int8 ``x`` times int8 ``weight [N, K]``, int32-exact
    accumulation (float64 GEMM of integers), rescaled by ``x_scale[m] * w_scale[n]``.

    Returns ``[M, N]`` in ``x.dtype``.
    """
    qx, sx = quantize_per_token_int8(x)
    acc = qx.to(torch.float64) @ weight.to(torch.float64).t()  # exact integer sums
    y = acc * sx.to(torch.float64) * weight_scale.to(torch.float64).view(1, -1)
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.to(x.dtype)
