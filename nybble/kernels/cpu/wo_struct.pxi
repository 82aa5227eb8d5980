# The C view of a packed weight-only weight (wo_gemm.h), shared by wo_gemm.pyx and
# decoder.pyx (Cython `include`, after cpu_arrays.pxi): `_fill_wo` checks a `CpuWeight`'s
# arrays and points an nyb_wo_weight at them (the caller keeps the object alive).

cdef extern from "wo_gemm.h" nogil:
    enum: NYB_COLS
    enum: NYB_MAX_ROWS
    ctypedef struct nyb_wo_weight:
        int bits, s16
        int64_t K, N, Np, group, G
        const void *w
        const void *scales
        const float *zeros
        float zero
        const void *mins
        const int64_t *perm
    int nyb_wo_gemm(const nyb_wo_weight *W, const float *x, int64_t M, int64_t ldx,
                    float *y, int64_t ldy, int force_portable)
    int nyb_wo_have_avx2()


cdef int _fill_wo(nyb_wo_weight *W, object p) except -1:
    """Point ``W`` at the arrays of ``p`` (a ``nybble.kernels.cpu.weight_only.CpuWeight``)."""
    cdef int64_t k = p.in_features, n = p.out_features, gs = p.group_size
    if p.bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {p.bits}")
    if gs < 1 or n < 1 or k < 1:
        raise ValueError(f"group_size, in and out features must be positive, got {gs}, {k}, {n}")
    W.bits, W.K, W.N, W.group = p.bits, k, n, gs
    W.G = (k + gs - 1) // gs
    W.Np = (n + NYB_COLS - 1) // NYB_COLS * NYB_COLS
    W.w = _qarr(p.packed, np.uint8, (W.Np * k * p.bits // 8,), "packed")
    W.s16 = p.scales.dtype == np.uint16
    sdt = np.uint16 if W.s16 else np.float32
    W.scales = _qarr(p.scales, sdt, (W.G, W.Np), "scales")
    W.zeros = <const float *> (NULL if p.zeros is None else
                               _qarr(p.zeros, np.float32, (W.G, W.Np), "zeros"))
    W.zero = p.zero
    W.mins = NULL if p.mins is None else _qarr(p.mins, sdt, (W.G, W.Np), "mins")
    W.perm = <const int64_t *> (NULL if p.perm is None else
                                _qarr(p.perm, np.int64, (k,), "perm"))
    return 0
