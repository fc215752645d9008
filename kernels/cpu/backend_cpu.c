/*
 * backend_cpu.c — the reference backend: every operation of backend.h on the host CPU.
 *
 * This is the definition the CUDA backend is held to, so it is written plainly, for exactness first;
 * only the matrix products, which carry nearly all the work, are tuned:
 *  - Tensors of dtype fp16/bf16 hold 16-bit patterns. Every op reads its inputs converted to fp32
 *    (dtype_convert, vectorised in blocks), computes in fp32 (double for reductions whose result must
 *    not depend on blocking: statistics, loss sums, column sums, the gradient norm) and rounds once,
 *    to nearest-even, when it stores a 16-bit output. fp32 tensors are read and written in place.
 *  - Matrix products go through one internal routine, gemm_core. Where the CPU has AVX-512 (and
 *    AMP_GEMM_PORTABLE is not set), products whose A and B share a dtype go to gemm_avx512.c: fp32 and
 *    fp16 with FMA (fp16 widened exactly while packing), bf16 with AVX512-BF16 vdpbf16ps where the CPU
 *    has it (AMX tdpbf16ps where it has AMX too, unless AMP_GEMM_AMX=0: other bits, gemm_avx512.h); fp32
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
 *  - Threads (run.threads, set_threads): one persistent pthread pool (lib/threadpool.h) runs the matrix
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
#include "backend.h"

#include <assert.h>
#include <cblas.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fp8.h"       /* fp8_scale_from_amax, fp8_amax_fold: the fp8 recipes' arithmetic */
#include "gemm_avx512.h" /* gemm_avx512: fp32, fp16 and bf16 products with AVX-512 */
#include "rng.h"       /* rng_uniform: dropout masks */
#include "threadpool.h" /* parallel_for: the ops' chunks on the backend's threads */
#include "sround.h"    /* bf16_round_stochastic: bf16 master weights and moments */
#include "vecmath.h"   /* tanh_f32: GELU */

#define BLOCK 1024 /* elements per block in elementwise loops: a few fp32 blocks stay in L1 */

/* Hot loops (elementwise ops, the optimizer, the normalisations' and bias gradients' sums, attention's
 * backward) are compiled for AVX-512, AVX2 and the baseline, picked at load time (GCC's target_clones).
 * The same operations run in the same order in every clone (ISO C mode: no FMA contraction, no
 * re-association; independent sums side by side become vector lanes, each still in its own order), so
 * results are bit-identical whichever the CPU picks. Sanitizer builds keep one version. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define HOT_LOOP __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define HOT_LOOP
#endif

/* Hand-written AVX-512 paths (max pooling, the gradient statistics) for GCC on x86-64, each taken only where
 * __builtin_cpu_supports finds its instructions, each giving the portable loop's results bit for bit. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#include <immintrin.h>
#define HAVE_AVX512_INTRIN 1
#include "bf16_lanes.h" /* bf16 lanes widened and rounded, shared with gemm_avx512.c */
#endif

static const float GELU_TANH_S = 0.7978845608028654f;  /* sqrt(2 / pi) */
static const float GELU_TANH_C = 0.044715f;
static const float INV_SQRT2 = 0.7071067811865476f;    /* 1 / sqrt(2) */
static const float INV_SQRT_2PI = 0.3989422804014327f; /* 1 / sqrt(2 pi) */

enum scratch_slot {
    SCR_GEMM_A, SCR_GEMM_B, SCR_GEMM_C, /* gemm_core: fp32 copies of 16-bit operands and result, or
                                         * the packed panels and partial sums of gemm_avx512 */
    SCR_IN0, SCR_IN1, SCR_IN2,          /* fp32 copies of one slice (image, plane, row, block) of a 16-bit input */
    SCR_TMP0, SCR_TMP1, SCR_TMP2,       /* per-op fp32 work buffers, also one slice each */
    SCR_ACC0, SCR_ACC1,                 /* per-op double accumulators */
    SCR_IDX,                            /* int32 indices: max pooling's argmax, one plane */
    SCR_FP8_A, SCR_FP8_B,               /* gemm_core: fp8 operands widened (exactly) to bf16 */
    SCR_FP8_C,                          /* gemm_core: an fp8 product accumulated into C, formed apart first */
    SCR_COUNT
};

struct scratch {
    void *p;
    size_t cap; /* bytes */
};

/* Per-worker scratch, one row of slots per thread of the pool (row w belongs to worker w; rows are added,
 * empty, when the pool grows, and kept until destroy). The threaded products pack each worker's rows of
 * op(A) into WSCR_PACK_A; the ops threaded by slices (images, planes, channels, rows, (batch, head) pairs)
 * stage and compute one slice per worker in the others, and their per-worker products (a convolution's
 * image, an attention pair) pack their operands there too. */
enum worker_slot {
    WSCR_PACK_A, WSCR_GEMM_B, WSCR_GEMM_C, /* a worker's own product: packed op(A), op(B), partial sums or a
                                            * 16-bit C in fp32 */
    WSCR_IN0, WSCR_IN1, WSCR_IN2,          /* fp32 copies of one slice of a 16-bit input */
    WSCR_TMP0, WSCR_TMP1, WSCR_TMP2,       /* fp32 work buffers, one slice each (im2col columns, a 16-bit
                                            * output's slice) */
    WSCR_IDX,                              /* int32: max pooling's argmax, one plane */
    WSCR_COUNT
};

struct cpu_backend {
    struct backend base; /* first member: the table callers hold a pointer to */
    struct scratch scr[SCR_COUNT];
    struct threadpool *pool;             /* NULL: one thread (the default until set_threads) */
    struct scratch (*wscr)[WSCR_COUNT];  /* per-worker scratch: wscr_rows rows (wscratch_reserve) */
    int wscr_rows;
    void **wpack_a;                      /* each thread's packed op(A): its wscr[w][WSCR_PACK_A].p */
    void **wpack_b;                      /* each thread's packed op(B) (a whole one): its wscr[w][WSCR_GEMM_B].p */
    enum amp_status status; /* first failure, AMP_OK when none */
    struct amp_error err;
    bool gemm_avx512[DT_COUNT]; /* products of this input dtype go through gemm_avx512 (the CPU has the
                                 * instructions, AMP_GEMM_PORTABLE unset) */
    bool gemm_amx;              /* ... and bf16 ones on AMX tiles (the CPU has AMX-BF16, AMP_GEMM_AMX not 0) */
};

static struct cpu_backend *cpu_of(struct backend *be)
{
    return (struct cpu_backend *)be;
}

/* ---- scratch --------------------------------------------------------------------------------- */

static size_t round_up_64(size_t bytes)
{
    return (bytes + 63) & ~(size_t)63;
}

/* A slot's buffer of at least `bytes`; its contents are not kept when it grows. NULL (and the
 * backend's status set) when memory runs out. */
static void *scratch_grow(struct cpu_backend *cb, struct scratch *s, size_t bytes)
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

static void *scratch_get(struct cpu_backend *cb, enum scratch_slot slot, size_t bytes)
{
    return scratch_grow(cb, &cb->scr[slot], bytes);
}

static int cpu_threads(const struct cpu_backend *cb)
{
    return threadpool_threads(cb->pool);
}

/* One row of worker scratch per thread of the pool, added (empty) when the pool has grown. */
static bool wscratch_rows(struct cpu_backend *cb)
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
static bool wscratch_reserve(struct cpu_backend *cb, enum worker_slot slot, size_t bytes)
{
    if (!wscratch_rows(cb))
        return false;
    for (int w = 0; w < cpu_threads(cb); w++)
        if (!scratch_grow(cb, &cb->wscr[w][slot], bytes))
            return false;
    return true;
}

/* The same for staging n values of t: nothing to reserve when t is fp32 (read and written in place). */
static bool wstage_reserve(struct cpu_backend *cb, enum worker_slot slot, const struct tensor *t, size_t n)
{
    return !t || t->dtype == DT_FP32 || wscratch_reserve(cb, slot, n * sizeof(float));
}

/* Worker w's buffer in `slot`: NULL when none was reserved (an fp32 tensor needs none). */
static void *wscratch(const struct cpu_backend *cb, int worker, enum worker_slot slot)
{
    return worker < cb->wscr_rows ? cb->wscr[worker][slot].p : NULL;
}

/* Elements per chunk of the elementwise ops and the optimizer: fixed (never from the thread count), a
 * multiple of BLOCK, large enough that handing a chunk to a thread costs little next to computing it. */
#define EW_CHUNK ((size_t)16 * BLOCK)

static int64_t ew_chunks(size_t n)
{
    return (int64_t)((n + EW_CHUNK - 1) / EW_CHUNK);
}

/* Rows per chunk of an op whose rows (of `cols` elements) are independent: about EW_CHUNK elements, at
 * least one row. Fixed by the shape alone; a problem of one chunk runs inline, so small ones pay nothing. */
static int64_t rows_per_chunk(int64_t cols)
{
    int64_t r = (int64_t)EW_CHUNK / (cols > 0 ? cols : 1);
    return r > 0 ? r : 1;
}

static int64_t div_up(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

/* Independent chains side by side. A channel's or a row's statistics are double sums in order, one long
 * dependent chain each, which alone would leave the adder waiting on its latency. FOR_CHAINS(n, len, l, q, body)
 * runs body for l < n (n <= CHAINS chains: channels, rows) and q < len, each chain l taking its q in order: when
 * n == CHAINS, the chains interleaved (q outer, the constant-count l inner, kept in registers), else one chain after
 * another. Each chain's operations and their order are the same either way, so are its sums. */
#define CHAINS 8
#define FOR_CHAINS(n, len, l, q, ...)                                                                                 \
    do {                                                                                                              \
        if ((n) == CHAINS)                                                                                            \
            for (int64_t q = 0; q < (len); q++)                                                                       \
                for (int l = 0; l < CHAINS; l++) {                                                                    \
                    __VA_ARGS__;                                                                                      \
                }                                                                                                     \
        else                                                                                                          \
            for (int64_t l = 0; l < (n); l++)                                                                         \
                for (int64_t q = 0; q < (len); q++) {                                                                 \
                    __VA_ARGS__;                                                                                      \
                }                                                                                                     \
    } while (0)

/* ---- dtype helpers --------------------------------------------------------------------------- */

static void *elem_ptr(const void *base, enum dtype dt, size_t i)
{
    return (char *)base + i * dtype_size(dt);
}

/* n elements of `base` (dtype dt) from element `off` as fp32: the data itself when fp32, else
 * converted into buf (n floats). */
static const float *load_f32(const void *base, enum dtype dt, size_t off, size_t n, float *buf)
{
    if (dt == DT_FP32)
        return (const float *)base + off;
    dtype_convert(buf, DT_FP32, elem_ptr(base, dt, off), dt, n);
    return buf;
}

/* Where to compute n fp32 results destined for `base` at `off`: in place when fp32, else buf. */
static float *out_f32(void *base, enum dtype dt, size_t off, float *buf)
{
    return dt == DT_FP32 ? (float *)base + off : buf;
}

/* Store results computed in out_f32's buffer: one rounding for 16-bit outputs, nothing for fp32. */
static void store_f32(void *base, enum dtype dt, size_t off, size_t n, const float *buf)
{
    if (dt != DT_FP32)
        dtype_convert(elem_ptr(base, dt, off), dt, buf, DT_FP32, n);
}

/* Staging scratch for n fp32 values read from or written to t a slice at a time (one image, one
 * plane, one row block): NULL when t is fp32 — load_f32/out_f32 then use t's data in place — else
 * slot's buffer. Ops take their staging buffers before touching any output, so a failure to grow one
 * (*ok cleared, status set) leaves the outputs unwritten. */
static float *stage_f32(struct cpu_backend *cb, enum scratch_slot slot, const struct tensor *t, size_t n, bool *ok)
{
    if (!t || t->dtype == DT_FP32)
        return NULL;
    float *p = scratch_get(cb, slot, n * sizeof(float));
    if (!p)
        *ok = false;
    return p;
}

/* The whole tensor as fp32: itself, or a converted copy in `slot`. Only for small tensors (weights). */
static const float *view_f32(struct cpu_backend *cb, enum scratch_slot slot, const struct tensor *t)
{
    if (t->dtype == DT_FP32)
        return (const float *)t->data;
    float *p = scratch_get(cb, slot, t->numel * sizeof(float));
    if (p)
        dtype_convert(p, DT_FP32, t->data, t->dtype, t->numel);
    return p;
}

/* Round fp32 values to dt and back, in place: what storing them in dt and reading them back gives. */
static void round_f32_to(float *p, size_t n, enum dtype dt)
{
    if (dt == DT_FP32)
        return;
    uint16_t tmp[BLOCK];
    for (size_t i = 0; i < n; i += BLOCK) {
        size_t c = n - i < BLOCK ? n - i : BLOCK;
        dtype_convert(tmp, dt, p + i, DT_FP32, c);
        dtype_convert(p + i, DT_FP32, tmp, dt, c);
    }
}

/* d = beta * d + acc: beta 0 overwrites without reading d (which may hold NaN). */
static void store_acc(float *d, const double *acc, size_t n, float beta)
{
    if (beta == 0.0f) {
        for (size_t i = 0; i < n; i++)
            d[i] = (float)acc[i];
    } else {
        for (size_t i = 0; i < n; i++)
            d[i] = beta * d[i] + (float)acc[i];
    }
}

/* d = beta * d over n floats (beta 0 writes zeros). */
static void scale_f32(float *d, size_t n, float beta)
{
    if (beta == 0.0f)
        memset(d, 0, n * sizeof(float));
    else if (beta != 1.0f)
        for (size_t i = 0; i < n; i++)
            d[i] *= beta;
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

/* ---- matrix products ------------------------------------------------------------------------- */

/* A row-major matrix operand: element (r, c) is at p + (r * ld + c) elements of dtype dt. */
struct mat_in {
    const void *p;
    enum dtype dt;
    int64_t ld;
};

struct mat_out {
    void *p;
    enum dtype dt;
    int64_t ld;
    const float *row_bias; /* NULL, or fp32 (rows): each row's bias, added to its every element (beta 0) */
    bool relu;             /* gemm_avx512_args.relu (GEMM_EPI_RELU); only where gemm_takes_avx512 */
    const void *relu_mask; /* gemm_avx512_args.relu_mask, leading dimension ldr (GEMM_EPI_RELU_MASK); likewise */
    int64_t ldr;
};

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

/* Whether gemm_avx512 runs bf16 products of `in` on the AMX tiles (gemm_core_avx512's choice). */
static bool gemm_uses_amx(const struct cpu_backend *cb, enum dtype in)
{
    return in == DT_BF16 && cb->gemm_amx;
}

/* Products smaller than this many multiply-adds run on one thread: waking the pool costs more than it
 * saves. (Threaded or not, a product has the same bits: gemm_avx512.h, gemm_avx512_threaded.) */
#define GEMM_PAR_MACS ((int64_t)1 << 19)

/* A and B of one dtype through gemm_avx512, same contract as gemm_core. The scratch is taken before C
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
        if (!wscratch_reserve(cb, WSCR_PACK_A, plan.worker_a_bytes) ||
            (plan.worker_b_bytes && !wscratch_reserve(cb, WSCR_GEMM_B, plan.worker_b_bytes)))
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

static void gemm_core(struct cpu_backend *cb, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                      struct mat_in a, struct mat_in b, float beta, struct mat_out c, const float *bias);
static struct mat_out out_mat_f32(float *p, int64_t ld);

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
        gemm_core(cb, ta, tb, m, n, k, alpha, a, b, beta, c, bias);
        return;
    }
    assert(c.dt == DT_FP32 && !bias && !c.row_bias);
    float *p = scratch_get(cb, SCR_FP8_C, (size_t)(m * n) * sizeof(float));
    if (!p)
        return;
    gemm_core(cb, ta, tb, m, n, k, alpha, a, b, 0.0f, out_mat_f32(p, n), NULL);
    float *cf = (float *)c.p;
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < n; j++)
            cf[r * c.ld + j] = beta * cf[r * c.ld + j] + p[r * n + j];
}

/* The factor an fp8 product's sum is multiplied by: alpha * A's scale_inv * B's (backend.h, gemm_args). */
static float gemm_alpha(const struct gemm_args *g)
{
    float alpha = g->alpha;
    if (dtype_is_fp8(g->a->dtype)) {
        assert(g->a->scale_inv && g->b->scale_inv);
        alpha = alpha * *g->a->scale_inv * *g->b->scale_inv;
    }
    return alpha;
}

static inline bool gemm_dtypes_ok(const struct gemm_args *g)
{
    enum dtype a = g->a->dtype, b = g->b->dtype, c = g->c->dtype;
    if (dtype_is_fp8(a) || dtype_is_fp8(b))
        return dtype_is_fp8(a) && dtype_is_fp8(b) && !(a == DT_FP8_E5M2 && b == DT_FP8_E5M2) &&
               (c == DT_FP32 || c == DT_BF16);
    return a == b && (c == DT_FP32 || c == a);
}

static int blas_dim(int64_t x)
{
    assert(x >= 0 && x <= INT_MAX);
    return x < 1 ? 1 : (int)x;
}

/* Whether gemm_core runs this product on gemm_avx512 (and so can apply a ReLU or its mask in the epilogue). */
static bool gemm_takes_avx512(const struct cpu_backend *cb, int64_t k, enum dtype a, enum dtype b, enum dtype c)
{
    return k > 0 && a == b && !dtype_is_fp8(a) && cb->gemm_avx512[a] && (c == DT_FP32 || c == a);
}

/* C (m, n) = alpha * op(A) @ op(B) + beta * C [+ bias (n) on every row, or + c.row_bias (m) on every column,
 * with beta 0], rounded once to C's dtype. beta 0 never reads C. */
static void gemm_core(struct cpu_backend *cb, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                      struct mat_in a, struct mat_in b, float beta, struct mat_out c, const float *bias)
{
    assert(!bias || beta == 0.0f);
    assert(!c.row_bias || (beta == 0.0f && !bias));
    if (m <= 0 || n <= 0)
        return;
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

static struct mat_in mat_f32(const float *p, int64_t ld)
{
    return (struct mat_in){ .p = p, .dt = DT_FP32, .ld = ld };
}

static struct mat_out out_mat_f32(float *p, int64_t ld)
{
    return (struct mat_out){ .p = p, .dt = DT_FP32, .ld = ld };
}

static void gemm_gelu(struct cpu_backend *cb, const struct gemm_args *g);
static void cpu_act_forward(struct backend *be, enum act_kind kind, struct tensor *y, const struct tensor *x);
static void cpu_act_backward(struct backend *be, enum act_kind kind, struct tensor *dx, const struct tensor *dy,
                             const struct tensor *x);

/* GEMM_EPI_RELU, GEMM_EPI_RELU_MASK (backend.h): in gemm_avx512's epilogue, where the product runs there (the
 * one pass over C: no second one reading what the product's threads left in their caches); else the plain
 * product, then the ReLU op itself over C, in place. The same bits either way (gemm_avx512.c, epilogue). */
static void gemm_relu(struct cpu_backend *cb, const struct gemm_args *g)
{
    const bool mask = g->epilogue == GEMM_EPI_RELU_MASK;
    assert(g->batch == 1 && g->beta == 0.0f && gemm_dtypes_ok(g));
    assert(!mask || (g->aux && g->aux->dtype == g->c->dtype && (int64_t)g->aux->numel == g->m * g->n));
    const float *bias = g->bias ? (const float *)g->bias->data : NULL;
    struct mat_in a = { g->a->data, g->a->dtype, g->trans_a ? g->m : g->k };
    struct mat_in b = { g->b->data, g->b->dtype, g->trans_b ? g->k : g->n };
    struct mat_out c = { .p = g->c->data, .dt = g->c->dtype, .ld = g->n };
    const bool fused = gemm_takes_avx512(cb, g->k, a.dt, b.dt, c.dt);
    if (fused) {
        c.relu = !mask;
        c.relu_mask = mask ? g->aux->data : NULL;
        c.ldr = g->n;
    }
    gemm_core(cb, g->trans_a, g->trans_b, g->m, g->n, g->k, gemm_alpha(g), a, b, 0.0f, c, bias);
    if (fused)
        return;
    if (mask)
        cpu_act_backward(&cb->base, ACT_RELU, g->c, g->c, g->aux);
    else
        cpu_act_forward(&cb->base, ACT_RELU, g->c, g->c);
}

static void cpu_gemm(struct backend *be, const struct gemm_args *g)
{
    struct cpu_backend *cb = cpu_of(be);
    if (g->epilogue == GEMM_EPI_GELU_TANH) {
        gemm_gelu(cb, g);
        return;
    }
    if (g->epilogue == GEMM_EPI_RELU || g->epilogue == GEMM_EPI_RELU_MASK) {
        gemm_relu(cb, g);
        return;
    }
    assert(g->batch >= 1);
    assert(gemm_dtypes_ok(g)); /* the contract; gemm_core itself would take any pair */
    assert(!g->bias || (g->bias->dtype == DT_FP32 && (int64_t)g->bias->numel == g->n));
    const float *bias = g->bias ? (const float *)g->bias->data : NULL;
    const float alpha = gemm_alpha(g);
    for (int64_t i = 0; i < g->batch; i++) {
        struct mat_in a = { elem_ptr(g->a->data, g->a->dtype, (size_t)(i * g->stride_a)), g->a->dtype,
                            g->trans_a ? g->m : g->k };
        struct mat_in b = { elem_ptr(g->b->data, g->b->dtype, (size_t)(i * g->stride_b)), g->b->dtype,
                            g->trans_b ? g->k : g->n };
        struct mat_out c = { .p = elem_ptr(g->c->data, g->c->dtype, (size_t)(i * g->stride_c)), .dt = g->c->dtype,
                             .ld = g->n };
        gemm_core(cb, g->trans_a, g->trans_b, g->m, g->n, g->k, alpha, a, b, g->beta, c, bias);
    }
}

/* ---- per-worker products of the sliced ops ---------------------------------------------------- */

/* worker_gemm's panels for an (m, n, k) product of inputs `in` on every worker. */
static bool worker_gemm_reserve(struct cpu_backend *cb, enum dtype in, int64_t m, int64_t n, int64_t k)
{
    struct gemm_avx512_scratch s;
    gemm_avx512_scratch_sizes(in, gemm_uses_amx(cb, in), m, n, k, &s);
    return wscratch_reserve(cb, WSCR_PACK_A, s.pack_a_bytes) &&
           wscratch_reserve(cb, WSCR_GEMM_B, s.pack_b_bytes) && wscratch_reserve(cb, WSCR_GEMM_C, s.partial_bytes);
}

/* C (m, n) = alpha op(A) @ op(B) + beta * C, A and B of dtype `in` (m, n, k >= 1), C fp32 or `in`,
 * single-threaded in worker w's own panels (WSCR_GEMM_C holds the partial sums where gemm_avx512 needs
 * them): the call gemm_core_avx512 makes, so the same bits (gemm_avx512.h: the threaded driver's bits are the
 * single-threaded one's). Only where cb->gemm_avx512[in]. The one per-worker product: a convolution's image
 * and an attention pair both run theirs here. */
static void worker_gemm(const struct cpu_backend *cb, int worker, enum dtype in, bool ta, bool tb, int64_t m,
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

static void cpu_bias_grad(struct backend *be, struct tensor *db, const struct tensor *dy, int64_t m, int64_t n,
                          float beta)
{
    struct cpu_backend *cb = cpu_of(be);
    assert(db->dtype == DT_FP32 && (int64_t)db->numel == n && (int64_t)dy->numel == m * n);
    const int64_t cols = (size_t)(m * n) < EW_CHUNK ? (n > 0 ? n : 1) : BIAS_GRAD_COLS;
    double *acc = scratch_get(cb, SCR_ACC0, (size_t)n * sizeof(double));
    if (!acc || !wscratch_rows(cb) || !wstage_reserve(cb, WSCR_TMP0, dy, (size_t)cols))
        return;
    memset(acc, 0, (size_t)n * sizeof(double));
    struct bias_grad_job j = { .cb = cb, .acc = acc, .dy = dy, .m = m, .n = n, .cols = cols };
    parallel_for(cb->pool, (n + cols - 1) / cols, bias_grad_chunk, &j);
    store_acc((float *)db->data, acc, (size_t)n, beta);
}

/* ---- elementwise ----------------------------------------------------------------------------- */

HOT_LOOP static void act_apply(enum act_kind kind, float *y, const float *x, size_t n)
{
    switch (kind) {
    case ACT_RELU:
        for (size_t i = 0; i < n; i++)
            y[i] = x[i] <= 0.0f ? 0.0f : x[i]; /* NaN passes through, as in PyTorch */
        break;
    case ACT_GELU_TANH:
        for (size_t i = 0; i < n; i++) {
            float v = x[i];
            float u = GELU_TANH_S * (v + GELU_TANH_C * v * v * v);
            y[i] = 0.5f * v * (1.0f + tanh_f32(u));
        }
        break;
    case ACT_GELU_ERF:
        for (size_t i = 0; i < n; i++)
            y[i] = 0.5f * x[i] * (1.0f + erff(x[i] * INV_SQRT2));
        break;
    }
}

/* The GELU epilogue's elementwise part over pre[0, n) (fp32, the product with its bias): aux = round(pre) and
 * C = round(gelu_tanh(pre)) from `off` on, or (fp32 C) C = gelu_tanh(pre) where pre is aux itself. Each element
 * depends on its own alone, so EW_CHUNK ranges run on any thread. */
struct gelu_epi_job {
    const float *pre;
    const struct tensor *aux, *c;
    size_t off, n;
};

static void gelu_epi_chunk(void *arg, int64_t chunk, int worker)
{
    (void)worker;
    const struct gelu_epi_job *j = arg;
    const enum dtype dt = j->c->dtype;
    const size_t lo = (size_t)chunk * EW_CHUNK, hi = j->n - lo < EW_CHUNK ? j->n : lo + EW_CHUNK;
    float yb[BLOCK];
    for (size_t i = lo; i < hi; i += BLOCK) {
        const size_t cnt = hi - i < BLOCK ? hi - i : BLOCK, at = j->off + i;
        if (dt == DT_FP32) {
            act_apply(ACT_GELU_TANH, (float *)j->c->data + at, j->pre + i, cnt);
            continue;
        }
        dtype_convert(elem_ptr(j->aux->data, dt, at), dt, j->pre + i, DT_FP32, cnt);
        act_apply(ACT_GELU_TANH, yb, j->pre + i, cnt);
        dtype_convert(elem_ptr(j->c->data, dt, at), dt, yb, DT_FP32, cnt);
    }
}

/* The GELU epilogue (backend.h GEMM_EPI_GELU_TANH), a block of rows at a time so the fp32 scratch stays
 * small: the product with the bias into fp32 (gemm_core, as for any product), then per element aux =
 * round(pre) and C = round(gelu_tanh(pre)), GELU computed on the unrounded fp32 value, as a GEMM
 * epilogue on a GPU computes it (gelu_epi_chunk, over the pool). */
static void gemm_gelu(struct cpu_backend *cb, const struct gemm_args *g)
{
    assert(g->batch == 1 && g->beta == 0.0f && !g->trans_a && g->aux);
    assert(gemm_dtypes_ok(g) && g->aux->dtype == g->c->dtype);
    const float alpha = gemm_alpha(g);
    assert((int64_t)g->aux->numel == g->m * g->n && (int64_t)g->c->numel == g->m * g->n);
    int64_t m = g->m, n = g->n, k = g->k;
    if (m <= 0 || n <= 0)
        return;
    const float *bias = g->bias ? (const float *)g->bias->data : NULL;
    struct mat_in b = { g->b->data, g->b->dtype, g->trans_b ? k : n };
    if (g->c->dtype == DT_FP32) { /* aux holds the fp32 product itself: no scratch, no copies */
        struct mat_in a = { g->a->data, g->a->dtype, k };
        gemm_core(cb, false, g->trans_b, m, n, k, alpha, a, b, 0.0f, out_mat_f32(g->aux->data, n), bias);
        struct gelu_epi_job j = { .pre = g->aux->data, .aux = g->aux, .c = g->c, .off = 0, .n = (size_t)(m * n) };
        parallel_for(cb->pool, ew_chunks(j.n), gelu_epi_chunk, &j);
        return;
    }
    int64_t rows = (int64_t)1 << 16; /* elements a block: 256 KiB of fp32, to stay in cache for the GELU pass */
    rows = rows / n > 0 ? rows / n : 1;
    rows = rows < m ? rows : m;
    float *pre = scratch_get(cb, SCR_TMP0, (size_t)(rows * n) * sizeof(float));
    if (!pre)
        return;
    for (int64_t r0 = 0; r0 < m; r0 += rows) {
        int64_t rb = m - r0 < rows ? m - r0 : rows;
        struct mat_in a = { elem_ptr(g->a->data, g->a->dtype, (size_t)(r0 * k)), g->a->dtype, k };
        gemm_core(cb, false, g->trans_b, rb, n, k, alpha, a, b, 0.0f, out_mat_f32(pre, n), bias);
        struct gelu_epi_job j = { .pre = pre, .aux = g->aux, .c = g->c, .off = (size_t)(r0 * n),
                                  .n = (size_t)(rb * n) };
        parallel_for(cb->pool, ew_chunks(j.n), gelu_epi_chunk, &j);
    }
}

/* dx = dy * act'(x). For |x| > 20 the GELU derivative is exactly 0 or 1 in fp32; the closed form
 * would compute 0 * Inf there once x^2 overflows, so the limit is used. */
HOT_LOOP static void act_grad_apply(enum act_kind kind, float *dx, const float *dy, const float *x, size_t n)
{
    switch (kind) {
    case ACT_RELU:
        for (size_t i = 0; i < n; i++)
            dx[i] = x[i] <= 0.0f ? 0.0f : dy[i];
        break;
    case ACT_GELU_TANH:
        for (size_t i = 0; i < n; i++) {
            float v = x[i], d;
            if (fabsf(v) > 20.0f) {
                d = v > 0.0f ? 1.0f : 0.0f;
            } else {
                float u = GELU_TANH_S * (v + GELU_TANH_C * v * v * v);
                float t = tanh_f32(u);
                d = 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * GELU_TANH_S * (1.0f + 3.0f * GELU_TANH_C * v * v);
            }
            dx[i] = dy[i] * d;
        }
        break;
    case ACT_GELU_ERF:
        for (size_t i = 0; i < n; i++) {
            float v = x[i], d;
            if (fabsf(v) > 20.0f)
                d = v > 0.0f ? 1.0f : 0.0f;
            else
                d = 0.5f * (1.0f + erff(v * INV_SQRT2)) + v * INV_SQRT_2PI * expf(-0.5f * v * v);
            dx[i] = dy[i] * d;
        }
        break;
    }
}

/* The elementwise ops run over element ranges [lo, hi): each element's result depends on that element
 * alone, so the ranges (EW_CHUNK elements, a chunk each) may run on any threads in any order. */
enum ew_op { EW_ACT, EW_ACT_GRAD, EW_ADD, EW_DROPOUT };

struct ew_job {
    enum ew_op op;
    enum act_kind kind;     /* EW_ACT, EW_ACT_GRAD */
    struct tensor *y;       /* the output: y, dx */
    const struct tensor *x; /* the input: x, a; EW_ACT_GRAD: dy */
    const struct tensor *x2;/* EW_ACT_GRAD: x; EW_ADD: b */
    float p;                /* EW_DROPOUT */
    struct rng_key key;     /* EW_DROPOUT */
};

/* ReLU and its gradient where every tensor of the call is bf16, or every one fp16: the bits that widening,
 * act_apply / act_grad_apply in fp32 and rounding back give, without the two conversions. A 16-bit value is exact
 * in fp32, so what passes comes back unchanged, except a NaN, whose rounding sets its quiet bit; a value <= 0
 * (either zero, any negative) gives +0. test_backend_cpu checks every one of the 65536 inputs in both formats. */
static bool half_format(enum dtype dt, uint16_t *inf, uint16_t *quiet)
{
    if (dt != DT_BF16 && dt != DT_FP16)
        return false;
    *inf = dt == DT_BF16 ? 0x7F80 : 0x7C00;
    *quiet = dt == DT_BF16 ? 0x0040 : 0x0200;
    return true;
}

/* All ones where h passes ReLU (h > 0, or a NaN), zero where h <= 0 (either zero, any negative). Masks, not
 * branches: written as a bool helper under ?:, GCC left relu_grad_16 scalar in the avx512f clone ("control flow
 * in loop"; 11% of fashion_mlp's bf16 step at 2 threads in perf record, against 0.6% vectorised). */
static inline uint16_t half_pass_mask(uint16_t h, uint16_t inf)
{
    uint16_t m = h & 0x7FFF;
    return (uint16_t)-(uint16_t)(m > inf || (!(h & 0x8000) && m != 0));
}

/* h as rounding fp32 back gives it: a NaN with its quiet bit set, anything else unchanged. */
static inline uint16_t half_quieted(uint16_t h, uint16_t inf, uint16_t quiet)
{
    return (uint16_t)(h | (quiet & (uint16_t)-(uint16_t)((h & 0x7FFF) > inf)));
}

HOT_LOOP static void relu_16(uint16_t *y, const uint16_t *x, size_t n, uint16_t inf, uint16_t quiet)
{
    for (size_t i = 0; i < n; i++)
        y[i] = half_quieted(x[i], inf, quiet) & half_pass_mask(x[i], inf); /* x <= 0: +0 */
}

HOT_LOOP static void relu_grad_16(uint16_t *dx, const uint16_t *dy, const uint16_t *x, size_t n, uint16_t inf,
                                  uint16_t quiet)
{
    for (size_t i = 0; i < n; i++)
        dx[i] = half_quieted(dy[i], inf, quiet) & half_pass_mask(x[i], inf);
}

static void act_forward_range(enum act_kind kind, struct tensor *y, const struct tensor *x, size_t lo, size_t hi)
{
    uint16_t inf, quiet;
    if (kind == ACT_RELU && y->dtype == x->dtype && half_format(x->dtype, &inf, &quiet)) {
        relu_16((uint16_t *)y->data + lo, (const uint16_t *)x->data + lo, hi - lo, inf, quiet);
        return;
    }
    float xb[BLOCK], yb[BLOCK];
    for (size_t i = lo; i < hi; i += BLOCK) {
        size_t c = hi - i < BLOCK ? hi - i : BLOCK;
        const float *xs = load_f32(x->data, x->dtype, i, c, xb);
        float *ys = out_f32(y->data, y->dtype, i, yb);
        act_apply(kind, ys, xs, c);
        store_f32(y->data, y->dtype, i, c, ys);
    }
}

static void act_backward_range(enum act_kind kind, struct tensor *dx, const struct tensor *dy, const struct tensor *x,
                               size_t lo, size_t hi)
{
    uint16_t inf, quiet;
    if (kind == ACT_RELU && dx->dtype == x->dtype && dy->dtype == x->dtype && half_format(x->dtype, &inf, &quiet)) {
        relu_grad_16((uint16_t *)dx->data + lo, (const uint16_t *)dy->data + lo, (const uint16_t *)x->data + lo,
                     hi - lo, inf, quiet);
        return;
    }
    float xb[BLOCK], dyb[BLOCK], dxb[BLOCK];
    for (size_t i = lo; i < hi; i += BLOCK) {
        size_t c = hi - i < BLOCK ? hi - i : BLOCK;
        const float *xs = load_f32(x->data, x->dtype, i, c, xb);
        const float *dys = load_f32(dy->data, dy->dtype, i, c, dyb);
        float *dxs = out_f32(dx->data, dx->dtype, i, dxb);
        act_grad_apply(kind, dxs, dys, xs, c);
        store_f32(dx->data, dx->dtype, i, c, dxs);
    }
}

static void add_range(struct tensor *y, const struct tensor *a, const struct tensor *b, size_t lo, size_t hi)
{
    float ab[BLOCK], bb[BLOCK], yb[BLOCK];
    for (size_t i = lo; i < hi; i += BLOCK) {
        size_t c = hi - i < BLOCK ? hi - i : BLOCK;
        const float *as = load_f32(a->data, a->dtype, i, c, ab);
        const float *bs = load_f32(b->data, b->dtype, i, c, bb);
        float *ys = out_f32(y->data, y->dtype, i, yb);
        for (size_t j = 0; j < c; j++)
            ys[j] = as[j] + bs[j];
        store_f32(y->data, y->dtype, i, c, ys);
    }
}

static void dropout_range(struct tensor *y, const struct tensor *x, float p, struct rng_key key, size_t lo, size_t hi);

static void ew_chunk(void *arg, int64_t chunk, int worker)
{
    (void)worker;
    const struct ew_job *j = arg;
    size_t lo = (size_t)chunk * EW_CHUNK, n = j->y->numel, hi = n - lo < EW_CHUNK ? n : lo + EW_CHUNK;
    switch (j->op) {
    case EW_ACT:
        act_forward_range(j->kind, j->y, j->x, lo, hi);
        break;
    case EW_ACT_GRAD:
        act_backward_range(j->kind, j->y, j->x, j->x2, lo, hi);
        break;
    case EW_ADD:
        add_range(j->y, j->x, j->x2, lo, hi);
        break;
    case EW_DROPOUT:
        dropout_range(j->y, j->x, j->p, j->key, lo, hi);
        break;
    }
}

static void ew_run(struct cpu_backend *cb, const struct ew_job *j)
{
    parallel_for(cb->pool, ew_chunks(j->y->numel), ew_chunk, (void *)j);
}

static void cpu_act_forward(struct backend *be, enum act_kind kind, struct tensor *y, const struct tensor *x)
{
    assert(y->numel == x->numel);
    ew_run(cpu_of(be), &(struct ew_job){ .op = EW_ACT, .kind = kind, .y = y, .x = x });
}

static void cpu_act_backward(struct backend *be, enum act_kind kind, struct tensor *dx, const struct tensor *dy,
                             const struct tensor *x)
{
    assert(dx->numel == x->numel && dy->numel == x->numel);
    ew_run(cpu_of(be), &(struct ew_job){ .op = EW_ACT_GRAD, .kind = kind, .y = dx, .x = dy, .x2 = x });
}

static void cpu_add(struct backend *be, struct tensor *y, const struct tensor *a, const struct tensor *b)
{
    assert(y->numel == a->numel && y->numel == b->numel);
    ew_run(cpu_of(be), &(struct ew_job){ .op = EW_ADD, .y = y, .x = a, .x2 = b });
}

/* Dropout masks. Element i of the tensor dropped under key (seed, stream, counter) draws
 *     u = rng_uniform(seed, (stream << 20) + (counter >> 32), ((counter & 0xffffffff) << 32) | i)
 * and is kept iff u >= p. The map (stream, counter, i) -> (stream', counter') is one-to-one for
 * stream < 2^44, counter < 2^52 and i < 2^32 (asserted), so no two elements of any realistic run share
 * a draw, and it is plain 64-bit integer arithmetic a CUDA kernel reproduces. A kept element is
 * multiplied by 1/(1-p), a dropped one by 0 (so NaN stays NaN, as in PyTorch). */
static uint64_t dropout_stream(struct rng_key key)
{
    return (key.stream << 20) + (key.counter >> 32);
}

static uint64_t dropout_counter(struct rng_key key, size_t i)
{
    return (key.counter << 32) | (uint64_t)i;
}

static void dropout_range(struct tensor *y, const struct tensor *x, float p, struct rng_key key, size_t lo, size_t hi)
{
    float scale = 1.0f / (1.0f - p);
    uint64_t stream = dropout_stream(key);
    float xb[BLOCK], yb[BLOCK];
    for (size_t i = lo; i < hi; i += BLOCK) {
        size_t c = hi - i < BLOCK ? hi - i : BLOCK;
        const float *xs = load_f32(x->data, x->dtype, i, c, xb);
        float *ys = out_f32(y->data, y->dtype, i, yb);
        for (size_t j = 0; j < c; j++) {
            float u = rng_uniform(key.seed, stream, dropout_counter(key, i + j));
            ys[j] = xs[j] * (u >= p ? scale : 0.0f);
        }
        store_f32(y->data, y->dtype, i, c, ys);
    }
}

static void dropout_apply(struct cpu_backend *cb, struct tensor *y, const struct tensor *x, float p, struct rng_key key)
{
    assert(y->numel == x->numel);
    assert((uint64_t)x->numel <= 0x100000000ULL && key.stream < (1ULL << 44) && key.counter < (1ULL << 52));
    if (p <= 0.0f) {
        dtype_convert(y->data, y->dtype, x->data, x->dtype, x->numel);
        return;
    }
    ew_run(cb, &(struct ew_job){ .op = EW_DROPOUT, .y = y, .x = x, .p = p, .key = key });
}

static void cpu_dropout_forward(struct backend *be, struct tensor *y, const struct tensor *x, float p,
                                struct rng_key key)
{
    dropout_apply(cpu_of(be), y, x, p, key);
}

static void cpu_dropout_backward(struct backend *be, struct tensor *dx, const struct tensor *dy, float p,
                                 struct rng_key key)
{
    dropout_apply(cpu_of(be), dx, dy, p, key); /* the same mask and scale: d(x * mask)/dx = mask */
}

/* ---- eight planes as the lanes of a vector ---------------------------------------------------- */

#ifdef HAVE_AVX512_INTRIN
/* Per-channel sums of CHAINS (8) channels (batchnorm's statistics and gradient sums, a convolution's bias
 * gradient) with the channels as the lanes of one vector: 8 floats of each plane transposed (shuffles only move
 * bits) so that vector e holds element q + e of every plane, then each lane takes its elements in order, one IEEE
 * operation each as the scalar chains do (widen, subtract, multiply, add: no FMA), and the last hw % 8 elements
 * of each plane one by one after them. The same sums, bit for bit. */
#define LANES8_TARGET __attribute__((target("avx512f,avx512vl")))

/* Element q of a plane: fp32, or bf16 widened (exactly: bf16 is fp32's upper half). */
static inline float plane_elem(const void *p, int64_t q, bool bf16)
{
    return bf16 ? bf16_to_fp32(((const uint16_t *)p)[q]) : ((const float *)p)[q];
}

LANES8_TARGET static inline __m256 plane_load8(const void *p, int64_t q, bool bf16)
{
    if (bf16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + q))), 16));
    return _mm256_loadu_ps((const float *)p + q);
}

/* Whether a ReLU passes its input v (its backward keeps the gradient): v > 0 or a NaN; not +0, -0 or negative. */
LANES8_TARGET static inline __mmask8 relu_passes8(__m256 v)
{
    return _mm256_cmp_ps_mask(v, _mm256_setzero_ps(), _CMP_NLE_UQ);
}

/* Elements q .. q + 7 of the 8 planes p (fp32, or bf16 read as it is stored) transposed: t[e] lane l = p[l][q + e];
 * with ReLU planes m (p's dtype; else NULL), each element is the ReLU backward's, +0 where m's does not pass (a
 * NaN gradient is not quieted here: every use widens it to double or computes with it, which quiets it). */
LANES8_TARGET static inline void planes_transpose8_masked(const void *const p[CHAINS], const void *const m[CHAINS],
                                                          bool bf16, int64_t q, __m256 t[8])
{
    __m256 r[8], u[8];
    for (int l = 0; l < 8; l++) {
        r[l] = plane_load8(p[l], q, bf16);
        if (m)
            r[l] = _mm256_maskz_mov_ps(relu_passes8(plane_load8(m[l], q, bf16)), r[l]);
    }
    for (int l = 0; l < 8; l += 2) {
        u[l] = _mm256_unpacklo_ps(r[l], r[l + 1]);
        u[l + 1] = _mm256_unpackhi_ps(r[l], r[l + 1]);
    }
    for (int l = 0; l < 8; l += 4) {
        r[l] = _mm256_shuffle_ps(u[l], u[l + 2], 0x44);
        r[l + 1] = _mm256_shuffle_ps(u[l], u[l + 2], 0xEE);
        r[l + 2] = _mm256_shuffle_ps(u[l + 1], u[l + 3], 0x44);
        r[l + 3] = _mm256_shuffle_ps(u[l + 1], u[l + 3], 0xEE);
    }
    for (int e = 0; e < 4; e++) {
        t[e] = _mm256_permute2f128_ps(r[e], r[e + 4], 0x20);
        t[e + 4] = _mm256_permute2f128_ps(r[e], r[e + 4], 0x31);
    }
}

LANES8_TARGET static inline void planes_transpose8(const void *const p[CHAINS], bool bf16, int64_t q, __m256 t[8])
{
    planes_transpose8_masked(p, NULL, bf16, q, t);
}

/* s[l] += p[l][q] for q < hw, in order (bn_stats' first pass, conv_filter_image's bias sums). */
LANES8_TARGET static void planes_sum8_avx512(const void *const p[CHAINS], bool bf16, int64_t hw, double s[CHAINS])
{
    __m512d acc = _mm512_loadu_pd(s);
    int64_t q = 0;
    for (; q + 8 <= hw; q += 8) {
        __m256 t[8];
        planes_transpose8(p, bf16, q, t);
        for (int e = 0; e < 8; e++)
            acc = _mm512_add_pd(acc, _mm512_cvtps_pd(t[e]));
    }
    _mm512_storeu_pd(s, acc);
    for (int l = 0; l < CHAINS; l++)
        for (int64_t r = q; r < hw; r++)
            s[l] += plane_elem(p[l], r, bf16);
}

/* ss[l] += (p[l][q] - mu[l])^2 for q < hw, in order (bn_stats' and layernorm's second pass; d in double). */
LANES8_TARGET static void planes_sumsq8_avx512(const void *const p[CHAINS], bool bf16, int64_t hw,
                                               const double mu[CHAINS], double ss[CHAINS])
{
    __m512d acc = _mm512_loadu_pd(ss);
    const __m512d m = _mm512_loadu_pd(mu);
    int64_t q = 0;
    for (; q + 8 <= hw; q += 8) {
        __m256 t[8];
        planes_transpose8(p, bf16, q, t);
        for (int e = 0; e < 8; e++) {
            __m512d d = _mm512_sub_pd(_mm512_cvtps_pd(t[e]), m);
            acc = _mm512_add_pd(acc, _mm512_mul_pd(d, d));
        }
    }
    _mm512_storeu_pd(ss, acc);
    for (int l = 0; l < CHAINS; l++)
        for (int64_t r = q; r < hw; r++) {
            double d = plane_elem(p[l], r, bf16) - mu[l];
            ss[l] += d * d;
        }
}

/* sdy[l] += dy, sdyx[l] += (double)dy * ((x - mu[l]) * rs[l]) (the product in fp32) for q < hw, in order
 * (bn_grad_sums, layernorm's backward); with ReLU planes yp (else NULL), dy is the ReLU backward's of it (+0 where
 * y does not pass); with column factors g (else NULL: none), dy is dy * g[q] (layernorm's dxhat, in fp32). */
LANES8_TARGET static void planes_gradsum8_avx512(const void *const xp[CHAINS], const void *const dp[CHAINS],
                                                 const void *const yp[CHAINS], const float *g, bool bf16, int64_t hw,
                                                 const float mu[CHAINS], const float rs[CHAINS], double sdy[CHAINS],
                                                 double sdyx[CHAINS])
{
    __m512d a_dy = _mm512_loadu_pd(sdy), a_dyx = _mm512_loadu_pd(sdyx);
    const __m256 m = _mm256_loadu_ps(mu), r = _mm256_loadu_ps(rs);
    int64_t q = 0;
    for (; q + 8 <= hw; q += 8) {
        __m256 tx[8], td[8];
        planes_transpose8(xp, bf16, q, tx);
        planes_transpose8_masked(dp, yp, bf16, q, td);
        for (int e = 0; e < 8; e++) {
            if (g)
                td[e] = _mm256_mul_ps(td[e], _mm256_set1_ps(g[q + e]));
            __m512d dy = _mm512_cvtps_pd(td[e]);
            __m256 xhat = _mm256_mul_ps(_mm256_sub_ps(tx[e], m), r);
            a_dy = _mm512_add_pd(a_dy, dy);
            a_dyx = _mm512_add_pd(a_dyx, _mm512_mul_pd(dy, _mm512_cvtps_pd(xhat)));
        }
    }
    _mm512_storeu_pd(sdy, a_dy);
    _mm512_storeu_pd(sdyx, a_dyx);
    for (int l = 0; l < CHAINS; l++)
        for (int64_t e = q; e < hw; e++) {
            float dv = plane_elem(dp[l], e, bf16), xv = plane_elem(xp[l], e, bf16);
            if (yp && plane_elem(yp[l], e, bf16) <= 0.0f)
                dv = 0.0f;
            if (g)
                dv *= g[e];
            sdy[l] += dv;
            sdyx[l] += (double)dv * ((xv - mu[l]) * rs[l]);
        }
}

static bool planes8_avx512(int64_t lanes)
{
    return lanes == CHAINS && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
}
#endif

/* ---- convolution ----------------------------------------------------------------------------- */

/* The output columns [*lo, *hi) whose input column ow * stride - padding + kw lies inside the row. */
static void conv_inside_cols(const struct conv_args *a, int64_t kw, int64_t *lo, int64_t *hi)
{
    int64_t first = a->padding - kw; /* ow * stride >= first */
    int64_t l = first > 0 ? (first + a->stride - 1) / a->stride : 0;
    int64_t last = a->w_in - 1 + a->padding - kw; /* ow * stride <= last */
    int64_t h = last >= 0 ? last / a->stride + 1 : 0;
    h = h < a->w_out ? h : a->w_out;
    *lo = l < h ? l : h;
    *hi = h;
}

/* col (c_in*k*k, h_out*w_out) from one image x (c_in, h_in, w_in) of elements T (float, or uint16_t: the bits
 * of bf16, the products' input either way); zero padding (all-zero bits in both). A copy: each output row's
 * padding zeros and its inside columns in plain loops (rows are short: a call to memcpy per row cost more
 * than the copy at fashion_cnn's 14 and 28 columns). */
#define DEFINE_IM2COL(NAME, T)                                                                                    \
    static void NAME(T *col, const T *x, const struct conv_args *a)                                              \
    {                                                                                                            \
        const int64_t k = a->kernel, hw = a->h_out * a->w_out, s = a->stride;                                    \
        for (int64_t ci = 0; ci < a->c_in; ci++)                                                                 \
            for (int64_t kh = 0; kh < k; kh++)                                                                   \
                for (int64_t kw = 0; kw < k; kw++) {                                                             \
                    T *row = col + ((ci * k + kh) * k + kw) * hw;                                                \
                    const T *plane = x + ci * a->h_in * a->w_in;                                                 \
                    int64_t lo, hi;                                                                              \
                    conv_inside_cols(a, kw, &lo, &hi);                                                           \
                    for (int64_t oh = 0; oh < a->h_out; oh++) {                                                  \
                        const int64_t ih = oh * s - a->padding + kh;                                             \
                        T *out = row + oh * a->w_out;                                                            \
                        const bool inside = ih >= 0 && ih < a->h_in && lo < hi;                                  \
                        const int64_t l = inside ? lo : a->w_out, h = inside ? hi : a->w_out;                    \
                        for (int64_t ow = 0; ow < l; ow++)                                                       \
                            out[ow] = 0;                                                                         \
                        if (inside) {                                                                            \
                            const T *src = plane + ih * a->w_in + lo * s - a->padding + kw; /* ow = lo */        \
                            if (s == 1)                                                                          \
                                for (int64_t ow = l; ow < h; ow++)                                               \
                                    out[ow] = src[ow - l];                                                       \
                            else                                                                                 \
                                for (int64_t ow = l; ow < h; ow++)                                               \
                                    out[ow] = src[(ow - l) * s];                                                 \
                        }                                                                                        \
                        for (int64_t ow = h; ow < a->w_out; ow++)                                                \
                            out[ow] = 0;                                                                         \
                    }                                                                                            \
                }                                                                                                \
    }
DEFINE_IM2COL(im2col_f32, float)
DEFINE_IM2COL(im2col_16, uint16_t)
#undef DEFINE_IM2COL

/* A stride-1 convolution whose output is as wide as its input (2 * padding = kernel - 1, "same"): output
 * element i = oh * w + ow of the row for (kh, kw) reads input element i + (kh - padding) * w + (kw - padding),
 * so the row is one shifted copy of the plane, then zeros where the read fell outside it: the rows above or
 * below and the |kw - padding| columns at one edge (which the shifted copy took from the neighbouring row). The
 * same bits as the loops above: a copy either way. */
static bool conv_is_same_stride1(const struct conv_args *a)
{
    return a->stride == 1 && 2 * a->padding == a->kernel - 1 && a->padding < a->w_in && a->padding < a->h_in;
}

/* The zero runs are short (at most a row and a column: 15 values in fashion_cnn's second convolution), one to each
 * side of 288 rows an image: as memset calls (GCC turns the loops into them) they were 2-3% of fashion_cnn's step;
 * written in place (no_loop_patterns) they are a few stores. */
#if defined(__GNUC__) && !defined(__clang__)
#define NO_LOOP_PATTERNS __attribute__((optimize("no-tree-loop-distribute-patterns")))
#else
#define NO_LOOP_PATTERNS
#endif
#define DEFINE_IM2COL_SAME(NAME, T)                                                                               \
    NO_LOOP_PATTERNS static void NAME(T *col, const T *x, const struct conv_args *a)                             \
    {                                                                                                            \
        const int64_t k = a->kernel, w = a->w_in, h = a->h_in, hw = h * w, p = a->padding;                      \
        for (int64_t ci = 0; ci < a->c_in; ci++)                                                                 \
            for (int64_t kh = 0; kh < k; kh++)                                                                   \
                for (int64_t kw = 0; kw < k; kw++) {                                                             \
                    T *row = col + ((ci * k + kh) * k + kw) * hw;                                                \
                    const T *plane = x + ci * hw;                                                                \
                    const int64_t dr = kh - p, dc = kw - p, d = dr * w + dc;                                     \
                    const int64_t i0 = (dr < 0 ? -dr : 0) * w, i1 = (dr > 0 ? h - dr : h) * w; /* rows inside */ \
                    const int64_t c0 = i0 > -d ? i0 : -d, c1 = i1 < hw - d ? i1 : hw - d;   /* and the plane */  \
                    for (int64_t i = 0; i < c0; i++)                                                             \
                        row[i] = 0;                                                                              \
                    memcpy(row + c0, plane + c0 + d, (size_t)(c1 - c0) * sizeof(T));                            \
                    for (int64_t i = c1; i < hw; i++)                                                            \
                        row[i] = 0;                                                                              \
                    /* the edge columns read outside the row: stores, not a call each (rows are short) */        \
                    for (int64_t i = i0; dc != 0 && i < i1; i += w)                                              \
                        for (int64_t e = 0; e < (dc < 0 ? -dc : dc); e++)                                        \
                            row[(dc < 0 ? i : i + w - dc) + e] = 0;                                              \
                }                                                                                                \
    }
DEFINE_IM2COL_SAME(im2col_same_f32, float)
DEFINE_IM2COL_SAME(im2col_same_16, uint16_t)
#undef DEFINE_IM2COL_SAME

static void im2col(void *col, const void *x, const struct conv_args *a, size_t es)
{
    if (conv_is_same_stride1(a) && es == sizeof(float))
        im2col_same_f32(col, x, a);
    else if (conv_is_same_stride1(a))
        im2col_same_16(col, x, a);
    else if (es == sizeof(float))
        im2col_f32(col, x, a);
    else
        im2col_16(col, x, a);
}

/* col2im for a "same" stride-1 convolution (conv_is_same_stride1): im2col_same's shifted copy run backwards,
 * x[i + d] += row[i] over the whole shifted range in one loop, after the row's entries that im2col_same zeroes
 * (those that read outside the plane's row: padding) are set to +0 here. Each element of x still takes the same
 * entries in the same (ci, kh, kw) order; the +0 entries it now also takes change nothing: x starts at +0 and a
 * sum that starts at +0 is never -0 in round-to-nearest, and s + (+0) == s for every other s, NaN and inf
 * included. The same bits as the loops of col2im. Overwrites col's padding entries. */
static void col2im_same(float *restrict x, float *restrict col, const struct conv_args *a)
{
    const int64_t k = a->kernel, w = a->w_in, h = a->h_in, hw = h * w, p = a->padding;
    for (int64_t ci = 0; ci < a->c_in; ci++)
        for (int64_t kh = 0; kh < k; kh++)
            for (int64_t kw = 0; kw < k; kw++) {
                float *restrict row = col + ((ci * k + kh) * k + kw) * hw;
                float *restrict plane = x + ci * hw;
                const int64_t dr = kh - p, dc = kw - p, d = dr * w + dc;
                const int64_t i0 = (dr < 0 ? -dr : 0) * w, i1 = (dr > 0 ? h - dr : h) * w; /* the rows inside */
                const int64_t c0 = i0 > -d ? i0 : -d, c1 = i1 < hw - d ? i1 : hw - d;   /* and the plane */
                for (int64_t i = i0; dc != 0 && i < i1; i += w) /* the edge columns read outside the row */
                    for (int64_t e = 0; e < (dc < 0 ? -dc : dc); e++)
                        row[(dc < 0 ? i : i + w - dc) + e] = 0.0f;
                for (int64_t i = c0; i < c1; i++)
                    plane[i + d] += row[i];
            }
}

/* x (c_in, h_in, w_in) = sum of col's entries over the positions they were read from (overwrites x; for a
 * "same" stride-1 convolution also col's padding entries, col2im_same). */
static void col2im(float *x, float *col, const struct conv_args *a)
{
    int64_t k = a->kernel, hw = a->h_out * a->w_out;
    memset(x, 0, (size_t)(a->c_in * a->h_in * a->w_in) * sizeof(float));
    if (conv_is_same_stride1(a)) {
        col2im_same(x, col, a);
        return;
    }
    for (int64_t ci = 0; ci < a->c_in; ci++)
        for (int64_t kh = 0; kh < k; kh++)
            for (int64_t kw = 0; kw < k; kw++) {
                const float *row = col + ((ci * k + kh) * k + kw) * hw;
                float *plane = x + ci * a->h_in * a->w_in;
                int64_t lo, hi; /* the output columns that read inside the row: no test per element */
                conv_inside_cols(a, kw, &lo, &hi);
                for (int64_t oh = 0; oh < a->h_out; oh++) {
                    int64_t ih = oh * a->stride - a->padding + kh;
                    if (ih < 0 || ih >= a->h_in)
                        continue;
                    const int64_t base = ih * a->w_in - a->padding + kw; /* + ow * stride: >= 0 from lo on */
                    const float *src = row + oh * a->w_out;
                    if (a->stride == 1)
                        for (int64_t ow = lo; ow < hi; ow++)
                            plane[base + ow] += src[ow];
                    else
                        for (int64_t ow = lo; ow < hi; ow++)
                            plane[base + ow * a->stride] += src[ow];
                }
            }
}

/* A 1x1 convolution with stride 1 and no padding reads each image as its own column matrix. */
static bool conv_is_pointwise(const struct conv_args *a)
{
    return a->kernel == 1 && a->stride == 1 && a->padding == 0;
}

static void conv_check(const struct conv_args *a)
{
    assert(a->kernel >= 1 && a->stride >= 1 && a->padding >= 0);
    assert(a->h_out == (a->h_in + 2 * a->padding - a->kernel) / a->stride + 1);
    assert(a->w_out == (a->w_in + 2 * a->padding - a->kernel) / a->stride + 1);
    (void)a;
}

/* The convolutions work one image at a time: a 16-bit image is widened into IN0/IN1 scratch and a 16-bit
 * result computed in TMP1 scratch and rounded before the next image, so their scratch is O(one image),
 * never O(batch). fp32 images are used in place. Where the inputs of a call's products (x and w, dy and w,
 * dy and x) are all bf16 and gemm_avx512 takes bf16, the products take them as they are (im2col copies
 * bf16 bits): the bf16 product of gemm_avx512.h (AMX where the CPU has it), fp32 results as before. Its sums
 * are that product's, not the fp32 FMA's over the widened values: another order, with bf16's DAZ/FTZ.
 *
 * Threads: above CONV_PAR_MACS multiply-adds, where the products run on gemm_avx512 (fp32 operands: the
 * weights and im2col columns are fp32), the images are the chunks, each worker in its own scratch
 * (wscratch) with its own single-threaded product (worker_gemm): an image's product is the call one thread
 * makes, so the same bits. The filter gradient takes the images CONV_FILTER_IMAGES at a time (fewer
 * when their products would pass CONV_FILTER_BYTES): each image's product dy_i @ col_i^T is formed apart
 * (beta 0, so exactly the fp32 sum gemm_avx512's epilogue adds), then each element of dW adds the images'
 * products in image order, dW = beta * dW + P_i, rounded as that epilogue rounds (beta * dW, then + P_i),
 * so dW has the bits of the image-by-image accumulation. Elsewhere (smaller, or the portable path, whose
 * OpenBLAS keeps its own threads) the images run in order on the calling thread through gemm_core. */
#define CONV_PAR_MACS ((int64_t)1 << 20)
#define CONV_FILTER_IMAGES 16                  /* images whose dW products are formed at once */
#define CONV_FILTER_BYTES ((size_t)16 << 20)  /* at most this much scratch for them */

struct conv_dims {
    int64_t ckk, hw, chw_in, chw_out;
};

static struct conv_dims conv_dims_of(const struct conv_args *a)
{
    int64_t hw = a->h_out * a->w_out;
    return (struct conv_dims){ .ckk = a->c_in * a->kernel * a->kernel, .hw = hw,
                               .chw_in = a->c_in * a->h_in * a->w_in, .chw_out = a->c_out * hw };
}

/* Whether this convolution runs as chunks on the pool: by its size and the path its products take, never
 * by the thread count. */
static bool conv_threaded(const struct cpu_backend *cb, const struct conv_args *a)
{
    const struct conv_dims d = conv_dims_of(a);
    return cb->gemm_avx512[DT_FP32] && a->n > 1 && a->c_out > 0 && d.ckk > 0 && d.hw > 0 &&
           a->n * a->c_out * d.ckk * d.hw >= CONV_PAR_MACS;
}

/* The products' input dtype for a call whose two product inputs are p and q: bf16 as they are where both
 * are bf16 and gemm_avx512 takes bf16, else fp32 (16-bit inputs widened). */
static enum dtype conv_product_dtype(const struct cpu_backend *cb, const struct tensor *p, const struct tensor *q)
{
    return cb->gemm_avx512[DT_BF16] && p->dtype == DT_BF16 && q->dtype == DT_BF16 ? DT_BF16 : DT_FP32;
}

/* One convolution call's tensors; the image and block bodies read them and their own buffers. */
struct conv_job {
    struct cpu_backend *cb;
    const struct conv_args *a;
    struct tensor *out;        /* y, dx or dw */
    const struct tensor *in;   /* x, dy or dy */
    const struct tensor *in2;  /* backward_filter: x */
    enum dtype dt;             /* the products' inputs: DT_FP32, or DT_BF16 (conv_product_dtype) */
    const void *w;             /* forward, backward_data: the weights (c_out, ckk) as dt */
    const float *bias;         /* forward: NULL or fp32 (c_out) */
    double *acc;               /* backward_filter: NULL or the bias gradient's per-channel sums (c_out) */
    float beta;                /* backward_filter: dW = beta * dW + ... */
    float *prod;               /* backward_filter, threaded: the group's products (images, c_out, ckk) */
    double *sums;              /* backward_filter, threaded, with acc: the group's plane sums (images, c_out) */
    int64_t i0, images;        /* backward_filter, threaded: the group's first image and its size */
    bool transposed;           /* backward_filter: each product formed as col_i @ dy_i^T (conv_filter_transposed) */
};

/* Where a body computes: its buffers, and worker < 0 for the calling thread's gemm_core, else the worker
 * whose worker_gemm panels it uses. */
struct conv_bufs {
    float *in0, *in1, *tmp0, *tmp1;
    int worker;
};

/* C (m, n) = op(A) @ op(B) + beta * C [+ row_bias (m) on every column, with beta 0]; C fp32, or of the products'
 * input dtype (c_dt: rounded once in the product's epilogue). */
static void conv_gemm_to(const struct conv_job *j, const struct conv_bufs *b, bool ta, bool tb, int64_t m,
                         int64_t n, int64_t k, const void *a, int64_t lda, const void *bm, int64_t ldb, float beta,
                         void *c, enum dtype c_dt, int64_t ldc, const float *row_bias)
{
    assert(c_dt == DT_FP32 || c_dt == j->dt);
    const struct mat_out out = { .p = c, .dt = c_dt, .ld = ldc, .row_bias = row_bias };
    if (b->worker < 0)
        gemm_core(j->cb, ta, tb, m, n, k, 1.0f, (struct mat_in){ a, j->dt, lda }, (struct mat_in){ bm, j->dt, ldb },
                  beta, out, NULL);
    else
        worker_gemm(j->cb, b->worker, j->dt, ta, tb, m, n, k, 1.0f, a, lda, bm, ldb, beta, out);
}

/* conv_gemm_to with an fp32 C. */
static void conv_gemm(const struct conv_job *j, const struct conv_bufs *b, bool ta, bool tb, int64_t m, int64_t n,
                      int64_t k, const void *a, int64_t lda, const void *bm, int64_t ldb, float beta, float *c,
                      int64_t ldc, const float *row_bias)
{
    conv_gemm_to(j, b, ta, tb, m, n, k, a, lda, bm, ldb, beta, c, DT_FP32, ldc, row_bias);
}

/* n values of image data t from element off as the products' input: t's own bf16 bits on the bf16 path,
 * else fp32 (load_f32: in place, or widened into buf). */
static const void *conv_load(const struct conv_job *j, const struct tensor *t, size_t off, size_t n, float *buf)
{
    return j->dt == DT_BF16 ? elem_ptr(t->data, DT_BF16, off) : load_f32(t->data, t->dtype, off, n, buf);
}

/* Worker w's buffers, reserved by the caller. */
static struct conv_bufs conv_worker_bufs(const struct cpu_backend *cb, int worker)
{
    return (struct conv_bufs){ .in0 = wscratch(cb, worker, WSCR_IN0), .in1 = wscratch(cb, worker, WSCR_IN1),
                               .tmp0 = wscratch(cb, worker, WSCR_TMP0), .tmp1 = wscratch(cb, worker, WSCR_TMP1),
                               .worker = worker };
}

/* y_i (c_out, hw) = W (c_out, ckk) @ col_i (ckk, hw) [+ bias per channel]. */
static void conv_forward_image(const struct conv_job *j, int64_t i, const struct conv_bufs *b)
{
    const struct conv_args *a = j->a;
    const struct conv_dims d = conv_dims_of(a);
    const bool pointwise = conv_is_pointwise(a);
    const void *xi = conv_load(j, j->in, (size_t)(i * d.chw_in), (size_t)d.chw_in, b->in0);
    if (!pointwise)
        im2col(b->tmp0, xi, a, dtype_size(j->dt));
    const void *col = pointwise ? xi : b->tmp0;
    /* the bias per output channel, a row of the product: added in its epilogue, as a C filled with the bias
     * and beta 1 would add it (the same bits), without that fill's pass over y */
    if (j->out->dtype == j->dt && j->dt == DT_BF16) {
        /* bf16 y from bf16 products: rounded in the epilogue, as store_f32 rounds (the same bits), without the
         * fp32 image and the pass that rounds it */
        conv_gemm_to(j, b, false, false, a->c_out, d.hw, d.ckk, j->w, d.ckk, col, d.hw, 0.0f,
                     elem_ptr(j->out->data, DT_BF16, (size_t)(i * d.chw_out)), DT_BF16, d.hw, j->bias);
        return;
    }
    float *yi = out_f32(j->out->data, j->out->dtype, (size_t)(i * d.chw_out), b->tmp1);
    conv_gemm(j, b, false, false, a->c_out, d.hw, d.ckk, j->w, d.ckk, col, d.hw, 0.0f, yi, d.hw, j->bias);
    store_f32(j->out->data, j->out->dtype, (size_t)(i * d.chw_out), (size_t)d.chw_out, yi);
}

/* dx_i = col2im(W^T (ckk, c_out) @ dy_i (c_out, hw)). */
static void conv_backward_data_image(const struct conv_job *j, int64_t i, const struct conv_bufs *b)
{
    const struct conv_args *a = j->a;
    const struct conv_dims d = conv_dims_of(a);
    const bool pointwise = conv_is_pointwise(a);
    const void *dyi = conv_load(j, j->in, (size_t)(i * d.chw_out), (size_t)d.chw_out, b->in0);
    float *dxi = out_f32(j->out->data, j->out->dtype, (size_t)(i * d.chw_in), b->tmp1);
    conv_gemm(j, b, true, false, d.ckk, d.hw, a->c_out, j->w, d.ckk, dyi, d.hw, 0.0f, pointwise ? dxi : b->tmp0,
              d.hw, NULL);
    if (!pointwise)
        col2im(dxi, b->tmp0, a);
    store_f32(j->out->data, j->out->dtype, (size_t)(i * d.chw_in), (size_t)d.chw_in, dxi);
}

/* Whether the filter gradient's products are formed transposed, P_i^T (ckk, c_out) = col_i @ dy_i^T, and
 * transposed back: where few input channels make dy_i @ col_i^T a thin product that fills the AVX-512 tiles
 * badly (fashion_cnn's first convolution: 32 x 9) and the swap gives the same bits (gemm_avx512.h). */
static bool conv_filter_transposed(const struct cpu_backend *cb, const struct conv_args *a, enum dtype dt)
{
    return cb->gemm_avx512[dt] && gemm_avx512_transposed_fits(dt, a->c_out, conv_dims_of(a).ckk);
}

/* im2col's columns, then (transposed) the product's ckk x c_out floats: tmp0's size for one image. */
static int64_t conv_filter_tmp0(const struct conv_args *a, bool transposed)
{
    const struct conv_dims d = conv_dims_of(a);
    return (conv_is_pointwise(a) ? 0 : d.ckk * d.hw) + (transposed ? d.ckk * a->c_out : 0);
}

/* C (c_out, ckk) = beta * C + dy_i (c_out, hw) @ col_i^T (hw, ckk); with sums, each channel's plane of dy_i
 * summed in double into sums[co]. Transposed (j->transposed), the product goes to tmp0 after the columns and
 * each element of C then takes beta * C (rounded) + P (rounded), as the product's epilogue would (beta 0: P). */
HOT_LOOP static void conv_filter_image(const struct conv_job *j, int64_t i, const struct conv_bufs *b, float beta,
                                       float *c, double *sums)
{
    const struct conv_args *a = j->a;
    const struct conv_dims d = conv_dims_of(a);
    const bool pointwise = conv_is_pointwise(a);
    const void *dyi = conv_load(j, j->in, (size_t)(i * d.chw_out), (size_t)d.chw_out, b->in0);
    const void *xi = conv_load(j, j->in2, (size_t)(i * d.chw_in), (size_t)d.chw_in, b->in1);
    if (!pointwise)
        im2col(b->tmp0, xi, a, dtype_size(j->dt));
    const void *col = pointwise ? xi : b->tmp0;
    if (j->transposed) {
        float *pt = b->tmp0 + (pointwise ? 0 : d.ckk * d.hw);
        conv_gemm(j, b, false, true, d.ckk, a->c_out, d.hw, col, d.hw, dyi, d.hw, 0.0f, pt, a->c_out, NULL);
        for (int64_t co = 0; co < a->c_out; co++)
            for (int64_t e = 0; e < d.ckk; e++) {
                float *ce = &c[co * d.ckk + e];
                if (beta == 0.0f) {
                    *ce = pt[e * a->c_out + co];
                } else {
                    const float scaled = beta * *ce; /* apart: no contraction into an fma */
                    *ce = scaled + pt[e * a->c_out + co];
                }
            }
    } else {
        conv_gemm(j, b, false, true, a->c_out, d.ckk, d.hw, dyi, d.hw, col, d.hw, beta, c, d.ckk, NULL);
    }
    if (!sums)
        return;
    /* each channel's plane summed in order, CHAINS channels side by side (bf16 values widened exactly) */
    for (int64_t co0 = 0; co0 < a->c_out; co0 += CHAINS) {
        const int64_t lanes = a->c_out - co0 < CHAINS ? a->c_out - co0 : CHAINS;
        double s[CHAINS] = { 0.0 };
#ifdef HAVE_AVX512_INTRIN
        if (planes8_avx512(lanes)) {
            const void *v[CHAINS];
            for (int l = 0; l < CHAINS; l++)
                v[l] = (const char *)dyi + (size_t)((co0 + l) * d.hw) * dtype_size(j->dt);
            planes_sum8_avx512(v, j->dt == DT_BF16, d.hw, s);
        } else
#endif
        if (j->dt == DT_BF16) {
            const uint16_t *p = (const uint16_t *)dyi + co0 * d.hw;
            FOR_CHAINS(lanes, d.hw, l, q, s[l] += bf16_to_fp32(p[l * d.hw + q]));
        } else {
            const float *p = (const float *)dyi + co0 * d.hw;
            FOR_CHAINS(lanes, d.hw, l, q, s[l] += p[l * d.hw + q]);
        }
        for (int64_t l = 0; l < lanes; l++)
            sums[co0 + l] = s[l];
    }
}

static void conv_forward_chunk(void *arg, int64_t chunk, int worker)
{
    const struct conv_job *j = arg;
    const struct conv_bufs b = conv_worker_bufs(j->cb, worker);
    conv_forward_image(j, chunk, &b);
}

static void conv_backward_data_chunk(void *arg, int64_t chunk, int worker)
{
    const struct conv_job *j = arg;
    const struct conv_bufs b = conv_worker_bufs(j->cb, worker);
    conv_backward_data_image(j, chunk, &b);
}

/* Image i0 + chunk of the group: its product, apart, into prod. */
static void conv_filter_chunk(void *arg, int64_t chunk, int worker)
{
    const struct conv_job *j = arg;
    const struct conv_bufs b = conv_worker_bufs(j->cb, worker);
    const int64_t cols = j->a->c_out * conv_dims_of(j->a).ckk;
    double *sums = j->sums ? j->sums + chunk * j->a->c_out : NULL;
    conv_filter_image(j, j->i0 + chunk, &b, 0.0f, j->prod + chunk * cols, sums);
}

/* EW_CHUNK elements of dW: the group's products added in image order, as gemm_avx512's epilogue adds one
 * (beta 0 never reads dW; else beta * dW rounded, then the product added and rounded). */
static void conv_filter_sum_chunk(void *arg, int64_t chunk, int worker)
{
    (void)worker;
    const struct conv_job *j = arg;
    const size_t cols = (size_t)(j->a->c_out * conv_dims_of(j->a).ckk), lo = (size_t)chunk * EW_CHUNK;
    const size_t hi = cols - lo < EW_CHUNK ? cols : lo + EW_CHUNK;
    float *dw = j->out->data;
    for (int64_t k = 0; k < j->images; k++) {
        const float beta = j->i0 + k == 0 ? j->beta : 1.0f, *p = j->prod + (size_t)k * cols;
        if (beta == 0.0f) {
            memcpy(dw + lo, p + lo, (hi - lo) * sizeof(float));
            continue;
        }
        for (size_t e = lo; e < hi; e++) {
            const float scaled = beta * dw[e]; /* apart: no contraction into an fma */
            dw[e] = scaled + p[e];
        }
    }
}

/* How many images' products the threaded filter gradient forms at once: fixed by the problem. */
static int64_t conv_filter_group(const struct conv_args *a)
{
    const size_t per = (size_t)(a->c_out * conv_dims_of(a).ckk) * sizeof(float);
    int64_t g = per ? (int64_t)(CONV_FILTER_BYTES / per) : CONV_FILTER_IMAGES;
    g = g < CONV_FILTER_IMAGES ? g : CONV_FILTER_IMAGES;
    return g < a->n ? g : a->n;
}

/* Every worker's buffers for a chunk reading nin0 values of in0, nin1 of in1 (staged when 16-bit), writing
 * ntmp1 of out (staged when 16-bit), with ntmp0 floats of im2col columns and an (m, n, k) product. */
struct conv_reserve {
    const struct tensor *in0, *in1, *out; /* in0, in1: NULL where nothing is staged (the bf16 path) */
    int64_t nin0, nin1, ntmp0, ntmp1, m, n, k;
    enum dtype dt; /* the products' inputs */
};

static bool conv_reserve_workers(struct cpu_backend *cb, const struct conv_reserve *r)
{
    return wscratch_rows(cb) && wstage_reserve(cb, WSCR_IN0, r->in0, (size_t)r->nin0) &&
           wstage_reserve(cb, WSCR_IN1, r->in1, (size_t)r->nin1) &&
           wstage_reserve(cb, WSCR_TMP1, r->out, (size_t)r->ntmp1) &&
           (r->ntmp0 == 0 || wscratch_reserve(cb, WSCR_TMP0, (size_t)r->ntmp0 * sizeof(float))) &&
           worker_gemm_reserve(cb, r->dt, r->m, r->n, r->k);
}

/* The forward pass and the data gradient alike, image by image: on the pool above the threshold, each worker
 * in its own buffers (r sizes them); else on the calling thread through the shared slots, r->in0 staged into
 * in0, r->out into tmp1, im2col's columns (r->ntmp0, none for a pointwise convolution) in tmp0. */
static void conv_images(struct cpu_backend *cb, const struct conv_job *j, const struct conv_reserve *r,
                        parallel_fn chunk, void (*image)(const struct conv_job *, int64_t, const struct conv_bufs *))
{
    const struct conv_args *a = j->a;
    if (conv_threaded(cb, a)) {
        if (conv_reserve_workers(cb, r))
            parallel_for(cb->pool, a->n, chunk, (void *)j);
        return;
    }
    bool ok = true;
    struct conv_bufs b = { .in0 = stage_f32(cb, SCR_IN0, r->in0, (size_t)r->nin0, &ok),
                           .tmp1 = stage_f32(cb, SCR_TMP1, r->out, (size_t)r->ntmp1, &ok), .worker = -1 };
    b.tmp0 = r->ntmp0 == 0 ? NULL : scratch_get(cb, SCR_TMP0, (size_t)r->ntmp0 * sizeof(float));
    if (!ok || (r->ntmp0 != 0 && !b.tmp0))
        return;
    for (int64_t i = 0; i < a->n; i++)
        image(j, i, &b);
}

static void cpu_conv2d_forward(struct backend *be, const struct conv_args *a, struct tensor *y,
                               const struct tensor *x, const struct tensor *w, const struct tensor *bias)
{
    struct cpu_backend *cb = cpu_of(be);
    conv_check(a);
    const struct conv_dims d = conv_dims_of(a);
    assert((int64_t)x->numel == a->n * d.chw_in && (int64_t)w->numel == a->c_out * d.ckk);
    assert((int64_t)y->numel == a->n * d.chw_out);
    assert(!bias || (bias->dtype == DT_FP32 && (int64_t)bias->numel == a->c_out));
    const bool pointwise = conv_is_pointwise(a);
    const enum dtype dt = conv_product_dtype(cb, x, w);
    const void *wv = dt == DT_BF16 ? w->data : (const void *)view_f32(cb, SCR_IN1, w);
    if (!wv)
        return;
    struct conv_job j = { .cb = cb, .a = a, .out = y, .in = x, .dt = dt, .w = wv,
                          .bias = bias ? (const float *)bias->data : NULL };
    struct conv_reserve r = { .in0 = dt == DT_BF16 ? NULL : x, .out = y, .nin0 = d.chw_in, .ntmp1 = d.chw_out,
                              .ntmp0 = pointwise ? 0 : d.ckk * d.hw, .m = a->c_out, .n = d.hw, .k = d.ckk, .dt = dt };
    conv_images(cb, &j, &r, conv_forward_chunk, conv_forward_image);
}

static void cpu_conv2d_backward_data(struct backend *be, const struct conv_args *a, struct tensor *dx,
                                     const struct tensor *dy, const struct tensor *w)
{
    struct cpu_backend *cb = cpu_of(be);
    conv_check(a);
    const struct conv_dims d = conv_dims_of(a);
    assert((int64_t)dx->numel == a->n * d.chw_in && (int64_t)dy->numel == a->n * d.chw_out);
    const bool pointwise = conv_is_pointwise(a);
    const enum dtype dt = conv_product_dtype(cb, dy, w);
    const void *wv = dt == DT_BF16 ? w->data : (const void *)view_f32(cb, SCR_IN1, w);
    if (!wv)
        return;
    struct conv_job j = { .cb = cb, .a = a, .out = dx, .in = dy, .dt = dt, .w = wv };
    struct conv_reserve r = { .in0 = dt == DT_BF16 ? NULL : dy, .out = dx, .nin0 = d.chw_out, .ntmp1 = d.chw_in,
                              .ntmp0 = pointwise ? 0 : d.ckk * d.hw, .m = d.ckk, .n = d.hw, .k = a->c_out, .dt = dt };
    conv_images(cb, &j, &r, conv_backward_data_chunk, conv_backward_data_image);
}

static void cpu_conv2d_backward_filter(struct backend *be, const struct conv_args *a, struct tensor *dw,
                                       struct tensor *db, const struct tensor *dy, const struct tensor *x, float beta)
{
    struct cpu_backend *cb = cpu_of(be);
    conv_check(a);
    const struct conv_dims d = conv_dims_of(a);
    assert(dw->dtype == DT_FP32 && (int64_t)dw->numel == a->c_out * d.ckk);
    assert(!db || (db->dtype == DT_FP32 && (int64_t)db->numel == a->c_out));
    assert((int64_t)x->numel == a->n * d.chw_in && (int64_t)dy->numel == a->n * d.chw_out);
    const int64_t group = conv_filter_group(a);
    const bool threaded = conv_threaded(cb, a) && group > 1;
    const int64_t sum_images = threaded ? group : 1; /* plane sums held at once */
    double *acc = db ? scratch_get(cb, SCR_ACC0, (size_t)a->c_out * sizeof(double)) : NULL;
    double *sums = db ? scratch_get(cb, SCR_ACC1, (size_t)(sum_images * a->c_out) * sizeof(double)) : NULL;
    if (db && (!acc || !sums))
        return;
    const enum dtype dt = conv_product_dtype(cb, dy, x);
    const bool staged = dt != DT_BF16; /* the bf16 path reads dy and x in place */
    const bool transposed = conv_filter_transposed(cb, a, dt);
    const int64_t ntmp0 = conv_filter_tmp0(a, transposed);
    struct conv_job j = { .cb = cb, .a = a, .out = dw, .in = dy, .in2 = x, .dt = dt, .acc = acc, .beta = beta,
                          .sums = sums, .transposed = transposed };
    bool ok = true;
    struct conv_bufs b = { .worker = -1 };
    if (threaded) {
        struct conv_reserve r = { .in0 = staged ? dy : NULL, .in1 = staged ? x : NULL, .nin0 = d.chw_out,
                                  .nin1 = d.chw_in, .ntmp0 = ntmp0, .m = transposed ? d.ckk : a->c_out,
                                  .n = transposed ? a->c_out : d.ckk, .k = d.hw, .dt = dt };
        j.prod = scratch_get(cb, SCR_TMP2, (size_t)(group * a->c_out * d.ckk) * sizeof(float));
        ok = j.prod && conv_reserve_workers(cb, &r);
    } else {
        b.in0 = stage_f32(cb, SCR_IN0, staged ? dy : NULL, (size_t)d.chw_out, &ok);
        b.in1 = stage_f32(cb, SCR_IN1, staged ? x : NULL, (size_t)d.chw_in, &ok);
        b.tmp0 = ntmp0 == 0 ? NULL : scratch_get(cb, SCR_TMP0, (size_t)ntmp0 * sizeof(float));
        ok = ok && (ntmp0 == 0 || b.tmp0);
    }
    if (!ok)
        return;
    float *dwf = (float *)dw->data;
    if (a->n == 0)
        scale_f32(dwf, dw->numel, beta);
    if (acc)
        memset(acc, 0, (size_t)a->c_out * sizeof(double));
    for (int64_t i0 = 0; i0 < a->n; i0 += sum_images) {
        if (threaded) {
            j.i0 = i0;
            j.images = a->n - i0 < group ? a->n - i0 : group;
            parallel_for(cb->pool, j.images, conv_filter_chunk, &j);
            parallel_for(cb->pool, ew_chunks((size_t)(a->c_out * d.ckk)), conv_filter_sum_chunk, &j);
        } else {
            /* dW (c_out, ckk) += dy_i (c_out, hw) @ col_i^T (hw, ckk) */
            conv_filter_image(&j, i0, &b, i0 == 0 ? beta : 1.0f, dwf, sums);
        }
        /* db: per channel a double sum over the plane, added to the channel's total image by image */
        for (int64_t k = 0; acc && k < (threaded ? j.images : 1); k++)
            for (int64_t co = 0; co < a->c_out; co++)
                acc[co] += sums[k * a->c_out + co];
    }
    if (db)
        store_acc((float *)db->data, acc, (size_t)a->c_out, beta);
}

/* ---- pooling --------------------------------------------------------------------------------- */

/* Index in the plane of the window's max: the first maximum in row-major window order, or the last
 * NaN (PyTorch's CPU rule `val > max || isnan(val)`). Padding never wins (it is -inf). -1 only for a
 * window that covers no input, which valid shapes never produce. */
static int64_t pool_argmax(const float *plane, const struct pool_args *a, int64_t oh, int64_t ow)
{
    int64_t best_i = -1;
    float best = -INFINITY;
    for (int64_t kh = 0; kh < a->kernel; kh++) {
        int64_t ih = oh * a->stride - a->padding + kh;
        if (ih < 0 || ih >= a->h_in)
            continue;
        for (int64_t kw = 0; kw < a->kernel; kw++) {
            int64_t iw = ow * a->stride - a->padding + kw;
            if (iw < 0 || iw >= a->w_in)
                continue;
            float v = plane[ih * a->w_in + iw];
            if (v > best || isnan(v) || best_i < 0) {
                best = v;
                best_i = ih * a->w_in + iw;
            }
        }
    }
    return best_i;
}

/* pool_argmax for a window that lies inside the plane, rows h0 .. h0+k-1, columns w0 .. w0+k-1: the
 * same rule (first maximum; a NaN wins) without bounds checks. */
static inline int32_t window_argmax(const float *plane, int64_t w_in, int64_t h0, int64_t w0, int64_t k)
{
    int32_t best_i = (int32_t)(h0 * w_in + w0);
    float best = plane[best_i];
    for (int64_t kh = 0; kh < k; kh++)
        for (int64_t kw = 0; kw < k; kw++) {
            const int32_t i = (int32_t)((h0 + kh) * w_in + w0 + kw);
            const float v = plane[i];
            const int take = (v > best) | (v != v); /* larger, or NaN */
            best = take ? v : best;
            best_i = take ? i : best_i;
        }
    return best_i;
}

#ifdef HAVE_AVX512_INTRIN
/* ld16 / st16 (ld16m / st16m: some lanes): 16 values of an fp32 or bf16 plane as fp32 lanes and back, bf16 widened
 * exactly and rounded as store_f32 rounds (bf16_lanes.h); the one-pass planes' loads and stores, the max pool's
 * backward and batchnorm's (ld1 / st1: one element, as the scalar loops load and store_f32 stores it). */
__attribute__((target("avx512f,avx512bw"))) static inline __m512 ld16(const void *p, int64_t e, bool bf16)
{
    return bf16 ? bf16_lanes_widen(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + e)))
                : _mm512_loadu_ps((const float *)p + e);
}

__attribute__((target("avx512f,avx512bw"))) static inline void st16(void *p, int64_t e, __m512 v, bool bf16)
{
    if (bf16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)p + e), _mm512_cvtepi32_epi16(bf16_lanes_round(v)));
    else
        _mm512_storeu_ps((float *)p + e, v);
}

/* ld16 / st16 of the lanes in m only (the others load as +0 and are not stored). */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static inline __m512 ld16m(const void *p, int64_t e, bool bf16,
                                                                                __mmask16 m)
{
    if (bf16)
        return bf16_lanes_widen(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + e));
    return _mm512_maskz_loadu_ps(m, (const float *)p + e);
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) static inline void st16m(void *p, int64_t e, __m512 v, bool bf16,
                                                                             __mmask16 m)
{
    if (bf16)
        _mm512_mask_cvtepi32_storeu_epi16((uint16_t *)p + e, m, bf16_lanes_round(v));
    else
        _mm512_mask_storeu_ps((float *)p + e, m, v);
}

static inline float ld1(const void *p, int64_t e, bool bf16)
{
    return bf16 ? bf16_to_fp32(((const uint16_t *)p)[e]) : ((const float *)p)[e];
}

static inline void st1(void *p, int64_t e, float v, bool bf16)
{
    if (bf16)
        ((uint16_t *)p)[e] = bf16_from_fp32(v);
    else
        ((float *)p)[e] = v;
}

/* window_argmax of the windows 2x2 / stride 2 of one row, 16 at a time (the last group masked): the four
 * candidates of each window (row-major order) deinterleaved from two 32-float loads per row, then taken in
 * window_argmax's order with its rule (larger, or NaN), so the same index. */
__attribute__((target("avx512f"))) static void maxpool_row_2x2_avx512(const float *plane, int64_t w_in, int64_t h0,
                                                                      int64_t w0, int64_t count, int32_t *arg)
{
    const float *r0 = plane + h0 * w_in + w0, *r1 = r0 + w_in;
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    const __m512i one = _mm512_set1_epi32(1), down = _mm512_set1_epi32((int32_t)w_in);
    for (int64_t o = 0; o < count; o += 16) {
        const int64_t n = count - o < 16 ? count - o : 16, vals = 2 * n; /* windows, and floats per row */
        const __mmask16 m0 = vals >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << vals) - 1);
        const __mmask16 m1 = vals >= 32 ? (__mmask16)0xFFFF : vals > 16 ? (__mmask16)((1u << (vals - 16)) - 1) : 0;
        const __m512 x0 = _mm512_maskz_loadu_ps(m0, r0 + 2 * o), x1 = _mm512_maskz_loadu_ps(m1, r0 + 2 * o + 16);
        const __m512 y0 = _mm512_maskz_loadu_ps(m0, r1 + 2 * o), y1 = _mm512_maskz_loadu_ps(m1, r1 + 2 * o + 16);
        const __m512 v[4] = { _mm512_permutex2var_ps(x0, even, x1), _mm512_permutex2var_ps(x0, odd, x1),
                              _mm512_permutex2var_ps(y0, even, y1), _mm512_permutex2var_ps(y0, odd, y1) };
        const __m512i ia = _mm512_add_epi32(_mm512_set1_epi32((int32_t)(h0 * w_in + w0 + 2 * o)), even);
        const __m512i idx[4] = { ia, _mm512_add_epi32(ia, one), _mm512_add_epi32(ia, down),
                                 _mm512_add_epi32(_mm512_add_epi32(ia, down), one) };
        __m512 best = v[0];
        __m512i bi = idx[0];
        for (int c = 0; c < 4; c++) {
            const __mmask16 take = _mm512_cmp_ps_mask(v[c], best, _CMP_GT_OQ) | _mm512_cmp_ps_mask(v[c], v[c], _CMP_UNORD_Q);
            best = _mm512_mask_mov_ps(best, take, v[c]);
            bi = _mm512_mask_mov_epi32(bi, take, idx[c]);
        }
        _mm512_mask_storeu_epi32(arg + o, n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1), bi);
    }
}

/* The gradient of a 2x2 / stride-2 max pool without padding over a plane of 2 h_out x 2 w_out (x, dy, dx all fp32
 * or all bf16), in one pass and 16 windows at a time: each window's max chosen by maxpool_row_2x2_avx512's rule
 * (the first of equal values, the last NaN), and its four dx values written at once, the window's gradient
 * 0 + dy at the max (the generic path adds dy to a zeroed plane: -0 becomes +0 there too) and +0 elsewhere,
 * rounded as store_f32 rounds. Every input is in one window, so this is the generic path's plane, bit for bit,
 * without its zeroing pass, the argmax array, the scatter and, for bf16, the staging and rounding passes. */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static void maxpool2x2_backward_plane(void *dx, const void *dy,
                                                                                          const void *x, bool bf16,
                                                                                          int64_t h_out, int64_t w_out)
{
    const int64_t w_in = 2 * w_out;
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    /* window i's left and right values side by side: outputs 2i and 2i + 1 of the row */
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (int64_t oh = 0; oh < h_out; oh++) {
        const int64_t r0 = 2 * oh * w_in, r1 = r0 + w_in;
        for (int64_t o = 0; o < w_out; o += 16) {
            const int64_t n = w_out - o < 16 ? w_out - o : 16, vals = 2 * n; /* windows, and values per row */
            const __mmask16 mw = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
            const __mmask16 m0 = vals >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << vals) - 1);
            const __mmask16 m1 = vals >= 32 ? (__mmask16)0xFFFF : vals > 16 ? (__mmask16)((1u << (vals - 16)) - 1) : 0;
            const __m512 x0 = ld16m(x, r0 + 2 * o, bf16, m0), x1 = ld16m(x, r0 + 2 * o + 16, bf16, m1);
            const __m512 y0 = ld16m(x, r1 + 2 * o, bf16, m0), y1 = ld16m(x, r1 + 2 * o + 16, bf16, m1);
            const __m512 v[4] = { _mm512_permutex2var_ps(x0, even, x1), _mm512_permutex2var_ps(x0, odd, x1),
                                  _mm512_permutex2var_ps(y0, even, y1), _mm512_permutex2var_ps(y0, odd, y1) };
            __m512 best = v[0];
            __m512i which = _mm512_setzero_si512();
            for (int c = 1; c < 4; c++) {
                const __mmask16 take =
                    _mm512_cmp_ps_mask(v[c], best, _CMP_GT_OQ) | _mm512_cmp_ps_mask(v[c], v[c], _CMP_UNORD_Q);
                best = _mm512_mask_mov_ps(best, take, v[c]);
                which = _mm512_mask_mov_epi32(which, take, _mm512_set1_epi32(c));
            }
            const __m512 g = _mm512_add_ps(_mm512_setzero_ps(), ld16m(dy, oh * w_out + o, bf16, mw));
            __m512 d[4];
            for (int c = 0; c < 4; c++)
                d[c] = _mm512_maskz_mov_ps(_mm512_cmpeq_epi32_mask(which, _mm512_set1_epi32(c)), g);
            st16m(dx, r0 + 2 * o, _mm512_permutex2var_ps(d[0], lo, d[1]), bf16, m0);
            st16m(dx, r0 + 2 * o + 16, _mm512_permutex2var_ps(d[0], hi, d[1]), bf16, m1);
            st16m(dx, r1 + 2 * o, _mm512_permutex2var_ps(d[2], lo, d[3]), bf16, m0);
            st16m(dx, r1 + 2 * o + 16, _mm512_permutex2var_ps(d[2], hi, d[3]), bf16, m1);
        }
    }
}

/* Whether a max pool's backward runs maxpool2x2_backward_plane: 2x2, stride 2, no padding, even planes, one dtype
 * (fp32 or bf16) for x, dy and dx, on a CPU with AVX-512 (BW, VL). */
static bool maxpool2x2_fused_runs(const struct pool_args *a, const struct tensor *dx, const struct tensor *dy,
                                  const struct tensor *x)
{
    return a->kind == POOL_MAX && a->kernel == 2 && a->stride == 2 && a->padding == 0 && a->h_in == 2 * a->h_out &&
           a->w_in == 2 * a->w_out && x->dtype == dy->dtype && dy->dtype == dx->dtype &&
           (x->dtype == DT_FP32 || x->dtype == DT_BF16) && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}
#endif

/* window_argmax over `count` windows of one output row, `stride` apart; the 2x2 / stride 2 case (the
 * reference CNN's) gets constants, so the window loops unroll, and 16 windows at a time with AVX-512. */
static void maxpool_row_inside(const float *plane, int64_t w_in, int64_t h0, int64_t w0, int64_t stride, int64_t k,
                               int64_t count, int32_t *arg)
{
    if (stride == 2 && k == 2) {
#ifdef HAVE_AVX512_INTRIN
        if (__builtin_cpu_supports("avx512f")) {
            maxpool_row_2x2_avx512(plane, w_in, h0, w0, count, arg);
            return;
        }
#endif
        for (int64_t o = 0; o < count; o++)
            arg[o] = window_argmax(plane, w_in, h0, w0 + 2 * o, 2);
    } else
        for (int64_t o = 0; o < count; o++)
            arg[o] = window_argmax(plane, w_in, h0, w0 + stride * o, k);
}

/* The argmax (index into the plane, -1 for a window of padding only) of every output of one plane:
 * windows inside the plane by maxpool_row_inside, the ones that touch the padding by pool_argmax. */
static void maxpool_plane_argmax(const float *plane, const struct pool_args *a, int32_t *arg)
{
    assert(a->h_in * a->w_in <= INT32_MAX);
    const int64_t s = a->stride, p = a->padding, k = a->kernel;
    /* output columns whose windows lie inside: ow*s - p >= 0 and ow*s - p + k <= w_in */
    int64_t ow0 = (p + s - 1) / s, ow1 = a->w_in + p - k >= 0 ? (a->w_in + p - k) / s + 1 : 0;
    ow1 = ow1 < a->w_out ? ow1 : a->w_out;
    for (int64_t oh = 0; oh < a->h_out; oh++) {
        int32_t *row = arg + oh * a->w_out;
        const int64_t h0 = oh * s - p;
        const bool inside = h0 >= 0 && h0 + k <= a->h_in && ow0 < ow1;
        const int64_t lo = inside ? ow0 : a->w_out, hi = inside ? ow1 : a->w_out;
        for (int64_t ow = 0; ow < lo; ow++)
            row[ow] = (int32_t)pool_argmax(plane, a, oh, ow);
        if (inside)
            maxpool_row_inside(plane, a->w_in, h0, ow0 * s - p, s, k, ow1 - ow0, row + ow0);
        for (int64_t ow = hi; ow < a->w_out; ow++)
            row[ow] = (int32_t)pool_argmax(plane, a, oh, ow);
    }
}

/* PyTorch's count_include_pad divisor: the window clipped to the padded extent of the input. */
static int64_t pool_divisor(const struct pool_args *a, int64_t oh, int64_t ow)
{
    int64_t h0 = oh * a->stride - a->padding, w0 = ow * a->stride - a->padding;
    int64_t h1 = h0 + a->kernel < a->h_in + a->padding ? h0 + a->kernel : a->h_in + a->padding;
    int64_t w1 = w0 + a->kernel < a->w_in + a->padding ? w0 + a->kernel : a->w_in + a->padding;
    return (h1 - h0) * (w1 - w0);
}

/* Pooling works one (n, c) plane at a time; 16-bit planes are staged through O(plane) scratch. The
 * planes are cut into chunks of at least EW_CHUNK input elements (one chunk for a smaller problem); a
 * plane's outputs depend on that plane alone, so which worker runs a chunk changes no bit. */
struct pool_job {
    const struct cpu_backend *cb;
    const struct pool_args *a;
    struct tensor *out;                       /* y, dx */
    const struct tensor *in, *x;              /* forward: x, NULL; backward: dy, x */
    int64_t planes;                           /* planes a chunk */
};

static int64_t pool_chunk_planes(const struct pool_args *a)
{
    const int64_t hw_in = a->h_in * a->w_in, all = a->n * a->c;
    if (hw_in <= 0 || all * hw_in < (int64_t)EW_CHUNK)
        return all > 0 ? all : 1;
    return ((int64_t)EW_CHUNK + hw_in - 1) / hw_in;
}

static bool pool_reserve(struct cpu_backend *cb, const struct pool_args *a, const struct tensor *in, size_t nin,
                         const struct tensor *x, const struct tensor *out, size_t nout)
{
    const size_t hw = (size_t)(a->h_out * a->w_out);
    return wscratch_rows(cb) && wstage_reserve(cb, WSCR_IN0, in, nin) &&
           wstage_reserve(cb, WSCR_IN1, x, (size_t)(a->h_in * a->w_in)) &&
           wstage_reserve(cb, WSCR_TMP0, out, nout) &&
           (a->kind != POOL_MAX || wscratch_reserve(cb, WSCR_IDX, hw * sizeof(int32_t)));
}

static void pool_forward_chunk(void *arg, int64_t chunk, int worker)
{
    const struct pool_job *j = arg;
    const struct pool_args *a = j->a;
    const struct tensor *x = j->in, *y = j->out;
    int64_t hw_in = a->h_in * a->w_in, hw = a->h_out * a->w_out, all = a->n * a->c;
    float *xbuf = wscratch(j->cb, worker, WSCR_IN0), *ybuf = wscratch(j->cb, worker, WSCR_TMP0);
    int32_t *arg_max = wscratch(j->cb, worker, WSCR_IDX);
    const int64_t pl0 = chunk * j->planes, pl1 = all - pl0 < j->planes ? all : pl0 + j->planes;
    for (int64_t pl = pl0; pl < pl1; pl++) {
        const float *plane = load_f32(x->data, x->dtype, (size_t)(pl * hw_in), (size_t)hw_in, xbuf);
        float *out = out_f32(y->data, y->dtype, (size_t)(pl * hw), ybuf);
        if (a->kind == POOL_MAX) {
            maxpool_plane_argmax(plane, a, arg_max);
            for (int64_t o = 0; o < hw; o++)
                out[o] = arg_max[o] >= 0 ? plane[arg_max[o]] : -INFINITY;
            store_f32(y->data, y->dtype, (size_t)(pl * hw), (size_t)hw, out);
            continue;
        }
        for (int64_t oh = 0; oh < a->h_out; oh++)
            for (int64_t ow = 0; ow < a->w_out; ow++) {
                float sum = 0.0f;
                for (int64_t kh = 0; kh < a->kernel; kh++) {
                    int64_t ih = oh * a->stride - a->padding + kh;
                    if (ih < 0 || ih >= a->h_in)
                        continue;
                    for (int64_t kw = 0; kw < a->kernel; kw++) {
                        int64_t iw = ow * a->stride - a->padding + kw;
                        if (iw >= 0 && iw < a->w_in)
                            sum += plane[ih * a->w_in + iw];
                    }
                }
                out[oh * a->w_out + ow] = sum / (float)pool_divisor(a, oh, ow);
            }
        store_f32(y->data, y->dtype, (size_t)(pl * hw), (size_t)hw, out);
    }
}

static void cpu_pool2d_forward(struct backend *be, const struct pool_args *a, struct tensor *y,
                               const struct tensor *x)
{
    struct cpu_backend *cb = cpu_of(be);
    int64_t hw_in = a->h_in * a->w_in, hw = a->h_out * a->w_out;
    assert((int64_t)x->numel == a->n * a->c * hw_in && (int64_t)y->numel == a->n * a->c * hw);
    if (!pool_reserve(cb, a, x, (size_t)hw_in, NULL, y, (size_t)hw))
        return;
    struct pool_job j = { .cb = cb, .a = a, .out = y, .in = x, .planes = pool_chunk_planes(a) };
    parallel_for(cb->pool, (a->n * a->c + j.planes - 1) / j.planes, pool_forward_chunk, &j);
}

static void pool_backward_chunk(void *arg, int64_t chunk, int worker)
{
    const struct pool_job *j = arg;
    const struct pool_args *a = j->a;
    const struct tensor *dy = j->in, *x = j->x, *dx = j->out;
    int64_t hw_in = a->h_in * a->w_in, hw = a->h_out * a->w_out, all = a->n * a->c;
    bool is_max = a->kind == POOL_MAX;
    float *dybuf = wscratch(j->cb, worker, WSCR_IN0), *xbuf = wscratch(j->cb, worker, WSCR_IN1);
    float *dxbuf = wscratch(j->cb, worker, WSCR_TMP0);
    int32_t *arg_max = wscratch(j->cb, worker, WSCR_IDX);
    const int64_t pl0 = chunk * j->planes, pl1 = all - pl0 < j->planes ? all : pl0 + j->planes;
#ifdef HAVE_AVX512_INTRIN
    if (is_max && maxpool2x2_fused_runs(a, dx, dy, x)) {
        for (int64_t pl = pl0; pl < pl1; pl++)
            maxpool2x2_backward_plane(elem_ptr(dx->data, dx->dtype, (size_t)(pl * hw_in)),
                                      elem_ptr(dy->data, dy->dtype, (size_t)(pl * hw)),
                                      elem_ptr(x->data, x->dtype, (size_t)(pl * hw_in)), x->dtype == DT_BF16, a->h_out,
                                      a->w_out);
        return;
    }
#endif
    for (int64_t pl = pl0; pl < pl1; pl++) {
        float *dplane = out_f32(dx->data, dx->dtype, (size_t)(pl * hw_in), dxbuf);
        const float *g = load_f32(dy->data, dy->dtype, (size_t)(pl * hw), (size_t)hw, dybuf);
        const float *xplane = is_max ? load_f32(x->data, x->dtype, (size_t)(pl * hw_in), (size_t)hw_in, xbuf) : NULL;
        memset(dplane, 0, (size_t)hw_in * sizeof(float));
        if (is_max) {
            maxpool_plane_argmax(xplane, a, arg_max);
            for (int64_t o = 0; o < hw; o++) /* in output order: the sums' order does not depend on the path */
                if (arg_max[o] >= 0)
                    dplane[arg_max[o]] += g[o];
            store_f32(dx->data, dx->dtype, (size_t)(pl * hw_in), (size_t)hw_in, dplane);
            continue;
        }
        for (int64_t oh = 0; oh < a->h_out; oh++)
            for (int64_t ow = 0; ow < a->w_out; ow++) {
                float gv = g[oh * a->w_out + ow];
                float share = gv / (float)pool_divisor(a, oh, ow);
                for (int64_t kh = 0; kh < a->kernel; kh++) {
                    int64_t ih = oh * a->stride - a->padding + kh;
                    if (ih < 0 || ih >= a->h_in)
                        continue;
                    for (int64_t kw = 0; kw < a->kernel; kw++) {
                        int64_t iw = ow * a->stride - a->padding + kw;
                        if (iw >= 0 && iw < a->w_in)
                            dplane[ih * a->w_in + iw] += share;
                    }
                }
            }
        store_f32(dx->data, dx->dtype, (size_t)(pl * hw_in), (size_t)hw_in, dplane);
    }
}

static void cpu_pool2d_backward(struct backend *be, const struct pool_args *a, struct tensor *dx,
                                const struct tensor *dy, const struct tensor *x, const struct tensor *y)
{
    struct cpu_backend *cb = cpu_of(be);
    (void)y; /* the window's argmax is recomputed from x */
    int64_t hw_in = a->h_in * a->w_in, hw = a->h_out * a->w_out;
    assert((int64_t)dx->numel == a->n * a->c * hw_in && (int64_t)dy->numel == a->n * a->c * hw);
    bool is_max = a->kind == POOL_MAX;
    if (!pool_reserve(cb, a, dy, (size_t)hw, is_max ? x : NULL, dx, (size_t)hw_in))
        return;
    struct pool_job j = { .cb = cb, .a = a, .out = dx, .in = dy, .x = is_max ? x : NULL,
                          .planes = pool_chunk_planes(a) };
    parallel_for(cb->pool, (a->n * a->c + j.planes - 1) / j.planes, pool_backward_chunk, &j);
}

/* ---- normalisation --------------------------------------------------------------------------- */

/* Layernorm is threaded by rows (rows_per_chunk of them a chunk): a row's statistics and outputs depend on
 * that row alone. The weight and bias gradients are sums over all rows, so they are threaded by columns
 * instead (LN_COLS a chunk): each column is summed over the rows in order 0, 1, ..., in double, exactly as
 * one thread does. */
#define LN_COLS 32

struct ln_job {
    struct cpu_backend *cb;
    const struct norm_args *a;
    struct tensor *y, *dx;                 /* (rows, cols), x's dtype */
    float *mean_out, *rstd_out;            /* (rows) forward's statistics */
    const float *mean, *rstd;              /* (rows) the same, read backward */
    struct tensor *dgamma, *dbeta;         /* (cols) fp32 */
    const struct tensor *x, *dy;           /* (rows, cols); forward with an addend: x is a->sum */
    const struct tensor *x1;               /* forward with an addend: the add's first input */
    const float *g, *bt;                   /* gamma, beta (cols) fp32, or NULL */
    double *acc_g, *acc_b;                 /* (cols) the gradients' sums */
    float beta_acc;
    int64_t rows_per;                      /* rows per chunk */
};

/* A row's mean and variance (forward) and its two gradient sums (backward) are double sums over its columns in
 * order: CHAINS rows side by side (FOR_CHAINS; a 16-bit row is staged in its own slice of the scratch). */

HOT_LOOP static void ln_forward_chunk(void *arg, int64_t chunk, int worker)
{
    const struct ln_job *j = arg;
    const struct tensor *x = j->x;
    struct tensor *y = j->y;
    int64_t cols = j->a->cols, r0 = chunk * j->rows_per;
    int64_t r1 = r0 + j->rows_per < j->a->rows ? r0 + j->rows_per : j->a->rows;
    const float *g = j->g, *bt = j->bt;
    float *xb = wscratch(j->cb, worker, WSCR_TMP0), *yb = wscratch(j->cb, worker, WSCR_TMP1);
    if (j->a->addend) /* the fused residual add: the chunk's rows of sum first, read back below as stored */
        add_range(j->a->sum, j->x1, j->a->addend, (size_t)(r0 * cols), (size_t)(r1 * cols));
    for (int64_t rg = r0; rg < r1; rg += CHAINS) {
        const int64_t lanes = r1 - rg < CHAINS ? r1 - rg : CHAINS;
        const float *xr[CHAINS];
        double s[CHAINS] = { 0.0 }, ss[CHAINS] = { 0.0 }, mu[CHAINS];
        for (int64_t l = 0; l < lanes; l++)
            xr[l] = load_f32(x->data, x->dtype, (size_t)((rg + l) * cols), (size_t)cols, xb + l * cols);
#ifdef HAVE_AVX512_INTRIN
        const bool planes = planes8_avx512(lanes); /* the rows as a vector's lanes: the same sums */
        if (planes)
            planes_sum8_avx512((const void *const *)xr, false, cols, s);
        else
#endif
            FOR_CHAINS(lanes, cols, l, k, s[l] += xr[l][k]);
        for (int64_t l = 0; l < lanes; l++)
            mu[l] = s[l] / (double)cols;
#ifdef HAVE_AVX512_INTRIN
        if (planes)
            planes_sumsq8_avx512((const void *const *)xr, false, cols, mu, ss);
        else
#endif
            FOR_CHAINS(lanes, cols, l, k, double d = xr[l][k] - mu[l]; ss[l] += d * d);
        for (int64_t l = 0; l < lanes; l++) {
            const int64_t r = rg + l;
            float mu_f = (float)mu[l];
            float rs_f = (float)(1.0 / sqrt(ss[l] / (double)cols + (double)j->a->eps));
            j->mean_out[r] = mu_f;
            j->rstd_out[r] = rs_f;
            float *yr = out_f32(y->data, y->dtype, (size_t)(r * cols), yb);
            for (int64_t k = 0; k < cols; k++) {
                float v = (xr[l][k] - mu_f) * rs_f;
                yr[k] = v * (g ? g[k] : 1.0f) + (bt ? bt[k] : 0.0f);
            }
            store_f32(y->data, y->dtype, (size_t)(r * cols), (size_t)cols, yr);
        }
    }
}

static void cpu_layernorm_forward(struct backend *be, const struct norm_args *a, struct tensor *y,
                                  struct tensor *mean, struct tensor *rstd, const struct tensor *x,
                                  const struct tensor *gamma, const struct tensor *beta)
{
    struct cpu_backend *cb = cpu_of(be);
    int64_t rows = a->rows, cols = a->cols;
    assert((int64_t)x->numel == rows * cols && (int64_t)y->numel == rows * cols);
    assert(mean->dtype == DT_FP32 && rstd->dtype == DT_FP32 && (int64_t)mean->numel == rows);
    if (!wscratch_reserve(cb, WSCR_TMP0, (size_t)(CHAINS * cols) * sizeof(float)) ||
        !wscratch_reserve(cb, WSCR_TMP1, (size_t)cols * sizeof(float)))
        return;
    assert(!a->addend || (a->sum && a->addend->numel == x->numel && a->sum->numel == x->numel));
    struct ln_job j = { .cb = cb, .a = a, .y = y, .mean_out = mean->data, .rstd_out = rstd->data,
                        .x = a->addend ? a->sum : x, .x1 = x,
                        .g = gamma ? (const float *)gamma->data : NULL, .bt = beta ? (const float *)beta->data : NULL,
                        .rows_per = rows_per_chunk(cols) };
    parallel_for(cb->pool, div_up(rows, j.rows_per), ln_forward_chunk, &j);
}

/* dx for a chunk of rows: each row's two sums over its columns, in column order, then its dx. */
HOT_LOOP static void ln_backward_dx_chunk(void *arg, int64_t chunk, int worker)
{
    const struct ln_job *j = arg;
    int64_t cols = j->a->cols, r0 = chunk * j->rows_per;
    int64_t r1 = r0 + j->rows_per < j->a->rows ? r0 + j->rows_per : j->a->rows;
    const float *g = j->g;
    float *xb = wscratch(j->cb, worker, WSCR_TMP0), *dyb = wscratch(j->cb, worker, WSCR_TMP1);
    float *dxb = wscratch(j->cb, worker, WSCR_TMP2);
    for (int64_t rg = r0; rg < r1; rg += CHAINS) {
        const int64_t lanes = r1 - rg < CHAINS ? r1 - rg : CHAINS;
        const float *xr[CHAINS], *dyr[CHAINS];
        float mu[CHAINS], rs[CHAINS];
        double s1[CHAINS] = { 0.0 }, s2[CHAINS] = { 0.0 }; /* sum dxhat, sum dxhat * xhat */
        for (int64_t l = 0; l < lanes; l++) {
            const size_t off = (size_t)((rg + l) * cols);
            xr[l] = load_f32(j->x->data, j->x->dtype, off, (size_t)cols, xb + l * cols);
            dyr[l] = load_f32(j->dy->data, j->dy->dtype, off, (size_t)cols, dyb + l * cols);
            mu[l] = j->mean[rg + l];
            rs[l] = j->rstd[rg + l];
        }
#ifdef HAVE_AVX512_INTRIN
        if (planes8_avx512(lanes)) /* the rows as a vector's lanes: the same sums (no g: dy * 1 is dy) */
            planes_gradsum8_avx512((const void *const *)xr, (const void *const *)dyr, NULL, g, false, cols, mu, rs,
                                   s1, s2);
        else
#endif
            FOR_CHAINS(lanes, cols, l, k, float xhat = (xr[l][k] - mu[l]) * rs[l];
                       float dxhat = dyr[l][k] * (g ? g[k] : 1.0f); s1[l] += dxhat; s2[l] += (double)dxhat * xhat);
        for (int64_t l = 0; l < lanes; l++) {
            const int64_t r = rg + l;
            float m1 = (float)(s1[l] / (double)cols), m2 = (float)(s2[l] / (double)cols);
            float *dxr = out_f32(j->dx->data, j->dx->dtype, (size_t)(r * cols), dxb);
            for (int64_t k = 0; k < cols; k++) {
                float xhat = (xr[l][k] - mu[l]) * rs[l];
                float dxhat = dyr[l][k] * (g ? g[k] : 1.0f);
                dxr[k] = rs[l] * (dxhat - m1 - xhat * m2);
            }
            store_f32(j->dx->data, j->dx->dtype, (size_t)(r * cols), (size_t)cols, dxr);
        }
    }
    if (j->a->dsum) /* the fused residual's gradient: dx (as stored) + dsum, rounded once, the chunk's rows */
        add_range(j->dx, j->dx, j->a->dsum, (size_t)(r0 * cols), (size_t)(r1 * cols));
}

/* dgamma and dbeta for columns [c0, c1): each summed over all rows in row order. */
HOT_LOOP static void ln_backward_dparams_chunk(void *arg, int64_t chunk, int worker)
{
    const struct ln_job *j = arg;
    int64_t cols = j->a->cols, c0 = chunk * LN_COLS, w = cols - c0 < LN_COLS ? cols - c0 : LN_COLS;
    float *xb = wscratch(j->cb, worker, WSCR_TMP0), *dyb = wscratch(j->cb, worker, WSCR_TMP1);
    double *acc_g = j->acc_g + c0, *acc_b = j->acc_b + c0;
    memset(acc_g, 0, (size_t)w * sizeof(double));
    memset(acc_b, 0, (size_t)w * sizeof(double));
    for (int64_t r = 0; r < j->a->rows; r++) {
        const float *xr = load_f32(j->x->data, j->x->dtype, (size_t)(r * cols + c0), (size_t)w, xb);
        const float *dyr = load_f32(j->dy->data, j->dy->dtype, (size_t)(r * cols + c0), (size_t)w, dyb);
        float mu = j->mean[r], rs = j->rstd[r];
        for (int64_t k = 0; k < w; k++) {
            float xhat = (xr[k] - mu) * rs;
            acc_g[k] += (double)dyr[k] * xhat;
            acc_b[k] += dyr[k];
        }
    }
    if (j->dgamma)
        store_acc((float *)j->dgamma->data + c0, acc_g, (size_t)w, j->beta_acc);
    if (j->dbeta)
        store_acc((float *)j->dbeta->data + c0, acc_b, (size_t)w, j->beta_acc);
}

static void cpu_layernorm_backward(struct backend *be, const struct norm_args *a, struct tensor *dx,
                                   struct tensor *dgamma, struct tensor *dbeta, const struct tensor *dy,
                                   const struct tensor *x, const struct tensor *mean, const struct tensor *rstd,
                                   const struct tensor *gamma, float beta_acc)
{
    struct cpu_backend *cb = cpu_of(be);
    int64_t rows = a->rows, cols = a->cols;
    assert((int64_t)x->numel == rows * cols && (int64_t)dy->numel == rows * cols);
    size_t row_bytes = (size_t)cols * sizeof(float);
    double *acc_g = scratch_get(cb, SCR_ACC0, (size_t)cols * sizeof(double));
    double *acc_b = scratch_get(cb, SCR_ACC1, (size_t)cols * sizeof(double));
    if (!acc_g || !acc_b || !wscratch_reserve(cb, WSCR_TMP0, CHAINS * row_bytes) ||
        !wscratch_reserve(cb, WSCR_TMP1, CHAINS * row_bytes) || !wscratch_reserve(cb, WSCR_TMP2, row_bytes))
        return;
    struct ln_job j = { .cb = cb, .a = a, .dx = dx, .dgamma = dgamma, .dbeta = dbeta, .mean = mean->data,
                        .rstd = rstd->data, .x = x, .dy = dy,
                        .g = gamma ? (const float *)gamma->data : NULL, .acc_g = acc_g, .acc_b = acc_b,
                        .beta_acc = beta_acc, .rows_per = rows_per_chunk(cols) };
    if (dx)
        parallel_for(cb->pool, div_up(rows, j.rows_per), ln_backward_dx_chunk, &j);
    /* column chunks hold every row: worth the pool only when the whole problem is more than one chunk */
    if (dgamma || dbeta)
        parallel_for(rows * cols > (int64_t)EW_CHUNK ? cb->pool : NULL, div_up(cols, LN_COLS),
                     ln_backward_dparams_chunk, &j);
}

/* Batchnorm (n, c, hw): channel ch's values are the n planes x[i, ch, :]. Everything of a channel — its
 * statistics (double sums over the images in order), its running statistics, its outputs, its parameter
 * gradients — depends on that channel alone, so the channels are cut into chunks of at least EW_CHUNK
 * elements (one chunk for a smaller problem), each computed in the order one thread would. */
struct bn_job {
    const struct cpu_backend *cb;
    const struct norm_args *a;
    struct tensor *out;                           /* y, dx (NULL: no dx) */
    const struct tensor *x, *dy;
    const struct tensor *y;                       /* backward with a fused ReLU: the forward's y (its mask) */
    struct tensor *mean, *rstd, *running_mean, *running_var; /* forward */
    const struct tensor *smean, *srstd;          /* backward: the saved statistics */
    const float *gamma, *beta;
    double *acc_g, *acc_b;                        /* backward: per-channel sums (c each) */
    int64_t channels;                             /* channels a chunk */
};

/* A channel's statistics and gradient sums are double sums in order: CHAINS channels side by side (FOR_CHAINS),
 * and a chunk holds at least that many channels where the layer has them. */

static int64_t bn_chunk_channels(const struct norm_args *a)
{
    const int64_t per = a->n * a->hw;
    if (per <= 0 || a->c * per < (int64_t)EW_CHUNK)
        return a->c > 0 ? a->c : 1;
    const int64_t by_size = ((int64_t)EW_CHUNK + per - 1) / per;
    return by_size > CHAINS ? by_size : CHAINS;
}

#ifdef HAVE_AVX512_INTRIN
/* The 8 planes from element off0 of data (dtype dt: a tensor's, or bn_dy_planes' staging) as the vector kernels
 * read them: bf16 as it is stored, else as fp32 (load_f32: fp16 widened into buf's planes). Whether they are
 * bf16. */
static bool bn_planes(const void *data, enum dtype dt, size_t off0, int64_t hw, float *buf, const void *p[CHAINS])
{
    const bool bf16 = dt == DT_BF16;
    for (int l = 0; l < CHAINS; l++) {
        size_t off = off0 + (size_t)(l * hw);
        p[l] = bf16 ? (const void *)((const uint16_t *)data + off)
                    : (const void *)load_f32(data, dt, off, (size_t)hw, buf ? buf + l * hw : NULL);
    }
    return bf16;
}

#endif

/* Training statistics of channels ch0 .. ch0 + lanes - 1 (lanes <= CHAINS): each channel's double sum of
 * its values over the images in order, then of its squared deviations from its mean (xbuf: lanes planes,
 * where x is 16-bit). */
HOT_LOOP static void bn_stats(const struct bn_job *j, int64_t ch0, int64_t lanes, float *xbuf, double *s, double *ss)
{
    const struct tensor *x = j->x;
    const int64_t n = j->a->n, c = j->a->c, hw = j->a->hw;
    const double count = (double)(n * hw);
    const float *p[CHAINS];
    double mu[CHAINS];
    for (int64_t l = 0; l < lanes; l++)
        s[l] = ss[l] = 0.0;
    for (int64_t i = 0; i < n; i++) {
#ifdef HAVE_AVX512_INTRIN
        if (planes8_avx512(lanes)) {
            const void *v[CHAINS];
            bool bf16 = bn_planes(x->data, x->dtype, (size_t)((i * c + ch0) * hw), hw, xbuf, v);
            planes_sum8_avx512(v, bf16, hw, s);
            continue;
        }
#endif
        for (int64_t l = 0; l < lanes; l++)
            p[l] = load_f32(x->data, x->dtype, (size_t)((i * c + ch0 + l) * hw), (size_t)hw, xbuf ? xbuf + l * hw : NULL);
        FOR_CHAINS(lanes, hw, l, q, s[l] += p[l][q]);
    }
    for (int64_t l = 0; l < lanes; l++)
        mu[l] = s[l] / count;
    for (int64_t i = 0; i < n; i++) {
#ifdef HAVE_AVX512_INTRIN
        if (planes8_avx512(lanes)) {
            const void *v[CHAINS];
            bool bf16 = bn_planes(x->data, x->dtype, (size_t)((i * c + ch0) * hw), hw, xbuf, v);
            planes_sumsq8_avx512(v, bf16, hw, mu, ss);
            continue;
        }
#endif
        for (int64_t l = 0; l < lanes; l++)
            p[l] = load_f32(x->data, x->dtype, (size_t)((i * c + ch0 + l) * hw), (size_t)hw, xbuf ? xbuf + l * hw : NULL);
        FOR_CHAINS(lanes, hw, l, q, double d = p[l][q] - mu[l]; ss[l] += d * d);
    }
}

static int64_t bn_chunks(const struct norm_args *a, int64_t channels)
{
    return (a->c + channels - 1) / channels;
}

#ifdef HAVE_AVX512_INTRIN
/* One plane of the batchnorm's output from a plane of x, both fp32 or both bf16 (bf16): bn_forward_channel's
 * widening, its four fp32 operations in its order (no FMA), the fused ReLU's test (x <= 0 gives +0, a NaN passes)
 * and the rounding of store_f32 (nearest-even, a NaN quieted), in one pass and in registers, where they were up
 * to four passes over an fp32 plane (for bf16 the widening and rounding calls took 4x the arithmetic's time in
 * fashion_cnn's step). The same bits: each lane runs the scalar loop's operations; the last hw % 16 elements run
 * that loop itself. */
__attribute__((target("avx512f,avx512bw"), always_inline)) static inline void
bn_norm_plane_body(void *y, const void *x, bool bf16, int64_t hw, float mu, float rs, float g, float b, bool relu)
{
    const __m512 vmu = _mm512_set1_ps(mu), vrs = _mm512_set1_ps(rs), vg = _mm512_set1_ps(g), vb = _mm512_set1_ps(b);
    int64_t e = 0;
    for (; e + 16 <= hw; e += 16) {
        __m512 t = _mm512_sub_ps(ld16(x, e, bf16), vmu);
        t = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(t, vrs), vg), vb);
        if (relu)
            t = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(t, _mm512_setzero_ps(), _CMP_NLE_UQ), t);
        st16(y, e, t, bf16);
    }
    for (; e < hw; e++) {
        float t = (ld1(x, e, bf16) - mu) * rs * g + b;
        if (relu)
            t = t <= 0.0f ? 0.0f : t;
        st1(y, e, t, bf16);
    }
}

/* bn_norm_plane_body compiled once per dtype: no test of it in the loop. */
__attribute__((target("avx512f,avx512bw"))) static void bn_norm_plane(void *y, const void *x, bool bf16, int64_t hw,
                                                                      float mu, float rs, float g, float b, bool relu)
{
    if (bf16)
        bn_norm_plane_body(y, x, true, hw, mu, rs, g, b, relu);
    else
        bn_norm_plane_body(y, x, false, hw, mu, rs, g, b, relu);
}

/* Whether the fused planes run for these dtypes (all fp32 or all bf16) on this CPU. */
static bool bn_fused_runs(enum dtype a, enum dtype b, enum dtype c)
{
    return a == b && b == c && (a == DT_FP32 || a == DT_BF16) && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw");
}
#endif

/* Channel ch's outputs; in training, from its sums s and ss (bn_stats). */
HOT_LOOP static void bn_forward_channel(const struct bn_job *j, int64_t ch, double s, double ss, float *xbuf,
                                        float *ybuf)
{
    const struct norm_args *a = j->a;
    const struct tensor *x = j->x;
    struct tensor *y = j->out;
    int64_t n = a->n, c = a->c, hw = a->hw;
    float *rm = j->running_mean ? (float *)j->running_mean->data : NULL;
    float *rv = j->running_var ? (float *)j->running_var->data : NULL;
    double count = (double)(n * hw);
    float mu_f, rs_f;
    if (a->training) {
        double mu = s / count;
        double var = ss / count;
        mu_f = (float)mu;
        rs_f = (float)(1.0 / sqrt(var + (double)a->eps));
        /* PyTorch: running = (1 - m) * running + m * batch, with the unbiased variance. One value per
         * channel has no unbiased variance (PyTorch refuses it); the biased one (0) is used. */
        double m = a->momentum, unbiased = count > 1.0 ? ss / (count - 1.0) : var;
        if (rm)
            rm[ch] = (float)((1.0 - m) * rm[ch] + m * mu);
        if (rv)
            rv[ch] = (float)((1.0 - m) * rv[ch] + m * unbiased);
    } else {
        assert(rm && rv);
        mu_f = rm[ch];
        rs_f = (float)(1.0 / sqrt((double)rv[ch] + (double)a->eps));
    }
    if (j->mean)
        ((float *)j->mean->data)[ch] = mu_f;
    if (j->rstd)
        ((float *)j->rstd->data)[ch] = rs_f;
    float gc = j->gamma ? j->gamma[ch] : 1.0f, bc = j->beta ? j->beta[ch] : 0.0f;
#ifdef HAVE_AVX512_INTRIN
    if (bn_fused_runs(x->dtype, y->dtype, y->dtype)) {
        const bool bf16 = x->dtype == DT_BF16;
        for (int64_t i = 0; i < n; i++) {
            const size_t off = (size_t)((i * c + ch) * hw);
            bn_norm_plane(elem_ptr(y->data, y->dtype, off), elem_ptr(x->data, x->dtype, off), bf16, hw, mu_f, rs_f,
                          gc, bc, a->relu);
        }
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) {
        size_t off = (size_t)((i * c + ch) * hw);
        const float *p = load_f32(x->data, x->dtype, off, (size_t)hw, xbuf);
        float *q = out_f32(y->data, y->dtype, off, ybuf);
        for (int64_t e = 0; e < hw; e++)
            q[e] = (p[e] - mu_f) * rs_f * gc + bc;
        /* the fused ReLU in fp32 before the rounding: round(relu(v)) is relu(round(v)) bit for bit (rounding
         * keeps the sign and a NaN; relu_16 gives +0 for either zero and quiets a NaN, as rounding does) */
        if (a->relu)
            act_apply(ACT_RELU, q, q, (size_t)hw);
        store_f32(y->data, y->dtype, off, (size_t)hw, q);
    }
}

static void bn_forward_chunk(void *arg, int64_t chunk, int worker)
{
    const struct bn_job *j = arg;
    float *xbuf = wscratch(j->cb, worker, WSCR_IN0), *ybuf = wscratch(j->cb, worker, WSCR_TMP0);
    const int64_t c0 = chunk * j->channels, c1 = j->a->c - c0 < j->channels ? j->a->c : c0 + j->channels;
    for (int64_t ch0 = c0; ch0 < c1; ch0 += CHAINS) {
        const int64_t lanes = c1 - ch0 < CHAINS ? c1 - ch0 : CHAINS;
        double s[CHAINS] = { 0.0 }, ss[CHAINS] = { 0.0 };
        if (j->a->training)
            bn_stats(j, ch0, lanes, xbuf, s, ss);
        for (int64_t l = 0; l < lanes; l++)
            bn_forward_channel(j, ch0 + l, s[l], ss[l], xbuf, ybuf);
    }
}

static void cpu_batchnorm_forward(struct backend *be, const struct norm_args *a, struct tensor *y,
                                  struct tensor *mean, struct tensor *rstd, struct tensor *running_mean,
                                  struct tensor *running_var, const struct tensor *x, const struct tensor *gamma,
                                  const struct tensor *beta)
{
    struct cpu_backend *cb = cpu_of(be);
    const int64_t hw = a->hw;
    assert((int64_t)x->numel == a->n * a->c * hw && (int64_t)y->numel == a->n * a->c * hw);
    assert(!a->training || (mean && rstd));
    if (!wscratch_rows(cb) || !wstage_reserve(cb, WSCR_IN0, x, (size_t)(CHAINS * hw)) ||
        !wstage_reserve(cb, WSCR_TMP0, y, (size_t)hw))
        return;
    struct bn_job j = { .cb = cb, .a = a, .out = y, .x = x, .mean = mean, .rstd = rstd,
                        .running_mean = running_mean, .running_var = running_var,
                        .gamma = gamma ? (const float *)gamma->data : NULL,
                        .beta = beta ? (const float *)beta->data : NULL, .channels = bn_chunk_channels(a) };
    parallel_for(cb->pool, bn_chunks(a, j.channels), bn_forward_chunk, &j);
}

/* dy's planes of image i, channels ch0 .. ch0 + lanes - 1, as the backward reads them: dy's own (*off0 their first
 * element in dy), or with a fused ReLU (j->y) the ReLU's input gradient, staged in mbuf (lanes planes of dy's
 * dtype; *off0 0) by the ReLU backward's own loops, so with its bits. */
static const void *bn_dy_planes(const struct bn_job *j, int64_t i, int64_t ch0, int64_t lanes, void *mbuf,
                                size_t *off0)
{
    const struct tensor *dy = j->dy;
    const size_t off = (size_t)((i * j->a->c + ch0) * j->a->hw), count = (size_t)(lanes * j->a->hw);
    uint16_t inf, quiet;
    if (!j->y) {
        *off0 = off;
        return dy->data;
    }
    *off0 = 0;
    if (half_format(dy->dtype, &inf, &quiet))
        relu_grad_16(mbuf, (const uint16_t *)dy->data + off, (const uint16_t *)j->y->data + off, count, inf, quiet);
    else
        act_grad_apply(ACT_RELU, mbuf, (const float *)dy->data + off, (const float *)j->y->data + off, count);
    return mbuf;
}

/* The gradient sums of channels ch0 .. ch0 + lanes - 1 (lanes <= CHAINS) into acc_b and acc_g: each
 * channel's sum of dy and of dy * xhat over the images in order (xbuf, dybuf: lanes planes each, where
 * 16-bit; mbuf: bn_dy_planes'). */
HOT_LOOP static void bn_grad_sums(const struct bn_job *j, int64_t ch0, int64_t lanes, float *xbuf, float *dybuf,
                                  void *mbuf)
{
    const struct tensor *x = j->x, *dy = j->dy;
    const int64_t n = j->a->n, c = j->a->c, hw = j->a->hw;
    const float *xp[CHAINS], *dp[CHAINS];
    float mu[CHAINS], rs[CHAINS];
    double sdy[CHAINS], sdyx[CHAINS];
    for (int64_t l = 0; l < lanes; l++) {
        mu[l] = ((const float *)j->smean->data)[ch0 + l];
        rs[l] = ((const float *)j->srstd->data)[ch0 + l];
        sdy[l] = sdyx[l] = 0.0;
    }
    for (int64_t i = 0; i < n; i++) {
#ifdef HAVE_AVX512_INTRIN
        /* fp32 and bf16 planes are read in place, the ReLU's mask applied as they are read (no staging) */
        if (planes8_avx512(lanes) && x->dtype == dy->dtype && (dy->dtype == DT_FP32 || dy->dtype == DT_BF16)) {
            const void *xv[CHAINS], *dv[CHAINS], *yv[CHAINS];
            const size_t off = (size_t)((i * c + ch0) * hw);
            bool bf16 = bn_planes(x->data, x->dtype, off, hw, NULL, xv);
            bn_planes(dy->data, dy->dtype, off, hw, NULL, dv);
            if (j->y)
                bn_planes(j->y->data, j->y->dtype, off, hw, NULL, yv);
            planes_gradsum8_avx512(xv, dv, j->y ? yv : NULL, NULL, bf16, hw, mu, rs, sdy, sdyx);
            continue;
        }
#endif
        size_t doff;
        const void *dsrc = bn_dy_planes(j, i, ch0, lanes, mbuf, &doff);
#ifdef HAVE_AVX512_INTRIN
        if (planes8_avx512(lanes) && x->dtype == dy->dtype) {
            const void *xv[CHAINS], *dv[CHAINS];
            bool bf16 = bn_planes(x->data, x->dtype, (size_t)((i * c + ch0) * hw), hw, xbuf, xv);
            bn_planes(dsrc, dy->dtype, doff, hw, dybuf, dv);
            planes_gradsum8_avx512(xv, dv, NULL, NULL, bf16, hw, mu, rs, sdy, sdyx);
            continue;
        }
#endif
        for (int64_t l = 0; l < lanes; l++) {
            size_t off = (size_t)((i * c + ch0 + l) * hw);
            xp[l] = load_f32(x->data, x->dtype, off, (size_t)hw, xbuf ? xbuf + l * hw : NULL);
            dp[l] = load_f32(dsrc, dy->dtype, doff + (size_t)(l * hw), (size_t)hw, dybuf ? dybuf + l * hw : NULL);
        }
        FOR_CHAINS(lanes, hw, l, e, sdy[l] += dp[l][e]; sdyx[l] += (double)dp[l][e] * ((xp[l][e] - mu[l]) * rs[l]));
    }
    for (int64_t l = 0; l < lanes; l++) {
        j->acc_g[ch0 + l] = sdyx[l];
        j->acc_b[ch0 + l] = sdy[l];
    }
}

#ifdef HAVE_AVX512_INTRIN
/* One plane of batchnorm's dx from planes of dy, x and (a fused ReLU; else NULL) y, all fp32 or all bf16 (bf16):
 * bn_backward_channel's loop in one pass and in registers — dy masked as the ReLU's backward masks it (+0 where
 * y <= 0; a NaN dy is quieted by the first multiply, as the staged copy quieted it), widened, the formula's fp32
 * operations in its order (no FMA), rounded as store_f32 rounds — where it was up to five passes over staged planes
 * (bn_dy_planes' mask, two widenings, the formula, the rounding). The same bits; the last hw % 16 elements run the
 * same operations one by one. */
__attribute__((target("avx512f,avx512bw"), always_inline)) static inline void
bn_dx_plane_body(void *dx, const void *dy, const void *x, const void *y, bool bf16, int64_t hw, bool training, float mu,
                 float rs, float gc, float m1, float m2)
{
    const __m512 vmu = _mm512_set1_ps(mu), vrs = _mm512_set1_ps(rs), vg = _mm512_set1_ps(gc);
    const __m512 vm1 = _mm512_set1_ps(m1), vm2 = _mm512_set1_ps(m2);
    int64_t e = 0;
    for (; e + 16 <= hw; e += 16) {
        __m512 d = ld16(dy, e, bf16);
        if (y)
            d = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(ld16(y, e, bf16), _mm512_setzero_ps(), _CMP_NLE_UQ), d);
        __m512 q;
        if (training) {
            const __m512 xh = _mm512_mul_ps(_mm512_mul_ps(_mm512_sub_ps(ld16(x, e, bf16), vmu), vrs), vm2);
            q = _mm512_mul_ps(vrs, _mm512_sub_ps(_mm512_sub_ps(_mm512_mul_ps(d, vg), vm1), xh));
        } else {
            q = _mm512_mul_ps(_mm512_mul_ps(d, vg), vrs);
        }
        st16(dx, e, q, bf16);
    }
    for (; e < hw; e++) {
        float d = ld1(dy, e, bf16);
        if (y && ld1(y, e, bf16) <= 0.0f)
            d = 0.0f;
        const float q = training ? rs * (d * gc - m1 - (ld1(x, e, bf16) - mu) * rs * m2) : d * gc * rs;
        st1(dx, e, q, bf16);
    }
}

/* bn_dx_plane_body compiled once per dtype. */
__attribute__((target("avx512f,avx512bw"))) static void bn_dx_plane(void *dx, const void *dy, const void *x,
                                                                    const void *y, bool bf16, int64_t hw,
                                                                    bool training, float mu, float rs, float gc,
                                                                    float m1, float m2)
{
    if (bf16)
        bn_dx_plane_body(dx, dy, x, y, true, hw, training, mu, rs, gc, m1, m2);
    else
        bn_dx_plane_body(dx, dy, x, y, false, hw, training, mu, rs, gc, m1, m2);
}
#endif

/* Channel ch's dx from its sums (bn_grad_sums). */
HOT_LOOP static void bn_backward_channel(const struct bn_job *j, int64_t ch, float *xbuf, float *dybuf, float *dxbuf,
                                         void *mbuf)
{
    const struct norm_args *a = j->a;
    const struct tensor *x = j->x, *dy = j->dy;
    struct tensor *dx = j->out;
    int64_t n = a->n, c = a->c, hw = a->hw;
    double count = (double)(n * hw);
    float mu = ((const float *)j->smean->data)[ch], rs = ((const float *)j->srstd->data)[ch];
    float gc = j->gamma ? j->gamma[ch] : 1.0f;
    double sdyx = j->acc_g[ch], sdy = j->acc_b[ch];
    if (!dx)
        return;
    /* mean(dxhat) = gamma * sdy / count, mean(dxhat * xhat) = gamma * sdyx / count */
    float m1 = (float)(gc * sdy / count), m2 = (float)(gc * sdyx / count);
#ifdef HAVE_AVX512_INTRIN
    if (bn_fused_runs(dx->dtype, dy->dtype, x->dtype)) {
        const bool bf16 = x->dtype == DT_BF16;
        for (int64_t i = 0; i < n; i++) {
            const size_t off = (size_t)((i * c + ch) * hw);
            bn_dx_plane(elem_ptr(dx->data, dx->dtype, off), elem_ptr(dy->data, dy->dtype, off),
                        elem_ptr(x->data, x->dtype, off), j->y ? elem_ptr(j->y->data, j->y->dtype, off) : NULL, bf16,
                        hw, a->training, mu, rs, gc, m1, m2);
        }
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) {
        size_t off = (size_t)((i * c + ch) * hw), doff;
        const void *dsrc = bn_dy_planes(j, i, ch, 1, mbuf, &doff);
        const float *dp = load_f32(dsrc, dy->dtype, doff, (size_t)hw, dybuf);
        float *q = out_f32(dx->data, dx->dtype, off, dxbuf);
        if (a->training) {
            const float *xp = load_f32(x->data, x->dtype, off, (size_t)hw, xbuf);
            for (int64_t e = 0; e < hw; e++)
                q[e] = rs * (dp[e] * gc - m1 - (xp[e] - mu) * rs * m2);
        } else {
            for (int64_t e = 0; e < hw; e++)
                q[e] = dp[e] * gc * rs;
        }
        store_f32(dx->data, dx->dtype, off, (size_t)hw, q);
    }
}

static void bn_backward_chunk(void *arg, int64_t chunk, int worker)
{
    const struct bn_job *j = arg;
    float *xbuf = wscratch(j->cb, worker, WSCR_IN0), *dybuf = wscratch(j->cb, worker, WSCR_IN1);
    float *dxbuf = wscratch(j->cb, worker, WSCR_TMP0);
    void *mbuf = wscratch(j->cb, worker, WSCR_IN2);
    const int64_t c0 = chunk * j->channels, c1 = j->a->c - c0 < j->channels ? j->a->c : c0 + j->channels;
    for (int64_t ch0 = c0; ch0 < c1; ch0 += CHAINS) {
        const int64_t lanes = c1 - ch0 < CHAINS ? c1 - ch0 : CHAINS;
        bn_grad_sums(j, ch0, lanes, xbuf, dybuf, mbuf);
        for (int64_t l = 0; l < lanes; l++)
            bn_backward_channel(j, ch0 + l, xbuf, dybuf, dxbuf, mbuf);
    }
}

/* Training mode: the batch statistics depend on x, so dx = rstd * (dxhat - mean(dxhat) - xhat *
 * mean(dxhat * xhat)) over the channel. Eval mode (a->training false, mean/rstd from the running
 * statistics): they are constants, dx = dy * gamma * rstd. With a fused ReLU (a->relu) dy is masked by y
 * plane by plane as it is read (bn_dy_planes), never as a whole tensor. */
static void cpu_batchnorm_backward(struct backend *be, const struct norm_args *a, struct tensor *dx,
                                   struct tensor *dgamma, struct tensor *dbeta, const struct tensor *dy,
                                   const struct tensor *x, const struct tensor *y, const struct tensor *mean,
                                   const struct tensor *rstd, const struct tensor *gamma, float beta_acc)
{
    struct cpu_backend *cb = cpu_of(be);
    const int64_t c = a->c, hw = a->hw;
    assert((int64_t)x->numel == a->n * c * hw && (int64_t)dy->numel == a->n * c * hw);
    assert(!a->relu || (y && y->dtype == dy->dtype && y->numel == dy->numel &&
                        (dy->dtype == DT_FP32 || dy->dtype == DT_BF16 || dy->dtype == DT_FP16)));
    double *acc = scratch_get(cb, SCR_ACC0, 2 * (size_t)c * sizeof(double));
    if (!acc || !wscratch_rows(cb) || !wstage_reserve(cb, WSCR_IN0, x, (size_t)(CHAINS * hw)) ||
        !wstage_reserve(cb, WSCR_IN1, dy, (size_t)(CHAINS * hw)) || !wstage_reserve(cb, WSCR_TMP0, dx, (size_t)hw) ||
        (a->relu && !wscratch_reserve(cb, WSCR_IN2, (size_t)(CHAINS * hw) * sizeof(float))))
        return;
    struct bn_job j = { .cb = cb, .a = a, .out = dx, .x = x, .dy = dy, .y = a->relu ? y : NULL, .smean = mean,
                        .srstd = rstd,
                        .gamma = gamma ? (const float *)gamma->data : NULL, .acc_g = acc, .acc_b = acc + c,
                        .channels = bn_chunk_channels(a) };
    parallel_for(cb->pool, bn_chunks(a, j.channels), bn_backward_chunk, &j);
    if (dgamma)
        store_acc((float *)dgamma->data, j.acc_g, (size_t)c, beta_acc);
    if (dbeta)
        store_acc((float *)dbeta->data, j.acc_b, (size_t)c, beta_acc);
}

/* ---- embedding ------------------------------------------------------------------------------- */

/* The forward pass is threaded by rows of y (rows_per_chunk positions a chunk). The backward pass
 * scatter-adds dy's rows into the tables by token and by position, so it is threaded by ranges of table
 * rows (EMB_TABLE_ELEMS elements a chunk, wte's ranges first, then wpe's): a chunk zeroes its rows, adds
 * into them every matching dy row in the order (b, t) of one thread, and finishes them. The tokens are
 * first bucketed by chunk, stably, so a chunk visits only its own. */
#define EMB_TABLE_ELEMS 4096

struct emb_job {
    struct cpu_backend *cb;
    struct tensor *y;                       /* forward: (B*T, C) */
    const struct tensor *wte, *wpe, *dy;    /* (vocab, C), (>= T, C); backward: dy (B*T, C) */
    const int32_t *tokens;                  /* (B*T) */
    int64_t B, T, C, vocab, rows_per;       /* rows_per: forward positions or backward table rows a chunk */
    int64_t pe_rows;                        /* backward: wpe's rows (max_len >= T) */
    float *acc_te, *acc_pe, *dte, *dpe;     /* backward: the sums (dte, dpe themselves when beta is 0) */
    float beta;
    int64_t te_chunks;                      /* wte's chunks; wpe's follow */
    const int32_t *order, *first;           /* the positions b*T+t of each wte chunk's tokens, in order */
};

static void emb_forward_chunk(void *arg, int64_t chunk, int worker)
{
    const struct emb_job *j = arg;
    int64_t C = j->C, i0 = chunk * j->rows_per, n = j->B * j->T;
    int64_t i1 = i0 + j->rows_per < n ? i0 + j->rows_per : n;
    float *eb = wscratch(j->cb, worker, WSCR_TMP0), *pb = wscratch(j->cb, worker, WSCR_TMP1);
    float *yb = wscratch(j->cb, worker, WSCR_TMP2);
    for (int64_t i = i0; i < i1; i++) {
        int64_t t = i % j->T;
        int32_t tok = j->tokens[i];
        assert(tok >= 0 && tok < j->vocab);
        if (tok < 0 || tok >= j->vocab)
            tok = 0; /* release builds: never read outside wte (the data module validates tokens) */
        const float *e = load_f32(j->wte->data, j->wte->dtype, (size_t)(tok * C), (size_t)C, eb);
        const float *p = load_f32(j->wpe->data, j->wpe->dtype, (size_t)(t * C), (size_t)C, pb);
        size_t off = (size_t)(i * C);
        float *yr = out_f32(j->y->data, j->y->dtype, off, yb);
        for (int64_t k = 0; k < C; k++)
            yr[k] = e[k] + p[k];
        store_f32(j->y->data, j->y->dtype, off, (size_t)C, yr);
    }
}

static void cpu_embedding_forward(struct backend *be, struct tensor *y, const int32_t *tokens,
                                  const struct tensor *wte, const struct tensor *wpe, int64_t B, int64_t T,
                                  int64_t C)
{
    struct cpu_backend *cb = cpu_of(be);
    assert((int64_t)y->numel == B * T * C && (int64_t)wpe->numel >= T * C);
    size_t row_bytes = (size_t)C * sizeof(float);
    if (!wscratch_reserve(cb, WSCR_TMP0, row_bytes) || !wscratch_reserve(cb, WSCR_TMP1, row_bytes) ||
        !wscratch_reserve(cb, WSCR_TMP2, row_bytes))
        return;
    struct emb_job j = { .cb = cb, .y = y, .wte = wte, .wpe = wpe, .tokens = tokens, .B = B, .T = T, .C = C,
                         .vocab = (int64_t)wte->numel / C, .rows_per = rows_per_chunk(C) };
    parallel_for(cb->pool, div_up(B * T, j.rows_per), emb_forward_chunk, &j);
}

/* Adds dy row i into table row r of acc (C values). */
static void emb_add_row(const struct emb_job *j, float *acc, int64_t r, int64_t i, float *dybuf)
{
    const float *g = load_f32(j->dy->data, j->dy->dtype, (size_t)(i * j->C), (size_t)j->C, dybuf);
    float *e = acc + r * j->C;
    for (int64_t k = 0; k < j->C; k++)
        e[k] += g[k];
}

static void emb_backward_chunk(void *arg, int64_t chunk, int worker)
{
    const struct emb_job *j = arg;
    float *dybuf = wscratch(j->cb, worker, WSCR_IN0);
    bool te = chunk < j->te_chunks;
    int64_t r0 = (te ? chunk : chunk - j->te_chunks) * j->rows_per, rows = te ? j->vocab : j->pe_rows;
    int64_t r1 = r0 + j->rows_per < rows ? r0 + j->rows_per : rows;
    float *acc = te ? j->acc_te : j->acc_pe, *d = te ? j->dte : j->dpe;
    size_t lo = (size_t)(r0 * j->C), hi = (size_t)(r1 * j->C);
    scale_f32(acc + lo, hi - lo, 0.0f);
    if (te) {
        for (int32_t q = j->first[chunk]; q < j->first[chunk + 1]; q++)
            emb_add_row(j, acc, j->tokens[j->order[q]], j->order[q], dybuf);
    } else {
        for (int64_t b = 0; b < j->B; b++)
            for (int64_t t = r0; t < r1 && t < j->T; t++)
                emb_add_row(j, acc, t, b * j->T + t, dybuf);
    }
    if (j->beta != 0.0f)
        for (size_t i = lo; i < hi; i++)
            d[i] = j->beta * d[i] + acc[i];
}

static void cpu_embedding_backward(struct backend *be, struct tensor *dwte, struct tensor *dwpe,
                                   const struct tensor *dy, const int32_t *tokens, int64_t B, int64_t T, int64_t C,
                                   float beta)
{
    struct cpu_backend *cb = cpu_of(be);
    int64_t vocab = (int64_t)dwte->numel / C, n = B * T;
    assert(dwte->dtype == DT_FP32 && dwpe->dtype == DT_FP32 && (int64_t)dy->numel == B * T * C);
    assert((int64_t)dwpe->numel >= T * C && n < INT32_MAX);
    assert(dwte->numel % (size_t)C == 0 && dwpe->numel % (size_t)C == 0);
    int64_t per = EMB_TABLE_ELEMS / C > 0 ? EMB_TABLE_ELEMS / C : 1;
    int64_t pe_rows = (int64_t)dwpe->numel / C, te_chunks = div_up(vocab, per), pe_chunks = div_up(pe_rows, per);
    if (!wstage_reserve(cb, WSCR_IN0, dy, (size_t)C)) /* one row at a time */
        return;
    /* This pass's gradient is summed from zero, then added to beta * d: accumulating micro-batches is
     * "grad += new" (PyTorch's order), so one rank summing two micro-batches gives the bits of two ranks'
     * all-reduce. With beta != 0 the sums go to scratch first. */
    float *dte = (float *)dwte->data, *dpe = (float *)dwpe->data;
    float *acc_te = dte, *acc_pe = dpe;
    if (beta != 0.0f) {
        acc_te = scratch_get(cb, SCR_TMP0, dwte->numel * sizeof(float));
        acc_pe = scratch_get(cb, SCR_TMP1, dwpe->numel * sizeof(float));
        if (!acc_te || !acc_pe)
            return;
    }
    /* The bucket of each wte chunk: the positions of its tokens, in order (a stable counting sort). */
    int32_t *first = scratch_get(cb, SCR_ACC0, (size_t)(te_chunks + 1 + n) * sizeof(int32_t)), *order;
    if (!first)
        return;
    order = first + te_chunks + 1;
    memset(first, 0, (size_t)(te_chunks + 1) * sizeof(int32_t));
    for (int64_t i = 0; i < n; i++) {
        assert(tokens[i] >= 0 && tokens[i] < vocab);
        if (tokens[i] >= 0 && tokens[i] < vocab) /* release builds skip a bad token */
            first[tokens[i] / per + 1]++;
    }
    for (int64_t c = 0; c < te_chunks; c++)
        first[c + 1] += first[c];
    for (int64_t i = 0; i < n; i++)
        if (tokens[i] >= 0 && tokens[i] < vocab)
            order[first[tokens[i] / per]++] = (int32_t)i;
    for (int64_t c = te_chunks; c > 0; c--) /* back from each bucket's end to its start */
        first[c] = first[c - 1];
    first[0] = 0;
    struct emb_job j = { .cb = cb, .dy = dy, .tokens = tokens, .B = B, .T = T, .C = C, .vocab = vocab,
                         .rows_per = per, .pe_rows = pe_rows, .acc_te = acc_te, .acc_pe = acc_pe, .dte = dte, .dpe = dpe, .beta = beta,
                         .te_chunks = te_chunks, .order = order, .first = first };
    parallel_for((n + vocab + T) * C > (int64_t)EW_CHUNK ? cb->pool : NULL, te_chunks + pe_chunks, emb_backward_chunk,
                 &j);
}

/* ---- attention ------------------------------------------------------------------------------- */

/* Rows of the (T, T) scores become causal softmax probabilities in place: fp32, max-subtracted, the
 * sum in double; entries j > t become 0. */
static void softmax_causal(float *s, int64_t T)
{
    for (int64_t t = 0; t < T; t++) {
        float *row = s + t * T;
        float mx = row[0];
        for (int64_t j = 1; j <= t; j++)
            mx = row[j] > mx ? row[j] : mx;
        double sum = 0.0;
        for (int64_t j = 0; j <= t; j++) {
            row[j] = expf(row[j] - mx);
            sum += row[j];
        }
        float inv = (float)(1.0 / sum);
        for (int64_t j = 0; j <= t; j++)
            row[j] *= inv;
        for (int64_t j = t + 1; j < T; j++)
            row[j] = 0.0f;
    }
}

/* Attention is threaded by (batch, head): each pair reads its own column blocks of qkv (and dout, probs)
 * and writes its own of out, probs (and dqkv). The pairs run on the pool when there are several and the
 * products are worth it (ATT_PAR_MACS multiply-adds in all); each then forms its products on its own
 * thread with its own scratch (att_gemm_worker), which gives the bits gemm_core gives: the same routine
 * (gemm_avx512, or sgemm for a 16-bit result), whose bits do not depend on the thread running it or on
 * banding (gemm_avx512.h). Otherwise the pairs run in order on the calling thread through gemm_core, as
 * they always did (a long sequence's products may then band across the pool themselves). */
#define ATT_PAR_MACS ((int64_t)1 << 20)

struct att_job {
    struct cpu_backend *cb;
    const struct tensor *qkv;               /* (B, T, 3C) */
    struct tensor *out, *probs_out;         /* forward: (B, T, C), (B, H, T, T) */
    struct tensor *dqkv;                    /* backward: (B, T, 3C) */
    const struct tensor *dout, *probs;      /* backward: (B, T, C), (B, H, T, T) */
    int64_t T, C, H, D;
    float scale;                            /* 1 / sqrt(D) */
    bool par;                               /* on the pool: att_gemm_worker; else gemm_core */
    bool bf16;                              /* the products read the bf16 tensors in place (att_bf16) */
};

/* The (rows, D) column block `col` of row-major t (row stride ld) from element off, as a product's input. */
static struct mat_in att_block(const struct tensor *t, size_t off, int64_t ld, int64_t col)
{
    return (struct mat_in){ elem_ptr(t->data, t->dtype, off + (size_t)col), t->dtype, ld };
}

/* Rows [0, rows) of the column block [col, col + width) of the row-major (rows, ld) matrix at element
 * `off` of t, as fp32 at the same place of a same-shaped matrix: t's data itself when fp32, else buf
 * (rows * ld floats), into which only that block is converted. */
static const float *att_load_block(const struct tensor *t, size_t off, int64_t rows, int64_t ld, int64_t col,
                                   int64_t width, float *buf)
{
    if (t->dtype == DT_FP32)
        return (const float *)t->data + off;
    for (int64_t r = 0; r < rows; r++)
        dtype_convert(buf + r * ld + col, DT_FP32, elem_ptr(t->data, t->dtype, off + (size_t)(r * ld + col)),
                      t->dtype, (size_t)width);
    return buf;
}

/* gemm_core's path for A and B of one dtype (fp32, or bf16 on the bf16 path), beta 0 and no bias, on this
 * worker's scratch (reserved by att_reserve_gemm): gemm_avx512 where gemm_core takes it (C fp32 or of the
 * inputs' dtype), else (fp32 inputs) sgemm into C or, for a 16-bit C, into fp32 scratch rounded once. */
static void att_gemm_worker(struct cpu_backend *cb, int worker, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                            float alpha, struct mat_in a, struct mat_in b, struct mat_out c)
{
    if (a.dt == b.dt && cb->gemm_avx512[a.dt] && (c.dt == DT_FP32 || c.dt == a.dt)) {
        worker_gemm(cb, worker, a.dt, ta, tb, m, n, k, alpha, a.p, a.ld, b.p, b.ld, 0.0f, c);
        return;
    }
    assert(a.dt == DT_FP32 && b.dt == DT_FP32);
    float *cf = c.dt == DT_FP32 ? (float *)c.p : wscratch(cb, worker, WSCR_GEMM_C);
    int64_t ldc = c.dt == DT_FP32 ? c.ld : n;
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, blas_dim(m),
                blas_dim(n), blas_dim(k), alpha, a.p, blas_dim(a.ld), b.p, blas_dim(b.ld), 0.0f, cf, blas_dim(ldc));
    if (c.dt != DT_FP32)
        for (int64_t r = 0; r < m; r++)
            dtype_convert(elem_ptr(c.p, c.dt, (size_t)(r * c.ld)), c.dt, cf + r * n, DT_FP32, (size_t)n);
}

/* C = alpha op(A) op(B) for one (batch, head): A and B fp32, or bf16 on the bf16 path; beta 0. */
static void att_gemm(const struct att_job *j, int worker, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                     float alpha, struct mat_in a, struct mat_in b, struct mat_out c)
{
    if (j->par)
        att_gemm_worker(j->cb, worker, ta, tb, m, n, k, alpha, a, b, c);
    else
        gemm_core(j->cb, ta, tb, m, n, k, alpha, a, b, 0.0f, c, NULL);
}

/* The per-worker scratch of attention on the pool, products of inputs `in`: the packed panels (the larger of
 * the two shapes (T, T, D) and (T, D, T)) and a 16-bit result's fp32 copy or partial sums (T, D). */
static bool att_reserve_gemm(struct cpu_backend *cb, enum dtype in, int64_t T, int64_t D, enum dtype c_dt)
{
    struct gemm_avx512_scratch s1 = { 0 }, s2 = { 0 };
    if (cb->gemm_avx512[in]) {
        gemm_avx512_scratch_sizes(in, gemm_uses_amx(cb, in), T, T, D, &s1);
        gemm_avx512_scratch_sizes(in, gemm_uses_amx(cb, in), T, D, T, &s2);
    }
    size_t pa = s1.pack_a_bytes > s2.pack_a_bytes ? s1.pack_a_bytes : s2.pack_a_bytes;
    size_t pb = s1.pack_b_bytes > s2.pack_b_bytes ? s1.pack_b_bytes : s2.pack_b_bytes;
    size_t pc = (size_t)(T * D) * sizeof(float);
    pc = s2.partial_bytes > pc ? s2.partial_bytes : pc;
    return (!pa || wscratch_reserve(cb, WSCR_PACK_A, pa)) && (!pb || wscratch_reserve(cb, WSCR_GEMM_B, pb)) &&
           (c_dt == DT_FP32 || wscratch_reserve(cb, WSCR_GEMM_C, pc));
}

/* Whether a call's products take its bf16 tensors as they are (every tensor given bf16, gemm_avx512 taking
 * bf16): the bf16 path, whose sums are gemm_avx512's bf16 product (AMX where present); else fp32 inputs. */
static bool att_bf16(const struct cpu_backend *cb, const struct tensor *const *t, int n)
{
    bool all = cb->gemm_avx512[DT_BF16];
    for (int i = 0; i < n; i++)
        all = all && t[i]->dtype == DT_BF16;
    return all;
}

/* Whether B*H pairs of this size run on the pool. */
static bool att_par(const struct cpu_backend *cb, int64_t B, int64_t T, int64_t D, int64_t H)
{
    return cb->pool && B * H > 1 && B * H * T * T * D >= ATT_PAR_MACS;
}

/* Head h's Q, K and V blocks of the sequence at element seq of qkv (row stride 3C) as products' inputs: in
 * place on the bf16 path, else widened into qbuf (one sequence). */
static void att_qkv(const struct att_job *j, size_t seq, int64_t h, float *qbuf, struct mat_in *q, struct mat_in *k,
                    struct mat_in *v)
{
    const int64_t T = j->T, C = j->C, D = j->D;
    if (j->bf16) {
        *q = att_block(j->qkv, seq, 3 * C, h * D);
        *k = att_block(j->qkv, seq, 3 * C, C + h * D);
        *v = att_block(j->qkv, seq, 3 * C, 2 * C + h * D);
        return;
    }
    att_load_block(j->qkv, seq, T, 3 * C, h * D, D, qbuf);
    att_load_block(j->qkv, seq, T, 3 * C, C + h * D, D, qbuf);
    const float *qb = att_load_block(j->qkv, seq, T, 3 * C, 2 * C + h * D, D, qbuf) + h * D;
    *q = mat_f32(qb, 3 * C);
    *k = mat_f32(qb + C, 3 * C);
    *v = mat_f32(qb + 2 * C, 3 * C);
}

/* Per (batch b, head h), with Q, K, V the (T, D) column blocks h*D, C + h*D, 2C + h*D of qkv[b]
 * (row stride 3C) and d = qkv's dtype:
 *   S = round_d(Q K^T / sqrt(D))           GEMM, fp32 accumulation
 *   P = round_probs(causal_softmax(S))      fp32, stored in `probs`
 *   out[b, :, hD:(h+1)D] = round_out(P V)   GEMM */
static void att_forward_chunk(void *arg, int64_t chunk, int worker)
{
    const struct att_job *j = arg;
    int64_t T = j->T, C = j->C, D = j->D, b = chunk / j->H, h = chunk % j->H;
    const struct tensor *qkv = j->qkv;
    float *qbuf = wscratch(j->cb, worker, WSCR_IN0), *s = wscratch(j->cb, worker, WSCR_TMP0);
    size_t seq = (size_t)(b * T * 3 * C);
    struct mat_in q, k, v;
    att_qkv(j, seq, h, qbuf, &q, &k, &v);
    att_gemm(j, worker, false, true, T, T, D, j->scale, q, k, out_mat_f32(s, T));
    round_f32_to(s, (size_t)(T * T), qkv->dtype);
    softmax_causal(s, T);
    round_f32_to(s, (size_t)(T * T), j->probs_out->dtype);
    void *probs = elem_ptr(j->probs_out->data, j->probs_out->dtype, (size_t)(chunk * T * T));
    dtype_convert(probs, j->probs_out->dtype, s, DT_FP32, (size_t)(T * T));
    struct mat_out o = { .p = elem_ptr(j->out->data, j->out->dtype, (size_t)(b * T * C + h * D)), .dt = j->out->dtype,
                         .ld = C };
    /* P: the stored probabilities themselves on the bf16 path (s holds their values) */
    struct mat_in p = j->bf16 ? (struct mat_in){ probs, DT_BF16, T } : mat_f32(s, T);
    att_gemm(j, worker, false, false, T, D, T, 1.0f, p, v, o);
}

static void cpu_attention_forward(struct backend *be, struct tensor *out, struct tensor *probs,
                                  const struct tensor *qkv, int64_t B, int64_t T, int64_t C, int64_t H)
{
    struct cpu_backend *cb = cpu_of(be);
    assert(H >= 1 && C % H == 0);
    assert((int64_t)qkv->numel == B * T * 3 * C && (int64_t)out->numel == B * T * C);
    assert((int64_t)probs->numel == B * H * T * T);
    int64_t D = C / H;
    const struct tensor *io[] = { qkv, probs, out };
    struct att_job j = { .cb = cb, .qkv = qkv, .out = out, .probs_out = probs, .T = T, .C = C, .H = H, .D = D,
                         .scale = 1.0f / sqrtf((float)D), .par = att_par(cb, B, T, D, H), .bf16 = att_bf16(cb, io, 3) };
    /* one sequence's qkv (only the pair's blocks are filled; none on the bf16 path), one (T, T) score matrix */
    if (!wstage_reserve(cb, WSCR_IN0, j.bf16 ? NULL : qkv, (size_t)(T * 3 * C)) ||
        !wscratch_reserve(cb, WSCR_TMP0, (size_t)(T * T) * sizeof(float)) ||
        (j.par && !att_reserve_gemm(cb, j.bf16 ? DT_BF16 : DT_FP32, T, D, out->dtype)))
        return;
    parallel_for(j.par ? cb->pool : NULL, B * H, att_forward_chunk, &j);
}

/* The chain rule through cpu_attention_forward, per (b, h), with d = qkv's dtype. The 16-bit roundings
 * are the ones a GPU implementation stores (llm.c's datt and dpreatt buffers):
 *   dP = round_d(dO V^T)                               GEMM
 *   dS = round_d(P * (dP - rowsum(P * dP)))             fp32 softmax backward (0 where masked)
 *   dV = P^T dO,  dQ = dS K / sqrt(D),  dK = dS^T Q / sqrt(D)   GEMMs rounded to dqkv's dtype */
HOT_LOOP static void att_backward_chunk(void *arg, int64_t chunk, int worker)
{
    const struct att_job *j = arg;
    int64_t T = j->T, C = j->C, D = j->D, b = chunk / j->H, h = chunk % j->H;
    const struct tensor *qkv = j->qkv;
    enum dtype d = qkv->dtype;
    struct cpu_backend *cb = j->cb;
    float *qbuf = wscratch(cb, worker, WSCR_IN0), *dobuf = wscratch(cb, worker, WSCR_IN1);
    float *pbuf = wscratch(cb, worker, WSCR_IN2), *ds = wscratch(cb, worker, WSCR_TMP0);
    size_t seq = (size_t)(b * T * 3 * C);
    struct mat_in q, k, v, dob, p;
    const float *pb = load_f32(j->probs->data, j->probs->dtype, (size_t)(chunk * T * T), (size_t)(T * T), pbuf);
    att_qkv(j, seq, h, qbuf, &q, &k, &v);
    if (j->bf16) {
        dob = att_block(j->dout, (size_t)(b * T * C), C, h * D);
        p = att_block(j->probs, (size_t)(chunk * T * T), T, 0);
    } else {
        dob = mat_f32(att_load_block(j->dout, (size_t)(b * T * C), T, C, h * D, D, dobuf) + h * D, C);
        p = mat_f32(pb, T);
    }
    att_gemm(j, worker, false, true, T, T, D, 1.0f, dob, v, out_mat_f32(ds, T));
    round_f32_to(ds, (size_t)(T * T), d);
    for (int64_t t = 0; t < T; t++) {
        const float *pr = pb + t * T;
        float *row = ds + t * T;
        double dot = 0.0;
        for (int64_t k = 0; k <= t; k++)
            dot += (double)pr[k] * row[k];
        float dot_f = (float)dot;
        for (int64_t k = 0; k <= t; k++)
            row[k] = pr[k] * (row[k] - dot_f);
        for (int64_t k = t + 1; k < T; k++)
            row[k] = 0.0f;
    }
    round_f32_to(ds, (size_t)(T * T), d);
    struct mat_in dsm = mat_f32(ds, T);
    if (j->bf16) { /* dS's bf16 bits (its values are bf16 already) in the qkv staging slot, unused here */
        dtype_convert(qbuf, DT_BF16, ds, DT_FP32, (size_t)(T * T));
        dsm = (struct mat_in){ qbuf, DT_BF16, T };
    }
    struct tensor *dqkv = j->dqkv;
    size_t base = seq + (size_t)(h * D);
    struct mat_out dq = { .p = elem_ptr(dqkv->data, dqkv->dtype, base), .dt = dqkv->dtype, .ld = 3 * C };
    struct mat_out dk = { .p = elem_ptr(dqkv->data, dqkv->dtype, base + (size_t)C), .dt = dqkv->dtype, .ld = 3 * C };
    struct mat_out dv = { .p = elem_ptr(dqkv->data, dqkv->dtype, base + 2 * (size_t)C), .dt = dqkv->dtype,
                          .ld = 3 * C };
    att_gemm(j, worker, true, false, T, D, T, 1.0f, p, dob, dv);
    att_gemm(j, worker, false, false, T, D, T, j->scale, dsm, k, dq);
    att_gemm(j, worker, true, false, T, D, T, j->scale, dsm, q, dk);
}

static void cpu_attention_backward(struct backend *be, struct tensor *dqkv, const struct tensor *dout,
                                   const struct tensor *qkv, const struct tensor *probs, int64_t B, int64_t T,
                                   int64_t C, int64_t H)
{
    struct cpu_backend *cb = cpu_of(be);
    assert(H >= 1 && C % H == 0);
    assert((int64_t)qkv->numel == B * T * 3 * C && (int64_t)dqkv->numel == B * T * 3 * C);
    assert((int64_t)dout->numel == B * T * C && (int64_t)probs->numel == B * H * T * T);
    int64_t D = C / H;
    const struct tensor *io[] = { qkv, dout, probs, dqkv };
    struct att_job j = { .cb = cb, .qkv = qkv, .dqkv = dqkv, .dout = dout, .probs = probs, .T = T, .C = C, .H = H,
                         .D = D, .scale = 1.0f / sqrtf((float)D), .par = att_par(cb, B, T, D, H),
                         .bf16 = att_bf16(cb, io, 4) };
    /* staged per sequence (qkv, dout: the pair's blocks) and per pair (probs); on the bf16 path nothing of qkv
     * and dout, and IN0 holds dS's bf16 bits */
    if (!(j.bf16 ? wscratch_reserve(cb, WSCR_IN0, (size_t)(T * T) * sizeof(uint16_t))
                 : wstage_reserve(cb, WSCR_IN0, qkv, (size_t)(T * 3 * C))) ||
        !wstage_reserve(cb, WSCR_IN1, j.bf16 ? NULL : dout, (size_t)(T * C)) ||
        !wstage_reserve(cb, WSCR_IN2, probs, (size_t)(T * T)) ||
        !wscratch_reserve(cb, WSCR_TMP0, (size_t)(T * T) * sizeof(float)) ||
        (j.par && !att_reserve_gemm(cb, j.bf16 ? DT_BF16 : DT_FP32, T, D, dqkv->dtype)))
        return;
    parallel_for(j.par ? cb->pool : NULL, B * H, att_backward_chunk, &j);
}

/* ---- attention over a key/value cache (sampling) ---------------------------------------------------
 * The reference of backend.h's attention_decode, as plain loops: the new rows' K and V go into the cache,
 * then each (row, head) makes three passes over the cached positions 0..pos+i (the scores' max, the sum of
 * their exponentials, the weighted values), recomputing a score q.k in each rather than keeping a row of
 * them: the CUDA kernel does the same, one thread block per (row, head). Decoding runs one position at a
 * time, so this is at most a few thousand dot products per layer. */

static float elem_f32(const void *base, enum dtype dt, size_t i)
{
    float v;
    dtype_convert(&v, DT_FP32, elem_ptr(base, dt, i), dt, 1);
    return v;
}

/* score j of query q (D fp32) against cached key j of head h: the dot product in fp32, times scale, rounded to
 * d as attention_forward stores its scores */
static float decode_score(const float *q, const struct tensor *cache, int64_t h, int64_t j, int64_t max_T, int64_t D,
                          float scale, enum dtype d)
{
    size_t k0 = (size_t)((h * max_T + j) * D);
    float dot = 0.0f;
    for (int64_t e = 0; e < D; e++)
        dot = fmaf(q[e], elem_f32(cache->data, cache->dtype, k0 + (size_t)e), dot);
    return dtype_round(scale * dot, d);
}

static void cpu_attention_decode(struct backend *be, struct tensor *out, struct tensor *cache, const struct tensor *qkv,
                                 int64_t pos, int64_t n, int64_t C, int64_t H)
{
    struct cpu_backend *cb = cpu_of(be);
    assert(H >= 1 && C % H == 0 && pos >= 0 && n >= 1);
    int64_t D = C / H, max_T = cache->shape[2];
    assert(cache->ndim == 4 && cache->shape[0] == 2 && cache->shape[1] == H && cache->shape[3] == D);
    assert(pos + n <= max_T && (int64_t)qkv->numel == n * 3 * C && (int64_t)out->numel == n * C);
    enum dtype d = qkv->dtype;
    size_t values = (size_t)(H * max_T * D); /* cache[1] starts here */
    for (int64_t i = 0; i < n; i++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t e = 0; e < D; e++) {
                size_t at = (size_t)((h * max_T + pos + i) * D + e);
                float k = elem_f32(qkv->data, d, (size_t)(i * 3 * C + C + h * D + e));
                float v = elem_f32(qkv->data, d, (size_t)(i * 3 * C + 2 * C + h * D + e));
                dtype_convert(elem_ptr(cache->data, cache->dtype, at), cache->dtype, &k, DT_FP32, 1);
                dtype_convert(elem_ptr(cache->data, cache->dtype, values + at), cache->dtype, &v, DT_FP32, 1);
            }
    float *q = scratch_get(cb, SCR_TMP0, (size_t)D * 2 * sizeof(float)); /* query, then the weighted sum */
    if (!q)
        return;
    float *acc = q + D;
    float scale = 1.0f / sqrtf((float)D);
    const void *vals = elem_ptr(cache->data, cache->dtype, values);
    for (int64_t i = 0; i < n; i++) {
        int64_t last = pos + i;
        for (int64_t h = 0; h < H; h++) {
            for (int64_t e = 0; e < D; e++)
                q[e] = elem_f32(qkv->data, d, (size_t)(i * 3 * C + h * D + e));
            float mx = -INFINITY;
            for (int64_t j = 0; j <= last; j++) {
                float s = decode_score(q, cache, h, j, max_T, D, scale, d);
                mx = s > mx ? s : mx;
            }
            double sum = 0.0;
            for (int64_t j = 0; j <= last; j++)
                sum += expf(decode_score(q, cache, h, j, max_T, D, scale, d) - mx);
            float inv = (float)(1.0 / sum);
            for (int64_t e = 0; e < D; e++)
                acc[e] = 0.0f;
            for (int64_t j = 0; j <= last; j++) {
                float p = dtype_round(expf(decode_score(q, cache, h, j, max_T, D, scale, d) - mx) * inv, d);
                for (int64_t e = 0; e < D; e++)
                    acc[e] = fmaf(p, elem_f32(vals, cache->dtype, (size_t)((h * max_T + j) * D + e)), acc[e]);
            }
            dtype_convert(elem_ptr(out->data, out->dtype, (size_t)(i * C + h * D)), out->dtype, acc, DT_FP32,
                          (size_t)D);
        }
    }
}

/* ---- losses ---------------------------------------------------------------------------------- */

/* Both losses are threaded by rows (rows_per_chunk samples a chunk): a sample's loss, prediction and
 * gradient row depend on its own row alone. */
struct loss_job {
    struct cpu_backend *cb;
    float *losses;                          /* (N) fp32, or NULL */
    int32_t *correct;                       /* xent: (N), or NULL */
    struct tensor *grad;                    /* (N, K) dlogits or dy, or NULL */
    const struct tensor *x, *target;        /* (N, K) logits or y; mse: target */
    const int32_t *labels;                  /* xent: (N) */
    int64_t N, K, rows_per;
    float g;                                /* the gradient's factor */
};

/*
 * Cross-entropy's bits are those of its scalar formula (xent_row_formula): libm's double exp over the row,
 * log of the sum, then each probability as fp32 of exp(x - lse). xent_row_fast gets the same bits in a
 * fraction of the time, or says it cannot: it sums vectorised exp_f64 (vecmath.h, within EXP_F64_ERR units)
 * instead of libm's, so its lse is a little off the formula's, by at most
 *   d_lse = 2u (2K + 80 + 4|L| + 3|lse|),   u = 2^-53, L = log(sum),
 * twice what these add up to, with libm's exp and log taken within 1 ulp (2u; glibc's are within 0.52):
 * each sum within (K + 2)u resp. (K + EXP_F64_ERR)u of the exact one (positive terms, any order), so the
 * logs within about (2K + 66)u of each other, log's rounding 2u|L| in each, lse's own u|lse| in each.
 * Then the loss (lse - x[label]) is within 2 d_lse + 4u|loss|. Each probability is taken as the sum's own term
 * times exp(-L) (libm), e^(x - m) e^-L, against the formula's e^fl(x - fl(m + L)): the exponents differ by the
 * logs' difference and the roundings of x - m, m + L and x - lse (at most d_lse / 2 + u (|x - m| + |x - lse|)), the
 * factors by exp_f64's 64u, libm's 2u twice and the product's u, so it is within a relative
 * 2 (d_lse + 2u (|x - m| + |x - lse|)) + 140u (the ends' roundings in the margin): wherever that whole
 * interval rounds to one fp32 (f32_of_interval) it is the formula's fp32. Where one does not (about one
 * value in 10^6 at K = 256, one in 10^3 at K = 50257; losses near 0, whose fp32 is finer than d_lse), or anything
 * is not finite (NaN, +-Inf reach the check as NaN), xent_row_formula takes the row from the formula's own lse.
 * Only bits the formula gives are written.
 */

/* e[k] = exp(x[k] - m) (a vector loop) and their sum, in eight running sums side by side. */
HOT_LOOP static double xent_exp_sum(double *e, const float *x, float m, int64_t K)
{
    for (int64_t k = 0; k < K; k++)
        e[k] = exp_f64((double)x[k] - (double)m);
    double acc[8] = { 0 };
    int64_t k = 0;
    for (; k + 8 <= K; k += 8)
        for (int i = 0; i < 8; i++)
            acc[i] += e[k + i];
    for (; k < K; k++)
        acc[k & 7] += e[k];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* The gradient row d[k] = (p_k - [k == label]) g, p_k the fp32 that the whole interval around e[k] exp(-L) (= exp(x[k]
 * - m - L)) rounds to; whether every p_k had one. E = exp(-L) from libm. */
HOT_LOOP static bool xent_fast_grad(float *d, const double *e, const float *x, float m, double lse, double E,
                                    double d_lse, int64_t K, int32_t label, float g)
{
    const double u = 0x1p-53;
    int ok = 1;
    for (int64_t k = 0; k < K; k++) {
        const double p = e[k] * E, a = fabs((double)x[k] - (double)m) + fabs((double)x[k] - lse);
        float pf;
        ok &= f32_of_interval(p, p * (2.0 * (d_lse + 2.0 * u * a) + 140.0 * u), &pf);
        d[k] = (pf - (k == label ? 1.0f : 0.0f)) * g;
    }
    return ok;
}

/* The gradient row from the formula's own lse: each p as exp_f64 of the formula's exponent, kept where its interval
 * (exp_f64's 64u, libm's 2u, the ends) rounds to one fp32; whether every one did. */
HOT_LOOP static bool xent_exact_grad(float *d, const float *x, double lse, int64_t K, int32_t label, float g)
{
    const double u = 0x1p-53;
    int ok = 1;
    for (int64_t k = 0; k < K; k++) {
        const double p = exp_f64((double)x[k] - lse);
        float pf;
        ok &= f32_of_interval(p, p * (140.0 * u), &pf);
        d[k] = (pf - (k == label ? 1.0f : 0.0f)) * g;
    }
    return ok;
}

/* One row by the formula, the bits every other path must give: libm's sum and log, so the formula's lse itself, then
 * the probabilities through xent_exact_grad, libm's exp only for those whose interval still straddles a rounding
 * boundary. For rows the fast path could not settle, rows of large K (GPT-2's 50257, where the sum's bound of K
 * roundings would send most rows here: one libm pass a row instead of two) and labels outside [0, K) (ok false: a
 * NaN loss, no one-hot term). */
static void xent_row_formula(const float *x, float mx, int64_t K, int32_t label, bool ok, float *loss, float *d,
                             float g)
{
    const double u = 0x1p-53;
    double sum = 0.0;
    for (int64_t k = 0; k < K; k++)
        sum += exp((double)x[k] - (double)mx);
    const double lse = (double)mx + log(sum);
    if (loss)
        *loss = ok ? (float)(lse - (double)x[label]) : NAN;
    if (!d || xent_exact_grad(d, x, lse, K, label, g))
        return;
    for (int64_t k = 0; k < K; k++) {
        const double a = (double)x[k] - lse, p = exp_f64(a);
        float pf;
        if (!f32_of_interval(p, p * (140.0 * u), &pf))
            d[k] = ((float)exp(a) - (k == label ? 1.0f : 0.0f)) * g;
    }
}

/* One row by exp_f64 and the bound above; false (outputs partly written) where the formula must decide. e: K
 * doubles of scratch. */
static bool xent_row_fast(double *e, const float *x, float mx, int64_t K, int32_t label, float *loss, float *d, float g)
{
    const double u = 0x1p-53;
    const double L = log(xent_exp_sum(e, x, mx, K));
    const double lse = (double)mx + L;
    const double d_lse = 2.0 * u * (2.0 * (double)K + 80.0 + 4.0 * fabs(L) + 3.0 * fabs(lse));
    const double lv = lse - (double)x[label];
    float lf;
    if (!f32_of_interval(lv, 2.0 * d_lse + 4.0 * u * fabs(lv), &lf))
        return false;
    if (loss)
        *loss = lf;
    return !d || xent_fast_grad(d, e, x, mx, lse, exp(-L), d_lse, K, label, g);
}

/* Rows longer than this go straight to xent_row_formula: d_lse grows with K, and from about 8 Ki logits a row
 * expects one probability or more whose interval straddles a rounding boundary (about K^2 / 2^26 of them), so the
 * fast attempt would mostly be wasted work. */
#define XENT_FAST_MAX_K 8192

/* A label outside [0, K) is a programming error (the data module validates labels): debug builds
 * abort; release builds give that sample a NaN loss, correct 0 and no one-hot term, so the non-finite
 * check reports it instead of the backend reading out of bounds (by the formula, not the fast row). */
static void xent_chunk(void *arg, int64_t chunk, int worker)
{
    const struct loss_job *j = arg;
    int64_t K = j->K, i0 = chunk * j->rows_per, i1 = i0 + j->rows_per < j->N ? i0 + j->rows_per : j->N;
    float *xb = wscratch(j->cb, worker, WSCR_TMP0), *db = wscratch(j->cb, worker, WSCR_TMP1);
    double *e = (double *)(void *)wscratch(j->cb, worker, WSCR_TMP2);
    struct tensor *dlogits = j->grad;
    /* dlogits over the logits (models/loss.c): an fp32 row is read in place, so it is copied first (a 16-bit one is
     * widened into xb anyway, and its gradient staged in db) */
    bool in_place = dlogits && dlogits->data == j->x->data && j->x->dtype == DT_FP32;
    for (int64_t i = i0; i < i1; i++) {
        const float *x = in_place ? memcpy(xb, (const float *)j->x->data + i * K, (size_t)K * sizeof *xb)
                                  : load_f32(j->x->data, j->x->dtype, (size_t)(i * K), (size_t)K, xb);
        float mx = x[0];
        int64_t arg_max = 0;
        for (int64_t k = 1; k < K; k++)
            if (x[k] > mx) {
                mx = x[k];
                arg_max = k;
            }
        int32_t label = j->labels[i];
        assert(label >= 0 && label < K);
        bool ok = label >= 0 && label < K;
        if (j->correct)
            j->correct[i] = ok && arg_max == label;
        float *loss = j->losses ? &j->losses[i] : NULL;
        float *d = dlogits ? out_f32(dlogits->data, dlogits->dtype, (size_t)(i * K), db) : NULL;
        if (!ok || K > XENT_FAST_MAX_K || !xent_row_fast(e, x, mx, K, label, loss, d, j->g))
            xent_row_formula(x, mx, K, label, ok, loss, d, j->g);
        if (d)
            store_f32(dlogits->data, dlogits->dtype, (size_t)(i * K), (size_t)K, d);
    }
}

static void cpu_xent_forward_backward(struct backend *be, struct tensor *losses, int32_t *correct,
                                      struct tensor *dlogits, const struct tensor *logits, const int32_t *labels,
                                      int64_t N, int64_t K, const float *grad_seed)
{
    struct cpu_backend *cb = cpu_of(be);
    assert((int64_t)logits->numel == N * K && K >= 1);
    assert(!losses || (losses->dtype == DT_FP32 && (int64_t)losses->numel >= N));
    assert(!dlogits || (int64_t)dlogits->numel == N * K);
    if (!wscratch_reserve(cb, WSCR_TMP0, (size_t)K * sizeof(float)) ||
        !wscratch_reserve(cb, WSCR_TMP1, (size_t)K * sizeof(float)) ||
        !wscratch_reserve(cb, WSCR_TMP2, (size_t)K * sizeof(double)))
        return;
    assert(!dlogits || grad_seed);
    struct loss_job j = { .cb = cb, .losses = losses ? (float *)losses->data : NULL, .correct = correct,
                          .grad = dlogits, .x = logits, .labels = labels, .N = N, .K = K,
                          .rows_per = rows_per_chunk(K),
                          .g = dlogits ? (float)((double)*grad_seed / (double)N) : 0.0f };
    parallel_for(cb->pool, div_up(N, j.rows_per), xent_chunk, &j);
}

static void mse_chunk(void *arg, int64_t chunk, int worker)
{
    const struct loss_job *j = arg;
    int64_t K = j->K, i0 = chunk * j->rows_per, i1 = i0 + j->rows_per < j->N ? i0 + j->rows_per : j->N;
    float *yb = wscratch(j->cb, worker, WSCR_TMP0), *tb = wscratch(j->cb, worker, WSCR_TMP1);
    float *db = wscratch(j->cb, worker, WSCR_TMP2);
    struct tensor *dy = j->grad;
    for (int64_t i = i0; i < i1; i++) {
        size_t off = (size_t)(i * K);
        const float *yr = load_f32(j->x->data, j->x->dtype, off, (size_t)K, yb);
        const float *tr = load_f32(j->target->data, j->target->dtype, off, (size_t)K, tb);
        double s = 0.0;
        for (int64_t k = 0; k < K; k++) {
            double e = (double)yr[k] - (double)tr[k];
            s += e * e;
        }
        if (j->losses)
            j->losses[i] = (float)(s / (double)K);
        if (!dy)
            continue;
        float *d = out_f32(dy->data, dy->dtype, off, db);
        for (int64_t k = 0; k < K; k++)
            d[k] = (yr[k] - tr[k]) * j->g;
        store_f32(dy->data, dy->dtype, off, (size_t)K, d);
    }
}

static void cpu_mse_forward_backward(struct backend *be, struct tensor *losses, struct tensor *dy,
                                     const struct tensor *y, const struct tensor *target, int64_t N, int64_t K,
                                     const float *grad_seed)
{
    struct cpu_backend *cb = cpu_of(be);
    assert((int64_t)y->numel == N * K && (int64_t)target->numel == N * K);
    assert(!dy || grad_seed);
    assert(!dy || (int64_t)dy->numel == N * K);
    size_t row_bytes = (size_t)K * sizeof(float);
    if (!wscratch_reserve(cb, WSCR_TMP0, row_bytes) || !wscratch_reserve(cb, WSCR_TMP1, row_bytes) ||
        !wscratch_reserve(cb, WSCR_TMP2, row_bytes))
        return;
    struct loss_job j = { .cb = cb, .losses = losses ? (float *)losses->data : NULL, .grad = dy, .x = y,
                          .target = target, .N = N, .K = K, .rows_per = rows_per_chunk(K),
                          .g = dy ? (float)(2.0 * (double)*grad_seed / ((double)N * (double)K)) : 0.0f };
    parallel_for(cb->pool, div_up(N, j.rows_per), mse_chunk, &j);
}

/* The mean of the first n losses. Not threaded: one double sum in index order, which fixed-chunk partials
 * would reorder (the logged loss would move in its last bits), over a handful of values per sample. */
static void cpu_loss_sum(struct backend *be, double *acc, const struct tensor *losses, int64_t n, bool accumulate)
{
    (void)be;
    assert(losses->dtype == DT_FP32 && (int64_t)losses->numel >= n && n > 0);
    const float *l = (const float *)losses->data;
    double s = 0;
    for (int64_t i = 0; i < n; i++)
        s += l[i];
    *acc = (accumulate ? *acc : 0.0) + s / (double)n;
}

/* ---- gradient statistics --------------------------------------------------------------------- */

static bool bits_nonfinite(uint32_t u)
{
    return (u & 0x7F800000u) == 0x7F800000u;
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

/* One chunk's statistics (struct gs_part): sumsq into 8 lanes (element i of the chunk to lane i % 8), absmax,
 * the non-finite elements counted, and told apart only when present. */
struct gs_part {
    double lanes[8], absmax;
    int64_t n_inf, n_nan;
};

HOT_LOOP static void grad_stats_one(const float *g, size_t n, struct gs_part *out)
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

/* The gradients in EW_CHUNK-element chunks, numbered on from tensor to tensor (first[t] is tensor t's first),
 * as optim_run's; part[c] is chunk c's statistics. */
struct gs_job {
    const struct tensor *const *grads;
    int n;
    const int64_t *first; /* n + 1 */
    struct gs_part *part;
};

/* Which of n tensors chunk `chunk` belongs to, their chunks numbered on from tensor to tensor (first[i] is
 * tensor i's first, first[n] the total): the i with first[i] <= chunk < first[i + 1]. */
static int chunk_owner(const int64_t *first, int n, int64_t chunk)
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

static void gs_chunk(const struct gs_job *j, int64_t chunk, struct gs_part *out)
{
    const int i = chunk_owner(j->first, j->n, chunk);
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

/* The fused check over fixed chunks (fixed by the tensors' sizes alone), threaded; then, in chunk order,
 * each chunk's 8 lanes added into 8 totals (lane by lane), absmax taken, and the non-finite counts summed
 * per tensor. So the sum of squares has the same bits for any thread count. Without scratch for the
 * chunks' results the chunks run here one at a time, each combined as it is done: the same additions. */
static void cpu_grad_stats(struct backend *be, const struct tensor *const *grads, int ntensors,
                           struct grad_check *out, int64_t *counts)
{
    struct cpu_backend *cb = cpu_of(be);
    double lanes[8] = { 0 };
    out->absmax = 0.0;
    out->found_nonfinite = 0;
    out->update_nonfinite = 0; /* the whole struct is this pass's (step_propose zeroes it again for its trial) */
    for (int t = 0; t < 2 * ntensors; t++)
        counts[t] = 0;
    int64_t stack_first[65], *first = ntensors < 65 ? stack_first : malloc(((size_t)ntensors + 1) * sizeof *first);
    struct gs_job job = { .grads = grads, .n = ntensors, .first = first };
    if (first) {
        first[0] = 0;
        for (int t = 0; t < ntensors; t++)
            first[t + 1] = first[t] + ew_chunks(grads[t]->numel);
        job.part = scratch_get(cb, SCR_ACC1, (size_t)(first[ntensors] > 0 ? first[ntensors] : 1) * sizeof *job.part);
        if (job.part)
            parallel_for(cb->pool, first[ntensors], gs_chunk_job, &job);
    }
    for (int t = 0; t < ntensors; t++) {
        int64_t c0 = first ? first[t] : 0, nc = ew_chunks(grads[t]->numel);
        for (int64_t c = 0; c < nc; c++) {
            struct gs_part one, *r = &one;
            if (job.part)
                r = &job.part[c0 + c];
            else if (first)
                gs_chunk(&job, c0 + c, r);
            else { /* no memory even for the chunk table: tensor t's chunk c directly */
                size_t off = (size_t)c * EW_CHUNK, n = grads[t]->numel - off < EW_CHUNK ? grads[t]->numel - off : EW_CHUNK;
                grad_stats_one((const float *)grads[t]->data + off, n, r);
            }
            for (int l = 0; l < 8; l++)
                lanes[l] += r->lanes[l];
            out->absmax = r->absmax > out->absmax ? r->absmax : out->absmax;
            counts[t] += r->n_inf;
            counts[ntensors + t] += r->n_nan;
        }
        if (counts[t] || counts[ntensors + t])
            out->found_nonfinite = 1;
    }
    if (first && first != stack_first)
        free(first);
    out->sumsq = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

static void cpu_step_propose(struct backend *be, const struct step_params *p, struct step_state *state,
                             struct grad_check *check)
{
    (void)be;
    step_rule_propose(p, state, check);
}

static void cpu_step_finish(struct backend *be, const struct step_params *p, struct step_state *state,
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

static void cpu_count_zeros(struct backend *be, const struct tensor *t, int64_t *acc)
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

/* ---- optimizers ------------------------------------------------------------------------------ */

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
 * (lib/sround.h). All integer arithmetic, so every clone gives the same bits; the draw's 64-bit multiplies
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
 * the 16 bits at `shift` of each element's draw (lib/sround.h). */
static void optim_block_store(void *base, enum dtype dt, size_t off, size_t n, const float *x,
                              const struct optim_update_args *a, uint64_t key, int shift)
{
    if (dt == DT_FP32)
        return;
    uint16_t *d = (uint16_t *)base + off;
    if (a->stochastic)
        store_bf16_stochastic(d, x, n, key, off, shift);
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
        store_bf16_stochastic(h, x, n, key, off, shift);
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
 * updated from its own values alone (stochastic rounding draws by element index, lib/sround.h), so the
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
    const int lo = chunk_owner(j->first, j->n, chunk);
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

static void cpu_adamw_update(struct backend *be, const struct optim_update_args *a, int n)
{
    optim_run(cpu_of(be), a, n, true, 0);
}

static void cpu_sgd_update(struct backend *be, const struct optim_update_args *a, int n)
{
    optim_run(cpu_of(be), a, n, false, 0);
}

/* ---- status and lifetime --------------------------------------------------------------------- */

/* ---- fp8 -------------------------------------------------------------------------------------------- */

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

static void cpu_fp8_cast(struct backend *be, const struct fp8_cast_args *a)
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

static void cpu_fp8_update(struct backend *be, const struct fp8_update_args *a)
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

static enum amp_status cpu_status(struct backend *be, struct amp_error *err)
{
    struct cpu_backend *cb = cpu_of(be);
    if (err) {
        if (cb->status != AMP_OK) {
            *err = cb->err;
        } else {
            err->code = AMP_OK;
            err->msg[0] = '\0';
            err->hint[0] = '\0';
        }
    }
    return cb->status;
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

/* The pool is made once (the engine calls this once, after backend_open); calling it again replaces it. */
static enum amp_status cpu_set_threads(struct backend *be, int threads, struct amp_error *err)
{
    struct cpu_backend *cb = cpu_of(be);
    assert(threads >= 1);
    free_workers(cb);
    /* one thread runs without a pool, except under AMP_POOL_PROFILE: a one-thread pool runs every job inline
     * (the same bits at any count) and so gives the per-operation table at 1 thread too */
    if (threads == 1 && !getenv("AMP_POOL_PROFILE"))
        return AMP_OK;
    cb->pool = threadpool_create(threads);
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
    const char *portable = getenv("AMP_GEMM_PORTABLE");
    const bool forced = portable && portable[0] && strcmp(portable, "0") != 0;
    for (int dt = 0; dt < DT_COUNT; dt++)
        cb->gemm_avx512[dt] = !forced && gemm_avx512_supported((enum dtype)dt);
    const char *amx = getenv("AMP_GEMM_AMX");
    cb->gemm_amx = cb->gemm_avx512[DT_BF16] && !(amx && strcmp(amx, "0") == 0) && gemm_avx512_amx_supported();
    struct backend *be = &cb->base;
    be->name = "cpu";
    be->host_memory = true;
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
    be->step_propose = cpu_step_propose;
    be->step_finish = cpu_step_finish;
    be->count_zeros = cpu_count_zeros;
    be->fp8_cast = cpu_fp8_cast;
    be->fp8_update = cpu_fp8_update;
    be->adamw_update = cpu_adamw_update;
    be->sgd_update = cpu_sgd_update;
    be->set_threads = cpu_set_threads;
    be->status = cpu_status;
    be->destroy = cpu_destroy;
    return be;
}
