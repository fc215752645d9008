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

static void activation_decode(struct layer *l, const struct step_ctx *ctx, const struct tensor *x,
                              const struct decode_step *d)
{
    l->y = seq_view(&l->y, d->n);
    ctx->be->act_forward(ctx->be, activation_kind(l), &l->y, x);
}

static const struct layer_ops activation_ops = {activation_forward, activation_backward, NULL, activation_decode,
                                                NULL};

/* A relu fused into the layer before it (a batchnorm2d: norm_args.relu; a linear layer: GEMM_EPI_RELU): that
 * layer's y is already this one's output, and y and dx are views. The mask is applied elsewhere: by the
 * batchnorm2d's backward as it reads dy, or by the linear layer after this one in its dx product's epilogue
 * (linear_op.mask_dx); or else here, over dy in place (dy is the next layer's input gradient, read by nobody after
 * this), with y, which passes exactly where this layer's input does. On the steps that count zeros (ctx->zeros)
 * the next layer gives its dx unmasked (its own count is of that), the mask is applied here and counted, so the
 * log does not change with the fusion (a batchnorm2d then masks dy again, which changes nothing). */
struct fused_relu {
    bool into_linear;     /* fused into a linear layer (else a batchnorm2d) */
    bool masked_elsewhere; /* by the batchnorm2d before, or the linear layer after (relu_masked_by_next) */
};

static void fused_relu_forward(struct layer *l, const struct step_ctx *ctx, const struct tensor *x,
                               const struct batch *b)
{
    (void)ctx, (void)b;
    l->y = tensor_reshape(x, x->ndim, x->shape);
}

static void fused_relu_backward(struct layer *l, const struct step_ctx *ctx, const struct tensor *dy,
                                const struct tensor *x, const struct batch *b)
{
    (void)b;
    if (!l->needs_dx)
        return;
    const struct fused_relu *p = l->priv;
    l->dx = tensor_reshape(dy, dy->ndim, dy->shape);
    if (!p->masked_elsewhere || ctx->zeros)
        ctx->be->act_backward(ctx->be, ACT_RELU, &l->dx, dy, x);
    if (ctx->zeros)
        count_grad_zeros(ctx, &l->dx, l->out_dtype != DT_FP32);
}

static void fused_relu_decode(struct layer *l, const struct step_ctx *ctx, const struct tensor *x,
                              const struct decode_step *d)
{
    (void)ctx, (void)d;
    l->y = tensor_reshape(x, x->ndim, x->shape);
}

static const struct layer_ops fused_relu_ops = {fused_relu_forward, fused_relu_backward, NULL, fused_relu_decode,
                                                NULL};

bool relu_fused_into_linear(const struct layer *relu)
{
    return relu->ops == &fused_relu_ops && ((const struct fused_relu *)relu->priv)->into_linear;
}

void relu_masked_by_next(struct layer *relu)
{
    ((struct fused_relu *)relu->priv)->masked_elsewhere = true;
}

/* Whether this relu runs inside the op before it (kind: OP_BATCHNORM2D, OP_LINEAR): fusing allowed
 * (layer_build.fuse), the same dtype out of both (the fused op writes one tensor), a dtype the backends' fused
 * ReLU takes. */
static bool fuses_into(const struct layer *l, const struct layer_build *b, enum op_kind kind)
{
    if (l->cfg.kind != LAYER_RELU || !b->fuse || b->nbuilt < 1)
        return false;
    const struct layer *prev = &b->built[b->nbuilt - 1];
    return prev->op == kind && prev->out_dtype == l->out_dtype && b->in_dtype == l->out_dtype &&
           (l->out_dtype == DT_FP32 || l->out_dtype == DT_BF16 || l->out_dtype == DT_FP16);
}

enum amp_status activation_setup(struct layer *l, struct layer_build *b)
{
    enum amp_status st = need_activation(l, b);
    if (st != AMP_OK)
        return st;
    l->ops = &activation_ops;
    l->op = l->cfg.kind == LAYER_RELU ? OP_RELU : OP_GELU;
    same_shape_out(l, b);
    const bool into_linear = fuses_into(l, b, OP_LINEAR) && linear_is_plain(&b->built[b->nbuilt - 1]);
    if (into_linear || fuses_into(l, b, OP_BATCHNORM2D)) {
        struct fused_relu *p = calloc(1, sizeof *p);
        if (!p)
            return amp_fail(b->err, AMP_ERR_INTERNAL, NULL, "out of memory building layer '%s'", l->cfg.name);
        l->priv = p;
        p->into_linear = into_linear;
        p->masked_elsewhere = !into_linear; /* batchnorm2d's backward masks dy as it reads it */
        if (into_linear)
            linear_fuse_relu(&b->built[b->nbuilt - 1]);
        else
            batchnorm2d_fuse_relu(&b->built[b->nbuilt - 1]);
        l->ops = &fused_relu_ops;
        l->is_view = true;
        b->y_is_view = true;
    }
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

/* generation is never training: the identity */
static void dropout_decode(struct layer *l, const struct step_ctx *ctx, const struct tensor *x,
                           const struct decode_step *d)
{
    l->y = seq_view(&l->y, d->n);
    ctx->be->convert(ctx->be, &l->y, x);
}

static const struct layer_ops dropout_ops = {dropout_forward, dropout_backward, NULL, dropout_decode, NULL};

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
