/*
 * bf16_lanes.h — 16 bf16 values as fp32 lanes and back, for the CPU backend's AVX-512 code (gemm_avx512.c's
 * epilogue, norm.c's one-pass planes, pool.c's 2x2 backward): one copy of the rounding all must give bit for bit.
 *
 * Include only where <immintrin.h> is available (x86-64 GCC or clang); the functions carry their own target
 * attributes, so callers compiled for the baseline can still call them from their AVX-512 functions.
 */
#ifndef AMP_BF16_LANES_H
#define AMP_BF16_LANES_H

#include <immintrin.h>

/* 16 bf16 values (the low 16 bits of each 32-bit lane of h16) widened to fp32: exact, bf16 is fp32's upper half. */
__attribute__((target("avx512f"))) static inline __m512 bf16_lanes_widen(__m256i h)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* v rounded to bf16, the bits in the low half of each 32-bit lane: nearest-even, a NaN quieted (dtype.c's
 * bf16_from_fp32 bit for bit). */
__attribute__((target("avx512f"))) static inline __m512i bf16_lanes_round(__m512 v)
{
    const __m512i u = _mm512_castps_si512(v), hi = _mm512_srli_epi32(u, 16);
    const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                  _mm512_set1_epi32(0x7F800000));
    return _mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(hi, _mm512_set1_epi32(0x0040)));
}

#endif
