/*
 * test_fp8.c — precision.mode fp8 on the CPU backend: the scaled casts, the recipes' scale arithmetic
 * (lib/base/fp8.h, Transformer Engine's delayed scaling, torchao's current scaling and the blockwise recipe's
 * power-of-two tile scales), products of fp8 operands (per-tensor and block-scaled), and the linear layer's fp8 path
 * (the weights cast once per optimizer step). Expected values are computed here independently: nearest codes by
 * search over all 256, scales by the formulas as TE and torchao write them (blockwise: by search over the powers of
 * two), products in double from decoded codes.
 */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_testlib.h" /* amp, scratch, SMALL: runs of the binary */
#include "testrand.h" /* seed, urand */
#include "testmem.h"  /* talloc, tracked_tensor, tracked_free_all */
#include "backend.h"
#include "fp8.h"
#include "train.h"    /* trainer_setup, trainer_step: the weight casts of a run, counted */

static struct backend *be;

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

TestSuite(fp8, .init = setup, .fini = teardown);

static float *falloc(size_t n)
{
    return talloc(n * sizeof(float));
}

static enum fp8_format fmt(enum dtype dt)
{
    return dt == DT_FP8_E4M3 ? FP8_E4M3 : FP8_E5M2;
}

/* The code a saturating round-to-nearest-even cast gives for v, found by searching every finite code: the
 * nearest value; of two equally near, the one with an even code (its last mantissa bit 0); beyond the largest
 * finite value, that value. */
static uint8_t nearest_code(double v, enum fp8_format f)
{
    if (isnan(v))
        return 0x7F;
    double max = fp8_max(f);
    if (v >= max)
        return f == FP8_E4M3 ? 0x7E : 0x7B;
    if (v <= -max)
        return f == FP8_E4M3 ? 0xFE : 0xFB;
    int best = -1;
    double bestd = INFINITY;
    for (int c = 0; c < 256; c++) {
        float x = fp8_to_fp32((uint8_t)c, f);
        if (!isfinite(x))
            continue;
        double d = fabs((double)x - v);
        if (d < bestd || (d == bestd && (c & 1) == 0 && (best & 1) == 1)) {
            best = c;
            bestd = d;
        }
    }
    /* zero's sign follows v's */
    if ((best & 0x7F) == 0)
        best = signbit(v) ? 0x80 : 0x00;
    return (uint8_t)best;
}

static struct tensor *host_tensor(enum dtype dt, size_t n)
{
    return tracked_tensor(be, dt, n);
}

Test(fp8, cast_is_the_nearest_code_of_value_times_scale_saturating)
{
    seed(1);
    enum dtype dts[2] = {DT_FP8_E4M3, DT_FP8_E5M2};
    const size_t n = 4000;
    for (int d = 0; d < 2; d++) {
        struct tensor *src = host_tensor(DT_FP32, n), *dst = host_tensor(dts[d], n);
        float *x = src->data;
        for (size_t i = 0; i < n; i++) /* magnitudes from 2^-30 to 2^20: underflow, normal, saturation */
            x[i] = (urand() < 0.5 ? -1.0f : 1.0f) * ldexpf(1.0f + (float)urand(), (int)(urand() * 50) - 30);
        x[0] = INFINITY;
        x[1] = -INFINITY;
        x[2] = NAN;
        x[3] = 0.0f;
        x[4] = -0.0f;
        float scale = 3.7f, scale_inv = 0;
        struct fp8_cast_args a = {.dst = dst, .src = src, .scale = &scale, .scale_inv = &scale_inv};
        be->fp8_cast(be, &a);
        const uint8_t *code = dst->data;
        for (size_t i = 0; i < n; i++) {
            uint8_t want = nearest_code((double)(x[i] * scale), fmt(dts[d]));
            cr_assert_eq(code[i], want, "%s: x %g * %g: code 0x%02x, nearest 0x%02x", dtype_name(dts[d]),
                         (double)x[i], (double)scale, code[i], want);
        }
        cr_assert_eq(scale_inv, 0.0f, "a delayed cast leaves scale_inv to the update");
    }
}

Test(fp8, cast_raises_the_amax_ignoring_nan_and_counting_inf)
{
    float h[6] = {0.25f, -3.0f, NAN, 1.0f, -2.5f, 0.0f};
    struct tensor *src = host_tensor(DT_BF16, 6), *dst = host_tensor(DT_FP8_E4M3, 6);
    tensor_from_host_f32(src, h);
    float scale = 1.0f, inv = 1.0f, amax = 0.5f;
    struct fp8_cast_args a = {.dst = dst, .src = src, .scale = &scale, .scale_inv = &inv, .amax = &amax};
    be->fp8_cast(be, &a);
    cr_assert_eq(amax, 3.0f, "amax %g", (double)amax);
    amax = 7.0f;
    be->fp8_cast(be, &a);
    cr_assert_eq(amax, 7.0f, "the amax is a running max: %g", (double)amax);
    h[3] = -INFINITY;
    tensor_from_host_f32(src, h);
    be->fp8_cast(be, &a);
    cr_assert(isinf(amax), "Inf counts: %g", (double)amax);
}

/* The cast-transpose (backend.h fp8_cast_args.dst_t): on odd shapes (no side a multiple of 32, one row, one column),
 * both formats, both recipes, with the counts: dst_t is the transpose of dst bit for bit, and dst, the amax, the
 * scale and the counts are those of the plain cast, counted once. */
Test(fp8, cast_transpose_writes_the_same_codes_transposed)
{
    seed(46);
    const int64_t shapes[4][2] = {{37, 53}, {1, 70}, {70, 1}, {64, 33}};
    const enum dtype dts[2] = {DT_FP8_E4M3, DT_FP8_E5M2};
    for (int sh = 0; sh < 4; sh++)
        for (int d = 0; d < 2; d++)
            for (int current = 0; current < 2; current++) {
                const int64_t rows = shapes[sh][0], cols = shapes[sh][1];
                const size_t n = (size_t)(rows * cols);
                struct tensor *src = host_tensor(DT_BF16, n), *plain = host_tensor(dts[d], n);
                struct tensor *dst = host_tensor(dts[d], n), *dst_t = host_tensor(dts[d], n);
                float *h = falloc(n);
                for (size_t i = 0; i < n; i++)
                    h[i] = (float)(urand() * 1200.0 - 600.0); /* saturates E4M3 at the delayed scale below */
                tensor_from_host_f32(src, h);
                float st[2][4]; /* scale, scale_inv, amax of the plain cast and of the cast-transpose */
                int64_t counts[2][4] = {{0}};
                for (int k = 0; k < 2; k++) {
                    st[k][0] = 0.75f, st[k][1] = 1.0f, st[k][2] = 3.0f;
                    struct fp8_cast_args a = {.dst = k ? dst : plain, .src = src, .scale = &st[k][0],
                                              .scale_inv = &st[k][1], .amax = &st[k][2], .current = current,
                                              .margin = 1, .counts = counts[k], .dst_t = k ? dst_t : NULL,
                                              .rows = rows, .cols = cols};
                    be->fp8_cast(be, &a);
                }
                const uint8_t *p = plain->data, *c = dst->data, *t = dst_t->data;
                cr_assert_eq(memcmp(p, c, n), 0, "(%lld, %lld) %s: the codes moved", (long long)rows,
                             (long long)cols, dtype_name(dts[d]));
                for (int64_t r = 0; r < rows; r++)
                    for (int64_t j = 0; j < cols; j++)
                        cr_assert_eq(t[j * rows + r], c[r * cols + j],
                                     "(%lld, %lld) %s current %d: dst_t[%lld][%lld] 0x%02x, dst[%lld][%lld] 0x%02x",
                                     (long long)rows, (long long)cols, dtype_name(dts[d]), current, (long long)j,
                                     (long long)r, t[j * rows + r], (long long)r, (long long)j, c[r * cols + j]);
                for (int i = 0; i < 3; i++)
                    cr_assert_eq(st[1][i], st[0][i], "state %d: %g against the plain cast's %g", i, (double)st[1][i],
                                 (double)st[0][i]);
                for (int i = 0; i < 4; i++)
                    cr_assert_eq(counts[1][i], counts[0][i], "counter %d: %lld against %lld", i,
                                 (long long)counts[1][i], (long long)counts[0][i]);
                cr_assert_gt(counts[0][2], 0, "the counts counted");
            }
}

Test(fp8, current_recipe_takes_the_scale_from_this_tensor_in_double)
{
    const size_t n = 5;
    float h[5] = {0.5f, -2.5f, 1.0f, 2.0f, -0.125f};
    struct tensor *src = host_tensor(DT_FP32, n), *dst = host_tensor(DT_FP8_E5M2, n);
    tensor_from_host_f32(src, h);
    float scale = 1.0f, inv = 1.0f;
    for (int margin = 0; margin < 3; margin++) {
        struct fp8_cast_args a = {.dst = dst, .src = src, .scale = &scale, .scale_inv = &inv, .current = true,
                                  .margin = margin};
        be->fp8_cast(be, &a);
        float want = (float)(57344.0 / 2.5 / ldexp(1.0, margin)); /* torchao: fmax / amax in fp64, then fp32 */
        cr_assert_eq(scale, want, "margin %d: scale %.9g, want %.9g", margin, (double)scale, (double)want);
        cr_assert_eq(inv, 1.0f / want);
        /* the largest element lands on (or, with a margin, a power of two below) the format's max */
        cr_assert_eq(fp8_to_fp32(((uint8_t *)dst->data)[1], FP8_E5M2), -(float)ldexp(57344.0, -margin));
    }
    /* all zeros: amax clamped to 1e-12 as torchao does, a finite scale */
    memset(src->data, 0, n * sizeof(float));
    struct fp8_cast_args a = {.dst = dst, .src = src, .scale = &scale, .scale_inv = &inv, .current = true};
    be->fp8_cast(be, &a);
    cr_assert_eq(scale, (float)(57344.0 / 1e-12));
    /* a NaN-only tensor has amax 0 (NaN ignored): the same; an Inf keeps the old scale */
    float old = scale;
    ((float *)src->data)[2] = INFINITY;
    be->fp8_cast(be, &a);
    cr_assert_eq(scale, old, "Inf amax keeps the old scale");
}

/* TE's _default_get_amax_and_update_history and _default_sf_compute, written out for one tensor. */
static float te_scale(const float *hist, int len, int n, int i, int row, bool most_recent, int margin, float fmax,
                      float old)
{
    float amax = hist[row * n + i];
    if (!most_recent)
        for (int r = 0; r < len; r++)
            amax = fmaxf(amax, hist[r * n + i]);
    if (!(amax > 0.0f) || !isfinite(amax))
        return old;
    float sf = fmax / amax;
    return sf / (float)ldexp(1.0, margin);
}

Test(fp8, delayed_update_is_transformer_engines_over_the_history)
{
    seed(2);
    const int len = 4, n = 5;
    for (int mr = 0; mr < 2; mr++)
        for (int margin = 0; margin < 2; margin++)
            for (int row = 0; row < len; row++) {
                float *hist = falloc((size_t)(len * n)), *before = falloc((size_t)(len * n));
                float scale[5], inv[5], old[5];
                for (int i = 0; i < len * n; i++)
                    hist[i] = (float)urand() * 10.0f;
                for (int r = 0; r < len; r++) { /* tensor 3 never seen: keeps its scale; tensor 4 saw Inf */
                    hist[r * n + 3] = 0.0f;
                    hist[r * n + 4] = r == row ? INFINITY : 1.0f;
                }
                for (int i = 0; i < n; i++)
                    scale[i] = old[i] = inv[i] = 0.5f + (float)i;
                memcpy(before, hist, (size_t)(len * n) * sizeof(float));
                struct fp8_update_args a = {.groups = {{.scale = scale, .scale_inv = inv, .history = hist, .n = n,
                                                        .fmax = 448.0f}},
                                            .ngroups = 1, .len = len, .row = row, .most_recent = mr, .margin = margin};
                be->fp8_update(be, &a);
                for (int i = 0; i < n; i++) {
                    float want = te_scale(before, len, n, i, row, mr, margin, 448.0f, old[i]);
                    cr_assert_eq(scale[i], want, "most_recent %d margin %d row %d tensor %d: %.9g, want %.9g", mr,
                                 margin, row, i, (double)scale[i], (double)want);
                    cr_assert_eq(inv[i], 1.0f / want);
                }
                cr_assert_eq(scale[3], old[3]);
                cr_assert_eq(scale[4], old[4]);
                int next = (row + 1) % len;
                for (int r = 0; r < len; r++)
                    for (int i = 0; i < n; i++)
                        cr_assert_eq(hist[r * n + i], r == next ? 0.0f : before[r * n + i],
                                     "row %d: only the next step's row is cleared", r);
            }
}

/* A training step's update reads its step from backend memory (fp8_update_args.step: row = *step mod len) and first
 * folds the step's pending amaxes into that row (fmaxf, then pending zeroed): the bits of the plain update on a history
 * whose row already holds them. Steps 5, 6 and 11 in memory move the row, with the same arguments. */
Test(fp8, delayed_update_reads_the_step_and_the_pending_amaxes_from_memory)
{
    seed(3);
    const int len = 4, n = 6;
    int64_t *step = be->alloc(be, sizeof *step);
    float *pending = be->alloc(be, (size_t)n * sizeof(float));
    cr_assert(step && pending);
    const int64_t steps[3] = {5, 6, 11};
    for (int mr = 0; mr < 2; mr++)
        for (int k = 0; k < 3; k++) {
            int row = (int)(steps[k] % len);
            float *hist = falloc((size_t)(len * n)), *plain = falloc((size_t)(len * n));
            float scale[6], inv[6], scale_p[6], inv_p[6];
            for (int i = 0; i < len * n; i++)
                hist[i] = (float)urand() * 10.0f;
            for (int i = 0; i < n; i++) {
                hist[row * n + i] = 0.0f; /* as the previous step's update left it */
                pending[i] = i == 5 ? 0.0f : (float)urand() * 20.0f; /* tensor 5: not cast this step */
                scale[i] = inv[i] = scale_p[i] = inv_p[i] = 0.5f + (float)i;
            }
            memcpy(plain, hist, (size_t)(len * n) * sizeof(float));
            for (int i = 0; i < n; i++)
                plain[row * n + i] = fmaxf(plain[row * n + i], pending[i]);
            be->upload(be, step, &steps[k], sizeof *step);
            struct fp8_update_args dev = {.groups = {{.scale = scale, .scale_inv = inv, .history = hist,
                                                      .pending = pending, .n = n, .fmax = 57344.0f}},
                                          .ngroups = 1, .len = len, .row = 0, .most_recent = mr, .step = step};
            struct fp8_update_args ref = {.groups = {{.scale = scale_p, .scale_inv = inv_p, .history = plain, .n = n,
                                                      .fmax = 57344.0f}},
                                          .ngroups = 1, .len = len, .row = row, .most_recent = mr};
            be->fp8_update(be, &dev);
            be->fp8_update(be, &ref);
            cr_assert_eq(memcmp(hist, plain, (size_t)(len * n) * sizeof(float)), 0, "step %lld: the history",
                         (long long)steps[k]);
            cr_assert_eq(memcmp(scale, scale_p, sizeof scale), 0, "step %lld: the scales", (long long)steps[k]);
            cr_assert_eq(memcmp(inv, inv_p, sizeof inv), 0, "step %lld: scale_inv", (long long)steps[k]);
            for (int i = 0; i < n; i++)
                cr_assert_eq(pending[i], 0.0f, "pending[%d] is zeroed", i);
        }
    be->free(be, step);
    be->free(be, pending);
}

/* One update call for two groups (different sizes, formats and pending amaxes; the step read from memory) leaves the
 * bits that one call per group leaves: each group's history, pending, scales and scale_inv. */
Test(fp8, one_update_of_two_groups_is_two_updates_of_one)
{
    seed(4);
    const int len = 3, n[2] = {5, 7};
    const float fmax[2] = {448.0f, 57344.0f};
    int64_t *step = be->alloc(be, sizeof *step);
    cr_assert_not_null(step);
    const int64_t steps[2] = {4, 6};
    for (int mr = 0; mr < 2; mr++)
        for (int s = 0; s < 2; s++) {
            *step = steps[s];
            /* per group: history (len * n), pending (n), scale (n), scale_inv (n); [0] one call, [1] two calls */
            float *hist[2][2], *pend[2][2], *scale[2][2], *inv[2][2];
            for (int g = 0; g < 2; g++) {
                hist[0][g] = falloc((size_t)(len * n[g]));
                pend[0][g] = falloc((size_t)n[g]);
                scale[0][g] = falloc((size_t)n[g]);
                inv[0][g] = falloc((size_t)n[g]);
                for (int i = 0; i < len * n[g]; i++)
                    hist[0][g][i] = i % 4 == 0 ? 0.0f : (float)urand() * 100.0f;
                for (int i = 0; i < n[g]; i++) {
                    pend[0][g][i] = i == 2 ? 0.0f : (float)urand() * 300.0f;
                    scale[0][g][i] = inv[0][g][i] = 0.25f + (float)i;
                }
                hist[1][g] = falloc((size_t)(len * n[g]));
                pend[1][g] = falloc((size_t)n[g]);
                scale[1][g] = falloc((size_t)n[g]);
                inv[1][g] = falloc((size_t)n[g]);
                memcpy(hist[1][g], hist[0][g], (size_t)(len * n[g]) * sizeof(float));
                memcpy(pend[1][g], pend[0][g], (size_t)n[g] * sizeof(float));
                memcpy(scale[1][g], scale[0][g], (size_t)n[g] * sizeof(float));
                memcpy(inv[1][g], inv[0][g], (size_t)n[g] * sizeof(float));
            }
            struct fp8_update_args a = {.ngroups = 2, .len = len, .most_recent = mr, .margin = 1, .step = step};
            for (int g = 0; g < 2; g++)
                a.groups[g] = (struct fp8_update_group){.scale = scale[0][g], .scale_inv = inv[0][g],
                                                        .history = hist[0][g], .pending = pend[0][g], .n = n[g],
                                                        .fmax = fmax[g]};
            be->fp8_update(be, &a);
            for (int g = 0; g < 2; g++) {
                struct fp8_update_args one = {.ngroups = 1, .len = len, .most_recent = mr, .margin = 1, .step = step};
                one.groups[0] = (struct fp8_update_group){.scale = scale[1][g], .scale_inv = inv[1][g],
                                                          .history = hist[1][g], .pending = pend[1][g], .n = n[g],
                                                          .fmax = fmax[g]};
                be->fp8_update(be, &one);
            }
            for (int g = 0; g < 2; g++) {
                cr_assert_eq(memcmp(hist[0][g], hist[1][g], (size_t)(len * n[g]) * sizeof(float)), 0,
                             "group %d history (mr %d, step %lld)", g, mr, (long long)steps[s]);
                cr_assert_eq(memcmp(pend[0][g], pend[1][g], (size_t)n[g] * sizeof(float)), 0, "group %d pending", g);
                cr_assert_eq(memcmp(scale[0][g], scale[1][g], (size_t)n[g] * sizeof(float)), 0,
                             "group %d scales (mr %d, step %lld)", g, mr, (long long)steps[s]);
                cr_assert_eq(memcmp(inv[0][g], inv[1][g], (size_t)n[g] * sizeof(float)), 0, "group %d scale_inv", g);
                cr_assert_neq(scale[0][g][0], 0.25f, "group %d: the update moved its first scale", g);
                for (int i = 0; i < n[g]; i++)
                    cr_assert_eq(pend[0][g][i], 0.0f, "group %d pending[%d] is zeroed", g, i);
            }
        }
    be->free(be, step);
}

/* Products of fp8 operands: the exact products of the decoded codes summed (here in double), times alpha and both
 * scale_inv, then the bias, rounded once to C's dtype. The CPU sums in fp32, so fp32 C agrees to ~k ulp and
 * bf16 C to one bf16 ulp. */
static void gemm_case(enum dtype da, enum dtype db, enum dtype dc, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                      bool bias, float beta)
{
    struct tensor *a = host_tensor(da, (size_t)(m * k)), *b = host_tensor(db, (size_t)(k * n));
    struct tensor *c = host_tensor(dc, (size_t)(m * n)), *bt = host_tensor(DT_FP32, (size_t)n);
    uint8_t *ac = a->data, *bc = b->data;
    for (int64_t i = 0; i < m * k; i++)
        do ac[i] = (uint8_t)(urand() * 256); while (!isfinite(fp8_to_fp32(ac[i], fmt(da))));
    for (int64_t i = 0; i < k * n; i++)
        do bc[i] = (uint8_t)(urand() * 256); while (!isfinite(fp8_to_fp32(bc[i], fmt(db))));
    float sa = 0.0123f, sb = 3.5f;
    a->scale_inv = &sa;
    b->scale_inv = &sb;
    float *bh = bt->data, *c0 = falloc((size_t)(m * n));
    for (int64_t j = 0; j < n; j++)
        bh[j] = (float)urand() - 0.5f;
    for (int64_t i = 0; i < m * n; i++)
        c0[i] = (float)urand();
    tensor_from_host_f32(c, c0);
    tensor_to_host_f32(c, c0);
    float alpha = 0.75f;
    struct gemm_args g = {.a = a, .b = b, .c = c, .bias = bias ? bt : NULL, .trans_a = ta, .trans_b = tb, .m = m,
                          .n = n, .k = k, .alpha = alpha, .beta = beta, .batch = 1};
    be->gemm(be, &g);
    float *got = falloc((size_t)(m * n));
    tensor_to_host_f32(c, got);
    double f = (double)(alpha * sa * sb);
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            double s = 0, mag = 0;
            for (int64_t p = 0; p < k; p++) {
                double x = fp8_to_fp32(ac[ta ? p * m + i : i * k + p], fmt(da));
                double y = fp8_to_fp32(bc[tb ? j * k + p : p * n + j], fmt(db));
                s += x * y;
                mag += fabs(x * y);
            }
            double want = f * s + (bias ? bh[j] : 0.0) + beta * c0[i * n + j];
            double tol = f * mag * 1e-6 + fabs(want) * (dc == DT_BF16 ? 1.0 / 128 : 1e-6) + 1e-30;
            cr_assert(fabs(got[i * n + j] - want) <= tol, "%s x %s -> %s ta %d tb %d (%lld, %lld): %.9g, want %.9g",
                      dtype_name(da), dtype_name(db), dtype_name(dc), ta, tb, (long long)i, (long long)j,
                      (double)got[i * n + j], want);
        }
}

Test(fp8, gemm_of_fp8_operands_is_the_scaled_sum_of_exact_products)
{
    seed(3);
    enum dtype pairs[3][2] = {{DT_FP8_E4M3, DT_FP8_E4M3}, {DT_FP8_E5M2, DT_FP8_E4M3}, {DT_FP8_E4M3, DT_FP8_E5M2}};
    for (int p = 0; p < 3; p++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) {
                gemm_case(pairs[p][0], pairs[p][1], DT_FP32, ta, tb, 7, 9, 33, false, 0.0f);
                gemm_case(pairs[p][0], pairs[p][1], DT_FP32, ta, tb, 7, 9, 33, false, 1.0f); /* dW accumulating */
                gemm_case(pairs[p][0], pairs[p][1], DT_BF16, ta, tb, 7, 9, 33, true, 0.0f);
            }
}

/* The fp8 GEMM's bf16 result is the fp32 one rounded once: the scale and the bias are applied before the one
 * rounding, not after a first one. */
Test(fp8, gemm_bf16_output_is_the_fp32_output_rounded_once)
{
    seed(4);
    const int64_t m = 16, n = 24, k = 40;
    struct tensor *a = host_tensor(DT_FP8_E4M3, (size_t)(m * k)), *b = host_tensor(DT_FP8_E4M3, (size_t)(k * n));
    struct tensor *c16 = host_tensor(DT_BF16, (size_t)(m * n)), *c32 = host_tensor(DT_FP32, (size_t)(m * n));
    struct tensor *bias = host_tensor(DT_FP32, (size_t)n);
    for (int64_t i = 0; i < m * k; i++)
        ((uint8_t *)a->data)[i] = (uint8_t)(urand() * 126);
    for (int64_t i = 0; i < k * n; i++)
        ((uint8_t *)b->data)[i] = (uint8_t)(urand() * 126) | (urand() < 0.5 ? 0x80 : 0);
    for (int64_t j = 0; j < n; j++)
        ((float *)bias->data)[j] = (float)urand();
    float sa = 1.0f / 448, sb = 0.37f;
    a->scale_inv = &sa;
    b->scale_inv = &sb;
    struct gemm_args g = {.a = a, .b = b, .c = c32, .bias = bias, .trans_b = false, .m = m, .n = n, .k = k,
                          .alpha = 1.0f, .batch = 1};
    be->gemm(be, &g);
    g.c = c16;
    be->gemm(be, &g);
    const uint16_t *h = c16->data;
    const float *f = c32->data;
    for (int64_t i = 0; i < m * n; i++)
        cr_assert_eq(h[i], bf16_from_fp32(f[i]), "element %lld", (long long)i);
}

/* ---- the recipe in a run ------------------------------------------------------------------------- */

static float *read_dataset(const char *path, const char *name, size_t *n)
{
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    cr_assert(f >= 0, "cannot open %s", path);
    hid_t d = H5Dopen2(f, name, H5P_DEFAULT);
    cr_assert(d >= 0, "%s: no dataset %s", path, name);
    hid_t sp = H5Dget_space(d);
    *n = (size_t)H5Sget_simple_extent_npoints(sp);
    float *v = malloc(*n * sizeof *v);
    cr_assert_not_null(v);
    cr_assert(H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v) >= 0);
    H5Sclose(sp);
    H5Dclose(d);
    H5Fclose(f);
    return v;
}

/* After 3 steps of the delayed recipe with a 2-step history and amax_compute most_recent, each tensor's scale is
 * fmax over the last step's amax (row 2 mod 2), the row the next step writes is clear, and the scales moved from 1.
 * (With `max` the cleared row, the window's oldest, took part in the last update: the unit tests above check it.) */
static void check_delayed_state(const char *ckpt, const char *group, float fmax, int len, int64_t steps)
{
    char name[64];
    size_t ns, nh;
    snprintf(name, sizeof name, "/fp8/%s/scale", group);
    float *scale = read_dataset(ckpt, name, &ns);
    snprintf(name, sizeof name, "/fp8/%s/amax_history", group);
    float *hist = read_dataset(ckpt, name, &nh);
    cr_assert_eq(nh, ns * (size_t)len, "%s: history %zu for %zu tensors", group, nh, ns);
    int last = (int)((steps - 1) % len), next = (int)(steps % len);
    for (size_t i = 0; i < ns; i++) {
        float amax = hist[(size_t)last * ns + i];
        cr_assert_gt(amax, 0.0f, "%s tensor %zu: no amax recorded", group, i);
        cr_assert_eq(hist[(size_t)next * ns + i], 0.0f, "%s tensor %zu: the next step's row is not clear", group, i);
        cr_assert_eq(scale[i], fmax / amax, "%s tensor %zu: scale %.9g, fmax / amax %.9g", group, i, (double)scale[i],
                     (double)(fmax / amax));
        cr_assert_neq(scale[i], 1.0f);
    }
    free(scale);
    free(hist);
}

Test(fp8, a_delayed_run_keeps_transformer_engines_scales_in_its_checkpoint)
{
    make_scratch();
    struct result r = amp("run configs/fashion_mlp.yaml " SMALL " precision.mode=fp8 precision.fp8.amax_history_len=2 "
                          "precision.fp8.amax_compute=most_recent 'precision.fp8.keep_bf16=[]' "
                          "'precision.fp8.min_size=[0,0]' run.steps=3 run.out_dir=%s/a", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char ckpt[512];
    snprintf(ckpt, sizeof ckpt, "%s/a/ckpt-3.h5", scratch);
    check_delayed_state(ckpt, "fwd", 448.0f, 2, 3);   /* fc1, fc2, head: input and weight each */
    check_delayed_state(ckpt, "bwd", 57344.0f, 2, 3); /* their output gradients */
    size_t n;
    float *s = read_dataset(ckpt, "/fp8/fwd/scale", &n);
    cr_assert_eq(n, 6);
    free(s);
    s = read_dataset(ckpt, "/fp8/bwd/scale", &n);
    cr_assert_eq(n, 3);
    free(s);
    remove_scratch();
}

/* What `check` says: the default keeps the first and last layers with parameters in bf16, and the products of the
 * others too where they are below precision.fp8.min_size (text_gpt's, at width 128, all are). */
Test(fp8, check_lists_the_fp8_layers_and_the_kept_ones)
{
    struct result r = amp("check configs/text_gpt.yaml precision.mode=fp8");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "layers in fp8: block0 block1\n"), "%s", r.out);
    cr_assert(strstr(r.out, "kept in bf16 (precision.fp8.keep_bf16): lm_head\n"), "%s", r.out);
    cr_assert(strstr(r.out, "products kept in bf16 (smaller): block0/attn/qkv (K 128, N 384) block0/attn/proj "
                            "(K 128, N 128) block0/mlp/fc (K 128, N 512) block0/mlp/proj (K 512, N 128) block1/"), "%s",
              r.out);
    r = amp("check configs/text_gpt.yaml precision.mode=fp8 'precision.fp8.min_size=[0,0]'");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "): block0/attn/qkv (K 128, N 384) block0/attn/proj (K 128, N 128) "), "%s", r.out);
    cr_assert(strstr(r.out, "products kept in bf16 (smaller): none\n"), "%s", r.out);
    r = amp("check configs/fashion_mlp.yaml precision.mode=fp8 precision.fp8.recipe=current");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "fp8: recipe current"), "%s", r.out);
    cr_assert(strstr(r.out, "layers in fp8: fc2\n"), "%s", r.out);
    cr_assert(strstr(r.out, "kept in bf16 (precision.fp8.keep_bf16): fc1 head\n"), "%s", r.out);
}

/* precision.fp8.loss_scale: none by default; static and dynamic as the fp16 modes (the key is there for those who
 * want one). The scale column of scale_log.csv shows which. */
static void scales_of_run(const char *extra, double *scales, int n)
{
    make_scratch();
    struct result r = amp("run configs/fashion_mlp.yaml " SMALL " precision.mode=fp8 "
                          "'precision.fp8.min_size=[0,0]' %s run.steps=%d run.out_dir=%s/a",
                          extra, n, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char path[512], line[1024];
    snprintf(path, sizeof path, "%s/a/scale_log.csv", scratch);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f);
    cr_assert_not_null(fgets(line, sizeof line, f)); /* header */
    for (int i = 0; i < n; i++) {
        cr_assert_not_null(fgets(line, sizeof line, f), "row %d", i);
        char *c = strchr(strchr(strchr(line, ',') + 1, ',') + 1, ','); /* step,epoch,loss,scale */
        scales[i] = strtod(c + 1, NULL);
    }
    fclose(f);
    remove_scratch();
}

Test(fp8, the_loss_scale_is_none_static_or_dynamic)
{
    double s[5];
    scales_of_run("", s, 5);
    for (int i = 0; i < 5; i++)
        cr_assert_eq(s[i], 1.0, "none: step %d scale %g", i + 1, s[i]);
    scales_of_run("precision.fp8.loss_scale=static precision.loss_scale.value=64", s, 5);
    for (int i = 0; i < 5; i++)
        cr_assert_eq(s[i], 64.0, "static: step %d scale %g", i + 1, s[i]);
    scales_of_run("precision.fp8.loss_scale=dynamic precision.loss_scale.init=4 precision.loss_scale.growth_interval=2",
                  s, 5);
    const double want[5] = {4, 4, 8, 8, 16};
    for (int i = 0; i < 5; i++)
        cr_assert_eq(s[i], want[i], "dynamic: step %d scale %g, want %g", i + 1, s[i], want[i]);
}

/* ampTrain numerics' counters of a cast: saturated (of all), flushed to zero and nonzero (NaN and 0 in neither),
 * all elements; a running sum */
Test(fp8, cast_counts_saturated_flushed_and_nonzero_elements)
{
    float h[7] = {1000.0f, 1e-4f, 1.0f, 0.0f, NAN, -2000.0f, -448.0f};
    struct tensor *src = host_tensor(DT_FP32, 7), *dst = host_tensor(DT_FP8_E4M3, 7);
    tensor_from_host_f32(src, h);
    float scale = 1.0f, inv = 1.0f;
    int64_t counts[4] = {1, 2, 3, 4};
    struct fp8_cast_args a = {.dst = dst, .src = src, .scale = &scale, .scale_inv = &inv, .counts = counts};
    be->fp8_cast(be, &a);
    /* 1000 and -2000 saturate (448 does not: it is the max); 1e-4 is below E4M3's smallest subnormal's half */
    cr_assert_eq(counts[0], 1 + 2);
    cr_assert_eq(counts[1], 2 + 1);
    cr_assert_eq(counts[2], 3 + 5);
    cr_assert_eq(counts[3], 4 + 7);
    /* E5M2 holds 1000 and 2000; at scale 1e-3, 1 lands on 2^-10 (normal in E5M2), 1e-4 x 1e-3 flushes */
    struct tensor *d5 = host_tensor(DT_FP8_E5M2, 7);
    memset(counts, 0, sizeof counts);
    scale = 1e-3f;
    a.dst = d5;
    be->fp8_cast(be, &a);
    cr_assert_eq(counts[0], 0);
    cr_assert_eq(counts[1], 1);
    cr_assert_eq(counts[2], 5);
}

/* `ampTrain numerics` on an fp8 run reports the run's own casts; with recipe current no cast can saturate (the
 * tensor's amax lands on the format's max), and every fp8 tensor of the model is listed. */
Test(fp8, numerics_reports_the_casts_at_the_runs_scales)
{
    make_scratch();
    struct result r = amp("numerics configs/fashion_mlp.yaml " SMALL " precision.mode=fp8 precision.fp8.recipe=current "
                          "'precision.fp8.keep_bf16=[]' 'precision.fp8.min_size=[0,0]' --steps 2 run.out_dir=%s/n", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    const char *section = strstr(r.out, "fp8 casts of this run (recipe current");
    cr_assert(section, "%s", r.out);
    const char *names[] = {"fc1/input", "fc1/weight", "fc2/input", "fc2/weight", "head/input", "head/weight",
                           "fc1/grad_output", "fc2/grad_output", "head/grad_output"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        const char *line = strstr(section, names[i]);
        cr_assert(line, "%s missing:\n%s", names[i], r.out);
        char fmt[16];
        double scale, sat;
        cr_assert_eq(sscanf(line + strlen(names[i]), "%15s %lf %lf%%", fmt, &scale, &sat), 3, "%s", line);
        cr_assert_str_eq(fmt, strstr(names[i], "grad_output") ? "e5m2" : "e4m3");
        cr_assert_eq(sat, 0.0, "%s saturates under current scaling: %s", names[i], line);
        cr_assert_gt(scale, 0.0);
    }
    char csv[512];
    snprintf(csv, sizeof csv, "%s/n/numerics-from-step-0.csv", scratch);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "grep -c ',fp8_cast,' %s", csv);
    struct result g = shell(cmd);
    cr_assert_eq(atoi(g.out), 2 * 9, "fp8_cast rows: %s", g.out);
    remove_scratch();
}

/* ---- weights cast once per optimizer step ----------------------------------------------------------- */

#define FASHION "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"

/* The trainer's fp8 casts, counted (its backend table patched in place): all of them, and those of a weight (the
 * source is a parameter's master); and its scale updates, with the groups and tensors they covered. */
static struct {
    void (*fp8_cast)(struct backend *, const struct fp8_cast_args *);
    void (*fp8_block_cast)(struct backend *, const struct fp8_block_cast_args *);
    void (*fp8_update)(struct backend *, const struct fp8_update_args *);
    const struct model *m;
    int casts, weight_casts;
    int updates, update_groups, update_tensors;
} counted;

static void count_cast_of(const void *src)
{
    counted.casts++;
    for (int i = 0; i < counted.m->nparams; i++)
        if (src == counted.m->params[i]->master.data)
            counted.weight_casts++;
}

static void counting_fp8_block_cast(struct backend *b, const struct fp8_block_cast_args *a)
{
    count_cast_of(a->src->data);
    counted.fp8_block_cast(b, a);
}

static void counting_fp8_cast(struct backend *b, const struct fp8_cast_args *a)
{
    count_cast_of(a->src->data);
    counted.fp8_cast(b, a);
}

static void counting_fp8_update(struct backend *b, const struct fp8_update_args *a)
{
    counted.updates++;
    counted.update_groups += a->ngroups;
    for (int k = 0; k < a->ngroups; k++)
        counted.update_tensors += a->groups[k].n;
    counted.fp8_update(b, a);
}

/* Every parameter's FP32 master, in parameter order, in one malloc'd array of *n floats. */
static float *copy_masters(const struct model *m, size_t *n)
{
    *n = 0;
    for (int i = 0; i < m->nparams; i++)
        *n += m->params[i]->master.numel;
    float *w = malloc(*n * sizeof(float));
    cr_assert_not_null(w);
    size_t off = 0;
    for (int i = 0; i < m->nparams; i++) {
        memcpy(w + off, m->params[i]->master.data, m->params[i]->master.numel * sizeof(float));
        off += m->params[i]->master.numel;
    }
    return w;
}

struct fp8_run {
    int casts, weight_casts;
    int updates, update_groups, update_tensors; /* the scale updates (backend fp8_update calls) */
    int slots;                                  /* the fp8 tensors of both groups */
    float *weights; /* every master, concatenated */
    size_t nweights;
    float scales[64]; /* the forward group's scales, then the backward group's */
    double loss[8];
};

/* configs/fashion_mlp.yaml at 784-64-32-10, every layer in fp8 (however small), `steps` steps of accum_steps 4. recast: the
 * reference, which casts the weights at every micro-batch. */
static void fp8_accum_run(const char *recipe, bool recast, int steps, struct fp8_run *out)
{
    setenv("OPENBLAS_NUM_THREADS", "1", 1);
    struct config cfg;
    struct amp_error err = {0};
    cr_assert_eq(config_load(&cfg, AMP_SOURCE_DIR "/configs/fashion_mlp.yaml", &err), AMP_OK, "%s", err.msg);
    char rec[64];
    snprintf(rec, sizeof rec, "precision.fp8.recipe=%s", recipe);
    const char *ov[] = {"run.device=cpu", "model.layers.1.out=64", "model.layers.3.out=32", "data.batch_size=16",
                        "accum_steps=4", "precision.mode=fp8", "precision.fp8.keep_bf16=[]",
                        "precision.fp8.min_size=[0, 0]", rec,
                        "run.log_every=1", NULL};
    for (int i = 0; ov[i]; i++)
        cr_assert_eq(config_apply_override(&cfg, ov[i], &err), AMP_OK, "%s: %s", ov[i], err.msg);
    cr_assert_eq(config_finalize(&cfg, &err), AMP_OK, "%s", err.msg);
    struct trainer t;
    cr_assert_eq(trainer_setup(&t, &cfg, NULL, &err), AMP_OK, "%s", err.msg);
    cr_assert(t.model.has_fp8);
    t.model.fp8.recast_weights = recast;
    counted = (__typeof__(counted)){.fp8_cast = t.be->fp8_cast, .fp8_block_cast = t.be->fp8_block_cast,
                                    .fp8_update = t.be->fp8_update, .m = &t.model};
    t.be->fp8_cast = counting_fp8_cast;
    t.be->fp8_block_cast = counting_fp8_block_cast;
    t.be->fp8_update = counting_fp8_update;
    for (int i = 0; i < steps; i++) {
        cr_assert_eq(trainer_step(&t, &err), AMP_OK, "%s", err.msg);
        cr_assert_eq(trainer_flush(&t, &err), AMP_OK, "%s", err.msg);
        cr_assert_eq(t.nrecs, 1);
        out->loss[i] = t.recs[0].loss;
    }
    t.be->fp8_cast = counted.fp8_cast;
    t.be->fp8_block_cast = counted.fp8_block_cast;
    t.be->fp8_update = counted.fp8_update;
    out->casts = counted.casts;
    out->weight_casts = counted.weight_casts;
    out->updates = counted.updates;
    out->update_groups = counted.update_groups;
    out->update_tensors = counted.update_tensors;
    out->slots = t.model.fp8.fwd.n + t.model.fp8.bwd.n;
    out->weights = copy_masters(&t.model, &out->nweights);
    const struct fp8_state *f = &t.model.fp8;
    cr_assert_leq(f->fwd.n + f->bwd.n, 64);
    memcpy(out->scales, f->fwd.scale, (size_t)f->fwd.n * sizeof(float));
    memcpy(out->scales + f->fwd.n, f->bwd.scale, (size_t)f->bwd.n * sizeof(float));
    trainer_teardown(&t);
    config_free(&cfg);
}

/* With accum_steps 4 each layer's weight is cast once per optimizer step, not once per micro-batch, and the run
 * is bit for bit the reference that casts it at every micro-batch (the codes kept are the ones a cast would make
 * again: same weights, same scale), under both recipes. Its scales moved (the delayed recipe's after each step,
 * the current recipe's at each cast), so a kept code that outlived its step would show. */
Test(fp8, weights_are_cast_once_per_optimizer_step)
{
    if (access(FASHION, R_OK) != 0)
        cr_skip_test("Fashion-MNIST not installed (Debian package dataset-fashion-mnist)");
    const char *recipes[] = {"delayed", "current"};
    const int steps = 3, layers = 3, accum = 4;
    for (int r = 0; r < 2; r++) {
        struct fp8_run kept = {0}, ref = {0};
        fp8_accum_run(recipes[r], false, steps, &kept);
        fp8_accum_run(recipes[r], true, steps, &ref);
        cr_assert_eq(kept.weight_casts, steps * layers, "%s: %d weight casts in %d steps of %d layers", recipes[r],
                     kept.weight_casts, steps, layers);
        cr_assert_eq(ref.weight_casts, steps * accum * layers, "%s: the reference casts at every micro-batch",
                     recipes[r]);
        /* the inputs and output gradients are still cast at every micro-batch */
        cr_assert_eq(kept.casts - kept.weight_casts, steps * accum * 2 * layers, "%s", recipes[r]);
        cr_assert_eq(ref.casts - ref.weight_casts, kept.casts - kept.weight_casts, "%s", recipes[r]);
        cr_assert_eq(kept.nweights, ref.nweights);
        cr_assert_eq(memcmp(kept.weights, ref.weights, kept.nweights * sizeof(float)), 0, "%s: weights after %d steps",
                     recipes[r], steps);
        cr_assert_eq(memcmp(kept.scales, ref.scales, sizeof kept.scales), 0, "%s: fp8 scales", recipes[r]);
        cr_assert_eq(memcmp(kept.loss, ref.loss, sizeof kept.loss), 0, "%s: losses", recipes[r]);
        cr_assert_neq(kept.scales[1], 1.0f, "%s: fc1/weight's scale never moved", recipes[r]);
        free(kept.weights);
        free(ref.weights);
    }
}

/* The delayed recipe's scale update is one backend call a step for every fp8 tensor of the model (one launch on a
 * GPU): both groups, every slot, whatever accum_steps; recipe current has no update. */
Test(fp8, a_delayed_step_updates_every_scale_in_one_call)
{
    if (access(FASHION, R_OK) != 0)
        cr_skip_test("Fashion-MNIST not installed (Debian package dataset-fashion-mnist)");
    const int steps = 3;
    struct fp8_run delayed = {0}, current = {0};
    fp8_accum_run("delayed", false, steps, &delayed);
    fp8_accum_run("current", false, steps, &current);
    cr_assert_eq(delayed.updates, steps, "%d update calls in %d steps", delayed.updates, steps);
    cr_assert_eq(delayed.update_groups, 2 * steps, "each call updates both groups (forward E4M3, backward E5M2)");
    cr_assert_eq(delayed.slots, 9, "3 layers: input and weight forward, output gradient backward");
    cr_assert_eq(delayed.update_tensors, delayed.slots * steps, "each call covers every fp8 tensor");
    cr_assert_eq(current.updates, 0, "recipe current keeps no history to update");
    free(delayed.weights);
    free(current.weights);
}

/* ---- the size rule: products too small to gain stay bf16 ------------------------------------------ */

struct sized_run {
    void *y[2];           /* after step 1: fc1's and fc2's outputs (bf16, their bytes) */
    size_t ybytes[2];
    float *weights;       /* after all steps: every master, concatenated */
    size_t nweights;
    int fwd_slots;        /* fp8 tensors of the forward (inputs and weights of the fp8 products) */
};

/* configs/fashion_mlp.yaml at 784-64-96-10 (fc1 K 784 N 64, fc2 K 64 N 96, head K 96 N 10), no layer kept in bf16
 * by name, `steps` steps under the overrides `mode` (space-separated KEY=VALUE). */
static void sized_run(const char *mode, int steps, struct sized_run *out)
{
    setenv("OPENBLAS_NUM_THREADS", "1", 1);
    struct config cfg;
    struct amp_error err = {0};
    cr_assert_eq(config_load(&cfg, AMP_SOURCE_DIR "/configs/fashion_mlp.yaml", &err), AMP_OK, "%s", err.msg);
    char words[512];
    snprintf(words, sizeof words, "run.device=cpu model.layers.1.out=64 model.layers.3.out=96 data.batch_size=16 "
                                  "run.log_every=1 precision.fp8.keep_bf16=[] %s", mode);
    for (char *w = strtok(words, " "); w; w = strtok(NULL, " "))
        cr_assert_eq(config_apply_override(&cfg, w, &err), AMP_OK, "%s: %s", w, err.msg);
    cr_assert_eq(config_finalize(&cfg, &err), AMP_OK, "%s", err.msg);
    struct trainer t;
    cr_assert_eq(trainer_setup(&t, &cfg, NULL, &err), AMP_OK, "%s", err.msg);
    cr_assert_str_eq(t.model.layers[1].cfg.name, "fc1");
    cr_assert_str_eq(t.model.layers[3].cfg.name, "fc2");
    out->fwd_slots = t.model.fp8.fwd.n;
    for (int i = 0; i < steps; i++) {
        cr_assert_eq(trainer_step(&t, &err), AMP_OK, "%s", err.msg);
        cr_assert_eq(trainer_flush(&t, &err), AMP_OK, "%s", err.msg);
        for (int k = 0; i == 0 && k < 2; k++) {
            const struct tensor *y = &t.model.layers[1 + 2 * k].y;
            cr_assert_eq(y->dtype, DT_BF16);
            out->ybytes[k] = tensor_bytes(y);
            out->y[k] = malloc(out->ybytes[k]);
            cr_assert_not_null(out->y[k]);
            memcpy(out->y[k], y->data, out->ybytes[k]);
        }
    }
    out->weights = copy_masters(&t.model, &out->nweights);
    trainer_teardown(&t);
    config_free(&cfg);
}

static void sized_free(struct sized_run *r)
{
    free(r->y[0]);
    free(r->y[1]);
    free(r->weights);
}

/* precision.fp8.min_size [1000, 80] puts fc2 (N 96) alone in fp8: fc1 (K 784, N 64), which runs before it, gives
 * the bf16 run's bits, and fc2 does not. Under the default rule (K > 4096 or N > 1024) none of these products is
 * large enough: the fp8 run is the bf16 run, bit for bit, over 3 steps. */
Test(fp8, products_below_min_size_stay_bf16)
{
    if (access(FASHION, R_OK) != 0)
        cr_skip_test("Fashion-MNIST not installed (Debian package dataset-fashion-mnist)");
    struct sized_run bf16 = {0}, mixed = {0}, rule = {0};
    sized_run("precision.mode=bf16", 3, &bf16);
    sized_run("precision.mode=fp8 precision.fp8.min_size=[1000,80]", 1, &mixed);
    sized_run("precision.mode=fp8", 3, &rule);
    cr_assert_eq(mixed.fwd_slots, 2, "fc2's input and weight alone are fp8 tensors");
    cr_assert_eq(mixed.ybytes[0], bf16.ybytes[0]);
    cr_assert_eq(memcmp(mixed.y[0], bf16.y[0], bf16.ybytes[0]), 0, "fc1 is below min_size: its output is bf16's");
    cr_assert_neq(memcmp(mixed.y[1], bf16.y[1], bf16.ybytes[1]), 0, "fc2 ran in fp8: its output is not bf16's");
    cr_assert_eq(rule.fwd_slots, 0, "no product is large enough under the default rule");
    cr_assert_eq(rule.nweights, bf16.nweights);
    cr_assert_eq(memcmp(rule.weights, bf16.weights, bf16.nweights * sizeof(float)), 0, "weights after 3 steps");
    for (int k = 0; k < 2; k++)
        cr_assert_eq(memcmp(rule.y[k], bf16.y[k], bf16.ybytes[k]), 0);
    sized_free(&bf16);
    sized_free(&mixed);
    sized_free(&rule);
}

/* What `check` says of the same model: the products in fp8 and those kept in bf16, with their sizes. */
Test(fp8, check_lists_the_products_in_fp8_and_those_too_small)
{
    if (access(FASHION, R_OK) != 0)
        cr_skip_test("Fashion-MNIST not installed (Debian package dataset-fashion-mnist)");
    struct result r = amp("check configs/fashion_mlp.yaml precision.mode=fp8 model.layers.1.out=64 "
                          "model.layers.3.out=96 'precision.fp8.keep_bf16=[]' 'precision.fp8.min_size=[1000,80]'");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "  products in fp8 (weight N x K with K > 1000 or N > 80, precision.fp8.min_size "
                            "[1000, 80]): fc2 (K 64, N 96)\n"), "%s", r.out);
    cr_assert(strstr(r.out, "  products kept in bf16 (smaller): fc1 (K 784, N 64) head (K 96, N 10)\n"), "%s", r.out);
    cr_assert(!strstr(r.out, "no product runs in fp8"), "%s", r.out);
    /* the default rule: none of them, and a warning that the run is bf16 */
    r = amp("check configs/fashion_mlp.yaml precision.mode=fp8 'precision.fp8.keep_bf16=[]'");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "K > 4096 or N > 1024, precision.fp8.min_size [4096, 1024]): none\n"), "%s", r.out);
    cr_assert(strstr(r.out, "no product runs in fp8 (see precision.fp8.keep_bf16 and precision.fp8.min_size); the "
                            "run is bf16"), "%s", r.out);
}

/* Checkpoint `path`'s /config without its precision.fp8.min_size line, as a checkpoint written before the key;
 * re-sealed. */
static void drop_min_size(const char *path)
{
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    cr_assert(f >= 0, "cannot open %s", path);
    hid_t d = H5Dopen2(f, "config", H5P_DEFAULT);
    hid_t t = H5Dget_type(d);
    size_t n = H5Tget_size(t);
    char *text = calloc(n + 1, 1);
    cr_assert_not_null(text);
    cr_assert(H5Dread(d, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, text) >= 0);
    H5Tclose(t);
    H5Dclose(d);
    char *key = strstr(text, "min_size:");
    cr_assert_not_null(key, "%s", text);
    char *start = key, *end = strchr(key, '\n');
    while (start > text && start[-1] != '\n')
        start--;
    cr_assert_not_null(end);
    memmove(start, end + 1, strlen(end + 1) + 1);
    cr_assert(H5Ldelete(f, "config", H5P_DEFAULT) >= 0);
    t = H5Tcopy(H5T_C_S1);
    H5Tset_size(t, strlen(text));
    H5Tset_strpad(t, H5T_STR_NULLPAD);
    H5Tset_cset(t, H5T_CSET_UTF8);
    hid_t sp = H5Screate(H5S_SCALAR);
    d = H5Dcreate2(f, "config", t, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    cr_assert(d >= 0 && H5Dwrite(d, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, text) >= 0);
    H5Dclose(d);
    H5Sclose(sp);
    H5Tclose(t);
    H5Fclose(f);
    free(text);
    reseal(path);
}

/* A checkpoint written before precision.fp8.min_size ran every product of its fp8 layers in fp8: it resumes so (its
 * config read with min_size [0, 0]), bit for bit the run that never stopped, not under the default rule, which would
 * have put its small products in bf16 and dropped their scales without a word. */
Test(fp8, a_checkpoint_from_before_min_size_resumes_with_every_product_in_fp8)
{
    make_scratch();
    const char *run = "run configs/fashion_mlp.yaml " SMALL " precision.mode=fp8 'precision.fp8.keep_bf16=[]' "
                      "'precision.fp8.min_size=[0,0]' precision.fp8.amax_history_len=4";
    struct result r = amp("%s run.steps=4 run.out_dir=%s/a", run, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp("%s run.steps=2 run.out_dir=%s/b", run, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char ckpt[512], a[512], b[512];
    snprintf(ckpt, sizeof ckpt, "%s/b/ckpt-2.h5", scratch);
    drop_min_size(ckpt);
    r = amp("inspect %s", ckpt);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp("resume %s run.steps=4", ckpt);
    cr_assert_eq(r.code, 0, "%s", r.out);
    snprintf(a, sizeof a, "%s/a/ckpt-4.h5", scratch);
    snprintf(b, sizeof b, "%s/b/ckpt-4.h5", scratch);
    cr_assert_geq(assert_same_tensors(a, b), 6);
    snprintf(a, sizeof a, "%s/a/scale_log.csv", scratch);
    snprintf(b, sizeof b, "%s/b/scale_log.csv", scratch);
    assert_same_logs(a, b);
    snprintf(b, sizeof b, "%s/b/ckpt-4.h5", scratch);
    size_t n;
    float *s = read_dataset(b, "/fp8/fwd/scale", &n);
    cr_assert_eq(n, 6, "the three products' inputs and weights");
    free(s);
    remove_scratch();
}

/* ---- recipe blockwise ------------------------------------------------------------------------------------ */

/* The scale the recipe gives a tile of amax `amax` (double, NaN ignored), found here by search: the largest
 * power of two 2^e, e in [-126, 126], with amax * 2^e <= 448; 1 for an amax of 0 or Inf. Returns e (scale 2^e). */
static int tile_exponent(double amax)
{
    if (amax == 0.0 || isinf(amax))
        return 0;
    int e = 126;
    while (e > -126 && ldexp(amax, e) > 448.0)
        e--;
    return e;
}

/* Tile (tr rows, tc columns) of a (rows, cols) matrix that element (r, c) is in, and that tile's scale index,
 * as docs/precision.md lays them out: 1x128 tiles along rows, 128x1 down columns, 128x128 blocks, row-major. */
static int64_t tile_scale_index(enum fp8_tiling t, int64_t rows, int64_t cols, int64_t r, int64_t c)
{
    int64_t row_tiles = (rows + 127) / 128, col_tiles = (cols + 127) / 128;
    (void)row_tiles;
    if (t == FP8_TILES_ROWS)
        return r * col_tiles + c / 128;
    if (t == FP8_TILES_COLS)
        return (r / 128) * cols + c;
    return (r / 128) * col_tiles + c / 128;
}

/* A (rows, cols) fp32 matrix whose 16-row, 16-column patches have magnitudes 2^-12 to 2^14, and whose 128x128
 * blocks differ by powers of 2^5 too, so that the tiles of every tiling get scales of their own. */
static float *varied_matrix(int64_t rows, int64_t cols)
{
    float *x = falloc((size_t)(rows * cols));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            int e = (int)(((r / 16) * 7 + (c / 16) * 3) % 17) - 12 + 5 * (int)((r / 128 + c / 128) % 3);
            x[r * cols + c] = (float)(urand() * 2.0 - 1.0) * ldexpf(1.0f, e);
        }
    return x;
}

/* Each tile's codes are the nearest E4M3 codes of value * 2^e, 2^e the largest power of two that keeps the tile's
 * amax within 448, and its scale_inv is 2^-e, exactly; an all-zero tile gets 1, a NaN is left out of the amax. The
 * matrix is 130 x 300, so every tiling has partial tiles at the edges. */
Test(fp8, block_cast_gives_each_tile_its_power_of_two_scale_and_nearest_codes)
{
    seed(11);
    const int64_t rows = 130, cols = 300;
    const enum fp8_tiling tilings[3] = {FP8_TILES_ROWS, FP8_TILES_COLS, FP8_BLOCKS};
    const int64_t tr[3] = {1, 128, 128}, tc[3] = {128, 1, 128};
    for (int t = 0; t < 3; t++) {
        float *x = varied_matrix(rows, cols);
        for (int64_t c = 128; c < 256; c++) /* a zero tile in every tiling: row 129, columns 128..255 */
            x[129 * cols + c] = 0.0f;
        for (int64_t r = 128; r < 130; r++)
            for (int64_t c = 128; c < 256; c++)
                x[r * cols + c] = 0.0f;
        x[5 * cols + 7] = NAN;
        struct tensor *src = host_tensor(DT_FP32, (size_t)(rows * cols)), *dst = host_tensor(DT_FP8_E4M3,
                                                                                             (size_t)(rows * cols));
        memcpy(src->data, x, (size_t)(rows * cols) * sizeof(float));
        int64_t ns = fp8_tiling_scales(tilings[t], rows, cols);
        cr_assert_eq(ns, t == 0 ? rows * 3 : t == 1 ? 2 * cols : 2 * 3);
        float *inv = falloc((size_t)ns);
        struct fp8_block_cast_args a = { .dst = dst, .src = src, .rows = rows, .cols = cols, .tiling = tilings[t],
                                         .scale_inv = inv };
        be->fp8_block_cast(be, &a);
        const uint8_t *code = dst->data;
        int other = 0, e0 = INT32_MIN; /* tiles whose scale is not the first tile's */
        for (int64_t r0 = 0; r0 < rows; r0 += tr[t])
            for (int64_t c0 = 0; c0 < cols; c0 += tc[t]) {
                int64_t r1 = r0 + tr[t] < rows ? r0 + tr[t] : rows, c1 = c0 + tc[t] < cols ? c0 + tc[t] : cols;
                double amax = 0;
                for (int64_t r = r0; r < r1; r++)
                    for (int64_t c = c0; c < c1; c++)
                        if (!isnan(x[r * cols + c]))
                            amax = fmax(amax, fabs((double)x[r * cols + c]));
                int e = tile_exponent(amax);
                int64_t si = tile_scale_index(tilings[t], rows, cols, r0, c0);
                cr_assert_eq(inv[si], ldexpf(1.0f, -e), "tiling %d tile (%lld, %lld): scale_inv %g, want 2^%d", t,
                             (long long)r0, (long long)c0, (double)inv[si], -e);
                e0 = e0 == INT32_MIN ? e : e0;
                other += e != e0;
                for (int64_t r = r0; r < r1; r++)
                    for (int64_t c = c0; c < c1; c++) {
                        uint8_t want = nearest_code(ldexp((double)x[r * cols + c], e), FP8_E4M3);
                        cr_assert_eq(code[r * cols + c], want, "tiling %d (%lld, %lld): code 0x%02x, want 0x%02x", t,
                                     (long long)r, (long long)c, code[r * cols + c], want);
                    }
            }
        cr_assert_gt(other, 1, "tiling %d: the scales hardly vary; the test would not see a tile's mix-up", t);
        cr_assert_eq(inv[tile_scale_index(tilings[t], rows, cols, 129, 128)], 1.0f, "tiling %d: zero tile", t);
    }
}

/* The recipe's scale rule at its edges: a power of two exactly at 448 / amax, the clamps, 0, Inf and NaN. */
Test(fp8, block_scale_is_the_largest_power_of_two_within_448)
{
    cr_assert_eq(fp8_block_scale(448.0f), 1.0f);
    cr_assert_eq(fp8_block_scale(7.0f), 64.0f);                   /* 448 / 7 = 64 exactly */
    cr_assert_eq(fp8_block_scale(nextafterf(7.0f, 8.0f)), 32.0f); /* just above: the next power down */
    cr_assert_eq(fp8_block_scale(nextafterf(7.0f, 0.0f)), 64.0f);
    cr_assert_eq(fp8_block_scale(1.0f), 256.0f);
    cr_assert_eq(fp8_block_scale(0.0f), 1.0f);
    cr_assert_eq(fp8_block_scale(INFINITY), 1.0f);
    cr_assert_eq(fp8_block_scale(NAN), 1.0f);
    cr_assert_eq(fp8_block_scale(1e-44f), ldexpf(1.0f, 126)); /* clamped: its inverse stays a normal number */
    cr_assert_eq(fp8_block_scale(3.4e38f), ldexpf(1.0f, -120));
}

/* One block-scaled product: op(A) (m, k) and op(B) (k, n) from fp32 matrices cast with the tilings given. */
struct block_case {
    bool ta, tb;
    enum fp8_tiling at, bt;
    enum dtype c;
    bool bias;
    float alpha, beta;
};

/* The product of block-scaled operands, against (1) the documented order computed here, bit for bit, and (2) the
 * exact sum in double of the decoded values times their scales, within a bound: each 128-wide block's exact sum is
 * rounded once to fp32 (error <= u times the block's sum of |products|), times a power of two (exact), into an fp32
 * accumulator (blocks - 1 roundings), then alpha and the bias (one rounding each): with u = 2^-24 and
 * g = (blocks + 3) u / (1 - (blocks + 3) u), |C - exact| <= g * sum |a_i b_i| * scales (+ beta * C's own rounding
 * and, for a bf16 C, half a bf16 ulp). */
static void block_gemm_case(struct block_case bc, int64_t m, int64_t n, int64_t k)
{
    const int64_t ar = bc.ta ? k : m, ac = bc.ta ? m : k, br = bc.tb ? n : k, bcl = bc.tb ? k : n;
    float *xa = varied_matrix(ar, ac), *xb = varied_matrix(br, bcl);
    struct tensor *sa = host_tensor(DT_FP32, (size_t)(ar * ac)), *sb = host_tensor(DT_FP32, (size_t)(br * bcl));
    struct tensor *a = host_tensor(DT_FP8_E4M3, (size_t)(ar * ac)), *b = host_tensor(DT_FP8_E4M3, (size_t)(br * bcl));
    memcpy(sa->data, xa, (size_t)(ar * ac) * sizeof(float));
    memcpy(sb->data, xb, (size_t)(br * bcl) * sizeof(float));
    float *ia = falloc((size_t)fp8_tiling_scales(bc.at, ar, ac)), *ib = falloc((size_t)fp8_tiling_scales(bc.bt, br, bcl));
    be->fp8_block_cast(be, &(struct fp8_block_cast_args){ .dst = a, .src = sa, .rows = ar, .cols = ac,
                                                            .tiling = bc.at, .scale_inv = ia });
    be->fp8_block_cast(be, &(struct fp8_block_cast_args){ .dst = b, .src = sb, .rows = br, .cols = bcl,
                                                            .tiling = bc.bt, .scale_inv = ib });
    struct tensor *c = host_tensor(bc.c, (size_t)(m * n)), *bias = host_tensor(DT_FP32, (size_t)n);
    float *c0 = falloc((size_t)(m * n)), *bh = bias->data;
    for (int64_t i = 0; i < m * n; i++)
        c0[i] = (float)urand() - 0.5f;
    for (int64_t j = 0; j < n; j++)
        bh[j] = (float)urand() - 0.5f;
    tensor_from_host_f32(c, c0);
    struct gemm_args g = { .a = a, .b = b, .c = c, .bias = bc.bias ? bias : NULL, .trans_a = bc.ta, .trans_b = bc.tb,
                           .m = m, .n = n, .k = k, .alpha = bc.alpha, .beta = bc.beta, .batch = 1,
                           .a_blocks = { ia, bc.at }, .b_blocks = { ib, bc.bt } };
    be->gemm(be, &g);
    float *got = falloc((size_t)(m * n));
    tensor_to_host_f32(c, got);
    const uint8_t *acode = a->data, *bcode = b->data;
    const int64_t blocks = (k + 127) / 128;
    const double u = ldexp(1.0, -24), gam = (blocks + 3) * u / (1 - (blocks + 3) * u);
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            float acc = 0.0f;
            double exact = 0, mag = 0;
            for (int64_t blk = 0; blk < blocks; blk++) {
                double se = 0, sm = 0; /* exact: products of E4M3 values are multiples of 2^-18 below 2^18 */
                for (int64_t p = blk * 128; p < k && p < blk * 128 + 128; p++) {
                    int64_t ra = bc.ta ? p : i, ca = bc.ta ? i : p, rb = bc.tb ? j : p, cb = bc.tb ? p : j;
                    float va = fp8_to_fp32(acode[ra * ac + ca], FP8_E4M3), vb = fp8_to_fp32(bcode[rb * bcl + cb], FP8_E4M3);
                    se += (double)va * vb;
                    sm += fabs((double)va * vb);
                }
                int64_t p0 = blk * 128, ra = bc.ta ? p0 : i, ca = bc.ta ? i : p0, rb = bc.tb ? j : p0, cb = bc.tb ? p0 : j;
                float f = ia[tile_scale_index(bc.at, ar, ac, ra, ca)] * ib[tile_scale_index(bc.bt, br, bcl, rb, cb)];
                acc += (float)se * f;
                exact += se * f;
                mag += sm * f;
            }
            float mine = bc.alpha * acc;
            if (bc.bias)
                mine += bh[j];
            double want = bc.alpha * exact + (bc.bias ? bh[j] : 0) + bc.beta * c0[i * n + j];
            double tol = gam * fabs(bc.alpha) * mag + (bc.bias ? u * fabs(want) : 0) + u * fabs(bc.beta * c0[i * n + j]) +
                         (bc.c == DT_BF16 ? fabs(want) / 256 : 0) + 1e-37;
            cr_assert(fabs(got[i * n + j] - want) <= tol, "ta %d tb %d (%lld, %lld): %.9g, exact %.9g, bound %.3g",
                      bc.ta, bc.tb, (long long)i, (long long)j, (double)got[i * n + j], want, tol);
            if (bc.c == DT_FP32 && bc.beta == 0.0f)
                cr_assert_eq(got[i * n + j], mine, "ta %d tb %d (%lld, %lld): %.9g, the documented order %.9g", bc.ta,
                             bc.tb, (long long)i, (long long)j, (double)got[i * n + j], (double)mine);
            if (bc.c == DT_BF16 && bc.beta == 0.0f)
                cr_assert_eq(((const uint16_t *)c->data)[i * n + j], bf16_from_fp32(mine), "bf16 (%lld, %lld)",
                             (long long)i, (long long)j);
        }
}

/* The three products of a linear layer: y = x W^T (x in 1x128 tiles, W in blocks), dW = dy^T x (both in 128x1
 * tiles: K is the rows) and dx = dy W (dy in 1x128 tiles, W in blocks); K 300, so the last block of K is partial,
 * and outputs fp32 (bit for bit the documented order), bf16 with a bias, and fp32 accumulated into (beta 1). */
Test(fp8, block_scaled_products_follow_the_documented_order_within_the_derived_bound)
{
    seed(12);
    const struct block_case cases[] = {
        {.ta = false, .tb = true, .at = FP8_TILES_ROWS, .bt = FP8_BLOCKS, .c = DT_FP32, .alpha = 1.0f},
        {.ta = false, .tb = true, .at = FP8_TILES_ROWS, .bt = FP8_BLOCKS, .c = DT_BF16, .bias = true, .alpha = 1.0f},
        {.ta = true, .tb = false, .at = FP8_TILES_COLS, .bt = FP8_TILES_COLS, .c = DT_FP32, .alpha = 1.0f},
        {.ta = true, .tb = false, .at = FP8_TILES_COLS, .bt = FP8_TILES_COLS, .c = DT_FP32, .alpha = 1.0f, .beta = 1.0f},
        {.ta = false, .tb = false, .at = FP8_TILES_ROWS, .bt = FP8_BLOCKS, .c = DT_BF16, .alpha = 1.0f},
        {.ta = false, .tb = true, .at = FP8_BLOCKS, .bt = FP8_TILES_ROWS, .c = DT_FP32, .alpha = 0.75f},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        block_gemm_case(cases[i], 9, 140, 300);
}

/* The attribute `recipe` of a checkpoint's /fp8, and how many links the group holds. */
static void fp8_group_of(const char *path, char *recipe, size_t len, hsize_t *links)
{
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    cr_assert(f >= 0, "cannot open %s", path);
    hid_t g = H5Gopen2(f, "fp8", H5P_DEFAULT);
    cr_assert(g >= 0, "%s: no /fp8", path);
    H5G_info_t info;
    cr_assert(H5Gget_info(g, &info) >= 0);
    *links = info.nlinks;
    hid_t a = H5Aopen(g, "recipe", H5P_DEFAULT);
    cr_assert(a >= 0, "%s: /fp8 has no recipe", path);
    hid_t t = H5Aget_type(a);
    size_t n = H5Tget_size(t);
    cr_assert_lt(n, len);
    hid_t mt = H5Tcopy(t);
    memset(recipe, 0, len);
    cr_assert(H5Aread(a, mt, recipe) >= 0);
    H5Tclose(mt);
    H5Tclose(t);
    H5Aclose(a);
    H5Gclose(g);
    H5Fclose(f);
}

/* Recipe blockwise on the small MLP with every product in fp8 (K 784: seven blocks, the last of 16; dW's K, the
 * batch of 32, one partial tile): two runs give the same bits, 2 steps then `resume` give the 4-step run's bits,
 * and the checkpoint's /fp8 holds its attributes and nothing else (no scale state to carry). */
Test(fp8, a_blockwise_run_is_deterministic_resumes_bit_exactly_and_keeps_no_scales)
{
    if (access(FASHION, R_OK) != 0)
        cr_skip_test("Fashion-MNIST not installed (Debian package dataset-fashion-mnist)");
    make_scratch();
    const char *mode = "precision.mode=fp8 precision.fp8.recipe=blockwise 'precision.fp8.keep_bf16=[]' "
                       "'precision.fp8.min_size=[0,0]' run.log_every=1";
    struct result r = amp("run configs/fashion_mlp.yaml " SMALL " %s run.steps=4 run.out_dir=%s/a", mode, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp("run configs/fashion_mlp.yaml " SMALL " %s run.steps=4 run.threads=2 run.out_dir=%s/b", mode, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp("run configs/fashion_mlp.yaml " SMALL " %s run.steps=2 run.out_dir=%s/c", mode, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp("resume %s/c/ckpt-2.h5 run.steps=4", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "resumed from"), "%s", r.out);
    char a[512], b[512];
    snprintf(a, sizeof a, "%s/a/ckpt-4.h5", scratch);
    for (int i = 0; i < 2; i++) {
        snprintf(b, sizeof b, "%s/%s/ckpt-4.h5", scratch, i ? "c" : "b");
        cr_assert_geq(assert_same_tensors(a, b), 6);
    }
    snprintf(a, sizeof a, "%s/a/scale_log.csv", scratch);
    snprintf(b, sizeof b, "%s/c/scale_log.csv", scratch);
    assert_same_logs(a, b);
    /* and it is not the delayed recipe's run, nor bf16's */
    r = amp("run configs/fashion_mlp.yaml " SMALL " precision.mode=fp8 'precision.fp8.keep_bf16=[]' "
            "'precision.fp8.min_size=[0,0]' run.steps=4 run.out_dir=%s/d", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    snprintf(a, sizeof a, "%s/a/ckpt-4.h5", scratch);
    snprintf(b, sizeof b, "%s/d/ckpt-4.h5", scratch);
    size_t na, nd;
    float *wa = read_dataset(a, "/model/fc1/weight", &na), *wd = read_dataset(b, "/model/fc1/weight", &nd);
    cr_assert_eq(na, nd);
    cr_assert_neq(memcmp(wa, wd, na * sizeof *wa), 0, "blockwise trained as delayed did");
    free(wa);
    free(wd);
    char recipe[32];
    hsize_t links;
    fp8_group_of(a, recipe, sizeof recipe, &links);
    cr_assert_str_eq(recipe, "blockwise");
    cr_assert_eq(links, 0, "/fp8 of a blockwise run holds %llu datasets or groups", (unsigned long long)links);
    remove_scratch();
}

/* `check` names the recipe and the format of every cast; an unknown recipe is refused naming the key (exit 2). */
Test(fp8, check_names_recipe_blockwise_and_refuses_unknown_recipes)
{
    struct result r = amp("check configs/fashion_mlp.yaml precision.mode=fp8 precision.fp8.recipe=blockwise");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "fp8: recipe blockwise (a power-of-two scale per 1x128 tile of inputs and output "
                            "gradients and per 128x128 block of weights, from its amax at the cast); E4M3 inputs, "
                            "weights and output gradients, bf16 results\n"), "%s", r.out);
    const char *bad[] = {"blockwize", "block", "128x128", ""};
    for (int i = 0; i < 4; i++) {
        r = amp("check configs/fashion_mlp.yaml precision.mode=fp8 'precision.fp8.recipe=%s'", bad[i]);
        cr_assert_eq(r.code, 2, "recipe '%s': exit %d\n%s", bad[i], r.code, r.out);
        cr_assert(strstr(r.out, "precision.fp8.recipe"), "recipe '%s': the key is not named\n%s", bad[i], r.out);
    }
    /* the delayed recipe's keys and margin mean nothing to it: a warning, not a silent no-op */
    r = amp("check configs/fashion_mlp.yaml precision.mode=fp8 precision.fp8.recipe=blockwise precision.fp8.margin=2");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "do not apply to recipe blockwise"), "%s", r.out);
}

/* The size rule under recipe blockwise: with the default min_size no product of this model is large enough and
 * the run is bf16's, bit for bit; with [1000, 80] fc2 alone runs in fp8 (fc1, before it, gives bf16's output). */
Test(fp8, blockwise_products_below_min_size_stay_bf16)
{
    if (access(FASHION, R_OK) != 0)
        cr_skip_test("Fashion-MNIST not installed (Debian package dataset-fashion-mnist)");
    struct sized_run bf16 = {0}, mixed = {0}, rule = {0};
    sized_run("precision.mode=bf16", 3, &bf16);
    sized_run("precision.mode=fp8 precision.fp8.recipe=blockwise precision.fp8.min_size=[1000,80]", 1, &mixed);
    sized_run("precision.mode=fp8 precision.fp8.recipe=blockwise", 3, &rule);
    cr_assert_eq(mixed.fwd_slots, 2, "fc2's input and weight alone are fp8 tensors");
    cr_assert_eq(memcmp(mixed.y[0], bf16.y[0], bf16.ybytes[0]), 0, "fc1 is below min_size: its output is bf16's");
    cr_assert_neq(memcmp(mixed.y[1], bf16.y[1], bf16.ybytes[1]), 0, "fc2 ran in fp8: its output is not bf16's");
    cr_assert_eq(rule.fwd_slots, 0);
    cr_assert_eq(rule.nweights, bf16.nweights);
    cr_assert_eq(memcmp(rule.weights, bf16.weights, bf16.nweights * sizeof(float)), 0, "weights after 3 steps");
    sized_free(&bf16);
    sized_free(&mixed);
    sized_free(&rule);
}

/* Recipe blockwise keeps a weight's codes and block scales for the step's other micro-batches too, and the run is
 * bit for bit the reference that casts the weight at every micro-batch; x and dy are cast twice a micro-batch
 * (along their rows and down their columns). */
Test(fp8, blockwise_weights_are_cast_once_per_optimizer_step)
{
    if (access(FASHION, R_OK) != 0)
        cr_skip_test("Fashion-MNIST not installed (Debian package dataset-fashion-mnist)");
    const int steps = 3, layers = 3, accum = 4;
    struct fp8_run kept = {0}, ref = {0};
    fp8_accum_run("blockwise", false, steps, &kept);
    fp8_accum_run("blockwise", true, steps, &ref);
    cr_assert_eq(kept.weight_casts, steps * layers, "%d weight casts in %d steps of %d layers", kept.weight_casts,
                 steps, layers);
    cr_assert_eq(ref.weight_casts, steps * accum * layers);
    cr_assert_eq(kept.casts - kept.weight_casts, steps * accum * 4 * layers);
    cr_assert_eq(ref.casts - ref.weight_casts, kept.casts - kept.weight_casts);
    cr_assert_eq(kept.nweights, ref.nweights);
    cr_assert_eq(memcmp(kept.weights, ref.weights, kept.nweights * sizeof(float)), 0, "weights after %d steps", steps);
    cr_assert_eq(memcmp(kept.loss, ref.loss, sizeof kept.loss), 0, "losses");
    free(kept.weights);
    free(ref.weights);
}

/* A backend without the recipe's cast (a backend that has not implemented it) refuses recipe blockwise when the model is
 * built: exit 2's status, naming the recipe and the backend, not a run that falls back to something else. */
Test(fp8, a_backend_without_block_casts_refuses_recipe_blockwise_at_setup)
{
    struct config cfg;
    struct amp_error err = {0};
    cr_assert_eq(config_load(&cfg, AMP_SOURCE_DIR "/configs/fashion_mlp.yaml", &err), AMP_OK, "%s", err.msg);
    const char *ov[] = {"precision.mode=fp8", "precision.fp8.recipe=blockwise", "precision.fp8.keep_bf16=[]",
                        "precision.fp8.min_size=[0, 0]", NULL};
    for (int i = 0; ov[i]; i++)
        cr_assert_eq(config_apply_override(&cfg, ov[i], &err), AMP_OK, "%s: %s", ov[i], err.msg);
    cr_assert_eq(config_finalize(&cfg, &err), AMP_OK, "%s", err.msg);
    struct autocast_policy pol;
    cr_assert_eq(autocast_from_config(&pol, cfg.precision.mode, &cfg.precision.autocast, &err), AMP_OK, "%s", err.msg);
    struct data_spec spec = {.sample_ndim = 3, .sample_shape = {1, 28, 28}, .num_classes = 10};
    struct model m;
    cr_assert_eq(model_build(&m, &cfg, &spec, be, &pol, 4, &err), AMP_OK, "%s", err.msg);
    cr_assert(m.has_fp8 && m.fp8.recipe == FP8_BLOCKWISE);
    model_free(&m);
    be->fp8_block_cast = NULL;
    cr_assert_eq(model_build(&m, &cfg, &spec, be, &pol, 4, &err), AMP_ERR_CONFIG);
    cr_assert(strstr(err.msg, "precision.fp8.recipe: blockwise is not available on backend cpu"), "%s", err.msg);
    config_free(&cfg);
}

/* `ampTrain numerics` of a blockwise run: every cast is E4M3, the output gradients' too, and no per-tensor scale is
 * shown (each tile had its own), in the report and in numerics.csv (an empty scale column). */
Test(fp8, numerics_of_a_blockwise_run_shows_e4m3_casts_and_no_tensor_scale)
{
    make_scratch();
    struct result r = amp("numerics configs/fashion_mlp.yaml " SMALL " precision.mode=fp8 precision.fp8.recipe=blockwise "
                          "'precision.fp8.keep_bf16=[]' 'precision.fp8.min_size=[0,0]' --steps 2 run.out_dir=%s/n", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    const char *section = strstr(r.out, "fp8 casts of this run (recipe blockwise");
    cr_assert(section, "%s", r.out);
    cr_assert(strstr(section, "  head/grad_output             e4m3              -"), "%s", section);
    char path[512], line[1024];
    snprintf(path, sizeof path, "%s/n/numerics-from-step-0.csv", scratch);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    int rows = 0;
    while (fgets(line, sizeof line, f))
        if (strstr(line, ",fp8_cast,")) {
            rows++;
            cr_assert(strstr(line, ",fp8_cast,e4m3,"), "%s", line);
            const char *c = line; /* the scale: the sixth field (step,tensor,kind,format,numel,scale,...) */
            for (int k = 0; k < 5; k++)
                c = strchr(c, ',') + 1;
            cr_assert_eq(*c, ',', "a scale is shown: %s", line);
        }
    fclose(f);
    cr_assert_eq(rows, 2 * 9, "9 fp8 tensors, 2 measured steps");
    remove_scratch();
}

/* ---- the products read the transposed codes the casts made -------------------------------------------------- */

static struct {
    void (*gemm)(struct backend *be, const struct gemm_args *g);
    int dw, dx;    /* fp8 products given their transposed operands: dW (a_t and b_t), dx (b_t) */
    int untransposed; /* fp8 products that a layout-bound GPU would have to transpose into scratch */
} seen;

/* t (stored (rows, cols)) and its transpose tt, one byte a code: the same codes, the same scale_inv */
static void expect_transposed(const struct tensor *t, const struct tensor *tt, int64_t rows, int64_t cols,
                              const char *what)
{
    cr_assert_eq(tt->dtype, t->dtype, "%s: dtype", what);
    cr_assert_eq(tt->numel, t->numel, "%s: numel", what);
    cr_assert_eq(tt->scale_inv, t->scale_inv, "%s: scale_inv", what);
    const uint8_t *c = t->data, *ct = tt->data;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < cols; j++)
            cr_assert_eq(ct[j * rows + r], c[r * cols + j], "%s (%lld, %lld): [%lld][%lld]", what, (long long)rows,
                         (long long)cols, (long long)r, (long long)j);
}

static void checking_gemm(struct backend *b, const struct gemm_args *g)
{
    if (dtype_is_fp8(g->a->dtype)) {
        const int64_t m = g->m, n = g->n, k = g->k;
        if (g->a_t)
            expect_transposed(g->a, g->a_t, g->trans_a ? k : m, g->trans_a ? m : k, "a_t");
        if (g->b_t)
            expect_transposed(g->b, g->b_t, g->trans_b ? n : k, g->trans_b ? k : n, "b_t");
        seen.dw += g->trans_a && g->a_t && g->b_t;
        seen.dx += !g->trans_a && !g->trans_b && g->b_t;
        seen.untransposed += (g->trans_a && !g->a_t) || (!g->trans_b && !g->b_t);
    }
    seen.gemm(b, g);
}

/* text_gpt with every product in fp8, accum_steps 2, both per-tensor recipes: in training every dW product gets dy's
 * and x's transposed codes and every dx product W's (gemm_args a_t, b_t), each bit for bit the transpose of the
 * operand it stands for with its scale, so no product is left for a GPU to transpose (the CPU reads the operands as
 * stored, so only this shows a wrong view). */
Test(fp8, backward_products_get_the_transposed_codes_of_their_operands)
{
    const char *recipes[2] = {"delayed", "current"};
    for (int r = 0; r < 2; r++) {
        setenv("OPENBLAS_NUM_THREADS", "1", 1);
        struct config cfg;
        struct amp_error err = {0};
        cr_assert_eq(config_load(&cfg, AMP_SOURCE_DIR "/configs/text_gpt.yaml", &err), AMP_OK, "%s", err.msg);
        char rec[64];
        snprintf(rec, sizeof rec, "precision.fp8.recipe=%s", recipes[r]);
        const char *ov[] = {"run.device=cpu", "accum_steps=2", "precision.mode=fp8", "precision.fp8.keep_bf16=[]",
                            "precision.fp8.min_size=[0, 0]", rec, NULL};
        for (int i = 0; ov[i]; i++)
            cr_assert_eq(config_apply_override(&cfg, ov[i], &err), AMP_OK, "%s: %s", ov[i], err.msg);
        cr_assert_eq(config_finalize(&cfg, &err), AMP_OK, "%s", err.msg);
        struct trainer t;
        cr_assert_eq(trainer_setup(&t, &cfg, NULL, &err), AMP_OK, "%s", err.msg);
        cr_assert(t.model.has_fp8);
        seen = (__typeof__(seen)){.gemm = t.be->gemm};
        t.be->gemm = checking_gemm;
        for (int i = 0; i < 2; i++) {
            cr_assert_eq(trainer_step(&t, &err), AMP_OK, "%s", err.msg);
            cr_assert_eq(trainer_flush(&t, &err), AMP_OK, "%s", err.msg);
        }
        t.be->gemm = seen.gemm;
        /* 9 products (2 blocks of 4, the head), 2 steps of 2 micro-batches; every one has a dx */
        cr_assert_eq(seen.dw, 9 * 4, "recipe %s: %d dW products with transposed codes", recipes[r], seen.dw);
        cr_assert_eq(seen.dx, 9 * 4, "recipe %s: %d dx products with transposed codes", recipes[r], seen.dx);
        cr_assert_eq(seen.untransposed, 0, "recipe %s: %d fp8 products without their transposed operands", recipes[r],
                     seen.untransposed);
        trainer_teardown(&t);
        config_free(&cfg);
    }
}
