/*
 * dtype_simd.h — private to dtype.c: the vectorised conversion kernels of dtype_simd.c, and the loads and
 * stores at any alignment that both files' scalar loops use.
 *
 * Each path ("f16c", "avx512") is a table of kernels, one per pair of dtypes; a NULL entry means
 * "use the portable loop". A kernel converts n elements, handles its own tail and any alignment, and
 * must agree bit for bit with the portable scalar functions of dtype.c.
 */
#ifndef AMP_DTYPE_SIMD_H
#define AMP_DTYPE_SIMD_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Element i of an array at any address. A uint16_t or float access to a misaligned address is undefined (UBSan
 * reports it); memcpy of a constant size compiles to the same single load or store, aligned or not. */
static inline uint16_t dtype_ld_u16(const void *p, size_t i)
{
    uint16_t v;
    memcpy(&v, (const unsigned char *)p + i * sizeof v, sizeof v);
    return v;
}

static inline float dtype_ld_f32(const void *p, size_t i)
{
    float v;
    memcpy(&v, (const unsigned char *)p + i * sizeof v, sizeof v);
    return v;
}

static inline void dtype_st_u16(void *p, size_t i, uint16_t v)
{
    memcpy((unsigned char *)p + i * sizeof v, &v, sizeof v);
}

static inline void dtype_st_f32(void *p, size_t i, float v)
{
    memcpy((unsigned char *)p + i * sizeof v, &v, sizeof v);
}

typedef void dtype_simd_kernel_fn(void *dst, const void *src, size_t n);

struct dtype_simd_table {
    const char *name;                    /* as dtype_simd_path() reports it */
    dtype_simd_kernel_fn *fp32_to_fp16;  /* dst: uint16_t fp16 (n), src: float (n) */
    dtype_simd_kernel_fn *fp16_to_fp32;
    dtype_simd_kernel_fn *fp32_to_bf16;
    dtype_simd_kernel_fn *bf16_to_fp32;
    dtype_simd_kernel_fn *fp16_to_bf16;
    dtype_simd_kernel_fn *bf16_to_fp16;
};

/* The best path this CPU runs, or NULL when it has none (portable only). */
const struct dtype_simd_table *dtype_simd_best(void);

/* The path called `name`, or NULL when the name is unknown or this CPU lacks its instructions. */
const struct dtype_simd_table *dtype_simd_find(const char *name);

#endif
