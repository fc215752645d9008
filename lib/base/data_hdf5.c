/*
 * data_hdf5.c — the HDF5 reader: inputs x (N, ...) and integer labels y (N) from a user's file.
 *
 * x may be any float or integer type, of rank 1 to 4: (N) and (N, D) give vector samples
 * (sample_ndim 1), (N, H, W) single-channel images (1, H, W), (N, C, H, W) images (C, H, W). HDF5
 * converts the file's type to double as we read a block of rows at a time; each value is checked to be
 * finite, normalised x' = (x - mean)/std and rounded once to fp32. y may be (N) or (N, 1), any integer
 * type; labels must lie in [0, 2^31 - 1). The last val_fraction of the rows (floor) is the test split.
 * num_classes = max(training label) + 1; a test label outside [0, num_classes) is an error.
 *
 * HDF5 prints its own error stack by default; we silence it for the duration of the load (and restore
 * the caller's handler) and report failures in our words.
 */
#define _DEFAULT_SOURCE

#include <hdf5.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "data_internal.h" /* data_check_file, data_alloc, data_mul_ok */
#include "h5compat.h"      /* amp_h5l_info, amp_h5_is_hdf5: HDF5 1.10 and 1.12+ alike */
#include "trial.h"         /* trial_run: libhdf5 parses the file in a child first */

#define H5_MISSING_HINT "fix data.path: it must name an HDF5 file holding the datasets data.x_key and data.y_key"
#define H5_BLOCK_VALUES (1 << 20) /* doubles per read block (8 MB) */

struct h5_ctx {
    const char *path;
    const struct data_config *cfg;
    hid_t file;
    struct amp_error *err;
};

/* Up to a few top-level names of the file, for "no dataset 'x'" hints. */
struct name_list {
    char text[400];
    int count;
};

static herr_t collect_name(hid_t group, const char *name, const amp_h5l_info *info, void *data)
{
    (void)group;
    (void)info;
    struct name_list *l = data;
    size_t used = strlen(l->text);
    if (l->count < 8)
        snprintf(l->text + used, sizeof l->text - used, "%s'%s'", l->count ? ", " : "", name);
    else if (l->count == 8)
        snprintf(l->text + used, sizeof l->text - used, ", ...");
    l->count++;
    return 0;
}

static enum amp_status h5_fail_missing(const struct h5_ctx *c, const char *name, const char *key)
{
    struct name_list l = {.text = "", .count = 0};
    hsize_t idx = 0;
    H5Literate(c->file, H5_INDEX_NAME, H5_ITER_NATIVE, &idx, collect_name, &l);
    char hint[600];
    if (l.count)
        snprintf(hint, sizeof hint, "set %s to one of the file's datasets: %s", key, l.text);
    else
        snprintf(hint, sizeof hint, "the file's root group is empty: write the arrays into it or fix data.path");
    return amp_fail(c->err, AMP_ERR_DATA, hint, "%s: no dataset '%s' (%s)", c->path, name, key);
}

/* Open dataset `name` (config key `key`), its shape and type class. */
static enum amp_status h5_open(const struct h5_ctx *c, const char *name, const char *key, hid_t *dset, int *rank,
                               hsize_t dims[4], H5T_class_t *cls)
{
    *dset = -1;
    if (!name[0])
        return amp_fail(c->err, AMP_ERR_CONFIG, "name the dataset in the config", "%s is empty", key);
    htri_t exists = H5Lexists(c->file, name, H5P_DEFAULT);
    if (exists <= 0)
        return h5_fail_missing(c, name, key);
    *dset = H5Dopen2(c->file, name, H5P_DEFAULT);
    if (*dset < 0)
        return amp_fail(c->err, AMP_ERR_DATA, "name an array dataset, not a group", "%s: '%s' is not a dataset (%s)",
                        c->path, name, key);
    hid_t type = H5Dget_type(*dset), space = H5Dget_space(*dset);
    *cls = type >= 0 ? H5Tget_class(type) : H5T_NO_CLASS;
    *rank = space >= 0 ? H5Sget_simple_extent_ndims(space) : -1;
    if (*rank >= 1 && *rank <= 4)
        H5Sget_simple_extent_dims(space, dims, NULL);
    if (type >= 0)
        H5Tclose(type);
    if (space >= 0)
        H5Sclose(space);
    if (*rank < 0)
        return amp_fail(c->err, AMP_ERR_DATA, "the file may be damaged", "%s: cannot read the shape of '%s' (%s)",
                        c->path, name, key);
    return AMP_OK;
}

/* Read rows [row0, row0 + rows) of a dataset with row_numel values per row as doubles into buf. */
static herr_t h5_read_rows(hid_t dset, int rank, const hsize_t dims[4], int64_t row0, int64_t rows, double *buf)
{
    hsize_t start[4] = {(hsize_t)row0, 0, 0, 0}, count[4] = {(hsize_t)rows, 1, 1, 1};
    hsize_t total = (hsize_t)rows;
    for (int d = 1; d < rank; d++) {
        count[d] = dims[d];
        total *= dims[d];
    }
    hid_t fspace = H5Dget_space(dset);
    hid_t mspace = H5Screate_simple(1, &total, NULL);
    herr_t r = -1;
    if (fspace >= 0 && mspace >= 0 && H5Sselect_hyperslab(fspace, H5S_SELECT_SET, start, NULL, count, NULL) >= 0)
        r = H5Dread(dset, H5T_NATIVE_DOUBLE, mspace, fspace, H5P_DEFAULT, buf);
    if (mspace >= 0)
        H5Sclose(mspace);
    if (fspace >= 0)
        H5Sclose(fspace);
    return r;
}

/* Read x into the two splits' fp32 buffers, checking and normalising each value. */
static enum amp_status h5_read_x(const struct h5_ctx *c, struct dataset *ds, hid_t dset, int rank, const hsize_t dims[4],
                                 int64_t n, int64_t n_train)
{
    const int64_t numel = ds->sample_numel;
    const char *name = c->cfg->x_key;
    int64_t rows_per_block = numel >= H5_BLOCK_VALUES ? 1 : H5_BLOCK_VALUES / numel;
    if (rows_per_block > n)
        rows_per_block = n;
    double *buf = data_alloc((uint64_t)(rows_per_block * numel), sizeof(double), c->path, "a read block", c->err);
    if (!buf)
        return c->err ? c->err->code : AMP_ERR_INTERNAL;
    const double mean = c->cfg->mean, std = c->cfg->std;
    enum amp_status st = AMP_OK;
    for (int64_t row0 = 0; row0 < n && st == AMP_OK; row0 += rows_per_block) {
        int64_t rows = n - row0 < rows_per_block ? n - row0 : rows_per_block;
        if (h5_read_rows(dset, rank, dims, row0, rows, buf) < 0) {
            st = amp_fail(c->err, AMP_ERR_DATA, "the file may be damaged or its type not convertible to numbers",
                          "%s: cannot read rows %lld..%lld of dataset '%s' (data.x_key)", c->path, (long long)row0,
                          (long long)(row0 + rows - 1), name);
            break;
        }
        for (int64_t r = 0; r < rows && st == AMP_OK; r++) {
            int64_t i = row0 + r;
            int s = i < n_train ? SPLIT_TRAIN : SPLIT_TEST;
            float *dst = ds->split[s].x + (i - (s == SPLIT_TRAIN ? 0 : n_train)) * numel;
            const double *src = buf + r * numel;
            for (int64_t e = 0; e < numel; e++) {
                float v = (float)((src[e] - mean) / std);
                if (!isfinite(src[e]) || !isfinite(v)) {
                    st = amp_fail(c->err, AMP_ERR_DATA,
                                  isfinite(src[e]) ? "rescale the inputs or fix data.mean / data.std"
                                                   : "clean the inputs (NaN/Inf cannot be trained on)",
                                  isfinite(src[e]) ? "%s: dataset '%s' has a value (%g) that is not finite in fp32 after "
                                                     "normalisation at sample %lld, element %lld (data.x_key)"
                                                   : "%s: dataset '%s' has a non-finite value (%g) at sample %lld, "
                                                     "element %lld (data.x_key)",
                                  c->path, name, src[e], (long long)i, (long long)e);
                    break;
                }
                dst[e] = v;
            }
        }
    }
    free(buf);
    return st;
}

/* Read y (n) as int64, check each label, and store int32 labels in the two splits. */
static enum amp_status h5_read_y(const struct h5_ctx *c, struct dataset *ds, hid_t dset, int64_t n, int64_t n_train)
{
    const char *name = c->cfg->y_key;
    int64_t *lab = data_alloc((uint64_t)n, sizeof(int64_t), c->path, "the labels", c->err);
    if (!lab)
        return c->err ? c->err->code : AMP_ERR_INTERNAL;
    enum amp_status st = AMP_OK;
    if (H5Dread(dset, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, lab) < 0)
        st = amp_fail(c->err, AMP_ERR_DATA, "the file may be damaged", "%s: cannot read dataset '%s' (data.y_key)",
                      c->path, name);
    int64_t max_label = 0, max_at = 0;
    for (int64_t i = 0; i < n && st == AMP_OK; i++) {
        if (lab[i] < 0 || lab[i] >= INT32_MAX)
            st = amp_fail(c->err, AMP_ERR_DATA, "labels must be class indices 0, 1, 2, ...",
                          "%s: dataset '%s' has label %lld at index %lld, out of range (labels must be in [0, %d)) "
                          "(data.y_key)",
                          c->path, name, (long long)lab[i], (long long)i, INT32_MAX);
        else if (i < n_train && lab[i] > max_label) {
            max_label = lab[i];
            max_at = i;
        }
    }
    for (int64_t i = n_train; i < n && st == AMP_OK; i++)
        if (lab[i] > max_label)
            st = amp_fail(c->err, AMP_ERR_DATA,
                          "the held-out samples must use the classes of the training samples: reorder the file or "
                          "change data.val_fraction",
                          "%s: dataset '%s' has label %lld at index %lld (test split), out of range: the training "
                          "labels are 0..%lld (data.y_key)",
                          c->path, name, (long long)lab[i], (long long)i, (long long)max_label);
    if (st == AMP_OK) {
        for (int64_t i = 0; i < n; i++) {
            if (i < n_train)
                ds->split[SPLIT_TRAIN].y[i] = (int32_t)lab[i];
            else
                ds->split[SPLIT_TEST].y[i - n_train] = (int32_t)lab[i];
        }
        ds->spec.num_classes = max_label + 1;
        ds->spec.max_label_at = max_at;
        snprintf(ds->spec.labels_from, sizeof ds->spec.labels_from, "%s dataset '%s' (data.y_key)", c->path, name);
    }
    free(lab);
    return st;
}

static enum amp_status h5_load(struct h5_ctx *c, struct dataset *ds)
{
    const struct data_config *cfg = c->cfg;
    hid_t x = -1, y = -1;
    int xrank = 0, yrank = 0;
    hsize_t xdims[4] = {0}, ydims[4] = {0};
    H5T_class_t xcls, ycls;
    enum amp_status st = h5_open(c, cfg->x_key, "data.x_key", &x, &xrank, xdims, &xcls);
    if (st == AMP_OK)
        st = h5_open(c, cfg->y_key, "data.y_key", &y, &yrank, ydims, &ycls);
    if (st == AMP_OK && xcls != H5T_FLOAT && xcls != H5T_INTEGER)
        st = amp_fail(c->err, AMP_ERR_DATA, "store the inputs as a float or integer array",
                      "%s: dataset '%s' is not numeric: expected float or integer values (data.x_key)", c->path,
                      cfg->x_key);
    if (st == AMP_OK && (xrank < 1 || xrank > 4))
        st = amp_fail(c->err, AMP_ERR_DATA, "store the inputs as (N, D), (N, H, W) or (N, C, H, W)",
                      "%s: dataset '%s' has %d dimensions, expected 1 to 4 (N, ...) (data.x_key)", c->path, cfg->x_key,
                      xrank);
    if (st == AMP_OK && ycls != H5T_INTEGER)
        st = amp_fail(c->err, AMP_ERR_DATA, "store the labels as an integer array of class indices",
                      "%s: dataset '%s' does not hold integers: labels must be integer class indices (data.y_key)",
                      c->path, cfg->y_key);
    if (st == AMP_OK && !(yrank == 1 || (yrank == 2 && ydims[1] == 1)))
        st = amp_fail(c->err, AMP_ERR_DATA, "store the labels as a 1-D array (N)",
                      "%s: dataset '%s' has %d dimensions, expected (N) (data.y_key)", c->path, cfg->y_key, yrank);
    int64_t n = (int64_t)xdims[0];
    if (st == AMP_OK && (int64_t)ydims[0] != n)
        st = amp_fail(c->err, AMP_ERR_DATA, "x and y must hold one label per sample",
                      "%s: dataset '%s' holds %lld samples but '%s' holds %lld labels", c->path, cfg->x_key,
                      (long long)n, cfg->y_key, (long long)ydims[0]);
    if (st == AMP_OK && n == 0)
        st = amp_fail(c->err, AMP_ERR_DATA, "write the samples into the file", "%s: dataset '%s' holds no samples",
                      c->path, cfg->x_key);
    int64_t numel = 1;
    for (int d = 1; d < xrank && st == AMP_OK; d++)
        if (xdims[d] == 0 || xdims[d] > INT64_MAX || !data_mul_ok(numel, (int64_t)xdims[d], &numel))
            st = amp_fail(c->err, AMP_ERR_DATA, "check the shape of the inputs",
                          "%s: dataset '%s' has an empty or overflowing dimension %d (%llu)", c->path, cfg->x_key, d,
                          (unsigned long long)xdims[d]);
    int64_t n_test = (int64_t)floor((double)n * cfg->val_fraction);
    if (n_test > n)
        n_test = n;
    int64_t n_train = n - n_test;
    if (st == AMP_OK && cfg->val_fraction > 0 && n_test == 0)
        st = amp_fail(c->err, AMP_ERR_DATA, "raise data.val_fraction, add samples, or set data.val_fraction: 0",
                      "%s: data.val_fraction %g of %lld samples holds out no sample for the test split", c->path,
                      cfg->val_fraction, (long long)n);
    if (st == AMP_OK && n_train == 0)
        st = amp_fail(c->err, AMP_ERR_DATA, "lower data.val_fraction",
                      "%s: data.val_fraction %g of %lld samples leaves no training sample", c->path, cfg->val_fraction,
                      (long long)n);
    if (st == AMP_OK) {
        ds->sample_numel = numel;
        if (xrank <= 2) {
            ds->spec.sample_ndim = 1;
            ds->spec.sample_shape[0] = xrank == 2 ? (int64_t)xdims[1] : 1;
            ds->spec.sample_shape[1] = ds->spec.sample_shape[2] = 1;
        } else {
            ds->spec.sample_ndim = 3;
            ds->spec.sample_shape[0] = xrank == 4 ? (int64_t)xdims[1] : 1;
            ds->spec.sample_shape[1] = (int64_t)xdims[xrank - 2];
            ds->spec.sample_shape[2] = (int64_t)xdims[xrank - 1];
        }
        int64_t total;
        if (!data_mul_ok(n, numel, &total))
            st = amp_fail(c->err, AMP_ERR_DATA, "check the shape of the inputs", "%s: dataset '%s' is too large",
                          c->path, cfg->x_key);
    }
    for (int s = 0; s < 2 && st == AMP_OK; s++) {
        int64_t ns = s == SPLIT_TRAIN ? n_train : n_test;
        ds->split[s].n = ns;
        ds->split[s].x = data_alloc((uint64_t)(ns * numel), sizeof(float), c->path, "the fp32 inputs", c->err);
        ds->split[s].y = ds->split[s].x ? data_alloc((uint64_t)ns, sizeof(int32_t), c->path, "the labels", c->err)
                                        : NULL;
        if (!ds->split[s].y)
            st = c->err ? c->err->code : AMP_ERR_INTERNAL;
    }
    if (st == AMP_OK)
        st = h5_read_y(c, ds, y, n, n_train);
    if (st == AMP_OK)
        st = h5_read_x(c, ds, x, xrank, xdims, n, n_train);
    if (x >= 0)
        H5Dclose(x);
    if (y >= 0)
        H5Dclose(y);
    return st;
}

static enum amp_status load_here(struct dataset *ds, const struct data_config *cfg, struct amp_error *err);

struct trial_job {
    const struct data_config *cfg;
};

static void trial_load(void *arg)
{
    const struct trial_job *j = arg;
    struct dataset ds;
    memset(&ds, 0, sizeof ds);
    struct amp_error ignored = {0};
    load_here(&ds, j->cfg, &ignored);
}

/* The file is the user's, not ours: libhdf5 trusts its metadata, and a damaged or crafted one can crash it.
 * So the whole load runs first in a child (trial.h), and here only when the child came back. A file is read
 * twice; docs/data.md says so (AMPTRAIN_NO_TRIAL=1 reads it once, trusting it). */
enum amp_status data_load_hdf5(struct dataset *ds, const struct data_config *cfg, struct amp_error *err)
{
    int64_t bytes = 0;
    enum amp_status st = data_check_file(cfg->path, "data.path", H5_MISSING_HINT, &bytes, err);
    if (st != AMP_OK)
        return st;
    struct trial_job job = {.cfg = cfg};
    struct trial_result tr = trial_run(trial_load, &job, trial_seconds_for(bytes));
    if (tr.outcome == TRIAL_CRASHED || tr.outcome == TRIAL_TIMEOUT) {
        char what[96];
        trial_describe(&tr, what, sizeof what);
        return amp_fail(err, AMP_ERR_DATA, "the file is damaged: write it again (h5py, HDF5 C API) or restore it",
                        "%s: its HDF5 metadata is damaged: reading it in a trial process %s (data.path; libhdf5 "
                        "trusts metadata, docs/reliability.md)", cfg->path, what);
    }
    return load_here(ds, cfg, err);
}

static enum amp_status load_here(struct dataset *ds, const struct data_config *cfg, struct amp_error *err)
{
    enum amp_status st = AMP_OK;
    H5E_auto2_t old_func = NULL;
    void *old_data = NULL;
    H5Eget_auto2(H5E_DEFAULT, &old_func, &old_data);
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
    struct h5_ctx c = {.path = cfg->path, .cfg = cfg, .file = -1, .err = err};
    htri_t is_h5 = amp_h5_is_hdf5(cfg->path);
    if (is_h5 <= 0) {
        st = amp_fail(err, AMP_ERR_DATA, "data.path must name an HDF5 file (h5py, HDF5 C API, ...)",
                      "%s: not an HDF5 file (data.path)", cfg->path);
    } else {
        c.file = H5Fopen(cfg->path, H5F_ACC_RDONLY, H5P_DEFAULT);
        if (c.file < 0)
            st = amp_fail(err, AMP_ERR_DATA,
                          "the file may be damaged or locked by another process; on NFS set HDF5_USE_FILE_LOCKING=FALSE",
                          "%s: cannot open the HDF5 file (data.path)", cfg->path);
        else
            st = h5_load(&c, ds);
    }
    if (c.file >= 0)
        H5Fclose(c.file);
    H5Eset_auto2(H5E_DEFAULT, old_func, old_data);
    return st;
}
