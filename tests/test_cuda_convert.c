/*
 * test_cuda_convert.c — the GPU conversion kernels (kernels/cuda/convert.cu) against the portable CPU path
 * (lib/base/dtype.c), and the check macros of kernels/cuda/cuda_check.h.
 *
 * On a machine with a CUDA device: 10 M fresh seeded fp32 values plus the edge cases go through
 * cuda_convert to fp16 and bf16, and all 65,536 fp16 and bf16 patterns go back to fp32 and across to
 * the other 16-bit type; every result must equal dtype_convert_portable bit for bit, except that a NaN
 * only has to stay a NaN (the GPU returns a canonical NaN where x86 keeps payload bits; see dtype.h).
 * Without a device that test skips, saying so, and is never counted as passed: this file has its own
 * main, which exits 77 (CTest's SKIP_RETURN_CODE) when any test skipped and none failed. The argument
 * checks and the check-macro tests need no device and always run.
 * Built without the CUDA backend, the file holds one test that skips.
 */
#include <criterion/criterion.h>
#include <criterion/hooks.h>
#include <criterion/logging.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"    /* dtype_convert_portable, the reference */
#include "testbits.h" /* bits_of, float_of, rng_next */

#include "skip_main.h" /* main: exit 77 (Skipped) when tests skipped and none failed */

#ifdef AMP_HAVE_CUDA

#include <cuda_runtime_api.h>

#include "convert.h"    /* cuda_convert */
#include "cuda_check.h" /* CUDA_CHECK, CUBLAS_CHECK, CUDNN_CHECK */

#define N_RANDOM 10000000u

static const uint32_t edge_bits[] = {
    0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0xC77FF000, /* fp16 max, overflow boundary */
    0x38800000, 0x387FFFFF, 0x387FC000, 0x387FE000,             /* fp16 normal / subnormal boundary */
    0x33800000, 0x33000000, 0xB3000000, 0x33000001, 0x32FFFFFF, /* 2^-24, 2^-25 and neighbours */
    0x33C00000, 0x34200000, 0x3F801000, 0x3F803000, 0x3F808000, 0x3F818000, /* ties */
    0x7F7F0000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7FFFFF, /* bf16 max, overflow, FLT_MAX */
    0x00800000, 0x807FFFFF, 0x00000001, 0x00008000, 0x00018000, /* FLT_MIN, fp32 subnormals */
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000,             /* ±0, ±Inf */
    0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7FA00000, 0x7F802000,
    0x7F810000, /* NaNs, quiet and signalling */
};
#define N_EDGE (sizeof edge_bits / sizeof edge_bits[0])

/* Edge cases, then random bit patterns, random values around the fp16 range, and values within one
 * fp32 ulp of fp16 and bf16 rounding ties (normal fp16 only: subnormal ties are in the edge cases and
 * in tests/test_dtype.c). */
static float *make_values(size_t n)
{
    float *v = malloc(n * sizeof *v);
    cr_assert_not_null(v, "out of memory");
    uint64_t state = UINT64_C(0xC0DA5EED);
    for (size_t i = 0; i < n; i++) {
        uint64_t r = rng_next(&state);
        uint32_t sign = (uint32_t)(r >> 63) << 31;
        uint32_t delta = (uint32_t)((r >> 40) % 3) - 1; /* -1, 0, +1 in two's complement */
        if (i < N_EDGE) {
            v[i] = float_of(edge_bits[i]);
            continue;
        }
        switch (i % 4) {
        case 0: v[i] = float_of((uint32_t)r); break;
        case 1: v[i] = float_of(sign | ((127 - 27 + (uint32_t)((r >> 23) % 45)) << 23) | ((uint32_t)r & 0x7FFFFF)); break;
        case 2: { /* fp16 normal h = (e, m), 1 <= e <= 30: its fp32 has exponent e + 112, mantissa m << 13 */
            uint32_t e = 1 + (uint32_t)((r >> 10) % 30), m = (uint32_t)r & 0x3FF;
            v[i] = float_of(sign | ((((e + 112) << 23) | (m << 13)) + 0x1000 + delta));
            break;
        }
        default: v[i] = float_of(sign | (((uint32_t)(r % 0x7F80) << 16) + 0x8000 + delta)); break;
        }
    }
    return v;
}

static int is_nan_bits(enum dtype dt, uint32_t b)
{
    switch (dt) {
    case DT_FP16: return (b & 0x7C00) == 0x7C00 && (b & 0x03FF);
    case DT_BF16: return (b & 0x7F80) == 0x7F80 && (b & 0x007F);
    default: return (b & 0x7FFFFFFF) > 0x7F800000;
    }
}

/* Convert n elements of `src` (host) on the GPU into `out` (host), through device buffers that the
 * caller frees (so that a failing check, which returns at once, leaks nothing). */
static enum amp_status gpu_convert_through(void **d_dst, void **d_src, void *out, enum dtype dst_dt, const void *src,
                                           enum dtype src_dt, size_t n, struct amp_error *err)
{
    size_t src_bytes = n * dtype_size(src_dt), dst_bytes = n * dtype_size(dst_dt);
    CUDA_CHECK(cudaMalloc(d_src, src_bytes), err);
    CUDA_CHECK(cudaMalloc(d_dst, dst_bytes), err);
    CUDA_CHECK(cudaMemcpy(*d_src, src, src_bytes, cudaMemcpyHostToDevice), err);
    CUDA_CHECK((cudaError_t)cuda_convert(*d_dst, dst_dt, *d_src, src_dt, n, NULL), err);
    CUDA_CHECK(cudaDeviceSynchronize(), err);
    CUDA_CHECK(cudaMemcpy(out, *d_dst, dst_bytes, cudaMemcpyDeviceToHost), err);
    return AMP_OK;
}

static enum amp_status gpu_convert(void *out, enum dtype dst_dt, const void *src, enum dtype src_dt, size_t n,
                                   struct amp_error *err)
{
    void *d_dst = NULL, *d_src = NULL;
    enum amp_status status = gpu_convert_through(&d_dst, &d_src, out, dst_dt, src, src_dt, n, err);
    cudaFree(d_src);
    cudaFree(d_dst);
    return status;
}

/* The GPU result of src (n elements) against the portable CPU path. */
static void check_against_cpu(enum dtype dst_dt, const void *src, enum dtype src_dt, size_t n)
{
    size_t es = dtype_size(dst_dt);
    unsigned char *gpu = malloc(n * es), *cpu = malloc(n * es);
    cr_assert(gpu && cpu, "out of memory");
    struct amp_error err = {0};
    enum amp_status s = gpu_convert(gpu, dst_dt, src, src_dt, n, &err);
    cr_assert_eq(s, AMP_OK, "%s (hint: %s)", err.msg, err.hint);
    dtype_convert_portable(cpu, dst_dt, src, src_dt, n);
    size_t mismatches = 0, nan_payload_differences = 0, first = 0;
    uint32_t first_gpu = 0, first_cpu = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t g = 0, c = 0;
        memcpy(&g, gpu + i * es, es);
        memcpy(&c, cpu + i * es, es);
        if (g == c)
            continue;
        if (is_nan_bits(dst_dt, c) && is_nan_bits(dst_dt, g)) {
            nan_payload_differences++;
            continue;
        }
        if (mismatches++ == 0) {
            first = i;
            first_gpu = g;
            first_cpu = c;
        }
    }
    uint32_t first_src = 0;
    if (mismatches)
        memcpy(&first_src, (const unsigned char *)src + first * dtype_size(src_dt), dtype_size(src_dt));
    cr_assert_eq(mismatches, 0, "%s -> %s: %zu of %zu differ; first [%zu] src 0x%X: GPU 0x%X, CPU 0x%X",
                 dtype_name(src_dt), dtype_name(dst_dt), mismatches, n, first, first_src, first_gpu, first_cpu);
    cr_log_info("%s -> %s: %zu values bit-identical to the CPU (%zu NaNs with a different payload)",
                dtype_name(src_dt), dtype_name(dst_dt), n - nan_payload_differences, nan_payload_differences);
    free(gpu);
    free(cpu);
}

static int cuda_device_present(void)
{
    int count = 0;
    return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

Test(cuda_convert, matches_the_cpu_bit_for_bit, .timeout = 300)
{
    if (!cuda_device_present())
        cr_skip_test("no CUDA device (cudaGetDeviceCount failed or found none): the GPU conversions "
                     "were not run");
    size_t n = N_EDGE + N_RANDOM;
    float *values = make_values(n);
    check_against_cpu(DT_FP16, values, DT_FP32, n);
    check_against_cpu(DT_BF16, values, DT_FP32, n);
    free(values);

    uint16_t *patterns = malloc(65536 * sizeof *patterns);
    cr_assert_not_null(patterns, "out of memory");
    for (uint32_t p = 0; p <= 0xFFFF; p++)
        patterns[p] = (uint16_t)p;
    check_against_cpu(DT_FP32, patterns, DT_FP16, 65536);
    check_against_cpu(DT_FP32, patterns, DT_BF16, 65536);
    check_against_cpu(DT_BF16, patterns, DT_FP16, 65536);
    check_against_cpu(DT_FP16, patterns, DT_BF16, 65536);
    check_against_cpu(DT_FP16, patterns, DT_FP16, 65536); /* a copy */
    free(patterns);
}

/* ---- no device needed ----------------------------------------------------------------------------- */

Test(cuda_convert, rejects_bad_arguments_without_touching_the_gpu)
{
    cr_assert_eq(cuda_convert(NULL, DT_FP16, NULL, DT_FP32, 0, NULL), (int)cudaSuccess, "n = 0 is a no-op");
    cr_assert_eq(cuda_convert(NULL, DT_FP16, NULL, DT_FP32, 8, NULL), (int)cudaErrorInvalidValue);
    cr_assert_eq(cuda_convert(NULL, DT_COUNT, NULL, DT_FP32, 8, NULL), (int)cudaErrorInvalidValue);
    cr_assert_eq(cuda_convert(NULL, DT_FP16, NULL, (enum dtype)7, 0, NULL), (int)cudaErrorInvalidValue);
}

static int line_of_last_check;

static enum amp_status cuda_step(cudaError_t result, struct amp_error *err)
{
    line_of_last_check = __LINE__ + 1;
    CUDA_CHECK(result, err);
    return AMP_OK;
}

static enum amp_status cublas_step(cublasStatus_t result, struct amp_error *err)
{
    line_of_last_check = __LINE__ + 1;
    CUBLAS_CHECK(result, err);
    return AMP_OK;
}

static enum amp_status cudnn_step(cudnnStatus_t result, struct amp_error *err)
{
    line_of_last_check = __LINE__ + 1;
    CUDNN_CHECK(result, err);
    return AMP_OK;
}

static void assert_filled(const struct amp_error *err, const char *name, const char *hint_part)
{
    char where[64];
    snprintf(where, sizeof where, "test_cuda_convert.c:%d: ", line_of_last_check);
    cr_assert_eq(err->code, AMP_ERR_INTERNAL);
    cr_assert(strstr(err->msg, where), "message \"%s\" should name %s", err->msg, where);
    cr_assert(strstr(err->msg, name), "message \"%s\" should name %s", err->msg, name);
    cr_assert(strstr(err->msg, "in result"), "message \"%s\" should quote the call", err->msg);
    cr_assert(strstr(err->hint, hint_part), "hint \"%s\" should mention %s", err->hint, hint_part);
}

Test(cuda_convert, check_macros_fill_the_error_and_return_internal)
{
    struct amp_error err = {0};
    cr_assert_eq(cuda_step(cudaSuccess, &err), AMP_OK);
    cr_assert_eq(err.code, AMP_OK, "success leaves the error alone");
    cr_assert_eq(err.msg[0], '\0');

    cr_assert_eq(cuda_step(cudaErrorMemoryAllocation, &err), AMP_ERR_INTERNAL);
    assert_filled(&err, "cudaErrorMemoryAllocation", "batch_size");
    cr_assert_eq(cuda_step(cudaErrorLaunchFailure, &err), AMP_ERR_INTERNAL);
    assert_filled(&err, "cudaErrorLaunchFailure", "CUDA_LAUNCH_BLOCKING=1");

    cr_assert_eq(cublas_step(CUBLAS_STATUS_SUCCESS, &err), AMP_OK);
    cr_assert_eq(cublas_step(CUBLAS_STATUS_ALLOC_FAILED, &err), AMP_ERR_INTERNAL);
    assert_filled(&err, "CUBLAS_STATUS_ALLOC_FAILED", "batch_size");
    cr_assert_eq(cublas_step(CUBLAS_STATUS_INVALID_VALUE, &err), AMP_ERR_INTERNAL);
    assert_filled(&err, "cuBLAS error", "CUBLASLT_LOG_MASK");

    cr_assert_eq(cudnn_step(CUDNN_STATUS_SUCCESS, &err), AMP_OK);
    cr_assert_eq(cudnn_step(CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE, &err), AMP_ERR_INTERNAL);
    assert_filled(&err, "cuDNN error 3003", "precision");
    cr_assert_eq(cudnn_step(CUDNN_STATUS_BAD_PARAM, &err), AMP_ERR_INTERNAL);
    assert_filled(&err, "cuDNN error 2000", "CUDNN_LOGLEVEL_DBG");

    cr_assert_eq(cuda_step(cudaErrorInvalidValue, NULL), AMP_ERR_INTERNAL, "a NULL error struct is allowed");
}

#else /* built without the CUDA backend */

Test(cuda_convert, needs_the_cuda_backend)
{
    cr_skip_test("the CUDA backend is not built (no nvcc or cuDNN found, or -DAMP_CUDA=OFF): "
                 "kernels/cuda/convert.cu was not tested");
}

#endif
