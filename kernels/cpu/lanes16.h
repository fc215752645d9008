/*
 * lanes16.h — 16 consecutive elements of a tensor (fp32, bf16 or fp16) as the 16 fp32 lanes of an AVX-512
 * vector, and back: the CPU backend's hand-written vector loops (gemm_avx512's packing and epilogue, batchnorm's
 * planes) read and write their tensors through these, so each conversion has one vector form, bit for bit
 * dtype.c's scalar one.
 *
 *   - lanes16_load: widening is exact (bf16 is fp32's upper half; fp16 through vcvtph2ps).
 *   - lanes16_store: one rounding to nearest even; a NaN stays a NaN with its quiet bit set (bf16: the upper half
 *     | 0x0040; fp16: vcvtps2ph), as dtype.c's bf16_from_fp32 and fp16_from_fp32.
 *   - lanes16_relu_passes: the lanes ReLU lets through (> 0, or a NaN: act_apply's `x <= 0` failing; +0, -0 and
 *     any negative do not).
 *   - lanes16_relu_grad: dy where y passes ReLU, else +0; 16-bit dy with a NaN's quiet bit set first, the bits
 *     relu_grad_16 gives (act_backward) before they are widened.
 *
 * Lanes outside the mask m read nothing and are zero. Only for x86-64 GCC/clang, in functions compiled with
 * LANES16_TARGET and called where lanes16_supported() holds.
 */
#ifndef AMP_LANES16_H
#define AMP_LANES16_H

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define AMP_LANES16 1

#include <immintrin.h>
#include <stdbool.h>
#include <stdint.h>

#include "dtype.h" /* enum dtype */

#define LANES16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))

static inline bool lanes16_supported(void)
{
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
}

/* Lanes [0, n) of a 16-lane mask (n clamped to [0, 16]). */
static inline __mmask16 lanes16_mask(int64_t n)
{
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}

/* fp32 bits -> bf16 bits in the low half of each 32-bit lane: RNE, a NaN quieted. */
LANES16_TARGET static inline __m512i lanes16_bf16_bits(__m512 v)
{
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x0040));
    const __mmask16 nan =
        _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
    return _mm512_mask_blend_epi32(nan, rounded, quiet);
}

/* 16-bit elements (bf16 or fp16 bits) widened to fp32. */
LANES16_TARGET static inline __m512 lanes16_widen(__m256i h, enum dtype dt)
{
    if (dt == DT_FP16)
        return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Elements off .. off + 15 of p (dtype dt) as fp32, lanes outside m zero. */
LANES16_TARGET static inline __m512 lanes16_load(const void *p, enum dtype dt, int64_t off, __mmask16 m)
{
    if (dt == DT_FP32)
        return _mm512_maskz_loadu_ps(m, (const float *)p + off);
    return lanes16_widen(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + off), dt);
}

/* v rounded once to dt into lanes m of elements off .. off + 15 of p. */
LANES16_TARGET static inline void lanes16_store(void *p, enum dtype dt, int64_t off, __mmask16 m, __m512 v)
{
    if (dt == DT_BF16) /* narrowed in a register, then stored: vpmovdw's store form was slower (Zen 5) */
        _mm256_mask_storeu_epi16((uint16_t *)p + off, m, _mm512_cvtepi32_epi16(lanes16_bf16_bits(v)));
    else if (dt == DT_FP16)
        _mm256_mask_storeu_epi16((uint16_t *)p + off, m, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    else
        _mm512_mask_storeu_ps((float *)p + off, m, v);
}

/* 16-bit values' infinity (bf16 0x7F80, fp16 0x7C00) and quiet bit (0x0040, 0x0200). */
static inline uint16_t lanes16_half_inf(enum dtype dt)
{
    return dt == DT_BF16 ? 0x7F80 : 0x7C00;
}

/* The lanes of h (16-bit bits of dt) that pass ReLU: a NaN, or positive and not zero. */
LANES16_TARGET static inline __mmask16 lanes16_half_passes(__m256i h, enum dtype dt)
{
    const __m256i mag = _mm256_and_si256(h, _mm256_set1_epi16(0x7FFF));
    const __mmask16 nan = _mm256_cmpgt_epi16_mask(mag, _mm256_set1_epi16((short)lanes16_half_inf(dt)));
    const __mmask16 pos =
        _mm256_testn_epi16_mask(h, _mm256_set1_epi16((short)0x8000)) & _mm256_test_epi16_mask(mag, mag);
    return nan | pos;
}

/* The lanes m of elements off .. off + 15 of y (dtype dt) that pass ReLU. */
LANES16_TARGET static inline __mmask16 lanes16_relu_passes(const void *y, enum dtype dt, int64_t off, __mmask16 m)
{
    if (dt == DT_FP32)
        return _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, (const float *)y + off), _mm512_setzero_ps(),
                                       _CMP_NLE_UQ);
    return m & lanes16_half_passes(_mm256_maskz_loadu_epi16(m, (const uint16_t *)y + off), dt);
}

/* Elements off .. off + 15 of dy as fp32, each +0 where y's does not pass ReLU (y NULL: dy as it is); 16-bit dy
 * with a NaN's quiet bit set before the widening. */
LANES16_TARGET static inline __m512 lanes16_relu_grad(const void *dy, const void *y, enum dtype dt, int64_t off,
                                                      __mmask16 m)
{
    if (!y)
        return lanes16_load(dy, dt, off, m);
    const __mmask16 pass = lanes16_relu_passes(y, dt, off, m);
    if (dt == DT_FP32)
        return _mm512_maskz_loadu_ps(pass, (const float *)dy + off);
    __m256i h = _mm256_maskz_loadu_epi16(pass, (const uint16_t *)dy + off);
    const __mmask16 nan = _mm256_cmpgt_epi16_mask(_mm256_and_si256(h, _mm256_set1_epi16(0x7FFF)),
                                                  _mm256_set1_epi16((short)lanes16_half_inf(dt)));
    h = _mm256_mask_blend_epi16(nan, h, _mm256_or_si256(h, _mm256_set1_epi16(dt == DT_BF16 ? 0x0040 : 0x0200)));
    return lanes16_widen(h, dt);
}

#endif /* x86-64 */
#endif
