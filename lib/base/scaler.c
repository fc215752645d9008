/*
 * scaler.c — the loss scaler's initial state. The update rule is inline in scaler.h: it runs
 * on the backend, next to the gradients (lib/base/step_rule.h).
 */
#include "scaler.h"

#include "precision.h" /* precision_loss_scaling */

void scaler_init(struct scaler *s, const struct precision_config *pc)
{
    const struct loss_scale_config *ls = &pc->loss_scale;
    enum loss_scaling scaling = precision_loss_scaling(pc);
    bool dynamic = scaling == LOSS_SCALE_DYNAMIC;
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
    else if (scaling == LOSS_SCALE_STATIC)
        s->scale = ls->value;
}
