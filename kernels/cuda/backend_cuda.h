/*
 * backend_cuda.h — the CUDA backend's entry points, for kernels/cuda/module.cu (the table that
 * libamp_cuda.so exports to lib/base/device_module.c) and for the backend's own translation units.
 * lib/ never includes this header: the engine reaches these through struct device_module only.
 */
#ifndef AMP_BACKEND_CUDA_H
#define AMP_BACKEND_CUDA_H

#include <stdbool.h>
#include <stddef.h>

#include "error.h" /* enum amp_status, struct amp_error */

#ifdef __cplusplus
extern "C" {
#endif

struct backend;
struct comm;

/* The CUDA devices the runtime sees; 0 without a driver or a device (never an error). */
int cuda_device_count(void);

/* The backend on device `device_index` (0 .. cuda_device_count() - 1): a stream, cuBLASLt, cuDNN. */
enum amp_status cuda_backend_create(struct backend **out, int device_index, struct amp_error *err);

/* "NVIDIA H200, sm_90" for device `device_index` into buf (lib/base/backend.c's "device:" line); 0, or -1
 * when the device cannot be queried. */
int cuda_describe(int device_index, char *buf, size_t len);

/* "CUDA loaded: driver 13.0, runtime 13.0, cuBLASLt 130100, cuDNN 9.19.0; 1 GPU, GPU 0: NVIDIA H200, compute
 * capability 9.0": the versions actually loaded and the first GPU, for --version and gpu-check. */
void cuda_versions(char *buf, size_t len);

/* Highest device memory in use (bytes, all processes on the device, from cudaMemGetInfo) seen after
 * any allocation by this backend. Also printed to stderr at destroy when AMPTRAIN_CUDA_MEMLOG=1. */
size_t backend_cuda_peak_bytes(struct backend *be);

/* kernels/cuda/comm_nccl.cu (AMP_HAVE_NCCL builds): lib/base/comm.h's comm_use_nccl, comm_release_nccl and
 * comm_nccl_version, reached through the module table. */
enum amp_status nccl_comm_use(struct comm *c, struct backend *be, struct amp_error *err);
void nccl_comm_release(struct comm *c);
const char *nccl_version_line(void);

#ifdef __cplusplus
}
#endif

#endif
