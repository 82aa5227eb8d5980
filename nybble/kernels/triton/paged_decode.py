"""Split-KV paged decode attention (one new token per sequence), GQA aware.

Algorithm: flash-decoding (Dao, Haziza, Massa, Sizov, 2023): each sequence's context is cut
into partitions processed by independent programs, each producing an un-normalised partial
output plus its running max and sum (FlashAttention-2 online softmax); a second, reduce
kernel rescales and combines the partials. KV is read through block tables as in
PagedAttention (Kwon et al., SOSP 2023). All query heads sharing one KV head are processed as
the rows of one tile, so each K/V tile is loaded once per group (GQA). Shapes follow
:mod:`nybble.kernels.interface`. A sliding-window layer's sequence is walked from position
``seq_len - window`` only (no program, no partial for the splits before it); soft-capping
(Gemma 2) caps each scaled score to ``c * tanh(s / c)``. A quantized cache that holds keys
before RoPE (:class:`~nybble.kernels.kv_quant.RotaryKeys`; pre-RoPE key quantization, KVQuant,
Hooper et al. 2024) has each key tile zero-shifted and rotated as it is read
(:func:`kv_tile`, shared with the prefill kernel).
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
from nybble.kernels.kv_quant import RotaryKeys, is_quantized_cache
from nybble.kernels.triton.cache import quant_mode, scale_arg


def rotary_args(kv_cache: torch.Tensor, rotary_keys: RotaryKeys | None, dummy: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, int, tuple[int, ...]]:
    """The attention kernels' rotary arguments ``(zero_ptr, cs_ptr, num_pos, (stride_zh,
    stride_zd, stride_csp, stride_csx, stride_csd))``: ``rotary_keys``' ``zero [Hkv, D]`` and
    ``cos_sin [P, 2, D]`` (float32, checked; read through their strides) with ``P``, or
    ``dummy`` twice, 1 and zero strides without it (never read: ``ROPE_KEYS`` is False).

    Raises:
        ValueError: ``rotary_keys`` with a float cache, or tensors of the wrong shape, dtype
            or an odd head dimension (the rotation swaps the halves of each key).
    """
    if rotary_keys is None:
        return dummy, dummy, 1, (0,) * 5
    if not is_quantized_cache(kv_cache):
        raise ValueError(f"rotary_keys (keys cached before RoPE) needs a quantized (int8 / "
                         f"float8_e4m3fn) KV cache, got {kv_cache.dtype}")
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    zero, cos_sin = rotary_keys.zero, rotary_keys.cos_sin
    if (tuple(zero.shape) != (num_kv_heads, head_dim) or cos_sin.dim() != 3
            or tuple(cos_sin.shape[1:]) != (2, head_dim) or cos_sin.shape[0] < 1
            or zero.dtype != torch.float32 or cos_sin.dtype != torch.float32
            or head_dim % 2 != 0):
        raise ValueError(f"rotary_keys needs zero [{num_kv_heads}, {head_dim}] and cos_sin "
                         f"[P >= 1, 2, {head_dim}] float32 (even head_dim), got "
                         f"{tuple(zero.shape)} {zero.dtype} and {tuple(cos_sin.shape)} "
                         f"{cos_sin.dtype}")
    return zero, cos_sin, cos_sin.shape[0], (*zero.stride(), *cos_sin.stride())


@triton.jit
def rotated_keys(k, cache_ptr, kv_offs, mask_kv, k_scale, zero, zero_r, cs_ptr, k_pos, offs_d,
                 head_dim, num_pos, stride_cd, stride_csp, stride_csx, stride_csd):
    """A quantized tile of pre-RoPE keys ``k [N, BLOCK_D]`` (codes, loaded from
    ``cache_ptr + kv_offs``) -> the keys attention uses, fp32:
    ``x = float(code) * k_scale + zero``, ``k = x * cos + roll(x, D/2) * sin`` with the rows
    ``k_pos`` of the rotary table ``cs_ptr [P, 2, D]`` (``zero`` / ``zero_r``: the head's zero
    point at columns ``d`` / ``(d + D/2) % D``, ``[BLOCK_D]`` fp32). Masked elements are 0.
    """
    offs_r = (offs_d + head_dim // 2) % head_dim
    # NOTE: roll(x) is read from the cache a second time at the rolled columns (the same
    # bytes, from cache) rather than permuted in registers: tl.gather is newer than the
    # triton>=3.0 this package supports, and the extra load of one-byte codes is cheap.
    k_r = tl.load(cache_ptr + kv_offs + ((offs_r - offs_d) * stride_cd)[None, :], mask=mask_kv,
                  other=0.0)
    x = k.to(tl.float32) * k_scale + zero[None, :]
    x_r = k_r.to(tl.float32) * k_scale + zero_r[None, :]
    # NOTE: masked rows never load; clamping keeps even their addresses inside the table (as
    # RotaryKeys.rotate clamps).
    rows = tl.minimum(k_pos, num_pos - 1)
    cs_ptrs = cs_ptr + rows[:, None] * stride_csp + offs_d[None, :] * stride_csd
    cos = tl.load(cs_ptrs, mask=mask_kv, other=0.0)
    sin = tl.load(cs_ptrs + stride_csx, mask=mask_kv, other=0.0)
    return x * cos + x_r * sin


@triton.jit
def key_zero(zero_ptr, kvh, offs_d, mask_d, head_dim, stride_zh, stride_zd,
             ROPE_KEYS: tl.constexpr):
    """KV head ``kvh``'s key zero point at columns ``d`` and ``(d + D/2) % D`` (``[BLOCK_D]``
    fp32 each) for :func:`kv_tile`; 0.0 placeholders, never read, without ``ROPE_KEYS``."""
    zero = 0.0
    zero_r = 0.0
    if ROPE_KEYS:
        row = zero_ptr + kvh * stride_zh
        zero = tl.load(row + offs_d * stride_zd, mask=mask_d, other=0.0)
        zero_r = tl.load(row + ((offs_d + head_dim // 2) % head_dim) * stride_zd, mask=mask_d,
                         other=0.0)
    return zero, zero_r


@triton.jit
def kv_tile(cache_ptr, kv_offs, mask_kv, stride_ckv, k_scale, v_scale, zero, zero_r, cs_ptr,
            k_pos, offs_d, head_dim, num_pos, stride_cd, stride_csp, stride_csx, stride_csd,
            QUANT: tl.constexpr, ROPE_KEYS: tl.constexpr):
    """The key and value tiles ``[N, BLOCK_D]`` at ``cache_ptr + kv_offs`` (values one
    ``stride_ckv`` further) as attention reads them: a float cache's as stored, a quantized
    one's as ``float(q) * scale`` (fp32), its keys with ``ROPE_KEYS`` shifted and rotated
    (:func:`rotated_keys`). Masked elements are 0."""
    k = tl.load(cache_ptr + kv_offs, mask=mask_kv, other=0.0)
    v = tl.load(cache_ptr + stride_ckv + kv_offs, mask=mask_kv, other=0.0)
    if QUANT != 0:
        if ROPE_KEYS:
            k = rotated_keys(k, cache_ptr, kv_offs, mask_kv, k_scale, zero, zero_r, cs_ptr,
                             k_pos, offs_d, head_dim, num_pos, stride_cd, stride_csp,
                             stride_csx, stride_csd)
        else:
            k = k.to(tl.float32) * k_scale
        v = v.to(tl.float32) * v_scale
    return k, v


@triton.jit
def _paged_decode_split_kernel(
    # pointers
    q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, part_acc_ptr, part_ml_ptr, scale_ptr,
    zero_ptr, cs_ptr,
    # sizes
    head_dim, block_size, group_size, partition_size, scale, num_kv_heads, window, softcap,
    num_pos,
    # strides
    stride_qt, stride_qh, stride_qd,
    stride_ckv, stride_cb, stride_cs, stride_ch, stride_cd,
    stride_btb, stride_btm,
    stride_pab, stride_pah, stride_pas, stride_pad,
    stride_pmb, stride_pmh, stride_pms, stride_pmx,
    stride_zh, stride_zd, stride_csp, stride_csx, stride_csd,
    # meta-parameters
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, QUANT: tl.constexpr,
    SOFTCAP: tl.constexpr, ROPE_KEYS: tl.constexpr,
):
    """Program (b, kv head, split): online softmax over one partition of sequence b's keys
    (those inside the window when ``window`` > 0).
    A quantized cache (``QUANT`` != 0) is read as ``float(q) * scale`` with the head's scales
    ``scale_ptr[0, h]`` (keys) and ``scale_ptr[1, h]`` (values); with ``ROPE_KEYS`` its keys
    are pre-RoPE, read through ``zero_ptr [Hkv, D]`` and ``cs_ptr [num_pos, 2, D]``
    (:func:`rotated_keys`).

    Writes ``part_acc[b, h, split] = sum_j exp2(s_j - m) v_j`` (fp32, not normalised) and
    ``part_ml[b, h, split] = (m, l)`` with ``l = sum_j exp2(s_j - m)`` (scores in log2 units).
    """
    pid_b = tl.program_id(0)
    pid_kvh = tl.program_id(1)
    pid_s = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + pid_b)
    first = tl.where((window > 0) & (window < seq_len), seq_len - window, 0)
    start = tl.maximum(pid_s * partition_size, first)
    if start >= seq_len or pid_s * partition_size + partition_size <= first:
        return  # NOTE: the reduce kernel reads only the splits [first // P, cdiv(seq_len, P))
    end = tl.minimum(pid_s * partition_size + partition_size, seq_len)
    tok = tl.load(qsl_ptr + pid_b)  # decode: the sequence's single new token

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_g = offs_g < group_size
    mask_d = offs_d < head_dim
    heads = pid_kvh * group_size + offs_g  # query heads of this KV head, padded to BLOCK_G rows
    q_ptrs = q_ptr + tok * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    k_scale = 1.0  # NOTE: placeholders, read only with QUANT
    v_scale = 1.0
    if QUANT != 0:
        k_scale = tl.load(scale_ptr + pid_kvh)
        v_scale = tl.load(scale_ptr + num_kv_heads + pid_kvh)
    zero, zero_r = key_zero(zero_ptr, pid_kvh, offs_d, mask_d, head_dim, stride_zh, stride_zd,
                            ROPE_KEYS)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + pid_b * stride_btb
    for kv_start in range(start, end, BLOCK_N):
        k_pos = kv_start + offs_n
        mask_n = k_pos < end
        # Per-token block-table gather: works for any block size, including < BLOCK_N.
        blk = tl.load(bt_row + (k_pos // block_size) * stride_btm, mask=mask_n, other=0)
        kv_offs = blk.to(tl.int64)[:, None] * stride_cb + (k_pos % block_size)[:, None] * stride_cs \
            + pid_kvh * stride_ch + offs_d[None, :] * stride_cd
        mask_kv = mask_n[:, None] & mask_d[None, :]
        k, v = kv_tile(cache_ptr, kv_offs, mask_kv, stride_ckv, k_scale, v_scale, zero, zero_r,
                       cs_ptr, k_pos, offs_d, head_dim, num_pos, stride_cd, stride_csp,
                       stride_csx, stride_csd, QUANT, ROPE_KEYS)
        # NOTE: a no-op for a float cache of the query's dtype
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        qk = capped_log2_scores(dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT), scale, softcap,
                                SOFTCAP)  # [G, N], log2 units
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
        m_i = m_new

    pa_ptrs = part_acc_ptr + pid_b * stride_pab + heads[:, None] * stride_pah \
        + pid_s * stride_pas + offs_d[None, :] * stride_pad
    tl.store(pa_ptrs, acc, mask=mask_g[:, None] & mask_d[None, :])
    pm_ptrs = part_ml_ptr + pid_b * stride_pmb + heads * stride_pmh + pid_s * stride_pms
    tl.store(pm_ptrs, m_i, mask=mask_g)
    tl.store(pm_ptrs + stride_pmx, l_i, mask=mask_g)


@triton.jit
def _paged_decode_reduce_kernel(
    # pointers
    part_acc_ptr, part_ml_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
    # sizes
    head_dim, partition_size, window,
    # strides
    stride_pab, stride_pah, stride_pas, stride_pad,
    stride_pmb, stride_pmh, stride_pms, stride_pmx,
    stride_ot, stride_oh, stride_od,
    # meta-parameters
    BLOCK_D: tl.constexpr,
):
    """Program (b, query head): combine the sequence's partitions, ``out = sum w_s acc_s / sum w_s l_s``."""
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + pid_b)
    num_splits = tl.cdiv(seq_len, partition_size)
    first_split = tl.where((window > 0) & (window < seq_len), seq_len - window,
                           0) // partition_size
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    m_run = tl.full([], float("-inf"), dtype=tl.float32)
    l_run = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    pm_base = part_ml_ptr + pid_b * stride_pmb + pid_h * stride_pmh
    pa_base = part_acc_ptr + pid_b * stride_pab + pid_h * stride_pah + offs_d * stride_pad
    for s in range(first_split, num_splits):
        m_s = tl.load(pm_base + s * stride_pms)
        l_s = tl.load(pm_base + s * stride_pms + stride_pmx)
        a_s = tl.load(pa_base + s * stride_pas, mask=mask_d, other=0.0)
        m_new = tl.maximum(m_run, m_s)
        alpha = tl.exp2(m_run - m_new)  # every stored split has a finite max, so no NaN
        beta = tl.exp2(m_s - m_new)
        l_run = l_run * alpha + l_s * beta
        acc = acc * alpha + a_s * beta
        m_run = m_new
    tok = tl.load(qsl_ptr + pid_b)
    out = acc / l_run
    o_ptrs = out_ptr + tok * stride_ot + pid_h * stride_oh + offs_d * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_d)


def _decode_config(batch: int, num_kv_heads: int, max_seq_len: int,
                   head_dim: int) -> tuple[int, int]:
    """(BLOCK_N, partition_size) for the split kernel.

    Flash-decoding heuristic: aim for ~1024 programs (several per SM) so that small batches
    with long contexts still fill the GPU, but never partitions shorter than 256 tokens (each
    split costs a partial write and a reduce step).
    """
    if is_interpreter():
        return 16, 64
    block_n = 64 if head_dim <= 128 else 32
    splits = max(1, min(cdiv(1024, batch * num_kv_heads), cdiv(max_seq_len, 256)))
    partition = cdiv(cdiv(max_seq_len, splits), block_n) * block_n
    return block_n, max(partition, block_n)


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                           scale: float, out: torch.Tensor | None = None,
                           partition_size: int | None = None,
                           kv_scale: torch.Tensor | None = None, window: int | None = None,
                           softcap: float | None = None,
                           rotary_keys: RotaryKeys | None = None) -> torch.Tensor:
    """Decode attention: each sequence's single new token over all of its cached keys.

    Args:
        query: ``[T = B, Hq, D]`` fp16/bf16/fp32 (token ``query_start_loc[b]`` is sequence b's).
        kv_cache: ``[2, NB, BS, Hkv, D]``, any float dtype, or ``int8`` / ``float8_e4m3fn``
            (quantized, read through ``kv_scale``); already holds this step's keys/values.
        meta: batch layout; ``meta.is_decode_only`` must hold. ``seq_lens[b] >= 1``.
        scale: softmax scale (usually ``D ** -0.5``).
        out: optional ``[T, Hq, D]`` output buffer in ``query.dtype`` (written fully).
        partition_size: tokens per split (a multiple of the key tile); ``None`` picks it from
            the batch shape (see :func:`_decode_config`). Tests use it to force many splits.
        kv_scale: ``[2, Hkv]`` float32 per-head scales of a quantized cache.
        window: a sliding-window layer's window (the token sees the last ``window``
            positions, itself included), or None.
        softcap: ``c`` of the scores' soft-capping ``c * tanh(s / c)``, or None.
        rotary_keys: a quantized cache that holds keys before RoPE (pre-RoPE key
            quantization, KVQuant, Hooper et al. 2024): ``zero [Hkv, D]`` float32 and the
            layer's rotary table ``cos_sin [P, 2, D]`` float32, applied in fp32 as each key
            tile is read (:class:`~nybble.kernels.kv_quant.RotaryKeys`; the key at position
            ``j`` uses row ``j``). None: keys are cached rotated.

    Returns:
        ``[T, Hq, D]`` in ``query.dtype``; fp32 accumulation, softmax in exp2 form.

    Raises:
        ValueError: not decode-only, shape/dtype mismatch, ``rotary_keys`` with a float cache
            or of the wrong shape/dtype, or device unsupported.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    batch = meta.seq_lens.shape[0]
    if not meta.is_decode_only or num_tokens != batch:
        raise ValueError(f"decode attention needs one new token per sequence, got {num_tokens} "
                         f"tokens for {batch} sequences")
    if cache_head_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(f"query [T, Hq, D] must match kv_cache [2, NB, BS, Hkv, D] with "
                         f"Hq % Hkv == 0, got {tuple(query.shape)} and {tuple(kv_cache.shape)}")
    quant = quant_mode(kv_cache)
    if not query.dtype.is_floating_point or not kv_cache.dtype.is_floating_point and not quant:
        raise ValueError(f"query and kv_cache must be float tensors (or the cache int8), got "
                         f"{query.dtype} and {kv_cache.dtype}")
    scales = scale_arg(kv_cache, kv_scale)
    zero, cos_sin, num_pos, rotary_strides = rotary_args(kv_cache, rotary_keys, scales)
    check_device(query, kv_cache, meta.block_tables, meta.seq_lens, scales, zero, cos_sin)
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    block_n, auto_partition = _decode_config(batch, num_kv_heads, meta.max_seq_len, head_dim)
    partition = partition_size or auto_partition
    if partition % block_n != 0:
        raise ValueError(f"partition_size must be a multiple of {block_n}, got {partition}")
    num_splits = cdiv(max(meta.max_seq_len, 1), partition)
    group = num_heads // num_kv_heads
    part_acc = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32,
                           device=query.device)
    part_ml = torch.empty(batch, num_heads, num_splits, 2, dtype=torch.float32,
                          device=query.device)
    block_d = max(16, next_power_of_2(head_dim))  # tl.dot needs every dim >= 16: pad, mask
    _paged_decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, part_acc, part_ml,
        scales, zero, cos_sin, head_dim, block_size, group, partition, scale, num_kv_heads,
        window or 0, float(softcap or 1.0), num_pos,
        *query.stride(), *kv_cache.stride(), *meta.block_tables.stride(),
        *part_acc.stride(), *part_ml.stride(), *rotary_strides,
        BLOCK_G=max(16, next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_PRECISION=tl_dtype_precision(query.dtype), UPCAST_DOT=upcast_dot(query.dtype),
        QUANT=quant, SOFTCAP=softcap is not None, ROPE_KEYS=rotary_keys is not None,
    )
    _paged_decode_reduce_kernel[(batch, num_heads)](
        part_acc, part_ml, meta.seq_lens, meta.query_start_loc, out,
        head_dim, partition, window or 0,
        *part_acc.stride(), *part_ml.stride(), *out.stride(),
        BLOCK_D=next_power_of_2(head_dim),
    )
    return out
