/*
 * test_interop_torch.c — ampTrain's GPT-2 against PyTorch (docs/checkpoint.md), with scripts/ref/gpt2_torch.py (a
 * torch.nn GPT-2 in nanoGPT's layout with Hugging Face's key names; no transformers or safetensors package):
 *   - a tiny GPT-2 (configs/gpt2_tiny.yaml, lm_head tied) trained 20 steps in fp32, exported with
 *     `--names hf-gpt2`, gives in torch the logits ampTrain computes for fixed tokens: max|diff| <= 1e-5 max|logit|;
 *   - torch's freshly initialised weights, saved with hf-gpt2 keys, start an ampTrain run (model.init_from) whose
 *     step-1 loss is torch's loss on the same first batch (data.sampling: sequential) within 1e-5 relative.
 * Every test skips (counted as skipped: skip_main.h, exit 77) where /usr/bin/python3 cannot import torch.
 */
#define _POSIX_C_SOURCE 200809L
#include "ckpt_testlib.h"
#include "skip_main.h"

#include <math.h>

#include "autocast.h"   /* autocast_from_config */
#include "backend.h"    /* backend_cpu_create */
#include "checkpoint.h" /* ckpt_read_config, ckpt_load_model */
#include "model.h"      /* model_build, model_forward */

static char ckpt[512], hf[600];

#define TINY "configs/gpt2_tiny.yaml run.device=cpu run.log_every=1 data.train_bin=%s/train.bin data.val_bin=%s/val.bin"

static void setup_torch(void)
{
    make_scratch();
    if (!have_torch())
        return;
    char cmd[1400];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/scripts/tools/make_tokens.py --format nanogpt --val-fraction 0.1 -o "
             "%s/train.bin /usr/share/games/fortunes/cookie >/dev/null 2>&1", AMP_SOURCE_DIR, scratch);
    cr_assert_eq(shell(cmd).code, 0, "make_tokens.py failed");
    struct result r = amp("run " TINY " run.steps=20 run.out_dir=%s/base", scratch, scratch, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    snprintf(ckpt, sizeof ckpt, "%s/base/ckpt-20.h5", scratch);
    snprintf(hf, sizeof hf, "%s/hf.safetensors", scratch);
    r = amp("export %s %s --names hf-gpt2", ckpt, hf);
    cr_assert_eq(r.code, 0, "%s", r.out);
}

TestSuite(torch, .init = setup_torch, .fini = remove_scratch);

/* ampTrain's logits (T, vocab) of one sequence of tokens, from the checkpoint, on the CPU in fp32. */
static float *amptrain_logits(const int32_t *tokens, int64_t T, int64_t *vocab)
{
    struct config cfg;
    struct amp_error err = {0};
    cr_assert_eq(ckpt_read_config(ckpt, &cfg, &err), AMP_OK, "%s", err.msg);
    struct backend *be = backend_cpu_create();
    struct autocast_policy pol;
    cr_assert_eq(autocast_from_config(&pol, cfg.precision.mode, &cfg.precision.autocast, &err), AMP_OK);
    struct data_spec spec = {.sample_ndim = 1, .sample_shape = {T}, .is_tokens = true, .num_classes = cfg.data.vocab};
    struct model m;
    cr_assert_eq(model_build(&m, &cfg, &spec, be, &pol, 1, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(ckpt_load_model(ckpt, &m, &err), AMP_OK, "%s", err.msg);
    int32_t *labels = calloc((size_t)T, sizeof *labels);
    struct batch b = {.n = 1, .tokens = (int32_t *)tokens, .labels = labels};
    struct step_ctx ctx = {.be = be, .policy = &m.policy, .training = false};
    model_forward(&m, &ctx, &b);
    const struct tensor *y = &m.layers[m.nlayers - 2].y; /* lm_head: (1, T, vocab) fp32 */
    cr_assert_eq(y->dtype, DT_FP32);
    *vocab = y->shape[2];
    float *out = malloc(y->numel * sizeof *out);
    tensor_to_host_f32(y, out);
    free(labels);
    model_free(&m);
    be->destroy(be);
    config_free(&cfg);
    return out;
}

Test(torch, logits_of_a_trained_export_match_pytorch)
{
    if (!have_torch())
        cr_skip_test("/usr/bin/python3 cannot import torch");
    static const int32_t tokens[] = {72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 0, 255, 300, 319};
    const int64_t T = (int64_t)(sizeof tokens / sizeof tokens[0]);
    int64_t vocab = 0;
    float *logits = amptrain_logits(tokens, T, &vocab);
    cr_assert_eq(vocab, 320);
    char path[600], list[400] = "", cmd[2400];
    snprintf(path, sizeof path, "%s/logits.f32", scratch);
    FILE *f = fopen(path, "wb");
    cr_assert_eq(fwrite(logits, sizeof *logits, (size_t)(T * vocab), f), (size_t)(T * vocab));
    fclose(f);
    for (int64_t i = 0; i < T; i++)
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%d", i ? "," : "", tokens[i]);
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/scripts/ref/gpt2_torch.py logits %s --heads 2 --tokens %s "
                              "--compare %s "
             "--rtol 1e-5 2>&1", AMP_SOURCE_DIR, hf, list, path);
    struct result r = shell(cmd);
    cr_log_info("%s", r.out);
    cr_assert_eq(r.code, 0, "torch's logits differ from ampTrain's: %s", r.out);
    cr_assert(strstr(r.out, "logits max_abs_diff"), "%s", r.out);
    free(logits);
}

Test(torch, training_from_torch_initialised_weights_matches_the_step_0_loss)
{
    if (!have_torch())
        cr_skip_test("/usr/bin/python3 cannot import torch");
    char init[600], cmd[2400];
    snprintf(init, sizeof init, "%s/torch-init.safetensors", scratch);
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/scripts/ref/gpt2_torch.py init %s --layers 2 --heads 2 --embd 32 "
             "--vocab 320 --block 32 --seed 7 2>&1 && /usr/bin/python3 %s/scripts/ref/gpt2_torch.py loss %s --heads 2 "
             "--tokens-file %s/train.bin --batch 8 --seq 16 2>&1", AMP_SOURCE_DIR, init, AMP_SOURCE_DIR, init, scratch);
    struct result r = shell(cmd);
    cr_assert_eq(r.code, 0, "%s", r.out);
    const char *at = strstr(r.out, "loss ");
    cr_assert_not_null(at, "%s", r.out);
    double torch_loss = atof(at + 5);
    r = amp("run " TINY " run.steps=1 data.sampling=sequential run.out_dir=%s/ft model.init_from=%s "
            "model.init_names=hf-gpt2", scratch, scratch, scratch, init);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "init_from: 28 of 28 tensors"), "%s", r.out);
    char csv[600], line[1024];
    snprintf(csv, sizeof csv, "%s/ft/scale_log.csv", scratch);
    FILE *f = fopen(csv, "r");
    cr_assert_not_null(f);
    cr_assert_not_null(fgets(line, sizeof line, f));
    cr_assert_not_null(fgets(line, sizeof line, f));
    fclose(f);
    double loss = NAN;
    cr_assert_eq(sscanf(line, "%*[^,],%*[^,],%lf", &loss), 1, "%s", line);
    cr_log_info("step-1 loss: ampTrain %.17g, torch %.17g, relative %.3g", loss, torch_loss,
                fabs(loss - torch_loss) / torch_loss);
    cr_assert(fabs(loss - torch_loss) <= 1e-5 * torch_loss, "ampTrain %.17g, torch %.17g", loss, torch_loss);
    cr_assert(fabs(loss - log(320.0)) > 1e-3, "not a uniform model: %g", loss);
}

/* scripts/ref/interop_torch.py rebuilds each reference model family in PyTorch from a checkpoint (h5py) and evaluates
 * the test split: its loss equals `ampTrain eval --autocast off` (eval.jsonl) within 1e-5 relative. */
Test(torch, interop_torch_py_agrees_with_eval_for_every_reference_family)
{
    if (system("/usr/bin/python3 -c 'import torch, h5py' >/dev/null 2>&1") != 0)
        cr_skip_test("/usr/bin/python3 lacks torch or h5py (Debian: python3-torch python3-h5py)");
    static const char *const runs[] = {
        "configs/fashion_mlp.yaml model.layers.1.out=32 model.layers.3.out=32",
        "configs/fashion_cnn.yaml model.layers.0.out=4 model.layers.4.out=4 model.layers.9.out=16",
        "configs/text_gpt.yaml model.layers.0.dim=32 model.layers.1.heads=2 model.layers.2.heads=2",
        "configs/gpt2_tiny.yaml data.train_bin=%s/train.bin data.val_bin=%s/val.bin",
    };
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        char cfg[600], dir[600], cmd[1400];
        snprintf(cfg, sizeof cfg, runs[i], scratch, scratch);
        snprintf(dir, sizeof dir, "%s/fam%zu", scratch, i);
        struct result r = amp("run %s run.device=cpu run.steps=10 data.batch_size=16 run.out_dir=%s", cfg, dir);
        cr_assert_eq(r.code, 0, "%s: %s", cfg, r.out);
        r = amp("eval %s --autocast off; tail -n 1 %s/eval.jsonl", dir, dir);
        cr_assert_eq(r.code, 0, "%s", r.out);
        const char *a = strstr(r.out, "\"loss\": ");
        cr_assert_not_null(a, "%s", r.out);
        double ours = atof(a + 8);
        snprintf(cmd, sizeof cmd, "cd %s && /usr/bin/python3 %s/scripts/ref/interop_torch.py %s/ckpt-10.h5 2>&1",
                 AMP_SOURCE_DIR, AMP_SOURCE_DIR, dir);
        r = shell(cmd);
        cr_assert_eq(r.code, 0, "%s", r.out);
        const char *b = strstr(r.out, "loss ");
        cr_assert_not_null(b, "%s", r.out);
        double theirs = atof(b + 5);
        cr_log_info("%s: eval loss %.9g, PyTorch %.9g", cfg, ours, theirs);
        cr_assert(fabs(ours - theirs) <= 1e-5 * ours, "%s: ampTrain eval %.9g vs PyTorch %.9g", cfg, ours, theirs);
    }
}
