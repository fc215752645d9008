/*
 * linear.c — the linear layer, y = x W^T + b over the last dimension, and the linear_op building
 * block it shares with attention and transformer blocks (layers.h).
 *
 * Shapes: x (N, D) or (N, T, D) -> y (N, out) or (N, T, out); the GEMM sees rows = N or N*T.
 * Parameters: "NAME/weight" (out, D) fp32, "NAME/bias" (out) fp32 unless bias: false.
 * Dtype: the op runs in d = autocast(linear, x's dtype) — bf16/fp16 under an enabled policy, fp32
 * otherwise or with `fp32_ops: [linear]`. The input is cast to d into a saved copy when it is not d
 * already (PyTorch autocast casts it the same way and autograd keeps the cast tensor), the weight is
 * the parameter's copy in d (made once per optimizer step by model_refresh_copies) or the master where it
 * is d already, products accumulate in fp32, the fp32 bias is added before the one rounding to d.
 * Backward (dy in d): dW = dy^T x_d and db = colsum(dy) in fp32, overwriting or accumulating
 * (ctx->accumulate); dx = dy W computed and rounded in d, then cast to x's dtype when that differs.
 * Nothing is computed for dx when the layer is the first one.
 * fp8 (precision.mode fp8, the layer not kept in bf16, the product not smaller than precision.fp8.min_size, which
 * leaves it in bf16 as above; lib/base/fp8.h): the forward casts x and the fp32 master weight
 * to E4M3 with their scales (x's cast is saved for dW, the weight's for dx; the weight is cast on a step's first
 * micro-batch only, its codes kept for the others: lib/base/fp8.h, struct fp8_pass), the product of the codes sums in
 * fp32 and gives y in d (bf16) with the fp32 bias; backward casts dy to E5M2 and forms dW = dy8^T x8 (fp32) and
 * dx = dy8 W8 (d); db is the column sum of dy itself, as Transformer Engine computes it. In training (recipes
 * delayed and current) the casts of x, W and dy also write their codes transposed, in the same pass, for the
 * products that read them the other way round (gemm_args a_t, b_t: a GPU's fp8 kernels take one layout); the CPU
 * makes them too and reads the operands as stored.
 * Recipe blockwise: every cast is E4M3 with one scale per tile along its product's K (lib/base/fp8.h): the forward
 * casts x in 1x128 tiles along its rows (x8, for y) and in 128x1 tiles down its columns (x8t, kept for dW, whose K
 * is the rows), the weight in 128x128 blocks (w8, for y and dx alike); backward casts dy both ways, 1x128 for dx
 * and 128x1 for dW. The products take the tile scales (backend.h, gemm_args a_blocks, b_blocks).
 * The token head (the linear layer before a cross_entropy on text) pads its out, the vocabulary V, to Vp, a
 * multiple of the backend's vocab_align, outside fp8 and the numerics report: the product's N and the logits'
 * last dimension are Vp; the weight, bias and their gradients are the logical (V, ...) tensors, a prefix of
 * storage whose rows past V stay zero (docs/model.md, "Vocabulary padding").
 *
 * `tie: LAYER/wte` (GPT-2's lm_head): the layer has no weight of its own and reads an earlier embedding's
 * table (vocab, C) as its (out, in) weight. The table stays one parameter (one master, one gradient, one
 * optimizer state, stored once in checkpoints, under the embedding's name); it gets a copy in this op's
 * dtype where the embedding reads another (param_value_as), and weight decay as a linear weight has it
 * (nanoGPT and Hugging Face decay the tied matrix). This layer's backward runs before the embedding's, so
 * it writes the gradient with the micro-batch's beta and the embedding adds its part (param.tied); with
 * accum_steps > 1 the micro-batch's two parts meet in param.tied_grad first, and their sum is added to the
 * gradient, so that one rank accumulating gives the bits of ranks whose sums an all-reduce adds.
 */
#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "layers.h" /* struct linear_op, struct layer_build, views, layer_fail */

/* ---- the building block ------------------------------------------------------------------------ */

/* Register one of the op's fp8 tensors: "LAYER/PREFIXinput", ".../weight", ".../grad_output". */
static enum amp_status fp8_slot(struct layer *l, struct layer_build *b, const char *prefix, const char *what,
                                bool backward, struct fp8_slot *out)
{
    char name[160];
    snprintf(name, sizeof name, "%s/%s%s", l->cfg.name, prefix, what);
    return fp8_add_slot(b->fp8, backward, name, out, b->err);
}

/* Recipe blockwise's buffers besides x8 and w8: x8t and the scales of x8, x8t and w8; dy's casts in scratch. */
static enum amp_status blockwise_setup(struct linear_op *op, struct layer *l, struct layer_build *b,
                                       const char *prefix, int64_t max_rows)
{
    char name[96];
    const int64_t in = op->in, out = op->out;
    struct { struct tensor *t; const char *what; enum dtype dt; int64_t rows, cols; } bufs[] = {
        {&op->x8t, "input cast to e4m3 down its columns", DT_FP8_E4M3, max_rows, in},
        {&op->xs, "input's tile scales", DT_FP32, max_rows, fp8_tiles(in)},
        {&op->xts, "input's column tile scales", DT_FP32, fp8_tiles(max_rows), in},
        {&op->ws, "weight's block scales", DT_FP32, fp8_tiles(out), fp8_tiles(in)},
    };
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
        snprintf(name, sizeof name, "%s%s", prefix, bufs[i].what);
        enum amp_status st = layer_alloc(l, b, bufs[i].t, bufs[i].dt, 2, (int64_t[]){bufs[i].rows, bufs[i].cols}, name);
        if (st != AMP_OK)
            return st;
    }
    op->dy8t_off = scratch_reserve(b, DT_FP8_E4M3, (size_t)(max_rows * out));
    op->dys_off = scratch_reserve(b, DT_FP32, (size_t)(max_rows * fp8_tiles(out)));
    op->dyts_off = scratch_reserve(b, DT_FP32, (size_t)(fp8_tiles(max_rows) * out));
    return AMP_OK;
}

/* Recipes delayed and current: the transposed codes of w8 and x8 (kept) and of dy8 (scratch). */
static enum amp_status transposed_setup(struct linear_op *op, struct layer *l, struct layer_build *b,
                                        const char *prefix, int64_t max_rows)
{
    char name[96];
    snprintf(name, sizeof name, "%sweight cast to e4m3, transposed", prefix);
    enum amp_status st = layer_alloc(l, b, &op->w8_tr, DT_FP8_E4M3, 2, (int64_t[]){op->in, op->out}, name);
    if (st != AMP_OK)
        return st;
    snprintf(name, sizeof name, "%sinput cast to e4m3, transposed", prefix);
    st = layer_alloc(l, b, &op->x8_tr, DT_FP8_E4M3, 2, (int64_t[]){op->in, max_rows}, name);
    if (st != AMP_OK)
        return st;
    op->dy8_tr_off = scratch_reserve(b, DT_FP8_E5M2, (size_t)(max_rows * op->out));
    return AMP_OK;
}

enum amp_status linear_op_setup(struct linear_op *op, struct layer *l, struct layer_build *b, const char *prefix,
                                int64_t in, int64_t out, bool bias, enum dtype in_dtype, int64_t max_rows,
                                enum param_init weight_init, struct param *shared)
{
    char name[96];
    op->in = in;
    op->out = out;
    op->in_dtype = in_dtype;
    op->d = autocast_dtype(b->policy, OP_LINEAR, in_dtype, in_dtype);
    op->workspace = b->workspace;
    /* a layer in fp8 runs a product in fp8 where it is large enough (precision.fp8.min_size), else in bf16 */
    bool may_fp8 = b->fp8_layer && op->d != DT_FP32;
    op->fp8 = may_fp8 && fp8_state_large(b->fp8, in, out);
    op->fp8_state = b->fp8;
    if (may_fp8) {
        char product[160];
        snprintf(product, sizeof product, "%s%s%s", l->cfg.name, prefix[0] ? "/" : "", prefix);
        if (prefix[0]) /* "block0/attn/qkv/": no trailing slash */
            product[strlen(product) - 1] = '\0';
        enum amp_status st = fp8_add_product(b->fp8, product, in, out, op->fp8, b->err);
        if (st != AMP_OK)
            return st;
    }

    int64_t wshape[2] = {out, in};
    snprintf(name, sizeof name, "%sweight", prefix);
    /* an fp8 op casts the (fp32) master itself each pass: it needs no 16-bit copy */
    enum dtype read_as = op->fp8 ? b->master_dtype : op->d;
    if (shared) {
        op->w = shared;
        shared->tied = true;
        shared->decay = true;
        if (shared->master.dtype != read_as && !shared->copy.data &&
            tensor_alloc(&shared->copy, b->be, read_as, 2, wshape, shared->name, b->err) != AMP_OK)
            return b->err->code;
        if (shared->master.dtype != read_as && shared->copy.dtype != read_as)
            return layer_fail(l, b, "use precision.master_weights: fp32, or leave out the tie",
                              "tie: %s is read in %s by its own layer and would be read in %s here; a tied weight "
                              "is kept in at most two dtypes (its master's and one other)",
                              shared->name, dtype_name(shared->copy.dtype), dtype_name(read_as));
        if (b->accumulates && !shared->tied_grad.data &&
            tensor_zeros(&shared->tied_grad, b->be, DT_FP32, 2, wshape, shared->name, b->err) != AMP_OK)
            return b->err->code;
    } else {
        op->w = layer_add_param(l, b, name, 2, wshape, weight_init, in, true, read_as);
    }
    if (!op->w)
        return b->err->code;
    if (bias) {
        snprintf(name, sizeof name, "%sbias", prefix);
        op->b = layer_add_param(l, b, name, 1, &out, PINIT_LINEAR_BIAS, in, false, DT_FP32);
        if (!op->b)
            return b->err->code;
    }
    enum amp_status st = AMP_OK;
    if (op->fp8) {
        int64_t xshape[2] = {max_rows, in};
        snprintf(name, sizeof name, "%sinput cast to e4m3", prefix);
        if ((st = fp8_slot(l, b, prefix, "input", false, &op->sx)) != AMP_OK ||
            (st = fp8_slot(l, b, prefix, "weight", false, &op->sw)) != AMP_OK ||
            (st = fp8_slot(l, b, prefix, "grad_output", true, &op->sdy)) != AMP_OK ||
            (st = layer_alloc(l, b, &op->x8, DT_FP8_E4M3, 2, xshape, name)) != AMP_OK)
            return st;
        snprintf(name, sizeof name, "%sweight cast to e4m3", prefix);
        if ((st = layer_alloc(l, b, &op->w8, DT_FP8_E4M3, 2, wshape, name)) != AMP_OK)
            return st;
        op->blockwise = b->fp8->recipe == FP8_BLOCKWISE;
        op->dy8_off = scratch_reserve(b, op->blockwise ? DT_FP8_E4M3 : DT_FP8_E5M2, (size_t)(max_rows * out));
        if (op->blockwise && (st = blockwise_setup(op, l, b, prefix, max_rows)) != AMP_OK)
            return st;
        if (!op->blockwise && (st = transposed_setup(op, l, b, prefix, max_rows)) != AMP_OK)
            return st;
    } else if (in_dtype != op->d) {
        int64_t xshape[2] = {max_rows, in};
        snprintf(name, sizeof name, "%sinput cast to %s", prefix, dtype_name(op->d));
        st = layer_alloc(l, b, &op->xc, op->d, 2, xshape, name);
        if (st != AMP_OK)
            return st;
    }
    if (in_dtype != op->d)
        op->dxc_off = scratch_reserve(b, op->d, (size_t)(max_rows * in));
    return AMP_OK;
}

static struct tensor linear_op_weight(const struct linear_op *op)
{
    /* the copy made once per optimizer step, or master; an fp8 op casts the master itself. A padded head's is
     * (Vp, in), its rows past the vocabulary zero. */
    return param_stored(op->w, param_value_as(op->w, op->fp8 ? op->w->master.dtype : op->d));
}

/* Cast `src` to the fp8 tensor `dst` with slot s's scale (lib/base/fp8.h): the recipe current computes the scale
 * now; delayed uses it as it is and records src's amax in this pass's pending amaxes (training only; fp8_step_end
 * files them into the history). With dst_t, src is a (rows, cols) matrix and dst_t (cols, rows) gets the codes
 * transposed in the same pass. */
static void fp8_cast_to(const struct step_ctx *ctx, const struct fp8_state *st, struct tensor *dst,
                        const struct tensor *src, const struct fp8_slot *s, struct tensor *dst_t, int64_t rows,
                        int64_t cols)
{
    const struct fp8_pass *pass = ctx->fp8;
    bool bwd = s->g->dt == DT_FP8_E5M2;
    float *row = !pass ? NULL : bwd ? pass->amax_bwd : pass->amax_fwd;
    int64_t *counts = !pass ? NULL : bwd ? pass->counts_bwd : pass->counts_fwd;
    struct fp8_cast_args a = {
        .dst = dst, .src = src, .scale = s->g->scale + s->index, .scale_inv = s->g->scale_inv + s->index,
        .amax = row ? row + s->index : NULL, .current = st->recipe == FP8_CURRENT, .margin = st->margin,
        .counts = counts ? counts + 4 * s->index : NULL, .dst_t = dst_t, .rows = rows, .cols = cols,
    };
    dst->scale_inv = a.scale_inv;
    if (dst_t)
        dst_t->scale_inv = a.scale_inv;
    ctx->be->fp8_cast(ctx->be, &a);
}

/* Recipe blockwise's cast of src (rows, cols) to dst in `tiling`, its scales into scale_inv (fp32 backend memory),
 * counted in this pass's numerics counters of slot s unless s is NULL (x and dy are counted at one of their two
 * casts). Returns the scales, for a product. */
static struct fp8_blocks fp8_block_cast_to(const struct step_ctx *ctx, const struct fp8_state *st, struct tensor *dst,
                                           const struct tensor *src, int64_t rows, int64_t cols,
                                           enum fp8_tiling tiling, float *scale_inv, const struct fp8_slot *s)
{
    const struct fp8_pass *pass = ctx->fp8;
    int64_t *counts = !pass || !s ? NULL : s->g == &st->bwd ? pass->counts_bwd : pass->counts_fwd;
    struct fp8_block_cast_args a = { .dst = dst, .src = src, .rows = rows, .cols = cols, .tiling = tiling,
                                     .scale_inv = scale_inv, .counts = counts ? counts + 4 * s->index : NULL };
    ctx->be->fp8_block_cast(ctx->be, &a);
    return (struct fp8_blocks){ .scale_inv = scale_inv, .tiling = tiling };
}

/* y = x W^T + b, or with the GELU epilogue y = gelu(pre), pre = x W^T + b (pre NULL: none). */
static void linear_op_gemm(const struct step_ctx *ctx, struct linear_op *op, struct tensor *y, struct tensor *pre,
                           const struct tensor *x, int64_t rows)
{
    struct backend *be = ctx->be;
    struct tensor x2 = matrix_view(x, rows, op->in);
    struct tensor y2 = matrix_view(y, rows, op->out);
    struct tensor pre2 = pre ? matrix_view(pre, rows, op->out) : y2;
    struct tensor xc, wv = linear_op_weight(op);
    const struct tensor *xin = &x2, *w = &wv;
    struct tensor bias = op->b ? param_stored(op->b, param_value(op->b)) : (struct tensor){0};
    struct fp8_blocks xb = {0}, wb = {0};
    if (op->fp8) {
        xc = matrix_view(&op->x8, rows, op->in);
        if (op->blockwise) {
            struct tensor xt = matrix_view(&op->x8t, rows, op->in);
            xb = fp8_block_cast_to(ctx, op->fp8_state, &xc, &x2, rows, op->in, FP8_TILES_ROWS, op->xs.data, &op->sx);
            fp8_block_cast_to(ctx, op->fp8_state, &xt, &x2, rows, op->in, FP8_TILES_COLS, op->xts.data, NULL);
        } else { /* in training with its transpose, which dW reads */
            struct tensor x8_tr = matrix_view(&op->x8_tr, op->in, rows);
            fp8_cast_to(ctx, op->fp8_state, &xc, &x2, &op->sx, ctx->training ? &x8_tr : NULL, rows, op->in);
            op->x8.scale_inv = xc.scale_inv; /* for backward's views */
        }
        /* the weight once per optimizer step: its codes kept for the step's other micro-batches (lib/base/fp8.h) */
        uint64_t version = ctx->fp8 ? ctx->fp8->weights : 0;
        if ((version == 0 || op->w8_weights != version) && op->blockwise)
            fp8_block_cast_to(ctx, op->fp8_state, &op->w8, w, op->out, op->in, FP8_BLOCKS, op->ws.data, &op->sw);
        else if (version == 0 || op->w8_weights != version) /* in training with its transpose, which dx reads */
            fp8_cast_to(ctx, op->fp8_state, &op->w8, w, &op->sw, ctx->training ? &op->w8_tr : NULL, op->out, op->in);
        if (op->blockwise)
            wb = (struct fp8_blocks){ .scale_inv = op->ws.data, .tiling = FP8_BLOCKS };
        op->w8_weights = version;
        xin = &xc;
        w = &op->w8;
    } else if (op->xc.data) {
        xc = matrix_view(&op->xc, rows, op->in);
        be->convert(be, &xc, &x2);
        xin = &xc;
    }
    struct gemm_args g = {
        .a = xin, .b = w, .c = &y2, .bias = op->b ? &bias : NULL,
        .trans_b = true, .m = rows, .n = op->out, .k = op->in, .alpha = 1.0f, .beta = 0.0f, .batch = 1,
        .epilogue = pre ? GEMM_EPI_GELU_TANH : op->relu ? GEMM_EPI_RELU : GEMM_EPI_NONE, .aux = pre ? &pre2 : NULL,
        .a_blocks = xb, .b_blocks = wb,
    };
    be->gemm(be, &g);
}

void linear_op_forward(const struct step_ctx *ctx, struct linear_op *op, struct tensor *y, const struct tensor *x,
                       int64_t rows)
{
    linear_op_gemm(ctx, op, y, NULL, x, rows);
}

void linear_op_forward_act(const struct step_ctx *ctx, struct linear_op *op, enum act_kind act, struct tensor *y,
                           struct tensor *pre, const struct tensor *x, int64_t rows)
{
    if (act == ACT_GELU_TANH && y->dtype == pre->dtype && y->dtype == op->d) {
        linear_op_gemm(ctx, op, y, pre, x, rows);
        return;
    }
    linear_op_gemm(ctx, op, pre, NULL, x, rows);
    ctx->be->act_forward(ctx->be, act, y, pre);
}

void linear_op_backward(const struct step_ctx *ctx, struct linear_op *op, struct tensor *dx, const struct tensor *dy,
                        const struct tensor *x, int64_t rows, float beta)
{
    struct backend *be = ctx->be;
    struct tensor dy2 = matrix_view(dy, rows, op->out);
    struct tensor xin = op->fp8 ? matrix_view(&op->x8, rows, op->in)
                      : op->xc.data ? matrix_view(&op->xc, rows, op->in) : matrix_view(x, rows, op->in);
    struct tensor wv = linear_op_weight(op);
    const struct tensor *dyin = &dy2, *w = &wv;
    struct tensor dy8, dy8t, xt, dy8_tr, x8_tr;
    /* blockwise: dW reads dy and x in 128x1 tiles (its K is the rows), dx reads dy in 1x128 tiles and W's blocks */
    const struct tensor *dw_a = &dy2, *dw_b = &xin;
    /* delayed and current: dW's operands and dx's W also transposed (gemm_args a_t, b_t) */
    const struct tensor *dw_a_t = NULL, *dw_b_t = NULL, *dx_b_t = NULL;
    struct fp8_blocks dyb = {0}, dytb = {0}, xtb = {0}, wb = {0};
    if (op->fp8 && op->blockwise) {
        const struct fp8_state *st = op->fp8_state;
        dy8 = scratch_view(op->workspace, op->dy8_off, DT_FP8_E4M3, 2, (int64_t[]){rows, op->out});
        dy8t = scratch_view(op->workspace, op->dy8t_off, DT_FP8_E4M3, 2, (int64_t[]){rows, op->out});
        float *dys = scratch_view(op->workspace, op->dys_off, DT_FP32, 1, (int64_t[]){1}).data;
        float *dyts = scratch_view(op->workspace, op->dyts_off, DT_FP32, 1, (int64_t[]){1}).data;
        dyb = fp8_block_cast_to(ctx, st, &dy8, &dy2, rows, op->out, FP8_TILES_ROWS, dys, &op->sdy);
        dytb = fp8_block_cast_to(ctx, st, &dy8t, &dy2, rows, op->out, FP8_TILES_COLS, dyts, NULL);
        xt = matrix_view(&op->x8t, rows, op->in);
        xtb = (struct fp8_blocks){ .scale_inv = op->xts.data, .tiling = FP8_TILES_COLS };
        wb = (struct fp8_blocks){ .scale_inv = op->ws.data, .tiling = FP8_BLOCKS };
        dyin = &dy8;
        dw_a = &dy8t;
        dw_b = &xt;
        w = &op->w8;
    } else if (op->fp8) {
        dy8 = scratch_view(op->workspace, op->dy8_off, DT_FP8_E5M2, 2, (int64_t[]){rows, op->out});
        dy8_tr = scratch_view(op->workspace, op->dy8_tr_off, DT_FP8_E5M2, 2, (int64_t[]){op->out, rows});
        fp8_cast_to(ctx, op->fp8_state, &dy8, &dy2, &op->sdy, &dy8_tr, rows, op->out);
        x8_tr = matrix_view(&op->x8_tr, op->in, rows);
        x8_tr.scale_inv = op->x8.scale_inv;
        dyin = &dy8;
        dw_a = &dy8;
        w = &op->w8;
        dw_a_t = &dy8_tr;
        dw_b_t = &x8_tr;
        dx_b_t = &op->w8_tr;
    }

    /* dW (out, in) = dy^T (out, rows) @ x (rows, in); a tied table accumulating over micro-batches gets this
     * micro-batch's gradient in its tied_grad first (the embedding adds its part and then the sum to grad) */
    bool apart = op->w->tied && beta != 0.0f && op->w->tied_grad.data;
    struct tensor dw = param_stored(op->w, apart ? &op->w->tied_grad : &op->w->grad); /* a padded head's: (Vp, in) */
    struct gemm_args gw = {
        .a = dw_a, .b = dw_b, .c = &dw, .trans_a = true,
        .m = op->out, .n = op->in, .k = rows, .alpha = 1.0f, .beta = apart ? 0.0f : beta, .batch = 1,
        .a_blocks = dytb, .b_blocks = xtb, .a_t = dw_a_t, .b_t = dw_b_t,
    };
    be->gemm(be, &gw);
    if (op->b) {
        struct tensor db = param_stored(op->b, &op->b->grad);
        be->bias_grad(be, &db, &dy2, rows, op->out, beta);
    }
    if (!dx)
        return;

    /* dx (rows, in) = dy (rows, out) @ W (out, in), rounded in d */
    struct tensor dx2 = matrix_view(dx, rows, op->in);
    struct tensor dxc = dx2;
    if (op->in_dtype != op->d)
        dxc = scratch_view(op->workspace, op->dxc_off, op->d, 2, (int64_t[]){rows, op->in});
    struct gemm_args gx = {
        .a = dyin, .b = w, .c = &dxc,
        .m = rows, .n = op->in, .k = op->out, .alpha = 1.0f, .beta = 0.0f, .batch = 1,
        .a_blocks = dyb, .b_blocks = wb, .b_t = dx_b_t,
    };
    if (op->out_valid) { /* a padded head: the V logical columns of dy's rows, against the table's V rows. K = Vp
                          * would add the padding's zero products, in another order of the sum on some paths */
        gx.k = op->out_valid;
        gx.lda = op->out;
    }
    struct tensor mask = matrix_view(x, rows, op->in);
    if (op->mask_dx && !ctx->zeros) { /* linear_setup made sure dx is d: dxc is dx itself */
        gx.epilogue = GEMM_EPI_RELU_MASK;
        gx.aux = &mask;
    }
    be->gemm(be, &gx);
    if (op->in_dtype != op->d)
        be->convert(be, &dx2, &dxc);
}

void linear_op_free(struct linear_op *op)
{
    tensor_free(&op->xc);
    tensor_free(&op->x8);
    tensor_free(&op->w8);
    tensor_free(&op->w8_tr);
    tensor_free(&op->x8_tr);
    tensor_free(&op->x8t);
    tensor_free(&op->xs);
    tensor_free(&op->xts);
    tensor_free(&op->ws);
}

/* ---- the layer ----------------------------------------------------------------------------------- */

struct linear_layer {
    struct linear_op op;
};

static int64_t rows_of(const struct tensor *x)
{
    return (int64_t)(x->numel / (size_t)x->shape[x->ndim - 1]);
}

static void linear_forward(struct layer *l, const struct step_ctx *ctx, const struct tensor *x,
                           const struct batch *b)
{
    (void)b;
    struct linear_layer *p = l->priv;
    l->y = batch_view(&l->y, x->shape[0]);
    linear_op_forward(ctx, &p->op, &l->y, x, rows_of(x));
}

static void linear_backward(struct layer *l, const struct step_ctx *ctx, const struct tensor *dy,
                            const struct tensor *x, const struct batch *b)
{
    (void)b;
    struct linear_layer *p = l->priv;
    struct tensor *dx = NULL;
    if (l->needs_dx) {
        l->dx = batch_view_like(&l->dx, x);
        dx = &l->dx;
    }
    linear_op_backward(ctx, &p->op, dx, dy, x, rows_of(x), ctx->accumulate ? 1.0f : 0.0f);
}

static void linear_free(struct layer *l)
{
    struct linear_layer *p = l->priv;
    if (p)
        linear_op_free(&p->op);
}

static void linear_decode(struct layer *l, const struct step_ctx *ctx, const struct tensor *x,
                          const struct decode_step *d)
{
    struct linear_layer *p = l->priv;
    l->y = seq_view(&l->y, d->n);
    linear_op_forward(ctx, &p->op, &l->y, x, d->n);
}

static const struct layer_ops linear_ops = {linear_forward, linear_backward, linear_free, linear_decode, NULL};

/* The parameter `tie` names: an earlier embedding's wte of shape (out, in). NULL (and AMP_OK) without a tie. */
static enum amp_status tied_weight(struct layer *l, struct layer_build *b, int64_t out, int64_t in,
                                   struct param **shared)
{
    *shared = NULL;
    if (!l->cfg.tie[0])
        return AMP_OK;
    const char *hint = "tie names the token table of an earlier embedding layer: tie: EMBEDDING_NAME/wte";
    for (int i = 0; i < b->nbuilt; i++) {
        struct layer *o = &b->built[i];
        for (int j = 0; j < o->nparams; j++) {
            struct param *p = &o->params[j];
            if (strcmp(p->name, l->cfg.tie) != 0)
                continue;
            const char *slash = strchr(p->name, '/');
            if (o->cfg.kind != LAYER_EMBEDDING || strcmp(slash ? slash + 1 : "", "wte") != 0)
                return layer_fail(l, b, hint, "tie: %s is a parameter of '%s' (%s); only an embedding's wte can be tied",
                                  l->cfg.tie, o->cfg.name, layer_kind_name(o->cfg.kind));
            if (p->tied)
                return layer_fail(l, b, "tie one linear layer to an embedding table", "tie: %s is tied already",
                                  l->cfg.tie);
            if (p->master.ndim != 2 || p->master.shape[0] != out || p->master.shape[1] != in)
                return layer_fail(l, b, "set out to the embedding's vocab, and feed the layer the embedding's width",
                                  "tie: %s has shape (%lld, %lld) but this layer's weight is (out %lld, in %lld)",
                                  l->cfg.tie, (long long)p->master.shape[0], (long long)p->master.shape[1],
                                  (long long)out, (long long)in);
            *shared = p;
            return AMP_OK;
        }
    }
    return layer_fail(l, b, hint, "tie: %s is not a parameter of an earlier layer", l->cfg.tie);
}

/* The token head's vocabulary padded to vp columns (b->vocab_align; docs/model.md, "Vocabulary padding"): the
 * weight (its own, or the tied embedding table) and the bias get vp rows of storage, the rows past out zero, and
 * the product's N becomes vp. Not an fp8 product: its casts would count the padding's zeros in the numerics. */
static enum amp_status linear_pad_vocab(struct linear_op *op, struct layer_build *b, int64_t vp)
{
    enum amp_status st = layer_pad_param_rows(op->w, b, vp);
    if (st == AMP_OK && op->b)
        st = layer_pad_param_rows(op->b, b, vp);
    if (st == AMP_OK) {
        op->out_valid = op->out;
        op->out = vp;
    }
    return st;
}

bool linear_is_plain(const struct layer *l)
{
    return l->ops == &linear_ops;
}

void linear_fuse_relu(struct layer *linear)
{
    assert(linear_is_plain(linear));
    ((struct linear_layer *)linear->priv)->op.relu = true;
}

enum amp_status linear_setup(struct layer *l, struct layer_build *b)
{
    char got[96];
    if (b->in_tokens || (b->in_ndim != 2 && b->in_ndim != 3))
        return layer_fail(l, b, b->in_ndim == 4 ? "add a flatten layer before it" : NULL,
                          "expects input of shape (N, D) or (N, T, D), got %s from %s",
                          shape_str_n(got, sizeof got, b->in_ndim, b->in_shape), b->in_from);
    if (l->cfg.out <= 0)
        return layer_fail(l, b, "set `out` to the number of output features", "out must be >= 1, got %lld",
                          (long long)l->cfg.out);
    struct linear_layer *p = calloc(1, sizeof *p);
    if (!p)
        return amp_fail(b->err, AMP_ERR_INTERNAL, NULL, "out of memory building layer '%s'", l->cfg.name);
    l->priv = p;
    l->ops = &linear_ops;
    l->op = OP_LINEAR;

    int64_t in = b->in_shape[b->in_ndim - 1];
    int64_t max_rows = b->in_shape[0] * (b->in_ndim == 3 ? b->in_shape[1] : 1);
    struct param *shared = NULL;
    enum amp_status st = tied_weight(l, b, l->cfg.out, in, &shared);
    if (st == AMP_OK)
        st = layer_reserve_params(l, b, 2);
    if (st == AMP_OK)
        st = linear_op_setup(&p->op, l, b, "", in, l->cfg.out, l->cfg.bias, b->in_dtype, max_rows,
                             PINIT_LINEAR_WEIGHT, shared);
    const int64_t align = b->vocab_align > 1 ? b->vocab_align : 1;
    const int64_t vp = (l->cfg.out + align - 1) / align * align;
    /* a head whose out is not the vocabulary fails at the loss: its message shows the shape unpadded */
    if (st == AMP_OK && vp > l->cfg.out && !p->op.fp8 && l->cfg.out == b->spec->num_classes) {
        st = linear_pad_vocab(&p->op, b, vp);
        l->out_valid = l->cfg.out;
    }
    if (st != AMP_OK)
        return st;
    l->ndim_out = b->in_ndim;
    for (int i = 0; i < b->in_ndim; i++)
        l->out_shape[i] = b->in_shape[i];
    l->out_shape[b->in_ndim - 1] = p->op.out;
    l->out_dtype = p->op.d;
    /* after a relu fused into a linear: dx masked here, in the product's epilogue, where no cast follows it (not
     * a padded head's: its dx product reads dy with a stride, which no epilogue takes) */
    if (b->fuse && b->nbuilt > 0 && l->needs_dx && relu_fused_into_linear(&b->built[b->nbuilt - 1]) && !p->op.fp8 &&
        !p->op.out_valid && p->op.in_dtype == p->op.d) {
        p->op.mask_dx = true;
        relu_masked_by_next(&b->built[b->nbuilt - 1]);
    }
    return AMP_OK;
}
