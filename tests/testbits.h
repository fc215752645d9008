/*
 * testbits.h — what the suites that check bit patterns (test_dtype.c, test_cuda_convert.c, test_sround.c,
 * test_export.c) share: a float's bits and back, and a SplitMix64 step whose state the caller holds (one stream per
 * test, independent of testrand.h's global one).
 */
#ifndef AMP_TESTBITS_H
#define AMP_TESTBITS_H

#include <stdint.h>
#include <string.h>

static inline uint32_t bits_of(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static inline float float_of(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* splitmix64: small, seeded, and good enough to cover every exponent and mantissa pattern. */
static inline uint64_t rng_next(uint64_t *state)
{
    uint64_t z = (*state += UINT64_C(0x9E3779B97F4A7C15));
    z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
    return z ^ (z >> 31);
}

#endif
