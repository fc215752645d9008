/*
 * restart.h — `run` under run.resume: auto (docs/checkpoint.md, "Restarts without a person"): whether run.out_dir
 * holds this run, and from which checkpoint it continues.
 *
 * So that a scheduler's requeue or a shell retry loop may repeat the same `ampTrain run` after a failure: where
 * run.out_dir holds no run, the run starts; where it holds one, the newest checkpoint that verifies (the one `latest`
 * names, then ckpt-STEP.h5 from the highest STEP down) is continued, provided its config differs from this one only
 * in keys `resume` may change (lib/engine/overrides.h), which become the resume's overrides; at the run's last
 * step there is nothing to do. A directory that holds a run but no checkpoint, or only checkpoints that fail to
 * verify, or a run of another config, is an error: nothing of it is replaced.
 */
#ifndef AMP_RESTART_H
#define AMP_RESTART_H

#include "checkpoint.h" /* struct ckpt_info */
#include "comm.h"       /* struct comm */
#include "config.h"     /* struct config, CFG_STR */
#include "error.h"      /* enum amp_status, struct amp_error */

enum restart_action { RESTART_START, RESTART_CONTINUE, RESTART_COMPLETE };

struct restart {
    enum restart_action action;
    char ckpt[CFG_STR + 64];  /* RESTART_CONTINUE, RESTART_COMPLETE: the checkpoint continued from */
    struct ckpt_info info;    /* its state */
    char **ov;                /* RESTART_CONTINUE: KEY=VALUE of each key this run changes (malloc'd) */
    int nov;
};

/* Decide what `run` with cfg does with cfg->run.out_dir, on every rank of `ranks`, and agree: every rank reads the
 * directory itself, and a rank that decides otherwise (another directory) ends the job with AMP_ERR_CONFIG. Rank 0
 * warns of each checkpoint passed over. AMP_ERR_CKPT where the run has checkpoints but none verifies,
 * AMP_ERR_CONFIG where it has none or is of another config (naming the first key that differs, both values). */
enum amp_status restart_decide(const struct config *cfg, struct comm *ranks, struct restart *r, struct amp_error *err);

void restart_free(struct restart *r);

#endif
