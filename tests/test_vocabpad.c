/*
 * test_vocabpad.c — the token head's padded vocabulary (docs/model.md, "Vocabulary padding"): a run whose head
 * product is (rows, Vp) gives the bits of the unpadded run. The CPU pads nothing by default; the test switch
 * AMPTRAIN_TEST_VOCAB_ALIGN (lib/base/test_switches.h) makes it pad as CUDA does.
 *
 * End to end through the binary: configs/gpt2_tiny.yaml at vocabulary 300 (padded to 320), its head tied to the
 * embedding table and untied with a bias, in fp32, bf16, fp16-dynamic and fp8 (the head kept in bf16, so padded;
 * the blocks' products in fp8), with accumulation: scale_log.csv (every column but samples_per_s), eval.jsonl and
 * every checkpoint tensor the same; two ranks with dist.zero 1 the same; export's files the same bytes; `ampTrain
 * sample` the same text (a byte model, vocabulary 256 padded to 288). In-process (the trainer): the padding is
 * really there (the logits' last dimension, the table's storage rows), its rows are zero after training, and values
 * planted in them are never read into a result nor written by the optimizer. tests/test_cpu_loss.c holds the loss
 * op on padded rows to the dense bits; tests/test_cuda_backend.c the CUDA loss against the CPU's.
 */
#define _POSIX_C_SOURCE 200809L
#include "ckpt_testlib.h" /* amp, scratch, assert_same_tensors, assert_same_logs */
#include "disttest.h"     /* mpi, NEED_MPI: two ranks */

#include "train.h" /* trainer_setup, trainer_step: the in-process runs */

static char tokens[700];

static void setup_tokens(void)
{
    make_scratch();
    if (access("/usr/share/games/fortunes/cookie", R_OK) != 0)
        cr_skip_test("the fortunes corpus is not installed (Debian package fortunes)");
    char cmd[1400];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/scripts/tools/make_tokens.py --format nanogpt --val-fraction 0.1 -o "
             "%s/train.bin /usr/share/games/fortunes/cookie >/dev/null 2>&1", AMP_SOURCE_DIR, scratch);
    cr_assert_eq(shell(cmd).code, 0, "make_tokens.py failed");
    snprintf(tokens, sizeof tokens, "data.train_bin=%s/train.bin data.val_bin=%s/val.bin", scratch, scratch);
}

TestSuite(vocabpad, .init = setup_tokens, .fini = remove_scratch, .timeout = 600);

/* gpt2_tiny at vocabulary 300: three steps of two micro-batches, evaluated twice */
#define TINY300                                                                                                       \
    "configs/gpt2_tiny.yaml run.device=cpu run.steps=3 run.log_every=1 run.eval_every=2 accum_steps=2 "              \
    "data.batch_size=4 data.val_windows=16 data.vocab=300 model.layers.0.vocab=300 model.layers.4.out=300"
#define UNTIED "model.layers.4.tie=\"''\" model.layers.4.bias=true"

/* Run `args` into scratch/dir with AMPTRAIN_TEST_VOCAB_ALIGN=align (0: unset). */
static void run_into(const char *dir, int align, const char *args)
{
    char env[64] = "";
    if (align > 0)
        snprintf(env, sizeof env, "AMPTRAIN_TEST_VOCAB_ALIGN=%d", align);
    char cmd[3000];
    snprintf(cmd, sizeof cmd, "cd %s && %s OPENBLAS_NUM_THREADS=1 %s run %s %s run.out_dir=%s/%s >%s/%s.log 2>&1",
             AMP_SOURCE_DIR, env, amp_binary(), args, tokens, scratch, dir, scratch, dir);
    cr_assert_eq(system(cmd), 0, "%s (align %d) failed: see %s/%s.log", dir, align, scratch, dir);
}

static void assert_same_runs(const char *a, const char *b, const char *ckpt)
{
    char pa[700], pb[700];
    snprintf(pa, sizeof pa, "%s/%s/scale_log.csv", scratch, a);
    snprintf(pb, sizeof pb, "%s/%s/scale_log.csv", scratch, b);
    assert_same_logs(pa, pb);
    snprintf(pa, sizeof pa, "%s/%s/%s", scratch, a, ckpt);
    snprintf(pb, sizeof pb, "%s/%s/%s", scratch, b, ckpt);
    cr_assert_gt(assert_same_tensors(pa, pb), 20, "%s vs %s: the weights and moments", a, b);
    char cmd[1600];
    snprintf(cmd, sizeof cmd, "cmp %s/%s/eval.jsonl %s/%s/eval.jsonl", scratch, a, scratch, b);
    cr_assert_eq(system(cmd), 0, "%s vs %s: eval.jsonl differs", a, b);
}

static void check_mode(const char *mode, const char *extra)
{
    static const char *const heads[] = {"tied", "untied"};
    for (int h = 0; h < 2; h++) {
        char args[1200], a[200], b[200];
        snprintf(args, sizeof args, TINY300 " precision.mode=%s %s %s", mode, extra, h ? UNTIED : "");
        snprintf(a, sizeof a, "%s-%s-dense", mode, heads[h]);
        snprintf(b, sizeof b, "%s-%s-padded", mode, heads[h]);
        run_into(a, 0, args);
        run_into(b, 64, args);
        assert_same_runs(a, b, "ckpt-3.h5");
    }
}

Test(vocabpad, fp32_is_the_same_bits) { check_mode("fp32", ""); }
Test(vocabpad, bf16_is_the_same_bits) { check_mode("bf16", ""); }
Test(vocabpad, fp16_dynamic_is_the_same_bits) { check_mode("fp16-dynamic", ""); }
/* fp8: the blocks' products in fp8 however small; the head stays bf16 (keep_bf16's default `last`), and padded */
Test(vocabpad, fp8_is_the_same_bits) { check_mode("fp8", "'precision.fp8.min_size=[0,0]'"); }

/* Two ranks with dist.zero 1: the reduce walks grad_flat, padding included, and the untied bf16 head's master is
 * sharded into blocks of the logical tensor while its padded copy stays whole; the same bits padded or not. */
Test(vocabpad, two_ranks_with_zero_are_the_same_bits)
{
    NEED_MPI();
    for (int h = 0; h < 2; h++) {
        const char *head = h ? UNTIED : "";
        for (int padded = 0; padded < 2; padded++) {
            struct result r = mpi(2, padded ? "-x AMPTRAIN_TEST_VOCAB_ALIGN=64" : NULL,
                                  "run " TINY300 " precision.mode=bf16 dist.zero=1 %s %s run.out_dir=%s/z%d-%d", head,
                                  tokens, scratch, h, padded);
            cr_assert_eq(r.code, 0, "%s", r.out);
        }
        char a[64], b[64];
        snprintf(a, sizeof a, "z%d-0", h);
        snprintf(b, sizeof b, "z%d-1", h);
        assert_same_runs(a, b, "ckpt-3.h5");
    }
}

/* export reads the checkpoint and the model it describes: the same files, padded or not (hf-gpt2 names need the
 * tied head without a bias) */
Test(vocabpad, export_is_the_same_bytes)
{
    run_into("ex-tied", 0, TINY300 " precision.mode=bf16");
    run_into("ex-untied", 0, TINY300 " precision.mode=bf16 " UNTIED);
    static const char *const names[] = {"hf-gpt2", "pytorch", "ampTrain"};
    char cmd[3000];
    for (int h = 0; h < 2; h++)
        for (int n = h; n < 3; n++) {
            const char *run = h ? "ex-untied" : "ex-tied";
            snprintf(cmd, sizeof cmd,
                     "cd %s && OPENBLAS_NUM_THREADS=1 %s export %s/%s/ckpt-3.h5 %s/dense.safetensors --names %s "
                     ">/dev/null 2>&1 && AMPTRAIN_TEST_VOCAB_ALIGN=64 OPENBLAS_NUM_THREADS=1 %s export %s/%s/ckpt-3.h5 "
                     "%s/padded.safetensors --names %s >/dev/null 2>&1 && cmp %s/dense.safetensors "
                     "%s/padded.safetensors && rm %s/dense.safetensors %s/padded.safetensors",
                     AMP_SOURCE_DIR, amp_binary(), scratch, run, scratch, names[n], amp_binary(), scratch, run, scratch,
                     names[n], scratch, scratch, scratch, scratch);
            cr_assert_eq(system(cmd), 0, "%s, export --names %s: failed or differs", run, names[n]);
        }
}

/* Sampling reads V columns of rows Vp apart: the byte model (vocabulary 256, padded to 288 by an alignment of 96)
 * trained padded and not, then sampled padded and not from each checkpoint: one text, four times (the prefill's
 * last row is at (n - 1) * Vp, the padding is never drawn). */
Test(vocabpad, sample_is_the_same_text)
{
    const char *args = "configs/gpt2_tiny.yaml run.device=cpu run.steps=4 run.log_every=1000 run.eval_every=0 "
                       "data.vocab=256 model.layers.0.vocab=256 model.layers.4.out=256";
    run_into("s-dense", 0, args);
    run_into("s-padded", 96, args);
    char want[4096] = "";
    for (int c = 0; c < 2; c++)
        for (int align = 0; align <= 96; align += 96) {
            char cmd[2000];
            snprintf(cmd, sizeof cmd, "cd %s && %s%s OPENBLAS_NUM_THREADS=1 %s sample %s/s-%s/ckpt-4.h5 --prompt "
                     "'The fortune' --tokens 40 --seed 5 2>/dev/null", AMP_SOURCE_DIR,
                     align ? "AMPTRAIN_TEST_VOCAB_ALIGN=" : "", align ? "96" : "", amp_binary(), scratch,
                     c ? "padded" : "dense");
            struct result r = shell(cmd);
            cr_assert_eq(r.code, 0, "%s\n%s", cmd, r.out);
            cr_assert_gt(strlen(r.out), strlen("The fortune"), "nothing generated: %s", r.out);
            if (!want[0])
                snprintf(want, sizeof want, "%s", r.out);
            cr_assert_str_eq(r.out, want, "checkpoint %d, align %d", c, align);
        }
}

/* A switch value that is not an alignment is exit 2 naming the variable, not a silent 1. */
Test(vocabpad, a_bad_switch_value_is_exit_2)
{
    char cmd[2000];
    snprintf(cmd, sizeof cmd, "cd %s && AMPTRAIN_TEST_VOCAB_ALIGN=x %s run configs/gpt2_tiny.yaml run.device=cpu "
             "run.steps=1 %s run.out_dir=%s/bad 2>&1; echo \"rc=$?\"", AMP_SOURCE_DIR, amp_binary(), tokens, scratch);
    struct result r = shell(cmd);
    cr_assert(strstr(r.out, "AMPTRAIN_TEST_VOCAB_ALIGN is 'x'"), "%s", r.out);
    cr_assert(strstr(r.out, "rc=2"), "%s", r.out);
}

/* ---- in-process: the padding itself ---------------------------------------------------------------------- */

static void tiny_config(struct config *cfg, const char *mode, bool untied)
{
    struct amp_error err = {0};
    cr_assert_eq(config_load(cfg, AMP_SOURCE_DIR "/configs/gpt2_tiny.yaml", &err), AMP_OK, "%s", err.msg);
    char train[400], val[400], prec[64];
    snprintf(train, sizeof train, "data.train_bin=%s/train.bin", scratch);
    snprintf(val, sizeof val, "data.val_bin=%s/val.bin", scratch);
    snprintf(prec, sizeof prec, "precision.mode=%s", mode);
    const char *ov[] = {"run.device=cpu", "run.steps=4", "run.log_every=1", "accum_steps=2", "data.batch_size=4",
                        "data.vocab=300", "model.layers.0.vocab=300", "model.layers.4.out=300", train, val, prec,
                        untied ? "model.layers.4.tie=''" : "run.seed=1234", untied ? "model.layers.4.bias=true" : NULL,
                        NULL};
    for (int i = 0; ov[i]; i++)
        cr_assert_eq(config_apply_override(cfg, ov[i], &err), AMP_OK, "%s: %s", ov[i], err.msg);
    cr_assert_eq(config_finalize(cfg, &err), AMP_OK, "%s", err.msg);
}

static struct param *param_named(struct trainer *t, const char *name)
{
    for (int i = 0; i < t->model.nparams; i++)
        if (!strcmp(t->model.params[i]->name, name))
            return t->model.params[i];
    cr_assert_fail("no parameter %s", name);
    return NULL;
}

/* The bytes of t's storage rows [from, to) (t one of p's padded tensors, CPU memory). */
static const unsigned char *rows_of(const struct param *p, const struct tensor *t, int64_t from, size_t *bytes)
{
    size_t row = t->numel / (size_t)t->shape[0] * dtype_size(t->dtype);
    *bytes = row * (size_t)(p->stored_rows - from);
    return (const unsigned char *)t->data + row * (size_t)from;
}

/* The padded tensors of the head's weight (and bias) hold 1.0 in their padding rows (value, 0 for none). */
static void plant(struct param *p, float value)
{
    const struct tensor *ts[] = {&p->master, &p->copy};
    for (int k = 0; k < 2; k++) {
        if (!ts[k]->data)
            continue;
        size_t bytes;
        unsigned char *r = (unsigned char *)rows_of(p, ts[k], ts[k]->shape[0], &bytes);
        size_t n = bytes / dtype_size(ts[k]->dtype);
        float *v = malloc(n * sizeof *v);
        for (size_t i = 0; i < n; i++)
            v[i] = value;
        dtype_convert(r, ts[k]->dtype, v, DT_FP32, n);
        free(v);
    }
}

struct trained {
    double loss[4];
    float *table; /* the head's weight, logical, fp32 */
    size_t n;
};

/* Four steps of gpt2_tiny at vocabulary 300 padded to 320, with `value` planted in the head's padding rows; checks
 * that the padding is there and, after training, that the planted rows are as planted (nothing wrote them) and the
 * gradient's are zero. */
static struct trained train_padded(const char *mode, bool untied, float value)
{
    setenv("AMPTRAIN_TEST_VOCAB_ALIGN", "64", 1);
    struct config cfg;
    tiny_config(&cfg, mode, untied);
    struct trainer t;
    struct amp_error err = {0};
    cr_assert_eq(trainer_setup(&t, &cfg, NULL, &err), AMP_OK, "%s", err.msg);
    const struct layer *head = &t.model.layers[4];
    cr_assert_eq(head->out_shape[2], 320, "the logits are (N, T, 320): %lld", (long long)head->out_shape[2]);
    cr_assert_eq(head->out_valid, 300);
    cr_assert_eq(layer_out_cols(head), 300);
    struct param *w = param_named(&t, untied ? "lm_head/weight" : "wte/wte");
    struct param *b = untied ? param_named(&t, "lm_head/bias") : NULL;
    cr_assert_eq(w->stored_rows, 320);
    cr_assert_eq(w->master.shape[0], 300, "the parameter everyone else sees is (300, 32)");
    cr_assert_eq(w->master.numel, (size_t)300 * 32);
    if (b)
        cr_assert_eq(b->stored_rows, 320);
    plant(w, value);
    if (b)
        plant(b, value);
    struct trained out = {0};
    for (int s = 0; s < 4; s++) {
        cr_assert_eq(trainer_step(&t, &err), AMP_OK, "%s", err.msg);
        cr_assert_eq(trainer_flush(&t, &err), AMP_OK, "%s", err.msg);
        out.loss[s] = t.recs[0].loss;
    }
    struct param *ps[] = {w, b};
    for (int k = 0; k < 2 && ps[k]; k++) {
        struct param *p = ps[k];
        const struct tensor *ts[] = {&p->master, &p->copy};
        for (int j = 0; j < 2; j++) {
            if (!ts[j]->data)
                continue;
            size_t bytes;
            const unsigned char *r = rows_of(p, ts[j], ts[j]->shape[0], &bytes);
            size_t n = bytes / dtype_size(ts[j]->dtype);
            float *v = malloc(n * sizeof *v);
            dtype_convert(v, DT_FP32, r, ts[j]->dtype, n);
            for (size_t i = 0; i < n; i++)
                cr_assert(v[i] == value && !signbit(v[i]), "%s %s: padding element %zu is %g, not %g as planted",
                          p->name, j ? "copy" : "master", i, (double)v[i], (double)value);
            free(v);
        }
        size_t bytes;
        const float *g = (const float *)rows_of(p, &p->grad, p->grad.shape[0], &bytes);
        for (size_t i = 0; i < bytes / sizeof *g; i++)
            cr_assert(g[i] == 0.0f, "%s: the gradient's padding element %zu is %g", p->name, i, (double)g[i]);
    }
    out.n = w->master.numel;
    out.table = malloc(out.n * sizeof *out.table);
    tensor_to_host_f32(&w->master, out.table);
    trainer_teardown(&t);
    config_free(&cfg);
    return out;
}

static void check_rows(const char *mode, bool untied)
{
    struct trained zero = train_padded(mode, untied, 0.0f), planted = train_padded(mode, untied, 1.0f);
    cr_assert_eq(memcmp(zero.loss, planted.loss, sizeof zero.loss), 0, "%s: the losses read the padding rows", mode);
    cr_assert_eq(memcmp(zero.table, planted.table, zero.n * sizeof *zero.table), 0,
                 "%s: the trained weights read the padding rows", mode);
    free(zero.table);
    free(planted.table);
}

Test(vocabpad, padding_rows_stay_zero_and_are_never_read_tied) { check_rows("bf16", false); }
Test(vocabpad, padding_rows_stay_zero_and_are_never_read_untied) { check_rows("fp32", true); }

/* Under the numerics report (which measures the logits and their gradient as they are) the head is not padded. */
Test(vocabpad, the_numerics_report_runs_unpadded)
{
    setenv("AMPTRAIN_TEST_VOCAB_ALIGN", "64", 1);
    struct config cfg;
    tiny_config(&cfg, "bf16", false);
    struct amp_error err = {0};
    cr_assert_eq(config_apply_override(&cfg, "run.numerics_every=1", &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(config_finalize(&cfg, &err), AMP_OK, "%s", err.msg);
    struct trainer t;
    cr_assert_eq(trainer_setup(&t, &cfg, NULL, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(t.model.layers[4].out_shape[2], 300);
    cr_assert_eq(t.model.layers[4].out_valid, 0);
    cr_assert_eq(param_named(&t, "wte/wte")->stored_rows, 0);
    trainer_teardown(&t);
    config_free(&cfg);
}
