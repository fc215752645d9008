/*
 * test_dtype.c — the dtype module: exact fp32 <-> fp16 / bf16 conversion, and the SIMD bulk paths.
 *
 * Three kinds of evidence hold the portable scalar functions (the definition) in place:
 *   - every one of the 65,536 fp16 and bf16 bit patterns, widened and narrowed again;
 *   - an independent reference written here with double arithmetic and nearbyint (no bit tricks
 *     shared with lib/base/dtype.c), on 10 M fresh seeded values plus a table of hand-worked edge cases;
 *   - the x86 hardware where this CPU has it: F16C (_cvtss_sh / _cvtsh_ss) for fp16 and AVX512-BF16
 *     (_mm512_cvtneps_pbh) for bf16; tests that need missing hardware skip and say why.
 * The bulk SIMD paths are then held to the portable path bit for bit, for every pair of dtypes, on the
 * same 10 M values, odd lengths and unaligned pointers, with canaries around the destination.
 */
#define _POSIX_C_SOURCE 200809L /* setenv */

#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"    /* the module under test */
#include "testbits.h" /* bits_of, float_of, rng_next */
#ifdef AMP_HAVE_CUDA
#include <cuda_fp8.h> /* __nv_cvt_float_to_fp8: NVIDIA's own conversion (host code), the fp8 reference */
#endif

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_X86_INTRINSICS 1
#include <cpuid.h>
#include <immintrin.h>
#endif

#define N_RANDOM 10000000u
#define SEED UINT64_C(0x5EED0F16B16F32A1)

/* ---- independent references ----------------------------------------------------------------------- */

/* The exact value of an fp16 / bf16 pattern from its fields (not for Inf/NaN). */
static double fp16_value(uint16_t h)
{
    int e = (h >> 10) & 0x1F, m = h & 0x3FF;
    double v = e ? ldexp(1.0 + m / 1024.0, e - 15) : ldexp(m, -24);
    return (h & 0x8000) ? -v : v;
}

static double bf16_value(uint16_t h)
{
    int e = (h >> 7) & 0xFF, m = h & 0x7F;
    double v = e ? ldexp(1.0 + m / 128.0, e - 127) : ldexp(m, -133);
    return (h & 0x8000) ? -v : v;
}

/* Round a finite or infinite fp32 to a binary format with `mbits` stored mantissa bits and `ebits`
 * exponent bits, ties to even, with double arithmetic: scale to units of the target's ulp and let
 * nearbyint (default rounding mode: to nearest even) do the rounding. NaN is the caller's business. */
static uint16_t reference_round(float x, int mbits, int ebits)
{
    uint16_t sign = signbit(x) ? 0x8000 : 0;
    int bias = (1 << (ebits - 1)) - 1;
    uint16_t inf = (uint16_t)(((1u << ebits) - 1) << mbits);
    double a = fabs((double)x);
    if (isinf(a))
        return sign | inf;
    if (a == 0.0)
        return sign;
    int e = ilogb(a);
    if (e < 1 - bias)
        e = 1 - bias; /* subnormal range: the ulp stops shrinking */
    double q = nearbyint(ldexp(a, mbits - e));
    if (q >= ldexp(1.0, mbits + 1)) { /* rounded up to the next binade */
        q /= 2;
        e++;
    }
    if (q < ldexp(1.0, mbits)) /* subnormal (or zero) */
        return sign | (uint16_t)q;
    if (e > bias)
        return sign | inf;
    return sign | (uint16_t)((unsigned)(e + bias) << mbits) | (uint16_t)((unsigned)q - (1u << mbits));
}

/* The NaN rules of the contract, spelled out. */
static uint16_t reference_fp16_nan(uint32_t u)
{
    return (uint16_t)(((u >> 16) & 0x8000) | 0x7E00 | ((u >> 13) & 0x3FF));
}

static uint16_t reference_fp16(float x)
{
    return isnan(x) ? reference_fp16_nan(bits_of(x)) : reference_round(x, 10, 5);
}

static uint16_t reference_bf16(float x)
{
    return isnan(x) ? (uint16_t)((bits_of(x) >> 16) | 0x0040) : reference_round(x, 7, 8);
}

/* The standard bit formulation of bf16 RNE: rounding bias 0x7FFF plus the kept lsb. */
static uint16_t reference_bf16_bits(float x)
{
    uint32_t u = bits_of(x);
    if ((u & 0x7FFFFFFF) > 0x7F800000)
        return (uint16_t)((u >> 16) | 0x0040);
    uint32_t lsb = (u >> 16) & 1;
    return (uint16_t)((u + 0x7FFF + lsb) >> 16);
}

/* ---- hardware references -------------------------------------------------------------------------- */

#ifdef HAVE_X86_INTRINSICS
static int cpu_has(const char *what)
{
    unsigned eax, ebx, ecx, edx;
    __builtin_cpu_init();
    if (strcmp(what, "f16c") == 0) /* CPUID, as clang < 16 lacks __builtin_cpu_supports("f16c") */
        return __builtin_cpu_supports("avx") && __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
    if (strcmp(what, "avx512bf16") == 0)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
    return 0;
}

__attribute__((target("f16c"))) static uint16_t hw_fp16_from_fp32(float x)
{
    return (uint16_t)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
}

__attribute__((target("f16c"))) static float hw_fp16_to_fp32(uint16_t h)
{
    return _cvtsh_ss(h);
}

/* 16 fp32 -> 16 bf16 through vcvtneps2bf16. */
__attribute__((target("avx512f,avx512bf16"))) static void hw_bf16_from_fp32_x16(uint16_t *dst, const float *src)
{
    __m256bh r = _mm512_cvtneps_pbh(_mm512_loadu_ps(src));
    memcpy(dst, &r, 16 * sizeof *dst);
}
#else
static int cpu_has(const char *what)
{
    (void)what;
    return 0;
}
static uint16_t hw_fp16_from_fp32(float x) { (void)x; return 0; }
static float hw_fp16_to_fp32(uint16_t h) { (void)h; return 0; }
static void hw_bf16_from_fp32_x16(uint16_t *dst, const float *src) { (void)src; memset(dst, 0, 32); }
#endif

/* ---- test values ---------------------------------------------------------------------------------- */

/* Hand-worked expectations. f32 is the input's bit pattern. */
struct edge_case {
    uint32_t f32;
    uint16_t fp16, bf16;
    const char *what;
};

static const struct edge_case edge_cases[] = {
    {0x477FE000, 0x7BFF, 0x4780, "65504, fp16 max"},
    {0x477FEFFF, 0x7BFF, 0x4780, "65519.996, nextafter below 65520"},
    {0x477FF000, 0x7C00, 0x4780, "65520, rounds to fp16 Inf"},
    {0x477FF001, 0x7C00, 0x4780, "nextafter above 65520"},
    {0xC77FF000, 0xFC00, 0xC780, "-65520"},
    {0xC77FE000, 0xFBFF, 0xC780, "-65504"},
    {0x38800000, 0x0400, 0x3880, "2^-14, smallest normal fp16"},
    {0x387FFFFF, 0x0400, 0x3880, "nextafter below 2^-14"},
    {0x387FC000, 0x03FF, 0x3880, "largest fp16 subnormal"},
    {0x387FE000, 0x0400, 0x3880, "tie between largest subnormal and 2^-14"},
    {0x33800000, 0x0001, 0x3380, "2^-24, smallest fp16 subnormal"},
    {0x33000000, 0x0000, 0x3300, "2^-25, tie to even 0"},
    {0xB3000000, 0x8000, 0xB300, "-2^-25, tie to -0"},
    {0x33000001, 0x0001, 0x3300, "nextafter above 2^-25"},
    {0x32FFFFFF, 0x0000, 0x3300, "nextafter below 2^-25"},
    {0x33C00000, 0x0002, 0x33C0, "1.5 * 2^-24, tie to even 2"},
    {0x34200000, 0x0002, 0x3420, "2.5 * 2^-24, tie to even 2"},
    {0x3F801000, 0x3C00, 0x3F80, "1 + 2^-11, fp16 tie to even"},
    {0x3F803000, 0x3C02, 0x3F80, "1 + 3 * 2^-11, fp16 tie to even (up)"},
    {0x3F808000, 0x3C04, 0x3F80, "1 + 2^-8, bf16 tie to even"},
    {0x3F818000, 0x3C0C, 0x3F82, "1 + 3 * 2^-8, bf16 tie to even (up)"},
    {0x40490FDB, 0x4248, 0x4049, "pi"},
    {0x7F7F0000, 0x7C00, 0x7F7F, "largest finite bf16"},
    {0x7F7F7FFF, 0x7C00, 0x7F7F, "just below the bf16 overflow tie"},
    {0x7F7F8000, 0x7C00, 0x7F80, "bf16 overflow tie, rounds to Inf"},
    {0x7F7FFFFF, 0x7C00, 0x7F80, "FLT_MAX"},
    {0xFF7FFFFF, 0xFC00, 0xFF80, "-FLT_MAX"},
    {0x00800000, 0x0000, 0x0080, "FLT_MIN"},
    {0x807FFFFF, 0x8000, 0x8080, "largest negative fp32 subnormal"},
    {0x00000001, 0x0000, 0x0000, "smallest fp32 subnormal"},
    {0x00008000, 0x0000, 0x0000, "fp32 subnormal, bf16 tie to even 0"},
    {0x00018000, 0x0000, 0x0002, "fp32 subnormal, bf16 tie to even 2"},
    {0x00000000, 0x0000, 0x0000, "+0"},
    {0x80000000, 0x8000, 0x8000, "-0"},
    {0x7F800000, 0x7C00, 0x7F80, "+Inf"},
    {0xFF800000, 0xFC00, 0xFF80, "-Inf"},
    {0x7FC00000, 0x7E00, 0x7FC0, "quiet NaN"},
    {0xFFC00000, 0xFE00, 0xFFC0, "negative quiet NaN"},
    {0x7FFFFFFF, 0x7FFF, 0x7FFF, "quiet NaN, all payload bits"},
    {0x7F800001, 0x7E00, 0x7FC0, "signalling NaN, low payload bit"},
    {0xFF800001, 0xFE00, 0xFFC0, "negative signalling NaN"},
    {0x7FBFFFFF, 0x7FFF, 0x7FFF, "signalling NaN, all payload bits"},
    {0x7FA00000, 0x7F00, 0x7FE0, "signalling NaN, top payload bit"},
    {0x7F802000, 0x7E01, 0x7FC0, "signalling NaN, lowest payload bit fp16 keeps"},
    {0x7F810000, 0x7E08, 0x7FC1, "signalling NaN, lowest payload bit bf16 keeps"},
};
#define N_EDGE (sizeof edge_cases / sizeof edge_cases[0])

/* A fp32 within one ulp of the midpoint between fp16 h and the next fp16 up (h finite, positive). */
static float near_fp16_tie(uint16_t h, int delta)
{
    int e = (h >> 10) & 0x1F;
    double half_ulp = e ? ldexp(1.0, e - 26) : ldexp(1.0, -25);
    float mid = (float)(fp16_value(h) + half_ulp); /* exact: 12 significant bits */
    if (delta < 0)
        return nextafterf(mid, 0.0f);
    if (delta > 0)
        return nextafterf(mid, INFINITY);
    return mid;
}

/* The edge cases, then N_RANDOM fresh values: a quarter random bit patterns (every exponent, NaNs
 * and subnormals included), a quarter random values in and around the fp16 range (2^-27 .. 2^17),
 * a quarter within one ulp of an fp16 rounding tie, a quarter within one ulp of a bf16 tie. */
static float *make_values(size_t *count)
{
    size_t n = N_EDGE + N_RANDOM;
    float *v = malloc(n * sizeof *v);
    cr_assert_not_null(v, "out of memory for %zu test values", n);
    for (size_t i = 0; i < N_EDGE; i++)
        v[i] = float_of(edge_cases[i].f32);
    uint64_t state = SEED;
    for (size_t i = N_EDGE; i < n; i++) {
        uint64_t r = rng_next(&state);
        uint32_t sign = (uint32_t)(r >> 63) << 31;
        int delta = (int)((r >> 40) % 3) - 1;
        switch (i % 4) {
        case 0:
            v[i] = float_of((uint32_t)r);
            break;
        case 1: {
            uint32_t exponent = 127 - 27 + (uint32_t)((r >> 23) % 45);
            v[i] = float_of(sign | (exponent << 23) | ((uint32_t)r & 0x7FFFFF));
            break;
        }
        case 2: {
            uint16_t h = (uint16_t)(r % 0x7C00); /* finite, positive */
            v[i] = near_fp16_tie(h, delta);
            if (sign)
                v[i] = -v[i];
            break;
        }
        default: {
            uint32_t h = (uint32_t)(r % 0x7F80); /* finite, positive */
            v[i] = float_of(sign | ((h << 16) + 0x8000 + (uint32_t)delta));
            break;
        }
        }
    }
    *count = n;
    return v;
}

/* ---- small facts ---------------------------------------------------------------------------------- */

Test(dtype, size_and_name)
{
    cr_assert_eq(dtype_size(DT_FP32), 4);
    cr_assert_eq(dtype_size(DT_FP16), 2);
    cr_assert_eq(dtype_size(DT_BF16), 2);
    cr_assert_eq(dtype_size(DT_COUNT), 0);
    cr_assert_str_eq(dtype_name(DT_FP32), "fp32");
    cr_assert_str_eq(dtype_name(DT_FP16), "fp16");
    cr_assert_str_eq(dtype_name(DT_BF16), "bf16");
    cr_assert_str_eq(dtype_name(DT_COUNT), "unknown");
}

Test(dtype, round_gives_the_nearest_representable_value)
{
    cr_assert_eq(dtype_round(1.0f + 0x1p-11f, DT_FP16), 1.0f, "tie to even");
    cr_assert_eq(dtype_round(1.0f + 3 * 0x1p-11f, DT_FP16), 1.0f + 0x1p-9f, "tie to even, up");
    cr_assert_eq(dtype_round(65519.996f, DT_FP16), 65504.0f);
    cr_assert(isinf(dtype_round(65520.0f, DT_FP16)) && dtype_round(65520.0f, DT_FP16) > 0);
    cr_assert(isinf(dtype_round(-1e6f, DT_FP16)) && dtype_round(-1e6f, DT_FP16) < 0);
    cr_assert_eq(dtype_round(0x1p-25f, DT_FP16), 0.0f);
    cr_assert_eq(dtype_round(nextafterf(0x1p-25f, 1.0f), DT_FP16), 0x1p-24f);
    cr_assert_eq(bits_of(dtype_round(-1e-10f, DT_FP16)), 0x80000000u, "underflow keeps the sign");
    cr_assert_eq(dtype_round(3.14159265f, DT_FP16), 3.140625f);
    cr_assert_eq(dtype_round(3.14159265f, DT_BF16), 3.140625f);
    cr_assert_eq(dtype_round(1.0f + 0x1p-8f, DT_BF16), 1.0f, "tie to even");
    cr_assert_eq(dtype_round(1.0f + 3 * 0x1p-8f, DT_BF16), 1.0f + 0x1p-6f);
    cr_assert_eq(bits_of(dtype_round(1e30f, DT_BF16)), 0x714A0000u, "1e30 = 0x7149F2CA rounds up");
    cr_assert(isinf(dtype_round(FLT_MAX, DT_BF16)));
    cr_assert_eq(dtype_round(0x1p-130f, DT_BF16), 0x1p-130f, "bf16 subnormal kept");
    cr_assert_eq(dtype_round(0x1p-133f, DT_BF16), 0x1p-133f, "smallest bf16 subnormal kept");
    cr_assert_eq(bits_of(dtype_round(-0x1p-134f, DT_BF16)), 0x80000000u, "half the smallest: tie to -0");
    cr_assert_eq(dtype_round(1.0f + 0x1p-20f, DT_FP32), 1.0f + 0x1p-20f, "fp32 is the identity");
    cr_assert_eq(bits_of(dtype_round(float_of(0x7F800001), DT_FP32)), 0x7F800001u, "fp32 keeps NaN bits");
    cr_assert(isnan(dtype_round(NAN, DT_FP16)));
    cr_assert(isnan(dtype_round(NAN, DT_BF16)));
}

Test(dtype, edge_cases_give_the_worked_bits)
{
    for (size_t i = 0; i < N_EDGE; i++) {
        const struct edge_case *c = &edge_cases[i];
        float x = float_of(c->f32);
        cr_expect_eq(fp16_from_fp32(x), c->fp16, "fp16 of %s (0x%08X): got 0x%04X, want 0x%04X", c->what,
                     c->f32, fp16_from_fp32(x), c->fp16);
        cr_expect_eq(bf16_from_fp32(x), c->bf16, "bf16 of %s (0x%08X): got 0x%04X, want 0x%04X", c->what,
                     c->f32, bf16_from_fp32(x), c->bf16);
        cr_expect_eq(reference_fp16(x), c->fp16, "double reference disagrees on fp16 of %s", c->what);
        cr_expect_eq(reference_bf16(x), c->bf16, "double reference disagrees on bf16 of %s", c->what);
    }
}

/* ---- every 16-bit pattern ------------------------------------------------------------------------- */

Test(dtype, fp16_to_fp32_is_exact_for_all_patterns)
{
    int hw = cpu_has("f16c");
    for (uint32_t p = 0; p <= 0xFFFF; p++) {
        uint16_t h = (uint16_t)p;
        uint32_t got = bits_of(fp16_to_fp32(h));
        uint32_t sign = (uint32_t)(h & 0x8000) << 16;
        int e = (h >> 10) & 0x1F, m = h & 0x3FF;
        uint32_t want;
        if (e == 0x1F && m != 0)
            want = sign | 0x7FC00000 | ((uint32_t)m << 13); /* NaN: payload in place, quiet */
        else if (e == 0x1F)
            want = sign | 0x7F800000;
        else
            want = bits_of((float)fp16_value(h)); /* exact: fp16 values all fit fp32; -0 stays -0 */
        cr_assert_eq(got, want, "fp16 0x%04X -> 0x%08X, want 0x%08X", h, got, want);
        if (hw)
            cr_assert_eq(got, bits_of(hw_fp16_to_fp32(h)), "fp16 0x%04X -> 0x%08X, F16C gives 0x%08X", h, got,
                         bits_of(hw_fp16_to_fp32(h)));
    }
    if (!hw)
        cr_log_warn("no F16C on this CPU: fp16 -> fp32 checked against the ldexp reference only");
}

Test(dtype, fp16_round_trips_for_all_patterns)
{
    for (uint32_t p = 0; p <= 0xFFFF; p++) {
        uint16_t h = (uint16_t)p;
        uint16_t back = fp16_from_fp32(fp16_to_fp32(h));
        int is_nan = (h & 0x7C00) == 0x7C00 && (h & 0x3FF);
        uint16_t want = is_nan ? (uint16_t)(h | 0x0200) : h; /* a signalling NaN comes back quiet */
        cr_assert_eq(back, want, "fp16 0x%04X -> fp32 -> 0x%04X, want 0x%04X", h, back, want);
    }
}

Test(dtype, bf16_to_fp32_is_exact_for_all_patterns)
{
    for (uint32_t p = 0; p <= 0xFFFF; p++) {
        uint16_t h = (uint16_t)p;
        float f = bf16_to_fp32(h);
        cr_assert_eq(bits_of(f), (uint32_t)h << 16, "bf16 0x%04X -> 0x%08X", h, bits_of(f));
        if ((h & 0x7F80) != 0x7F80)
            cr_assert_eq((double)f, bf16_value(h), "bf16 0x%04X -> %a, want %a", h, (double)f, bf16_value(h));
    }
}

Test(dtype, bf16_round_trips_for_all_patterns)
{
    for (uint32_t p = 0; p <= 0xFFFF; p++) {
        uint16_t h = (uint16_t)p;
        uint16_t back = bf16_from_fp32(bf16_to_fp32(h));
        int is_nan = (h & 0x7F80) == 0x7F80 && (h & 0x7F);
        uint16_t want = is_nan ? (uint16_t)(h | 0x0040) : h;
        cr_assert_eq(back, want, "bf16 0x%04X -> fp32 -> 0x%04X, want 0x%04X", h, back, want);
    }
}

/* ---- 10 M values against the references ----------------------------------------------------------- */

struct mismatches {
    size_t count;
    size_t first;     /* index of the first one */
    uint16_t got, want;
};

static void note(struct mismatches *m, size_t i, uint16_t got, uint16_t want)
{
    if (got == want)
        return;
    if (m->count++ == 0) {
        m->first = i;
        m->got = got;
        m->want = want;
    }
}

static void assert_none(const struct mismatches *m, const float *v, const char *what)
{
    cr_assert_eq(m->count, 0, "%s: %zu mismatches; first at [%zu] fp32 0x%08X: got 0x%04X, want 0x%04X", what,
                 m->count, m->first, m->count ? bits_of(v[m->first]) : 0, m->got, m->want);
}

Test(dtype, fp16_matches_the_double_reference_on_10M_values, .timeout = 120)
{
    size_t n;
    float *v = make_values(&n);
    struct mismatches m = {0};
    for (size_t i = 0; i < n; i++)
        note(&m, i, fp16_from_fp32(v[i]), reference_fp16(v[i]));
    assert_none(&m, v, "fp16_from_fp32 vs double reference");
    free(v);
}

Test(dtype, fp16_matches_f16c_on_10M_values, .timeout = 120)
{
    if (!cpu_has("f16c"))
        cr_skip_test("this CPU has no F16C: the hardware fp16 comparison cannot run here");
    size_t n;
    float *v = make_values(&n);
    struct mismatches m = {0};
    for (size_t i = 0; i < n; i++)
        note(&m, i, fp16_from_fp32(v[i]), hw_fp16_from_fp32(v[i]));
    assert_none(&m, v, "fp16_from_fp32 vs F16C _cvtss_sh");
    free(v);
}

Test(dtype, bf16_matches_the_references_on_10M_values, .timeout = 120)
{
    size_t n;
    float *v = make_values(&n);
    struct mismatches bits = {0}, dbl = {0};
    for (size_t i = 0; i < n; i++) {
        uint16_t got = bf16_from_fp32(v[i]);
        note(&bits, i, got, reference_bf16_bits(v[i]));
        note(&dbl, i, got, reference_bf16(v[i]));
    }
    assert_none(&bits, v, "bf16_from_fp32 vs bias-0x7FFF reference");
    assert_none(&dbl, v, "bf16_from_fp32 vs double reference");
    free(v);
}

/* vcvtneps2bf16 flushes fp32 subnormal inputs to ±0 (the GPU does not), so those lanes are checked
 * for exactly that and otherwise left to the references above. */
Test(dtype, bf16_matches_avx512bf16_on_10M_values, .timeout = 120)
{
    if (!cpu_has("avx512bf16"))
        cr_skip_test("this CPU has no AVX512-BF16: the hardware bf16 comparison cannot run here");
    size_t n;
    float *v = make_values(&n);
    struct mismatches m = {0};
    size_t subnormals = 0;
    for (size_t i = 0; i < n; i += 16) {
        float chunk[16] = {0};
        uint16_t hw[16];
        size_t len = n - i < 16 ? n - i : 16;
        memcpy(chunk, v + i, len * sizeof *chunk);
        hw_bf16_from_fp32_x16(hw, chunk);
        for (size_t j = 0; j < len; j++) {
            uint32_t u = bits_of(v[i + j]);
            if ((u & 0x7F800000) == 0 && (u & 0x7FFFFF) != 0) {
                subnormals++;
                note(&m, i + j, hw[j], (uint16_t)((u >> 16) & 0x8000));
                continue;
            }
            note(&m, i + j, bf16_from_fp32(v[i + j]), hw[j]);
        }
    }
    assert_none(&m, v, "bf16_from_fp32 vs AVX512-BF16 _mm512_cvtneps_pbh");
    cr_assert_gt(subnormals, 0, "the generator should produce fp32 subnormals");
    cr_log_info("AVX512-BF16 agreed on all %zu values except the %zu fp32 subnormals it flushes to zero", n,
                subnormals);
    free(v);
}

/* ---- bulk paths against the portable path --------------------------------------------------------- */

static const char *const simd_paths[] = {"f16c", "avx512"};
#define N_PATHS (sizeof simd_paths / sizeof simd_paths[0])

/* A source array of n elements of `dt`: the 10 M values for fp32; for fp16 / bf16 every pattern
 * followed by random patterns. */
static void *make_source(enum dtype dt, size_t *count)
{
    if (dt == DT_FP32)
        return make_values(count);
    size_t n = N_RANDOM;
    uint16_t *s = malloc(n * sizeof *s);
    cr_assert_not_null(s, "out of memory");
    uint64_t state = SEED ^ (uint64_t)dt;
    for (size_t i = 0; i < n; i++)
        s[i] = i <= 0xFFFF ? (uint16_t)i : (uint16_t)rng_next(&state);
    *count = n;
    return s;
}

/* Run `path` (NULL: the dispatched dtype_convert) on n elements starting at element src_off of src,
 * writing at element dst_off of a canary-filled buffer, and compare with the portable result `want`
 * (for the whole source array). */
static void check_run(const char *path, enum dtype dst_dt, enum dtype src_dt, const void *src, const void *want,
                      size_t n, size_t src_off, size_t dst_off)
{
    size_t es = dtype_size(dst_dt), ss = dtype_size(src_dt);
    size_t guard = 32;
    unsigned char *buf = malloc((n + dst_off + guard) * es);
    cr_assert_not_null(buf, "out of memory");
    memset(buf, 0xA5, (n + dst_off + guard) * es);
    void *dst = buf + dst_off * es;
    const void *s = (const unsigned char *)src + src_off * ss;
    if (path)
        cr_assert_eq(dtype_convert_via(path, dst, dst_dt, s, src_dt, n), 0, "path %s refused", path);
    else
        dtype_convert(dst, dst_dt, s, src_dt, n);
    const unsigned char *w = (const unsigned char *)want + src_off * es;
    if (memcmp(dst, w, n * es) != 0) {
        size_t i = 0;
        while (memcmp((unsigned char *)dst + i * es, w + i * es, es) == 0)
            i++;
        uint32_t got = 0, exp = 0;
        memcpy(&got, (unsigned char *)dst + i * es, es);
        memcpy(&exp, w + i * es, es);
        cr_assert_fail("%s %s -> %s, n=%zu src+%zu dst+%zu: element %zu is 0x%X, portable gives 0x%X",
                       path ? path : dtype_simd_path(), dtype_name(src_dt), dtype_name(dst_dt), n, src_off,
                       dst_off, i, got, exp);
    }
    for (size_t b = 0; b < dst_off * es; b++)
        cr_assert_eq(buf[b], 0xA5, "%s wrote before dst", path ? path : "dtype_convert");
    for (size_t b = (n + dst_off) * es; b < (n + dst_off + guard) * es; b++)
        cr_assert_eq(buf[b], 0xA5, "%s %s -> %s, n=%zu: wrote past the end", path ? path : "dtype_convert",
                     dtype_name(src_dt), dtype_name(dst_dt), n);
    free(buf);
}

static void check_bulk_from(enum dtype src_dt)
{
    static const size_t odd_lengths[] = {0, 1, 15, 17, 1000003};
    static const size_t src_offsets[] = {0, 1, 3};
    static const size_t dst_offsets[] = {0, 1};
    size_t n;
    void *src = make_source(src_dt, &n);
    int paths_run = 0;
    for (int d = 0; d < DT_COUNT; d++) {
        enum dtype dst_dt = (enum dtype)d;
        void *want = malloc(n * dtype_size(dst_dt));
        cr_assert_not_null(want, "out of memory");
        dtype_convert_portable(want, dst_dt, src, src_dt, n);
        for (size_t p = 0; p <= N_PATHS; p++) {
            const char *path = p < N_PATHS ? simd_paths[p] : NULL;
            if (path && dtype_convert_via(path, NULL, dst_dt, NULL, src_dt, 0) != 0)
                continue; /* this CPU lacks the path */
            paths_run++;
            check_run(path, dst_dt, src_dt, src, want, n, 0, 0);
            for (size_t l = 0; l < sizeof odd_lengths / sizeof odd_lengths[0]; l++)
                for (size_t so = 0; so < sizeof src_offsets / sizeof src_offsets[0]; so++)
                    for (size_t dof = 0; dof < sizeof dst_offsets / sizeof dst_offsets[0]; dof++)
                        check_run(path, dst_dt, src_dt, src, want, odd_lengths[l], src_offsets[so], dst_offsets[dof]);
        }
        free(want);
    }
    cr_log_info("bulk from %s: %d path x dtype runs of %zu elements (dispatched path: %s)", dtype_name(src_dt),
                paths_run, n, dtype_simd_path());
    free(src);
}

Test(dtype, bulk_from_fp32_matches_portable, .timeout = 120)
{
    check_bulk_from(DT_FP32);
}

Test(dtype, bulk_from_fp16_matches_portable, .timeout = 120)
{
    check_bulk_from(DT_FP16);
}

Test(dtype, bulk_from_bf16_matches_portable, .timeout = 120)
{
    check_bulk_from(DT_BF16);
}

Test(dtype, bulk_portable_agrees_with_the_scalar_functions)
{
    float f[4] = {1.0f, 65520.0f, 0x1p-25f, -0.0f};
    uint16_t h[4], b[4];
    dtype_convert_portable(h, DT_FP16, f, DT_FP32, 4);
    dtype_convert_portable(b, DT_BF16, f, DT_FP32, 4);
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(h[i], fp16_from_fp32(f[i]));
        cr_assert_eq(b[i], bf16_from_fp32(f[i]));
    }
    uint16_t fp16_max = 0x7BFF, as_bf16;
    dtype_convert_portable(&as_bf16, DT_BF16, &fp16_max, DT_FP16, 1);
    cr_assert_eq(as_bf16, 0x4780, "65504 in bf16 is 65536");
    float copy[4];
    dtype_convert_portable(copy, DT_FP32, f, DT_FP32, 4);
    cr_assert_eq(memcmp(copy, f, sizeof f), 0, "same dtype is a copy");
}

/* A safetensors file whose header length is not a multiple of 8 (the format allows it) puts its F16/BF16 data at
 * odd addresses; the scalar tails loaded them as uint16_t, which UBSan reports as misaligned.
 * Every path, every pair, source and destination one byte off alignment, against the aligned conversion. */
Test(dtype, misaligned_source_and_destination_give_the_aligned_bits)
{
    enum { N = 45 }; /* vectors of 8 and 16 and a tail of each */
    _Alignas(64) unsigned char src[N * 4 + 1], dst[N * 4 + 1], want[N * 4];
    for (size_t i = 0; i < sizeof src; i++)
        src[i] = (unsigned char)(i * 37 + 11);
    const char *paths[] = {"portable", "f16c", "avx512", NULL};
    for (size_t p = 0; p < sizeof paths / sizeof paths[0]; p++)
        for (int s = 0; s < DT_COUNT; s++)
            for (int d = 0; d < DT_COUNT; d++) {
                const char *path = paths[p];
                enum dtype sd = (enum dtype)s, dd = (enum dtype)d;
                if (path && dtype_convert_via(path, NULL, dd, NULL, sd, 0) != 0)
                    continue; /* this CPU lacks the path */
                unsigned char aligned[N * 4];
                memcpy(aligned, src + 1, N * dtype_size(sd));
                dtype_convert_portable(want, dd, aligned, sd, N);
                memset(dst, 0xA5, sizeof dst);
                if (path)
                    dtype_convert_via(path, dst + 1, dd, src + 1, sd, N);
                else
                    dtype_convert(dst + 1, dd, src + 1, sd, N);
                cr_assert_eq(memcmp(dst + 1, want, N * dtype_size(dd)), 0, "%s %s -> %s, both one byte off",
                             path ? path : "dispatch", dtype_name(sd), dtype_name(dd));
                cr_assert_eq(dst[0], 0xA5);
            }
}

/* ---- dispatch ------------------------------------------------------------------------------------- */

Test(dtype, dispatch_takes_the_best_path_this_cpu_has)
{
    const char *path = dtype_simd_path();
    int has_avx512 = dtype_convert_via("avx512", NULL, DT_FP16, NULL, DT_FP32, 0) == 0;
    int has_f16c = dtype_convert_via("f16c", NULL, DT_FP16, NULL, DT_FP32, 0) == 0;
    const char *env = getenv("AMPTRAIN_DTYPE_PORTABLE");
    if (env && env[0] && strcmp(env, "0") != 0)
        cr_assert_str_eq(path, "portable");
    else if (has_avx512)
        cr_assert_str_eq(path, "avx512");
    else if (has_f16c)
        cr_assert_str_eq(path, "f16c");
    else
        cr_assert_str_eq(path, "portable");
#ifdef HAVE_X86_INTRINSICS
    __builtin_cpu_init();
    cr_assert_eq(has_avx512, !!__builtin_cpu_supports("avx512f"));
    cr_assert_eq(has_f16c, cpu_has("f16c") && __builtin_cpu_supports("avx2"));
#endif
    cr_assert_eq(dtype_convert_via("portable", NULL, DT_FP16, NULL, DT_FP32, 0), 0);
    cr_assert_eq(dtype_convert_via("sse9", NULL, DT_FP16, NULL, DT_FP32, 0), -1, "unknown paths are refused");
    cr_assert_eq(dtype_convert_via(NULL, NULL, DT_FP16, NULL, DT_FP32, 0), -1);
    cr_log_info("dtype_convert path on this CPU: %s", path);
}

/* Each Criterion test runs in its own process, so setting the variable before the first conversion
 * here decides this process's path. */
Test(dtype, env_var_forces_the_portable_path)
{
    cr_assert_eq(setenv("AMPTRAIN_DTYPE_PORTABLE", "1", 1), 0);
    cr_assert_str_eq(dtype_simd_path(), "portable");
    float f[33];
    uint16_t got[33];
    for (int i = 0; i < 33; i++)
        f[i] = (float)i * 1000.5f;
    dtype_convert(got, DT_FP16, f, DT_FP32, 33);
    for (int i = 0; i < 33; i++)
        cr_assert_eq(got[i], fp16_from_fp32(f[i]));
}

/* Values a user compares (scale_log.csv, messages) print so that they read back exactly: 2^30 was
 * 1.07374182e+09 with %.9g. */
Test(dtype, double_to_text_is_the_shortest_exact_decimal)
{
    char buf[40];
    struct { double v; const char *want; } cases[] = {
        {1073741824.0, "1073741824"}, {65536.0, "65536"}, {0.1, "0.1"}, {1e-300, "1e-300"}, {0.0, "0"},
        {-2.5, "-2.5"}, {INFINITY, "inf"}, {-INFINITY, "-inf"}, {NAN, "nan"}, {16777216.0 * 4096, "68719476736"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        double_to_text(cases[i].v, buf, sizeof buf);
        cr_assert_str_eq(buf, cases[i].want);
    }
    /* Every power of two a loss scale can take, and random doubles, read back exactly. */
    for (int e = -1074; e <= 1023; e++) {
        double v = ldexp(1.0, e);
        double_to_text(v, buf, sizeof buf);
        cr_assert_eq(strtod(buf, NULL), v, "2^%d printed as %s", e, buf);
    }
    uint64_t x = 88172645463325252ull;
    for (int i = 0; i < 100000; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        double v;
        memcpy(&v, &x, sizeof v);
        if (!isfinite(v))
            continue;
        double_to_text(v, buf, sizeof buf);
        cr_assert_eq(strtod(buf, NULL), v, "%a printed as %s", v, buf);
    }
}

/* ---- fp8 -------------------------------------------------------------------------------------------- */

static const char *fp8_name(enum fp8_format f)
{
    return f == FP8_E4M3 ? "e4m3" : "e5m2";
}

static int fp8_is_nan_code(uint8_t c, enum fp8_format f)
{
    return f == FP8_E4M3 ? (c & 0x7F) == 0x7F : (c & 0x7F) > 0x7C;
}

/* Every code decodes to its value and encodes back to itself, in both saturation modes; the values rise
 * with the codes (0x00..0x7E or 0x7B), and the largest finite value is the format's max. */
Test(fp8, all_256_codes_round_trip)
{
    for (int f = FP8_E4M3; f <= FP8_E5M2; f++) {
        float prev = -1;
        for (int c = 0; c < 256; c++) {
            float v = fp8_to_fp32((uint8_t)c, f);
            if (fp8_is_nan_code((uint8_t)c, f)) {
                cr_assert(isnan(v), "%s 0x%02x decodes to %g, want NaN", fp8_name(f), c, (double)v);
                continue;
            }
            if (isinf(v)) {
                cr_assert(f == FP8_E5M2 && (c & 0x7F) == 0x7C, "%s 0x%02x is Inf", fp8_name(f), c);
                cr_assert_eq(fp8_from_fp32(v, f, 0), c);
                continue;
            }
            cr_assert_eq(fp8_from_fp32(v, f, 0), c, "%s 0x%02x = %a encodes to 0x%02x", fp8_name(f), c, (double)v,
                         fp8_from_fp32(v, f, 0));
            cr_assert_eq(fp8_from_fp32(v, f, 1), c, "%s 0x%02x saturating", fp8_name(f), c);
            cr_assert_eq(!!signbit(v), c >= 0x80, "%s 0x%02x: sign", fp8_name(f), c);
            if (c < 0x80) {
                cr_assert(v > prev || (c == 0 && v == 0), "%s codes rise: 0x%02x = %g after %g", fp8_name(f), c,
                          (double)v, (double)prev);
                prev = v;
            }
        }
        cr_assert_eq(prev, fp8_max(f), "%s: largest finite %g", fp8_name(f), (double)prev);
    }
    cr_assert_eq(fp8_max(FP8_E4M3), 448.0f);
    cr_assert_eq(fp8_max(FP8_E5M2), 57344.0f);
    cr_assert_eq(fp8_to_fp32(0x01, FP8_E4M3), 0x1p-9f, "E4M3's smallest subnormal");
    cr_assert_eq(fp8_to_fp32(0x01, FP8_E5M2), 0x1p-16f, "E5M2's smallest subnormal");
}

/* Between every two neighbouring finite values a < b (both signs): the midpoint goes to the one with an even
 * code (ties to even), the float just above it to b, the float just below it to a. */
Test(fp8, every_rounding_boundary_rounds_to_nearest_even)
{
    for (int f = FP8_E4M3; f <= FP8_E5M2; f++) {
        int top = f == FP8_E4M3 ? 0x7E : 0x7B, checked = 0;
        for (int c = 0; c < top; c++)
            for (int neg = 0; neg < 2; neg++) {
                uint8_t a = (uint8_t)(c | (neg << 7)), b = (uint8_t)((c + 1) | (neg << 7));
                float va = fp8_to_fp32(a, f), vb = fp8_to_fp32(b, f);
                float mid = (va + vb) / 2; /* exact: a few significant bits */
                cr_assert_eq((double)mid, ((double)va + (double)vb) / 2);
                uint8_t even = (c & 1) ? b : a;
                for (int sat = 0; sat < 2; sat++) {
                    cr_assert_eq(fp8_from_fp32(mid, f, sat), even, "%s tie %a: 0x%02x", fp8_name(f), (double)mid,
                                 fp8_from_fp32(mid, f, sat));
                    cr_assert_eq(fp8_from_fp32(nextafterf(mid, neg ? -INFINITY : INFINITY), f, sat), b,
                                 "%s just past %a", fp8_name(f), (double)mid);
                    cr_assert_eq(fp8_from_fp32(nextafterf(mid, 0.0f), f, sat), a, "%s just short of %a", fp8_name(f),
                                 (double)mid);
                }
                checked++;
            }
        cr_assert_eq(checked, 2 * top);
    }
}

/* Past the largest finite value: +-max when saturating (Inf too), else NaN (E4M3, which has no Inf) or
 * +-Inf (E5M2); the tie at max + half an ulp goes to max (its code is even) in E4M3 and past it in E5M2. */
Test(fp8, saturation_and_overflow)
{
    /* E4M3: max 448 (0x7E), half an ulp above it 464 */
    cr_assert_eq(fp8_from_fp32(464.0f, FP8_E4M3, 0), 0x7E, "464 ties to 448 (even)");
    cr_assert_eq(fp8_from_fp32(nextafterf(464.0f, INFINITY), FP8_E4M3, 0), 0x7F, "NaN: E4M3 has no Inf");
    cr_assert_eq(fp8_from_fp32(nextafterf(464.0f, INFINITY), FP8_E4M3, 1), 0x7E);
    cr_assert_eq(fp8_from_fp32(-1e6f, FP8_E4M3, 0), 0xFF);
    cr_assert_eq(fp8_from_fp32(-1e6f, FP8_E4M3, 1), 0xFE);
    cr_assert_eq(fp8_from_fp32(INFINITY, FP8_E4M3, 1), 0x7E, "Inf saturates too");
    cr_assert_eq(fp8_from_fp32(-INFINITY, FP8_E4M3, 0), 0xFF);
    /* E5M2: max 57344 (0x7B, an odd code), half an ulp above it 61440 */
    cr_assert_eq(fp8_from_fp32(nextafterf(61440.0f, 0.0f), FP8_E5M2, 0), 0x7B);
    cr_assert_eq(fp8_from_fp32(61440.0f, FP8_E5M2, 0), 0x7C, "61440 ties to 65536 (even): Inf");
    cr_assert_eq(fp8_from_fp32(61440.0f, FP8_E5M2, 1), 0x7B);
    cr_assert_eq(fp8_from_fp32(-INFINITY, FP8_E5M2, 0), 0xFC);
    cr_assert_eq(fp8_from_fp32(-INFINITY, FP8_E5M2, 1), 0xFB);
    cr_assert_eq(fp8_from_fp32(FLT_MAX, FP8_E5M2, 1), 0x7B);
}

Test(fp8, nan_underflow_and_signed_zero)
{
    for (int f = FP8_E4M3; f <= FP8_E5M2; f++) {
        cr_assert_eq(fp8_from_fp32(NAN, f, 0), 0x7F);
        cr_assert_eq(fp8_from_fp32(-NAN, f, 1), 0x7F, "a NaN's sign is not kept (as CUDA's conversion)");
        float tiny = fp8_to_fp32(0x01, f); /* the smallest subnormal */
        cr_assert_eq(fp8_from_fp32(tiny / 2, f, 0), 0x00, "half the smallest subnormal ties to 0");
        cr_assert_eq(fp8_from_fp32(nextafterf(tiny / 2, 1.0f), f, 0), 0x01);
        cr_assert_eq(fp8_from_fp32(-tiny / 4, f, 0), 0x80, "underflow keeps the sign: -0");
        cr_assert_eq(fp8_from_fp32(-0.0f, f, 0), 0x80);
        cr_assert(signbit(fp8_to_fp32(0x80, f)) && fp8_to_fp32(0x80, f) == 0.0f);
        cr_assert_eq(fp8_from_fp32(FLT_MIN / 1024, f, 0), 0x00, "an fp32 subnormal");
    }
    cr_assert(isnan(fp8_to_fp32(0xFF, FP8_E4M3)));
    cr_assert(isnan(fp8_to_fp32(0x7D, FP8_E5M2)) && isnan(fp8_to_fp32(0xFE, FP8_E5M2)));
}

/* NVIDIA's own conversion (cuda_fp8.hpp's host code, which defines the GPU's cvt.rn.satfinite results) against
 * ours: every 997th fp32 pattern and every float of magnitude 2^-20..2^17 whose low mantissa bits are 0 or
 * near a boundary, both formats, both saturation modes (19.7 M conversions); and the decoding of all 256 codes. */
Test(fp8, matches_nvidias_conversion_bit_for_bit, .timeout = 300)
{
#ifndef AMP_HAVE_CUDA
    cr_skip_test("built without the CUDA toolkit: no cuda_fp8.h to compare with");
#else
    long long n = 0;
    for (int f = FP8_E4M3; f <= FP8_E5M2; f++)
        for (int sat = 0; sat < 2; sat++) {
            __nv_fp8_interpretation_t interp = f == FP8_E4M3 ? __NV_E4M3 : __NV_E5M2;
            __nv_saturation_t s = sat ? __NV_SATFINITE : __NV_NOSAT;
            for (uint64_t u = 0; u < (1ull << 32); u += 997) {
                float x;
                uint32_t b = (uint32_t)u;
                memcpy(&x, &b, sizeof x);
                uint8_t want = __nv_cvt_float_to_fp8(x, s, interp), got = fp8_from_fp32(x, f, sat);
                cr_assert_eq(got, want, "%s sat %d: %a (0x%08x): ours 0x%02x, NVIDIA's 0x%02x", fp8_name(f), sat,
                             (double)x, b, got, want);
                n++;
            }
            for (uint32_t e = 127 - 20; e <= 127 + 17; e++)
                for (uint32_t m = 0; m < (1u << 23); m += (m & 0x3F) == 0x3F ? 0xFFC1 : 1)
                    for (uint32_t sg = 0; sg < 2; sg++) {
                        uint32_t b = (sg << 31) | (e << 23) | m;
                        float x;
                        memcpy(&x, &b, sizeof x);
                        uint8_t want = __nv_cvt_float_to_fp8(x, s, interp), got = fp8_from_fp32(x, f, sat);
                        cr_assert_eq(got, want, "%s sat %d: %a: ours 0x%02x, NVIDIA's 0x%02x", fp8_name(f), sat,
                                     (double)x, got, want);
                        n++;
                    }
        }
    for (int c = 0; c < 256; c++) {
        /* NVIDIA decodes to fp16 (exact: both formats fit in it); fp16_to_fp32 is exact too */
        float wa = fp16_to_fp32(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)c, __NV_E4M3).x),
              wb = fp16_to_fp32(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)c, __NV_E5M2).x);
        float ga = fp8_to_fp32((uint8_t)c, FP8_E4M3), gb = fp8_to_fp32((uint8_t)c, FP8_E5M2);
        cr_assert((isnan(wa) && isnan(ga)) || (wa == ga && signbit(wa) == signbit(ga)), "e4m3 0x%02x", c);
        cr_assert((isnan(wb) && isnan(gb)) || (wb == gb && signbit(wb) == signbit(gb)), "e5m2 0x%02x", c);
    }
    cr_log_info("fp8: %lld conversions agree with NVIDIA's", n);
#endif
}
