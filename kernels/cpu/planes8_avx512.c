/*
 * planes8_avx512.c — eight planes (batchnorm's channels, a convolution's bias-gradient channels, layernorm's rows)
 * as the lanes of one vector: the per-channel sums of batchnorm's statistics and gradient, a convolution's bias
 * gradient and layernorm's statistics and backward, bit for bit the scalar chains of their callers (FOR_CHAINS in
 * norm.c and conv.c, the plain loops, which run where this file's paths do not: fewer than CHAINS lanes, a CPU
 * without AVX-512). Reads the planes, accumulates (+=) into the caller's double sums.
 */
#include "cpu_internal.h" /* CHAINS, HAVE_AVX512_INTRIN, bf16_to_fp32 */

#ifdef HAVE_AVX512_INTRIN

/* Per-channel sums of CHAINS (8) channels (batchnorm's statistics and gradient sums, a convolution's bias
 * gradient) with the channels as the lanes of one vector: 8 floats of each plane transposed (shuffles only move
 * bits) so that vector e holds element q + e of every plane, then each lane takes its elements in order, one IEEE
 * operation each as the scalar chains do (widen, subtract, multiply, add: no FMA), and the last hw % 8 elements
 * of each plane one by one after them. The same sums, bit for bit. */
#define LANES8_TARGET __attribute__((target("avx512f,avx512vl")))

/* Element q of a plane: fp32, or bf16 widened (exactly: bf16 is fp32's upper half). */
static inline float plane_elem(const void *p, int64_t q, bool bf16)
{
    return bf16 ? bf16_to_fp32(((const uint16_t *)p)[q]) : ((const float *)p)[q];
}

LANES8_TARGET static inline __m256 plane_load8(const void *p, int64_t q, bool bf16)
{
    if (bf16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + q))), 16));
    return _mm256_loadu_ps((const float *)p + q);
}

/* Whether a ReLU passes its input v (its backward keeps the gradient): v > 0 or a NaN; not +0, -0 or negative. */
LANES8_TARGET static inline __mmask8 relu_passes8(__m256 v)
{
    return _mm256_cmp_ps_mask(v, _mm256_setzero_ps(), _CMP_NLE_UQ);
}

/* Elements q .. q + 7 of the 8 planes p (fp32, or bf16 read as it is stored) transposed: t[e] lane l = p[l][q + e];
 * with ReLU planes m (p's dtype; else NULL), each element is the ReLU backward's, +0 where m's does not pass (a
 * NaN gradient is not quieted here: every use widens it to double or computes with it, which quiets it). */
LANES8_TARGET static inline void planes_transpose8_masked(const void *const p[CHAINS], const void *const m[CHAINS],
                                                          bool bf16, int64_t q, __m256 t[8])
{
    __m256 r[8], u[8];
    for (int l = 0; l < 8; l++) {
        r[l] = plane_load8(p[l], q, bf16);
        if (m)
            r[l] = _mm256_maskz_mov_ps(relu_passes8(plane_load8(m[l], q, bf16)), r[l]);
    }
    for (int l = 0; l < 8; l += 2) {
        u[l] = _mm256_unpacklo_ps(r[l], r[l + 1]);
        u[l + 1] = _mm256_unpackhi_ps(r[l], r[l + 1]);
    }
    for (int l = 0; l < 8; l += 4) {
        r[l] = _mm256_shuffle_ps(u[l], u[l + 2], 0x44);
        r[l + 1] = _mm256_shuffle_ps(u[l], u[l + 2], 0xEE);
        r[l + 2] = _mm256_shuffle_ps(u[l + 1], u[l + 3], 0x44);
        r[l + 3] = _mm256_shuffle_ps(u[l + 1], u[l + 3], 0xEE);
    }
    for (int e = 0; e < 4; e++) {
        t[e] = _mm256_permute2f128_ps(r[e], r[e + 4], 0x20);
        t[e + 4] = _mm256_permute2f128_ps(r[e], r[e + 4], 0x31);
    }
}

LANES8_TARGET static inline void planes_transpose8(const void *const p[CHAINS], bool bf16, int64_t q, __m256 t[8])
{
    planes_transpose8_masked(p, NULL, bf16, q, t);
}

/* s[l] += p[l][q] for q < hw, in order (bn_stats' first pass, conv_filter_image's bias sums). */
LANES8_TARGET void cpu_planes_sum8_avx512(const void *const p[CHAINS], bool bf16, int64_t hw, double s[CHAINS])
{
    __m512d acc = _mm512_loadu_pd(s);
    int64_t q = 0;
    for (; q + 8 <= hw; q += 8) {
        __m256 t[8];
        planes_transpose8(p, bf16, q, t);
        for (int e = 0; e < 8; e++)
            acc = _mm512_add_pd(acc, _mm512_cvtps_pd(t[e]));
    }
    _mm512_storeu_pd(s, acc);
    for (int l = 0; l < CHAINS; l++)
        for (int64_t r = q; r < hw; r++)
            s[l] += plane_elem(p[l], r, bf16);
}

/* ss[l] += (p[l][q] - mu[l])^2 for q < hw, in order (bn_stats' and layernorm's second pass; d in double). */
LANES8_TARGET void cpu_planes_sumsq8_avx512(const void *const p[CHAINS], bool bf16, int64_t hw,
                                               const double mu[CHAINS], double ss[CHAINS])
{
    __m512d acc = _mm512_loadu_pd(ss);
    const __m512d m = _mm512_loadu_pd(mu);
    int64_t q = 0;
    for (; q + 8 <= hw; q += 8) {
        __m256 t[8];
        planes_transpose8(p, bf16, q, t);
        for (int e = 0; e < 8; e++) {
            __m512d d = _mm512_sub_pd(_mm512_cvtps_pd(t[e]), m);
            acc = _mm512_add_pd(acc, _mm512_mul_pd(d, d));
        }
    }
    _mm512_storeu_pd(ss, acc);
    for (int l = 0; l < CHAINS; l++)
        for (int64_t r = q; r < hw; r++) {
            double d = plane_elem(p[l], r, bf16) - mu[l];
            ss[l] += d * d;
        }
}

/* sdy[l] += dy, sdyx[l] += (double)dy * ((x - mu[l]) * rs[l]) (the product in fp32) for q < hw, in order
 * (bn_grad_sums, layernorm's backward); with ReLU planes yp (else NULL), dy is the ReLU backward's of it (+0 where
 * y does not pass); with column factors g (else NULL: none), dy is dy * g[q] (layernorm's dxhat, in fp32). */
LANES8_TARGET void cpu_planes_gradsum8_avx512(const void *const xp[CHAINS], const void *const dp[CHAINS],
                                                 const void *const yp[CHAINS], const float *g, bool bf16, int64_t hw,
                                                 const float mu[CHAINS], const float rs[CHAINS], double sdy[CHAINS],
                                                 double sdyx[CHAINS])
{
    __m512d a_dy = _mm512_loadu_pd(sdy), a_dyx = _mm512_loadu_pd(sdyx);
    const __m256 m = _mm256_loadu_ps(mu), r = _mm256_loadu_ps(rs);
    int64_t q = 0;
    for (; q + 8 <= hw; q += 8) {
        __m256 tx[8], td[8];
        planes_transpose8(xp, bf16, q, tx);
        planes_transpose8_masked(dp, yp, bf16, q, td);
        for (int e = 0; e < 8; e++) {
            if (g)
                td[e] = _mm256_mul_ps(td[e], _mm256_set1_ps(g[q + e]));
            __m512d dy = _mm512_cvtps_pd(td[e]);
            __m256 xhat = _mm256_mul_ps(_mm256_sub_ps(tx[e], m), r);
            a_dy = _mm512_add_pd(a_dy, dy);
            a_dyx = _mm512_add_pd(a_dyx, _mm512_mul_pd(dy, _mm512_cvtps_pd(xhat)));
        }
    }
    _mm512_storeu_pd(sdy, a_dy);
    _mm512_storeu_pd(sdyx, a_dyx);
    for (int l = 0; l < CHAINS; l++)
        for (int64_t e = q; e < hw; e++) {
            float dv = plane_elem(dp[l], e, bf16), xv = plane_elem(xp[l], e, bf16);
            if (yp && plane_elem(yp[l], e, bf16) <= 0.0f)
                dv = 0.0f;
            if (g)
                dv *= g[e];
            sdy[l] += dv;
            sdyx[l] += (double)dv * ((xv - mu[l]) * rs[l]);
        }
}

#endif
