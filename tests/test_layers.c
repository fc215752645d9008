/*
 * test_layers.c — every layer kind on the CPU backend: a forward pass on hand-computed values, and its
 * input and parameter gradients against central finite differences.
 *
 * The rig builds a real model around the layer under test (model_build, so the shapes, dtypes and
 * buffers are the builder's), then drives that one layer directly: its input is written from the
 * host, and the test loss is L = sum(y * r) for a fixed random r, so backward is seeded with dy = r
 * and every analytic gradient can be held to (L(v + eps) - L(v - eps)) / (2 eps), computed in double
 * from the fp32 outputs. For a loss layer r = 1/rows: L is then the mean loss, whose gradient the
 * loss layer's backward produces (grad_seed 1).
 * The input is layer k's: layer k-1 (an identity dropout with p = 0 where nothing else comes first)
 * only provides the preallocated tensor the layer reads.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"       /* backend_cpu_create, struct backend */
#include "config.h"        /* struct config, struct layer_config, config_defaults */
#include "layer_testlib.h" /* lc: a layer config with the schema's defaults */
#include "model.h"         /* model_build, struct layer, struct data_spec */
#include "rng.h"           /* rng_normal, rng_uniform: seeded test values */

/* The loss gradient's seed (CPU backend memory is host memory). */
static const float unit_seed = 1.0f;

/* ---- configs ------------------------------------------------------------------------------------- */

static struct layer_config identity(void)
{
    struct layer_config l = lc(LAYER_DROPOUT, "input");
    l.p = 0.0;
    return l;
}

static struct data_spec image_spec(int64_t c, int64_t h, int64_t w)
{
    return (struct data_spec){.sample_ndim = 3, .sample_shape = {c, h, w}, .num_classes = 10};
}

/* Samples of shape (T, C): an hdf5-like sequence dataset, for attention without an embedding. */
static struct data_spec sequence_spec(int64_t T, int64_t C)
{
    return (struct data_spec){.sample_ndim = 2, .sample_shape = {T, C}, .num_classes = 10};
}

/* ---- the rig ------------------------------------------------------------------------------------- */

struct rig {
    struct backend *be;
    struct config cfg;
    struct data_spec spec;
    struct autocast_policy policy;
    struct model m;
    struct batch b;
    struct step_ctx ctx;
    int k;               /* the layer under test */
    struct layer *l;
    struct tensor in;    /* layer k's input: b.x, or a view of layer k-1's y */
    float *x;            /* host copy of the input */
    float *r;            /* dL/dy */
    size_t x_numel, y_numel;
    struct tensor dy;    /* r in y's dtype */
    bool is_loss;
};

static float normal(uint64_t stream, uint64_t i)
{
    return rng_normal(99, stream, i);
}

static void rig_open(struct rig *r, struct data_spec spec, int64_t n, int k, int nlayers,
                     const struct layer_config *layers, enum dtype lowp)
{
    memset(r, 0, sizeof *r);
    r->be = backend_cpu_create();
    cr_assert(r->be);
    config_defaults(&r->cfg);
    r->cfg.model.layers = malloc((size_t)nlayers * sizeof *layers);
    memcpy(r->cfg.model.layers, layers, (size_t)nlayers * sizeof *layers);
    r->cfg.model.nlayers = nlayers;
    if (spec.is_tokens)
        r->cfg.data.seq_len = spec.sample_shape[0];
    r->spec = spec;
    r->spec.input_grad = true; /* the layer under test computes dx even with no parameter before it */
    autocast_default(&r->policy, lowp);
    struct amp_error err = {0};
    enum amp_status st = model_build(&r->m, &r->cfg, &r->spec, r->be, &r->policy, n, &err);
    cr_assert_eq(st, AMP_OK, "model_build: %s", err.msg);
    cr_assert_eq(model_init(&r->m, &r->cfg, 42, &err), AMP_OK);
    r->k = k;
    r->l = &r->m.layers[k];
    cr_assert(k == 0 || r->l->needs_dx, "the layer under test computes its input gradient (spec.input_grad)");
    r->is_loss = k == nlayers - 1;

    /* the batch: inputs, tokens, labels, targets */
    r->b.n = n;
    int64_t T = spec.is_tokens ? spec.sample_shape[0] : 1;
    if (spec.is_tokens) {
        r->b.tokens = r->be->alloc(r->be, (size_t)(n * T) * sizeof(int32_t));
        int32_t *tok = malloc((size_t)(n * T) * sizeof *tok);
        for (int64_t i = 0; i < n * T; i++)
            tok[i] = (int32_t)((i * 7 + 3) % spec.num_classes);
        r->be->upload(r->be, r->b.tokens, tok, (size_t)(n * T) * sizeof(int32_t));
        free(tok);
    } else {
        int64_t shape[4] = {n, 1, 1, 1};
        for (int i = 0; i < spec.sample_ndim; i++)
            shape[1 + i] = spec.sample_shape[i];
        cr_assert_eq(tensor_alloc(&r->b.x, r->be, DT_FP32, 1 + spec.sample_ndim, shape, "x", &err), AMP_OK);
    }
    int64_t rows = model_loss_rows(&r->m, n);
    r->b.labels = r->be->alloc(r->be, (size_t)rows * sizeof(int32_t));
    int32_t *lab = malloc((size_t)rows * sizeof *lab);
    for (int64_t i = 0; i < rows; i++)
        lab[i] = (int32_t)((i * 5 + 1) % (spec.num_classes > 0 ? spec.num_classes : 1));
    r->be->upload(r->be, r->b.labels, lab, (size_t)rows * sizeof(int32_t));
    free(lab);

    r->ctx = (struct step_ctx){.be = r->be, .policy = &r->policy, .training = true,
                               .key = {.seed = 7, .stream = 0, .counter = 3}, .grad_seed = &unit_seed};

    /* layer k's input, filled with N(0, 1) values */
    if (k == 0) {
        r->in = r->b.x;
    } else {
        struct tensor *prev = &r->m.layers[k - 1].y;
        r->in = *prev;
    }
    r->x_numel = r->in.numel;
    r->x = malloc((r->x_numel ? r->x_numel : 1) * sizeof *r->x);
    for (size_t i = 0; i < r->x_numel; i++)
        r->x[i] = normal(1, i);
}

/* The mse target of a model that ends in mse: regression targets (n, K) = 0.5. */
static void rig_set_target(struct rig *r, int64_t K)
{
    struct amp_error err;
    int64_t shape[2] = {r->b.n, K};
    cr_assert_eq(tensor_alloc(&r->b.target, r->be, DT_FP32, 2, shape, "target", &err), AMP_OK);
    float *t = malloc((size_t)(r->b.n * K) * sizeof *t);
    for (int64_t i = 0; i < r->b.n * K; i++)
        t[i] = 0.25f * (float)(i % 5) - 0.5f;
    tensor_from_host_f32(&r->b.target, t);
    free(t);
}

static void rig_forward(struct rig *r)
{
    if (r->x_numel)
        tensor_from_host_f32(&r->in, r->x);
    r->l->ops->forward(r->l, &r->ctx, &r->in, &r->b);
    if (!r->r) {
        r->y_numel = r->l->y.numel;
        r->r = malloc(r->y_numel * sizeof *r->r);
        for (size_t i = 0; i < r->y_numel; i++)
            r->r[i] = r->is_loss ? 1.0f / (float)r->y_numel : normal(2, i);
        struct amp_error err;
        cr_assert_eq(tensor_alloc(&r->dy, r->be, r->l->y.dtype, r->l->y.ndim, r->l->y.shape, "dy", &err), AMP_OK);
        tensor_from_host_f32(&r->dy, r->r);
    }
}

/* y of the last forward, on the host (caller frees). */
static float *rig_y(struct rig *r)
{
    float *y = malloc(r->l->y.numel * sizeof *y);
    tensor_to_host_f32(&r->l->y, y);
    return y;
}

static double rig_loss(struct rig *r)
{
    rig_forward(r);
    float *y = rig_y(r);
    double s = 0;
    for (size_t i = 0; i < r->y_numel; i++)
        s += (double)y[i] * (double)r->r[i];
    free(y);
    return s;
}

static void rig_backward(struct rig *r)
{
    r->l->ops->backward(r->l, &r->ctx, r->is_loss ? NULL : &r->dy, &r->in, &r->b);
}

static void rig_close(struct rig *r)
{
    model_free(&r->m);
    tensor_free(&r->dy);
    tensor_free(&r->b.x);
    tensor_free(&r->b.target);
    if (r->b.tokens)
        r->be->free(r->be, r->b.tokens);
    r->be->free(r->be, r->b.labels);
    free(r->x);
    free(r->r);
    config_free(&r->cfg);
    r->be->destroy(r->be);
}

static struct param *find_param(struct rig *r, const char *name)
{
    for (int i = 0; i < r->m.nparams; i++)
        if (strcmp(r->m.params[i]->name, name) == 0)
            return r->m.params[i];
    cr_assert_fail("no parameter %s", name);
    return NULL;
}

static void set_param(struct rig *r, const char *name, const float *v)
{
    struct param *p = find_param(r, name);
    tensor_from_host_f32(&p->master, v);
    model_refresh_copies(&r->m);
}

/* ---- finite differences -------------------------------------------------------------------------- */

static bool close_enough(double fd, double an, double atol, double rtol)
{
    return fabs(fd - an) <= atol + rtol * fabs(an);
}

/* Every input element and every element of every parameter of layer k. */
static void check_gradients(struct rig *r, float eps, double atol, double rtol)
{
    rig_forward(r);
    rig_backward(r);
    struct layer *l = r->l;
    int bad = 0, checked = 0;
    if (l->needs_dx) {
        float *dx = malloc(r->x_numel * sizeof *dx);
        tensor_to_host_f32(&l->dx, dx);
        for (size_t i = 0; i < r->x_numel; i++) {
            float save = r->x[i];
            r->x[i] = save + eps;
            double fp = rig_loss(r);
            r->x[i] = save - eps;
            double fm = rig_loss(r);
            r->x[i] = save;
            double fd = (fp - fm) / (2.0 * eps);
            checked++;
            if (!close_enough(fd, dx[i], atol, rtol) && bad++ < 5)
                cr_log_error("%s: dx[%zu] analytic %.6g, finite difference %.6g", l->cfg.name, i, dx[i], fd);
        }
        free(dx);
    }
    for (int j = 0; j < l->nparams; j++) {
        struct param *p = &l->params[j];
        size_t n = p->master.numel;
        float *w = malloc(n * sizeof *w), *g = malloc(n * sizeof *g);
        tensor_to_host_f32(&p->master, w);
        tensor_to_host_f32(&p->grad, g);
        for (size_t i = 0; i < n; i++) {
            float save = w[i];
            w[i] = save + eps;
            tensor_from_host_f32(&p->master, w);
            model_refresh_copies(&r->m);
            double fp = rig_loss(r);
            w[i] = save - eps;
            tensor_from_host_f32(&p->master, w);
            model_refresh_copies(&r->m);
            double fm = rig_loss(r);
            w[i] = save;
            tensor_from_host_f32(&p->master, w);
            model_refresh_copies(&r->m);
            double fd = (fp - fm) / (2.0 * eps);
            checked++;
            if (!close_enough(fd, g[i], atol, rtol) && bad++ < 5)
                cr_log_error("%s: d%s[%zu] analytic %.6g, finite difference %.6g", l->cfg.name, p->name, i, g[i], fd);
        }
        free(w);
        free(g);
    }
    cr_assert(checked > 0);
    cr_assert_eq(bad, 0, "%s: %d of %d gradient elements disagree with finite differences", l->cfg.name, bad,
                 checked);
}

static void assert_values(const float *got, const double *want, size_t n, double tol, const char *what)
{
    for (size_t i = 0; i < n; i++)
        cr_assert(fabs(got[i] - want[i]) <= tol * (1.0 + fabs(want[i])), "%s[%zu] = %.7g, want %.7g", what, i,
                  got[i], want[i]);
}

/* ---- linear -------------------------------------------------------------------------------------- */

Test(linear, forward_known_values)
{
    struct layer_config layers[] = {identity(), lc(LAYER_LINEAR, "fc"), lc(LAYER_MSE, "loss")};
    layers[1].out = 2;
    struct rig r;
    rig_open(&r, vector_spec(3, 2), 2, 1, 3, layers, DT_FP32);
    float w[] = {1, 0, -1, 0.5f, 0.5f, 0.5f}, b[] = {0.1f, -0.2f}, x[] = {1, 2, 3, 4, 5, 6};
    set_param(&r, "fc/weight", w);
    set_param(&r, "fc/bias", b);
    memcpy(r.x, x, sizeof x);
    rig_forward(&r);
    float *y = rig_y(&r);
    assert_values(y, (double[]){-1.9, 2.8, -1.9, 7.3}, 4, 1e-6, "y");
    cr_assert_eq(r.l->y.ndim, 2);
    cr_assert_eq(r.l->y.shape[1], 2);
    free(y);
    rig_close(&r);
}

Test(linear, forward_on_sequences_applies_to_last_dim)
{
    struct layer_config layers[] = {identity(), lc(LAYER_LINEAR, "fc"), lc(LAYER_FLATTEN, "flat"),
                                    lc(LAYER_MSE, "loss")};
    layers[1].out = 2;
    struct rig r;
    rig_open(&r, sequence_spec(2, 3), 1, 1, 4, layers, DT_FP32);
    float w[] = {1, 0, -1, 0.5f, 0.5f, 0.5f}, b[] = {0.1f, -0.2f}, x[] = {1, 2, 3, 4, 5, 6};
    set_param(&r, "fc/weight", w);
    set_param(&r, "fc/bias", b);
    memcpy(r.x, x, sizeof x);
    rig_forward(&r);
    cr_assert_eq(r.l->y.ndim, 3);
    cr_assert_eq(r.l->y.shape[1], 2);
    cr_assert_eq(r.l->y.shape[2], 2);
    float *y = rig_y(&r);
    assert_values(y, (double[]){-1.9, 2.8, -1.9, 7.3}, 4, 1e-6, "y");
    free(y);
    rig_close(&r);
}

Test(linear, gradients)
{
    struct layer_config layers[] = {identity(), lc(LAYER_LINEAR, "fc"), lc(LAYER_MSE, "loss")};
    layers[1].out = 4;
    struct rig r;
    rig_open(&r, vector_spec(5, 4), 3, 1, 3, layers, DT_FP32);
    check_gradients(&r, 1e-2f, 2e-3, 1e-2);
    rig_close(&r);
}

Test(linear, gradients_on_sequences_without_bias)
{
    struct layer_config layers[] = {identity(), lc(LAYER_LINEAR, "fc"), lc(LAYER_FLATTEN, "flat"),
                                    lc(LAYER_MSE, "loss")};
    layers[1].out = 3;
    layers[1].bias = false;
    struct rig r;
    rig_open(&r, sequence_spec(3, 4), 2, 1, 4, layers, DT_FP32);
    cr_assert_eq(r.l->nparams, 1);
    check_gradients(&r, 1e-2f, 2e-3, 1e-2);
    rig_close(&r);
}

/* ---- conv2d -------------------------------------------------------------------------------------- */

static void conv_known(int64_t stride, int64_t padding, const double *want, int64_t side)
{
    struct layer_config layers[] = {identity(), lc(LAYER_CONV2D, "conv"), lc(LAYER_FLATTEN, "flat"),
                                    lc(LAYER_MSE, "loss")};
    layers[1].out = 1;
    layers[1].kernel = 2;
    layers[1].stride = stride;
    layers[1].padding = padding;
    struct rig r;
    rig_open(&r, image_spec(1, 3, 3), 1, 1, 4, layers, DT_FP32);
    float w[] = {1, 2, 3, 4}, b[] = {0};
    set_param(&r, "conv/weight", w);
    set_param(&r, "conv/bias", b);
    for (int i = 0; i < 9; i++)
        r.x[i] = (float)(i + 1);
    rig_forward(&r);
    cr_assert_eq(r.l->y.ndim, 4);
    cr_assert_eq(r.l->y.shape[2], side);
    cr_assert_eq(r.l->y.shape[3], side);
    float *y = rig_y(&r);
    assert_values(y, want, (size_t)(side * side), 1e-6, "y");
    free(y);
    rig_close(&r);
}

Test(conv2d, forward_known_values)
{
    /* x = 1..9 (3x3), W = [[1, 2], [3, 4]] */
    conv_known(1, 0, (double[]){37, 47, 67, 77}, 2);
    /* padding 1, stride 2: windows at (-1,-1), (-1,1), (1,-1), (1,1) */
    conv_known(2, 1, (double[]){4, 18, 36, 77}, 2);
}

Test(conv2d, gradients)
{
    struct layer_config layers[] = {identity(), lc(LAYER_CONV2D, "conv"), lc(LAYER_FLATTEN, "flat"),
                                    lc(LAYER_MSE, "loss")};
    layers[1].out = 3;
    layers[1].kernel = 3;
    layers[1].stride = 2;
    layers[1].padding = 1;
    struct rig r;
    rig_open(&r, image_spec(2, 5, 4), 2, 1, 4, layers, DT_FP32);
    cr_assert_eq(r.l->out_shape[2], 3);
    cr_assert_eq(r.l->out_shape[3], 2);
    check_gradients(&r, 1e-2f, 2e-3, 1e-2);
    rig_close(&r);
}

/* ---- pools --------------------------------------------------------------------------------------- */

static void pool_known(enum layer_kind kind, int64_t kernel, int64_t stride, int64_t padding, int64_t side,
                       const double *want, int64_t out_side)
{
    struct layer_config layers[] = {identity(), lc(kind, "pool"), lc(LAYER_FLATTEN, "flat"), lc(LAYER_MSE, "loss")};
    layers[1].kernel = kernel;
    layers[1].stride = stride;
    layers[1].padding = padding;
    struct rig r;
    rig_open(&r, image_spec(1, side, side), 1, 1, 4, layers, DT_FP32);
    for (int64_t i = 0; i < side * side; i++)
        r.x[i] = (float)(i + 1);
    rig_forward(&r);
    cr_assert_eq(r.l->y.shape[2], out_side);
    float *y = rig_y(&r);
    assert_values(y, want, (size_t)(out_side * out_side), 1e-6, "y");
    free(y);
    rig_close(&r);
}

Test(pool2d, forward_known_values)
{
    pool_known(LAYER_MAXPOOL2D, 2, 2, 0, 4, (double[]){6, 8, 14, 16}, 2);
    pool_known(LAYER_AVGPOOL2D, 2, 2, 0, 4, (double[]){3.5, 5.5, 11.5, 13.5}, 2);
    /* count_include_pad: every 3x3 window over the padded 2x2 input divides by 9 */
    pool_known(LAYER_AVGPOOL2D, 3, 1, 1, 2, (double[]){10.0 / 9, 10.0 / 9, 10.0 / 9, 10.0 / 9}, 2);
    /* stride 0 in the layer config means "the kernel" */
    pool_known(LAYER_MAXPOOL2D, 2, 0, 0, 4, (double[]){6, 8, 14, 16}, 2);
}

static void pool_gradients(enum layer_kind kind)
{
    struct layer_config layers[] = {identity(), lc(kind, "pool"), lc(LAYER_FLATTEN, "flat"), lc(LAYER_MSE, "loss")};
    layers[1].kernel = 3;
    layers[1].stride = 2;
    layers[1].padding = 1;
    struct rig r;
    rig_open(&r, image_spec(2, 5, 5), 2, 1, 4, layers, DT_FP32);
    /* distinct values 0.1 apart (a shuffled ramp), so no window's maximum is within eps of another value */
    for (size_t i = 0; i < r.x_numel; i++)
        r.x[i] = 0.1f * (float)((i * 37) % r.x_numel) - 2.0f;
    check_gradients(&r, 1e-3f, 2e-3, 1e-2);
    rig_close(&r);
}

Test(pool2d, maxpool_gradients)
{
    pool_gradients(LAYER_MAXPOOL2D);
}

Test(pool2d, avgpool_gradients)
{
    pool_gradients(LAYER_AVGPOOL2D);
}

/* ---- flatten ------------------------------------------------------------------------------------- */

Test(flatten, forward_is_a_view_and_backward_reshapes)
{
    struct layer_config layers[] = {identity(), lc(LAYER_FLATTEN, "flat"), lc(LAYER_MSE, "loss")};
    struct rig r;
    rig_open(&r, image_spec(2, 2, 3), 2, 1, 3, layers, DT_FP32);
    rig_forward(&r);
    cr_assert_eq(r.l->y.ndim, 2);
    cr_assert_eq(r.l->y.shape[0], 2);
    cr_assert_eq(r.l->y.shape[1], 12);
    cr_assert_eq(r.l->y.data, r.in.data, "flatten's y is a view of its input");
    float *y = rig_y(&r);
    for (size_t i = 0; i < r.x_numel; i++)
        cr_assert_eq(y[i], r.x[i]);
    free(y);
    check_gradients(&r, 1e-2f, 2e-3, 1e-2);
    cr_assert_eq(r.l->dx.ndim, 4);
    rig_close(&r);
}

/* ---- batchnorm2d --------------------------------------------------------------------------------- */

Test(batchnorm2d, training_forward_and_running_stats)
{
    struct layer_config layers[] = {identity(), lc(LAYER_BATCHNORM2D, "bn"), lc(LAYER_FLATTEN, "flat"),
                                    lc(LAYER_MSE, "loss")};
    struct rig r;
    rig_open(&r, image_spec(1, 1, 2), 2, 1, 4, layers, DT_FP32);
    float x[] = {1, 2, 3, 4};
    memcpy(r.x, x, sizeof x);
    rig_forward(&r);
    double s = 1.0 / sqrt(1.25 + 1e-5);
    float *y = rig_y(&r);
    assert_values(y, (double[]){-1.5 * s, -0.5 * s, 0.5 * s, 1.5 * s}, 4, 1e-6, "y");
    free(y);
    cr_assert_eq(r.l->nbuffers, 2);
    cr_assert_str_eq(r.l->buffers[0].name, "bn/running_mean");
    cr_assert_str_eq(r.l->buffers[1].name, "bn/running_var");
    float rm, rv;
    tensor_to_host_f32(&r.l->buffers[0].t, &rm);
    tensor_to_host_f32(&r.l->buffers[1].t, &rv);
    cr_assert_float_eq(rm, 0.25f, 1e-6f);               /* 0.9 * 0 + 0.1 * 2.5 */
    cr_assert_float_eq(rv, 0.9f + 0.1f * 5.0f / 3.0f, 1e-6f); /* unbiased batch variance 5/3 */

    /* eval: the running statistics */
    r.ctx.training = false;
    rig_forward(&r);
    y = rig_y(&r);
    double es = 1.0 / sqrt((double)rv + 1e-5);
    assert_values(y, (double[]){(1 - rm) * es, (2 - rm) * es, (3 - rm) * es, (4 - rm) * es}, 4, 1e-6, "eval y");
    free(y);
    rig_close(&r);
}

Test(batchnorm2d, training_gradients)
{
    struct layer_config layers[] = {identity(), lc(LAYER_BATCHNORM2D, "bn"), lc(LAYER_FLATTEN, "flat"),
                                    lc(LAYER_MSE, "loss")};
    struct rig r;
    rig_open(&r, image_spec(3, 2, 2), 2, 1, 4, layers, DT_FP32);
    float g[] = {1.5f, -0.5f, 1.0f}, b[] = {0.1f, 0.2f, -0.3f};
    set_param(&r, "bn/weight", g);
    set_param(&r, "bn/bias", b);
    check_gradients(&r, 1e-2f, 3e-3, 1e-2);
    rig_close(&r);
}

/* ---- layernorm ----------------------------------------------------------------------------------- */

Test(layernorm, forward_known_values)
{
    struct layer_config layers[] = {identity(), lc(LAYER_LAYERNORM, "ln"), lc(LAYER_MSE, "loss")};
    struct rig r;
    rig_open(&r, vector_spec(4, 4), 1, 1, 3, layers, DT_FP32);
    float x[] = {1, 2, 3, 4}, g[] = {2, 2, 2, 2}, b[] = {1, 1, 1, 1};
    memcpy(r.x, x, sizeof x);
    set_param(&r, "ln/weight", g);
    set_param(&r, "ln/bias", b);
    rig_forward(&r);
    double s = 1.0 / sqrt(1.25 + 1e-5);
    float *y = rig_y(&r);
    assert_values(y, (double[]){1 - 3 * s, 1 - s, 1 + s, 1 + 3 * s}, 4, 1e-6, "y");
    free(y);
    rig_close(&r);
}

Test(layernorm, gradients_on_sequences)
{
    struct layer_config layers[] = {identity(), lc(LAYER_LAYERNORM, "ln"), lc(LAYER_FLATTEN, "flat"),
                                    lc(LAYER_MSE, "loss")};
    struct rig r;
    rig_open(&r, sequence_spec(3, 5), 2, 1, 4, layers, DT_FP32);
    float g[] = {1.5f, -0.5f, 1.0f, 0.7f, 1.2f}, b[] = {0.1f, 0.2f, -0.3f, 0, 0.5f};
    set_param(&r, "ln/weight", g);
    set_param(&r, "ln/bias", b);
    check_gradients(&r, 1e-2f, 3e-3, 1e-2);
    rig_close(&r);
}

/* ---- relu, gelu ---------------------------------------------------------------------------------- */

static void activation_known(enum layer_kind kind, enum gelu_approx approx, const double *want)
{
    struct layer_config layers[] = {identity(), lc(kind, "act"), lc(LAYER_MSE, "loss")};
    layers[1].approximate = approx;
    struct rig r;
    rig_open(&r, vector_spec(4, 4), 1, 1, 3, layers, DT_FP32);
    float x[] = {-1, 0.5f, 2, 1};
    memcpy(r.x, x, sizeof x);
    rig_forward(&r);
    float *y = rig_y(&r);
    assert_values(y, want, 4, 2e-6, kind == LAYER_RELU ? "relu" : "gelu");
    free(y);
    rig_close(&r);
}

Test(activation, forward_known_values)
{
    activation_known(LAYER_RELU, GELU_TANH, (double[]){0, 0.5, 2, 1});
    /* 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
    activation_known(LAYER_GELU, GELU_TANH, (double[]){-0.15880800939172324, 0.34571400982514394,
                                                       1.9545976940871754, 0.8411919906082768});
    /* 0.5 x (1 + erf(x / sqrt(2))) */
    activation_known(LAYER_GELU, GELU_ERF, (double[]){-0.15865525393145707, 0.34573123063700656,
                                                      1.9544997361036416, 0.8413447460685429});
}

static void activation_gradients(enum layer_kind kind, enum gelu_approx approx)
{
    struct layer_config layers[] = {identity(), lc(kind, "act"), lc(LAYER_FLATTEN, "flat"), lc(LAYER_MSE, "loss")};
    layers[1].approximate = approx;
    struct rig r;
    rig_open(&r, sequence_spec(3, 4), 2, 1, 4, layers, DT_FP32);
    for (size_t i = 0; i < r.x_numel; i++) /* keep relu's inputs away from its kink */
        if (fabsf(r.x[i]) < 0.05f)
            r.x[i] = 0.3f;
    check_gradients(&r, 1e-2f, 2e-3, 1e-2);
    rig_close(&r);
}

Test(activation, relu_gradients)
{
    activation_gradients(LAYER_RELU, GELU_TANH);
}

Test(activation, gelu_tanh_gradients)
{
    activation_gradients(LAYER_GELU, GELU_TANH);
}

Test(activation, gelu_erf_gradients)
{
    activation_gradients(LAYER_GELU, GELU_ERF);
}

/* ---- dropout ------------------------------------------------------------------------------------- */

Test(dropout, training_masks_and_scales_eval_copies)
{
    struct layer_config layers[] = {identity(), lc(LAYER_DROPOUT, "drop"), lc(LAYER_MSE, "loss")};
    layers[1].p = 0.25;
    struct rig r;
    rig_open(&r, vector_spec(512, 4), 8, 1, 3, layers, DT_FP32);
    rig_forward(&r);
    float *y = rig_y(&r);
    size_t dropped = 0;
    for (size_t i = 0; i < r.x_numel; i++) {
        if (y[i] == 0.0f) {
            dropped++;
            continue;
        }
        cr_assert_float_eq(y[i], r.x[i] / 0.75f, 1e-6f * (1 + fabsf(y[i])), "kept elements scale by 1/(1-p)");
    }
    double frac = (double)dropped / (double)r.x_numel;
    cr_assert(frac > 0.22 && frac < 0.28, "dropped fraction %.3f, p = 0.25", frac);
    free(y);

    /* another micro-batch (counter) draws another mask; the same key the same one */
    float *y1 = rig_y(&r);
    r.ctx.key.counter++;
    rig_forward(&r);
    float *y2 = rig_y(&r);
    cr_assert(memcmp(y1, y2, r.x_numel * sizeof *y1) != 0);
    r.ctx.key.counter--;
    rig_forward(&r);
    float *y3 = rig_y(&r);
    cr_assert(memcmp(y1, y3, r.x_numel * sizeof *y1) == 0);
    free(y1);
    free(y2);
    free(y3);

    r.ctx.training = false;
    rig_forward(&r);
    y = rig_y(&r);
    cr_assert(memcmp(y, r.x, r.x_numel * sizeof *y) == 0, "eval: y = x");
    free(y);
    rig_close(&r);
}

Test(dropout, gradients_with_the_same_key)
{
    struct layer_config layers[] = {identity(), lc(LAYER_DROPOUT, "drop"), lc(LAYER_MSE, "loss")};
    layers[1].p = 0.5;
    struct rig r;
    rig_open(&r, vector_spec(16, 4), 3, 1, 3, layers, DT_FP32);
    check_gradients(&r, 1e-2f, 2e-3, 1e-2);
    /* the gradient is the mask: zero exactly where y is */
    float *y = rig_y(&r), *dx = malloc(r.x_numel * sizeof *dx);
    tensor_to_host_f32(&r.l->dx, dx);
    for (size_t i = 0; i < r.x_numel; i++)
        cr_assert_eq(y[i] == 0.0f, dx[i] == 0.0f);
    free(y);
    free(dx);
    rig_close(&r);
}

/* ---- embedding ----------------------------------------------------------------------------------- */

static void embedding_rig(struct rig *r, int64_t n, int64_t T, int64_t vocab, int64_t C)
{
    struct layer_config layers[] = {lc(LAYER_EMBEDDING, "emb"), lc(LAYER_FLATTEN, "flat"), lc(LAYER_MSE, "loss")};
    layers[0].vocab = vocab;
    layers[0].dim = C;
    rig_open(r, token_spec(T, vocab), n, 0, 3, layers, DT_FP32);
}

Test(embedding, forward_known_values)
{
    struct rig r;
    embedding_rig(&r, 1, 3, 4, 2);
    float wte[] = {0, 1, 2, 3, 4, 5, 6, 7}, wpe[] = {0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f};
    set_param(&r, "emb/wte", wte);
    set_param(&r, "emb/wpe", wpe);
    int32_t tok[] = {3, 0, 2};
    r.be->upload(r.be, r.b.tokens, tok, sizeof tok);
    rig_forward(&r);
    float *y = rig_y(&r);
    assert_values(y, (double[]){6.1, 7.2, 0.3, 1.4, 4.5, 5.6}, 6, 1e-6, "y");
    free(y);
    cr_assert_eq(r.l->y.shape[1], 3);
    cr_assert_eq(r.l->y.shape[2], 2);
    rig_close(&r);
}

Test(embedding, gradients)
{
    struct rig r;
    embedding_rig(&r, 2, 3, 5, 4); /* tokens (i*7+3) % 5 repeat, so rows of dwte sum several positions */
    check_gradients(&r, 1e-2f, 2e-3, 1e-2);
    rig_close(&r);
}

/* ---- attention ----------------------------------------------------------------------------------- */

static void attention_rig(struct rig *r, enum layer_kind kind, int64_t n, int64_t T, int64_t C, int64_t H,
                          enum dtype lowp)
{
    struct layer_config layers[] = {identity(), lc(kind, "att"), lc(LAYER_FLATTEN, "flat"), lc(LAYER_MSE, "loss")};
    layers[1].heads = H;
    layers[1].mlp_ratio = 2;
    rig_open(r, sequence_spec(T, C), n, 1, 4, layers, lowp);
}

Test(attention, forward_known_values)
{
    /* C = H = 1, q = k = v = x, identity projection: position 0 sees itself only (out = x0 = 0); position 1
     * mixes softmax(x1*x0, x1*x1) = softmax(0, 1) of v = (0, 1): e / (1 + e) */
    struct rig r;
    attention_rig(&r, LAYER_ATTENTION, 1, 2, 1, 1, DT_FP32);
    float one3[] = {1, 1, 1}, zero3[] = {0, 0, 0}, one[] = {1}, zero[] = {0};
    set_param(&r, "att/qkv/weight", one3);
    set_param(&r, "att/qkv/bias", zero3);
    set_param(&r, "att/proj/weight", one);
    set_param(&r, "att/proj/bias", zero);
    r.x[0] = 0;
    r.x[1] = 1;
    rig_forward(&r);
    float *y = rig_y(&r);
    assert_values(y, (double[]){0, exp(1.0) / (1 + exp(1.0))}, 2, 1e-6, "y");
    free(y);
    rig_close(&r);
}

/* Reference causal multi-head attention in double: x (T, C) of one sample -> y (T, C). */
static void reference_attention(const double *x, double *y, int64_t T, int64_t C, int64_t H, const float *wqkv,
                                const float *bqkv, const float *wproj, const float *bproj)
{
    int64_t D = C / H;
    double *qkv = calloc((size_t)(T * 3 * C), sizeof *qkv), *att = calloc((size_t)(T * C), sizeof *att);
    for (int64_t t = 0; t < T; t++)
        for (int64_t o = 0; o < 3 * C; o++) {
            double s = bqkv[o];
            for (int64_t i = 0; i < C; i++)
                s += wqkv[o * C + i] * x[t * C + i];
            qkv[t * 3 * C + o] = s;
        }
    for (int64_t h = 0; h < H; h++)
        for (int64_t t = 0; t < T; t++) {
            double sc[64], mx = -INFINITY, sum = 0;
            for (int64_t j = 0; j <= t; j++) {
                double s = 0;
                for (int64_t d = 0; d < D; d++)
                    s += qkv[t * 3 * C + h * D + d] * qkv[j * 3 * C + C + h * D + d];
                sc[j] = s / sqrt((double)D);
                mx = sc[j] > mx ? sc[j] : mx;
            }
            for (int64_t j = 0; j <= t; j++)
                sum += (sc[j] = exp(sc[j] - mx));
            for (int64_t d = 0; d < D; d++) {
                double s = 0;
                for (int64_t j = 0; j <= t; j++)
                    s += sc[j] / sum * qkv[j * 3 * C + 2 * C + h * D + d];
                att[t * C + h * D + d] = s;
            }
        }
    for (int64_t t = 0; t < T; t++)
        for (int64_t o = 0; o < C; o++) {
            double s = bproj[o];
            for (int64_t i = 0; i < C; i++)
                s += wproj[o * C + i] * att[t * C + i];
            y[t * C + o] = s;
        }
    free(qkv);
    free(att);
}

static float *param_host(struct rig *r, const char *name)
{
    struct param *p = find_param(r, name);
    float *v = malloc(p->master.numel * sizeof *v);
    tensor_to_host_f32(&p->master, v);
    return v;
}

Test(attention, forward_matches_reference)
{
    int64_t n = 2, T = 3, C = 4, H = 2;
    struct rig r;
    attention_rig(&r, LAYER_ATTENTION, n, T, C, H, DT_FP32);
    rig_forward(&r);
    float *y = rig_y(&r);
    float *wq = param_host(&r, "att/qkv/weight"), *bq = param_host(&r, "att/qkv/bias");
    float *wp = param_host(&r, "att/proj/weight"), *bp = param_host(&r, "att/proj/bias");
    double x[12], want[12];
    for (int64_t b = 0; b < n; b++) {
        for (int i = 0; i < T * C; i++)
            x[i] = r.x[b * T * C + i];
        reference_attention(x, want, T, C, H, wq, bq, wp, bp);
        assert_values(y + b * T * C, want, (size_t)(T * C), 1e-5, "y");
    }
    free(y);
    free(wq);
    free(bq);
    free(wp);
    free(bp);
    rig_close(&r);
}

Test(attention, gradients)
{
    struct rig r;
    attention_rig(&r, LAYER_ATTENTION, 2, 3, 4, 2, DT_FP32);
    cr_assert_eq(r.l->nparams, 4);
    check_gradients(&r, 1e-2f, 3e-3, 1e-2);
    rig_close(&r);
}

/* ---- transformer_block --------------------------------------------------------------------------- */

static void reference_layernorm(const double *x, double *y, int64_t T, int64_t C, const float *g, const float *b)
{
    for (int64_t t = 0; t < T; t++) {
        double mu = 0, var = 0;
        for (int64_t i = 0; i < C; i++)
            mu += x[t * C + i] / (double)C;
        for (int64_t i = 0; i < C; i++)
            var += (x[t * C + i] - mu) * (x[t * C + i] - mu) / (double)C;
        for (int64_t i = 0; i < C; i++)
            y[t * C + i] = (x[t * C + i] - mu) / sqrt(var + 1e-5) * g[i] + b[i];
    }
}

static double gelu_tanh(double v)
{
    const double pi = 3.14159265358979323846;
    return 0.5 * v * (1 + tanh(sqrt(2 / pi) * (v + 0.044715 * v * v * v)));
}

Test(transformer_block, forward_matches_reference)
{
    int64_t n = 2, T = 3, C = 4, H = 2, F = 8; /* mlp_ratio 2 */
    struct rig r;
    attention_rig(&r, LAYER_TRANSFORMER_BLOCK, n, T, C, H, DT_FP32);
    cr_assert_eq(r.l->nparams, 12);
    const char *names[] = {"att/ln1/weight",      "att/ln1/bias",      "att/attn/qkv/weight", "att/attn/qkv/bias",
                           "att/attn/proj/weight", "att/attn/proj/bias", "att/ln2/weight",      "att/ln2/bias",
                           "att/mlp/fc/weight",   "att/mlp/fc/bias",   "att/mlp/proj/weight", "att/mlp/proj/bias"};
    float *p[12];
    for (int i = 0; i < 12; i++) {
        cr_assert_str_eq(r.l->params[i].name, names[i]);
        /* non-trivial norm gains and biases, so the reference sees every parameter */
        struct param *q = &r.l->params[i];
        float *v = malloc(q->master.numel * sizeof *v);
        for (size_t j = 0; j < q->master.numel; j++)
            v[j] = (i == 0 || i == 6 ? 1.0f : 0.0f) + 0.3f * normal(10 + (uint64_t)i, j);
        tensor_from_host_f32(&q->master, v);
        p[i] = v;
    }
    rig_forward(&r);
    float *y = rig_y(&r);
    double x[12], h[12], a[12], r1[12], h2[12], f[24], want[12];
    for (int64_t b = 0; b < n; b++) {
        for (int i = 0; i < T * C; i++)
            x[i] = r.x[b * T * C + i];
        reference_layernorm(x, h, T, C, p[0], p[1]);
        reference_attention(h, a, T, C, H, p[2], p[3], p[4], p[5]);
        for (int i = 0; i < T * C; i++)
            r1[i] = x[i] + a[i];
        reference_layernorm(r1, h2, T, C, p[6], p[7]);
        for (int64_t t = 0; t < T; t++)
            for (int64_t o = 0; o < F; o++) {
                double s = p[9][o];
                for (int64_t i = 0; i < C; i++)
                    s += p[8][o * C + i] * h2[t * C + i];
                f[t * F + o] = gelu_tanh(s);
            }
        for (int64_t t = 0; t < T; t++)
            for (int64_t o = 0; o < C; o++) {
                double s = p[11][o];
                for (int64_t i = 0; i < F; i++)
                    s += p[10][o * F + i] * f[t * F + i];
                want[t * C + o] = r1[t * C + o] + s;
            }
        assert_values(y + b * T * C, want, (size_t)(T * C), 1e-5, "y");
    }
    for (int i = 0; i < 12; i++)
        free(p[i]);
    free(y);
    rig_close(&r);
}

Test(transformer_block, gradients)
{
    struct rig r;
    attention_rig(&r, LAYER_TRANSFORMER_BLOCK, 2, 3, 4, 2, DT_FP32);
    check_gradients(&r, 1e-2f, 3e-3, 1e-2);
    rig_close(&r);
}

/* ---- losses -------------------------------------------------------------------------------------- */

Test(cross_entropy, forward_known_values)
{
    struct layer_config layers[] = {identity(), lc(LAYER_CROSS_ENTROPY, "loss")};
    struct rig r;
    rig_open(&r, vector_spec(3, 3), 2, 1, 2, layers, DT_FP32);
    float x[] = {1, 2, 3, 1, 2, 3};
    memcpy(r.x, x, sizeof x);
    int32_t labels[] = {2, 0};
    r.be->upload(r.be, r.b.labels, labels, sizeof labels);
    rig_forward(&r);
    cr_assert_eq(r.l->y.dtype, DT_FP32);
    cr_assert_eq(r.l->y.numel, 2);
    float *y = rig_y(&r);
    double lse = log(exp(1.0) + exp(2.0) + exp(3.0));
    assert_values(y, (double[]){lse - 3, lse - 1}, 2, 1e-6, "losses");
    free(y);
    int32_t correct[2];
    r.be->download(r.be, correct, r.m.correct, sizeof correct);
    cr_assert_eq(correct[0], 1);
    cr_assert_eq(correct[1], 0);
    rig_close(&r);
}

Test(cross_entropy, gradients)
{
    struct layer_config layers[] = {identity(), lc(LAYER_CROSS_ENTROPY, "loss")};
    struct rig r;
    rig_open(&r, vector_spec(5, 5), 3, 1, 2, layers, DT_FP32);
    check_gradients(&r, 1e-2f, 1e-3, 1e-2);
    rig_close(&r);
}

Test(cross_entropy, text_rows_are_tokens)
{
    /* embedding (N, T, C=vocab) straight into the loss: logits per token, labels (N*T) */
    struct layer_config layers[] = {lc(LAYER_EMBEDDING, "emb"), lc(LAYER_CROSS_ENTROPY, "loss")};
    layers[0].vocab = 6;
    layers[0].dim = 6;
    struct rig r;
    rig_open(&r, token_spec(4, 6), 3, 1, 2, layers, DT_FP32);
    cr_assert_eq(model_loss_rows(&r.m, 3), 12);
    cr_assert_eq(model_loss_rows(&r.m, 2), 8);
    cr_assert_eq(r.l->out_shape[0], 12);
    check_gradients(&r, 1e-2f, 1e-3, 1e-2);
    rig_close(&r);
}

Test(mse, forward_known_values_and_gradients)
{
    struct layer_config layers[] = {identity(), lc(LAYER_MSE, "loss")};
    struct rig r;
    rig_open(&r, vector_spec(2, 2), 2, 1, 2, layers, DT_FP32);
    rig_set_target(&r, 2); /* targets -0.5, -0.25, 0, 0.25 */
    float x[] = {0.5f, -0.25f, 2, 0.25f};
    memcpy(r.x, x, sizeof x);
    rig_forward(&r);
    float *y = rig_y(&r);
    assert_values(y, (double[]){0.5, 2.0}, 2, 1e-6, "losses"); /* (1 + 0)/2, (4 + 0)/2 */
    free(y);
    cr_assert_null(r.m.correct);
    check_gradients(&r, 1e-2f, 1e-3, 1e-2);
    rig_close(&r);
}

/* ---- low precision ------------------------------------------------------------------------------- */

/* The same layer under bf16 autocast gives the fp32 result within bf16's precision, forward and
 * backward, and keeps every activation gradient in its activation's dtype. */
static void bf16_agrees(struct layer_config *layers, int nlayers, struct data_spec spec, int64_t n, double tol,
                        enum dtype want_y)
{
    struct rig a, b;
    rig_open(&a, spec, n, 1, nlayers, layers, DT_FP32);
    rig_open(&b, spec, n, 1, nlayers, layers, DT_BF16);
    cr_assert_eq(b.in.dtype, DT_FP32, "the identity dropout before it passes the fp32 input on");
    cr_assert_eq(b.l->out_dtype, want_y);
    cr_assert_eq(b.l->y.dtype, want_y);
    rig_forward(&a);
    rig_backward(&a);
    rig_forward(&b);
    rig_backward(&b);
    cr_assert_eq(b.l->dx.dtype, b.in.dtype);
    float *ya = rig_y(&a), *yb = rig_y(&b);
    double scale = 0;
    for (size_t i = 0; i < a.y_numel; i++)
        scale = fmax(scale, fabs(ya[i]));
    for (size_t i = 0; i < a.y_numel; i++)
        cr_assert(fabs(ya[i] - yb[i]) <= tol * scale, "y[%zu]: fp32 %g, bf16 %g", i, ya[i], yb[i]);
    float *da = malloc(a.x_numel * sizeof *da), *db = malloc(a.x_numel * sizeof *db);
    tensor_to_host_f32(&a.l->dx, da);
    tensor_to_host_f32(&b.l->dx, db);
    scale = 0;
    for (size_t i = 0; i < a.x_numel; i++)
        scale = fmax(scale, fabs(da[i]));
    for (size_t i = 0; i < a.x_numel; i++)
        cr_assert(fabs(da[i] - db[i]) <= tol * scale, "dx[%zu]: fp32 %g, bf16 %g", i, da[i], db[i]);
    for (int j = 0; j < a.l->nparams; j++) {
        size_t pn = a.l->params[j].grad.numel;
        float *ga = malloc(pn * sizeof *ga), *gb = malloc(pn * sizeof *gb);
        tensor_to_host_f32(&a.l->params[j].grad, ga);
        tensor_to_host_f32(&b.l->params[j].grad, gb);
        cr_assert_eq(b.l->params[j].grad.dtype, DT_FP32);
        double s = 0;
        for (size_t i = 0; i < pn; i++)
            s = fmax(s, fabs(ga[i]));
        for (size_t i = 0; i < pn; i++)
            cr_assert(fabs(ga[i] - gb[i]) <= tol * s + 1e-6, "%s grad[%zu]: fp32 %g, bf16 %g", a.l->params[j].name, i,
                      ga[i], gb[i]);
        free(ga);
        free(gb);
    }
    free(ya);
    free(yb);
    free(da);
    free(db);
    rig_close(&a);
    rig_close(&b);
}

Test(low_precision, linear_conv_attention_block_agree_with_fp32)
{
    struct layer_config lin[] = {identity(), lc(LAYER_LINEAR, "fc"), lc(LAYER_MSE, "loss")};
    lin[1].out = 6;
    bf16_agrees(lin, 3, vector_spec(16, 6), 4, 3e-2, DT_BF16);

    struct layer_config conv[] = {identity(), lc(LAYER_CONV2D, "conv"), lc(LAYER_FLATTEN, "flat"),
                                  lc(LAYER_MSE, "loss")};
    conv[1].out = 3;
    conv[1].kernel = 3;
    conv[1].padding = 1;
    bf16_agrees(conv, 4, image_spec(2, 5, 5), 2, 3e-2, DT_BF16);

    struct layer_config att[] = {identity(), lc(LAYER_ATTENTION, "att"), lc(LAYER_FLATTEN, "flat"),
                                 lc(LAYER_MSE, "loss")};
    att[1].heads = 2;
    bf16_agrees(att, 4, sequence_spec(5, 8), 2, 5e-2, DT_BF16);

    struct layer_config blk[] = {identity(), lc(LAYER_TRANSFORMER_BLOCK, "blk"), lc(LAYER_FLATTEN, "flat"),
                                 lc(LAYER_MSE, "loss")};
    blk[1].heads = 2;
    bf16_agrees(blk, 4, sequence_spec(5, 8), 2, 5e-2, DT_FP32); /* the residual stream stays fp32 */
}

/* ---- a batch smaller than the model's ------------------------------------------------------------ */

Test(batch, smaller_batch_uses_views_and_gives_the_same_rows)
{
    struct layer_config layers[] = {identity(), lc(LAYER_TRANSFORMER_BLOCK, "blk"), lc(LAYER_FLATTEN, "flat"),
                                    lc(LAYER_MSE, "loss")};
    layers[1].heads = 2;
    struct rig r;
    rig_open(&r, sequence_spec(3, 4), 4, 1, 4, layers, DT_FP32);
    rig_forward(&r);
    float *full = rig_y(&r);
    /* the same first two samples as a batch of 2 */
    r.in = tensor_reshape(&r.in, 3, (int64_t[]){2, 3, 4});
    r.x_numel = r.in.numel;
    rig_forward(&r);
    cr_assert_eq(r.l->y.shape[0], 2);
    cr_assert_eq(r.l->y.numel, 24);
    float *half = rig_y(&r);
    cr_assert(memcmp(full, half, 24 * sizeof *full) == 0);
    /* backward on the small batch writes a dx of the small shape */
    struct tensor dy = tensor_reshape(&r.dy, 3, (int64_t[]){2, 3, 4});
    r.l->ops->backward(r.l, &r.ctx, &dy, &r.in, &r.b);
    cr_assert_eq(r.l->dx.shape[0], 2);
    free(full);
    free(half);
    rig_close(&r);
}
