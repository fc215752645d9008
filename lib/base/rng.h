/*
 * rng.h — counter-based random numbers: every draw is a pure function of (seed, stream, counter).
 *
 * No generator state to save or restore: parameter init, dropout masks and data shuffling name
 * their stream and counter, so a resumed run draws exactly what an uninterrupted one would, and the
 * CUDA backend can compute the same dropout masks on the device (the mixing function is plain
 * 64-bit integer arithmetic, see rng.c).
 */
#ifndef AMP_RNG_H
#define AMP_RNG_H

#include <stdint.h>

#include "amp_hd.h" /* AMP_HD */

/* SplitMix64's finaliser. */
AMP_HD static inline uint64_t rng_mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* 64 random bits for (seed, stream, counter): one definition for the host and every device (the CUDA
 * backend draws dropout masks and stochastic rounding bits with it). */
AMP_HD static inline uint64_t rng_bits(uint64_t seed, uint64_t stream, uint64_t counter)
{
    uint64_t k = rng_mix64(seed + 0x9e3779b97f4a7c15ULL);
    k = rng_mix64(k ^ (stream * 0xd1b54a32d192ed03ULL + 0x632be59bd9b4e019ULL));
    return rng_mix64(k ^ (counter * 0x9e3779b97f4a7c15ULL + 0x2545f4914f6cdd1dULL));
}

#ifdef __cplusplus
extern "C" { /* kernels/ (CUDA C++) includes this header for rng_bits */
#endif

/* Uniform float in [0, 1) with 24 random bits. */
float rng_uniform(uint64_t seed, uint64_t stream, uint64_t counter);

/* Standard normal (Box-Muller on two draws at counters 2c and 2c+1). */
float rng_normal(uint64_t seed, uint64_t stream, uint64_t counter);

/* Uniform integer in [0, n) (n > 0), unbiased by rejection over successive counters from `counter`. */
uint64_t rng_below(uint64_t seed, uint64_t stream, uint64_t counter, uint64_t n);

#ifdef __cplusplus
}
#endif

#endif
