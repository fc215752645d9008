/*
 * test_export.c — `ampTrain export` and lib/base/safetensors (docs/checkpoint.md): a small trained fashion_mlp checkpoint
 * exported in fp32, bf16 and fp16 with both name sets and read back with our reader (fp32 bit-exact, bf16/fp16
 * equal to dtype_convert of the fp32 values); the file's bytes against the format (header length, 8-byte
 * alignment, contiguous offsets, space padding); scripts/tools/safetensors_check.py and, where /usr/bin/python3 has
 * torch, PyTorch loading it; atomic writes (a corrupt checkpoint or a failed write leaves nothing new at OUT and
 * an existing OUT untouched); bad arguments; and every bad input of the reader, each with its message.
 */
#define _POSIX_C_SOURCE 200809L
#include "ckpt_testlib.h"

#include <dirent.h>
#include <math.h>
#include <sys/resource.h>

#include "checkpoint.h"  /* ckpt_read_weights: the reference values */
#include "dtype.h"       /* dtype_convert, bf16_from_fp32 */
#include "safetensors.h" /* safetensors_read, safetensors_parse */
#include "testbits.h"    /* bits_of */

static char ckpt[512];

static void setup_export(void)
{
    make_scratch();
    struct result r =
        amp("run configs/fashion_mlp.yaml " SMALL " run.steps=5 run.ckpt_every=5 run.out_dir=%s/base", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    snprintf(ckpt, sizeof ckpt, "%s/base/ckpt-5.h5", scratch);
}

TestSuite(export, .init = setup_export, .fini = remove_scratch);

static const char *const dtypes[] = {"fp32", "bf16", "fp16"};
static const enum dtype dts[] = {DT_FP32, DT_BF16, DT_FP16};

/* The checkpoint's name for the file's naming scheme. */
static void mapped(char *out, size_t len, const char *name, bool pytorch)
{
    snprintf(out, len, "%s", name);
    for (char *c = out; pytorch && *c; c++)
        *c = *c == '/' ? '.' : *c;
}

static const char *meta_value(const struct safetensors_file *f, const char *key)
{
    for (int i = 0; i < f->nmeta; i++)
        if (!strcmp(f->meta_keys[i], key))
            return f->meta_values[i];
    return NULL;
}

Test(export, every_dtype_and_name_set_reads_back_equal_to_the_checkpoint)
{
    struct ckpt_weights w;
    struct amp_error err = {0};
    cr_assert_eq(ckpt_read_weights(ckpt, &w, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(w.n, 6, "fc1, fc2, head: weight and bias each; got %d", w.n);
    for (int d = 0; d < 3; d++)
        for (int names = 0; names < 2; names++) {
            char out[600];
            snprintf(out, sizeof out, "%s/w-%s-%d.safetensors", scratch, dtypes[d], names);
            struct result r = amp("export %s %s --dtype %s --names %s", ckpt, out, dtypes[d],
                                  names ? "pytorch" : "ampTrain");
            cr_assert_eq(r.code, 0, "%s", r.out);
            cr_assert(strstr(r.out, "exported 6 tensors"), "%s", r.out);
            struct safetensors_file f;
            cr_assert_eq(safetensors_read(out, &f, &err), AMP_OK, "%s", err.msg);
            cr_assert_eq(f.ntensors, w.n);
            cr_assert_str_eq(meta_value(&f, "format"), "pt");
            cr_assert_str_eq(meta_value(&f, "dtype"), dtypes[d]);
            cr_assert_str_eq(meta_value(&f, "step"), "5");
            for (int i = 0; i < w.n; i++) {
                const struct ckpt_tensor *t = &w.tensors[i];
                char name[300];
                mapped(name, sizeof name, t->name, names);
                const struct safetensor *s = safetensors_find(&f, name);
                cr_assert_not_null(s, "%s: no tensor '%s'", out, name);
                cr_assert_eq(s->dtype, dts[d], "%s", name);
                cr_assert_eq(s->ndim, t->ndim, "%s", name);
                for (int k = 0; k < t->ndim; k++)
                    cr_assert_eq(s->shape[k], t->shape[k], "%s dim %d", name, k);
                size_t bytes = t->numel * dtype_size(dts[d]);
                cr_assert_eq(s->nbytes, bytes, "%s", name);
                void *want = malloc(bytes);
                dtype_convert(want, dts[d], t->data, DT_FP32, t->numel);
                cr_assert_eq(memcmp(want, s->data, bytes), 0, "%s in %s differs from the checkpoint", name, out);
                free(want);
            }
            /* the ampTrain names are the checkpoint's own, with the '/' */
            cr_assert_not_null(safetensors_find(&f, names ? "fc1.weight" : "fc1/weight"));
            safetensors_free(&f);
        }
    ckpt_weights_free(&w);
}

static unsigned char *slurp(const char *path, size_t *size)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *buf = malloc((size_t)n + 1);
    cr_assert_eq(fread(buf, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *size = (size_t)n;
    return buf;
}

/* The bytes against the format, independently of our reader: header length, '{', space padding to an 8-byte
 * boundary, offsets in header order from 0, back to back, ending at the end of the file. */
Test(export, file_layout_byte_by_byte)
{
    char out[600];
    snprintf(out, sizeof out, "%s/layout.safetensors", scratch);
    struct result r = amp("export %s %s --dtype bf16", ckpt, out);
    cr_assert_eq(r.code, 0, "%s", r.out);
    size_t size;
    unsigned char *b = slurp(out, &size);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = n << 8 | b[i];
    cr_assert(n >= 2 && 8 + n <= size, "header length %llu, file %zu", (unsigned long long)n, size);
    cr_assert_eq((8 + n) % 8, 0, "the data section starts at %llu, not on an 8-byte boundary", (unsigned long long)(8 + n));
    cr_assert_eq(b[8], '{');
    size_t close = 8 + (size_t)n;
    while (b[close - 1] == ' ')
        close--;
    cr_assert_eq(b[close - 1], '}', "the header's padding is not spaces after the closing brace");
    cr_assert(8 + n - close < 8, "more padding than an 8-byte boundary needs");
    char *json = malloc(n + 1);
    memcpy(json, b + 8, n);
    json[n] = '\0';
    uint64_t pos = 0;
    int count = 0;
    for (char *p = strstr(json, "\"data_offsets\": ["); p; p = strstr(p + 1, "\"data_offsets\": [")) {
        unsigned long long begin, end;
        cr_assert_eq(sscanf(p, "\"data_offsets\": [%llu, %llu]", &begin, &end), 2);
        cr_assert_eq(begin, pos, "tensor %d begins at %llu, the previous ends at %llu", count, begin,
                     (unsigned long long)pos);
        cr_assert(end >= begin);
        pos = end;
        count++;
    }
    cr_assert_eq(count, 6);
    cr_assert_eq(8 + n + pos, size, "offsets end at %llu, the data section holds %zu", (unsigned long long)pos,
                 size - 8 - (size_t)n);
    cr_assert(strstr(json, "\"fc1/weight\": {\"dtype\": \"BF16\", \"shape\": [32, 784], \"data_offsets\": ["), "%s", json);
    cr_assert(strstr(json, "\"__metadata__\": {\"format\": \"pt\""), "%s", json);
    free(json);
    free(b);
}

/* scripts/tools/safetensors_check.py (standard library only) validates the file and sums each F32 tensor as we do. */
Test(export, the_python_checker_accepts_the_export)
{
    char out[600];
    snprintf(out, sizeof out, "%s/check.safetensors", scratch);
    cr_assert_eq(amp("export %s %s --names pytorch", ckpt, out).code, 0);
    char cmd[1400];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/scripts/tools/safetensors_check.py %s 2>&1", AMP_SOURCE_DIR, out);
    struct result r = shell(cmd);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "(8-byte aligned), 6 tensors"), "%s", r.out);
    struct ckpt_weights w;
    struct amp_error err = {0};
    cr_assert_eq(ckpt_read_weights(ckpt, &w, &err), AMP_OK, "%s", err.msg);
    for (int i = 0; i < w.n; i++) {
        char name[300], line[400];
        mapped(name, sizeof name, w.tensors[i].name, true);
        snprintf(line, sizeof line, "\n%s F32 [", name);
        const char *at = strstr(r.out, line);
        cr_assert_not_null(at, "%s missing in:\n%s", name, r.out);
        const char *sum = strstr(at, "sum=");
        cr_assert_not_null(sum);
        double got = strtod(sum + 4, NULL), want = 0;
        for (size_t k = 0; k < w.tensors[i].numel; k++)
            want += w.tensors[i].data[k];
        cr_assert(fabs(got - want) <= 1e-9 * (1 + fabs(want)), "%s: python sums %.17g, the checkpoint %.17g", name,
                  got, want);
    }
    ckpt_weights_free(&w);
}

/* PyTorch (torch.frombuffer on the raw bytes; the safetensors package need not be installed) sees the values we
 * wrote, bit for bit, and a torch.nn model of Linear layers named fc1, fc2, head loads the pytorch names with
 * load_state_dict(strict=True) (scripts/tools/safetensors_check.py --torch-load builds it from the names). */
Test(export, pytorch_loads_the_export_exactly)
{
    if (!have_torch())
        cr_skip_test("/usr/bin/python3 cannot import torch");
    struct ckpt_weights w;
    struct amp_error err = {0};
    cr_assert_eq(ckpt_read_weights(ckpt, &w, &err), AMP_OK, "%s", err.msg);
    for (int d = 0; d < 3; d++) {
        char out[600], cmd[1400];
        snprintf(out, sizeof out, "%s/torch-%s.safetensors", scratch, dtypes[d]);
        cr_assert_eq(amp("export %s %s --names pytorch --dtype %s", ckpt, out, dtypes[d]).code, 0);
        snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/scripts/tools/safetensors_check.py --torch %s 2>&1",
                 AMP_SOURCE_DIR, out);
        struct result r = shell(cmd);
        cr_assert_eq(r.code, 0, "%s", r.out);
        for (int i = 0; i < w.n; i++) {
            const struct ckpt_tensor *t = &w.tensors[i];
            float first = dtype_round(t->data[0], dts[d]), last = dtype_round(t->data[t->numel - 1], dts[d]);
            char name[300], line[500];
            mapped(name, sizeof name, t->name, true);
            snprintf(line, sizeof line, "torch %s first=%08x last=%08x", name, bits_of(first), bits_of(last));
            cr_assert(strstr(r.out, line), "%s: want '%s' in:\n%s", dtypes[d], line, r.out);
        }
        snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/scripts/tools/safetensors_check.py --torch-load %s 2>&1",
                 AMP_SOURCE_DIR, out);
        r = shell(cmd);
        cr_assert_eq(r.code, 0, "%s", r.out);
        cr_assert(strstr(r.out, "torch-load strict: 6 tensors into fc1=Linear fc2=Linear head=Linear"), "%s", r.out);
    }
    ckpt_weights_free(&w);
}

/* Every layer kind with parameters: conv2d and batchnorm2d (fashion_cnn: running_mean and running_var are
 * exported), embedding, transformer_block and layernorm (text_gpt). With --names pytorch the equivalent torch.nn
 * model (Conv2d, BatchNorm2d, Linear, LayerNorm, the embedding's Parameters) loads each file strictly. */
Test(export, every_layer_kind_is_exported_and_loads_into_torch_nn)
{
    static const struct {
        const char *config, *overrides, *dir;
        const char *names[4]; /* some of its tensors, ampTrain names */
        const char *torch;    /* what --torch-load reports */
    } runs[] = {
        {"fashion_cnn", "data.batch_size=8", "cnn",
         {"bn1/running_mean", "bn2/running_var", "conv1/weight", "conv2/bias"},
         "torch-load strict: 16 tensors into bn1=BatchNorm2d bn2=BatchNorm2d conv1=Conv2d conv2=Conv2d fc1=Linear "
         "head=Linear"},
        /* a 0.2% split: the run's final evaluation is 22 batches, not 1,096 */
        {"text_gpt", "data.batch_size=2 data.val_fraction=0.002", "gpt",
         {"embed/wte", "embed/wpe", "block0/attn/qkv/weight", "ln_f/bias"},
         "block0.attn.qkv=Linear block0.ln1=LayerNorm"},
    };
    bool torch = have_torch();
    for (size_t k = 0; k < sizeof runs / sizeof runs[0]; k++) {
        struct result r = amp("run configs/%s.yaml %s run.device=cpu run.steps=1 run.ckpt_every=1 run.log_every=1000 "
                              "run.out_dir=%s/%s", runs[k].config, runs[k].overrides, scratch, runs[k].dir);
        cr_assert_eq(r.code, 0, "%s", r.out);
        char out[600], pt[600];
        snprintf(out, sizeof out, "%s/%s.safetensors", scratch, runs[k].dir);
        snprintf(pt, sizeof pt, "%s/%s-pt.safetensors", scratch, runs[k].dir);
        cr_assert_eq(amp("export %s/%s %s", scratch, runs[k].dir, out).code, 0);
        cr_assert_eq(amp("export %s/%s %s --names pytorch", scratch, runs[k].dir, pt).code, 0);
        struct safetensors_file f;
        struct amp_error err = {0};
        cr_assert_eq(safetensors_read(out, &f, &err), AMP_OK, "%s", err.msg);
        for (int i = 0; i < 4; i++) {
            const struct safetensor *t = safetensors_find(&f, runs[k].names[i]);
            cr_assert(t && t->dtype == DT_FP32, "%s: no F32 tensor %s", runs[k].config, runs[k].names[i]);
        }
        safetensors_free(&f);
        if (!torch)
            continue;
        char cmd[1400];
        snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/scripts/tools/safetensors_check.py --torch-load %s 2>&1",
                 AMP_SOURCE_DIR, pt);
        r = shell(cmd);
        cr_assert_eq(r.code, 0, "%s", r.out);
        cr_assert(strstr(r.out, runs[k].torch), "want '%s' in:\n%s", runs[k].torch, r.out);
    }
    if (!torch)
        cr_skip_test("/usr/bin/python3 cannot import torch: the names were checked, the torch.nn load was not");
}

/* ---- atomic writes --------------------------------------------------------------------------------------- */

static int tmp_files_in(const char *dir)
{
    DIR *d = opendir(dir);
    cr_assert_not_null(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;)
        n += strstr(e->d_name, ".tmp-") != NULL || strncmp(e->d_name, ".ampTrain-export-", 17) == 0;
    closedir(d);
    return n;
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
}

/* An earlier export at `path` (the only kind of file export replaces); returns its bytes for assert_bytes. */
static unsigned char *earlier_export(const char *path, size_t *size)
{
    struct result r = amp("export %s %s --dtype fp16", ckpt, path);
    cr_assert_eq(r.code, 0, "%s", r.out);
    return slurp(path, size);
}

static void assert_bytes(const char *path, const unsigned char *want, size_t size)
{
    size_t n;
    unsigned char *b = slurp(path, &n);
    cr_assert(n == size && !memcmp(b, want, n), "%s was changed", path);
    free(b);
}

Test(export, a_corrupt_checkpoint_is_exit_4_and_leaves_nothing_at_out)
{
    char bad[600], out[600], kept[600], dir[400];
    snprintf(dir, sizeof dir, "%s/atomic", scratch);
    cr_assert_eq(mkdir(dir, 0755), 0);
    snprintf(bad, sizeof bad, "%s/bad.h5", dir);
    copy_file(ckpt, bad);
    flip_bit(bad, file_size(bad) / 2, 3);
    snprintf(out, sizeof out, "%s/new.safetensors", dir);
    struct result r = amp("export %s %s", bad, out);
    cr_assert_eq(r.code, 4, "%s", r.out);
    cr_assert(strstr(r.out, bad) && strstr(r.out, "CRC-32"), "%s", r.out);
    cr_assert(!file_exists(out));
    snprintf(kept, sizeof kept, "%s/kept.safetensors", dir);
    size_t kept_size;
    unsigned char *kept_bytes = earlier_export(kept, &kept_size);
    r = amp("export %s %s", bad, kept);
    cr_assert_eq(r.code, 4, "%s", r.out);
    assert_bytes(kept, kept_bytes, kept_size);
    free(kept_bytes);
    cr_assert_eq(tmp_files_in(dir), 0);
    r = amp("export %s/missing.h5 %s", dir, out);
    cr_assert_eq(r.code, 4, "%s", r.out);
    cr_assert(!file_exists(out));
}

/* A checkpoint edited through HDF5 and re-sealed (its CRC matches): export checks each tensor as resume does. */
Test(export, a_crafted_tensor_is_exit_4_naming_it)
{
    char p[600], out[600];
    snprintf(out, sizeof out, "%s/crafted.safetensors", scratch);
    snprintf(p, sizeof p, "%s/nan.h5", scratch);
    copy_file(ckpt, p);
    hid_t f = H5Fopen(p, H5F_ACC_RDWR, H5P_DEFAULT);
    cr_assert(f >= 0);
    hid_t d = H5Dopen2(f, "model/fc1/bias", H5P_DEFAULT);
    float v[32];
    cr_assert(H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v) >= 0);
    v[3] = NAN;
    cr_assert(H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v) >= 0);
    H5Dclose(d);
    H5Fclose(f);
    reseal(p);
    struct result r = amp("export %s %s", p, out);
    cr_assert_eq(r.code, 4, "%s", r.out);
    cr_assert(strstr(r.out, "tensor /model/fc1/bias holds nan at element 3"), "%s", r.out);
    cr_assert(!file_exists(out));

    snprintf(p, sizeof p, "%s/int.h5", scratch);
    copy_file(ckpt, p);
    f = H5Fopen(p, H5F_ACC_RDWR, H5P_DEFAULT);
    cr_assert(f >= 0);
    cr_assert(H5Ldelete(f, "model/head/bias", H5P_DEFAULT) >= 0);
    hsize_t n = 10;
    hid_t sp = H5Screate_simple(1, &n, NULL);
    d = H5Dcreate2(f, "model/head/bias", H5T_STD_I32LE, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    cr_assert(d >= 0);
    H5Dclose(d);
    H5Sclose(sp);
    H5Fclose(f);
    reseal(p);
    r = amp("export %s %s", p, out);
    cr_assert_eq(r.code, 4, "%s", r.out);
    cr_assert(strstr(r.out, "tensor /model/head/bias is an integer; checkpoint tensors are float32"), "%s", r.out);
    cr_assert(!file_exists(out));
}

/* The checkpoint's tensors must be exactly its config's model's, as eval requires: a tensor the
 * model does not have, one it has that is missing, one of another shape are each exit 4 naming the tensor (and
 * both shapes), and nothing is written. Export wrote all three with exit 0. */
Test(export, tensors_that_are_not_the_models_are_exit_4_naming_them)
{
    static const struct {
        const char *file, *tensor;
        int ndim;
        hsize_t dims[2];
        const char *want;
    } cases[] = {
        {"extra.h5", "fc1/extra", 1, {5}, "tensor /model/fc1/extra is not a tensor of the model"},
        {"missing.h5", "head/bias", 0, {0}, "tensor /model/head/bias is missing"},
        {"shape.h5", "fc2/bias", 1, {31}, "tensor /model/fc2/bias has shape (31) in the checkpoint but (32) in the "
                                          "config's model"},
        {"rank.h5", "fc1/weight", 1, {25088}, "tensor /model/fc1/weight has shape (25088) in the checkpoint but (32, "
                                              "784) in the config's model"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        char p[600], out[600];
        snprintf(p, sizeof p, "%s/%s", scratch, cases[k].file);
        snprintf(out, sizeof out, "%s/%s.safetensors", scratch, cases[k].file);
        craft_tensor(ckpt, p, cases[k].tensor, cases[k].ndim, cases[k].dims);
        for (int names = 0; names < 2; names++) {
            struct result r = amp("export %s %s --names %s", p, out, names ? "pytorch" : "ampTrain");
            cr_assert_eq(r.code, 4, "%s: exit %d: %s", cases[k].file, r.code, r.out);
            cr_assert(strstr(r.out, cases[k].want) && strstr(r.out, p) && strstr(r.out, "hint:"), "want '%s' in: %s",
                      cases[k].want, r.out);
            cr_assert(!file_exists(out), "%s was written", out);
        }
    }
    cr_assert_eq(tmp_files_in(scratch), 0);
}

Test(export, a_failed_write_is_exit_1_naming_out_and_leaves_an_existing_out_untouched)
{
    char out[600];
    snprintf(out, sizeof out, "%s/no/such/dir/w.safetensors", scratch);
    struct result r = amp("export %s %s", ckpt, out);
    cr_assert_eq(r.code, 1, "%s", r.out);
    cr_assert(strstr(r.out, "cannot write") && strstr(r.out, out) && strstr(r.out, "hint:"), "%s", r.out);

    /* disk full: a 16 KB file-size limit in a forked child (the fp32 export is about 104 KB) */
    char dir[400], err_path[600];
    snprintf(dir, sizeof dir, "%s/full", scratch);
    cr_assert_eq(mkdir(dir, 0755), 0);
    snprintf(out, sizeof out, "%s/w.safetensors", dir);
    size_t kept_size;
    unsigned char *kept_bytes = earlier_export(out, &kept_size);
    snprintf(err_path, sizeof err_path, "%s/full.err", scratch);
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        struct rlimit rl = {.rlim_cur = 16 * 1024, .rlim_max = 16 * 1024};
        setrlimit(RLIMIT_FSIZE, &rl);
        if (!freopen("/dev/null", "w", stdout) || !freopen(err_path, "w", stderr))
            _exit(126);
        execl(AMP_BINARY, AMP_BINARY, "export", ckpt, out, (char *)NULL);
        _exit(127);
    }
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    size_t n;
    char *msg = (char *)slurp(err_path, &n);
    msg[n] = '\0';
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 1, "status %d: %s", status, msg);
    cr_assert(strstr(msg, "cannot write") && strstr(msg, out), "%s", msg);
    free(msg);
    assert_bytes(out, kept_bytes, kept_size);
    free(kept_bytes);
    cr_assert_eq(tmp_files_in(dir), 0);
}

/* ---- what OUT may be ------------------------------------------------------------------------------------- */

/* `export CKPT OUT` (under timeout: a FIFO must not be waited on) is exit 2 naming OUT and saying `what` it is,
 * with a hint, and OUT is still there, the same kind of file, the same inode, the same bytes. */
static void expect_out_refused(const char *out, const char *what)
{
    struct stat before, after;
    cr_assert_eq(lstat(out, &before), 0, "%s missing", out);
    size_t n0 = 0;
    unsigned char *b0 = S_ISREG(before.st_mode) ? slurp(out, &n0) : NULL;
    char cmd[2400];
    snprintf(cmd, sizeof cmd, "cd %s && timeout 20 %s export %s %s 2>&1", AMP_SOURCE_DIR, amp_binary(), ckpt, out);
    struct result r = shell(cmd);
    cr_assert_eq(r.code, 2, "export over %s (%s): exit %d: %s", out, what, r.code, r.out);
    cr_assert(strstr(r.out, out) && strstr(r.out, what) && strstr(r.out, "hint:"), "want '%s' naming %s in: %s",
              what, out, r.out);
    cr_assert_eq(lstat(out, &after), 0, "%s is gone", out);
    cr_assert_eq(after.st_mode & S_IFMT, before.st_mode & S_IFMT, "%s changed kind", out);
    cr_assert_eq(after.st_ino, before.st_ino, "%s was replaced", out);
    if (b0) {
        assert_bytes(out, b0, n0);
        free(b0);
    }
}

Test(export, out_may_only_be_new_or_an_earlier_export)
{
    char p[700], link[600], base[400];
    snprintf(base, sizeof base, "%s/base", scratch);
    expect_out_refused(ckpt, "is the checkpoint being exported");
    snprintf(p, sizeof p, "%s/latest", base);
    expect_out_refused(p, "is a run directory's latest");
    snprintf(p, sizeof p, "%s/config.yaml", base);
    expect_out_refused(p, "is a run directory's config.yaml");
    snprintf(p, sizeof p, "%s/scale_log.csv", base);
    expect_out_refused(p, "is a run directory's scale_log.csv");
    snprintf(p, sizeof p, "%s/other.h5", scratch);
    copy_file(ckpt, p);
    expect_out_refused(p, "is an ampTrain checkpoint");
    snprintf(p, sizeof p, "%s/notes.safetensors", scratch);
    write_text(p, "precious");
    expect_out_refused(p, "is a regular file that is not a safetensors file");
    snprintf(p, sizeof p, "%s/adir", scratch);
    cr_assert_eq(mkdir(p, 0755), 0);
    expect_out_refused(p, "is a directory");
    snprintf(p, sizeof p, "%s/fifo", scratch);
    cr_assert_eq(mkfifo(p, 0644), 0);
    expect_out_refused(p, "is a FIFO");
    expect_out_refused("/dev/null", "is a character device");
    snprintf(link, sizeof link, "%s/link.safetensors", scratch);
    cr_assert_eq(symlink(ckpt, link), 0);
    expect_out_refused(link, "is a symbolic link");
    cr_assert_eq(tmp_files_in(scratch), 0);
    cr_assert_eq(tmp_files_in(base), 0);
    /* an earlier export is replaced: the second file is bf16 */
    snprintf(p, sizeof p, "%s/again.safetensors", scratch);
    size_t n;
    free(earlier_export(p, &n));
    struct result r = amp("export %s %s --dtype bf16", ckpt, p);
    cr_assert_eq(r.code, 0, "%s", r.out);
    struct safetensors_file f;
    struct amp_error err = {0};
    cr_assert_eq(safetensors_read(p, &f, &err), AMP_OK, "%s", err.msg);
    cr_assert_str_eq(meta_value(&f, "dtype"), "bf16");
    safetensors_free(&f);
    r = amp("help export");
    cr_assert(strstr(r.out, "OUT must not exist or be an earlier export"), "the help states the rule: %s", r.out);
}

/* Dotted layer names are allowed, so two tensors can meet under --names pytorch ('/' becomes '.'): a layernorm
 * named block0.ln1 beside transformer_block block0 (whose ln1 is block0/ln1). Export wrote both as
 * block0.ln1.weight (exit 0) and ampTrain's own reader refused the file; it is now exit 2 naming both tensors and
 * their layers and the key, before anything is written. ampTrain names stay unique. */
Test(export, layer_names_that_collide_under_pytorch_names_are_refused)
{
    struct result r = amp("run configs/text_gpt.yaml data.batch_size=2 data.val_fraction=0.002 run.device=cpu "
                          "run.steps=1 run.ckpt_every=1 run.log_every=1000 model.layers.3.name=block0.ln1 "
                          "run.out_dir=%s/dots", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char out[600];
    snprintf(out, sizeof out, "%s/dots.safetensors", scratch);
    r = amp("export %s/dots %s --names pytorch", scratch, out);
    cr_assert_eq(r.code, 2, "exit %d: %s", r.code, r.out);
    cr_assert(strstr(r.out, "/model/block0/ln1/bias (layer 'block0')") &&
              strstr(r.out, "/model/block0.ln1/bias (layer 'block0.ln1')") &&
              strstr(r.out, "both become 'block0.ln1.bias'") && strstr(r.out, "hint:"), "%s", r.out);
    cr_assert(!file_exists(out), "%s was written", out);
    cr_assert_eq(tmp_files_in(scratch), 0);
    r = amp("export %s/dots %s", scratch, out);
    cr_assert_eq(r.code, 0, "ampTrain names do not collide: %s", r.out);
    struct safetensors_file f;
    struct amp_error err = {0};
    cr_assert_eq(safetensors_read(out, &f, &err), AMP_OK, "%s", err.msg);
    cr_assert_not_null(safetensors_find(&f, "block0.ln1/bias"));
    cr_assert_not_null(safetensors_find(&f, "block0/ln1/bias"));
    safetensors_free(&f);
}

/* ---- the temporary file and the final file's mode ------------------------------------------------------- */

/* The file gets 0666 & ~umask, as any file a program creates (and as checkpoints do): 0640 under umask 027, not
 * the 0644 it was forced to. */
Test(export, the_file_honours_the_umask)
{
    char out[600], cmd[2000];
    snprintf(out, sizeof out, "%s/umask.safetensors", scratch);
    snprintf(cmd, sizeof cmd, "cd %s && umask 027 && %s export %s %s 2>&1", AMP_SOURCE_DIR, amp_binary(), ckpt, out);
    struct result r = shell(cmd);
    cr_assert_eq(r.code, 0, "%s", r.out);
    struct stat sb;
    cr_assert_eq(stat(out, &sb), 0);
    cr_assert_eq(sb.st_mode & 0777, 0640, "mode %o under umask 027", (unsigned)(sb.st_mode & 0777));
    snprintf(cmd, sizeof cmd, "cd %s && umask 002 && %s export %s %s 2>&1", AMP_SOURCE_DIR, amp_binary(), ckpt, out);
    cr_assert_eq(shell(cmd).code, 0);
    cr_assert_eq(stat(out, &sb), 0);
    cr_assert_eq(sb.st_mode & 0777, 0664, "mode %o under umask 002", (unsigned)(sb.st_mode & 0777));
}

/* A valid OUT name of 250 bytes (NAME_MAX is 255) exports: the temporary name is short and fixed, not OUT's name
 * plus a suffix. */
Test(export, an_out_name_of_250_bytes_exports)
{
    char name[251], out[900];
    memset(name, 'w', 238);
    snprintf(name + 238, sizeof name - 238, ".safetensors");
    cr_assert_eq(strlen(name), 250);
    snprintf(out, sizeof out, "%s/%s", scratch, name);
    struct result r = amp("export %s %s", ckpt, out);
    cr_assert_eq(r.code, 0, "%s", r.out);
    struct safetensors_file f;
    struct amp_error err = {0};
    cr_assert_eq(safetensors_read(out, &f, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(f.ntensors, 6);
    safetensors_free(&f);
    cr_assert_eq(tmp_files_in(scratch), 0);
}

/* SIGTERM in the middle of the write (AMPTRAIN_TEST_RAISE=export_write raises it after the first tensor's bytes)
 * is exit 143 naming OUT; the temporary file is removed, a new OUT is not created and an earlier one is untouched. */
Test(export, a_signal_during_the_write_removes_the_temporary_file)
{
    char dir[400], out[600], cmd[2000];
    snprintf(dir, sizeof dir, "%s/sig", scratch);
    cr_assert_eq(mkdir(dir, 0755), 0);
    snprintf(out, sizeof out, "%s/new.safetensors", dir);
    snprintf(cmd, sizeof cmd, "cd %s && AMPTRAIN_TEST_RAISE=export_write %s export %s %s 2>&1", AMP_SOURCE_DIR,
             amp_binary(), ckpt, out);
    struct result r = shell(cmd);
    cr_assert_eq(r.code, 143, "exit %d: %s", r.code, r.out);
    cr_assert(strstr(r.out, "SIGTERM") && strstr(r.out, out) && strstr(r.out, "hint:"), "%s", r.out);
    cr_assert(!file_exists(out), "%s was left", out);
    cr_assert_eq(tmp_files_in(dir), 0, "a temporary file was left in %s", dir);
    size_t n;
    unsigned char *kept = earlier_export(out, &n);
    r = shell(cmd);
    cr_assert_eq(r.code, 143, "exit %d: %s", r.code, r.out);
    assert_bytes(out, kept, n);
    free(kept);
    cr_assert_eq(tmp_files_in(dir), 0, "a temporary file was left in %s", dir);
}

/* ---- arguments ------------------------------------------------------------------------------------------- */

Test(export, bad_arguments_are_exit_2_with_their_message)
{
    struct result r = amp("export %s", ckpt);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "missing OUT.safetensors argument"), "%s", r.out);
    r = amp("export");
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "missing CHECKPOINT.h5"), "%s", r.out);
    char out[600];
    snprintf(out, sizeof out, "%s/args.safetensors", scratch);
    r = amp("export %s %s --dtype fp8", ckpt, out);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "bad option '--dtype fp8'") && strstr(r.out, "fp32|bf16|fp16"), "%s", r.out);
    r = amp("export %s %s --dtype", ckpt, out);
    cr_assert_eq(r.code, 2, "%s", r.out);
    r = amp("export %s %s --names hf-gpt2", ckpt, out);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "export --names hf-gpt2: hf-gpt2 names need a GPT-2 shaped model, but model.layers[0] "
                            "'flatten_0' is a flatten") && strstr(r.out, "hint:"), "%s", r.out); /* the MLP */
    r = amp("export %s %s --names keras", ckpt, out);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "bad option '--names keras'"), "%s", r.out);
    cr_assert(!file_exists(out));
    r = amp("help export");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "ampTrain export CHECKPOINT.h5 OUT.safetensors") && strstr(r.out, "--names"), "%s", r.out);
    /* a run directory stands for its latest checkpoint, as for eval and inspect */
    r = amp("export %s/base %s", scratch, out);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "(step 5)"), "%s", r.out);
}

/* ---- the reader on bad input ------------------------------------------------------------------------------ */

/* A file of header `json` (unpadded, as another writer may leave it) and `data_len` bytes of data. */
static unsigned char *make_file(const char *json, size_t data_len, size_t *size)
{
    size_t n = strlen(json);
    *size = 8 + n + data_len;
    unsigned char *b = calloc(*size ? *size : 1, 1);
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)((uint64_t)n >> (8 * i));
    memcpy(b + 8, json, n);
    for (size_t i = 0; i < data_len; i++)
        b[8 + n + i] = (unsigned char)(i * 7 + 1);
    return b;
}

/* Parse and expect failure with AMP_ERR_CKPT and each of the NULL-terminated fragments in the message. */
static void expect_refused(const char *json, size_t data_len, ...)
{
    size_t size;
    unsigned char *b = make_file(json, data_len, &size);
    struct safetensors_file f;
    struct amp_error err = {0};
    enum amp_status st = safetensors_parse(b, size, "x.safetensors", &f, &err);
    cr_assert_eq(st, AMP_ERR_CKPT, "accepted: %s", json);
    cr_assert(strstr(err.msg, "x.safetensors"), "the message does not name the file: %s", err.msg);
    cr_assert(err.hint[0], "no hint: %s", err.msg);
    cr_assert_eq(f.ntensors, 0);
    cr_assert_null(f.bytes);
    va_list ap;
    va_start(ap, data_len);
    for (const char *s; (s = va_arg(ap, const char *)) != NULL;)
        cr_assert(strstr(err.msg, s), "'%s' not in: %s (header %s)", s, err.msg, json);
    va_end(ap);
    free(b);
}

#define E(name, dtype, shape, b, e) "\"" name "\": {\"dtype\": \"" dtype "\", \"shape\": " shape ", \"data_offsets\": [" #b ", " #e "]}"

Test(export, reader_accepts_what_the_format_allows)
{
    /* entries out of offset order, a scalar, an empty tensor, escapes, unpadded header, metadata anywhere */
    const char *json = "{" E("b\\u00e9\\ud83d\\ude00", "F32", "[2]", 4, 12) ", \"__metadata__\": {\"k\\\"\": \"v\\n\"}, "
                       E("a", "BF16", "[]", 2, 4) ", " E("z", "F16", "[0, 3]", 2, 2) "," E("s", "F16", "[1]", 0, 2) "}";
    size_t size;
    unsigned char *b = make_file(json, 12, &size);
    struct safetensors_file f;
    struct amp_error err = {0};
    cr_assert_eq(safetensors_parse(b, size, "ok.safetensors", &f, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(f.ntensors, 4);
    const struct safetensor *t = safetensors_find(&f, "b\xc3\xa9\xf0\x9f\x98\x80");
    cr_assert_not_null(t, "the escaped name did not decode to UTF-8");
    cr_assert_eq(t->dtype, DT_FP32);
    cr_assert_eq(t->nbytes, 8);
    cr_assert_eq(memcmp(t->data, b + size - 8, 8), 0);
    t = safetensors_find(&f, "a");
    cr_assert(t && t->ndim == 0 && t->dtype == DT_BF16 && t->nbytes == 2);
    t = safetensors_find(&f, "z");
    cr_assert(t && t->ndim == 2 && t->shape[0] == 0 && t->shape[1] == 3 && t->nbytes == 0);
    cr_assert_eq(f.nmeta, 1);
    cr_assert_str_eq(f.meta_keys[0], "k\"");
    cr_assert_str_eq(f.meta_values[0], "v\n");
    safetensors_free(&f);
    safetensors_free(&f); /* twice: a freed file is empty */
    free(b);
    /* nothing at all: no tensors, no data */
    b = make_file("{}", 0, &size);
    cr_assert_eq(safetensors_parse(b, size, "empty.safetensors", &f, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(f.ntensors, 0);
    safetensors_free(&f);
    free(b);
}

Test(export, reader_refuses_bad_lengths)
{
    struct safetensors_file f;
    struct amp_error err = {0};
    unsigned char tiny[5] = {1, 0, 0, 0, 0};
    cr_assert_eq(safetensors_parse(tiny, sizeof tiny, "x.safetensors", &f, &err), AMP_ERR_CKPT);
    cr_assert(strstr(err.msg, "x.safetensors: 5 bytes, too short"), "%s", err.msg);
    size_t size;
    unsigned char *b = make_file("{}", 0, &size);
    b[0] = 200; /* the header length beyond the file */
    cr_assert_eq(safetensors_parse(b, size, "x.safetensors", &f, &err), AMP_ERR_CKPT);
    cr_assert(strstr(err.msg, "x.safetensors: the header length is 200 bytes but the file has only 2"), "%s", err.msg);
    b[0] = 0;
    b[4] = 1; /* 2^32: beyond the 100 MB cap */
    cr_assert_eq(safetensors_parse(b, size, "x.safetensors", &f, &err), AMP_ERR_CKPT);
    cr_assert(strstr(err.msg, "beyond the 104857600-byte limit"), "%s", err.msg);
    b[4] = 0;
    b[7] = 0x80; /* 2^63 */
    cr_assert_eq(safetensors_parse(b, size, "x.safetensors", &f, &err), AMP_ERR_CKPT);
    free(b);
    expect_refused("[]", 0, "does not start with '{'", NULL);
    expect_refused(" {}", 0, "does not start with '{'", NULL);
    char missing[600];
    snprintf(missing, sizeof missing, "%s/none.safetensors", scratch);
    cr_assert_eq(safetensors_read(missing, &f, &err), AMP_ERR_CKPT);
    cr_assert(strstr(err.msg, missing), "%s", err.msg);
    cr_assert_eq(safetensors_read(scratch, &f, &err), AMP_ERR_CKPT);
    cr_assert(strstr(err.msg, "not a regular file"), "%s", err.msg);
}

Test(export, reader_refuses_malformed_json)
{
    expect_refused("{", 0, "malformed safetensors header", NULL);
    expect_refused("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}", 4, "'}' expected", NULL);
    expect_refused("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}x", 4,
                   "text after the header", NULL);
    expect_refused("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]},}", 4, "malformed", NULL);
    expect_refused("{\"a: 1}", 0, "unterminated string", NULL);
    expect_refused("{\"a\\q\": 1}", 0, "a bad escape", NULL);
    expect_refused("{\"a\\u00\": 1}", 0, "a bad escape", NULL);
    expect_refused("{\"a\\ud800\": 1}", 0, "a bad escape", NULL); /* a lone surrogate */
    expect_refused("{\"a\\u0000\": 1}", 0, "\\u0000", NULL);
    expect_refused("{\"a\tb\": 1}", 0, "control character", NULL);
    expect_refused("{\"a\": {\"dtype\": \"F32\", \"shape\": [01], \"data_offsets\": [0, 4]}}", 4, "leading zero",
                   "tensor 'a'", NULL);
    expect_refused("{\"a\": {\"dtype\": \"F32\", \"shape\": [-1], \"data_offsets\": [0, 4]}}", 4,
                   "a non-negative integer expected", "tensor 'a'", NULL);
    expect_refused("{\"a\": {\"dtype\": \"F32\", \"shape\": [1.0], \"data_offsets\": [0, 4]}}", 4, "fraction", NULL);
    expect_refused("{\"a\": {\"dtype\": \"F32\", \"shape\": [1e0], \"data_offsets\": [0, 4]}}", 4, "exponent", NULL);
    expect_refused("{\"a\": {\"dtype\": \"F32\", \"shape\": [99999999999999999999], \"data_offsets\": [0, 4]}}", 4,
                   "beyond 2^63", NULL);
    expect_refused("{\"a\": {\"dtype\": \"F32\", \"shape\": [1,1,1,1,1,1,1,1,1], \"data_offsets\": [0, 4]}}", 4,
                   "more than 8 dimensions", NULL);
    expect_refused("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4, 8]}}", 8,
                   "data_offsets has more than 2 values", NULL);
    expect_refused("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4]}}", 4, "[begin, end]", NULL);
    expect_refused("{\"a\": {\"dtype\": \"F32\", \"shape\": [1]}}", 4, "no data_offsets", "tensor 'a'", NULL);
    expect_refused("{\"a\": {\"shape\": [1], \"data_offsets\": [0, 4]}}", 4, "no dtype", NULL);
    expect_refused("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4], \"x\": 1}}", 4,
                   "an unknown key", "tensor 'a'", NULL);
    expect_refused("{\"a\": {\"dtype\": \"F32\", \"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}", 4,
                   "a repeated key", NULL);
    expect_refused("{\"a\": {\"dtype\": 3, \"shape\": [1], \"data_offsets\": [0, 4]}}", 4, "'\"' expected", NULL);
    expect_refused("{\"a\": [1]}", 4, "'{' expected", NULL);
    expect_refused("{\"__metadata__\": {\"k\": 1}}", 0, "__metadata__ values must be strings", NULL);
    expect_refused("{\"__metadata__\": {}, \"__metadata__\": {}}", 0, "__metadata__ appears twice", NULL);
}

Test(export, reader_refuses_inconsistent_entries_naming_the_tensor)
{
    expect_refused("{" E("a", "F32", "[1]", 0, 4) ", " E("b", "F32", "[1]", 2, 6) "}", 6, "tensor 'b'",
                   "overlaps tensor 'a'", NULL);
    expect_refused("{" E("a", "F32", "[1]", 0, 4) ", " E("b", "F32", "[1]", 8, 12) "}", 12, "tensor 'b' begins at 8",
                   "no tensor covers", NULL);
    expect_refused("{" E("a", "F32", "[1]", 4, 8) "}", 8, "tensor 'a' begins at 4", NULL);
    expect_refused("{" E("a", "F32", "[2]", 0, 8) "}", 4, "tensor 'a'", "past the end of the data", NULL);
    expect_refused("{" E("a", "F32", "[1]", 0, 4) "}", 6, "cover 4 bytes", "holds 6", NULL);
    expect_refused("{" E("a", "F32", "[1]", 4, 0) "}", 4, "tensor 'a'", "begin after end", NULL);
    expect_refused("{" E("a", "F32", "[3]", 0, 8) "}", 8, "tensor 'a'", "make 12 bytes", "hold 8", NULL);
    expect_refused("{" E("a", "F32", "[4294967296, 4294967296]", 0, 8) "}", 8, "tensor 'a'", "more than 2^64", NULL);
    expect_refused("{" E("a", "I64", "[1]", 0, 8) "}", 8, "tensor 'a' has dtype 'I64', which ampTrain does not take",
                   NULL);
    expect_refused("{" E("a", "F33", "[1]", 0, 4) "}", 4, "dtype 'F33', which safetensors does not define", NULL);
    expect_refused("{" E("a", "F32", "[1]", 0, 4) ", " E("a", "F32", "[1]", 4, 8) "}", 8,
                   "tensor 'a' appears twice", NULL);
}

/* Every prefix and every single-byte change of a valid file is refused cleanly or accepted, never a crash
 * (ASan builds check the bounds). */
Test(export, reader_survives_every_truncation_and_byte_flip)
{
    const char *json = "{" E("a", "F32", "[2]", 0, 8) ", " E("b", "BF16", "[1]", 8, 10)
                       ", \"__metadata__\": {\"format\": \"pt\"}}";
    size_t size;
    unsigned char *b = make_file(json, 10, &size);
    struct safetensors_file f;
    struct amp_error err = {0};
    cr_assert_eq(safetensors_parse(b, size, "x", &f, &err), AMP_OK, "%s", err.msg);
    safetensors_free(&f);
    for (size_t n = 0; n < size; n++) {
        enum amp_status st = safetensors_parse(b, n, "x", &f, &err);
        cr_assert_eq(st, AMP_ERR_CKPT, "a %zu-byte prefix was accepted", n);
    }
    unsigned char *c = malloc(size);
    for (size_t i = 0; i < size; i++)
        for (int v = 0; v < 256; v += 17) {
            memcpy(c, b, size);
            c[i] = (unsigned char)v;
            enum amp_status st = safetensors_parse(c, size, "x", &f, &err);
            cr_assert(st == AMP_OK || st == AMP_ERR_CKPT);
            if (st == AMP_OK)
                safetensors_free(&f);
        }
    free(c);
    free(b);
}

/* The writer alone: round trip through safetensors_write and safetensors_read, and a write error naming OUT. */
Test(export, writer_round_trip_and_error)
{
    float a[6] = {1, -2, 3.5f, 0, 1e-30f, 65504};
    uint16_t h[3] = {0x3c00, 0x8000, 0x7bff};
    const struct safetensor ts[] = {
        {.name = "x/\"q\"", .dtype = DT_FP32, .ndim = 2, .shape = {2, 3}, .data = a},
        {.name = "s", .dtype = DT_FP16, .ndim = 0, .data = h},
        {.name = "e", .dtype = DT_BF16, .ndim = 1, .shape = {0}, .data = h},
        {.name = "h", .dtype = DT_FP16, .ndim = 1, .shape = {3}, .data = h},
    };
    const struct safetensors_meta meta[] = {{"format", "pt"}, {"note", "tab\there"}};
    char out[600];
    snprintf(out, sizeof out, "%s/rt.safetensors", scratch);
    struct amp_error err = {0};
    cr_assert_eq(safetensors_write(out, ts, 4, meta, 2, &err), AMP_OK, "%s", err.msg);
    struct safetensors_file f;
    cr_assert_eq(safetensors_read(out, &f, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(f.ntensors, 4);
    cr_assert_eq(f.data_start % 8, 0);
    for (int i = 0; i < 4; i++) {
        const struct safetensor *t = safetensors_find(&f, ts[i].name);
        cr_assert_not_null(t, "%s", ts[i].name);
        cr_assert_eq(t->ndim, ts[i].ndim);
        cr_assert_eq(t->dtype, ts[i].dtype);
        cr_assert_eq(memcmp(t->data, ts[i].data, t->nbytes), 0, "%s", ts[i].name);
    }
    cr_assert_eq(safetensors_find(&f, "s")->nbytes, 2);
    cr_assert_str_eq(f.meta_values[1], "tab\there");
    safetensors_free(&f);
    snprintf(out, sizeof out, "%s/nowhere/rt.safetensors", scratch);
    cr_assert_eq(safetensors_write(out, ts, 4, meta, 2, &err), AMP_ERR_INTERNAL);
    cr_assert(strstr(err.msg, out) && strstr(err.msg, "/nowhere does not exist"), "%s", err.msg);
}

/* An idx model exports where its data set is not: the checkpoint's /data holds the sample shape and classes the
 * model is built from. A checkpoint without them (written before) falls back to loading the data, and names it
 * when it is missing (exit 3). */
Test(export, an_image_model_exports_without_its_data)
{
    char p[700], cmd[2400];
    snprintf(p, sizeof p, "%s/moved.h5", scratch);
    copy_file(ckpt, p);
    /* the config's data paths now name files that do not exist (the checkpoint moved to another machine) */
    snprintf(cmd, sizeof cmd,
             "/usr/bin/python3 -c \"import h5py; f = h5py.File('%s', 'r+'); c = f['config'][()]; "
             "c = c.decode() if isinstance(c, bytes) else c; del f['config']; "
             "f['config'] = c.replace('/usr/share/datasets/fashion-mnist', '/nonexistent/fashion-mnist')\"",
             p);
    cr_assert_eq(system(cmd), 0);
    reseal(p);
    struct result r = amp("export %s %s/moved.safetensors", p, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "exported 6 tensors"), "%s", r.out);
    /* without /data's sample attributes: the data set is read, and it is not there */
    snprintf(cmd, sizeof cmd,
             "/usr/bin/python3 -c \"import h5py; f = h5py.File('%s', 'r+'); d = f['data'].attrs; del d['sample_ndim']\"",
             p);
    cr_assert_eq(system(cmd), 0);
    reseal(p);
    r = amp("export %s %s/old.safetensors", p, scratch);
    cr_assert_eq(r.code, 3, "%s", r.out);
    cr_assert(strstr(r.out, "/nonexistent/fashion-mnist"), "%s", r.out);
}

/* An OUT in a directory that does not exist is named as such (it blamed disk space and quotas). */
Test(export, a_missing_directory_is_named)
{
    struct result r = amp("export %s %s/no/such/dir/out.safetensors", ckpt, scratch);
    cr_assert_eq(r.code, 1, "%s", r.out);
    cr_assert(strstr(r.out, "/no/such/dir does not exist") && strstr(r.out, "hint: create the directory first"), "%s",
              r.out);
    cr_assert_null(strstr(r.out, "disk space"), "%s", r.out);
}
