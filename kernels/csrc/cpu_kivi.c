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
 * Three bodies, one contract: kivi_range (any head size), kivi_range_fast
 * (head sizes that are multiples of 64) and, inside the latter on AVX-512
 * VNNI builds, the integer body (seg_scores_int / seg_values_int), which
 * multiplies codes as int16 and rounds q s and p s to 16 bits (its comment
 * says how far that moves a result; docs/benchmarks/kv-compression.md what it
 * does to perplexity and speed).
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
    struct vnni_scratch_s *vnni; /* the integer body's, or NULL without it */
} kivi_scratch;

static struct vnni_scratch_s *vnni_new(int64_t hq, int64_t g, int64_t d, int64_t G);
static void vnni_free(struct vnni_scratch_s *v);

void fuel_kivi_scratch_free(fuel_kivi_scratch *s)
{
    if (s == NULL) return;
    free(s->scores);
    free(s->qs);
    free(s->qz);
    free(s->row);
    free(s->vrow);
    free(s->rows);
    vnni_free(s->vnni);
    free(s);
}

fuel_kivi_scratch *fuel_kivi_scratch_new(const fuel_kivi *kv, int64_t hq, int64_t hkv, int64_t d)
{
    const int64_t g = hq / hkv;
    kivi_scratch *s = calloc(1, sizeof *s);
    if (s == NULL) return NULL;
    s->qs = malloc(sizeof(float) * (size_t)(g * d));
    s->qz = malloc(sizeof(float) * (size_t)g);
    s->row = malloc(sizeof(float) * (size_t)d);
    s->vrow = malloc(sizeof(float) * (size_t)d);
    s->rows = malloc(sizeof(float) * (size_t)(KIVI_SEG * d));
    s->vnni = d % 64 == 0 ? vnni_new(hq, g, d, kv->group) : NULL;
    if (!s->qs || !s->qz || !s->row || !s->vrow || !s->rows || (d % 64 == 0 && !s->vnni)) {
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

/* ---- the integer body (AVX-512 VNNI; head sizes that are multiples of 64) --
 *
 * Same contract and read rule as kivi_range_fast; its float16 rows (sinks and
 * window) are read by the same float code. Quantized rows are never turned
 * into floats: codes are widened to int16 and multiplied by int16 weights with
 * vpdpwssd, 32 products per instruction into int32, exactly.
 * - Keys: for each group and query head, q * s (the group's channel scales
 *   folded into the query) is rounded to int16, qi = round(q s / qs_scale) with
 *   qs_scale = max |q s| / 32767, and q . k = qs_scale * sum_c qi_c code_c +
 *   q . z. The rounding moves each score by at most
 *   qs_scale / 2 * sum_c code_c (llama.cpp's CPU attention over quantized KV
 *   rounds the query to its key type the same way, to 8 bits).
 * - Values: for a segment of rows, one query head and one channel group k, the
 *   weights w_u = p_u s_uk are rounded to int16 against the segment's largest,
 *   and the output gains w_scale * sum_u wi_u code_uc + sum_u p_u z_uk.
 *   Codes of two rows sit in each int32 lane (vpdpwssd sums the pair), so the
 *   multiplier of a lane is (wi_u, wi_u+1) of the lane's channel group.
 * Both are 2^-16 of the largest term, far below the codes' own rounding (a
 * 4-bit code is 2^-4 of its range), and the same on every path (decode,
 * extend pieces, the fused step), since every path runs this kernel.
 *
 * Code layout of one 64-channel chunk of a row, as two vectors of 32 int16:
 * - 4 bits: c0 holds channels 2i, c1 channels 2i + 1 (the low and high
 *   nibbles of byte i);
 * - 2 bits: c0 holds channels 4i (i < 16) then 4i + 1, c1 channels 4i + 2 then
 *   4i + 3 (the four bit planes of byte i).
 * Value groups must be 32 channels or a multiple of 64, so that each 128-bit
 * lane of those vectors lies in one channel group. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KIVI_VNNI 1

/* Channel of int16 lane i (0..63: c0 then c1) of a 64-channel chunk. */
static inline int vnni_channel(int64_t bits, int i)
{
    const int half = i / 32, w = i % 32;
    if (bits == 4) return 2 * w + half;
    return 4 * (w % 16) + 2 * half + w / 16;
}

/* One row's chunk of codes (p: its first byte) in the layout above. */
static inline void vnni_codes(const uint8_t *p, int64_t bits, __m512i *c0, __m512i *c1)
{
    if (bits == 4) {
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
        *c0 = _mm512_and_si512(w, _mm512_set1_epi16(0x0f));
        *c1 = _mm512_srli_epi16(w, 4);
    } else {
        const __m512i w = _mm512_broadcast_i64x4(
            _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)));
        const __m512i three = _mm512_set1_epi16(3);
        const __m512i s01 = _mm512_set_epi64(0x0002000200020002, 0x0002000200020002,
                                             0x0002000200020002, 0x0002000200020002, 0, 0, 0, 0);
        const __m512i s23 = _mm512_add_epi16(s01, _mm512_set1_epi16(4));
        *c0 = _mm512_and_si512(_mm512_srlv_epi16(w, s01), three);
        *c1 = _mm512_and_si512(_mm512_srlv_epi16(w, s23), three);
    }
}

/* Lane r of the result: the sum of the 16 lanes of a[r] (a 16x16
 * transpose-add in four levels; integer sums, so the order is free). */
static inline __m512i vnni_hsum16(const __m512i a[16])
{
    __m512i s1[8], s2[4], s3[2];
    for (int i = 0; i < 8; ++i) /* rows 2i | 2i + 1, eight partials each */
        s1[i] = _mm512_add_epi32(_mm512_shuffle_i64x2(a[2 * i], a[2 * i + 1], 0x44),
                                 _mm512_shuffle_i64x2(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; ++i) /* quarter m: row 4i + m, four partials */
        s2[i] = _mm512_add_epi32(_mm512_shuffle_i64x2(s1[2 * i], s1[2 * i + 1], 0x88),
                                 _mm512_shuffle_i64x2(s1[2 * i], s1[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i) /* quarter m: rows 8i + m, 8i + 4 + m, two partials each */
        s3[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(s2[2 * i], s2[2 * i + 1]),
                                 _mm512_unpackhi_epi64(s2[2 * i], s2[2 * i + 1]));
    const __m512 f0 = _mm512_castsi512_ps(s3[0]), f1 = _mm512_castsi512_ps(s3[1]);
    const __m512i s4 = _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(f0, f1, 0x88)),
                                        _mm512_castps_si512(_mm512_shuffle_ps(f0, f1, 0xDD)));
    /* lane 4m + i holds row m + 4i */
    const __m512i order =
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_epi32(order, s4);
}

/* Rounds x[0..n) (n a multiple of 16) to int16 against its largest magnitude:
 * returns the scale (0 when every x is 0; then q is all 0). */
static inline float vnni_round(const float *x, int64_t n, int16_t *q)
{
    __m512 m = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    const float amax = _mm512_reduce_max_ps(m);
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
    for (int64_t i = 0; i < n; i += 16)
        _mm256_storeu_si256((__m256i *)(q + i), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(
                                                    _mm512_mul_ps(_mm512_loadu_ps(x + i), inv))));
    return amax / 32767.0f;
}

/* Scratch of the integer body, per thread (sized for KIVI_SEG rows). */
typedef struct vnni_scratch_s {
    int16_t *codes;  /* [hkv, KIVI_SEG, d]: a key segment's codes, chunk layout */
    int16_t *qi;     /* [groups, hq, d]: rounded q s per group of a segment and query head */
    float *qscale;   /* [hq, KIVI_SEG + 1] (+ 16: a vector load past the last) */
    float *qz;       /* [hq, KIVI_SEG + 1] (+ 16) */
    __m512i *pairs;  /* [hkv, KIVI_SEG / 2, d / 64, 4]: value codes of row pairs */
    float *vs, *vz;  /* [KIVI_SEG + 16, hkv, d / vgroup]: value scales and zeros */
    float *tmp;      /* [KIVI_SEG + 16] floats */
    float *operm;    /* [hq, d]: value sums in lane order (seg_values_int) */
    int32_t *wi;     /* [d / 32, KIVI_SEG / 2]: rounded value weights, two rows per int32 */
} vnni_scratch;

static void vnni_free(vnni_scratch *v)
{
    if (v == NULL) return;
    free(v->codes);
    free(v->qi);
    free(v->qscale);
    free(v->qz);
    free(v->pairs);
    free(v->vs);
    free(v->vz);
    free(v->tmp);
    free(v->wi);
    free(v->operm);
    free(v);
}

/* Zeroed, so that lanes past a segment's rows read finite numbers. */
static vnni_scratch *vnni_new(int64_t hq, int64_t g, int64_t d, int64_t G)
{
    vnni_scratch *v = calloc(1, sizeof *v);
    if (v == NULL) return NULL;
    /* groups a segment of KIVI_SEG rows touches: (KIVI_SEG - 1) / G + 2 at most */
    const size_t groups = (size_t)((KIVI_SEG - 1) / G + 2);
    const size_t ng = (size_t)(d / 32), hkv = (size_t)(hq / g);
    v->codes = calloc(hkv * KIVI_SEG * (size_t)d, sizeof(int16_t));
    v->qi = calloc(groups * (size_t)(hq * d), sizeof(int16_t));
    v->qscale = calloc((KIVI_SEG + 1) * (size_t)hq + 16, sizeof(float));
    v->qz = calloc((KIVI_SEG + 1) * (size_t)hq + 16, sizeof(float));
    v->pairs = aligned_alloc(64, sizeof(__m512i) * hkv * (KIVI_SEG / 2 * 4 * (size_t)(d / 64)));
    v->vs = calloc(hkv * ng * (KIVI_SEG + 16), sizeof(float));
    v->vz = calloc(hkv * ng * (KIVI_SEG + 16), sizeof(float));
    v->tmp = calloc(KIVI_SEG + 16, sizeof(float));
    v->wi = calloc(ng * (KIVI_SEG / 2), sizeof(int32_t));
    v->operm = calloc((size_t)(hq * d), sizeof(float));
    if (!v->operm || !v->codes || !v->qi || !v->qscale || !v->qz || !v->pairs || !v->vs || !v->vz ||
        !v->tmp || !v->wi) {
        vnni_free(v);
        return NULL;
    }
    return v;
}

/* Rows [t, t + cnt) of one side walked block by block (no division per
 * row): base[u] is row u's first byte (all kv heads). */
static void seg_bases(const kivi_cache *kc, const int32_t *bt, int keys, int64_t t, int64_t cnt,
                      const uint8_t **base)
{
    const int64_t bs = kc->bs, row = kc->hkv * kc->d * kc->bits / 8;
    const uint8_t *side = keys ? kc->k : kc->v;
    const int64_t stride = keys ? kc->kside : kc->vside;
    int64_t blk = t / bs, o = t % bs;
    for (int64_t u = 0; u < cnt; ++u, ++o) {
        if (o == bs) {
            o = 0;
            ++blk;
        }
        base[u] = side + bt[blk] * stride + o * row;
    }
}

/* Scores of quantized key rows [t, t + cnt) (t >= sink, t + cnt <= ws), every
 * head: sc[j * len + u] for query head j and row u (sc: row t's column). Each
 * row is read once for all kv heads (a token's heads are contiguous). */
static void seg_scores_int(const kivi_cache *kc, const int32_t *bt, const float *q, int64_t t,
                           int64_t cnt, int64_t g, float scale, float *sc, int64_t len,
                           float *fbuf, vnni_scratch *vs)
{
    const int64_t d = kc->d, bs = kc->bs, hkv = kc->hkv, G = kc->group, hq = hkv * g;
    const int64_t dp = d * kc->bits / 8, nc = d / 64, g0 = t / G, chunk = 64 * kc->bits / 8;
    const int64_t ngr = (t + cnt - 1) / G - g0 + 1;
    const uint8_t *base[KIVI_SEG];
    seg_bases(kc, bt, 1, t, cnt, base);
    /* Codes of the segment's rows: [h, u, d] in the chunk layout. */
    for (int64_t u = 0; u < cnt; ++u)
        for (int64_t h = 0; h < hkv; ++h) {
            int16_t *dst = vs->codes + (h * KIVI_SEG + u) * d;
            for (int64_t c = 0; c < nc; ++c) {
                __m512i c0, c1;
                vnni_codes(base[u] + h * dp + c * chunk, kc->bits, &c0, &c1);
                _mm512_storeu_si512(dst + c * 64, c0);
                _mm512_storeu_si512(dst + c * 64 + 32, c1);
            }
        }
    /* Each group's rounded q s, its scale and q . z, per query head j:
     * vs->qi [group, j, d]; vs->qscale and vs->qz [j, group] (KIVI_SEG + 1
     * groups per head, so 16 of them load as one vector). */
    int16_t perm_idx[64];
    for (int i = 0; i < 64; ++i) perm_idx[i] = (int16_t)vnni_channel(kc->bits, i);
    const __m512i ix0 = _mm512_loadu_si512(perm_idx), ix1 = _mm512_loadu_si512(perm_idx + 32);
    float *qsf = fbuf, *sf = fbuf + d, *zf = fbuf + 2 * d;
    for (int64_t gr = 0; gr < ngr; ++gr) {
        const int64_t gt = (g0 + gr) * G; /* the group's first token */
        const uint8_t *kb = kc->k + bt[gt / bs] * kc->kside;
        const int64_t gi = (gt % bs) / G;
        for (int64_t h = 0; h < hkv; ++h) {
            /* the group's scales and zeros, as floats once for the kv head's g heads */
            const uint16_t *sp = (const uint16_t *)(kb + kc->scale_off) + (gi * hkv + h) * d;
            const uint16_t *zp = (const uint16_t *)(kb + kc->kzero_off) + (gi * hkv + h) * d;
            for (int64_t c = 0; c < d; c += 16) {
                const __m256i sh = _mm256_loadu_si256((const __m256i *)(sp + c));
                const __m256i zh = _mm256_loadu_si256((const __m256i *)(zp + c));
                _mm512_storeu_ps(sf + c, _mm512_cvtph_ps(sh));
                _mm512_storeu_ps(zf + c, _mm512_cvtph_ps(zh));
            }
            for (int64_t j = h * g; j < (h + 1) * g; ++j) {
                const float *qj = q + j * d;
                __m512 z = _mm512_setzero_ps(), m = _mm512_setzero_ps();
                for (int64_t c = 0; c < d; c += 16) {
                    const __m512 qv = _mm512_loadu_ps(qj + c);
                    const __m512 x = _mm512_mul_ps(qv, _mm512_loadu_ps(sf + c));
                    _mm512_storeu_ps(qsf + c, x);
                    m = _mm512_max_ps(m, _mm512_abs_ps(x));
                    z = _mm512_fmadd_ps(qv, _mm512_loadu_ps(zf + c), z);
                }
                const float amax = _mm512_reduce_max_ps(m);
                const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
                vs->qz[j * (KIVI_SEG + 1) + gr] = _mm512_reduce_add_ps(z);
                vs->qscale[j * (KIVI_SEG + 1) + gr] = amax / 32767.0f;
                int16_t *dst = vs->qi + (gr * hq + j) * d;
                for (int64_t c = 0; c < d; c += 64) {
                    /* rounded, as int16 in channel order, then into the chunk layout */
#define KIVI_Q16(o)                                                                               \
    _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(qsf + c + (o)), inv)))
                    const __m512i lo =
                        _mm512_inserti64x4(_mm512_castsi256_si512(KIVI_Q16(0)), KIVI_Q16(16), 1);
                    const __m512i hi =
                        _mm512_inserti64x4(_mm512_castsi256_si512(KIVI_Q16(32)), KIVI_Q16(48), 1);
#undef KIVI_Q16
                    _mm512_storeu_si512(dst + c, _mm512_permutex2var_epi16(lo, ix0, hi));
                    _mm512_storeu_si512(dst + c + 32, _mm512_permutex2var_epi16(lo, ix1, hi));
                }
            }
        }
    }
    /* Each row's group (in the segment) and its offset into vs->qi, without a
     * division per row; rows past cnt (computed on stale codes, then not
     * stored) take group 0. */
    int32_t rowgr[KIVI_SEG + 16] = {0}, rowoff[KIVI_SEG + 16] = {0};
    for (int64_t u = 0, gr = 0, next = (g0 + 1) * G; u < cnt; ++u) {
        if (t + u == next) {
            ++gr;
            next += G;
        }
        rowgr[u] = (int32_t)gr;
        rowoff[u] = (int32_t)(gr * hq * d);
    }
    /* Scores, 16 rows at a time per query head. */
    for (int64_t j = 0; j < hq; ++j) {
        float *sj = sc + j * len;
        const int16_t *qh = vs->qi + j * d;
        const int16_t *ch = vs->codes + (j / g) * KIVI_SEG * d;
        const float *qsj = vs->qscale + j * (KIVI_SEG + 1), *qzj = vs->qz + j * (KIVI_SEG + 1);
        for (int64_t u0 = 0; u0 < cnt; u0 += 16) {
            const int64_t m = cnt - u0 < 16 ? cnt - u0 : 16;
            __m512i acc[16];
#pragma GCC unroll 16
            for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_si512();
            const int16_t *cr = ch + u0 * d;
            for (int64_t c = 0; c < d; c += 32)
#pragma GCC unroll 16
                for (int r = 0; r < 16; ++r)
                    acc[r] = _mm512_dpwssd_epi32(acc[r], _mm512_loadu_si512(cr + r * d + c),
                                                 _mm512_loadu_si512(qh + rowoff[u0 + r] + c));
            __m512 rs, rz;
            const __m512i gv = _mm512_loadu_si512(rowgr + u0);
            if (ngr <= 16) {
                rs = _mm512_permutexvar_ps(gv, _mm512_loadu_ps(qsj));
                rz = _mm512_permutexvar_ps(gv, _mm512_loadu_ps(qzj));
            } else {
                rs = _mm512_i32gather_ps(gv, qsj, 4);
                rz = _mm512_i32gather_ps(gv, qzj, 4);
            }
            const __m512 isum = _mm512_cvtepi32_ps(vnni_hsum16(acc));
            const __m512 sv = _mm512_mul_ps(_mm512_fmadd_ps(isum, rs, rz), _mm512_set1_ps(scale));
            _mm512_mask_storeu_ps(sj + u0, (__mmask16)((1u << m) - 1), sv);
        }
    }
}

/* The values of quantized rows [t, t + cnt), every head, weighted by
 * p[j * len + u] (p: row t's column of the probabilities), added to
 * vs->operm in lane order (vnni_values_out puts them in channel order). */
static void seg_values_int(const kivi_cache *kc, const int32_t *bt, const float *p, int64_t t,
                           int64_t cnt, int64_t g, int64_t len, vnni_scratch *vs)
{
    const int64_t d = kc->d, hkv = kc->hkv, vg = kc->vgroup, ng = d / vg;
    const int64_t dp = d * kc->bits / 8, nc = d / 64, np = (cnt + 1) / 2, rows = 2 * np;
    const int64_t chunk = 64 * kc->bits / 8;
    const uint8_t *base[KIVI_SEG];
    seg_bases(kc, bt, 0, t, cnt, base);
    /* Scales and zeros as floats in the cache's order [u, h, k], converted a
     * block's run of rows at a time (the rows of a run are contiguous). */
    const int64_t per_row = hkv * ng;
    for (int64_t u = 0, blk = t / kc->bs, o = t % kc->bs; u < cnt; o = 0, ++blk) {
        const int64_t n = cnt - u < kc->bs - o ? cnt - u : kc->bs - o, count = n * per_row;
        const uint8_t *b = kc->v + bt[blk] * kc->vside;
        const uint16_t *src[2] = {(const uint16_t *)(b + kc->scale_off) + o * per_row,
                                  (const uint16_t *)(b + kc->vzero_off) + o * per_row};
        float *dst[2] = {vs->vs + u * per_row, vs->vz + u * per_row};
        for (int side = 0; side < 2; ++side)
            for (int64_t i = 0; i < count; i += 16) {
                const __mmask16 mk =
                    count - i >= 16 ? 0xFFFF : (__mmask16)((1u << (count - i)) - 1);
                _mm512_mask_storeu_ps(dst[side] + i, mk,
                                      _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, src[side] + i)));
            }
        u += n;
    }
    /* Codes of row pairs [h, pair, chunk, 4]. */
    for (int64_t pi = 0; pi < np; ++pi) {
        const int64_t u = 2 * pi;
        for (int64_t h = 0; h < hkv; ++h) {
            __m512i *dst = vs->pairs + ((h * (KIVI_SEG / 2) + pi) * nc) * 4;
            for (int64_t c = 0; c < nc; ++c, dst += 4) {
                __m512i a0, a1, b0 = _mm512_setzero_si512(), b1 = _mm512_setzero_si512();
                vnni_codes(base[u] + h * dp + c * chunk, kc->bits, &a0, &a1);
                if (u + 1 < cnt) vnni_codes(base[u + 1] + h * dp + c * chunk, kc->bits, &b0, &b1);
                dst[0] = _mm512_unpacklo_epi16(a0, b0);
                dst[1] = _mm512_unpackhi_epi16(a0, b0);
                dst[2] = _mm512_unpacklo_epi16(a1, b1);
                dst[3] = _mm512_unpackhi_epi16(a1, b1);
            }
        }
    }
    /* Lanes (of 16 int32) in the second channel group of a chunk, for 32-channel groups. */
    const __mmask16 second = vg == 32 ? (kc->bits == 4 ? 0xFF00 : 0xF0F0) : 0;
    const __m512i rowidx = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int32_t)per_row));
    for (int64_t j = 0; j < hkv * g; ++j) {
        const int64_t h = j / g;
        const float *pj = p + j * len;
        float *w = vs->tmp, wscale[ng], zsum[ng];
        /* Weights p_u s_uk rounded per channel group, packed two rows per int32. */
        for (int64_t k = 0; k < ng; ++k) {
            /* rows u .. u + 15 of the [u, h, k] scales: a stride of per_row; rows
             * past cnt read finite stale numbers (zeroed scratch) weighted by p = 0 */
            const float *sk = vs->vs + h * ng + k, *zk = vs->vz + h * ng + k;
            __m512 z = _mm512_setzero_ps();
            for (int64_t u = 0; u < rows; u += 16) {
                const __mmask16 mk = rows - u >= 16 ? 0xFFFF : (__mmask16)((1u << (rows - u)) - 1);
                const __mmask16 mp = cnt - u >= 16 ? 0xFFFF
                                     : cnt > u      ? (__mmask16)((1u << (cnt - u)) - 1)
                                                    : 0;
                const __m512 pv = _mm512_maskz_loadu_ps(mp, pj + u);
                const __m512 sv = _mm512_i32gather_ps(rowidx, sk + u * per_row, 4);
                const __m512 zv = _mm512_i32gather_ps(rowidx, zk + u * per_row, 4);
                _mm512_mask_storeu_ps(w + u, mk, _mm512_mul_ps(pv, sv));
                z = _mm512_fmadd_ps(pv, zv, z);
            }
            zsum[k] = _mm512_reduce_add_ps(z);
            for (int64_t u = rows; u % 16; ++u) w[u] = 0.0f;
            /* int16 u of the group's pairs is row u: rows 2i and 2i + 1 share int32 i */
            int16_t *wk = (int16_t *)(vs->wi + k * (KIVI_SEG / 2));
            wscale[k] = vnni_round(w, (rows + 15) / 16 * 16, wk);
        }
        /* The segment's sums, into the head's accumulators in lane order. */
        float *oj = vs->operm + j * d;
        for (int64_t c = 0; c < nc; ++c) {
            const int64_t k0 = c * 64 / vg, k1 = second ? k0 + 1 : k0;
            const int32_t *w0 = vs->wi + k0 * (KIVI_SEG / 2), *w1 = vs->wi + k1 * (KIVI_SEG / 2);
            __m512i acc0 = _mm512_setzero_si512(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
            const __m512i *pv = vs->pairs + (h * (KIVI_SEG / 2) * nc + c) * 4;
            for (int64_t pi = 0; pi < np; ++pi, pv += 4 * nc) {
                const __m512i mult =
                    _mm512_mask_set1_epi32(_mm512_set1_epi32(w0[pi]), second, w1[pi]);
                acc0 = _mm512_dpwssd_epi32(acc0, pv[0], mult);
                acc1 = _mm512_dpwssd_epi32(acc1, pv[1], mult);
                acc2 = _mm512_dpwssd_epi32(acc2, pv[2], mult);
                acc3 = _mm512_dpwssd_epi32(acc3, pv[3], mult);
            }
            const __m512 ws = _mm512_mask_blend_ps(second, _mm512_set1_ps(wscale[k0]),
                                                   _mm512_set1_ps(wscale[k1]));
            const __m512 zs = _mm512_mask_blend_ps(second, _mm512_set1_ps(zsum[k0]),
                                                   _mm512_set1_ps(zsum[k1]));
            const __m512i accs[4] = {acc0, acc1, acc2, acc3};
            for (int a = 0; a < 4; ++a) {
                float *o = oj + c * 64 + 16 * a;
                _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o),
                                                  _mm512_fmadd_ps(_mm512_cvtepi32_ps(accs[a]),
                                                                  ws, zs)));
            }
        }
    }
}

/* out[j, c] += the lane-order accumulators of seg_values_int, for every head j. */
static void vnni_values_out(const kivi_cache *kc, int64_t hq, const float *operm, float *out)
{
    const int64_t d = kc->d;
    int32_t perm[64]; /* output channel of lane i of a chunk (accumulator i / 16) */
    for (int a = 0; a < 4; ++a)
        for (int l = 0; l < 16; ++l) {
            /* unpacklo/hi keep 128-bit lanes: int32 lane l of pair vector a
             * came from int16 lane 8 (l / 4) + 4 (a % 2) + l % 4 of c(a / 2) */
            const int w = 8 * (l / 4) + 4 * (a % 2) + l % 4;
            perm[a * 16 + l] = vnni_channel(kc->bits, 32 * (a / 2) + w);
        }
    for (int64_t j = 0; j < hq; ++j)
        for (int64_t c = 0; c < d; c += 64)
            for (int i = 0; i < 64; ++i) out[j * d + c + perm[i]] += operm[j * d + c + i];
}
#else
struct vnni_scratch_s {
    int unused;
};
static struct vnni_scratch_s *vnni_new(int64_t hq, int64_t g, int64_t d, int64_t G)
{
    (void)G;
    (void)hq;
    (void)g;
    (void)d;
    return calloc(1, sizeof(struct vnni_scratch_s));
}
static void vnni_free(struct vnni_scratch_s *v) { free(v); }
#endif /* KIVI_VNNI */

/* Whether layouts of head size d and value groups of vgroup channels take the
 * integer body in this build. */
static int integer_body(int64_t d, int64_t vgroup)
{
#ifdef KIVI_VNNI
    return d % 64 == 0 && (vgroup == 32 || vgroup % 64 == 0);
#else
    (void)d;
    (void)vgroup;
    return 0;
#endif
}

int fuel_kivi_integer_body(int64_t d, int64_t vgroup) { return integer_body(d, vgroup); }

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
#ifdef KIVI_VNNI
    vnni_scratch *vs = integer_body(kc->d, kc->vgroup) ? s->vnni : NULL;
#endif
    /* Pass 1: scores, segment by segment. */
    for (int64_t t = t0; t < t1;) {
        const int quantized = t >= sink && t < ws;
        int64_t end;
        if (quantized) {
            end = (t / G + 1) * G; /* the group's end (ws and sink are group-aligned) */
#ifdef KIVI_VNNI
            if (vs != NULL) end = ws; /* the integer body takes each row's group */
#endif
        } else {
            end = t < sink ? sink : t1;
        }
        if (end > t1) end = t1;
        if (end - t > KIVI_SEG) end = t + KIVI_SEG;
        const int64_t cnt = end - t;
#ifdef KIVI_VNNI
        if (quantized && vs != NULL) {
            seg_scores_int(kc, bt, q, t, cnt, g, scale, sc + (t - t0), len, s->rows, vs);
            t = end;
            continue;
        }
#endif
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
#ifdef KIVI_VNNI
    int any_int = 0;
    if (vs != NULL) memset(vs->operm, 0, sizeof(float) * (size_t)(hq * d));
#endif
    for (int64_t t = t0; t < t1;) {
        const int quantized = t >= sink && t < ws;
        int64_t end = quantized ? ws : (t < sink ? sink : t1);
        if (end > t1) end = t1;
        if (end - t > KIVI_SEG) end = t + KIVI_SEG;
        const int64_t cnt = end - t;
#ifdef KIVI_VNNI
        if (quantized && vs != NULL) {
            seg_values_int(kc, bt, sc + (t - t0), t, cnt, g, len, vs);
            any_int = 1;
            t = end;
            continue;
        }
#endif
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
#ifdef KIVI_VNNI
    if (any_int) vnni_values_out(kc, hq, vs->operm, out);
#endif
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
        kivi_scratch *s = fuel_kivi_scratch_new(&kv, hq, hkv, d);
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
