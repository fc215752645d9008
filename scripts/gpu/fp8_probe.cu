/*
 * fp8_probe.cu — which native fp8 products this GPU's cuBLASLt accepts (scripts/gpu/gpu-check.sh runs it on a GPU).
 *
 * On the first H200 run (2026-12-04, cuBLASLt 130100) every native fp8 product of the CUDA backend
 * (kernels/cuda/fp8.cu: E4M3 x E4M3 or E5M2, TN, compute 32F, scale pointers set, an fp32 D in place of C) was
 * refused by cublasLtMatmul with CUBLAS_STATUS_NOT_SUPPORTED, although the heuristic had offered an algorithm,
 * and the backend now emulates them in bf16. This asks cuBLASLt the same product in variants, each changing one
 * thing, and tries every algorithm the heuristic offers (up to 8) until one is accepted, so one run on a GPU says
 * what the refusal depends on. Its first H200 run (2026-12-04) accepted every variant it then had, 256-byte-aligned
 * scales among them, so it now also asks with scales 4 bytes past a 16-byte boundary. Each accepted product is
 * checked: A and B hold the E4M3 code of 1.0 and the scales are 1, so every element of D must be k.
 *
 *   fp8_probe            one line per variant, then "fp8_probe: ours accepted|refused"; exit 0 (1 on a CUDA error)
 */
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

namespace {

constexpr int64_t kM = 256, kN = 384, kK = 512; /* our (m, n, k): cuBLASLt's (n, m, k) */
constexpr size_t kWorkspace = 32u << 20;          /* the backend's kLtWorkspaceBytes */

struct variant {
    const char *name;
    cudaDataType_t d_type, c_type; /* D's and C's types */
    bool separate_c;               /* C a buffer of its own (else C == D, as the backend calls it) */
    bool scales;                   /* the A and B scale pointers set */
    bool fast_accum;               /* CUBLASLT_MATMUL_DESC_FAST_ACCUM */
    bool align_prefs;              /* the backend's 16-byte alignment preferences */
    bool scales_off4;              /* the scale pointers 4 bytes past a 16-byte boundary, as lib/base/fp8.c's side by
                                    * side scales were before kernels/cuda/fp8.cu copied them (fp8_aligned_scales) */
};

const variant kVariants[] = {
    {"ours (D fp32 = C, scales, alignment preferences)", CUDA_R_32F, CUDA_R_32F, false, true, false, true, false},
    {"scales 4 bytes past a 16-byte boundary", CUDA_R_32F, CUDA_R_32F, false, true, false, true, true},
    {"C a separate fp32 buffer", CUDA_R_32F, CUDA_R_32F, true, true, false, true, false},
    {"no scale pointers", CUDA_R_32F, CUDA_R_32F, false, false, false, true, false},
    {"fast accumulation", CUDA_R_32F, CUDA_R_32F, false, true, true, true, false},
    {"no alignment preferences", CUDA_R_32F, CUDA_R_32F, false, true, false, false, false},
    {"D bf16 = C", CUDA_R_16BF, CUDA_R_16BF, false, true, false, true, false},
    {"D bf16, C a separate bf16 buffer", CUDA_R_16BF, CUDA_R_16BF, true, true, false, true, false},
};

bool cuda_ok(cudaError_t e, const char *what)
{
    if (e == cudaSuccess)
        return true;
    fprintf(stderr, "fp8_probe: %s: %s\n", what, cudaGetErrorString(e));
    return false;
}

/* D's first, middle and last elements as floats */
bool d_is_k(const void *d, cudaDataType_t t, int64_t count)
{
    const int64_t at[3] = {0, count / 2, count - 1};
    for (int64_t i : at) {
        float v;
        if (t == CUDA_R_32F) {
            if (cudaMemcpy(&v, static_cast<const float *>(d) + i, sizeof v, cudaMemcpyDeviceToHost) != cudaSuccess)
                return false;
        } else {
            __nv_bfloat16 h;
            if (cudaMemcpy(&h, static_cast<const __nv_bfloat16 *>(d) + i, sizeof h, cudaMemcpyDeviceToHost) !=
                cudaSuccess)
                return false;
            v = __bfloat162float(h);
        }
        if (v != (float)kK)
            return false;
    }
    return true;
}

/* One variant: "accepted (algorithm i of n), D = k" or why not. true when accepted. */
bool probe(const variant &v, const void *a, const void *b, void *c, void *d, const float *scale, void *ws,
           cudaStream_t stream)
{
    cublasLtHandle_t lt = nullptr;
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr, ld = nullptr;
    cublasLtMatmulPreference_t pref = nullptr;
    cublasLtMatmulHeuristicResult_t res[8];
    int nres = 0;
    bool accepted = false;
    char statuses[256] = "";
    cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
    uint64_t wsb = kWorkspace;
    uint32_t al = 16;
    int8_t fast = v.fast_accum ? 1 : 0;
    float alpha = 1.0f, beta = 0.0f;
    if (v.scales_off4)
        scale += 1; /* main fills 8 floats with 1 */
    /* cuBLASLt's A is our B (n, k) row-major = (k, n) column-major, transposed; its B our A (m, k) row-major =
     * (k, m) column-major; D (n, m) column-major = our (m, n) row-major */
    cublasStatus_t s = cublasLtCreate(&lt);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof op_t);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof op_n);
    if (s == CUBLAS_STATUS_SUCCESS && v.scales)
        s = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale, sizeof scale);
    if (s == CUBLAS_STATUS_SUCCESS && v.scales)
        s = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale, sizeof scale);
    if (s == CUBLAS_STATUS_SUCCESS && v.fast_accum)
        s = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, kK, kN, kK);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, kK, kM, kK);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatrixLayoutCreate(&lc, v.c_type, kN, kM, kN);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatrixLayoutCreate(&ld, v.d_type, kN, kM, kN);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceCreate(&pref);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb);
    const cublasLtMatmulPreferenceAttributes_t aligns[] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (auto attr : aligns)
        if (s == CUBLAS_STATUS_SUCCESS && v.align_prefs)
            s = cublasLtMatmulPreferenceSetAttribute(pref, attr, &al, sizeof al);
    if (s != CUBLAS_STATUS_SUCCESS) {
        printf("%-52s setup failed: %s\n", v.name, cublasGetStatusName(s));
    } else {
        s = cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, ld, pref, 8, res, &nres);
        void *cc = v.separate_c ? c : d;
        for (int i = 0; s == CUBLAS_STATUS_SUCCESS && i < nres && !accepted; i++) {
            cublasStatus_t r = cublasLtMatmul(lt, desc, &alpha, b, la, a, lb, &beta, cc, lc, d, ld, &res[i].algo, ws,
                                              kWorkspace, stream);
            if (r == CUBLAS_STATUS_SUCCESS) {
                accepted = true;
                bool good = cudaStreamSynchronize(stream) == cudaSuccess && d_is_k(d, v.d_type, kM * kN);
                printf("%-52s accepted: algorithm %d of the %d offered (refused before it:%s), D %s\n", v.name, i + 1,
                       nres, statuses[0] ? statuses : " none", good ? "= k, right" : "WRONG");
            } else {
                size_t used = strlen(statuses);
                snprintf(statuses + used, sizeof statuses - used, " %s", cublasGetStatusName(r));
            }
        }
        if (s != CUBLAS_STATUS_SUCCESS)
            printf("%-52s heuristic: %s\n", v.name, cublasGetStatusName(s));
        else if (!accepted)
            printf("%-52s refused: all %d algorithms offered (%s )\n", v.name, nres, statuses);
    }
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatmulDescDestroy(desc);
    cublasLtDestroy(lt);
    return accepted;
}

} // namespace

int main()
{
    int dev_count = 0, rt = 0, drv = 0;
    if (!cuda_ok(cudaGetDeviceCount(&dev_count), "cudaGetDeviceCount") || dev_count == 0) {
        printf("fp8_probe: no CUDA device\n");
        return 1;
    }
    cudaDeviceProp prop;
    cudaRuntimeGetVersion(&rt);
    cudaDriverGetVersion(&drv);
    if (!cuda_ok(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties"))
        return 1;
    printf("fp8_probe: %s (sm_%d%d), driver %d, runtime %d, cuBLASLt %zu; our m=%lld n=%lld k=%lld, E4M3 x E4M3, TN\n",
           prop.name, prop.major, prop.minor, drv, rt, cublasLtGetVersion(), (long long)kM, (long long)kN,
           (long long)kK);
    void *a = nullptr, *b = nullptr, *c = nullptr, *d = nullptr, *ws = nullptr;
    float *scale = nullptr;
    const float ones[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    cudaStream_t stream = nullptr;
    bool ok = cuda_ok(cudaMalloc(&a, kM * kK), "cudaMalloc A") && cuda_ok(cudaMalloc(&b, kN * kK), "cudaMalloc B") &&
              cuda_ok(cudaMalloc(&c, kM * kN * sizeof(float)), "cudaMalloc C") &&
              cuda_ok(cudaMalloc(&d, kM * kN * sizeof(float)), "cudaMalloc D") &&
              cuda_ok(cudaMalloc(&ws, kWorkspace), "cudaMalloc workspace") &&
              cuda_ok(cudaMalloc(&scale, 8 * sizeof(float)), "cudaMalloc scale") &&
              cuda_ok(cudaMemset(a, 0x38, kM * kK), "cudaMemset A") && /* E4M3 0x38 = 1.0 */
              cuda_ok(cudaMemset(b, 0x38, kN * kK), "cudaMemset B") &&
              cuda_ok(cudaMemcpy(scale, ones, sizeof ones, cudaMemcpyHostToDevice), "scales") &&
              cuda_ok(cudaStreamCreate(&stream), "cudaStreamCreate");
    bool ours = false;
    if (ok)
        for (size_t i = 0; i < sizeof kVariants / sizeof kVariants[0]; i++) {
            bool acc = probe(kVariants[i], a, b, c, d, scale, ws, stream);
            if (i == 0)
                ours = acc;
        }
    if (ok)
        printf("fp8_probe: ours %s\n", ours ? "accepted" : "refused");
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
    cudaFree(d);
    cudaFree(ws);
    cudaFree(scale);
    if (stream)
        cudaStreamDestroy(stream);
    return ok ? 0 : 1;
}
