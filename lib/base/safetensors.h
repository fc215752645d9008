/*
 * safetensors.h — the safetensors format, written and read by our own code (`ampTrain export`, and
 * `model.init_from` later; docs/checkpoint.md, "export").
 *
 * A file is
 *   8 bytes    N, the header length, a little-endian u64
 *   N bytes    a UTF-8 JSON object: {"NAME": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}, ...,
 *              "__metadata__": {"format": "pt", ...}} (string values only), padded with spaces so that the
 *              data section starts on an 8-byte boundary
 *   the rest   the data section: each tensor's elements, row-major, little-endian, at [begin, end) of the
 *              section; the tensors lie back to back, without gaps, and cover the section exactly
 * (huggingface/safetensors, README "Format").
 *
 * Rules of this module:
 *   - Writing is atomic, as checkpoints are: a temporary file beside OUT (.ampTrain-export-XXXXXX, short
 *     whatever OUT's name), fsync, rename, fsync of the directory; the file gets 0666 & ~umask. On any failure
 *     nothing new is left at OUT (an existing OUT is untouched) and the error, AMP_ERR_INTERNAL, names OUT.
 *     SIGINT and SIGTERM are held during the write: one that arrives removes the temporary file and is
 *     returned as AMP_EXIT_SIGINT / AMP_EXIT_SIGTERM (the signal itself is taken off, not delivered).
 *   - Reading trusts nothing: the header length against the file and a 100 MB cap (the reference's), the
 *     JSON by a strict parser of just this format (objects, arrays, strings with escapes, unsigned
 *     integers), every dtype, shape and offset, duplicate names. Every failure is AMP_ERR_CKPT naming the
 *     file and, where there is one, the tensor; never a read out of bounds.
 *   - ampTrain takes F32, F16 and BF16 (lib/base/dtype.h); any other dtype of the format is refused by name.
 *   - Data is little-endian in the file and in memory: ampTrain builds for little-endian hosts only.
 */
#ifndef AMP_SAFETENSORS_H
#define AMP_SAFETENSORS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dtype.h" /* enum dtype */
#include "error.h" /* enum amp_status, struct amp_error */

#define SAFETENSORS_MAX_DIMS 8
#define SAFETENSORS_MAX_HEADER (100u << 20) /* bytes of JSON, as the reference implementation caps it */

struct safetensor {
    char *name;                             /* writer: borrowed; reader: owned by the safetensors_file */
    enum dtype dtype;
    int ndim;                               /* 0 (a scalar) to SAFETENSORS_MAX_DIMS */
    int64_t shape[SAFETENSORS_MAX_DIMS];
    const void *data;                       /* numel elements of dtype; reader: points into the file's bytes */
    size_t nbytes;                          /* numel * dtype_size (the reader checks it; the writer computes it) */
};

struct safetensors_meta {
    const char *key, *value;
};

/* A file read back: tensors in header order, metadata, and the bytes they point into. */
struct safetensors_file {
    struct safetensor *tensors;
    int ntensors;
    char **meta_keys, **meta_values;        /* __metadata__, in header order */
    int nmeta;
    unsigned char *bytes;                   /* the whole file */
    size_t size;
    size_t data_start;                      /* 8 + N */
};

/* Write `n` tensors (in this order, back to back) and the metadata to `path` atomically. */
enum amp_status safetensors_write(const char *path, const struct safetensor *tensors, int n,
                                  const struct safetensors_meta *meta, int nmeta, struct amp_error *err);

/* Whether the `size` bytes of a file that begin with `head` (its first min(size, 9) bytes) start as a safetensors
 * file does: an 8-byte header length n with 8 + n <= size, and the header's first byte '{'. A cheap look, not a
 * validation: `export` replaces an existing OUT only when this holds (an earlier export), never a checkpoint, a
 * config or any other file a mistyped argument names. */
bool safetensors_sniff(const unsigned char *head, size_t size);

/* Read and validate `path`. On success f owns everything (safetensors_free); on failure f is empty. */
enum amp_status safetensors_read(const char *path, struct safetensors_file *f, struct amp_error *err);

/* Validate `size` bytes (a copy is taken; `name` is the file named in messages). safetensors_read is this on
 * the file's contents; the tests and the fuzz harness call it directly. */
enum amp_status safetensors_parse(const unsigned char *bytes, size_t size, const char *name, struct safetensors_file *f,
                                  struct amp_error *err);

/* The tensor called `name`, or NULL. */
const struct safetensor *safetensors_find(const struct safetensors_file *f, const char *name);

/* Accepts an empty or zeroed file. */
void safetensors_free(struct safetensors_file *f);

/* "F32", "F16", "BF16" */
const char *safetensors_dtype_name(enum dtype dt);

#endif
