/* Quantized GEMM for the CPU with integer dot products: y[M, N] (+)= x[M, K] @ W^T (+ b).
 *
 * The packed 4/8-bit weight is multiplied as integers by integer activations with AVX-512
 * VNNI's VPDPBUSD (four unsigned-byte x signed-byte products summed into each int32 lane, 64
 * products per instruction, no conversion of the weight), one float multiply-add per
 * activation block and 16 outputs.  The idea is llama.cpp's (ggml-cpu quantizes activations
 * per block of 32 to 8 bits, Q8_0/Q8_1, for its integer dots); the activation precision is a
 * choice here:
 *
 *   planes 1 ("int8"):  x ~ a_b * v, v = round(x / a_b) in [-127, 127], a_b = max|x| / 127
 *                       per block b — llama.cpp's Q8_0 activations (relative 2^-8 of the
 *                       block's largest value);
 *   planes 2 ("int16"): a_b = max|x| / 16383, v in [-16383, 16383] split as v = 256 h + l,
 *                       h in [-64, 64], l in [-128, 127], two int8 planes and two dots per
 *                       weight (relative 2^-15 of the block's largest value: finer than
 *                       bfloat16's 2^-9 of each value for all but values 64x below the max).
 *
 * Blocks are the largest of 32, 16, 8, 4 input rows dividing the weight's group (so a block
 * never crosses a group).  Per block the sum D = sum_k q[k, n] v[k] - o sum_k v[k] is exact in
 * int32 (q the stored unsigned integer, o = 2^(bits-1)); per group d = sum_b a_b D_b
 * (float32, fused multiply-adds in block order); then, as qgemm.h, y += s d (SYM),
 * s (d - zq sx) (ZERO) or s d + mo sx (MIN) with sx = sum_b a_b sum_k v[k] the group's sum of
 * the quantized activations.  The portable C loop does the same integer sums and the same
 * fused float operations in the same order, so its output equals the AVX-512 one bit for bit.
 *
 * Packed layout (qgemm_pack.py, layout "vnni"): output columns in blocks of 16 (one int32
 * lane each); 64-byte units, lane c = bytes 4c .. 4c + 3:
 *   4 bits: unit u of 8 input rows:
 *           byte 4c + i = q[8u + i, 16jb + c] | q[8u + 4 + i, 16jb + c] << 4
 *           (a mask gives rows 8u .. 8u+3 of all 16 columns, a shift and mask the next four);
 *   8 bits: unit u of 4 input rows: byte 4c + i = q[4u + i, 16jb + c] (unsigned, 0 .. 255).
 * Each column block is K-major: unit (jb, u) at byte 64 (U jb + u), U the units per column
 * block (a tile reads CB column blocks at once: CB sequential streams, which measured faster
 * from memory than one stream of the same units interleaved).
 * Scales, zq, mo and perm as qgemm.h.
 *
 * Prefetch: a tile's CB streams end where the next tile's begin, so the hardware prefetchers
 * (which do not cross 4 KiB pages) restart all CB streams at every tile.  Each unit load
 * therefore also prefetches the same unit of the next tile into L2 (one prefetch per 64-byte
 * line, the whole next tile in flight while this one computes): measured on SmolLM2's
 * projections at one row, ~6% less time (benchmarks/README.md).  The scales (and zq / mo)
 * are a second access pattern the hardware does not follow: a tile reads CB * 16 of them
 * from each of G rows Np apart, one row per group, an eighth as many bytes as the 4-bit
 * weight.  So each group's step also prefetches the next tile's row of that group: at one
 * row ~10% less time for SmolLM2's projections and its 8-bit head (benchmarks/README.md).
 */
#ifndef NYB_CPU_IDOT_H
#define NYB_CPU_IDOT_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Included by qgemm.h after nyb_qw and its helpers. */

/* The 64-byte unit u of column block jb. */
static inline const uint8_t *nyb_id_unit(const nyb_qw *W, int64_t jb, int64_t u) {
    return W->w + (jb * (W->bits == 4 ? W->K / 8 : W->K / 4) + u) * 64;
}

static inline int nyb_id_cpu_vnni(void) {
#ifdef NYB_X86_BF16
    static int have = -1;
    if (have < 0) {
        __builtin_cpu_init();
        have = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
               && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni")
               && __builtin_cpu_supports("fma");
    }
    return have;
#else
    return 0;
#endif
}

/* AVX2 + FMA + F16C: the integer-dot path without VNNI (VPMADDUBSW, see nyb_id2_tile). */
static inline int nyb_id_cpu_avx2(void) { return nyb_cpu_has_avx2_fma(); }

/* Activation block: the largest of 32, 16, 8, 4 that divides the group. */
static inline int64_t nyb_id_ablock(int64_t group) {
    return group % 32 == 0 ? 32 : group % 16 == 0 ? 16 : group % 8 == 0 ? 8 : 4;
}

/* The quantized activations of M rows: planes [M, K] int8 (xl NULL for one plane), per block
 * the scale a [M, NA] and o * sum v (osum [M, NA], int32), per group sx [M, G]. */
typedef struct {
    int planes;
    int64_t NA;
    int8_t *xh, *xl;
    float *a, *sx;
    int32_t *osum;
} nyb_idx;

/* Row m's per-group sums of the quantized activations, sx = sum_b a_b sum_k v[k] (fused
 * multiply-adds in block order), from X's a and osum. */
static inline __attribute__((always_inline)) void nyb_id_group_sums(const nyb_qw *W,
                                                                    nyb_idx *X, int64_t m) {
    const int64_t K = W->K, ab = nyb_id_ablock(W->group), NA = X->NA;
    const int o = 1 << (W->bits - 1);
    for (int64_t g = 0; g < W->G; g++) {
        const int64_t ge = (g + 1) * W->group < K ? (g + 1) * W->group : K;
        float t = 0.0f;
        for (int64_t b = g * W->group / ab; b < (ge + ab - 1) / ab; b++)
            t = fmaf(X->a[m * NA + b], (float)(X->osum[m * NA + b] / o), t);
        X->sx[m * W->G + g] = t;
    }
}

/* Quantize x [M, K] (row stride ldx; read through W->perm) into X (arrays allocated by the
 * caller). */
static void nyb_id_quantize(const nyb_qw *W, const float *x, int64_t M, int64_t ldx,
                            nyb_idx *X) {
    const int64_t K = W->K, ab = nyb_id_ablock(W->group), NA = X->NA;
    const int o = 1 << (W->bits - 1);
    const float top = X->planes == 1 ? 127.0f : 16383.0f;
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * ldx;
        int8_t *h = X->xh + m * K, *l = X->xl ? X->xl + m * K : NULL;
        for (int64_t b = 0; b < NA; b++) {
            const int64_t ks = b * ab, ke = ks + ab < K ? ks + ab : K;
            float amax = 0.0f;
            for (int64_t k = ks; k < ke; k++) {
                const float v = fabsf(W->perm ? xm[W->perm[k]] : xm[k]);
                amax = v > amax ? v : amax;
            }
            const float inv = amax > 0.0f ? top / amax : 0.0f;
            int32_t sum = 0;
            for (int64_t k = ks; k < ke; k++) {
                float f = rintf((W->perm ? xm[W->perm[k]] : xm[k]) * inv);
                f = f > top ? top : (f < -top ? -top : f);
                const int32_t v = (int32_t)f;
                sum += v;
                if (l) {
                    const int32_t hi = (v + 128) >> 8;   /* floor: l in [-128, 127] */
                    h[k] = (int8_t)hi;
                    l[k] = (int8_t)(v - 256 * hi);
                } else h[k] = (int8_t)v;
            }
            X->a[m * NA + b] = amax / top;
            X->osum[m * NA + b] = o * sum;
        }
        nyb_id_group_sums(W, X, m);
    }
}

/* The stored unsigned integer q of packed row k, column n (vnni layout). */
static inline int nyb_id_q(const nyb_qw *W, int64_t k, int64_t n) {
    const int64_t jb = n / NYB_QG_COLS, c = n % NYB_QG_COLS;
    if (W->bits == 4) {
        const uint8_t b = nyb_id_unit(W, jb, k / 8)[4 * c + (k % 4)];
        return (k % 8) < 4 ? (b & 0xf) : (b >> 4);
    }
    return nyb_id_unit(W, jb, k / 4)[4 * c + (k % 4)];
}

/* The group's contribution added to the running total t: fused as the AVX-512 code. */
static inline float nyb_id_combine(const nyb_qw *W, int64_t gi, float d, float sx, float t) {
    const float s = nyb_qg_scale(W, gi);
    if (W->mode == NYB_QG_ZERO) return fmaf(s, fmaf(-(float)W->zq[gi], sx, d), t);
    if (W->mode == NYB_QG_MIN) return fmaf(s, d, fmaf(W->mo[gi], sx, t));
    return fmaf(s, d, t);
}

static void nyb_id_portable(const nyb_qw *W, const nyb_idx *X, int64_t M, float *y,
                            int64_t ldy, const float *bias, int acc) {
    const int64_t K = W->K, ab = nyb_id_ablock(W->group), NA = X->NA;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < W->N; n++) {
            float tot = 0.0f;
            for (int64_t g = 0; g < W->G; g++) {
                const int64_t ks = g * W->group, ke = ks + W->group < K ? ks + W->group : K;
                float d = 0.0f;
                for (int64_t kb = ks; kb < ke; kb += ab) {
                    const int64_t kbe = kb + ab < ke ? kb + ab : ke;
                    int32_t sh = 0, sl = 0;
                    for (int64_t k = kb; k < kbe; k++) {
                        const int q = nyb_id_q(W, k, n);
                        sh += q * X->xh[m * K + k];
                        if (X->xl) sl += q * X->xl[m * K + k];
                    }
                    const int32_t D = (X->xl ? sh * 256 + sl : sh) - X->osum[m * NA + kb / ab];
                    d = fmaf(X->a[m * NA + kb / ab], (float)D, d);
                }
                tot = nyb_id_combine(W, g * W->Np + n, d, X->sx[m * W->G + g], tot);
            }
            float *out = y + m * ldy + n;
            float v = tot;
            if (bias) v = v + bias[n];
            if (acc) v = v + *out;
            *out = v;
        }
}

#ifdef NYB_X86_BF16
#define NYB_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma")))
#define NYB_ID_INLINE static inline __attribute__((always_inline)) NYB_VNNI_TARGET

/* nyb_id_quantize with AVX-512 (no perm): the same operations per element in the same order
 * (block absmax, x * (top / amax) rounded to nearest even, clamped, split into planes), 16
 * inputs a vector, so X is byte for byte the scalar loop's.  At 64 rows the scalar loop was
 * ~12% of the integer-dot GEMM time (perf, SmolLM2 Q4_0). */
static NYB_VNNI_TARGET void nyb_id_quantize_avx512(const nyb_qw *W, const float *x, int64_t M,
                                                   int64_t ldx, nyb_idx *X) {
    const int64_t K = W->K, ab = nyb_id_ablock(W->group), NA = X->NA;
    const int o = 1 << (W->bits - 1);
    const float top = X->planes == 1 ? 127.0f : 16383.0f;
    const __m512 vtop = _mm512_set1_ps(top), vntop = _mm512_set1_ps(-top);
    const __m512i c128 = _mm512_set1_epi32(128);
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * ldx;
        int8_t *h = X->xh + m * K, *l = X->xl ? X->xl + m * K : NULL;
        for (int64_t b = 0; b < NA; b++) {
            const int64_t ks = b * ab, ke = ks + ab < K ? ks + ab : K;
            __m512 vx[2];
            __mmask16 mk[2];
            const int nv = ke - ks > 16 ? 2 : 1;
            __m512 vmax = _mm512_setzero_ps();
            for (int i = 0; i < nv; i++) {
                const int64_t left = ke - ks - 16 * i;
                mk[i] = (__mmask16)(left >= 16 ? 0xffffu : (1u << left) - 1u);
                vx[i] = _mm512_maskz_loadu_ps(mk[i], xm + ks + 16 * i);
                vmax = _mm512_max_ps(vmax, _mm512_abs_ps(vx[i]));
            }
            const float amax = _mm512_reduce_max_ps(vmax);
            const float inv = amax > 0.0f ? top / amax : 0.0f;
            const __m512 vinv = _mm512_set1_ps(inv);
            __m512i vsum = _mm512_setzero_si512();
            for (int i = 0; i < nv; i++) {
                __m512 f = _mm512_roundscale_ps(_mm512_mul_ps(vx[i], vinv),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                f = _mm512_min_ps(_mm512_max_ps(f, vntop), vtop);
                const __m512i v = _mm512_cvttps_epi32(f);
                vsum = _mm512_add_epi32(vsum, v);
                if (l) {
                    const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(v, c128), 8);
                    const __m512i lo = _mm512_sub_epi32(v, _mm512_slli_epi32(hi, 8));
                    _mm512_mask_cvtepi32_storeu_epi8(h + ks + 16 * i, mk[i], hi);
                    _mm512_mask_cvtepi32_storeu_epi8(l + ks + 16 * i, mk[i], lo);
                } else _mm512_mask_cvtepi32_storeu_epi8(h + ks + 16 * i, mk[i], v);
            }
            X->a[m * NA + b] = amax / top;
            X->osum[m * NA + b] = o * _mm512_reduce_add_epi32(vsum);
        }
        nyb_id_group_sums(W, X, m);
    }
}

/* Prefetch unit u of column block jb into L2 when that block exists (see the header). */
NYB_ID_INLINE void nyb_id_prefetch(const nyb_qw *W, int64_t jb, int64_t u) {
    if (jb * NYB_QG_COLS < W->Np) _mm_prefetch((const char *)nyb_id_unit(W, jb, u), _MM_HINT_T1);
}

/* Prefetch into L2 every 64-byte line that bytes [p, e) touch. */
NYB_ID_INLINE void nyb_id_prefetch_bytes(const void *p, const void *e) {
    for (uintptr_t a = (uintptr_t)p & ~(uintptr_t)63; a < (uintptr_t)e; a += 64)
        _mm_prefetch((const char *)a, _MM_HINT_T1);
}

/* Prefetch into L2 group g's scales (and zq or mo) of column blocks jb .. jb + ncb - 1, those
 * that exist: one row of each [G, Np] array (see the header). */
NYB_ID_INLINE void nyb_id_prefetch_group(const nyb_qw *W, int64_t g, int64_t jb, int64_t ncb) {
    const int64_t n0 = jb * NYB_QG_COLS;
    if (n0 >= W->Np) return;
    const int64_t n1 = (jb + ncb) * NYB_QG_COLS < W->Np ? (jb + ncb) * NYB_QG_COLS : W->Np;
    const int64_t gi = g * W->Np;
    if (W->s16) nyb_id_prefetch_bytes((const uint16_t *)W->s + gi + n0,
                                      (const uint16_t *)W->s + gi + n1);
    else nyb_id_prefetch_bytes((const float *)W->s + gi + n0, (const float *)W->s + gi + n1);
    if (W->mode == NYB_QG_MIN) nyb_id_prefetch_bytes(W->mo + gi + n0, W->mo + gi + n1);
    else if (W->mode == NYB_QG_ZERO) nyb_id_prefetch_bytes(W->zq + gi + n0, W->zq + gi + n1);
}

NYB_ID_INLINE __m512i nyb_id_dot(__m512i acc, __m512i w, const int8_t *x4) {
    int32_t v;
    memcpy(&v, x4, 4);
    return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(v));
}

/* R rows (from m0) x CB column blocks (from jb0), all groups, P activation planes; the result
 * goes to the float32 tile yt [R][CB * 16] (which starts at zero).  ONE: a group is one
 * activation block (group 32, 16, 8 or 4), so d = a D is a product rather than a running sum
 * (the same value: fma(a, D, +0) rounds a D once) and d need not stay live, in registers,
 * through the block's dot products. */
NYB_ID_INLINE void nyb_id_tile(const nyb_qw *W, const nyb_idx *X, int64_t m0, int64_t jb0,
                               float *yt, const int R, const int CB, const int P,
                               const int ONE) {
    const int64_t K = W->K, ab = nyb_id_ablock(W->group), NA = X->NA;
    const __m512i mask = _mm512_set1_epi8(0x0f);
    __m512 tot[4][8];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int c = 0; c < CB; c++) tot[r][c] = _mm512_setzero_ps();
    for (int64_t g = 0; g < W->G; g++) {
        const int64_t ks = g * W->group, ke = ks + W->group < K ? ks + W->group : K;
        nyb_id_prefetch_group(W, g, jb0 + CB, CB);
        __m512 d[4][8];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
#pragma GCC unroll 8
            for (int c = 0; c < CB; c++) d[r][c] = _mm512_setzero_ps();
        for (int64_t kb = ks; kb < ke; kb += ab) {
            const int64_t kbe = kb + ab < ke ? kb + ab : ke, b = kb / ab;
            /* the offset sum o * sum v starts in s1, so D below needs no subtraction */
            __m512i s0[4][8], s1[4][8];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m512i nos = _mm512_set1_epi32(-X->osum[(m0 + r) * NA + b]);
#pragma GCC unroll 8
                for (int c = 0; c < CB; c++) {
                    s0[r][c] = _mm512_setzero_si512();
                    s1[r][c] = nos;
                }
            }
            if (W->bits == 4) {
                for (int64_t k = kb; k < kbe; k += 8) {
                    __m512i lo[8], hi[8];
#pragma GCC unroll 8
                    for (int c = 0; c < CB; c++) {
                        nyb_id_prefetch(W, jb0 + CB + c, k / 8);
                        const __m512i u = _mm512_loadu_si512(
                            (const void *)nyb_id_unit(W, jb0 + c, k / 8));
                        lo[c] = _mm512_and_si512(u, mask);
                        hi[c] = _mm512_and_si512(_mm512_srli_epi16(u, 4), mask);
                    }
#pragma GCC unroll 4
                    for (int r = 0; r < R; r++) {
                        const int8_t *xh = X->xh + (m0 + r) * K + k;
#pragma GCC unroll 8
                        for (int c = 0; c < CB; c++) {
                            if (P == 1) {
                                s0[r][c] = nyb_id_dot(s0[r][c], lo[c], xh);
                                s1[r][c] = nyb_id_dot(s1[r][c], hi[c], xh + 4);
                            } else {
                                const int8_t *xl = X->xl + (m0 + r) * K + k;
                                s0[r][c] = nyb_id_dot(nyb_id_dot(s0[r][c], lo[c], xh), hi[c],
                                                      xh + 4);
                                s1[r][c] = nyb_id_dot(nyb_id_dot(s1[r][c], lo[c], xl), hi[c],
                                                      xl + 4);
                            }
                        }
                    }
                }
            } else {
                for (int64_t k = kb; k < kbe; k += 4) {
                    __m512i u[8];
#pragma GCC unroll 8
                    for (int c = 0; c < CB; c++) {
                        nyb_id_prefetch(W, jb0 + CB + c, k / 4);
                        u[c] = _mm512_loadu_si512((const void *)nyb_id_unit(W, jb0 + c, k / 4));
                    }
#pragma GCC unroll 4
                    for (int r = 0; r < R; r++) {
                        const int8_t *xh = X->xh + (m0 + r) * K + k;
#pragma GCC unroll 8
                        for (int c = 0; c < CB; c++) {
                            s0[r][c] = nyb_id_dot(s0[r][c], u[c], xh);
                            if (P == 2)
                                s1[r][c] = nyb_id_dot(s1[r][c], u[c], X->xl + (m0 + r) * K + k);
                        }
                    }
                }
            }
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m512 a = _mm512_set1_ps(X->a[(m0 + r) * NA + b]);
#pragma GCC unroll 8
                for (int c = 0; c < CB; c++) {
                    const __m512i D = P == 1 ? _mm512_add_epi32(s0[r][c], s1[r][c])
                                             : _mm512_add_epi32(_mm512_slli_epi32(s0[r][c], 8),
                                                                s1[r][c]);
                    d[r][c] = ONE ? _mm512_mul_ps(a, _mm512_cvtepi32_ps(D))
                                  : _mm512_fmadd_ps(a, _mm512_cvtepi32_ps(D), d[r][c]);
                }
            }
        }
#pragma GCC unroll 8
        for (int c = 0; c < CB; c++) {
            const int64_t gi = g * W->Np + (jb0 + c) * NYB_QG_COLS;
            const __m512 s = W->s16 ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                          (const __m256i *)((const uint16_t *)W->s + gi)))
                                    : _mm512_loadu_ps((const float *)W->s + gi);
            __m512 extra = _mm512_setzero_ps();
            if (W->mode == NYB_QG_ZERO)
                extra = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm_loadu_si128((const __m128i *)(W->zq + gi))));
            else if (W->mode == NYB_QG_MIN) extra = _mm512_loadu_ps(W->mo + gi);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m512 sxg = _mm512_set1_ps(X->sx[(m0 + r) * W->G + g]);
                if (W->mode == NYB_QG_ZERO)
                    tot[r][c] = _mm512_fmadd_ps(s, _mm512_fnmadd_ps(extra, sxg, d[r][c]),
                                                tot[r][c]);
                else if (W->mode == NYB_QG_MIN)
                    tot[r][c] = _mm512_fmadd_ps(s, d[r][c],
                                                _mm512_fmadd_ps(extra, sxg, tot[r][c]));
                else tot[r][c] = _mm512_fmadd_ps(s, d[r][c], tot[r][c]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int c = 0; c < CB; c++) _mm512_storeu_ps(yt + (r * CB + c) * NYB_QG_COLS, tot[r][c]);
}

NYB_ID_INLINE void nyb_id_run(const nyb_qw *W, const nyb_idx *X, int64_t m0, int64_t jb0,
                              float *y, int64_t ldy, const float *bias, int acc, const int R,
                              const int CB, const int P) {
    float yt[4 * 8 * NYB_QG_COLS];
    if (nyb_id_ablock(W->group) == W->group) nyb_id_tile(W, X, m0, jb0, yt, R, CB, P, 1);
    else nyb_id_tile(W, X, m0, jb0, yt, R, CB, P, 0);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < CB; c++) {
            const int64_t n0 = (jb0 + c) * NYB_QG_COLS;
            if (n0 >= W->N) continue;
            const int cols = W->N - n0 < NYB_QG_COLS ? (int)(W->N - n0) : NYB_QG_COLS;
            const __mmask16 mk = (__mmask16)((1u << cols) - 1u);
            float *out = y + (m0 + r) * ldy + n0;
            __m512 v = _mm512_loadu_ps(yt + (r * CB + c) * NYB_QG_COLS);
            if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, bias + n0));
            if (acc) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, out));
            _mm512_mask_storeu_ps(out, mk, v);
        }
}

static NYB_VNNI_TARGET void nyb_id_step(const nyb_qw *W, const nyb_idx *X, int64_t m,
                                         int64_t jb, float *y, int64_t ldy, const float *bias,
                                         int acc, int R, int C) {
#define NYB_ID_CASE(RR, CC)                                                               \
    if (R == RR && C == CC) {                                                             \
        if (X->planes == 1) nyb_id_run(W, X, m, jb, y, ldy, bias, acc, RR, CC, 1);        \
        else nyb_id_run(W, X, m, jb, y, ldy, bias, acc, RR, CC, 2);                       \
        return;                                                                           \
    }
    NYB_ID_CASE(1, 8) NYB_ID_CASE(1, 4) NYB_ID_CASE(1, 2) NYB_ID_CASE(1, 1)
    NYB_ID_CASE(2, 4) NYB_ID_CASE(2, 2) NYB_ID_CASE(2, 1)
    NYB_ID_CASE(4, 2) NYB_ID_CASE(4, 1)
#undef NYB_ID_CASE
}

/* Column blocks jb_lo .. jb_hi of all M rows. */
static NYB_VNNI_TARGET void nyb_id_avx512(const nyb_qw *W, const nyb_idx *X, int64_t M,
                                           int64_t jb_lo, int64_t jb_hi, float *y,
                                           int64_t ldy, const float *bias, int acc) {
    const int rows_per = nyb_qg_tile_rows(M);
    const int64_t CB = nyb_qg_tile_cols(M);
    for (int64_t mb = 0; mb < M; mb += NYB_QG_MB) {
        const int64_t mend = M - mb < NYB_QG_MB ? M : mb + NYB_QG_MB;
        for (int64_t jb = jb_lo; jb < jb_hi; jb += CB) {
            const int64_t jend = jb_hi - jb < CB ? jb_hi : jb + CB;
            for (int64_t m = mb; m < mend;) {
                const int R = mend - m >= rows_per ? rows_per : (mend - m >= 2 ? 2 : 1);
                const int64_t most = R == 1 ? 8 : R == 2 ? 4 : 2;
                for (int64_t j = jb; j < jend;) {
                    const int64_t left = jend - j;
                    int C = left >= most ? (int)most : left >= 4 ? 4 : left >= 2 ? 2 : 1;
                    if (C > most) C = (int)most;
                    nyb_id_step(W, X, m, j, y, ldy, bias, acc, R, C);
                    j += C;
                }
                m += R;
            }
        }
    }
}
#endif

#ifdef NYB_X86_BF16
/* ---- AVX2 (no VNNI): the same integer sums with VPMADDUBSW + VPMADDWD -------------------
 *
 * VPMADDUBSW multiplies unsigned weight bytes by signed activation bytes and adds adjacent
 * pairs into int16 lanes with saturation; VPMADDWD by ones (or 16) then sums int16 pairs into
 * int32, so MADDUBS + MADDWD is one VPDPBUSD's four-product lane sum.  The products stay
 * exact because every weight operand is at most 15: a 4-bit unit's nibbles are used as they
 * are, an 8-bit weight is split into its two nibbles (q = 16 qh + ql, summed separately, qh's
 * sum weighted by 16 in VPMADDWD).  Activation bytes are in [-128, 127], so each int16 lane of
 * one VPMADDUBSW is at most 2 * 15 * 128 = 3840 in magnitude and the int16 sums of a whole
 * activation block (at most 32 input rows: 16 products per lane) at most 30720 < 2^15: the
 * lanes are added in int16 (no saturation reached) and widened once per block.  From there the
 * float steps are the AVX-512 tile's, in the same order, so the output equals the portable
 * loop's bit for bit.  A 64-byte unit is two 256-bit halves (columns 0-7 and 8-15 of its
 * 16-column block); a tile is R rows x H halves, its running totals kept in the caller's yt
 * (one load/store per group and half: AVX2 has 16 vector registers, not 32). */
#define NYB_ID2_TARGET __attribute__((target("avx2,fma,f16c")))
#define NYB_ID2_INLINE static inline __attribute__((always_inline)) NYB_ID2_TARGET

NYB_ID2_INLINE __m256i nyb_id2_bcast(const int8_t *x4) {
    int32_t v;
    memcpy(&v, x4, 4);
    return _mm256_set1_epi32(v);
}

/* The low and high nibbles (as bytes) of half hb's 32 bytes of 64-byte unit u. */
NYB_ID2_INLINE void nyb_id2_nibbles(const nyb_qw *W, int64_t hb, int64_t u, __m256i mask,
                                    __m256i *lo, __m256i *hi) {
    const __m256i v = _mm256_loadu_si256(
        (const __m256i *)(nyb_id_unit(W, hb / 2, u) + 32 * (hb % 2)));
    *lo = _mm256_and_si256(v, mask);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
}

/* R rows (from m0) x H halves (8 columns each, from half hb0 = columns 8 hb0 ..) into
 * yt [R][H * 8], which starts at zero; P activation planes. */
NYB_ID2_INLINE void nyb_id2_tile(const nyb_qw *W, const nyb_idx *X, int64_t m0, int64_t hb0,
                                 float *yt, const int R, const int H, const int P) {
    const int64_t K = W->K, ab = nyb_id_ablock(W->group), NA = X->NA;
    const __m256i mask = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi16(1),
                  sixteen = _mm256_set1_epi16(16);
    for (int64_t g = 0; g < W->G; g++) {
        const int64_t ks = g * W->group, ke = ks + W->group < K ? ks + W->group : K;
        __m256 d[4][4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int h = 0; h < H; h++) d[r][h] = _mm256_setzero_ps();
        for (int64_t kb = ks; kb < ke; kb += ab) {
            const int64_t kbe = kb + ab < ke ? kb + ab : ke, b = kb / ab;
            /* int16 block sums: [plane][nibble] (the nibble index only for 8-bit weights) */
            __m256i acc[4][4][2][2];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
#pragma GCC unroll 4
                for (int h = 0; h < H; h++)
                    acc[r][h][0][0] = acc[r][h][0][1] = acc[r][h][1][0] = acc[r][h][1][1] =
                        _mm256_setzero_si256();
            if (W->bits == 4 && R == 1) {
                /* one row: each half's nibbles feed its sums at once (fewer live registers) */
                for (int64_t k = kb; k < kbe; k += 8) {
                    __m256i x0[2], x1[2];
#pragma GCC unroll 2
                    for (int p = 0; p < P; p++) {
                        const int8_t *xp = (p == 0 ? X->xh : X->xl) + m0 * K + k;
                        x0[p] = nyb_id2_bcast(xp);
                        x1[p] = nyb_id2_bcast(xp + 4);
                    }
#pragma GCC unroll 4
                    for (int h = 0; h < H; h++) {
                        __m256i lo, hi;
                        nyb_id2_nibbles(W, hb0 + h, k / 8, mask, &lo, &hi);
#pragma GCC unroll 2
                        for (int p = 0; p < P; p++)
                            acc[0][h][p][0] = _mm256_add_epi16(
                                acc[0][h][p][0],
                                _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0[p]),
                                                 _mm256_maddubs_epi16(hi, x1[p])));
                    }
                }
            } else if (W->bits == 4) {
                for (int64_t k = kb; k < kbe; k += 8) {
                    __m256i lo[4], hi[4];
#pragma GCC unroll 4
                    for (int h = 0; h < H; h++)
                        nyb_id2_nibbles(W, hb0 + h, k / 8, mask, &lo[h], &hi[h]);
#pragma GCC unroll 4
                    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
                        for (int p = 0; p < P; p++) {
                            const int8_t *xp = (p == 0 ? X->xh : X->xl) + (m0 + r) * K + k;
                            const __m256i x0 = nyb_id2_bcast(xp), x1 = nyb_id2_bcast(xp + 4);
#pragma GCC unroll 4
                            for (int h = 0; h < H; h++)
                                acc[r][h][p][0] = _mm256_add_epi16(
                                    acc[r][h][p][0],
                                    _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], x0),
                                                     _mm256_maddubs_epi16(hi[h], x1)));
                        }
                }
            } else {
                for (int64_t k = kb; k < kbe; k += 4) {
                    __m256i lo[4], hi[4];
#pragma GCC unroll 4
                    for (int h = 0; h < H; h++)
                        nyb_id2_nibbles(W, hb0 + h, k / 4, mask, &lo[h], &hi[h]);
#pragma GCC unroll 4
                    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
                        for (int p = 0; p < P; p++) {
                            const __m256i x = nyb_id2_bcast(
                                (p == 0 ? X->xh : X->xl) + (m0 + r) * K + k);
#pragma GCC unroll 4
                            for (int h = 0; h < H; h++) {
                                acc[r][h][p][0] = _mm256_add_epi16(
                                    acc[r][h][p][0], _mm256_maddubs_epi16(lo[h], x));
                                acc[r][h][p][1] = _mm256_add_epi16(
                                    acc[r][h][p][1], _mm256_maddubs_epi16(hi[h], x));
                            }
                        }
                }
            }
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m256i os = _mm256_set1_epi32(X->osum[(m0 + r) * NA + b]);
                const __m256 a = _mm256_set1_ps(X->a[(m0 + r) * NA + b]);
#pragma GCC unroll 4
                for (int h = 0; h < H; h++) {
                    __m256i S[2];
#pragma GCC unroll 2
                    for (int p = 0; p < P; p++) {
                        S[p] = _mm256_madd_epi16(acc[r][h][p][0], one);
                        if (W->bits == 8)
                            S[p] = _mm256_add_epi32(
                                S[p], _mm256_madd_epi16(acc[r][h][p][1], sixteen));
                    }
                    __m256i D = P == 1 ? S[0] : _mm256_add_epi32(_mm256_slli_epi32(S[0], 8), S[1]);
                    D = _mm256_sub_epi32(D, os);
                    d[r][h] = _mm256_fmadd_ps(a, _mm256_cvtepi32_ps(D), d[r][h]);
                }
            }
        }
#pragma GCC unroll 4
        for (int h = 0; h < H; h++) {
            const int64_t gi = g * W->Np + 8 * (hb0 + h);
            const __m256 s = W->s16 ? _mm256_cvtph_ps(_mm_loadu_si128(
                                          (const __m128i *)((const uint16_t *)W->s + gi)))
                                    : _mm256_loadu_ps((const float *)W->s + gi);
            __m256 extra = _mm256_setzero_ps();
            if (W->mode == NYB_QG_ZERO)
                extra = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                    _mm_loadl_epi64((const __m128i *)(W->zq + gi))));
            else if (W->mode == NYB_QG_MIN) extra = _mm256_loadu_ps(W->mo + gi);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                float *tp = yt + (r * H + h) * 8;
                const __m256 sxg = _mm256_set1_ps(X->sx[(m0 + r) * W->G + g]);
                __m256 t = _mm256_loadu_ps(tp);
                if (W->mode == NYB_QG_ZERO)
                    t = _mm256_fmadd_ps(s, _mm256_fnmadd_ps(extra, sxg, d[r][h]), t);
                else if (W->mode == NYB_QG_MIN)
                    t = _mm256_fmadd_ps(s, d[r][h], _mm256_fmadd_ps(extra, sxg, t));
                else t = _mm256_fmadd_ps(s, d[r][h], t);
                _mm256_storeu_ps(tp, t);
            }
        }
    }
}

NYB_ID2_INLINE void nyb_id2_run(const nyb_qw *W, const nyb_idx *X, int64_t m0, int64_t hb0,
                                float *y, int64_t ldy, const float *bias, int acc, const int R,
                                const int H, const int P) {
    float yt[4 * 4 * 8];
    memset(yt, 0, sizeof(float) * (size_t)(R * H * 8));
    nyb_id2_tile(W, X, m0, hb0, yt, R, H, P);
    for (int r = 0; r < R; r++)
        for (int h = 0; h < H; h++) {
            const int64_t n0 = 8 * (hb0 + h);
            if (n0 >= W->N) continue;
            const float *t = yt + (r * H + h) * 8;
            float *out = y + (m0 + r) * ldy + n0;
            if (W->N - n0 >= 8) {
                __m256 v = _mm256_loadu_ps(t);
                if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n0));
                if (acc) v = _mm256_add_ps(v, _mm256_loadu_ps(out));
                _mm256_storeu_ps(out, v);
            } else {
                for (int64_t c = 0; c < W->N - n0; c++) {
                    float v = t[c];
                    if (bias) v = v + bias[n0 + c];
                    if (acc) v = v + out[c];
                    out[c] = v;
                }
            }
        }
}

static NYB_ID2_TARGET void nyb_id2_step(const nyb_qw *W, const nyb_idx *X, int64_t m,
                                        int64_t hb, float *y, int64_t ldy, const float *bias,
                                        int acc, int R) {
#define NYB_ID2_CASE(RR)                                                                  \
    if (R == RR) {                                                                        \
        if (X->planes == 1) nyb_id2_run(W, X, m, hb, y, ldy, bias, acc, RR, 2, 1);        \
        else nyb_id2_run(W, X, m, hb, y, ldy, bias, acc, RR, 2, 2);                       \
        return;                                                                           \
    }
    NYB_ID2_CASE(1) NYB_ID2_CASE(2) NYB_ID2_CASE(4)
#undef NYB_ID2_CASE
}

/* Column blocks jb_lo .. jb_hi of all M rows, one 16-column block (two halves) a tile by 1, 2
 * or 4 rows (nyb_qg_tile_rows; at most 2 for 8-bit weights with two activation planes, which
 * keep four int16 sums per row and half).  Measured on Zen 3 (SmolLM2-sized weights, 1, 4 and
 * 16 rows): two halves beat four for one row and one half for four rows; 8-bit int16 runs
 * ~10% faster at two rows than at four. */
static NYB_ID2_TARGET void nyb_id_avx2(const nyb_qw *W, const nyb_idx *X, int64_t M,
                                       int64_t jb_lo, int64_t jb_hi, float *y, int64_t ldy,
                                       const float *bias, int acc) {
    const int cap = W->bits == 8 && X->planes == 2 ? 2 : 4;
    const int rows_per = nyb_qg_tile_rows(M) > cap ? cap : nyb_qg_tile_rows(M);
    for (int64_t mb = 0; mb < M; mb += NYB_QG_MB) {
        const int64_t mend = M - mb < NYB_QG_MB ? M : mb + NYB_QG_MB;
        for (int64_t jb = jb_lo; jb < jb_hi; jb++)
            for (int64_t m = mb; m < mend;) {
                const int R = mend - m >= rows_per ? rows_per : (mend - m >= 2 ? 2 : 1);
                nyb_id2_step(W, X, m, 2 * jb, y, ldy, bias, acc, R);
                m += R;
            }
    }
}
#endif

#ifdef NYB_X86_BF16
typedef struct {
    const nyb_qw *W;
    const nyb_idx *X;
    int64_t M;
    float *y;
    int64_t ldy;
    const float *bias;
    int acc;
} nyb_id_job;

static void nyb_id_range(void *ctx, int64_t lo, int64_t hi) {
    const nyb_id_job *j = (const nyb_id_job *)ctx;
    nyb_id_avx512(j->W, j->X, j->M, lo, hi, j->y, j->ldy, j->bias, j->acc);
}

static void nyb_id2_range(void *ctx, int64_t lo, int64_t hi) {
    const nyb_id_job *j = (const nyb_id_job *)ctx;
    nyb_id_avx2(j->W, j->X, j->M, lo, hi, j->y, j->ldy, j->bias, j->acc);
}
#endif

/* y[M, N] (row stride ldy) = (acc ? y : 0) + x[M, K] (row stride ldx) @ W^T + bias with
 * W->xq planes of integer activations.  Returns 0, or -1 when memory runs out (y untouched). */
static int nyb_idgemm(const nyb_qw *W, const float *x, int64_t M, int64_t ldx, float *y,
                      int64_t ldy, const float *bias, int acc, int portable) {
    if (M < 1) return 0;
    nyb_idx X;
    X.planes = W->xq;
    X.NA = (W->K + nyb_id_ablock(W->group) - 1) / nyb_id_ablock(W->group);
    const size_t n8 = (size_t)(M * W->K);
    X.xh = (int8_t *)malloc(n8 * (size_t)X.planes + 64);
    X.a = (float *)malloc(sizeof(float) * (size_t)(M * (X.NA + W->G)));
    X.osum = (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * X.NA));
    if (X.xh == NULL || X.a == NULL || X.osum == NULL) {
        free(X.xh); free(X.a); free(X.osum);
        return -1;
    }
    X.xl = X.planes == 2 ? X.xh + n8 : NULL;
    X.sx = X.a + M * X.NA;
#ifdef NYB_X86_BF16
    if (!portable && W->perm == NULL && nyb_id_cpu_vnni()) nyb_id_quantize_avx512(W, x, M, ldx, &X);
    else
#endif
        nyb_id_quantize(W, x, M, ldx, &X);
#ifdef NYB_X86_BF16
    if (!portable && (nyb_id_cpu_vnni() || nyb_id_cpu_avx2())) {
        /* column blocks over the pool's threads (pool.h), a register tile's worth a chunk */
        nyb_id_job job = {W, &X, M, y, ldy, bias, acc};
        const int64_t Nb = W->Np / NYB_QG_COLS;
        nyb_parallel_for(Nb, nyb_pool_chunk(Nb, nyb_qg_tile_cols(M)),
                         nyb_id_cpu_vnni() ? nyb_id_range : nyb_id2_range, &job);
    } else
#endif
        nyb_id_portable(W, &X, M, y, ldy, bias, acc);
    free(X.xh); free(X.a); free(X.osum);
    return 0;
}

#endif
