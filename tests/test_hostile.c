/*
 * test_hostile.c — checkpoints edited through HDF5 and re-sealed (so the whole-file CRC passes and only
 * the reader's own checks stand between the file and the trainer; docs/reliability.md, "Validated contents"):
 * attributes and datasets of the wrong class, rank or size, values out of range, non-finite tensors,
 * and the string encodings h5py writes, which must load.
 * Every case is a refusal with exit 4 naming the object, never a crash (the ASan build runs these too).
 */
#define _POSIX_C_SOURCE 200809L
#include "ckpt_testlib.h"

#include <math.h>
#include <stdarg.h>

#include "checkpoint.h"

static char ckpt10[512];

/* 10 fp16-dynamic steps of the small model (the scaler's state is checked against its settings). */
static void setup_base(void)
{
    make_scratch();
    struct result r = amp("run configs/fashion_mlp.yaml " SMALL " precision.mode=fp16-dynamic run.steps=10 "
                          "run.out_dir=%s/base",
                          scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    snprintf(ckpt10, sizeof ckpt10, "%s/base/ckpt-10.h5", scratch);
}

TestSuite(hostile, .init = setup_base, .fini = remove_scratch);

/* A fresh copy of the base checkpoint to edit. */
static const char *copy_of_base(const char *name)
{
    static char p[600];
    snprintf(p, sizeof p, "%s/%s.h5", scratch, name);
    copy_file(ckpt10, p);
    return p;
}

/* Replace attribute OBJ/NAME by one of `type` over `rank` dims (0: scalar) holding buf, and re-seal. */
static void set_attr(const char *path, const char *obj, const char *name, hid_t type, int rank, const hsize_t *dims,
                     const void *buf)
{
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    cr_assert(f >= 0);
    hid_t o = H5Oopen(f, obj, H5P_DEFAULT);
    cr_assert(o >= 0, "%s", obj);
    if (H5Aexists(o, name) > 0)
        cr_assert(H5Adelete(o, name) >= 0);
    hid_t sp = rank == 0 ? H5Screate(H5S_SCALAR) : H5Screate_simple(rank, dims, NULL);
    hid_t a = H5Acreate2(o, name, type, sp, H5P_DEFAULT, H5P_DEFAULT);
    cr_assert(a >= 0 && H5Awrite(a, type, buf) >= 0, "%s/%s", obj, name);
    H5Aclose(a);
    H5Sclose(sp);
    H5Oclose(o);
    H5Fclose(f);
    reseal(path);
}

/* Replace dataset NAME by one of `type` over `rank` dims (0: scalar) holding buf, and re-seal. */
static void set_dataset(const char *path, const char *name, hid_t type, int rank, const hsize_t *dims,
                        const void *buf)
{
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    cr_assert(f >= 0);
    if (H5Lexists(f, name, H5P_DEFAULT) > 0)
        cr_assert(H5Ldelete(f, name, H5P_DEFAULT) >= 0);
    hid_t sp = rank == 0 ? H5Screate(H5S_SCALAR) : H5Screate_simple(rank, dims, NULL);
    hid_t d = H5Dcreate2(f, name, type, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    cr_assert(d >= 0 && H5Dwrite(d, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf) >= 0, "%s", name);
    H5Dclose(d);
    H5Sclose(sp);
    H5Fclose(f);
    reseal(path);
}

static void set_i64(const char *path, const char *obj, const char *name, int64_t v)
{
    set_attr(path, obj, name, H5T_NATIVE_INT64, 0, NULL, &v);
}

static void set_f64(const char *path, const char *obj, const char *name, double v)
{
    set_attr(path, obj, name, H5T_NATIVE_DOUBLE, 0, NULL, &v);
}

/* `cmd` on the file exits 4 and says `want` (and a hint). */
static void refused(const char *cmd, const char *path, const char *want)
{
    struct result r = amp("%s %s", cmd, path);
    cr_assert_eq(r.code, 4, "%s %s: exit %d, want 4:\n%s", cmd, path, r.code, r.out);
    cr_assert(strstr(r.out, want), "%s: want '%s' in:\n%s", cmd, want, r.out);
    cr_assert(strstr(r.out, "hint: "), "%s", r.out);
}

/* The base checkpoint's model tensor fc1/bias: 32 floats. */
#define BIAS "model/fc1/bias"

Test(hostile, an_array_where_one_value_belongs_is_refused_naming_the_attribute)
{
    int64_t three[3] = {10, 11, 12};
    hsize_t n3 = 3, n2 = 2, n4 = 4;
    const char *p = copy_of_base("step_array");
    set_attr(p, "state", "step", H5T_NATIVE_INT64, 1, &n3, three);
    refused("resume", p, "attribute /state/step is an array of 3 values");
    refused("inspect", p, "attribute /state/step is an array of 3 values");

    p = copy_of_base("version_array");
    set_attr(p, "/", "format_version", H5T_NATIVE_INT64, 1, &n2, three);
    refused("eval", p, "attribute /format_version is an array of 2 values");

    double scales[4] = {1, 2, 4, 8};
    p = copy_of_base("scale_array");
    set_attr(p, "scaler", "scale", H5T_NATIVE_DOUBLE, 1, &n4, scales);
    refused("resume", p, "attribute /scaler/scale is an array of 4 values");

    p = copy_of_base("optimizer_step_array");
    set_attr(p, "optimizer", "step", H5T_NATIVE_INT64, 1, &n3, three);
    refused("resume", p, "attribute /optimizer/step is an array of 3 values");

    p = copy_of_base("cursor_array");
    set_attr(p, "data", "cursor", H5T_NATIVE_INT64, 1, &n2, three);
    refused("resume", p, "attribute /data/cursor is an array of 2 values");

    /* A string attribute as an array of strings. */
    const char *modes[2] = {"fp32", "bf16"};
    hid_t vs = H5Tcopy(H5T_C_S1);
    H5Tset_size(vs, H5T_VARIABLE);
    p = copy_of_base("mode_array");
    set_attr(p, "state", "precision_mode", vs, 1, &n2, modes);
    refused("inspect", p, "attribute /state/precision_mode is an array of 2 values");
    H5Tclose(vs);
}

Test(hostile, a_config_that_is_not_one_string_is_refused)
{
    hid_t t = H5Tcopy(H5T_C_S1);
    H5Tset_size(t, 8);
    char two[2][8] = {"run:", "steps:"};
    hsize_t n2 = 2;
    const char *p = copy_of_base("config_array");
    set_dataset(p, "config", t, 1, &n2, two);
    refused("resume", p, "dataset /config is an array of 2 values");
    refused("inspect", p, "dataset /config is an array of 2 values");
    H5Tclose(t);

    int32_t i = 7;
    p = copy_of_base("config_int");
    set_dataset(p, "config", H5T_NATIVE_INT32, 0, NULL, &i);
    refused("eval", p, "dataset /config is an integer where a string belongs");
}

/* The encodings h5py writes by default: variable-length strings, ASCII or UTF-8. */
Test(hostile, strings_as_h5py_writes_them_are_read)
{
    /* The config as a variable-length UTF-8 string, as h5py's f['config'] = text writes it. */
    hid_t fin = H5Fopen(ckpt10, H5F_ACC_RDONLY, H5P_DEFAULT);
    hid_t d = H5Dopen2(fin, "config", H5P_DEFAULT);
    hid_t ft = H5Dget_type(d);
    size_t n = H5Tget_size(ft);
    char *text = calloc(n + 1, 1);
    cr_assert(H5Dread(d, ft, H5S_ALL, H5S_ALL, H5P_DEFAULT, text) >= 0);
    H5Tclose(ft);
    H5Dclose(d);
    H5Fclose(fin);

    const char *p = copy_of_base("h5py_strings");
    hid_t vu = H5Tcopy(H5T_C_S1);
    H5Tset_size(vu, H5T_VARIABLE);
    H5Tset_cset(vu, H5T_CSET_UTF8);
    set_dataset(p, "config", vu, 0, NULL, &text);
    free(text);
    /* format as a variable-length ASCII string; precision_mode as a fixed-length ASCII one. */
    hid_t va = H5Tcopy(H5T_C_S1);
    H5Tset_size(va, H5T_VARIABLE);
    H5Tset_cset(va, H5T_CSET_ASCII);
    const char *format = CKPT_FORMAT;
    set_attr(p, "/", "format", va, 0, NULL, &format);
    hid_t fa = H5Tcopy(H5T_C_S1);
    H5Tset_size(fa, 12);
    H5Tset_cset(fa, H5T_CSET_ASCII);
    char mode[12] = "fp16-dynamic";
    set_attr(p, "state", "precision_mode", fa, 0, NULL, mode);
    H5Tclose(vu);
    H5Tclose(va);
    H5Tclose(fa);

    struct result r = amp("inspect %s", p);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "precision: fp16-dynamic") && strstr(r.out, "out_dir:"), "%s", r.out);
    r = amp("resume %s run.steps=11 run.out_dir=%s/h5py_resumed", p, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
}

Test(hostile, counters_of_the_wrong_type_or_out_of_range_are_refused)
{
    const char *p = copy_of_base("step_nan");
    set_f64(p, "state", "step", NAN);
    refused("resume", p, "attribute /state/step is a float where an integer belongs");

    p = copy_of_base("step_negative");
    set_i64(p, "state", "step", -5);
    refused("resume", p, "attribute /state/step is -5, outside [0, ");

    p = copy_of_base("growth_tracker_max");
    set_i64(p, "scaler", "growth_tracker", INT64_MAX);
    refused("resume", p, "attribute /scaler/growth_tracker is 9223372036854775807, outside [0, 1999]");

    p = copy_of_base("hysteresis_min");
    set_i64(p, "scaler", "hysteresis_left", INT64_MIN);
    refused("resume", p, "attribute /scaler/hysteresis_left is -9223372036854775808, outside");

    p = copy_of_base("optimizer_step_min");
    set_i64(p, "optimizer", "step", INT64_MIN);
    refused("resume", p, "attribute /optimizer/step is -9223372036854775808, outside [0, 10]");

    p = copy_of_base("skips_beyond_steps");
    set_i64(p, "scaler", "skips_total", 11);
    refused("resume", p, "attribute /scaler/skips_total is 11, outside [0, 10]");

    p = copy_of_base("world_zero");
    set_i64(p, "state", "world_size", 0);
    refused("inspect", p, "attribute /state/world_size is 0, outside [1, ");

    p = copy_of_base("cursor_beyond_data");
    set_i64(p, "data", "cursor", 60001);
    refused("resume", p, "attribute /data/cursor is 60001, outside [0, ");

    p = copy_of_base("version_string");
    hid_t t = H5Tcopy(H5T_C_S1);
    H5Tset_size(t, 2);
    set_attr(p, "/", "format_version", t, 0, NULL, "1");
    H5Tclose(t);
    refused("inspect", p, "attribute /format_version is a string where an integer belongs");
}

Test(hostile, a_loss_scale_outside_the_scalers_range_is_refused_not_blamed_on_training)
{
    double bad[] = {0.0, 1e-300, INFINITY, 1e30};
    const char *want[] = {"attribute /scaler/scale is 0, outside [precision.loss_scale.min, max]",
                          "attribute /scaler/scale is 1e-300, outside", "attribute /scaler/scale is not a finite number",
                          "attribute /scaler/scale is 1e+30, outside"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char name[32];
        snprintf(name, sizeof name, "scale_%zu", i);
        const char *p = copy_of_base(name);
        set_f64(p, "scaler", "scale", bad[i]);
        /* Before: training ran, overflowed, and exit 5 called this file "the last good checkpoint". */
        struct result r = amp("resume %s run.steps=12 run.out_dir=%s/%s_run", p, scratch, name);
        cr_assert_eq(r.code, 4, "scale %g: exit %d\n%s", bad[i], r.code, r.out);
        cr_assert(strstr(r.out, want[i]), "scale %g: want '%s' in:\n%s", bad[i], want[i], r.out);
    }
}

Test(hostile, non_finite_weights_and_negative_second_moments_are_refused_naming_the_tensor)
{
    float nan32[32], v32[32];
    for (int i = 0; i < 32; i++) {
        nan32[i] = NAN;
        v32[i] = i == 5 ? -1.0f : 0.5f;
    }
    hsize_t n32 = 32;
    const char *p = copy_of_base("nan_weights");
    set_dataset(p, BIAS, H5T_NATIVE_FLOAT, 1, &n32, nan32);
    /* Before: "accuracy 0.1000" and exit 0. */
    refused("eval", p, "tensor /model/fc1/bias holds nan at element 0; every value must be finite");
    refused("resume", p, "tensor /model/fc1/bias holds nan at element 0");

    p = copy_of_base("inf_moment");
    float m32[32] = {0};
    m32[31] = INFINITY;
    set_dataset(p, "optimizer/fc1/bias/m", H5T_NATIVE_FLOAT, 1, &n32, m32);
    refused("resume", p, "tensor /optimizer/fc1/bias/m holds inf at element 31");

    p = copy_of_base("negative_v");
    set_dataset(p, "optimizer/fc1/bias/v", H5T_NATIVE_FLOAT, 1, &n32, v32);
    refused("resume", p, "tensor /optimizer/fc1/bias/v holds -1 at element 5; every value must be finite and >= 0");
}

Test(hostile, tensors_of_another_class_or_rank_are_named_as_such)
{
    int32_t ints[32] = {0};
    hsize_t n32 = 32;
    const char *p = copy_of_base("int_tensor");
    set_dataset(p, BIAS, H5T_NATIVE_INT32, 1, &n32, ints);
    refused("eval", p, "tensor /model/fc1/bias is an integer; checkpoint tensors are float32");

    hsize_t dims9[9] = {2, 2, 2, 2, 2, 1, 1, 1, 1};
    p = copy_of_base("rank9_tensor");
    set_dataset(p, BIAS, H5T_NATIVE_FLOAT, 9, dims9, ints);
    refused("eval", p, "tensor /model/fc1/bias has 9 dimensions");
    struct result r = amp("inspect %s", p);
    cr_assert(!strstr(r.out, "(0, 0, 0"), "%s", r.out);

    float one = 1.0f;
    p = copy_of_base("scalar_tensor");
    set_dataset(p, BIAS, H5T_NATIVE_FLOAT, 0, NULL, &one);
    refused("eval", p, "tensor /model/fc1/bias has 0 dimensions (a scalar)");

    /* a float layout of HDF5's own description that no IEEE type has: 32 bits of precision in 8 bytes (found
     * by fuzz_ckpt_resealed: it overflowed a conversion buffer inside H5D__read) */
    hid_t odd = H5Tcopy(H5T_IEEE_F64LE);
    cr_assert(H5Tset_fields(odd, 31, 23, 8, 0, 23) >= 0 && H5Tset_precision(odd, 32) >= 0 && H5Tset_ebias(odd, 127) >= 0);
    float f32[32] = {0};
    p = copy_of_base("odd_float");
    hid_t f = H5Fopen(p, H5F_ACC_RDWR, H5P_DEFAULT);
    cr_assert(f >= 0 && H5Ldelete(f, BIAS, H5P_DEFAULT) >= 0);
    hid_t sp = H5Screate_simple(1, &n32, NULL);
    hid_t d = H5Dcreate2(f, BIAS, odd, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    cr_assert(d >= 0 && H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, f32) >= 0);
    H5Dclose(d);
    H5Sclose(sp);
    H5Tclose(odd);
    H5Fclose(f);
    reseal(p);
    refused("eval", p, "tensor /model/fc1/bias is a float of 8 bytes and 32 bits of precision, not IEEE float32 or float64");

    /* float64 of the right shape converts exactly as h5py users write it: accepted. */
    double d32[32] = {0};
    p = copy_of_base("f64_tensor");
    set_dataset(p, BIAS, H5T_NATIVE_DOUBLE, 1, &n32, d32);
    r = amp("eval %s", p);
    cr_assert_eq(r.code, 0, "%s", r.out);
}

/* HDF5 allocates a whole chunk to read one, and reads external storage from wherever it names: a checkpoint
 * whose layout message declares chunks beyond the tensor (found by fuzz_ckpt_resealed: a 4 GB malloc inside
 * H5Dread for a 32x784 tensor), or whose tensor lives in another file, is refused before any data is read. */
Test(hostile, tensor_storage_beyond_the_tensor_or_the_file_is_refused)
{
    /* the bias kept in /dev/zero: read, it would be 32 zeros and load */
    const char *p = copy_of_base("external");
    hid_t f = H5Fopen(p, H5F_ACC_RDWR, H5P_DEFAULT);
    cr_assert(f >= 0 && H5Ldelete(f, BIAS, H5P_DEFAULT) >= 0);
    hsize_t n32 = 32;
    hid_t sp = H5Screate_simple(1, &n32, NULL);
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    cr_assert(H5Pset_external(dcpl, "/dev/zero", 0, 32 * sizeof(float)) >= 0);
    hid_t d = H5Dcreate2(f, BIAS, H5T_IEEE_F32LE, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    cr_assert(d >= 0);
    H5Dclose(d);
    H5Pclose(dcpl);
    H5Sclose(sp);
    H5Fclose(f);
    reseal(p);
    refused("eval", p, "tensor /model/fc1/bias keeps its data in 1 external file(s)");

    const char *w = "model/fc1/weight";
    p = copy_of_base("big_chunks");
    f = H5Fopen(p, H5F_ACC_RDONLY, H5P_DEFAULT);
    d = H5Dopen2(f, w, H5P_DEFAULT);
    dcpl = H5Dget_create_plist(d);
    sp = H5Dget_space(d);
    hsize_t dims[2], chunk[2];
    cr_assert_eq(H5Sget_simple_extent_dims(sp, dims, NULL), 2);
    cr_assert_eq(H5Pget_chunk(dcpl, 2, chunk), 2);
    cr_assert(chunk[0] == dims[0] && chunk[1] == dims[1], "the writer chunks a small tensor whole");
    H5Sclose(sp);
    H5Pclose(dcpl);
    H5Dclose(d);
    H5Fclose(f);
    /* the layout message (version 3) holds the chunk's dims and the element size as 4-byte integers */
    unsigned char pat[12];
    uint32_t v[3] = {(uint32_t)chunk[0], (uint32_t)chunk[1], 4};
    for (int i = 0; i < 12; i++)
        pat[i] = (unsigned char)(v[i / 4] >> (8 * (i % 4)));
    /* the model's tensor and its two Adam moments have that shape: all three get chunks twice as tall */
    long size = file_size(p);
    unsigned char *buf = malloc((size_t)size);
    FILE *fp = fopen(p, "r+b");
    cr_assert(fp && fread(buf, 1, (size_t)size, fp) == (size_t)size);
    int found = 0;
    for (long at = 0; at + 12 <= size; at++) {
        if (memcmp(buf + at, pat, 12) != 0)
            continue;
        uint32_t twice = 2 * (uint32_t)chunk[0];
        for (int i = 0; i < 4; i++)
            buf[at + i] = (unsigned char)(twice >> (8 * i));
        found++;
    }
    cr_assert(found >= 1 && found <= 3, "the chunk dims of %s occur %d times in the file", w, found);
    cr_assert(fseek(fp, 0, SEEK_SET) == 0 && fwrite(buf, 1, (size_t)size, fp) == (size_t)size);
    fclose(fp);
    free(buf);
    reseal(p);
    refused("eval", p, "tensor /model/fc1/weight has chunks larger than itself");
    refused("resume", p, "tensor /model/fc1/weight has chunks larger than itself");

}

/* ---- the commands around a checkpoint --------------------------------------------------------------- */

Test(hostile, resume_override_typo_gets_a_did_you_mean)
{
    struct result r = amp("resume %s run.stepsx=5", ckpt10);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "unknown key 'stepsx' in run (did you mean 'steps'?)"), "%s", r.out);
    r = amp("resume %s optim.lrr=0.1", ckpt10);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "did you mean 'lr'?"), "%s", r.out);
    /* A real key that resume may not change keeps its reason. */
    r = amp("resume %s optim.lr=0.1", ckpt10);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "changes the training itself"), "%s", r.out);
}

Test(hostile, resume_with_steps_at_or_below_the_checkpoint_says_so)
{
    /* Before: exit 0 having done nothing, silently. */
    struct result r = amp("resume %s run.steps=3 run.out_dir=%s/below", ckpt10, scratch);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "is at step 10, past the run's 3 steps") && strstr(r.out, "nothing to train"), "%s",
              r.out);
    r = amp("resume %s run.out_dir=%s/equal", ckpt10, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "it is the run's last step: nothing to train"), "%s", r.out);
}

Test(hostile, resume_refuses_steps_and_epochs_together_as_run_does)
{
    struct result run = amp("check configs/fashion_mlp.yaml run.steps=20 run.epochs=2");
    cr_assert_eq(run.code, 2, "%s", run.out);
    cr_assert(strstr(run.out, "run.steps (20) and run.epochs (2) are both set"), "%s", run.out);
    struct result r = amp("resume %s run.steps=20 run.epochs=2 run.out_dir=%s/both", ckpt10, scratch);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "run.steps (20) and run.epochs (2) are both set"), "%s", r.out);
    /* One of them alone replaces the checkpoint's choice. */
    r = amp("resume %s run.steps=11 run.out_dir=%s/one", ckpt10, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
}

Test(hostile, eval_refuses_a_dtype_that_would_be_ignored)
{
    struct result r = amp("eval %s --autocast off --dtype fp16", ckpt10);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "--dtype fp16 has no effect with --autocast off"), "%s", r.out);
    r = amp("eval %s --autocast on --dtype bf16", ckpt10);
    cr_assert_eq(r.code, 0, "%s", r.out);
}

static struct result shellf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static struct result shellf(const char *fmt, ...)
{
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    return shell(cmd);
}

/* AMPTRAIN_TEST_RAISE sends SIGTERM at a fixed point of the run: no timing involved. */
Test(hostile, sigterm_before_the_first_step_or_in_the_final_evaluation_is_answered)
{
    struct result r = amp("run configs/fashion_mlp.yaml " SMALL " run.steps=2 run.out_dir=%s/sig_setup", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = shellf("cd " AMP_SOURCE_DIR " && AMPTRAIN_TEST_RAISE=setup " AMP_BINARY " run configs/fashion_mlp.yaml " SMALL
              " run.steps=2 run.out_dir=%s/sig_setup2 2>&1; echo \"rc $?\"; ls %s/sig_setup2 2>&1 | head -1",
              scratch, scratch);
    cr_assert(strstr(r.out, "stopped by SIGTERM before the first step") && strstr(r.out, "rc 143"), "%s", r.out);
    cr_assert(strstr(r.out, "No such file"), "nothing written:\n%s", r.out);

    r = shellf("cd " AMP_SOURCE_DIR " && AMPTRAIN_TEST_RAISE=final_eval " AMP_BINARY " run configs/fashion_mlp.yaml "
              SMALL " run.steps=2 run.out_dir=%s/sig_eval 2>&1; echo \"rc $?\"", scratch);
    cr_assert(strstr(r.out, "SIGTERM arrived during the final evaluation") && strstr(r.out, "rc 143"), "%s", r.out);
    cr_assert(strstr(r.out, "sig_eval/ckpt-2.h5"), "names the checkpoint:\n%s", r.out);
}

Test(hostile, a_full_disk_at_the_first_checkpoint_does_not_promise_a_previous_one)
{
    /* ulimit -f 64 (KiB): the first checkpoint (about 110 KB) cannot be written. */
    struct result r = shellf("cd " AMP_SOURCE_DIR " && (ulimit -f 64; " AMP_BINARY " run configs/fashion_mlp.yaml " SMALL
                            " run.steps=2 run.out_dir=%s/full 2>&1; echo \"rc $?\")", scratch);
    cr_assert(strstr(r.out, "cannot write checkpoint") && strstr(r.out, "rc 1"), "%s", r.out);
    cr_assert(!strstr(r.out, "previous checkpoint is intact"), "%s", r.out);
    cr_assert(strstr(r.out, "no checkpoint of this run was written before this one"), "%s", r.out);
}

/* scale_log.csv and inspect print the loss scale so that it reads back exactly: 2^30 was 1.07374182e+09. */
Test(hostile, a_loss_scale_of_2_to_the_30_is_logged_exactly)
{
    struct result r = amp("run configs/fashion_mlp.yaml " SMALL " precision.mode=fp16-dynamic "
                          "precision.loss_scale.init=1073741824 precision.loss_scale.max=inf run.steps=2 "
                          "run.out_dir=%s/big_scale", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char p[600];
    snprintf(p, sizeof p, "%s/big_scale/scale_log.csv", scratch);
    FILE *f = fopen(p, "r");
    cr_assert_not_null(f);
    char text[8192] = "";
    size_t n = fread(text, 1, sizeof text - 1, f);
    text[n] = '\0';
    fclose(f);
    cr_assert(strstr(text, ",1073741824,"), "%s", text);
    cr_assert(!strstr(text, "e+09"), "%s", text);
    /* Both steps overflow fp16 at these scales: the checkpoint holds 2^28, printed in full. */
    r = amp("inspect %s/big_scale/ckpt-2.h5", scratch);
    cr_assert(strstr(r.out, "scaler: scale 268435456,"), "%s", r.out);
}

/* Resuming an fp32-master checkpoint with bf16 master weights rounds each value to bf16 once; a finite fp32
 * value beyond bf16's range would become Inf: refused, naming the tensor, the element and the way out. */
Test(hostile, resuming_into_bf16_refuses_a_value_beyond_bf16s_range)
{
    float big[32];
    for (int i = 0; i < 32; i++)
        big[i] = i == 7 ? 3.4e38f : 0.25f; /* finite in fp32, above bf16's largest finite 3.3895e38 */
    hsize_t n32 = 32;
    const char *p = copy_of_base("beyond_bf16");
    set_dataset(p, BIAS, H5T_NATIVE_FLOAT, 1, &n32, big);
    struct result r = amp("resume %s precision.mode=bf16 precision.master_weights=bf16", p);
    cr_assert_eq(r.code, 4, "exit %d, want 4:\n%s", r.code, r.out);
    cr_assert(strstr(r.out, "tensor /model/fc1/bias holds 3.4e+38 at element 7, beyond bf16's range"), "%s", r.out);
    cr_assert(strstr(r.out, "precision.master_weights=fp32"), "the hint says how to keep it: %s", r.out);
    cr_assert(strstr(r.out, "rounded to nearest bf16 once at load"), "the conversion is announced: %s", r.out);
    /* kept in fp32, the same file resumes (into a directory of its own: the copy is not in base's) */
    r = amp("resume %s run.steps=11 run.out_dir=%s/beyond_bf16_run", p, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
}

/* precision.mode fp8: the scales and amax histories are checkpoint state, checked like the rest (a zero scale would
 * make every code Inf-scaled; a NaN or negative amax would freeze or flip the delayed scales). */
Test(hostile, fp8_scales_and_amax_histories_are_checked_naming_the_tensor)
{
    struct result r = amp("run configs/fashion_mlp.yaml " SMALL " precision.mode=fp8 precision.fp8.amax_history_len=3 "
                          "'precision.fp8.min_size=[0,0]' run.steps=4 run.out_dir=%s/fp8", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char base[600], p[600];
    snprintf(base, sizeof base, "%s/fp8/ckpt-4.h5", scratch);
    float two[2] = {0.5f, 0.0f}, hist[6] = {1, 2, 3, 4, 5, 6};
    hsize_t n2 = 2, h32[2] = {3, 2}, h23[2] = {2, 3};
    snprintf(p, sizeof p, "%s/fp8_scale0.h5", scratch);
    copy_file(base, p);
    set_dataset(p, "fp8/fwd/scale", H5T_NATIVE_FLOAT, 1, &n2, two);
    refused("resume", p, "tensor /fp8/fwd/scale holds 0 at element 1; every value must be finite and > 0");
    refused("eval", p, "tensor /fp8/fwd/scale holds 0 at element 1");

    snprintf(p, sizeof p, "%s/fp8_hist_nan.h5", scratch);
    copy_file(base, p);
    hist[4] = NAN;
    set_dataset(p, "fp8/fwd/amax_history", H5T_NATIVE_FLOAT, 2, h32, hist);
    refused("resume", p, "tensor /fp8/fwd/amax_history holds nan at element 4");
    hist[4] = -5;
    set_dataset(p, "fp8/fwd/amax_history", H5T_NATIVE_FLOAT, 2, h32, hist);
    refused("resume", p, "tensor /fp8/fwd/amax_history holds -5 at element 4; every amax must be >= 0 or +Inf");
    hist[4] = 5;
    set_dataset(p, "fp8/fwd/amax_history", H5T_NATIVE_FLOAT, 2, h23, hist);
    refused("resume", p, "tensor /fp8/fwd/amax_history has shape (2, 3) in the checkpoint but (3, 2)");

    snprintf(p, sizeof p, "%s/fp8_no_group.h5", scratch);
    copy_file(base, p);
    hid_t f = H5Fopen(p, H5F_ACC_RDWR, H5P_DEFAULT);
    cr_assert(f >= 0 && H5Ldelete(f, "fp8", H5P_DEFAULT) >= 0);
    H5Fclose(f);
    reseal(p);
    refused("resume", p, "group /fp8 (the fp8 scales and amax histories) is missing");
    /* the untouched file resumes; a resume into bf16 drops the fp8 state, one from fp16 into fp8 starts it afresh */
    r = amp("resume %s run.steps=5", base);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp("resume %s precision.mode=bf16 run.steps=6", base);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "precision.mode changes from fp8 to bf16 on resume"), "%s", r.out);
    r = amp("resume %s precision.mode=fp8 run.steps=11", ckpt10);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "precision.mode changes from fp16-dynamic to fp8 on resume"), "%s", r.out);
}

/* A loss scale whose fp32 inverse is Inf is refused before training (1e-45 wrote NaN into every
 * weight without a skip), and an update that would store a non-finite weight or moment is never applied: the step
 * is skipped and counted, the weights stay finite, every checkpoint loads (lr 1e38 wrote Inf weights, exit 0, and an
 * unloadable `latest`). */
Test(hostile, a_loss_scale_below_fp32s_normal_range_is_refused)
{
    const char *cases[] = {"precision.mode=fp16-dynamic precision.loss_scale.init=1e-45 precision.loss_scale.min=1e-45",
                           "precision.mode=fp16-dynamic precision.loss_scale.min=1e-39",
                           "precision.mode=fp16-static precision.loss_scale.value=1e-45"};
    const char *keys[] = {"precision.loss_scale.init", "precision.loss_scale.min", "precision.loss_scale.value"};
    for (int i = 0; i < 3; i++) {
        struct result r = amp("check configs/fashion_mlp.yaml %s", cases[i]);
        cr_assert_eq(r.code, 2, "%s: exit %d\n%s", cases[i], r.code, r.out);
        cr_assert(strstr(r.out, keys[i]) && strstr(r.out, "below fp32's smallest normal number") &&
                      strstr(r.out, "hint:"), "%s: %s", cases[i], r.out);
    }
    /* the smallest normal scale itself is accepted */
    struct result r = amp("check configs/fashion_mlp.yaml precision.mode=fp16-static "
                          "precision.loss_scale.value=1.1754944e-38");
    cr_assert_eq(r.code, 0, "%s", r.out);
}

/* The non-finite values of a checkpoint's float tensors (weights, buffers, moments; counted by visit_tensor_pairs
 * over the file against itself). */
struct finite_count {
    int tensors, bad;
};

static void count_nonfinite(const char *name, const float *a, const float *b, size_t n, void *user)
{
    (void)name;
    (void)b;
    struct finite_count *c = user;
    c->tensors++;
    for (size_t i = 0; i < n; i++)
        c->bad += !isfinite(a[i]);
}

static int nonfinite_values(const char *ckpt)
{
    struct finite_count c = {0};
    visit_tensor_pairs(ckpt, ckpt, count_nonfinite, &c);
    cr_assert(c.tensors >= 6, "%s: %d tensors", ckpt, c.tensors);
    return c.bad;
}

Test(hostile, an_update_that_would_be_non_finite_is_skipped_and_every_checkpoint_loads)
{
    const char *modes[] = {"fp32", "bf16 precision.master_weights=bf16 optim.state_dtype=bf16", "fp16-dynamic"};
    for (int i = 0; i < 3; i++) {
        struct result r = amp("run configs/fashion_mlp.yaml " SMALL " precision.mode=%s optim.lr=1e38 run.steps=3 "
                              "run.ckpt_every=1 run.out_dir=%s/lr_huge_%d",
                              modes[i], scratch, i);
        cr_assert_eq(r.code, 0, "%s: %s", modes[i], r.out);
        char p[700];
        snprintf(p, sizeof p, "%s/lr_huge_%d/scale_log.csv", scratch, i);
        FILE *f = fopen(p, "r");
        cr_assert_not_null(f);
        char line[512];
        int rows = 0;
        while (fgets(line, sizeof line, f))
            if (strncmp(line, "step", 4) != 0) {
                rows++; /* found_inf 0 (the gradients were finite), skipped 1, the update named */
                cr_assert(strstr(line, ",0,1,") && strstr(line, "the update of fc1/weight (non-finite)"), "%s: %s",
                          modes[i], line);
            }
        fclose(f);
        cr_assert_eq(rows, 3);
        snprintf(p, sizeof p, "%s/lr_huge_%d/ckpt-3.h5", scratch, i);
        cr_assert_eq(nonfinite_values(p), 0, "%s: non-finite values in %s", modes[i], p);
        r = amp("eval %s/lr_huge_%d", scratch, i);
        cr_assert_eq(r.code, 0, "%s: the latest checkpoint loads: %s", modes[i], r.out);
        r = amp("resume %s/lr_huge_%d run.steps=4", scratch, i);
        cr_assert_eq(r.code, 0, "%s: and resumes: %s", modes[i], r.out);
    }
    /* the fail-fast policy still applies: bf16 with on_nonfinite stop, and max_consecutive_skips */
    struct result r = amp("run configs/fashion_mlp.yaml " SMALL " precision.mode=bf16 optim.lr=1e38 run.steps=3 "
                          "stability.on_nonfinite=stop run.out_dir=%s/lr_stop",
                          scratch);
    cr_assert_eq(r.code, 5, "%s", r.out);
    cr_assert(strstr(r.out, "step 1: skipped: the update of fc1/weight (non-finite)"), "%s", r.out);
    r = amp("run configs/fashion_mlp.yaml " SMALL " optim.lr=1e38 run.steps=5 stability.max_consecutive_skips=2 "
            "run.out_dir=%s/lr_skips",
            scratch);
    cr_assert_eq(r.code, 5, "%s", r.out);
    cr_assert(strstr(r.out, "2 skipped steps in a row"), "%s", r.out);
}

/* An fp8 run with a dynamic loss scale records the amax of an overflowing step's gradients, +Inf,
 * in /fp8/bwd/amax_history (as Transformer Engine does; the scale update ignores it). The loader refused every
 * checkpoint holding such an entry (exit 4), while inspect accepted it: writer, loader and inspect now agree. */
Test(hostile, an_fp8_checkpoint_with_an_overflow_in_its_amax_history_loads)
{
    struct result r = amp("run configs/fashion_mlp.yaml run.device=cpu run.steps=1 precision.mode=fp8 "
                          "'precision.fp8.min_size=[0,0]' precision.fp8.loss_scale=dynamic precision.loss_scale.init=1e300 "
                          "precision.loss_scale.max=inf run.out_dir=%s/fp8_overflow",
                          scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char p[600];
    snprintf(p, sizeof p, "%s/fp8_overflow/scale_log.csv", scratch);
    FILE *f = fopen(p, "r");
    char line[512] = "";
    cr_assert_not_null(f);
    while (fgets(line, sizeof line, f)) {
    }
    fclose(f);
    cr_assert(strstr(line, ",1,1,1,"), "step 1 overflowed and was skipped: %s", line);
    r = amp("inspect %s/fp8_overflow/ckpt-1.h5", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp("resume %s/fp8_overflow/ckpt-1.h5 run.steps=2", scratch);
    cr_assert_eq(r.code, 0, "the checkpoint its own run wrote resumes: %s", r.out);
    r = amp("eval %s/fp8_overflow/ckpt-1.h5", scratch);
    cr_assert_eq(r.code, 0, "and evaluates: %s", r.out);
    /* the file really holds +Inf there (so the test would fail if the writer changed instead) */
    snprintf(p, sizeof p, "%s/fp8_overflow/ckpt-1.h5", scratch);
    hid_t h = H5Fopen(p, H5F_ACC_RDONLY, H5P_DEFAULT);
    hid_t d = H5Dopen2(h, "fp8/bwd/amax_history", H5P_DEFAULT);
    cr_assert(h >= 0 && d >= 0);
    hssize_t n = H5Sget_simple_extent_npoints(H5Dget_space(d));
    float *v = malloc((size_t)n * sizeof *v);
    cr_assert(H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v) >= 0);
    int infs = 0;
    for (hssize_t i = 0; i < n; i++)
        infs += isinf(v[i]) && v[i] > 0;
    free(v);
    H5Dclose(d);
    H5Fclose(h);
    cr_assert(infs > 0, "no +Inf in /fp8/bwd/amax_history");
}

/* The keys resume accepts are one list: the refusal's hint prints lib/engine/overrides.c's table, and
 * docs/checkpoint.md and `help resume` name every key of it (they disagreed: run.threads, dist.* and the storage keys
 * were missing from some). */
Test(hostile, resume_overrides_are_one_list)
{
    struct result r = amp("resume %s optim.lr=0.1", ckpt10);
    cr_assert_eq(r.code, 2, "%s", r.out);
    char keys[HINT_KEYS_MAX][64];
    int count = hint_keys_documented(r.out, "resume", "Overrides allowed (the list the refusal's hint prints", keys);
    struct result help = amp("help resume");
    for (int i = 0; i < count; i++) {
        const char *k = keys[i];
        char section[96];
        snprintf(section, sizeof section, "%.*s.*", (int)(strchr(k, '.') ? strchr(k, '.') - k : (long)strlen(k)), k);
        cr_assert(strstr(help.out, k) || strstr(help.out, section), "help resume names neither %s nor %s:\n%s", k,
                  section, help.out);
    }
    cr_assert_geq(count, 20, "%d keys in the hint", count);
}
