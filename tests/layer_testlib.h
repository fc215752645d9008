/*
 * layer_testlib.h — what test_layers.c and test_model.c build their layers and models from: `lc`, a layer config
 * of one kind and name with the schema's defaults for every other field (docs/config.md), which a test then
 * narrows; and the data a model is built for: `vector_spec` (d features, `classes` classes) and `token_spec` (T
 * token ids below `vocab`).
 */
#ifndef AMP_LAYER_TESTLIB_H
#define AMP_LAYER_TESTLIB_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "config.h" /* struct layer_config, enum layer_kind, GELU_TANH */
#include "data.h"   /* struct data_spec */

static inline struct layer_config lc(enum layer_kind kind, const char *name)
{
    struct layer_config l;
    memset(&l, 0, sizeof l);
    l.kind = kind;
    snprintf(l.name, sizeof l.name, "%s", name);
    l.stride = 1;
    l.bias = true;
    l.eps = 1e-5;
    l.momentum = 0.1;
    l.p = 0.1;
    l.vocab = 256;
    l.mlp_ratio = 4;
    l.approximate = GELU_TANH;
    return l;
}

static inline struct data_spec vector_spec(int64_t d, int64_t classes)
{
    return (struct data_spec){.sample_ndim = 1, .sample_shape = {d}, .num_classes = classes};
}

static inline struct data_spec token_spec(int64_t T, int64_t vocab)
{
    return (struct data_spec){.sample_ndim = 1, .sample_shape = {T}, .is_tokens = true, .num_classes = vocab};
}

#endif
