# cython: language_level=3
"""Weight-only INT4/INT8 GEMM on the CPU for decode-sized batches (the C code is
``wo_gemm.h``; its comment gives the packed layouts).

``y [M, N] = x [M, K] @ W^T`` with ``W[n, k] = s[g, n] * (q[k, n] - z[g, n])``, float32
(+ ``m[g, n]``, a float per-group minimum) activations and accumulation, the packed weight
read once per call whatever ``M`` (rows run in chunks of :data:`MAX_ROWS`). Torch-free: callers pass numpy arrays (``tensor.numpy()`` of CPU tensors,
which share memory). The GIL is released while the kernel runs.
"""
from libc.stdint cimport int64_t, int8_t, uint32_t


cdef extern from "wo_gemm.h" nogil:
    enum: NYB_COLS
    enum: NYB_MAX_ROWS
    ctypedef struct nyb_wo_weight:
        int bits
        int64_t K, N, Np, group, G
        const void *w
        const float *scales
        const float *zeros
        const float *mins
        const int64_t *perm
    int nyb_wo_gemm(const nyb_wo_weight *W, const float *x, int64_t M, int64_t ldx,
                    float *y, int64_t ldy, int force_portable)
    int nyb_wo_have_avx2()


COLS = NYB_COLS
"""Output columns per packed block (``N`` is padded to a multiple of it)."""
MAX_ROWS = NYB_MAX_ROWS
"""Rows (tokens) the kernel runs together over one block of weights (a call takes any number,
in chunks of this many)."""


def have_avx2() -> bool:
    """True when the CPU runs the AVX2+FMA version (else the portable C loop)."""
    return bool(nyb_wo_have_avx2())


def wo_gemm(const float[:, :] x, const unsigned char[::1] packed, int bits, int64_t n,
            int64_t group_size, const float[:, ::1] scales, const float[:, ::1] zeros,
            const int64_t[::1] perm, float[:, :] out, bint portable=False,
            const float[:, ::1] mins=None):
    """``out[:, :n] = x @ W^T`` for a weight packed by ``nybble.kernels.cpu.weight_only``.

    Args:
        x: ``[M, K]`` float32, ``M >= 1``, unit stride along ``K``.
        packed: the packed weight's bytes (``int4``: ``Np * K / 2``, ``int8``: ``Np * K``).
        bits: 4 or 8. n: output features ``N``. group_size: input rows per group
            (the last group may be shorter).
        scales, zeros: ``[G, Np]`` float32 (``G = ceil(K / group_size)``; for 8 bits the
            zeros are ``z - 128``). perm: ``[K]`` int64 input order (act order) or None.
        out: ``[M, >= N]`` float32, unit stride along ``N``; columns ``[0, N)`` written.
        portable: run the portable C loop even where AVX2 exists (tests).
        mins: ``[G, Np]`` float32 per-group minimums (``W = s (q - z) + m``) or None.

    Raises:
        ValueError: shapes that do not fit together, bits other than 4 or 8, or no rows.
        MemoryError: the kernel could not allocate its scratch space.
    """
    cdef int64_t m = x.shape[0], k = x.shape[1]
    if bits != 4 and bits != 8:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if m < 1:
        raise ValueError(f"x must have at least one row, got {m}")
    if group_size < 1:
        raise ValueError(f"group_size must be positive, got {group_size}")
    cdef int64_t np_ = scales.shape[1], g = (k + group_size - 1) // group_size
    if np_ % NYB_COLS or np_ < n or n < 1 or scales.shape[0] != g \
            or zeros.shape[0] != g or zeros.shape[1] != np_:
        raise ValueError(f"scales and zeros must be [{g}, Np] with Np >= N={n} a multiple of "
                         f"{NYB_COLS}, got {[scales.shape[0], scales.shape[1]]} and "
                         f"{[zeros.shape[0], zeros.shape[1]]}")
    if packed.shape[0] != np_ * k * bits // 8:
        raise ValueError(f"packed must hold {np_ * k * bits // 8} bytes for [{k}, {np_}] at "
                         f"{bits} bits, got {packed.shape[0]}")
    if mins is not None and (mins.shape[0] != g or mins.shape[1] != np_):
        raise ValueError(f"mins must be [{g}, {np_}], got {[mins.shape[0], mins.shape[1]]}")
    if perm is not None and perm.shape[0] != k:
        raise ValueError(f"perm must have {k} entries, got {perm.shape[0]}")
    if out.shape[0] != m or out.shape[1] < n:
        raise ValueError(f"out must be [{m}, >= {n}], got {[out.shape[0], out.shape[1]]}")
    if (k > 1 and x.strides[1] != sizeof(float)) or (n > 1 and out.strides[1] != sizeof(float)):
        raise ValueError("x and out need unit stride along their last dimension")
    cdef nyb_wo_weight w
    w.bits, w.K, w.N, w.Np, w.group, w.G = bits, k, n, np_, group_size, g
    w.w = <const void *> &packed[0]
    w.scales, w.zeros = &scales[0, 0], &zeros[0, 0]
    w.perm, w.mins = NULL, NULL
    if mins is not None:
        w.mins = &mins[0, 0]
    if perm is not None:
        w.perm = &perm[0]
    cdef int64_t ldx = x.strides[0] // sizeof(float), ldy = out.strides[0] // sizeof(float)
    cdef int rc
    with nogil:
        rc = nyb_wo_gemm(&w, &x[0, 0], m, ldx, &out[0, 0], ldy, portable)
    if rc != 0:
        raise MemoryError("cpu_wo_gemm: no memory for the kernel's scratch space")
