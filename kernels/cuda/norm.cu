/*
 * norm.cu — layernorm and batchnorm, forward and backward, with FP32 statistics (sums in double, as in
 * the CPU reference, so the GPU agrees with it to the last few bits of fp32).
 *
 * layernorm: one block per row; mean, then the centred sum of squares (two passes over the row),
 * then y. Backward: one block per row for dx; dgamma/dbeta are column sums over rows, done in two
 * passes (double partials per chunk of rows, then a fixed-order sum) — deterministic, no atomics.
 * batchnorm (NCHW, per-channel statistics over n*hw) and the conv bias gradient (cuda_channel_sums):
 * per-channel sums spread over many blocks — a channel's n*hw elements in chunks of kChanChunk, one
 * block per (channel, chunk) writing a double partial, then one block per channel adding its
 * partials in a fixed order — so a layer with 32 channels fills the GPU instead of 32 SMs. The order
 * of every addition depends on the shape alone: deterministic run to run, no atomics. Forward
 * (training): sum of x -> mean (double) -> centred sum of squares -> var, rstd, running statistics;
 * then y element by element. Backward: sums of dy and dy*xhat -> dgamma, dbeta (beta accumulation)
 * and dx's two per-channel terms; then dx element by element. Running statistics follow PyTorch
 * (unbiased variance).
 * Buffers: x, y, dy, dx any dtype; gamma, beta, mean, rstd, running stats, dgamma, dbeta, db fp32;
 * scratch: CSCR_PARTIAL/PARTIAL2 (c, chunks) double partials, CSCR_CHANNEL_STATS (c) channel_stat.
 */
#include "backend_cuda_internal.h"

#include <climits> /* INT_MAX */

namespace {

constexpr unsigned kRowThreads = 256;
constexpr int64_t kLnChunk = 128; /* rows per partial of the dgamma/dbeta column sums */
constexpr int64_t kChanChunk = 4096; /* elements of one channel per partial of the channel sums */
constexpr unsigned kChanThreads = 256; /* block size of the channel sums: part of their fixed order */

/* With `sum` (the fused residual add, norm_args.addend): each thread first writes its elements of the row's
 * sum = x + addend, rounded to sum's dtype as the add kernel rounds it, and the layernorm then reads sum: every
 * element it reads is one this thread wrote, so no barrier is needed before. */
__global__ void layernorm_forward_kernel(void *y, int y_dt, float *mean, float *rstd, const void *x, int x_dt,
                                         const float *gamma, const float *beta, int64_t cols, float eps,
                                         void *sum, int sum_dt, const void *addend, int addend_dt)
{
    __shared__ double red[32];
    size_t base = (size_t)blockIdx.x * (size_t)cols;
    if (sum) {
        for (int64_t j = threadIdx.x; j < cols; j += blockDim.x)
            store_elem(sum, sum_dt, base + j, load_elem(x, x_dt, base + j) + load_elem(addend, addend_dt, base + j));
        x = sum;
        x_dt = sum_dt;
    }
    double s = 0.0;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x)
        s += load_elem(x, x_dt, base + j);
    double mu = block_sum(s, red) / (double)cols;
    double ss = 0.0;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
        double d = load_elem(x, x_dt, base + j) - mu;
        ss += d * d;
    }
    ss = block_sum(ss, red);
    float mu_f = (float)mu;
    float rs_f = (float)(1.0 / sqrt(ss / (double)cols + (double)eps));
    if (threadIdx.x == 0) {
        mean[blockIdx.x] = mu_f;
        rstd[blockIdx.x] = rs_f;
    }
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
        float v = (load_elem(x, x_dt, base + j) - mu_f) * rs_f;
        store_elem(y, y_dt, base + j, v * (gamma ? gamma[j] : 1.0f) + (beta ? beta[j] : 0.0f));
    }
}

/* With `dsum` (norm_args.dsum): dx = dsum + the layernorm's dx rounded to dx's dtype, rounded once more. */
__global__ void layernorm_backward_dx_kernel(void *dx, int dx_dt, const void *dy, int dy_dt, const void *x, int x_dt,
                                             const float *mean, const float *rstd, const float *gamma, int64_t cols,
                                             const void *dsum, int dsum_dt)
{
    __shared__ double red[32];
    size_t base = (size_t)blockIdx.x * (size_t)cols;
    float mu = mean[blockIdx.x], rs = rstd[blockIdx.x];
    double s1 = 0.0, s2 = 0.0;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
        float xhat = (load_elem(x, x_dt, base + j) - mu) * rs;
        float dxhat = load_elem(dy, dy_dt, base + j) * (gamma ? gamma[j] : 1.0f);
        s1 += dxhat;
        s2 += (double)dxhat * xhat;
    }
    s1 = block_sum(s1, red);
    s2 = block_sum(s2, red);
    float m1 = (float)(s1 / (double)cols), m2 = (float)(s2 / (double)cols);
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
        float xhat = (load_elem(x, x_dt, base + j) - mu) * rs;
        float dxhat = load_elem(dy, dy_dt, base + j) * (gamma ? gamma[j] : 1.0f);
        float v = rs * (dxhat - m1 - xhat * m2);
        if (dsum)
            v = round_to(v, dx_dt) + load_elem(dsum, dsum_dt, base + j);
        store_elem(dx, dx_dt, base + j, v);
    }
}

/* partial[chunk][j] = (sum dy * xhat, sum dy) over the chunk's rows, double */
__global__ void layernorm_param_partials_kernel(double *pg, double *pb, const void *dy, int dy_dt, const void *x,
                                                int x_dt, const float *mean, const float *rstd, int64_t rows,
                                                int64_t cols, int64_t chunks)
{
    int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (j >= cols)
        return;
    for (int64_t chunk = blockIdx.y; chunk < chunks; chunk += gridDim.y) { /* gridDim.y is at most 65535 */
        int64_t r0 = chunk * kLnChunk, r1 = r0 + kLnChunk < rows ? r0 + kLnChunk : rows;
        double sg = 0.0, sb = 0.0;
        for (int64_t r = r0; r < r1; r++) {
            size_t at = (size_t)(r * cols + j);
            float xhat = (load_elem(x, x_dt, at) - mean[r]) * rstd[r];
            float g = load_elem(dy, dy_dt, at);
            sg += (double)g * xhat;
            sb += g;
        }
        pg[chunk * cols + j] = sg;
        pb[chunk * cols + j] = sb;
    }
}

__global__ void param_finish_kernel(float *dgamma, float *dbeta, const double *pg, const double *pb, int64_t chunks,
                                    int64_t cols, float beta_acc)
{
    int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (j >= cols)
        return;
    double sg = 0.0, sb = 0.0;
    for (int64_t c = 0; c < chunks; c++) {
        sg += pg[c * cols + j];
        sb += pb[c * cols + j];
    }
    if (dgamma)
        dgamma[j] = beta_acc == 0.0f ? (float)sg : beta_acc * dgamma[j] + (float)sg;
    if (dbeta)
        dbeta[j] = beta_acc == 0.0f ? (float)sb : beta_acc * dbeta[j] + (float)sb;
}

/* ---- per-channel sums (batchnorm, conv bias): many blocks per channel, two passes ----
 * A channel's n*hw elements (index i: sample i / hw, position i % hw) are cut into chunks of
 * kChanChunk; one block sums one (channel, chunk) into a double partial, and a finish kernel (one
 * block per channel) sums a channel's partials in a fixed order. Chunk size and block size are
 * constants, so the order of every addition depends on the shape alone: results reproduce run to run
 * and device to device, with no atomics. */

enum chan_sum_kind {
    CSUM_X,         /* p1: sum of x */
    CSUM_CENTRED,   /* p1: sum of (x - mean_d[ch])^2, the mean in double */
    CSUM_DY_XHAT,   /* p1: sum of dy, p2: sum of dy * xhat with xhat = (x - mean[ch]) * rstd[ch] in fp32 */
};

/* batchnorm's per-channel values between the passes (scratch CSCR_CHANNEL_STATS) */
struct channel_stat {
    double mean; /* forward: the batch mean in double (the running mean and the centred pass use it) */
    float a, b;  /* forward: mean and rstd as fp32 (what y uses); backward: m1, m2 of dx */
};

__device__ __forceinline__ size_t nchw_at(int64_t i, int64_t ch, int64_t c, int64_t hw)
{
    return (size_t)(((i / hw) * c + ch) * hw + i % hw);
}

/* p1/p2[ch * chunks + chunk] = the kind's sums over the chunk of channel ch, double */
template <int Kind>
__global__ void channel_partials_kernel(double *p1, double *p2, const void *a, int a_dt, const void *x, int x_dt,
                                        const struct channel_stat *stat, const float *mean, const float *rstd,
                                        int64_t n, int64_t c, int64_t hw, int64_t chunks)
{
    __shared__ double red[32];
    int64_t count = n * hw;
    for (int64_t ch = blockIdx.y; ch < c; ch += gridDim.y) /* gridDim.y is at most 65535 */
        for (int64_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
            int64_t i0 = chunk * kChanChunk, i1 = i0 + kChanChunk < count ? i0 + kChanChunk : count;
            double s1 = 0.0, s2 = 0.0;
            if (Kind == CSUM_X) {
                for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x)
                    s1 += load_elem(a, a_dt, nchw_at(i, ch, c, hw));
            } else if (Kind == CSUM_CENTRED) {
                double mu = stat[ch].mean;
                for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
                    double d = load_elem(a, a_dt, nchw_at(i, ch, c, hw)) - mu;
                    s1 += d * d;
                }
            } else {
                float mu = mean[ch], rs = rstd[ch];
                for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
                    size_t at = nchw_at(i, ch, c, hw);
                    float g = load_elem(a, a_dt, at);
                    s1 += g;
                    s2 += (double)g * ((load_elem(x, x_dt, at) - mu) * rs);
                }
            }
            s1 = block_sum(s1, red);
            if (Kind == CSUM_DY_XHAT)
                s2 = block_sum(s2, red);
            if (threadIdx.x == 0) {
                p1[ch * chunks + chunk] = s1;
                if (Kind == CSUM_DY_XHAT)
                    p2[ch * chunks + chunk] = s2;
            }
        }
}

/* The sum of a channel's `chunks` partials, in a fixed order (the whole block returns it). */
__device__ double partials_sum(const double *p, int64_t chunks, double *red)
{
    double s = 0.0;
    for (int64_t k = threadIdx.x; k < chunks; k += blockDim.x)
        s += p[k];
    return block_sum(s, red);
}

/* One block per channel: db[ch] = beta * db[ch] + sum (the conv bias gradient). */
__global__ void channel_sums_finish_kernel(float *db, const double *p1, int64_t chunks, float beta)
{
    __shared__ double red[32];
    int64_t ch = blockIdx.x;
    double s = partials_sum(p1 + ch * chunks, chunks, red);
    if (threadIdx.x == 0)
        db[ch] = beta == 0.0f ? (float)s : beta * db[ch] + (float)s;
}

/* One block per channel: the batch mean, in double. */
__global__ void batchnorm_mean_kernel(struct channel_stat *stat, const double *p1, int64_t chunks, double count)
{
    __shared__ double red[32];
    int64_t ch = blockIdx.x;
    double s = partials_sum(p1 + ch * chunks, chunks, red);
    if (threadIdx.x == 0)
        stat[ch].mean = s / count;
}

/* Channel ch's mean and rstd, for the apply kernel (stat) and, where asked for, the saved statistics. */
__device__ static void put_channel_stat(struct channel_stat *stat, float *mean, float *rstd, int64_t ch, float mu_f,
                                        float rs_f)
{
    stat[ch].a = mu_f;
    stat[ch].b = rs_f;
    if (mean)
        mean[ch] = mu_f;
    if (rstd)
        rstd[ch] = rs_f;
}

/* One block per channel: variance, rstd, the running statistics (PyTorch: unbiased variance). */
__global__ void batchnorm_var_kernel(struct channel_stat *stat, float *mean, float *rstd, float *rm, float *rv,
                                     const double *p1, int64_t chunks, double count, float eps, float momentum)
{
    __shared__ double red[32];
    int64_t ch = blockIdx.x;
    double ss = partials_sum(p1 + ch * chunks, chunks, red);
    if (threadIdx.x != 0)
        return;
    double mu = stat[ch].mean, var = ss / count;
    float mu_f = (float)mu, rs_f = (float)(1.0 / sqrt(var + (double)eps));
    double m = momentum, unbiased = count > 1.0 ? ss / (count - 1.0) : var;
    if (rm)
        rm[ch] = (float)((1.0 - m) * rm[ch] + m * mu);
    if (rv)
        rv[ch] = (float)((1.0 - m) * rv[ch] + m * unbiased);
    put_channel_stat(stat, mean, rstd, ch, mu_f, rs_f);
}

/* Eval mode: the running statistics as the channel's mean and rstd. One thread per channel. */
__global__ void batchnorm_eval_stats_kernel(struct channel_stat *stat, float *mean, float *rstd, const float *rm,
                                            const float *rv, int64_t c, float eps)
{
    int64_t ch = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (ch >= c)
        return;
    float mu_f = rm[ch], rs_f = (float)(1.0 / sqrt((double)rv[ch] + (double)eps));
    put_channel_stat(stat, mean, rstd, ch, mu_f, rs_f);
}

/* y = (x - mean) * rstd * gamma + beta, every element (grid-stride); relu: the fused ReLU (norm_args.relu), in
 * fp32 before the rounding, as the CPU backend applies it. */
__global__ void batchnorm_apply_kernel(void *y, int y_dt, const void *x, int x_dt, const struct channel_stat *stat,
                                       const float *gamma, const float *beta, int64_t c, int64_t hw, size_t total,
                                       bool relu)
{
    for (size_t at = (size_t)blockIdx.x * blockDim.x + threadIdx.x; at < total; at += (size_t)gridDim.x * blockDim.x) {
        int64_t ch = (int64_t)((at / (size_t)hw) % (size_t)c);
        float mu = stat[ch].a, rs = stat[ch].b;
        float gc = gamma ? gamma[ch] : 1.0f, bc = beta ? beta[ch] : 0.0f;
        float v = (load_elem(x, x_dt, at) - mu) * rs * gc + bc;
        store_elem(y, y_dt, at, relu && v <= 0.0f ? 0.0f : v);
    }
}

/* One block per channel: dgamma, dbeta (beta accumulation) and dx's m1, m2. */
__global__ void batchnorm_backward_finish_kernel(struct channel_stat *stat, float *dgamma, float *dbeta,
                                                 const double *p1, const double *p2, const float *gamma,
                                                 int64_t chunks, double count, float beta_acc)
{
    __shared__ double red[32];
    int64_t ch = blockIdx.x;
    double sdy = partials_sum(p1 + ch * chunks, chunks, red);
    double sdyx = partials_sum(p2 + ch * chunks, chunks, red);
    if (threadIdx.x != 0)
        return;
    float gc = gamma ? gamma[ch] : 1.0f;
    if (dgamma)
        dgamma[ch] = beta_acc == 0.0f ? (float)sdyx : beta_acc * dgamma[ch] + (float)sdyx;
    if (dbeta)
        dbeta[ch] = beta_acc == 0.0f ? (float)sdy : beta_acc * dbeta[ch] + (float)sdy;
    stat[ch].a = (float)(gc * sdy / count);
    stat[ch].b = (float)(gc * sdyx / count);
}

__global__ void batchnorm_backward_dx_kernel(void *dx, int dx_dt, const void *dy, int dy_dt, const void *x, int x_dt,
                                             const float *mean, const float *rstd, const float *gamma,
                                             const struct channel_stat *stat, int64_t c, int64_t hw, size_t total,
                                             bool training)
{
    for (size_t at = (size_t)blockIdx.x * blockDim.x + threadIdx.x; at < total; at += (size_t)gridDim.x * blockDim.x) {
        int64_t ch = (int64_t)((at / (size_t)hw) % (size_t)c);
        float mu = mean[ch], rs = rstd[ch], gc = gamma ? gamma[ch] : 1.0f;
        float g = load_elem(dy, dy_dt, at);
        float v = training ? rs * (g * gc - stat[ch].a - (load_elem(x, x_dt, at) - mu) * rs * stat[ch].b)
                           : g * gc * rs;
        store_elem(dx, dx_dt, at, v);
    }
}

const float *f32_or_null(const struct tensor *t)
{
    return t ? static_cast<const float *>(t->data) : NULL;
}

float *f32_or_null(struct tensor *t)
{
    return t ? static_cast<float *>(t->data) : NULL;
}

} // namespace

void cuda_layernorm_forward(struct backend *be, const struct norm_args *a, struct tensor *y, struct tensor *mean,
                            struct tensor *rstd, const struct tensor *x, const struct tensor *gamma,
                            const struct tensor *beta)
{
    struct cuda_backend *cb = cuda_of(be);
    if (a->rows <= 0)
        return;
    layernorm_forward_kernel<<<(unsigned)a->rows, kRowThreads, 0, cb->stream>>>(
        y->data, y->dtype, f32_or_null(mean), f32_or_null(rstd), x->data, x->dtype, f32_or_null(gamma),
        f32_or_null(beta), a->cols, a->eps, a->addend ? a->sum->data : NULL, a->addend ? a->sum->dtype : 0,
        a->addend ? a->addend->data : NULL, a->addend ? a->addend->dtype : 0);
    CB_LAUNCHED(cb, "layernorm_forward_kernel");
}

void cuda_layernorm_backward(struct backend *be, const struct norm_args *a, struct tensor *dx, struct tensor *dgamma,
                             struct tensor *dbeta, const struct tensor *dy, const struct tensor *x,
                             const struct tensor *mean, const struct tensor *rstd, const struct tensor *gamma,
                             float beta_acc)
{
    struct cuda_backend *cb = cuda_of(be);
    int64_t rows = a->rows, cols = a->cols;
    if (dx && rows > 0) {
        layernorm_backward_dx_kernel<<<(unsigned)rows, kRowThreads, 0, cb->stream>>>(
            dx->data, dx->dtype, dy->data, dy->dtype, x->data, x->dtype, f32_or_null(mean), f32_or_null(rstd),
            f32_or_null(gamma), cols, a->dsum ? a->dsum->data : NULL, a->dsum ? a->dsum->dtype : 0);
        CB_LAUNCHED(cb, "layernorm_backward_dx_kernel");
    }
    if ((!dgamma && !dbeta) || cols <= 0)
        return;
    int64_t chunks = rows > 0 ? (rows + kLnChunk - 1) / kLnChunk : 0;
    size_t per = (size_t)((chunks ? chunks : 1) * cols);
    double *pg = static_cast<double *>(cuda_scratch(cb, CSCR_PARTIAL, per * sizeof(double)));
    double *pb = static_cast<double *>(cuda_scratch(cb, CSCR_PARTIAL2, per * sizeof(double)));
    if (!pg || !pb)
        return;
    unsigned gx = (unsigned)((cols + 127) / 128);
    if (chunks > 0) {
        unsigned gy = (unsigned)(chunks < 65535 ? chunks : 65535);
        layernorm_param_partials_kernel<<<dim3(gx, gy), 128, 0, cb->stream>>>(
            pg, pb, dy->data, dy->dtype, x->data, x->dtype, f32_or_null(mean), f32_or_null(rstd), rows, cols, chunks);
        CB_LAUNCHED(cb, "layernorm_param_partials_kernel");
    }
    param_finish_kernel<<<gx, 128, 0, cb->stream>>>(f32_or_null(dgamma), f32_or_null(dbeta), pg, pb, chunks, cols,
                                                    beta_acc);
    CB_LAUNCHED(cb, "param_finish_kernel");
}

/* ---- channel sums: host side ---- */

/* The partials of one channel sum: a channel's n*hw elements in chunks of kChanChunk. */
struct chan_pass {
    int64_t n, c, hw, chunks;
    double *p1, *p2;            /* (c, chunks) double each: CSCR_PARTIAL, CSCR_PARTIAL2 */
    struct channel_stat *stat;  /* (c): CSCR_CHANNEL_STATS */
};

/* Scratch for a pass over (n, c, hw); false (status set) when device memory ran out. */
static bool chan_pass_begin(struct cuda_backend *cb, struct chan_pass *ps, int64_t n, int64_t c, int64_t hw,
                            bool two_sums, bool stats)
{
    int64_t count = n * hw;
    ps->n = n;
    ps->c = c;
    ps->hw = hw;
    ps->chunks = count > 0 ? (count + kChanChunk - 1) / kChanChunk : 0;
    size_t per = (size_t)(c * (ps->chunks ? ps->chunks : 1));
    ps->p1 = static_cast<double *>(cuda_scratch(cb, CSCR_PARTIAL, per * sizeof(double)));
    ps->p2 = two_sums ? static_cast<double *>(cuda_scratch(cb, CSCR_PARTIAL2, per * sizeof(double))) : NULL;
    ps->stat = stats ? static_cast<struct channel_stat *>(
                           cuda_scratch(cb, CSCR_CHANNEL_STATS, (size_t)c * sizeof(struct channel_stat)))
                     : NULL;
    return ps->p1 && (!two_sums || ps->p2) && (!stats || ps->stat);
}

/* Queue the partials of one kind (no launch when a channel is empty: the finish then sums nothing). */
template <int Kind>
static void chan_partials(struct cuda_backend *cb, const struct chan_pass *ps, const void *a, int a_dt,
                          const void *x, int x_dt, const float *mean, const float *rstd)
{
    if (ps->chunks <= 0 || ps->c <= 0)
        return;
    unsigned gx = (unsigned)(ps->chunks < INT_MAX ? ps->chunks : INT_MAX);
    unsigned gy = (unsigned)(ps->c < 65535 ? ps->c : 65535);
    channel_partials_kernel<Kind><<<dim3(gx, gy), kChanThreads, 0, cb->stream>>>(
        ps->p1, ps->p2, a, a_dt, x, x_dt, ps->stat, mean, rstd, ps->n, ps->c, ps->hw, ps->chunks);
    CB_LAUNCHED(cb, "channel_partials_kernel");
}

void cuda_channel_sums(struct cuda_backend *cb, float *db, const void *dy, enum dtype dt, int64_t N, int64_t C,
                       int64_t HW, float beta)
{
    struct chan_pass ps;
    if (C <= 0 || !chan_pass_begin(cb, &ps, N, C, HW, false, false))
        return;
    chan_partials<CSUM_X>(cb, &ps, dy, dt, NULL, DT_FP32, NULL, NULL);
    channel_sums_finish_kernel<<<(unsigned)C, kChanThreads, 0, cb->stream>>>(db, ps.p1, ps.chunks, beta);
    CB_LAUNCHED(cb, "channel_sums_finish_kernel");
}

void cuda_batchnorm_forward(struct backend *be, const struct norm_args *a, struct tensor *y, struct tensor *mean,
                            struct tensor *rstd, struct tensor *running_mean, struct tensor *running_var,
                            const struct tensor *x, const struct tensor *gamma, const struct tensor *beta)
{
    struct cuda_backend *cb = cuda_of(be);
    if (a->c <= 0)
        return;
    if (!a->training && (!running_mean || !running_var)) {
        cuda_record(cb, "this is a bug in the caller", "batchnorm eval mode needs the running statistics");
        return;
    }
    struct chan_pass ps;
    if (!chan_pass_begin(cb, &ps, a->n, a->c, a->hw, false, true))
        return;
    unsigned cblocks = (unsigned)a->c;
    double count = (double)(a->n * a->hw);
    if (a->training) {
        chan_partials<CSUM_X>(cb, &ps, x->data, x->dtype, NULL, DT_FP32, NULL, NULL);
        batchnorm_mean_kernel<<<cblocks, kChanThreads, 0, cb->stream>>>(ps.stat, ps.p1, ps.chunks, count);
        CB_LAUNCHED(cb, "batchnorm_mean_kernel");
        chan_partials<CSUM_CENTRED>(cb, &ps, x->data, x->dtype, NULL, DT_FP32, NULL, NULL);
        batchnorm_var_kernel<<<cblocks, kChanThreads, 0, cb->stream>>>(
            ps.stat, f32_or_null(mean), f32_or_null(rstd), f32_or_null(running_mean), f32_or_null(running_var), ps.p1,
            ps.chunks, count, a->eps, a->momentum);
        CB_LAUNCHED(cb, "batchnorm_var_kernel");
    } else {
        batchnorm_eval_stats_kernel<<<(unsigned)((a->c + 127) / 128), 128, 0, cb->stream>>>(
            ps.stat, f32_or_null(mean), f32_or_null(rstd), f32_or_null(running_mean), f32_or_null(running_var), a->c,
            a->eps);
        CB_LAUNCHED(cb, "batchnorm_eval_stats_kernel");
    }
    size_t total = (size_t)(a->n * a->c * a->hw);
    if (!total)
        return;
    batchnorm_apply_kernel<<<grid_for(total), kThreads, 0, cb->stream>>>(
        y->data, y->dtype, x->data, x->dtype, ps.stat, f32_or_null(gamma), f32_or_null(beta), a->c, a->hw, total,
        a->relu);
    CB_LAUNCHED(cb, "batchnorm_apply_kernel");
}

/* With a fused ReLU (a->relu) the ReLU's backward runs first, act_backward's own kernel into scratch (y, the
 * forward's output, is the mask: y <= 0 exactly where the ReLU's input was), and batchnorm's backward reads that:
 * the passes the CPU backend saves are not saved here, the op is the two ops' composition. */
void cuda_batchnorm_backward(struct backend *be, const struct norm_args *a, struct tensor *dx, struct tensor *dgamma,
                             struct tensor *dbeta, const struct tensor *dy, const struct tensor *x,
                             const struct tensor *y, const struct tensor *mean, const struct tensor *rstd,
                             const struct tensor *gamma, float beta_acc)
{
    struct cuda_backend *cb = cuda_of(be);
    if (a->c <= 0)
        return;
    struct tensor masked;
    if (a->relu) {
        if (!y || y->dtype != dy->dtype || y->numel != dy->numel) {
            cuda_record(cb, "this is a bug in the caller", "batchnorm with a fused ReLU needs the forward's y");
            return;
        }
        masked = *dy;
        masked.data = cuda_scratch(cb, CSCR_BN_RELU_DY, dy->numel * dtype_size(dy->dtype));
        if (!masked.data)
            return;
        cuda_act_backward(be, ACT_RELU, &masked, dy, y);
        dy = &masked;
    }
    struct chan_pass ps;
    if (!chan_pass_begin(cb, &ps, a->n, a->c, a->hw, true, true))
        return;
    chan_partials<CSUM_DY_XHAT>(cb, &ps, dy->data, dy->dtype, x->data, x->dtype, f32_or_null(mean),
                                f32_or_null(rstd));
    batchnorm_backward_finish_kernel<<<(unsigned)a->c, kChanThreads, 0, cb->stream>>>(
        ps.stat, f32_or_null(dgamma), f32_or_null(dbeta), ps.p1, ps.p2, f32_or_null(gamma), ps.chunks,
        (double)(a->n * a->hw), beta_acc);
    CB_LAUNCHED(cb, "batchnorm_backward_finish_kernel");
    size_t total = (size_t)(a->n * a->c * a->hw);
    if (!dx || !total)
        return;
    batchnorm_backward_dx_kernel<<<grid_for(total), kThreads, 0, cb->stream>>>(
        dx->data, dx->dtype, dy->data, dy->dtype, x->data, x->dtype, f32_or_null(mean), f32_or_null(rstd),
        f32_or_null(gamma), ps.stat, a->c, a->hw, total, a->training);
    CB_LAUNCHED(cb, "batchnorm_backward_dx_kernel");
}
