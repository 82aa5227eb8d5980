/* A packed 4/8-bit weight (qgemm.h / idot.h layouts) dequantized to bfloat16 (or float32,
 * nyb_qdequant_f32: the same values unrounded, for CPUs without a fast bf16 GEMM), for prefill:
 * out[n, perm ? perm[k] : k] = bf16(W[n, k]) with W[n, k] the value the GEMM kernels multiply
 * by (s q, s (q - zq) or s q + mo, float32, then rounded to nearest even), row-major [N, K]
 * with row stride ldo, i.e. torch's Linear weight layout in the original input order (act
 * order undone).  Many-row steps (prefill chunks) multiply x by this with a bfloat16 matrix
 * GEMM (on CPUs with AMX-BF16 that is oneDNN's tile kernel); the weight is dequantized once
 * per call and reused across all the rows, the "dequantize + bf16 GEMM" option of the
 * prefill path (issue 22.5).
 *
 * The integer-dot layout is walked unit by unit (one group's scale per unit and column, no
 * division per value); the bf16-dot layout value by value through nyb_qg_q.  Column blocks
 * are spread over pool.h's threads.  Included by qgemm.h's users after qgemm.h. */
#ifndef NYB_CPU_QDEQUANT_H
#define NYB_CPU_QDEQUANT_H

#include <stdint.h>

#include "pool.h"
#include "qgemm.h"

/* The value stored integer u (0 .. 2^bits - 1) stands for in group entry gi. */
static inline float nyb_qd_value(const nyb_qw *W, int64_t gi, float s, int u) {
    const float q = (float)(u - (1 << (W->bits - 1)));
    if (W->mode == NYB_QG_ZERO) return s * (q - (float)W->zq[gi]);
    if (W->mode == NYB_QG_MIN) return s * q + W->mo[gi];
    return s * q;
}

typedef struct {
    const nyb_qw *W;
    void *out;              /* uint16_t bf16 bits (f32 = 0) or float (f32 = 1) */
    int64_t ldo;
    int f32;
} nyb_qd_job;

static inline void nyb_qd_put(const nyb_qd_job *j, int64_t n, int64_t k, float v) {
    if (j->f32) ((float *)j->out)[n * j->ldo + k] = v;
    else ((uint16_t *)j->out)[n * j->ldo + k] = nyb_bf16_bits(v);
}

static void nyb_qd_idot_col(const nyb_qd_job *j, int64_t jb, int c, int64_t n);

/* Column blocks lo .. hi. */
static void nyb_qd_range(void *ctx, int64_t lo, int64_t hi) {
    const nyb_qd_job *j = (const nyb_qd_job *)ctx;
    const nyb_qw *W = j->W;
    const int64_t K = W->K;
    for (int64_t jb = lo; jb < hi; jb++) {
        for (int c = 0; c < NYB_QG_COLS; c++) {
            const int64_t n = jb * NYB_QG_COLS + c;
            if (n >= W->N) break;
            if (!W->xq) {            /* bf16-dot layout: value by value */
                for (int64_t k = 0; k < K; k++) {
                    const int64_t gi = (k / W->group) * W->Np + n;
                    const int u = nyb_qg_q(W, k, n) + (1 << (W->bits - 1));
                    nyb_qd_put(j, n, W->perm ? W->perm[k] : k,
                               nyb_qd_value(W, gi, nyb_qg_scale(W, gi), u));
                }
                continue;
            }
            nyb_qd_idot_col(j, jb, c, n);
        }
    }
}

/* Column n (c-th of block jb) of the integer-dot layout: per 64-byte unit, the column's 4
 * bytes hold 8 (4-bit: low nibbles then high nibbles) or 4 (8-bit) consecutive inputs of one
 * group, so each unit is one scale, one integer offset and a branch-free run of 8 / 4 values
 * (the same float operations as nyb_qd_value: s (u - 2^(b-1) - zq), or s q + mo). */
static void nyb_qd_idot_col(const nyb_qd_job *j, int64_t jb, int c, int64_t n) {
    const nyb_qw *W = j->W;
    const int rows = W->bits == 4 ? 8 : 4;      /* input rows per 64-byte unit */
    const int64_t units = W->K / rows;
    const int half = 1 << (W->bits - 1);
    float v[8];
    float *of = j->f32 ? (float *)j->out + n * j->ldo : NULL;
    uint16_t *ob = j->f32 ? NULL : (uint16_t *)j->out + n * j->ldo;
    for (int64_t u = 0; u < units; u++) {
        const uint8_t *b = nyb_id_unit(W, jb, u) + 4 * c;
        const int64_t k0 = u * rows, gi = (k0 / W->group) * W->Np + n;
        const float s = nyb_qg_scale(W, gi);
        const int off = half + (W->mode == NYB_QG_ZERO ? (int)W->zq[gi] : 0);
        if (rows == 8) {
            for (int i = 0; i < 4; i++) {
                v[i] = s * (float)((b[i] & 0xf) - off);
                v[i + 4] = s * (float)((b[i] >> 4) - off);
            }
        } else {
            for (int i = 0; i < 4; i++) v[i] = s * (float)(b[i] - off);
        }
        if (W->mode == NYB_QG_MIN) {
            const float mo = W->mo[gi];
            for (int i = 0; i < rows; i++) v[i] += mo;
        }
        if (W->perm) {
            for (int i = 0; i < rows; i++) {
                const int64_t k = W->perm[k0 + i];
                if (of) of[k] = v[i]; else ob[k] = nyb_bf16_bits(v[i]);
            }
        } else if (of) {
            for (int i = 0; i < rows; i++) of[k0 + i] = v[i];
        } else {
            for (int i = 0; i < rows; i++) ob[k0 + i] = nyb_bf16_bits(v[i]);
        }
    }
}

/* out [N, K] bf16 bits (row stride ldo >= K) = the dequantized weight, original input order. */
static void nyb_qdequant_bf16(const nyb_qw *W, uint16_t *out, int64_t ldo) {
    nyb_qd_job job = {W, out, ldo, 0};
    const int64_t Nb = (W->N + NYB_QG_COLS - 1) / NYB_QG_COLS;
    nyb_parallel_for(Nb, nyb_pool_chunk(Nb, 4), nyb_qd_range, &job);
}

/* out [N, K] float32 (row stride ldo >= K) = the dequantized weight (the float32 values
 * before bf16_bits' rounding), original input order. */
static void nyb_qdequant_f32(const nyb_qw *W, float *out, int64_t ldo) {
    nyb_qd_job job = {W, out, ldo, 1};
    const int64_t Nb = (W->N + NYB_QG_COLS - 1) / NYB_QG_COLS;
    nyb_parallel_for(Nb, nyb_pool_chunk(Nb, 4), nyb_qd_range, &job);
}

#endif
