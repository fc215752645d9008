/*
 * test_sample.c — generation (lib/sample.h, models/model.h model_decode): the key/value-cache path against the
 * model's full forward, the sampling rule, determinism, and the `ampTrain sample` command's errors.
 * CPU backend; the models are tiny GPTs built in code.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h" /* backend_cpu_create */
#include "config.h"  /* struct config, config_defaults */
#include "dtype.h"   /* dtype_convert */
#include "gemm_avx512.h" /* gemm_avx512_supported: whether the full forward's products sum as attention_decode does */
#include "model.h"   /* model_build, model_decode */
#include "rng.h"     /* rng_bits: seeded tokens */

/* ---- a tiny GPT ---------------------------------------------------------------------------------- */

static struct layer_config lc(enum layer_kind kind, const char *name)
{
    struct layer_config l;
    memset(&l, 0, sizeof l);
    l.kind = kind;
    snprintf(l.name, sizeof l.name, "%s", name);
    l.bias = true;
    l.eps = 1e-5;
    l.heads = 2;
    l.mlp_ratio = 4;
    l.approximate = GELU_TANH;
    return l;
}

struct gpt {
    struct backend *be;
    struct config cfg;
    struct autocast_policy pol;
    struct model m;
    int64_t T, V;
};

/* embedding (V, 32), two blocks of 2 heads, ln_f, lm_head, cross_entropy; context T; fp32 or `lowp` autocast */
static void gpt_build(struct gpt *g, int64_t T, int64_t V, enum dtype lowp)
{
    g->be = backend_cpu_create();
    g->T = T;
    g->V = V;
    struct layer_config layers[] = {lc(LAYER_EMBEDDING, "embed"), lc(LAYER_TRANSFORMER_BLOCK, "b0"),
                                    lc(LAYER_TRANSFORMER_BLOCK, "b1"), lc(LAYER_LAYERNORM, "ln_f"),
                                    lc(LAYER_LINEAR, "lm_head"), lc(LAYER_CROSS_ENTROPY, "loss")};
    layers[0].vocab = V;
    layers[0].dim = 32;
    layers[4].out = V;
    config_defaults(&g->cfg);
    g->cfg.model.layers = malloc(sizeof layers);
    memcpy(g->cfg.model.layers, layers, sizeof layers);
    g->cfg.model.nlayers = 6;
    g->cfg.model.init = INIT_GPT2;
    g->cfg.data.seq_len = T;
    autocast_default(&g->pol, lowp);
    struct data_spec spec = {.sample_ndim = 1, .sample_shape = {T}, .is_tokens = true, .num_classes = V};
    struct amp_error err = {0};
    cr_assert_eq(model_build(&g->m, &g->cfg, &spec, g->be, &g->pol, 1, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(model_init(&g->m, &g->cfg, 1234, &err), AMP_OK, "%s", err.msg);
    model_refresh_copies(&g->m);
}

static void gpt_free(struct gpt *g)
{
    model_free(&g->m);
    config_free(&g->cfg);
    g->be->destroy(g->be);
}

/* The logits (T, V) fp32 of a full forward over tokens (T): the training/eval path. */
static float *full_logits(struct gpt *g, const int32_t *tokens)
{
    int32_t *labels = calloc((size_t)g->T, sizeof *labels);
    struct batch b = {.n = 1, .tokens = (int32_t *)tokens, .labels = labels};
    struct step_ctx ctx = {.be = g->be, .policy = &g->pol, .training = false};
    model_forward(&g->m, &ctx, &b);
    const struct tensor *y = &g->m.layers[g->m.nlayers - 2].y;
    float *out = malloc((size_t)(g->T * g->V) * sizeof *out);
    dtype_convert(out, DT_FP32, y->data, y->dtype, (size_t)(g->T * g->V));
    free(labels);
    return out;
}

static void random_tokens(int32_t *t, int64_t n, int64_t V, uint64_t seed)
{
    for (int64_t i = 0; i < n; i++)
        t[i] = (int32_t)(rng_bits(seed, 7, (uint64_t)i) % (uint64_t)V);
}

/* The largest difference between the logits of the cache path and the full forward's, over every position: a
 * prefill of `prefill` positions, then one position per call. CPU backend memory is host memory. */
static double cache_vs_full(enum dtype lowp, int64_t prefill, bool *bits_equal)
{
    struct gpt g;
    gpt_build(&g, 16, 64, lowp);
    int32_t tokens[16];
    random_tokens(tokens, g.T, g.V, 5);
    float *full = full_logits(&g, tokens);
    int64_t context = 0;
    struct amp_error err = {0};
    cr_assert_eq(model_decode_begin(&g.m, &context, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(context, g.T);
    struct step_ctx ctx = {.be = g.be, .policy = &g.pol, .training = false};
    double worst = 0.0;
    *bits_equal = true;
    float *row = malloc((size_t)(g.T * g.V) * sizeof *row);
    for (int64_t pos = 0, n = prefill; pos < g.T; pos += n, n = 1) {
        struct decode_step d = {.pos = pos, .n = n, .tokens = tokens + pos};
        struct tensor logits;
        model_decode(&g.m, &ctx, &d, &logits);
        cr_assert_eq(logits.numel, (size_t)(n * g.V));
        dtype_convert(row, DT_FP32, logits.data, logits.dtype, (size_t)(n * g.V));
        for (int64_t i = 0; i < n * g.V; i++) {
            float want = full[pos * g.V + i];
            *bits_equal = *bits_equal && memcmp(&row[i], &want, sizeof want) == 0;
            double diff = fabs((double)row[i] - want);
            worst = diff > worst ? diff : worst;
        }
    }
    cr_assert_eq(g.be->status(g.be, &err), AMP_OK, "%s", err.msg);
    free(row);
    free(full);
    gpt_free(&g);
    return worst;
}

/* fp32: bit for bit where the full forward's products are gemm_avx512's, which sums each dot product in order of k
 * with one fused multiply-add per term, as attention_decode's loop does (fmaf); elsewhere (OpenBLAS's sgemm) the
 * order differs, and the logits (of size ~1) agree to a few fp32 roundings. */
Test(cache, fp32_logits_match_the_full_forward)
{
    bool bits;
    double worst = cache_vs_full(DT_FP32, 5, &bits);
    cr_log_info("fp32: largest |cache - full| %.3g, bit-equal %d\n", worst, bits);
    if (gemm_avx512_supported(DT_FP32))
        cr_assert(bits, "the cache path's fp32 logits differ from the full forward's, by up to %g", worst);
    cr_assert(worst < 1e-5, "cache path differs from the full forward by %g", worst);
}

/* bf16 autocast: the full forward's attention products are gemm_avx512's bf16 product (pairs of bf16 terms per
 * instruction, AMX tiles where present) while attention_decode sums one term at a time in fp32: the same bits
 * after the roundings to bf16 in most positions (all, on the machine this was written on), and within a bf16
 * rounding of the logits (2^-8 relative; logits of size ~1) where a sum lands on the other side of a tie. */
Test(cache, bf16_logits_match_the_full_forward)
{
    bool bits;
    double worst = cache_vs_full(DT_BF16, 3, &bits);
    cr_log_info("bf16: largest |cache - full| %.3g, bit-equal %d\n", worst, bits);
    cr_assert(worst < 2e-2, "cache path differs from the full forward by %g", worst);
}
