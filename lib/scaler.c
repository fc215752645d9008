/*
 * scaler.c — the loss scaler's initial state. The update rule is inline in scaler.h: it runs
 * on the backend, next to the gradients (lib/step_rule.h).
 */
#include "scaler.h"

void scaler_init(struct scaler *s, const struct precision_config *pc)
{
    const struct loss_scale_config *ls = &pc->loss_scale;
    bool fp8 = pc->mode == PREC_FP8;
    bool dynamic = pc->mode == PREC_FP16_DYNAMIC || (fp8 && pc->fp8.loss_scale == FP8_LS_DYNAMIC);
    bool fixed = pc->mode == PREC_FP16_STATIC || (fp8 && pc->fp8.loss_scale == FP8_LS_STATIC);
    *s = (struct scaler){
        .dynamic = dynamic,
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
    if (dynamic)
        s->scale = ls->init;
    else if (fixed)
        s->scale = ls->value;
}
