/*
 * norm.c — batchnorm2d and layernorm, and the layernorm_op building block of transformer blocks.
 *
 * Both are fp32-class ops: they read their input in whatever dtype it comes, compute statistics in
 * fp32 and write y in fp32 (or wherever the policy moves them); gain and shift are read in fp32 (the masters, or
 * their fp32 copies under bf16 master weights).
 * Backward writes dx in the input's dtype, and dgain / dshift fp32 with beta = accumulate.
 *
 * layernorm: normalises the last dimension of (N, D) or (N, T, D); "NAME/weight" (D) = 1 and
 *   "NAME/bias" (D) = 0 at init. Mean and 1/std per row (fp32) are saved for backward. Right after a
 *   transformer block it also runs that block's last residual add, writing the block's y on its way
 *   (block_hand_over_add, attention.c): the same bits, one pass less.
 * batchnorm2d: (N, C, H, W), statistics per channel over N*H*W. Training: batch statistics, and the
 *   running ones move by `momentum` (unbiased variance, as PyTorch); eval: the running statistics.
 *   Parameters "NAME/weight", "NAME/bias" (C); buffers "NAME/running_mean" (C) = 0 and
 *   "NAME/running_var" (C) = 1 at init, checkpointed with the parameters.
 */
#include <stdlib.h>

#include "layers.h" /* struct layernorm_op, struct layer_build, layer_fail, views */

/* ---- the building block ------------------------------------------------------------------------ */

enum amp_status layernorm_op_setup(struct layernorm_op *op, struct layer *l, struct layer_build *b,
                                   const char *prefix, int64_t cols, float eps, int64_t max_rows)
{
    char name[96];
    op->cols = cols;
    op->eps = eps;
    snprintf(name, sizeof name, "%sweight", prefix);
    op->gain = layer_add_param(l, b, name, 1, &cols, PINIT_NORM_GAIN, cols, false, DT_FP32);
    if (!op->gain)
        return b->err->code;
    snprintf(name, sizeof name, "%sbias", prefix);
    op->shift = layer_add_param(l, b, name, 1, &cols, PINIT_NORM_SHIFT, cols, false, DT_FP32);
    if (!op->shift)
        return b->err->code;
    snprintf(name, sizeof name, "%smean", prefix);
    enum amp_status st = layer_alloc(l, b, &op->mean, DT_FP32, 1, &max_rows, name);
    if (st != AMP_OK)
        return st;
    snprintf(name, sizeof name, "%srstd", prefix);
    return layer_alloc(l, b, &op->rstd, DT_FP32, 1, &max_rows, name);
}

void layernorm_op_forward_add(struct backend *be, struct layernorm_op *op, struct tensor *y, struct tensor *sum,
                              const struct tensor *x, const struct tensor *addend, int64_t rows)
{
    struct norm_args a = {.rows = rows, .cols = op->cols, .eps = op->eps, .addend = addend, .sum = sum};
    struct tensor mean = batch_view(&op->mean, rows), rstd = batch_view(&op->rstd, rows);
    be->layernorm_forward(be, &a, y, &mean, &rstd, x, param_value(op->gain), param_value(op->shift));
}

void layernorm_op_forward(struct backend *be, struct layernorm_op *op, struct tensor *y, const struct tensor *x,
                          int64_t rows)
{
    layernorm_op_forward_add(be, op, y, NULL, x, NULL, rows);
}

void layernorm_op_backward_add(struct backend *be, struct layernorm_op *op, struct tensor *dx, const struct tensor *dy,
                               const struct tensor *x, const struct tensor *dsum, int64_t rows, float beta)
{
    struct norm_args a = {.rows = rows, .cols = op->cols, .eps = op->eps, .dsum = dsum};
    struct tensor mean = batch_view(&op->mean, rows), rstd = batch_view(&op->rstd, rows);
    be->layernorm_backward(be, &a, dx, &op->gain->grad, &op->shift->grad, dy, x, &mean, &rstd, param_value(op->gain),
                           beta);
}

void layernorm_op_backward(struct backend *be, struct layernorm_op *op, struct tensor *dx, const struct tensor *dy,
                           const struct tensor *x, int64_t rows, float beta)
{
    layernorm_op_backward_add(be, op, dx, dy, x, NULL, rows, beta);
}

void layernorm_op_free(struct layernorm_op *op)
{
    tensor_free(&op->mean);
    tensor_free(&op->rstd);
}

/* The backends compute dx together with the parameter gradients, so the first layer, which has no
 * l->dx, hands them a scratch tensor instead (reserved at setup by reserve_unused_dx). */
static struct tensor dx_or_scratch(struct layer *l, const struct tensor *workspace, size_t off,
                                   const struct tensor *x)
{
    if (l->needs_dx) {
        l->dx = batch_view_like(&l->dx, x);
        return l->dx;
    }
    return scratch_view(workspace, off, x->dtype, x->ndim, x->shape);
}

static size_t reserve_unused_dx(const struct layer *l, struct layer_build *b)
{
    if (l->needs_dx)
        return 0;
    return scratch_reserve(b, b->in_dtype, (size_t)(b->in_shape[0] * shape_inner(b->in_ndim, b->in_shape)));
}

/* ---- layernorm ----------------------------------------------------------------------------------- */

struct layernorm_layer {
    struct layernorm_op op;
    size_t dx_off;               /* first layer: scratch for the dx nobody reads */
    const struct tensor *workspace;
    struct layer *add_from;      /* the transformer block before, whose last add runs here (block_hand_over_add) */
};

/* y = layernorm(x), with the block before's last add first where it was handed over (x is that block's y) */
static void layernorm_layer_run(struct layer *l, struct backend *be, const struct tensor *x, int64_t rows)
{
    struct layernorm_layer *p = l->priv;
    if (p->add_from)
        layernorm_op_forward_from(be, &p->op, &l->y, p->add_from, rows);
    else
        layernorm_op_forward(be, &p->op, &l->y, x, rows);
}

static void layernorm_forward(struct layer *l, const struct step_ctx *ctx, const struct tensor *x,
                              const struct batch *b)
{
    (void)b;
    struct layernorm_layer *p = l->priv;
    l->y = batch_view(&l->y, x->shape[0]);
    layernorm_layer_run(l, ctx->be, x, (int64_t)(x->numel / (size_t)p->op.cols));
}

static void layernorm_backward(struct layer *l, const struct step_ctx *ctx, const struct tensor *dy,
                               const struct tensor *x, const struct batch *b)
{
    (void)b;
    struct layernorm_layer *p = l->priv;
    struct tensor dx = dx_or_scratch(l, p->workspace, p->dx_off, x);
    layernorm_op_backward(ctx->be, &p->op, &dx, dy, x, (int64_t)(x->numel / (size_t)p->op.cols),
                          ctx->accumulate ? 1.0f : 0.0f);
}

static void layernorm_free(struct layer *l)
{
    struct layernorm_layer *p = l->priv;
    if (p)
        layernorm_op_free(&p->op);
}

static void layernorm_decode(struct layer *l, const struct step_ctx *ctx, const struct tensor *x,
                             const struct decode_step *d)
{
    l->y = seq_view(&l->y, d->n);
    layernorm_layer_run(l, ctx->be, x, d->n);
}

static const struct layer_ops layernorm_ops = {layernorm_forward, layernorm_backward, layernorm_free,
                                               layernorm_decode, NULL};

enum amp_status layernorm_setup(struct layer *l, struct layer_build *b)
{
    char got[96];
    if (b->in_tokens || b->in_ndim < 2)
        return layer_fail(l, b, "put an embedding layer first for text data",
                          "expects input of shape (N, ..., D), got %s from %s",
                          shape_str_n(got, sizeof got, b->in_ndim, b->in_shape), b->in_from);
    if (!(l->cfg.eps > 0))
        return layer_fail(l, b, "use eps > 0 (default 1e-5)", "eps must be > 0, got %g", l->cfg.eps);
    struct layernorm_layer *p = calloc(1, sizeof *p);
    if (!p)
        return amp_fail(b->err, AMP_ERR_INTERNAL, NULL, "out of memory building layer '%s'", l->cfg.name);
    l->priv = p;
    l->ops = &layernorm_ops;
    l->op = OP_LAYERNORM;
    p->workspace = b->workspace;
    p->dx_off = reserve_unused_dx(l, b);
    p->add_from = block_hand_over_add(b);
    int64_t cols = b->in_shape[b->in_ndim - 1];
    int64_t max_rows = b->in_shape[0] * shape_inner(b->in_ndim, b->in_shape) / cols;
    enum amp_status st = layer_reserve_params(l, b, 2);
    if (st == AMP_OK)
        st = layernorm_op_setup(&p->op, l, b, "", cols, (float)l->cfg.eps, max_rows);
    if (st != AMP_OK)
        return st;
    l->ndim_out = b->in_ndim;
    for (int i = 0; i < b->in_ndim; i++)
        l->out_shape[i] = b->in_shape[i];
    l->out_dtype = autocast_dtype(b->policy, OP_LAYERNORM, b->in_dtype, b->in_dtype);
    return AMP_OK;
}

/* ---- batchnorm2d --------------------------------------------------------------------------------- */

struct batchnorm_layer {
    struct param *gain, *shift;  /* (C) */
    struct tensor mean, rstd;    /* (C) fp32: this batch's statistics, saved for backward */
    float eps, momentum;
    bool relu;                   /* the relu after it runs here (batchnorm2d_fuse_relu): y is its output */
    size_t dx_off;               /* first layer: scratch for the dx nobody reads */
    const struct tensor *workspace;
};

static struct norm_args batchnorm_args(const struct batchnorm_layer *p, const struct tensor *x, bool training)
{
    return (struct norm_args){.n = x->shape[0], .c = x->shape[1], .hw = x->shape[2] * x->shape[3],
                              .eps = p->eps, .momentum = p->momentum, .training = training, .relu = p->relu};
}

void batchnorm2d_fuse_relu(struct layer *bn)
{
    ((struct batchnorm_layer *)bn->priv)->relu = true;
}

static void batchnorm2d_forward(struct layer *l, const struct step_ctx *ctx, const struct tensor *x,
                                const struct batch *b)
{
    (void)b;
    struct batchnorm_layer *p = l->priv;
    struct norm_args a = batchnorm_args(p, x, ctx->training);
    l->y = batch_view(&l->y, x->shape[0]);
    ctx->be->batchnorm_forward(ctx->be, &a, &l->y, &p->mean, &p->rstd, &l->buffers[0].t, &l->buffers[1].t, x,
                               param_value(p->gain), param_value(p->shift));
}

static void batchnorm2d_backward(struct layer *l, const struct step_ctx *ctx, const struct tensor *dy,
                                 const struct tensor *x, const struct batch *b)
{
    (void)b;
    struct batchnorm_layer *p = l->priv;
    struct norm_args a = batchnorm_args(p, x, true);
    struct tensor dx = dx_or_scratch(l, p->workspace, p->dx_off, x);
    ctx->be->batchnorm_backward(ctx->be, &a, &dx, &p->gain->grad, &p->shift->grad, dy, x, p->relu ? &l->y : NULL,
                                &p->mean, &p->rstd, param_value(p->gain), ctx->accumulate ? 1.0f : 0.0f);
}

static void batchnorm2d_free(struct layer *l)
{
    struct batchnorm_layer *p = l->priv;
    if (p) {
        tensor_free(&p->mean);
        tensor_free(&p->rstd);
    }
}

static const struct layer_ops batchnorm2d_ops = {batchnorm2d_forward, batchnorm2d_backward, batchnorm2d_free, NULL,
                                                 NULL};

enum amp_status batchnorm2d_setup(struct layer *l, struct layer_build *b)
{
    char got[96];
    if (b->in_tokens || b->in_ndim != 4)
        return layer_fail(l, b, "batchnorm2d normalises images; use layernorm for (N, D) or (N, T, D)",
                          "expects input of shape (N, C, H, W), got %s from %s",
                          shape_str_n(got, sizeof got, b->in_ndim, b->in_shape), b->in_from);
    if (!(l->cfg.eps > 0))
        return layer_fail(l, b, "use eps > 0 (default 1e-5)", "eps must be > 0, got %g", l->cfg.eps);
    if (!(l->cfg.momentum >= 0 && l->cfg.momentum <= 1))
        return layer_fail(l, b, "use momentum in [0, 1] (default 0.1)", "momentum must be in [0, 1], got %g",
                          l->cfg.momentum);
    struct batchnorm_layer *p = calloc(1, sizeof *p);
    if (!p)
        return amp_fail(b->err, AMP_ERR_INTERNAL, NULL, "out of memory building layer '%s'", l->cfg.name);
    l->priv = p;
    l->ops = &batchnorm2d_ops;
    l->op = OP_BATCHNORM2D;
    p->workspace = b->workspace;
    p->dx_off = reserve_unused_dx(l, b);
    p->eps = (float)l->cfg.eps;
    p->momentum = (float)l->cfg.momentum;
    int64_t c = b->in_shape[1];

    enum amp_status st = layer_reserve_params(l, b, 2);
    if (st != AMP_OK)
        return st;
    p->gain = layer_add_param(l, b, "weight", 1, &c, PINIT_NORM_GAIN, c, false, DT_FP32);
    if (!p->gain)
        return b->err->code;
    p->shift = layer_add_param(l, b, "bias", 1, &c, PINIT_NORM_SHIFT, c, false, DT_FP32);
    if (!p->shift)
        return b->err->code;
    l->buffers = calloc(2, sizeof *l->buffers);
    if (!l->buffers)
        return amp_fail(b->err, AMP_ERR_INTERNAL, NULL, "out of memory building layer '%s'", l->cfg.name);
    st = layer_add_buffer(l, b, "running_mean", 1, &c);
    if (st == AMP_OK && (st = layer_add_buffer(l, b, "running_var", 1, &c)) == AMP_OK)
        l->buffers[1].nonneg = true;
    if (st == AMP_OK)
        st = layer_alloc(l, b, &p->mean, DT_FP32, 1, &c, "batch mean");
    if (st == AMP_OK)
        st = layer_alloc(l, b, &p->rstd, DT_FP32, 1, &c, "batch rstd");
    if (st != AMP_OK)
        return st;
    l->ndim_out = 4;
    for (int i = 0; i < 4; i++)
        l->out_shape[i] = b->in_shape[i];
    l->out_dtype = autocast_dtype(b->policy, OP_BATCHNORM2D, b->in_dtype, b->in_dtype);
    return AMP_OK;
}
