/*
 * test_vecmath.c — kernels/cpu/vecmath.h against double-precision libm: tanh_f32 within 2 ulp over a dense
 * sweep of fp32 bit patterns (every 61st pattern from 0 to 12, both signs: about 36 million inputs,
 * both branches and the switch points 0.55 and 10), and its special values; exp_f64 within its bound
 * over [-708, 1] (and much closer, as measured), its ends and special values; f32_of_interval's decisions.
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vecmath.h" /* tanh_f32 */

/* |got - want| in units of the last place of want in fp32 (subnormal spacing below 2^-126). */
static double ulps(float got, double want)
{
    int e;
    frexp(want, &e);
    double ulp = ldexp(1.0, (e - 24 < -149 ? -149 : e - 24));
    return fabs((double)got - want) / ulp;
}

static float from_bits(uint32_t b)
{
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

Test(vecmath, tanh_within_2_ulp_dense_sweep)
{
    const uint32_t last = 0x41400000u; /* 12.0f */
    double worst = 0;
    float worst_at = 0;
    for (uint32_t b = 0; b <= last; b += 61)
        for (int sign = 0; sign < 2; sign++) {
            float u = from_bits(b | (uint32_t)sign << 31);
            double e = ulps(tanh_f32(u), tanh((double)u));
            if (e > worst) {
                worst = e;
                worst_at = u;
            }
        }
    cr_assert(worst <= 2.0, "tanh_f32 is %.3f ulp off at %.9g", worst, (double)worst_at);
}

Test(vecmath, tanh_at_the_switch_points)
{
    const float points[] = { 0.55f, 10.0f };
    for (int i = 0; i < 2; i++)
        for (int d = -64; d <= 64; d++) {
            float u = points[i];
            for (int s = 0; s < (d < 0 ? -d : d); s++)
                u = nextafterf(u, d < 0 ? 0.0f : INFINITY);
            cr_assert(ulps(tanh_f32(u), tanh((double)u)) <= 2.0, "tanh_f32(%.9g) = %.9g, want %.9g", (double)u,
                      (double)tanh_f32(u), tanh((double)u));
        }
}

Test(vecmath, tanh_special_values)
{
    cr_assert(isnan(tanh_f32(NAN)), "NaN must propagate");
    cr_assert_eq(tanh_f32(INFINITY), 1.0f);
    cr_assert_eq(tanh_f32(-INFINITY), -1.0f);
    cr_assert_eq(tanh_f32(1e30f), 1.0f);
    cr_assert_eq(tanh_f32(-20.0f), -1.0f);
    cr_assert(tanh_f32(0.0f) == 0.0f && !signbit(tanh_f32(0.0f)));
    cr_assert(tanh_f32(-0.0f) == 0.0f && signbit(tanh_f32(-0.0f)), "the sign of zero is kept");
    cr_assert_eq(tanh_f32(1e-30f), 1e-30f, "tiny inputs return themselves");
    cr_assert_eq(tanh_f32(-0x1p-149f), -0x1p-149f);
}

/* |got - want| / want in units of 2^-53. */
static double rel_u(double got, double want)
{
    return fabs(got - want) / want / 0x1p-53;
}

/* Every 1000 * 2^-22 from -708 to 1 (about 3 million points, each shifted by a different multiple of 2^-40
 * so they do not share low bits) and the points around each multiple of ln2 / 2, where n changes. The
 * worst measured is 2.0 units of 2^-53 against libm's exp (itself within 0.52 ulp: about 1 unit); the bound
 * loss.c relies on is EXP_F64_ERR (64); asserting 3 here also catches what that loose bound would
 * let through (without its degree-13 term the polynomial is 4.2 units off). */
Test(vecmath, exp_f64_within_its_bound)
{
    double worst = 0, worst_at = 0;
    for (int64_t i = 0;; i++) {
        const double a = -708.0 + (double)i * 0x1p-22 * 1000.0 + (double)(i % 997) * 0x1p-40;
        if (a > 1.0)
            break;
        const double e = rel_u(exp_f64(a), exp(a));
        if (e > worst) {
            worst = e;
            worst_at = a;
        }
    }
    for (int n = -2042; n <= 2; n++)
        for (int d = -8; d <= 8; d++) {
            double a = (double)n * 0.34657359027997264 + (double)d * 0x1p-40;
            if (a < -708.0 || a > 1.0)
                continue;
            const double e = rel_u(exp_f64(a), exp(a));
            if (e > worst) {
                worst = e;
                worst_at = a;
            }
        }
    cr_assert(worst <= 3.0, "exp_f64 is %.3f units of 2^-53 off at %.17g", worst, worst_at);
    cr_assert(worst <= EXP_F64_ERR);
}

Test(vecmath, exp_f64_ends_and_special_values)
{
    cr_assert_eq(exp_f64(0.0), 1.0, "exp(0) is 1 exactly (cross-entropy's row maximum)");
    cr_assert_eq(exp_f64(-0.0), 1.0);
    cr_assert(rel_u(exp_f64(-708.0), exp(-708.0)) <= 3.0, "-708 is still a normal double");
    cr_assert(exp_f64(-708.0) >= 0x1p-1022);
    cr_assert_eq(exp_f64(nextafter(-708.0, -1000.0)), 0.0, "below -708: 0");
    cr_assert_eq(exp_f64(-1e300), 0.0);
    cr_assert_eq(exp_f64(-INFINITY), 0.0);
    cr_assert(isnan(exp_f64(NAN)), "NaN must propagate (cross-entropy's fast rows fall back on it)");
    cr_assert(rel_u(exp_f64(1.0), exp(1.0)) <= 3.0);
}

Test(vecmath, f32_of_interval_decides_by_both_ends)
{
    float f;
    cr_assert(f32_of_interval(1.0, 1e-12, &f) && f == 1.0f, "well inside one fp32's rounding interval");
    const double mid = 1.0 + 0x1p-24; /* halfway between 1 and the next fp32 */
    cr_assert(!f32_of_interval(mid, 1e-12, &f), "an interval across a rounding boundary has no one fp32");
    cr_assert(f32_of_interval(mid - 2e-12, 1e-12, &f) && f == 1.0f, "just below it: 1");
    cr_assert(f32_of_interval(mid + 2e-12, 1e-12, &f) && f == nextafterf(1.0f, 2.0f), "just above: the next");
    cr_assert(f32_of_interval(1e-300, 1e-310, &f) && f == 0.0f, "far below fp32's least subnormal: 0");
    cr_assert(!f32_of_interval(0.0, 1e-40, &f), "+-1e-40 are fp32 subnormals of both signs");
    cr_assert(!f32_of_interval(NAN, 0.0, &f), "NaN never passes");
    cr_assert(!f32_of_interval(1.0, INFINITY, &f), "nor an infinite width");
    cr_assert(f32_of_interval(INFINITY, 1.0, &f) && isinf(f), "an infinite value with a finite width is itself");
}
