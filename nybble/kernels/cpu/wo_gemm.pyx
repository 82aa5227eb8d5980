# cython: language_level=3
"""Weight-only INT4/INT8 GEMM on the CPU for decode-sized batches (the C code is
``wo_gemm.h``; its comment gives the packed layouts).

``y [M, N] = x [M, K] @ W^T`` with ``W[n, k] = s[g, n] * (q[k, n] - z[g, n])``, float32
(+ ``m[g, n]``, a float per-group minimum) activations and accumulation, the packed weight
read once per call whatever ``M`` (rows run in chunks of :data:`MAX_ROWS`). Torch-free: callers pass numpy arrays (``tensor.numpy()`` of CPU tensors,
which share memory). The GIL is released while the kernel runs.
"""
include "cpu_arrays.pxi"
include "wo_struct.pxi"
include "pool.pxi"

cnp.import_array()


COLS = NYB_COLS
"""Output columns per packed block (``N`` is padded to a multiple of it)."""
MAX_ROWS = NYB_MAX_ROWS
"""Rows (tokens) the kernel runs together over one block of weights (a call takes any number,
in chunks of this many)."""


def have_avx2() -> bool:
    """True when the CPU runs the AVX2+FMA version (else the portable C loop)."""
    return bool(nyb_wo_have_avx2())


def wo_gemm(const float[:, :] x, object weight, float[:, :] out, bint portable=False):
    """``out[:, :N] = x @ W^T`` for a weight packed by ``nybble.kernels.cpu.weight_only``.

    Args:
        x: ``[M, K]`` float32, ``M >= 1``, unit stride along ``K``.
        weight: a ``CpuWeight`` (its arrays' layout: ``wo_gemm.h``).
        out: ``[M, >= N]`` float32, unit stride along ``N``; columns ``[0, N)`` written.
        portable: run the portable C loop even where AVX2 exists (tests).

    Raises:
        ValueError: arrays that do not fit the weight or each other, bits other than 4 or 8,
            or no rows.
        MemoryError: the kernel could not allocate its scratch space.
    """
    cdef nyb_wo_weight w
    _fill_wo(&w, weight)
    cdef int64_t m = x.shape[0]
    if m < 1:
        raise ValueError(f"x must have at least one row, got {m}")
    if x.shape[1] != w.K:
        raise ValueError(f"x must be [M, {w.K}], got [{m}, {x.shape[1]}]")
    if out.shape[0] != m or out.shape[1] < w.N:
        raise ValueError(f"out must be [{m}, >= {w.N}], got {[out.shape[0], out.shape[1]]}")
    if (w.K > 1 and x.strides[1] != sizeof(float)) or (w.N > 1 and out.strides[1] != sizeof(float)):
        raise ValueError("x and out need unit stride along their last dimension")
    cdef int64_t ldx = x.strides[0] // sizeof(float), ldy = out.strides[0] // sizeof(float)
    cdef int rc
    with nogil:
        rc = nyb_wo_gemm(&w, &x[0, 0], m, ldx, &out[0, 0], ldy, portable)
    if rc != 0:
        raise MemoryError("cpu_wo_gemm: no memory for the kernel's scratch space")
