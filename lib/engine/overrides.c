/*
 * overrides.c — the keys `resume` and `eval` may change, and the check that applies one (overrides.h).
 */
#include "overrides.h"

#include <stdio.h>
#include <string.h>

/* The data paths `resume` and `eval` may point elsewhere: the files are checked against the digests the checkpoint
 * records (ckpt_check_data), so only their place may change, never their contents. */
#define DATA_PATH_KEYS                                                                                                 \
    "data.train_images", "data.train_labels", "data.test_images", "data.test_labels", "data.path", "data.files",       \
        "data.train_bin", "data.val_bin"

/* Keys `resume` may change, and why the others may not (docs/checkpoint.md, "Resume": it continues the same run). */
static const char *const resume_allowed[] = {
    "run.steps", "run.epochs", "run.log_every", "run.eval_every", "run.ckpt_every", "run.keep_ckpts", "run.numerics_every",
    "run.recompute", /* the same bits, less memory */
    "run.sample_every", "run.sample_prompt", /* samples never change the run */
    /* what the evaluations are watched for; a changed metric starts its watch afresh (docs/config.md) */
    "run.keep_best", "run.early_stop", "run.early_stop.metric", "run.early_stop.patience", "run.early_stop.min_delta",
    "run.out_dir", "run.device", "run.threads", "precision.mode", "stability.max_consecutive_skips", "stability.on_nonfinite",
    /* how the weights and moments are stored: converted once at load (docs/checkpoint.md, "Resume") */
    "precision.master_weights", "optim.state_dtype", "optim.stochastic_rounding",
    "dist.backend", "dist.check_every", "dist.timeout_s",
    "dist.zero", /* where the optimizer state lives, not what it is: a checkpoint holds it whole (lib/engine/zero.h) */
    "run.resume", /* what a later `run` does with the directory, not the training */
    "accum_steps", /* so that a resume on another number of ranks can keep the step's batch (docs/distributed.md) */
    DATA_PATH_KEYS,
};

const char *override_resume_refusal(const char *key)
{
    if (strncmp(key, "model.", 6) == 0)
        return "it changes the model's shapes or initialisation, which the checkpoint's tensors fix";
    if (strncmp(key, "data.", 5) == 0)
        return "it changes the data or its order, which the checkpoint's sampler position refers to";
    if (strcmp(key, "run.seed") == 0 || strcmp(key, "run.name") == 0)
        return "the seed and name identify the run being continued (change run.out_dir to write elsewhere)";
    return "it changes the training itself, so the resumed run would not continue the checkpoint's run";
}

/* Keys `eval` may change: where and how fast it runs, and where the data is; not what the model or a sample is. */
static const char *const eval_allowed[] = {
    "run.device", "run.threads", "data.batch_size", "data.val_windows", DATA_PATH_KEYS,
};

static const char *eval_refusal(const char *key)
{
    if (strncmp(key, "model.", 6) == 0)
        return "it changes the model, which the checkpoint's tensors fix";
    if (strncmp(key, "data.", 5) == 0)
        return "it changes what a sample is, which the model was trained on";
    return "it changes only training, not how a checkpoint is evaluated";
}

const struct override_rules resume_rules = {
    "resume", resume_allowed, sizeof resume_allowed / sizeof resume_allowed[0], override_resume_refusal,
    "start a new run with 'ampTrain run' to change anything else"};
const struct override_rules eval_rules = {
    "eval", eval_allowed, sizeof eval_allowed / sizeof eval_allowed[0], eval_refusal,
    "the others are the checkpoint's own (start a new run to change them)"};

/* Whether ov (KEY=VALUE) sets one of the data paths. */
bool override_sets_data_path(const char *ov)
{
    static const char *const keys[] = {DATA_PATH_KEYS};
    size_t len = strcspn(ov, "=");
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (strlen(keys[i]) == len && strncmp(ov, keys[i], len) == 0)
            return true;
    return false;
}

bool override_allowed(const struct override_rules *rules, const char *key)
{
    for (size_t i = 0; i < rules->nallowed; i++)
        if (strcmp(key, rules->allowed[i]) == 0)
            return true;
    return false;
}

enum amp_status override_apply(const struct override_rules *rules, struct config *cfg, const char *ov,
                               struct amp_error *err)
{
    const char *eq = strchr(ov, '=');
    char key[128];
    snprintf(key, sizeof key, "%.*s", eq ? (int)(eq - ov) : (int)strlen(ov), ov);
    bool ok = override_allowed(rules, key);
    if (eq && !ok) {
        /* A key the config does not have at all: the config reader's message, with its did-you-mean. */
        struct config scratch;
        enum amp_status st = config_copy(&scratch, cfg, err);
        if (st == AMP_OK) {
            st = config_apply_override(&scratch, ov, err);
            config_free(&scratch);
        }
        if (st != AMP_OK)
            return st;
    }
    if (!eq || !ok) {
        char hint[1024]; /* the list is the table's: one list for the hint and the docs */
        snprintf(hint, sizeof hint, "%s accepts ", rules->cmd);
        for (size_t i = 0; i < rules->nallowed; i++)
            snprintf(hint + strlen(hint), sizeof hint - strlen(hint), "%s%s", i ? ", " : "", rules->allowed[i]);
        snprintf(hint + strlen(hint), sizeof hint - strlen(hint), "; %s", rules->otherwise);
        return amp_fail(err, AMP_ERR_CONFIG, hint, "%s: override '%s' refused: %s", rules->cmd, ov,
                        eq ? rules->refusal(key) : "expected KEY=VALUE");
    }
    /* both run.steps and run.epochs are refused as 'run' refuses them (config_apply_override, config_finalize) */
    return config_apply_override(cfg, ov, err);
}

