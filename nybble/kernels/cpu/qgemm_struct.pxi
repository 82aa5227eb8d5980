# The C view of a packed bf16-dot weight (qgemm.h), shared by qgemm.pyx and decoder.pyx
# (Cython `include`, after cpu_arrays.pxi): `_fill_qw` checks a `QPacked`'s arrays and points
# an nyb_qw at them (the caller keeps the object alive).

cdef extern from "qgemm.h" nogil:
    ctypedef struct nyb_qw:
        int bits, mode, s16, xq
        int64_t K, N, Np, group, G
        const uint8_t *w
        const void *s
        const int8_t *zq
        const float *mo
        const int64_t *perm
    int nyb_qgemm(const nyb_qw *W, const float *x, int64_t M, int64_t ldx, float *y,
                  int64_t ldy, const float *bias, int acc, int portable)
    int nyb_qg_cpu_bf16()
    int nyb_id_cpu_vnni()
    int nyb_id_cpu_avx2()


cdef int _fill_qw(nyb_qw *W, object p) except -1:
    """Point ``W`` at the arrays of ``p`` (a ``nybble.kernels.cpu.qgemm_pack.QPacked``)."""
    cdef int64_t k = p.in_features, n = p.out_features, gs = p.group_size
    if p.bits not in (4, 8) or p.mode not in (0, 1, 2):
        raise ValueError(f"bits must be 4 or 8 and mode 0/1/2, got {p.bits}, {p.mode}")
    cdef int unit = 8 if p.bits == 4 else 4
    if k % unit or gs % unit or gs < unit or n < 1:
        raise ValueError(f"K ({k}) and group_size ({gs}) must be positive multiples of {unit}")
    if p.planes not in (0, 1, 2):
        raise ValueError(f"planes must be 0 (bf16 activations), 1 or 2, got {p.planes}")
    W.bits, W.mode, W.K, W.N, W.group = p.bits, p.mode, k, n, gs
    W.xq = p.planes
    W.G = (k + gs - 1) // gs
    W.Np = (n + 15) // 16 * 16
    W.w = <const uint8_t *> _qarr(p.packed, np.uint8, (W.Np * k * p.bits // 8,), "packed")
    W.s16 = p.scales.dtype == np.uint16
    W.s = _qarr(p.scales, np.uint16 if W.s16 else np.float32, (W.G, W.Np), "scales")
    W.zq = <const int8_t *> (_qarr(p.zq, np.int8, (W.G, W.Np), "zq") if p.mode == 1 else NULL)
    W.mo = <const float *> (_qarr(p.mo, np.float32, (W.G, W.Np), "mo") if p.mode == 2 else NULL)
    W.perm = <const int64_t *> (NULL if p.perm is None else
                                _qarr(p.perm, np.int64, (k,), "perm"))
    return 0
