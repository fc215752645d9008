/*
 * overrides.h — what `resume` and `eval` may change of a checkpoint's config (docs/checkpoint.md, "Resume" and
 * "eval"): one table a command, its reasons for refusing the other keys, and the check that applies an override.
 *
 * A checkpoint fixes its run: the model's shapes, the data and its order, the seed. `resume` continues that run, so
 * it accepts only what leaves it the same run (its length, logging, where and how fast it computes, how values are
 * stored, where the data files lie); `eval` only where and how fast it runs and where the data lies. The tables are
 * the one list the refusal's hint prints, `run.resume: auto` reads (lib/engine/restart.h) and the docs name.
 */
#ifndef AMP_OVERRIDES_H
#define AMP_OVERRIDES_H

#include <stdbool.h>
#include <stddef.h>

#include "config.h" /* struct config */
#include "error.h"  /* enum amp_status, struct amp_error */

/* One command's table of the overrides it accepts. */
struct override_rules {
    const char *cmd;
    const char *const *allowed;
    size_t nallowed;
    const char *(*refusal)(const char *key); /* why `key` is refused */
    const char *otherwise;                   /* the hint's last words: how to change anything else */
};

extern const struct override_rules resume_rules; /* `resume`, and `run` continuing under run.resume: auto */
extern const struct override_rules eval_rules;

/* Whether `rules` accepts KEY (a key, not KEY=VALUE). */
bool override_allowed(const struct override_rules *rules, const char *key);

/* The reason `resume` refuses KEY (what changing it would do to the run). */
const char *override_resume_refusal(const char *key);

/* Whether ov (KEY=VALUE) sets one of the data paths, which a checkpoint's digests check (ckpt_check_data). */
bool override_sets_data_path(const char *ov);

/* Apply one override ov (KEY=VALUE) to cfg, or refuse it: AMP_ERR_CONFIG where it is not KEY=VALUE or its key is
 * not in the table (the message says why, the hint lists the table); a key the config does not have at all gets the
 * config reader's own message. Run length is steps or epochs: one override replaces the checkpoint's choice. */
enum amp_status override_apply(const struct override_rules *rules, struct config *cfg, const char *ov,
                               struct amp_error *err);

#endif
