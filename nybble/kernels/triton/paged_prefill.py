"""Varlen causal paged attention: prefill, chunked prefill and decode in one batch.

Algorithm: FlashAttention-2 (Dao, 2023) forward with online softmax, in its varlen causal form,
with K/V read through block tables (PagedAttention, Kwon et al., SOSP 2023). Sequence ``b``'s
``q_len`` new tokens are the last ``q_len`` of its ``seq_len`` tokens, so a chunk attends to
its whole cached prefix plus itself causally. As in the Triton fused-attention tutorial the
key range of a query tile is split into two constexpr stages: the prefix every row sees in
full (no causal mask) and the diagonal band (causal mask). Shapes follow
:mod:`nybble.kernels.interface`. A quantized cache that holds keys before RoPE
(:class:`~nybble.kernels.kv_quant.RotaryKeys`; pre-RoPE key quantization, KVQuant, Hooper et
al. 2024) has each key tile zero-shifted and rotated as it is read
(:func:`~nybble.kernels.triton.paged_decode.kv_tile`).
"""
from __future__ import annotations

import torch

from nybble.kernels.triton.common import (
    capped_log2_scores,
    cdiv,
    check_device,
    dot,
    is_interpreter,
    next_power_of_2,
    tl,
    tl_dtype_precision,
    triton,
    upcast_dot,
)
from nybble.kernels.interface import AttentionMetadata
from nybble.kernels.kv_quant import RotaryKeys
from nybble.kernels.triton.cache import quant_mode, scale_arg
from nybble.kernels.triton.paged_decode import key_zero, kv_tile, rotary_args


@triton.jit
def _attn_stage(acc, l_i, m_i, q, q_pos, cache_ptr, bt_row, lo, hi, kvh_off, scale,
                k_scale, v_scale, head_dim, block_size, window, softcap,
                stride_ckv, stride_cb, stride_cs, stride_cd, stride_btm,
                zero, zero_r, cs_ptr, num_pos, stride_csp, stride_csx, stride_csd,
                CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, QUANT: tl.constexpr,
                SOFTCAP: tl.constexpr, ROPE_KEYS: tl.constexpr):
    """Online-softmax update of one query tile over keys ``lo .. hi-1`` (log2-unit scores);
    a quantized cache (``QUANT`` != 0) is read as ``float(q) * k_scale`` / ``* v_scale``,
    its keys with ``ROPE_KEYS`` as pre-RoPE (zero points ``zero`` / ``zero_r`` and the table
    ``cs_ptr [num_pos, 2, D]``, :func:`~nybble.kernels.triton.paged_decode.kv_tile`);
    ``window`` > 0 hides keys at or before ``q_pos - window`` of each row."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    for kv_start in range(lo, hi, BLOCK_N):
        k_pos = kv_start + offs_n
        mask_n = k_pos < hi
        blk = tl.load(bt_row + (k_pos // block_size) * stride_btm, mask=mask_n, other=0)
        kv_offs = blk.to(tl.int64)[:, None] * stride_cb + (k_pos % block_size)[:, None] * stride_cs \
            + kvh_off + offs_d[None, :] * stride_cd
        mask_kv = mask_n[:, None] & mask_d[None, :]
        k, v = kv_tile(cache_ptr, kv_offs, mask_kv, stride_ckv, k_scale, v_scale, zero, zero_r,
                       cs_ptr, k_pos, offs_d, head_dim, num_pos, stride_cd, stride_csp,
                       stride_csx, stride_csd, QUANT, ROPE_KEYS)
        # NOTE: a no-op for a float cache of the query's dtype
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        qk = capped_log2_scores(dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT), scale, softcap,
                                SOFTCAP)  # [M, N]
        if CAUSAL:
            mask_s = mask_n[None, :] & (k_pos[None, :] <= q_pos[:, None])
        else:
            mask_s = mask_n[None, :]
        mask_s = mask_s & ((window <= 0) | (k_pos[None, :] > q_pos[:, None] - window))
        qk = tl.where(mask_s, qk, float("-inf"))
        # NOTE: with a window a row may see no key of a tile (max -inf): exponents are taken
        # against 0 then, so no -inf - -inf; the row's later tiles hold its visible keys.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(qk - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _paged_prefill_kernel(
    # pointers
    q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr, scale_ptr, zero_ptr, cs_ptr,
    # sizes
    head_dim, block_size, group_size, scale, num_kv_heads, window, softcap, num_pos,
    # strides
    stride_qt, stride_qh, stride_qd,
    stride_ckv, stride_cb, stride_cs, stride_ch, stride_cd,
    stride_btb, stride_btm,
    stride_ot, stride_oh, stride_od,
    stride_zh, stride_zd, stride_csp, stride_csx, stride_csd,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, QUANT: tl.constexpr,
    SOFTCAP: tl.constexpr, ROPE_KEYS: tl.constexpr,
):
    """Program (query tile, sequence b, query head h): rows ``pid_m*BLOCK_M ..`` of b's chunk
    (with ``window`` > 0 the prefix stage starts at the tile's first visible key; with
    ``ROPE_KEYS`` the keys are pre-RoPE, ``zero_ptr [Hkv, D]``, ``cs_ptr [num_pos, 2, D]``)."""
    pid_m = tl.program_id(0)
    pid_b = tl.program_id(1)
    pid_h = tl.program_id(2)
    q_start = tl.load(qsl_ptr + pid_b)
    q_len = tl.load(qsl_ptr + pid_b + 1) - q_start
    if pid_m * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + pid_b)
    ctx_len = seq_len - q_len  # cached prefix before this chunk
    kvh = pid_h // group_size
    k_scale = 1.0
    v_scale = 1.0
    if QUANT != 0:
        k_scale = tl.load(scale_ptr + kvh)
        v_scale = tl.load(scale_ptr + num_kv_heads + kvh)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < head_dim
    zero, zero_r = key_zero(zero_ptr, kvh, offs_d, mask_d, head_dim, stride_zh, stride_zd,
                            ROPE_KEYS)
    q_ptrs = q_ptr + (q_start + offs_m)[:, None] * stride_qt + pid_h * stride_qh \
        + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    q_pos = ctx_len + offs_m  # absolute position of each query row

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + pid_b * stride_btb
    diag_lo = ctx_len + pid_m * BLOCK_M  # keys below this are visible to every row of the tile
    diag_hi = tl.minimum(diag_lo + BLOCK_M, seq_len)
    lo = tl.where(window > 0, tl.maximum(diag_lo - window + 1, 0), 0)
    # stage 1: the prefix, visible to every row (without a window), no causal mask
    acc, l_i, m_i = _attn_stage(acc, l_i, m_i, q, q_pos, cache_ptr, bt_row, lo, diag_lo,
                                kvh * stride_ch, scale, k_scale, v_scale, head_dim,
                                block_size, window, softcap, stride_ckv, stride_cb, stride_cs,
                                stride_cd, stride_btm, zero, zero_r, cs_ptr, num_pos, stride_csp,
                                stride_csx, stride_csd, False, BLOCK_N, BLOCK_D, DOT_PRECISION,
                                UPCAST_DOT, QUANT, SOFTCAP, ROPE_KEYS)
    # stage 2: the diagonal band, causal mask
    acc, l_i, m_i = _attn_stage(acc, l_i, m_i, q, q_pos, cache_ptr, bt_row, diag_lo, diag_hi,
                                kvh * stride_ch, scale, k_scale, v_scale, head_dim,
                                block_size, window, softcap, stride_ckv, stride_cb, stride_cs,
                                stride_cd, stride_btm, zero, zero_r, cs_ptr, num_pos, stride_csp,
                                stride_csx, stride_csd, True, BLOCK_N, BLOCK_D, DOT_PRECISION,
                                UPCAST_DOT, QUANT, SOFTCAP, ROPE_KEYS)
    out = acc / l_i[:, None]
    o_ptrs = out_ptr + (q_start + offs_m)[:, None] * stride_ot + pid_h * stride_oh \
        + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def _prefill_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): tiles sized so K/V tiles fit shared memory."""
    if is_interpreter():
        return 16, 16, 4, 1
    if dtype == torch.float32 or head_dim > 128:
        return 32, 32, 4, 2
    return 64, 64, 4, 2


def paged_prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                            scale: float, out: torch.Tensor | None = None,
                            kv_scale: torch.Tensor | None = None, window: int | None = None,
                            softcap: float | None = None,
                            rotary_keys: RotaryKeys | None = None) -> torch.Tensor:
    """Varlen causal attention of each sequence's new tokens over its cached prefix and itself.

    Args:
        query: ``[T, Hq, D]`` fp16/bf16/fp32, sequences concatenated per ``query_start_loc``.
        kv_cache: ``[2, NB, BS, Hkv, D]``, any float dtype, or ``int8`` / ``float8_e4m3fn``
            (quantized, read through ``kv_scale``); already holds this step's keys/values.
        meta: batch layout (``query_start_loc [B+1]``, ``seq_lens [B]``, ``block_tables [B, MB]``,
            ``max_query_len``); ``q_len_b <= seq_len_b``.
        scale: softmax scale (usually ``D ** -0.5``).
        out: optional ``[T, Hq, D]`` output buffer in ``query.dtype``.
        kv_scale: ``[2, Hkv]`` float32 per-head scales of a quantized cache.
        window: a sliding-window layer's window (a query at ``i`` sees keys
            ``i - window < j <= i``), or None.
        softcap: ``c`` of the scores' soft-capping ``c * tanh(s / c)``, or None.
        rotary_keys: a quantized cache that holds keys before RoPE (pre-RoPE key
            quantization, KVQuant, Hooper et al. 2024): ``zero [Hkv, D]`` float32 and the
            layer's rotary table ``cos_sin [P, 2, D]`` float32, applied in fp32 as each key
            tile is read (:class:`~nybble.kernels.kv_quant.RotaryKeys`; the key at position
            ``j`` uses row ``j``). None: keys are cached rotated.

    Returns:
        ``[T, Hq, D]`` in ``query.dtype`` (fp32 accumulation). Rows of sequences with zero new
        tokens do not exist; every row of the flat batch is written.

    Raises:
        ValueError: shape/dtype mismatch, ``rotary_keys`` with a float cache or of the wrong
            shape/dtype, or device unsupported.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(f"query [T, Hq, D] must match kv_cache [2, NB, BS, Hkv, D] with "
                         f"Hq % Hkv == 0, got {tuple(query.shape)} and {tuple(kv_cache.shape)}")
    quant = quant_mode(kv_cache)
    if not query.dtype.is_floating_point or not kv_cache.dtype.is_floating_point and not quant:
        raise ValueError(f"query and kv_cache must be float tensors (or the cache int8), got "
                         f"{query.dtype} and {kv_cache.dtype}")
    scales = scale_arg(kv_cache, kv_scale)
    zero, cos_sin, num_pos, rotary_strides = rotary_args(kv_cache, rotary_keys, scales)
    check_device(query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scales,
                 zero, cos_sin)
    if out is None:
        out = torch.empty_like(query)
    batch = meta.seq_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    block_m, block_n, num_warps, num_stages = _prefill_config(head_dim, query.dtype)
    grid = (cdiv(meta.max_query_len, block_m), batch, num_heads)
    _paged_prefill_kernel[grid](
        query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, out, scales,
        zero, cos_sin, head_dim, block_size, num_heads // num_kv_heads, scale, num_kv_heads,
        window or 0, float(softcap or 1.0), num_pos,
        *query.stride(), *kv_cache.stride(), *meta.block_tables.stride(), *out.stride(),
        *rotary_strides,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, next_power_of_2(head_dim)),
        DOT_PRECISION=tl_dtype_precision(query.dtype), UPCAST_DOT=upcast_dot(query.dtype),
        QUANT=quant, SOFTCAP=softcap is not None, ROPE_KEYS=rotary_keys is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
