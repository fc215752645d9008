/*
 * embedding.c — token + learned position embedding, the first layer of a text model.
 *
 * y (N, T, C) = wte[token] + wpe[t], read from the batch's int32 tokens (N, T) in backend memory.
 * Parameters "NAME/wte" (vocab, C) and "NAME/wpe" (max_len, C); no weight decay (they are tables, like
 * the norm gains). An fp32-class op: the lookup reads the tables in fp32 (the masters, or the fp32 copies
 * of bf16 masters) and writes y in fp32. Backward scatter-adds dy into dwte and dwpe (fp32, beta = accumulate); there is no dx.
 * A wte tied to a later linear (its `tie`) has that layer's gradient in it already: backward adds to it.
 * Setup checks: the layer is first, the data are tokens, vocab covers the data's token range
 * (num_classes), dim >= 1, and the sequence length fits max_len (default data.seq_len).
 */
#include <stdlib.h>

#include "layers.h" /* struct layer_build, layer_fail, views */

struct embedding_layer {
    struct param *wte, *wpe;
    int64_t T, C;
};

static void embedding_forward(struct layer *l, const struct step_ctx *ctx, const struct tensor *x,
                              const struct batch *b)
{
    (void)x;
    struct embedding_layer *p = l->priv;
    l->y = batch_view(&l->y, b->n);
    ctx->be->embedding_forward(ctx->be, &l->y, b->tokens, param_value_as(p->wte, DT_FP32),
                               param_value_as(p->wpe, DT_FP32), b->n, p->T, p->C);
}

static void embedding_backward(struct layer *l, const struct step_ctx *ctx, const struct tensor *dy,
                               const struct tensor *x, const struct batch *b)
{
    (void)x;
    struct embedding_layer *p = l->priv;
    float beta = ctx->accumulate ? 1.0f : 0.0f;
    struct tensor *dwte = &p->wte->grad;
    if (p->wte->tied && !ctx->accumulate) { /* the tying linear wrote wte's gradient already: add to it */
        ctx->be->zero(ctx->be, &p->wpe->grad);
        beta = 1.0f;
    } else if (p->wte->tied && p->wte->tied_grad.data) { /* accumulating: this micro-batch's sum apart first */
        dwte = &p->wte->tied_grad;
    }
    ctx->be->embedding_backward(ctx->be, dwte, &p->wpe->grad, dy, b->tokens, b->n, p->T, p->C, beta);
    if (dwte != &p->wte->grad)
        ctx->be->add(ctx->be, &p->wte->grad, &p->wte->grad, dwte);
}

/* wpe's rows from d->pos on: the position embedding of the new positions */
static void embedding_decode(struct layer *l, const struct step_ctx *ctx, const struct tensor *x,
                             const struct decode_step *d)
{
    (void)x;
    struct embedding_layer *p = l->priv;
    struct tensor wpe = *param_value_as(p->wpe, DT_FP32);
    wpe.data = (float *)wpe.data + d->pos * p->C;
    wpe = tensor_reshape(&wpe, 2, (int64_t[]){d->n, p->C});
    l->y = seq_view(&l->y, d->n);
    ctx->be->embedding_forward(ctx->be, &l->y, d->tokens, param_value_as(p->wte, DT_FP32), &wpe, 1, d->n, p->C);
}

static const struct layer_ops embedding_ops = {embedding_forward, embedding_backward, NULL, embedding_decode, NULL};

enum amp_status embedding_setup(struct layer *l, struct layer_build *b)
{
    char got[96];
    if (!b->spec->is_tokens)
        return layer_fail(l, b, "an embedding reads token ids: use data.format: text, or remove the embedding",
                          "needs text token input, but the data gives samples of shape %s",
                          shape_str_n(got, sizeof got, b->in_ndim, b->in_shape));
    if (!b->in_tokens)
        return layer_fail(l, b, "move the embedding to the top of model.layers",
                          "must be the first layer (it reads the token ids), but it comes after %s", b->in_from);
    int64_t T = b->in_shape[1];
    int64_t C = l->cfg.dim;
    int64_t vocab = l->cfg.vocab;
    int64_t max_len = l->cfg.max_len > 0 ? l->cfg.max_len : (b->seq_len > 0 ? b->seq_len : T);
    if (C <= 0)
        return layer_fail(l, b, "set `dim` to the model width (e.g. 128)", "dim must be >= 1, got %lld",
                          (long long)C);
    if (vocab < b->spec->num_classes)
        return layer_fail(l, b, "set vocab to at least the data's vocabulary (256 for bytes)",
                          "vocab %lld is smaller than the data's token range %lld", (long long)vocab,
                          (long long)b->spec->num_classes);
    if (T > max_len)
        return layer_fail(l, b, "raise the embedding's max_len or lower data.seq_len",
                          "sequence length T = %lld is longer than max_len = %lld", (long long)T,
                          (long long)max_len);

    struct embedding_layer *p = calloc(1, sizeof *p);
    if (!p)
        return amp_fail(b->err, AMP_ERR_INTERNAL, NULL, "out of memory building layer '%s'", l->cfg.name);
    l->priv = p;
    l->ops = &embedding_ops;
    l->op = OP_EMBEDDING;
    p->T = T;
    p->C = C;
    enum amp_status st = layer_reserve_params(l, b, 2);
    if (st != AMP_OK)
        return st;
    p->wte = layer_add_param(l, b, "wte", 2, (int64_t[]){vocab, C}, PINIT_EMBEDDING, C, false, DT_FP32);
    if (!p->wte)
        return b->err->code;
    p->wpe = layer_add_param(l, b, "wpe", 2, (int64_t[]){max_len, C}, PINIT_EMBEDDING, C, false, DT_FP32);
    if (!p->wpe)
        return b->err->code;
    l->ndim_out = 3;
    l->out_shape[0] = b->in_shape[0];
    l->out_shape[1] = T;
    l->out_shape[2] = C;
    l->out_dtype = autocast_dtype(b->policy, OP_EMBEDDING, DT_FP32, DT_FP32);
    return AMP_OK;
}
