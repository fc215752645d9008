/*
 * model.c — the model builder, parameter init, and the forward / backward passes over the layers.
 * See model.h for the contract and docs/model.md for the layer kinds.
 *
 * model_build walks model.layers once. For each layer it hands the layer kind's setup (layers.h) the
 * shape and dtype the previous layer produces (the data's sample shape and fp32 for the first), lets
 * it check them and create its parameters and saved tensors, then allocates the layer's y (its
 * out_shape and out_dtype for max_batch samples) and dx (the input's shape and dtype; none for the
 * first layer). Every layer's backward scratch comes from one workspace sized for the largest need.
 *
 * model_init fills each parameter on the host from the counter-based generator (rng.h) with
 * stream = a hash of the parameter's name and counter = the element index, then uploads it: the
 * values depend on the seed and the names only, not on the backend or on the other layers.
 */
#include "model.h"

#include <assert.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "layers.h" /* the layer kinds' setup, struct layer_build */
#include "rng.h"    /* rng_uniform, rng_normal */

/* ---- build --------------------------------------------------------------------------------------- */

static bool is_loss(enum layer_kind k)
{
    return k == LAYER_CROSS_ENTROPY || k == LAYER_MSE;
}

static enum amp_status (*const setup_of[LAYER_KIND_COUNT])(struct layer *, struct layer_build *) = {
    [LAYER_LINEAR] = linear_setup,
    [LAYER_CONV2D] = conv2d_setup,
    [LAYER_MAXPOOL2D] = pool2d_setup,
    [LAYER_AVGPOOL2D] = pool2d_setup,
    [LAYER_FLATTEN] = flatten_setup,
    [LAYER_BATCHNORM2D] = batchnorm2d_setup,
    [LAYER_LAYERNORM] = layernorm_setup,
    [LAYER_RELU] = activation_setup,
    [LAYER_GELU] = activation_setup,
    [LAYER_DROPOUT] = dropout_setup,
    [LAYER_EMBEDDING] = embedding_setup,
    [LAYER_ATTENTION] = attention_setup,
    [LAYER_TRANSFORMER_BLOCK] = transformer_block_setup,
    [LAYER_CROSS_ENTROPY] = loss_setup,
    [LAYER_MSE] = loss_setup,
};

/* The order of the layers: a loss last, and only there. */
static enum amp_status check_layer_order(const struct config *cfg, struct amp_error *err)
{
    const struct model_config *mc = &cfg->model;
    if (mc->nlayers < 1 || !mc->layers)
        return amp_fail(err, AMP_ERR_CONFIG, "list the layers under model.layers, ending with a loss",
                        "model.layers is empty");
    for (int i = 0; i < mc->nlayers - 1; i++)
        if (is_loss(mc->layers[i].kind))
            return amp_fail(err, AMP_ERR_CONFIG, "a model has one loss, as its last layer",
                            "model.layers[%d] '%s' (%s): a loss layer must be the last one, but %d more follow",
                            i, mc->layers[i].name, layer_kind_name(mc->layers[i].kind), mc->nlayers - 1 - i);
    const struct layer_config *last = &mc->layers[mc->nlayers - 1];
    if (!is_loss(last->kind))
        return amp_fail(err, AMP_ERR_CONFIG, "end model.layers with a cross_entropy (or mse) layer",
                        "model.layers[%d] '%s' (%s): the last layer must be a loss (cross_entropy or mse)",
                        mc->nlayers - 1, last->name, layer_kind_name(last->kind));
    for (int i = 0; i < mc->nlayers; i++)
        if ((int)mc->layers[i].kind < 0 || mc->layers[i].kind >= LAYER_KIND_COUNT)
            return amp_fail(err, AMP_ERR_CONFIG, NULL, "model.layers[%d]: unknown layer kind %d", i,
                            (int)mc->layers[i].kind);
    return AMP_OK;
}

/* The first layer's input: the data's samples, fp32, or its int32 token ids. */
static void input_from_data(struct layer_build *b, const struct data_spec *spec, int64_t max_batch)
{
    b->in_shape[0] = max_batch;
    b->in_ndim = 1 + spec->sample_ndim;
    for (int i = 0; i < spec->sample_ndim; i++)
        b->in_shape[1 + i] = spec->sample_shape[i];
    for (int i = b->in_ndim; i < TENSOR_MAX_DIMS; i++)
        b->in_shape[i] = 1;
    b->in_dtype = DT_FP32;
    b->in_tokens = spec->is_tokens;
    b->in_valid = 0;
    snprintf(b->in_from, sizeof b->in_from, "the data");
}

static void input_from_layer(struct layer_build *b, const struct layer *l)
{
    b->in_ndim = l->ndim_out;
    for (int i = 0; i < TENSOR_MAX_DIMS; i++)
        b->in_shape[i] = i < l->ndim_out ? l->out_shape[i] : 1;
    b->in_dtype = l->out_dtype;
    b->in_tokens = false;
    b->in_valid = l->out_valid;
    snprintf(b->in_from, sizeof b->in_from, "model.layers[%d] '%s' (%s)", l->index, l->cfg.name,
             layer_kind_name(l->cfg.kind));
}

/* Set up layer l on input b->in_*, then allocate its y and dx. */
static enum amp_status build_layer(struct model *m, struct layer *l, struct layer_build *b)
{
    if (b->in_tokens && l->cfg.kind != LAYER_EMBEDDING) {
        char got[96];
        return layer_fail(l, b, "start model.layers with an embedding layer",
                          "the data gives token ids %s: the first layer must be an embedding",
                          shape_str_n(got, sizeof got, b->in_ndim, b->in_shape));
    }
    b->y_is_view = false;
    b->scratch_bytes = 0;
    enum amp_status st = setup_of[l->cfg.kind](l, b);
    if (st != AMP_OK)
        return st;
    if (!b->y_is_view) {
        st = layer_alloc(l, b, &l->y, l->out_dtype, l->ndim_out, l->out_shape, "output");
        if (st == AMP_OK && l->needs_dx && !l->dx_is_input)
            st = layer_alloc(l, b, &l->dx, b->in_dtype, b->in_ndim, b->in_shape, "input gradient");
        if (st != AMP_OK)
            return st;
    }
    if (l->cfg.kind == LAYER_CROSS_ENTROPY) {
        m->correct = m->be->alloc(m->be, (size_t)l->out_shape[0] * sizeof(int32_t));
        if (!m->correct)
            return amp_fail(b->err, AMP_ERR_INTERNAL, NULL, "out of memory allocating the correct-prediction marks");
        loss_set_correct(l, m->correct);
    }
    return AMP_OK;
}

/* m->params and m->buffers: pointers into the layers, in layer order. */
static enum amp_status gather_params(struct model *m, struct amp_error *err)
{
    int np = 0, nb = 0;
    for (int i = 0; i < m->nlayers; i++) {
        np += m->layers[i].nparams;
        nb += m->layers[i].nbuffers;
    }
    m->params = calloc((size_t)(np ? np : 1), sizeof *m->params);
    m->buffers = calloc((size_t)(nb ? nb : 1), sizeof *m->buffers);
    if (!m->params || !m->buffers)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory listing the model's parameters");
    for (int i = 0; i < m->nlayers; i++) {
        for (int j = 0; j < m->layers[i].nparams; j++)
            m->params[m->nparams++] = &m->layers[i].params[j];
        for (int j = 0; j < m->layers[i].nbuffers; j++)
            m->buffers[m->nbuffers++] = &m->layers[i].buffers[j];
    }
    return AMP_OK;
}

/* Move every parameter's gradient into one zeroed allocation (struct model, grad_flat). */
static enum amp_status flatten_grads(struct model *m, struct amp_error *err)
{
    const size_t align = 64; /* floats: 256 bytes */
    size_t total = 0; /* a padded head's gradient takes its storage's rows (struct param, stored_rows) */
    for (int i = 0; i < m->nparams; i++)
        total += (param_stored(m->params[i], &m->params[i]->grad).numel + align - 1) / align * align;
    if (total == 0)
        return AMP_OK;
    struct tensor flat;
    int64_t n = (int64_t)total;
    enum amp_status st = tensor_zeros(&flat, m->be, DT_FP32, 1, &n, "flat gradient buffer", err);
    if (st != AMP_OK)
        return st;
    m->grad_flat = flat.data;
    m->grad_flat_count = total;
    size_t off = 0;
    for (int i = 0; i < m->nparams; i++) {
        struct tensor *g = &m->params[i]->grad;
        if (g->data)
            g->be->free(g->be, g->data);
        g->data = m->grad_flat + off;
        off += (param_stored(m->params[i], g).numel + align - 1) / align * align;
    }
    return AMP_OK;
}

/* The layers whose products may run in fp8 hold a linear op; precision.fp8.keep_bf16 keeps some in bf16 by
 * name, or as `first` / `last`: the first and last layers that hold parameters. */
static bool holds_linear(enum layer_kind k)
{
    return k == LAYER_LINEAR || k == LAYER_ATTENTION || k == LAYER_TRANSFORMER_BLOCK;
}

static bool holds_params(enum layer_kind k)
{
    return holds_linear(k) || k == LAYER_CONV2D || k == LAYER_BATCHNORM2D || k == LAYER_LAYERNORM ||
           k == LAYER_EMBEDDING;
}

bool model_layer_in_fp8(const struct config *cfg, int i)
{
    const struct model_config *mc = &cfg->model;
    if (cfg->precision.mode != PREC_FP8 || !holds_linear(mc->layers[i].kind))
        return false;
    int first = -1, last = -1;
    for (int j = 0; j < mc->nlayers; j++)
        if (holds_params(mc->layers[j].kind)) {
            if (first < 0)
                first = j;
            last = j;
        }
    const struct fp8_config *f = &cfg->precision.fp8;
    for (int k = 0; k < f->nkeep_bf16; k++) {
        const char *name = f->keep_bf16[k];
        if ((!strcmp(name, "first") && i == first) || (!strcmp(name, "last") && i == last) ||
            !strcmp(name, mc->layers[i].name))
            return false;
    }
    return true;
}

enum amp_status model_build(struct model *m, const struct config *cfg, const struct data_spec *spec,
                            struct backend *be, const struct autocast_policy *policy, int64_t max_batch,
                            struct amp_error *err)
{
    struct amp_error local;
    if (!err)
        err = &local;
    memset(m, 0, sizeof *m);
    m->be = be;
    m->policy = *policy;
    m->max_batch = max_batch;
    if (max_batch < 1)
        return amp_fail(err, AMP_ERR_CONFIG, "set data.batch_size >= 1", "model: batch size %lld",
                        (long long)max_batch);
    enum amp_status st = check_layer_order(cfg, err);
    if (st != AMP_OK)
        return st;

    m->workspace = calloc(1, sizeof *m->workspace);
    m->layers = calloc((size_t)cfg->model.nlayers, sizeof *m->layers);
    if (!m->workspace || !m->layers) {
        model_free(m);
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory building the model");
    }
    m->nlayers = cfg->model.nlayers;
    struct layer_build b = {
        .be = be, .policy = &m->policy, .master_dtype = cfg->precision.master_weights == STORE_BF16 ? DT_BF16 : DT_FP32,
        .spec = spec, .max_batch = max_batch, .seq_len = cfg->data.seq_len,
        .workspace = m->workspace, .accumulates = cfg->accum_steps > 1, .fp8 = &m->fp8, .err = err,
        .fuse = cfg->run.numerics_every == 0,
        .recompute = cfg->run.recompute,
    };
    m->has_fp8 = m->policy.enabled && m->policy.fp8;
    const struct fp8_config *f8 = &cfg->precision.fp8;
    m->fp8 = (struct fp8_state){ .recipe = f8->recipe == FP8_RECIPE_CURRENT ? FP8_CURRENT
                                         : f8->recipe == FP8_RECIPE_BLOCKWISE ? FP8_BLOCKWISE : FP8_DELAYED,
                                 .len = (int)f8->amax_history_len, .most_recent = f8->amax_compute == FP8_AMAX_MOST_RECENT,
                                 .margin = (int)f8->margin, .min_k = (int64_t)f8->min_size[0],
                                 .min_n = (int64_t)f8->min_size[1] };
    if (m->has_fp8 && m->fp8.recipe == FP8_BLOCKWISE && !be->fp8_block_cast) {
        model_free(m);
        return amp_fail(err, AMP_ERR_CONFIG, "use run.device: cpu, or precision.fp8.recipe: delayed or current",
                        "precision.fp8.recipe: blockwise is not available on backend %s (its block-scaled casts and "
                        "products are not implemented there yet)", be->name);
    }
    input_from_data(&b, spec, max_batch);
    size_t scratch = 0;
    bool params_before = false; /* a layer before this one has parameters: its input gradient has a use */
    for (int i = 0; i < m->nlayers; i++) {
        struct layer *l = &m->layers[i];
        l->cfg = cfg->model.layers[i];
        l->index = i;
        l->needs_dx = params_before || (i > 0 && spec->input_grad);
        b.fp8_layer = m->has_fp8 && model_layer_in_fp8(cfg, i);
        /* the token head: padded where the backend asks, except under the numerics report, which measures the
         * logits and their gradient as they are (docs/model.md, "Vocabulary padding") */
        bool head = i + 1 < m->nlayers && cfg->model.layers[i + 1].kind == LAYER_CROSS_ENTROPY && spec->is_tokens;
        b.vocab_align = head && b.fuse && be->vocab_align > 1 ? be->vocab_align : 1;
        b.built = m->layers;
        b.nbuilt = i;
        if ((st = build_layer(m, l, &b)) != AMP_OK) {
            model_free(m);
            return st;
        }
        if (b.scratch_bytes > scratch)
            scratch = b.scratch_bytes;
        params_before = params_before || l->nparams > 0;
        input_from_layer(&b, l);
    }
    int64_t words = (int64_t)((scratch + 3) / 4);
    st = tensor_alloc(m->workspace, be, DT_FP32, 1, &words, "backward workspace", err);
    if (st == AMP_OK && m->has_fp8)
        st = fp8_alloc(&m->fp8, be, err);
    if (st == AMP_OK)
        st = gather_params(m, err);
    if (st == AMP_OK)
        st = flatten_grads(m, err);
    if (st != AMP_OK)
        model_free(m);
    return st;
}

/* ---- init ---------------------------------------------------------------------------------------- */

/* FNV-1a of the parameter's name: its random stream. */
static uint64_t name_stream(const char *name)
{
    uint64_t h = 0xcbf29ce484222325ULL;
    for (const unsigned char *c = (const unsigned char *)name; *c; c++)
        h = (h ^ *c) * 0x100000001b3ULL;
    return h;
}

static void fill_uniform(float *v, size_t n, uint64_t seed, uint64_t stream, float bound)
{
    for (size_t i = 0; i < n; i++)
        v[i] = (2.0f * rng_uniform(seed, stream, i) - 1.0f) * bound;
}

static void fill_normal(float *v, size_t n, uint64_t seed, uint64_t stream, float std)
{
    for (size_t i = 0; i < n; i++)
        v[i] = rng_normal(seed, stream, i) * std;
}

static void fill_constant(float *v, size_t n, float c)
{
    for (size_t i = 0; i < n; i++)
        v[i] = c;
}

/* PyTorch's default for linear and conv: kaiming_uniform(a = sqrt(5)) gives the bound
 * gain * sqrt(3 / fan_in) with gain = sqrt(2 / (1 + 5)), i.e. 1 / sqrt(fan_in); biases use the same. */
static float fan_in_bound(const struct param *p)
{
    return p->fan_in > 0 ? (float)(1.0 / sqrt((double)p->fan_in)) : 0.0f;
}

static void init_param_host(const struct param *p, float *v, uint64_t seed, enum init_scheme scheme, int n_blocks)
{
    size_t n = p->master.numel;
    uint64_t stream = name_stream(p->name);
    bool gpt2 = scheme == INIT_GPT2;
    switch (p->init) {
    case PINIT_LINEAR_WEIGHT:
        if (gpt2)
            fill_normal(v, n, seed, stream, 0.02f);
        else
            fill_uniform(v, n, seed, stream, fan_in_bound(p));
        break;
    case PINIT_RESIDUAL_WEIGHT:
        if (gpt2)
            fill_normal(v, n, seed, stream, (float)(0.02 / sqrt(2.0 * n_blocks)));
        else
            fill_uniform(v, n, seed, stream, fan_in_bound(p));
        break;
    case PINIT_LINEAR_BIAS:
        if (gpt2)
            fill_constant(v, n, 0.0f);
        else
            fill_uniform(v, n, seed, stream, fan_in_bound(p));
        break;
    case PINIT_CONV_WEIGHT:
    case PINIT_CONV_BIAS:
        fill_uniform(v, n, seed, stream, fan_in_bound(p));
        break;
    case PINIT_NORM_GAIN:
        fill_constant(v, n, 1.0f);
        break;
    case PINIT_NORM_SHIFT:
        fill_constant(v, n, 0.0f);
        break;
    case PINIT_EMBEDDING:
        fill_normal(v, n, seed, stream, gpt2 ? 0.02f : 1.0f);
        break;
    }
}

/* Residual projections are scaled by the number of attention sublayers (GPT-2: 2 per block counts
 * the attention and mlp branches: 1/sqrt(2 * n_blocks)). */
static int count_blocks(const struct model *m)
{
    int n = 0;
    for (int i = 0; i < m->nlayers; i++)
        if (m->layers[i].cfg.kind == LAYER_TRANSFORMER_BLOCK || m->layers[i].cfg.kind == LAYER_ATTENTION)
            n++;
    return n > 0 ? n : 1;
}

/* Batchnorm's running variance starts at 1, every other buffer (running means) at 0. */
static float buffer_init_value(const struct buffer *b)
{
    const char *suffix = "/running_var";
    size_t ln = strlen(b->name), ls = strlen(suffix);
    return ln >= ls && strcmp(b->name + ln - ls, suffix) == 0 ? 1.0f : 0.0f;
}

enum amp_status model_init(struct model *m, const struct config *cfg, uint64_t seed, struct amp_error *err)
{
    size_t most = 1;
    for (int i = 0; i < m->nparams; i++)
        if (m->params[i]->master.numel > most)
            most = m->params[i]->master.numel;
    for (int i = 0; i < m->nbuffers; i++)
        if (m->buffers[i]->t.numel > most)
            most = m->buffers[i]->t.numel;
    float *host = malloc(most * sizeof *host);
    if (!host)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory initialising the parameters");
    int n_blocks = count_blocks(m);
    for (int i = 0; i < m->nparams; i++) {
        struct param *p = m->params[i];
        init_param_host(p, host, seed, cfg->model.init, n_blocks);
        tensor_from_host_f32(&p->master, host);
        m->be->zero(m->be, &p->grad);
    }
    for (int i = 0; i < m->nbuffers; i++) {
        struct buffer *b = m->buffers[i];
        fill_constant(host, b->t.numel, buffer_init_value(b));
        tensor_from_host_f32(&b->t, host);
    }
    free(host);
    model_refresh_copies(m);
    return AMP_OK;
}

void model_refresh_copies(struct model *m)
{
    for (int i = 0; i < m->nparams; i++) {
        struct param *p = m->params[i];
        if (p->copy.data && !p->master_block) /* a block's copy is the optimizer's to refresh (dist.zero 1) */
            m->be->convert(m->be, &p->copy, &p->master);
    }
}

/* ---- passes -------------------------------------------------------------------------------------- */

static const struct tensor *layer_input(const struct model *m, int i, const struct batch *b)
{
    return i == 0 ? &b->x : &m->layers[i - 1].y;
}

void model_forward(struct model *m, const struct step_ctx *ctx, const struct batch *b)
{
    for (int i = 0; i < m->nlayers; i++) {
        struct layer *l = &m->layers[i];
        l->ops->forward(l, ctx, layer_input(m, i, b), b);
    }
}

void model_backward(struct model *m, const struct step_ctx *ctx, const struct batch *b)
{
    for (int i = m->nlayers - 1; i >= 0; i--) {
        struct layer *l = &m->layers[i];
        const struct tensor *dy = i == m->nlayers - 1 ? NULL : &m->layers[i + 1].dx;
        l->ops->backward(l, ctx, dy, layer_input(m, i, b), b);
        /* a view's dx (flatten's, a fused relu's) is its neighbour's gradient: counted there */
        if (l->needs_dx && !l->is_view)
            count_grad_zeros_padded(ctx, &l->dx, l->out_dtype != DT_FP32, i > 0 ? m->layers[i - 1].out_valid : 0);
        if (l->nparams > 0)
            grads_final(ctx, &l->params[0]);
    }
}

enum amp_status model_decode_begin(struct model *m, int64_t *context, struct amp_error *err)
{
    const struct layer *first = &m->layers[0], *loss = &m->layers[m->nlayers - 1];
    if (first->cfg.kind != LAYER_EMBEDDING || loss->cfg.kind != LAYER_CROSS_ENTROPY || m->nlayers < 3)
        return amp_fail(err, AMP_ERR_CONFIG, "sample a text or token model: an embedding first, cross_entropy last",
                        "the model cannot generate text: its first layer is '%s' (%s) and its last '%s' (%s)",
                        first->cfg.name, layer_kind_name(first->cfg.kind), loss->cfg.name,
                        layer_kind_name(loss->cfg.kind));
    for (int i = 0; i < m->nlayers - 1; i++) {
        struct layer *l = &m->layers[i];
        if (!l->ops->decode)
            return amp_fail(err, AMP_ERR_CONFIG, "generation runs embedding, transformer_block, attention, "
                            "layernorm, linear, dropout, relu and gelu layers",
                            "model.layers[%d] '%s' (%s) cannot generate", i, l->cfg.name,
                            layer_kind_name(l->cfg.kind));
        enum amp_status st = l->ops->cache_alloc ? l->ops->cache_alloc(l, m->be, err) : AMP_OK;
        if (st != AMP_OK)
            return st;
    }
    *context = first->out_shape[1];
    return AMP_OK;
}

void model_decode(struct model *m, const struct step_ctx *ctx, const struct decode_step *d, struct tensor *logits)
{
    assert(!ctx->training && d->n >= 1 && d->pos + d->n <= m->layers[0].out_shape[1]);
    for (int i = 0; i < m->nlayers - 1; i++) {
        struct layer *l = &m->layers[i];
        l->ops->decode(l, ctx, i == 0 ? NULL : &m->layers[i - 1].y, d);
    }
    *logits = m->layers[m->nlayers - 2].y;
    /* the layers' outputs back to their full shapes: the forward's batch views keep their trailing dimensions */
    for (int i = 0; i < m->nlayers - 1; i++) {
        struct layer *l = &m->layers[i];
        l->y = tensor_reshape(&l->y, l->ndim_out, l->out_shape);
    }
}

int64_t model_loss_rows(const struct model *m, int64_t n)
{
    return n * loss_rows_per_sample(&m->layers[m->nlayers - 1]);
}

/* ---- free ---------------------------------------------------------------------------------------- */

static void layer_free(struct layer *l, const float *grad_flat)
{
    if (l->ops && l->ops->free_priv)
        l->ops->free_priv(l);
    free(l->priv);
    for (int j = 0; j < l->nparams; j++) {
        tensor_free(&l->params[j].master);
        if (!grad_flat) /* else a view into the model's grad_flat */
            tensor_free(&l->params[j].grad);
        tensor_free(&l->params[j].copy);
        tensor_free(&l->params[j].tied_grad);
    }
    free(l->params);
    for (int j = 0; j < l->nbuffers; j++)
        tensor_free(&l->buffers[j].t);
    free(l->buffers);
    if (!l->is_view) { /* a view's y and dx are its neighbours' */
        tensor_free(&l->y);
        if (!l->dx_is_input)
            tensor_free(&l->dx);
    }
}

void model_free(struct model *m)
{
    if (!m)
        return;
    for (int i = 0; i < m->nlayers; i++)
        layer_free(&m->layers[i], m->grad_flat);
    free(m->layers);
    free(m->params);
    free(m->buffers);
    if (m->grad_flat)
        m->be->free(m->be, m->grad_flat);
    if (m->correct)
        m->be->free(m->be, m->correct);
    if (m->workspace) {
        tensor_free(m->workspace);
        free(m->workspace);
    }
    fp8_free(&m->fp8);
    memset(m, 0, sizeof *m);
}
