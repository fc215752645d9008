/*
 * convert.cu — dtype conversion kernels: fp32 <-> fp16 / bf16 and fp16 <-> bf16 on device buffers.
 *
 * One templated elementwise kernel, instantiated per pair of dtypes: each thread reads src[i] (read
 * only), widens it to fp32 exactly, narrows it with round-to-nearest-even (__float2half_rn /
 * __float2bfloat16_rn: overflow to ±Inf, subnormals kept, no flush to zero) and overwrites dst[i].
 * A grid-stride loop covers any n with a bounded grid. The CPU definition of the same conversions is
 * lib/base/dtype.c; tests/test_cuda_convert.c compares the two bit for bit.
 */
#include "convert.h"

#include <cuda_bf16.h> /* __nv_bfloat16, __float2bfloat16_rn, __bfloat162float */
#include <cuda_fp16.h> /* __half, __float2half_rn, __half2float */

namespace {

constexpr unsigned kThreadsPerBlock = 256;
constexpr size_t kMaxBlocks = 8192; /* enough to fill an H100 many times over; the loop does the rest */

__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ float widen(__half x) { return __half2float(x); }
__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T narrow(float x);
template <> __device__ __forceinline__ float narrow<float>(float x) { return x; }
template <> __device__ __forceinline__ __half narrow<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 narrow<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

/* dst: Dst (n), overwritten; src: Src (n), read. */
template <typename Dst, typename Src>
__global__ void convert_elementwise_kernel(Dst *__restrict__ dst, const Src *__restrict__ src, size_t n)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = narrow<Dst>(widen(src[i]));
}

template <typename Dst, typename Src>
int launch_convert(void *dst, const void *src, size_t n, cudaStream_t stream)
{
    size_t blocks = (n + kThreadsPerBlock - 1) / kThreadsPerBlock;
    if (blocks > kMaxBlocks)
        blocks = kMaxBlocks;
    convert_elementwise_kernel<Dst, Src><<<(unsigned)blocks, kThreadsPerBlock, 0, stream>>>(
        static_cast<Dst *>(dst), static_cast<const Src *>(src), n);
    return (int)cudaGetLastError();
}

} // namespace

extern "C" int cuda_convert(void *dst, enum dtype dst_dt, const void *src, enum dtype src_dt, size_t n,
                            cudaStream_t stream)
{
    if (dst_dt >= DT_COUNT || src_dt >= DT_COUNT)
        return (int)cudaErrorInvalidValue;
    if (n == 0)
        return (int)cudaSuccess;
    if (!dst || !src)
        return (int)cudaErrorInvalidValue;
    if (dst_dt == src_dt) {
        if (dst == src)
            return (int)cudaSuccess;
        return (int)cudaMemcpyAsync(dst, src, n * dtype_size(dst_dt), cudaMemcpyDeviceToDevice, stream);
    }
    switch (src_dt * DT_COUNT + dst_dt) {
    case DT_FP32 * DT_COUNT + DT_FP16: return launch_convert<__half, float>(dst, src, n, stream);
    case DT_FP32 * DT_COUNT + DT_BF16: return launch_convert<__nv_bfloat16, float>(dst, src, n, stream);
    case DT_FP16 * DT_COUNT + DT_FP32: return launch_convert<float, __half>(dst, src, n, stream);
    case DT_BF16 * DT_COUNT + DT_FP32: return launch_convert<float, __nv_bfloat16>(dst, src, n, stream);
    case DT_FP16 * DT_COUNT + DT_BF16: return launch_convert<__nv_bfloat16, __half>(dst, src, n, stream);
    case DT_BF16 * DT_COUNT + DT_FP16: return launch_convert<__half, __nv_bfloat16>(dst, src, n, stream);
    default: return (int)cudaErrorInvalidValue;
    }
}
