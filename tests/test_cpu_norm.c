/*
 * test_cpu_norm.c — the normalisations (kernels/cpu/norm.c): layernorm and batchnorm against naive double versions and
 * finite differences, their outputs against their scalar formulas to the bit, the fused batchnorm + ReLU and
 * layernorm + residual add against the two ops, and the documented order of batchnorm's sums.
 *
 * Each op runs on fresh random inputs from a seeded generator; outputs are poisoned with NaN before each call
 * so an element the backend forgets to write fails (cpu_testlib.h).
 */

#include "cpu_testlib.h" /* be, tnew, tfrom, trand, check_*, fd_grad */

TestSuite(cpu_norm, .init = cpu_test_setup, .fini = cpu_test_teardown);

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

Test(cpu_norm, layernorm_forward_backward)
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

Test(cpu_norm, layernorm_all_equal_row_is_finite)
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

/* Layernorm's outputs and sums as kernels/cpu/norm.c documents them, computed here one row at a time: each
 * row's double sums over its columns in order (mean, then squared deviations; backward: dxhat and dxhat * xhat),
 * everything else in fp32, compared bit for bit. Rows in groups of 8 and a rest (the backend takes 8 rows as the
 * lanes of a vector), columns 8k and 8k + 5 (its tail), with gamma/beta and without, x and dy fp32 and bf16, y also
 * bf16 and fp16 (the fp32 y rounded once); every other row
 * opens with 2^60, seven 200s and -2^60, whose sum depends on the order (batchnorm_sums_in_their_documented_order),
 * the rest are random throughout (where the huge values would hide a wrong small term). */
Test(cpu_norm, layernorm_outputs_are_their_formulas_to_the_bit)
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

Test(cpu_norm, batchnorm_running_stats_after_one_step)
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

Test(cpu_norm, batchnorm_forward_backward)
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
Test(cpu_norm, batchnorm_sums_in_their_documented_order)
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
Test(cpu_norm, batchnorm_with_relu_fused_is_the_two_ops)
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
Test(cpu_norm, batchnorm_outputs_are_their_formulas_to_the_bit)
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

Test(cpu_norm, layernorm_with_its_residual_add_is_the_two_ops_to_the_bit)
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
