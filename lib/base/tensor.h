/*
 * tensor.h — a dense, row-major, contiguous tensor living in one backend's memory.
 *
 * A tensor knows its dtype (fp32, fp16 or bf16: 16-bit types are stored in 16 bits), its shape (up
 * to 4 dims, outermost first) and the backend that owns its memory. Layers and the engine only pass
 * tensors to backend operations (backend.h); they never touch `data` unless the backend is the CPU
 * one. Integer index buffers (labels, tokens) are not tensors: they are int32 arrays allocated with
 * backend_alloc.
 */
#ifndef AMP_TENSOR_H
#define AMP_TENSOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dtype.h" /* enum dtype, dtype_size */
#include "error.h" /* struct amp_error */

#define TENSOR_MAX_DIMS 4

struct backend;

struct tensor {
    void *data;                       /* backend memory, NULL when empty */
    enum dtype dtype;
    int ndim;
    int64_t shape[TENSOR_MAX_DIMS];   /* shape[0] is outermost; unused dims are 1 */
    size_t numel;
    struct backend *be;               /* owner of `data` */
    const float *scale_inv;           /* fp8 tensors: one fp32 in backend memory, the factor that turns a code into
                                       * the value it stands for (value = code * *scale_inv: the reciprocal of the
                                       * scale it was cast with, backend.h fp8_cast); NULL otherwise */
};

/* Allocate an uninitialised tensor of `shape` (ndim values). Returns AMP_ERR_INTERNAL naming `what`
 * on out of memory. */
enum amp_status tensor_alloc(struct tensor *t, struct backend *be, enum dtype dt, int ndim, const int64_t *shape,
                             const char *what, struct amp_error *err);

/* The same, filled with zeros. */
enum amp_status tensor_zeros(struct tensor *t, struct backend *be, enum dtype dt, int ndim, const int64_t *shape,
                             const char *what, struct amp_error *err);

/* Free the memory (NULL-safe, empty-safe) and reset to empty. */
void tensor_free(struct tensor *t);

size_t tensor_bytes(const struct tensor *t);
bool tensor_same_shape(const struct tensor *a, const struct tensor *b);

/* "(128, 784)" into buf; returns buf. */
const char *tensor_shape_str(const struct tensor *t, char *buf, size_t len);
/* The same for any dims ("(2, 3)"; "()" for ndim 0), e.g. a shape read from a file before it is a tensor. */
const char *shape_str(char *buf, size_t len, int ndim, const int64_t *shape);

/* A view of `t` with another shape of the same numel (shares data; do not free it). */
struct tensor tensor_reshape(const struct tensor *t, int ndim, const int64_t *shape);

/* Copy between host fp32 arrays and a tensor of any dtype (converting). For tests, init and checkpoints. */
void tensor_from_host_f32(struct tensor *t, const float *src);
void tensor_to_host_f32(const struct tensor *t, float *dst);

#endif
