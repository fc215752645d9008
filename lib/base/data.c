/*
 * data.c — the data module's front: data_load dispatches to the format readers (data_idx.c,
 * data_hdf5.c, data_text.c, data_tokens.c) and applies the checks common to all formats; data_gather
 * copies a batch to host buffers; the sampler gives each epoch a deterministic order. See data.h and
 * docs/data.md.
 *
 * The sampler keeps no random state: epoch e's order is a Fisher-Yates shuffle whose draws are
 * rng_below(seed, DATA_SHUFFLE_STREAM + e, i, i + 1), the identity, or (random token windows) draws
 * rng_below(seed, DATA_WINDOW_STREAM + e, k, range) computed as they are handed out; so (seed, epoch,
 * cursor) — what a checkpoint stores — is all it takes to continue the same order after a resume.
 * Only a shuffled order is stored (n int64): token files of any size need no per-window memory.
 */
#define _DEFAULT_SOURCE /* sysconf(_SC_PHYS_PAGES), stat */

#include "data.h"

#include <errno.h>
#include <fcntl.h> /* open: O_NONBLOCK */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h> /* munmap: token files */
#include <sys/stat.h>
#include <unistd.h>

#include "data_internal.h" /* data_load_idx, data_load_hdf5, data_load_text */
#include "digest.h"        /* digest_bytes: data_fingerprint */
#include "rng.h"           /* rng_below */

/* Far from the small stream numbers layers use (their index), so shuffling never shares draws with
 * dropout or init. Epoch e uses stream DATA_SHUFFLE_STREAM + e. */
#define DATA_SHUFFLE_STREAM 0x5348554646000000ULL /* "SHUFF" */
/* Random token windows: epoch e draws from stream DATA_WINDOW_STREAM + e. */
#define DATA_WINDOW_STREAM 0x57494e444f000000ULL /* "WINDO" */

/* ---- helpers shared with the readers ---------------------------------------------------------- */

enum amp_status data_check_file(const char *path, const char *key, const char *missing_hint, int64_t *size,
                                struct amp_error *err)
{
    if (!path || !path[0])
        return amp_fail(err, AMP_ERR_CONFIG, missing_hint, "%s is not set", key);
    /* O_NONBLOCK: opening a FIFO for reading would wait for a writer for ever (fstat refuses it below) */
    int fd = open(path, O_RDONLY | O_NONBLOCK);
    if (fd < 0) {
        if (errno == ENOENT || errno == ENOTDIR)
            return amp_fail(err, AMP_ERR_DATA, missing_hint, "%s: no such file (%s)", path, key);
        if (errno == EACCES)
            return amp_fail(err, AMP_ERR_DATA, "check the file's permissions", "%s: cannot read (%s): %s", path, key,
                            strerror(errno));
        return amp_fail(err, AMP_ERR_DATA, "check the path and its permissions", "%s: cannot open (%s): %s", path,
                        key, strerror(errno));
    }
    struct stat st;
    int stat_errno = fstat(fd, &st) == 0 ? 0 : errno;
    close(fd);
    if (stat_errno)
        return amp_fail(err, AMP_ERR_DATA, "check the path and its permissions", "%s: cannot open (%s): %s", path,
                        key, strerror(stat_errno));
    if (S_ISDIR(st.st_mode))
        return amp_fail(err, AMP_ERR_DATA, "name a file, not a directory", "%s: is a directory, not a file (%s)",
                        path, key);
    if (!S_ISREG(st.st_mode))
        return amp_fail(err, AMP_ERR_DATA, "name a data file on disk, not a pipe, FIFO, device or socket",
                        "%s: not a regular file (%s)", path, key);
    if (st.st_size == 0)
        return amp_fail(err, AMP_ERR_DATA, "the file is empty: re-download or reinstall it, or fix the path",
                        "%s: empty file (0 bytes) (%s)", path, key);
    if (size)
        *size = (int64_t)st.st_size;
    return AMP_OK;
}

bool data_mul_ok(int64_t a, int64_t b, int64_t *out)
{
    if (a < 0 || b < 0 || (b != 0 && a > INT64_MAX / b))
        return false;
    *out = a * b;
    return true;
}

static uint64_t physical_memory_bytes(void)
{
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || page <= 0)
        return UINT64_C(1) << 40;
    return (uint64_t)pages * (uint64_t)page;
}

void *data_alloc(uint64_t count, size_t size, const char *path, const char *what, struct amp_error *err)
{
    uint64_t mem = physical_memory_bytes();
    if (size != 0 && count > mem / size) {
        amp_fail(err, AMP_ERR_DATA, "check the file: its dimensions look corrupt, or use a machine with more memory",
                 "%s: %s needs %llu x %zu bytes, more than this machine's %.1f GB of memory", path, what,
                 (unsigned long long)count, size, (double)mem / 1e9);
        return NULL;
    }
    void *p = malloc(count * size > 0 ? (size_t)(count * size) : 1);
    if (!p)
        amp_fail(err, AMP_ERR_INTERNAL, "free some memory and retry", "%s: out of memory allocating %s (%llu bytes)",
                 path, what, (unsigned long long)(count * size));
    return p;
}

/* ---- load / free ------------------------------------------------------------------------------ */

/* The file a training-split message should name. */
static const char *train_source(const struct data_config *cfg)
{
    switch (cfg->format) {
    case DATA_IDX: return cfg->train_images;
    case DATA_HDF5: return cfg->path;
    case DATA_TEXT: return cfg->nfiles == 1 ? cfg->files[0] : "data.files";
    case DATA_TOKENS: return cfg->train_bin;
    }
    return "data";
}

static enum amp_status check_min_samples(const struct dataset *ds, const struct data_config *cfg, int64_t min_samples,
                                         struct amp_error *err)
{
    int64_t n = ds->split[SPLIT_TRAIN].n;
    if (n >= min_samples)
        return AMP_OK;
    char need[160];
    if (cfg->batch_size > 0 && min_samples % cfg->batch_size == 0)
        snprintf(need, sizeof need, "data.batch_size %lld x accum_steps %lld = %lld", (long long)cfg->batch_size,
                 (long long)(min_samples / cfg->batch_size), (long long)min_samples);
    else
        snprintf(need, sizeof need, "%lld", (long long)min_samples);
    bool windows = cfg->format == DATA_TEXT || cfg->format == DATA_TOKENS;
    return amp_fail(err, AMP_ERR_DATA,
                    windows ? "lower data.batch_size, accum_steps or data.seq_len, or add more text"
                            : "lower data.batch_size or accum_steps, or use a larger dataset",
                    "%s: the training split has %lld %s, fewer than one optimizer step needs (%s)", train_source(cfg),
                    (long long)n, windows ? "windows" : "samples", need);
}

enum amp_status data_file_digest(const char *path, const char *key, uint64_t *digest, struct amp_error *err)
{
    int fd = open(path, O_RDONLY | O_NONBLOCK);
    struct stat sb;
    if (fd < 0 || fstat(fd, &sb) != 0) {
        int e = errno;
        if (fd >= 0)
            close(fd);
        return amp_fail(err, AMP_ERR_DATA, "check the path and its permissions", "%s: cannot read (%s): %s", path,
                        key, strerror(e));
    }
    uint64_t size = (uint64_t)sb.st_size, h = digest_u64(DIGEST_INIT, size);
    unsigned char *buf = malloc(DATA_DIGEST_CHUNK);
    if (!buf) {
        close(fd);
        return amp_fail(err, AMP_ERR_INTERNAL, "free some memory and retry", "%s: out of memory digesting it (%s)",
                        path, key);
    }
    bool whole = size <= DATA_DIGEST_WHOLE;
    uint64_t pieces = whole ? (size + DATA_DIGEST_CHUNK - 1) / DATA_DIGEST_CHUNK : DATA_DIGEST_CHUNKS;
    enum amp_status st = AMP_OK;
    for (uint64_t k = 0; k < pieces && st == AMP_OK; k++) {
        /* whole: consecutive chunks; else chunk k starts at (size - CHUNK) * k / (CHUNKS - 1) */
        uint64_t at = whole ? k * DATA_DIGEST_CHUNK
                            : (uint64_t)((double)(size - DATA_DIGEST_CHUNK) * (double)k / (DATA_DIGEST_CHUNKS - 1));
        size_t want = (size_t)(size - at < DATA_DIGEST_CHUNK ? size - at : DATA_DIGEST_CHUNK);
        ssize_t got = pread(fd, buf, want, (off_t)at);
        if (got != (ssize_t)want)
            st = amp_fail(err, AMP_ERR_DATA, "check the file: it changed while being read, or the disk failed",
                          "%s: cannot read %zu bytes at offset %llu (%s): %s", path, want, (unsigned long long)at, key,
                          got < 0 ? strerror(errno) : "short read");
        else
            h = digest_bytes(h, buf, want);
    }
    free(buf);
    close(fd);
    *digest = h;
    return st;
}

/* Record the files the loaded splits came from, in config order, each with its digest. */
static enum amp_status digest_files(struct dataset *ds, const struct data_config *cfg, unsigned splits,
                                    struct amp_error *err)
{
    const char *keys[DATA_MAX_FILES], *paths[DATA_MAX_FILES];
    char file_keys[CFG_MAX_FILES][32];
    int n = 0;
    bool train = splits & (1u << SPLIT_TRAIN), test = splits & (1u << SPLIT_TEST);
    switch (cfg->format) {
    case DATA_IDX:
        if (train) {
            keys[n] = "data.train_images", paths[n++] = cfg->train_images;
            keys[n] = "data.train_labels", paths[n++] = cfg->train_labels;
        }
        if (test) {
            keys[n] = "data.test_images", paths[n++] = cfg->test_images;
            keys[n] = "data.test_labels", paths[n++] = cfg->test_labels;
        }
        break;
    case DATA_HDF5: keys[n] = "data.path", paths[n++] = cfg->path; break;
    case DATA_TEXT:
        for (int i = 0; i < cfg->nfiles && i < CFG_MAX_FILES; i++) {
            snprintf(file_keys[i], sizeof file_keys[i], "data.files.%d", i);
            keys[n] = file_keys[i], paths[n++] = cfg->files[i];
        }
        break;
    case DATA_TOKENS:
        if (train)
            keys[n] = "data.train_bin", paths[n++] = cfg->train_bin;
        if (test && cfg->val_bin[0])
            keys[n] = "data.val_bin", paths[n++] = cfg->val_bin;
        break;
    }
    enum amp_status st = AMP_OK;
    for (int i = 0; i < n && st == AMP_OK; i++) {
        struct data_file *f = &ds->files[i];
        snprintf(f->key, sizeof f->key, "%s", keys[i]);
        snprintf(f->path, sizeof f->path, "%s", paths[i]);
        st = data_file_digest(f->path, f->key, &f->digest, err);
        ds->nfiles = i + 1;
    }
    return st;
}

/* Read the splits in `splits` (a mask of 1 << enum split; the formats that keep both in one set of files read both)
 * and digest the files read. `classes` > 0: the classes, where an idx test split is read alone. */
static enum amp_status load(struct dataset *ds, const struct data_config *cfg, unsigned splits, int64_t classes,
                            struct amp_error *err)
{
    memset(ds, 0, sizeof *ds);
    if (!isfinite(cfg->mean) || !isfinite(cfg->std) || !(cfg->std > 0))
        return amp_fail(err, AMP_ERR_CONFIG, "data.std must be a positive number and data.mean finite",
                        "data.mean = %g, data.std = %g: cannot normalise inputs with these", cfg->mean, cfg->std);
    enum amp_status st;
    switch (cfg->format) {
    case DATA_IDX: st = data_load_idx(ds, cfg, splits, classes, err); break;
    case DATA_HDF5: st = data_load_hdf5(ds, cfg, err); break;
    case DATA_TEXT: st = data_load_text(ds, cfg, err); break;
    case DATA_TOKENS: st = data_load_tokens(ds, cfg, splits, err); break;
    default:
        st = amp_fail(err, AMP_ERR_CONFIG, "use idx, hdf5, text or tokens", "data.format: unknown format %d",
                      (int)cfg->format);
    }
    if (st == AMP_OK)
        st = digest_files(ds, cfg, splits, err);
    if (st != AMP_OK)
        data_free(ds);
    return st;
}

enum amp_status data_load(struct dataset *ds, const struct data_config *cfg, int64_t min_samples,
                          struct amp_error *err)
{
    enum amp_status st = load(ds, cfg, DATA_SPLITS_BOTH, 0, err);
    if (st == AMP_OK && (st = check_min_samples(ds, cfg, min_samples, err)) != AMP_OK)
        data_free(ds);
    return st;
}

enum amp_status data_load_split(struct dataset *ds, const struct data_config *cfg, enum split s,
                                const struct data_spec *spec, struct amp_error *err)
{
    int64_t classes = spec && spec->sample_ndim > 0 ? spec->num_classes : 0;
    unsigned splits = 1u << s;
    if (cfg->format == DATA_IDX && s == SPLIT_TEST && classes <= 0)
        splits = DATA_SPLITS_BOTH; /* the classes come from the training labels */
    return load(ds, cfg, splits, classes, err);
}

/* The k-th of DATA_FINGERPRINT_SAMPLES positions spread evenly over [0, last]. */
static int64_t spread(int64_t k, int64_t last)
{
    return (int64_t)((double)last * (double)k / (DATA_FINGERPRINT_SAMPLES - 1));
}

uint64_t data_fingerprint(const struct dataset *ds)
{
    uint64_t h = digest_u64(DIGEST_INIT, (uint64_t)ds->sample_numel);
    h = digest_u64(h, (uint64_t)ds->spec.num_classes);
    for (int d = 0; d < ds->spec.sample_ndim && d < 3; d++)
        h = digest_u64(h, (uint64_t)ds->spec.sample_shape[d]);
    for (int s = 0; s < 2; s++) {
        const struct data_split *sp = &ds->split[s];
        h = digest_u64(h, (uint64_t)sp->n);
        h = digest_u64(h, (uint64_t)sp->text_len);
        h = digest_u64(h, (uint64_t)sp->ntokens);
        for (int64_t k = 0; k < DATA_FINGERPRINT_SAMPLES; k++) {
            if (sp->x && sp->n > 0) { /* arrays: the sample's normalised values and its label */
                int64_t i = spread(k, sp->n - 1);
                h = digest_bytes(h, sp->x + i * ds->sample_numel, (size_t)ds->sample_numel * sizeof *sp->x);
                if (sp->y)
                    h = digest_bytes(h, &sp->y[i], sizeof sp->y[i]);
            } else if (sp->text && sp->text_len > 0) { /* text: a window's bytes */
                int64_t w = ds->sample_numel + 1 < sp->text_len ? ds->sample_numel + 1 : sp->text_len;
                h = digest_bytes(h, sp->text + spread(k, sp->text_len - w), (size_t)w);
            } else if (sp->tokens && sp->ntokens > 0) { /* tokens: a window's ids as stored */
                int64_t w = ds->sample_numel + 1 < sp->ntokens ? ds->sample_numel + 1 : sp->ntokens;
                h = digest_bytes(h, sp->tokens + spread(k, sp->ntokens - w) * sp->token_bytes,
                                 (size_t)(w * sp->token_bytes));
            }
        }
    }
    return h;
}

bool data_spec_from_config(const struct data_config *cfg, struct data_spec *spec)
{
    if (cfg->format != DATA_TEXT && cfg->format != DATA_TOKENS)
        return false;
    /* as data_text.c and data_tokens.c set it */
    *spec = (struct data_spec){.sample_ndim = 1, .sample_shape = {cfg->seq_len, 1, 1}, .is_tokens = true,
                               .num_classes = cfg->format == DATA_TEXT ? 256 : cfg->vocab};
    return true;
}

void data_free(struct dataset *ds)
{
    if (!ds)
        return;
    for (int s = 0; s < 2; s++) {
        free(ds->split[s].x);
        free(ds->split[s].y);
    }
    free(ds->text_buf);
    for (int s = 0; s < 2; s++)
        if (ds->maps[s])
            munmap(ds->maps[s], ds->map_len[s]);
    memset(ds, 0, sizeof *ds);
}

/* ---- gather ----------------------------------------------------------------------------------- */

void data_gather(const struct dataset *ds, enum split s, const int64_t *idx, int64_t n, float *x, int32_t *tokens,
                 int32_t *labels)
{
    const struct data_split *sp = &ds->split[s];
    const int64_t numel = ds->sample_numel;
    if (sp->tokens) {
        data_gather_tokens(sp, numel, idx, n, tokens, labels);
        return;
    }
    if (ds->spec.is_tokens) {
        /* window i is bytes [i*T, i*T + T]: inputs the first T, targets the last T */
        for (int64_t i = 0; i < n; i++) {
            const uint8_t *w = sp->text + idx[i] * numel;
            for (int64_t t = 0; t < numel; t++) {
                if (tokens)
                    tokens[i * numel + t] = w[t];
                if (labels)
                    labels[i * numel + t] = w[t + 1];
            }
        }
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        if (x)
            memcpy(x + i * numel, sp->x + idx[i] * numel, (size_t)numel * sizeof *x);
        if (labels)
            labels[i] = sp->y[idx[i]];
    }
}

/* ---- sampler ---------------------------------------------------------------------------------- */

static void sampler_make_order(struct sampler *s)
{
    if (!s->order)
        return; /* identity or draws: computed as handed out */
    for (int64_t i = 0; i < s->n; i++)
        s->order[i] = i;
    uint64_t stream = DATA_SHUFFLE_STREAM + (uint64_t)s->epoch;
    for (int64_t i = s->n - 1; i > 0; i--) {
        int64_t j = (int64_t)rng_below(s->seed, stream, (uint64_t)i, (uint64_t)i + 1);
        int64_t t = s->order[i];
        s->order[i] = s->order[j];
        s->order[j] = t;
    }
}

/* The sample id at position `pos` of the current epoch's order. */
static int64_t sampler_at(const struct sampler *s, int64_t pos)
{
    if (s->draw_range > 0)
        return DATA_WINDOW_AT(rng_below(s->seed, DATA_WINDOW_STREAM + (uint64_t)s->epoch, (uint64_t)pos,
                                        (uint64_t)s->draw_range));
    return s->order ? s->order[pos] : pos;
}

enum amp_status sampler_init(struct sampler *s, int64_t n, uint64_t seed, bool shuffle, struct amp_error *err)
{
    memset(s, 0, sizeof *s);
    if (n < 0)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "sampler_init: negative sample count %lld", (long long)n);
    if (shuffle) {
        s->order = malloc((size_t)(n > 0 ? n : 1) * sizeof *s->order);
        if (!s->order)
            return amp_fail(err, AMP_ERR_INTERNAL, "free some memory and retry",
                            "out of memory for the order of %lld samples", (long long)n);
    }
    s->n = n;
    s->seed = seed;
    s->shuffle = shuffle;
    sampler_make_order(s);
    return AMP_OK;
}

enum amp_status sampler_init_draws(struct sampler *s, int64_t n, uint64_t seed, int64_t range, struct amp_error *err)
{
    enum amp_status st = sampler_init(s, n, seed, false, err);
    if (st == AMP_OK && range < 1)
        st = amp_fail(err, AMP_ERR_INTERNAL, NULL, "sampler_init_draws: empty range %lld", (long long)range);
    s->draw_range = range;
    return st;
}

enum amp_status data_sampler_init(struct sampler *s, const struct dataset *ds, const struct data_config *cfg,
                                  uint64_t seed, struct amp_error *err)
{
    const struct data_split *train = &ds->split[SPLIT_TRAIN];
    if (cfg->format == DATA_TOKENS && cfg->sampling == SAMPLING_RANDOM)
        return sampler_init_draws(s, train->n, seed, train->draw_range, err);
    return sampler_init(s, train->n, seed, cfg->format == DATA_TOKENS ? false : cfg->shuffle, err);
}

void sampler_seek(struct sampler *s, int64_t epoch, int64_t cursor)
{
    s->epoch = epoch;
    s->cursor = cursor < 0 ? 0 : cursor > s->n ? s->n : cursor;
    sampler_make_order(s);
}

void sampler_next(struct sampler *s, int64_t batch, int64_t *idx)
{
    if (s->n <= 0 || batch <= 0)
        return;
    if (s->cursor + batch > s->n)
        sampler_seek(s, s->epoch + 1, 0);
    if (batch > s->n) {
        /* Precondition broken (data_load guarantees n >= batch): wrap rather than read past the order. */
        for (int64_t k = 0; k < batch; k++)
            idx[k] = sampler_at(s, k % s->n);
        s->cursor = s->n;
        return;
    }
    for (int64_t k = 0; k < batch; k++)
        idx[k] = sampler_at(s, s->cursor + k);
    s->cursor += batch;
}

int64_t sampler_batches_per_epoch(const struct sampler *s, int64_t batch)
{
    return batch > 0 ? s->n / batch : 0;
}

void sampler_free(struct sampler *s)
{
    if (!s)
        return;
    free(s->order);
    s->order = NULL;
}
