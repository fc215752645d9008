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

/* 64 random bits for (seed, stream, counter). */
uint64_t rng_bits(uint64_t seed, uint64_t stream, uint64_t counter);

/* Uniform float in [0, 1) with 24 random bits. */
float rng_uniform(uint64_t seed, uint64_t stream, uint64_t counter);

/* Standard normal (Box-Muller on two draws at counters 2c and 2c+1). */
float rng_normal(uint64_t seed, uint64_t stream, uint64_t counter);

/* Uniform integer in [0, n) (n > 0), unbiased by rejection over successive counters from `counter`. */
uint64_t rng_below(uint64_t seed, uint64_t stream, uint64_t counter, uint64_t n);

#endif
