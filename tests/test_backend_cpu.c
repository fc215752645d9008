/*
 * test_backend_cpu.c — the CPU backend (kernels/cpu/backend_cpu.c) against independent naive implementations.
 *
 * Every operation is run on fresh random inputs from a seeded generator and compared with a naive
 * version written here in double (triple-loop GEMM, direct convolution, direct pooling, ...):
 * fp32 outputs within ~1e-5 relative, fp16/bf16 outputs within 1 unit in the last place of the
 * naive result rounded once. Backward operations are held to central finite differences of a naive
 * double forward (itself checked against the backend's forward). Outputs are poisoned with NaN
 * before each call so an element the backend forgets to write fails the test.
 */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <criterion/criterion.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "testrand.h" /* seed, urand */
#include "testmem.h"  /* talloc, tracked_tensor, tracked_free_all */
#include "backend.h" /* the interface under test, backend_cpu_create, backend_open */
#include "device_module.h" /* the CUDA backend module: loaded only for a CUDA device */
#include "rng.h"     /* rng_uniform: the documented dropout mask */
#include "sround.h"  /* sr_seed: bf16 master weights */

static const double PI = 3.14159265358979323846;

static struct backend *be;

static double *dalloc(size_t n)
{
    return talloc(n * sizeof(double));
}

static float *falloc(size_t n)
{
    return talloc(n * sizeof(float));
}

static void setup(void)
{
    be = backend_cpu_create();
    cr_assert_not_null(be);
}

static void teardown(void)
{
    tracked_free_all();
    backend_close(be);
}

TestSuite(backend_cpu, .init = setup, .fini = teardown);

/* ---- random inputs ----------------------------------------------------------------------------- */


static float frand(float lo, float hi)
{
    return lo + (hi - lo) * (float)urand();
}

/* ---- tensors ----------------------------------------------------------------------------------- */

static void poison(struct tensor *t)
{
    if (t->dtype == DT_FP32) {
        float *p = t->data;
        for (size_t i = 0; i < t->numel; i++)
            p[i] = NAN;
    } else {
        uint16_t *p = t->data, nan = t->dtype == DT_FP16 ? 0x7E00 : 0x7FC0;
        for (size_t i = 0; i < t->numel; i++)
            p[i] = nan;
    }
}

/* A 1-D tensor of n elements, poisoned with NaN. */
static struct tensor *tnew(enum dtype dt, size_t n)
{
    struct tensor *t = tracked_tensor(be, dt, n);
    poison(t);
    return t;
}

/* A tensor holding h rounded to dt; h is overwritten with the stored values. */
static struct tensor *tfrom(enum dtype dt, size_t n, float *h)
{
    struct tensor *t = tnew(dt, n);
    tensor_from_host_f32(t, h);
    tensor_to_host_f32(t, h);
    return t;
}

/* Uniform random values in [lo, hi) as a tensor; *host gets the stored values. */
static struct tensor *trand(enum dtype dt, size_t n, float lo, float hi, float **host)
{
    float *h = falloc(n);
    for (size_t i = 0; i < n; i++)
        h[i] = frand(lo, hi);
    struct tensor *t = tfrom(dt, n, h);
    if (host)
        *host = h;
    return t;
}

static float *thost(const struct tensor *t)
{
    float *h = falloc(t->numel);
    tensor_to_host_f32(t, h);
    return h;
}

static double *to_d(const float *x, size_t n)
{
    double *d = dalloc(n);
    for (size_t i = 0; i < n; i++)
        d[i] = x[i];
    return d;
}

/* ---- comparisons ------------------------------------------------------------------------------- */

static uint16_t lowp_bits(float x, enum dtype dt)
{
    return dt == DT_FP16 ? fp16_from_fp32(x) : bf16_from_fp32(x);
}

/* Distance in units in the last place between two 16-bit patterns of the same format. */
static int ulp_dist(uint16_t a, uint16_t b)
{
    int ia = a & 0x8000 ? -(int)(a & 0x7FFF) : (int)(a & 0x7FFF);
    int ib = b & 0x8000 ? -(int)(b & 0x7FFF) : (int)(b & 0x7FFF);
    return abs(ia - ib);
}

static void check_f32(const struct tensor *t, const double *want, size_t n, double rtol, double atol,
                      const char *what)
{
    cr_assert_eq(t->dtype, DT_FP32);
    const float *got = t->data;
    for (size_t i = 0; i < n; i++)
        cr_assert(fabs((double)got[i] - want[i]) <= atol + rtol * fabs(want[i]), "%s[%zu]: got %.9g, want %.9g",
                  what, i, (double)got[i], want[i]);
}

/* Each 16-bit element within max_ulps of want rounded once to the format, or within atol (for values
 * the fp32 accumulation leaves near zero, where an ulp is tiny). */
static void check_lowp(const struct tensor *t, const double *want, size_t n, int max_ulps, double atol,
                       const char *what)
{
    cr_assert(t->dtype == DT_FP16 || t->dtype == DT_BF16);
    const uint16_t *got = t->data;
    for (size_t i = 0; i < n; i++) {
        uint16_t w = lowp_bits((float)want[i], t->dtype);
        float g = t->dtype == DT_FP16 ? fp16_to_fp32(got[i]) : bf16_to_fp32(got[i]);
        cr_assert(ulp_dist(got[i], w) <= max_ulps || fabs((double)g - want[i]) <= atol,
                  "%s[%zu] (%s): got 0x%04x = %.9g, want 0x%04x (%.9g)", what, i, dtype_name(t->dtype), got[i],
                  (double)g, w, want[i]);
    }
}

static void check_out(const struct tensor *t, const double *want, size_t n, double rtol, double atol,
                      const char *what)
{
    if (t->dtype == DT_FP32)
        check_f32(t, want, n, rtol, atol, what);
    else
        check_lowp(t, want, n, 1, atol, what);
}

static void check_grad(const float *got, const double *want, size_t n, double rtol, double atol, const char *what)
{
    for (size_t i = 0; i < n; i++)
        cr_assert(fabs((double)got[i] - want[i]) <= atol + rtol * fabs(want[i]), "%s[%zu]: got %.9g, want %.9g",
                  what, i, (double)got[i], want[i]);
}

/* Central finite differences of f at x (n values), written to grad. */
typedef double loss_fn(const double *x, void *ctx);

static void fd_grad(loss_fn *f, void *ctx, double *x, size_t n, double h, double *grad)
{
    for (size_t i = 0; i < n; i++) {
        double x0 = x[i];
        x[i] = x0 + h;
        double fp = f(x, ctx);
        x[i] = x0 - h;
        double fm = f(x, ctx);
        x[i] = x0;
        grad[i] = (fp - fm) / (2.0 * h);
    }
}

static double dot(const double *a, const double *b, size_t n)
{
    double s = 0.0;
    for (size_t i = 0; i < n; i++)
        s += a[i] * b[i];
    return s;
}

/* ---- GEMM -------------------------------------------------------------------------------------- */

/* C (m, n) = alpha op(A) op(B) + beta C0 + bias, in double. */
static void gemm_naive(const float *a, const float *b, const float *c0, const float *bias, bool ta, bool tb,
                       int64_t m, int64_t n, int64_t k, double alpha, double beta, double *c)
{
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            double s = 0.0;
            for (int64_t p = 0; p < k; p++)
                s += (double)(ta ? a[p * m + i] : a[i * k + p]) * (double)(tb ? b[j * k + p] : b[p * n + j]);
            c[i * n + j] = alpha * s + (beta != 0.0 ? beta * c0[i * n + j] : 0.0) + (bias ? bias[j] : 0.0);
        }
}

static void run_gemm_case(enum dtype in_dt, enum dtype out_dt, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                          int64_t batch, float alpha, float beta, bool with_bias)
{
    float *ha, *hb, *hc0 = NULL, *hbias = NULL;
    struct tensor *a = trand(in_dt, (size_t)(batch * m * k), -1, 1, &ha);
    struct tensor *b = trand(in_dt, (size_t)(batch * k * n), -1, 1, &hb);
    struct tensor *c = beta != 0.0f ? trand(out_dt, (size_t)(batch * m * n), -1, 1, &hc0)
                                    : tnew(out_dt, (size_t)(batch * m * n));
    struct tensor *bias = with_bias ? trand(DT_FP32, (size_t)n, -1, 1, &hbias) : NULL;
    struct gemm_args g = { .a = a, .b = b, .c = c, .bias = bias, .trans_a = ta, .trans_b = tb, .m = m, .n = n,
                           .k = k, .alpha = alpha, .beta = beta, .batch = batch, .stride_a = m * k,
                           .stride_b = k * n, .stride_c = m * n };
    be->gemm(be, &g);
    double *want = dalloc((size_t)(batch * m * n));
    for (int64_t i = 0; i < batch; i++)
        gemm_naive(ha + i * m * k, hb + i * k * n, hc0 ? hc0 + i * m * n : NULL, hbias, ta, tb, m, n, k, alpha, beta,
                   want + i * m * n);
    char what[96];
    snprintf(what, sizeof what, "gemm %s->%s ta=%d tb=%d batch=%lld", dtype_name(in_dt), dtype_name(out_dt), ta, tb,
             (long long)batch);
    check_out(c, want, (size_t)(batch * m * n), 1e-5, 1e-5, what);
}

Test(backend_cpu, gemm_fp32_all_transposes)
{
    seed(1);
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            run_gemm_case(DT_FP32, DT_FP32, ta, tb, 5, 7, 3, 1, 1.0f, 0.0f, false);
            run_gemm_case(DT_FP32, DT_FP32, ta, tb, 33, 17, 29, 1, 0.5f, 0.0f, false);
        }
}

Test(backend_cpu, gemm_batch_bias_and_beta_accumulation)
{
    seed(2);
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            run_gemm_case(DT_FP32, DT_FP32, ta, tb, 4, 6, 5, 3, 1.0f, 0.0f, true);
            run_gemm_case(DT_FP32, DT_FP32, ta, tb, 4, 6, 5, 3, 2.0f, 1.0f, false);
            run_gemm_case(DT_FP32, DT_FP32, ta, tb, 4, 6, 5, 2, 1.0f, 0.5f, false);
        }
}

Test(backend_cpu, gemm_lowp_output_rounded_once)
{
    seed(3);
    enum dtype dts[2] = { DT_FP16, DT_BF16 };
    for (int d = 0; d < 2; d++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) {
                run_gemm_case(dts[d], dts[d], ta, tb, 9, 11, 13, 2, 1.0f, 0.0f, false);
                run_gemm_case(dts[d], dts[d], ta, tb, 9, 11, 13, 1, 1.0f, 0.0f, true);
                run_gemm_case(dts[d], dts[d], ta, tb, 9, 11, 13, 2, 1.0f, 1.0f, false);
                /* lowp inputs, fp32 output: the products of the rounded inputs, accumulated in fp32 */
                run_gemm_case(dts[d], DT_FP32, ta, tb, 9, 11, 13, 2, 1.0f, 0.0f, false);
                run_gemm_case(dts[d], DT_FP32, ta, tb, 9, 11, 13, 1, 1.0f, 1.0f, false);
            }
}

/* The GELU epilogue: aux is the plain product (with bias) bit for bit, and C is GELU of the unrounded fp32
 * product rounded once, i.e. act_forward on the fp32-output product, then one rounding. m = 700 with
 * n = 1500 spans several of the epilogue's row blocks. */
Test(backend_cpu, gemm_gelu_epilogue_is_gelu_of_the_fp32_product_rounded_once)
{
    seed(4);
    enum dtype dts[3] = { DT_FP32, DT_FP16, DT_BF16 };
    int64_t shapes[2][3] = { { 9, 11, 13 }, { 700, 1500, 40 } };
    for (int d = 0; d < 3; d++)
        for (int sh = 0; sh < 2; sh++)
            for (int tb = 0; tb < 2; tb++) {
                int64_t m = shapes[sh][0], n = shapes[sh][1], k = shapes[sh][2];
                enum dtype dt = dts[d];
                struct tensor *a = trand(dt, (size_t)(m * k), -1.5f, 1.5f, NULL);
                struct tensor *b = trand(dt, (size_t)(k * n), -1.5f, 1.5f, NULL);
                struct tensor *bias = trand(DT_FP32, (size_t)n, -1, 1, NULL);
                struct tensor *c = tnew(dt, (size_t)(m * n)), *aux = tnew(dt, (size_t)(m * n));
                struct tensor *plain = tnew(dt, (size_t)(m * n)), *c32 = tnew(DT_FP32, (size_t)(m * n));
                struct tensor *g32 = tnew(DT_FP32, (size_t)(m * n)), *want = tnew(dt, (size_t)(m * n));
                struct gemm_args g = { .a = a, .b = b, .c = plain, .bias = bias, .trans_b = tb, .m = m, .n = n,
                                       .k = k, .alpha = 0.5f, .batch = 1 };
                be->gemm(be, &g);
                g.c = c32;
                be->gemm(be, &g);
                be->act_forward(be, ACT_GELU_TANH, g32, c32);
                be->convert(be, want, g32);
                g.c = c;
                g.epilogue = GEMM_EPI_GELU_TANH;
                g.aux = aux;
                be->gemm(be, &g);
                size_t bytes = tensor_bytes(c);
                cr_assert_eq(memcmp(aux->data, plain->data, bytes), 0, "%s %lldx%lld tb=%d: aux is the product",
                             dtype_name(dt), (long long)m, (long long)n, tb);
                cr_assert_eq(memcmp(c->data, want->data, bytes), 0,
                             "%s %lldx%lld tb=%d: C is gelu of the fp32 product, rounded once", dtype_name(dt),
                             (long long)m, (long long)n, tb);
                if (dt != DT_FP32) { /* and that differs from rounding twice somewhere, so the check can fail */
                    struct tensor *twice = tnew(dt, (size_t)(m * n));
                    be->act_forward(be, ACT_GELU_TANH, twice, plain);
                    if (sh == 1)
                        cr_assert_neq(memcmp(twice->data, c->data, bytes), 0, "double rounding is not the epilogue");
                }
            }
}

Test(backend_cpu, gemm_fp16_overflow_is_inf)
{
    float ha[4] = { 256, 256, -256, -256 }, hb[2] = { 137, 137 };
    struct tensor *a = tfrom(DT_FP16, 4, ha), *b = tfrom(DT_FP16, 2, hb);
    struct tensor *c = tnew(DT_FP16, 2), *c32 = tnew(DT_FP32, 2);
    struct gemm_args g = { .a = a, .b = b, .c = c, .m = 2, .n = 1, .k = 2, .alpha = 1, .batch = 1 };
    be->gemm(be, &g);
    const uint16_t *bits = c->data;
    cr_assert_eq(bits[0], 0x7C00, "256*137*2 = 70144 > 65504 must be +Inf in fp16, got 0x%04x", bits[0]);
    cr_assert_eq(bits[1], 0xFC00, "-70144 must be -Inf in fp16, got 0x%04x", bits[1]);
    g.c = c32;
    be->gemm(be, &g);
    cr_assert_eq(((float *)c32->data)[0], 70144.0f);
    /* 32752 + 32768 = 65520 is past the midpoint to 65504's successor: the fp32 sum rounds to Inf */
    float hc[2] = { 1, 1 };
    struct tensor *ones = tfrom(DT_FP16, 2, hc);
    float hx[2] = { 32752, 32767.5f };
    struct tensor *x = tfrom(DT_FP16, 2, hx); /* stored as 32752 and 32768 */
    cr_assert_eq(hx[1], 32768.0f);
    struct gemm_args g2 = { .a = x, .b = ones, .c = tnew(DT_FP16, 1), .m = 1, .n = 1, .k = 2, .alpha = 1, .batch = 1 };
    be->gemm(be, &g2);
    cr_assert_eq(((uint16_t *)g2.c->data)[0], 0x7C00, "32752 + 32768 = 65520 rounds to Inf");
    hx[1] = 32720; /* 32752 + 32720 = 65472 = fp16 max - 32: finite */
    x = tfrom(DT_FP16, 2, hx);
    g2.a = x;
    be->gemm(be, &g2);
    cr_assert_eq(fp16_to_fp32(((uint16_t *)g2.c->data)[0]), 65472.0f);
}

Test(backend_cpu, bias_grad_column_sums)
{
    seed(4);
    enum dtype dts[3] = { DT_FP32, DT_FP16, DT_BF16 };
    for (int d = 0; d < 3; d++) {
        int64_t m = 37, n = 11;
        float *hdy, *hdb0;
        struct tensor *dy = trand(dts[d], (size_t)(m * n), -2, 2, &hdy);
        struct tensor *db = tnew(DT_FP32, (size_t)n);
        be->bias_grad(be, db, dy, m, n, 0.0f);
        double *want = dalloc((size_t)n);
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++)
                want[j] += hdy[i * n + j];
        check_f32(db, want, (size_t)n, 1e-6, 1e-6, "bias_grad beta 0");
        struct tensor *db2 = trand(DT_FP32, (size_t)n, -1, 1, &hdb0);
        be->bias_grad(be, db2, dy, m, n, 1.0f);
        for (int64_t j = 0; j < n; j++)
            want[j] += hdb0[j];
        check_f32(db2, want, (size_t)n, 1e-6, 1e-6, "bias_grad beta 1");
    }
}

/* ---- activations, add, dropout ----------------------------------------------------------------- */

static double act_d(enum act_kind kind, double x)
{
    switch (kind) {
    case ACT_RELU: return x > 0 ? x : 0;
    case ACT_GELU_TANH: return 0.5 * x * (1 + tanh(sqrt(2 / PI) * (x + 0.044715 * x * x * x)));
    case ACT_GELU_ERF: return 0.5 * x * (1 + erf(x / sqrt(2.0)));
    }
    return NAN;
}

Test(backend_cpu, act_known_values)
{
    float hx[4] = { -1, 0, 1, 2 };
    struct tensor *x = tfrom(DT_FP32, 4, hx), *y = tnew(DT_FP32, 4);
    be->act_forward(be, ACT_RELU, y, x);
    check_f32(y, (double[]){ 0, 0, 1, 2 }, 4, 0, 0, "relu");
    be->act_forward(be, ACT_GELU_TANH, y, x);
    check_f32(y, (double[]){ -0.15880800939172324, 0, 0.8411919906082768, 1.9545976940871322 }, 4, 1e-6, 1e-7,
              "gelu tanh");
    be->act_forward(be, ACT_GELU_ERF, y, x);
    check_f32(y, (double[]){ -0.15865525393145707, 0, 0.8413447460685429, 1.9544997361036416 }, 4, 1e-6, 1e-7,
              "gelu erf");
    float hn[1] = { NAN };
    struct tensor *xn = tfrom(DT_FP32, 1, hn), *yn = tnew(DT_FP32, 1);
    ((float *)yn->data)[0] = 0;
    be->act_forward(be, ACT_RELU, yn, xn);
    cr_assert(isnan(((float *)yn->data)[0]), "relu must not hide a NaN");
}

/* GELU (tanh) over a dense sweep of [-12, 12] and special values, against the formula in double:
 * the backend's own tanh (kernels/cpu/backend_cpu.c, tanh_f32) must be as good as libm's. Bound per element:
 * 0.5 |x| (4 ulp of 1) for tanh and the 1 + t, plus 2 ulp of the result. */
Test(backend_cpu, gelu_tanh_dense_sweep)
{
    const size_t n = 240001;
    float *hx = falloc(n + 4);
    for (size_t i = 0; i < n; i++)
        hx[i] = -12.0f + 24.0f * (float)i / (float)(n - 1);
    hx[n] = 1e-30f, hx[n + 1] = -1e-30f, hx[n + 2] = INFINITY, hx[n + 3] = NAN;
    struct tensor *x = tfrom(DT_FP32, n + 4, hx), *y = tnew(DT_FP32, n + 4);
    be->act_forward(be, ACT_GELU_TANH, y, x);
    const float *hy = y->data;
    for (size_t i = 0; i < n + 2; i++) {
        double v = hx[i], want = act_d(ACT_GELU_TANH, v);
        float wf = (float)fabs(want);
        double bound = 0.5 * fabs(v) * 4 * 0x1p-24 + 2 * ((double)nextafterf(wf, INFINITY) - wf);
        cr_assert(fabs(hy[i] - want) <= bound, "gelu_tanh(%.9g) = %.9g, want %.9g (bound %.3g)", v, (double)hy[i],
                  want, bound);
    }
    cr_assert(isinf(hy[n + 2]) && hy[n + 2] > 0, "gelu_tanh(inf) = %g", (double)hy[n + 2]);
    cr_assert(isnan(hy[n + 3]), "gelu_tanh must not hide a NaN, got %g", (double)hy[n + 3]);
}

Test(backend_cpu, act_forward_all_dtypes)
{
    seed(5);
    enum dtype dts[3] = { DT_FP32, DT_FP16, DT_BF16 };
    enum act_kind kinds[3] = { ACT_RELU, ACT_GELU_TANH, ACT_GELU_ERF };
    for (int di = 0; di < 3; di++)
        for (int dout = 0; dout < 3; dout++)
            for (int k = 0; k < 3; k++) {
                size_t n = 2500; /* more than one block */
                float *hx;
                struct tensor *x = trand(dts[di], n, -5, 5, &hx), *y = tnew(dts[dout], n);
                be->act_forward(be, kinds[k], y, x);
                double *want = dalloc(n);
                for (size_t i = 0; i < n; i++)
                    want[i] = act_d(kinds[k], hx[i]);
                check_out(y, want, n, 2e-6, 1e-6, "act_forward");
            }
}

/* ReLU and its gradient on 16-bit tensors (all bf16 or all fp16) work on the bits without widening: every one of
 * the 65536 inputs, and 65536 gradients against them, must give the bits of widening to fp32, x <= 0 ? 0 : x
 * (dy for the gradient) and rounding back, NaN payloads, signed zeros and infinities included. */
Test(backend_cpu, relu_on_16_bit_tensors_gives_the_bits_of_the_fp32_round_trip)
{
    const size_t n = 65536;
    enum dtype dts[2] = { DT_BF16, DT_FP16 };
    float *xf = falloc(n), *gf = falloc(n), *want = falloc(n);
    uint16_t *want16 = talloc(n * sizeof *want16);
    for (int d = 0; d < 2; d++) {
        enum dtype dt = dts[d];
        struct tensor *x = tnew(dt, n), *dy = tnew(dt, n), *y = tnew(dt, n), *dx = tnew(dt, n);
        uint16_t *hx = x->data, *hdy = dy->data;
        for (size_t i = 0; i < n; i++) {
            hx[i] = (uint16_t)i;
            /* odd multiplier: every pattern once, against another x; x = +0 meets a gradient of 1.0 in bf16 */
            hdy[i] = (uint16_t)(i * 40503u + 0x3F80u);
        }
        dtype_convert(xf, DT_FP32, hx, dt, n);
        dtype_convert(gf, DT_FP32, hdy, dt, n);
        be->act_forward(be, ACT_RELU, y, x);
        for (size_t i = 0; i < n; i++)
            want[i] = xf[i] <= 0.0f ? 0.0f : xf[i];
        dtype_convert(want16, dt, want, DT_FP32, n);
        for (size_t i = 0; i < n; i++)
            cr_assert_eq(((uint16_t *)y->data)[i], want16[i], "%s relu(0x%04zx) = 0x%04x, want 0x%04x",
                         dtype_name(dt), i, ((uint16_t *)y->data)[i], want16[i]);
        be->act_backward(be, ACT_RELU, dx, dy, x);
        for (size_t i = 0; i < n; i++)
            want[i] = xf[i] <= 0.0f ? 0.0f : gf[i];
        dtype_convert(want16, dt, want, DT_FP32, n);
        for (size_t i = 0; i < n; i++)
            cr_assert_eq(((uint16_t *)dx->data)[i], want16[i], "%s relu'(0x%04zx) * 0x%04x = 0x%04x, want 0x%04x",
                         dtype_name(dt), i, hdy[i], ((uint16_t *)dx->data)[i], want16[i]);
    }
}

struct act_ctx {
    enum act_kind kind;
    const double *w;
};

static double act_loss(const double *x, void *vctx)
{
    struct act_ctx *c = vctx;
    double s = 0;
    for (size_t i = 0; i < 64; i++)
        s += c->w[i] * act_d(c->kind, x[i]);
    return s;
}

Test(backend_cpu, act_backward_matches_finite_differences)
{
    seed(6);
    enum act_kind kinds[3] = { ACT_RELU, ACT_GELU_TANH, ACT_GELU_ERF };
    for (int k = 0; k < 3; k++) {
        size_t n = 64;
        float *hx, *hw;
        struct tensor *x = trand(DT_FP32, n, -4, 4, &hx), *w = trand(DT_FP32, n, -1, 1, &hw);
        for (size_t i = 0; i < n; i++)
            if (fabsf(hx[i]) < 1e-3f) /* keep relu's kink away from the difference stencil */
                hx[i] = ((float *)x->data)[i] = 0.5f;
        struct tensor *dx = tnew(DT_FP32, n);
        be->act_backward(be, kinds[k], dx, w, x);
        struct act_ctx c = { kinds[k], to_d(hw, n) };
        double *want = dalloc(n);
        fd_grad(act_loss, &c, to_d(hx, n), n, 1e-5, want);
        check_grad(dx->data, want, n, 1e-5, 1e-6, "act_backward");
        /* 16-bit output: the same gradient rounded once */
        struct tensor *dx16 = tnew(DT_BF16, n);
        be->act_backward(be, kinds[k], dx16, w, x);
        double *exact = to_d(dx->data, n);
        check_lowp(dx16, exact, n, 1, 0, "act_backward bf16");
    }
    /* large |x|: the derivative saturates cleanly instead of 0 * Inf */
    float big[2] = { 1e20f, -1e20f }, ones[2] = { 1, 1 };
    struct tensor *xb = tfrom(DT_FP32, 2, big), *g = tfrom(DT_FP32, 2, ones), *d = tnew(DT_FP32, 2);
    be->act_backward(be, ACT_GELU_TANH, d, g, xb);
    check_f32(d, (double[]){ 1, 0 }, 2, 0, 0, "gelu tanh' at +-1e20");
    be->act_backward(be, ACT_GELU_ERF, d, g, xb);
    check_f32(d, (double[]){ 1, 0 }, 2, 0, 0, "gelu erf' at +-1e20");
}

Test(backend_cpu, add_mixed_dtypes)
{
    seed(7);
    size_t n = 3000;
    float *ha, *hb;
    struct tensor *a = trand(DT_FP16, n, -100, 100, &ha), *b = trand(DT_FP32, n, -1, 1, &hb);
    enum dtype outs[3] = { DT_FP32, DT_FP16, DT_BF16 };
    double *want = dalloc(n);
    for (size_t i = 0; i < n; i++)
        want[i] = (double)(ha[i] + hb[i]); /* the fp32 sum, rounded once to y */
    for (int o = 0; o < 3; o++) {
        struct tensor *y = tnew(outs[o], n);
        be->add(be, y, a, b);
        if (outs[o] == DT_FP32)
            check_f32(y, want, n, 0, 0, "add fp32");
        else
            check_lowp(y, want, n, 0, 0, "add lowp");
    }
}

Test(backend_cpu, dropout_mask_is_a_pure_function_of_key)
{
    seed(8);
    size_t n = 100000;
    float p = 0.25f, scale = 1.0f / (1.0f - p);
    float *hx = falloc(n);
    for (size_t i = 0; i < n; i++)
        hx[i] = frand(0.5f, 2.0f); /* never zero, so y == 0 means dropped */
    struct tensor *x = tfrom(DT_FP32, n, hx);
    struct rng_key key = { .seed = 1234, .stream = 3, .counter = 77 };
    struct tensor *y1 = tnew(DT_FP32, n), *y2 = tnew(DT_FP32, n), *y3 = tnew(DT_FP32, n), *y4 = tnew(DT_FP32, n);
    be->dropout_forward(be, y1, x, p, key);
    be->dropout_forward(be, y2, x, p, key);
    cr_assert_eq(memcmp(y1->data, y2->data, n * sizeof(float)), 0, "same key, same mask");
    struct rng_key key_c = key, key_s = key;
    key_c.counter++;
    key_s.stream++;
    be->dropout_forward(be, y3, x, p, key_c);
    be->dropout_forward(be, y4, x, p, key_s);
    const float *a = y1->data, *c = y3->data, *s = y4->data;
    size_t kept = 0, diff_c = 0, diff_s = 0;
    uint64_t stream = (key.stream << 20) + (key.counter >> 32);
    for (size_t i = 0; i < n; i++) {
        bool k = a[i] != 0.0f;
        kept += k;
        diff_c += k != (c[i] != 0.0f);
        diff_s += k != (s[i] != 0.0f);
        /* the documented mask, which the CUDA backend reproduces */
        bool expect = rng_uniform(key.seed, stream, (key.counter << 32) | i) >= p;
        cr_assert_eq(k, expect, "mask[%zu] differs from the documented formula", i);
        cr_assert_eq(a[i], k ? hx[i] * scale : 0.0f);
    }
    double frac = (double)kept / (double)n;
    cr_assert(fabs(frac - 0.75) < 0.01, "kept fraction %.4f, want 0.75", frac);
    /* independent masks disagree on about 2 p (1-p) = 37.5% of elements */
    cr_assert(fabs((double)diff_c / (double)n - 0.375) < 0.02, "counter+1 mask differs on %zu", diff_c);
    cr_assert(fabs((double)diff_s / (double)n - 0.375) < 0.02, "stream+1 mask differs on %zu", diff_s);

    /* backward: the forward's mask and scale */
    float *hdy;
    struct tensor *dy = trand(DT_FP32, n, 0.5f, 2.0f, &hdy), *dx = tnew(DT_FP32, n);
    be->dropout_backward(be, dx, dy, p, key);
    const float *d = dx->data;
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(d[i], a[i] != 0.0f ? hdy[i] * scale : 0.0f, "dropout backward [%zu]", i);

    /* p = 0: a copy, converting */
    struct tensor *y16 = tnew(DT_BF16, n);
    be->dropout_forward(be, y16, x, 0.0f, key);
    for (size_t i = 0; i < n; i += 997)
        cr_assert_eq(((uint16_t *)y16->data)[i], bf16_from_fp32(hx[i]));
}

Test(backend_cpu, dropout_lowp_rounds_scaled_values)
{
    seed(9);
    size_t n = 4096;
    float *hx;
    struct tensor *x = trand(DT_FP16, n, 0.5f, 2.0f, &hx), *y = tnew(DT_FP16, n);
    float p = 0.1f, scale = 1.0f / (1.0f - p);
    struct rng_key key = { .seed = 5, .stream = 0, .counter = 1 };
    be->dropout_forward(be, y, x, p, key);
    const uint16_t *yb = y->data;
    for (size_t i = 0; i < n; i++)
        cr_assert(yb[i] == 0 || yb[i] == fp16_from_fp32(hx[i] * scale), "[%zu]", i);
}

/* ---- convolution ------------------------------------------------------------------------------- */

static float x_at(const float *x, const struct conv_args *a, int64_t n, int64_t c, int64_t h, int64_t w)
{
    if (h < 0 || h >= a->h_in || w < 0 || w >= a->w_in)
        return 0.0f;
    return x[((n * a->c_in + c) * a->h_in + h) * a->w_in + w];
}

static void conv_naive(const double *x, const double *w, const float *bias, const struct conv_args *a, double *y)
{
    int64_t k = a->kernel;
    for (int64_t n = 0; n < a->n; n++)
        for (int64_t co = 0; co < a->c_out; co++)
            for (int64_t oh = 0; oh < a->h_out; oh++)
                for (int64_t ow = 0; ow < a->w_out; ow++) {
                    double s = bias ? bias[co] : 0.0;
                    for (int64_t ci = 0; ci < a->c_in; ci++)
                        for (int64_t kh = 0; kh < k; kh++)
                            for (int64_t kw = 0; kw < k; kw++) {
                                int64_t ih = oh * a->stride - a->padding + kh, iw = ow * a->stride - a->padding + kw;
                                if (ih < 0 || ih >= a->h_in || iw < 0 || iw >= a->w_in)
                                    continue;
                                s += w[((co * a->c_in + ci) * k + kh) * k + kw] *
                                     x[((n * a->c_in + ci) * a->h_in + ih) * a->w_in + iw];
                            }
                    y[((n * a->c_out + co) * a->h_out + oh) * a->w_out + ow] = s;
                }
}

static struct conv_args conv_shape(int64_t n, int64_t c_in, int64_t h, int64_t w, int64_t c_out, int64_t k,
                                   int64_t s, int64_t p)
{
    return (struct conv_args){ .n = n, .c_in = c_in, .h_in = h, .w_in = w, .c_out = c_out,
                               .h_out = (h + 2 * p - k) / s + 1, .w_out = (w + 2 * p - k) / s + 1,
                               .kernel = k, .stride = s, .padding = p };
}

/* n, c_in, h, w, c_out, kernel, stride, padding */
static const int64_t conv_cases[][8] = {
    { 2, 3, 7, 6, 4, 3, 2, 1 }, /* stride 2, padding 1 */
    { 2, 5, 4, 4, 3, 1, 1, 0 }, /* pointwise: no im2col */
    { 1, 2, 6, 5, 3, 3, 1, 0 }, /* valid */
    { 2, 2, 5, 5, 2, 3, 1, 1 }, /* same: im2col as shifted copies of each plane (im2col_same) */
    { 1, 2, 4, 7, 3, 5, 1, 2 }, /* same, 5 x 5, wider than high: two edge columns each side */
    { 1, 1, 2, 3, 2, 5, 1, 2 }, /* same, padding as high as the image: the general loops */
};
#define N_CONV_CASES ((int)(sizeof conv_cases / sizeof conv_cases[0]))

/* A shape written as a row of 8: n, c_in, h, w, c_out, kernel, stride, padding. */
static struct conv_args conv_row(const int64_t c[8])
{
    return conv_shape(c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]);
}

static void conv_case(int i, struct conv_args *a)
{
    *a = conv_row(conv_cases[i]);
}

Test(backend_cpu, conv2d_forward_matches_direct_convolution)
{
    seed(10);
    enum dtype dts[3] = { DT_FP32, DT_FP16, DT_BF16 };
    for (int ci = 0; ci < N_CONV_CASES; ci++)
        for (int d = 0; d < 3; d++)
            for (int with_bias = 0; with_bias < 2; with_bias++) {
                struct conv_args a;
                conv_case(ci, &a);
                size_t nx = (size_t)(a.n * a.c_in * a.h_in * a.w_in), nw = (size_t)(a.c_out * a.c_in * a.kernel * a.kernel);
                size_t ny = (size_t)(a.n * a.c_out * a.h_out * a.w_out);
                float *hx, *hw, *hb = NULL;
                struct tensor *x = trand(dts[d], nx, -1, 1, &hx), *w = trand(dts[d], nw, -1, 1, &hw);
                struct tensor *b = with_bias ? trand(DT_FP32, (size_t)a.c_out, -1, 1, &hb) : NULL;
                struct tensor *y = tnew(dts[d], ny);
                be->conv2d_forward(be, &a, y, x, w, b);
                double *want = dalloc(ny);
                conv_naive(to_d(hx, nx), to_d(hw, nw), hb, &a, want);
                check_out(y, want, ny, 1e-5, 1e-5, "conv2d_forward");
            }
}

struct conv_ctx {
    struct conv_args a;
    const double *w, *x, *gy; /* gy: the weights of the scalar loss sum(gy * y) */
};

static double conv_loss_x(const double *x, void *vctx)
{
    struct conv_ctx *c = vctx;
    size_t ny = (size_t)(c->a.n * c->a.c_out * c->a.h_out * c->a.w_out);
    double *y = malloc(ny * sizeof(double));
    conv_naive(x, c->w, NULL, &c->a, y);
    double s = dot(y, c->gy, ny);
    free(y);
    return s;
}

static double conv_loss_w(const double *w, void *vctx)
{
    struct conv_ctx *c = vctx;
    size_t ny = (size_t)(c->a.n * c->a.c_out * c->a.h_out * c->a.w_out);
    double *y = malloc(ny * sizeof(double));
    conv_naive(c->x, w, NULL, &c->a, y);
    double s = dot(y, c->gy, ny);
    free(y);
    return s;
}

Test(backend_cpu, conv2d_backward_matches_finite_differences)
{
    seed(11);
    for (int ci = 0; ci < N_CONV_CASES; ci++) {
        struct conv_args a;
        conv_case(ci, &a);
        size_t nx = (size_t)(a.n * a.c_in * a.h_in * a.w_in), nw = (size_t)(a.c_out * a.c_in * a.kernel * a.kernel);
        size_t ny = (size_t)(a.n * a.c_out * a.h_out * a.w_out);
        float *hx, *hw, *hdy, *hdw0, *hdb0;
        struct tensor *x = trand(DT_FP32, nx, -1, 1, &hx), *w = trand(DT_FP32, nw, -1, 1, &hw);
        struct tensor *dy = trand(DT_FP32, ny, -1, 1, &hdy);
        struct tensor *dx = tnew(DT_FP32, nx), *dw = tnew(DT_FP32, nw), *db = tnew(DT_FP32, (size_t)a.c_out);
        be->conv2d_backward_data(be, &a, dx, dy, w);
        be->conv2d_backward_filter(be, &a, dw, db, dy, x, 0.0f);
        struct conv_ctx c = { a, to_d(hw, nw), to_d(hx, nx), to_d(hdy, ny) };
        double *gx = dalloc(nx), *gw = dalloc(nw), *gb = dalloc((size_t)a.c_out);
        fd_grad(conv_loss_x, &c, to_d(hx, nx), nx, 1e-4, gx);
        fd_grad(conv_loss_w, &c, to_d(hw, nw), nw, 1e-4, gw);
        for (int64_t n = 0; n < a.n; n++)
            for (int64_t co = 0; co < a.c_out; co++)
                for (int64_t j = 0; j < a.h_out * a.w_out; j++)
                    gb[co] += hdy[(n * a.c_out + co) * a.h_out * a.w_out + j];
        check_f32(dx, gx, nx, 1e-5, 1e-5, "conv2d_backward_data");
        check_f32(dw, gw, nw, 1e-5, 1e-5, "conv2d_backward_filter dw");
        check_f32(db, gb, (size_t)a.c_out, 1e-5, 1e-6, "conv2d_backward_filter db");
        /* beta 1 accumulates onto what is there */
        struct tensor *dw1 = trand(DT_FP32, nw, -1, 1, &hdw0), *db1 = trand(DT_FP32, (size_t)a.c_out, -1, 1, &hdb0);
        be->conv2d_backward_filter(be, &a, dw1, db1, dy, x, 1.0f);
        for (size_t i = 0; i < nw; i++)
            gw[i] += hdw0[i];
        for (int64_t i = 0; i < a.c_out; i++)
            gb[i] += hdb0[i];
        check_f32(dw1, gw, nw, 1e-5, 1e-5, "conv2d_backward_filter dw beta 1");
        check_f32(db1, gb, (size_t)a.c_out, 1e-5, 1e-6, "conv2d_backward_filter db beta 1");
    }
}

Test(backend_cpu, conv2d_backward_lowp)
{
    seed(12);
    struct conv_args a;
    conv_case(0, &a);
    size_t nx = (size_t)(a.n * a.c_in * a.h_in * a.w_in), nw = (size_t)(a.c_out * a.c_in * a.kernel * a.kernel);
    size_t ny = (size_t)(a.n * a.c_out * a.h_out * a.w_out);
    float *hx, *hw, *hdy;
    struct tensor *x = trand(DT_BF16, nx, -1, 1, &hx), *w = trand(DT_BF16, nw, -1, 1, &hw);
    struct tensor *dy = trand(DT_BF16, ny, -1, 1, &hdy);
    struct tensor *dx = tnew(DT_BF16, nx), *dw = tnew(DT_FP32, nw);
    be->conv2d_backward_data(be, &a, dx, dy, w);
    be->conv2d_backward_filter(be, &a, dw, NULL, dy, x, 0.0f);
    /* direct adjoints in double over the rounded inputs */
    double *gx = dalloc(nx), *gw = dalloc(nw);
    int64_t k = a.kernel;
    for (int64_t n = 0; n < a.n; n++)
        for (int64_t co = 0; co < a.c_out; co++)
            for (int64_t oh = 0; oh < a.h_out; oh++)
                for (int64_t ow = 0; ow < a.w_out; ow++) {
                    double g = hdy[((n * a.c_out + co) * a.h_out + oh) * a.w_out + ow];
                    for (int64_t ci = 0; ci < a.c_in; ci++)
                        for (int64_t kh = 0; kh < k; kh++)
                            for (int64_t kw = 0; kw < k; kw++) {
                                int64_t ih = oh * a.stride - a.padding + kh, iw = ow * a.stride - a.padding + kw;
                                if (ih < 0 || ih >= a.h_in || iw < 0 || iw >= a.w_in)
                                    continue;
                                size_t wi = (size_t)(((co * a.c_in + ci) * k + kh) * k + kw);
                                gx[((n * a.c_in + ci) * a.h_in + ih) * a.w_in + iw] += g * hw[wi];
                                gw[wi] += g * x_at(hx, &a, n, ci, ih, iw);
                            }
                }
    check_lowp(dx, gx, nx, 1, 1e-6, "conv2d_backward_data bf16");
    check_f32(dw, gw, nw, 1e-5, 1e-5, "conv2d_backward_filter from bf16");
}

/* The bias gradient: each image's plane of dy summed in double in plane order (8 channels at a time as vector
 * lanes where the CPU has AVX-512, the rest one by one), the images' sums added in image order, rounded to fp32
 * once. Planes open with 2^60, seven 200s and -2^60 (as in batchnorm_sums_in_their_documented_order: another
 * order of the first eight keeps a different number of the 200s); 19 channels (two vector groups and 3 alone),
 * planes of 25 and 16 elements (a tail and none), fp32 and bf16, and a size that runs on the pool. */
Test(backend_cpu, conv2d_bias_gradient_sums_planes_in_order)
{
    seed(20);
    const int64_t shapes[3][8] = { { 3, 2, 5, 5, 19, 3, 1, 1 }, { 2, 3, 4, 4, 19, 3, 1, 1 },
                                   { 4, 16, 14, 14, 16, 3, 1, 1 } };
    const enum dtype dts[2] = { DT_FP32, DT_BF16 };
    for (int sh = 0; sh < 3; sh++)
        for (int d = 0; d < 2; d++) {
            struct conv_args a = conv_row(shapes[sh]);
            const int64_t hw = a.h_out * a.w_out;
            size_t nx = (size_t)(a.n * a.c_in * a.h_in * a.w_in), nw = (size_t)(a.c_out * a.c_in * a.kernel * a.kernel);
            size_t ny = (size_t)(a.n * a.c_out * hw);
            float *hdy = falloc(ny);
            for (size_t k = 0; k < ny; k++) {
                int64_t q = (int64_t)(k % (size_t)hw);
                hdy[k] = q == 0 ? 0x1p60f : q < 8 ? 200.0f : q == 8 ? -0x1p60f : frand(-7, 9);
            }
            struct tensor *x = trand(dts[d], nx, -1, 1, NULL), *dy = tfrom(dts[d], ny, hdy);
            struct tensor *dw = tnew(DT_FP32, nw), *db = tnew(DT_FP32, (size_t)a.c_out);
            be->conv2d_backward_filter(be, &a, dw, db, dy, x, 0.0f);
            const float *fb = db->data;
            for (int64_t co = 0; co < a.c_out; co++) {
                double acc = 0;
                for (int64_t i = 0; i < a.n; i++) {
                    double s = 0;
                    for (int64_t q = 0; q < hw; q++)
                        s += hdy[(i * a.c_out + co) * hw + q];
                    acc += s;
                }
                float want = (float)acc;
                cr_assert(memcmp(&fb[co], &want, sizeof want) == 0, "%s shape %d channel %lld: db %.9g, want %.9g",
                          dts[d] == DT_FP32 ? "fp32" : "bf16", sh, (long long)co, (double)fb[co], (double)want);
            }
        }
}

/* The filter gradient has the bits of the image-by-image accumulation of the backend's own products, dW = dy_0 @
 * col_0^T, then dW = 1 * dW + dy_i @ col_i^T (backend.h; docs/backend.md), whichever way the product is formed:
 * few input channels (c_in 1: 32 x 9 products) are formed transposed on the AVX-512 path and transposed back
 * (conv_filter_transposed), which must not move a bit; fp32 and bf16; one size on the calling thread, one on the
 * pool; beta 0 and beta 1 (onto a dW that is there). */
Test(backend_cpu, conv2d_filter_gradient_is_the_accumulated_products)
{
    seed(21);
    const int64_t shapes[3][8] = { { 3, 1, 6, 6, 32, 3, 1, 1 }, { 8, 1, 28, 28, 32, 3, 1, 1 },
                                   { 2, 3, 5, 5, 16, 3, 1, 1 } };
    const enum dtype dts[2] = { DT_FP32, DT_BF16 };
    for (int sh = 0; sh < 3; sh++)
        for (int d = 0; d < 2; d++)
            for (int beta1 = 0; beta1 < 2; beta1++) {
                struct conv_args a = conv_row(shapes[sh]);
                const int64_t hw = a.h_out * a.w_out, k = a.kernel, ckk = a.c_in * k * k;
                const int64_t chw_in = a.c_in * a.h_in * a.w_in;
                size_t nx = (size_t)(a.n * chw_in), ny = (size_t)(a.n * a.c_out * hw), nw = (size_t)(a.c_out * ckk);
                float *hx, *hdy, *hw0;
                struct tensor *x = trand(dts[d], nx, -1, 1, &hx), *dy = trand(dts[d], ny, -1, 1, &hdy);
                struct tensor *dw = trand(DT_FP32, nw, -1, 1, &hw0), *want = tfrom(DT_FP32, nw, hw0);
                be->conv2d_backward_filter(be, &a, dw, NULL, dy, x, beta1 ? 1.0f : 0.0f);
                float *col = falloc((size_t)(ckk * hw));
                for (int64_t i = 0; i < a.n; i++) {
                    for (int64_t ci = 0; ci < a.c_in; ci++)
                        for (int64_t kh = 0; kh < k; kh++)
                            for (int64_t kw = 0; kw < k; kw++)
                                for (int64_t oh = 0; oh < a.h_out; oh++)
                                    for (int64_t ow = 0; ow < a.w_out; ow++) {
                                        int64_t ih = oh * a.stride - a.padding + kh, iw = ow * a.stride - a.padding + kw;
                                        bool in = ih >= 0 && ih < a.h_in && iw >= 0 && iw < a.w_in;
                                        col[((ci * k + kh) * k + kw) * hw + oh * a.w_out + ow] =
                                            in ? hx[i * chw_in + (ci * a.h_in + ih) * a.w_in + iw] : 0.0f;
                                    }
                    struct tensor *ct = tfrom(dts[d], (size_t)(ckk * hw), col);
                    struct tensor *dyi = tfrom(dts[d], (size_t)(a.c_out * hw), hdy + i * a.c_out * hw);
                    struct gemm_args g = { .a = dyi, .b = ct, .c = want, .trans_b = true, .m = a.c_out, .n = ckk,
                                           .k = hw, .alpha = 1.0f, .beta = i == 0 && !beta1 ? 0.0f : 1.0f,
                                           .batch = 1 };
                    be->gemm(be, &g);
                }
                const float *got = dw->data, *exp = want->data;
                for (size_t e = 0; e < nw; e++)
                    cr_assert(memcmp(&got[e], &exp[e], sizeof(float)) == 0,
                              "%s shape %d beta %d: dW[%zu] %.9g, the accumulated products %.9g",
                              dts[d] == DT_FP32 ? "fp32" : "bf16", sh, beta1, e, (double)got[e], (double)exp[e]);
            }
}

/* The forward's bias is added once, after the product's whole sum, and rounded with it: y with a bias is, to the
 * bit, fp32(y without it + bias[channel]) (the product's sum is fp32 already). Shapes with one k block and with
 * two (ckk 288), one on the pool. */
Test(backend_cpu, conv2d_bias_is_added_once_after_the_sum)
{
    seed(22);
    const int64_t shapes[3][8] = { { 2, 1, 6, 6, 32, 3, 1, 1 }, { 2, 32, 5, 5, 12, 3, 1, 1 },
                                   { 8, 1, 28, 28, 32, 3, 1, 1 } };
    for (int sh = 0; sh < 3; sh++) {
        struct conv_args a = conv_row(shapes[sh]);
        const int64_t hw = a.h_out * a.w_out;
        size_t nx = (size_t)(a.n * a.c_in * a.h_in * a.w_in), nw = (size_t)(a.c_out * a.c_in * a.kernel * a.kernel);
        size_t ny = (size_t)(a.n * a.c_out * hw);
        float *hb;
        struct tensor *x = trand(DT_FP32, nx, -1, 1, NULL), *w = trand(DT_FP32, nw, -1, 1, NULL);
        struct tensor *b = trand(DT_FP32, (size_t)a.c_out, -1, 1, &hb);
        struct tensor *y = tnew(DT_FP32, ny), *y0 = tnew(DT_FP32, ny);
        be->conv2d_forward(be, &a, y, x, w, b);
        be->conv2d_forward(be, &a, y0, x, w, NULL);
        const float *got = y->data, *sum = y0->data;
        for (size_t e = 0; e < ny; e++) {
            float want = sum[e] + hb[(e / (size_t)hw) % (size_t)a.c_out];
            cr_assert(memcmp(&got[e], &want, sizeof want) == 0, "shape %d: y[%zu] %.9g, want %.9g", sh, e,
                      (double)got[e], (double)want);
        }
    }
}

/* ---- pooling ----------------------------------------------------------------------------------- */

static void pool_naive(const struct pool_args *a, const float *x, double *y, int64_t *argmax)
{
    for (int64_t pl = 0; pl < a->n * a->c; pl++)
        for (int64_t oh = 0; oh < a->h_out; oh++)
            for (int64_t ow = 0; ow < a->w_out; ow++) {
                double best = -INFINITY, sum = 0;
                int64_t bi = -1;
                for (int64_t kh = 0; kh < a->kernel; kh++)
                    for (int64_t kw = 0; kw < a->kernel; kw++) {
                        int64_t ih = oh * a->stride - a->padding + kh, iw = ow * a->stride - a->padding + kw;
                        if (ih < 0 || ih >= a->h_in || iw < 0 || iw >= a->w_in)
                            continue;
                        double v = x[(pl * a->h_in + ih) * a->w_in + iw];
                        sum += v;
                        if (bi < 0 || v > best) {
                            best = v;
                            bi = (pl * a->h_in + ih) * a->w_in + iw;
                        }
                    }
                size_t o = (size_t)((pl * a->h_out + oh) * a->w_out + ow);
                y[o] = a->kind == POOL_MAX ? best : sum / (double)(a->kernel * a->kernel);
                if (argmax)
                    argmax[o] = bi;
            }
}

static struct pool_args pool_shape(enum pool_kind kind, int64_t n, int64_t c, int64_t h, int64_t w, int64_t k,
                                   int64_t s, int64_t p)
{
    return (struct pool_args){ .kind = kind, .n = n, .c = c, .h_in = h, .w_in = w, .h_out = (h + 2 * p - k) / s + 1,
                               .w_out = (w + 2 * p - k) / s + 1, .kernel = k, .stride = s, .padding = p };
}

Test(backend_cpu, pool2d_forward_and_backward)
{
    seed(13);
    int64_t cases[4][3] = { { 2, 2, 0 }, { 3, 2, 1 }, { 3, 1, 1 }, { 2, 1, 0 } }; /* kernel, stride, padding */
    enum dtype dts[2] = { DT_FP32, DT_BF16 };
    for (int kind = 0; kind < 2; kind++)
        for (int cs = 0; cs < 4; cs++)
            for (int d = 0; d < 2; d++) {
                struct pool_args a = pool_shape(kind ? POOL_AVG : POOL_MAX, 2, 3, 6, 5, cases[cs][0], cases[cs][1],
                                                cases[cs][2]);
                size_t nx = (size_t)(a.n * a.c * a.h_in * a.w_in), ny = (size_t)(a.n * a.c * a.h_out * a.w_out);
                float *hx, *hdy;
                struct tensor *x = trand(dts[d], nx, -3, 3, &hx), *y = tnew(dts[d], ny);
                be->pool2d_forward(be, &a, y, x);
                double *want = dalloc(ny);
                int64_t *arg = talloc(ny * sizeof(int64_t));
                pool_naive(&a, hx, want, arg);
                check_out(y, want, ny, 1e-6, 1e-7, kind ? "avgpool forward" : "maxpool forward");

                struct tensor *dy = trand(dts[d], ny, -1, 1, &hdy), *dx = tnew(dts[d], nx);
                be->pool2d_backward(be, &a, dx, dy, x, y);
                double *gx = dalloc(nx);
                for (int64_t pl = 0; pl < a.n * a.c; pl++)
                    for (int64_t oh = 0; oh < a.h_out; oh++)
                        for (int64_t ow = 0; ow < a.w_out; ow++) {
                            size_t o = (size_t)((pl * a.h_out + oh) * a.w_out + ow);
                            if (a.kind == POOL_MAX) {
                                gx[arg[o]] += hdy[o];
                                continue;
                            }
                            for (int64_t kh = 0; kh < a.kernel; kh++)
                                for (int64_t kw = 0; kw < a.kernel; kw++) {
                                    int64_t ih = oh * a.stride - a.padding + kh, iw = ow * a.stride - a.padding + kw;
                                    if (ih >= 0 && ih < a.h_in && iw >= 0 && iw < a.w_in)
                                        gx[(pl * a.h_in + ih) * a.w_in + iw] +=
                                            hdy[o] / (double)(a.kernel * a.kernel);
                                }
                        }
                check_out(dx, gx, nx, 1e-5, 1e-6, kind ? "avgpool backward" : "maxpool backward");
            }
}

Test(backend_cpu, maxpool_ties_go_to_the_first_element)
{
    /* one 2x2 window of equal values, then a window where padding (-inf) surrounds negatives */
    float hx[4] = { 5, 5, 5, 5 };
    struct pool_args a = pool_shape(POOL_MAX, 1, 1, 2, 2, 2, 2, 0);
    struct tensor *x = tfrom(DT_FP32, 4, hx), *y = tnew(DT_FP32, 1), *dx = tnew(DT_FP32, 4);
    float one = 1;
    struct tensor *dy = tfrom(DT_FP32, 1, &one);
    be->pool2d_forward(be, &a, y, x);
    be->pool2d_backward(be, &a, dx, dy, x, y);
    check_f32(y, (double[]){ 5 }, 1, 0, 0, "max of ties");
    check_f32(dx, (double[]){ 1, 0, 0, 0 }, 4, 0, 0, "gradient to the first max");

    float neg[4] = { -3, -1, -2, -4 };
    struct pool_args p = pool_shape(POOL_MAX, 1, 1, 2, 2, 3, 1, 1); /* 2x2 output, each window padded */
    struct tensor *xn = tfrom(DT_FP32, 4, neg), *yn = tnew(DT_FP32, 4);
    be->pool2d_forward(be, &p, yn, xn);
    check_f32(yn, (double[]){ -1, -1, -1, -1 }, 4, 0, 0, "padding is -inf for max");
    struct pool_args av = pool_shape(POOL_AVG, 1, 1, 2, 2, 3, 1, 1);
    be->pool2d_forward(be, &av, yn, xn);
    check_f32(yn, (double[]){ -10.0 / 9, -10.0 / 9, -10.0 / 9, -10.0 / 9 }, 4, 1e-6, 0,
              "avg counts the padding in the divisor");
}

/* 2x2 / stride 2 windows over rows of every width the vectorised paths split differently (one partial group
 * of 16 windows, one whole, a whole and a partial, several; 14 and 7 windows as in fashion_cnn), values drawn
 * from a few (ties everywhere) and NaNs, in fp32 and bf16: each window's gradient lands where PyTorch's CPU rule
 * puts the max (the first of equal values in row-major order, or the last NaN), as 0 + dy (a -0 gradient gives
 * +0, as the generic path's add to a zeroed plane gives it; every bit compared), and y holds that value. */
Test(backend_cpu, maxpool_2x2_on_wide_rows_follows_the_rule_exactly)
{
    seed(29);
    const float pick[5] = { -1.0f, 0.0f, 1.0f, 2.0f, NAN };
    const float grads[4] = { 1.0f, -0.0f, -2.5f, 0.375f };
    const int64_t widths[7] = { 28, 32, 34, 66, 100, 14, 2 };
    const enum dtype dts[2] = { DT_FP32, DT_BF16 };
    for (int d = 0; d < 2; d++)
    for (int wi = 0; wi < 7; wi++) {
        struct pool_args a = pool_shape(POOL_MAX, 2, 3, widths[wi] == 2 ? 2 : 6, widths[wi], 2, 2, 0);
        size_t nx = (size_t)(a.n * a.c * a.h_in * a.w_in), ny = (size_t)(a.n * a.c * a.h_out * a.w_out);
        float *hx = falloc(nx), *ones = falloc(ny);
        for (size_t i = 0; i < nx; i++)
            hx[i] = pick[(int)(urand() * 5)];
        for (size_t i = 0; i < ny; i++)
            ones[i] = grads[(int)(urand() * 4)];
        struct tensor *x = tfrom(dts[d], nx, hx), *y = tnew(dts[d], ny), *dx = tnew(dts[d], nx);
        struct tensor *dy = tfrom(dts[d], ny, ones);
        be->pool2d_forward(be, &a, y, x);
        be->pool2d_backward(be, &a, dx, dy, x, y);
        const float *gy = thost(y), *gdx = thost(dx);
        float *want_dx = falloc(nx);
        memset(want_dx, 0, nx * sizeof(float));
        for (int64_t pl = 0; pl < a.n * a.c; pl++)
            for (int64_t oh = 0; oh < a.h_out; oh++)
                for (int64_t ow = 0; ow < a.w_out; ow++) {
                    int64_t bi = -1;
                    float best = 0;
                    for (int64_t kh = 0; kh < 2; kh++)
                        for (int64_t kw = 0; kw < 2; kw++) {
                            int64_t i = (pl * a.h_in + 2 * oh + kh) * a.w_in + 2 * ow + kw;
                            if (bi < 0 || hx[i] > best || isnan(hx[i])) {
                                best = hx[i];
                                bi = i;
                            }
                        }
                    want_dx[bi] += ones[(pl * a.h_out + oh) * a.w_out + ow];
                    float got = gy[(pl * a.h_out + oh) * a.w_out + ow];
                    cr_assert(isnan(best) ? isnan(got) : got == best, "width %lld, plane %lld, window (%lld, %lld): y %g, want %g",
                              (long long)a.w_in, (long long)pl, (long long)oh, (long long)ow, (double)got, (double)best);
                }
        for (size_t i = 0; i < nx; i++)
            cr_assert_eq(memcmp(&gdx[i], &want_dx[i], sizeof(float)), 0,
                         "%s width %lld: dx[%zu] = %g, want %g (the max's position, 0 + dy)",
                         dts[d] == DT_BF16 ? "bf16" : "fp32", (long long)a.w_in, i, (double)gdx[i], (double)want_dx[i]);
    }
}

/* A NaN in a window wins (PyTorch propagates it), the last one when there are several, and backward
 * sends the window's gradient there: on windows inside the plane and on padded ones alike. */
Test(backend_cpu, maxpool_propagates_nan)
{
    float hx[16] = { 1, NAN, 0, 7,   /* windows (2x2, stride 2): [1 NaN; 2 3] -> NaN at 1 */
                     2, 3, 9, 8,     /*                          [0 7; 9 8] -> 9 at 6 */
                     NAN, 5, 4, 4,   /*                          [NaN 5; 6 NaN] -> the last NaN, at 13 */
                     6, NAN, 4, 4 }; /*                          [4 4; 4 4] -> the first 4, at 10 */
    struct pool_args a = pool_shape(POOL_MAX, 1, 1, 4, 4, 2, 2, 0);
    struct tensor *x = tfrom(DT_FP32, 16, hx), *y = tnew(DT_FP32, 4), *dx = tnew(DT_FP32, 16);
    float hg[4] = { 1, 2, 3, 4 };
    struct tensor *dy = tfrom(DT_FP32, 4, hg);
    be->pool2d_forward(be, &a, y, x);
    const float *hy = y->data;
    cr_assert(isnan(hy[0]) && hy[1] == 9 && isnan(hy[2]) && hy[3] == 4, "%g %g %g %g", (double)hy[0],
              (double)hy[1], (double)hy[2], (double)hy[3]);
    be->pool2d_backward(be, &a, dx, dy, x, y);
    double want[16] = { 0 };
    want[1] = 1, want[6] = 2, want[13] = 3, want[10] = 4;
    check_f32(dx, want, 16, 0, 0, "maxpool backward to the NaN / first maximum");

    struct pool_args p = pool_shape(POOL_MAX, 1, 1, 4, 4, 3, 1, 1); /* padded windows at the border */
    struct tensor *yp = tnew(DT_FP32, 16);
    be->pool2d_forward(be, &p, yp, x);
    cr_assert(isnan(((float *)yp->data)[0]), "a padded window holding a NaN gives NaN");
}

/* ---- layernorm --------------------------------------------------------------------------------- */

static void ln_naive(const double *x, const double *g, const double *b, int64_t rows, int64_t cols, double eps,
                     double *y)
{
    for (int64_t r = 0; r < rows; r++) {
        const double *xr = x + r * cols;
        double mu = 0, var = 0;
        for (int64_t j = 0; j < cols; j++)
            mu += xr[j];
        mu /= (double)cols;
        for (int64_t j = 0; j < cols; j++)
            var += (xr[j] - mu) * (xr[j] - mu);
        var /= (double)cols;
        for (int64_t j = 0; j < cols; j++)
            y[r * cols + j] = (xr[j] - mu) / sqrt(var + eps) * g[j] + b[j];
    }
}

struct ln_ctx {
    int64_t rows, cols;
    double eps;
    const double *x, *g, *b, *gy;
};

static double ln_loss(const double *x, const double *g, const double *b, const struct ln_ctx *c)
{
    size_t n = (size_t)(c->rows * c->cols);
    double *y = malloc(n * sizeof(double));
    ln_naive(x, g, b, c->rows, c->cols, c->eps, y);
    double s = dot(y, c->gy, n);
    free(y);
    return s;
}

static double ln_loss_x(const double *x, void *c)
{
    return ln_loss(x, ((struct ln_ctx *)c)->g, ((struct ln_ctx *)c)->b, c);
}

static double ln_loss_g(const double *g, void *c)
{
    return ln_loss(((struct ln_ctx *)c)->x, g, ((struct ln_ctx *)c)->b, c);
}

static double ln_loss_b(const double *b, void *c)
{
    return ln_loss(((struct ln_ctx *)c)->x, ((struct ln_ctx *)c)->g, b, c);
}

Test(backend_cpu, layernorm_forward_backward)
{
    seed(14);
    int64_t rows = 6, cols = 10;
    size_t n = (size_t)(rows * cols);
    struct norm_args a = { .rows = rows, .cols = cols, .eps = 1e-5f };
    float *hx, *hg, *hb, *hdy, *hdg0, *hdb0;
    struct tensor *x = trand(DT_FP32, n, -2, 3, &hx), *g = trand(DT_FP32, (size_t)cols, 0.5f, 1.5f, &hg);
    struct tensor *b = trand(DT_FP32, (size_t)cols, -1, 1, &hb);
    struct tensor *mean = tnew(DT_FP32, (size_t)rows), *rstd = tnew(DT_FP32, (size_t)rows);
    enum dtype outs[3] = { DT_FP32, DT_FP16, DT_BF16 };
    double *want = dalloc(n);
    ln_naive(to_d(hx, n), to_d(hg, (size_t)cols), to_d(hb, (size_t)cols), rows, cols, a.eps, want);
    for (int o = 0; o < 3; o++) {
        struct tensor *y = tnew(outs[o], n);
        be->layernorm_forward(be, &a, y, mean, rstd, x, g, b);
        check_out(y, want, n, 1e-5, 1e-5, "layernorm_forward");
    }
    for (int64_t r = 0; r < rows; r++) {
        double mu = 0, var = 0;
        for (int64_t j = 0; j < cols; j++)
            mu += hx[r * cols + j];
        mu /= (double)cols;
        for (int64_t j = 0; j < cols; j++)
            var += (hx[r * cols + j] - mu) * (hx[r * cols + j] - mu);
        var /= (double)cols;
        cr_assert(fabs(((float *)mean->data)[r] - mu) < 1e-6);
        cr_assert(fabs(((float *)rstd->data)[r] - 1 / sqrt(var + a.eps)) < 1e-5 / sqrt(var + a.eps));
    }

    struct tensor *dy = trand(DT_FP32, n, -1, 1, &hdy), *dx = tnew(DT_FP32, n);
    struct tensor *dg = trand(DT_FP32, (size_t)cols, -1, 1, &hdg0), *db = trand(DT_FP32, (size_t)cols, -1, 1, &hdb0);
    be->layernorm_backward(be, &a, dx, dg, db, dy, x, mean, rstd, g, 1.0f);
    struct ln_ctx c = { rows, cols, a.eps, to_d(hx, n), to_d(hg, (size_t)cols), to_d(hb, (size_t)cols), to_d(hdy, n) };
    double *gx = dalloc(n), *gg = dalloc((size_t)cols), *gb = dalloc((size_t)cols);
    fd_grad(ln_loss_x, &c, to_d(hx, n), n, 1e-6, gx);
    fd_grad(ln_loss_g, &c, to_d(hg, (size_t)cols), (size_t)cols, 1e-6, gg);
    fd_grad(ln_loss_b, &c, to_d(hb, (size_t)cols), (size_t)cols, 1e-6, gb);
    for (int64_t j = 0; j < cols; j++) {
        gg[j] += hdg0[j];
        gb[j] += hdb0[j];
    }
    check_f32(dx, gx, n, 1e-4, 1e-5, "layernorm dx");
    check_f32(dg, gg, (size_t)cols, 1e-4, 1e-5, "layernorm dgamma (beta_acc 1)");
    check_f32(db, gb, (size_t)cols, 1e-4, 1e-5, "layernorm dbeta (beta_acc 1)");
    /* beta_acc 0 overwrites; a bf16 dx is the fp32 one rounded once */
    struct tensor *dg0 = tnew(DT_FP32, (size_t)cols), *dx16 = tnew(DT_BF16, n);
    be->layernorm_backward(be, &a, dx16, dg0, NULL, dy, x, mean, rstd, g, 0.0f);
    for (int64_t j = 0; j < cols; j++)
        gg[j] -= hdg0[j];
    check_f32(dg0, gg, (size_t)cols, 1e-4, 1e-5, "layernorm dgamma (beta_acc 0)");
    check_lowp(dx16, to_d(dx->data, n), n, 1, 0, "layernorm dx bf16");
}

Test(backend_cpu, layernorm_all_equal_row_is_finite)
{
    /* docs/backend.md: an all-zero (or constant) LayerNorm input must not give NaN: var 0, eps keeps rstd finite */
    int64_t rows = 2, cols = 8;
    float hx[16] = { 0 };
    for (int j = 0; j < 8; j++)
        hx[8 + j] = 3.0f;
    float hg[8], hb[8], hdy[16];
    for (int j = 0; j < 8; j++) {
        hg[j] = 1.0f + (float)j;
        hb[j] = 0.25f * (float)j;
    }
    for (int i = 0; i < 16; i++)
        hdy[i] = (float)(i % 5) - 2.0f;
    struct norm_args a = { .rows = rows, .cols = cols, .eps = 1e-5f };
    enum dtype dts[2] = { DT_FP32, DT_FP16 };
    for (int d = 0; d < 2; d++) {
        struct tensor *x = tfrom(dts[d], 16, hx), *g = tfrom(DT_FP32, 8, hg), *b = tfrom(DT_FP32, 8, hb);
        struct tensor *y = tnew(dts[d], 16), *mean = tnew(DT_FP32, 2), *rstd = tnew(DT_FP32, 2);
        be->layernorm_forward(be, &a, y, mean, rstd, x, g, b);
        float *hy = thost(y);
        for (int i = 0; i < 16; i++)
            cr_assert_eq(hy[i], hb[i % 8], "constant row -> y = beta, got %g at %d", (double)hy[i], i);
        cr_assert(isfinite(((float *)rstd->data)[0]));
        struct tensor *dy = tfrom(dts[d], 16, hdy), *dx = tnew(dts[d], 16), *dg = tnew(DT_FP32, 8);
        struct tensor *db = tnew(DT_FP32, 8);
        be->layernorm_backward(be, &a, dx, dg, db, dy, x, mean, rstd, g, 0.0f);
        float *hdx = thost(dx);
        for (int i = 0; i < 16; i++)
            cr_assert(isfinite(hdx[i]), "dx[%d] = %g", i, (double)hdx[i]);
    }
}

/* Layernorm's outputs and sums as kernels/cpu/backend_cpu.c documents them, computed here one row at a time: each
 * row's double sums over its columns in order (mean, then squared deviations; backward: dxhat and dxhat * xhat),
 * everything else in fp32, compared bit for bit. Rows in groups of 8 and a rest (the backend takes 8 rows as the
 * lanes of a vector), columns 8k and 8k + 5 (its tail), with gamma/beta and without, x and dy fp32 and bf16, y also
 * bf16 and fp16 (the fp32 y rounded once); every other row
 * opens with 2^60, seven 200s and -2^60, whose sum depends on the order (batchnorm_sums_in_their_documented_order),
 * the rest are random throughout (where the huge values would hide a wrong small term). */
Test(backend_cpu, layernorm_outputs_are_their_formulas_to_the_bit)
{
    seed(31);
    const int64_t rows = 19, colss[2] = { 128, 45 };
    const enum dtype dts[2] = { DT_FP32, DT_BF16 };
    for (int ci = 0; ci < 2; ci++)
        for (int d = 0; d < 2; d++)
            for (int affine = 0; affine <= 1; affine++) {
                const int64_t cols = colss[ci];
                const size_t cnt = (size_t)(rows * cols);
                float *hx = falloc(cnt), *hdy = falloc(cnt), *hg = falloc((size_t)cols), *hb = falloc((size_t)cols);
                for (size_t k = 0; k < cnt; k++) {
                    const int64_t q = (int64_t)(k % (size_t)cols), r = (int64_t)(k / (size_t)cols);
                    const float v = r % 2 ? frand(-3, 5) : q == 0 ? 0x1p60f : q < 8 ? 200.0f : q == 8 ? -0x1p60f
                                                                                                     : frand(-3, 5);
                    hx[k] = v;
                    hdy[k] = r % 2 == 0 && q < 9 ? v : frand(-7, 9);
                }
                for (int64_t q = 0; q < cols; q++) {
                    hg[q] = frand(0.5f, 1.5f);
                    hb[q] = frand(-1, 1);
                }
                struct norm_args a = { .rows = rows, .cols = cols, .eps = 1e-5f };
                struct tensor *x = tfrom(dts[d], cnt, hx), *dy = tfrom(dts[d], cnt, hdy);
                struct tensor *g = affine ? tfrom(DT_FP32, (size_t)cols, hg) : NULL;
                struct tensor *b = affine ? tfrom(DT_FP32, (size_t)cols, hb) : NULL;
                struct tensor *y = tnew(DT_FP32, cnt), *dx = tnew(DT_FP32, cnt);
                struct tensor *mean = tnew(DT_FP32, (size_t)rows), *rstd = tnew(DT_FP32, (size_t)rows);
                struct tensor *y16 = tnew(DT_BF16, cnt), *yh = tnew(DT_FP16, cnt);
                be->layernorm_forward(be, &a, y16, mean, rstd, x, g, b);
                be->layernorm_forward(be, &a, yh, mean, rstd, x, g, b);
                be->layernorm_forward(be, &a, y, mean, rstd, x, g, b);
                be->layernorm_backward(be, &a, dx, NULL, NULL, dy, x, mean, rstd, g, 0.0f);
                const float *gy = y->data, *gdx = dx->data, *gm = mean->data, *gr = rstd->data;
                /* a 16-bit y is the fp32 one rounded once (the transformer block stores ln1/ln2's output so:
                 * models/attention.c, ln_out_dtype) */
                for (size_t k = 0; k < cnt; k++)
                    cr_assert(((uint16_t *)y16->data)[k] == bf16_from_fp32(gy[k]) &&
                                  ((uint16_t *)yh->data)[k] == fp16_from_fp32(gy[k]),
                              "cols %lld %s affine %d element %zu: a 16-bit y is not the fp32 one rounded",
                              (long long)cols, dtype_name(dts[d]), affine, k);
                for (int64_t r = 0; r < rows; r++) {
                    const float *xr = hx + r * cols, *dyr = hdy + r * cols;
                    double s = 0.0, ss = 0.0, s1 = 0.0, s2 = 0.0;
                    for (int64_t q = 0; q < cols; q++)
                        s += xr[q];
                    const double mu = s / (double)cols;
                    for (int64_t q = 0; q < cols; q++) {
                        const double dd = xr[q] - mu;
                        ss += dd * dd;
                    }
                    const float mu_f = (float)mu, rs_f = (float)(1.0 / sqrt(ss / (double)cols + (double)a.eps));
                    cr_assert(memcmp(&gm[r], &mu_f, sizeof mu_f) == 0 && memcmp(&gr[r], &rs_f, sizeof rs_f) == 0,
                              "cols %lld %s affine %d row %lld: mean/rstd %a %a, want %a %a", (long long)cols,
                              dtype_name(dts[d]), affine, (long long)r, (double)gm[r], (double)gr[r], (double)mu_f,
                              (double)rs_f);
                    for (int64_t q = 0; q < cols; q++) {
                        const float xhat = (xr[q] - mu_f) * rs_f, dxhat = dyr[q] * (affine ? hg[q] : 1.0f);
                        s1 += dxhat;
                        s2 += (double)dxhat * xhat;
                    }
                    const float m1 = (float)(s1 / (double)cols), m2 = (float)(s2 / (double)cols);
                    for (int64_t q = 0; q < cols; q++) {
                        const float v = (xr[q] - mu_f) * rs_f, wy = v * (affine ? hg[q] : 1.0f) + (affine ? hb[q] : 0.0f);
                        const float xhat = (xr[q] - mu_f) * rs_f, dxhat = dyr[q] * (affine ? hg[q] : 1.0f);
                        const float wdx = rs_f * (dxhat - m1 - xhat * m2);
                        cr_assert(memcmp(&gy[r * cols + q], &wy, sizeof wy) == 0 &&
                                      memcmp(&gdx[r * cols + q], &wdx, sizeof wdx) == 0,
                                  "cols %lld %s affine %d row %lld col %lld: y %a dx %a, want %a %a", (long long)cols,
                                  dtype_name(dts[d]), affine, (long long)r, (long long)q, (double)gy[r * cols + q],
                                  (double)gdx[r * cols + q], (double)wy, (double)wdx);
                    }
                }
            }
}

/* ---- batchnorm --------------------------------------------------------------------------------- */

static void bn_naive(const double *x, const double *g, const double *b, int64_t n, int64_t c, int64_t hw, double eps,
                     double *y)
{
    for (int64_t ch = 0; ch < c; ch++) {
        double mu = 0, var = 0, cnt = (double)(n * hw);
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j < hw; j++)
                mu += x[(i * c + ch) * hw + j];
        mu /= cnt;
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j < hw; j++)
                var += (x[(i * c + ch) * hw + j] - mu) * (x[(i * c + ch) * hw + j] - mu);
        var /= cnt;
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j < hw; j++)
                y[(i * c + ch) * hw + j] = (x[(i * c + ch) * hw + j] - mu) / sqrt(var + eps) * g[ch] + b[ch];
    }
}

struct bn_ctx {
    int64_t n, c, hw;
    double eps;
    const double *x, *g, *b, *gy;
};

static double bn_loss(const double *x, const double *g, const double *b, const struct bn_ctx *c)
{
    size_t cnt = (size_t)(c->n * c->c * c->hw);
    double *y = malloc(cnt * sizeof(double));
    bn_naive(x, g, b, c->n, c->c, c->hw, c->eps, y);
    double s = dot(y, c->gy, cnt);
    free(y);
    return s;
}

static double bn_loss_x(const double *x, void *c)
{
    return bn_loss(x, ((struct bn_ctx *)c)->g, ((struct bn_ctx *)c)->b, c);
}

static double bn_loss_g(const double *g, void *c)
{
    return bn_loss(((struct bn_ctx *)c)->x, g, ((struct bn_ctx *)c)->b, c);
}

Test(backend_cpu, batchnorm_running_stats_after_one_step)
{
    /* one channel, values 1 2 3 4 over (n=2, hw=2): mean 2.5, biased var 1.25, unbiased 5/3 */
    float hx[4] = { 1, 2, 3, 4 }, hg = 1, hb = 0, rm0 = 0, rv0 = 1;
    struct tensor *x = tfrom(DT_FP32, 4, hx), *g = tfrom(DT_FP32, 1, &hg), *b = tfrom(DT_FP32, 1, &hb);
    struct tensor *rm = tfrom(DT_FP32, 1, &rm0), *rv = tfrom(DT_FP32, 1, &rv0);
    struct tensor *y = tnew(DT_FP32, 4), *mean = tnew(DT_FP32, 1), *rstd = tnew(DT_FP32, 1);
    struct norm_args a = { .n = 2, .c = 1, .hw = 2, .eps = 1e-5f, .momentum = 0.1f, .training = true };
    be->batchnorm_forward(be, &a, y, mean, rstd, rm, rv, x, g, b);
    check_f32(rm, (double[]){ 0.1 * 2.5 }, 1, 1e-6, 0, "running_mean");
    check_f32(rv, (double[]){ 0.9 * 1.0 + 0.1 * (5.0 / 3.0) }, 1, 1e-6, 0, "running_var (unbiased)");
    check_f32(mean, (double[]){ 2.5 }, 1, 1e-7, 0, "saved mean");
    check_f32(rstd, (double[]){ 1 / sqrt(1.25 + 1e-5) }, 1, 1e-6, 0, "saved rstd (biased var)");
    double s = 1 / sqrt(1.25 + 1e-5);
    check_f32(y, (double[]){ -1.5 * s, -0.5 * s, 0.5 * s, 1.5 * s }, 4, 1e-6, 0, "training output");

    /* eval: the running statistics normalise */
    struct norm_args e = a;
    e.training = false;
    struct tensor *ye = tnew(DT_FP32, 4);
    be->batchnorm_forward(be, &e, ye, NULL, NULL, rm, rv, x, g, b);
    double rmv = 0.25, rvv = 0.9 + 0.1 * 5.0 / 3.0;
    double want[4];
    for (int i = 0; i < 4; i++)
        want[i] = (hx[i] - rmv) / sqrt(rvv + 1e-5);
    check_f32(ye, want, 4, 1e-6, 1e-7, "eval output");
    check_f32(rm, (double[]){ 0.25 }, 1, 1e-6, 0, "eval leaves running_mean");
}

Test(backend_cpu, batchnorm_forward_backward)
{
    seed(15);
    int64_t n = 3, c = 4, hw = 5;
    size_t cnt = (size_t)(n * c * hw);
    struct norm_args a = { .n = n, .c = c, .hw = hw, .eps = 1e-5f, .momentum = 0.1f, .training = true };
    float *hx, *hg, *hb, *hdy, *hdg0, *hdb0;
    struct tensor *x = trand(DT_FP32, cnt, -2, 3, &hx), *g = trand(DT_FP32, (size_t)c, 0.5f, 1.5f, &hg);
    struct tensor *b = trand(DT_FP32, (size_t)c, -1, 1, &hb);
    struct tensor *rm = tnew(DT_FP32, (size_t)c), *rv = tnew(DT_FP32, (size_t)c);
    be->zero(be, rm);
    be->zero(be, rv);
    struct tensor *mean = tnew(DT_FP32, (size_t)c), *rstd = tnew(DT_FP32, (size_t)c);
    double *want = dalloc(cnt);
    bn_naive(to_d(hx, cnt), to_d(hg, (size_t)c), to_d(hb, (size_t)c), n, c, hw, a.eps, want);
    enum dtype outs[2] = { DT_FP32, DT_BF16 };
    for (int o = 0; o < 2; o++) {
        struct tensor *y = tnew(outs[o], cnt);
        be->batchnorm_forward(be, &a, y, mean, rstd, rm, rv, x, g, b);
        check_out(y, want, cnt, 1e-5, 1e-5, "batchnorm_forward");
    }
    struct tensor *dy = trand(DT_FP32, cnt, -1, 1, &hdy), *dx = tnew(DT_FP32, cnt);
    struct tensor *dg = trand(DT_FP32, (size_t)c, -1, 1, &hdg0), *db = trand(DT_FP32, (size_t)c, -1, 1, &hdb0);
    be->batchnorm_backward(be, &a, dx, dg, db, dy, x, NULL, mean, rstd, g, 1.0f);
    struct bn_ctx ctx = { n, c, hw, a.eps, to_d(hx, cnt), to_d(hg, (size_t)c), to_d(hb, (size_t)c), to_d(hdy, cnt) };
    double *gx = dalloc(cnt), *gg = dalloc((size_t)c), *gb = dalloc((size_t)c);
    fd_grad(bn_loss_x, &ctx, to_d(hx, cnt), cnt, 1e-6, gx);
    fd_grad(bn_loss_g, &ctx, to_d(hg, (size_t)c), (size_t)c, 1e-6, gg);
    for (int64_t ch = 0; ch < c; ch++) {
        gg[ch] += hdg0[ch];
        gb[ch] += hdb0[ch];
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j < hw; j++)
                gb[ch] += hdy[(i * c + ch) * hw + j];
    }
    check_f32(dx, gx, cnt, 1e-4, 1e-5, "batchnorm dx");
    check_f32(dg, gg, (size_t)c, 1e-4, 1e-5, "batchnorm dgamma (beta_acc 1)");
    check_f32(db, gb, (size_t)c, 1e-5, 1e-6, "batchnorm dbeta (beta_acc 1)");
    /* beta_acc 0 overwrites (poisoned outputs); eval mode: dx = dy * gamma * rstd */
    struct tensor *dg0 = tnew(DT_FP32, (size_t)c), *db0 = tnew(DT_FP32, (size_t)c), *dx16 = tnew(DT_BF16, cnt);
    be->batchnorm_backward(be, &a, dx16, dg0, db0, dy, x, NULL, mean, rstd, g, 0.0f);
    for (int64_t ch = 0; ch < c; ch++) {
        gg[ch] -= hdg0[ch];
        gb[ch] -= hdb0[ch];
    }
    check_f32(dg0, gg, (size_t)c, 1e-4, 1e-5, "batchnorm dgamma (beta_acc 0)");
    check_f32(db0, gb, (size_t)c, 1e-5, 1e-6, "batchnorm dbeta (beta_acc 0)");
    check_lowp(dx16, to_d(dx->data, cnt), cnt, 1, 0, "batchnorm dx bf16");
    struct norm_args e = a;
    e.training = false;
    be->batchnorm_backward(be, &e, dx, NULL, NULL, dy, x, NULL, mean, rstd, g, 0.0f);
    double *ge = dalloc(cnt);
    for (int64_t i = 0; i < n; i++)
        for (int64_t ch = 0; ch < c; ch++)
            for (int64_t j = 0; j < hw; j++) {
                size_t k = (size_t)((i * c + ch) * hw + j);
                ge[k] = (double)hdy[k] * hg[ch] * ((float *)rstd->data)[ch];
            }
    check_f32(dx, ge, cnt, 1e-6, 1e-7, "batchnorm eval-mode dx");
}

/* The channel sums in their documented order (docs/backend.md): per channel, over the images in order and within
 * one over its plane in order, in double: s += x; then d = x - mean (double), ss += d * d; backward sdy += dy,
 * sdyx += (double)dy * ((x - mean_f) * rstd_f) (that product in fp32). 19 channels (two groups of 8, which the
 * AVX-512 path takes as vector lanes, and 3 more), planes of 13 (a tail past the last 8) and 16 elements; x and dy
 * in fp32 and bf16. mean, rstd, dgamma, dbeta must be these values to the bit. (The squared deviations' order
 * cannot show: positive terms, whose sum in any order is within n 2^-53 of the exact one, far below fp32's rstd.) */
Test(backend_cpu, batchnorm_sums_in_their_documented_order)
{
    seed(19);
    const int64_t n = 3, c = 19, hws[2] = { 13, 16 };
    const enum dtype dts[2] = { DT_FP32, DT_BF16 };
    for (int h = 0; h < 2; h++)
        for (int d = 0; d < 2; d++) {
            const int64_t hw = hws[h];
            size_t cnt = (size_t)(n * c * hw);
            struct norm_args a = { .n = n, .c = c, .hw = hw, .eps = 1e-5f, .momentum = 0.1f, .training = true };
            /* each plane opens with 2^60, seven 200s and -2^60: in order, every 200 rounds 2^60 + s up by a whole
             * ulp (256), while any other order of the first eight keeps less of them, and the difference survives
             * the cancellation and the rounding to fp32; the rest random */
            float *hx = falloc(cnt), *hdy = falloc(cnt), *hg;
            for (size_t k = 0; k < cnt; k++) {
                int64_t q = (int64_t)(k % (size_t)hw);
                float v = q == 0 ? 0x1p60f : q < 8 ? 200.0f : q == 8 ? -0x1p60f : frand(-3, 5);
                hx[k] = v;
                hdy[k] = q < 9 ? v : frand(-7, 9);
            }
            struct tensor *x = tfrom(dts[d], cnt, hx), *dy = tfrom(dts[d], cnt, hdy);
            struct tensor *g = trand(DT_FP32, (size_t)c, 0.5f, 1.5f, &hg), *b = trand(DT_FP32, (size_t)c, -1, 1, NULL);
            struct tensor *y = tnew(dts[d], cnt), *mean = tnew(DT_FP32, (size_t)c), *rstd = tnew(DT_FP32, (size_t)c);
            struct tensor *dx = tnew(dts[d], cnt), *dg = tnew(DT_FP32, (size_t)c), *db = tnew(DT_FP32, (size_t)c);
            be->batchnorm_forward(be, &a, y, mean, rstd, NULL, NULL, x, g, b);
            be->batchnorm_backward(be, &a, dx, dg, db, dy, x, NULL, mean, rstd, g, 0.0f);
            const float *fm = mean->data, *fr = rstd->data, *fg = dg->data, *fb = db->data;
            for (int64_t ch = 0; ch < c; ch++) {
                double sum = 0, ss = 0, sdy = 0, sdyx = 0, count = (double)(n * hw);
                for (int64_t i = 0; i < n; i++)
                    for (int64_t q = 0; q < hw; q++)
                        sum += hx[(i * c + ch) * hw + q];
                double mu = sum / count;
                for (int64_t i = 0; i < n; i++)
                    for (int64_t q = 0; q < hw; q++) {
                        double dd = hx[(i * c + ch) * hw + q] - mu;
                        ss += dd * dd;
                    }
                float mu_f = (float)mu, rs_f = (float)(1.0 / sqrt(ss / count + (double)a.eps));
                for (int64_t i = 0; i < n; i++)
                    for (int64_t q = 0; q < hw; q++) {
                        size_t k = (size_t)((i * c + ch) * hw + q);
                        sdy += hdy[k];
                        sdyx += (double)hdy[k] * ((hx[k] - mu_f) * rs_f);
                    }
                const char *what = dts[d] == DT_FP32 ? "fp32" : "bf16";
                cr_assert(memcmp(&fm[ch], &mu_f, sizeof mu_f) == 0, "%s hw %lld channel %lld: mean %.9g, want %.9g",
                          what, (long long)hw, (long long)ch, (double)fm[ch], (double)mu_f);
                cr_assert(memcmp(&fr[ch], &rs_f, sizeof rs_f) == 0, "%s hw %lld channel %lld: rstd %.9g, want %.9g",
                          what, (long long)hw, (long long)ch, (double)fr[ch], (double)rs_f);
                float want_g = (float)sdyx, want_b = (float)sdy;
                cr_assert(memcmp(&fg[ch], &want_g, sizeof want_g) == 0, "%s hw %lld channel %lld: dgamma %.9g, want %.9g",
                          what, (long long)hw, (long long)ch, (double)fg[ch], (double)want_g);
                cr_assert(memcmp(&fb[ch], &want_b, sizeof want_b) == 0, "%s hw %lld channel %lld: dbeta %.9g, want %.9g",
                          what, (long long)hw, (long long)ch, (double)fb[ch], (double)want_b);
            }
        }
}

/* A ReLU fused into batchnorm (norm_args.relu) gives the bits of the two ops one after the other: forward, y equal
 * to act_forward(relu) of the unfused y; backward, dx, dgamma, dbeta equal to batchnorm's backward of
 * act_backward(relu)'s gradient, with the fused forward's y as the mask. fp32, bf16, fp16; training and eval;
 * values at ReLU's edges: zeros of either sign out of the normalisation (a channel with gamma 0 and beta -0),
 * outputs that round to a signed zero in fp16 (gamma 1e-30), NaN and -0 in dy; 8 + 3 channels (the vector lanes
 * and the scalar chains) and a 13-element plane (a tail). */
Test(backend_cpu, batchnorm_with_relu_fused_is_the_two_ops)
{
    seed(23);
    const int64_t n = 3, c = 11, hw = 13;
    const size_t cnt = (size_t)(n * c * hw);
    const enum dtype dts[3] = { DT_FP32, DT_BF16, DT_FP16 };
    for (int d = 0; d < 3; d++)
        for (int training = 1; training >= 0; training--) {
            float *hx = falloc(cnt), *hdy = falloc(cnt), *hg = falloc((size_t)c), *hb = falloc((size_t)c);
            for (size_t k = 0; k < cnt; k++) {
                hx[k] = (k % 5 == 0) ? 1.0f : frand(-2, 2);
                hdy[k] = k % 17 == 3 ? NAN : k % 11 == 4 ? -0.0f : frand(-1, 1);
            }
            for (int64_t ch = 0; ch < c; ch++) {
                hg[ch] = ch == 2 ? 0.0f : ch == 4 ? 1e-30f : frand(0.5f, 1.5f);
                hb[ch] = ch == 2 ? -0.0f : ch == 4 ? 0.0f : frand(-0.5f, 0.5f);
            }
            struct tensor *x = tfrom(dts[d], cnt, hx), *dy = tfrom(dts[d], cnt, hdy);
            struct tensor *g = tfrom(DT_FP32, (size_t)c, hg), *b = tfrom(DT_FP32, (size_t)c, hb);
            struct tensor *rm = trand(DT_FP32, (size_t)c, -1, 1, NULL), *rv = trand(DT_FP32, (size_t)c, 0.5f, 2, NULL);
            struct tensor *rm2 = tnew(DT_FP32, (size_t)c), *rv2 = tnew(DT_FP32, (size_t)c);
            memcpy(rm2->data, rm->data, (size_t)c * sizeof(float));
            memcpy(rv2->data, rv->data, (size_t)c * sizeof(float));
            struct norm_args a = { .n = n, .c = c, .hw = hw, .eps = 1e-5f, .momentum = 0.1f, .training = training };
            struct norm_args f = a;
            f.relu = true;
            /* unfused: batchnorm, relu; relu's backward, batchnorm's */
            struct tensor *ybn = tnew(dts[d], cnt), *y = tnew(dts[d], cnt), *mean = tnew(DT_FP32, (size_t)c);
            struct tensor *rstd = tnew(DT_FP32, (size_t)c), *dr = tnew(dts[d], cnt), *dx = tnew(dts[d], cnt);
            struct tensor *dg = tnew(DT_FP32, (size_t)c), *db = tnew(DT_FP32, (size_t)c);
            be->batchnorm_forward(be, &a, ybn, mean, rstd, rm, rv, x, g, b);
            be->act_forward(be, ACT_RELU, y, ybn);
            be->act_backward(be, ACT_RELU, dr, dy, ybn);
            be->batchnorm_backward(be, &a, dx, dg, db, dr, x, NULL, mean, rstd, g, 0.0f);
            /* fused */
            struct tensor *yf = tnew(dts[d], cnt), *meanf = tnew(DT_FP32, (size_t)c), *rstdf = tnew(DT_FP32, (size_t)c);
            struct tensor *dxf = tnew(dts[d], cnt), *dgf = tnew(DT_FP32, (size_t)c), *dbf = tnew(DT_FP32, (size_t)c);
            be->batchnorm_forward(be, &f, yf, meanf, rstdf, rm2, rv2, x, g, b);
            be->batchnorm_backward(be, &f, dxf, dgf, dbf, dy, x, yf, meanf, rstdf, g, 0.0f);
            const size_t es = dtype_size(dts[d]);
            const char *what = dts[d] == DT_FP32 ? "fp32" : dts[d] == DT_BF16 ? "bf16" : "fp16";
            cr_assert_eq(memcmp(yf->data, y->data, cnt * es), 0, "%s training %d: y", what, training);
            cr_assert_eq(memcmp(dxf->data, dx->data, cnt * es), 0, "%s training %d: dx", what, training);
            cr_assert_eq(memcmp(dgf->data, dg->data, (size_t)c * 4), 0, "%s training %d: dgamma", what, training);
            cr_assert_eq(memcmp(dbf->data, db->data, (size_t)c * 4), 0, "%s training %d: dbeta", what, training);
            cr_assert_eq(memcmp(rm2->data, rm->data, (size_t)c * 4), 0, "%s: running mean", what);
            cr_assert_eq(memcmp(rv2->data, rv->data, (size_t)c * 4), 0, "%s: running var", what);
            /* the edges were met: zeros of both signs out of the normalisation, and NaN gradients */
            size_t negzero = 0;
            float *hy = falloc(cnt);
            tensor_to_host_f32(ybn, hy);
            for (size_t k = 0; k < cnt; k++)
                negzero += hy[k] == 0.0f && signbit(hy[k]);
            cr_assert_gt(negzero, 0, "%s training %d: no -0 reached the ReLU", what, training);
        }
}

/* One element of dtype dt (2 or 4 bytes at p) rounded from v by the portable conversion. */
static void put_elem(void *p, enum dtype dt, size_t k, float v)
{
    dtype_convert_portable((char *)p + k * dtype_size(dt), dt, &v, DT_FP32, 1);
}

/* batchnorm's y and dx are, to the bit, their documented per-element formulas (docs/backend.md), each operation
 * rounded to fp32 in this order and the result rounded once to the tensor's dtype: y = ((x - mean) * rstd) * gamma
 * + beta, with a fused ReLU (x <= 0: +0) before the rounding; training dx = rstd * ((dy' * gamma - m1) - ((x - mean)
 * * rstd) * m2), m1 = gamma * sum(dy') / count and m2 = gamma * sum(dy' * xhat) / count in double rounded to fp32,
 * eval dx = (dy' * gamma) * rstd, where dy' is dy masked by the fused ReLU's y (y <= 0: +0, NaN passes). fp32, bf16
 * and fp16; training and eval; with and without the ReLU; 19 channels (two groups of 8 and 3) of 37-element planes
 * (two 16-element vectors and a tail of 5; four 8-element steps and 5); -0 in dy, NaN in one channel's dy and
 * another's x (their channels' dx all NaN in training, unless the ReLU masks them), a channel with gamma 0 and beta
 * -0 (signed zeros at the ReLU), one with gamma 1e-30 (fp16 outputs that round to zero). Every path (the sums'
 * AVX-512 lanes, the scalar chains, any vector form of the outputs to come) is checked against the formula, not
 * against another path. */
Test(backend_cpu, batchnorm_outputs_are_their_formulas_to_the_bit)
{
    seed(29);
    const int64_t n = 3, c = 19, hw = 37;
    const size_t cnt = (size_t)(n * c * hw);
    const double count = (double)(n * hw);
    const enum dtype dts[3] = { DT_FP32, DT_BF16, DT_FP16 };
    for (int d = 0; d < 3; d++)
        for (int relu = 0; relu <= 1; relu++)
            for (int training = 1; training >= 0; training--) {
                const enum dtype dt = dts[d];
                const size_t es = dtype_size(dt);
                float *hx = falloc(cnt), *hdy = falloc(cnt), *hg = falloc((size_t)c), *hb = falloc((size_t)c);
                for (size_t k = 0; k < cnt; k++) {
                    const int64_t ch = (int64_t)(k / (size_t)hw) % c;
                    hx[k] = ch == 5 && k % 29 == 1 ? NAN : k % 7 == 0 ? 0.0f : frand(-2, 2);
                    hdy[k] = ch == 7 && k % 13 == 3 ? NAN : k % 11 == 4 ? -0.0f : frand(-1, 1);
                }
                for (int64_t ch = 0; ch < c; ch++) {
                    hg[ch] = ch == 2 ? 0.0f : ch == 4 ? 1e-30f : frand(0.5f, 1.5f);
                    hb[ch] = ch == 2 ? -0.0f : ch == 4 ? 0.0f : frand(-0.5f, 0.5f);
                }
                struct tensor *x = tfrom(dt, cnt, hx), *dy = tfrom(dt, cnt, hdy);
                struct tensor *g = tfrom(DT_FP32, (size_t)c, hg), *b = tfrom(DT_FP32, (size_t)c, hb);
                float *hrm, *hrv;
                struct tensor *rm = trand(DT_FP32, (size_t)c, -1, 1, &hrm);
                struct tensor *rv = trand(DT_FP32, (size_t)c, 0.5f, 2, &hrv);
                float *rm0 = falloc((size_t)c), *rv0 = falloc((size_t)c);
                memcpy(rm0, hrm, (size_t)c * sizeof(float));
                memcpy(rv0, hrv, (size_t)c * sizeof(float));
                struct norm_args a = { .n = n, .c = c, .hw = hw, .eps = 1e-5f, .momentum = 0.1f, .training = training,
                                       .relu = relu };
                struct tensor *y = tnew(dt, cnt), *mean = tnew(DT_FP32, (size_t)c), *rstd = tnew(DT_FP32, (size_t)c);
                struct tensor *dx = tnew(dt, cnt), *dg = tnew(DT_FP32, (size_t)c), *db = tnew(DT_FP32, (size_t)c);
                be->batchnorm_forward(be, &a, y, mean, rstd, rm, rv, x, g, b);
                /* eval normalises with the running statistics (the forward hands them on in mean and rstd), training
                 * with the batch's (which batchnorm_sums_in_their_documented_order checks to the bit) */
                float *mu = falloc((size_t)c), *rs = falloc((size_t)c);
                for (int64_t ch = 0; ch < c; ch++) {
                    mu[ch] = training ? ((const float *)mean->data)[ch] : rm0[ch];
                    rs[ch] = training ? ((const float *)rstd->data)[ch]
                                      : (float)(1.0 / sqrt((double)rv0[ch] + (double)a.eps));
                }
                be->batchnorm_backward(be, &a, dx, dg, db, dy, x, relu ? y : NULL, mean, rstd, g, 0.0f);
                const char *what = dt == DT_FP32 ? "fp32" : dt == DT_BF16 ? "bf16" : "fp16";
                float *hy = thost(y), *dym = falloc(cnt);
                char *want = talloc(cnt * es);
                size_t negzero = 0;
                for (int64_t i = 0; i < n; i++)
                    for (int64_t ch = 0; ch < c; ch++)
                        for (int64_t q = 0; q < hw; q++) {
                            const size_t k = (size_t)((i * c + ch) * hw + q);
                            float v = (hx[k] - mu[ch]) * rs[ch] * hg[ch] + hb[ch];
                            negzero += v == 0.0f && signbit(v);
                            put_elem(want, dt, k, relu && v <= 0.0f ? 0.0f : v);
                            dym[k] = relu && hy[k] <= 0.0f ? 0.0f : hdy[k];
                        }
                cr_assert_eq(memcmp(y->data, want, cnt * es), 0, "%s relu %d training %d: y", what, relu, training);
                cr_assert_gt(negzero, 0, "%s relu %d training %d: no -0 before the ReLU", what, relu, training);
                for (int64_t ch = 0; ch < c; ch++) {
                    double sdy = 0.0, sdyx = 0.0;
                    for (int64_t i = 0; i < n; i++)
                        for (int64_t q = 0; q < hw; q++) {
                            const size_t k = (size_t)((i * c + ch) * hw + q);
                            sdy += dym[k];
                            sdyx += (double)dym[k] * ((hx[k] - mu[ch]) * rs[ch]);
                        }
                    const float m1 = (float)(hg[ch] * sdy / count), m2 = (float)(hg[ch] * sdyx / count);
                    for (int64_t i = 0; i < n; i++)
                        for (int64_t q = 0; q < hw; q++) {
                            const size_t k = (size_t)((i * c + ch) * hw + q);
                            put_elem(want, dt, k,
                                     training ? rs[ch] * (dym[k] * hg[ch] - m1 - (hx[k] - mu[ch]) * rs[ch] * m2)
                                              : dym[k] * hg[ch] * rs[ch]);
                        }
                    const float want_g = (float)sdyx, want_b = (float)sdy;
                    cr_assert(memcmp(&((const float *)dg->data)[ch], &want_g, 4) == 0,
                              "%s relu %d training %d channel %lld: dgamma", what, relu, training, (long long)ch);
                    cr_assert(memcmp(&((const float *)db->data)[ch], &want_b, 4) == 0,
                              "%s relu %d training %d channel %lld: dbeta", what, relu, training, (long long)ch);
                }
                for (size_t k = 0; k < cnt; k++)
                    cr_assert(memcmp((const char *)dx->data + k * es, want + k * es, es) == 0,
                              "%s relu %d training %d: dx[%zu] (channel %zu, element %zu)", what, relu, training, k,
                              (k / (size_t)hw) % (size_t)c, k % (size_t)hw);
            }
}

/* ---- embedding --------------------------------------------------------------------------------- */

Test(backend_cpu, embedding_forward_and_repeated_token_backward)
{
    seed(16);
    int64_t B = 2, T = 3, C = 5, V = 4;
    int32_t htok[6] = { 1, 3, 1, 1, 0, 3 };
    int32_t *tok = be->alloc(be, sizeof htok);
    be->upload(be, tok, htok, sizeof htok);
    float *hwte, *hwpe, *hdy, *hdte0;
    struct tensor *wte = trand(DT_FP32, (size_t)(V * C), -1, 1, &hwte), *wpe = trand(DT_FP32, (size_t)(T * C), -1, 1, &hwpe);
    enum dtype outs[2] = { DT_FP32, DT_FP16 };
    for (int o = 0; o < 2; o++) {
        struct tensor *y = tnew(outs[o], (size_t)(B * T * C));
        be->embedding_forward(be, y, tok, wte, wpe, B, T, C);
        double want[30];
        for (int64_t b = 0; b < B; b++)
            for (int64_t t = 0; t < T; t++)
                for (int64_t j = 0; j < C; j++)
                    want[(b * T + t) * C + j] = (double)(hwte[htok[b * T + t] * C + j] + hwpe[t * C + j]);
        check_out(y, want, 30, 0, 0, "embedding_forward");
    }
    struct tensor *dy = trand(DT_BF16, (size_t)(B * T * C), -1, 1, &hdy);
    struct tensor *dte = tnew(DT_FP32, (size_t)(V * C)), *dpe = tnew(DT_FP32, (size_t)(T * C));
    be->embedding_backward(be, dte, dpe, dy, tok, B, T, C, 0.0f);
    double gte[20] = { 0 }, gpe[15] = { 0 };
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < C; j++) {
                gte[htok[b * T + t] * C + j] += hdy[(b * T + t) * C + j];
                gpe[t * C + j] += hdy[(b * T + t) * C + j];
            }
    check_f32(dte, gte, 20, 1e-6, 1e-6, "dwte: token 1 three times, token 2 never (zeros)");
    check_f32(dpe, gpe, 15, 1e-6, 1e-6, "dwpe");
    for (int j = 0; j < 5; j++)
        cr_assert_eq(((float *)dte->data)[2 * C + j], 0.0f, "an unused token's row is overwritten with 0");
    /* beta 1 accumulates */
    struct tensor *dte1 = trand(DT_FP32, (size_t)(V * C), -1, 1, &hdte0);
    be->embedding_backward(be, dte1, dpe, dy, tok, B, T, C, 1.0f);
    for (int i = 0; i < 20; i++)
        gte[i] += hdte0[i];
    for (int i = 0; i < 15; i++)
        gpe[i] *= 2;
    check_f32(dte1, gte, 20, 1e-6, 1e-6, "dwte beta 1");
    check_f32(dpe, gpe, 15, 1e-6, 1e-6, "dwpe beta 1");
    be->free(be, tok);
}

/* ---- attention --------------------------------------------------------------------------------- */

static double round_to(double x, enum dtype d)
{
    return d == DT_FP32 ? x : (double)dtype_round((float)x, d);
}

/* Naive causal attention in double. With d lowp, rounds where the backend stores (scores, probs, out). */
static void attn_naive(const double *qkv, int64_t B, int64_t T, int64_t C, int64_t H, enum dtype d, double *out,
                       double *probs)
{
    int64_t D = C / H;
    double scale = d == DT_FP32 ? 1.0 / sqrt((double)D) : (double)(1.0f / sqrtf((float)D));
    double s[64], p[64];
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = 0; t < T; t++) {
                const double *q = qkv + (b * T + t) * 3 * C + h * D;
                double mx = -INFINITY, sum = 0;
                for (int64_t j = 0; j <= t; j++) {
                    const double *k = qkv + (b * T + j) * 3 * C + C + h * D;
                    double acc = 0;
                    for (int64_t e = 0; e < D; e++)
                        acc += q[e] * k[e];
                    s[j] = round_to(acc * scale, d);
                    mx = s[j] > mx ? s[j] : mx;
                }
                for (int64_t j = 0; j <= t; j++)
                    sum += exp(s[j] - mx);
                for (int64_t j = 0; j < T; j++) {
                    p[j] = j <= t ? round_to(exp(s[j] - mx) / sum, d) : 0.0;
                    if (probs)
                        probs[((b * H + h) * T + t) * T + j] = p[j];
                }
                for (int64_t e = 0; e < D; e++) {
                    double acc = 0;
                    for (int64_t j = 0; j <= t; j++)
                        acc += p[j] * qkv[(b * T + j) * 3 * C + 2 * C + h * D + e];
                    out[(b * T + t) * C + h * D + e] = acc;
                }
            }
}

Test(backend_cpu, attention_forward_matches_naive)
{
    seed(17);
    int64_t B = 2, T = 5, C = 8, H = 2;
    size_t nq = (size_t)(B * T * 3 * C), no = (size_t)(B * T * C), np = (size_t)(B * H * T * T);
    enum dtype dts[3] = { DT_FP32, DT_FP16, DT_BF16 };
    for (int d = 0; d < 3; d++) {
        float *hq;
        struct tensor *qkv = trand(dts[d], nq, -2, 2, &hq);
        struct tensor *out = tnew(dts[d], no), *probs = tnew(dts[d], np);
        be->attention_forward(be, out, probs, qkv, B, T, C, H);
        double *wo = dalloc(no), *wp = dalloc(np);
        attn_naive(to_d(hq, nq), B, T, C, H, dts[d], wo, wp);
        if (dts[d] == DT_FP32) {
            check_f32(out, wo, no, 1e-5, 1e-6, "attention out");
            check_f32(probs, wp, np, 1e-5, 1e-7, "attention probs");
        } else {
            /* an fp32-order difference may tip one intermediate rounding: allow 2 ulps */
            check_lowp(out, wo, no, 2, 1e-4, "attention out");
            check_lowp(probs, wp, np, 2, 1e-4, "attention probs");
        }
        const float *pp = thost(probs);
        for (int64_t r = 0; r < B * H * T; r++)
            for (int64_t j = r % T + 1; j < T; j++)
                cr_assert_eq(pp[r * T + j], 0.0f, "masked probability must be exactly 0");
    }
}

Test(backend_cpu, attention_is_causal)
{
    seed(18);
    int64_t B = 2, T = 5, C = 8, H = 2, tp = 3;
    size_t nq = (size_t)(B * T * 3 * C), no = (size_t)(B * T * C), np = (size_t)(B * H * T * T);
    float *hq;
    struct tensor *qkv = trand(DT_FP32, nq, -2, 2, &hq);
    struct tensor *o1 = tnew(DT_FP32, no), *p1 = tnew(DT_FP32, np), *o2 = tnew(DT_FP32, no), *p2 = tnew(DT_FP32, np);
    be->attention_forward(be, o1, p1, qkv, B, T, C, H);
    for (int64_t j = 0; j < 3 * C; j++) /* perturb q, k and v of token tp in batch 0 */
        ((float *)qkv->data)[tp * 3 * C + j] += 0.5f;
    be->attention_forward(be, o2, p2, qkv, B, T, C, H);
    const float *a = o1->data, *b = o2->data;
    size_t changed = 0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < C; j++) {
            if (t < tp)
                cr_assert_eq(a[t * C + j], b[t * C + j], "out at t=%lld depends on token %lld", (long long)t,
                             (long long)tp);
            else
                changed += a[t * C + j] != b[t * C + j];
        }
    cr_assert_gt(changed, 0);
    cr_assert_eq(memcmp(a + T * C, b + T * C, (size_t)(T * C) * sizeof(float)), 0, "batch 1 untouched");
}

struct attn_ctx {
    int64_t B, T, C, H;
    const double *gy;
};

static double attn_loss(const double *qkv, void *vctx)
{
    struct attn_ctx *c = vctx;
    size_t no = (size_t)(c->B * c->T * c->C);
    double *out = malloc(no * sizeof(double));
    attn_naive(qkv, c->B, c->T, c->C, c->H, DT_FP32, out, NULL);
    double s = dot(out, c->gy, no);
    free(out);
    return s;
}

/* One attention case of (B, T, C, H) in dtype dt, forward then backward: qkv and dout random in [-1.5, 1.5) and
 * [-1, 1), or (q_from, do_from non-NULL) those values rounded to dt; hq and hdo hold the stored values. */
struct attn_case {
    size_t nq, no, np;
    float *hq, *hdo;
    struct tensor *probs, *dqkv;
};

static struct attn_case attn_case_run(enum dtype dt, int64_t B, int64_t T, int64_t C, int64_t H, const float *q_from,
                                      const float *do_from)
{
    struct attn_case a = { (size_t)(B * T * 3 * C), (size_t)(B * T * C), (size_t)(B * H * T * T), NULL, NULL, NULL,
                           NULL };
    struct tensor *qkv, *dout;
    if (q_from && do_from) {
        a.hq = memcpy(falloc(a.nq), q_from, a.nq * sizeof(float));
        a.hdo = memcpy(falloc(a.no), do_from, a.no * sizeof(float));
        qkv = tfrom(dt, a.nq, a.hq);
        dout = tfrom(dt, a.no, a.hdo);
    } else {
        qkv = trand(dt, a.nq, -1.5f, 1.5f, &a.hq);
        dout = trand(dt, a.no, -1, 1, &a.hdo);
    }
    a.probs = tnew(dt, a.np);
    a.dqkv = tnew(dt, a.nq);
    be->attention_forward(be, tnew(dt, a.no), a.probs, qkv, B, T, C, H);
    be->attention_backward(be, a.dqkv, dout, qkv, a.probs, B, T, C, H);
    return a;
}

Test(backend_cpu, attention_backward_matches_finite_differences)
{
    seed(19);
    int64_t B = 2, T = 5, C = 8, H = 2;
    const struct attn_case f = attn_case_run(DT_FP32, B, T, C, H, NULL, NULL);
    const size_t nq = f.nq;
    struct attn_ctx c = { B, T, C, H, to_d(f.hdo, f.no) };
    double *want = dalloc(nq);
    fd_grad(attn_loss, &c, to_d(f.hq, nq), nq, 1e-6, want);
    check_f32(f.dqkv, want, nq, 1e-4, 1e-5, "attention dqkv");

    /* bf16: same gradients within bf16's precision (intermediates are rounded to bf16) */
    const struct attn_case h = attn_case_run(DT_BF16, B, T, C, H, f.hq, f.hdo);
    const float *g16 = thost(h.dqkv), *g32 = f.dqkv->data;
    double gmax = 0;
    for (size_t i = 0; i < nq; i++)
        gmax = fmax(gmax, fabs(g32[i]));
    for (size_t i = 0; i < nq; i++)
        cr_assert(fabs(g16[i] - g32[i]) <= 0.05 * gmax, "bf16 dqkv[%zu] = %g, fp32 %g", i, (double)g16[i],
                  (double)g32[i]);
}

/* bf16 backward against the chain rule in double over the backend's own bf16 values and roundings: with
 * qkv, dout and the stored probabilities P (the forward's) all bf16, dP = round(dO V^T), dS = round(P (dP -
 * rowsum(P dP))), dV = round(P^T dO), dQ = round(dS K / sqrt(D)), dK = round(dS^T Q / sqrt(D)). The products
 * then read the bf16 tensors in place (gemm_avx512's bf16 product where the CPU has it): a wrong block,
 * stride or transpose there is off by far more than the 2 ulps an fp32-order difference may tip. */
Test(backend_cpu, attention_backward_bf16_matches_its_roundings)
{
    seed(23);
    int64_t B = 2, T = 6, C = 8, H = 2, D = C / H;
    const struct attn_case a = attn_case_run(DT_BF16, B, T, C, H, NULL, NULL);
    const size_t nq = a.nq;
    const float *P = thost(a.probs), *hq = a.hq, *hdo = a.hdo;
    const double scale = (double)(1.0f / sqrtf((float)D));
    double *want = dalloc(nq), ds[64];
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            const float *p = P + (b * H + h) * T * T;
#define Q_(t, e) ((double)hq[(b * T + (t)) * 3 * C + h * D + (e)])
#define K_(t, e) ((double)hq[(b * T + (t)) * 3 * C + C + h * D + (e)])
#define V_(t, e) ((double)hq[(b * T + (t)) * 3 * C + 2 * C + h * D + (e)])
#define DO_(t, e) ((double)hdo[(b * T + (t)) * C + h * D + (e)])
            for (int64_t t = 0; t < T; t++) {
                double dot = 0;
                for (int64_t k = 0; k < T; k++) {
                    double acc = 0;
                    for (int64_t e = 0; e < D; e++)
                        acc += DO_(t, e) * V_(k, e);
                    ds[t * T + k] = round_to(acc, DT_BF16);
                }
                for (int64_t k = 0; k <= t; k++)
                    dot += (double)p[t * T + k] * ds[t * T + k];
                for (int64_t k = 0; k < T; k++)
                    ds[t * T + k] = k <= t ? round_to(p[t * T + k] * (ds[t * T + k] - (double)(float)dot), DT_BF16) : 0;
            }
            for (int64_t t = 0; t < T; t++)
                for (int64_t e = 0; e < D; e++) {
                    double dq = 0, dk = 0, dv = 0;
                    for (int64_t k = 0; k < T; k++) {
                        dq += ds[t * T + k] * K_(k, e);
                        dk += ds[k * T + t] * Q_(k, e);
                        dv += (double)p[k * T + t] * DO_(k, e);
                    }
                    size_t at = (size_t)((b * T + t) * 3 * C + h * D + e);
                    want[at] = dq * scale;
                    want[at + (size_t)C] = dk * scale;
                    want[at + 2 * (size_t)C] = dv;
                }
#undef Q_
#undef K_
#undef V_
#undef DO_
        }
    check_lowp(a.dqkv, want, nq, 2, 1e-4, "attention dqkv bf16");
}

/* ---- losses ------------------------------------------------------------------------------------ */

Test(backend_cpu, xent_known_values)
{
    float hl[9] = { 1, 2, 3, 1e4f, 0, -1e4f, 2, 2, 1 };
    int32_t hlab[3] = { 2, 1, 1 };
    int32_t *lab = be->alloc(be, sizeof hlab), *cor = be->alloc(be, 3 * sizeof(int32_t));
    be->upload(be, lab, hlab, sizeof hlab);
    struct tensor *logits = tfrom(DT_FP32, 9, hl), *loss = tnew(DT_FP32, 3), *dl = tnew(DT_FP32, 9);
    be->xent_forward_backward(be, loss, cor, dl, logits, lab, 3, 3, &(float){ 6.0f });
    double lse0 = log(exp(1.0) + exp(2.0) + exp(3.0)), lse2 = log(2 * exp(2.0) + exp(1.0));
    check_f32(loss, (double[]){ lse0 - 3, 1e4, lse2 - 2 }, 3, 1e-6, 0, "losses (huge logits stay finite)");
    cr_assert_eq(cor[0], 1);
    cr_assert_eq(cor[1], 0);
    cr_assert_eq(cor[2], 0, "tie between classes 0 and 1: argmax is the first index, 0");
    double g = 6.0 / 3.0, want[9];
    for (int j = 0; j < 3; j++)
        want[j] = (exp(1.0 + j - lse0) - (j == 2)) * g;
    want[3] = 1.0 * g; /* softmax (1, 0, 0) minus onehot at 1 */
    want[4] = -1.0 * g;
    want[5] = 0.0;
    for (int j = 0; j < 3; j++)
        want[6 + j] = (exp((double)hl[6 + j] - lse2) - (j == 1)) * g;
    check_f32(dl, want, 9, 1e-6, 1e-7, "dlogits");
    /* fp16 dlogits: rounded once; eval (NULL) writes only losses and correct */
    struct tensor *dl16 = tnew(DT_FP16, 9);
    be->xent_forward_backward(be, loss, cor, dl16, logits, lab, 3, 3, &(float){ 6.0f });
    check_lowp(dl16, want, 9, 1, 0, "dlogits fp16");
    hlab[2] = 0;
    be->upload(be, lab, hlab, sizeof hlab);
    be->xent_forward_backward(be, loss, cor, NULL, logits, lab, 3, 3, NULL);
    cr_assert_eq(cor[2], 1, "tie: label 0 is the argmax");
    be->free(be, lab);
    be->free(be, cor);
}

struct xent_ctx {
    int64_t N, K;
    const int32_t *labels;
};

static double xent_loss(const double *x, void *vctx)
{
    struct xent_ctx *c = vctx;
    double s = 0;
    for (int64_t i = 0; i < c->N; i++) {
        double mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j < c->K; j++)
            mx = fmax(mx, x[i * c->K + j]);
        for (int64_t j = 0; j < c->K; j++)
            sum += exp(x[i * c->K + j] - mx);
        s += mx + log(sum) - x[i * c->K + c->labels[i]];
    }
    return s / (double)c->N;
}

Test(backend_cpu, xent_gradient_and_lowp_logits)
{
    seed(20);
    int64_t N = 7, K = 10;
    size_t n = (size_t)(N * K);
    int32_t *lab = be->alloc(be, (size_t)N * sizeof(int32_t)), *cor = be->alloc(be, (size_t)N * sizeof(int32_t));
    for (int64_t i = 0; i < N; i++)
        lab[i] = (int32_t)(urand() * (double)K);
    enum dtype dts[3] = { DT_FP32, DT_FP16, DT_BF16 };
    for (int d = 0; d < 3; d++) {
        float *hl;
        struct tensor *logits = trand(dts[d], n, -4, 4, &hl), *loss = tnew(DT_FP32, (size_t)N), *dl = tnew(DT_FP32, n);
        be->xent_forward_backward(be, loss, cor, dl, logits, lab, N, K, &(float){ 1.0f });
        struct xent_ctx c = { N, K, lab };
        double *want = dalloc(n);
        fd_grad(xent_loss, &c, to_d(hl, n), n, 1e-6, want);
        check_f32(dl, want, n, 1e-4, 1e-7, "dlogits vs finite differences of the mean loss");
        const float *hloss = loss->data;
        for (int64_t i = 0; i < N; i++) {
            struct xent_ctx one = { 1, K, lab + i };
            double w = xent_loss(to_d(hl + i * K, (size_t)K), &one);
            cr_assert(fabs(hloss[i] - w) < 1e-5, "loss[%lld] %g want %g", (long long)i, (double)hloss[i], w);
            int64_t arg = 0;
            for (int64_t j = 1; j < K; j++)
                if (hl[i * K + j] > hl[i * K + arg])
                    arg = j;
            cr_assert_eq(cor[i], arg == lab[i]);
        }
    }
    be->free(be, lab);
    be->free(be, cor);
}

/* Cross-entropy's formula, one row, with the backend's operations in its order (libm's double exp and log):
 * the bits the backend must give, whichever way it computes them (kernels/cpu/backend_cpu.c, xent_row_fast). */
static void xent_formula(const float *x, int64_t K, int32_t label, float g, float *loss, float *d)
{
    float mx = x[0];
    for (int64_t k = 1; k < K; k++)
        if (x[k] > mx)
            mx = x[k];
    double sum = 0.0;
    for (int64_t k = 0; k < K; k++)
        sum += exp((double)x[k] - (double)mx);
    double lse = (double)mx + log(sum);
    *loss = (float)(lse - (double)x[label]);
    for (int64_t k = 0; k < K; k++) {
        float p = (float)exp((double)x[k] - lse);
        d[k] = (p - (k == label ? 1.0f : 0.0f)) * g;
    }
}

/* Rows of every kind, each K around the backend's blocks of 8 and 256 and GPT-2's 50257 (whose rows go straight to
 * xent_row_formula): logits of small and huge spread, around 0 and far from it, the label ahead by a margin
 * (losses near 0: the fast rows' interval is wider than their fp32 there, so the formula decides; there lse's
 * roundings show in the loss), -Inf logits, a NaN, on 1 and 2 threads; losses and dlogits must be the formula's
 * bits. */
Test(backend_cpu, xent_is_its_formula_to_the_bit)
{
    seed(22);
    const int64_t Ks[] = { 1, 2, 3, 7, 8, 9, 255, 256, 257, 600, 1000, 50257 }; /* the last GPT-2's vocabulary */
    const float spreads[] = { 1e-3f, 0.5f, 4.0f, 30.0f, 300.0f };
    for (size_t ik = 0; ik < sizeof Ks / sizeof Ks[0]; ik++) {
        const int64_t K = Ks[ik], N = K > 1000 ? 40 : K >= 255 ? 160 : 2000;
        const size_t n = (size_t)(N * K);
        float *hl = falloc(n);
        int32_t *hlab = malloc((size_t)N * sizeof(int32_t));
        for (int64_t i = 0; i < N; i++) {
            const float s = spreads[i % 5];
            const float base = (float)(i % 7) * 1000.0f - 3000.0f; /* lse far from 0 too */
            for (int64_t k = 0; k < K; k++)
                hl[i * K + k] = base + frand(-s, s);
            hlab[i] = (int32_t)(urand() * (double)K);
            if (i % 3 == 1) /* the label ahead by 8 to 64: losses from ~K e^-8 to those that round to 0 */
                hl[i * K + hlab[i]] = (i % 2 ? base : 0.0f) + 8.0f * (float)(1 + i % 8);
            if (i % 13 == 5 && K > 1)
                hl[i * K + (hlab[i] + 1) % K] = -INFINITY;
        }
        if (K > 2)
            hl[(N - 1) * K + (hlab[N - 1] + 1) % K] = NAN;
        int32_t *lab = be->alloc(be, (size_t)N * sizeof(int32_t));
        be->upload(be, lab, hlab, (size_t)N * sizeof(int32_t));
        struct tensor *logits = tfrom(DT_FP32, n, hl), *loss = tnew(DT_FP32, (size_t)N), *dl = tnew(DT_FP32, n);
        const float seed_g = 3.0f, g = (float)((double)seed_g / (double)N);
        float *wd = falloc((size_t)K);
        for (int threads = 1; threads <= 2; threads++) {
            struct amp_error err;
            cr_assert_eq(backend_set_threads(be, threads, &err), AMP_OK, "%s", err.msg);
            be->xent_forward_backward(be, loss, NULL, dl, logits, lab, N, K, &seed_g);
            const float *gl = loss->data, *gd = dl->data;
            for (int64_t i = 0; i < N; i++) {
                float wl;
                xent_formula(hl + i * K, K, hlab[i], g, &wl, wd);
                cr_assert(memcmp(&gl[i], &wl, sizeof wl) == 0, "K %lld row %lld: loss %a, formula %a", (long long)K,
                          (long long)i, (double)gl[i], (double)wl);
                cr_assert(memcmp(gd + i * K, wd, (size_t)K * sizeof(float)) == 0,
                          "K %lld row %lld: dlogits are not the formula's bits", (long long)K, (long long)i);
            }
        }
        struct amp_error err;
        cr_assert_eq(backend_set_threads(be, 1, &err), AMP_OK, "%s", err.msg);
        cr_assert(isnan(((const float *)loss->data)[N - 1]) || K <= 2, "a NaN logit gives a NaN loss");
        be->free(be, lab);
        free(hlab);
    }
}

Test(backend_cpu, mse_values_and_gradient)
{
    seed(21);
    int64_t N = 4, K = 3;
    size_t n = (size_t)(N * K);
    float *hy, *ht;
    struct tensor *y = trand(DT_FP32, n, -2, 2, &hy), *t = trand(DT_FP32, n, -2, 2, &ht);
    struct tensor *loss = tnew(DT_FP32, (size_t)N), *dy = tnew(DT_FP32, n), *dy16 = tnew(DT_BF16, n);
    float seed_g = 8.0f;
    be->mse_forward_backward(be, loss, dy, y, t, N, K, &seed_g);
    double wl[4] = { 0 }, wd[12];
    for (int64_t i = 0; i < N; i++)
        for (int64_t j = 0; j < K; j++) {
            double e = (double)hy[i * K + j] - ht[i * K + j];
            wl[i] += e * e / (double)K;
            wd[i * K + j] = 2 * e * seed_g / (double)(N * K);
        }
    check_f32(loss, wl, (size_t)N, 1e-6, 1e-7, "mse losses");
    check_f32(dy, wd, n, 1e-6, 1e-7, "mse dy");
    be->mse_forward_backward(be, loss, dy16, y, t, N, K, &seed_g);
    check_lowp(dy16, wd, n, 1, 0, "mse dy bf16");
}

/* ---- gradient statistics ----------------------------------------------------------------------- */

Test(backend_cpu, grad_stats_counts_inf_and_nan_per_tensor)
{
    float h0[5] = { 1, 2, INFINITY, -INFINITY, NAN }, h1[3] = { 3, NAN, 0 }, h2[1] = { -4 };
    struct tensor *t0 = tfrom(DT_FP32, 5, h0), *t1 = tfrom(DT_FP32, 3, h1), *t2 = tfrom(DT_FP32, 1, h2);
    const struct tensor *grads[3] = { t0, t1, t2 };
    int64_t counts[6] = { -1, -1, -1, -1, -1, -1 }, *n_inf = counts, *n_nan = counts + 3;
    struct grad_check gs = { .sumsq = NAN, .absmax = NAN };
    be->grad_stats(be, grads, 3, &gs, counts);
    cr_assert_eq(gs.found_nonfinite, 1);
    cr_assert_eq(n_inf[0], 2);
    cr_assert_eq(n_nan[0], 1);
    cr_assert_eq(n_inf[1], 0);
    cr_assert_eq(n_nan[1], 1);
    cr_assert_eq(n_inf[2], 0);
    cr_assert_eq(n_nan[2], 0);
    cr_assert_eq(gs.sumsq, 30.0, "1 + 4 + 9 + 16 over the finite elements, got %g", gs.sumsq);
    cr_assert_eq(gs.absmax, 4.0);
}

Test(backend_cpu, grad_stats_finite_sum_of_squares)
{
    seed(22);
    size_t sizes[3] = { 1001, 7, 4096 };
    const struct tensor *grads[3];
    double want = 0, amax = 0;
    for (int t = 0; t < 3; t++) {
        float *h;
        grads[t] = trand(DT_FP32, sizes[t], -3, 3, &h);
        for (size_t i = 0; i < sizes[t]; i++) {
            want += (double)h[i] * h[i];
            amax = fmax(amax, fabs(h[i]));
        }
    }
    int64_t counts[6], *n_inf = counts, *n_nan = counts + 3;
    struct grad_check gs = { .found_nonfinite = 1 };
    be->grad_stats(be, grads, 3, &gs, counts);
    cr_assert_eq(gs.found_nonfinite, 0);
    cr_assert(fabs(gs.sumsq - want) <= 1e-12 * want, "sumsq %.17g want %.17g", gs.sumsq, want);
    cr_assert_eq(gs.absmax, amax);
    for (int t = 0; t < 3; t++)
        cr_assert(n_inf[t] == 0 && n_nan[t] == 0);
    /* a very large finite gradient squares without overflow in double */
    float big = 3e38f;
    const struct tensor *one[1] = { tfrom(DT_FP32, 1, &big) };
    be->grad_stats(be, one, 1, &gs, counts);
    cr_assert(!gs.found_nonfinite && isfinite(gs.sumsq) && gs.sumsq > 8e76);
}

Test(backend_cpu, count_zeros_counts_both_signs)
{
    float h[6] = { 0.0f, -0.0f, 1e-45f, 1.0f, -2.0f, 0.0f };
    struct tensor *t = tfrom(DT_FP32, 6, h);
    int64_t acc = 0;
    be->count_zeros(be, t, &acc);
    cr_assert_eq(acc, 3, "+0, -0, +0; the subnormal 1e-45 is not zero");
    struct tensor *t16 = tnew(DT_FP16, 6), *tb = tnew(DT_BF16, 6);
    uint16_t b16[6] = { 0x0000, 0x8000, 0x0001, 0x3C00, 0x7E00, 0x0000 };
    memcpy(t16->data, b16, sizeof b16);
    memcpy(tb->data, b16, sizeof b16);
    be->count_zeros(be, t16, &acc);
    cr_assert_eq(acc, 6, "it adds to the accumulator");
    acc = 0;
    be->count_zeros(be, tb, &acc);
    cr_assert_eq(acc, 3);
}

/* ---- optimizers -------------------------------------------------------------------------------- */

Test(backend_cpu, adamw_matches_pytorch_formula)
{
    seed(23);
    size_t n = 1500;
    float *hp, *hg;
    struct tensor *p = trand(DT_FP32, n, -1, 1, &hp), *g = trand(DT_FP32, n, -1000, 1000, &hg);
    struct tensor *m = tnew(DT_FP32, n), *v = tnew(DT_FP32, n), *lowp = tnew(DT_BF16, n);
    be->zero(be, m);
    be->zero(be, v);
    struct step_params sp = { .beta1 = 0.9f, .beta2 = 0.999f, .weight_decay = 0.1f };
    struct step_scalars sc;
    float lr_f = 1e-2f, gm = 1.0f / 1024;
    struct optim_update_args a = { .master = p, .grad = g, .m = m, .v = v, .copy = lowp, .sc = &sc,
                                   .weight_decay = 0.1f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f };
    double *wp = to_d(hp, n), *wm = dalloc(n), *wv = dalloc(n);
    for (int64_t step = 1; step <= 2; step++) {
        step_rule_scalars(&sc, &sp, lr_f, step, gm);
        be->adamw_update(be, &a, 1);
        double b1 = a.beta1, b2 = a.beta2, lr = lr_f, wd = a.weight_decay;
        double bc1 = 1 - pow(b1, (double)step), bc2 = 1 - pow(b2, (double)step);
        for (size_t i = 0; i < n; i++) {
            double gi = (double)hg[i] * gm;
            wp[i] *= 1 - lr * wd;
            wm[i] = b1 * wm[i] + (1 - b1) * gi;
            wv[i] = b2 * wv[i] + (1 - b2) * gi * gi;
            wp[i] -= lr / bc1 * wm[i] / (sqrt(wv[i]) / sqrt(bc2) + a.eps);
        }
        check_f32(p, wp, n, 1e-6, 1e-7, "adamw master");
        check_f32(m, wm, n, 1e-5, 1e-9, "adamw m");
        check_f32(v, wv, n, 1e-5, 1e-12, "adamw v");
        const uint16_t *lb = lowp->data;
        const float *pm = p->data;
        for (size_t i = 0; i < n; i++)
            cr_assert_eq(lb[i], bf16_from_fp32(pm[i]), "lowp copy is the new master rounded once");
    }
    /* the first step moves each weight by about lr against the gradient's sign (plus decay) */
    struct optim_update_args b = a;
    float hp1 = 0.5f, hg1 = -3.0f;
    b.master = tfrom(DT_FP32, 1, &hp1);
    b.grad = tfrom(DT_FP32, 1, &hg1);
    b.m = tnew(DT_FP32, 1);
    b.v = tnew(DT_FP32, 1);
    be->zero(be, b.m);
    be->zero(be, b.v);
    b.copy = NULL;
    step_rule_scalars(&sc, &sp, lr_f, 1, 1.0f);
    be->adamw_update(be, &b, 1);
    check_f32(b.master, (double[]){ 0.5 * (1 - 1e-3) + 1e-2 * 3.0 / (3.0 + 1e-8) }, 1, 1e-6, 0, "adamw step 1");
}

/* A value of class `cls` for the subnormal test below: 0, -0, a subnormal (often one of the few smallest, where
 * a first moment that keeps shrinking stops), a normal number just above fp32's subnormals, or an ordinary one. */
static float subnormal_case_value(int cls, float ordinary)
{
    float sign = urand() < 0.5 ? -1.0f : 1.0f;
    switch (cls) {
    case 0: return 0.0f;
    case 1: return -0.0f;
    case 2: { /* k * 2^-149 */
        uint32_t k = urand() < 0.5 ? 1 + (uint32_t)(urand() * 8) : 1 + (uint32_t)(urand() * 0x7FFFFE);
        float f;
        memcpy(&f, &k, sizeof f);
        return sign * f;
    }
    case 3: return sign * (float)ldexp(1.0 + urand(), -126 + (int)(urand() * 80)); /* 2^-126 .. 2^-46 */
    default: return sign * ordinary * (float)(0.25 + urand());
    }
}

/* AdamW's bits where moments, gradients or weights are subnormal (or about to be): the backend against the fp32
 * formula run plainly here, every bit of p, m and v, over several steps, with and without weight decay. Subnormals
 * slow the update (docs/perf.md, "Subnormal moments"); whatever a faster path does about them (flush them, set
 * MXCSR's FTZ/DAZ, compute them another way) must keep these bits. The first part of the tensor has ordinary second
 * moments and gradients (first moments alone near the subnormals, the common case); the rest mixes every class. */
Test(backend_cpu, adamw_subnormal_moments_have_the_fp32_formulas_bits)
{
    seed(29);
    const size_t n = 4096 + 13, split = 2048;
    float *hp = malloc(n * sizeof *hp), *hm = malloc(n * sizeof *hm), *hv = malloc(n * sizeof *hv),
          *hg = malloc(n * sizeof *hg);
    cr_assert(hp && hm && hv && hg);
    for (size_t i = 0; i < n; i++) {
        bool mixed = i >= split;
        int mcls = urand() < 0.25 ? 2 : (int)(urand() * 5);
        int vcls = mixed ? (int)(urand() * 5) : (urand() < 0.2 ? 0 : 4);
        int gcls = mixed ? (int)(urand() * 5) : (urand() < 0.5 ? (int)(urand() * 2) : 4);
        int pcls = mixed && urand() < 0.1 ? (int)(urand() * 4) : 4;
        hm[i] = subnormal_case_value(mcls, 1e-3f);
        hv[i] = fabsf(subnormal_case_value(vcls, 1e-6f));
        hg[i] = subnormal_case_value(gcls, urand() < 0.5 ? 1e3f : 1e-3f);
        hp[i] = subnormal_case_value(pcls, 0.1f);
    }
    struct tensor *p = tfrom(DT_FP32, n, hp), *m = tfrom(DT_FP32, n, hm), *v = tfrom(DT_FP32, n, hv),
                  *g = tfrom(DT_FP32, n, hg);
    struct step_scalars sc;
    const float wds[2] = { 0.0f, 0.01f }, gms[2] = { 1.0f / 65536, 1.0f };
    int64_t subnormal_m = 0;
    for (int step = 1; step <= 6; step++) {
        float wd = wds[step % 2], gm = gms[step / 4];
        struct step_params sp = { .beta1 = 0.9f, .beta2 = 0.999f, .weight_decay = wd };
        step_rule_scalars(&sc, &sp, step == 3 ? 1e-30f : 1e-3f, step, gm);
        struct optim_update_args a = { .master = p, .grad = g, .m = m, .v = v, .sc = &sc, .weight_decay = wd,
                                       .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8f };
        be->adamw_update(be, &a, 1);
        float neg_step = sc.adam_neg_step, bc2_sqrt = sc.adam_bc2_sqrt, decay = sc.adam_decay;
        float b1 = 0.9f, b2 = 0.999f, omb1 = (float)(1.0 - 0.9), omb2 = (float)(1.0 - 0.999), eps = 1e-8f;
        for (size_t i = 0; i < n; i++) {
            float gi = hg[i] * sc.grad_mul;
            float pi = wd != 0.0f ? hp[i] * decay : hp[i];
            float mi = b1 * hm[i] + omb1 * gi;
            float vi = b2 * hv[i] + omb2 * gi * gi;
            float denom = sqrtf(vi) / bc2_sqrt + eps;
            hp[i] = pi + neg_step * mi / denom;
            hm[i] = mi;
            hv[i] = vi;
            subnormal_m += mi != 0.0f && fabsf(mi) < 0x1p-126f;
        }
        const char *names[3] = { "p", "m", "v" };
        const float *got[3] = { p->data, m->data, v->data }, *want[3] = { hp, hm, hv };
        for (int t = 0; t < 3; t++)
            for (size_t i = 0; i < n; i++) {
                uint32_t gb, wb;
                memcpy(&gb, &got[t][i], sizeof gb);
                memcpy(&wb, &want[t][i], sizeof wb);
                cr_assert_eq(gb, wb, "step %d, %s[%zu]: 0x%08x (%a), the fp32 formula gives 0x%08x (%a)", step,
                             names[t], i, gb, (double)got[t][i], wb, (double)want[t][i]);
            }
    }
    cr_assert_gt(subnormal_m, 1000, "the case holds subnormal first moments (%lld)", (long long)subnormal_m);
    free(hp), free(hm), free(hv), free(hg);
}

/* 1 - beta is computed in double and then rounded, as PyTorch passes the Python float 1 - beta2 to
 * addcmul_: for beta2 = 0.999 the factor is 0.001f, not 1.0f - 0.999f = 0.00099998713.
 * One step from v = 0 with g = 1 makes v exactly that factor. */
Test(backend_cpu, adamw_one_minus_beta_is_rounded_from_double_as_pytorch_does)
{
    float hp = 0.5f, hg = 1.0f;
    struct tensor *p = tfrom(DT_FP32, 1, &hp), *g = tfrom(DT_FP32, 1, &hg), *m = tnew(DT_FP32, 1),
                  *v = tnew(DT_FP32, 1);
    be->zero(be, m);
    be->zero(be, v);
    struct step_params sp = {.beta1 = 0.9, .beta2 = 0.999};
    struct step_scalars sc;
    step_rule_scalars(&sc, &sp, 1e-3f, 1, 1.0f);
    struct optim_update_args a = {.master = p, .grad = g, .m = m, .v = v, .sc = &sc, .beta1 = 0.9, .beta2 = 0.999,
                                  .eps = 1e-8f};
    be->adamw_update(be, &a, 1);
    float got_m = ((const float *)m->data)[0], got_v = ((const float *)v->data)[0];
    cr_assert_eq(got_v, (float)(1.0 - 0.999), "v = %.9g, want (float)(1 - 0.999) = %.9g (1.0f - 0.999f is %.9g)",
                 (double)got_v, (double)(float)(1.0 - 0.999), (double)(1.0f - 0.999f));
    cr_assert_eq(got_m, (float)(1.0 - 0.9), "m = %.9g, want %.9g", (double)got_m, (double)(float)(1.0 - 0.9));
}

static void sgd_reference(double *p, double *buf, const float *g, size_t n, double gm, double lr, double wd,
                          double mom, bool nesterov, bool first)
{
    for (size_t i = 0; i < n; i++) {
        double gi = g[i] * gm + wd * p[i];
        buf[i] = first ? gi : mom * buf[i] + gi;
        gi = nesterov ? gi + mom * buf[i] : buf[i];
        p[i] -= lr * gi;
    }
}

Test(backend_cpu, sgd_momentum_and_nesterov_two_steps)
{
    seed(24);
    size_t n = 1100;
    for (int nesterov = 0; nesterov < 2; nesterov++) {
        float *hp, *hg;
        struct tensor *p = trand(DT_FP32, n, -1, 1, &hp), *g = trand(DT_FP32, n, -4, 4, &hg);
        struct tensor *buf = tnew(DT_FP32, n), *lowp = tnew(DT_FP16, n);
        struct step_params sp = { .beta1 = 0.9f, .beta2 = 0.999f };
        struct step_scalars sc;
        struct optim_update_args a = { .master = p, .grad = g, .m = buf, .copy = lowp, .sc = &sc,
                                       .weight_decay = 0.01f, .momentum = 0.9f, .nesterov = nesterov };
        double *wp = to_d(hp, n), *wb = dalloc(n);
        for (int step = 0; step < 2; step++) {
            /* the poisoned buffer must not be read on the first step (sc.first_step) */
            step_rule_scalars(&sc, &sp, 0.1f, step + 1, 0.5f);
            cr_assert_eq(sc.first_step, step == 0);
            be->sgd_update(be, &a, 1);
            sgd_reference(wp, wb, hg, n, sc.grad_mul, sc.lr, a.weight_decay, a.momentum, nesterov, step == 0);
            check_f32(p, wp, n, 1e-6, 1e-7, nesterov ? "sgd nesterov master" : "sgd momentum master");
            check_f32(buf, wb, n, 1e-6, 1e-7, "sgd momentum buffer");
            const uint16_t *lb = lowp->data;
            for (size_t i = 0; i < n; i++)
                cr_assert_eq(lb[i], fp16_from_fp32(((float *)p->data)[i]));
        }
    }
    /* plain SGD: no buffer */
    float hp = 1.0f, hg = 2.0f;
    struct step_scalars sc = { .grad_mul = 1, .lr = 0.25f };
    struct optim_update_args s = { .master = tfrom(DT_FP32, 1, &hp), .grad = tfrom(DT_FP32, 1, &hg), .sc = &sc };
    be->sgd_update(be, &s, 1);
    check_f32(s.master, (double[]){ 0.5 }, 1, 0, 0, "p - lr g");
}

/* A skipped step (sc->skip, written by step_finish on non-finite gradients) leaves the master, the
 * moments and the low-precision copy exactly as they were, even with Inf/NaN in the gradient. */
Test(backend_cpu, optimizer_updates_leave_everything_on_a_skipped_step)
{
    seed(25);
    size_t n = 600;
    float *hp, *hg;
    struct tensor *p = trand(DT_FP32, n, -1, 1, &hp), *g = trand(DT_FP32, n, -1, 1, &hg);
    ((float *)g->data)[5] = INFINITY;
    ((float *)g->data)[9] = NAN;
    struct tensor *m = trand(DT_FP32, n, -1, 1, NULL), *v = trand(DT_FP32, n, 0, 1, NULL), *lowp = tnew(DT_BF16, n);
    be->convert(be, lowp, p);
    struct step_params sp = { .beta1 = 0.9f, .beta2 = 0.999f, .weight_decay = 0.1f };
    struct step_scalars sc;
    step_rule_scalars(&sc, &sp, 1e-2f, 3, 0.5f);
    sc.skip = 1;
    struct tensor *ts[4] = { p, m, v, lowp };
    void *before[4];
    for (int k = 0; k < 4; k++) {
        before[k] = malloc(tensor_bytes(ts[k]));
        memcpy(before[k], ts[k]->data, tensor_bytes(ts[k]));
    }
    struct optim_update_args a = { .master = p, .grad = g, .m = m, .v = v, .copy = lowp, .sc = &sc,
                                   .weight_decay = 0.1f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                                   .momentum = 0.9f };
    be->adamw_update(be, &a, 1);
    for (int k = 0; k < 4; k++)
        cr_assert_eq(memcmp(before[k], ts[k]->data, tensor_bytes(ts[k])), 0, "adamw wrote tensor %d on a skip", k);
    a.v = NULL;
    be->sgd_update(be, &a, 1);
    for (int k = 0; k < 4; k++)
        cr_assert_eq(memcmp(before[k], ts[k]->data, tensor_bytes(ts[k])), 0, "sgd wrote tensor %d on a skip", k);
    sc.skip = 0; /* and the same call without the flag does move them: the check above can fail */
    be->sgd_update(be, &a, 1);
    cr_assert_neq(memcmp(before[0], p->data, tensor_bytes(p)), 0);
    for (int k = 0; k < 4; k++)
        free(before[k]);
}

/* One call with several parameters (what optim_step makes) is the same as one call for each, bit for bit:
 * different sizes, decay on some, lowp copies on some, SGD with and without a momentum buffer. */
Test(backend_cpu, optimizer_updates_of_many_tensors_in_one_call_equal_one_at_a_time)
{
    seed(26);
    size_t sizes[4] = { 1, 7, 1000, 4097 };
    for (int kind = 0; kind < 2; kind++) {
        struct tensor *t[2][4][5], *init[4]; /* [pass][tensor][master, grad, m, v, lowp] */
        struct optim_update_args args[2][4];
        for (int i = 0; i < 4; i++) {
            float *h;
            struct tensor *p = init[i] = trand(DT_FP32, sizes[i], -1, 1, &h), *g = trand(DT_FP32, sizes[i], -1, 1, NULL);
            struct tensor *m = trand(DT_FP32, sizes[i], -1, 1, NULL), *v = trand(DT_FP32, sizes[i], 0, 1, NULL);
            for (int pass = 0; pass < 2; pass++) {
                t[pass][i][0] = tfrom(DT_FP32, sizes[i], p->data);
                t[pass][i][1] = g;
                t[pass][i][2] = tfrom(DT_FP32, sizes[i], m->data);
                t[pass][i][3] = tfrom(DT_FP32, sizes[i], v->data);
                t[pass][i][4] = i % 2 ? tnew(i == 1 ? DT_BF16 : DT_FP16, sizes[i]) : NULL;
            }
        }
        struct step_params sp = { .beta1 = 0.9f, .beta2 = 0.99f, .weight_decay = 0.1f };
        struct step_scalars sc;
        for (int pass = 0; pass < 2; pass++)
            for (int i = 0; i < 4; i++)
                args[pass][i] = (struct optim_update_args){
                    .master = t[pass][i][0], .grad = t[pass][i][1], .m = kind == 1 && i == 2 ? NULL : t[pass][i][2],
                    .v = kind == 0 ? t[pass][i][3] : NULL, .copy = t[pass][i][4], .sc = &sc,
                    .weight_decay = i < 2 ? 0.1f : 0.0f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-8f,
                    .momentum = 0.9f, .nesterov = true,
                };
        for (int step = 1; step <= 2; step++) {
            step_rule_scalars(&sc, &sp, 1e-2f, step, 0.5f);
            if (kind == 0) {
                be->adamw_update(be, args[0], 4);
                for (int i = 0; i < 4; i++)
                    be->adamw_update(be, &args[1][i], 1);
            } else {
                be->sgd_update(be, args[0], 4);
                for (int i = 0; i < 4; i++)
                    be->sgd_update(be, &args[1][i], 1);
            }
        }
        for (int i = 0; i < 4; i++)
            for (int k = 0; k < 5; k++)
                if (t[0][i][k] && k != 1)
                    cr_assert_eq(memcmp(t[0][i][k]->data, t[1][i][k]->data, tensor_bytes(t[0][i][k])), 0,
                                 "%s tensor %d part %d", kind ? "sgd" : "adamw", i, k);
        for (int i = 0; i < 4; i++) /* and the weights did move, so the comparison means something */
            cr_assert_neq(memcmp(t[0][i][0]->data, init[i]->data, tensor_bytes(init[i])), 0, "tensor %d moved", i);
    }
}

/* loss_sum: the mean of n fp32 rows in double, added to the accumulator or replacing it. */
Test(backend_cpu, loss_sum_accumulates_means_in_double)
{
    float h[5] = { 1.0f, 2.0f, 4.0f, 1e-8f, 3.0f };
    struct tensor *l = tfrom(DT_FP32, 5, h);
    double acc = 1e300;
    be->loss_sum(be, &acc, l, 4, false);
    cr_assert_eq(acc, (7.0 + (double)1e-8f) / 4.0, "overwrite: rows 0..3 only, in double: %.17g", acc);
    be->loss_sum(be, &acc, l, 2, true);
    cr_assert_eq(acc, (7.0 + (double)1e-8f) / 4.0 + 1.5);
}

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

/* ---- the CUDA backend's module (lib/device_module.h) ---------------------------------------------- */

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

/* ---- bf16 master weights and moments ------------------------------------------------------------ */

/* The same AdamW step with bf16 master, m and v (from bf16-representable values): to nearest, every stored
 * value is the fp32 update's value rounded once; stochastically, one of its two bf16 neighbours (the value
 * itself where representable); the fp32 copy is the stored master widened. */
static void adamw_bf16_case(bool stochastic)
{
    seed(41);
    size_t n = 3000;
    float *hp, *hg, *hm, *hv;
    struct tensor *p16 = trand(DT_BF16, n, -1, 1, &hp), *g = trand(DT_FP32, n, -10, 10, &hg);
    struct tensor *m16 = trand(DT_BF16, n, -0.1f, 0.1f, &hm), *v16 = trand(DT_BF16, n, 0, 0.5f, &hv);
    struct tensor *p32 = tfrom(DT_FP32, n, hp), *m32 = tfrom(DT_FP32, n, hm), *v32 = tfrom(DT_FP32, n, hv);
    struct tensor *wide = tnew(DT_FP32, n);
    struct step_params sp = {.beta1 = 0.9, .beta2 = 0.999, .weight_decay = 0.1f};
    struct step_scalars sc;
    step_rule_scalars(&sc, &sp, 3e-2f, 4, 0.5f);
    struct optim_update_args ref = {.master = p32, .grad = g, .m = m32, .v = v32, .sc = &sc, .weight_decay = 0.1f,
                                    .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8f};
    struct optim_update_args a = ref;
    a.master = p16;
    a.m = m16;
    a.v = v16;
    a.copy = wide;
    a.stochastic = stochastic;
    a.sr_seed = sr_seed(7);
    a.sr_param = 3;
    be->adamw_update(be, &ref, 1);
    be->adamw_update(be, &a, 1);
    const struct tensor *t16[3] = {p16, m16, v16}, *t32[3] = {p32, m32, v32};
    size_t moved_up = 0, inexact = 0;
    for (int k = 0; k < 3; k++) {
        const uint16_t *h = t16[k]->data;
        const float *f = t32[k]->data;
        for (size_t i = 0; i < n; i++) {
            uint16_t near = bf16_from_fp32(f[i]);
            if (!stochastic) {
                cr_assert_eq(h[i], near, "tensor %d [%zu]: 0x%04x, want 0x%04x", k, i, h[i], near);
                continue;
            }
            uint32_t u;
            memcpy(&u, &f[i], sizeof u);
            uint16_t down = (uint16_t)(u >> 16);
            bool exact = (u & 0xFFFF) == 0;
            cr_assert(h[i] == down || (!exact && h[i] == down + 1), "tensor %d [%zu]: 0x%04x not a neighbour of %a", k,
                      i, h[i], (double)f[i]);
            /* and exactly the neighbour the element's draw picks (lib/sround.h), whatever clone stored it */
            const int shift[3] = {SR_WEIGHT, SR_M, SR_V};
            uint16_t want = bf16_round_stochastic(f[i], (uint32_t)(sr_bits(sr_key(a.sr_seed, sc.t, 3), i) >> shift[k]));
            cr_assert_eq(h[i], want, "tensor %d [%zu]: 0x%04x, the draw gives 0x%04x", k, i, h[i], want);
            inexact += !exact;
            moved_up += h[i] == (uint16_t)(down + 1);
        }
    }
    if (stochastic) /* both directions happen (about half of the inexact values go up) */
        cr_assert(moved_up > inexact / 4 && moved_up < inexact * 3 / 4, "%zu of %zu rounded up", moved_up, inexact);
    const uint16_t *h = p16->data;
    const float *w = wide->data;
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(w[i], bf16_to_fp32(h[i]), "the fp32 copy is the stored bf16 master");
}

Test(backend_cpu, adamw_bf16_master_and_moments_round_to_nearest) { adamw_bf16_case(false); }
Test(backend_cpu, adamw_bf16_master_and_moments_round_stochastically) { adamw_bf16_case(true); }

/* Updates below half a bf16 ulp: nearest rounding drops every one of them (the weights never move);
 * stochastic rounding moves the weights by the update on average. SGD, lr * g = 2^-12 against weights in
 * [1, 2), whose bf16 ulp is 2^-7: each weight moves one ulp down with probability 2^-5. */
Test(backend_cpu, sgd_bf16_master_small_updates_survive_only_stochastically)
{
    size_t n = 1 << 16;
    float *hp = malloc(n * sizeof *hp), *hg = malloc(n * sizeof *hg);
    for (size_t i = 0; i < n; i++) {
        hp[i] = 1.0f + (float)(i % 128) * 0x1p-7f; /* bf16 values in [1, 2) */
        hg[i] = 1.0f;
    }
    struct step_params sp = {0};
    struct step_scalars sc;
    step_rule_scalars(&sc, &sp, 0x1p-12f, 1, 1.0f);
    double moved[2] = {0, 0};
    for (int stochastic = 0; stochastic < 2; stochastic++) {
        float *h0 = malloc(n * sizeof *h0);
        memcpy(h0, hp, n * sizeof *h0);
        struct tensor *p = tfrom(DT_BF16, n, h0), *g = tfrom(DT_FP32, n, hg);
        struct optim_update_args a = {.master = p, .grad = g, .sc = &sc, .stochastic = stochastic,
                                      .sr_seed = sr_seed(1234), .sr_param = 0};
        be->sgd_update(be, &a, 1);
        float *after = malloc(n * sizeof *after);
        tensor_to_host_f32(p, after);
        for (size_t i = 0; i < n; i++)
            moved[stochastic] += (double)after[i] - (double)hp[i];
        free(after);
        free(h0);
    }
    double want = -(double)n * 0x1p-12; /* what fp32 weights would move in total */
    cr_assert_eq(moved[0], 0.0, "nearest rounding drops every update below half an ulp");
    /* ups ~ Binomial(n, 2^-5): sd = sqrt(n p (1-p)) ulps; allow 6 sd */
    double sd = sqrt((double)n * 0x1p-5 * (1 - 0x1p-5)) * 0x1p-7;
    cr_assert(fabs(moved[1] - want) < 6 * sd, "stochastic rounding moved %g in total, want %g +- %g", moved[1], want,
              6 * sd);
    free(hp);
    free(hg);
}

/* The trial of an update (optim_update_args.trial) stores nothing and reports, as 1 + its index in the call, the
 * first parameter with a new weight or moment that would be stored non-finite: a learning rate that overflows
 * the weight, a gradient whose square overflows v, a finite fp32 value that bf16 storage rounds to Inf (to
 * nearest and stochastically), SGD's momentum buffer. A clean trial reports 0. (Before, lr 1e38 wrote Inf
 * weights and an unloadable checkpoint.) */
struct trial_case {
    const char *what;
    float p, g, lr;
    enum dtype master, state;
    bool stochastic;
    int64_t want; /* *trial after the call over entries {clean, this} */
};

static void run_trial_case(const struct trial_case *c, bool adamw)
{
    size_t n = 300;
    struct tensor *t[2][4]; /* [entry][master, grad, m, v] */
    struct optim_update_args a[2];
    struct step_params sp = { .beta1 = 0.9, .beta2 = 0.999 };
    struct step_scalars sc;
    step_rule_scalars(&sc, &sp, c->lr, 2, 1.0f);
    sc.check = 1; /* what step_rule_propose asks where its bound proves nothing */
    for (int e = 0; e < 2; e++) {
        float *hp = malloc(n * sizeof *hp), *hg = malloc(n * sizeof *hg), *hz = calloc(n, sizeof *hz);
        for (size_t i = 0; i < n; i++) {
            hp[i] = e == 1 && i == 123 ? c->p : 0.5f;
            hg[i] = e == 1 && i == 123 ? c->g : 0.25f;
        }
        t[e][0] = tfrom(c->master, n, hp);
        t[e][1] = tfrom(DT_FP32, n, hg);
        t[e][2] = tfrom(c->state, n, hz);
        t[e][3] = tfrom(c->state, n, hz);
        a[e] = (struct optim_update_args){ .master = t[e][0], .grad = t[e][1], .m = t[e][2],
                                           .v = adamw ? t[e][3] : NULL, .sc = &sc, .beta1 = 0.9, .beta2 = 0.999,
                                           .eps = 1e-8f, .momentum = 0.9f, .stochastic = c->stochastic,
                                           .sr_seed = sr_seed(7), .sr_param = (uint32_t)e };
        free(hp);
        free(hg);
        free(hz);
    }
    void *before[2][4];
    for (int e = 0; e < 2; e++)
        for (int k = 0; k < 4; k++) {
            before[e][k] = malloc(tensor_bytes(t[e][k]));
            memcpy(before[e][k], t[e][k]->data, tensor_bytes(t[e][k]));
        }
    int64_t trial = 0;
    a[0].trial = a[1].trial = &trial;
    sc.check = 0; /* the step's bound proved it finite: the trial does nothing */
    if (adamw)
        be->adamw_update(be, a, 2);
    else
        be->sgd_update(be, a, 2);
    cr_assert_eq(trial, 0, "%s: a trial ran without sc->check", c->what);
    sc.check = 1;
    if (adamw)
        be->adamw_update(be, a, 2);
    else
        be->sgd_update(be, a, 2);
    cr_assert_eq(trial, c->want, "%s (%s): trial reported %lld, want %lld", c->what, adamw ? "adamw" : "sgd",
                 (long long)trial, (long long)c->want);
    for (int e = 0; e < 2; e++)
        for (int k = 0; k < 4; k++) {
            cr_assert_eq(memcmp(before[e][k], t[e][k]->data, tensor_bytes(t[e][k])), 0, "%s: the trial wrote", c->what);
            free(before[e][k]);
        }
    /* the update itself, where the trial was clean, leaves everything finite (and did move the weights), and
     * raises the state's bound to the largest |weight|, |m| and v it stored, over both entries */
    if (c->want == 0) {
        struct state_bound bound = {0};
        a[0].trial = a[1].trial = NULL;
        a[0].bound = a[1].bound = &bound;
        if (adamw)
            be->adamw_update(be, a, 2);
        else
            be->sgd_update(be, a, 2);
        float *w = malloc(n * sizeof *w), most[3] = {0, 0, 0};
        for (int e = 0; e < 2; e++)
            for (int k = 0; k < 3; k++) {
                if (k == 2 && !adamw)
                    continue;
                int slot = k == 0 ? 0 : k + 1; /* master, m, v */
                tensor_to_host_f32(t[e][slot], w);
                for (size_t i = 0; i < n; i++) {
                    cr_assert(isfinite(w[i]), "%s: tensor %d element %zu is %g after a clean trial", c->what, k, i,
                              w[i]);
                    most[k] = fabsf(w[i]) > most[k] ? fabsf(w[i]) : most[k];
                }
            }
        tensor_to_host_f32(t[0][0], w);
        cr_assert_neq(w[0], 0.5f, "%s: the update moved nothing", c->what);
        /* the bound holds the stored values' maxima (bf16 storage: within its rounding of them) */
        const float got[3] = {bound.pmax, bound.mmax, bound.vmax};
        for (int k = 0; k < (adamw ? 3 : 2); k++)
            cr_assert(got[k] >= most[k] * 0.996f && got[k] <= most[k] * 1.004f, "%s: bound %d is %g, stored max %g",
                      c->what, k, got[k], most[k]);
        free(w);
    }
}

Test(backend_cpu, an_update_trial_reports_the_first_parameter_that_would_go_non_finite)
{
    const struct trial_case adamw_cases[] = {
        { "clean", 1.0f, 1.0f, 1e-3f, DT_FP32, DT_FP32, false, 0 },
        { "lr overflows the weight", 3.4e38f, -1.0f, 1e37f, DT_FP32, DT_FP32, false, 2 },
        /* -lr / (1 - beta1^2) is -Inf in fp32: every weight, and the first entry is named */
        { "lr overflows every weight", 1.0f, 1.0f, 1e38f, DT_FP32, DT_FP32, false, 1 },
        { "g^2 overflows v", 1.0f, 1e21f, 1e-3f, DT_FP32, DT_FP32, false, 2 },
        /* 3.38e38 (bf16: 3.3757e38) + 3e36 x 0.744 (the step's normalised update) = 3.398e38 in bf16 storage, beyond
         * bf16's rounding boundary 3.3961e38; in fp32 storage 3.4023e38, still finite */
        { "fp32 master keeps a large weight", 3.38e38f, -1.0f, 3e36f, DT_FP32, DT_FP32, false, 0 },
        { "bf16 master rounds to Inf", 3.38e38f, -1.0f, 3e36f, DT_BF16, DT_FP32, false, 2 },
        { "bf16 master rounds to Inf, stochastically", 3.38e38f, -1.0f, 3e36f, DT_BF16, DT_FP32, true, 2 },
        { "g^2 overflows v in bf16 state", 1.0f, 3.4e38f, 1e-3f, DT_FP32, DT_BF16, false, 2 },
    };
    for (size_t i = 0; i < sizeof adamw_cases / sizeof adamw_cases[0]; i++)
        run_trial_case(&adamw_cases[i], true);
    const struct trial_case sgd_cases[] = {
        { "clean", 1.0f, 1.0f, 1e-3f, DT_FP32, DT_FP32, false, 0 },
        { "lr overflows the weight", 3.4e38f, -1.0f, 1e37f, DT_FP32, DT_FP32, false, 2 },
        /* 3.2998e38 + 1e37 = 3.3998e38: finite in fp32, beyond bf16's rounding boundary 3.3961e38 */
        { "bf16 master rounds to Inf", 3.3e38f, -1.0f, 1e37f, DT_BF16, DT_FP32, false, 2 },
        { "fp32 master keeps it", 3.3e38f, -1.0f, 1e37f, DT_FP32, DT_FP32, false, 0 },
        { "bf16 momentum rounds to Inf", 1.0f, 3.4e38f, 1e-3f, DT_FP32, DT_BF16, false, 2 },
    };
    for (size_t i = 0; i < sizeof sgd_cases / sizeof sgd_cases[0]; i++)
        run_trial_case(&sgd_cases[i], false);
}

/* The residual add fused into layernorm (norm_args.addend, dsum: a transformer block's r1 = x + proj, h2 =
 * ln2(r1), and backward's dy + ln2's dx) gives the bits of the two ops one after the other, in every dtype the
 * block meets: an fp32 residual stream with a 16-bit branch, and 16-bit all through. Rows of odd length and more
 * rows than one chunk. */
Test(backend_cpu, layernorm_with_its_residual_add_is_the_two_ops_to_the_bit)
{
    seed(71);
    const enum dtype cases[][3] = { /* x (and sum, dx), addend (and dy), dsum */
        { DT_FP32, DT_BF16, DT_FP32 }, { DT_FP32, DT_FP16, DT_FP32 }, { DT_BF16, DT_BF16, DT_BF16 },
        { DT_FP32, DT_FP32, DT_BF16 },
    };
    int64_t rows = 333, cols = 77;
    size_t n = (size_t)(rows * cols);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        enum dtype xd = cases[c][0], ad = cases[c][1], sd = cases[c][2];
        struct tensor *x = trand(xd, n, -2, 2, NULL), *add = trand(ad, n, -1, 1, NULL);
        struct tensor *g = trand(DT_FP32, (size_t)cols, 0.5f, 1.5f, NULL), *bt = trand(DT_FP32, (size_t)cols, -1, 1, NULL);
        struct tensor *dy = trand(ad, n, -1, 1, NULL), *dsum = trand(sd, n, -1, 1, NULL);
        struct tensor *sum[2], *y[2], *mean[2], *rstd[2], *dx[2], *dg[2], *db[2];
        for (int k = 0; k < 2; k++) {
            sum[k] = tnew(xd, n);
            y[k] = tnew(ad, n);
            mean[k] = tnew(DT_FP32, (size_t)rows);
            rstd[k] = tnew(DT_FP32, (size_t)rows);
            dx[k] = tnew(xd, n);
            dg[k] = tnew(DT_FP32, (size_t)cols);
            db[k] = tnew(DT_FP32, (size_t)cols);
        }
        struct norm_args a = { .rows = rows, .cols = cols, .eps = 1e-5f };
        be->add(be, sum[0], x, add); /* the two ops */
        be->layernorm_forward(be, &a, y[0], mean[0], rstd[0], sum[0], g, bt);
        be->layernorm_backward(be, &a, dx[0], dg[0], db[0], dy, sum[0], mean[0], rstd[0], g, 0.0f);
        be->add(be, dx[0], dsum, dx[0]);
        struct norm_args f = a; /* fused */
        f.addend = add;
        f.sum = sum[1];
        be->layernorm_forward(be, &f, y[1], mean[1], rstd[1], x, g, bt);
        struct norm_args fb = a;
        fb.dsum = dsum;
        be->layernorm_backward(be, &fb, dx[1], dg[1], db[1], dy, sum[1], mean[1], rstd[1], g, 0.0f);
        struct tensor *pairs[][2] = { { sum[0], sum[1] }, { y[0], y[1] }, { mean[0], mean[1] }, { rstd[0], rstd[1] },
                                      { dx[0], dx[1] }, { dg[0], dg[1] }, { db[0], db[1] } };
        const char *names[] = { "sum", "y", "mean", "rstd", "dx", "dgamma", "dbeta" };
        for (int k = 0; k < 7; k++)
            cr_assert_eq(memcmp(pairs[k][0]->data, pairs[k][1]->data, tensor_bytes(pairs[k][0])), 0,
                         "case %zu: %s differs from the two ops'", c, names[k]);
    }
}

/* Cross-entropy given dlogits == logits (models/loss.c writes the gradient over the logits): the same losses, marks
 * and gradient bits as into a tensor of its own, in fp32 (read in place: the row is copied first) and bf16; K 1000
 * (the fast path: among 2000 rows some fall back to the formula after the fast gradient has written the row, which
 * fails without the copy) and 9000 (the formula directly). */
Test(backend_cpu, xent_in_place_is_xent_into_another_tensor)
{
    seed(73);
    const enum dtype dts[] = { DT_FP32, DT_BF16 };
    const int64_t Ks[] = { 1000, 9000 };
    for (int d = 0; d < 2; d++)
        for (int k = 0; k < 2; k++) {
            int64_t N = 2000, K = Ks[k];
            size_t n = (size_t)(N * K);
            float *h;
            struct tensor *x = trand(dts[d], n, -8, 8, &h);
            for (int64_t i = 0; i < N; i += 5) /* rows the fast path cannot settle */
                h[i * K + 3] = 250.0f;
            tensor_from_host_f32(x, h);
            struct tensor *copy = tnew(dts[d], n), *dl = tnew(dts[d], n);
            memcpy(copy->data, x->data, tensor_bytes(x));
            int32_t *labels = malloc((size_t)N * sizeof *labels), *c0 = malloc((size_t)N * sizeof *c0);
            int32_t *c1 = malloc((size_t)N * sizeof *c1);
            for (int64_t i = 0; i < N; i++)
                labels[i] = (int32_t)((i * 7919) % K);
            struct tensor *l0 = tnew(DT_FP32, (size_t)N), *l1 = tnew(DT_FP32, (size_t)N);
            float seed_v = 2.0f;
            be->xent_forward_backward(be, l0, c0, dl, x, labels, N, K, &seed_v);
            be->xent_forward_backward(be, l1, c1, copy, copy, labels, N, K, &seed_v);
            cr_assert_eq(memcmp(dl->data, copy->data, tensor_bytes(dl)), 0, "dtype %d K %lld: dlogits differ", d,
                         (long long)K);
            cr_assert_eq(memcmp(l0->data, l1->data, tensor_bytes(l0)), 0, "losses differ");
            cr_assert_eq(memcmp(c0, c1, (size_t)N * sizeof *c0), 0, "marks differ");
            free(labels);
            free(c0);
            free(c1);
        }
}
