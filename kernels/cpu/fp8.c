/*
 * fp8.c — the CPU backend's fp8 ops: fp8_cast (a tensor to E4M3 or E5M2 with a scale, its amax and saturation
 * counts, and where asked its codes transposed too), fp8_update (the delayed-scaling history and scale of every
 * group in one call, lib/base/fp8.h's recipe arithmetic), and recipe blockwise's emulation: fp8_block_cast (a matrix to E4M3 with one scale per 1x128 tile or 128x128 block) and
 * cpu_gemm_blockwise, the product of two block-scaled operands (backend.h, gemm_args: per 128-wide block of K the
 * exact sum of the code products rounded once to fp32, times the two tiles' scale_inv, added to an fp32
 * accumulator, blocks in order).
 * Both are plain scalar loops: the reference a GPU's block-scaled product is held to.
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

/* The cast-transpose's second output: the codes of dst (rows, cols) transposed into dst_t (cols, rows), a plain
 * loop over the codes the cast wrote, so they are the same bits by construction. */
static void fp8_transpose_codes(uint8_t *dst_t, const uint8_t *dst, int64_t rows, int64_t cols)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            dst_t[c * rows + r] = dst[r * cols + c];
}

void cpu_fp8_cast(struct backend *be, const struct fp8_cast_args *a)
{
    struct cpu_backend *cb = cpu_of(be);
    const struct tensor *src = a->src;
    struct tensor *dst = a->dst;
    assert(dtype_is_fp8(dst->dtype) && !dtype_is_fp8(src->dtype) && dst->numel == src->numel);
    assert(!a->dst_t || (a->dst_t->dtype == dst->dtype && a->rows >= 0 && a->cols >= 0 &&
                         (size_t)(a->rows * a->cols) == dst->numel && a->dst_t->numel == dst->numel));
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
    if (a->dst_t)
        fp8_transpose_codes(a->dst_t->data, dst->data, a->rows, a->cols);
}

/* One group's update (backend.h fp8_update_args), the row already read. */
static void update_one_group(const struct fp8_update_group *g, const struct fp8_update_args *a, int row)
{
    for (int i = 0; g->pending && i < g->n; i++) {
        float *h = &g->history[(size_t)row * (size_t)g->n + (size_t)i];
        *h = fmaxf(*h, g->pending[i]);
        g->pending[i] = 0.0f;
    }
    for (int i = 0; i < g->n; i++) {
        float amax = fp8_history_amax(g->history, g->n, a->len, row, i, a->most_recent);
        g->scale[i] = fp8_scale_from_amax(amax, g->fmax, a->margin, g->scale[i], false);
        g->scale_inv[i] = 1.0f / g->scale[i];
    }
    int next = (row + 1) % a->len;
    memset(g->history + (size_t)next * (size_t)g->n, 0, (size_t)g->n * sizeof(float));
}

void cpu_fp8_update(struct backend *be, const struct fp8_update_args *a)
{
    (void)be;
    assert(a->len >= 1 && a->ngroups >= 0 && a->ngroups <= FP8_UPDATE_MAX_GROUPS);
    int row = a->step ? (int)(*a->step % a->len) : a->row; /* the step read from memory now, as a device reads it */
    assert(row >= 0 && row < a->len);
    for (int k = 0; k < a->ngroups; k++) /* the groups name distinct memory: their order moves no bit */
        update_one_group(&a->groups[k], a, row);
}

/* ---- recipe blockwise ----------------------------------------------------------------------------------- */

/* One tile's cast: the elements (r0..r1, c0..c1) of v (cols wide), scale from their amax. */
struct block_tile {
    int64_t r0, r1, c0, c1;
};

static float block_tile_cast(const float *v, int64_t cols, struct block_tile t, uint8_t *out, int64_t *counts)
{
    float amax = 0.0f;
    for (int64_t r = t.r0; r < t.r1; r++)
        for (int64_t c = t.c0; c < t.c1; c++)
            amax = fp8_amax_fold(amax, v[r * cols + c]);
    const float scale = fp8_block_scale(amax);
    for (int64_t r = t.r0; r < t.r1; r++)
        for (int64_t c = t.c0; c < t.c1; c++) {
            float x = v[r * cols + c];
            uint8_t code = fp8_from_fp32(x * scale, FP8_E4M3, 1);
            out[r * cols + c] = code;
            if (!counts || x == 0.0f || isnan(x))
                continue;
            counts[2]++;
            counts[0] += (fp8_from_fp32(x * scale, FP8_E4M3, 0) & 0x7F) == 0x7F;
            counts[1] += (code & 0x7F) == 0;
        }
    return 1.0f / scale; /* exact: a power of two */
}

void cpu_fp8_block_cast(struct backend *be, const struct fp8_block_cast_args *a)
{
    struct cpu_backend *cb = cpu_of(be);
    const int64_t rows = a->rows, cols = a->cols;
    assert(a->dst->dtype == DT_FP8_E4M3 && !dtype_is_fp8(a->src->dtype));
    assert((int64_t)a->dst->numel >= rows * cols && (int64_t)a->src->numel >= rows * cols);
    if (rows <= 0 || cols <= 0)
        return;
    float *v = scratch_get(cb, SCR_TMP0, (size_t)(rows * cols) * sizeof(float));
    if (!v)
        return;
    dtype_convert(v, DT_FP32, a->src->data, a->src->dtype, (size_t)(rows * cols));
    uint8_t *out = a->dst->data;
    const int64_t tr = a->tiling == FP8_TILES_ROWS ? 1 : FP8_BLOCK; /* a tile's rows and columns */
    const int64_t tc = a->tiling == FP8_TILES_COLS ? 1 : FP8_BLOCK;
    int64_t counts[3] = {0, 0, 0};
    for (int64_t r0 = 0; r0 < rows; r0 += tr)
        for (int64_t c0 = 0; c0 < cols; c0 += tc) {
            struct block_tile t = { r0, r0 + tr < rows ? r0 + tr : rows, c0, c0 + tc < cols ? c0 + tc : cols };
            a->scale_inv[fp8_tiling_index(a->tiling, cols, r0, c0)] =
                block_tile_cast(v, cols, t, out, a->counts ? counts : NULL);
        }
    if (a->counts) {
        a->counts[0] += counts[0];
        a->counts[1] += counts[1];
        a->counts[2] += counts[2];
        a->counts[3] += rows * cols;
    }
}

/* One operand of a block-scaled product as the loops read it: op(X)'s `outer` rows (A's m, or B's n: op(B)
 * transposed), each `k` values long, the E4M3 codes' values unscaled (exact in fp32) in vals (outer, k), and the
 * scale_inv of each row's K blocks in inv (outer, ceil(k / 128)). */
static bool block_operand(struct mat_in x, bool k_is_stored_rows, int64_t outer, int64_t k, float *vals, float *inv)
{
    assert(x.dt == DT_FP8_E4M3 && x.blocks && x.blocks->scale_inv);
    const enum fp8_tiling t = x.blocks->tiling;
    /* the tiles must lie along K */
    if (t != FP8_BLOCKS && (t == FP8_TILES_COLS) != k_is_stored_rows)
        return false;
    float table[256];
    for (int c = 0; c < 256; c++)
        table[c] = fp8_to_fp32((uint8_t)c, FP8_E4M3);
    const uint8_t *codes = x.p;
    const int64_t cols = k_is_stored_rows ? outer : k, nkb = fp8_tiles(k);
    for (int64_t i = 0; i < outer; i++) {
        for (int64_t kk = 0; kk < k; kk++) {
            int64_t r = k_is_stored_rows ? kk : i, c = k_is_stored_rows ? i : kk;
            vals[i * k + kk] = table[codes[r * x.ld + c]];
        }
        for (int64_t b = 0; b < nkb; b++) {
            int64_t kk = b * FP8_BLOCK, r = k_is_stored_rows ? kk : i, c = k_is_stored_rows ? i : kk;
            inv[i * nkb + b] = x.blocks->scale_inv[fp8_tiling_index(t, cols, r, c)];
        }
    }
    return true;
}

/* The sum of n <= 128 products of E4M3 values, rounded once to fp32. Every E4M3 value is a multiple of 2^-9 below
 * 2^9, so each product (exact in fp32) is a multiple of 2^-18 below 2^18, and every partial sum of up to 128 of them
 * a multiple of 2^-18 below 2^25: an integer times 2^-18 under 2^43, exact in double whatever the order. So four
 * lanes summed apart, then together, give the exact sum, which is rounded once. */
HOT_LOOP static float block_sum(const float *a, const float *b, int64_t n)
{
    double l0 = 0.0, l1 = 0.0, l2 = 0.0, l3 = 0.0;
    int64_t k = 0;
    for (; k + 4 <= n; k += 4) {
        l0 += (double)(a[k] * b[k]);
        l1 += (double)(a[k + 1] * b[k + 1]);
        l2 += (double)(a[k + 2] * b[k + 2]);
        l3 += (double)(a[k + 3] * b[k + 3]);
    }
    for (; k < n; k++)
        l0 += (double)(a[k] * b[k]);
    return (float)((l0 + l1) + (l2 + l3));
}

/* Rows of C a chunk: fixed by nothing but this constant, and each element computed alone, so the bits do not
 * depend on the threads. */
#define BLOCK_GEMM_ROWS 8

struct block_gemm_job {
    const float *av, *ai, *bv, *bi; /* block_operand's vals and inv of op(A) (m rows) and of op(B)^T (n rows) */
    float *p;                       /* (m, n) fp32: alpha * the product */
    int64_t m, n, k;
    float alpha;
};

static void block_gemm_chunk(void *arg, int64_t chunk, int worker)
{
    (void)worker;
    const struct block_gemm_job *j = arg;
    const int64_t nkb = fp8_tiles(j->k), i1 = (chunk + 1) * BLOCK_GEMM_ROWS;
    for (int64_t i = chunk * BLOCK_GEMM_ROWS; i < (i1 < j->m ? i1 : j->m); i++)
        for (int64_t jj = 0; jj < j->n; jj++) {
            const float *a = j->av + i * j->k, *b = j->bv + jj * j->k;
            float acc = 0.0f;
            for (int64_t blk = 0; blk < nkb; blk++) {
                const int64_t k0 = blk * FP8_BLOCK, k1 = k0 + FP8_BLOCK < j->k ? k0 + FP8_BLOCK : j->k;
                const float s = block_sum(a + k0, b + k0, k1 - k0);
                const float f = j->ai[i * nkb + blk] * j->bi[jj * nkb + blk];
                acc += s * f; /* f a power of two: s * f exact but for underflow */
            }
            j->p[i * j->n + jj] = j->alpha * acc;
        }
}

/* C (m, n) = alpha * op(A) @ op(B) (+ bias) + beta * C for block-scaled E4M3 A and B (backend.h, gemm_args),
 * rounded once to C's dtype: the product into fp32 scratch (or C itself, fp32 and beta 0), then bias and beta
 * as cpu_gemm_core applies them (a C accumulated into gets beta * C + product). */
void cpu_gemm_blockwise(struct cpu_backend *cb, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                        struct mat_in a, struct mat_in b, float beta, struct mat_out c, const float *bias)
{
    assert(a.blocks && b.blocks && !c.row_bias && !c.relu && !c.relu_mask && (!bias || beta == 0.0f));
    const int64_t nkb = fp8_tiles(k);
    float *av = scratch_get(cb, SCR_FP8_A, (size_t)(m * k + m * nkb) * sizeof(float));
    float *bv = scratch_get(cb, SCR_FP8_B, (size_t)(n * k + n * nkb) * sizeof(float));
    const bool direct = c.dt == DT_FP32 && beta == 0.0f;
    float *p = direct ? (float *)c.p : scratch_get(cb, SCR_FP8_C, (size_t)(m * n) * sizeof(float));
    if (!av || !bv || !p)
        return;
    if (!block_operand(a, ta, m, k, av, av + m * k) || !block_operand(b, !tb, n, k, bv, bv + n * k)) {
        assert(!"a block-scaled operand's tiles do not lie along K");
        if (cb->status == AMP_OK)
            cb->status = amp_fail(&cb->err, AMP_ERR_INTERNAL, "this is a bug in the caller (backend.h, gemm_args)",
                                  "gemm: a block-scaled operand's tiles do not lie along K");
        return;
    }
    assert(!direct || c.ld == n);
    struct block_gemm_job j = { .av = av, .ai = av + m * k, .bv = bv, .bi = bv + n * k, .p = p, .m = m, .n = n,
                                .k = k, .alpha = alpha };
    parallel_for(cb->pool, (m + BLOCK_GEMM_ROWS - 1) / BLOCK_GEMM_ROWS, block_gemm_chunk, &j);
    for (int64_t r = 0; r < m; r++) {
        float *row = p + r * n;
        if (bias)
            for (int64_t jj = 0; jj < n; jj++)
                row[jj] += bias[jj];
        if (direct)
            continue;
        if (beta != 0.0f) {
            assert(c.dt == DT_FP32);
            float *cf = (float *)c.p + r * c.ld;
            for (int64_t jj = 0; jj < n; jj++)
                cf[jj] = beta * cf[jj] + row[jj];
        } else {
            dtype_convert(elem_ptr(c.p, c.dt, (size_t)(r * c.ld)), c.dt, row, DT_FP32, (size_t)n);
        }
    }
}
