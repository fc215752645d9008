/*
 * checkpoint.c — writing, verifying, loading and inspecting HDF5 checkpoints. checkpoint.h has the layout.
 *
 * The whole-file check lives in HDF5's user block (512 bytes at the start, which HDF5 and h5py skip):
 * after HDF5 has closed the file we compute the CRC-32 of everything after the block and write it with
 * the file length into the block, then fsync and rename. A reader checks length and CRC before HDF5
 * sees a byte, because HDF5 can crash or loop on damaged metadata.
 *
 * HDF5's own error stack printing is switched off around every call (and restored after), so a damaged
 * or foreign file becomes one of our messages with a hint.
 */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE
#include "checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <hdf5.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h> /* crc32 */

#include "backend.h" /* download, upload */
#include "digest.h"  /* digest_u64: ckpt_fingerprint */
#include "dtype.h"   /* double_to_text */
#include "h5compat.h" /* amp_h5l_info: HDF5 1.10 and 1.12+ alike */
#include "precision.h" /* precision_mode_from_name, precision_loss_scaling: the file's mode */
#include "scaler.h"  /* scaler_init: the settings that bound a loaded state */
#include "trial.h"   /* trial_run: HDF5 parses a file in a child first */

#define USERBLOCK 512
#define MAGIC CKPT_MAGIC
#define HINT_CORRUPT "the file is damaged: resume from an older checkpoint in the same directory (ls ckpt-*.h5)"

#ifndef AMP_VERSION
#define AMP_VERSION "0.0.0"
#endif

/* ---- HDF5 helpers ---------------------------------------------------------------------------------- */

struct h5_quiet {
    H5E_auto2_t func;
    void *data;
};

static void h5_quiet_begin(struct h5_quiet *q)
{
    H5Eget_auto2(H5E_DEFAULT, &q->func, &q->data);
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
}

static void h5_quiet_end(const struct h5_quiet *q) { H5Eset_auto2(H5E_DEFAULT, q->func, q->data); }

static hid_t fapl_unlocked(void)
{
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
    /* No file locks: they fail on NFS (errno 37/11) and a checkpoint is never shared while written. */
    H5Pset_file_locking(fapl, 0, 1);
    return fapl;
}

static void h5_close_id(hid_t id)
{
    if (id < 0)
        return;
    switch (H5Iget_type(id)) {
    case H5I_FILE: H5Fclose(id); break;
    case H5I_GROUP: H5Gclose(id); break;
    case H5I_DATASET: H5Dclose(id); break;
    case H5I_DATASPACE: H5Sclose(id); break;
    case H5I_DATATYPE: H5Tclose(id); break;
    case H5I_ATTR: H5Aclose(id); break;
    case H5I_GENPROP_LST: H5Pclose(id); break;
    default: break;
    }
}

static int attr_i64(hid_t loc, const char *name, int64_t v)
{
    hid_t sp = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(loc, name, H5T_STD_I64LE, sp, H5P_DEFAULT, H5P_DEFAULT);
    int rc = a < 0 ? -1 : H5Awrite(a, H5T_NATIVE_INT64, &v);
    h5_close_id(a);
    h5_close_id(sp);
    return rc;
}

static int attr_f64(hid_t loc, const char *name, double v)
{
    hid_t sp = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(loc, name, H5T_IEEE_F64LE, sp, H5P_DEFAULT, H5P_DEFAULT);
    int rc = a < 0 ? -1 : H5Awrite(a, H5T_NATIVE_DOUBLE, &v);
    h5_close_id(a);
    h5_close_id(sp);
    return rc;
}

static hid_t str_type(size_t len)
{
    hid_t t = H5Tcopy(H5T_C_S1);
    H5Tset_size(t, len ? len : 1);
    H5Tset_strpad(t, H5T_STR_NULLPAD);
    H5Tset_cset(t, H5T_CSET_UTF8);
    return t;
}

static int attr_str(hid_t loc, const char *name, const char *v)
{
    hid_t t = str_type(strlen(v));
    hid_t sp = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(loc, name, t, sp, H5P_DEFAULT, H5P_DEFAULT);
    int rc = a < 0 ? -1 : H5Awrite(a, t, v);
    h5_close_id(a);
    h5_close_id(sp);
    h5_close_id(t);
    return rc;
}

/* ---- writing --------------------------------------------------------------------------------------- */

struct writer {
    hid_t file;
    hid_t lcpl; /* creates intermediate groups for "model/fc1/weight" */
    const char *path;
    struct amp_error *err;
    bool failed;
};

static void writer_fail(struct writer *w, const char *what)
{
    if (w->failed)
        return;
    w->failed = true;
    amp_fail(w->err, AMP_ERR_INTERNAL, "check free disk space, quotas (ulimit -f) and permissions of the run directory",
             "cannot write checkpoint %s: %s failed%s%s", w->path, what, errno ? ": " : "", errno ? strerror(errno) : "");
}

static void write_floats(struct writer *w, const char *name, const float *data, int ndim, const int64_t *shape)
{
    if (w->failed)
        return;
    hsize_t dims[8], chunk[8];
    size_t numel = 1;
    for (int i = 0; i < ndim; i++) {
        dims[i] = chunk[i] = (hsize_t)shape[i];
        numel *= (size_t)shape[i];
    }
    if (ndim == 0 || numel == 0) {
        dims[0] = chunk[0] = numel ? numel : 1;
        ndim = 1;
    }
    /* Chunks of at most ~1M elements (HDF5 caps a chunk at 4 GB); split along the outermost dim. */
    size_t inner = numel / (size_t)dims[0];
    if (inner == 0)
        inner = 1;
    size_t rows = (1u << 20) / inner;
    if (rows < 1)
        rows = 1;
    if (chunk[0] > rows)
        chunk[0] = rows;
    hid_t sp = H5Screate_simple(ndim, dims, NULL);
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    H5Pset_chunk(dcpl, ndim, chunk);
    H5Pset_fletcher32(dcpl);
    hid_t d = H5Dcreate2(w->file, name, H5T_IEEE_F32LE, sp, w->lcpl, dcpl, H5P_DEFAULT);
    if (d < 0 || H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0) {
        char what[256];
        snprintf(what, sizeof what, "writing tensor '%s'", name);
        writer_fail(w, what);
    }
    h5_close_id(d);
    h5_close_id(dcpl);
    h5_close_id(sp);
}

static void write_tensor(struct writer *w, const char *name, const struct tensor *t, struct backend *be)
{
    if (w->failed || !t->data)
        return;
    /* every tensor is written as fp32 (bf16 master weights and moments exactly: they widen without rounding) */
    float *host = malloc((t->numel ? t->numel : 1) * sizeof *host);
    void *raw = t->dtype == DT_FP32 ? host : malloc(tensor_bytes(t) ? tensor_bytes(t) : 1);
    if (!host || !raw) {
        free(host);
        writer_fail(w, "allocating a host buffer");
        return;
    }
    be->download(be, raw, t->data, tensor_bytes(t));
    if (raw != host) {
        dtype_convert(host, DT_FP32, raw, t->dtype, t->numel);
        free(raw);
    }
    write_floats(w, name, host, t->ndim, t->shape);
    free(host);
}

static hid_t make_group(struct writer *w, const char *name)
{
    if (w->failed)
        return -1;
    hid_t g = H5Gcreate2(w->file, name, w->lcpl, H5P_DEFAULT, H5P_DEFAULT);
    if (g < 0)
        writer_fail(w, name);
    return g;
}

static void write_config(struct writer *w, const struct config *cfg)
{
    char *yaml = config_to_yaml_string(cfg);
    if (!yaml) {
        writer_fail(w, "printing the config");
        return;
    }
    hid_t t = str_type(strlen(yaml));
    hid_t sp = H5Screate(H5S_SCALAR);
    hid_t d = H5Dcreate2(w->file, "config", t, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    if (d < 0 || H5Dwrite(d, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, yaml) < 0)
        writer_fail(w, "writing /config");
    h5_close_id(d);
    h5_close_id(sp);
    h5_close_id(t);
    free(yaml);
}

static void write_attrs_ok(struct writer *w, int rc, const char *what)
{
    if (rc < 0)
        writer_fail(w, what);
}

/* The HDF5 part of a checkpoint: everything but the user block. */
/* /fp8 (precision.mode fp8, lib/base/fp8.h): its attributes; with recipe delayed, per group (fwd: E4M3 inputs and weights,
 * bwd: E5M2 output gradients) the scales (n) and the amax history (amax_history_len, n) (recipes current and
 * blockwise have no state: each cast computes its scales); the n tensors in the order the
 * model's layers register them (`ampTrain check` lists them). scale_inv is 1 / scale, not stored. */
static void write_fp8(struct writer *w, const struct fp8_state *st, struct backend *be)
{
    hid_t g = make_group(w, "fp8");
    if (g < 0)
        return;
    int rc = attr_str(g, "recipe", st->recipe == FP8_CURRENT ? "current" : st->recipe == FP8_BLOCKWISE ? "blockwise"
                                                                                                   : "delayed");
    rc |= attr_i64(g, "amax_history_len", st->len);
    rc |= attr_str(g, "amax_compute", st->most_recent ? "most_recent" : "max");
    rc |= attr_i64(g, "margin", st->margin);
    write_attrs_ok(w, rc, "writing /fp8");
    h5_close_id(g);
    if (st->recipe != FP8_DELAYED) /* every cast computes its scales afresh: no state to carry */
        return;
    const struct fp8_group *groups[2] = {&st->fwd, &st->bwd};
    const char *names[2] = {"fwd", "bwd"};
    char name[64];
    for (int i = 0; i < 2; i++) {
        const struct fp8_group *fg = groups[i];
        if (fg->n == 0)
            continue;
        struct tensor scale = { .data = fg->scale, .dtype = DT_FP32, .ndim = 1, .shape = {fg->n, 1, 1, 1},
                                .numel = (size_t)fg->n, .be = be };
        snprintf(name, sizeof name, "fp8/%s/scale", names[i]);
        write_tensor(w, name, &scale, be);
        if (fg->history) {
            struct tensor h = { .data = fg->history, .dtype = DT_FP32, .ndim = 2, .shape = {st->len, fg->n, 1, 1},
                                .numel = (size_t)st->len * (size_t)fg->n, .be = be };
            snprintf(name, sizeof name, "fp8/%s/amax_history", names[i]);
            write_tensor(w, name, &h, be);
        }
    }
}

/* run.keep_best's or run.early_stop's watch as /state attributes PREFIX_metric, PREFIX_best, PREFIX_step (-1: no
 * evaluation yet; PREFIX_best is then absent) and PREFIX_since; nothing when the run watches nothing. */
static int write_watch(hid_t g, const char *prefix, const struct eval_watch *wt)
{
    if (wt->metric == METRIC_NONE)
        return 0;
    char name[64];
    snprintf(name, sizeof name, "%s_metric", prefix);
    int rc = attr_str(g, name, eval_metric_name(wt->metric));
    snprintf(name, sizeof name, "%s_step", prefix);
    rc |= attr_i64(g, name, wt->best_step);
    snprintf(name, sizeof name, "%s_since", prefix);
    rc |= attr_i64(g, name, wt->since);
    if (wt->best_step >= 0) {
        snprintf(name, sizeof name, "%s_best", prefix);
        rc |= attr_f64(g, name, wt->best);
    }
    return rc;
}

static void write_contents(struct writer *w, const struct trainer *t)
{
    const struct config *cfg = t->cfg;
    struct backend *be = t->be;
    char created[64];
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(created, sizeof created, "%Y-%m-%dT%H:%M:%SZ", &tm);
    int rc = attr_str(w->file, "format", CKPT_FORMAT);
    rc |= attr_i64(w->file, "format_version", CKPT_FORMAT_VERSION);
    rc |= attr_str(w->file, "amptrain_version", AMP_VERSION);
    rc |= attr_str(w->file, "created", created);
    write_attrs_ok(w, rc, "writing the root attributes");
    write_config(w, cfg);

    hid_t g = make_group(w, "state");
    if (g >= 0) {
        rc = attr_i64(g, "step", t->step);
        rc |= attr_i64(g, "micro_step", 0);
        rc |= attr_i64(g, "epoch", t->sampler.epoch);
        rc |= attr_i64(g, "cursor", t->sampler.cursor);
        rc |= attr_i64(g, "samples_seen", t->samples_seen);
        rc |= attr_i64(g, "world_size", t->world); /* data-parallel ranks that wrote it (docs/distributed.md) */
        rc |= attr_i64(g, "accum_steps", cfg->accum_steps); /* with world_size: the step's batch it trained with */
        rc |= attr_i64(g, "skips_total", t->scaler.skips_total);
        rc |= attr_i64(g, "total_steps", t->total_steps);
        rc |= attr_str(g, "precision_mode", precision_mode_name(cfg->precision.mode));
        rc |= write_watch(g, "keep_best", &t->best);
        rc |= write_watch(g, "early_stop", &t->stop);
        write_attrs_ok(w, rc, "writing /state");
        h5_close_id(g);
    }
    const struct model *m = &t->model;
    char name[256];
    if (m->has_fp8)
        write_fp8(w, &m->fp8, be);
    for (int i = 0; i < m->nparams; i++) {
        snprintf(name, sizeof name, "model/%s", m->params[i]->name);
        write_tensor(w, name, &m->params[i]->master, be);
    }
    for (int i = 0; i < m->nbuffers; i++) {
        snprintf(name, sizeof name, "model/%s", m->buffers[i]->name);
        write_tensor(w, name, &m->buffers[i]->t, be);
    }
    g = make_group(w, "optimizer");
    if (g >= 0) {
        rc = attr_i64(g, "step", t->opt.step);
        rc |= attr_str(g, "kind", cfg->optim.kind == OPTIM_ADAMW ? "adamw" : "sgd");
        write_attrs_ok(w, rc, "writing /optimizer");
        h5_close_id(g);
    }
    for (int i = 0; i < t->opt.nstate && i < m->nparams; i++) {
        snprintf(name, sizeof name, "optimizer/%s/m", m->params[i]->name);
        write_tensor(w, name, &t->opt.state[i].m, be);
        snprintf(name, sizeof name, "optimizer/%s/v", m->params[i]->name);
        write_tensor(w, name, &t->opt.state[i].v, be);
    }
    const struct scaler *s = &t->scaler;
    g = make_group(w, "scaler");
    if (g >= 0) {
        rc = attr_str(g, "mode", precision_mode_name(cfg->precision.mode));
        rc |= attr_f64(g, "scale", s->scale);
        rc |= attr_i64(g, "growth_tracker", s->growth_tracker);
        rc |= attr_i64(g, "hysteresis_left", s->hysteresis_left);
        rc |= attr_i64(g, "consecutive_skips", s->consecutive_skips);
        rc |= attr_i64(g, "skips_total", s->skips_total);
        rc |= attr_i64(g, "last_overflow_step", s->last_overflow_step);
        write_attrs_ok(w, rc, "writing /scaler");
        h5_close_id(g);
    }
    g = make_group(w, "data");
    if (g >= 0) {
        rc = attr_i64(g, "epoch", t->sampler.epoch);
        rc |= attr_i64(g, "cursor", t->sampler.cursor);
        rc |= attr_i64(g, "seed", (int64_t)t->sampler.seed);
        rc |= attr_i64(g, "shuffle", t->sampler.shuffle);
        /* the sample's shape and the classes: what building the model needs from the data (export) */
        const struct data_spec *spec = &t->ds.spec;
        rc |= attr_i64(g, "sample_ndim", spec->sample_ndim);
        for (int i = 0; i < 3; i++) {
            char name[24];
            snprintf(name, sizeof name, "sample_dim%d", i);
            rc |= attr_i64(g, name, spec->sample_shape[i]);
        }
        rc |= attr_i64(g, "num_classes", spec->num_classes);
        rc |= attr_i64(g, "tokens", spec->is_tokens);
        /* what the data files held: a later eval or resume accepts the same data under another path */
        for (int i = 0; i < t->ds.nfiles; i++) {
            char name[48];
            snprintf(name, sizeof name, "digest:%s", t->ds.files[i].key);
            rc |= attr_i64(g, name, (int64_t)t->ds.files[i].digest);
        }
        write_attrs_ok(w, rc, "writing /data");
        h5_close_id(g);
    }
    g = make_group(w, "rng");
    if (g >= 0) {
        rc = attr_i64(g, "seed", (int64_t)cfg->run.seed);
        rc |= attr_str(g, "note", "dropout keys are (seed, step * accum_steps + micro_batch): nothing else to save");
        write_attrs_ok(w, rc, "writing /rng");
        h5_close_id(g);
    }
}

static void put_le(unsigned char *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static uint64_t get_le(const unsigned char *p, int n)
{
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

/* CRC-32 of fd's bytes [from, to). */
static int crc_range(int fd, off_t from, off_t to, uint32_t *out)
{
    unsigned char buf[1 << 16];
    uLong crc = crc32(0L, Z_NULL, 0);
    off_t pos = from;
    while (pos < to) {
        size_t want = (size_t)(to - pos) < sizeof buf ? (size_t)(to - pos) : sizeof buf;
        ssize_t n = pread(fd, buf, want, pos);
        if (n <= 0)
            return -1;
        crc = crc32(crc, buf, (uInt)n);
        pos += n;
    }
    *out = (uint32_t)crc;
    return 0;
}

/* The one change H5Fget_file_image makes to the bytes it copies: the superblock's file consistency flags, which
 * HDF5 sets while a file is open for writing, read as cleared. Where they lie (HDF5 file format specification):
 * superblock versions 0 and 1, 4 bytes at offset 20; versions 2 and 3, 1 byte at offset 11. */
static void clear_status_flags(unsigned char *superblock)
{
    if (superblock[8] < 2)
        memset(superblock + 20, 0, 4);
    else
        superblock[11] = 0;
}

/* Fill the user block of an in-memory image with magic, length and CRC. */
static void seal_image(unsigned char *img, size_t size)
{
    uLong crc = crc32(0L, Z_NULL, 0);
    for (size_t off = USERBLOCK; off < size;) {
        size_t n = size - off < (1u << 30) ? size - off : (1u << 30);
        crc = crc32(crc, img + off, (uInt)n);
        off += n;
    }
    memset(img, 0, USERBLOCK);
    memcpy(img, MAGIC, 8);
    put_le(img + 8, 1, 4);
    put_le(img + 16, (uint64_t)size, 8);
    put_le(img + 24, (uint32_t)crc, 4);
}

/* Write the image to `path` and fsync it. `previous`: the run directory has an earlier checkpoint (which
 * this failure leaves intact). */
static enum amp_status write_image(const char *path, const unsigned char *img, size_t size, bool previous,
                                   struct amp_error *err)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    bool ok = fd >= 0;
    for (size_t off = 0; ok && off < size;) {
        ssize_t n = write(fd, img + off, size - off);
        if (n < 0 && errno == EINTR)
            continue;
        ok = n > 0;
        off += ok ? (size_t)n : 0;
    }
    ok = ok && fsync(fd) == 0;
    int e = errno;
    if (fd >= 0 && close(fd) != 0 && ok) {
        e = errno;
        ok = false;
    }
    if (!ok)
        return amp_fail(err, AMP_ERR_INTERNAL,
                        previous ? "check free disk space, quotas (ulimit -f) and permissions of the run directory; the "
                                   "previous checkpoint is intact"
                                 : "check free disk space, quotas (ulimit -f) and permissions of the run directory (no "
                                   "checkpoint of this run was written before this one)",
                        "cannot write checkpoint %s: %s", path, strerror(e ? e : EIO));
    return AMP_OK;
}

static void fsync_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
}

/* Write `text` to DIR/NAME via NAME.tmp + fsync + rename. */
static enum amp_status write_small_file(const char *dir, const char *name, const char *text, struct amp_error *err)
{
    char tmp[CFG_STR + 80], path[CFG_STR + 64];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    size_t len = strlen(text);
    bool ok = fd >= 0 && write(fd, text, len) == (ssize_t)len && fsync(fd) == 0;
    int e = errno;
    if (fd >= 0 && close(fd) != 0)
        ok = false;
    if (ok && rename(tmp, path) != 0) {
        e = errno;
        ok = false;
    }
    if (!ok) {
        unlink(tmp);
        return amp_fail(err, AMP_ERR_INTERNAL, "check free disk space and permissions of the run directory",
                        "cannot write %s: %s", path, strerror(e));
    }
    fsync_dir(dir);
    return AMP_OK;
}

static int parse_ckpt_name(const char *name, long long *step)
{
    int n = 0;
    if (sscanf(name, "ckpt-%lld%n", step, &n) != 1)
        return -1;
    return strcmp(name + n, ".h5") == 0 ? 0 : -1;
}

static int cmp_desc(const void *a, const void *b)
{
    long long x = *(const long long *)a, y = *(const long long *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* Delete all but the newest `keep` DIR/ckpt-N.h5 (never `current`, `protect` or `best`). */
static void prune(const char *dir, int64_t keep, int64_t current, int64_t protect, int64_t best)
{
    DIR *d = opendir(dir);
    if (!d)
        return;
    long long steps[4096];
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < 4096) {
        long long s;
        if (parse_ckpt_name(e->d_name, &s) == 0)
            steps[n++] = s;
    }
    closedir(d);
    qsort(steps, (size_t)n, sizeof steps[0], cmp_desc);
    for (int64_t i = keep < 1 ? 1 : keep; i < n; i++) { /* keep is any int64 (run.keep_ckpts): no narrowing */
        if (steps[i] == current || steps[i] == protect || steps[i] == best)
            continue;
        char path[CFG_STR + 64];
        snprintf(path, sizeof path, "%s/ckpt-%lld.h5", dir, steps[i]);
        unlink(path);
    }
}

/* The step of the checkpoint DIR/best names; -1 when there is none or it names no ckpt-STEP.h5. */
static int64_t named_best(const char *dir)
{
    char path[CFG_STR + 16], name[64] = "";
    snprintf(path, sizeof path, "%s/best", dir);
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    bool ok = fgets(name, sizeof name, f) != NULL;
    fclose(f);
    name[strcspn(name, "\r\n")] = '\0';
    long long step = -1;
    return ok && parse_ckpt_name(name, &step) == 0 ? (int64_t)step : -1;
}

int ckpt_clean_stale(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return 0;
    int removed = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t len = strlen(e->d_name);
        bool ours = strncmp(e->d_name, "ckpt-", 5) == 0 || strcmp(e->d_name, "latest.tmp") == 0 ||
                    strcmp(e->d_name, "best.tmp") == 0;
        if (ours && len > 4 && strcmp(e->d_name + len - 4, ".tmp") == 0) {
            char path[CFG_STR + 300];
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            if (unlink(path) == 0)
                removed++;
        }
    }
    closedir(d);
    return removed;
}

enum amp_status ckpt_save(const struct trainer *t, const char *dir, int64_t keep, int64_t protect, char *path_out,
                          size_t path_len,
                          struct amp_error *err)
{
    char name[64], path[CFG_STR + 64], tmp[CFG_STR + 80];
    snprintf(name, sizeof name, "ckpt-%lld.h5", (long long)t->step);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    for (int i = 0; i < t->model.nparams; i++) /* a file holds every parameter whole: zero_gather_begin first */
        if (t->model.params[i]->master_block)
            return amp_fail(err, AMP_ERR_INTERNAL, "this is a bug: report it with the run's config",
                            "%s: the master weights of %s are this rank's block only (dist.zero 1); nothing was "
                            "written", path, t->model.params[i]->name);

    /* HDF5 builds the file in memory (core driver, no backing store); we write the bytes ourselves. HDF5
     * never touches the disk, so a full disk is one clean write error, not a half-closed HDF5 file (which
     * crashes HDF5 1.10 at exit). */
    struct h5_quiet q;
    h5_quiet_begin(&q);
    hid_t fcpl = H5Pcreate(H5P_FILE_CREATE);
    H5Pset_userblock(fcpl, USERBLOCK);
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
    H5Pset_fapl_core(fapl, (size_t)1 << 20, 0);
    errno = 0;
    struct writer w = {.path = path, .err = err};
    w.file = H5Fcreate(tmp, H5F_ACC_TRUNC, fcpl, fapl);
    if (w.file < 0)
        writer_fail(&w, "creating the file in memory");
    w.lcpl = H5Pcreate(H5P_LINK_CREATE);
    H5Pset_create_intermediate_group(w.lcpl, 1);
    if (!w.failed)
        write_contents(&w, t);
    /* The file is the core driver's own memory, sealed and written where it lies: a checkpoint may be
     * gigabytes, and H5Fget_file_image would copy it whole. The driver keeps the file from byte 0, so the user
     * block (zeros HDF5 never touches) comes first, then the image H5Fget_file_image would copy (which starts at
     * the superblock); H5Fflush has grown the memory to at least the end of allocated space. */
    unsigned char *img = NULL;
    ssize_t size = -1;
    void *handle = NULL;
    if (!w.failed && H5Fflush(w.file, H5F_SCOPE_GLOBAL) >= 0 && (size = H5Fget_file_image(w.file, NULL, 0)) > 0 &&
        H5Fget_vfd_handle(w.file, H5P_DEFAULT, &handle) >= 0 && handle)
        img = *(unsigned char **)handle;
    if (!w.failed && !img)
        writer_fail(&w, "building the file image");
    enum amp_status st = AMP_OK;
    if (!w.failed) {
        clear_status_flags(img + USERBLOCK);
        seal_image(img, USERBLOCK + (size_t)size);
        char latest[CFG_STR + 16];
        snprintf(latest, sizeof latest, "%s/latest", dir);
        st = write_image(tmp, img, USERBLOCK + (size_t)size, access(latest, F_OK) == 0, err);
    }
    if (w.file >= 0)
        H5Fclose(w.file); /* frees the image */
    h5_close_id(w.lcpl);
    h5_close_id(fapl);
    h5_close_id(fcpl);
    h5_quiet_end(&q);
    if (w.failed)
        return err->code;
    if (st == AMP_OK && rename(tmp, path) != 0)
        st = amp_fail(err, AMP_ERR_INTERNAL, "check permissions of the run directory", "cannot rename %s to %s: %s",
                      tmp, path, strerror(errno));
    if (st != AMP_OK) {
        unlink(tmp);
        return st;
    }
    fsync_dir(dir);
    char line[80];
    snprintf(line, sizeof line, "%s\n", name);
    if ((st = write_small_file(dir, "latest", line, err)) != AMP_OK)
        return st;
    /* run.keep_best: this step's evaluation is the best so far. `best` moves (crash-safely, as `latest`) before
     * the prune may remove the checkpoint it named before; whatever `best` names is never pruned, also after a
     * resume that watches another metric or none, so it never names a missing file. */
    if (t->best.metric != METRIC_NONE && t->best.best_step == t->step &&
        (st = write_small_file(dir, "best", line, err)) != AMP_OK)
        return st;
    prune(dir, keep, t->step, protect, named_best(dir));
    if (path_out)
        snprintf(path_out, path_len, "%s", path);
    return AMP_OK;
}

/* ---- verifying and reading ------------------------------------------------------------------------- */

bool ckpt_sniff(const char *path)
{
    struct stat sb;
    if (stat(path, &sb) != 0)
        return false;
    if (S_ISDIR(sb.st_mode)) {
        char latest[CFG_STR + 16];
        snprintf(latest, sizeof latest, "%s/latest", path);
        return access(latest, F_OK) == 0;
    }
    char head[8];
    int fd = S_ISREG(sb.st_mode) ? open(path, O_RDONLY | O_NONBLOCK) : -1;
    bool ours = fd >= 0 && pread(fd, head, sizeof head, 0) == (ssize_t)sizeof head && !memcmp(head, CKPT_MAGIC, 8);
    if (fd >= 0)
        close(fd);
    return ours;
}

enum amp_status ckpt_resolve(const char *arg, char *path, size_t len, struct amp_error *err)
{
    struct stat sb;
    if (stat(arg, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
        snprintf(path, len, "%s", arg);
        return AMP_OK;
    }
    char latest[CFG_STR + 16], name[48] = "";
    snprintf(latest, sizeof latest, "%s/latest", arg);
    FILE *f = fopen(latest, "r");
    if (!f)
        return amp_fail(err, AMP_ERR_CKPT, "give a ckpt-STEP.h5 file, or the run.out_dir of a run that wrote one",
                        "%s is a directory without a 'latest' file: no checkpoint was written there", arg);
    bool ok = fgets(name, sizeof name, f) != NULL;
    fclose(f);
    name[strcspn(name, "\r\n")] = '\0';
    if (!ok || !name[0] || strchr(name, '/'))
        return amp_fail(err, AMP_ERR_CKPT, "give a ckpt-STEP.h5 file of that directory directly",
                        "%s does not name a checkpoint file", latest);
    snprintf(path, len, "%s/%s", arg, name);
    if (access(path, F_OK) != 0)
        return amp_fail(err, AMP_ERR_CKPT, "give a ckpt-STEP.h5 file of that directory directly (ls it)",
                        "%s names %s, which does not exist", latest, name);
    return AMP_OK;
}

static enum amp_status check_file(const char *path, struct amp_error *err)
{
    /* O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever (fstat refuses it) */
    int fd = open(path, O_RDONLY | O_NONBLOCK);
    if (fd < 0)
        return amp_fail(err, AMP_ERR_CKPT, "give the path of a ckpt-STEP.h5 file in a run directory (see its 'latest')",
                        "cannot open checkpoint %s: %s", path, strerror(errno));
    struct stat sb;
    unsigned char hdr[USERBLOCK];
    enum amp_status st = AMP_OK;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        st = amp_fail(err, AMP_ERR_CKPT, "give the path of a ckpt-STEP.h5 file", "%s is not a regular file", path);
    } else if (sb.st_size == 0) {
        st = amp_fail(err, AMP_ERR_CKPT, HINT_CORRUPT, "%s is empty (0 bytes): not a checkpoint", path);
    } else if (sb.st_size < USERBLOCK || pread(fd, hdr, sizeof hdr, 0) != (ssize_t)sizeof hdr) {
        st = amp_fail(err, AMP_ERR_CKPT, HINT_CORRUPT, "%s: %lld bytes, too short to be a checkpoint (truncated?)",
                      path, (long long)sb.st_size);
    } else if (memcmp(hdr, MAGIC, 8) != 0) {
        bool hdf5 = memcmp(hdr, "\x89HDF\r\n\x1a\n", 8) == 0;
        st = amp_fail(err, AMP_ERR_CKPT, "give a file written by 'ampTrain run' or 'ampTrain resume'",
                      "%s is not an ampTrain checkpoint (%s)", path,
                      hdf5 ? "an HDF5 file without the ampTrain header" : "no ampTrain header");
    } else if (get_le(hdr + 8, 4) != 1) {
        st = amp_fail(err, AMP_ERR_CKPT, "upgrade ampTrain to read it",
                      "%s: header layout %llu is newer than this ampTrain reads (1)", path,
                      (unsigned long long)get_le(hdr + 8, 4));
    } else if (get_le(hdr + 16, 8) != (uint64_t)sb.st_size) {
        st = amp_fail(err, AMP_ERR_CKPT, HINT_CORRUPT, "%s is truncated or damaged: %lld bytes, the header says %llu",
                      path, (long long)sb.st_size, (unsigned long long)get_le(hdr + 16, 8));
    } else {
        uint32_t crc = 0;
        if (crc_range(fd, USERBLOCK, sb.st_size, &crc) != 0)
            st = amp_fail(err, AMP_ERR_CKPT, HINT_CORRUPT, "cannot read %s: %s", path, strerror(errno));
        else if (crc != (uint32_t)get_le(hdr + 24, 4))
            st = amp_fail(err, AMP_ERR_CKPT, HINT_CORRUPT,
                          "%s is corrupt: CRC-32 checksum mismatch (stored %08x, computed %08x)", path,
                          (unsigned)get_le(hdr + 24, 4), (unsigned)crc);
    }
    close(fd);
    return st;
}

/* ---- reading: every object checked before a byte of it is read ------------------------------------ */

/* A checkpoint that verified is still only bytes someone may have edited and re-sealed (docs/checkpoint.md,
 * "What a verified file may still say"): each
 * attribute and dataset is checked for its type class, rank and size before it is read, and each value
 * for its range after; a failure is AMP_ERR_CKPT naming the file and the object. */
struct reader {
    hid_t file;
    const char *path;
    struct amp_error *err;
    bool dry;      /* a trial read (trial.h): everything but uploads to the backend */
    const struct ckpt_info *info; /* the file's /state, read by open_checked */
};

#define MAX_ATTR_TEXT 4096             /* longest string attribute read */
#define MAX_CONFIG_TEXT (16u << 20)    /* /config: the config reader's own cap */
#define MAX_STEP ((int64_t)CFG_MAX_STEPS)
#define MAX_COUNT (INT64_C(1) << 62)   /* samples, epochs: train.c keeps every product below it */
#define MAX_WORLD (INT64_C(1) << 20)

static const char *class_name(H5T_class_t c)
{
    switch (c) {
    case H5T_INTEGER: return "an integer";
    case H5T_FLOAT: return "a float";
    case H5T_STRING: return "a string";
    case H5T_BITFIELD: return "a bitfield";
    case H5T_OPAQUE: return "opaque bytes";
    case H5T_COMPOUND: return "a compound (struct)";
    case H5T_REFERENCE: return "a reference";
    case H5T_ENUM: return "an enum";
    case H5T_VLEN: return "a variable-length sequence";
    case H5T_ARRAY: return "an array type";
    default: return "of an unknown type";
    }
}

/* Whether dataspace `sp` holds exactly one value; else why not, in `why`. */
static bool one_value(hid_t sp, char *why, size_t len)
{
    H5S_class_t c = sp >= 0 ? H5Sget_simple_extent_type(sp) : H5S_NO_CLASS;
    hssize_t n = c == H5S_SIMPLE ? H5Sget_simple_extent_npoints(sp) : 0;
    if (c == H5S_SCALAR || (c == H5S_SIMPLE && n == 1))
        return true;
    if (c == H5S_SIMPLE)
        snprintf(why, len, "is an array of %lld values (%d dimensions) where one value belongs",
                 (long long)n, H5Sget_simple_extent_ndims(sp));
    else
        snprintf(why, len, "holds no value (an empty dataspace)");
    return false;
}

/* Whether dataset `d` (rank nd, dims) is stored so that reading it stays within its own size and this file:
 * contiguous, compact, or chunked with no chunk dimension beyond the dataset's (HDF5 allocates a whole chunk
 * to read one, and a crafted layout message can declare 4 GB chunks over a 32-float tensor); no external or
 * virtual storage (a checkpoint names no other file, and reading one could block on a FIFO or read
 * /dev/zero). dims NULL: every dimension is 1 (one value). Else why not, in `why`. */
static bool storage_ok(hid_t d, int nd, const hsize_t *dims, char *why, size_t len)
{
    hid_t dcpl = H5Dget_create_plist(d);
    H5D_layout_t layout = dcpl >= 0 ? H5Pget_layout(dcpl) : H5D_LAYOUT_ERROR;
    int external = dcpl >= 0 ? H5Pget_external_count(dcpl) : -1;
    bool ok = false;
    if (layout == H5D_CONTIGUOUS || layout == H5D_COMPACT || layout == H5D_CHUNKED) {
        ok = external == 0;
        if (!ok)
            snprintf(why, len, "keeps its data in %d external file(s); a checkpoint holds its own data", external);
    } else {
        snprintf(why, len, "has a storage layout (%d) a checkpoint never uses", (int)layout);
    }
    if (ok && layout == H5D_CHUNKED) {
        hsize_t chunk[32];
        int cr = H5Pget_chunk(dcpl, 32, chunk);
        for (int i = 0; ok && i < cr && i < 32; i++)
            ok = chunk[i] >= 1 && chunk[i] <= (dims && i < nd && dims[i] > 1 ? dims[i] : 1);
        if (!ok || cr != (nd > 0 ? nd : 1)) {
            ok = false;
            snprintf(why, len, "has chunks larger than itself (its storage layout is damaged or crafted)");
        }
    }
    h5_close_id(dcpl);
    return ok;
}

/* The one string value of attribute or dataset `obj`: fixed or variable length, ASCII or UTF-8, at most
 * `max` bytes; a new NUL-terminated buffer, or NULL with `why` filled. */
static char *read_string(hid_t obj, bool attr, size_t max, char *why, size_t len)
{
    hid_t ft = attr ? H5Aget_type(obj) : H5Dget_type(obj);
    hid_t sp = attr ? H5Aget_space(obj) : H5Dget_space(obj);
    char *out = NULL;
    snprintf(why, len, "cannot be read");
    if (ft < 0 || !one_value(sp, why, len)) {
    } else if (!attr && !storage_ok(obj, H5Sget_simple_extent_ndims(sp), NULL, why, len)) {
    } else if (H5Tget_class(ft) != H5T_STRING) {
        snprintf(why, len, "is %s where a string belongs", class_name(H5Tget_class(ft)));
    } else {
        H5T_cset_t cset = H5Tget_cset(ft);
        hid_t mt = H5Tcopy(H5T_C_S1);
        if (cset == H5T_CSET_ASCII || cset == H5T_CSET_UTF8)
            H5Tset_cset(mt, cset); /* HDF5 converts no string between character sets */
        if (H5Tis_variable_str(ft) > 0) {
            char *p = NULL;
            H5Tset_size(mt, H5T_VARIABLE);
            herr_t rc = attr ? H5Aread(obj, mt, &p) : H5Dread(obj, mt, H5S_ALL, H5S_ALL, H5P_DEFAULT, &p);
            if (rc >= 0 && p && strnlen(p, max + 1) > max)
                snprintf(why, len, "is longer than %zu bytes", max);
            else if (rc >= 0)
                out = strdup(p ? p : "");
            if (p)
                H5free_memory(p);
        } else {
            size_t n = H5Tget_size(ft);
            if (n == 0 || n > max) {
                snprintf(why, len, "is a string of %zu bytes (at most %zu)", n, max);
            } else if ((out = calloc(n + 1, 1)) != NULL) {
                H5Tset_size(mt, n);
                H5Tset_strpad(mt, H5T_STR_NULLPAD);
                herr_t rc = attr ? H5Aread(obj, mt, out) : H5Dread(obj, mt, H5S_ALL, H5S_ALL, H5P_DEFAULT, out);
                if (rc < 0) {
                    free(out);
                    out = NULL;
                }
            }
        }
        h5_close_id(mt);
    }
    h5_close_id(sp);
    h5_close_id(ft);
    return out;
}

/* Open attribute WHERE/NAME of `loc` (where: "" for the root, "/state", ...) that must exist, hold one
 * value and be of class `want` (an integer also serves where a float belongs). */
static enum amp_status open_attr(const struct reader *r, hid_t loc, const char *where, const char *name,
                                 H5T_class_t want, hid_t *out)
{
    *out = -1;
    if (loc < 0 || H5Aexists(loc, name) <= 0)
        return amp_fail(r->err, AMP_ERR_CKPT, HINT_CORRUPT, "%s: attribute %s/%s is missing", r->path, where, name);
    hid_t a = H5Aopen(loc, name, H5P_DEFAULT);
    hid_t sp = a >= 0 ? H5Aget_space(a) : -1, ft = a >= 0 ? H5Aget_type(a) : -1;
    char why[128] = "cannot be opened";
    bool ok = a >= 0 && ft >= 0 && one_value(sp, why, sizeof why);
    H5T_class_t c = ft >= 0 ? H5Tget_class(ft) : H5T_NO_CLASS;
    if (ok && c != want && !(want == H5T_FLOAT && c == H5T_INTEGER)) {
        snprintf(why, sizeof why, "is %s where %s belongs", class_name(c), class_name(want));
        ok = false;
    }
    h5_close_id(sp);
    h5_close_id(ft);
    if (!ok) {
        h5_close_id(a);
        return amp_fail(r->err, AMP_ERR_CKPT, HINT_CORRUPT, "%s: attribute %s/%s %s", r->path, where, name, why);
    }
    *out = a;
    return AMP_OK;
}

/* An integer attribute in [lo, hi]. */
static enum amp_status get_i64(const struct reader *r, hid_t loc, const char *where, const char *name, int64_t lo,
                               int64_t hi, int64_t *v)
{
    hid_t a;
    enum amp_status st = open_attr(r, loc, where, name, H5T_INTEGER, &a);
    if (st != AMP_OK)
        return st;
    int64_t x = 0;
    herr_t rc = H5Aread(a, H5T_NATIVE_INT64, &x);
    h5_close_id(a);
    if (rc < 0)
        return amp_fail(r->err, AMP_ERR_CKPT, HINT_CORRUPT, "%s: attribute %s/%s cannot be read", r->path, where, name);
    if (x < lo || x > hi)
        return amp_fail(r->err, AMP_ERR_CKPT, HINT_CORRUPT, "%s: attribute %s/%s is %lld, outside [%lld, %lld]",
                        r->path, where, name, (long long)x, (long long)lo, (long long)hi);
    *v = x;
    return AMP_OK;
}

/* A finite number attribute (the range is the caller's). */
static enum amp_status get_f64(const struct reader *r, hid_t loc, const char *where, const char *name, double *v)
{
    hid_t a;
    enum amp_status st = open_attr(r, loc, where, name, H5T_FLOAT, &a);
    if (st != AMP_OK)
        return st;
    double x = 0;
    herr_t rc = H5Aread(a, H5T_NATIVE_DOUBLE, &x);
    h5_close_id(a);
    if (rc < 0 || !isfinite(x))
        return amp_fail(r->err, AMP_ERR_CKPT, HINT_CORRUPT, "%s: attribute %s/%s %s", r->path, where, name,
                        rc < 0 ? "cannot be read" : "is not a finite number");
    *v = x;
    return AMP_OK;
}

/* A string attribute into buf (of `len` bytes; a longer one is refused). */
static enum amp_status get_str(const struct reader *r, hid_t loc, const char *where, const char *name, char *buf,
                               size_t len)
{
    hid_t a;
    enum amp_status st = open_attr(r, loc, where, name, H5T_STRING, &a);
    if (st != AMP_OK)
        return st;
    char why[128];
    char *text = read_string(a, true, len - 1 < MAX_ATTR_TEXT ? len - 1 : MAX_ATTR_TEXT, why, sizeof why);
    h5_close_id(a);
    if (!text)
        return amp_fail(r->err, AMP_ERR_CKPT, HINT_CORRUPT, "%s: attribute %s/%s %s", r->path, where, name, why);
    snprintf(buf, len, "%s", text);
    free(text);
    return AMP_OK;
}

static hid_t open_group(const struct reader *r, const char *name, const char *what)
{
    hid_t g = H5Lexists(r->file, name, H5P_DEFAULT) > 0 ? H5Gopen2(r->file, name, H5P_DEFAULT) : -1;
    if (g < 0)
        amp_fail(r->err, AMP_ERR_CKPT, HINT_CORRUPT, "%s: group /%s (%s) is missing", r->path, name, what);
    return g;
}

/* /state: the run's position. */
static enum amp_status read_state(const struct reader *r, struct ckpt_info *info)
{
    hid_t g = open_group(r, "state", "the run's position");
    if (g < 0)
        return AMP_ERR_CKPT;
    enum amp_status st = get_i64(r, g, "/state", "step", 0, MAX_STEP, &info->step);
    if (st == AMP_OK)
        st = get_i64(r, g, "/state", "epoch", 0, MAX_COUNT, &info->epoch);
    if (st == AMP_OK)
        st = get_i64(r, g, "/state", "cursor", 0, MAX_COUNT, &info->cursor);
    if (st == AMP_OK)
        st = get_i64(r, g, "/state", "samples_seen", 0, MAX_COUNT, &info->samples_seen);
    if (st == AMP_OK)
        st = get_i64(r, g, "/state", "skips_total", 0, info->step, &info->skips_total);
    if (st == AMP_OK)
        st = get_str(r, g, "/state", "precision_mode", info->precision_mode, sizeof info->precision_mode);
    info->world_size = 1; /* written before data parallel: one rank */
    if (st == AMP_OK && H5Aexists(g, "world_size") > 0)
        st = get_i64(r, g, "/state", "world_size", 1, MAX_WORLD, &info->world_size);
    info->accum_steps = 0; /* written before it was recorded: not known */
    if (st == AMP_OK && H5Aexists(g, "accum_steps") > 0)
        st = get_i64(r, g, "/state", "accum_steps", 1, MAX_COUNT, &info->accum_steps);
    h5_close_id(g);
    return st;
}

/* /data's sample shape and classes into info, each attribute checked as every other; informational (a file without
 * them, or with one out of range, leaves info->sample_ndim 0: the data gives them). */
static void read_data_spec(const struct reader *quiet, struct ckpt_info *info)
{
    hid_t g = H5Lexists(quiet->file, "data", H5P_DEFAULT) > 0 ? H5Gopen2(quiet->file, "data", H5P_DEFAULT) : -1;
    if (g < 0)
        return;
    int64_t ndim = 0, dims[3] = {0}, classes = 0, tokens = 0;
    bool ok = get_i64(quiet, g, "/data", "sample_ndim", 1, 3, &ndim) == AMP_OK &&
              get_i64(quiet, g, "/data", "num_classes", 1, INT32_MAX, &classes) == AMP_OK &&
              get_i64(quiet, g, "/data", "tokens", 0, 1, &tokens) == AMP_OK;
    for (int i = 0; i < 3 && ok; i++) {
        char name[24];
        snprintf(name, sizeof name, "sample_dim%d", i);
        ok = get_i64(quiet, g, "/data", name, i < ndim ? 1 : 0, INT32_MAX, &dims[i]) == AMP_OK;
    }
    h5_close_id(g);
    if (!ok)
        return;
    info->sample_ndim = (int)ndim;
    for (int i = 0; i < 3; i++)
        info->sample_shape[i] = dims[i];
    info->num_classes = classes;
    info->is_tokens = tokens != 0;
}

/* The config keys a data file can have, "digest:KEY" each under /data. */
static int data_digest_names(char names[][48], int max)
{
    static const char *const fixed[] = {"data.train_images", "data.train_labels", "data.test_images",
                                        "data.test_labels", "data.path", "data.train_bin", "data.val_bin"};
    int n = 0;
    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0] && n < max; i++)
        snprintf(names[n++], 48, "digest:%s", fixed[i]);
    for (int i = 0; i < CFG_MAX_FILES && n < max; i++)
        snprintf(names[n++], 48, "digest:data.files.%d", i);
    return n;
}

/* /data's digests of the run's data files into info; a malformed one is a checkpoint error naming it. */
static enum amp_status read_data_digests(const struct reader *r, struct ckpt_info *info)
{
    hid_t g = H5Lexists(r->file, "data", H5P_DEFAULT) > 0 ? H5Gopen2(r->file, "data", H5P_DEFAULT) : -1;
    if (g < 0)
        return AMP_OK;
    char names[7 + CFG_MAX_FILES][48];
    int n = data_digest_names(names, 7 + CFG_MAX_FILES);
    enum amp_status st = AMP_OK;
    for (int i = 0; i < n && st == AMP_OK && info->ndata_files < DATA_MAX_FILES; i++) {
        if (H5Aexists(g, names[i]) <= 0)
            continue;
        int64_t v = 0;
        if ((st = get_i64(r, g, "/data", names[i], INT64_MIN, INT64_MAX, &v)) != AMP_OK)
            break;
        struct ckpt_data_file *f = &info->data_files[info->ndata_files++];
        snprintf(f->key, sizeof f->key, "%s", names[i] + strlen("digest:"));
        f->digest = (uint64_t)v;
    }
    h5_close_id(g);
    return st;
}

/* Open a file that check_file verified with HDF5 and read the root attributes and /state. Returns the file
 * id, or -1 with err filled. */
static hid_t open_checked(const char *path, struct ckpt_info *info, struct amp_error *err)
{
    hid_t fapl = fapl_unlocked();
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, fapl);
    h5_close_id(fapl);
    if (f < 0) {
        amp_fail(err, AMP_ERR_CKPT, HINT_CORRUPT, "%s: HDF5 cannot open it although its checksum matches", path);
        return -1;
    }
    struct ckpt_info tmp;
    if (!info)
        info = &tmp;
    memset(info, 0, sizeof *info);
    struct reader r = {.file = f, .path = path, .err = err};
    char format[64] = "";
    hid_t a = -1;
    enum amp_status st = AMP_OK;
    if (H5Aexists(f, "format") > 0 && open_attr(&r, f, "", "format", H5T_STRING, &a) == AMP_OK) {
        char why[128];
        char *text = read_string(a, true, sizeof format - 1, why, sizeof why);
        snprintf(format, sizeof format, "%s", text ? text : "");
        free(text);
        h5_close_id(a);
    }
    if (strcmp(format, CKPT_FORMAT) != 0)
        st = amp_fail(err, AMP_ERR_CKPT, "give a file written by 'ampTrain run' or 'ampTrain resume'",
                      "%s is not an ampTrain checkpoint (root attribute format is '%s', want '%s')", path, format,
                      CKPT_FORMAT);
    if (st == AMP_OK)
        st = get_i64(&r, f, "", "format_version", INT64_MIN, INT64_MAX, &info->format_version);
    if (st == AMP_OK && (info->format_version > CKPT_FORMAT_VERSION || info->format_version < 1))
        st = amp_fail(err, AMP_ERR_CKPT, "upgrade ampTrain to read this checkpoint",
                      "%s has format_version %lld; this ampTrain reads format_version %d", path,
                      (long long)info->format_version, CKPT_FORMAT_VERSION);
    /* Informational: a file without them still loads. */
    struct amp_error ignored = {0};
    struct reader quiet = {.file = f, .path = path, .err = &ignored};
    if (st == AMP_OK && get_str(&quiet, f, "", "created", info->created, sizeof info->created) != AMP_OK)
        snprintf(info->created, sizeof info->created, "?");
    if (st == AMP_OK &&
        get_str(&quiet, f, "", "amptrain_version", info->amptrain_version, sizeof info->amptrain_version) != AMP_OK)
        snprintf(info->amptrain_version, sizeof info->amptrain_version, "?");
    if (st == AMP_OK)
        st = read_state(&r, info);
    if (st == AMP_OK)
        read_data_spec(&quiet, info);
    if (st == AMP_OK)
        st = read_data_digests(&r, info);
    if (st != AMP_OK) {
        H5Fclose(f);
        return -1;
    }
    return f;
}

/* /config: the resolved YAML, one string. */
static char *read_config_text(const struct reader *r)
{
    if (H5Lexists(r->file, "config", H5P_DEFAULT) <= 0) {
        amp_fail(r->err, AMP_ERR_CKPT, HINT_CORRUPT, "%s: dataset /config (the run's config) is missing", r->path);
        return NULL;
    }
    hid_t d = H5Dopen2(r->file, "config", H5P_DEFAULT);
    char why[128] = "is not a dataset";
    char *text = d >= 0 ? read_string(d, false, MAX_CONFIG_TEXT, why, sizeof why) : NULL;
    h5_close_id(d);
    if (!text)
        amp_fail(r->err, AMP_ERR_CKPT, HINT_CORRUPT, "%s: dataset /config %s", r->path, why);
    return text;
}

/* What a tensor's values must be. AMAX: an fp8 amax history, >= 0 or +Inf (the amax of a step whose gradients
 * overflowed is recorded as it is, as Transformer Engine records it; the scale update ignores it), never NaN. */
enum values { ANY_FINITE, NONNEG_FINITE, POSITIVE_FINITE, AMAX };

/* A dataset's shape as read_checked finds it. */
struct tensor_shape {
    int ndim;
    int64_t shape[8];
    size_t numel;
};

/* The one validated read of a checkpoint tensor (resume, eval, export and init_from all come here): dataset
 * `name` (a path from the root, "model/fc1/weight") must be floating point with 1 to 8 dimensions and at most
 * 2^40 elements; `expect`, where given, is the shape it must have (a mismatch names both: the checkpoint is of
 * another model); its data must pass HDF5's Fletcher-32 check and every value be finite (and >= 0 for
 * NONNEG_FINITE). On success *out owns numel fp32 values (malloc) and *got has the shape. */
static enum amp_status read_checked(const struct reader *r, const char *name, const struct tensor_shape *expect,
                                   enum values want, struct tensor_shape *got, float **out)
{
    const char *hint_model = "the checkpoint belongs to a different model; use the config it was written with";
    *out = NULL;
    memset(got, 0, sizeof *got);
    hid_t d = H5Lexists(r->file, name, H5P_DEFAULT) > 0 ? H5Dopen2(r->file, name, H5P_DEFAULT) : -1;
    if (d < 0)
        return amp_fail(r->err, AMP_ERR_CKPT, hint_model, "%s: tensor /%s is missing", r->path, name);
    hid_t sp = H5Dget_space(d), ft = H5Dget_type(d);
    H5S_class_t sc = sp >= 0 ? H5Sget_simple_extent_type(sp) : H5S_NO_CLASS;
    int nd = sc == H5S_SIMPLE ? H5Sget_simple_extent_ndims(sp) : 0;
    H5T_class_t tc = ft >= 0 ? H5Tget_class(ft) : H5T_NO_CLASS;
    char why[400] = "";
    bool other_model = false; /* a shape mismatch: the config's model is not the checkpoint's */
    if (tc != H5T_FLOAT) {
        snprintf(why, sizeof why, "is %s; checkpoint tensors are float32", class_name(tc));
    } else if (sc != H5S_SIMPLE || nd < 1 || nd > 8) {
        snprintf(why, sizeof why, "has %d dimensions (%s); a tensor has 1 to 8",
                 sc == H5S_SIMPLE ? nd : 0, sc == H5S_SCALAR ? "a scalar" : sc == H5S_NULL ? "empty" : "rank");
    } else {
        hsize_t dims[8] = {0};
        H5Sget_simple_extent_dims(sp, dims, NULL);
        bool same = expect == NULL || nd == expect->ndim, too_big = false;
        got->ndim = nd;
        got->numel = 1;
        for (int i = 0; i < nd; i++) {
            got->shape[i] = dims[i] > (hsize_t)INT64_MAX ? INT64_MAX : (int64_t)dims[i];
            same = same && (expect == NULL || got->shape[i] == expect->shape[i]);
            too_big = too_big || (dims[i] && got->numel > ((size_t)1 << 40) / dims[i]);
            got->numel *= (size_t)dims[i];
        }
        if (!same) {
            char a[160], b[160];
            shape_str(a, sizeof a, nd, got->shape);
            shape_str(b, sizeof b, expect->ndim, expect->shape);
            snprintf(why, sizeof why, "has shape %s in the checkpoint but %s in the config's model", a, b);
            other_model = true;
        } else if (too_big) {
            snprintf(why, sizeof why, "is larger than 2^40 elements");
        } else if (H5Tequal(ft, H5T_IEEE_F32LE) <= 0 && H5Tequal(ft, H5T_IEEE_F32BE) <= 0 &&
                   H5Tequal(ft, H5T_IEEE_F64LE) <= 0 && H5Tequal(ft, H5T_IEEE_F64BE) <= 0) {
            /* HDF5 converts any float layout it can describe; a crafted one (32 bits of precision in 8 bytes)
             * overflowed its conversion buffers */
            snprintf(why, sizeof why, "is a float of %zu bytes and %zu bits of precision, not IEEE float32 or float64",
                     H5Tget_size(ft), H5Tget_precision(ft));
        } else {
            storage_ok(d, nd, dims, why, sizeof why);
        }
    }
    h5_close_id(sp);
    h5_close_id(ft);
    if (why[0]) {
        h5_close_id(d);
        return amp_fail(r->err, AMP_ERR_CKPT, other_model ? hint_model : HINT_CORRUPT,
                        "%s: tensor /%s %s", r->path, name, why);
    }
    float *host = malloc((got->numel ? got->numel : 1) * sizeof *host);
    if (!host) {
        h5_close_id(d);
        return amp_fail(r->err, AMP_ERR_INTERNAL, NULL, "out of memory reading /%s of %s", name, r->path);
    }
    herr_t rc = H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, host);
    h5_close_id(d);
    if (rc < 0) {
        free(host);
        return amp_fail(r->err, AMP_ERR_CKPT, HINT_CORRUPT,
                        "%s: tensor /%s cannot be read: its data fails HDF5's Fletcher-32 checksum or is damaged",
                        r->path, name);
    }
    for (size_t i = 0; i < got->numel; i++) {
        if (want == AMAX ? host[i] >= 0.0f
                         : isfinite(host[i]) && (want == ANY_FINITE || host[i] > 0.0f ||
                                                 (want == NONNEG_FINITE && host[i] == 0.0f)))
            continue;
        enum amp_status st = amp_fail(r->err, AMP_ERR_CKPT, HINT_CORRUPT, "%s: tensor /%s holds %g at element %zu; %s",
                                      r->path, name, (double)host[i], i,
                                      want == ANY_FINITE      ? "every value must be finite"
                                      : want == NONNEG_FINITE ? "every value must be finite and >= 0"
                                      : want == AMAX          ? "every amax must be >= 0 or +Inf"
                                                              : "every value must be finite and > 0");
        free(host);
        return st;
    }
    *out = host;
    return AMP_OK;
}

/* Read dataset `name` into tensor t (read_checked against t's shape), rounding once to t's dtype. */
static enum amp_status read_tensor(const struct reader *r, const char *name, struct tensor *t, enum values want,
                                   struct backend *be)
{
    if (!t->data)
        return AMP_OK;
    struct tensor_shape expect = {.ndim = t->ndim, .numel = t->numel}, got;
    memcpy(expect.shape, t->shape, sizeof(int64_t) * (size_t)(t->ndim < TENSOR_MAX_DIMS ? t->ndim : TENSOR_MAX_DIMS));
    float *host;
    enum amp_status st = read_checked(r, name, &expect, want, &got, &host);
    if (st != AMP_OK)
        return st;
    if (t->dtype == DT_FP32) {
        if (!r->dry)
            be->upload(be, t->data, host, t->numel * sizeof(float));
    } else { /* a bf16 master or moment: rounded to nearest once (exact for what a bf16 run wrote) */
        void *narrow = malloc(tensor_bytes(t) ? tensor_bytes(t) : 1);
        if (!narrow)
            st = amp_fail(r->err, AMP_ERR_INTERNAL, NULL, "out of memory reading %s", name);
        for (size_t i = 0; st == AMP_OK && i < t->numel; i++)
            if (!isfinite(dtype_round(host[i], t->dtype)))
                st = amp_fail(r->err, AMP_ERR_CKPT, "resume with precision.master_weights=fp32 and optim.state_dtype=fp32",
                              "%s: tensor /%s holds %g at element %zu, beyond %s's range (this run keeps it in %s)",
                              r->path, name, (double)host[i], i, dtype_name(t->dtype), dtype_name(t->dtype));
        if (st == AMP_OK) {
            dtype_convert(narrow, t->dtype, host, DT_FP32, t->numel);
            if (!r->dry)
                be->upload(be, t->data, narrow, tensor_bytes(t));
        }
        free(narrow);
    }
    free(host);
    return st;
}

/* /fp8 into the model's fp8 state, when the file's run was in fp8 (a resume from another mode starts fp8 afresh:
 * scales 1, empty histories). The shapes check the tensors' count and the history's length; scale_inv follows. */
static enum amp_status load_fp8(const struct reader *r, struct model *m)
{
    enum precision_mode file_mode;
    if (!m->has_fp8 || m->fp8.recipe != FP8_DELAYED || !precision_mode_from_name(r->info->precision_mode, &file_mode) ||
        file_mode != PREC_FP8)
        return AMP_OK;
    hid_t g = open_group(r, "fp8", "the fp8 scales and amax histories");
    if (g < 0)
        return AMP_ERR_CKPT;
    h5_close_id(g);
    struct fp8_group *groups[2] = {&m->fp8.fwd, &m->fp8.bwd};
    const char *names[2] = {"fwd", "bwd"};
    char name[64];
    enum amp_status st = AMP_OK;
    for (int i = 0; i < 2 && st == AMP_OK; i++) {
        struct fp8_group *fg = groups[i];
        if (fg->n == 0)
            continue;
        struct tensor scale = { .data = fg->scale, .dtype = DT_FP32, .ndim = 1, .shape = {fg->n, 1, 1, 1},
                                .numel = (size_t)fg->n, .be = m->be };
        snprintf(name, sizeof name, "fp8/%s/scale", names[i]);
        st = read_tensor(r, name, &scale, POSITIVE_FINITE, m->be);
        if (st == AMP_OK && !r->dry) { /* scale_inv with its scale, before anything else may be refused */
            float *host = malloc((size_t)fg->n * sizeof *host);
            if (!host)
                return amp_fail(r->err, AMP_ERR_INTERNAL, NULL, "out of memory reading the fp8 scales");
            m->be->download(m->be, host, fg->scale, (size_t)fg->n * sizeof *host);
            for (int j = 0; j < fg->n; j++)
                host[j] = 1.0f / host[j];
            m->be->upload(m->be, fg->scale_inv, host, (size_t)fg->n * sizeof *host);
            free(host);
        }
        if (st == AMP_OK && fg->history) {
            struct tensor h = { .data = fg->history, .dtype = DT_FP32, .ndim = 2, .shape = {m->fp8.len, fg->n, 1, 1},
                                .numel = (size_t)m->fp8.len * (size_t)fg->n, .be = m->be };
            snprintf(name, sizeof name, "fp8/%s/amax_history", names[i]);
            st = read_tensor(r, name, &h, AMAX, m->be);
        }
    }
    return st;
}

static enum amp_status load_model_from(const struct reader *r, struct model *m)
{
    char name[256];
    enum amp_status st = load_fp8(r, m);
    for (int i = 0; i < m->nparams && st == AMP_OK; i++) {
        snprintf(name, sizeof name, "model/%s", m->params[i]->name);
        st = read_tensor(r, name, &m->params[i]->master, ANY_FINITE, m->be);
    }
    for (int i = 0; i < m->nbuffers && st == AMP_OK; i++) {
        snprintf(name, sizeof name, "model/%s", m->buffers[i]->name);
        st = read_tensor(r, name, &m->buffers[i]->t, m->buffers[i]->nonneg ? NONNEG_FINITE : ANY_FINITE, m->be);
    }
    if (st == AMP_OK && !r->dry)
        model_refresh_copies(m);
    return st;
}

/* /scaler into s (whose settings, from the config, bound its state), for a run at optimizer step `step`. */
static enum amp_status load_scaler(const struct reader *r, int64_t step, struct scaler *s)
{
    hid_t g = open_group(r, "scaler", "the loss-scaler state");
    if (g < 0)
        return AMP_ERR_CKPT;
    const char *w = "/scaler";
    enum amp_status st = get_f64(r, g, w, "scale", &s->scale);
    if (st == AMP_OK)
        st = get_i64(r, g, w, "skips_total", 0, step, &s->skips_total);
    if (st == AMP_OK)
        st = get_i64(r, g, w, "consecutive_skips", 0, s->skips_total, &s->consecutive_skips);
    if (st == AMP_OK)
        st = get_i64(r, g, w, "last_overflow_step", -1, step, &s->last_overflow_step);
    if (st == AMP_OK)
        st = get_i64(r, g, w, "growth_tracker", 0, s->growth_interval > 0 ? s->growth_interval - 1 : 0,
                     &s->growth_tracker);
    /* each overflow since the last growth took one off */
    if (st == AMP_OK)
        st = get_i64(r, g, w, "hysteresis_left", s->hysteresis - s->skips_total, s->hysteresis, &s->hysteresis_left);
    h5_close_id(g);
    bool in_range = s->dynamic ? s->scale >= s->min_scale && s->scale <= s->max_scale : s->scale > 0;
    char scale[40];
    double_to_text(s->scale, scale, sizeof scale);
    if (st == AMP_OK && !in_range)
        st = amp_fail(r->err, AMP_ERR_CKPT, HINT_CORRUPT, "%s: attribute /scaler/scale is %s, outside %s", r->path,
                      scale, s->dynamic ? "[precision.loss_scale.min, max]" : "(0, inf)");
    return st;
}

/* A watch written by write_watch, into w when it watched the metric w watches (a resume that changes the metric,
 * or a file from a run that watched none, leaves w fresh). Present attributes are checked as every other. */
static enum amp_status read_watch(const struct reader *r, hid_t g, const char *prefix, int64_t step,
                                  struct eval_watch *w)
{
    char name[64], metric[32] = "";
    snprintf(name, sizeof name, "%s_metric", prefix);
    if (H5Aexists(g, name) <= 0)
        return AMP_OK;
    enum amp_status st = get_str(r, g, "/state", name, metric, sizeof metric);
    struct eval_watch v = {.metric = w->metric, .best = NAN};
    snprintf(name, sizeof name, "%s_step", prefix);
    if (st == AMP_OK)
        st = get_i64(r, g, "/state", name, -1, step, &v.best_step);
    snprintf(name, sizeof name, "%s_since", prefix);
    if (st == AMP_OK)
        st = get_i64(r, g, "/state", name, 0, MAX_STEP, &v.since);
    snprintf(name, sizeof name, "%s_best", prefix);
    if (st == AMP_OK && v.best_step >= 0)
        st = get_f64(r, g, "/state", name, &v.best);
    if (st == AMP_OK && w->metric != METRIC_NONE && strcmp(metric, eval_metric_name(w->metric)) == 0)
        *w = v;
    return st;
}

static enum amp_status load_trainer_from(const struct reader *r, const struct ckpt_info *info, struct trainer *t,
                                         bool fresh_scaler)
{
    /* The sampler position refers to the data: the files the run read (wherever they are now), or none of it. */
    enum amp_status st = ckpt_check_data(r->path, info, &t->ds, NULL, r->err);
    if (st != AMP_OK)
        return st;
    st = load_model_from(r, &t->model);
    char name[256];
    for (int i = 0; i < t->opt.nstate && i < t->model.nparams && st == AMP_OK; i++) {
        snprintf(name, sizeof name, "optimizer/%s/m", t->model.params[i]->name);
        st = read_tensor(r, name, &t->opt.state[i].m, ANY_FINITE, t->be);
        snprintf(name, sizeof name, "optimizer/%s/v", t->model.params[i]->name);
        if (st == AMP_OK)
            st = read_tensor(r, name, &t->opt.state[i].v, NONNEG_FINITE, t->be);
    }
    if (st != AMP_OK)
        return st;
    hid_t g = open_group(r, "optimizer", "the optimizer's step");
    if (g < 0)
        return AMP_ERR_CKPT;
    st = get_i64(r, g, "/optimizer", "step", 0, info->step, &t->opt.step); /* steps taken <= steps attempted */
    h5_close_id(g);
    if (st != AMP_OK)
        return st;
    int64_t epoch = 0, cursor = 0;
    if ((g = open_group(r, "data", "the sampler position")) < 0)
        return AMP_ERR_CKPT;
    st = get_i64(r, g, "/data", "epoch", 0, MAX_COUNT, &epoch);
    if (st == AMP_OK)
        st = get_i64(r, g, "/data", "cursor", 0, t->sampler.n, &cursor);
    h5_close_id(g);
    if (st != AMP_OK)
        return st;
    /* The file's state is checked against the mode that wrote it (a resume may change precision.mode, not
     * precision.fp8.*, so the config's fp8 keys are the file's). */
    struct scaler s = t->scaler;
    struct precision_config file_pc = t->cfg->precision;
    s.dynamic = precision_mode_from_name(info->precision_mode, &file_pc.mode) &&
                precision_loss_scaling(&file_pc) == LOSS_SCALE_DYNAMIC;
    if ((st = load_scaler(r, info->step, &s)) != AMP_OK)
        return st;
    s.dynamic = t->scaler.dynamic;
    if (!fresh_scaler)
        t->scaler = s;
    else
        t->scaler.skips_total = s.skips_total;
    if ((g = open_group(r, "state", "the run's position")) < 0)
        return AMP_ERR_CKPT;
    st = read_watch(r, g, "keep_best", info->step, &t->best);
    if (st == AMP_OK)
        st = read_watch(r, g, "early_stop", info->step, &t->stop);
    h5_close_id(g);
    if (st != AMP_OK)
        return st;
    sampler_seek(&t->sampler, epoch, cursor);
    t->ckpt_world = info->world_size;
    t->ckpt_accum = info->accum_steps;
    t->step = info->step;
    t->samples_seen = info->samples_seen;
    return AMP_OK;
}

enum amp_status ckpt_check_data(const char *path, const struct ckpt_info *info, const struct dataset *ds,
                                bool *checked, struct amp_error *err)
{
    if (checked)
        *checked = info->ndata_files > 0;
    if (info->ndata_files == 0)
        return AMP_OK;
    for (int i = 0; i < ds->nfiles; i++) {
        const struct data_file *f = &ds->files[i];
        const struct ckpt_data_file *rec = NULL;
        for (int j = 0; j < info->ndata_files && !rec; j++)
            if (strcmp(info->data_files[j].key, f->key) == 0)
                rec = &info->data_files[j];
        if (!rec)
            return amp_fail(err, AMP_ERR_DATA, "give the data files the run was trained on (ampTrain inspect lists "
                            "them in its config)",
                            "%s (%s): the run that wrote %s read no file under this key", f->path, f->key, path);
        if (rec->digest != f->digest)
            return amp_fail(err, AMP_ERR_DATA,
                            "give the file the run was trained on (a copy anywhere will do), or start a new run on "
                            "this data",
                            "%s (%s): its contents differ from the file the run that wrote %s was trained on (digest "
                            "%016llx, the checkpoint records %016llx)",
                            f->path, f->key, path, (unsigned long long)f->digest, (unsigned long long)rec->digest);
    }
    /* text: one file more in the checkpoint than given is a different byte stream too */
    char more[48];
    snprintf(more, sizeof more, "data.files.%d", ds->nfiles);
    for (int j = 0; j < info->ndata_files; j++)
        if (ds->nfiles > 0 && strncmp(ds->files[0].key, "data.files.", 11) == 0 &&
            strcmp(info->data_files[j].key, more) == 0)
            return amp_fail(err, AMP_ERR_DATA, "give every file the run was trained on, in its order",
                            "data.files: %d file%s given, but the run that wrote %s read more (%s)", ds->nfiles,
                            ds->nfiles == 1 ? "" : "s", path, more);
    return AMP_OK;
}

/* ---- inspect --------------------------------------------------------------------------------------- */

struct visit {
    FILE *out;
    hid_t file;
};

static herr_t visit_cb(hid_t g, const char *name, const amp_h5l_info *info, void *data)
{
    (void)info;
    struct visit *v = data;
    hid_t o = H5Oopen(g, name, H5P_DEFAULT);
    if (o >= 0 && H5Iget_type(o) == H5I_DATASET && strcmp(name, "config") != 0) {
        hid_t sp = H5Dget_space(o), ft = H5Dget_type(o);
        int nd = H5Sget_simple_extent_type(sp) == H5S_SIMPLE ? H5Sget_simple_extent_ndims(sp) : 0;
        bool f32 = H5Tget_class(ft) == H5T_FLOAT && H5Tget_size(ft) == 4;
        char s[160];
        if (nd > 0 && nd <= 8) {
            hsize_t dims[8] = {0};
            int64_t shape[8] = {0};
            H5Sget_simple_extent_dims(sp, dims, NULL);
            for (int i = 0; i < nd; i++)
                shape[i] = dims[i] > (hsize_t)INT64_MAX ? INT64_MAX : (int64_t)dims[i];
            shape_str(s, sizeof s, nd, shape);
        } else {
            snprintf(s, sizeof s, "(%d dimensions: not a tensor ampTrain reads)", nd);
        }
        fprintf(v->out, "  /%-40s %s %s\n", name, f32 ? "float32" : class_name(H5Tget_class(ft)), s);
        h5_close_id(ft);
        h5_close_id(sp);
    }
    h5_close_id(o);
    return 0;
}

static enum amp_status inspect_open(hid_t f, const char *path, const struct ckpt_info *info_in, FILE *out, bool dry,
                                    struct amp_error *err)
{
    struct ckpt_info info = *info_in;
    /* The scaler's state is checked against the settings of the config it ran with. */
    struct reader r = {.file = f, .path = path, .err = err, .dry = dry};
    char *text = read_config_text(&r);
    enum amp_status st = text ? AMP_OK : AMP_ERR_CKPT;
    struct config cfg;
    struct amp_error perr = {0};
    if (st == AMP_OK && config_parse_string(&cfg, text, strlen(text), path, &perr) != AMP_OK)
        st = amp_fail(err, AMP_ERR_CKPT, "the checkpoint was written by an incompatible ampTrain version",
                      "%s: its embedded config does not parse: %s", path, perr.msg);
    struct scaler s = {0};
    if (st == AMP_OK) {
        scaler_init(&s, &cfg.precision);
        config_free(&cfg);
        st = load_scaler(&r, info.step, &s);
    }
    char scale[40];
    double_to_text(s.scale, scale, sizeof scale);
    FILE *null = dry ? fopen("/dev/null", "w") : NULL; /* a trial makes the same calls and prints nowhere */
    if (dry)
        out = null;
    if (st == AMP_OK && text && out) {
        fprintf(out, "checkpoint %s\n", path);
        fprintf(out, "format: %s version %lld, written by ampTrain %s at %s (whole-file CRC-32 verified)\n",
                CKPT_FORMAT, (long long)info.format_version, info.amptrain_version, info.created);
        fprintf(out, "step: %lld  epoch: %lld  cursor: %lld  samples_seen: %lld\n", (long long)info.step,
                (long long)info.epoch, (long long)info.cursor, (long long)info.samples_seen);
        fprintf(out, "precision: %s\n", info.precision_mode);
        fprintf(out, "world_size: %lld (data-parallel ranks that wrote it)\n", (long long)info.world_size);
        fprintf(out,
                "scaler: scale %s, growth_tracker %lld, hysteresis_left %lld, consecutive_skips %lld, "
                "skips_total %lld, last_overflow_step %lld\n",
                scale, (long long)s.growth_tracker, (long long)s.hysteresis_left, (long long)s.consecutive_skips,
                (long long)s.skips_total, (long long)s.last_overflow_step);
        fprintf(out, "tensors:\n");
        struct visit v = {.out = out, .file = f};
        H5Lvisit(f, H5_INDEX_NAME, H5_ITER_INC, visit_cb, &v);
        fprintf(out, "config:\n%s", text);
        if (text[0] && text[strlen(text) - 1] != '\n')
            fprintf(out, "\n");
    }
    if (null)
        fclose(null);
    free(text);
    return st;
}

/* ---- export: every tensor under /model ------------------------------------------------------------- */

struct weights_visit {
    const struct reader *r;
    struct ckpt_weights *w;
    int cap;
    enum amp_status st;
};

/* One dataset under /model into w (groups are walked through). Returns 0 to go on, -1 to stop with v->st. */
static int read_one_weight(struct weights_visit *v, const char *name)
{
    const struct reader *r = v->r;
    struct ckpt_tensor t = {0};
    char path[sizeof t.name + 8];
    if (strlen(name) >= sizeof t.name) {
        v->st = amp_fail(r->err, AMP_ERR_CKPT, HINT_CORRUPT, "%s: tensor /model/%.64s... is named by a path longer "
                         "than 255 bytes", r->path, name);
        return -1;
    }
    snprintf(t.name, sizeof t.name, "%s", name);
    snprintf(path, sizeof path, "model/%s", name);
    struct tensor_shape got;
    v->st = read_checked(r, path, NULL, ANY_FINITE, &got, &t.data);
    if (v->st != AMP_OK)
        return -1;
    t.ndim = got.ndim;
    t.numel = got.numel;
    memcpy(t.shape, got.shape, sizeof t.shape);
    if (v->w->n == v->cap) {
        int cap = v->cap ? 2 * v->cap : 32;
        struct ckpt_tensor *g = realloc(v->w->tensors, (size_t)cap * sizeof *g);
        if (!g) {
            free(t.data);
            v->st = amp_fail(r->err, AMP_ERR_INTERNAL, NULL, "out of memory reading %s", r->path);
            return -1;
        }
        v->w->tensors = g;
        v->cap = cap;
    }
    v->w->tensors[v->w->n++] = t;
    return 0;
}

static herr_t weights_cb(hid_t g, const char *name, const amp_h5l_info *info, void *data)
{
    (void)info;
    struct weights_visit *v = data;
    hid_t o = H5Oopen(g, name, H5P_DEFAULT);
    int rc = 0;
    if (o < 0) {
        v->st = amp_fail(v->r->err, AMP_ERR_CKPT, HINT_CORRUPT, "%s: /model/%s cannot be opened", v->r->path, name);
        rc = -1;
    } else if (H5Iget_type(o) == H5I_DATASET) {
        rc = read_one_weight(v, name);
    }
    h5_close_id(o);
    return rc;
}

static enum amp_status read_weights(const struct reader *r, struct ckpt_weights *w)
{
    hid_t g = H5Lexists(r->file, "model", H5P_DEFAULT) > 0 ? H5Gopen2(r->file, "model", H5P_DEFAULT) : -1;
    if (g < 0)
        return amp_fail(r->err, AMP_ERR_CKPT, HINT_CORRUPT, "%s: group /model (the weights) is missing", r->path);
    struct weights_visit v = {.r = r, .w = w, .st = AMP_OK};
    herr_t rc = H5Lvisit(g, H5_INDEX_NAME, H5_ITER_INC, weights_cb, &v);
    h5_close_id(g);
    if (v.st == AMP_OK && rc < 0)
        v.st = amp_fail(r->err, AMP_ERR_CKPT, HINT_CORRUPT, "%s: the group /model cannot be listed", r->path);
    if (v.st == AMP_OK && w->n == 0)
        v.st = amp_fail(r->err, AMP_ERR_CKPT, HINT_CORRUPT, "%s: the group /model holds no tensors", r->path);
    if (v.st != AMP_OK)
        ckpt_weights_free(w);
    return v.st;
}

void ckpt_weights_free(struct ckpt_weights *w)
{
    if (!w)
        return;
    for (int i = 0; i < w->n; i++)
        free(w->tensors[i].data);
    free(w->tensors);
    w->tensors = NULL;
    w->n = 0;
}

/* ---- the public readers: a trial read in a child first (trial.h) --------------------------------------- */

enum ckpt_op { OP_VERIFY, OP_CONFIG, OP_MODEL, OP_TRAINER, OP_INSPECT, OP_WEIGHTS };

struct ckpt_job {
    enum ckpt_op op;
    const char *path;
    struct ckpt_info *info; /* OP_VERIFY (may be NULL) */
    struct config *cfg;     /* OP_CONFIG */
    struct model *m;        /* OP_MODEL */
    struct trainer *t;      /* OP_TRAINER */
    bool fresh_scaler;
    FILE *out;              /* OP_INSPECT */
    struct ckpt_weights *w; /* OP_WEIGHTS */
};

/* The job's HDF5 part, on a file check_file verified. */
static enum amp_status job_run(const struct ckpt_job *j, bool dry, struct amp_error *err)
{
    struct h5_quiet q;
    h5_quiet_begin(&q);
    struct ckpt_info info;
    hid_t f = open_checked(j->path, &info, err);
    struct reader r = {.file = f, .path = j->path, .err = err, .dry = dry, .info = &info};
    enum amp_status st = f < 0 ? AMP_ERR_CKPT : AMP_OK;
    char *text = NULL;
    if (st == AMP_OK) {
        switch (j->op) {
        case OP_VERIFY:
            if (j->info)
                *j->info = info;
            break;
        case OP_CONFIG: st = (text = read_config_text(&r)) ? AMP_OK : AMP_ERR_CKPT; break;
        case OP_MODEL: st = load_model_from(&r, j->m); break;
        case OP_TRAINER: st = load_trainer_from(&r, &info, j->t, j->fresh_scaler); break;
        case OP_INSPECT: st = inspect_open(f, j->path, &info, j->out, dry, err); break;
        case OP_WEIGHTS:
            memset(j->w, 0, sizeof *j->w);
            j->w->info = info;
            st = read_weights(&r, j->w);
            if (dry)
                ckpt_weights_free(j->w);
            break;
        }
    }
    if (f >= 0)
        H5Fclose(f);
    h5_quiet_end(&q);
    if (st == AMP_OK && j->op == OP_CONFIG) {
        char name[CFG_STR + 16];
        snprintf(name, sizeof name, "%s:/config", j->path);
        struct amp_error perr = {0};
        st = config_parse_string(j->cfg, text, strlen(text), name, &perr);
        if (st != AMP_OK)
            st = amp_fail(err, AMP_ERR_CKPT, "the checkpoint was written by an incompatible ampTrain version",
                          "%s: its embedded config does not parse: %s", j->path, perr.msg);
        else if (dry)
            config_free(j->cfg);
        else if (!config_fp8_min_size_written(j->cfg)) /* written before the key: every product ran in fp8 */
            j->cfg->precision.fp8.min_size[0] = j->cfg->precision.fp8.min_size[1] = 0;
    }
    free(text);
    return st;
}

static void job_trial(void *arg)
{
    struct amp_error ignored = {0};
    job_run(arg, true, &ignored);
}

/* check_file (no HDF5), then the job in a child, then here. */
static enum amp_status guarded(const struct ckpt_job *j, struct amp_error *err)
{
    enum amp_status st = check_file(j->path, err);
    if (st != AMP_OK)
        return st;
    struct stat sb;
    long long bytes = stat(j->path, &sb) == 0 ? (long long)sb.st_size : 0;
    struct trial_result tr = trial_run(job_trial, (void *)j, trial_seconds_for(bytes));
    if (tr.outcome == TRIAL_CRASHED || tr.outcome == TRIAL_TIMEOUT) {
        char what[96];
        trial_describe(&tr, what, sizeof what);
        return amp_fail(err, AMP_ERR_CKPT, HINT_CORRUPT,
                        "%s: its HDF5 metadata is damaged or crafted although its checksum matches: reading it "
                        "in a trial process %s (libhdf5 trusts metadata; docs/reliability.md)", j->path, what);
    }
    return job_run(j, false, err);
}

enum amp_status ckpt_verify(const char *path, struct ckpt_info *info, struct amp_error *err)
{
    struct amp_error ignored = {0};
    return guarded(&(struct ckpt_job){.op = OP_VERIFY, .path = path, .info = info}, err ? err : &ignored);
}

enum amp_status ckpt_fingerprint(const char *path, uint64_t *fp, struct amp_error *err)
{
    unsigned char hdr[32];
    int fd = open(path, O_RDONLY | O_NONBLOCK); /* O_NONBLOCK: as check_file, a FIFO does not wait for a writer */
    ssize_t got = fd < 0 ? -1 : pread(fd, hdr, sizeof hdr, 0);
    int saved = errno;
    if (fd >= 0)
        close(fd);
    if (got != (ssize_t)sizeof hdr || memcmp(hdr, MAGIC, 8) != 0)
        return amp_fail(err, AMP_ERR_CKPT, HINT_CORRUPT, "cannot read the header of checkpoint %s: %s", path,
                        got < 0 ? strerror(saved) : "too short, or no ampTrain header");
    /* bytes 16..23 the file's size, 24..27 its CRC-32 (seal_image) */
    *fp = digest_u64(digest_u64(DIGEST_INIT, get_le(hdr + 24, 4)), get_le(hdr + 16, 8));
    return AMP_OK;
}

enum amp_status ckpt_read_config(const char *path, struct config *cfg, struct amp_error *err)
{
    return guarded(&(struct ckpt_job){.op = OP_CONFIG, .path = path, .cfg = cfg}, err);
}

enum amp_status ckpt_load_model(const char *path, struct model *m, struct amp_error *err)
{
    return guarded(&(struct ckpt_job){.op = OP_MODEL, .path = path, .m = m}, err);
}

enum amp_status ckpt_load_trainer(const char *path, struct trainer *t, bool fresh_scaler, struct amp_error *err)
{
    return guarded(&(struct ckpt_job){.op = OP_TRAINER, .path = path, .t = t, .fresh_scaler = fresh_scaler}, err);
}

enum amp_status ckpt_inspect(const char *path, FILE *out, struct amp_error *err)
{
    return guarded(&(struct ckpt_job){.op = OP_INSPECT, .path = path, .out = out}, err);
}

enum amp_status ckpt_read_weights(const char *path, struct ckpt_weights *w, struct amp_error *err)
{
    memset(w, 0, sizeof *w);
    return guarded(&(struct ckpt_job){.op = OP_WEIGHTS, .path = path, .w = w}, err);
}
