/*
 * rng.c — counter-based generator: SplitMix64-style finalisers over a combination of the key. See rng.h.
 */
#include "rng.h"

#include <math.h>

float rng_uniform(uint64_t seed, uint64_t stream, uint64_t counter)
{
    return (float)(rng_bits(seed, stream, counter) >> 40) * (1.0f / 16777216.0f);
}

float rng_normal(uint64_t seed, uint64_t stream, uint64_t counter)
{
    /* u1 in (0, 1] so log is finite */
    double u1 = ((double)(rng_bits(seed, stream, 2 * counter) >> 11) + 1.0) * (1.0 / 9007199254740992.0);
    double u2 = (double)(rng_bits(seed, stream, 2 * counter + 1) >> 11) * (1.0 / 9007199254740992.0);
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

uint64_t rng_below(uint64_t seed, uint64_t stream, uint64_t counter, uint64_t n)
{
    uint64_t limit = UINT64_MAX - UINT64_MAX % n; /* accept draws below a multiple of n */
    for (uint64_t c = counter;; c += 0x100000000ULL) {
        uint64_t r = rng_bits(seed, stream, c);
        if (r < limit)
            return r % n;
    }
}
