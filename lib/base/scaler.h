/*
 * scaler.h — the loss scaler (docs/precision.md, "Dynamic loss scale"): static, dynamic with hysteresis
 * and clamps, or none.
 *
 * fp16-dynamic follows PyTorch's GradScaler (_amp_update_scale_) at hysteresis 1 and Megatron's
 * DynamicGradScaler at hysteresis > 1, with our min/max clamps:
 *   on overflow:   growth_tracker = 0; hysteresis_left -= 1;
 *                  if hysteresis_left <= 0: scale = max(scale * backoff_factor, min)
 *   on clean step: growth_tracker += 1;
 *                  if growth_tracker == growth_interval: scale = min(scale * growth_factor, max),
 *                     growth_tracker = 0, hysteresis_left = hysteresis
 * fp16-static keeps its scale; fp32 and bf16 have scale 1. In every mode a step whose gradients are
 * not all finite is reported by scaler_update as skipped (the caller skips the optimizer) and counted.
 * The whole state is the struct below; the checkpoint stores each field.
 */
#ifndef AMP_SCALER_H
#define AMP_SCALER_H

#include <stdbool.h>
#include <stdint.h>

#include "config.h" /* struct precision_config */

#include "amp_hd.h" /* AMP_HD */

struct scaler {
    bool dynamic;
    double scale;              /* current loss scale (a power of two with the default factors) */
    double growth_factor, backoff_factor, min_scale, max_scale;
    int64_t growth_interval, hysteresis;
    /* state */
    int64_t growth_tracker;    /* clean steps since the last growth or overflow */
    int64_t hysteresis_left;   /* overflows still tolerated before the next backoff */
    int64_t consecutive_skips; /* skipped steps in a row */
    int64_t skips_total;
    int64_t last_overflow_step;/* -1 when none yet */
};

void scaler_init(struct scaler *s, const struct precision_config *pc);

/* The factor the loss gradient is seeded with, before dividing by accum_steps. */
AMP_HD static inline float scaler_loss_scale(const struct scaler *s)
{
    return (float)s->scale;
}

/* inv = (float)(1.0 / (double)scale), as PyTorch computes it. */
AMP_HD static inline float scaler_inv_scale(const struct scaler *s)
{
    return (float)(1.0 / (double)(float)s->scale);
}

/* Record the outcome of optimizer step `step` and update the scale. Returns true when the step must
 * be skipped (found_nonfinite). Inline and AMP_HD: the backend runs it where the state lives
 * (lib/base/step_rule.h), and this is the only definition of the rule. */
/* Record a step skipped for another reason than its gradients (an update that would store a non-finite weight
 * or moment): counted as a skip, the scale and its trackers left as they are, since the gradients were finite at
 * this scale. Returns true (skipped). */
AMP_HD static inline bool scaler_skip(struct scaler *s)
{
    s->skips_total++;
    s->consecutive_skips++;
    return true;
}

AMP_HD static inline bool scaler_update(struct scaler *s, bool found_nonfinite, int64_t step)
{
    if (found_nonfinite) {
        s->skips_total++;
        s->consecutive_skips++;
        s->last_overflow_step = step;
        if (s->dynamic) {
            s->growth_tracker = 0;
            s->hysteresis_left--;
            if (s->hysteresis_left <= 0) {
                double next = s->scale * s->backoff_factor;
                s->scale = next < s->min_scale ? s->min_scale : next;
            }
        }
        return true;
    }
    s->consecutive_skips = 0;
    if (s->dynamic) {
        s->growth_tracker++;
        if (s->growth_tracker == s->growth_interval) {
            double next = s->scale * s->growth_factor;
            s->scale = next > s->max_scale ? s->max_scale : next;
            s->growth_tracker = 0;
            s->hysteresis_left = s->hysteresis;
        }
    }
    return false;
}

#endif
