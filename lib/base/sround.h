/*
 * sround.h — stochastic rounding of fp32 values to bf16, with the random bits of lib/base/rng.h.
 *
 * Rounding x stochastically picks one of the two bf16 values around it with probabilities that make
 * the expected result x: adding 16 uniform random bits to x's low 16 bits and truncating rounds up
 * with probability (x - down) / (up - down). An update smaller than half a bf16 ulp, which nearest
 * rounding always drops, so survives on average (docs/precision.md, "bf16 master weights").
 * Inf stays Inf and NaN stays NaN (as bf16_from_fp32 makes it); a value within one ulp below bf16's
 * largest finite one may round up to Inf, as nearest rounding does above it.
 *
 * The bits: one 64-bit draw per element and optimizer step. Each parameter's stream at step t starts from
 * key = rng_bits(sr_seed(run.seed), sr_stream(t, param), 0) (t the 1-based optimizer step, param the
 * parameter's index in the model), and element i draws SplitMix64's output i of the sequence from key,
 * sr_bits(key, i): one mixing per element. Bits 0-15 round the weight, 16-31 AdamW's m (or SGD's momentum
 * buffer), 32-47 v.
 * Nothing depends on the rank (every replica rounds alike) or on a generator's state (a resumed run
 * draws what an uninterrupted one would). One definition for the host and every device (AMP_HD).
 */
#ifndef AMP_SROUND_H
#define AMP_SROUND_H

#include <stdint.h>
#include <string.h>

#include "amp_hd.h" /* AMP_HD */
#include "rng.h"    /* rng_bits */

enum { SR_WEIGHT = 0, SR_M = 16, SR_V = 32 }; /* the shift of each tensor's 16 bits in an element's draw */

/* The seed of the rounding streams: run.seed, kept apart from the streams that init and dropout draw from. */
AMP_HD static inline uint64_t sr_seed(uint64_t run_seed)
{
    return run_seed ^ 0x53524f554e440000ULL; /* "SROUND" */
}

/* The stream of parameter `param` (< 2^24) at optimizer step t (1-based, < 2^40). */
AMP_HD static inline uint64_t sr_stream(int64_t t, uint32_t param)
{
    return ((uint64_t)t << 24) | (param & 0xFFFFFFu);
}

/* The key of parameter `param`'s stream at optimizer step t. */
AMP_HD static inline uint64_t sr_key(uint64_t seed, int64_t t, uint32_t param)
{
    return rng_bits(seed, sr_stream(t, param), 0);
}

/* Element i's 64 random bits in the stream of `key` (SplitMix64: a Weyl sequence through its finaliser). */
AMP_HD static inline uint64_t sr_bits(uint64_t key, uint64_t i)
{
    return rng_mix64(key + (i + 1) * 0x9e3779b97f4a7c15ULL);
}

/* x rounded to bf16 with the 16 random bits r (uniform in [0, 65536)). */
AMP_HD static inline uint16_t bf16_round_stochastic(float x, uint32_t r)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7F800000u) == 0x7F800000u) /* Inf stays, NaN made quiet as bf16_from_fp32 does */
        return (uint16_t)((u >> 16) | ((u & 0x007FFFFFu) ? 0x0040u : 0u));
    return (uint16_t)((u + (r & 0xFFFFu)) >> 16);
}

#endif
