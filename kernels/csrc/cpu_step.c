/*
 * A whole decode-only step of a Llama-family decoder in one native call.
 *
 * On the CPU, a decode step of a small model is ~10 kernel calls per layer,
 * each paying a Python dispatch, a ctypes crossing, an OpenMP fork/join and
 * its own scratch allocation; for one sequence of SmolLM2-135M those costs
 * were larger than the arithmetic. Here the threads enter one parallel region
 * for the whole step (the CPU analogue of replaying a CUDA graph over
 * persistent buffers) and meet at a barrier between phases:
 *
 *   per layer:  A  residual add + RMSNorm + 8-bit activation blocks (per row)
 *               B  qkv projection (weight rows split across threads)
 *               C  RoPE on q and k, store k/v in the paged cache (per row);
 *                  attention (per sequence, or split-K across threads for
 *                  fewer sequences than threads over long contexts)
 *               D  o projection
 *               E  residual add + RMSNorm + activation blocks
 *               F  gate and up projections, SiLU(gate) * up, activation
 *                  blocks (intermediate columns split in 32-aligned spans)
 *               G  down projection
 *   then the final residual add + RMSNorm.
 *
 * Every phase calls the same row functions as the separate kernels
 * (fuel_internal.h): norm, rope, cache store, attention ranges and merge,
 * activation quantization and the block-quantized GEMM; the split decisions
 * are the same too. So this call computes bit for bit what the layer-by-layer
 * path (engine/models/llama.py with BlockQuantLinear, NativeCpuModelOps and
 * the cpu attention backend) computes; tests/test_kernels.py checks it.
 *
 * Layouts: x [M, H] (embeddings in; used as the residual stream, so it is
 * overwritten), out [M, H] (final-normed hidden states), positions and
 * slots int64 [M] (slot -1: not stored), block_tables int32 [M, bt_stride],
 * seq_lens int32 [M] (each >= 1, counting the new token). The caller checks
 * bounds (kernels/cpu_native.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "fuel_internal.h"

/* ctypes mirrors these (kernels/cpu_native.py). */
typedef struct {
    const float *attn_norm; /* [H] */
    const float *ffn_norm;  /* [H] */
    fuel_qweight qkv;       /* [(hq + 2 hkv) d, H] */
    fuel_qweight o;         /* [H, hq d] */
    fuel_qweight gate_up;   /* [2 I, H]: gate rows, then up rows */
    fuel_qweight down;      /* [H, I] */
    void *k_cache;          /* [num_blocks, bs, hkv, d] fp32 or fp16; KIVI: uint8 rows */
    void *v_cache;
} fuel_layer;

typedef struct {
    int64_t n_layers, hidden, n_heads, n_kv_heads, head_dim, inter, block_size;
    float eps, scale;
    int32_t kv_half, reserved;
    const float *cos_sin;    /* [max_pos, d]: cos | sin */
    const float *final_norm; /* [H] */
    const fuel_layer *layers;
    /* KIVI caches (uint8 rows of this layout) instead of plain ones, or NULL. */
    const fuel_kivi *kivi;
} fuel_model;

/* This thread's share [*lo, *hi) of `units` units, in multiples of `align`. */
static inline void share(int64_t units, int64_t align, int t, int T, int64_t *lo, int64_t *hi)
{
    const int64_t chunks = (units + align - 1) / align;
    *lo = chunks * t / T * align;
    *hi = chunks * (t + 1) / T * align;
    if (*hi > units) *hi = units;
    if (*lo > units) *lo = units;
}

/* Keys [t0, t1) of one sequence, all heads (fuel_decode_range's contract),
 * over the model's plain or KIVI caches. */
static int attend(const fuel_model *md, const fuel_layer *L, const float *q, const int32_t *bt,
                  int64_t n, int64_t t0, int64_t t1, float *out, float *mx, float *sum,
                  float **scores, int64_t *cap, fuel_kivi_scratch *ks)
{
    const int64_t hq = md->n_heads, hkv = md->n_kv_heads, d = md->head_dim, bs = md->block_size;
    if (md->kivi != NULL)
        return ks == NULL ? -1
                          : fuel_kivi_range(md->kivi, L->k_cache, L->v_cache, hkv, d, bs, q, bt, n,
                                            t0, t1, hq, md->scale, out, mx, sum, ks);
    return fuel_decode_range(q, L->k_cache, L->v_cache, md->kv_half, bt, t0, t1, out, hkv,
                             hq / hkv, d, bs, md->scale, scores, cap, mx, sum);
}

/* One function of ~180 lines, against the house's ~80: the phases must share
 * one OpenMP region (that is the point: one fork/join per step, barriers
 * between phases) and its thread-private scratch, so they cannot become
 * separate functions with their own regions; each phase is a few calls to
 * the shared row functions. */
int fuel_decode_step_f32(const fuel_model *md, float *x, int64_t M, const int64_t *positions,
                         const int64_t *slots, const int32_t *block_tables, int64_t bt_stride,
                         const int32_t *seq_lens, float *out, int num_threads)
{
    const int64_t H = md->hidden, hq = md->n_heads, hkv = md->n_kv_heads, d = md->head_dim;
    const int64_t I = md->inter, bs = md->block_size;
    const int64_t nqkv = (hq + 2 * hkv) * d, natt = hq * d, tok = hkv * d;
    const int qt = md->layers[0].qkv.qtype;
    /* Weight rows per thread in whole tiles of the layout. */
    const int64_t unit = md->layers[0].qkv.layout == FUEL_LAYOUT_X16 ? 16 : 4;
    const int64_t nbH = fuel_qx_blocks(qt, H), nbA = fuel_qx_blocks(qt, natt);
    const int64_t nbI = fuel_qx_blocks(qt, I), nbmax = nbH > nbA ? (nbH > nbI ? nbH : nbI)
                                                                 : (nbA > nbI ? nbA : nbI);
    int64_t max_len = 0;
    for (int64_t i = 0; i < M; ++i) max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
    /* The decode kernel's split rule (cpu_attention.c), so results match it. */
    const int64_t parts = M < num_threads && max_len >= FUEL_SPLIT_MIN_TOKENS ? num_threads : 1;

    float *xn = malloc(sizeof(float) * (size_t)(M * H));
    float *delta = malloc(sizeof(float) * (size_t)(M * H));
    float *qkv = malloc(sizeof(float) * (size_t)(M * nqkv));
    float *att = malloc(sizeof(float) * (size_t)(M * natt));
    float *gate = malloc(sizeof(float) * (size_t)(M * I));
    float *up = malloc(sizeof(float) * (size_t)(M * I));
    int8_t *qa = malloc((size_t)(M * FUEL_QX_ROW(nbmax)));
    float *da = malloc(sizeof(float) * (size_t)(M * nbmax));
    float *sa = malloc(sizeof(float) * (size_t)(M * nbmax));
    float *part_out = NULL, *part_mx = NULL, *part_sum = NULL;
    if (parts > 1) {
        part_out = malloc(sizeof(float) * (size_t)(M * parts * natt));
        part_mx = malloc(sizeof(float) * (size_t)(M * parts * hq));
        part_sum = malloc(sizeof(float) * (size_t)(M * parts * hq));
    }
    int failed = !xn || !delta || !qkv || !att || !gate || !up || !qa || !da || !sa ||
                 (parts > 1 && (!part_out || !part_mx || !part_sum));
    if (failed) goto done;

    const int nt = num_threads > 1 ? num_threads : 1;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
#else
        const int t = 0, T = 1;
#endif
        float *scores = NULL;
        int64_t cap = 0;
        int64_t lo, hi;
        fuel_kivi_scratch *kscratch = md->kivi ? fuel_kivi_scratch_new(md->kivi, hq, hkv, d) : NULL;
        if (md->kivi && kscratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t l = 0; l < md->n_layers; ++l) {
            const fuel_layer *L = md->layers + l;
            /* A: h = delta + x (x is the residual stream), xn = norm(h), blocks. */
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; ++r) {
                if (l == 0)
                    fuel_norm_row(x + r * H, NULL, L->attn_norm, xn + r * H, H, md->eps);
                else
                    fuel_norm_row(delta + r * H, x + r * H, L->attn_norm, xn + r * H, H, md->eps);
                fuel_qx_quantize_rows(xn, H, nbH, r, r + 1, qa, da, sa);
            }
            /* B: qkv = xn @ Wqkv^T */
            share(nqkv, unit, t, T, &lo, &hi);
            if (lo < hi) fuel_qgemm_rows(&L->qkv, qa, da, sa, nbH, M, lo, hi, qkv, nqkv, 0);
#pragma omp barrier
            /* C1: RoPE (q and k heads, in place), then store k and v. */
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; ++r) {
                float *row = qkv + r * nqkv;
                fuel_rope_row(row, hq + hkv, d, md->cos_sin + positions[r] * d);
                if (slots[r] >= 0 && md->kivi) {
                    fuel_kivi_store_row(md->kivi, L->k_cache, L->v_cache, hkv, d, bs, slots[r],
                                        row + natt, row + natt + tok);
                } else if (slots[r] >= 0) {
                    const size_t at = (size_t)(slots[r] * tok) * (md->kv_half ? 2 : 4);
                    fuel_store_row((char *)L->k_cache + at, row + natt, tok, md->kv_half);
                    fuel_store_row((char *)L->v_cache + at, row + natt + tok, tok, md->kv_half);
                }
            }
            /* C2: attention; without a split the item's owner also makes the
             * o projection's activation blocks. */
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < M * parts; ++it) {
                const int64_t i = it / parts, p = it % parts;
                const int32_t *bt = block_tables + i * bt_stride;
                const float *q = qkv + i * nqkv;
                const int64_t n = seq_lens[i];
                int rc = 0;
                if (parts == 1) {
                    float mx[hq], sum[hq];
                    float *o = att + i * natt;
                    rc = attend(md, L, q, bt, n, 0, n, o, mx, sum, &scores, &cap, kscratch);
                    for (int64_t j = 0; j < hq && rc == 0; ++j) {
                        const float inv = 1.0f / sum[j];
                        for (int64_t c = 0; c < d; ++c) o[j * d + c] *= inv;
                    }
                    if (rc == 0) fuel_qx_quantize_rows(att, natt, nbA, i, i + 1, qa, da, sa);
                } else {
                    const int64_t t0 = n * p / parts, t1 = n * (p + 1) / parts;
                    float *po = part_out + it * natt, *pm = part_mx + it * hq,
                          *ps = part_sum + it * hq;
                    if (t0 == t1) { /* an empty range contributes nothing */
                        for (int64_t j = 0; j < hq; ++j) {
                            pm[j] = -INFINITY;
                            ps[j] = 0.0f;
                        }
                        memset(po, 0, sizeof(float) * (size_t)natt);
                    } else {
                        rc = attend(md, L, q, bt, n, t0, t1, po, pm, ps, &scores, &cap,
                                    kscratch);
                    }
                }
                if (rc != 0) {
#pragma omp atomic write
                    failed = 1;
                }
            }
            if (parts > 1) {
                /* C3: merge the split parts, then the activation blocks. */
#pragma omp for schedule(static)
                for (int64_t i = 0; i < M; ++i) {
                    fuel_merge_parts(part_out + i * parts * natt, part_mx + i * parts * hq,
                                     part_sum + i * parts * hq, parts, hq, d, att + i * natt);
                    fuel_qx_quantize_rows(att, natt, nbA, i, i + 1, qa, da, sa);
                }
            }
            /* D: delta = att @ Wo^T */
            share(H, unit, t, T, &lo, &hi);
            if (lo < hi) fuel_qgemm_rows(&L->o, qa, da, sa, nbA, M, lo, hi, delta, H, 0);
#pragma omp barrier
            /* E: h = delta + x, xn = norm(h), blocks. */
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; ++r) {
                fuel_norm_row(delta + r * H, x + r * H, L->ffn_norm, xn + r * H, H, md->eps);
                fuel_qx_quantize_rows(xn, H, nbH, r, r + 1, qa, da, sa);
            }
            /* F: gate and up columns [lo, hi) of the intermediate, SiLU(gate) * up
             * into `gate`, then those columns' activation blocks (32-aligned
             * spans, so each thread owns whole blocks). */
            share(I, FUEL_QK, t, T, &lo, &hi);
            if (lo < hi) {
                fuel_qgemm_rows(&L->gate_up, qa, da, sa, nbH, M, lo, hi, gate, I, 0);
                fuel_qgemm_rows(&L->gate_up, qa, da, sa, nbH, M, I + lo, I + hi, up, I, I);
                for (int64_t r = 0; r < M; ++r)
                    fuel_silu_mul_span(gate + r * I, up + r * I, gate + r * I, lo, hi);
            }
            /* Every thread reads xn's blocks in F: only then may they be overwritten. */
#pragma omp barrier
            if (lo < hi) {
                const int64_t b0 = lo / FUEL_QK, b1 = hi == I ? nbI : hi / FUEL_QK;
                for (int64_t r = 0; r < M; ++r)
                    fuel_qx_quantize_span(gate, I, nbI, r, b0, b1, qa, da, sa);
            }
#pragma omp barrier
            /* G: delta = act @ Wdown^T */
            share(H, unit, t, T, &lo, &hi);
            if (lo < hi) fuel_qgemm_rows(&L->down, qa, da, sa, nbI, M, lo, hi, delta, H, 0);
#pragma omp barrier
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; ++r)
            fuel_norm_row(delta + r * H, x + r * H, md->final_norm, out + r * H, H, md->eps);
        free(scores);
        fuel_kivi_scratch_free(kscratch);
    }
done:
    free(xn);
    free(delta);
    free(qkv);
    free(att);
    free(gate);
    free(up);
    free(qa);
    free(da);
    free(sa);
    free(part_out);
    free(part_mx);
    free(part_sum);
    return failed ? -1 : 0;
}
