/*
 * dtype_simd.c — vectorised bulk conversions for dtype_convert, chosen at run time.
 *
 * Two x86-64 paths, each compiled with a per-function target attribute so the rest of the build needs
 * no -m flags and the binary still runs on CPUs without these instructions:
 *   "f16c"   (F16C + AVX2, 8 lanes):   fp16 via vcvtps2ph / vcvtph2ps, bf16 via integer AVX2.
 *   "avx512" (AVX-512F, 16 lanes):     fp16 via the EVEX vcvtps2ph / vcvtph2ps, bf16 via integer
 *                                      AVX-512 and vpmovdw.
 * fp16 <-> bf16 goes through fp32 in registers, exactly as the portable path goes through fp32.
 *
 * Why bf16 is done with integer arithmetic and not AVX512-BF16's vcvtneps2bf16: that instruction
 * flushes fp32 subnormal inputs to ±0, whereas the GPU (and the portable definition) rounds them to
 * bf16 subnormals. The integer form (bits + 0x7FFF + lsb) >> 16 with a NaN blend is exact, and the
 * conversion is memory-bound, so it costs nothing measurable.
 *
 * The fp16 instructions agree with the portable functions on every input, NaNs included, because the
 * portable functions were defined to match them (see dtype.c). The immediate rounding mode is used,
 * so MXCSR's rounding mode does not matter. Tails shorter than a vector go through the scalar
 * functions, which give the same bits. Source and destination may lie at any address (a safetensors tensor after a
 * header of odd length): the vectors use unaligned loads and stores, the tails dtype_simd.h's memcpy-based ones.
 */
#include "dtype_simd.h"

#include <stdint.h>
#include <string.h>

#include "dtype.h"  /* fp16_from_fp32, fp16_to_fp32, bf16_from_fp32, bf16_to_fp32 for the tails */

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define AMP_DTYPE_X86 1
#include <cpuid.h>
#include <immintrin.h>
#endif

#ifdef AMP_DTYPE_X86

#define TARGET_F16C __attribute__((target("avx2,f16c")))
#define TARGET_AVX512 __attribute__((target("avx512f")))

/* ---- "f16c": F16C + AVX2, 8 lanes ---------------------------------------------------------------- */

/* fp32 bits (8 lanes) -> bf16 in the low 16 bits of each 32-bit lane, RNE, NaN quieted. */
TARGET_F16C static inline __m256i bf16_bits_avx2(__m256i u)
{
    const __m256i one = _mm256_set1_epi32(1);
    const __m256i bias = _mm256_set1_epi32(0x7FFF);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(bias, lsb)), 16);
    __m256i magnitude = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
    __m256i is_nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7F800000));
    __m256i quiet_nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x0040));
    return _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
}

/* Two vectors of 8 bf16-in-32-bit lanes -> 16 packed bf16, in order. */
TARGET_F16C static inline __m256i pack_bf16_avx2(__m256i lo, __m256i hi)
{
    /* packus works per 128-bit half: [lo0-3 hi0-3 | lo4-7 hi4-7]; the permute restores the order. */
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
}

TARGET_F16C static void fp32_to_fp16_f16c(void *dst, const void *src, size_t n)
{
    uint16_t *d = dst;    /* fp16 (n) */
    const float *s = src; /* fp32 (n) */
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i *)(d + i), h);
    }
    for (; i < n; i++)
        dtype_st_u16(dst, i, fp16_from_fp32(dtype_ld_f32(src, i)));
}

TARGET_F16C static void fp16_to_fp32_f16c(void *dst, const void *src, size_t n)
{
    float *d = dst;          /* fp32 (n) */
    const uint16_t *s = src; /* fp16 (n) */
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
    for (; i < n; i++)
        dtype_st_f32(dst, i, fp16_to_fp32(dtype_ld_u16(src, i)));
}

TARGET_F16C static void fp32_to_bf16_f16c(void *dst, const void *src, size_t n)
{
    uint16_t *d = dst;    /* bf16 (n) */
    const float *s = src; /* fp32 (n) */
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i lo = bf16_bits_avx2(_mm256_loadu_si256((const __m256i *)(s + i)));
        __m256i hi = bf16_bits_avx2(_mm256_loadu_si256((const __m256i *)(s + i + 8)));
        _mm256_storeu_si256((__m256i *)(d + i), pack_bf16_avx2(lo, hi));
    }
    for (; i < n; i++)
        dtype_st_u16(dst, i, bf16_from_fp32(dtype_ld_f32(src, i)));
}

TARGET_F16C static void bf16_to_fp32_f16c(void *dst, const void *src, size_t n)
{
    float *d = dst;          /* fp32 (n) */
    const uint16_t *s = src; /* bf16 (n) */
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + i)));
        _mm256_storeu_si256((__m256i *)(d + i), _mm256_slli_epi32(w, 16));
    }
    for (; i < n; i++)
        dtype_st_f32(dst, i, bf16_to_fp32(dtype_ld_u16(src, i)));
}

TARGET_F16C static void fp16_to_bf16_f16c(void *dst, const void *src, size_t n)
{
    uint16_t *d = dst;       /* bf16 (n) */
    const uint16_t *s = src; /* fp16 (n) */
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i)));
        __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i + 8)));
        __m256i packed = pack_bf16_avx2(bf16_bits_avx2(_mm256_castps_si256(lo)),
                                        bf16_bits_avx2(_mm256_castps_si256(hi)));
        _mm256_storeu_si256((__m256i *)(d + i), packed);
    }
    for (; i < n; i++)
        dtype_st_u16(dst, i, bf16_from_fp32(fp16_to_fp32(dtype_ld_u16(src, i))));
}

TARGET_F16C static void bf16_to_fp16_f16c(void *dst, const void *src, size_t n)
{
    uint16_t *d = dst;       /* fp16 (n) */
    const uint16_t *s = src; /* bf16 (n) */
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + i))), 16);
        __m128i h = _mm256_cvtps_ph(_mm256_castsi256_ps(w), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i *)(d + i), h);
    }
    for (; i < n; i++)
        dtype_st_u16(dst, i, fp16_from_fp32(bf16_to_fp32(dtype_ld_u16(src, i))));
}

/* ---- "avx512": AVX-512F, 16 lanes ---------------------------------------------------------------- */

/* fp32 bits (16 lanes) -> 16 packed bf16, RNE, NaN quieted. */
TARGET_AVX512 static inline __m256i bf16_from_bits_avx512(__m512i u)
{
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
    __m512i magnitude = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
    __mmask16 is_nan = _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(0x7F800000));
    __m512i quiet_nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x0040));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, is_nan, quiet_nan));
}

TARGET_AVX512 static inline __m512 fp32_from_bf16_avx512(__m256i h)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

TARGET_AVX512 static void fp32_to_fp16_avx512(void *dst, const void *src, size_t n)
{
    uint16_t *d = dst;    /* fp16 (n) */
    const float *s = src; /* fp32 (n) */
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT);
        _mm256_storeu_si256((__m256i *)(d + i), h);
    }
    for (; i < n; i++)
        dtype_st_u16(dst, i, fp16_from_fp32(dtype_ld_f32(src, i)));
}

TARGET_AVX512 static void fp16_to_fp32_avx512(void *dst, const void *src, size_t n)
{
    float *d = dst;          /* fp32 (n) */
    const uint16_t *s = src; /* fp16 (n) */
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(d + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + i))));
    for (; i < n; i++)
        dtype_st_f32(dst, i, fp16_to_fp32(dtype_ld_u16(src, i)));
}

TARGET_AVX512 static void fp32_to_bf16_avx512(void *dst, const void *src, size_t n)
{
    uint16_t *d = dst;    /* bf16 (n) */
    const float *s = src; /* fp32 (n) */
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i h = bf16_from_bits_avx512(_mm512_loadu_si512((const void *)(s + i)));
        _mm256_storeu_si256((__m256i *)(d + i), h);
    }
    for (; i < n; i++)
        dtype_st_u16(dst, i, bf16_from_fp32(dtype_ld_f32(src, i)));
}

TARGET_AVX512 static void bf16_to_fp32_avx512(void *dst, const void *src, size_t n)
{
    float *d = dst;          /* fp32 (n) */
    const uint16_t *s = src; /* bf16 (n) */
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(d + i, fp32_from_bf16_avx512(_mm256_loadu_si256((const __m256i *)(s + i))));
    for (; i < n; i++)
        dtype_st_f32(dst, i, bf16_to_fp32(dtype_ld_u16(src, i)));
}

TARGET_AVX512 static void fp16_to_bf16_avx512(void *dst, const void *src, size_t n)
{
    uint16_t *d = dst;       /* bf16 (n) */
    const uint16_t *s = src; /* fp16 (n) */
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + i)));
        _mm256_storeu_si256((__m256i *)(d + i), bf16_from_bits_avx512(_mm512_castps_si512(f)));
    }
    for (; i < n; i++)
        dtype_st_u16(dst, i, bf16_from_fp32(fp16_to_fp32(dtype_ld_u16(src, i))));
}

TARGET_AVX512 static void bf16_to_fp16_avx512(void *dst, const void *src, size_t n)
{
    uint16_t *d = dst;       /* fp16 (n) */
    const uint16_t *s = src; /* bf16 (n) */
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 f = fp32_from_bf16_avx512(_mm256_loadu_si256((const __m256i *)(s + i)));
        _mm256_storeu_si256((__m256i *)(d + i), _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT));
    }
    for (; i < n; i++)
        dtype_st_u16(dst, i, fp16_from_fp32(bf16_to_fp32(dtype_ld_u16(src, i))));
}

static const struct dtype_simd_table table_f16c = {
    .name = "f16c",
    .fp32_to_fp16 = fp32_to_fp16_f16c,
    .fp16_to_fp32 = fp16_to_fp32_f16c,
    .fp32_to_bf16 = fp32_to_bf16_f16c,
    .bf16_to_fp32 = bf16_to_fp32_f16c,
    .fp16_to_bf16 = fp16_to_bf16_f16c,
    .bf16_to_fp16 = bf16_to_fp16_f16c,
};

static const struct dtype_simd_table table_avx512 = {
    .name = "avx512",
    .fp32_to_fp16 = fp32_to_fp16_avx512,
    .fp16_to_fp32 = fp16_to_fp32_avx512,
    .fp32_to_bf16 = fp32_to_bf16_avx512,
    .bf16_to_fp32 = bf16_to_fp32_avx512,
    .fp16_to_bf16 = fp16_to_bf16_avx512,
    .bf16_to_fp16 = bf16_to_fp16_avx512,
};

/* __builtin_cpu_supports also checks that the OS saves the wide registers (XCR0). Not every compiler
 * knows "f16c" there (clang < 16 does not), so that bit comes from CPUID leaf 1 directly; the AVX2
 * check already covers the OS support F16C's ymm registers need. */
static int cpu_has_f16c_path(void)
{
    unsigned eax, ebx, ecx, edx;
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__get_cpuid(1, &eax, &ebx, &ecx, &edx))
        return 0;
    return (ecx & bit_F16C) != 0;
}

static int cpu_has_avx512_path(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}

const struct dtype_simd_table *dtype_simd_find(const char *name)
{
    if (!name)
        return NULL;
    if (strcmp(name, "avx512") == 0)
        return cpu_has_avx512_path() ? &table_avx512 : NULL;
    if (strcmp(name, "f16c") == 0)
        return cpu_has_f16c_path() ? &table_f16c : NULL;
    return NULL;
}

const struct dtype_simd_table *dtype_simd_best(void)
{
    if (cpu_has_avx512_path())
        return &table_avx512;
    if (cpu_has_f16c_path())
        return &table_f16c;
    return NULL;
}

#else /* not x86 with GCC/Clang: portable only */

const struct dtype_simd_table *dtype_simd_find(const char *name)
{
    (void)name;
    return NULL;
}

const struct dtype_simd_table *dtype_simd_best(void)
{
    return NULL;
}

#endif
