/*
 * Internal entry points shared between the native CPU sources (one library):
 * the pieces that the public kernels and the fused decode step
 * (cpu_step.c) both run, so both compute bit for bit the same values.
 * Nothing here is exported from the library; the Python side sees only the
 * fuel_* functions of each source file.
 *
 * Every function here runs on the calling thread (no OpenMP region of its
 * own), so it may be called inside a parallel region.
 */
#ifndef FUEL_INTERNAL_H
#define FUEL_INTERNAL_H

#include <stdint.h>

#define FUEL_HIDDEN __attribute__((visibility("hidden")))
#define FUEL_QK 32

/* ---- block-quantized weights (cpu_quant.c) ---------------------------- */

/* A weight W [n, k] in a block format (kernels/quant_linear.py):
 * qtype 0 = Q8_0: qs [n, k] int8, d [n, k / 32] fp16; m unused.
 * qtype 1 = Q4_1: qs [n, nb / 2, 32] nibble pairs, d and m [n, nb] fp16,
 *                 nb = k / 32 rounded up to even.
 * bias [n] or NULL. Layout shared with ctypes (kernels/cpu_native.py). */
typedef struct {
    const uint8_t *qs;
    const uint16_t *d;
    const uint16_t *m;
    const float *bias;
    int64_t n;
    int64_t k;
    int32_t qtype;
    int32_t layout; /* FUEL_LAYOUT_ROWS or FUEL_LAYOUT_X16 */
} fuel_qweight;

/* Weight layouts: row-major blocks (above), or 16 rows interleaved per block
 * (cpu_quant.c, x16_tile; AVX-512 VNNI builds only). */
#define FUEL_LAYOUT_ROWS 0
#define FUEL_LAYOUT_X16 1

/* Bytes per quantized activation row of nb blocks: the hi plane (nb * 32
 * int8), the lo plane (nb * 32 int8), then each block's code sum (nb int32);
 * see cpu_quant.c. */
#define FUEL_QX_ROW(nb) ((nb) * (2 * FUEL_QK + 4))

/* Blocks per activation row for a weight of this type and width. */
FUEL_HIDDEN int64_t fuel_qx_blocks(int qtype, int64_t k);

/* Quantize activation rows [r0, r1) of x [*, k] (row stride k) into 32-blocks
 * of 15-bit codes: qx [*, FUEL_QX_ROW(nb)] (hi plane, lo plane), dx and sx
 * [*, nb] (scale per code, scale * sum of codes); blocks past k / 32 (Q4_1's
 * padding block) are zero. */
FUEL_HIDDEN void fuel_qx_quantize_rows(const float *x, int64_t k, int64_t nb, int64_t r0,
                                       int64_t r1, int8_t *qx, float *dx, float *sx);

/* Blocks [b0, b1) of activation row r only (same layout and values). */
FUEL_HIDDEN void fuel_qx_quantize_span(const float *x, int64_t k, int64_t nb, int64_t r, int64_t b0,
                                       int64_t b1, int8_t *qx, float *dx, float *sx);

/* y[r, j] = sum_i x[r, i] W[j, i] (+ bias[j]) for weight rows j in [n0, n1)
 * and all rows r < rows of the quantized activations (from
 * fuel_qx_quantize_rows, nb blocks per row). y has row stride y_stride and
 * its column j is written at y + r * y_stride + (j - y_col0).
 * Each output is computed by the same sequence of operations whatever
 * n0, n1 and rows are, so results do not depend on the batch or the split. */
FUEL_HIDDEN void fuel_qgemm_rows(const fuel_qweight *w, const int8_t *qx, const float *dx,
                                 const float *sx, int64_t nb, int64_t rows, int64_t n0,
                                 int64_t n1, float *y, int64_t y_stride, int64_t y_col0);

/* Bit mask of the code paths this build has: 1 = AVX2 integer dots,
 * 2 = AVX-512 VNNI integer dots. */
int fuel_quant_caps(void);

/* ---- small ops (cpu_ops.c) ---------------------------------------------- */

/* One row of fuel_add_rms_norm_f32 (residual may be NULL). */
FUEL_HIDDEN void fuel_norm_row(const float *x, float *residual, const float *weight, float *out,
                               int64_t dim, float eps);

/* One row of fuel_rope_neox_f32: rotate `heads` heads of head_dim at v. */
FUEL_HIDDEN void fuel_rope_row(float *v, int64_t heads, int64_t head_dim, const float *cos_sin_row);

/* out[j] = silu(g[j]) * u[j] for j in [j0, j1); j0 a multiple of 8 (the
 * vector/scalar split is then the same as for the whole row). */
FUEL_HIDDEN void fuel_silu_mul_span(const float *g, const float *u, float *out, int64_t j0,
                                    int64_t j1);

/* ---- decode attention (cpu_attention.c) ------------------------------- */

/* Store n floats at dst as the cache's element type (fp16 when half). */
FUEL_HIDDEN void fuel_store_row(void *dst, const float *src, int64_t n, int half);

/* Attention of one query row q [hq, d] over keys [t0, t1) of a sequence
 * (block-table row `row`), all kv heads: writes the unnormalised output
 * to out [hq, d] and the per-head running max and normaliser to mx, sum
 * [hq]. *scores / *cap: a per-thread scratch buffer, grown as needed.
 * Returns 0, or -1 when the scratch could not be grown. */
FUEL_HIDDEN int fuel_decode_range(const float *q, const void *k_cache, const void *v_cache,
                                  int kv_half, const int32_t *row, int64_t t0, int64_t t1,
                                  float *out, int64_t hkv, int64_t g, int64_t d, int64_t bs,
                                  float scale, float **scores, int64_t *cap, float *mx, float *sum);

/* Merge `parts` partial outputs (part_out [parts, hq, d], part_mx and
 * part_sum [parts, hq]) of one sequence into out [hq, d], normalised. */
FUEL_HIDDEN void fuel_merge_parts(const float *part_out, const float *part_mx,
                                  const float *part_sum, int64_t parts, int64_t hq, int64_t d,
                                  float *out);

/* Scores to unnormalised softmax weights, in place: row j (of nh rows of n
 * scores) becomes exp(s - mx[j]), with mx[j] its maximum and sum[j] its total
 * (the caller divides by sum). NaN scores never win the maximum. */
FUEL_HIDDEN void fuel_softmax_rows(float *sc, int64_t n, int64_t nh, float *mx, float *sum);

/* ---- KIVI blocks (cpu_kivi.c) ------------------------------------------ */

/* A KIVI layout's numbers (kernels/kivi.py, KiviLayout and its sides); the
 * caches are uint8 [num_blocks, kside] and [num_blocks, vside]. Layout shared
 * with ctypes (kernels/cpu_native.py). */
typedef struct {
    int64_t bits, group, vgroup, ring, sink;
    int64_t kside, vside, scale_off, kzero_off, vzero_off, kresid_off, vresid_off;
} fuel_kivi;

/* Per-thread scratch of the KIVI attention (opaque); NULL when out of memory. */
typedef struct fuel_kivi_scratch fuel_kivi_scratch;
FUEL_HIDDEN fuel_kivi_scratch *fuel_kivi_scratch_new(const fuel_kivi *kv, int64_t hq, int64_t hkv,
                                                   int64_t d);
FUEL_HIDDEN void fuel_kivi_scratch_free(fuel_kivi_scratch *s);

/* Store one token's key and value rows (hkv * d floats each) at `slot`: the
 * float16 slot rows, and when the token ends its group, the group quantized
 * (kernels/kivi.py kivi_store, bit for bit). */
FUEL_HIDDEN void fuel_kivi_store_row(const fuel_kivi *kv, uint8_t *k_cache, uint8_t *v_cache,
                                     int64_t hkv, int64_t d, int64_t bs, int64_t slot,
                                     const float *k, const float *v);

/* Like fuel_decode_range, over KIVI blocks: keys [t0, t1) of one sequence of
 * n tokens, all heads. Returns 0, or -1 when the scratch could not grow. */
FUEL_HIDDEN int fuel_kivi_range(const fuel_kivi *kv, const uint8_t *k_cache,
                                const uint8_t *v_cache, int64_t hkv, int64_t d, int64_t bs,
                                const float *q, const int32_t *bt, int64_t n, int64_t t0,
                                int64_t t1, int64_t hq, float scale, float *out, float *mx,
                                float *sum, fuel_kivi_scratch *s);

/* Sequences below this many keys are never split across threads. */
#define FUEL_SPLIT_MIN_TOKENS 256

#endif /* FUEL_INTERNAL_H */
