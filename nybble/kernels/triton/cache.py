"""Triton ``reshape_and_cache``: scatter new keys/values into the paged KV cache.

Layout (PagedAttention, Kwon et al., SOSP 2023; see :mod:`nybble.kernels.interface`):
``kv_cache [2, NB, BS, Hkv, D]``, token with flat slot ``s`` goes to ``kv_cache[:, s // BS, s % BS]``.
An ``int8`` / ``float8_e4m3fn`` cache stores the values quantized with per-head scales, exactly
as :func:`nybble.kernels.kv_quant.quantize_kv` does.
"""
from __future__ import annotations

import torch

from nybble.kernels.triton.common import check_device, next_power_of_2, tl, triton
from nybble.kernels.kv_quant import QMAX, is_quantized_cache

QUANT_NONE, QUANT_INT8, QUANT_FP8 = 0, 1, 2
"""``QUANT`` of the kernels: how the cache stores values (float, int8, fp8 e4m3)."""


def quant_mode(kv_cache: torch.Tensor) -> int:
    """The kernels' ``QUANT`` constant for a cache of ``kv_cache``'s dtype."""
    return {torch.int8: QUANT_INT8, torch.float8_e4m3fn: QUANT_FP8}.get(kv_cache.dtype,
                                                                          QUANT_NONE)


def scale_arg(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> torch.Tensor:
    """The ``scale_ptr`` argument: ``kv_scale`` ``[2, Hkv]`` float32, contiguous (checked) for
    a quantized cache; for a float cache the cache itself (never read: ``QUANT`` is 0).

    Raises:
        ValueError: a quantized cache without a ``[2, Hkv]`` float32 ``kv_scale``.
    """
    if not is_quantized_cache(kv_cache):
        return kv_cache
    want = (2, kv_cache.shape[3])
    if kv_scale is None or tuple(kv_scale.shape) != want or kv_scale.dtype != torch.float32:
        got = None if kv_scale is None else (tuple(kv_scale.shape), kv_scale.dtype)
        raise ValueError(f"kv_scale must be a {list(want)} float32 tensor for a "
                         f"{kv_cache.dtype} KV cache, got {got}")
    return kv_scale.contiguous()


@triton.jit
def _round_to_e4m3(x):
    """fp32 ``x`` (``|x| <= 448``) rounded to the nearest float8 e4m3 value, ties to even, in
    fp32 arithmetic: the cast that follows is then exact. NOTE: written out because the Triton
    interpreter's fp32 -> fp8 cast does not carry a rounded-up mantissa into the exponent
    (7.94 -> 4.0); on a GPU the result equals the hardware's round-to-nearest-even cast."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    # e4m3 keeps 3 mantissa bits; below 2^-6 the grid is the subnormal step 2^-9
    step_exp = tl.maximum(exponent, -6) - 3
    step = ((step_exp + 127) << 23).to(tl.float32, bitcast=True)
    t = x / step
    r = tl.floor(t + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    r = tl.where(((r - t) == 0.5) & odd, r - 1.0, r)
    return r * step


@triton.jit
def _reshape_and_cache_kernel(
    # pointers
    key_ptr, value_ptr, cache_ptr, slot_ptr, scale_ptr,
    # sizes
    num_kv_heads, head_dim, block_size, qmax,
    # strides
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_ckv, stride_cb, stride_cs, stride_ch, stride_cd,
    # meta-parameters
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr,
):
    """One program per new token: copy its ``[Hkv, D]`` key and value rows into its slot
    (quantized with ``scale_ptr [2, Hkv]`` when ``QUANT`` is not 0)."""
    pid_t = tl.program_id(0)
    slot = tl.load(slot_ptr + pid_t)
    if slot < 0:  # NOTE: -1 marks tokens whose KV must not be written (padding)
        return
    block_id = slot // block_size
    block_off = slot % block_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_hd = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)

    k_ptrs = key_ptr + pid_t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd
    v_ptrs = value_ptr + pid_t * stride_vt + offs_h[:, None] * stride_vh \
        + offs_d[None, :] * stride_vd
    c_offs = block_id.to(tl.int64) * stride_cb + block_off * stride_cs \
        + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd
    k = tl.load(k_ptrs, mask=mask_hd, other=0.0)
    v = tl.load(v_ptrs, mask=mask_hd, other=0.0)
    if QUANT != 0:
        mask_h = offs_h < num_kv_heads
        k_scale = tl.load(scale_ptr + offs_h, mask=mask_h, other=1.0)
        v_scale = tl.load(scale_ptr + num_kv_heads + offs_h, mask=mask_h, other=1.0)
        k = k.to(tl.float32) / k_scale[:, None]
        v = v.to(tl.float32) / v_scale[:, None]
        k = tl.minimum(tl.maximum(k, -qmax), qmax)
        v = tl.minimum(tl.maximum(v, -qmax), qmax)
        if QUANT == 1:  # int8: round half up, as kv_quant.quantize_kv
            k = tl.floor(k + 0.5)
            v = tl.floor(v + 0.5)
        else:
            k = _round_to_e4m3(k)
            v = _round_to_e4m3(v)
    cache_ty = cache_ptr.dtype.element_ty
    tl.store(cache_ptr + c_offs, k.to(cache_ty), mask=mask_hd)
    tl.store(cache_ptr + stride_ckv + c_offs, v.to(cache_ty), mask=mask_hd)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
    """Write each new token's key/value into its paged-cache slot (in place).

    Args:
        key, value: ``[T, Hkv, D]``, same dtype and device as ``kv_cache`` (any strides); any
            float dtype for an ``int8`` / ``float8_e4m3fn`` cache.
        kv_cache: ``[2, NB, BS, Hkv, D]``.
        slot_mapping: ``[T]`` int64 (or int32) flat slot per token; ``-1`` skips the token.
        kv_scale: ``[2, Hkv]`` float32 per-head scales (keys, values) of a quantized cache.

    Raises:
        ValueError: shape, dtype or device mismatch, or a quantized cache without scales.
    """
    if key.shape != value.shape or key.dim() != 3:
        raise ValueError(f"key and value must both be [T, Hkv, D], got {tuple(key.shape)} "
                         f"and {tuple(value.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != key.shape[1:]:
        raise ValueError(f"kv_cache must be [2, NB, BS, {key.shape[1]}, {key.shape[2]}], "
                         f"got {tuple(kv_cache.shape)}")
    quant = quant_mode(kv_cache)
    if key.dtype != value.dtype or not key.dtype.is_floating_point:
        raise ValueError(f"key and value must be of one float dtype, got {key.dtype} and "
                         f"{value.dtype}")
    if not quant and key.dtype != kv_cache.dtype:
        # NOTE: a float cache of another dtype (--kv-cache-dtype bfloat16 under a float32
        # model): torch's cast rounds to nearest even, as the reference write does
        key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    scales = scale_arg(kv_cache, kv_scale)
    check_device(key, value, kv_cache, slot_mapping, scales)
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping, scales,
        num_kv_heads, head_dim, kv_cache.shape[2], QMAX.get(kv_cache.dtype, 0.0),
        *key.stride(), *value.stride(), *kv_cache.stride(),
        BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_dim),
        QUANT=quant,
    )
