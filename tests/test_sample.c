/*
 * test_sample.c — generation (lib/engine/sample.h, models/model.h model_decode): the key/value-cache path against the
 * model's full forward, the sampling rule, determinism, and the `ampTrain sample` command's errors.
 * CPU backend; the models are tiny GPTs built in code.
 */
#define _POSIX_C_SOURCE 200809L
#include "ckpt_testlib.h" /* make_scratch, remove_scratch, amp: the binary end to end */

#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h" /* backend_cpu_create */
#include "checkpoint.h" /* ckpt_read_config, ckpt_load_model: the reference suite's model */
#include "config.h"  /* struct config, config_defaults */
#include "data.h"    /* data_spec_from_config */
#include "dtype.h"   /* dtype_convert */
#include "gemm_avx512.h" /* gemm_avx512_supported: whether the full forward's products sum as attention_decode does */
#include "model.h"   /* model_build, model_decode */
#include "rng.h"     /* rng_bits: seeded tokens */
#include "runlog.h"  /* runlog_json_bytes */
#include "sample.h"  /* sample_pick, sample_generate */

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

/* ---- the sampling rule --------------------------------------------------------------------------- */

Test(rule, greedy_top_k_and_top_p)
{
    const float logits[4] = {0.5f, 2.0f, 2.0f, -1.0f};
    struct sample_rank k[4];
    struct sample_opts greedy = {.temperature = 0.0, .top_p = 1.0};
    cr_assert_eq(sample_pick(logits, 4, &greedy, 0.99f, k), 1, "the first of equal maxima");
    struct sample_opts top1 = {.temperature = 1.0, .top_k = 1, .top_p = 1.0};
    struct sample_opts nucleus = {.temperature = 1.0, .top_p = 0.1};
    for (float u = 0.0f; u < 1.0f; u += 0.125f) {
        cr_assert_eq(sample_pick(logits, 4, &top1, u, k), 1);
        cr_assert_eq(sample_pick(logits, 4, &nucleus, u, k), 1);
    }
}

/* weights 1 and 3 (logits 0 and ln 3): token 1 for u < 3/4, token 0 from there; temperature 2 flattens them to 1 and
 * sqrt(3); top_k 1 keeps token 1 alone */
Test(rule, draws_split_the_weights_in_order)
{
    const float logits[2] = {0.0f, logf(3.0f)};
    struct sample_rank k[2];
    struct sample_opts o = {.temperature = 1.0, .top_p = 1.0};
    cr_assert_eq(sample_pick(logits, 2, &o, 0.70f, k), 1);
    cr_assert_eq(sample_pick(logits, 2, &o, 0.80f, k), 0);
    o.temperature = 2.0;
    double split = sqrt(3.0) / (1.0 + sqrt(3.0)); /* 0.634 */
    cr_assert_eq(sample_pick(logits, 2, &o, (float)(split - 0.01), k), 1);
    cr_assert_eq(sample_pick(logits, 2, &o, (float)(split + 0.01), k), 0);
    o.top_k = 1;
    cr_assert_eq(sample_pick(logits, 2, &o, 0.99f, k), 1);
    /* top_p 0.8 of {0.75, 0.25}: 0.75 falls short, so both stay */
    o = (struct sample_opts){.temperature = 1.0, .top_p = 0.8};
    cr_assert_eq(sample_pick(logits, 2, &o, 0.80f, k), 0);
    o.top_p = 0.75;
    cr_assert_eq(sample_pick(logits, 2, &o, 0.80f, k), 1);
}

/* ---- determinism --------------------------------------------------------------------------------- */

static void generate(struct gpt *g, uint64_t seed, int32_t *out, int64_t *n)
{
    int64_t context = 0;
    struct amp_error err = {0};
    cr_assert_eq(model_decode_begin(&g->m, &context, &err), AMP_OK, "%s", err.msg);
    const int32_t prompt[3] = {1, 2, 3};
    struct sample_opts o = {.tokens = 100, .temperature = 1.0, .top_k = 40, .top_p = 0.95, .seed = seed};
    struct sample_result r;
    cr_assert_eq(sample_generate(&g->m, context, prompt, 3, &o, &r, &err), AMP_OK, "%s", err.msg);
    cr_assert(r.stopped_at_context && r.n == context, "100 tokens stop at the context of %lld", (long long)context);
    cr_assert_eq(memcmp(r.tokens, prompt, sizeof prompt), 0, "the prompt comes first");
    memcpy(out, r.tokens, (size_t)r.n * sizeof *out);
    *n = r.n;
    sample_result_free(&r);
}

Test(determinism, a_seed_gives_the_same_tokens_and_another_seed_others)
{
    struct gpt g;
    gpt_build(&g, 24, 64, DT_FP32);
    int32_t a[24], b[24], c[24];
    int64_t na, nb, nc;
    generate(&g, 7, a, &na);
    generate(&g, 7, b, &nb); /* the cache is written over from position 0 again */
    generate(&g, 8, c, &nc);
    cr_assert(na == 24 && nb == 24 && nc == 24);
    cr_assert_eq(memcmp(a, b, sizeof a), 0, "seed 7 twice gave different tokens");
    cr_assert_neq(memcmp(a, c, sizeof a), 0, "seeds 7 and 8 gave the same tokens");
    struct amp_error err = {0};
    int32_t too_long[24] = {0};
    struct sample_result r;
    struct sample_opts o = {.tokens = 1, .temperature = 1.0, .top_p = 1.0};
    cr_assert_eq(sample_generate(&g.m, 24, too_long, 24, &o, &r, &err), AMP_ERR_CONFIG);
    cr_assert(strstr(err.msg, "the prompt has 24 tokens, but the model's context is 24 positions"), "%s", err.msg);
    int32_t bad[2] = {5, 64};
    cr_assert_eq(sample_generate(&g.m, 24, bad, 2, &o, &r, &err), AMP_ERR_CONFIG);
    cr_assert(strstr(err.msg, "prompt token 1 is 64, outside the model's vocabulary of 64"), "%s", err.msg);
    gpt_free(&g);
}

/* A model that cannot generate says which layer: an mlp (no embedding), before anything is allocated. */
Test(determinism, a_model_without_an_embedding_is_refused)
{
    struct backend *be = backend_cpu_create();
    struct config cfg;
    config_defaults(&cfg);
    struct layer_config layers[] = {lc(LAYER_LINEAR, "fc"), lc(LAYER_CROSS_ENTROPY, "loss")};
    layers[0].out = 4;
    cfg.model.layers = malloc(sizeof layers);
    memcpy(cfg.model.layers, layers, sizeof layers);
    cfg.model.nlayers = 2;
    struct autocast_policy pol;
    autocast_default(&pol, DT_FP32);
    struct data_spec spec = {.sample_ndim = 1, .sample_shape = {8}, .num_classes = 4};
    struct model m;
    struct amp_error err = {0};
    cr_assert_eq(model_build(&m, &cfg, &spec, be, &pol, 1, &err), AMP_OK, "%s", err.msg);
    int64_t context = 0;
    cr_assert_eq(model_decode_begin(&m, &context, &err), AMP_ERR_CONFIG);
    cr_assert(strstr(err.msg, "its first layer is 'fc' (linear)"), "%s", err.msg);
    model_free(&m);
    config_free(&cfg);
    be->destroy(be);
}

/* ---- ampTrain sample ----------------------------------------------------------------------------- */

/* A byte-level text GPT (configs/text_gpt.yaml made small: width 32, context 32), trained 20 steps. */
#define TINY_TEXT "run configs/text_gpt.yaml data.batch_size=4 data.seq_len=32 model.layers.0.dim=32 run.device=cpu " \
                  "run.steps=20 run.ckpt_every=20 run.log_every=1000 run.eval_every=0"

static char ckpt[512];

static void setup_cli(void)
{
    make_scratch();
    struct result r = amp(TINY_TEXT " run.out_dir=%s/gpt", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    snprintf(ckpt, sizeof ckpt, "%s/gpt/ckpt-20.h5", scratch);
}

TestSuite(cli, .init = setup_cli, .fini = remove_scratch);

#define assert_exit(r, want, text)                                                                           \
    do {                                                                                                     \
        cr_assert_eq((r).code, (want), "exit %d, not %d: %s", (r).code, (want), (r).out);                    \
        cr_assert(strstr((r).out, (text)), "output lacks \"%s\": %s", (text), (r).out);                      \
    } while (0)

Test(cli, the_same_seed_prints_the_same_text)
{
    char first[4096];
    struct result r = amp("sample %s --prompt 'The ' --tokens 12 --seed 5 --top-k 50 --top-p 0.9", ckpt);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert_eq(strncmp(r.out, "The ", 4), 0, "the prompt comes first: %s", r.out);
    cr_assert_eq(strlen(r.out), 4 + 12 + 1, "prompt, 12 bytes and a newline: %zu bytes", strlen(r.out));
    snprintf(first, sizeof first, "%s", r.out);
    r = amp("sample %s --prompt 'The ' --tokens 12 --seed 5 --top-k 50 --top-p 0.9", ckpt);
    cr_assert_str_eq(r.out, first);
    r = amp("sample %s --prompt 'The ' --tokens 12 --seed 6 --top-k 50 --top-p 0.9", ckpt);
    cr_assert_str_neq(r.out, first);
    /* an empty prompt starts from a newline; the context (32) ends generation, said on stderr */
    r = amp("sample %s --prompt '' --tokens 100 --temperature 0 2>/dev/null | wc -c", ckpt);
    cr_assert_eq(atoi(r.out), 32 + 1, "%s", r.out);
    r = amp("sample %s --tokens 100 --temperature 0 >/dev/null", ckpt);
    assert_exit(r, 0, "stopped at the model's context of 32 positions (data.seq_len): 31 of 100 tokens generated");
    /* a prompt file gives what the same --prompt gives */
    r = amp("sample %s --prompt 'ab' --tokens 5 --seed 1", ckpt);
    cr_assert_eq(r.code, 0, "%s", r.out);
    snprintf(first, sizeof first, "%s", r.out);
    char path[600];
    snprintf(path, sizeof path, "%s/p.txt", scratch);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs("ab", f);
    fclose(f);
    r = amp("sample %s --prompt-file %s --tokens 5 --seed 1", ckpt, path);
    cr_assert_str_eq(r.out, first);
}

Test(cli, bad_arguments_are_exit_2_naming_them)
{
    struct result r = amp("sample %s --tokens -1", ckpt);
    assert_exit(r, 2, "sample: bad value for --tokens: '-1' (expected a whole number from 0 to 1048576)");
    r = amp("sample %s --temperature nan", ckpt);
    assert_exit(r, 2, "bad value for --temperature: 'nan'");
    r = amp("sample %s --top-k 2.5", ckpt);
    assert_exit(r, 2, "bad value for --top-k: '2.5'");
    r = amp("sample %s --top-p 1.5", ckpt);
    assert_exit(r, 2, "bad value for --top-p: '1.5' (expected a number in (0, 1]");
    r = amp("sample %s --seed x", ckpt);
    assert_exit(r, 2, "bad value for --seed: 'x'");
    r = amp("sample %s --device tpu", ckpt);
    assert_exit(r, 2, "bad value for --device: 'tpu' (expected cpu or cuda)");
    r = amp("sample %s --tokens", ckpt);
    assert_exit(r, 2, "bad value for --tokens: '' (expected a value after it)");
    r = amp("sample %s --temp 1", ckpt);
    assert_exit(r, 2, "sample: unknown option '--temp'");
    r = amp("sample %s --prompt a --prompt-file b", ckpt);
    assert_exit(r, 2, "--prompt and --prompt-file given together");
    r = amp("sample");
    assert_exit(r, 2, "sample: missing CHECKPOINT.h5 argument");
    r = amp("sample %s --help", ckpt);
    assert_exit(r, 0, "usage: ampTrain sample CHECKPOINT.h5 [--prompt TEXT | --prompt-file F] [--tokens N]");
    r = amp("generate %s", ckpt);
    assert_exit(r, 2, "unknown command 'generate' (did you mean 'sample'?)");
    r = amp("sample %s/none.h5", scratch);
    cr_assert_eq(r.code, 4, "a missing checkpoint: %s", r.out);
    r = amp("sample %s --prompt '%0*d'", ckpt, 40, 0);
    assert_exit(r, 2, "the prompt has 40 tokens, but the model's context is 32 positions");
    r = amp("sample %s --tokenizer %s/gpt/config.yaml", ckpt, scratch); /* not a tokenizer file: data, exit 3 */
    assert_exit(r, 3, "/gpt/config.yaml: byte 0: an unexpected character where a value should be");
}

Test(cli, prompt_files_that_are_not_text_files_are_exit_2_naming_them)
{
    struct result r = amp("sample %s --prompt-file %s/missing.txt", ckpt, scratch);
    assert_exit(r, 2, "cannot open --prompt-file");
    cr_assert(strstr(r.out, "/missing.txt': No such file or directory"), "%s", r.out);
    r = amp("sample %s --prompt-file %s", ckpt, scratch);
    assert_exit(r, 2, "' is a directory");
    char path[600];
    snprintf(path, sizeof path, "%s/fifo", scratch);
    cr_assert_eq(mkfifo(path, 0600), 0);
    r = amp("sample %s --prompt-file %s", ckpt, path); /* opened without blocking: no writer needed */
    assert_exit(r, 2, "/fifo' is not a regular file");
    snprintf(path, sizeof path, "%s/big.txt", scratch);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    cr_assert_eq(fseek(f, (2 << 20) - 1, SEEK_SET), 0);
    fputc('x', f);
    fclose(f);
    r = amp("sample %s --prompt-file %s", ckpt, path);
    assert_exit(r, 2, "/big.txt' has 2097152 bytes, more than 1048576");
}

/* A vocabulary other than the 256 bytes needs a tokenizer: exit 2 before generating without one. With one (a BPE
 * of 300 ids trained on the fortunes by Hugging Face's tokenizers, scripts/ref/bpe_reference.py, and token files made
 * with it), `sample` reads the run's data.tokenizer or --tokenizer: the prompt goes in as the tokenizer's ids and
 * the text comes out decoded, and the 20 ids the model has beyond the tokenizer's 300 are never drawn (their
 * decoding would be an error). run.sample_every samples through the same tokenizer. configs/gpt2_tiny.yaml
 * (vocab 320). */
Test(cli, a_model_of_another_vocabulary_samples_through_its_tokenizer)
{
    char cmd[2400];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/scripts/tools/make_tokens.py --format nanogpt --val-fraction 0.1 -o "
             "%s/train.bin /usr/share/games/fortunes/cookie >/dev/null 2>&1", AMP_SOURCE_DIR, scratch);
    cr_assert_eq(shell(cmd).code, 0, "make_tokens.py failed");
    struct result r = amp("run configs/gpt2_tiny.yaml run.device=cpu run.log_every=1000 run.eval_every=0 run.steps=1 "
                          "run.ckpt_every=1 data.train_bin=%s/train.bin data.val_bin=%s/val.bin run.out_dir=%s/v320",
                          scratch, scratch, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp("sample %s/v320/ckpt-1.h5 --prompt hi", scratch);
    assert_exit(r, 2, "the model's vocabulary has 320 tokens, not the 256 bytes");
    cr_assert(strstr(r.out, "--tokenizer FILE"), "%s", r.out);

    /* a BPE of 300 ids, and token files of its ids */
    snprintf(cmd, sizeof cmd,
             "cd %s && /usr/bin/python3 scripts/ref/bpe_reference.py --vocab 300 %s/bpe "
             "/usr/share/games/fortunes/cookie "
             ">/dev/null 2>&1 && /usr/bin/python3 scripts/tools/make_tokens.py --tokenizer %s/bpe/tokenizer.json "
             "--amptrain %s "
             "--format nanogpt --val-fraction 0.1 -o %s/bpe_train.bin /usr/share/games/fortunes/cookie 2>&1",
             AMP_SOURCE_DIR, scratch, scratch, amp_binary(), scratch);
    r = shell(cmd);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp("run configs/gpt2_tiny.yaml run.device=cpu run.log_every=1000 run.eval_every=0 run.steps=4 "
            "run.ckpt_every=4 data.train_bin=%s/bpe_train.bin data.val_bin=%s/bpe_val.bin data.tokenizer=%s/bpe/"
            "tokenizer.json run.sample_every=2 run.sample_prompt='The fortune' run.out_dir=%s/bpe_run",
            scratch, scratch, scratch, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "sample step 2 | The fortune"), "%s", r.out);
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 -c \"import json; rows=[json.loads(l) for l in open('%s/bpe_run/"
             "samples.jsonl')]; print([(r['step'], r['prompt']) for r in rows])\"", scratch);
    r = shell(cmd);
    cr_assert(strstr(r.out, "[(2, 'The fortune'), (4, 'The fortune')]"), "%s", r.out);
    /* the samples in the event file as text (the prompt in bold), its scalars still those of scale_log.csv */
    snprintf(cmd, sizeof cmd, "cd %s && /usr/bin/python3 scripts/ref/tb_check.py --text %s/bpe_run samples && "
             "/usr/bin/python3 scripts/ref/tb_check.py %s/bpe_run", AMP_SOURCE_DIR, scratch, scratch);
    r = shell(cmd);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "[[2, \"**The fortune**"), "%s", r.out);
    cr_assert(strstr(r.out, "[4, \"**The fortune**"), "%s", r.out);

    /* no generated token: the prompt through encode and decode, from the run's data.tokenizer and from --tokenizer */
    char ck[600];
    snprintf(ck, sizeof ck, "%s/bpe_run/ckpt-4.h5", scratch);
    r = amp("sample %s --prompt 'Hello, you.' --tokens 0", ck);
    assert_exit(r, 0, "Hello, you.\n");
    r = amp("sample %s --prompt 'Hello, you.' --tokens 0 --tokenizer %s/bpe/vocab.json", ck, scratch);
    assert_exit(r, 0, "Hello, you.\n");
    /* an untrained model at a high temperature, to the context's end (15 tokens) for 12 seeds: without the limit,
     * ids 300-319 would be drawn about 6% of the time (an exit 3: the tokenizer cannot decode them), so in 180
     * draws almost surely */
    static char first[sizeof r.out];
    for (int seed = 1; seed <= 12; seed++) {
        r = amp("sample %s --prompt 'The' --tokens 200 --temperature 3 --seed %d", ck, seed);
        assert_exit(r, 0, "The");
        if (seed == 7)
            snprintf(first, sizeof first, "%s", r.out);
    }
    r = amp("sample %s --prompt 'The' --tokens 200 --temperature 3 --seed 7 --tokenizer %s/bpe", ck, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert_str_eq(r.out, first);
    /* a tokenizer with more ids than the model's vocabulary: exit 2 naming both */
    snprintf(cmd, sizeof cmd,
             "cd %s && /usr/bin/python3 scripts/ref/bpe_reference.py --vocab 400 %s/bpe400 "
             "/usr/share/games/fortunes/cookie "
             ">/dev/null 2>&1", AMP_SOURCE_DIR, scratch);
    cr_assert_eq(shell(cmd).code, 0, "bpe_reference.py failed");
    r = amp("sample %s --tokenizer %s/bpe400/tokenizer.json", ck, scratch);
    assert_exit(r, 2, "/bpe400/tokenizer.json' has 400 ids, more than the model's vocabulary of 320");
}

/* ---- against a Python reference ------------------------------------------------------------------ */

/* A GPT-2 shaped byte-level model (configs/gpt2_tiny.yaml with vocabulary 256: tied lm_head, no bias, context 16)
 * trained 30 steps and exported with hf-gpt2 names; scripts/ref/sample_ref.py loads the export into a torch.nn GPT-2
 * (scripts/ref/gpt2_torch.py) and generates with the same rule and draws, each step a full forward without a cache.
 * The same tokens, and ampTrain's logits of every generated token within 1e-5 of the row's largest logit. */
static char ref_ckpt[600], exported[600];

static void setup_reference(void)
{
    make_scratch();
    char cmd[2000];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/scripts/tools/make_tokens.py --format nanogpt --val-fraction 0.1 -o "
             "%s/train.bin /usr/share/games/fortunes/cookie >/dev/null 2>&1", AMP_SOURCE_DIR, scratch);
    cr_assert_eq(shell(cmd).code, 0, "make_tokens.py failed");
    struct result r = amp("run configs/gpt2_tiny.yaml run.device=cpu run.log_every=1000 run.eval_every=0 run.steps=30 "
                          "run.ckpt_every=30 data.vocab=256 model.layers.0.vocab=256 model.layers.4.out=256 "
                          "data.train_bin=%s/train.bin data.val_bin=%s/val.bin run.out_dir=%s/g",
                          scratch, scratch, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    snprintf(ref_ckpt, sizeof ref_ckpt, "%s/g/ckpt-30.h5", scratch);
    snprintf(exported, sizeof exported, "%s/g.safetensors", scratch);
    r = amp("export %s %s --names hf-gpt2", ref_ckpt, exported);
    cr_assert_eq(r.code, 0, "%s", r.out);
}

static void reference_case(const char *opts, struct sample_opts o)
{
    const char *ckpt_path = ref_ckpt;
    char cmd[2000], logits_path[600];
    snprintf(logits_path, sizeof logits_path, "%s/logits.f32", scratch);
    struct result r;
    /* ampTrain's generation, in process, keeping the logits */
    struct config cfg;
    struct amp_error err = {0};
    cr_assert_eq(ckpt_read_config(ckpt_path, &cfg, &err), AMP_OK, "%s", err.msg);
    struct data_spec spec;
    cr_assert(data_spec_from_config(&cfg.data, &spec));
    struct autocast_policy pol;
    autocast_default(&pol, DT_FP32);
    struct backend *be = backend_cpu_create();
    struct model m;
    cr_assert_eq(model_build(&m, &cfg, &spec, be, &pol, 1, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(ckpt_load_model(ckpt_path, &m, &err), AMP_OK, "%s", err.msg);
    int64_t context = 0;
    cr_assert_eq(model_decode_begin(&m, &context, &err), AMP_OK, "%s", err.msg);
    const int32_t prompt[4] = {'T', 'h', 'e', ' '};
    o.keep_logits = true;
    struct sample_result res;
    cr_assert_eq(sample_generate(&m, context, prompt, 4, &o, &res, &err), AMP_OK, "%s", err.msg);
    FILE *f = fopen(logits_path, "wb");
    cr_assert_not_null(f);
    cr_assert_eq(fwrite(res.logits, sizeof(float), (size_t)((res.n - res.n_prompt) * res.vocab), f),
                 (size_t)((res.n - res.n_prompt) * res.vocab));
    fclose(f);
    char want[4096] = "tokens ";
    for (int64_t i = 0; i < res.n; i++)
        snprintf(want + strlen(want), sizeof want - strlen(want), "%s%d", i ? "," : "", res.tokens[i]);

    snprintf(cmd, sizeof cmd, "cd %s && /usr/bin/python3 scripts/ref/sample_ref.py %s --heads 2 --prompt 84,104,101,32 "
             "--tokens %lld --context %lld %s --compare %s 2>&1", AMP_SOURCE_DIR, exported, (long long)o.tokens,
             (long long)context, opts, logits_path);
    r = shell(cmd);
    cr_log_info("%s: %s\n", opts, r.out);
    cr_assert_eq(r.code, 0, "sample_ref.py: %s", r.out);
    cr_assert(strncmp(r.out, want, strlen(want)) == 0 && r.out[strlen(want)] == '\n',
              "tokens differ:\nampTrain:  %s\nreference: %s", want, r.out);
    sample_result_free(&res);
    model_free(&m);
    config_free(&cfg);
    be->destroy(be);
}

TestSuite(reference, .init = setup_reference, .fini = remove_scratch);

Test(reference, nucleus_sampling_matches_torch)
{
    reference_case("--temperature 0.9 --top-k 40 --top-p 0.95 --seed 11",
                   (struct sample_opts){.tokens = 11, .temperature = 0.9, .top_k = 40, .top_p = 0.95, .seed = 11});
}

Test(reference, greedy_and_plain_sampling_match_torch)
{
    reference_case("--temperature 0", (struct sample_opts){.tokens = 11, .temperature = 0.0, .top_p = 1.0});
    reference_case("--temperature 1.5 --seed 3",
                   (struct sample_opts){.tokens = 11, .temperature = 1.5, .top_p = 1.0, .seed = 3});
}

/* ---- during training: run.sample_every --------------------------------------------------------------- */

TestSuite(training, .init = make_scratch, .fini = remove_scratch);

/* A run that samples every 2 steps is the same run as one that does not: every scale_log.csv column, eval.jsonl and
 * every checkpoint tensor (weights and moments), fp32 and bf16; and samples.jsonl has a line per sample that
 * json.loads reads back to the prompt and 64 bytes of text. A 2% validation split: at 10% the two evaluations of
 * each run were most of its time. */
static void same_run(const char *mode)
{
    static const char *const extra[] = {"", "run.sample_every=2 'run.sample_prompt=\"Q: \\\"x\\\"\"'"};
    for (int k = 0; k < 2; k++) {
        struct result r = amp("run configs/text_gpt.yaml data.batch_size=4 data.seq_len=96 model.layers.0.dim=32 "
                              "data.val_fraction=0.02 run.device=cpu run.steps=6 run.log_every=1 run.eval_every=3 "
                              "run.ckpt_every=3 precision.mode=%s %s run.out_dir=%s/%s-%d", mode, extra[k], scratch,
                              mode, k);
        cr_assert_eq(r.code, 0, "%s", r.out);
        cr_assert_eq(strstr(r.out, "sample step 2 | Q: \"x\"") != NULL, k == 1, "%s", r.out);
    }
    char a[700], b[700];
    snprintf(a, sizeof a, "%s/%s-0/scale_log.csv", scratch, mode);
    snprintf(b, sizeof b, "%s/%s-1/scale_log.csv", scratch, mode);
    assert_same_logs(a, b);
    for (int step = 3; step <= 6; step += 3) {
        snprintf(a, sizeof a, "%s/%s-0/ckpt-%d.h5", scratch, mode, step);
        snprintf(b, sizeof b, "%s/%s-1/ckpt-%d.h5", scratch, mode, step);
        cr_assert_gt(assert_same_tensors(a, b), 20, "%s step %d: the weights and moments", mode, step);
    }
    char cmd[2000];
    snprintf(cmd, sizeof cmd, "cmp %s/%s-0/eval.jsonl %s/%s-1/eval.jsonl", scratch, mode, scratch, mode);
    cr_assert_eq(system(cmd), 0, "%s: eval.jsonl differs", mode);
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 -c \"import json,sys\n"
             "rows = [json.loads(l) for l in open('%s/%s-1/samples.jsonl')]\n"
             "assert [r['step'] for r in rows] == [2, 4, 6], rows\n"
             "assert all(r['prompt'] == 'Q: \\\"x\\\"' for r in rows), rows\n"
             "assert all(len(r['text'].encode('utf-8', 'surrogateescape')) == 64 for r in rows), rows\n"
             "print('ok')\" 2>&1", scratch, mode);
    struct result r = shell(cmd);
    cr_assert(r.code == 0 && strstr(r.out, "ok"), "samples.jsonl: %s", r.out);
    snprintf(a, sizeof a, "%s/%s-0/samples.jsonl", scratch, mode);
    cr_assert(!file_exists(a), "a run without run.sample_every wrote %s", a);
}

Test(training, sampling_leaves_an_fp32_run_the_same_bits) { same_run("fp32"); }
Test(training, sampling_leaves_a_bf16_run_the_same_bits) { same_run("bf16"); }

Test(training, what_cannot_be_sampled_is_exit_2_before_the_first_step)
{
    struct result r = amp(TINY_TEXT " run.sample_every=5 run.sample_prompt=%0*d run.out_dir=%s/long", 40, 0, scratch);
    assert_exit(r, 2, "run.sample_prompt has 40 bytes, but the model's context is 32 positions");
    r = amp(TINY_TEXT " run.sample_every=5 precision.mode=fp8 run.out_dir=%s/fp8", scratch);
    assert_exit(r, 2, "run.sample_every: precision.mode fp8 runs do not sample while training");
    cr_assert(!strstr(r.out, "step 1"), "%s", r.out);
}

/* JSON strings of bytes: quotes, backslashes and control characters escaped, valid UTF-8 as it is, each byte of an
 * invalid sequence as \udcXX (an overlong '/', a lone continuation byte, a truncated sequence, a surrogate) */
Test(training, json_strings_of_any_bytes)
{
    static const char in[] = "a\"\\\n\x01\x7f" "\xc3\xa9" "\xe2\x82\xac" "\xc0\xaf" "\x80" "\xe2\x82" "\xed\xa0\x80";
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    cr_assert_not_null(f);
    runlog_json_bytes(f, in, sizeof in - 1);
    fclose(f);
    cr_assert_str_eq(buf, "\"a\\\"\\\\\\u000a\\u0001\\u007f\xc3\xa9\xe2\x82\xac\\udcc0\\udcaf\\udc80\\udce2\\udc82"
                          "\\udced\\udca0\\udc80\"");
    free(buf);
}
