/*
 * gemm_bf16.h — private to backend_cpu.c: the AVX512-BF16 matrix product of gemm_bf16.c.
 *
 * C (m, n) = alpha * op(A) @ op(B) + beta * C [+ bias (n) on every row], A and B bf16, row-major,
 * products accumulated in fp32 by vdpbf16ps, C fp32 or bf16 (rounded once, to nearest-even, after
 * alpha, beta and the bias — the same epilogue as the portable cblas_sgemm path). beta 0 never reads
 * C. Deviation from the portable path: vdpbf16ps treats bf16 subnormal inputs as zero and flushes
 * subnormal fp32 partial sums to zero (DAZ/FTZ), besides summing in another order. See
 * docs/backend.md, "bf16 GEMM on the CPU".
 */
#ifndef AMP_GEMM_BF16_H
#define AMP_GEMM_BF16_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct gemm_bf16_args {
    bool ta, tb;          /* op(A) = A^T (A is (k, m)); op(B) = B^T (B is (n, k)) */
    int64_t m, n, k;      /* m, n, k >= 1 */
    float alpha, beta;
    const uint16_t *a;    /* bf16 bits, leading dimension lda */
    int64_t lda;
    const uint16_t *b;
    int64_t ldb;
    void *c;              /* fp32, or bf16 bits when c_bf16 */
    bool c_bf16;
    int64_t ldc;
    const float *bias;    /* NULL or fp32 (n); needs beta 0 */
};

/* Scratch sizes for one call of gemm_bf16 with these dimensions: the packed panels of op(A) and
 * op(B), and the fp32 partial sums (m * n floats, leading dimension n; 0 when k fits one block). */
struct gemm_bf16_scratch {
    size_t pack_a_bytes, pack_b_bytes, partial_bytes;
};

/* True when this build and this CPU run gemm_bf16 (x86-64 with AVX-512F/BW/VL and AVX512-BF16). */
bool gemm_bf16_supported(void);

void gemm_bf16_scratch_sizes(int64_t m, int64_t n, int64_t k, struct gemm_bf16_scratch *s);

/* The product. pack_a, pack_b: 64-byte-aligned buffers of the sizes above; partial: NULL when
 * partial_bytes is 0. Only call when gemm_bf16_supported(). */
void gemm_bf16(const struct gemm_bf16_args *g, void *pack_a, void *pack_b, float *partial);

#endif
