/*
 * backend.c — choosing a backend from run.device. See backend.h.
 *
 * run.device is "auto", "cpu", "cuda" or "cuda:N". A CPU-only build answers "cuda" with a
 * configuration error (asking for a GPU the build cannot use is a mistake worth stopping for) and
 * "auto" with the CPU. A CUDA build (AMP_HAVE_CUDA) gives "auto" the first GPU when the driver reports
 * one ("device: cuda:0 (NVIDIA H200, sm_90)"), else the CPU ("device: cpu (no CUDA device found)");
 * "cuda" / "cuda:N" without that device is a configuration error.
 *
 * The CUDA backend is a module (lib/base/device_module.h), loaded here on first use: only where the NVIDIA
 * driver is installed, so a CPU run never maps cuBLASLt, cuDNN or NCCL. Where the driver is present
 * but the module cannot be loaded, "auto" says why on its "device: cpu (...)" line and "cuda" is a
 * configuration error carrying the loader's message.
 */
#include "backend.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device_module.h" /* the CUDA backend, a module loaded on first use */
#include "test_switches.h" /* test_switch_vocab_align */
#include "threadpool.h"    /* threadpool_available_cpus: run.threads auto */

/* Parse run.device. Returns 0 and sets *is_auto / *cuda_index (-1 for the CPU), or -1 when the string
 * is none of the accepted forms. */
static int parse_device(const char *device, bool *is_auto, int *cuda_index)
{
    *is_auto = false;
    *cuda_index = -1;
    if (strcmp(device, "auto") == 0) {
        *is_auto = true;
        return 0;
    }
    if (strcmp(device, "cpu") == 0)
        return 0;
    if (strcmp(device, "cuda") == 0) {
        *cuda_index = 0;
        return 0;
    }
    if (strncmp(device, "cuda:", 5) != 0)
        return -1;
    const char *digits = device + 5;
    size_t len = strlen(digits);
    if (len == 0 || len > 4 || strspn(digits, "0123456789") != len)
        return -1;
    *cuda_index = atoi(digits);
    return 0;
}

static enum amp_status open_cpu(struct backend **out, const char *why, char *chosen, size_t chosen_len,
                                struct amp_error *err)
{
    *out = backend_cpu_create();
    if (!*out)
        return amp_fail(err, AMP_ERR_INTERNAL, "free some memory and try again",
                        "out of memory creating the CPU backend");
    if (!test_switch_vocab_align(1, &(*out)->vocab_align)) {
        backend_close(*out);
        *out = NULL;
        return amp_fail(err, AMP_ERR_CONFIG, "set it to an integer from 1 to 4096, or unset it",
                        "AMPTRAIN_TEST_VOCAB_ALIGN is '%s'", getenv("AMPTRAIN_TEST_VOCAB_ALIGN"));
    }
    if (chosen && chosen_len)
        snprintf(chosen, chosen_len, "device: cpu%s", why);
    return AMP_OK;
}

enum amp_status backend_open(struct backend **out, const char *device, char *chosen, size_t chosen_len,
                             struct amp_error *err)
{
    return backend_open_rank(out, device, 0, 1, chosen, chosen_len, err);
}

enum amp_status backend_open_rank(struct backend **out, const char *device, int local_rank, int local_world,
                                  char *chosen, size_t chosen_len, struct amp_error *err)
{
    *out = NULL;
    if (chosen && chosen_len)
        chosen[0] = '\0';
    const char *dev = device ? device : "auto";
    bool is_auto;
    int cuda_index;
    if (parse_device(dev, &is_auto, &cuda_index) != 0)
        return amp_fail(err, AMP_ERR_CONFIG, "set run.device: auto, cpu, cuda or cuda:N (N a GPU index, e.g. cuda:0)",
                        "run.device is '%s': expected auto, cpu, cuda or cuda:N", dev);
    /* the CUDA backend's switches, each 0 or 1: checked here, on every device, so a typo is never a silent default */
    static const struct {
        const char *name, *off; /* what 0 means */
    } switches[] = {
        { "AMPTRAIN_CUDNN_ATTENTION", "the unfused attention everywhere" },  /* kernels/cuda/attention_cudnn.cpp */
        { "AMPTRAIN_FP8_CUBLASLT_EPILOGUE",                                   /* kernels/cuda/fp8.cu */
          "every fp8 product through the fp32 scratch and the epilogue kernel" },
        { "AMPTRAIN_FP8_BLOCK_CUBLASLT",                                      /* kernels/cuda/fp8.cu */
          "recipe blockwise's products in the plain CUDA kernels, the CPU's arithmetic" },
        { "AMPTRAIN_CUDA_GRAPHS", "every op queued one by one" },             /* kernels/cuda/graphs.cu */
    };
    for (size_t i = 0; i < sizeof switches / sizeof switches[0]; i++) {
        const char *v = getenv(switches[i].name);
        if (v && strcmp(v, "0") != 0 && strcmp(v, "1") != 0) {
            char hint[160];
            snprintf(hint, sizeof hint, "set it to 0 (%s) or 1, or unset it", switches[i].off);
            return amp_fail(err, AMP_ERR_CONFIG, hint, "%s is '%s'", switches[i].name, v);
        }
    }
    if (cuda_index < 0 && !is_auto)
        return open_cpu(out, "", chosen, chosen_len, err);
#ifdef AMP_HAVE_CUDA
    /* Without the NVIDIA driver there is no device: the CUDA module (and its libraries) is not loaded. */
    char why[768];
    const struct device_module *m = NULL;
    if (device_module_driver_present())
        m = device_module_cuda(why, sizeof why);
    else
        snprintf(why, sizeof why, "the NVIDIA driver (libcuda.so.1) is not installed");
    int count = m ? m->device_count() : 0;
    /* data parallel: one GPU per rank, the node-local rank's ("cuda" parses as cuda:0) */
    bool any_gpu = is_auto || (strcmp(dev, "cuda") == 0);
    if (local_world > 1 && !any_gpu && count > 0)
        return amp_fail(err, AMP_ERR_CONFIG, "set run.device: cuda (or auto): each rank then takes the GPU of its "
                        "node-local rank",
                        "run.device is '%s', but %d ranks share this host and would all use that one GPU", dev,
                        local_world);
    if (local_world > 1 && count > 0 && count < local_world)
        return amp_fail(err, AMP_ERR_CONFIG, "launch at most one rank per GPU on each host (mpirun --map-by "
                        "ppr:GPUS:node), or set run.device: cpu",
                        "%d ranks on this host but only %d CUDA device%s", local_world, count, count == 1 ? "" : "s");
    if (is_auto) {
        if (count <= 0 && !m && device_module_driver_present()) {
            char note[900];
            snprintf(note, sizeof note, " (%s)", why);
            return open_cpu(out, note, chosen, chosen_len, err);
        }
        if (count <= 0)
            return open_cpu(out, " (no CUDA device found)", chosen, chosen_len, err);
        cuda_index = local_rank;
    } else if (any_gpu && count > 0) {
        cuda_index = local_rank;
    } else if (cuda_index >= count) {
        if (count <= 0 && !m)
            return amp_fail(err, AMP_ERR_CONFIG,
                            "set run.device: cpu or auto, or install the NVIDIA driver and check nvidia-smi",
                            "run.device is '%s' but no CUDA device can be used: %s", dev, why);
        if (count <= 0)
            return amp_fail(err, AMP_ERR_CONFIG,
                            "set run.device: cpu or auto, or check nvidia-smi, the driver and CUDA_VISIBLE_DEVICES",
                            "run.device is '%s' but no CUDA device was found", dev);
        return amp_fail(err, AMP_ERR_CONFIG, "set run.device: cuda:0 .. cuda:%d, cpu or auto",
                        "run.device is '%s' but only %d CUDA device%s found", dev, count,
                        count == 1 ? " was" : "s were");
    }
    enum amp_status s = m->backend_create(out, cuda_index, err);
    if (s != AMP_OK)
        return s;
    if (chosen && chosen_len) {
        char what[256];
        if (m->describe(cuda_index, what, sizeof what) != 0)
            snprintf(what, sizeof what, "unknown GPU");
        snprintf(chosen, chosen_len, "device: cuda:%d (%s)", cuda_index, what);
    }
    return AMP_OK;
#else
    (void)local_rank, (void)local_world;
    if (is_auto)
        return open_cpu(out, " (CPU-only build)", chosen, chosen_len, err);
    return amp_fail(err, AMP_ERR_CONFIG, "set run.device: cpu or auto",
                    "run.device is '%s' but this build has no CUDA backend", dev);
#endif
}

void backend_close(struct backend *be)
{
    if (be)
        be->destroy(be);
}

enum amp_status backend_set_threads(struct backend *be, int threads, struct amp_error *err)
{
    if (!be->set_threads)
        return AMP_OK;
    return be->set_threads(be, threads > 0 ? threads : threadpool_available_cpus(), err);
}

bool backend_attention_fused(struct backend *be, int64_t B, int64_t T, int64_t C, int64_t H, enum dtype d)
{
    return be->attention_fused_supported && be->attention_fused_forward && be->attention_fused_backward &&
           be->attention_fused_supported(be, B, T, C, H, d);
}

void backend_describe_build(char *buf, size_t len)
{
#ifdef AMP_HAVE_CUDA
    char why[768];
    const struct device_module *m = device_module_cuda(why, sizeof why);
    if (m)
        m->versions(buf, len);
    else
        snprintf(buf, len, "CUDA: not loaded (%s)", why);
#else
    snprintf(buf, len, "CUDA: not built");
#endif
}

int backend_cuda_device_count(void)
{
    const struct device_module *m = device_module_driver_present() ? device_module_cuda(NULL, 0) : NULL;
    return m ? m->device_count() : 0;
}
