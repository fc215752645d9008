/*
 * test_cuda_backend.c — every op of the CUDA backend (kernels/) against the CPU reference backend, the
 * device selection of backend_open, and fashion_mlp training on the GPU against the CPU.
 *
 * Each op test draws fresh seeded inputs, runs the op on both backends with the same bits (16-bit
 * tensors hold the same patterns on both), fills the GPU outputs with NaN first (0xFF bytes: NaN in
 * fp32, fp16 and bf16) so an unwritten element fails, and compares by relative L2 error:
 * fp32 1e-5, TF32 1e-3, fp16/bf16 1e-2 (a 16-bit output may differ by an ulp where the summation
 * order moves a value across a rounding boundary). Dropout masks, pooling and embeddings are held
 * tighter where the arithmetic is the same.
 * Without a GPU these tests skip and are counted as skipped: this file has its own main, which exits 77
 * (CTest's SKIP_RETURN_CODE) when any test skipped and none failed. The device-selection tests need no
 * GPU and always run. Built without the CUDA backend, the file holds one test that skips.
 */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <criterion/hooks.h>
#include <criterion/logging.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h" /* backend_open, backend_cpu_create, the op table */

#include "skip_main.h" /* main: exit 77 (Skipped) when tests skipped and none failed */

#ifdef AMP_HAVE_CUDA

#include "ckpt_testlib.h" /* amp(), assert_same_tensors, assert_same_logs: the resume test */
#include "train.h"        /* trainer_setup, trainer_step: the training comparison */

#define FASHION "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"

/* ---- fixtures ----------------------------------------------------------------------------------- */

static struct backend *cpu, *gpu;
static uint64_t rng_state;

static void open_both(void)
{
    setenv("OPENBLAS_NUM_THREADS", "1", 1);
    if (backend_cuda_device_count() <= 0)
        cr_skip_test("no CUDA device (cudaGetDeviceCount found none): the CUDA backend was not run");
    struct amp_error err = {0};
    cr_assert_eq(backend_cuda_create(&gpu, 0, &err), AMP_OK, "%s (hint: %s)", err.msg, err.hint);
    cpu = backend_cpu_create();
    cr_assert_not_null(cpu);
}

static void close_both(void)
{
    backend_close(gpu);
    backend_close(cpu);
    gpu = cpu = NULL;
}

static uint64_t next_u64(void)
{
    uint64_t z = (rng_state += UINT64_C(0x9E3779B97F4A7C15));
    z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
    return z ^ (z >> 31);
}

static float uniform(float lo, float hi)
{
    return lo + (hi - lo) * (float)(next_u64() >> 40) * (1.0f / 16777216.0f);
}

static void check_gpu(void)
{
    struct amp_error err = {0};
    gpu->synchronize(gpu);
    cr_assert_eq(gpu->status(gpu, &err), AMP_OK, "GPU backend failed: %s (hint: %s)", err.msg, err.hint);
}

/* ---- tensor pairs: the same bits on both backends ------------------------------------------------ */

struct pair {
    struct tensor c, g;
};

static void pair_alloc(struct pair *p, enum dtype dt, int ndim, const int64_t *shape)
{
    struct amp_error err = {0};
    cr_assert_eq(tensor_alloc(&p->c, cpu, dt, ndim, shape, "cpu tensor", &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(tensor_alloc(&p->g, gpu, dt, ndim, shape, "gpu tensor", &err), AMP_OK, "%s", err.msg);
}

/* Random values in [lo, hi) (rounded to dt) on both. */
static void pair_rand(struct pair *p, enum dtype dt, int ndim, const int64_t *shape, float lo, float hi)
{
    pair_alloc(p, dt, ndim, shape);
    float *h = malloc(p->c.numel * sizeof *h);
    cr_assert_not_null(h);
    for (size_t i = 0; i < p->c.numel; i++)
        h[i] = uniform(lo, hi);
    tensor_from_host_f32(&p->c, h);
    gpu->upload(gpu, p->g.data, p->c.data, tensor_bytes(&p->c));
    free(h);
}

/* An output: CPU side zero, GPU side poisoned with NaN. */
static void pair_out(struct pair *p, enum dtype dt, int ndim, const int64_t *shape)
{
    pair_alloc(p, dt, ndim, shape);
    memset(p->c.data, 0, tensor_bytes(&p->c));
    void *poison = malloc(tensor_bytes(&p->c));
    cr_assert_not_null(poison);
    memset(poison, 0xFF, tensor_bytes(&p->c));
    gpu->upload(gpu, p->g.data, poison, tensor_bytes(&p->c));
    free(poison);
}

/* An accumulator (beta = 1 tests): the same random values on both. */
static void pair_acc(struct pair *p, int ndim, const int64_t *shape)
{
    pair_rand(p, DT_FP32, ndim, shape, -1.0f, 1.0f);
}

static void pair_free(struct pair *p)
{
    tensor_free(&p->c);
    tensor_free(&p->g);
}

static float tol_of(enum dtype dt)
{
    return dt == DT_FP32 ? 1e-5f : 1e-2f;
}

/* Relative L2 error of the GPU tensor against the CPU one; every GPU element must be finite where the
 * CPU's is (a NaN left by the poison fails here). */
static void pair_expect(const struct pair *p, double tol, const char *what)
{
    check_gpu();
    size_t n = p->c.numel, bytes = tensor_bytes(&p->c);
    void *raw = malloc(bytes);
    float *g = malloc(n * sizeof *g), *c = malloc(n * sizeof *c);
    cr_assert(raw && g && c);
    gpu->download(gpu, raw, p->g.data, bytes);
    dtype_convert(g, DT_FP32, raw, p->c.dtype, n);
    tensor_to_host_f32(&p->c, c);
    double num = 0.0, den = 0.0;
    size_t bad = 0, first_bad = 0;
    for (size_t i = 0; i < n; i++) {
        if (isfinite(c[i]) && !isfinite(g[i])) {
            if (bad++ == 0)
                first_bad = i;
            continue;
        }
        if (!isfinite(c[i]))
            continue;
        double d = (double)g[i] - (double)c[i];
        num += d * d;
        den += (double)c[i] * c[i];
    }
    cr_assert_eq(bad, 0, "%s: %zu GPU elements non-finite where the CPU's are finite (first [%zu]: GPU %g, CPU %g)",
                 what, bad, first_bad, g[first_bad], c[first_bad]);
    double rel = sqrt(num) / (den > 0.0 ? sqrt(den) : 1.0);
    cr_assert(rel <= tol, "%s (%s): relative L2 error %.3g > %.3g", what, dtype_name(p->c.dtype), rel, tol);
    free(raw);
    free(g);
    free(c);
}

/* int32 buffers (labels, tokens, correct) on both backends */
static int32_t *ints_upload(const int32_t *h, size_t n)
{
    int32_t *d = gpu->alloc(gpu, n * sizeof *d);
    cr_assert_not_null(d);
    gpu->upload(gpu, d, h, n * sizeof *d);
    return d;
}

static const enum dtype all_dtypes[] = {DT_FP32, DT_FP16, DT_BF16};

/* ---- matrix products ---------------------------------------------------------------------------- */

static void gemm_case(enum dtype dt, enum dtype c_dt, bool ta, bool tb, bool bias, float beta, int64_t batch,
                      double tol)
{
    int64_t m = 37, n = 72, k = 50;
    struct pair a, b, c, bi;
    pair_rand(&a, dt, 3, (int64_t[]){batch, ta ? k : m, ta ? m : k}, -1, 1);
    pair_rand(&b, dt, 3, (int64_t[]){batch, tb ? n : k, tb ? k : n}, -1, 1);
    if (beta != 0.0f)
        pair_rand(&c, c_dt, 3, (int64_t[]){batch, m, n}, -1, 1);
    else
        pair_out(&c, c_dt, 3, (int64_t[]){batch, m, n});
    if (bias)
        pair_rand(&bi, DT_FP32, 1, (int64_t[]){n}, -1, 1);
    struct gemm_args g = {.trans_a = ta, .trans_b = tb, .m = m, .n = n, .k = k, .alpha = 0.75f, .beta = beta,
                          .batch = batch, .stride_a = m * k, .stride_b = k * n, .stride_c = m * n};
    g.a = &a.c, g.b = &b.c, g.c = &c.c, g.bias = bias ? &bi.c : NULL;
    cpu->gemm(cpu, &g);
    g.a = &a.g, g.b = &b.g, g.c = &c.g, g.bias = bias ? &bi.g : NULL;
    gpu->gemm(gpu, &g);
    char what[128];
    snprintf(what, sizeof what, "gemm %s->%s ta=%d tb=%d bias=%d beta=%g batch=%lld", dtype_name(dt),
             dtype_name(c_dt), ta, tb, bias, beta, (long long)batch);
    pair_expect(&c, tol, what);
    pair_free(&a);
    pair_free(&b);
    pair_free(&c);
    if (bias)
        pair_free(&bi);
}

Test(cuda_backend, gemm, .init = open_both, .fini = close_both)
{
    rng_state = 1;
    for (int d = 0; d < 3; d++) {
        enum dtype dt = all_dtypes[d];
        enum dtype outs[2] = {DT_FP32, dt};
        for (int o = 0; o < (dt == DT_FP32 ? 1 : 2); o++)
            for (int t = 0; t < 4; t++) {
                double tol = outs[o] == DT_FP32 ? (dt == DT_FP32 ? 1e-5 : 1e-4) : 1e-2;
                gemm_case(dt, outs[o], t & 1, t & 2, false, 0.0f, 1, tol);
                gemm_case(dt, outs[o], t & 1, t & 2, true, 0.0f, 1, tol);
                gemm_case(dt, outs[o], t & 1, t & 2, false, 1.0f, 3, tol);
            }
    }
}

Test(cuda_backend, gemm_tf32, .init = open_both, .fini = close_both)
{
    rng_state = 2;
    gpu->allow_tf32 = true;
    gemm_case(DT_FP32, DT_FP32, false, true, true, 0.0f, 1, 1e-3);
    gemm_case(DT_FP32, DT_FP32, true, false, false, 1.0f, 2, 1e-3);
}

Test(cuda_backend, bias_grad, .init = open_both, .fini = close_both)
{
    rng_state = 3;
    for (int d = 0; d < 3; d++) {
        int64_t m = 300, n = 77;
        struct pair dy, db;
        pair_rand(&dy, all_dtypes[d], 2, (int64_t[]){m, n}, -1, 1);
        pair_acc(&db, 1, (int64_t[]){n});
        cpu->bias_grad(cpu, &db.c, &dy.c, m, n, 1.0f);
        gpu->bias_grad(gpu, &db.g, &dy.g, m, n, 1.0f);
        pair_expect(&db, 1e-6, "bias_grad beta 1");
        pair_free(&dy);
        pair_free(&db);
    }
}

/* ---- elementwise -------------------------------------------------------------------------------- */

Test(cuda_backend, activations_and_add, .init = open_both, .fini = close_both)
{
    rng_state = 4;
    int64_t shape[] = {1000, 33};
    for (int d = 0; d < 3; d++) {
        enum dtype dt = all_dtypes[d];
        for (int k = ACT_RELU; k <= ACT_GELU_ERF; k++) {
            struct pair x, y, dy, dx;
            pair_rand(&x, dt, 2, shape, -25, 25);
            pair_rand(&dy, dt, 2, shape, -1, 1);
            pair_out(&y, dt, 2, shape);
            pair_out(&dx, dt, 2, shape);
            cpu->act_forward(cpu, (enum act_kind)k, &y.c, &x.c);
            gpu->act_forward(gpu, (enum act_kind)k, &y.g, &x.g);
            pair_expect(&y, dt == DT_FP32 ? 1e-6 : 1e-3, "act_forward");
            cpu->act_backward(cpu, (enum act_kind)k, &dx.c, &dy.c, &x.c);
            gpu->act_backward(gpu, (enum act_kind)k, &dx.g, &dy.g, &x.g);
            pair_expect(&dx, dt == DT_FP32 ? 1e-6 : 1e-3, "act_backward");
            pair_free(&x);
            pair_free(&y);
            pair_free(&dy);
            pair_free(&dx);
        }
        struct pair a, b, y;
        pair_rand(&a, dt, 2, shape, -1, 1);
        pair_rand(&b, DT_FP32, 2, shape, -1, 1);
        pair_out(&y, DT_FP32, 2, shape);
        cpu->add(cpu, &y.c, &a.c, &b.c);
        gpu->add(gpu, &y.g, &a.g, &b.g);
        pair_expect(&y, 0.0, "add (exact)");
        pair_free(&a);
        pair_free(&b);
        pair_free(&y);
    }
}

Test(cuda_backend, dropout_masks_match_bit_for_bit, .init = open_both, .fini = close_both)
{
    rng_state = 5;
    int64_t shape[] = {4097, 3};
    struct rng_key key = {.seed = 1234, .stream = 7, .counter = (UINT64_C(5) << 32) + 3};
    for (int d = 0; d < 3; d++) {
        struct pair x, y, dx;
        pair_rand(&x, all_dtypes[d], 2, shape, 0.5f, 1.5f);
        pair_out(&y, all_dtypes[d], 2, shape);
        pair_out(&dx, all_dtypes[d], 2, shape);
        cpu->dropout_forward(cpu, &y.c, &x.c, 0.3f, key);
        gpu->dropout_forward(gpu, &y.g, &x.g, 0.3f, key);
        pair_expect(&y, 0.0, "dropout_forward (same mask, same products)");
        cpu->dropout_backward(cpu, &dx.c, &x.c, 0.3f, key);
        gpu->dropout_backward(gpu, &dx.g, &x.g, 0.3f, key);
        pair_expect(&dx, 0.0, "dropout_backward");
        cr_assert_eq(cpu->count_zeros(cpu, &y.c), gpu->count_zeros(gpu, &y.g), "count_zeros of the dropped tensor");
        pair_free(&x);
        pair_free(&y);
        pair_free(&dx);
    }
}

/* ---- convolution and pooling -------------------------------------------------------------------- */

static void conv_case(enum dtype dt, int64_t kernel, int64_t stride, int64_t pad)
{
    struct conv_args a = {.n = 3, .c_in = 5, .h_in = 13, .w_in = 11, .c_out = 8, .kernel = kernel, .stride = stride,
                          .padding = pad};
    a.h_out = (a.h_in + 2 * pad - kernel) / stride + 1;
    a.w_out = (a.w_in + 2 * pad - kernel) / stride + 1;
    int64_t xs[] = {a.n, a.c_in, a.h_in, a.w_in}, ws[] = {a.c_out, a.c_in, kernel, kernel};
    int64_t ys[] = {a.n, a.c_out, a.h_out, a.w_out};
    struct pair x, w, bias, y, dy, dx, dw, db;
    pair_rand(&x, dt, 4, xs, -1, 1);
    pair_rand(&w, dt, 4, ws, -0.5f, 0.5f);
    pair_rand(&bias, DT_FP32, 1, (int64_t[]){a.c_out}, -1, 1);
    pair_rand(&dy, dt, 4, ys, -1, 1);
    pair_out(&y, dt, 4, ys);
    pair_out(&dx, dt, 4, xs);
    pair_acc(&dw, 4, ws);
    pair_acc(&db, 1, (int64_t[]){a.c_out});
    cpu->conv2d_forward(cpu, &a, &y.c, &x.c, &w.c, &bias.c);
    gpu->conv2d_forward(gpu, &a, &y.g, &x.g, &w.g, &bias.g);
    pair_expect(&y, tol_of(dt), "conv2d_forward");
    cpu->conv2d_backward_data(cpu, &a, &dx.c, &dy.c, &w.c);
    gpu->conv2d_backward_data(gpu, &a, &dx.g, &dy.g, &w.g);
    pair_expect(&dx, tol_of(dt), "conv2d_backward_data");
    cpu->conv2d_backward_filter(cpu, &a, &dw.c, &db.c, &dy.c, &x.c, 1.0f);
    gpu->conv2d_backward_filter(gpu, &a, &dw.g, &db.g, &dy.g, &x.g, 1.0f);
    pair_expect(&dw, 1e-5, "conv2d_backward_filter dw (fp32, beta 1)");
    pair_expect(&db, 1e-6, "conv2d_backward_filter db");
    struct pair *all[] = {&x, &w, &bias, &y, &dy, &dx, &dw, &db};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        pair_free(all[i]);
}

Test(cuda_backend, conv2d, .init = open_both, .fini = close_both)
{
    rng_state = 6;
    for (int d = 0; d < 3; d++) {
        conv_case(all_dtypes[d], 3, 1, 1);
        conv_case(all_dtypes[d], 5, 2, 2);
        conv_case(all_dtypes[d], 1, 1, 0);
    }
}

Test(cuda_backend, pool2d, .init = open_both, .fini = close_both)
{
    rng_state = 7;
    for (int d = 0; d < 3; d++)
        for (int kind = POOL_MAX; kind <= POOL_AVG; kind++) {
            struct pool_args a = {.kind = (enum pool_kind)kind, .n = 2, .c = 3, .h_in = 12, .w_in = 9, .kernel = 3,
                                  .stride = 2, .padding = 1};
            a.h_out = (a.h_in + 2 - 3) / 2 + 1;
            a.w_out = (a.w_in + 2 - 3) / 2 + 1;
            int64_t xs[] = {a.n, a.c, a.h_in, a.w_in}, ys[] = {a.n, a.c, a.h_out, a.w_out};
            struct pair x, y, dy, dx;
            pair_rand(&x, all_dtypes[d], 4, xs, -1, 1);
            pair_rand(&dy, all_dtypes[d], 4, ys, -1, 1);
            pair_out(&y, all_dtypes[d], 4, ys);
            pair_out(&dx, all_dtypes[d], 4, xs);
            cpu->pool2d_forward(cpu, &a, &y.c, &x.c);
            gpu->pool2d_forward(gpu, &a, &y.g, &x.g);
            pair_expect(&y, 1e-6, "pool2d_forward");
            cpu->pool2d_backward(cpu, &a, &dx.c, &dy.c, &x.c, &y.c);
            gpu->pool2d_backward(gpu, &a, &dx.g, &dy.g, &x.g, &y.g);
            pair_expect(&dx, 1e-6, "pool2d_backward");
            pair_free(&x);
            pair_free(&y);
            pair_free(&dy);
            pair_free(&dx);
        }
}

/* ---- normalisation ------------------------------------------------------------------------------ */

Test(cuda_backend, layernorm, .init = open_both, .fini = close_both)
{
    rng_state = 8;
    int64_t rows = 300, cols = 130;
    struct norm_args a = {.rows = rows, .cols = cols, .eps = 1e-5f};
    for (int d = 0; d < 3; d++) {
        enum dtype dt = all_dtypes[d];
        int64_t s[] = {rows, cols};
        struct pair x, g, b, y, mean, rstd, dy, dx, dg, db;
        pair_rand(&x, dt, 2, s, -2, 3);
        pair_rand(&g, DT_FP32, 1, &cols, 0.5f, 1.5f);
        pair_rand(&b, DT_FP32, 1, &cols, -1, 1);
        pair_rand(&dy, dt, 2, s, -1, 1);
        pair_out(&y, dt, 2, s);
        pair_out(&dx, dt, 2, s);
        pair_out(&mean, DT_FP32, 1, &rows);
        pair_out(&rstd, DT_FP32, 1, &rows);
        pair_acc(&dg, 1, &cols);
        pair_acc(&db, 1, &cols);
        cpu->layernorm_forward(cpu, &a, &y.c, &mean.c, &rstd.c, &x.c, &g.c, &b.c);
        gpu->layernorm_forward(gpu, &a, &y.g, &mean.g, &rstd.g, &x.g, &g.g, &b.g);
        pair_expect(&y, tol_of(dt), "layernorm_forward y");
        pair_expect(&mean, 1e-6, "layernorm_forward mean");
        pair_expect(&rstd, 1e-6, "layernorm_forward rstd");
        cpu->layernorm_backward(cpu, &a, &dx.c, &dg.c, &db.c, &dy.c, &x.c, &mean.c, &rstd.c, &g.c, 1.0f);
        gpu->layernorm_backward(gpu, &a, &dx.g, &dg.g, &db.g, &dy.g, &x.g, &mean.g, &rstd.g, &g.g, 1.0f);
        pair_expect(&dx, tol_of(dt), "layernorm_backward dx");
        pair_expect(&dg, 1e-5, "layernorm_backward dgamma");
        pair_expect(&db, 1e-5, "layernorm_backward dbeta");
        struct pair *all[] = {&x, &g, &b, &y, &mean, &rstd, &dy, &dx, &dg, &db};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
            pair_free(all[i]);
    }
}

Test(cuda_backend, batchnorm, .init = open_both, .fini = close_both)
{
    rng_state = 9;
    int64_t n = 6, c = 5, hw = 49;
    for (int d = 0; d < 3; d++)
        for (int training = 1; training >= 0; training--) {
            enum dtype dt = all_dtypes[d];
            struct norm_args a = {.n = n, .c = c, .hw = hw, .eps = 1e-5f, .momentum = 0.1f, .training = training};
            int64_t s[] = {n, c, 7, 7};
            struct pair x, g, b, y, mean, rstd, rm, rv, dy, dx, dg, db;
            pair_rand(&x, dt, 4, s, -2, 3);
            pair_rand(&g, DT_FP32, 1, &c, 0.5f, 1.5f);
            pair_rand(&b, DT_FP32, 1, &c, -1, 1);
            pair_rand(&rm, DT_FP32, 1, &c, -0.5f, 0.5f);
            pair_rand(&rv, DT_FP32, 1, &c, 0.5f, 1.5f);
            pair_rand(&dy, dt, 4, s, -1, 1);
            pair_out(&y, dt, 4, s);
            pair_out(&dx, dt, 4, s);
            pair_out(&mean, DT_FP32, 1, &c);
            pair_out(&rstd, DT_FP32, 1, &c);
            pair_acc(&dg, 1, &c);
            pair_acc(&db, 1, &c);
            cpu->batchnorm_forward(cpu, &a, &y.c, &mean.c, &rstd.c, &rm.c, &rv.c, &x.c, &g.c, &b.c);
            gpu->batchnorm_forward(gpu, &a, &y.g, &mean.g, &rstd.g, &rm.g, &rv.g, &x.g, &g.g, &b.g);
            pair_expect(&y, tol_of(dt), "batchnorm_forward y");
            pair_expect(&mean, 1e-6, "batchnorm_forward mean");
            pair_expect(&rstd, 1e-6, "batchnorm_forward rstd");
            pair_expect(&rm, 1e-6, "batchnorm running mean");
            pair_expect(&rv, 1e-6, "batchnorm running var");
            cpu->batchnorm_backward(cpu, &a, &dx.c, &dg.c, &db.c, &dy.c, &x.c, &mean.c, &rstd.c, &g.c, 1.0f);
            gpu->batchnorm_backward(gpu, &a, &dx.g, &dg.g, &db.g, &dy.g, &x.g, &mean.g, &rstd.g, &g.g, 1.0f);
            pair_expect(&dx, tol_of(dt), "batchnorm_backward dx");
            pair_expect(&dg, 1e-5, "batchnorm_backward dgamma");
            pair_expect(&db, 1e-5, "batchnorm_backward dbeta");
            struct pair *all[] = {&x, &g, &b, &y, &mean, &rstd, &rm, &rv, &dy, &dx, &dg, &db};
            for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
                pair_free(all[i]);
        }
}

/* ---- embedding and attention -------------------------------------------------------------------- */

Test(cuda_backend, embedding, .init = open_both, .fini = close_both)
{
    rng_state = 10;
    int64_t B = 3, T = 17, C = 24, V = 50;
    int32_t tok[3 * 17];
    for (int i = 0; i < B * T; i++)
        tok[i] = (int32_t)(next_u64() % 12); /* few ids: many repeats exercise the ordered sums */
    int32_t *dtok = ints_upload(tok, (size_t)(B * T));
    for (int d = 0; d < 3; d++) {
        enum dtype dt = all_dtypes[d];
        struct pair wte, wpe, y, dy, dwte, dwpe;
        pair_rand(&wte, dt, 2, (int64_t[]){V, C}, -1, 1);
        pair_rand(&wpe, dt, 2, (int64_t[]){T + 3, C}, -1, 1);
        pair_rand(&dy, dt, 3, (int64_t[]){B, T, C}, -1, 1);
        pair_out(&y, dt, 3, (int64_t[]){B, T, C});
        pair_acc(&dwte, 2, (int64_t[]){V, C});
        pair_acc(&dwpe, 2, (int64_t[]){T + 3, C});
        cpu->embedding_forward(cpu, &y.c, tok, &wte.c, &wpe.c, B, T, C);
        gpu->embedding_forward(gpu, &y.g, dtok, &wte.g, &wpe.g, B, T, C);
        pair_expect(&y, 0.0, "embedding_forward (exact)");
        cpu->embedding_backward(cpu, &dwte.c, &dwpe.c, &dy.c, tok, B, T, C, 0.5f);
        gpu->embedding_backward(gpu, &dwte.g, &dwpe.g, &dy.g, dtok, B, T, C, 0.5f);
        pair_expect(&dwte, 0.0, "embedding_backward dwte (same order: exact)");
        pair_expect(&dwpe, 0.0, "embedding_backward dwpe (exact)");
        struct pair *all[] = {&wte, &wpe, &y, &dy, &dwte, &dwpe};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
            pair_free(all[i]);
    }
    gpu->free(gpu, dtok);
}

Test(cuda_backend, attention, .init = open_both, .fini = close_both)
{
    rng_state = 11;
    int64_t B = 2, T = 33, C = 48, H = 3;
    for (int d = 0; d < 3; d++) {
        enum dtype dt = all_dtypes[d];
        struct pair qkv, out, probs, dout, dqkv;
        pair_rand(&qkv, dt, 3, (int64_t[]){B, T, 3 * C}, -1, 1);
        pair_rand(&dout, dt, 3, (int64_t[]){B, T, C}, -1, 1);
        pair_out(&out, dt, 3, (int64_t[]){B, T, C});
        pair_out(&probs, dt, 4, (int64_t[]){B, H, T, T});
        pair_out(&dqkv, dt, 3, (int64_t[]){B, T, 3 * C});
        cpu->attention_forward(cpu, &out.c, &probs.c, &qkv.c, B, T, C, H);
        gpu->attention_forward(gpu, &out.g, &probs.g, &qkv.g, B, T, C, H);
        pair_expect(&probs, tol_of(dt), "attention_forward probs");
        pair_expect(&out, tol_of(dt), "attention_forward out");
        cpu->attention_backward(cpu, &dqkv.c, &dout.c, &qkv.c, &probs.c, B, T, C, H);
        gpu->attention_backward(gpu, &dqkv.g, &dout.g, &qkv.g, &probs.g, B, T, C, H);
        pair_expect(&dqkv, dt == DT_FP32 ? 1e-5 : 2e-2, "attention_backward dqkv");
        struct pair *all[] = {&qkv, &out, &probs, &dout, &dqkv};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
            pair_free(all[i]);
    }
}

/* ---- losses, statistics, optimizers ------------------------------------------------------------- */

Test(cuda_backend, losses, .init = open_both, .fini = close_both)
{
    rng_state = 12;
    int64_t N = 65, K = 37;
    int32_t labels[65], correct_c[65], correct_g[65];
    for (int i = 0; i < N; i++)
        labels[i] = (int32_t)(next_u64() % (uint64_t)K);
    int32_t *dlab = ints_upload(labels, (size_t)N);
    int32_t *dcor = gpu->alloc(gpu, (size_t)N * sizeof(int32_t));
    for (int d = 0; d < 3; d++) {
        enum dtype dt = all_dtypes[d];
        struct pair x, t, losses, dx;
        pair_rand(&x, dt, 2, (int64_t[]){N, K}, -4, 4);
        pair_rand(&t, DT_FP32, 2, (int64_t[]){N, K}, -1, 1);
        pair_out(&losses, DT_FP32, 1, &N);
        pair_out(&dx, dt, 2, (int64_t[]){N, K});
        cpu->xent_forward_backward(cpu, &losses.c, correct_c, &dx.c, &x.c, labels, N, K, 128.0f);
        gpu->xent_forward_backward(gpu, &losses.g, dcor, &dx.g, &x.g, dlab, N, K, 128.0f);
        pair_expect(&losses, 1e-6, "xent losses");
        pair_expect(&dx, tol_of(dt) * 0.1, "xent dlogits");
        gpu->download(gpu, correct_g, dcor, sizeof correct_g);
        cr_assert_eq(memcmp(correct_c, correct_g, sizeof correct_c), 0, "xent correct flags differ");
        cpu->mse_forward_backward(cpu, &losses.c, &dx.c, &x.c, &t.c, N, K, 2.0f);
        gpu->mse_forward_backward(gpu, &losses.g, &dx.g, &x.g, &t.g, N, K, 2.0f);
        pair_expect(&losses, 1e-6, "mse losses");
        pair_expect(&dx, tol_of(dt) * 0.1, "mse dy");
        pair_free(&x);
        pair_free(&t);
        pair_free(&losses);
        pair_free(&dx);
    }
    gpu->free(gpu, dlab);
    gpu->free(gpu, dcor);
}

Test(cuda_backend, grad_stats_one_launch_many_tensors, .init = open_both, .fini = close_both)
{
    rng_state = 13;
    enum { NT = 7 };
    int64_t sizes[NT] = {1, 10, 1000, 65537, 3, 200000, 17};
    struct pair t[NT];
    for (int i = 0; i < NT; i++)
        pair_rand(&t[i], DT_FP32, 1, &sizes[i], -3, 3);
    /* inject non-finite values into tensors 2 and 5 (both backends) */
    float bad[3] = {INFINITY, NAN, -INFINITY};
    ((float *)t[2].c.data)[7] = bad[0];
    ((float *)t[5].c.data)[0] = bad[1];
    ((float *)t[5].c.data)[199999] = bad[2];
    gpu->upload(gpu, (float *)t[2].g.data + 7, &bad[0], sizeof(float));
    gpu->upload(gpu, (float *)t[5].g.data, &bad[1], sizeof(float));
    gpu->upload(gpu, (float *)t[5].g.data + 199999, &bad[2], sizeof(float));
    const struct tensor *gc[NT], *gg[NT];
    for (int i = 0; i < NT; i++) {
        gc[i] = &t[i].c;
        gg[i] = &t[i].g;
    }
    int64_t inf_c[NT], nan_c[NT], inf_g[NT], nan_g[NT];
    struct grad_stats sc = {.n_inf = inf_c, .n_nan = nan_c}, sg = {.n_inf = inf_g, .n_nan = nan_g};
    cpu->grad_stats(cpu, gc, NT, &sc);
    gpu->grad_stats(gpu, gg, NT, &sg);
    check_gpu();
    cr_assert(sg.found_nonfinite && sc.found_nonfinite);
    for (int i = 0; i < NT; i++) {
        cr_assert_eq(inf_g[i], inf_c[i], "tensor %d: inf count %lld vs %lld", i, (long long)inf_g[i], (long long)inf_c[i]);
        cr_assert_eq(nan_g[i], nan_c[i], "tensor %d: nan count", i);
    }
    cr_assert(fabs(sg.sumsq - sc.sumsq) <= 1e-12 * sc.sumsq, "sumsq %.17g vs %.17g", sg.sumsq, sc.sumsq);
    cr_assert_eq(sg.absmax, sc.absmax, "absmax %.17g vs %.17g", sg.absmax, sc.absmax);
    struct grad_stats again = {.n_inf = inf_g, .n_nan = nan_g};
    gpu->grad_stats(gpu, gg, NT, &again);
    cr_assert_eq(memcmp(&again.sumsq, &sg.sumsq, sizeof(double)), 0, "grad_stats must reproduce bit for bit");
    for (int i = 0; i < NT; i++)
        pair_free(&t[i]);
}

Test(cuda_backend, count_zeros, .init = open_both, .fini = close_both)
{
    rng_state = 14;
    for (int d = 0; d < 3; d++) {
        struct pair x;
        pair_rand(&x, all_dtypes[d], 1, (int64_t[]){100003}, -1, 1);
        cpu->act_forward(cpu, ACT_RELU, &x.c, &x.c);
        gpu->act_forward(gpu, ACT_RELU, &x.g, &x.g);
        int64_t zc = cpu->count_zeros(cpu, &x.c), zg = gpu->count_zeros(gpu, &x.g);
        cr_assert_eq(zg, zc, "count_zeros %lld vs %lld", (long long)zg, (long long)zc);
        cr_assert(zc > 40000);
        pair_free(&x);
    }
}

Test(cuda_backend, optimizers, .init = open_both, .fini = close_both)
{
    rng_state = 15;
    int64_t n = 10007;
    for (int which = 0; which < 3; which++) {
        struct pair p, g, m, v, low;
        pair_rand(&p, DT_FP32, 1, &n, -1, 1);
        pair_rand(&g, DT_FP32, 1, &n, -100, 100);
        pair_rand(&m, DT_FP32, 1, &n, -0.1f, 0.1f);
        pair_rand(&v, DT_FP32, 1, &n, 0, 0.1f);
        pair_out(&low, which == 1 ? DT_FP16 : DT_BF16, 1, &n);
        struct optim_update_args a = {.grad_mul = 1.0f / 128.0f, .lr = 1e-2f, .weight_decay = 0.1f, .beta1 = 0.9f,
                                      .beta2 = 0.999f, .eps = 1e-8f, .step = 3, .momentum = 0.9f,
                                      .nesterov = which == 2, .first_step = false};
        for (int side = 0; side < 2; side++) {
            struct backend *be = side ? gpu : cpu;
            a.master = side ? &p.g : &p.c;
            a.grad = side ? &g.g : &g.c;
            a.m = side ? &m.g : &m.c;
            a.v = side ? &v.g : &v.c;
            a.lowp = side ? &low.g : &low.c;
            if (which == 0)
                be->adamw_update(be, &a);
            else
                be->sgd_update(be, &a);
        }
        pair_expect(&p, 1e-6, which == 0 ? "adamw master" : "sgd master");
        pair_expect(&m, 1e-6, "moment / momentum buffer");
        if (which == 0)
            pair_expect(&v, 1e-6, "adamw v");
        pair_expect(&low, 1e-3, "low-precision copy written in the same pass");
        struct pair *all[] = {&p, &g, &m, &v, &low};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
            pair_free(all[i]);
    }
}

/* ---- training ----------------------------------------------------------------------------------- */

static void mlp_config(struct config *cfg, const char *device, const char *mode)
{
    struct amp_error err = {0};
    cr_assert_eq(config_load(cfg, AMP_SOURCE_DIR "/configs/fashion_mlp.yaml", &err), AMP_OK, "%s", err.msg);
    char dev[64], prec[64];
    snprintf(dev, sizeof dev, "run.device=%s", device);
    snprintf(prec, sizeof prec, "precision.mode=%s", mode);
    const char *ov[] = {dev, prec, "data.batch_size=64", "run.steps=200", NULL};
    for (int i = 0; ov[i]; i++)
        cr_assert_eq(config_apply_override(cfg, ov[i], &err), AMP_OK, "%s: %s", ov[i], err.msg);
    cr_assert_eq(config_finalize(cfg, &err), AMP_OK, "%s", err.msg);
}

/* Mean loss over steps [from, to) of a 200-step run on `device`. */
static void train_losses(const char *device, const char *mode, double *losses, int steps)
{
    struct config cfg;
    mlp_config(&cfg, device, mode);
    struct trainer t;
    struct amp_error err = {0};
    cr_assert_eq(trainer_setup(&t, &cfg, &err), AMP_OK, "%s: %s", device, err.msg);
    for (int s = 0; s < steps; s++) {
        struct step_record rec;
        cr_assert_eq(trainer_step(&t, &rec, &err), AMP_OK, "%s %s step %d: %s", device, mode, s, err.msg);
        losses[s] = rec.loss;
    }
    trainer_teardown(&t);
}

Test(cuda_backend, fashion_mlp_tracks_the_cpu_in_every_mode, .timeout = 1200)
{
    setenv("OPENBLAS_NUM_THREADS", "1", 1);
    if (backend_cuda_device_count() <= 0)
        cr_skip_test("no CUDA device: GPU training was not run");
    if (access(FASHION, R_OK) != 0)
        cr_skip_test("Fashion-MNIST not installed (Debian package dataset-fashion-mnist)");
    const char *modes[] = {"fp32", "fp16-static", "fp16-dynamic", "bf16"};
    enum { STEPS = 200 };
    for (int i = 0; i < 4; i++) {
        double lc[STEPS], lg[STEPS];
        train_losses("cpu", modes[i], lc, STEPS);
        train_losses("cuda", modes[i], lg, STEPS);
        double mc = 0.0, mg = 0.0;
        for (int s = STEPS - 20; s < STEPS; s++) {
            mc += lc[s] / 20.0;
            mg += lg[s] / 20.0;
        }
        cr_log_info("%s: mean loss of the last 20 steps: cpu %.4f, cuda %.4f (first step %.4f / %.4f)", modes[i], mc,
                    mg, lc[0], lg[0]);
        cr_assert(fabs(lg[0] - lc[0]) <= 1e-3 * fabs(lc[0]) + 1e-3, "%s: first-step loss %g vs %g", modes[i], lg[0],
                  lc[0]);
        cr_assert(fabs(mg - mc) <= 0.05 * mc + 0.02, "%s: GPU loss curve left the CPU's: %g vs %g", modes[i], mg, mc);
        cr_assert(mg < lg[0], "%s: GPU training did not reduce the loss", modes[i]);
    }
}

/* N steps straight and k steps + `ampTrain resume` on the GPU give byte-identical checkpoints and
 * logs (test_resume.c's check, with run.device=cuda). */
Test(cuda_backend, resume_is_bit_exact_on_the_gpu, .timeout = 900)
{
    if (backend_cuda_device_count() <= 0)
        cr_skip_test("no CUDA device: GPU resume was not run");
    if (access(FASHION, R_OK) != 0)
        cr_skip_test("Fashion-MNIST not installed (Debian package dataset-fashion-mnist)");
    const char *modes[] = {"fp32", "bf16", "fp16-dynamic"};
    enum { N = 12, K = 5 };
    for (int i = 0; i < 3; i++) {
        make_scratch();
        struct result r = amp("run configs/fashion_mlp.yaml " SMALL " run.device=cuda precision.mode=%s run.steps=%d "
                              "run.out_dir=%s/a", modes[i], N, scratch);
        cr_assert_eq(r.code, 0, "%s straight run:\n%s", modes[i], r.out);
        cr_assert(strstr(r.out, "device: cuda:0"), "%s: not on the GPU:\n%s", modes[i], r.out);
        r = amp("run configs/fashion_mlp.yaml " SMALL " run.device=cuda precision.mode=%s run.steps=%d "
                "run.out_dir=%s/b", modes[i], K, scratch);
        cr_assert_eq(r.code, 0, "%s first part:\n%s", modes[i], r.out);
        r = amp("resume %s/b/ckpt-%d.h5 run.steps=%d", scratch, K, N);
        cr_assert_eq(r.code, 0, "%s resume:\n%s", modes[i], r.out);
        char a[512], b[512];
        snprintf(a, sizeof a, "%s/a/ckpt-%d.h5", scratch, N);
        snprintf(b, sizeof b, "%s/b/ckpt-%d.h5", scratch, N);
        cr_assert_geq(assert_same_tensors(a, b), 6, "%s: too few tensors compared", modes[i]);
        snprintf(a, sizeof a, "%s/a/scale_log.csv", scratch);
        snprintf(b, sizeof b, "%s/b/scale_log.csv", scratch);
        assert_same_logs(a, b);
        remove_scratch();
    }
}

/* ---- device selection (no GPU needed) ----------------------------------------------------------- */

Test(cuda_backend, device_selection_follows_the_hardware)
{
    struct backend *be = NULL;
    struct amp_error err = {0};
    char chosen[256];
    int count = backend_cuda_device_count();
    cr_assert(count >= 0);
    cr_assert_eq(backend_open(&be, "auto", chosen, sizeof chosen, &err), AMP_OK, "%s", err.msg);
    if (count == 0) {
        cr_assert_str_eq(chosen, "device: cpu (no CUDA device found)");
        cr_assert_str_eq(be->name, "cpu");
    } else {
        cr_assert(strncmp(chosen, "device: cuda:0 (", 16) == 0, "chosen line: %s", chosen);
        cr_assert(strstr(chosen, ", sm_"), "chosen line names the architecture: %s", chosen);
        cr_assert_str_eq(be->name, "cuda:0");
    }
    backend_close(be);
    be = NULL;
    cr_assert_eq(backend_open(&be, "cuda:99", chosen, sizeof chosen, &err), AMP_ERR_CONFIG);
    cr_assert_null(be);
    cr_assert(strstr(err.msg, "cuda:99"), "message names the request: %s", err.msg);
    cr_assert(strstr(err.hint, "run.device"), "hint says what to set: %s", err.hint);
    if (count == 0) {
        cr_assert_eq(backend_open(&be, "cuda", chosen, sizeof chosen, &err), AMP_ERR_CONFIG);
        cr_assert(strstr(err.msg, "no CUDA device"), "%s", err.msg);
    }
    cr_assert_eq(backend_open(&be, "cpu", chosen, sizeof chosen, &err), AMP_OK);
    cr_assert_str_eq(chosen, "device: cpu");
    backend_close(be);
}

#else /* built without the CUDA backend */

Test(cuda_backend, needs_the_cuda_backend)
{
    cr_skip_test("the CUDA backend is not built (no nvcc or cuDNN found, or -DAMP_CUDA=OFF): kernels/ was not "
                 "tested");
}

#endif
