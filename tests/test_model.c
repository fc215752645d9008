/*
 * test_model.c — the model builder (shape and dtype inference, config errors), parameter init, the
 * low-precision copies, gradient accumulation, whole-model gradients, smaller batches, and a tiny
 * MLP that learns. CPU backend; configs are built in code (no YAML).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"       /* backend_cpu_create, struct optim_update_args */
#include "config.h"        /* struct config, struct layer_config, config_defaults */
#include "dtype.h"         /* bf16_from_fp32 */
#include "layer_testlib.h" /* lc: a layer config with the schema's defaults */
#include "model.h"         /* model_build, model_init, ... */
#include "rng.h"           /* rng_normal: seeded inputs */

/* The loss gradient's seed and a plain SGD step at lr 0.5 (CPU backend memory is host memory). */
static const float unit_seed = 1.0f;
static const struct step_scalars sgd_half = {.grad_mul = 1.0f, .lr = 0.5f};

/* ---- configs ------------------------------------------------------------------------------------- */

static struct layer_config linear(const char *name, int64_t out)
{
    struct layer_config l = lc(LAYER_LINEAR, name);
    l.out = out;
    return l;
}

static struct layer_config conv(const char *name, int64_t out, int64_t kernel)
{
    struct layer_config l = lc(LAYER_CONV2D, name);
    l.out = out;
    l.kernel = kernel;
    return l;
}

static struct layer_config embedding(const char *name, int64_t vocab, int64_t dim)
{
    struct layer_config l = lc(LAYER_EMBEDDING, name);
    l.vocab = vocab;
    l.dim = dim;
    return l;
}

static struct layer_config block(const char *name, int64_t heads)
{
    struct layer_config l = lc(LAYER_TRANSFORMER_BLOCK, name);
    l.heads = heads;
    l.mlp_ratio = 2;
    return l;
}

static const struct data_spec MNIST = {.sample_ndim = 3, .sample_shape = {1, 28, 28}, .num_classes = 10};

static void make_config(struct config *cfg, const struct layer_config *layers, int n, int64_t seq_len)
{
    config_defaults(cfg);
    cfg->model.layers = malloc((size_t)n * sizeof *layers);
    memcpy(cfg->model.layers, layers, (size_t)n * sizeof *layers);
    cfg->model.nlayers = n;
    cfg->data.seq_len = seq_len;
}

/* Build and return the status; the model is freed again unless `keep`. */
static enum amp_status try_build(const struct layer_config *layers, int n, struct data_spec spec,
                                 struct amp_error *err)
{
    struct backend *be = backend_cpu_create();
    struct config cfg;
    make_config(&cfg, layers, n, spec.is_tokens ? spec.sample_shape[0] : 64);
    struct autocast_policy pol;
    autocast_default(&pol, DT_BF16);
    struct model m;
    memset(err, 0, sizeof *err);
    enum amp_status st = model_build(&m, &cfg, &spec, be, &pol, 4, err);
    if (st == AMP_OK)
        model_free(&m);
    config_free(&cfg);
    be->destroy(be);
    return st;
}

#define assert_msg_has(err, s) cr_assert(strstr((err).msg, (s)), "message lacks \"%s\": %s", (s), (err).msg)
#define assert_hint_has(err, s) cr_assert(strstr((err).hint, (s)), "hint lacks \"%s\": %s", (s), (err).hint)

/* ---- build errors -------------------------------------------------------------------------------- */

Test(build_errors, linear_after_conv_without_flatten)
{
    struct layer_config layers[] = {conv("conv1", 4, 3), linear("fc2", 10), lc(LAYER_CROSS_ENTROPY, "loss")};
    struct amp_error err;
    cr_assert_eq(try_build(layers, 3, MNIST, &err), AMP_ERR_CONFIG);
    assert_msg_has(err, "model.layers[1] 'fc2' (linear)");
    assert_msg_has(err, "(N, D)");
    assert_msg_has(err, "(N, 4, 26, 26)");
    assert_msg_has(err, "'conv1' (conv2d)");
    assert_hint_has(err, "flatten");
}

Test(build_errors, linear_on_images)
{
    struct layer_config layers[] = {linear("fc1", 10), lc(LAYER_CROSS_ENTROPY, "loss")};
    struct amp_error err;
    cr_assert_eq(try_build(layers, 2, MNIST, &err), AMP_ERR_CONFIG);
    assert_msg_has(err, "model.layers[0] 'fc1' (linear)");
    assert_msg_has(err, "(N, 1, 28, 28)");
    assert_msg_has(err, "the data");
    assert_hint_has(err, "flatten");
}

Test(build_errors, conv_after_flatten)
{
    struct layer_config layers[] = {lc(LAYER_FLATTEN, "flat"), conv("c", 2, 3), lc(LAYER_CROSS_ENTROPY, "loss")};
    struct amp_error err;
    cr_assert_eq(try_build(layers, 3, MNIST, &err), AMP_ERR_CONFIG);
    assert_msg_has(err, "model.layers[1] 'c' (conv2d)");
    assert_msg_has(err, "(N, C, H, W)");
    assert_msg_has(err, "(N, 784)");
}

Test(build_errors, kernel_larger_than_input)
{
    struct layer_config layers[] = {conv("c", 2, 30), lc(LAYER_FLATTEN, "flat"), linear("fc", 10),
                                    lc(LAYER_CROSS_ENTROPY, "loss")};
    struct amp_error err;
    cr_assert_eq(try_build(layers, 4, MNIST, &err), AMP_ERR_CONFIG);
    assert_msg_has(err, "'c' (conv2d)");
    assert_msg_has(err, "kernel 30");
}

Test(build_errors, wrong_num_classes_names_the_loss_and_the_linear)
{
    struct layer_config layers[] = {lc(LAYER_FLATTEN, "flat"), linear("head", 5), lc(LAYER_CROSS_ENTROPY, "xent")};
    struct amp_error err;
    cr_assert_eq(try_build(layers, 3, MNIST, &err), AMP_ERR_CONFIG);
    assert_msg_has(err, "model.layers[2] 'xent' (cross_entropy)");
    assert_msg_has(err, "'head' (linear)");
    assert_msg_has(err, "10 classes");
    assert_msg_has(err, "gives 5");
}

/* One out-of-range label (a byte 255 in a 10-class IDX file) used to read as a config error with no file
 * named: with the labels' source known it is a data error naming it, the index and the
 * label. */
Test(build_errors, a_label_beyond_the_models_classes_is_a_data_error_naming_the_file)
{
    struct layer_config layers[] = {lc(LAYER_FLATTEN, "flat"), linear("head", 10), lc(LAYER_CROSS_ENTROPY, "xent")};
    struct data_spec spec = MNIST;
    spec.num_classes = 256;
    spec.max_label_at = 1234;
    snprintf(spec.labels_from, sizeof spec.labels_from, "/data/train-labels-idx1-ubyte (data.train_labels)");
    struct amp_error err;
    cr_assert_eq(try_build(layers, 3, spec, &err), AMP_ERR_DATA);
    assert_msg_has(err, "/data/train-labels-idx1-ubyte (data.train_labels): label 255 at index 1234");
    assert_msg_has(err, "beyond the 10 classes");
    assert_hint_has(err, "labels file");
}

Test(build_errors, text_logits_must_match_the_vocabulary)
{
    struct layer_config layers[] = {embedding("emb", 256, 16), linear("head", 100), lc(LAYER_CROSS_ENTROPY, "loss")};
    struct amp_error err;
    cr_assert_eq(try_build(layers, 3, token_spec(8, 256), &err), AMP_ERR_CONFIG);
    assert_msg_has(err, "'loss' (cross_entropy)");
    assert_msg_has(err, "256");
    assert_msg_has(err, "'head' (linear)");
}

Test(build_errors, embedding_on_image_data)
{
    struct layer_config layers[] = {embedding("emb", 256, 16), lc(LAYER_CROSS_ENTROPY, "loss")};
    struct amp_error err;
    cr_assert_eq(try_build(layers, 2, MNIST, &err), AMP_ERR_CONFIG);
    assert_msg_has(err, "model.layers[0] 'emb' (embedding)");
    assert_msg_has(err, "token");
    assert_msg_has(err, "(N, 1, 28, 28)");
}

Test(build_errors, embedding_not_first)
{
    struct layer_config layers[] = {embedding("emb", 256, 16), embedding("emb2", 256, 16), linear("head", 256),
                                    lc(LAYER_CROSS_ENTROPY, "loss")};
    struct amp_error err;
    cr_assert_eq(try_build(layers, 4, token_spec(8, 256), &err), AMP_ERR_CONFIG);
    assert_msg_has(err, "model.layers[1] 'emb2' (embedding)");
    assert_msg_has(err, "first layer");
}

Test(build_errors, text_without_an_embedding_first)
{
    struct layer_config layers[] = {linear("fc", 256), lc(LAYER_CROSS_ENTROPY, "loss")};
    struct amp_error err;
    cr_assert_eq(try_build(layers, 2, token_spec(8, 256), &err), AMP_ERR_CONFIG);
    assert_msg_has(err, "model.layers[0] 'fc' (linear)");
    assert_msg_has(err, "embedding");
}

Test(build_errors, attention_dim_not_divisible_by_heads)
{
    struct layer_config att = lc(LAYER_ATTENTION, "att");
    att.heads = 4;
    struct layer_config layers[] = {embedding("emb", 256, 6), att, linear("head", 256), lc(LAYER_CROSS_ENTROPY, "loss")};
    struct amp_error err;
    cr_assert_eq(try_build(layers, 4, token_spec(8, 256), &err), AMP_ERR_CONFIG);
    assert_msg_has(err, "model.layers[1] 'att' (attention)");
    assert_msg_has(err, "dim 6 is not divisible by heads 4");

    struct layer_config blk[] = {embedding("emb", 256, 6), block("blk", 4), linear("head", 256),
                                 lc(LAYER_CROSS_ENTROPY, "loss")};
    cr_assert_eq(try_build(blk, 4, token_spec(8, 256), &err), AMP_ERR_CONFIG);
    assert_msg_has(err, "'blk' (transformer_block)");
    assert_msg_has(err, "not divisible");
}

Test(build_errors, attention_dim_must_match_its_input)
{
    struct layer_config b = block("blk", 2);
    b.dim = 8;
    struct layer_config layers[] = {embedding("emb", 256, 16), b, linear("head", 256), lc(LAYER_CROSS_ENTROPY, "loss")};
    struct amp_error err;
    cr_assert_eq(try_build(layers, 4, token_spec(8, 256), &err), AMP_ERR_CONFIG);
    assert_msg_has(err, "'blk' (transformer_block)");
    assert_msg_has(err, "dim 8");
    assert_msg_has(err, "(N, 8, 16)");
}

Test(build_errors, sequence_longer_than_max_len)
{
    struct layer_config e = embedding("emb", 256, 16);
    e.max_len = 4;
    struct layer_config layers[] = {e, linear("head", 256), lc(LAYER_CROSS_ENTROPY, "loss")};
    struct amp_error err;
    cr_assert_eq(try_build(layers, 3, token_spec(8, 256), &err), AMP_ERR_CONFIG);
    assert_msg_has(err, "model.layers[0] 'emb' (embedding)");
    assert_msg_has(err, "T = 8");
    assert_msg_has(err, "max_len = 4");
}

Test(build_errors, loss_placement)
{
    struct amp_error err;
    struct layer_config no_loss[] = {lc(LAYER_FLATTEN, "flat"), linear("fc", 10)};
    cr_assert_eq(try_build(no_loss, 2, MNIST, &err), AMP_ERR_CONFIG);
    assert_msg_has(err, "'fc' (linear)");
    assert_msg_has(err, "last layer must be a loss");

    struct layer_config early[] = {lc(LAYER_FLATTEN, "flat"), lc(LAYER_CROSS_ENTROPY, "x"), linear("fc", 10),
                                   lc(LAYER_CROSS_ENTROPY, "loss")};
    cr_assert_eq(try_build(early, 4, MNIST, &err), AMP_ERR_CONFIG);
    assert_msg_has(err, "model.layers[1] 'x' (cross_entropy)");
}

Test(build_errors, batchnorm_on_vectors_and_layernorm_on_tokens)
{
    struct amp_error err;
    struct layer_config bn[] = {lc(LAYER_FLATTEN, "flat"), lc(LAYER_BATCHNORM2D, "bn"), linear("fc", 10),
                                lc(LAYER_CROSS_ENTROPY, "loss")};
    cr_assert_eq(try_build(bn, 4, MNIST, &err), AMP_ERR_CONFIG);
    assert_msg_has(err, "model.layers[1] 'bn' (batchnorm2d)");
    assert_msg_has(err, "(N, 784)");
}

/* ---- shapes and dtypes --------------------------------------------------------------------------- */

struct built {
    struct backend *be;
    struct config cfg;
    struct autocast_policy pol;
    struct model m;
    struct data_spec spec;
};

static void build_ok(struct built *b, const struct layer_config *layers, int n, struct data_spec spec,
                     const struct autocast_policy *pol, int64_t max_batch)
{
    b->be = backend_cpu_create();
    b->spec = spec;
    make_config(&b->cfg, layers, n, spec.is_tokens ? spec.sample_shape[0] : 64);
    b->pol = *pol;
    struct amp_error err = {0};
    cr_assert_eq(model_build(&b->m, &b->cfg, &b->spec, b->be, &b->pol, max_batch, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(model_init(&b->m, &b->cfg, 1234, &err), AMP_OK);
}

static void built_free(struct built *b)
{
    model_free(&b->m);
    config_free(&b->cfg);
    b->be->destroy(b->be);
}

static struct autocast_policy policy(enum dtype lowp)
{
    struct autocast_policy p;
    autocast_default(&p, lowp);
    return p;
}

/* A relu right after a batchnorm2d runs inside it (docs/backend.md, "Fused batchnorm + ReLU"): its y and dx are
 * views then, nothing allocated; a relu after anything else is its own op; a run that measures numerics
 * (run.numerics_every) keeps them apart, and so does a policy that gives the two ops different dtypes. */
static void build_fusion_case(struct built *b, struct layer_config *layers, int n, const struct autocast_policy *pol,
                              int64_t numerics_every)
{
    b->be = backend_cpu_create();
    b->spec = MNIST;
    make_config(&b->cfg, layers, n, 64);
    b->cfg.run.numerics_every = numerics_every;
    b->pol = *pol;
    struct amp_error err = {0};
    cr_assert_eq(model_build(&b->m, &b->cfg, &b->spec, b->be, &b->pol, 4, &err), AMP_OK, "%s", err.msg);
}

static void check_relu_fusion(const struct autocast_policy *pol, int64_t numerics_every, bool fused)
{
    struct layer_config layers[] = {conv("c1", 8, 3), lc(LAYER_BATCHNORM2D, "bn"), lc(LAYER_RELU, "r1"),
                                    conv("c2", 8, 3), lc(LAYER_RELU, "r2"), lc(LAYER_FLATTEN, "flat"),
                                    linear("fc", 10), lc(LAYER_CROSS_ENTROPY, "loss")};
    struct built b;
    build_fusion_case(&b, layers, 8, pol, numerics_every);
    cr_assert_eq(b.m.layers[2].is_view, fused, "r1 after bn: fused %d expected", fused);
    cr_assert_eq(b.m.layers[2].y.data == NULL, fused, "a fused relu allocates no output");
    cr_assert_eq(b.m.layers[2].dx.data == NULL, fused, "nor an input gradient");
    cr_assert_not(b.m.layers[4].is_view, "r2 follows a convolution: its own op");
    cr_assert_not_null(b.m.layers[4].y.data);
    cr_assert(b.m.layers[5].is_view, "flatten is a view");
    built_free(&b);
}

Test(shapes, a_relu_after_batchnorm_runs_inside_it)
{
    struct autocast_policy fp32 = policy(DT_FP32), bf16 = policy(DT_BF16), apart = policy(DT_BF16);
    check_relu_fusion(&fp32, 0, true);
    check_relu_fusion(&bf16, 0, true);
    check_relu_fusion(&bf16, 5, false);
    apart.cls[OP_RELU] = OPC_FP32; /* relu out fp32, batchnorm's bf16 */
    check_relu_fusion(&apart, 0, false);
}

/* linear, relu, linear, relu, dropout, linear: both relus run inside the linear layer before them (views: no
 * output, no input gradient of their own), unless fusing is off (run.numerics_every) or the relu's output dtype is
 * not the linear layer's. */
static void check_linear_relu_fusion(const struct autocast_policy *pol, int64_t numerics_every, bool fused)
{
    struct layer_config layers[] = {lc(LAYER_FLATTEN, "flat"), linear("fc1", 32), lc(LAYER_RELU, "r1"),
                                    linear("fc2", 16), lc(LAYER_RELU, "r2"), lc(LAYER_DROPOUT, "drop"),
                                    linear("head", 10), lc(LAYER_CROSS_ENTROPY, "loss")};
    struct built b;
    build_fusion_case(&b, layers, 8, pol, numerics_every);
    for (int i = 2; i <= 4; i += 2) {
        cr_assert_eq(b.m.layers[i].is_view, fused, "%s after a linear layer: fused %d expected",
                     b.m.layers[i].cfg.name, fused);
        cr_assert_eq(b.m.layers[i].y.data == NULL, fused, "a fused relu allocates no output");
        cr_assert_eq(b.m.layers[i].dx.data == NULL, fused, "nor an input gradient");
    }
    built_free(&b);
}

Test(shapes, a_relu_after_a_linear_layer_runs_inside_it)
{
    struct autocast_policy fp32 = policy(DT_FP32), bf16 = policy(DT_BF16), apart = policy(DT_BF16);
    check_linear_relu_fusion(&fp32, 0, true);
    check_linear_relu_fusion(&bf16, 0, true);
    check_linear_relu_fusion(&bf16, 5, false);
    apart.cls[OP_RELU] = OPC_FP32; /* relu out fp32, the linear layers' bf16 */
    check_linear_relu_fusion(&apart, 0, false);
    /* a transformer block's op kind is OP_LINEAR too, but it is not a linear layer: the relu after it stays apart */
    struct layer_config layers[] = {embedding("emb", 256, 16), block("block_1", 2), lc(LAYER_RELU, "r"),
                                    linear("head", 256), lc(LAYER_CROSS_ENTROPY, "loss")};
    struct built b;
    build_ok(&b, layers, 5, token_spec(8, 256), &fp32, 4);
    cr_assert_not(b.m.layers[2].is_view, "a relu after a transformer block runs on its own");
    cr_assert_not_null(b.m.layers[2].y.data);
    built_free(&b);
}

Test(shapes, mlp_and_cnn_shapes)
{
    struct layer_config layers[] = {conv("c1", 8, 3), lc(LAYER_RELU, "r1"), lc(LAYER_MAXPOOL2D, "p1"),
                                    lc(LAYER_FLATTEN, "flat"), linear("fc", 10), lc(LAYER_CROSS_ENTROPY, "loss")};
    layers[2].kernel = 2;
    layers[2].stride = 2;
    struct autocast_policy pol = policy(DT_FP32);
    struct built b;
    build_ok(&b, layers, 6, MNIST, &pol, 16);
    struct model *m = &b.m;
    int64_t want[][4] = {{16, 8, 26, 26}, {16, 8, 26, 26}, {16, 8, 13, 13}, {16, 1352}, {16, 10}, {16}};
    int ndim[] = {4, 4, 4, 2, 2, 1};
    for (int i = 0; i < 6; i++) {
        cr_assert_eq(m->layers[i].ndim_out, ndim[i], "layer %d", i);
        for (int d = 0; d < ndim[i]; d++)
            cr_assert_eq(m->layers[i].out_shape[d], want[i][d], "layer %d dim %d", i, d);
    }
    cr_assert_not(m->layers[0].needs_dx);
    cr_assert_null(m->layers[0].dx.data, "the first layer has no input gradient");
    cr_assert(m->layers[1].needs_dx);
    cr_assert_eq(m->layers[4].dx.shape[1], 1352);
    cr_assert_eq(m->nparams, 4);
    cr_assert_str_eq(m->params[0]->name, "c1/weight");
    cr_assert_eq(m->params[0]->master.shape[1], 1);
    cr_assert_eq(m->params[0]->master.shape[3], 3);
    cr_assert_str_eq(m->params[2]->name, "fc/weight");
    cr_assert_eq(m->params[2]->master.shape[0], 10);
    cr_assert_eq(m->params[2]->master.shape[1], 1352);
    cr_assert_eq(m->params[2]->layer, 4);
    cr_assert(m->params[2]->decay);
    cr_assert_not(m->params[3]->decay, "biases are not decayed");
    cr_assert_eq(model_loss_rows(m, 16), 16);
    cr_assert_not_null(m->correct);
    built_free(&b);
}

/* A layer computes its input gradient only where a layer before it has parameters (PyTorch's autograd: the samples
 * do not require a gradient), so an MLP's first linear layer skips its dx product; data_spec.input_grad asks for
 * every layer's but the first. */
Test(shapes, only_layers_after_a_parameter_compute_an_input_gradient)
{
    struct layer_config layers[] = {lc(LAYER_FLATTEN, "flat"), lc(LAYER_DROPOUT, "drop"), linear("fc1", 16),
                                    lc(LAYER_RELU, "r1"), lc(LAYER_DROPOUT, "drop2"), linear("fc2", 10),
                                    lc(LAYER_CROSS_ENTROPY, "loss")};
    const bool want[] = {false, false, false, true, true, true, true};
    struct autocast_policy pol = policy(DT_BF16);
    for (int input_grad = 0; input_grad < 2; input_grad++) {
        struct data_spec spec = MNIST;
        spec.input_grad = input_grad;
        struct built b;
        build_ok(&b, layers, 7, spec, &pol, 4);
        for (int i = 0; i < 7; i++) {
            const struct layer *l = &b.m.layers[i];
            const bool needs = want[i] || (input_grad && i > 0);
            cr_assert_eq(l->needs_dx, needs, "input_grad %d: layer %d '%s' needs_dx %d, want %d", input_grad, i,
                         l->cfg.name, l->needs_dx, needs);
            if (!l->is_view && !l->dx_is_input)
                cr_assert_eq(l->dx.data != NULL, needs, "layer %d '%s': an input gradient is allocated where needed",
                             i, l->cfg.name);
        }
        /* the loss writes its dlogits over fc2's logits: no tensor of its own */
        cr_assert(b.m.layers[6].dx_is_input && b.m.layers[6].dx.data == NULL);
        built_free(&b);
    }
}

Test(shapes, gpt_parameter_names)
{
    struct layer_config layers[] = {embedding("emb", 256, 16), block("block_1", 2), lc(LAYER_LAYERNORM, "ln_f"),
                                    linear("head", 256), lc(LAYER_CROSS_ENTROPY, "loss")};
    struct autocast_policy pol = policy(DT_FP32);
    struct built b;
    build_ok(&b, layers, 5, token_spec(8, 256), &pol, 4);
    const char *names[] = {"emb/wte",
                           "emb/wpe",
                           "block_1/ln1/weight",
                           "block_1/ln1/bias",
                           "block_1/attn/qkv/weight",
                           "block_1/attn/qkv/bias",
                           "block_1/attn/proj/weight",
                           "block_1/attn/proj/bias",
                           "block_1/ln2/weight",
                           "block_1/ln2/bias",
                           "block_1/mlp/fc/weight",
                           "block_1/mlp/fc/bias",
                           "block_1/mlp/proj/weight",
                           "block_1/mlp/proj/bias",
                           "ln_f/weight",
                           "ln_f/bias",
                           "head/weight",
                           "head/bias"};
    cr_assert_eq(b.m.nparams, 18);
    for (int i = 0; i < 18; i++)
        cr_assert_str_eq(b.m.params[i]->name, names[i]);
    cr_assert_eq(b.m.params[1]->master.shape[0], 8, "max_len defaults to data.seq_len");
    cr_assert_eq(b.m.params[4]->master.shape[0], 48);
    cr_assert_eq(b.m.params[10]->master.shape[0], 32);
    cr_assert_eq(model_loss_rows(&b.m, 3), 24);
    built_free(&b);
}

static void assert_dtypes(const struct model *m, const enum dtype *want)
{
    for (int i = 0; i < m->nlayers; i++) {
        cr_assert_eq(m->layers[i].out_dtype, want[i], "layer %d '%s': %s, want %s", i, m->layers[i].cfg.name,
                     dtype_name(m->layers[i].out_dtype), dtype_name(want[i]));
        if (!m->layers[i].y.data)
            continue;
        cr_assert_eq(m->layers[i].y.dtype, want[i]);
        if (i > 0 && m->layers[i].dx.data)
            cr_assert_eq(m->layers[i].dx.dtype, want[i - 1], "layer %d's dx has its input's dtype", i);
    }
}

Test(dtypes, bf16_policy)
{
    struct layer_config layers[] = {lc(LAYER_FLATTEN, "flat"), linear("fc1", 32), lc(LAYER_RELU, "relu"),
                                    linear("fc2", 10), lc(LAYER_CROSS_ENTROPY, "loss")};
    struct autocast_policy pol = policy(DT_BF16);
    struct built b;
    build_ok(&b, layers, 5, MNIST, &pol, 4);
    assert_dtypes(&b.m, (enum dtype[]){DT_FP32, DT_BF16, DT_BF16, DT_BF16, DT_FP32});
    for (int i = 0; i < b.m.nparams; i++) {
        const struct param *p = b.m.params[i];
        cr_assert_eq(p->master.dtype, DT_FP32);
        cr_assert_eq(p->grad.dtype, DT_FP32);
        if (strstr(p->name, "/weight")) { /* read by a bf16 linear: a bf16 copy */
            cr_assert_eq(p->copy.dtype, DT_BF16, "%s", p->name);
            cr_assert_not_null(p->copy.data, "%s", p->name);
            cr_assert_eq(param_value(p), &p->copy);
        } else { /* a bias, added in fp32 inside the op: read from the master, no copy */
            cr_assert_null(p->copy.data, "%s has a copy", p->name);
            cr_assert_eq(param_value(p), &p->master);
        }
    }
    built_free(&b);
}

Test(dtypes, fp16_text_model)
{
    struct layer_config layers[] = {embedding("emb", 256, 16), block("blk", 2), lc(LAYER_LAYERNORM, "ln_f"),
                                    linear("head", 256), lc(LAYER_CROSS_ENTROPY, "loss")};
    struct autocast_policy pol = policy(DT_FP16);
    struct built b;
    build_ok(&b, layers, 5, token_spec(8, 256), &pol, 2);
    assert_dtypes(&b.m, (enum dtype[]){DT_FP32, DT_FP32, DT_FP32, DT_FP16, DT_FP32});
    built_free(&b);
}

Test(dtypes, fp32_ops_override)
{
    struct layer_config layers[] = {lc(LAYER_FLATTEN, "flat"), linear("fc1", 32), lc(LAYER_RELU, "relu"),
                                    linear("fc2", 10), lc(LAYER_CROSS_ENTROPY, "loss")};
    struct autocast_config ac;
    memset(&ac, 0, sizeof ac);
    snprintf(ac.fp32_ops[0], sizeof ac.fp32_ops[0], "linear");
    ac.nfp32 = 1;
    struct autocast_policy pol;
    struct amp_error err;
    cr_assert_eq(autocast_from_config(&pol, PREC_BF16, &ac, &err), AMP_OK);
    struct built b;
    build_ok(&b, layers, 5, MNIST, &pol, 4);
    assert_dtypes(&b.m, (enum dtype[]){DT_FP32, DT_FP32, DT_FP32, DT_FP32, DT_FP32});
    built_free(&b);
}

Test(dtypes, fp32_policy_has_no_lowp_copies)
{
    struct layer_config layers[] = {lc(LAYER_FLATTEN, "flat"), linear("fc1", 32), lc(LAYER_CROSS_ENTROPY, "loss")};
    layers[1].out = 10;
    struct autocast_policy pol = policy(DT_FP32);
    struct built b;
    build_ok(&b, layers, 3, MNIST, &pol, 4);
    assert_dtypes(&b.m, (enum dtype[]){DT_FP32, DT_FP32, DT_FP32});
    for (int i = 0; i < b.m.nparams; i++)
        cr_assert_null(b.m.params[i]->copy.data);
    model_refresh_copies(&b.m); /* nothing to refresh, and no crash */
    built_free(&b);
}

Test(dtypes, lowp_copies_are_the_master_rounded)
{
    struct layer_config layers[] = {lc(LAYER_FLATTEN, "flat"), linear("fc1", 32), lc(LAYER_RELU, "relu"),
                                    linear("fc2", 10), lc(LAYER_CROSS_ENTROPY, "loss")};
    struct autocast_policy pol = policy(DT_BF16);
    struct built b;
    build_ok(&b, layers, 5, MNIST, &pol, 4);
    for (int i = 0; i < b.m.nparams; i++) {
        struct param *p = b.m.params[i];
        size_t n = p->master.numel;
        float *w = malloc(n * sizeof *w);
        for (size_t j = 0; j < n; j++) /* values with bits below bf16's precision, ties included */
            w[j] = rng_normal(5, (uint64_t)i, j) * 3.0f + (j % 7 == 0 ? 1.00390625f : 0.0f);
        tensor_from_host_f32(&p->master, w);
        free(w);
    }
    model_refresh_copies(&b.m);
    for (int i = 0; i < b.m.nparams; i++) {
        struct param *p = b.m.params[i];
        if (!strstr(p->name, "/weight"))
            continue; /* biases have no copy (bf16_policy) */
        size_t n = p->master.numel;
        float *w = malloc(n * sizeof *w);
        uint16_t *lo = malloc(n * sizeof *lo);
        tensor_to_host_f32(&p->master, w);
        b.be->download(b.be, lo, p->copy.data, n * sizeof *lo);
        for (size_t j = 0; j < n; j++)
            cr_assert_eq(lo[j], bf16_from_fp32(w[j]), "%s[%zu]", p->name, j);
        free(w);
        free(lo);
    }
    built_free(&b);
}

/* ---- init ---------------------------------------------------------------------------------------- */

static float *param_values(struct model *m, const char *name, size_t *n)
{
    for (int i = 0; i < m->nparams; i++)
        if (strcmp(m->params[i]->name, name) == 0) {
            *n = m->params[i]->master.numel;
            float *v = malloc(*n * sizeof *v);
            tensor_to_host_f32(&m->params[i]->master, v);
            return v;
        }
    cr_assert_fail("no parameter %s", name);
    return NULL;
}

static void moments(const float *v, size_t n, double *mean, double *std, double *absmax)
{
    double s = 0, ss = 0, mx = 0;
    for (size_t i = 0; i < n; i++) {
        s += v[i];
        mx = fmax(mx, fabs(v[i]));
    }
    *mean = s / (double)n;
    for (size_t i = 0; i < n; i++)
        ss += (v[i] - *mean) * (v[i] - *mean);
    *std = sqrt(ss / (double)n);
    *absmax = mx;
}

static const struct layer_config GPT[] = {
    {.kind = LAYER_EMBEDDING, .name = "emb", .vocab = 256, .dim = 64},
    {.kind = LAYER_TRANSFORMER_BLOCK, .name = "b0", .heads = 4, .mlp_ratio = 4, .eps = 1e-5},
    {.kind = LAYER_TRANSFORMER_BLOCK, .name = "b1", .heads = 4, .mlp_ratio = 4, .eps = 1e-5},
    {.kind = LAYER_LAYERNORM, .name = "ln_f", .eps = 1e-5},
    {.kind = LAYER_LINEAR, .name = "head", .out = 256, .bias = true},
    {.kind = LAYER_CROSS_ENTROPY, .name = "loss"},
};

static void init_with(struct built *b, const struct layer_config *layers, int n, struct data_spec spec,
                      enum init_scheme scheme, uint64_t seed)
{
    struct autocast_policy pol = policy(DT_FP32);
    build_ok(b, layers, n, spec, &pol, 2);
    b->cfg.model.init = scheme;
    struct amp_error err;
    cr_assert_eq(model_init(&b->m, &b->cfg, seed, &err), AMP_OK);
}

Test(init, same_seed_same_params_other_seed_other_params)
{
    struct built a, b, c;
    init_with(&a, GPT, 6, token_spec(16, 256), INIT_PYTORCH, 7);
    init_with(&b, GPT, 6, token_spec(16, 256), INIT_PYTORCH, 7);
    init_with(&c, GPT, 6, token_spec(16, 256), INIT_PYTORCH, 8);
    for (int i = 0; i < a.m.nparams; i++) {
        size_t n;
        float *va = param_values(&a.m, a.m.params[i]->name, &n);
        float *vb = param_values(&b.m, a.m.params[i]->name, &n);
        float *vc = param_values(&c.m, a.m.params[i]->name, &n);
        cr_assert(memcmp(va, vb, n * sizeof *va) == 0, "%s differs under the same seed", a.m.params[i]->name);
        bool constant = a.m.params[i]->init == PINIT_NORM_GAIN || a.m.params[i]->init == PINIT_NORM_SHIFT;
        if (!constant)
            cr_assert(memcmp(va, vc, n * sizeof *va) != 0, "%s equal under another seed", a.m.params[i]->name);
        free(va);
        free(vb);
        free(vc);
    }
    built_free(&a);
    built_free(&b);
    built_free(&c);
}

Test(init, a_parameter_depends_on_its_name_not_on_other_layers)
{
    struct layer_config small[] = {lc(LAYER_FLATTEN, "flat"), linear("fc", 10), lc(LAYER_CROSS_ENTROPY, "loss")};
    struct layer_config big[] = {lc(LAYER_FLATTEN, "flat"), linear("pre", 784), linear("fc", 10),
                                 lc(LAYER_CROSS_ENTROPY, "loss")};
    struct built a, b;
    init_with(&a, small, 3, MNIST, INIT_PYTORCH, 3);
    init_with(&b, big, 4, MNIST, INIT_PYTORCH, 3);
    size_t n, n2;
    float *va = param_values(&a.m, "fc/weight", &n), *vb = param_values(&b.m, "fc/weight", &n2);
    cr_assert_eq(n, n2);
    cr_assert(memcmp(va, vb, n * sizeof *va) == 0);
    free(va);
    free(vb);
    built_free(&a);
    built_free(&b);
}

Test(init, pytorch_defaults)
{
    struct layer_config layers[] = {conv("c", 16, 3), lc(LAYER_BATCHNORM2D, "bn"), lc(LAYER_FLATTEN, "flat"),
                                    linear("fc", 10), lc(LAYER_CROSS_ENTROPY, "loss")};
    struct built b;
    init_with(&b, layers, 5, MNIST, INIT_PYTORCH, 11);
    struct {
        const char *name;
        double bound;
    } uniform[] = {{"c/weight", 1 / 3.0}, {"c/bias", 1 / 3.0}, {"fc/weight", 1 / sqrt(16 * 26 * 26.0)},
                   {"fc/bias", 1 / sqrt(16 * 26 * 26.0)}};
    for (size_t i = 0; i < sizeof uniform / sizeof *uniform; i++) {
        size_t n;
        float *v = param_values(&b.m, uniform[i].name, &n);
        double mean, std, mx, bound = uniform[i].bound;
        moments(v, n, &mean, &std, &mx);
        cr_assert(mx <= bound, "%s: |w| up to %g, bound %g", uniform[i].name, mx, bound);
        if (n >= 1000) {
            cr_assert(fabs(std - bound / sqrt(3.0)) < 0.03 * bound, "%s: std %g, want %g", uniform[i].name, std,
                      bound / sqrt(3.0));
            cr_assert(fabs(mean) < 0.03 * bound, "%s: mean %g", uniform[i].name, mean);
            cr_assert(mx > 0.99 * bound, "%s fills its range", uniform[i].name);
        }
        free(v);
    }
    size_t n;
    float *g = param_values(&b.m, "bn/weight", &n), *s = param_values(&b.m, "bn/bias", &n);
    for (size_t i = 0; i < n; i++) {
        cr_assert_eq(g[i], 1.0f);
        cr_assert_eq(s[i], 0.0f);
    }
    free(g);
    free(s);
    cr_assert_eq(b.m.nbuffers, 2);
    float rm[16], rv[16];
    tensor_to_host_f32(&b.m.buffers[0]->t, rm);
    tensor_to_host_f32(&b.m.buffers[1]->t, rv);
    for (int i = 0; i < 16; i++) {
        cr_assert_eq(rm[i], 0.0f);
        cr_assert_eq(rv[i], 1.0f);
    }
    built_free(&b);
}

Test(init, pytorch_embeddings_are_standard_normal)
{
    struct built b;
    init_with(&b, GPT, 6, token_spec(16, 256), INIT_PYTORCH, 5);
    size_t n;
    float *v = param_values(&b.m, "emb/wte", &n);
    double mean, std, mx;
    moments(v, n, &mean, &std, &mx);
    cr_assert(fabs(std - 1.0) < 0.03, "std %g", std);
    cr_assert(fabs(mean) < 0.03, "mean %g", mean);
    free(v);
    built_free(&b);
}

Test(init, gpt2_scheme)
{
    struct built b;
    init_with(&b, GPT, 6, token_spec(16, 256), INIT_GPT2, 5);
    const char *normal002[] = {"emb/wte", "emb/wpe", "b0/attn/qkv/weight", "b1/mlp/fc/weight", "head/weight"};
    for (size_t i = 0; i < sizeof normal002 / sizeof *normal002; i++) {
        size_t n;
        float *v = param_values(&b.m, normal002[i], &n);
        double mean, std, mx;
        moments(v, n, &mean, &std, &mx);
        cr_assert(fabs(std - 0.02) < 0.002, "%s: std %g", normal002[i], std);
        cr_assert(fabs(mean) < 0.002, "%s: mean %g", normal002[i], mean);
        free(v);
    }
    const char *residual[] = {"b0/attn/proj/weight", "b1/mlp/proj/weight"};
    double want = 0.02 / sqrt(2.0 * 2); /* two blocks */
    for (size_t i = 0; i < 2; i++) {
        size_t n;
        float *v = param_values(&b.m, residual[i], &n);
        double mean, std, mx;
        moments(v, n, &mean, &std, &mx);
        cr_assert(fabs(std - want) < 0.1 * want, "%s: std %g, want %g", residual[i], std, want);
        free(v);
    }
    const char *zero[] = {"b0/attn/qkv/bias", "b0/mlp/proj/bias", "head/bias", "b1/ln1/bias", "ln_f/bias"};
    for (size_t i = 0; i < sizeof zero / sizeof *zero; i++) {
        size_t n;
        float *v = param_values(&b.m, zero[i], &n);
        for (size_t j = 0; j < n; j++)
            cr_assert_eq(v[j], 0.0f, "%s", zero[i]);
        free(v);
    }
    size_t n;
    float *g = param_values(&b.m, "b1/ln2/weight", &n);
    for (size_t j = 0; j < n; j++)
        cr_assert_eq(g[j], 1.0f);
    free(g);
    built_free(&b);
}

/* ---- whole-model passes -------------------------------------------------------------------------- */

/* A batch in CPU memory: x or tokens, labels, filled from a seed. */
struct test_batch {
    struct batch b;
    struct backend *be;
};

static void batch_fill(struct test_batch *tb, struct backend *be, const struct data_spec *spec, int64_t n,
                       uint64_t seed)
{
    memset(tb, 0, sizeof *tb);
    tb->be = be;
    tb->b.n = n;
    int64_t T = spec->is_tokens ? spec->sample_shape[0] : 1;
    int64_t rows = n * T;
    tb->b.labels = be->alloc(be, (size_t)rows * sizeof(int32_t));
    int32_t *lab = tb->b.labels;
    for (int64_t i = 0; i < rows; i++)
        lab[i] = (int32_t)(rng_bits(seed, 1, (uint64_t)i) % (uint64_t)spec->num_classes);
    if (spec->is_tokens) {
        tb->b.tokens = be->alloc(be, (size_t)rows * sizeof(int32_t));
        for (int64_t i = 0; i < rows; i++)
            tb->b.tokens[i] = (int32_t)(rng_bits(seed, 2, (uint64_t)i) % (uint64_t)spec->num_classes);
        return;
    }
    int64_t shape[4] = {n, 1, 1, 1};
    for (int i = 0; i < spec->sample_ndim; i++)
        shape[1 + i] = spec->sample_shape[i];
    struct amp_error err;
    cr_assert_eq(tensor_alloc(&tb->b.x, be, DT_FP32, 1 + spec->sample_ndim, shape, "x", &err), AMP_OK);
    float *x = malloc(tb->b.x.numel * sizeof *x);
    for (size_t i = 0; i < tb->b.x.numel; i++)
        x[i] = rng_normal(seed, 3, i);
    tensor_from_host_f32(&tb->b.x, x);
    free(x);
}

static void batch_free(struct test_batch *tb)
{
    tensor_free(&tb->b.x);
    tb->be->free(tb->be, tb->b.labels);
    if (tb->b.tokens)
        tb->be->free(tb->be, tb->b.tokens);
}

static struct step_ctx train_ctx(struct built *b, bool accumulate)
{
    return (struct step_ctx){.be = b->be, .policy = &b->pol, .training = true, .key = {.seed = 9, .counter = 1},
                             .grad_seed = &unit_seed, .accumulate = accumulate};
}

/* Mean loss of the batch (the loss layer's rows). */
static double mean_loss(struct built *b, const struct step_ctx *ctx, const struct batch *batch)
{
    model_forward(&b->m, ctx, batch);
    int64_t rows = model_loss_rows(&b->m, batch->n);
    float *l = malloc((size_t)rows * sizeof *l);
    struct tensor y = b->m.layers[b->m.nlayers - 1].y;
    y = tensor_reshape(&y, 1, &rows);
    tensor_to_host_f32(&y, l);
    double s = 0;
    for (int64_t i = 0; i < rows; i++)
        s += l[i];
    free(l);
    return s / (double)rows;
}

static float **grads_host(struct model *m)
{
    float **g = calloc((size_t)m->nparams, sizeof *g);
    for (int i = 0; i < m->nparams; i++) {
        g[i] = malloc(m->params[i]->grad.numel * sizeof *g[i]);
        tensor_to_host_f32(&m->params[i]->grad, g[i]);
    }
    return g;
}

static void grads_free(struct model *m, float **g)
{
    for (int i = 0; i < m->nparams; i++)
        free(g[i]);
    free(g);
}

static const struct layer_config CNN[] = {
    {.kind = LAYER_CONV2D, .name = "c1", .out = 3, .kernel = 3, .stride = 1, .padding = 1, .bias = true},
    {.kind = LAYER_BATCHNORM2D, .name = "bn", .eps = 1e-5, .momentum = 0.1},
    {.kind = LAYER_RELU, .name = "r1"},
    {.kind = LAYER_MAXPOOL2D, .name = "p1", .kernel = 2, .stride = 2},
    {.kind = LAYER_AVGPOOL2D, .name = "p2", .kernel = 2, .stride = 1, .padding = 1},
    {.kind = LAYER_FLATTEN, .name = "flat"},
    {.kind = LAYER_DROPOUT, .name = "drop", .p = 0.3},
    {.kind = LAYER_LINEAR, .name = "fc1", .out = 8, .bias = true},
    {.kind = LAYER_GELU, .name = "g1", .approximate = GELU_ERF},
    {.kind = LAYER_LINEAR, .name = "fc2", .out = 5, .bias = true},
    {.kind = LAYER_CROSS_ENTROPY, .name = "loss"},
};
static const struct data_spec CNN_SPEC = {.sample_ndim = 3, .sample_shape = {2, 6, 6}, .num_classes = 5};

static const struct layer_config SMALL_GPT[] = {
    {.kind = LAYER_EMBEDDING, .name = "emb", .vocab = 11, .dim = 8},
    {.kind = LAYER_DROPOUT, .name = "drop", .p = 0.2},
    {.kind = LAYER_TRANSFORMER_BLOCK, .name = "b0", .heads = 2, .mlp_ratio = 2, .eps = 1e-5},
    {.kind = LAYER_ATTENTION, .name = "att", .heads = 4},
    {.kind = LAYER_LAYERNORM, .name = "ln_f", .eps = 1e-5},
    {.kind = LAYER_LINEAR, .name = "head", .out = 11, .bias = true},
    {.kind = LAYER_CROSS_ENTROPY, .name = "loss"},
};

/* Finite differences of the mean loss over a few elements of every parameter, through the whole model. */
static void model_gradients(const struct layer_config *layers, int n, struct data_spec spec, int64_t batch)
{
    struct autocast_policy pol = policy(DT_FP32);
    struct built b;
    build_ok(&b, layers, n, spec, &pol, batch);
    struct test_batch tb;
    batch_fill(&tb, b.be, &spec, batch, 17);
    struct step_ctx ctx = train_ctx(&b, false);
    model_forward(&b.m, &ctx, &tb.b);
    model_backward(&b.m, &ctx, &tb.b);
    float **g = grads_host(&b.m);
    int bad = 0, checked = 0;
    const float eps = 1e-3f; /* small: relu and maxpool kinks sit among the many activations a weight moves */
    for (int i = 0; i < b.m.nparams; i++) {
        struct param *p = b.m.params[i];
        size_t pn = p->master.numel;
        float *w = malloc(pn * sizeof *w);
        tensor_to_host_f32(&p->master, w);
        size_t step = pn > 12 ? pn / 12 : 1;
        for (size_t j = 0; j < pn; j += step) {
            float save = w[j];
            w[j] = save + eps;
            tensor_from_host_f32(&p->master, w);
            double fp = mean_loss(&b, &ctx, &tb.b);
            w[j] = save - eps;
            tensor_from_host_f32(&p->master, w);
            double fm = mean_loss(&b, &ctx, &tb.b);
            w[j] = save;
            tensor_from_host_f32(&p->master, w);
            double fd = (fp - fm) / (2.0 * eps), an = g[i][j];
            checked++;
            if (fabs(fd - an) > 1e-3 + 2e-2 * fabs(an) && bad++ < 5)
                cr_log_error("%s[%zu]: analytic %.6g, finite difference %.6g", p->name, j, an, fd);
        }
        free(w);
    }
    cr_assert_eq(bad, 0, "%d of %d parameter gradient elements disagree", bad, checked);
    grads_free(&b.m, g);
    batch_free(&tb);
    built_free(&b);
}

Test(passes, cnn_gradients_through_the_whole_model)
{
    model_gradients(CNN, 11, CNN_SPEC, 4);
}

Test(passes, gpt_gradients_through_the_whole_model)
{
    model_gradients(SMALL_GPT, 7, token_spec(5, 11), 3);
}

/* What a backward told its hook: each call's parameter, and grad_flat as it was then (CPU memory). */
struct told {
    const struct model *m;
    int n;
    const struct param *first[64];
    float *flat[64];
};

static void record_told(void *user, const struct param *first)
{
    struct told *t = user;
    cr_assert_lt(t->n, 64);
    t->first[t->n] = first;
    t->flat[t->n] = malloc(t->m->grad_flat_count * sizeof(float));
    memcpy(t->flat[t->n], t->m->grad_flat, t->m->grad_flat_count * sizeof(float));
    t->n++;
}

/* The backward hook (layer.h, struct backward_hook) is told of gradients only once they are final: grad_flat,
 * filled with NaN first, holds from each told parameter's first float to its end the bits it holds after the
 * backward; each call names an earlier parameter, the last the first; a transformer block and an attention layer
 * tell it inside their backward too (`want`, in order); a tied table is told with its embedding, last. */
static void hook_told_final(const struct layer_config *layers, int n, const char *const *want, int nwant)
{
    struct autocast_policy pol = policy(DT_FP32);
    struct built b;
    build_ok(&b, layers, n, token_spec(5, 11), &pol, 3);
    struct test_batch tb;
    batch_fill(&tb, b.be, &b.spec, 3, 41);
    struct told t = {.m = &b.m};
    struct backward_hook hook = {.grads_final = record_told, .user = &t};
    struct step_ctx ctx = train_ctx(&b, false);
    ctx.hook = &hook;
    model_forward(&b.m, &ctx, &tb.b);
    for (size_t i = 0; i < b.m.grad_flat_count; i++)
        b.m.grad_flat[i] = NAN;
    model_backward(&b.m, &ctx, &tb.b);
    cr_assert_eq(t.n, nwant, "the hook was told %d times, not %d", t.n, nwant);
    size_t prev = b.m.grad_flat_count + 1;
    for (int k = 0; k < t.n; k++) {
        size_t from = (size_t)((const float *)t.first[k]->grad.data - b.m.grad_flat);
        cr_assert_str_eq(t.first[k]->name, want[k], "call %d", k);
        cr_assert_lt(from, prev, "call %d (%s) names no earlier parameter than the one before", k, want[k]);
        cr_assert_eq(memcmp(t.flat[k] + from, b.m.grad_flat + from, (b.m.grad_flat_count - from) * sizeof(float)),
                     0, "call %d: a gradient from %s on was written after the hook was told", k, want[k]);
        prev = from;
        free(t.flat[k]);
    }
    cr_assert_eq(prev, 0, "the last call is not the first parameter");
    batch_free(&tb);
    built_free(&b);
}

Test(passes, backward_tells_the_hook_of_final_gradients_inside_blocks)
{
    static const char *const want[] = {"head/weight", "ln_f/weight", "att/proj/weight", "att/qkv/weight",
                                       "b0/mlp/proj/weight", "b0/mlp/fc/weight", "b0/ln2/weight",
                                       "b0/attn/proj/weight", "b0/attn/qkv/weight", "b0/ln1/weight", "emb/wte"};
    hook_told_final(SMALL_GPT, 7, want, 11);
}

/* The loss layer's per-row losses (host copy) and their count. */
static float *losses_host(struct built *b, const struct batch *batch, int64_t *rows)
{
    *rows = model_loss_rows(&b->m, batch->n);
    float *l = malloc((size_t)*rows * sizeof *l);
    struct tensor y = tensor_reshape(&b->m.layers[b->m.nlayers - 1].y, 1, rows);
    tensor_to_host_f32(&y, l);
    return l;
}

/* The trainer's passes (ctx.loss_in_backward): forward leaves the losses alone and backward writes those of a
 * plain forward, bit for bit, with the same gradients. */
static void loss_in_backward_case(const struct layer_config *layers, int n, struct data_spec spec, enum dtype lowp)
{
    struct autocast_policy pol = policy(lowp);
    struct built b;
    build_ok(&b, layers, n, spec, &pol, 3);
    struct test_batch tb;
    batch_fill(&tb, b.be, &spec, 3, 29);
    struct step_ctx ctx = train_ctx(&b, false);
    model_forward(&b.m, &ctx, &tb.b);
    int64_t rows;
    float *want = losses_host(&b, &tb.b, &rows);
    model_backward(&b.m, &ctx, &tb.b);
    float **g = grads_host(&b.m);

    float *nan = malloc((size_t)rows * sizeof *nan);
    for (int64_t i = 0; i < rows; i++)
        nan[i] = NAN;
    struct tensor y = tensor_reshape(&b.m.layers[b.m.nlayers - 1].y, 1, &rows);
    tensor_from_host_f32(&y, nan);
    ctx.loss_in_backward = true;
    model_forward(&b.m, &ctx, &tb.b);
    float *mid = losses_host(&b, &tb.b, &rows);
    cr_assert(isnan(mid[0]) && isnan(mid[rows - 1]), "forward wrote the losses although backward follows");
    model_backward(&b.m, &ctx, &tb.b);
    float *got = losses_host(&b, &tb.b, &rows);
    cr_assert_eq(memcmp(got, want, (size_t)rows * sizeof *got), 0, "%s: backward's losses are not forward's",
                 dtype_name(lowp));
    float **g2 = grads_host(&b.m);
    for (int i = 0; i < b.m.nparams; i++)
        cr_assert_eq(memcmp(g[i], g2[i], b.m.params[i]->grad.numel * sizeof(float)), 0, "%s: %s's gradient moved",
                     dtype_name(lowp), b.m.params[i]->name);
    grads_free(&b.m, g);
    grads_free(&b.m, g2);
    free(want);
    free(mid);
    free(got);
    free(nan);
    batch_free(&tb);
    built_free(&b);
}

Test(passes, loss_in_backward_gives_the_losses_and_gradients_of_forward_then_backward)
{
    loss_in_backward_case(CNN, 11, CNN_SPEC, DT_FP32);
    loss_in_backward_case(CNN, 11, CNN_SPEC, DT_BF16);
    loss_in_backward_case(SMALL_GPT, 7, token_spec(5, 11), DT_FP16);
}

/* The backend's add, counted (the residual adds the blocks leave to their layernorms run nowhere else). */
static int adds_run;
static void (*plain_add)(struct backend *be, struct tensor *y, const struct tensor *a, const struct tensor *b);
static void counted_add(struct backend *be, struct tensor *y, const struct tensor *a, const struct tensor *b)
{
    adds_run++;
    plain_add(be, y, a, b);
}

/* Every layer's output (host fp32) after one forward of `tb`, the gradients after its backward, and the adds each
 * pass ran. */
struct residual_run {
    float *y[8];
    float **g;
    int forward_adds, backward_adds;
};

static void residual_case_run(struct built *b, const struct test_batch *tb, struct residual_run *out)
{
    plain_add = b->be->add;
    b->be->add = counted_add;
    struct step_ctx ctx = train_ctx(b, false);
    adds_run = 0;
    model_forward(&b->m, &ctx, &tb->b);
    out->forward_adds = adds_run;
    cr_assert_leq(b->m.nlayers, 8);
    for (int i = 0; i < b->m.nlayers; i++) { /* before backward: the loss may write dlogits over the head's y */
        const struct tensor *y = &b->m.layers[i].y;
        out->y[i] = malloc(y->numel * sizeof *out->y[i]);
        tensor_to_host_f32(y, out->y[i]);
    }
    adds_run = 0;
    model_backward(&b->m, &ctx, &tb->b);
    out->backward_adds = adds_run;
    b->be->add = plain_add;
    out->g = grads_host(&b->m);
}

/* A transformer block's last residual add (y = r1 + mlp) runs inside the layernorm after it (the next block's
 * ln1, the final layernorm layer), and a block's backward sums each residual gradient inside the layernorm
 * backward that meets it: with fusing on, the backend's add runs in neither pass; with it off (a run that measures
 * numerics, run.numerics_every) each block adds its y. Every layer's output (the blocks' y included, written by the
 * layernorm after them) and every gradient has the same bits either way: fp32, and bf16 autocast (an fp32
 * residual stream, bf16 branches). */
Test(passes, a_blocks_residual_adds_run_inside_the_layernorms_after_them)
{
    static const struct layer_config gpt[] = {
        {.kind = LAYER_EMBEDDING, .name = "emb", .vocab = 11, .dim = 8},
        {.kind = LAYER_TRANSFORMER_BLOCK, .name = "b0", .heads = 2, .mlp_ratio = 2, .eps = 1e-5},
        {.kind = LAYER_TRANSFORMER_BLOCK, .name = "b1", .heads = 2, .mlp_ratio = 2, .eps = 1e-5},
        {.kind = LAYER_LAYERNORM, .name = "ln_f", .eps = 1e-5},
        {.kind = LAYER_LINEAR, .name = "head", .out = 11, .bias = true},
        {.kind = LAYER_CROSS_ENTROPY, .name = "loss"},
    };
    const int n = 6;
    const enum dtype modes[] = {DT_FP32, DT_BF16};
    for (int k = 0; k < 2; k++) {
        struct built b[2];
        struct residual_run run[2];
        struct data_spec spec = token_spec(5, 11);
        for (int apart = 0; apart < 2; apart++) {
            b[apart].be = backend_cpu_create();
            b[apart].spec = spec;
            make_config(&b[apart].cfg, gpt, n, 5);
            b[apart].cfg.run.numerics_every = apart ? 5 : 0;
            b[apart].pol = policy(modes[k]);
            struct amp_error err = {0};
            cr_assert_eq(model_build(&b[apart].m, &b[apart].cfg, &b[apart].spec, b[apart].be, &b[apart].pol, 3, &err),
                         AMP_OK, "%s", err.msg);
            cr_assert_eq(model_init(&b[apart].m, &b[apart].cfg, 1234, &err), AMP_OK);
            struct test_batch tb;
            batch_fill(&tb, b[apart].be, &spec, 3, 31);
            residual_case_run(&b[apart], &tb, &run[apart]);
            batch_free(&tb);
        }
        const char *mode = dtype_name(modes[k]);
        cr_assert_eq(run[0].forward_adds, 0, "%s: fused, the forward ran %d adds", mode, run[0].forward_adds);
        cr_assert_eq(run[1].forward_adds, 2, "%s: apart, each block adds its y (%d adds)", mode, run[1].forward_adds);
        for (int apart = 0; apart < 2; apart++)
            cr_assert_eq(run[apart].backward_adds, 0, "%s: the backward ran %d adds", mode, run[apart].backward_adds);
        for (int i = 0; i < n; i++)
            cr_assert_eq(memcmp(run[0].y[i], run[1].y[i], b[0].m.layers[i].y.numel * sizeof(float)), 0,
                         "%s: %s's output differs fused and apart", mode, b[0].m.layers[i].cfg.name);
        for (int i = 0; i < b[0].m.nparams; i++)
            cr_assert_eq(memcmp(run[0].g[i], run[1].g[i], b[0].m.params[i]->grad.numel * sizeof(float)), 0,
                         "%s: %s's gradient differs fused and apart", mode, b[0].m.params[i]->name);
        for (int apart = 0; apart < 2; apart++) {
            for (int i = 0; i < n; i++)
                free(run[apart].y[i]);
            grads_free(&b[apart].m, run[apart].g);
            built_free(&b[apart]);
        }
    }
}

static void accumulation_doubles(const struct layer_config *layers, int n, struct data_spec spec, enum dtype lowp)
{
    struct autocast_policy pol = policy(lowp);
    struct built b;
    build_ok(&b, layers, n, spec, &pol, 4);
    struct test_batch tb;
    batch_fill(&tb, b.be, &spec, 4, 23);
    struct step_ctx first = train_ctx(&b, false), more = train_ctx(&b, true);
    model_forward(&b.m, &first, &tb.b);
    model_backward(&b.m, &first, &tb.b);
    float **g1 = grads_host(&b.m);
    model_forward(&b.m, &more, &tb.b);
    model_backward(&b.m, &more, &tb.b);
    float **g2 = grads_host(&b.m);
    for (int i = 0; i < b.m.nparams; i++) {
        bool nonzero = false;
        for (size_t j = 0; j < b.m.params[i]->grad.numel; j++) {
            /* equal up to the order of the fp32 sums (conv adds image by image onto the old gradient) */
            cr_assert(fabsf(g2[i][j] - 2.0f * g1[i][j]) <= 1e-5f * fabsf(g1[i][j]) + 1e-9f,
                      "%s[%zu]: %g after two, %g after one", b.m.params[i]->name, j, g2[i][j], g1[i][j]);
            nonzero |= g1[i][j] != 0.0f;
        }
        cr_assert(nonzero, "%s has a gradient", b.m.params[i]->name);
    }
    /* and accumulate = false overwrites again */
    model_forward(&b.m, &first, &tb.b);
    model_backward(&b.m, &first, &tb.b);
    float **g3 = grads_host(&b.m);
    for (int i = 0; i < b.m.nparams; i++)
        cr_assert(memcmp(g3[i], g1[i], b.m.params[i]->grad.numel * sizeof(float)) == 0);
    grads_free(&b.m, g1);
    grads_free(&b.m, g2);
    grads_free(&b.m, g3);
    batch_free(&tb);
    built_free(&b);
}

Test(passes, accumulation_gives_twice_the_gradient)
{
    accumulation_doubles(CNN, 11, CNN_SPEC, DT_FP32);
    accumulation_doubles(CNN, 11, CNN_SPEC, DT_BF16);
    accumulation_doubles(SMALL_GPT, 7, token_spec(5, 11), DT_FP32);
    accumulation_doubles(SMALL_GPT, 7, token_spec(5, 11), DT_FP16);
}

/* The last eval batch is smaller than the model's: its rows are those of a full batch's first samples. */
static void smaller_batch(const struct layer_config *layers, int n, struct data_spec spec, enum dtype lowp)
{
    struct autocast_policy pol = policy(lowp);
    struct built b;
    build_ok(&b, layers, n, spec, &pol, 6);
    struct test_batch full, part;
    batch_fill(&full, b.be, &spec, 6, 31);
    batch_fill(&part, b.be, &spec, 2, 31); /* the same first two samples: values depend on the index only */
    struct step_ctx ctx = {.be = b.be, .policy = &b.pol, .training = false};
    int64_t rows_full = model_loss_rows(&b.m, 6), rows_part = model_loss_rows(&b.m, 2);
    float *lf = malloc((size_t)rows_full * sizeof *lf), *lp = malloc((size_t)rows_part * sizeof *lp);
    model_forward(&b.m, &ctx, &full.b);
    struct tensor *y = &b.m.layers[b.m.nlayers - 1].y;
    cr_assert_eq((int64_t)y->numel, rows_full);
    tensor_to_host_f32(y, lf);
    model_forward(&b.m, &ctx, &part.b);
    cr_assert_eq((int64_t)y->numel, rows_part);
    tensor_to_host_f32(y, lp);
    cr_assert(memcmp(lf, lp, (size_t)rows_part * sizeof *lf) == 0);
    /* a full batch again gets full-size views back */
    model_forward(&b.m, &ctx, &full.b);
    cr_assert_eq((int64_t)y->numel, rows_full);
    free(lf);
    free(lp);
    batch_free(&full);
    batch_free(&part);
    built_free(&b);
}

Test(passes, a_smaller_batch_gives_the_same_rows)
{
    smaller_batch(CNN, 11, CNN_SPEC, DT_FP32);
    smaller_batch(CNN, 11, CNN_SPEC, DT_BF16);
    smaller_batch(SMALL_GPT, 7, token_spec(5, 11), DT_FP32);
    smaller_batch(SMALL_GPT, 7, token_spec(5, 11), DT_BF16);
}

/* ---- training ------------------------------------------------------------------------------------ */

/* 64 points in 8 dimensions, 4 classes given by the argmax of a fixed linear map. */
static void make_problem(struct backend *be, struct test_batch *tb)
{
    struct data_spec spec = vector_spec(8, 4);
    batch_fill(tb, be, &spec, 64, 41);
    float x[64 * 8];
    tensor_to_host_f32(&tb->b.x, x);
    for (int i = 0; i < 64; i++) {
        int best = 0;
        float bv = -INFINITY;
        for (int c = 0; c < 4; c++) {
            float s = 0;
            for (int d = 0; d < 8; d++)
                s += rng_normal(77, (uint64_t)c, (uint64_t)d) * x[i * 8 + d];
            if (s > bv) {
                bv = s;
                best = c;
            }
        }
        tb->b.labels[i] = best;
    }
}

static void train_mlp(enum dtype lowp, double *first, double *last, double *accuracy)
{
    struct layer_config layers[] = {linear("fc1", 32), lc(LAYER_RELU, "relu"), linear("fc2", 4),
                                    lc(LAYER_CROSS_ENTROPY, "loss")};
    struct autocast_policy pol = policy(lowp);
    struct built b;
    build_ok(&b, layers, 4, vector_spec(8, 4), &pol, 64);
    struct test_batch tb;
    make_problem(b.be, &tb);
    struct step_ctx ctx = train_ctx(&b, false);
    for (int step = 0; step < 50; step++) {
        double loss = mean_loss(&b, &ctx, &tb.b);
        if (step == 0)
            *first = loss;
        model_backward(&b.m, &ctx, &tb.b);
        for (int i = 0; i < b.m.nparams; i++) {
            struct param *p = b.m.params[i];
            struct optim_update_args a = {.master = &p->master, .grad = &p->grad, .copy = p->copy.data ? &p->copy : NULL,
                                          .sc = &sgd_half};
            b.be->sgd_update(b.be, &a, 1);
        }
    }
    *last = mean_loss(&b, &ctx, &tb.b);
    int32_t correct[64];
    b.be->download(b.be, correct, b.m.correct, sizeof correct);
    int right = 0;
    for (int i = 0; i < 64; i++)
        right += correct[i];
    *accuracy = right / 64.0;
    batch_free(&tb);
    built_free(&b);
}

Test(training, a_tiny_mlp_learns)
{
    double first, last, acc;
    train_mlp(DT_FP32, &first, &last, &acc);
    cr_assert(last < 0.25 * first, "fp32: loss %g -> %g", first, last);
    cr_assert(acc > 0.9, "fp32: accuracy %g", acc);
    train_mlp(DT_BF16, &first, &last, &acc);
    cr_assert(last < 0.25 * first, "bf16: loss %g -> %g", first, last);
    cr_assert(acc > 0.9, "bf16: accuracy %g", acc);
}

/* ---- tied weights (a linear's `tie`, GPT-2's lm_head) -------------------------------------------- */

static const struct layer_config TIED_GPT[] = {
    {.kind = LAYER_EMBEDDING, .name = "emb", .vocab = 11, .dim = 8},
    {.kind = LAYER_TRANSFORMER_BLOCK, .name = "b0", .heads = 2, .mlp_ratio = 2, .eps = 1e-5},
    {.kind = LAYER_LAYERNORM, .name = "ln_f", .eps = 1e-5},
    {.kind = LAYER_LINEAR, .name = "head", .out = 11, .bias = false, .tie = "emb/wte"},
    {.kind = LAYER_CROSS_ENTROPY, .name = "loss"},
};

/* The backward hook is told of a tied table with its embedding, last (the head, its other reader, runs first). */
Test(passes, backward_tells_the_hook_of_a_tied_table_last)
{
    static const char *const want[] = {"ln_f/weight", "b0/mlp/proj/weight", "b0/mlp/fc/weight", "b0/ln2/weight",
                                       "b0/attn/proj/weight", "b0/attn/qkv/weight", "b0/ln1/weight", "emb/wte"};
    hook_told_final(TIED_GPT, 5, want, 8);
}

static struct param *param_named(struct model *m, const char *name)
{
    for (int i = 0; i < m->nparams; i++)
        if (!strcmp(m->params[i]->name, name))
            return m->params[i];
    return NULL;
}

Test(tie, one_parameter_and_finite_differences_see_both_uses)
{
    struct autocast_policy pol = policy(DT_BF16);
    struct built b;
    build_ok(&b, TIED_GPT, 5, token_spec(5, 11), &pol, 3);
    cr_assert_null(param_named(&b.m, "head/weight"), "the tied layer has no weight of its own");
    struct param *wte = param_named(&b.m, "emb/wte");
    cr_assert(wte && wte->tied && wte->decay, "emb/wte is tied and decays as a linear weight");
    cr_assert_eq(wte->copy.dtype, DT_BF16, "the head reads a bf16 copy of the fp32 table");
    cr_assert_eq(b.m.layers[3].nparams, 0);
    built_free(&b);
    model_gradients(TIED_GPT, 5, token_spec(5, 11), 3);
    accumulation_doubles(TIED_GPT, 5, token_spec(5, 11), DT_FP32);
    accumulation_doubles(TIED_GPT, 5, token_spec(5, 11), DT_BF16);
}

/* The tied model computes exactly what an untied one whose head holds a copy of the table computes, and the
 * table's one gradient is the sum of the untied table's and head's, bit for bit. */
static void tied_equals_untied(enum dtype lowp)
{
    struct layer_config untied[5];
    memcpy(untied, TIED_GPT, sizeof untied);
    untied[3].tie[0] = '\0';
    struct data_spec spec = token_spec(5, 11);
    struct autocast_policy pol = policy(lowp);
    struct built t, u;
    build_ok(&t, TIED_GPT, 5, spec, &pol, 3);
    build_ok(&u, untied, 5, spec, &pol, 3);
    cr_assert_eq(t.m.nparams + 1, u.m.nparams);
    struct param *uw = param_named(&u.m, "emb/wte"), *uh = param_named(&u.m, "head/weight");
    struct param *tw = param_named(&t.m, "emb/wte");
    size_t n = uw->master.numel;
    float *w = malloc(n * sizeof *w), *gu = malloc(n * sizeof *gu), *gh = malloc(n * sizeof *gh),
          *gt = malloc(n * sizeof *gt);
    tensor_to_host_f32(&uw->master, w);
    tensor_from_host_f32(&uh->master, w);
    model_refresh_copies(&u.m);
    struct test_batch tb;
    batch_fill(&tb, t.be, &spec, 3, 31);
    struct step_ctx ct = train_ctx(&t, false), cu = train_ctx(&u, false);
    cr_assert_eq(mean_loss(&t, &ct, &tb.b), mean_loss(&u, &cu, &tb.b), "the same loss, bit for bit");
    model_backward(&t.m, &ct, &tb.b);
    model_backward(&u.m, &cu, &tb.b);
    tensor_to_host_f32(&uw->grad, gu);
    tensor_to_host_f32(&uh->grad, gh);
    tensor_to_host_f32(&tw->grad, gt);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(gt[i], gh[i] + gu[i], "emb/wte grad[%zu]: %g tied, %g + %g untied", i, gt[i], gh[i], gu[i]);
    free(w);
    free(gu);
    free(gh);
    free(gt);
    batch_free(&tb);
    built_free(&t);
    built_free(&u);
}

Test(tie, the_gradient_is_the_sum_of_both_uses)
{
    tied_equals_untied(DT_FP32);
    tied_equals_untied(DT_BF16);
}

Test(tie, errors_name_the_layer_and_the_tie)
{
    struct layer_config layers[5];
    struct amp_error err;
    memcpy(layers, TIED_GPT, sizeof layers);
    snprintf(layers[3].tie, sizeof layers[3].tie, "emb/nope");
    cr_assert_eq(try_build(layers, 5, token_spec(5, 11), &err), AMP_ERR_CONFIG);
    assert_msg_has(err, "model.layers[3] 'head' (linear): tie: emb/nope is not a parameter of an earlier layer");
    snprintf(layers[3].tie, sizeof layers[3].tie, "emb/wpe");
    cr_assert_eq(try_build(layers, 5, token_spec(5, 11), &err), AMP_ERR_CONFIG);
    assert_msg_has(err, "only an embedding's wte can be tied");
    snprintf(layers[3].tie, sizeof layers[3].tie, "ln_f/weight");
    cr_assert_eq(try_build(layers, 5, token_spec(5, 11), &err), AMP_ERR_CONFIG);
    assert_msg_has(err, "tie: ln_f/weight is a parameter of 'ln_f' (layernorm)");
    memcpy(layers, TIED_GPT, sizeof layers);
    layers[0].vocab = 12;
    layers[3].out = 12;
    layers[0].dim = 8;
    layers[1].dim = 0;
    cr_assert_eq(try_build(layers, 5, token_spec(5, 11), &err), AMP_ERR_CONFIG); /* out 12 vs the data's 11 */
    memcpy(layers, TIED_GPT, sizeof layers);
    layers[0].vocab = 12;
    cr_assert_eq(try_build(layers, 5, token_spec(5, 11), &err), AMP_ERR_CONFIG);
    assert_msg_has(err, "tie: emb/wte has shape (12, 8) but this layer's weight is (out 11, in 8)");
}

/* With accum_steps > 1 a tied table's micro-batch gradient (head + table) is summed apart and then added: one
 * rank accumulating two micro-batches gives g1 + g2 bit for bit, the sum two ranks' all-reduce forms. */
Test(tie, accumulation_adds_each_micro_batchs_sum)
{
    struct data_spec spec = token_spec(5, 11);
    struct autocast_policy pol = policy(DT_BF16);
    struct built b;
    b.be = backend_cpu_create();
    b.spec = spec;
    b.pol = pol;
    make_config(&b.cfg, TIED_GPT, 5, 5);
    b.cfg.accum_steps = 2;
    struct amp_error err = {0};
    cr_assert_eq(model_build(&b.m, &b.cfg, &b.spec, b.be, &b.pol, 3, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(model_init(&b.m, &b.cfg, 1234, &err), AMP_OK);
    struct param *wte = param_named(&b.m, "emb/wte");
    cr_assert_not_null(wte->tied_grad.data);
    size_t n = wte->grad.numel;
    float *g1 = malloc(n * sizeof *g1), *g2 = malloc(n * sizeof *g2), *g = malloc(n * sizeof *g);
    struct test_batch t1, t2;
    batch_fill(&t1, b.be, &spec, 3, 41);
    batch_fill(&t2, b.be, &spec, 3, 43);
    struct step_ctx first = train_ctx(&b, false), more = train_ctx(&b, true);
    model_forward(&b.m, &first, &t2.b);
    model_backward(&b.m, &first, &t2.b);
    tensor_to_host_f32(&wte->grad, g2);
    model_forward(&b.m, &first, &t1.b);
    model_backward(&b.m, &first, &t1.b);
    tensor_to_host_f32(&wte->grad, g1);
    model_forward(&b.m, &more, &t2.b);
    model_backward(&b.m, &more, &t2.b);
    tensor_to_host_f32(&wte->grad, g);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(g[i], g1[i] + g2[i], "emb/wte grad[%zu]: %g accumulated, %g + %g", i, g[i], g1[i], g2[i]);
    free(g1);
    free(g2);
    free(g);
    batch_free(&t1);
    batch_free(&t2);
    built_free(&b);
}
