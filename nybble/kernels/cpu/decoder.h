/* A whole Llama-family decode step on the CPU in one call: float32 KV cache, float32 or
 * packed 4/8-bit (bf16-dot, qgemm.h) weights.
 *
 * For T sequences with one new token each: embedding row, then per layer RMSNorm -> fused
 * q/k/v projection (+ bias) -> RoPE (the model's cos/sin table, HF's rotate_half layout) ->
 * K/V written to the paged cache at the token's slot -> paged attention over the sequence's
 * cached positions through its block table (PagedAttention, Kwon et al., SOSP 2023) ->
 * o_proj + residual -> RMSNorm -> fused gate/up -> SiLU(gate) * up -> down + residual; then the
 * final RMSNorm.  The result is the final hidden state [T, H]; the LM head stays with the
 * caller.  The same arithmetic as the torch path (float32 everywhere, sums in float32), in a
 * different summation order, and without the ~230 framework op dispatches a small model's
 * step costs there.
 *
 * Each projection (nyb_proj) is either dense float32 (register-tiled dot products below) or
 * one to NYB_MAX_PARTS packed 4/8-bit weights concatenated along the output features (a GGUF
 * q/k/v whose shards have different block types), all of one kind: the bf16-dot kernel's
 * (qgemm.h: activations rounded to bfloat16, float32 sums) or the float32 weight-only
 * kernel's (wo_gemm.h: float32 activations and sums, the exact path).  The token embedding
 * is a dense table or a packed weight [V, H] of either kind whose rows are dequantized one
 * by one (nyb_qg_row, nyb_wo_row).
 *
 * Layouts: dense weights [out, in] row-major (torch's), biases [out] or NULL; the KV cache
 * [2, NB, BS, Hkv, D] C-contiguous, float32 or bfloat16 (kv_bf16: half the bytes a decode
 * step's attention reads, which dominate long contexts and many sequences); the RoPE table
 * [P, 2, D] holds cos = [c, c] and sin = [-s, s] per position, so rotated
 * x[i] = x[i] cos[i] + x[(i + D/2) % D] sin[i].
 * An x86-64 AVX2+FMA copy of the code is chosen at run time when the CPU has it.
 *
 * Multi-LoRA (Hu et al. 2021; batched as in S-LoRA / Punica): each projection may carry the
 * model's stacked adapter slots (nyb_lora: A [S, R, K] and B transposed [S, R, N], the
 * adapter's scale folded into B; R zero-padded).  With a per-row slot array (-1: base), row t
 * of slot s >= 0 then adds (x_t A_s^T) B_s^T to the projection's output: R dot products of
 * length K, then R scaled rows of B added (zero rank rows skipped).
 */
#ifndef NYB_CPU_DECODER_H
#define NYB_CPU_DECODER_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_features.h"
#include "qgemm.h"
#include "wo_gemm.h"

#define NYB_MAX_PARTS 4

/* One projection x [T, K] -> y [T, N]: dense (w != NULL) or `nparts` packed weights whose
 * output features follow one another (their N sum to the projection's): bf16-dot ones
 * (parts) or weight-only ones (wo). */
typedef struct {
    const float *w;                       /* [N, K] float32, or NULL: packed */
    const float *b;                       /* [N] or NULL */
    int nparts;
    const nyb_qw *parts[NYB_MAX_PARTS];   /* bf16-dot parts, or NULL ... */
    const nyb_wo_weight *wo[NYB_MAX_PARTS];  /* ... weight-only parts */
} nyb_proj;

/* A projection's LoRA slots: a [S, R, K], bt [S, R, N] (B^T, scale folded in); a == NULL:
 * none. */
typedef struct {
    const float *a, *bt;
    int64_t R;
} nyb_lora;

typedef struct {
    const float *in_norm, *post_norm;  /* [H] */
    nyb_proj qkv;                      /* [(Hq + 2 Hkv) D, H] */
    nyb_proj o;                        /* [H, Hq D] */
    nyb_proj gu;                       /* [2 FF, H] (gate rows first) */
    nyb_proj down;                     /* [H, FF] */
    void *kv_cache;                    /* [2, NB, BS, Hkv, D] float32, or bfloat16 bits */
    nyb_lora lqkv, lo, lgu, ldown;     /* LoRA slots of the four projections */
} nyb_layer;

typedef struct {
    int64_t H, FF, Hq, Hkv, D, L, V, NB, BS, P;
    float eps, scale;
    const float *embed;       /* [V, H], or NULL: embed_q */
    const nyb_qw *embed_q;    /* packed [V, H] (K = H, N = V), or NULL */
    const nyb_wo_weight *embed_wo;  /* packed [V, H] weight-only, or NULL */
    const float *final_norm;  /* [H] */
    const float *cos_sin;     /* [P, 2, D] */
    const nyb_layer *layers;  /* [L] */
    int64_t LS, LR;           /* LoRA: slots, and the largest R of a projection (0: none) */
    int kv_bf16;              /* the KV cache holds bfloat16 (written rounded to nearest even,
                               * read widened exactly) instead of float32 */
} nyb_decoder;

#define NYB_INLINE static inline __attribute__((always_inline))

/* y[t, n] (row stride ldy) = (acc ? y[t, n] : 0) + b[n] + x[t, :K] . W[n, :K] for t < T.
 * Register tiles of 4 rows x 2 output features (8 sums, each vectorised over k), so each
 * loaded weight serves 4 rows and each loaded activation 2 features; remainders one by one. */
NYB_INLINE void nyb_store(float *y, float s, const float *b, int64_t n, int acc) {
    *y = (acc ? *y : 0.0f) + (s + (b ? b[n] : 0.0f));
}

/* Rows of fewer than 4 tokens stream each weight row pair once: the pair NYB_LIN_AHEAD pairs
 * ahead is prefetched (into L2) while this one computes, in one burst per pair (the one-row
 * AVX2 GEMV, nyb_gemv1_avx2, streams row by row instead).  SmolLM2-135M's float32
 * projections at one row: 1, 2, 3, 4 and 8 pairs ahead measured, 2 best (38 -> 24 ms a step's
 * 425 MB; benchmarks/README.md). */
#ifndef NYB_LIN_AHEAD
#define NYB_LIN_AHEAD 2
#endif

NYB_INLINE void nyb_linear(const float *x, int64_t T, int64_t K, const float *W,
                           const float *b, int64_t N, float *y, int64_t ldy, int acc) {
    int64_t n = 0;
    for (; n + 2 <= N; n += 2) {
        const float *w0 = W + n * K, *w1 = w0 + K;
        int64_t t = 0;
        for (; t + 4 <= T; t += 4) {
            const float *x0 = x + t * K, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K;
            float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
            float c0 = 0.0f, c1 = 0.0f, c2 = 0.0f, c3 = 0.0f;
            for (int64_t k = 0; k < K; k++) {
                a0 += x0[k] * w0[k]; c0 += x0[k] * w1[k];
                a1 += x1[k] * w0[k]; c1 += x1[k] * w1[k];
                a2 += x2[k] * w0[k]; c2 += x2[k] * w1[k];
                a3 += x3[k] * w0[k]; c3 += x3[k] * w1[k];
            }
            float *yt = y + t * ldy + n;
            nyb_store(yt, a0, b, n, acc); nyb_store(yt + 1, c0, b, n + 1, acc);
            nyb_store(yt + ldy, a1, b, n, acc); nyb_store(yt + ldy + 1, c1, b, n + 1, acc);
            nyb_store(yt + 2 * ldy, a2, b, n, acc);
            nyb_store(yt + 2 * ldy + 1, c2, b, n + 1, acc);
            nyb_store(yt + 3 * ldy, a3, b, n, acc);
            nyb_store(yt + 3 * ldy + 1, c3, b, n + 1, acc);
        }
        if (T < 4 && n + 2 * NYB_LIN_AHEAD + 2 <= N)   /* see NYB_LIN_AHEAD */
            for (int64_t i = 0; i < 2 * K; i += 16)
                __builtin_prefetch(w0 + 2 * NYB_LIN_AHEAD * K + i, 0, 2);
        for (; t < T; t++) {
            const float *xt = x + t * K;
            float a = 0.0f, c = 0.0f;
            for (int64_t k = 0; k < K; k++) { a += xt[k] * w0[k]; c += xt[k] * w1[k]; }
            nyb_store(y + t * ldy + n, a, b, n, acc);
            nyb_store(y + t * ldy + n + 1, c, b, n + 1, acc);
        }
    }
    for (; n < N; n++) {
        const float *w = W + n * K;
        for (int64_t t = 0; t < T; t++) {
            const float *xt = x + t * K;
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++) s += xt[k] * w[k];
            nyb_store(y + t * ldy + n, s, b, n, acc);
        }
    }
}

/* out[k] = W[n, k], k < K: a weight-only packed table's row n dequantized (act order undone). */
static inline void nyb_wo_row(const nyb_wo_weight *W, int64_t n, float *out) {
    const int64_t jb = n / NYB_COLS, c = n % NYB_COLS;
    for (int64_t k = 0; k < W->K; k++) {
        const int64_t gi = (k / W->group) * W->Np + n;
        float v = nyb_wo_scale(W, gi) * (nyb_q(W, jb, k, (int)c) - nyb_wo_zero(W, gi));
        if (W->mins) v += nyb_wo_min(W, gi);
        out[W->perm ? W->perm[k] : k] = v;
    }
}

/* e^x in float32 within ~2 ulp for x in [-87, 88] (Cephes' expf: 2^n times a degree-7
 * polynomial of the remainder after splitting ln 2 in two parts); written without a libm
 * call or branch so that loops over it vectorise.  x is clamped to [-87.3, 88.7]. */
NYB_INLINE float nyb_expf(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } two_n = { .i = ((int32_t)n + 127) << 23 };
    return p * two_n.f;
}

/* out[t] = w * x[t] / sqrt(mean(x[t]^2) + eps), rows of H. */
NYB_INLINE void nyb_rms_norm(const float *x, int64_t T, int64_t H, const float *w, float eps,
                             float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * H;
        float ss = 0.0f;
        for (int64_t i = 0; i < H; i++) ss += xt[i] * xt[i];
        const float r = 1.0f / sqrtf(ss / (float)H + eps);
        float *o = out + t * H;
        for (int64_t i = 0; i < H; i++) o[i] = w[i] * (xt[i] * r);
    }
}

/* Rotate `heads` heads of D at x in place by the table rows cs = [cos D, sin D]. */
NYB_INLINE void nyb_rope(float *x, int64_t heads, int64_t D, const float *cs, float *tmp) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *xh = x + h * D;
        memcpy(tmp, xh, sizeof(float) * (size_t)D);
        for (int64_t i = 0; i < D; i++)
            xh[i] = tmp[i] * cs[i] + tmp[(i + half) % D] * cs[D + i];
    }
}

/* Softmax in place of each of the `heads` rows of `len` scores at work. */
NYB_INLINE void nyb_softmax_rows(float *work, int64_t heads, int64_t len) {
    for (int64_t h = 0; h < heads; h++) {
        float *row = work + h * len, mx = -INFINITY, total = 0.0f;
        for (int64_t p = 0; p < len; p++) mx = row[p] > mx ? row[p] : mx;
        for (int64_t p = 0; p < len; p++) { row[p] = nyb_expf(row[p] - mx); total += row[p]; }
        const float inv = 1.0f / total;
        for (int64_t p = 0; p < len; p++) row[p] *= inv;
    }
}

/* Element i of a KV cache half (keys or values): float32, or bfloat16 bits widened (BF, a
 * constant). */
NYB_INLINE float nyb_kv_at(const void *kv, int64_t i, const int BF) {
    return BF ? nyb_bf16_float(((const uint16_t *)kv)[i]) : ((const float *)kv)[i];
}

/* Decode attention of one token: q [Hq, D] over `len` cached positions -> out [Hq, D].
 * keys, values: the cache's two halves (float32, or bfloat16 when BF).  work: Hq * len
 * floats. */
NYB_INLINE void nyb_attend_t(const nyb_decoder *M, const void *keys, const void *values,
                             const int32_t *table, int64_t len, const float *q, float *out,
                             float *work, const int BF) {
    const int64_t Hq = M->Hq, Hkv = M->Hkv, D = M->D, BS = M->BS, group = Hq / Hkv;
    const int64_t slot_stride = Hkv * D;
    for (int64_t p = 0; p < len; p++) {
        const int64_t k = ((int64_t)table[p / BS] * BS + p % BS) * slot_stride;
        for (int64_t h = 0; h < Hq; h++) {
            const float *qh = q + h * D;
            const int64_t kh = k + (h / group) * D;
            float s = 0.0f;
            for (int64_t d = 0; d < D; d++) s += qh[d] * nyb_kv_at(keys, kh + d, BF);
            work[h * len + p] = s * M->scale;
        }
    }
    nyb_softmax_rows(work, Hq, len);
    memset(out, 0, sizeof(float) * (size_t)(Hq * D));
    for (int64_t p = 0; p < len; p++) {
        const int64_t v = ((int64_t)table[p / BS] * BS + p % BS) * slot_stride;
        for (int64_t h = 0; h < Hq; h++) {
            const float pr = work[h * len + p];
            const int64_t vh = v + (h / group) * D;
            float *o = out + h * D;
            for (int64_t d = 0; d < D; d++) o[d] += pr * nyb_kv_at(values, vh + d, BF);
        }
    }
}

NYB_INLINE void nyb_attend(const nyb_decoder *M, const void *keys, const void *values,
                           const int32_t *table, int64_t len, const float *q, float *out,
                           float *work) {
    if (M->kv_bf16) nyb_attend_t(M, keys, values, table, len, q, out, work, 1);
    else nyb_attend_t(M, keys, values, table, len, q, out, work, 0);
}

/* The cache's value half: `half` elements after the keys. */
NYB_INLINE const void *nyb_kv_values(const nyb_decoder *M, const void *keys, int64_t half) {
    return (const char *)keys + half * (M->kv_bf16 ? 2 : 4);
}

#ifdef NYB_X86_AVX2
#define NYB_AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma")))

NYB_AVX2_INLINE float nyb_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* Eight elements i .. i + 7 of a KV cache half as float32 (bfloat16 widened when BF). */
NYB_AVX2_INLINE __m256 nyb_kv_load8(const void *kv, int64_t i, const int BF) {
    if (BF)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)kv + i))),
            16));
    return _mm256_loadu_ps((const float *)kv + i);
}

/* out[h, d0 .. d0 + 8 NV) = sum_p pr[h, p] v_p[h / group, d0 ..]: the sums kept in NV
 * registers over all positions, the cache walked block by block (no division per position). */
NYB_AVX2_INLINE void nyb_attend_pv(const nyb_decoder *M, const void *values,
                                   const int32_t *table, int64_t len, const float *pr,
                                   int64_t kvh, int64_t d0, float *o, const int NV,
                                   const int BF) {
    const int64_t D = M->D, BS = M->BS, stride = M->Hkv * D;
    __m256 acc[8];
#pragma GCC unroll 8
    for (int i = 0; i < NV; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t p0 = 0, blk = 0; p0 < len; p0 += BS, blk++) {
        int64_t v = (int64_t)table[blk] * BS * stride + kvh * D + d0;
        const int64_t n = len - p0 < BS ? len - p0 : BS;
        for (int64_t i = 0; i < n; i++, v += stride) {
            const __m256 w = _mm256_set1_ps(pr[p0 + i]);
#pragma GCC unroll 8
            for (int r = 0; r < NV; r++)
                acc[r] = _mm256_fmadd_ps(w, nyb_kv_load8(values, v + 8 * r, BF), acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < NV; i++) _mm256_storeu_ps(o + d0 + 8 * i, acc[i]);
}

/* nyb_attend with AVX2 for head sizes that are multiples of 8 (else nyb_attend itself): each
 * key row is read once per KV head and dotted with that head's query heads, the weighted sum
 * of values kept in registers (64 outputs at a time) instead of read and written back per
 * position.  Sums in a different order than nyb_attend, so the two differ in the last bits. */
NYB_AVX2_INLINE void nyb_attend_avx2_t(const nyb_decoder *M, const void *keys,
                                       const void *values, const int32_t *table, int64_t len,
                                       const float *q, float *out, float *work, const int BF) {
    const int64_t Hq = M->Hq, Hkv = M->Hkv, D = M->D, BS = M->BS, group = Hq / Hkv;
    const int64_t stride = Hkv * D, row_bytes = stride * (BF ? 2 : 4);
    for (int64_t p0 = 0, blk = 0; p0 < len; p0 += BS, blk++) {
        int64_t k = (int64_t)table[blk] * BS * stride;
        const int64_t n = len - p0 < BS ? len - p0 : BS;
        /* the next block's rows, fetched while this block computes: blocks are scattered in
         * the pool, so the hardware prefetchers restart at each one */
        const int64_t next = len - p0 - BS < BS ? len - p0 - BS : BS;
        const int64_t nbase = next > 0 ? (int64_t)table[blk + 1] * BS * row_bytes : 0;
        for (int64_t i = 0; i < n; i++, k += stride) {
            if (i < next) {
                const char *nk = (const char *)keys + nbase + i * row_bytes;
                const char *nv = (const char *)values + nbase + i * row_bytes;
                for (int64_t b = 0; b < row_bytes; b += 64) {
                    _mm_prefetch(nk + b, _MM_HINT_T0);
                    _mm_prefetch(nv + b, _MM_HINT_T1);
                }
            }
            for (int64_t h = 0; h < Hq; h++) {
                const float *qh = q + h * D;
                const int64_t kh = k + (h / group) * D;
                __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
                int64_t d = 0;
                for (; d + 16 <= D; d += 16) {
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), nyb_kv_load8(keys, kh + d, BF),
                                         a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d + 8),
                                         nyb_kv_load8(keys, kh + d + 8, BF), a1);
                }
                if (d < D)
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), nyb_kv_load8(keys, kh + d, BF),
                                         a0);
                work[h * len + p0 + i] = nyb_hsum8(_mm256_add_ps(a0, a1)) * M->scale;
            }
        }
    }
    nyb_softmax_rows(work, Hq, len);
    for (int64_t h = 0; h < Hq; h++) {
        int64_t d0 = 0;
        for (; d0 + 64 <= D; d0 += 64)
            nyb_attend_pv(M, values, table, len, work + h * len, h / group, d0, out + h * D, 8,
                          BF);
        for (; d0 < D; d0 += 8)
            nyb_attend_pv(M, values, table, len, work + h * len, h / group, d0, out + h * D, 1,
                          BF);
    }
}

static __attribute__((target("avx2,fma"))) void nyb_attend_avx2(
        const nyb_decoder *M, const void *keys, const void *values, const int32_t *table,
        int64_t len, const float *q, float *out, float *work) {
    if (M->D % 8 != 0) nyb_attend(M, keys, values, table, len, q, out, work);
    else if (M->kv_bf16) nyb_attend_avx2_t(M, keys, values, table, len, q, out, work, 1);
    else nyb_attend_avx2_t(M, keys, values, table, len, q, out, work, 0);
}
#endif

/* The step's parallel parts (pool.h): a dense projection's output features in pairs, and the
 * attention of each sequence.  Each has an AVX2+FMA copy (the body inlined into a function
 * of that target) and a portable one; nyb_apply and the step pick by `portable`. */
typedef struct {
    const float *x, *W, *b;
    int64_t T, K, N;
    float *y;
    int64_t ldy;
    int acc;
} nyb_lin_job;

NYB_INLINE void nyb_lin_range_body(void *ctx, int64_t lo, int64_t hi) {
    const nyb_lin_job *j = (const nyb_lin_job *)ctx;
    const int64_t n0 = 2 * lo, n1 = 2 * hi < j->N ? 2 * hi : j->N;
    nyb_linear(j->x, j->T, j->K, j->W + n0 * j->K, j->b ? j->b + n0 : NULL, n1 - n0,
               j->y + n0, j->ldy, j->acc);
}

typedef struct {
    const nyb_decoder *M;
    const nyb_layer *ly;
    const int32_t *tables;
    const int32_t *seq_lens;
    int64_t MB, QKV, longest;
    const float *qkv;
    float *att;
    _Atomic int failed;
} nyb_att_job;

/* Sequences lo .. hi of the step's attention; fast (a constant): nyb_attend_avx2, with the
 * next sequence's first block prefetched while this one computes. */
NYB_INLINE void nyb_att_range_body(void *ctx, int64_t lo, int64_t hi, const int fast) {
    nyb_att_job *j = (nyb_att_job *)ctx;
    const nyb_decoder *M = j->M;
    const int64_t cache_half = M->NB * M->BS * M->Hkv * M->D;
    const int64_t row_bytes = M->Hkv * M->D * (M->kv_bf16 ? 2 : 4);
    float *work = (float *)malloc(sizeof(float) * (size_t)(M->Hq * j->longest));
    if (work == NULL) { atomic_store(&j->failed, 1); return; }
    for (int64_t t = lo; t < hi; t++) {
        const void *keys = j->ly->kv_cache, *values = nyb_kv_values(M, keys, cache_half);
#ifdef NYB_X86_AVX2
        if (fast) {
            if (t + 1 < hi) {
                const int64_t rows = j->seq_lens[t + 1] < M->BS ? j->seq_lens[t + 1] : M->BS;
                const int64_t first = (int64_t)j->tables[(t + 1) * j->MB] * M->BS * row_bytes;
                for (int64_t b = 0; b < rows * row_bytes; b += 64) {
                    _mm_prefetch((const char *)keys + first + b, _MM_HINT_T1);
                    _mm_prefetch((const char *)values + first + b, _MM_HINT_T1);
                }
            }
            nyb_attend_avx2(M, keys, values, j->tables + t * j->MB, j->seq_lens[t],
                            j->qkv + t * j->QKV, j->att + t * M->Hq * M->D, work);
            continue;
        }
#endif
        nyb_attend(M, keys, values, j->tables + t * j->MB, j->seq_lens[t],
                   j->qkv + t * j->QKV, j->att + t * M->Hq * M->D, work);
    }
    free(work);
}

static void nyb_lin_range_portable(void *ctx, int64_t lo, int64_t hi) {
    nyb_lin_range_body(ctx, lo, hi);
}
static void nyb_att_range_portable(void *ctx, int64_t lo, int64_t hi) {
    nyb_att_range_body(ctx, lo, hi, 0);
}
#ifdef NYB_X86_AVX2
/* One row (a decode step of one sequence, or a head's row): y[n] = x . W[n] for rows n0 ..
 * n1, one weight row at a time (the matrix is read as one sequential stream), four running
 * sums of 8, and one prefetch (into L2) per 64 bytes NYB_GEMV1_AHEAD floats further on in
 * the stream (into the next row near a row's end), spread over the loop.  Measured on 512 MiB
 * of float32 on 2 MiB pages, one thread (AMD EPYC, 2026-12-07), GB/s for rows of 576 / 1536 /
 * 4096: 256 floats ahead 31-34 / 31-33 / 26-27, the next row's same column 29-34 / 23 / 23,
 * 1024 floats ahead 21-28 / 25-26 / 22; the former loop of row pairs (the pair two pairs
 * ahead prefetched) 22-23 at 576. */
#define NYB_GEMV1_AHEAD 256
NYB_AVX2_INLINE void nyb_gemv1_avx2(const float *x, int64_t K, const float *W, const float *b,
                                    int64_t n0, int64_t n1, int64_t N, float *y, int acc) {
    for (int64_t n = n0; n < n1; n++) {
        const float *w = W + n * K;
        const int64_t pf_end = n + 1 < N ? K : K - NYB_GEMV1_AHEAD;   /* stay inside W */
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 32 <= K; k += 32) {
            if (k < pf_end) {
                _mm_prefetch((const char *)(w + NYB_GEMV1_AHEAD + k), _MM_HINT_T1);
                _mm_prefetch((const char *)(w + NYB_GEMV1_AHEAD + k + 16), _MM_HINT_T1);
            }
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(w + k), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), _mm256_loadu_ps(w + k + 8), a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), _mm256_loadu_ps(w + k + 16), a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), _mm256_loadu_ps(w + k + 24), a3);
        }
        for (; k + 8 <= K; k += 8)
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(w + k), a0);
        float s = nyb_hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        for (; k < K; k++) s += x[k] * w[k];
        nyb_store(y + n, s, b, n, acc);
    }
}

static __attribute__((target("avx2,fma"))) void nyb_lin_range_avx2(void *ctx, int64_t lo,
                                                                    int64_t hi) {
    const nyb_lin_job *j = (const nyb_lin_job *)ctx;
    if (j->T == 1) {
        const int64_t n1 = 2 * hi < j->N ? 2 * hi : j->N;
        nyb_gemv1_avx2(j->x, j->K, j->W, j->b, 2 * lo, n1, j->N, j->y, j->acc);
        return;
    }
    nyb_lin_range_body(ctx, lo, hi);
}
static __attribute__((target("avx2,fma"))) void nyb_att_range_avx2(void *ctx, int64_t lo,
                                                                    int64_t hi) {
    nyb_att_range_body(ctx, lo, hi, 1);
}
#define NYB_RANGE(name, portable) ((portable) ? name##_portable : name##_avx2)
#else
#define NYB_RANGE(name, portable) (name##_portable)
#endif

/* y (+)= x @ P^T + b for a projection of K inputs and N outputs; tmp: T * N floats (the
 * weight-only kernel's output before it is added to y).  Returns 0, or -1 when a packed
 * kernel runs out of memory (y may be partly written then). */
NYB_INLINE int nyb_apply(const nyb_proj *P, const float *x, int64_t T, int64_t K, int64_t N,
                         float *y, int64_t ldy, int acc, int portable, float *tmp) {
    if (P->w) {   /* output features in pairs over the pool's threads */
        nyb_lin_job job = {x, P->w, P->b, T, K, N, y, ldy, acc};
        const int64_t pairs = (N + 1) / 2;
        nyb_parallel_for(pairs, nyb_pool_chunk(pairs, 64), NYB_RANGE(nyb_lin_range, portable),
                         &job);
        return 0;
    }
    int64_t off = 0;
    if (P->wo[0]) {
        float *dst = acc ? tmp : y;
        const int64_t ld = acc ? N : ldy;
        for (int i = 0; i < P->nparts; i++) {
            if (nyb_wo_gemm(P->wo[i], x, T, K, dst + off, ld, portable)) return -1;
            off += P->wo[i]->N;
        }
        for (int64_t t = 0; t < T; t++) {
            float *yt = y + t * ldy;
            const float *st = dst + t * ld;
            for (int64_t n = 0; n < N; n++)
                yt[n] = (acc ? yt[n] + st[n] : st[n]) + (P->b ? P->b[n] : 0.0f);
        }
        return 0;
    }
    for (int i = 0; i < P->nparts; i++) {
        if (nyb_qgemm(P->parts[i], x, T, K, y + off, ldy, P->b ? P->b + off : NULL, acc,
                      portable)) return -1;
        off += P->parts[i]->N;
    }
    return 0;
}

/* y[t, :N] (row stride ldy) += (x[t, :K] . A_s^T) B_s^T for each row t whose slot s =
 * lslots[t] >= 0; h: R floats of scratch. */
NYB_INLINE void nyb_lora_add(const nyb_lora *L, const int64_t *lslots, const float *x,
                             int64_t T, int64_t K, int64_t N, float *y, int64_t ldy,
                             float *h) {
    if (L->a == NULL || lslots == NULL) return;
    const int64_t R = L->R;
    for (int64_t t = 0; t < T; t++) {
        const int64_t s = lslots[t];
        if (s < 0) continue;
        const float *xt = x + t * K, *A = L->a + s * R * K, *Bt = L->bt + s * R * N;
        float *yt = y + t * ldy;
        for (int64_t r = 0; r < R; r++) {
            const float *ar = A + r * K;
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc += ar[k] * xt[k];
            h[r] = acc;
        }
        for (int64_t r = 0; r < R; r++) {
            const float hr = h[r];
            if (hr == 0.0f) continue;   /* a zero-padded rank row */
            const float *br = Bt + r * N;
            for (int64_t n = 0; n < N; n++) yt[n] += hr * br[n];
        }
    }
}

NYB_INLINE int nyb_decode_body(const nyb_decoder *M, int64_t T, const int64_t *ids,
                               const int64_t *pos, const int64_t *slots,
                               const int32_t *tables, int64_t MB, const int32_t *seq_lens,
                               const int64_t *lslots, float *out, float *buf, int portable) {
    const int64_t H = M->H, FF = M->FF, D = M->D, Hq = M->Hq, Hkv = M->Hkv;
    const int64_t QKV = (Hq + 2 * Hkv) * D, cache_half = M->NB * M->BS * Hkv * D;
    float *h = buf, *xn = h + T * H, *qkv = xn + T * H, *att = qkv + T * QKV;
    float *gu = att + T * Hq * D, *act = gu + T * 2 * FF, *tmp = act + T * FF, *wtmp = tmp + D;
    float *work = wtmp + T * H;   /* wtmp: the residual projections' outputs (N = H) */
    int64_t longest = 1;
    for (int64_t t = 0; t < T; t++) longest = seq_lens[t] > longest ? seq_lens[t] : longest;
    float *lh = work + Hq * longest;   /* LoRA: M->LR floats */
    for (int64_t t = 0; t < T; t++) {
        if (M->embed) memcpy(h + t * H, M->embed + ids[t] * H, sizeof(float) * (size_t)H);
        else if (M->embed_q) nyb_qg_row(M->embed_q, ids[t], h + t * H);
        else nyb_wo_row(M->embed_wo, ids[t], h + t * H);
    }
    for (int64_t l = 0; l < M->L; l++) {
        const nyb_layer *ly = M->layers + l;
        nyb_rms_norm(h, T, H, ly->in_norm, M->eps, xn);
        if (nyb_apply(&ly->qkv, xn, T, H, QKV, qkv, QKV, 0, portable, wtmp)) return -1;
        nyb_lora_add(&ly->lqkv, lslots, xn, T, H, QKV, qkv, QKV, lh);
        for (int64_t t = 0; t < T; t++) {
            float *qt = qkv + t * QKV, *kt = qt + Hq * D, *vt = kt + Hkv * D;
            nyb_rope(qt, Hq + Hkv, D, M->cos_sin + pos[t] * 2 * D, tmp);  /* q and k */
            if (slots[t] >= 0) {
                const int64_t at = slots[t] * Hkv * D;
                if (M->kv_bf16) {   /* rounded to nearest even, as torch's cast */
                    uint16_t *kc = (uint16_t *)ly->kv_cache + at, *vc = kc + cache_half;
                    for (int64_t i = 0; i < Hkv * D; i++) {
                        kc[i] = nyb_bf16_bits(kt[i]);
                        vc[i] = nyb_bf16_bits(vt[i]);
                    }
                } else {
                    float *kc = (float *)ly->kv_cache + at;
                    memcpy(kc, kt, sizeof(float) * (size_t)(Hkv * D));
                    memcpy(kc + cache_half, vt, sizeof(float) * (size_t)(Hkv * D));
                }
            }
        }
        const void *values = nyb_kv_values(M, ly->kv_cache, cache_half);
        if (T == 1) {
#ifdef NYB_X86_AVX2
            if (!portable && nyb_cpu_has_avx2_fma())
                nyb_attend_avx2(M, ly->kv_cache, values, tables, seq_lens[0], qkv, att, work);
            else
#endif
                nyb_attend(M, ly->kv_cache, values, tables, seq_lens[0], qkv, att, work);
        } else {   /* sequences over the pool's threads, each chunk with its own scores */
            nyb_att_job job = {M, ly, tables, seq_lens, MB, QKV, longest, qkv, att, 0};
            nyb_parallel_for(T, nyb_pool_chunk(T, 8), NYB_RANGE(nyb_att_range, portable), &job);
            if (atomic_load(&job.failed)) return -1;
        }
        if (nyb_apply(&ly->o, att, T, Hq * D, H, h, H, 1, portable, wtmp)) return -1;
        nyb_lora_add(&ly->lo, lslots, att, T, Hq * D, H, h, H, lh);
        nyb_rms_norm(h, T, H, ly->post_norm, M->eps, xn);
        if (nyb_apply(&ly->gu, xn, T, H, 2 * FF, gu, 2 * FF, 0, portable, wtmp)) return -1;
        nyb_lora_add(&ly->lgu, lslots, xn, T, H, 2 * FF, gu, 2 * FF, lh);
        for (int64_t t = 0; t < T; t++) {  /* SiLU(gate) * up */
            const float *g = gu + t * 2 * FF;
            float *a = act + t * FF;
            for (int64_t i = 0; i < FF; i++) a[i] = g[i] / (1.0f + nyb_expf(-g[i])) * g[FF + i];
        }
        if (nyb_apply(&ly->down, act, T, FF, H, h, H, 1, portable, wtmp)) return -1;
        nyb_lora_add(&ly->ldown, lslots, act, T, FF, H, h, H, lh);
    }
    nyb_rms_norm(h, T, H, M->final_norm, M->eps, out);
    return 0;
}

#ifdef NYB_X86_AVX2
static __attribute__((target("avx2,fma"))) int nyb_decode_avx2(
        const nyb_decoder *M, int64_t T, const int64_t *ids, const int64_t *pos,
        const int64_t *slots, const int32_t *tables, int64_t MB, const int32_t *seq_lens,
        const int64_t *lslots, float *out, float *buf) {
    return nyb_decode_body(M, T, ids, pos, slots, tables, MB, seq_lens, lslots, out, buf, 0);
}
#endif

static int nyb_decoder_avx2(void) { return nyb_cpu_has_avx2_fma(); }

static int nyb_decode_portable(const nyb_decoder *M, int64_t T, const int64_t *ids,
                               const int64_t *pos, const int64_t *slots,
                               const int32_t *tables, int64_t MB, const int32_t *seq_lens,
                               const int64_t *lslots, float *out, float *buf) {
    return nyb_decode_body(M, T, ids, pos, slots, tables, MB, seq_lens, lslots, out, buf, 1);
}

/* y [T, N] = x [T, K] @ W^T for a dense float32 W [N, K] (row-major) outside a step: the
 * step's own projection loop (weight rows in pairs over the pool's threads, the pairs ahead
 * prefetched), for a float32 LM head. */
static void nyb_dense_linear(const float *x, int64_t T, int64_t K, const float *W, int64_t N,
                             float *y, int portable) {
#ifdef NYB_X86_AVX2
    portable = portable || !nyb_decoder_avx2();
#else
    portable = 1;
#endif
    nyb_lin_job job = {x, W, NULL, T, K, N, y, N, 0};
    const int64_t pairs = (N + 1) / 2;
    nyb_parallel_for(pairs, nyb_pool_chunk(pairs, 64), NYB_RANGE(nyb_lin_range, portable), &job);
}

/* Check the step's indices, then run it; lslots: each row's LoRA slot (-1: base), or NULL
 * (no row uses an adapter).  Returns 0; -1 no memory (the KV cache may hold some of the
 * step's writes then); -2 an index out of range (a token id, position, slot, sequence
 * length, block id or LoRA slot), with nothing written. */
static int nyb_decode_forward(const nyb_decoder *M, int64_t T, const int64_t *ids,
                              const int64_t *pos, const int64_t *slots, const int32_t *tables,
                              int64_t MB, const int32_t *seq_lens, const int64_t *lslots,
                              float *out, int portable) {
    int64_t longest = 1;
    for (int64_t t = 0; t < T; t++) {
        if (lslots && (lslots[t] < -1 || lslots[t] >= M->LS)) return -2;
        if (ids[t] < 0 || ids[t] >= M->V || pos[t] < 0 || pos[t] >= M->P
                || slots[t] < -1 || slots[t] >= M->NB * M->BS
                || seq_lens[t] < 1 || seq_lens[t] > MB * M->BS) return -2;
        for (int64_t j = 0; j < (seq_lens[t] + M->BS - 1) / M->BS; j++)
            if (tables[t * MB + j] < 0 || tables[t * MB + j] >= M->NB) return -2;
        if (seq_lens[t] > longest) longest = seq_lens[t];
    }
    const int64_t QKV = (M->Hq + 2 * M->Hkv) * M->D;
    const size_t floats = (size_t)(T * (3 * M->H + QKV + M->Hq * M->D + 3 * M->FF) + M->D
                                   + M->Hq * longest + M->LR);
    float *buf = (float *)malloc(sizeof(float) * floats);
    if (buf == NULL) return -1;
    int rc;
#ifdef NYB_X86_AVX2
    if (!portable && nyb_decoder_avx2())
        rc = nyb_decode_avx2(M, T, ids, pos, slots, tables, MB, seq_lens, lslots, out, buf);
    else
#endif
        rc = nyb_decode_portable(M, T, ids, pos, slots, tables, MB, seq_lens, lslots, out, buf);
    free(buf);
    return rc;
}

#endif
