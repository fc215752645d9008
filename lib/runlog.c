/*
 * runlog.c — run directory, scale_log.csv, eval.jsonl, progress line. See runlog.h.
 */
#define _POSIX_C_SOURCE 200809L
#include "runlog.h"

#include <dirent.h>
#include <errno.h>
#include <libgen.h>
#include <math.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "dtype.h" /* double_to_text */

double runlog_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

enum amp_status runlog_make_dirs(const char *path, struct amp_error *err)
{
    char buf[CFG_STR];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *p = buf + 1;; p++) {
        bool end = *p == '\0';
        if (*p == '/' || end) {
            char c = *p;
            *p = '\0';
            if (mkdir(buf, 0777) != 0 && errno != EEXIST)
                return amp_fail(err, AMP_ERR_INTERNAL, "check run.out_dir and its permissions",
                                "cannot create run directory '%s': %s", buf, strerror(errno));
            *p = c;
        }
        if (end)
            break;
    }
    return AMP_OK;
}

bool runlog_is_run_file(const char *name)
{
    static const char *const files[] = {"scale_log.csv", "config.yaml", "latest", "best", "eval.jsonl",
                                        "numerics.csv"};
    size_t n = strlen(name);
    bool found = strncmp(name, "ckpt-", 5) == 0 && n > 8 && strcmp(name + n - 3, ".h5") == 0;
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++)
        found = found || strcmp(name, files[i]) == 0;
    return found;
}

/* Whether `dir` holds a run (one of its run files); `which` gets the first one found. */
static bool holds_run(const char *dir, char *which, size_t len)
{
    DIR *d = opendir(dir);
    if (!d)
        return false;
    bool found = false;
    struct dirent *e;
    while (!found && (e = readdir(d))) {
        found = runlog_is_run_file(e->d_name);
        if (found)
            snprintf(which, len, "%s/%s", dir, e->d_name);
    }
    closedir(d);
    return found;
}

/* Whether `dir` is the directory that holds the checkpoint file `ckpt` (the same directory, however named). */
static bool is_checkpoint_dir(const char *dir, const char *ckpt)
{
    char buf[CFG_STR + 64];
    snprintf(buf, sizeof buf, "%s", ckpt);
    struct stat a, b;
    return stat(dirname(buf), &a) == 0 && stat(dir, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

/* A run writes only into a directory that holds no run, or, resuming, into its checkpoint's own directory:
 * never over another run's checkpoints, `latest` and config.yaml. */
static enum amp_status claim_dir(const char *dir, const char *resume, bool *append, struct amp_error *err)
{
    char which[CFG_STR + 300];
    *append = false;
    if (resume && is_checkpoint_dir(dir, resume)) {
        snprintf(which, sizeof which, "%s/scale_log.csv", dir);
        *append = access(which, F_OK) == 0;
        return AMP_OK;
    }
    if (!holds_run(dir, which, sizeof which))
        return AMP_OK;
    if (resume)
        return amp_fail(err, AMP_ERR_CONFIG,
                        "resume into the checkpoint's own directory (leave run.out_dir as the checkpoint's), or give "
                        "run.out_dir=NEW for a directory that holds no run",
                        "resume: run.out_dir '%s' holds another run (%s exists), not the one %s belongs to; refusing "
                        "to write over it", dir, which, resume);
    return amp_fail(err, AMP_ERR_CONFIG,
                    "choose another directory (run.out_dir=...), remove the old run, or continue it with "
                    "'ampTrain resume'",
                    "run.out_dir '%s' already holds a run (%s exists); refusing to overwrite it", dir, which);
}

enum amp_status runlog_open(struct runlog *rl, const struct config *cfg, int64_t total_steps, const char *resume,
                            struct amp_error *err)
{
    memset(rl, 0, sizeof *rl);
    snprintf(rl->dir, sizeof rl->dir, "%s", cfg->run.out_dir);
    rl->out = stdout;
    rl->tty = isatty(fileno(stdout));
    rl->log_every = cfg->run.log_every;
    rl->total_steps = total_steps;
    rl->t_start = runlog_now();

    bool append = false;
    enum amp_status st = runlog_make_dirs(rl->dir, err);
    if (st == AMP_OK)
        st = claim_dir(rl->dir, resume, &append, err);
    if (st != AMP_OK)
        return st;
    char path[CFG_STR + 32];
    snprintf(path, sizeof path, "%s/scale_log.csv", rl->dir);
    rl->scale_csv = fopen(path, append ? "a" : "w");
    if (!rl->scale_csv)
        return amp_fail(err, AMP_ERR_INTERNAL, "check run.out_dir and its permissions", "cannot write %s: %s", path,
                        strerror(errno));
    if (!append)
        fprintf(rl->scale_csv, "%s\n", SCALE_LOG_HEADER);

    snprintf(path, sizeof path, "%s/config.yaml", rl->dir);
    FILE *f = fopen(path, "w");
    if (!f)
        return amp_fail(err, AMP_ERR_INTERNAL, "check run.out_dir and its permissions", "cannot write %s: %s", path,
                        strerror(errno));
    config_print_yaml(cfg, f);
    if (fclose(f) != 0)
        return amp_fail(err, AMP_ERR_INTERNAL, "check free disk space", "cannot write %s: %s", path, strerror(errno));
    return AMP_OK;
}

void runlog_csv_field(FILE *f, const char *s)
{
    if (!strpbrk(s, ",\"\n")) {
        fputs(s, f);
        return;
    }
    fputc('"', f);
    for (; *s; s++) {
        if (*s == '"')
            fputc('"', f);
        fputc(*s, f);
    }
    fputc('"', f);
}

/* The shortest text that reads back exactly (double_to_text); empty for NaN where a value is "not measured". */
static void csv_num(FILE *f, double v, bool nan_empty)
{
    if (isnan(v) && nan_empty)
        return;
    if (isnan(v))
        fputs("nan", f);
    else if (isinf(v))
        fputs(v > 0 ? "inf" : "-inf", f);
    else {
        char text[40];
        double_to_text(v, text, sizeof text);
        fputs(text, f);
    }
}

static void format_eta(char *buf, size_t len, double seconds)
{
    if (!(seconds >= 0) || seconds > 1e7) {
        snprintf(buf, len, "?");
        return;
    }
    long s = (long)seconds;
    if (s >= 3600)
        snprintf(buf, len, "%ldh%02ldm", s / 3600, (s / 60) % 60);
    else if (s >= 60)
        snprintf(buf, len, "%ldm%02lds", s / 60, s % 60);
    else
        snprintf(buf, len, "%lds", s);
}

enum amp_status runlog_step(struct runlog *rl, const struct step_record *r, struct amp_error *err)
{
    FILE *f = rl->scale_csv;
    fprintf(f, "%lld,%lld,", (long long)r->step, (long long)r->epoch);
    csv_num(f, r->loss, false);
    fputc(',', f);
    csv_num(f, r->scale, false);
    fprintf(f, ",%d,%d,%lld,", r->found_inf, r->skipped, (long long)r->skips_total);
    csv_num(f, r->grad_norm, false);
    fputc(',', f);
    csv_num(f, r->clip_coef, false);
    fputc(',', f);
    csv_num(f, r->lr, false);
    fputc(',', f);
    runlog_csv_field(f, r->overflow_layer);
    fputc(',', f);
    csv_num(f, r->grad_zero_frac, true);
    fputc(',', f);
    fprintf(f, "%.1f\n", r->samples_per_s);
    if (ferror(f))
        return amp_fail(err, AMP_ERR_INTERNAL, "check free disk space", "cannot write %s/scale_log.csv", rl->dir);

    bool log_line = rl->log_every > 0 && (r->step % rl->log_every == 0 || r->step == rl->total_steps);
    if (!rl->tty && !log_line && !r->skipped)
        return AMP_OK;
    char eta[32];
    double elapsed = runlog_now() - rl->t_start;
    format_eta(eta, sizeof eta, r->step > 0 ? elapsed / (double)r->step * (double)(rl->total_steps - r->step) : -1);
    int k = (int)lround(log2(r->scale));
    char line[512];
    snprintf(line, sizeof line, "epoch %lld | step %lld/%lld | loss %.4f | scale 2^%d | skips %lld | %.0f samples/s | ETA %s%s%s",
             (long long)r->epoch, (long long)r->step, (long long)rl->total_steps, r->loss, k, /* 0-based, as everywhere */
             (long long)r->skips_total, r->samples_per_s, eta, r->skipped ? " | skipped: " : "",
             r->skipped ? (r->overflow_layer[0] ? r->overflow_layer : "non-finite gradients") : "");
    if (rl->tty) {
        fprintf(rl->out, "\r\033[K%s", line);
        if (r->skipped || r->step == rl->total_steps)
            fputc('\n', rl->out);
    } else {
        fprintf(rl->out, "%s\n", line);
    }
    fflush(rl->out);
    return AMP_OK;
}

enum amp_status runlog_flush(struct runlog *rl, struct amp_error *err)
{
    if (rl->scale_csv && fflush(rl->scale_csv) != 0)
        return amp_fail(err, AMP_ERR_INTERNAL, "check free disk space", "cannot write %s/scale_log.csv", rl->dir);
    return AMP_OK;
}

static void json_num(FILE *f, double v)
{
    char text[40];
    double_to_text(v, text, sizeof text);
    fputs(isfinite(v) ? text : "null", f);
}

enum amp_status runlog_eval(const char *dir, FILE *out, const struct eval_record *r, struct amp_error *err)
{
    char path[CFG_STR + 32];
    snprintf(path, sizeof path, "%s/eval.jsonl", dir);
    FILE *f = fopen(path, "a");
    if (!f)
        return amp_fail(err, AMP_ERR_INTERNAL, "check the run directory's permissions", "cannot append to %s: %s",
                        path, strerror(errno));
    fprintf(f, "{\"step\": %lld, \"split\": \"%s\", \"autocast\": %s, \"dtype\": \"%s\", \"loss\": ", (long long)r->step,
            r->split, r->autocast ? "true" : "false", r->dtype);
    json_num(f, r->loss);
    fputs(", \"accuracy\": ", f);
    json_num(f, r->accuracy);
    if (!isnan(r->perplexity)) {
        fputs(", \"perplexity\": ", f);
        json_num(f, r->perplexity);
    }
    fprintf(f, ", \"samples\": %lld}\n", (long long)r->samples);
    if (fclose(f) != 0)
        return amp_fail(err, AMP_ERR_INTERNAL, "check free disk space", "cannot write %s", path);
    if (out) {
        fprintf(out, "eval step %lld | %s | autocast %s (%s) | loss %.4f", (long long)r->step, r->split,
                r->autocast ? "on" : "off", r->dtype, r->loss);
        if (!isnan(r->accuracy))
            fprintf(out, " | accuracy %.4f", r->accuracy);
        if (!isnan(r->perplexity))
            fprintf(out, " | perplexity %.3f", r->perplexity);
        fprintf(out, " | %lld samples\n", (long long)r->samples);
        fflush(out);
    }
    return AMP_OK;
}

void runlog_close(struct runlog *rl)
{
    if (rl->scale_csv)
        fclose(rl->scale_csv);
    rl->scale_csv = NULL;
}
