/*
 * train.h — the training loop (`ampTrain run`) and evaluation.
 *
 * One optimizer step (DESIGN.md sections 3 and 10 — keep this shape, a data-parallel reduce slots in
 * after backward):
 *   for each of accum_steps micro-batches: forward, backward seeded with scale/accum_steps
 *     (weight gradients accumulate in FP32)
 *   [reduce]  check: one fused pass over all gradients (non-finite counts, squared norm)
 *   step:     skipped if non-finite; else unscale and clip folded into one factor, optimizer update,
 *             low-precision weight copies refreshed
 *   update:   loss scale; log row; evaluation every eval_every steps
 */
#ifndef AMP_TRAIN_H
#define AMP_TRAIN_H

#include <stdio.h>

#include "config.h"
#include "data.h"
#include "error.h"
#include "model.h"

/* Train as `cfg` says. Prints progress to stdout. */
enum amp_status train_run(const struct config *cfg, struct amp_error *err);

struct eval_result {
    double loss;          /* mean over rows */
    double accuracy;      /* NaN for text and mse */
    int64_t samples;
};

/* Forward-only pass over a whole split in batches of m->max_batch. */
enum amp_status train_evaluate(struct model *m, const struct dataset *ds, enum split s, struct eval_result *out,
                               struct amp_error *err);

#endif
