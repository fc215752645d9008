/*
 * train.h — the training loop (`ampTrain run`) and evaluation.
 *
 * One optimizer step (docs/precision.md, "One optimizer step"; docs/distributed.md):
 *   for each of accum_steps micro-batches: forward, backward seeded with scale/(accum_steps x world)
 *     (weight gradients accumulate in FP32, each micro-batch's summed apart and then added)
 *   reduce:   data parallel: the flat FP32 gradient buffer and the step's loss summed over the ranks, once
 *             per step (lib/engine/dist.h); every rank then holds the same gradients and decides alike
 *   check:    one fused pass over all gradients (non-finite counts, squared norm)
 *   step:     skipped if non-finite; else unscale and clip folded into one factor, optimizer update,
 *             low-precision weight copies refreshed
 *   update:   loss scale; log row; evaluation every eval_every steps
 * The check, step and update run on the backend (lib/base/step_rule.h): trainer_step queues a whole step
 * without waiting for it, and trainer_flush reads the log rows of the steps queued since the last
 * flush in one go. run_loop flushes every log window: run.log_every steps (at most TRAIN_MAX_WINDOW),
 * and before a checkpoint, an evaluation, a stop and the end.
 */
#ifndef AMP_TRAIN_H
#define AMP_TRAIN_H

#include <stdio.h>

#include "config.h"
#include "comm.h"  /* struct comm */
#include "data.h"
#include "dist.h"  /* struct dist */
#include "dist_overlap.h" /* struct dist_overlap */
#include "error.h"
#include "model.h"
#include "optim.h"  /* struct optimizer */
#include "runlog.h" /* struct runlog, struct step_record */
#include "scaler.h" /* struct scaler */
#include "step_rule.h" /* struct step_params, step_state, step_row, grad_check */
#include "test_switches.h" /* struct trainer_test_hook */
#include "zero.h" /* struct zero_plan: dist.zero 1's partition */

#define TRAIN_MAX_WINDOW 256 /* steps queued at most between two flushes */

/* Host staging buffers and backend buffers for one batch. The staging buffers come in
 * BACKEND_STAGING_SLOTS sets (backend host_alloc: pinned on CUDA), used in turn, so the host gathers the
 * next batch while the device may still copy the last one. */
struct batch_io {
    int64_t max_n;
    int64_t *idx;
    float *x_stage[BACKEND_STAGING_SLOTS];
    int32_t *tokens_stage[BACKEND_STAGING_SLOTS], *labels_stage[BACKEND_STAGING_SLOTS];
    int slot;              /* the set the next batch_io_load fills */
    size_t label_count;    /* labels per sample: 1, or seq_len for text */
    struct batch b;        /* backend side */
    int32_t *correct_host;
    float *loss_host;
};

/* What run.keep_best or run.early_stop has seen of the run's evaluations; stored in each checkpoint's /state, so
 * a resumed run goes on comparing against the same best (docs/checkpoint.md, "The best checkpoint"). */
struct eval_watch {
    enum eval_metric metric; /* METRIC_NONE: nothing watched */
    double best;             /* the best value so far (meaningful when best_step >= 0) */
    int64_t best_step;       /* its step; -1: no evaluation yet */
    int64_t since;           /* evaluations after the best that did not improve on it */
};

/* CUDA Graphs of a training step (docs/backend.md, "CUDA Graphs"). A step is cut into pieces, one per micro-batch
 * (its forward, backward and loss sum; the last one also the step's tail: check, update, scale, log row), each
 * recorded once by the backend (graph_begin / graph_end) and replayed afterwards (graph_launch). The batch uploads
 * run between the pieces. Key k < accum_steps is micro-batch k's piece; key accum_steps the last micro-batch's
 * piece on a step that samples grad_zero_frac (it counts zeros as well). */
struct train_graphs {
    bool off;                    /* none this run (the backend has none, or a refusal said once why) */
    bool seen[BACKEND_GRAPHS];   /* the key's piece ran plainly once (plans and scratch settled): record next */
    bool kept[BACKEND_GRAPHS];   /* the backend keeps the key's graph */
    int64_t zero_total, zero_pad;/* the grad_zero_frac piece's (key accum_steps) host counts (grad_zeros), as
                                  * its recording computed them */
    int64_t recorded, replayed;  /* pieces recorded, pieces replayed (the run's summary line) */
};

/* The state of a training run. */
struct trainer {
    const struct config *cfg;
    struct backend *be;
    struct dist dist;            /* the communicator bound to the backend; one rank: collectives are no-ops */
    struct dist_overlap *overlap; /* the gradient buckets reduced during backward (dist_overlap.h); NULL: none */
    struct zero_plan zero;       /* dist.zero 1: which elements each rank reduces, holds and updates (zero.h) */
    int rank, world;
    double reduce_seconds;       /* wall time of the steps' gradient reduces so far (trainer_step) */
    int64_t *idx_skip;           /* sampler indices of the other ranks' micro-batches (read past) */
    int64_t samples_seen;        /* training samples of every rank so far (checkpointed) */
    struct dataset ds;
    struct model model;
    struct optimizer opt;
    struct scaler scaler;
    struct state_bound bound;    /* host mirror of the step state's bound (lib/base/step_rule.h); +Inf until a step */
    struct sampler sampler;
    struct runlog log;
    struct batch_io io;
    const struct tensor **grads; /* every parameter's fp32 gradient, in model order */
    int64_t total_steps;
    int64_t step;                /* optimizer steps attempted (taken or skipped), queued ones included */
    /* The step rule's state in backend memory. scaler, opt.step and the steps in flight are the host's
     * mirror of it: written to the backend when a window starts, read back by trainer_flush. */
    struct step_params params;
    void *dev;                   /* one backend allocation holding the four below, in this order */
    struct step_state *dev_state;
    struct grad_check *dev_check;
    struct step_row *dev_row;    /* the running step's row and counts, copied into the window by window_store */
    int64_t *dev_row_counts;
    struct step_row *dev_rows;   /* window rows */
    int64_t *dev_counts;         /* per row: Inf counts then NaN counts of every gradient tensor */
    int64_t window;              /* rows the buffers hold: min(run.log_every, TRAIN_MAX_WINDOW) */
    int64_t pending;             /* steps queued since the last flush */
    int64_t *pend_epoch;         /* host side of the pending rows */
    int64_t *pend_zero_total;    /* elements the sampled grad_zero_frac counted (0: not sampled) */
    int64_t *pend_zero_pad;      /* zeros in the device count that are a padded vocabulary's (grad_zeros.padding) */
    void *host;                  /* the host copy of the dev block (trainer_flush reads it in one download) */
    struct step_row *rows_host;  /* views into host, at dev_rows' and dev_counts' offsets */
    int64_t *counts_host;
    int64_t ncounts;             /* counts per row: 2 * parameter tensors (at least 2) */
    size_t counts_off;           /* where the counts start in the block */
    struct step_record *recs;    /* trainer_flush's output: recs[0..nrecs) */
    int64_t nrecs;
    struct trainer_test_hook test_hook; /* test-only: faults between backward and the check (test_switches.h) */
    /* When set, called after the first micro-batch's forward and backward of the next step, with that
     * micro-batch's context and batch (lib/engine/numerics.c measures there, against its FP32 shadow). It must not
     * change the model's tensors: the step goes on from them. */
    enum amp_status (*after_first_micro)(struct trainer *t, const struct step_ctx *ctx, const struct batch *b,
                                         void *user, struct amp_error *err);
    void *micro_user;
    /* When set (fp8, ampTrain numerics): the first micro-batch's fp8 casts raise these counters, 4 per fp8
     * tensor, the forward group's first (backend memory; backend.h fp8_cast_args) */
    int64_t *fp8_counts;
    struct eval_watch best;      /* run.keep_best: the best evaluation, whose checkpoint DIR/best names */
    struct eval_watch stop;      /* run.early_stop: its best and the evaluations since */
    bool fp8_eval_noted;         /* an fp8 run said once that it evaluates under bf16 autocast */
    int64_t ckpt_world;          /* ckpt_load_trainer: the data-parallel ranks that wrote the checkpoint (0: none loaded) */
    int64_t ckpt_accum;          /* ... and the accum_steps it trained with (0: not recorded) */
    struct train_graphs graphs;  /* CUDA Graphs of the step's pieces (below) */
};

/* Open the backend, load data, build and initialise the model, optimizer, scaler and sampler. On
 * failure the trainer is still safe to tear down. comm: the ranks (NULL: one rank). */
enum amp_status trainer_setup(struct trainer *t, const struct config *cfg, struct comm *comm, struct amp_error *err);

/* Queue optimizer step t->step (accum_steps micro-batches, check, step or skip, scale update) and
 * advance t->step. It waits for nothing on the backend; the step's outcome is known after
 * trainer_flush. At most t->window steps may be queued between flushes (a programming error beyond). */
enum amp_status trainer_step(struct trainer *t, struct amp_error *err);

/* Wait for the queued steps and read their log rows into t->recs[0..t->nrecs) (samples_per_s left 0),
 * in step order, and the backend's state into the host mirror (t->scaler, t->opt.step). With nothing
 * queued it sets nrecs to 0. */
enum amp_status trainer_flush(struct trainer *t, struct amp_error *err);

/* Fail-fast policy after a step (docs/precision.md, "Failing fast"): AMP_ERR_UNSTABLE with the reason. */
enum amp_status trainer_check_stability(const struct trainer *t, const struct step_record *rec, struct amp_error *err);

void trainer_teardown(struct trainer *t);

/* A measurement that takes chosen steps of a run in trainer_step's place, plugged in from above the trainer:
 * run.numerics_every's is lib/engine/numerics.h's numerics_probe, which measures a step's first micro-batch through
 * after_first_micro. The run opens it on rank 0 once the trainer is set up (and the checkpoint loaded), has it take
 * every run.numerics_every-th step, and closes it at the end. */
struct train_probe {
    /* Start measuring t's run; *self becomes the probe's state (close it even when open fails). */
    enum amp_status (*open)(struct trainer *t, void **self, struct amp_error *err);
    /* Queue step t->step as trainer_step does, measuring on the way: the step's bits must not change. */
    enum amp_status (*step)(void *self, struct trainer *t, struct amp_error *err);
    /* report: the run ended well, so print what was measured (cfg: the run's); then free self (NULL: nothing). */
    void (*close)(void *self, const struct config *cfg, bool report);
};

/* Train as `cfg` says. Prints progress to stdout. Checkpoints every run.ckpt_every steps and at the end
 * (lib/engine/checkpoint.h), and at each new best evaluation under run.keep_best; with run.keep_best or run.early_stop an
 * evaluation comes before its step's checkpoint, and run.early_stop ends the run with AMP_OK after its patience. On SIGINT/SIGTERM the current step finishes, a checkpoint is written and the
 * status is AMP_EXIT_SIGINT / AMP_EXIT_SIGTERM; a second signal during that save exits at once. probe: what
 * run.numerics_every measures with; NULL only where run.numerics_every is 0 (otherwise AMP_ERR_INTERNAL). */
enum amp_status train_run(const struct config *cfg, struct comm *comm, const struct train_probe *probe,
                          struct amp_error *err);

/* The same, continuing from `checkpoint` (cfg is its embedded config with the allowed overrides).
 * fresh_scaler: the precision mode changed, so the loss scaler starts from its init. */
enum amp_status train_resume(const struct config *cfg, const char *checkpoint, bool fresh_scaler, struct comm *comm,
                             const struct train_probe *probe, struct amp_error *err);

struct eval_result {
    double loss;          /* mean over rows */
    double accuracy;      /* NaN for text and mse */
    int64_t samples;
};

/* The figure `metric` names (loss, accuracy, or perplexity: exp(loss)) of an evaluation; NaN when not measured. */
double eval_metric_value(const struct eval_result *r, enum eval_metric metric);

/* Record value `v` of step `step` in w: true (and `since` reset) when it is better than w's best by more than
 * min_delta (in the metric's direction) or is the first; otherwise false and `since` counts one more. NaN never
 * improves. */
bool eval_watch_update(struct eval_watch *w, double v, int64_t step, double min_delta);

/* Forward-only pass over a whole split in batches of m->max_batch. With several ranks (comm; NULL: one)
 * batch b runs on rank b mod world and the per-batch sums are gathered and added in batch order, so
 * every rank gets the bits of a one-rank evaluation. A collective: every rank calls it. */
enum amp_status train_evaluate(struct model *m, const struct dataset *ds, enum split s, struct comm *comm,
                               struct eval_result *out, struct amp_error *err);

#endif
