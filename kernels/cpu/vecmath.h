/*
 * vecmath.h — elementary functions for the CPU backend's hot loops, written in plain operations (no libm
 * calls, no lookups indexed by the data) so GCC vectorises the loops that call them.
 *
 * glibc's tanhf is a scalar call; inside the GELU loops it was 43% of a text_gpt step. These run
 * in every HOT_LOOP clone (cpu_internal.h) in the same order of the same IEEE operations (ISO C mode:
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

/*
 * exp(a) in double for a <= 1 (cross-entropy's exponents, all <= 0 up to rounding), within EXP_F64_ERR units of
 * 2^-53 relative to the exact value for a in [-708, 1]; 0 below -708 (and for -Inf); NaN gives NaN; above 1 it is
 * not exp (2^n's exponent would wrap from n = 1024 on). As 2^n exp(r): n = round(a / ln 2) (the 1.5 * 2^52 shift,
 * whose low bits then hold n), r = a - n ln 2 with ln 2 in two parts (n ln2_hi exact for |n| < 2^20, the
 * subtraction exact by Sterbenz), exp(r) by its degree-13 Taylor polynomial in Horner form (|r| <= 0.3466:
 * truncation below 0.08 units); 2^n from its exponent bits, n in [-1021, 1] (a normal double).
 * The bound: Horner's 26 roundings (no FMA) cost at most 26 units times sum|c_i r^i| / exp(r) <= e^0.7 = 2,
 * the rounded coefficients 2 units, r's rounding 0.4, the truncation 0.08: under 57, taken as 64.
 * tests/test_vecmath.c measures the worst over a dense sweep: 2.0 units against libm.
 * Cross-entropy (loss.c) uses it with the bound, never for bits of its own: see f32_of_interval.
 */
#define EXP_F64_ERR 64.0

static inline double exp_f64(double a)
{
    const double shift = 0x1.8p52;
    const double kd = a * 1.4426950408889634 + shift; /* below -708 what follows is masked to 0 */
    uint64_t ki;
    memcpy(&ki, &kd, sizeof ki);
    const double n = kd - shift;
    const double r = (a - n * 6.93147180369123816490e-01) - n * 1.90821492927058770002e-10;
    static const double inv_factorial[13] = { /* 1/12!, 1/11!, ..., 1/1!, 1/0!: Horner's coefficients after 1/13! */
        1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0, 1.0 / 40320.0, 1.0 / 5040.0,
        1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0
    };
    double e = 1.0 / 6227020800.0;
    for (int i = 0; i < 13; i++)
        e = e * r + inv_factorial[i];
    const uint64_t sbits = (ki << 52) + ((uint64_t)1023 << 52); /* ki's low bits: n, two's complement */
    double scale, v;
    memcpy(&scale, &sbits, sizeof scale);
    v = e * scale;
    /* below -708 +0 by a mask, not a select: GCC turned the select into a branch around the whole computation in
     * some callers' loops and left them scalar ("control flow in loop") */
    uint64_t vb;
    memcpy(&vb, &v, sizeof vb);
    vb &= -(uint64_t)!(a < -708.0); /* NaN: kept */
    memcpy(&v, &vb, sizeof v);
    return v;
}

/*
 * Whether every real within d (>= 0) of v rounds to one fp32: rounding to nearest is monotone, so the ends
 * v - d and v + d decide; *out gets that fp32 (v's). d must cover the rounding of v - d and v + d (a few
 * units of 2^-53 of v). NaN, or an infinite d, never passes.
 */
static inline int f32_of_interval(double v, double d, float *out)
{
    const float lo = (float)(v - d), hi = (float)(v + d);
    *out = lo;
    return lo == hi;
}

#endif
