/*
 * scaler.c — the loss scaler's initial state. The update rule is inline in scaler.h: it runs
 * on the backend, next to the gradients (lib/step_rule.h).
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
