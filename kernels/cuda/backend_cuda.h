/*
 * backend_cuda.h — CUDA-only extras beside the backend table of lib/backend.h.
 *
 * backend_cuda_create / backend_cuda_device_count are declared in backend.h (AMP_HAVE_CUDA builds).
 * Here: the peak device memory seen by the backend and the device's description. (precision.tf32 is
 * the backend table's allow_tf32 field.)
 */
#ifndef AMP_BACKEND_CUDA_H
#define AMP_BACKEND_CUDA_H

#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

struct backend;

/* Highest device memory in use (bytes, all processes on the device, from cudaMemGetInfo) seen after
 * any allocation by this backend. Also printed to stderr at destroy when AMP_CUDA_MEMLOG=1. */
size_t backend_cuda_peak_bytes(struct backend *be);

/* "NVIDIA H200, sm_90" for device `device_index` into buf (lib/backend.c's "device:" line); 0, or -1
 * when the device cannot be queried. */
int backend_cuda_describe(int device_index, char *buf, size_t len);

/* "CUDA loaded: driver 13.0, runtime 13.0, cuBLASLt 130100, cuDNN 9.19.0; 1 GPU, GPU 0: NVIDIA H200, compute
 * capability 9.0": the versions actually loaded and the first GPU, for --version and gpu-check. */
void backend_cuda_versions(char *buf, size_t len);

#ifdef __cplusplus
}
#endif

#endif
