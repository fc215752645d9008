/*
 * fuzz_ckpt.c — libFuzzer harness for the checkpoint loader (lib/engine/checkpoint.h), built three times:
 *
 *   FUZZ_CKPT_MODE 0, fuzz_ckpt_raw: the input is the checkpoint file as is. The whole-file CRC-32 in the
 *     512-byte user block must refuse almost every mutation before HDF5 sees a byte: that is what it tests.
 *   FUZZ_CKPT_MODE 1, fuzz_ckpt_resealed: the input is written, then its user block is made valid again
 *     (magic and layout version here, length and CRC-32 by reseal() of tests/ckpt_testlib.h), so the
 *     mutated bytes reach HDF5's parser and then our readers. Crashes inside libhdf5 are expected here
 *     (that is why the CRC exists); scripts/check/fuzz.sh files them apart from ours.
 *   fuzz_ckpt_guarded: mode 1 with lib/base/trial.h's trial process on (FUZZ_TRIAL), as `ampTrain resume` runs:
 *     HDF5 parses each file in a forked child first, so no crash inside libhdf5 may reach this process; any
 *     finding here, in libhdf5 or not, breaks that promise (docs/reliability.md). The other modes turn the
 *     trial off (fuzz_common.h: fuzz_set_trials) to fuzz the parse itself.
 *   FUZZ_CKPT_MODE 2, fuzz_ckpt_edit: the input is an edit script applied through the HDF5 API to a copy
 *     of a valid checkpoint (edit_*, below): attributes replaced by other types, ranks, sizes and extreme
 *     values; tensors by other dtypes, ranks, shapes and non-finite values; /config by arrays of strings,
 *     variable-length strings, non-strings or other text; objects deleted, swapped for groups or links.
 *     The file is then resealed and loaded: this reaches our reading code with well-formed HDF5.
 *
 * Every input goes through ckpt_verify, ckpt_read_config (+ config_print_yaml), ckpt_inspect,
 * ckpt_load_model and ckpt_load_trainer (fresh_scaler from the input) into one trainer set up at start;
 * when the load is accepted and the step is below the run's total, one training step runs from the loaded
 * state (as `ampTrain resume` would), so values that load but cannot be trained from show up too. An
 * accepted load overwrites all the state that step reads (the scaler is reset first, for fresh_scaler), so an
 * input's outcome does not depend on the ones before. The trainer computes on one thread (run.threads 1): the
 * checkpoint readers fork a trial child (lib/base/trial.h), and ASan's allocator is not fork-safe with other threads
 * in the process; with the CPU backend's pool workers, a fork on a loaded machine left a child waiting on an
 * allocator lock (a 10 s "timeout" in trial_run, CI 2026-12-05).
 *
 * The seed checkpoint is made at start (LLVMFuzzerInitialize) with the library itself: a 4x4-pixel IDX
 * dataset written into the scratch directory, a conv2d + batchnorm2d + linear model in fp16-dynamic (built with
 * FUZZ_FP8, fuzz_ckpt_fp8: in fp8 with delayed scaling, so the file has /fp8), two optimizer steps, ckpt_save. So it always matches the current format; AMPTRAIN_FUZZ_WRITE_SEED=PATH copies it
 * to PATH (scripts/check/fuzz.sh adds it to the scratch corpus of the raw and resealed harnesses).
 *
 * Oracles (checkpoint.h's contract): a refusal is AMP_ERR_CKPT (or AMP_ERR_INTERNAL) with a message; no
 * HDF5 identifier stays open after a call; an accepted trainer state has step, optimizer step,
 * samples_seen and epoch >= 0 and, with the scaler loaded, a finite positive scale and counters >= 0; with fp8, finite
 * positive scales (scale_inv their reciprocal) and amaxes >= 0 or +Inf (an overflowed step's, as written), never NaN.
 */
#define _DEFAULT_SOURCE
#define _XOPEN_SOURCE 700
#define _POSIX_C_SOURCE 200809L

#include <float.h>
#include <hdf5.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "checkpoint.h" /* ckpt_save, ckpt_verify, ckpt_read_config, ckpt_inspect, ckpt_load_model, ckpt_load_trainer */
#include "config.h"     /* config_parse_string, config_print_yaml, config_free */
#include "fuzz_common.h"
#include "h5compat.h" /* amp_h5l_info, amp_h5_object_info */
#include "train.h" /* trainer_setup, trainer_step, trainer_flush, trainer_check_stability */

/* tests/ckpt_testlib.h is a Criterion helper: its cr_assert* become aborts here, and Criterion itself is
 * kept out (it brings its own main and runner). We use its reseal(). */
#define CRITERION_H_ 1
#define cr_assert(cond, ...) ((cond) ? (void)0 : fuzz_testlib_failed(#cond, __FILE__, __LINE__))
#define cr_assert_eq(a, b, ...) cr_assert((a) == (b))
#define cr_assert_not_null(p, ...) cr_assert((p) != NULL)
#define cr_assert_str_eq(a, b, ...) cr_assert(strcmp((a), (b)) == 0)
static void fuzz_testlib_failed(const char *cond, const char *file, int line)
{
    fprintf(stderr, "fuzz harness: ckpt_testlib.h check failed at %s:%d: %s\n", file, line, cond);
    abort();
}
#include "ckpt_testlib.h" /* reseal */

#ifndef FUZZ_CKPT_MODE
#define FUZZ_CKPT_MODE 2
#endif
#ifndef FUZZ_TRIAL
#define FUZZ_TRIAL 0 /* 1: lib/base/trial.h's child process parses first, as in production (fuzz_ckpt_guarded) */
#endif

#define MAX_OBJECTS 64
#define MAX_EDITS 8

/* ---- the seed run ------------------------------------------------------------------------------- */

#define IMG 4
#define N_TRAIN 8
#define N_TEST 4

static const char SEED_YAML[] = "run:\n"
                                "  name: fuzz\n"
                                "  out_dir: %s/run\n"
                                "  seed: 7\n"
                                "  device: cpu\n"
                                "  threads: 1\n"
                                "  steps: 1000\n"
                                "  log_every: 1\n"
                                "data:\n"
                                "  format: idx\n"
                                "  train_images: %s/train-images\n"
                                "  train_labels: %s/train-labels\n"
                                "  test_images: %s/test-images\n"
                                "  test_labels: %s/test-labels\n"
                                "  batch_size: 4\n"
                                "model:\n"
                                "  layers:\n"
                                "    - {kind: conv2d, name: conv, out: 2, kernel: 3, padding: 1}\n"
                                "    - {kind: batchnorm2d, name: bn}\n"
                                "    - {kind: relu}\n"
                                "    - {kind: flatten}\n"
                                "    - {kind: linear, name: head, out: 3}\n"
                                "    - {kind: cross_entropy}\n"
                                "optim:\n"
                                "  kind: adamw\n"
                                "  lr: 0.01\n"
                                "precision:\n"
#ifdef FUZZ_FP8 /* fuzz_ckpt_fp8: the head's product in fp8, delayed scaling, a 3-step amax history (/fp8) */
                                "  mode: fp8\n"
                                "  fp8: {amax_history_len: 3, keep_bf16: [], min_size: [0, 0]}\n";
#else
                                "  mode: fp16-dynamic\n"
                                "  loss_scale: {growth_interval: 1, hysteresis: 2}\n";
#endif

static void write_idx(const char *path, int ndim, uint32_t n, const uint8_t *payload, size_t plen)
{
    uint8_t buf[16 + N_TRAIN * IMG * IMG];
    uint32_t dims[3] = {n, IMG, IMG};
    uint32_t magic = 0x800u | (uint32_t)ndim;
    size_t len = 0;
    for (int k = 0; k < 4; k++)
        buf[len++] = (uint8_t)(magic >> (24 - 8 * k));
    for (int d = 0; d < ndim; d++)
        for (int k = 0; k < 4; k++)
            buf[len++] = (uint8_t)(dims[d] >> (24 - 8 * k));
    memcpy(buf + len, payload, plen);
    fuzz_write(path, buf, len + plen);
}

static struct {
    struct config cfg;
    struct trainer t;
    char seed_path[600];
    uint8_t *seed;   /* the pristine checkpoint's bytes */
    size_t seed_len;
    char *seed_yaml; /* its /config text */
    char work[600];  /* the file each input becomes */
} g;

static void make_seed(void)
{
    const char *dir = fuzz_scratch("ckpt");
    uint8_t pix[N_TRAIN * IMG * IMG], lab[N_TRAIN];
    for (size_t i = 0; i < sizeof pix; i++)
        pix[i] = (uint8_t)(i * 37 + 11);
    for (int i = 0; i < N_TRAIN; i++)
        lab[i] = (uint8_t)(i % 3);
    write_idx(fuzz_path("train-images"), 3, N_TRAIN, pix, sizeof pix);
    write_idx(fuzz_path("train-labels"), 1, N_TRAIN, lab, sizeof lab);
    write_idx(fuzz_path("test-images"), 3, N_TEST, pix, N_TEST * IMG * IMG);
    write_idx(fuzz_path("test-labels"), 1, N_TEST, lab, N_TEST);
    FUZZ_REQUIRE(mkdir(fuzz_path("run"), 0755) == 0, "mkdir run");

    char yaml[sizeof SEED_YAML + 5 * 600];
    snprintf(yaml, sizeof yaml, SEED_YAML, dir, dir, dir, dir, dir);
    struct amp_error err = {0};
    FUZZ_REQUIRE(config_parse_string(&g.cfg, yaml, strlen(yaml), "seed.yaml", &err) == AMP_OK, "%s", err.msg);
    FUZZ_REQUIRE(trainer_setup(&g.t, &g.cfg, NULL, &err) == AMP_OK, "%s", err.msg);
    for (int s = 0; s < 2; s++) {
        FUZZ_REQUIRE(trainer_step(&g.t, &err) == AMP_OK, "%s", err.msg);
        FUZZ_REQUIRE(trainer_flush(&g.t, &err) == AMP_OK, "%s", err.msg);
    }
    FUZZ_REQUIRE(ckpt_save(&g.t, g.cfg.run.out_dir, 3, -1, g.seed_path, sizeof g.seed_path, &err) == AMP_OK, "%s",
                 err.msg);
    g.seed = fuzz_slurp(g.seed_path, &g.seed_len);
    FUZZ_REQUIRE(g.seed && g.seed_len > 512, "cannot read back %s", g.seed_path);
    snprintf(g.work, sizeof g.work, "%s", fuzz_path("input.h5"));

    /* the seed must load: a refusal here is a broken harness (or a broken writer), not a finding */
    FUZZ_REQUIRE(ckpt_load_trainer(g.seed_path, &g.t, false, &err) == AMP_OK, "the seed does not load: %s", err.msg);
    hid_t f = H5Fopen(g.seed_path, H5F_ACC_RDONLY, H5P_DEFAULT);
    hid_t d = H5Dopen2(f, "config", H5P_DEFAULT), t = H5Dget_type(d);
    size_t n = H5Tget_size(t);
    g.seed_yaml = calloc(n + 1, 1);
    FUZZ_REQUIRE(g.seed_yaml && H5Dread(d, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, g.seed_yaml) >= 0, "reading /config");
    H5Tclose(t);
    H5Dclose(d);
    H5Fclose(f);

    const char *out = getenv("AMPTRAIN_FUZZ_WRITE_SEED");
    if (out && *out)
        fuzz_write(out, g.seed, g.seed_len);
}

/* ---- loading an input --------------------------------------------------------------------------- */

/* A resealed record of the data (/data's digest:KEY attributes, ckpt_check_data) that an edit made disagree with
 * the harness's unchanged files: the loader cannot tell it from data that changed, and refuses it as the contract
 * says for changed data, exit 3 naming the file (docs/checkpoint.md, "Portable checkpoints"). */
static bool data_record_refusal(enum amp_status st, const struct amp_error *err)
{
    return st == AMP_ERR_DATA && (strstr(err->msg, "its contents differ from the file the run that wrote") ||
                                  strstr(err->msg, "read no file under this key") ||
                                  strstr(err->msg, "but the run that wrote"));
}

static void check_refusal(enum amp_status st, const struct amp_error *err, const char *what)
{
    FUZZ_ORACLE(st == AMP_ERR_CKPT || st == AMP_ERR_INTERNAL || data_record_refusal(st, err), "%s returned %d: %s",
                what, (int)st, err->msg);
    FUZZ_ORACLE(err->msg[0] != '\0', "%s refused without a message", what);
}

static void check_no_open_ids(const char *what)
{
    ssize_t n = H5Fget_obj_count(H5F_OBJ_ALL, H5F_OBJ_ALL);
    FUZZ_ORACLE(n == 0, "%zd HDF5 identifiers left open after %s", n, what);
}

/* What a resume that accepted the file may hold (docs/checkpoint.md: every field is a count or a scale). */
static void check_loaded_state(const struct trainer *t, bool fresh_scaler)
{
    FUZZ_ORACLE(t->step >= 0, "accepted /state step %lld", (long long)t->step);
    FUZZ_ORACLE(t->opt.step >= 0, "accepted /optimizer step %lld", (long long)t->opt.step);
    FUZZ_ORACLE(t->samples_seen >= 0, "accepted /state samples_seen %lld", (long long)t->samples_seen);
    FUZZ_ORACLE(t->sampler.epoch >= 0, "accepted /data epoch %lld", (long long)t->sampler.epoch);
    FUZZ_ORACLE(t->scaler.skips_total >= 0, "accepted /scaler skips_total %lld", (long long)t->scaler.skips_total);
    /* fp8 (fuzz_ckpt_fp8): scales finite and > 0 with scale_inv their reciprocal, amaxes >= 0 or +Inf (the amax of a
     * step whose gradients overflowed is recorded as it is; NaN fails >= 0) (the CPU backend's memory is the host's) */
    const struct fp8_state *f8 = &t->model.fp8;
    const struct fp8_group *groups[2] = {&f8->fwd, &f8->bwd};
    for (int g = 0; t->model.has_fp8 && g < 2; g++) {
        for (int i = 0; i < groups[g]->n; i++) {
            float sc = groups[g]->scale[i];
            FUZZ_ORACLE(isfinite(sc) && sc > 0 && groups[g]->scale_inv[i] == 1.0f / sc,
                        "accepted /fp8 scale %g (scale_inv %g) of tensor %d", (double)sc,
                        (double)groups[g]->scale_inv[i], i);
        }
        for (int i = 0; groups[g]->history && i < groups[g]->n * f8->len; i++)
            FUZZ_ORACLE(groups[g]->history[i] >= 0, "accepted /fp8 amax %g", (double)groups[g]->history[i]);
    }
    if (fresh_scaler)
        return;
    const struct scaler *s = &t->scaler;
    FUZZ_ORACLE(isfinite(s->scale) && s->scale > 0, "accepted /scaler scale %g", s->scale);
    FUZZ_ORACLE(s->growth_tracker >= 0, "accepted /scaler growth_tracker %lld", (long long)s->growth_tracker);
    FUZZ_ORACLE(s->hysteresis_left >= 0, "accepted /scaler hysteresis_left %lld", (long long)s->hysteresis_left);
    FUZZ_ORACLE(s->consecutive_skips >= 0, "accepted /scaler consecutive_skips %lld",
                (long long)s->consecutive_skips);
}

static void load_all(const char *path, bool fresh_scaler)
{
    struct amp_error err = {0};
    struct ckpt_info info;
    enum amp_status st = ckpt_verify(path, &info, &err);
    FUZZ_NOTE("ckpt_verify: %s", st == AMP_OK ? "accepted" : err.msg);
    if (st != AMP_OK)
        check_refusal(st, &err, "ckpt_verify");
    check_no_open_ids("ckpt_verify");
    if (st != AMP_OK)
        return; /* the others open it the same way first */

    struct config cfg;
    config_defaults(&cfg);
    memset(&err, 0, sizeof err);
    st = ckpt_read_config(path, &cfg, &err);
    FUZZ_NOTE("ckpt_read_config: %s", st == AMP_OK ? "accepted" : err.msg);
    if (st == AMP_OK)
        config_print_yaml(&cfg, fuzz_devnull());
    else
        check_refusal(st, &err, "ckpt_read_config");
    config_free(&cfg);
    check_no_open_ids("ckpt_read_config");

    memset(&err, 0, sizeof err);
    st = ckpt_inspect(path, fuzz_devnull(), &err);
    FUZZ_NOTE("ckpt_inspect: %s", st == AMP_OK ? "accepted" : err.msg);
    if (st != AMP_OK)
        check_refusal(st, &err, "ckpt_inspect");
    check_no_open_ids("ckpt_inspect");

    memset(&err, 0, sizeof err);
    st = ckpt_load_model(path, &g.t.model, &err);
    FUZZ_NOTE("ckpt_load_model: %s", st == AMP_OK ? "accepted" : err.msg);
    if (st != AMP_OK)
        check_refusal(st, &err, "ckpt_load_model");
    check_no_open_ids("ckpt_load_model");

    /* An accepted load sets everything the training step reads, but for the scaler when fresh_scaler asks for
     * a new one: as in a resumed run, that one starts from its init, not from the previous input's. */
    scaler_init(&g.t.scaler, &g.cfg.precision);
    memset(&err, 0, sizeof err);
    st = ckpt_load_trainer(path, &g.t, fresh_scaler, &err);
    FUZZ_NOTE("ckpt_load_trainer (fresh_scaler %d): %s", fresh_scaler, st == AMP_OK ? "accepted" : err.msg);
    check_no_open_ids("ckpt_load_trainer");
    if (st != AMP_OK) {
        check_refusal(st, &err, "ckpt_load_trainer");
        return;
    }
    check_loaded_state(&g.t, fresh_scaler);
    /* Train on from there, as `ampTrain resume` would. */
    if (g.t.step < g.t.total_steps) {
        memset(&err, 0, sizeof err);
        st = trainer_step(&g.t, &err);
        if (st == AMP_OK)
            st = trainer_flush(&g.t, &err);
        for (int64_t i = 0; st == AMP_OK && i < g.t.nrecs; i++)
            trainer_check_stability(&g.t, &g.t.recs[i], &err);
        FUZZ_NOTE("one training step from it: %s", st == AMP_OK ? "done" : err.msg);
    }
}

/* ---- the edit script (mode 2) ------------------------------------------------------------------ */

struct object {
    char name[128];
    bool dataset;
    int ndim;
    hsize_t dims[8];
    hsize_t numel;
};

static struct object objects[MAX_OBJECTS];
static int nobjects;

static herr_t list_cb(hid_t loc, const char *name, const amp_h5l_info *info, void *data)
{
    (void)info;
    (void)data;
    if (nobjects == MAX_OBJECTS)
        return 1;
    struct object *o = &objects[nobjects];
    snprintf(o->name, sizeof o->name, "%s", name);
    H5O_info_t oi;
    if (amp_h5_object_info(loc, name, &oi) < 0)
        return 0;
    o->dataset = oi.type == H5O_TYPE_DATASET;
    o->numel = 1;
    if (o->dataset) {
        hid_t d = H5Dopen2(loc, name, H5P_DEFAULT), sp = H5Dget_space(d);
        o->ndim = H5Sget_simple_extent_ndims(sp);
        FUZZ_REQUIRE(o->ndim >= 0 && o->ndim <= 8, "seed dataset %s has rank %d", name, o->ndim);
        H5Sget_simple_extent_dims(sp, o->dims, NULL);
        for (int i = 0; i < o->ndim; i++)
            o->numel *= o->dims[i];
        H5Sclose(sp);
        H5Dclose(d);
    }
    nobjects++;
    return 0;
}

static void list_objects(void)
{
    hid_t f = H5Fopen(g.seed_path, H5F_ACC_RDONLY, H5P_DEFAULT);
    FUZZ_REQUIRE(f >= 0, "cannot open the seed %s", g.seed_path);
    H5Lvisit(f, H5_INDEX_NAME, H5_ITER_INC, list_cb, NULL);
    H5Fclose(f);
    FUZZ_REQUIRE(nobjects > 4, "the seed lists only %d objects", nobjects);
}

/* Attributes ckpt_save writes: group ("" = root) and name. */
static const char *const ATTRS[][2] = {
    {"", "format"},          {"", "format_version"},        {"", "amptrain_version"},   {"", "created"},
    {"state", "step"},       {"state", "micro_step"},       {"state", "epoch"},         {"state", "cursor"},
    {"state", "samples_seen"}, {"state", "world_size"},     {"state", "skips_total"},   {"state", "total_steps"},
    {"state", "precision_mode"}, {"optimizer", "step"},     {"optimizer", "kind"},      {"scaler", "mode"},
    {"scaler", "scale"},     {"scaler", "growth_tracker"},  {"scaler", "hysteresis_left"},
    {"scaler", "consecutive_skips"}, {"scaler", "skips_total"}, {"scaler", "last_overflow_step"},
    {"data", "epoch"},       {"data", "cursor"},            {"data", "seed"},           {"data", "shuffle"},
    {"rng", "seed"},         {"rng", "note"},
};
#define NATTRS (sizeof ATTRS / sizeof ATTRS[0])

static const int64_t I64S[] = {0, 1, -1, -5, 2, 3, 4, INT64_MIN, INT64_MAX, INT32_MAX, INT32_MIN,
                               (INT64_C(1) << 53) + 1, 1000, 999, INT64_C(1) << 62, -(INT64_C(1) << 62)};
static const double F64S[] = {NAN, -NAN, INFINITY, -INFINITY, 0.0, -0.0, -5.0, 1e-300,
                              1e300, DBL_MAX, DBL_MIN / 4, 0.5, 65536.0, 9.3e18, -9.3e18, 2.0};

static int64_t pick_i64(struct fuzz_in *in)
{
    uint8_t b = fin_u8(in);
    return b < 240 ? I64S[b % (sizeof I64S / sizeof I64S[0])] : (int64_t)fin_u64(in);
}

static double pick_f64(struct fuzz_in *in)
{
    uint8_t b = fin_u8(in);
    return b < 240 ? F64S[b % (sizeof F64S / sizeof F64S[0])] : fin_f64_bits(in);
}

/* An integer file type: int64 first, then other sizes, signedness and byte orders. */
static hid_t int_type(uint8_t i)
{
    switch (i % 8) {
    case 0: return H5T_STD_I64LE;
    case 1: return H5T_STD_I64BE;
    case 2: return H5T_STD_I32LE;
    case 3: return H5T_STD_U64LE;
    case 4: return H5T_STD_I8LE;
    case 5: return H5T_STD_U8LE;
    case 6: return H5T_STD_I16BE;
    default: return H5T_STD_U32LE;
    }
}

/* A value of some HDF5 type and shape, built from the script: what an attribute or /config becomes. */
struct value {
    hid_t ftype, mtype, space; /* file type, memory type, dataspace (all owned) */
    unsigned char buf[4096];
    const void *vlen[9];       /* variable-length strings point here */
    bool no_write;             /* null dataspace, or left to the fill value */
};

static void value_free(struct value *v)
{
    if (v->ftype >= 0)
        H5Tclose(v->ftype);
    if (v->mtype >= 0)
        H5Tclose(v->mtype);
    if (v->space >= 0)
        H5Sclose(v->space);
}

static hid_t fixed_str(size_t len, H5T_cset_t cset, H5T_str_t pad)
{
    hid_t t = H5Tcopy(H5T_C_S1);
    H5Tset_size(t, len ? len : 1);
    H5Tset_cset(t, cset);
    H5Tset_strpad(t, pad);
    return t;
}

static hid_t vlen_str(void)
{
    hid_t t = H5Tcopy(H5T_C_S1);
    H5Tset_size(t, H5T_VARIABLE);
    H5Tset_cset(t, H5T_CSET_UTF8);
    return t;
}

static hid_t space_of(hsize_t n, int rank)
{
    if (rank == 0)
        return H5Screate(H5S_SCALAR);
    hsize_t dims[9];
    for (int i = 0; i < rank; i++)
        dims[i] = i == rank - 1 ? n : 1;
    return H5Screate_simple(rank, dims, NULL);
}

/* Fill v with `count` strings of `text` (fixed size len each, or variable length). */
static void fill_strings(struct value *v, const char *text, size_t len, size_t count, bool vlen)
{
    if (vlen) {
        for (size_t i = 0; i < count && i < 9; i++)
            v->vlen[i] = text;
        return;
    }
    for (size_t i = 0; i < count && (i + 1) * len <= sizeof v->buf; i++)
        memcpy(v->buf + i * len, text, len);
}

/* An attribute value (kind from the script). */
static void make_attr_value(struct value *v, struct fuzz_in *in)
{
    static const hsize_t COUNTS[] = {0, 1, 2, 9};
    memset(v->buf, 0, sizeof v->buf);
    v->ftype = v->mtype = v->space = -1;
    v->no_write = false;
    uint8_t kind = fin_u8(in) % 18;
    switch (kind) {
    case 0: case 1: { /* int64 scalar, another integer type, or big-endian */
        v->ftype = H5Tcopy(int_type(kind == 0 ? 0 : fin_u8(in)));
        v->mtype = H5Tcopy(H5T_NATIVE_INT64);
        v->space = H5Screate(H5S_SCALAR);
        int64_t x = pick_i64(in);
        memcpy(v->buf, &x, sizeof x);
        break;
    }
    case 2: case 3: { /* float64 or float32 scalar (NaN, inf, 1e300, ...) */
        v->ftype = H5Tcopy(kind == 2 ? H5T_IEEE_F64LE : (fin_u8(in) & 1) ? H5T_IEEE_F32BE : H5T_IEEE_F32LE);
        v->mtype = H5Tcopy(H5T_NATIVE_DOUBLE);
        v->space = H5Screate(H5S_SCALAR);
        double x = pick_f64(in);
        memcpy(v->buf, &x, sizeof x);
        break;
    }
    case 4: case 5: { /* fixed-length string, ASCII or UTF-8, some padding, text from the script */
        const uint8_t *s;
        size_t len = fin_bytes(in, 300, &s);
        static const H5T_str_t PADS[] = {H5T_STR_NULLPAD, H5T_STR_NULLTERM, H5T_STR_SPACEPAD};
        v->ftype = fixed_str(len, kind == 4 ? H5T_CSET_ASCII : H5T_CSET_UTF8, PADS[fin_u8(in) % 3]);
        v->mtype = H5Tcopy(v->ftype);
        v->space = H5Screate(H5S_SCALAR);
        memcpy(v->buf, s, len);
        break;
    }
    case 6: { /* variable-length string */
        const uint8_t *s;
        size_t len = fin_bytes(in, 200, &s);
        memcpy(v->buf, s, len);
        v->buf[len] = '\0';
        v->ftype = vlen_str();
        v->mtype = vlen_str();
        v->space = H5Screate(H5S_SCALAR);
        v->vlen[0] = v->buf;
        break;
    }
    case 7: case 8: { /* an array of 0, 1, 2 or 9 int64 or float64, rank 1 or 2..9 */
        hsize_t n = COUNTS[fin_u8(in) % 4];
        int rank = 1 + fin_u8(in) % 9;
        v->space = space_of(n, rank);
        if (kind == 7) {
            v->ftype = H5Tcopy(H5T_STD_I64LE);
            v->mtype = H5Tcopy(H5T_NATIVE_INT64);
            for (hsize_t i = 0; i < n; i++) {
                int64_t x = pick_i64(in);
                memcpy(v->buf + 8 * i, &x, 8);
            }
        } else {
            v->ftype = H5Tcopy(H5T_IEEE_F64LE);
            v->mtype = H5Tcopy(H5T_NATIVE_DOUBLE);
            for (hsize_t i = 0; i < n; i++) {
                double x = pick_f64(in);
                memcpy(v->buf + 8 * i, &x, 8);
            }
        }
        break;
    }
    case 9: case 10: { /* an array of 0, 2 or 9 strings, fixed or variable length */
        hsize_t n = COUNTS[fin_u8(in) % 4];
        const uint8_t *s;
        size_t len = fin_bytes(in, 64, &s);
        char text[65] = "";
        memcpy(text, s, len);
        v->space = space_of(n, 1);
        if (kind == 9) {
            v->ftype = fixed_str(len ? len : 1, H5T_CSET_UTF8, H5T_STR_NULLPAD);
            v->mtype = H5Tcopy(v->ftype);
            fill_strings(v, text, len ? len : 1, n, false);
        } else {
            v->ftype = vlen_str();
            v->mtype = vlen_str();
            memcpy(v->buf, text, len + 1);
            fill_strings(v, (const char *)v->buf, 0, n, true);
        }
        break;
    }
    case 11: /* null dataspace */
        v->ftype = H5Tcopy(H5T_STD_I64LE);
        v->mtype = H5Tcopy(H5T_NATIVE_INT64);
        v->space = H5Screate(H5S_NULL);
        v->no_write = true;
        break;
    case 12: { /* compound {int64 a; double b} */
        v->ftype = H5Tcreate(H5T_COMPOUND, 16);
        H5Tinsert(v->ftype, "a", 0, H5T_NATIVE_INT64);
        H5Tinsert(v->ftype, "b", 8, H5T_NATIVE_DOUBLE);
        v->mtype = H5Tcopy(v->ftype);
        v->space = H5Screate(H5S_SCALAR);
        int64_t a = pick_i64(in);
        double b = pick_f64(in);
        memcpy(v->buf, &a, 8);
        memcpy(v->buf + 8, &b, 8);
        break;
    }
    case 13: { /* array datatype int64[2] or int64[9] in a scalar space */
        hsize_t n = (fin_u8(in) & 1) ? 9 : 2;
        v->ftype = H5Tarray_create2(H5T_NATIVE_INT64, 1, &n);
        v->mtype = H5Tcopy(v->ftype);
        v->space = H5Screate(H5S_SCALAR);
        for (hsize_t i = 0; i < n; i++) {
            int64_t x = pick_i64(in);
            memcpy(v->buf + 8 * i, &x, 8);
        }
        break;
    }
    case 14: { /* enum of int */
        v->ftype = H5Tenum_create(H5T_NATIVE_INT);
        int a = 0, b = 1;
        H5Tenum_insert(v->ftype, "fp32", &a);
        H5Tenum_insert(v->ftype, "bf16", &b);
        v->mtype = H5Tcopy(v->ftype);
        v->space = H5Screate(H5S_SCALAR);
        int x = fin_u8(in) & 1;
        memcpy(v->buf, &x, sizeof x);
        break;
    }
    case 15: /* opaque or bitfield */
        v->ftype = (fin_u8(in) & 1) ? H5Tcreate(H5T_OPAQUE, 8) : H5Tcopy(H5T_STD_B64LE);
        v->mtype = H5Tcopy(v->ftype);
        v->space = H5Screate(H5S_SCALAR);
        for (int i = 0; i < 8; i++)
            v->buf[i] = fin_u8(in);
        break;
    case 16: { /* a variable-length sequence of int64 */
        hvl_t *vl = (hvl_t *)(void *)v->buf;
        int64_t *xs = (int64_t *)(void *)(v->buf + 64);
        vl->len = fin_u8(in) % 4;
        vl->p = xs;
        for (size_t i = 0; i < vl->len; i++)
            xs[i] = pick_i64(in);
        v->ftype = H5Tvlen_create(H5T_NATIVE_INT64);
        v->mtype = H5Tcopy(v->ftype);
        v->space = H5Screate(H5S_SCALAR);
        break;
    }
    default: { /* a reference to the root group */
        v->ftype = H5Tcopy(H5T_STD_REF_OBJ);
        v->mtype = H5Tcopy(H5T_STD_REF_OBJ);
        v->space = H5Screate(H5S_SCALAR);
        v->no_write = true;
        break;
    }
    }
}

static void write_value(hid_t obj, bool attr, const struct value *v)
{
    if (v->no_write)
        return;
    bool vlen = H5Tis_variable_str(v->mtype) > 0;
    const void *src = vlen ? (const void *)v->vlen : (const void *)v->buf;
    if (attr)
        H5Awrite(obj, v->mtype, src);
    else
        H5Dwrite(obj, v->mtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, src);
}

static void edit_attr(hid_t f, struct fuzz_in *in, bool remove_only)
{
    const char *const *a = ATTRS[fin_u8(in) % NATTRS];
    hid_t loc = a[0][0] ? H5Oopen(f, a[0], H5P_DEFAULT) : H5Oopen(f, "/", H5P_DEFAULT);
    if (loc < 0)
        return;
    if (H5Aexists(loc, a[1]) > 0)
        H5Adelete(loc, a[1]);
    FUZZ_NOTE("edit: %s attribute /%s %s", remove_only ? "delete" : "replace", a[0], a[1]);
    if (!remove_only) {
        struct value v;
        make_attr_value(&v, in);
        hid_t id = H5Acreate2(loc, a[1], v.ftype, v.space, H5P_DEFAULT, H5P_DEFAULT);
        if (id >= 0) {
            write_value(id, true, &v);
            H5Aclose(id);
        }
        value_free(&v);
    }
    H5Oclose(loc);
}

static hid_t lcpl(void)
{
    hid_t p = H5Pcreate(H5P_LINK_CREATE);
    H5Pset_create_intermediate_group(p, 1);
    return p;
}

static const struct object *pick_object(struct fuzz_in *in, bool dataset)
{
    int start = fin_u8(in) % nobjects;
    for (int k = 0; k < nobjects; k++) {
        const struct object *o = &objects[(start + k) % nobjects];
        if (!dataset || (o->dataset && strcmp(o->name, "config") != 0))
            return o;
    }
    return &objects[start];
}

/* Replace a tensor by one of another dtype, rank, shape, layout or contents. */
static void edit_tensor(hid_t f, struct fuzz_in *in)
{
    const struct object *o = pick_object(in, true);
    if (H5Lexists(f, o->name, H5P_DEFAULT) > 0)
        H5Ldelete(f, o->name, H5P_DEFAULT);
    int rank = o->ndim;
    hsize_t dims[9];
    memcpy(dims, o->dims, sizeof o->dims);
    uint8_t kind = fin_u8(in) % 14;
    FUZZ_NOTE("edit: replace tensor /%s (kind %d)", o->name, kind);
    hid_t ftype = H5Tcopy(H5T_IEEE_F32LE), dcpl = H5Pcreate(H5P_DATASET_CREATE), space;
    bool write = true, as_group = false;
    switch (kind) {
    case 0: H5Tclose(ftype); ftype = H5Tcopy(H5T_IEEE_F64LE); break;
    case 1: H5Tclose(ftype); ftype = H5Tcopy(H5T_STD_I32LE); break;
    case 2: H5Tclose(ftype); ftype = H5Tcopy(H5T_IEEE_F32BE); break;
    case 3: H5Tclose(ftype); ftype = fixed_str(8, H5T_CSET_ASCII, H5T_STR_NULLPAD); write = false; break;
    case 4:
        H5Tclose(ftype);
        ftype = H5Tcreate(H5T_COMPOUND, 8);
        H5Tinsert(ftype, "re", 0, H5T_NATIVE_FLOAT);
        H5Tinsert(ftype, "im", 4, H5T_NATIVE_FLOAT);
        write = false;
        break;
    case 5: rank = 0; break;
    case 6: /* rank 9: (1, ..., 1, numel) */
        rank = 9;
        for (int i = 0; i < 9; i++)
            dims[i] = i == 8 ? o->numel : 1;
        break;
    case 7: { /* another shape: dims reversed, one grown or shrunk, a dim added or dropped, or empty */
        uint8_t how = fin_u8(in) % 5;
        if (how == 0)
            for (int i = 0; i < rank / 2; i++) {
                hsize_t t = dims[i];
                dims[i] = dims[rank - 1 - i];
                dims[rank - 1 - i] = t;
            }
        else if (how == 1 && rank > 0)
            dims[fin_u8(in) % rank] += 1 + fin_u8(in) % 3;
        else if (how == 2 && rank > 0)
            dims[fin_u8(in) % rank] /= 2;
        else if (how == 3 && rank < 8)
            dims[rank++] = 1;
        else if (rank > 1)
            rank--;
        break;
    }
    case 8: break; /* same shape, values from the script (NaN, inf, negative, ...) */
    case 9: /* same shape, compact or contiguous layout, or chunked with deflate; maybe never written */
        switch (fin_u8(in) % 3) {
        case 0: H5Pset_layout(dcpl, H5D_COMPACT); break;
        case 1: H5Pset_layout(dcpl, H5D_CONTIGUOUS); break;
        default: {
            hsize_t chunk[8];
            for (int i = 0; i < rank; i++)
                chunk[i] = 1;
            if (rank > 0) {
                H5Pset_chunk(dcpl, rank, chunk);
                H5Pset_deflate(dcpl, 1);
            }
        }
        }
        write = fin_u8(in) & 1;
        break;
    case 10: rank = -1; write = false; break; /* null dataspace */
    case 11: H5Tclose(ftype); ftype = vlen_str(); write = false; break;
    case 12: H5Tclose(ftype); ftype = H5Tcopy(H5T_STD_I64LE); break;
    default: as_group = true; break;
    }
    hid_t lp = lcpl();
    if (as_group) {
        hid_t gr = H5Gcreate2(f, o->name, lp, H5P_DEFAULT, H5P_DEFAULT);
        if (gr >= 0)
            H5Gclose(gr);
    } else {
        space = rank < 0 ? H5Screate(H5S_NULL) : rank == 0 ? H5Screate(H5S_SCALAR) : H5Screate_simple(rank, dims, NULL);
        hid_t d = H5Dcreate2(f, o->name, ftype, space, lp, dcpl, H5P_DEFAULT);
        hssize_t n = rank < 0 ? 0 : H5Sget_simple_extent_npoints(space);
        if (d >= 0 && write && n > 0 && n <= 4096) {
            double *vals = malloc((size_t)n * sizeof *vals);
            uint8_t pattern = fin_u8(in);
            for (hssize_t i = 0; vals && i < n; i++)
                vals[i] = pattern < 128 ? F64S[(pattern + i) % 16] : (double)(int8_t)fin_u8(in) / 8.0;
            if (vals)
                H5Dwrite(d, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, vals);
            free(vals);
        }
        if (d >= 0)
            H5Dclose(d);
        H5Sclose(space);
    }
    H5Pclose(lp);
    H5Pclose(dcpl);
    H5Tclose(ftype);
}

/* Replace /config by an array of strings, a variable-length string, a number, a group or other text. */
static void edit_config(hid_t f, struct fuzz_in *in)
{
    if (H5Lexists(f, "config", H5P_DEFAULT) > 0)
        H5Ldelete(f, "config", H5P_DEFAULT);
    size_t ylen = strlen(g.seed_yaml);
    char *text = malloc(ylen + 4096 + 1);
    if (!text)
        return;
    memcpy(text, g.seed_yaml, ylen + 1);
    size_t len = ylen;
    const uint8_t *s;
    size_t n;
    hid_t ftype = -1, mtype = -1, space = -1;
    const void *src = text;
    const char *vl[9];
    uint8_t kind = fin_u8(in) % 12;
    FUZZ_NOTE("edit: replace /config (kind %d)", kind);
    switch (kind) {
    case 0: /* an array of 2 or 9 fixed-length strings, each the whole YAML */
    case 1: { /* ... or of variable-length ones */
        hsize_t count = (fin_u8(in) & 1) ? 9 : 2;
        space = H5Screate_simple(1, &count, NULL);
        if (kind == 0) {
            ftype = fixed_str(len, H5T_CSET_UTF8, H5T_STR_NULLPAD);
            char *many = calloc(count, len);
            for (hsize_t i = 0; many && i < count; i++)
                memcpy(many + i * len, text, len);
            free(text);
            text = many;
            src = many;
        } else {
            ftype = vlen_str();
            for (hsize_t i = 0; i < count; i++)
                vl[i] = text;
            src = vl;
        }
        break;
    }
    case 2: /* one variable-length string */
        ftype = vlen_str();
        space = H5Screate(H5S_SCALAR);
        vl[0] = text;
        src = vl;
        break;
    case 3: { /* a number */
        static double x;
        x = pick_f64(in);
        ftype = H5Tcopy(H5T_IEEE_F64LE);
        mtype = H5Tcopy(H5T_NATIVE_DOUBLE);
        space = H5Screate(H5S_SCALAR);
        src = &x;
        break;
    }
    case 4: /* other text altogether */
        n = fin_bytes(in, 4096, &s);
        memcpy(text, s, n);
        len = n;
        break;
    case 5: case 6: { /* the YAML with bytes of the script spliced in (kind 6: appended) */
        size_t at = kind == 6 ? ylen : (size_t)(fin_u8(in) | fin_u8(in) << 8) % (ylen + 1);
        size_t cut = kind == 6 ? 0 : fin_u8(in) % 16;
        if (at + cut > ylen)
            cut = ylen - at;
        n = fin_bytes(in, 512, &s);
        memmove(text + at + n, text + at + cut, ylen - at - cut + 1);
        memcpy(text + at, s, n);
        len = ylen - cut + n;
        break;
    }
    case 7: /* one byte, or an empty string (size 1, a NUL) */
        len = 1;
        text[0] = (fin_u8(in) & 1) ? '\0' : '{';
        break;
    case 8: { /* an array of 0 or 1 string */
        hsize_t count = fin_u8(in) & 1;
        space = H5Screate_simple(1, &count, NULL);
        break;
    }
    case 9: /* ASCII, space- or NUL-terminated padding */
        ftype = fixed_str(len + fin_u8(in) % 4, (fin_u8(in) & 1) ? H5T_CSET_ASCII : H5T_CSET_UTF8,
                          (fin_u8(in) & 1) ? H5T_STR_SPACEPAD : H5T_STR_NULLTERM);
        text[len] = '\0';
        memset(text + len, 0, 4);
        break;
    case 10: { /* a 2-D float dataset */
        hsize_t dims[2] = {2, 3};
        static double zeros[6];
        ftype = H5Tcopy(H5T_IEEE_F32LE);
        mtype = H5Tcopy(H5T_NATIVE_DOUBLE);
        space = H5Screate_simple(2, dims, NULL);
        src = zeros;
        break;
    }
    default: { /* a group */
        hid_t gr = H5Gcreate2(f, "config", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
        if (gr >= 0)
            H5Gclose(gr);
        free(text);
        return;
    }
    }
    if (ftype < 0)
        ftype = fixed_str(len, H5T_CSET_UTF8, H5T_STR_NULLPAD);
    if (mtype < 0)
        mtype = H5Tcopy(ftype);
    if (space < 0)
        space = H5Screate(H5S_SCALAR);
    hid_t d = H5Dcreate2(f, "config", ftype, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    if (d >= 0 && H5Sget_simple_extent_npoints(space) > 0)
        H5Dwrite(d, mtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, src);
    if (d >= 0)
        H5Dclose(d);
    H5Sclose(space);
    H5Tclose(mtype);
    H5Tclose(ftype);
    free(text);
}

/* Delete an object, or put a group, a dataset or a (hard, soft, external) link in its place. */
static void edit_link(hid_t f, struct fuzz_in *in)
{
    const struct object *o = pick_object(in, false);
    if (H5Lexists(f, o->name, H5P_DEFAULT) > 0)
        H5Ldelete(f, o->name, H5P_DEFAULT);
    const struct object *other = pick_object(in, false);
    hid_t lp = lcpl();
    uint8_t kind = fin_u8(in) % 6;
    FUZZ_NOTE("edit: replace link /%s (kind %d, other /%s)", o->name, kind, other->name);
    switch (kind) {
    case 0: break; /* deleted */
    case 1: {
        hid_t gr = H5Gcreate2(f, o->name, lp, H5P_DEFAULT, H5P_DEFAULT);
        if (gr >= 0)
            H5Gclose(gr);
        break;
    }
    case 2: { /* a scalar int64 dataset */
        hid_t sp = H5Screate(H5S_SCALAR);
        hid_t d = H5Dcreate2(f, o->name, H5T_STD_I64LE, sp, lp, H5P_DEFAULT, H5P_DEFAULT);
        if (d >= 0)
            H5Dclose(d);
        H5Sclose(sp);
        break;
    }
    case 3: H5Lcreate_hard(f, other->name, f, o->name, lp, H5P_DEFAULT); break;
    case 4: H5Lcreate_soft((fin_u8(in) & 1) ? other->name : "/nowhere", f, o->name, lp, H5P_DEFAULT); break;
    default: H5Lcreate_external("no-such-file.h5", "/model", f, o->name, lp, H5P_DEFAULT); break;
    }
    H5Pclose(lp);
}

static void apply_edits(const uint8_t *data, size_t size)
{
    fuzz_write(g.work, g.seed, g.seed_len);
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
    H5Pset_fclose_degree(fapl, H5F_CLOSE_STRONG);
    hid_t f = H5Fopen(g.work, H5F_ACC_RDWR, fapl);
    H5Pclose(fapl);
    FUZZ_REQUIRE(f >= 0, "cannot open the copy of the seed");
    struct fuzz_in in = {data, size};
    for (int k = 0; k < MAX_EDITS && in.n > 0; k++) {
        switch (fin_u8(&in) % 8) {
        case 0: case 1: edit_attr(f, &in, false); break;
        case 2: edit_attr(f, &in, true); break;
        case 3: case 4: edit_tensor(f, &in); break;
        case 5: edit_config(f, &in); break;
        default: edit_link(f, &in); break;
        }
    }
    FUZZ_REQUIRE(H5Fclose(f) >= 0, "closing the edited copy");
    FUZZ_REQUIRE(H5Fget_obj_count(H5F_OBJ_ALL, H5F_OBJ_ALL) == 0, "the edit left HDF5 identifiers open");
    reseal(g.work);
}

/* ---- libFuzzer entry points --------------------------------------------------------------------- */

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    setenv("OPENBLAS_NUM_THREADS", "1", 1);
    fuzz_set_trials(FUZZ_TRIAL);
    fuzz_silence_stdout();
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
    /* No HDF5 free lists: freed blocks go back to malloc at once. Blocks parked in a list make an input look
     * as if it leaked (more mallocs than frees), and libFuzzer then stops the world for a LeakSanitizer scan
     * after almost every input (ten times slower); and ASan sees a use-after-free inside HDF5. */
    H5set_free_list_limits(0, 0, 0, 0, 0, 0);
    make_seed();
    list_objects();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    bool fresh_scaler = size & 1;
#if FUZZ_CKPT_MODE == 0
    fuzz_write(g.work, data, size);
#elif FUZZ_CKPT_MODE == 1
    fuzz_write(g.work, data, size);
    if (size >= 512) {
        int fd = open(g.work, O_WRONLY);
        FUZZ_REQUIRE(fd >= 0, "reopening %s", g.work);
        static const unsigned char head[12] = {'A', 'M', 'P', 'T', 'C', 'K', 'P', 'T', 1, 0, 0, 0};
        FUZZ_REQUIRE(pwrite(fd, head, sizeof head, 0) == (ssize_t)sizeof head, "writing the magic");
        close(fd);
        reseal(g.work);
    }
#else
    apply_edits(data, size);
#endif
    load_all(g.work, fresh_scaler);
    /* HDF5 keeps the last error stack (allocated) until its next call: free it within this input, or every
     * refusal would look like a possible leak to libFuzzer and cost a LeakSanitizer scan. */
    H5Eclear2(H5E_DEFAULT);
    return 0;
}
