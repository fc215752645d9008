/*
 * layer.h — one layer of a model: its parameters, its activations, forward and backward.
 *
 * Layers call only backend operations (backend.h). Each layer owns its output activation `y` and the
 * gradient of its input `dx`, allocated once by the model builder for the largest batch; a smaller
 * batch (the last eval batch) uses views of them. A layer runs in the dtype the autocast policy gives
 * its op kind (autocast.h); backward runs in its forward's dtype. Weight gradients are FP32 and
 * accumulate across the micro-batches of one optimizer step (ctx->accumulate).
 *
 * Parameter names are "LAYER/PARAM" ("fc1/weight"), the same path the checkpoint uses under /model.
 *
 * Dtypes are fixed when the model is built, from the model's policy (model_build); ctx->policy is
 * not consulted again. A run that evaluates under another policy (eval --autocast off) builds its
 * own model. docs/model.md lists the layer kinds, their shapes, parameters and dtypes.
 */
#ifndef AMP_LAYER_H
#define AMP_LAYER_H

#include <stdbool.h>
#include <stdint.h>

#include "autocast.h" /* struct autocast_policy, enum op_kind */
#include "backend.h"  /* struct backend, struct tensor, struct rng_key */
#include "config.h"   /* struct layer_config */
#include "fp8.h"      /* struct fp8_pass, fp8_slot */

/* How model_init fills a parameter (model.h): the rule depends on what the tensor is, not on its layer. */
enum param_init {
    PINIT_LINEAR_WEIGHT,   /* pytorch: U(+-1/sqrt(fan_in)); gpt2: N(0, 0.02) */
    PINIT_RESIDUAL_WEIGHT, /* a linear whose output joins the residual stream (attention proj, mlp proj):
                            * pytorch: as a linear weight; gpt2: N(0, 0.02/sqrt(2*n_blocks)) */
    PINIT_LINEAR_BIAS,     /* pytorch: U(+-1/sqrt(fan_in)); gpt2: 0 */
    PINIT_CONV_WEIGHT,     /* U(+-1/sqrt(fan_in)) under both schemes (GPT-2 has no convolutions) */
    PINIT_CONV_BIAS,       /* U(+-1/sqrt(fan_in)) under both schemes */
    PINIT_NORM_GAIN,       /* 1 */
    PINIT_NORM_SHIFT,      /* 0 */
    PINIT_EMBEDDING        /* pytorch: N(0, 1) (nn.Embedding); gpt2: N(0, 0.02) */
};

struct param {
    char name[96];        /* "LAYER/PARAM" */
    struct tensor master; /* the weights: fp32, or bf16 with precision.master_weights: bf16; with master_block, only
                           * this rank's block of them, flat */
    struct tensor grad;   /* fp32 gradient, accumulated over micro-batches */
    struct tensor copy;   /* the weights in the dtype the ops read them in (the run's fp16/bf16 for a lowp op's
                           * weight, fp32 for a bias, a norm gain or an embedding table) where that is not
                           * master's dtype, made once per optimizer step; empty where the ops read master */
    bool master_block;    /* dist.zero 1 (lib/engine/zero.h): master holds only the elements [lo, hi) this rank
                           * updates (its optimizer state's), 1-D; copy, which the ops read, stays whole. Only where
                           * param_master_private */
    bool decay;           /* weight decay applies (weights: yes; biases, norm and embedding gains: no) */
    int layer;            /* index of the owning layer, for overflow attribution */
    enum param_init init; /* how model_init fills master */
    int64_t fan_in;       /* inputs per output unit, for the fan-in rules */
    bool tied;            /* also read by a later layer (a linear's `tie`): that layer's backward runs first and
                           * writes the micro-batch's gradient, the owner's backward adds its part, so grad is the
                           * sum of both uses */
    struct tensor tied_grad; /* tied, accum_steps > 1: one micro-batch's gradient (fp32), both uses summed, before it
                              * is added to grad: grad += (head + table), the order in which two ranks' all-reduce
                              * adds them, so one rank with accumulation gives their bits; empty otherwise */
    int64_t stored_rows;  /* 0, or the rows along dim 0 that master, grad, copy and tied_grad hold in memory, more
                           * than shape[0]: the token head's padded vocabulary (docs/model.md, "Vocabulary
                           * padding"). The tensors' shape and numel are the logical ones, a prefix of the storage
                           * (row-major); the rows past it are zero. Only the head's product reads them
                           * (param_stored); everything else walks the logical tensor. */
};

/* t (one of p's tensors, not a master block) as its storage holds it: (stored_rows, ...) where p is padded. */
static inline struct tensor param_stored(const struct param *p, const struct tensor *t)
{
    struct tensor v = *t;
    if (p->stored_rows > v.shape[0] && v.shape[0] > 0) {
        v.numel = v.numel / (size_t)v.shape[0] * (size_t)p->stored_rows;
        v.shape[0] = p->stored_rows;
    }
    return v;
}

/* The tensor the ops read: the copy where there is one, else master. */
static inline const struct tensor *param_value(const struct param *p)
{
    return p->copy.data ? &p->copy : &p->master;
}

/* Whether the ops never read master, only the copy: the optimizer alone reads it, so it may be sharded over ranks
 * (dist.zero 1). A tied weight is read as master too (the embedding's fp32 lookup, or an fp8 product's cast). */
static inline bool param_master_private(const struct param *p)
{
    return p->copy.data && !p->tied;
}

/* The parameter's number of elements (master's, or the copy's where master is a block). */
static inline size_t param_numel(const struct param *p)
{
    return p->master_block ? p->copy.numel : p->master.numel;
}

/* The weights in dtype `dt`: master, or the copy, whichever has it (a tied parameter is read in two dtypes:
 * fp32 by the embedding, the run's low precision by the linear that ties it). */
static inline const struct tensor *param_value_as(const struct param *p, enum dtype dt)
{
    return p->master.dtype == dt ? &p->master : &p->copy;
}


/* Non-trainable state that is checkpointed (batchnorm running mean and variance), fp32. */
struct buffer {
    char name[96];
    struct tensor t;
    bool nonneg;             /* a variance: a checkpoint holding a negative value is refused */
};

/* Zero count of low-precision activation gradients (scale_log.csv's grad_zero_frac). */
struct grad_zeros {
    int64_t *zeros;       /* one int64 in backend memory: count_zeros adds to it */
    int64_t total;        /* elements counted (host), a padded vocabulary's columns left out */
    int64_t padding;      /* zeros the device count includes that are a padded vocabulary's dlogits columns (written
                           * 0, docs/model.md): the trainer takes them off the count it downloads (host) */
};

/* Told during a backward as parameters' gradients become final: after grads_final(user, first), the rest of this
 * backward writes no gradient of `first` nor of any parameter after it in the model's order (struct model, params;
 * their gradients lie in that order in grad_flat). The model tells it after each layer (first: the layer's first
 * parameter) and a composite layer also inside its backward, after each inner op that writes the last parameters'
 * gradients not yet told (a transformer block: after its MLP's second linear, its first, ln2, the attention's
 * output projection, qkv), so each call names an earlier parameter than the one before. A tied weight belongs to
 * its embedding, whose backward, the last, adds to what the linear that also reads it wrote. On a backend with a
 * queue (CUDA) the gradients are then queued, not yet computed: a reader orders itself after the backend's queue.
 * The data-parallel trainer supplies one (lib/engine/dist_overlap.h); the layers know nothing of what it does. */
struct backward_hook {
    void (*grads_final)(void *user, const struct param *first);
    void *user;
};

/* What one forward/backward pass needs to know. */
struct step_ctx {
    struct backend *be;
    const struct autocast_policy *policy;
    bool training;        /* dropout active, batchnorm batch statistics */
    struct rng_key key;   /* seed and counter of this micro-batch; layers set .stream to their index */
    const float *grad_seed; /* d(loss)/d(loss) = scale / accum_steps: one fp32 in backend memory (the step
                           * rule writes it there, lib/base/step_rule.h); NULL when not training */
    bool accumulate;      /* weight gradients: add to (true) or overwrite (false, first micro-batch) */
    bool loss_in_backward; /* model_backward follows this model_forward: the loss layer computes the losses there,
                            * with its gradient, in one op, and its forward does nothing (the trainer's steps) */
    const struct fp8_pass *fp8; /* precision.mode fp8: the scales and where this pass records amaxes; else NULL */
    struct grad_zeros *zeros; /* non-NULL: backward adds the zeros of every activation gradient computed in
                               * fp16/bf16 (model_backward: each layer's dx; composite layers: their inner ones) */
    const struct backward_hook *hook; /* non-NULL: backward tells it of the gradients made final (above) */
};

/* A batch in backend memory. Exactly one of x / tokens is set. */
struct batch {
    int64_t n;            /* samples in this batch (<= the model's max batch) */
    struct tensor x;      /* fp32 inputs (n, ...) for image/array data */
    int32_t *tokens;      /* int32 (n, T) token ids for text */
    int32_t *labels;      /* int32 class labels (n) or next tokens (n, T) for cross_entropy */
    struct tensor target; /* fp32 regression targets (n, K) for mse */
};

/* One call of generation (model_decode): n new positions pos..pos+n-1 of one sequence (a prompt's prefill, then
 * one position at a time). */
struct decode_step {
    int64_t pos, n;
    const int32_t *tokens; /* int32 (n) in backend memory: the new positions' token ids */
};

struct layer;

struct layer_ops {
    /* forward: read x (the previous layer's y, or the batch input), write l->y */
    void (*forward)(struct layer *l, const struct step_ctx *ctx, const struct tensor *x, const struct batch *b);
    /* backward: read dy (the next layer's dx; NULL for the loss layer), x as in forward; write l->dx
     * (unless this is the first layer, when dx may be left unallocated) and the parameter gradients */
    void (*backward)(struct layer *l, const struct step_ctx *ctx, const struct tensor *dy, const struct tensor *x,
                     const struct batch *b);
    void (*free_priv)(struct layer *l);
    /* generation, not training: the forward of d's positions alone, x and y (1, n, ...) views; a layer with
     * attention attends to the positions before them through its key/value cache, and stores theirs there.
     * NULL where the kind cannot generate (model_decode_begin says which). */
    void (*decode)(struct layer *l, const struct step_ctx *ctx, const struct tensor *x, const struct decode_step *d);
    /* a layer with attention: allocate its key/value cache (once; freed with the layer). NULL for the others. */
    enum amp_status (*cache_alloc)(struct layer *l, struct backend *be, struct amp_error *err);
};

struct layer {
    const struct layer_ops *ops;
    struct layer_config cfg;
    int index;
    enum op_kind op;         /* autocast op kind of the layer's main op (transformer_block: linear;
                                flatten, a view with no op: OP_KIND_COUNT) */
    int ndim_out;
    int64_t out_shape[TENSOR_MAX_DIMS]; /* per max batch: out_shape[0] is the max batch (for the loss
                                           layer, the max loss rows: max batch, or max batch * T for text) */
    enum dtype out_dtype;    /* dtype of y under the model's policy */
    struct param *params;
    int nparams;
    struct buffer *buffers;
    int nbuffers;
    struct tensor y;         /* output activation (for the loss layer: per-row losses, fp32); after a
                                pass, a view with the pass's batch size; flatten: a view of its input */
    struct tensor dx;        /* gradient of the input, in the input's dtype; flatten: a view of dy */
    bool needs_dx;           /* false up to the first layer with parameters (and its dx never allocated): no
                                gradient goes further back, unless data_spec.input_grad asks for it */
    bool is_view;            /* y and dx are views of x and dy, nothing computed: flatten; a relu fused into
                                the batchnorm2d or linear layer before it (layer_build.fuse) */
    bool dx_is_input;        /* dx is written over x, the layer before's y (cross_entropy's dlogits over the logits):
                                a view, not the layer's own tensor */
    int64_t out_valid;       /* 0, or the logical size of y's last dimension where out_shape's is padded (the token
                                head's vocabulary V of Vp columns: docs/model.md, "Vocabulary padding") */
    void *priv;              /* layer-private saved tensors (masks, statistics, attention probabilities) */
};

/* The size of y's last dimension that holds results: the vocabulary for a padded token head. */
static inline int64_t layer_out_cols(const struct layer *l)
{
    return l->out_valid > 0 ? l->out_valid : l->out_shape[l->ndim_out - 1];
}

#endif
