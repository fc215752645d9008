/*
 * precision.c — what a precision mode implies. See precision.h.
 */
#include "precision.h"

#include <string.h>

#include "config.h" /* struct precision_config, enum fp8_loss_scale */

const char *const precision_mode_names[] = {"fp32", "fp16-static", "fp16-dynamic", "bf16", "fp8", NULL};

_Static_assert(sizeof precision_mode_names / sizeof *precision_mode_names == PREC_FP8 + 2,
               "one name per precision mode");

const char *precision_mode_name(enum precision_mode m)
{
    return (int)m >= 0 && (int)m <= PREC_FP8 ? precision_mode_names[m] : "?";
}

bool precision_mode_from_name(const char *name, enum precision_mode *out)
{
    for (int m = 0; precision_mode_names[m]; m++)
        if (strcmp(name, precision_mode_names[m]) == 0) {
            *out = (enum precision_mode)m;
            return true;
        }
    return false;
}

enum dtype precision_lowp_dtype(enum precision_mode mode)
{
    switch (mode) {
    case PREC_FP16_STATIC:
    case PREC_FP16_DYNAMIC: return DT_FP16;
    case PREC_BF16:
    case PREC_FP8: return DT_BF16; /* fp8 runs the autocast policy of bf16; its linear layers' products read fp8 */
    case PREC_FP32: break;
    }
    return DT_FP32;
}

enum loss_scaling precision_loss_scaling(const struct precision_config *pc)
{
    switch (pc->mode) {
    case PREC_FP16_STATIC: return LOSS_SCALE_STATIC;
    case PREC_FP16_DYNAMIC: return LOSS_SCALE_DYNAMIC;
    case PREC_FP8:
        return pc->fp8.loss_scale == FP8_LS_STATIC    ? LOSS_SCALE_STATIC
               : pc->fp8.loss_scale == FP8_LS_DYNAMIC ? LOSS_SCALE_DYNAMIC
                                                       : LOSS_SCALE_NONE;
    case PREC_FP32:
    case PREC_BF16: break;
    }
    return LOSS_SCALE_NONE;
}

bool precision_is_loss_scaled(const struct precision_config *pc)
{
    return precision_loss_scaling(pc) != LOSS_SCALE_NONE;
}
