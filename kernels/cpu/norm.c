/*
 * norm.c — the CPU backend's normalisations: layernorm (by rows) and batchnorm (by channels, with the fused
 * ReLU), forward and backward.
 *
 * Statistics are double sums in element order; the plain loops come first (FOR_CHAINS: eight channels' or rows'
 * chains side by side), and beside them, where the CPU has AVX-512, the eight chains as vector lanes
 * (planes8_avx512.c) and batchnorm's one-pass planes (bn_norm_plane, bn_dx_plane): the same IEEE operations in
 * the same order, so the same bits (docs/backend.md, "Fused batchnorm + ReLU"). y, dx, mean and rstd are
 * overwritten; dgamma and dbeta accumulate with beta_acc; batchnorm's running statistics are updated in place.
 */
#include "cpu_internal.h" /* struct cpu_backend, scratch, dtype helpers, FOR_CHAINS, cpu_planes_*8_avx512 */

/* Layernorm is threaded by rows (rows_per_chunk of them a chunk): a row's statistics and outputs depend on
 * that row alone. The weight and bias gradients are sums over all rows, so they are threaded by columns
 * instead (LN_COLS a chunk): each column is summed over the rows in order 0, 1, ..., in double, exactly as
 * one thread does. */
#define LN_COLS 32

struct ln_job {
    struct cpu_backend *cb;
    const struct norm_args *a;
    struct tensor *y, *dx;                 /* (rows, cols), x's dtype */
    float *mean_out, *rstd_out;            /* (rows) forward's statistics */
    const float *mean, *rstd;              /* (rows) the same, read backward */
    struct tensor *dgamma, *dbeta;         /* (cols) fp32 */
    const struct tensor *x, *dy;           /* (rows, cols); forward with an addend: x is a->sum */
    const struct tensor *x1;               /* forward with an addend: the add's first input */
    const float *g, *bt;                   /* gamma, beta (cols) fp32, or NULL */
    double *acc_g, *acc_b;                 /* (cols) the gradients' sums */
    float beta_acc;
    int64_t rows_per;                      /* rows per chunk */
};

/* A row's mean and variance (forward) and its two gradient sums (backward) are double sums over its columns in
 * order: CHAINS rows side by side (FOR_CHAINS; a 16-bit row is staged in its own slice of the scratch). */

HOT_LOOP static void ln_forward_chunk(void *arg, int64_t chunk, int worker)
{
    const struct ln_job *j = arg;
    const struct tensor *x = j->x;
    struct tensor *y = j->y;
    int64_t cols = j->a->cols, r0 = chunk * j->rows_per;
    int64_t r1 = r0 + j->rows_per < j->a->rows ? r0 + j->rows_per : j->a->rows;
    const float *g = j->g, *bt = j->bt;
    float *xb = wscratch(j->cb, worker, WSCR_TMP0), *yb = wscratch(j->cb, worker, WSCR_TMP1);
    if (j->a->addend) /* the fused residual add: the chunk's rows of sum first, read back below as stored */
        cpu_add_range(j->a->sum, j->x1, j->a->addend, (size_t)(r0 * cols), (size_t)(r1 * cols));
    for (int64_t rg = r0; rg < r1; rg += CHAINS) {
        const int64_t lanes = r1 - rg < CHAINS ? r1 - rg : CHAINS;
        const float *xr[CHAINS];
        double s[CHAINS] = { 0.0 }, ss[CHAINS] = { 0.0 }, mu[CHAINS];
        for (int64_t l = 0; l < lanes; l++)
            xr[l] = load_f32(x->data, x->dtype, (size_t)((rg + l) * cols), (size_t)cols, xb + l * cols);
#ifdef HAVE_AVX512_INTRIN
        const bool planes = cpu_planes8_avx512(lanes); /* the rows as a vector's lanes: the same sums */
        if (planes)
            cpu_planes_sum8_avx512((const void *const *)xr, false, cols, s);
        else
#endif
            FOR_CHAINS(lanes, cols, l, k, s[l] += xr[l][k]);
        for (int64_t l = 0; l < lanes; l++)
            mu[l] = s[l] / (double)cols;
#ifdef HAVE_AVX512_INTRIN
        if (planes)
            cpu_planes_sumsq8_avx512((const void *const *)xr, false, cols, mu, ss);
        else
#endif
            FOR_CHAINS(lanes, cols, l, k, double d = xr[l][k] - mu[l]; ss[l] += d * d);
        for (int64_t l = 0; l < lanes; l++) {
            const int64_t r = rg + l;
            float mu_f = (float)mu[l];
            float rs_f = (float)(1.0 / sqrt(ss[l] / (double)cols + (double)j->a->eps));
            j->mean_out[r] = mu_f;
            j->rstd_out[r] = rs_f;
            float *yr = out_f32(y->data, y->dtype, (size_t)(r * cols), yb);
            for (int64_t k = 0; k < cols; k++) {
                float v = (xr[l][k] - mu_f) * rs_f;
                yr[k] = v * (g ? g[k] : 1.0f) + (bt ? bt[k] : 0.0f);
            }
            store_f32(y->data, y->dtype, (size_t)(r * cols), (size_t)cols, yr);
        }
    }
}

void cpu_layernorm_forward(struct backend *be, const struct norm_args *a, struct tensor *y,
                                  struct tensor *mean, struct tensor *rstd, const struct tensor *x,
                                  const struct tensor *gamma, const struct tensor *beta)
{
    struct cpu_backend *cb = cpu_of(be);
    int64_t rows = a->rows, cols = a->cols;
    assert((int64_t)x->numel == rows * cols && (int64_t)y->numel == rows * cols);
    assert(mean->dtype == DT_FP32 && rstd->dtype == DT_FP32 && (int64_t)mean->numel == rows);
    if (!cpu_wscratch_reserve(cb, WSCR_TMP0, (size_t)(CHAINS * cols) * sizeof(float)) ||
        !cpu_wscratch_reserve(cb, WSCR_TMP1, (size_t)cols * sizeof(float)))
        return;
    assert(!a->addend || (a->sum && a->addend->numel == x->numel && a->sum->numel == x->numel));
    struct ln_job j = { .cb = cb, .a = a, .y = y, .mean_out = mean->data, .rstd_out = rstd->data,
                        .x = a->addend ? a->sum : x, .x1 = x,
                        .g = gamma ? (const float *)gamma->data : NULL, .bt = beta ? (const float *)beta->data : NULL,
                        .rows_per = rows_per_chunk(cols) };
    parallel_for(cb->pool, div_up(rows, j.rows_per), ln_forward_chunk, &j);
}

/* dx for a chunk of rows: each row's two sums over its columns, in column order, then its dx. */
HOT_LOOP static void ln_backward_dx_chunk(void *arg, int64_t chunk, int worker)
{
    const struct ln_job *j = arg;
    int64_t cols = j->a->cols, r0 = chunk * j->rows_per;
    int64_t r1 = r0 + j->rows_per < j->a->rows ? r0 + j->rows_per : j->a->rows;
    const float *g = j->g;
    float *xb = wscratch(j->cb, worker, WSCR_TMP0), *dyb = wscratch(j->cb, worker, WSCR_TMP1);
    float *dxb = wscratch(j->cb, worker, WSCR_TMP2);
    for (int64_t rg = r0; rg < r1; rg += CHAINS) {
        const int64_t lanes = r1 - rg < CHAINS ? r1 - rg : CHAINS;
        const float *xr[CHAINS], *dyr[CHAINS];
        float mu[CHAINS], rs[CHAINS];
        double s1[CHAINS] = { 0.0 }, s2[CHAINS] = { 0.0 }; /* sum dxhat, sum dxhat * xhat */
        for (int64_t l = 0; l < lanes; l++) {
            const size_t off = (size_t)((rg + l) * cols);
            xr[l] = load_f32(j->x->data, j->x->dtype, off, (size_t)cols, xb + l * cols);
            dyr[l] = load_f32(j->dy->data, j->dy->dtype, off, (size_t)cols, dyb + l * cols);
            mu[l] = j->mean[rg + l];
            rs[l] = j->rstd[rg + l];
        }
#ifdef HAVE_AVX512_INTRIN
        if (cpu_planes8_avx512(lanes)) /* the rows as a vector's lanes: the same sums (no g: dy * 1 is dy) */
            cpu_planes_gradsum8_avx512((const void *const *)xr, (const void *const *)dyr, NULL, g, false, cols, mu, rs,
                                   s1, s2);
        else
#endif
            FOR_CHAINS(lanes, cols, l, k, float xhat = (xr[l][k] - mu[l]) * rs[l];
                       float dxhat = dyr[l][k] * (g ? g[k] : 1.0f); s1[l] += dxhat; s2[l] += (double)dxhat * xhat);
        for (int64_t l = 0; l < lanes; l++) {
            const int64_t r = rg + l;
            float m1 = (float)(s1[l] / (double)cols), m2 = (float)(s2[l] / (double)cols);
            float *dxr = out_f32(j->dx->data, j->dx->dtype, (size_t)(r * cols), dxb);
            for (int64_t k = 0; k < cols; k++) {
                float xhat = (xr[l][k] - mu[l]) * rs[l];
                float dxhat = dyr[l][k] * (g ? g[k] : 1.0f);
                dxr[k] = rs[l] * (dxhat - m1 - xhat * m2);
            }
            store_f32(j->dx->data, j->dx->dtype, (size_t)(r * cols), (size_t)cols, dxr);
        }
    }
    if (j->a->dsum) /* the fused residual's gradient: dx (as stored) + dsum, rounded once, the chunk's rows */
        cpu_add_range(j->dx, j->dx, j->a->dsum, (size_t)(r0 * cols), (size_t)(r1 * cols));
}

/* dgamma and dbeta for columns [c0, c1): each summed over all rows in row order. */
HOT_LOOP static void ln_backward_dparams_chunk(void *arg, int64_t chunk, int worker)
{
    const struct ln_job *j = arg;
    int64_t cols = j->a->cols, c0 = chunk * LN_COLS, w = cols - c0 < LN_COLS ? cols - c0 : LN_COLS;
    float *xb = wscratch(j->cb, worker, WSCR_TMP0), *dyb = wscratch(j->cb, worker, WSCR_TMP1);
    double *acc_g = j->acc_g + c0, *acc_b = j->acc_b + c0;
    memset(acc_g, 0, (size_t)w * sizeof(double));
    memset(acc_b, 0, (size_t)w * sizeof(double));
    for (int64_t r = 0; r < j->a->rows; r++) {
        const float *xr = load_f32(j->x->data, j->x->dtype, (size_t)(r * cols + c0), (size_t)w, xb);
        const float *dyr = load_f32(j->dy->data, j->dy->dtype, (size_t)(r * cols + c0), (size_t)w, dyb);
        float mu = j->mean[r], rs = j->rstd[r];
        for (int64_t k = 0; k < w; k++) {
            float xhat = (xr[k] - mu) * rs;
            acc_g[k] += (double)dyr[k] * xhat;
            acc_b[k] += dyr[k];
        }
    }
    if (j->dgamma)
        store_acc((float *)j->dgamma->data + c0, acc_g, (size_t)w, j->beta_acc);
    if (j->dbeta)
        store_acc((float *)j->dbeta->data + c0, acc_b, (size_t)w, j->beta_acc);
}

void cpu_layernorm_backward(struct backend *be, const struct norm_args *a, struct tensor *dx,
                                   struct tensor *dgamma, struct tensor *dbeta, const struct tensor *dy,
                                   const struct tensor *x, const struct tensor *mean, const struct tensor *rstd,
                                   const struct tensor *gamma, float beta_acc)
{
    struct cpu_backend *cb = cpu_of(be);
    int64_t rows = a->rows, cols = a->cols;
    assert((int64_t)x->numel == rows * cols && (int64_t)dy->numel == rows * cols);
    size_t row_bytes = (size_t)cols * sizeof(float);
    double *acc_g = scratch_get(cb, SCR_ACC0, (size_t)cols * sizeof(double));
    double *acc_b = scratch_get(cb, SCR_ACC1, (size_t)cols * sizeof(double));
    if (!acc_g || !acc_b || !cpu_wscratch_reserve(cb, WSCR_TMP0, CHAINS * row_bytes) ||
        !cpu_wscratch_reserve(cb, WSCR_TMP1, CHAINS * row_bytes) || !cpu_wscratch_reserve(cb, WSCR_TMP2, row_bytes))
        return;
    struct ln_job j = { .cb = cb, .a = a, .dx = dx, .dgamma = dgamma, .dbeta = dbeta, .mean = mean->data,
                        .rstd = rstd->data, .x = x, .dy = dy,
                        .g = gamma ? (const float *)gamma->data : NULL, .acc_g = acc_g, .acc_b = acc_b,
                        .beta_acc = beta_acc, .rows_per = rows_per_chunk(cols) };
    if (dx)
        parallel_for(cb->pool, div_up(rows, j.rows_per), ln_backward_dx_chunk, &j);
    /* column chunks hold every row: worth the pool only when the whole problem is more than one chunk */
    if (dgamma || dbeta)
        parallel_for(rows * cols > (int64_t)EW_CHUNK ? cb->pool : NULL, div_up(cols, LN_COLS),
                     ln_backward_dparams_chunk, &j);
}

/* Batchnorm (n, c, hw): channel ch's values are the n planes x[i, ch, :]. Everything of a channel — its
 * statistics (double sums over the images in order), its running statistics, its outputs, its parameter
 * gradients — depends on that channel alone, so the channels are cut into chunks of at least EW_CHUNK
 * elements (one chunk for a smaller problem), each computed in the order one thread would. */
struct bn_job {
    const struct cpu_backend *cb;
    const struct norm_args *a;
    struct tensor *out;                           /* y, dx (NULL: no dx) */
    const struct tensor *x, *dy;
    const struct tensor *y;                       /* backward with a fused ReLU: the forward's y (its mask) */
    struct tensor *mean, *rstd, *running_mean, *running_var; /* forward */
    const struct tensor *smean, *srstd;          /* backward: the saved statistics */
    const float *gamma, *beta;
    double *acc_g, *acc_b;                        /* backward: per-channel sums (c each) */
    int64_t channels;                             /* channels a chunk */
};

/* A channel's statistics and gradient sums are double sums in order: CHAINS channels side by side (FOR_CHAINS),
 * and a chunk holds at least that many channels where the layer has them. */

static int64_t bn_chunk_channels(const struct norm_args *a)
{
    const int64_t per = a->n * a->hw;
    if (per <= 0 || a->c * per < (int64_t)EW_CHUNK)
        return a->c > 0 ? a->c : 1;
    const int64_t by_size = ((int64_t)EW_CHUNK + per - 1) / per;
    return by_size > CHAINS ? by_size : CHAINS;
}

#ifdef HAVE_AVX512_INTRIN
/* The 8 planes from element off0 of data (dtype dt: a tensor's, or bn_dy_planes' staging) as the vector kernels
 * read them: bf16 as it is stored, else as fp32 (load_f32: fp16 widened into buf's planes). Whether they are
 * bf16. */
static bool bn_planes(const void *data, enum dtype dt, size_t off0, int64_t hw, float *buf, const void *p[CHAINS])
{
    const bool bf16 = dt == DT_BF16;
    for (int l = 0; l < CHAINS; l++) {
        size_t off = off0 + (size_t)(l * hw);
        p[l] = bf16 ? (const void *)((const uint16_t *)data + off)
                    : (const void *)load_f32(data, dt, off, (size_t)hw, buf ? buf + l * hw : NULL);
    }
    return bf16;
}

#endif

/* Training statistics of channels ch0 .. ch0 + lanes - 1 (lanes <= CHAINS): each channel's double sum of
 * its values over the images in order, then of its squared deviations from its mean (xbuf: lanes planes,
 * where x is 16-bit). */
HOT_LOOP static void bn_stats(const struct bn_job *j, int64_t ch0, int64_t lanes, float *xbuf, double *s, double *ss)
{
    const struct tensor *x = j->x;
    const int64_t n = j->a->n, c = j->a->c, hw = j->a->hw;
    const double count = (double)(n * hw);
    const float *p[CHAINS];
    double mu[CHAINS];
    for (int64_t l = 0; l < lanes; l++)
        s[l] = ss[l] = 0.0;
    for (int64_t i = 0; i < n; i++) {
#ifdef HAVE_AVX512_INTRIN
        if (cpu_planes8_avx512(lanes)) {
            const void *v[CHAINS];
            bool bf16 = bn_planes(x->data, x->dtype, (size_t)((i * c + ch0) * hw), hw, xbuf, v);
            cpu_planes_sum8_avx512(v, bf16, hw, s);
            continue;
        }
#endif
        for (int64_t l = 0; l < lanes; l++)
            p[l] = load_f32(x->data, x->dtype, (size_t)((i * c + ch0 + l) * hw), (size_t)hw, xbuf ? xbuf + l * hw : NULL);
        FOR_CHAINS(lanes, hw, l, q, s[l] += p[l][q]);
    }
    for (int64_t l = 0; l < lanes; l++)
        mu[l] = s[l] / count;
    for (int64_t i = 0; i < n; i++) {
#ifdef HAVE_AVX512_INTRIN
        if (cpu_planes8_avx512(lanes)) {
            const void *v[CHAINS];
            bool bf16 = bn_planes(x->data, x->dtype, (size_t)((i * c + ch0) * hw), hw, xbuf, v);
            cpu_planes_sumsq8_avx512(v, bf16, hw, mu, ss);
            continue;
        }
#endif
        for (int64_t l = 0; l < lanes; l++)
            p[l] = load_f32(x->data, x->dtype, (size_t)((i * c + ch0 + l) * hw), (size_t)hw, xbuf ? xbuf + l * hw : NULL);
        FOR_CHAINS(lanes, hw, l, q, double d = p[l][q] - mu[l]; ss[l] += d * d);
    }
}

static int64_t bn_chunks(const struct norm_args *a, int64_t channels)
{
    return (a->c + channels - 1) / channels;
}

#ifdef HAVE_AVX512_INTRIN
/* One plane of the batchnorm's output from a plane of x, both fp32 or both bf16 (bf16): bn_forward_channel's
 * widening, its four fp32 operations in its order (no FMA), the fused ReLU's test (x <= 0 gives +0, a NaN passes)
 * and the rounding of store_f32 (nearest-even, a NaN quieted), in one pass and in registers, where they were up
 * to four passes over an fp32 plane (for bf16 the widening and rounding calls took 4x the arithmetic's time in
 * fashion_cnn's step). The same bits: each lane runs the scalar loop's operations; the last hw % 16 elements run
 * that loop itself. */
__attribute__((target("avx512f,avx512bw"), always_inline)) static inline void
bn_norm_plane_body(void *y, const void *x, bool bf16, int64_t hw, float mu, float rs, float g, float b, bool relu)
{
    const __m512 vmu = _mm512_set1_ps(mu), vrs = _mm512_set1_ps(rs), vg = _mm512_set1_ps(g), vb = _mm512_set1_ps(b);
    int64_t e = 0;
    for (; e + 16 <= hw; e += 16) {
        __m512 t = _mm512_sub_ps(ld16(x, e, bf16), vmu);
        t = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(t, vrs), vg), vb);
        if (relu)
            t = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(t, _mm512_setzero_ps(), _CMP_NLE_UQ), t);
        st16(y, e, t, bf16);
    }
    for (; e < hw; e++) {
        float t = (ld1(x, e, bf16) - mu) * rs * g + b;
        if (relu)
            t = t <= 0.0f ? 0.0f : t;
        st1(y, e, t, bf16);
    }
}

/* bn_norm_plane_body compiled once per dtype: no test of it in the loop. */
__attribute__((target("avx512f,avx512bw"))) static void bn_norm_plane(void *y, const void *x, bool bf16, int64_t hw,
                                                                      float mu, float rs, float g, float b, bool relu)
{
    if (bf16)
        bn_norm_plane_body(y, x, true, hw, mu, rs, g, b, relu);
    else
        bn_norm_plane_body(y, x, false, hw, mu, rs, g, b, relu);
}

/* Whether the fused planes run for these dtypes (all fp32 or all bf16) on this CPU. */
static bool bn_fused_runs(enum dtype a, enum dtype b, enum dtype c)
{
    return a == b && b == c && (a == DT_FP32 || a == DT_BF16) && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw");
}
#endif

/* Channel ch's outputs; in training, from its sums s and ss (bn_stats). */
HOT_LOOP static void bn_forward_channel(const struct bn_job *j, int64_t ch, double s, double ss, float *xbuf,
                                        float *ybuf)
{
    const struct norm_args *a = j->a;
    const struct tensor *x = j->x;
    struct tensor *y = j->out;
    int64_t n = a->n, c = a->c, hw = a->hw;
    float *rm = j->running_mean ? (float *)j->running_mean->data : NULL;
    float *rv = j->running_var ? (float *)j->running_var->data : NULL;
    double count = (double)(n * hw);
    float mu_f, rs_f;
    if (a->training) {
        double mu = s / count;
        double var = ss / count;
        mu_f = (float)mu;
        rs_f = (float)(1.0 / sqrt(var + (double)a->eps));
        /* PyTorch: running = (1 - m) * running + m * batch, with the unbiased variance. One value per
         * channel has no unbiased variance (PyTorch refuses it); the biased one (0) is used. */
        double m = a->momentum, unbiased = count > 1.0 ? ss / (count - 1.0) : var;
        if (rm)
            rm[ch] = (float)((1.0 - m) * rm[ch] + m * mu);
        if (rv)
            rv[ch] = (float)((1.0 - m) * rv[ch] + m * unbiased);
    } else {
        assert(rm && rv);
        mu_f = rm[ch];
        rs_f = (float)(1.0 / sqrt((double)rv[ch] + (double)a->eps));
    }
    if (j->mean)
        ((float *)j->mean->data)[ch] = mu_f;
    if (j->rstd)
        ((float *)j->rstd->data)[ch] = rs_f;
    float gc = j->gamma ? j->gamma[ch] : 1.0f, bc = j->beta ? j->beta[ch] : 0.0f;
#ifdef HAVE_AVX512_INTRIN
    if (bn_fused_runs(x->dtype, y->dtype, y->dtype)) {
        const bool bf16 = x->dtype == DT_BF16;
        for (int64_t i = 0; i < n; i++) {
            const size_t off = (size_t)((i * c + ch) * hw);
            bn_norm_plane(elem_ptr(y->data, y->dtype, off), elem_ptr(x->data, x->dtype, off), bf16, hw, mu_f, rs_f,
                          gc, bc, a->relu);
        }
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) {
        size_t off = (size_t)((i * c + ch) * hw);
        const float *p = load_f32(x->data, x->dtype, off, (size_t)hw, xbuf);
        float *q = out_f32(y->data, y->dtype, off, ybuf);
        for (int64_t e = 0; e < hw; e++)
            q[e] = (p[e] - mu_f) * rs_f * gc + bc;
        /* the fused ReLU in fp32 before the rounding: round(relu(v)) is relu(round(v)) bit for bit (rounding
         * keeps the sign and a NaN; relu_16 gives +0 for either zero and quiets a NaN, as rounding does) */
        if (a->relu)
            cpu_act_apply(ACT_RELU, q, q, (size_t)hw);
        store_f32(y->data, y->dtype, off, (size_t)hw, q);
    }
}

static void bn_forward_chunk(void *arg, int64_t chunk, int worker)
{
    const struct bn_job *j = arg;
    float *xbuf = wscratch(j->cb, worker, WSCR_IN0), *ybuf = wscratch(j->cb, worker, WSCR_TMP0);
    const int64_t c0 = chunk * j->channels, c1 = j->a->c - c0 < j->channels ? j->a->c : c0 + j->channels;
    for (int64_t ch0 = c0; ch0 < c1; ch0 += CHAINS) {
        const int64_t lanes = c1 - ch0 < CHAINS ? c1 - ch0 : CHAINS;
        double s[CHAINS] = { 0.0 }, ss[CHAINS] = { 0.0 };
        if (j->a->training)
            bn_stats(j, ch0, lanes, xbuf, s, ss);
        for (int64_t l = 0; l < lanes; l++)
            bn_forward_channel(j, ch0 + l, s[l], ss[l], xbuf, ybuf);
    }
}

void cpu_batchnorm_forward(struct backend *be, const struct norm_args *a, struct tensor *y,
                                  struct tensor *mean, struct tensor *rstd, struct tensor *running_mean,
                                  struct tensor *running_var, const struct tensor *x, const struct tensor *gamma,
                                  const struct tensor *beta)
{
    struct cpu_backend *cb = cpu_of(be);
    const int64_t hw = a->hw;
    assert((int64_t)x->numel == a->n * a->c * hw && (int64_t)y->numel == a->n * a->c * hw);
    assert(!a->training || (mean && rstd));
    if (!cpu_wscratch_rows(cb) || !wstage_reserve(cb, WSCR_IN0, x, (size_t)(CHAINS * hw)) ||
        !wstage_reserve(cb, WSCR_TMP0, y, (size_t)hw))
        return;
    struct bn_job j = { .cb = cb, .a = a, .out = y, .x = x, .mean = mean, .rstd = rstd,
                        .running_mean = running_mean, .running_var = running_var,
                        .gamma = gamma ? (const float *)gamma->data : NULL,
                        .beta = beta ? (const float *)beta->data : NULL, .channels = bn_chunk_channels(a) };
    parallel_for(cb->pool, bn_chunks(a, j.channels), bn_forward_chunk, &j);
}

/* dy's planes of image i, channels ch0 .. ch0 + lanes - 1, as the backward reads them: dy's own (*off0 their first
 * element in dy), or with a fused ReLU (j->y) the ReLU's input gradient, staged in mbuf (lanes planes of dy's
 * dtype; *off0 0) by the ReLU backward's own loops, so with its bits. */
static const void *bn_dy_planes(const struct bn_job *j, int64_t i, int64_t ch0, int64_t lanes, void *mbuf,
                                size_t *off0)
{
    const struct tensor *dy = j->dy;
    const size_t off = (size_t)((i * j->a->c + ch0) * j->a->hw), count = (size_t)(lanes * j->a->hw);
    uint16_t inf, quiet;
    if (!j->y) {
        *off0 = off;
        return dy->data;
    }
    *off0 = 0;
    if (cpu_half_format(dy->dtype, &inf, &quiet))
        cpu_relu_grad_16(mbuf, (const uint16_t *)dy->data + off, (const uint16_t *)j->y->data + off, count, inf, quiet);
    else
        cpu_act_grad_apply(ACT_RELU, mbuf, (const float *)dy->data + off, (const float *)j->y->data + off, count);
    return mbuf;
}

/* The gradient sums of channels ch0 .. ch0 + lanes - 1 (lanes <= CHAINS) into acc_b and acc_g: each
 * channel's sum of dy and of dy * xhat over the images in order (xbuf, dybuf: lanes planes each, where
 * 16-bit; mbuf: bn_dy_planes'). */
HOT_LOOP static void bn_grad_sums(const struct bn_job *j, int64_t ch0, int64_t lanes, float *xbuf, float *dybuf,
                                  void *mbuf)
{
    const struct tensor *x = j->x, *dy = j->dy;
    const int64_t n = j->a->n, c = j->a->c, hw = j->a->hw;
    const float *xp[CHAINS], *dp[CHAINS];
    float mu[CHAINS], rs[CHAINS];
    double sdy[CHAINS], sdyx[CHAINS];
    for (int64_t l = 0; l < lanes; l++) {
        mu[l] = ((const float *)j->smean->data)[ch0 + l];
        rs[l] = ((const float *)j->srstd->data)[ch0 + l];
        sdy[l] = sdyx[l] = 0.0;
    }
    for (int64_t i = 0; i < n; i++) {
#ifdef HAVE_AVX512_INTRIN
        /* fp32 and bf16 planes are read in place, the ReLU's mask applied as they are read (no staging) */
        if (cpu_planes8_avx512(lanes) && x->dtype == dy->dtype && (dy->dtype == DT_FP32 || dy->dtype == DT_BF16)) {
            const void *xv[CHAINS], *dv[CHAINS], *yv[CHAINS];
            const size_t off = (size_t)((i * c + ch0) * hw);
            bool bf16 = bn_planes(x->data, x->dtype, off, hw, NULL, xv);
            bn_planes(dy->data, dy->dtype, off, hw, NULL, dv);
            if (j->y)
                bn_planes(j->y->data, j->y->dtype, off, hw, NULL, yv);
            cpu_planes_gradsum8_avx512(xv, dv, j->y ? yv : NULL, NULL, bf16, hw, mu, rs, sdy, sdyx);
            continue;
        }
#endif
        size_t doff;
        const void *dsrc = bn_dy_planes(j, i, ch0, lanes, mbuf, &doff);
#ifdef HAVE_AVX512_INTRIN
        if (cpu_planes8_avx512(lanes) && x->dtype == dy->dtype) {
            const void *xv[CHAINS], *dv[CHAINS];
            bool bf16 = bn_planes(x->data, x->dtype, (size_t)((i * c + ch0) * hw), hw, xbuf, xv);
            bn_planes(dsrc, dy->dtype, doff, hw, dybuf, dv);
            cpu_planes_gradsum8_avx512(xv, dv, NULL, NULL, bf16, hw, mu, rs, sdy, sdyx);
            continue;
        }
#endif
        for (int64_t l = 0; l < lanes; l++) {
            size_t off = (size_t)((i * c + ch0 + l) * hw);
            xp[l] = load_f32(x->data, x->dtype, off, (size_t)hw, xbuf ? xbuf + l * hw : NULL);
            dp[l] = load_f32(dsrc, dy->dtype, doff + (size_t)(l * hw), (size_t)hw, dybuf ? dybuf + l * hw : NULL);
        }
        FOR_CHAINS(lanes, hw, l, e, sdy[l] += dp[l][e]; sdyx[l] += (double)dp[l][e] * ((xp[l][e] - mu[l]) * rs[l]));
    }
    for (int64_t l = 0; l < lanes; l++) {
        j->acc_g[ch0 + l] = sdyx[l];
        j->acc_b[ch0 + l] = sdy[l];
    }
}

#ifdef HAVE_AVX512_INTRIN
/* One plane of batchnorm's dx from planes of dy, x and (a fused ReLU; else NULL) y, all fp32 or all bf16 (bf16):
 * bn_backward_channel's loop in one pass and in registers — dy masked as the ReLU's backward masks it (+0 where
 * y <= 0; a NaN dy is quieted by the first multiply, as the staged copy quieted it), widened, the formula's fp32
 * operations in its order (no FMA), rounded as store_f32 rounds — where it was up to five passes over staged planes
 * (bn_dy_planes' mask, two widenings, the formula, the rounding). The same bits; the last hw % 16 elements run the
 * same operations one by one. */
__attribute__((target("avx512f,avx512bw"), always_inline)) static inline void
bn_dx_plane_body(void *dx, const void *dy, const void *x, const void *y, bool bf16, int64_t hw, bool training, float mu,
                 float rs, float gc, float m1, float m2)
{
    const __m512 vmu = _mm512_set1_ps(mu), vrs = _mm512_set1_ps(rs), vg = _mm512_set1_ps(gc);
    const __m512 vm1 = _mm512_set1_ps(m1), vm2 = _mm512_set1_ps(m2);
    int64_t e = 0;
    for (; e + 16 <= hw; e += 16) {
        __m512 d = ld16(dy, e, bf16);
        if (y)
            d = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(ld16(y, e, bf16), _mm512_setzero_ps(), _CMP_NLE_UQ), d);
        __m512 q;
        if (training) {
            const __m512 xh = _mm512_mul_ps(_mm512_mul_ps(_mm512_sub_ps(ld16(x, e, bf16), vmu), vrs), vm2);
            q = _mm512_mul_ps(vrs, _mm512_sub_ps(_mm512_sub_ps(_mm512_mul_ps(d, vg), vm1), xh));
        } else {
            q = _mm512_mul_ps(_mm512_mul_ps(d, vg), vrs);
        }
        st16(dx, e, q, bf16);
    }
    for (; e < hw; e++) {
        float d = ld1(dy, e, bf16);
        if (y && ld1(y, e, bf16) <= 0.0f)
            d = 0.0f;
        const float q = training ? rs * (d * gc - m1 - (ld1(x, e, bf16) - mu) * rs * m2) : d * gc * rs;
        st1(dx, e, q, bf16);
    }
}

/* bn_dx_plane_body compiled once per dtype. */
__attribute__((target("avx512f,avx512bw"))) static void bn_dx_plane(void *dx, const void *dy, const void *x,
                                                                    const void *y, bool bf16, int64_t hw,
                                                                    bool training, float mu, float rs, float gc,
                                                                    float m1, float m2)
{
    if (bf16)
        bn_dx_plane_body(dx, dy, x, y, true, hw, training, mu, rs, gc, m1, m2);
    else
        bn_dx_plane_body(dx, dy, x, y, false, hw, training, mu, rs, gc, m1, m2);
}
#endif

/* Channel ch's dx from its sums (bn_grad_sums). */
HOT_LOOP static void bn_backward_channel(const struct bn_job *j, int64_t ch, float *xbuf, float *dybuf, float *dxbuf,
                                         void *mbuf)
{
    const struct norm_args *a = j->a;
    const struct tensor *x = j->x, *dy = j->dy;
    struct tensor *dx = j->out;
    int64_t n = a->n, c = a->c, hw = a->hw;
    double count = (double)(n * hw);
    float mu = ((const float *)j->smean->data)[ch], rs = ((const float *)j->srstd->data)[ch];
    float gc = j->gamma ? j->gamma[ch] : 1.0f;
    double sdyx = j->acc_g[ch], sdy = j->acc_b[ch];
    if (!dx)
        return;
    /* mean(dxhat) = gamma * sdy / count, mean(dxhat * xhat) = gamma * sdyx / count */
    float m1 = (float)(gc * sdy / count), m2 = (float)(gc * sdyx / count);
#ifdef HAVE_AVX512_INTRIN
    if (bn_fused_runs(dx->dtype, dy->dtype, x->dtype)) {
        const bool bf16 = x->dtype == DT_BF16;
        for (int64_t i = 0; i < n; i++) {
            const size_t off = (size_t)((i * c + ch) * hw);
            bn_dx_plane(elem_ptr(dx->data, dx->dtype, off), elem_ptr(dy->data, dy->dtype, off),
                        elem_ptr(x->data, x->dtype, off), j->y ? elem_ptr(j->y->data, j->y->dtype, off) : NULL, bf16,
                        hw, a->training, mu, rs, gc, m1, m2);
        }
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) {
        size_t off = (size_t)((i * c + ch) * hw), doff;
        const void *dsrc = bn_dy_planes(j, i, ch, 1, mbuf, &doff);
        const float *dp = load_f32(dsrc, dy->dtype, doff, (size_t)hw, dybuf);
        float *q = out_f32(dx->data, dx->dtype, off, dxbuf);
        if (a->training) {
            const float *xp = load_f32(x->data, x->dtype, off, (size_t)hw, xbuf);
            for (int64_t e = 0; e < hw; e++)
                q[e] = rs * (dp[e] * gc - m1 - (xp[e] - mu) * rs * m2);
        } else {
            for (int64_t e = 0; e < hw; e++)
                q[e] = dp[e] * gc * rs;
        }
        store_f32(dx->data, dx->dtype, off, (size_t)hw, q);
    }
}

static void bn_backward_chunk(void *arg, int64_t chunk, int worker)
{
    const struct bn_job *j = arg;
    float *xbuf = wscratch(j->cb, worker, WSCR_IN0), *dybuf = wscratch(j->cb, worker, WSCR_IN1);
    float *dxbuf = wscratch(j->cb, worker, WSCR_TMP0);
    void *mbuf = wscratch(j->cb, worker, WSCR_IN2);
    const int64_t c0 = chunk * j->channels, c1 = j->a->c - c0 < j->channels ? j->a->c : c0 + j->channels;
    for (int64_t ch0 = c0; ch0 < c1; ch0 += CHAINS) {
        const int64_t lanes = c1 - ch0 < CHAINS ? c1 - ch0 : CHAINS;
        bn_grad_sums(j, ch0, lanes, xbuf, dybuf, mbuf);
        for (int64_t l = 0; l < lanes; l++)
            bn_backward_channel(j, ch0 + l, xbuf, dybuf, dxbuf, mbuf);
    }
}

/* Training mode: the batch statistics depend on x, so dx = rstd * (dxhat - mean(dxhat) - xhat *
 * mean(dxhat * xhat)) over the channel. Eval mode (a->training false, mean/rstd from the running
 * statistics): they are constants, dx = dy * gamma * rstd. With a fused ReLU (a->relu) dy is masked by y
 * plane by plane as it is read (bn_dy_planes), never as a whole tensor. */
void cpu_batchnorm_backward(struct backend *be, const struct norm_args *a, struct tensor *dx,
                                   struct tensor *dgamma, struct tensor *dbeta, const struct tensor *dy,
                                   const struct tensor *x, const struct tensor *y, const struct tensor *mean,
                                   const struct tensor *rstd, const struct tensor *gamma, float beta_acc)
{
    struct cpu_backend *cb = cpu_of(be);
    const int64_t c = a->c, hw = a->hw;
    assert((int64_t)x->numel == a->n * c * hw && (int64_t)dy->numel == a->n * c * hw);
    assert(!a->relu || (y && y->dtype == dy->dtype && y->numel == dy->numel &&
                        (dy->dtype == DT_FP32 || dy->dtype == DT_BF16 || dy->dtype == DT_FP16)));
    double *acc = scratch_get(cb, SCR_ACC0, 2 * (size_t)c * sizeof(double));
    if (!acc || !cpu_wscratch_rows(cb) || !wstage_reserve(cb, WSCR_IN0, x, (size_t)(CHAINS * hw)) ||
        !wstage_reserve(cb, WSCR_IN1, dy, (size_t)(CHAINS * hw)) || !wstage_reserve(cb, WSCR_TMP0, dx, (size_t)hw) ||
        (a->relu && !cpu_wscratch_reserve(cb, WSCR_IN2, (size_t)(CHAINS * hw) * sizeof(float))))
        return;
    struct bn_job j = { .cb = cb, .a = a, .out = dx, .x = x, .dy = dy, .y = a->relu ? y : NULL, .smean = mean,
                        .srstd = rstd,
                        .gamma = gamma ? (const float *)gamma->data : NULL, .acc_g = acc, .acc_b = acc + c,
                        .channels = bn_chunk_channels(a) };
    parallel_for(cb->pool, bn_chunks(a, j.channels), bn_backward_chunk, &j);
    if (dgamma)
        store_acc((float *)dgamma->data, j.acc_g, (size_t)c, beta_acc);
    if (dbeta)
        store_acc((float *)dbeta->data, j.acc_b, (size_t)c, beta_acc);
}
