/*
 * digest.h — FNV-1a, 64 bits: the digests ranks compare to find that they were given different things (the
 * resolved config, the command, a checkpoint, the data, a host's name, a replica's tensors). Not a checksum
 * against damage (checkpoints carry CRC-32) and not cryptographic: equal inputs give equal digests, and
 * different ones differ but for a 2^-64 chance.
 */
#ifndef AMP_DIGEST_H
#define AMP_DIGEST_H

#include <stddef.h>
#include <stdint.h>

#define DIGEST_INIT UINT64_C(1469598103934665603)

/* h extended by the n bytes at p (start from DIGEST_INIT). */
static inline uint64_t digest_bytes(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * UINT64_C(1099511628211);
    return h;
}

/* h extended by a string's bytes (without its terminator). */
static inline uint64_t digest_str(uint64_t h, const char *s)
{
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * UINT64_C(1099511628211);
    return h;
}

/* h extended by one 64-bit value (its bytes in memory order: compare digests within one job's hosts). */
static inline uint64_t digest_u64(uint64_t h, uint64_t v)
{
    return digest_bytes(h, &v, sizeof v);
}

#endif
