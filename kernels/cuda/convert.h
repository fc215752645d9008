/*
 * convert.h — fp32 <-> fp16 / bf16 conversion of device buffers on the GPU.
 *
 * The GPU twin of dtype_convert (lib/base/dtype.h): every element is rounded to nearest, ties to even, by
 * __float2half_rn / __float2bfloat16_rn; widening is exact; fp16 <-> bf16 goes through fp32, as on the
 * CPU. tests/test_cuda_convert.c holds the results to the portable CPU path bit for bit (NaNs: NaN).
 */
#ifndef AMP_CONVERT_H
#define AMP_CONVERT_H

#include <stddef.h>

#include <cuda_runtime_api.h> /* cudaStream_t, cudaError_t */

#include "dtype.h" /* enum dtype, dtype_size */

#ifdef __cplusplus
extern "C" {
#endif

/* Convert n elements of the device buffer src (src_dt) into the device buffer dst (dst_dt),
 * asynchronously on `stream`. Same dtype: a device-to-device copy. The buffers must not overlap
 * unless dst == src with the same dtype. Returns a cudaError_t as int: cudaSuccess (0), or the
 * launch error; cudaErrorInvalidValue for a NULL pointer with n > 0 or an unknown dtype. Errors
 * raised while the kernel runs surface at the next synchronisation, as usual in CUDA. */
int cuda_convert(void *dst, enum dtype dst_dt, const void *src, enum dtype src_dt, size_t n, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
