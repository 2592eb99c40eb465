/*
 * 8-lane float helpers for the native CPU kernels, written with GCC/Clang
 * vector extensions (AVX2 here, NEON elsewhere, scalar code otherwise): one
 * copy, included by each source file that needs them.
 */
#ifndef FUEL_VEC_H
#define FUEL_VEC_H

#include <stdint.h>
#include <string.h>

#ifdef __AVX__
#include <immintrin.h>
#endif

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

typedef int32_t v8i __attribute__((vector_size(32)));

/* mask ? a : b, lane by lane (mask lanes are all ones or all zeros). */
static inline v8f select8(v8i mask, v8f a, v8f b)
{
    v8i ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    const v8i r = (ai & mask) | (bi & ~mask);
    v8f out;
    memcpy(&out, &r, sizeof out);
    return out;
}

/* exp on 8 lanes: 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2 (Cody-Waite
 * split of ln2, Cephes' degree-6 polynomial; a few ulp). Lanes below -87 give
 * 0 (expf underflows there too), which also covers -inf; lanes above 88 give
 * e^88 (~1.7e38) rather than overflowing the exponent field. */
static inline v8f exp8(v8f x)
{
    const v8f lo = (v8f){0} - 87.0f, hi = (v8f){0} + 88.0f;
    const v8i under = x < lo;
    x = select8(under, lo, x);
    x = select8(x > hi, hi, x);
    /* round to nearest: adding and subtracting 1.5 * 2^23 (|x log2 e| < 2^22) */
    const v8f fn = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const v8f r = (x - fn * 0.693359375f) + fn * 2.12194440e-4f;
    v8f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const v8i bits = (__builtin_convertvector(fn, v8i) + 127) << 23;
    v8f scale;
    memcpy(&scale, &bits, sizeof scale);
    return select8(under, (v8f){0}, p * scale);
}

/* Lane u of the result: the sum of the lanes of a[u] (an 8x8 transpose-add,
 * so eight dot products cost three shuffle levels rather than eight hsums). */
static inline v8f hsum8x8(const v8f a[8])
{
#ifdef __AVX__
    const __m256 s01 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]);
    const __m256 s23 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
    const __m256 s45 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]);
    const __m256 s67 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    return (v8f)_mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                              _mm256_permute2f128_ps(s0123, s4567, 0x31));
#else
    v8f out;
    for (int u = 0; u < 8; ++u) out[u] = hsum8(a[u]);
    return out;
#endif
}

#endif /* FUEL_VEC_H */
