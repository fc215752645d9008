/*
 * cpu_internal.h — what the CPU backend's files share: the backend's state (struct cpu_backend), its scratch
 * slots and their growth, the dtype helpers every op stages its slices through, the chunk sizes that fix the
 * threads' work by the problem alone, and the cross-file routines (gemm_core, the per-worker products, the eight
 * planes' sums). Private to kernels/cpu/; the engine sees only backend.h.
 *
 * Small hot helpers (dtype loads and stores, index math, scratch look-ups) are `static inline` here so that every
 * op file inlines them as the one file did; routines shared by several files are `cpu_`-prefixed and defined in
 * the file named beside their declaration. The op functions of the table (backend_cpu_create, backend_cpu.c) are
 * declared at the end, grouped by the file that defines them.
 */
#ifndef AMP_CPU_INTERNAL_H
#define AMP_CPU_INTERNAL_H

#include "backend.h"

#include <assert.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "threadpool.h" /* parallel_for, threadpool_threads: the ops' chunks on the backend's threads */

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

enum scratch_slot {
    SCR_GEMM_A, SCR_GEMM_B, SCR_GEMM_C, /* cpu_gemm_core: fp32 copies of 16-bit operands and result, or
                                         * the packed panels and partial sums of gemm_avx512 */
    SCR_IN0, SCR_IN1, SCR_IN2,          /* fp32 copies of one slice (image, plane, row, block) of a 16-bit input */
    SCR_TMP0, SCR_TMP1, SCR_TMP2,       /* per-op fp32 work buffers, also one slice each */
    SCR_ACC0, SCR_ACC1,                 /* per-op double accumulators */
    SCR_IDX,                            /* int32 indices: max pooling's argmax, one plane */
    SCR_FP8_A, SCR_FP8_B,               /* cpu_gemm_core: fp8 operands widened (exactly) to bf16 */
    SCR_FP8_C,                          /* cpu_gemm_core: an fp8 product accumulated into C, formed apart first */
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
    struct scratch (*wscr)[WSCR_COUNT];  /* per-worker scratch: wscr_rows rows (cpu_wscratch_reserve) */
    int wscr_rows;
    void **wpack_a;                      /* each thread's packed op(A): its wscr[w][WSCR_PACK_A].p */
    void **wpack_b;                      /* each thread's packed op(B) (a whole one): its wscr[w][WSCR_GEMM_B].p */
    enum amp_status status; /* first failure, AMP_OK when none */
    struct amp_error err;
    bool gemm_avx512[DT_COUNT]; /* products of this input dtype go through gemm_avx512 (the CPU has the
                                 * instructions, AMPTRAIN_GEMM_PORTABLE unset) */
    bool gemm_amx;              /* ... and bf16 ones on AMX tiles (the CPU has AMX-BF16, AMPTRAIN_GEMM_AMX not 0) */
};

static inline struct cpu_backend *cpu_of(struct backend *be)
{
    return (struct cpu_backend *)be;
}

/* A slot's buffer of at least `bytes`; its contents are not kept when it grows. NULL (and the
 * backend's status set) when memory runs out. (backend_cpu.c) */
void *cpu_scratch_grow(struct cpu_backend *cb, struct scratch *s, size_t bytes);

static inline void *scratch_get(struct cpu_backend *cb, enum scratch_slot slot, size_t bytes)
{
    return cpu_scratch_grow(cb, &cb->scr[slot], bytes);
}

static inline int cpu_threads(const struct cpu_backend *cb)
{
    return threadpool_threads(cb->pool);
}

/* One row of worker scratch per thread of the pool, added (empty) when the pool has grown. (backend_cpu.c) */
bool cpu_wscratch_rows(struct cpu_backend *cb);

/* Grow `slot` to `bytes` for every worker. Called on the calling thread before parallel_for, so a failure
 * sets the status once and the op returns before touching an output; chunks only read the pointers.
 * (backend_cpu.c) */
bool cpu_wscratch_reserve(struct cpu_backend *cb, enum worker_slot slot, size_t bytes);

/* The same for staging n values of t: nothing to reserve when t is fp32 (read and written in place). */
static inline bool wstage_reserve(struct cpu_backend *cb, enum worker_slot slot, const struct tensor *t, size_t n)
{
    return !t || t->dtype == DT_FP32 || cpu_wscratch_reserve(cb, slot, n * sizeof(float));
}

/* Worker w's buffer in `slot`: NULL when none was reserved (an fp32 tensor needs none). */
static inline void *wscratch(const struct cpu_backend *cb, int worker, enum worker_slot slot)
{
    return worker < cb->wscr_rows ? cb->wscr[worker][slot].p : NULL;
}

/* Elements per chunk of the elementwise ops and the optimizer: fixed (never from the thread count), a
 * multiple of BLOCK, large enough that handing a chunk to a thread costs little next to computing it. */
#define EW_CHUNK ((size_t)16 * BLOCK)

static inline int64_t ew_chunks(size_t n)
{
    return (int64_t)((n + EW_CHUNK - 1) / EW_CHUNK);
}

/* Rows per chunk of an op whose rows (of `cols` elements) are independent: about EW_CHUNK elements, at
 * least one row. Fixed by the shape alone; a problem of one chunk runs inline, so small ones pay nothing. */
static inline int64_t rows_per_chunk(int64_t cols)
{
    int64_t r = (int64_t)EW_CHUNK / (cols > 0 ? cols : 1);
    return r > 0 ? r : 1;
}

static inline int64_t div_up(int64_t a, int64_t b)
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

static inline void *elem_ptr(const void *base, enum dtype dt, size_t i)
{
    return (char *)base + i * dtype_size(dt);
}

/* n elements of `base` (dtype dt) from element `off` as fp32: the data itself when fp32, else
 * converted into buf (n floats). */
static inline const float *load_f32(const void *base, enum dtype dt, size_t off, size_t n, float *buf)
{
    if (dt == DT_FP32)
        return (const float *)base + off;
    dtype_convert(buf, DT_FP32, elem_ptr(base, dt, off), dt, n);
    return buf;
}

/* Where to compute n fp32 results destined for `base` at `off`: in place when fp32, else buf. */
static inline float *out_f32(void *base, enum dtype dt, size_t off, float *buf)
{
    return dt == DT_FP32 ? (float *)base + off : buf;
}

/* Store results computed in out_f32's buffer: one rounding for 16-bit outputs, nothing for fp32. */
static inline void store_f32(void *base, enum dtype dt, size_t off, size_t n, const float *buf)
{
    if (dt != DT_FP32)
        dtype_convert(elem_ptr(base, dt, off), dt, buf, DT_FP32, n);
}

/* Staging scratch for n fp32 values read from or written to t a slice at a time (one image, one
 * plane, one row block): NULL when t is fp32 — load_f32/out_f32 then use t's data in place — else
 * slot's buffer. Ops take their staging buffers before touching any output, so a failure to grow one
 * (*ok cleared, status set) leaves the outputs unwritten. */
static inline float *stage_f32(struct cpu_backend *cb, enum scratch_slot slot, const struct tensor *t, size_t n,
                               bool *ok)
{
    if (!t || t->dtype == DT_FP32)
        return NULL;
    float *p = scratch_get(cb, slot, n * sizeof(float));
    if (!p)
        *ok = false;
    return p;
}

/* The whole tensor as fp32: itself, or a converted copy in `slot`. Only for small tensors (weights). */
static inline const float *view_f32(struct cpu_backend *cb, enum scratch_slot slot, const struct tensor *t)
{
    if (t->dtype == DT_FP32)
        return (const float *)t->data;
    float *p = scratch_get(cb, slot, t->numel * sizeof(float));
    if (p)
        dtype_convert(p, DT_FP32, t->data, t->dtype, t->numel);
    return p;
}

/* Round fp32 values to dt and back, in place: what storing them in dt and reading them back gives. */
static inline void round_f32_to(float *p, size_t n, enum dtype dt)
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
static inline void store_acc(float *d, const double *acc, size_t n, float beta)
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
static inline void scale_f32(float *d, size_t n, float beta)
{
    if (beta == 0.0f)
        memset(d, 0, n * sizeof(float));
    else if (beta != 1.0f)
        for (size_t i = 0; i < n; i++)
            d[i] *= beta;
}

/* A row-major matrix operand: element (r, c) is at p + (r * ld + c) elements of dtype dt. */
struct mat_in {
    const void *p;
    enum dtype dt;
    int64_t ld;
    const struct fp8_blocks *blocks; /* recipe blockwise: the operand's tile scales (backend.h), or NULL */
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

/* Whether gemm_avx512 runs bf16 products of `in` on the AMX tiles (gemm_core_avx512's choice). */
static inline bool gemm_uses_amx(const struct cpu_backend *cb, enum dtype in)
{
    return in == DT_BF16 && cb->gemm_amx;
}

/* The factor an fp8 product's sum is multiplied by: alpha * A's scale_inv * B's (backend.h, gemm_args). */
static inline float gemm_alpha(const struct gemm_args *g)
{
    float alpha = g->alpha;
    if (dtype_is_fp8(g->a->dtype) && !g->a_blocks.scale_inv) { /* block scales: applied per block of K */
        assert(g->a->scale_inv && g->b->scale_inv);
        alpha = alpha * *g->a->scale_inv * *g->b->scale_inv;
    }
    return alpha;
}

/* A gemm_args operand's tile scales for mat_in.blocks: NULL unless recipe blockwise set them. */
static inline const struct fp8_blocks *blocks_of(const struct fp8_blocks *b)
{
    return b->scale_inv ? b : NULL;
}

static inline bool gemm_dtypes_ok(const struct gemm_args *g)
{
    enum dtype a = g->a->dtype, b = g->b->dtype, c = g->c->dtype;
    if (g->a_blocks.scale_inv || g->b_blocks.scale_inv)
        return a == DT_FP8_E4M3 && b == DT_FP8_E4M3 && g->a_blocks.scale_inv && g->b_blocks.scale_inv &&
               g->batch == 1 && (c == DT_FP32 || c == DT_BF16);
    if (dtype_is_fp8(a) || dtype_is_fp8(b))
        return dtype_is_fp8(a) && dtype_is_fp8(b) && !(a == DT_FP8_E5M2 && b == DT_FP8_E5M2) &&
               (c == DT_FP32 || c == DT_BF16);
    return a == b && (c == DT_FP32 || c == a);
}

static inline int blas_dim(int64_t x)
{
    assert(x >= 0 && x <= INT_MAX);
    return x < 1 ? 1 : (int)x;
}

/* Whether cpu_gemm_core runs this product on gemm_avx512 (and so can apply a ReLU or its mask in the epilogue). */
static inline bool gemm_takes_avx512(const struct cpu_backend *cb, int64_t k, enum dtype a, enum dtype b, enum dtype c)
{
    return k > 0 && a == b && !dtype_is_fp8(a) && cb->gemm_avx512[a] && (c == DT_FP32 || c == a);
}

static inline struct mat_in mat_f32(const float *p, int64_t ld)
{
    return (struct mat_in){ .p = p, .dt = DT_FP32, .ld = ld };
}

static inline struct mat_out out_mat_f32(float *p, int64_t ld)
{
    return (struct mat_out){ .p = p, .dt = DT_FP32, .ld = ld };
}

/* C (m, n) = alpha * op(A) @ op(B) + beta * C [+ bias (n) on every row, or + c.row_bias (m) on every column,
 * with beta 0], rounded once to C's dtype. beta 0 never reads C. (gemm.c) */
void cpu_gemm_core(struct cpu_backend *cb, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                   struct mat_in a, struct mat_in b, float beta, struct mat_out c, const float *bias);

/* cpu_worker_gemm's panels for an (m, n, k) product of inputs `in` on every worker. (gemm.c) */
bool cpu_worker_gemm_reserve(struct cpu_backend *cb, enum dtype in, int64_t m, int64_t n, int64_t k);

/* C (m, n) = alpha op(A) @ op(B) + beta * C on worker w's own panels, single-threaded: the call gemm_core
 * makes, so the same bits. Only where cb->gemm_avx512[in]. (gemm.c) */
void cpu_worker_gemm(const struct cpu_backend *cb, int worker, enum dtype in, bool ta, bool tb, int64_t m,
                     int64_t n, int64_t k, float alpha, const void *a, int64_t lda, const void *b, int64_t ldb,
                     float beta, struct mat_out c);

/* The GELU epilogue of a product (GEMM_EPI_GELU_TANH): the product, then GELU over it. (elementwise.c) */
void cpu_gemm_gelu(struct cpu_backend *cb, const struct gemm_args *g);

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

#endif

#ifdef HAVE_AVX512_INTRIN
/* Per-channel sums of CHAINS channels (or rows) with the channels as the lanes of one vector, bit for bit the
 * scalar chains' sums (planes8_avx512.c): s[l] += p[l][q]; ss[l] += (p[l][q] - mu[l])^2; and the gradient sums
 * sdy[l] += dy, sdyx[l] += (double)dy * ((x - mu[l]) * rs[l]). Only where cpu_planes8_avx512(lanes). */
void cpu_planes_sum8_avx512(const void *const p[CHAINS], bool bf16, int64_t hw, double s[CHAINS]);
void cpu_planes_sumsq8_avx512(const void *const p[CHAINS], bool bf16, int64_t hw, const double mu[CHAINS],
                              double ss[CHAINS]);
void cpu_planes_gradsum8_avx512(const void *const xp[CHAINS], const void *const dp[CHAINS],
                                const void *const yp[CHAINS], const float *g, bool bf16, int64_t hw,
                                const float mu[CHAINS], const float rs[CHAINS], double sdy[CHAINS],
                                double sdyx[CHAINS]);

/* Whether `lanes` channels take the planes' vector sums: all CHAINS of them, on a CPU with AVX-512 F and VL. */
static inline bool cpu_planes8_avx512(int64_t lanes)
{
    return lanes == CHAINS && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
}
#endif

/* The elementwise loops batchnorm and layernorm reuse for their fused ReLU and residual add (elementwise.c). */
/* y = act(x) over n fp32 values. */
void cpu_act_apply(enum act_kind kind, float *y, const float *x, size_t n);
/* dx = dy * act'(x) over n fp32 values. */
void cpu_act_grad_apply(enum act_kind kind, float *dx, const float *dy, const float *x, size_t n);
/* Whether dt is a 16-bit float format, with its Inf and quiet-NaN bits: where relu_grad_16 applies. */
bool cpu_half_format(enum dtype dt, uint16_t *inf, uint16_t *quiet);
/* The ReLU's gradient on 16-bit patterns: the bits the fp32 round trip of cpu_act_grad_apply gives. */
void cpu_relu_grad_16(uint16_t *dx, const uint16_t *dy, const uint16_t *x, size_t n, uint16_t inf, uint16_t quiet);
/* y = a + b over elements [lo, hi). */
void cpu_add_range(struct tensor *y, const struct tensor *a, const struct tensor *b, size_t lo, size_t hi);

/* Which of n tensors chunk `chunk` belongs to, their chunks numbered on from tensor to tensor (first[i] is
 * tensor i's first, first[n] the total): the i with first[i] <= chunk < first[i + 1]. (gradstats.c) */
int cpu_chunk_owner(const int64_t *first, int n, int64_t chunk);

/* The operations of the table (backend.h has their contracts), by the file that defines them. */

/* gemm.c */
void cpu_gemm(struct backend *be, const struct gemm_args *g);
void cpu_bias_grad(struct backend *be, struct tensor *db, const struct tensor *dy, int64_t m, int64_t n,
                   float beta);

/* elementwise.c */
void cpu_act_forward(struct backend *be, enum act_kind kind, struct tensor *y, const struct tensor *x);
void cpu_act_backward(struct backend *be, enum act_kind kind, struct tensor *dx, const struct tensor *dy,
                      const struct tensor *x);
void cpu_add(struct backend *be, struct tensor *y, const struct tensor *a, const struct tensor *b);
void cpu_dropout_forward(struct backend *be, struct tensor *y, const struct tensor *x, float p,
                         struct rng_key key);
void cpu_dropout_backward(struct backend *be, struct tensor *dx, const struct tensor *dy, float p,
                          struct rng_key key);

/* conv.c */
void cpu_conv2d_forward(struct backend *be, const struct conv_args *a, struct tensor *y,
                        const struct tensor *x, const struct tensor *w, const struct tensor *bias);
void cpu_conv2d_backward_data(struct backend *be, const struct conv_args *a, struct tensor *dx,
                              const struct tensor *dy, const struct tensor *w);
void cpu_conv2d_backward_filter(struct backend *be, const struct conv_args *a, struct tensor *dw,
                                struct tensor *db, const struct tensor *dy, const struct tensor *x, float beta);

/* pool.c */
void cpu_pool2d_forward(struct backend *be, const struct pool_args *a, struct tensor *y,
                        const struct tensor *x);
void cpu_pool2d_backward(struct backend *be, const struct pool_args *a, struct tensor *dx,
                         const struct tensor *dy, const struct tensor *x, const struct tensor *y);

/* norm.c */
void cpu_layernorm_forward(struct backend *be, const struct norm_args *a, struct tensor *y,
                           struct tensor *mean, struct tensor *rstd, const struct tensor *x,
                           const struct tensor *gamma, const struct tensor *beta);
void cpu_layernorm_backward(struct backend *be, const struct norm_args *a, struct tensor *dx,
                            struct tensor *dgamma, struct tensor *dbeta, const struct tensor *dy,
                            const struct tensor *x, const struct tensor *mean, const struct tensor *rstd,
                            const struct tensor *gamma, float beta_acc);
void cpu_batchnorm_forward(struct backend *be, const struct norm_args *a, struct tensor *y,
                           struct tensor *mean, struct tensor *rstd, struct tensor *running_mean,
                           struct tensor *running_var, const struct tensor *x, const struct tensor *gamma,
                           const struct tensor *beta);
void cpu_batchnorm_backward(struct backend *be, const struct norm_args *a, struct tensor *dx,
                            struct tensor *dgamma, struct tensor *dbeta, const struct tensor *dy,
                            const struct tensor *x, const struct tensor *y, const struct tensor *mean,
                            const struct tensor *rstd, const struct tensor *gamma, float beta_acc);

/* embedding.c */
void cpu_embedding_forward(struct backend *be, struct tensor *y, const int32_t *tokens,
                           const struct tensor *wte, const struct tensor *wpe, int64_t B, int64_t T,
                           int64_t C);
void cpu_embedding_backward(struct backend *be, struct tensor *dwte, struct tensor *dwpe,
                            const struct tensor *dy, const int32_t *tokens, int64_t B, int64_t T, int64_t C,
                            float beta);

/* attention.c */
void cpu_attention_forward(struct backend *be, struct tensor *out, struct tensor *probs,
                           const struct tensor *qkv, int64_t B, int64_t T, int64_t C, int64_t H);
void cpu_attention_backward(struct backend *be, struct tensor *dqkv, const struct tensor *dout,
                            const struct tensor *qkv, const struct tensor *probs, int64_t B, int64_t T,
                            int64_t C, int64_t H);
void cpu_attention_decode(struct backend *be, struct tensor *out, struct tensor *cache, const struct tensor *qkv,
                          int64_t pos, int64_t n, int64_t C, int64_t H);

/* loss.c */
void cpu_xent_forward_backward(struct backend *be, struct tensor *losses, int32_t *correct,
                               struct tensor *dlogits, const struct tensor *logits, const int32_t *labels,
                               int64_t N, int64_t K, const float *grad_seed);
void cpu_mse_forward_backward(struct backend *be, struct tensor *losses, struct tensor *dy,
                              const struct tensor *y, const struct tensor *target, int64_t N, int64_t K,
                              const float *grad_seed);
void cpu_loss_sum(struct backend *be, double *acc, const struct tensor *losses, int64_t n, bool accumulate);

/* gradstats.c */
void cpu_grad_stats(struct backend *be, const struct tensor *const *grads, int ntensors,
                    struct grad_check *out, int64_t *counts);
void cpu_grad_stats_parts(struct backend *be, const struct tensor *const *grads, int ntensors, struct grad_part *out);
void cpu_grad_stats_combine(struct backend *be, const struct grad_part *parts, const int64_t *first,
                            const int64_t *at, int ntensors, struct grad_check *out, int64_t *counts);
void cpu_step_propose(struct backend *be, const struct step_params *p, struct step_state *state,
                      struct grad_check *check);
void cpu_step_finish(struct backend *be, const struct step_params *p, struct step_state *state,
                     const struct grad_check *check, struct step_row *row);
void cpu_count_zeros(struct backend *be, const struct tensor *t, int64_t *acc);

/* optim.c */
void cpu_adamw_update(struct backend *be, const struct optim_update_args *a, int n);
void cpu_sgd_update(struct backend *be, const struct optim_update_args *a, int n);

/* fp8.c */
void cpu_fp8_cast(struct backend *be, const struct fp8_cast_args *a);
void cpu_fp8_update(struct backend *be, const struct fp8_update_args *a);
void cpu_fp8_block_cast(struct backend *be, const struct fp8_block_cast_args *a);
/* C = alpha * op(A) @ op(B) (+ bias) + beta * C of block-scaled E4M3 operands (a.blocks, b.blocks), the
 * emulation backend.h's gemm_args defines; called by cpu_gemm_core. */
void cpu_gemm_blockwise(struct cpu_backend *cb, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                        struct mat_in a, struct mat_in b, float beta, struct mat_out c, const float *bias);

#endif /* AMP_CPU_INTERNAL_H */
