/*
 * checkpoint.h — FP32 HDF5 checkpoints (docs/checkpoint.md has the layout and an
 * h5py snippet).
 *
 * Layout of one file:
 *   [512-byte user block: "AMPTCKPT" magic, layout version, file length, CRC-32 of bytes 512..end]
 *   /             attrs format="ampTrain-checkpoint", format_version, amptrain_version, created
 *   /config       the resolved YAML (fixed-length string dataset)
 *   /state        attrs step, micro_step, epoch, cursor, samples_seen, skips_total, precision_mode
 *   /model/LAYER/PARAM           float32, chunked, Fletcher-32 (parameters and batchnorm buffers)
 *   /optimizer    attr step; /optimizer/LAYER/PARAM/m and .../v (those the optimizer has)
 *   /scaler       attrs scale, growth_tracker, hysteresis_left, consecutive_skips, skips_total,
 *                 last_overflow_step, mode
 *   /data         attrs epoch, cursor, seed, shuffle   (the sampler position); sample_ndim, sample_dimN,
 *                 num_classes, tokens; "digest:KEY" per data file read (KEY its config key, the value its
 *                 data_file_digest as int64)
 *   /rng          attr seed (dropout masks are a pure function of seed and the micro-batch counter)
 *
 * Crash safety: ckpt_save writes DIR/ckpt-STEP.h5.tmp, fsyncs it, renames it, fsyncs the directory,
 * then rewrites DIR/latest (one line, the file name) the same tmp+rename way, and DIR/best too when the step is
 * run.keep_best's best, then prunes to keep_ckpts (never the file DIR/best names).
 * Loading first checks the user block's length and CRC over the whole file, so HDF5 never parses a
 * damaged file; every failure is AMP_ERR_CKPT naming what is wrong.
 */
#ifndef AMP_CHECKPOINT_H
#define AMP_CHECKPOINT_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "config.h" /* struct config */
#include "error.h"
#include "train.h"  /* struct trainer */

#define CKPT_FORMAT "ampTrain-checkpoint"
#define CKPT_FORMAT_VERSION 1
#define CKPT_MAGIC "AMPTCKPT" /* the first 8 bytes of every checkpoint (its user block) */

/* What /state and /scaler hold, as read back (for inspect and resume). */
struct ckpt_info {
    int64_t format_version;
    int64_t step, epoch, cursor, samples_seen, skips_total;
    int64_t world_size;    /* data-parallel ranks that wrote it (1 for checkpoints from before data parallel) */
    int64_t accum_steps;   /* the accum_steps it trained with (0 in files from before it was recorded) */
    char precision_mode[32];
    char created[64];
    char amptrain_version[32];
    /* the data's sample shape and classes (vocabulary), from /data's attributes, so that the model can be built
     * without the data (export); sample_ndim 0 in files written before they were */
    int sample_ndim;
    int64_t sample_shape[3];
    int64_t num_classes;
    bool is_tokens;
    /* the files the run's data came from, by config key, each with its data_file_digest (/data's attributes
     * "digest:KEY"); ndata_files 0 in files written before they were recorded */
    int ndata_files;
    struct ckpt_data_file {
        char key[32];
        uint64_t digest;
    } data_files[DATA_MAX_FILES];
};

/* Write t's full state to DIR/ckpt-STEP.h5 crash-safely, update DIR/latest (and DIR/best when t->best says this
 * step is the best evaluation), keep the newest `keep`, the checkpoint DIR/best names, and also DIR/ckpt-PROTECT.h5
 * (the last checkpoint after a clean step; -1: none), so a run of skipped steps cannot prune the point a fail-fast
 * stop tells the user to continue from. /state records t->best and t->stop (run.keep_best, run.early_stop).
 * On success `path_out` (may be NULL) receives the file's path. Failures are AMP_ERR_INTERNAL (I/O). */
enum amp_status ckpt_save(const struct trainer *t, const char *dir, int64_t keep, int64_t protect, char *path_out,
                          size_t path_len, struct amp_error *err);

/* Whether `path` is an ampTrain checkpoint (a regular file that starts with CKPT_MAGIC) or a run directory (one
 * with a `latest` file): what `run` and `check` name when given one in place of a config. Opens nothing that
 * could block (a FIFO). */
bool ckpt_sniff(const char *path);

/* A CHECKPOINT argument: a ckpt-STEP.h5 path is taken as it is; a run directory stands for the file
 * its `latest` names. AMP_ERR_CKPT when the directory has no `latest` or it names a missing file. */
enum amp_status ckpt_resolve(const char *arg, char *path, size_t len, struct amp_error *err);

/* Check the whole-file checksum and the format attributes. AMP_ERR_CKPT naming what is wrong. */
enum amp_status ckpt_verify(const char *path, struct ckpt_info *info, struct amp_error *err);

/* The identity of a checkpoint's contents, for ranks to compare the files they were given (a copy on each host has
 * the same): its header's checksum and size mixed into one value, read without checking them (the caller has
 * verified the file, or will). AMP_ERR_CKPT where the header cannot be read. */
enum amp_status ckpt_fingerprint(const char *path, uint64_t *fp, struct amp_error *err);

/* Whether the data files in `ds` are the ones the checkpoint at `path` recorded (info from ckpt_verify): each file
 * whose key the checkpoint records must have the recorded digest, and a text run's list of files its length.
 * AMP_ERR_DATA naming the file and its key when not. A checkpoint that records no digests (info->ndata_files 0:
 * written before they were) accepts any data, as it always did; *checked (may be NULL) says whether it did check. */
enum amp_status ckpt_check_data(const char *path, const struct ckpt_info *info, const struct dataset *ds,
                                bool *checked, struct amp_error *err);

/* Read /config (after verifying) into cfg (overwritten; config_free it afterwards). */
enum amp_status ckpt_read_config(const char *path, struct config *cfg, struct amp_error *err);

/* Load model parameters and buffers into m (already built from the checkpoint's config), refreshing the
 * low-precision copies. A missing tensor or a shape mismatch is AMP_ERR_CKPT naming it. */
enum amp_status ckpt_load_model(const char *path, struct model *m, struct amp_error *err);

/* Load everything into a set-up trainer: model, optimizer, sampler, step; the scaler unless
 * `fresh_scaler` (precision mode changed on resume). */
enum amp_status ckpt_load_trainer(const char *path, struct trainer *t, bool fresh_scaler, struct amp_error *err);

/* One tensor under /model (a parameter or a batchnorm buffer), as `export` reads it: no model is built. */
struct ckpt_tensor {
    char name[256]; /* LAYER/PARAM, the path under /model */
    int ndim;       /* 1 to 8 */
    int64_t shape[8];
    size_t numel;
    float *data;    /* (numel) fp32, host */
};

struct ckpt_weights {
    struct ckpt_tensor *tensors; /* in name order (HDF5's index) */
    int n;
    struct ckpt_info info;
};

/* Read every float tensor under /model after verifying the file, each checked for class, rank and finite
 * values. AMP_ERR_CKPT naming the file and the tensor; free with ckpt_weights_free (accepts a zeroed one). */
enum amp_status ckpt_read_weights(const char *path, struct ckpt_weights *w, struct amp_error *err);
void ckpt_weights_free(struct ckpt_weights *w);

/* Print step, precision, scaler state, tensors with shapes, and the config. */
enum amp_status ckpt_inspect(const char *path, FILE *out, struct amp_error *err);

/* Remove stale DIR/ *.tmp files left by a crash. Returns how many were removed. */
int ckpt_clean_stale(const char *dir);

#endif
