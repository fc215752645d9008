/*
 * backend.h — the one seam between the engine and the device.
 *
 * A backend is a table of operations on tensors (tensor.h). Layers (models/), the optimizer and the
 * training loop call only these; the CPU backend (kernels/cpu/backend_cpu.c) is the reference, the CUDA
 * backend (kernels/cuda/) implements the same table and must agree with it within per-dtype tolerances.
 *
 * Dtype rules every operation follows (docs/backend.md, "Dtype rules"):
 *  - An op "runs in" the dtype of its output activation. It reads inputs of any dtype, computes in
 *    FP32 (double where noted for determinism), and rounds once, to nearest-even, when it stores.
 *    So a bf16 op on the CPU gives the bits the GPU would, up to summation order.
 *  - GEMM inputs A and B share a dtype; products accumulate in FP32, as tensor cores do.
 *  - Parameter gradients, optimizer state, statistics and losses are FP32 always.
 *  - Ops that accumulate take `beta`: out = beta * out + new (beta 0 overwrites, 1 accumulates).
 *
 * Nothing in a training step returns a value to the host: losses, the gradient check, the loss scale
 * and the step's decision stay in backend memory (lib/base/step_rule.h), so a GPU queues a whole step
 * without a host synchronisation. Only download and synchronize wait.
 *
 * Errors: operations return void; a backend records its first failure (a CUDA error, say) and
 * backend_status() reports it. The training loop checks it once per step. Shape and dtype mistakes
 * are programming errors and abort with a message in debug builds (assert).
 *
 * Integer buffers (labels, tokens) are int32 arrays in backend memory from backend_alloc.
 */
#ifndef AMP_BACKEND_H
#define AMP_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "error.h"  /* enum amp_status, struct amp_error */
#include "fp8.h"    /* enum fp8_tiling: recipe blockwise's scale layouts */
#include "step_rule.h" /* struct step_params, step_state, step_row, grad_check, step_scalars */
#include "tensor.h" /* struct tensor */

enum act_kind { ACT_RELU, ACT_GELU_TANH, ACT_GELU_ERF };
#define BACKEND_STAGING_SLOTS 2
enum pool_kind { POOL_MAX, POOL_AVG };

/* What the product's epilogue does besides alpha, beta and the bias. */
enum gemm_epilogue {
    GEMM_EPI_NONE,            /* C = alpha * op(A) @ op(B) + beta * C (+ bias) */
    GEMM_EPI_GELU_TANH,       /* pre = alpha * op(A) @ op(B) + bias, in fp32; aux = pre and C = gelu_tanh(pre),
                               * each rounded once to their dtype (which they share). Needs beta 0, batch 1,
                               * !trans_a, and aux (m, n). aux is what GELU's backward reads (act_backward). */
    GEMM_EPI_RELU,            /* C = relu of the product (+ bias) rounded once: act_forward(ACT_RELU, C, C) on
                               * the plain product's C, bit for bit (a value <= 0 gives +0, a NaN passes). Needs
                               * beta 0 and batch 1. ReLU's backward can read C: it passes where its input does. */
    GEMM_EPI_RELU_MASK,       /* C = the rounded product where aux (m, n, C's dtype) passes ReLU (> 0, or a NaN)
                               * and +0 elsewhere: act_backward(ACT_RELU, C, C, aux) on the plain product's C,
                               * bit for bit. aux: a ReLU's output (or input). Needs beta 0 and batch 1. */
};

/* C = alpha * op(A) @ op(B) + beta * C, row-major, `batch` independent products (strided batched).
 * fp8 operands (precision.mode fp8): A and B are each E4M3 or E5M2 (not both E5M2), each with its scale_inv
 * (tensor.h); the exact products of the codes are summed in fp32 (on the CPU; a GPU's FP8 tensor cores sum them
 * in a narrower accumulator: kernels/cuda/fp8.cu) and the sum multiplied by
 * alpha * *A.scale_inv * *B.scale_inv (that factor formed in fp32, left to right) before the bias, the
 * epilogue and the one rounding. C is then fp32 or bf16.
 * Block-scaled fp8 operands (recipe blockwise: a_blocks.scale_inv and b_blocks.scale_inv both set, A and B E4M3,
 * batch 1, no row bias): each operand's scales are laid out as its tiling says (lib/base/fp8.h), and the tiles lie
 * along K (FP8_TILES_ROWS when K is the operand's stored columns, FP8_TILES_COLS when its stored rows; FP8_BLOCKS
 * either way). The tensors' own scale_inv is not read. Element (i, j) is, on the CPU (kernels/cpu/fp8.c), in fp32:
 * acc = 0; for each 128-wide block b of K in order: s = the exact sum of the block's code products rounded once to
 * fp32 (exact in any order: lib/base/fp8.h's E4M3 products are multiples of 2^-18 below 2^18); acc = acc + s * (A's
 * scale_inv of (i, b) * B's of (b, j)); then alpha * acc, + bias, epilogue, rounding. The scales are powers of two,
 * so s * scale is exact and each block costs two roundings (s and acc). A GPU sums in its own order and
 * accumulator (cuBLASLt), so its last bits differ. */
struct fp8_blocks {
    const float *scale_inv;  /* fp8_tiling_scales(tiling, stored rows, stored cols) fp32, backend memory; NULL: none */
    enum fp8_tiling tiling;
};

/* One part's gradient statistics (grad_stats_parts, below): the finite squares, the finite max |g|, and the Inf and
 * NaN elements. The squares' layout is the backend's own, read only by its grad_stats_combine: the CPU adds element i
 * of the part to lane i % 8 in element order; CUDA puts the part's sum (its block's fixed tree) in lane 0 and zeroes
 * the other seven. 88 bytes. */
struct grad_part {
    double lanes[8];
    double absmax;
    int64_t n_inf, n_nan;
};

struct gemm_args {
    const struct tensor *a;   /* op(A) is (m, k): A is (m, k), or (k, m) when trans_a */
    const struct tensor *b;   /* op(B) is (k, n): B is (k, n), or (n, k) when trans_b */
    struct tensor *c;         /* (m, n): fp32, or the dtype of A (then rounded once at the end); fp8 A and B:
                               * fp32 or bf16 */
    const struct tensor *bias;/* optional, fp32 (n): added to every row before rounding; needs beta 0 */
    bool trans_a, trans_b;
    int64_t m, n, k;
    float alpha, beta;
    int64_t batch;            /* >= 1 */
    int64_t stride_a, stride_b, stride_c; /* elements between consecutive batch matrices */
    int64_t lda;              /* elements between A's stored rows where they are longer than op(A) needs (0: dense,
                               * k, or m when trans_a): the padded token head's dx reads the first V columns of its
                               * (rows, Vp) dlogits. No epilogue; not fp8 */
    enum gemm_epilogue epilogue; /* GEMM_EPI_NONE (0) unless set */
    struct tensor *aux;       /* GEMM_EPI_GELU_TANH: the pre-activation (m, n), C's dtype (written);
                               * GEMM_EPI_RELU_MASK: the mask (m, n), C's dtype (read) */
    struct fp8_blocks a_blocks, b_blocks; /* recipe blockwise: the operands' tile scales (above); zero otherwise */
    /* fp8 operands with a per-tensor scale, optional: A's and B's codes stored transposed ((k, m) where A is stored
     * (m, k), (m, k) where it is stored (k, m) as trans_a says; B likewise), bit for bit the transpose of a and b
     * (fp8_cast_args.dst_t makes them). The product is the same; a backend may read them in place of a and b: the
     * CUDA backend does, since Hopper's fp8 kernels take one layout only (kernels/cuda/fp8.cu), and the CPU ignores
     * them. NULL: none. */
    const struct tensor *a_t, *b_t;
};

struct conv_args {
    int64_t n, c_in, h_in, w_in;   /* input (n, c_in, h_in, w_in), NCHW */
    int64_t c_out, h_out, w_out;   /* output (n, c_out, h_out, w_out) */
    int64_t kernel, stride, padding;
};

struct pool_args {
    enum pool_kind kind;
    int64_t n, c, h_in, w_in, h_out, w_out;
    int64_t kernel, stride, padding; /* avg: padding counted in the divisor (PyTorch count_include_pad) */
};

struct norm_args {
    int64_t rows, cols;       /* layernorm: rows = tokens, cols = features normalised together */
    int64_t n, c, hw;         /* batchnorm2d: NCHW with hw = h*w, statistics per channel over n*hw */
    float eps;
    float momentum;           /* batchnorm2d running statistics: r = (1-m) r + m s (unbiased var, as PyTorch) */
    bool training;            /* batchnorm2d: batch statistics and update running ones; else use running */
    bool relu;                /* batchnorm2d: a ReLU fused after it. Forward: y = relu(bn(x)), the bits of the
                               * two ops one after the other (y, the ReLU's output, in y's dtype). Backward: dy
                               * is the gradient of that output, y the forward's (the ReLU's mask, y <= 0: 0);
                               * dy, dx and the parameter gradients have the bits of the ReLU's backward then
                               * batchnorm's. y and dy share a dtype. One pass over the activations fewer each
                               * way, and no tensor between the two. */
    /* layernorm: the residual add before it, fused (a transformer block's r1 = x + proj, h2 = ln2(r1)). Forward,
     * with `addend`: the op first writes sum = x + addend in sum's dtype (the bits of backend->add(sum, x, addend))
     * and normalises sum as stored: mean, rstd and y are sum's layernorm. Backward, with `dsum`: dx = dsum + the
     * layernorm's dx (that rounded to dx's dtype first, then the sum rounded once: the bits of layernorm_backward
     * into dx, then backend->add(dx, dx, dsum); IEEE addition commutes). x, addend, sum, dsum: (rows, cols), any
     * dtype. */
    const struct tensor *addend;
    struct tensor *sum;
    const struct tensor *dsum;
};

/* Key of a counter-based random stream: dropout masks are a pure function of (seed, layer, step, micro)
 * and the element index, so backward regenerates the forward's mask and a resumed run gets the same ones.
 * A training step names its step through backend memory: with `step` set, the counter the op uses is
 * *step * per_step + counter, *step read when the op runs (the trainer's step_state.step, which step_finish
 * advances on the device), so one recorded sequence of launches serves every step (a CUDA graph: docs/backend.md,
 * "CUDA Graphs"); the CPU backend reads it from its memory the same way. step NULL: counter alone. */
struct rng_key {
    uint64_t seed;
    uint64_t stream; /* layer index */
    uint64_t counter;/* optimizer step * accum_steps + micro-batch; with `step`: the part within the step */
    const int64_t *step; /* or NULL: one int64 in backend memory, the optimizer step */
    uint64_t per_step;   /* with `step`: the counters a step spans (accum_steps x ranks) */
};

/* The step's log row and gradient counts into the trainer's window, as a training step's last op: the step writes
 * its row and counts at fixed places (`row`, `counts`), and this copies them to slot *slot of the window (`rows`,
 * `window_counts`: slot * ncounts onwards), zeroes the fixed row (count_zeros adds into it) and raises *slot by one.
 * *slot (one int64 in backend memory) is set to 0 by the host at a window's start, so the same launch serves every
 * step of a window (a CUDA graph). */
struct window_store_args {
    struct step_row *row;          /* backend memory: the step's row, zeroed after the copy */
    const int64_t *counts;         /* backend memory: ncounts int64, the step's per-tensor counts */
    struct step_row *rows;         /* backend memory: the window's rows */
    int64_t *window_counts;        /* backend memory: the window's counts, ncounts per slot */
    int64_t ncounts;
    int64_t *slot;                 /* backend memory: the next slot; raised by one */
};

/* One parameter's optimizer update. The step's scalars (unscale * clip factor, learning rate, step
 * count, skip) are in backend memory, written by step_finish: the host never needs them. */
struct optim_update_args {
    struct tensor *master;    /* the weights, updated in place: fp32, or bf16 (precision.master_weights) */
    const struct tensor *grad;/* fp32 gradient (still scaled by the loss scale) */
    struct tensor *m, *v;     /* moments (adamw: m, v; sgd: m = momentum buffer or NULL): fp32, or bf16
                               * (optim.state_dtype) */
    struct tensor *copy;      /* optional copy of the new weights in another dtype, written in the same pass:
                               * an fp32 master's fp16/bf16 compute copy, or a bf16 master's fp32 copy for the
                               * ops that read weights in fp32 (or NULL) */
    const struct step_scalars *sc; /* backend memory; sc->skip: leave every tensor as it is */
    int64_t *trial;           /* NULL: update. Else (backend memory, shared by the call's entries) the trial of the
                               * same update: nothing is stored, and where any element's new weight or moment, as
                               * it would be stored (bf16 rounding included), is non-finite, *trial becomes at
                               * most 1 + this entry's index in the call (the smallest such index wins); a trial
                               * returns at once unless sc->check */
    struct state_bound *bound;/* or NULL; backend memory, shared by the call's entries: an update raises it to the
                               * largest |weight|, |m| and v it stores (lib/base/step_rule.h, step_rule_bounded) */
    float weight_decay;       /* this parameter's (0 where it does not decay); adamw applies sc->adam_decay */
    double beta1, beta2;      /* adamw: the config's; the update uses (float)beta and (float)(1 - beta), 1 - beta
                               * computed in double as PyTorch passes it (0.001f for 0.999, not 1.0f - 0.999f) */
    float eps;                /* adamw */
    float momentum;           /* sgd */
    bool nesterov;            /* sgd */
    bool stochastic;          /* bf16 stores round stochastically (lib/base/sround.h), else to nearest even */
    uint64_t sr_seed;         /* sr_seed(run.seed) */
    uint32_t sr_param;        /* this parameter's index: the rounding stream is sr_stream(sc->t, sr_param) */
    uint64_t sr_offset;       /* the index in the parameter of master's element 0: 0, or a ZeRO shard's first element
                               * (lib/engine/zero.h; master, grad, m, v and copy are then that shard's views), so element
                               * i draws the bits it draws unsharded (lib/base/sround.h) */
};

/* A cast to fp8 with a per-tensor scale (lib/base/fp8.h has the recipes). dst = saturate(round-to-nearest-even(
 * src * scale)) in dst's format (E4M3 or E5M2; never Inf), and dst's value is code * scale_inv. */
struct fp8_cast_args {
    struct tensor *dst;       /* E4M3 or E5M2, src's numel; dst->scale_inv should point at scale_inv */
    const struct tensor *src; /* any non-fp8 dtype */
    float *scale, *scale_inv; /* this tensor's: one fp32 each in backend memory */
    float *amax;              /* non-NULL: *amax = max(*amax, max |src|) (lib/base/fp8.h fp8_amax_fold) */
    bool current;             /* first *scale = fp8_scale_from_amax(max |src|, current) and *scale_inv = 1 / *scale
                               * (recipe current), then cast */
    int margin;               /* precision.fp8.margin, for `current` */
    int64_t *counts;          /* non-NULL (ampTrain numerics): 4 int64 in backend memory, raised by the elements
                               * whose scaled value saturates (would round beyond max; Inf too), the nonzero finite
                               * ones that round to zero, the nonzero ones, and all of them */
    /* The cast-transpose (Transformer Engine's): with dst_t, src and dst are also (rows, cols) matrices
     * (rows * cols == numel) and dst_t (cols, rows), dst's dtype, gets the same codes transposed, bit for bit:
     * dst_t[c * rows + r] = dst[r * cols + c], made in the cast's own pass (the CUDA backend: one kernel through
     * shared-memory tiles), for a product that reads the operand the other way round (gemm_args a_t, b_t). The amax
     * and the counts are the cast's, counted once. NULL: none (rows and cols unread). */
    struct tensor *dst_t;
    int64_t rows, cols;
};

/* Recipe blockwise's cast of a (rows, cols) matrix to E4M3 with one scale per tile (lib/base/fp8.h, enum
 * fp8_tiling): for each tile, scale = fp8_block_scale(max |src| over the tile), scale_inv[tile] = 1 / scale (exact),
 * and dst = saturate(round-to-nearest-even(src * scale)) over the tile. No state is read or kept. */
struct fp8_block_cast_args {
    struct tensor *dst;       /* E4M3, rows * cols elements, src's layout */
    const struct tensor *src; /* any non-fp8 dtype, rows * cols elements, row-major */
    int64_t rows, cols;
    enum fp8_tiling tiling;
    float *scale_inv;         /* fp8_tiling_scales(tiling, rows, cols) fp32 in backend memory, written */
    int64_t *counts;          /* as fp8_cast_args.counts, at each element's own tile scale; or NULL */
};

/* The delayed recipe's update after a step, of every group of fp8 tensors in one call (lib/base/fp8.h: the forward's
 * E4M3 and the backward's E5M2; one launch on a GPU). For each group in order and each of its n tensors: with
 * `pending`, first history row `row` = fmaxf(itself, pending) and pending = 0 (the step's casts raised pending, not
 * the row); then amax from the history (len rows of n; `max` over the rows or row `row` alone), scale =
 * fp8_scale_from_amax(amax, fmax, margin, scale, delayed), scale_inv = 1 / scale, then row (row + 1) mod len set to
 * 0. The groups share the history length, the row, the rule and the margin (one fp8_state's), and name distinct
 * memory. With `step`, row is *step mod len, *step read when the op runs (the trainer's step_state.step), so the
 * same launch serves every step. */
#define FP8_UPDATE_MAX_GROUPS 4 /* a model has two (fp8_state fwd, bwd); the arguments stay a kernel's by value */

struct fp8_update_group {
    float *scale, *scale_inv; /* n fp32 in backend memory each */
    float *history;           /* len rows of n fp32 in backend memory */
    float *pending;           /* or NULL: n fp32 in backend memory, the step's amaxes, folded into the row and zeroed */
    int n;                    /* >= 1 */
    float fmax;               /* the group's largest finite value: 448 (E4M3) or 57344 (E5M2) */
};

struct fp8_update_args {
    struct fp8_update_group groups[FP8_UPDATE_MAX_GROUPS]; /* the first ngroups, by value: no array to keep alive */
    int ngroups;
    int len, row;
    bool most_recent;
    int margin;
    const int64_t *step;      /* or NULL (then `row`): one int64 in backend memory, the optimizer step */
};

struct backend {
    const char *name;         /* "cpu", "cuda:0" */
    bool host_memory;         /* backend memory is the process's own (the CPU backend): host code and MPI may
                               * read and write it directly */
    bool allow_tf32;          /* precision.tf32: fp32 GEMMs and convolutions may use TF32 tensor cores (CUDA);
                               * the CPU computes fp32 products exactly and ignores it. Default false. */

    /* memory */
    void *(*alloc)(struct backend *be, size_t bytes);          /* NULL on failure */
    void (*free)(struct backend *be, void *p);
    void (*upload)(struct backend *be, void *dst, const void *host_src, size_t bytes);
    void (*download)(struct backend *be, void *host_dst, const void *src, size_t bytes);
    void (*zero)(struct backend *be, struct tensor *t);
    void (*synchronize)(struct backend *be);

    /* batch staging (lib/engine/train.c, batch_io): host memory the device copies from while the host goes on
     * (pinned on CUDA, plain on the CPU); copies queued under one of BACKEND_STAGING_SLOTS slots; and a
     * wait for a slot's queued copies, before the host writes that slot's memory again. With two slots
     * alternated the host prepares the next batch while the device still copies the last. */
    void *(*host_alloc)(struct backend *be, size_t bytes);   /* NULL on failure */
    void (*host_free)(struct backend *be, void *p);
    void (*upload_staged)(struct backend *be, void *dst, const void *staged_src, size_t bytes, int slot);
    void (*staging_wait)(struct backend *be, int slot);
    /* Rows idx[0..n) of a host table (row_bytes each, the indices in range) to dst, one after another: the
     * batch's samples. `staged` is slot's staging memory (at least n * row_bytes), which a backend that
     * copies gathers into and uploads from as upload_staged does (CUDA); the CPU gathers straight into dst,
     * on its threads, and leaves staged alone. */
    void (*upload_rows)(struct backend *be, void *dst, const void *table, size_t row_bytes, const int64_t *idx,
                        int64_t n, void *staged, int slot);

    /* dtype conversion between two tensors of the same numel (same dtype: copy) */
    void (*convert)(struct backend *be, struct tensor *dst, const struct tensor *src);

    /* matrix products */
    void (*gemm)(struct backend *be, const struct gemm_args *args);
    /* db (n) fp32 = beta*db + column sums of dy (m, n) */
    void (*bias_grad)(struct backend *be, struct tensor *db, const struct tensor *dy, int64_t m, int64_t n, float beta);

    /* elementwise: y = act(x); dx = dy * act'(x). Any dtypes; same numel; y may be x, and dx may be dy (in
     * place: each element is read before it is written). */
    void (*act_forward)(struct backend *be, enum act_kind kind, struct tensor *y, const struct tensor *x);
    void (*act_backward)(struct backend *be, enum act_kind kind, struct tensor *dx, const struct tensor *dy,
                         const struct tensor *x);
    /* y = a + b (residual add; y's dtype is the promoted one); dx += ... is done with beta in callers */
    void (*add)(struct backend *be, struct tensor *y, const struct tensor *a, const struct tensor *b);
    /* dropout with inverted scaling 1/(1-p); mask regenerated from key in backward */
    void (*dropout_forward)(struct backend *be, struct tensor *y, const struct tensor *x, float p, struct rng_key key);
    void (*dropout_backward)(struct backend *be, struct tensor *dx, const struct tensor *dy, float p,
                             struct rng_key key);

    /* convolution (NCHW, square kernel), weights (c_out, c_in, k, k) */
    void (*conv2d_forward)(struct backend *be, const struct conv_args *a, struct tensor *y, const struct tensor *x,
                           const struct tensor *w, const struct tensor *bias /* fp32 or NULL */);
    void (*conv2d_backward_data)(struct backend *be, const struct conv_args *a, struct tensor *dx,
                                 const struct tensor *dy, const struct tensor *w);
    /* dw, db fp32 (db may be NULL): dw = beta*dw + grad */
    void (*conv2d_backward_filter)(struct backend *be, const struct conv_args *a, struct tensor *dw, struct tensor *db,
                                   const struct tensor *dy, const struct tensor *x, float beta);

    void (*pool2d_forward)(struct backend *be, const struct pool_args *a, struct tensor *y, const struct tensor *x);
    void (*pool2d_backward)(struct backend *be, const struct pool_args *a, struct tensor *dx, const struct tensor *dy,
                            const struct tensor *x, const struct tensor *y);

    /* normalisation with FP32 statistics; gamma, beta, running stats, saved mean/rstd are fp32.
     * Backward: dgamma, dbeta = beta_acc*d + grad (fp32); dx in dx's dtype. */
    void (*layernorm_forward)(struct backend *be, const struct norm_args *a, struct tensor *y, struct tensor *mean,
                              struct tensor *rstd, const struct tensor *x, const struct tensor *gamma,
                              const struct tensor *beta);
    void (*layernorm_backward)(struct backend *be, const struct norm_args *a, struct tensor *dx,
                               struct tensor *dgamma, struct tensor *dbeta, const struct tensor *dy,
                               const struct tensor *x, const struct tensor *mean, const struct tensor *rstd,
                               const struct tensor *gamma, float beta_acc);
    void (*batchnorm_forward)(struct backend *be, const struct norm_args *a, struct tensor *y, struct tensor *mean,
                              struct tensor *rstd, struct tensor *running_mean, struct tensor *running_var,
                              const struct tensor *x, const struct tensor *gamma, const struct tensor *beta);
    /* batchnorm_backward: y is the forward's output where a->relu (else NULL, unread) */
    void (*batchnorm_backward)(struct backend *be, const struct norm_args *a, struct tensor *dx,
                               struct tensor *dgamma, struct tensor *dbeta, const struct tensor *dy,
                               const struct tensor *x, const struct tensor *y, const struct tensor *mean,
                               const struct tensor *rstd, const struct tensor *gamma, float beta_acc);

    /* token + position embedding: y (B, T, C) = wte[tokens] + wpe[t]; tokens int32 (B*T) in backend memory.
     * backward: dwte, dwpe fp32 = beta*d + scatter-add of dy (deterministic order). */
    void (*embedding_forward)(struct backend *be, struct tensor *y, const int32_t *tokens, const struct tensor *wte,
                              const struct tensor *wpe, int64_t B, int64_t T, int64_t C);
    void (*embedding_backward)(struct backend *be, struct tensor *dwte, struct tensor *dwpe, const struct tensor *dy,
                               const int32_t *tokens, int64_t B, int64_t T, int64_t C, float beta);

    /* causal multi-head self-attention core. qkv (B, T, 3C) in dtype d; out (B, T, C) in d.
     * scores = Q K^T / sqrt(C/H) by a lowp GEMM (stored in d), softmax in FP32 with the causal mask,
     * probabilities stored in d in `probs` (B, H, T, T) for backward, out = probs @ V (lowp GEMM). */
    void (*attention_forward)(struct backend *be, struct tensor *out, struct tensor *probs, const struct tensor *qkv,
                              int64_t B, int64_t T, int64_t C, int64_t H);
    void (*attention_backward)(struct backend *be, struct tensor *dqkv, const struct tensor *dout,
                               const struct tensor *qkv, const struct tensor *probs, int64_t B, int64_t T, int64_t C,
                               int64_t H);

    /* causal attention over a key/value cache, for generating one sequence a few positions at a time (sampling).
     * qkv (n, 3C) in d holds positions pos..pos+n-1 (pos + n <= max_T); their K and V are first stored, in d, into
     * cache (2, H, max_T, D), D = C/H: [0] keys, [1] values, position-major per head. Then row i of out (n, C) in d
     * is, per head h, the causal attention of query i over cache positions 0..pos+i with the arithmetic of
     * attention_forward: scores q.k * (1/sqrt(D)) summed in fp32 and rounded to d, the softmax in fp32 (max, expf,
     * the sum in double, one reciprocal), probabilities rounded to d, out = sum_j p_j v_j in fp32 rounded once to
     * out's dtype. The positions of a sequence get the results a full attention_forward over it gives, up to the
     * order in which the two sum their dot products. */
    void (*attention_decode)(struct backend *be, struct tensor *out, struct tensor *cache, const struct tensor *qkv,
                             int64_t pos, int64_t n, int64_t C, int64_t H);

    /* losses, FP32. softmax cross-entropy over logits (N, K) of any dtype with int32 labels (N):
     * losses (N) fp32 per sample; dlogits (N, K) in its dtype = (softmax - onehot) * seed / N with
     * seed = *grad_seed, one fp32 in backend memory (the loss scale lives there; NULL when dlogits is);
     * correct (N) int32: 1 where argmax == label. dlogits may be NULL (eval).
     * Rows are S = logits->numel / N >= K elements apart (a vocabulary padded to vocab_align): columns K..S-1
     * are padding, left out of the max, the sum and the argmax, and their dlogits are written 0; dlogits has
     * the logits' shape. S == K is the dense case. */
    void (*xent_forward_backward)(struct backend *be, struct tensor *losses, int32_t *correct, struct tensor *dlogits,
                                  const struct tensor *logits, const int32_t *labels, int64_t N, int64_t K,
                                  const float *grad_seed);
    /* mean squared error over (N, K) against fp32 targets: losses (N) = mean_k (y-t)^2;
     * dy = 2 (y-t) seed / (N K), seed = *grad_seed as above */
    void (*mse_forward_backward)(struct backend *be, struct tensor *losses, struct tensor *dy, const struct tensor *y,
                                 const struct tensor *target, int64_t N, int64_t K, const float *grad_seed);
    /* *acc (one double in backend memory) = (accumulate ? *acc : 0) + (sum of losses[0..n), in order, in
     * double) / n: a step's loss, kept where the losses are */
    void (*loss_sum)(struct backend *be, double *acc, const struct tensor *losses, int64_t n, bool accumulate);

    /* the fused pass over all gradients (fp32), into backend memory: out gets the finite sum of squares,
     * max |g| and whether anything is non-finite; counts[t] and counts[ntensors + t] the Inf and NaN
     * elements of tensor t */
    void (*grad_stats)(struct backend *be, const struct tensor *const *grads, int ntensors, struct grad_check *out,
                       int64_t *counts);
    /* the scalars the step would update with (lib/base/step_rule.h, step_rule_propose), for the trial updates; it
     * zeroes check->update_nonfinite */
    void (*step_propose)(struct backend *be, const struct step_params *p, struct step_state *state,
                         struct grad_check *check);
    /* the step's tail (lib/base/step_rule.h, step_rule_finish) on state, check and row in backend memory */
    void (*step_finish)(struct backend *be, const struct step_params *p, struct step_state *state,
                        const struct grad_check *check, struct step_row *row);
    /* *acc (one int64 in backend memory) += the number of elements exactly zero, +0 or -0 (grad_zero_frac) */
    void (*count_zeros)(struct backend *be, const struct tensor *t, int64_t *acc);

    /* fp8 (precision.mode fp8): the scaled cast, and the delayed recipe's scale update */
    void (*fp8_cast)(struct backend *be, const struct fp8_cast_args *a);
    void (*fp8_update)(struct backend *be, const struct fp8_update_args *a);
    /* recipe blockwise's cast (NULL where the backend has none yet: the model refuses the recipe at setup) */
    void (*fp8_block_cast)(struct backend *be, const struct fp8_block_cast_args *a);

    /* optimizer updates: n parameters' in one call (the CUDA backend: one launch for all of them, as grad_stats);
     * the n entries share sc, betas, eps, momentum and nesterov, and name distinct tensors */
    void (*adamw_update)(struct backend *be, const struct optim_update_args *a, int n);
    void (*sgd_update)(struct backend *be, const struct optim_update_args *a, int n);

    /* The number of host threads the backend's ops may use (>= 1), set once by the engine after opening it
     * (run.threads). NULL where the backend has none to set (CUDA). Results do not depend on it: the CPU
     * backend splits work into chunks fixed by the problem size (docs/backend.md, "Threads"). */
    enum amp_status (*set_threads)(struct backend *be, int threads, struct amp_error *err);

    /* first error recorded, AMP_OK when none; `err` filled */
    enum amp_status (*status)(struct backend *be, struct amp_error *err);
    void (*destroy)(struct backend *be);

    /* The token head's product is (rows, Vp) with Vp the vocabulary rounded up to a multiple of this (>= 1):
     * cuBLASLt runs N = 50304 far faster than 50257. CUDA 64; the CPU 1 (no padding), or what the test switch
     * AMPTRAIN_TEST_VOCAB_ALIGN says (lib/base/test_switches.h). docs/model.md, "Vocabulary padding". */
    int vocab_align;

    /* Fused causal attention (flash attention: CUDA through cuDNN's SDPA). All three NULL where the backend has none
     * (the CPU): then attention_forward/attention_backward with probs (B, H, T, T) are the op.
     * attention_fused_supported says, for a batch of up to B sequences of qkv (B, T, 3C) in d, whether the fused
     * pair serves it; it decides which tensor attention_forward keeps for backward, so the model asks it once, at
     * setup, and allocates that tensor: where it says true, the softmax statistics `stats` (B, H, T) fp32 (row i of
     * head h: the log-sum-exp of its scaled scores over its causal keys, what the backward needs to rebuild the
     * probabilities), never (B, H, T, T). It may print one note (stderr) naming a shape it refuses.
     * attention_fused_forward: out (B, T, C) in d = causal softmax(Q K^T / sqrt(C/H)) V, Q, K, V read from qkv
     * in place; out, qkv, dout and dqkv share the dtype d. attention_fused_backward: dqkv (B, T, 3C) in d, from
     * dout, qkv, the forward's own out (unchanged since) and stats; deterministic (the same bits on every run). The
     * arithmetic is the library's (online softmax in fp32 tiles, P rounded to d before P V): within the 16-bit
     * tolerance of the present path, not its bits. */
    bool (*attention_fused_supported)(struct backend *be, int64_t B, int64_t T, int64_t C, int64_t H, enum dtype d);
    void (*attention_fused_forward)(struct backend *be, struct tensor *out, struct tensor *stats,
                                    const struct tensor *qkv, int64_t B, int64_t T, int64_t C, int64_t H);
    void (*attention_fused_backward)(struct backend *be, struct tensor *dqkv, const struct tensor *dout,
                                     const struct tensor *qkv, const struct tensor *out, const struct tensor *stats,
                                     int64_t B, int64_t T, int64_t C, int64_t H);

    /* grad_stats in two halves, for ranks that each hold part of the reduced gradient (dist.zero 1,
     * lib/engine/zero.h): grad_stats cuts every tensor into parts of grad_part_numel elements from its start (the
     * last part of a tensor may be shorter), computes each part's results (struct grad_part) and combines them in
     * tensor and part order: grad_stats is grad_stats_parts over every part, then grad_stats_combine, on the CPU and
     * on CUDA alike. grad_stats_parts writes, tensor by tensor and part by part, the results of the parts of `grads`
     * (each tensor a view that starts at a part boundary of its parameter, so its parts are the parameter's) into
     * `out`, backend memory. grad_stats_combine then combines the parts of whole tensors into what grad_stats writes
     * (out and counts in backend memory): the same bits, whichever rank computed which part. Part c in tensor and
     * part order (parts[first[t] .. first[t + 1]) are tensor t's) is parts[c], or parts[at[c]] where `at` is given
     * (the parts as ranks gathered them, in another order); parts is backend memory, first (ntensors + 1) and at
     * (first[ntensors]) host memory. A part's results depend on its elements alone, never on the tensor it was cut
     * from nor on the launch. grad_part_numel 0 and both NULL where a backend has no such split (the ranks then
     * all-gather the reduced gradient and run grad_stats on all of it). */
    size_t grad_part_numel;
    void (*grad_stats_parts)(struct backend *be, const struct tensor *const *grads, int ntensors,
                             struct grad_part *out);
    void (*grad_stats_combine)(struct backend *be, const struct grad_part *parts, const int64_t *first,
                               const int64_t *at, int ntensors, struct grad_check *out, int64_t *counts);

    /* The step's row and counts into the log window (struct window_store_args). */
    void (*window_store)(struct backend *be, const struct window_store_args *a);

    /* CUDA Graphs (docs/backend.md, "CUDA Graphs"): record a sequence of ops once and replay it. All three NULL where
     * the backend has none (the CPU) or AMPTRAIN_CUDA_GRAPHS=0. graph_begin starts recording the ops the calling
     * thread queues (nothing runs until the graph is launched); false: recording cannot start (the reason is said
     * once on stderr). graph_end stops recording and keeps the sequence as graph `key` (0 <= key < BACKEND_GRAPHS,
     * replacing one kept there); false: the recording failed (the reason is said once on stderr, nothing of it ran,
     * the backend's status is untouched, and the caller runs the ops again plainly). graph_launch queues graph
     * `key` on the backend's stream; false: none is kept under key, or it is stale (a scratch buffer it names was
     * replaced since), and nothing was queued. Between graph_begin and graph_end the caller makes no call that
     * waits (download, synchronize, staging_wait) and no upload. */
    bool (*graph_begin)(struct backend *be);
    bool (*graph_end)(struct backend *be, int key);
    bool (*graph_launch)(struct backend *be, int key);
};

#define BACKEND_GRAPHS 64 /* graph keys a backend keeps */

/* Open a backend from run.device: "auto" (a GPU if present, else the CPU), "cpu", "cuda", "cuda:N".
 * `chosen` gets a line saying which ("device: cpu (no CUDA device found)"). */
enum amp_status backend_open(struct backend **out, const char *device, char *chosen, size_t chosen_len,
                             struct amp_error *err);
/* The same for one of local_world data-parallel ranks on this host: "auto" and "cuda" take the GPU of
 * the node-local rank; fewer GPUs than ranks, or one explicit cuda:N shared by several ranks, is
 * AMP_ERR_CONFIG. */
enum amp_status backend_open_rank(struct backend **out, const char *device, int local_rank, int local_world,
                                  char *chosen, size_t chosen_len, struct amp_error *err);
void backend_close(struct backend *be);
/* be->set_threads where the backend has it (a no-op otherwise): threads 0 means auto, the CPUs this process
 * may run on (sched_getaffinity). */
enum amp_status backend_set_threads(struct backend *be, int threads, struct amp_error *err);

/* Whether be's fused attention serves a batch of up to B sequences (struct backend, attention_fused_supported):
 * false where the backend has none. */
bool backend_attention_fused(struct backend *be, int64_t B, int64_t T, int64_t C, int64_t H, enum dtype d);

/* What the devices' libraries are at run time ("CUDA loaded: driver 13.0, runtime 13.0, cuBLASLt ..., cuDNN
 * ...; 1 GPU, GPU 0: NVIDIA H200, compute capability 9.0"), for --version. */
void backend_describe_build(char *buf, size_t len);

/* The CPU backend's constructor, used by backend_open and by tests that compare backends. (The CUDA
 * backend is reached through backend_open only: it lives in a module loaded on first use,
 * lib/base/device_module.h.) */
struct backend *backend_cpu_create(void);
/* The CUDA devices there are: 0 in a CPU-only build, without the NVIDIA driver (libcuda.so.1), or when
 * the CUDA backend's module cannot be loaded. Loads the module where the driver is present. */
int backend_cuda_device_count(void);

#endif
