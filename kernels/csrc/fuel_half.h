/*
 * IEEE half <-> float for the native CPU kernels (one copy, included by each
 * source file). F16C instructions where the build targets a CPU that has
 * them; otherwise exact portable code (round to nearest even, subnormals,
 * infinities and NaN kept), tested against numpy by tests/test_kernels.py
 * through the -mno-avx2 build.
 */
#ifndef FUEL_HALF_H
#define FUEL_HALF_H

#include <stdint.h>
#include <string.h>

#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#define FUEL_F16C 1
#endif

static inline float h2f(uint16_t h)
{
#ifdef FUEL_F16C
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400u)) {
                mant <<= 1;
                --exp;
            }
            bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* float -> fp16, round to nearest even; overflow to inf, NaN kept NaN. */
static inline uint16_t f2h(float f)
{
#ifdef FUEL_F16C
    return (uint16_t)_cvtss_sh(f, 0);
#else
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u);
    if (ax >= 0x477ff000u) return sign | 0x7c00u; /* rounds past the largest half */
    if (ax < 0x38800000u) {                         /* subnormal half (or zero) */
        if (ax < 0x33000000u) return sign;          /* below half the smallest subnormal */
        const uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126 - e; /* 14 + (113 - e) */
        uint32_t r = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1u))) ++r;
        return sign | (uint16_t)r;
    }
    uint32_t r = ax - 0x38000000u; /* rebias 127 -> 15 */
    const uint32_t rem = r & 0x1fffu;
    r >>= 13;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
    return sign | (uint16_t)r;
#endif
}

#endif /* FUEL_HALF_H */
