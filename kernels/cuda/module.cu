/*
 * module.cu — the one symbol libamp_cuda.so exports (kernels/cuda/module.map): the table through which
 * lib/base/device_module.c reaches the CUDA backend and the NCCL communicator. Everything else in the
 * module, our copies of lib/'s error, dtype and tensor helpers included, stays local to it.
 */
#include "backend.h"       /* struct backend: its size is checked by the loader */
#include "backend_cuda.h"  /* cuda_device_count, cuda_backend_create, ..., nccl_comm_use */
#include "device_module.h" /* struct device_module, DEVICE_MODULE_ABI */

static const struct device_module cuda_module = {
    DEVICE_MODULE_ABI,
    sizeof(struct backend),
    cuda_device_count,
    cuda_backend_create,
    cuda_describe,
    cuda_versions,
#ifdef AMP_HAVE_NCCL
    nccl_comm_use,
    nccl_comm_release,
    nccl_version_line,
#else
    nullptr,
    nullptr,
    nullptr,
#endif
};

extern "C" __attribute__((visibility("default"))) const struct device_module *amp_device_module_cuda(void)
{
    return &cuda_module;
}
