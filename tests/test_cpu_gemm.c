/*
 * test_cpu_gemm.c — the matrix products (kernels/cpu/gemm.c): gemm in every dtype, transpose and batch, its GELU and
 * ReLU epilogues, and the bias gradient, against a triple-loop GEMM in double.
 *
 * Each op runs on fresh random inputs from a seeded generator; outputs are poisoned with NaN before each call
 * so an element the backend forgets to write fails (cpu_testlib.h).
 */

#include "cpu_testlib.h" /* be, tnew, tfrom, trand, check_*, fd_grad */

TestSuite(cpu_gemm, .init = cpu_test_setup, .fini = cpu_test_teardown);

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

Test(cpu_gemm, gemm_fp32_all_transposes)
{
    seed(1);
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            run_gemm_case(DT_FP32, DT_FP32, ta, tb, 5, 7, 3, 1, 1.0f, 0.0f, false);
            run_gemm_case(DT_FP32, DT_FP32, ta, tb, 33, 17, 29, 1, 0.5f, 0.0f, false);
        }
}

Test(cpu_gemm, gemm_batch_bias_and_beta_accumulation)
{
    seed(2);
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            run_gemm_case(DT_FP32, DT_FP32, ta, tb, 4, 6, 5, 3, 1.0f, 0.0f, true);
            run_gemm_case(DT_FP32, DT_FP32, ta, tb, 4, 6, 5, 3, 2.0f, 1.0f, false);
            run_gemm_case(DT_FP32, DT_FP32, ta, tb, 4, 6, 5, 2, 1.0f, 0.5f, false);
        }
}

Test(cpu_gemm, gemm_lowp_output_rounded_once)
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
Test(cpu_gemm, gemm_gelu_epilogue_is_gelu_of_the_fp32_product_rounded_once)
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

Test(cpu_gemm, gemm_fp16_overflow_is_inf)
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

Test(cpu_gemm, bias_grad_column_sums)
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
