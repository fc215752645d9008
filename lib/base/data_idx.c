/*
 * data_idx.c — the IDX reader (MNIST / Fashion-MNIST files), gzip or not.
 *
 * An IDX file is a 4-byte magic (0, 0, type, ndim), ndim big-endian uint32 dimensions, then the
 * values. We read type 0x08 (uint8) only: images 0x00000803 (N, H, W) and labels 0x00000801 (N).
 * zlib's gzread reads gzip and plain files alike (it looks for the gzip magic 1f 8b), so one path
 * serves both; the payload is read in large chunks into a buffer that grows only as real bytes
 * arrive, so a header claiming more data than the file holds is reported as truncated instead of
 * turning into a huge allocation.
 *
 * Labels: num_classes = max(training label) + 1; a test label outside [0, num_classes) is an error,
 * since the model would have no output for it.
 */
#define _DEFAULT_SOURCE

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "data_internal.h" /* data_check_file, data_alloc */

#define IDX_TYPE_UBYTE 0x08
#define IDX_CHUNK (1u << 24) /* bytes per gzread call */

#define IDX_MISSING_HINT \
    "install the dataset-fashion-mnist package (files under /usr/share/datasets/fashion-mnist/) or fix %s"

/* One IDX file as read: its uint8 payload and dimensions. */
struct idx_file {
    const char *path;
    const char *key;  /* config key that named it, for messages */
    int ndim;
    int64_t dims[3];
    int64_t count;    /* product of dims */
    uint8_t *data;    /* (count) bytes */
    bool gzipped;
};

static const char *idx_type_name(unsigned type)
{
    switch (type) {
    case 0x08: return "uint8";
    case 0x09: return "int8";
    case 0x0B: return "int16";
    case 0x0C: return "int32";
    case 0x0D: return "float32";
    case 0x0E: return "float64";
    }
    return NULL;
}

/* Read up to `len` bytes; returns the count read, or -1 with err filled on a gzip/IO error. A gzip
 * stream that ends early (Z_BUF_ERROR) counts as a short read, so the caller reports truncation; then
 * gzread's return value undercounts what it delivered, and gztell (the uncompressed position) tells. */
static int64_t gz_read_full(gzFile gz, const struct idx_file *f, uint8_t *buf, int64_t len, struct amp_error *err)
{
    const z_off_t start = gztell(gz);
    int64_t got = 0;
    while (got < len) {
        int64_t want = len - got < IDX_CHUNK ? len - got : IDX_CHUNK;
        int r = gzread(gz, buf + got, (unsigned)want);
        if (r > 0) {
            got += r;
            continue;
        }
        int zerr = Z_OK;
        const char *msg = gzerror(gz, &zerr);
        if (r == 0 || zerr == Z_BUF_ERROR) {
            z_off_t pos = gztell(gz);
            if (start >= 0 && pos - start > got && pos - start <= len)
                got = (int64_t)(pos - start);
            break;
        }
        if (zerr == Z_ERRNO) {
            amp_fail(err, AMP_ERR_INTERNAL, "check the disk and retry", "%s: read error (%s): %s", f->path, f->key,
                     strerror(errno));
            return -1;
        }
        size_t plen = strlen(f->path); /* zlib prefixes its message with the path we already print */
        if (msg && strncmp(msg, f->path, plen) == 0 && strncmp(msg + plen, ": ", 2) == 0)
            msg += plen + 2;
        amp_fail(err, AMP_ERR_DATA, "the file is damaged: re-download or reinstall it",
                 "%s: corrupt gzip data (%s): %s", f->path, f->key, msg ? msg : "unknown zlib error");
        return -1;
    }
    return got;
}

static enum amp_status idx_fail_magic(const struct idx_file *f, uint32_t magic, int want_ndim, struct amp_error *err)
{
    const char *want_what = want_ndim == 3 ? "uint8 images N x H x W" : "uint8 labels N";
    char found[96];
    unsigned type = (magic >> 8) & 0xff, ndim = magic & 0xff;
    if ((magic >> 16) == 0 && idx_type_name(type))
        snprintf(found, sizeof found, "0x%08X (an IDX file of %s with %u dims)", magic, idx_type_name(type), ndim);
    else
        snprintf(found, sizeof found, "0x%08X (not an IDX file)", magic);
    char hint[256];
    if (type == IDX_TYPE_UBYTE && (magic >> 16) == 0 && (int)ndim == (want_ndim == 3 ? 1 : 3))
        snprintf(hint, sizeof hint, "%s looks like an IDX %s file: are the images and labels paths swapped?", f->key,
                 ndim == 1 ? "labels" : "images");
    else
        snprintf(hint, sizeof hint, "%s must name an IDX file of %s (gzip or not)", f->key, want_what);
    return amp_fail(err, AMP_ERR_DATA, hint, "%s: wrong magic number %s, expected 0x%08X (IDX %s) (%s)", f->path, found,
                    0x800u | (unsigned)want_ndim, want_what, f->key);
}

static enum amp_status idx_fail_truncated(const struct idx_file *f, const char *part, int64_t want, int64_t got,
                                          gzFile gz, struct amp_error *err)
{
    int zerr = Z_OK;
    if (f->gzipped)
        gzerror(gz, &zerr);
    return amp_fail(err, AMP_ERR_DATA, "the file is incomplete: re-download or reinstall it",
                    "%s: truncated%s: the %s needs %lld bytes, the file holds %lld (%s)", f->path,
                    zerr == Z_BUF_ERROR ? " (the gzip stream ends early)" : "", part, (long long)want, (long long)got,
                    f->key);
}

/* Read the payload (count bytes) into a buffer grown as data arrives. */
static enum amp_status idx_read_payload(gzFile gz, struct idx_file *f, int64_t file_size, struct amp_error *err)
{
    int64_t cap = f->count;
    if (!f->gzipped && file_size < cap)
        cap = file_size > 0 ? file_size : 1; /* a plain file cannot hold more than its size */
    else if (f->gzipped && cap > (int64_t)IDX_CHUNK * 4)
        cap = (int64_t)IDX_CHUNK * 4;
    /* One byte beyond the payload: the last read asks for it, so that zlib goes on past the data to the gzip
     * trailer within that read. A read that ends exactly with the data can leave zlib holding a cut trailer's
     * bytes at the end of the file, and every later gzread then reports a clean end of file. */
    f->data = data_alloc((uint64_t)cap + 1, 1, f->path, "the IDX payload", err);
    if (!f->data)
        return err ? err->code : AMP_ERR_INTERNAL;
    int64_t got = 0;
    for (;;) {
        int64_t r = gz_read_full(gz, f, f->data + got, cap - got + (cap == f->count), err);
        if (r < 0)
            return err ? err->code : AMP_ERR_DATA;
        got += r;
        if (got > f->count)
            got = f->count; /* bytes after the payload are ignored */
        if (got < cap || cap == f->count)
            break;
        int64_t ncap = cap * 2 < f->count ? cap * 2 : f->count; /* full so far: grow and read on */
        uint8_t *p = realloc(f->data, (size_t)ncap + 1);
        if (!p)
            return amp_fail(err, AMP_ERR_INTERNAL, "free some memory and retry", "%s: out of memory reading %lld bytes",
                            f->path, (long long)ncap);
        f->data = p;
        cap = ncap;
    }
    if (got < f->count)
        return idx_fail_truncated(f, f->ndim == 3 ? "pixel data" : "label data", f->count, got, gz, err);
    if (f->gzipped) {
        /* zlib checks the gzip trailer (CRC-32 and length) only when a read reaches the stream's end: a
         * file cut inside the trailer would otherwise pass with all its data. */
        uint8_t extra;
        int r = gzread(gz, &extra, 1);
        int zerr = Z_OK;
        const char *msg = gzerror(gz, &zerr);
        if (r < 0 || zerr != Z_OK)
            return amp_fail(err, AMP_ERR_DATA, "the file is damaged or was cut short: re-download or reinstall it",
                            "%s: the gzip stream does not end properly after the %s (%s): %s", f->path,
                            f->ndim == 3 ? "pixel data" : "label data", f->key,
                            zerr == Z_BUF_ERROR ? "its trailer is missing (the file is truncated)" : msg ? msg : "?");
    }
    return AMP_OK;
}

static enum amp_status idx_read_open(gzFile gz, struct idx_file *f, int want_ndim, int64_t file_size,
                                     struct amp_error *err)
{
    const int64_t header_len = 4 + 4 * (int64_t)want_ndim;
    uint8_t hdr[16];
    int64_t got = gz_read_full(gz, f, hdr, 4, err);
    if (got < 0)
        return err ? err->code : AMP_ERR_DATA;
    f->gzipped = !gzdirect(gz);
    if (got == 0)
        return amp_fail(err, AMP_ERR_DATA, "the file is empty: re-download or reinstall it, or fix the path",
                        "%s: empty file (no data after gzip decompression) (%s)", f->path, f->key);
    if (got < 4)
        return idx_fail_truncated(f, "header", header_len, got, gz, err);
    uint32_t magic = (uint32_t)hdr[0] << 24 | (uint32_t)hdr[1] << 16 | (uint32_t)hdr[2] << 8 | hdr[3];
    if (magic != (0x800u | (unsigned)want_ndim))
        return idx_fail_magic(f, magic, want_ndim, err);
    int64_t r = gz_read_full(gz, f, hdr + 4, header_len - 4, err);
    if (r < 0)
        return err ? err->code : AMP_ERR_DATA;
    if (r < header_len - 4)
        return idx_fail_truncated(f, "header", header_len, 4 + r, gz, err);
    f->ndim = want_ndim;
    f->count = 1;
    for (int d = 0; d < want_ndim; d++) {
        const uint8_t *b = hdr + 4 + 4 * d;
        f->dims[d] = (int64_t)((uint32_t)b[0] << 24 | (uint32_t)b[1] << 16 | (uint32_t)b[2] << 8 | b[3]);
        if (f->dims[d] == 0)
            return amp_fail(err, AMP_ERR_DATA, "the file is damaged or empty: re-download or reinstall it",
                            d == 0 ? "%s: the IDX header says it holds no samples (dimension %d is 0) (%s)"
                                   : "%s: the IDX header has a zero dimension (dimension %d) (%s)",
                            f->path, d, f->key);
        if (!data_mul_ok(f->count, f->dims[d], &f->count))
            return amp_fail(err, AMP_ERR_DATA, "the file is damaged: re-download or reinstall it",
                            "%s: the IDX dimensions overflow (%s)", f->path, f->key);
    }
    return idx_read_payload(gz, f, file_size - header_len, err);
}

static enum amp_status idx_read(struct idx_file *f, const char *path, const char *key, int want_ndim,
                                struct amp_error *err)
{
    memset(f, 0, sizeof *f);
    f->path = path;
    f->key = key;
    char hint[512];
    snprintf(hint, sizeof hint, IDX_MISSING_HINT, key);
    int64_t size = 0;
    enum amp_status st = data_check_file(path, key, hint, &size, err);
    if (st != AMP_OK)
        return st;
    gzFile gz = gzopen(path, "rb");
    if (!gz)
        return amp_fail(err, AMP_ERR_DATA, "check the path and its permissions", "%s: cannot open (%s): %s", path, key,
                        errno ? strerror(errno) : "out of memory");
    gzbuffer(gz, 1u << 18);
    st = idx_read_open(gz, f, want_ndim, size, err);
    gzclose(gz);
    return st;
}

static void idx_file_free(struct idx_file *f)
{
    free(f->data);
    f->data = NULL;
}

/* Fill one split from an images file and a labels file (both already read). */
static enum amp_status idx_make_split(struct data_split *sp, const struct idx_file *img, const struct idx_file *lab,
                                      const float lut[256], struct amp_error *err)
{
    if (img->dims[0] != lab->dims[0])
        return amp_fail(err, AMP_ERR_DATA, "the images and labels files must come from the same dataset split",
                        "%s holds %lld images but %s holds %lld labels (%s, %s)", img->path, (long long)img->dims[0],
                        lab->path, (long long)lab->dims[0], img->key, lab->key);
    int64_t n = img->dims[0];
    sp->x = data_alloc((uint64_t)img->count, sizeof(float), img->path, "the fp32 images", err);
    if (!sp->x)
        return err ? err->code : AMP_ERR_INTERNAL;
    sp->y = data_alloc((uint64_t)n, sizeof(int32_t), lab->path, "the labels", err);
    if (!sp->y)
        return err ? err->code : AMP_ERR_INTERNAL;
    for (int64_t i = 0; i < img->count; i++)
        sp->x[i] = lut[img->data[i]];
    for (int64_t i = 0; i < n; i++)
        sp->y[i] = lab->data[i];
    sp->n = n;
    return AMP_OK;
}

enum amp_status data_load_idx(struct dataset *ds, const struct data_config *cfg, unsigned splits, int64_t classes,
                              struct amp_error *err)
{
    /* x' = (x/255 - mean)/std, in double and rounded once to fp32; 256 possible inputs, so a table. */
    float lut[256];
    for (int v = 0; v < 256; v++) {
        lut[v] = (float)(((double)v / 255.0 - cfg->mean) / cfg->std);
        if (!isfinite(lut[v]))
            return amp_fail(err, AMP_ERR_CONFIG, "use data.std of a sensible size (e.g. 0.3530 for Fashion-MNIST)",
                            "data.mean = %g, data.std = %g turn pixel value %d into %g", cfg->mean, cfg->std, v,
                            (double)lut[v]);
    }
    bool train = splits & (1u << SPLIT_TRAIN), test = splits & (1u << SPLIT_TEST);
    if (!train && classes <= 0)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "idx: the test split alone needs the classes");
    struct idx_file f[4];
    memset(f, 0, sizeof f);
    const char *paths[4] = {cfg->train_images, cfg->train_labels, cfg->test_images, cfg->test_labels};
    const char *keys[4] = {"data.train_images", "data.train_labels", "data.test_images", "data.test_labels"};
    enum amp_status st = AMP_OK;
    for (int k = 0; k < 4 && st == AMP_OK; k++)
        if (splits & (1u << (k / 2)))
            st = idx_read(&f[k], paths[k], keys[k], k % 2 == 0 ? 3 : 1, err);
    if (st == AMP_OK && train && test && (f[2].dims[1] != f[0].dims[1] || f[2].dims[2] != f[0].dims[2]))
        st = amp_fail(err, AMP_ERR_DATA, "the training and test images must have the same size",
                      "%s holds %lldx%lld images but %s holds %lldx%lld (data.test_images)", f[2].path,
                      (long long)f[2].dims[1], (long long)f[2].dims[2], f[0].path, (long long)f[0].dims[1],
                      (long long)f[0].dims[2]);
    for (int s = 0; s < 2 && st == AMP_OK; s++)
        if (splits & (1u << s))
            st = idx_make_split(&ds->split[s], &f[2 * s], &f[2 * s + 1], lut, err);
    if (st == AMP_OK && train) {
        int32_t max_label = 0;
        int64_t max_at = 0;
        for (int64_t i = 0; i < ds->split[SPLIT_TRAIN].n; i++)
            if (ds->split[SPLIT_TRAIN].y[i] > max_label) {
                max_label = ds->split[SPLIT_TRAIN].y[i];
                max_at = i;
            }
        ds->spec.num_classes = (int64_t)max_label + 1;
        ds->spec.max_label_at = max_at;
        snprintf(ds->spec.labels_from, sizeof ds->spec.labels_from, "%s (data.train_labels)", f[1].path);
    } else if (st == AMP_OK) {
        ds->spec.num_classes = classes;
    }
    if (st == AMP_OK && test) {
        const struct data_split *te = &ds->split[SPLIT_TEST];
        for (int64_t i = 0; i < te->n; i++)
            if (te->y[i] >= ds->spec.num_classes) {
                char from[CFG_STR + 64];
                if (train)
                    snprintf(from, sizeof from, "the training labels (%s)", f[1].path);
                else
                    snprintf(from, sizeof from, "the model's classes");
                st = amp_fail(err, AMP_ERR_DATA,
                              "the test labels must use the classes of the training labels: check data.test_labels",
                              "%s: label %d at index %lld is out of range: %s are 0..%d (data.test_labels)",
                              f[3].path, (int)te->y[i], (long long)i, from, (int)ds->spec.num_classes - 1);
                break;
            }
    }
    if (st == AMP_OK) {
        const struct idx_file *images = train ? &f[0] : &f[2];
        ds->spec.sample_ndim = 3;
        ds->spec.sample_shape[0] = 1;
        ds->spec.sample_shape[1] = images->dims[1];
        ds->spec.sample_shape[2] = images->dims[2];
        ds->spec.is_tokens = false;
        ds->sample_numel = images->dims[1] * images->dims[2];
    }
    for (int k = 0; k < 4; k++)
        idx_file_free(&f[k]);
    return st;
}
