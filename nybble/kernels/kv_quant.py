"""Quantized KV cache: one byte per element, one float32 scale per (K or V, KV head).

A cache of dtype ``torch.int8`` or ``torch.float8_e4m3fn`` stores ``q = quant(x / s)`` and is
read as ``x ~ float(q) * s``, with ``s = kv_scale[0, h]`` for keys and ``kv_scale[1, h]`` for
values of KV head ``h`` (``kv_scale: [2, Hkv]`` float32, one tensor per layer). Per-head
static scales, as vLLM's per-tensor ``k_scale``/``v_scale`` refined to one per head: heads
differ in range by several times, and a static scale keeps the cache layout, the kernels and
prefix caching unchanged (the bytes of a block do not depend on which batch wrote it).
See docs/kv-cache.md for how the scales are calibrated.

- ``int8``: symmetric, ``q = clamp(floor(x / s + 0.5), -127, 127)`` (``-128`` unused, so the
  grid is symmetric); the Triton kernel rounds the same way, so the two write equal bytes.
- ``fp8_e4m3``: ``q = float8_e4m3fn(clamp(x / s, -448, 448))`` (OCP FP8 E4M3, round to nearest
  even; saturating, since an out-of-range cast would be NaN).

Every function here is the pure-torch reference the Triton kernels are tested against.
"""
from __future__ import annotations

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
