/*
 * init_from.h — `model.init_from`: start a run from weights in a file (fine-tuning; docs/checkpoint.md,
 * "init_from").
 *
 * The file is a .safetensors file (names as model.init_names says: ampTrain, pytorch or hf-gpt2,
 * lib/base/weight_names.h) or an ampTrain checkpoint or run directory (ampTrain names; only /model is read). Every
 * tensor of the model (parameters and batchnorm buffers) is looked up by its outside name; a table tied by a
 * linear's `tie` is read once, and its alias (lm_head.weight), where the file has it, must hold the same values.
 *
 * Strict (model.init_strict, the default, as load_state_dict): missing keys, unexpected keys and shape
 * mismatches are one AMP_ERR_CKPT naming the file and listing them all. Not strict: what matches is loaded and
 * the rest listed in a warning. Either way a value that is not finite (or a negative running variance), a dtype
 * the reader does not take (lib/base/safetensors.h), or a damaged file is AMP_ERR_CKPT naming the file, the tensor
 * and the element, and nothing of the model is changed. F16 and BF16 values widen to fp32 exactly; bf16
 * masters (precision.master_weights) round once, and refuse a finite value beyond bf16's range.
 *
 * The caller (lib/engine/train.c) calls it after model_init on a fresh run only, on every rank (each reads the same
 * file), never on resume. The optimizer and the loss scaler are not touched: they start fresh.
 */
#ifndef AMP_INIT_FROM_H
#define AMP_INIT_FROM_H

#include <stdbool.h>
#include <stdio.h>

#include "config.h"         /* struct model_config */
#include "error.h"
#include "model.h"  /* struct model */

/* Load mc->init_from into m (built from mc, initialised). With `report` not NULL (rank 0), one line there says
 * what was loaded, and the warning listing what was not (not strict) goes to stderr. */
enum amp_status init_from_load(struct model *m, const struct model_config *mc, FILE *report, struct amp_error *err);

#endif
