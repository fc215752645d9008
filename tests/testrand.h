/*
 * testrand.h — the seeded generator (SplitMix64) that tests draw fresh random inputs from.
 */
#ifndef AMP_TESTRAND_H
#define AMP_TESTRAND_H

#include <stdint.h>

/* ---- seeded generator (SplitMix64) ---- */

static uint64_t rs __attribute__((unused));

static inline void seed(uint64_t s)
{
    rs = s * 0x9e3779b97f4a7c15ULL + 1;
}

static inline double urand(void) /* [0, 1) */
{
    uint64_t z = (rs += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

#endif
