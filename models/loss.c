/*
 * loss.c — the loss layers, cross_entropy and mse: always the last layer of a model.
 *
 * cross_entropy: logits (N, K) with labels (N), or (N, T, K) with next-token labels (N*T) for text;
 *   K must equal the data's num_classes (the vocabulary for text). Fused softmax + NLL in fp32 on
 *   logits of any dtype (backend xent_forward_backward).
 * mse: predictions (N, K) against the batch's fp32 targets (N, K); the per-row loss is mean_k (y-t)^2.
 *
 * y is the per-row losses, fp32, (rows) with rows = N or N*T; model_loss_rows gives rows for a batch.
 * cross_entropy also writes m->correct (int32 per row, 1 where argmax == label), which the model
 * hands the layer as its private pointer.
 *
 * Forward computes the losses only (no dlogits), so evaluation does no gradient work. Backward calls
 * the same fused backend op, now with dlogits = dx: it writes the same losses and correct marks (the
 * same op on the same logits) and
 * dx = d(sum of row losses / rows) * grad_seed = (softmax - onehot) * grad_seed / rows
 * in the dtype of the logits, as autograd's backward of the fp32 cast gives it. Where the trainer says
 * backward follows (ctx->loss_in_backward), forward leaves the losses to backward: the softmax runs once
 * a step instead of twice (its exps were a fifth of text_gpt's CPU step).
 * cross_entropy writes dx over the logits themselves (l->dx_is_input) where the layer before is a linear layer,
 * whose backward reads its input and dy but not its output, and no numerics report reads the outputs after
 * backward (layer_build.fuse): at a GPT-2 vocabulary that is one (B*T, V) tensor less (1.6 GB in bf16 at 16 x
 * 1024 tokens). The backends read a row whole before they write its gradient (xent_forward_backward may be given
 * dlogits == logits).
 * A padded vocabulary (docs/model.md, "Vocabulary padding"): the logits are (N, T, Vp), K the V classes; the backend
 * reads rows Vp apart and writes the padding's dlogits 0.
 */
#include <stdlib.h>

#include "layers.h" /* struct layer_build, layer_fail, views */

struct loss_layer {
    int64_t rows_per_sample;  /* 1, or T for text */
    int64_t classes;          /* K */
    int32_t *correct;         /* the model's m->correct (cross_entropy), not owned */
    const struct tensor *workspace;
    size_t dx_off;            /* first layer: scratch for the dlogits nobody reads */
};

static struct tensor loss_rows_view(const struct layer *l, const struct loss_layer *p, int64_t n)
{
    return batch_view(&l->y, n * p->rows_per_sample);
}

static void loss_forward(struct layer *l, const struct step_ctx *ctx, const struct tensor *x,
                         const struct batch *b)
{
    if (ctx->loss_in_backward)
        return;
    struct loss_layer *p = l->priv;
    int64_t rows = x->shape[0] * p->rows_per_sample;
    l->y = loss_rows_view(l, p, x->shape[0]);
    if (l->cfg.kind == LAYER_CROSS_ENTROPY)
        ctx->be->xent_forward_backward(ctx->be, &l->y, p->correct, NULL, x, b->labels, rows, p->classes,
                                       ctx->grad_seed);
    else
        ctx->be->mse_forward_backward(ctx->be, &l->y, NULL, x, &b->target, rows, p->classes, ctx->grad_seed);
}

static void loss_backward(struct layer *l, const struct step_ctx *ctx, const struct tensor *dy,
                          const struct tensor *x, const struct batch *b)
{
    (void)dy;
    struct loss_layer *p = l->priv;
    int64_t rows = x->shape[0] * p->rows_per_sample;
    l->y = loss_rows_view(l, p, x->shape[0]);
    struct tensor dx;
    if (l->dx_is_input) {
        l->dx = batch_view_like(x, x); /* the logits, overwritten by their gradient */
        dx = l->dx;
    } else if (l->needs_dx) {
        l->dx = batch_view_like(&l->dx, x);
        dx = l->dx;
    } else {
        dx = scratch_view(p->workspace, p->dx_off, x->dtype, x->ndim, x->shape);
    }
    if (l->cfg.kind == LAYER_CROSS_ENTROPY)
        ctx->be->xent_forward_backward(ctx->be, &l->y, p->correct, &dx, x, b->labels, rows, p->classes,
                                       ctx->grad_seed);
    else
        ctx->be->mse_forward_backward(ctx->be, &l->y, &dx, x, &b->target, rows, p->classes, ctx->grad_seed);
}

static const struct layer_ops loss_ops = {loss_forward, loss_backward, NULL, NULL, NULL};

enum amp_status loss_setup(struct layer *l, struct layer_build *b)
{
    char got[96];
    bool xent = l->cfg.kind == LAYER_CROSS_ENTROPY;
    bool text = b->spec->is_tokens;
    if (b->in_tokens)
        return layer_fail(l, b, "put an embedding and a linear layer before the loss",
                          "cannot take token ids %s as its input", shape_str_n(got, sizeof got, b->in_ndim,
                                                                                b->in_shape));
    int want_ndim = xent && text ? 3 : 2;
    if (b->in_ndim != want_ndim) {
        const char *hint = b->in_ndim == 4 ? "add a flatten and a linear layer before the loss" : NULL;
        return layer_fail(l, b, hint, "expects input of shape %s, got %s from %s",
                          want_ndim == 3 ? "(N, T, K) (logits per token)" : "(N, K)",
                          shape_str_n(got, sizeof got, b->in_ndim, b->in_shape), b->in_from);
    }
    int64_t K = b->in_valid > 0 ? b->in_valid : b->in_shape[want_ndim - 1]; /* the classes, not the padding */
    if (xent && !text && K < b->spec->num_classes && b->spec->labels_from[0])
        /* more labels than the model has classes: most often one bad label (a corrupt or foreign file) */
        return amp_fail(b->err, AMP_ERR_DATA,
                        "check that labels file (a corrupt byte, or another data set's labels?); if the data "
                        "really has that many classes, set `out` of the layer before the loss to it",
                        "%s: label %lld at index %lld is beyond the %lld classes the model gives (%s feeds "
                        "model.layers[%d] '%s' %lld logits)",
                        b->spec->labels_from, (long long)(b->spec->num_classes - 1), (long long)b->spec->max_label_at,
                        (long long)K, b->in_from, l->index, l->cfg.name, (long long)K);
    if (xent && K != b->spec->num_classes)
        return layer_fail(l, b, "set `out` of the layer before the loss to the number of classes",
                          "expects %lld classes (the data's %s), but %s gives %lld (input %s)",
                          (long long)b->spec->num_classes, text ? "vocabulary" : "labels", b->in_from,
                          (long long)K, shape_str_n(got, sizeof got, b->in_ndim, b->in_shape));
    struct loss_layer *p = calloc(1, sizeof *p);
    if (!p)
        return amp_fail(b->err, AMP_ERR_INTERNAL, NULL, "out of memory building layer '%s'", l->cfg.name);
    l->priv = p;
    l->ops = &loss_ops;
    l->op = xent ? OP_CROSS_ENTROPY : OP_MSE;
    p->rows_per_sample = want_ndim == 3 ? b->in_shape[1] : 1;
    p->classes = K;
    p->workspace = b->workspace;
    const struct layer *before = b->nbuilt > 0 ? &b->built[b->nbuilt - 1] : NULL;
    l->dx_is_input = xent && l->needs_dx && b->fuse && before && before->cfg.kind == LAYER_LINEAR && !before->is_view;
    if (!l->needs_dx)
        p->dx_off = scratch_reserve(b, b->in_dtype, (size_t)(b->in_shape[0] * shape_inner(b->in_ndim, b->in_shape)));
    l->ndim_out = 1;
    l->out_shape[0] = b->in_shape[0] * p->rows_per_sample;
    l->out_dtype = DT_FP32;
    return AMP_OK;
}

/* model.c hands the cross_entropy layer the model's correct-marks buffer. */
void loss_set_correct(struct layer *l, int32_t *correct)
{
    struct loss_layer *p = l->priv;
    p->correct = correct;
}

int64_t loss_rows_per_sample(const struct layer *l)
{
    const struct loss_layer *p = l->priv;
    return p->rows_per_sample;
}
