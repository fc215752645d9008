/*
 * test_cpu_gradstats.c — the gradient statistics (kernels/cpu/gradstats.c): non-finite counts per tensor, the finite sum
 * of squares, and count_zeros.
 *
 * Each op runs on fresh random inputs from a seeded generator; outputs are poisoned with NaN before each call
 * so an element the backend forgets to write fails (cpu_testlib.h).
 */

#include "cpu_testlib.h" /* be, tnew, tfrom, trand, check_*, fd_grad */

TestSuite(cpu_gradstats, .init = cpu_test_setup, .fini = cpu_test_teardown);

/* ---- gradient statistics ----------------------------------------------------------------------- */

Test(cpu_gradstats, grad_stats_counts_inf_and_nan_per_tensor)
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

Test(cpu_gradstats, grad_stats_finite_sum_of_squares)
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

Test(cpu_gradstats, count_zeros_counts_both_signs)
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
