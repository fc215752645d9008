/*
 * test_backend_cpu.c — the CPU backend's lifetime and memory (kernels/cpu/backend_cpu.c): alloc, convert, status,
 * backend_open's device strings, and that a CPU run maps no CUDA library (the module is loaded only for a CUDA
 * device). The ops' suites are tests/test_cpu_<family>.c, one per file of kernels/cpu/.
 *
 * Each op runs on fresh random inputs from a seeded generator; outputs are poisoned with NaN before each call
 * so an element the backend forgets to write fails (cpu_testlib.h).
 */

#include "cpu_testlib.h" /* be, tnew, tfrom, trand, check_*, fd_grad */

#include "device_module.h" /* the CUDA backend module: loaded only for a CUDA device */

TestSuite(backend_cpu, .init = cpu_test_setup, .fini = cpu_test_teardown);

/* ---- memory, conversion, status, backend_open -------------------------------------------------- */

Test(backend_cpu, memory_conversion_and_status)
{
    void *p = be->alloc(be, 3);
    cr_assert_not_null(p);
    cr_assert_eq((uintptr_t)p % 64, 0, "64-byte aligned");
    be->free(be, p);
    float h[4] = { 1.0f, 65519.0f, 65520.0f, 1.00048828125f }; /* the last: a tie, to even */
    struct tensor *src = tfrom(DT_FP32, 4, h), *f16 = tnew(DT_FP16, 4), *b16 = tnew(DT_BF16, 4);
    be->convert(be, f16, src);
    const uint16_t *fb = f16->data;
    cr_assert(fb[0] == 0x3C00 && fb[1] == 0x7BFF && fb[2] == 0x7C00 && fb[3] == 0x3C00);
    be->convert(be, b16, f16); /* fp16 -> bf16 through fp32, one rounding */
    cr_assert_eq(((uint16_t *)b16->data)[1], bf16_from_fp32(65504.0f));
    cr_assert_eq(((uint16_t *)b16->data)[2], 0x7F80);
    be->zero(be, src);
    check_f32(src, (double[]){ 0, 0, 0, 0 }, 4, 0, 0, "zero");
    be->synchronize(be);
    struct amp_error err = { .code = AMP_ERR_DATA };
    cr_assert_eq(be->status(be, &err), AMP_OK);
    cr_assert_eq(err.code, AMP_OK);
    cr_assert_str_eq(be->name, "cpu");
}

Test(backend_cpu, backend_open_device_strings)
{
    struct backend *b = NULL;
    struct amp_error err;
    char chosen[128];
    cr_assert_eq(backend_open(&b, "cpu", chosen, sizeof chosen, &err), AMP_OK);
    cr_assert_not_null(b);
    cr_assert_str_eq(chosen, "device: cpu");
    backend_close(b);
    cr_assert_eq(backend_open(&b, "auto", chosen, sizeof chosen, &err), AMP_OK);
    cr_assert_not_null(b);
#ifdef AMP_HAVE_CUDA
    if (backend_cuda_device_count() > 0) {
        /* auto takes the GPU where there is one: the CPU cases below do not apply */
        cr_assert(strncmp(b->name, "cuda", 4) == 0, "auto on a GPU machine chose %s", b->name);
        backend_close(b);
        return;
    }
    cr_assert_str_eq(chosen, "device: cpu (no CUDA device found)");
#else
    cr_assert_str_eq(chosen, "device: cpu (CPU-only build)");
#endif
    cr_assert_str_eq(b->name, "cpu");
    backend_close(b);
    const char *cuda[2] = { "cuda", "cuda:1" };
    for (int i = 0; i < 2; i++) {
        b = (struct backend *)&err; /* must be reset to NULL */
        cr_assert_eq(backend_open(&b, cuda[i], chosen, sizeof chosen, &err), AMP_ERR_CONFIG);
        cr_assert_null(b);
        cr_assert(strstr(err.msg, "run.device") && strstr(err.msg, cuda[i]), "msg: %s", err.msg);
        cr_assert(strstr(err.hint, "cpu or auto") || strstr(err.hint, "auto or cpu"), "hint: %s", err.hint);
    }
#ifndef AMP_HAVE_CUDA
    backend_open(&b, "cuda", chosen, sizeof chosen, &err);
    cr_assert_str_eq(err.msg, "run.device is 'cuda' but this build has no CUDA backend");
    cr_assert_str_eq(err.hint, "set run.device: cpu or auto");
#endif
    const char *bad[6] = { "bogus", "", "CPU", "cuda:", "cuda:x", "cuda:-1" };
    for (int i = 0; i < 6; i++) {
        cr_assert_eq(backend_open(&b, bad[i], chosen, sizeof chosen, &err), AMP_ERR_CONFIG, "'%s'", bad[i]);
        cr_assert_null(b);
        cr_assert(strstr(err.msg, "run.device"), "msg: %s", err.msg);
        cr_assert(err.hint[0]);
    }
    backend_close(NULL);
}

/* window_store (backend.h): the step's row and counts go to slot *slot of the window, the row is zeroed (count_zeros
 * adds into it next step) and the slot advances, all read from and written to backend memory; a later store leaves
 * the earlier slots alone. */
Test(backend_cpu, window_store_files_the_step_at_the_slot_in_memory)
{
    const int64_t nc = 5, w = 3;
    struct step_row *row = be->alloc(be, sizeof *row), *rows = be->alloc(be, (size_t)w * sizeof *rows);
    int64_t *counts = be->alloc(be, (size_t)nc * sizeof *counts);
    int64_t *wcounts = be->alloc(be, (size_t)(w * nc) * sizeof *wcounts);
    int64_t *slot = be->alloc(be, sizeof *slot);
    cr_assert(row && rows && counts && wcounts && slot);
    memset(rows, 0xA5, (size_t)w * sizeof *rows);
    memset(wcounts, 0xA5, (size_t)(w * nc) * sizeof *wcounts);
    *slot = 0;
    struct window_store_args a = { .row = row, .counts = counts, .rows = rows, .window_counts = wcounts,
                                   .ncounts = nc, .slot = slot };
    for (int64_t s = 0; s < w; s++) {
        memset(row, 0, sizeof *row);
        row->step = 10 + s;
        row->loss = 0.5 * (double)s;
        row->grad_zeros = 7 * s + 1;
        for (int64_t i = 0; i < nc; i++)
            counts[i] = 100 * s + i;
        be->window_store(be, &a);
        cr_assert_eq(*slot, s + 1);
        for (int64_t r = 0; r <= s; r++) { /* this step's slot and every earlier one */
            cr_assert_eq(rows[r].step, 10 + r);
            cr_assert_eq(rows[r].loss, 0.5 * (double)r);
            cr_assert_eq(rows[r].grad_zeros, 7 * r + 1);
            for (int64_t i = 0; i < nc; i++)
                cr_assert_eq(wcounts[r * nc + i], 100 * r + i, "slot %lld count %lld", (long long)r, (long long)i);
        }
        const unsigned char *z = (const unsigned char *)row;
        for (size_t b = 0; b < sizeof *row; b++)
            cr_assert_eq(z[b], 0, "the step's row is zeroed after the store (byte %zu)", b);
    }
    be->free(be, row);
    be->free(be, rows);
    be->free(be, counts);
    be->free(be, wcounts);
    be->free(be, slot);
}

/* The CUDA backend's switches are 0 or 1: anything else is refused at backend_open, naming the variable, with a
 * hint, on the CPU too, rather than read as "on"; 0 and 1 open the CPU backend. */
static void switch_takes_only_0_and_1(const char *name)
{
    struct backend *b = NULL;
    struct amp_error err;
    const char *bad[5] = { "yes", "", "00", "2", "1 " };
    for (int i = 0; i < 5; i++) {
        cr_assert_eq(setenv(name, bad[i], 1), 0);
        cr_assert_eq(backend_open(&b, "cpu", NULL, 0, &err), AMP_ERR_CONFIG, "%s='%s'", name, bad[i]);
        cr_assert_null(b);
        cr_assert(strstr(err.msg, name), "msg: %s", err.msg);
        cr_assert(err.hint[0]);
    }
    const char *good[2] = { "0", "1" };
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(setenv(name, good[i], 1), 0);
        cr_assert_eq(backend_open(&b, "cpu", NULL, 0, &err), AMP_OK, "%s='%s': %s", name, good[i], err.msg);
        backend_close(b);
    }
    cr_assert_eq(unsetenv(name), 0);
}

Test(backend_cpu, a_bad_amptrain_cudnn_attention_is_refused_naming_it)
{
    switch_takes_only_0_and_1("AMPTRAIN_CUDNN_ATTENTION");
}

Test(backend_cpu, a_bad_amptrain_fp8_cublaslt_epilogue_is_refused_naming_it)
{
    switch_takes_only_0_and_1("AMPTRAIN_FP8_CUBLASLT_EPILOGUE");
}

Test(backend_cpu, a_bad_amptrain_fp8_block_cublaslt_is_refused_naming_it)
{
    switch_takes_only_0_and_1("AMPTRAIN_FP8_BLOCK_CUBLASLT");
}

/* the CPU backend records no graphs, whatever the switch says */
Test(backend_cpu, a_bad_amptrain_cuda_graphs_is_refused_naming_it)
{
    switch_takes_only_0_and_1("AMPTRAIN_CUDA_GRAPHS");
    struct backend *b = NULL;
    struct amp_error err;
    cr_assert_eq(setenv("AMPTRAIN_CUDA_GRAPHS", "1", 1), 0);
    cr_assert_eq(backend_open(&b, "cpu", NULL, 0, &err), AMP_OK, "%s", err.msg);
    cr_assert(!b->graph_begin && !b->graph_end && !b->graph_launch, "the CPU records no graphs");
    backend_close(b);
    cr_assert_eq(unsetenv("AMPTRAIN_CUDA_GRAPHS"), 0);
}

/* ---- the CUDA backend's module (lib/base/device_module.h) ---------------------------------------------- */

/* Whether this process has mapped a file whose path contains `name` (/proc/self/maps). */
static bool maps_file(const char *name)
{
    FILE *f = fopen("/proc/self/maps", "r");
    cr_assert_not_null(f, "cannot read /proc/self/maps");
    char line[4096];
    bool found = false;
    while (!found && fgets(line, sizeof line, f))
        found = strstr(line, name) != NULL;
    fclose(f);
    return found;
}

/* A CPU run of a CUDA-enabled build maps none of cuBLASLt, cuDNN, NCCL or the module: run.device
 * cpu never loads it, and auto does not where the NVIDIA driver is absent. */
Test(backend_cpu, cpu_run_maps_no_cuda_library)
{
    struct backend *b = NULL;
    struct amp_error err;
    char chosen[1024];
    cr_assert_eq(backend_open(&b, "cpu", chosen, sizeof chosen, &err), AMP_OK);
    backend_close(b);
    if (!device_module_driver_present()) {
        cr_assert_eq(backend_open(&b, "auto", chosen, sizeof chosen, &err), AMP_OK);
        cr_assert_str_eq(b->name, "cpu");
        backend_close(b);
        cr_assert_eq(backend_cuda_device_count(), 0);
    }
    cr_assert_null(device_module_cuda_loaded());
    const char *libs[4] = { "libcublasLt", "libcudnn", "libnccl", DEVICE_MODULE_FILE };
    for (int i = 0; i < 4; i++)
        cr_assert(!maps_file(libs[i]), "a CPU run mapped %s", libs[i]);
}

/* The module loads with every symbol resolved (RTLD_NOW), agrees with this binary on the table and struct
 * backend, and brings the CUDA libraries with it. Without a driver it sees no device. */
Test(backend_cpu, cuda_module_loads)
{
    char why[1024] = "";
    const struct device_module *m = device_module_cuda(why, sizeof why);
#ifdef AMP_HAVE_CUDA
    cr_assert_not_null(m, "%s", why);
    cr_assert_eq(device_module_cuda(why, sizeof why), m, "a second call must return the loaded module");
    cr_assert_eq(device_module_cuda_loaded(), m);
    cr_assert_eq(m->abi, DEVICE_MODULE_ABI);
    cr_assert_eq(m->backend_size, sizeof(struct backend));
    cr_assert(maps_file(DEVICE_MODULE_FILE) && maps_file("libcublasLt") && maps_file("libcudnn"),
              "the module and its CUDA libraries are mapped once it is loaded");
    char versions[512];
    m->versions(versions, sizeof versions);
    cr_assert(strstr(versions, "cuBLASLt") && strstr(versions, "cuDNN"), "%s", versions);
    if (!device_module_driver_present())
        cr_assert_eq(m->device_count(), 0, "no driver, no device");
#ifdef AMP_HAVE_NCCL
    cr_assert(m->use_nccl && m->release_nccl && m->nccl_version, "an NCCL build's module carries the communicator");
    cr_assert(strstr(m->nccl_version(), "NCCL: built ("), "%s", m->nccl_version());
#endif
#else
    cr_assert_null(m);
    cr_assert(strstr(why, "this build has no CUDA backend"), "%s", why);
    cr_assert_null(device_module_cuda_loaded());
#endif
}

/* A module that cannot be loaded is named, with the loader's reason; --version says so; nothing crashes. */
Test(backend_cpu, cuda_module_missing_is_named)
{
    cr_assert_eq(setenv("AMPTRAIN_CUDA_MODULE", "/nonexistent/dir/libamp_cuda.so", 1), 0);
    char why[1024] = "";
    cr_assert_null(device_module_cuda(why, sizeof why));
    cr_assert_null(device_module_cuda_loaded());
    char build[1024];
    backend_describe_build(build, sizeof build);
#ifdef AMP_HAVE_CUDA
    cr_assert(strstr(why, "/nonexistent/dir/libamp_cuda.so") && strstr(why, "could not be loaded"), "%s", why);
    cr_assert(strncmp(build, "CUDA: not loaded (", 18) == 0 && strstr(build, "/nonexistent/dir"), "%s", build);
#else
    cr_assert_str_eq(build, "CUDA: not built");
#endif
    cr_assert_eq(backend_cuda_device_count(), 0);
}
