/*
 * gemm_avx512.h — private to the CPU backend (gemm.c, conv.c, attention.c): the AVX-512 matrix products of
 * gemm_avx512.c.
 *
 * C (m, n) = alpha * op(A) @ op(B) + beta * C [+ bias (n) on every row, or + row_bias (m) on every column],
 * A and B row-major and of one
 * dtype, products accumulated in fp32, C fp32 or the inputs' 16-bit dtype (rounded once, to
 * nearest-even, after alpha, beta and the bias — the same epilogue as the portable cblas_sgemm path).
 * beta 0 never reads C. By input dtype:
 *   fp32, fp16  AVX-512F FMA (fp16 widened exactly while packing): IEEE fp32 arithmetic, subnormals
 *               kept; differs from the portable path only in summation order.
 *   bf16        AVX512-BF16 vdpbf16ps, or AMX tdpbf16ps where the CPU has AMX-BF16 and `amx` is set:
 *               both treat bf16 subnormal inputs as zero and flush subnormal fp32 partial sums to zero
 *               (DAZ/FTZ). Their sums differ in order: vdpbf16ps adds each product to the running sum in
 *               turn, tdpbf16ps adds each pair's two products first and groups the pairs of one tile; so
 *               the two paths give different bits, each of them independent of the thread count.
 * See docs/backend.md, "AVX-512 GEMM on the CPU".
 */
#ifndef AMP_GEMM_AVX512_H
#define AMP_GEMM_AVX512_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dtype.h" /* enum dtype */

struct gemm_avx512_args {
    enum dtype in;        /* dtype of A and B */
    bool amx;             /* bf16: AMX tiles (only where gemm_avx512_amx_supported()); else ignored */
    bool ta, tb;          /* op(A) = A^T (A is (k, m)); op(B) = B^T (B is (n, k)) */
    int64_t m, n, k;      /* m, n, k >= 1 */
    float alpha, beta;
    const void *a;        /* leading dimension lda */
    int64_t lda;
    const void *b;
    int64_t ldb;
    void *c;              /* DT_FP32, or `in` when that is 16-bit */
    enum dtype c_dt;
    int64_t ldc;
    const float *bias;    /* NULL or fp32 (n); needs beta 0 */
    const float *row_bias;/* NULL or fp32 (m): row i's elements take row_bias[i] as bias takes bias[j] (a
                           * convolution's per-channel bias); needs beta 0 and no bias */
    bool relu;            /* C = relu(the finished value) before its rounding (backend.h GEMM_EPI_RELU) */
    const void *relu_mask;/* NULL or (m, n) of c_dt, leading dimension ldr: C's element is +0 where the mask's
                           * does not pass ReLU (backend.h GEMM_EPI_RELU_MASK) */
    int64_t ldr;
};

/* Scratch sizes for one call with these dimensions: the packed panels of op(A) and op(B), and the
 * fp32 partial sums (m * n floats, leading dimension n; 0 when k fits one block). */
struct gemm_avx512_scratch {
    size_t pack_a_bytes, pack_b_bytes, partial_bytes;
};

/* True when this build and this CPU run gemm_avx512 for inputs of dtype `in`: x86-64 with
 * AVX-512F/BW/VL, plus AVX512-BF16 for bf16. */
bool gemm_avx512_supported(enum dtype in);

/* Whether the n x m product C^T = op(B)^T op(A)^T (the same k) pads the microkernel's tiles to at most half the
 * area that C = op(A) op(B) (m x n) pads them to: a caller with a thin C (few columns: a convolution's filter
 * gradient over few input channels) forms C^T and transposes it. For fp32 and fp16 inputs the two give every
 * element the same bits: its FMAs take the same pairs of factors (an FMA's two factors commute) over the same k
 * blocks in the same order. Never for bf16 (the grouping of its pair sums was not checked with the operands
 * swapped). */
bool gemm_avx512_transposed_fits(enum dtype in, int64_t m, int64_t n);

/* True when this CPU has AMX-BF16 and the kernel lets this process use it (asked once, arch_prctl). */
bool gemm_avx512_amx_supported(void);

/* amx: as gemm_avx512_args.amx (the panels are laid out for the tiles). */
void gemm_avx512_scratch_sizes(enum dtype in, bool amx, int64_t m, int64_t n, int64_t k,
                               struct gemm_avx512_scratch *s);

/* The product. pack_a, pack_b: 64-byte-aligned buffers of the sizes above; partial: NULL when
 * partial_bytes is 0, or when C is fp32, beta 0 and there is no bias (C itself then holds the
 * partial sums; a row_bias, like beta 0, never reads C, so it allows that too). Only call when gemm_avx512_supported(g->in). */
void gemm_avx512(const struct gemm_avx512_args *g, void *pack_a, void *pack_b, float *partial);

/* The same product on a thread pool (threadpool.h), with the same bits, shared out as gemm_avx512_plan says
 * (from the shape alone; gemm_avx512.c describes the three ways): plan->chunks chunks (worth the pool only
 * when more than one); each worker w packs into its own pack_a[w] (plan->worker_a_bytes) and pack_b[w]
 * (plan->worker_b_bytes, when not 0), and into the shared shared_b (plan->shared_b_bytes, when not 0). */
#define GEMM_AVX512_MAX_BANDS 32
enum gemm_avx512_split { GEMM_SPLIT_BANDS, GEMM_SPLIT_BANDS_WHOLE_B, GEMM_SPLIT_COLUMNS };
struct gemm_avx512_plan {
    enum gemm_avx512_split split;
    int64_t chunks;
    size_t worker_a_bytes, worker_b_bytes, shared_b_bytes;
};
struct threadpool;
void gemm_avx512_plan(enum dtype in, bool amx, int64_t m, int64_t n, int64_t k, struct gemm_avx512_plan *p);
void gemm_avx512_threaded(const struct gemm_avx512_args *g, const struct gemm_avx512_plan *plan,
                          struct threadpool *pool, void *const *pack_a, void *const *pack_b, void *shared_b,
                          float *partial);

#endif
