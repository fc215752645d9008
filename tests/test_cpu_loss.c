/*
 * test_cpu_loss.c — the losses (kernels/cpu/loss.c): cross-entropy (known values, gradient, its formula to the bit, in
 * place), MSE, and the loss sum in double.
 *
 * Each op runs on fresh random inputs from a seeded generator; outputs are poisoned with NaN before each call
 * so an element the backend forgets to write fails (cpu_testlib.h).
 */

#include "cpu_testlib.h" /* be, tnew, tfrom, trand, check_*, fd_grad */

TestSuite(cpu_loss, .init = cpu_test_setup, .fini = cpu_test_teardown);

/* ---- losses ------------------------------------------------------------------------------------ */

Test(cpu_loss, xent_known_values)
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

Test(cpu_loss, xent_gradient_and_lowp_logits)
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
 * the bits the backend must give, whichever way it computes them (kernels/cpu/loss.c, xent_row_fast). */
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
Test(cpu_loss, xent_is_its_formula_to_the_bit)
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

Test(cpu_loss, mse_values_and_gradient)
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

Test(cpu_loss, loss_sum_accumulates_means_in_double)
{
    float h[5] = { 1.0f, 2.0f, 4.0f, 1e-8f, 3.0f };
    struct tensor *l = tfrom(DT_FP32, 5, h);
    double acc = 1e300;
    be->loss_sum(be, &acc, l, 4, false);
    cr_assert_eq(acc, (7.0 + (double)1e-8f) / 4.0, "overwrite: rows 0..3 only, in double: %.17g", acc);
    be->loss_sum(be, &acc, l, 2, true);
    cr_assert_eq(acc, (7.0 + (double)1e-8f) / 4.0 + 1.5);
}

Test(cpu_loss, xent_in_place_is_xent_into_another_tensor)
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

/* A padded vocabulary (backend.h, xent_forward_backward; docs/model.md, "Vocabulary padding"): logits whose rows are
 * S > K elements apart give the losses, marks and dlogits of the dense (N, K) logits to the bit, the padding's dlogits
 * written +0, in place too. The padding holds the row's largest values, so a kernel that lets a padded column into
 * the max, the sum or the argmax moves every loss. Both row paths: K = 300 (the fast one) and 9000 (the formula). */
Test(cpu_loss, xent_padded_rows_give_the_dense_bits)
{
    seed(91);
    const enum dtype dts[] = { DT_FP32, DT_BF16, DT_FP16 };
    const int64_t Ks[] = { 300, 9000 }, Ss[] = { 320, 9024 };
    for (int d = 0; d < 3; d++)
        for (int k = 0; k < 2; k++)
            for (int in_place = 0; in_place < 2; in_place++) {
                const int64_t N = 37, K = Ks[k], S = Ss[k];
                float *h, *hp = falloc((size_t)(N * S));
                struct tensor *x = trand(dts[d], (size_t)(N * K), -8, 8, &h);
                for (int64_t i = 0; i < N; i++)
                    for (int64_t j = 0; j < S; j++)
                        hp[i * S + j] = j < K ? h[i * K + j] : 30.0f + (float)(j - K);
                struct tensor *xp = tfrom(dts[d], (size_t)(N * S), hp);
                struct tensor *dl = tnew(dts[d], (size_t)(N * K));
                struct tensor *dlp = in_place ? xp : tnew(dts[d], (size_t)(N * S));
                int32_t *labels = (int32_t *)falloc((size_t)N), *c0 = (int32_t *)falloc((size_t)N);
                int32_t *c1 = (int32_t *)falloc((size_t)N);
                for (int64_t i = 0; i < N; i++)
                    labels[i] = (int32_t)(urand() * (double)K);
                labels[0] = (int32_t)K - 1; /* the last logical class, next to the padding */
                struct tensor *l0 = tnew(DT_FP32, (size_t)N), *l1 = tnew(DT_FP32, (size_t)N);
                float seed_v = 3.0f;
                be->xent_forward_backward(be, l0, c0, dl, x, labels, N, K, &seed_v);
                be->xent_forward_backward(be, l1, c1, dlp, xp, labels, N, K, &seed_v);
                cr_assert_eq(memcmp(l0->data, l1->data, tensor_bytes(l0)), 0, "dtype %d K %lld: losses differ", d,
                             (long long)K);
                cr_assert_eq(memcmp(c0, c1, (size_t)N * sizeof *c0), 0, "dtype %d K %lld: marks differ", d,
                             (long long)K);
                size_t es = dtype_size(dts[d]);
                for (int64_t i = 0; i < N; i++) {
                    const char *row = (const char *)dlp->data + (size_t)(i * S) * es;
                    cr_assert_eq(memcmp((const char *)dl->data + (size_t)(i * K) * es, row, (size_t)K * es), 0,
                                 "dtype %d K %lld in place %d: row %lld of dlogits differs", d, (long long)K, in_place,
                                 (long long)i);
                    for (int64_t j = K; j < S; j++)
                        for (size_t b = 0; b < es; b++)
                            cr_assert_eq(row[(size_t)j * es + b], 0, "row %lld padding column %lld is not +0",
                                         (long long)i, (long long)j);
                }
                /* eval: no dlogits, the same losses and marks */
                be->xent_forward_backward(be, l1, c1, NULL, tfrom(dts[d], (size_t)(N * S), hp), labels, N, K, NULL);
                cr_assert_eq(memcmp(l0->data, l1->data, tensor_bytes(l0)), 0, "eval: losses differ");
                cr_assert_eq(memcmp(c0, c1, (size_t)N * sizeof *c0), 0, "eval: marks differ");
            }
}
