/* Weight-only INT4/INT8 GEMM for the CPU: y[M, N] = x[M, K] @ W^T, W dequantized on the fly.
 *
 * W[n, k] = s[g, n] * (q[k, n] - z[g, n]) (+ m[g, n]) with g = k / group (after the act-order
 * permutation that makes groups contiguous, applied to x here); the float per-group minimum m
 * is GGUF Q4_1/Q4_K/Q5_1/Q5_K's (y = d q + m), added as m * sum(x over the group).  float32 activations, float32
 * accumulation; the weight is read once per call in its packed form, which is what makes a
 * memory-bound decode step faster than with float32 weights.
 *
 * Packed layouts (written once at load by nybble/kernels/cpu/weight_only.py), N padded to a
 * multiple of NYB_COLS = 32 output columns ("Np"), blocks of 32 columns stored K-major so that
 * one call streams every block from start to end:
 *   int4: w4[(jb * K + k) * 4 + i]  uint32; nibble t (bits 4t..4t+3) is q[k, 32 jb + 8 i + t]
 *   int8: w8[(jb * K + k) * 32 + c] int8 = q[k, 32 jb + c] - 128
 *   scales[g * Np + n]: s, float32 or (s16) float16 bits when every scale is a float16 value;
 *   zeros[g * Np + n]: float32 z (int8: z - 128, so w = q8 - z'), or NULL when every zero is
 *   the one constant `zero` (symmetric types, float minimums);
 *   mins[g * Np + n]: m in the scales' dtype, or NULL (no minimum).
 * float16 scales and no zeros array keep the bytes streamed per weight near the packed
 * integers' own: 0.5625 per 4-bit weight at group 32, as GGUF Q4_0.
 *
 * Three ways through a block of 32 columns (rows in chunks of NYB_MAX_ROWS):
 *   2 <= M <= NYB_DIRECT_ROWS: each unpacked weight vector feeds the sums of a pair of rows
 *           (and a last single row), then y += s * (acc - z * sum_k x) per row;
 *   M == 1: the integers times x are summed per group, then y += s * (acc - z * sum_k x):
 *           unpack (shift, mask, convert) and one FMA per 8 weights.
 *   more rows: a group of the block is unpacked once to float (q - z) in a scratch tile, then
 *           every row of x runs FMAs over it (rows in threes: 12 accumulators).
 * An x86-64 AVX2+FMA version is chosen at run time when the CPU has it; the portable C loop
 * computes the same sums in the same order otherwise.
 */
#ifndef NYB_CPU_WO_GEMM_H
#define NYB_CPU_WO_GEMM_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_features.h"
#include "pool.h"
#ifdef NYB_X86_AVX2
#include <immintrin.h>
#endif

#define NYB_COLS 32
#define NYB_MAX_ROWS 16
#define NYB_DIRECT_ROWS 4   /* up to this many rows: no tile (each unpacked vector feeds all) */

typedef struct {
    int bits;              /* 4 or 8 */
    int s16;               /* scales and mins are float16 bits */
    int64_t K, N, Np, group, G;
    const void *w;         /* packed weight, layout above */
    const void *scales;    /* [G, Np] float32 or float16 bits */
    const float *zeros;    /* [G, Np] or NULL: every zero is `zero` */
    float zero;
    const void *mins;      /* [G, Np] like scales, or NULL */
    const int64_t *perm;   /* [K] input order (act order) or NULL */
} nyb_wo_weight;

static inline float nyb_wo_f(const nyb_wo_weight *W, const void *a, int64_t i) {
    return W->s16 ? nyb_half_float(((const uint16_t *)a)[i]) : ((const float *)a)[i];
}

/* Scale, zero and minimum (0 when none) of group-column index gi = g * Np + n. */
static inline float nyb_wo_scale(const nyb_wo_weight *W, int64_t gi) {
    return nyb_wo_f(W, W->scales, gi);
}
static inline float nyb_wo_zero(const nyb_wo_weight *W, int64_t gi) {
    return W->zeros ? W->zeros[gi] : W->zero;
}
static inline float nyb_wo_min(const nyb_wo_weight *W, int64_t gi) {
    return W->mins ? nyb_wo_f(W, W->mins, gi) : 0.0f;
}

/* The 32 scales, zeros and minimums of group g, column block jb, as float32 (portable). */
static void nyb_wo_group(const nyb_wo_weight *W, int64_t g, int64_t jb, float *s, float *z,
                         float *m) {
    const int64_t gi = g * W->Np + jb * NYB_COLS;
    for (int c = 0; c < NYB_COLS; c++) {
        s[c] = nyb_wo_scale(W, gi + c);
        z[c] = nyb_wo_zero(W, gi + c);
        m[c] = nyb_wo_min(W, gi + c);
    }
}

/* The integer q[k, 32 jb + c] of a packed block (portable path). */
static inline float nyb_q(const nyb_wo_weight *W, int64_t jb, int64_t k, int c) {
    if (W->bits == 4) {
        const uint32_t *w = (const uint32_t *)W->w + (jb * W->K + k) * 4;
        return (float)((w[c >> 3] >> (4 * (c & 7))) & 0xFu);
    }
    return (float)((const int8_t *)W->w)[(jb * W->K + k) * NYB_COLS + c];
}

/* Portable path: the same per-column sums as the AVX2 one, in the same order. */
static void nyb_block_portable(const nyb_wo_weight *W, const float *x, const float *xs,
                               int64_t M, int64_t jb, float *yt, float *tile) {
    const int64_t K = W->K, group = W->group;
    float s[NYB_COLS], z[NYB_COLS], mb[NYB_COLS];
    const float *mn = W->mins ? mb : NULL;
    for (int64_t g = 0; g < W->G; g++) {
        const int64_t ks = g * group, ke = ks + group < K ? ks + group : K;
        nyb_wo_group(W, g, jb, s, z, mb);
        if (M == 1) {   /* even and odd k summed apart, then added (as the AVX2 loop) */
            float acc[NYB_COLS] = {0}, odd[NYB_COLS] = {0};
            int64_t k = ks;
            for (; k + 2 <= ke; k += 2)
                for (int c = 0; c < NYB_COLS; c++) {
                    acc[c] += x[k] * nyb_q(W, jb, k, c);
                    odd[c] += x[k + 1] * nyb_q(W, jb, k + 1, c);
                }
            for (; k < ke; k++)
                for (int c = 0; c < NYB_COLS; c++) acc[c] += x[k] * nyb_q(W, jb, k, c);
            for (int c = 0; c < NYB_COLS; c++) acc[c] += odd[c];
            for (int c = 0; c < NYB_COLS; c++) {
                yt[c] += s[c] * (acc[c] - z[c] * xs[g]);
                if (mn) yt[c] += mn[c] * xs[g];
            }
            continue;
        }
        if (M <= NYB_DIRECT_ROWS) {   /* per row: sum x q, then the zero and the minimum */
            for (int64_t m = 0; m < M; m++) {
                float acc[NYB_COLS] = {0};
                const float xg = xs[m * W->G + g];
                for (int64_t k = ks; k < ke; k++)
                    for (int c = 0; c < NYB_COLS; c++) acc[c] += x[m * K + k] * nyb_q(W, jb, k, c);
                for (int c = 0; c < NYB_COLS; c++) {
                    yt[m * NYB_COLS + c] += s[c] * (acc[c] - z[c] * xg);
                    if (mn) yt[m * NYB_COLS + c] += mn[c] * xg;
                }
            }
            continue;
        }
        for (int64_t k = ks; k < ke; k++)
            for (int c = 0; c < NYB_COLS; c++)
                tile[(k - ks) * NYB_COLS + c] = nyb_q(W, jb, k, c) - z[c];
        for (int64_t m = 0; m < M; m++) {
            float acc[NYB_COLS] = {0};
            for (int64_t k = ks; k < ke; k++)
                for (int c = 0; c < NYB_COLS; c++)
                    acc[c] += x[m * K + k] * tile[(k - ks) * NYB_COLS + c];
            for (int c = 0; c < NYB_COLS; c++) {
                yt[m * NYB_COLS + c] += s[c] * acc[c];
                if (mn) yt[m * NYB_COLS + c] += mn[c] * xs[m * W->G + g];
            }
        }
    }
}

#ifdef NYB_X86_AVX2
#define NYB_AVX2 __attribute__((target("avx2,fma,f16c")))

/* nyb_wo_group with F16C conversions. */
static inline NYB_AVX2 void nyb_wo_group_avx2(const nyb_wo_weight *W, int64_t g, int64_t jb,
                                              float *s, float *z, float *m) {
    const int64_t gi = g * W->Np + jb * NYB_COLS;
    for (int i = 0; i < NYB_COLS; i += 8) {
        if (W->s16) {
            _mm256_storeu_ps(s + i, _mm256_cvtph_ps(_mm_loadu_si128(
                (const __m128i *)((const uint16_t *)W->scales + gi + i))));
            if (W->mins) _mm256_storeu_ps(m + i, _mm256_cvtph_ps(_mm_loadu_si128(
                (const __m128i *)((const uint16_t *)W->mins + gi + i))));
        } else {
            _mm256_storeu_ps(s + i, _mm256_loadu_ps((const float *)W->scales + gi + i));
            if (W->mins) _mm256_storeu_ps(m + i, _mm256_loadu_ps((const float *)W->mins + gi + i));
        }
        _mm256_storeu_ps(z + i, W->zeros ? _mm256_loadu_ps(W->zeros + gi + i)
                                         : _mm256_set1_ps(W->zero));
    }
}

/* Eight integers of row k for columns 8 i .. 8 i + 7 of the block, as float. */
static inline NYB_AVX2 __m256 nyb_unpack4(const uint32_t *wk, int i, __m256i shifts,
                                          __m256i mask) {
    __m256i v = _mm256_set1_epi32((int)wk[i]);
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(v, shifts), mask));
}

static inline NYB_AVX2 __m256 nyb_unpack8(const int8_t *wk, int i) {
    __m128i b = _mm_loadl_epi64((const __m128i *)(wk + 8 * i));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

/* yt[r, :] += s * (x[r, :L] @ tile[L, 32]) (+ mn * xs[r * G]) for ROWS rows (a constant after
 * inlining, so the 4 * ROWS accumulators stay in registers); mn NULL: no minimum. */
static inline __attribute__((always_inline)) NYB_AVX2 void nyb_rows_avx2(
        const float *tile, int64_t L, const float *x, int64_t ldx, const float *s,
        const float *mn, const float *xs, int64_t G, float *yt, const int ROWS) {
    __m256 acc[3][4];
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < L; k++) {
        const float *tk = tile + k * NYB_COLS;
        const __m256 t0 = _mm256_loadu_ps(tk), t1 = _mm256_loadu_ps(tk + 8);
        const __m256 t2 = _mm256_loadu_ps(tk + 16), t3 = _mm256_loadu_ps(tk + 24);
        for (int r = 0; r < ROWS; r++) {
            const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
            acc[r][0] = _mm256_fmadd_ps(t0, xv, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(t1, xv, acc[r][1]);
            acc[r][2] = _mm256_fmadd_ps(t2, xv, acc[r][2]);
            acc[r][3] = _mm256_fmadd_ps(t3, xv, acc[r][3]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < 4; i++) {
            float *y = yt + r * NYB_COLS + 8 * i;
            __m256 v = _mm256_fmadd_ps(_mm256_loadu_ps(s + 8 * i), acc[r][i], _mm256_loadu_ps(y));
            if (mn) v = _mm256_fmadd_ps(_mm256_loadu_ps(mn + 8 * i), _mm256_set1_ps(xs[r * G]), v);
            _mm256_storeu_ps(y, v);
        }
}

/* Rows 0 .. R (R = 1 or 2) of x (row stride K) over inputs ks .. ke of one column block,
 * without a tile: each unpacked weight vector feeds the R rows' sums (4 R accumulators); then per row
 * yt += s * (acc - z * xs) (+ mn * xs).  R is a constant after inlining. */
static inline __attribute__((always_inline)) NYB_AVX2 void nyb_direct_avx2(
        const nyb_wo_weight *W, const uint32_t *w4, const int8_t *w8, const float *x,
        int64_t K, int64_t ks, int64_t ke, const float *s, const float *z, const float *mn,
        const float *xs, int64_t G, float *yt, __m256i shifts, __m256i mask, const int R) {
    __m256 acc[2][4];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = _mm256_setzero_ps();
    if (W->bits == 4) {
        for (int64_t k = ks; k < ke; k++) {
            __m256 xv[2];
            for (int r = 0; r < R; r++) xv[r] = _mm256_broadcast_ss(x + r * K + k);
            for (int i = 0; i < 4; i++) {
                const __m256 q = nyb_unpack4(w4 + k * 4, i, shifts, mask);
                for (int r = 0; r < R; r++) acc[r][i] = _mm256_fmadd_ps(q, xv[r], acc[r][i]);
            }
        }
    } else {
        for (int64_t k = ks; k < ke; k++) {
            __m256 xv[2];
            for (int r = 0; r < R; r++) xv[r] = _mm256_broadcast_ss(x + r * K + k);
            for (int i = 0; i < 4; i++) {
                const __m256 q = nyb_unpack8(w8 + k * NYB_COLS, i);
                for (int r = 0; r < R; r++) acc[r][i] = _mm256_fmadd_ps(q, xv[r], acc[r][i]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        const __m256 xsg = _mm256_set1_ps(xs[r * G]);
        for (int i = 0; i < 4; i++) {
            float *y = yt + r * NYB_COLS + 8 * i;
            const __m256 t = _mm256_fnmadd_ps(_mm256_loadu_ps(z + 8 * i), xsg, acc[r][i]);
            __m256 v = _mm256_fmadd_ps(_mm256_loadu_ps(s + 8 * i), t, _mm256_loadu_ps(y));
            if (mn) v = _mm256_fmadd_ps(_mm256_loadu_ps(mn + 8 * i), xsg, v);
            _mm256_storeu_ps(y, v);
        }
    }
}

static NYB_AVX2 void nyb_block_avx2(const nyb_wo_weight *W, const float *x, const float *xs,
                                    int64_t M, int64_t jb, float *yt, float *tile) {
    const int64_t K = W->K, group = W->group;
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i mask = _mm256_set1_epi32(0xF);
    const uint32_t *w4 = (const uint32_t *)W->w + jb * K * 4;
    const int8_t *w8 = (const int8_t *)W->w + jb * K * NYB_COLS;
    float s[NYB_COLS], z[NYB_COLS], mb[NYB_COLS];
    const float *mn = W->mins ? mb : NULL;
    for (int64_t g = 0; g < W->G; g++) {
        const int64_t ks = g * group, ke = ks + group < K ? ks + group : K;
        nyb_wo_group_avx2(W, g, jb, s, z, mb);
        if (M == 1) {
            /* two sets of four sums (even and odd k), so eight FMA chains hide the FMA
             * latency; added together at the end of the group */
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            int64_t k = ks;
            if (W->bits == 4) {
                for (; k + 2 <= ke; k += 2) {
                    const __m256 xv = _mm256_broadcast_ss(x + k), xw = _mm256_broadcast_ss(x + k + 1);
                    const uint32_t *wk = w4 + k * 4, *wl = wk + 4;
                    a0 = _mm256_fmadd_ps(nyb_unpack4(wk, 0, shifts, mask), xv, a0);
                    a1 = _mm256_fmadd_ps(nyb_unpack4(wk, 1, shifts, mask), xv, a1);
                    a2 = _mm256_fmadd_ps(nyb_unpack4(wk, 2, shifts, mask), xv, a2);
                    a3 = _mm256_fmadd_ps(nyb_unpack4(wk, 3, shifts, mask), xv, a3);
                    b0 = _mm256_fmadd_ps(nyb_unpack4(wl, 0, shifts, mask), xw, b0);
                    b1 = _mm256_fmadd_ps(nyb_unpack4(wl, 1, shifts, mask), xw, b1);
                    b2 = _mm256_fmadd_ps(nyb_unpack4(wl, 2, shifts, mask), xw, b2);
                    b3 = _mm256_fmadd_ps(nyb_unpack4(wl, 3, shifts, mask), xw, b3);
                }
                for (; k < ke; k++) {
                    const __m256 xv = _mm256_broadcast_ss(x + k);
                    const uint32_t *wk = w4 + k * 4;
                    a0 = _mm256_fmadd_ps(nyb_unpack4(wk, 0, shifts, mask), xv, a0);
                    a1 = _mm256_fmadd_ps(nyb_unpack4(wk, 1, shifts, mask), xv, a1);
                    a2 = _mm256_fmadd_ps(nyb_unpack4(wk, 2, shifts, mask), xv, a2);
                    a3 = _mm256_fmadd_ps(nyb_unpack4(wk, 3, shifts, mask), xv, a3);
                }
            } else {
                for (; k + 2 <= ke; k += 2) {
                    const __m256 xv = _mm256_broadcast_ss(x + k), xw = _mm256_broadcast_ss(x + k + 1);
                    const int8_t *wk = w8 + k * NYB_COLS, *wl = wk + NYB_COLS;
                    a0 = _mm256_fmadd_ps(nyb_unpack8(wk, 0), xv, a0);
                    a1 = _mm256_fmadd_ps(nyb_unpack8(wk, 1), xv, a1);
                    a2 = _mm256_fmadd_ps(nyb_unpack8(wk, 2), xv, a2);
                    a3 = _mm256_fmadd_ps(nyb_unpack8(wk, 3), xv, a3);
                    b0 = _mm256_fmadd_ps(nyb_unpack8(wl, 0), xw, b0);
                    b1 = _mm256_fmadd_ps(nyb_unpack8(wl, 1), xw, b1);
                    b2 = _mm256_fmadd_ps(nyb_unpack8(wl, 2), xw, b2);
                    b3 = _mm256_fmadd_ps(nyb_unpack8(wl, 3), xw, b3);
                }
                for (; k < ke; k++) {
                    const __m256 xv = _mm256_broadcast_ss(x + k);
                    const int8_t *wk = w8 + k * NYB_COLS;
                    a0 = _mm256_fmadd_ps(nyb_unpack8(wk, 0), xv, a0);
                    a1 = _mm256_fmadd_ps(nyb_unpack8(wk, 1), xv, a1);
                    a2 = _mm256_fmadd_ps(nyb_unpack8(wk, 2), xv, a2);
                    a3 = _mm256_fmadd_ps(nyb_unpack8(wk, 3), xv, a3);
                }
            }
            const __m256 xsg = _mm256_set1_ps(xs[g]);
            __m256 acc[4] = {_mm256_add_ps(a0, b0), _mm256_add_ps(a1, b1), _mm256_add_ps(a2, b2),
                             _mm256_add_ps(a3, b3)};
            for (int i = 0; i < 4; i++) {
                __m256 t = _mm256_fnmadd_ps(_mm256_loadu_ps(z + 8 * i), xsg, acc[i]);
                __m256 v = _mm256_fmadd_ps(_mm256_loadu_ps(s + 8 * i), t,
                                           _mm256_loadu_ps(yt + 8 * i));
                if (mn) v = _mm256_fmadd_ps(_mm256_loadu_ps(mn + 8 * i), xsg, v);
                _mm256_storeu_ps(yt + 8 * i, v);
            }
            continue;
        }
        if (M <= NYB_DIRECT_ROWS) {   /* rows in pairs (12 sums would spill registers) */
            for (int64_t m0 = 0; m0 < M;) {
                const int64_t left = M - m0;
                const float *xr = x + m0 * K, *sr = xs + m0 * W->G + g;
                float *yr = yt + m0 * NYB_COLS;
                if (left >= 2) {
                    nyb_direct_avx2(W, w4, w8, xr, K, ks, ke, s, z, mn, sr, W->G, yr, shifts, mask, 2);
                    m0 += 2;
                } else {
                    nyb_direct_avx2(W, w4, w8, xr, K, ks, ke, s, z, mn, sr, W->G, yr, shifts, mask, 1);
                    m0 += 1;
                }
            }
            continue;
        }
        for (int64_t k = ks; k < ke; k++) {
            float *tk = tile + (k - ks) * NYB_COLS;
            for (int i = 0; i < 4; i++) {
                __m256 q = W->bits == 4 ? nyb_unpack4(w4 + k * 4, i, shifts, mask)
                                        : nyb_unpack8(w8 + k * NYB_COLS, i);
                _mm256_storeu_ps(tk + 8 * i, _mm256_sub_ps(q, _mm256_loadu_ps(z + 8 * i)));
            }
        }
        int64_t m0 = 0;
        for (; m0 + 3 <= M; m0 += 3) nyb_rows_avx2(tile, ke - ks, x + m0 * K + ks, K, s, mn,
                                                   xs + m0 * W->G + g, W->G,
                                                   yt + m0 * NYB_COLS, 3);
        for (; m0 < M; m0++) nyb_rows_avx2(tile, ke - ks, x + m0 * K + ks, K, s, mn,
                                           xs + m0 * W->G + g, W->G, yt + m0 * NYB_COLS, 1);
    }
}
#endif

static int nyb_have_avx2(void) { return nyb_cpu_has_avx2_fma(); }

typedef struct {
    const nyb_wo_weight *W;
    const float *xp, *xs;
    int64_t M;
    float *y;
    int64_t ldy;
    int avx2, failed;
} nyb_wo_job;

/* Column blocks lo .. hi of all rows, with this chunk's own scratch (the dequantized group
 * tile and the output tile). */
static void nyb_wo_range(void *ctx, int64_t lo, int64_t hi) {
    nyb_wo_job *j = (nyb_wo_job *)ctx;
    const nyb_wo_weight *W = j->W;
    const int64_t K = W->K, M = j->M;
    float *tile = (float *)malloc(sizeof(float) * (size_t)(W->group * NYB_COLS
                                                           + NYB_MAX_ROWS * NYB_COLS));
    if (tile == NULL) {
        __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    float *yt = tile + W->group * NYB_COLS;
    for (int64_t jb = lo; jb < hi; jb++) {
        const int64_t n0 = jb * NYB_COLS;
        const int64_t cols = W->N - n0 < NYB_COLS ? W->N - n0 : NYB_COLS;
        for (int64_t m0 = 0; m0 < M; m0 += NYB_MAX_ROWS) {
            const int64_t rows = M - m0 < NYB_MAX_ROWS ? M - m0 : NYB_MAX_ROWS;
            memset(yt, 0, sizeof(float) * (size_t)(rows * NYB_COLS));
#ifdef NYB_X86_AVX2
            if (j->avx2) nyb_block_avx2(W, j->xp + m0 * K, j->xs + m0 * W->G, rows, jb, yt, tile);
            else
#endif
            nyb_block_portable(W, j->xp + m0 * K, j->xs + m0 * W->G, rows, jb, yt, tile);
            for (int64_t m = 0; m < rows; m++)
                memcpy(j->y + (m0 + m) * j->ldy + n0, yt + m * NYB_COLS,
                       sizeof(float) * (size_t)cols);
        }
    }
    free(tile);
}

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W^T, any M >= 1.  Each block of 32
 * output columns runs over the rows in chunks of NYB_MAX_ROWS while it is in cache, so the
 * packed weight is read from memory once per call; the blocks are spread over the module's
 * pool.h threads (each block computed the same way on any thread: results do not depend on
 * the thread count).  Returns 0, or -1 when M < 1 or memory runs out (y may then be partly
 * written).  force_portable: 1 takes the portable C loop even where AVX2 exists (tests
 * compare the two). */
static int nyb_wo_gemm(const nyb_wo_weight *W, const float *x, int64_t M, int64_t ldx,
                       float *y, int64_t ldy, int force_portable) {
    if (M < 1) return -1;
    const int64_t K = W->K;
    float *xp = (float *)malloc(sizeof(float) * (size_t)(M * K + M * W->G));
    if (xp == NULL) return -1;
    float *xs = xp + M * K;
    for (int64_t m = 0; m < M; m++) {   /* x in the weight's row order, then group sums */
        const float *xm = x + m * ldx;
        float *d = xp + m * K;
        if (W->perm) for (int64_t k = 0; k < K; k++) d[k] = xm[W->perm[k]];
        else memcpy(d, xm, sizeof(float) * (size_t)K);
        for (int64_t g = 0; g < W->G; g++) {
            const int64_t ks = g * W->group, ke = ks + W->group < K ? ks + W->group : K;
            float t = 0.0f;
            for (int64_t k = ks; k < ke; k++) t += d[k];
            xs[m * W->G + g] = t;
        }
    }
    nyb_wo_job job = {W, xp, xs, M, y, ldy, !force_portable && nyb_have_avx2(), 0};
    const int64_t Nb = W->Np / NYB_COLS;
    nyb_parallel_for(Nb, nyb_pool_chunk(Nb, 2), nyb_wo_range, &job);
    free(xp);
    return job.failed ? -1 : 0;
}

static int nyb_wo_have_avx2(void) { return nyb_have_avx2(); }

#endif
