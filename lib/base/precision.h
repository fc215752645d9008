/*
 * precision.h — what a precision mode implies, answered in one place (docs/precision.md).
 *
 * A mode (precision.mode: fp32, fp16-static, fp16-dynamic, bf16, fp8) decides three things the rest of the
 * engine asks about: its name in configs and checkpoints, the low-precision dtype its autocast policy casts
 * to, and how the loss is scaled. fp8 runs bf16's autocast policy (its linear products read E4M3/E5M2
 * operands) and is loss-scaled only when precision.fp8.loss_scale says static or dynamic, which then behave
 * as fp16-static and fp16-dynamic do. The scaler, the config warnings, the fail-fast check and the
 * checkpoint reader all ask these functions instead of comparing modes themselves.
 */
#ifndef AMP_PRECISION_H
#define AMP_PRECISION_H

#include <stdbool.h>

#include "dtype.h" /* enum dtype */

enum precision_mode { PREC_FP32, PREC_FP16_STATIC, PREC_FP16_DYNAMIC, PREC_BF16, PREC_FP8 };

/* How a mode scales the loss: not at all (scale 1), by a fixed precision.loss_scale.value, or by the dynamic
 * rule from precision.loss_scale.init (lib/base/scaler.h). */
enum loss_scaling { LOSS_SCALE_NONE, LOSS_SCALE_STATIC, LOSS_SCALE_DYNAMIC };

struct precision_config; /* config.h */

/* "fp32", "fp16-static", "fp16-dynamic", "bf16", "fp8" (NULL-terminated, indexed by enum precision_mode). */
extern const char *const precision_mode_names[];

/* The mode's name as configs and checkpoints spell it; "?" for a value outside the enum. */
const char *precision_mode_name(enum precision_mode m);

/* The mode a name spells (a checkpoint's /state precision_mode): false, *out untouched, if none does. */
bool precision_mode_from_name(const char *name, enum precision_mode *out);

/* The dtype the mode's autocast policy casts to: fp16 for both fp16 modes, bf16 for bf16 and fp8, DT_FP32 for
 * fp32. */
enum dtype precision_lowp_dtype(enum precision_mode mode);

/* How `pc` scales the loss: its mode, and for fp8 precision.fp8.loss_scale. */
enum loss_scaling precision_loss_scaling(const struct precision_config *pc);

/* Whether `pc` scales the loss at all (static or dynamic). Where it does not, a non-finite gradient is the
 * matter of stability.on_nonfinite; where it does, such a step is an overflow that is skipped. */
bool precision_is_loss_scaled(const struct precision_config *pc);

#endif
