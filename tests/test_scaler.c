/*
 * test_scaler.c — the loss-scale state machine against the PyTorch rule (hysteresis 1) and the
 * Megatron rule (hysteresis > 1), on scripted overflow sequences, with every counter checked.
 *
 * The reference implementations below are transcriptions of the published rules (docs/precision.md,
 * "Dynamic loss scale"):
 * PyTorch's _amp_update_scale_ (no clamps) and Megatron's DynamicGradScaler.update.
 */
#include <criterion/criterion.h>
#include <math.h>

#include <string.h>

#include "config.h"
#include "scaler.h"
#include "step_rule.h" /* step_rule_propose, step_rule_finish: the skip of a non-finite update */

static struct precision_config dyn(double init, int64_t interval, int64_t hyst, double min, double max)
{
    struct config c;
    config_defaults(&c);
    c.precision.mode = PREC_FP16_DYNAMIC;
    c.precision.loss_scale.init = init;
    c.precision.loss_scale.growth_interval = interval;
    c.precision.loss_scale.hysteresis = hyst;
    c.precision.loss_scale.min = min;
    c.precision.loss_scale.max = max;
    return c.precision;
}

/* PyTorch _amp_update_scale_: found_inf -> scale *= backoff, tracker = 0;
 * else successful = tracker + 1; if successful == interval: scale *= growth, tracker = 0; else tracker = successful */
struct torch_ref { double scale; int64_t tracker; };
static void torch_update(struct torch_ref *r, bool inf, int64_t interval)
{
    if (inf) {
        r->scale *= 0.5;
        r->tracker = 0;
    } else if (r->tracker + 1 == interval) {
        r->scale *= 2.0;
        r->tracker = 0;
    } else {
        r->tracker++;
    }
}

/* Megatron DynamicGradScaler.update */
struct megatron_ref { double scale; int64_t tracker, hyst_left, hysteresis; double min; };
static void megatron_update(struct megatron_ref *r, bool inf, int64_t interval)
{
    if (inf) {
        r->tracker = 0;
        r->hyst_left -= 1;
        if (r->hyst_left <= 0)
            r->scale = fmax(r->scale * 0.5, r->min);
    } else {
        r->tracker += 1;
        if (r->tracker == interval) {
            r->tracker = 0;
            r->hyst_left = r->hysteresis;
            r->scale *= 2.0;
        }
    }
}

Test(scaler, defaults_match_pytorch_gradscaler)
{
    struct config c;
    config_defaults(&c);
    c.precision.mode = PREC_FP16_DYNAMIC;
    struct scaler s;
    scaler_init(&s, &c.precision);
    cr_assert_eq(s.scale, 65536.0);
    cr_assert_eq(s.growth_factor, 2.0);
    cr_assert_eq(s.backoff_factor, 0.5);
    cr_assert_eq(s.growth_interval, 2000);
    cr_assert_eq(s.hysteresis, 1);
    cr_assert_eq(s.min_scale, 1.0);
    cr_assert_eq(s.max_scale, 16777216.0);
    cr_assert_eq(s.last_overflow_step, -1);
    cr_assert_float_eq(scaler_inv_scale(&s), 1.0f / 65536.0f, 0);
}

Test(scaler, random_sequences_follow_pytorch_rule_at_hysteresis_1)
{
    uint64_t x = 0x1234567;
    for (int trial = 0; trial < 50; trial++) {
        int64_t interval = 1 + trial % 7;
        struct precision_config pc = dyn(1024.0, interval, 1, 1e-300, 1e300); /* clamps out of reach */
        struct scaler s;
        scaler_init(&s, &pc);
        struct torch_ref r = {1024.0, 0};
        int64_t skips = 0, consecutive = 0;
        for (int step = 1; step <= 400; step++) {
            x = x * 6364136223846793005ULL + 1442695040888963407ULL;
            bool inf = (x >> 60) < 3; /* ~19% overflow */
            bool skipped = scaler_update(&s, inf, step);
            torch_update(&r, inf, interval);
            skips += inf;
            consecutive = inf ? consecutive + 1 : 0;
            cr_assert_eq(skipped, inf);
            cr_assert_eq(s.scale, r.scale, "trial %d step %d: %g vs torch %g", trial, step, s.scale, r.scale);
            cr_assert_eq(s.growth_tracker, r.tracker, "trial %d step %d", trial, step);
            cr_assert_eq(s.skips_total, skips);
            cr_assert_eq(s.consecutive_skips, consecutive);
            if (inf)
                cr_assert_eq(s.last_overflow_step, step);
        }
    }
}

Test(scaler, random_sequences_follow_megatron_rule_with_hysteresis)
{
    uint64_t x = 0xabcdef;
    for (int trial = 0; trial < 50; trial++) {
        int64_t interval = 2 + trial % 5, hyst = 2 + trial % 3;
        struct precision_config pc = dyn(4096.0, interval, hyst, 1.0, 1e300);
        struct scaler s;
        scaler_init(&s, &pc);
        struct megatron_ref r = {4096.0, 0, hyst, hyst, 1.0};
        for (int step = 1; step <= 400; step++) {
            x = x * 6364136223846793005ULL + 1442695040888963407ULL;
            bool inf = (x >> 60) < 5;
            scaler_update(&s, inf, step);
            megatron_update(&r, inf, interval);
            cr_assert_eq(s.scale, r.scale, "trial %d step %d", trial, step);
            cr_assert_eq(s.growth_tracker, r.tracker);
            cr_assert_eq(s.hysteresis_left, r.hyst_left);
        }
    }
}

Test(scaler, growth_at_interval_and_clamp_at_max)
{
    struct precision_config pc = dyn(4.0, 3, 1, 1.0, 16.0);
    struct scaler s;
    scaler_init(&s, &pc);
    double expect[] = {4, 4, 8, 8, 8, 16, 16, 16, 16, 16, 16, 16};
    for (int i = 0; i < 12; i++) {
        scaler_update(&s, false, i + 1);
        cr_assert_eq(s.scale, expect[i], "after clean step %d: %g", i + 1, s.scale);
    }
    cr_assert_eq(s.skips_total, 0);
}

Test(scaler, backoff_clamps_at_min)
{
    struct precision_config pc = dyn(8.0, 100, 1, 2.0, 1e6);
    struct scaler s;
    scaler_init(&s, &pc);
    double expect[] = {4, 2, 2, 2};
    for (int i = 0; i < 4; i++) {
        cr_assert(scaler_update(&s, true, i + 1));
        cr_assert_eq(s.scale, expect[i]);
    }
    cr_assert_eq(s.scale, s.min_scale);
    cr_assert_eq(s.consecutive_skips, 4);
    cr_assert_eq(s.skips_total, 4);
    scaler_update(&s, false, 5);
    cr_assert_eq(s.scale, 2.0, "a clean step at the floor does not grow before the interval");
    cr_assert_eq(s.consecutive_skips, 0);
    cr_assert_eq(s.skips_total, 4);
}

Test(scaler, hysteresis_delays_backoff_and_growth_refills_it)
{
    struct precision_config pc = dyn(1024.0, 2, 3, 1.0, 1e9);
    struct scaler s;
    scaler_init(&s, &pc);
    scaler_update(&s, true, 1);
    scaler_update(&s, true, 2);
    cr_assert_eq(s.scale, 1024.0, "two overflows tolerated by hysteresis 3");
    cr_assert_eq(s.hysteresis_left, 1);
    scaler_update(&s, true, 3);
    cr_assert_eq(s.scale, 512.0);
    scaler_update(&s, true, 4);
    cr_assert_eq(s.scale, 256.0, "hysteresis stays exhausted until a growth");
    scaler_update(&s, false, 5);
    scaler_update(&s, false, 6);
    cr_assert_eq(s.scale, 512.0);
    cr_assert_eq(s.hysteresis_left, 3);
}

Test(scaler, static_and_unscaled_modes_never_change_but_count_skips)
{
    struct config c;
    config_defaults(&c);
    enum precision_mode modes[] = {PREC_FP16_STATIC, PREC_FP32, PREC_BF16};
    double scales[] = {128.0, 1.0, 1.0};
    for (int k = 0; k < 3; k++) {
        c.precision.mode = modes[k];
        c.precision.loss_scale.value = 128.0;
        struct scaler s;
        scaler_init(&s, &c.precision);
        for (int i = 0; i < 10; i++)
            scaler_update(&s, i % 3 == 0, i + 1);
        cr_assert_eq(s.scale, scales[k]);
        cr_assert_eq(s.skips_total, 4);
        cr_assert_eq(s.last_overflow_step, 10);
    }
}

/* The step rule's answer to a trial that found a non-finite update (docs/precision.md,
 * "One optimizer step"): the step is skipped and counted,
 * nothing else moves (the scale, its growth tracker and hysteresis, the optimizer step count, the schedule); and
 * where the trial is clean, the scalars it ran on are the ones the update gets, to the bit. */
Test(scaler, a_non_finite_update_is_a_counted_skip_that_moves_nothing_else)
{
    struct precision_config pc = dyn(1024, 3, 2, 1, 1e9);
    struct step_params p = {.micro_batches = 2, .max_norm = 1.0, .beta1 = 0.9, .beta2 = 0.999, .weight_decay = 0.01f,
                            .eps = 1e-8f,
                            .schedule = {.kind = SCHEDULE_COSINE, .lr = 1e-3, .min_lr = 1e-5, .warmup_steps = 2,
                                         .total_steps = 20}};
    struct step_state st = {.opt_step = 0, .loss_acc = 3.0, .bound = {INFINITY, INFINITY, INFINITY}};
    scaler_init(&st.scaler, &pc);
    for (int step = 0; step < 8; step++) {
        bool bad = step == 2 || step == 5 || step == 6;
        struct grad_check gc = {.sumsq = 4.0 * (step + 1), .absmax = 1.5, .found_nonfinite = 0, .update_nonfinite = 77};
        step_rule_propose(&p, &st, &gc);
        cr_assert_eq(gc.update_nonfinite, 0, "propose zeroes the trial's report");
        struct step_scalars proposed = st.sc;
        cr_assert_eq(proposed.skip, 0);
        /* the state's magnitudes are unknown before the first step: a trial; after a taken step they are what the
         * updates stored (zeroed here, as step_finish leaves them before the updates raise them): no trial */
        cr_assert_eq(proposed.check, step == 0 || isinf(st.bound.pmax), "step %d", step);
        proposed.check = 0;
        gc.update_nonfinite = bad ? 3 : 0;
        struct step_state before = st;
        struct step_row row;
        step_rule_finish(&p, &st, &gc, &row);
        cr_assert_eq(row.skipped, bad, "step %d", step);
        cr_assert_eq(row.found_inf, 0, "the gradients were finite");
        cr_assert_eq(row.update_nonfinite, bad ? 3 : 0);
        if (bad) {
            cr_assert_eq(st.sc.skip, 1);
            cr_assert_eq(st.opt_step, before.opt_step, "the schedule and AdamW's count stay");
            cr_assert_eq(st.scaler.scale, before.scaler.scale, "the scale stays");
            cr_assert_eq(st.scaler.growth_tracker, before.scaler.growth_tracker);
            cr_assert_eq(st.scaler.hysteresis_left, before.scaler.hysteresis_left);
            cr_assert_eq(st.scaler.last_overflow_step, before.scaler.last_overflow_step);
            cr_assert_eq(st.scaler.skips_total, before.scaler.skips_total + 1);
            cr_assert_eq(st.scaler.consecutive_skips, before.scaler.consecutive_skips + 1);
            cr_assert_eq(row.lr, 0.0);
        } else {
            cr_assert_eq(memcmp(&st.sc, &proposed, sizeof proposed), 0, "step %d: the update's scalars are the trial's",
                         step);
            cr_assert_eq(st.opt_step, before.opt_step + 1);
            cr_assert_eq(st.scaler.consecutive_skips, 0);
        }
    }
    cr_assert_eq(st.scaler.skips_total, 3);
    /* non-finite gradients: propose skips too, and finish counts an overflow as before */
    struct grad_check gc = {.found_nonfinite = 1};
    step_rule_propose(&p, &st, &gc);
    cr_assert_eq(st.sc.skip, 1, "no trial runs on non-finite gradients");
    struct step_row row;
    double scale = st.scaler.scale;
    st.scaler.hysteresis_left = 1;
    step_rule_finish(&p, &st, &gc, &row);
    cr_assert(row.found_inf && row.skipped && !row.update_nonfinite && st.scaler.scale == scale * 0.5);
}

/* step_rule_bounded: the trial is skipped only where the bound proves every stored value finite. */
Test(scaler, the_trial_is_skipped_only_where_a_bound_proves_the_update_finite)
{
    struct step_params adam = {.beta1 = 0.9, .beta2 = 0.999, .weight_decay = 0.01f, .eps = 1e-8f};
    struct step_params sgd = {.sgd = 1, .momentum = 0.9f, .nesterov = 1, .weight_decay = 0.01f};
    struct grad_check gc = {.absmax = 10.0};
    struct state_bound small = {2.0f, 1.0f, 1.0f}, unknown = {INFINITY, INFINITY, INFINITY};
    struct state_bound near_max = {3.39e38f, 1.0f, 1.0f}, v_near_max = {1.0f, 1.0f, 3.39e38f};
    const struct step_params *ps[2] = {&adam, &sgd};
    for (int k = 0; k < 2; k++) {
        struct step_scalars sc;
        step_rule_scalars(&sc, ps[k], 1e-3f, 5, 0.5f);
        cr_assert(step_rule_bounded(ps[k], &sc, &gc, &small), "%d: an ordinary step is proved finite", k);
        cr_assert(!step_rule_bounded(ps[k], &sc, &gc, &unknown), "%d", k);
        cr_assert(!step_rule_bounded(ps[k], &sc, &gc, &near_max), "%d: a weight near fp32's top", k);
        struct grad_check huge = {.absmax = 3.3e38};
        cr_assert(!step_rule_bounded(ps[k], &sc, &huge, &small), "%d: a gradient near the top", k);
        step_rule_scalars(&sc, ps[k], 1e38f, 5, 0.5f);
        cr_assert(!step_rule_bounded(ps[k], &sc, &gc, &small), "%d: lr 1e38", k);
    }
    struct step_scalars sc;
    step_rule_scalars(&sc, &adam, 1e-3f, 5, 0.5f);
    cr_assert(!step_rule_bounded(&adam, &sc, &gc, &v_near_max), "AdamW's second moment near the top");
    struct grad_check g_sq = {.absmax = 2e21}; /* (1 - beta2) (0.5 g)^2 = 1e39 overflows v */
    cr_assert(!step_rule_bounded(&adam, &sc, &g_sq, &small));
    struct step_params no_eps = adam;
    no_eps.eps = 0.0f;
    cr_assert(!step_rule_bounded(&no_eps, &sc, &gc, &small), "eps 0: the step is not bounded by m / eps");
}
