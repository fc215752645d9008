/*
 * restart.c — run.resume: auto's decision (restart.h).
 */
#define _POSIX_C_SOURCE 200809L
#include "restart.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "digest.h"    /* digest_str, digest_u64: the decision every rank compares */
#include "dist.h"      /* comm_agree, dist_check_same */
#include "overrides.h" /* resume_rules: the keys a continued run may change */
#include "runlog.h"    /* runlog_is_run_file */

void restart_free(struct restart *r)
{
    for (int i = 0; i < r->nov; i++)
        free(r->ov[i]);
    free(r->ov);
    r->ov = NULL;
    r->nov = 0;
}

/* Whether `name` is ckpt-STEP.h5; *step gets STEP. */
static bool ckpt_file_step(const char *name, long long *step)
{
    char *end;
    if (strncmp(name, "ckpt-", 5) != 0 || name[5] < '0' || name[5] > '9')
        return false;
    *step = strtoll(name + 5, &end, 10);
    return strcmp(end, ".h5") == 0;
}

/* Verify DIR/NAME into r; where it fails, rank 0 says the file is passed over and why. */
static bool verified(const char *dir, const char *name, int rank, struct restart *r)
{
    struct amp_error e = {0};
    snprintf(r->ckpt, sizeof r->ckpt, "%s/%s", dir, name);
    if (ckpt_verify(r->ckpt, &r->info, &e) == AMP_OK)
        return true;
    if (rank == 0)
        fprintf(stderr, "ampTrain: warning: run.resume auto: skipping %s: %s\n", r->ckpt, e.msg);
    return false;
}

/* The newest checkpoint in `dir` that verifies: the one `latest` names first, then ckpt-STEP.h5 from the highest
 * STEP down. *any says whether dir holds a checkpoint file at all. AMP_ERR_CKPT where none of them verifies. */
static enum amp_status newest_verified(const char *dir, int rank, struct restart *r, bool *any,
                                       struct amp_error *err)
{
    char latest[CFG_STR + 64], name[256] = "";
    snprintf(latest, sizeof latest, "%s/latest", dir);
    FILE *f = fopen(latest, "r");
    if (f) {
        if (fscanf(f, "%255s", name) != 1)
            name[0] = '\0';
        fclose(f);
    }
    *any = name[0] != '\0';
    if (name[0] && !strchr(name, '/') && verified(dir, name, rank, r))
        return AMP_OK;
    long long best = -1, below = -1; /* each pass takes the newest step under the last one tried */
    do {
        DIR *d = opendir(dir);
        if (!d)
            return amp_fail(err, AMP_ERR_INTERNAL, "check run.out_dir and its permissions", "cannot read %s: %s", dir,
                            strerror(errno));
        best = -1;
        struct dirent *e;
        long long step;
        while ((e = readdir(d)))
            if (ckpt_file_step(e->d_name, &step) && (below < 0 || step < below) && step > best &&
                strcmp(e->d_name, name) != 0)
                best = step;
        closedir(d);
        if (best < 0)
            break;
        *any = true;
        char file[64];
        snprintf(file, sizeof file, "ckpt-%lld.h5", best);
        if (verified(dir, file, rank, r))
            return AMP_OK;
        below = best;
    } while (best > 0);
    if (*any)
        return amp_fail(err, AMP_ERR_CKPT,
                        "the warnings above name each file and its fault: restore one from a copy, or remove the directory "
                        "to start the run again from step 0",
                        "run.resume auto: no checkpoint in %s verifies", dir);
    return AMP_OK;
}

/* Whether `dir` holds a run (one of its files: runlog_is_run_file). */
static bool dir_holds_run(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return false;
    bool found = false;
    struct dirent *e;
    while (!found && (e = readdir(d)))
        found = runlog_is_run_file(e->d_name);
    closedir(d);
    return found;
}

/* config_diff's callback: a key resume may change becomes an override; any other stops the walk. */
struct restart_diff {
    struct restart *r;
    char key[160], there[CFG_STR + 8], here[CFG_STR + 8];
    bool refused, failed;
};

static bool restart_diff_key(const char *key, const char *there, const char *here, void *user)
{
    struct restart_diff *d = user;
    if (!override_allowed(&resume_rules, key)) {
        d->refused = true;
        snprintf(d->key, sizeof d->key, "%s", key);
        snprintf(d->there, sizeof d->there, "%s", there);
        snprintf(d->here, sizeof d->here, "%s", here);
        return false;
    }
    size_t len = strlen(key) + strlen(here) + 2;
    char **ov = realloc(d->r->ov, (size_t)(d->r->nov + 1) * sizeof *ov);
    char *one = malloc(len);
    if (ov)
        d->r->ov = ov;
    if (!ov || !one) {
        free(one);
        d->failed = true;
        return false;
    }
    snprintf(one, len, "%s=%s", key, here);
    d->r->ov[d->r->nov++] = one;
    return true;
}

/* This run against the checkpoint's: the same but for resume_allowed's keys (those become r->ov), else
 * AMP_ERR_CONFIG naming the first other key that differs and both its values. */
static enum amp_status compare_with_checkpoint(const struct config *cfg, struct restart *r, struct amp_error *err)
{
    struct config there;
    enum amp_status st = ckpt_read_config(r->ckpt, &there, err);
    if (st != AMP_OK)
        return st;
    struct restart_diff d = {.r = r};
    int n = config_diff(&there, cfg, restart_diff_key, &d);
    config_free(&there);
    if (n < 0 || d.failed)
        return amp_fail(err, AMP_ERR_INTERNAL, "free some memory and try again", "out of memory comparing configs");
    if (d.refused) {
        char hint[CFG_STR + 200];
        snprintf(hint, sizeof hint, "give %s its run's config to continue it (only the keys 'ampTrain help resume' "
                 "lists may change), or another run.out_dir to start a new run", cfg->run.out_dir);
        return amp_fail(err, AMP_ERR_CONFIG, hint,
                        "run.resume auto: %s holds a run of another config: %s is %s in %s but %s here (%s); nothing "
                        "was written", cfg->run.out_dir, d.key, d.there, r->ckpt, d.here, override_resume_refusal(d.key));
    }
    return AMP_OK;
}

/* What this rank decides: start (no run there), continue from the newest verified checkpoint, or nothing (that
 * checkpoint is at the run's last step). */
static enum amp_status decide(const struct config *cfg, int rank, struct restart *r, struct amp_error *err)
{
    const char *dir = cfg->run.out_dir;
    *r = (struct restart){.action = RESTART_START};
    if (!dir_holds_run(dir))
        return AMP_OK;
    bool any = false;
    enum amp_status st = newest_verified(dir, rank, r, &any, err);
    if (st == AMP_OK && !any) {
        char hint[CFG_STR + 160];
        snprintf(hint, sizeof hint, "remove %s to start the run again from step 0 (set run.ckpt_every so that a "
                 "restart finds a checkpoint)", dir);
        st = amp_fail(err, AMP_ERR_CONFIG, hint,
                      "run.resume auto: %s holds a run but no checkpoint (it stopped before its first): there is "
                      "nothing to continue, and starting again would replace its logs", dir);
    }
    if (st == AMP_OK)
        st = compare_with_checkpoint(cfg, r, err);
    if (st == AMP_OK)
        r->action = cfg->run.steps > 0 && r->info.step == cfg->run.steps ? RESTART_COMPLETE : RESTART_CONTINUE;
    return st;
}

/* Every rank decided alike (each read run.out_dir itself). */
static enum amp_status agree(struct comm *ranks, const struct restart *r, struct amp_error *err)
{
    uint64_t h = digest_u64(DIGEST_INIT, (uint64_t)r->action);
    h = digest_str(h, r->action == RESTART_START ? "" : r->ckpt);
    for (int i = 0; i < r->nov; i++)
        h = digest_str(h, r->ov[i]);
    return comm_agree(ranks,
                      dist_check_same(ranks, h, AMP_ERR_CONFIG, "run.resume auto's decision (start, or which checkpoint "
                                      "to continue from)", "give every rank the same run.out_dir", err),
                      err);
}

enum amp_status restart_decide(const struct config *cfg, struct comm *ranks, struct restart *r, struct amp_error *err)
{
    enum amp_status st = comm_agree(ranks, decide(cfg, ranks->rank, r, err), err);
    if (st == AMP_OK)
        st = agree(ranks, r, err);
    return st;
}
