/*
 * gemm.c — the CPU backend's matrix products: the gemm op (with its ReLU epilogues), gemm_core (the one
 * product routine every op uses: convolutions and attention too), the per-worker product of the sliced ops,
 * and the bias gradient (column sums of dy).
 *
 * gemm_core takes A and B of one dtype to gemm_avx512.c where the CPU has AVX-512 (and AMPTRAIN_GEMM_PORTABLE is
 * unset): the vector path, in its own file beside this one. Elsewhere it is the portable path: fp32 operands to
 * OpenBLAS's cblas_sgemm as they are, 16-bit ones first widened to fp32 scratch (exact), a 16-bit C accumulated
 * in fp32 scratch and rounded once. fp8 operands are widened to bf16 (exact) and multiplied as bf16. The two
 * paths accumulate in different orders, so their last bits differ (docs/backend.md, "AVX-512 GEMM on the CPU");
 * tests/test_gemm_avx512.c holds the vector path to its own reference. Writes C (beta 0 never reads it) or
 * accumulates into it (beta); db is overwritten or accumulated (beta) from double column sums.
 */
#include "cpu_internal.h" /* struct cpu_backend, scratch, dtype helpers, mat_in/mat_out */

#include <cblas.h>         /* cblas_sgemm: the portable path */

#include "gemm_avx512.h" /* gemm_avx512, gemm_avx512_threaded: fp32, fp16 and bf16 products with AVX-512 */

/* The (rows, cols) operand as fp32 for sgemm: itself, or widened row by row into `slot`. */
static const float *operand_f32(struct cpu_backend *cb, enum scratch_slot slot, struct mat_in a, int64_t rows,
                                int64_t cols, int64_t *ld)
{
    if (a.dt == DT_FP32) {
        *ld = a.ld;
        return (const float *)a.p;
    }
    float *p = scratch_get(cb, slot, (size_t)(rows * cols) * sizeof(float));
    if (!p)
        return NULL;
    for (int64_t r = 0; r < rows; r++)
        dtype_convert(p + r * cols, DT_FP32, elem_ptr(a.p, a.dt, (size_t)(r * a.ld)), a.dt, (size_t)cols);
    *ld = cols;
    return p;
}

/* Products smaller than this many multiply-adds run on one thread: waking the pool costs more than it
 * saves. (Threaded or not, a product has the same bits: gemm_avx512.h, gemm_avx512_threaded.) */
#define GEMM_PAR_MACS ((int64_t)1 << 19)

/* A and B of one dtype through gemm_avx512, same contract as cpu_gemm_core. The scratch is taken before C
 * is touched, so a failure to grow it leaves C unwritten. With several threads the product is shared out as
 * gemm_avx512_plan says, each thread packing into its own buffers (wscr) and into the shared one. */
static void gemm_core_avx512(struct cpu_backend *cb, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                             struct mat_in a, struct mat_in b, float beta, struct mat_out c, const float *bias)
{
    struct gemm_avx512_scratch s;
    struct gemm_avx512_plan plan;
    const bool amx = gemm_uses_amx(cb, a.dt);
    gemm_avx512_scratch_sizes(a.dt, amx, m, n, k, &s);
    gemm_avx512_plan(a.dt, amx, m, n, k, &plan);
    const int threads = cpu_threads(cb);
    const bool par = threads > 1 && m * n * k >= GEMM_PAR_MACS && plan.chunks > 1;
    void *pa = NULL, *pb = NULL;
    if (par) {
        if (!cpu_wscratch_reserve(cb, WSCR_PACK_A, plan.worker_a_bytes) ||
            (plan.worker_b_bytes && !cpu_wscratch_reserve(cb, WSCR_GEMM_B, plan.worker_b_bytes)))
            return;
        for (int w = 0; w < threads; w++) {
            cb->wpack_a[w] = cb->wscr[w][WSCR_PACK_A].p;
            cb->wpack_b[w] = cb->wscr[w][WSCR_GEMM_B].p;
        }
        if (plan.shared_b_bytes && !(pb = scratch_get(cb, SCR_GEMM_B, plan.shared_b_bytes)))
            return;
    } else if (!(pa = scratch_get(cb, SCR_GEMM_A, s.pack_a_bytes)) || !(pb = scratch_get(cb, SCR_GEMM_B, s.pack_b_bytes))) {
        return;
    }
    float *partial = NULL;
    /* more than one k block: partial sums in C itself where that is fp32 and not read, else in scratch */
    if (s.partial_bytes && !(c.dt == DT_FP32 && beta == 0.0f && !bias)) {
        partial = scratch_get(cb, SCR_GEMM_C, s.partial_bytes);
        if (!partial)
            return;
    }
    struct gemm_avx512_args g = { .in = a.dt, .amx = amx, .ta = ta, .tb = tb, .m = m, .n = n, .k = k, .alpha = alpha,
                                  .beta = beta, .a = a.p, .lda = a.ld, .b = b.p, .ldb = b.ld, .c = c.p,
                                  .c_dt = c.dt, .ldc = c.ld, .bias = bias, .row_bias = c.row_bias,
                                  .relu = c.relu, .relu_mask = c.relu_mask, .ldr = c.ldr };
    if (par)
        gemm_avx512_threaded(&g, &plan, cb->pool, cb->wpack_a, cb->wpack_b, pb, partial);
    else
        gemm_avx512(&g, pa, pb, partial);
}

/* An fp8 operand (rows, cols) widened to bf16 in `slot`, which holds every fp8 value exactly (E4M3's and
 * E5M2's exponents are within bf16's, their 3 and 2 mantissa bits within its 7); other dtypes as they are. */
static bool fp8_widen(struct cpu_backend *cb, enum scratch_slot slot, struct mat_in *a, int64_t rows, int64_t cols)
{
    if (!dtype_is_fp8(a->dt))
        return true;
    uint16_t *p = scratch_get(cb, slot, (size_t)(rows * cols) * sizeof(uint16_t));
    if (!p)
        return false;
    uint16_t table[256]; /* each code's bf16 bits */
    enum fp8_format f = a->dt == DT_FP8_E4M3 ? FP8_E4M3 : FP8_E5M2;
    for (int v = 0; v < 256; v++)
        table[v] = bf16_from_fp32(fp8_to_fp32((uint8_t)v, f));
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *src = elem_ptr(a->p, a->dt, (size_t)(r * a->ld));
        uint16_t *dst = p + r * cols;
        for (int64_t j = 0; j < cols; j++)
            dst[j] = table[src[j]];
    }
    *a = (struct mat_in){ .p = p, .dt = DT_BF16, .ld = cols };
    return true;
}

/* fp8 A and B (any pair of formats): widened to bf16, whose products are as exact and whose sums are fp32, then
 * the bf16 product. alpha already holds the operands' scale_inv (cpu_gemm), so alpha * sum is rounded: accumulated
 * into C (beta != 0, a weight gradient over micro-batches) the product is formed and rounded apart, then added,
 * C = beta * C + product, so two micro-batches give the bits of two ranks' all-reduce (and of the GPU's epilogue),
 * where a fused alpha * sum + beta * C would round once. */
static void gemm_core_fp8(struct cpu_backend *cb, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                          struct mat_in a, struct mat_in b, float beta, struct mat_out c, const float *bias)
{
    if (!fp8_widen(cb, SCR_FP8_A, &a, ta ? k : m, ta ? m : k) || !fp8_widen(cb, SCR_FP8_B, &b, tb ? n : k, tb ? k : n))
        return;
    if (beta == 0.0f) {
        cpu_gemm_core(cb, ta, tb, m, n, k, alpha, a, b, beta, c, bias);
        return;
    }
    assert(c.dt == DT_FP32 && !bias && !c.row_bias);
    float *p = scratch_get(cb, SCR_FP8_C, (size_t)(m * n) * sizeof(float));
    if (!p)
        return;
    cpu_gemm_core(cb, ta, tb, m, n, k, alpha, a, b, 0.0f, out_mat_f32(p, n), NULL);
    float *cf = (float *)c.p;
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < n; j++)
            cf[r * c.ld + j] = beta * cf[r * c.ld + j] + p[r * n + j];
}

/* C (m, n) = alpha * op(A) @ op(B) + beta * C [+ bias (n) on every row, or + c.row_bias (m) on every column,
 * with beta 0], rounded once to C's dtype. beta 0 never reads C. */
void cpu_gemm_core(struct cpu_backend *cb, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                      struct mat_in a, struct mat_in b, float beta, struct mat_out c, const float *bias)
{
    assert(!bias || beta == 0.0f);
    assert(!c.row_bias || (beta == 0.0f && !bias));
    if (m <= 0 || n <= 0)
        return;
    if (a.blocks || b.blocks) {
        cpu_gemm_blockwise(cb, ta, tb, m, n, k, alpha, a, b, beta, c, bias);
        return;
    }
    if (dtype_is_fp8(a.dt) || dtype_is_fp8(b.dt)) {
        gemm_core_fp8(cb, ta, tb, m, n, k, alpha, a, b, beta, c, bias);
        return;
    }
    if (gemm_takes_avx512(cb, k, a.dt, b.dt, c.dt)) {
        gemm_core_avx512(cb, ta, tb, m, n, k, alpha, a, b, beta, c, bias);
        return;
    }
    assert(!c.relu && !c.relu_mask); /* gemm_relu applies them after the product elsewhere */
    int64_t lda = 0, ldb = 0, ldc;
    const float *af = operand_f32(cb, SCR_GEMM_A, a, ta ? k : m, ta ? m : k, &lda);
    const float *bf = operand_f32(cb, SCR_GEMM_B, b, tb ? n : k, tb ? k : n, &ldb);
    if (!af || !bf)
        return;
    float *cf;
    /* fp32 C accumulated into (beta != 0: a gradient over micro-batches): the product is formed apart and
     * then added, C = beta * C + product, as gemm_avx512 does, so the sum of two micro-batches has the bits
     * of two ranks' all-reduce whichever path runs. */
    float *acc_into = c.dt == DT_FP32 && beta != 0.0f && k > 0 ? (float *)c.p : NULL;
    float acc_beta = beta;
    if (acc_into) {
        cf = scratch_get(cb, SCR_GEMM_C, (size_t)(m * n) * sizeof(float));
        if (!cf)
            return;
        ldc = n;
        beta = 0.0f;
    } else if (c.dt == DT_FP32) {
        cf = (float *)c.p;
        ldc = c.ld;
    } else {
        cf = scratch_get(cb, SCR_GEMM_C, (size_t)(m * n) * sizeof(float));
        if (!cf)
            return;
        ldc = n;
        if (beta != 0.0f)
            for (int64_t r = 0; r < m; r++)
                dtype_convert(cf + r * n, DT_FP32, elem_ptr(c.p, c.dt, (size_t)(r * c.ld)), c.dt, (size_t)n);
    }
    if (bias) {
        for (int64_t r = 0; r < m; r++)
            memcpy(cf + r * ldc, bias, (size_t)n * sizeof(float));
        beta = 1.0f;
    } else if (c.row_bias) {
        for (int64_t r = 0; r < m; r++)
            for (int64_t j = 0; j < n; j++)
                cf[r * ldc + j] = c.row_bias[r];
        beta = 1.0f;
    }
    if (k == 0) {
        for (int64_t r = 0; r < m; r++)
            scale_f32(cf + r * ldc, (size_t)n, beta);
    } else {
        cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, blas_dim(m),
                    blas_dim(n), blas_dim(k), alpha, af, blas_dim(lda), bf, blas_dim(ldb), beta, cf, blas_dim(ldc));
    }
    if (acc_into)
        for (int64_t r = 0; r < m; r++)
            for (int64_t j = 0; j < n; j++)
                acc_into[r * c.ld + j] = acc_beta * acc_into[r * c.ld + j] + cf[r * n + j];
    else if (c.dt != DT_FP32)
        for (int64_t r = 0; r < m; r++)
            dtype_convert(elem_ptr(c.p, c.dt, (size_t)(r * c.ld)), c.dt, cf + r * n, DT_FP32, (size_t)n);
}

/* GEMM_EPI_RELU, GEMM_EPI_RELU_MASK (backend.h): in gemm_avx512's epilogue, where the product runs there (the
 * one pass over C: no second one reading what the product's threads left in their caches); else the plain
 * product, then the ReLU op itself over C, in place. The same bits either way (gemm_avx512.c, epilogue). */
static void gemm_relu(struct cpu_backend *cb, const struct gemm_args *g)
{
    const bool mask = g->epilogue == GEMM_EPI_RELU_MASK;
    assert(g->batch == 1 && g->beta == 0.0f && gemm_dtypes_ok(g));
    assert(!mask || (g->aux && g->aux->dtype == g->c->dtype && (int64_t)g->aux->numel == g->m * g->n));
    const float *bias = g->bias ? (const float *)g->bias->data : NULL;
    struct mat_in a = { g->a->data, g->a->dtype, g->trans_a ? g->m : g->k, blocks_of(&g->a_blocks) };
    struct mat_in b = { g->b->data, g->b->dtype, g->trans_b ? g->k : g->n, blocks_of(&g->b_blocks) };
    struct mat_out c = { .p = g->c->data, .dt = g->c->dtype, .ld = g->n };
    const bool fused = gemm_takes_avx512(cb, g->k, a.dt, b.dt, c.dt);
    if (fused) {
        c.relu = !mask;
        c.relu_mask = mask ? g->aux->data : NULL;
        c.ldr = g->n;
    }
    cpu_gemm_core(cb, g->trans_a, g->trans_b, g->m, g->n, g->k, gemm_alpha(g), a, b, 0.0f, c, bias);
    if (fused)
        return;
    if (mask)
        cpu_act_backward(&cb->base, ACT_RELU, g->c, g->c, g->aux);
    else
        cpu_act_forward(&cb->base, ACT_RELU, g->c, g->c);
}

void cpu_gemm(struct backend *be, const struct gemm_args *g)
{
    struct cpu_backend *cb = cpu_of(be);
    assert(!g->lda || (g->epilogue == GEMM_EPI_NONE && g->lda >= (g->trans_a ? g->m : g->k)));
    if (g->epilogue == GEMM_EPI_GELU_TANH) {
        cpu_gemm_gelu(cb, g);
        return;
    }
    if (g->epilogue == GEMM_EPI_RELU || g->epilogue == GEMM_EPI_RELU_MASK) {
        gemm_relu(cb, g);
        return;
    }
    assert(g->batch >= 1);
    assert(gemm_dtypes_ok(g)); /* the contract; cpu_gemm_core itself would take any pair */
    assert(!g->bias || (g->bias->dtype == DT_FP32 && (int64_t)g->bias->numel == g->n));
    const float *bias = g->bias ? (const float *)g->bias->data : NULL;
    const float alpha = gemm_alpha(g);
    for (int64_t i = 0; i < g->batch; i++) {
        struct mat_in a = { elem_ptr(g->a->data, g->a->dtype, (size_t)(i * g->stride_a)), g->a->dtype,
                            g->lda ? g->lda : g->trans_a ? g->m : g->k, blocks_of(&g->a_blocks) };
        struct mat_in b = { elem_ptr(g->b->data, g->b->dtype, (size_t)(i * g->stride_b)), g->b->dtype,
                            g->trans_b ? g->k : g->n, blocks_of(&g->b_blocks) };
        struct mat_out c = { .p = elem_ptr(g->c->data, g->c->dtype, (size_t)(i * g->stride_c)), .dt = g->c->dtype,
                             .ld = g->n };
        cpu_gemm_core(cb, g->trans_a, g->trans_b, g->m, g->n, g->k, alpha, a, b, g->beta, c, bias);
    }
}

/* ---- per-worker products of the sliced ops ---------------------------------------------------- */

/* cpu_worker_gemm's panels for an (m, n, k) product of inputs `in` on every worker. */
bool cpu_worker_gemm_reserve(struct cpu_backend *cb, enum dtype in, int64_t m, int64_t n, int64_t k)
{
    struct gemm_avx512_scratch s;
    gemm_avx512_scratch_sizes(in, gemm_uses_amx(cb, in), m, n, k, &s);
    return cpu_wscratch_reserve(cb, WSCR_PACK_A, s.pack_a_bytes) &&
           cpu_wscratch_reserve(cb, WSCR_GEMM_B, s.pack_b_bytes) &&
           cpu_wscratch_reserve(cb, WSCR_GEMM_C, s.partial_bytes);
}

/* C (m, n) = alpha op(A) @ op(B) + beta * C, A and B of dtype `in` (m, n, k >= 1), C fp32 or `in`,
 * single-threaded in worker w's own panels (WSCR_GEMM_C holds the partial sums where gemm_avx512 needs
 * them): the call gemm_core_avx512 makes, so the same bits (gemm_avx512.h: the threaded driver's bits are the
 * single-threaded one's). Only where cb->gemm_avx512[in]. The one per-worker product: a convolution's image
 * and an attention pair both run theirs here. */
void cpu_worker_gemm(const struct cpu_backend *cb, int worker, enum dtype in, bool ta, bool tb, int64_t m,
                        int64_t n, int64_t k, float alpha, const void *a, int64_t lda, const void *b, int64_t ldb,
                        float beta, struct mat_out c)
{
    struct gemm_avx512_scratch s;
    const bool amx = gemm_uses_amx(cb, in);
    gemm_avx512_scratch_sizes(in, amx, m, n, k, &s);
    const bool own = c.dt == DT_FP32 && beta == 0.0f; /* C itself holds the partial sums */
    float *partial = s.partial_bytes && !own ? wscratch(cb, worker, WSCR_GEMM_C) : NULL;
    struct gemm_avx512_args g = { .in = in, .amx = amx, .ta = ta, .tb = tb, .m = m, .n = n, .k = k, .alpha = alpha,
                                  .beta = beta, .a = a, .lda = lda, .b = b, .ldb = ldb, .c = c.p, .c_dt = c.dt,
                                  .ldc = c.ld, .bias = NULL, .row_bias = c.row_bias };
    gemm_avx512(&g, wscratch(cb, worker, WSCR_PACK_A), wscratch(cb, worker, WSCR_GEMM_B), partial);
}

HOT_LOOP static void add_row(double *acc, const float *r, int64_t n)
{
    for (int64_t j = 0; j < n; j++)
        acc[j] += r[j];
}

/* The bias gradient's columns are cut into chunks of BIAS_GRAD_COLS (one chunk when the whole problem is
 * under EW_CHUNK elements): each chunk sums its columns over every row, rows in order, so each column's
 * double sum is the one a single thread forms. */
#define BIAS_GRAD_COLS 256

struct bias_grad_job {
    const struct cpu_backend *cb;
    double *acc;           /* (n) */
    const struct tensor *dy;
    int64_t m, n, cols;    /* cols: columns a chunk */
};

static void bias_grad_chunk(void *arg, int64_t chunk, int worker)
{
    const struct bias_grad_job *j = arg;
    const int64_t j0 = chunk * j->cols, nj = j->n - j0 < j->cols ? j->n - j0 : j->cols;
    float *row = wscratch(j->cb, worker, WSCR_TMP0);
    for (int64_t i = 0; i < j->m; i++)
        add_row(j->acc + j0, load_f32(j->dy->data, j->dy->dtype, (size_t)(i * j->n + j0), (size_t)nj, row), nj);
}

void cpu_bias_grad(struct backend *be, struct tensor *db, const struct tensor *dy, int64_t m, int64_t n,
                          float beta)
{
    struct cpu_backend *cb = cpu_of(be);
    assert(db->dtype == DT_FP32 && (int64_t)db->numel == n && (int64_t)dy->numel == m * n);
    const int64_t cols = (size_t)(m * n) < EW_CHUNK ? (n > 0 ? n : 1) : BIAS_GRAD_COLS;
    double *acc = scratch_get(cb, SCR_ACC0, (size_t)n * sizeof(double));
    if (!acc || !cpu_wscratch_rows(cb) || !wstage_reserve(cb, WSCR_TMP0, dy, (size_t)cols))
        return;
    memset(acc, 0, (size_t)n * sizeof(double));
    struct bias_grad_job j = { .cb = cb, .acc = acc, .dy = dy, .m = m, .n = n, .cols = cols };
    parallel_for(cb->pool, (n + cols - 1) / cols, bias_grad_chunk, &j);
    store_acc((float *)db->data, acc, (size_t)n, beta);
}
