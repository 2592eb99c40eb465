/*
 * Block-quantized linears for the CPU path: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
 *
 * Two weight formats, both llama.cpp's block quantizations (32 weights per
 * block, one scale each) in a layout repacked for AVX2 (kernels/quant_linear.py
 * builds them; its torch references define the arithmetic):
 *   Q8_0:  w = d * q,      q int8.        qs [N, K] int8,   d [N, nb] fp16.
 *   Q4_1:  w = d * q + m,  q in 0..15.    qs [N, nb / 2, 32] bytes: byte i of
 *          pair p holds element i of block 2p in its low nibble and element i
 *          of block 2p + 1 in its high nibble; d, m [N, nb] fp16.
 * nb = K / 32 (for Q4_1 rounded up to even; the padding block has d = m = 0).
 *
 * Activations are quantized per 32-element block to int8 with a float scale
 * (dx = amax / 127) and, for Q4_1's offset term, sx = dx * sum(qx); a block
 * pair's dot is then an integer dot (maddubs + madd, the route llama.cpp
 * takes on AVX2) scaled by d * dx, and Q4_1 adds m * sx. Reading 0.625 (Q4_1)
 * or 1.06 (Q8_0) bytes per weight is what makes decode fast on this
 * bandwidth-bound CPU; up to four activation rows share each unpacked weight
 * block, so small batches read the weights once.
 *
 * Threads split the output features N; the activation rows are quantized
 * once, before the parallel region.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define FUEL_AVX2 1
#endif

#include "fuel_half.h"

#define QK 32
#define MT 4                  /* activation rows sharing one pass over a weight row */
#define PAR_MIN_BLOCKS 4096   /* weight blocks x rows below which one thread is faster */

/* Quantize rows of x [M, K] into blocks: qx [M, nb * 32], dx and sx [M, nb];
 * blocks past K / 32 (padding) are zero. */
static void quantize_rows(const float *x, int64_t M, int64_t K, int64_t nb, int8_t *qx, float *dx,
                          float *sx)
{
    const int64_t kb = K / QK;
    for (int64_t r = 0; r < M; ++r) {
        for (int64_t b = 0; b < nb; ++b) {
            int8_t *q = qx + (r * nb + b) * QK;
            if (b >= kb) {
                memset(q, 0, QK);
                dx[r * nb + b] = 0.0f;
                sx[r * nb + b] = 0.0f;
                continue;
            }
            const float *xb = x + r * K + b * QK;
            float amax = 0.0f;
            for (int j = 0; j < QK; ++j) amax = fmaxf(amax, fabsf(xb[j]));
            const float d = amax / 127.0f;
            const float id = d > 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            for (int j = 0; j < QK; ++j) {
                const int v = (int)nearbyintf(xb[j] * id);
                q[j] = (int8_t)v;
                sum += v;
            }
            dx[r * nb + b] = d;
            sx[r * nb + b] = d * (float)sum;
        }
    }
}

#ifdef FUEL_AVX2
static inline float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Float lanes of sum(u8 a * s8 b) over 32 byte pairs (no saturation for our
 * ranges: |pair sum| <= 2 * 127 * 127). */
static inline __m256 dot_u8s8(__m256i a, __m256i b)
{
    const __m256i p16 = _mm256_maddubs_epi16(a, b);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
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
            const int8_t *a = qx + (r * nb + 2 * p) * QK;
            const __m256 s0 = dot_u8s8(q0, _mm256_loadu_si256((const __m256i *)a));
            const __m256 s1 = dot_u8s8(q1, _mm256_loadu_si256((const __m256i *)(a + QK)));
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
            const int8_t *a = qx + (r * nb + 2 * p) * QK;
            for (int j = 0; j < QK; ++j) {
                s0 += (qs[p * QK + j] & 0x0f) * a[j];
                s1 += (qs[p * QK + j] >> 4) * a[QK + j];
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
            const __m256i a = _mm256_loadu_si256((const __m256i *)(qx + (r * nb + b) * QK));
            const __m256 s = dot_u8s8(uq, _mm256_sign_epi8(a, q));
            acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(ds + r * nb + b), s, acc[r]);
        }
    }
    for (int r = 0; r < mt; ++r) out[r] = hsum8(acc[r]);
#else
    for (int r = 0; r < mt; ++r) {
        float total = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
            int s = 0;
            const int8_t *a = qx + (r * nb + b) * QK;
            for (int j = 0; j < QK; ++j) s += qs[b * QK + j] * a[j];
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

/* y [M, N] = x [M, K] @ W^T (+ bias [N] when not NULL).
 * qtype 0 (Q8_0): qs [N, K] int8, d [N, K / 32] fp16, m unused (may be NULL).
 * qtype 1 (Q4_1): qs [N, nb / 2, 32], d and m [N, nb] with nb = K / 32 rounded
 * up to even. K must be a multiple of 32. Returns 0, or -1 when scratch
 * memory could not be allocated. */
int fuel_quant_linear_f32(const float *x, int64_t M, int64_t K, const uint8_t *qs,
                          const uint16_t *d, const uint16_t *m, int qtype, int64_t N,
                          const float *bias, float *y, int num_threads)
{
    const int64_t nb = qtype == 1 ? (K / QK + 1) / 2 * 2 : K / QK;
    const int64_t qs_row = qtype == 1 ? nb / 2 * QK : K;
    int8_t *qx = malloc((size_t)(M * nb * QK));
    float *dx = malloc(sizeof(float) * (size_t)(M * nb));
    float *sx = malloc(sizeof(float) * (size_t)(M * nb));
    int failed = !qx || !dx || !sx;
    if (!failed) {
        quantize_rows(x, M, K, nb, qx, dx, sx);
        const int nt = N * nb * M >= PAR_MIN_BLOCKS ? num_threads : 1;
#pragma omp parallel num_threads(nt) if (nt > 1) reduction(| : failed)
        {
            float *ds = malloc(sizeof(float) * (size_t)(MT * nb));
            failed |= !ds;
            /* Every thread must reach the worksharing loop, even one whose
             * allocation failed (it then skips its rows; the call fails). */
#pragma omp for schedule(static)
            for (int64_t n = 0; n < N; ++n) {
                if (!ds) continue;
                const uint8_t *wq = qs + n * qs_row;
                const uint16_t *wd = d + n * nb;
                const uint16_t *wm = qtype == 1 ? m + n * nb : NULL;
                const float bn = bias ? bias[n] : 0.0f;
                for (int64_t r0 = 0; r0 < M; r0 += MT) {
                    const int mt = M - r0 < MT ? (int)(M - r0) : MT;
                    float out[MT];
                    weight_row(qtype, wq, wd, wm, qx + r0 * nb * QK, dx + r0 * nb, sx + r0 * nb,
                               nb, mt, ds, out);
                    for (int r = 0; r < mt; ++r) y[(r0 + r) * N + n] = out[r] + bn;
                }
            }
            free(ds);
        }
    }
    free(qx);
    free(dx);
    free(sx);
    return failed ? -1 : 0;
}
