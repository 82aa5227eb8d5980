"""GGUF block types -> nybble's integer weights, without a float detour.

Block layouts: ggml's ``ggml-common.h`` (``block_q4_0`` ... ``block_q6_K``) and the
``dequantize_row_*`` functions of ``ggml-quants.c``. Every block runs along the input
features; one row of a GGUF weight (an output feature) is a whole number of blocks. Each
type maps exactly onto nybble's integer form (:class:`~nybble.kernels.reference.quant.IntWeight`)
with float32 group scales:

========  ==================================  ====  =====  =====================
type      ggml dequantization                 bits  group  nybble form
========  ==================================  ====  =====  =====================
Q4_0      ``d * (q - 8)``                     4     32     zero 8
Q4_1      ``d * q + m``                       4     32     float minimum ``m``
Q4_K      ``(d*sc_j) * q - (dmin*m_j)``       4     32     minimum ``-(dmin*m_j)``
Q5_0      ``d * (q - 16)``                    8     32     zero 16 (5-bit values)
Q5_1      ``d * q + m``                       8     32     float minimum
Q5_K      ``(d*sc_j) * q - (dmin*m_j)``       8     32     float minimum
Q6_K      ``(d*sc_j) * (q - 32)``             8     16     zero 32 (6-bit values)
Q8_0      ``d * q`` (``q`` int8)              8     32     ``q + 128``, zero 128
========  ==================================  ====  =====  =====================

``d``, ``dmin`` (float16) times the 6/8-bit sub-scales is exact in float32, so the scales and
minimums hold gguf-py's float32 intermediates exactly and
:func:`~nybble.kernels.reference.quant.dequantize_int_weight` reproduces
``gguf.quants.dequantize`` bit for bit (tested per type).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_QUANT_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")
"""GGUF block types loaded as integers."""
DENSE_TYPES = ("F32", "F16", "BF16")
"""GGUF float types loaded as dense weights."""


@dataclass(frozen=True)
class GGUFInts:
    """One GGUF weight as integers, rows first (``[N, K]``; transpose for ``IntWeight``).

    Attributes:
        q: int32 ``[N, K]`` in ``[0, 2^bits)``. scales: float32 ``[N, G]``.
        mins: float32 ``[N, G]`` (``W = s * q + m``) or None (``W = s * (q - zero)``).
        zero: the fixed zero point (ignored with ``mins``). bits: 4 or 8. group_size: 16 or 32.
    """

    q: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    zero: int
    bits: int
    group_size: int


_BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
          "Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 from the last axis' 2 bytes -> float32 ``[...]``."""
    return b.contiguous().view(torch.float16)[..., 0].to(torch.float32)


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """``[..., 16]`` bytes -> ``[..., 32]``: low nibbles are elements 0-15, high 16-31."""
    return torch.cat((qs & 0xF, qs >> 4), dim=-1)


def _qh_bits(qh: torch.Tensor) -> torch.Tensor:
    """``[..., 4]`` bytes of a little-endian uint32 -> bit ``i`` of it, ``[..., 32]``."""
    shifts = torch.arange(8, dtype=torch.int32)
    bits = (qh.unsqueeze(-1) >> shifts) & 1          # [..., 4 bytes, 8]
    return bits.reshape(*qh.shape[:-1], 32)


def _scale_min_k4(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins packed in 12 bytes (ggml's ``get_scale_min_k4``)."""
    s = sc.to(torch.int32)
    lo, hi = s[..., :4], s[..., 4:8]
    tail = s[..., 8:12]
    scales = torch.cat((lo & 63, (tail & 0xF) | ((lo >> 6) << 4)), dim=-1)
    mins = torch.cat((hi & 63, (tail >> 4) | ((hi >> 6) << 4)), dim=-1)
    return scales, mins


def unpack_blocks(type_name: str, raw: torch.Tensor, k: int) -> GGUFInts:
    """Unpack a GGUF weight's blocks.

    Args:
        type_name: one of :data:`SUPPORTED_QUANT_TYPES`.
        raw: uint8 ``[N, K / block * block_bytes]`` (gguf-py's view of the tensor data).
        k: input features (``ne0``).

    Raises:
        ValueError: an unsupported type, or a row length that does not match ``k``.
    """
    if type_name not in _BLOCK:
        raise ValueError(f"GGUF type must be one of {', '.join(SUPPORTED_QUANT_TYPES)}, got "
                         f"{type_name}")
    per, size = _BLOCK[type_name]
    n = raw.shape[0]
    if k % per or raw.shape[1] != k // per * size:
        raise ValueError(f"{type_name} rows of {k} features must be {k // per * size} bytes "
                         f"({per}-element blocks of {size} bytes), got {raw.shape[1]}")
    b = raw.reshape(n, k // per, size).to(torch.int32)
    r8 = raw.reshape(n, k // per, size)
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        d = _f16(r8[..., 0:2])
        mins = _f16(r8[..., 2:4]) if type_name in ("Q4_1", "Q5_1") else None
        if type_name == "Q8_0":
            q = b[..., 2:34] ^ 0x80        # int8 bit pattern -> q + 128 in [0, 256)
            return _out(q, d, None, 128, 8, 32, n, k)
        if type_name == "Q4_0":
            return _out(_nibbles32(b[..., 2:18]), d, None, 8, 4, 32, n, k)
        if type_name == "Q4_1":
            return _out(_nibbles32(b[..., 4:20]), d, mins, 0, 4, 32, n, k)
        off = 2 if type_name == "Q5_0" else 4
        q = _nibbles32(b[..., off + 4:off + 20]) | (_qh_bits(b[..., off:off + 4]) << 4)
        return _out(q, d, mins, 16 if mins is None else 0, 8, 32, n, k)
    if type_name == "Q6_K":
        ql, qh = b[..., 0:128], b[..., 128:192]
        sc = r8[..., 192:208].contiguous().view(torch.int8).to(torch.float32)   # [N, B, 16]
        d = _f16(r8[..., 208:210])
        halves = []
        for h in range(2):
            lq, hq = ql[..., 64 * h:64 * h + 64], qh[..., 32 * h:32 * h + 32]
            halves += [(lq[..., :32] & 0xF) | (((hq >> 0) & 3) << 4),
                       (lq[..., 32:] & 0xF) | (((hq >> 2) & 3) << 4),
                       (lq[..., :32] >> 4) | (((hq >> 4) & 3) << 4),
                       (lq[..., 32:] >> 4) | (((hq >> 6) & 3) << 4)]
        q = torch.cat(halves, dim=-1)                                         # [N, B, 256]
        return _out(q, (d.unsqueeze(-1) * sc), None, 32, 8, 16, n, k)
    # Q4_K / Q5_K
    d, dmin = _f16(r8[..., 0:2]), _f16(r8[..., 2:4])
    sc, mn = _scale_min_k4(b[..., 4:16])
    scales = d.unsqueeze(-1) * sc.to(torch.float32)                           # [N, B, 8]
    mins = -(dmin.unsqueeze(-1) * mn.to(torch.float32))
    if type_name == "Q4_K":
        qs = b[..., 16:144]
        q = torch.cat([torch.cat((qs[..., 32 * i:32 * i + 32] & 0xF,
                                  qs[..., 32 * i:32 * i + 32] >> 4), -1) for i in range(4)], -1)
        return _out(q, scales, mins, 0, 4, 32, n, k)
    qh, qs = b[..., 16:48], b[..., 48:176]
    parts = []
    for i in range(4):
        chunk = qs[..., 32 * i:32 * i + 32]
        parts += [(chunk & 0xF) | (((qh >> (2 * i)) & 1) << 4),
                  (chunk >> 4) | (((qh >> (2 * i + 1)) & 1) << 4)]
    return _out(torch.cat(parts, -1), scales, mins, 0, 8, 32, n, k)


def _out(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, zero: int,
         bits: int, gs: int, n: int, k: int) -> GGUFInts:
    return GGUFInts(q.reshape(n, k).to(torch.int32), scales.reshape(n, k // gs).contiguous(),
                    None if mins is None else mins.reshape(n, k // gs).contiguous(),
                    zero, bits, gs)
