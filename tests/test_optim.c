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

/* The schedules linear, wsd and inverse_sqrt, and decay_steps apart from run.steps (nanoGPT's lr_decay_iters),
 * against the formulas written out here (PyTorch LambdaLR lambdas). */
static double want_linear(int t, int w, int end, double lr, double min_lr)
{
    double frac = t < w ? 0 : fmin(1.0, (double)(t - w) / (end - w));
    return t < w ? lr * (t + 1) / w : min_lr + (lr - min_lr) * (1 - frac);
}

Test(optim, linear_decays_to_min_lr_at_decay_steps_and_stays)
{
    struct optimizer o = make(SCHED_LINEAR, 1e-3, 10, 1000);
    o.cfg.schedule.decay_steps = 110; /* ends long before run.steps */
    for (int t = 0; t <= 200; t += 3)
        cr_assert_float_eq(lr_at(&o, t), want_linear(t, 10, 110, 1e-3, 1e-5), 1e-15, "step %d", t);
    cr_assert_float_eq(lr_at(&o, 60), (1e-3 + 1e-5) / 2, 1e-15);
    cr_assert_float_eq(lr_at(&o, 110), 1e-5, 1e-15);
    cr_assert_float_eq(lr_at(&o, 999), 1e-5, 1e-15);
    o.cfg.schedule.decay_steps = 0; /* 0: the run's steps */
    cr_assert_float_eq(lr_at(&o, 505), want_linear(505, 10, 1000, 1e-3, 1e-5), 1e-15);
}

Test(optim, cosine_takes_decay_steps_too)
{
    struct optimizer o = make(SCHED_COSINE, 1e-3, 10, 1000);
    o.cfg.schedule.decay_steps = 110;
    cr_assert_float_eq(lr_at(&o, 60), (1e-3 + 1e-5) / 2, 1e-15);
    cr_assert_float_eq(lr_at(&o, 110), 1e-5, 1e-15);
    cr_assert_float_eq(lr_at(&o, 900), 1e-5, 1e-15);
}

Test(optim, wsd_is_warmup_stable_then_a_linear_decay_over_its_fraction)
{
    struct optimizer o = make(SCHED_WSD, 1e-3, 10, 110);
    o.cfg.schedule.decay_fraction = 0.2; /* the last 20 of the 100 steps after warmup */
    cr_assert_float_eq(lr_at(&o, 4), 5e-4, 1e-15, "warmup");
    for (int t = 10; t < 90; t += 7)
        cr_assert_eq(lr_at(&o, t), 1e-3, "stable at step %d", t);
    for (int t = 90; t <= 120; t++) {
        double frac = fmin(1.0, (t - 90) / 20.0);
        cr_assert_float_eq(lr_at(&o, t), 1e-5 + (1e-3 - 1e-5) * (1 - frac), 1e-15, "decay at step %d", t);
    }
    cr_assert_float_eq(lr_at(&o, 100), (1e-3 + 1e-5) / 2, 1e-15);
}

Test(optim, inverse_sqrt_is_fairseqs)
{
    struct optimizer o = make(SCHED_INVERSE_SQRT, 1e-3, 16, 1000);
    cr_assert_float_eq(lr_at(&o, 15), 1e-3, 1e-15, "the warmup's last step reaches lr");
    for (int t = 15; t < 1000; t += 37) /* fairseq: lr * sqrt(warmup) / sqrt(num_updates), num_updates = t + 1 */
        cr_assert_float_eq(lr_at(&o, t), 1e-3 * sqrt(16.0) / sqrt(t + 1.0), 1e-15, "step %d", t);
    o.cfg.schedule.warmup_steps = 0;
    cr_assert_float_eq(lr_at(&o, 0), 1e-3, 1e-15);
    cr_assert_float_eq(lr_at(&o, 3), 1e-3 / 2, 1e-15);
}
