"""Triton ``reshape_and_cache``: scatter new keys/values into the paged KV cache.

Layout (PagedAttention, Kwon et al., SOSP 2023; see :mod:`nybble.kernels.interface`):
``kv_cache [2, NB, BS, Hkv, D]``, token with flat slot ``s`` goes to ``kv_cache[:, s // BS, s % BS]``.
"""
from __future__ import annotations

import torch

from nybble.kernels._triton import check_device, next_power_of_2, tl, triton


@triton.jit
def _reshape_and_cache_kernel(
    # pointers
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    # sizes
    num_kv_heads, head_dim, block_size,
    # strides
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_ckv, stride_cb, stride_cs, stride_ch, stride_cd,
    # meta-parameters
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per new token: copy its ``[Hkv, D]`` key and value rows into its slot."""
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
    tl.store(cache_ptr + c_offs, tl.load(k_ptrs, mask=mask_hd), mask=mask_hd)
    tl.store(cache_ptr + stride_ckv + c_offs, tl.load(v_ptrs, mask=mask_hd), mask=mask_hd)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write each new token's key/value into its paged-cache slot (in place).

    Args:
        key, value: ``[T, Hkv, D]``, same dtype and device as ``kv_cache`` (any strides).
        kv_cache: ``[2, NB, BS, Hkv, D]``.
        slot_mapping: ``[T]`` int64 (or int32) flat slot per token; ``-1`` skips the token.

    Raises:
        ValueError: shape, dtype or device mismatch.
    """
    if key.shape != value.shape or key.dim() != 3:
        raise ValueError(f"key and value must both be [T, Hkv, D], got {tuple(key.shape)} "
                         f"and {tuple(value.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != key.shape[1:]:
        raise ValueError(f"kv_cache must be [2, NB, BS, {key.shape[1]}, {key.shape[2]}], "
                         f"got {tuple(kv_cache.shape)}")
    if key.dtype != kv_cache.dtype or value.dtype != kv_cache.dtype:
        raise ValueError(f"key/value dtype must be the cache's {kv_cache.dtype}, got {key.dtype}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    check_device(key, value, kv_cache, slot_mapping)
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping,
        num_kv_heads, head_dim, kv_cache.shape[2],
        *key.stride(), *value.stride(), *kv_cache.stride(),
        BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_dim),
    )
