/*
 * loss_optim.cu — losses, the fused gradient check, the step's tail, zero counting and the optimizer
 * updates. Nothing here waits for the device: a training step queues on the stream without a host
 * synchronisation (backend.h); count_zeros adds into an int64 in device memory.
 *
 * xent / mse: one block per sample row, FP32 math with double sums (the CPU's formulas): max and
 * argmax (first maximum), log-sum-exp, the per-sample loss, and the gradient (softmax - onehot) *
 * seed / N rounded once into dlogits' dtype; correct[i] = argmax == label (int32, device). The seed
 * (one fp32, the loss scale / accum_steps) is read on the device: the host never learns the scale.
 * loss_sum: one block adds a step's row losses in double in a fixed order (per-thread strided sums,
 * then a fixed tree) and adds the mean to a double in device memory.
 * grad_stats: ONE launch over all gradient tensors, then one to combine. A table of {pointer, numel} for every
 * tensor, and each tensor's first part, lives in device memory; every tensor is cut into parts of kGradPart
 * elements from its start (backend.h grad_part_numel, the last part shorter), and a grid of one 256-thread block a
 * part writes each part's struct grad_part (sum of squares of finite elements and max |g| in double, inf and nan
 * counts) (grad_stats_parts); a second one-block kernel adds the parts' sums in part order (per-thread contiguous
 * runs, then a fixed tree), and writes struct grad_check and the per-tensor counts to the caller's device memory
 * (grad_stats_combine). grad_stats is exactly those two halves, so ranks that each compute some of the parts
 * (dist.zero 1) and combine the gathered results get its bits. Same inputs,
 * same bits, every run (no atomics). The table is uploaded only when the tensors change (a training
 * run passes the same gradients every step), from a pageable host copy kept in struct cuda_backend:
 * cudaMemcpyAsync stages a pageable source before it returns, so rewriting the copy later can never
 * race a queued upload (a shared pinned buffer could, without a synchronisation per call).
 * step_finish: step_rule_finish (lib/base/step_rule.h) in a one-thread kernel, on state in device memory.
 * step_propose: step_rule_propose, the same way: the scalars the trial updates run on.
 * adamw / sgd: ONE launch updates all n parameters of a call (a model's ~30 tensors paid ~30 launches a
 * step before). A table of {master, grad, m, v, copy, their dtypes, numel, weight decay, rounding} per parameter lives
 * in device memory, cached and uploaded as grad_stats' is (struct device_table, scratch slot
 * CSCR_OPT_DESC); a grid (blocks per tensor, tensors) gives each tensor the same number of blocks, enough
 * for 4 elements a thread over the largest tensor and at most kOptimMaxBlocks, which grid-stride over its
 * elements (past 65535 tensors, one launch per 65535). Each element is updated in the CPU backend's
 * order (update_element): the master and moments (fp32, or bf16 rounded to nearest or stochastically with
 * lib/base/sround.h's bits), and the copy written in the same thread. The step's scalars (bias corrections, learning rate, unscale-and-clip factor, skip) are
 * read from struct step_scalars in device memory, written by step_finish in double as PyTorch and the CPU
 * backend compute them; every thread reads skip first, and a skipped step leaves every tensor untouched.
 * A trial (optim_update_args.trial) runs the same kernel with its stores replaced by checks of the values they
 * would store, and reports the first tensor with a non-finite one (atomicCAS to the minimum: deterministic).
 */
#include "backend_cuda_internal.h"

#include <cmath>
#include <cstdlib>
#include <cstring>

namespace {

constexpr unsigned kLossThreads = 256;
constexpr unsigned kLossSumThreads = 1024; /* loss_sum: one block */
constexpr unsigned kStatThreads = 256;     /* grad_stats: threads of a part's block */
constexpr int kCombineThreads = 256;       /* grad_stats: the combine's one block (a power of two) */
constexpr unsigned kOptimThreads = 256;
constexpr unsigned kOptimPerThread = 4;    /* elements a thread at least, over the largest tensor */
constexpr unsigned kOptimMaxBlocks = 512;  /* blocks per tensor at most; beyond, the threads grid-stride */
constexpr int kMaxTensorsPerLaunch = 65535; /* gridDim.y */

/* (value, index) max with the CPU's tie rule: the first index wins. */
__device__ void argmax_merge(float &v, int64_t &i, float v2, int64_t i2)
{
    if (v2 > v || (v2 == v && i2 < i)) {
        v = v2;
        i = i2;
    }
}

/* Rows S >= K elements apart: columns K..S-1 are the padded vocabulary's, left out of the max, the sum and the
 * argmax, their gradient written 0 (backend.h). */
__global__ void xent_kernel(float *losses, int32_t *correct, void *dlogits, int d_dt, const void *logits, int x_dt,
                            const int32_t *labels, int64_t N, int64_t K, int64_t S, const float *seed)
{
    __shared__ float sv[32];
    __shared__ long long si[32];
    __shared__ double red[32];
    size_t base = (size_t)blockIdx.x * (size_t)S;
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
    int32_t label = labels[blockIdx.x];
    bool ok = label >= 0 && label < K;
    /* read before block_sum's barriers: dlogits may be the logits themselves (models/loss.c), and after them the
     * thread that owns element `label` may already have written its gradient there */
    float x_label = ok && threadIdx.x == 0 ? load_elem(logits, x_dt, base + label) : 0.0f;
    double sum = 0.0;
    for (int64_t j = threadIdx.x; j < K; j += blockDim.x)
        sum += exp((double)load_elem(logits, x_dt, base + j) - (double)mv);
    sum = block_sum(sum, red);
    double lse = (double)mv + log(sum);
    if (threadIdx.x == 0) {
        if (losses)
            losses[blockIdx.x] = ok ? (float)(lse - (double)x_label) : NAN;
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
    for (int64_t j = K + threadIdx.x; j < S; j += blockDim.x)
        store_elem(dlogits, d_dt, base + j, 0.0f);
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
    s = block_sum(s, red);
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
    s = block_sum(s, red);
    if (threadIdx.x == 0)
        *acc = (accumulate ? *acc : 0.0) + s / (double)n;
}

/* Which of nt tensors part b belongs to, the parts numbered on from tensor to tensor (first[t] is tensor t's first,
 * first[nt] the total): the t with first[t] <= b < first[t + 1] (a tensor without parts is never chosen). */
__device__ int part_owner(const int64_t *first, int nt, int64_t b)
{
    int lo = 0, hi = nt;
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (first[mid] <= b)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* One block a part (blockIdx.x: the part's number in tensor and part order): the finite squares and max |g| in
 * double, the Inf and NaN elements, of the part's kGradPart (or fewer) elements. Thread k adds elements k, k + 256,
 * ... in order; the 256 sums are added by a fixed tree (warp shuffles, then the 8 warps in order). So a part's
 * results depend on its elements alone: the same from a whole tensor and from a view that starts at the part. */
__global__ void grad_stats_parts_kernel(struct grad_part *out, const struct grad_table_entry *tab,
                                        const int64_t *first, int nt)
{
    __shared__ double s_sq[kStatThreads / 32], s_mx[kStatThreads / 32];
    __shared__ long long s_inf[kStatThreads / 32], s_nan[kStatThreads / 32];
    const int64_t b = blockIdx.x;
    const int t = part_owner(first, nt, b);
    const struct grad_table_entry e = tab[t];
    const uint64_t lo = (uint64_t)(b - first[t]) * kGradPart, hi = lo + kGradPart < e.n ? lo + kGradPart : e.n;
    double sq = 0.0, mx = 0.0;
    long long ni = 0, nn = 0;
    for (uint64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float g = e.p[i];
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
        struct grad_part r = {};
        for (int k = 0; k < (int)(blockDim.x >> 5); k++) {
            r.lanes[0] += s_sq[k];
            r.absmax = fmax(r.absmax, s_mx[k]);
            r.n_inf += s_inf[k];
            r.n_nan += s_nan[k];
        }
        out[b] = r;
    }
}

/* The parts' results combined, in one order whoever computed them: part c (tensor and part order) is part[at[c]]
 * (part[c] where at is NULL). Thread k adds the squares of parts [k per, (k + 1) per) in order (per: the parts over
 * kCombineThreads, rounded up), the 256 sums then added by a fixed tree in shared memory; the max and the counts
 * are exact in any order. Per tensor, its Inf and NaN counts into counts[t] and counts[nt + t]. */
__global__ void grad_stats_combine_kernel(struct grad_check *out, int64_t *counts, const struct grad_part *part,
                                          const int64_t *first, const int64_t *at, int nt)
{
    __shared__ double s_sq[kCombineThreads], s_mx[kCombineThreads];
    __shared__ long long s_bad[kCombineThreads];
    const int64_t total = first[nt], per = (total + kCombineThreads - 1) / kCombineThreads;
    const int k = threadIdx.x;
    double sq = 0.0, mx = 0.0;
    long long bad = 0;
    for (int64_t c = k * per; c < (k + 1) * per && c < total; c++) {
        const struct grad_part *r = &part[at ? at[c] : c];
        sq += r->lanes[0];
        mx = fmax(mx, r->absmax);
        bad += r->n_inf + r->n_nan;
    }
    s_sq[k] = sq;
    s_mx[k] = mx;
    s_bad[k] = bad;
    __syncthreads();
    for (int half = kCombineThreads / 2; half > 0; half >>= 1) {
        if (k < half) {
            s_sq[k] += s_sq[k + half];
            s_mx[k] = fmax(s_mx[k], s_mx[k + half]);
            s_bad[k] += s_bad[k + half];
        }
        __syncthreads();
    }
    for (int t = k; counts && t < nt; t += kCombineThreads) {
        long long ni = 0, nn = 0;
        for (int64_t c = first[t]; c < first[t + 1]; c++) {
            const struct grad_part *r = &part[at ? at[c] : c];
            ni += r->n_inf;
            nn += r->n_nan;
        }
        counts[t] = ni;
        counts[nt + t] = nn;
    }
    if (k == 0) {
        out->sumsq = s_sq[0];
        out->absmax = s_mx[0];
        out->found_nonfinite = s_bad[0] != 0;
        out->update_nonfinite = 0; /* the whole struct is this pass's, as on the CPU */
    }
}

/* The scalars the step would update with, for the trial updates; p travels by value. */
__global__ void step_propose_kernel(struct step_params p, struct step_state *state, struct grad_check *check)
{
    step_rule_propose(&p, state, check);
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

__global__ void add_partials_kernel(long long *acc, const long long *part, unsigned n)
{
    long long s = 0;
    for (unsigned i = 0; i < n; i++)
        s += part[i];
    *acc += s;
}

/* What the AdamW launch takes from the host (shared by the call's parameters); the step's scalars come from
 * struct step_scalars, each parameter's weight decay from its table entry. */
struct adamw_consts {
    float b1, b2, omb1, omb2, eps;
};

/* Whether any of a trial's values would be stored non-finite (value_rounded: as store_rounded rounds it). */
__device__ __forceinline__ bool stored_nonfinite(int dt, float v, bool stochastic, uint64_t draw, int shift)
{
    return !isfinite(value_rounded(dt, v, stochastic, draw, shift));
}

/* The running maxima of |weight|, |m| (or the momentum buffer) and v an update stores, before their rounding to the
 * stored dtype (as the CPU backend takes them; step_rule_bounded allows for it), as float bits (non-negative floats
 * order as unsigned integers), for the state's bound (struct state_bound). */
struct stored_max {
    unsigned p, m, v;
};

__device__ __forceinline__ void raise_bits(unsigned &mx, float x)
{
    unsigned b = __float_as_uint(x) & 0x7FFFFFFFu;
    mx = b > mx ? b : mx;
}

/* Element i of torch.optim.AdamW, in the CPU backend's order (adamw_range). Trial: nothing is stored; returns
 * whether the new weight or a moment would be stored non-finite. Else the stored values raise mx. */
template <bool Trial>
__device__ __forceinline__ bool update_element(const struct optim_table_entry &t, size_t i,
                                               const struct step_scalars &s, const adamw_consts &c, stored_max &mx)
{
    float gi = t.grad[i] * s.grad_mul;
    float p0 = load_elem(t.master, t.master_dt, i);
    float pi = t.weight_decay != 0.0f ? p0 * s.adam_decay : p0;
    float mi = c.b1 * load_elem(t.m, t.state_dt, i) + c.omb1 * gi;
    float vi = c.b2 * load_elem(t.v, t.state_dt, i) + c.omb2 * gi * gi;
    float denom = sqrtf(vi) / s.adam_bc2_sqrt + c.eps;
    float np = pi + s.adam_neg_step * mi / denom;
    uint64_t draw = t.stochastic ? sr_bits(sr_key(t.sr_seed, s.t, t.sr_param), t.sr_offset + (uint64_t)i) : 0;
    if (Trial)
        return stored_nonfinite(t.master_dt, np, t.stochastic, draw, SR_WEIGHT) ||
               stored_nonfinite(t.state_dt, mi, t.stochastic, draw, SR_M) ||
               stored_nonfinite(t.state_dt, vi, t.stochastic, draw, SR_V);
    float stored = store_rounded(t.master, t.master_dt, i, np, t.stochastic, draw, SR_WEIGHT);
    store_rounded(t.m, t.state_dt, i, mi, t.stochastic, draw, SR_M);
    store_rounded(t.v, t.state_dt, i, vi, t.stochastic, draw, SR_V);
    raise_bits(mx.p, np);
    raise_bits(mx.m, mi);
    raise_bits(mx.v, vi);
    if (t.copy)
        store_elem(t.copy, t.copy_dt, i, stored);
    return false;
}

/* What the SGD launch takes from the host (shared by the call's parameters). */
struct sgd_consts {
    float mom;
    bool nesterov;
};

/* Element i of torch.optim.SGD, in the CPU backend's order (sgd_range); t.m NULL: no momentum. Trial as AdamW's. */
template <bool Trial>
__device__ __forceinline__ bool update_element(const struct optim_table_entry &t, size_t i,
                                               const struct step_scalars &s, const sgd_consts &c, stored_max &mx)
{
    float gi = t.grad[i] * s.grad_mul, p0 = load_elem(t.master, t.master_dt, i);
    uint64_t draw = t.stochastic ? sr_bits(sr_key(t.sr_seed, s.t, t.sr_param), t.sr_offset + (uint64_t)i) : 0;
    bool bad = false;
    if (t.weight_decay != 0.0f)
        gi = gi + t.weight_decay * p0;
    if (t.m) {
        float bi = s.first_step ? gi : c.mom * load_elem(t.m, t.state_dt, i) + gi;
        if (Trial)
            bad = stored_nonfinite(t.state_dt, bi, t.stochastic, draw, SR_M);
        else
            store_rounded(t.m, t.state_dt, i, bi, t.stochastic, draw, SR_M);
        raise_bits(mx.m, bi);
        gi = c.nesterov ? gi + c.mom * bi : bi;
    }
    float np = p0 + (-s.lr) * gi;
    if (Trial)
        return bad || stored_nonfinite(t.master_dt, np, t.stochastic, draw, SR_WEIGHT);
    float stored = store_rounded(t.master, t.master_dt, i, np, t.stochastic, draw, SR_WEIGHT);
    raise_bits(mx.p, np);
    if (t.copy)
        store_elem(t.copy, t.copy_dt, i, stored);
    return false;
}

/* The warp's maxima into the bound (one atomicMax a warp and value: the max does not depend on the order). */
__device__ void bound_raise(struct state_bound *bound, stored_max mx)
{
    for (int o = 16; o > 0; o >>= 1) {
        mx.p = max(mx.p, __shfl_xor_sync(0xffffffffu, mx.p, o));
        mx.m = max(mx.m, __shfl_xor_sync(0xffffffffu, mx.m, o));
        mx.v = max(mx.v, __shfl_xor_sync(0xffffffffu, mx.v, o));
    }
    if ((threadIdx.x & 31) == 0) {
        atomicMax(reinterpret_cast<unsigned *>(&bound->pmax), mx.p);
        atomicMax(reinterpret_cast<unsigned *>(&bound->mmax), mx.m);
        atomicMax(reinterpret_cast<unsigned *>(&bound->vmax), mx.v);
    }
}

/* *trial = min(*trial, want) where 0 means none yet: the smallest entry index wins, whatever the order. */
__device__ void trial_report(unsigned long long *trial, unsigned long long want)
{
    unsigned long long cur = *trial, prev;
    while ((cur == 0 || cur > want) && (prev = atomicCAS(trial, cur, want)) != cur)
        cur = prev;
}

/* Grid (blocks per tensor, tensors): block row y updates tab[y] with a grid-stride loop over its
 * elements, each by the update's update_element (AdamW's or SGD's, by Consts). Every thread reads the
 * skip flag first: a skipped step writes nothing. A trial (Trial) runs only where sc->check asks, stores
 * nothing and reports 1 + (base + y) for a tensor with a value that would be stored non-finite; an update
 * raises `bound` (or NULL) to the magnitudes it stores. */
template <bool Trial, typename Consts>
__global__ void optim_kernel(const struct optim_table_entry *tab, const struct step_scalars *sc, Consts c,
                             unsigned long long *trial, int base, struct state_bound *bound)
{
    const struct step_scalars s = *sc;
    if (s.skip || (Trial && !s.check))
        return;
    const struct optim_table_entry t = tab[blockIdx.y];
    bool bad = false;
    stored_max mx = {0u, 0u, 0u};
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < t.numel; i += (size_t)gridDim.x * blockDim.x)
        bad |= update_element<Trial>(t, i, s, c, mx);
    if (Trial && bad)
        trial_report(trial, (unsigned long long)(base + (int)blockIdx.y) + 1ull);
    if (!Trial && bound)
        bound_raise(bound, mx);
}

/* The device table of `grads` for grad_stats_parts_kernel: nt entries, then the tensors' first parts (int64, nt + 1,
 * *first pointing at them), uploaded only when it changed (struct device_table); *total gets the parts. NULL (status
 * set) on failure. */
const struct grad_table_entry *grad_table_for(struct cuda_backend *cb, const struct tensor *const *grads, int nt,
                                              const int64_t **first, int64_t *total)
{
    size_t head = (size_t)nt * sizeof(struct grad_table_entry), bytes = head + ((size_t)nt + 1) * sizeof(int64_t);
    char *build = static_cast<char *>(device_table_begin(cb, &cb->gs_table, bytes, "grad_stats"));
    if (!build)
        return NULL;
    struct grad_table_entry *e = reinterpret_cast<struct grad_table_entry *>(build);
    int64_t *f = reinterpret_cast<int64_t *>(build + head);
    for (int t = 0; t < nt; t++) {
        if (grads[t]->dtype != DT_FP32) {
            cuda_record(cb, "this is a bug in the caller", "grad_stats: gradient %d is %s, not fp32", t,
                        dtype_name(grads[t]->dtype));
            return NULL;
        }
        e[t].p = static_cast<const float *>(grads[t]->data);
        e[t].n = grads[t]->numel;
        f[t + 1] = f[t] + (int64_t)((grads[t]->numel + kGradPart - 1) / kGradPart);
    }
    *total = f[nt];
    if (*total > INT32_MAX) { /* one block a part: gridDim.x */
        cuda_record(cb, "this is a bug in the caller", "grad_stats: %lld parts exceed one launch's grid",
                    (long long)*total);
        return NULL;
    }
    const char *dev = static_cast<const char *>(device_table_commit(cb, &cb->gs_table, CSCR_GS_DESC, bytes));
    if (!dev)
        return NULL;
    *first = reinterpret_cast<const int64_t *>(dev + head);
    return reinterpret_cast<const struct grad_table_entry *>(dev);
}

/* Blocks per tensor of an optimizer launch: enough for kOptimPerThread elements a thread over the
 * largest tensor, at most kOptimMaxBlocks (the rest grid-stride). */
unsigned optim_blocks_for(uint64_t max_numel)
{
    uint64_t per_block = (uint64_t)kOptimThreads * kOptimPerThread;
    uint64_t b = (max_numel + per_block - 1) / per_block;
    return b < 1 ? 1u : b > kOptimMaxBlocks ? kOptimMaxBlocks : (unsigned)b;
}

/* The table entry of parameter `a`: adamw reads m and v; sgd a momentum buffer only where it has one and
 * momentum is on (the CPU's rule). */
struct optim_table_entry optim_entry_of(const struct optim_update_args *a, bool adamw)
{
    struct optim_table_entry e;
    memset(&e, 0, sizeof e); /* padding compares equal (device_table_commit) */
    e.master = a->master->data;
    e.master_dt = a->master->dtype;
    e.grad = static_cast<const float *>(a->grad->data);
    if (adamw) {
        e.m = a->m->data;
        e.v = a->v->data;
    } else {
        e.m = a->m && a->momentum != 0.0f ? a->m->data : NULL;
        e.v = NULL;
    }
    e.state_dt = a->m ? a->m->dtype : DT_FP32;
    e.copy = a->copy ? a->copy->data : NULL;
    e.copy_dt = a->copy ? a->copy->dtype : DT_FP32;
    e.numel = a->master->numel;
    e.weight_decay = a->weight_decay;
    e.stochastic = a->stochastic;
    e.sr_seed = a->sr_seed;
    e.sr_param = a->sr_param;
    e.sr_offset = a->sr_offset;
    return e;
}

bool same_bits(float x, float y)
{
    return memcmp(&x, &y, sizeof x) == 0;
}

/* The device table of the n parameters, uploaded only when it changed (struct device_table). NULL
 * (status set) on failure. */
const struct optim_table_entry *optim_table_for(struct cuda_backend *cb, const struct optim_update_args *a, int n,
                                                bool adamw)
{
    size_t bytes = (size_t)n * sizeof(struct optim_table_entry);
    struct optim_table_entry *e = static_cast<struct optim_table_entry *>(
        device_table_begin(cb, &cb->opt_table, bytes, adamw ? "adamw_update" : "sgd_update"));
    if (!e)
        return NULL;
    for (int t = 0; t < n; t++)
        e[t] = optim_entry_of(&a[t], adamw);
    return static_cast<const struct optim_table_entry *>(device_table_commit(cb, &cb->opt_table, CSCR_OPT_DESC, bytes));
}

/* Entry i against entry 0 and its own shapes; a violation is a bug in the caller. */
bool optim_entry_ok(struct cuda_backend *cb, const struct optim_update_args *a, int i, bool adamw, const char *op)
{
    const struct optim_update_args *e = &a[i], *a0 = &a[0];
    const char *hint = "this is a bug in the caller: one call's entries share sc and the hyperparameters (backend.h)";
    if (e->sc != a0->sc) {
        cuda_record(cb, hint, "%s: entry %d has other step scalars than entry 0", op, i);
        return false;
    }
    bool shared = adamw ? e->beta1 == a0->beta1 && e->beta2 == a0->beta2 && same_bits(e->eps, a0->eps)
                        : same_bits(e->momentum, a0->momentum) && e->nesterov == a0->nesterov;
    if (!shared) {
        cuda_record(cb, hint, "%s: entry %d has other %s than entry 0", op, i,
                    adamw ? "betas or eps" : "momentum or nesterov");
        return false;
    }
    size_t n = e->master->numel;
    bool fits = (e->master->dtype == DT_FP32 || e->master->dtype == DT_BF16) && e->grad->dtype == DT_FP32 &&
                e->grad->numel == n && (!e->copy || e->copy->numel == n);
    if (adamw)
        fits = fits && e->m && e->v && e->m->numel == n && e->v->numel == n && e->m->dtype == e->v->dtype;
    else
        fits = fits && (!e->m || e->m->numel == n);
    fits = fits && (!e->m || e->m->dtype == DT_FP32 || e->m->dtype == DT_BF16);
    if (!fits) {
        cuda_record(cb, "this is a bug in the caller: see struct optim_update_args (backend.h)",
                    "%s: entry %d: the master (fp32 or bf16), fp32 gradient%s and copy must all have %zu elements",
                    op, i, adamw ? ", m, v" : ", momentum buffer", n);
        return false;
    }
    return true;
}

/* The n parameters of one update call are consistent; *max_numel gets the largest. */
bool optim_args_ok(struct cuda_backend *cb, const struct optim_update_args *a, int n, bool adamw,
                   uint64_t *max_numel)
{
    const char *op = adamw ? "adamw_update" : "sgd_update";
    if (!a[0].sc) {
        cuda_record(cb, "this is a bug in the caller: pass the step_scalars step_finish wrote",
                    "%s without step scalars (optim_update_args.sc is NULL)", op);
        return false;
    }
    *max_numel = 0;
    for (int i = 0; i < n; i++) {
        if (!optim_entry_ok(cb, a, i, adamw, op))
            return false;
        if (a[i].master->numel > *max_numel)
            *max_numel = a[i].master->numel;
    }
    return true;
}

/* adamw_update / sgd_update: one launch per kMaxTensorsPerLaunch parameters (the grid's y limit). */
void optim_update(struct backend *be, const struct optim_update_args *a, int n, bool adamw)
{
    struct cuda_backend *cb = cuda_of(be);
    uint64_t max_numel;
    if (n <= 0 || !optim_args_ok(cb, a, n, adamw, &max_numel) || !max_numel)
        return;
    const struct optim_table_entry *tab = optim_table_for(cb, a, n, adamw);
    if (!tab)
        return;
    adamw_consts adam_c;
    adam_c.b1 = (float)a->beta1;
    adam_c.b2 = (float)a->beta2;
    adam_c.omb1 = (float)(1.0 - a->beta1); /* in double, as PyTorch passes 1 - beta */
    adam_c.omb2 = (float)(1.0 - a->beta2);
    adam_c.eps = a->eps;
    sgd_consts sgd_c;
    sgd_c.mom = a->momentum;
    sgd_c.nesterov = a->nesterov;
    unsigned blocks = optim_blocks_for(max_numel);
    for (int off = 0; off < n; off += kMaxTensorsPerLaunch) {
        int left = n - off;
        dim3 grid(blocks, (unsigned)(left < kMaxTensorsPerLaunch ? left : kMaxTensorsPerLaunch));
        unsigned long long *trial = reinterpret_cast<unsigned long long *>(a->trial);
        if (adamw) {
            if (trial)
                optim_kernel<true><<<grid, kOptimThreads, 0, cb->stream>>>(tab + off, a->sc, adam_c, trial, off, a->bound);
            else
                optim_kernel<false><<<grid, kOptimThreads, 0, cb->stream>>>(tab + off, a->sc, adam_c, trial, off, a->bound);
            CB_LAUNCHED(cb, "optim_kernel (adamw)");
        } else {
            if (trial)
                optim_kernel<true><<<grid, kOptimThreads, 0, cb->stream>>>(tab + off, a->sc, sgd_c, trial, off, a->bound);
            else
                optim_kernel<false><<<grid, kOptimThreads, 0, cb->stream>>>(tab + off, a->sc, sgd_c, trial, off, a->bound);
            CB_LAUNCHED(cb, "optim_kernel (sgd)");
        }
    }
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
    const int64_t S = (int64_t)logits->numel / N; /* the row stride: K, or the padded vocabulary */
    if (S < K || (int64_t)logits->numel != N * S || (dlogits && dlogits->numel != logits->numel)) {
        cuda_record(cb, "this is a bug in the caller", "xent_forward_backward: logits of %zu elements are not %lld "
                    "rows of at least %lld classes", logits->numel, (long long)N, (long long)K);
        return;
    }
    xent_kernel<<<(unsigned)N, kLossThreads, 0, cb->stream>>>(
        losses ? static_cast<float *>(losses->data) : NULL, correct, dlogits ? dlogits->data : NULL,
        dlogits ? dlogits->dtype : DT_FP32, logits->data, logits->dtype, labels, N, K, S, grad_seed);
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

/* grad_stats_parts_kernel over every part of grads into out (device memory, first[nt] parts); false (status set)
 * where the table could not be had. *first and *total as grad_table_for's. */
static bool queue_parts(struct cuda_backend *cb, const struct tensor *const *grads, int ntensors,
                        struct grad_part *out, const int64_t **first, int64_t *total)
{
    const struct grad_table_entry *tab = grad_table_for(cb, grads, ntensors, first, total);
    if (!tab)
        return false;
    if (*total == 0) /* every tensor empty */
        return true;
    grad_stats_parts_kernel<<<(unsigned)*total, kStatThreads, 0, cb->stream>>>(out, tab, *first, ntensors);
    return CB_LAUNCHED(cb, "grad_stats_parts_kernel");
}

void cuda_grad_stats_parts(struct backend *be, const struct tensor *const *grads, int ntensors,
                           struct grad_part *out)
{
    struct cuda_backend *cb = cuda_of(be);
    const int64_t *first;
    int64_t total;
    if (ntensors > 0)
        queue_parts(cb, grads, ntensors, out, &first, &total);
}

void cuda_grad_stats_combine(struct backend *be, const struct grad_part *parts, const int64_t *first,
                             const int64_t *at, int ntensors, struct grad_check *out, int64_t *counts)
{
    struct cuda_backend *cb = cuda_of(be);
    if (ntensors <= 0) {
        CB_CUDA(cb, cudaMemsetAsync(out, 0, sizeof *out, cb->stream)); /* all-zero bits: 0.0, 0.0, 0 */
        return;
    }
    /* first (and at) to the device: a table uploaded only when it changed, as the tensors' */
    size_t nf = (size_t)ntensors + 1, na = at ? (size_t)first[ntensors] : 0;
    size_t bytes = (nf + na) * sizeof(int64_t);
    int64_t *h = static_cast<int64_t *>(device_table_begin(cb, &cb->gc_table, bytes, "grad_stats_combine"));
    if (!h)
        return;
    memcpy(h, first, nf * sizeof *h);
    if (na)
        memcpy(h + nf, at, na * sizeof *h);
    const int64_t *d = static_cast<const int64_t *>(device_table_commit(cb, &cb->gc_table, CSCR_GC_DESC, bytes));
    if (!d)
        return;
    grad_stats_combine_kernel<<<1, kCombineThreads, 0, cb->stream>>>(out, counts, parts, d, na ? d + nf : NULL,
                                                                     ntensors);
    CB_LAUNCHED(cb, "grad_stats_combine_kernel");
}

/* The parts of every tensor, then their combination: the two halves above in one pass, the parts in scratch. */
void cuda_grad_stats(struct backend *be, const struct tensor *const *grads, int ntensors, struct grad_check *out,
                     int64_t *counts)
{
    struct cuda_backend *cb = cuda_of(be);
    if (ntensors <= 0) {
        CB_CUDA(cb, cudaMemsetAsync(out, 0, sizeof *out, cb->stream)); /* all-zero bits: 0.0, 0.0, 0 */
        return;
    }
    int64_t parts = 0;
    for (int t = 0; t < ntensors; t++)
        parts += (int64_t)((grads[t]->numel + kGradPart - 1) / kGradPart);
    /* the scratch before the table: growing CSCR_PARTIAL never touches CSCR_GS_DESC */
    struct grad_part *part = static_cast<struct grad_part *>(
        cuda_scratch(cb, CSCR_PARTIAL, (size_t)(parts > 0 ? parts : 1) * sizeof(struct grad_part)));
    const int64_t *first;
    int64_t total;
    if (!part || !queue_parts(cb, grads, ntensors, part, &first, &total))
        return;
    grad_stats_combine_kernel<<<1, kCombineThreads, 0, cb->stream>>>(out, counts, part, first, NULL, ntensors);
    CB_LAUNCHED(cb, "grad_stats_combine_kernel");
}

void cuda_step_propose(struct backend *be, const struct step_params *p, struct step_state *state,
                       struct grad_check *check)
{
    struct cuda_backend *cb = cuda_of(be);
    step_propose_kernel<<<1, 1, 0, cb->stream>>>(*p, state, check);
    CB_LAUNCHED(cb, "step_propose_kernel");
}

void cuda_step_finish(struct backend *be, const struct step_params *p, struct step_state *state,
                      const struct grad_check *check, struct step_row *row)
{
    struct cuda_backend *cb = cuda_of(be);
    step_finish_kernel<<<1, 1, 0, cb->stream>>>(*p, state, check, row);
    CB_LAUNCHED(cb, "step_finish_kernel");
}

void cuda_count_zeros(struct backend *be, const struct tensor *t, int64_t *acc)
{
    struct cuda_backend *cb = cuda_of(be);
    if (!t->numel)
        return;
    unsigned blocks = grid_for(t->numel);
    if (blocks > 1024)
        blocks = 1024;
    long long *part = static_cast<long long *>(cuda_scratch(cb, CSCR_PARTIAL2, blocks * sizeof(long long)));
    if (!part)
        return;
    count_zeros_partial_kernel<<<blocks, kThreads, 0, cb->stream>>>(part, t->data, t->dtype, t->numel);
    add_partials_kernel<<<1, 1, 0, cb->stream>>>(reinterpret_cast<long long *>(acc), part, blocks);
    CB_LAUNCHED(cb, "count_zeros kernels");
}

void cuda_adamw_update(struct backend *be, const struct optim_update_args *a, int n)
{
    optim_update(be, a, n, true);
}

void cuda_sgd_update(struct backend *be, const struct optim_update_args *a, int n)
{
    optim_update(be, a, n, false);
}
