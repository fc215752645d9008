/*
 * fp8.c — the CPU backend's fp8 ops: fp8_cast (a tensor to E4M3 or E5M2 with a scale, its amax and saturation
 * counts) and fp8_update (the delayed-scaling history and scale, lib/base/fp8.h's recipe arithmetic).
 */
#include "cpu_internal.h" /* struct cpu_backend, scratch, dtype helpers, EW_CHUNK */

#include "fp8.h" /* fp8_scale_from_amax, fp8_amax_fold: the fp8 recipes' arithmetic */

/* Threaded in EW_CHUNK-element chunks, twice: the amax (one per chunk, folded in chunk order; a max, so
 * the same value in any order), then the cast, elementwise, with the saturation counts (integers, one set
 * per chunk, summed in chunk order). */
struct fp8_cast_job {
    const struct tensor *src;
    uint8_t *out;
    enum fp8_format f;
    float scale;
    bool counts;
    float *amax;       /* one per chunk */
    int64_t *tallies;  /* 3 per chunk: saturated, flushed, nonzero */
};

static void fp8_amax_chunk(void *arg, int64_t chunk, int worker)
{
    (void)worker;
    const struct fp8_cast_job *j = arg;
    size_t lo = (size_t)chunk * EW_CHUNK, n = j->src->numel, hi = n - lo < EW_CHUNK ? n : lo + EW_CHUNK;
    float buf[BLOCK], amax = 0.0f;
    for (size_t i = lo; i < hi; i += BLOCK) {
        size_t c = hi - i < BLOCK ? hi - i : BLOCK;
        const float *v = load_f32(j->src->data, j->src->dtype, i, c, buf);
        for (size_t k = 0; k < c; k++)
            amax = fp8_amax_fold(amax, v[k]);
    }
    j->amax[chunk] = amax;
}

static void fp8_cast_chunk(void *arg, int64_t chunk, int worker)
{
    (void)worker;
    const struct fp8_cast_job *j = arg;
    size_t lo = (size_t)chunk * EW_CHUNK, n = j->src->numel, hi = n - lo < EW_CHUNK ? n : lo + EW_CHUNK;
    const float scale = j->scale;
    const enum fp8_format f = j->f;
    uint8_t *out = j->out;
    float buf[BLOCK];
    int64_t sat = 0, flushed = 0, nonzero = 0;
    for (size_t i = lo; i < hi; i += BLOCK) {
        size_t c = hi - i < BLOCK ? hi - i : BLOCK;
        const float *v = load_f32(j->src->data, j->src->dtype, i, c, buf);
        for (size_t k = 0; k < c; k++)
            out[i + k] = fp8_from_fp32(v[k] * scale, f, 1);
        if (j->counts)
            for (size_t k = 0; k < c; k++) {
                if (v[k] == 0.0f || isnan(v[k]))
                    continue;
                nonzero++;
                uint8_t raw = fp8_from_fp32(v[k] * scale, f, 0) & 0x7F;
                sat += f == FP8_E4M3 ? raw == 0x7F : raw >= 0x7C;
                flushed += (out[i + k] & 0x7F) == 0;
            }
    }
    int64_t *t = j->tallies + 3 * chunk;
    t[0] = sat;
    t[1] = flushed;
    t[2] = nonzero;
}

void cpu_fp8_cast(struct backend *be, const struct fp8_cast_args *a)
{
    struct cpu_backend *cb = cpu_of(be);
    const struct tensor *src = a->src;
    struct tensor *dst = a->dst;
    assert(dtype_is_fp8(dst->dtype) && !dtype_is_fp8(src->dtype) && dst->numel == src->numel);
    size_t n = src->numel;
    int64_t n_chunks = ew_chunks(n), slots = n_chunks > 0 ? n_chunks : 1;
    struct fp8_cast_job j = { .src = src, .out = dst->data, .f = dst->dtype == DT_FP8_E4M3 ? FP8_E4M3 : FP8_E5M2,
                              .counts = a->counts != NULL,
                              .amax = scratch_get(cb, SCR_ACC0, (size_t)slots * sizeof(float)),
                              .tallies = scratch_get(cb, SCR_ACC1, (size_t)slots * 3 * sizeof(int64_t)) };
    if (!j.amax || !j.tallies)
        return;
    if (a->current || a->amax) {
        parallel_for(cb->pool, n_chunks, fp8_amax_chunk, &j);
        float amax = 0.0f;
        for (int64_t c = 0; c < n_chunks; c++)
            amax = fmaxf(amax, j.amax[c]);
        if (a->current) {
            *a->scale = fp8_scale_from_amax(amax, fp8_max(j.f), a->margin, *a->scale, true);
            *a->scale_inv = 1.0f / *a->scale;
        }
        if (a->amax)
            *a->amax = fp8_amax_fold(*a->amax, amax);
    }
    j.scale = *a->scale;
    parallel_for(cb->pool, n_chunks, fp8_cast_chunk, &j);
    if (a->counts) {
        for (int64_t c = 0; c < n_chunks; c++) {
            a->counts[0] += j.tallies[3 * c];
            a->counts[1] += j.tallies[3 * c + 1];
            a->counts[2] += j.tallies[3 * c + 2];
        }
        a->counts[3] += (int64_t)n;
    }
}

void cpu_fp8_update(struct backend *be, const struct fp8_update_args *a)
{
    (void)be;
    assert(a->len >= 1 && a->row >= 0 && a->row < a->len);
    for (int i = 0; i < a->n; i++) {
        float amax = fp8_history_amax(a->history, a->n, a->len, a->row, i, a->most_recent);
        a->scale[i] = fp8_scale_from_amax(amax, a->fmax, a->margin, a->scale[i], false);
        a->scale_inv[i] = 1.0f / a->scale[i];
    }
    int next = (a->row + 1) % a->len;
    memset(a->history + (size_t)next * (size_t)a->n, 0, (size_t)a->n * sizeof(float));
}
