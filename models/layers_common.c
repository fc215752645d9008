/*
 * layers_common.c — what every layer kind's setup uses: the config-error message naming the layer,
 * parameter / buffer / saved-tensor allocation, the shared backward workspace, and batch views.
 * See layers.h.
 */
#include "layers.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h" /* layer_kind_name */

enum amp_status layer_fail(const struct layer *l, struct layer_build *b, const char *hint, const char *fmt, ...)
{
    char what[1536];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return amp_fail(b->err, AMP_ERR_CONFIG, hint, "model.layers[%d] '%s' (%s): %s", l->index, l->cfg.name,
                    layer_kind_name(l->cfg.kind), what);
}

const char *shape_str_n(char *buf, size_t len, int ndim, const int64_t *shape)
{
    size_t off = (size_t)snprintf(buf, len, "(N");
    for (int i = 1; i < ndim && off < len; i++)
        off += (size_t)snprintf(buf + off, len - off, ", %lld", (long long)shape[i]);
    if (off < len)
        snprintf(buf + off, len - off, ")");
    return buf;
}

enum amp_status layer_reserve_params(struct layer *l, struct layer_build *b, int n)
{
    l->params = calloc((size_t)n, sizeof *l->params);
    if (!l->params)
        return amp_fail(b->err, AMP_ERR_INTERNAL, NULL, "out of memory creating the parameters of layer '%s'",
                        l->cfg.name);
    l->nparams = 0;
    return AMP_OK;
}

struct param *layer_add_param(struct layer *l, struct layer_build *b, const char *local, int ndim,
                              const int64_t *shape, enum param_init init, int64_t fan_in, bool decay,
                              enum dtype read_as)
{
    struct param *p = &l->params[l->nparams++];
    snprintf(p->name, sizeof p->name, "%s/%s", l->cfg.name, local);
    p->decay = decay;
    p->layer = l->index;
    p->init = init;
    p->fan_in = fan_in;
    if (tensor_alloc(&p->master, b->be, b->master_dtype, ndim, shape, p->name, b->err) != AMP_OK ||
        tensor_zeros(&p->grad, b->be, DT_FP32, ndim, shape, p->name, b->err) != AMP_OK)
        return NULL;
    if (read_as != b->master_dtype && tensor_alloc(&p->copy, b->be, read_as, ndim, shape, p->name, b->err) != AMP_OK)
        return NULL;
    return p;
}

/* One tensor of a parameter, reallocated zeroed with `rows` outer rows and given back its logical shape. */
static enum amp_status pad_tensor_rows(struct tensor *t, struct layer_build *b, const char *name, int64_t rows)
{
    if (!t->data)
        return AMP_OK;
    int64_t shape[TENSOR_MAX_DIMS];
    memcpy(shape, t->shape, sizeof shape);
    shape[0] = rows;
    struct tensor padded;
    enum amp_status st = tensor_zeros(&padded, t->be, t->dtype, t->ndim, shape, name, b->err);
    if (st != AMP_OK)
        return st;
    padded.shape[0] = t->shape[0];
    padded.numel = t->numel;
    tensor_free(t);
    *t = padded;
    return AMP_OK;
}

enum amp_status layer_pad_param_rows(struct param *p, struct layer_build *b, int64_t rows)
{
    if (rows <= p->master.shape[0])
        return AMP_OK;
    struct tensor *ts[] = {&p->master, &p->grad, &p->copy, &p->tied_grad};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) {
        enum amp_status st = pad_tensor_rows(ts[i], b, p->name, rows);
        if (st != AMP_OK)
            return st;
    }
    p->stored_rows = rows;
    return AMP_OK;
}

enum amp_status layer_add_buffer(struct layer *l, struct layer_build *b, const char *local, int ndim,
                                 const int64_t *shape)
{
    struct buffer *buf = &l->buffers[l->nbuffers++];
    snprintf(buf->name, sizeof buf->name, "%s/%s", l->cfg.name, local);
    return tensor_alloc(&buf->t, b->be, DT_FP32, ndim, shape, buf->name, b->err);
}

enum amp_status layer_alloc(struct layer *l, struct layer_build *b, struct tensor *t, enum dtype dt, int ndim,
                            const int64_t *shape, const char *what)
{
    char name[160];
    snprintf(name, sizeof name, "%s (%s)", what, l->cfg.name);
    return tensor_alloc(t, b->be, dt, ndim, shape, name, b->err);
}

/* Offsets stay aligned for vector loads on any backend. */
#define SCRATCH_ALIGN 256

size_t scratch_reserve(struct layer_build *b, enum dtype dt, size_t numel)
{
    size_t off = b->scratch_bytes;
    size_t bytes = numel * dtype_size(dt);
    b->scratch_bytes += (bytes + SCRATCH_ALIGN - 1) / SCRATCH_ALIGN * SCRATCH_ALIGN;
    return off;
}

struct tensor scratch_view(const struct tensor *workspace, size_t off, enum dtype dt, int ndim,
                           const int64_t *shape)
{
    struct tensor t = *workspace;
    t.data = (char *)workspace->data + off;
    t.dtype = dt;
    return tensor_reshape(&t, ndim, shape);
}

struct tensor batch_view(const struct tensor *t, int64_t rows)
{
    int64_t shape[TENSOR_MAX_DIMS];
    memcpy(shape, t->shape, sizeof shape);
    shape[0] = rows;
    return tensor_reshape(t, t->ndim, shape);
}

struct tensor seq_view(const struct tensor *t, int64_t n)
{
    return tensor_reshape(t, 3, (int64_t[]){1, n, t->shape[t->ndim - 1]});
}

struct tensor batch_view_like(const struct tensor *t, const struct tensor *like)
{
    return tensor_reshape(t, like->ndim, like->shape);
}

struct tensor matrix_view(const struct tensor *t, int64_t rows, int64_t cols)
{
    int64_t shape[2] = {rows, cols};
    return tensor_reshape(t, 2, shape);
}

int64_t shape_inner(int ndim, const int64_t *shape)
{
    int64_t n = 1;
    for (int i = 1; i < ndim; i++)
        n *= shape[i];
    return n;
}

void grads_final(const struct step_ctx *ctx, const struct param *first)
{
    if (ctx->hook)
        ctx->hook->grads_final(ctx->hook->user, first);
}

void count_grad_zeros(const struct step_ctx *ctx, const struct tensor *g, bool computed_lowp)
{
    count_grad_zeros_padded(ctx, g, computed_lowp, 0);
}

void count_grad_zeros_padded(const struct step_ctx *ctx, const struct tensor *g, bool computed_lowp, int64_t valid)
{
    if (!ctx->zeros || !g->data || (g->dtype == DT_FP32 && !computed_lowp))
        return;
    ctx->be->count_zeros(ctx->be, g, ctx->zeros->zeros);
    int64_t cols = g->shape[g->ndim - 1];
    int64_t pad = valid > 0 && valid < cols ? (int64_t)g->numel / cols * (cols - valid) : 0;
    ctx->zeros->total += (int64_t)g->numel - pad;
    ctx->zeros->padding += pad;
}
