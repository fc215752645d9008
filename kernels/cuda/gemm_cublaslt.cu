/*
 * gemm_cublaslt.cu — matrix products through cuBLASLt, and causal attention built on them.
 *
 * Row-major to column-major: a row-major (r, c) matrix with leading dimension ld is, to cuBLASLt, a
 * column-major (c, r) matrix with the same ld. So C = op(A) op(B) (row-major, m x n) is computed as
 * C^T = op(B)^T op(A)^T: cuBLASLt's "A" is our B, its "B" is our A, its m is our n and its n our m.
 * Inputs fp32 (compute CUBLAS_COMPUTE_32F, or 32F_FAST_TF32 when the backend's tf32 flag is set) or
 * fp16/bf16 (compute 32F: FP32 accumulation on tensor cores); output fp32 or the inputs' dtype, rounded
 * once after alpha, beta and the bias (CUBLASLT_EPILOGUE_BIAS with an fp32 bias vector). Should a
 * cuBLASLt build offer no kernel for an fp32 bias on a 16-bit output, the plan falls back to a plain
 * product plus a bias kernel (one extra rounding) rather than failing.
 *
 * GELU epilogue (backend.h GEMM_EPI_GELU_TANH, lt_matmul.aux): CUBLASLT_EPILOGUE_GELU_AUX_BIAS (GELU_AUX
 * without a bias) writes pre = alpha A B + bias to aux and GELU(pre) to C, both from the fp32 value, each
 * rounded once. aux has C's layout (CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD = ldc) and, with
 * CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE left unset, C's dtype (cublasLt.h: the default). cublasLt.h
 * asks for an aux leading dimension divisible by 8, and the heuristic infers the aux alignment from the
 * pointer's value, so the building call's aux pointer is set before it is asked; the fused path is taken
 * only for a 16-bit C, ldc % 8 == 0, a 16-byte-aligned aux and k > 0. cuBLASLt's documentation says
 * only "GELU"; NVIDIA's nvmath-python tests model its epilogue with the tanh form, the one backend.h asks
 * for, but whether it is computed exactly or with a fast tanh (~1e-4) is not said: invisible under a
 * 16-bit rounding, not in fp32, so an fp32 C takes the exact path below (an fp32 product costs far more
 * than the extra pass). Otherwise (fp32, shape, alignment, or a heuristic with no kernel for the epilogue,
 * or cublasLtMatmul refusing it at the first call: refusals the plan remembers) the product
 * with the bias goes into aux, rounded to its dtype, and elementwise.cu's GELU kernel maps aux into C:
 * GELU of the rounded pre-activation, so a 16-bit C is rounded twice (three times where the bias
 * fallback applies as well). cuda_lt_matmul_fused takes neither fallback: where cuBLASLt has no kernel for the
 * epilogue, or refuses it, it says so and the caller takes its own path (fp8.cu: an fp8 product's bf16 C, which
 * must be rounded once). cuda_lt_matmul_block_scaled likewise (recipe blockwise: fp8 operands with a tensor of
 * scales each, CUBLASLT_MATMUL_DESC_A_SCALE_MODE / B_SCALE_MODE): where the heuristic offers no algorithm, or the
 * first call refuses it, the plan remembers and the caller runs its plain kernels.
 *
 * Plans: the matmul descriptor, the three layouts and the heuristic's algorithm are built once per
 * shape key (transposes, m, n, k, leading dimensions, batch and strides, dtypes, bias, epilogue,
 * alignment of every operand and of the bias, tf32, fp8 scale modes) and kept in a most-recently-used list until destroy;
 * a call only sets the bias and aux pointers. While the heuristic chooses, the descriptor holds the first
 * call's bias and aux pointers (struct plan_probes), so it sees their real alignment: a bias that is a
 * view into a larger buffer gets a kernel legal for it, and another alignment gets another plan.
 *
 * Alignment rule: every operand pointer and every batch stride (in bytes) must be a multiple of the
 * element size (else the call records an error and computes nothing). 16-byte alignment of pointers and
 * byte strides is the fast path (cudaMalloc gives 256; layer scratch offsets are 256-aligned): the
 * alignment actually present (2, 4, 8 or 16) is part of the plan key and is passed to the heuristic
 * (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*), so a less-aligned view gets a kernel that is legal for it.
 *
 * Attention (per backend.h and the CPU reference): heads are split from qkv (B, T, 3C) into contiguous
 * (B*H, T, D) buffers, the products are strided-batched GEMMs over B*H, the causal softmax and its
 * backward are fp32 kernels (one block per row, sums in double as on the CPU), and the results are
 * merged back. Buffers live in the backend's attention scratch slots.
 */
#include "backend_cuda_internal.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "convert.h" /* cuda_convert */

/* ---- plans ------------------------------------------------------------------------------------- */

struct gemm_key {
    int32_t trans_a, trans_b, ab_dt, b_dt, c_dt, has_bias, tf32, scaled;
    int32_t align_a, align_b, align_c;
    int32_t align_bias;  /* the bias's alignment (0: no bias): the heuristic reads it from the probe pointer */
    int32_t epilogue; /* enum gemm_epilogue */
    int32_t a_scale_mode, b_scale_mode; /* fp8: cublasLtMatmulMatrixScale_t of our A and B (0: a scalar) */
    int64_t m, n, k, lda, ldb, ldc, batch, stride_a, stride_b, stride_c;
};

struct gemm_plan {
    struct gemm_key key;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t lay_a, lay_b, lay_c; /* cuBLASLt's A (our B), B (our A), C = D */
    cublasLtMatmulAlgo_t algo;
    bool bias_by_kernel; /* the epilogue was refused: bias added by cuda_add_row_bias */
    bool gelu_by_kernel; /* the GELU epilogue was refused: no algorithm, the call falls back (lt_matmul_gelu) */
    bool ran;            /* cublasLtMatmul has accepted this plan once */
    bool refused;        /* block-scaled fp8: the heuristic offered no algorithm, or a call refused it */
    struct gemm_plan *next;
};

constexpr int kMaxPlans = 1024;

static cudaDataType_t cuda_type(enum dtype dt)
{
    switch (dt) {
    case DT_FP16: return CUDA_R_16F;
    case DT_BF16: return CUDA_R_16BF;
    case DT_FP8_E4M3: return CUDA_R_8F_E4M3;
    case DT_FP8_E5M2: return CUDA_R_8F_E5M2;
    default: return CUDA_R_32F;
    }
}

static void plan_destroy(struct gemm_plan *p)
{
    if (p->lay_a)
        cublasLtMatrixLayoutDestroy(p->lay_a);
    if (p->lay_b)
        cublasLtMatrixLayoutDestroy(p->lay_b);
    if (p->lay_c)
        cublasLtMatrixLayoutDestroy(p->lay_c);
    if (p->desc)
        cublasLtMatmulDescDestroy(p->desc);
    free(p);
}

void cuda_gemm_plans_free(struct cuda_backend *cb)
{
    struct gemm_plan *p = cb->gemm_plans;
    while (p) {
        struct gemm_plan *next = p->next;
        plan_destroy(p);
        p = next;
    }
    cb->gemm_plans = NULL;
    cb->n_gemm_plans = 0;
}

static bool layout_create(struct cuda_backend *cb, cublasLtMatrixLayout_t *lay, enum dtype dt, int64_t rows,
                          int64_t cols, int64_t ld, int64_t batch, int64_t stride)
{
    if (!CB_CUBLAS(cb, cublasLtMatrixLayoutCreate(lay, cuda_type(dt), (uint64_t)rows, (uint64_t)cols, ld)))
        return false;
    if (batch > 1) {
        int32_t count = (int32_t)batch;
        if (!CB_CUBLAS(cb, cublasLtMatrixLayoutSetAttribute(*lay, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                                            sizeof count)) ||
            !CB_CUBLAS(cb, cublasLtMatrixLayoutSetAttribute(*lay, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                            sizeof stride)))
            return false;
    }
    return true;
}

/* Ask the heuristic for the best algorithm of `p` (epilogue as set in its descriptor). `soft`: any
 * refusal of the heuristic means "none found" (trying the fused bias), not an error. */
static bool plan_pick_algo(struct cuda_backend *cb, struct gemm_plan *p, bool soft, bool *found)
{
    cublasLtMatmulPreference_t pref = NULL;
    *found = false;
    if (!CB_CUBLAS(cb, cublasLtMatmulPreferenceCreate(&pref)))
        return false;
    uint64_t ws = kLtWorkspaceBytes;
    uint32_t al_a = (uint32_t)p->key.align_b, al_b = (uint32_t)p->key.align_a, al_c = (uint32_t)p->key.align_c;
    bool ok = CB_CUBLAS(cb, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                                 sizeof ws)) &&
              CB_CUBLAS(cb, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                                 &al_a, sizeof al_a)) &&
              CB_CUBLAS(cb, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                                 &al_b, sizeof al_b)) &&
              CB_CUBLAS(cb, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                                 &al_c, sizeof al_c)) &&
              CB_CUBLAS(cb, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                                 &al_c, sizeof al_c));
    if (ok) {
        cublasLtMatmulHeuristicResult_t res;
        int nres = 0;
        cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(cb->lt, p->desc, p->lay_a, p->lay_b, p->lay_c, p->lay_c,
                                                          pref, 1, &res, &nres);
        if (s == CUBLAS_STATUS_SUCCESS && nres > 0) {
            p->algo = res.algo;
            *found = true;
        } else if (s != CUBLAS_STATUS_SUCCESS && s != CUBLAS_STATUS_NOT_SUPPORTED && !soft) {
            ok = CB_CUBLAS(cb, s);
        }
    }
    cublasLtMatmulPreferenceDestroy(pref);
    return ok;
}

/* Pointers with the alignment the plan's calls will have, set on the descriptor while the heuristic
 * chooses (it reads their alignment; a NULL one says nothing, and a kernel chosen for one alignment may
 * be wrong for another, so the alignments are in the plan key). */
struct plan_probes {
    void *aux;        /* GELU epilogue: the call's aux */
    const void *bias; /* the call's bias, or NULL */
    const float *a_scale, *b_scale; /* fp8: the call's scale factors of our A and B, set while the heuristic
                                     * chooses as PyTorch's scaled_gemm does (the H200's refusal of the native
                                     * products, plan_refused, came with them set as without) */
};

static bool plan_set_bias_probe(struct cuda_backend *cb, struct gemm_plan *p, const void *bias)
{
    return !p->key.has_bias ||
           CB_CUBLAS(cb, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
}

/* p's descriptor back to the default epilogue, no bias pointer and the bias type D's own (what the header gives
 * as the rule, cublasLt.h CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE), for the separate bias kernel: an fp32 bias type left
 * on a 16-bit D is what cuBLASLt refused, and nothing promises that the default epilogue ignores it. */
static bool plan_unfuse_bias(struct cuda_backend *cb, struct gemm_plan *p)
{
    cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_DEFAULT;
    int32_t bias_type = (int32_t)cuda_type((enum dtype)p->key.c_dt);
    const void *none = NULL;
    p->bias_by_kernel = true;
    return CB_CUBLAS(cb, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi)) &&
           CB_CUBLAS(cb, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                                        sizeof bias_type)) &&
           CB_CUBLAS(cb, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &none,
                                                        sizeof none));
}

/* The GELU epilogue on p's descriptor (see the top of the file). */
static bool plan_set_gelu(struct cuda_backend *cb, struct gemm_plan *p, void *aux_probe)
{
    cublasLtEpilogue_t epi = p->key.has_bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    int64_t aux_ld = p->key.ldc;
    int32_t bias_type = CUDA_R_32F;
    return CB_CUBLAS(cb, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi)) &&
           CB_CUBLAS(cb, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld,
                                                        sizeof aux_ld)) &&
           CB_CUBLAS(cb, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux_probe,
                                                        sizeof aux_probe)) &&
           (!p->key.has_bias ||
            CB_CUBLAS(cb, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                                         sizeof bias_type)));
}

static struct gemm_plan *plan_build(struct cuda_backend *cb, const struct gemm_key *key, const struct plan_probes *probe)
{
    struct gemm_plan *p = static_cast<struct gemm_plan *>(calloc(1, sizeof *p));
    if (!p) {
        cuda_record(cb, "free some host memory", "out of memory building a cuBLASLt plan");
        return NULL;
    }
    p->key = *key;
    enum dtype ab = (enum dtype)key->ab_dt, c = (enum dtype)key->c_dt;
    cublasComputeType_t compute =
        ab == DT_FP32 && key->tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    cublasOperation_t op_a = key->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N; /* cuBLASLt's A is our B */
    cublasOperation_t op_b = key->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    bool ok = CB_CUBLAS(cb, cublasLtMatmulDescCreate(&p->desc, compute, CUDA_R_32F)) &&
              CB_CUBLAS(cb, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a)) &&
              CB_CUBLAS(cb, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b)) &&
              layout_create(cb, &p->lay_a, (enum dtype)key->b_dt, key->trans_b ? key->k : key->n,
                            key->trans_b ? key->n : key->k,
                            key->ldb, key->batch, key->stride_b) &&
              layout_create(cb, &p->lay_b, ab, key->trans_a ? key->m : key->k, key->trans_a ? key->k : key->m,
                            key->lda, key->batch, key->stride_a) &&
              layout_create(cb, &p->lay_c, c, key->n, key->m, key->ldc, key->batch, key->stride_c);
    /* fp8: cuBLASLt's A is our B, so its A scale is our B's (as plan_run sets them at every call), and so is its
     * scale mode (recipe blockwise: a tensor of scales, fp8.cu) */
    if (ok && key->scaled)
        ok = CB_CUBLAS(cb, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &probe->b_scale,
                                                          sizeof probe->b_scale)) &&
             CB_CUBLAS(cb, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &probe->a_scale,
                                                          sizeof probe->a_scale));
    const bool blocks = key->a_scale_mode != 0 || key->b_scale_mode != 0;
    if (ok && blocks)
        ok = CB_CUBLAS(cb, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &key->b_scale_mode,
                                                          sizeof key->b_scale_mode)) &&
             CB_CUBLAS(cb, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &key->a_scale_mode,
                                                          sizeof key->a_scale_mode));
    bool found = false;
    if (ok && key->epilogue == GEMM_EPI_GELU_TANH) {
        ok = plan_set_gelu(cb, p, probe->aux) && plan_set_bias_probe(cb, p, probe->bias) &&
             plan_pick_algo(cb, p, true, &found);
        if (ok && !found) { /* kept, so the heuristic is asked once; the caller falls back */
            p->gelu_by_kernel = true;
            return p;
        }
    } else if (ok && key->has_bias) {
        cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
        int32_t bias_type = CUDA_R_32F;
        ok = CB_CUBLAS(cb, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi)) &&
             CB_CUBLAS(cb, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                                          sizeof bias_type)) &&
             plan_set_bias_probe(cb, p, probe->bias);
        if (ok)
            ok = plan_pick_algo(cb, p, true, &found);
        if (ok && !found && key->scaled) { /* fp8 (cuda_lt_matmul_fused): kept, so the heuristic is asked once; the
                                            * caller takes its own path, never this plan */
            p->bias_by_kernel = true;
            return p;
        }
        if (ok && !found) /* no fused-bias kernel for this combination: a separate bias kernel */
            ok = plan_unfuse_bias(cb, p);
    }
    if (ok && !found) /* block-scaled: any refusal of the heuristic is "none found" */
        ok = plan_pick_algo(cb, p, blocks, &found);
    if (ok && !found && blocks) { /* kept, so the heuristic is asked once; the caller takes its plain kernels */
        p->refused = true;
        return p;
    }
    if (ok && !found) {
        cuda_record(cb, "report this shape; meanwhile try another precision mode",
                    "cuBLASLt has no algorithm for a %s x %s -> %s product m=%lld n=%lld k=%lld (batch %lld, "
                    "alignment %d/%d/%d bytes)",
                    dtype_name(ab), dtype_name((enum dtype)key->b_dt), dtype_name(c), (long long)key->m, (long long)key->n,
                    (long long)key->k, (long long)key->batch, key->align_a, key->align_b, key->align_c);
        ok = false;
    }
    if (!ok) {
        plan_destroy(p);
        return NULL;
    }
    return p;
}

/* The plan for `key`, moved to the front of the list; built on first use with the call's pointers as probes. */
static struct gemm_plan *plan_get(struct cuda_backend *cb, const struct gemm_key *key, const struct plan_probes *probe)
{
    struct gemm_plan **link = &cb->gemm_plans;
    for (struct gemm_plan *p = cb->gemm_plans; p; link = &p->next, p = p->next)
        if (memcmp(&p->key, key, sizeof *key) == 0) {
            *link = p->next;
            p->next = cb->gemm_plans;
            cb->gemm_plans = p;
            return p;
        }
    struct gemm_plan *p = plan_build(cb, key, probe);
    if (!p)
        return NULL;
    p->next = cb->gemm_plans;
    cb->gemm_plans = p;
    if (++cb->n_gemm_plans > kMaxPlans) { /* drop the least recently used */
        struct gemm_plan *q = cb->gemm_plans;
        while (q->next && q->next->next)
            q = q->next;
        if (q->next) {
            plan_destroy(q->next);
            q->next = NULL;
            cb->n_gemm_plans--;
        }
    }
    return p;
}

/* Largest power of two <= 16 dividing the pointer and the batch stride in bytes. */
static int alignment_of(const void *p, int64_t stride_bytes, int64_t batch)
{
    uintptr_t bits = (uintptr_t)p | (uintptr_t)(batch > 1 ? stride_bytes : 0) | 16u;
    return (int)(bits & (~bits + 1));
}

__global__ void scale_rows_kernel(void *c, int dt, int64_t m, int64_t n, int64_t ldc, float beta)
{
    int64_t total = m * n;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = i / n, j = i % n;
        size_t at = (size_t)(r * ldc + j);
        store_elem(c, dt, at, beta == 0.0f ? 0.0f : beta * load_elem(c, dt, at));
    }
}

/* The plan key of `mm` with `epilogue`; false (the error recorded) where no plan may be built. */
static bool key_of(struct cuda_backend *cb, const struct lt_matmul *mm, enum gemm_epilogue epilogue,
                   struct gemm_key *key)
{
    size_t es_ab = dtype_size(mm->ab_dt), es_c = dtype_size(mm->c_dt); /* fp8 pairs: both 1 byte */
    memset(key, 0, sizeof *key); /* padding included: keys are compared with memcmp */
    key->trans_a = mm->trans_a;
    key->trans_b = mm->trans_b;
    key->ab_dt = mm->ab_dt;
    key->b_dt = dtype_is_fp8(mm->ab_dt) ? mm->b_dt : mm->ab_dt;
    key->scaled = mm->a_scale || mm->b_scale;
    key->c_dt = mm->c_dt;
    key->has_bias = mm->bias != NULL;
    key->tf32 = cb->base.allow_tf32 && mm->ab_dt == DT_FP32;
    key->align_a = alignment_of(mm->a, mm->stride_a * (int64_t)es_ab, mm->batch);
    key->align_b = alignment_of(mm->b, mm->stride_b * (int64_t)es_ab, mm->batch);
    key->align_c = alignment_of(mm->c, mm->stride_c * (int64_t)es_c, mm->batch);
    key->align_bias = mm->bias ? alignment_of(mm->bias, 0, 1) : 0;
    key->epilogue = epilogue;
    key->a_scale_mode = mm->a_scale_mode;
    key->b_scale_mode = mm->b_scale_mode;
    key->m = mm->m;
    key->n = mm->n;
    key->k = mm->k;
    key->lda = mm->lda;
    key->ldb = mm->ldb;
    key->ldc = mm->ldc;
    key->batch = mm->batch;
    key->stride_a = mm->batch > 1 ? mm->stride_a : 0;
    key->stride_b = mm->batch > 1 ? mm->stride_b : 0;
    key->stride_c = mm->batch > 1 ? mm->stride_c : 0;
    if (key->align_a < (int)es_ab || key->align_b < (int)es_ab || key->align_c < (int)es_c) {
        cuda_record(cb, "operands must be aligned to their element size (16 bytes for the fast path); this is a bug "
                    "in the caller's tensor views",
                    "gemm m=%lld n=%lld k=%lld: misaligned operand (A %p, B %p, C %p; alignment %d/%d/%d bytes)",
                    (long long)mm->m, (long long)mm->n, (long long)mm->k, mm->a, mm->b, mm->c, key->align_a,
                    key->align_b, key->align_c);
        return false;
    }
    if (mm->batch > INT32_MAX) {
        cuda_record(cb, "this is a bug in the caller", "gemm batch %lld exceeds cuBLASLt's int32 batch count",
                    (long long)mm->batch);
        return false;
    }
    return true;
}

/* One cuBLASLt call of plan p on mm's operands (the bias added by a kernel where p says so). */
/* A fused epilogue (bias, GELU) that cublasLtMatmul itself refuses at a plan's first call, though the
 * heuristic offered an algorithm for it: cuBLASLt documents the bias as D's type (fp32 with a 16-bit D is
 * not in its list), so this may happen. The plan then drops the epilogue as if the heuristic had refused
 * it: the bias goes to cuda_add_row_bias (the plan's algorithm asked again without the epilogue), the
 * GELU to lt_matmul_gelu's fallback. false: the caller must take the unfused path (GELU). */
static bool plan_refused(struct cuda_backend *cb, struct gemm_plan *p, cublasStatus_t st)
{
    const bool fused = p->key.epilogue == GEMM_EPI_GELU_TANH || (p->key.has_bias && !p->bias_by_kernel);
    if ((p->key.a_scale_mode != 0 || p->key.b_scale_mode != 0) && !p->ran &&
        (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE)) {
        /* a block-scaled product the heuristic offered and the call refused: the plan remembers, and
         * cuda_lt_matmul_block_scaled's caller runs its plain kernels (fp8.cu says so once) */
        p->refused = true;
        return true;
    }
    if (p->key.scaled && fused && !p->ran && (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE)) {
        /* a native fp8 product with its epilogue (cuda_lt_matmul_fused: only it asks for one) refused: the plan
         * remembers, and the caller takes its fp32 scratch, whose plain product is asked for on its own (a refusal
         * of that one is the fp8 refusal below) */
        if (p->key.epilogue == GEMM_EPI_GELU_TANH)
            p->gelu_by_kernel = true;
        else
            p->bias_by_kernel = true;
        return true;
    }
    if (p->key.scaled && !p->ran && (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE)) {
        /* a native fp8 product the heuristic offered and the call refused: cuda_gemm_fp8 sees the flag and
         * emulates it in bf16 (the same values), as it does on GPUs without fp8 products */
        if (!cb->fp8_refused)
            fprintf(stderr, "ampTrain: warning: %s: cuBLASLt refused a native fp8 product (m=%lld n=%lld k=%lld, %s): fp8 "
                            "products are emulated in bf16 with FP32 accumulation from here on, the same values, "
                            "without fp8's speed (CUBLASLT_LOG_MASK=15 logs what cuBLASLt was asked)\n",
                    cb->name, (long long)p->key.m, (long long)p->key.n, (long long)p->key.k, cublasGetStatusName(st));
        cb->fp8_refused = true;
        return true;
    }
    if (p->ran || !fused || (st != CUBLAS_STATUS_NOT_SUPPORTED && st != CUBLAS_STATUS_INVALID_VALUE))
        return false;
    if (p->key.epilogue == GEMM_EPI_GELU_TANH) {
        p->gelu_by_kernel = true;
        return true;
    }
    bool found = false;
    return plan_unfuse_bias(cb, p) && plan_pick_algo(cb, p, false, &found) && found;
}

static void plan_run(struct cuda_backend *cb, struct gemm_plan *p, const struct lt_matmul *mm)
{
    if (mm->bias && !p->bias_by_kernel &&
        !CB_CUBLAS(cb, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &mm->bias,
                                                      sizeof mm->bias)))
        return;
    if (mm->aux &&
        !CB_CUBLAS(cb, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &mm->aux,
                                                      sizeof mm->aux)))
        return;
    /* fp8: cuBLASLt's A is our B, so its A scale is our B's */
    if (p->key.scaled &&
        (!CB_CUBLAS(cb, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &mm->b_scale,
                                                       sizeof mm->b_scale)) ||
         !CB_CUBLAS(cb, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &mm->a_scale,
                                                       sizeof mm->a_scale))))
        return;
    /* cuBLASLt's A is our B, its B our A; beta 0 never reads C (cuBLAS semantics) */
    cublasStatus_t st = cublasLtMatmul(cb->lt, p->desc, &mm->alpha, mm->b, p->lay_a, mm->a, p->lay_b, &mm->beta, mm->c,
                                       p->lay_c, mm->c, p->lay_c, &p->algo, cb->lt_workspace, kLtWorkspaceBytes,
                                       cb->stream);
    if (st != CUBLAS_STATUS_SUCCESS && plan_refused(cb, p, st)) {
        if (p->gelu_by_kernel || p->key.scaled)
            return; /* lt_matmul_gelu or cuda_gemm_fp8 sees the flag and runs its fallback */
        plan_run(cb, p, mm); /* now without the bias epilogue: once, since bias_by_kernel is set */
        return;
    }
    if (!cublas_ok_(cb, st, __FILE__, __LINE__, "cublasLtMatmul"))
        return;
    p->ran = true;
    if (mm->bias && p->bias_by_kernel)
        cuda_add_row_bias(cb, mm->c, mm->c_dt, mm->bias, mm->m, mm->n, mm->batch, mm->stride_c);
}

/* A contiguous 1-D tensor over n elements of backend memory, for the elementwise entry points. */
static struct tensor flat_tensor(struct cuda_backend *cb, void *data, enum dtype dt, int64_t n)
{
    struct tensor t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.dtype = dt;
    t.ndim = 1;
    for (int d = 0; d < TENSOR_MAX_DIMS; d++)
        t.shape[d] = d == 0 ? n : 1;
    t.numel = (size_t)n;
    t.be = &cb->base;
    return t;
}

/* The GELU epilogue (mm->aux set): fused where cuBLASLt allows it, else the fallback described at the top
 * of the file. */
static void lt_matmul_gelu(struct cuda_backend *cb, const struct lt_matmul *mm)
{
    if (mm->batch != 1 || mm->beta != 0.0f || mm->trans_a || mm->ldc != mm->n) {
        cuda_record(cb, "this is a bug in the caller",
                    "gemm with the GELU epilogue needs batch 1, beta 0, !trans_a and ldc == n (batch %lld, beta %g, "
                    "trans_a %d, ldc %lld, n %lld)",
                    (long long)mm->batch, (double)mm->beta, (int)mm->trans_a, (long long)mm->ldc, (long long)mm->n);
        return;
    }
    int align_aux = alignment_of(mm->aux, 0, 1), align_c = alignment_of(mm->c, 0, 1);
    if (align_aux < (int)dtype_size(mm->c_dt) || align_c < (int)dtype_size(mm->c_dt)) { /* before anything runs */
        cuda_record(cb, "operands must be aligned to their element size; this is a bug in the caller's tensor views",
                    "gemm m=%lld n=%lld k=%lld with the GELU epilogue: misaligned C %p or aux %p (alignment %d/%d "
                    "bytes)",
                    (long long)mm->m, (long long)mm->n, (long long)mm->k, mm->c, mm->aux, align_c, align_aux);
        return;
    }
    /* fused for 16-bit outputs only: cuBLASLt does not say how it computes GELU (a fast tanh would be
     * ~1e-4 off, invisible under a 16-bit rounding but not in fp32, where the product is the cost anyway) */
    bool fusable = mm->c_dt != DT_FP32 && mm->k > 0 && mm->ldc % 8 == 0 && align_aux >= 16;
    if (fusable) {
        struct gemm_key key;
        if (!key_of(cb, mm, GEMM_EPI_GELU_TANH, &key))
            return;
        struct plan_probes probe = {.aux = mm->aux, .bias = mm->bias, .a_scale = NULL, .b_scale = NULL};
        struct gemm_plan *p = plan_get(cb, &key, &probe);
        if (!p)
            return;
        if (!p->gelu_by_kernel) {
            plan_run(cb, p, mm);
            if (!p->gelu_by_kernel) /* (plan_run sets it when cuBLASLt refuses the epilogue at the call) */
                return;
        }
    }
    struct lt_matmul pre = *mm; /* the product with the bias into aux ... */
    pre.c = mm->aux;
    pre.aux = NULL;
    cuda_lt_matmul(cb, &pre);
    struct tensor x = flat_tensor(cb, mm->aux, mm->c_dt, mm->m * mm->n); /* ... then C = GELU(aux) */
    struct tensor y = flat_tensor(cb, mm->c, mm->c_dt, mm->m * mm->n);
    cuda_act_forward(&cb->base, ACT_GELU_TANH, &y, &x);
}

void cuda_lt_matmul(struct cuda_backend *cb, const struct lt_matmul *mm)
{
    if (mm->m <= 0 || mm->n <= 0 || mm->batch <= 0)
        return;
    if (mm->aux) {
        lt_matmul_gelu(cb, mm);
        return;
    }
    if (mm->k == 0) { /* C = beta * C (+ bias), batch by batch, as the CPU does */
        for (int64_t i = 0; i < mm->batch; i++) {
            char *c = (char *)mm->c + (size_t)(i * mm->stride_c) * dtype_size(mm->c_dt);
            scale_rows_kernel<<<grid_for((size_t)(mm->m * mm->n)), kThreads, 0, cb->stream>>>(c, mm->c_dt, mm->m, mm->n,
                                                                                              mm->ldc, mm->beta);
        }
        CB_LAUNCHED(cb, "scale_rows_kernel");
        if (mm->bias)
            cuda_add_row_bias(cb, mm->c, mm->c_dt, mm->bias, mm->m, mm->n, mm->batch, mm->stride_c);
        return;
    }
    struct gemm_key key;
    if (!key_of(cb, mm, GEMM_EPI_NONE, &key))
        return;
    struct plan_probes probe = {.aux = NULL, .bias = mm->bias, .a_scale = mm->a_scale, .b_scale = mm->b_scale};
    struct gemm_plan *p = plan_get(cb, &key, &probe);
    if (p)
        plan_run(cb, p, mm);
}

bool cuda_lt_matmul_fused(struct cuda_backend *cb, const struct lt_matmul *mm)
{
    const bool gelu = mm->aux != NULL;
    if (mm->m <= 0 || mm->n <= 0 || mm->k <= 0 || mm->batch != 1 || mm->beta != 0.0f || mm->c_dt == DT_FP32 ||
        mm->ldc != mm->n || (gelu && (mm->trans_a || mm->ldc % 8 != 0 || alignment_of(mm->aux, 0, 1) < 16)))
        return false;
    struct gemm_key key;
    if (!key_of(cb, mm, gelu ? GEMM_EPI_GELU_TANH : GEMM_EPI_NONE, &key))
        return true;
    struct plan_probes probe = {.aux = mm->aux, .bias = mm->bias, .a_scale = mm->a_scale, .b_scale = mm->b_scale};
    struct gemm_plan *p = plan_get(cb, &key, &probe);
    if (!p)
        return true;
    if (p->gelu_by_kernel || p->bias_by_kernel) /* the heuristic had no kernel with the epilogue, or a call refused it */
        return false;
    plan_run(cb, p, mm);
    if (cb->status != AMP_OK) /* an error, not a refusal: the caller takes no other path */
        return true;
    return !(p->gelu_by_kernel || p->bias_by_kernel || (key.scaled && !p->ran));
}

bool cuda_lt_matmul_block_scaled(struct cuda_backend *cb, const struct lt_matmul *mm)
{
    if (mm->m <= 0 || mm->n <= 0 || mm->k <= 0 || mm->batch != 1 || mm->bias || mm->aux ||
        (mm->a_scale_mode == 0 && mm->b_scale_mode == 0))
        return false;
    struct gemm_key key;
    if (!key_of(cb, mm, GEMM_EPI_NONE, &key))
        return true;
    struct plan_probes probe = {.aux = NULL, .bias = NULL, .a_scale = mm->a_scale, .b_scale = mm->b_scale};
    struct gemm_plan *p = plan_get(cb, &key, &probe);
    if (!p)
        return true;
    if (p->refused)
        return false;
    plan_run(cb, p, mm);
    return !p->refused;
}

/* The GELU epilogue's preconditions (backend.h) that only the tensors show. */
static bool gelu_args_ok(struct cuda_backend *cb, const struct gemm_args *g)
{
    if (g->epilogue == GEMM_EPI_NONE)
        return true;
    if (g->epilogue != GEMM_EPI_GELU_TANH) {
        cuda_record(cb, "this is a bug in the caller (see enum gemm_epilogue in lib/base/backend.h)",
                    "gemm: unknown epilogue %d", (int)g->epilogue);
        return false;
    }
    if (g->beta == 0.0f && g->batch == 1 && !g->trans_a && g->aux && g->aux->dtype == g->c->dtype &&
        (int64_t)g->aux->numel == g->m * g->n)
        return true;
    cuda_record(cb, "this is a bug in the caller (see GEMM_EPI_GELU_TANH in lib/base/backend.h)",
                "gemm: the GELU epilogue needs beta 0, batch 1, !trans_a and aux (m, n) of C's dtype (beta %g, "
                "batch %lld, trans_a %d, m %lld, n %lld, aux %s of %zu elements, C %s)",
                (double)g->beta, (long long)g->batch, (int)g->trans_a, (long long)g->m, (long long)g->n,
                g->aux ? dtype_name(g->aux->dtype) : "NULL", g->aux ? g->aux->numel : (size_t)0,
                dtype_name(g->c->dtype));
    return false;
}

/* GEMM_EPI_RELU, GEMM_EPI_RELU_MASK (backend.h): the plain product, then the ReLU op itself over C in place
 * (act_forward, or act_backward with aux as its input), which is the bits backend.h asks for. cuBLASLt's RELU
 * epilogues would save that pass; its DRELU reads a bit mask its forward wrote, not a tensor. */
static void gemm_relu(struct backend *be, const struct gemm_args *g)
{
    struct cuda_backend *cb = cuda_of(be);
    const bool mask = g->epilogue == GEMM_EPI_RELU_MASK;
    if (g->beta != 0.0f || g->batch != 1 ||
        (mask && (!g->aux || g->aux->dtype != g->c->dtype || (int64_t)g->aux->numel != g->m * g->n))) {
        cuda_record(cb, "this is a bug in the caller (see GEMM_EPI_RELU in lib/base/backend.h)",
                    "gemm: the ReLU epilogues need beta 0, batch 1 and (the mask) aux (m, n) of C's dtype (beta %g, "
                    "batch %lld, m %lld, n %lld, aux %s of %zu elements, C %s)",
                    (double)g->beta, (long long)g->batch, (long long)g->m, (long long)g->n,
                    g->aux ? dtype_name(g->aux->dtype) : "NULL", g->aux ? g->aux->numel : (size_t)0,
                    dtype_name(g->c->dtype));
        return;
    }
    struct gemm_args plain = *g;
    plain.epilogue = GEMM_EPI_NONE;
    plain.aux = NULL;
    cuda_gemm(be, &plain);
    if (mask)
        cuda_act_backward(be, ACT_RELU, g->c, g->c, g->aux);
    else
        cuda_act_forward(be, ACT_RELU, g->c, g->c);
}

void cuda_gemm(struct backend *be, const struct gemm_args *g)
{
    struct cuda_backend *cb = cuda_of(be);
    if (g->epilogue == GEMM_EPI_RELU || g->epilogue == GEMM_EPI_RELU_MASK) {
        gemm_relu(be, g);
        return;
    }
    if (dtype_is_fp8(g->a->dtype) || dtype_is_fp8(g->b->dtype)) {
        if (gelu_args_ok(cb, g))
            cuda_gemm_fp8(cb, g);
        return;
    }
    if (g->a->dtype != g->b->dtype || (g->c->dtype != DT_FP32 && g->c->dtype != g->a->dtype) ||
        (g->bias && (g->bias->dtype != DT_FP32 || g->beta != 0.0f))) {
        cuda_record(cb, "this is a bug in the caller (see the dtype rules in lib/base/backend.h)",
                    "gemm: unsupported dtypes A %s, B %s, C %s%s", dtype_name(g->a->dtype), dtype_name(g->b->dtype),
                    dtype_name(g->c->dtype), g->bias ? " with a bias" : "");
        return;
    }
    if (!gelu_args_ok(cb, g))
        return;
    struct lt_matmul mm;
    memset(&mm, 0, sizeof mm);
    mm.a = g->a->data;
    mm.b = g->b->data;
    mm.c = g->c->data;
    mm.bias = g->bias ? static_cast<const float *>(g->bias->data) : NULL;
    mm.aux = g->epilogue == GEMM_EPI_GELU_TANH ? g->aux->data : NULL;
    mm.ab_dt = g->a->dtype;
    mm.c_dt = g->c->dtype;
    mm.trans_a = g->trans_a;
    mm.trans_b = g->trans_b;
    mm.m = g->m;
    mm.n = g->n;
    mm.k = g->k;
    mm.lda = g->lda ? g->lda : g->trans_a ? g->m : g->k; /* lda: the padded head's dlogits rows (backend.h) */
    mm.ldb = g->trans_b ? g->k : g->n;
    mm.ldc = g->n;
    mm.alpha = g->alpha;
    mm.beta = g->beta;
    mm.batch = g->batch;
    mm.stride_a = g->stride_a;
    mm.stride_b = g->stride_b;
    mm.stride_c = g->stride_c;
    cuda_lt_matmul(cb, &mm);
}

/* ---- attention --------------------------------------------------------------------------------- */

/* dst (B, H, T, D) dtype dst_dt = the head columns of src rows: src[(b*T + t)*row + col + h*D + d]. */
__global__ void split_heads_kernel(void *dst, int dst_dt, const void *src, int src_dt, int64_t row, int64_t col,
                                   int64_t B, int64_t T, int64_t H, int64_t D)
{
    int64_t total = B * H * T * D;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t d = i % D, t = (i / D) % T, h = (i / (D * T)) % H, b = i / (D * T * H);
        store_elem(dst, dst_dt, (size_t)i, load_elem(src, src_dt, (size_t)((b * T + t) * row + col + h * D + d)));
    }
}

/* The inverse: dst[(b*T + t)*row + col + h*D + d] = src (B, H, T, D). */
__global__ void merge_heads_kernel(void *dst, int dst_dt, int64_t row, int64_t col, const void *src, int src_dt,
                                   int64_t B, int64_t T, int64_t H, int64_t D)
{
    int64_t total = B * H * T * D;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t d = i % D, t = (i / D) % T, h = (i / (D * T)) % H, b = i / (D * T * H);
        store_elem(dst, dst_dt, (size_t)((b * T + t) * row + col + h * D + d), load_elem(src, src_dt, (size_t)i));
    }
}

__device__ float block_max_float(float v, float *shared)
{
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0)
        shared[warp] = v;
    __syncthreads();
    float m = -INFINITY;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++)
        m = fmaxf(m, shared[w]);
    return m;
}

/* One block per row r of the (B*H*T, T) scores, t = r % T. Reads s (dtype s_dt), rounds each score
 * to d (the CPU stores scores in qkv's dtype), writes the causal softmax to probs (probs_dt, zeros for
 * j > t) and, when s_back, the probabilities as rounded to probs_dt back into s (fp32 work buffer). */
__global__ void softmax_causal_kernel(void *s, int s_dt, int d, void *probs, int probs_dt, bool s_back, int64_t T)
{
    extern __shared__ float row[]; /* T */
    __shared__ double red_d[32];
    __shared__ float red_f[32];
    int64_t r = blockIdx.x, t = r % T;
    size_t base = (size_t)r * (size_t)T;
    float mx = -INFINITY;
    for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) {
        float v = round_to(load_elem(s, s_dt, base + j), d);
        row[j] = v;
        mx = fmaxf(mx, v);
    }
    mx = block_max_float(mx, red_f);
    double sum = 0.0;
    for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) {
        float e = expf(row[j] - mx);
        row[j] = e;
        sum += e;
    }
    sum = block_sum(sum, red_d);
    float inv = (float)(1.0 / sum);
    for (int64_t j = threadIdx.x; j < T; j += blockDim.x) {
        float p = j <= t ? row[j] * inv : 0.0f;
        store_elem(probs, probs_dt, base + j, p);
        if (s_back)
            static_cast<float *>(s)[base + j] = round_to(p, probs_dt);
    }
}

/* One block per row: dS = P * (dP - sum_j P dP) over j <= t (0 beyond), dP read from ds (ds_dt) and
 * rounded to d first, the result rounded to d and stored back into ds. */
__global__ void softmax_causal_backward_kernel(void *ds, int ds_dt, int d, const void *probs, int probs_dt, int64_t T)
{
    __shared__ double red_d[32];
    int64_t r = blockIdx.x, t = r % T;
    size_t base = (size_t)r * (size_t)T;
    double dot = 0.0;
    for (int64_t j = threadIdx.x; j <= t; j += blockDim.x)
        dot += (double)load_elem(probs, probs_dt, base + j) * (double)round_to(load_elem(ds, ds_dt, base + j), d);
    dot = block_sum(dot, red_d);
    float dot_f = (float)dot;
    __syncthreads(); /* every thread has read its dP before any is overwritten (same thread owns j) */
    for (int64_t j = threadIdx.x; j < T; j += blockDim.x) {
        float v = 0.0f;
        if (j <= t) {
            float p = load_elem(probs, probs_dt, base + j), dp = round_to(load_elem(ds, ds_dt, base + j), d);
            v = p * (dp - dot_f);
        }
        store_elem(ds, ds_dt, base + j, round_to(v, d));
    }
}

static unsigned row_threads(int64_t T)
{
    return T >= 512 ? 256u : T >= 128 ? 128u : 32u;
}

static void *att_buffer(struct cuda_backend *cb, enum cuda_scratch_slot slot, enum dtype dt, int64_t numel)
{
    return cuda_scratch(cb, slot, (size_t)numel * dtype_size(dt));
}

static bool att_shapes_ok(struct cuda_backend *cb, int64_t B, int64_t T, int64_t C, int64_t H)
{
    /* softmax_causal_kernel: T floats of dynamic shared memory next to its 384 static bytes, in the
     * default 48 KiB a block may have: T <= 12192 */
    if (H < 1 || C % H != 0 || T < 1 || B < 1 || T * (int64_t)sizeof(float) + 384 > 48 * 1024) {
        cuda_record(cb, "use a sequence length of at most 12192 and a width divisible by the head count",
                    "attention: unsupported shape B=%lld T=%lld C=%lld H=%lld", (long long)B, (long long)T,
                    (long long)C, (long long)H);
        return false;
    }
    return true;
}

static struct lt_matmul batched(const void *a, bool ta, const void *b, bool tb, void *c, enum dtype ab, enum dtype cd,
                                int64_t m, int64_t n, int64_t k, float alpha, int64_t batch)
{
    struct lt_matmul mm;
    memset(&mm, 0, sizeof mm);
    mm.a = a;
    mm.b = b;
    mm.c = c;
    mm.ab_dt = ab;
    mm.c_dt = cd;
    mm.trans_a = ta;
    mm.trans_b = tb;
    mm.m = m;
    mm.n = n;
    mm.k = k;
    mm.lda = ta ? m : k;
    mm.ldb = tb ? k : n;
    mm.ldc = n;
    mm.alpha = alpha;
    mm.beta = 0.0f;
    mm.batch = batch;
    mm.stride_a = m * k;
    mm.stride_b = k * n;
    mm.stride_c = m * n;
    return mm;
}

void cuda_attention_forward(struct backend *be, struct tensor *out, struct tensor *probs, const struct tensor *qkv,
                            int64_t B, int64_t T, int64_t C, int64_t H)
{
    struct cuda_backend *cb = cuda_of(be);
    if (!att_shapes_ok(cb, B, T, C, H))
        return;
    int64_t D = C / H, BH = B * H;
    float scale = 1.0f / sqrtf((float)D);
    enum dtype d = qkv->dtype;
    enum dtype w = probs->dtype == d ? d : DT_FP32; /* the GEMMs' operand dtype */
    enum dtype o_dt = out->dtype == w ? w : DT_FP32;
    void *q = att_buffer(cb, CSCR_ATT_Q, w, BH * T * D), *k = att_buffer(cb, CSCR_ATT_K, w, BH * T * D);
    void *v = att_buffer(cb, CSCR_ATT_V, w, BH * T * D), *o = att_buffer(cb, CSCR_ATT_O, o_dt, BH * T * D);
    void *s = w == d ? probs->data : att_buffer(cb, CSCR_ATT_S, DT_FP32, BH * T * T);
    if (!q || !k || !v || !o || !s)
        return;
    unsigned g = grid_for((size_t)(BH * T * D));
    split_heads_kernel<<<g, kThreads, 0, cb->stream>>>(q, w, qkv->data, d, 3 * C, 0, B, T, H, D);
    split_heads_kernel<<<g, kThreads, 0, cb->stream>>>(k, w, qkv->data, d, 3 * C, C, B, T, H, D);
    split_heads_kernel<<<g, kThreads, 0, cb->stream>>>(v, w, qkv->data, d, 3 * C, 2 * C, B, T, H, D);
    CB_LAUNCHED(cb, "split_heads_kernel");
    /* S = Q K^T / sqrt(D), stored in w (d, or fp32 rounded to d by the softmax) */
    struct lt_matmul mm = batched(q, false, k, true, s, w, w, T, T, D, scale, BH);
    cuda_lt_matmul(cb, &mm);
    softmax_causal_kernel<<<(unsigned)(BH * T), row_threads(T), (size_t)T * sizeof(float), cb->stream>>>(
        s, w, d, probs->data, probs->dtype, w != d, T);
    CB_LAUNCHED(cb, "softmax_causal_kernel");
    /* O = P V; P is probs itself (w == d) or its fp32 copy in s */
    mm = batched(s, false, v, false, o, w, o_dt, T, D, T, 1.0f, BH);
    cuda_lt_matmul(cb, &mm);
    merge_heads_kernel<<<g, kThreads, 0, cb->stream>>>(out->data, out->dtype, C, 0, o, o_dt, B, T, H, D);
    CB_LAUNCHED(cb, "merge_heads_kernel");
}

void cuda_attention_backward(struct backend *be, struct tensor *dqkv, const struct tensor *dout,
                             const struct tensor *qkv, const struct tensor *probs, int64_t B, int64_t T, int64_t C,
                             int64_t H)
{
    struct cuda_backend *cb = cuda_of(be);
    if (!att_shapes_ok(cb, B, T, C, H))
        return;
    int64_t D = C / H, BH = B * H;
    float scale = 1.0f / sqrtf((float)D);
    enum dtype d = qkv->dtype;
    enum dtype w = probs->dtype == d && dout->dtype == d ? d : DT_FP32;
    enum dtype g_dt = dqkv->dtype == w ? w : DT_FP32;
    size_t nh = (size_t)(BH * T * D);
    void *q = att_buffer(cb, CSCR_ATT_Q, w, BH * T * D), *k = att_buffer(cb, CSCR_ATT_K, w, BH * T * D);
    void *v = att_buffer(cb, CSCR_ATT_V, w, BH * T * D), *dO = att_buffer(cb, CSCR_ATT_O, w, BH * T * D);
    void *ds = att_buffer(cb, CSCR_ATT_S, w, BH * T * T);
    void *dq = att_buffer(cb, CSCR_ATT_DQ, g_dt, BH * T * D), *dk = att_buffer(cb, CSCR_ATT_DK, g_dt, BH * T * D);
    void *dv = att_buffer(cb, CSCR_ATT_DV, g_dt, BH * T * D);
    /* P as a GEMM operand: probs itself, or an fp32 copy (in the partial slot) */
    const void *p = probs->data;
    if (w != probs->dtype) {
        void *p32 = cuda_scratch(cb, CSCR_PARTIAL2, probs->numel * sizeof(float));
        if (p32)
            CB_CUDA(cb, (cudaError_t)cuda_convert(p32, DT_FP32, probs->data, probs->dtype, probs->numel, cb->stream));
        p = p32;
    }
    if (!q || !k || !v || !dO || !ds || !dq || !dk || !dv || !p)
        return;
    unsigned g = grid_for(nh);
    split_heads_kernel<<<g, kThreads, 0, cb->stream>>>(q, w, qkv->data, d, 3 * C, 0, B, T, H, D);
    split_heads_kernel<<<g, kThreads, 0, cb->stream>>>(k, w, qkv->data, d, 3 * C, C, B, T, H, D);
    split_heads_kernel<<<g, kThreads, 0, cb->stream>>>(v, w, qkv->data, d, 3 * C, 2 * C, B, T, H, D);
    split_heads_kernel<<<g, kThreads, 0, cb->stream>>>(dO, w, dout->data, dout->dtype, C, 0, B, T, H, D);
    CB_LAUNCHED(cb, "split_heads_kernel");
    struct lt_matmul mm = batched(dO, false, v, true, ds, w, w, T, T, D, 1.0f, BH); /* dP = dO V^T */
    cuda_lt_matmul(cb, &mm);
    softmax_causal_backward_kernel<<<(unsigned)(BH * T), row_threads(T), 0, cb->stream>>>(ds, w, d, probs->data,
                                                                                          probs->dtype, T);
    CB_LAUNCHED(cb, "softmax_causal_backward_kernel");
    mm = batched(p, true, dO, false, dv, w, g_dt, T, D, T, 1.0f, BH); /* dV = P^T dO */
    cuda_lt_matmul(cb, &mm);
    mm = batched(ds, false, k, false, dq, w, g_dt, T, D, T, scale, BH); /* dQ = dS K / sqrt(D) */
    cuda_lt_matmul(cb, &mm);
    mm = batched(ds, true, q, false, dk, w, g_dt, T, D, T, scale, BH); /* dK = dS^T Q / sqrt(D) */
    cuda_lt_matmul(cb, &mm);
    merge_heads_kernel<<<g, kThreads, 0, cb->stream>>>(dqkv->data, dqkv->dtype, 3 * C, 0, dq, g_dt, B, T, H, D);
    merge_heads_kernel<<<g, kThreads, 0, cb->stream>>>(dqkv->data, dqkv->dtype, 3 * C, C, dk, g_dt, B, T, H, D);
    merge_heads_kernel<<<g, kThreads, 0, cb->stream>>>(dqkv->data, dqkv->dtype, 3 * C, 2 * C, dv, g_dt, B, T, H, D);
    CB_LAUNCHED(cb, "merge_heads_kernel");
}

/* ---- attention over a key/value cache (sampling) -------------------------------------------------
 * backend.h's attention_decode. cache_store_kernel writes the new rows' K and V into the cache
 * (2, H, max_T, D); attention_decode_kernel then runs one block per (row i, head h): the scores of
 * positions 0..pos+i in shared memory (each thread its j's, the dot product in fp32 in order of e, rounded
 * to d), the fp32 softmax as softmax_causal_kernel computes it (max, expf, the sum in double), the
 * probabilities rounded to d, and each thread one output column e, summed over j in order. */

__global__ void cache_store_kernel(void *cache, int cache_dt, const void *qkv, int qkv_dt, int64_t pos, int64_t n,
                                   int64_t C, int64_t H, int64_t max_T)
{
    int64_t D = C / H, total = n * C;
    size_t values = (size_t)(H * max_T * D);
    for (int64_t x = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; x < total; x += (int64_t)gridDim.x * blockDim.x) {
        int64_t i = x / C, h = (x % C) / D, e = x % D;
        size_t at = (size_t)((h * max_T + pos + i) * D + e);
        store_elem(cache, cache_dt, at, load_elem(qkv, qkv_dt, (size_t)(i * 3 * C + C + h * D + e)));
        store_elem(cache, cache_dt, values + at, load_elem(qkv, qkv_dt, (size_t)(i * 3 * C + 2 * C + h * D + e)));
    }
}

__global__ void attention_decode_kernel(void *out, int out_dt, const void *cache, int cache_dt, const void *qkv,
                                        int d, int64_t pos, int64_t C, int64_t H, int64_t max_T, float scale)
{
    extern __shared__ float sh[]; /* q (D), then the scores (max_T) */
    __shared__ double red_d[32];
    __shared__ float red_f[32];
    int64_t i = blockIdx.x / H, h = blockIdx.x % H, D = C / H, last = pos + i;
    float *q = sh, *s = sh + D;
    size_t values = (size_t)(H * max_T * D);
    for (int64_t e = threadIdx.x; e < D; e += blockDim.x)
        q[e] = load_elem(qkv, d, (size_t)(i * 3 * C + h * D + e));
    __syncthreads();
    float mx = -INFINITY;
    for (int64_t j = threadIdx.x; j <= last; j += blockDim.x) {
        size_t k0 = (size_t)((h * max_T + j) * D);
        float dot = 0.0f;
        for (int64_t e = 0; e < D; e++)
            dot += q[e] * load_elem(cache, cache_dt, k0 + (size_t)e);
        s[j] = round_to(scale * dot, d);
        mx = fmaxf(mx, s[j]);
    }
    mx = block_max_float(mx, red_f);
    double sum = 0.0;
    for (int64_t j = threadIdx.x; j <= last; j += blockDim.x)
        sum += expf(s[j] - mx);
    sum = block_sum(sum, red_d);
    float inv = (float)(1.0 / sum);
    for (int64_t j = threadIdx.x; j <= last; j += blockDim.x)
        s[j] = round_to(expf(s[j] - mx) * inv, d);
    __syncthreads();
    for (int64_t e = threadIdx.x; e < D; e += blockDim.x) {
        float acc = 0.0f;
        for (int64_t j = 0; j <= last; j++)
            acc += s[j] * load_elem(cache, cache_dt, values + (size_t)((h * max_T + j) * D + e));
        store_elem(out, out_dt, (size_t)(i * C + h * D + e), acc);
    }
}

void cuda_attention_decode(struct backend *be, struct tensor *out, struct tensor *cache, const struct tensor *qkv,
                           int64_t pos, int64_t n, int64_t C, int64_t H)
{
    struct cuda_backend *cb = cuda_of(be);
    int64_t max_T = cache->shape[2];
    if (!att_shapes_ok(cb, n, max_T + C / H, C, H)) /* shared memory: the query and a row of max_T scores */
        return;
    int64_t D = C / H;
    cache_store_kernel<<<grid_for((size_t)(n * C)), kThreads, 0, cb->stream>>>(cache->data, cache->dtype, qkv->data,
                                                                              qkv->dtype, pos, n, C, H, max_T);
    CB_LAUNCHED(cb, "cache_store_kernel");
    attention_decode_kernel<<<(unsigned)(n * H), row_threads(max_T), (size_t)(D + max_T) * sizeof(float),
                              cb->stream>>>(out->data, out->dtype, cache->data, cache->dtype, qkv->data, qkv->dtype,
                                            pos, C, H, max_T, 1.0f / sqrtf((float)D));
    CB_LAUNCHED(cb, "attention_decode_kernel");
}
