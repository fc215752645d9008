/*
 * setup.h — what every command that computes opens first, in one order: the backend, its threads, the data, the
 * autocast policy and the model.
 *
 * `run` and `resume` (trainer_setup, lib/engine/train.c), `numerics` (through trainer_setup), `eval`, `sample` and
 * `export` (cmd/main.c, lib/engine/export.c) differ only in the options below: which device and threads, how much of the
 * data is read, which precision mode's policy the model runs under, for how many samples it is built, and whether
 * its tensors come from a checkpoint. The steps run in this order, and the first failure stops them:
 *   1. the backend: run.device (or opts.device) on the node-local rank's share of the host (opts.comm);
 *   2. its threads: run.threads, auto under several ranks being the CPUs each has to itself (dist_threads);
 *   3. for training, the communicator bound to the backend (dist_init), before any rank reads data;
 *   4. the data (enum setup_data);
 *   5. the autocast policy of opts.mode, and the model built on it for opts.max_batch samples;
 *   6. with opts.ckpt, the model's tensors loaded from the checkpoint (ckpt_load_model: a missing tensor or another
 *      shape is AMP_ERR_CKPT naming it).
 * Errors are each step's own (AMP_ERR_CONFIG for a device or policy, AMP_ERR_DATA for the data, AMP_ERR_CKPT for
 * the checkpoint), unchanged: setup adds no message of its own but the one on a training step's size.
 */
#ifndef AMP_SETUP_H
#define AMP_SETUP_H

#include <stdbool.h>
#include <stdint.h>

#include "config.h"    /* struct config */
#include "data.h"      /* struct dataset, struct data_spec, enum split */
#include "error.h"     /* enum amp_status, struct amp_error */
#include "model.h"     /* struct model */
#include "precision.h" /* enum precision_mode */

struct backend;
struct ckpt_info; /* checkpoint.h */
struct comm;
struct dist;

/* How much of the data a command reads (step 4). */
enum setup_data {
    SETUP_DATA_TRAIN, /* data_load: every split, at least one step's samples (data.batch_size x accum_steps x
                       * ranks; more than 2^62 of them is AMP_ERR_CONFIG naming the config) */
    SETUP_DATA_SPLIT, /* data_load_split: opts.split alone (its files may be all that was copied with the
                       * checkpoint), then checked against the digests opts.ckpt records (ckpt_check_data) */
    SETUP_DATA_SPEC,  /* only what the model is built for: from the config for text and token data, else from the
                       * checkpoint's /data (opts.info), else from the data set, loaded for it and freed again
                       * (s->ds may be NULL) */
};

struct setup_opts {
    const char *device;             /* run.device's forms; NULL: cfg->run.device */
    struct comm *comm;              /* the ranks: the device and the CPUs are this rank's share; NULL: one rank */
    bool announce;                  /* print the backend's "device: ..." line, and on rank 0 of several CPU ranks
                                     * how the threads were shared (training's progress) */
    bool keep_threads;              /* leave the backend's one thread: export builds and loads, it computes nothing */
    bool tf32;                      /* be->allow_tf32 from precision.tf32 (training); otherwise it stays off */
    struct dist *dist;              /* training: bound to the backend (dist_init) before the data; NULL: none */
    enum setup_data data;
    enum split split;               /* SETUP_DATA_SPLIT: the split read */
    const char *ckpt;               /* the checkpoint the model's tensors are loaded from; NULL: none (training
                                     * initialises them itself) */
    const struct ckpt_info *info;   /* ckpt's, from ckpt_verify (its /data: the sample shape and classes); with ckpt */
    enum precision_mode mode;       /* whose autocast policy the model runs under */
    int64_t max_batch;              /* samples the model is built for */
};

/* What setup_open opens, and where. The dataset and the model are the caller's storage, filled in place (a model
 * points into itself, its fp8 scaling slots, so it is built where it stays: trainer_setup builds into its trainer);
 * the backend is opened here. The caller frees them: setup_close, or its own teardown. */
struct setup {
    struct backend *be;
    struct dataset *ds;   /* the data read; NULL under SETUP_DATA_SPEC, which keeps none */
    struct model *model;  /* built; its policy is model->policy */
    bool data_unchecked;  /* SETUP_DATA_SPLIT: the checkpoint records no digests of its data (written before ampTrain
                           * recorded them), so the data was used without checking that it is the run's */
};

/* Open what `cfg` and `o` describe into s->be, *s->ds and *s->model (each overwritten). On failure s holds what
 * was opened before the failing step, and is still safe to setup_close. */
enum amp_status setup_open(struct setup *s, const struct config *cfg, const struct setup_opts *o,
                           struct amp_error *err);

/* Free the model, the data and the backend (in that order); each may be partly opened, zeroed or NULL. */
void setup_close(struct setup *s);

/* Step 5 alone, on a backend and a sample shape already at hand (setup_open's, and lib/engine/numerics.c's FP32 shadow of
 * a run's model): the autocast policy of `mode` with cfg's precision.autocast overrides, and `m` built on it for
 * max_batch samples. On failure m is zeroed (model_free has nothing to do). */
enum amp_status setup_model(struct model *m, const struct config *cfg, const struct data_spec *spec,
                            struct backend *be, enum precision_mode mode, int64_t max_batch, struct amp_error *err);

#endif
