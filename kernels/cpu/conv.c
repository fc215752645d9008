/*
 * conv.c — the CPU backend's 2-D convolution: forward (y = w * x + bias), backward data (dx) and backward filter
 * (dw and db, accumulated with beta), NCHW, by im2col (col2im backward) and gemm_core, an image at a time.
 *
 * Threaded by images (each image's product on a worker's own panels, cpu_worker_gemm); dW's per-image products
 * are kept apart and added in image order, so the bits do not depend on the thread count. The bias gradient
 * sums each channel's planes in order: the plain chains (FOR_CHAINS) first, the eight channels as vector lanes
 * (planes8_avx512.c) beside them where the CPU has AVX-512, the same sums.
 */
#include "cpu_internal.h" /* struct cpu_backend, scratch, dtype helpers, cpu_gemm_core, cpu_worker_gemm */

#include "gemm_avx512.h" /* gemm_avx512_transposed_fits: dW's products on transposed panels */

/* The output columns [*lo, *hi) whose input column ow * stride - padding + kw lies inside the row. */
static void conv_inside_cols(const struct conv_args *a, int64_t kw, int64_t *lo, int64_t *hi)
{
    int64_t first = a->padding - kw; /* ow * stride >= first */
    int64_t l = first > 0 ? (first + a->stride - 1) / a->stride : 0;
    int64_t last = a->w_in - 1 + a->padding - kw; /* ow * stride <= last */
    int64_t h = last >= 0 ? last / a->stride + 1 : 0;
    h = h < a->w_out ? h : a->w_out;
    *lo = l < h ? l : h;
    *hi = h;
}

/* col (c_in*k*k, h_out*w_out) from one image x (c_in, h_in, w_in) of elements T (float, or uint16_t: the bits
 * of bf16, the products' input either way); zero padding (all-zero bits in both). A copy: each output row's
 * padding zeros and its inside columns in plain loops (rows are short: a call to memcpy per row cost more
 * than the copy at fashion_cnn's 14 and 28 columns). */
#define DEFINE_IM2COL(NAME, T)                                                                                    \
    static void NAME(T *col, const T *x, const struct conv_args *a)                                              \
    {                                                                                                            \
        const int64_t k = a->kernel, hw = a->h_out * a->w_out, s = a->stride;                                    \
        for (int64_t ci = 0; ci < a->c_in; ci++)                                                                 \
            for (int64_t kh = 0; kh < k; kh++)                                                                   \
                for (int64_t kw = 0; kw < k; kw++) {                                                             \
                    T *row = col + ((ci * k + kh) * k + kw) * hw;                                                \
                    const T *plane = x + ci * a->h_in * a->w_in;                                                 \
                    int64_t lo, hi;                                                                              \
                    conv_inside_cols(a, kw, &lo, &hi);                                                           \
                    for (int64_t oh = 0; oh < a->h_out; oh++) {                                                  \
                        const int64_t ih = oh * s - a->padding + kh;                                             \
                        T *out = row + oh * a->w_out;                                                            \
                        const bool inside = ih >= 0 && ih < a->h_in && lo < hi;                                  \
                        const int64_t l = inside ? lo : a->w_out, h = inside ? hi : a->w_out;                    \
                        for (int64_t ow = 0; ow < l; ow++)                                                       \
                            out[ow] = 0;                                                                         \
                        if (inside) {                                                                            \
                            const T *src = plane + ih * a->w_in + lo * s - a->padding + kw; /* ow = lo */        \
                            if (s == 1)                                                                          \
                                for (int64_t ow = l; ow < h; ow++)                                               \
                                    out[ow] = src[ow - l];                                                       \
                            else                                                                                 \
                                for (int64_t ow = l; ow < h; ow++)                                               \
                                    out[ow] = src[(ow - l) * s];                                                 \
                        }                                                                                        \
                        for (int64_t ow = h; ow < a->w_out; ow++)                                                \
                            out[ow] = 0;                                                                         \
                    }                                                                                            \
                }                                                                                                \
    }
DEFINE_IM2COL(im2col_f32, float)
DEFINE_IM2COL(im2col_16, uint16_t)
#undef DEFINE_IM2COL

/* A stride-1 convolution whose output is as wide as its input (2 * padding = kernel - 1, "same"): output
 * element i = oh * w + ow of the row for (kh, kw) reads input element i + (kh - padding) * w + (kw - padding),
 * so the row is one shifted copy of the plane, then zeros where the read fell outside it: the rows above or
 * below and the |kw - padding| columns at one edge (which the shifted copy took from the neighbouring row). The
 * same bits as the loops above: a copy either way. */
static bool conv_is_same_stride1(const struct conv_args *a)
{
    return a->stride == 1 && 2 * a->padding == a->kernel - 1 && a->padding < a->w_in && a->padding < a->h_in;
}

/* The zero runs are short (at most a row and a column: 15 values in fashion_cnn's second convolution), one to each
 * side of 288 rows an image: as memset calls (GCC turns the loops into them) they were 2-3% of fashion_cnn's step;
 * written in place (no_loop_patterns) they are a few stores. */
#if defined(__GNUC__) && !defined(__clang__)
#define NO_LOOP_PATTERNS __attribute__((optimize("no-tree-loop-distribute-patterns")))
#else
#define NO_LOOP_PATTERNS
#endif
#define DEFINE_IM2COL_SAME(NAME, T)                                                                               \
    NO_LOOP_PATTERNS static void NAME(T *col, const T *x, const struct conv_args *a)                             \
    {                                                                                                            \
        const int64_t k = a->kernel, w = a->w_in, h = a->h_in, hw = h * w, p = a->padding;                      \
        for (int64_t ci = 0; ci < a->c_in; ci++)                                                                 \
            for (int64_t kh = 0; kh < k; kh++)                                                                   \
                for (int64_t kw = 0; kw < k; kw++) {                                                             \
                    T *row = col + ((ci * k + kh) * k + kw) * hw;                                                \
                    const T *plane = x + ci * hw;                                                                \
                    const int64_t dr = kh - p, dc = kw - p, d = dr * w + dc;                                     \
                    const int64_t i0 = (dr < 0 ? -dr : 0) * w, i1 = (dr > 0 ? h - dr : h) * w; /* rows inside */ \
                    const int64_t c0 = i0 > -d ? i0 : -d, c1 = i1 < hw - d ? i1 : hw - d;   /* and the plane */  \
                    for (int64_t i = 0; i < c0; i++)                                                             \
                        row[i] = 0;                                                                              \
                    memcpy(row + c0, plane + c0 + d, (size_t)(c1 - c0) * sizeof(T));                            \
                    for (int64_t i = c1; i < hw; i++)                                                            \
                        row[i] = 0;                                                                              \
                    /* the edge columns read outside the row: stores, not a call each (rows are short) */        \
                    for (int64_t i = i0; dc != 0 && i < i1; i += w)                                              \
                        for (int64_t e = 0; e < (dc < 0 ? -dc : dc); e++)                                        \
                            row[(dc < 0 ? i : i + w - dc) + e] = 0;                                              \
                }                                                                                                \
    }
DEFINE_IM2COL_SAME(im2col_same_f32, float)
DEFINE_IM2COL_SAME(im2col_same_16, uint16_t)
#undef DEFINE_IM2COL_SAME

static void im2col(void *col, const void *x, const struct conv_args *a, size_t es)
{
    if (conv_is_same_stride1(a) && es == sizeof(float))
        im2col_same_f32(col, x, a);
    else if (conv_is_same_stride1(a))
        im2col_same_16(col, x, a);
    else if (es == sizeof(float))
        im2col_f32(col, x, a);
    else
        im2col_16(col, x, a);
}

/* col2im for a "same" stride-1 convolution (conv_is_same_stride1): im2col_same's shifted copy run backwards,
 * x[i + d] += row[i] over the whole shifted range in one loop, after the row's entries that im2col_same zeroes
 * (those that read outside the plane's row: padding) are set to +0 here. Each element of x still takes the same
 * entries in the same (ci, kh, kw) order; the +0 entries it now also takes change nothing: x starts at +0 and a
 * sum that starts at +0 is never -0 in round-to-nearest, and s + (+0) == s for every other s, NaN and inf
 * included. The same bits as the loops of col2im. Overwrites col's padding entries. */
static void col2im_same(float *restrict x, float *restrict col, const struct conv_args *a)
{
    const int64_t k = a->kernel, w = a->w_in, h = a->h_in, hw = h * w, p = a->padding;
    for (int64_t ci = 0; ci < a->c_in; ci++)
        for (int64_t kh = 0; kh < k; kh++)
            for (int64_t kw = 0; kw < k; kw++) {
                float *restrict row = col + ((ci * k + kh) * k + kw) * hw;
                float *restrict plane = x + ci * hw;
                const int64_t dr = kh - p, dc = kw - p, d = dr * w + dc;
                const int64_t i0 = (dr < 0 ? -dr : 0) * w, i1 = (dr > 0 ? h - dr : h) * w; /* the rows inside */
                const int64_t c0 = i0 > -d ? i0 : -d, c1 = i1 < hw - d ? i1 : hw - d;   /* and the plane */
                for (int64_t i = i0; dc != 0 && i < i1; i += w) /* the edge columns read outside the row */
                    for (int64_t e = 0; e < (dc < 0 ? -dc : dc); e++)
                        row[(dc < 0 ? i : i + w - dc) + e] = 0.0f;
                for (int64_t i = c0; i < c1; i++)
                    plane[i + d] += row[i];
            }
}

/* x (c_in, h_in, w_in) = sum of col's entries over the positions they were read from (overwrites x; for a
 * "same" stride-1 convolution also col's padding entries, col2im_same). */
static void col2im(float *x, float *col, const struct conv_args *a)
{
    int64_t k = a->kernel, hw = a->h_out * a->w_out;
    memset(x, 0, (size_t)(a->c_in * a->h_in * a->w_in) * sizeof(float));
    if (conv_is_same_stride1(a)) {
        col2im_same(x, col, a);
        return;
    }
    for (int64_t ci = 0; ci < a->c_in; ci++)
        for (int64_t kh = 0; kh < k; kh++)
            for (int64_t kw = 0; kw < k; kw++) {
                const float *row = col + ((ci * k + kh) * k + kw) * hw;
                float *plane = x + ci * a->h_in * a->w_in;
                int64_t lo, hi; /* the output columns that read inside the row: no test per element */
                conv_inside_cols(a, kw, &lo, &hi);
                for (int64_t oh = 0; oh < a->h_out; oh++) {
                    int64_t ih = oh * a->stride - a->padding + kh;
                    if (ih < 0 || ih >= a->h_in)
                        continue;
                    const int64_t base = ih * a->w_in - a->padding + kw; /* + ow * stride: >= 0 from lo on */
                    const float *src = row + oh * a->w_out;
                    if (a->stride == 1)
                        for (int64_t ow = lo; ow < hi; ow++)
                            plane[base + ow] += src[ow];
                    else
                        for (int64_t ow = lo; ow < hi; ow++)
                            plane[base + ow * a->stride] += src[ow];
                }
            }
}

/* A 1x1 convolution with stride 1 and no padding reads each image as its own column matrix. */
static bool conv_is_pointwise(const struct conv_args *a)
{
    return a->kernel == 1 && a->stride == 1 && a->padding == 0;
}

static void conv_check(const struct conv_args *a)
{
    assert(a->kernel >= 1 && a->stride >= 1 && a->padding >= 0);
    assert(a->h_out == (a->h_in + 2 * a->padding - a->kernel) / a->stride + 1);
    assert(a->w_out == (a->w_in + 2 * a->padding - a->kernel) / a->stride + 1);
    (void)a;
}

/* The convolutions work one image at a time: a 16-bit image is widened into IN0/IN1 scratch and a 16-bit
 * result computed in TMP1 scratch and rounded before the next image, so their scratch is O(one image),
 * never O(batch). fp32 images are used in place. Where the inputs of a call's products (x and w, dy and w,
 * dy and x) are all bf16 and gemm_avx512 takes bf16, the products take them as they are (im2col copies
 * bf16 bits): the bf16 product of gemm_avx512.h (AMX where the CPU has it), fp32 results as before. Its sums
 * are that product's, not the fp32 FMA's over the widened values: another order, with bf16's DAZ/FTZ.
 *
 * Threads: above CONV_PAR_MACS multiply-adds, where the products run on gemm_avx512 (fp32 operands: the
 * weights and im2col columns are fp32), the images are the chunks, each worker in its own scratch
 * (wscratch) with its own single-threaded product (cpu_worker_gemm): an image's product is the call one thread
 * makes, so the same bits. The filter gradient takes the images CONV_FILTER_IMAGES at a time (fewer
 * when their products would pass CONV_FILTER_BYTES): each image's product dy_i @ col_i^T is formed apart
 * (beta 0, so exactly the fp32 sum gemm_avx512's epilogue adds), then each element of dW adds the images'
 * products in image order, dW = beta * dW + P_i, rounded as that epilogue rounds (beta * dW, then + P_i),
 * so dW has the bits of the image-by-image accumulation. Elsewhere (smaller, or the portable path, whose
 * OpenBLAS keeps its own threads) the images run in order on the calling thread through cpu_gemm_core. */
#define CONV_PAR_MACS ((int64_t)1 << 20)
#define CONV_FILTER_IMAGES 16                  /* images whose dW products are formed at once */
#define CONV_FILTER_BYTES ((size_t)16 << 20)  /* at most this much scratch for them */

struct conv_dims {
    int64_t ckk, hw, chw_in, chw_out;
};

static struct conv_dims conv_dims_of(const struct conv_args *a)
{
    int64_t hw = a->h_out * a->w_out;
    return (struct conv_dims){ .ckk = a->c_in * a->kernel * a->kernel, .hw = hw,
                               .chw_in = a->c_in * a->h_in * a->w_in, .chw_out = a->c_out * hw };
}

/* Whether this convolution runs as chunks on the pool: by its size and the path its products take, never
 * by the thread count. */
static bool conv_threaded(const struct cpu_backend *cb, const struct conv_args *a)
{
    const struct conv_dims d = conv_dims_of(a);
    return cb->gemm_avx512[DT_FP32] && a->n > 1 && a->c_out > 0 && d.ckk > 0 && d.hw > 0 &&
           a->n * a->c_out * d.ckk * d.hw >= CONV_PAR_MACS;
}

/* The products' input dtype for a call whose two product inputs are p and q: bf16 as they are where both
 * are bf16 and gemm_avx512 takes bf16, else fp32 (16-bit inputs widened). */
static enum dtype conv_product_dtype(const struct cpu_backend *cb, const struct tensor *p, const struct tensor *q)
{
    return cb->gemm_avx512[DT_BF16] && p->dtype == DT_BF16 && q->dtype == DT_BF16 ? DT_BF16 : DT_FP32;
}

/* One convolution call's tensors; the image and block bodies read them and their own buffers. */
struct conv_job {
    struct cpu_backend *cb;
    const struct conv_args *a;
    struct tensor *out;        /* y, dx or dw */
    const struct tensor *in;   /* x, dy or dy */
    const struct tensor *in2;  /* backward_filter: x */
    enum dtype dt;             /* the products' inputs: DT_FP32, or DT_BF16 (conv_product_dtype) */
    const void *w;             /* forward, backward_data: the weights (c_out, ckk) as dt */
    const float *bias;         /* forward: NULL or fp32 (c_out) */
    double *acc;               /* backward_filter: NULL or the bias gradient's per-channel sums (c_out) */
    float beta;                /* backward_filter: dW = beta * dW + ... */
    float *prod;               /* backward_filter, threaded: the group's products (images, c_out, ckk) */
    double *sums;              /* backward_filter, threaded, with acc: the group's plane sums (images, c_out) */
    int64_t i0, images;        /* backward_filter, threaded: the group's first image and its size */
    bool transposed;           /* backward_filter: each product formed as col_i @ dy_i^T (conv_filter_transposed) */
};

/* Where a body computes: its buffers, and worker < 0 for the calling thread's cpu_gemm_core, else the worker
 * whose cpu_worker_gemm panels it uses. */
struct conv_bufs {
    float *in0, *in1, *tmp0, *tmp1;
    int worker;
};

/* C (m, n) = op(A) @ op(B) + beta * C [+ row_bias (m) on every column, with beta 0]; C fp32, or of the products'
 * input dtype (c_dt: rounded once in the product's epilogue). */
static void conv_gemm_to(const struct conv_job *j, const struct conv_bufs *b, bool ta, bool tb, int64_t m,
                         int64_t n, int64_t k, const void *a, int64_t lda, const void *bm, int64_t ldb, float beta,
                         void *c, enum dtype c_dt, int64_t ldc, const float *row_bias)
{
    assert(c_dt == DT_FP32 || c_dt == j->dt);
    const struct mat_out out = { .p = c, .dt = c_dt, .ld = ldc, .row_bias = row_bias };
    if (b->worker < 0)
        cpu_gemm_core(j->cb, ta, tb, m, n, k, 1.0f, (struct mat_in){ .p = a, .dt = j->dt, .ld = lda },
                      (struct mat_in){ .p = bm, .dt = j->dt, .ld = ldb }, beta, out, NULL);
    else
        cpu_worker_gemm(j->cb, b->worker, j->dt, ta, tb, m, n, k, 1.0f, a, lda, bm, ldb, beta, out);
}

/* conv_gemm_to with an fp32 C. */
static void conv_gemm(const struct conv_job *j, const struct conv_bufs *b, bool ta, bool tb, int64_t m, int64_t n,
                      int64_t k, const void *a, int64_t lda, const void *bm, int64_t ldb, float beta, float *c,
                      int64_t ldc, const float *row_bias)
{
    conv_gemm_to(j, b, ta, tb, m, n, k, a, lda, bm, ldb, beta, c, DT_FP32, ldc, row_bias);
}

/* n values of image data t from element off as the products' input: t's own bf16 bits on the bf16 path,
 * else fp32 (load_f32: in place, or widened into buf). */
static const void *conv_load(const struct conv_job *j, const struct tensor *t, size_t off, size_t n, float *buf)
{
    return j->dt == DT_BF16 ? elem_ptr(t->data, DT_BF16, off) : load_f32(t->data, t->dtype, off, n, buf);
}

/* Worker w's buffers, reserved by the caller. */
static struct conv_bufs conv_worker_bufs(const struct cpu_backend *cb, int worker)
{
    return (struct conv_bufs){ .in0 = wscratch(cb, worker, WSCR_IN0), .in1 = wscratch(cb, worker, WSCR_IN1),
                               .tmp0 = wscratch(cb, worker, WSCR_TMP0), .tmp1 = wscratch(cb, worker, WSCR_TMP1),
                               .worker = worker };
}

/* y_i (c_out, hw) = W (c_out, ckk) @ col_i (ckk, hw) [+ bias per channel]. */
static void conv_forward_image(const struct conv_job *j, int64_t i, const struct conv_bufs *b)
{
    const struct conv_args *a = j->a;
    const struct conv_dims d = conv_dims_of(a);
    const bool pointwise = conv_is_pointwise(a);
    const void *xi = conv_load(j, j->in, (size_t)(i * d.chw_in), (size_t)d.chw_in, b->in0);
    if (!pointwise)
        im2col(b->tmp0, xi, a, dtype_size(j->dt));
    const void *col = pointwise ? xi : b->tmp0;
    /* the bias per output channel, a row of the product: added in its epilogue, as a C filled with the bias
     * and beta 1 would add it (the same bits), without that fill's pass over y */
    if (j->out->dtype == j->dt && j->dt == DT_BF16) {
        /* bf16 y from bf16 products: rounded in the epilogue, as store_f32 rounds (the same bits), without the
         * fp32 image and the pass that rounds it */
        conv_gemm_to(j, b, false, false, a->c_out, d.hw, d.ckk, j->w, d.ckk, col, d.hw, 0.0f,
                     elem_ptr(j->out->data, DT_BF16, (size_t)(i * d.chw_out)), DT_BF16, d.hw, j->bias);
        return;
    }
    float *yi = out_f32(j->out->data, j->out->dtype, (size_t)(i * d.chw_out), b->tmp1);
    conv_gemm(j, b, false, false, a->c_out, d.hw, d.ckk, j->w, d.ckk, col, d.hw, 0.0f, yi, d.hw, j->bias);
    store_f32(j->out->data, j->out->dtype, (size_t)(i * d.chw_out), (size_t)d.chw_out, yi);
}

/* dx_i = col2im(W^T (ckk, c_out) @ dy_i (c_out, hw)). */
static void conv_backward_data_image(const struct conv_job *j, int64_t i, const struct conv_bufs *b)
{
    const struct conv_args *a = j->a;
    const struct conv_dims d = conv_dims_of(a);
    const bool pointwise = conv_is_pointwise(a);
    const void *dyi = conv_load(j, j->in, (size_t)(i * d.chw_out), (size_t)d.chw_out, b->in0);
    float *dxi = out_f32(j->out->data, j->out->dtype, (size_t)(i * d.chw_in), b->tmp1);
    conv_gemm(j, b, true, false, d.ckk, d.hw, a->c_out, j->w, d.ckk, dyi, d.hw, 0.0f, pointwise ? dxi : b->tmp0,
              d.hw, NULL);
    if (!pointwise)
        col2im(dxi, b->tmp0, a);
    store_f32(j->out->data, j->out->dtype, (size_t)(i * d.chw_in), (size_t)d.chw_in, dxi);
}

/* Whether the filter gradient's products are formed transposed, P_i^T (ckk, c_out) = col_i @ dy_i^T, and
 * transposed back: where few input channels make dy_i @ col_i^T a thin product that fills the AVX-512 tiles
 * badly (fashion_cnn's first convolution: 32 x 9) and the swap gives the same bits (gemm_avx512.h). */
static bool conv_filter_transposed(const struct cpu_backend *cb, const struct conv_args *a, enum dtype dt)
{
    return cb->gemm_avx512[dt] && gemm_avx512_transposed_fits(dt, a->c_out, conv_dims_of(a).ckk);
}

/* im2col's columns, then (transposed) the product's ckk x c_out floats: tmp0's size for one image. */
static int64_t conv_filter_tmp0(const struct conv_args *a, bool transposed)
{
    const struct conv_dims d = conv_dims_of(a);
    return (conv_is_pointwise(a) ? 0 : d.ckk * d.hw) + (transposed ? d.ckk * a->c_out : 0);
}

/* C (c_out, ckk) = beta * C + dy_i (c_out, hw) @ col_i^T (hw, ckk); with sums, each channel's plane of dy_i
 * summed in double into sums[co]. Transposed (j->transposed), the product goes to tmp0 after the columns and
 * each element of C then takes beta * C (rounded) + P (rounded), as the product's epilogue would (beta 0: P). */
HOT_LOOP static void conv_filter_image(const struct conv_job *j, int64_t i, const struct conv_bufs *b, float beta,
                                       float *c, double *sums)
{
    const struct conv_args *a = j->a;
    const struct conv_dims d = conv_dims_of(a);
    const bool pointwise = conv_is_pointwise(a);
    const void *dyi = conv_load(j, j->in, (size_t)(i * d.chw_out), (size_t)d.chw_out, b->in0);
    const void *xi = conv_load(j, j->in2, (size_t)(i * d.chw_in), (size_t)d.chw_in, b->in1);
    if (!pointwise)
        im2col(b->tmp0, xi, a, dtype_size(j->dt));
    const void *col = pointwise ? xi : b->tmp0;
    if (j->transposed) {
        float *pt = b->tmp0 + (pointwise ? 0 : d.ckk * d.hw);
        conv_gemm(j, b, false, true, d.ckk, a->c_out, d.hw, col, d.hw, dyi, d.hw, 0.0f, pt, a->c_out, NULL);
        for (int64_t co = 0; co < a->c_out; co++)
            for (int64_t e = 0; e < d.ckk; e++) {
                float *ce = &c[co * d.ckk + e];
                if (beta == 0.0f) {
                    *ce = pt[e * a->c_out + co];
                } else {
                    const float scaled = beta * *ce; /* apart: no contraction into an fma */
                    *ce = scaled + pt[e * a->c_out + co];
                }
            }
    } else {
        conv_gemm(j, b, false, true, a->c_out, d.ckk, d.hw, dyi, d.hw, col, d.hw, beta, c, d.ckk, NULL);
    }
    if (!sums)
        return;
    /* each channel's plane summed in order, CHAINS channels side by side (bf16 values widened exactly) */
    for (int64_t co0 = 0; co0 < a->c_out; co0 += CHAINS) {
        const int64_t lanes = a->c_out - co0 < CHAINS ? a->c_out - co0 : CHAINS;
        double s[CHAINS] = { 0.0 };
#ifdef HAVE_AVX512_INTRIN
        if (cpu_planes8_avx512(lanes)) {
            const void *v[CHAINS];
            for (int l = 0; l < CHAINS; l++)
                v[l] = (const char *)dyi + (size_t)((co0 + l) * d.hw) * dtype_size(j->dt);
            cpu_planes_sum8_avx512(v, j->dt == DT_BF16, d.hw, s);
        } else
#endif
        if (j->dt == DT_BF16) {
            const uint16_t *p = (const uint16_t *)dyi + co0 * d.hw;
            FOR_CHAINS(lanes, d.hw, l, q, s[l] += bf16_to_fp32(p[l * d.hw + q]));
        } else {
            const float *p = (const float *)dyi + co0 * d.hw;
            FOR_CHAINS(lanes, d.hw, l, q, s[l] += p[l * d.hw + q]);
        }
        for (int64_t l = 0; l < lanes; l++)
            sums[co0 + l] = s[l];
    }
}

static void conv_forward_chunk(void *arg, int64_t chunk, int worker)
{
    const struct conv_job *j = arg;
    const struct conv_bufs b = conv_worker_bufs(j->cb, worker);
    conv_forward_image(j, chunk, &b);
}

static void conv_backward_data_chunk(void *arg, int64_t chunk, int worker)
{
    const struct conv_job *j = arg;
    const struct conv_bufs b = conv_worker_bufs(j->cb, worker);
    conv_backward_data_image(j, chunk, &b);
}

/* Image i0 + chunk of the group: its product, apart, into prod. */
static void conv_filter_chunk(void *arg, int64_t chunk, int worker)
{
    const struct conv_job *j = arg;
    const struct conv_bufs b = conv_worker_bufs(j->cb, worker);
    const int64_t cols = j->a->c_out * conv_dims_of(j->a).ckk;
    double *sums = j->sums ? j->sums + chunk * j->a->c_out : NULL;
    conv_filter_image(j, j->i0 + chunk, &b, 0.0f, j->prod + chunk * cols, sums);
}

/* EW_CHUNK elements of dW: the group's products added in image order, as gemm_avx512's epilogue adds one
 * (beta 0 never reads dW; else beta * dW rounded, then the product added and rounded). */
static void conv_filter_sum_chunk(void *arg, int64_t chunk, int worker)
{
    (void)worker;
    const struct conv_job *j = arg;
    const size_t cols = (size_t)(j->a->c_out * conv_dims_of(j->a).ckk), lo = (size_t)chunk * EW_CHUNK;
    const size_t hi = cols - lo < EW_CHUNK ? cols : lo + EW_CHUNK;
    float *dw = j->out->data;
    for (int64_t k = 0; k < j->images; k++) {
        const float beta = j->i0 + k == 0 ? j->beta : 1.0f, *p = j->prod + (size_t)k * cols;
        if (beta == 0.0f) {
            memcpy(dw + lo, p + lo, (hi - lo) * sizeof(float));
            continue;
        }
        for (size_t e = lo; e < hi; e++) {
            const float scaled = beta * dw[e]; /* apart: no contraction into an fma */
            dw[e] = scaled + p[e];
        }
    }
}

/* How many images' products the threaded filter gradient forms at once: fixed by the problem. */
static int64_t conv_filter_group(const struct conv_args *a)
{
    const size_t per = (size_t)(a->c_out * conv_dims_of(a).ckk) * sizeof(float);
    int64_t g = per ? (int64_t)(CONV_FILTER_BYTES / per) : CONV_FILTER_IMAGES;
    g = g < CONV_FILTER_IMAGES ? g : CONV_FILTER_IMAGES;
    return g < a->n ? g : a->n;
}

/* Every worker's buffers for a chunk reading nin0 values of in0, nin1 of in1 (staged when 16-bit), writing
 * ntmp1 of out (staged when 16-bit), with ntmp0 floats of im2col columns and an (m, n, k) product. */
struct conv_reserve {
    const struct tensor *in0, *in1, *out; /* in0, in1: NULL where nothing is staged (the bf16 path) */
    int64_t nin0, nin1, ntmp0, ntmp1, m, n, k;
    enum dtype dt; /* the products' inputs */
};

static bool conv_reserve_workers(struct cpu_backend *cb, const struct conv_reserve *r)
{
    return cpu_wscratch_rows(cb) && wstage_reserve(cb, WSCR_IN0, r->in0, (size_t)r->nin0) &&
           wstage_reserve(cb, WSCR_IN1, r->in1, (size_t)r->nin1) &&
           wstage_reserve(cb, WSCR_TMP1, r->out, (size_t)r->ntmp1) &&
           (r->ntmp0 == 0 || cpu_wscratch_reserve(cb, WSCR_TMP0, (size_t)r->ntmp0 * sizeof(float))) &&
           cpu_worker_gemm_reserve(cb, r->dt, r->m, r->n, r->k);
}

/* The forward pass and the data gradient alike, image by image: on the pool above the threshold, each worker
 * in its own buffers (r sizes them); else on the calling thread through the shared slots, r->in0 staged into
 * in0, r->out into tmp1, im2col's columns (r->ntmp0, none for a pointwise convolution) in tmp0. */
static void conv_images(struct cpu_backend *cb, const struct conv_job *j, const struct conv_reserve *r,
                        parallel_fn chunk, void (*image)(const struct conv_job *, int64_t, const struct conv_bufs *))
{
    const struct conv_args *a = j->a;
    if (conv_threaded(cb, a)) {
        if (conv_reserve_workers(cb, r))
            parallel_for(cb->pool, a->n, chunk, (void *)j);
        return;
    }
    bool ok = true;
    struct conv_bufs b = { .in0 = stage_f32(cb, SCR_IN0, r->in0, (size_t)r->nin0, &ok),
                           .tmp1 = stage_f32(cb, SCR_TMP1, r->out, (size_t)r->ntmp1, &ok), .worker = -1 };
    b.tmp0 = r->ntmp0 == 0 ? NULL : scratch_get(cb, SCR_TMP0, (size_t)r->ntmp0 * sizeof(float));
    if (!ok || (r->ntmp0 != 0 && !b.tmp0))
        return;
    for (int64_t i = 0; i < a->n; i++)
        image(j, i, &b);
}

void cpu_conv2d_forward(struct backend *be, const struct conv_args *a, struct tensor *y,
                               const struct tensor *x, const struct tensor *w, const struct tensor *bias)
{
    struct cpu_backend *cb = cpu_of(be);
    conv_check(a);
    const struct conv_dims d = conv_dims_of(a);
    assert((int64_t)x->numel == a->n * d.chw_in && (int64_t)w->numel == a->c_out * d.ckk);
    assert((int64_t)y->numel == a->n * d.chw_out);
    assert(!bias || (bias->dtype == DT_FP32 && (int64_t)bias->numel == a->c_out));
    const bool pointwise = conv_is_pointwise(a);
    const enum dtype dt = conv_product_dtype(cb, x, w);
    const void *wv = dt == DT_BF16 ? w->data : (const void *)view_f32(cb, SCR_IN1, w);
    if (!wv)
        return;
    struct conv_job j = { .cb = cb, .a = a, .out = y, .in = x, .dt = dt, .w = wv,
                          .bias = bias ? (const float *)bias->data : NULL };
    struct conv_reserve r = { .in0 = dt == DT_BF16 ? NULL : x, .out = y, .nin0 = d.chw_in, .ntmp1 = d.chw_out,
                              .ntmp0 = pointwise ? 0 : d.ckk * d.hw, .m = a->c_out, .n = d.hw, .k = d.ckk, .dt = dt };
    conv_images(cb, &j, &r, conv_forward_chunk, conv_forward_image);
}

void cpu_conv2d_backward_data(struct backend *be, const struct conv_args *a, struct tensor *dx,
                                     const struct tensor *dy, const struct tensor *w)
{
    struct cpu_backend *cb = cpu_of(be);
    conv_check(a);
    const struct conv_dims d = conv_dims_of(a);
    assert((int64_t)dx->numel == a->n * d.chw_in && (int64_t)dy->numel == a->n * d.chw_out);
    const bool pointwise = conv_is_pointwise(a);
    const enum dtype dt = conv_product_dtype(cb, dy, w);
    const void *wv = dt == DT_BF16 ? w->data : (const void *)view_f32(cb, SCR_IN1, w);
    if (!wv)
        return;
    struct conv_job j = { .cb = cb, .a = a, .out = dx, .in = dy, .dt = dt, .w = wv };
    struct conv_reserve r = { .in0 = dt == DT_BF16 ? NULL : dy, .out = dx, .nin0 = d.chw_out, .ntmp1 = d.chw_in,
                              .ntmp0 = pointwise ? 0 : d.ckk * d.hw, .m = d.ckk, .n = d.hw, .k = a->c_out, .dt = dt };
    conv_images(cb, &j, &r, conv_backward_data_chunk, conv_backward_data_image);
}

void cpu_conv2d_backward_filter(struct backend *be, const struct conv_args *a, struct tensor *dw,
                                       struct tensor *db, const struct tensor *dy, const struct tensor *x, float beta)
{
    struct cpu_backend *cb = cpu_of(be);
    conv_check(a);
    const struct conv_dims d = conv_dims_of(a);
    assert(dw->dtype == DT_FP32 && (int64_t)dw->numel == a->c_out * d.ckk);
    assert(!db || (db->dtype == DT_FP32 && (int64_t)db->numel == a->c_out));
    assert((int64_t)x->numel == a->n * d.chw_in && (int64_t)dy->numel == a->n * d.chw_out);
    const int64_t group = conv_filter_group(a);
    const bool threaded = conv_threaded(cb, a) && group > 1;
    const int64_t sum_images = threaded ? group : 1; /* plane sums held at once */
    double *acc = db ? scratch_get(cb, SCR_ACC0, (size_t)a->c_out * sizeof(double)) : NULL;
    double *sums = db ? scratch_get(cb, SCR_ACC1, (size_t)(sum_images * a->c_out) * sizeof(double)) : NULL;
    if (db && (!acc || !sums))
        return;
    const enum dtype dt = conv_product_dtype(cb, dy, x);
    const bool staged = dt != DT_BF16; /* the bf16 path reads dy and x in place */
    const bool transposed = conv_filter_transposed(cb, a, dt);
    const int64_t ntmp0 = conv_filter_tmp0(a, transposed);
    struct conv_job j = { .cb = cb, .a = a, .out = dw, .in = dy, .in2 = x, .dt = dt, .acc = acc, .beta = beta,
                          .sums = sums, .transposed = transposed };
    bool ok = true;
    struct conv_bufs b = { .worker = -1 };
    if (threaded) {
        struct conv_reserve r = { .in0 = staged ? dy : NULL, .in1 = staged ? x : NULL, .nin0 = d.chw_out,
                                  .nin1 = d.chw_in, .ntmp0 = ntmp0, .m = transposed ? d.ckk : a->c_out,
                                  .n = transposed ? a->c_out : d.ckk, .k = d.hw, .dt = dt };
        j.prod = scratch_get(cb, SCR_TMP2, (size_t)(group * a->c_out * d.ckk) * sizeof(float));
        ok = j.prod && conv_reserve_workers(cb, &r);
    } else {
        b.in0 = stage_f32(cb, SCR_IN0, staged ? dy : NULL, (size_t)d.chw_out, &ok);
        b.in1 = stage_f32(cb, SCR_IN1, staged ? x : NULL, (size_t)d.chw_in, &ok);
        b.tmp0 = ntmp0 == 0 ? NULL : scratch_get(cb, SCR_TMP0, (size_t)ntmp0 * sizeof(float));
        ok = ok && (ntmp0 == 0 || b.tmp0);
    }
    if (!ok)
        return;
    float *dwf = (float *)dw->data;
    if (a->n == 0)
        scale_f32(dwf, dw->numel, beta);
    if (acc)
        memset(acc, 0, (size_t)a->c_out * sizeof(double));
    for (int64_t i0 = 0; i0 < a->n; i0 += sum_images) {
        if (threaded) {
            j.i0 = i0;
            j.images = a->n - i0 < group ? a->n - i0 : group;
            parallel_for(cb->pool, j.images, conv_filter_chunk, &j);
            parallel_for(cb->pool, ew_chunks((size_t)(a->c_out * d.ckk)), conv_filter_sum_chunk, &j);
        } else {
            /* dW (c_out, ckk) += dy_i (c_out, hw) @ col_i^T (hw, ckk) */
            conv_filter_image(&j, i0, &b, i0 == 0 ? beta : 1.0f, dwf, sums);
        }
        /* db: per channel a double sum over the plane, added to the channel's total image by image */
        for (int64_t k = 0; acc && k < (threaded ? j.images : 1); k++)
            for (int64_t co = 0; co < a->c_out; co++)
                acc[co] += sums[k * a->c_out + co];
    }
    if (db)
        store_acc((float *)db->data, acc, (size_t)a->c_out, beta);
}
