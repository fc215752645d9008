/*
 * model.h — a model built from `model.layers`: shape and dtype inference, parameter init, forward,
 * backward, the low-precision weight copies.
 *
 * model_build infers every layer's shape from the data's sample shape; a mismatch is a config error
 * naming the layer and both shapes. model_init fills parameters from the run seed (PyTorch's defaults
 * for linear and conv — kaiming-uniform(a=sqrt(5)) weights, uniform(±1/sqrt(fan_in)) biases; GPT-2's
 * normal(0, 0.02) when model.init is gpt2, with residual projections scaled by 1/sqrt(2*n_blocks)),
 * on the host from a counter-based generator, so it does not depend on the backend.
 */
#ifndef AMP_MODEL_H
#define AMP_MODEL_H

#include "data.h"  /* struct data_spec: the samples a model is built for */
#include "layer.h" /* struct layer, struct param, struct batch, struct step_ctx */

struct model {
    struct layer *layers;          /* the last one is the loss */
    int nlayers;
    struct param **params;         /* every parameter, in layer order (pointers into layers[i].params) */
    int nparams;
    struct buffer **buffers;       /* every buffer, in layer order */
    int nbuffers;
    int64_t max_batch;
    struct backend *be;
    struct autocast_policy policy;
    int32_t *correct;              /* int32 per loss row, 1 where argmax == label (cross_entropy; NULL for mse) */
    struct tensor *workspace;      /* scratch shared by every layer's backward (models/layers.h) */
    /* Every parameter's fp32 gradient lives in this one backend allocation, in parameter order, each
     * starting on a 256-byte boundary (zeros between): a data-parallel step reduces it in one go. */
    float *grad_flat;
    size_t grad_flat_count;        /* floats, padding included */
    /* precision.mode fp8 under an enabled policy: the scales and amax histories of every fp8 tensor (lib/base/fp8.h);
     * has_fp8 false (and fp8 empty) otherwise */
    bool has_fp8;
    struct fp8_state fp8;
};

/* Build (allocating every tensor for max_batch samples) and check shapes. */
enum amp_status model_build(struct model *m, const struct config *cfg, const struct data_spec *spec,
                            struct backend *be, const struct autocast_policy *policy, int64_t max_batch,
                            struct amp_error *err);

/* Initialise parameters and buffers from `seed` (deterministic, backend-independent). */
/* Whether layer i's linear products run in fp8 under cfg (precision.mode fp8, precision.fp8.keep_bf16). */
bool model_layer_in_fp8(const struct config *cfg, int i);

enum amp_status model_init(struct model *m, const struct config *cfg, uint64_t seed, struct amp_error *err);

/* Refresh every parameter's copy (param.copy: the dtype its ops read) from its master (after init and load; the
 * optimizer refreshes them in its update pass). */
void model_refresh_copies(struct model *m);

/* Forward through all layers and the loss. Per-row losses land in the loss layer's y (fp32); for
 * cross_entropy the rows are samples (or tokens for text) and m->correct marks right predictions. */
void model_forward(struct model *m, const struct step_ctx *ctx, const struct batch *b);

/* Backward from the loss (seeded with ctx->grad_seed) to the first layer; parameter gradients
 * overwrite or accumulate per ctx->accumulate. ctx->hook, where set, is told as they become final (layer.h). */
void model_backward(struct model *m, const struct step_ctx *ctx, const struct batch *b);

/* ---- generation (ampTrain sample) ----
 * A token model (an embedding first, a cross_entropy last) generates one sequence with a key/value cache: the
 * prompt's positions in one model_decode call (the prefill), then one position per call, each attending to the
 * cached keys and values of the positions before it. The context is the model's sequence length T (data.seq_len):
 * positions 0..T-1. */

/* Check that every layer can generate (AMP_ERR_CONFIG naming the first that cannot), allocate the attention
 * layers' caches (AMP_ERR_INTERNAL when out of memory), and give the context length T. */
enum amp_status model_decode_begin(struct model *m, int64_t *context, struct amp_error *err);

/* The forward of positions d->pos .. d->pos + d->n - 1 (d->pos + d->n <= T; every position before d->pos given by
 * earlier calls): *logits becomes a view (1, n, vocab) of the last layer before the loss, in its dtype, valid until
 * the next pass. ctx->training must be false. */
void model_decode(struct model *m, const struct step_ctx *ctx, const struct decode_step *d, struct tensor *logits);

/* Number of loss rows of a batch of n samples (n, or n*T for text). */
int64_t model_loss_rows(const struct model *m, int64_t n);

void model_free(struct model *m);

#endif
