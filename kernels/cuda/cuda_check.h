/*
 * cuda_check.h — one check macro per GPU library: CUDA_CHECK (runtime), CUBLAS_CHECK, CUDNN_CHECK.
 *
 *     enum amp_status upload(float *d, const float *h, size_t n, struct amp_error *err)
 *     {
 *         CUDA_CHECK(cudaMemcpy(d, h, n * sizeof *h, cudaMemcpyHostToDevice), err);
 *         return AMP_OK;
 *     }
 *
 * On failure a macro fills `err` (struct amp_error *, may be NULL) with "FILE:LINE: <library> error
 * NAME (description) in <the call>" and a hint saying what to try next, then returns AMP_ERR_INTERNAL
 * from the enclosing function, which must therefore return enum amp_status (or int). No exit():
 * cmd/ decides what a failure means for the process. Usable from C and from CUDA C++.
 */
#ifndef AMP_CUDA_CHECK_H
#define AMP_CUDA_CHECK_H

#include <cublas_v2.h>        /* cublasStatus_t, cublasGetStatusName, cublasGetStatusString */
#include <cuda_runtime_api.h> /* cudaError_t, cudaGetErrorName, cudaGetErrorString */
#include <cudnn.h>            /* cudnnStatus_t, cudnnGetErrorString */

#include "error.h" /* struct amp_error, amp_fail, AMP_ERR_INTERNAL (C linkage) */

static inline const char *amp_cuda_hint(cudaError_t status)
{
    switch (status) {
    case cudaErrorMemoryAllocation:
        return "the GPU ran out of memory: lower data.batch_size, or check with nvidia-smi that no other "
               "process holds the GPU";
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
        return "no usable CUDA device: check nvidia-smi, the driver version and CUDA_VISIBLE_DEVICES, or set "
               "run.device: cpu";
    case cudaErrorNoKernelImageForDevice:
        return "this build has no code for this GPU: rebuild with its architecture in CMAKE_CUDA_ARCHITECTURES";
    default:
        return "rerun with CUDA_LAUNCH_BLOCKING=1 to pin the error to the failing call, or under "
               "compute-sanitizer to name the kernel";
    }
}

static inline const char *amp_cublas_hint(cublasStatus_t status)
{
    switch (status) {
    case CUBLAS_STATUS_ALLOC_FAILED:
        return "cuBLAS ran out of GPU memory: lower data.batch_size";
    case CUBLAS_STATUS_NOT_INITIALIZED:
        return "cuBLAS could not start: usually no usable GPU or no free GPU memory; check nvidia-smi";
    case CUBLAS_STATUS_ARCH_MISMATCH:
        return "this GPU lacks the feature the call needs (bf16 matmuls need sm_80 or newer): use fp16 or "
               "fp32 precision on this GPU";
    default:
        return "rerun with CUBLASLT_LOG_MASK=15 (errors, traces of each call, hints, information) to see the call "
               "cuBLASLt rejected";
    }
}

static inline const char *amp_cudnn_hint(cudnnStatus_t status)
{
    switch (CUDNN_STATUS_CATEGORY(status)) {
    case CUDNN_STATUS_NOT_SUPPORTED:
        return "cuDNN has no kernel for this layer's shape, dtype or layout on this GPU: try another "
               "precision mode, or set run.device: cpu to confirm the model itself is valid";
    case CUDNN_STATUS_INTERNAL_ERROR:
        if (status == CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED)
            return "cuDNN ran out of GPU memory: lower data.batch_size";
        break;
    default:
        break;
    }
    return "rerun with CUDNN_LOGLEVEL_DBG=2 CUDNN_LOGDEST_DBG=stderr to see why cuDNN refused the call";
}

/* The status variables carry a trailing underscore so that they cannot capture names in `call`. */
#define CUDA_CHECK(call, err)                                                                                 \
    do {                                                                                                      \
        cudaError_t amp_cuda_status_ = (call);                                                                \
        if (amp_cuda_status_ != cudaSuccess)                                                                  \
            return amp_fail((err), AMP_ERR_INTERNAL, amp_cuda_hint(amp_cuda_status_),                         \
                            "%s:%d: CUDA error %s (%s) in %s", __FILE__, __LINE__,                            \
                            cudaGetErrorName(amp_cuda_status_), cudaGetErrorString(amp_cuda_status_), #call); \
    } while (0)

#define CUBLAS_CHECK(call, err)                                                                              \
    do {                                                                                                     \
        cublasStatus_t amp_cublas_status_ = (call);                                                          \
        if (amp_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                                     \
            return amp_fail((err), AMP_ERR_INTERNAL, amp_cublas_hint(amp_cublas_status_),                    \
                            "%s:%d: cuBLAS error %s (%s) in %s", __FILE__, __LINE__,                         \
                            cublasGetStatusName(amp_cublas_status_), cublasGetStatusString(amp_cublas_status_), \
                            #call);                                                                          \
    } while (0)

#define CUDNN_CHECK(call, err)                                                                                \
    do {                                                                                                      \
        cudnnStatus_t amp_cudnn_status_ = (call);                                                             \
        if (amp_cudnn_status_ != CUDNN_STATUS_SUCCESS)                                                        \
            return amp_fail((err), AMP_ERR_INTERNAL, amp_cudnn_hint(amp_cudnn_status_),                       \
                            "%s:%d: cuDNN error %d (%s) in %s", __FILE__, __LINE__, (int)amp_cudnn_status_,   \
                            cudnnGetErrorString(amp_cudnn_status_), #call);                                   \
    } while (0)

#endif
