/*
 * elementwise.c — relu, gelu and dropout: one input, same shape out, no parameters.
 *
 * All three are promote-class ops: they run in their input's dtype (y and dx have x's dtype) unless
 * the policy moves them (`fp32_ops: [gelu]` makes gelu's y fp32; dx keeps x's dtype).
 * gelu: `approximate: tanh` (default, GPT-2's) or `none` (the erf form).
 * dropout: inverted scaling, y = x * mask / (1 - p). The mask is a pure function of
 *   (ctx->key.seed, stream = the layer's index, ctx->key.counter) and the element index, so backward
 *   regenerates the forward's mask (the backend does it) and nothing is stored. Not training (eval)
 *   or p = 0: y is a copy of x (converted if the policy gives y another dtype).
 */
#include <stdlib.h>

#include "layers.h" /* struct layer_build, layer_fail, views */

static enum amp_status need_activation(struct layer *l, struct layer_build *b)
{
    if (!b->in_tokens)
        return AMP_OK;
    char got[96];
    return layer_fail(l, b, "put an embedding layer first for text data", "cannot apply to token ids %s",
                      shape_str_n(got, sizeof got, b->in_ndim, b->in_shape));
}

static void same_shape_out(struct layer *l, const struct layer_build *b)
{
    l->ndim_out = b->in_ndim;
    for (int i = 0; i < b->in_ndim; i++)
        l->out_shape[i] = b->in_shape[i];
    l->out_dtype = autocast_dtype(b->policy, l->op, b->in_dtype, b->in_dtype);
}

/* ---- relu, gelu ---------------------------------------------------------------------------------- */

static enum act_kind activation_kind(const struct layer *l)
{
    if (l->cfg.kind == LAYER_RELU)
        return ACT_RELU;
    return l->cfg.approximate == GELU_ERF ? ACT_GELU_ERF : ACT_GELU_TANH;
}

static void activation_forward(struct layer *l, const struct step_ctx *ctx, const struct tensor *x,
                               const struct batch *b)
{
    (void)b;
    l->y = batch_view(&l->y, x->shape[0]);
    ctx->be->act_forward(ctx->be, activation_kind(l), &l->y, x);
}

static void activation_backward(struct layer *l, const struct step_ctx *ctx, const struct tensor *dy,
                                const struct tensor *x, const struct batch *b)
{
    (void)b;
    if (!l->needs_dx)
        return;
    l->dx = batch_view_like(&l->dx, x);
    ctx->be->act_backward(ctx->be, activation_kind(l), &l->dx, dy, x);
}

static const struct layer_ops activation_ops = {activation_forward, activation_backward, NULL};

enum amp_status activation_setup(struct layer *l, struct layer_build *b)
{
    enum amp_status st = need_activation(l, b);
    if (st != AMP_OK)
        return st;
    l->ops = &activation_ops;
    l->op = l->cfg.kind == LAYER_RELU ? OP_RELU : OP_GELU;
    same_shape_out(l, b);
    return AMP_OK;
}

/* ---- dropout ------------------------------------------------------------------------------------- */

static struct rng_key dropout_key(const struct layer *l, const struct step_ctx *ctx)
{
    struct rng_key key = ctx->key;
    key.stream = (uint64_t)l->index;
    return key;
}

static void dropout_forward(struct layer *l, const struct step_ctx *ctx, const struct tensor *x,
                            const struct batch *b)
{
    (void)b;
    l->y = batch_view(&l->y, x->shape[0]);
    float p = (float)l->cfg.p;
    if (!ctx->training || p == 0.0f)
        ctx->be->convert(ctx->be, &l->y, x);
    else
        ctx->be->dropout_forward(ctx->be, &l->y, x, p, dropout_key(l, ctx));
}

static void dropout_backward(struct layer *l, const struct step_ctx *ctx, const struct tensor *dy,
                             const struct tensor *x, const struct batch *b)
{
    (void)b;
    if (!l->needs_dx)
        return;
    l->dx = batch_view_like(&l->dx, x);
    float p = (float)l->cfg.p;
    if (!ctx->training || p == 0.0f)
        ctx->be->convert(ctx->be, &l->dx, dy);
    else
        ctx->be->dropout_backward(ctx->be, &l->dx, dy, p, dropout_key(l, ctx));
}

static const struct layer_ops dropout_ops = {dropout_forward, dropout_backward, NULL};

enum amp_status dropout_setup(struct layer *l, struct layer_build *b)
{
    enum amp_status st = need_activation(l, b);
    if (st != AMP_OK)
        return st;
    if (!(l->cfg.p >= 0 && l->cfg.p < 1))
        return layer_fail(l, b, "use p in [0, 1)", "p must be in [0, 1), got %g", l->cfg.p);
    l->ops = &dropout_ops;
    l->op = OP_DROPOUT;
    same_shape_out(l, b);
    return AMP_OK;
}
