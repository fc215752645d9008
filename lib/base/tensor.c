/*
 * tensor.c — allocation, views and host transfer of tensors. See tensor.h.
 */
#include "tensor.h"

#include <stdio.h>
#include <string.h>

#include "backend.h" /* alloc, free, upload, download, zero */

static void tensor_set_shape(struct tensor *t, int ndim, const int64_t *shape)
{
    t->ndim = ndim;
    t->numel = 1;
    for (int i = 0; i < TENSOR_MAX_DIMS; i++) {
        t->shape[i] = i < ndim ? shape[i] : 1;
        if (i < ndim)
            t->numel *= (size_t)shape[i];
    }
}

enum amp_status tensor_alloc(struct tensor *t, struct backend *be, enum dtype dt, int ndim, const int64_t *shape,
                             const char *what, struct amp_error *err)
{
    memset(t, 0, sizeof *t);
    if (ndim < 1 || ndim > TENSOR_MAX_DIMS)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "tensor %s: %d dimensions (1 to %d supported)", what, ndim,
                        TENSOR_MAX_DIMS);
    t->dtype = dt;
    t->be = be;
    tensor_set_shape(t, ndim, shape);
    size_t bytes = tensor_bytes(t);
    t->data = be->alloc(be, bytes ? bytes : 1);
    if (!t->data) {
        char buf[96];
        return amp_fail(err, AMP_ERR_INTERNAL, "use a smaller data.batch_size or model",
                        "out of memory allocating tensor %s %s %s (%zu bytes) on %s", what, dtype_name(dt),
                        tensor_shape_str(t, buf, sizeof buf), bytes, be->name);
    }
    return AMP_OK;
}

enum amp_status tensor_zeros(struct tensor *t, struct backend *be, enum dtype dt, int ndim, const int64_t *shape,
                             const char *what, struct amp_error *err)
{
    enum amp_status st = tensor_alloc(t, be, dt, ndim, shape, what, err);
    if (st == AMP_OK)
        be->zero(be, t);
    return st;
}

void tensor_free(struct tensor *t)
{
    if (t && t->data && t->be)
        t->be->free(t->be, t->data);
    if (t)
        memset(t, 0, sizeof *t);
}

size_t tensor_bytes(const struct tensor *t)
{
    return t->numel * dtype_size(t->dtype);
}

bool tensor_same_shape(const struct tensor *a, const struct tensor *b)
{
    if (a->ndim != b->ndim)
        return false;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i])
            return false;
    return true;
}

const char *shape_str(char *buf, size_t len, int ndim, const int64_t *shape)
{
    size_t off = (size_t)snprintf(buf, len, "(");
    for (int i = 0; i < ndim && off < len; i++)
        off += (size_t)snprintf(buf + off, len - off, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (off < len)
        snprintf(buf + off, len - off, ")");
    return buf;
}

const char *tensor_shape_str(const struct tensor *t, char *buf, size_t len)
{
    return shape_str(buf, len, t->ndim, t->shape);
}

struct tensor tensor_reshape(const struct tensor *t, int ndim, const int64_t *shape)
{
    struct tensor v = *t;
    tensor_set_shape(&v, ndim, shape);
    return v;
}

/* 16- and 8-bit conversions go through a stack buffer a chunk at a time: no allocation, so no failure. */
#define HOST_CHUNK 4096

void tensor_from_host_f32(struct tensor *t, const float *src)
{
    if (t->dtype == DT_FP32) {
        t->be->upload(t->be, t->data, src, tensor_bytes(t));
        return;
    }
    uint16_t buf[HOST_CHUNK];
    for (size_t off = 0; off < t->numel; off += HOST_CHUNK) {
        size_t n = t->numel - off < HOST_CHUNK ? t->numel - off : HOST_CHUNK;
        size_t es = dtype_size(t->dtype);
        dtype_convert(buf, t->dtype, src + off, DT_FP32, n);
        t->be->upload(t->be, (char *)t->data + off * es, buf, n * es);
    }
}

void tensor_to_host_f32(const struct tensor *t, float *dst)
{
    if (t->dtype == DT_FP32) {
        t->be->download(t->be, dst, t->data, tensor_bytes(t));
        return;
    }
    uint16_t buf[HOST_CHUNK];
    for (size_t off = 0; off < t->numel; off += HOST_CHUNK) {
        size_t n = t->numel - off < HOST_CHUNK ? t->numel - off : HOST_CHUNK;
        size_t es = dtype_size(t->dtype);
        t->be->download(t->be, buf, (const char *)t->data + off * es, n * es);
        dtype_convert(dst + off, DT_FP32, buf, t->dtype, n);
    }
}
