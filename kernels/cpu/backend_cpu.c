/*
 * backend_cpu.c — the reference backend: every operation of backend.h on the host CPU. This file holds its
 * lifetime (create, set_threads, status, destroy), memory (alloc, copies, upload_rows, convert), the scratch slots'
 * growth and the op table; the operations are in one file per family, as in kernels/cuda/, each with its plain
 * loop first and any vector version beside it (docs/backend.md, "Where the CPU backend's code is"):
 *   gemm.c (gemm, bias_grad, gemm_core; the AVX-512/AMX product in gemm_avx512.c), elementwise.c (activations,
 *   add, dropout, the GELU epilogue), conv.c, pool.c, norm.c (layernorm, batchnorm), embedding.c, attention.c,
 *   loss.c (cross-entropy, MSE, loss_sum), gradstats.c (grad_stats, step_propose/finish, count_zeros), optim.c
 *   (AdamW, SGD), fp8.c (fp8_cast, fp8_update, fp8_block_cast and the block-scaled product), planes8_avx512.c (eight channels as vector lanes, for conv.c and
 *   norm.c); cpu_internal.h is what they share.
 *
 * This is the definition the CUDA backend is held to, so it is written plainly, for exactness first;
 * only the matrix products, which carry nearly all the work, are tuned:
 *  - Tensors of dtype fp16/bf16 hold 16-bit patterns. Every op reads its inputs converted to fp32
 *    (dtype_convert, vectorised in blocks), computes in fp32 (double for reductions whose result must
 *    not depend on blocking: statistics, loss sums, column sums, the gradient norm) and rounds once,
 *    to nearest-even, when it stores a 16-bit output. fp32 tensors are read and written in place.
 *  - Matrix products go through one internal routine, cpu_gemm_core (gemm.c). Where the CPU has AVX-512 (and
 *    AMPTRAIN_GEMM_PORTABLE is not set), products whose A and B share a dtype go to gemm_avx512.c: fp32 and
 *    fp16 with FMA (fp16 widened exactly while packing), bf16 with AVX512-BF16 vdpbf16ps where the CPU
 *    has it (AMX tdpbf16ps where it has AMX too, unless AMPTRAIN_GEMM_AMX=0: other bits, gemm_avx512.h); fp32
 *    accumulation, one rounding of a 16-bit result after alpha, beta and the bias.
 *    Elsewhere (the portable path) fp32 operands are handed to OpenBLAS cblas_sgemm as they are and
 *    16-bit operands are first widened to fp32 scratch (exact, every fp16/bf16 value is an fp32 value),
 *    so the product reads the rounded inputs and accumulates in fp32 as tensor cores do; a 16-bit
 *    result is accumulated in fp32 scratch and rounded once at the end. Convolutions (im2col + GEMM)
 *    and attention use the same routine. vdpbf16ps reads bf16 subnormals as zero and flushes subnormal
 *    results (docs/backend.md, "AVX-512 GEMM on the CPU").
 *  - Scratch memory is a handful of per-backend slots that grow to the largest request and live until
 *    destroy, so the training loop does not malloc per call. A slot has one user at a time: gemm_core
 *    owns SCR_GEMM_*, the ops own the rest. Ops stage 16-bit tensors through fp32 scratch one slice at
 *    a time (an image, an (n, c) plane, a row, a sequence), never a whole activation tensor, so a
 *    16-bit run's activations stay half the size of fp32's; only gemm_core widens whole operands. A failure to grow a slot is the one error this backend
 *    records (backend->status); the op that hit it leaves its outputs unwritten.
 *  - Threads (run.threads, set_threads): one persistent pthread pool (lib/base/threadpool.h) runs the matrix
 *    products (bands of C's rows, gemm_core_avx512), the elementwise ops (activation, add, dropout), the
 *    optimizer updates, the convolutions (images), pooling (planes), batchnorm (channels), the bias
 *    gradient (columns), attention (by (batch, head)), layernorm (by rows; its parameter gradients by
 *    columns), the embedding (by rows; backward by table rows), the losses (by rows), count_zeros and
 *    fp8_cast in chunks fixed by the problem size, never by the thread count. Each chunk writes its own
 *    outputs in the order one thread would. The sums that span chunks are a convolution's dW over the
 *    images (each image's product kept apart, added in image order after parallel_for), a max and
 *    integer counts (combined in chunk order). So the bits are the same for any thread count
 *    (docs/backend.md, "Threads"). Chunks stage through per-thread scratch, grown before the pool runs.
 *    Everything else, the loss sum and the gradient check included, runs on the calling thread in a
 *    fixed order. OpenBLAS (the portable path) may use threads inside sgemm
 *    (OPENBLAS_NUM_THREADS): reproducible for a given thread count, but another count can change the last
 *    bits of a product.
 */
#include "cpu_internal.h" /* struct cpu_backend, the scratch slots, the op functions of the table */

#include "gemm_avx512.h" /* gemm_avx512_supported, gemm_avx512_amx_supported: the products' path */

/* ---- scratch --------------------------------------------------------------------------------- */

static size_t round_up_64(size_t bytes)
{
    return (bytes + 63) & ~(size_t)63;
}

/* A slot's buffer of at least `bytes`; its contents are not kept when it grows. NULL (and the
 * backend's status set) when memory runs out. */
void *cpu_scratch_grow(struct cpu_backend *cb, struct scratch *s, size_t bytes)
{
    if (bytes <= s->cap && s->p)
        return s->p;
    size_t cap = round_up_64((bytes ? bytes : 1) + bytes / 4);
    void *p = aligned_alloc(64, cap);
    if (!p) {
        if (cb->status == AMP_OK)
            cb->status = amp_fail(&cb->err, AMP_ERR_INTERNAL, "use a smaller data.batch_size or model",
                                  "out of memory: the CPU backend could not grow its scratch space to %zu bytes",
                                  cap);
        return NULL;
    }
    free(s->p);
    s->p = p;
    s->cap = cap;
    return p;
}

/* One row of worker scratch per thread of the pool, added (empty) when the pool has grown. */
bool cpu_wscratch_rows(struct cpu_backend *cb)
{
    const int threads = cpu_threads(cb);
    if (cb->wscr_rows >= threads)
        return true;
    struct scratch (*p)[WSCR_COUNT] = realloc(cb->wscr, (size_t)threads * sizeof *p);
    if (!p) {
        if (cb->status == AMP_OK)
            cb->status = amp_fail(&cb->err, AMP_ERR_INTERNAL, "set run.threads lower (or 1)",
                                  "out of memory: the CPU backend could not add scratch for %d threads", threads);
        return false;
    }
    memset(p + cb->wscr_rows, 0, (size_t)(threads - cb->wscr_rows) * sizeof *p);
    cb->wscr = p;
    cb->wscr_rows = threads;
    return true;
}

/* Grow `slot` to `bytes` for every worker. Called on the calling thread before parallel_for, so a failure
 * sets the status once and the op returns before touching an output; chunks only read the pointers. */
bool cpu_wscratch_reserve(struct cpu_backend *cb, enum worker_slot slot, size_t bytes)
{
    if (!cpu_wscratch_rows(cb))
        return false;
    for (int w = 0; w < cpu_threads(cb); w++)
        if (!cpu_scratch_grow(cb, &cb->wscr[w][slot], bytes))
            return false;
    return true;
}

/* ---- memory ---------------------------------------------------------------------------------- */

static void *cpu_alloc(struct backend *be, size_t bytes)
{
    (void)be;
    return aligned_alloc(64, round_up_64(bytes ? bytes : 1));
}

static void cpu_free(struct backend *be, void *p)
{
    (void)be;
    free(p);
}

static void cpu_copy(struct backend *be, void *dst, const void *src, size_t bytes)
{
    (void)be;
    if (bytes)
        memcpy(dst, src, bytes);
}

/* Staging: host memory is the CPU's own, so an upload is a copy, done when it returns. */
static void cpu_upload_staged(struct backend *be, void *dst, const void *src, size_t bytes, int slot)
{
    (void)slot;
    cpu_copy(be, dst, src, bytes);
}

static void cpu_staging_wait(struct backend *be, int slot)
{
    (void)be, (void)slot;
}

/* upload_rows: the gather is the copy, ROWS_CHUNK_BYTES of rows a chunk (at least one row), each row copied by
 * one thread. fashion_mlp's batch (128 rows of 3,136 bytes from a 188 MB table) is 7 chunks. */
#define ROWS_CHUNK_BYTES 65536
struct rows_job {
    char *dst;
    const char *table;
    size_t row_bytes;
    const int64_t *idx;
    int64_t n, per;
};

static void rows_chunk(void *arg, int64_t chunk, int worker)
{
    (void)worker;
    const struct rows_job *j = arg;
    for (int64_t i = chunk * j->per; i < j->n && i < (chunk + 1) * j->per; i++)
        memcpy(j->dst + (size_t)i * j->row_bytes, j->table + (size_t)j->idx[i] * j->row_bytes, j->row_bytes);
}

static void cpu_upload_rows(struct backend *be, void *dst, const void *table, size_t row_bytes, const int64_t *idx,
                            int64_t n, void *staged, int slot)
{
    (void)staged, (void)slot;
    if (n <= 0 || row_bytes == 0)
        return;
    struct rows_job j = { .dst = dst, .table = table, .row_bytes = row_bytes, .idx = idx, .n = n,
                          .per = row_bytes >= ROWS_CHUNK_BYTES ? 1 : (int64_t)(ROWS_CHUNK_BYTES / row_bytes) };
    parallel_for(cpu_of(be)->pool, (n + j.per - 1) / j.per, rows_chunk, &j);
}

static void cpu_zero(struct backend *be, struct tensor *t)
{
    (void)be;
    if (t->data)
        memset(t->data, 0, tensor_bytes(t));
}

/* The step's row and counts into the window's slot *slot (backend.h window_store_args). */
static void cpu_window_store(struct backend *be, const struct window_store_args *a)
{
    (void)be;
    int64_t slot = *a->slot;
    a->rows[slot] = *a->row;
    memcpy(a->window_counts + slot * a->ncounts, a->counts, (size_t)a->ncounts * sizeof *a->counts);
    memset(a->row, 0, sizeof *a->row);
    *a->slot = slot + 1;
}

static void cpu_synchronize(struct backend *be)
{
    (void)be;
}

/* Conversions in EW_CHUNK-element chunks on the pool: each element is converted alone. */
struct convert_job {
    struct tensor *dst;
    const struct tensor *src;
};

static void convert_chunk(void *arg, int64_t chunk, int worker)
{
    (void)worker;
    const struct convert_job *j = arg;
    size_t off = (size_t)chunk * EW_CHUNK, n = j->src->numel - off < EW_CHUNK ? j->src->numel - off : EW_CHUNK;
    dtype_convert(elem_ptr(j->dst->data, j->dst->dtype, off), j->dst->dtype,
                  elem_ptr(j->src->data, j->src->dtype, off), j->src->dtype, n);
}

static void cpu_convert(struct backend *be, struct tensor *dst, const struct tensor *src)
{
    assert(dst->numel == src->numel);
    struct convert_job j = { .dst = dst, .src = src };
    parallel_for(cpu_of(be)->pool, ew_chunks(src->numel), convert_chunk, &j);
}

/* ---- status and lifetime --------------------------------------------------------------------- */

static enum amp_status cpu_status(struct backend *be, struct amp_error *err)
{
    struct cpu_backend *cb = cpu_of(be);
    return amp_error_report(cb->status, &cb->err, err);
}

static void free_workers(struct cpu_backend *cb)
{
    threadpool_free(cb->pool);
    free(cb->wpack_a);
    free(cb->wpack_b);
    cb->pool = NULL;
    cb->wpack_a = NULL;
    cb->wpack_b = NULL;
}

/* AMPTRAIN_POOL_SPIN_US: how long an idle pool thread spins before it sleeps, in microseconds (0 to 10^6), into
 * *spin_ns; -1 where unset or empty (the pool's default). Where other busy processes share the machine, as the
 * test suites' side-by-side runs do, a spinning thread holds a CPU they need. Anything else is refused. */
static enum amp_status spin_from_env(int64_t *spin_ns, struct amp_error *err)
{
    *spin_ns = -1;
    const char *v = getenv("AMPTRAIN_POOL_SPIN_US");
    if (!v || !*v)
        return AMP_OK;
    int64_t us = 0;
    const char *c = v;
    for (; *c >= '0' && *c <= '9' && us <= 1000000; c++)
        us = us * 10 + (*c - '0');
    if (*c || us > 1000000)
        return amp_fail(err, AMP_ERR_CONFIG, "unset it, or give a whole number of microseconds from 0 to 1000000",
                        "AMPTRAIN_POOL_SPIN_US is '%.64s': not a whole number of microseconds from 0 to 1000000", v);
    *spin_ns = us * 1000;
    return AMP_OK;
}

/* The pool is made once (the engine calls this once, after backend_open); calling it again replaces it. */
static enum amp_status cpu_set_threads(struct backend *be, int threads, struct amp_error *err)
{
    struct cpu_backend *cb = cpu_of(be);
    assert(threads >= 1);
    free_workers(cb);
    int64_t spin_ns;
    enum amp_status st = spin_from_env(&spin_ns, err); /* checked at 1 thread too: a bad value never passes */
    if (st != AMP_OK)
        return st;
    /* one thread runs without a pool, except under AMPTRAIN_POOL_PROFILE: a one-thread pool runs every job inline
     * (the same bits at any count) and so gives the per-operation table at 1 thread too */
    if (threads == 1 && !getenv("AMPTRAIN_POOL_PROFILE"))
        return AMP_OK;
    cb->pool = threadpool_create_spinning(threads, spin_ns);
    cb->wpack_a = calloc((size_t)threads, sizeof *cb->wpack_a);
    cb->wpack_b = calloc((size_t)threads, sizeof *cb->wpack_b);
    if (!cb->pool || !cb->wpack_a || !cb->wpack_b) {
        free_workers(cb);
        return amp_fail(err, AMP_ERR_INTERNAL, "set run.threads lower (or 1)",
                        "the CPU backend could not start %d threads", threads);
    }
    return AMP_OK;
}

static void cpu_destroy(struct backend *be)
{
    struct cpu_backend *cb = cpu_of(be);
    if (!cb)
        return;
    for (int i = 0; i < SCR_COUNT; i++)
        free(cb->scr[i].p);
    for (int w = 0; w < cb->wscr_rows; w++)
        for (int i = 0; i < WSCR_COUNT; i++)
            free(cb->wscr[w][i].p);
    free(cb->wscr);
    free_workers(cb);
    free(cb);
}

struct backend *backend_cpu_create(void)
{
    struct cpu_backend *cb = calloc(1, sizeof *cb);
    if (!cb)
        return NULL;
    const char *portable = getenv("AMPTRAIN_GEMM_PORTABLE");
    const bool forced = portable && portable[0] && strcmp(portable, "0") != 0;
    for (int dt = 0; dt < DT_COUNT; dt++)
        cb->gemm_avx512[dt] = !forced && gemm_avx512_supported((enum dtype)dt);
    const char *amx = getenv("AMPTRAIN_GEMM_AMX");
    cb->gemm_amx = cb->gemm_avx512[DT_BF16] && !(amx && strcmp(amx, "0") == 0) && gemm_avx512_amx_supported();
    struct backend *be = &cb->base;
    be->name = "cpu";
    be->host_memory = true;
    be->vocab_align = 1; /* backend_open applies the test switch AMPTRAIN_TEST_VOCAB_ALIGN */
    be->alloc = cpu_alloc;
    be->free = cpu_free;
    be->upload = cpu_copy;
    be->download = cpu_copy;
    be->host_alloc = cpu_alloc;
    be->host_free = cpu_free;
    be->upload_staged = cpu_upload_staged;
    be->upload_rows = cpu_upload_rows;
    be->staging_wait = cpu_staging_wait;
    be->zero = cpu_zero;
    be->synchronize = cpu_synchronize;
    be->convert = cpu_convert;
    be->gemm = cpu_gemm;
    be->bias_grad = cpu_bias_grad;
    be->act_forward = cpu_act_forward;
    be->act_backward = cpu_act_backward;
    be->add = cpu_add;
    be->dropout_forward = cpu_dropout_forward;
    be->dropout_backward = cpu_dropout_backward;
    be->conv2d_forward = cpu_conv2d_forward;
    be->conv2d_backward_data = cpu_conv2d_backward_data;
    be->conv2d_backward_filter = cpu_conv2d_backward_filter;
    be->pool2d_forward = cpu_pool2d_forward;
    be->pool2d_backward = cpu_pool2d_backward;
    be->layernorm_forward = cpu_layernorm_forward;
    be->layernorm_backward = cpu_layernorm_backward;
    be->batchnorm_forward = cpu_batchnorm_forward;
    be->batchnorm_backward = cpu_batchnorm_backward;
    be->embedding_forward = cpu_embedding_forward;
    be->embedding_backward = cpu_embedding_backward;
    be->attention_forward = cpu_attention_forward;
    be->attention_backward = cpu_attention_backward;
    be->attention_decode = cpu_attention_decode;
    be->xent_forward_backward = cpu_xent_forward_backward;
    be->mse_forward_backward = cpu_mse_forward_backward;
    be->loss_sum = cpu_loss_sum;
    be->grad_stats = cpu_grad_stats;
    be->grad_part_numel = EW_CHUNK;
    be->grad_stats_parts = cpu_grad_stats_parts;
    be->grad_stats_combine = cpu_grad_stats_combine;
    be->step_propose = cpu_step_propose;
    be->step_finish = cpu_step_finish;
    be->count_zeros = cpu_count_zeros;
    be->fp8_cast = cpu_fp8_cast;
    be->fp8_update = cpu_fp8_update;
    be->fp8_block_cast = cpu_fp8_block_cast;
    be->adamw_update = cpu_adamw_update;
    be->sgd_update = cpu_sgd_update;
    be->window_store = cpu_window_store;
    be->set_threads = cpu_set_threads;
    be->status = cpu_status;
    be->destroy = cpu_destroy;
    return be;
}
