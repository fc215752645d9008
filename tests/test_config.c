/*
 * test_config.c — the strict YAML config reader (lib/base/config.c).
 *
 * What is checked, on values: every default; numbers such as 1e-4; the reference configs in configs/
 * load and finalize; every class of bad input gives AMP_ERR_CONFIG with the exact FILE:LINE:COL and
 * message (unknown key with did-you-mean, wrong type, out of range, duplicate key, tab, unclosed
 * bracket, empty file, missing file, yes/no, quoted numbers, layer errors, cross-key errors);
 * overrides change exactly what they name and fail with messages naming the override; printing
 * the resolved config and parsing it back gives an equal config; docs/config.md names every key.
 *
 * Most bad configs are inline: the faulty lines come first, then BASE (a valid data + model
 * section), so the expected line numbers can be read off the string.
 */
#define _POSIX_C_SOURCE 200809L /* open_memstream */
#include <criterion/criterion.h>

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h" /* config_parse_string, config_load, config_apply_override, config_print_yaml, ... */

#define FIXTURES AMP_SOURCE_DIR "/tests/data/config/"

#define BASE_DATA                                                                                                      \
    "data:\n"                                                                                                          \
    "  format: idx\n"                                                                                                  \
    "  train_images: a\n"                                                                                              \
    "  train_labels: b\n"                                                                                              \
    "  test_images: c\n"                                                                                               \
    "  test_labels: d\n"
#define BASE_MODEL                                                                                                     \
    "model:\n"                                                                                                         \
    "  layers:\n"                                                                                                      \
    "    - kind: flatten\n"                                                                                            \
    "    - kind: linear\n"                                                                                             \
    "      out: 10\n"                                                                                                  \
    "    - kind: cross_entropy\n"
#define BASE BASE_DATA BASE_MODEL

/* ---- helpers ---------------------------------------------------------------------------------- */

static void parse_ok(struct config *cfg, const char *yaml)
{
    struct amp_error err = {0};
    enum amp_status st = config_parse_string(cfg, yaml, strlen(yaml), "t.yaml", &err);
    cr_assert_eq(st, AMP_OK, "expected the config to parse, got %d: %s (hint: %s)\n--- yaml:\n%s", st, err.msg,
                 err.hint, yaml);
}

/* Parse `yaml`, expect AMP_ERR_CONFIG with msg starting with `prefix` (the position) and containing
 * `msg`, and a hint containing `hint` (when not NULL). */
static void expect_error(const char *yaml, const char *prefix, const char *msg, const char *hint)
{
    struct config cfg;
    struct amp_error err = {0};
    enum amp_status st = config_parse_string(&cfg, yaml, strlen(yaml), "t.yaml", &err);
    cr_assert_eq(st, AMP_ERR_CONFIG, "expected AMP_ERR_CONFIG, got %d for:\n%s", st, yaml);
    cr_assert_eq(err.code, AMP_ERR_CONFIG);
    cr_assert(!strncmp(err.msg, prefix, strlen(prefix)), "message '%s' should start with '%s'", err.msg, prefix);
    cr_assert(strstr(err.msg, msg), "message '%s' should contain '%s'", err.msg, msg);
    cr_assert(err.hint[0], "every error has a hint (message '%s')", err.msg);
    if (hint)
        cr_assert(strstr(err.hint, hint), "hint '%s' should contain '%s'", err.hint, hint);
    cr_assert_null(cfg.model.layers, "a failed parse leaves the config freed");
    config_free(&cfg);
}

/* The whole message must be exactly `msg`. */
static void expect_error_exact(const char *yaml, const char *msg)
{
    expect_error(yaml, msg, msg, NULL);
    struct config cfg;
    struct amp_error err = {0};
    config_parse_string(&cfg, yaml, strlen(yaml), "t.yaml", &err);
    cr_assert_str_eq(err.msg, msg);
    config_free(&cfg);
}

static void load_ok(struct config *cfg, const char *path)
{
    struct amp_error err = {0};
    enum amp_status st = config_load(cfg, path, &err);
    cr_assert_eq(st, AMP_OK, "%s: %s (hint: %s)", path, err.msg, err.hint);
}

static void expect_load_error(const char *file, const char *pos, const char *msg, const char *hint)
{
    char path[1024], prefix[1200];
    snprintf(path, sizeof path, FIXTURES "%s", file);
    snprintf(prefix, sizeof prefix, "%s%s", path, pos);
    struct config cfg;
    struct amp_error err = {0};
    enum amp_status st = config_load(&cfg, path, &err);
    cr_assert_eq(st, AMP_ERR_CONFIG, "%s: expected AMP_ERR_CONFIG, got %d", file, st);
    cr_assert(!strncmp(err.msg, prefix, strlen(prefix)), "message '%s' should start with '%s'", err.msg, prefix);
    cr_assert(strstr(err.msg, msg), "message '%s' should contain '%s'", err.msg, msg);
    if (hint)
        cr_assert(strstr(err.hint, hint), "hint '%s' should contain '%s'", err.hint, hint);
    config_free(&cfg);
}

static void override_ok(struct config *cfg, const char *ov)
{
    struct amp_error err = {0};
    enum amp_status st = config_apply_override(cfg, ov, &err);
    cr_assert_eq(st, AMP_OK, "override '%s': %s (hint: %s)", ov, err.msg, err.hint);
    st = config_finalize(cfg, &err);
    cr_assert_eq(st, AMP_OK, "finalize after '%s': %s (hint: %s)", ov, err.msg, err.hint);
}

/* The override must fail with exactly `msg`, and leave the config as it was. */
static void expect_override_error(struct config *cfg, const char *ov, const char *msg, const char *hint)
{
    struct config before;
    struct amp_error err = {0};
    cr_assert_eq(config_copy(&before, cfg, &err), AMP_OK);
    enum amp_status st = config_apply_override(cfg, ov, &err);
    cr_assert_eq(st, AMP_ERR_CONFIG, "override '%s' should fail, got %d", ov, st);
    cr_assert_str_eq(err.msg, msg);
    if (hint)
        cr_assert(strstr(err.hint, hint), "hint '%s' should contain '%s'", err.hint, hint);
    cr_assert(config_equal(cfg, &before), "a failed override leaves the config unchanged");
    config_free(&before);
}

/* print -> parse -> equal, and printing the re-parsed config gives the same text. */
static void expect_round_trip(const struct config *cfg)
{
    char *text = config_to_yaml_string(cfg);
    cr_assert_not_null(text);
    struct config back;
    struct amp_error err = {0};
    enum amp_status st = config_parse_string(&back, text, strlen(text), "printed.yaml", &err);
    cr_assert_eq(st, AMP_OK, "the printed config does not parse: %s (hint: %s)\n%s", err.msg, err.hint, text);
    cr_assert(config_equal(cfg, &back), "print -> parse changed the config:\n%s", text);
    char *again = config_to_yaml_string(&back);
    cr_assert_not_null(again);
    cr_assert_str_eq(again, text);

    /* config_print_yaml writes the same text to a FILE. */
    FILE *f = tmpfile();
    cr_assert_not_null(f);
    config_print_yaml(cfg, f);
    long n = ftell(f);
    cr_assert_eq(n, (long)strlen(text));
    rewind(f);
    char *filed = calloc((size_t)n + 1, 1);
    cr_assert_not_null(filed);
    cr_assert_eq(fread(filed, 1, (size_t)n, f), (size_t)n);
    cr_assert_str_eq(filed, text);
    fclose(f);
    free(filed);
    free(again);
    free(text);
    config_free(&back);
}

/* Names of the YAML files in configs/ (at most 64), sorted. */
static int list_configs(char names[][256], int max)
{
    DIR *dir = opendir(AMP_SOURCE_DIR "/configs");
    cr_assert_not_null(dir, "cannot open configs/");
    int n = 0;
    struct dirent *e;
    while ((e = readdir(dir)) && n < max) {
        size_t len = strlen(e->d_name);
        if (len > 5 && !strcmp(e->d_name + len - 5, ".yaml"))
            snprintf(names[n++], 256, "%s", e->d_name);
    }
    closedir(dir);
    qsort(names, (size_t)n, 256, (int (*)(const void *, const void *))strcmp);
    return n;
}

/* ---- defaults --------------------------------------------------------------------------------- */

Test(defaults, every_key_has_its_default)
{
    struct config c;
    config_defaults(&c);
    cr_assert_str_eq(c.run.name, "run");
    cr_assert_str_eq(c.run.out_dir, "runs/run");
    cr_assert_eq(c.run.seed, 1234u);
    cr_assert_str_eq(c.run.device, "auto");
    cr_assert_eq(c.run.steps, 0);
    cr_assert_eq(c.run.epochs, 1);
    cr_assert_eq(c.run.log_every, 50);
    cr_assert_eq(c.run.eval_every, 0);
    cr_assert_eq(c.run.ckpt_every, 0);
    cr_assert_eq(c.run.keep_ckpts, 3);

    cr_assert_eq(c.data.format, DATA_IDX);
    cr_assert_str_eq(c.data.train_images, "");
    cr_assert_str_eq(c.data.path, "");
    cr_assert_str_eq(c.data.x_key, "x");
    cr_assert_str_eq(c.data.y_key, "y");
    cr_assert_eq(c.data.nfiles, 0);
    cr_assert_eq(c.data.seq_len, 64);
    cr_assert_eq(c.data.val_fraction, 0.1);
    cr_assert_eq(c.data.batch_size, 64);
    cr_assert_eq(c.data.shuffle, true);
    cr_assert_eq(c.data.mean, 0.0);
    cr_assert_eq(c.data.std, 1.0);

    cr_assert_eq(c.model.init, INIT_PYTORCH);
    cr_assert_null(c.model.layers);
    cr_assert_eq(c.model.nlayers, 0);

    cr_assert_eq(c.optim.kind, OPTIM_ADAMW);
    cr_assert_eq(c.optim.lr, 1e-3);
    cr_assert_eq(c.optim.betas[0], 0.9);
    cr_assert_eq(c.optim.betas[1], 0.999);
    cr_assert_eq(c.optim.eps, 1e-8);
    cr_assert_eq(c.optim.weight_decay, 0.01);
    cr_assert_eq(c.optim.momentum, 0.0);
    cr_assert_eq(c.optim.nesterov, false);
    cr_assert_eq(c.optim.schedule.kind, SCHED_CONSTANT);
    cr_assert_eq(c.optim.schedule.warmup_steps, 0);
    cr_assert_eq(c.optim.schedule.step_size, 1000);
    cr_assert_eq(c.optim.schedule.gamma, 0.1);
    cr_assert_eq(c.optim.schedule.min_lr, 0.0);

    cr_assert_eq(c.precision.mode, PREC_FP32);
    cr_assert_eq(c.precision.loss_scale.init, 65536.0);
    cr_assert_eq(c.precision.loss_scale.growth_factor, 2.0);
    cr_assert_eq(c.precision.loss_scale.backoff_factor, 0.5);
    cr_assert_eq(c.precision.loss_scale.growth_interval, 2000);
    cr_assert_eq(c.precision.loss_scale.hysteresis, 1);
    cr_assert_eq(c.precision.loss_scale.min, 1.0);
    cr_assert_eq(c.precision.loss_scale.max, 16777216.0);
    cr_assert_eq(c.precision.loss_scale.value, 65536.0);
    cr_assert_eq(c.precision.autocast.nlowp, 0);
    cr_assert_eq(c.precision.autocast.nfp32, 0);
    cr_assert_eq(c.precision.autocast.npromote, 0);
    cr_assert_eq(c.precision.tf32, false);

    cr_assert_eq(c.accum_steps, 1);
    cr_assert_eq(c.clip.max_norm, 0.0);
    cr_assert_eq(c.clip.norm_type, 2.0);
    cr_assert_eq(c.stability.on_nonfinite, NONFINITE_SKIP);
    cr_assert_eq(c.stability.max_consecutive_skips, 100);
    config_free(&c);
}

Test(defaults, a_minimal_file_gets_the_same_defaults)
{
    struct config c, d;
    parse_ok(&c, BASE);
    config_defaults(&d);
    /* Same as the built-in defaults in every section but data and model. */
    cr_assert_str_eq(c.run.out_dir, "runs/run");
    cr_assert_eq(c.run.epochs, 1);
    cr_assert_eq(memcmp(&c.optim, &d.optim, sizeof c.optim), 0);
    cr_assert_eq(memcmp(&c.precision, &d.precision, sizeof c.precision), 0);
    cr_assert_eq(c.accum_steps, 1);
    cr_assert_eq(c.data.batch_size, 64);
    cr_assert_str_eq(c.source, "t.yaml");
    cr_assert_eq(c.model.nlayers, 3);
    cr_assert_str_eq(c.model.layers[0].name, "flatten_0");
    cr_assert_str_eq(c.model.layers[1].name, "linear_1");
    cr_assert_str_eq(c.model.layers[2].name, "cross_entropy_2");
    cr_assert_eq(c.model.layers[1].out, 10);
    cr_assert_eq(c.model.layers[1].bias, true);
    config_free(&c);
    config_free(&d);
}

Test(defaults, layer_defaults_per_kind)
{
    struct config c;
    parse_ok(&c, "data:\n"
                 "  format: text\n"
                 "  files: [a.txt]\n"
                 "  seq_len: 32\n"
                 "model:\n"
                 "  layers:\n"
                 "    - kind: conv2d\n"
                 "      out: 8\n"
                 "      kernel: 3\n"
                 "    - kind: maxpool2d\n"
                 "      kernel: 2\n"
                 "    - kind: avgpool2d\n"
                 "      kernel: 3\n"
                 "      stride: 1\n"
                 "    - kind: batchnorm2d\n"
                 "    - kind: layernorm\n"
                 "    - kind: dropout\n"
                 "    - kind: gelu\n"
                 "    - kind: embedding\n"
                 "      dim: 16\n"
                 "    - kind: attention\n"
                 "      heads: 2\n"
                 "    - kind: transformer_block\n"
                 "      heads: 4\n"
                 "    - kind: gelu\n"
                 "      approximate: none\n"
                 "    - kind: mse\n");
    const struct layer_config *l = c.model.layers;
    cr_assert_eq(c.model.nlayers, 12);
    cr_assert_eq(l[0].kind, LAYER_CONV2D);
    cr_assert_eq(l[0].stride, 1);
    cr_assert_eq(l[0].padding, 0);
    cr_assert_eq(l[0].bias, true);
    cr_assert_eq(l[1].stride, 2, "pool stride defaults to the kernel");
    cr_assert_eq(l[1].padding, 0);
    cr_assert_eq(l[2].stride, 1, "an explicit pool stride is kept");
    cr_assert_eq(l[3].eps, 1e-5);
    cr_assert_eq(l[3].momentum, 0.1);
    cr_assert_eq(l[4].eps, 1e-5);
    cr_assert_eq(l[5].p, 0.1);
    cr_assert_eq(l[6].approximate, GELU_TANH);
    cr_assert_eq(l[7].vocab, 256);
    cr_assert_eq(l[7].dim, 16);
    cr_assert_eq(l[7].max_len, 32, "embedding max_len defaults to data.seq_len");
    cr_assert_eq(l[8].heads, 2);
    cr_assert_eq(l[8].dim, 0, "attention dim 0 = inferred");
    cr_assert_eq(l[9].mlp_ratio, 4);
    cr_assert_eq(l[9].approximate, GELU_TANH);
    cr_assert_eq(l[9].dim, 0);
    cr_assert_eq(l[10].approximate, GELU_ERF);
    cr_assert_str_eq(l[10].name, "gelu_10");
    cr_assert_str_eq(l[11].name, "mse_11");
    config_free(&c);
}

Test(defaults, weight_decay_depends_on_the_optimizer)
{
    struct config c;
    parse_ok(&c, "optim:\n  kind: sgd\n" BASE);
    cr_assert_eq(c.optim.weight_decay, 0.0);
    config_free(&c);
    parse_ok(&c, "optim:\n  kind: adamw\n" BASE);
    cr_assert_eq(c.optim.weight_decay, 0.01);
    config_free(&c);
    parse_ok(&c, "optim:\n  kind: sgd\n  weight_decay: 0.05\n" BASE);
    cr_assert_eq(c.optim.weight_decay, 0.05);
    config_free(&c);
}

Test(defaults, steps_or_epochs)
{
    struct config c;
    parse_ok(&c, "run:\n  steps: 500\n" BASE);
    cr_assert_eq(c.run.steps, 500);
    cr_assert_eq(c.run.epochs, 0, "with steps set, epochs is 0");
    config_free(&c);
    parse_ok(&c, "run:\n  epochs: 3\n" BASE);
    cr_assert_eq(c.run.steps, 0);
    cr_assert_eq(c.run.epochs, 3);
    config_free(&c);
    parse_ok(&c, "run:\n  steps: 0\n  epochs: 0\n" BASE);
    cr_assert_eq(c.run.epochs, 1, "neither: one epoch");
    config_free(&c);
    parse_ok(&c, "run:\n  name: exp7\n" BASE);
    cr_assert_str_eq(c.run.out_dir, "runs/exp7");
    config_free(&c);
}

Test(names, enum_names)
{
    cr_assert_str_eq(layer_kind_name(LAYER_LINEAR), "linear");
    cr_assert_str_eq(layer_kind_name(LAYER_ATTENTION), "attention");
    cr_assert_str_eq(layer_kind_name(LAYER_TRANSFORMER_BLOCK), "transformer_block");
    cr_assert_str_eq(layer_kind_name(LAYER_MSE), "mse");
    cr_assert_str_eq(precision_mode_name(PREC_FP32), "fp32");
    cr_assert_str_eq(precision_mode_name(PREC_FP16_STATIC), "fp16-static");
    cr_assert_str_eq(precision_mode_name(PREC_FP16_DYNAMIC), "fp16-dynamic");
    cr_assert_str_eq(precision_mode_name(PREC_BF16), "bf16");
    cr_assert_str_eq(data_format_name(DATA_IDX), "idx");
    cr_assert_str_eq(data_format_name(DATA_HDF5), "hdf5");
    cr_assert_str_eq(data_format_name(DATA_TEXT), "text");
}

/* ---- values ----------------------------------------------------------------------------------- */

Test(values, numbers_in_exponent_form_are_numbers)
{
    struct config c;
    parse_ok(&c, "optim:\n"
                 "  lr: 1e-4\n"
                 "  eps: 1.0e+3\n"
                 "  momentum: .5\n"
                 "  schedule:\n"
                 "    min_lr: 3e-5\n"
                 "precision:\n"
                 "  loss_scale:\n"
                 "    init: 65536\n"
                 "    max: 1E9\n"
                 "    growth_interval: 1e3\n" /* an integer field takes an integral exponent form */
                 "    hysteresis: +2\n"
                 "run:\n"
                 "  seed: 18446744073709551615\n" BASE);
    cr_assert_eq(c.optim.lr, 0.0001);
    cr_assert_eq(c.optim.eps, 1000.0);
    cr_assert_eq(c.optim.momentum, 0.5);
    cr_assert_eq(c.optim.schedule.min_lr, 3e-5);
    cr_assert_eq(c.precision.loss_scale.init, 65536.0);
    cr_assert_eq(c.precision.loss_scale.max, 1e9);
    cr_assert_eq(c.precision.loss_scale.growth_interval, 1000);
    cr_assert_eq(c.precision.loss_scale.hysteresis, 2);
    cr_assert_eq(c.run.seed, UINT64_MAX);
    config_free(&c);
}

Test(values, norm_type_two_or_inf)
{
    struct config c;
    const char *infs[] = {"inf", ".inf", ".Inf", ".INF", "Inf"};
    for (size_t i = 0; i < sizeof infs / sizeof *infs; i++) {
        char yaml[512];
        snprintf(yaml, sizeof yaml, "clip:\n  max_norm: 1.0\n  norm_type: %s\n" BASE, infs[i]);
        parse_ok(&c, yaml);
        cr_assert(isinf(c.clip.norm_type) && c.clip.norm_type > 0, "%s", infs[i]);
        cr_assert_eq(c.clip.max_norm, 1.0);
        char *text = config_to_yaml_string(&c);
        cr_assert(strstr(text, "  norm_type: inf\n"), "inf prints as inf:\n%s", text);
        free(text);
        config_free(&c);
    }
    parse_ok(&c, "clip:\n  norm_type: 2.0\n" BASE);
    cr_assert_eq(c.clip.norm_type, 2.0);
    config_free(&c);
    parse_ok(&c, "precision:\n  loss_scale:\n    max: .inf\n" BASE);
    cr_assert(isinf(c.precision.loss_scale.max), "loss_scale.max may be inf (no cap)");
    config_free(&c);
}

Test(values, strings_lists_enums_and_bools)
{
    struct config c;
    parse_ok(&c, "run:\n"
                 "  name: 'my run'\n"
                 "  device: cuda:1\n"
                 "  out_dir: \"/tmp/a b\"\n"
                 "data:\n"
                 "  format: text\n"
                 "  files:\n"
                 "    - one.txt\n"
                 "    - \"two words.txt\"\n"
                 "  shuffle: false\n"
                 "model:\n"
                 "  init: gpt2\n"
                 "  layers:\n"
                 "    - {kind: linear, out: 4, bias: false, name: head}\n"
                 "    - kind: mse\n"
                 "precision:\n"
                 "  mode: fp16-dynamic\n"
                 "  tf32: true\n"
                 "  autocast:\n"
                 "    fp32_ops: [gelu, softmax]\n"
                 "    lowp_ops: [attention_matmul]\n"
                 "stability:\n"
                 "  on_nonfinite: stop\n");
    cr_assert_str_eq(c.run.name, "my run");
    cr_assert_str_eq(c.run.device, "cuda:1");
    cr_assert_str_eq(c.run.out_dir, "/tmp/a b");
    cr_assert_eq(c.data.format, DATA_TEXT);
    cr_assert_eq(c.data.nfiles, 2);
    cr_assert_str_eq(c.data.files[0], "one.txt");
    cr_assert_str_eq(c.data.files[1], "two words.txt");
    cr_assert_eq(c.data.shuffle, false);
    cr_assert_eq(c.model.init, INIT_GPT2);
    cr_assert_eq(c.model.layers[0].bias, false);
    cr_assert_str_eq(c.model.layers[0].name, "head");
    cr_assert_eq(c.precision.mode, PREC_FP16_DYNAMIC);
    cr_assert_eq(c.precision.tf32, true);
    cr_assert_eq(c.precision.autocast.nfp32, 2);
    cr_assert_str_eq(c.precision.autocast.fp32_ops[1], "softmax");
    cr_assert_eq(c.precision.autocast.nlowp, 1);
    cr_assert_str_eq(c.precision.autocast.lowp_ops[0], "attention_matmul");
    cr_assert_eq(c.stability.on_nonfinite, NONFINITE_STOP);
    config_free(&c);
}

Test(values, empty_section_means_defaults)
{
    struct config c;
    parse_ok(&c, "optim:\nclip:\n" BASE);
    cr_assert_eq(c.optim.lr, 1e-3);
    cr_assert_eq(c.clip.max_norm, 0.0);
    config_free(&c);
}

/* ---- reference configs ------------------------------------------------------------------------ */

Test(reference, every_file_in_configs_loads_and_round_trips)
{
    char names[64][256];
    int n = list_configs(names, 64);
    cr_assert_geq(n, 3, "configs/ holds at least the three reference configs");
    for (int i = 0; i < n; i++) {
        char path[1024];
        snprintf(path, sizeof path, AMP_SOURCE_DIR "/configs/%s", names[i]);
        struct config c;
        struct amp_error err = {0};
        load_ok(&c, path);
        cr_assert_eq(config_finalize(&c, &err), AMP_OK, "%s: finalize again: %s", names[i], err.msg);
        cr_assert_str_eq(c.source, path);
        expect_round_trip(&c);
        config_free(&c);
    }
}

Test(reference, fashion_mlp_values)
{
    struct config c;
    load_ok(&c, AMP_SOURCE_DIR "/configs/fashion_mlp.yaml");
    cr_assert_eq(c.data.format, DATA_IDX);
    cr_assert_str_eq(c.data.train_images, "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz");
    cr_assert_str_eq(c.data.test_labels, "/usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz");
    cr_assert_eq(c.data.mean, 0.2860);
    cr_assert_eq(c.data.std, 0.3530);
    cr_assert_eq(c.data.batch_size, 128);
    cr_assert_eq(c.run.epochs, 10);
    cr_assert_eq(c.run.steps, 0);
    cr_assert_eq(c.run.log_every, 100);
    cr_assert_eq(c.run.eval_every, 0);
    cr_assert_str_eq(c.run.out_dir, "runs/fashion_mlp");
    cr_assert_eq(c.optim.kind, OPTIM_ADAMW);
    cr_assert_eq(c.optim.lr, 1e-3);
    cr_assert_eq(c.precision.mode, PREC_FP32);
    const enum layer_kind kinds[] = {LAYER_FLATTEN, LAYER_LINEAR, LAYER_RELU, LAYER_LINEAR,
                                     LAYER_RELU,    LAYER_LINEAR, LAYER_CROSS_ENTROPY};
    const int64_t outs[] = {0, 512, 0, 512, 0, 10, 0};
    cr_assert_eq(c.model.nlayers, 7);
    for (int i = 0; i < 7; i++) {
        cr_assert_eq(c.model.layers[i].kind, kinds[i], "layer %d", i);
        cr_assert_eq(c.model.layers[i].out, outs[i], "layer %d", i);
    }
    config_free(&c);
}

Test(reference, fashion_cnn_values)
{
    struct config c;
    load_ok(&c, AMP_SOURCE_DIR "/configs/fashion_cnn.yaml");
    cr_assert_eq(c.run.epochs, 5);
    cr_assert_eq(c.data.batch_size, 128);
    cr_assert_eq(c.model.nlayers, 14);
    const struct layer_config *l = c.model.layers;
    cr_assert_eq(l[0].kind, LAYER_CONV2D);
    cr_assert_eq(l[0].out, 32);
    cr_assert_eq(l[0].kernel, 3);
    cr_assert_eq(l[0].padding, 1);
    cr_assert_eq(l[3].kind, LAYER_MAXPOOL2D);
    cr_assert_eq(l[3].kernel, 2);
    cr_assert_eq(l[3].stride, 2);
    cr_assert_eq(l[4].out, 64);
    cr_assert_eq(l[9].kind, LAYER_LINEAR);
    cr_assert_eq(l[9].out, 128);
    cr_assert_eq(l[11].kind, LAYER_DROPOUT);
    cr_assert_eq(l[11].p, 0.2);
    cr_assert_eq(l[12].out, 10);
    cr_assert_eq(l[13].kind, LAYER_CROSS_ENTROPY);
    config_free(&c);
}

Test(reference, text_gpt_values)
{
    struct config c;
    load_ok(&c, AMP_SOURCE_DIR "/configs/text_gpt.yaml");
    cr_assert_eq(c.data.format, DATA_TEXT);
    cr_assert_geq(c.data.nfiles, 2);
    for (int i = 0; i < c.data.nfiles; i++)
        cr_assert(!strncmp(c.data.files[i], "/usr/share/games/fortunes/", 26), "%s", c.data.files[i]);
    cr_assert_eq(c.data.seq_len, 64);
    cr_assert_eq(c.data.batch_size, 32);
    cr_assert_eq(c.model.init, INIT_GPT2);
    cr_assert_eq(c.run.steps, 2000);
    cr_assert_eq(c.run.epochs, 0);
    cr_assert_eq(c.optim.schedule.kind, SCHED_COSINE);
    cr_assert_eq(c.optim.schedule.warmup_steps, 100);
    cr_assert_eq(c.clip.max_norm, 1.0);
    const struct layer_config *l = c.model.layers;
    cr_assert_eq(c.model.nlayers, 6);
    cr_assert_eq(l[0].kind, LAYER_EMBEDDING);
    cr_assert_eq(l[0].dim, 128);
    cr_assert_eq(l[0].vocab, 256);
    cr_assert_eq(l[0].max_len, 64);
    cr_assert_eq(l[1].kind, LAYER_TRANSFORMER_BLOCK);
    cr_assert_eq(l[1].heads, 4);
    cr_assert_eq(l[2].kind, LAYER_TRANSFORMER_BLOCK);
    cr_assert_eq(l[3].kind, LAYER_LAYERNORM);
    cr_assert_eq(l[4].out, 256);
    cr_assert_eq(l[5].kind, LAYER_CROSS_ENTROPY);
    config_free(&c);
}

/* ---- round trip ------------------------------------------------------------------------------- */

/* Every key away from its default, strings that need escaping, every layer kind. */
static const char *const everything_yaml =
    "run:\n"
    "  name: \"my run: \\\"quoted\\\" #1 \\\\ back\"\n"
    "  out_dir: \"/tmp/out dir/\\u00fcn\\u00efc\\u00f6d\\u00e9 \\u2028 ctl\\x01\"\n"
    "  seed: 18446744073709551615\n"
    "  device: cuda:1\n"
    "  steps: 123\n"
    "  epochs: 0\n"
    "  log_every: 7\n"
    "  eval_every: 11\n"
    "  ckpt_every: 13\n"
    "  keep_ckpts: 5\n"
    "data:\n"
    "  format: hdf5\n"
    "  train_images: ti\n"
    "  train_labels: 'tl'\n"
    "  test_images: \"te\"\n"
    "  test_labels: 'it''s'\n"
    "  path: /data/x.h5\n"
    "  x_key: images\n"
    "  y_key: \"labels\\ttab\"\n"
    "  files: [a.txt, \"b\\\\c.txt\", \"line\\nbreak\", \"yes\", \"1e-4\", \"~\", \"- dash\", \"\\u0085nel\"]\n"
    "  seq_len: 128\n"
    "  val_fraction: 0.05\n"
    "  batch_size: 17\n"
    "  shuffle: false\n"
    "  mean: -0.1234567890123\n"
    "  std: 3.3\n"
    "model:\n"
    "  init: gpt2\n"
    "  layers:\n"
    "    - {kind: conv2d, out: 8, kernel: 5, stride: 2, padding: 2, bias: false, name: c1}\n"
    "    - {kind: batchnorm2d, eps: 1e-3, momentum: 0.2}\n"
    "    - {kind: maxpool2d, kernel: 3, stride: 1, padding: 1}\n"
    "    - {kind: avgpool2d, kernel: 2}\n"
    "    - {kind: relu, name: r}\n"
    "    - {kind: flatten}\n"
    "    - {kind: embedding, vocab: 100, dim: 32, max_len: 16}\n"
    "    - {kind: attention, heads: 2, dim: 32}\n"
    "    - {kind: transformer_block, heads: 4, dim: 32, mlp_ratio: 2, approximate: none}\n"
    "    - {kind: gelu, approximate: none}\n"
    "    - {kind: layernorm, eps: 1e-6}\n"
    "    - {kind: dropout, p: 0.5}\n"
    "    - {kind: linear, out: 3, bias: false}\n"
    "    - {kind: mse, name: loss.mse}\n"
    "optim:\n"
    "  kind: sgd\n"
    "  lr: 0.123456789\n"
    "  betas: [0.5, 0.25]\n"
    "  eps: 1e-7\n"
    "  weight_decay: 0.2\n"
    "  momentum: 0.9\n"
    "  nesterov: true\n"
    "  schedule:\n"
    "    kind: step\n"
    "    warmup_steps: 10\n"
    "    step_size: 20\n"
    "    gamma: 0.5\n"
    "    min_lr: 1e-6\n"
    "precision:\n"
    "  mode: fp16-static\n"
    "  loss_scale: {init: 1024, growth_factor: 3, backoff_factor: 0.25, growth_interval: 10, hysteresis: 2,"
    " min: 2, max: .inf, value: 128}\n"
    "  autocast:\n"
    "    lowp_ops: [attention_matmul]\n"
    "    fp32_ops: [gelu, softmax]\n"
    "    promote_ops: [residual_add]\n"
    "  tf32: true\n"
    "accum_steps: 8\n"
    "clip:\n"
    "  max_norm: 0.1\n"
    "  norm_type: inf\n"
    "stability:\n"
    "  on_nonfinite: stop\n"
    "  max_consecutive_skips: 0\n";

Test(round_trip, non_default_everywhere)
{
    struct config c, d;
    parse_ok(&c, everything_yaml);
    cr_assert_str_eq(c.run.name, "my run: \"quoted\" #1 \\ back");
    cr_assert_str_eq(c.run.out_dir, "/tmp/out dir/\xc3\xbcn\xc3\xaf" "c\xc3\xb6" "d\xc3\xa9 \xe2\x80\xa8 ctl\x01");
    cr_assert_str_eq(c.data.y_key, "labels\ttab");
    cr_assert_str_eq(c.data.test_labels, "it's");
    cr_assert_eq(c.data.nfiles, 8);
    cr_assert_str_eq(c.data.files[1], "b\\c.txt");
    cr_assert_str_eq(c.data.files[2], "line\nbreak");
    cr_assert_str_eq(c.data.files[3], "yes");
    cr_assert_str_eq(c.data.files[7], "\xc2\x85nel");
    cr_assert_eq(c.model.nlayers, 14);
    cr_assert_str_eq(c.model.layers[13].name, "loss.mse");
    cr_assert_eq(c.optim.nesterov, true);
    cr_assert_eq(c.clip.max_norm, 0.1);
    expect_round_trip(&c);

    /* Not equal to the defaults, and each single change is seen by config_equal. */
    config_defaults(&d);
    cr_assert_not(config_equal(&c, &d));
    config_free(&d);
    struct amp_error err = {0};
    cr_assert_eq(config_copy(&d, &c, &err), AMP_OK);
    cr_assert(config_equal(&c, &d));
    d.model.layers[4].name[0] = 'q';
    cr_assert_not(config_equal(&c, &d), "layer names count");
    d.model.layers[4].name[0] = 'r';
    cr_assert(config_equal(&c, &d));
    d.optim.betas[1] = 0.5;
    cr_assert_not(config_equal(&c, &d), "betas count");
    d.optim.betas[1] = 0.25;
    d.data.files[7][0] = 'x';
    cr_assert_not(config_equal(&c, &d), "file names count");
    config_free(&d);
    config_free(&c);
}

Test(round_trip, defaults_only)
{
    struct config c;
    parse_ok(&c, BASE);
    expect_round_trip(&c);
    char *text = config_to_yaml_string(&c);
    /* Every key is printed with its value; layers only with their kind's keys. */
    cr_assert(strstr(text, "  lr: 0.001\n"), "%s", text);
    cr_assert(strstr(text, "  betas: [0.9, 0.999]\n"), "%s", text);
    cr_assert(strstr(text, "  files: []\n"), "%s", text);
    cr_assert(strstr(text, "    - kind: linear\n      name: \"linear_1\"\n      out: 10\n      bias: true\n"), "%s", text);
    cr_assert(strstr(text, "    - kind: flatten\n      name: \"flatten_0\"\n    - kind"), "%s", text);
    cr_assert(strstr(text, "accum_steps: 1\n"), "%s", text);
    free(text);
    config_free(&c);
}

Test(round_trip, copy_is_deep)
{
    struct config c, d;
    struct amp_error err = {0};
    parse_ok(&c, BASE);
    cr_assert_eq(config_copy(&d, &c, &err), AMP_OK);
    cr_assert_neq(d.model.layers, c.model.layers);
    d.model.layers[1].out = 99;
    cr_assert_eq(c.model.layers[1].out, 10);
    cr_assert_not(config_equal(&c, &d));
    config_free(&d);
    config_free(&c);
    config_free(&c); /* twice is harmless */
    config_free(NULL);
}

/* ---- docs ------------------------------------------------------------------------------------- */

Test(docs, config_md_names_every_key)
{
    struct config c;
    parse_ok(&c, everything_yaml);
    char *text = config_to_yaml_string(&c);
    FILE *f = fopen(AMP_SOURCE_DIR "/docs/config.md", "rb");
    cr_assert_not_null(f, "docs/config.md is missing");
    static char doc[1 << 18];
    size_t n = fread(doc, 1, sizeof doc - 1, f);
    doc[n] = '\0';
    fclose(f);
    int keys = 0;
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        line += strspn(line, " ");
        if (!strncmp(line, "- ", 2))
            line += 2;
        size_t len = strcspn(line, ":");
        char key[80];
        snprintf(key, sizeof key, "`%.*s`", (int)len, line);
        cr_assert(strstr(doc, key), "docs/config.md does not mention %s", key);
        keys++;
    }
    cr_assert_gt(keys, 90);
    free(text);
    config_free(&c);
}

/* ---- unknown keys ----------------------------------------------------------------------------- */

Test(errors, unknown_key_with_trailing_space)
{
    expect_error_exact("optim:\n  'lr ': 1e-3\n" BASE, "t.yaml:2:3: unknown key 'lr ' in optim (did you mean 'lr'?)");
    expect_error("optim:\n  'lr ': 1e-3\n" BASE, "t.yaml:2:3: ", "unknown key",
                 "valid keys in optim: kind, lr, betas, eps, weight_decay, momentum, nesterov, state_dtype, "
                 "stochastic_rounding, schedule");
}

Test(errors, unknown_key_trailing_space_from_a_file)
{
    expect_load_error("unknown_key_space.yaml", ":4:3: ", "unknown key 'lr ' in optim (did you mean 'lr'?)",
                      "valid keys in optim");
}

Test(errors, unknown_key_did_you_mean)
{
    expect_error_exact("optim:\n  lrr: 1e-3\n" BASE, "t.yaml:2:3: unknown key 'lrr' in optim (did you mean 'lr'?)");
    expect_error_exact("optim:\n  Weight_Decay: 0.1\n" BASE,
                       "t.yaml:2:3: unknown key 'Weight_Decay' in optim (did you mean 'weight_decay'?)");
    expect_error_exact("precision:\n  loss_scale:\n    growth_intervall: 10\n" BASE,
                       "t.yaml:3:5: unknown key 'growth_intervall' in precision.loss_scale (did you mean "
                       "'growth_interval'?)");
    expect_error_exact("optm:\n  lr: 1\n" BASE, "t.yaml:1:1: unknown key 'optm' at the top level (did you mean 'optim'?)");
}

Test(errors, unknown_key_far_from_all_gets_no_suggestion)
{
    expect_error_exact("optim:\n  zebra: 1\n" BASE, "t.yaml:2:3: unknown key 'zebra' in optim");
    expect_error("learning_rate: 1\n" BASE, "t.yaml:1:1: ", "unknown key 'learning_rate' at the top level",
                 "valid keys at the top level: run, data, model, optim, precision, accum_steps, clip, stability");
}

/* ---- types ------------------------------------------------------------------------------------ */

Test(errors, wrong_type_for_a_number)
{
    expect_error_exact("optim:\n  lr: abc\n" BASE, "t.yaml:2:7: optim.lr: expected a number, got 'abc'");
    expect_error("optim:\n  lr: abc\n" BASE, "t.yaml:2:7: ", "abc", "optim.lr takes a number > 0 (default 0.001)");
    expect_error_exact("optim:\n  lr: 0x10\n" BASE, "t.yaml:2:7: optim.lr: expected a number, got '0x10'");
    expect_error_exact("optim:\n  lr: nan\n" BASE, "t.yaml:2:7: optim.lr: expected a number, got 'nan'");
    expect_error_exact("optim:\n  lr: .inf\n" BASE, "t.yaml:2:7: optim.lr: expected a finite number, got '.inf'");
    expect_error_exact("optim:\n  lr: 1e999\n" BASE, "t.yaml:2:7: optim.lr: the number '1e999' is too large");
}

Test(errors, yes_no_on_off_are_not_numbers)
{
    const char *words[] = {"yes", "no", "on", "off", "y", "n", "true"};
    for (size_t i = 0; i < sizeof words / sizeof *words; i++) {
        char yaml[512], msg[128];
        snprintf(yaml, sizeof yaml, "accum_steps: %s\n" BASE, words[i]);
        snprintf(msg, sizeof msg, "t.yaml:1:14: accum_steps: expected an integer, got '%s'", words[i]);
        expect_error_exact(yaml, msg);
        snprintf(yaml, sizeof yaml, "optim:\n  lr: %s\n" BASE, words[i]);
        snprintf(msg, sizeof msg, "t.yaml:2:7: optim.lr: expected a number, got '%s'", words[i]);
        expect_error_exact(yaml, msg);
    }
}

Test(errors, yes_no_on_off_are_not_booleans)
{
    const char *words[] = {"yes", "no", "on", "off", "y", "n", "True", "1"};
    for (size_t i = 0; i < sizeof words / sizeof *words; i++) {
        char yaml[512], msg[128];
        snprintf(yaml, sizeof yaml, "precision:\n  tf32: %s\n" BASE, words[i]);
        snprintf(msg, sizeof msg, "t.yaml:2:9: precision.tf32: expected true or false, got '%s'", words[i]);
        expect_error_exact(yaml, msg);
        expect_error(yaml, "t.yaml:2:9: ", "expected true or false", "write true or false");
    }
    expect_error("optim:\n  nesterov: \"true\"\n" BASE, "t.yaml:2:13: ",
                 "optim.nesterov: expected true or false, got the quoted string \"true\"", "remove the quotes");
}

Test(errors, quoted_numbers_are_rejected)
{
    expect_error("optim:\n  lr: \"1e-4\"\n" BASE, "t.yaml:2:7: ",
                 "optim.lr: expected a number, got the quoted string \"1e-4\"", "remove the quotes");
    expect_error("optim:\n  lr: '0.1'\n" BASE, "t.yaml:2:7: ", "got the quoted string \"0.1\"", "remove the quotes");
    expect_error("accum_steps: \"4\"\n" BASE, "t.yaml:1:14: ", "accum_steps: expected an integer, got the quoted string",
                 "remove the quotes");
}

Test(errors, integers_reject_fractions)
{
    expect_error("accum_steps: 1.5\n" BASE, "t.yaml:1:14: ", "accum_steps: expected an integer, got '1.5'",
                 "whole number");
    expect_error("run:\n  seed: -1\n" BASE, "t.yaml:2:9: ", "run.seed: expected a non-negative integer, got '-1'", NULL);
    expect_error("run:\n  steps: 99999999999999999999\n" BASE, "t.yaml:2:10: ", "is too large", NULL);
}

Test(errors, null_or_empty_value)
{
    expect_error_exact("optim:\n  lr:\n" BASE, "t.yaml:2:6: optim.lr: missing value (write a value or remove the key)");
    expect_error_exact("optim:\n  lr: ~\n" BASE, "t.yaml:2:7: optim.lr: missing value (write a value or remove the key)");
    expect_error_exact("optim:\n  lr: null\n" BASE,
                       "t.yaml:2:7: optim.lr: missing value (write a value or remove the key)");
    expect_error("run:\n  name:\n" BASE, "t.yaml:2:8: ", "run.name: missing value", NULL);
    expect_error("run:\n  name: \"\"\n" BASE, "t.yaml:2:9: ", "run.name: must not be empty", NULL);
    expect_error("precision:\n  mode:\n" BASE, "t.yaml:2:8: ", "precision.mode: missing value", NULL);
}

Test(errors, mapping_where_a_scalar_is_expected)
{
    expect_error("optim:\n  lr:\n    value: 1\n" BASE, "t.yaml:3:5: ", "optim.lr: expected a number, got a mapping",
                 "optim.lr takes a number");
    expect_error("optim:\n  lr: [1]\n" BASE, "t.yaml:2:7: ", "optim.lr: expected a number, got a list", NULL);
    expect_error("run:\n  name: {a: 1}\n" BASE, "t.yaml:2:9: ", "run.name: expected a string, got a mapping", NULL);
}

Test(errors, scalar_where_a_mapping_is_expected)
{
    expect_error_exact("optim: 3\n" BASE, "t.yaml:1:8: optim: expected a mapping of keys, got '3'");
    expect_error("optim: 3\n" BASE, "t.yaml:1:8: ", "expected a mapping", "kind, lr, betas");
    expect_error("optim:\n  - lr: 1\n" BASE, "t.yaml:2:3: ", "optim: expected a mapping of keys, got a list", NULL);
    expect_error("model:\n  layers: relu\n" BASE_DATA, "t.yaml:2:11: ", "model.layers: expected a list of layers, got 'relu'",
                 NULL);
}

Test(errors, top_level_not_a_mapping)
{
    expect_error_exact("- a\n- b\n", "t.yaml:1:1: the top level must be a mapping of sections, got a list");
    expect_error_exact("just words\n", "t.yaml:1:1: the top level must be a mapping of sections, got 'just words'");
    expect_load_error("top_level_list.yaml", ":1:1: ", "the top level must be a mapping of sections, got a list",
                      "run, data, model");
}

/* ---- ranges ----------------------------------------------------------------------------------- */

Test(ranges, accum_steps_zero)
{
    expect_error_exact("accum_steps: 0\n" BASE, "t.yaml:1:14: accum_steps must be in [1, 65536], got 0");
    expect_error("accum_steps: 0\n" BASE, "t.yaml:1:14: ", "accum_steps", "accum_steps takes an integer in [1, 65536] (default 1)");
}

Test(ranges, accum_steps_negative)
{
    expect_error_exact("accum_steps: -4\n" BASE, "t.yaml:1:14: accum_steps must be in [1, 65536], got -4");
}

Test(ranges, clip_max_norm_negative)
{
    expect_error_exact("clip:\n  max_norm: -0.5\n" BASE, "t.yaml:2:13: clip.max_norm must be >= 0, got -0.5");
}

Test(ranges, clip_norm_type_not_2_or_inf)
{
    expect_error_exact("clip:\n  norm_type: 1\n" BASE, "t.yaml:2:14: clip.norm_type must be 2 or inf, got 1");
    expect_error("clip:\n  norm_type: fro\n" BASE, "t.yaml:2:14: ", "expected a number, got 'fro'", "2 or inf");
}

Test(ranges, static_loss_scale_zero)
{
    expect_error_exact("precision:\n  mode: fp16-static\n  loss_scale:\n    value: 0\n" BASE,
                       "t.yaml:4:12: precision.loss_scale.value must be > 0, got 0");
}

Test(ranges, batch_size_zero)
{
    expect_error_exact("data:\n  format: idx\n  batch_size: 0\n" BASE_MODEL,
                       "t.yaml:3:15: data.batch_size must be in [1, 16777216], got 0");
}

Test(ranges, lr_not_positive)
{
    expect_error_exact("optim:\n  lr: 0\n" BASE, "t.yaml:2:7: optim.lr must be > 0, got 0");
    expect_error_exact("optim:\n  lr: -1e-3\n" BASE, "t.yaml:2:7: optim.lr must be > 0, got -1e-3");
}

Test(ranges, betas_outside_0_1)
{
    expect_error_exact("optim:\n  betas: [0.9, 1.0]\n" BASE, "t.yaml:2:16: optim.betas[1] must be in [0, 1), got 1.0");
    expect_error_exact("optim:\n  betas: [-0.1, 0.9]\n" BASE, "t.yaml:2:11: optim.betas[0] must be in [0, 1), got -0.1");
    expect_error_exact("optim:\n  betas: [0.9]\n" BASE, "t.yaml:2:10: optim.betas: expected a list of two numbers, got 1 items");
    expect_error("optim:\n  betas: 0.9\n" BASE, "t.yaml:2:10: ", "expected a list of two numbers, got '0.9'",
                 "default [0.9, 0.999]");
}

Test(ranges, dropout_p_outside_0_1)
{
    expect_error_exact(BASE_DATA "model:\n  layers:\n    - kind: dropout\n      p: 1.0\n    - kind: mse\n",
                       "t.yaml:10:10: model.layers.0.p must be in [0, 1), got 1.0");
    expect_error_exact(BASE_DATA "model:\n  layers:\n    - kind: dropout\n      p: -0.1\n    - kind: mse\n",
                       "t.yaml:10:10: model.layers.0.p must be in [0, 1), got -0.1");
}

Test(ranges, other_bounds)
{
    struct {
        const char *yaml, *msg;
    } cases[] = {
        {"precision:\n  loss_scale:\n    growth_factor: 1\n", "t.yaml:3:20: precision.loss_scale.growth_factor must be > 1, got 1"},
        {"precision:\n  loss_scale:\n    backoff_factor: 1\n", "t.yaml:3:21: precision.loss_scale.backoff_factor must be in (0, 1), got 1"},
        {"precision:\n  loss_scale:\n    backoff_factor: 0\n", "t.yaml:3:21: precision.loss_scale.backoff_factor must be in (0, 1), got 0"},
        {"precision:\n  loss_scale:\n    growth_interval: 0\n", "t.yaml:3:22: precision.loss_scale.growth_interval must be >= 1, got 0"},
        {"precision:\n  loss_scale:\n    hysteresis: 0\n", "t.yaml:3:17: precision.loss_scale.hysteresis must be >= 1, got 0"},
        {"precision:\n  loss_scale:\n    init: 0\n", "t.yaml:3:11: precision.loss_scale.init must be > 0, got 0"},
        {"precision:\n  loss_scale:\n    min: 0\n", "t.yaml:3:10: precision.loss_scale.min must be > 0, got 0"},
        {"optim:\n  schedule:\n    warmup_steps: -1\n", "t.yaml:3:19: optim.schedule.warmup_steps must be >= 0, got -1"},
        {"optim:\n  eps: 0\n", "t.yaml:2:8: optim.eps must be > 0, got 0"},
        {"optim:\n  weight_decay: -0.1\n", "t.yaml:2:17: optim.weight_decay must be >= 0, got -0.1"},
        {"stability:\n  max_consecutive_skips: -1\n", "t.yaml:2:26: stability.max_consecutive_skips must be >= 0, got -1"},
        {"dist:\n  timeout_s: -1\n", "t.yaml:2:14: dist.timeout_s must be >= 0, got -1"},
        {"dist:\n  bucket_mb: -1\n", "t.yaml:2:14: dist.bucket_mb must be in [0, 1048576], got -1"},
        {"dist:\n  bucket_mb: 2e6\n", "t.yaml:2:14: dist.bucket_mb must be in [0, 1048576], got 2e6"},
        {"run:\n  keep_ckpts: 0\n", "t.yaml:2:15: run.keep_ckpts must be >= 1, got 0"},
        {"run:\n  steps: -5\n", "t.yaml:2:10: run.steps must be in [0, 1000000000000], got -5"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char yaml[1024];
        snprintf(yaml, sizeof yaml, "%s%s", cases[i].yaml, BASE);
        expect_error_exact(yaml, cases[i].msg);
    }
}

Test(ranges, loss_scale_min_init_max_order)
{
    expect_error("precision:\n  loss_scale:\n    min: 100\n    init: 10\n" BASE, "t.yaml:3:5: ",
                 "precision.loss_scale: min (100) is larger than init (10)", "min <= init <= max");
    expect_error("precision:\n  loss_scale:\n    init: 100\n    max: 10\n" BASE, "t.yaml:4:5: ",
                 "precision.loss_scale: init (100) is larger than max (10)", NULL);
}

/* ---- enums ------------------------------------------------------------------------------------ */

Test(errors, unknown_precision_mode)
{
    expect_error("precision:\n  mode: fp4\n" BASE, "t.yaml:2:9: ", "precision.mode: unknown value 'fp4'",
                 "fp32, fp16-static, fp16-dynamic, bf16, fp8");
    expect_error_exact("precision:\n  mode: bf61\n" BASE,
                       "t.yaml:2:9: precision.mode: unknown value 'bf61' (did you mean 'bf16'?)");
    expect_error("precision:\n  mode: FP16\n" BASE, "t.yaml:2:9: ", "unknown value 'FP16'", NULL);
}

Test(errors, other_enums)
{
    expect_error("optim:\n  kind: adam\n" BASE, "t.yaml:2:9: ", "optim.kind: unknown value 'adam' (did you mean 'adamw'?)",
                 "sgd, adamw");
    expect_error("data:\n  format: csv\n" BASE_MODEL, "t.yaml:2:11: ", "data.format: unknown value 'csv'", "idx, hdf5, text");
    expect_error("stability:\n  on_nonfinite: ignore\n" BASE, "t.yaml:2:17: ", "unknown value 'ignore'", "skip, stop");
    expect_error("run:\n  device: gpu\n" BASE, "t.yaml:2:11: ", "run.device: 'gpu' must be auto, cpu, cuda or cuda:N",
                 NULL);
    expect_error("run:\n  device: cuda:x\n" BASE, "t.yaml:2:11: ", "must be auto, cpu, cuda or cuda:N", NULL);
}

/* ---- YAML-level faults ------------------------------------------------------------------------ */

Test(errors, duplicate_key)
{
    expect_error_exact("optim:\n  lr: 1e-3\n  betas: [0.9, 0.95]\n  lr: 3e-4\n" BASE,
                       "t.yaml:4:3: duplicate key 'lr' in optim: first at line 2, again at line 4");
    expect_error("accum_steps: 2\n" BASE "accum_steps: 4\n", "t.yaml:14:1: ",
                 "duplicate key 'accum_steps' at the top level: first at line 1, again at line 14", "remove one");
    expect_load_error("duplicate_key.yaml", ":4:3: ", "duplicate key 'name' in run: first at line 2, again at line 4",
                      NULL);
}

Test(errors, tab_character)
{
    expect_load_error("tab.yaml", ":3:1: ", "tab character", "YAML forbids tabs for indentation; use spaces");
    expect_error("optim:\n  lr: 1e-3\n  eps:\t1e-8\n" BASE, "t.yaml:3:7: ", "tab character", "use spaces");
    /* Columns count characters, as libyaml's do: "é" is one column. */
    expect_error("run:\n  name: \"\xc3\xa9\"\t\n" BASE, "t.yaml:2:12: ", "tab character", NULL);
}

Test(errors, unclosed_bracket)
{
    expect_load_error("unclosed_bracket.yaml", ":4:12: ",
                      "YAML syntax error: did not find expected ',' or ']' (while parsing a flow sequence at line 3, "
                      "column 10)",
                      "add the missing ']'");
    expect_error("a: [1, 2", "t.yaml:1:9: ", "did not find expected ',' or ']'", "'[' is not closed");
    expect_error("a: {b: 1", "t.yaml:1:9: ", "did not find expected ',' or '}'", "'{' is not closed");
}

Test(errors, other_syntax_errors)
{
    expect_error("optim:\n  lr: 1\n   eps: 2\n" BASE, "t.yaml:3:", "YAML syntax error", "indentation");
    expect_error("a: \"unterminated\n", "t.yaml:", "YAML syntax error: found unexpected end of stream", NULL);
    expect_error("a: *nothing\n", "t.yaml:1:4: ", "found undefined alias", NULL);
    expect_error("a: 1\n---\nb: 2\n", "t.yaml:3:1: ", "a second YAML document starts here", "one YAML document");
}

Test(errors, empty_file)
{
    expect_load_error("empty.yaml", ":1:1: ", "the config is empty", "configs/");
    expect_error_exact("", "t.yaml:1:1: the config is empty (no YAML document, only comments or blank lines)");
    expect_error("---\n", "t.yaml:", "the config is empty", NULL);
}

Test(errors, comments_only_file)
{
    expect_load_error("comments_only.yaml", ":1:1: ", "the config is empty", NULL);
    expect_error("# nothing\n\n# here\n", "t.yaml:1:1: ", "the config is empty", NULL);
}

Test(errors, missing_file)
{
    struct config c;
    struct amp_error err = {0};
    enum amp_status st = config_load(&c, "/nonexistent/dir/my_config.yaml", &err);
    cr_assert_eq(st, AMP_ERR_CONFIG);
    cr_assert_eq(err.code, AMP_ERR_CONFIG);
    cr_assert_str_eq(err.msg, "/nonexistent/dir/my_config.yaml: cannot open the config file: No such file or directory");
    cr_assert(strstr(err.hint, "check the path"), "%s", err.hint);
    config_free(&c);

    st = config_load(&c, AMP_SOURCE_DIR "/tests", &err);
    cr_assert_eq(st, AMP_ERR_CONFIG, "a directory is not a config");
    cr_assert(strstr(err.msg, "/tests: not a regular file"), "%s", err.msg);
    config_free(&c);
}

Test(errors, long_strings_and_lists)
{
    char yaml[4096], name[300];
    memset(name, 'a', 299);
    name[299] = '\0';
    snprintf(yaml, sizeof yaml, "run:\n  out_dir: %s\n" BASE, name);
    expect_error(yaml, "t.yaml:2:12: ", "run.out_dir: the string is too long (299 bytes, at most 255)", NULL);
    snprintf(yaml, sizeof yaml, "data:\n  format: text\n  files: [");
    for (int i = 0; i < 17; i++)
        snprintf(yaml + strlen(yaml), sizeof yaml - strlen(yaml), "%sf%d", i ? ", " : "", i);
    snprintf(yaml + strlen(yaml), sizeof yaml - strlen(yaml), "]\n" BASE_MODEL);
    expect_error(yaml, "t.yaml:3:10: ", "data.files: too many entries (17, at most 16)", NULL);
    expect_error("data:\n  format: text\n  files: [a, a]\n" BASE_MODEL, "t.yaml:3:14: ", "data.files: 'a' is listed twice", NULL);
    expect_error("data:\n  format: text\n  files: [a, ~]\n" BASE_MODEL, "t.yaml:3:14: ",
                 "data.files[1]: expected a string, got nothing (null)", NULL);
}

/* ---- layers ----------------------------------------------------------------------------------- */

Test(layers, unknown_layer_kind)
{
    expect_error_exact(BASE_DATA "model:\n  layers:\n    - kind: linaer\n      out: 3\n",
                       "t.yaml:9:13: model.layers.0.kind: unknown value 'linaer' (did you mean 'linear'?)");
    expect_error(BASE_DATA "model:\n  layers:\n    - kind: lstm\n", "t.yaml:9:13: ", "unknown value 'lstm'",
                 "linear, conv2d, maxpool2d, avgpool2d, flatten, batchnorm2d, layernorm, relu, gelu, dropout, "
                 "embedding, attention, transformer_block, cross_entropy, mse");
}

Test(layers, key_not_valid_for_its_kind)
{
    expect_error_exact(BASE_DATA "model:\n  layers:\n    - kind: linear\n      out: 3\n      kernel: 3\n",
                       "t.yaml:11:7: key 'kernel' does not apply to a linear layer (model.layers.0)");
    expect_error(BASE_DATA "model:\n  layers:\n    - kind: linear\n      out: 3\n      kernel: 3\n", "t.yaml:11:7: ",
                 "kernel", "keys of a linear layer: kind, name, out (required), bias");
    expect_error(BASE_DATA "model:\n  layers:\n    - kind: relu\n    - kind: dropout\n      eps: 0.1\n", "t.yaml:11:7: ",
                 "key 'eps' does not apply to a dropout layer (model.layers.1)", "keys of a dropout layer: kind, name, p");
    expect_error_exact(BASE_DATA "model:\n  layers:\n    - kind: conv2d\n      out: 3\n      kernal: 3\n",
                       "t.yaml:11:7: unknown key 'kernal' in model.layers.0 (conv2d) (did you mean 'kernel'?)");
}

Test(layers, missing_required_key)
{
    expect_error_exact(BASE_DATA "model:\n  layers:\n    - kind: flatten\n    - kind: linear\n      bias: false\n"
                                 "    - kind: cross_entropy\n",
                       "t.yaml:10:7: layer 'linear_1' (model.layers.1, linear) needs 'out'");
    expect_error(BASE_DATA "model:\n  layers:\n    - kind: conv2d\n      out: 8\n    - kind: mse\n", "t.yaml:9:7: ",
                 "layer 'conv2d_0' (model.layers.0, conv2d) needs 'kernel'", "out (required), kernel (required)");
    expect_error(BASE_DATA "model:\n  layers:\n    - kind: embedding\n    - kind: mse\n", "t.yaml:9:7: ",
                 "needs 'dim'", NULL);
    expect_error(BASE_DATA "model:\n  layers:\n    - kind: transformer_block\n    - kind: mse\n", "t.yaml:9:7: ",
                 "needs 'heads'", NULL);
    expect_error(BASE_DATA "model:\n  layers:\n    - kind: maxpool2d\n    - kind: mse\n", "t.yaml:9:7: ",
                 "needs 'kernel'", NULL);
    expect_error(BASE_DATA "model:\n  layers:\n    - kind: linear\n      out: 0\n    - kind: mse\n", "t.yaml:10:12: ",
                 "model.layers.0.out must be in [1, 16777216], got 0", NULL);
}

Test(layers, last_layer_not_a_loss)
{
    expect_error_exact(BASE_DATA "model:\n  layers:\n    - kind: flatten\n    - kind: linear\n      out: 10\n",
                       "t.yaml:10:7: model: the last layer must be a loss (cross_entropy or mse), but model.layers.1 "
                       "'linear_1' is linear");
    expect_error(BASE_DATA "model:\n  layers:\n    - kind: mse\n    - kind: relu\n    - kind: mse\n", "t.yaml:9:7: ",
                 "model: layer 'mse_0' (model.layers.0) is a loss but is not the last layer", NULL);
}

Test(layers, layer_structure_errors)
{
    expect_error_exact(BASE_DATA "model:\n  layers:\n    - relu\n",
                       "t.yaml:9:7: model.layers.0: expected a mapping with a kind, got 'relu'");
    expect_error_exact(BASE_DATA "model:\n  layers:\n    - out: 3\n", "t.yaml:9:7: model.layers.0 has no 'kind'");
    expect_error_exact(BASE_DATA "model:\n  layers:\n    - kind: relu\n      kind: gelu\n",
                       "t.yaml:10:7: duplicate key 'kind' in model.layers.0: first at line 9, again at line 10");
    expect_error(BASE_DATA "model:\n  layers:\n    - kind: relu\n      name: a/b\n    - kind: mse\n", "t.yaml:10:13: ",
                 "model.layers.0.name: 'a/b' may only contain letters, digits", NULL);
}

Test(layers, duplicate_layer_names)
{
    expect_error_exact(BASE_DATA "model:\n  layers:\n    - kind: linear\n      out: 3\n      name: fc\n"
                                 "    - kind: linear\n      out: 3\n      name: fc\n    - kind: mse\n",
                       "t.yaml:12:7: model: layers 0 and 1 are both named 'fc'");
    /* A given name may also collide with a default one. */
    expect_error(BASE_DATA "model:\n  layers:\n    - kind: relu\n    - kind: relu\n      name: relu_0\n    - kind: mse\n",
                 "t.yaml:10:7: ", "layers 0 and 1 are both named 'relu_0'", NULL);
}

Test(layers, missing_or_empty_layers)
{
    expect_error_exact(BASE_DATA "model:\n  layers: []\n", "t.yaml:8:3: model.layers is missing or empty");
    expect_error_exact(BASE_DATA "model:\n  init: gpt2\n", "t.yaml:7:1: model.layers is missing or empty");
    expect_error(BASE_DATA, "t.yaml:1:1: ", "model.layers is missing or empty", "ending with a loss");
}

Test(layers, heads_must_divide_dim_and_pool_padding)
{
    expect_error(BASE_DATA "model:\n  layers:\n    - kind: attention\n      heads: 3\n      dim: 64\n    - kind: mse\n",
                 "t.yaml:9:7: ", "dim 64 is not divisible by heads 3", NULL);
    expect_error(BASE_DATA "model:\n  layers:\n    - kind: maxpool2d\n      kernel: 2\n      padding: 2\n    - kind: mse\n",
                 "t.yaml:9:7: ", "padding 2 is more than half the kernel 2", NULL);
}

/* ---- checks across keys ----------------------------------------------------------------------- */

Test(cross, data_keys_per_format)
{
    expect_error_exact("data:\n  format: idx\n  train_images: a\n  train_labels: b\n  test_images: c\n" BASE_MODEL,
                       "t.yaml:2:3: data.format is idx but data.test_labels is not set");
    expect_error(BASE_MODEL, "t.yaml:1:1: ", "data.format is idx but data.train_images is not set",
                 "add data.train_images");
    expect_error_exact("data:\n  format: hdf5\n" BASE_MODEL, "t.yaml:2:3: data.format is hdf5 but data.path is not set");
    expect_error_exact("data:\n  format: text\n  files: []\n" BASE_MODEL,
                       "t.yaml:2:3: data.format is text but data.files is empty");
    struct config c;
    parse_ok(&c, "data:\n  format: hdf5\n  path: x.h5\n" BASE_MODEL);
    cr_assert_str_eq(c.data.path, "x.h5");
    config_free(&c);
}

Test(cross, steps_and_epochs_both_set)
{
    expect_error("run:\n  steps: 100\n  epochs: 2\n" BASE, "t.yaml:2:3: ", "run.steps (100) and run.epochs (2) are both set",
                 "set only one");
}

Test(cross, nesterov_needs_momentum)
{
    expect_error("optim:\n  kind: sgd\n  nesterov: true\n" BASE, "t.yaml:3:3: ", "optim.nesterov needs optim.momentum > 0",
                 NULL);
    struct config c;
    parse_ok(&c, "optim:\n  kind: sgd\n  momentum: 0.9\n  nesterov: true\n" BASE);
    cr_assert_eq(c.optim.momentum, 0.9);
    config_free(&c);
}

Test(cross, bf16_master_weights_need_bf16_mode)
{
    expect_error("precision:\n  mode: fp16-dynamic\n  master_weights: bf16\n" BASE, "t.yaml:3:3: ",
                 "precision.master_weights: bf16 needs precision.mode: bf16 (mode is fp16-dynamic)", "mode: bf16");
    struct config c;
    parse_ok(&c, "precision:\n  mode: bf16\n  master_weights: bf16\n" BASE);
    cr_assert_eq(c.precision.master_weights, STORE_BF16);
    cr_assert_eq(c.optim.state_dtype, STORE_FP32);
    cr_assert_not(c.optim.stochastic_rounding);
    config_free(&c);
}

Test(cross, stochastic_rounding_needs_a_bf16_store)
{
    expect_error("optim:\n  stochastic_rounding: true\n" BASE, "t.yaml:2:3: ",
                 "optim.stochastic_rounding rounds bf16 stores, but the weights and the optimizer state are fp32",
                 "master_weights: bf16");
    struct config c; /* bf16 moments alone have something to round */
    parse_ok(&c, "optim:\n  stochastic_rounding: true\n  state_dtype: bf16\n" BASE);
    cr_assert(c.optim.stochastic_rounding);
    cr_assert_eq(c.optim.state_dtype, STORE_BF16);
    config_free(&c);
    expect_error("optim:\n  state_dtype: fp16\n" BASE, "t.yaml:2:16: ", "state_dtype", "fp32, bf16");
}

Test(cross, cosine_min_lr_above_lr)
{
    expect_error("optim:\n  lr: 1e-4\n  schedule:\n    kind: cosine\n    min_lr: 1e-3\n" BASE, "t.yaml:5:5: ",
                 "optim.schedule.min_lr (0.001) is larger than optim.lr (0.0001)", NULL);
}

Test(cross, autocast_op_names)
{
    expect_error_exact("precision:\n  autocast:\n    fp32_ops: [gelu, softmx]\n" BASE,
                       "t.yaml:3:22: precision.autocast.fp32_ops[1]: unknown value 'softmx' (did you mean 'softmax'?)");
    expect_error("precision:\n  autocast:\n    fp32_ops: [matmul]\n" BASE, "t.yaml:3:16: ", "unknown value 'matmul'",
                 "attention_matmul");
    expect_error("precision:\n  autocast:\n    fp32_ops: [gelu]\n    lowp_ops: [linear, gelu]\n" BASE, "t.yaml:3:5: ",
                 "precision.autocast: 'gelu' is in both lowp_ops and fp32_ops", "one list only");
    expect_error("precision:\n  autocast:\n    promote_ops: [gelu, gelu]\n" BASE, "t.yaml:3:25: ", "'gelu' is listed twice",
                 NULL);
}

/* ---- overrides -------------------------------------------------------------------------------- */

static void load_mlp(struct config *c) { load_ok(c, AMP_SOURCE_DIR "/configs/fashion_mlp.yaml"); }

Test(overrides, good_overrides_change_the_value)
{
    struct config c;
    load_mlp(&c);
    override_ok(&c, "optim.lr=3e-4");
    cr_assert_eq(c.optim.lr, 3e-4);
    override_ok(&c, "precision.mode=bf16");
    cr_assert_eq(c.precision.mode, PREC_BF16);
    override_ok(&c, "optim.betas=[0.9, 0.95]");
    cr_assert_eq(c.optim.betas[0], 0.9);
    cr_assert_eq(c.optim.betas[1], 0.95);
    override_ok(&c, "model.layers.1.out=256");
    cr_assert_eq(c.model.layers[1].out, 256);
    cr_assert_eq(c.model.layers[3].out, 512, "only the named layer changes");
    override_ok(&c, "accum_steps=4");
    cr_assert_eq(c.accum_steps, 4);
    override_ok(&c, "clip.norm_type=inf");
    cr_assert(isinf(c.clip.norm_type));
    override_ok(&c, "clip.max_norm=1.0");
    cr_assert_eq(c.clip.max_norm, 1.0);
    override_ok(&c, "run.seed=7");
    cr_assert_eq(c.run.seed, 7u);
    override_ok(&c, "run.device=cuda:0");
    cr_assert_str_eq(c.run.device, "cuda:0");
    override_ok(&c, "data.shuffle=false");
    cr_assert_eq(c.data.shuffle, false);
    override_ok(&c, "precision.loss_scale.growth_interval=1e3");
    cr_assert_eq(c.precision.loss_scale.growth_interval, 1000);
    override_ok(&c, "precision.autocast.fp32_ops=[gelu, linear]");
    cr_assert_eq(c.precision.autocast.nfp32, 2);
    cr_assert_str_eq(c.precision.autocast.fp32_ops[1], "linear");
    override_ok(&c, "optim.schedule={kind: cosine, warmup_steps: 50}");
    cr_assert_eq(c.optim.schedule.kind, SCHED_COSINE);
    cr_assert_eq(c.optim.schedule.warmup_steps, 50);
    cr_assert_eq(c.optim.lr, 3e-4, "a mapping override merges into the section");
    expect_round_trip(&c);
    config_free(&c);
}

Test(overrides, list_values)
{
    struct config c;
    load_mlp(&c);
    override_ok(&c, "data.files=[a.txt, \"b c.txt\"]");
    cr_assert_eq(c.data.nfiles, 2);
    cr_assert_str_eq(c.data.files[0], "a.txt");
    cr_assert_str_eq(c.data.files[1], "b c.txt");
    override_ok(&c, "data.format=text");
    cr_assert_eq(c.data.format, DATA_TEXT);
    struct amp_error err = {0};
    cr_assert_eq(config_apply_override(&c, "data.files=[]", &err), AMP_OK);
    cr_assert_eq(c.data.nfiles, 0);
    cr_assert_eq(config_finalize(&c, &err), AMP_ERR_CONFIG, "text data with no files");
    cr_assert_str_eq(err.msg, AMP_SOURCE_DIR "/configs/fashion_mlp.yaml: data.format is text but data.files is empty");
    config_free(&c);
}

Test(overrides, layer_index)
{
    struct config c;
    load_mlp(&c);
    override_ok(&c, "model.layers.0.name=flat");
    cr_assert_str_eq(c.model.layers[0].name, "flat");
    override_ok(&c, "model.layers.6.kind=mse");
    cr_assert_eq(c.model.layers[6].kind, LAYER_MSE);
    cr_assert_str_eq(c.model.layers[6].name, "mse_6", "the default name follows the kind");
    /* A new kind starts from that kind's defaults; the given name stays. */
    override_ok(&c, "model.layers.1.kind=dropout");
    cr_assert_eq(c.model.layers[1].kind, LAYER_DROPOUT);
    cr_assert_eq(c.model.layers[1].p, 0.1);
    cr_assert_eq(c.model.layers[1].out, 0);
    cr_assert_str_eq(c.model.layers[1].name, "fc1");
    override_ok(&c, "model.layers.1={kind: linear, out: 64}");
    cr_assert_eq(c.model.layers[1].kind, LAYER_LINEAR);
    cr_assert_eq(c.model.layers[1].out, 64);
    override_ok(&c, "model.layers=[{kind: linear, out: 5}, {kind: mse}]");
    cr_assert_eq(c.model.nlayers, 2);
    cr_assert_eq(c.model.layers[0].out, 5);
    cr_assert_str_eq(c.model.layers[1].name, "mse_1");
    expect_round_trip(&c);
    config_free(&c);
}

Test(overrides, derived_defaults_follow)
{
    struct config c;
    parse_ok(&c, BASE);
    override_ok(&c, "run.name=exp2");
    cr_assert_str_eq(c.run.out_dir, "runs/exp2");
    override_ok(&c, "run.out_dir=/tmp/x");
    override_ok(&c, "run.name=exp3");
    cr_assert_str_eq(c.run.out_dir, "/tmp/x", "an explicit out_dir stays");
    override_ok(&c, "optim.kind=sgd");
    cr_assert_eq(c.optim.weight_decay, 0.0);
    override_ok(&c, "optim.kind=adamw");
    cr_assert_eq(c.optim.weight_decay, 0.01);
    override_ok(&c, "run.steps=50");
    cr_assert_eq(c.run.steps, 50);
    cr_assert_eq(c.run.epochs, 0);
    config_free(&c);
}

Test(overrides, steps_override_replaces_the_files_epochs)
{
    struct config c;
    load_mlp(&c); /* epochs: 10 */
    override_ok(&c, "run.steps=100");
    cr_assert_eq(c.run.steps, 100);
    cr_assert_eq(c.run.epochs, 0);
    override_ok(&c, "run.steps=200");
    cr_assert_eq(c.run.steps, 200);
    config_free(&c);

    load_ok(&c, AMP_SOURCE_DIR "/configs/text_gpt.yaml"); /* steps: 2000 */
    override_ok(&c, "run.epochs=2");
    cr_assert_eq(c.run.steps, 0);
    cr_assert_eq(c.run.epochs, 2);
    config_free(&c);

    /* Both by override: the strict rule holds. */
    load_mlp(&c);
    struct amp_error err = {0};
    cr_assert_eq(config_apply_override(&c, "run.steps=100", &err), AMP_OK);
    cr_assert_eq(config_apply_override(&c, "run.epochs=2", &err), AMP_OK);
    cr_assert_eq(config_finalize(&c, &err), AMP_ERR_CONFIG);
    cr_assert_str_eq(err.msg, AMP_SOURCE_DIR "/configs/fashion_mlp.yaml: run.steps (100) and run.epochs (2) are both set");
    config_free(&c);
}

Test(overrides, no_equals_sign)
{
    struct config c;
    load_mlp(&c);
    expect_override_error(&c, "foo", "override 'foo' has no '=': write KEY=VALUE", "optim.lr=3e-4");
    expect_override_error(&c, "=3", "override '=3': no key before '='", NULL);
    config_free(&c);
}

Test(overrides, unknown_key_with_suggestion)
{
    struct config c;
    load_mlp(&c);
    expect_override_error(&c, "optim.lrr=1", "override 'optim.lrr=1': unknown key 'lrr' in optim (did you mean 'lr'?)",
                          "valid keys in optim");
    expect_override_error(&c, "optm.lr=1",
                          "override 'optm.lr=1': unknown key 'optm' at the top level (did you mean 'optim'?)", NULL);
    expect_override_error(&c, "optim.lr.x=1", "override 'optim.lr.x=1': optim.lr is a value, not a section; it has no key 'x'",
                          NULL);
    expect_override_error(&c, "optim..lr=1", "override 'optim..lr=1': 'optim..lr' is not a valid key", NULL);
    expect_override_error(&c, "model.layers.1.kernel=3",
                          "override 'model.layers.1.kernel=3': key 'kernel' does not apply to a linear layer "
                          "(model.layers.1)",
                          "keys of a linear layer");
    expect_override_error(&c, "model.layers.1.outt=3",
                          "override 'model.layers.1.outt=3': unknown key 'outt' in model.layers.1 (linear) (did you "
                          "mean 'out'?)",
                          NULL);
    config_free(&c);
}

Test(overrides, wrong_type)
{
    struct config c;
    load_mlp(&c);
    expect_override_error(&c, "optim.lr=abc", "override 'optim.lr=abc': expected a number, got 'abc'",
                          "optim.lr takes a number > 0");
    expect_override_error(&c, "optim.lr=yes", "override 'optim.lr=yes': expected a number, got 'yes'", NULL);
    expect_override_error(&c, "data.shuffle=no", "override 'data.shuffle=no': expected true or false, got 'no'",
                          "write true or false");
    expect_override_error(&c, "data.files=a.txt", "override 'data.files=a.txt': expected a list of strings, got 'a.txt'",
                          "[a.txt, b.txt]");
    expect_override_error(&c, "accum_steps=1.5", "override 'accum_steps=1.5': expected an integer, got '1.5'", NULL);
    expect_override_error(&c, "precision.mode=fp4", "override 'precision.mode=fp4': unknown value 'fp4' (did you mean 'fp8'?)", "bf16");
    expect_override_error(&c, "optim={lr: abc}", "override 'optim={lr: abc}': optim.lr: expected a number, got 'abc'", NULL);
    expect_override_error(&c, "optim=3", "override 'optim=3': expected a mapping of keys, got '3'", NULL);
    expect_override_error(&c, "optim=~", "override 'optim=~': missing value (a mapping of keys)", "optim={lr: 3e-4}");
    config_free(&c);
}

Test(overrides, out_of_range_and_bad_values)
{
    struct config c;
    load_mlp(&c);
    expect_override_error(&c, "accum_steps=0", "override 'accum_steps=0': accum_steps must be in [1, 65536], got 0", NULL);
    expect_override_error(&c, "optim.betas=[0.9, 1.5]",
                          "override 'optim.betas=[0.9, 1.5]': optim.betas[1] must be in [0, 1), got 1.5", NULL);
    expect_override_error(&c, "optim.lr=", "override 'optim.lr=': missing value after '='", NULL);
    expect_override_error(&c, "optim.lr=~", "override 'optim.lr=~': missing value (write a value or remove the key)", NULL);
    expect_override_error(&c, "optim.betas=[0.9",
                          "override 'optim.betas=[0.9': cannot read the value as YAML: did not find expected ',' or ']'",
                          NULL);
    config_free(&c);
}

Test(overrides, layer_index_out_of_range)
{
    struct config c;
    load_mlp(&c);
    expect_override_error(&c, "model.layers.7.out=3",
                          "override 'model.layers.7.out=3': model.layers has 7 layers (indices 0 to 6), no layer 7",
                          NULL);
    expect_override_error(&c, "model.layers.x.out=3", "override 'model.layers.x.out=3': 'x' is not a layer index", NULL);
    expect_override_error(&c, "model.layers.-1.out=3", "override 'model.layers.-1.out=3': '-1' is not a layer index",
                          NULL);
    expect_override_error(&c, "model.layers.1.out.x=3", "override 'model.layers.1.out.x=3': layer keys have no sub-keys",
                          NULL);
    config_free(&c);
}

Test(overrides, finalize_catches_cross_key_errors_after_overrides)
{
    struct config c;
    struct amp_error err = {0};
    load_mlp(&c);
    cr_assert_eq(config_apply_override(&c, "model.layers.6.kind=relu", &err), AMP_OK);
    cr_assert_eq(config_finalize(&c, &err), AMP_ERR_CONFIG);
    cr_assert(strstr(err.msg, "the last layer must be a loss"), "%s", err.msg);
    config_free(&c);
    load_mlp(&c);
    cr_assert_eq(config_apply_override(&c, "precision.loss_scale.min=1e6", &err), AMP_OK);
    cr_assert_eq(config_finalize(&c, &err), AMP_ERR_CONFIG);
    cr_assert_str_eq(err.msg, AMP_SOURCE_DIR "/configs/fashion_mlp.yaml: precision.loss_scale: min (1000000) is larger "
                              "than init (65536)");
    config_free(&c);
}

/* ---- hostile sizes (docs/reliability.md, "Bounded parsing") -------------------------------------- */

/* A growing buffer for generated configs. */
static char *gen(size_t cap) { char *s = calloc(cap, 1); cr_assert_not_null(s); return s; }

Test(bounds, counts_the_loop_multiplies_are_bounded)
{
    /* Before: these passed and then overflowed int64 in the loop (or looped for ever in one step). */
    expect_error("accum_steps: 4611686018427387904\n" BASE, "t.yaml:1:14: ",
                 "accum_steps must be in [1, 65536], got 4611686018427387904", NULL);
    expect_error("run:\n  epochs: 4611686018427387904\n" BASE, "t.yaml:2:11: ",
                 "run.epochs must be in [0, 1000000], got 4611686018427387904", NULL);
    expect_error("run:\n  steps: 1000000000001\n" BASE, "t.yaml:2:10: ",
                 "run.steps must be in [0, 1000000000000], got 1000000000001", NULL);
    expect_error("data:\n  batch_size: 16777217\n" BASE_MODEL, "t.yaml:2:15: ",
                 "data.batch_size must be in [1, 16777216], got 16777217", NULL);
    expect_error(BASE_DATA "model:\n  layers:\n    - kind: linear\n      out: 99999999999\n    - kind: mse\n",
                 "t.yaml:10:12: ", "model.layers.0.out must be in [1, 16777216], got 99999999999", NULL);
    struct config cfg;
    parse_ok(&cfg, "accum_steps: 65536\nrun:\n  steps: 1000000000000\n" BASE);
    config_free(&cfg);
}

Test(bounds, global_batch_is_batch_times_accum_times_ranks_up_to_2_62)
{
    cr_assert_eq(config_global_batch(32, 4, 8), 1024);
    cr_assert_eq(config_global_batch(1, 1, 1), 1);
    /* the largest the config allows, on 2^22 ranks: exactly 2^62 */
    cr_assert_eq(config_global_batch(16777216, 65536, INT64_C(1) << 22), INT64_C(1) << 62);
    cr_assert_eq(config_global_batch(16777216, 65536, (INT64_C(1) << 22) + 1), -1, "past 2^62");
    cr_assert_eq(config_global_batch(INT64_C(1) << 40, INT64_C(1) << 40, 1), -1, "batch x accum overflows int64");
    cr_assert_eq(config_global_batch(INT64_C(1) << 31, 1, INT64_C(1) << 40), -1, "x ranks overflows int64");
    cr_assert_eq(config_global_batch(-1, 2, 2), -1);
}

Test(bounds, deep_nesting_is_refused_before_libyaml_goes_quadratic)
{
    /* 200000 levels took minutes in libyaml's scanner (8 s at 40000); the event pass stops at 33. */
    size_t depth = 200000;
    char *s = gen(2 * depth + 16);
    strcpy(s, "run: ");
    memset(s + 5, '[', depth);
    memset(s + 5 + depth, ']', depth);
    strcat(s, "\n");
    expect_error(s, "t.yaml:1:", "the YAML nests more than 32 lists or mappings deep here", "at most 4 levels");
    free(s);
    /* Within the limit, the usual message. */
    expect_error("run: [[[[1]]]]\n" BASE, "t.yaml:1:6: ", "run: expected a mapping of keys, got a list", NULL);
    /* And in an override's value. */
    struct config cfg;
    parse_ok(&cfg, BASE);
    char ov[200] = "optim.betas=";
    memset(ov + strlen(ov), '[', 40);
    struct amp_error err = {0};
    cr_assert_eq(config_apply_override(&cfg, ov, &err), AMP_ERR_CONFIG);
    cr_assert(strstr(err.msg, "nests more than 32"), "%s", err.msg);
    config_free(&cfg);
}

Test(bounds, many_layers_and_many_keys_are_linear_or_refused)
{
    /* 5000 layers: refused by count (names are compared pairwise). */
    size_t n = 5000;
    char *s = gen(n * 24 + 1024);
    strcpy(s, BASE_DATA "model:\n  layers:\n");
    size_t len = strlen(s);
    for (size_t i = 0; i < n; i++)
        len += (size_t)sprintf(s + len, "    - {kind: relu}\n");
    expect_error(s, "t.yaml:", "model.layers: 5000 layers; ampTrain builds at most 4096", NULL);
    free(s);
    /* 40000 keys in one mapping (11 s before: the duplicate check compared every pair): the first unknown
     * key is reported, and a duplicate among known keys is still found after thousands of others. */
    n = 40000;
    s = gen(n * 16 + 1024);
    strcpy(s, "run:\n");
    len = strlen(s);
    for (size_t i = 0; i < n; i++)
        len += (size_t)sprintf(s + len, "  k%zu: 1\n", i);
    strcat(s, BASE);
    expect_error(s, "t.yaml:2:3: ", "unknown key 'k0' in run", NULL);
    free(s);
}

Test(errors, a_tagged_number_is_not_a_number)
{
    /* docs/config.md: numbers are written bare; before, !!str 1e-3 was read as the number. */
    expect_error_exact("optim:\n  lr: !!str 1e-3\n" BASE,
                       "t.yaml:2:7: optim.lr: expected a number, got a tagged (!!...) value \"1e-3\"");
    expect_error("accum_steps: !!int 2\n" BASE, "t.yaml:1:14: ", "expected an integer, got a tagged (!!...) value", NULL);
    expect_error("data:\n  shuffle: !!bool true\n" BASE_MODEL, "t.yaml:2:12: ", "got the tagged value \"true\"", NULL);
    /* Anchors and aliases of bare numbers still work. */
    struct config cfg;
    parse_ok(&cfg, "optim:\n  lr: &x 0.25\n  eps: *x\n" BASE);
    cr_assert_eq(cfg.optim.eps, 0.25);
    config_free(&cfg);
}

/* ---- precision.fp8 --------------------------------------------------------------------------------- */

static char *warnings_of(const struct config *c, int *n)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    cr_assert_not_null(f);
    *n = config_print_warnings(c, f);
    fclose(f);
    return buf;
}

Test(cross, fp8_keys_defaults_errors_and_warnings)
{
    struct config c;
    parse_ok(&c, "precision:\n  mode: fp8\n" BASE);
    const struct fp8_config *f = &c.precision.fp8;
    cr_assert_eq(f->recipe, FP8_RECIPE_DELAYED);
    cr_assert_eq(f->amax_history_len, 1024);
    cr_assert_eq(f->amax_compute, FP8_AMAX_MAX);
    cr_assert_eq(f->margin, 0);
    cr_assert_eq(f->loss_scale, FP8_LS_NONE);
    cr_assert_eq(f->nkeep_bf16, 2);
    cr_assert_str_eq(f->keep_bf16[0], "first");
    cr_assert_str_eq(f->keep_bf16[1], "last");
    cr_assert(f->min_size[0] == 4096 && f->min_size[1] == 1024, "torchao's rule: K > 4096 or N > 1024");
    cr_assert(!config_fp8_min_size_written(&c));
    int n;
    char *w = warnings_of(&c, &n);
    cr_assert_eq(n, 0, "%s", w);
    free(w);
    config_free(&c);

    expect_error("precision:\n  fp8:\n    amax_history_len: 0\n" BASE, "t.yaml:3:23: ",
                 "precision.fp8.amax_history_len must be in [1, 65536], got 0", NULL);
    expect_error("precision:\n  fp8:\n    margin: -1\n" BASE, "t.yaml:3:13: ", "precision.fp8.margin must be in [0, 64]",
                 NULL);
    expect_error("precision:\n  fp8:\n    recipe: delay\n" BASE, "t.yaml:3:13: ",
                 "precision.fp8.recipe: unknown value 'delay' (did you mean 'delayed'?)", NULL);
    expect_error("precision:\n  fp8:\n    keep_bf16: [fc9]\n" BASE, "t.yaml:3:5: ",
                 "precision.fp8.keep_bf16: no layer is named 'fc9'", "linear_1");
    expect_error("precision:\n  fp8:\n    keep_bf16: [flatten_0]\n" BASE, "t.yaml:3:5: ",
                 "precision.fp8.keep_bf16: there is no matrix product to keep in layer 'flatten_0'", NULL);
    /* min_size: two whole numbers >= 0 */
    expect_error("precision:\n  fp8:\n    min_size: [-1, 8]\n" BASE, "t.yaml:3:16: ",
                 "precision.fp8.min_size[0] must be a whole number >= 0, got -1", NULL);
    expect_error("precision:\n  fp8:\n    min_size: [16, 1.5]\n" BASE, "t.yaml:3:20: ",
                 "precision.fp8.min_size[1] must be a whole number >= 0, got 1.5", NULL);
    expect_error("precision:\n  fp8:\n    min_size: 4096\n" BASE, "t.yaml:3:15: ",
                 "precision.fp8.min_size: expected a list of two numbers, got '4096'", NULL);
    expect_error("precision:\n  fp8:\n    min_size: [1, 2, 3]\n" BASE, "t.yaml:3:15: ",
                 "precision.fp8.min_size: expected a list of two numbers, got 3 items", NULL);
    parse_ok(&c, "precision:\n  mode: fp8\n  fp8:\n    min_size: [0, 2048]\n" BASE);
    cr_assert(c.precision.fp8.min_size[0] == 0 && c.precision.fp8.min_size[1] == 2048);
    cr_assert(config_fp8_min_size_written(&c), "a checkpoint's config that has the key keeps its value");
    config_free(&c);

    /* keys that do nothing are said to do nothing */
    parse_ok(&c, "precision:\n  mode: bf16\n  fp8:\n    margin: 2\n" BASE);
    w = warnings_of(&c, &n);
    cr_assert(n == 1 && strstr(w, "precision.fp8 is set but precision.mode is bf16"), "%s", w);
    free(w);
    config_free(&c);
    parse_ok(&c, "precision:\n  mode: fp8\n  loss_scale:\n    init: 1024\n" BASE);
    w = warnings_of(&c, &n);
    cr_assert(n == 1 && strstr(w, "fp8 is not loss-scaled unless precision.fp8.loss_scale is static or dynamic"), "%s",
              w);
    free(w);
    config_free(&c);
    parse_ok(&c, "precision:\n  mode: fp8\n  fp8:\n    loss_scale: dynamic\n  loss_scale:\n    init: 1024\n" BASE);
    w = warnings_of(&c, &n);
    cr_assert_eq(n, 0, "dynamic fp8 uses the dynamic keys: %s", w);
    free(w);
    config_free(&c);
    /* a loss-scaled fp8 skips overflowing steps as fp16 does: on_nonfinite: stop would not stop it */
    parse_ok(&c, "precision:\n  mode: fp8\n  fp8:\n    loss_scale: static\nstability:\n  on_nonfinite: stop\n" BASE);
    w = warnings_of(&c, &n);
    cr_assert(n == 1 && strstr(w, "stability.on_nonfinite applies to bf16 and fp32; fp8 skips overflowing steps"), "%s",
              w);
    free(w);
    config_free(&c);
    parse_ok(&c, "precision:\n  mode: fp8\n  fp8:\n    recipe: current\n    amax_history_len: 16\n" BASE);
    w = warnings_of(&c, &n);
    cr_assert(n == 1 && strstr(w, "amax_history_len and amax_compute apply to recipe delayed"), "%s", w);
    free(w);
    config_free(&c);
}

/* ---- config_diff: each differing key, named and with values that read back ----------------------------- */

struct diffs {
    int n, stop_after;
    char keys[8][256], a[8][256], b[8][256];
};

static bool collect_diff(const char *key, const char *a, const char *b, void *user)
{
    struct diffs *d = user;
    if (d->n < 8) {
        snprintf(d->keys[d->n], sizeof d->keys[0], "%s", key);
        snprintf(d->a[d->n], sizeof d->a[0], "%s", a);
        snprintf(d->b[d->n], sizeof d->b[0], "%s", b);
    }
    d->n++;
    return d->n != d->stop_after;
}

Test(config_diff, names_each_differing_key_in_table_order_with_values_that_read_back)
{
    struct config a, b;
    parse_ok(&a, BASE);
    parse_ok(&b, BASE);
    struct diffs d = {0};
    cr_assert_eq(config_diff(&a, &b, collect_diff, &d), 0);
    struct amp_error err = {0};
    cr_assert_eq(config_apply_override(&b, "optim.lr=0.5", &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(config_apply_override(&b, "run.steps=77", &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(config_apply_override(&b, "run.out_dir=\"o k\"", &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(config_apply_override(&b, "model.layers.1.out=33", &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(config_apply_override(&b, "optim.betas=[0.5, 0.25]", &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(config_diff(&a, &b, collect_diff, &d), 5);
    const char *keys[] = {"run.out_dir", "run.steps", "model.layers.1.out", "optim.lr", "optim.betas"};
    for (int i = 0; i < 5; i++)
        cr_assert_str_eq(d.keys[i], keys[i], "difference %d", i);
    cr_assert_str_eq(d.a[3], "0.001");
    cr_assert_str_eq(d.b[3], "0.5");
    cr_assert_str_eq(d.b[0], "\"o k\"");
    /* each value of b, applied to a as KEY=VALUE, makes the two equal */
    for (int i = 0; i < 5; i++) {
        char ov[600];
        snprintf(ov, sizeof ov, "%s=%s", d.keys[i], d.b[i]);
        cr_assert_eq(config_apply_override(&a, ov, &err), AMP_OK, "%s: %s", ov, err.msg);
    }
    cr_assert(config_equal(&a, &b));
    /* the walk stops where the callback says so */
    cr_assert_eq(config_apply_override(&b, "optim.lr=0.25", &err), AMP_OK);
    cr_assert_eq(config_apply_override(&b, "accum_steps=2", &err), AMP_OK);
    d = (struct diffs){.stop_after = 1};
    cr_assert_eq(config_diff(&a, &b, collect_diff, &d), 1);
    cr_assert_str_eq(d.keys[0], "optim.lr");
    config_free(&a);
    config_free(&b);
}

Test(config_diff, layers_of_another_kind_or_number_are_one_difference)
{
    struct config a, b;
    parse_ok(&a, BASE);
    parse_ok(&b, BASE);
    struct amp_error err = {0};
    cr_assert_eq(config_apply_override(&b, "model.layers.2.kind=mse", &err), AMP_OK, "%s", err.msg);
    struct diffs d = {0};
    cr_assert_eq(config_diff(&a, &b, collect_diff, &d), 1);
    cr_assert_str_eq(d.keys[0], "model.layers.2.kind");
    cr_assert_str_eq(d.b[0], "mse");
    config_free(&b);
    const char *yaml = BASE_DATA "model:\n  layers:\n    - kind: flatten\n    - kind: linear\n      out: 16\n"
                                 "    - kind: linear\n      out: 10\n    - kind: cross_entropy\n";
    parse_ok(&b, yaml);
    d = (struct diffs){0};
    cr_assert_geq(config_diff(&a, &b, collect_diff, &d), 1);
    cr_assert_str_eq(d.keys[0], "model.layers");
    config_free(&a);
    config_free(&b);
}
