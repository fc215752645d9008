/*
 * data.h — datasets in host memory and the deterministic, resumable sampler.
 *
 * Formats (docs/data.md): IDX (gzip or not; MNIST-style images and labels), HDF5 (float
 * array x (N, ...) and integer labels y (N)), byte-level text (files concatenated; samples are
 * non-overlapping windows of seq_len+1 bytes: inputs are the first seq_len, labels the next-byte
 * targets), and token files (nanoGPT's raw uint16 / llm.c's headered .bin, memory-mapped, never held
 * in memory whole; windows of seq_len+1 tokens like text, consecutive or at random offsets: see
 * data_tokens.c). Inputs are normalised once at load: idx x' = (x/255 - mean)/std, hdf5 x' = (x - mean)/std.
 *
 * Splits: idx has its own test files; hdf5 and text hold out the last val_fraction of the samples
 * (of the byte stream for text) as the "test" split; tokens read the test split from data.val_bin.
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

/* What the data looks like: the shape of one sample and the classes, what a model is built for (models/model.h). */
struct data_spec {
    int sample_ndim;               /* dims of one sample (without batch): 1 (vector), 3 (C,H,W), or 1 (tokens T) */
    int64_t sample_shape[3];
    bool is_tokens;                /* text: samples are int32 token ids of length sample_shape[0] */
    int64_t num_classes;           /* labels in [0, num_classes); vocabulary size for text */
    /* classification data: where the labels come from ("FILE (data.train_labels)"), and the first training
     * sample holding the largest label, num_classes - 1 (so a model with fewer classes can name it); empty
     * where unknown */
    char labels_from[CFG_STR + 160];
    int64_t max_label_at;
    /* Every layer after the first computes its input gradient, even with no parameters before it, as if the
     * samples required a gradient (the layer tests' finite-difference checks of dx). Training leaves it false:
     * a layer computes dx only where a parameter before it needs the gradient (layer.needs_dx). */
    bool input_grad;
};

enum split { SPLIT_TRAIN = 0, SPLIT_TEST = 1 };

struct data_split {
    int64_t n;            /* samples (tokens: consecutive windows, the first data.val_windows for the test split) */
    float *x;             /* (n, sample_numel) normalised fp32; NULL for text and tokens */
    int32_t *y;           /* (n) labels; NULL for text and tokens */
    const uint8_t *text;  /* text: the split's bytes (points into dataset.text_buf) */
    int64_t text_len;
    const uint8_t *tokens;/* tokens: the file's ids, little-endian, token_bytes each (points into dataset.maps) */
    int token_bytes;      /* tokens: 2 (uint16) or 4 (uint32) */
    int64_t ntokens;
    int64_t draw_range;   /* tokens, training split: windows can start at [0, draw_range) = [0, ntokens - seq_len),
                             where data.sampling: random draws them; 0 otherwise */
};

/* Sample ids of token splits: id i >= 0 is the i-th consecutive window (it starts at token i * seq_len);
 * a window that starts at token offset o (random sampling) has the id DATA_WINDOW_AT(o) = -1 - o, and
 * DATA_WINDOW_AT of such an id gives o back. */
#define DATA_WINDOW_AT(x) (-1 - (int64_t)(x))

/* One file a dataset was read from, and what its contents were (data_file_digest), so that a checkpoint can record
 * its data and a later `eval` or `resume` can accept the same data under another path. */
#define DATA_MAX_FILES (CFG_MAX_FILES + 4)
struct data_file {
    char key[32];          /* the config key that names it: "data.train_bin", "data.files.2" */
    char path[CFG_STR];    /* as the config gives it */
    uint64_t digest;       /* data_file_digest of its bytes */
};

struct dataset {
    struct data_spec spec;
    int64_t sample_numel; /* floats per sample (x) or tokens per sample (text, tokens) */
    struct data_split split[2];
    uint8_t *text_buf;    /* owned, text only */
    void *maps[2];        /* owned, tokens only: each split's file, memory-mapped read-only */
    size_t map_len[2];
    struct data_file files[DATA_MAX_FILES]; /* the files read, in config order, each with its digest */
    int nfiles;
};

/* Load and check everything. `min_samples` is the fewest training samples acceptable (batch_size *
 * accum_steps): fewer is a data error saying how many there are. */
enum amp_status data_load(struct dataset *ds, const struct data_config *cfg, int64_t min_samples,
                          struct amp_error *err);
void data_free(struct dataset *ds);

/* Load what evaluating split `s` needs and nothing else, where the format keeps the splits in files of their own:
 * idx reads only that split's images and labels, tokens only data.train_bin or data.val_bin; hdf5 and text read their
 * one set of files for both. An idx test split alone cannot give the classes: `spec` (may be NULL) supplies the
 * model's (a checkpoint's /data), and without it idx reads the training labels too. The split not read has n 0, and
 * no minimum of training samples applies. */
enum amp_status data_load_split(struct dataset *ds, const struct data_config *cfg, enum split s,
                                const struct data_spec *spec, struct amp_error *err);

/* FNV-1a (digest.h) of a data file's size and bytes: the whole file up to DATA_DIGEST_WHOLE bytes, beyond that
 * DATA_DIGEST_CHUNKS chunks of DATA_DIGEST_CHUNK bytes spread evenly over it, the first and the last among them
 * (so a token file of any size costs at most 16 MiB of reads). Two large files that differ only between the chunks
 * read look the same. AMP_ERR_DATA naming `path` and `key` when it cannot be read. */
#define DATA_DIGEST_WHOLE (UINT64_C(16) << 20)
#define DATA_DIGEST_CHUNKS 256
#define DATA_DIGEST_CHUNK (UINT64_C(64) << 10)
enum amp_status data_file_digest(const char *path, const char *key, uint64_t *digest, struct amp_error *err);

/* The spec data_load would give, where the config alone determines it: text (seq_len bytes, 256 classes) and
 * token files (seq_len tokens, data.vocab classes). false for idx and hdf5, whose sample shape and classes are the
 * files' (data_load them). `export` builds a text model this way without reading its data. */
bool data_spec_from_config(const struct data_config *cfg, struct data_spec *spec);

/* A digest of what the ranks of a job must share (lib/engine/dist.h, dist_check_data): the sample shape, the classes,
 * each split's size, and the contents of DATA_FINGERPRINT_SAMPLES samples of each split spread evenly over it,
 * the first and the last among them (for text and tokens: their windows' bytes). Cheap for any size (token files
 * are read at those windows only); two files that differ only between the samples read look the same. */
#define DATA_FINGERPRINT_SAMPLES 64
uint64_t data_fingerprint(const struct dataset *ds);

/* Copy samples idx[0..n) of a split into host buffers: x (n, sample_numel) fp32 for arrays, or
 * tokens (n, seq_len) int32 for text and token files; labels (n) or (n, seq_len) int32. Any buffer may be
 * NULL: lib/engine/train.c passes no x and has the backend gather an array's samples as rows of split.x
 * (backend.h, upload_rows). */
void data_gather(const struct dataset *ds, enum split s, const int64_t *idx, int64_t n, float *x, int32_t *tokens,
                 int32_t *labels);

/* Deterministic shuffled order over n samples from (seed, epoch): epoch e's permutation is a pure
 * function of (seed, e), so a run resumed at (epoch, cursor) continues the same order. Training
 * batches are full: the last partial batch of an epoch is dropped (drop_last). */
struct sampler {
    int64_t n;
    uint64_t seed;
    bool shuffle;
    int64_t draw_range;   /* > 0: random token windows (sampler_init_draws) */
    int64_t epoch;        /* 0-based */
    int64_t cursor;       /* position in this epoch's order */
    int64_t *order;       /* this epoch's permutation; NULL when not shuffling (the order is 0..n-1 or draws) */
};

enum amp_status sampler_init(struct sampler *s, int64_t n, uint64_t seed, bool shuffle, struct amp_error *err);
/* Random token windows: each epoch is n draws with replacement, position k of epoch e giving the window
 * at offset rng_below(seed, DATA_WINDOW_STREAM + e, k, range) as the id DATA_WINDOW_AT(offset). A pure
 * function of (seed, epoch, cursor) like the shuffled order, so resume and the per-rank split work alike. */
enum amp_status sampler_init_draws(struct sampler *s, int64_t n, uint64_t seed, int64_t range, struct amp_error *err);
/* The training sampler the data and its config ask for: draws for tokens with data.sampling random, the
 * order 0..n-1 for tokens with sequential, else a shuffled (data.shuffle) or identity order. */
enum amp_status data_sampler_init(struct sampler *s, const struct dataset *ds, const struct data_config *cfg,
                                  uint64_t seed, struct amp_error *err);
/* Jump to (epoch, cursor), e.g. after a resume. */
void sampler_seek(struct sampler *s, int64_t epoch, int64_t cursor);
/* Fill idx with the next `batch` indices, moving to the next epoch first when fewer than `batch` remain. */
void sampler_next(struct sampler *s, int64_t batch, int64_t *idx);
/* Optimizer-step-free count: full batches per epoch. */
int64_t sampler_batches_per_epoch(const struct sampler *s, int64_t batch);
void sampler_free(struct sampler *s);

#endif
