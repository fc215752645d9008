/*
 * test_cpu_conv.c — the 2-D convolution (kernels/cpu/conv.c) against a direct convolution in double, its backward against
 * finite differences, and the documented order of its bias and filter sums.
 *
 * Each op runs on fresh random inputs from a seeded generator; outputs are poisoned with NaN before each call
 * so an element the backend forgets to write fails (cpu_testlib.h).
 */

#include "cpu_testlib.h" /* be, tnew, tfrom, trand, check_*, fd_grad */

TestSuite(cpu_conv, .init = cpu_test_setup, .fini = cpu_test_teardown);

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

Test(cpu_conv, conv2d_forward_matches_direct_convolution)
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

Test(cpu_conv, conv2d_backward_matches_finite_differences)
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

Test(cpu_conv, conv2d_backward_lowp)
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
Test(cpu_conv, conv2d_bias_gradient_sums_planes_in_order)
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
Test(cpu_conv, conv2d_filter_gradient_is_the_accumulated_products)
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
Test(cpu_conv, conv2d_bias_is_added_once_after_the_sum)
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
