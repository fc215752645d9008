/*
 * elementwise.c — the CPU backend's elementwise ops: activations (ReLU, GELU tanh and erf) forward and backward,
 * add, dropout, and the GELU epilogue of a product (gemm_gelu: the product by gemm_core, then GELU over it).
 *
 * Each op reads x (and dy) BLOCK elements at a time, widened to fp32 where 16-bit, computes in fp32 and rounds
 * once into y (dx), which it overwrites. The loops are plain C compiled for AVX-512, AVX2 and the baseline
 * (HOT_LOOP: the same operations in the same order in every clone, so the same bits on any CPU); ReLU on 16-bit
 * tensors works on the bit patterns (relu_16, relu_grad_16), which gives the fp32 round trip's bits. Threaded in
 * EW_CHUNK-element chunks; dropout's mask is a pure function of (key, element index), so of no thread count.
 */
#include "cpu_internal.h" /* struct cpu_backend, scratch, dtype helpers, EW_CHUNK */

#include "rng.h"     /* rng_uniform: dropout masks */
#include "vecmath.h" /* tanh_f32: GELU */

static const float GELU_TANH_S = 0.7978845608028654f;  /* sqrt(2 / pi) */
static const float GELU_TANH_C = 0.044715f;
static const float INV_SQRT2 = 0.7071067811865476f;    /* 1 / sqrt(2) */
static const float INV_SQRT_2PI = 0.3989422804014327f; /* 1 / sqrt(2 pi) */

HOT_LOOP void cpu_act_apply(enum act_kind kind, float *y, const float *x, size_t n)
{
    switch (kind) {
    case ACT_RELU:
        for (size_t i = 0; i < n; i++)
            y[i] = x[i] <= 0.0f ? 0.0f : x[i]; /* NaN passes through, as in PyTorch */
        break;
    case ACT_GELU_TANH:
        for (size_t i = 0; i < n; i++) {
            float v = x[i];
            float u = GELU_TANH_S * (v + GELU_TANH_C * v * v * v);
            y[i] = 0.5f * v * (1.0f + tanh_f32(u));
        }
        break;
    case ACT_GELU_ERF:
        for (size_t i = 0; i < n; i++)
            y[i] = 0.5f * x[i] * (1.0f + erff(x[i] * INV_SQRT2));
        break;
    }
}

/* The GELU epilogue's elementwise part over pre[0, n) (fp32, the product with its bias): aux = round(pre) and
 * C = round(gelu_tanh(pre)) from `off` on, or (fp32 C) C = gelu_tanh(pre) where pre is aux itself. Each element
 * depends on its own alone, so EW_CHUNK ranges run on any thread. */
struct gelu_epi_job {
    const float *pre;
    const struct tensor *aux, *c;
    size_t off, n;
};

static void gelu_epi_chunk(void *arg, int64_t chunk, int worker)
{
    (void)worker;
    const struct gelu_epi_job *j = arg;
    const enum dtype dt = j->c->dtype;
    const size_t lo = (size_t)chunk * EW_CHUNK, hi = j->n - lo < EW_CHUNK ? j->n : lo + EW_CHUNK;
    float yb[BLOCK];
    for (size_t i = lo; i < hi; i += BLOCK) {
        const size_t cnt = hi - i < BLOCK ? hi - i : BLOCK, at = j->off + i;
        if (dt == DT_FP32) {
            cpu_act_apply(ACT_GELU_TANH, (float *)j->c->data + at, j->pre + i, cnt);
            continue;
        }
        dtype_convert(elem_ptr(j->aux->data, dt, at), dt, j->pre + i, DT_FP32, cnt);
        cpu_act_apply(ACT_GELU_TANH, yb, j->pre + i, cnt);
        dtype_convert(elem_ptr(j->c->data, dt, at), dt, yb, DT_FP32, cnt);
    }
}

/* The GELU epilogue (backend.h GEMM_EPI_GELU_TANH), a block of rows at a time so the fp32 scratch stays
 * small: the product with the bias into fp32 (cpu_gemm_core, as for any product), then per element aux =
 * round(pre) and C = round(gelu_tanh(pre)), GELU computed on the unrounded fp32 value, as a GEMM
 * epilogue on a GPU computes it (gelu_epi_chunk, over the pool). */
void cpu_gemm_gelu(struct cpu_backend *cb, const struct gemm_args *g)
{
    assert(g->batch == 1 && g->beta == 0.0f && !g->trans_a && g->aux);
    assert(gemm_dtypes_ok(g) && g->aux->dtype == g->c->dtype);
    const float alpha = gemm_alpha(g);
    assert((int64_t)g->aux->numel == g->m * g->n && (int64_t)g->c->numel == g->m * g->n);
    int64_t m = g->m, n = g->n, k = g->k;
    if (m <= 0 || n <= 0)
        return;
    const float *bias = g->bias ? (const float *)g->bias->data : NULL;
    struct mat_in b = { g->b->data, g->b->dtype, g->trans_b ? k : n, blocks_of(&g->b_blocks) };
    if (g->c->dtype == DT_FP32) { /* aux holds the fp32 product itself: no scratch, no copies */
        struct mat_in a = { g->a->data, g->a->dtype, k, blocks_of(&g->a_blocks) };
        cpu_gemm_core(cb, false, g->trans_b, m, n, k, alpha, a, b, 0.0f, out_mat_f32(g->aux->data, n), bias);
        struct gelu_epi_job j = { .pre = g->aux->data, .aux = g->aux, .c = g->c, .off = 0, .n = (size_t)(m * n) };
        parallel_for(cb->pool, ew_chunks(j.n), gelu_epi_chunk, &j);
        return;
    }
    int64_t rows = (int64_t)1 << 16; /* elements a block: 256 KiB of fp32, to stay in cache for the GELU pass */
    rows = rows / n > 0 ? rows / n : 1;
    rows = rows < m ? rows : m;
    if (g->a_blocks.scale_inv) /* block-scaled A: one product, its tile scales indexed from row 0 */
        rows = m;
    float *pre = scratch_get(cb, SCR_TMP0, (size_t)(rows * n) * sizeof(float));
    if (!pre)
        return;
    for (int64_t r0 = 0; r0 < m; r0 += rows) {
        int64_t rb = m - r0 < rows ? m - r0 : rows;
        struct mat_in a = { elem_ptr(g->a->data, g->a->dtype, (size_t)(r0 * k)), g->a->dtype, k,
                            blocks_of(&g->a_blocks) };
        cpu_gemm_core(cb, false, g->trans_b, rb, n, k, alpha, a, b, 0.0f, out_mat_f32(pre, n), bias);
        struct gelu_epi_job j = { .pre = pre, .aux = g->aux, .c = g->c, .off = (size_t)(r0 * n),
                                  .n = (size_t)(rb * n) };
        parallel_for(cb->pool, ew_chunks(j.n), gelu_epi_chunk, &j);
    }
}

/* dx = dy * act'(x). For |x| > 20 the GELU derivative is exactly 0 or 1 in fp32; the closed form
 * would compute 0 * Inf there once x^2 overflows, so the limit is used. */
HOT_LOOP void cpu_act_grad_apply(enum act_kind kind, float *dx, const float *dy, const float *x, size_t n)
{
    switch (kind) {
    case ACT_RELU:
        for (size_t i = 0; i < n; i++)
            dx[i] = x[i] <= 0.0f ? 0.0f : dy[i];
        break;
    case ACT_GELU_TANH:
        for (size_t i = 0; i < n; i++) {
            float v = x[i], d;
            if (fabsf(v) > 20.0f) {
                d = v > 0.0f ? 1.0f : 0.0f;
            } else {
                float u = GELU_TANH_S * (v + GELU_TANH_C * v * v * v);
                float t = tanh_f32(u);
                d = 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * GELU_TANH_S * (1.0f + 3.0f * GELU_TANH_C * v * v);
            }
            dx[i] = dy[i] * d;
        }
        break;
    case ACT_GELU_ERF:
        for (size_t i = 0; i < n; i++) {
            float v = x[i], d;
            if (fabsf(v) > 20.0f)
                d = v > 0.0f ? 1.0f : 0.0f;
            else
                d = 0.5f * (1.0f + erff(v * INV_SQRT2)) + v * INV_SQRT_2PI * expf(-0.5f * v * v);
            dx[i] = dy[i] * d;
        }
        break;
    }
}

/* The elementwise ops run over element ranges [lo, hi): each element's result depends on that element
 * alone, so the ranges (EW_CHUNK elements, a chunk each) may run on any threads in any order. */
enum ew_op { EW_ACT, EW_ACT_GRAD, EW_ADD, EW_DROPOUT };

struct ew_job {
    enum ew_op op;
    enum act_kind kind;     /* EW_ACT, EW_ACT_GRAD */
    struct tensor *y;       /* the output: y, dx */
    const struct tensor *x; /* the input: x, a; EW_ACT_GRAD: dy */
    const struct tensor *x2;/* EW_ACT_GRAD: x; EW_ADD: b */
    float p;                /* EW_DROPOUT */
    struct rng_key key;     /* EW_DROPOUT */
};

/* ReLU and its gradient where every tensor of the call is bf16, or every one fp16: the bits that widening,
 * cpu_act_apply / cpu_act_grad_apply in fp32 and rounding back give, without the two conversions. A 16-bit value
 * is exact in fp32, so what passes comes back unchanged, except a NaN, whose rounding sets its quiet bit; a value <= 0
 * (either zero, any negative) gives +0. test_cpu_elementwise checks every one of the 65536 inputs in both formats. */
bool cpu_half_format(enum dtype dt, uint16_t *inf, uint16_t *quiet)
{
    if (dt != DT_BF16 && dt != DT_FP16)
        return false;
    *inf = dt == DT_BF16 ? 0x7F80 : 0x7C00;
    *quiet = dt == DT_BF16 ? 0x0040 : 0x0200;
    return true;
}

/* All ones where h passes ReLU (h > 0, or a NaN), zero where h <= 0 (either zero, any negative). Masks, not
 * branches: written as a bool helper under ?:, GCC left cpu_relu_grad_16 scalar in the avx512f clone ("control flow
 * in loop"; 11% of fashion_mlp's bf16 step at 2 threads in perf record, against 0.6% vectorised). */
static inline uint16_t half_pass_mask(uint16_t h, uint16_t inf)
{
    uint16_t m = h & 0x7FFF;
    return (uint16_t)-(uint16_t)(m > inf || (!(h & 0x8000) && m != 0));
}

/* h as rounding fp32 back gives it: a NaN with its quiet bit set, anything else unchanged. */
static inline uint16_t half_quieted(uint16_t h, uint16_t inf, uint16_t quiet)
{
    return (uint16_t)(h | (quiet & (uint16_t)-(uint16_t)((h & 0x7FFF) > inf)));
}

HOT_LOOP static void relu_16(uint16_t *y, const uint16_t *x, size_t n, uint16_t inf, uint16_t quiet)
{
    for (size_t i = 0; i < n; i++)
        y[i] = half_quieted(x[i], inf, quiet) & half_pass_mask(x[i], inf); /* x <= 0: +0 */
}

HOT_LOOP void cpu_relu_grad_16(uint16_t *dx, const uint16_t *dy, const uint16_t *x, size_t n, uint16_t inf,
                                  uint16_t quiet)
{
    for (size_t i = 0; i < n; i++)
        dx[i] = half_quieted(dy[i], inf, quiet) & half_pass_mask(x[i], inf);
}

static void act_forward_range(enum act_kind kind, struct tensor *y, const struct tensor *x, size_t lo, size_t hi)
{
    uint16_t inf, quiet;
    if (kind == ACT_RELU && y->dtype == x->dtype && cpu_half_format(x->dtype, &inf, &quiet)) {
        relu_16((uint16_t *)y->data + lo, (const uint16_t *)x->data + lo, hi - lo, inf, quiet);
        return;
    }
    float xb[BLOCK], yb[BLOCK];
    for (size_t i = lo; i < hi; i += BLOCK) {
        size_t c = hi - i < BLOCK ? hi - i : BLOCK;
        const float *xs = load_f32(x->data, x->dtype, i, c, xb);
        float *ys = out_f32(y->data, y->dtype, i, yb);
        cpu_act_apply(kind, ys, xs, c);
        store_f32(y->data, y->dtype, i, c, ys);
    }
}

static void act_backward_range(enum act_kind kind, struct tensor *dx, const struct tensor *dy, const struct tensor *x,
                               size_t lo, size_t hi)
{
    uint16_t inf, quiet;
    if (kind == ACT_RELU && dx->dtype == x->dtype && dy->dtype == x->dtype && cpu_half_format(x->dtype, &inf, &quiet)) {
        cpu_relu_grad_16((uint16_t *)dx->data + lo, (const uint16_t *)dy->data + lo, (const uint16_t *)x->data + lo,
                     hi - lo, inf, quiet);
        return;
    }
    float xb[BLOCK], dyb[BLOCK], dxb[BLOCK];
    for (size_t i = lo; i < hi; i += BLOCK) {
        size_t c = hi - i < BLOCK ? hi - i : BLOCK;
        const float *xs = load_f32(x->data, x->dtype, i, c, xb);
        const float *dys = load_f32(dy->data, dy->dtype, i, c, dyb);
        float *dxs = out_f32(dx->data, dx->dtype, i, dxb);
        cpu_act_grad_apply(kind, dxs, dys, xs, c);
        store_f32(dx->data, dx->dtype, i, c, dxs);
    }
}

void cpu_add_range(struct tensor *y, const struct tensor *a, const struct tensor *b, size_t lo, size_t hi)
{
    float ab[BLOCK], bb[BLOCK], yb[BLOCK];
    for (size_t i = lo; i < hi; i += BLOCK) {
        size_t c = hi - i < BLOCK ? hi - i : BLOCK;
        const float *as = load_f32(a->data, a->dtype, i, c, ab);
        const float *bs = load_f32(b->data, b->dtype, i, c, bb);
        float *ys = out_f32(y->data, y->dtype, i, yb);
        for (size_t j = 0; j < c; j++)
            ys[j] = as[j] + bs[j];
        store_f32(y->data, y->dtype, i, c, ys);
    }
}

static void dropout_range(struct tensor *y, const struct tensor *x, float p, struct rng_key key, size_t lo, size_t hi);

static void ew_chunk(void *arg, int64_t chunk, int worker)
{
    (void)worker;
    const struct ew_job *j = arg;
    size_t lo = (size_t)chunk * EW_CHUNK, n = j->y->numel, hi = n - lo < EW_CHUNK ? n : lo + EW_CHUNK;
    switch (j->op) {
    case EW_ACT:
        act_forward_range(j->kind, j->y, j->x, lo, hi);
        break;
    case EW_ACT_GRAD:
        act_backward_range(j->kind, j->y, j->x, j->x2, lo, hi);
        break;
    case EW_ADD:
        cpu_add_range(j->y, j->x, j->x2, lo, hi);
        break;
    case EW_DROPOUT:
        dropout_range(j->y, j->x, j->p, j->key, lo, hi);
        break;
    }
}

static void ew_run(struct cpu_backend *cb, const struct ew_job *j)
{
    parallel_for(cb->pool, ew_chunks(j->y->numel), ew_chunk, (void *)j);
}

void cpu_act_forward(struct backend *be, enum act_kind kind, struct tensor *y, const struct tensor *x)
{
    assert(y->numel == x->numel);
    ew_run(cpu_of(be), &(struct ew_job){ .op = EW_ACT, .kind = kind, .y = y, .x = x });
}

void cpu_act_backward(struct backend *be, enum act_kind kind, struct tensor *dx, const struct tensor *dy,
                             const struct tensor *x)
{
    assert(dx->numel == x->numel && dy->numel == x->numel);
    ew_run(cpu_of(be), &(struct ew_job){ .op = EW_ACT_GRAD, .kind = kind, .y = dx, .x = dy, .x2 = x });
}

void cpu_add(struct backend *be, struct tensor *y, const struct tensor *a, const struct tensor *b)
{
    assert(y->numel == a->numel && y->numel == b->numel);
    ew_run(cpu_of(be), &(struct ew_job){ .op = EW_ADD, .y = y, .x = a, .x2 = b });
}

/* Dropout masks. Element i of the tensor dropped under key (seed, stream, counter) draws
 *     u = rng_uniform(seed, (stream << 20) + (counter >> 32), ((counter & 0xffffffff) << 32) | i)
 * and is kept iff u >= p. The map (stream, counter, i) -> (stream', counter') is one-to-one for
 * stream < 2^44, counter < 2^52 and i < 2^32 (asserted), so no two elements of any realistic run share
 * a draw, and it is plain 64-bit integer arithmetic a CUDA kernel reproduces. A kept element is
 * multiplied by 1/(1-p), a dropped one by 0 (so NaN stays NaN, as in PyTorch). */
static uint64_t dropout_stream(struct rng_key key)
{
    return (key.stream << 20) + (key.counter >> 32);
}

static uint64_t dropout_counter(struct rng_key key, size_t i)
{
    return (key.counter << 32) | (uint64_t)i;
}

static void dropout_range(struct tensor *y, const struct tensor *x, float p, struct rng_key key, size_t lo, size_t hi)
{
    float scale = 1.0f / (1.0f - p);
    uint64_t stream = dropout_stream(key);
    float xb[BLOCK], yb[BLOCK];
    for (size_t i = lo; i < hi; i += BLOCK) {
        size_t c = hi - i < BLOCK ? hi - i : BLOCK;
        const float *xs = load_f32(x->data, x->dtype, i, c, xb);
        float *ys = out_f32(y->data, y->dtype, i, yb);
        for (size_t j = 0; j < c; j++) {
            float u = rng_uniform(key.seed, stream, dropout_counter(key, i + j));
            ys[j] = xs[j] * (u >= p ? scale : 0.0f);
        }
        store_f32(y->data, y->dtype, i, c, ys);
    }
}

static void dropout_apply(struct cpu_backend *cb, struct tensor *y, const struct tensor *x, float p, struct rng_key key)
{
    assert(y->numel == x->numel);
    if (key.step) { /* the step read from backend memory now, as a device reads it when the op runs */
        key.counter += (uint64_t)*key.step * key.per_step;
        key.step = NULL;
    }
    assert((uint64_t)x->numel <= 0x100000000ULL && key.stream < (1ULL << 44) && key.counter < (1ULL << 52));
    if (p <= 0.0f) {
        dtype_convert(y->data, y->dtype, x->data, x->dtype, x->numel);
        return;
    }
    ew_run(cb, &(struct ew_job){ .op = EW_DROPOUT, .y = y, .x = x, .p = p, .key = key });
}

void cpu_dropout_forward(struct backend *be, struct tensor *y, const struct tensor *x, float p,
                                struct rng_key key)
{
    dropout_apply(cpu_of(be), y, x, p, key);
}

void cpu_dropout_backward(struct backend *be, struct tensor *dx, const struct tensor *dy, float p,
                                 struct rng_key key)
{
    dropout_apply(cpu_of(be), dx, dy, p, key); /* the same mask and scale: d(x * mask)/dx = mask */
}
