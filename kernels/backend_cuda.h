/*
 * backend_cuda.h — CUDA-only extras beside the backend table of lib/backend.h.
 *
 * backend_cuda_create / backend_cuda_device_count are declared in backend.h (AMP_HAVE_CUDA builds).
 * Here: the switch for precision.tf32 (fp32 GEMMs and convolutions may then use TF32 tensor cores;
 * off by default, so fp32 means IEEE fp32 products) and the peak device memory seen by the backend.
 */
#ifndef AMP_BACKEND_CUDA_H
#define AMP_BACKEND_CUDA_H

#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

struct backend;

/* Allow TF32 for fp32 matrix products and convolutions from now on (precision.tf32). `be` must be a
 * CUDA backend (its name starts with "cuda"). */
void backend_cuda_set_tf32(struct backend *be, bool on);

/* Highest device memory in use (bytes, all processes on the device, from cudaMemGetInfo) seen after
 * any allocation by this backend. Also printed to stderr at destroy when AMP_CUDA_MEMLOG=1. */
size_t backend_cuda_peak_bytes(struct backend *be);

/* "NVIDIA H200, sm_90" for device `device_index` into buf (lib/backend.c's "device:" line); 0, or -1
 * when the device cannot be queried. */
int backend_cuda_describe(int device_index, char *buf, size_t len);

#ifdef __cplusplus
}
#endif

#endif
