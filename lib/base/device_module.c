/*
 * device_module.c — opening the CUDA backend's module (libamp_cuda.so) on first use. See device_module.h.
 */
#define _GNU_SOURCE /* readlink's declaration with -std=c11 */
#include "device_module.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef AMP_HAVE_CUDA
#include <dlfcn.h>
#include <limits.h>
#include <unistd.h>

#include "backend.h" /* sizeof(struct backend): the module must agree */

static const struct device_module *loaded;
static bool tried;
static char load_error[768];

/* $AMPTRAIN_CUDA_MODULE, else DEVICE_MODULE_FILE beside the running executable. */
static int module_path(char *buf, size_t len)
{
    const char *env = getenv("AMPTRAIN_CUDA_MODULE");
    if (env && env[0])
        return snprintf(buf, len, "%s", env) < (int)len ? 0 : -1;
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0)
        return -1;
    exe[n] = '\0';
    char *slash = strrchr(exe, '/');
    if (!slash)
        return -1;
    *slash = '\0';
    return snprintf(buf, len, "%s/%s", exe, DEVICE_MODULE_FILE) < (int)len ? 0 : -1;
}

static const struct device_module *load(void)
{
    char path[PATH_MAX + 64];
    if (module_path(path, sizeof path) != 0) {
        snprintf(load_error, sizeof load_error, "the CUDA backend module %s could not be located (set "
                 "AMPTRAIN_CUDA_MODULE to its path)", DEVICE_MODULE_FILE);
        return NULL;
    }
    /* RTLD_NOW: a library the module needs (cuDNN, cuBLASLt, NCCL) or a symbol missing from it is found
     * here, as one message, not as a crash in the middle of a step. */
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        snprintf(load_error, sizeof load_error, "the CUDA backend module could not be loaded: %.600s", e ? e : path);
        return NULL;
    }
    device_module_entry_fn entry;
    void *sym = dlsym(h, DEVICE_MODULE_SYMBOL);
    memcpy(&entry, &sym, sizeof entry); /* object pointer to function pointer, as POSIX allows */
    const struct device_module *m = sym ? entry() : NULL;
    if (!m) {
        snprintf(load_error, sizeof load_error, "%.600s has no %s: not an ampTrain CUDA module", path,
                 DEVICE_MODULE_SYMBOL);
        dlclose(h);
        return NULL;
    }
    if (m->abi != DEVICE_MODULE_ABI || m->backend_size != sizeof(struct backend)) {
        snprintf(load_error, sizeof load_error, "%.600s was built from another ampTrain version (module ABI %d, "
                 "struct backend %zu bytes; this binary: %d, %zu): rebuild both together", path, m->abi,
                 m->backend_size, DEVICE_MODULE_ABI, sizeof(struct backend));
        dlclose(h);
        return NULL;
    }
    return m; /* never closed: the CUDA runtime and NCCL keep state until exit */
}

const struct device_module *device_module_cuda(char *why, size_t why_len)
{
    if (!tried) {
        tried = true;
        loaded = load();
    }
    if (!loaded && why && why_len)
        snprintf(why, why_len, "%s", load_error);
    return loaded;
}

const struct device_module *device_module_cuda_loaded(void)
{
    return loaded;
}

bool device_module_driver_present(void)
{
    static int present = -1;
    if (present < 0) {
        /* kept open when found: the CUDA runtime opens the same library once the module is loaded */
        void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
        present = h != NULL;
    }
    return present == 1;
}

#else /* a CPU-only build */

const struct device_module *device_module_cuda(char *why, size_t why_len)
{
    if (why && why_len)
        snprintf(why, why_len, "this build has no CUDA backend (nvcc or cuDNN was not found when it was built)");
    return NULL;
}

const struct device_module *device_module_cuda_loaded(void)
{
    return NULL;
}

bool device_module_driver_present(void)
{
    return false;
}

#endif
