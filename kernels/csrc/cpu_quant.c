/*
 * Block-quantized linears for the CPU path: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
 *
 * Two weight formats, both llama.cpp's block quantizations (32 weights per
 * block, one scale each) in a layout repacked for SIMD loads
 * (kernels/quant_linear.py builds them; its torch references define the
 * arithmetic):
 *   Q8_0:  w = d * q,      q int8.        qs [N, K] int8,   d [N, nb] fp16.
 *   Q4_1:  w = d * q + m,  q in 0..15.    qs [N, nb / 2, 32] bytes: byte i of
 *          pair p holds element i of block 2p in its low nibble and element i
 *          of block 2p + 1 in its high nibble; d, m [N, nb] fp16.
 * nb = K / 32 (for Q4_1 rounded up to even; the padding block has d = m = 0).
 *
 * Activations are quantized per 32-element block to 15-bit integers held in
 * two int8 planes: with e = amax / (127 * 128) and s = x / (127 e), the code
 * q = rint(128 s) = 128 hi + lo, hi = rint(s) in [-127, 127] and
 * lo = rint(128 (s - hi)) in [-64, 64], and x ~ e * q. A block's dot is two
 * integer dots (hi and lo against the same unpacked weight bytes) combined as
 * 128 * dot(hi) + dot(lo), scaled by d * e; Q4_1 adds m * sx with
 * sx = e * sum(q). llama.cpp's 8-bit activation blocks (hi alone) moved the
 * default model's first-token distribution by total variation 0.07 and flipped
 * its greedy answer; 15 bits move it by 0.0004 (docs/benchmarks/cpu.md), for
 * one more integer dot per block. Reading 0.5625 (Q4_1) or 1.06 (Q8_0) bytes
 * per weight is what makes decode fast on a bandwidth-bound CPU.
 *
 * Three code paths, chosen when the library is built (-march=native; the
 * CPU's flags are part of the build key in kernels/cpu_native.py):
 *  - AVX-512 VNNI: one 64-byte vpdpbusd per activation plane covers two
 *    blocks (a Q4_1 pair's low and high nibbles, or two Q8_0 blocks made
 *    unsigned by +128 with the correction folded into the accumulator), the hi
 *    plane's sum shifted by 7 bits into the lo plane's accumulator; tiles of up to 4 weight rows x
 *    4 activation rows, so each unpacked weight block serves several rows
 *    and each activation block several weight rows; the same kernel serves
 *    one decode row and a 2,048-row prefill chunk.
 *  - AVX2: maddubs + madd per block and plane (llama.cpp's AVX2 route), up
 *    to four activation rows per pass over a weight row.
 *  - portable C (tested through a -mno-avx2 build).
 * In every path an output's value is computed by the same sequence of
 * operations whatever the number of rows and the split across threads: a
 * sequence's logits do not depend on what else is in its batch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define FUEL_AVX2 1
#endif
#if defined(FUEL_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define FUEL_VNNI512 1
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

#include "fuel_half.h"
#include "fuel_internal.h"

#define QK FUEL_QK
#define MT 4                  /* activation rows per tile */
#define ROW_BLOCK 64          /* activation rows kept hot in L2 while weight rows stream */
#define PAR_MIN_BLOCKS 4096   /* weight blocks x rows below which one thread is faster */

int fuel_quant_caps(void)
{
    int caps = 0;
#ifdef FUEL_AVX2
    caps |= 1;
#endif
#ifdef FUEL_VNNI512
    caps |= 2;
#endif
    return caps;
}

int64_t fuel_qx_blocks(int qtype, int64_t k) { return qtype == 1 ? (k / QK + 1) / 2 * 2 : k / QK; }

/* ---- activation quantization (identical results on every path) -------- */

/* One block: hi and lo codes (32 each), the scale e and e * sum(q). */
static inline void quantize_block(const float *xb, int8_t *hi, int8_t *lo, float *e_out,
                                  float *s_out, int32_t *q_out)
{
#ifdef FUEL_VNNI512
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d = amax / 127.0f;
    const float id = d > 0.0f ? 1.0f / d : 0.0f;
    const __m512 vid = _mm512_set1_ps(id), k128 = _mm512_set1_ps(128.0f);
    /* cvtps rounds to nearest even, as nearbyintf does in the default mode;
     * s - rint(s) and the product by 128 are exact in float. */
    const __m512 s0 = _mm512_mul_ps(v0, vid), s1 = _mm512_mul_ps(v1, vid);
    const __m512i h0 = _mm512_cvtps_epi32(s0), h1 = _mm512_cvtps_epi32(s1);
    const __m512i l0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(s0, _mm512_cvtepi32_ps(h0)), k128));
    const __m512i l1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(s1, _mm512_cvtepi32_ps(h1)), k128));
    _mm_storeu_si128((__m128i *)hi, _mm512_cvtepi32_epi8(h0));
    _mm_storeu_si128((__m128i *)(hi + 16), _mm512_cvtepi32_epi8(h1));
    _mm_storeu_si128((__m128i *)lo, _mm512_cvtepi32_epi8(l0));
    _mm_storeu_si128((__m128i *)(lo + 16), _mm512_cvtepi32_epi8(l1));
    const __m512i q = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0, h1), 7),
                                       _mm512_add_epi32(l0, l1));
    const float e = d / 128.0f;
    const int32_t qsum = _mm512_reduce_add_epi32(q);
    *e_out = e;
    *s_out = e * (float)qsum;
    *q_out = qsum;
#else
    float amax = 0.0f;
    for (int j = 0; j < QK; ++j) amax = fmaxf(amax, fabsf(xb[j]));
    const float d = amax / 127.0f;
    const float id = d > 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int j = 0; j < QK; ++j) {
        const float sj = xb[j] * id;
        const float h = nearbyintf(sj);
        const int l = (int)nearbyintf((sj - h) * 128.0f);
        hi[j] = (int8_t)(int)h;
        lo[j] = (int8_t)l;
        sum += 128 * (int)h + l;
    }
    const float e = d / 128.0f;
    *e_out = e;
    *s_out = e * (float)sum;
    *q_out = sum;
#endif
}

void fuel_qx_quantize_span(const float *x, int64_t k, int64_t nb, int64_t r, int64_t b0,
                           int64_t b1, int8_t *qx, float *dx, float *sx)
{
    const int64_t kb = k / QK;
    int8_t *row = qx + r * FUEL_QX_ROW(nb);
    int32_t *qsum = (int32_t *)(row + 2 * nb * QK);
    for (int64_t b = b0; b < b1; ++b) {
        int8_t *hi = row + b * QK, *lo = row + (nb + b) * QK;
        if (b >= kb) {
            memset(hi, 0, QK);
            memset(lo, 0, QK);
            dx[r * nb + b] = 0.0f;
            sx[r * nb + b] = 0.0f;
            qsum[b] = 0;
            continue;
        }
        quantize_block(x + r * k + b * QK, hi, lo, dx + r * nb + b, sx + r * nb + b, qsum + b);
    }
}

void fuel_qx_quantize_rows(const float *x, int64_t k, int64_t nb, int64_t r0, int64_t r1,
                           int8_t *qx, float *dx, float *sx)
{
    for (int64_t r = r0; r < r1; ++r) fuel_qx_quantize_span(x, k, nb, r, 0, nb, qx, dx, sx);
}

/* ---- AVX-512 VNNI ------------------------------------------------------ */
#ifdef FUEL_VNNI512

/* [s0 x 8 | s1 x 8] from two consecutive floats / fp16 values. */
static inline __m512 pair_f(const float *s, __m512i idx)
{
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_castsi128_ps(
                                          _mm_loadl_epi64((const __m128i *)s))));
}

static inline __m512 pair_h(const uint16_t *h, __m512i idx)
{
    uint32_t bits;
    memcpy(&bits, h, sizeof bits);
    return _mm512_permutexvar_ps(
        idx, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128((int)bits))));
}

/* [s0 x 8 | 0 x 8]: the last block of an odd count (lane 1 of the load is 0). */
static inline __m512 single_f(const float *s, __m512i idx)
{
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_load_ss(s)));
}

static inline __m512 single_h(const uint16_t *h, __m512i idx)
{
    return _mm512_permutexvar_ps(
        idx, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128((int)h[0]))));
}

/* Q4_1's offset term of one weight row and one activation row: sum_b m[b] sx[b]. */
static inline float q4_offset(const uint16_t *m, const float *sx, int64_t nb)
{
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b += 16) {
        const __mmask16 mask = nb - b >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (nb - b)) - 1);
        const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, m + b));
        acc = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(mask, sx + b), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* NR weight rows from n x MR activation rows from r (Q4_1). */
static inline __attribute__((always_inline)) void q4_1_tile(const fuel_qweight *w, int64_t n,
                                                            const int NR, const int8_t *qx,
                                                            const float *dx, const float *sx,
                                                            int64_t nb, int64_t r, const int MR,
                                                            float *y, int64_t ys, int64_t col0)
{
    const int64_t pairs = nb / 2, qs_row = pairs * QK;
    const __m512i shift = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
    const __m512i low = _mm512_set1_epi8(0x0f);
    const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc[4][4];
    for (int i = 0; i < NR; ++i)
        for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
        __m512i a[4], b[4];
        __m512 xs[4];
        for (int j = 0; j < MR; ++j) {
            const int8_t *row = qx + (r + j) * FUEL_QX_ROW(nb);
            a[j] = _mm512_loadu_si512(row + 2 * p * QK);
            b[j] = _mm512_loadu_si512(row + (nb + 2 * p) * QK);
            xs[j] = pair_f(dx + (r + j) * nb + 2 * p, idx);
        }
        for (int i = 0; i < NR; ++i) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(w->qs + (n + i) * qs_row + p * QK));
            /* low nibbles (block 2p) in bytes 0..31, high nibbles (2p + 1) in 32..63 */
            const __m512i wq =
                _mm512_and_si512(_mm512_srlv_epi64(_mm512_broadcast_i64x4(raw), shift), low);
            const __m512 ws = pair_h(w->d + (n + i) * nb + 2 * p, idx);
            for (int j = 0; j < MR; ++j) {
                const __m512i th = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, a[j]);
                const __m512i t = _mm512_dpbusd_epi32(_mm512_slli_epi32(th, 7), wq, b[j]);
                acc[i][j] =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(ws, xs[j]), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < NR; ++i) {
        const float bn = w->bias ? w->bias[n + i] : 0.0f;
        for (int j = 0; j < MR; ++j) {
            const float off = q4_offset(w->m + (n + i) * nb, sx + (r + j) * nb, nb);
            y[(r + j) * ys + (n + i - col0)] = _mm512_reduce_add_ps(acc[i][j]) + off + bn;
        }
    }
}

/* NR weight rows from n x MR activation rows from r (Q8_0). The weight bytes
 * are made unsigned (w + 128) for vpdpbusd; the accumulator starts at
 * -128 * sum(a) per lane, so the integer result is exactly sum(w * a). */
static inline __attribute__((always_inline)) void q8_0_tile(const fuel_qweight *w, int64_t n,
                                                            const int NR, const int8_t *qx,
                                                            const float *dx, int64_t nb, int64_t r,
                                                            const int MR, float *y, int64_t ys,
                                                            int64_t col0)
{
    const int64_t k = w->k, pairs = nb / 2;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc[4][4];
    for (int i = 0; i < NR; ++i)
        for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p <= pairs; ++p) {
        const int tail = p == pairs;
        if (tail && !(nb & 1)) break;
        /* The tail block alone: the upper 32 bytes load as zeros and their
         * scale lanes are zero. */
        const __mmask64 mask = tail ? (__mmask64)0xffffffffULL : ~(__mmask64)0;
        __m512i a[4], b[4], ca[4], cb[4];
        __m512 xs[4];
        for (int j = 0; j < MR; ++j) {
            const int8_t *row = qx + (r + j) * FUEL_QX_ROW(nb);
            a[j] = _mm512_maskz_loadu_epi8(mask, row + 2 * p * QK);
            b[j] = _mm512_maskz_loadu_epi8(mask, row + (nb + 2 * p) * QK);
            xs[j] = tail ? single_f(dx + (r + j) * nb + 2 * p, idx)
                         : pair_f(dx + (r + j) * nb + 2 * p, idx);
            ca[j] = _mm512_sub_epi32(_mm512_setzero_si512(),
                                     _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, a[j]));
            cb[j] = _mm512_sub_epi32(_mm512_setzero_si512(),
                                     _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, b[j]));
        }
        for (int i = 0; i < NR; ++i) {
            const __m512i wq = _mm512_xor_si512(
                _mm512_maskz_loadu_epi8(mask, w->qs + (n + i) * k + 2 * p * QK), flip);
            const __m512 ws = tail ? single_h(w->d + (n + i) * nb + 2 * p, idx)
                                   : pair_h(w->d + (n + i) * nb + 2 * p, idx);
            for (int j = 0; j < MR; ++j) {
                const __m512i th = _mm512_dpbusd_epi32(ca[j], wq, a[j]);
                const __m512i t =
                    _mm512_dpbusd_epi32(_mm512_add_epi32(_mm512_slli_epi32(th, 7), cb[j]), wq, b[j]);
                acc[i][j] =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(ws, xs[j]), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < NR; ++i) {
        const float bn = w->bias ? w->bias[n + i] : 0.0f;
        for (int j = 0; j < MR; ++j)
            y[(r + j) * ys + (n + i - col0)] = _mm512_reduce_add_ps(acc[i][j]) + bn;
    }
}

#define TILE_CASE(NR, MR)                                                                 \
    case NR * 8 + MR:                                                                     \
        if (w->qtype == 1)                                                                \
            q4_1_tile(w, n, NR, qx, dx, sx, nb, r, MR, y, ys, col0);                      \
        else                                                                              \
            q8_0_tile(w, n, NR, qx, dx, nb, r, MR, y, ys, col0);                          \
        break;

/* Dispatch to a constant tile shape (so each is fully unrolled). nr is 1, 2
 * or 4; 4 x 3-4 tiles run as two 2-row ones (8 accumulators + 4 activation
 * rows fill the 32 vector registers). */
static void tile(const fuel_qweight *w, int64_t n, int nr, const int8_t *qx, const float *dx,
                 const float *sx, int64_t nb, int64_t r, int mr, float *y, int64_t ys,
                 int64_t col0)
{
    if (nr == 4 && mr >= 3) {
        tile(w, n, 2, qx, dx, sx, nb, r, mr, y, ys, col0);
        tile(w, n + 2, 2, qx, dx, sx, nb, r, mr, y, ys, col0);
        return;
    }
    switch (nr * 8 + mr) {
        TILE_CASE(4, 1)
        TILE_CASE(4, 2)
        TILE_CASE(2, 1)
        TILE_CASE(2, 2)
        TILE_CASE(2, 3)
        TILE_CASE(2, 4)
        TILE_CASE(1, 1)
        TILE_CASE(1, 2)
        TILE_CASE(1, 3)
        TILE_CASE(1, 4)
    }
}
#undef TILE_CASE

/* ---- the x16 layout: 16 weight rows interleaved per block ---------------- */

/* Packed by kernels/quant_linear.py (pack_x16): for each group of 16 weight
 * rows and each block, Q4_1: 4 vectors of 64 bytes, byte 4 i + t of vector j
 * holding row i's codes k = 4 j + t (low nibble) and 16 + 4 j + t (high);
 * Q8_0: 8 vectors, byte 4 i + t of vector j row i's k = 4 j + t; then the
 * group's 16 scales (and minima) per block, fp16. One vpdpbusd multiplies 16
 * rows by 4 activation codes (broadcast), so the integer sums of a block
 * stay in 16 lanes, one per row, and its float scaling is paid once per 16
 * rows x 32 codes (against once per 64 codes in the row-major layout); the
 * outputs come out as a vector of 16 columns, with no horizontal sums. */

static inline __m512i bcast4(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

/* Group g (16 weight rows) x MR activation rows from r, columns masked by store. */
static inline __attribute__((always_inline)) void x16_tile(const fuel_qweight *w, int64_t g,
                                                           const int8_t *qx, const float *dx,
                                                           const float *sx, int64_t nb,
                                                           int64_t r, const int MR, float *y,
                                                           int64_t ys, int64_t col0,
                                                           __mmask16 store)
{
    const int64_t nbk = w->k / QK, row_bytes = FUEL_QX_ROW(nb);
    const int q4 = w->qtype == 1;
    const __m512i low = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[4];
    for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nbk; ++b) {
        __m512i hi[4], lo[4];
        for (int m = 0; m < MR; ++m) hi[m] = lo[m] = _mm512_setzero_si512();
        if (q4) {
            const uint8_t *pk = w->qs + (g * nbk + b) * 4 * 64;
            for (int j = 0; j < 4; ++j) {
                const __m512i pv = _mm512_loadu_si512(pk + j * 64);
                const __m512i w0 = _mm512_and_si512(pv, low);
                const __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(pv, 4), low);
                for (int m = 0; m < MR; ++m) {
                    const int8_t *h = qx + (r + m) * row_bytes + b * QK, *l = h + nb * QK;
                    hi[m] = _mm512_dpbusd_epi32(hi[m], w0, bcast4(h + 4 * j));
                    hi[m] = _mm512_dpbusd_epi32(hi[m], w1, bcast4(h + 16 + 4 * j));
                    lo[m] = _mm512_dpbusd_epi32(lo[m], w0, bcast4(l + 4 * j));
                    lo[m] = _mm512_dpbusd_epi32(lo[m], w1, bcast4(l + 16 + 4 * j));
                }
            }
        } else {
            const uint8_t *pk = w->qs + (g * nbk + b) * 8 * 64;
            for (int j = 0; j < 8; ++j) {
                /* +128: unsigned bytes for vpdpbusd; corrected below by 128 * sum(q). */
                const __m512i wq = _mm512_xor_si512(_mm512_loadu_si512(pk + j * 64), flip);
                for (int m = 0; m < MR; ++m) {
                    const int8_t *h = qx + (r + m) * row_bytes + b * QK, *l = h + nb * QK;
                    hi[m] = _mm512_dpbusd_epi32(hi[m], wq, bcast4(h + 4 * j));
                    lo[m] = _mm512_dpbusd_epi32(lo[m], wq, bcast4(l + 4 * j));
                }
            }
        }
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->d + (g * nbk + b) * 16)));
        const __m512 mv = q4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->m + (g * nbk + b) * 16)))
                             : _mm512_setzero_ps();
        for (int m = 0; m < MR; ++m) {
            __m512i t = _mm512_add_epi32(_mm512_slli_epi32(hi[m], 7), lo[m]);
            if (!q4) {
                const int32_t *qs = (const int32_t *)(qx + (r + m) * row_bytes + 2 * nb * QK);
                t = _mm512_sub_epi32(t, _mm512_set1_epi32(128 * qs[b]));
            }
            const __m512 s = _mm512_mul_ps(dv, _mm512_set1_ps(dx[(r + m) * nb + b]));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), s, acc[m]);
            if (q4) acc[m] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sx[(r + m) * nb + b]), acc[m]);
        }
    }
    const __m512 bv = w->bias ? _mm512_maskz_loadu_ps(store, w->bias + g * 16) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m)
        _mm512_mask_storeu_ps(y + (r + m) * ys + g * 16 - col0, store, _mm512_add_ps(acc[m], bv));
}

static void x16_rows(const fuel_qweight *w, const int8_t *qx, const float *dx, const float *sx,
                     int64_t nb, int64_t rows, int64_t n0, int64_t n1, float *y, int64_t ys,
                     int64_t col0)
{
    for (int64_t rb = 0; rb < rows; rb += ROW_BLOCK) {
        const int64_t re = rows - rb < ROW_BLOCK ? rows : rb + ROW_BLOCK;
        for (int64_t g = n0 / 16; g * 16 < n1; ++g) {
            const int64_t lo = g * 16 > n0 ? g * 16 : n0, hi = g * 16 + 16 < n1 ? g * 16 + 16 : n1;
            const __mmask16 store = (__mmask16)(((1u << (hi - lo)) - 1) << (lo - g * 16));
            for (int64_t r = rb; r < re; r += MT) {
                switch (re - r < MT ? (int)(re - r) : MT) {
                case 1: x16_tile(w, g, qx, dx, sx, nb, r, 1, y, ys, col0, store); break;
                case 2: x16_tile(w, g, qx, dx, sx, nb, r, 2, y, ys, col0, store); break;
                case 3: x16_tile(w, g, qx, dx, sx, nb, r, 3, y, ys, col0, store); break;
                default: x16_tile(w, g, qx, dx, sx, nb, r, 4, y, ys, col0, store); break;
                }
            }
        }
    }
}

void fuel_qgemm_rows(const fuel_qweight *w, const int8_t *qx, const float *dx, const float *sx,
                     int64_t nb, int64_t rows, int64_t n0, int64_t n1, float *y, int64_t ys,
                     int64_t col0)
{
    if (w->layout == FUEL_LAYOUT_X16) {
        x16_rows(w, qx, dx, sx, nb, rows, n0, n1, y, ys, col0);
        return;
    }
    /* A block of activation rows stays in L2 while the weight rows stream
     * past it; each tile's weight rows stay in L1 across the block. */
    for (int64_t rb = 0; rb < rows; rb += ROW_BLOCK) {
        const int64_t re = rows - rb < ROW_BLOCK ? rows : rb + ROW_BLOCK;
        for (int64_t n = n0; n < n1;) {
            const int nr = n1 - n >= 4 ? 4 : n1 - n >= 2 ? 2 : 1;
            for (int64_t r = rb; r < re; r += MT)
                tile(w, n, nr, qx, dx, sx, nb, r, re - r < MT ? (int)(re - r) : MT, y, ys, col0);
            n += nr;
        }
    }
}

/* ---- AVX2 and portable ------------------------------------------------- */
#else

#ifdef FUEL_AVX2
static inline float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* int32 lanes of sum(u8 a * s8 b) over 32 byte pairs (no saturation for our
 * ranges: |pair sum| <= 2 * 127 * 127). */
static inline __m256i madd_u8s8(__m256i a, __m256i b)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
}

/* Float lanes of sum(w * (128 hi + lo)) for unsigned weight bytes w and the
 * hi and lo activation planes of one block. */
static inline __m256 dot2(__m256i w, const int8_t *hi, const int8_t *lo)
{
    const __m256i th = madd_u8s8(w, _mm256_loadu_si256((const __m256i *)hi));
    const __m256i tl = madd_u8s8(w, _mm256_loadu_si256((const __m256i *)lo));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(th, 7), tl));
}
#endif

/* Per-row block scales for `mt` activation rows: ds[r][b] = half(d[b]) * dx[r][b]. */
static inline void row_scales(const uint16_t *d, const float *dx, int64_t nb, int mt, float *ds)
{
    int64_t b = 0;
#ifdef FUEL_AVX2
    for (; b + 8 <= nb; b += 8) {
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b)));
        for (int r = 0; r < mt; ++r)
            _mm256_storeu_ps(ds + r * nb + b, _mm256_mul_ps(dw, _mm256_loadu_ps(dx + r * nb + b)));
    }
#endif
    for (; b < nb; ++b) {
        const float dw = h2f(d[b]);
        for (int r = 0; r < mt; ++r) ds[r * nb + b] = dw * dx[r * nb + b];
    }
}

/* Q4_1's offset term for `mt` activation rows: offs[r] = sum_b half(m[b]) * sx[r][b]. */
static inline void row_offsets(const uint16_t *m, const float *sx, int64_t nb, int mt, float *offs)
{
    for (int r = 0; r < mt; ++r) {
        const float *s = sx + r * nb;
        float total = 0.0f;
        int64_t b = 0;
#ifdef FUEL_AVX2
        __m256 acc = _mm256_setzero_ps();
        for (; b + 8 <= nb; b += 8)
            acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + b))),
                                  _mm256_loadu_ps(s + b), acc);
        total = hsum8(acc);
#endif
        for (; b < nb; ++b) total += h2f(m[b]) * s[b];
        offs[r] = total;
    }
}

/* One Q4_1 weight row against `mt` (<= MT) quantized activation rows. */
static inline __attribute__((always_inline)) void q4_1_row(const uint8_t *qs, const uint16_t *d,
                                                           const uint16_t *m, const int8_t *qx,
                                                           const float *dx, const float *sx,
                                                           int64_t nb, const int mt, float *ds,
                                                           float *out)
{
    row_scales(d, dx, nb, mt, ds);
    float offs[MT];
    row_offsets(m, sx, nb, mt, offs);
#ifdef FUEL_AVX2
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256 acc[MT];
    for (int r = 0; r < mt; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t p = 0; p < nb / 2; ++p) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + p * QK));
        const __m256i q0 = _mm256_and_si256(raw, low);
        const __m256i q1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        for (int r = 0; r < mt; ++r) {
            const int8_t *a = qx + r * FUEL_QX_ROW(nb) + 2 * p * QK, *b = a + nb * QK;
            const __m256 s0 = dot2(q0, a, b);
            const __m256 s1 = dot2(q1, a + QK, b + QK);
            acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(ds + r * nb + 2 * p), s0, acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(ds + r * nb + 2 * p + 1), s1, acc[r]);
        }
    }
    for (int r = 0; r < mt; ++r) out[r] = hsum8(acc[r]) + offs[r];
#else
    for (int r = 0; r < mt; ++r) {
        float total = 0.0f;
        for (int64_t p = 0; p < nb / 2; ++p) {
            int s0 = 0, s1 = 0;
            const int8_t *a = qx + r * FUEL_QX_ROW(nb) + 2 * p * QK, *b = a + nb * QK;
            for (int j = 0; j < QK; ++j) {
                s0 += (qs[p * QK + j] & 0x0f) * (128 * a[j] + b[j]);
                s1 += (qs[p * QK + j] >> 4) * (128 * a[QK + j] + b[QK + j]);
            }
            total += ds[r * nb + 2 * p] * (float)s0 + ds[r * nb + 2 * p + 1] * (float)s1;
        }
        out[r] = total + offs[r];
    }
#endif
}

/* One Q8_0 weight row against `mt` (<= MT) quantized activation rows. */
static inline __attribute__((always_inline)) void q8_0_row(const int8_t *qs, const uint16_t *d,
                                                           const int8_t *qx, const float *dx,
                                                           int64_t nb, const int mt, float *ds,
                                                           float *out)
{
    row_scales(d, dx, nb, mt, ds);
#ifdef FUEL_AVX2
    __m256 acc[MT];
    for (int r = 0; r < mt; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + b * QK));
        /* maddubs wants an unsigned operand: |q| against a carrying q's sign. */
        const __m256i uq = _mm256_sign_epi8(q, q);
        for (int r = 0; r < mt; ++r) {
            const int8_t *pa = qx + r * FUEL_QX_ROW(nb) + b * QK;
            const __m256i a = _mm256_loadu_si256((const __m256i *)pa);
            const __m256i lo = _mm256_loadu_si256((const __m256i *)(pa + nb * QK));
            const __m256i th = madd_u8s8(uq, _mm256_sign_epi8(a, q));
            const __m256i tl = madd_u8s8(uq, _mm256_sign_epi8(lo, q));
            const __m256 s = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(th, 7), tl));
            acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(ds + r * nb + b), s, acc[r]);
        }
    }
    for (int r = 0; r < mt; ++r) out[r] = hsum8(acc[r]);
#else
    for (int r = 0; r < mt; ++r) {
        float total = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
            int s = 0;
            const int8_t *a = qx + r * FUEL_QX_ROW(nb) + b * QK, *lo = a + nb * QK;
            for (int j = 0; j < QK; ++j) s += qs[b * QK + j] * (128 * a[j] + lo[j]);
            total += ds[r * nb + b] * (float)s;
        }
        out[r] = total;
    }
#endif
}

/* Dispatch on the tile height so each call sees a constant `mt` (unrolled). */
static inline void weight_row(int qtype, const uint8_t *qs, const uint16_t *d, const uint16_t *m,
                              const int8_t *qx, const float *dx, const float *sx, int64_t nb,
                              int mt, float *ds, float *out)
{
#define ROW_CASE(T)                                                                        \
    case T:                                                                                \
        if (qtype == 1)                                                                    \
            q4_1_row(qs, d, m, qx, dx, sx, nb, T, ds, out);                                \
        else                                                                               \
            q8_0_row((const int8_t *)qs, d, qx, dx, nb, T, ds, out);                       \
        break;
    switch (mt) {
        ROW_CASE(1)
        ROW_CASE(2)
        ROW_CASE(3)
        ROW_CASE(4)
    }
#undef ROW_CASE
}

void fuel_qgemm_rows(const fuel_qweight *w, const int8_t *qx, const float *dx, const float *sx,
                     int64_t nb, int64_t rows, int64_t n0, int64_t n1, float *y, int64_t ys,
                     int64_t col0)
{
    const int64_t qs_row = w->qtype == 1 ? nb / 2 * QK : w->k;
    if (w->layout != FUEL_LAYOUT_ROWS) abort(); /* x16 weights exist only on VNNI builds */
    float ds[MT * 64];
    float *scratch = nb <= 64 ? ds : malloc(sizeof(float) * (size_t)(MT * nb));
    if (!scratch) abort(); /* nb > 64 means K > 2048 per row: 32 KiB, cannot fail in practice */
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *wq = w->qs + n * qs_row;
        const uint16_t *wd = w->d + n * nb;
        const uint16_t *wm = w->qtype == 1 ? w->m + n * nb : NULL;
        const float bn = w->bias ? w->bias[n] : 0.0f;
        for (int64_t r0 = 0; r0 < rows; r0 += MT) {
            const int mt = rows - r0 < MT ? (int)(rows - r0) : MT;
            float out[MT] = {0};
            weight_row(w->qtype, wq, wd, wm, qx + r0 * FUEL_QX_ROW(nb), dx + r0 * nb, sx + r0 * nb, nb,
                       mt, scratch, out);
            for (int r = 0; r < mt; ++r) y[(r0 + r) * ys + (n - col0)] = out[r] + bn;
        }
    }
    if (scratch != ds) free(scratch);
}
#endif /* FUEL_VNNI512 */

/* y [M, N] = x [M, K] @ W^T (+ bias [N] when not NULL).
 * qtype 0 (Q8_0): qs [N, K] int8, d [N, K / 32] fp16, m unused (may be NULL).
 * qtype 1 (Q4_1): qs [N, nb / 2, 32], d and m [N, nb] with nb = K / 32 rounded
 * up to even. K must be a multiple of 32. layout: FUEL_LAYOUT_ROWS, or
 * FUEL_LAYOUT_X16 (VNNI builds only; see x16_tile). Returns 0, -1 when scratch
 * memory could not be allocated, -2 for a layout this build cannot read. */
int fuel_quant_linear_f32(const float *x, int64_t M, int64_t K, const uint8_t *qs,
                          const uint16_t *d, const uint16_t *m, int qtype, int64_t N,
                          const float *bias, float *y, int num_threads, int layout)
{
#ifndef FUEL_VNNI512
    if (layout != FUEL_LAYOUT_ROWS) return -2;
#endif
    const fuel_qweight w = {qs, d, m, bias, N, K, qtype, layout};
    const int64_t nb = fuel_qx_blocks(qtype, K);
    int8_t *qx = malloc((size_t)(M * FUEL_QX_ROW(nb)));
    float *dx = malloc(sizeof(float) * (size_t)(M * nb));
    float *sx = malloc(sizeof(float) * (size_t)(M * nb));
    if (!qx || !dx || !sx) {
        free(qx);
        free(dx);
        free(sx);
        return -1;
    }
    const int nt = N * nb * M >= PAR_MIN_BLOCKS ? num_threads : 1;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; ++r) fuel_qx_quantize_rows(x, K, nb, r, r + 1, qx, dx, sx);
        /* Weight rows split evenly, in whole tiles (4 rows; 16 in the x16 layout). */
#ifdef _OPENMP
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
#else
        const int t = 0, T = 1;
#endif
        const int64_t unit = layout == FUEL_LAYOUT_X16 ? 16 : 4, quads = (N + unit - 1) / unit;
        int64_t n0 = quads * t / T * unit, n1 = quads * (t + 1) / T * unit;
        n1 = n1 < N ? n1 : N;
        if (n0 < n1) fuel_qgemm_rows(&w, qx, dx, sx, nb, M, n0, n1, y, N, 0);
    }
    free(qx);
    free(dx);
    free(sx);
    return 0;
}
