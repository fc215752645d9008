/*
 * norm.cu — layernorm and batchnorm, forward and backward, with FP32 statistics (sums in double, as in
 * the CPU reference, so the GPU agrees with it to the last few bits of fp32).
 *
 * layernorm: one block per row; mean, then the centred sum of squares (two passes over the row),
 * then y. Backward: one block per row for dx; dgamma/dbeta are column sums over rows, done in two
 * passes (double partials per chunk of rows, then a fixed-order sum) — deterministic, no atomics.
 * batchnorm (NCHW, per-channel statistics over n*hw): one block per channel does the reductions and
 * then writes its channel of y (forward) or dx (backward); the block's reduction order is fixed, so
 * results reproduce run to run. Running statistics follow PyTorch (unbiased variance).
 * Buffers: x, y, dy, dx any dtype; gamma, beta, mean, rstd, running stats, dgamma, dbeta fp32.
 */
#include "backend_cuda_internal.h"

namespace {

constexpr unsigned kRowThreads = 256;
constexpr int64_t kLnChunk = 128; /* rows per partial of the dgamma/dbeta column sums */

__device__ double block_sum(double v, double *shared)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads(); /* shared may still be read by the previous call */
    if ((threadIdx.x & 31) == 0)
        shared[threadIdx.x >> 5] = v;
    __syncthreads();
    double s = 0.0;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++)
        s += shared[w];
    return s;
}

__global__ void layernorm_forward_kernel(void *y, int y_dt, float *mean, float *rstd, const void *x, int x_dt,
                                         const float *gamma, const float *beta, int64_t cols, float eps)
{
    __shared__ double red[32];
    size_t base = (size_t)blockIdx.x * (size_t)cols;
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

__global__ void layernorm_backward_dx_kernel(void *dx, int dx_dt, const void *dy, int dy_dt, const void *x, int x_dt,
                                             const float *mean, const float *rstd, const float *gamma, int64_t cols)
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
        store_elem(dx, dx_dt, base + j, rs * (dxhat - m1 - xhat * m2));
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

/* One block per channel. */
__global__ void batchnorm_forward_kernel(void *y, int y_dt, float *mean, float *rstd, float *rm, float *rv,
                                         const void *x, int x_dt, const float *gamma, const float *beta, int64_t n,
                                         int64_t c, int64_t hw, float eps, float momentum, bool training)
{
    __shared__ double red[32];
    int64_t ch = blockIdx.x, count_i = n * hw;
    double count = (double)count_i;
    float mu_f, rs_f;
    if (training) {
        double s = 0.0;
        for (int64_t i = threadIdx.x; i < count_i; i += blockDim.x)
            s += load_elem(x, x_dt, (size_t)(((i / hw) * c + ch) * hw + i % hw));
        double mu = block_sum(s, red) / count;
        double ss = 0.0;
        for (int64_t i = threadIdx.x; i < count_i; i += blockDim.x) {
            double d = load_elem(x, x_dt, (size_t)(((i / hw) * c + ch) * hw + i % hw)) - mu;
            ss += d * d;
        }
        ss = block_sum(ss, red);
        double var = ss / count;
        mu_f = (float)mu;
        rs_f = (float)(1.0 / sqrt(var + (double)eps));
        if (threadIdx.x == 0) {
            double m = momentum, unbiased = count > 1.0 ? ss / (count - 1.0) : var;
            if (rm)
                rm[ch] = (float)((1.0 - m) * rm[ch] + m * mu);
            if (rv)
                rv[ch] = (float)((1.0 - m) * rv[ch] + m * unbiased);
        }
    } else {
        mu_f = rm[ch];
        rs_f = (float)(1.0 / sqrt((double)rv[ch] + (double)eps));
    }
    if (threadIdx.x == 0) {
        if (mean)
            mean[ch] = mu_f;
        if (rstd)
            rstd[ch] = rs_f;
    }
    float gc = gamma ? gamma[ch] : 1.0f, bc = beta ? beta[ch] : 0.0f;
    for (int64_t i = threadIdx.x; i < count_i; i += blockDim.x) {
        size_t at = (size_t)(((i / hw) * c + ch) * hw + i % hw);
        store_elem(y, y_dt, at, (load_elem(x, x_dt, at) - mu_f) * rs_f * gc + bc);
    }
}

__global__ void batchnorm_backward_kernel(void *dx, int dx_dt, float *dgamma, float *dbeta, const void *dy, int dy_dt,
                                          const void *x, int x_dt, const float *mean, const float *rstd,
                                          const float *gamma, int64_t n, int64_t c, int64_t hw, float beta_acc,
                                          bool training)
{
    __shared__ double red[32];
    int64_t ch = blockIdx.x, count_i = n * hw;
    double count = (double)count_i;
    float mu = mean[ch], rs = rstd[ch], gc = gamma ? gamma[ch] : 1.0f;
    double sdy = 0.0, sdyx = 0.0;
    for (int64_t i = threadIdx.x; i < count_i; i += blockDim.x) {
        size_t at = (size_t)(((i / hw) * c + ch) * hw + i % hw);
        float g = load_elem(dy, dy_dt, at);
        sdy += g;
        sdyx += (double)g * ((load_elem(x, x_dt, at) - mu) * rs);
    }
    sdy = block_sum(sdy, red);
    sdyx = block_sum(sdyx, red);
    if (threadIdx.x == 0) {
        if (dgamma)
            dgamma[ch] = beta_acc == 0.0f ? (float)sdyx : beta_acc * dgamma[ch] + (float)sdyx;
        if (dbeta)
            dbeta[ch] = beta_acc == 0.0f ? (float)sdy : beta_acc * dbeta[ch] + (float)sdy;
    }
    if (!dx)
        return;
    float m1 = (float)(gc * sdy / count), m2 = (float)(gc * sdyx / count);
    for (int64_t i = threadIdx.x; i < count_i; i += blockDim.x) {
        size_t at = (size_t)(((i / hw) * c + ch) * hw + i % hw);
        float g = load_elem(dy, dy_dt, at);
        float v = training ? rs * (g * gc - m1 - (load_elem(x, x_dt, at) - mu) * rs * m2) : g * gc * rs;
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
        f32_or_null(beta), a->cols, a->eps);
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
            f32_or_null(gamma), cols);
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
    batchnorm_forward_kernel<<<(unsigned)a->c, kRowThreads, 0, cb->stream>>>(
        y->data, y->dtype, f32_or_null(mean), f32_or_null(rstd), f32_or_null(running_mean), f32_or_null(running_var),
        x->data, x->dtype, f32_or_null(gamma), f32_or_null(beta), a->n, a->c, a->hw, a->eps, a->momentum, a->training);
    CB_LAUNCHED(cb, "batchnorm_forward_kernel");
}

void cuda_batchnorm_backward(struct backend *be, const struct norm_args *a, struct tensor *dx, struct tensor *dgamma,
                             struct tensor *dbeta, const struct tensor *dy, const struct tensor *x,
                             const struct tensor *mean, const struct tensor *rstd, const struct tensor *gamma,
                             float beta_acc)
{
    struct cuda_backend *cb = cuda_of(be);
    if (a->c <= 0)
        return;
    batchnorm_backward_kernel<<<(unsigned)a->c, kRowThreads, 0, cb->stream>>>(
        dx ? dx->data : NULL, dx ? dx->dtype : DT_FP32, f32_or_null(dgamma), f32_or_null(dbeta), dy->data, dy->dtype,
        x->data, x->dtype, f32_or_null(mean), f32_or_null(rstd), f32_or_null(gamma), a->n, a->c, a->hw, beta_acc,
        a->training);
    CB_LAUNCHED(cb, "batchnorm_backward_kernel");
}
