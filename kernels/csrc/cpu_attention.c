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
 * Layouts (C-contiguous; fp32 unless noted):
 *   q, out:           [nd, hq, d]
 *   k_cache, v_cache: [num_blocks, bs, hkv, d], fp32 or (kv_half) IEEE fp16,
 *                     converted to fp32 as read (F16C where the CPU has it)
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

#include "fuel_internal.h"
#include "fuel_vec.h"

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

#include "fuel_half.h"

#ifdef __AVX__
#include <immintrin.h>
#endif

/* Tokens per chunk of the fast weighted sum (see DEFINE_DECODE_RANGE_FAST). */
#define FUEL_V_CHUNK 128

static inline v8f load8h(const uint16_t *p)
{
#ifdef FUEL_F16C
    v8f v;
    const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    memcpy(&v, &f, sizeof v);
    return v;
#else
    v8f v;
    for (int i = 0; i < 8; ++i) v[i] = h2f(p[i]);
    return v;
#endif
}

/* q . k with k in fp16 (see dot). */
static inline float dot_h(const float *a, const uint16_t *b, int64_t d)
{
    if ((d & 15) == 0) {
        v8f a0 = {0}, a1 = {0};
        for (int64_t c = 0; c < d; c += 16) {
            a0 += load8(a + c) * load8h(b + c);
            a1 += load8(a + c + 8) * load8h(b + c + 8);
        }
        return hsum8(a0 + a1);
    }
    float acc = 0.0f;
    for (int64_t c = 0; c < d; ++c) acc += a[c] * h2f(b[c]);
    return acc;
}

/* o += p * v over d values. */
static inline void axpy(float *o, float p, const float *v, int64_t d)
{
    for (int64_t c = 0; c < d; ++c) o[c] += p * v[c];
}

static inline void axpy_h(float *o, float p, const uint16_t *v, int64_t d)
{
    int64_t c = 0;
    for (; c + 8 <= d; c += 8) {
        const v8f r = load8(o + c) + p * load8h(v + c);
        memcpy(o + c, &r, sizeof r);
    }
    for (; c < d; ++c) o[c] += p * h2f(v[c]);
}

/* Store n floats as the cache's element type. */
void fuel_store_row(void *dst, const float *src, int64_t n, int half)
{
    if (!half) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *h = (uint16_t *)dst;
    int64_t c = 0;
#ifdef FUEL_F16C
    for (; c + 8 <= n; c += 8)
        _mm_storeu_si128((__m128i *)(h + c), _mm256_cvtps_ph(_mm256_loadu_ps(src + c), 0));
#endif
    for (; c < n; ++c) h[c] = f2h(src[c]);
}

/* The per-thread scores buffer, grown to hold n floats (n >= 1); NULL when it
 * cannot be grown. */
static float *scores_for(float **scores, int64_t *cap, int64_t n)
{
    if (n > *cap) {
        free(*scores);
        *scores = (float *)malloc((size_t)n * sizeof(float));
        *cap = *scores != NULL ? n : 0;
    }
    return *scores;
}

void fuel_softmax_rows(float *sc, int64_t n, int64_t nh, float *mx, float *sum)
{
    for (int64_t j = 0; j < nh; ++j) {
        float *sj = sc + j * n;
        /* NaN scores never win a comparison, as in a scalar running max. */
        v8f vm = (v8f){0} - INFINITY;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            const v8f x = load8(sj + i);
            vm = select8(x > vm, x, vm);
        }
        float m = -INFINITY;
        for (int u = 0; u < 8; ++u) m = vm[u] > m ? vm[u] : m;
        for (; i < n; ++i) m = sj[i] > m ? sj[i] : m;
        mx[j] = m;
        v8f acc = {0};
        for (i = 0; i + 8 <= n; i += 8) {
            const v8f e = exp8(load8(sj + i) - m);
            memcpy(sj + i, &e, sizeof e);
            acc += e;
        }
        float total = hsum8(acc);
        for (; i < n; ++i) {
            const float e = expf(sj[i] - m);
            sj[i] = e;
            total += e;
        }
        sum[j] = total;
    }
}

/* Keys [t0, t1) of one sequence for kv heads [h0, h1): writes the
 * unnormalised output sum_t exp(s_t - mx) v_t of each query head to out (at
 * its head offsets), with mx and sum (the normaliser) per query head.
 * Returns 0, or -1 when the scratch buffer could not be grown. One body, two
 * cache element types (KT), so the fp32 loop carries no per-element branch. */
#define DEFINE_DECODE_RANGE(NAME, KT, DOT, AXPY)                                                  \
    static int NAME(const float *q, const KT *k_cache, const KT *v_cache, const int32_t *row,     \
                    int64_t t0, int64_t t1, float *out, int64_t h0, int64_t h1, int64_t g,        \
                    int64_t d, int64_t bs, int64_t tok_stride, int64_t blk_stride, float scale,   \
                    float **scores, int64_t *cap, float *mx, float *sum)                          \
    {                                                                                             \
        const int64_t nh = (h1 - h0) * g; /* query heads in this item */                         \
        const int64_t n = t1 - t0;                                                                \
        const float *qh = q + h0 * g * d;                                                         \
        float *oh = out + h0 * g * d;                                                             \
        float *sc = scores_for(scores, cap, n * nh);                                              \
        if (sc == NULL) return -1;                                                                \
        /* Pass 1: scores. A token's row holds every kv head contiguously, so one                 \
         * item reads each row once for all of its heads. */                                      \
        for (int64_t t = t0; t < t1; ++t) {                                                       \
            const KT *kr = k_cache + (int64_t)row[t / bs] * blk_stride + (t % bs) * tok_stride;   \
            for (int64_t j = 0; j < nh; ++j) {                                                    \
                const float s = DOT(qh + j * d, kr + (h0 + j / g) * d, d) * scale;                \
                sc[j * n + t - t0] = s;                                                           \
            }                                                                                     \
        }                                                                                         \
        fuel_softmax_rows(sc, n, nh, mx, sum);                                                         \
        /* Pass 2: weighted sum of values. */                                                     \
        memset(oh, 0, (size_t)(nh * d) * sizeof(float));                                          \
        for (int64_t t = t0; t < t1; ++t) {                                                       \
            const KT *vr = v_cache + (int64_t)row[t / bs] * blk_stride + (t % bs) * tok_stride;   \
            for (int64_t j = 0; j < nh; ++j)                                                      \
                AXPY(oh + j * d, sc[j * n + t - t0], vr + (h0 + j / g) * d, d);                   \
        }                                                                                         \
        return 0;                                                                                 \
    }

DEFINE_DECODE_RANGE(decode_range_f32, float, dot, axpy)
DEFINE_DECODE_RANGE(decode_range_f16, uint16_t, dot_h, axpy_h)

/* The fast body of decode_range for head sizes that are multiples of 64 (64,
 * 128, 256: every model we serve); decode_range_* above is the general one.
 * Same contract. Why it is faster, measured at 1,000 tokens of fp16 context:
 * - scores for 8 tokens at once, reduced by one transpose-add (hsum8x8) rather
 *   than a horizontal sum per (token, head);
 * - the weighted sum keeps 64 output channels in 8 registers over all tokens,
 *   instead of loading and storing the output row for every token;
 * - tokens are walked block by block, with no division per token. */
#define DEFINE_DECODE_RANGE_FAST(NAME, KT, LOAD8)                                                \
    static int NAME(const float *q, const KT *k_cache, const KT *v_cache, const int32_t *row,     \
                    int64_t t0, int64_t t1, float *out, int64_t h0, int64_t h1, int64_t g,        \
                    int64_t d, int64_t bs, int64_t tok_stride, int64_t blk_stride, float scale,   \
                    float **scores, int64_t *cap, float *mx, float *sum)                          \
    {                                                                                             \
        const int64_t nh = (h1 - h0) * g;                                                         \
        const int64_t n = t1 - t0;                                                                \
        const float *qh = q + h0 * g * d;                                                         \
        float *oh = out + h0 * g * d;                                                             \
        float *sc = scores_for(scores, cap, n * nh);                                              \
        if (sc == NULL) return -1;                                                                \
        /* Pass 1: scores, 8 tokens at a time (their rows may span two blocks). */                \
        int64_t b = t0 / bs, off = t0 % bs, t = t0;                                               \
        for (; t + 8 <= t1; t += 8) {                                                             \
            const KT *kr[8];                                                                      \
            for (int u = 0; u < 8; ++u) {                                                         \
                kr[u] = k_cache + (int64_t)row[b] * blk_stride + off * tok_stride;                \
                if (++off == bs) {                                                                \
                    off = 0;                                                                      \
                    ++b;                                                                          \
                }                                                                                 \
            }                                                                                     \
            for (int64_t j = 0; j < nh; ++j) {                                                    \
                const float *qj = qh + j * d;                                                     \
                const int64_t ko = (h0 + j / g) * d;                                              \
                v8f acc[8] = {{0}};                                                               \
                for (int64_t c = 0; c < d; c += 8) {                                              \
                    const v8f qv = load8(qj + c);                                                 \
                    for (int u = 0; u < 8; ++u) acc[u] += qv * LOAD8(kr[u] + ko + c);             \
                }                                                                                 \
                const v8f s = hsum8x8(acc) * scale;                                               \
                memcpy(sc + j * n + (t - t0), &s, sizeof s);                                      \
            }                                                                                     \
        }                                                                                         \
        for (; t < t1; ++t) {                                                                     \
            const KT *kr = k_cache + (int64_t)row[b] * blk_stride + off * tok_stride;             \
            if (++off == bs) {                                                                    \
                off = 0;                                                                          \
                ++b;                                                                              \
            }                                                                                     \
            for (int64_t j = 0; j < nh; ++j) {                                                    \
                const float *qj = qh + j * d;                                                     \
                const KT *kj = kr + (h0 + j / g) * d;                                             \
                v8f acc = {0};                                                                    \
                for (int64_t c = 0; c < d; c += 8) acc += load8(qj + c) * LOAD8(kj + c);          \
                sc[j * n + (t - t0)] = hsum8(acc) * scale;                                        \
            }                                                                                     \
        }                                                                                         \
        fuel_softmax_rows(sc, n, nh, mx, sum);                                                         \
        /* Pass 2: weighted sum of values, 64 output channels in registers, over       \
         * chunks of FUEL_V_CHUNK tokens: the g query heads of one kv head read the     \
         * same chunk of value rows while it is in L1 (over the whole range at once,    \
         * each would stream a long context's values from memory again).                \
         * Chunks start at block boundaries, so a chunk's rows are walked per block. */ \
        memset(oh, 0, (size_t)(nh * d) * sizeof(float));                                          \
        for (int64_t tc = t0; tc < t1;) {                                                         \
            int64_t te = (tc / bs + 1) * bs;                                                      \
            while (te - tc < FUEL_V_CHUNK && te < t1) te += bs;                                   \
            if (te > t1) te = t1;                                                                 \
            for (int64_t j = 0; j < nh; ++j) {                                                    \
                const float *pj = sc + j * n - t0;                                                \
                const int64_t vo = (h0 + j / g) * d;                                              \
                for (int64_t c0 = 0; c0 < d; c0 += 64) {                                          \
                    float *o = oh + j * d + c0;                                                   \
                    v8f a0 = load8(o), a1 = load8(o + 8), a2 = load8(o + 16), a3 = load8(o + 24); \
                    v8f a4 = load8(o + 32), a5 = load8(o + 40), a6 = load8(o + 48);               \
                    v8f a7 = load8(o + 56);                                                       \
                    for (int64_t tt = tc; tt < te;) {                                             \
                        const int64_t bb = tt / bs;                                               \
                        const int64_t end = (bb + 1) * bs < te ? (bb + 1) * bs : te;              \
                        const KT *vr = v_cache + (int64_t)row[bb] * blk_stride +                  \
                                       (tt - bb * bs) * tok_stride + vo + c0;                     \
                        for (; tt < end; ++tt, vr += tok_stride) {                                \
                            const float p = pj[tt];                                               \
                            a0 += p * LOAD8(vr);                                                  \
                            a1 += p * LOAD8(vr + 8);                                              \
                            a2 += p * LOAD8(vr + 16);                                             \
                            a3 += p * LOAD8(vr + 24);                                             \
                            a4 += p * LOAD8(vr + 32);                                             \
                            a5 += p * LOAD8(vr + 40);                                             \
                            a6 += p * LOAD8(vr + 48);                                             \
                            a7 += p * LOAD8(vr + 56);                                             \
                        }                                                                         \
                    }                                                                             \
                    memcpy(o, &a0, sizeof a0);                                                    \
                    memcpy(o + 8, &a1, sizeof a1);                                                \
                    memcpy(o + 16, &a2, sizeof a2);                                               \
                    memcpy(o + 24, &a3, sizeof a3);                                               \
                    memcpy(o + 32, &a4, sizeof a4);                                               \
                    memcpy(o + 40, &a5, sizeof a5);                                               \
                    memcpy(o + 48, &a6, sizeof a6);                                               \
                    memcpy(o + 56, &a7, sizeof a7);                                               \
                }                                                                                 \
            }                                                                                     \
            tc = te;                                                                              \
        }                                                                                         \
        return 0;                                                                                 \
    }

DEFINE_DECODE_RANGE_FAST(decode_range_fast_f32, float, load8)
DEFINE_DECODE_RANGE_FAST(decode_range_fast_f16, uint16_t, load8h)

static int decode_range(const float *q, const void *k_cache, const void *v_cache, int kv_half,
                        const int32_t *row, int64_t t0, int64_t t1, float *out, int64_t h0,
                        int64_t h1, int64_t g, int64_t d, int64_t bs, int64_t tok_stride,
                        int64_t blk_stride, float scale, float **scores, int64_t *cap, float *mx,
                        float *sum)
{
    if ((d & 63) == 0) {
        if (kv_half)
            return decode_range_fast_f16(q, (const uint16_t *)k_cache, (const uint16_t *)v_cache,
                                         row, t0, t1, out, h0, h1, g, d, bs, tok_stride,
                                         blk_stride, scale, scores, cap, mx, sum);
        return decode_range_fast_f32(q, (const float *)k_cache, (const float *)v_cache, row, t0,
                                     t1, out, h0, h1, g, d, bs, tok_stride, blk_stride, scale,
                                     scores, cap, mx, sum);
    }
    if (kv_half)
        return decode_range_f16(q, (const uint16_t *)k_cache, (const uint16_t *)v_cache, row, t0,
                                t1, out, h0, h1, g, d, bs, tok_stride, blk_stride, scale, scores,
                                cap, mx, sum);
    return decode_range_f32(q, (const float *)k_cache, (const float *)v_cache, row, t0, t1, out,
                            h0, h1, g, d, bs, tok_stride, blk_stride, scale, scores, cap, mx, sum);
}

int fuel_decode_range(const float *q, const void *k_cache, const void *v_cache, int kv_half,
                      const int32_t *row, int64_t t0, int64_t t1, float *out, int64_t hkv,
                      int64_t g, int64_t d, int64_t bs, float scale, float **scores, int64_t *cap,
                      float *mx, float *sum)
{
    return decode_range(q, k_cache, v_cache, kv_half, row, t0, t1, out, 0, hkv, g, d, bs,
                        hkv * d, bs * hkv * d, scale, scores, cap, mx, sum);
}

void fuel_merge_parts(const float *part_out, const float *part_mx, const float *part_sum,
                      int64_t parts, int64_t hq, int64_t d, float *out)
{
    for (int64_t j = 0; j < hq; ++j) {
        float m = -INFINITY;
        for (int64_t p = 0; p < parts; ++p) {
            const float v = part_mx[p * hq + j];
            m = v > m ? v : m;
        }
        float total = 0.0f;
        float *o = out + j * d;
        memset(o, 0, sizeof(float) * (size_t)d);
        for (int64_t p = 0; p < parts; ++p) {
            if (part_sum[p * hq + j] == 0.0f) continue;
            const float w = expf(part_mx[p * hq + j] - m);
            total += w * part_sum[p * hq + j];
            const float *po = part_out + (p * hq + j) * d;
            for (int64_t c = 0; c < d; ++c) o[c] += w * po[c];
        }
        const float inv = 1.0f / total;
        for (int64_t c = 0; c < d; ++c) o[c] *= inv;
    }
}

/* One work item: sequence i, kv heads [h0, h1), all n of its keys. */
static int decode_item(
    const float *q, const void *k_cache, const void *v_cache, int kv_half, const int32_t *row,
    int64_t n, float *out, int64_t h0, int64_t h1, int64_t g, int64_t d, int64_t bs,
    int64_t tok_stride, int64_t blk_stride, float scale, float **scores, int64_t *cap)
{
    const int64_t nh = (h1 - h0) * g;
    float mx[nh], sum[nh];
    if (decode_range(q, k_cache, v_cache, kv_half, row, 0, n, out, h0, h1, g, d, bs, tok_stride,
                     blk_stride, scale, scores, cap, mx, sum) != 0)
        return -1;
    float *oh = out + h0 * g * d;
    for (int64_t j = 0; j < nh; ++j) {
        const float inv = 1.0f / sum[j];
        for (int64_t c = 0; c < d; ++c) oh[j * d + c] *= inv;
    }
    return 0;
}

/* The whole attention of a decode-only step in one call: for each sequence i,
 * store its new key/value row into cache slot slots[i] (skipped when < 0, a
 * padding row; converted to fp16 when kv_half; slots == NULL stores nothing),
 * then attend over each sequence's first seq_lens[i] cached positions. q, k and
 * v are read in place from one fused projection output: row i of q starts at
 * qkv + i * row_stride, its k at + k_off, its v at + v_off (floats).
 *
 * With fewer sequences than threads and long contexts (one stream over a long
 * system prompt), each sequence's keys are split into one range per thread
 * (flash-decoding's split-K: partial outputs merged by their softmax maxima),
 * so no core idles. out: [nd, hq, d] contiguous. */

int fuel_paged_decode_store_attention_f32(
    const float *qkv, int64_t row_stride, int64_t k_off, int64_t v_off, void *k_cache,
    void *v_cache, const int64_t *slots, const int32_t *block_tables, int64_t bt_stride,
    const int32_t *seq_lens, float *out, int64_t nd, int64_t hq, int64_t hkv, int64_t d,
    int64_t bs, float scale, int num_threads, int kv_half)
{
    const int64_t g = hq / hkv;
    const int64_t tok_stride = hkv * d;
    const int64_t blk_stride = bs * tok_stride;
    /* Stores first: a split sequence's ranges are read by several threads.
     * One work item per sequence (all its kv heads) otherwise: each cache row
     * (every head of one token, contiguous) is then read once, front to back;
     * splitting a sequence's heads across threads instead was measured 1.6x
     * slower at 16 sequences x 1,100 tokens (the threads stride through the
     * same rows and defeat the prefetcher). */
    for (int64_t i = 0; slots && i < nd; ++i) {
        if (slots[i] < 0) continue;
        const float *row = qkv + i * row_stride;
        const size_t at = (size_t)(slots[i] * tok_stride) * (kv_half ? 2 : 4);
        fuel_store_row((char *)k_cache + at, row + k_off, tok_stride, kv_half);
        fuel_store_row((char *)v_cache + at, row + v_off, tok_stride, kv_half);
    }
    int64_t max_len = 0;
    for (int64_t i = 0; i < nd; ++i) max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
    const int64_t parts = nd < num_threads && max_len >= FUEL_SPLIT_MIN_TOKENS ? num_threads : 1;
    const int64_t items = nd * parts;
    const int nt = items < num_threads ? (int)items : num_threads;
    /* Split mode: partial outputs [items, hq, d] and their (max, sum) [items, hq]. */
    float *part_out = NULL, *part_mx = NULL, *part_sum = NULL;
    if (parts > 1) {
        part_out = malloc(sizeof(float) * (size_t)(items * hq * d));
        part_mx = malloc(sizeof(float) * (size_t)(items * hq));
        part_sum = malloc(sizeof(float) * (size_t)(items * hq));
        if (!part_out || !part_mx || !part_sum) {
            free(part_out);
            free(part_mx);
            free(part_sum);
            return -1;
        }
    }
    int failed = 0;

#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *scores = NULL;
        int64_t cap = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; ++it) {
            const int64_t i = it / parts, p = it % parts;
            const float *row = qkv + i * row_stride;
            const int32_t *bt = block_tables + i * bt_stride;
            int rc;
            if (parts == 1) {
                rc = decode_item(row, k_cache, v_cache, kv_half, bt, seq_lens[i], out + i * hq * d,
                                 0, hkv, g, d, bs, tok_stride, blk_stride, scale, &scores, &cap);
            } else {
                const int64_t n = seq_lens[i];
                const int64_t t0 = n * p / parts, t1 = n * (p + 1) / parts;
                if (t0 == t1) { /* an empty range contributes nothing */
                    for (int64_t j = 0; j < hq; ++j) {
                        part_mx[it * hq + j] = -INFINITY;
                        part_sum[it * hq + j] = 0.0f;
                    }
                    memset(part_out + it * hq * d, 0, sizeof(float) * (size_t)(hq * d));
                    rc = 0;
                } else {
                    rc = decode_range(row, k_cache, v_cache, kv_half, bt, t0, t1,
                                      part_out + it * hq * d,
                                      0, hkv, g, d, bs, tok_stride, blk_stride, scale, &scores,
                                      &cap, part_mx + it * hq, part_sum + it * hq);
                }
            }
            if (rc != 0) {
#pragma omp atomic write
                failed = 1;
            }
        }
        free(scores);
    }
    if (parts > 1 && !failed) {
        for (int64_t i = 0; i < nd; ++i)
            fuel_merge_parts(part_out + i * parts * hq * d, part_mx + i * parts * hq,
                             part_sum + i * parts * hq, parts, hq, d, out + i * hq * d);
    }
    free(part_out);
    free(part_mx);
    free(part_sum);
    return failed ? -1 : 0;
}

/* Attention of one new token per sequence whose key/value are already
 * cached: the fused entry with nothing to store, q rows contiguous. */
int fuel_paged_decode_attention_f32(
    const float *q, const void *k_cache, const void *v_cache,
    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
    float *out, int64_t nd, int64_t hq, int64_t hkv, int64_t d, int64_t bs,
    float scale, int num_threads, int kv_half)
{
    return fuel_paged_decode_store_attention_f32(
        q, hq * d, 0, 0, (void *)k_cache, (void *)v_cache, NULL, block_tables, bt_stride,
        seq_lens, out, nd, hq, hkv, d, bs, scale, num_threads, kv_half);
}
