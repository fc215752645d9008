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

/* grad_stats in two halves (backend.h, grad_stats_parts and grad_stats_combine), as ranks that each hold some of a
 * gradient's parts run it (dist.zero 1): each tensor cut at part boundaries into pieces computed apart, in an order
 * other than the tensors', the parts put back in their places and combined, give grad_stats' bits, counts and all.
 * The values span 2^-20 to 2^20 so that any other order of the double additions would give other bits. */
Test(cpu_gradstats, parts_combined_give_the_bits_of_grad_stats)
{
    seed(45);
    size_t part = be->grad_part_numel;
    cr_assert_gt(part, 0, "the CPU backend has parts");
    cr_assert(be->grad_stats_parts && be->grad_stats_combine);
    /* smaller than a part, exactly one, several with a short last one, and one of 3 parts with an Inf and a NaN */
    size_t sizes[4] = { 7, part, 2 * part + 1001, 3 * part };
    const struct tensor *grads[4];
    int64_t first[5] = { 0 };
    for (int t = 0; t < 4; t++) {
        float *h;
        grads[t] = trand(DT_FP32, sizes[t], -1, 1, &h);
        for (size_t i = 0; i < sizes[t]; i++)
            h[i] = ldexpf(h[i], (int)(urand() * 41.0) - 20);
        if (t == 3) {
            h[5] = INFINITY;
            h[2 * part + 3] = NAN;
        }
        memcpy(grads[t]->data, h, sizes[t] * sizeof(float));
        first[t + 1] = first[t] + (int64_t)((sizes[t] + part - 1) / part);
    }
    int64_t want_counts[8], counts[8];
    struct grad_check want, got;
    be->grad_stats(be, grads, 4, &want, want_counts);
    /* two "ranks": rank A the first part of every tensor, rank B the rest (empty for the small ones), B first */
    struct tensor va[4], vb[4];
    const struct tensor *a[4], *b[4];
    size_t na = 0, nb = 0;
    for (int t = 0; t < 4; t++) {
        size_t cut = sizes[t] < part ? sizes[t] : part;
        va[t] = *grads[t];
        va[t].numel = cut;
        va[t].shape[0] = (int64_t)cut;
        vb[t] = *grads[t];
        vb[t].data = (float *)grads[t]->data + cut;
        vb[t].numel = sizes[t] - cut;
        vb[t].shape[0] = (int64_t)vb[t].numel;
        a[t] = &va[t];
        b[t] = &vb[t];
        na += 1;
        nb += (size_t)(first[t + 1] - first[t]) - 1;
    }
    struct grad_part *pa = calloc(na, sizeof *pa), *pb = calloc(nb, sizeof *pb), *all = calloc(8, sizeof *all);
    cr_assert(pa && pb && all);
    be->grad_stats_parts(be, b, 4, pb);
    be->grad_stats_parts(be, a, 4, pa);
    size_t ka = 0, kb = 0;
    for (int t = 0; t < 4; t++)
        for (int64_t c = first[t]; c < first[t + 1]; c++)
            all[c] = c == first[t] ? pa[ka++] : pb[kb++];
    cr_assert(ka == na && kb == nb && first[4] == 8);
    be->grad_stats_combine(be, all, first, NULL, 4, &got, counts);
    cr_assert(memcmp(&got.sumsq, &want.sumsq, sizeof got.sumsq) == 0, "sumsq %.17g, grad_stats %.17g", got.sumsq,
              want.sumsq);
    cr_assert(memcmp(&got.absmax, &want.absmax, sizeof got.absmax) == 0);
    cr_assert_eq(got.found_nonfinite, 1);
    cr_assert_eq(want.found_nonfinite, 1);
    cr_assert(memcmp(counts, want_counts, sizeof counts) == 0, "per-tensor counts");
    cr_assert(counts[3] == 1 && counts[7] == 1, "tensor 3: one Inf, one NaN");
    /* the parts are told apart by their place alone: tensor 3's last part (its NaN) put in tensor 2's place */
    struct grad_part tmp = all[4];
    all[4] = all[7];
    all[7] = tmp;
    be->grad_stats_combine(be, all, first, NULL, 4, &got, counts);
    cr_assert(counts[4 + 2] == 1 && counts[4 + 3] == 0, "the NaN counted for tensor 2");
    /* `at` names where each part lies: the swapped parts read from their places give grad_stats' bits again */
    const int64_t at[8] = { 0, 1, 2, 3, 7, 5, 6, 4 };
    be->grad_stats_combine(be, all, first, at, 4, &got, counts);
    cr_assert(memcmp(&got.sumsq, &want.sumsq, sizeof got.sumsq) == 0, "sumsq through at %.17g, grad_stats %.17g",
              got.sumsq, want.sumsq);
    cr_assert(memcmp(counts, want_counts, sizeof counts) == 0, "per-tensor counts through at");
    free(pa);
    free(pb);
    free(all);
}
