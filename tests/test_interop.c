/*
 * test_interop.c — GPT-2 interop (docs/checkpoint.md): a tiny GPT-2 (configs/gpt2_tiny.yaml, lm_head tied to
 * the token table) trained a few steps; `export --names hf-gpt2` (Hugging Face's keys, Conv1D weights
 * transposed, lm_head.weight left out as save_pretrained leaves it) and `--names pytorch` (the tied table under
 * both state_dict names); `model.init_from` from a checkpoint and from each export, strict and not strict;
 * hostile files (truncated, bad header, NaN, a dtype ampTrain does not take, wrong shapes), each exit 4 naming
 * the file; and a resumed run that never reads init_from again. PyTorch's side is tests/test_interop_torch.c.
 */
#define _POSIX_C_SOURCE 200809L
#include "ckpt_testlib.h"

#include <math.h>
#include <sys/resource.h> /* getrusage: a child's peak memory */

#include "checkpoint.h"  /* ckpt_read_weights: the reference values */
#include "dtype.h"       /* dtype_convert */
#include "safetensors.h" /* safetensors_read, safetensors_write: planting faults */

static char ckpt[512], tokens[700];

#define WEIGHT_NAME_LEN 96

#define TINY "configs/gpt2_tiny.yaml run.device=cpu run.log_every=1 data.train_bin=%s/train.bin data.val_bin=%s/val.bin"

static void setup_tiny(void)
{
    make_scratch();
    char cmd[1400];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/scripts/tools/make_tokens.py --format nanogpt --val-fraction 0.1 -o "
             "%s/train.bin /usr/share/games/fortunes/cookie >/dev/null 2>&1", AMP_SOURCE_DIR, scratch);
    cr_assert_eq(shell(cmd).code, 0, "make_tokens.py failed");
    snprintf(tokens, sizeof tokens, "data.train_bin=%s/train.bin data.val_bin=%s/val.bin", scratch, scratch);
    struct result r = amp("run " TINY " run.steps=6 run.out_dir=%s/base", scratch, scratch, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    snprintf(ckpt, sizeof ckpt, "%s/base/ckpt-6.h5", scratch);
}

TestSuite(interop, .init = setup_tiny, .fini = remove_scratch);

static struct result export_to(const char *out, const char *names)
{
    char path[600];
    snprintf(path, sizeof path, "%s/%s", scratch, out);
    return amp("export %s %s --names %s", ckpt, path, names);
}

static const struct ckpt_tensor *weight(const struct ckpt_weights *w, const char *name)
{
    for (int i = 0; i < w->n; i++)
        if (!strcmp(w->tensors[i].name, name))
            return &w->tensors[i];
    cr_assert_fail("the checkpoint has no %s", name);
    return NULL;
}

Test(interop, the_tied_table_is_stored_once)
{
    struct ckpt_weights w;
    struct amp_error err = {0};
    cr_assert_eq(ckpt_read_weights(ckpt, &w, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(w.n, 2 + 2 * 12 + 2, "wte, wpe, 12 per block, ln_f: %d tensors", w.n);
    for (int i = 0; i < w.n; i++)
        cr_assert(strncmp(w.tensors[i].name, "lm_head", 7), "lm_head has no weight of its own: %s", w.tensors[i].name);
    ckpt_weights_free(&w);
}

/* A crafted qkv weight of another shape: 3-D, hf-gpt2's transpose read (96, 32) of it and
 * exported 2,976 of its 3,072 values from uninitialised heap, exit 0; 1-D, it exported as shape [0]. Now both are
 * exit 4 naming the tensor and both shapes, under every name set, and nothing is written. */
Test(interop, a_qkv_weight_of_another_shape_is_exit_4_not_exported)
{
    static const struct {
        int ndim;
        hsize_t dims[3];
        const char *got;
    } cases[] = {{3, {3, 32, 32}, "(3, 32, 32)"}, {1, {3072}, "(3072)"}};
    static const char *const names[] = {"hf-gpt2", "pytorch", "ampTrain"};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        char p[600], out[600], want[300];
        snprintf(p, sizeof p, "%s/qkv%zu.h5", scratch, k);
        snprintf(out, sizeof out, "%s/qkv%zu.safetensors", scratch, k);
        craft_tensor(ckpt, p, "h0/attn/qkv/weight", cases[k].ndim, cases[k].dims);
        snprintf(want, sizeof want, "tensor /model/h0/attn/qkv/weight has shape %s in the checkpoint but (96, 32) in "
                 "the config's model", cases[k].got);
        for (int n = 0; n < 3; n++) {
            struct result r = amp("export %s %s --names %s", p, out, names[n]);
            cr_assert_eq(r.code, 4, "%s --names %s: exit %d: %s", p, names[n], r.code, r.out);
            cr_assert(strstr(r.out, want) && strstr(r.out, "hint:"), "want '%s' in: %s", want, r.out);
            cr_assert(!file_exists(out), "%s was written", out);
        }
    }
}

/* Every hf-gpt2 key with its layout: Conv1D weights are the checkpoint's transposed, the rest equal. */
Test(interop, hf_gpt2_names_and_layouts)
{
    struct result r = export_to("hf.safetensors", "hf-gpt2");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "exported 28 tensors"), "%s", r.out);
    char path[600];
    snprintf(path, sizeof path, "%s/hf.safetensors", scratch);
    struct safetensors_file f;
    struct ckpt_weights w;
    struct amp_error err = {0};
    cr_assert_eq(safetensors_read(path, &f, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(ckpt_read_weights(ckpt, &w, &err), AMP_OK, "%s", err.msg);
    static const struct { const char *hf, *ours; bool transpose; } map[] = {
        {"transformer.wte.weight", "wte/wte", false},
        {"transformer.wpe.weight", "wte/wpe", false},
        {"transformer.h.0.ln_1.weight", "h0/ln1/weight", false},
        {"transformer.h.0.attn.c_attn.weight", "h0/attn/qkv/weight", true},
        {"transformer.h.0.attn.c_attn.bias", "h0/attn/qkv/bias", false},
        {"transformer.h.1.attn.c_proj.weight", "h1/attn/proj/weight", true},
        {"transformer.h.1.ln_2.bias", "h1/ln2/bias", false},
        {"transformer.h.1.mlp.c_fc.weight", "h1/mlp/fc/weight", true},
        {"transformer.h.0.mlp.c_proj.weight", "h0/mlp/proj/weight", true},
        {"transformer.h.0.mlp.c_proj.bias", "h0/mlp/proj/bias", false},
        {"transformer.ln_f.weight", "ln_f/weight", false},
    };
    for (size_t k = 0; k < sizeof map / sizeof map[0]; k++) {
        const struct safetensor *s = safetensors_find(&f, map[k].hf);
        cr_assert_not_null(s, "no %s", map[k].hf);
        const struct ckpt_tensor *t = weight(&w, map[k].ours);
        const float *v = s->data;
        if (!map[k].transpose) {
            cr_assert_eq(s->ndim, t->ndim);
            cr_assert_eq(memcmp(v, t->data, t->numel * 4), 0, "%s differs from %s", map[k].hf, map[k].ours);
            continue;
        }
        cr_assert(s->ndim == 2 && s->shape[0] == t->shape[1] && s->shape[1] == t->shape[0], "%s is (in, out)",
                  map[k].hf);
        for (int64_t i = 0; i < t->shape[0]; i++)
            for (int64_t j = 0; j < t->shape[1]; j++)
                cr_assert_eq(v[j * t->shape[0] + i], t->data[i * t->shape[1] + j], "%s[%lld][%lld]", map[k].hf,
                             (long long)j, (long long)i);
    }
    cr_assert_null(safetensors_find(&f, "lm_head.weight"), "tied: left out, as save_pretrained does");
    ckpt_weights_free(&w);
    safetensors_free(&f);
}

Test(interop, pytorch_names_give_the_tied_table_under_both_keys)
{
    struct result r = export_to("pt.safetensors", "pytorch");
    cr_assert_eq(r.code, 0, "%s", r.out);
    char path[600];
    snprintf(path, sizeof path, "%s/pt.safetensors", scratch);
    struct safetensors_file f;
    struct amp_error err = {0};
    cr_assert_eq(safetensors_read(path, &f, &err), AMP_OK, "%s", err.msg);
    const struct safetensor *a = safetensors_find(&f, "wte.wte"), *b = safetensors_find(&f, "lm_head.weight");
    cr_assert(a && b, "both state_dict names of the tied table");
    cr_assert_eq(a->nbytes, b->nbytes);
    cr_assert_eq(memcmp(a->data, b->data, a->nbytes), 0);
    cr_assert_eq(f.ntensors, 29);
    safetensors_free(&f);
}

Test(interop, hf_gpt2_is_refused_for_other_models)
{
    struct result r = amp("run configs/text_gpt.yaml run.device=cpu run.steps=1 run.log_every=1 "
                          "model.layers.1.heads=2 model.layers.0.dim=16 model.layers.2.heads=2 data.batch_size=4 "
                          "run.out_dir=%s/tg", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp("export %s/tg/ckpt-1.h5 %s/tg.safetensors --names hf-gpt2", scratch, scratch);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "hf-gpt2 names need a GPT-2 shaped model, but model.layers[4] 'lm_head' is a linear: "
                            "GPT-2's lm_head has no bias"), "%s", r.out);
    char out[600];
    snprintf(out, sizeof out, "%s/tg.safetensors", scratch);
    cr_assert(!file_exists(out));
}

/* The loss of step 1 (scale_log.csv's third column) of a run of the tiny GPT-2 with these overrides. */
static double first_loss(const char *dir, const char *overrides)
{
    struct result r = amp("run " TINY " run.steps=1 run.out_dir=%s/%s %s", scratch, scratch, scratch, dir, overrides);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char path[600];
    snprintf(path, sizeof path, "%s/%s/scale_log.csv", scratch, dir);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f);
    char line[1024];
    cr_assert_not_null(fgets(line, sizeof line, f));
    cr_assert_not_null(fgets(line, sizeof line, f));
    fclose(f);
    double loss = NAN;
    cr_assert_eq(sscanf(line, "%*[^,],%*[^,],%lf", &loss), 1, "%s", line);
    return loss;
}

Test(interop, init_from_a_checkpoint_and_from_each_export_starts_from_the_same_weights)
{
    cr_assert_eq(export_to("hf2.safetensors", "hf-gpt2").code, 0);
    cr_assert_eq(export_to("pt2.safetensors", "pytorch").code, 0);
    cr_assert_eq(export_to("at2.safetensors", "ampTrain").code, 0);
    char o[4][900];
    snprintf(o[0], sizeof o[0], "model.init_from=%s", ckpt);
    snprintf(o[1], sizeof o[1], "model.init_from=%s/hf2.safetensors model.init_names=hf-gpt2", scratch);
    snprintf(o[2], sizeof o[2], "model.init_from=%s/pt2.safetensors model.init_names=pytorch", scratch);
    snprintf(o[3], sizeof o[3], "model.init_from=%s/at2.safetensors", scratch);
    double fresh = first_loss("fresh", "");
    double from_ckpt = first_loss("i0", o[0]);
    cr_assert_neq(from_ckpt, fresh, "the trained weights were loaded (%g)", fresh);
    for (int i = 1; i < 4; i++) {
        char dir[8];
        snprintf(dir, sizeof dir, "i%d", i);
        double l = first_loss(dir, o[i]);
        cr_assert_eq(l, from_ckpt, "%s: loss %.9g, from the checkpoint %.9g", o[i], l, from_ckpt);
    }
    /* the run directory stands for its latest checkpoint too */
    char dir_opt[700];
    snprintf(dir_opt, sizeof dir_opt, "model.init_from=%s/base", scratch);
    cr_assert_eq(first_loss("i4", dir_opt), from_ckpt);
    /* `numerics CONFIG` measures the run the config starts: from init_from too */
    struct result r = amp("numerics " TINY " --steps 1 run.out_dir=%s/num %s", scratch, scratch, scratch, o[1]);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "init_from: 28 of 28 tensors"), "%s", r.out);
    char step1[64];
    snprintf(step1, sizeof step1, "step 1 | loss %.4f |", from_ckpt);
    cr_assert(strstr(r.out, step1), "want '%s' in %s", step1, r.out);
}

Test(interop, strict_lists_every_mismatch_and_not_strict_warns)
{
    cr_assert_eq(export_to("pt3.safetensors", "pytorch").code, 0);
    struct result r = amp("run " TINY " run.steps=1 run.out_dir=%s/s1 model.init_from=%s/pt3.safetensors", scratch,
                          scratch, scratch, scratch);
    cr_assert_eq(r.code, 4, "%s", r.out);
    char want[800];
    snprintf(want, sizeof want, "model.init_from: %s/pt3.safetensors does not match the model (ampTrain names, "
             "strict): missing keys: wte/wte, wte/wpe, h0/ln1/weight", scratch);
    cr_assert(strstr(r.out, want), "%s", r.out);
    cr_assert(strstr(r.out, "unexpected keys: "), "%s", r.out);
    cr_assert(strstr(r.out, "and 17 more"), "29 unexpected, 12 listed: %s", r.out);
    /* the export's metadata says its naming: the hint names the setting */
    cr_assert(strstr(r.out, "hint: the file says its names are pytorch: set model.init_names=pytorch"), "%s", r.out);
    r = amp("run " TINY " run.steps=1 run.out_dir=%s/s2 model.init_from=%s/pt3.safetensors model.init_strict=false",
            scratch, scratch, scratch, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "warning: model.init_from"), "%s", r.out);
    cr_assert(strstr(r.out, "init_from: 0 of 28 tensors"), "%s", r.out);
}

/* Rewrite the hf export with `edit` applied to its tensors, as another tool might have written it. */
typedef void (*edit_fn)(struct safetensor *t, int *n, float *scratch_values);

static void write_edited(const char *out, edit_fn edit)
{
    char in[600], path[600];
    snprintf(in, sizeof in, "%s/hfe.safetensors", scratch);
    snprintf(path, sizeof path, "%s/%s", scratch, out);
    if (!file_exists(in))
        cr_assert_eq(export_to("hfe.safetensors", "hf-gpt2").code, 0);
    struct safetensors_file f;
    struct amp_error err = {0};
    cr_assert_eq(safetensors_read(in, &f, &err), AMP_OK, "%s", err.msg);
    struct safetensor *t = calloc((size_t)f.ntensors + 2, sizeof *t);
    memcpy(t, f.tensors, (size_t)f.ntensors * sizeof *t);
    int n = f.ntensors;
    float *values = calloc(1 << 16, sizeof *values);
    edit(t, &n, values);
    cr_assert_eq(safetensors_write(path, t, n, NULL, 0, &err), AMP_OK, "%s", err.msg);
    free(values);
    free(t);
    safetensors_free(&f);
}

static struct safetensor *named(struct safetensor *t, int n, const char *name)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(t[i].name, name))
            return &t[i];
    cr_assert_fail("no %s", name);
    return NULL;
}

static void drop_ln_f_and_reshape_wpe(struct safetensor *t, int *n, float *v)
{
    (void)v;
    struct safetensor *ln = named(t, *n, "transformer.ln_f.bias");
    *ln = t[--*n];
    struct safetensor *wpe = named(t, *n, "transformer.wpe.weight");
    wpe->shape[0] = 16; /* (16, 64): the same bytes, another shape */
    wpe->shape[1] = 64;
    t[(*n)++] = (struct safetensor){.name = "transformer.h.7.mlp.c_fc.bias", .dtype = DT_FP32, .ndim = 1,
                                     .shape = {4}, .data = v, .nbytes = 16};
}

static void nan_in_c_attn(struct safetensor *t, int *n, float *v)
{
    struct safetensor *w = named(t, *n, "transformer.h.1.attn.c_attn.weight");
    memcpy(v, w->data, w->nbytes);
    v[5] = NAN;
    w->data = v;
}

static void lm_head_differs(struct safetensor *t, int *n, float *v)
{
    struct safetensor *wte = named(t, *n, "transformer.wte.weight");
    memcpy(v, wte->data, wte->nbytes);
    v[0] += 1.0f;
    t[(*n)++] = (struct safetensor){.name = "lm_head.weight", .dtype = DT_FP32, .ndim = 2,
                                     .shape = {wte->shape[0], wte->shape[1]}, .data = v, .nbytes = wte->nbytes};
}

static void lm_head_same_and_hf_buffers(struct safetensor *t, int *n, float *v)
{
    struct safetensor *wte = named(t, *n, "transformer.wte.weight");
    t[(*n)++] = (struct safetensor){.name = "lm_head.weight", .dtype = DT_FP32, .ndim = 2,
                                     .shape = {wte->shape[0], wte->shape[1]}, .data = wte->data, .nbytes = wte->nbytes};
    (void)v;
}

/* As the original `gpt2` upload on the Hugging Face hub has them: no "transformer." prefix, and the causal-mask
 * buffers h.N.attn.bias (1, 1, block, block) and h.N.attn.masked_bias (a scalar) beside the weights. */
static char bare_names[32][WEIGHT_NAME_LEN];

static void hub_layout(struct safetensor *t, int *n, float *v)
{
    for (int i = 0; i < *n; i++) {
        cr_assert(!strncmp(t[i].name, "transformer.", 12));
        snprintf(bare_names[i], sizeof bare_names[i], "%s", t[i].name + 12);
        t[i].name = bare_names[i];
    }
    for (int64_t i = 0; i < 32 * 32; i++)
        v[i] = (i % 32) <= (i / 32) ? 1.0f : 0.0f;
    v[32 * 32] = -1e4f;
    t[(*n)++] = (struct safetensor){.name = "h.0.attn.bias", .dtype = DT_FP32, .ndim = 4, .shape = {1, 1, 32, 32},
                                     .data = v, .nbytes = 32 * 32 * 4};
    t[(*n)++] = (struct safetensor){.name = "h.1.attn.masked_bias", .dtype = DT_FP32, .ndim = 0, .data = v + 32 * 32,
                                     .nbytes = 4};
}

static void all_bf16(struct safetensor *t, int *n, float *v)
{
    uint16_t *h = (uint16_t *)v;
    size_t off = 0;
    for (int i = 0; i < *n; i++) {
        size_t numel = t[i].nbytes / 4;
        dtype_convert(h + off, DT_BF16, t[i].data, DT_FP32, numel);
        t[i].data = h + off;
        t[i].dtype = DT_BF16;
        t[i].nbytes = numel * 2;
        off += numel;
    }
}

static struct result init_run(const char *dir, const char *file, const char *more)
{
    return amp("run " TINY " run.steps=1 run.out_dir=%s/%s model.init_from=%s/%s model.init_names=hf-gpt2 %s", scratch,
               scratch, scratch, dir, scratch, file, more);
}

Test(interop, hostile_and_mismatched_files)
{
    write_edited("mis.safetensors", drop_ln_f_and_reshape_wpe);
    struct result r = init_run("m1", "mis.safetensors", "");
    cr_assert_eq(r.code, 4, "%s", r.out);
    cr_assert(strstr(r.out, "mis.safetensors does not match the model (hf-gpt2 names, strict): missing keys: "
                            "transformer.ln_f.bias; unexpected keys: transformer.h.7.mlp.c_fc.bias; mismatches: "
                            "transformer.wpe.weight (16, 64) in the file, (32, 32) in the model"), "%s", r.out);
    r = init_run("m2", "mis.safetensors", "model.init_strict=false");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "init_from: 26 of 28 tensors"), "%s", r.out);

    write_edited("nan.safetensors", nan_in_c_attn);
    r = init_run("m3", "nan.safetensors", "model.init_strict=false");
    cr_assert_eq(r.code, 4, "%s", r.out);
    cr_assert(strstr(r.out, "nan.safetensors: tensor transformer.h.1.attn.c_attn.weight holds nan at element 5; "
                            "every value must be finite"), "%s", r.out);

    write_edited("tied.safetensors", lm_head_differs);
    r = init_run("m4", "tied.safetensors", "");
    cr_assert_eq(r.code, 4, "%s", r.out);
    cr_assert(strstr(r.out, "lm_head.weight holds other values than transformer.wte.weight, and the model ties the "
                            "two"), "%s", r.out);
    write_edited("tied2.safetensors", lm_head_same_and_hf_buffers);
    r = init_run("m5", "tied2.safetensors", "");
    cr_assert_eq(r.code, 0, "an lm_head.weight equal to the table is taken: %s", r.out);

    write_edited("bf16.safetensors", all_bf16);
    r = init_run("m6", "bf16.safetensors", "");
    cr_assert_eq(r.code, 0, "bf16 files widen exactly: %s", r.out);
    cr_assert(strstr(r.out, "init_from: 28 of 28 tensors"), "%s", r.out);

    /* the reader's faults: truncated, a header that is not JSON, an integer dtype */
    char src[600], bad[600], cmd[2000];
    snprintf(src, sizeof src, "%s/hfe.safetensors", scratch);
    snprintf(bad, sizeof bad, "%s/trunc.safetensors", scratch);
    snprintf(cmd, sizeof cmd, "head -c 5000 %s > %s", src, bad);
    cr_assert_eq(shell(cmd).code, 0);
    r = init_run("m7", "trunc.safetensors", "");
    cr_assert_eq(r.code, 4, "%s", r.out);
    cr_assert(strstr(r.out, "trunc.safetensors"), "%s", r.out);
    snprintf(bad, sizeof bad, "%s/json.safetensors", scratch);
    snprintf(cmd, sizeof cmd, "cp %s %s && printf '[' | dd of=%s bs=1 seek=8 conv=notrunc 2>/dev/null", src, bad, bad);
    cr_assert_eq(shell(cmd).code, 0);
    r = init_run("m8", "json.safetensors", "");
    cr_assert_eq(r.code, 4, "%s", r.out);
    cr_assert(strstr(r.out, "json.safetensors"), "%s", r.out);
    snprintf(bad, sizeof bad, "%s/i64.safetensors", scratch);
    snprintf(cmd, sizeof cmd, "sed 's/\"F32\"/\"I32\"/' %s > %s", src, bad);
    cr_assert_eq(shell(cmd).code, 0);
    r = init_run("m9", "i64.safetensors", "");
    cr_assert_eq(r.code, 4, "%s", r.out);
    cr_assert(strstr(r.out, "I32"), "%s", r.out);
    r = init_run("m10", "no-such.safetensors", "");
    cr_assert_eq(r.code, 4, "%s", r.out);
    cr_assert(strstr(r.out, "no-such.safetensors"), "%s", r.out);
}

Test(interop, names_and_files_that_do_not_fit_the_config)
{
    struct result r = amp("run " TINY " run.steps=1 run.out_dir=%s/n1 model.init_from=%s model.init_names=pytorch",
                          scratch, scratch, scratch, ckpt);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "is an ampTrain checkpoint, whose tensors have ampTrain names, but model.init_names is "
                            "pytorch"), "%s", r.out);
    r = amp("run configs/text_gpt.yaml run.device=cpu run.steps=1 run.out_dir=%s/n2 model.init_from=%s "
            "model.init_names=hf-gpt2", scratch, ckpt);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "model.init_names: hf-gpt2 names need a GPT-2 shaped model"), "%s", r.out);
    /* `check` says so too, before any data is read */
    r = amp("check configs/text_gpt.yaml model.init_from=%s model.init_names=hf-gpt2", ckpt);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "configs/text_gpt.yaml: model.init_names: hf-gpt2 names need a GPT-2 shaped model"), "%s",
              r.out);
    r = amp("check configs/gpt2_tiny.yaml model.init_from=%s model.init_names=hf-gpt2", ckpt);
    cr_assert_eq(r.code, 0, "%s", r.out);
}

/* A resumed run has its weights from the checkpoint and never opens init_from again (here: gone). */
Test(interop, resume_never_reads_init_from)
{
    char file[600];
    snprintf(file, sizeof file, "%s/gone.safetensors", scratch);
    cr_assert_eq(export_to("gone.safetensors", "hf-gpt2").code, 0);
    struct result r = amp("run " TINY " run.steps=4 run.ckpt_every=2 run.out_dir=%s/r1 model.init_from=%s "
                          "model.init_names=hf-gpt2", scratch, scratch, scratch, file);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp("run " TINY " run.steps=2 run.ckpt_every=2 run.out_dir=%s/r2 model.init_from=%s model.init_names=hf-gpt2",
            scratch, scratch, scratch, file);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert_eq(unlink(file), 0);
    r = amp("resume %s/r2/ckpt-2.h5 run.steps=4", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(!strstr(r.out, "init_from:"), "%s", r.out);
    char a[600], b[600];
    snprintf(a, sizeof a, "%s/r1/ckpt-4.h5", scratch);
    snprintf(b, sizeof b, "%s/r2/ckpt-4.h5", scratch);
    assert_same_tensors(a, b);
}

/* Files as others write them load to the same weights: the hub's layout of GPT-2 (no prefix, mask buffers), and
 * bf16 masters (precision.master_weights: bf16) from an fp32 file. */
Test(interop, hub_layout_and_bf16_masters)
{
    write_edited("hub.safetensors", hub_layout);
    char o[700];
    snprintf(o, sizeof o, "model.init_from=%s model.init_names=ampTrain", ckpt);
    double want = first_loss("h0", o);
    snprintf(o, sizeof o, "model.init_from=%s/hub.safetensors model.init_names=hf-gpt2", scratch);
    cr_assert_eq(first_loss("h1", o), want, "the hub's layout gives the checkpoint's weights");
    struct result r = init_run("h2", "hub.safetensors", "precision.mode=bf16 precision.master_weights=bf16 "
                               "optim.stochastic_rounding=true");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "init_from: 28 of 28 tensors"), "%s", r.out);
}

/* ---- init_from's reading of files that are not what they claim (docs/reliability.md) -------------------- */

TestSuite(init_from_files, .init = make_scratch, .fini = remove_scratch);

/* A file of `size` bytes (sparse: ftruncate) that begins with `head`. */
static void write_sparse(const char *path, const void *head, size_t len, off_t size)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    cr_assert(fd >= 0);
    cr_assert_eq(write(fd, head, len), (ssize_t)len);
    cr_assert_eq(ftruncate(fd, size), 0);
    cr_assert_eq(close(fd), 0);
}

/* safetensors_read of `path` in a child; its status, and the peak resident memory (KiB) of this process's
 * children so far, which is the child's when it is the first. */
static long read_in_child(const char *path, int *status)
{
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        struct safetensors_file f;
        struct amp_error e = {0};
        _exit((int)safetensors_read(path, &f, &e));
    }
    int ws = 0;
    cr_assert_eq(waitpid(pid, &ws, 0), pid);
    *status = WIFEXITED(ws) ? WEXITSTATUS(ws) : -1;
    struct rusage ru;
    cr_assert_eq(getrusage(RUSAGE_CHILDREN, &ru), 0);
    return ru.ru_maxrss;
}

/* init_from read the whole file before its first check: a wrong 6 GB file took 6.3 GB of memory.
 * The header length is checked after 8 bytes, the header before the data is read. */
static void refused_without_reading(const char *name, const void *head, size_t len, const char *why)
{
    char path[600];
    snprintf(path, sizeof path, "%s/%s", scratch, name);
    write_sparse(path, head, len, (off_t)2 << 30);
    int status = 0;
    long kib = read_in_child(path, &status);
    cr_log_info("%s: peak %ld KiB", name, kib);
    cr_assert_eq(status, AMP_ERR_CKPT, "%s: refused as a checkpoint error", name);
    /* 512 MiB: the ASan build's allocator writes the shadow of a buffer allocated for the file (an eighth of it) */
    cr_assert_lt(kib, 512 * 1024, "%s: a 2 GiB file refused with a peak of %ld KiB resident", name, kib);
    struct result r = amp("run configs/fashion_mlp.yaml " SMALL " run.steps=1 run.out_dir=%s/out model.init_from=%s",
                          scratch, path);
    cr_assert_eq(r.code, 4, "%s", r.out);
    cr_assert(strstr(r.out, path) && strstr(r.out, why) && strstr(r.out, "hint: "), "%s", r.out);
}

Test(init_from_files, a_large_wrong_file_is_refused_from_its_header)
{
    const unsigned char beyond[8] = {0, 0, 0, 0, 0, 1, 0, 0}; /* 2^40 */
    refused_without_reading("beyond.safetensors", beyond, sizeof beyond, "beyond the 104857600-byte limit");
}

Test(init_from_files, a_large_file_without_a_json_header_is_refused_from_its_first_bytes)
{
    const unsigned char nojson[9] = {16, 0, 0, 0, 0, 0, 0, 0, '['};
    refused_without_reading("nojson.safetensors", nojson, sizeof nojson, "does not start with '{'");
}

Test(init_from_files, a_large_file_whose_header_does_not_cover_its_data_is_refused_before_the_data)
{
    const char json[] = "{\"__metadata__\": {}}    ";
    unsigned char head[8 + sizeof json - 1] = {sizeof json - 1};
    memcpy(head + 8, json, sizeof json - 1);
    refused_without_reading("uncovered.safetensors", head, sizeof head, "the tensors cover 0 bytes of data");
}

/* A file of `len` bytes of `head` and zeros after them up to 4096. */
static void write_headed(const char *path, const char *head, size_t len)
{
    char buf[4096] = {0};
    memcpy(buf, head, len);
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    cr_assert_eq(fwrite(buf, 1, sizeof buf, f), sizeof buf);
    cr_assert_eq(fclose(f), 0);
}

/* An HDF5 file of one dataset, as Keras's save_weights writes them (h5py), with a user block of `userblock` bytes
 * before HDF5's signature (0: none). */
static void write_h5(const char *path, hsize_t userblock)
{
    hid_t fcpl = H5Pcreate(H5P_FILE_CREATE);
    cr_assert(fcpl >= 0 && H5Pset_userblock(fcpl, userblock) >= 0);
    hid_t f = H5Fcreate(path, H5F_ACC_TRUNC, fcpl, H5P_DEFAULT);
    cr_assert(f >= 0);
    hsize_t dims[2] = {4, 3};
    float w[12] = {0};
    hid_t space = H5Screate_simple(2, dims, NULL);
    hid_t d = H5Dcreate2(f, "dense_kernel", H5T_IEEE_F32LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    cr_assert(d >= 0 && H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, w) >= 0);
    H5Dclose(d);
    H5Sclose(space);
    H5Fclose(f);
    H5Pclose(fcpl);
}

static void assert_named(const char *name, const char *what, const char *hint)
{
    char path[600];
    snprintf(path, sizeof path, "%s/%s", scratch, name);
    struct safetensors_file f;
    struct amp_error e = {0};
    cr_assert_eq(safetensors_read(path, &f, &e), AMP_ERR_CKPT, "%s", name);
    cr_assert(strstr(e.msg, path) && strstr(e.msg, what) && strstr(e.msg, "not a safetensors file"), "%s: %s", name,
              e.msg);
    cr_assert(strstr(e.hint, hint), "%s: hint: %s", name, e.hint);
}

/* init_from on a Keras .h5 or a PyTorch .bin said "the header length is ... beyond the limit": the format its magic
 * bytes show is named, with how to convert it. */
Test(init_from_files, files_of_other_formats_are_named_with_a_hint)
{
    static const struct {
        const char *name, *head;
        size_t len;
        const char *what, *hint;
    } cases[] = {
        {"torch.bin", "PK\x03\x04\x00\x00\x08\x00\x00\x00", 10, "a ZIP archive (PyTorch's torch.save format",
         "safetensors.torch.save_file(torch.load("},
        {"legacy.bin", "\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20", 10, "a Python pickle, protocol 2",
         "safetensors.torch.save_file("},
        {"p3.pt", "\x80\x03}q\x00(X", 7, "a Python pickle, protocol 3", "safetensors.torch.save_file("},
        {"p4.pt", "\x80\x04\x95\x10\x00\x00\x00\x00", 8, "a Python pickle, protocol 4", "safetensors.torch.save_file("},
        {"p5.pt", "\x80\x05\x95\x10\x00\x00\x00\x00", 8, "a Python pickle, protocol 5", "safetensors.torch.save_file("},
        {"model.gguf", "GGUF\x03\x00\x00\x00\x02", 9, "a GGUF file (llama.cpp)", "gguf"},
        {"ckpt-9.h5", "AMPTCKPT\x01", 9, "an ampTrain checkpoint", "ampTrain export"},
    };
    char path[600];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", scratch, cases[i].name);
        write_headed(path, cases[i].head, cases[i].len);
        assert_named(cases[i].name, cases[i].what, cases[i].hint);
    }
    snprintf(path, sizeof path, "%s/keras.h5", scratch);
    write_h5(path, 0);
    assert_named("keras.h5", "an HDF5 file (Keras .h5, h5py)", "safetensors.numpy.save_file");
    snprintf(path, sizeof path, "%s/userblock.h5", scratch);
    write_h5(path, 1024);
    assert_named("userblock.h5", "an HDF5 file (Keras .h5, h5py)", "safetensors.numpy.save_file");
    /* a pickle's opcode is never 0: a cut safetensors file with a 640-byte header is not called one */
    struct safetensors_file f;
    struct amp_error e = {0};
    cr_assert_eq(safetensors_parse((const unsigned char *)"\x80\x02\x00\x00\x00\x00\x00\x00{}", 10, "cut", &f, &e),
                 AMP_ERR_CKPT);
    cr_assert(strstr(e.msg, "cut: the header length is 640 bytes but the file has only 2 after it"), "%s", e.msg);
    /* and through the program: exit 4 naming the file and its format */
    const char *cli[][2] = {{"keras.h5", "is an HDF5 file (Keras .h5, h5py)"}, {"torch.bin", "is a ZIP archive"},
                            {"legacy.bin", "is a Python pickle"}};
    for (int i = 0; i < 3; i++) {
        struct result r = amp("run configs/fashion_mlp.yaml " SMALL " run.steps=1 run.out_dir=%s/out "
                              "model.init_from=%s/%s", scratch, scratch, cli[i][0]);
        cr_assert_eq(r.code, 4, "%s", r.out);
        cr_assert(strstr(r.out, cli[i][0]) && strstr(r.out, cli[i][1]) && strstr(r.out, "hint: "), "%s", r.out);
    }
}

/* ---- the reader's __metadata__ ------------------------------------------------------------------------------- */

/* A safetensors file (8-byte length, header, no data) whose __metadata__ holds n entries "kI": "vI". */
static unsigned char *metadata_file(int n, size_t *size)
{
    size_t cap = 64 + (size_t)n * 32, len = 8;
    unsigned char *b = malloc(cap);
    cr_assert_not_null(b);
    len += (size_t)snprintf((char *)b + len, cap - len, "{\"__metadata__\": {");
    for (int i = 0; i < n; i++)
        len += (size_t)snprintf((char *)b + len, cap - len, "%s\"k%d\": \"v%d\"", i ? ", " : "", i, i);
    len += (size_t)snprintf((char *)b + len, cap - len, "}}");
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)((uint64_t)(len - 8) >> (8 * i));
    *size = len;
    return b;
}

/* 50,000 metadata entries took 14-25 s under ASan: each entry grew two arrays by one element. */
Test(safetensors_reader, many_metadata_entries_parse_in_linear_time, .timeout = 10)
{
    enum { N = 200000 };
    size_t size;
    unsigned char *b = metadata_file(N, &size);
    struct safetensors_file f;
    struct amp_error e = {0};
    cr_assert_eq(safetensors_parse(b, size, "meta.safetensors", &f, &e), AMP_OK, "%s", e.msg);
    cr_assert_eq(f.nmeta, N);
    char want[32];
    for (int i = 0; i < N; i += 997) {
        snprintf(want, sizeof want, "k%d", i);
        cr_assert_str_eq(f.meta_keys[i], want);
        snprintf(want, sizeof want, "v%d", i);
        cr_assert_str_eq(f.meta_values[i], want);
    }
    cr_assert_str_eq(f.meta_values[N - 1], "v199999");
    safetensors_free(&f);
    free(b);
}

/* ---- init_from: tensors at any alignment ------------------------------------------------------------------ */

/* `from` with its header one space longer (the format allows any header length): the data then starts at an
 * odd offset, and every F16/BF16 element at an odd address. */
static void reheader_odd(const char *from, const char *to)
{
    FILE *f = fopen(from, "rb");
    cr_assert_not_null(f);
    cr_assert_eq(fseek(f, 0, SEEK_END), 0);
    size_t size = (size_t)ftell(f);
    rewind(f);
    unsigned char *b = malloc(size + 1);
    cr_assert(b && fread(b, 1, size, f) == size);
    fclose(f);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = n << 8 | b[i];
    memmove(b + 8 + n + 1, b + 8 + n, size - 8 - n);
    b[8 + n] = ' ';
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)((n + 1) >> (8 * i));
    f = fopen(to, "wb");
    cr_assert(f && fwrite(b, 1, size + 1, f) == size + 1);
    cr_assert_eq(fclose(f), 0);
    free(b);
}

/* The line of the final evaluation, which depends on every weight. */
static const char *eval_line(const struct result *r, char *out, size_t len)
{
    const char *e = strstr(r->out, "eval step");
    cr_assert_not_null(e, "%s", r->out);
    snprintf(out, len, "%.*s", (int)strcspn(e, "\n"), e);
    return out;
}

/* Under UBSan init_from of an F16/BF16 file whose header length is not a multiple of 8 stopped at a misaligned
 * uint16_t load (dtype_simd.c's tails; dtype.c's loop with AMPTRAIN_DTYPE_PORTABLE=1), exit 1. */
Test(init_from_files, fp16_and_bf16_tensors_at_odd_offsets_load_as_aligned_ones)
{
    struct result r = amp("run configs/fashion_mlp.yaml " SMALL " run.steps=1 run.ckpt_every=1 run.out_dir=%s/base",
                          scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    const char *dtypes[] = {"fp16", "bf16"};
    for (int k = 0; k < 2; k++) {
        char aligned[600], odd[600], want[256], got[256];
        snprintf(aligned, sizeof aligned, "%s/%s.safetensors", scratch, dtypes[k]);
        snprintf(odd, sizeof odd, "%s/%s_odd.safetensors", scratch, dtypes[k]);
        r = amp("export %s/base/ckpt-1.h5 %s --dtype %s", scratch, aligned, dtypes[k]);
        cr_assert_eq(r.code, 0, "%s", r.out);
        reheader_odd(aligned, odd);
        struct safetensors_file a, b;
        struct amp_error e = {0};
        cr_assert_eq(safetensors_read(aligned, &a, &e), AMP_OK, "%s", e.msg);
        cr_assert_eq(safetensors_read(odd, &b, &e), AMP_OK, "%s", e.msg);
        cr_assert_eq(b.data_start % 2, 1, "the data start at an odd offset");
        cr_assert_eq(b.ntensors, a.ntensors);
        for (int i = 0; i < a.ntensors; i++) {
            size_t n = a.tensors[i].nbytes / 2;
            float *va = malloc(n * sizeof *va), *vb = malloc(n * sizeof *vb);
            cr_assert(va && vb);
            dtype_convert(va, DT_FP32, a.tensors[i].data, a.tensors[i].dtype, n);
            dtype_convert(vb, DT_FP32, b.tensors[i].data, b.tensors[i].dtype, n);
            cr_assert_eq(memcmp(va, vb, n * sizeof *va), 0, "%s: the same values", a.tensors[i].name);
            free(va);
            free(vb);
        }
        safetensors_free(&a);
        safetensors_free(&b);
        const char *run = "run configs/fashion_mlp.yaml " SMALL " run.steps=1 run.out_dir=%s/%s_%d model.init_from=%s";
        r = amp(run, scratch, dtypes[k], 0, aligned);
        cr_assert_eq(r.code, 0, "%s", r.out);
        eval_line(&r, want, sizeof want);
        for (int portable = 0; portable < 2; portable++) {
            setenv("AMPTRAIN_DTYPE_PORTABLE", portable ? "1" : "0", 1);
            r = amp(run, scratch, dtypes[k], 1 + portable, odd);
            cr_assert_eq(r.code, 0, "%s (AMPTRAIN_DTYPE_PORTABLE=%d): %s", odd, portable, r.out);
            cr_assert(strstr(r.out, "init_from: 6 of 6 tensors"), "%s", r.out);
            cr_assert_str_eq(eval_line(&r, got, sizeof got), want, "the odd file trains as the aligned one");
        }
        unsetenv("AMPTRAIN_DTYPE_PORTABLE");
    }
}

/* A file whose names match but whose shapes do not gets a hint about the model, not about names. */
Test(interop, shapes_alone_get_a_hint_about_the_model)
{
    cr_assert_eq(export_to("hf_shapes.safetensors", "hf-gpt2").code, 0);
    struct result r = amp("run " TINY " run.steps=1 run.out_dir=%s/shapes model.init_from=%s/hf_shapes.safetensors "
                          "model.init_names=hf-gpt2 model.layers.0.dim=64",
                          scratch, scratch, scratch, scratch);
    cr_assert_eq(r.code, 4, "%s", r.out);
    cr_assert(strstr(r.out, "mismatches: transformer.wte.weight (320, 32) in the file, (320, 64) in the model"), "%s",
              r.out);
    cr_assert(strstr(r.out, "hint: the names match but the shapes do not: the file holds another model"), "%s", r.out);
}
