/*
 * test_cuda_backend.c — every op of the CUDA backend (kernels/cuda/) against the CPU reference backend, the
 * device selection of backend_open, and fashion_mlp training on the GPU against the CPU.
 *
 * Each op test draws fresh seeded inputs, runs the op on both backends with the same bits (16-bit
 * tensors hold the same patterns on both), fills the GPU outputs with NaN first (0xFF bytes: NaN in
 * fp32, fp16 and bf16) so an unwritten element fails, and compares by relative L2 error:
 * fp32 1e-5, TF32 2^-9 sqrt(k) (tf32_tolerance), fp16/bf16 1e-2 (a 16-bit output may differ by an ulp where the summation
 * order moves a value across a rounding boundary); convolution weight gradients by dw_tolerance (their
 * reduction length and path). Dropout masks, pooling and embeddings are held
 * tighter where the arithmetic is the same.
 * Without a GPU these tests skip and are counted as skipped: this file has its own main, which exits 77
 * (CTest's SKIP_RETURN_CODE) when any test skipped and none failed. The device-selection tests need no
 * GPU and always run. Built without the CUDA backend, the file holds one test that skips.
 */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <criterion/hooks.h>
#include <criterion/logging.h>

#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h" /* backend_open, backend_cpu_create, the op table */
#include "sround.h" /* sr_seed: bf16 master weights */

#include "skip_main.h" /* main: exit 77 (Skipped) when tests skipped and none failed */

#ifdef AMP_HAVE_CUDA

#include "ckpt_testlib.h" /* amp(), assert_same_tensors, assert_same_logs: the resume test */
#include "train.h"        /* trainer_setup, trainer_step, trainer_flush: the training comparison */

#define FASHION "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"

/* ---- fixtures ----------------------------------------------------------------------------------- */

static struct backend *cpu, *gpu;
static uint64_t rng_state;

static void open_both(void)
{
    setenv("OPENBLAS_NUM_THREADS", "1", 1);
    if (backend_cuda_device_count() <= 0)
        cr_skip_test("no CUDA device (no NVIDIA driver, or cudaGetDeviceCount found none): the CUDA backend was not run");
    struct amp_error err = {0};
    cr_assert_eq(backend_open(&gpu, "cuda:0", NULL, 0, &err), AMP_OK, "%s (hint: %s)", err.msg, err.hint);
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

/* Relative L2 error of GPU tensor `gt` against CPU tensor `ct` (same dtype and numel); every GPU element
 * must be finite where the CPU's is (a NaN left by the poison fails here). */
static double rel_l2(const struct tensor *gt, const struct tensor *ct, const char *what)
{
    check_gpu();
    size_t n = ct->numel, bytes = tensor_bytes(ct);
    void *raw = malloc(bytes);
    float *g = malloc(n * sizeof *g), *c = malloc(n * sizeof *c);
    cr_assert(raw && g && c);
    gpu->download(gpu, raw, gt->data, bytes);
    dtype_convert(g, DT_FP32, raw, ct->dtype, n);
    tensor_to_host_f32(ct, c);
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
    free(raw);
    free(g);
    free(c);
    return sqrt(num) / (den > 0.0 ? sqrt(den) : 1.0);
}

static double pair_expect(const struct pair *p, double tol, const char *what)
{
    double rel = rel_l2(&p->g, &p->c, what);
    cr_assert(rel <= tol, "%s (%s): relative L2 error %.3g > %.3g", what, dtype_name(p->c.dtype), rel, tol);
    return rel;
}

/* int32 buffers (labels, tokens, correct) on both backends */
static int32_t *ints_upload(const int32_t *h, size_t n)
{
    int32_t *d = gpu->alloc(gpu, n * sizeof *d);
    cr_assert_not_null(d);
    gpu->upload(gpu, d, h, n * sizeof *d);
    return d;
}

/* `bytes` of `be`'s memory holding a copy of `host`: the scalars and small structs a step keeps in backend
 * memory (loss seed, gradient check, step state). Free with be->free. */
static void *be_put(struct backend *be, const void *host, size_t bytes)
{
    void *d = be->alloc(be, bytes);
    cr_assert_not_null(d, "%s: alloc of %zu bytes", be->name, bytes);
    be->upload(be, d, host, bytes);
    return d;
}

/* `bytes` of `be`'s memory filled with 0xFF (NaN in every float type, -1 in every integer): what an op
 * leaves unwritten shows. */
static void *be_poisoned(struct backend *be, size_t bytes)
{
    void *h = malloc(bytes);
    cr_assert_not_null(h);
    memset(h, 0xFF, bytes);
    void *d = be_put(be, h, bytes);
    free(h);
    return d;
}

static const enum dtype all_dtypes[] = {DT_FP32, DT_FP16, DT_BF16};

/* count_zeros into an accumulator in be's memory that starts at `start`, read back. */
static int64_t zeros_of(struct backend *be, const struct tensor *t, int64_t start)
{
    int64_t *acc = be_put(be, &start, sizeof start), got = -1;
    be->count_zeros(be, t, acc);
    be->download(be, &got, acc, sizeof got);
    be->free(be, acc);
    return got;
}

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

/* TF32 keeps 10 of fp32's 23 mantissa bits. Truncated (not rounded, as Hopper may), an input is off by
 * less than 2^-10 of itself and a product of two by less than 2^-9; over k products of random sign the
 * error of a sum is at most 2^-9 sum|a b| and about 2^-9 sqrt(k) rms(a b) / sqrt(3), against a sum of about
 * sqrt(k) rms(a b). So the relative error is about 2^-9 / sqrt(3) = 1.1e-3 (a fixed 1e-3 would fail it)
 * and below 2^-9 sqrt(k) * E|ab| / rms(ab) for uniform inputs: 2^-9 sqrt(k) bounds it with margin. */
/* ---- fp8 (precision.mode fp8) ------------------------------------------------------------------- */

/* Both backends' bytes of a tensor pair, compared exactly. */
static void pair_expect_bits(const struct pair *p, const char *what)
{
    check_gpu();
    size_t bytes = tensor_bytes(&p->c);
    unsigned char *g = malloc(bytes);
    cr_assert_not_null(g);
    gpu->download(gpu, g, p->g.data, bytes);
    const unsigned char *c = p->c.data;
    for (size_t i = 0; i < bytes; i++)
        cr_assert_eq(g[i], c[i], "%s: byte %zu: GPU 0x%02x, CPU 0x%02x", what, i, g[i], c[i]);
    free(g);
}

static float gpu_float(const float *d)
{
    float v;
    gpu->download(gpu, &v, d, sizeof v);
    return v;
}

/* The scaled cast: the same codes, the same amax and (recipe current) the same scale, bit for bit. */
Test(cuda_backend, fp8_cast_matches_the_cpu_bit_for_bit, .init = open_both, .fini = close_both)
{
    const enum dtype dsts[2] = {DT_FP8_E4M3, DT_FP8_E5M2}, srcs[2] = {DT_FP32, DT_BF16};
    for (int d = 0; d < 2; d++)
        for (int s = 0; s < 2; s++)
            for (int current = 0; current < 2; current++) {
                int64_t n = 100003;
                struct pair src, dst;
                pair_rand(&src, srcs[s], 1, &n, -900.0f, 900.0f); /* saturates E4M3 at scale 1 */
                pair_out(&dst, dsts[d], 1, &n);
                float init[3] = {current ? 1.0f : 0.37f, 1.0f, 2.0f}; /* scale, scale_inv, amax */
                float cs[3];
                memcpy(cs, init, sizeof cs);
                float *gs = be_put(gpu, init, sizeof init);
                int64_t cc[4] = {0}, gc[4] = {-1};
                int64_t *gcd = be_put(gpu, cc, sizeof cc);
                struct fp8_cast_args a = {.dst = &dst.c, .src = &src.c, .scale = &cs[0], .scale_inv = &cs[1],
                                          .amax = &cs[2], .current = current, .margin = 1, .counts = cc};
                cpu->fp8_cast(cpu, &a);
                a.dst = &dst.g, a.src = &src.g, a.scale = &gs[0], a.scale_inv = &gs[1], a.amax = &gs[2], a.counts = gcd;
                gpu->fp8_cast(gpu, &a);
                gpu->download(gpu, gc, gcd, sizeof gc);
                gpu->free(gpu, gcd);
                for (int i = 0; i < 4; i++)
                    cr_assert_eq(gc[i], cc[i], "fp8_cast counter %d: GPU %lld, CPU %lld", i, (long long)gc[i],
                                 (long long)cc[i]);
                char what[96];
                snprintf(what, sizeof what, "fp8_cast %s <- %s current %d", dtype_name(dsts[d]), dtype_name(srcs[s]),
                         current);
                pair_expect_bits(&dst, what);
                for (int i = 0; i < 3; i++)
                    cr_assert_eq(gpu_float(&gs[i]), cs[i], "%s: state %d: GPU %.9g, CPU %.9g", what, i,
                                 (double)gpu_float(&gs[i]), (double)cs[i]);
                gpu->free(gpu, gs);
                pair_free(&src);
                pair_free(&dst);
            }
}

/* One update of two groups (the forward's E4M3 and the backward's E5M2, of different sizes: the GPU's one launch
 * numbers their tensors one after the other), with pending amaxes and without, against the CPU's, bit for bit. */
Test(cuda_backend, fp8_update_matches_the_cpu_bit_for_bit, .init = open_both, .fini = close_both)
{
    const int len = 7, n[2] = {300, 129};
    const float fmax[2] = {448.0f, 57344.0f};
    for (int mr = 0; mr < 2; mr++)
        for (int with_pending = 0; with_pending < 2; with_pending++) {
            float *hist[2], *scale[2], *pend[2], *gh[2], *gsc[2], *gp[2];
            struct fp8_update_args a = {.ngroups = 2, .len = len, .row = 3, .most_recent = mr, .margin = 2};
            struct fp8_update_args ga = a;
            for (int g = 0; g < 2; g++) {
                hist[g] = malloc((size_t)(len * n[g]) * sizeof *hist[g]);
                scale[g] = malloc((size_t)(2 * n[g]) * sizeof *scale[g]);
                pend[g] = malloc((size_t)n[g] * sizeof *pend[g]);
                cr_assert(hist[g] && scale[g] && pend[g]);
                for (int i = 0; i < len * n[g]; i++)
                    hist[g][i] = i % 13 == 0 ? 0.0f : uniform(0.0f, 1000.0f);
                for (int i = 0; i < 2 * n[g]; i++)
                    scale[g][i] = uniform(0.5f, 2.0f);
                for (int i = 0; i < n[g]; i++)
                    pend[g][i] = i % 5 == 0 ? 0.0f : uniform(0.0f, 3000.0f);
                gh[g] = be_put(gpu, hist[g], (size_t)(len * n[g]) * sizeof *hist[g]);
                gsc[g] = be_put(gpu, scale[g], (size_t)(2 * n[g]) * sizeof *scale[g]);
                gp[g] = be_put(gpu, pend[g], (size_t)n[g] * sizeof *pend[g]);
                a.groups[g] = (struct fp8_update_group){.scale = scale[g], .scale_inv = scale[g] + n[g],
                                                        .history = hist[g], .pending = with_pending ? pend[g] : NULL,
                                                        .n = n[g], .fmax = fmax[g]};
                ga.groups[g] = (struct fp8_update_group){.scale = gsc[g], .scale_inv = gsc[g] + n[g],
                                                         .history = gh[g], .pending = with_pending ? gp[g] : NULL,
                                                         .n = n[g], .fmax = fmax[g]};
            }
            cpu->fp8_update(cpu, &a);
            gpu->fp8_update(gpu, &ga);
            for (int g = 0; g < 2; g++) {
                float *back = malloc((size_t)(len * n[g]) * sizeof *back);
                cr_assert_not_null(back);
                gpu->download(gpu, back, gsc[g], (size_t)(2 * n[g]) * sizeof *back);
                cr_assert_eq(memcmp(back, scale[g], (size_t)(2 * n[g]) * sizeof *back), 0,
                             "group %d scales (most_recent %d, pending %d)", g, mr, with_pending);
                gpu->download(gpu, back, gh[g], (size_t)(len * n[g]) * sizeof *back);
                cr_assert_eq(memcmp(back, hist[g], (size_t)(len * n[g]) * sizeof *back), 0,
                             "group %d history (most_recent %d, pending %d)", g, mr, with_pending);
                gpu->download(gpu, back, gp[g], (size_t)n[g] * sizeof *back);
                cr_assert_eq(memcmp(back, pend[g], (size_t)n[g] * sizeof *back), 0,
                             "group %d pending (most_recent %d, pending %d)", g, mr, with_pending);
                gpu->free(gpu, gh[g]);
                gpu->free(gpu, gsc[g]);
                gpu->free(gpu, gp[g]);
                free(hist[g]);
                free(scale[g]);
                free(pend[g]);
                free(back);
            }
        }
}

/* A product's (m, n) output C in dc (random where beta accumulates onto it, else an output), its bias (n) where
 * asked and GELU's pre-activation (m, n) where asked: the fp8 and block-scaled product tests share these. */
static void gemm_outputs(struct pair *c, struct pair *bi, struct pair *aux, enum dtype dc, int64_t m, int64_t n,
                         bool bias, float beta, bool gelu)
{
    if (beta != 0.0f)
        pair_rand(c, dc, 1, (int64_t[]){m * n}, -1, 1);
    else
        pair_out(c, dc, 1, (int64_t[]){m * n});
    if (bias)
        pair_rand(bi, DT_FP32, 1, (int64_t[]){n}, -1, 1);
    if (gelu)
        pair_out(aux, dc, 1, (int64_t[]){m * n});
}

/* Products of fp8 operands against the CPU: cuBLASLt's FP8 path (sm_89+, every dimension a multiple of 16, with
 * the transposes Hopper's TN layout needs) and the bf16 emulation (odd shapes), all the layouts the linear layer
 * uses, bias, accumulation and the GELU epilogue. */
/* Returns C's relative L2 error against the CPU. */
static double fp8_gemm_case(enum dtype da, enum dtype db, enum dtype dc, bool ta, bool tb, int64_t m, int64_t n,
                            int64_t k, bool bias, float beta, bool gelu)
{
    struct pair a, b, c, bi, aux;
    pair_rand(&a, da, 1, (int64_t[]){m * k}, -400.0f, 400.0f);
    pair_rand(&b, db, 1, (int64_t[]){k * n}, -400.0f, 400.0f);
    gemm_outputs(&c, &bi, &aux, dc, m, n, bias, beta, gelu);
    float sc[2] = {1.0f / 300.0f, 0.0021f};
    float *gs = be_put(gpu, sc, sizeof sc);
    a.c.scale_inv = &sc[0], b.c.scale_inv = &sc[1], a.g.scale_inv = &gs[0], b.g.scale_inv = &gs[1];
    struct gemm_args g = {.trans_a = ta, .trans_b = tb, .m = m, .n = n, .k = k, .alpha = 1.0f, .beta = beta,
                          .batch = 1, .epilogue = gelu ? GEMM_EPI_GELU_TANH : GEMM_EPI_NONE};
    g.a = &a.c, g.b = &b.c, g.c = &c.c, g.bias = bias ? &bi.c : NULL, g.aux = gelu ? &aux.c : NULL;
    cpu->gemm(cpu, &g);
    g.a = &a.g, g.b = &b.g, g.c = &c.g, g.bias = bias ? &bi.g : NULL, g.aux = gelu ? &aux.g : NULL;
    gpu->gemm(gpu, &g);
    char what[160];
    snprintf(what, sizeof what, "fp8 gemm %s x %s -> %s ta=%d tb=%d (%lld, %lld, %lld) bias=%d beta=%g gelu=%d",
             dtype_name(da), dtype_name(db), dtype_name(dc), ta, tb, (long long)m, (long long)n, (long long)k, bias,
             beta, gelu);
    /* an fp32 C shows the summation: the emulation's fp32 sums differ from the CPU's by their order (1e-5), the
     * native FP8 path's (m, n, k multiples of 16 on sm_89 and later) by Hopper's narrower accumulator: about
     * 1e-4 relative on these operands by a simulation modelled on the DeepSeek-V3 report's description, and
     * 1.12e-4 measured on the H200 (kernels/cuda/fp8.cu) */
    const bool native_shape = m % 16 == 0 && n % 16 == 0 && k % 16 == 0;
    double rel = pair_expect(&c, dc == DT_FP32 ? (native_shape ? 1e-3 : 1e-5) : 1e-2, what);
    if (gelu)
        pair_expect(&aux, 1e-2, what);
    gpu->free(gpu, gs);
    pair_free(&a);
    pair_free(&b);
    pair_free(&c);
    if (bias)
        pair_free(&bi);
    if (gelu)
        pair_free(&aux);
    return rel;
}

Test(cuda_backend, fp8_gemm_matches_the_cpu, .init = open_both, .fini = close_both)
{
    const int64_t shapes[2][3] = {{64, 96, 128}, {37, 50, 72}}; /* cuBLASLt FP8, and the emulation */
    for (int s = 0; s < 2; s++) {
        int64_t m = shapes[s][0], n = shapes[s][1], k = shapes[s][2];
        /* the linear layer's three products: forward x W^T (bias, GELU), dx = dy W, dW = dy^T x (accumulating) */
        fp8_gemm_case(DT_FP8_E4M3, DT_FP8_E4M3, DT_BF16, false, true, m, n, k, true, 0.0f, false);
        fp8_gemm_case(DT_FP8_E4M3, DT_FP8_E4M3, DT_BF16, false, true, m, n, k, true, 0.0f, true);
        fp8_gemm_case(DT_FP8_E5M2, DT_FP8_E4M3, DT_BF16, false, false, m, n, k, false, 0.0f, false);
        fp8_gemm_case(DT_FP8_E5M2, DT_FP8_E4M3, DT_FP32, true, false, m, n, k, false, 0.0f, false);
        fp8_gemm_case(DT_FP8_E5M2, DT_FP8_E4M3, DT_FP32, true, false, m, n, k, false, 1.0f, false);
        fp8_gemm_case(DT_FP8_E4M3, DT_FP8_E5M2, DT_FP32, true, true, m, n, k, false, 0.0f, false);
    }
}

/* An empty contraction (k = 0, which CUDA's fp8 path keeps for native on sm_89 and later: 0 is a multiple of 16) gives
 * the CPU's C = beta * C (+ the bias). dW's two operands and dx's B are stored the other way and come without
 * transposed codes, so the backend transposes them into scratch first: an empty operand must launch no transpose (a
 * grid of 0 blocks is an invalid launch, which check_gpu sees). */
Test(cuda_backend, fp8_gemm_with_an_empty_k_matches_the_cpu, .init = open_both, .fini = close_both)
{
    fp8_gemm_case(DT_FP8_E5M2, DT_FP8_E4M3, DT_FP32, true, false, 32, 48, 0, false, 1.0f, false);  /* dW += */
    fp8_gemm_case(DT_FP8_E5M2, DT_FP8_E4M3, DT_FP32, true, false, 32, 48, 0, false, 0.0f, false);  /* dW = */
    fp8_gemm_case(DT_FP8_E5M2, DT_FP8_E4M3, DT_BF16, false, false, 32, 48, 0, false, 0.0f, false); /* dx */
    fp8_gemm_case(DT_FP8_E4M3, DT_FP8_E4M3, DT_BF16, false, true, 32, 48, 0, true, 0.0f, false);   /* y = b */
}

/* The device's compute capability as major * 10 + minor, from the build description's "compute capability
 * 9.0"; 0 where it says none. */
static int device_cc(void)
{
    char desc[1024];
    backend_describe_build(desc, sizeof desc);
    const char *at = strstr(desc, "compute capability ");
    int major = 0, minor = 0;
    return at && sscanf(at, "compute capability %d.%d", &major, &minor) == 2 ? major * 10 + minor : 0;
}

/* On a GPU with fp8 tensor cores (compute capability 8.9 and later) the products of shapes in multiples of 16
 * run on cuBLASLt's fp8 kernels, not the bf16 emulation: cuBLASLt refused them on the H200 while a scale
 * factor sat 4 bytes past a 16-byte boundary, as lib/base/fp8.c keeps a layer's scales and as fp8_gemm_case's B
 * scale is (docs/precision.md "fp8"), and the backend then warned and emulated, which fp8_gemm_matches_the_cpu
 * cannot tell from a native product. The warning goes to stderr, so stderr goes to a file here. The fp32
 * products' errors against the CPU (the native accumulator's) are printed for docs/precision.md. */
Test(cuda_backend, fp8_gemm_runs_native_on_fp8_tensor_cores, .init = open_both, .fini = close_both)
{
    int cc = device_cc();
    if (cc < 89)
        cr_skip_test("compute capability %d.%d: no fp8 tensor cores, fp8 products are emulated", cc / 10, cc % 10);
    FILE *log = tmpfile();
    cr_assert_not_null(log);
    fflush(stderr);
    int saved = dup(STDERR_FILENO);
    cr_assert(saved >= 0 && dup2(fileno(log), STDERR_FILENO) >= 0);
    double fwd = fp8_gemm_case(DT_FP8_E4M3, DT_FP8_E4M3, DT_FP32, false, true, 64, 96, 128, true, 0.0f, false);
    double dx = fp8_gemm_case(DT_FP8_E5M2, DT_FP8_E4M3, DT_BF16, false, false, 64, 96, 128, false, 0.0f, false);
    double dw = fp8_gemm_case(DT_FP8_E5M2, DT_FP8_E4M3, DT_FP32, true, false, 256, 384, 512, false, 1.0f, false);
    fflush(stderr);
    dup2(saved, STDERR_FILENO);
    close(saved);
    char text[4096] = {0};
    rewind(log);
    size_t got = fread(text, 1, sizeof text - 1, log);
    fclose(log);
    fwrite(text, 1, got, stderr); /* what the products said, back where it belongs */
    cr_assert(!strstr(text, "refused a native fp8 product"),
              "compute capability %d.%d: a native fp8 product was refused and emulated: %s", cc / 10, cc % 10, text);
    printf("fp8 native products on compute capability %d.%d: relative L2 error against the CPU: forward (fp32 C, "
           "64x96x128) %.3g, dx (bf16 C) %.3g, dW (fp32 C, beta 1, 256x384x512) %.3g\n", cc / 10, cc % 10, fwd, dx, dw);
    fflush(stdout);
}

static double tf32_tolerance(int64_t k)
{
    return ldexp(1.0, -9) * sqrt((double)k);
}

Test(cuda_backend, gemm_tf32, .init = open_both, .fini = close_both)
{
    rng_state = 2;
    gpu->allow_tf32 = true;
    gemm_case(DT_FP32, DT_FP32, false, true, true, 0.0f, 1, tf32_tolerance(50)); /* gemm_case's k */
    gemm_case(DT_FP32, DT_FP32, true, false, false, 1.0f, 2, tf32_tolerance(50));
}

/* The GELU epilogue (backend.h GEMM_EPI_GELU_TANH): aux (the pre-activation) and C (its GELU) each against
 * the CPU. With a 16-bit C, n = 72 and 256 give aux a leading dimension cuBLASLt's epilogue takes (a
 * multiple of 8), so they run fused where its heuristic offers a kernel; n = 50 does not and runs the
 * fallback (the product into aux, then the GELU kernel), as every fp32 C does. The fp32 cases therefore
 * check the fallback to 1e-5 (the erf form would be 1.4e-4 off; a failure prints that distance too). */
static void gemm_gelu_case(enum dtype dt, enum dtype c_dt, bool tb, bool bias, int64_t m, int64_t n, int64_t k)
{
    struct pair a, b, aux, c, bi;
    pair_rand(&a, dt, 2, (int64_t[]){m, k}, -1, 1);
    pair_rand(&b, dt, 2, (int64_t[]){tb ? n : k, tb ? k : n}, -1, 1);
    pair_out(&aux, c_dt, 2, (int64_t[]){m, n});
    pair_out(&c, c_dt, 2, (int64_t[]){m, n});
    if (bias)
        pair_rand(&bi, DT_FP32, 1, (int64_t[]){n}, -1, 1);
    struct gemm_args g = {.trans_b = tb, .m = m, .n = n, .k = k, .alpha = 0.75f, .beta = 0.0f, .batch = 1,
                          .epilogue = GEMM_EPI_GELU_TANH};
    g.a = &a.c, g.b = &b.c, g.c = &c.c, g.bias = bias ? &bi.c : NULL, g.aux = &aux.c;
    cpu->gemm(cpu, &g);
    g.a = &a.g, g.b = &b.g, g.c = &c.g, g.bias = bias ? &bi.g : NULL, g.aux = &aux.g;
    gpu->gemm(gpu, &g);
    double tol = c_dt != DT_FP32 ? 1e-2 : dt == DT_FP32 ? 1e-5 : 1e-4; /* as the gemm test */
    char what[160];
    snprintf(what, sizeof what, "gemm+gelu %s->%s tb=%d bias=%d m=%lld n=%lld k=%lld", dtype_name(dt),
             dtype_name(c_dt), tb, bias, (long long)m, (long long)n, (long long)k);
    pair_expect(&aux, tol, what);
    if (dt == DT_FP32) {
        struct amp_error err = {0};
        struct tensor erf; /* the erf form of the CPU's pre-activation */
        cr_assert_eq(tensor_alloc(&erf, cpu, DT_FP32, 2, (int64_t[]){m, n}, "erf reference", &err), AMP_OK, "%s",
                     err.msg);
        cpu->act_forward(cpu, ACT_GELU_ERF, &erf, &aux.c);
        double to_tanh = rel_l2(&c.g, &c.c, what), to_erf = rel_l2(&c.g, &erf, what);
        cr_assert(to_tanh <= tol, "%s: C's relative L2 error against the tanh form %.3g > %.3g (against the erf form "
                  "%.3g)", what, to_tanh, tol, to_erf);
        tensor_free(&erf);
    } else {
        pair_expect(&c, tol, what);
    }
    pair_free(&a);
    pair_free(&b);
    pair_free(&aux);
    pair_free(&c);
    if (bias)
        pair_free(&bi);
}

Test(cuda_backend, gemm_gelu_epilogue, .init = open_both, .fini = close_both)
{
    static const int64_t shapes[][3] = {{37, 72, 50}, {64, 256, 64}, {37, 50, 72}}; /* m, n, k */
    rng_state = 21;
    for (int d = 0; d < 3; d++) {
        enum dtype dt = all_dtypes[d];
        enum dtype outs[2] = {dt, DT_FP32};
        for (int o = 0; o < (dt == DT_FP32 ? 1 : 2); o++)
            for (int s = 0; s < 3; s++)
                for (int t = 0; t < 4; t++)
                    gemm_gelu_case(dt, outs[o], t & 1, t & 2, shapes[s][0], shapes[s][1], shapes[s][2]);
    }
}

/* A GELU call that breaks a precondition of backend.h records an error and writes nothing: C and aux keep
 * their poison. Each case on a fresh backend, since the first error stays recorded. */
Test(cuda_backend, gemm_gelu_epilogue_refuses_bad_calls, .init = open_both, .fini = close_both)
{
    enum { BETA, BATCH, TRANS_A, NO_AUX, AUX_DTYPE, CASES };
    static const char *names[CASES] = {"beta 1", "batch 2", "trans_a", "aux NULL", "aux fp16 with C fp32"};
    int64_t m = 16, shape[] = {2, m, m};
    rng_state = 22;
    for (int v = 0; v < CASES; v++) {
        struct amp_error err = {0};
        if (v > 0) {
            backend_close(gpu);
            cr_assert_eq(backend_open(&gpu, "cuda:0", NULL, 0, &err), AMP_OK, "%s (hint: %s)", err.msg, err.hint);
        }
        struct pair a, b, aux, c;
        pair_rand(&a, DT_FP32, 3, shape, -1, 1);
        pair_rand(&b, DT_FP32, 3, shape, -1, 1);
        pair_out(&aux, v == AUX_DTYPE ? DT_FP16 : DT_FP32, 2, (int64_t[]){m, m});
        pair_out(&c, DT_FP32, 3, shape);
        struct gemm_args g = {.a = &a.g, .b = &b.g, .c = &c.g, .aux = v == NO_AUX ? NULL : &aux.g,
                              .trans_a = v == TRANS_A, .m = m, .n = m, .k = m, .alpha = 1.0f,
                              .beta = v == BETA ? 1.0f : 0.0f, .batch = v == BATCH ? 2 : 1, .stride_a = m * m,
                              .stride_b = m * m, .stride_c = m * m, .epilogue = GEMM_EPI_GELU_TANH};
        gpu->gemm(gpu, &g);
        gpu->synchronize(gpu);
        cr_assert_neq(gpu->status(gpu, &err), AMP_OK, "%s: no error recorded", names[v]);
        cr_assert(strstr(err.hint, "bug in the caller"), "%s: hint \"%s\"", names[v], err.hint);
        const struct pair *outs[2] = {&c, &aux};
        for (int o = 0; o < 2; o++) {
            size_t bytes = tensor_bytes(&outs[o]->c);
            unsigned char *h = malloc(bytes);
            cr_assert_not_null(h);
            gpu->download(gpu, h, outs[o]->g.data, bytes);
            for (size_t i = 0; i < bytes; i++)
                cr_assert_eq(h[i], 0xFF, "%s: %s byte %zu written", names[v], o ? "aux" : "C", i);
            free(h);
        }
        pair_free(&a);
        pair_free(&b);
        pair_free(&aux);
        pair_free(&c);
    }
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
        cr_assert_eq(zeros_of(cpu, &y.c, 0), zeros_of(gpu, &y.g, 0), "count_zeros of the dropped tensor");
        pair_free(&x);
        pair_free(&y);
        pair_free(&dx);
    }
}

/* ---- convolution and pooling -------------------------------------------------------------------- */

/* dw's tolerance for a reduction of length k = n * h_out * w_out. fp32 x and dy: cuDNN's FMA sums in
 * another order than the CPU's, 2^-22 sqrt(k) (rounding errors of random sign; the first H200 run measured
 * 1.51e-5 at k = 32736, where this gives 4.3e-5: the 1e-5 cap this once had was below it). 16-bit x and dy:
 * TF32 tensor cores on exact fp32 copies (kernels/cuda/conv_cudnn.cu), so every product is exact, but the
 * tensor cores' FP32 accumulator may truncate instead of rounding, once per 8-product MMA step (Fasi,
 * Higham, Mikaitis, Pranesh, "Numerical behavior of NVIDIA tensor cores", PeerJ CS 2021): at worst
 * 2^-23 k / 8, never looser than the 16-bit dtype's own tolerance. Never tighter than 1e-5. */
static double dw_tolerance(enum dtype dt, int64_t k)
{
    double t = dt == DT_FP32 ? ldexp(1.0, -22) * sqrt((double)k) : ldexp(1.0, -23) * (double)k / 8.0;
    t = t > 1e-5 ? t : 1e-5;
    return dt == DT_FP32 || t < tol_of(dt) ? t : tol_of(dt);
}

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
    pair_expect(&dw, dw_tolerance(dt, a.n * a.h_out * a.w_out), "conv2d_backward_filter dw (beta 1)");
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

/* The weight and bias gradients alone, beta 0 (dw, db poisoned: cuDNN and the channel sums must not
 * read them) or 1, on shapes whose channel sums span several chunks of 4096 (kernels/cuda/norm.cu). */
static void conv_filter_case(enum dtype dt, struct conv_args a, float beta)
{
    a.h_out = (a.h_in + 2 * a.padding - a.kernel) / a.stride + 1;
    a.w_out = (a.w_in + 2 * a.padding - a.kernel) / a.stride + 1;
    int64_t xs[] = {a.n, a.c_in, a.h_in, a.w_in}, ws[] = {a.c_out, a.c_in, a.kernel, a.kernel};
    int64_t ys[] = {a.n, a.c_out, a.h_out, a.w_out};
    struct pair x, dy, dw, db;
    pair_rand(&x, dt, 4, xs, -1, 1);
    pair_rand(&dy, dt, 4, ys, -1, 1);
    if (beta == 0.0f) {
        pair_out(&dw, DT_FP32, 4, ws);
        pair_out(&db, DT_FP32, 1, (int64_t[]){a.c_out});
    } else {
        pair_acc(&dw, 4, ws);
        pair_acc(&db, 1, (int64_t[]){a.c_out});
    }
    cpu->conv2d_backward_filter(cpu, &a, &dw.c, &db.c, &dy.c, &x.c, beta);
    gpu->conv2d_backward_filter(gpu, &a, &dw.g, &db.g, &dy.g, &x.g, beta);
    char what[96];
    snprintf(what, sizeof what, "conv2d_backward_filter dw (n %lld, c_out %lld, beta %g)", (long long)a.n,
             (long long)a.c_out, (double)beta);
    pair_expect(&dw, dw_tolerance(dt, a.n * a.h_out * a.w_out), what);
    snprintf(what, sizeof what, "conv2d_backward_filter db (n %lld, c_out %lld, beta %g)", (long long)a.n,
             (long long)a.c_out, (double)beta);
    pair_expect(&db, 1e-6, what);
    pair_free(&x);
    pair_free(&dy);
    pair_free(&dw);
    pair_free(&db);
}

Test(cuda_backend, conv2d_filter_grad_many_chunks, .init = open_both, .fini = close_both)
{
    rng_state = 21;
    const struct conv_args shapes[] = {
        /* one output channel, n*hw = 14400: three full chunks and a partial one */
        {.n = 16, .c_in = 3, .h_in = 30, .w_in = 30, .c_out = 1, .kernel = 3, .stride = 1, .padding = 1},
        /* odd sizes, n*hw = 32736 (7 chunks + 4064) */
        {.n = 32, .c_in = 2, .h_in = 33, .w_in = 31, .c_out = 3, .kernel = 3, .stride = 1, .padding = 1},
        /* strided 5x5, fewer elements than one chunk */
        {.n = 9, .c_in = 4, .h_in = 37, .w_in = 29, .c_out = 5, .kernel = 5, .stride = 2, .padding = 2},
    };
    for (int d = 0; d < 3; d++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            conv_filter_case(all_dtypes[d], shapes[s], 0.0f);
            conv_filter_case(all_dtypes[d], shapes[s], 1.0f);
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

/* The residual add fused into layernorm (norm_args.addend, dsum) against the CPU's: the sum bit for bit (one
 * addition, rounded once on both), the rest as the plain layernorm's tolerances. fp32 residual with a bf16 branch,
 * and bf16 all through. */
Test(cuda_backend, layernorm_with_its_residual_add, .init = open_both, .fini = close_both)
{
    rng_state = 81;
    int64_t rows = 300, cols = 130, s[] = {300, 130};
    const enum dtype cases[][2] = {{DT_FP32, DT_BF16}, {DT_BF16, DT_BF16}};
    for (int c = 0; c < 2; c++) {
        enum dtype xd = cases[c][0], ad = cases[c][1];
        struct pair x, add, g, b, sum, y, mean, rstd, dy, dsum, dx, dg, db;
        pair_rand(&x, xd, 2, s, -2, 3);
        pair_rand(&add, ad, 2, s, -1, 1);
        pair_rand(&g, DT_FP32, 1, &cols, 0.5f, 1.5f);
        pair_rand(&b, DT_FP32, 1, &cols, -1, 1);
        pair_rand(&dy, ad, 2, s, -1, 1);
        pair_rand(&dsum, xd, 2, s, -1, 1);
        pair_out(&sum, xd, 2, s);
        pair_out(&y, ad, 2, s);
        pair_out(&dx, xd, 2, s);
        pair_out(&mean, DT_FP32, 1, &rows);
        pair_out(&rstd, DT_FP32, 1, &rows);
        pair_acc(&dg, 1, &cols);
        pair_acc(&db, 1, &cols);
        struct norm_args fc = {.rows = rows, .cols = cols, .eps = 1e-5f, .addend = &add.c, .sum = &sum.c};
        struct norm_args fg = {.rows = rows, .cols = cols, .eps = 1e-5f, .addend = &add.g, .sum = &sum.g};
        cpu->layernorm_forward(cpu, &fc, &y.c, &mean.c, &rstd.c, &x.c, &g.c, &b.c);
        gpu->layernorm_forward(gpu, &fg, &y.g, &mean.g, &rstd.g, &x.g, &g.g, &b.g);
        pair_expect_bits(&sum, "fused residual sum");
        pair_expect(&y, tol_of(ad), "fused layernorm y");
        pair_expect(&mean, 1e-6, "fused layernorm mean");
        pair_expect(&rstd, 1e-6, "fused layernorm rstd");
        struct norm_args bc = {.rows = rows, .cols = cols, .eps = 1e-5f, .dsum = &dsum.c};
        struct norm_args bg = {.rows = rows, .cols = cols, .eps = 1e-5f, .dsum = &dsum.g};
        cpu->layernorm_backward(cpu, &bc, &dx.c, &dg.c, &db.c, &dy.c, &sum.c, &mean.c, &rstd.c, &g.c, 1.0f);
        gpu->layernorm_backward(gpu, &bg, &dx.g, &dg.g, &db.g, &dy.g, &sum.g, &mean.g, &rstd.g, &g.g, 1.0f);
        pair_expect(&dx, tol_of(xd), "fused layernorm dx + dsum");
        pair_expect(&dg, 1e-5, "fused layernorm dgamma");
        pair_expect(&db, 1e-5, "fused layernorm dbeta");
        struct pair *all[] = {&x, &add, &g, &b, &sum, &y, &mean, &rstd, &dy, &dsum, &dx, &dg, &db};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
            pair_free(all[i]);
    }
}

/* pair_expect with the case's context after the op's name */
static void expect_in(const struct pair *p, double tol, const char *what, const char *ctx)
{
    char full[192];
    snprintf(full, sizeof full, "%s (%s)", what, ctx);
    pair_expect(p, tol, full);
}

/* Batchnorm on shapes whose channel sums span many chunks of 4096 (kernels/cuda/norm.cu), or many channels
 * (more than a grid's 65535 rows), with beta 0 (dgamma, dbeta poisoned) and 1. */
static void batchnorm_case(enum dtype dt, int64_t n, int64_t c, int64_t h, int64_t w, bool training, float beta,
                           bool relu)
{
    struct norm_args a = {.n = n, .c = c, .hw = h * w, .eps = 1e-5f, .momentum = 0.1f, .training = training,
                          .relu = relu};
    int64_t s[] = {n, c, h, w};
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
    if (beta == 0.0f) {
        pair_out(&dg, DT_FP32, 1, &c);
        pair_out(&db, DT_FP32, 1, &c);
    } else {
        pair_acc(&dg, 1, &c);
        pair_acc(&db, 1, &c);
    }
    char ctx[96];
    snprintf(ctx, sizeof ctx, "n %lld, c %lld, hw %lld, %s, beta %g%s", (long long)n, (long long)c,
             (long long)(h * w), training ? "training" : "eval", (double)beta, relu ? ", relu fused" : "");
    cpu->batchnorm_forward(cpu, &a, &y.c, &mean.c, &rstd.c, &rm.c, &rv.c, &x.c, &g.c, &b.c);
    gpu->batchnorm_forward(gpu, &a, &y.g, &mean.g, &rstd.g, &rm.g, &rv.g, &x.g, &g.g, &b.g);
    expect_in(&y, tol_of(dt), "batchnorm_forward y", ctx);
    expect_in(&mean, 1e-6, "batchnorm_forward mean", ctx);
    expect_in(&rstd, 1e-6, "batchnorm_forward rstd", ctx);
    expect_in(&rm, 1e-6, "batchnorm running mean", ctx);
    expect_in(&rv, 1e-6, "batchnorm running var", ctx);
    cpu->batchnorm_backward(cpu, &a, &dx.c, &dg.c, &db.c, &dy.c, &x.c, relu ? &y.c : NULL, &mean.c, &rstd.c, &g.c,
                            beta);
    gpu->batchnorm_backward(gpu, &a, &dx.g, &dg.g, &db.g, &dy.g, &x.g, relu ? &y.g : NULL, &mean.g, &rstd.g, &g.g,
                            beta);
    expect_in(&dx, tol_of(dt), "batchnorm_backward dx", ctx);
    expect_in(&dg, 1e-5, "batchnorm_backward dgamma", ctx);
    expect_in(&db, 1e-5, "batchnorm_backward dbeta", ctx);
    struct pair *all[] = {&x, &g, &b, &y, &mean, &rstd, &rm, &rv, &dy, &dx, &dg, &db};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        pair_free(all[i]);
}

Test(cuda_backend, batchnorm, .init = open_both, .fini = close_both)
{
    rng_state = 9;
    for (int d = 0; d < 3; d++)
        for (int training = 1; training >= 0; training--)
            for (int relu = 0; relu < 2; relu++)
                batchnorm_case(all_dtypes[d], 6, 5, 7, 7, training, 1.0f, relu);
}

Test(cuda_backend, batchnorm_many_chunks, .init = open_both, .fini = close_both)
{
    rng_state = 22;
    for (int d = 0; d < 3; d++)
        for (int training = 1; training >= 0; training--)
            for (int bi = 0; bi < 2; bi++) {
                float beta = bi ? 1.0f : 0.0f;
                batchnorm_case(all_dtypes[d], 64, 1, 23, 29, training, beta, false); /* C = 1, 42688: 10 chunks + 1792 */
                batchnorm_case(all_dtypes[d], 5, 3, 61, 67, training, beta, false);  /* 20435: 4 chunks + 4051 */
                batchnorm_case(all_dtypes[d], 7, 32, 28, 28, training, beta, bi); /* fashion_cnn-like, 5488 (relu fused
                                                                                     with beta 1) */
                batchnorm_case(all_dtypes[d], 2, 65537, 1, 1, training, beta, false); /* channels past gridDim.y */
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

/* ---- the fused attention (cuDNN's flash attention, kernels/cuda/attention_cudnn.cpp) ---------------------- */

/* Whether the GPU's fused attention serves (B, T, C, H) in dt; a skip where the module was built without cuDNN's
 * frontend, a failure where it refuses head sizes 64 and 128 in 16 bits on an Ampere or newer GPU. */
static bool fused_or_skip(int64_t B, int64_t T, int64_t C, int64_t H, enum dtype dt)
{
    if (!gpu->attention_fused_supported)
        cr_skip_test("the CUDA module was built without cuDNN's frontend headers: the fused attention was not run");
    bool ok = backend_attention_fused(gpu, B, T, C, H, dt);
    cr_assert(ok || device_cc() < 80, "cuDNN refused the fused attention of B=%lld T=%lld C=%lld H=%lld %s on "
              "compute capability %d (see the note above)", (long long)B, (long long)T, (long long)C, (long long)H,
              dtype_name(dt), device_cc());
    return ok;
}

/* log-sum-exp of each causal row of the scaled scores, in double from the 16-bit qkv values: what the fused
 * forward's statistics hold (backend.h). stats_want (B*H*T). */
static void attention_lse(const struct pair *qkv, int64_t B, int64_t T, int64_t C, int64_t H, double *stats_want)
{
    int64_t D = C / H;
    float *x = malloc(qkv->c.numel * sizeof *x);
    cr_assert_not_null(x);
    tensor_to_host_f32(&qkv->c, x);
    double scale = 1.0 / sqrt((double)D);
    double *s = malloc((size_t)T * sizeof *s);
    cr_assert_not_null(s);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < T; i++) {
                const float *q = x + (b * T + i) * 3 * C + h * D;
                double mx = -INFINITY, sum = 0.0;
                for (int64_t j = 0; j <= i; j++) {
                    const float *k = x + (b * T + j) * 3 * C + C + h * D;
                    double dot = 0.0;
                    for (int64_t e = 0; e < D; e++)
                        dot += (double)q[e] * (double)k[e];
                    s[j] = dot * scale;
                    mx = fmax(mx, s[j]);
                }
                for (int64_t j = 0; j <= i; j++)
                    sum += exp(s[j] - mx);
                stats_want[(b * H + h) * T + i] = mx + log(sum);
            }
    free(s);
    free(x);
}

/* The fused forward and backward against the CPU's attention op (probabilities kept), bf16 and fp16, head sizes 64
 * and 128, T = 77 (not a multiple of the 64-row tiles: the last tile is partial and the causal edge cuts through
 * tiles). Tolerances from the roundings the two sides make differently, u = 2^-8 (bf16) or 2^-11 (fp16) each:
 * forward, the CPU rounds the scores to d (the fused path keeps them fp32) and both round P (the fused path before
 * normalising, the CPU after) and out: at most three roundings of relative size u apart, 4u in relative L2. Backward,
 * dP, dS and the three products again, where dS = P (dP - rowsum(dO O)) cancels: 8u. The statistics are fp32
 * throughout on the GPU: 1e-3 absolute against double (products of 16-bit values are exact in fp32; the rest is
 * fp32 exp and log over at most 77 terms). */
Test(cuda_backend, attention_fused_matches_the_cpu, .init = open_both, .fini = close_both)
{
    rng_state = 41;
    const enum dtype dts[] = {DT_BF16, DT_FP16};
    const int64_t heads[] = {64, 128};
    int64_t B = 2, T = 77, H = 3;
    for (int di = 0; di < 2; di++)
        for (int hi = 0; hi < 2; hi++) {
            enum dtype dt = dts[di];
            int64_t D = heads[hi], C = H * D;
            if (!fused_or_skip(B, T, C, H, dt))
                continue;
            double u = dt == DT_BF16 ? 0x1p-8 : 0x1p-11;
            struct pair qkv, out, probs, dout, dqkv, stats;
            pair_rand(&qkv, dt, 3, (int64_t[]){B, T, 3 * C}, -1, 1);
            pair_rand(&dout, dt, 3, (int64_t[]){B, T, C}, -1, 1);
            pair_out(&out, dt, 3, (int64_t[]){B, T, C});
            pair_out(&probs, dt, 4, (int64_t[]){B, H, T, T});
            pair_out(&dqkv, dt, 3, (int64_t[]){B, T, 3 * C});
            pair_out(&stats, DT_FP32, 3, (int64_t[]){B, H, T});
            cpu->attention_forward(cpu, &out.c, &probs.c, &qkv.c, B, T, C, H);
            gpu->attention_fused_forward(gpu, &out.g, &stats.g, &qkv.g, B, T, C, H);
            char what[96];
            snprintf(what, sizeof what, "fused forward out, head size %lld", (long long)D);
            pair_expect(&out, 4 * u, what);

            double *want = malloc(stats.c.numel * sizeof *want);
            float *got = malloc(stats.c.numel * sizeof *got);
            cr_assert(want && got);
            attention_lse(&qkv, B, T, C, H, want);
            check_gpu();
            gpu->download(gpu, got, stats.g.data, stats.c.numel * sizeof *got);
            for (size_t i = 0; i < stats.c.numel; i++)
                cr_assert(fabs((double)got[i] - want[i]) <= 1e-3, "%s head size %lld: statistic [%zu] %.6g, want %.6g",
                          dtype_name(dt), (long long)D, i, (double)got[i], want[i]);
            free(want);
            free(got);

            /* the backward reads the GPU's own out, as the model gives it */
            cpu->attention_backward(cpu, &dqkv.c, &dout.c, &qkv.c, &probs.c, B, T, C, H);
            gpu->attention_fused_backward(gpu, &dqkv.g, &dout.g, &qkv.g, &out.g, &stats.g, B, T, C, H);
            snprintf(what, sizeof what, "fused backward dqkv, head size %lld", (long long)D);
            pair_expect(&dqkv, 8 * u, what);
            struct pair *all[] = {&qkv, &out, &probs, &dout, &dqkv, &stats};
            for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
                pair_free(all[i]);
        }
}

/* The same inputs give the same bits: forward twice, backward twice (cuDNN's deterministic backward: resume and
 * run.recompute stay bit-exact on the GPU), each into a freshly poisoned output. */
Test(cuda_backend, attention_fused_is_deterministic, .init = open_both, .fini = close_both)
{
    rng_state = 42;
    int64_t B = 4, T = 200, H = 4, D = 64, C = H * D;
    enum dtype dt = DT_BF16;
    if (!fused_or_skip(B, T, C, H, dt))
        return;
    struct pair qkv, dout, out[2], stats[2], dqkv[2];
    pair_rand(&qkv, dt, 3, (int64_t[]){B, T, 3 * C}, -1, 1);
    pair_rand(&dout, dt, 3, (int64_t[]){B, T, C}, -1, 1);
    for (int r = 0; r < 2; r++) {
        pair_out(&out[r], dt, 3, (int64_t[]){B, T, C});
        pair_out(&stats[r], DT_FP32, 3, (int64_t[]){B, H, T});
        pair_out(&dqkv[r], dt, 3, (int64_t[]){B, T, 3 * C});
        gpu->attention_fused_forward(gpu, &out[r].g, &stats[r].g, &qkv.g, B, T, C, H);
        gpu->attention_fused_backward(gpu, &dqkv[r].g, &dout.g, &qkv.g, &out[r].g, &stats[r].g, B, T, C, H);
    }
    check_gpu();
    const char *names[] = {"out", "statistics", "dqkv"};
    struct pair *runs[][2] = {{&out[0], &out[1]}, {&stats[0], &stats[1]}, {&dqkv[0], &dqkv[1]}};
    for (int t = 0; t < 3; t++) {
        size_t bytes = tensor_bytes(&runs[t][0]->c);
        unsigned char *a = malloc(bytes), *b = malloc(bytes);
        cr_assert(a && b);
        gpu->download(gpu, a, runs[t][0]->g.data, bytes);
        gpu->download(gpu, b, runs[t][1]->g.data, bytes);
        cr_assert_eq(memcmp(a, b, bytes), 0, "two fused runs gave different %s", names[t]);
        /* and something was written: the poison (0xFF) is gone */
        size_t poisoned = 0;
        for (size_t i = 0; i < bytes; i++)
            poisoned += a[i] == 0xFF;
        cr_assert(poisoned < bytes / 4, "%s: %zu of %zu bytes still poisoned", names[t], poisoned, bytes);
        free(a);
        free(b);
    }
    for (int r = 0; r < 2; r++) {
        pair_free(&out[r]);
        pair_free(&stats[r]);
        pair_free(&dqkv[r]);
    }
    pair_free(&qkv);
    pair_free(&dout);
}

/* A batch smaller than the one the model asked about at setup (an epoch's last, an evaluation's) gets graphs of its
 * own on first use (the plan key holds B): batches 2, 4 and 2 after the setup's question for 4, each against the CPU
 * with attention_fused_matches_the_cpu's tolerances, so a plan run on another batch's dims, a cache that returned the
 * wrong plan after reordering, or a workspace sized for another batch, fails. */
Test(cuda_backend, attention_fused_serves_smaller_batches_than_its_setup, .init = open_both, .fini = close_both)
{
    rng_state = 44;
    int64_t T = 77, H = 2, D = 64, C = H * D;
    enum dtype dt = DT_BF16;
    double u = 0x1p-8;
    if (!fused_or_skip(4, T, C, H, dt))
        return;
    const int64_t batches[] = {2, 4, 2};
    for (int i = 0; i < 3; i++) {
        int64_t B = batches[i];
        struct pair qkv, out, probs, dout, dqkv, stats;
        pair_rand(&qkv, dt, 3, (int64_t[]){B, T, 3 * C}, -1, 1);
        pair_rand(&dout, dt, 3, (int64_t[]){B, T, C}, -1, 1);
        pair_out(&out, dt, 3, (int64_t[]){B, T, C});
        pair_out(&probs, dt, 4, (int64_t[]){B, H, T, T});
        pair_out(&dqkv, dt, 3, (int64_t[]){B, T, 3 * C});
        pair_out(&stats, DT_FP32, 3, (int64_t[]){B, H, T});
        cpu->attention_forward(cpu, &out.c, &probs.c, &qkv.c, B, T, C, H);
        gpu->attention_fused_forward(gpu, &out.g, &stats.g, &qkv.g, B, T, C, H);
        char what[96];
        snprintf(what, sizeof what, "fused forward out, batch %lld after setup for 4", (long long)B);
        pair_expect(&out, 4 * u, what);
        cpu->attention_backward(cpu, &dqkv.c, &dout.c, &qkv.c, &probs.c, B, T, C, H);
        gpu->attention_fused_backward(gpu, &dqkv.g, &dout.g, &qkv.g, &out.g, &stats.g, B, T, C, H);
        snprintf(what, sizeof what, "fused backward dqkv, batch %lld after setup for 4", (long long)B);
        pair_expect(&dqkv, 8 * u, what);
        struct pair *all[] = {&qkv, &out, &probs, &dout, &dqkv, &stats};
        for (size_t k = 0; k < sizeof all / sizeof all[0]; k++)
            pair_free(all[k]);
    }
}

/* Where the fused path does not apply the backend says so and the model keeps the probabilities (the unfused op,
 * tested by cuda_backend::attention above): fp32, a head size cuDNN cannot take (12: not a multiple of 8), and any
 * shape with AMPTRAIN_CUDNN_ATTENTION=0 (read when a backend is created). */
Test(cuda_backend, attention_fused_declines_where_it_does_not_apply, .init = open_both, .fini = close_both)
{
    int64_t B = 2, T = 64, H = 2;
    if (!fused_or_skip(B, T, H * 64, H, DT_BF16))
        return;
    cr_assert_not(backend_attention_fused(gpu, B, T, H * 64, H, DT_FP32), "fp32 keeps the unfused path");
    cr_assert_not(backend_attention_fused(gpu, B, T, H * 12, H, DT_BF16), "head size 12 keeps the unfused path");
    check_gpu(); /* a refusal is no error */
    setenv("AMPTRAIN_CUDNN_ATTENTION", "0", 1);
    struct backend *off = NULL;
    struct amp_error err = {0};
    enum amp_status st = backend_open(&off, "cuda:0", NULL, 0, &err);
    unsetenv("AMPTRAIN_CUDNN_ATTENTION");
    cr_assert_eq(st, AMP_OK, "%s", err.msg);
    cr_assert_not(backend_attention_fused(off, B, T, H * 64, H, DT_BF16), "AMPTRAIN_CUDNN_ATTENTION=0 turns it off");
    backend_close(off);
}

/* The byte GPT (head size 32) on the GPU in bf16, with the fused attention and with it off
 * (AMPTRAIN_CUDNN_ATTENTION=0): both train, no refusal is noted, and the first step's losses agree within 1% (the
 * two paths round differently: not the same bits). cuda_backend::recompute_is_the_same_bits_on_the_gpu and the
 * resume test run the same model, fused, for the bit-exact contracts. */
Test(cuda_backend, gpt_trains_with_and_without_the_fused_attention, .timeout = 600)
{
    if (backend_cuda_device_count() <= 0)
        cr_skip_test("no CUDA device: the fused attention end to end was not run");
    make_scratch();
    const char *env[] = {"1", "0"};
    double first[2] = {0, 0};
    for (int i = 0; i < 2; i++) {
        setenv("AMPTRAIN_CUDNN_ATTENTION", env[i], 1);
        struct result r = amp("run configs/text_gpt.yaml run.device=cuda run.steps=3 run.log_every=1 "
                              "precision.mode=bf16 run.out_dir=%s/fused%s", scratch, env[i]);
        unsetenv("AMPTRAIN_CUDNN_ATTENTION");
        cr_assert_eq(r.code, 0, "AMPTRAIN_CUDNN_ATTENTION=%s:\n%s", env[i], r.out);
        cr_assert_null(strstr(r.out, "fused attention refuses"), "text_gpt's head size 32 was refused:\n%s", r.out);
        char path[512];
        snprintf(path, sizeof path, "%s/fused%s/scale_log.csv", scratch, env[i]);
        FILE *f = fopen(path, "r");
        cr_assert_not_null(f, "%s", path);
        char line[1024];
        cr_assert_not_null(fgets(line, sizeof line, f)); /* header */
        cr_assert_not_null(fgets(line, sizeof line, f));
        fclose(f);
        char *c = strchr(line, ',');
        c = c ? strchr(c + 1, ',') : NULL; /* the third column: the loss */
        cr_assert_not_null(c, "%s", line);
        first[i] = strtod(c + 1, NULL);
    }
    cr_assert(fabs(first[0] - first[1]) <= 1e-2 * fabs(first[1]), "first loss %.6g fused, %.6g unfused", first[0],
              first[1]);
    remove_scratch();
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
    /* the seeds live in backend memory, as the step state keeps them */
    float xent_seed = 128.0f, mse_seed = 2.0f;
    float *xs_c = be_put(cpu, &xent_seed, sizeof xent_seed), *xs_g = be_put(gpu, &xent_seed, sizeof xent_seed);
    float *ms_c = be_put(cpu, &mse_seed, sizeof mse_seed), *ms_g = be_put(gpu, &mse_seed, sizeof mse_seed);
    for (int d = 0; d < 3; d++) {
        enum dtype dt = all_dtypes[d];
        struct pair x, t, losses, dx;
        pair_rand(&x, dt, 2, (int64_t[]){N, K}, -4, 4);
        pair_rand(&t, DT_FP32, 2, (int64_t[]){N, K}, -1, 1);
        pair_out(&losses, DT_FP32, 1, &N);
        pair_out(&dx, dt, 2, (int64_t[]){N, K});
        cpu->xent_forward_backward(cpu, &losses.c, correct_c, &dx.c, &x.c, labels, N, K, xs_c);
        gpu->xent_forward_backward(gpu, &losses.g, dcor, &dx.g, &x.g, dlab, N, K, xs_g);
        pair_expect(&losses, 1e-6, "xent losses");
        pair_expect(&dx, tol_of(dt) * 0.1, "xent dlogits");
        gpu->download(gpu, correct_g, dcor, sizeof correct_g);
        cr_assert_eq(memcmp(correct_c, correct_g, sizeof correct_c), 0, "xent correct flags differ");
        cpu->mse_forward_backward(cpu, &losses.c, &dx.c, &x.c, &t.c, N, K, ms_c);
        gpu->mse_forward_backward(gpu, &losses.g, &dx.g, &x.g, &t.g, N, K, ms_g);
        pair_expect(&losses, 1e-6, "mse losses");
        pair_expect(&dx, tol_of(dt) * 0.1, "mse dy");
        /* evaluation: no gradient, no seed */
        pair_free(&losses);
        pair_out(&losses, DT_FP32, 1, &N);
        cpu->xent_forward_backward(cpu, &losses.c, NULL, NULL, &x.c, labels, N, K, NULL);
        gpu->xent_forward_backward(gpu, &losses.g, NULL, NULL, &x.g, dlab, N, K, NULL);
        pair_expect(&losses, 1e-6, "xent losses without dlogits or seed");
        pair_free(&x);
        pair_free(&t);
        pair_free(&losses);
        pair_free(&dx);
    }
    /* NaN logits: the CPU's scan starts at x[0], so a NaN there is the row's argmax (index 0), and a NaN
     * later in the row is passed over; `correct` must follow the same rule on the GPU */
    struct pair x, losses;
    pair_rand(&x, DT_FP32, 2, (int64_t[]){N, K}, -4, 4);
    float *hx = x.c.data;
    for (int i = 0; i < 8; i++)
        labels[i] = i % 2 ? 0 : 3; /* odd rows: label 0, so "argmax is 0" shows as correct */
    gpu->upload(gpu, dlab, labels, (size_t)N * sizeof(int32_t));
    for (int i = 0; i < 8; i++)
        hx[i * K + (i < 4 ? 0 : 5)] = NAN;
    gpu->upload(gpu, x.g.data, x.c.data, tensor_bytes(&x.c));
    pair_out(&losses, DT_FP32, 1, &N);
    cpu->xent_forward_backward(cpu, &losses.c, correct_c, NULL, &x.c, labels, N, K, NULL);
    gpu->xent_forward_backward(gpu, &losses.g, dcor, NULL, &x.g, dlab, N, K, NULL);
    gpu->download(gpu, correct_g, dcor, sizeof correct_g);
    for (int i = 0; i < N; i++)
        cr_assert_eq(correct_g[i], correct_c[i], "row %d (NaN at %s): correct %d on the GPU, %d on the CPU", i,
                     i < 4 ? "x[0]" : i < 8 ? "x[5]" : "nowhere", correct_g[i], correct_c[i]);
    cr_assert(correct_c[1] == 1 && correct_c[0] == 0, "the CPU rule itself: NaN at x[0] is the argmax");
    pair_free(&x);
    pair_free(&losses);
    gpu->free(gpu, dlab);
    gpu->free(gpu, dcor);
    cpu->free(cpu, xs_c);
    gpu->free(gpu, xs_g);
    cpu->free(cpu, ms_c);
    gpu->free(gpu, ms_g);
}

/* A padded vocabulary (backend.h, xent_forward_backward): rows S = 320 apart, K = 300 classes, the padding holding
 * the row's largest values (30 and up), so a kernel that lets it into the max, the sum or the argmax moves every loss.
 * The GPU against the CPU (which tests/test_cpu_loss.c holds to its dense bits) with the losses test's tolerances,
 * into another tensor and in place, and the padding's dlogits exactly +0 on the GPU. */
Test(cuda_backend, xent_on_padded_rows, .init = open_both, .fini = close_both)
{
    rng_state = 42;
    cr_assert_eq(gpu->vocab_align, 64, "the CUDA backend pads the vocabulary to a multiple of 64");
    const int64_t N = 65, K = 300, S = 320;
    int32_t labels[65], correct_c[65], correct_g[65];
    for (int i = 0; i < N; i++)
        labels[i] = (int32_t)(next_u64() % (uint64_t)K);
    labels[0] = (int32_t)K - 1;
    int32_t *dlab = ints_upload(labels, (size_t)N);
    int32_t *dcor = gpu->alloc(gpu, (size_t)N * sizeof(int32_t));
    float seed = 64.0f;
    float *s_c = be_put(cpu, &seed, sizeof seed), *s_g = be_put(gpu, &seed, sizeof seed);
    for (int d = 0; d < 3; d++)
        for (int in_place = 0; in_place < 2; in_place++) {
            enum dtype dt = all_dtypes[d];
            struct pair x, losses, dx;
            pair_rand(&x, dt, 2, (int64_t[]){N, S}, -4, 4);
            float *h = malloc((size_t)(N * S) * sizeof *h);
            cr_assert_not_null(h);
            tensor_to_host_f32(&x.c, h);
            for (int64_t i = 0; i < N; i++)
                for (int64_t j = K; j < S; j++)
                    h[i * S + j] = 30.0f + (float)(j - K);
            tensor_from_host_f32(&x.c, h);
            gpu->upload(gpu, x.g.data, x.c.data, tensor_bytes(&x.c));
            pair_out(&losses, DT_FP32, 1, &N);
            if (!in_place)
                pair_out(&dx, dt, 2, (int64_t[]){N, S});
            struct pair *out = in_place ? &x : &dx;
            cpu->xent_forward_backward(cpu, &losses.c, correct_c, &out->c, &x.c, labels, N, K, s_c);
            gpu->xent_forward_backward(gpu, &losses.g, dcor, &out->g, &x.g, dlab, N, K, s_g);
            char what[96];
            snprintf(what, sizeof what, "padded xent (%s)", in_place ? "in place" : "into dlogits");
            pair_expect(&losses, 1e-6, what);
            pair_expect(out, tol_of(dt) * 0.1, what);
            gpu->download(gpu, correct_g, dcor, sizeof correct_g);
            cr_assert_eq(memcmp(correct_c, correct_g, sizeof correct_c), 0, "%s: correct flags differ", what);
            size_t es = dtype_size(dt);
            unsigned char *g = malloc(tensor_bytes(&out->c));
            cr_assert_not_null(g);
            gpu->download(gpu, g, out->g.data, tensor_bytes(&out->c));
            for (int64_t i = 0; i < N; i++)
                for (size_t b = (size_t)K * es; b < (size_t)S * es; b++)
                    cr_assert_eq(g[(size_t)(i * S) * es + b], 0, "%s: row %lld's padding is not +0 (byte %zu)", what,
                                 (long long)i, b);
            free(g);
            free(h);
            pair_free(&x);
            pair_free(&losses);
            if (!in_place)
                pair_free(&dx);
        }
    gpu->free(gpu, dlab);
    gpu->free(gpu, dcor);
    cpu->free(cpu, s_c);
    gpu->free(gpu, s_g);
}

/* gemm_args.lda: A's rows stored longer than op(A) needs, as the padded head's dx reads the V columns of its (rows,
 * Vp) dlogits; the columns past k hold NaN, so a product that reads them fails. Tolerances as the gemm test's. */
Test(cuda_backend, gemm_reads_a_by_its_row_stride, .init = open_both, .fini = close_both)
{
    rng_state = 43;
    const int64_t m = 37, n = 32, k = 300, lda = 320;
    for (int d = 0; d < 3; d++) {
        enum dtype dt = all_dtypes[d];
        struct pair a, b, c;
        pair_rand(&a, dt, 2, (int64_t[]){m, lda}, -1, 1);
        float *h = malloc((size_t)(m * lda) * sizeof *h);
        cr_assert_not_null(h);
        tensor_to_host_f32(&a.c, h);
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = k; j < lda; j++)
                h[i * lda + j] = NAN;
        tensor_from_host_f32(&a.c, h);
        gpu->upload(gpu, a.g.data, a.c.data, tensor_bytes(&a.c));
        pair_rand(&b, dt, 2, (int64_t[]){k, n}, -1, 1);
        pair_out(&c, dt, 2, (int64_t[]){m, n});
        struct gemm_args g = {.m = m, .n = n, .k = k, .alpha = 1.0f, .beta = 0.0f, .batch = 1, .lda = lda};
        g.a = &a.c, g.b = &b.c, g.c = &c.c;
        cpu->gemm(cpu, &g);
        g.a = &a.g, g.b = &b.g, g.c = &c.g;
        gpu->gemm(gpu, &g);
        pair_expect(&c, dt == DT_FP32 ? 1e-5 : 1e-2, "gemm with lda");
        free(h);
        pair_free(&a);
        pair_free(&b);
        pair_free(&c);
    }
}

/* A step's loss: the mean of a prefix of the row losses, in double, added to a double in backend memory
 * (or replacing it). Each case's tensor holds rows past n set to 1e30, which must not count, and the
 * accumulator starts at 1e300, which the first (non-accumulating) case must drop. */
Test(cuda_backend, loss_sum_matches_the_cpu, .init = open_both, .fini = close_both)
{
    rng_state = 16;
    struct { int64_t numel, n; bool accumulate; } cases[] = {
        {1, 1, false}, {77, 77, true}, {1000, 990, true}, {250001, 250001, false}, {300, 5, true}, {64, 64, true},
    };
    double start = 1e300, expect = 0.0;
    double *acc_c = be_put(cpu, &start, sizeof start), *acc_g = be_put(gpu, &start, sizeof start);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct pair l;
        pair_rand(&l, DT_FP32, 1, &cases[i].numel, 0.0f, 5.0f);
        float *h = l.c.data;
        for (int64_t j = cases[i].n; j < cases[i].numel; j++)
            h[j] = 1e30f;
        gpu->upload(gpu, l.g.data, h, tensor_bytes(&l.c));
        double sum = 0.0;
        for (int64_t j = 0; j < cases[i].n; j++)
            sum += (double)h[j];
        expect = (cases[i].accumulate ? expect : 0.0) + sum / (double)cases[i].n;
        cpu->loss_sum(cpu, acc_c, &l.c, cases[i].n, cases[i].accumulate);
        gpu->loss_sum(gpu, acc_g, &l.g, cases[i].n, cases[i].accumulate);
        double vc = NAN, vg = NAN;
        cpu->download(cpu, &vc, acc_c, sizeof vc);
        gpu->download(gpu, &vg, acc_g, sizeof vg);
        check_gpu();
        cr_assert(fabs(vc - expect) <= 1e-12 * fabs(expect), "case %zu (n %lld, accumulate %d): CPU %.17g, expected %.17g",
                  i, (long long)cases[i].n, cases[i].accumulate, vc, expect);
        cr_assert(fabs(vg - vc) <= 1e-12 * fabs(vc), "case %zu (n %lld, accumulate %d): GPU %.17g vs CPU %.17g", i,
                  (long long)cases[i].n, cases[i].accumulate, vg, vc);
        pair_free(&l);
    }
    cpu->free(cpu, acc_c);
    gpu->free(gpu, acc_g);
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
    /* The results stay in backend memory: one check and 2*NT counts for the CPU, three of each for the GPU
     * (poisoned, so what grad_stats leaves unwritten fails below). */
    struct grad_check *chk_c = cpu->alloc(cpu, sizeof *chk_c), *chk_g = be_poisoned(gpu, 3 * sizeof *chk_g);
    int64_t *cnt_c = cpu->alloc(cpu, 2 * NT * sizeof *cnt_c), *cnt_g = be_poisoned(gpu, 3 * 2 * NT * sizeof *cnt_g);
    cr_assert(chk_c && cnt_c);
    /* the finite tensors in reverse order: another table */
    const struct tensor *fc[] = {gc[6], gc[4], gc[3], gc[1], gc[0]}, *fg[] = {gg[6], gg[4], gg[3], gg[1], gg[0]};
    enum { NF = sizeof fc / sizeof fc[0] };
    /* Three calls queued without a synchronisation between them, alternating the two tables: each must
     * run on its own table, though the host rewrites its copy of the table for the next call at once. */
    gpu->grad_stats(gpu, gg, NT, &chk_g[0], cnt_g);
    gpu->grad_stats(gpu, fg, NF, &chk_g[1], cnt_g + 2 * NT);
    gpu->grad_stats(gpu, gg, NT, &chk_g[2], cnt_g + 4 * NT);
    struct grad_check hg[3], hc;
    int64_t counts_g[3][2 * NT], counts_c[2 * NT];
    gpu->download(gpu, hg, chk_g, sizeof hg);
    gpu->download(gpu, counts_g, cnt_g, sizeof counts_g);
    check_gpu();

    cpu->grad_stats(cpu, gc, NT, chk_c, cnt_c);
    cpu->download(cpu, &hc, chk_c, sizeof hc);
    cpu->download(cpu, counts_c, cnt_c, sizeof counts_c);
    cr_assert_eq(hc.found_nonfinite, 1, "CPU found_nonfinite %lld", (long long)hc.found_nonfinite);
    cr_assert_eq(hg[0].found_nonfinite, 1, "GPU found_nonfinite %lld (must be 0 or 1)", (long long)hg[0].found_nonfinite);
    for (int i = 0; i < NT; i++) {
        cr_assert_eq(counts_g[0][i], counts_c[i], "tensor %d: inf count %lld vs %lld", i, (long long)counts_g[0][i],
                     (long long)counts_c[i]);
        cr_assert_eq(counts_g[0][NT + i], counts_c[NT + i], "tensor %d: nan count %lld vs %lld", i,
                     (long long)counts_g[0][NT + i], (long long)counts_c[NT + i]);
    }
    cr_assert_eq(counts_c[2] + counts_c[5], 2, "CPU inf counts of the planted values");
    cr_assert_eq(counts_c[NT + 5], 1, "CPU nan count of the planted value");
    cr_assert(fabs(hg[0].sumsq - hc.sumsq) <= 1e-12 * hc.sumsq, "sumsq %.17g vs %.17g", hg[0].sumsq, hc.sumsq);
    cr_assert_eq(hg[0].absmax, hc.absmax, "absmax %.17g vs %.17g", hg[0].absmax, hc.absmax);
    cr_assert_eq(memcmp(&hg[2].sumsq, &hg[0].sumsq, sizeof(double)), 0, "grad_stats must reproduce bit for bit");
    cr_assert_eq(memcmp(&hg[2].absmax, &hg[0].absmax, sizeof(double)), 0, "absmax must reproduce bit for bit");
    cr_assert_eq(hg[2].found_nonfinite, 1);
    cr_assert_eq(memcmp(counts_g[2], counts_g[0], sizeof counts_g[0]), 0, "counts must reproduce");

    cpu->grad_stats(cpu, fc, NF, chk_c, cnt_c);
    cpu->download(cpu, &hc, chk_c, sizeof hc);
    cr_assert_eq(hc.found_nonfinite, 0, "CPU: the finite tensors");
    cr_assert_eq(hg[1].found_nonfinite, 0, "GPU: the second table lists only finite tensors; found_nonfinite %lld",
                 (long long)hg[1].found_nonfinite);
    cr_assert(fabs(hg[1].sumsq - hc.sumsq) <= 1e-12 * hc.sumsq, "second table: sumsq %.17g vs %.17g", hg[1].sumsq,
              hc.sumsq);
    cr_assert_eq(hg[1].absmax, hc.absmax, "second table: absmax %.17g vs %.17g", hg[1].absmax, hc.absmax);
    for (int i = 0; i < 2 * NF; i++)
        cr_assert_eq(counts_g[1][i], 0, "second table: count %d is %lld", i, (long long)counts_g[1][i]);

    /* no tensors: zeros */
    gpu->upload(gpu, chk_g, &hg[0], sizeof hg[0]);
    gpu->grad_stats(gpu, gg, 0, chk_g, cnt_g);
    gpu->download(gpu, &hg[0], chk_g, sizeof hg[0]);
    check_gpu();
    cr_assert(hg[0].sumsq == 0.0 && hg[0].absmax == 0.0 && hg[0].found_nonfinite == 0,
              "no tensors: sumsq %g, absmax %g, found_nonfinite %lld", hg[0].sumsq, hg[0].absmax,
              (long long)hg[0].found_nonfinite);
    cpu->free(cpu, chk_c);
    cpu->free(cpu, cnt_c);
    gpu->free(gpu, chk_g);
    gpu->free(gpu, cnt_g);
    for (int i = 0; i < NT; i++)
        pair_free(&t[i]);
}

/* A view of t from element `from` on, flat (as lib/engine/zero.c's views of a rank's blocks). */
static struct tensor view_from(const struct tensor *t, size_t from)
{
    struct tensor v = *t;
    v.data = (float *)t->data + from;
    v.ndim = 1;
    for (int d = 0; d < TENSOR_MAX_DIMS; d++)
        v.shape[d] = 1;
    v.numel = t->numel - from;
    v.shape[0] = (int64_t)v.numel;
    return v;
}

/* grad_stats in two halves (backend.h, grad_stats_parts and grad_stats_combine) on the GPU, as ranks that each hold
 * some of a gradient's parts run it (dist.zero 1): 40 tensors (smaller than a part, one part, several with a short
 * last one), each cut after its first part into two "ranks'" views computed apart, the second rank's parts first,
 * combined through `at`, give cuda_grad_stats' bits (sumsq, absmax, the verdict and every per-tensor count); so do
 * the parts of the whole tensors combined in order. Values span 2^-20 to 2^20, so another order of the double
 * additions would give other bits; Inf and NaN are planted in a small tensor, in two parts of a large one and in a
 * last part. Against the CPU: the counts exactly, absmax exactly, sumsq within the bound of two sums of n positive
 * terms in double, each within (n - 1) eps of the exact sum. */
Test(cuda_backend, grad_stats_parts_combined_give_the_bits_of_grad_stats, .init = open_both, .fini = close_both)
{
    rng_state = 45;
    enum { NT = 40 };
    const size_t part = gpu->grad_part_numel;
    cr_assert_gt(part, 0, "the CUDA backend has parts");
    cr_assert(gpu->grad_stats_parts && gpu->grad_stats_combine);
    struct pair t[NT];
    const struct tensor *gc[NT], *gg[NT];
    int64_t first[NT + 1] = {0};
    size_t n_all = 0;
    for (int i = 0; i < NT; i++) {
        int64_t n = i % 4 == 0 ? (int64_t)(part * (size_t)(1 + i / 8)) + 3 * i
                  : i % 4 == 1 ? 1 + 7 * i
                  : i % 4 == 2 ? (int64_t)part
                               : (int64_t)(2 * part) + 1001;
        pair_alloc(&t[i], DT_FP32, 1, &n);
        float *h = malloc((size_t)n * sizeof *h);
        cr_assert_not_null(h);
        for (int64_t k = 0; k < n; k++)
            h[k] = ldexpf(uniform(-1, 1), (int)(next_u64() % 41) - 20);
        if (i == 1)
            h[3] = NAN;                  /* a tensor smaller than a part */
        if (i == 7) {
            h[5] = INFINITY;             /* the first part of a three-part tensor, */
            h[2 * part + 7] = NAN;       /* its short last part */
        }
        if (i == 36)
            h[n - 1] = -INFINITY;        /* the last element of a multi-part tensor */
        tensor_from_host_f32(&t[i].c, h);
        gpu->upload(gpu, t[i].g.data, t[i].c.data, tensor_bytes(&t[i].c));
        free(h);
        gc[i] = &t[i].c;
        gg[i] = &t[i].g;
        first[i + 1] = first[i] + (int64_t)((t[i].c.numel + part - 1) / part);
        n_all += t[i].c.numel;
    }
    const int64_t total = first[NT];
    /* the whole in one pass, the reference */
    struct grad_check *chk = be_poisoned(gpu, 3 * sizeof *chk);
    int64_t *cnt = be_poisoned(gpu, 3 * 2 * NT * sizeof *cnt);
    gpu->grad_stats(gpu, gg, NT, &chk[0], cnt);
    /* two ranks: A the first part of every tensor, B the rest (empty for the tensors of one part or less); B's parts
     * lie first in the gathered buffer, then A's */
    struct tensor va[NT], vb[NT];
    const struct tensor *a[NT], *b[NT];
    int64_t na = NT, nb = total - NT;
    int64_t *at = malloc((size_t)total * sizeof *at);
    cr_assert_not_null(at);
    for (int i = 0, ka = 0, kb = 0; i < NT; i++) {
        va[i] = view_from(&t[i].g, 0);
        va[i].numel = t[i].g.numel < part ? t[i].g.numel : part;
        va[i].shape[0] = (int64_t)va[i].numel;
        vb[i] = view_from(&t[i].g, va[i].numel);
        a[i] = &va[i];
        b[i] = &vb[i];
        for (int64_t c = first[i]; c < first[i + 1]; c++)
            at[c] = c == first[i] ? nb + ka++ : kb++;
    }
    struct grad_part *gathered = be_poisoned(gpu, (size_t)total * sizeof *gathered);
    struct grad_part *inorder = be_poisoned(gpu, (size_t)total * sizeof *inorder);
    gpu->grad_stats_parts(gpu, b, NT, gathered);
    gpu->grad_stats_parts(gpu, a, NT, gathered + nb);
    gpu->grad_stats_combine(gpu, gathered, first, at, NT, &chk[1], cnt + 2 * NT);
    /* the whole tensors' parts in order, combined without `at` */
    gpu->grad_stats_parts(gpu, gg, NT, inorder);
    gpu->grad_stats_combine(gpu, inorder, first, NULL, NT, &chk[2], cnt + 4 * NT);
    struct grad_check hg[3];
    int64_t counts[3][2 * NT];
    gpu->download(gpu, hg, chk, sizeof hg);
    gpu->download(gpu, counts, cnt, sizeof counts);
    check_gpu();
    cr_assert_eq(na + nb, total);
    for (int k = 1; k < 3; k++) {
        cr_assert(memcmp(&hg[k].sumsq, &hg[0].sumsq, sizeof(double)) == 0, "%s: sumsq %.17g, grad_stats %.17g",
                  k == 1 ? "two ranks' parts" : "the parts in order", hg[k].sumsq, hg[0].sumsq);
        cr_assert(memcmp(&hg[k].absmax, &hg[0].absmax, sizeof(double)) == 0, "absmax %.17g, grad_stats %.17g",
                  hg[k].absmax, hg[0].absmax);
        cr_assert_eq(hg[k].found_nonfinite, 1);
        cr_assert_eq(hg[k].update_nonfinite, 0);
        cr_assert(memcmp(counts[k], counts[0], sizeof counts[0]) == 0, "per-tensor counts (%d)", k);
    }
    cr_assert_eq(hg[0].found_nonfinite, 1);
    cr_assert(counts[0][NT + 1] == 1 && counts[0][7] == 1 && counts[0][NT + 7] == 1 && counts[0][36] == 1,
              "the planted values, each counted for its tensor");
    /* against the CPU */
    struct grad_check *chk_c = cpu->alloc(cpu, sizeof *chk_c), hc;
    int64_t *cnt_c = cpu->alloc(cpu, 2 * NT * sizeof *cnt_c);
    cr_assert(chk_c && cnt_c);
    cpu->grad_stats(cpu, gc, NT, chk_c, cnt_c);
    cpu->download(cpu, &hc, chk_c, sizeof hc);
    cr_assert(memcmp(cnt_c, counts[0], sizeof counts[0]) == 0, "per-tensor counts: the CPU's");
    cr_assert_eq(hg[0].absmax, hc.absmax, "absmax %.17g vs the CPU's %.17g", hg[0].absmax, hc.absmax);
    double bound = 2.0 * (double)n_all * DBL_EPSILON * hc.sumsq;
    cr_assert(fabs(hg[0].sumsq - hc.sumsq) <= bound, "sumsq %.17g vs the CPU's %.17g (bound %g)", hg[0].sumsq,
              hc.sumsq, bound);
    cpu->free(cpu, chk_c);
    cpu->free(cpu, cnt_c);
    gpu->free(gpu, chk);
    gpu->free(gpu, cnt);
    gpu->free(gpu, gathered);
    gpu->free(gpu, inorder);
    free(at);
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
        int64_t zc = zeros_of(cpu, &x.c, 0), zg = zeros_of(gpu, &x.g, 0);
        cr_assert_eq(zg, zc, "count_zeros %lld vs %lld", (long long)zg, (long long)zc);
        cr_assert(zc > 40000);
        cr_assert_eq(zeros_of(gpu, &x.g, 1000), zc + 1000, "count_zeros adds to its accumulator");
        pair_free(&x);
    }
}

/* The GPU tensor's bytes, downloaded (malloc'd). */
static void *gpu_bytes_of(const struct tensor *t)
{
    void *h = malloc(tensor_bytes(t));
    cr_assert_not_null(h);
    gpu->download(gpu, h, t->data, tensor_bytes(t));
    return h;
}

/* The update reads its scalars (lr, bias corrections, unscale-and-clip factor, skip) from backend memory,
 * as step_finish leaves them: each case builds them with step_rule_scalars and places them on both. After
 * the compared update, the same update with skip set must leave every GPU tensor as it is. */
Test(cuda_backend, optimizers, .init = open_both, .fini = close_both)
{
    rng_state = 15;
    int64_t n = 10007;
    struct { bool sgd, nesterov; int64_t step; } cases[] = {
        {false, false, 3}, {true, false, 3}, {true, true, 3}, {true, false, 1}, {false, false, 1},
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        bool sgd = cases[ci].sgd;
        const char *name = sgd ? "sgd" : "adamw";
        struct pair p, g, m, v, low;
        pair_rand(&p, DT_FP32, 1, &n, -1, 1);
        pair_rand(&g, DT_FP32, 1, &n, -100, 100);
        pair_rand(&m, DT_FP32, 1, &n, -0.1f, 0.1f);
        pair_rand(&v, DT_FP32, 1, &n, 0, 0.1f);
        pair_out(&low, ci % 2 ? DT_FP16 : DT_BF16, 1, &n);
        struct step_params sp = {.beta1 = 0.9f, .beta2 = 0.999f, .weight_decay = 0.1f};
        struct step_scalars sc;
        step_rule_scalars(&sc, &sp, 1e-2f, cases[ci].step, 1.0f / 128.0f);
        cr_assert_eq(sc.first_step, cases[ci].step == 1);
        struct step_scalars *sc_c = be_put(cpu, &sc, sizeof sc), *sc_g = be_put(gpu, &sc, sizeof sc);
        struct optim_update_args a = {.weight_decay = 0.1f, .beta1 = sp.beta1, .beta2 = sp.beta2, .eps = 1e-8f,
                                      .momentum = 0.9f, .nesterov = cases[ci].nesterov};
        for (int side = 0; side < 2; side++) {
            struct backend *be = side ? gpu : cpu;
            a.master = side ? &p.g : &p.c;
            a.grad = side ? &g.g : &g.c;
            a.m = side ? &m.g : &m.c;
            a.v = side ? &v.g : &v.c;
            a.copy = side ? &low.g : &low.c;
            a.sc = side ? sc_g : sc_c;
            if (sgd)
                be->sgd_update(be, &a, 1);
            else
                be->adamw_update(be, &a, 1);
        }
        char what[96];
        snprintf(what, sizeof what, "%s step %lld nesterov %d: master", name, (long long)cases[ci].step,
                 cases[ci].nesterov);
        pair_expect(&p, 1e-6, what);
        pair_expect(&m, 1e-6, sgd ? "sgd momentum buffer" : "adamw m");
        if (!sgd)
            pair_expect(&v, 1e-6, "adamw v");
        pair_expect(&low, 1e-3, "low-precision copy written in the same pass");

        sc.skip = 1;
        gpu->upload(gpu, sc_g, &sc, sizeof sc);
        struct tensor *kept[] = {&p.g, &m.g, &v.g, &low.g};
        void *before[4];
        for (int k = 0; k < 4; k++)
            before[k] = gpu_bytes_of(kept[k]);
        if (sgd)
            gpu->sgd_update(gpu, &a, 1);
        else
            gpu->adamw_update(gpu, &a, 1);
        check_gpu();
        for (int k = 0; k < 4; k++) {
            void *after = gpu_bytes_of(kept[k]);
            cr_assert_eq(memcmp(before[k], after, tensor_bytes(kept[k])), 0,
                         "%s with skip set wrote tensor %d (master, m, v, lowp)", name, k);
            free(after);
            free(before[k]);
        }
        cpu->free(cpu, sc_c);
        gpu->free(gpu, sc_g);
        struct pair *all[] = {&p, &g, &m, &v, &low};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
            pair_free(all[i]);
    }
}

/* The parameters of optimizers_many_tensors_in_one_call: one element to more than one block's share of
 * the grid, with and without a low-precision copy, decaying or not. */
static const struct mt_spec {
    int64_t numel;
    bool has_lowp;
    enum dtype lowp_dt;
    float weight_decay;
    bool may_lack_m; /* the case with drop_m gives this parameter no momentum buffer (m NULL) */
} mt_specs[] = {
    {1, false, DT_FP32, 0.1f, false},   {7, true, DT_BF16, 0.0f, true},      {1000, true, DT_FP16, 0.1f, false},
    {4097, false, DT_FP32, 0.0f, true}, {65536, true, DT_BF16, 0.1f, false},
};
enum { MT_N = sizeof mt_specs / sizeof mt_specs[0] };

struct mt_case {
    const char *name;
    bool sgd, nesterov;
    bool drop_m; /* sgd: the parameters marked may_lack_m pass m NULL */
};

struct mt_param {
    struct pair p, g, m, v, low; /* low only where the spec has_lowp */
};

static void mt_alloc(struct mt_param *t)
{
    for (int i = 0; i < MT_N; i++) {
        int64_t n = mt_specs[i].numel;
        pair_rand(&t[i].p, DT_FP32, 1, &n, -1, 1);
        pair_rand(&t[i].g, DT_FP32, 1, &n, -100, 100);
        pair_rand(&t[i].m, DT_FP32, 1, &n, -0.1f, 0.1f);
        pair_rand(&t[i].v, DT_FP32, 1, &n, 0, 0.1f);
        if (mt_specs[i].has_lowp)
            pair_out(&t[i].low, mt_specs[i].lowp_dt, 1, &n);
    }
}

static void mt_free(struct mt_param *t)
{
    for (int i = 0; i < MT_N; i++) {
        pair_free(&t[i].p);
        pair_free(&t[i].g);
        pair_free(&t[i].m);
        pair_free(&t[i].v);
        if (mt_specs[i].has_lowp)
            pair_free(&t[i].low);
    }
}

static struct tensor *side_of(struct pair *p, bool on_gpu)
{
    return on_gpu ? &p->g : &p->c;
}

/* One update call's arguments: the parameters idx[0..n) of t, on one backend. */
static void mt_args(struct optim_update_args *a, struct mt_param *t, const int *idx, int n, bool on_gpu,
                    const struct mt_case *c, const struct step_scalars *sc, const struct step_params *sp)
{
    for (int k = 0; k < n; k++) {
        int i = idx[k];
        bool no_m = c->drop_m && mt_specs[i].may_lack_m;
        a[k] = (struct optim_update_args){
            .master = side_of(&t[i].p, on_gpu),
            .grad = side_of(&t[i].g, on_gpu),
            .m = no_m ? NULL : side_of(&t[i].m, on_gpu),
            .v = c->sgd ? NULL : side_of(&t[i].v, on_gpu),
            .copy = mt_specs[i].has_lowp ? side_of(&t[i].low, on_gpu) : NULL,
            .sc = sc,
            .weight_decay = mt_specs[i].weight_decay,
            .beta1 = sp->beta1,
            .beta2 = sp->beta2,
            .eps = 1e-8f,
            .momentum = 0.9f,
            .nesterov = c->nesterov,
        };
    }
}

static void mt_update(struct backend *be, const struct mt_case *c, const struct optim_update_args *a, int n)
{
    if (c->sgd)
        be->sgd_update(be, a, n);
    else
        be->adamw_update(be, a, n);
}

/* The same call on both backends: the CPU loops over the parameters, the GPU queues one launch. */
static void mt_update_both(struct mt_param *t, const struct mt_case *c, const int *idx, int n,
                           const struct step_scalars *sc_c, const struct step_scalars *sc_g,
                           const struct step_params *sp)
{
    struct optim_update_args a[MT_N];
    mt_args(a, t, idx, n, false, c, sc_c, sp);
    mt_update(cpu, c, a, n);
    mt_args(a, t, idx, n, true, c, sc_g, sp);
    mt_update(gpu, c, a, n);
}

/* Step t's scalars (step_rule_scalars, as step_finish leaves them) into both backends' memory. */
static void mt_put_scalars(struct step_scalars *sc, const struct step_params *sp, int64_t step,
                           struct step_scalars *sc_c, struct step_scalars *sc_g)
{
    step_rule_scalars(sc, sp, 1e-2f, step, 1.0f / 128.0f);
    cpu->upload(cpu, sc_c, sc, sizeof *sc);
    gpu->upload(gpu, sc_g, sc, sizeof *sc);
}

/* An fp32 update against the CPU's by relative L2 error, the reference's RMS floored at 1e-2: the
 * optimizer kernels are built without FMA contraction (loss_optim.cu, -fmad=false), but the device's pow
 * and sqrt in the bias corrections may differ from glibc's by an ulp, and in a one-element tensor whose
 * value cancels to near zero that ulp would be a large relative error of the result. */
static void expect_update(const struct pair *t, const char *what)
{
    size_t n = t->c.numel;
    const float *c = t->c.data;
    double ss = 0.0;
    for (size_t i = 0; i < n; i++)
        ss += (double)c[i] * c[i];
    double norm = sqrt(ss), rel = rel_l2(&t->g, &t->c, what);
    double err = rel * (ss > 0.0 ? norm : 1.0), floor_norm = 1e-2 * sqrt((double)n);
    rel = err / (norm > floor_norm ? norm : floor_norm);
    cr_assert(rel <= tol_of(DT_FP32), "%s: relative L2 error %.3g > %.3g", what, rel, tol_of(DT_FP32));
}

/* The GPU's low-precision copy is its own fp32 master rounded once (the same pass wrote both). */
static void expect_lowp_is_master(const struct mt_param *t, enum dtype dt, const char *what)
{
    size_t n = t->p.c.numel, bytes = tensor_bytes(&t->low.c);
    float *master = gpu_bytes_of(&t->p.g);
    void *low = gpu_bytes_of(&t->low.g), *want = malloc(bytes);
    cr_assert_not_null(want);
    dtype_convert(want, dt, master, DT_FP32, n);
    cr_assert_eq(memcmp(want, low, bytes), 0, "%s: the GPU's copy is not its master rounded once to %s", what,
                 dtype_name(dt));
    free(master);
    free(low);
    free(want);
}

/* Every parameter's master, m and v (untouched ones too: they must stay equal), and each lowp copy. */
static void mt_expect(const struct mt_param *t, const char *name, const char *when)
{
    char what[192];
    for (int i = 0; i < MT_N; i++) {
        const char *part[] = {"master", "m", "v"};
        const struct pair *fp32[] = {&t[i].p, &t[i].m, &t[i].v};
        for (int k = 0; k < 3; k++) {
            snprintf(what, sizeof what, "%s, %s: parameter %d (%lld elements): %s", name, when, i,
                     (long long)mt_specs[i].numel, part[k]);
            expect_update(fp32[k], what);
        }
        if (!mt_specs[i].has_lowp)
            continue;
        snprintf(what, sizeof what, "%s, %s: parameter %d (%lld elements): low-precision copy", name, when, i,
                 (long long)mt_specs[i].numel);
        pair_expect(&t[i].low, tol_of(mt_specs[i].lowp_dt), what);
        expect_lowp_is_master(&t[i], mt_specs[i].lowp_dt, what);
    }
}

/* A call whose step scalars say skip leaves every GPU tensor bit for bit as it was. */
static void mt_expect_skip_writes_nothing(struct mt_param *t, const struct mt_case *c, const int *idx, int n,
                                          const struct step_scalars *sc_g, const struct step_params *sp)
{
    enum { KEPT = 4 };
    struct tensor *kept[MT_N][KEPT];
    void *before[MT_N][KEPT];
    for (int i = 0; i < MT_N; i++) {
        struct tensor *k[KEPT] = {&t[i].p.g, &t[i].m.g, &t[i].v.g, mt_specs[i].has_lowp ? &t[i].low.g : NULL};
        for (int j = 0; j < KEPT; j++) {
            kept[i][j] = k[j];
            before[i][j] = k[j] ? gpu_bytes_of(k[j]) : NULL;
        }
    }
    struct optim_update_args a[MT_N];
    mt_args(a, t, idx, n, true, c, sc_g, sp);
    mt_update(gpu, c, a, n);
    check_gpu();
    for (int i = 0; i < MT_N; i++)
        for (int j = 0; j < KEPT; j++) {
            if (!kept[i][j])
                continue;
            void *after = gpu_bytes_of(kept[i][j]);
            cr_assert_eq(memcmp(before[i][j], after, tensor_bytes(kept[i][j])), 0,
                         "%s with skip set wrote parameter %d's tensor %d (master, m, v, lowp)", c->name, i, j);
            free(after);
            free(before[i][j]);
        }
}

/* A fresh GPU backend refuses the call and says why (the first error stays until destroy, so each
 * refusal gets its own backend; the kernels never run). */
static void expect_refused(const struct optim_update_args *a, int n, bool sgd, const char *needle)
{
    struct backend *be = NULL;
    struct amp_error err = {0};
    cr_assert_eq(backend_open(&be, "cuda:0", NULL, 0, &err), AMP_OK, "%s (hint: %s)", err.msg, err.hint);
    if (sgd)
        be->sgd_update(be, a, n);
    else
        be->adamw_update(be, a, n);
    cr_assert_neq(be->status(be, &err), AMP_OK, "%s update of %d parameters was not refused (expected \"%s\")",
                  sgd ? "sgd" : "adamw", n, needle);
    cr_assert(strstr(err.msg, needle), "refused with \"%s\", expected \"%s\"", err.msg, needle);
    backend_close(be);
}

/* One call updates all of a model's parameters (one launch on the GPU): every tensor against the CPU,
 * which loops, over two steps; a skipped step writes nothing; three calls queued back to back on two
 * different tables (the GPU caches its table and rewrites its host copy at once) each update their own
 * parameters; n = 0 does nothing, and calls breaking the shared-fields contract are refused. */
Test(cuda_backend, optimizers_many_tensors_in_one_call, .init = open_both, .fini = close_both)
{
    rng_state = 16;
    static const struct mt_case cases[] = {
        {"adamw", false, false, false},
        {"sgd with momentum", true, false, false},
        {"sgd nesterov", true, true, false},
        {"sgd, two parameters without a momentum buffer (m NULL)", true, false, true},
    };
    struct step_params sp = {.beta1 = 0.9f, .beta2 = 0.999f, .weight_decay = 0.1f};
    struct step_scalars sc;
    struct step_scalars *sc_c = cpu->alloc(cpu, sizeof sc), *sc_g = gpu->alloc(gpu, sizeof sc);
    cr_assert(sc_c && sc_g);
    int all[MT_N];
    for (int i = 0; i < MT_N; i++)
        all[i] = i;
    const int some[] = {3, 0}; /* another table: fewer parameters, in another order */
    enum { SOME = sizeof some / sizeof some[0] };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const struct mt_case *c = &cases[ci];
        struct mt_param t[MT_N];
        mt_alloc(t);
        for (int64_t step = 1; step <= 2; step++) {
            mt_put_scalars(&sc, &sp, step, sc_c, sc_g);
            mt_update_both(t, c, all, MT_N, sc_c, sc_g, &sp);
            char when[32];
            snprintf(when, sizeof when, "step %lld", (long long)step);
            mt_expect(t, c->name, when);
        }
        sc.skip = 1;
        gpu->upload(gpu, sc_g, &sc, sizeof sc);
        mt_expect_skip_writes_nothing(t, c, all, MT_N, sc_g, &sp);

        /* no synchronisation between the GPU calls: each must run on its own table */
        mt_put_scalars(&sc, &sp, 3, sc_c, sc_g);
        mt_update_both(t, c, all, MT_N, sc_c, sc_g, &sp);
        mt_update_both(t, c, some, SOME, sc_c, sc_g, &sp);
        mt_update_both(t, c, all, MT_N, sc_c, sc_g, &sp);
        mt_expect(t, c->name, "step 3: all parameters, then parameters 3 and 0, then all, queued back to back");
        mt_free(t);
    }

    /* n = 0 reads nothing and records nothing */
    gpu->adamw_update(gpu, NULL, 0);
    gpu->sgd_update(gpu, NULL, 0);
    check_gpu();

    struct mt_param t[MT_N];
    mt_alloc(t);
    struct optim_update_args a[MT_N];
    struct step_scalars *other_sc = be_put(gpu, &sc, sizeof sc);
    mt_args(a, t, all, MT_N, true, &cases[0], NULL, &sp);
    expect_refused(a, MT_N, false, "without step scalars");
    mt_args(a, t, all, MT_N, true, &cases[1], sc_g, &sp);
    a[2].sc = other_sc;
    expect_refused(a, MT_N, true, "entry 2 has other step scalars");
    mt_args(a, t, all, MT_N, true, &cases[0], sc_g, &sp);
    a[4].beta2 = 0.99f;
    expect_refused(a, MT_N, false, "entry 4 has other betas or eps");
    check_gpu(); /* the refusals were on other backends */
    mt_free(t);
    gpu->free(gpu, other_sc);
    cpu->free(cpu, sc_c);
    gpu->free(gpu, sc_g);
}

/* ---- the step's tail ---------------------------------------------------------------------------- */

/* Relative closeness; a NaN on the CPU needs a NaN on the GPU. */
static void expect_close(double g, double c, double tol, int step, const char *what)
{
    if (isnan(c)) {
        cr_assert(isnan(g), "step %d: %s: GPU %.17g where the CPU has NaN", step, what, g);
        return;
    }
    cr_assert(fabs(g - c) <= tol * fabs(c), "step %d: %s: GPU %.17g vs CPU %.17g (relative tolerance %g)", step, what,
              g, c, tol);
}

#define EXPECT_SAME_INT(step, g, c, what)                                                                           \
    cr_assert_eq((long long)(g), (long long)(c), "step %d: %s: GPU %lld vs CPU %lld", (step), (what), (long long)(g), \
                 (long long)(c))
#define EXPECT_SAME_REAL(step, g, c, what)                                                                          \
    cr_assert((double)(g) == (double)(c), "step %d: %s: GPU %.17g vs CPU %.17g", (step), (what), (double)(g),      \
              (double)(c))

static void expect_same_row(int s, const struct step_row *g, const struct step_row *c)
{
    EXPECT_SAME_INT(s, g->step, c->step, "row.step");
    EXPECT_SAME_INT(s, g->found_inf, c->found_inf, "row.found_inf");
    EXPECT_SAME_INT(s, g->skipped, c->skipped, "row.skipped");
    EXPECT_SAME_INT(s, g->skips_total, c->skips_total, "row.skips_total");
    EXPECT_SAME_INT(s, g->consecutive_skips, c->consecutive_skips, "row.consecutive_skips");
    EXPECT_SAME_REAL(s, g->scale, c->scale, "row.scale");
    EXPECT_SAME_REAL(s, g->scale_next, c->scale_next, "row.scale_next");
    expect_close(g->loss, c->loss, 1e-12, s, "row.loss");
    expect_close(g->grad_norm, c->grad_norm, 1e-12, s, "row.grad_norm");
    expect_close(g->clip_coef, c->clip_coef, 1e-12, s, "row.clip_coef");
    expect_close(g->lr, c->lr, 1e-12, s, "row.lr");
}

static void expect_same_state(int s, const struct step_state *g, const struct step_state *c)
{
    const struct scaler *gs = &g->scaler, *cs = &c->scaler;
    EXPECT_SAME_INT(s, gs->dynamic, cs->dynamic, "scaler.dynamic");
    EXPECT_SAME_REAL(s, gs->scale, cs->scale, "scaler.scale");
    EXPECT_SAME_REAL(s, gs->growth_factor, cs->growth_factor, "scaler.growth_factor");
    EXPECT_SAME_REAL(s, gs->backoff_factor, cs->backoff_factor, "scaler.backoff_factor");
    EXPECT_SAME_REAL(s, gs->min_scale, cs->min_scale, "scaler.min_scale");
    EXPECT_SAME_REAL(s, gs->max_scale, cs->max_scale, "scaler.max_scale");
    EXPECT_SAME_INT(s, gs->growth_interval, cs->growth_interval, "scaler.growth_interval");
    EXPECT_SAME_INT(s, gs->hysteresis, cs->hysteresis, "scaler.hysteresis");
    EXPECT_SAME_INT(s, gs->growth_tracker, cs->growth_tracker, "scaler.growth_tracker");
    EXPECT_SAME_INT(s, gs->hysteresis_left, cs->hysteresis_left, "scaler.hysteresis_left");
    EXPECT_SAME_INT(s, gs->consecutive_skips, cs->consecutive_skips, "scaler.consecutive_skips");
    EXPECT_SAME_INT(s, gs->skips_total, cs->skips_total, "scaler.skips_total");
    EXPECT_SAME_INT(s, gs->last_overflow_step, cs->last_overflow_step, "scaler.last_overflow_step");
    EXPECT_SAME_INT(s, g->step, c->step, "state.step");
    EXPECT_SAME_INT(s, g->opt_step, c->opt_step, "state.opt_step");
    expect_close(g->loss_acc, c->loss_acc, 1e-12, s, "state.loss_acc");
    EXPECT_SAME_REAL(s, g->seed, c->seed, "state.seed");
    EXPECT_SAME_INT(s, g->sc.skip, c->sc.skip, "sc.skip");
    EXPECT_SAME_INT(s, g->sc.first_step, c->sc.first_step, "sc.first_step");
    /* fp32 roundings of double expressions with pow and cos: the device's may differ in the last ulp */
    expect_close(g->sc.grad_mul, c->sc.grad_mul, 1e-6, s, "sc.grad_mul");
    expect_close(g->sc.lr, c->sc.lr, 1e-6, s, "sc.lr");
    expect_close(g->sc.adam_neg_step, c->sc.adam_neg_step, 1e-6, s, "sc.adam_neg_step");
    expect_close(g->sc.adam_bc2_sqrt, c->sc.adam_bc2_sqrt, 1e-6, s, "sc.adam_bc2_sqrt");
    expect_close(g->sc.adam_decay, c->sc.adam_decay, 1e-6, s, "sc.adam_decay");
}

/* step_finish on both backends over the same sequence of gradient checks: a dynamic scaler that grows
 * every 3 clean steps and backs off on the second overflow in a row (hysteresis 2), clipping at norm 1,
 * a cosine schedule with warmup that reaches its end. Every row and the state after every step must
 * agree. Run with the L2 and the inf norm. */
Test(cuda_backend, step_finish_matches_the_cpu, .init = open_both, .fini = close_both)
{
    rng_state = 17;
    enum { STEPS = 12 };
    static const bool nonfinite[STEPS] = {[3] = true, [4] = true, [8] = true};
    for (int inf_norm = 0; inf_norm < 2; inf_norm++) {
        struct step_params p = {.micro_batches = 2, .max_norm = 1.0, .inf_norm = inf_norm, .beta1 = 0.9f,
                                .beta2 = 0.999f, .weight_decay = 0.01f,
                                .schedule = {.kind = SCHEDULE_COSINE, .lr = 3e-3, .min_lr = 1e-5, .warmup_steps = 3,
                                             .total_steps = 8}};
        struct step_state st0 = {.scaler = {.dynamic = true, .scale = 65536.0, .growth_factor = 2.0,
                                            .backoff_factor = 0.5, .min_scale = 1.0, .max_scale = 16777216.0,
                                            .growth_interval = 3, .hysteresis = 2, .hysteresis_left = 2,
                                            .last_overflow_step = -1},
                                 .seed = 32768.0f};
        struct grad_check checks[STEPS];
        double loss_acc[STEPS];
        for (int s = 0; s < STEPS; s++) {
            double norm = uniform(0.05f, 4.0f) * 65536.0;
            checks[s] = (struct grad_check){.sumsq = norm * norm, .absmax = norm * 0.8,
                                            .found_nonfinite = nonfinite[s]};
            loss_acc[s] = uniform(0.5f, 3.0f);
        }
        struct step_row rows[2][STEPS];
        struct step_state states[2][STEPS];
        for (int side = 0; side < 2; side++) {
            struct backend *be = side ? gpu : cpu;
            struct step_state *st = be_put(be, &st0, sizeof st0);
            struct grad_check *chk = be_put(be, checks, sizeof checks);
            struct step_row *row = be_poisoned(be, sizeof rows[side]);
            for (int s = 0; s < STEPS; s++) {
                be->upload(be, (char *)st + offsetof(struct step_state, loss_acc), &loss_acc[s], sizeof(double));
                be->step_finish(be, &p, st, &chk[s], &row[s]);
                be->download(be, &states[side][s], st, sizeof states[side][s]);
            }
            be->download(be, rows[side], row, sizeof rows[side]);
            be->free(be, st);
            be->free(be, chk);
            be->free(be, row);
        }
        check_gpu();
        int grew = 0, backed_off = 0, held = 0, clipped = 0;
        for (int s = 0; s < STEPS; s++) {
            const struct step_row *r = &rows[0][s];
            cr_assert_eq(r->step, s + 1, "CPU row %d has step %lld", s, (long long)r->step);
            grew += r->scale_next > r->scale;
            backed_off += r->scale_next < r->scale;
            held += r->skipped && r->scale_next == r->scale;
            clipped += r->clip_coef < 1.0;
            expect_same_row(s, &rows[1][s], r);
            expect_same_state(s, &states[1][s], &states[0][s]);
        }
        cr_assert(grew >= 2 && backed_off >= 1 && held >= 1 && clipped >= 1,
                  "inf_norm %d: the sequence must grow the scale (%d), back off (%d), hold it on an overflow (%d) "
                  "and clip (%d)", inf_norm, grew, backed_off, held, clipped);
        cr_assert_eq(states[0][STEPS - 1].opt_step, STEPS - 3, "CPU: the three overflows are not counted");
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

/* Queue one step and wait for it: its log record. */
static enum amp_status step_now(struct trainer *t, struct step_record *rec, struct amp_error *err)
{
    enum amp_status s = trainer_step(t, err);
    if (s == AMP_OK)
        s = trainer_flush(t, err);
    if (s == AMP_OK) {
        cr_assert_gt(t->nrecs, 0, "trainer_flush after a step returned no record");
        *rec = t->recs[t->nrecs - 1];
    }
    return s;
}

/* Mean loss over steps [from, to) of a 200-step run on `device`. */
static void train_losses(const char *device, const char *mode, double *losses, int steps)
{
    struct config cfg;
    mlp_config(&cfg, device, mode);
    struct trainer t;
    struct amp_error err = {0};
    cr_assert_eq(trainer_setup(&t, &cfg, NULL, &err), AMP_OK, "%s: %s", device, err.msg);
    for (int s = 0; s < steps; s++) {
        struct step_record rec = {0};
        cr_assert_eq(step_now(&t, &rec, &err), AMP_OK, "%s %s step %d: %s", device, mode, s, err.msg);
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

/* run.recompute on the GPU: the byte GPT with every recompute mode gives the bits of none (tests/test_recompute.c's
 * comparison, on cuda:0), in bf16 and fp16-dynamic, with accumulation. */
Test(cuda_backend, recompute_is_the_same_bits_on_the_gpu, .timeout = 900)
{
    if (backend_cuda_device_count() <= 0)
        cr_skip_test("no CUDA device: GPU recompute was not run");
    const char *modes[] = {"bf16", "fp16-dynamic"}, *kinds[] = {"none", "gelu", "attention", "block"};
    for (int i = 0; i < 2; i++) {
        make_scratch();
        for (int k = 0; k < 4; k++) {
            struct result r = amp("run configs/text_gpt.yaml run.device=cuda run.steps=3 run.log_every=1 accum_steps=2 "
                                  "precision.mode=%s run.recompute=%s run.out_dir=%s/%s",
                                  modes[i], kinds[k], scratch, kinds[k]);
            cr_assert_eq(r.code, 0, "%s %s:\n%s", modes[i], kinds[k], r.out);
            cr_assert(strstr(r.out, "device: cuda:0"), "not on the GPU:\n%s", r.out);
        }
        for (int k = 1; k < 4; k++) {
            char a[512], b[512];
            snprintf(a, sizeof a, "%s/none/ckpt-3.h5", scratch);
            snprintf(b, sizeof b, "%s/%s/ckpt-3.h5", scratch, kinds[k]);
            assert_same_tensors(a, b);
            snprintf(a, sizeof a, "%s/none/scale_log.csv", scratch);
            snprintf(b, sizeof b, "%s/%s/scale_log.csv", scratch, kinds[k]);
            assert_same_logs(a, b);
        }
        remove_scratch();
    }
}

/* The transformer blocks' residual adds run inside the layernorms after them (models/attention.c: ln2 both ways,
 * the block's last add inside the next layernorm, ln1's backward): the byte GPT on cuda:0 with them (the default)
 * and apart (run.numerics_every turns fusing off: each block adds its y) gives the same checkpoint tensors and
 * scale_log.csv, in bf16 and fp16-dynamic, with accumulation. */
Test(cuda_backend, residual_adds_in_the_layernorms_are_the_same_bits_on_the_gpu, .timeout = 600)
{
    if (backend_cuda_device_count() <= 0)
        cr_skip_test("no CUDA device: the GPU's fused residual adds were not run");
    const char *modes[] = {"bf16", "fp16-dynamic"}, *sides[] = {"fused", "apart"};
    for (int i = 0; i < 2; i++) {
        make_scratch();
        for (int k = 0; k < 2; k++) {
            struct result r = amp("run configs/text_gpt.yaml run.device=cuda run.steps=3 run.log_every=1 accum_steps=2 "
                                  "precision.mode=%s run.numerics_every=%d run.out_dir=%s/%s",
                                  modes[i], k ? 1000 : 0, scratch, sides[k]);
            cr_assert_eq(r.code, 0, "%s %s:\n%s", modes[i], sides[k], r.out);
            cr_assert(strstr(r.out, "device: cuda:0"), "not on the GPU:\n%s", r.out);
        }
        char a[512], b[512];
        snprintf(a, sizeof a, "%s/fused/ckpt-3.h5", scratch);
        snprintf(b, sizeof b, "%s/apart/ckpt-3.h5", scratch);
        cr_assert_geq(assert_same_tensors(a, b), 20, "%s: too few tensors compared", modes[i]);
        snprintf(a, sizeof a, "%s/fused/scale_log.csv", scratch);
        snprintf(b, sizeof b, "%s/apart/scale_log.csv", scratch);
        assert_same_logs(a, b);
        remove_scratch();
    }
}

/* The padded head on the GPU: configs/gpt2_tiny.yaml at vocabulary 300 (the GPU pads it to 320) trains, its
 * checkpoint holds the (300, 32) table, and its first loss (the same initial weights and batch, before any update)
 * agrees with the CPU's unpadded run to bf16's precision: each rounding of the logits' path is within 2^-9 relative,
 * a handful of them deep, so 1% of a loss near ln 300 = 5.7 is a generous bound. */
Test(cuda_backend, the_padded_head_trains_on_the_gpu, .timeout = 600)
{
    if (backend_cuda_device_count() <= 0)
        cr_skip_test("no CUDA device: the padded head was not run on the GPU");
    if (access("/usr/share/games/fortunes/cookie", R_OK) != 0)
        cr_skip_test("the fortunes corpus is not installed (Debian package fortunes)");
    make_scratch();
    char cmd[1400];
    /* make_tokens.py needs the standard library only: where there is no /usr/bin/python3 (the GPU machine's Python
     * is a virtual environment's), python3 on PATH serves */
    snprintf(cmd, sizeof cmd, "p=/usr/bin/python3; [ -x $p ] || p=python3; $p %s/scripts/tools/make_tokens.py --format "
             "nanogpt --val-fraction 0.1 -o %s/train.bin /usr/share/games/fortunes/cookie >/dev/null 2>&1",
             AMP_SOURCE_DIR, scratch);
    cr_assert_eq(shell(cmd).code, 0, "make_tokens.py failed");
    double first[2];
    const char *devices[] = {"cpu", "cuda"};
    for (int i = 0; i < 2; i++) {
        struct result r = amp("run configs/gpt2_tiny.yaml run.device=%s run.steps=2 run.log_every=1 "
                              "precision.mode=bf16 data.vocab=300 model.layers.0.vocab=300 model.layers.4.out=300 "
                              "data.train_bin=%s/train.bin data.val_bin=%s/val.bin run.out_dir=%s/%s",
                              devices[i], scratch, scratch, scratch, devices[i]);
        cr_assert_eq(r.code, 0, "%s:\n%s", devices[i], r.out);
        char path[600];
        snprintf(path, sizeof path, "%s/%s/scale_log.csv", scratch, devices[i]);
        FILE *f = fopen(path, "r");
        cr_assert_not_null(f, "%s", path);
        char line[1024];
        cr_assert_not_null(fgets(line, sizeof line, f)); /* the header */
        cr_assert_not_null(fgets(line, sizeof line, f));
        fclose(f);
        cr_assert_eq(sscanf(line, "%*[^,],%*[^,],%lf", &first[i]), 1, "%s", line);
    }
    cr_assert(fabs(first[1] - first[0]) <= 0.01 * fabs(first[0]), "step 1 loss: GPU %.6f, CPU %.6f", first[1],
              first[0]);
    /* the table's shape as `ampTrain inspect` lists it (h5py is not in every python3: the GPU machine's system one) */
    struct result r = amp("inspect %s/cuda/ckpt-2.h5", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    const char *wte = strstr(r.out, "/model/wte/wte "), *eol = wte ? strchr(wte, '\n') : NULL;
    const char *shape = wte ? strstr(wte, "(300, 32)") : NULL;
    cr_assert(shape && (!eol || shape < eol), "the checkpoint's table:\n%s", r.out);
    remove_scratch();
}

/* ---- the binary the end-to-end tests run (no GPU needed) -------------------------------------------- */

/* amp() runs $AMPTRAIN_BIN where set: on a GPU machine the bundle's binary lies away from the build path
 * compiled in. scripts/gpu/gpu-check.sh runs this test with AMPTRAIN_BIN naming a wrapper that leaves a mark,
 * which proves the variable is honoured (its DRY run does it on the CPU). */
Test(cuda_backend, end_to_end_tests_run_the_binary_amptrain_bin_names)
{
    struct result r = amp("--version");
    cr_assert_eq(r.code, 0, "%s: %s", amp_binary(), r.out);
    cr_assert(strstr(r.out, "ampTrain "), "%s", r.out);
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

/* bf16 master weights and moments, rounded stochastically: the GPU draws lib/base/sround.h's bits as the CPU does
 * and computes each element in the same fp32 order without FMA, so the stored bf16 values are the CPU's. An
 * fp32 value a last-bit apart (a device sqrt or division off by an ulp) could round to the other neighbour: at
 * most one element in 10^4 may differ, by one bf16 step; the fp32 copy is the GPU's stored master widened. */
Test(cuda_backend, bf16_master_stochastic_rounding_matches_the_cpu, .init = open_both, .fini = close_both)
{
    int64_t n = 100003;
    for (int sgd = 0; sgd < 2; sgd++) {
        struct pair p, g, m, v, w;
        pair_rand(&p, DT_BF16, 1, &n, -1, 1);
        pair_rand(&g, DT_FP32, 1, &n, -100, 100);
        pair_rand(&m, DT_BF16, 1, &n, -0.1f, 0.1f);
        pair_rand(&v, DT_BF16, 1, &n, 0, 0.1f);
        pair_out(&w, DT_FP32, 1, &n);
        struct step_params sp = {.beta1 = 0.9, .beta2 = 0.999, .weight_decay = 0.1f};
        struct step_scalars sc;
        struct step_scalars *sc_c = cpu->alloc(cpu, sizeof sc), *sc_g = gpu->alloc(gpu, sizeof sc);
        cr_assert(sc_c && sc_g);
        mt_put_scalars(&sc, &sp, 3, sc_c, sc_g);
        for (int on_gpu = 0; on_gpu < 2; on_gpu++) {
            struct optim_update_args a = {
                .master = side_of(&p, on_gpu), .grad = side_of(&g, on_gpu), .m = side_of(&m, on_gpu),
                .v = sgd ? NULL : side_of(&v, on_gpu), .copy = side_of(&w, on_gpu), .sc = on_gpu ? sc_g : sc_c,
                .weight_decay = 0.1f, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8f, .momentum = 0.9f,
                .stochastic = true, .sr_seed = sr_seed(99), .sr_param = 5};
            struct backend *be = on_gpu ? gpu : cpu;
            if (sgd)
                be->sgd_update(be, &a, 1);
            else
                be->adamw_update(be, &a, 1);
        }
        check_gpu();
        const struct pair *t16[3] = {&p, &m, &v};
        for (int k = 0; k < (sgd ? 2 : 3); k++) {
            uint16_t *gb = gpu_bytes_of(&t16[k]->g);
            const uint16_t *cb = t16[k]->c.data;
            size_t differ = 0;
            for (int64_t i = 0; i < n; i++) {
                int d = (int)gb[i] - (int)cb[i];
                cr_assert(d >= -1 && d <= 1, "%s tensor %d [%lld]: GPU 0x%04x, CPU 0x%04x", sgd ? "sgd" : "adamw", k,
                          (long long)i, gb[i], cb[i]);
                differ += d != 0;
            }
            cr_assert(differ * 10000 <= (size_t)n, "%s tensor %d: %zu of %lld elements differ from the CPU's",
                      sgd ? "sgd" : "adamw", k, differ, (long long)n);
            free(gb);
        }
        uint16_t *gm = gpu_bytes_of(&p.g);
        float *gw = gpu_bytes_of(&w.g);
        for (int64_t i = 0; i < n; i++)
            cr_assert_eq(gw[i], bf16_to_fp32(gm[i]), "the GPU's fp32 copy is its stored master, element %lld",
                         (long long)i);
        free(gm);
        free(gw);
        cpu->free(cpu, sc_c);
        gpu->free(gpu, sc_g);
        pair_free(&p);
        pair_free(&g);
        pair_free(&m);
        pair_free(&v);
        pair_free(&w);
    }
}

/* The ReLU epilogues on the GPU: the bits of its own plain product followed by the ReLU op (act_forward, or
 * act_backward with aux as input) over C, the contract of backend.h; and within tol_of of the CPU's fused ones. */
Test(cuda_backend, gemm_relu_epilogues, .init = open_both, .fini = close_both)
{
    const int64_t m = 64, n = 96, k = 72, mn[2] = {m, n}, mk[2] = {m, k}, nk[2] = {n, k};
    rng_state = 23;
    for (int d = 0; d < 3; d++) {
        enum dtype dt = all_dtypes[d];
        struct pair a, b, mask, plain, fused;
        pair_rand(&a, dt, 2, mk, -1.0f, 1.0f);
        pair_rand(&b, dt, 2, nk, -1.0f, 1.0f);
        pair_rand(&mask, dt, 2, mn, -1.0f, 1.0f);
        for (int e = 0; e < 2; e++) {
            pair_out(&plain, dt, 2, mn);
            pair_out(&fused, dt, 2, mn);
            struct gemm_args g = {.a = &a.g, .b = &b.g, .c = &plain.g, .trans_b = true, .m = m, .n = n, .k = k,
                                  .alpha = 1, .batch = 1};
            gpu->gemm(gpu, &g);
            if (e)
                gpu->act_backward(gpu, ACT_RELU, &plain.g, &plain.g, &mask.g);
            else
                gpu->act_forward(gpu, ACT_RELU, &plain.g, &plain.g);
            g.c = &fused.g;
            g.epilogue = e ? GEMM_EPI_RELU_MASK : GEMM_EPI_RELU;
            g.aux = e ? &mask.g : NULL;
            gpu->gemm(gpu, &g);
            struct gemm_args gc = g;
            gc.a = &a.c;
            gc.b = &b.c;
            gc.c = &fused.c;
            gc.aux = e ? &mask.c : NULL;
            cpu->gemm(cpu, &gc);
            unsigned char *want = gpu_bytes_of(&plain.g), *got = gpu_bytes_of(&fused.g);
            cr_assert(memcmp(want, got, tensor_bytes(&plain.c)) == 0, "%s %s: the GPU's fused ReLU differs from its "
                      "product then the ReLU op", dtype_name(dt), e ? "GEMM_EPI_RELU_MASK" : "GEMM_EPI_RELU");
            free(want);
            free(got);
            pair_expect(&fused, tol_of(dt), e ? "GEMM_EPI_RELU_MASK against the CPU" : "GEMM_EPI_RELU against the CPU");
            pair_free(&plain);
            pair_free(&fused);
        }
        pair_free(&a);
        pair_free(&b);
        pair_free(&mask);
    }
}

/* upload_rows through both staging slots: the rows land in order, from the pinned staging memory the GPU gathers
 * into; the slot's wait then lets the host rewrite it. */
Test(cuda_backend, upload_rows_puts_every_row_in_its_place, .init = open_both, .fini = close_both)
{
    const size_t rb = 3136;
    const int64_t rows = 300, n = 128;
    unsigned char *table = malloc((size_t)rows * rb), *back = malloc((size_t)n * rb);
    int64_t idx[128];
    cr_assert(table && back);
    for (size_t i = 0; i < (size_t)rows * rb; i++)
        table[i] = (unsigned char)next_u64();
    for (int slot = 0; slot < BACKEND_STAGING_SLOTS; slot++) {
        for (int64_t i = 0; i < n; i++)
            idx[i] = (int64_t)(next_u64() % (uint64_t)rows);
        void *staged = gpu->host_alloc(gpu, (size_t)n * rb), *dst = gpu->alloc(gpu, (size_t)n * rb);
        cr_assert(staged && dst);
        gpu->staging_wait(gpu, slot);
        gpu->upload_rows(gpu, dst, table, rb, idx, n, staged, slot);
        gpu->download(gpu, back, dst, (size_t)n * rb);
        for (int64_t i = 0; i < n; i++)
            cr_assert(memcmp(back + (size_t)i * rb, table + (size_t)idx[i] * rb, rb) == 0,
                      "slot %d: row %lld is not table row %lld", slot, (long long)i, (long long)idx[i]);
        gpu->staging_wait(gpu, slot);
        gpu->free(gpu, dst);
        gpu->host_free(gpu, staged);
    }
    free(table);
    free(back);
}

/* One update call over the three parameters p[e] (with g, m and v) on the CPU (side 0) or the GPU (side 1): a trial
 * into `trial`, or an update raising `bound`. */
static void three_updates(int side, bool sgd, struct pair *p, struct pair *g, struct pair *m, struct pair *v,
                          const struct step_scalars *scd, int64_t *trial, struct state_bound *bound)
{
    struct backend *be = side ? gpu : cpu;
    struct optim_update_args a[3];
    for (int e = 0; e < 3; e++)
        a[e] = (struct optim_update_args){.master = side ? &p[e].g : &p[e].c, .grad = side ? &g[e].g : &g[e].c,
                                          .m = side ? &m[e].g : &m[e].c, .v = sgd ? NULL : side ? &v[e].g : &v[e].c,
                                          .sc = scd, .trial = trial, .bound = bound, .beta1 = 0.9, .beta2 = 0.999,
                                          .eps = 1e-8f, .momentum = 0.9f};
    if (sgd)
        be->sgd_update(be, a, 3);
    else
        be->adamw_update(be, a, 3);
}

/* The trial of an update (optim_update_args.trial) and the state's bound on both backends: the same parameter
 * reported (a weight that lr 1e37 takes past fp32's top, in the second of three tensors; the first entry where
 * every weight overflows), nothing stored by a trial, no trial without sc->check, and the bound an update raises
 * equal to the CPU's bit for bit (both take the values before rounding to the stored dtype). */
Test(cuda_backend, update_trial_and_bound_match_the_cpu, .init = open_both, .fini = close_both)
{
    rng_state = 41;
    int64_t n = 4099;
    for (int sgd = 0; sgd < 2; sgd++)
        for (int bf16 = 0; bf16 < 2; bf16++) {
            struct pair p[3], g[3], m[3], v[3];
            for (int e = 0; e < 3; e++) {
                pair_rand(&p[e], bf16 ? DT_BF16 : DT_FP32, 1, &n, -1, 1);
                pair_rand(&g[e], DT_FP32, 1, &n, -1, 1);
                pair_rand(&m[e], DT_FP32, 1, &n, -0.1f, 0.1f);
                pair_rand(&v[e], DT_FP32, 1, &n, 0, 0.1f);
            }
            float big = 3.3e38f, neg = -1.0f; /* weight 3.3e38 pushed up by lr 1e37 */
            for (int side = 0; side < 2; side++) {
                struct backend *be = side ? gpu : cpu;
                struct tensor *pt = side ? &p[1].g : &p[1].c, *gt = side ? &g[1].g : &g[1].c;
                uint16_t hb = bf16_from_fp32(big);
                be->upload(be, (char *)pt->data + 77 * dtype_size(pt->dtype), bf16 ? (void *)&hb : (void *)&big,
                           dtype_size(pt->dtype));
                be->upload(be, (float *)gt->data + 77, &neg, sizeof neg);
            }
            struct step_params sp = {.beta1 = 0.9, .beta2 = 0.999};
            for (int lr_case = 0; lr_case < 3; lr_case++) {
                const float lrs[3] = {1e-3f, 1e37f, 1e38f};
                struct step_scalars sc;
                step_rule_scalars(&sc, &sp, lrs[lr_case], 3, 1.0f);
                sc.check = 1;
                int64_t got[2];
                for (int side = 0; side < 2; side++) {
                    struct backend *be = side ? gpu : cpu;
                    struct step_scalars *scd = be_put(be, &sc, sizeof sc);
                    int64_t zero = 0, *trial = be_put(be, &zero, sizeof zero);
                    three_updates(side, sgd, p, g, m, v, scd, trial, NULL);
                    be->download(be, &got[side], trial, sizeof got[side]);
                    be->free(be, scd);
                    be->free(be, trial);
                }
                check_gpu();
                /* lr 1e-3: clean; 1e37: at least the weight at 3.3e38 overflows; AdamW at 1e38: -lr / (1 - 0.9^3) is
                 * -Inf, every weight, so the first entry is reported */
                bool ok = lr_case == 0 ? got[0] == 0 : lr_case == 1 || sgd ? got[0] >= 1 && got[0] <= 2 : got[0] == 1;
                cr_assert(ok, "%s bf16 %d lr %g: CPU trial %lld", sgd ? "sgd" : "adamw", bf16, lrs[lr_case],
                          (long long)got[0]);
                cr_assert_eq(got[1], got[0], "%s bf16 %d lr %g: GPU trial %lld, CPU %lld", sgd ? "sgd" : "adamw", bf16,
                             lrs[lr_case], (long long)got[1], (long long)got[0]);
            }
            for (int e = 0; e < 3; e++) { /* the trials stored nothing */
                pair_expect_bits(&p[e], "master after trials");
                pair_expect_bits(&m[e], "m after trials");
            }
            /* an update with a bound: the same maxima on both */
            struct step_scalars sc;
            step_rule_scalars(&sc, &sp, 1e-3f, 3, 1.0f);
            struct state_bound b[2];
            for (int side = 0; side < 2; side++) {
                struct backend *be = side ? gpu : cpu;
                struct step_scalars *scd = be_put(be, &sc, sizeof sc);
                struct state_bound zero = {0}, *bound = be_put(be, &zero, sizeof zero);
                three_updates(side, sgd, p, g, m, v, scd, NULL, bound);
                be->download(be, &b[side], bound, sizeof b[side]);
                be->free(be, scd);
                be->free(be, bound);
            }
            check_gpu();
            cr_assert(b[0].pmax > 3e38f && b[0].mmax > 0 && (sgd || b[0].vmax > 0), "CPU bound %g %g %g", b[0].pmax,
                      b[0].mmax, b[0].vmax);
            cr_assert_eq(memcmp(&b[0], &b[1], sizeof b[0]), 0, "%s bf16 %d: GPU bound %g %g %g, CPU %g %g %g",
                         sgd ? "sgd" : "adamw", bf16, b[1].pmax, b[1].mmax, b[1].vmax, b[0].pmax, b[0].mmax,
                         b[0].vmax);
            for (int e = 0; e < 3; e++) {
                pair_free(&p[e]);
                pair_free(&g[e]);
                pair_free(&m[e]);
                pair_free(&v[e]);
            }
        }
}

/* Rows r0 .. r0+n-1 of a (rows, w) tensor, as a tensor (n, w). */
static struct tensor rows_view(const struct tensor *t, int64_t r0, int64_t n, int64_t w)
{
    struct tensor v = *t;
    v.data = (char *)t->data + (size_t)(r0 * w) * dtype_size(t->dtype);
    return tensor_reshape(&v, 2, (int64_t[]){n, w});
}

/* attention_decode (generation's key/value cache): a prefill of 5 positions, then one position per call up to T, on
 * both backends; the outputs and the whole cache (every position written by then) agree. */
Test(cuda_backend, attention_decode, .init = open_both, .fini = close_both)
{
    rng_state = 12;
    int64_t T = 33, C = 48, H = 3, D = C / H;
    for (int d = 0; d < 3; d++) {
        enum dtype dt = all_dtypes[d];
        struct pair qkv, out, cache;
        pair_rand(&qkv, dt, 2, (int64_t[]){T, 3 * C}, -1, 1);
        pair_out(&out, dt, 2, (int64_t[]){T, C});
        pair_out(&cache, dt, 4, (int64_t[]){2, H, T, D});
        for (int64_t pos = 0, n = 5; pos < T; pos += n, n = 1) {
            struct tensor qc = rows_view(&qkv.c, pos, n, 3 * C), qg = rows_view(&qkv.g, pos, n, 3 * C);
            struct tensor oc = rows_view(&out.c, pos, n, C), og = rows_view(&out.g, pos, n, C);
            cpu->attention_decode(cpu, &oc, &cache.c, &qc, pos, n, C, H);
            gpu->attention_decode(gpu, &og, &cache.g, &qg, pos, n, C, H);
        }
        pair_expect(&cache, 0.0, "attention_decode cache (copies)");
        pair_expect(&out, tol_of(dt), "attention_decode out");
        struct pair *all[] = {&qkv, &out, &cache};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
            pair_free(all[i]);
    }
}

/* ---- recipe blockwise ------------------------------------------------------------------------------------ */

/* One operand of a block-scaled product on both backends: fp32 values (rows, cols) whose 16-row bands span
 * 2^-12 to 2^14, cast with `tiling` by each backend; the codes and the scales must have the same bits. */
struct block_pair {
    struct pair x, q;      /* the fp32 source and its E4M3 codes */
    float *sc, *sg;        /* scale_inv: host (the CPU's) and GPU */
    int64_t nscales;
};

static void block_pair_cast_from(struct block_pair *bp, const float *h, int64_t rows, int64_t cols,
                                 enum fp8_tiling tiling, int64_t *counts)
{
    pair_alloc(&bp->x, DT_FP32, 2, (int64_t[]){rows, cols});
    tensor_from_host_f32(&bp->x.c, h);
    gpu->upload(gpu, bp->x.g.data, bp->x.c.data, tensor_bytes(&bp->x.c));
    pair_out(&bp->q, DT_FP8_E4M3, 2, (int64_t[]){rows, cols});
    bp->nscales = fp8_tiling_scales(tiling, rows, cols);
    bp->sc = malloc((size_t)bp->nscales * sizeof(float));
    cr_assert_not_null(bp->sc);
    bp->sg = be_poisoned(gpu, (size_t)bp->nscales * sizeof(float));
    int64_t *gcounts = counts ? be_put(gpu, (int64_t[4]){0, 0, 0, 0}, 4 * sizeof(int64_t)) : NULL;
    cpu->fp8_block_cast(cpu, &(struct fp8_block_cast_args){ .dst = &bp->q.c, .src = &bp->x.c, .rows = rows,
                                                            .cols = cols, .tiling = tiling, .scale_inv = bp->sc,
                                                            .counts = counts });
    gpu->fp8_block_cast(gpu, &(struct fp8_block_cast_args){ .dst = &bp->q.g, .src = &bp->x.g, .rows = rows,
                                                            .cols = cols, .tiling = tiling, .scale_inv = bp->sg,
                                                            .counts = gcounts });
    char what[96];
    snprintf(what, sizeof what, "fp8_block_cast tiling %d (%lld, %lld) codes", (int)tiling, (long long)rows,
             (long long)cols);
    pair_expect_bits(&bp->q, what);
    float *got = malloc((size_t)bp->nscales * sizeof(float));
    cr_assert_not_null(got);
    gpu->download(gpu, got, bp->sg, (size_t)bp->nscales * sizeof(float));
    cr_assert_eq(memcmp(got, bp->sc, (size_t)bp->nscales * sizeof(float)), 0, "%s: the scales differ", what);
    free(got);
    if (counts) {
        int64_t gc[4];
        gpu->download(gpu, gc, gcounts, sizeof gc);
        for (int i = 0; i < 4; i++)
            cr_assert_eq(gc[i], counts[i], "%s: count %d: GPU %lld, CPU %lld", what, i, (long long)gc[i],
                         (long long)counts[i]);
        gpu->free(gpu, gcounts);
    }
}

static void block_pair_cast(struct block_pair *bp, int64_t rows, int64_t cols, enum fp8_tiling tiling, int64_t *counts)
{
    float *h = malloc((size_t)(rows * cols) * sizeof *h);
    cr_assert_not_null(h);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            h[r * cols + c] = uniform(-1, 1) * ldexpf(1.0f, (int)((r / 16 + c / 64) % 27) - 12);
    h[3] = NAN;
    block_pair_cast_from(bp, h, rows, cols, tiling, counts);
    free(h);
}

static void block_pair_free(struct block_pair *bp)
{
    pair_free(&bp->x);
    pair_free(&bp->q);
    free(bp->sc);
    gpu->free(gpu, bp->sg);
}

/* The tile-scaled cast in each tiling, with its counts: the CPU's codes, scales and counts, bit for bit. */
Test(cuda_backend, fp8_block_cast_matches_the_cpu_bit_for_bit, .init = open_both, .fini = close_both)
{
    rng_state = 21;
    const enum fp8_tiling tilings[3] = {FP8_TILES_ROWS, FP8_TILES_COLS, FP8_BLOCKS};
    for (int t = 0; t < 3; t++) {
        struct block_pair bp;
        int64_t counts[4] = {0, 0, 0, 0};
        block_pair_cast(&bp, 200, 300, tilings[t], counts);
        cr_assert_eq(counts[3], 200 * 300);
        block_pair_free(&bp);
    }
}

/* A linear layer's three block-scaled products (y = x W^T, dx = dy W, dW = dy^T x accumulating) with K 300 (a
 * partial last block): the GPU runs the CPU's arithmetic, so fp32 and bf16 results have the CPU's bits; GELU's
 * epilogue (tanhf against the CPU's tanh) is held to the bf16 tolerance. */
static void block_gemm_case_shape(bool ta, bool tb, enum fp8_tiling at, enum fp8_tiling bt, enum dtype dc, bool bias,
                                  float beta, bool gelu, int64_t m, int64_t n, int64_t k)
{
    struct block_pair a, b;
    block_pair_cast(&a, ta ? k : m, ta ? m : k, at, NULL);
    block_pair_cast(&b, tb ? n : k, tb ? k : n, bt, NULL);
    struct pair c, bi, aux;
    gemm_outputs(&c, &bi, &aux, dc, m, n, bias, beta, gelu);
    struct gemm_args g = {.trans_a = ta, .trans_b = tb, .m = m, .n = n, .k = k, .alpha = 1.0f, .beta = beta,
                          .batch = 1, .epilogue = gelu ? GEMM_EPI_GELU_TANH : GEMM_EPI_NONE};
    g.a = &a.q.c, g.b = &b.q.c, g.c = &c.c, g.bias = bias ? &bi.c : NULL, g.aux = gelu ? &aux.c : NULL;
    g.a_blocks = (struct fp8_blocks){a.sc, at}, g.b_blocks = (struct fp8_blocks){b.sc, bt};
    cpu->gemm(cpu, &g);
    g.a = &a.q.g, g.b = &b.q.g, g.c = &c.g, g.bias = bias ? &bi.g : NULL, g.aux = gelu ? &aux.g : NULL;
    g.a_blocks = (struct fp8_blocks){a.sg, at}, g.b_blocks = (struct fp8_blocks){b.sg, bt};
    gpu->gemm(gpu, &g);
    char what[160];
    snprintf(what, sizeof what, "block-scaled gemm -> %s ta=%d tb=%d bias=%d beta=%g gelu=%d", dtype_name(dc), ta, tb,
             bias, beta, gelu);
    if (gelu) {
        pair_expect(&c, 1e-2, what);
        pair_expect_bits(&aux, what); /* the pre-activation: no tanh in it */
    } else {
        pair_expect_bits(&c, what);
    }
    block_pair_free(&a);
    block_pair_free(&b);
    pair_free(&c);
    if (bias)
        pair_free(&bi);
    if (gelu)
        pair_free(&aux);
}

static void block_gemm_case(bool ta, bool tb, enum fp8_tiling at, enum fp8_tiling bt, enum dtype dc, bool bias,
                            float beta, bool gelu)
{
    block_gemm_case_shape(ta, tb, at, bt, dc, bias, beta, gelu, 70, 140, 300); /* m, n not multiples of 16: the plain
                                                                              * kernels on every GPU */
}

Test(cuda_backend, fp8_block_gemm_matches_the_cpu_bit_for_bit, .init = open_both, .fini = close_both)
{
    rng_state = 22;
    block_gemm_case(false, true, FP8_TILES_ROWS, FP8_BLOCKS, DT_BF16, true, 0.0f, false);  /* y = x W^T + b */
    block_gemm_case(false, true, FP8_TILES_ROWS, FP8_BLOCKS, DT_BF16, true, 0.0f, true);   /* ... with GELU */
    block_gemm_case(false, true, FP8_TILES_ROWS, FP8_BLOCKS, DT_FP32, false, 0.0f, false);
    block_gemm_case(false, false, FP8_TILES_ROWS, FP8_BLOCKS, DT_BF16, false, 0.0f, false); /* dx = dy W */
    block_gemm_case(true, false, FP8_TILES_COLS, FP8_TILES_COLS, DT_FP32, false, 0.0f, false); /* dW = dy^T x */
    block_gemm_case(true, false, FP8_TILES_COLS, FP8_TILES_COLS, DT_FP32, false, 1.0f, false); /* accumulating */
}

/* ---- fp8: the cast-transpose and products that write their bf16 C themselves ------------------------------ */

/* The cast-transpose (backend.h fp8_cast_args.dst_t; kernels/cuda/fp8.cu, cast_transpose_kernel) against the CPU's, bit
 * for bit: the codes, the transposed codes, the amax, the scale and the counts, on shapes whose sides are not
 * multiples of the 32 x 32 tile, a single row and column, and more row tiles than a grid's 65535 (the stride). */
Test(cuda_backend, fp8_cast_transpose_matches_the_cpu_bit_for_bit, .init = open_both, .fini = close_both)
{
    const int64_t shapes[5][2] = {{100, 77}, {33, 1000}, {1, 50}, {50, 1}, {65535 * 32 + 40, 3}};
    const enum dtype dsts[2] = {DT_FP8_E4M3, DT_FP8_E5M2}, srcs[2] = {DT_BF16, DT_FP32};
    for (int sh = 0; sh < 5; sh++)
        for (int d = 0; d < 2; d++)
            for (int current = 0; current < 2; current++) {
                const int64_t rows = shapes[sh][0], cols = shapes[sh][1], n = rows * cols;
                const enum dtype sdt = srcs[(sh + d) % 2];
                struct pair src, dst, dst_t;
                pair_rand(&src, sdt, 1, &n, -900.0f, 900.0f); /* saturates E4M3 at scale 1 */
                pair_out(&dst, dsts[d], 1, &n);
                pair_out(&dst_t, dsts[d], 1, &n);
                float init[3] = {current ? 1.0f : 0.37f, 1.0f, 2.0f}; /* scale, scale_inv, amax */
                float cs[3];
                memcpy(cs, init, sizeof cs);
                float *gs = be_put(gpu, init, sizeof init);
                int64_t cc[4] = {0}, gc[4] = {-1};
                int64_t *gcd = be_put(gpu, cc, sizeof cc);
                struct fp8_cast_args a = {.dst = &dst.c, .src = &src.c, .scale = &cs[0], .scale_inv = &cs[1],
                                          .amax = &cs[2], .current = current, .margin = 1, .counts = cc,
                                          .dst_t = &dst_t.c, .rows = rows, .cols = cols};
                cpu->fp8_cast(cpu, &a);
                a.dst = &dst.g, a.src = &src.g, a.scale = &gs[0], a.scale_inv = &gs[1], a.amax = &gs[2], a.counts = gcd;
                a.dst_t = &dst_t.g;
                gpu->fp8_cast(gpu, &a);
                gpu->download(gpu, gc, gcd, sizeof gc);
                gpu->free(gpu, gcd);
                char what[128];
                snprintf(what, sizeof what, "fp8 cast-transpose (%lld, %lld) %s <- %s current %d", (long long)rows,
                         (long long)cols, dtype_name(dsts[d]), dtype_name(sdt), current);
                for (int i = 0; i < 4; i++)
                    cr_assert_eq(gc[i], cc[i], "%s: counter %d: GPU %lld, CPU %lld", what, i, (long long)gc[i],
                                 (long long)cc[i]);
                pair_expect_bits(&dst, what);
                pair_expect_bits(&dst_t, what);
                for (int i = 0; i < 3; i++)
                    cr_assert_eq(gpu_float(&gs[i]), cs[i], "%s: state %d: GPU %.9g, CPU %.9g", what, i,
                                 (double)gpu_float(&gs[i]), (double)cs[i]);
                gpu->free(gpu, gs);
                pair_free(&src);
                pair_free(&dst);
                pair_free(&dst_t);
            }
}

/* A bf16 C's tolerance against the CPU where cuBLASLt's fp8 product writes it (kernels/cuda/fp8.cu,
 * fp8_product_into_c): before its one rounding each element is the CPU's fp32 value up to Hopper's fp8 accumulator
 * (1.12e-4 relative measured, fp8_gemm_runs_native_on_fp8_tensor_cores; 1e-3 allowed) and, with GELU, a tanh that
 * may be a fast one (~1e-4); the two values then round to bf16 apart, so an element may land one bf16 ulp away,
 * 2^-7 of it relative at most. Relative L2 within 2^-7 + 1e-3. */
static double fp8_bf16_tolerance(void)
{
    return ldexp(1.0, -7) + 1e-3;
}

/* The linear layer's fp8 products as the model now calls them: the forward into a fresh bf16 C with the bias
 * (and GELU), which cuBLASLt writes itself; dx with W's transposed codes (b_t); dW with dy's and x's (a_t, b_t),
 * accumulating into fp32 through the scratch. The transposed operands are made by the CPU's cast-transpose and
 * uploaded, so a wrong choice between a and a_t shows. Shapes in multiples of 16 (native on sm_89 and later)
 * and odd ones (the emulation, which reads a and b). */
static void fp8_transposed_gemm_case(enum dtype da, enum dtype db, enum dtype dc, bool ta, bool tb, int64_t m,
                                     int64_t n, int64_t k, bool bias, float beta, bool gelu)
{
    struct pair a, b, at, bt, c, bi, aux;
    const int64_t ar = ta ? k : m, ac = ta ? m : k, br = tb ? n : k, bc = tb ? k : n;
    pair_rand(&a, da, 1, (int64_t[]){m * k}, -400.0f, 400.0f);
    pair_rand(&b, db, 1, (int64_t[]){k * n}, -400.0f, 400.0f);
    pair_out(&at, da, 1, (int64_t[]){m * k});
    pair_out(&bt, db, 1, (int64_t[]){k * n});
    uint8_t *ha = malloc((size_t)(m * k)), *hb = malloc((size_t)(k * n));
    cr_assert(ha && hb);
    const uint8_t *ca = a.c.data, *cb8 = b.c.data;
    for (int64_t r = 0; r < ar; r++)
        for (int64_t j = 0; j < ac; j++)
            ha[j * ar + r] = ca[r * ac + j];
    for (int64_t r = 0; r < br; r++)
        for (int64_t j = 0; j < bc; j++)
            hb[j * br + r] = cb8[r * bc + j];
    memcpy(at.c.data, ha, (size_t)(m * k));
    memcpy(bt.c.data, hb, (size_t)(k * n));
    gpu->upload(gpu, at.g.data, ha, (size_t)(m * k));
    gpu->upload(gpu, bt.g.data, hb, (size_t)(k * n));
    free(ha);
    free(hb);
    gemm_outputs(&c, &bi, &aux, dc, m, n, bias, beta, gelu);
    float sc[2] = {1.0f / 300.0f, 0.0021f};
    float *gs = be_put(gpu, sc, sizeof sc);
    a.c.scale_inv = at.c.scale_inv = &sc[0], b.c.scale_inv = bt.c.scale_inv = &sc[1];
    a.g.scale_inv = at.g.scale_inv = &gs[0], b.g.scale_inv = bt.g.scale_inv = &gs[1];
    struct gemm_args g = {.trans_a = ta, .trans_b = tb, .m = m, .n = n, .k = k, .alpha = 1.0f, .beta = beta,
                          .batch = 1, .epilogue = gelu ? GEMM_EPI_GELU_TANH : GEMM_EPI_NONE};
    g.a = &a.c, g.b = &b.c, g.c = &c.c, g.bias = bias ? &bi.c : NULL, g.aux = gelu ? &aux.c : NULL;
    g.a_t = ta ? &at.c : NULL, g.b_t = tb ? NULL : &bt.c;
    cpu->gemm(cpu, &g);
    g.a = &a.g, g.b = &b.g, g.c = &c.g, g.bias = bias ? &bi.g : NULL, g.aux = gelu ? &aux.g : NULL;
    g.a_t = ta ? &at.g : NULL, g.b_t = tb ? NULL : &bt.g;
    gpu->gemm(gpu, &g);
    char what[160];
    snprintf(what, sizeof what, "fp8 gemm %s x %s -> %s ta=%d tb=%d (%lld, %lld, %lld) bias=%d beta=%g gelu=%d "
             "(transposed codes given)", dtype_name(da), dtype_name(db), dtype_name(dc), ta, tb, (long long)m,
             (long long)n, (long long)k, bias, beta, gelu);
    const bool native_shape = m % 16 == 0 && n % 16 == 0 && k % 16 == 0;
    pair_expect(&c, dc == DT_FP32 ? (native_shape ? 1e-3 : 1e-5) : fp8_bf16_tolerance(), what);
    if (gelu)
        pair_expect(&aux, fp8_bf16_tolerance(), what);
    gpu->free(gpu, gs);
    pair_free(&a);
    pair_free(&b);
    pair_free(&at);
    pair_free(&bt);
    pair_free(&c);
    if (bias)
        pair_free(&bi);
    if (gelu)
        pair_free(&aux);
}

Test(cuda_backend, fp8_gemm_with_transposed_codes_and_cublaslt_epilogue, .init = open_both, .fini = close_both)
{
    const int64_t shapes[2][3] = {{64, 96, 128}, {37, 50, 72}};
    for (int s = 0; s < 2; s++) {
        int64_t m = shapes[s][0], n = shapes[s][1], k = shapes[s][2];
        fp8_transposed_gemm_case(DT_FP8_E4M3, DT_FP8_E4M3, DT_BF16, false, true, m, n, k, true, 0.0f, false);
        fp8_transposed_gemm_case(DT_FP8_E4M3, DT_FP8_E4M3, DT_BF16, false, true, m, n, k, false, 0.0f, false);
        fp8_transposed_gemm_case(DT_FP8_E4M3, DT_FP8_E4M3, DT_BF16, false, true, m, n, k, true, 0.0f, true);
        fp8_transposed_gemm_case(DT_FP8_E5M2, DT_FP8_E4M3, DT_BF16, false, false, m, n, k, false, 0.0f, false);
        fp8_transposed_gemm_case(DT_FP8_E5M2, DT_FP8_E4M3, DT_FP32, true, false, m, n, k, false, 1.0f, false);
        fp8_transposed_gemm_case(DT_FP8_E5M2, DT_FP8_E4M3, DT_FP32, true, false, m, n, k, false, 0.0f, false);
    }
}

/* The first scale_log.csv rows' losses of a run (the third column), up to `steps`. */
static void run_losses(const char *dir, double *losses, int steps)
{
    char path[640];
    snprintf(path, sizeof path, "%s/scale_log.csv", dir);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    char line[1024];
    cr_assert_not_null(fgets(line, sizeof line, f)); /* header */
    for (int s = 0; s < steps; s++) {
        cr_assert_not_null(fgets(line, sizeof line, f), "%s: step %d", path, s + 1);
        char *c = strchr(line, ',');
        c = c ? strchr(c + 1, ',') : NULL;
        cr_assert_not_null(c, "%s", line);
        losses[s] = strtod(c + 1, NULL);
    }
    fclose(f);
}

/* text_gpt with every product in fp8 (keep_bf16 [], min_size [0, 0]), both per-tensor recipes, with cuBLASLt
 * writing the bf16 products (the default) and with every product through the fp32 scratch and the epilogue kernel
 * (AMPTRAIN_FP8_CUBLASLT_EPILOGUE=0): both train, and the losses of the first 3 steps agree within 1% (the two
 * round each bf16 output apart, fp8_bf16_tolerance; not the same bits). */
Test(cuda_backend, fp8_gpt_trains_the_same_with_and_without_cublaslt_epilogue, .timeout = 600)
{
    if (backend_cuda_device_count() <= 0)
        cr_skip_test("no CUDA device: the fp8 epilogue end to end was not run");
    make_scratch();
    const char *recipes[2] = {"delayed", "current"}, *env[2] = {"1", "0"};
    for (int r = 0; r < 2; r++) {
        double losses[2][3];
        for (int i = 0; i < 2; i++) {
            setenv("AMPTRAIN_FP8_CUBLASLT_EPILOGUE", env[i], 1);
            struct result res = amp("run configs/text_gpt.yaml run.device=cuda run.steps=3 run.log_every=1 "
                                    "precision.mode=fp8 precision.fp8.recipe=%s 'precision.fp8.keep_bf16=[]' "
                                    "'precision.fp8.min_size=[0,0]' run.out_dir=%s/%s%s",
                                    recipes[r], scratch, recipes[r], env[i]);
            unsetenv("AMPTRAIN_FP8_CUBLASLT_EPILOGUE");
            cr_assert_eq(res.code, 0, "recipe %s, AMPTRAIN_FP8_CUBLASLT_EPILOGUE=%s:\n%s", recipes[r], env[i], res.out);
            printf("fp8 text_gpt, recipe %s, AMPTRAIN_FP8_CUBLASLT_EPILOGUE=%s:\n%s\n", recipes[r], env[i], res.out);
            char dir[512];
            snprintf(dir, sizeof dir, "%s/%s%s", scratch, recipes[r], env[i]);
            run_losses(dir, losses[i], 3);
        }
        for (int s = 0; s < 3; s++)
            cr_assert(isfinite(losses[0][s]) && fabs(losses[0][s] - losses[1][s]) <= 1e-2 * fabs(losses[1][s]),
                      "recipe %s, step %d: loss %.6g with cuBLASLt's epilogue, %.6g through the scratch", recipes[r],
                      s + 1, losses[0][s], losses[1][s]);
    }
    fflush(stdout);
    remove_scratch();
}

/* ---- recipe blockwise through cuBLASLt's block-scaled matmul (kernels/cuda/fp8.cu, block_product_lt) ----------- */

/* Values whose magnitude is 2^e, e in [-3, 3] drawn per tile of `tiling` (fp8_tiling_index): neighbouring tiles get
 * different scales, so a scale read from the wrong tile shows, and none is too small to count. */
static float *tiled_values(int64_t rows, int64_t cols, enum fp8_tiling tiling)
{
    float *h = malloc((size_t)(rows * cols) * sizeof *h);
    cr_assert_not_null(h);
    const int64_t tiles = fp8_tiling_scales(tiling, rows, cols);
    int *e = malloc((size_t)tiles * sizeof *e);
    cr_assert_not_null(e);
    for (int64_t t = 0; t < tiles; t++)
        e[t] = (int)(next_u64() % 7) - 3;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            h[r * cols + c] = uniform(-1, 1) * ldexpf(1.0f, e[fp8_tiling_index(tiling, cols, r, c)]);
    free(e);
    return h;
}

/* The value of op(X)'s element (outer, kk) from the CPU's codes and scales: X (outer_n, k), or stored (k, outer_n)
 * when k_rows. */
static double block_value(const struct block_pair *x, enum fp8_tiling t, bool k_rows, int64_t outer_n, int64_t k,
                          int64_t outer, int64_t kk)
{
    const int64_t cols = k_rows ? outer_n : k, r = k_rows ? kk : outer, c = k_rows ? outer : kk;
    const uint8_t *q = x->q.c.data;
    return (double)fp8_to_fp32(q[r * cols + c], FP8_E4M3) * (double)x->sc[fp8_tiling_index(t, cols, r, c)];
}

/* The bound on a block-scaled product's element against the CPU's (backend.h: each 128-wide block's exact sum
 * rounded once to fp32, times the power-of-two scales, accumulated in fp32), as a multiple of S = sum over k of
 * |a_ik b_kj|. The CPU: (blocks + 3) u S, u = 2^-24 (docs/precision.md). cuBLASLt on Hopper: each block's 128
 * products summed on the tensor cores in their narrower accumulator, then scaled and moved into fp32 (the
 * block-scaled matmul promotes at every scale block, as DeepSeek-V3's recipe does): about 22 bits kept (a
 * simulation, kernels/cuda/fp8.cu, which the per-tensor products' error measured on the H200 agrees with), so within
 * 128 additions of truncation at 2^-21 of the running sum, 2^-14 S at worst, plus its fp32 sum over the blocks,
 * (blocks + 1) u S. 2^-14 + (2 blocks + 4) u, doubled for the accumulator's width being an estimate: about 1.2e-4 S.
 * A scale read from the wrong tile (neighbouring tiles' scales differ by factors of 2 to 64) moves an element by at
 * least half its tile's partial sum, typically a few per cent of S. */
static double block_lt_bound(int64_t k)
{
    const double u = ldexp(1.0, -24), blocks = (double)((k + 127) / 128);
    return 2.0 * (ldexp(1.0, -14) + (2.0 * blocks + 4.0) * u);
}

/* One product op(A) op(B) of the linear layer's layouts on both backends, C fp32 (beta 0 or 1, no bias): every
 * element of the GPU's C within block_lt_bound(k) S of the CPU's (plus an fp32 ulp of C for beta's add); with
 * `bf16` also the forward's bf16 C with bias and GELU, within the bf16 tolerance. Returns the largest |GPU - CPU| / S. */
static double block_lt_case(bool ta, bool tb, enum fp8_tiling at, enum fp8_tiling bt, int64_t m, int64_t n, int64_t k,
                            float beta, bool bf16)
{
    const int64_t ar = ta ? k : m, ac = ta ? m : k, br = tb ? n : k, bc = tb ? k : n;
    struct block_pair a, b;
    float *ha = tiled_values(ar, ac, at), *hb = tiled_values(br, bc, bt);
    block_pair_cast_from(&a, ha, ar, ac, at, NULL);
    block_pair_cast_from(&b, hb, br, bc, bt, NULL);
    free(ha);
    free(hb);
    struct pair c, bi, aux;
    gemm_outputs(&c, &bi, &aux, DT_FP32, m, n, false, beta, false);
    struct gemm_args g = {.trans_a = ta, .trans_b = tb, .m = m, .n = n, .k = k, .alpha = 1.0f, .beta = beta, .batch = 1};
    g.a = &a.q.c, g.b = &b.q.c, g.c = &c.c;
    g.a_blocks = (struct fp8_blocks){a.sc, at}, g.b_blocks = (struct fp8_blocks){b.sc, bt};
    cpu->gemm(cpu, &g);
    g.a = &a.q.g, g.b = &b.q.g, g.c = &c.g;
    g.a_blocks = (struct fp8_blocks){a.sg, at}, g.b_blocks = (struct fp8_blocks){b.sg, bt};
    gpu->gemm(gpu, &g);
    check_gpu();
    float *got = malloc((size_t)(m * n) * sizeof *got);
    cr_assert_not_null(got);
    gpu->download(gpu, got, c.g.data, (size_t)(m * n) * sizeof *got);
    const float *want = c.c.data;
    const double bound = block_lt_bound(k);
    double *va = malloc((size_t)(m * k) * sizeof *va), *vb = malloc((size_t)(n * k) * sizeof *vb); /* |op(X)|, K last */
    cr_assert(va && vb);
    for (int64_t kk = 0; kk < k; kk++) {
        for (int64_t i = 0; i < m; i++)
            va[i * k + kk] = fabs(block_value(&a, at, ta, m, k, i, kk));
        for (int64_t j = 0; j < n; j++)
            vb[j * k + kk] = fabs(block_value(&b, bt, !tb, n, k, j, kk));
    }
    double worst = 0.0;
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            double sum_abs = 0.0;
            for (int64_t kk = 0; kk < k; kk++)
                sum_abs += va[i * k + kk] * vb[j * k + kk];
            const double w = want[i * n + j], d = fabs((double)got[i * n + j] - w);
            const double allowed = bound * sum_abs + ldexp(fabs(w), -23);
            cr_assert(d <= allowed, "block-scaled gemm ta=%d tb=%d (%lld, %lld, %lld) beta=%g: C[%lld, %lld] GPU %.9g, "
                      "CPU %.9g: |difference| %.3g > %.3g (%.3g of sum |a b| %.6g)", ta, tb, (long long)m, (long long)n,
                      (long long)k, beta, (long long)i, (long long)j, got[i * n + j], w, d, allowed, bound, sum_abs);
            if (sum_abs > 0.0 && d / sum_abs > worst)
                worst = d / sum_abs;
        }
    free(got);
    free(va);
    free(vb);
    pair_free(&c);
    if (bf16) { /* the forward as the model calls it: bf16 C, fp32 bias, GELU (fp8.cu's epilogue kernel after P) */
        gemm_outputs(&c, &bi, &aux, DT_BF16, m, n, true, 0.0f, true);
        g.beta = 0.0f, g.epilogue = GEMM_EPI_GELU_TANH;
        g.a = &a.q.c, g.b = &b.q.c, g.c = &c.c, g.bias = &bi.c, g.aux = &aux.c;
        g.a_blocks = (struct fp8_blocks){a.sc, at}, g.b_blocks = (struct fp8_blocks){b.sc, bt};
        cpu->gemm(cpu, &g);
        g.a = &a.q.g, g.b = &b.q.g, g.c = &c.g, g.bias = &bi.g, g.aux = &aux.g;
        g.a_blocks = (struct fp8_blocks){a.sg, at}, g.b_blocks = (struct fp8_blocks){b.sg, bt};
        gpu->gemm(gpu, &g);
        char what[128];
        snprintf(what, sizeof what, "block-scaled gemm -> bf16, bias, GELU (%lld, %lld, %lld)", (long long)m,
                 (long long)n, (long long)k);
        pair_expect(&c, fp8_bf16_tolerance(), what);
        pair_expect(&aux, fp8_bf16_tolerance(), what);
        pair_free(&c);
        pair_free(&bi);
        pair_free(&aux);
    }
    block_pair_free(&a);
    block_pair_free(&b);
    return worst;
}

/* Runs f with stderr in a buffer (text, NUL-terminated), then puts what it said back on stderr. */
static void with_stderr_captured(void (*f)(void), char *text, size_t size)
{
    FILE *log = tmpfile();
    cr_assert_not_null(log);
    fflush(stderr);
    int saved = dup(STDERR_FILENO);
    cr_assert(saved >= 0 && dup2(fileno(log), STDERR_FILENO) >= 0);
    f();
    fflush(stderr);
    dup2(saved, STDERR_FILENO);
    close(saved);
    rewind(log);
    size_t got = fread(text, 1, size - 1, log);
    text[got] = '\0';
    fclose(log);
    fwrite(text, 1, got, stderr);
}

static void block_lt_cases(void)
{
    /* m, n, k: multiples of 128; m and n not (k's 3 blocks: the 128x128 scales' row padded to 4); 5 blocks */
    const int64_t shapes[3][3] = {{256, 384, 512}, {144, 272, 384}, {48, 80, 640}};
    for (int s = 0; s < 3; s++) {
        const int64_t m = shapes[s][0], n = shapes[s][1], k = shapes[s][2];
        double fwd = block_lt_case(false, true, FP8_TILES_ROWS, FP8_BLOCKS, m, n, k, 0.0f, true);  /* y = x W^T */
        double dx = block_lt_case(false, false, FP8_TILES_ROWS, FP8_BLOCKS, m, n, k, 0.0f, false); /* dx = dy W */
        double dw = block_lt_case(true, false, FP8_TILES_COLS, FP8_TILES_COLS, m, n, k, 1.0f, false); /* dW += */
        printf("block-scaled products (%lld, %lld, %lld): largest |GPU - CPU| / sum |a b|: forward %.3g, dx %.3g, dW "
               "%.3g (bound %.3g)\n", (long long)m, (long long)n, (long long)k, fwd, dx, dw, block_lt_bound(k));
    }
    fflush(stdout);
}

/* On Hopper (sm_90) the block-scaled products of shapes that fit (m, n multiples of 16, k of 128) run through
 * cuBLASLt's block-scaled matmul (1x128 tiles VEC128_32F, 128x128 blocks BLK128x128_32F), no longer the CPU's
 * arithmetic: every element within block_lt_bound of the CPU's, the three layouts of a linear layer, and the backend
 * says nothing of the plain kernels (its note goes to stderr, captured here). Elsewhere the products take the plain
 * kernels, which are within the bound too. */
Test(cuda_backend, fp8_block_gemm_through_cublaslt_is_within_its_bound, .init = open_both, .fini = close_both)
{
    rng_state = 23;
    char text[4096];
    with_stderr_captured(block_lt_cases, text, sizeof text);
    int cc = device_cc();
    if (cc == 90) /* cuBLAS lists the 128-element scaling modes for compute capability 9.0 alone: on a newer GPU its
                   * heuristic offers nothing and the plain kernels run, as they should */
        cr_assert(!strstr(text, "plain CUDA kernels"),
                  "compute capability %d.%d: a block-scaled product took the plain kernels: %s", cc / 10, cc % 10, text);
}

/* AMPTRAIN_FP8_BLOCK_CUBLASLT=0 sends every block-scaled product to the plain kernels: a shape cuBLASLt would take
 * gets the CPU's bits, and the backend says so once. */
static void block_plain_cases(void)
{
    block_gemm_case_shape(false, true, FP8_TILES_ROWS, FP8_BLOCKS, DT_BF16, true, 0.0f, false, 256, 384, 512);
    block_gemm_case_shape(true, false, FP8_TILES_COLS, FP8_TILES_COLS, DT_FP32, false, 1.0f, false, 256, 384, 512);
}

Test(cuda_backend, fp8_block_gemm_switched_off_is_the_cpus_bits)
{
    setenv("AMPTRAIN_FP8_BLOCK_CUBLASLT", "0", 1);
    open_both();
    unsetenv("AMPTRAIN_FP8_BLOCK_CUBLASLT");
    rng_state = 24;
    char text[4096];
    with_stderr_captured(block_plain_cases, text, sizeof text);
    cr_assert(strstr(text, "AMPTRAIN_FP8_BLOCK_CUBLASLT=0"), "the note naming the switch is missing: %s", text);
    close_both();
}

/* text_gpt in recipe blockwise with every product in fp8, through cuBLASLt's block-scaled products (the default)
 * and through the plain kernels (AMPTRAIN_FP8_BLOCK_CUBLASLT=0): both train, and the first 3 losses agree within
 * 1% (the two differ by the accumulator's rounding, block_lt_bound, and then by bf16 roundings that land apart). */
Test(cuda_backend, fp8_gpt_trains_the_same_in_blockwise_through_cublaslt_and_the_plain_kernels, .timeout = 600)
{
    if (backend_cuda_device_count() <= 0)
        cr_skip_test("no CUDA device: recipe blockwise end to end was not run");
    make_scratch();
    const char *env[2] = {"1", "0"};
    double losses[2][3];
    for (int i = 0; i < 2; i++) {
        setenv("AMPTRAIN_FP8_BLOCK_CUBLASLT", env[i], 1);
        struct result res = amp("run configs/text_gpt.yaml run.device=cuda run.steps=3 run.log_every=1 "
                                "precision.mode=fp8 precision.fp8.recipe=blockwise 'precision.fp8.keep_bf16=[]' "
                                "'precision.fp8.min_size=[0,0]' run.out_dir=%s/blockwise%s", scratch, env[i]);
        unsetenv("AMPTRAIN_FP8_BLOCK_CUBLASLT");
        cr_assert_eq(res.code, 0, "AMPTRAIN_FP8_BLOCK_CUBLASLT=%s:\n%s", env[i], res.out);
        printf("fp8 text_gpt, recipe blockwise, AMPTRAIN_FP8_BLOCK_CUBLASLT=%s:\n%s\n", env[i], res.out);
        char dir[512];
        snprintf(dir, sizeof dir, "%s/blockwise%s", scratch, env[i]);
        run_losses(dir, losses[i], 3);
    }
    for (int s = 0; s < 3; s++)
        cr_assert(isfinite(losses[0][s]) && fabs(losses[0][s] - losses[1][s]) <= 1e-2 * fabs(losses[1][s]),
                  "step %d: loss %.6g through cuBLASLt, %.6g through the plain kernels", s + 1, losses[0][s],
                  losses[1][s]);
    fflush(stdout);
    remove_scratch();
}

/* ---- CUDA graphs (kernels/cuda/graphs.cu, lib/engine/train.c graph_piece) ----------------------------------- */

/* The per-step values a recorded step reads from device memory: the delayed fp8 update's step (its row: step mod len)
 * and pending amaxes, as the CPU reads them, bit for bit (history, scales, pending zeroed), at two steps with the same
 * arguments; and window_store's slot. */
Test(cuda_backend, per_step_values_in_memory_match_the_cpu, .init = open_both, .fini = close_both)
{
    const int len = 5, n = 200;
    const int64_t steps[2] = {8, 9};
    int64_t *cstep = cpu->alloc(cpu, sizeof *cstep), *gstep = be_put(gpu, &steps[0], sizeof steps[0]);
    cr_assert(cstep && gstep);
    for (int mr = 0; mr < 2; mr++) {
        float *hist = malloc((size_t)(len * n) * sizeof *hist), *scale = malloc((size_t)(2 * n) * sizeof *scale);
        float *pend = malloc((size_t)n * sizeof *pend), *back = malloc((size_t)(len * n) * sizeof *back);
        cr_assert(hist && scale && pend && back);
        for (int i = 0; i < len * n; i++)
            hist[i] = i % 11 == 0 ? 0.0f : uniform(0.0f, 1000.0f);
        for (int i = 0; i < 2 * n; i++)
            scale[i] = uniform(0.5f, 2.0f);
        float *gh = be_put(gpu, hist, (size_t)(len * n) * sizeof *hist);
        float *gsc = be_put(gpu, scale, (size_t)(2 * n) * sizeof *scale);
        float *gp = be_put(gpu, hist, (size_t)n * sizeof *pend); /* filled below */
        for (int k = 0; k < 2; k++) {
            for (int i = 0; i < n; i++)
                pend[i] = i % 7 == 0 ? 0.0f : uniform(0.0f, 2000.0f);
            gpu->upload(gpu, gp, pend, (size_t)n * sizeof *pend);
            gpu->upload(gpu, gstep, &steps[k], sizeof steps[k]);
            *cstep = steps[k];
            struct fp8_update_args a = {.groups = {{.scale = scale, .scale_inv = scale + n, .history = hist,
                                                    .pending = pend, .n = n, .fmax = 448.0f}},
                                        .ngroups = 1, .len = len, .row = 0, .most_recent = mr, .margin = 1,
                                        .step = cstep};
            cpu->fp8_update(cpu, &a);
            a.groups[0] = (struct fp8_update_group){.scale = gsc, .scale_inv = gsc + n, .history = gh, .pending = gp,
                                                    .n = n, .fmax = 448.0f};
            a.step = gstep;
            gpu->fp8_update(gpu, &a);
            gpu->download(gpu, back, gsc, (size_t)(2 * n) * sizeof *back);
            cr_assert_eq(memcmp(back, scale, (size_t)(2 * n) * sizeof *back), 0, "scales (mr %d, step %lld)", mr,
                         (long long)steps[k]);
            gpu->download(gpu, back, gh, (size_t)(len * n) * sizeof *back);
            cr_assert_eq(memcmp(back, hist, (size_t)(len * n) * sizeof *back), 0, "history (mr %d, step %lld)", mr,
                         (long long)steps[k]);
            gpu->download(gpu, back, gp, (size_t)n * sizeof *back);
            for (int i = 0; i < n; i++)
                cr_assert_eq(back[i], 0.0f, "pending[%d] zeroed on the GPU", i);
        }
        gpu->free(gpu, gh);
        gpu->free(gpu, gsc);
        gpu->free(gpu, gp);
        free(hist);
        free(scale);
        free(pend);
        free(back);
    }
    cpu->free(cpu, cstep);
    gpu->free(gpu, gstep);

    /* window_store: two steps filed at slots 0 and 1 from the same arguments, the row zeroed, the slot advanced */
    const int64_t nc = 6;
    struct step_row rows_h[2];
    int64_t counts_h[2 * 6], slot = 0;
    struct step_row *row = be_put(gpu, rows_h, sizeof rows_h[0]), *rows = be_put(gpu, rows_h, sizeof rows_h);
    int64_t *counts = be_put(gpu, counts_h, (size_t)nc * sizeof *counts_h);
    int64_t *wcounts = be_put(gpu, counts_h, sizeof counts_h), *gslot = be_put(gpu, &slot, sizeof slot);
    struct window_store_args w = {.row = row, .counts = counts, .rows = rows, .window_counts = wcounts, .ncounts = nc,
                                  .slot = gslot};
    for (int s = 0; s < 2; s++) {
        struct step_row r = {.step = 40 + s, .loss = 1.25 * s, .grad_zeros = 9 + s};
        int64_t c[6];
        for (int i = 0; i < nc; i++)
            c[i] = 100 * s + i;
        gpu->upload(gpu, row, &r, sizeof r);
        gpu->upload(gpu, counts, c, sizeof c);
        gpu->window_store(gpu, &w);
    }
    gpu->download(gpu, rows_h, rows, sizeof rows_h);
    gpu->download(gpu, counts_h, wcounts, sizeof counts_h);
    gpu->download(gpu, &slot, gslot, sizeof slot);
    cr_assert_eq(slot, 2);
    for (int s = 0; s < 2; s++) {
        cr_assert(rows_h[s].step == 40 + s && rows_h[s].loss == 1.25 * s && rows_h[s].grad_zeros == 9 + s, "slot %d", s);
        for (int i = 0; i < nc; i++)
            cr_assert_eq(counts_h[s * nc + i], 100 * s + i, "slot %d count %d", s, i);
    }
    struct step_row z;
    gpu->download(gpu, &z, row, sizeof z);
    const unsigned char *zb = (const unsigned char *)&z;
    for (size_t b = 0; b < sizeof z; b++)
        cr_assert_eq(zb[b], 0, "the step's row is zeroed (byte %zu)", b);
    gpu->free(gpu, row);
    gpu->free(gpu, rows);
    gpu->free(gpu, counts);
    gpu->free(gpu, wcounts);
    gpu->free(gpu, gslot);
    struct amp_error err = {0};
    cr_assert_eq(gpu->status(gpu, &err), AMP_OK, "%s", err.msg);
}

/* Dropout with the step in device memory (backend.h struct rng_key: counter + *step * per_step, read as the kernel
 * runs), against the CPU reading its own copy of the step: the same masks bit for bit, forward and backward, at
 * consecutive steps and at a step whose counter passes 2^32 (its high half moves the stream). The trainer-level graph
 * test compares the GPU with itself only, so it cannot see a GPU that reads the step wrongly. */
Test(cuda_backend, dropout_reads_the_step_from_device_memory_as_the_cpu, .init = open_both, .fini = close_both)
{
    rng_state = 59;
    const int64_t n = 5000;
    const uint64_t per_step = 6, within = 4;
    const int64_t steps[3] = {5, 6, INT64_C(3000000000)};
    struct pair x, dy, y, dx;
    pair_rand(&x, DT_BF16, 1, &n, 0.5f, 2.0f);
    pair_rand(&dy, DT_FP32, 1, &n, -1.0f, 1.0f);
    pair_out(&y, DT_BF16, 1, &n);
    pair_out(&dx, DT_FP32, 1, &n);
    int64_t *cstep = cpu->alloc(cpu, sizeof *cstep), *gstep = be_put(gpu, &steps[0], sizeof steps[0]);
    cr_assert_not_null(cstep);
    struct rng_key ck = {.seed = 99, .stream = 2, .counter = within, .step = cstep, .per_step = per_step};
    struct rng_key gk = ck;
    gk.step = gstep;
    for (int k = 0; k < 3; k++) {
        *cstep = steps[k];
        gpu->upload(gpu, gstep, &steps[k], sizeof steps[k]);
        cpu->dropout_forward(cpu, &y.c, &x.c, 0.3f, ck);
        gpu->dropout_forward(gpu, &y.g, &x.g, 0.3f, gk);
        cpu->dropout_backward(cpu, &dx.c, &dy.c, 0.3f, ck);
        gpu->dropout_backward(gpu, &dx.g, &dy.g, 0.3f, gk);
        char what[96];
        snprintf(what, sizeof what, "dropout_forward at step %lld in memory", (long long)steps[k]);
        pair_expect_bits(&y, what);
        snprintf(what, sizeof what, "dropout_backward at step %lld in memory", (long long)steps[k]);
        pair_expect_bits(&dx, what);
    }
    cpu->free(cpu, cstep);
    gpu->free(gpu, gstep);
    pair_free(&x);
    pair_free(&dy);
    pair_free(&y);
    pair_free(&dx);
}

/* Fresh random fp32 values in both copies of a gradient pair; `plant` non-NaN: that value at element 3 too. */
static void grad_refill(struct pair *p, float plant)
{
    float *h = malloc(p->c.numel * sizeof *h);
    cr_assert_not_null(h);
    for (size_t i = 0; i < p->c.numel; i++)
        h[i] = uniform(-3.0f, 3.0f);
    if (!isnan(plant) && p->c.numel > 3)
        h[3] = plant;
    tensor_from_host_f32(&p->c, h);
    gpu->upload(gpu, p->g.data, h, p->c.numel * sizeof *h);
    free(h);
}

/* The GPU's grad_check and counts (nt tensors) against the CPU's for the same gradients. */
static void expect_grad_stats(const struct grad_check *chk_g, const int64_t *cnt_g, const struct tensor *const *gc,
                              int nt, const char *what)
{
    struct grad_check *chk_c = cpu->alloc(cpu, sizeof *chk_c), hg;
    int64_t *cnt_c = cpu->alloc(cpu, 2 * (size_t)nt * sizeof *cnt_c), hcnt[16];
    cr_assert(chk_c && cnt_c && nt <= 8);
    cpu->grad_stats(cpu, gc, nt, chk_c, cnt_c);
    gpu->download(gpu, &hg, chk_g, sizeof hg);
    gpu->download(gpu, hcnt, cnt_g, 2 * (size_t)nt * sizeof *hcnt);
    check_gpu();
    cr_assert_eq(hg.found_nonfinite, chk_c->found_nonfinite, "%s: found_nonfinite %lld, CPU %lld", what,
                 (long long)hg.found_nonfinite, (long long)chk_c->found_nonfinite);
    cr_assert_eq(hg.absmax, chk_c->absmax, "%s: absmax %.17g, CPU %.17g", what, hg.absmax, chk_c->absmax);
    double n_all = 0; /* two sums of n positive terms in double, each within (n - 1) eps of the exact one */
    for (int i = 0; i < nt; i++)
        n_all += (double)gc[i]->numel;
    double bound = 2.0 * n_all * DBL_EPSILON * chk_c->sumsq;
    cr_assert(fabs(hg.sumsq - chk_c->sumsq) <= bound, "%s: sumsq %.17g, CPU %.17g (bound %g)", what, hg.sumsq,
              chk_c->sumsq, bound);
    for (int i = 0; i < 2 * nt; i++)
        cr_assert_eq(hcnt[i], cnt_c[i], "%s: count %d: %lld, CPU %lld", what, i, (long long)hcnt[i],
                     (long long)cnt_c[i]);
    cpu->free(cpu, chk_c);
    cpu->free(cpu, cnt_c);
}

/* The graph entries alone (kernels/cuda/graphs.cu; no model, no data set): a step's ops recorded between graph_begin
 * and graph_end run only when the graph is launched, and each launch reads what lives in device memory as it is
 * then: dropout's step (the CPU's masks at that step, bit for bit), the gradients' values (grad_stats against the
 * CPU's), count_zeros' row (zeroed by the previous launch's window_store) and window_store's slot (one row and one set
 * of counts filed a launch, in the next slot). */
Test(cuda_backend, graph_replays_read_the_step_values_and_slot_from_memory, .init = open_both, .fini = close_both)
{
    if (!gpu->graph_begin)
        cr_skip_test("AMPTRAIN_CUDA_GRAPHS=0: the CUDA backend records no graphs");
    rng_state = 67;
    const int64_t n = 5000, zero = 0;
    const float p = 0.3f;
    struct pair x, y;
    pair_rand(&x, DT_BF16, 1, &n, 0.5f, 2.0f);
    pair_out(&y, DT_BF16, 1, &n);
    int64_t *cstep = cpu->alloc(cpu, sizeof *cstep), *gstep = be_put(gpu, &zero, sizeof zero);
    cr_assert_not_null(cstep);
    struct rng_key ck = {.seed = 7, .stream = 3, .counter = 1, .step = cstep, .per_step = 2}, gk = ck;
    gk.step = gstep;
    enum { NT = 3 };
    int64_t sizes[NT] = {70000, 5, 16384};
    struct pair gr[NT];
    const struct tensor *gc[NT], *gg[NT];
    for (int i = 0; i < NT; i++) {
        pair_alloc(&gr[i], DT_FP32, 1, &sizes[i]);
        grad_refill(&gr[i], NAN);
        gc[i] = &gr[i].c;
        gg[i] = &gr[i].g;
    }
    struct grad_check *chk = be_poisoned(gpu, sizeof *chk);
    int64_t *cnt = be_poisoned(gpu, 2 * NT * sizeof *cnt);
    struct step_row zrow = {0};
    struct step_row *row = be_put(gpu, &zrow, sizeof zrow), *rows = be_poisoned(gpu, 3 * sizeof *rows);
    int64_t *wcounts = be_poisoned(gpu, 3 * 2 * NT * sizeof *wcounts), *slot = be_put(gpu, &zero, sizeof zero);
    struct window_store_args w = {.row = row, .counts = cnt, .rows = rows, .window_counts = wcounts,
                                  .ncounts = 2 * NT, .slot = slot};
    /* the ops once plainly, as the trainer runs a piece before recording it (its scratch and tables settle) */
    for (int rec = 0; rec < 2; rec++) {
        if (rec == 1) {
            void *poison = malloc(tensor_bytes(&y.g));
            cr_assert_not_null(poison);
            memset(poison, 0xFF, tensor_bytes(&y.g));
            gpu->upload(gpu, y.g.data, poison, tensor_bytes(&y.g));
            free(poison);
            gpu->upload(gpu, slot, &zero, sizeof zero);
            check_gpu();
            cr_assert(gpu->graph_begin(gpu), "graph_begin refused on a healthy backend");
        }
        gpu->dropout_forward(gpu, &y.g, &x.g, p, gk);
        gpu->count_zeros(gpu, &y.g, &row->grad_zeros);
        gpu->grad_stats(gpu, gg, NT, chk, cnt);
        gpu->window_store(gpu, &w);
    }
    cr_assert(gpu->graph_end(gpu, 5), "the recording failed (see the note on stderr)");
    check_gpu();
    int64_t got = -1;
    gpu->download(gpu, &got, slot, sizeof got);
    cr_assert_eq(got, 0, "a recorded window_store ran before its graph was launched (slot %lld)", (long long)got);
    unsigned char yb[8];
    gpu->download(gpu, yb, y.g.data, sizeof yb);
    for (int i = 0; i < 8; i++)
        cr_assert_eq(yb[i], 0xFF, "a recorded dropout ran before its graph was launched");

    const int64_t steps[2] = {7, INT64_C(3000000000)};
    int64_t zeros_want[2];
    for (int k = 0; k < 2; k++) {
        *cstep = steps[k];
        gpu->upload(gpu, gstep, &steps[k], sizeof steps[k]);
        for (int i = 0; i < NT; i++)
            grad_refill(&gr[i], k == 1 && i == 0 ? INFINITY : NAN);
        cr_assert(gpu->graph_launch(gpu, 5), "launch %d of a graph kept under key 5", k + 1);
        cpu->dropout_forward(cpu, &y.c, &x.c, p, ck);
        char what[96];
        snprintf(what, sizeof what, "replayed dropout at step %lld in memory", (long long)steps[k]);
        pair_expect_bits(&y, what);
        snprintf(what, sizeof what, "replayed grad_stats, launch %d", k + 1);
        expect_grad_stats(chk, cnt, gc, NT, what);
        zeros_want[k] = zeros_of(cpu, &y.c, 0);
    }
    gpu->download(gpu, &got, slot, sizeof got);
    cr_assert_eq(got, 2, "two launches filed %lld rows", (long long)got);
    struct step_row hrows[2];
    int64_t hcounts[2 * 2 * NT];
    gpu->download(gpu, hrows, rows, sizeof hrows);
    gpu->download(gpu, hcounts, wcounts, sizeof hcounts);
    for (int k = 0; k < 2; k++)
        cr_assert_eq(hrows[k].grad_zeros, zeros_want[k], "slot %d: grad_zeros %lld, the zeros of that step's mask %lld",
                     k, (long long)hrows[k].grad_zeros, (long long)zeros_want[k]);
    cr_assert_eq(hcounts[2 * NT + 0], 1, "slot 1: the Inf planted in tensor 0 counted");
    for (int i = 0; i < 2 * NT; i++)
        cr_assert_eq(hcounts[i], 0, "slot 0: count %d is %lld (the gradients were finite)", i, (long long)hcounts[i]);

    cpu->free(cpu, cstep);
    gpu->free(gpu, gstep);
    gpu->free(gpu, chk);
    gpu->free(gpu, cnt);
    gpu->free(gpu, row);
    gpu->free(gpu, rows);
    gpu->free(gpu, wcounts);
    gpu->free(gpu, slot);
    pair_free(&x);
    pair_free(&y);
    for (int i = 0; i < NT; i++)
        pair_free(&gr[i]);
}

/* Where a graph cannot serve (backend.h graph_end and graph_launch): a key out of range ends the recording anyway
 * (the stream leaves capture, so the caller's plain ops run); a recording that would grow a scratch slot fails with
 * the backend's status untouched and nothing of it run; a graph is refused once a scratch slot it names is replaced,
 * and once a call has uploaded a tensor table with other entries into the buffer it reads (it would read them). */
Test(cuda_backend, graphs_refuse_what_they_cannot_serve, .init = open_both, .fini = close_both)
{
    if (!gpu->graph_begin)
        cr_skip_test("AMPTRAIN_CUDA_GRAPHS=0: the CUDA backend records no graphs");
    rng_state = 71;
    enum { NT = 2 };
    int64_t small[NT] = {1000, 20000}, big = 40 * 16384 + 1;
    struct pair a[NT], b[NT], large;
    const struct tensor *ga[NT], *gb[NT], *gl[1];
    for (int i = 0; i < NT; i++) {
        pair_alloc(&a[i], DT_FP32, 1, &small[i]);
        pair_alloc(&b[i], DT_FP32, 1, &small[i]);
        grad_refill(&a[i], NAN);
        grad_refill(&b[i], NAN);
        ga[i] = &a[i].g;
        gb[i] = &b[i].g;
    }
    pair_alloc(&large, DT_FP32, 1, &big);
    grad_refill(&large, NAN);
    gl[0] = &large.g;
    struct grad_check *chk = be_poisoned(gpu, sizeof *chk);
    int64_t *cnt = be_poisoned(gpu, 2 * NT * sizeof *cnt);
    struct amp_error err = {0};

    /* a key out of range: false, and the capture is over (a new one can start; a plain op runs) */
    gpu->grad_stats(gpu, ga, NT, chk, cnt);
    check_gpu();
    cr_assert(gpu->graph_begin(gpu));
    gpu->grad_stats(gpu, ga, NT, chk, cnt);
    cr_assert_not(gpu->graph_end(gpu, BACKEND_GRAPHS), "graph_end kept a graph under key %d", BACKEND_GRAPHS);
    cr_assert(gpu->graph_begin(gpu), "the recording with a bad key was left open");
    gpu->grad_stats(gpu, ga, NT, chk, cnt);
    cr_assert(gpu->graph_end(gpu, 0));
    check_gpu();

    /* recorded under key 1 with table A; a plain call with table B (the same size: no slot grows) uploads B into the
     * buffer the graph reads: the graph is stale */
    cr_assert(gpu->graph_begin(gpu));
    gpu->grad_stats(gpu, ga, NT, chk, cnt);
    cr_assert(gpu->graph_end(gpu, 1));
    cr_assert(gpu->graph_launch(gpu, 1));
    expect_grad_stats(chk, cnt, (const struct tensor *[]){&a[0].c, &a[1].c}, NT, "graph of table A");
    gpu->grad_stats(gpu, gb, NT, chk, cnt);
    expect_grad_stats(chk, cnt, (const struct tensor *[]){&b[0].c, &b[1].c}, NT, "plain call with table B");
    cr_assert_not(gpu->graph_launch(gpu, 1), "a graph of table A launched after table B replaced it in memory");

    /* a recording whose op would grow CSCR_PARTIAL (more parts than any call before) fails; nothing ran, the status
     * is clean; the same call plainly then grows the slot, and the graph recorded before is stale */
    gpu->grad_stats(gpu, ga, NT, chk, cnt);
    cr_assert(gpu->graph_begin(gpu));
    gpu->grad_stats(gpu, ga, NT, chk, cnt);
    cr_assert(gpu->graph_end(gpu, 2));
    struct grad_check *chk2 = be_poisoned(gpu, sizeof *chk2);
    cr_assert(gpu->graph_begin(gpu));
    gpu->grad_stats(gpu, gl, 1, chk2, cnt);
    cr_assert_not(gpu->graph_end(gpu, 3), "a recording that grew a scratch slot was kept");
    cr_assert_eq(gpu->status(gpu, &err), AMP_OK, "a failed recording set the status: %s", err.msg);
    cr_assert_not(gpu->graph_launch(gpu, 3), "nothing is kept under key 3");
    check_gpu();
    unsigned char raw[sizeof(struct grad_check)];
    gpu->download(gpu, raw, chk2, sizeof raw);
    for (size_t i = 0; i < sizeof raw; i++)
        cr_assert_eq(raw[i], 0xFF, "the failed recording wrote its output (byte %zu)", i);
    gpu->grad_stats(gpu, gl, 1, chk2, cnt);
    expect_grad_stats(chk2, cnt, (const struct tensor *[]){&large.c}, 1, "the large tensor plainly");
    cr_assert_not(gpu->graph_launch(gpu, 2), "a graph naming a replaced scratch buffer launched");
    cr_assert_eq(gpu->status(gpu, &err), AMP_OK, "%s", err.msg);

    gpu->free(gpu, chk);
    gpu->free(gpu, chk2);
    gpu->free(gpu, cnt);
    for (int i = 0; i < NT; i++) {
        pair_free(&a[i]);
        pair_free(&b[i]);
    }
    pair_free(&large);
}

/* The first integer after `key` in out, or -1. */
static long long count_after(const char *out, const char *key)
{
    const char *p = strstr(out, key);
    return p ? strtoll(p + strlen(key), NULL, 10) : -1;
}

/* A step recorded once and replayed (AMPTRAIN_CUDA_GRAPHS=1, the default) gives the checkpoint tensors and
 * scale_log.csv of the same run with every op queued one by one (=0), bit for bit: the CNN with dropout (the masks'
 * step read from device memory) in fp16-dynamic from a 2^24 scale (skipped steps), with accumulation, steps that
 * sample grad_zero_frac (their own graph), and evaluations between steps; the byte GPT in bf16 with accumulation; and
 * fp8 with every product in fp8, recipe delayed (a 3-step amax history, so its row wraps; accumulation) and recipe
 * current. The graphs run says it recorded pieces and replayed them; the other says nothing of graphs. */
Test(cuda_backend, graphs_replay_the_bits_of_plain_launches, .timeout = 900)
{
    if (backend_cuda_device_count() <= 0)
        cr_skip_test("no CUDA device: CUDA graphs were not run");
    if (access(FASHION, R_OK) != 0)
        cr_skip_test("Fashion-MNIST not installed (Debian package dataset-fashion-mnist)");
    static const struct {
        const char *name, *args;
        int steps;
    } cases[] = {
        {"cnn", "configs/fashion_cnn_fp16_dynamic.yaml precision.loss_scale.init=16777216 accum_steps=2 "
                "run.log_every=5 run.eval_every=4", 12},
        {"gpt", "configs/text_gpt.yaml precision.mode=bf16 accum_steps=2 run.log_every=3", 8},
        {"fp8 delayed", "configs/text_gpt.yaml precision.mode=fp8 precision.fp8.amax_history_len=3 accum_steps=2 "
                        "precision.fp8.min_size=[0,0] precision.fp8.keep_bf16=[] run.log_every=4", 8},
        {"fp8 current", "configs/text_gpt.yaml precision.mode=fp8 precision.fp8.recipe=current "
                        "precision.fp8.min_size=[0,0] precision.fp8.keep_bf16=[] run.log_every=4", 8},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        make_scratch();
        const char *env[] = {"1", "0"};
        for (int i = 0; i < 2; i++) {
            setenv("AMPTRAIN_CUDA_GRAPHS", env[i], 1);
            struct result r = amp("run %s run.device=cuda run.steps=%d run.out_dir=%s/g%s", cases[c].args,
                                  cases[c].steps, scratch, env[i]);
            unsetenv("AMPTRAIN_CUDA_GRAPHS");
            cr_assert_eq(r.code, 0, "%s, AMPTRAIN_CUDA_GRAPHS=%s:\n%s", cases[c].name, env[i], r.out);
            cr_assert(strstr(r.out, "device: cuda:0"), "not on the GPU:\n%s", r.out);
            cr_assert_null(strstr(r.out, "CUDA graphs off"), "%s: %s", cases[c].name, r.out);
            long long recorded = count_after(r.out, "cuda graphs: "), replayed = count_after(r.out, "recorded, ");
            if (i == 0)
                cr_assert(recorded > 0 && replayed > 0, "%s: no piece was recorded and replayed:\n%s",
                          cases[c].name, r.out);
            else
                cr_assert_eq(recorded, -1, "%s: AMPTRAIN_CUDA_GRAPHS=0 recorded graphs:\n%s", cases[c].name, r.out);
        }
        char a[512], b[512];
        snprintf(a, sizeof a, "%s/g1/ckpt-%d.h5", scratch, cases[c].steps);
        snprintf(b, sizeof b, "%s/g0/ckpt-%d.h5", scratch, cases[c].steps);
        cr_assert_geq(assert_same_tensors(a, b), 6, "%s: too few tensors compared", cases[c].name);
        snprintf(a, sizeof a, "%s/g1/scale_log.csv", scratch);
        snprintf(b, sizeof b, "%s/g0/scale_log.csv", scratch);
        assert_same_logs(a, b);
        remove_scratch();
    }
}

/* The GPU trainer's delayed fp8 scale update, counted through its backend table (each op queued by itself:
 * AMPTRAIN_CUDA_GRAPHS=0, so a replayed graph does not hide a call): one fp8_update call a step, of both groups and
 * every fp8 tensor, with accumulation; and the scales it set moved from 1. */
static struct {
    void (*fp8_update)(struct backend *, const struct fp8_update_args *);
    int calls, groups, tensors;
} gpu_updates;

static void counting_gpu_fp8_update(struct backend *b, const struct fp8_update_args *a)
{
    gpu_updates.calls++;
    gpu_updates.groups += a->ngroups;
    for (int k = 0; k < a->ngroups; k++)
        gpu_updates.tensors += a->groups[k].n;
    gpu_updates.fp8_update(b, a);
}

Test(cuda_backend, a_delayed_fp8_step_updates_every_scale_in_one_launch, .timeout = 300)
{
    if (backend_cuda_device_count() <= 0)
        cr_skip_test("no CUDA device: the GPU trainer's fp8 update was not counted");
    if (access(FASHION, R_OK) != 0)
        cr_skip_test("Fashion-MNIST not installed (Debian package dataset-fashion-mnist)");
    struct config cfg;
    struct amp_error err = {0};
    cr_assert_eq(config_load(&cfg, AMP_SOURCE_DIR "/configs/fashion_mlp.yaml", &err), AMP_OK, "%s", err.msg);
    const char *ov[] = {"run.device=cuda", "data.batch_size=32", "accum_steps=2", "precision.mode=fp8",
                        "precision.fp8.recipe=delayed", "precision.fp8.keep_bf16=[]", "precision.fp8.min_size=[0, 0]",
                        "run.log_every=1", NULL};
    for (int i = 0; ov[i]; i++)
        cr_assert_eq(config_apply_override(&cfg, ov[i], &err), AMP_OK, "%s: %s", ov[i], err.msg);
    cr_assert_eq(config_finalize(&cfg, &err), AMP_OK, "%s", err.msg);
    setenv("AMPTRAIN_CUDA_GRAPHS", "0", 1);
    struct trainer t;
    enum amp_status s = trainer_setup(&t, &cfg, NULL, &err);
    unsetenv("AMPTRAIN_CUDA_GRAPHS");
    cr_assert_eq(s, AMP_OK, "%s", err.msg);
    cr_assert(t.model.has_fp8);
    const int steps = 3, slots = t.model.fp8.fwd.n + t.model.fp8.bwd.n;
    cr_assert_gt(t.model.fp8.fwd.n, 0);
    cr_assert_gt(t.model.fp8.bwd.n, 0);
    gpu_updates = (__typeof__(gpu_updates)){.fp8_update = t.be->fp8_update};
    t.be->fp8_update = counting_gpu_fp8_update;
    for (int i = 0; i < steps; i++) {
        struct step_record rec = {0};
        cr_assert_eq(step_now(&t, &rec, &err), AMP_OK, "step %d: %s", i + 1, err.msg);
    }
    t.be->fp8_update = gpu_updates.fp8_update;
    cr_assert_eq(gpu_updates.calls, steps, "%d update calls in %d steps", gpu_updates.calls, steps);
    cr_assert_eq(gpu_updates.groups, 2 * steps, "each call updates both groups");
    cr_assert_eq(gpu_updates.tensors, slots * steps, "each call covers all %d fp8 tensors", slots);
    float *sc = malloc((size_t)t.model.fp8.fwd.n * sizeof *sc);
    cr_assert_not_null(sc);
    t.be->download(t.be, sc, t.model.fp8.fwd.scale, (size_t)t.model.fp8.fwd.n * sizeof *sc);
    int moved = 0;
    for (int i = 0; i < t.model.fp8.fwd.n; i++)
        moved += sc[i] != 1.0f;
    cr_assert_gt(moved, 0, "no forward scale moved from 1 in %d steps", steps);
    free(sc);
    cr_assert_eq(t.be->status(t.be, &err), AMP_OK, "%s", err.msg);
    trainer_teardown(&t);
    config_free(&cfg);
}

#else /* built without the CUDA backend */

Test(cuda_backend, needs_the_cuda_backend)
{
    cr_skip_test("the CUDA backend is not built (no nvcc or cuDNN found, or -DAMP_CUDA=OFF): kernels/ was not "
                 "tested");
}

#endif
