/*
 * attention.c — causal multi-head self-attention and the pre-LN transformer block.
 *
 * attention: x (N, T, C) -> y (N, T, C).
 *   qkv = x Wqkv^T + bqkv         (N, T, 3C)   linear_op "NAME/qkv/weight" (3C, C), "NAME/qkv/bias"
 *   a   = attention core(qkv)     (N, T, C)    backend attention_forward: softmax(Q K^T / sqrt(C/H)),
 *                                              causal, fp32 softmax, probabilities (N, H, T, T) kept; or,
 *                                              where the backend's fused attention serves the shape
 *                                              (cuDNN's flash attention), attention_fused_forward
 *                                              keeping only the softmax statistics (N, H, T) fp32
 *   y   = a Wproj^T + bproj       (N, T, C)    linear_op "NAME/proj/weight" (C, C), "NAME/proj/bias"
 *   The two projections are linear ops, the core an attention_matmul op (lowp under a policy; its
 *   softmax is fp32 inside the backend); y has the proj's dtype.
 *
 * transformer_block (pre-LN, GPT-2): x (N, T, C) -> y (N, T, C).
 *   h1 = ln1(x)                              "NAME/ln1/weight", "NAME/ln1/bias"      fp32 class (stored in
 *                                                                                     qkv's dtype: ln_out_dtype)
 *   r1 = x + attn(h1)                        "NAME/attn/qkv/...", "NAME/attn/proj/..." residual add
 *   h2 = ln2(r1)                             "NAME/ln2/weight", "NAME/ln2/bias"   (the add and ln2 one op:
 *                                                                                  layernorm_op_forward_add;
 *                                                                                  backward the same)
 *   y  = r1 + proj(gelu(fc(h2)))             "NAME/mlp/fc/..." (rC, C), "NAME/mlp/proj/..." (C, rC)
 *   with r = mlp_ratio (default 4) and gelu's `approximate` (tanh by default). The residual adds
 *   promote: x fp32 plus a bf16 branch gives fp32, so the residual stream stays fp32 as in PyTorch
 *   autocast. The block has no dropout (put dropout layers between blocks).
 *   Backward follows autograd: a gradient reaching a tensor of another dtype is cast to it, the two
 *   gradients of r1 (through the add and through ln2) and of x (through the add and through ln1) are summed in
 *   those tensors' dtypes, each inside the layernorm backward that meets it (layernorm_op_backward_add: dy plus
 *   ln2's dx into d_r1, d_r1 plus ln1's dx into dx), no separate add pass.
 *   The add that ends the block, y = r1 + mlp, runs inside the layernorm after it where there is one (the next
 *   block's ln1, a final layernorm layer: block_hand_over_add at setup), which writes y and its own output in one
 *   pass; the block then only keeps the views of r1 and the mlp output for it. Not where fusing is off
 *   (run.numerics_every measures each layer's own output) or under run.recompute block (r1 and the mlp output live
 *   in the shared workspace, which the next layer's forward reuses): the block adds.
 *   Gradients on their way through the block live in the model's shared workspace (layers.h).
 *
 * run.recompute (llm.c's -r, Megatron's selective recomputation) keeps activations in the model's shared workspace
 * instead of the layer, and backward computes them again with the same ops on the same inputs, so every result is
 * the same bits: `attention` the probabilities (N, H, T, T) (attention layers too), `gelu` the block's GELU output
 * (N, T, rC), by the fc product and its epilogue again, `block` all of a block's activations, by its whole forward
 * again (only the block's input and output stay). The workspace grows by one layer's share; the layers shrink.
 * A fused attention core keeps no probabilities, only its statistics (N*H*T floats, in the layer): `attention` has
 * nothing to recompute there and runs nothing again; `block` runs the fused forward again with the rest.
 *
 * dim 0 means "the input's last dimension"; a given dim must equal it, and be divisible by heads.
 * The attention proj and the block's mlp proj are residual projections: gpt2 init scales them by
 * 1/sqrt(2 * number of attention / transformer_block layers).
 */
#include <stdlib.h>
#include <string.h>

#include "backend.h" /* backend_attention_fused: which tensor the attention core keeps */
#include "layers.h" /* struct linear_op, struct layernorm_op, struct attention_core, views, scratch */

/* ---- the attention core -------------------------------------------------------------------------- */

enum amp_status attention_core_setup(struct attention_core *op, struct layer *l, struct layer_build *b,
                                     int64_t T, int64_t C, int64_t H, enum dtype in_dtype, int64_t max_B,
                                     bool recompute)
{
    op->T = T;
    op->C = C;
    op->H = H;
    op->in_dtype = in_dtype;
    op->d = autocast_dtype(b->policy, OP_ATTENTION_MATMUL, in_dtype, in_dtype);
    op->workspace = b->workspace;
    op->fused = backend_attention_fused(b->be, max_B, T, C, H, op->d);
    op->recompute = recompute && !op->fused;
    enum amp_status st = AMP_OK;
    if (op->fused)
        st = layer_alloc(l, b, &op->stats, DT_FP32, 3, (int64_t[]){max_B, H, T}, "attention softmax statistics");
    else if (op->recompute)
        op->probs_off = scratch_reserve(b, op->d, (size_t)(max_B * H * T * T));
    else
        st = layer_alloc(l, b, &op->probs, op->d, 4, (int64_t[]){max_B, H, T, T}, "attention probs");
    if (st != AMP_OK || op->d == in_dtype)
        return st;
    int64_t shape[3] = {max_B, T, 3 * C};
    st = layer_alloc(l, b, &op->qkvc, op->d, 3, shape, "qkv cast");
    op->dqkvc_off = scratch_reserve(b, op->d, (size_t)(max_B * T * 3 * C));
    return st;
}

/* The probabilities of a batch of B: the core's own, or its share of the workspace. */
static struct tensor core_probs(const struct attention_core *op, int64_t B)
{
    if (!op->recompute)
        return batch_view(&op->probs, B);
    return scratch_view(op->workspace, op->probs_off, op->d, 4, (int64_t[]){B, op->H, op->T, op->T});
}

void attention_core_forward(struct backend *be, struct attention_core *op, struct tensor *out,
                            const struct tensor *qkv, int64_t B)
{
    struct tensor qkvc;
    const struct tensor *in = qkv;
    if (op->qkvc.data) {
        qkvc = batch_view(&op->qkvc, B);
        be->convert(be, &qkvc, qkv);
        in = &qkvc;
    }
    if (op->fused) {
        struct tensor stats = batch_view(&op->stats, B);
        be->attention_fused_forward(be, out, &stats, in, B, op->T, op->C, op->H);
        return;
    }
    struct tensor probs = core_probs(op, B);
    be->attention_forward(be, out, &probs, in, B, op->T, op->C, op->H);
}

/* The backend's backward of the core on qkv (in d), into dqkv (in d). */
static void core_backward_in_d(struct backend *be, const struct attention_core *op, struct tensor *dqkv,
                               const struct tensor *dout, const struct tensor *qkv, const struct tensor *out,
                               int64_t B)
{
    if (op->fused) {
        struct tensor stats = batch_view(&op->stats, B);
        be->attention_fused_backward(be, dqkv, dout, qkv, out, &stats, B, op->T, op->C, op->H);
        return;
    }
    struct tensor probs = core_probs(op, B);
    be->attention_backward(be, dqkv, dout, qkv, &probs, B, op->T, op->C, op->H);
}

void attention_core_backward(struct backend *be, struct attention_core *op, struct tensor *dqkv,
                             const struct tensor *dout, const struct tensor *qkv, const struct tensor *out, int64_t B)
{
    if (!op->qkvc.data) {
        core_backward_in_d(be, op, dqkv, dout, qkv, out, B);
        return;
    }
    struct tensor qkvc = batch_view(&op->qkvc, B);
    struct tensor dqkvc = scratch_view(op->workspace, op->dqkvc_off, op->d, 3, (int64_t[]){B, op->T, 3 * op->C});
    core_backward_in_d(be, op, &dqkvc, dout, &qkvc, out, B);
    be->convert(be, dqkv, &dqkvc);
}

enum amp_status attention_core_cache_alloc(struct attention_core *op, struct backend *be, struct amp_error *err)
{
    if (op->kv.data)
        return AMP_OK;
    return tensor_alloc(&op->kv, be, op->d, 4, (int64_t[]){2, op->H, op->T, op->C / op->H}, "key/value cache", err);
}

void attention_core_decode(struct backend *be, struct attention_core *op, struct tensor *out,
                           const struct tensor *qkv, const struct decode_step *d)
{
    struct tensor qkvc;
    const struct tensor *in = qkv;
    if (op->qkvc.data) {
        qkvc = seq_view(&op->qkvc, d->n);
        be->convert(be, &qkvc, qkv);
        in = &qkvc;
    }
    be->attention_decode(be, out, &op->kv, in, d->pos, d->n, op->C, op->H);
}

void attention_core_free(struct attention_core *op)
{
    tensor_free(&op->kv);
    tensor_free(&op->qkvc);
    tensor_free(&op->probs);
    tensor_free(&op->stats);
}

/* ---- shared checks ------------------------------------------------------------------------------- */

/* The model width and heads of an attention or transformer_block layer from its input (N, T, C). */
static enum amp_status attention_dims(struct layer *l, struct layer_build *b, int64_t *C, int64_t *H)
{
    char got[96];
    if (b->in_tokens || b->in_ndim != 3)
        return layer_fail(l, b, "put an embedding layer first: attention works on (N, T, C) sequences",
                          "expects input of shape (N, T, C), got %s from %s",
                          shape_str_n(got, sizeof got, b->in_ndim, b->in_shape), b->in_from);
    int64_t in_c = b->in_shape[2];
    *C = l->cfg.dim > 0 ? l->cfg.dim : in_c;
    *H = l->cfg.heads;
    if (*C != in_c)
        return layer_fail(l, b, "leave dim at 0 to take the input's width, or make it match",
                          "dim %lld does not match its input %s from %s", (long long)*C,
                          shape_str_n(got, sizeof got, b->in_ndim, b->in_shape), b->in_from);
    if (*H < 1)
        return layer_fail(l, b, "set heads >= 1", "heads must be >= 1, got %lld", (long long)*H);
    if (*C % *H != 0)
        return layer_fail(l, b, "choose heads that divide dim (e.g. dim 128 with 4 heads)",
                          "dim %lld is not divisible by heads %lld", (long long)*C, (long long)*H);
    return AMP_OK;
}

static void copy_shape_out(struct layer *l, const struct layer_build *b, enum dtype dt)
{
    l->ndim_out = 3;
    for (int i = 0; i < 3; i++)
        l->out_shape[i] = b->in_shape[i];
    l->out_dtype = dt;
}

/* ---- the attention layer ------------------------------------------------------------------------- */

struct attention_layer {
    struct linear_op qkv, proj;
    struct attention_core core;
    struct tensor qkv_y;      /* (max N, T, 3C) in qkv.d */
    struct tensor att;        /* (max N, T, C) in core.d */
    size_t dqkv_off, datt_off;/* scratch: gradients of qkv_y and att */
    const struct tensor *workspace;
};

static void attention_forward(struct layer *l, const struct step_ctx *ctx, const struct tensor *x,
                              const struct batch *b)
{
    (void)b;
    struct attention_layer *p = l->priv;
    struct backend *be = ctx->be;
    int64_t B = x->shape[0], rows = B * p->core.T;
    struct tensor qkv = batch_view(&p->qkv_y, B), att = batch_view(&p->att, B);
    l->y = batch_view(&l->y, B);
    linear_op_forward(ctx, &p->qkv, &qkv, x, rows);
    attention_core_forward(be, &p->core, &att, &qkv, B);
    linear_op_forward(ctx, &p->proj, &l->y, &att, rows);
}

static void attention_backward(struct layer *l, const struct step_ctx *ctx, const struct tensor *dy,
                               const struct tensor *x, const struct batch *b)
{
    (void)b;
    struct attention_layer *p = l->priv;
    struct backend *be = ctx->be;
    float beta = ctx->accumulate ? 1.0f : 0.0f;
    int64_t B = x->shape[0], T = p->core.T, C = p->core.C, rows = B * T;
    struct tensor qkv = batch_view(&p->qkv_y, B), att = batch_view(&p->att, B);
    struct tensor datt = scratch_view(p->workspace, p->datt_off, att.dtype, 3, (int64_t[]){B, T, C});
    struct tensor dqkv = scratch_view(p->workspace, p->dqkv_off, qkv.dtype, 3, (int64_t[]){B, T, 3 * C});
    linear_op_backward(ctx, &p->proj, &datt, dy, &att, rows, beta);
    grads_final(ctx, p->proj.w); /* the parameters' order: qkv, proj */
    if (p->core.recompute) /* the probabilities again (att gets the same bits again) */
        attention_core_forward(be, &p->core, &att, &qkv, B);
    attention_core_backward(be, &p->core, &dqkv, &datt, &qkv, &att, B);
    struct tensor *dx = NULL;
    if (l->needs_dx) {
        l->dx = batch_view_like(&l->dx, x);
        dx = &l->dx;
    }
    linear_op_backward(ctx, &p->qkv, dx, &dqkv, x, rows, beta);
}

static void attention_free(struct layer *l)
{
    struct attention_layer *p = l->priv;
    if (!p)
        return;
    linear_op_free(&p->qkv);
    linear_op_free(&p->proj);
    attention_core_free(&p->core);
    tensor_free(&p->qkv_y);
    tensor_free(&p->att);
}

static void attention_decode(struct layer *l, const struct step_ctx *ctx, const struct tensor *x,
                             const struct decode_step *d)
{
    struct attention_layer *p = l->priv;
    struct tensor qkv = seq_view(&p->qkv_y, d->n), att = seq_view(&p->att, d->n);
    l->y = seq_view(&l->y, d->n);
    linear_op_forward(ctx, &p->qkv, &qkv, x, d->n);
    attention_core_decode(ctx->be, &p->core, &att, &qkv, d);
    linear_op_forward(ctx, &p->proj, &l->y, &att, d->n);
}

static enum amp_status attention_cache_alloc(struct layer *l, struct backend *be, struct amp_error *err)
{
    struct attention_layer *p = l->priv;
    return attention_core_cache_alloc(&p->core, be, err);
}

static const struct layer_ops attention_ops = {attention_forward, attention_backward, attention_free,
                                               attention_decode, attention_cache_alloc};

enum amp_status attention_setup(struct layer *l, struct layer_build *b)
{
    int64_t C = 0, H = 1;
    enum amp_status st = attention_dims(l, b, &C, &H);
    if (st != AMP_OK)
        return st;
    struct attention_layer *p = calloc(1, sizeof *p);
    if (!p)
        return amp_fail(b->err, AMP_ERR_INTERNAL, NULL, "out of memory building layer '%s'", l->cfg.name);
    l->priv = p;
    l->ops = &attention_ops;
    l->op = OP_ATTENTION_MATMUL;
    p->workspace = b->workspace;
    int64_t N = b->in_shape[0], T = b->in_shape[1], rows = N * T;

    if ((st = layer_reserve_params(l, b, 4)) != AMP_OK ||
        (st = linear_op_setup(&p->qkv, l, b, "qkv/", C, 3 * C, true, b->in_dtype, rows, PINIT_LINEAR_WEIGHT, NULL)) ||
        (st = layer_alloc(l, b, &p->qkv_y, p->qkv.d, 3, (int64_t[]){N, T, 3 * C}, "qkv")) ||
        (st = attention_core_setup(&p->core, l, b, T, C, H, p->qkv.d, N, b->recompute >= RECOMPUTE_ATTENTION)) ||
        (st = layer_alloc(l, b, &p->att, p->core.d, 3, (int64_t[]){N, T, C}, "attention output")) ||
        (st = linear_op_setup(&p->proj, l, b, "proj/", C, C, true, p->core.d, rows, PINIT_RESIDUAL_WEIGHT, NULL)))
        return st;
    p->datt_off = scratch_reserve(b, p->core.d, (size_t)(rows * C));
    p->dqkv_off = scratch_reserve(b, p->qkv.d, (size_t)(rows * 3 * C));
    copy_shape_out(l, b, p->proj.d);
    return AMP_OK;
}

/* ---- the transformer block ----------------------------------------------------------------------- */

/* A saved activation (max N, T, width): the layer's own tensor, or, where run.recompute computes it again in
 * backward, a share of the workspace at `off` (t then holds only its dtype and shape). */
struct saved {
    struct tensor t;
    size_t off;
    bool scratch;
};

struct block_layer {
    struct layernorm_op ln1, ln2;
    struct linear_op qkv, proj, fc, fc2;
    struct attention_core core;
    enum act_kind act;
    enum recompute recompute;
    /* the activations backward reads, each in its op's dtype */
    struct saved h1, qkv_y, att, proj_y, r1, h2, fc_y, g, fc2_y;
    /* scratch offsets of the gradients, each shaped and typed like the tensor it is the gradient of */
    size_t d_fc2_y, d_g, d_fc_y, d_h2, d_r1, d_proj_y, d_att, d_qkv_y, d_h1, d_ln1x;
    const struct tensor *workspace;
    /* the add that ends the block, handed to the next layer's layernorm (block_hand_over_add): y is written there,
     * from the two inputs of this forward or decode pass, their views kept here (r1 and fc2 of its B) */
    bool add_handed;
    struct tensor out_r1, out_mlp;
    struct layer *add_from; /* the block before, whose last add ln1 runs (NULL: ln1 reads x as it is) */
};

/* The views of one batch of B: every activation the block's forward writes and its backward reads. */
struct block_views {
    struct tensor h1, qkv, att, proj, r1, h2, fc, g, fc2;
};

static struct tensor saved_view(const struct block_layer *p, const struct saved *s, int64_t B)
{
    if (!s->scratch)
        return batch_view(&s->t, B);
    return scratch_view(p->workspace, s->off, s->t.dtype, 3, (int64_t[]){B, s->t.shape[1], s->t.shape[2]});
}

/* The same as one sequence of n positions (1, n, width): generation. */
static struct tensor saved_seq(const struct block_layer *p, const struct saved *s, int64_t n)
{
    if (!s->scratch)
        return seq_view(&s->t, n);
    return scratch_view(p->workspace, s->off, s->t.dtype, 3, (int64_t[]){1, n, s->t.shape[2]});
}

static struct block_views block_views_of(const struct block_layer *p, int64_t B)
{
    return (struct block_views){
        .h1 = saved_view(p, &p->h1, B), .qkv = saved_view(p, &p->qkv_y, B), .att = saved_view(p, &p->att, B),
        .proj = saved_view(p, &p->proj_y, B), .r1 = saved_view(p, &p->r1, B), .h2 = saved_view(p, &p->h2, B),
        .fc = saved_view(p, &p->fc_y, B), .g = saved_view(p, &p->g, B), .fc2 = saved_view(p, &p->fc2_y, B),
    };
}

/* The gradient of `like` (a batch view of a saved activation) in the workspace. */
static struct tensor grad_of(const struct block_layer *p, size_t off, const struct tensor *like)
{
    return scratch_view(p->workspace, off, like->dtype, like->ndim, like->shape);
}

/* `g` as a gradient for tensor `like`: g itself when the dtypes agree, else cast into the scratch at `off`
 * (autograd's backward of an implicit cast). */
static struct tensor grad_cast(struct backend *be, const struct block_layer *p, size_t off, const struct tensor *g,
                               const struct tensor *like)
{
    if (g->dtype == like->dtype)
        return batch_view_like(g, like);
    struct tensor t = grad_of(p, off, like);
    be->convert(be, &t, g);
    return t;
}

/* Everything of the forward but the last residual add, into v: what backward reads. With `d` (generation), x and
 * v are d's positions of one sequence and the attention goes through the cache. `take_add`: x is the block
 * before's y, written here by ln1 with that block's last add (the forward and decode; backward's recompute finds x
 * written). */
static void block_forward_to(const struct step_ctx *ctx, struct block_layer *p, const struct tensor *x, int64_t B,
                             struct block_views *v, const struct decode_step *d, bool take_add)
{
    struct backend *be = ctx->be;
    int64_t rows = d ? d->n : B * p->core.T;
    if (take_add && p->add_from)
        layernorm_op_forward_from(be, &p->ln1, &v->h1, p->add_from, rows);
    else
        layernorm_op_forward(be, &p->ln1, &v->h1, x, rows);
    linear_op_forward(ctx, &p->qkv, &v->qkv, &v->h1, rows);
    if (d)
        attention_core_decode(be, &p->core, &v->att, &v->qkv, d);
    else
        attention_core_forward(be, &p->core, &v->att, &v->qkv, B);
    linear_op_forward(ctx, &p->proj, &v->proj, &v->att, rows);
    layernorm_op_forward_add(be, &p->ln2, &v->h2, &v->r1, x, &v->proj, rows); /* r1 = x + proj, h2 = ln2(r1) */
    linear_op_forward_act(ctx, &p->fc, p->act, &v->g, &v->fc, &v->h2, rows);
    linear_op_forward(ctx, &p->fc2, &v->fc2, &v->g, rows);
}

/* y = r1 + fc2: here, or, handed over, by the next layer's layernorm, which reads the two views kept for it. */
static void block_add_out(struct backend *be, struct block_layer *p, struct layer *l, const struct block_views *v)
{
    if (p->add_handed) {
        p->out_r1 = v->r1;
        p->out_mlp = v->fc2;
        return;
    }
    be->add(be, &l->y, &v->r1, &v->fc2);
}

static void block_forward(struct layer *l, const struct step_ctx *ctx, const struct tensor *x,
                          const struct batch *b)
{
    (void)b;
    struct block_layer *p = l->priv;
    int64_t B = x->shape[0];
    struct block_views v = block_views_of(p, B);
    l->y = batch_view(&l->y, B);
    block_forward_to(ctx, p, x, B, &v, NULL, true);
    block_add_out(ctx->be, p, l, &v);
}

static void block_decode(struct layer *l, const struct step_ctx *ctx, const struct tensor *x,
                         const struct decode_step *d)
{
    struct block_layer *p = l->priv;
    struct block_views v = {
        .h1 = saved_seq(p, &p->h1, d->n), .qkv = saved_seq(p, &p->qkv_y, d->n), .att = saved_seq(p, &p->att, d->n),
        .proj = saved_seq(p, &p->proj_y, d->n), .r1 = saved_seq(p, &p->r1, d->n), .h2 = saved_seq(p, &p->h2, d->n),
        .fc = saved_seq(p, &p->fc_y, d->n), .g = saved_seq(p, &p->g, d->n), .fc2 = saved_seq(p, &p->fc2_y, d->n),
    };
    l->y = seq_view(&l->y, d->n);
    block_forward_to(ctx, p, x, 1, &v, d, true);
    block_add_out(ctx->be, p, l, &v);
}

static enum amp_status block_cache_alloc(struct layer *l, struct backend *be, struct amp_error *err)
{
    struct block_layer *p = l->priv;
    return attention_core_cache_alloc(&p->core, be, err);
}

/* run.recompute: what the forward did not keep, computed again by the same ops from the same inputs. */
static void block_recompute(const struct step_ctx *ctx, struct block_layer *p, const struct tensor *x, int64_t B,
                            struct block_views *v)
{
    if (p->recompute == RECOMPUTE_BLOCK)
        block_forward_to(ctx, p, x, B, v, NULL, false);
    else if (p->recompute == RECOMPUTE_ATTENTION && p->core.recompute) /* a fused core kept its statistics */
        attention_core_forward(ctx->be, &p->core, &v->att, &v->qkv, B);
    else if (p->recompute == RECOMPUTE_GELU)
        linear_op_forward_act(ctx, &p->fc, p->act, &v->g, &v->fc, &v->h2, B * p->core.T);
}

static void block_backward(struct layer *l, const struct step_ctx *ctx, const struct tensor *dy,
                           const struct tensor *x, const struct batch *b)
{
    (void)b;
    struct block_layer *p = l->priv;
    struct backend *be = ctx->be;
    float beta = ctx->accumulate ? 1.0f : 0.0f;
    int64_t B = x->shape[0], rows = B * p->core.T;
    struct block_views v = block_views_of(p, B);
    block_recompute(ctx, p, x, B, &v);

    /* y = r1 + fc2(gelu(fc(ln2(r1)))) */
    struct tensor d_fc2 = grad_cast(be, p, p->d_fc2_y, dy, &v.fc2);
    struct tensor d_g = grad_of(p, p->d_g, &v.g);
    linear_op_backward(ctx, &p->fc2, &d_g, &d_fc2, &v.g, rows, beta);
    grads_final(ctx, p->fc2.w); /* the parameters' order: ln1, qkv, proj, ln2, fc, fc2 */
    struct tensor d_fc = grad_of(p, p->d_fc_y, &v.fc);
    be->act_backward(be, p->act, &d_fc, &d_g, &v.fc);
    struct tensor d_h2 = grad_of(p, p->d_h2, &v.h2);
    linear_op_backward(ctx, &p->fc, &d_h2, &d_fc, &v.h2, rows, beta);
    grads_final(ctx, p->fc.w);
    count_grad_zeros(ctx, &d_fc2, false);
    count_grad_zeros(ctx, &d_g, false);
    count_grad_zeros(ctx, &d_fc, false);
    count_grad_zeros(ctx, &d_h2, p->fc.d != DT_FP32);
    struct tensor d_r1 = grad_of(p, p->d_r1, &v.r1); /* dy through the residual plus ln2's dx, in one pass */
    layernorm_op_backward_add(be, &p->ln2, &d_r1, &d_h2, &v.r1, dy, rows, beta);
    grads_final(ctx, p->ln2.gain);

    /* r1 = x + proj(attn(qkv(ln1(x)))) */
    struct tensor d_proj = grad_cast(be, p, p->d_proj_y, &d_r1, &v.proj);
    struct tensor d_att = grad_of(p, p->d_att, &v.att);
    linear_op_backward(ctx, &p->proj, &d_att, &d_proj, &v.att, rows, beta);
    grads_final(ctx, p->proj.w);
    struct tensor d_qkv = grad_of(p, p->d_qkv_y, &v.qkv);
    attention_core_backward(be, &p->core, &d_qkv, &d_att, &v.qkv, &v.att, B);
    struct tensor d_h1 = grad_of(p, p->d_h1, &v.h1);
    linear_op_backward(ctx, &p->qkv, &d_h1, &d_qkv, &v.h1, rows, beta);
    grads_final(ctx, p->qkv.w);
    count_grad_zeros(ctx, &d_proj, false);
    count_grad_zeros(ctx, &d_att, false);
    count_grad_zeros(ctx, &d_qkv, false);
    count_grad_zeros(ctx, &d_h1, p->qkv.d != DT_FP32);
    if (l->needs_dx) { /* dx = d_r1 through the residual plus ln1's dx, in one pass */
        l->dx = batch_view_like(&l->dx, x);
        layernorm_op_backward_add(be, &p->ln1, &l->dx, &d_h1, x, &d_r1, rows, beta);
    } else { /* ln1's parameter gradients still count; its dx, nobody's input gradient, goes to scratch */
        struct tensor d_ln1x = grad_of(p, p->d_ln1x, x);
        layernorm_op_backward(be, &p->ln1, &d_ln1x, &d_h1, x, rows, beta);
    }
}

static void block_free(struct layer *l)
{
    struct block_layer *p = l->priv;
    if (!p)
        return;
    layernorm_op_free(&p->ln1);
    layernorm_op_free(&p->ln2);
    linear_op_free(&p->qkv);
    linear_op_free(&p->proj);
    linear_op_free(&p->fc);
    linear_op_free(&p->fc2);
    attention_core_free(&p->core);
    struct saved *saved[] = {&p->h1, &p->qkv_y, &p->att, &p->proj_y, &p->r1, &p->h2, &p->fc_y, &p->g, &p->fc2_y};
    for (size_t i = 0; i < sizeof saved / sizeof *saved; i++)
        tensor_free(&saved[i]->t);
}

static const struct layer_ops block_ops = {block_forward, block_backward, block_free, block_decode, block_cache_alloc};

struct layer *block_hand_over_add(struct layer_build *b)
{
    if (!b->fuse || b->nbuilt < 1)
        return NULL;
    struct layer *prev = &b->built[b->nbuilt - 1];
    if (prev->ops != &block_ops)
        return NULL;
    struct block_layer *p = prev->priv;
    if (p->r1.scratch || p->fc2_y.scratch)
        return NULL;
    p->add_handed = true;
    return prev;
}

void layernorm_op_forward_from(struct backend *be, struct layernorm_op *op, struct tensor *y, struct layer *from,
                               int64_t rows)
{
    struct block_layer *f = from->priv;
    layernorm_op_forward_add(be, op, y, &from->y, &f->out_r1, &f->out_mlp, rows);
}

/* Set up saved activation `s` (N, T, width): the layer's own tensor, or, when `recomputed`, a share of the workspace;
 * and reserve the scratch for its gradient. */
static enum amp_status block_tensor(struct layer *l, struct layer_build *b, struct saved *s, bool recomputed,
                                    size_t *grad_off, enum dtype dt, int64_t width, const char *what)
{
    int64_t shape[3] = {b->in_shape[0], b->in_shape[1], width};
    enum amp_status st = AMP_OK;
    s->scratch = recomputed;
    if (recomputed) {
        s->t = (struct tensor){.dtype = dt, .ndim = 3, .shape = {shape[0], shape[1], shape[2]},
                               .numel = (size_t)(shape[0] * shape[1] * shape[2])};
        s->off = scratch_reserve(b, dt, s->t.numel);
    } else {
        st = layer_alloc(l, b, &s->t, dt, 3, shape, what);
    }
    if (st == AMP_OK && grad_off)
        *grad_off = scratch_reserve(b, dt, s->t.numel);
    return st;
}

/* The dtype ln1's (ln2's) output is stored in. Its only reader is qkv (fc), which under autocast rounds its input to
 * its compute dtype before anything else: the layernorm stores it rounded to that dtype instead (the same bits, from
 * its fp32 values, without a conversion pass or an fp32 tensor; backward, the linear's dx reaches the layernorm in
 * that dtype, widened exactly as the cast's backward would). Not for an fp8 linear, which casts the fp32 values
 * themselves (and takes their amax). `ln_dt`: the layernorm's autocast dtype. */
static enum dtype ln_out_dtype(const struct layer_build *b, enum dtype ln_dt)
{
    enum dtype linear_dt = autocast_dtype(b->policy, OP_LINEAR, ln_dt, ln_dt);
    return b->fp8_layer && linear_dt != DT_FP32 ? ln_dt : linear_dt;
}

enum amp_status transformer_block_setup(struct layer *l, struct layer_build *b)
{
    int64_t C = 0, H = 1;
    enum amp_status st = attention_dims(l, b, &C, &H);
    if (st != AMP_OK)
        return st;
    int64_t ratio = l->cfg.mlp_ratio > 0 ? l->cfg.mlp_ratio : 4;
    if (!(l->cfg.eps > 0))
        return layer_fail(l, b, "use eps > 0 (default 1e-5)", "eps must be > 0, got %g", l->cfg.eps);
    struct block_layer *p = calloc(1, sizeof *p);
    if (!p)
        return amp_fail(b->err, AMP_ERR_INTERNAL, NULL, "out of memory building layer '%s'", l->cfg.name);
    l->priv = p;
    l->ops = &block_ops;
    l->op = OP_LINEAR;
    p->workspace = b->workspace;
    p->act = l->cfg.approximate == GELU_ERF ? ACT_GELU_ERF : ACT_GELU_TANH;
    p->recompute = b->recompute;
    bool all = p->recompute == RECOMPUTE_BLOCK; /* every activation the block saves lives in the workspace */
    const struct autocast_policy *pol = b->policy;
    int64_t N = b->in_shape[0], T = b->in_shape[1], rows = N * T, hidden = ratio * C;
    float eps = (float)l->cfg.eps;
    enum dtype x_dt = b->in_dtype;
    p->add_from = block_hand_over_add(b);

    if ((st = layer_reserve_params(l, b, 12)) != AMP_OK)
        return st;
    /* attention half */
    enum dtype h1_dt = ln_out_dtype(b, autocast_dtype(pol, OP_LAYERNORM, x_dt, x_dt));
    if ((st = layernorm_op_setup(&p->ln1, l, b, "ln1/", C, eps, rows)) ||
        (st = block_tensor(l, b, &p->h1, all, &p->d_h1, h1_dt, C, "ln1 output")) ||
        (st = linear_op_setup(&p->qkv, l, b, "attn/qkv/", C, 3 * C, true, h1_dt, rows, PINIT_LINEAR_WEIGHT, NULL)) ||
        (st = block_tensor(l, b, &p->qkv_y, all, &p->d_qkv_y, p->qkv.d, 3 * C, "qkv")) ||
        (st = attention_core_setup(&p->core, l, b, T, C, H, p->qkv.d, N, p->recompute >= RECOMPUTE_ATTENTION)) ||
        (st = block_tensor(l, b, &p->att, all, &p->d_att, p->core.d, C, "attention output")) ||
        (st = linear_op_setup(&p->proj, l, b, "attn/proj/", C, C, true, p->core.d, rows, PINIT_RESIDUAL_WEIGHT, NULL)) ||
        (st = block_tensor(l, b, &p->proj_y, all, &p->d_proj_y, p->proj.d, C, "attention proj")))
        return st;
    enum dtype r1_dt = autocast_dtype(pol, OP_RESIDUAL_ADD, x_dt, p->proj.d);
    if ((st = block_tensor(l, b, &p->r1, all, &p->d_r1, r1_dt, C, "first residual")))
        return st;
    if (!l->needs_dx)
        p->d_ln1x = scratch_reserve(b, x_dt, (size_t)(rows * C));
    /* mlp half */
    enum dtype h2_dt = ln_out_dtype(b, autocast_dtype(pol, OP_LAYERNORM, r1_dt, r1_dt));
    if ((st = layernorm_op_setup(&p->ln2, l, b, "ln2/", C, eps, rows)) ||
        (st = block_tensor(l, b, &p->h2, all, &p->d_h2, h2_dt, C, "ln2 output")) ||
        (st = linear_op_setup(&p->fc, l, b, "mlp/fc/", C, hidden, true, h2_dt, rows, PINIT_LINEAR_WEIGHT, NULL)) ||
        (st = block_tensor(l, b, &p->fc_y, all, &p->d_fc_y, p->fc.d, hidden, "mlp fc")))
        return st;
    enum dtype g_dt = autocast_dtype(pol, OP_GELU, p->fc.d, p->fc.d);
    if ((st = block_tensor(l, b, &p->g, all || p->recompute == RECOMPUTE_GELU, &p->d_g, g_dt, hidden, "mlp gelu")) ||
        (st = linear_op_setup(&p->fc2, l, b, "mlp/proj/", hidden, C, true, g_dt, rows, PINIT_RESIDUAL_WEIGHT, NULL)) ||
        (st = block_tensor(l, b, &p->fc2_y, all, &p->d_fc2_y, p->fc2.d, C, "mlp proj")))
        return st;
    copy_shape_out(l, b, autocast_dtype(pol, OP_RESIDUAL_ADD, r1_dt, p->fc2.d));
    return AMP_OK;
}
