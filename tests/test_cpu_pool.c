/*
 * test_cpu_pool.c — pooling (kernels/cpu/pool.c) against direct pooling in double: max and average, forward and backward,
 * ties, NaN, and the 2x2 windows of wide rows (the AVX-512 path where the CPU has it).
 *
 * Each op runs on fresh random inputs from a seeded generator; outputs are poisoned with NaN before each call
 * so an element the backend forgets to write fails (cpu_testlib.h).
 */

#include "cpu_testlib.h" /* be, tnew, tfrom, trand, check_*, fd_grad */

TestSuite(cpu_pool, .init = cpu_test_setup, .fini = cpu_test_teardown);

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

Test(cpu_pool, pool2d_forward_and_backward)
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

Test(cpu_pool, maxpool_ties_go_to_the_first_element)
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
Test(cpu_pool, maxpool_2x2_on_wide_rows_follows_the_rule_exactly)
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
Test(cpu_pool, maxpool_propagates_nan)
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
