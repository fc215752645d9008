/*
 * data.h — datasets in host memory and the deterministic, resumable sampler.
 *
 * Formats (DESIGN.md section 5): IDX (gzip or not; MNIST-style images and labels), HDF5 (float
 * array x (N, ...) and integer labels y (N)), and byte-level text (files concatenated; samples are
 * non-overlapping windows of seq_len+1 bytes: inputs are the first seq_len, labels the next-byte
 * targets). Inputs are normalised once at load: idx x' = (x/255 - mean)/std, hdf5 x' = (x - mean)/std.
 *
 * Splits: idx has its own test files; hdf5 and text hold out the last val_fraction of the samples
 * (of the byte stream for text) as the "test" split.
 *
 * Every failure is AMP_ERR_DATA naming the file and what is wrong: missing file, wrong magic number,
 * truncated file, image/label count mismatch, label out of range, fewer samples than one batch,
 * non-finite inputs.
 */
#ifndef AMP_DATA_H
#define AMP_DATA_H

#include <stdbool.h>
#include <stdint.h>

#include "config.h" /* struct data_config */
#include "error.h"
#include "model.h"  /* struct data_spec */

enum split { SPLIT_TRAIN = 0, SPLIT_TEST = 1 };

struct data_split {
    int64_t n;            /* samples */
    float *x;             /* (n, sample_numel) normalised fp32; NULL for text */
    int32_t *y;           /* (n) labels; NULL for text */
    const uint8_t *text;  /* text: the split's bytes (points into dataset.text_buf) */
    int64_t text_len;
};

struct dataset {
    struct data_spec spec;
    int64_t sample_numel; /* floats per sample (x) or tokens per sample (text) */
    struct data_split split[2];
    uint8_t *text_buf;    /* owned, text only */
};

/* Load and check everything. `min_samples` is the fewest training samples acceptable (batch_size *
 * accum_steps): fewer is a data error saying how many there are. */
enum amp_status data_load(struct dataset *ds, const struct data_config *cfg, int64_t min_samples,
                          struct amp_error *err);
void data_free(struct dataset *ds);

/* Copy samples idx[0..n) of a split into host buffers: x (n, sample_numel) fp32 for arrays, or
 * tokens (n, seq_len) int32 for text; labels (n) or (n, seq_len) int32. */
void data_gather(const struct dataset *ds, enum split s, const int64_t *idx, int64_t n, float *x, int32_t *tokens,
                 int32_t *labels);

/* Deterministic shuffled order over n samples from (seed, epoch): epoch e's permutation is a pure
 * function of (seed, e), so a run resumed at (epoch, cursor) continues the same order. Training
 * batches are full: the last partial batch of an epoch is dropped (drop_last). */
struct sampler {
    int64_t n;
    uint64_t seed;
    bool shuffle;
    int64_t epoch;        /* 0-based */
    int64_t cursor;       /* position in this epoch's order */
    int64_t *order;       /* this epoch's permutation */
};

enum amp_status sampler_init(struct sampler *s, int64_t n, uint64_t seed, bool shuffle, struct amp_error *err);
/* Jump to (epoch, cursor), e.g. after a resume. */
void sampler_seek(struct sampler *s, int64_t epoch, int64_t cursor);
/* Fill idx with the next `batch` indices, moving to the next epoch first when fewer than `batch` remain. */
void sampler_next(struct sampler *s, int64_t batch, int64_t *idx);
/* Optimizer-step-free count: full batches per epoch. */
int64_t sampler_batches_per_epoch(const struct sampler *s, int64_t batch);
void sampler_free(struct sampler *s);

#endif
