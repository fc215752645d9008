/*
 * gradstats.c — the CPU backend's fused gradient-statistics pass (per tensor: non-finite counts, the finite sum
 * of squares in double, the max magnitude), the step's tail (step_propose / step_finish: lib/base/step_rule.h, the
 * same definition the CUDA kernel runs) and count_zeros.
 *
 * The plain loop (grad_stats_one) is the reference; beside it its AVX-512 main loop (grad_stats_avx512), element i
 * to lane i % 8, multiply then add (no FMA), so the same double sums bit for bit.
 *
 * A part is one EW_CHUNK-element chunk of a tensor (the backend's grad_part_numel). grad_stats is the parts' results
 * (grad_stats_parts, threaded) combined in tensor and chunk order (grad_stats_combine); ranks that each hold some of
 * a reduced gradient's parts (dist.zero 1) run the two halves apart and get the same bits.
 */
#include "cpu_internal.h" /* struct cpu_backend, scratch, dtype helpers */

static bool bits_nonfinite(uint32_t u)
{
    return (u & 0x7F800000u) == 0x7F800000u;
}

/* One chunk's statistics are a struct grad_part (backend.h): sumsq into 8 lanes (element i of the chunk to lane
 * i % 8), absmax, the non-finite elements counted, and told apart only when present. */

#ifdef HAVE_AVX512_INTRIN
__attribute__((target("avx512f,avx512vl"))) static size_t grad_stats_avx512(const float *g, size_t n, double sq[8],
                                                                   double *mx, int64_t *bad);
#endif

HOT_LOOP static void grad_stats_one(const float *g, size_t n, struct grad_part *out)
{
    int64_t bad = 0;
    double mx = 0.0;
    double *lanes = out->lanes;
    for (int l = 0; l < 8; l++)
        lanes[l] = 0.0;
    size_t i = 0;
#ifdef HAVE_AVX512_INTRIN
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl"))
        i = grad_stats_avx512(g, n, lanes, &mx, &bad);
#endif
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) {
            uint32_t u;
            memcpy(&u, &g[i + l], sizeof u);
            bool nf = bits_nonfinite(u);
            double v = nf ? 0.0 : (double)g[i + l];
            lanes[l] += v * v;
            double av = fabs(v);
            mx = av > mx ? av : mx;
            bad += nf;
        }
    for (; i < n; i++) {
        uint32_t u;
        memcpy(&u, &g[i], sizeof u);
        bool nf = bits_nonfinite(u);
        double v = nf ? 0.0 : (double)g[i];
        lanes[i % 8] += v * v;
        double av = fabs(v);
        mx = av > mx ? av : mx;
        bad += nf;
    }
    out->absmax = mx;
    out->n_inf = out->n_nan = 0;
    if (bad)
        for (size_t j = 0; j < n; j++) {
            if (isinf(g[j]))
                out->n_inf++;
            else if (isnan(g[j]))
                out->n_nan++;
        }
}

#ifdef HAVE_AVX512_INTRIN
/* The main loop of grad_stats_one with AVX-512: lane l of `sq` gets the same double products added in
 * the same order as the portable loop (element i goes to lane i % 8; multiply, then add: no FMA), and
 * max does not depend on order, so the results are bit-identical. Returns elements consumed. */
__attribute__((target("avx512f,avx512vl"))) static size_t grad_stats_avx512(const float *g, size_t n, double sq[8],
                                                                   double *mx, int64_t *bad)
{
    __m512d acc = _mm512_loadu_pd(sq), vmax = _mm512_set1_pd(*mx);
    const __m256i expo = _mm256_set1_epi32(0x7F800000);
    int64_t nb = 0;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i bits = _mm256_loadu_si256((const __m256i *)(const void *)(g + i));
        __mmask8 nf = _mm256_cmpeq_epi32_mask(_mm256_and_si256(bits, expo), expo);
        __m512d v = _mm512_maskz_cvtps_pd((__mmask8)~nf, _mm256_castsi256_ps(bits));
        acc = _mm512_add_pd(acc, _mm512_mul_pd(v, v));
        vmax = _mm512_max_pd(vmax, _mm512_abs_pd(v));
        nb += __builtin_popcount((unsigned)nf);
    }
    _mm512_storeu_pd(sq, acc);
    *mx = _mm512_reduce_max_pd(vmax);
    *bad += nb;
    return i;
}
#endif

/* The gradients in EW_CHUNK-element chunks, numbered on from tensor to tensor (first[t] is tensor t's first),
 * as optim_run's; part[c] is chunk c's statistics. */
struct gs_job {
    const struct tensor *const *grads;
    int n;
    const int64_t *first; /* n + 1 */
    struct grad_part *part;
};

/* Which of n tensors chunk `chunk` belongs to, their chunks numbered on from tensor to tensor (first[i] is
 * tensor i's first, first[n] the total): the i with first[i] <= chunk < first[i + 1]. */
int cpu_chunk_owner(const int64_t *first, int n, int64_t chunk)
{
    int lo = 0, hi = n;
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (first[mid] <= chunk)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

static void gs_chunk(const struct gs_job *j, int64_t chunk, struct grad_part *out)
{
    const int i = cpu_chunk_owner(j->first, j->n, chunk);
    const struct tensor *t = j->grads[i];
    size_t off = (size_t)(chunk - j->first[i]) * EW_CHUNK;
    size_t n = t->numel - off < EW_CHUNK ? t->numel - off : EW_CHUNK;
    assert(t->dtype == DT_FP32);
    grad_stats_one((const float *)t->data + off, n, out);
}

static void gs_chunk_job(void *arg, int64_t chunk, int worker)
{
    (void)worker;
    const struct gs_job *j = arg;
    gs_chunk(j, chunk, &j->part[chunk]);
}

/* The combination, in one order whoever computed the parts: the totals start at zero (and the per-tensor counts), then
 * gs_add of every part in tensor and chunk order, then gs_end. */
static void gs_begin(struct grad_check *out, int64_t *counts, int ntensors, double lanes[8])
{
    for (int l = 0; l < 8; l++)
        lanes[l] = 0.0;
    out->absmax = 0.0;
    out->found_nonfinite = 0;
    out->update_nonfinite = 0; /* the whole struct is this pass's (step_propose zeroes it again for its trial) */
    for (int t = 0; t < 2 * ntensors; t++)
        counts[t] = 0;
}

/* Part r of tensor t: its 8 lanes added into the 8 totals (lane by lane), absmax taken, its counts added. */
static void gs_add(struct grad_check *out, int64_t *counts, int ntensors, int t, double lanes[8],
                   const struct grad_part *r)
{
    for (int l = 0; l < 8; l++)
        lanes[l] += r->lanes[l];
    out->absmax = r->absmax > out->absmax ? r->absmax : out->absmax;
    counts[t] += r->n_inf;
    counts[ntensors + t] += r->n_nan;
    if (r->n_inf || r->n_nan)
        out->found_nonfinite = 1;
}

static void gs_end(struct grad_check *out, const double lanes[8])
{
    out->sumsq = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

void cpu_grad_stats_combine(struct backend *be, const struct grad_part *parts, const int64_t *first,
                            const int64_t *at, int ntensors, struct grad_check *out, int64_t *counts)
{
    (void)be;
    double lanes[8];
    gs_begin(out, counts, ntensors, lanes);
    for (int t = 0; t < ntensors; t++)
        for (int64_t c = first[t]; c < first[t + 1]; c++)
            gs_add(out, counts, ntensors, t, lanes, &parts[at ? at[c] : c]);
    gs_end(out, lanes);
}

/* first[0..n]: the tensors' chunks numbered on from tensor to tensor (first[n] the total); NULL out of memory (a
 * caller's stack_first where n < 65). */
static int64_t *gs_first(const struct tensor *const *grads, int n, int64_t *stack_first)
{
    int64_t *first = n < 65 ? stack_first : malloc(((size_t)n + 1) * sizeof *first);
    if (!first)
        return NULL;
    first[0] = 0;
    for (int t = 0; t < n; t++)
        first[t + 1] = first[t] + ew_chunks(grads[t]->numel);
    return first;
}

/* Tensor t's chunk c directly (no chunk table). */
static void gs_direct(const struct tensor *t, int64_t c, struct grad_part *out)
{
    size_t off = (size_t)c * EW_CHUNK, n = t->numel - off < EW_CHUNK ? t->numel - off : EW_CHUNK;
    assert(t->dtype == DT_FP32);
    grad_stats_one((const float *)t->data + off, n, out);
}

void cpu_grad_stats_parts(struct backend *be, const struct tensor *const *grads, int ntensors, struct grad_part *out)
{
    struct cpu_backend *cb = cpu_of(be);
    int64_t stack_first[65], *first = gs_first(grads, ntensors, stack_first);
    if (first) {
        struct gs_job job = {.grads = grads, .n = ntensors, .first = first, .part = out};
        parallel_for(cb->pool, first[ntensors], gs_chunk_job, &job);
        if (first != stack_first)
            free(first);
        return;
    }
    int64_t k = 0; /* no memory for the chunk table: one chunk at a time, the same results */
    for (int t = 0; t < ntensors; t++)
        for (int64_t c = 0; c < ew_chunks(grads[t]->numel); c++)
            gs_direct(grads[t], c, &out[k++]);
}

/* The fused check over fixed chunks (fixed by the tensors' sizes alone), threaded; then, in chunk order,
 * each chunk's 8 lanes added into 8 totals (lane by lane), absmax taken, and the non-finite counts summed
 * per tensor (cpu_grad_stats_combine). So the sum of squares has the same bits for any thread count. Without scratch
 * for the chunks' results the chunks run here one at a time, each combined as it is done: the same additions. */
void cpu_grad_stats(struct backend *be, const struct tensor *const *grads, int ntensors,
                           struct grad_check *out, int64_t *counts)
{
    struct cpu_backend *cb = cpu_of(be);
    int64_t stack_first[65], *first = gs_first(grads, ntensors, stack_first);
    struct grad_part *part = NULL;
    if (first)
        part = scratch_get(cb, SCR_ACC1, (size_t)(first[ntensors] > 0 ? first[ntensors] : 1) * sizeof *part);
    if (part) {
        cpu_grad_stats_parts(be, grads, ntensors, part);
        cpu_grad_stats_combine(be, part, first, NULL, ntensors, out, counts);
    } else {
        double lanes[8];
        gs_begin(out, counts, ntensors, lanes);
        for (int t = 0; t < ntensors; t++)
            for (int64_t c = 0; c < ew_chunks(grads[t]->numel); c++) {
                struct grad_part one;
                gs_direct(grads[t], c, &one);
                gs_add(out, counts, ntensors, t, lanes, &one);
            }
        gs_end(out, lanes);
    }
    if (first && first != stack_first)
        free(first);
}

void cpu_step_propose(struct backend *be, const struct step_params *p, struct step_state *state,
                             struct grad_check *check)
{
    (void)be;
    step_rule_propose(p, state, check);
}

void cpu_step_finish(struct backend *be, const struct step_params *p, struct step_state *state,
                            const struct grad_check *check, struct step_row *row)
{
    (void)be;
    step_rule_finish(p, state, check, row);
}

/* Threaded in EW_CHUNK-element chunks, one count each, summed in chunk order (integers: exact anyway). */
struct zeros_job {
    const struct tensor *t;
    int64_t *counts; /* one per chunk */
};

static void count_zeros_chunk(void *arg, int64_t chunk, int worker)
{
    (void)worker;
    const struct zeros_job *j = arg;
    size_t lo = (size_t)chunk * EW_CHUNK, n = j->t->numel, hi = n - lo < EW_CHUNK ? n : lo + EW_CHUNK;
    int64_t zeros = 0;
    if (j->t->dtype == DT_FP32) {
        const uint32_t *u = (const uint32_t *)j->t->data;
        for (size_t i = lo; i < hi; i++)
            zeros += (u[i] & 0x7FFFFFFFu) == 0;
    } else {
        const uint16_t *u = (const uint16_t *)j->t->data;
        for (size_t i = lo; i < hi; i++)
            zeros += (u[i] & 0x7FFFu) == 0;
    }
    j->counts[chunk] = zeros;
}

void cpu_count_zeros(struct backend *be, const struct tensor *t, int64_t *acc)
{
    struct cpu_backend *cb = cpu_of(be);
    int64_t n_chunks = ew_chunks(t->numel);
    int64_t *counts = scratch_get(cb, SCR_ACC1, (size_t)(n_chunks > 0 ? n_chunks : 1) * sizeof(int64_t));
    if (!counts)
        return;
    struct zeros_job j = { .t = t, .counts = counts };
    parallel_for(cb->pool, n_chunks, count_zeros_chunk, &j);
    int64_t zeros = 0;
    for (int64_t c = 0; c < n_chunks; c++)
        zeros += counts[c];
    *acc += zeros;
}
