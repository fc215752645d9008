/*
 * test_cpu_planes8.c — the eight-planes vector sums (kernels/cpu/planes8_avx512.c) against the plain chains they
 * stand in for, bit for bit.
 *
 * batchnorm's statistics and gradient sums, a convolution's bias gradient and layernorm's row sums run eight
 * channels (or rows) as the lanes of one AVX-512 vector where the CPU has it, and as eight scalar chains
 * (FOR_CHAINS, cpu_internal.h) elsewhere. The run picks the path by the CPU, so no op-level test sees both on one
 * machine; here each vector routine is called directly and compared with the chains written as norm.c and conv.c
 * write them: fp32 and bf16 planes, lengths with and without a tail (hw % 8), a ReLU mask with zeros of both signs
 * and NaN, layernorm's column factors, and sums that start non-zero. Skipped where the CPU lacks AVX-512 F/VL.
 */
#include "cpu_testlib.h"  /* be, falloc, frand */
#include "cpu_internal.h" /* CHAINS, FOR_CHAINS, cpu_planes8_avx512, cpu_planes_*8_avx512 */

TestSuite(cpu_planes8, .init = cpu_test_setup, .fini = cpu_test_teardown);

#ifdef HAVE_AVX512_INTRIN

/* Eight planes of hw values in [-2, 2), stored as dt (fp32 or bf16); wide[l] gets plane l widened to fp32. */
static void planes_make(enum dtype dt, int64_t hw, const void *p[CHAINS], float *wide[CHAINS])
{
    for (int l = 0; l < CHAINS; l++) {
        float *h = falloc((size_t)hw);
        for (int64_t q = 0; q < hw; q++)
            h[q] = frand(-2.0f, 2.0f);
        if (dt == DT_BF16) {
            uint16_t *b = talloc((size_t)hw * sizeof(uint16_t));
            for (int64_t q = 0; q < hw; q++) {
                b[q] = bf16_from_fp32(h[q]);
                h[q] = bf16_to_fp32(b[q]);
            }
            p[l] = b;
        } else {
            p[l] = h;
        }
        wide[l] = h;
    }
}

static void assert_same_sums(const double *got, const double *want, const char *what, enum dtype dt, int64_t hw)
{
    for (int l = 0; l < CHAINS; l++)
        cr_assert(memcmp(&got[l], &want[l], sizeof(double)) == 0, "%s %s hw=%lld lane %d: vector %.17g, chain %.17g",
                  what, dtype_name(dt), (long long)hw, l, got[l], want[l]);
}

static const int64_t HWS[] = { 1, 7, 8, 9, 49, 64, 196, 785 };

Test(cpu_planes8, sums_are_the_scalar_chains_to_the_bit)
{
    if (!cpu_planes8_avx512(CHAINS))
        cr_skip_test("this CPU has no AVX-512 F/VL: only the scalar chains run");
    seed(71);
    const enum dtype dts[] = { DT_FP32, DT_BF16 };
    for (size_t di = 0; di < 2; di++)
        for (size_t hi = 0; hi < sizeof HWS / sizeof HWS[0]; hi++) {
            const int mark = n_mem; /* this case's buffers are freed at its end */
            const enum dtype dt = dts[di];
            const int64_t hw = HWS[hi];
            const void *p[CHAINS];
            float *x[CHAINS];
            planes_make(dt, hw, p, x);
            double s[CHAINS], want[CHAINS], mu[CHAINS];
            for (int l = 0; l < CHAINS; l++) {
                s[l] = want[l] = frand(-1.0f, 1.0f); /* sums carried over from an earlier image */
                mu[l] = frand(-0.5f, 0.5f) / 3.0;
            }
            cpu_planes_sum8_avx512(p, dt == DT_BF16, hw, s);
            FOR_CHAINS(CHAINS, hw, l, q, want[l] += x[l][q]);
            assert_same_sums(s, want, "sum", dt, hw);

            double ss[CHAINS], want_ss[CHAINS];
            for (int l = 0; l < CHAINS; l++)
                ss[l] = want_ss[l] = frand(0.0f, 1.0f);
            cpu_planes_sumsq8_avx512(p, dt == DT_BF16, hw, mu, ss);
            FOR_CHAINS(CHAINS, hw, l, q, double d = x[l][q] - mu[l]; want_ss[l] += d * d);
            assert_same_sums(ss, want_ss, "sum of squares", dt, hw);
            tracked_free_to(n_t, mark);
        }
}

/* The ReLU's mask as the scalar path applies it (act_grad_apply: dy where y > 0 or NaN, else +0). */
static float relu_masked(float dy, float y)
{
    return y <= 0.0f ? 0.0f : dy;
}

Test(cpu_planes8, gradient_sums_are_the_scalar_chains_to_the_bit)
{
    if (!cpu_planes8_avx512(CHAINS))
        cr_skip_test("this CPU has no AVX-512 F/VL: only the scalar chains run");
    seed(72);
    const enum dtype dts[] = { DT_FP32, DT_BF16 };
    for (size_t di = 0; di < 2; di++)
        for (size_t hi = 0; hi < sizeof HWS / sizeof HWS[0]; hi++)
            for (int kind = 0; kind < 3; kind++) { /* plain (batchnorm), ReLU mask (fused), column factors (LN) */
                const int mark = n_mem; /* this case's buffers are freed at its end */
                const enum dtype dt = dts[di];
                const int64_t hw = HWS[hi];
                const bool bf16 = dt == DT_BF16;
                const void *xp[CHAINS], *dp[CHAINS], *yp[CHAINS];
                float *x[CHAINS], *dy[CHAINS], *y[CHAINS];
                planes_make(dt, hw, xp, x);
                planes_make(dt, hw, dp, dy);
                planes_make(dt, hw, yp, y);
                if (kind == 1) /* the mask's edge cases: +0, -0 and NaN in y, written as both dtypes store them */
                    for (int l = 0; l < CHAINS; l++)
                        for (int64_t q = l % 3; q < hw; q += 5) {
                            const float v = q % 3 == 0 ? 0.0f : q % 3 == 1 ? -0.0f : NAN;
                            y[l][q] = v;
                            if (bf16)
                                ((uint16_t *)yp[l])[q] = bf16_from_fp32(v);
                            else
                                ((float *)yp[l])[q] = v;
                        }
                float *g = NULL;
                if (kind == 2) {
                    g = falloc((size_t)hw);
                    for (int64_t q = 0; q < hw; q++)
                        g[q] = frand(-1.5f, 1.5f);
                }
                float mu[CHAINS], rs[CHAINS];
                double sdy[CHAINS], sdyx[CHAINS], want_dy[CHAINS], want_dyx[CHAINS];
                for (int l = 0; l < CHAINS; l++) {
                    mu[l] = frand(-0.3f, 0.3f);
                    rs[l] = frand(0.5f, 2.0f);
                    sdy[l] = want_dy[l] = frand(-1.0f, 1.0f);
                    sdyx[l] = want_dyx[l] = frand(-1.0f, 1.0f);
                }
                cpu_planes_gradsum8_avx512(xp, dp, kind == 1 ? yp : NULL, g, bf16, hw, mu, rs, sdy, sdyx);
                FOR_CHAINS(CHAINS, hw, l, e, float dv = kind == 1 ? relu_masked(dy[l][e], y[l][e]) : dy[l][e];
                           if (g) dv *= g[e]; want_dy[l] += dv;
                           want_dyx[l] += (double)dv * ((x[l][e] - mu[l]) * rs[l]));
                const char *what = kind == 0 ? "sum of dy" : kind == 1 ? "sum of ReLU-masked dy" : "sum of dy * g";
                assert_same_sums(sdy, want_dy, what, dt, hw);
                assert_same_sums(sdyx, want_dyx, "sum of dy * xhat", dt, hw);
                tracked_free_to(n_t, mark);
            }
}

#else

Test(cpu_planes8, sums_are_the_scalar_chains_to_the_bit)
{
    cr_skip_test("no AVX-512 intrinsics in this build (GCC on x86-64 only): only the scalar chains run");
}

Test(cpu_planes8, gradient_sums_are_the_scalar_chains_to_the_bit)
{
    cr_skip_test("no AVX-512 intrinsics in this build (GCC on x86-64 only): only the scalar chains run");
}

#endif
