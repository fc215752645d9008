/*
 * test_attention_fused.c — the seam of the fused attention (backend.h attention_fused_*, models/attention.c's core)
 * on the CPU. The CPU backend has no fused attention; here its table is given a stand-in that reports one for
 * 16-bit shapes and computes it with the CPU's own attention op (probabilities in memory of its own, thrown away
 * after each call), so the model's side can be checked without a GPU: what a core allocates (the statistics
 * (B, H, T) fp32 instead of the probabilities (B, H, T, T)), that forward and backward reach the fused pair with the
 * tensors the contract names (the statistics the forward wrote, the forward's own output), the same bits as the
 * present path, and run.recompute's behaviour (attention: nothing run again; block: the forward again). The GPU's
 * fused op against the CPU op is tests/test_cuda_backend.c's.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"       /* backend_cpu_create, backend_attention_fused, the attention ops */
#include "config.h"        /* struct config, config_defaults, RECOMPUTE_* */
#include "layer_testlib.h" /* token_spec */
#include "model.h"         /* model_build, model_forward, model_backward */
#include "rng.h"           /* rng_bits: the token batch */

/* ---- the stand-in fused attention ---------------------------------------------------------------- */

static struct {
    bool offer;          /* the stand-in reports a fused attention for 16-bit d */
    int forwards, backwards;
    size_t alloc_bytes;  /* everything the model asked the backend for */
    void *(*cpu_alloc)(struct backend *be, size_t bytes);
    bool bad_out;        /* a backward's `out` was not its forward's output */
    bool bad_stats;      /* a backward's statistics were not what its forward wrote */
} fake;

static void *counting_alloc(struct backend *be, size_t bytes)
{
    fake.alloc_bytes += bytes;
    return fake.cpu_alloc(be, bytes);
}

static bool fake_supported(struct backend *be, int64_t B, int64_t T, int64_t C, int64_t H, enum dtype d)
{
    (void)be, (void)B, (void)T, (void)C, (void)H;
    return fake.offer && (d == DT_BF16 || d == DT_FP16);
}

static void probs_alloc(struct backend *be, struct tensor *probs, enum dtype d, int64_t B, int64_t T, int64_t H)
{
    struct amp_error err = {0};
    size_t before = fake.alloc_bytes; /* the stand-in's own memory is not the model's */
    cr_assert_eq(tensor_alloc(probs, be, d, 4, (int64_t[]){B, H, T, T}, "stand-in probs", &err), AMP_OK);
    fake.alloc_bytes = before;
}

/* A mark per statistic, which the backward checks: the forward wrote it into the tensor the backward gets. */
static float stat_mark(size_t i)
{
    return 0.25f * (float)i + 1.0f;
}

static void fake_forward(struct backend *be, struct tensor *out, struct tensor *stats, const struct tensor *qkv,
                         int64_t B, int64_t T, int64_t C, int64_t H)
{
    fake.forwards++;
    cr_assert_eq(stats->dtype, DT_FP32);
    cr_assert_eq(stats->ndim, 3);
    cr_assert(stats->shape[0] == B && stats->shape[1] == H && stats->shape[2] == T, "statistics (B, H, T)");
    cr_assert(out->dtype == qkv->dtype, "out and qkv share d");
    struct tensor probs;
    probs_alloc(be, &probs, qkv->dtype, B, T, H);
    be->attention_forward(be, out, &probs, qkv, B, T, C, H);
    tensor_free(&probs);
    float *s = stats->data;
    for (size_t i = 0; i < stats->numel; i++)
        s[i] = stat_mark(i);
}

static void fake_backward(struct backend *be, struct tensor *dqkv, const struct tensor *dout, const struct tensor *qkv,
                          const struct tensor *out, const struct tensor *stats, int64_t B, int64_t T, int64_t C,
                          int64_t H)
{
    fake.backwards++;
    const float *s = stats->data;
    for (size_t i = 0; i < stats->numel; i++)
        fake.bad_stats |= s[i] != stat_mark(i);
    fake.bad_stats |= stats->numel != (size_t)(B * H * T);
    struct tensor probs, again;
    probs_alloc(be, &probs, qkv->dtype, B, T, H);
    size_t before = fake.alloc_bytes;
    struct amp_error err = {0};
    cr_assert_eq(tensor_alloc(&again, be, out->dtype, 3, (int64_t[]){B, T, C}, "stand-in out", &err), AMP_OK);
    fake.alloc_bytes = before;
    be->attention_forward(be, &again, &probs, qkv, B, T, C, H);
    fake.bad_out |= out->numel != again.numel || memcmp(out->data, again.data, tensor_bytes(out)) != 0;
    be->attention_backward(be, dqkv, dout, qkv, &probs, B, T, C, H);
    tensor_free(&again);
    tensor_free(&probs);
}

static struct backend *fake_backend(bool offer)
{
    memset(&fake, 0, sizeof fake);
    fake.offer = offer;
    struct backend *be = backend_cpu_create();
    cr_assert_not_null(be);
    fake.cpu_alloc = be->alloc;
    be->alloc = counting_alloc;
    be->attention_fused_supported = fake_supported;
    be->attention_fused_forward = fake_forward;
    be->attention_fused_backward = fake_backward;
    return be;
}

/* ---- a small GPT ---------------------------------------------------------------------------------- */

enum { B_MAX = 3, T_SEQ = 7, C_DIM = 16, VOCAB = 13 };

/* An attention layer (4 heads) and a transformer block (2 heads): both kinds of core. */
static const struct layer_config GPT[] = {
    {.kind = LAYER_EMBEDDING, .name = "emb", .vocab = VOCAB, .dim = C_DIM},
    {.kind = LAYER_ATTENTION, .name = "att", .heads = 4},
    {.kind = LAYER_TRANSFORMER_BLOCK, .name = "b0", .heads = 2, .mlp_ratio = 2, .eps = 1e-5},
    {.kind = LAYER_LAYERNORM, .name = "ln_f", .eps = 1e-5},
    {.kind = LAYER_LINEAR, .name = "head", .out = VOCAB, .bias = true},
    {.kind = LAYER_CROSS_ENTROPY, .name = "loss"},
};
enum { NLAYERS = sizeof GPT / sizeof GPT[0], CORES = 2 };
static const int64_t CORE_HEADS[CORES] = {4, 2};

struct run {
    struct backend *be;
    struct config cfg;
    struct autocast_policy pol;
    struct data_spec spec;
    struct model m;
    size_t build_bytes;      /* what model_build asked the backend for */
    float *losses;           /* (B_MAX * T_SEQ) after one forward */
    float **grads;           /* every parameter's gradient after one backward */
    int forwards, backwards; /* fused calls in that step */
};

static const float unit_seed = 1.0f;

/* Build the GPT under `lowp` (fp32: no autocast), one forward and backward on a fixed batch, keep the results. */
static void run_gpt(struct run *r, bool offer, enum dtype lowp, enum recompute recompute)
{
    memset(r, 0, sizeof *r);
    r->be = fake_backend(offer);
    config_defaults(&r->cfg);
    r->cfg.model.layers = malloc(sizeof GPT);
    cr_assert_not_null(r->cfg.model.layers);
    memcpy(r->cfg.model.layers, GPT, sizeof GPT);
    for (int i = 0; i < NLAYERS; i++) { /* the schema's defaults where the table above leaves zeros */
        r->cfg.model.layers[i].approximate = GELU_TANH;
        r->cfg.model.layers[i].stride = 1;
    }
    r->cfg.model.nlayers = NLAYERS;
    r->cfg.data.seq_len = T_SEQ;
    r->cfg.run.recompute = recompute;
    r->spec = token_spec(T_SEQ, VOCAB);
    autocast_default(&r->pol, lowp);
    struct amp_error err = {0};
    cr_assert_eq(model_build(&r->m, &r->cfg, &r->spec, r->be, &r->pol, B_MAX, &err), AMP_OK, "%s", err.msg);
    r->build_bytes = fake.alloc_bytes;
    cr_assert_eq(model_init(&r->m, &r->cfg, 77, &err), AMP_OK, "%s", err.msg);

    struct batch b = {.n = B_MAX};
    int32_t tokens[B_MAX * T_SEQ], labels[B_MAX * T_SEQ];
    for (int i = 0; i < B_MAX * T_SEQ; i++) {
        tokens[i] = (int32_t)(rng_bits(5, 1, (uint64_t)i) % VOCAB);
        labels[i] = (int32_t)(rng_bits(5, 2, (uint64_t)i) % VOCAB);
    }
    b.tokens = tokens; /* CPU backend memory is host memory */
    b.labels = labels;
    struct step_ctx ctx = {.be = r->be, .policy = &r->pol, .training = true, .key = {.seed = 9, .counter = 1},
                           .grad_seed = &unit_seed};
    model_forward(&r->m, &ctx, &b);
    int64_t rows = model_loss_rows(&r->m, b.n);
    r->losses = malloc((size_t)rows * sizeof *r->losses);
    struct tensor y = tensor_reshape(&r->m.layers[NLAYERS - 1].y, 1, &rows);
    tensor_to_host_f32(&y, r->losses);
    model_backward(&r->m, &ctx, &b);
    r->grads = calloc((size_t)r->m.nparams, sizeof *r->grads);
    for (int i = 0; i < r->m.nparams; i++) {
        r->grads[i] = malloc(r->m.params[i]->grad.numel * sizeof(float));
        tensor_to_host_f32(&r->m.params[i]->grad, r->grads[i]);
    }
    r->forwards = fake.forwards;
    r->backwards = fake.backwards;
    cr_assert_not(fake.bad_out, "a fused backward was not given its forward's output");
    cr_assert_not(fake.bad_stats, "a fused backward was not given the statistics its forward wrote");
}

static void run_free(struct run *r)
{
    for (int i = 0; i < r->m.nparams; i++)
        free(r->grads[i]);
    free(r->grads);
    free(r->losses);
    model_free(&r->m);
    config_free(&r->cfg);
    r->be->destroy(r->be);
}

static void assert_same_bits(const struct run *a, const struct run *b, const char *what)
{
    int64_t rows = B_MAX * T_SEQ;
    cr_assert_eq(memcmp(a->losses, b->losses, (size_t)rows * sizeof(float)), 0, "%s: the losses differ", what);
    cr_assert_eq(a->m.nparams, b->m.nparams);
    for (int i = 0; i < a->m.nparams; i++)
        cr_assert_eq(memcmp(a->grads[i], b->grads[i], a->m.params[i]->grad.numel * sizeof(float)), 0,
                     "%s: %s's gradient differs", what, a->m.params[i]->name);
}

/* The bytes a core keeps: the probabilities (B, H, T, T) in d, or the statistics (B, H, T) fp32. */
static size_t probs_bytes(enum dtype d)
{
    size_t n = 0;
    for (int i = 0; i < CORES; i++)
        n += (size_t)(B_MAX * CORE_HEADS[i] * T_SEQ * T_SEQ) * dtype_size(d);
    return n;
}

static size_t stats_bytes(void)
{
    size_t n = 0;
    for (int i = 0; i < CORES; i++)
        n += (size_t)(B_MAX * CORE_HEADS[i] * T_SEQ) * sizeof(float);
    return n;
}

/* ---- the tests ----------------------------------------------------------------------------------- */

Test(attention_fused, the_cpu_backend_has_none)
{
    struct backend *be = backend_cpu_create();
    cr_assert_null(be->attention_fused_supported);
    cr_assert_not(backend_attention_fused(be, 4, 64, 768, 12, DT_BF16));
    be->destroy(be);
}

/* Where the backend reports a fused attention, each core keeps (B, H, T) fp32 statistics instead of (B, H, T, T)
 * probabilities: the model's memory shrinks by exactly the difference. */
Test(attention_fused, a_core_keeps_statistics_not_probabilities)
{
    enum dtype dts[] = {DT_BF16, DT_FP16};
    for (int i = 0; i < 2; i++) {
        struct run plain, fused;
        run_gpt(&plain, false, dts[i], RECOMPUTE_NONE);
        run_gpt(&fused, true, dts[i], RECOMPUTE_NONE);
        cr_assert_eq(plain.forwards + plain.backwards, 0, "no fused call where none is offered");
        cr_assert_eq(fused.forwards, CORES, "%s: one fused forward per core", dtype_name(dts[i]));
        cr_assert_eq(fused.backwards, CORES, "%s: one fused backward per core", dtype_name(dts[i]));
        cr_assert_eq(plain.build_bytes - fused.build_bytes, probs_bytes(dts[i]) - stats_bytes(),
                     "%s: built %zu bytes with probabilities, %zu with statistics", dtype_name(dts[i]),
                     plain.build_bytes, fused.build_bytes);
        assert_same_bits(&plain, &fused, dtype_name(dts[i]));
        run_free(&plain);
        run_free(&fused);
    }
}

/* fp32 attention keeps the present path whatever the backend offers (the stand-in, like CUDA, offers 16-bit only). */
Test(attention_fused, fp32_keeps_the_probabilities)
{
    struct run plain, offered;
    run_gpt(&plain, false, DT_FP32, RECOMPUTE_NONE);
    run_gpt(&offered, true, DT_FP32, RECOMPUTE_NONE);
    cr_assert_eq(offered.forwards + offered.backwards, 0);
    cr_assert_eq(offered.build_bytes, plain.build_bytes);
    assert_same_bits(&plain, &offered, "fp32");
    run_free(&plain);
    run_free(&offered);
}

/* run.recompute attention with a fused core: nothing to recompute, so nothing runs again (one forward per core,
 * the same bits as none, and no workspace share for probabilities: the same memory as none); block runs the whole
 * block's forward again, fused attention included. */
Test(attention_fused, recompute_with_a_fused_core)
{
    struct run none, attention, block;
    run_gpt(&none, true, DT_BF16, RECOMPUTE_NONE);
    run_gpt(&attention, true, DT_BF16, RECOMPUTE_ATTENTION);
    run_gpt(&block, true, DT_BF16, RECOMPUTE_BLOCK);
    cr_assert_eq(attention.forwards, CORES, "recompute attention ran a fused forward again");
    cr_assert_eq(attention.build_bytes, none.build_bytes, "recompute attention reserved memory for probabilities");
    cr_assert_eq(block.forwards, CORES + 1, "recompute block runs the block's attention again (and only it)");
    cr_assert_eq(block.backwards, CORES);
    assert_same_bits(&none, &attention, "recompute attention");
    assert_same_bits(&none, &block, "recompute block");
    run_free(&none);
    run_free(&attention);
    run_free(&block);
}
