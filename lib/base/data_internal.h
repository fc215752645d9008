/*
 * data_internal.h — what the format readers (data_idx.c, data_hdf5.c, data_text.c, data_tokens.c) share with
 * data.c. Not part of the data module's public contract: only data*.c include it.
 *
 * Each reader fills a zeroed `struct dataset` (spec, sample_numel, both splits) or returns
 * AMP_ERR_DATA (or AMP_ERR_CONFIG / AMP_ERR_INTERNAL) with the file and what is wrong; on failure it
 * may leave partial allocations in `ds`, which data_load frees with data_free.
 */
#ifndef AMP_DATA_INTERNAL_H
#define AMP_DATA_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "data.h" /* struct dataset, struct data_config */

/* A mask of 1 << enum split: the splits a reader fills (idx and tokens; hdf5 and text always fill both). */
#define DATA_SPLITS_BOTH ((1u << SPLIT_TRAIN) | (1u << SPLIT_TEST))

/* idx: `classes` > 0 gives the classes where the test split is read without the training labels. */
enum amp_status data_load_idx(struct dataset *ds, const struct data_config *cfg, unsigned splits, int64_t classes,
                              struct amp_error *err);
enum amp_status data_load_hdf5(struct dataset *ds, const struct data_config *cfg, struct amp_error *err);
enum amp_status data_load_text(struct dataset *ds, const struct data_config *cfg, struct amp_error *err);
enum amp_status data_load_tokens(struct dataset *ds, const struct data_config *cfg, unsigned splits,
                                 struct amp_error *err);
/* data_gather for a token split (data_tokens.c): windows of T + 1 tokens by sample id (data.h). */
void data_gather_tokens(const struct data_split *sp, int64_t T, const int64_t *idx, int64_t n, int32_t *tokens,
                        int32_t *labels);

/* Check that `path` (named by config key `key`) is a readable, non-empty regular file before any
 * library touches it, so the common mistakes get our messages: missing (with `missing_hint`), a
 * directory, a FIFO, device or socket (a reader would wait on it for ever or read it without end), unreadable,
 * empty. On success stores the file size in *size (may be NULL). */
enum amp_status data_check_file(const char *path, const char *key, const char *missing_hint, int64_t *size,
                                struct amp_error *err);

/* count * size bytes, refusing sizes that overflow or exceed this machine's physical memory (a
 * corrupt header must not become a multi-terabyte malloc). NULL with err filled on failure:
 * AMP_ERR_DATA naming `path` and `what` when the size is absurd, AMP_ERR_INTERNAL when malloc fails. */
void *data_alloc(uint64_t count, size_t size, const char *path, const char *what, struct amp_error *err);

/* a * b into *out unless it overflows int64 (both non-negative). */
bool data_mul_ok(int64_t a, int64_t b, int64_t *out);

#endif
