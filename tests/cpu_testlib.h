/*
 * cpu_testlib.h — what the CPU backend's test suites (tests/test_cpu_*.c, tests/test_backend_cpu.c) share: the
 * backend under test (`be`, opened and closed by cpu_test_setup / cpu_test_teardown, the suites' init and fini),
 * seeded random tensors poisoned with NaN before each call (tnew, tfrom, trand), tolerance checks against a
 * naive double result (check_f32, check_lowp: within max_ulps of the result rounded once, check_out, check_grad),
 * and central finite differences (fd_grad). Memory from talloc/tracked_tensor is freed by the suite's fini.
 */
#ifndef AMP_CPU_TESTLIB_H
#define AMP_CPU_TESTLIB_H
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <criterion/criterion.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "testrand.h" /* seed, urand */
#include "testmem.h"  /* talloc, tracked_tensor, tracked_free_all */
#include "backend.h" /* the interface under test, backend_cpu_create, backend_open */

static struct backend *be; /* the backend under test: cpu_test_setup opens it */

static inline double *dalloc(size_t n)
{
    return talloc(n * sizeof(double));
}

static inline float *falloc(size_t n)
{
    return talloc(n * sizeof(float));
}

static inline void cpu_test_setup(void)
{
    be = backend_cpu_create();
    cr_assert_not_null(be);
}

static inline void cpu_test_teardown(void)
{
    tracked_free_all();
    backend_close(be);
}

/* ---- random inputs ----------------------------------------------------------------------------- */

static inline float frand(float lo, float hi)
{
    return lo + (hi - lo) * (float)urand();
}

/* ---- tensors ----------------------------------------------------------------------------------- */

static inline void poison(struct tensor *t)
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
static inline struct tensor *tnew(enum dtype dt, size_t n)
{
    struct tensor *t = tracked_tensor(be, dt, n);
    poison(t);
    return t;
}

/* A tensor holding h rounded to dt; h is overwritten with the stored values. */
static inline struct tensor *tfrom(enum dtype dt, size_t n, float *h)
{
    struct tensor *t = tnew(dt, n);
    tensor_from_host_f32(t, h);
    tensor_to_host_f32(t, h);
    return t;
}

/* Uniform random values in [lo, hi) as a tensor; *host gets the stored values. */
static inline struct tensor *trand(enum dtype dt, size_t n, float lo, float hi, float **host)
{
    float *h = falloc(n);
    for (size_t i = 0; i < n; i++)
        h[i] = frand(lo, hi);
    struct tensor *t = tfrom(dt, n, h);
    if (host)
        *host = h;
    return t;
}

static inline float *thost(const struct tensor *t)
{
    float *h = falloc(t->numel);
    tensor_to_host_f32(t, h);
    return h;
}

static inline double *to_d(const float *x, size_t n)
{
    double *d = dalloc(n);
    for (size_t i = 0; i < n; i++)
        d[i] = x[i];
    return d;
}

/* ---- comparisons ------------------------------------------------------------------------------- */

static inline uint16_t lowp_bits(float x, enum dtype dt)
{
    return dt == DT_FP16 ? fp16_from_fp32(x) : bf16_from_fp32(x);
}

/* Distance in units in the last place between two 16-bit patterns of the same format. */
static inline int ulp_dist(uint16_t a, uint16_t b)
{
    int ia = a & 0x8000 ? -(int)(a & 0x7FFF) : (int)(a & 0x7FFF);
    int ib = b & 0x8000 ? -(int)(b & 0x7FFF) : (int)(b & 0x7FFF);
    return abs(ia - ib);
}

static inline void check_f32(const struct tensor *t, const double *want, size_t n, double rtol, double atol,
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
static inline void check_lowp(const struct tensor *t, const double *want, size_t n, int max_ulps, double atol,
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

static inline void check_out(const struct tensor *t, const double *want, size_t n, double rtol, double atol,
                      const char *what)
{
    if (t->dtype == DT_FP32)
        check_f32(t, want, n, rtol, atol, what);
    else
        check_lowp(t, want, n, 1, atol, what);
}

static inline void check_grad(const float *got, const double *want, size_t n, double rtol, double atol, const char *what)
{
    for (size_t i = 0; i < n; i++)
        cr_assert(fabs((double)got[i] - want[i]) <= atol + rtol * fabs(want[i]), "%s[%zu]: got %.9g, want %.9g",
                  what, i, (double)got[i], want[i]);
}

/* Central finite differences of f at x (n values), written to grad. */
typedef double loss_fn(const double *x, void *ctx);

static inline void fd_grad(loss_fn *f, void *ctx, double *x, size_t n, double h, double *grad)
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

static inline double dot(const double *a, const double *b, size_t n)
{
    double s = 0.0;
    for (size_t i = 0; i < n; i++)
        s += a[i] * b[i];
    return s;
}

#endif /* AMP_CPU_TESTLIB_H */
