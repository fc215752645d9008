/*
 * sample.h — generating text from a token model: the sampling rule and the generation loop (ampTrain sample, and
 * run.sample_every during training).
 *
 * Generation runs the model's key/value-cache path (models/model.h, model_decode): the prompt in one pass, then one
 * token per pass, until `tokens` are generated or the sequence reaches the model's context T (data.seq_len): it
 * stops there (no sliding window) and says so in `stopped_at_context`.
 *
 * The rule that picks token t+1 from the fp32 logits of position t (the logits downloaded and widened to fp32;
 * scripts/ref/sample_ref.py implements the same rule for the reference test):
 *   Only tokens below draw_below (when set: a tokenizer with fewer ids than the vocabulary) are candidates.
 *   temperature 0: the argmax (the lowest index among equal maxima); no draw.
 *   otherwise, in double: w_i = exp((l_i - max l) / temperature); the tokens ordered by w descending (ties: lower
 *   index first); top_k > 0 keeps the first top_k; top_p < 1 then keeps the shortest prefix whose sum reaches
 *   top_p times the sum of what is kept (at least one token); with u = rng_uniform(seed, SAMPLE_STREAM, k) for the
 *   k-th generated token (k from 0) and r = u * (sum of the kept w), the first kept token at which the running sum
 *   exceeds r (the last one kept if rounding leaves none).
 * The draws are a pure function of (seed, k) (lib/base/rng.h), so the same model, prompt and options give the same
 * tokens, on any backend whose logits are the same.
 */
#ifndef AMP_SAMPLE_H
#define AMP_SAMPLE_H

#include <stdbool.h>
#include <stdint.h>

#include "config.h" /* struct config */
#include "error.h" /* enum amp_status, struct amp_error */

struct model;
struct runlog;
struct tokenizer;

#define SAMPLE_STREAM 0x73616d706c65ULL /* "sample": the rng stream of the draws */

struct sample_opts {
    int64_t tokens;    /* how many to generate (>= 0) */
    double temperature;/* >= 0; 0 is greedy */
    int64_t top_k;     /* 0: every token */
    double top_p;      /* in (0, 1]; 1: every token */
    uint64_t seed;
    bool keep_logits;  /* sample_result.logits: what each token was drawn from (the reference test) */
    int64_t draw_below;/* > 0: only tokens below it are drawn (a tokenizer with fewer ids than the model's
                        * vocabulary: sample_codec_draw_below); 0: every token of the vocabulary */
};

/* A token and its weight: sample_pick's scratch, V of them. */
struct sample_rank {
    double w;
    int32_t token;
};

/* The token the rule above picks from logits (V fp32) with draw u in [0, 1). */
int32_t sample_pick(const float *logits, int64_t V, const struct sample_opts *o, float u, struct sample_rank *scratch);

struct sample_result {
    int32_t *tokens;        /* malloc'd: the prompt's tokens, then the generated ones (sample_result_free) */
    int64_t n, n_prompt;
    bool stopped_at_context;/* fewer than o->tokens generated: the sequence filled the context */
    float *logits;          /* o->keep_logits: malloc'd (n - n_prompt, vocab) fp32, row k the logits generated token
                             * k was drawn from; else NULL */
    int64_t vocab;
};

/* Generate after prompt (n_prompt >= 1 tokens, each in [0, vocab)) with model m, built for generation
 * (model_decode_begin done; its context in `context`). AMP_ERR_CONFIG when the prompt does not fit the context
 * (at most context - 1 tokens, so that one can be generated) or a token is out of range; a backend failure is
 * its status. */
enum amp_status sample_generate(struct model *m, int64_t context, const int32_t *prompt, int64_t n_prompt,
                                const struct sample_opts *o, struct sample_result *r, struct amp_error *err);
void sample_result_free(struct sample_result *r);

/* Text and tokens for a model of vocabulary `vocab`: a byte-level model's tokens are its bytes (no tokenizer file);
 * any other vocabulary needs the tokenizer the model was trained with (lib/base/tokenizer.h: a Hugging Face byte-level
 * BPE, the data.tokenizer of its run or sample's --tokenizer). */
struct sample_codec {
    struct tokenizer *tok; /* NULL: bytes */
    int64_t vocab;
};
/* path: a tokenizer file, or NULL or "" for bytes. AMP_ERR_CONFIG, the message starting with `who`, for a
 * vocabulary other than 256 without a tokenizer, or a tokenizer whose ids do not fit the model's vocabulary;
 * tokenizer_load's errors (naming the file) otherwise. */
enum amp_status sample_codec_open(struct sample_codec *c, const char *path, int64_t vocab, const char *who,
                                  struct amp_error *err);
/* text's tokens (malloc'd, *n of them); an empty text is one newline, so that generation has a position to start
 * from. */
enum amp_status sample_codec_encode(const struct sample_codec *c, const char *text, size_t len, const char *who,
                                    int32_t **tokens, int64_t *n, struct amp_error *err);
/* tokens' text: malloc'd bytes, NUL-terminated, *len without the NUL. A token the tokenizer does not know (a
 * model's vocabulary may be larger than its tokenizer's) is AMP_ERR_DATA naming it. */
enum amp_status sample_codec_decode(const struct sample_codec *c, const int32_t *tokens, int64_t n, char **text,
                                    size_t *len, struct amp_error *err);
void sample_codec_free(struct sample_codec *c);
/* sample_opts.draw_below for the codec: the tokenizer's id count, or 0 (every token) for bytes. */
int64_t sample_codec_draw_below(const struct sample_codec *c);

/* run.sample_every: the prompt, checked and encoded once before the first step. */
struct run_sampler {
    struct sample_codec codec;
    int32_t *prompt;
    int64_t n_prompt, context;
};
/* Check that m can generate from run.sample_prompt (AMP_ERR_CONFIG naming the key: a model that cannot generate,
 * a vocabulary other than 256 without data.tokenizer, a prompt that leaves no position, precision.mode fp8) and
 * allocate its caches. */
enum amp_status run_sampler_open(struct run_sampler *s, struct model *m, const struct config *cfg,
                                 struct amp_error *err);
/* Generate up to 64 tokens (temperature 1, seed run.seed + step), print them and log them (runlog_sample:
 * samples.jsonl and the event file). */
enum amp_status run_sampler_sample(struct run_sampler *s, struct model *m, struct runlog *log, const struct config *cfg,
                                   int64_t step, struct amp_error *err);
void run_sampler_free(struct run_sampler *s);

#endif
