/*
 * runlog.h — what a run writes besides checkpoints (README.md, "What a run writes"): the resolved config, the
 * per-step scale_log.csv, eval.jsonl, a TensorBoard event file with the same numbers (run.tensorboard;
 * lib/engine/tboard.h), and the progress line (a single rewritten line on a terminal, a plain line every log_every
 * steps otherwise).
 */
#ifndef AMP_RUNLOG_H
#define AMP_RUNLOG_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "config.h"
#include "error.h"
#include "tboard.h" /* struct tboard: the event file */

#define SCALE_LOG_HEADER \
    "step,epoch,loss,scale,found_inf,skipped,skips_total,grad_norm,clip_coef,lr,overflow_layer,grad_zero_frac," \
    "samples_per_s"

/* One row of scale_log.csv. */
struct step_record {
    int64_t step;            /* optimizer step, 1-based */
    int64_t epoch;           /* 0-based epoch the step's last micro-batch came from */
    double loss;             /* mean loss over the step's micro-batches (unscaled) */
    double scale;            /* loss scale the step ran with */
    bool found_inf;
    bool skipped;
    int64_t skips_total;
    double grad_norm;        /* unscaled global norm (NaN when non-finite) */
    double clip_coef;        /* 1 when not clipping */
    double lr;               /* learning rate applied (0 when skipped) */
    char overflow_layer[160];/* "" or "fc2 (inf, 12 elements)" */
    double grad_zero_frac;   /* NaN when not sampled this step */
    double samples_per_s;
    /* not in the CSV: what the fail-fast checks read */
    int64_t consecutive_skips; /* skipped steps in a row, this one included */
    double scale_next;       /* the loss scale after this step's update */
};

struct eval_record {
    int64_t step;
    const char *split;       /* "test" / "train" */
    bool autocast;
    const char *dtype;       /* "fp32", "fp16", "bf16" */
    double loss;
    double accuracy;         /* NaN: null (text) */
    double perplexity;       /* NaN: omitted */
    int64_t samples;
};

struct runlog {
    char dir[CFG_STR];
    FILE *scale_csv;
    struct tboard *tb;       /* NULL when run.tensorboard is false */
    int64_t tokens_per_sample; /* data.seq_len for token models (train/tokens_per_s), else 0 */
    FILE *out;               /* progress output (stdout) */
    bool tty;
    int64_t log_every;
    int64_t total_steps;
    double t_start;
};

/* Create the run directory, write config.yaml, open scale_log.csv and, with run.tensorboard, a new event file.
 * A directory that already holds a run (any of runlog_is_run_file's files) is refused (exit 2), except, when
 * `resume` names the checkpoint being continued, the checkpoint's own directory, whose scale_log.csv is
 * appended to (and which gets a new event file beside the earlier ones). `step` is the step the run continues
 * from (0 for a new run): TensorBoard drops what an earlier event file logged past it. */
enum amp_status runlog_open(struct runlog *rl, const struct config *cfg, int64_t total_steps, int64_t step,
                            const char *resume, struct amp_error *err);

/* One scale_log.csv row, its scalars for TensorBoard (buffered until runlog_flush), and the progress line.
 * Scalar tags: train/epoch, train/loss, train/loss_scale, train/found_inf, train/skipped, train/skips_total,
 * train/grad_norm, train/clip_coef, train/lr, train/grad_zero_frac (the steps it was sampled),
 * train/samples_per_s (the CSV's rounded value) and, for token models, train/tokens_per_s (samples_per_s x
 * data.seq_len). */
enum amp_status runlog_step(struct runlog *rl, const struct step_record *r, struct amp_error *err);

/* Hand the rows written so far to the file system (the trainer calls it after each log window, so a
 * checkpoint is never ahead of its log, whatever kills the process next): scale_log.csv, then the event file. */
enum amp_status runlog_flush(struct runlog *rl, struct amp_error *err);
/* Append to DIR/eval.jsonl and print a line. */
enum amp_status runlog_eval(const char *dir, FILE *out, const struct eval_record *r, struct amp_error *err);
/* The same record's metrics to the event file, written at once: eval/loss, eval/accuracy (classifiers),
 * eval/perplexity (token models). Nothing when run.tensorboard is false. */
enum amp_status runlog_eval_tboard(struct runlog *rl, const struct eval_record *r, struct amp_error *err);
/* Close the files; an event file that cannot be written to the end gets a warning on stderr. */
void runlog_close(struct runlog *rl);

/* Append {"step": STEP, "prompt": ..., "text": ...} to the run directory's samples.jsonl (run.sample_every), print
 * the sample to `out` (when not NULL) and, with run.tensorboard, log it as text (tag `samples`: the prompt in bold,
 * then the text; invalid UTF-8 shown as U+FFFD). The two strings are bytes: in samples.jsonl valid UTF-8 is written
 * as it is (", \ and control characters escaped), and each byte of an invalid sequence as \udcXX (XX its value),
 * Python's surrogateescape: json.loads(line)["text"].encode("utf-8", "surrogateescape") gives the bytes back. */
enum amp_status runlog_sample(struct runlog *rl, FILE *out, int64_t step, const char *prompt, size_t prompt_len,
                              const char *text, size_t text_len, struct amp_error *err);
/* One JSON string of those rules, quotes included (exposed for tests). */
void runlog_json_bytes(FILE *f, const char *s, size_t len);

double runlog_now(void); /* monotonic seconds */

/* Whether a file of this name (no directory) is one a run writes into its run.out_dir: scale_log.csv, config.yaml,
 * latest, best, eval.jsonl, numerics.csv, samples.jsonl, ckpt-*.h5, events.out.tfevents.*. A directory holding one
 * holds a run (runlog_open refuses it unless resuming its own checkpoint); export never writes over one. */
bool runlog_is_run_file(const char *name);

/* mkdir -p PATH: a run directory and its missing parents (AMP_ERR_INTERNAL naming the one that cannot be made). */
enum amp_status runlog_make_dirs(const char *path, struct amp_error *err);

/* One CSV field with quotes where needed (exposed for tests). */
void runlog_csv_field(FILE *f, const char *s);

#endif
