"""Fused mixture-of-experts: the experts' two GEMMs as grouped GEMMs over the token list
sorted by expert, no per-token loop and no per-expert launch.

Host side (:func:`align_blocks`, torch ops, no host sync): the ``T * top_k`` (token, slot)
pairs are sorted by expert and each expert's run is padded to a multiple of ``BLOCK_M``, so
that every ``BLOCK_M`` rows of the sorted list belong to one expert; a block's expert id is
looked up by the kernel (-1 past the last used block: the program exits). The grid is an upper
bound, ``ceil(T * top_k / BLOCK_M) + E`` row blocks by ``ceil(N / BLOCK_N)`` column blocks.

Kernel (:func:`_moe_gemm_kernel`): program ``(m, n)`` gathers its ``BLOCK_M`` rows of ``A``
(``x`` rows ``pair // top_k`` for the gate/up GEMM, the activation rows ``pair`` for the down
GEMM), multiplies them by its expert's ``[N, K]`` weight tile by tile with fp32 accumulation,
optionally scales each row by its routing weight, and scatters the rows back to their pair
index. :func:`fused_experts` runs gate/up, the SwiGLU activation (torch), down with the
routing weights, and sums each token's ``top_k`` rows.

The torch reference is :func:`nybble.kernels.reference.moe.fused_experts` (the tests' oracle);
the layout and grouping follow the Triton tutorials' blocked GEMM, with the row gather of a
grouped GEMM over variable-size groups (each expert's token run is one group).
"""
from __future__ import annotations

import torch

from nybble.kernels.reference.moe import gated
from nybble.kernels.triton.common import (cdiv, check_device, dot, tl, tl_dtype_precision,
                                          triton, upcast_dot)


def block_m_for(pairs: int, num_experts: int) -> int:
    """Rows per block: 16 when experts see few tokens each (decode), else 64."""
    return 16 if pairs <= 16 * num_experts else 64


def align_blocks(expert_ids: torch.Tensor, num_experts: int, block_m: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sorted, per-expert padded pair list and each row block's expert.

    Args:
        expert_ids: ``[T, top_k]`` int in ``[0, num_experts)``.
        block_m: rows per block.

    Returns:
        ``(sorted_pairs [num_blocks * block_m] int32, block_expert [num_blocks] int32)`` with
        ``num_blocks = ceil(T * top_k / block_m) + num_experts``: the flat pair indices
        ``t * top_k + slot`` expert by expert (tokens ascending), each expert's run starting
        on a block boundary, padding entries ``T * top_k``; ``block_expert`` is -1 for the
        blocks past the last expert's run.
    """
    flat = expert_ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    # NOTE: scatter_add, not bincount: bincount on CUDA reads the maximum back to the host,
    # which a CUDA-graph capture of the decode step forbids
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    run_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(pairs, device=flat.device) - run_start[expert_of]
    position = (padded_end - padded)[expert_of] + rank
    num_blocks = cdiv(pairs, block_m) + num_experts
    sorted_pairs = torch.full((num_blocks * block_m,), pairs, dtype=torch.int32,
                              device=flat.device)
    sorted_pairs[position] = order.to(torch.int32)
    block_start = torch.arange(num_blocks, device=flat.device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert >= num_experts, -1, block_expert)
    return sorted_pairs, block_expert.to(torch.int32)


@triton.jit
def _moe_gemm_kernel(a_ptr, b_ptr, c_ptr, w_ptr, pairs_ptr, block_expert_ptr,
                     num_pairs, N, K,
                     stride_am, stride_ak, stride_be, stride_bn, stride_bk,
                     stride_cm, stride_cn,
                     A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """``C[pair, n] = (w[pair] *) sum_k A[pair // A_ROW_DIV, k] * B[e, n, k]`` for the
    ``BLOCK_M`` pairs of row block ``program_id(0)`` (all of expert ``e``)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m)
    valid = pairs < num_pairs
    rows = pairs // A_ROW_DIV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    b_base = b_ptr + expert.to(tl.int64) * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak,
                    mask=valid[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_base + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc += dot(a, b, DOT_PRECISION, UPCAST_DOT)
    if MUL_WEIGHT:
        acc = acc * tl.load(w_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(c_ptr + pairs[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                  weights: torch.Tensor | None, sorted_pairs: torch.Tensor,
                  block_expert: torch.Tensor, a_row_div: int, block_m: int) -> None:
    """``out[pair] = (weights[pair] *) a[pair // a_row_div] @ b[expert(pair)].T`` for every
    pair of ``sorted_pairs`` (``b: [E, N, K]``, ``out: [pairs, N]``)."""
    n, k = b.shape[1], b.shape[2]
    block_n = 64 if n >= 64 else 32
    block_k = 32
    grid = (block_expert.shape[0], cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a, b, out, weights if weights is not None else out, sorted_pairs, block_expert,
        out.shape[0], n, k, *a.stride(), *b.stride(), *out.stride(),
        A_ROW_DIV=a_row_div, MUL_WEIGHT=weights is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=tl_dtype_precision(a.dtype), UPCAST_DOT=upcast_dot(a.dtype))


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  expert_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """The MoE layer's expert part on the GPU (or under ``TRITON_INTERPRET=1``).

    Args:
        x: ``[T, H]`` float16/bfloat16/float32. w13: ``[E, 2I, H]`` (gate rows, then up rows),
            ``x.dtype``. w2: ``[E, H, I]``, ``x.dtype``.
        weights: ``[T, top_k]`` routing weights (any float dtype; used in float32).
        expert_ids: ``[T, top_k]`` int in ``[0, E)``. activation: ``silu``.

    Returns:
        ``[T, H]`` in ``x.dtype``: per token, the sum of its experts' outputs times their
        weights (fp32 accumulation, the ``top_k`` rows summed in fp32).

    Raises:
        ValueError: shapes or dtypes that do not agree, an unknown activation, or a device
            Triton cannot run on.
    """
    num_experts, two_inter, hidden = w13.shape
    tokens = x.shape[0]
    if (x.dim() != 2 or x.shape[1] != hidden or two_inter % 2
            or w2.shape != (num_experts, hidden, two_inter // 2)):
        raise ValueError(f"x [T, H], w13 [E, 2I, H] and w2 [E, H, I] must agree, got "
                         f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    if weights.shape != expert_ids.shape or expert_ids.shape[0] != tokens:
        raise ValueError(f"weights and expert_ids must both be [{tokens}, top_k], got "
                         f"{tuple(weights.shape)} and {tuple(expert_ids.shape)}")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"w13 and w2 must have x's dtype {x.dtype}, got {w13.dtype}, "
                         f"{w2.dtype}")
    check_device(x, w13, w2, weights, expert_ids)
    top_k = expert_ids.shape[1]
    pairs = tokens * top_k
    if pairs == 0:
        return torch.zeros_like(x)
    block_m = block_m_for(pairs, num_experts)
    sorted_pairs, block_expert = align_blocks(expert_ids, num_experts, block_m)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    gate_up = torch.empty(pairs, two_inter, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, None, sorted_pairs, block_expert, top_k, block_m)
    act = gated(gate_up, activation)
    down = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    flat_weights = weights.reshape(-1).to(torch.float32).contiguous()
    _grouped_gemm(act, w2, down, flat_weights, sorted_pairs, block_expert, 1, block_m)
    return down.view(tokens, top_k, hidden).sum(1).to(x.dtype)
