/*
 * backend_cuda_internal.h — what the CUDA backend's translation units share (C++: the .cu files nvcc compiles, and
 * host-only .cpp files, which see everything but the device functions).
 *
 * The backend is one `struct cuda_backend` (its first member the `struct backend` table callers hold),
 * one non-blocking stream every op is queued on, a cuBLASLt handle with a 32 MB workspace, a cuDNN
 * handle, per-shape caches (matmul plans in gemm_cublaslt.cu, convolution algorithms in conv_cudnn.cu)
 * and a few growable device scratch slots. Nothing here synchronises the host except download and
 * synchronize: a training step's losses, gradient check, zero counts and decision stay in device
 * memory (backend.h).
 *
 * Errors: the first failure (a CUDA/cuBLAS/cuDNN error, a launch error, a violated alignment rule) is
 * recorded with file and line and stays until destroy; backend->status reports it. After a failure the
 * ops keep queueing work (their results are garbage), exactly like the CPU backend's scratch failure.
 *
 * Element access: every kernel reads its inputs through load_elem (any dtype -> fp32) and writes
 * through store_elem (fp32 -> the output's dtype, rounded once, to nearest even), so the dtype rules of
 * backend.h hold kernel by kernel.
 */
#ifndef AMP_BACKEND_CUDA_INTERNAL_H
#define AMP_BACKEND_CUDA_INTERNAL_H

#include <cstddef>
#include <cstdint>

#include <cublasLt.h>         /* cublasLtHandle_t */
#include <cuda_bf16.h>        /* __nv_bfloat16 */
#include <cuda_fp16.h>        /* __half */
#include <cuda_fp8.h>         /* __nv_fp8_e4m3, __nv_fp8_e5m2: precision.mode fp8 */
#include <cuda_runtime_api.h> /* cudaStream_t */
#include <cudnn.h>            /* cudnnHandle_t */

extern "C" {
#include "sround.h" /* bf16_round_stochastic, sr_stream: the optimizer's bf16 stores */
#include "backend.h" /* struct backend, the op argument structs */
}

constexpr size_t kLtWorkspaceBytes = 32u << 20; /* cuBLASLt workspace, allocated once */
constexpr unsigned kThreads = 256;              /* default block size of elementwise kernels */

enum cuda_scratch_slot {
    CSCR_CONV_WS,                 /* cuDNN workspace */
    CSCR_F32_0, CSCR_F32_1, CSCR_F32_2, /* fp32 copies of operands (conv with mixed dtypes) */
    CSCR_ATT_Q, CSCR_ATT_K, CSCR_ATT_V, CSCR_ATT_O, /* attention: per-head contiguous Q, K, V, out */
    CSCR_ATT_S,                   /* attention: scores / dP / dS (B*H, T, T) */
    CSCR_ATT_DQ, CSCR_ATT_DK, CSCR_ATT_DV, /* attention backward */
    CSCR_PARTIAL,                 /* per-block partial results of reductions */
    CSCR_PARTIAL2,
    CSCR_CHANNEL_STATS,           /* batchnorm: per-channel values between its passes (norm.cu) */
    CSCR_BN_RELU_DY,              /* batchnorm with a fused ReLU: the ReLU's input gradient (norm.cu) */
    CSCR_GS_DESC,                 /* grad_stats: the tensor table (cuda_backend.gs_table, a device_table) */
    CSCR_GC_DESC,                 /* grad_stats_combine: the parts' places (cuda_backend.gc_table) */
    CSCR_OPT_DESC,                /* adamw / sgd: the parameter table (cuda_backend.opt_table) */
    CSCR_EMB_KEYS, CSCR_EMB_VALS_IN, CSCR_EMB_VALS, CSCR_EMB_SORT, /* embedding backward: sorted tokens */
    CSCR_FP8_A, CSCR_FP8_B,       /* fp8 products: operands transposed (cuBLASLt's TN layout) or widened */
    CSCR_FP8_P,                   /* fp8 products: the fp32 product before fp8.cu's epilogue */
    CSCR_FP8_SCALES,              /* fp8 products: A's and B's scale_inv at 16-byte-aligned addresses */
    CSCR_FP8_AMAX,                /* fp8_cast (recipe current): the tensor's amax */
    CSCR_FP8_SA, CSCR_FP8_SB,     /* recipe blockwise: A's and B's tile scales in cuBLASLt's layout (fp8.cu) */
    CSCR_COUNT
};

struct device_scratch {
    void *p;
    size_t cap; /* bytes */
};

/* grad_stats' part (backend.grad_part_numel): a fixed element count, so that ranks holding some parts of a gradient
 * (dist.zero 1) compute the very parts one rank does (loss_optim.cu). */
constexpr uint64_t kGradPart = 16384;

/* grad_stats' tensor table (loss_optim.cu): one entry per gradient tensor, in the caller's order, followed in the
 * device table by the tensors' first parts (int64, ntensors + 1). */
struct grad_table_entry {
    const float *p;  /* fp32 gradient, device */
    uint64_t n;      /* elements */
};


/* adamw_update / sgd_update's parameter table (loss_optim.cu): one entry per parameter, in the caller's
 * order; the n entries of one call share the step scalars and the hyperparameters (kernel arguments). */
struct optim_table_entry {
    void *master;        /* (numel) of master_dt (fp32 or bf16), updated in place */
    const float *grad;   /* fp32 (numel), still scaled by the loss scale */
    void *m, *v;         /* (numel) of state_dt: adamw's moments; sgd: m the momentum buffer or NULL, v NULL */
    void *copy;          /* (numel) of copy_dt: the copy written in the same pass, or NULL */
    uint64_t numel;
    uint64_t sr_seed;    /* stochastic rounding (lib/base/sround.h): the seed, and this parameter's index */
    uint64_t sr_offset;  /* element 0's index in the parameter (a ZeRO shard's first; 0 otherwise): the draw's */
    uint32_t sr_param;
    float weight_decay;  /* 0 where the parameter does not decay */
    int32_t master_dt, state_dt, copy_dt; /* enum dtype of master, of m and v, of copy */
    int32_t stochastic;  /* bf16 stores round stochastically */
};

/* A table of plain entries kept in a scratch slot and uploaded again only when it changes (the grad_stats
 * and optimizer tables: the same tensors every step). The caller fills device_table_begin's buffer
 * (zeroed, so padding compares equal) and device_table_commit compares it with the copy last sent.
 * Both host copies are pageable on purpose: cudaMemcpyAsync stages a pageable source before it
 * returns, so the next call may rewrite them while the upload is still queued; the device copy is only
 * rewritten in stream order, after the kernels queued before have read it. */
struct cuda_backend;
struct device_table {
    void *build, *sent;  /* malloc'd, cap bytes each */
    size_t cap;
    size_t sent_bytes;   /* what the slot holds; 0 when nothing valid is there */
};
void *device_table_begin(struct cuda_backend *cb, struct device_table *t, size_t bytes, const char *what);
const void *device_table_commit(struct cuda_backend *cb, struct device_table *t, enum cuda_scratch_slot slot,
                                size_t bytes);
void device_table_free(struct device_table *t);

struct gemm_plan; /* gemm_cublaslt.cu */
struct conv_plan; /* conv_cudnn.cu */
struct sdpa_plan; /* attention_cudnn.cpp */

/* attention_cudnn.cpp: the fused attention (backend.h attention_fused_*), where built with cuDNN's frontend.
 * install fills the table's three entries (left NULL without the frontend) and reads AMPTRAIN_CUDNN_ATTENTION;
 * free drops the cached graphs; build says which, for --version. */
void cuda_attention_fused_install(struct cuda_backend *cb);
void cuda_attention_fused_free(struct cuda_backend *cb);
const char *cuda_attention_fused_build(void);

struct cuda_backend {
    struct backend base; /* first member */
    char name[16];       /* "cuda:N" */
    int device;
    cudaStream_t stream;
    int cc;              /* compute capability, major * 10 + minor: fp8 products need 89 or more (else emulated) */
    bool fp8_warned;     /* the fp8 emulation warning was printed */
    bool fp8_refused;    /* cublasLtMatmul refused a native fp8 product at its first call: fp8 products are
                          * emulated in bf16 from then on (cuda_gemm_fp8), with one warning saying so */
    bool blockwise_noted; /* recipe blockwise's note: a product ran the plain kernels (the CPU's arithmetic, no
                           * tensor cores), printed once */
    bool fp8_block_lt_off; /* AMPTRAIN_FP8_BLOCK_CUBLASLT=0: every block-scaled product through the plain kernels,
                            * none through cuBLASLt's block-scaled fp8 matmul (kernels/cuda/fp8.cu) */
    bool fp8_epilogue_off; /* AMPTRAIN_FP8_CUBLASLT_EPILOGUE=0: every fp8 product through the fp32 scratch and the
                            * epilogue kernel, none with cuBLASLt writing its bf16 C (kernels/cuda/fp8.cu) */
    bool fp8_epilogue_noted; /* the note that cuBLASLt declined to write an fp8 product's bf16 C was printed */
    bool pools;          /* cudaDevAttrMemoryPoolsSupported: scratch by cudaMallocAsync, else cudaMalloc */
    cudaEvent_t stage_done[BACKEND_STAGING_SLOTS]; /* upload_staged: each slot's last queued copy */
    bool staged[BACKEND_STAGING_SLOTS];            /* a copy was queued since the slot's last wait */
    cublasLtHandle_t lt;
    void *lt_workspace;  /* kLtWorkspaceBytes */
    cudnnHandle_t dnn;
    struct device_scratch scr[CSCR_COUNT];
    struct gemm_plan *gemm_plans; /* linked list, most recently used first */
    int n_gemm_plans;
    struct conv_plan *conv_plans;
    struct sdpa_plan *sdpa_plans; /* the fused attention's graphs, most recently used first */
    bool sdpa_off;       /* AMPTRAIN_CUDNN_ATTENTION=0: the fused attention reports no shape */
    struct device_table gs_table; /* grad_stats, grad_stats_parts (CSCR_GS_DESC) */
    struct device_table gc_table; /* grad_stats_combine (CSCR_GC_DESC) */
    struct device_table opt_table; /* adamw / sgd (CSCR_OPT_DESC) */
    size_t peak_used;    /* device bytes in use (cudaMemGetInfo) at the highest point seen in alloc */
    enum amp_status status;
    struct amp_error err;
    /* CUDA Graphs (graphs.cu): the kept graphs, the scratch generation each was recorded at (cuda_scratch raises
     * scratch_gen whenever it replaces a slot's buffer, which leaves every graph naming the old one stale, and
     * device_table_commit whenever it uploads a table with other entries than the graphs read), and the
     * recording in progress: its first failure goes to capture_why, never to status (the caller runs the ops again
     * plainly, and a failure there is recorded as usual). */
    cudaGraphExec_t graph_exec[BACKEND_GRAPHS];
    uint64_t graph_gen[BACKEND_GRAPHS];
    uint64_t scratch_gen;
    bool capturing;
    bool capture_failed;
    char capture_why[320];
    bool graph_noted;    /* a recording's failure was said (once a backend) */
};

static inline struct cuda_backend *cuda_of(struct backend *be)
{
    return (struct cuda_backend *)be;
}

/* Record the first failure (later ones are dropped). Returns false when the status says "failed". */
void cuda_record(struct cuda_backend *cb, const char *hint, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
bool cuda_ok_(struct cuda_backend *cb, cudaError_t e, const char *file, int line, const char *what);
bool cublas_ok_(struct cuda_backend *cb, cublasStatus_t s, const char *file, int line, const char *what);
bool cudnn_ok_(struct cuda_backend *cb, cudnnStatus_t s, const char *file, int line, const char *what);
#define CB_CUDA(cb, call) cuda_ok_((cb), (call), __FILE__, __LINE__, #call)
#define CB_CUBLAS(cb, call) cublas_ok_((cb), (call), __FILE__, __LINE__, #call)
#define CB_CUDNN(cb, call) cudnn_ok_((cb), (call), __FILE__, __LINE__, #call)
/* After a kernel launch: a bad configuration is reported here, with the kernel's name. */
#define CB_LAUNCHED(cb, kernel) cuda_ok_((cb), cudaGetLastError(), __FILE__, __LINE__, "launch of " kernel)

/* A slot's device buffer of at least `bytes`; growing never races queued kernels (stream-ordered free where the
 * device has memory pools, else a wait for the stream before the free).
 * NULL with the status set when memory runs out. */
void *cuda_scratch(struct cuda_backend *cb, enum cuda_scratch_slot slot, size_t bytes);

/* Blocks for an n-element grid-stride loop. */
static inline unsigned grid_for(size_t n, unsigned threads = kThreads)
{
    size_t b = (n + threads - 1) / threads;
    if (b > 65535u * 4u)
        b = 65535u * 4u;
    return (unsigned)(b ? b : 1);
}

/* Device code from here to the cross-file entry points: compiled by nvcc only (the host-only translation unit
 * attention_cudnn.cpp includes this header through the host compiler). */
#ifdef __CUDACC__

/* ---- block reductions ---- */

/* The sum of every thread's v over the block, in double, the same value on every thread: a butterfly within each
 * warp, then warp 0's lanes' order over the warps' partials, so the order is fixed by blockDim alone (results do
 * not depend on timing). `shared` holds blockDim.x / 32 doubles; every thread of the block must call it. */
__device__ __forceinline__ double block_sum(double v, double *shared)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads(); /* shared may still be read by the previous call */
    if ((threadIdx.x & 31) == 0)
        shared[threadIdx.x >> 5] = v;
    __syncthreads();
    double s = 0.0;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++)
        s += shared[w];
    return s;
}

/* ---- element access by run-time dtype ---- */

__device__ __forceinline__ float load_elem(const void *p, int dt, size_t i)
{
    switch (dt) {
    case DT_FP16: return __half2float(static_cast<const __half *>(p)[i]);
    case DT_BF16: return __bfloat162float(static_cast<const __nv_bfloat16 *>(p)[i]);
    case DT_FP8_E4M3: return static_cast<float>(static_cast<const __nv_fp8_e4m3 *>(p)[i]);
    case DT_FP8_E5M2: return static_cast<float>(static_cast<const __nv_fp8_e5m2 *>(p)[i]);
    default: return static_cast<const float *>(p)[i];
    }
}

/* fp8 stores saturate (lib/base/dtype.h: Transformer Engine's and torchao's casts), as the CPU's do */
__device__ __forceinline__ void store_elem(void *p, int dt, size_t i, float v)
{
    switch (dt) {
    case DT_FP16: static_cast<__half *>(p)[i] = __float2half_rn(v); break;
    case DT_BF16: static_cast<__nv_bfloat16 *>(p)[i] = __float2bfloat16_rn(v); break;
    case DT_FP8_E4M3:
        static_cast<__nv_fp8_storage_t *>(p)[i] = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
        break;
    case DT_FP8_E5M2:
        static_cast<__nv_fp8_storage_t *>(p)[i] = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E5M2);
        break;
    default: static_cast<float *>(p)[i] = v; break;
    }
}

/* v stored as element i of an optimizer tensor (fp32 or bf16): bf16 to nearest even, or stochastically with
 * the 16 bits of `draw` at `shift` (lib/base/sround.h, the CPU backend's optim_store). Returns the value stored. */
__device__ __forceinline__ float store_rounded(void *p, int dt, size_t i, float v, bool stochastic, uint64_t draw,
                                               int shift);

/* What store_rounded stores, as an fp32 value, without storing it (a trial update checks it). */
__device__ __forceinline__ float value_rounded(int dt, float v, bool stochastic, uint64_t draw, int shift)
{
    if (dt != DT_BF16)
        return v;
    uint16_t h;
    if (stochastic) {
        h = bf16_round_stochastic(v, (uint32_t)(draw >> shift));
    } else {
        __nv_bfloat16 b = __float2bfloat16_rn(v);
        memcpy(&h, &b, sizeof h);
    }
    return __uint_as_float((uint32_t)h << 16);
}

__device__ __forceinline__ float store_rounded(void *p, int dt, size_t i, float v, bool stochastic, uint64_t draw,
                                               int shift)
{
    float r = value_rounded(dt, v, stochastic, draw, shift);
    if (dt != DT_BF16)
        static_cast<float *>(p)[i] = r;
    else
        static_cast<uint16_t *>(p)[i] = (uint16_t)(__float_as_uint(r) >> 16);
    return r;
}

/* v rounded to dt and back (identity for fp32): what storing and reloading gives. */
__device__ __forceinline__ float round_to(float v, int dt)
{
    switch (dt) {
    case DT_FP16: return __half2float(__float2half_rn(v));
    case DT_BF16: return __bfloat162float(__float2bfloat16_rn(v));
    default: return v;
    }
}

#endif /* __CUDACC__ */

/* ---- cross-file entry points ---- */

/* gemm_cublaslt.cu */
struct lt_matmul {
    const void *a, *b; /* row-major operands as in gemm_args, dtype ab_dt */
    void *c;           /* dtype c_dt */
    const float *bias; /* fp32 (n) or NULL */
    void *aux;         /* NULL, or the GELU epilogue (backend.h GEMM_EPI_GELU_TANH): aux (m, n) of c_dt with ld
                        * ldc gets the pre-activation, C its GELU; needs batch 1, beta 0, !trans_a, ldc == n */
    enum dtype ab_dt, c_dt;
    enum dtype b_dt;   /* fp8 ab_dt only: B's format, which may differ from A's (E5M2 x E4M3); else unused */
    const float *a_scale, *b_scale; /* fp8 only: device fp32 factors of A and B (cuBLASLt's scale pointers; NULL
                                     * is 1): D = alpha * a_scale * b_scale * sum + beta * C */
    int32_t a_scale_mode, b_scale_mode; /* fp8 only: how cuBLASLt reads a_scale and b_scale
                                         * (cublasLtMatmulMatrixScale_t): 0, one scalar; recipe blockwise's
                                         * VEC128_32F or BLK128x128_32F, a tensor of scales (fp8.cu) */
    bool trans_a, trans_b;
    int64_t m, n, k, lda, ldb, ldc;
    float alpha, beta;
    int64_t batch, stride_a, stride_b, stride_c;
};
void cuda_lt_matmul(struct cuda_backend *cb, const struct lt_matmul *mm);
/* mm (batch 1, beta 0, a 16-bit C, k > 0) with its bias and GELU (aux) in cuBLASLt's own epilogue, never the
 * fallbacks cuda_lt_matmul takes (a bias or GELU kernel after a rounded product: more roundings). true where it ran
 * or an error was recorded; false, having written nothing that counts, where cuBLASLt offers no kernel for that
 * epilogue or refused it at a plan's first call (the plan remembers: later calls return false at once) or refused
 * a native fp8 product (cuda_backend.fp8_refused), so the caller takes another path. */
bool cuda_lt_matmul_fused(struct cuda_backend *cb, const struct lt_matmul *mm);
/* mm with block-scaled fp8 operands (a_scale_mode, b_scale_mode set; batch 1, no bias, no aux). true where it ran or
 * an error was recorded; false, having written nothing, where cuBLASLt offers no algorithm for it or refused it at
 * a plan's first call (the plan remembers: later calls return false at once), so the caller takes another path. */
bool cuda_lt_matmul_block_scaled(struct cuda_backend *cb, const struct lt_matmul *mm);
void cuda_gemm(struct backend *be, const struct gemm_args *g);
void cuda_gemm_plans_free(struct cuda_backend *cb);
void cuda_attention_forward(struct backend *be, struct tensor *out, struct tensor *probs, const struct tensor *qkv,
                            int64_t B, int64_t T, int64_t C, int64_t H);
void cuda_attention_backward(struct backend *be, struct tensor *dqkv, const struct tensor *dout,
                             const struct tensor *qkv, const struct tensor *probs, int64_t B, int64_t T, int64_t C,
                             int64_t H);

void cuda_attention_decode(struct backend *be, struct tensor *out, struct tensor *cache, const struct tensor *qkv,
                           int64_t pos, int64_t n, int64_t C, int64_t H);

/* fp8.cu: the scaled casts, the delayed recipe's update, and products of fp8 operands (cuda_gemm sends them) */
void cuda_fp8_cast(struct backend *be, const struct fp8_cast_args *a);
void cuda_fp8_update(struct backend *be, const struct fp8_update_args *a);
void cuda_gemm_fp8(struct cuda_backend *cb, const struct gemm_args *g);
/* recipe blockwise: the tile-scaled cast, and (from cuda_gemm_fp8) the product of block-scaled operands */
void cuda_fp8_block_cast(struct backend *be, const struct fp8_block_cast_args *a);

/* conv_cudnn.cu */
void cuda_conv2d_forward(struct backend *be, const struct conv_args *a, struct tensor *y, const struct tensor *x,
                         const struct tensor *w, const struct tensor *bias);
void cuda_conv2d_backward_data(struct backend *be, const struct conv_args *a, struct tensor *dx,
                               const struct tensor *dy, const struct tensor *w);
void cuda_conv2d_backward_filter(struct backend *be, const struct conv_args *a, struct tensor *dw, struct tensor *db,
                                 const struct tensor *dy, const struct tensor *x, float beta);
void cuda_conv_plans_free(struct cuda_backend *cb);

/* elementwise.cu */
void cuda_bias_grad(struct backend *be, struct tensor *db, const struct tensor *dy, int64_t m, int64_t n, float beta);
void cuda_act_forward(struct backend *be, enum act_kind kind, struct tensor *y, const struct tensor *x);
void cuda_act_backward(struct backend *be, enum act_kind kind, struct tensor *dx, const struct tensor *dy,
                       const struct tensor *x);
void cuda_add(struct backend *be, struct tensor *y, const struct tensor *a, const struct tensor *b);
void cuda_dropout_forward(struct backend *be, struct tensor *y, const struct tensor *x, float p, struct rng_key key);
void cuda_dropout_backward(struct backend *be, struct tensor *dx, const struct tensor *dy, float p, struct rng_key key);
void cuda_pool2d_forward(struct backend *be, const struct pool_args *a, struct tensor *y, const struct tensor *x);
void cuda_pool2d_backward(struct backend *be, const struct pool_args *a, struct tensor *dx, const struct tensor *dy,
                          const struct tensor *x, const struct tensor *y);
void cuda_embedding_forward(struct backend *be, struct tensor *y, const int32_t *tokens, const struct tensor *wte,
                            const struct tensor *wpe, int64_t B, int64_t T, int64_t C);
void cuda_embedding_backward(struct backend *be, struct tensor *dwte, struct tensor *dwpe, const struct tensor *dy,
                             const int32_t *tokens, int64_t B, int64_t T, int64_t C, float beta);
/* y (batch, rows, n) of dtype dt, batch matrices `stride` elements apart, gets the fp32 bias (n) added to
 * every row in place (one extra rounding for 16-bit y): the GEMM's fallback when the epilogue is refused. */
void cuda_add_row_bias(struct cuda_backend *cb, void *y, enum dtype dt, const float *bias, int64_t rows, int64_t n,
                       int64_t batch, int64_t stride);
/* y (N, C, HW) of dtype dt gets bias[c] added in place. */
void cuda_add_channel_bias(struct cuda_backend *cb, void *y, enum dtype dt, const float *bias, int64_t N, int64_t C,
                           int64_t HW);
/* db (C) fp32 = beta * db + sum over n, hw of dy (N, C, HW): double partials over many blocks, fixed order
 * (deterministic; norm.cu, with batchnorm's channel sums). */
void cuda_channel_sums(struct cuda_backend *cb, float *db, const void *dy, enum dtype dt, int64_t N, int64_t C,
                       int64_t HW, float beta);

/* norm.cu (also cuda_channel_sums above) */
void cuda_layernorm_forward(struct backend *be, const struct norm_args *a, struct tensor *y, struct tensor *mean,
                            struct tensor *rstd, const struct tensor *x, const struct tensor *gamma,
                            const struct tensor *beta);
void cuda_layernorm_backward(struct backend *be, const struct norm_args *a, struct tensor *dx, struct tensor *dgamma,
                             struct tensor *dbeta, const struct tensor *dy, const struct tensor *x,
                             const struct tensor *mean, const struct tensor *rstd, const struct tensor *gamma,
                             float beta_acc);
void cuda_batchnorm_forward(struct backend *be, const struct norm_args *a, struct tensor *y, struct tensor *mean,
                            struct tensor *rstd, struct tensor *running_mean, struct tensor *running_var,
                            const struct tensor *x, const struct tensor *gamma, const struct tensor *beta);
void cuda_batchnorm_backward(struct backend *be, const struct norm_args *a, struct tensor *dx, struct tensor *dgamma,
                             struct tensor *dbeta, const struct tensor *dy, const struct tensor *x,
                             const struct tensor *y, const struct tensor *mean, const struct tensor *rstd,
                             const struct tensor *gamma, float beta_acc);

/* graphs.cu: the CUDA Graphs entries (installed unless AMPTRAIN_CUDA_GRAPHS=0), their teardown, and window_store */
void cuda_graphs_install(struct cuda_backend *cb);
void cuda_graphs_free(struct cuda_backend *cb);
void cuda_window_store(struct backend *be, const struct window_store_args *a);

/* loss_optim.cu */
void cuda_xent_forward_backward(struct backend *be, struct tensor *losses, int32_t *correct, struct tensor *dlogits,
                                const struct tensor *logits, const int32_t *labels, int64_t N, int64_t K,
                                const float *grad_seed);
void cuda_mse_forward_backward(struct backend *be, struct tensor *losses, struct tensor *dy, const struct tensor *y,
                               const struct tensor *target, int64_t N, int64_t K, const float *grad_seed);
void cuda_loss_sum(struct backend *be, double *acc, const struct tensor *losses, int64_t n, bool accumulate);
void cuda_grad_stats(struct backend *be, const struct tensor *const *grads, int ntensors, struct grad_check *out,
                     int64_t *counts);
void cuda_grad_stats_parts(struct backend *be, const struct tensor *const *grads, int ntensors,
                           struct grad_part *out);
void cuda_grad_stats_combine(struct backend *be, const struct grad_part *parts, const int64_t *first,
                             const int64_t *at, int ntensors, struct grad_check *out, int64_t *counts);
void cuda_step_propose(struct backend *be, const struct step_params *p, struct step_state *state,
                       struct grad_check *check);
void cuda_step_finish(struct backend *be, const struct step_params *p, struct step_state *state,
                      const struct grad_check *check, struct step_row *row);
void cuda_count_zeros(struct backend *be, const struct tensor *t, int64_t *acc);
void cuda_adamw_update(struct backend *be, const struct optim_update_args *a, int n);
void cuda_sgd_update(struct backend *be, const struct optim_update_args *a, int n);

#endif
