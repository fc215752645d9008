/*
 * test_portable.c — portable checkpoints (issue 43 item 4; docs/checkpoint.md, "Portable checkpoints"): a run
 * records its data paths absolute and a digest of each data file, so a checkpoint copied elsewhere with its data
 * evaluates and resumes there with the data's new paths given as overrides, and only with the same data (exit 3
 * naming the file otherwise); `eval` reads only the split it evaluates and takes the overrides its table allows.
 *
 * Every run starts in a directory of the scratch area with relative data paths, as a user in a project directory
 * would; then the data and the run directory move to another directory, and the originals are gone.
 */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* mkdtemp */

#include "ckpt_testlib.h" /* scratch, make_scratch, remove_scratch, reseal, file_exists */

#include <stdint.h>

#include "rng.h" /* rng_bits: seeded token ids */

#define assert_contains(s, sub) cr_assert(strstr((s), (sub)) != NULL, "expected \"%s\" in \"%s\"", (sub), (s))

/* A small GPT on token files: 24 training windows of 16, 12 validation windows. */
#define TINY_GPT                                                                                                     \
    "run.device=cpu run.log_every=1000 run.eval_every=0 run.ckpt_every=0 data.seq_len=16 data.batch_size=4 "       \
    "model.layers.0.dim=32 model.layers.1.heads=2 model.layers.2.heads=2 optim.schedule.kind=constant "            \
    "optim.schedule.warmup_steps=0"

/* Run `ampTrain ARGS` in scratch/DIR (ARGS may go on with shell commands after a ';'), stderr merged. */
static struct result amp_in(const char *dir, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static struct result amp_in(const char *dir, const char *fmt, ...)
{
    char args[3000], cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof cmd, "cd %s/%s && { OPENBLAS_NUM_THREADS=1 %s %s ; } 2>&1", scratch, dir, amp_binary(), args);
    return shell(cmd);
}

static void sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void sh(const char *fmt, ...)
{
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
}

/* n little-endian uint16 ids below 256 from (seed), as nanoGPT's raw layout, at scratch/REL. */
static void write_tokens(const char *rel, int64_t n, uint64_t seed)
{
    char path[512];
    path_in(path, sizeof path, rel);
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "cannot write %s", path);
    for (int64_t i = 0; i < n; i++) {
        uint16_t id = (uint16_t)(rng_bits(seed, 43, (uint64_t)i) % 256);
        unsigned char le[2] = {(unsigned char)(id & 0xff), (unsigned char)(id >> 8)};
        cr_assert_eq(fwrite(le, 1, 2, f), 2);
    }
    cr_assert_eq(fclose(f), 0);
}

/* A token run of `steps` steps trained in scratch/a from a/d/train.bin and a/d/val.bin (relative paths), its
 * directory a/run. */
static void token_run_in_a(int steps)
{
    sh("mkdir -p %s/a/d %s/b", scratch, scratch);
    write_tokens("a/d/train.bin", 400, 1);
    write_tokens("a/d/val.bin", 200, 2);
    struct result r = amp_in("a", "run %s/configs/tokens_gpt.yaml " TINY_GPT " data.train_bin=d/train.bin "
                             "data.val_bin=./d/val.bin data.tokenizer=d/tok.json run.steps=%d run.out_dir=run",
                             AMP_SOURCE_DIR, steps);
    cr_assert_eq(r.code, 0, "%s", r.out);
}

/* Move scratch/a's data and run directory to scratch/b: the originals are gone. */
static void move_a_to_b(void)
{
    sh("mv %s/a/d %s/a/run %s/b/ && rmdir %s/a", scratch, scratch, scratch, scratch);
}

TestSuite(portable, .init = make_scratch, .fini = remove_scratch);

/* The recorded config names the data absolute: a relative path meant the directory the run started in. */
Test(portable, a_run_records_its_data_paths_absolute)
{
    token_run_in_a(2);
    char want[600];
    struct result r = amp_in("a", "inspect run | grep _bin:");
    cr_assert_eq(r.code, 0, "%s", r.out);
    snprintf(want, sizeof want, "train_bin: \"%s/a/d/train.bin\"", scratch);
    assert_contains(r.out, want);
    snprintf(want, sizeof want, "val_bin: \"%s/a/d/val.bin\"", scratch);
    assert_contains(r.out, want);
    char cmd[700];
    snprintf(cmd, sizeof cmd, "grep '_bin:\\|tokenizer:' %s/a/run/config.yaml", scratch);
    r = shell(cmd);
    snprintf(want, sizeof want, "train_bin: \"%s/a/d/train.bin\"", scratch);
    assert_contains(r.out, want);
    snprintf(want, sizeof want, "tokenizer: \"%s/a/d/tok.json\"", scratch); /* read by sample, from anywhere */
    assert_contains(r.out, want);
}

/* A token checkpoint and its data copied to another directory, the originals deleted: eval with overrides and
 * resume there, pointed at the data's new place by relative paths. */
Test(portable, a_moved_token_run_evaluates_and_resumes_with_new_data_paths)
{
    token_run_in_a(4);
    move_a_to_b();
    struct result r = amp_in("b", "eval run");
    cr_assert_eq(r.code, 3, "the recorded path is gone:\n%s", r.out);
    char gone[600];
    snprintf(gone, sizeof gone, "%s/a/d/val.bin: no such file (data.val_bin)", scratch);
    assert_contains(r.out, gone);
    r = amp_in("b", "eval run data.val_bin=d/val.bin run.device=cpu run.threads=1 data.batch_size=3 "
                    "data.val_windows=5");
    cr_assert_eq(r.code, 0, "%s", r.out);
    assert_contains(r.out, "eval step 4 | test |");
    assert_contains(r.out, "| 5 samples");
    r = amp_in("b", "eval run --split train data.train_bin=d/train.bin");
    cr_assert_eq(r.code, 0, "%s", r.out);
    assert_contains(r.out, "| train |");
    r = amp_in("b", "resume run data.train_bin=d/train.bin data.val_bin=d/val.bin run.steps=6");
    cr_assert_eq(r.code, 0, "%s", r.out);
    assert_contains(r.out, "resumed from");
    assert_contains(r.out, "eval step 6 | test |");
    /* the resumed run records the new place, absolute */
    r = amp_in("b", "eval run --split train");
    cr_assert_eq(r.code, 0, "the resumed checkpoint names the data's new place:\n%s", r.out);
    assert_contains(r.out, "eval step 6 | train |");
}

/* Data under the run's names that is not the run's data: exit 3 naming the file and its key, for eval and resume;
 * the checkpoint's own files are not touched. */
Test(portable, other_data_under_a_new_path_is_exit_3_naming_the_file)
{
    token_run_in_a(4);
    move_a_to_b();
    write_tokens("b/other.bin", 200, 3);
    struct result r = amp_in("b", "eval run data.val_bin=other.bin");
    cr_assert_eq(r.code, 3, "%s", r.out);
    assert_contains(r.out, "other.bin (data.val_bin): its contents differ from the file the run that wrote");
    assert_contains(r.out, "hint:");
    /* one changed byte in a copy of the training file */
    sh("cp %s/b/d/train.bin %s/b/t.bin && printf 'x' | dd of=%s/b/t.bin bs=1 seek=300 conv=notrunc 2>/dev/null",
       scratch, scratch, scratch);
    r = amp_in("b", "resume run data.train_bin=t.bin data.val_bin=d/val.bin run.steps=6");
    cr_assert_eq(r.code, 3, "%s", r.out);
    assert_contains(r.out, "t.bin (data.train_bin): its contents differ");
    cr_assert(!strstr(r.out, "resumed from"), "%s", r.out);
    char written[512];
    path_in(written, sizeof written, "b/run/ckpt-6.h5");
    cr_assert(!file_exists(written), "nothing was written");
}

/* eval --split test opens only the test split's files: the training file may be gone (tokens, and idx, whose test
 * labels alone take the classes the checkpoint records). */
Test(portable, eval_of_the_test_split_reads_no_training_file)
{
    token_run_in_a(2);
    sh("rm %s/a/d/train.bin", scratch);
    struct result r = amp_in("a", "eval run");
    cr_assert_eq(r.code, 0, "%s", r.out);
    assert_contains(r.out, "eval step 2 | test |");
    r = amp_in("a", "eval run --split train");
    cr_assert_eq(r.code, 3, "%s", r.out);
    assert_contains(r.out, "train.bin: no such file (data.train_bin)");

    const char *fm = "/usr/share/datasets/fashion-mnist";
    if (!file_exists("/usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz"))
        cr_skip_test("no Fashion-MNIST under %s", fm);
    sh("mkdir -p %s/f && for n in train-images-idx3 train-labels-idx1 t10k-images-idx3 t10k-labels-idx1; do "
       "ln -s %s/$n-ubyte.gz %s/f/$n-ubyte.gz; done",
       scratch, fm, scratch);
    r = amp_in("f", "run %s/configs/fashion_mlp.yaml " SMALL " run.steps=2 run.out_dir=run "
                    "data.train_images=train-images-idx3-ubyte.gz data.train_labels=train-labels-idx1-ubyte.gz "
                    "data.test_images=t10k-images-idx3-ubyte.gz data.test_labels=t10k-labels-idx1-ubyte.gz",
               AMP_SOURCE_DIR);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char line[256];
    const char *ran = strstr(r.out, "eval step 2 | test |");
    cr_assert_not_null(ran, "%s", r.out);
    snprintf(line, sizeof line, "%.*s", (int)strcspn(ran, "\n"), ran);
    sh("rm %s/f/train-images-idx3-ubyte.gz %s/f/train-labels-idx1-ubyte.gz", scratch, scratch);
    r = amp_in("f", "eval run");
    cr_assert_eq(r.code, 0, "%s", r.out);
    assert_contains(r.out, line); /* the run's own final evaluation, to the digit */
}

/* A text run (byte-level, data.files) moved with its files: the list given anew must be the same files in the same
 * order. */
Test(portable, a_moved_text_run_needs_the_same_files_in_order)
{
    sh("mkdir -p %s/a/t %s/b", scratch, scratch);
    write_tokens("a/t/one", 1500, 4); /* bytes are bytes: any file is text */
    write_tokens("a/t/two", 1500, 5);
    struct result r = amp_in("a", "run %s/configs/text_gpt.yaml run.device=cpu run.steps=2 run.out_dir=run "
                                  "data.seq_len=16 data.batch_size=4 model.layers.0.dim=32 'data.files=[t/one, t/two]'",
                             AMP_SOURCE_DIR);
    cr_assert_eq(r.code, 0, "%s", r.out);
    sh("mv %s/a/t %s/a/run %s/b/ && rmdir %s/a", scratch, scratch, scratch, scratch);
    r = amp_in("b", "eval run 'data.files=[t/one, t/two]'");
    cr_assert_eq(r.code, 0, "%s", r.out);
    assert_contains(r.out, "eval step 2 | test |");
    r = amp_in("b", "eval run 'data.files=[t/two, t/one]'");
    cr_assert_eq(r.code, 3, "%s", r.out);
    assert_contains(r.out, "t/two (data.files.0): its contents differ");
    r = amp_in("b", "eval run 'data.files=[t/one]'");
    cr_assert_eq(r.code, 3, "%s", r.out);
    assert_contains(r.out, "data.files: 1 file given, but the run that wrote");
    r = amp_in("b", "resume run 'data.files=[t/one, t/two]' run.steps=3");
    cr_assert_eq(r.code, 0, "%s", r.out);
    assert_contains(r.out, "eval step 3 | test |");
}

/* eval's overrides come from one table: the refusal's hint lists it, docs/checkpoint.md's list names every key of it,
 * an unknown key gets the config reader's did-you-mean, and a key eval does not take is exit 2 with the reason. */
Test(portable, eval_overrides_are_one_list)
{
    token_run_in_a(2);
    struct result r = amp_in("a", "eval run optim.lr=0.1");
    cr_assert_eq(r.code, 2, "%s", r.out);
    assert_contains(r.out, "eval: override 'optim.lr=0.1' refused");
    r = amp_in("a", "eval run data.seq_len=8");
    cr_assert_eq(r.code, 2, "%s", r.out);
    assert_contains(r.out, "eval: override 'data.seq_len=8' refused: it changes what a sample is");
    char keys[HINT_KEYS_MAX][64];
    int count = hint_keys_documented(r.out, "eval", "Overrides `eval` accepts (the list its refusal's hint prints",
                                     keys);
    cr_assert_eq(count, 12, "%d keys in the hint", count);
    r = amp_in("a", "eval run data.val_windoes=8");
    cr_assert_eq(r.code, 2, "%s", r.out);
    assert_contains(r.out, "did you mean 'val_windows'?");
    r = amp_in("a", "eval run data.batch_size=0");
    cr_assert_eq(r.code, 2, "%s", r.out);
    assert_contains(r.out, "data.batch_size");
}

/* /data's digest:KEY attributes of a checkpoint removed (as a file written before they were) or replaced. */
static void edit_digests(const char *ckpt, bool plant_string)
{
    hid_t f = H5Fopen(ckpt, H5F_ACC_RDWR, H5P_DEFAULT);
    cr_assert(f >= 0);
    hid_t g = H5Gopen2(f, "data", H5P_DEFAULT);
    cr_assert(g >= 0);
    const char *names[] = {"digest:data.train_bin", "digest:data.val_bin"};
    for (int i = 0; i < 2; i++) {
        cr_assert(H5Aexists(g, names[i]) > 0, "%s records %s", ckpt, names[i]);
        cr_assert(H5Adelete(g, names[i]) >= 0);
    }
    if (plant_string) {
        hid_t t = H5Tcopy(H5T_C_S1);
        H5Tset_size(t, 4);
        hid_t sp = H5Screate(H5S_SCALAR);
        hid_t a = H5Acreate2(g, "digest:data.val_bin", t, sp, H5P_DEFAULT, H5P_DEFAULT);
        cr_assert(a >= 0);
        cr_assert(H5Awrite(a, t, "abcd") >= 0);
        H5Aclose(a);
        H5Sclose(sp);
        H5Tclose(t);
    }
    H5Gclose(g);
    H5Fclose(f);
    reseal(ckpt);
}

/* A checkpoint from before digests were recorded: eval and resume still load it as before, and new data paths are
 * used with a warning that they cannot be checked. A digest that is not an integer is a checkpoint error. */
Test(portable, a_checkpoint_without_digests_takes_new_paths_with_a_warning)
{
    token_run_in_a(4);
    char ckpt[512];
    path_in(ckpt, sizeof ckpt, "a/run/ckpt-4.h5");
    edit_digests(ckpt, false);
    struct result r = amp_in("a", "eval run");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(!strstr(r.out, "warning"), "no new paths, nothing to warn of:\n%s", r.out);
    move_a_to_b();
    write_tokens("b/other.bin", 200, 3);
    r = amp_in("b", "eval run data.val_bin=other.bin");
    cr_assert_eq(r.code, 0, "%s", r.out);
    assert_contains(r.out, "warning: run/ckpt-4.h5 records no digests of its data");
    r = amp_in("b", "resume run data.train_bin=d/train.bin data.val_bin=d/val.bin run.steps=5");
    cr_assert_eq(r.code, 0, "%s", r.out);
    assert_contains(r.out, "records no digests of its data");
    /* the resumed run records them */
    r = amp_in("b", "eval run data.val_bin=other.bin");
    cr_assert_eq(r.code, 3, "%s", r.out);

    path_in(ckpt, sizeof ckpt, "b/run/ckpt-5.h5");
    edit_digests(ckpt, true);
    r = amp_in("b", "eval run/ckpt-5.h5");
    cr_assert_eq(r.code, 4, "%s", r.out);
    assert_contains(r.out, "attribute /data/digest:data.val_bin is a string where an integer belongs");
}

/* A relative path that would be too long once absolute: exit 2 naming the key, before anything is read. */
Test(portable, a_path_too_long_once_absolute_is_a_config_error)
{
    sh("mkdir -p %s/a", scratch);
    char rel[240];
    memset(rel, 'x', sizeof rel - 1);
    rel[sizeof rel - 1] = '\0';
    struct result r = amp_in("a", "run %s/configs/tokens_gpt.yaml " TINY_GPT " data.train_bin=%s run.steps=1 "
                                  "run.out_dir=run",
                             AMP_SOURCE_DIR, rel);
    cr_assert_eq(r.code, 2, "%s", r.out);
    assert_contains(r.out, "data.train_bin: 'xxx");
    assert_contains(r.out, "a path holds at most 255");
    char written[512];
    path_in(written, sizeof written, "a/run");
    cr_assert(!file_exists(written), "nothing was written");
}
