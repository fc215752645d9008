/*
 * test_optim.c — the learning-rate schedules (constant, step, cosine, each with linear warmup) and the
 * optimizer's step accounting, against the formulas written out independently here (PyTorch's
 * LambdaLR-style warmup, StepLR, and cosine annealing to min_lr).
 */
#include <criterion/criterion.h>
#include <math.h>

#include "optim.h"

static struct optimizer make(enum sched_kind kind, double lr, int64_t warmup, int64_t total)
{
    struct config c;
    config_defaults(&c);
    struct optimizer o = {.cfg = c.optim, .total_steps = total};
    o.cfg.lr = lr;
    o.cfg.schedule.kind = kind;
    o.cfg.schedule.warmup_steps = warmup;
    o.cfg.schedule.step_size = 10;
    o.cfg.schedule.gamma = 0.5;
    o.cfg.schedule.min_lr = 1e-5;
    return o;
}

static double lr_at(struct optimizer *o, int64_t step)
{
    o->step = step;
    return optim_lr(o);
}

Test(optim, warmup_is_linear_from_lr_over_warmup_to_lr)
{
    struct optimizer o = make(SCHED_CONSTANT, 0.1, 4, 100);
    double expect[] = {0.025, 0.05, 0.075, 0.1, 0.1, 0.1};
    for (int t = 0; t < 6; t++)
        cr_assert_float_eq(lr_at(&o, t), expect[t], 1e-15, "step %d: %g", t, lr_at(&o, t));
}

Test(optim, constant_without_warmup)
{
    struct optimizer o = make(SCHED_CONSTANT, 3e-4, 0, 100);
    for (int t = 0; t < 100; t += 7)
        cr_assert_eq(lr_at(&o, t), 3e-4);
}

Test(optim, step_decays_by_gamma_every_step_size_after_warmup)
{
    struct optimizer o = make(SCHED_STEP, 1.0, 2, 100);
    cr_assert_float_eq(lr_at(&o, 0), 0.5, 1e-15);
    cr_assert_eq(lr_at(&o, 2), 1.0);
    cr_assert_eq(lr_at(&o, 11), 1.0);
    cr_assert_eq(lr_at(&o, 12), 0.5);
    cr_assert_eq(lr_at(&o, 21), 0.5);
    cr_assert_eq(lr_at(&o, 22), 0.25);
    cr_assert_eq(lr_at(&o, 52), 1.0 / 32);
}

Test(optim, cosine_goes_from_lr_to_min_lr_over_the_remaining_steps)
{
    struct optimizer o = make(SCHED_COSINE, 1e-3, 10, 110);
    const double pi = 3.14159265358979323846;
    for (int t = 10; t <= 130; t += 5) {
        double frac = fmin(1.0, (t - 10) / 100.0);
        double want = 1e-5 + (1e-3 - 1e-5) * 0.5 * (1 + cos(pi * frac));
        cr_assert_float_eq(lr_at(&o, t), want, 1e-15, "step %d", t);
    }
    cr_assert_float_eq(lr_at(&o, 10), 1e-3, 1e-15);
    cr_assert_float_eq(lr_at(&o, 60), (1e-3 + 1e-5) / 2, 1e-15);
    cr_assert_float_eq(lr_at(&o, 110), 1e-5, 1e-15);
    cr_assert_float_eq(lr_at(&o, 500), 1e-5, 1e-15, "stays at min_lr past the end");
    cr_assert_float_eq(lr_at(&o, 4), 5e-4, 1e-15, "warmup first");
}
