/* Quantized GEMM for the CPU with bfloat16 dot products: y[M, N] (+)= x[M, K] @ W^T (+ b).
 *
 * The weight stays packed (4 or 8 bits per value) and is streamed once per call; the
 * activations are rounded to bfloat16 (round to nearest even) once per call and the products
 * are summed in float32 by AVX-512 BF16's VDPBF16PS (two bf16 products per float32 lane and
 * instruction).  Every weight integer is exactly representable in bfloat16, so the only
 * rounding beyond float32 summation is that of x (relative 2^-9 per element) — far finer than
 * the 8-bit per-block activation quantization of llama.cpp's integer dot products
 * (ggml-cpu's Q8_0/Q8_1 activations), which is what keeps greedy outputs of small models
 * intact.  Weight form, per group g of `group` input rows and output column n:
 *
 *     W[n, k] = s[g, n] * (q[k, n] - o)                   mode SYM   (o = 2^(bits-1))
 *     W[n, k] = s[g, n] * (q[k, n] - o - zq[g, n])        mode ZERO  (zq int8 = z - o)
 *     W[n, k] = s[g, n] * (q[k, n] - o) + mo[g, n]        mode MIN   (mo f32 = m + o s)
 *
 * so that per group the kernel sums d = x . (q - o) in float32 and adds s * d (SYM),
 * s * (d - zq * sx) (ZERO) or s * d + mo * sx (MIN), where sx is the sum of the group's
 * rounded x.  GPTQ/AWQ integer zero points are ZERO (SYM when symmetric), GGUF Q4_1/Q4_K's
 * float minimum is MIN (y = q s + m), Q4_0/Q8_0 are SYM.
 *
 * Packed layout (nybble/kernels/cpu/qgemm_pack.py writes it): output columns in blocks of 16
 * (one float32 lane each, N padded to Np = 16 Nb), each block K-major:
 *   4 bits: 16-bit words w16[((jb * K/8) + ko) * 32 + j] for each 8 input rows ko: nibble t
 *           (bits 4t .. 4t+3) of word j is q[8 ko + 2 t + j % 2, 16 jb + j / 2] — one 64-byte
 *           load gives four vectors of bf16 pairs, each unpacked by a shift and a lookup;
 *   8 bits: w[((jb * K/2) + kp) * 32 + b] = q - 128 (int8) with, for b < 16, column
 *           16 jb + b / 2 and for b >= 16 column 16 jb + 8 + (b - 16) / 2, input row
 *           2 kp + b % 2 (the order VCVTNE2PS2BF16 interleaves two float vectors in).
 *   s: [G, Np] float16 (s16 = 1, when every scale is a float16 value) or float32;
 *   zq: [G, Np] int8 or NULL; mo: [G, Np] float32 or NULL; perm: [K] input order or NULL
 *   (act order: the packed rows are sorted by group, x is read through perm).
 * K and group must be multiples of 8 (4 bits) or 4 (8 bits); the last group may be shorter.
 *
 * Loop nest: rows in blocks of NYB_QG_MB (x's bf16 copy stays in L2), then pairs of column
 * blocks, then register tiles of 1-4 rows x 2-4 column blocks; each unpacked weight vector
 * feeds every row of the tile.  4-bit values become bf16 by one VPERMW lookup of the nibble
 * in a 16-entry table of bf16(q - o).  A portable C loop computes the same sums in the same
 * order for CPUs without AVX-512 BF16 (and for tests); the caller prefers the float32
 * weight-only kernel (cpu_wo_gemm.h) there, which is faster without bf16 hardware.
 *
 * A weight packed with xq = 1 or 2 (idot.h's layout) takes idot.h's integer-dot kernel
 * instead: nyb_qgemm dispatches on it, so the fused decoder needs no second entry point.
 */
#ifndef NYB_CPU_QGEMM_H
#define NYB_CPU_QGEMM_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_features.h"
#include "pool.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define NYB_X86_BF16 1
#include <immintrin.h>
#endif

#define NYB_QG_COLS 16
#define NYB_QG_MB 64
enum { NYB_QG_SYM = 0, NYB_QG_ZERO = 1, NYB_QG_MIN = 2 };

typedef struct {
    int bits, mode, s16;
    int xq;                 /* 0: bf16 activations (this file's layout); 1 or 2: int8 planes
                             * of integer activations (idot.h's layout) */
    int64_t K, N, Np, group, G;
    const uint8_t *w;
    const void *s;          /* [G, Np] float16 bits (s16) or float32 */
    const int8_t *zq;       /* [G, Np] (ZERO) */
    const float *mo;        /* [G, Np] (MIN) */
    const int64_t *perm;    /* [K] or NULL */
} nyb_qw;

static inline int nyb_qg_cpu_bf16(void) {
#ifdef NYB_X86_BF16
    static int have = -1;
    if (have < 0) {
        __builtin_cpu_init();
        have = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
               && __builtin_cpu_supports("avx512bf16");
    }
    return have;
#else
    return 0;
#endif
}

/* float -> bfloat16 bits, round to nearest even (as VCVTNEPS2BF16 for finite values). */
static inline uint16_t nyb_bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) return (uint16_t)((u >> 16) | ((u & 0xffff) ? 0x40 : 0));
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float nyb_bf16_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float nyb_qg_scale(const nyb_qw *W, int64_t i) {
    return W->s16 ? nyb_half_float(((const uint16_t *)W->s)[i]) : ((const float *)W->s)[i];
}

/* Register tiles of both GEMMs: rows per tile for M rows (4, 2 or 1) and column blocks per
 * tile (8 for one row, 4 for two: enough independent sums and memory streams to hide the dot
 * instruction's latency; 2 for four rows, each loaded weight vector then feeding four rows).
 * A tile's columns are also the pool's natural chunk. */
static inline int nyb_qg_tile_rows(int64_t M) { return M >= 4 ? 4 : M >= 2 ? 2 : 1; }
static inline int64_t nyb_qg_tile_cols(int64_t M) {
    const int r = nyb_qg_tile_rows(M);
    return r == 1 ? 8 : r == 2 ? 4 : 2;
}

#include "idot.h"

/* The integer q - o of packed row k, column n. */
static inline int nyb_qg_q(const nyb_qw *W, int64_t k, int64_t n) {
    if (W->xq) return nyb_id_q(W, k, n) - (1 << (W->bits - 1));
    const int64_t jb = n / NYB_QG_COLS, c = n % NYB_QG_COLS;
    if (W->bits == 4) {
        const uint16_t *blk = (const uint16_t *)W->w + (jb * (W->K / 8) + k / 8) * 32;
        const int r = (int)(k % 8);
        return (int)((blk[2 * c + (r & 1)] >> (4 * (r / 2))) & 0xf) - 8;
    }
    const int8_t *blk = (const int8_t *)W->w + (jb * (W->K / 2) + k / 2) * 32;
    const int b = (c < 8 ? 2 * (int)c : 16 + 2 * (int)(c - 8)) + (int)(k & 1);
    return blk[b];
}

/* out[k] = W[n, k] for k < K: one output feature's weights dequantized (a packed token
 * embedding's row n), in the original input order (act order undone). */
static inline void nyb_qg_row(const nyb_qw *W, int64_t n, float *out) {
    for (int64_t k = 0; k < W->K; k++) {
        const int64_t gi = (k / W->group) * W->Np + n;
        const float s = nyb_qg_scale(W, gi), q = (float)nyb_qg_q(W, k, n);
        float v;
        if (W->mode == NYB_QG_ZERO) v = s * (q - (float)W->zq[gi]);
        else if (W->mode == NYB_QG_MIN) v = s * q + W->mo[gi];
        else v = s * q;
        out[W->perm ? W->perm[k] : k] = v;
    }
}

/* Each row of x rounded to bf16 (in the weight's row order) and the per-group sums of the
 * rounded values: xb [M, K] bf16 bits, sx [M, G]. */
static void nyb_qg_round(const nyb_qw *W, const float *x, int64_t M, int64_t ldx,
                         uint16_t *xb, float *sx) {
    const int64_t K = W->K;
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * ldx;
        uint16_t *d = xb + m * K;
        if (W->perm) for (int64_t k = 0; k < K; k++) d[k] = nyb_bf16_bits(xm[W->perm[k]]);
        else for (int64_t k = 0; k < K; k++) d[k] = nyb_bf16_bits(xm[k]);
        for (int64_t g = 0; g < W->G; g++) {
            const int64_t ks = g * W->group, ke = ks + W->group < K ? ks + W->group : K;
            float t = 0.0f;
            for (int64_t k = ks; k < ke; k++) t += nyb_bf16_float(d[k]);
            sx[m * W->G + g] = t;
        }
    }
}

/* The group's contribution to y from its sum d: s d, s (d - zq sx) or s d + mo sx. */
static inline float nyb_qg_combine(const nyb_qw *W, int64_t gi, float d, float sx) {
    const float s = nyb_qg_scale(W, gi);
    if (W->mode == NYB_QG_ZERO) return s * (d - (float)W->zq[gi] * sx);
    if (W->mode == NYB_QG_MIN) return s * d + W->mo[gi] * sx;
    return s * d;
}

/* Portable path: per output, per group, d summed over k pairs in order (as VDPBF16PS adds
 * a pair's two products, then the running sum). */
static void nyb_qg_portable(const nyb_qw *W, const uint16_t *xb, const float *sx, int64_t M,
                            float *y, int64_t ldy, const float *bias, int acc) {
    const int64_t K = W->K;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < W->N; n++) {
            float tot = 0.0f;
            for (int64_t g = 0; g < W->G; g++) {
                const int64_t ks = g * W->group, ke = ks + W->group < K ? ks + W->group : K;
                float d = 0.0f;
                for (int64_t k = ks; k < ke; k += 2) {
                    const float p0 = nyb_bf16_float(xb[m * K + k]) * (float)nyb_qg_q(W, k, n);
                    const float p1 = nyb_bf16_float(xb[m * K + k + 1])
                                     * (float)nyb_qg_q(W, k + 1, n);
                    d += p0 + p1;
                }
                tot += nyb_qg_combine(W, g * W->Np + n, d, sx[m * W->G + g]);
            }
            float *out = y + m * ldy + n;
            *out = (acc ? *out : 0.0f) + tot + (bias ? bias[n] : 0.0f);
        }
}

#ifdef NYB_X86_BF16
#define NYB_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))
#define NYB_QG_INLINE static inline __attribute__((always_inline)) NYB_BF16_TARGET

/* The four vectors of bf16 pairs (q - 8) of a 4-bit unit of 8 input rows (qgemm.h's
 * layout): a shift and one VPERMW lookup each (VPERMW reads 5 index bits; the table repeats
 * every 16 entries, so the nibbles above need no mask). */
NYB_QG_INLINE void nyb_qg_load4(const uint8_t *p, __m512i table, __m512i v[4]) {
    const __m512i u = _mm512_loadu_si512((const void *)p);
    v[0] = _mm512_permutexvar_epi16(u, table);
    v[1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(u, 4), table);
    v[2] = _mm512_permutexvar_epi16(_mm512_srli_epi16(u, 8), table);
    v[3] = _mm512_permutexvar_epi16(_mm512_srli_epi16(u, 12), table);
}

NYB_QG_INLINE __m512i nyb_qg_load8(const int8_t *p) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128((const __m128i *)(p + 16))));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

NYB_QG_INLINE __m512 nyb_qg_dot(__m512 acc, __m512i w, const uint16_t *xpair) {
    int32_t pair;
    memcpy(&pair, xpair, 4);
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_set1_epi32(pair));
}

NYB_QG_INLINE __m512 nyb_qg_scales(const nyb_qw *W, int64_t i) {
    if (W->s16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)W->s + i)));
    return _mm512_loadu_ps((const float *)W->s + i);
}

/* One register tile: R rows (xb rows m0.., sx rows) x CB column blocks from jb0, all groups;
 * adds the result to the float32 tile yt [R][CB * 16]. R and CB are constants after inlining. */
NYB_QG_INLINE void nyb_qg_tile(const nyb_qw *W, const uint16_t *xb, const float *sx,
                               int64_t jb0, float *yt, const int R, const int CB) {
    const int64_t K = W->K;
    const __m512i table = _mm512_set_epi16(
        0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000,
        (short)0xbf80, (short)0xc000, (short)0xc040, (short)0xc080, (short)0xc0a0,
        (short)0xc0c0, (short)0xc0e0, (short)0xc100,
        0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000,
        (short)0xbf80, (short)0xc000, (short)0xc040, (short)0xc080, (short)0xc0a0,
        (short)0xc0c0, (short)0xc0e0, (short)0xc100);   /* bf16(q - 8), q = 15 .. 0 */
    for (int64_t g = 0; g < W->G; g++) {
        const int64_t ks = g * W->group, ke = ks + W->group < K ? ks + W->group : K;
        __m512 acc[4][8][2];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
#pragma GCC unroll 8
            for (int c = 0; c < CB; c++) acc[r][c][0] = acc[r][c][1] = _mm512_setzero_ps();
        if (W->bits == 4) {
            for (int64_t k = ks; k < ke; k += 8) {
                __m512i wv[8][4];
#pragma GCC unroll 8
                for (int c = 0; c < CB; c++)
                    nyb_qg_load4(W->w + ((jb0 + c) * (K / 8) + k / 8) * 64, table, wv[c]);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const uint16_t *xr = xb + r * K + k;
#pragma GCC unroll 8
                    for (int c = 0; c < CB; c++) {
                        acc[r][c][0] = nyb_qg_dot(acc[r][c][0], wv[c][0], xr);
                        acc[r][c][1] = nyb_qg_dot(acc[r][c][1], wv[c][1], xr + 2);
                        acc[r][c][0] = nyb_qg_dot(acc[r][c][0], wv[c][2], xr + 4);
                        acc[r][c][1] = nyb_qg_dot(acc[r][c][1], wv[c][3], xr + 6);
                    }
                }
            }
        } else {
            for (int64_t k = ks; k < ke; k += 4) {
                __m512i wa[8], wb[8];
#pragma GCC unroll 4
                for (int c = 0; c < CB; c++) {
                    const int8_t *p = (const int8_t *)W->w + ((jb0 + c) * (K / 2) + k / 2) * 32;
                    wa[c] = nyb_qg_load8(p);
                    wb[c] = nyb_qg_load8(p + 32);
                }
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const uint16_t *xr = xb + r * K + k;
#pragma GCC unroll 4
                    for (int c = 0; c < CB; c++) {
                        acc[r][c][0] = nyb_qg_dot(acc[r][c][0], wa[c], xr);
                        acc[r][c][1] = nyb_qg_dot(acc[r][c][1], wb[c], xr + 2);
                    }
                }
            }
        }
        for (int c = 0; c < CB; c++) {
            const int64_t gi = g * W->Np + (jb0 + c) * NYB_QG_COLS;
            const __m512 s = nyb_qg_scales(W, gi);
            __m512 extra = _mm512_setzero_ps();
            if (W->mode == NYB_QG_ZERO)
                extra = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm_loadu_si128((const __m128i *)(W->zq + gi))));
            else if (W->mode == NYB_QG_MIN) extra = _mm512_loadu_ps(W->mo + gi);
            for (int r = 0; r < R; r++) {
                float *yr = yt + (r * CB + c) * NYB_QG_COLS;
                const __m512 d = _mm512_add_ps(acc[r][c][0], acc[r][c][1]);
                const __m512 sxg = _mm512_set1_ps(sx[r * W->G + g]);
                __m512 v;
                if (W->mode == NYB_QG_ZERO) v = _mm512_mul_ps(s, _mm512_fnmadd_ps(extra, sxg, d));
                else if (W->mode == NYB_QG_MIN) v = _mm512_fmadd_ps(s, d, _mm512_mul_ps(extra, sxg));
                else v = _mm512_mul_ps(s, d);
                _mm512_storeu_ps(yr, _mm512_add_ps(_mm512_loadu_ps(yr), v));
            }
        }
    }
}

/* Rows m0 .. m0 + R of the row block, column blocks jb0 .. jb0 + CB: tile, then write out. */
NYB_QG_INLINE void nyb_qg_run(const nyb_qw *W, const uint16_t *xb, const float *sx,
                              int64_t jb0, float *y, int64_t ldy, const float *bias, int acc,
                              const int R, const int CB) {
    float yt[4 * 8 * NYB_QG_COLS];
    memset(yt, 0, sizeof(float) * (size_t)(R * CB * NYB_QG_COLS));
    nyb_qg_tile(W, xb, sx, jb0, yt, R, CB);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < CB; c++) {
            const int64_t n0 = (jb0 + c) * NYB_QG_COLS;
            if (n0 >= W->N) continue;
            const int cols = W->N - n0 < NYB_QG_COLS ? (int)(W->N - n0) : NYB_QG_COLS;
            const __mmask16 mk = (__mmask16)((1u << cols) - 1u);
            float *out = y + r * ldy + n0;
            __m512 v = _mm512_loadu_ps(yt + (r * CB + c) * NYB_QG_COLS);
            if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, bias + n0));
            if (acc) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, out));
            _mm512_mask_storeu_ps(out, mk, v);
        }
}

/* One tile of R rows x C column blocks with R, C constants of the instantiation. */
static NYB_BF16_TARGET void nyb_qg_step(const nyb_qw *W, const uint16_t *xr, const float *sr,
                                         int64_t jb, float *yr, int64_t ldy, const float *bias,
                                         int acc, int R, int C) {
#define NYB_QG_CASE(RR, CC) \
    if (R == RR && C == CC) { nyb_qg_run(W, xr, sr, jb, yr, ldy, bias, acc, RR, CC); return; }
    NYB_QG_CASE(1, 8) NYB_QG_CASE(1, 4) NYB_QG_CASE(1, 2) NYB_QG_CASE(1, 1)
    NYB_QG_CASE(2, 4) NYB_QG_CASE(2, 2) NYB_QG_CASE(2, 1)
    NYB_QG_CASE(4, 2) NYB_QG_CASE(4, 1)
#undef NYB_QG_CASE
}

static NYB_BF16_TARGET void nyb_qg_avx512(const nyb_qw *W, const uint16_t *xb, const float *sx,
                                           int64_t M, int64_t jb_lo, int64_t jb_hi,
                                           float *y, int64_t ldy, const float *bias, int acc) {
    const int64_t K = W->K, G = W->G;
    const int rows_per = nyb_qg_tile_rows(M);
    const int64_t CB = nyb_qg_tile_cols(M);
    for (int64_t mb = 0; mb < M; mb += NYB_QG_MB) {
        const int64_t mend = M - mb < NYB_QG_MB ? M : mb + NYB_QG_MB;
        for (int64_t jb = jb_lo; jb < jb_hi; jb += CB) {
            const int64_t jend = jb_hi - jb < CB ? jb_hi : jb + CB;
            for (int64_t m = mb; m < mend;) {
                const int R = mend - m >= rows_per ? rows_per : (mend - m >= 2 ? 2 : 1);
                for (int64_t j = jb; j < jend;) {
                    const int64_t left = jend - j, most = R == 1 ? 8 : R == 2 ? 4 : 2;
                    const int C = left >= most ? (int)most : left >= 4 ? 4 : left >= 2 ? 2 : 1;
                    nyb_qg_step(W, xb + m * K, sx + m * G, j, y + m * ldy, ldy, bias, acc, R,
                                C > most ? (int)most : C);
                    j += C > most ? most : C;
                }
                m += R;
            }
        }
    }
}

typedef struct {
    const nyb_qw *W;
    const uint16_t *xb;
    const float *sx;
    int64_t M;
    float *y;
    int64_t ldy;
    const float *bias;
    int acc;
} nyb_qg_job;

static void nyb_qg_range(void *ctx, int64_t lo, int64_t hi) {   /* column blocks lo .. hi */
    const nyb_qg_job *j = (const nyb_qg_job *)ctx;
    nyb_qg_avx512(j->W, j->xb, j->sx, j->M, lo, hi, j->y, j->ldy, j->bias, j->acc);
}
#endif

/* y[M, N] (row stride ldy) = (acc ? y : 0) + x[M, K] (row stride ldx) @ W^T + bias, the
 * column blocks spread over pool.h's threads.
 * Returns 0, or -1 when memory runs out (y untouched).  portable: 1 takes the portable C
 * loop even where AVX-512 BF16 exists (tests compare the two). */
static int nyb_qgemm(const nyb_qw *W, const float *x, int64_t M, int64_t ldx, float *y,
                     int64_t ldy, const float *bias, int acc, int portable) {
    if (M < 1) return 0;
    if (W->xq) return nyb_idgemm(W, x, M, ldx, y, ldy, bias, acc, portable);
    uint16_t *xb = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(M * W->K) + 64);
    float *sx = (float *)malloc(sizeof(float) * (size_t)(M * W->G));
    if (xb == NULL || sx == NULL) { free(xb); free(sx); return -1; }
    nyb_qg_round(W, x, M, ldx, xb, sx);
#ifdef NYB_X86_BF16
    if (!portable && nyb_qg_cpu_bf16()) {
        nyb_qg_job job = {W, xb, sx, M, y, ldy, bias, acc};
        const int64_t Nb = W->Np / NYB_QG_COLS;
        nyb_parallel_for(Nb, nyb_pool_chunk(Nb, nyb_qg_tile_cols(M)), nyb_qg_range,
                         &job);
    } else
#endif
        nyb_qg_portable(W, xb, sx, M, y, ldy, bias, acc);
    free(xb);
    free(sx);
    return 0;
}

#endif
