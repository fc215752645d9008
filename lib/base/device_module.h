/*
 * device_module.h — a device backend built as a loadable module, opened on first use.
 *
 * The CUDA backend (kernels/cuda/, with the NCCL communicator) is built as libamp_cuda.so, not into the
 * ampTrain binary: cuBLASLt, cuDNN and NCCL (about 156 MB mapped) are then loaded only when a CUDA
 * device is used, and a CPU run of a CUDA-enabled build maps none of them. The module exports one
 * function, DEVICE_MODULE_SYMBOL, returning the table below; lib/base/backend.c (the backend factory) and
 * lib/base/comm.c (the NCCL switch) call the device through it and nothing else.
 *
 * Where the module is: $AMPTRAIN_CUDA_MODULE (a path), else libamp_cuda.so in the directory of the
 * running executable (the build directory; scripts/gpu/gpu-bundle.sh packs it beside ampTrain).
 */
#ifndef AMP_DEVICE_MODULE_H
#define AMP_DEVICE_MODULE_H

#include <stdbool.h>
#include <stddef.h>

#include "error.h" /* enum amp_status, struct amp_error */

#ifdef __cplusplus
extern "C" {
#endif

struct backend;
struct comm;

#define DEVICE_MODULE_ABI 10 /* bumped whenever the table, struct backend, struct comm or an op's argument
                             * struct (backend.h) changes shape */
#define DEVICE_MODULE_SYMBOL "amp_device_module_cuda"
#define DEVICE_MODULE_FILE "libamp_cuda.so"

struct device_module {
    int abi;             /* DEVICE_MODULE_ABI of the module's build: a mismatch is refused */
    size_t backend_size; /* sizeof(struct backend) of the module's build: the same check */
    int (*device_count)(void);
    enum amp_status (*backend_create)(struct backend **out, int device_index, struct amp_error *err);
    int (*describe)(int device_index, char *buf, size_t len);
    void (*versions)(char *buf, size_t len);
    /* the NCCL communicator (comm.h); all three NULL where the module was built without NCCL */
    enum amp_status (*use_nccl)(struct comm *c, struct backend *be, struct amp_error *err);
    void (*release_nccl)(struct comm *c);
    const char *(*nccl_version)(void);
};

typedef const struct device_module *(*device_module_entry_fn)(void);

/* The CUDA module: loaded by the first call, the same table after. NULL when this build has no CUDA
 * backend or the module cannot be loaded (not found, a library it needs missing, a mismatched build);
 * then `why` (may be NULL) says which, naming the file. */
const struct device_module *device_module_cuda(char *why, size_t why_len);

/* The CUDA module if an earlier call loaded it, else NULL; never loads. */
const struct device_module *device_module_cuda_loaded(void);

/* Whether the NVIDIA driver (libcuda.so.1) can be opened. Without it there is no CUDA device, so
 * run.device auto goes to the CPU without loading the module. */
bool device_module_driver_present(void);

#ifdef __cplusplus
}
#endif

#endif
