"""Batched multi-LoRA in Triton: the CUDA path of :func:`nybble.kernels.lora.add_lora`.

Punica's BGMV scheme (Chen et al. 2023; S-LoRA, Sheng et al. 2023): each program takes one
token row and one tile of the output, reads that row's slot and multiplies by that slot's
weights only, so a mixed batch of many adapters is two launches, no gather of weights:

* *shrink* ``h[t, :R] = A_s x_t`` (``s = token_slots[t]``; fp32 sums, ``h`` kept in fp32),
  grid ``(T, ceil(R / BLOCK_R))``, looping over the inputs in ``BLOCK_K`` tiles;
* *expand* ``y[t, :N] += B_s h[t]`` in place, grid ``(T, ceil(N / BLOCK_N))``, looping over the
  rank in ``BLOCK_R`` tiles.

Rows with slot ``-1`` (the base model) are left untouched. ``lora_b`` may be any strided view
(:class:`nybble.models.lora.LoRASlots` keeps it as the transpose of an ``[S, R, N]`` tensor).
Runs on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1`` (the tests).
"""
from __future__ import annotations

import torch

from nybble.kernels.triton.common import cdiv, check_device, next_power_of_2, tl, triton


@triton.jit
def _shrink(x_ptr, a_ptr, slots_ptr, h_ptr, K, R, stride_xt, stride_as, stride_ar,
            stride_ak, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + t)
    valid = slot >= 0
    slot = tl.maximum(slot, 0)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + t * stride_xt + k, mask=k < K, other=0.0).to(tl.float32)
        av = tl.load(a_ptr + slot * stride_as + r[:, None] * stride_ar + k[None, :] * stride_ak,
                     mask=(r[:, None] < R) & (k[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(av * xv[None, :], axis=1)
    acc = tl.where(valid, acc, 0.0)
    tl.store(h_ptr + t * R + r, acc, mask=r < R)


@triton.jit
def _expand(h_ptr, b_ptr, slots_ptr, y_ptr, N, R, stride_bs, stride_bn, stride_br, stride_yt,
            BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    raw = tl.load(slots_ptr + t)
    slot = tl.maximum(raw, 0)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        hv = tl.load(h_ptr + t * R + r, mask=r < R, other=0.0)
        bv = tl.load(b_ptr + slot * stride_bs + n[:, None] * stride_bn + r[None, :] * stride_br,
                     mask=(n[:, None] < N) & (r[None, :] < R), other=0.0).to(tl.float32)
        acc += tl.sum(bv * hv[None, :], axis=1)
    mask = (n < N) & ((n * 0 + raw) >= 0)     # NOTE: the row's slot as a vector mask
    yv = tl.load(y_ptr + t * stride_yt + n, mask=mask, other=0.0)
    tl.store(y_ptr + t * stride_yt + n, (yv.to(tl.float32) + acc).to(yv.dtype), mask=mask)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             token_slots: torch.Tensor) -> torch.Tensor:
    """``y[t] += lora_b[s] @ lora_a[s] @ x[t]`` for every row ``t`` with ``s = token_slots[t]
    >= 0``, in place (shapes and meaning as :func:`nybble.kernels.lora.add_lora`; ``y``'s and
    ``x``'s rows contiguous).

    Raises:
        ValueError: tensors on different devices, or on CPU without ``TRITON_INTERPRET=1``.
    """
    check_device(y, x, lora_a, lora_b, token_slots)
    rows, width = x.shape
    _, rank, _ = lora_a.shape
    out = lora_b.shape[1]
    if rows == 0:
        return y
    x = x if x.stride(1) == 1 else x.contiguous()
    assert y.stride(1) == 1, "y's rows must be contiguous"
    slots = token_slots.to(torch.int64).contiguous()
    h = torch.empty(rows, rank, dtype=torch.float32, device=x.device)
    block_r = min(max(next_power_of_2(rank), 16), 64)
    _shrink[(rows, cdiv(rank, block_r))](
        x, lora_a, slots, h, width, rank, x.stride(0), lora_a.stride(0), lora_a.stride(1),
        lora_a.stride(2), BLOCK_R=block_r, BLOCK_K=64)
    _expand[(rows, cdiv(out, 64))](
        h, lora_b, slots, y, out, rank, lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        y.stride(0), BLOCK_N=64, BLOCK_R=block_r)
    return y
