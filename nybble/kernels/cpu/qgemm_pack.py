"""Packing for the CPU's bf16-dot quantized GEMM (:mod:`nybble.kernels.cpu.qgemm`), and its
torch entry point.

:func:`pack` turns any weight-only integer weight (:class:`~nybble.kernels.reference.quant.
IntWeight` + scales: GPTQ, AWQ, compressed-tensors, nybble's own, GGUF blocks) into the
layout ``qgemm.h`` streams: 16-column blocks, K-major, 4-bit values two to a byte or 8-bit
values as ``q - 128``, scales as float16 when every scale is a float16 value (GPTQ/AWQ/GGUF
store them so; 2 bytes per group and column) or float32 otherwise. Zero points become a
mode: SYM (every zero is ``2^(bits-1)``; nothing stored), ZERO (``int8 z - 2^(bits-1)``), or
MIN for a float per-group minimum ``W = s q + m`` (``float32 m + 2^(bits-1) s``).

Numerics (:func:`error_bound`): ``x`` is rounded to bfloat16 (round to nearest even); the
products with the exact weight integers are exact in float32; sums run in float32 over one
group (pairs of products), then over the groups. So against the float64 product of the
*rounded* ``x`` with the exact weight, the error is that of a float32 sum of
``L + G + 3`` terms (``L`` the group size) — the same bound as the float32 weight-only kernel,
applied to ``bf16(x)``; the rounding of ``x`` itself (relative ``2^-9``) is the price of the
fast path, measured as perplexity in ``benchmarks/cpu_qgemm_quality.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nybble.kernels.cpu import qgemm as cpu_qgemm
from nybble.kernels.reference.quant import IntWeight

COLS = 16
"""Output columns per packed block."""
SYM, ZERO, MIN = 0, 1, 2


@dataclass(frozen=True)
class QPacked:
    """A 4- or 8-bit weight packed for :func:`nybble.kernels.cpu.qgemm.qgemm`.

    Attributes:
        bits: 4 or 8. mode: :data:`SYM`, :data:`ZERO` or :data:`MIN`. in_features ``K``
            and group_size: multiples of 8 (4 bits) or 4 (8 bits); the last group may be
            shorter. out_features ``N``.
        packed: uint8 ``[Np * K * bits / 8]`` (layout in ``qgemm.h``).
        scales: ``[G, Np]`` uint16 (float16 bits) or float32. zq: int8 ``[G, Np]`` (ZERO) or
            None. mo: float32 ``[G, Np]`` (MIN) or None. perm: int64 ``[K]`` input order (act
            order) or None. planes: 0 for bf16 activations (``qgemm.h``'s layout), 1 or 2
            int8 planes of integer activations per block (``idot.h``'s "vnni" layout:
            8-bit or 15-bit activations, AVX-512 VNNI dot products).
    """

    bits: int
    mode: int
    in_features: int
    out_features: int
    group_size: int
    packed: np.ndarray
    scales: np.ndarray
    zq: np.ndarray | None
    mo: np.ndarray | None
    perm: np.ndarray | None
    planes: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes the kernel streams per call (weights, scales, zeros or minimums)."""
        return sum(a.nbytes for a in (self.packed, self.scales, self.zq, self.mo)
                   if a is not None)


def group_order(iw: IntWeight) -> tuple[torch.Tensor | None, str | None]:
    """The input permutation that makes every group contiguous (None: already so), or
    ``(None, reason)`` when ``g_idx`` groups are not all ``group_size`` rows wide."""
    if iw.g_idx is None:
        return None, None
    k = iw.q.shape[0]
    perm = torch.argsort(iw.g_idx, stable=True)
    expect = torch.arange(k, device=iw.g_idx.device) // iw.group_size
    if not torch.equal(iw.g_idx[perm], expect):
        return None, f"g_idx groups are not all {iw.group_size} rows wide"
    return (None if torch.equal(perm, torch.arange(k, device=perm.device)) else perm), None


def _pad(t: torch.Tensor, np_: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, np_ - t.shape[1]))


def _scales(scales: torch.Tensor, np_: int) -> np.ndarray:
    """``[G, Np]`` float16 bits when exact, else float32."""
    s32 = _pad(scales.float(), np_).contiguous()
    s16 = s32.half()
    if torch.equal(s16.float(), s32):
        return s16.view(torch.int16).numpy().view(np.uint16)
    return s32.numpy()


ACTIVATION_PLANES = {"bfloat16": 0, "int8": 1, "int16": 2}
"""Activation kinds of the packed kernels and their ``QPacked.planes``."""


def pack(iw: IntWeight, scales: torch.Tensor, mins: torch.Tensor | None = None,
         activations: str = "bfloat16") -> tuple[QPacked | None, str]:
    """Pack a quantized weight for the bf16-dot or the integer-dot kernel.

    Args:
        iw: the weight's integers (``q [K, N]``, zeros ``[G, N]``, optional ``g_idx``).
        scales: ``[G, N]`` (any float dtype). mins: ``[G, N]`` float minimums (``W = s q +
            m``, GGUF Q4_1/Q4_K) or None (then ``iw.mins`` if the IntWeight carries one).
        activations: ``bfloat16`` (``qgemm.h``), ``int16`` or ``int8`` (``idot.h``: per
            block of up to 32 inputs, 15-bit or 8-bit integer activations).

    Raises:
        ValueError: an unknown ``activations``.

    Returns:
        ``(packed, description)``, or ``(None, reason)`` when the kernel cannot take it.
    """
    if activations not in ACTIVATION_PLANES:
        raise ValueError(f"activations must be one of {sorted(ACTIVATION_PLANES)}, got "
                         f"{activations!r}")
    planes = ACTIVATION_PLANES[activations]
    if mins is None:
        mins = getattr(iw, "mins", None)
    k, n = iw.q.shape
    if iw.bits not in (4, 8):
        return None, f"bits must be 4 or 8 for the bf16 kernel, got {iw.bits}"
    gs = iw.group_size
    unit = 8 if iw.bits == 4 else 4
    if k % unit or gs % unit:
        return None, (f"K ({k}) and group_size ({gs}) must be multiples of {unit} for "
                      f"{iw.bits}-bit weights")
    g = -(-k // gs)
    if scales.shape[0] != g:
        return None, f"group_size {gs} must split K={k} into {scales.shape[0]} groups"
    perm, why = group_order(iw)
    if why is not None:
        return None, why
    np_ = -(-n // COLS) * COLS
    nb = np_ // COLS
    off = 1 << (iw.bits - 1)
    q = _pad((iw.q if perm is None else iw.q[perm]).to(torch.int32), np_)  # [K, Np]
    if planes:
        packed = _pack_vnni(q, iw.bits, nb)
    elif iw.bits == 4:
        qp = q.reshape(k // 8, 4, 2, nb, COLS)                    # ko, t, parity, jb, c
        word = sum(qp[:, t] << (4 * t) for t in range(4))          # ko, parity, jb, c
        word = word.permute(2, 0, 3, 1).contiguous()              # jb, ko, c, parity
        packed = word.to(torch.int32).numpy().astype(np.uint16).view(np.uint8).reshape(-1)
    else:
        qp = (q - 128).to(torch.int8).reshape(k // 2, 2, nb, 2, 8)          # kp, par, jb, h, c
        packed = qp.permute(2, 0, 3, 4, 1).contiguous().reshape(-1).view(torch.uint8).numpy()
    zq = mo = None
    if mins is not None:
        mode = MIN
        mo = _pad((mins.double() + off * scales.double()).float(), np_).contiguous().numpy()
    elif bool((iw.zero == off).all()):
        mode = SYM
    else:
        mode = ZERO
        zq = _pad((iw.zero.to(torch.int32) - off).to(torch.int8), np_).contiguous().numpy()
    s = _scales(scales, np_)
    perm_np = None if perm is None else perm.to(torch.int64).contiguous().numpy()
    if planes:
        where = cpu_qgemm.idot_fast_path() or "portable C"
        return (QPacked(iw.bits, mode, k, n, gs, packed, s, zq, mo, perm_np, planes),
                f"int{iw.bits} integer-dot kernel ({where}, {activations} activations per "
                f"block, any number of rows)")
    where = "AVX-512 BF16" if cpu_qgemm.have_bf16() else "portable C"
    return (QPacked(iw.bits, mode, k, n, gs, packed, s, zq, mo, perm_np),
            f"int{iw.bits} bf16-dot kernel ({where}, bf16 activations, any number of rows)")


def _pack_vnni(q: torch.Tensor, bits: int, nb: int) -> np.ndarray:
    """``q [K, Np]`` (unsigned integers) in ``idot.h``'s layout: 64-byte units of 16 columns
    with four consecutive input rows per int32 lane (4 bits: rows ``i`` and ``i + 4`` of each
    8 in the low and high nibble), each column block K-major."""
    k = q.shape[0]
    if bits == 4:
        qp = q.reshape(k // 8, 2, 4, nb, COLS)                     # ku, half, i, jb, c
        units = qp[:, 0] | (qp[:, 1] << 4)                         # ku, i, jb, c
    else:
        units = q.reshape(k // 4, 4, nb, COLS)                     # ku, i, jb, c
    units = units.permute(2, 0, 3, 1)                              # jb, ku, c, i
    return units.contiguous().to(torch.uint8).numpy().reshape(-1)


def linear(x: torch.Tensor, w: QPacked, bias: torch.Tensor | None,
           portable: bool = False) -> torch.Tensor:
    """``x [M, K] @ W^T + bias`` with a packed weight; returns ``[M, N]`` in ``x.dtype``.
    ``portable`` forces the portable C loop (tests).

    Raises:
        ValueError: ``x`` not ``[M, K]``.
    """
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be [M, {w.in_features}], got {list(x.shape)}")
    x32 = x.to(torch.float32).contiguous()
    y = torch.empty(x.shape[0], w.out_features, dtype=torch.float32)
    b = None if bias is None else bias.float().contiguous().numpy()
    cpu_qgemm.qgemm(x32.numpy(), w, y.numpy(), b, False, portable)
    return y.to(x.dtype)


PREFILL_ROWS = 128
"""Rows from which :func:`prefill_linear` replaces :func:`linear` where it is on (CPUs with
AMX-BF16: its bfloat16 GEMM; the integer-dot kernel's AVX2 loop: its float32 GEMM).
Measured on SmolLM2-135M's projections (one thread, Sapphire Rapids class, 2026-12-03): the
integer-dot kernel runs ~2.2 ms per row for the 30 layers; the bf16 route costs ~200 ms of
dequantization per step plus ~0.22 ms per row, so it wins from ~100 rows."""

PREFILL_ROWS_AVX512_BF16 = 256
"""The same threshold for the bfloat16 GEMM on a CPU with AVX-512 BF16 but no AMX (oneDNN's
``vdpbf16ps`` kernel, about half AMX's rate per row against the VNNI integer-dot kernel).
Measured on SmolLM2-135M Q4_1 (one thread, AMD EPYC with AVX-512 VNNI/BF16, 2026-12-05,
median of 3 alternating rounds, whole prefill step): 128 tokens 436 (kernel) vs 330 (bf16)
tok/s, 256 tokens 435 vs 439, 512 tokens 360 vs 398, 1,450 tokens bf16 ~1.6x the kernel."""


def has_amx_bf16() -> bool:
    """True when the CPU has AMX-BF16 and the process may use its tiles (Linux asks the
    kernel for the tile state once, through torch): oneDNN's bf16 GEMM then runs on AMX
    tiles, ~8x float32's rate on one core here. Cached."""
    global _AMX
    if _AMX is None:
        flags = ""
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((ln for ln in f if ln.startswith("flags")), "")
        except OSError:
            pass
        init = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)
        _AMX = " amx_bf16" in flags and " amx_tile" in flags and bool(init and init())
    return _AMX


_AMX: bool | None = None


def dequantize_bf16(w: QPacked) -> torch.Tensor:
    """The packed weight as bfloat16 ``[N, K]`` in the original input order: each value
    exactly what :func:`linear` multiplies by (float32), rounded to nearest even
    (``qdequant.h``)."""
    out = np.empty((w.out_features, w.in_features), np.uint16)
    cpu_qgemm.dequant_bf16(w, out)
    return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)


def dequantize_f32(w: QPacked) -> torch.Tensor:
    """The packed weight as float32 ``[N, K]`` in the original input order: each value
    exactly what :func:`linear` multiplies by (``qdequant.h``)."""
    out = torch.empty(w.out_features, w.in_features, dtype=torch.float32)
    cpu_qgemm.dequant_f32(w, out.numpy())
    return out


PREFILL_DTYPES = ("bfloat16", "float32")
"""The GEMMs :func:`prefill_linear` can run."""


def prefill_linear(x: torch.Tensor, w: QPacked, bias: torch.Tensor | None,
                   dtype: str = "bfloat16") -> torch.Tensor:
    """``x [M, K] @ W^T + bias`` for many rows (prefill): the weight dequantized once per call,
    then one torch GEMM; returns ``[M, N]`` in ``x.dtype``.

    ``dtype`` ``bfloat16``: :func:`dequantize_bf16` and torch's bfloat16 GEMM (oneDNN; AMX
    tiles where the CPU has them) on ``bf16(x)``, float32 sums, the output rounded to bfloat16:
    against :func:`linear` this adds the weight's and the output's bfloat16 rounding (relative
    ``2^-9`` each); its perplexity cost is in ``benchmarks/README.md``. ``float32``:
    :func:`dequantize_f32` and torch's float32 GEMM on ``x`` as it is: the exact dequantized
    product (float32 sums), for CPUs whose integer-dot kernel is compute-bound at many rows
    (AVX2: ~1.4x the kernel's prefill speed on SmolLM2-135M, benchmarks/README.md).

    Raises:
        ValueError: ``x`` not ``[M, K]``, or ``dtype`` not in :data:`PREFILL_DTYPES`.
    """
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be [M, {w.in_features}], got {list(x.shape)}")
    if dtype == "bfloat16":
        y = (x.to(torch.bfloat16) @ dequantize_bf16(w).T).to(x.dtype)
    elif dtype == "float32":
        y = (x.float() @ dequantize_f32(w).T).to(x.dtype)
    else:
        raise ValueError(f"dtype must be one of {PREFILL_DTYPES}, got {dtype!r}")
    if bias is not None:
        y += bias.to(x.dtype)
    return y


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to bfloat16 (nearest even) and back to float32: what the kernel reads."""
    return x.float().to(torch.bfloat16).float()


def error_bound(x: torch.Tensor, iw: IntWeight, scales: torch.Tensor,
                mins: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's elementwise tolerance against the float64 product of ``bf16(x)`` with the
    exact weight, float64 ``[M, N]``: ``gamma_n * (|bf16(x)| @ A^T)`` with ``n = L + G + 3``
    (``L`` the group size, ``G`` the number of groups), ``gamma_n = n u / (1 - n u)``,
    ``u = 2^-24`` and ``A[n, k] = |s| (|q - o| + |z - o|)`` (integer zeros) or
    ``|s| |q - o| + |m + o s|`` (float minimums), ``o = 2^(bits-1)``: every product is
    exact, each sum a float32 sum of at most ``n`` terms."""
    k = iw.q.shape[0]
    gs = iw.group_size
    n_terms = gs + -(-k // gs) + 3
    u = 2.0 ** -24
    gamma = n_terms * u / (1 - n_terms * u)
    g = torch.arange(k) // gs if iw.g_idx is None else iw.g_idx
    off = 1 << (iw.bits - 1)
    s = scales.double()[g]                                          # [K, N]
    qa = (iw.q.double() - off).abs()
    if mins is None:
        a = s.abs() * (qa + (iw.zero.double()[g] - off).abs())
    else:
        a = s.abs() * qa + (mins.double()[g] + off * s).abs()
    return gamma * (round_bf16(x).double().abs() @ a)


def activation_block(group_size: int) -> int:
    """Inputs per activation block of the integer-dot kernel: the largest of 32, 16, 8, 4
    that divides ``group_size`` (so a block never crosses a weight group)."""
    return next(b for b in (32, 16, 8, 4) if group_size % b == 0)


def quantize_activations(x: torch.Tensor, group_size: int, planes: int,
                         perm: torch.Tensor | None = None) -> torch.Tensor:
    """What the integer-dot kernel reads for ``x [M, K]``: per block of
    :func:`activation_block` inputs, ``a = max|x| / T`` and ``v = round(x * (T / max|x|))``
    (float32 arithmetic, ties to even, ``T`` = 127 for one plane, 16383 for two), returned as
    float64 ``a v`` ``[M, K]`` — the reference the kernel's tests compare against (the
    kernel's integer sums are exact, so only its float32 block and group sums differ).
    ``perm``: the packed input order (act order, :func:`group_order`): blocks are taken in
    that order, the result is in ``x``'s.

    Raises:
        ValueError: ``planes`` not 1 or 2."""
    if planes not in (1, 2):
        raise ValueError(f"planes must be 1 or 2, got {planes}")
    if perm is not None:
        out = torch.empty(x.shape, dtype=torch.float64)
        out[:, perm] = quantize_activations(x[:, perm], group_size, planes)
        return out
    top = torch.tensor(127.0 if planes == 1 else 16383.0, dtype=torch.float32)
    m, k = x.shape
    ab = activation_block(group_size)
    out = torch.empty(m, k, dtype=torch.float64)
    x32 = x.float()
    for ks in range(0, k, ab):
        blk = x32[:, ks:ks + ab]
        amax = blk.abs().amax(dim=1, keepdim=True)
        inv = torch.where(amax > 0, top / amax, torch.zeros_like(amax))
        v = torch.round(blk * inv).clamp(-top, top)
        out[:, ks:ks + ab] = (amax / top).double() * v.double()
    return out


def idot_error_bound(x: torch.Tensor, iw: IntWeight, scales: torch.Tensor,
                     mins: torch.Tensor | None, planes: int) -> torch.Tensor:
    """The integer-dot kernel's elementwise tolerance against the float64 product of
    :func:`quantize_activations` with the exact weight, float64 ``[M, N]``:
    ``gamma_n * (|xq| @ A^T)`` with ``n = L / b + G + 4`` (``b`` the activation block, ``L``
    the group size, ``G`` the number of groups; ``A`` as in :func:`error_bound`): each
    block's integer sum is exact, its conversion to float32 rounds once, then float32 fused
    sums over the group's blocks and over the groups."""
    k = iw.q.shape[0]
    gs = iw.group_size
    n_terms = gs // activation_block(gs) + -(-k // gs) + 4
    u = 2.0 ** -24
    gamma = n_terms * u / (1 - n_terms * u)
    g = torch.arange(k) // gs if iw.g_idx is None else iw.g_idx
    off = 1 << (iw.bits - 1)
    s = scales.double()[g]
    qa = (iw.q.double() - off).abs()
    if mins is None:
        a = s.abs() * (qa + (iw.zero.double()[g] - off).abs())
    else:
        a = s.abs() * qa + (mins.double()[g] + off * s).abs()
    xq = quantize_activations(x, gs, planes, group_order(iw)[0])
    return gamma * (xq.abs() @ a)
