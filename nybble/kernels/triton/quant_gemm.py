"""Fused dequant-GEMM for GPTQ and AWQ weights: ``y = x @ dequant(W) + bias``.

The packed weight is read straight from its published layout (docs/quant-formats.md §3 GPTQ,
§4 AWQ GEMM) and dequantized tile by tile in registers, ``W[k, n] = s[g, n] * (q[k, n] - z[g, n])``,
then multiplied with fp32 accumulation, so the fp16 weight never exists in memory.

Two launch shapes of one kernel (selection by M in :func:`_launch`):
* small M (decode, M <= 16): split-K, each program reduces a strided share of the K tiles and
  ``atomic_add``s its fp32 partial tile (GEMV-like: enough programs to stream the weight at full
  bandwidth even when M is 1);
* larger M (prefill): classic tiled GEMM with grouped (L2-friendly) program ordering, as in
  the Triton matmul tutorial, bias and cast fused into the store.
Autotune configs live in :func:`_small_m_configs` / :func:`_tiled_configs`, keyed on the M
bucket (:func:`nybble.kernels.triton.common.m_bucket`), N and K; one config under the interpreter.
"""
from __future__ import annotations

import os

import torch

from nybble.kernels.triton.common import (
    cdiv,
    check_device,
    dot,
    is_interpreter,
    m_bucket,
    tl,
    tl_dtype_precision,
    triton,
    upcast_dot,
)

SMALL_M_MAX = 16  # rows up to which the split-K path is used


def _autotune_enabled() -> bool:
    """Autotune on GPUs unless ``NYBBLE_TRITON_AUTOTUNE=0`` (the kernel tests set it to skip
    compiling every config for every layout); the interpreter always uses one config."""
    return not is_interpreter() and os.environ.get("NYBBLE_TRITON_AUTOTUNE", "1") != "0"


@triton.jit
def _dequant_tile(qw_ptr, qz_ptr, sc_ptr, gidx_ptr, mn_ptr, k0, offs_k, offs_n, mask_k, mask_n,
                  stride_qwk, stride_qwn, stride_qzg, stride_qzn, stride_sg, stride_sn,
                  stride_mg, stride_mn,
                  BITS: tl.constexpr, IS_AWQ: tl.constexpr, HAS_GIDX: tl.constexpr,
                  SYM: tl.constexpr, ZERO_OFFSET: tl.constexpr, GROUP_SIZE: tl.constexpr,
                  BLOCK_K: tl.constexpr, HAS_MINS: tl.constexpr):
    """Dequantized ``[BLOCK_K, BLOCK_N]`` fp32 tile of ``Wt`` (rows offs_k, columns offs_n):
    ``s * (q - z)``, or ``s * q + m`` with per-group minimums (``HAS_MINS``, GGUF)."""
    MASK: tl.constexpr = (1 << BITS) - 1
    PACK: tl.constexpr = 32 // BITS  # values per int32 word
    mask_kn = mask_k[:, None] & mask_n[None, :]
    if IS_AWQ:
        # packed along N; field i holds column 8c + [0,2,4,6,1,3,5,7][i], so column j of a
        # word sits in field j // 2 + 4 * (j % 2) (AWQ_REVERSE_ORDER = [0,4,1,5,2,6,3,7])
        col = offs_n % 8
        shift_n = (col // 2 + (col % 2) * 4) * 4
        words = tl.load(qw_ptr + offs_k[:, None] * stride_qwk + (offs_n // 8)[None, :] * stride_qwn,
                        mask=mask_kn, other=0)
        q = (words >> shift_n[None, :]) & MASK
    else:
        # GPTQ: packed along K, row k in field k % PACK, no interleave
        shift_n = (offs_n % PACK) * BITS
        words = tl.load(qw_ptr + (offs_k // PACK)[:, None] * stride_qwk
                        + offs_n[None, :] * stride_qwn, mask=mask_kn, other=0)
        q = (words >> ((offs_k % PACK) * BITS)[:, None]) & MASK  # mask after arithmetic shift
    if HAS_GIDX:  # act-order: every row has its own group
        g = tl.load(gidx_ptr + offs_k, mask=mask_k, other=0)[:, None]
        mask_s = mask_kn
    elif GROUP_SIZE % BLOCK_K == 0:  # the whole K tile lies in one group: load one row
        g = k0 // GROUP_SIZE
        mask_s = mask_n[None, :]
    else:
        g = (offs_k // GROUP_SIZE)[:, None]
        mask_s = mask_kn
    s = tl.load(sc_ptr + g * stride_sg + offs_n[None, :] * stride_sn, mask=mask_s, other=0.0)
    if HAS_MINS:  # W = s * q + m (GGUF Q4_1/Q4_K/Q5_1/Q5_K): no zero point
        mn = tl.load(mn_ptr + g * stride_mg + offs_n[None, :] * stride_mn, mask=mask_s, other=0.0)
        return q.to(tl.float32) * s.to(tl.float32) + mn.to(tl.float32)
    if SYM:
        z = 1 << (BITS - 1)  # symmetric GPTQ: fixed zero 2^(b-1), qzeros ignored
    else:
        if IS_AWQ:
            zn = offs_n // 8
        else:
            zn = offs_n // PACK
        zw = tl.load(qz_ptr + g * stride_qzg + zn[None, :] * stride_qzn, mask=mask_s, other=0)
        z = ((zw >> shift_n[None, :]) + ZERO_OFFSET) & MASK  # GPTQ v1 stores z - 1
    return (q - z).to(tl.float32) * s.to(tl.float32)


@triton.jit
def _quant_gemm_kernel(
    # pointers
    x_ptr, qw_ptr, qz_ptr, sc_ptr, gidx_ptr, mn_ptr, bias_ptr, c_ptr,
    # sizes
    M, N, K, M_BUCKET,
    # strides
    stride_xm, stride_xk, stride_qwk, stride_qwn, stride_qzg, stride_qzn,
    stride_sg, stride_sn, stride_mg, stride_mn, stride_cm, stride_cn,
    # meta-parameters
    BITS: tl.constexpr, IS_AWQ: tl.constexpr, HAS_GIDX: tl.constexpr, SYM: tl.constexpr,
    HAS_MINS: tl.constexpr,
    ZERO_OFFSET: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """Program (output tile, K split): ``c[tile] (+)= x[rows, ks] @ dequant(W)[ks, cols]``."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # grouped ordering: GROUP_M row-tiles share each weight column-tile while it is in L2
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_rows = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_rows
    pid_n = (pid % num_pid_in_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = _dequant_tile(qw_ptr, qz_ptr, sc_ptr, gidx_ptr, mn_ptr, k0, offs_k, offs_n, mask_k,
                          mask_n, stride_qwk, stride_qwn, stride_qzg, stride_qzn, stride_sg,
                          stride_sn, stride_mg, stride_mn, BITS, IS_AWQ, HAS_GIDX, SYM,
                          ZERO_OFFSET, GROUP_SIZE, BLOCK_K, HAS_MINS)
        # NOTE: the weight is rounded to the activation dtype, as the tools' fp16 dequant does
        acc += dot(x, w.to(x.dtype), DOT_PRECISION, UPCAST_DOT)

    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    mask_c = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_c)
    else:  # c is a zeroed fp32 buffer; bias and the cast happen on the host side
        tl.atomic_add(c_ptrs, acc, mask=mask_c)


def _config(bm: int, bn: int, bk: int, split_k: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8,
                          "SPLIT_K": split_k}, num_warps=warps, num_stages=stages)


def _small_m_configs() -> list[triton.Config]:
    """Decode (M <= 16) configs: one 16-row tile, wide K tiles, split-K to fill the GPU."""
    if is_interpreter():
        return [_config(16, 32, 32, 2, 4, 1)]
    if not _autotune_enabled():
        return [_config(16, 64, 128, 4, 4, 3)]
    return [_config(16, bn, bk, sk, 4, 3) for bn in (64, 128) for bk in (64, 128) for sk in (2, 8)]


def _tiled_configs() -> list[triton.Config]:
    """Prefill (M > 16) configs: square-ish tiles, deeper pipelines (Triton matmul tutorial)."""
    if is_interpreter():
        return [_config(16, 32, 32, 1, 4, 1)]
    if not _autotune_enabled():
        return [_config(64, 64, 64, 1, 4, 3)]
    return [_config(32, 64, 64, 1, 4, 4), _config(64, 64, 64, 1, 4, 4),
            _config(64, 128, 32, 1, 4, 4), _config(128, 64, 32, 1, 4, 4),
            _config(128, 128, 32, 1, 8, 3), _config(128, 128, 64, 1, 8, 3)]


_KEY = ["M_BUCKET", "N", "K", "BITS", "IS_AWQ", "HAS_GIDX", "GROUP_SIZE", "HAS_MINS"]
# NOTE: the split-K path accumulates with atomic_add into ``c``, so a launch is only right if
# ``c`` starts at zero (the host allocates it zeroed). Autotuning, on the first call for a key,
# launches every config several times into that same ``c``; those partial sums would pile up.
# ``reset_to_zero`` makes Triton zero ``c`` before each benchmark launch and once more before
# the real one. The tiled path overwrites ``c`` (tl.store), so it needs no reset.
_small_m_kernel = triton.autotune(configs=_small_m_configs(), key=_KEY,
                                  reset_to_zero=["c_ptr"])(_quant_gemm_kernel)
_tiled_kernel = triton.autotune(configs=_tiled_configs(), key=_KEY)(_quant_gemm_kernel)


def _launch(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
            g_idx: torch.Tensor | None, bias: torch.Tensor | None, n: int, *, bits: int,
            group_size: int, is_awq: bool, sym: bool, zero_offset: int,
            out: torch.Tensor | None, mins: torch.Tensor | None = None) -> torch.Tensor:
    """Shared host side: flatten x, pick the path, allocate, launch, epilogue."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if out is None:
        out = torch.empty(*lead, n, dtype=x.dtype, device=x.device)
    if out.shape != (*lead, n) or out.dtype != x.dtype:
        raise ValueError(f"out must be {(*lead, n)} {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    if m == 0:
        return out
    check_device(*(t for t in (x, qweight, qzeros, scales, g_idx, bias, out, mins)
                   if t is not None))
    out2 = out.view(-1, n)
    small = m <= SMALL_M_MAX
    c = torch.zeros(m, n, dtype=torch.float32, device=x.device) if small else out2
    dummy = scales  # never dereferenced when the matching HAS_* flag is off
    kernel = _small_m_kernel if small else _tiled_kernel

    def grid(meta: dict) -> tuple[int, int]:
        return (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])

    kernel[grid](
        x2, qweight, qzeros, scales, g_idx if g_idx is not None else dummy,
        mins if mins is not None else dummy,
        bias if (bias is not None and not small) else dummy, c,
        m, n, k, m_bucket(m),
        *x2.stride(), *qweight.stride(), *qzeros.stride(), *scales.stride(),
        *(mins if mins is not None else scales).stride(), *c.stride(),
        BITS=bits, IS_AWQ=is_awq, HAS_GIDX=g_idx is not None, SYM=sym, HAS_MINS=mins is not None,
        ZERO_OFFSET=zero_offset,
        GROUP_SIZE=group_size, HAS_BIAS=bias is not None and not small,
        DOT_PRECISION=tl_dtype_precision(x.dtype), UPCAST_DOT=upcast_dot(x.dtype),
    )
    if small:
        if bias is not None:
            c += bias.to(torch.float32)
        out2.copy_(c)
    return out


def gptq_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              g_idx: torch.Tensor | None, bits: int, group_size: int, zero_offset: int, sym: bool,
              bias: torch.Tensor | None, *, out: torch.Tensor | None = None,
              mins: torch.Tensor | None = None) -> torch.Tensor:
    """GPTQ dequant-GEMM, ``y = x @ Wt + bias`` with ``Wt[k, n] = s[g, n] * (q[k, n] - z[g, n])``
    (or ``s[g, n] * q[k, n] + mins[g, n]`` with ``mins``: the float-minimum INT4/INT8 variant
    that GGUF's Q4_1/Q4_K/Q5_1/Q5_K load into).

    Layout: docs/quant-formats.md §3 (AutoGPTQ "gptq" v1 / GPTQModel "gptq_v2").

    Args:
        x: ``[M, K]`` (or ``[..., K]``) fp16/bf16/fp32 activations.
        qweight: int32 ``[ceil(K / pf), N]``, ``pf = 32 / bits`` values packed along K, row
            ``k`` in field ``k % pf`` (least significant first).
        qzeros: int32 ``[G, ceil(N / pf)]`` zero fields packed along N (ignored when ``sym``).
        scales: ``[G, N]`` (fp16/bf16/fp32).
        g_idx: int32 ``[K]`` group of every input row (act-order), or ``None`` for
            ``k // group_size``.
        bits: 4 or 8.
        group_size: rows per group; ``-1`` means one group over all of K.
        zero_offset: 1 for v1 checkpoints (stored field is ``z - 1``: ``z = (field + 1) & mask``),
            0 for gptq_v2.
        sym: True: ``z = 2^(bits-1)`` for every group and ``qzeros`` is not read.
        bias: ``[N]`` or None.
        out: optional preallocated ``[M, N]`` output in ``x.dtype``.
        mins: float ``[G, N]`` per-group minimums (``qzeros`` then not read), or None.

    Returns:
        ``[M, N]`` in ``x.dtype``; fp32 accumulation.

    Raises:
        ValueError: unsupported bits, inconsistent shapes or dtypes, or device unsupported.
    """
    if mins is not None and mins.shape != scales.shape:
        raise ValueError(f"mins must have the shape of scales {tuple(scales.shape)}, got "
                         f"{tuple(mins.shape)}")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if zero_offset not in (0, 1):
        raise ValueError(f"zero_offset must be 0 or 1, got {zero_offset}")
    k, n = x.shape[-1], qweight.shape[1]
    pack = 32 // bits
    group_size = k if group_size == -1 else group_size
    num_groups = scales.shape[0]
    if qweight.dtype != torch.int32 or qweight.shape[0] != cdiv(k, pack):
        raise ValueError(f"qweight must be int32 [{cdiv(k, pack)}, N] for K={k}, {bits}-bit, "
                         f"got {qweight.dtype} {tuple(qweight.shape)}")
    if group_size <= 0 or (g_idx is None and num_groups != cdiv(k, group_size)):
        raise ValueError(f"scales must be [{cdiv(k, max(group_size, 1))}, {n}] for group_size "
                         f"{group_size}, got {tuple(scales.shape)}")
    if scales.shape[1] != n or qzeros.shape != (num_groups, cdiv(n, pack)):
        raise ValueError(f"scales [G, {n}] and qzeros [G, {cdiv(n, pack)}] expected, got "
                         f"{tuple(scales.shape)} and {tuple(qzeros.shape)}")
    if g_idx is not None and g_idx.shape != (k,):
        raise ValueError(f"g_idx must be [{k}], got {tuple(g_idx.shape)}")
    if g_idx is not None and g_idx.dtype != torch.int32:
        g_idx = g_idx.to(torch.int32)
    return _launch(x, qweight, qzeros, scales, g_idx, bias, n, bits=bits, group_size=group_size,
                   is_awq=False, sym=sym, zero_offset=zero_offset, out=out, mins=mins)


def awq_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
             group_size: int, bias: torch.Tensor | None, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """AWQ (AutoAWQ GEMM, 4-bit) dequant-GEMM, ``y = x @ Wt + bias``.

    Layout: docs/quant-formats.md §4: ``Wt[k, n] = s[k // gs, n] * (q[k, n] - z[k // gs, n])``,
    real zero points (no offset), 4-bit fields interleaved ``[0,2,4,6,1,3,5,7]`` within a word.

    Args:
        x: ``[M, K]`` (or ``[..., K]``) fp16/bf16/fp32.
        qweight: int32 ``[K, ceil(N / 8)]`` packed along N.
        qzeros: int32 ``[G, ceil(N / 8)]``, same packing.
        scales: ``[G, N]``, ``G = ceil(K / group_size)``.
        group_size: rows per group (``-1``: all of K).
        bias: ``[N]`` or None.
        out: optional preallocated ``[M, N]`` output in ``x.dtype``.

    Returns:
        ``[M, N]`` in ``x.dtype``; fp32 accumulation.

    Raises:
        ValueError: inconsistent shapes or dtypes, or device unsupported.
    """
    k, n = x.shape[-1], scales.shape[1]
    group_size = k if group_size == -1 else group_size
    if group_size <= 0:
        raise ValueError(f"group_size must be positive or -1, got {group_size}")
    g = cdiv(k, group_size)
    if qweight.dtype != torch.int32 or qweight.shape != (k, cdiv(n, 8)):
        raise ValueError(f"qweight must be int32 [{k}, {cdiv(n, 8)}], got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    if scales.shape[0] != g or qzeros.shape != (g, cdiv(n, 8)):
        raise ValueError(f"scales [{g}, {n}] and qzeros [{g}, {cdiv(n, 8)}] expected, got "
                         f"{tuple(scales.shape)} and {tuple(qzeros.shape)}")
    return _launch(x, qweight, qzeros, scales, None, bias, n, bits=4, group_size=group_size,
                   is_awq=True, sym=False, zero_offset=0, out=out)
