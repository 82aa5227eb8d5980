# cython: language_level=3
"""Quantized GEMM on the CPU with bfloat16 or integer dot products (the C code and its packed
layouts: ``qgemm.h`` and ``idot.h``; the packing: :mod:`nybble.kernels.cpu.qgemm_pack`).

``out [M, N] (+)= x [M, K] @ W^T (+ bias)``: ``x`` rounded to bfloat16 with float32 sums
(AVX-512 BF16), or quantized per block to 8-bit or 15-bit integers with exact int32 block
sums (AVX-512 VNNI), as the packed weight's ``planes`` says; the packed 4/8-bit weight is
streamed once per call; any ``M`` (decode batches and prefill).
Torch-free: callers pass numpy arrays. The GIL is released while the kernel runs.
"""
include "cpu_arrays.pxi"
include "qgemm_struct.pxi"
include "pool.pxi"

from libc.stdint cimport uint16_t

cdef extern from "qdequant.h" nogil:
    void nyb_qdequant_bf16(const nyb_qw *W, uint16_t *out, int64_t ldo)
    void nyb_qdequant_f32(const nyb_qw *W, float *out, int64_t ldo)

cnp.import_array()


def have_bf16() -> bool:
    """True when the CPU has AVX-512 BF16 (VDPBF16PS), which the fast path needs."""
    return bool(nyb_qg_cpu_bf16())


def have_vnni() -> bool:
    """True when the CPU has AVX-512 VNNI (VPDPBUSD), which the integer-dot fast path needs."""
    return bool(nyb_id_cpu_vnni())


def idot_fast_path() -> str | None:
    """Which fast loop the integer-dot kernel (``idot.h``) runs on this CPU: ``"AVX-512
    VNNI"`` (VPDPBUSD), ``"AVX2"`` (VPMADDUBSW + VPMADDWD, for CPUs without VNNI) or None
    (the portable C loop). All three give the same output bit for bit."""
    if nyb_id_cpu_vnni():
        return "AVX-512 VNNI"
    return "AVX2" if nyb_id_cpu_avx2() else None


def qgemm(const float[:, :] x, object packed, float[:, :] out, const float[::1] bias=None,
          bint accumulate=False, bint portable=False):
    """``out[:, :N] = (out if accumulate else 0) + x @ W^T + bias``.

    Args:
        x: ``[M, K]`` float32, unit stride along ``K``. packed: a ``QPacked``.
        out: ``[M, >= N]`` float32, unit stride along ``N``. bias: ``[N]`` float32 or None.
        accumulate: add to ``out`` instead of overwriting it. portable: the portable C loop
            even where AVX-512 BF16 exists (tests).

    Raises:
        ValueError: arrays that do not fit the packed weight.
        MemoryError: no memory for the rounded or quantized activations.
    """
    cdef nyb_qw W
    _fill_qw(&W, packed)
    cdef int64_t m = x.shape[0]
    if x.shape[1] != W.K:
        raise ValueError(f"x must be [M, {W.K}], got [{m}, {x.shape[1]}]")
    if out.shape[0] != m or out.shape[1] < W.N:
        raise ValueError(f"out must be [{m}, >= {W.N}], got [{out.shape[0]}, {out.shape[1]}]")
    if bias is not None and bias.shape[0] != W.N:
        raise ValueError(f"bias must have {W.N} entries, got {bias.shape[0]}")
    if m == 0:
        return
    if (W.K > 1 and x.strides[1] != sizeof(float)) or (W.N > 1 and out.strides[1] != sizeof(float)):
        raise ValueError("x and out need unit stride along their last dimension")
    cdef const float *b = NULL if bias is None else &bias[0]
    cdef int rc
    with nogil:
        rc = nyb_qgemm(&W, &x[0, 0], m, x.strides[0] // sizeof(float), &out[0, 0],
                       out.strides[0] // sizeof(float), b, accumulate, portable)
    if rc != 0:
        raise MemoryError("cpu_qgemm: no memory for the rounded or quantized activations")


cdef int _fill_for_dequant(nyb_qw *W, object packed, Py_ssize_t rows,
                           Py_ssize_t cols) except -1:
    """Point ``W`` at ``packed``; raise ValueError unless the output is ``[N, K]``."""
    _fill_qw(W, packed)
    if rows != W.N or cols != W.K:
        raise ValueError(f"out must be [{W.N}, {W.K}], got [{rows}, {cols}]")
    return 0


def dequant_bf16(object packed, uint16_t[:, ::1] out):
    """``out[n, k]`` = the packed weight's value ``W[n, k]`` (what :func:`qgemm` multiplies
    by: float32 ``s q``, ``s (q - zq)`` or ``s q + mo``) rounded to bfloat16 (nearest even),
    as bits, in the original input order (act order undone): torch's ``[N, K]`` Linear
    layout (``qdequant.h``). Column blocks run on this module's threads.

    Args:
        packed: a ``QPacked`` (either layout). out: ``[N, K]`` uint16, C-contiguous.

    Raises:
        ValueError: ``out`` is not ``[N, K]``.
    """
    cdef nyb_qw W
    _fill_for_dequant(&W, packed, out.shape[0], out.shape[1])
    with nogil:
        nyb_qdequant_bf16(&W, &out[0, 0], W.K)


def dequant_f32(object packed, float[:, ::1] out):
    """``out[n, k]`` = the packed weight's value ``W[n, k]`` in float32 (``s q``,
    ``s (q - zq)`` or ``s q + mo``, as :func:`dequant_bf16` before its rounding), original input
    order (act order undone), ``[N, K]``. Column blocks run on this module's threads.

    Raises:
        ValueError: ``out`` is not ``[N, K]``.
    """
    cdef nyb_qw W
    _fill_for_dequant(&W, packed, out.shape[0], out.shape[1])
    with nogil:
        nyb_qdequant_f32(&W, &out[0, 0], W.K)
