/*
 * test_sround.c — stochastic rounding to bf16 (lib/base/sround.h): exhaustive over the 16 random bits, so the
 * probability of rounding up is checked exactly, not sampled.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "dtype.h"
#include "sround.h"
#include "testbits.h" /* bits_of */

/* Over every r in [0, 65536): the result is x's bf16 neighbour below or above (in magnitude), and it is the
 * one above exactly L times, L = x's low 16 bits: P(up) = (|x| - down) / ulp, so E[result] = x. */
static void check_exhaustive(float x)
{
    uint32_t u = bits_of(x), low = u & 0xFFFFu;
    uint16_t down = (uint16_t)(u >> 16), up = (uint16_t)(down + 1);
    uint32_t ups = 0;
    double sum = 0;
    for (uint32_t r = 0; r < 65536; r++) {
        uint16_t h = bf16_round_stochastic(x, r);
        cr_assert(h == down || (low && h == up), "x = %a, r = %u: got 0x%04x, want 0x%04x or 0x%04x", (double)x, r, h,
                  down, up);
        ups += h == up;
        sum += bf16_to_fp32(h);
    }
    cr_assert_eq(ups, low, "x = %a: rounded up %u times in 65536, want %u", (double)x, ups, low);
    /* the mean over all r is x itself (exact in double: 65536 terms of 8 significant bits) */
    cr_assert_eq(sum / 65536.0, (double)x, "x = %a: mean %a", (double)x, sum / 65536.0);
}

Test(sround, probability_of_rounding_up_is_exact)
{
    const float xs[] = {1.0f + 0x1p-9f,          /* a quarter of an ulp above 1 */
                        1.0f + 0x1p-8f,          /* a tie */
                        1.0f + 3 * 0x1p-10f,     /* 3/8 */
                        -2.75f - 0x1p-12f,       /* negative: rounds away from zero with the same probability */
                        3.14159265f, -1e-3f, 65504.5f, 1e30f,
                        0x1p-130f + 0x1p-140f,   /* an fp32 subnormal: bf16 keeps subnormals */
                        0x1.fffffcp-127f,        /* near the largest subnormal */
                        0x1.fdfffep127f};        /* just below bf16's largest finite value */
    for (size_t i = 0; i < sizeof xs / sizeof xs[0]; i++)
        check_exhaustive(xs[i]);
}

Test(sround, representable_values_never_move)
{
    const float xs[] = {0.0f, -0.0f, 1.0f, -1.5f, 0x1p-133f, 0x1.fep127f};
    for (size_t i = 0; i < sizeof xs / sizeof xs[0]; i++) {
        float x = bf16_to_fp32(bf16_from_fp32(xs[i])); /* a bf16 value */
        for (uint32_t r = 0; r < 65536; r += 97)
            cr_assert_eq(bf16_round_stochastic(x, r), bf16_from_fp32(x), "x = %a, r = %u", (double)x, r);
        cr_assert_eq(bf16_round_stochastic(x, 0xFFFF), bf16_from_fp32(x));
    }
}

Test(sround, inf_and_nan_are_kept)
{
    for (uint32_t r = 0; r < 65536; r += 4099) {
        cr_assert_eq(bf16_round_stochastic(INFINITY, r), 0x7F80);
        cr_assert_eq(bf16_round_stochastic(-INFINITY, r), 0xFF80);
        uint16_t h = bf16_round_stochastic(NAN, r);
        cr_assert((h & 0x7F80) == 0x7F80 && (h & 0x7F), "NaN stays NaN (0x%04x)", h);
        cr_assert_eq(h, bf16_from_fp32(NAN), "as nearest rounding makes it");
    }
    /* within an ulp below bf16's largest finite value, rounding up gives Inf (as nearest rounding does above it) */
    cr_assert_eq(bf16_round_stochastic(0x1.fefffep127f, 0xFFFF), 0x7F80);
    cr_assert_eq(bf16_round_stochastic(0x1.fefffep127f, 0), 0x7F7F);
    /* the upper 16 bits of r's 32 are ignored */
    cr_assert_eq(bf16_round_stochastic(1.0f + 0x1p-9f, 0xFFFF0000u), bf16_from_fp32(1.0f));
}

Test(sround, streams_are_keyed_by_seed_step_and_parameter)
{
    uint64_t s = sr_seed(1234);
    cr_assert_neq(s, sr_seed(1235));
    cr_assert_neq(sr_stream(1, 0), sr_stream(2, 0));
    cr_assert_neq(sr_stream(1, 0), sr_stream(1, 1));
    cr_assert_eq(sr_stream(7, 3), sr_stream(7, 3));
    /* the (t, param) fields do not overlap up to their documented bounds */
    cr_assert_neq(sr_stream(1, 0xFFFFFF), sr_stream(2, 0));
    cr_assert_eq(sr_stream((int64_t)1 << 39, 5) >> 24, (uint64_t)1 << 39);
    /* a draw is a pure function of (seed, step, parameter, element) */
    cr_assert_eq(sr_key(s, 9, 2), rng_bits(s, sr_stream(9, 2), 0));
    cr_assert_eq(sr_bits(sr_key(s, 9, 2), 17), sr_bits(sr_key(s, 9, 2), 17));
    cr_assert_neq(sr_bits(sr_key(s, 9, 2), 17), sr_bits(sr_key(s, 10, 2), 17));
    cr_assert_neq(sr_bits(sr_key(s, 9, 2), 17), sr_bits(sr_key(s, 9, 3), 17));
    cr_assert_neq(sr_bits(sr_key(s, 9, 2), 17), sr_bits(sr_key(s, 9, 2), 18));
    /* each 16-bit field is uniform: over 2^16 elements every field's mean is 2^15 - 1/2 within 6 standard errors
     * (sd of one field 65536 / sqrt(12), of the mean that / 256: 73.9) */
    for (int shift = 0; shift <= 32; shift += 16) {
        double sum = 0;
        for (uint64_t i = 0; i < 65536; i++)
            sum += (double)((sr_bits(sr_key(s, 3, 1), i) >> shift) & 0xFFFF);
        double mean = sum / 65536;
        cr_assert(fabs(mean - 32767.5) < 6 * 73.9, "bits %d-%d: mean %g", shift, shift + 15, mean);
    }
}
