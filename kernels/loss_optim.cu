/*
 * loss_optim.cu — losses, the fused gradient check, zero counting and the optimizer updates.
 *
 * xent / mse: one block per sample row, FP32 math with double sums (the CPU's formulas): max and
 * argmax (first maximum), log-sum-exp, the per-sample loss, and the gradient (softmax - onehot) *
 * grad_seed / N rounded once into dlogits' dtype; correct[i] = argmax == label (int32, device).
 * grad_stats: ONE launch over all gradient tensors. The host packs {pointer, numel} for every tensor
 * into pinned memory, copies it to the device, and a grid (kStatBlocks, ntensors) reduces each tensor
 * in kStatBlocks fixed slices to per-block partials (sum of squares of finite elements and max |g| in
 * double, inf and nan counts in int64); a second one-block kernel adds the partials per tensor and
 * then over tensors in index order. Same inputs, same bits, every run (no atomics). The results come
 * back in one copy and one stream synchronisation — the only host sync of a training step besides
 * reading log values.
 * adamw / sgd: one pass per parameter updating the fp32 master (and moments) and writing the fp16/bf16
 * copy in the same thread; scalars (bias corrections) are computed on the host in double as PyTorch and
 * the CPU backend do.
 */
#include "backend_cuda_internal.h"

#include <cmath>
#include <cstring>

namespace {

constexpr unsigned kLossThreads = 256;
constexpr unsigned kStatBlocks = 64;   /* slices per tensor in grad_stats */
constexpr unsigned kStatThreads = 256;

__device__ double block_sum_d(double v, double *shared)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0)
        shared[threadIdx.x >> 5] = v;
    __syncthreads();
    double s = 0.0;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++)
        s += shared[w];
    return s;
}

/* (value, index) max with the CPU's tie rule: the first index wins. */
__device__ void argmax_merge(float &v, int64_t &i, float v2, int64_t i2)
{
    if (v2 > v || (v2 == v && i2 < i)) {
        v = v2;
        i = i2;
    }
}

__global__ void xent_kernel(float *losses, int32_t *correct, void *dlogits, int d_dt, const void *logits, int x_dt,
                            const int32_t *labels, int64_t K, float g)
{
    __shared__ float sv[32];
    __shared__ long long si[32];
    __shared__ double red[32];
    size_t base = (size_t)blockIdx.x * (size_t)K;
    float mv = -INFINITY;
    int64_t mi = K;
    for (int64_t j = threadIdx.x; j < K; j += blockDim.x)
        argmax_merge(mv, mi, load_elem(logits, x_dt, base + j), j);
    for (int o = 16; o > 0; o >>= 1) {
        float v2 = __shfl_xor_sync(0xffffffffu, mv, o);
        long long i2 = __shfl_xor_sync(0xffffffffu, (long long)mi, o);
        argmax_merge(mv, mi, v2, i2);
    }
    if ((threadIdx.x & 31) == 0) {
        sv[threadIdx.x >> 5] = mv;
        si[threadIdx.x >> 5] = mi;
    }
    __syncthreads();
    mv = sv[0];
    mi = si[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); w++)
        argmax_merge(mv, mi, sv[w], si[w]);
    if (mi >= K) { /* every logit NaN: the CPU keeps x[0] */
        mi = 0;
        mv = load_elem(logits, x_dt, base);
    }
    double sum = 0.0;
    for (int64_t j = threadIdx.x; j < K; j += blockDim.x)
        sum += exp((double)load_elem(logits, x_dt, base + j) - (double)mv);
    sum = block_sum_d(sum, red);
    double lse = (double)mv + log(sum);
    int32_t label = labels[blockIdx.x];
    bool ok = label >= 0 && label < K;
    if (threadIdx.x == 0) {
        if (losses)
            losses[blockIdx.x] = ok ? (float)(lse - (double)load_elem(logits, x_dt, base + label)) : NAN;
        if (correct)
            correct[blockIdx.x] = ok && mi == label;
    }
    if (!dlogits)
        return;
    for (int64_t j = threadIdx.x; j < K; j += blockDim.x) {
        float p = (float)exp((double)load_elem(logits, x_dt, base + j) - lse);
        store_elem(dlogits, d_dt, base + j, (p - (j == label ? 1.0f : 0.0f)) * g);
    }
}

__global__ void mse_kernel(float *losses, void *dy, int dy_dt, const void *y, int y_dt, const void *t, int t_dt,
                           int64_t K, float g)
{
    __shared__ double red[32];
    size_t base = (size_t)blockIdx.x * (size_t)K;
    double s = 0.0;
    for (int64_t j = threadIdx.x; j < K; j += blockDim.x) {
        double e = (double)load_elem(y, y_dt, base + j) - (double)load_elem(t, t_dt, base + j);
        s += e * e;
    }
    s = block_sum_d(s, red);
    if (threadIdx.x == 0 && losses)
        losses[blockIdx.x] = (float)(s / (double)K);
    if (!dy)
        return;
    for (int64_t j = threadIdx.x; j < K; j += blockDim.x)
        store_elem(dy, dy_dt, base + j, (load_elem(y, y_dt, base + j) - load_elem(t, t_dt, base + j)) * g);
}

struct stat_tensor {
    const float *p;
    uint64_t n;
};

struct stat_partial {
    double sumsq, absmax;
    long long n_inf, n_nan;
};

__global__ void grad_stats_partial_kernel(struct stat_partial *part, const struct stat_tensor *tab)
{
    __shared__ double s_sq[kStatThreads / 32], s_mx[kStatThreads / 32];
    __shared__ long long s_inf[kStatThreads / 32], s_nan[kStatThreads / 32];
    struct stat_tensor t = tab[blockIdx.y];
    uint64_t per = (t.n + kStatBlocks - 1) / kStatBlocks;
    uint64_t lo = per * blockIdx.x, hi = lo + per < t.n ? lo + per : t.n;
    double sq = 0.0, mx = 0.0;
    long long ni = 0, nn = 0;
    for (uint64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float g = t.p[i];
        if (isinf(g)) {
            ni++;
        } else if (isnan(g)) {
            nn++;
        } else {
            double v = g;
            sq += v * v;
            mx = fmax(mx, fabs(v));
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        sq += __shfl_xor_sync(0xffffffffu, sq, o);
        mx = fmax(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        ni += __shfl_xor_sync(0xffffffffu, ni, o);
        nn += __shfl_xor_sync(0xffffffffu, nn, o);
    }
    int w = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) {
        s_sq[w] = sq;
        s_mx[w] = mx;
        s_inf[w] = ni;
        s_nan[w] = nn;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        struct stat_partial r = {0.0, 0.0, 0, 0};
        for (int k = 0; k < (int)(blockDim.x >> 5); k++) {
            r.sumsq += s_sq[k];
            r.absmax = fmax(r.absmax, s_mx[k]);
            r.n_inf += s_inf[k];
            r.n_nan += s_nan[k];
        }
        part[blockIdx.y * kStatBlocks + blockIdx.x] = r;
    }
}

/* out: n_inf[nt], n_nan[nt] (int64), then sumsq, absmax (double) */
__global__ void grad_stats_finish_kernel(long long *counts, double *totals, const struct stat_partial *part, int nt)
{
    for (int t = threadIdx.x; t < nt; t += blockDim.x) {
        long long ni = 0, nn = 0;
        for (unsigned b = 0; b < kStatBlocks; b++) {
            ni += part[t * kStatBlocks + b].n_inf;
            nn += part[t * kStatBlocks + b].n_nan;
        }
        counts[t] = ni;
        counts[nt + t] = nn;
    }
    if (threadIdx.x == 0) {
        double sq = 0.0, mx = 0.0;
        for (int t = 0; t < nt; t++)
            for (unsigned b = 0; b < kStatBlocks; b++) {
                sq += part[t * kStatBlocks + b].sumsq;
                mx = fmax(mx, part[t * kStatBlocks + b].absmax);
            }
        totals[0] = sq;
        totals[1] = mx;
    }
}

__global__ void count_zeros_partial_kernel(long long *part, const void *p, int dt, size_t n)
{
    __shared__ long long red[32];
    long long z = 0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        if (dt == DT_FP32)
            z += (static_cast<const uint32_t *>(p)[i] & 0x7FFFFFFFu) == 0;
        else
            z += (static_cast<const uint16_t *>(p)[i] & 0x7FFFu) == 0;
    }
    for (int o = 16; o > 0; o >>= 1)
        z += __shfl_xor_sync(0xffffffffu, z, o);
    if ((threadIdx.x & 31) == 0)
        red[threadIdx.x >> 5] = z;
    __syncthreads();
    if (threadIdx.x == 0) {
        long long s = 0;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++)
            s += red[w];
        part[blockIdx.x] = s;
    }
}

__global__ void sum_partials_kernel(long long *out, const long long *part, unsigned n)
{
    long long s = 0;
    for (unsigned i = 0; i < n; i++)
        s += part[i];
    *out = s;
}

struct adamw_scalars {
    float neg_step, bc2_sqrt, decay, b1, b2, omb1, omb2, gm, eps;
    bool decay_on;
};

__global__ void adamw_kernel(float *p, float *m, float *v, const float *g, void *lowp, int lowp_dt, size_t n,
                             adamw_scalars s)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float gi = g[i] * s.gm;
        float pi = s.decay_on ? p[i] * s.decay : p[i];
        float mi = s.b1 * m[i] + s.omb1 * gi;
        float vi = s.b2 * v[i] + s.omb2 * gi * gi;
        float denom = sqrtf(vi) / s.bc2_sqrt + s.eps;
        float np = pi + s.neg_step * mi / denom;
        p[i] = np;
        m[i] = mi;
        v[i] = vi;
        if (lowp)
            store_elem(lowp, lowp_dt, i, np);
    }
}

struct sgd_scalars {
    float gm, wd, mom, neg_lr;
    bool first_step, nesterov;
};

__global__ void sgd_kernel(float *p, float *buf, const float *g, void *lowp, int lowp_dt, size_t n, sgd_scalars s)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float gi = g[i] * s.gm;
        if (s.wd != 0.0f)
            gi = gi + s.wd * p[i];
        if (buf) {
            float bi = s.first_step ? gi : s.mom * buf[i] + gi;
            buf[i] = bi;
            gi = s.nesterov ? gi + s.mom * bi : bi;
        }
        float np = p[i] + s.neg_lr * gi;
        p[i] = np;
        if (lowp)
            store_elem(lowp, lowp_dt, i, np);
    }
}

} // namespace

void cuda_xent_forward_backward(struct backend *be, struct tensor *losses, int32_t *correct, struct tensor *dlogits,
                                const struct tensor *logits, const int32_t *labels, int64_t N, int64_t K,
                                float grad_seed)
{
    struct cuda_backend *cb = cuda_of(be);
    if (N <= 0)
        return;
    float g = (float)((double)grad_seed / (double)N);
    xent_kernel<<<(unsigned)N, kLossThreads, 0, cb->stream>>>(
        losses ? static_cast<float *>(losses->data) : NULL, correct, dlogits ? dlogits->data : NULL,
        dlogits ? dlogits->dtype : DT_FP32, logits->data, logits->dtype, labels, K, g);
    CB_LAUNCHED(cb, "xent_kernel");
}

void cuda_mse_forward_backward(struct backend *be, struct tensor *losses, struct tensor *dy, const struct tensor *y,
                               const struct tensor *target, int64_t N, int64_t K, float grad_seed)
{
    struct cuda_backend *cb = cuda_of(be);
    if (N <= 0)
        return;
    float g = (float)(2.0 * (double)grad_seed / ((double)N * (double)K));
    mse_kernel<<<(unsigned)N, kLossThreads, 0, cb->stream>>>(losses ? static_cast<float *>(losses->data) : NULL,
                                                             dy ? dy->data : NULL, dy ? dy->dtype : DT_FP32, y->data,
                                                             y->dtype, target->data, target->dtype, K, g);
    CB_LAUNCHED(cb, "mse_kernel");
}

void cuda_grad_stats(struct backend *be, const struct tensor *const *grads, int ntensors, struct grad_stats *out)
{
    struct cuda_backend *cb = cuda_of(be);
    out->sumsq = 0.0;
    out->absmax = 0.0;
    out->found_nonfinite = false;
    if (ntensors <= 0)
        return;
    if (ntensors > 65535) {
        cuda_record(cb, "this is a bug in the caller", "grad_stats: %d tensors exceed one launch's grid", ntensors);
        return;
    }
    size_t tab_bytes = (size_t)ntensors * sizeof(struct stat_tensor);
    size_t res_bytes = (size_t)ntensors * 2 * sizeof(long long) + 2 * sizeof(double);
    size_t tab_off = (res_bytes + 255) & ~(size_t)255;
    char *host = static_cast<char *>(cuda_host_buffer(cb, tab_off + tab_bytes));
    char *dev = static_cast<char *>(cuda_scratch(cb, CSCR_GS_DESC, tab_off + tab_bytes));
    struct stat_partial *part = static_cast<struct stat_partial *>(
        cuda_scratch(cb, CSCR_PARTIAL, (size_t)ntensors * kStatBlocks * sizeof(struct stat_partial)));
    if (!host || !dev || !part)
        return;
    /* the pinned buffer is free: every earlier use of it ended with a stream synchronisation */
    struct stat_tensor *tab = reinterpret_cast<struct stat_tensor *>(host + tab_off);
    for (int t = 0; t < ntensors; t++) {
        tab[t].p = static_cast<const float *>(grads[t]->data);
        tab[t].n = grads[t]->numel;
    }
    if (!CB_CUDA(cb, cudaMemcpyAsync(dev + tab_off, tab, tab_bytes, cudaMemcpyHostToDevice, cb->stream)))
        return;
    grad_stats_partial_kernel<<<dim3(kStatBlocks, (unsigned)ntensors), kStatThreads, 0, cb->stream>>>(
        part, reinterpret_cast<const struct stat_tensor *>(dev + tab_off));
    CB_LAUNCHED(cb, "grad_stats_partial_kernel");
    long long *counts = reinterpret_cast<long long *>(dev);
    double *totals = reinterpret_cast<double *>(dev + (size_t)ntensors * 2 * sizeof(long long));
    grad_stats_finish_kernel<<<1, 256, 0, cb->stream>>>(counts, totals, part, ntensors);
    CB_LAUNCHED(cb, "grad_stats_finish_kernel");
    if (!CB_CUDA(cb, cudaMemcpyAsync(host, dev, res_bytes, cudaMemcpyDeviceToHost, cb->stream)) ||
        !CB_CUDA(cb, cudaStreamSynchronize(cb->stream)))
        return;
    const long long *hc = reinterpret_cast<const long long *>(host);
    double ht[2];
    memcpy(ht, host + (size_t)ntensors * 2 * sizeof(long long), sizeof ht);
    for (int t = 0; t < ntensors; t++) {
        if (out->n_inf)
            out->n_inf[t] = hc[t];
        if (out->n_nan)
            out->n_nan[t] = hc[ntensors + t];
        if (hc[t] || hc[ntensors + t])
            out->found_nonfinite = true;
    }
    out->sumsq = ht[0];
    out->absmax = ht[1];
}

int64_t cuda_count_zeros(struct backend *be, const struct tensor *t)
{
    struct cuda_backend *cb = cuda_of(be);
    if (!t->numel)
        return 0;
    unsigned blocks = grid_for(t->numel);
    if (blocks > 1024)
        blocks = 1024;
    long long *part = static_cast<long long *>(cuda_scratch(cb, CSCR_PARTIAL2, (blocks + 1) * sizeof(long long)));
    long long *host = static_cast<long long *>(cuda_host_buffer(cb, sizeof(long long)));
    if (!part || !host)
        return 0;
    count_zeros_partial_kernel<<<blocks, kThreads, 0, cb->stream>>>(part + 1, t->data, t->dtype, t->numel);
    sum_partials_kernel<<<1, 1, 0, cb->stream>>>(part, part + 1, blocks);
    CB_LAUNCHED(cb, "count_zeros kernels");
    if (!CB_CUDA(cb, cudaMemcpyAsync(host, part, sizeof(long long), cudaMemcpyDeviceToHost, cb->stream)) ||
        !CB_CUDA(cb, cudaStreamSynchronize(cb->stream)))
        return 0;
    return (int64_t)*host;
}

void cuda_adamw_update(struct backend *be, const struct optim_update_args *a)
{
    struct cuda_backend *cb = cuda_of(be);
    size_t n = a->master->numel;
    if (!n)
        return;
    double bc1 = 1.0 - pow((double)a->beta1, (double)a->step);
    double bc2 = 1.0 - pow((double)a->beta2, (double)a->step);
    adamw_scalars s;
    s.neg_step = (float)(-(double)a->lr / bc1);
    s.bc2_sqrt = (float)sqrt(bc2);
    s.decay = (float)(1.0 - (double)a->lr * (double)a->weight_decay);
    s.decay_on = a->weight_decay != 0.0f;
    s.b1 = a->beta1;
    s.b2 = a->beta2;
    s.omb1 = 1.0f - a->beta1;
    s.omb2 = 1.0f - a->beta2;
    s.gm = a->grad_mul;
    s.eps = a->eps;
    adamw_kernel<<<grid_for(n), kThreads, 0, cb->stream>>>(
        static_cast<float *>(a->master->data), static_cast<float *>(a->m->data), static_cast<float *>(a->v->data),
        static_cast<const float *>(a->grad->data), a->lowp ? a->lowp->data : NULL, a->lowp ? a->lowp->dtype : DT_FP32,
        n, s);
    CB_LAUNCHED(cb, "adamw_kernel");
}

void cuda_sgd_update(struct backend *be, const struct optim_update_args *a)
{
    struct cuda_backend *cb = cuda_of(be);
    size_t n = a->master->numel;
    if (!n)
        return;
    sgd_scalars s;
    s.gm = a->grad_mul;
    s.wd = a->weight_decay;
    s.mom = a->momentum;
    s.neg_lr = -a->lr;
    s.first_step = a->first_step;
    s.nesterov = a->nesterov;
    float *buf = a->m && a->momentum != 0.0f ? static_cast<float *>(a->m->data) : NULL;
    sgd_kernel<<<grid_for(n), kThreads, 0, cb->stream>>>(static_cast<float *>(a->master->data), buf,
                                                         static_cast<const float *>(a->grad->data),
                                                         a->lowp ? a->lowp->data : NULL,
                                                         a->lowp ? a->lowp->dtype : DT_FP32, n, s);
    CB_LAUNCHED(cb, "sgd_kernel");
}
