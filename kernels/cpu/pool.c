/*
 * pool.c — the CPU backend's 2-D pooling (max and average), forward and backward, NCHW, threaded by planes.
 *
 * Max pooling finds each window's first maximum in row-major order, or its last NaN (PyTorch's CPU rule), with
 * the plain loop (window_argmax) first; beside it the AVX-512 version of the 2x2 / stride 2 windows (16 windows at
 * a time, the same rule in the same order, so the same index) and the fused 2x2 backward, each taken only where
 * the CPU has the instructions. y and dx are overwritten; the backward scatters dy into dx by the argmax.
 */
#include "cpu_internal.h" /* struct cpu_backend, scratch, dtype helpers, ld16/st16 */

/* Index in the plane of the window's max: the first maximum in row-major window order, or the last
 * NaN (PyTorch's CPU rule `val > max || isnan(val)`). Padding never wins (it is -inf). -1 only for a
 * window that covers no input, which valid shapes never produce. */
static int64_t pool_argmax(const float *plane, const struct pool_args *a, int64_t oh, int64_t ow)
{
    int64_t best_i = -1;
    float best = -INFINITY;
    for (int64_t kh = 0; kh < a->kernel; kh++) {
        int64_t ih = oh * a->stride - a->padding + kh;
        if (ih < 0 || ih >= a->h_in)
            continue;
        for (int64_t kw = 0; kw < a->kernel; kw++) {
            int64_t iw = ow * a->stride - a->padding + kw;
            if (iw < 0 || iw >= a->w_in)
                continue;
            float v = plane[ih * a->w_in + iw];
            if (v > best || isnan(v) || best_i < 0) {
                best = v;
                best_i = ih * a->w_in + iw;
            }
        }
    }
    return best_i;
}

/* pool_argmax for a window that lies inside the plane, rows h0 .. h0+k-1, columns w0 .. w0+k-1: the
 * same rule (first maximum; a NaN wins) without bounds checks. */
static inline int32_t window_argmax(const float *plane, int64_t w_in, int64_t h0, int64_t w0, int64_t k)
{
    int32_t best_i = (int32_t)(h0 * w_in + w0);
    float best = plane[best_i];
    for (int64_t kh = 0; kh < k; kh++)
        for (int64_t kw = 0; kw < k; kw++) {
            const int32_t i = (int32_t)((h0 + kh) * w_in + w0 + kw);
            const float v = plane[i];
            const int take = (v > best) | (v != v); /* larger, or NaN */
            best = take ? v : best;
            best_i = take ? i : best_i;
        }
    return best_i;
}

#ifdef HAVE_AVX512_INTRIN

/* window_argmax of the windows 2x2 / stride 2 of one row, 16 at a time (the last group masked): the four
 * candidates of each window (row-major order) deinterleaved from two 32-float loads per row, then taken in
 * window_argmax's order with its rule (larger, or NaN), so the same index. */
__attribute__((target("avx512f"))) static void maxpool_row_2x2_avx512(const float *plane, int64_t w_in, int64_t h0,
                                                                      int64_t w0, int64_t count, int32_t *arg)
{
    const float *r0 = plane + h0 * w_in + w0, *r1 = r0 + w_in;
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    const __m512i one = _mm512_set1_epi32(1), down = _mm512_set1_epi32((int32_t)w_in);
    for (int64_t o = 0; o < count; o += 16) {
        const int64_t n = count - o < 16 ? count - o : 16, vals = 2 * n; /* windows, and floats per row */
        const __mmask16 m0 = vals >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << vals) - 1);
        const __mmask16 m1 = vals >= 32 ? (__mmask16)0xFFFF : vals > 16 ? (__mmask16)((1u << (vals - 16)) - 1) : 0;
        const __m512 x0 = _mm512_maskz_loadu_ps(m0, r0 + 2 * o), x1 = _mm512_maskz_loadu_ps(m1, r0 + 2 * o + 16);
        const __m512 y0 = _mm512_maskz_loadu_ps(m0, r1 + 2 * o), y1 = _mm512_maskz_loadu_ps(m1, r1 + 2 * o + 16);
        const __m512 v[4] = { _mm512_permutex2var_ps(x0, even, x1), _mm512_permutex2var_ps(x0, odd, x1),
                              _mm512_permutex2var_ps(y0, even, y1), _mm512_permutex2var_ps(y0, odd, y1) };
        const __m512i ia = _mm512_add_epi32(_mm512_set1_epi32((int32_t)(h0 * w_in + w0 + 2 * o)), even);
        const __m512i idx[4] = { ia, _mm512_add_epi32(ia, one), _mm512_add_epi32(ia, down),
                                 _mm512_add_epi32(_mm512_add_epi32(ia, down), one) };
        __m512 best = v[0];
        __m512i bi = idx[0];
        for (int c = 0; c < 4; c++) {
            const __mmask16 take = _mm512_cmp_ps_mask(v[c], best, _CMP_GT_OQ) | _mm512_cmp_ps_mask(v[c], v[c], _CMP_UNORD_Q);
            best = _mm512_mask_mov_ps(best, take, v[c]);
            bi = _mm512_mask_mov_epi32(bi, take, idx[c]);
        }
        _mm512_mask_storeu_epi32(arg + o, n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1), bi);
    }
}

/* The gradient of a 2x2 / stride-2 max pool without padding over a plane of 2 h_out x 2 w_out (x, dy, dx all fp32
 * or all bf16), in one pass and 16 windows at a time: each window's max chosen by maxpool_row_2x2_avx512's rule
 * (the first of equal values, the last NaN), and its four dx values written at once, the window's gradient
 * 0 + dy at the max (the generic path adds dy to a zeroed plane: -0 becomes +0 there too) and +0 elsewhere,
 * rounded as store_f32 rounds. Every input is in one window, so this is the generic path's plane, bit for bit,
 * without its zeroing pass, the argmax array, the scatter and, for bf16, the staging and rounding passes. */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static void maxpool2x2_backward_plane(void *dx, const void *dy,
                                                                                          const void *x, bool bf16,
                                                                                          int64_t h_out, int64_t w_out)
{
    const int64_t w_in = 2 * w_out;
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    /* window i's left and right values side by side: outputs 2i and 2i + 1 of the row */
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (int64_t oh = 0; oh < h_out; oh++) {
        const int64_t r0 = 2 * oh * w_in, r1 = r0 + w_in;
        for (int64_t o = 0; o < w_out; o += 16) {
            const int64_t n = w_out - o < 16 ? w_out - o : 16, vals = 2 * n; /* windows, and values per row */
            const __mmask16 mw = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
            const __mmask16 m0 = vals >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << vals) - 1);
            const __mmask16 m1 = vals >= 32 ? (__mmask16)0xFFFF : vals > 16 ? (__mmask16)((1u << (vals - 16)) - 1) : 0;
            const __m512 x0 = ld16m(x, r0 + 2 * o, bf16, m0), x1 = ld16m(x, r0 + 2 * o + 16, bf16, m1);
            const __m512 y0 = ld16m(x, r1 + 2 * o, bf16, m0), y1 = ld16m(x, r1 + 2 * o + 16, bf16, m1);
            const __m512 v[4] = { _mm512_permutex2var_ps(x0, even, x1), _mm512_permutex2var_ps(x0, odd, x1),
                                  _mm512_permutex2var_ps(y0, even, y1), _mm512_permutex2var_ps(y0, odd, y1) };
            __m512 best = v[0];
            __m512i which = _mm512_setzero_si512();
            for (int c = 1; c < 4; c++) {
                const __mmask16 take =
                    _mm512_cmp_ps_mask(v[c], best, _CMP_GT_OQ) | _mm512_cmp_ps_mask(v[c], v[c], _CMP_UNORD_Q);
                best = _mm512_mask_mov_ps(best, take, v[c]);
                which = _mm512_mask_mov_epi32(which, take, _mm512_set1_epi32(c));
            }
            const __m512 g = _mm512_add_ps(_mm512_setzero_ps(), ld16m(dy, oh * w_out + o, bf16, mw));
            __m512 d[4];
            for (int c = 0; c < 4; c++)
                d[c] = _mm512_maskz_mov_ps(_mm512_cmpeq_epi32_mask(which, _mm512_set1_epi32(c)), g);
            st16m(dx, r0 + 2 * o, _mm512_permutex2var_ps(d[0], lo, d[1]), bf16, m0);
            st16m(dx, r0 + 2 * o + 16, _mm512_permutex2var_ps(d[0], hi, d[1]), bf16, m1);
            st16m(dx, r1 + 2 * o, _mm512_permutex2var_ps(d[2], lo, d[3]), bf16, m0);
            st16m(dx, r1 + 2 * o + 16, _mm512_permutex2var_ps(d[2], hi, d[3]), bf16, m1);
        }
    }
}

/* Whether a max pool's backward runs maxpool2x2_backward_plane: 2x2, stride 2, no padding, even planes, one dtype
 * (fp32 or bf16) for x, dy and dx, on a CPU with AVX-512 (BW, VL). */
static bool maxpool2x2_fused_runs(const struct pool_args *a, const struct tensor *dx, const struct tensor *dy,
                                  const struct tensor *x)
{
    return a->kind == POOL_MAX && a->kernel == 2 && a->stride == 2 && a->padding == 0 && a->h_in == 2 * a->h_out &&
           a->w_in == 2 * a->w_out && x->dtype == dy->dtype && dy->dtype == dx->dtype &&
           (x->dtype == DT_FP32 || x->dtype == DT_BF16) && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}
#endif

/* window_argmax over `count` windows of one output row, `stride` apart; the 2x2 / stride 2 case (the
 * reference CNN's) gets constants, so the window loops unroll, and 16 windows at a time with AVX-512. */
static void maxpool_row_inside(const float *plane, int64_t w_in, int64_t h0, int64_t w0, int64_t stride, int64_t k,
                               int64_t count, int32_t *arg)
{
    if (stride == 2 && k == 2) {
#ifdef HAVE_AVX512_INTRIN
        if (__builtin_cpu_supports("avx512f")) {
            maxpool_row_2x2_avx512(plane, w_in, h0, w0, count, arg);
            return;
        }
#endif
        for (int64_t o = 0; o < count; o++)
            arg[o] = window_argmax(plane, w_in, h0, w0 + 2 * o, 2);
    } else
        for (int64_t o = 0; o < count; o++)
            arg[o] = window_argmax(plane, w_in, h0, w0 + stride * o, k);
}

/* The argmax (index into the plane, -1 for a window of padding only) of every output of one plane:
 * windows inside the plane by maxpool_row_inside, the ones that touch the padding by pool_argmax. */
static void maxpool_plane_argmax(const float *plane, const struct pool_args *a, int32_t *arg)
{
    assert(a->h_in * a->w_in <= INT32_MAX);
    const int64_t s = a->stride, p = a->padding, k = a->kernel;
    /* output columns whose windows lie inside: ow*s - p >= 0 and ow*s - p + k <= w_in */
    int64_t ow0 = (p + s - 1) / s, ow1 = a->w_in + p - k >= 0 ? (a->w_in + p - k) / s + 1 : 0;
    ow1 = ow1 < a->w_out ? ow1 : a->w_out;
    for (int64_t oh = 0; oh < a->h_out; oh++) {
        int32_t *row = arg + oh * a->w_out;
        const int64_t h0 = oh * s - p;
        const bool inside = h0 >= 0 && h0 + k <= a->h_in && ow0 < ow1;
        const int64_t lo = inside ? ow0 : a->w_out, hi = inside ? ow1 : a->w_out;
        for (int64_t ow = 0; ow < lo; ow++)
            row[ow] = (int32_t)pool_argmax(plane, a, oh, ow);
        if (inside)
            maxpool_row_inside(plane, a->w_in, h0, ow0 * s - p, s, k, ow1 - ow0, row + ow0);
        for (int64_t ow = hi; ow < a->w_out; ow++)
            row[ow] = (int32_t)pool_argmax(plane, a, oh, ow);
    }
}

/* PyTorch's count_include_pad divisor: the window clipped to the padded extent of the input. */
static int64_t pool_divisor(const struct pool_args *a, int64_t oh, int64_t ow)
{
    int64_t h0 = oh * a->stride - a->padding, w0 = ow * a->stride - a->padding;
    int64_t h1 = h0 + a->kernel < a->h_in + a->padding ? h0 + a->kernel : a->h_in + a->padding;
    int64_t w1 = w0 + a->kernel < a->w_in + a->padding ? w0 + a->kernel : a->w_in + a->padding;
    return (h1 - h0) * (w1 - w0);
}

/* Pooling works one (n, c) plane at a time; 16-bit planes are staged through O(plane) scratch. The
 * planes are cut into chunks of at least EW_CHUNK input elements (one chunk for a smaller problem); a
 * plane's outputs depend on that plane alone, so which worker runs a chunk changes no bit. */
struct pool_job {
    const struct cpu_backend *cb;
    const struct pool_args *a;
    struct tensor *out;                       /* y, dx */
    const struct tensor *in, *x;              /* forward: x, NULL; backward: dy, x */
    int64_t planes;                           /* planes a chunk */
};

static int64_t pool_chunk_planes(const struct pool_args *a)
{
    const int64_t hw_in = a->h_in * a->w_in, all = a->n * a->c;
    if (hw_in <= 0 || all * hw_in < (int64_t)EW_CHUNK)
        return all > 0 ? all : 1;
    return ((int64_t)EW_CHUNK + hw_in - 1) / hw_in;
}

static bool pool_reserve(struct cpu_backend *cb, const struct pool_args *a, const struct tensor *in, size_t nin,
                         const struct tensor *x, const struct tensor *out, size_t nout)
{
    const size_t hw = (size_t)(a->h_out * a->w_out);
    return cpu_wscratch_rows(cb) && wstage_reserve(cb, WSCR_IN0, in, nin) &&
           wstage_reserve(cb, WSCR_IN1, x, (size_t)(a->h_in * a->w_in)) &&
           wstage_reserve(cb, WSCR_TMP0, out, nout) &&
           (a->kind != POOL_MAX || cpu_wscratch_reserve(cb, WSCR_IDX, hw * sizeof(int32_t)));
}

static void pool_forward_chunk(void *arg, int64_t chunk, int worker)
{
    const struct pool_job *j = arg;
    const struct pool_args *a = j->a;
    const struct tensor *x = j->in, *y = j->out;
    int64_t hw_in = a->h_in * a->w_in, hw = a->h_out * a->w_out, all = a->n * a->c;
    float *xbuf = wscratch(j->cb, worker, WSCR_IN0), *ybuf = wscratch(j->cb, worker, WSCR_TMP0);
    int32_t *arg_max = wscratch(j->cb, worker, WSCR_IDX);
    const int64_t pl0 = chunk * j->planes, pl1 = all - pl0 < j->planes ? all : pl0 + j->planes;
    for (int64_t pl = pl0; pl < pl1; pl++) {
        const float *plane = load_f32(x->data, x->dtype, (size_t)(pl * hw_in), (size_t)hw_in, xbuf);
        float *out = out_f32(y->data, y->dtype, (size_t)(pl * hw), ybuf);
        if (a->kind == POOL_MAX) {
            maxpool_plane_argmax(plane, a, arg_max);
            for (int64_t o = 0; o < hw; o++)
                out[o] = arg_max[o] >= 0 ? plane[arg_max[o]] : -INFINITY;
            store_f32(y->data, y->dtype, (size_t)(pl * hw), (size_t)hw, out);
            continue;
        }
        for (int64_t oh = 0; oh < a->h_out; oh++)
            for (int64_t ow = 0; ow < a->w_out; ow++) {
                float sum = 0.0f;
                for (int64_t kh = 0; kh < a->kernel; kh++) {
                    int64_t ih = oh * a->stride - a->padding + kh;
                    if (ih < 0 || ih >= a->h_in)
                        continue;
                    for (int64_t kw = 0; kw < a->kernel; kw++) {
                        int64_t iw = ow * a->stride - a->padding + kw;
                        if (iw >= 0 && iw < a->w_in)
                            sum += plane[ih * a->w_in + iw];
                    }
                }
                out[oh * a->w_out + ow] = sum / (float)pool_divisor(a, oh, ow);
            }
        store_f32(y->data, y->dtype, (size_t)(pl * hw), (size_t)hw, out);
    }
}

void cpu_pool2d_forward(struct backend *be, const struct pool_args *a, struct tensor *y,
                               const struct tensor *x)
{
    struct cpu_backend *cb = cpu_of(be);
    int64_t hw_in = a->h_in * a->w_in, hw = a->h_out * a->w_out;
    assert((int64_t)x->numel == a->n * a->c * hw_in && (int64_t)y->numel == a->n * a->c * hw);
    if (!pool_reserve(cb, a, x, (size_t)hw_in, NULL, y, (size_t)hw))
        return;
    struct pool_job j = { .cb = cb, .a = a, .out = y, .in = x, .planes = pool_chunk_planes(a) };
    parallel_for(cb->pool, (a->n * a->c + j.planes - 1) / j.planes, pool_forward_chunk, &j);
}

static void pool_backward_chunk(void *arg, int64_t chunk, int worker)
{
    const struct pool_job *j = arg;
    const struct pool_args *a = j->a;
    const struct tensor *dy = j->in, *x = j->x, *dx = j->out;
    int64_t hw_in = a->h_in * a->w_in, hw = a->h_out * a->w_out, all = a->n * a->c;
    bool is_max = a->kind == POOL_MAX;
    float *dybuf = wscratch(j->cb, worker, WSCR_IN0), *xbuf = wscratch(j->cb, worker, WSCR_IN1);
    float *dxbuf = wscratch(j->cb, worker, WSCR_TMP0);
    int32_t *arg_max = wscratch(j->cb, worker, WSCR_IDX);
    const int64_t pl0 = chunk * j->planes, pl1 = all - pl0 < j->planes ? all : pl0 + j->planes;
#ifdef HAVE_AVX512_INTRIN
    if (is_max && maxpool2x2_fused_runs(a, dx, dy, x)) {
        for (int64_t pl = pl0; pl < pl1; pl++)
            maxpool2x2_backward_plane(elem_ptr(dx->data, dx->dtype, (size_t)(pl * hw_in)),
                                      elem_ptr(dy->data, dy->dtype, (size_t)(pl * hw)),
                                      elem_ptr(x->data, x->dtype, (size_t)(pl * hw_in)), x->dtype == DT_BF16, a->h_out,
                                      a->w_out);
        return;
    }
#endif
    for (int64_t pl = pl0; pl < pl1; pl++) {
        float *dplane = out_f32(dx->data, dx->dtype, (size_t)(pl * hw_in), dxbuf);
        const float *g = load_f32(dy->data, dy->dtype, (size_t)(pl * hw), (size_t)hw, dybuf);
        const float *xplane = is_max ? load_f32(x->data, x->dtype, (size_t)(pl * hw_in), (size_t)hw_in, xbuf) : NULL;
        memset(dplane, 0, (size_t)hw_in * sizeof(float));
        if (is_max) {
            maxpool_plane_argmax(xplane, a, arg_max);
            for (int64_t o = 0; o < hw; o++) /* in output order: the sums' order does not depend on the path */
                if (arg_max[o] >= 0)
                    dplane[arg_max[o]] += g[o];
            store_f32(dx->data, dx->dtype, (size_t)(pl * hw_in), (size_t)hw_in, dplane);
            continue;
        }
        for (int64_t oh = 0; oh < a->h_out; oh++)
            for (int64_t ow = 0; ow < a->w_out; ow++) {
                float gv = g[oh * a->w_out + ow];
                float share = gv / (float)pool_divisor(a, oh, ow);
                for (int64_t kh = 0; kh < a->kernel; kh++) {
                    int64_t ih = oh * a->stride - a->padding + kh;
                    if (ih < 0 || ih >= a->h_in)
                        continue;
                    for (int64_t kw = 0; kw < a->kernel; kw++) {
                        int64_t iw = ow * a->stride - a->padding + kw;
                        if (iw >= 0 && iw < a->w_in)
                            dplane[ih * a->w_in + iw] += share;
                    }
                }
            }
        store_f32(dx->data, dx->dtype, (size_t)(pl * hw_in), (size_t)hw_in, dplane);
    }
}

void cpu_pool2d_backward(struct backend *be, const struct pool_args *a, struct tensor *dx,
                                const struct tensor *dy, const struct tensor *x, const struct tensor *y)
{
    struct cpu_backend *cb = cpu_of(be);
    (void)y; /* the window's argmax is recomputed from x */
    int64_t hw_in = a->h_in * a->w_in, hw = a->h_out * a->w_out;
    assert((int64_t)dx->numel == a->n * a->c * hw_in && (int64_t)dy->numel == a->n * a->c * hw);
    bool is_max = a->kind == POOL_MAX;
    if (!pool_reserve(cb, a, dy, (size_t)hw, is_max ? x : NULL, dx, (size_t)hw_in))
        return;
    struct pool_job j = { .cb = cb, .a = a, .out = dx, .in = dy, .x = is_max ? x : NULL,
                          .planes = pool_chunk_planes(a) };
    parallel_for(cb->pool, (a->n * a->c + j.planes - 1) / j.planes, pool_backward_chunk, &j);
}
