"""Quantized KV cache: one byte per element, one float32 scale per (K or V, KV head).

A cache of dtype ``torch.int8`` or ``torch.float8_e4m3fn`` stores ``q = quant(x / s)`` and is
read as ``x ~ float(q) * s``, with ``s = kv_scale[0, h]`` for keys and ``kv_scale[1, h]`` for
values of KV head ``h`` (``kv_scale: [2, Hkv]`` float32, one tensor per layer). Per-head
static scales, as vLLM's per-tensor ``k_scale``/``v_scale`` refined to one per head: heads
differ in range by several times, and a static scale keeps the cache layout, the kernels and
prefix caching unchanged (the bytes of a block do not depend on which batch wrote it).
See docs/kv-cache.md for how the scales are calibrated. Keys are cached before RoPE,
centred and equalised per channel (:class:`KeySmoothing`), and the attention kernels shift and
rotate them as they read (:class:`RotaryKeys`).

- ``int8``: symmetric, ``q = clamp(floor(x / s + 0.5), -127, 127)`` (``-128`` unused, so the
  grid is symmetric); the Triton kernel rounds the same way, so the two write equal bytes.
- ``fp8_e4m3``: ``q = float8_e4m3fn(clamp(x / s, -448, 448))`` (OCP FP8 E4M3, round to nearest
  even; saturating, since an out-of-range cast would be NaN).

Every function here is the pure-torch reference the Triton kernels are tested against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
"""Largest magnitude each quantized cache dtype stores (scaled units)."""


def is_quantized_cache(kv_cache: torch.Tensor) -> bool:
    """Whether ``kv_cache`` holds quantized values (``int8`` / ``float8_e4m3fn``)."""
    return kv_cache.dtype in QMAX


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x [T, Hkv, D]`` (any float dtype) with per-head ``scale [Hkv]`` float32 -> ``dtype``.

    Raises:
        ValueError: ``dtype`` is not a quantized cache dtype.
    """
    if dtype not in QMAX:
        raise ValueError(f"quantized KV dtype must be int8 or float8_e4m3fn, got {dtype}")
    y = x.float() / scale.view(1, -1, 1)
    qmax = QMAX[dtype]
    if dtype == torch.int8:
        return torch.floor(y + 0.5).clamp_(-qmax, qmax).to(torch.int8)
    return y.clamp_(-qmax, qmax).to(dtype)


def as_bytes(kv_cache: torch.Tensor) -> torch.Tensor:
    """``kv_cache`` viewed as ``int8`` when it is one byte per element (CPU indexing ops such
    as ``index_copy_`` / ``index_select`` do not take float8), else itself."""
    return kv_cache.view(torch.int8) if kv_cache.dtype == torch.float8_e4m3fn else kv_cache


class KeySmoothing:
    """A static per-channel change of variables on keys and queries ahead of a quantized cache.

    Keys are stored as ``k' = (k - shift) * inv_factor`` and queries are read as
    ``q' = q * factor`` (per KV head and head dimension), so that
    ``q' . k' = q . k - q . shift``: the product of query and key changes only by a term that
    is the same for every key a query sees, which softmax removes exactly. Two things follow:

    - ``factor`` moves each channel's range onto the head's quantization grid (the scale
      migration of SmoothQuant, Xiao et al. 2023, applied between queries and keys as in
      QServe's SmoothAttention, Lin et al. 2024): a key channel that spans a tenth of the
      widest one still gets the whole int8 grid.
    - ``shift`` centres each channel's range on zero. Post-RoPE keys of small models carry
      large per-channel offsets (up to 0.77 of a channel's absmax on the bundled model), and
      both int8 (absolute error) and fp8 (relative error) lose less on a centred value.

    The shift is only exact where nothing but a softmax follows the scores: a soft-capped
    layer (Gemma 2) must use a zero shift. Values are untouched (their per-head scale suffices:
    docs/kv-cache.md). Static like the per-head scales, so a block's bytes never depend on
    the batch that wrote it.

    Args:
        shift: ``[Hkv, D]`` float32, subtracted from every key.
        factor: ``[Hkv, D]`` float32 in ``(0, 1]``, the keys' per-channel range relative to
            the head's widest channel.
        group: query heads per KV head (``Hq / Hkv``; query head ``i`` reads KV head
            ``i // group``).

    Raises:
        ValueError: shapes that differ, or a factor outside ``(0, 1]``.
    """

    def __init__(self, shift: torch.Tensor, factor: torch.Tensor, group: int) -> None:
        if shift.shape != factor.shape or shift.dim() != 2:
            raise ValueError(f"shift and factor must both be [Hkv, D], got {tuple(shift.shape)} "
                             f"and {tuple(factor.shape)}")
        if not bool(((factor > 0) & (factor <= 1)).all()):
            raise ValueError("factor must lie in (0, 1]")
        self.shift = shift.float().contiguous()
        self.factor = factor.float().contiguous()
        self.inv_factor = (1.0 / self.factor).contiguous()
        self.q_factor = self.factor.repeat_interleave(group, dim=0).contiguous()

    def keys(self, key: torch.Tensor) -> torch.Tensor:
        """``key [T, Hkv, D]`` -> the keys to store, same shape and dtype (computed in
        float32, float64 for float64 keys)."""
        if key.dtype == torch.float64:
            return (key - self.shift.double()) * self.inv_factor.double()
        return ((key.float() - self.shift) * self.inv_factor).to(key.dtype)

    def queries(self, query: torch.Tensor) -> torch.Tensor:
        """``query [T, Hq, D]`` -> the queries that read the stored keys, same shape and
        dtype."""
        if query.dtype == torch.float64:
            return query * self.q_factor.double()
        return (query.float() * self.q_factor).to(query.dtype)


@dataclass(frozen=True, slots=True)
class RotaryKeys:
    """Keys cached before RoPE: what a layer whose quantized cache holds pre-RoPE keys gives
    its attention kernels (pre-RoPE key quantization, KVQuant, Hooper et al. 2024).

    The cache holds each key before its rotation, centred and equalised per channel
    (:class:`KeySmoothing`, calibrated before RoPE). An attention kernel reads the key of KV
    head ``h`` at sequence position ``j`` (token ``j`` of its sequence: nybble's positions are
    the token indices) as

    ``x = float(code) * kv_scale[0, h] + zero[h]``, then
    ``k = x * cos_sin[j, 0] + roll(x, D / 2) * cos_sin[j, 1]``

    where ``roll(x, D / 2)[d] = x[(d + D / 2) % D]``: the layer's own rotate-half RoPE
    (:class:`nybble.models.layers.RotaryEmbedding`, full width), applied as the key is read.
    Why: RoPE turns a key channel's fixed offset into one that turns with the position, which
    no static per-channel shift removes after the rotation; before it the offset is fixed and
    ``zero`` removes it exactly (docs/kv-cache.md).

    Attributes:
        zero: ``[Hkv, D]`` float32, added to every dequantized key of head ``h``.
        cos_sin: ``[P, 2, D]`` float32, the rotary table (row ``j``: cos and sin of position
            ``j``, ``cos = [c, c]``, ``sin = [-s, s]``); ``P`` covers every cached position.
    """

    zero: torch.Tensor
    cos_sin: torch.Tensor

    def rotate(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Dequantized pre-RoPE keys ``keys [..., N, Hkv, D]`` (float) at ``positions [N]``
        (int64) -> the keys attention uses, same shape, float32 (float64 for float64 keys)."""
        acc = torch.float64 if keys.dtype == torch.float64 else torch.float32
        x = keys.to(acc) + self.zero.to(acc)
        rows = self.cos_sin.index_select(0, positions.clamp(0, self.cos_sin.shape[0] - 1))
        cos, sin = rows[:, 0].to(acc).unsqueeze(-2), rows[:, 1].to(acc).unsqueeze(-2)
        return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * sin
