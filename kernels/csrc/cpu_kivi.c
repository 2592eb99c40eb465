/*
 * Paged decode attention over KIVI 2-/4-bit KV blocks, fp32 queries.
 *
 * The block layout, the read rule and the torch reference are in
 * kernels/kivi.py (kivi_attention_ref); the Python signature is
 * CpuKernels.kivi_decode_attention in kernels/cpu_native.py. Blocks are read in
 * place through the block tables and dequantized in registers: nothing of the
 * cache is copied out.
 *
 * A sequence of n tokens (its query at position n - 1) reads tokens
 * [sink, ws) from codes, ws = max(0, G * ((n - 1) / G - m + 1)) (the window
 * start of kernels/kivi.py, m = ring groups), and the others, [0, sink) and
 * [ws, n), from the float16 slot rows of their own blocks (resid_row). After
 * the decode's own store every one of those rows is current: the store only
 * reused the row of the token m groups back. Keys are quantized per channel
 * over a group, so for a group the score is
 *     q . k_t = sum_c (q_c s_c) code_tc + sum_c q_c z_c,
 * with q * s and q . z computed once per group and query head; values are
 * quantized per token over channel groups, dequantized one row at a time (all
 * query heads of a kv head share it).
 *
 * Layouts (C-contiguous): q, out [nd, hq, d] fp32; k_cache uint8 [num_blocks,
 * kside], v_cache uint8 [num_blocks, vside] (row = one block: codes at 0, then
 * per side the scale, zero and float16 slot offsets of kernels/kivi.py's
 * KiviSideLayout; scales share one offset); block_tables int32
 * [nd, bt_stride]; seq_lens int32 [nd], each >= 1.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuel_half.h"
#include "fuel_internal.h"
#include "fuel_vec.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

typedef struct {
    const uint8_t *k, *v;
    int64_t hkv, d, bs, group, vgroup, bits, ring, sink;
    int64_t kside, vside, scale_off, kzero_off, vzero_off, kresid_off, vresid_off;
} kivi_cache;

/* float16 row of the token at offset o of its block (KiviLayout.resid_row). */
static inline int64_t resid_row(const kivi_cache *kc, int64_t o)
{
    const int64_t j = o / kc->group;
    const int64_t slot = kc->sink ? (j == 0 ? 0 : 1 + (j - 1) % kc->ring) : j % kc->ring;
    return slot * kc->group + o % kc->group;
}

/* d codes of one packed row (channel c at bits (c % per) * bits of byte c / per) as floats. */
static inline void unpack_row(const uint8_t *p, int64_t d, int64_t bits, float *out)
{
    int64_t c = 0;
#if defined(__AVX512F__)
    if (bits == 4) {
        /* 64 channels from 32 bytes: nibbles split and interleaved per 128-bit
         * lane (x0 = channels 0-15 | 32-47, x1 = 16-31 | 48-63), then 16
         * codes at a time widened to floats. */
        const __m256i m = _mm256_set1_epi8(0x0f);
        for (; c + 64 <= d; c += 64) {
            const __m256i b = _mm256_loadu_si256((const __m256i *)(p + c / 2));
            const __m256i lo = _mm256_and_si256(b, m);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
            const __m256i x0 = _mm256_unpacklo_epi8(lo, hi), x1 = _mm256_unpackhi_epi8(lo, hi);
            _mm512_storeu_ps(out + c, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(x0))));
            _mm512_storeu_ps(out + c + 16, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(x1))));
            _mm512_storeu_ps(out + c + 32, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(x0, 1))));
            _mm512_storeu_ps(out + c + 48, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(x1, 1))));
        }
    } else {
        /* 64 channels from 16 bytes: the four 2-bit planes, interleaved by bytes
         * then by pairs (channel 4 i + j is plane j of byte i). */
        const __m128i m = _mm_set1_epi8(0x03);
        for (; c + 64 <= d; c += 64) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(p + c / 4));
            const __m128i x0 = _mm_and_si128(b, m), x1 = _mm_and_si128(_mm_srli_epi16(b, 2), m);
            const __m128i x2 = _mm_and_si128(_mm_srli_epi16(b, 4), m);
            const __m128i x3 = _mm_and_si128(_mm_srli_epi16(b, 6), m);
            const __m128i t0 = _mm_unpacklo_epi8(x0, x1), t1 = _mm_unpackhi_epi8(x0, x1);
            const __m128i t2 = _mm_unpacklo_epi8(x2, x3), t3 = _mm_unpackhi_epi8(x2, x3);
            _mm512_storeu_ps(out + c, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi16(t0, t2))));
            _mm512_storeu_ps(out + c + 16, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi16(t0, t2))));
            _mm512_storeu_ps(out + c + 32, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi16(t1, t3))));
            _mm512_storeu_ps(out + c + 48, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi16(t1, t3))));
        }
    }
#endif
#if defined(__AVX2__)
    if (bits == 4) {
        const __m128i lo_mask = _mm_set1_epi8(0x0f);
        for (; c + 16 <= d; c += 16) {
            const __m128i b = _mm_loadl_epi64((const __m128i *)(p + c / 2));
            const __m128i lo = _mm_and_si128(b, lo_mask);
            const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), lo_mask);
            const __m128i x = _mm_unpacklo_epi8(lo, hi); /* channels c .. c + 15 */
            _mm256_storeu_ps(out + c, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(x)));
            _mm256_storeu_ps(out + c + 8,
                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(x, 8))));
        }
    } else {
        const __m256i shifts = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
        const __m256i three = _mm256_set1_epi32(3);
        for (; c + 8 <= d; c += 8) {
            /* bytes b0 b0 b0 b0 b1 b1 b1 b1, each shifted by 0, 2, 4, 6 */
            const int32_t w = (int32_t)p[c / 4] | ((int32_t)p[c / 4 + 1] << 8);
            const __m128i b = _mm_shuffle_epi8(_mm_cvtsi32_si128(w),
                                               _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, -1, -1, -1,
                                                             -1, -1, -1, -1, -1));
            const __m256i x = _mm256_and_si256(_mm256_srlv_epi32(_mm256_cvtepu8_epi32(b), shifts),
                                               three);
            _mm256_storeu_ps(out + c, _mm256_cvtepi32_ps(x));
        }
    }
#endif
    const int per = (int)(8 / bits), mask = (1 << bits) - 1;
    for (; c < d; ++c) out[c] = (float)((p[c / per] >> ((c % per) * bits)) & mask);
}

static inline void half_row(const uint16_t *h, int64_t n, float *out)
{
    int64_t c = 0;
#ifdef FUEL_F16C
    for (; c + 8 <= n; c += 8)
        _mm256_storeu_ps(out + c, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + c))));
#endif
    for (; c < n; ++c) out[c] = h2f(h[c]);
}

static inline float dotf(const float *a, const float *b, int64_t d)
{
    v8f acc = {0};
    int64_t c = 0;
    for (; c + 8 <= d; c += 8) acc += load8(a + c) * load8(b + c);
    float s = hsum8(acc);
    for (; c < d; ++c) s += a[c] * b[c];
    return s;
}

static inline void axpyf(float *o, float p, const float *v, int64_t d)
{
    int64_t c = 0;
    for (; c + 8 <= d; c += 8) {
        const v8f r = load8(o + c) + p * load8(v + c);
        memcpy(o + c, &r, sizeof r);
    }
    for (; c < d; ++c) o[c] += p * v[c];
}

/* Scratch of one thread: scores [hq * n], and rows of d floats. */
#define KIVI_SEG 64 /* rows per scratch segment (keys) and per value chunk */
typedef struct fuel_kivi_scratch {
    float *scores;
    int64_t cap;
    float *qs, *qz, *row, *vrow;
    float *rows; /* KIVI_SEG rows of d floats (the fast body) */
} kivi_scratch;

void fuel_kivi_scratch_free(fuel_kivi_scratch *s)
{
    if (s == NULL) return;
    free(s->scores);
    free(s->qs);
    free(s->qz);
    free(s->row);
    free(s->vrow);
    free(s->rows);
    free(s);
}

fuel_kivi_scratch *fuel_kivi_scratch_new(int64_t hq, int64_t hkv, int64_t d)
{
    const int64_t g = hq / hkv;
    kivi_scratch *s = calloc(1, sizeof *s);
    if (s == NULL) return NULL;
    s->qs = malloc(sizeof(float) * (size_t)(g * d));
    s->qz = malloc(sizeof(float) * (size_t)g);
    s->row = malloc(sizeof(float) * (size_t)d);
    s->vrow = malloc(sizeof(float) * (size_t)d);
    s->rows = malloc(sizeof(float) * (size_t)(KIVI_SEG * d));
    if (!s->qs || !s->qz || !s->row || !s->vrow || !s->rows) {
        fuel_kivi_scratch_free(s);
        return NULL;
    }
    return s;
}

static kivi_cache cache_of(const fuel_kivi *kv, const uint8_t *k, const uint8_t *v, int64_t hkv,
                           int64_t d, int64_t bs)
{
    const kivi_cache kc = {k,         v,         hkv,       d,         bs,
                           kv->group, kv->vgroup, kv->bits, kv->ring,  kv->sink != 0,
                           kv->kside, kv->vside, kv->scale_off, kv->kzero_off, kv->vzero_off,
                           kv->kresid_off, kv->vresid_off};
    return kc;
}

static int scratch_fit(kivi_scratch *s, int64_t n)
{
    if (n <= s->cap) return 0;
    free(s->scores);
    s->scores = (float *)malloc(sizeof(float) * (size_t)n);
    s->cap = s->scores ? n : 0;
    return s->scores ? 0 : -1;
}

/* Keys [t0, t1) of one sequence (n tokens, block-table row bt), all heads:
 * unnormalised output, max and sum per query head (like fuel_decode_range). */
static int kivi_range(const kivi_cache *kc, const float *q, const int32_t *bt, int64_t n,
                      int64_t t0, int64_t t1, int64_t hq, float scale, float *out, float *mx,
                      float *sum, kivi_scratch *s)
{
    const int64_t hkv = kc->hkv, d = kc->d, bs = kc->bs, G = kc->group, g = hq / hkv;
    const int64_t dp = d * kc->bits / 8, len = t1 - t0;
    const int64_t w = (n - 1) / G - kc->ring + 1;
    const int64_t ws = w > 0 ? G * w : 0; /* the window's first position */
    const int64_t sink = kc->sink ? G : 0;
    if (scratch_fit(s, hq * len) != 0) return -1;
    float *sc = s->scores;
    for (int64_t j = 0; j < hq; ++j) mx[j] = -INFINITY;
    /* Pass 1: scores. */
    for (int64_t t = t0; t < t1;) {
        const int64_t blk = bt[t / bs];
        const uint8_t *kb = kc->k + blk * kc->kside;
        if (t >= sink && t < ws) { /* a quantized group: [t, end) */
            const int64_t gi = (t % bs) / G, end = (t / G + 1) * G < t1 ? (t / G + 1) * G : t1;
            for (int64_t h = 0; h < hkv; ++h) {
                const uint16_t *sp = (const uint16_t *)(kb + kc->scale_off) + (gi * hkv + h) * d;
                const uint16_t *zp = (const uint16_t *)(kb + kc->kzero_off) + (gi * hkv + h) * d;
                half_row(sp, d, s->row);
                half_row(zp, d, s->vrow);
                for (int64_t jj = 0; jj < g; ++jj) {
                    const int64_t j = h * g + jj;
                    const float *qj = q + j * d;
                    for (int64_t c = 0; c < d; ++c) s->qs[jj * d + c] = qj[c] * s->row[c];
                    s->qz[jj] = dotf(qj, s->vrow, d);
                }
                for (int64_t u = t; u < end; ++u) {
                    unpack_row(kb + ((u % bs) * hkv + h) * dp, d, kc->bits, s->row);
                    for (int64_t jj = 0; jj < g; ++jj) {
                        const int64_t j = h * g + jj;
                        const float v = (dotf(s->qs + jj * d, s->row, d) + s->qz[jj]) * scale;
                        sc[j * len + u - t0] = v;
                        if (v > mx[j]) mx[j] = v;
                    }
                }
            }
            t = end;
        } else { /* a float16 row of the token's own block */
            const uint16_t *rp = (const uint16_t *)(kb + kc->kresid_off);
            const int64_t row = resid_row(kc, t % bs);
            for (int64_t h = 0; h < hkv; ++h) {
                half_row(rp + (row * hkv + h) * d, d, s->row);
                for (int64_t jj = 0; jj < g; ++jj) {
                    const int64_t j = h * g + jj;
                    const float v = dotf(q + j * d, s->row, d) * scale;
                    sc[j * len + t - t0] = v;
                    if (v > mx[j]) mx[j] = v;
                }
            }
            ++t;
        }
    }
    /* Softmax, unnormalised. */
    for (int64_t j = 0; j < hq; ++j) {
        float *sj = sc + j * len, total = 0.0f;
        int64_t t = 0;
        v8f acc = {0};
        for (; t + 8 <= len; t += 8) {
            const v8f e = exp8(load8(sj + t) - mx[j]);
            memcpy(sj + t, &e, sizeof e);
            acc += e;
        }
        total = hsum8(acc);
        for (; t < len; ++t) {
            sj[t] = expf(sj[t] - mx[j]);
            total += sj[t];
        }
        sum[j] = total;
    }
    /* Pass 2: values, one dequantized row per (token, kv head). */
    memset(out, 0, sizeof(float) * (size_t)(hq * d));
    const int64_t vg = kc->vgroup, ng = d / vg;
    for (int64_t t = t0; t < t1; ++t) {
        for (int64_t h = 0; h < hkv; ++h) {
            const uint8_t *vb = kc->v + bt[t / bs] * kc->vside;
            if (t >= sink && t < ws) {
                const int64_t at = ((t % bs) * hkv + h);
                const uint16_t *sp = (const uint16_t *)(vb + kc->scale_off) + at * ng;
                const uint16_t *zp = (const uint16_t *)(vb + kc->vzero_off) + at * ng;
                unpack_row(vb + at * dp, d, kc->bits, s->vrow);
                for (int64_t k = 0; k < ng; ++k) {
                    const float sk = h2f(sp[k]), zk = h2f(zp[k]);
                    float *r = s->vrow + k * vg;
                    for (int64_t c = 0; c < vg; ++c) r[c] = r[c] * sk + zk;
                }
            } else {
                const uint16_t *rp = (const uint16_t *)(vb + kc->vresid_off);
                half_row(rp + (resid_row(kc, t % bs) * hkv + h) * d, d, s->vrow);
            }
            for (int64_t jj = 0; jj < g; ++jj) {
                const int64_t j = h * g + jj;
                axpyf(out + j * d, sc[j * len + t - t0], s->vrow, d);
            }
        }
    }
    return 0;
}

/* ---- the fast body (head sizes that are multiples of 64) -----------------
 *
 * Same contract and read rule as kivi_range. Why it is faster (measured at
 * 4,000 tokens of context, kivi4, the default model's heads:
 * benchmarks/kivi_decode_attention.py):
 * - a segment of key rows (part of one quantized group, or a run of float16
 *   rows) is decoded to floats once per kv head into scratch, and all g query
 *   heads of that kv head score it, rather than unpacking per token and head;
 * - scores come 8 rows at a time, reduced by one transpose-add (hsum8x8)
 *   instead of a horizontal sum per (token, head);
 * - values are dequantized a chunk of tokens at a time per kv head, and each
 *   query head sums the chunk with 64 output channels in registers. */
/* sc[jj * len + u] = (qv_jj . rows_u + add_jj) * scale for jj < g, u < cnt. */
static void seg_scores(const float *qv, const float *add, const float *rows, int64_t cnt,
                       int64_t d, int64_t g, float scale, float *sc, int64_t len)
{
    for (int64_t jj = 0; jj < g; ++jj) {
        const float *qj = qv + jj * d;
        const float a = add != NULL ? add[jj] : 0.0f;
        float *sj = sc + jj * len;
        int64_t u = 0;
        for (; u + 8 <= cnt; u += 8) {
            v8f acc[8] = {{0}};
            const float *r = rows + u * d;
            for (int64_t c = 0; c < d; c += 8) {
                const v8f qq = load8(qj + c);
                for (int k = 0; k < 8; ++k) acc[k] += qq * load8(r + k * d + c);
            }
            const v8f sv = (hsum8x8(acc) + a) * scale;
            memcpy(sj + u, &sv, sizeof sv);
        }
        for (; u < cnt; ++u) sj[u] = (dotf(qj, rows + u * d, d) + a) * scale;
    }
}

/* Rows [t, t + cnt) of kv head h of one side, as floats in rows [cnt, d]:
 * codes dequantized (keys: raw codes, scales applied to the query; values:
 * code * scale + zero per channel group) or float16 slot rows. */
static void seg_rows(const kivi_cache *kc, const int32_t *bt, int64_t t, int64_t cnt, int64_t h,
                     int keys, int quantized, float *rows)
{
    const int64_t d = kc->d, bs = kc->bs, hkv = kc->hkv, dp = d * kc->bits / 8;
    const int64_t vg = kc->vgroup, ng = d / vg;
    /* Rows walked block by block: no division per row. */
    int64_t blk = t / bs, o = t % bs;
    for (int64_t u = 0; u < cnt; ++u, ++o) {
        if (o == bs) {
            o = 0;
            ++blk;
        }
        const uint8_t *b = (keys ? kc->k : kc->v) + bt[blk] * (keys ? kc->kside : kc->vside);
        float *r = rows + u * d;
        if (!quantized) {
            const uint16_t *rp = (const uint16_t *)(b + (keys ? kc->kresid_off : kc->vresid_off));
            half_row(rp + (resid_row(kc, o) * hkv + h) * d, d, r);
            continue;
        }
        const int64_t at = o * hkv + h;
        unpack_row(b + at * dp, d, kc->bits, r);
        if (keys) continue;
        const uint16_t *sp = (const uint16_t *)(b + kc->scale_off) + at * ng;
        const uint16_t *zp = (const uint16_t *)(b + kc->vzero_off) + at * ng;
        for (int64_t k = 0; k < ng; ++k) {
            const v8f sk = (v8f){0} + h2f(sp[k]), zk = (v8f){0} + h2f(zp[k]);
            for (int64_t c = k * vg; c + 8 <= (k + 1) * vg; c += 8) {
                const v8f x = load8(r + c) * sk + zk;
                memcpy(r + c, &x, sizeof x);
            }
            for (int64_t c = k * vg + vg / 8 * 8; c < (k + 1) * vg; ++c)
                r[c] = r[c] * h2f(sp[k]) + h2f(zp[k]);
        }
    }
}

static int kivi_range_fast(const kivi_cache *kc, const float *q, const int32_t *bt, int64_t n,
                           int64_t t0, int64_t t1, int64_t hq, float scale, float *out,
                           float *mx, float *sum, kivi_scratch *s)
{
    const int64_t hkv = kc->hkv, d = kc->d, bs = kc->bs, G = kc->group, g = hq / hkv;
    const int64_t len = t1 - t0;
    const int64_t w = (n - 1) / G - kc->ring + 1;
    const int64_t ws = w > 0 ? G * w : 0; /* the window's first position */
    const int64_t sink = kc->sink ? G : 0;
    if (scratch_fit(s, hq * len) != 0) return -1;
    float *sc = s->scores;
    /* Pass 1: scores, segment by segment. */
    for (int64_t t = t0; t < t1;) {
        const int quantized = t >= sink && t < ws;
        int64_t end;
        if (quantized) {
            end = (t / G + 1) * G; /* the group's end (ws and sink are group-aligned) */
        } else {
            end = t < sink ? sink : t1;
        }
        if (end > t1) end = t1;
        if (end - t > KIVI_SEG) end = t + KIVI_SEG;
        const int64_t cnt = end - t;
        for (int64_t h = 0; h < hkv; ++h) {
            float *sch = sc + h * g * len + (t - t0);
            seg_rows(kc, bt, t, cnt, h, 1, quantized, s->rows);
            if (!quantized) {
                seg_scores(q + h * g * d, NULL, s->rows, cnt, d, g, scale, sch, len);
                continue;
            }
            /* q . k = sum_c (q_c s_c) code_c + q . z over the group's scales. */
            const uint8_t *kb = kc->k + bt[t / bs] * kc->kside;
            const int64_t gi = (t % bs) / G;
            half_row((const uint16_t *)(kb + kc->scale_off) + (gi * hkv + h) * d, d, s->row);
            half_row((const uint16_t *)(kb + kc->kzero_off) + (gi * hkv + h) * d, d, s->vrow);
            for (int64_t jj = 0; jj < g; ++jj) {
                const float *qj = q + (h * g + jj) * d;
                for (int64_t c = 0; c < d; c += 8) {
                    const v8f x = load8(qj + c) * load8(s->row + c);
                    memcpy(s->qs + jj * d + c, &x, sizeof x);
                }
                s->qz[jj] = dotf(qj, s->vrow, d);
            }
            seg_scores(s->qs, s->qz, s->rows, cnt, d, g, scale, sch, len);
        }
        t = end;
    }
    fuel_softmax_rows(sc, len, hq, mx, sum);
    /* Pass 2: values, a chunk of rows per kv head, 64 output channels in registers. */
    memset(out, 0, sizeof(float) * (size_t)(hq * d));
    for (int64_t t = t0; t < t1;) {
        const int quantized = t >= sink && t < ws;
        int64_t end = quantized ? ws : (t < sink ? sink : t1);
        if (end > t1) end = t1;
        if (end - t > KIVI_SEG) end = t + KIVI_SEG;
        const int64_t cnt = end - t;
        for (int64_t h = 0; h < hkv; ++h) {
            seg_rows(kc, bt, t, cnt, h, 0, quantized, s->rows);
            for (int64_t jj = 0; jj < g; ++jj) {
                const int64_t j = h * g + jj;
                const float *pj = sc + j * len + (t - t0);
                for (int64_t c0 = 0; c0 < d; c0 += 64) {
                    float *o = out + j * d + c0;
                    v8f a[8];
                    for (int i = 0; i < 8; ++i) a[i] = load8(o + 8 * i);
                    const float *r = s->rows + c0;
                    for (int64_t u = 0; u < cnt; ++u, r += d) {
                        const float p = pj[u];
                        for (int i = 0; i < 8; ++i) a[i] += p * load8(r + 8 * i);
                    }
                    memcpy(o, a, sizeof a);
                }
            }
        }
        t = end;
    }
    return 0;
}

int fuel_kivi_range(const fuel_kivi *kv, const uint8_t *k_cache, const uint8_t *v_cache,
                    int64_t hkv, int64_t d, int64_t bs, const float *q, const int32_t *bt,
                    int64_t n, int64_t t0, int64_t t1, int64_t hq, float scale, float *out,
                    float *mx, float *sum, fuel_kivi_scratch *s)
{
    const kivi_cache kc = cache_of(kv, k_cache, v_cache, hkv, d, bs);
    return (d % 64 == 0 ? kivi_range_fast : kivi_range)(&kc, q, bt, n, t0, t1, hq, scale, out,
                                                         mx, sum, s);
}

/* ---- the store (the fused decode step's; kernels/kivi.py kivi_store) ---- */

/* Asymmetric min/max codes of n floats x[i * stride] (float16 values), as
 * kernels/kivi.py _minmax_quant computes them: scale = fp16((hi - lo) /
 * levels), zero = fp16(lo), code = clamp(round_half_even((x - zero) /
 * scale), 0, levels), 0 where the scale is 0. */
static void minmax_codes(const float *x, int64_t n, int64_t stride, int levels, uint16_t *scale,
                         uint16_t *zero, uint8_t *codes)
{
    float lo = x[0], hi = x[0];
    for (int64_t i = 1; i < n; ++i) {
        const float v = x[i * stride];
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    *scale = f2h((hi - lo) / (float)levels);
    *zero = f2h(lo);
    const float sf = h2f(*scale), zf = h2f(*zero);
    for (int64_t i = 0; i < n; ++i) {
        float c = sf > 0.0f ? nearbyintf((x[i * stride] - zf) / sf) : 0.0f;
        c = c < 0.0f ? 0.0f : (c > (float)levels ? (float)levels : c);
        codes[i] = (uint8_t)c;
    }
}

/* Pack d codes into one row (channel c at bits (c % per) * bits of byte c / per). */
static void pack_row(const uint8_t *codes, int64_t d, int64_t bits, uint8_t *out)
{
    const int64_t per = 8 / bits;
    for (int64_t b = 0; b < d / per; ++b) {
        unsigned v = 0;
        for (int64_t i = 0; i < per; ++i) v |= (unsigned)codes[b * per + i] << (i * bits);
        out[b] = (uint8_t)v;
    }
}

void fuel_kivi_store_row(const fuel_kivi *kv, uint8_t *k_cache, uint8_t *v_cache, int64_t hkv,
                         int64_t d, int64_t bs, int64_t slot, const float *k, const float *v)
{
    const kivi_cache kc = cache_of(kv, k_cache, v_cache, hkv, d, bs);
    const int64_t blk = slot / bs, o = slot % bs, G = kc.group, tok = hkv * d;
    uint8_t *kb = k_cache + blk * kc.kside, *vb = v_cache + blk * kc.vside;
    uint16_t *kres = (uint16_t *)(kb + kc.kresid_off), *vres = (uint16_t *)(vb + kc.vresid_off);
    const int64_t row = resid_row(&kc, o);
    for (int64_t c = 0; c < tok; ++c) {
        kres[row * tok + c] = f2h(k[c]);
        vres[row * tok + c] = f2h(v[c]);
    }
    if (o % G != G - 1) return;
    /* The token ends its group: quantize the group's G float16 rows. */
    const int levels = (1 << kc.bits) - 1;
    const int64_t o0 = o - (G - 1), gi = o0 / G, r0 = resid_row(&kc, o0), dp = d * kc.bits / 8;
    const int64_t vg = kc.vgroup, ng = d / vg;
    float x[G > d ? G : d];
    uint8_t codes[G > d ? G : d], packed[d];
    uint8_t krows[G][d];
    for (int64_t h = 0; h < hkv; ++h) {
        /* Keys: per channel over the group's tokens. */
        uint16_t *ks = (uint16_t *)(kb + kc.scale_off) + (gi * hkv + h) * d;
        uint16_t *kz = (uint16_t *)(kb + kc.kzero_off) + (gi * hkv + h) * d;
        for (int64_t c = 0; c < d; ++c) {
            for (int64_t u = 0; u < G; ++u) x[u] = h2f(kres[(r0 + u) * tok + h * d + c]);
            minmax_codes(x, G, 1, levels, ks + c, kz + c, codes);
            for (int64_t u = 0; u < G; ++u) krows[u][c] = codes[u];
        }
        for (int64_t u = 0; u < G; ++u) pack_row(krows[u], d, kc.bits, kb + ((o0 + u) * hkv + h) * dp);
        /* Values: per token over groups of vg channels. */
        for (int64_t u = 0; u < G; ++u) {
            const int64_t at = (o0 + u) * hkv + h;
            uint16_t *vs = (uint16_t *)(vb + kc.scale_off) + at * ng;
            uint16_t *vz = (uint16_t *)(vb + kc.vzero_off) + at * ng;
            for (int64_t c = 0; c < d; ++c) x[c] = h2f(vres[(r0 + u) * tok + h * d + c]);
            for (int64_t gr = 0; gr < ng; ++gr)
                minmax_codes(x + gr * vg, vg, 1, levels, vs + gr, vz + gr, codes + gr * vg);
            pack_row(codes, d, kc.bits, packed);
            memcpy(vb + at * dp, packed, (size_t)dp);
        }
    }
}

/* Returns 0, -1 on a failed allocation, -2 on a bad argument. */
int fuel_kivi_decode_attention_f32(const float *q, const uint8_t *k_cache, const uint8_t *v_cache,
                                   const int32_t *block_tables, int64_t bt_stride,
                                   const int32_t *seq_lens, float *out, int64_t nd, int64_t hq,
                                   int64_t hkv, int64_t d, int64_t bs, int64_t group,
                                   int64_t vgroup, int64_t bits, int64_t ring, int64_t sink,
                                   int64_t kside, int64_t vside, int64_t scale_off,
                                   int64_t kzero_off, int64_t vzero_off, int64_t kresid_off,
                                   int64_t vresid_off, float scale, int num_threads)
{
    if ((bits != 2 && bits != 4) || hkv < 1 || hq % hkv || bs % group || d % vgroup ||
        d % (8 / bits) || ring < 1 || (ring + (sink != 0)) * group > bs)
        return -2;
    const fuel_kivi kv = {bits,      group,     vgroup,    ring,       sink,      kside,
                          vside,     scale_off, kzero_off, vzero_off, kresid_off, vresid_off};
    int64_t max_len = 0;
    for (int64_t i = 0; i < nd; ++i) max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
    /* Split-K as in cpu_attention.c: few long sequences use every thread. */
    const int64_t parts = nd < num_threads && max_len >= FUEL_SPLIT_MIN_TOKENS ? num_threads : 1;
    const int64_t items = nd * parts;
    const int nt = items < num_threads ? (int)items : num_threads;
    float *part_out = malloc(sizeof(float) * (size_t)(items * hq * d));
    float *part_mx = malloc(sizeof(float) * (size_t)(items * hq));
    float *part_sum = malloc(sizeof(float) * (size_t)(items * hq));
    int failed = !part_out || !part_mx || !part_sum;

#pragma omp parallel num_threads(nt) if (nt > 1 && !failed)
    {
        kivi_scratch *s = fuel_kivi_scratch_new(hq, hkv, d);
        const int ok = s != NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; ++it) {
            if (failed || !ok) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            const int64_t i = it / parts, p = it % parts, n = seq_lens[i];
            const int64_t t0 = n * p / parts, t1 = n * (p + 1) / parts;
            float *po = part_out + it * hq * d, *pm = part_mx + it * hq, *ps = part_sum + it * hq;
            if (t0 == t1) {
                for (int64_t j = 0; j < hq; ++j) {
                    pm[j] = -INFINITY;
                    ps[j] = 0.0f;
                }
                memset(po, 0, sizeof(float) * (size_t)(hq * d));
                continue;
            }
            if (fuel_kivi_range(&kv, k_cache, v_cache, hkv, d, bs, q + i * hq * d,
                                block_tables + i * bt_stride, n, t0, t1, hq, scale, po, pm, ps,
                                s) != 0) {
#pragma omp atomic write
                failed = 1;
            }
        }
        fuel_kivi_scratch_free(s);
    }
    if (!failed) {
        for (int64_t i = 0; i < nd; ++i)
            fuel_merge_parts(part_out + i * parts * hq * d, part_mx + i * parts * hq,
                             part_sum + i * parts * hq, parts, hq, d, out + i * hq * d);
    }
    free(part_out);
    free(part_mx);
    free(part_sum);
    return failed ? -1 : 0;
}
