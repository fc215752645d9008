/*
 * elementwise.cu — activations, residual add, dropout, pooling, embeddings and bias sums on the GPU.
 *
 * Each kernel is the CPU reference (kernels/cpu/elementwise.c) with its loop body moved to one thread: inputs
 * read as fp32 via load_elem, the same fp32 formula, one rounding on store. Grid-stride loops cover any
 * size. Nothing here uses floating-point atomics:
 *  - bias_grad: column sums in two passes (double partials per row chunk, then a fixed-order sum).
 *  - pool2d_backward gathers: each input element sums, in ascending window order, the gradients of the
 *    windows that chose it (max) or cover it (avg) — the CPU's scatter order, so fp32 results match.
 *  - embedding_backward: wpe by one thread per (t, c) looping over b; wte by a stable radix sort of the
 *    token ids (CUB), then one thread per (token run, c) adding the run's rows in position order — the
 *    CPU's order again. Cost O(B*T*C) plus the sort, independent of the vocabulary size.
 * Dropout draws the CPU's mask bit for bit: rng_bits is lib/base/rng.h's one definition for the host and the device.
 */
#include "backend_cuda_internal.h"
#include "rng.h" /* rng_bits */

#include <cub/device/device_radix_sort.cuh> /* cub::DeviceRadixSort::SortPairs */

namespace {

constexpr float kGeluTanhS = 0.7978845608028654f;  /* sqrt(2 / pi) */
constexpr float kGeluTanhC = 0.044715f;
constexpr float kInvSqrt2 = 0.7071067811865476f;    /* 1 / sqrt(2) */
constexpr float kInvSqrt2Pi = 0.3989422804014327f;  /* 1 / sqrt(2 pi) */

#define GRID_STRIDE(i, n)                                                                                      \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (size_t)(n);                            \
         i += (size_t)gridDim.x * blockDim.x)

__global__ void act_forward_kernel(int kind, void *y, int y_dt, const void *x, int x_dt, size_t n)
{
    GRID_STRIDE(i, n)
    {
        float v = load_elem(x, x_dt, i), r;
        if (kind == ACT_RELU) {
            r = v <= 0.0f ? 0.0f : v;
        } else if (kind == ACT_GELU_TANH) {
            float u = kGeluTanhS * (v + kGeluTanhC * v * v * v);
            r = 0.5f * v * (1.0f + tanhf(u));
        } else {
            r = 0.5f * v * (1.0f + erff(v * kInvSqrt2));
        }
        store_elem(y, y_dt, i, r);
    }
}

__global__ void act_backward_kernel(int kind, void *dx, int dx_dt, const void *dy, int dy_dt, const void *x, int x_dt,
                                    size_t n)
{
    GRID_STRIDE(i, n)
    {
        float v = load_elem(x, x_dt, i), g = load_elem(dy, dy_dt, i), r;
        if (kind == ACT_RELU) {
            r = v <= 0.0f ? 0.0f : g;
        } else {
            float d;
            if (fabsf(v) > 20.0f) {
                d = v > 0.0f ? 1.0f : 0.0f;
            } else if (kind == ACT_GELU_TANH) {
                float u = kGeluTanhS * (v + kGeluTanhC * v * v * v);
                float t = tanhf(u);
                d = 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * kGeluTanhS * (1.0f + 3.0f * kGeluTanhC * v * v);
            } else {
                d = 0.5f * (1.0f + erff(v * kInvSqrt2)) + v * kInvSqrt2Pi * expf(-0.5f * v * v);
            }
            r = g * d;
        }
        store_elem(dx, dx_dt, i, r);
    }
}

__global__ void add_kernel(void *y, int y_dt, const void *a, int a_dt, const void *b, int b_dt, size_t n)
{
    GRID_STRIDE(i, n)
    store_elem(y, y_dt, i, load_elem(a, a_dt, i) + load_elem(b, b_dt, i));
}

/* lib/base/rng.c's rng_uniform: rng_bits is lib/base/rng.h's, shared with the host */
__device__ __forceinline__ float rng_uniform_dev(uint64_t seed, uint64_t stream, uint64_t counter)
{
    return (float)(rng_bits(seed, stream, counter) >> 40) * (1.0f / 16777216.0f);
}

/* y = x * (kept ? 1/(1-p) : 0); element i kept iff rng_uniform(seed, (stream << 20) + (counter >> 32),
 * (counter << 32) | i) >= p (kernels/cpu/elementwise.c, dropout_apply). */
/* The key's counter is counter + *step * per_step where step is set (backend.h struct rng_key: the trainer's step,
 * read from device memory as the kernel runs, so a recorded graph serves every step), then split as the CPU splits
 * it (kernels/cpu/elementwise.c, dropout_stream and dropout_counter). */
__global__ void dropout_kernel(void *y, int y_dt, const void *x, int x_dt, size_t n, float p, float scale,
                               uint64_t seed, uint64_t key_stream, uint64_t counter, const int64_t *step,
                               uint64_t per_step)
{
    if (step)
        counter += (uint64_t)*step * per_step;
    uint64_t stream = (key_stream << 20) + (counter >> 32), counter_hi = counter << 32;
    GRID_STRIDE(i, n)
    {
        float u = rng_uniform_dev(seed, stream, counter_hi | (uint64_t)i);
        store_elem(y, y_dt, i, load_elem(x, x_dt, i) * (u >= p ? scale : 0.0f));
    }
}

/* ---- pooling ---- */

struct pool_dims {
    int kind;
    int64_t n, c, h_in, w_in, h_out, w_out, kernel, stride, padding;
};

__device__ int64_t pool_argmax_dev(const void *x, int x_dt, size_t plane, const pool_dims &a, int64_t oh, int64_t ow)
{
    int64_t best_i = -1;
    float best = -INFINITY;
    for (int64_t kh = 0; kh < a.kernel; kh++) {
        int64_t ih = oh * a.stride - a.padding + kh;
        if (ih < 0 || ih >= a.h_in)
            continue;
        for (int64_t kw = 0; kw < a.kernel; kw++) {
            int64_t iw = ow * a.stride - a.padding + kw;
            if (iw < 0 || iw >= a.w_in)
                continue;
            float v = load_elem(x, x_dt, plane + (size_t)(ih * a.w_in + iw));
            if (v > best || isnan(v) || best_i < 0) {
                best = v;
                best_i = ih * a.w_in + iw;
            }
        }
    }
    return best_i;
}

__device__ int64_t pool_divisor_dev(const pool_dims &a, int64_t oh, int64_t ow)
{
    int64_t h0 = oh * a.stride - a.padding, w0 = ow * a.stride - a.padding;
    int64_t h1 = h0 + a.kernel < a.h_in + a.padding ? h0 + a.kernel : a.h_in + a.padding;
    int64_t w1 = w0 + a.kernel < a.w_in + a.padding ? w0 + a.kernel : a.w_in + a.padding;
    return (h1 - h0) * (w1 - w0);
}

__global__ void pool_forward_kernel(pool_dims a, void *y, int y_dt, const void *x, int x_dt)
{
    size_t total = (size_t)(a.n * a.c * a.h_out * a.w_out);
    GRID_STRIDE(i, total)
    {
        int64_t ow = (int64_t)(i % a.w_out), oh = (int64_t)((i / a.w_out) % a.h_out), pl = (int64_t)(i / (a.w_out * a.h_out));
        size_t plane = (size_t)(pl * a.h_in * a.w_in);
        float r;
        if (a.kind == POOL_MAX) {
            int64_t idx = pool_argmax_dev(x, x_dt, plane, a, oh, ow);
            r = idx >= 0 ? load_elem(x, x_dt, plane + (size_t)idx) : -INFINITY;
        } else {
            float sum = 0.0f;
            for (int64_t kh = 0; kh < a.kernel; kh++) {
                int64_t ih = oh * a.stride - a.padding + kh;
                if (ih < 0 || ih >= a.h_in)
                    continue;
                for (int64_t kw = 0; kw < a.kernel; kw++) {
                    int64_t iw = ow * a.stride - a.padding + kw;
                    if (iw >= 0 && iw < a.w_in)
                        sum += load_elem(x, x_dt, plane + (size_t)(ih * a.w_in + iw));
                }
            }
            r = sum / (float)pool_divisor_dev(a, oh, ow);
        }
        store_elem(y, y_dt, i, r);
    }
}

/* One thread per input element: the windows (oh, ow) that contain it, in ascending order. */
__global__ void pool_backward_kernel(pool_dims a, void *dx, int dx_dt, const void *dy, int dy_dt, const void *x,
                                     int x_dt)
{
    size_t total = (size_t)(a.n * a.c * a.h_in * a.w_in);
    GRID_STRIDE(i, total)
    {
        int64_t iw = (int64_t)(i % a.w_in), ih = (int64_t)((i / a.w_in) % a.h_in), pl = (int64_t)(i / (a.w_in * a.h_in));
        size_t plane = (size_t)(pl * a.h_in * a.w_in), gplane = (size_t)(pl * a.h_out * a.w_out);
        int64_t me = ih * a.w_in + iw;
        /* oh * stride - padding <= ih < oh * stride - padding + kernel */
        int64_t oh0 = ih + a.padding - a.kernel + 1, oh1 = (ih + a.padding) / a.stride;
        oh0 = oh0 <= 0 ? 0 : (oh0 + a.stride - 1) / a.stride;
        int64_t ow0 = iw + a.padding - a.kernel + 1, ow1 = (iw + a.padding) / a.stride;
        ow0 = ow0 <= 0 ? 0 : (ow0 + a.stride - 1) / a.stride;
        if (oh1 >= a.h_out)
            oh1 = a.h_out - 1;
        if (ow1 >= a.w_out)
            ow1 = a.w_out - 1;
        float acc = 0.0f;
        for (int64_t oh = oh0; oh <= oh1; oh++)
            for (int64_t ow = ow0; ow <= ow1; ow++) {
                float gv = load_elem(dy, dy_dt, gplane + (size_t)(oh * a.w_out + ow));
                if (a.kind == POOL_MAX) {
                    if (pool_argmax_dev(x, x_dt, plane, a, oh, ow) == me)
                        acc += gv;
                } else {
                    acc += gv / (float)pool_divisor_dev(a, oh, ow);
                }
            }
        store_elem(dx, dx_dt, i, acc);
    }
}

/* ---- sums and biases ---- */

constexpr int64_t kRowChunk = 256;

/* partial[chunk][j] = sum of dy[r][j] over the chunk's rows, in double */
__global__ void column_partials_kernel(double *partial, const void *dy, int dy_dt, int64_t m, int64_t n,
                                       int64_t chunks)
{
    int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (j >= n)
        return;
    for (int64_t chunk = blockIdx.y; chunk < chunks; chunk += gridDim.y) { /* gridDim.y is at most 65535 */
        int64_t r0 = chunk * kRowChunk, r1 = r0 + kRowChunk < m ? r0 + kRowChunk : m;
        double s = 0.0;
        for (int64_t r = r0; r < r1; r++)
            s += load_elem(dy, dy_dt, (size_t)(r * n + j));
        partial[chunk * n + j] = s;
    }
}

__global__ void column_finish_kernel(float *db, const double *partial, int64_t chunks, int64_t n, float beta)
{
    int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (j >= n)
        return;
    double s = 0.0;
    for (int64_t c = 0; c < chunks; c++)
        s += partial[c * n + j];
    db[j] = beta == 0.0f ? (float)s : beta * db[j] + (float)s;
}

__global__ void add_row_bias_kernel(void *y, int dt, const float *bias, int64_t rows, int64_t n, int64_t batch,
                                    int64_t stride)
{
    size_t total = (size_t)(rows * n * batch);
    GRID_STRIDE(i, total)
    {
        int64_t j = (int64_t)(i % n), r = (int64_t)((i / n) % rows), b = (int64_t)(i / (n * rows));
        size_t at = (size_t)(b * stride + r * n + j);
        store_elem(y, dt, at, load_elem(y, dt, at) + bias[j]);
    }
}

__global__ void add_channel_bias_kernel(void *y, int dt, const float *bias, int64_t C, int64_t HW, size_t total)
{
    GRID_STRIDE(i, total)
    store_elem(y, dt, i, load_elem(y, dt, i) + bias[(i / HW) % C]);
}

/* ---- embeddings ---- */

__global__ void embedding_forward_kernel(void *y, int y_dt, const int32_t *tokens, const void *wte, int wte_dt,
                                         int64_t vocab, const void *wpe, int wpe_dt, int64_t T, int64_t C, size_t total)
{
    GRID_STRIDE(i, total)
    {
        int64_t c = (int64_t)(i % C), bt = (int64_t)(i / C), t = bt % T;
        int32_t tok = tokens[bt];
        if (tok < 0 || tok >= vocab)
            tok = 0; /* never read outside wte (the data module validates tokens) */
        store_elem(y, y_dt, i,
                   load_elem(wte, wte_dt, (size_t)(tok * C + c)) + load_elem(wpe, wpe_dt, (size_t)(t * C + c)));
    }
}

__global__ void scale_kernel(float *d, size_t n, float beta)
{
    GRID_STRIDE(i, n)
    d[i] = beta == 0.0f ? 0.0f : beta * d[i];
}

/* dwpe[t][c] = beta * dwpe + sum over b of dy[b][t][c], in b order: every position, whatever its token (as the
 * CPU; a token outside the vocabulary adds nothing to dwte only) */
__global__ void wpe_backward_kernel(float *dwpe, const void *dy, int dy_dt, int64_t B, int64_t T, int64_t C,
                                    float beta)
{
    GRID_STRIDE(i, (size_t)(T * C))
    {
        int64_t t = (int64_t)(i / C), c = (int64_t)(i % C);
        float acc = 0.0f; /* this pass's gradient first, then added: as one rank sums two micro-batches */
        for (int64_t b = 0; b < B; b++)
            acc += load_elem(dy, dy_dt, (size_t)((b * T + t) * C + c));
        dwpe[i] = beta == 0.0f ? acc : beta * dwpe[i] + acc;
    }
}

__global__ void iota_kernel(int32_t *v, size_t n)
{
    GRID_STRIDE(i, n)
    v[i] = (int32_t)i;
}

/* Thread (i, c) with i the first of a run of equal sorted tokens: dwte[tok][c] += the run's rows summed
 * from zero in position order (the sort is stable). dwte was already scaled by beta. */
__global__ void wte_backward_kernel(float *dwte, int64_t vocab, const uint32_t *keys, const int32_t *pos, const void *dy,
                                    int dy_dt, int64_t BT, int64_t C)
{
    GRID_STRIDE(i, (size_t)(BT * C))
    {
        int64_t s = (int64_t)(i / C), c = (int64_t)(i % C);
        uint32_t tok = keys[s];
        if ((s > 0 && keys[s - 1] == tok) || (int64_t)tok >= vocab) /* out of range (negative as uint32): skipped */
            continue;
        float acc = 0.0f;
        for (int64_t r = s; r < BT && keys[r] == tok; r++)
            acc += load_elem(dy, dy_dt, (size_t)pos[r] * C + c);
        dwte[(size_t)tok * C + c] += acc;
    }
}

} // namespace

void cuda_bias_grad(struct backend *be, struct tensor *db, const struct tensor *dy, int64_t m, int64_t n, float beta)
{
    struct cuda_backend *cb = cuda_of(be);
    if (n <= 0)
        return;
    int64_t chunks = m > 0 ? (m + kRowChunk - 1) / kRowChunk : 0;
    double *partial = static_cast<double *>(cuda_scratch(cb, CSCR_PARTIAL, (size_t)((chunks ? chunks : 1) * n) * sizeof(double)));
    if (!partial)
        return;
    unsigned gx = (unsigned)((n + 127) / 128);
    if (chunks > 0) {
        unsigned gy = (unsigned)(chunks < 65535 ? chunks : 65535);
        column_partials_kernel<<<dim3(gx, gy), 128, 0, cb->stream>>>(partial, dy->data, dy->dtype, m, n, chunks);
        CB_LAUNCHED(cb, "column_partials_kernel");
    }
    column_finish_kernel<<<gx, 128, 0, cb->stream>>>(static_cast<float *>(db->data), partial, chunks, n, beta);
    CB_LAUNCHED(cb, "column_finish_kernel");
}

void cuda_act_forward(struct backend *be, enum act_kind kind, struct tensor *y, const struct tensor *x)
{
    struct cuda_backend *cb = cuda_of(be);
    if (!x->numel)
        return;
    act_forward_kernel<<<grid_for(x->numel), kThreads, 0, cb->stream>>>(kind, y->data, y->dtype, x->data, x->dtype,
                                                                        x->numel);
    CB_LAUNCHED(cb, "act_forward_kernel");
}

void cuda_act_backward(struct backend *be, enum act_kind kind, struct tensor *dx, const struct tensor *dy,
                       const struct tensor *x)
{
    struct cuda_backend *cb = cuda_of(be);
    if (!x->numel)
        return;
    act_backward_kernel<<<grid_for(x->numel), kThreads, 0, cb->stream>>>(kind, dx->data, dx->dtype, dy->data, dy->dtype,
                                                                         x->data, x->dtype, x->numel);
    CB_LAUNCHED(cb, "act_backward_kernel");
}

void cuda_add(struct backend *be, struct tensor *y, const struct tensor *a, const struct tensor *b)
{
    struct cuda_backend *cb = cuda_of(be);
    if (!y->numel)
        return;
    add_kernel<<<grid_for(y->numel), kThreads, 0, cb->stream>>>(y->data, y->dtype, a->data, a->dtype, b->data, b->dtype,
                                                                y->numel);
    CB_LAUNCHED(cb, "add_kernel");
}

static void dropout_apply(struct cuda_backend *cb, struct tensor *y, const struct tensor *x, float p, struct rng_key key)
{
    if (!x->numel)
        return;
    if (p <= 0.0f) {
        cb->base.convert(&cb->base, y, x);
        return;
    }
    if ((uint64_t)x->numel > 0x100000000ULL || key.stream >= (1ULL << 44) || key.counter >= (1ULL << 52)) {
        cuda_record(cb, "this is a bug in the caller (see dropout_apply in kernels/cpu/elementwise.c)",
                    "dropout: tensor of %zu elements or key (stream %llu, counter %llu) out of the mask's range",
                    x->numel, (unsigned long long)key.stream, (unsigned long long)key.counter);
        return;
    }
    dropout_kernel<<<grid_for(x->numel), kThreads, 0, cb->stream>>>(y->data, y->dtype, x->data, x->dtype, x->numel, p,
                                                                    1.0f / (1.0f - p), key.seed, key.stream,
                                                                    key.counter, key.step, key.per_step);
    CB_LAUNCHED(cb, "dropout_kernel");
}

void cuda_dropout_forward(struct backend *be, struct tensor *y, const struct tensor *x, float p, struct rng_key key)
{
    dropout_apply(cuda_of(be), y, x, p, key);
}

void cuda_dropout_backward(struct backend *be, struct tensor *dx, const struct tensor *dy, float p, struct rng_key key)
{
    dropout_apply(cuda_of(be), dx, dy, p, key);
}

static pool_dims dims_of(const struct pool_args *a)
{
    pool_dims d;
    d.kind = a->kind;
    d.n = a->n;
    d.c = a->c;
    d.h_in = a->h_in;
    d.w_in = a->w_in;
    d.h_out = a->h_out;
    d.w_out = a->w_out;
    d.kernel = a->kernel;
    d.stride = a->stride;
    d.padding = a->padding;
    return d;
}

void cuda_pool2d_forward(struct backend *be, const struct pool_args *a, struct tensor *y, const struct tensor *x)
{
    struct cuda_backend *cb = cuda_of(be);
    if (!y->numel)
        return;
    pool_forward_kernel<<<grid_for(y->numel), kThreads, 0, cb->stream>>>(dims_of(a), y->data, y->dtype, x->data,
                                                                         x->dtype);
    CB_LAUNCHED(cb, "pool_forward_kernel");
}

void cuda_pool2d_backward(struct backend *be, const struct pool_args *a, struct tensor *dx, const struct tensor *dy,
                          const struct tensor *x, const struct tensor *y)
{
    struct cuda_backend *cb = cuda_of(be);
    (void)y; /* the window's argmax is recomputed from x, as on the CPU */
    if (!dx->numel)
        return;
    pool_backward_kernel<<<grid_for(dx->numel), kThreads, 0, cb->stream>>>(dims_of(a), dx->data, dx->dtype, dy->data,
                                                                           dy->dtype, x->data, x->dtype);
    CB_LAUNCHED(cb, "pool_backward_kernel");
}

void cuda_add_row_bias(struct cuda_backend *cb, void *y, enum dtype dt, const float *bias, int64_t rows, int64_t n,
                       int64_t batch, int64_t stride)
{
    size_t total = (size_t)(rows * n * batch);
    if (!total)
        return;
    add_row_bias_kernel<<<grid_for(total), kThreads, 0, cb->stream>>>(y, dt, bias, rows, n, batch,
                                                                     batch > 1 ? stride : rows * n);
    CB_LAUNCHED(cb, "add_row_bias_kernel");
}

void cuda_add_channel_bias(struct cuda_backend *cb, void *y, enum dtype dt, const float *bias, int64_t N, int64_t C,
                           int64_t HW)
{
    size_t total = (size_t)(N * C * HW);
    if (!total)
        return;
    add_channel_bias_kernel<<<grid_for(total), kThreads, 0, cb->stream>>>(y, dt, bias, C, HW, total);
    CB_LAUNCHED(cb, "add_channel_bias_kernel");
}

void cuda_embedding_forward(struct backend *be, struct tensor *y, const int32_t *tokens, const struct tensor *wte,
                            const struct tensor *wpe, int64_t B, int64_t T, int64_t C)
{
    struct cuda_backend *cb = cuda_of(be);
    size_t total = (size_t)(B * T * C);
    if (!total)
        return;
    embedding_forward_kernel<<<grid_for(total), kThreads, 0, cb->stream>>>(
        y->data, y->dtype, tokens, wte->data, wte->dtype, (int64_t)wte->numel / C, wpe->data, wpe->dtype, T, C, total);
    CB_LAUNCHED(cb, "embedding_forward_kernel");
}

void cuda_embedding_backward(struct backend *be, struct tensor *dwte, struct tensor *dwpe, const struct tensor *dy,
                             const int32_t *tokens, int64_t B, int64_t T, int64_t C, float beta)
{
    struct cuda_backend *cb = cuda_of(be);
    int64_t BT = B * T, vocab = (int64_t)dwte->numel / C;
    wpe_backward_kernel<<<grid_for((size_t)(T * C)), kThreads, 0, cb->stream>>>(
        static_cast<float *>(dwpe->data), dy->data, dy->dtype, B, T, C, beta);
    CB_LAUNCHED(cb, "wpe_backward_kernel");
    if (dwpe->numel > (size_t)(T * C)) /* rows beyond T get no gradient: only the scaling */
        scale_kernel<<<grid_for(dwpe->numel - (size_t)(T * C)), kThreads, 0, cb->stream>>>(
            static_cast<float *>(dwpe->data) + T * C, dwpe->numel - (size_t)(T * C), beta);
    scale_kernel<<<grid_for(dwte->numel), kThreads, 0, cb->stream>>>(static_cast<float *>(dwte->data), dwte->numel, beta);
    CB_LAUNCHED(cb, "scale_kernel");
    if (BT <= 0)
        return;
    /* keys sorted as uint32 over all 32 bits: equal ids are contiguous whatever their value */
    size_t temp_bytes = 0;
    if (!CB_CUDA(cb, cub::DeviceRadixSort::SortPairs(NULL, temp_bytes, (const uint32_t *)NULL, (uint32_t *)NULL,
                                                     (const int32_t *)NULL, (int32_t *)NULL, (int)BT, 0, 32,
                                                     cb->stream)))
        return;
    uint32_t *keys = static_cast<uint32_t *>(cuda_scratch(cb, CSCR_EMB_KEYS, (size_t)BT * sizeof(uint32_t)));
    int32_t *vals_in = static_cast<int32_t *>(cuda_scratch(cb, CSCR_EMB_VALS_IN, (size_t)BT * sizeof(int32_t)));
    int32_t *vals = static_cast<int32_t *>(cuda_scratch(cb, CSCR_EMB_VALS, (size_t)BT * sizeof(int32_t)));
    void *temp = cuda_scratch(cb, CSCR_EMB_SORT, temp_bytes);
    if (!keys || !vals_in || !vals || !temp)
        return;
    iota_kernel<<<grid_for((size_t)BT), kThreads, 0, cb->stream>>>(vals_in, (size_t)BT);
    CB_LAUNCHED(cb, "iota_kernel");
    if (!CB_CUDA(cb, cub::DeviceRadixSort::SortPairs(temp, temp_bytes, reinterpret_cast<const uint32_t *>(tokens), keys,
                                                     vals_in, vals, (int)BT, 0, 32, cb->stream)))
        return;
    wte_backward_kernel<<<grid_for((size_t)(BT * C)), kThreads, 0, cb->stream>>>(
        static_cast<float *>(dwte->data), vocab, keys, vals, dy->data, dy->dtype, BT, C);
    CB_LAUNCHED(cb, "wte_backward_kernel");
}
