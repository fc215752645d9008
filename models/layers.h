/*
 * layers.h — private to models/: how the model builder (model.c) sets up each layer kind, and the
 * small building blocks (a linear map, a layernorm, the attention core) that several kinds share.
 *
 * Building a layer is one call, `KIND_setup(l, b)`: it checks the input shape the builder hands it
 * (b->in_*), fails with AMP_ERR_CONFIG naming the layer and both shapes when it cannot take it, and
 * otherwise fills l->ops, l->op, l->out_shape / ndim_out / out_dtype, creates the parameters and
 * buffers (allocated, grads zeroed) and the tensors the layer saves between forward and backward
 * (l->priv). The builder then allocates l->y and l->dx for the largest batch.
 *
 * Scratch: tensors that live only inside one layer's backward (a gradient on its way through a
 * transformer block, a dx in the op's dtype before the cast back to the input's) are not owned by the
 * layer. The layer reserves them at setup (scratch_reserve, offsets from 0 for each layer) and the
 * builder allocates one workspace as large as the largest layer's need, shared by all layers, since
 * backward runs one layer at a time.
 *
 * Views for a smaller batch: tensors are allocated for max_batch rows; a pass over n samples works on
 * batch_view()s of them with the first dimension set to n (or n*T where rows are tokens).
 */
#ifndef AMP_LAYERS_H
#define AMP_LAYERS_H

#include <stddef.h>
#include <stdint.h>

#include "layer.h" /* struct layer, struct param, struct step_ctx */
#include "model.h" /* struct data_spec */

/* What the builder knows when it sets up one layer. */
struct layer_build {
    struct backend *be;
    const struct autocast_policy *policy;
    enum dtype master_dtype;              /* the parameters' masters: fp32, or bf16 (precision.master_weights) */
    const struct data_spec *spec;
    int64_t max_batch;
    int64_t seq_len;                      /* data.seq_len (text), the default embedding max_len */
    /* the input: the previous layer's output, or the data's sample shape */
    int in_ndim;
    int64_t in_shape[TENSOR_MAX_DIMS];    /* in_shape[0] is max_batch */
    enum dtype in_dtype;
    bool in_tokens;                       /* the input is the data's int32 token ids */
    int64_t in_valid;                     /* 0, or the logical size of the input's padded last dimension (the
                                           * layer before's out_valid) */
    char in_from[128];                    /* "the data" or "'fc1' (linear)", for messages */
    /* set by setup */
    bool y_is_view;                       /* y (and dx) are views of x (and dy): nothing to allocate */
    size_t scratch_bytes;                 /* this layer's backward scratch, see scratch_reserve */
    const struct tensor *workspace;       /* the model's shared workspace (allocated after every setup) */
    struct fp8_state *fp8;                /* the model's fp8 scales, where layers register their fp8 tensors */
    bool fp8_layer;                       /* this layer's linear products run in fp8 (precision.mode fp8, the
                                           * layer not in precision.fp8.keep_bf16) */
    struct layer *built;                  /* the layers set up before this one (a linear's `tie` names one) */
    bool accumulates;                     /* accum_steps > 1: gradients accumulate over micro-batches */
    bool fuse;                            /* a relu right after a batchnorm2d or a linear layer runs inside it
                                           * (backend.h, norm_args.relu, GEMM_EPI_RELU); off where the numerics
                                           * report measures every layer's own output (run.numerics_every) */
    enum recompute recompute;             /* run.recompute: what transformer blocks (and, for attention, attention
                                           * layers) keep in the shared workspace and recompute in backward */
    int vocab_align;                      /* > 1 for a linear layer right before a cross_entropy on text, where
                                           * fuse is on: pad its out (the vocabulary) to a multiple of this (the
                                           * backend's vocab_align; docs/model.md, "Vocabulary padding"); 1
                                           * otherwise */
    int nbuilt;
    struct amp_error *err;
};

/* One setup function per layer kind. */
enum amp_status linear_setup(struct layer *l, struct layer_build *b);
enum amp_status conv2d_setup(struct layer *l, struct layer_build *b);
enum amp_status pool2d_setup(struct layer *l, struct layer_build *b);   /* maxpool2d, avgpool2d */
enum amp_status flatten_setup(struct layer *l, struct layer_build *b);
/* Fuse the relu layer being set up into the batchnorm2d layer bn before it: bn's y becomes the ReLU's output. */
void batchnorm2d_fuse_relu(struct layer *bn);
/* Whether l is a linear layer (a transformer block's op kind is OP_LINEAR too), and fusing the relu layer being
 * set up into such a layer before it: its y becomes the ReLU's output. */
bool linear_is_plain(const struct layer *l);
void linear_fuse_relu(struct layer *linear);
/* For a linear layer being set up after a relu fused into a linear: whether that relu is one (elementwise.c), and
 * telling it that this layer masks its gradient (linear_op.mask_dx), so its backward passes dy on unchanged. */
bool relu_fused_into_linear(const struct layer *relu);
void relu_masked_by_next(struct layer *relu);
enum amp_status batchnorm2d_setup(struct layer *l, struct layer_build *b);
enum amp_status layernorm_setup(struct layer *l, struct layer_build *b);
enum amp_status activation_setup(struct layer *l, struct layer_build *b); /* relu, gelu */
enum amp_status dropout_setup(struct layer *l, struct layer_build *b);
enum amp_status embedding_setup(struct layer *l, struct layer_build *b);
enum amp_status attention_setup(struct layer *l, struct layer_build *b);
enum amp_status transformer_block_setup(struct layer *l, struct layer_build *b);
enum amp_status loss_setup(struct layer *l, struct layer_build *b);     /* cross_entropy, mse */

/* The loss layer's link to the model: where cross_entropy writes its correct marks (m->correct), and
 * how many loss rows one sample gives (1, or T for text). */
void loss_set_correct(struct layer *l, int32_t *correct);
int64_t loss_rows_per_sample(const struct layer *l);

/* ---- helpers shared by the kinds (layers_common.c) ---------------------------------------------- */

/* AMP_ERR_CONFIG "model.layers[I] 'NAME' (KIND): MESSAGE" with `hint`. */
enum amp_status layer_fail(const struct layer *l, struct layer_build *b, const char *hint, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* "(N, 1, 28, 28)": a shape with its batch dimension written as N. */
const char *shape_str_n(char *buf, size_t len, int ndim, const int64_t *shape);

/* Size l->params for `n` parameters (before any layer_add_param). */
enum amp_status layer_reserve_params(struct layer *l, struct layer_build *b, int n);

/* Create parameter "LAYER/local": master in b->master_dtype, a zeroed fp32 grad, and a copy in `read_as`, the
 * dtype the op reads the weights in, when that is not master's (param_value gives what to read). NULL on out
 * of memory (b->err filled). */
struct param *layer_add_param(struct layer *l, struct layer_build *b, const char *local, int ndim,
                              const int64_t *shape, enum param_init init, int64_t fan_in, bool decay,
                              enum dtype read_as);

/* Give p's tensors (master, grad, copy, tied_grad) storage for `rows` rows along dim 0, more than their shape's,
 * the rows past it zero (struct param, stored_rows). Before model_init and flatten_grads: nothing is lost. NULL-safe
 * for the absent ones; AMP_ERR_INTERNAL naming p on out of memory. */
enum amp_status layer_pad_param_rows(struct param *p, struct layer_build *b, int64_t rows);

/* Create buffer "LAYER/local" (fp32). l->buffers must be sized by the caller. */
enum amp_status layer_add_buffer(struct layer *l, struct layer_build *b, const char *local, int ndim,
                                 const int64_t *shape);

/* Allocate a tensor owned by the layer (saved for backward), named for out-of-memory messages. */
enum amp_status layer_alloc(struct layer *l, struct layer_build *b, struct tensor *t, enum dtype dt, int ndim,
                            const int64_t *shape, const char *what);

/* Reserve `numel` elements of `dt` in the shared workspace; returns the byte offset. */
size_t scratch_reserve(struct layer_build *b, enum dtype dt, size_t numel);

/* A tensor of `shape` at byte offset `off` in the workspace. */
/* With ctx->zeros set, add g's zero count if g holds low-precision values (stored in 16 bits, or
 * `computed_lowp`: rounded to 16 bits before being widened). */
void count_grad_zeros(const struct step_ctx *ctx, const struct tensor *g, bool computed_lowp);
/* The same for g whose last dimension holds `valid` columns of results and padding after them (zeros: the padded
 * vocabulary's dlogits), which grad_zeros.padding takes off the count; valid 0: none padded. */
void count_grad_zeros_padded(const struct step_ctx *ctx, const struct tensor *g, bool computed_lowp, int64_t valid);

/* Tell ctx->hook (where there is one) that the gradients of `first` and of every parameter after it are final. */
void grads_final(const struct step_ctx *ctx, const struct param *first);

struct tensor scratch_view(const struct tensor *workspace, size_t off, enum dtype dt, int ndim,
                           const int64_t *shape);

/* `t` with its first dimension set to `rows` (same trailing dims as `like`, or as t itself). */
struct tensor batch_view(const struct tensor *t, int64_t rows);
struct tensor batch_view_like(const struct tensor *t, const struct tensor *like);
/* `t` seen as a matrix (rows, cols). */
struct tensor matrix_view(const struct tensor *t, int64_t rows, int64_t cols);

/* `t` as one sequence of n positions: (1, n, its last dimension). */
struct tensor seq_view(const struct tensor *t, int64_t n);

/* Element count of one sample of a shape (everything but the batch dimension). */
int64_t shape_inner(int ndim, const int64_t *shape);

/* ---- building blocks ----------------------------------------------------------------------------- */

/* y (rows, out) = x (rows, in) @ W^T + b, the op of linear layers and of the projections inside
 * attention and transformer blocks. Runs in d = autocast(linear, x's dtype): x is cast to d first when
 * it is not (the cast copy xc is kept for the weight gradient), W is the master (d fp32) or the lowp
 * copy, the fp32 bias is added inside the GEMM before the one rounding to d. Backward: dW, db fp32
 * (beta = accumulate); dx computed in d, then cast to x's dtype when that differs, as autograd's
 * backward of the cast does. */
struct linear_op {
    struct param *w;        /* (out, in) */
    struct param *b;        /* (out) or NULL */
    int64_t in, out;        /* out: the product's N, the padded vocabulary where linear_setup padded it */
    int64_t out_valid;      /* 0, or the vocabulary V where out is padded: dx's product reads V columns of dy */
    enum dtype in_dtype;    /* x's dtype */
    enum dtype d;           /* the GEMM's (and y's) dtype */
    struct tensor xc;       /* (max_rows, in) in d: x cast to d; empty when x is already d or the op is fp8 */
    size_t dxc_off;         /* scratch (max_rows, in) in d, when x is not d */
    const struct tensor *workspace;
    /* precision.mode fp8, this layer not in keep_bf16, the product not below precision.fp8.min_size (lib/base/fp8.h):
     * the products read fp8 operands and give d */
    bool fp8;
    const struct fp8_state *fp8_state; /* the model's: the recipe and the slots' arrays */
    struct fp8_slot sx, sw, sdy; /* the input's and weight's scales (E4M3), the output gradient's (E5M2) */
    struct tensor x8;       /* (max_rows, in) E4M3: the input as the forward cast it, saved for dW */
    struct tensor w8;       /* (out, in) E4M3: the weight as this step's first pass cast it, read again by
                             * backward and by the step's later micro-batches (lib/base/fp8.h, struct fp8_pass) */
    uint64_t w8_weights;    /* the fp8_pass.weights w8 was cast for; 0: cast at every pass */
    size_t dy8_off;         /* scratch (max_rows, out) E5M2 (blockwise: E4M3 in 1x128 tiles): dy cast */
    /* recipes delayed and current: the codes transposed, made by the casts in the same pass (backend.h fp8_cast_args
     * dst_t) for the backward's products, which read W and both of dW's operands the other way round (gemm_args
     * a_t, b_t: a GPU's fp8 kernels take one layout only). Made in training only. */
    struct tensor w8_tr;    /* (in, out) E4M3: w8 transposed, cast and kept with it */
    struct tensor x8_tr;    /* (in, max_rows) E4M3, seen as (in, rows): x8 transposed, saved for dW */
    size_t dy8_tr_off;      /* scratch (out, max_rows) E5M2, seen as (out, rows): dy8 transposed, for dW */
    /* recipe blockwise (lib/base/fp8.h): each cast has one scale per tile along its product's K, so x and dy are
     * each cast twice, along their rows for one product and down their columns for the other (dW's K is the
     * rows); x8 and w8 above then hold 1x128 tiles and 128x128 blocks. All scales fp32 scale_inv. */
    bool blockwise;
    struct tensor x8t;      /* (max_rows, in) E4M3: x in 128x1 tiles down its columns, saved for dW */
    struct tensor xs;       /* (max_rows, ceil(in / 128)): x8's scales */
    struct tensor xts;      /* (ceil(max_rows / 128), in): x8t's scales */
    struct tensor ws;       /* (ceil(out / 128), ceil(in / 128)): w8's block scales, kept with w8 */
    size_t dy8t_off;        /* scratch (max_rows, out) E4M3: dy in 128x1 tiles down its columns, for dW */
    size_t dys_off, dyts_off; /* scratch fp32: dy8's scales (max_rows, ceil(out / 128)), dy8t's (ceil(max_rows /
                               * 128), out) */
    /* a relu fused in (model layers linear, relu, ...: layer_build.fuse): */
    bool relu;              /* y is the relu's output, made in the product's epilogue (GEMM_EPI_RELU) */
    bool mask_dx;           /* x is a fused relu's output, and dx comes out masked as the relu's backward would
                             * mask it (GEMM_EPI_RELU_MASK, x the mask), except on steps that count zeros */
};

/* `prefix` goes between the layer name and "weight"/"bias": "" for a linear layer, "attn/qkv/" inside
 * a transformer block. `shared`, when not NULL, is an earlier layer's (out, in) parameter used as the weight
 * (a tie): it gets a copy in the op's dtype where it has none, and is marked tied. */
enum amp_status linear_op_setup(struct linear_op *op, struct layer *l, struct layer_build *b, const char *prefix,
                                int64_t in, int64_t out, bool bias, enum dtype in_dtype, int64_t max_rows,
                                enum param_init weight_init, struct param *shared);
void linear_op_forward(const struct step_ctx *ctx, struct linear_op *op, struct tensor *y, const struct tensor *x,
                       int64_t rows);
/* The op followed by an activation: pre = the op's output (rows, out), saved for the activation's
 * backward, and y = act(pre). GELU (tanh) whose output has pre's dtype is the GEMM's epilogue
 * (GEMM_EPI_GELU_TANH: GELU of the unrounded fp32 pre-activation, one pass less over the activation);
 * otherwise the op, then act_forward. */
void linear_op_forward_act(const struct step_ctx *ctx, struct linear_op *op, enum act_kind act, struct tensor *y,
                           struct tensor *pre, const struct tensor *x, int64_t rows);
/* dx may be NULL (first layer): no input gradient. beta: 0 overwrite weight grads, 1 accumulate. */
void linear_op_backward(const struct step_ctx *ctx, struct linear_op *op, struct tensor *dx, const struct tensor *dy,
                        const struct tensor *x, int64_t rows, float beta);
void linear_op_free(struct linear_op *op);

/* Layernorm over the last `cols` of x (rows, cols), fp32 statistics saved for backward, fp32 gain and
 * shift (the masters: a fp32-class op). */
struct layernorm_op {
    struct param *gain, *shift; /* (cols) */
    int64_t cols;
    float eps;
    struct tensor mean, rstd;   /* (max_rows) fp32 */
};

enum amp_status layernorm_op_setup(struct layernorm_op *op, struct layer *l, struct layer_build *b,
                                   const char *prefix, int64_t cols, float eps, int64_t max_rows);
void layernorm_op_forward(struct backend *be, struct layernorm_op *op, struct tensor *y, const struct tensor *x,
                          int64_t rows);
void layernorm_op_backward(struct backend *be, struct layernorm_op *op, struct tensor *dx, const struct tensor *dy,
                           const struct tensor *x, int64_t rows, float beta);
/* The same with the residual add before the layernorm fused in (norm_args.addend, dsum): forward writes
 * sum = x + addend and y = layernorm(sum); backward dx = dsum + the layernorm's dx (x: the sum). */
void layernorm_op_forward_add(struct backend *be, struct layernorm_op *op, struct tensor *y, struct tensor *sum,
                              const struct tensor *x, const struct tensor *addend, int64_t rows);
void layernorm_op_backward_add(struct backend *be, struct layernorm_op *op, struct tensor *dx, const struct tensor *dy,
                               const struct tensor *x, const struct tensor *dsum, int64_t rows, float beta);
void layernorm_op_free(struct layernorm_op *op);
/* The add that ends a transformer block (y = r1 + mlp) run inside the first layernorm of the layer after it, one
 * pass instead of two (attention.c). For the layer being set up: the block before it, when fusing is on
 * (layer_build.fuse) and the add's inputs are the block's own tensors (not run.recompute block's share of the
 * workspace, which the next layer's forward reuses); that block then leaves its y to the layernorm, which must
 * run layernorm_op_forward_from in every forward and decode. NULL otherwise: the block adds. */
struct layer *block_hand_over_add(struct layer_build *b);
/* op's forward on `from`'s y (from: block_hand_over_add's), the block's add first: y = layernorm(from's y), from's
 * y = its r1 + mlp of the pass just run, the bits of the add then layernorm_op_forward. */
void layernorm_op_forward_from(struct backend *be, struct layernorm_op *op, struct tensor *y, struct layer *from,
                               int64_t rows);

/* Causal multi-head self-attention core on qkv (B, T, 3C): out (B, T, C) in d = autocast(attention_matmul,
 * qkv's dtype); qkv is cast to d first when it is not (kept, qkvc). What it keeps for backward is the backend's
 * choice, asked once at setup (backend_attention_fused): where the backend's fused attention serves the shape and
 * d, only the softmax statistics (B, H, T) fp32, and backward reads the forward's out besides; elsewhere (the CPU,
 * fp32, a shape the fused path refuses) the probabilities (B, H, T, T) in d. */
struct attention_core {
    int64_t T, C, H;
    enum dtype in_dtype, d;
    bool fused;             /* the backend's attention_fused_* pair runs this core */
    struct tensor stats;    /* fused: (max_B, H, T) fp32, always the core's own (nothing to recompute) */
    struct tensor qkvc;     /* (max_B, T, 3C) in d, empty when qkv is already d */
    struct tensor probs;    /* (max_B, H, T, T) in d; empty when fused or recomputed (run.recompute attention or
                             * block) */
    size_t probs_off;       /* then: scratch for them, filled by the forward and again in backward */
    bool recompute;         /* the probabilities are recomputed: never when fused */
    size_t dqkvc_off;       /* scratch (max_B, T, 3C) in d, when qkv is not d */
    struct tensor kv;       /* generation: the key/value cache (2, H, T, C/H) in d (backend.h attention_decode);
                             * empty until attention_core_cache_alloc */
    const struct tensor *workspace;
};

/* `recompute`: the probabilities live in the shared workspace, and the layer calls attention_core_forward again in
 * its backward, before attention_core_backward (the same kernels on the same inputs: the same bits). A fused core
 * ignores it (op->recompute stays false): its statistics are B*H*T floats, kept, and nothing is computed again.
 * attention_core_backward's `out` is the forward's output, unchanged since (the fused backward reads it). */
enum amp_status attention_core_setup(struct attention_core *op, struct layer *l, struct layer_build *b,
                                     int64_t T, int64_t C, int64_t H, enum dtype in_dtype, int64_t max_B,
                                     bool recompute);
void attention_core_forward(struct backend *be, struct attention_core *op, struct tensor *out,
                            const struct tensor *qkv, int64_t B);
void attention_core_backward(struct backend *be, struct attention_core *op, struct tensor *dqkv,
                             const struct tensor *dout, const struct tensor *qkv, const struct tensor *out, int64_t B);
void attention_core_free(struct attention_core *op);
/* Generation: the cache (once), and the core over d's positions, qkv and out (1, n, ...), through the cache. */
enum amp_status attention_core_cache_alloc(struct attention_core *op, struct backend *be, struct amp_error *err);
void attention_core_decode(struct backend *be, struct attention_core *op, struct tensor *out,
                           const struct tensor *qkv, const struct decode_step *d);

#endif
