/*
 * weight_names.h — what ampTrain's tensors are called outside it: the names `export --names` writes and
 * `model.init_from` with `model.init_names` reads (docs/checkpoint.md, "export" and "init_from").
 *
 *   ampTrain  LAYER/PARAM, the checkpoint's path under /model ("fc1/weight", "h0/attn/qkv/weight")
 *   pytorch   the state_dict key of the equivalent torch.nn model: '/' becomes '.' ("fc1.weight")
 *   hf-gpt2   Hugging Face's GPT2LMHeadModel: "transformer.wte.weight", "transformer.h.3.attn.c_attn.weight",
 *             ..., "transformer.ln_f.bias"; its Conv1D weights (c_attn, c_proj, c_fc) are stored (in, out),
 *             the transpose of our (out, in). Only a GPT-2 shaped model has these names (weight_names_check).
 *
 * A table tied by a linear's `tie` is one tensor under its embedding's name; the tying layer's weight is an
 * alias: pytorch "lm_head.weight" (state_dict() lists both keys of a tied torch.nn model), hf-gpt2
 * "lm_head.weight" (save_pretrained leaves it out and from_pretrained ties it again).
 */
#ifndef AMP_WEIGHT_NAMES_H
#define AMP_WEIGHT_NAMES_H

#include <stdbool.h>

#include "config.h" /* struct model_config, enum weight_names */
#include "error.h"

#define WEIGHT_NAME_MAX 192

/* One tensor's name outside ampTrain. */
struct outside_name {
    char name[WEIGHT_NAME_MAX];
    bool transpose; /* stored (in, out) outside: a Conv1D weight of Hugging Face's GPT-2 */
};

/* Can the model be named this way? hf-gpt2 needs a GPT-2: embedding, transformer_block x L (L >= 1), layernorm,
 * linear without bias (tied to the embedding's wte, or not), cross_entropy, and nothing else. AMP_ERR_CONFIG
 * naming the first layer that does not fit; `who` starts the message ("export", "model.init_names"). */
enum amp_status weight_names_check(const struct model_config *mc, enum weight_names names, const char *who,
                                   struct amp_error *err);

/* The outside name of tensor `ours` (LAYER/PARAM) of a model weight_names_check accepted. false where the scheme
 * has no name for it (only for a name that is not the model's). */
bool weight_name_outside(const struct model_config *mc, enum weight_names names, const char *ours,
                         struct outside_name *out);

/* The tied aliases: for each linear layer with a `tie`, its weight's outside name (alias) and the ampTrain name
 * of the table it reads (target). Returns how many (at most `max` are filled). */
struct weight_alias {
    char alias[WEIGHT_NAME_MAX];
    char target[96];
};
int weight_names_aliases(const struct model_config *mc, enum weight_names names, struct weight_alias *out, int max);

/* hf-gpt2 only: true for the keys of Hugging Face files that are not weights (h.N.attn.bias and
 * h.N.attn.masked_bias, the causal-mask buffers older transformers versions saved); init_from skips them. */
bool weight_name_ignorable(enum weight_names names, const char *outside);

#endif
