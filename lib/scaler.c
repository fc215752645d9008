/*
 * scaler.c — loss-scale state machine. See scaler.h for the rule.
 */
#include "scaler.h"

void scaler_init(struct scaler *s, const struct precision_config *pc)
{
    const struct loss_scale_config *ls = &pc->loss_scale;
    *s = (struct scaler){
        .dynamic = pc->mode == PREC_FP16_DYNAMIC,
        .scale = 1.0,
        .growth_factor = ls->growth_factor,
        .backoff_factor = ls->backoff_factor,
        .min_scale = ls->min,
        .max_scale = ls->max,
        .growth_interval = ls->growth_interval,
        .hysteresis = ls->hysteresis,
        .hysteresis_left = ls->hysteresis,
        .last_overflow_step = -1,
    };
    if (pc->mode == PREC_FP16_DYNAMIC)
        s->scale = ls->init;
    else if (pc->mode == PREC_FP16_STATIC)
        s->scale = ls->value;
}

float scaler_loss_scale(const struct scaler *s)
{
    return (float)s->scale;
}

float scaler_inv_scale(const struct scaler *s)
{
    return (float)(1.0 / (double)(float)s->scale);
}

bool scaler_update(struct scaler *s, bool found_nonfinite, int64_t step)
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
