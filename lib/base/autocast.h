/*
 * autocast.h — the autocast policy: which dtype each op kind runs in (docs/precision.md,
 * "Autocast policy").
 *
 * Each op kind has a class, mirroring PyTorch's CUDA autocast lists for the ops we have:
 *   lowp    — runs in the run's fp16/bf16: inputs cast down, FP32 accumulation, lowp output
 *             (linear, conv2d, attention_matmul)
 *   fp32    — inputs cast up, FP32 output (softmax, log_softmax, layernorm, losses,
 *             embedding: a lookup of FP32 weights)
 *   promote — the widest dtype among the inputs; for one input, the input's dtype
 *             (relu, gelu, dropout, pools, residual_add, and batchnorm2d, whose statistics are FP32
 *             always, as in PyTorch where batch_norm is in neither list and cuDNN keeps FP32 stats)
 * `precision.autocast.{lowp,fp32,promote}_ops` move op kinds between classes. With autocast disabled
 * (fp32 mode, or eval --autocast off) every op runs in fp32.
 */
#ifndef AMP_AUTOCAST_H
#define AMP_AUTOCAST_H

#include <stdbool.h>
#include <stdio.h>

#include "config.h" /* struct autocast_config, enum precision_mode */
#include "dtype.h"  /* enum dtype */
#include "error.h"  /* struct amp_error */

enum op_kind {
    OP_LINEAR, OP_CONV2D, OP_ATTENTION_MATMUL, OP_SOFTMAX, OP_LOG_SOFTMAX, OP_LAYERNORM, OP_BATCHNORM2D,
    OP_CROSS_ENTROPY, OP_MSE, OP_GELU, OP_RELU, OP_DROPOUT, OP_MAXPOOL2D, OP_AVGPOOL2D, OP_RESIDUAL_ADD,
    OP_EMBEDDING, OP_KIND_COUNT
};

enum op_class { OPC_LOWP, OPC_FP32, OPC_PROMOTE };

struct autocast_policy {
    bool enabled;                      /* false: everything fp32 */
    enum dtype lowp;                   /* DT_FP16 or DT_BF16 when enabled */
    enum op_class cls[OP_KIND_COUNT];
    bool fp8;                          /* precision.mode fp8: linear products read fp8 operands (lib/base/fp8.h), but in
                                        * the layers of precision.fp8.keep_bf16; the rest of the table is bf16's */
};

const char *op_kind_name(enum op_kind op);     /* the names used in precision.autocast lists */
int op_kind_from_name(const char *name);       /* -1 if unknown */
const char *op_class_name(enum op_class c);    /* "lowp", "fp32", "promote" */

/* Built-in table for `lowp` (enabled = lowp != DT_FP32). */
void autocast_default(struct autocast_policy *p, enum dtype lowp);

/* The policy of a run: mode's dtype, built-in table, then the config's overrides. */
enum amp_status autocast_from_config(struct autocast_policy *p, enum precision_mode mode,
                                     const struct autocast_config *ac, struct amp_error *err);

/* The dtype op runs in (its output dtype) given its input dtype(s) (for one input pass it twice). */
enum dtype autocast_dtype(const struct autocast_policy *p, enum op_kind op, enum dtype in_a, enum dtype in_b);

/* The table as printed by `ampTrain check`. */
void autocast_print(const struct autocast_policy *p, FILE *out);

#endif
