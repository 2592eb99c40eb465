/*
 * Paged decode attention for the CPU, fp32.
 *
 * Each decode sequence has one query token; it attends over its first
 * seq_lens[i] cached positions, read in place from the paged cache through
 * its block-table row (no gather, no padding, no mask). A work item is a
 * sequence; the keys and values it reads serve all g query heads of each kv head
 * (grouped-query attention). Scores are kept in a per-thread scratch buffer,
 * so K and V are each read once.
 *
 * Layouts (C-contiguous, fp32):
 *   q, out:           [nd, hq, d]
 *   k_cache, v_cache: [num_blocks, bs, hkv, d]
 *   block_tables:     int32 [nd, bt_stride]; only the first ceil(len / bs)
 *                     entries of a row are read.
 *   seq_lens:         int32 [nd], each >= 1.
 *
 * The torch reference is kernels.paged_attention.paged_attention_ref; the
 * loader and the Python signature are in kernels/cpu_native.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* GCC/Clang vector extensions: portable SIMD (AVX2 here, NEON elsewhere). */
typedef float v8f __attribute__((vector_size(32)));

static inline v8f load8(const float *p)
{
    v8f v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

static inline float hsum8(v8f v)
{
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* q . k over d floats. Two independent vector accumulators when d is a
 * multiple of 16 (head sizes 64/128/256), so FMA latency is not the bound. */
static inline float dot(const float *a, const float *b, int64_t d)
{
    if ((d & 15) == 0) {
        v8f a0 = {0}, a1 = {0};
        for (int64_t c = 0; c < d; c += 16) {
            a0 += load8(a + c) * load8(b + c);
            a1 += load8(a + c + 8) * load8(b + c + 8);
        }
        return hsum8(a0 + a1);
    }
    float acc = 0.0f;
    for (int64_t c = 0; c < d; ++c) acc += a[c] * b[c];
    return acc;
}

/* One work item: sequence i, kv heads [h0, h1). Returns 0, or -1 when the
 * scratch buffer could not be grown. */
static int decode_item(
    const float *q, const float *k_cache, const float *v_cache, const int32_t *row,
    int64_t n, float *out, int64_t hq, int64_t h0, int64_t h1, int64_t g, int64_t d,
    int64_t bs, int64_t tok_stride, int64_t blk_stride, float scale, float **scores,
    int64_t *cap)
{
    const int64_t nh = (h1 - h0) * g; /* query heads in this item */
    const float *qh = q + h0 * g * d;
    float *oh = out + h0 * g * d;
    if (n * nh > *cap) {
        free(*scores);
        *cap = n * nh;
        *scores = (float *)malloc((size_t)(*cap) * sizeof(float));
        if (*scores == NULL) {
            *cap = 0;
            return -1;
        }
    }
    float *sc = *scores;
    float mx[nh];
    for (int64_t j = 0; j < nh; ++j) mx[j] = -INFINITY;
    /* Pass 1: scores. A token's row holds every kv head contiguously, so one
     * item reads each row once for all of its heads. */
    for (int64_t t = 0; t < n; ++t) {
        const float *kr = k_cache + (int64_t)row[t / bs] * blk_stride + (t % bs) * tok_stride;
        for (int64_t j = 0; j < nh; ++j) {
            const float s = dot(qh + j * d, kr + (h0 + j / g) * d, d) * scale;
            sc[j * n + t] = s;
            if (s > mx[j]) mx[j] = s;
        }
    }
    /* Softmax, unnormalised; 1/sum is applied to the output at the end. */
    float inv[nh];
    for (int64_t j = 0; j < nh; ++j) {
        float *sj = sc + j * n;
        float sum = 0.0f;
        for (int64_t t = 0; t < n; ++t) {
            const float e = expf(sj[t] - mx[j]);
            sj[t] = e;
            sum += e;
        }
        inv[j] = 1.0f / sum;
    }
    /* Pass 2: weighted sum of values. */
    memset(oh, 0, (size_t)(nh * d) * sizeof(float));
    for (int64_t t = 0; t < n; ++t) {
        const float *vr = v_cache + (int64_t)row[t / bs] * blk_stride + (t % bs) * tok_stride;
        for (int64_t j = 0; j < nh; ++j) {
            const float p = sc[j * n + t];
            const float *vp = vr + (h0 + j / g) * d;
            float *oj = oh + j * d;
            for (int64_t c = 0; c < d; ++c) oj[c] += p * vp[c];
        }
    }
    for (int64_t j = 0; j < nh; ++j) {
        float *oj = oh + j * d;
        for (int64_t c = 0; c < d; ++c) oj[c] *= inv[j];
    }
    return 0;
}

int fuel_paged_decode_attention_f32(
    const float *q, const float *k_cache, const float *v_cache,
    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
    float *out, int64_t nd, int64_t hq, int64_t hkv, int64_t d, int64_t bs,
    float scale, int num_threads)
{
    const int64_t g = hq / hkv;
    const int64_t tok_stride = hkv * d;
    const int64_t blk_stride = bs * tok_stride;
    /* One item per sequence, all of its kv heads: each cache row (every head
     * of one token, contiguous) is then read once, front to back. Splitting a
     * sequence's heads across threads instead was measured 1.6x slower per
     * decode step at 1,100 tokens of context: the threads then stride through
     * the same rows and defeat the hardware prefetcher. */
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
        float *scores = NULL;
        int64_t cap = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < nd; ++i) {
            if (decode_item(q + i * hq * d, k_cache, v_cache, block_tables + i * bt_stride,
                            seq_lens[i], out + i * hq * d, hq, 0, hkv, g, d, bs, tok_stride,
                            blk_stride, scale, &scores, &cap) != 0) {
#pragma omp atomic write
                failed = 1;
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* The whole attention of a decode-only step in one call: for each sequence i,
 * store its new key/value row into cache slot slots[i] (skipped when < 0, a
 * padding row), then attend as fuel_paged_decode_attention_f32 does. q, k and
 * v are read in place from one fused projection output: row i of q starts at
 * qkv + i * row_stride, its k at + k_off, its v at + v_off (floats). Each
 * sequence writes only its own slot before reading its own blocks, so items
 * stay independent. out: [nd, hq, d] contiguous. */
int fuel_paged_decode_store_attention_f32(
    const float *qkv, int64_t row_stride, int64_t k_off, int64_t v_off, float *k_cache,
    float *v_cache, const int64_t *slots, const int32_t *block_tables, int64_t bt_stride,
    const int32_t *seq_lens, float *out, int64_t nd, int64_t hq, int64_t hkv, int64_t d,
    int64_t bs, float scale, int num_threads)
{
    const int64_t g = hq / hkv;
    const int64_t tok_stride = hkv * d;
    const int64_t blk_stride = bs * tok_stride;
    const int nt = nd < num_threads ? (int)nd : num_threads;
    int failed = 0;

#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *scores = NULL;
        int64_t cap = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < nd; ++i) {
            const float *row = qkv + i * row_stride;
            if (slots[i] >= 0) {
                memcpy(k_cache + slots[i] * tok_stride, row + k_off,
                       (size_t)tok_stride * sizeof(float));
                memcpy(v_cache + slots[i] * tok_stride, row + v_off,
                       (size_t)tok_stride * sizeof(float));
            }
            if (decode_item(row, k_cache, v_cache, block_tables + i * bt_stride, seq_lens[i],
                            out + i * hq * d, hq, 0, hkv, g, d, bs, tok_stride, blk_stride, scale,
                            &scores, &cap) != 0) {
#pragma omp atomic write
                failed = 1;
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
