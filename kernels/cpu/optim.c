/*
 * optim.c — the CPU backend's optimizer updates, AdamW and SGD (momentum, Nesterov), over many tensors a call.
 *
 * Updates p, m and v in place in fp32 (or bf16 masters and moments, rounded to nearest or stochastically), and
 * writes each parameter's 16-bit copy; on a skipped step nothing moves. A trial run of the same arithmetic finds
 * an update that would store a non-finite value before any is stored. The loops are plain C compiled per ISA
 * (HOT_LOOP, SR_LOOP), the same operations in every clone, so the same bits on any CPU.
 */
#include "cpu_internal.h" /* struct cpu_backend, scratch, dtype helpers, EW_CHUNK */

#include "sround.h" /* bf16_round_stochastic: bf16 master weights and moments */

static bool optim_dtype_ok(const struct tensor *t, size_t n)
{
    return !t || ((t->dtype == DT_FP32 || t->dtype == DT_BF16) && t->numel == n);
}

static void optim_check(const struct optim_update_args *a)
{
    assert(a->grad->dtype == DT_FP32 && a->grad->numel == a->master->numel);
    assert(optim_dtype_ok(a->master, a->master->numel));
    assert(optim_dtype_ok(a->m, a->master->numel) && optim_dtype_ok(a->v, a->master->numel));
    assert(!a->copy || (a->copy->numel == a->master->numel && a->copy->dtype != a->master->dtype));
    (void)a;
    (void)optim_dtype_ok;
}

/* The fresh weights of block [off, off + n) into the copy, converted once. */
static void optim_store_copy(const struct optim_update_args *a, size_t off, size_t n)
{
    if (a->copy)
        dtype_convert(elem_ptr(a->copy->data, a->copy->dtype, off), a->copy->dtype,
                      elem_ptr(a->master->data, a->master->dtype, off), a->master->dtype, n);
}

/* The updates run a block at a time: n elements of a tensor stored in fp32 or bf16, widened into buf (or, for
 * fp32, the tensor's own elements, except in a trial, which must not write them), updated there in fp32, then
 * stored back rounded once (optim_block_store) or, in a trial, checked (optim_block_trial). */
static float *optim_block_load(void *base, enum dtype dt, size_t off, size_t n, float *buf, bool trial)
{
    if (dt == DT_FP32 && trial)
        return memcpy(buf, (const float *)base + off, n * sizeof *buf);
    if (dt == DT_FP32)
        return (float *)base + off;
    dtype_convert(buf, DT_FP32, (const uint16_t *)base + off, DT_BF16, n);
    return buf;
}

/* x[0..n) rounded stochastically to bf16 into d with the 16 bits at `shift` of draws off, off+1, ... of `key`
 * (lib/base/sround.h). All integer arithmetic, so every clone gives the same bits; the draw's 64-bit multiplies
 * vectorise only with AVX512DQ's vpmullq, hence x86-64-v4 (AVX-512 F/BW/DQ/VL) rather than HOT_LOOP's avx512f. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define SR_LOOP __attribute__((target_clones("arch=x86-64-v4", "default")))
#else
#define SR_LOOP
#endif
SR_LOOP static void store_bf16_stochastic(uint16_t *d, const float *x, size_t n, uint64_t key, size_t off, int shift)
{
    for (size_t i = 0; i < n; i++)
        d[i] = bf16_round_stochastic(x[i], (uint32_t)(sr_bits(key, off + i) >> shift));
}

/* Store the block back: fp32 was updated in place; bf16 to nearest even (vectorised), or stochastically with
 * the 16 bits at `shift` of each element's draw (lib/base/sround.h). */
static void optim_block_store(void *base, enum dtype dt, size_t off, size_t n, const float *x,
                              const struct optim_update_args *a, uint64_t key, int shift)
{
    if (dt == DT_FP32)
        return;
    uint16_t *d = (uint16_t *)base + off;
    if (a->stochastic)
        store_bf16_stochastic(d, x, n, key, a->sr_offset + off, shift);
    else
        dtype_convert(d, DT_BF16, x, DT_FP32, n);
}

/* A trial's block: whether any of x[0..n) would be stored non-finite in dt, rounded exactly as optim_block_store
 * rounds it (a finite fp32 value may round to a bf16 Inf, stochastically too). */
static bool optim_block_nonfinite(enum dtype dt, size_t off, size_t n, const float *x,
                                  const struct optim_update_args *a, uint64_t key, int shift)
{
    bool bad = false;
    if (dt == DT_FP32) {
        for (size_t i = 0; i < n; i++)
            bad |= !isfinite(x[i]);
        return bad;
    }
    uint16_t h[BLOCK];
    if (a->stochastic)
        store_bf16_stochastic(h, x, n, key, a->sr_offset + off, shift);
    else
        dtype_convert(h, DT_BF16, x, DT_FP32, n);
    for (size_t i = 0; i < n; i++)
        bad |= (h[i] & 0x7F80u) == 0x7F80u;
    return bad;
}

/* The largest |x[i]| of a block as the bits of a non-negative float, which order as unsigned integers: an integer
 * max, which vectorises (the state's bound, struct state_bound). */
static uint32_t block_absmax_bits(const float *x, size_t n)
{
    uint32_t mx = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t b;
        memcpy(&b, &x[i], sizeof b);
        b &= 0x7FFFFFFFu;
        mx = b > mx ? b : mx;
    }
    return mx;
}

/* *slot = max(*slot, the float of `bits`), from any thread (the max does not depend on the order). */
static void bound_raise(float *slot, uint32_t bits)
{
    float want, cur;
    memcpy(&want, &bits, sizeof want);
    __atomic_load(slot, &cur, __ATOMIC_RELAXED);
    while (want > cur && !__atomic_compare_exchange(slot, &cur, &want, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

/* A trial found a non-finite value in entry `index` of its call: *trial = min(*trial, index + 1), from any
 * thread (the smallest index wins, whatever the order). */
static void optim_trial_report(int64_t *trial, int64_t index)
{
    int64_t want = index + 1, cur = __atomic_load_n(trial, __ATOMIC_RELAXED);
    while ((cur == 0 || cur > want) &&
           !__atomic_compare_exchange_n(trial, &cur, want, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

/* torch.optim.AdamW (single-tensor, fp32): scalars are computed in double as Python does, then used
 * as fp32 (step_rule_scalars), and the tensor arithmetic runs in fp32 in PyTorch's order:
 *   p *= 1 - lr*wd;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g g;   (1-b as a double rounded to fp32)
 *   p += (-lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps)   with bc_i = 1 - b_i^step.
 * bf16 weights or moments (precision.master_weights, optim.state_dtype) are widened exactly, updated by the
 * same arithmetic, and stored rounded once. */
HOT_LOOP static void adamw_range(const struct optim_update_args *a, size_t lo, size_t hi, int64_t index)
{
    optim_check(a);
    assert(a->m && a->v);
    const struct step_scalars *sc = a->sc;
    bool trial = a->trial != NULL;
    if (sc->skip || (trial && !sc->check))
        return;
    enum dtype pd = a->master->dtype, md = a->m->dtype, vd = a->v->dtype;
    const float *g = (const float *)a->grad->data;
    float neg_step = sc->adam_neg_step, bc2_sqrt = sc->adam_bc2_sqrt, decay = sc->adam_decay;
    float b1 = (float)a->beta1, b2 = (float)a->beta2, omb1 = (float)(1.0 - a->beta1), omb2 = (float)(1.0 - a->beta2);
    float gm = sc->grad_mul, eps = a->eps;
    uint64_t key = a->stochastic ? sr_key(a->sr_seed, sc->t, a->sr_param) : 0;
    uint32_t pmax = 0, mmax = 0, vmax = 0;
    float pbuf[BLOCK], mbuf[BLOCK], vbuf[BLOCK];
    for (size_t off = lo; off < hi; off += BLOCK) {
        size_t c = hi - off < BLOCK ? hi - off : BLOCK;
        float *p = optim_block_load(a->master->data, pd, off, c, pbuf, trial);
        float *m = optim_block_load(a->m->data, md, off, c, mbuf, trial);
        float *v = optim_block_load(a->v->data, vd, off, c, vbuf, trial);
        const float *gb = g + off;
        for (size_t i = 0; i < c; i++) {
            float gi = gb[i] * gm;
            float pi = a->weight_decay != 0.0f ? p[i] * decay : p[i];
            float mi = b1 * m[i] + omb1 * gi;
            float vi = b2 * v[i] + omb2 * gi * gi;
            float denom = sqrtf(vi) / bc2_sqrt + eps;
            p[i] = pi + neg_step * mi / denom;
            m[i] = mi;
            v[i] = vi;
        }
        if (trial) {
            if (optim_block_nonfinite(pd, off, c, p, a, key, SR_WEIGHT) ||
                optim_block_nonfinite(md, off, c, m, a, key, SR_M) || optim_block_nonfinite(vd, off, c, v, a, key, SR_V))
                optim_trial_report(a->trial, index);
            continue;
        }
        if (a->bound) {
            uint32_t bp = block_absmax_bits(p, c), bm = block_absmax_bits(m, c), bv = block_absmax_bits(v, c);
            pmax = bp > pmax ? bp : pmax;
            mmax = bm > mmax ? bm : mmax;
            vmax = bv > vmax ? bv : vmax;
        }
        optim_block_store(a->master->data, pd, off, c, p, a, key, SR_WEIGHT);
        optim_block_store(a->m->data, md, off, c, m, a, key, SR_M);
        optim_block_store(a->v->data, vd, off, c, v, a, key, SR_V);
        optim_store_copy(a, off, c);
    }
    if (a->bound && !trial) {
        bound_raise(&a->bound->pmax, pmax);
        bound_raise(&a->bound->mmax, mmax);
        bound_raise(&a->bound->vmax, vmax);
    }
}

/* torch.optim.SGD (dampening 0): g = grad*mul + wd*p; buf = first_step ? g : momentum*buf + g;
 * g = nesterov ? g + momentum*buf : buf; p -= lr*g. No momentum when a->m is NULL or momentum 0. */
HOT_LOOP static void sgd_range(const struct optim_update_args *a, size_t lo, size_t hi, int64_t index)
{
    optim_check(a);
    const struct step_scalars *sc = a->sc;
    bool trial = a->trial != NULL;
    if (sc->skip || (trial && !sc->check))
        return;
    void *p = a->master->data, *buf = a->m && a->momentum != 0.0f ? a->m->data : NULL;
    enum dtype pd = a->master->dtype, bd = a->m ? a->m->dtype : DT_FP32;
    const float *g = (const float *)a->grad->data;
    float gm = sc->grad_mul, wd = a->weight_decay, mom = a->momentum, neg_lr = -sc->lr;
    bool first_step = sc->first_step != 0;
    uint64_t key = a->stochastic ? sr_key(a->sr_seed, sc->t, a->sr_param) : 0;
    uint32_t pmax = 0, bmax = 0;
    float pbuf[BLOCK], bbuf[BLOCK];
    for (size_t off = lo; off < hi; off += BLOCK) {
        size_t c = hi - off < BLOCK ? hi - off : BLOCK;
        float *pb = optim_block_load(p, pd, off, c, pbuf, trial);
        float *bb = buf ? optim_block_load(buf, bd, off, c, bbuf, trial) : NULL;
        const float *gb = g + off;
        for (size_t i = 0; i < c; i++) {
            float gi = gb[i] * gm;
            if (wd != 0.0f)
                gi = gi + wd * pb[i];
            if (bb) {
                float bi = first_step ? gi : mom * bb[i] + gi;
                bb[i] = bi;
                gi = a->nesterov ? gi + mom * bi : bi;
            }
            pb[i] = pb[i] + neg_lr * gi;
        }
        if (trial) {
            if (optim_block_nonfinite(pd, off, c, pb, a, key, SR_WEIGHT) ||
                (bb && optim_block_nonfinite(bd, off, c, bb, a, key, SR_M)))
                optim_trial_report(a->trial, index);
            continue;
        }
        if (a->bound) {
            uint32_t bp = block_absmax_bits(pb, c), bm = bb ? block_absmax_bits(bb, c) : 0;
            pmax = bp > pmax ? bp : pmax;
            bmax = bm > bmax ? bm : bmax;
        }
        if (bb)
            optim_block_store(buf, bd, off, c, bb, a, key, SR_M);
        optim_block_store(p, pd, off, c, pb, a, key, SR_WEIGHT);
        optim_store_copy(a, off, c);
    }
    if (a->bound && !trial) {
        bound_raise(&a->bound->pmax, pmax);
        bound_raise(&a->bound->mmax, bmax);
    }
}

/* The n parameters' updates as one list of chunks: parameter i's elements in EW_CHUNK ranges, chunk
 * numbers running on from parameter to parameter (first[i] is parameter i's first). Every element is
 * updated from its own values alone (stochastic rounding draws by element index, lib/base/sround.h), so the
 * chunks may run on any threads. */
struct optim_job {
    const struct optim_update_args *a;
    int n;
    const int64_t *first; /* n + 1 */
    bool adamw;
    int base;             /* a[0]'s index in the backend call (a trial reports it) */
};

static void optim_chunk(void *arg, int64_t chunk, int worker)
{
    (void)worker;
    const struct optim_job *j = arg;
    const int lo = cpu_chunk_owner(j->first, j->n, chunk);
    const struct optim_update_args *a = &j->a[lo];
    size_t n = a->master->numel, off = (size_t)(chunk - j->first[lo]) * EW_CHUNK;
    size_t end = n - off < EW_CHUNK ? n : off + EW_CHUNK;
    if (j->adamw)
        adamw_range(a, off, end, j->base + lo);
    else
        sgd_range(a, off, end, j->base + lo);
}

static void optim_run(struct cpu_backend *cb, const struct optim_update_args *a, int n, bool adamw, int base)
{
    if (n <= 0)
        return;
    int64_t stack_first[65], *first = n < 65 ? stack_first : malloc(((size_t)n + 1) * sizeof *first);
    if (!first) { /* out of memory for the chunk table: the same updates, one parameter at a time */
        for (int i = 0; i < n; i++)
            optim_run(cb, &a[i], 1, adamw, base + i);
        return;
    }
    first[0] = 0;
    for (int i = 0; i < n; i++)
        first[i + 1] = first[i] + ew_chunks(a[i].master->numel);
    struct optim_job job = { .a = a, .n = n, .first = first, .adamw = adamw, .base = base };
    parallel_for(cb->pool, first[n], optim_chunk, &job);
    if (first != stack_first)
        free(first);
}

void cpu_adamw_update(struct backend *be, const struct optim_update_args *a, int n)
{
    optim_run(cpu_of(be), a, n, true, 0);
}

void cpu_sgd_update(struct backend *be, const struct optim_update_args *a, int n)
{
    optim_run(cpu_of(be), a, n, false, 0);
}
