/*
 * autocast.c — the op-class table and its overrides. See autocast.h.
 */
#include "autocast.h"

#include <string.h>

static const char *const op_names[OP_KIND_COUNT] = {
    [OP_LINEAR] = "linear",         [OP_CONV2D] = "conv2d",           [OP_ATTENTION_MATMUL] = "attention_matmul",
    [OP_SOFTMAX] = "softmax",       [OP_LOG_SOFTMAX] = "log_softmax", [OP_LAYERNORM] = "layernorm",
    [OP_BATCHNORM2D] = "batchnorm2d", [OP_CROSS_ENTROPY] = "cross_entropy", [OP_MSE] = "mse",
    [OP_GELU] = "gelu",             [OP_RELU] = "relu",               [OP_DROPOUT] = "dropout",
    [OP_MAXPOOL2D] = "maxpool2d",   [OP_AVGPOOL2D] = "avgpool2d",     [OP_RESIDUAL_ADD] = "residual_add",
    [OP_EMBEDDING] = "embedding",
};

/* PyTorch's CUDA lists: GEMM-like ops are lower_precision_fp; softmax, layer_norm and losses are fp32;
 * ops in neither list run in their input's dtype, which is our "promote" for one input. batch_norm is in
 * neither list: like cuDNN's, ours keeps FP32 statistics (running and batch) whatever its output dtype. */
static const enum op_class default_class[OP_KIND_COUNT] = {
    [OP_LINEAR] = OPC_LOWP,       [OP_CONV2D] = OPC_LOWP,      [OP_ATTENTION_MATMUL] = OPC_LOWP,
    [OP_SOFTMAX] = OPC_FP32,      [OP_LOG_SOFTMAX] = OPC_FP32, [OP_LAYERNORM] = OPC_FP32,
    [OP_BATCHNORM2D] = OPC_PROMOTE, [OP_CROSS_ENTROPY] = OPC_FP32, [OP_MSE] = OPC_FP32,
    [OP_GELU] = OPC_PROMOTE,      [OP_RELU] = OPC_PROMOTE,     [OP_DROPOUT] = OPC_PROMOTE,
    [OP_MAXPOOL2D] = OPC_PROMOTE, [OP_AVGPOOL2D] = OPC_PROMOTE, [OP_RESIDUAL_ADD] = OPC_PROMOTE,
    [OP_EMBEDDING] = OPC_FP32,
};

const char *op_kind_name(enum op_kind op)
{
    return (op >= 0 && op < OP_KIND_COUNT) ? op_names[op] : "?";
}

int op_kind_from_name(const char *name)
{
    for (int i = 0; i < OP_KIND_COUNT; i++)
        if (strcmp(op_names[i], name) == 0)
            return i;
    return -1;
}

const char *op_class_name(enum op_class c)
{
    switch (c) {
    case OPC_LOWP: return "lowp";
    case OPC_FP32: return "fp32";
    case OPC_PROMOTE: return "promote";
    }
    return "?";
}

void autocast_default(struct autocast_policy *p, enum dtype lowp)
{
    p->enabled = lowp != DT_FP32;
    p->lowp = lowp;
    p->fp8 = false;
    memcpy(p->cls, default_class, sizeof p->cls);
}

static enum amp_status apply_list(struct autocast_policy *p, const char (*names)[32], int n, enum op_class cls,
                                  struct amp_error *err)
{
    for (int i = 0; i < n; i++) {
        int op = op_kind_from_name(names[i]);
        if (op < 0)
            return amp_fail(err, AMP_ERR_CONFIG, "see docs/config.md for the op kinds",
                            "precision.autocast.%s_ops: unknown op kind '%s'", op_class_name(cls), names[i]);
        p->cls[op] = cls;
    }
    return AMP_OK;
}

enum amp_status autocast_from_config(struct autocast_policy *p, enum precision_mode mode,
                                     const struct autocast_config *ac, struct amp_error *err)
{
    autocast_default(p, precision_lowp_dtype(mode));
    p->fp8 = mode == PREC_FP8;
    enum amp_status st = apply_list(p, ac->lowp_ops, ac->nlowp, OPC_LOWP, err);
    if (st == AMP_OK)
        st = apply_list(p, ac->fp32_ops, ac->nfp32, OPC_FP32, err);
    if (st == AMP_OK)
        st = apply_list(p, ac->promote_ops, ac->npromote, OPC_PROMOTE, err);
    return st;
}

static enum dtype wider(enum dtype a, enum dtype b)
{
    if (a == DT_FP32 || b == DT_FP32)
        return DT_FP32;
    if (a != b)  /* fp16 with bf16: neither holds the other; PyTorch promotes to fp32 */
        return DT_FP32;
    return a;
}

enum dtype autocast_dtype(const struct autocast_policy *p, enum op_kind op, enum dtype in_a, enum dtype in_b)
{
    if (!p->enabled)
        return DT_FP32;
    switch (p->cls[op]) {
    case OPC_LOWP: return p->lowp;
    case OPC_FP32: return DT_FP32;
    case OPC_PROMOTE: return wider(in_a, in_b);
    }
    return DT_FP32;
}

void autocast_print(const struct autocast_policy *p, FILE *out)
{
    fprintf(out, "autocast policy (%s%s):\n", p->enabled ? dtype_name(p->lowp) : "disabled: every op runs in fp32",
            p->enabled && p->fp8 ? "; linear products in fp8, see below" : "");
    fprintf(out, "  %-18s %-8s %s\n", "op", "class", "runs in");
    for (int i = 0; i < OP_KIND_COUNT; i++) {
        const char *runs;
        switch (p->cls[i]) {
        case OPC_LOWP: runs = !p->enabled ? "fp32" : p->fp8 && i == OP_LINEAR ? "e4m3 x e4m3 -> bf16 (grads e5m2)"
                                                        : dtype_name(p->lowp); break;
        case OPC_FP32: runs = "fp32"; break;
        default: runs = "widest input"; break;
        }
        fprintf(out, "  %-18s %-8s %s\n", op_names[i], op_class_name(p->cls[i]), runs);
    }
}
