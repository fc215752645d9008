/*
 * conv.c — the image layers: conv2d, maxpool2d / avgpool2d and flatten. NCHW throughout.
 *
 * conv2d: x (N, C, H, W) -> y (N, out, H', W') with H' = (H + 2 padding - kernel) / stride + 1.
 *   Parameters "NAME/weight" (out, C, k, k) and "NAME/bias" (out) fp32, fan_in = C*k*k. Like linear,
 *   the op runs in d = autocast(conv2d, x's dtype): x cast to d into a saved copy when it is not d,
 *   the weight in d (its copy, or master where master is d), fp32 bias inside the op. Backward: dW, db fp32
 *   (beta = accumulate), dx computed in d and cast to x's dtype when that differs.
 * maxpool2d / avgpool2d: square windows, stride defaulting to the kernel, padding at most kernel/2
 *   (as PyTorch requires); avg counts the padding in its divisor. They run in their input's dtype
 *   (promote class), so y and dx have x's dtype unless the policy moves them.
 * flatten: (N, ...) -> (N, prod(...)). No op: y is a view of x and dx a view of dy, nothing is
 *   allocated (model.c leaves both alone when freeing).
 */
#include <stdlib.h>

#include "layers.h" /* struct layer_build, layer_fail, views, scratch */

static enum amp_status need_image(struct layer *l, struct layer_build *b)
{
    char got[96];
    if (!b->in_tokens && b->in_ndim == 4)
        return AMP_OK;
    return layer_fail(l, b,
                      "it needs images (N, C, H, W): image data (idx, or hdf5 with samples of 3 dims) or "
                      "another conv2d / pool / batchnorm2d layer before it, not a flatten or linear",
                      "expects input of shape (N, C, H, W), got %s from %s",
                      shape_str_n(got, sizeof got, b->in_ndim, b->in_shape), b->in_from);
}

/* Output side of a window op; fails when the window does not fit. */
static enum amp_status window_out(struct layer *l, struct layer_build *b, int64_t in, int64_t k, int64_t s,
                                  int64_t pad, int64_t *out)
{
    if (k < 1 || s < 1 || pad < 0)
        return layer_fail(l, b, "kernel and stride must be >= 1 and padding >= 0",
                          "kernel %lld, stride %lld, padding %lld", (long long)k, (long long)s, (long long)pad);
    if (in + 2 * pad < k) {
        char got[96];
        return layer_fail(l, b, "use a smaller kernel, more padding, or fewer pooling layers before it",
                          "kernel %lld does not fit input of shape %s (padding %lld)", (long long)k,
                          shape_str_n(got, sizeof got, b->in_ndim, b->in_shape), (long long)pad);
    }
    *out = (in + 2 * pad - k) / s + 1;
    return AMP_OK;
}

/* ---- conv2d -------------------------------------------------------------------------------------- */

struct conv_layer {
    struct param *w, *bias;   /* (out, C, k, k), (out) or NULL */
    struct conv_args shape;   /* for the max batch; .n is set per pass */
    enum dtype d;             /* the op's dtype */
    struct tensor xc;         /* (max N, C, H, W) in d when x is not d */
    size_t dxc_off;           /* scratch like xc, for dx in d */
    const struct tensor *workspace;
};

static void conv2d_forward(struct layer *l, const struct step_ctx *ctx, const struct tensor *x,
                           const struct batch *b)
{
    (void)b;
    struct conv_layer *p = l->priv;
    struct backend *be = ctx->be;
    struct conv_args a = p->shape;
    a.n = x->shape[0];
    l->y = batch_view(&l->y, a.n);
    struct tensor xc;
    const struct tensor *xin = x;
    if (p->xc.data) {
        xc = batch_view(&p->xc, a.n);
        be->convert(be, &xc, x);
        xin = &xc;
    }
    const struct tensor *w = param_value(p->w); /* in p->d */
    be->conv2d_forward(be, &a, &l->y, xin, w, p->bias ? param_value(p->bias) : NULL);
}

static void conv2d_backward(struct layer *l, const struct step_ctx *ctx, const struct tensor *dy,
                            const struct tensor *x, const struct batch *b)
{
    (void)b;
    struct conv_layer *p = l->priv;
    struct backend *be = ctx->be;
    struct conv_args a = p->shape;
    a.n = x->shape[0];
    struct tensor xc = p->xc.data ? batch_view(&p->xc, a.n) : *x;
    be->conv2d_backward_filter(be, &a, &p->w->grad, p->bias ? &p->bias->grad : NULL, dy, &xc,
                               ctx->accumulate ? 1.0f : 0.0f);
    if (!l->needs_dx)
        return;
    l->dx = batch_view_like(&l->dx, x);
    const struct tensor *w = param_value(p->w); /* in p->d */
    if (!p->xc.data) {
        be->conv2d_backward_data(be, &a, &l->dx, dy, w);
        return;
    }
    struct tensor dxc = scratch_view(p->workspace, p->dxc_off, p->d, x->ndim, x->shape);
    be->conv2d_backward_data(be, &a, &dxc, dy, w);
    be->convert(be, &l->dx, &dxc);
}

static void conv2d_free(struct layer *l)
{
    struct conv_layer *p = l->priv;
    if (p)
        tensor_free(&p->xc);
}

static const struct layer_ops conv2d_ops = {conv2d_forward, conv2d_backward, conv2d_free, NULL, NULL};

enum amp_status conv2d_setup(struct layer *l, struct layer_build *b)
{
    enum amp_status st = need_image(l, b);
    if (st != AMP_OK)
        return st;
    if (l->cfg.out <= 0)
        return layer_fail(l, b, "set `out` to the number of output channels", "out must be >= 1, got %lld",
                          (long long)l->cfg.out);
    struct conv_layer *p = calloc(1, sizeof *p);
    if (!p)
        return amp_fail(b->err, AMP_ERR_INTERNAL, NULL, "out of memory building layer '%s'", l->cfg.name);
    l->priv = p;
    l->ops = &conv2d_ops;
    l->op = OP_CONV2D;
    p->workspace = b->workspace;

    struct conv_args *a = &p->shape;
    a->n = b->in_shape[0];
    a->c_in = b->in_shape[1];
    a->h_in = b->in_shape[2];
    a->w_in = b->in_shape[3];
    a->c_out = l->cfg.out;
    a->kernel = l->cfg.kernel;
    a->stride = l->cfg.stride > 0 ? l->cfg.stride : 1;
    a->padding = l->cfg.padding;
    st = window_out(l, b, a->h_in, a->kernel, a->stride, a->padding, &a->h_out);
    if (st == AMP_OK)
        st = window_out(l, b, a->w_in, a->kernel, a->stride, a->padding, &a->w_out);
    if (st != AMP_OK)
        return st;

    int64_t fan_in = a->c_in * a->kernel * a->kernel;
    int64_t wshape[4] = {a->c_out, a->c_in, a->kernel, a->kernel};
    st = layer_reserve_params(l, b, 2);
    if (st != AMP_OK)
        return st;
    p->d = autocast_dtype(b->policy, OP_CONV2D, b->in_dtype, b->in_dtype);
    p->w = layer_add_param(l, b, "weight", 4, wshape, PINIT_CONV_WEIGHT, fan_in, true, p->d);
    if (!p->w)
        return b->err->code;
    if (l->cfg.bias) {
        p->bias = layer_add_param(l, b, "bias", 1, &a->c_out, PINIT_CONV_BIAS, fan_in, false, DT_FP32);
        if (!p->bias)
            return b->err->code;
    }
    if (p->d != b->in_dtype) {
        st = layer_alloc(l, b, &p->xc, p->d, 4, b->in_shape, "conv2d input cast");
        if (st != AMP_OK)
            return st;
        p->dxc_off = scratch_reserve(b, p->d, p->xc.numel);
    }
    l->ndim_out = 4;
    int64_t out[4] = {a->n, a->c_out, a->h_out, a->w_out};
    for (int i = 0; i < 4; i++)
        l->out_shape[i] = out[i];
    l->out_dtype = p->d;
    return AMP_OK;
}

/* ---- maxpool2d, avgpool2d ------------------------------------------------------------------------ */

struct pool_layer {
    struct pool_args shape;   /* .n is set per pass */
};

static void pool2d_forward(struct layer *l, const struct step_ctx *ctx, const struct tensor *x,
                           const struct batch *b)
{
    (void)b;
    struct pool_layer *p = l->priv;
    struct pool_args a = p->shape;
    a.n = x->shape[0];
    l->y = batch_view(&l->y, a.n);
    ctx->be->pool2d_forward(ctx->be, &a, &l->y, x);
}

static void pool2d_backward(struct layer *l, const struct step_ctx *ctx, const struct tensor *dy,
                            const struct tensor *x, const struct batch *b)
{
    (void)b;
    struct pool_layer *p = l->priv;
    if (!l->needs_dx)
        return;
    struct pool_args a = p->shape;
    a.n = x->shape[0];
    l->dx = batch_view_like(&l->dx, x);
    ctx->be->pool2d_backward(ctx->be, &a, &l->dx, dy, x, &l->y);
}

static const struct layer_ops pool2d_ops = {pool2d_forward, pool2d_backward, NULL, NULL, NULL};

enum amp_status pool2d_setup(struct layer *l, struct layer_build *b)
{
    enum amp_status st = need_image(l, b);
    if (st != AMP_OK)
        return st;
    struct pool_layer *p = calloc(1, sizeof *p);
    if (!p)
        return amp_fail(b->err, AMP_ERR_INTERNAL, NULL, "out of memory building layer '%s'", l->cfg.name);
    l->priv = p;
    l->ops = &pool2d_ops;
    bool is_max = l->cfg.kind == LAYER_MAXPOOL2D;
    l->op = is_max ? OP_MAXPOOL2D : OP_AVGPOOL2D;

    struct pool_args *a = &p->shape;
    a->kind = is_max ? POOL_MAX : POOL_AVG;
    a->n = b->in_shape[0];
    a->c = b->in_shape[1];
    a->h_in = b->in_shape[2];
    a->w_in = b->in_shape[3];
    a->kernel = l->cfg.kernel;
    a->stride = l->cfg.stride > 0 ? l->cfg.stride : l->cfg.kernel;
    a->padding = l->cfg.padding;
    if (a->padding > a->kernel / 2)
        return layer_fail(l, b, "use padding <= kernel/2 (PyTorch's limit too)",
                          "padding %lld is more than half the kernel %lld", (long long)a->padding,
                          (long long)a->kernel);
    st = window_out(l, b, a->h_in, a->kernel, a->stride, a->padding, &a->h_out);
    if (st == AMP_OK)
        st = window_out(l, b, a->w_in, a->kernel, a->stride, a->padding, &a->w_out);
    if (st != AMP_OK)
        return st;
    l->ndim_out = 4;
    int64_t out[4] = {a->n, a->c, a->h_out, a->w_out};
    for (int i = 0; i < 4; i++)
        l->out_shape[i] = out[i];
    l->out_dtype = autocast_dtype(b->policy, l->op, b->in_dtype, b->in_dtype);
    return AMP_OK;
}

/* ---- flatten ------------------------------------------------------------------------------------- */

static void flatten_forward(struct layer *l, const struct step_ctx *ctx, const struct tensor *x,
                            const struct batch *b)
{
    (void)ctx;
    (void)b;
    int64_t shape[2] = {x->shape[0], (int64_t)(x->numel / (size_t)x->shape[0])};
    l->y = tensor_reshape(x, 2, shape);
}

static void flatten_backward(struct layer *l, const struct step_ctx *ctx, const struct tensor *dy,
                             const struct tensor *x, const struct batch *b)
{
    (void)ctx;
    (void)b;
    if (l->needs_dx)
        l->dx = tensor_reshape(dy, x->ndim, x->shape);
}

static const struct layer_ops flatten_ops = {flatten_forward, flatten_backward, NULL, NULL, NULL};

enum amp_status flatten_setup(struct layer *l, struct layer_build *b)
{
    if (b->in_tokens) {
        char got[96];
        return layer_fail(l, b, "put an embedding layer first for text data", "cannot flatten token ids %s",
                          shape_str_n(got, sizeof got, b->in_ndim, b->in_shape));
    }
    l->ops = &flatten_ops;
    l->op = OP_KIND_COUNT; /* no op: a view */
    l->ndim_out = 2;
    l->out_shape[0] = b->in_shape[0];
    l->out_shape[1] = shape_inner(b->in_ndim, b->in_shape);
    l->out_dtype = b->in_dtype;
    l->is_view = true;
    b->y_is_view = true;
    return AMP_OK;
}
