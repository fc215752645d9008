/*
 * loss_optim.cu — losses, the fused gradient check, the step's tail, zero counting and the optimizer
 * updates. Nothing here waits for the device except count_zeros: a training step queues on the stream
 * without a host synchronisation (backend.h).
 *
 * xent / mse: one block per sample row, FP32 math with double sums (the CPU's formulas): max and
 * argmax (first maximum), log-sum-exp, the per-sample loss, and the gradient (softmax - onehot) *
 * seed / N rounded once into dlogits' dtype; correct[i] = argmax == label (int32, device). The seed
 * (one fp32, the loss scale / accum_steps) is read on the device: the host never learns the scale.
 * loss_sum: one block adds a step's row losses in double in a fixed order (per-thread strided sums,
 * then a fixed tree) and adds the mean to a double in device memory.
 * grad_stats: ONE launch over all gradient tensors. A table of {pointer, numel} for every tensor lives
 * in device memory; a grid (kStatBlocks, ntensors) reduces each tensor in kStatBlocks fixed slices to
 * per-block partials (sum of squares of finite elements and max |g| in double, inf and nan counts in
 * int64); a second one-block kernel adds the partials per tensor and then over tensors in index order
 * and writes struct grad_check and the per-tensor counts to the caller's device memory. Same inputs,
 * same bits, every run (no atomics). The table is uploaded only when the tensors change (a training
 * run passes the same gradients every step), from a pageable host copy kept in struct cuda_backend:
 * cudaMemcpyAsync stages a pageable source before it returns, so rewriting the copy later can never
 * race a queued upload (a shared pinned buffer could, without a synchronisation per call).
 * step_finish: step_rule_finish (lib/step_rule.h) in a one-thread kernel, on state in device memory.
 * adamw / sgd: one pass per parameter updating the fp32 master (and moments) and writing the fp16/bf16
 * copy in the same thread. The step's scalars (bias corrections, learning rate, unscale-and-clip factor,
 * skip) are read from struct step_scalars in device memory, written by step_finish in double as PyTorch
 * and the CPU backend compute them; a skipped step leaves every tensor untouched.
 */
#include "backend_cuda_internal.h"

#include <cmath>
#include <cstdlib>

namespace {

constexpr unsigned kLossThreads = 256;
constexpr unsigned kLossSumThreads = 1024; /* loss_sum: one block */
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
                            const int32_t *labels, int64_t N, int64_t K, const float *seed)
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
    float x0 = load_elem(logits, x_dt, base);
    if (mi >= K || isnan(x0)) { /* the CPU's scan starts at x[0] and a NaN there is never beaten */
        mi = 0;
        mv = x0;
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
    float g = (float)((double)*seed / (double)N);
    for (int64_t j = threadIdx.x; j < K; j += blockDim.x) {
        float p = (float)exp((double)load_elem(logits, x_dt, base + j) - lse);
        store_elem(dlogits, d_dt, base + j, (p - (j == label ? 1.0f : 0.0f)) * g);
    }
}

__global__ void mse_kernel(float *losses, void *dy, int dy_dt, const void *y, int y_dt, const void *t, int t_dt,
                           int64_t N, int64_t K, const float *seed)
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
    float g = (float)(2.0 * (double)*seed / ((double)N * (double)K));
    for (int64_t j = threadIdx.x; j < K; j += blockDim.x)
        store_elem(dy, dy_dt, base + j, (load_elem(y, y_dt, base + j) - load_elem(t, t_dt, base + j)) * g);
}

/* *acc = (accumulate ? *acc : 0) + sum(losses[0..n)) / n, in double; one block, fixed order. */
__global__ void loss_sum_kernel(double *acc, const float *losses, int64_t n, bool accumulate)
{
    __shared__ double red[32];
    double s = 0.0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
        s += (double)losses[i];
    s = block_sum_d(s, red);
    if (threadIdx.x == 0)
        *acc = (accumulate ? *acc : 0.0) + s / (double)n;
}

struct stat_partial {
    double sumsq, absmax;
    long long n_inf, n_nan;
};

__global__ void grad_stats_partial_kernel(struct stat_partial *part, const struct grad_table_entry *tab)
{
    __shared__ double s_sq[kStatThreads / 32], s_mx[kStatThreads / 32];
    __shared__ long long s_inf[kStatThreads / 32], s_nan[kStatThreads / 32];
    struct grad_table_entry t = tab[blockIdx.y];
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

/* Per tensor, its Inf and NaN counts into counts[t] and counts[nt + t] (counts may be NULL); then, in
 * tensor order, the totals into *out, found_nonfinite from the same counts. */
__global__ void grad_stats_finish_kernel(struct grad_check *out, int64_t *counts, const struct stat_partial *part,
                                         int nt)
{
    for (int t = threadIdx.x; counts && t < nt; t += blockDim.x) {
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
        long long bad = 0;
        for (int t = 0; t < nt; t++)
            for (unsigned b = 0; b < kStatBlocks; b++) {
                sq += part[t * kStatBlocks + b].sumsq;
                mx = fmax(mx, part[t * kStatBlocks + b].absmax);
                bad += part[t * kStatBlocks + b].n_inf + part[t * kStatBlocks + b].n_nan;
            }
        out->sumsq = sq;
        out->absmax = mx;
        out->found_nonfinite = bad != 0;
    }
}

/* The step's tail on device state; p travels by value as a kernel argument. */
__global__ void step_finish_kernel(struct step_params p, struct step_state *state, const struct grad_check *check,
                                   struct step_row *row)
{
    step_rule_finish(&p, state, check, row);
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

/* What adamw_kernel takes from the host; the step's scalars come from struct step_scalars. */
struct adamw_consts {
    float b1, b2, omb1, omb2, eps;
    bool decay_on;
};

__global__ void adamw_kernel(float *p, float *m, float *v, const float *g, void *lowp, int lowp_dt, size_t n,
                             const struct step_scalars *sc, adamw_consts c)
{
    if (sc->skip)
        return;
    float gm = sc->grad_mul, decay = sc->adam_decay, neg_step = sc->adam_neg_step, bc2_sqrt = sc->adam_bc2_sqrt;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float gi = g[i] * gm;
        float pi = c.decay_on ? p[i] * decay : p[i];
        float mi = c.b1 * m[i] + c.omb1 * gi;
        float vi = c.b2 * v[i] + c.omb2 * gi * gi;
        float denom = sqrtf(vi) / bc2_sqrt + c.eps;
        float np = pi + neg_step * mi / denom;
        p[i] = np;
        m[i] = mi;
        v[i] = vi;
        if (lowp)
            store_elem(lowp, lowp_dt, i, np);
    }
}

/* What sgd_kernel takes from the host. */
struct sgd_consts {
    float wd, mom;
    bool nesterov;
};

__global__ void sgd_kernel(float *p, float *buf, const float *g, void *lowp, int lowp_dt, size_t n,
                           const struct step_scalars *sc, sgd_consts c)
{
    if (sc->skip)
        return;
    float gm = sc->grad_mul, neg_lr = -sc->lr;
    bool first_step = sc->first_step != 0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float gi = g[i] * gm;
        if (c.wd != 0.0f)
            gi = gi + c.wd * p[i];
        if (buf) {
            float bi = first_step ? gi : c.mom * buf[i] + gi;
            buf[i] = bi;
            gi = c.nesterov ? gi + c.mom * bi : bi;
        }
        float np = p[i] + neg_lr * gi;
        p[i] = np;
        if (lowp)
            store_elem(lowp, lowp_dt, i, np);
    }
}

/* The device table of `grads` for grad_stats_partial_kernel. The last table uploaded is reused when it
 * lists the same tensors; otherwise the host copy is rewritten and uploaded from it. The copy is
 * pageable, so cudaMemcpyAsync has staged it before it returns and the next call may rewrite it while
 * this upload is still queued; the device buffer is only rewritten in stream order, after every kernel
 * queued before has read it. NULL (status set) on failure. */
const struct grad_table_entry *grad_table_for(struct cuda_backend *cb, const struct tensor *const *grads, int nt)
{
    struct grad_table *gt = &cb->gs_table;
    size_t bytes = (size_t)nt * sizeof(struct grad_table_entry);
    const struct device_scratch *slot = &cb->scr[CSCR_GS_DESC];
    if (!slot->p || bytes > slot->cap)
        gt->n = 0; /* cuda_scratch replaces the buffer: what was uploaded is gone */
    void *dev = cuda_scratch(cb, CSCR_GS_DESC, bytes);
    if (!dev) {
        gt->n = 0;
        return NULL;
    }
    bool same = gt->n == nt;
    for (int t = 0; same && t < nt; t++)
        same = gt->host[t].p == grads[t]->data && gt->host[t].n == grads[t]->numel;
    if (same)
        return static_cast<const struct grad_table_entry *>(dev);
    gt->n = 0;
    if (nt > gt->cap) {
        void *h = realloc(gt->host, bytes);
        if (!h) {
            cuda_record(cb, "free some host memory and try again", "grad_stats: out of host memory for a %d-tensor table",
                        nt);
            return NULL;
        }
        gt->host = static_cast<struct grad_table_entry *>(h);
        gt->cap = nt;
    }
    for (int t = 0; t < nt; t++) {
        gt->host[t].p = static_cast<const float *>(grads[t]->data);
        gt->host[t].n = grads[t]->numel;
    }
    if (!CB_CUDA(cb, cudaMemcpyAsync(dev, gt->host, bytes, cudaMemcpyHostToDevice, cb->stream)))
        return NULL;
    gt->n = nt;
    return static_cast<const struct grad_table_entry *>(dev);
}

/* An optimizer update needs the step's scalars; without them it is a bug in the caller. */
bool has_step_scalars(struct cuda_backend *cb, const struct optim_update_args *a, const char *op)
{
    if (a->sc)
        return true;
    cuda_record(cb, "this is a bug in the caller: pass the step_scalars step_finish wrote",
                "%s without step scalars (optim_update_args.sc is NULL)", op);
    return false;
}

} // namespace

void cuda_xent_forward_backward(struct backend *be, struct tensor *losses, int32_t *correct, struct tensor *dlogits,
                                const struct tensor *logits, const int32_t *labels, int64_t N, int64_t K,
                                const float *grad_seed)
{
    struct cuda_backend *cb = cuda_of(be);
    if (N <= 0)
        return;
    if (dlogits && !grad_seed) {
        cuda_record(cb, "this is a bug in the caller", "xent_forward_backward: dlogits without a grad_seed");
        return;
    }
    xent_kernel<<<(unsigned)N, kLossThreads, 0, cb->stream>>>(
        losses ? static_cast<float *>(losses->data) : NULL, correct, dlogits ? dlogits->data : NULL,
        dlogits ? dlogits->dtype : DT_FP32, logits->data, logits->dtype, labels, N, K, grad_seed);
    CB_LAUNCHED(cb, "xent_kernel");
}

void cuda_mse_forward_backward(struct backend *be, struct tensor *losses, struct tensor *dy, const struct tensor *y,
                               const struct tensor *target, int64_t N, int64_t K, const float *grad_seed)
{
    struct cuda_backend *cb = cuda_of(be);
    if (N <= 0)
        return;
    if (dy && !grad_seed) {
        cuda_record(cb, "this is a bug in the caller", "mse_forward_backward: dy without a grad_seed");
        return;
    }
    mse_kernel<<<(unsigned)N, kLossThreads, 0, cb->stream>>>(losses ? static_cast<float *>(losses->data) : NULL,
                                                             dy ? dy->data : NULL, dy ? dy->dtype : DT_FP32, y->data,
                                                             y->dtype, target->data, target->dtype, N, K, grad_seed);
    CB_LAUNCHED(cb, "mse_kernel");
}

void cuda_loss_sum(struct backend *be, double *acc, const struct tensor *losses, int64_t n, bool accumulate)
{
    struct cuda_backend *cb = cuda_of(be);
    if (losses->dtype != DT_FP32 || n <= 0 || (uint64_t)n > (uint64_t)losses->numel) {
        cuda_record(cb, "this is a bug in the caller", "loss_sum: %lld losses of a %zu-element %s tensor",
                    (long long)n, (size_t)losses->numel, dtype_name(losses->dtype));
        return;
    }
    loss_sum_kernel<<<1, kLossSumThreads, 0, cb->stream>>>(acc, static_cast<const float *>(losses->data), n,
                                                           accumulate);
    CB_LAUNCHED(cb, "loss_sum_kernel");
}

void cuda_grad_stats(struct backend *be, const struct tensor *const *grads, int ntensors, struct grad_check *out,
                     int64_t *counts)
{
    struct cuda_backend *cb = cuda_of(be);
    if (ntensors <= 0) {
        CB_CUDA(cb, cudaMemsetAsync(out, 0, sizeof *out, cb->stream)); /* all-zero bits: 0.0, 0.0, 0 */
        return;
    }
    if (ntensors > 65535) {
        cuda_record(cb, "this is a bug in the caller", "grad_stats: %d tensors exceed one launch's grid", ntensors);
        return;
    }
    const struct grad_table_entry *tab = grad_table_for(cb, grads, ntensors);
    struct stat_partial *part = static_cast<struct stat_partial *>(
        cuda_scratch(cb, CSCR_PARTIAL, (size_t)ntensors * kStatBlocks * sizeof(struct stat_partial)));
    if (!tab || !part)
        return;
    grad_stats_partial_kernel<<<dim3(kStatBlocks, (unsigned)ntensors), kStatThreads, 0, cb->stream>>>(part, tab);
    CB_LAUNCHED(cb, "grad_stats_partial_kernel");
    grad_stats_finish_kernel<<<1, 256, 0, cb->stream>>>(out, counts, part, ntensors);
    CB_LAUNCHED(cb, "grad_stats_finish_kernel");
}

void cuda_step_finish(struct backend *be, const struct step_params *p, struct step_state *state,
                      const struct grad_check *check, struct step_row *row)
{
    struct cuda_backend *cb = cuda_of(be);
    step_finish_kernel<<<1, 1, 0, cb->stream>>>(*p, state, check, row);
    CB_LAUNCHED(cb, "step_finish_kernel");
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
    if (!n || !has_step_scalars(cb, a, "adamw_update"))
        return;
    adamw_consts c;
    c.b1 = a->beta1;
    c.b2 = a->beta2;
    c.omb1 = 1.0f - a->beta1;
    c.omb2 = 1.0f - a->beta2;
    c.eps = a->eps;
    c.decay_on = a->weight_decay != 0.0f;
    adamw_kernel<<<grid_for(n), kThreads, 0, cb->stream>>>(
        static_cast<float *>(a->master->data), static_cast<float *>(a->m->data), static_cast<float *>(a->v->data),
        static_cast<const float *>(a->grad->data), a->lowp ? a->lowp->data : NULL, a->lowp ? a->lowp->dtype : DT_FP32,
        n, a->sc, c);
    CB_LAUNCHED(cb, "adamw_kernel");
}

void cuda_sgd_update(struct backend *be, const struct optim_update_args *a)
{
    struct cuda_backend *cb = cuda_of(be);
    size_t n = a->master->numel;
    if (!n || !has_step_scalars(cb, a, "sgd_update"))
        return;
    sgd_consts c;
    c.wd = a->weight_decay;
    c.mom = a->momentum;
    c.nesterov = a->nesterov;
    float *buf = a->m && a->momentum != 0.0f ? static_cast<float *>(a->m->data) : NULL;
    sgd_kernel<<<grid_for(n), kThreads, 0, cb->stream>>>(static_cast<float *>(a->master->data), buf,
                                                         static_cast<const float *>(a->grad->data),
                                                         a->lowp ? a->lowp->data : NULL,
                                                         a->lowp ? a->lowp->dtype : DT_FP32, n, a->sc, c);
    CB_LAUNCHED(cb, "sgd_kernel");
}
