/*
 * test_vecmath.c — kernels/cpu/vecmath.h against double-precision libm: tanh_f32 within 2 ulp over a dense
 * sweep of fp32 bit patterns (every 61st pattern from 0 to 12, both signs: about 36 million inputs,
 * both branches and the switch points 0.55 and 10), and its special values.
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
