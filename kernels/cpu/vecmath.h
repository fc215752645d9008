/*
 * vecmath.h — elementary functions in fp32 for the CPU backend's hot loops, written in plain
 * operations (no libm calls, no table lookups) so GCC vectorises the loops that call them.
 *
 * glibc's tanhf is a scalar call; inside the GELU loops it was 43% of a text_gpt step. These run
 * in every HOT_LOOP clone (backend_cpu.c) in the same order of the same IEEE operations (ISO C mode:
 * no contraction into FMA), so every clone, and the scalar build, gives the same bits.
 */
#ifndef AMP_VECMATH_H
#define AMP_VECMATH_H

#include <math.h>   /* fabsf, copysignf (inlined: bit operations) */
#include <stdint.h>
#include <string.h> /* memcpy: the bits of 2^n */

/*
 * tanh(u), within 2 ulp of the exact value (at most 1.53 ulp over every fp32 in [-12, 12], checked once
 * exhaustively against double tanh; tests/test_vecmath.c checks a dense sweep):
 *   |u| < 0.55:  u + u^3 P(u^2), P a degree-4 least-squares fit of (tanh u - u) / u^3 (< 0.75 ulp
 *                before the last rounding)
 *   otherwise:   sign(u) (1 - 2 / (e + 1)), e = exp(x), x = 2 min(|u|, 10), as 2^n exp(r) with
 *                n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts), exp(r) by its degree-7 Taylor
 *                polynomial (|r| <= ln2/2: truncation below 2^-27); tanh(u) rounds to 1 in fp32 from u = 9.01 on.
 * NaN propagates; ±Inf gives ±1; the sign of zero is kept.
 */
static inline float tanh_f32(float u)
{
    const float a = fabsf(u);
    const float s = u * u;
    float p = -0.006287662778049707f;
    p = p * s + 0.021082058548927307f;
    p = p * s + -0.05385512113571167f;
    p = p * s + 0.13332617282867432f;
    p = p * s + -0.33333319425582886f;
    const float small = a + (a * s) * p;

    const float x = 2.0f * (a > 10.0f ? 10.0f : a);                 /* NaN stays NaN */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    float e = 1.0f / 5040.0f;
    e = e * r + 1.0f / 720.0f;
    e = e * r + 1.0f / 120.0f;
    e = e * r + 1.0f / 24.0f;
    e = e * r + 1.0f / 6.0f;
    e = e * r + 0.5f;
    e = e * r + 1.0f;
    e = e * r + 1.0f;
    const int32_t bits = ((n >= 0.0f ? (int32_t)n : 0) + 127) << 23; /* 2^n, n in [0, 29]; NaN: 0 */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    const float big = 1.0f - 2.0f / (e * two_n + 1.0f);
    return copysignf(a < 0.55f ? small : big, u); /* odd: computed for |u|, so -0 stays -0 */
}

#endif
