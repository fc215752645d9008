/*
 * weight_names.c — ampTrain's tensor names and their outside equivalents (weight_names.h has the schemes).
 *
 * The hf-gpt2 names follow transformers' modeling_gpt2.py: GPT2LMHeadModel holds `transformer` (GPT2Model: wte,
 * wpe, h.N = GPT2Block (ln_1, attn = GPT2Attention (c_attn, c_proj), ln_2, mlp = GPT2MLP (c_fc, c_proj)),
 * ln_f) and `lm_head`. Conv1D keeps its weight as (in_features, out_features): x @ W + b.
 */
#include "weight_names.h"

#include <stdio.h>
#include <string.h>

static const struct layer_config *layer_named(const struct model_config *mc, const char *name, size_t len, int *index)
{
    for (int i = 0; i < mc->nlayers; i++)
        if (strlen(mc->layers[i].name) == len && !strncmp(mc->layers[i].name, name, len)) {
            *index = i;
            return &mc->layers[i];
        }
    return NULL;
}

enum amp_status weight_names_check(const struct model_config *mc, enum weight_names names, const char *who,
                                   struct amp_error *err)
{
    if (names != NAMES_HF_GPT2)
        return AMP_OK;
    const char *hint = "hf-gpt2 names a GPT-2: embedding, transformer_block x L, layernorm, linear (bias: false, "
                       "tie: EMB/wte), cross_entropy (configs/gpt2_124m.yaml); use ampTrain or pytorch names";
    /* the kind each position must have: 0 embedding, 1 blocks, 2 the final layernorm, 3 the head, 4 the loss */
    int stage = 0, blocks = 0;
    for (int i = 0; i < mc->nlayers; i++) {
        const struct layer_config *l = &mc->layers[i];
        const char *want = NULL;
        switch (l->kind) {
        case LAYER_EMBEDDING: want = stage == 0 ? NULL : "the embedding comes first"; stage = 1; break;
        case LAYER_TRANSFORMER_BLOCK:
            want = stage == 1 ? NULL : "transformer blocks follow the embedding";
            blocks++;
            break;
        case LAYER_LAYERNORM:
            want = stage == 1 && blocks > 0 ? NULL : "one layernorm (ln_f) follows the blocks";
            stage = 2;
            break;
        case LAYER_LINEAR:
            want = stage != 2 ? "the linear head follows ln_f" : l->bias ? "GPT-2's lm_head has no bias (bias: false)" : NULL;
            stage = 3;
            break;
        case LAYER_CROSS_ENTROPY: want = stage == 3 ? NULL : "the loss follows the linear head"; stage = 4; break;
        default: want = "GPT-2 has no such layer"; break;
        }
        if (want)
            return amp_fail(err, AMP_ERR_CONFIG, hint, "%s: hf-gpt2 names need a GPT-2 shaped model, but "
                            "model.layers[%d] '%s' is a %s: %s", who, i, l->name, layer_kind_name(l->kind), want);
    }
    if (stage != 4)
        return amp_fail(err, AMP_ERR_CONFIG, hint, "%s: hf-gpt2 names need a GPT-2 shaped model, but the model "
                        "ends before its %s", who, stage < 2 ? "final layernorm" : stage < 3 ? "linear head" : "loss");
    return AMP_OK;
}

/* Hugging Face's name of a block's tensor (REST after "BLOCK/"); transpose for Conv1D weights. */
static bool hf_block_name(const char *rest, int index, struct outside_name *out)
{
    static const struct { const char *ours, *theirs; bool transpose; } map[] = {
        {"ln1/weight", "ln_1.weight", false},          {"ln1/bias", "ln_1.bias", false},
        {"attn/qkv/weight", "attn.c_attn.weight", true}, {"attn/qkv/bias", "attn.c_attn.bias", false},
        {"attn/proj/weight", "attn.c_proj.weight", true}, {"attn/proj/bias", "attn.c_proj.bias", false},
        {"ln2/weight", "ln_2.weight", false},          {"ln2/bias", "ln_2.bias", false},
        {"mlp/fc/weight", "mlp.c_fc.weight", true},    {"mlp/fc/bias", "mlp.c_fc.bias", false},
        {"mlp/proj/weight", "mlp.c_proj.weight", true}, {"mlp/proj/bias", "mlp.c_proj.bias", false},
    };
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (!strcmp(rest, map[i].ours)) {
            snprintf(out->name, sizeof out->name, "transformer.h.%d.%s", index, map[i].theirs);
            out->transpose = map[i].transpose;
            return true;
        }
    return false;
}

static bool hf_name(const struct model_config *mc, const char *ours, struct outside_name *out)
{
    const char *slash = strchr(ours, '/');
    int index = -1;
    const struct layer_config *l = slash ? layer_named(mc, ours, (size_t)(slash - ours), &index) : NULL;
    if (!l)
        return false;
    const char *rest = slash + 1;
    const char *theirs = NULL;
    switch (l->kind) {
    case LAYER_EMBEDDING:
        theirs = !strcmp(rest, "wte") ? "transformer.wte.weight" : !strcmp(rest, "wpe") ? "transformer.wpe.weight" : NULL;
        break;
    case LAYER_TRANSFORMER_BLOCK: {
        int block = 0;
        for (int i = 0; i < index; i++)
            block += mc->layers[i].kind == LAYER_TRANSFORMER_BLOCK;
        return hf_block_name(rest, block, out);
    }
    case LAYER_LAYERNORM:
        theirs = !strcmp(rest, "weight") ? "transformer.ln_f.weight" : !strcmp(rest, "bias") ? "transformer.ln_f.bias" : NULL;
        break;
    case LAYER_LINEAR: theirs = !strcmp(rest, "weight") ? "lm_head.weight" : NULL; break;
    default: break;
    }
    if (!theirs)
        return false;
    snprintf(out->name, sizeof out->name, "%s", theirs);
    return true;
}

bool weight_name_outside(const struct model_config *mc, enum weight_names names, const char *ours,
                         struct outside_name *out)
{
    memset(out, 0, sizeof *out);
    switch (names) {
    case NAMES_AMPTRAIN: snprintf(out->name, sizeof out->name, "%s", ours); return true;
    case NAMES_PYTORCH:
        snprintf(out->name, sizeof out->name, "%s", ours);
        for (char *c = out->name; *c; c++)
            *c = *c == '/' ? '.' : *c;
        return true;
    case NAMES_HF_GPT2: return hf_name(mc, ours, out);
    }
    return false;
}

int weight_names_aliases(const struct model_config *mc, enum weight_names names, struct weight_alias *out, int max)
{
    int n = 0;
    for (int i = 0; i < mc->nlayers; i++) {
        const struct layer_config *l = &mc->layers[i];
        if (l->kind != LAYER_LINEAR || !l->tie[0])
            continue;
        if (n < max) {
            char ours[96];
            snprintf(ours, sizeof ours, "%s/weight", l->name);
            struct outside_name o;
            if (names == NAMES_HF_GPT2)
                snprintf(o.name, sizeof o.name, "lm_head.weight");
            else
                weight_name_outside(mc, names, ours, &o);
            snprintf(out[n].alias, sizeof out[n].alias, "%s", o.name);
            snprintf(out[n].target, sizeof out[n].target, "%s", l->tie);
        }
        n++;
    }
    return n;
}

bool weight_name_ignorable(enum weight_names names, const char *outside)
{
    if (names != NAMES_HF_GPT2)
        return false;
    const char *p = outside;
    if (!strncmp(p, "transformer.", 12))
        p += 12;
    int used = 0, index = 0;
    if (sscanf(p, "h.%d.%n", &index, &used) != 1 || used == 0)
        return false;
    return !strcmp(p + used, "attn.bias") || !strcmp(p + used, "attn.masked_bias");
}
