/*
 * runlog.c — run directory, scale_log.csv, eval.jsonl, TensorBoard event file, progress line. See runlog.h.
 */
#define _POSIX_C_SOURCE 200809L
#include "runlog.h"

#include <dirent.h>
#include <errno.h>
#include <libgen.h>
#include <math.h>
#include <stdlib.h> /* strtod */
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
                                        "numerics.csv", "samples.jsonl"};
    size_t n = strlen(name);
    bool found = strncmp(name, "ckpt-", 5) == 0 && n > 8 && strcmp(name + n - 3, ".h5") == 0;
    found = found || strncmp(name, TBOARD_PREFIX, strlen(TBOARD_PREFIX)) == 0;
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

enum amp_status runlog_open(struct runlog *rl, const struct config *cfg, int64_t total_steps, int64_t step,
                            const char *resume, struct amp_error *err)
{
    memset(rl, 0, sizeof *rl);
    snprintf(rl->dir, sizeof rl->dir, "%s", cfg->run.out_dir);
    rl->out = stdout;
    rl->tty = isatty(fileno(stdout));
    rl->log_every = cfg->run.log_every;
    rl->total_steps = total_steps;
    rl->t_start = runlog_now();
    bool tokens = cfg->data.format == DATA_TEXT || cfg->data.format == DATA_TOKENS;
    rl->tokens_per_sample = tokens ? cfg->data.seq_len : 0;

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
    return cfg->run.tensorboard ? tboard_open(&rl->tb, rl->dir, step + 1, err) : AMP_OK;
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

/* The row's numeric columns as scalars (runlog.h lists the tags). `rate` is samples_per_s as the CSV has it. */
static void step_scalars(struct runlog *rl, const struct step_record *r, double rate)
{
    const struct {
        const char *tag;
        double value;
    } cols[] = {
        {"train/epoch", (double)r->epoch},
        {"train/loss", r->loss},
        {"train/loss_scale", r->scale},
        {"train/found_inf", r->found_inf},
        {"train/skipped", r->skipped},
        {"train/skips_total", (double)r->skips_total},
        {"train/grad_norm", r->grad_norm},
        {"train/clip_coef", r->clip_coef},
        {"train/lr", r->lr},
        {"train/grad_zero_frac", r->grad_zero_frac},
        {"train/samples_per_s", rate},
    };
    for (size_t i = 0; i < sizeof cols / sizeof cols[0]; i++)
        if (!(isnan(cols[i].value) && !strcmp(cols[i].tag, "train/grad_zero_frac"))) /* not sampled this step */
            tboard_scalar(rl->tb, r->step, cols[i].tag, cols[i].value);
    if (rl->tokens_per_sample > 0)
        tboard_scalar(rl->tb, r->step, "train/tokens_per_s", rate * (double)rl->tokens_per_sample);
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
    char rate[48];
    snprintf(rate, sizeof rate, "%.1f", r->samples_per_s);
    fprintf(f, "%s\n", rate);
    if (ferror(f))
        return amp_fail(err, AMP_ERR_INTERNAL, "check free disk space", "cannot write %s/scale_log.csv", rl->dir);
    if (rl->tb)
        step_scalars(rl, r, strtod(rate, NULL));

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
    return rl->tb ? tboard_flush(rl->tb, err) : AMP_OK;
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

/* The length of the valid UTF-8 sequence at s (n bytes left), or 0 where none starts there (overlong forms,
 * surrogates and code points beyond U+10FFFF are invalid). */
static size_t utf8_len(const unsigned char *s, size_t n)
{
    unsigned c = s[0];
    size_t len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    if (len == 0 || len > n)
        return 0;
    uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return 0;
        cp = cp << 6 | (s[i] & 0x3F);
    }
    static const uint32_t least[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < least[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
        return 0;
    return len;
}

void runlog_json_bytes(FILE *f, const char *s, size_t len)
{
    const unsigned char *p = (const unsigned char *)s;
    fputc('"', f);
    for (size_t i = 0; i < len;) {
        size_t n = utf8_len(p + i, len - i);
        if (n == 0) {
            fprintf(f, "\\udc%02x", p[i]);
            i++;
        } else if (n == 1 && (p[i] == '"' || p[i] == '\\')) {
            fprintf(f, "\\%c", p[i]);
            i++;
        } else if (n == 1 && (p[i] < 0x20 || p[i] == 0x7F)) {
            fprintf(f, "\\u%04x", p[i]);
            i++;
        } else {
            fwrite(p + i, 1, n, f);
            i += n;
        }
    }
    fputc('"', f);
}

/* The sample as TensorBoard's text plugin shows it (UTF-8, Markdown): the prompt in bold, then the text; bytes that
 * are not valid UTF-8, and NULs, as U+FFFD. malloc'd, or NULL when out of memory. */
static char *sample_markdown(const char *prompt, size_t prompt_len, const char *text, size_t text_len)
{
    size_t cap = 3 * (prompt_len + text_len) + 8; /* each byte at most U+FFFD's three */
    char *md = malloc(cap), *o = md;
    if (!md)
        return NULL;
    const char *part[2] = {prompt, text};
    size_t plen[2] = {prompt_len, text_len};
    for (int k = 0; k < 2; k++) {
        const unsigned char *p = (const unsigned char *)part[k];
        if (k == 0) {
            memcpy(o, "**", 2);
            o += 2;
        }
        for (size_t i = 0; i < plen[k];) {
            size_t n = utf8_len(p + i, plen[k] - i);
            if (n == 0 || p[i] == 0) {
                memcpy(o, "\xEF\xBF\xBD", 3);
                o += 3;
                i++;
            } else {
                memcpy(o, p + i, n);
                o += n;
                i += n;
            }
        }
        if (k == 0) {
            memcpy(o, "**", 2);
            o += 2;
        }
    }
    *o = '\0';
    return md;
}

enum amp_status runlog_sample(struct runlog *rl, FILE *out, int64_t step, const char *prompt, size_t prompt_len,
                              const char *text, size_t text_len, struct amp_error *err)
{
    char path[CFG_STR + 32];
    snprintf(path, sizeof path, "%s/samples.jsonl", rl->dir);
    FILE *f = fopen(path, "a");
    if (!f)
        return amp_fail(err, AMP_ERR_INTERNAL, "check the run directory's permissions", "cannot append to %s: %s",
                        path, strerror(errno));
    fprintf(f, "{\"step\": %lld, \"prompt\": ", (long long)step);
    runlog_json_bytes(f, prompt, prompt_len);
    fputs(", \"text\": ", f);
    runlog_json_bytes(f, text, text_len);
    fputs("}\n", f);
    if (fclose(f) != 0)
        return amp_fail(err, AMP_ERR_INTERNAL, "check free disk space", "cannot write %s", path);
    if (out) {
        fprintf(out, "sample step %lld | ", (long long)step);
        fwrite(prompt, 1, prompt_len, out);
        fwrite(text, 1, text_len, out);
        fputc('\n', out);
        fflush(out);
    }
    if (!rl->tb)
        return AMP_OK;
    char *md = sample_markdown(prompt, prompt_len, text, text_len);
    if (!md)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory logging a sample to %s", tboard_path(rl->tb));
    tboard_text(rl->tb, step, "samples", md);
    free(md);
    return tboard_flush(rl->tb, err);
}

enum amp_status runlog_eval_tboard(struct runlog *rl, const struct eval_record *r, struct amp_error *err)
{
    if (!rl->tb)
        return AMP_OK;
    tboard_scalar(rl->tb, r->step, "eval/loss", r->loss);
    if (!isnan(r->accuracy))
        tboard_scalar(rl->tb, r->step, "eval/accuracy", r->accuracy);
    if (!isnan(r->perplexity))
        tboard_scalar(rl->tb, r->step, "eval/perplexity", r->perplexity);
    return tboard_flush(rl->tb, err);
}

void runlog_close(struct runlog *rl)
{
    if (rl->scale_csv)
        fclose(rl->scale_csv);
    rl->scale_csv = NULL;
    struct amp_error err = {0};
    if (tboard_close(rl->tb, &err) != AMP_OK)
        fprintf(stderr, "ampTrain: warning: %s\n", err.msg);
    rl->tb = NULL;
}
