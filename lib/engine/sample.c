/*
 * sample.c — the sampling rule and the generation loop (sample.h). The model's passes run on its backend; the
 * logits of the last position come back to the host each step, where the rule picks the next token, which goes
 * back up as the next pass's input (one int32).
 */
#include "sample.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h" /* dtype_convert, dtype_size */
#include "model.h" /* model_decode, struct decode_step */
#include "rng.h"   /* rng_uniform */
#include "runlog.h" /* runlog_sample: samples.jsonl */
#include "tokenizer.h" /* tokenizer_load, tokenizer_encode, tokenizer_decode: sample_codec */

/* weight descending, the lower token first among equals */
static int by_weight_desc(const void *a, const void *b)
{
    const struct sample_rank *x = a, *y = b;
    if (x->w != y->w)
        return x->w > y->w ? -1 : 1;
    return x->token < y->token ? -1 : x->token > y->token;
}

static int32_t argmax(const float *logits, int64_t V)
{
    int64_t best = 0;
    for (int64_t i = 1; i < V; i++)
        if (logits[i] > logits[best])
            best = i;
    return (int32_t)best;
}

int32_t sample_pick(const float *logits, int64_t V, const struct sample_opts *o, float u, struct sample_rank *k)
{
    if (o->temperature == 0.0)
        return argmax(logits, V);
    double mx = logits[argmax(logits, V)];
    for (int64_t i = 0; i < V; i++)
        k[i] = (struct sample_rank){exp(((double)logits[i] - mx) / o->temperature), (int32_t)i};
    qsort(k, (size_t)V, sizeof *k, by_weight_desc);
    int64_t kept = o->top_k > 0 && o->top_k < V ? o->top_k : V;
    double total = 0.0;
    for (int64_t i = 0; i < kept; i++)
        total += k[i].w;
    if (o->top_p < 1.0) {
        double cum = 0.0;
        int64_t n = 0;
        while (n < kept && (n == 0 || cum < o->top_p * total))
            cum += k[n++].w;
        kept = n;
        total = cum;
    }
    double r = (double)u * total, cum = 0.0;
    for (int64_t i = 0; i < kept; i++) {
        cum += k[i].w;
        if (cum > r)
            return k[i].token;
    }
    return k[kept - 1].token;
}

/* The logits of the view's last position (1, n, Vp), its first V widened to fp32 into out (V): a padded vocabulary's
 * rows are Vp apart (docs/model.md, "Vocabulary padding"). */
static void last_logits(struct backend *be, const struct tensor *logits, int64_t n, int64_t V, float *out,
                        void *raw)
{
    size_t es = dtype_size(logits->dtype);
    int64_t stride = logits->shape[logits->ndim - 1];
    be->download(be, raw, (const char *)logits->data + (size_t)((n - 1) * stride) * es, (size_t)V * es);
    dtype_convert(out, DT_FP32, raw, logits->dtype, (size_t)V);
}

enum amp_status sample_generate(struct model *m, int64_t context, const int32_t *prompt, int64_t n_prompt,
                                const struct sample_opts *o, struct sample_result *r, struct amp_error *err)
{
    memset(r, 0, sizeof *r);
    int64_t V = layer_out_cols(&m->layers[m->nlayers - 2]);
    if (n_prompt < 1 || n_prompt >= context)
        return amp_fail(err, AMP_ERR_CONFIG, "shorten the prompt: the model reads at most data.seq_len tokens",
                        "the prompt has %lld tokens, but the model's context is %lld positions and one must be left "
                        "to generate", (long long)n_prompt, (long long)context);
    for (int64_t i = 0; i < n_prompt; i++)
        if (prompt[i] < 0 || prompt[i] >= V)
            return amp_fail(err, AMP_ERR_CONFIG, "encode the prompt with the model's vocabulary",
                            "prompt token %lld is %d, outside the model's vocabulary of %lld", (long long)i,
                            prompt[i], (long long)V);
    int64_t want = n_prompt + o->tokens < context ? n_prompt + o->tokens : context;
    struct backend *be = m->be;
    r->tokens = malloc((size_t)context * sizeof *r->tokens);
    float *logits = malloc((size_t)V * sizeof *logits);
    void *raw = malloc((size_t)V * sizeof(float));
    struct sample_rank *order = malloc((size_t)V * sizeof *order);
    int32_t *dev = be->alloc(be, (size_t)context * sizeof *dev);
    enum amp_status st = AMP_OK;
    if (!r->tokens || !logits || !raw || !order || !dev)
        st = amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory generating %lld tokens", (long long)context);
    struct step_ctx ctx = {.be = be, .policy = &m->policy, .training = false};
    if (st == AMP_OK && o->keep_logits && !(r->logits = malloc((size_t)(context * V) * sizeof *r->logits)))
        st = amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory keeping the logits of %lld tokens", (long long)context);
    r->vocab = V;
    int64_t drawn = o->draw_below > 0 && o->draw_below < V ? o->draw_below : V; /* the tokens that can be drawn */
    if (st == AMP_OK) {
        memcpy(r->tokens, prompt, (size_t)n_prompt * sizeof *prompt);
        r->n = r->n_prompt = n_prompt;
        be->upload(be, dev, prompt, (size_t)n_prompt * sizeof *prompt);
    }
    /* the prompt's positions in one pass, then each new token's */
    for (int64_t pos = 0, n = n_prompt; st == AMP_OK && r->n < want; pos += n, n = 1) {
        struct decode_step d = {.pos = pos, .n = n, .tokens = dev + pos};
        struct tensor out;
        model_decode(m, &ctx, &d, &out);
        last_logits(be, &out, n, V, logits, raw);
        st = be->status(be, err);
        if (st != AMP_OK)
            break;
        if (r->logits)
            memcpy(r->logits + (r->n - n_prompt) * V, logits, (size_t)V * sizeof *logits);
        int32_t next = sample_pick(logits, drawn, o, rng_uniform(o->seed, SAMPLE_STREAM, (uint64_t)(r->n - n_prompt)),
                                   order);
        r->tokens[r->n++] = next;
        be->upload(be, dev + r->n - 1, &next, sizeof next);
    }
    r->stopped_at_context = st == AMP_OK && r->n - n_prompt < o->tokens;
    if (dev)
        be->free(be, dev);
    free(order);
    free(raw);
    free(logits);
    if (st != AMP_OK)
        sample_result_free(r);
    return st;
}

enum amp_status sample_codec_open(struct sample_codec *c, const char *path, int64_t vocab, const char *who,
                                  struct amp_error *err)
{
    c->tok = NULL;
    c->vocab = vocab;
    if (!path || !path[0]) {
        if (vocab != 256)
            return amp_fail(err, AMP_ERR_CONFIG,
                            "give the tokenizer the model was trained with: data.tokenizer, or sample's --tokenizer FILE",
                            "%s: the model's vocabulary has %lld tokens, not the 256 bytes read and written without a "
                            "tokenizer", who, (long long)vocab);
        return AMP_OK;
    }
    enum amp_status st = tokenizer_load(path, &c->tok, err);
    if (st == AMP_OK && tokenizer_vocab_size(c->tok) > vocab) {
        st = amp_fail(err, AMP_ERR_CONFIG, "give the tokenizer the model was trained with",
                      "%s: the tokenizer '%s' has %lld ids, more than the model's vocabulary of %lld", who, path,
                      (long long)tokenizer_vocab_size(c->tok), (long long)vocab);
        sample_codec_free(c);
    }
    return st;
}

enum amp_status sample_codec_encode(const struct sample_codec *c, const char *text, size_t len, const char *who,
                                    int32_t **tokens, int64_t *n, struct amp_error *err)
{
    *tokens = NULL;
    static const char newline = '\n';
    if (len == 0) {
        text = &newline;
        len = 1;
    }
    if (c->tok) {
        size_t k = 0;
        enum amp_status st = tokenizer_encode(c->tok, text, len, tokens, &k, err);
        *n = (int64_t)k;
        return st;
    }
    *tokens = malloc(len * sizeof **tokens);
    if (!*tokens)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "%s: out of memory for a prompt of %zu bytes", who, len);
    for (size_t i = 0; i < len; i++)
        (*tokens)[i] = (unsigned char)text[i];
    *n = (int64_t)len;
    return AMP_OK;
}

enum amp_status sample_codec_decode(const struct sample_codec *c, const int32_t *tokens, int64_t n, char **text,
                                    size_t *len, struct amp_error *err)
{
    if (c->tok)
        return tokenizer_decode(c->tok, tokens, (size_t)n, text, len, err);
    *text = malloc((size_t)n + 1);
    if (!*text)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory decoding %lld tokens", (long long)n);
    for (int64_t i = 0; i < n; i++)
        (*text)[i] = (char)tokens[i];
    (*text)[n] = '\0';
    *len = (size_t)n;
    return AMP_OK;
}

int64_t sample_codec_draw_below(const struct sample_codec *c)
{
    return c->tok ? tokenizer_vocab_size(c->tok) : 0;
}

void sample_codec_free(struct sample_codec *c)
{
    tokenizer_free(c->tok);
    c->tok = NULL;
}

#define RUN_SAMPLE_TOKENS 64

enum amp_status run_sampler_open(struct run_sampler *s, struct model *m, const struct config *cfg,
                                 struct amp_error *err)
{
    memset(s, 0, sizeof *s);
    if (cfg->precision.mode == PREC_FP8) /* its casts would write the scales the next step's current recipe reads */
        return amp_fail(err, AMP_ERR_CONFIG, "sample an fp8 run's checkpoint with ampTrain sample instead",
                        "run.sample_every: precision.mode fp8 runs do not sample while training");
    enum amp_status st = model_decode_begin(m, &s->context, err);
    if (st != AMP_OK) {
        char msg[sizeof err->msg];
        memcpy(msg, err->msg, sizeof msg);
        msg[sizeof msg - 32] = '\0'; /* room for the prefix */
        snprintf(err->msg, sizeof err->msg, "run.sample_every: %.2000s", msg);
        return st;
    }
    const struct layer *head = &m->layers[m->nlayers - 2];
    const char *p = cfg->run.sample_prompt;
    st = sample_codec_open(&s->codec, cfg->data.tokenizer, layer_out_cols(head), "run.sample_every",
                           err);
    if (st == AMP_OK)
        st = sample_codec_encode(&s->codec, p, strlen(p), "run.sample_prompt", &s->prompt, &s->n_prompt, err);
    if (st == AMP_OK && s->n_prompt >= s->context)
        st = amp_fail(err, AMP_ERR_CONFIG, "shorten run.sample_prompt",
                      "run.sample_prompt has %lld bytes, but the model's context is %lld positions (data.seq_len) and "
                      "one must be left to generate", (long long)s->n_prompt, (long long)s->context);
    if (st != AMP_OK)
        run_sampler_free(s);
    return st;
}

enum amp_status run_sampler_sample(struct run_sampler *s, struct model *m, struct runlog *log, const struct config *cfg,
                                   int64_t step, struct amp_error *err)
{
    struct sample_opts o = {.tokens = RUN_SAMPLE_TOKENS, .temperature = 1.0, .top_p = 1.0,
                            .seed = cfg->run.seed + (uint64_t)step, .draw_below = sample_codec_draw_below(&s->codec)};
    struct sample_result r;
    enum amp_status st = sample_generate(m, s->context, s->prompt, s->n_prompt, &o, &r, err);
    if (st != AMP_OK)
        return st;
    char *prompt = NULL, *text = NULL;
    size_t prompt_len = 0, text_len = 0;
    st = sample_codec_decode(&s->codec, r.tokens, r.n_prompt, &prompt, &prompt_len, err);
    if (st == AMP_OK)
        st = sample_codec_decode(&s->codec, r.tokens + r.n_prompt, r.n - r.n_prompt, &text, &text_len, err);
    if (st == AMP_OK)
        st = runlog_sample(log, stdout, step, prompt, prompt_len, text, text_len, err);
    free(prompt);
    free(text);
    sample_result_free(&r);
    return st;
}

void run_sampler_free(struct run_sampler *s)
{
    sample_codec_free(&s->codec);
    free(s->prompt);
    memset(s, 0, sizeof *s);
}

void sample_result_free(struct sample_result *r)
{
    free(r->logits);
    free(r->tokens);
    memset(r, 0, sizeof *r);
}
