/*
 * conv_cudnn.cu — 2-D convolutions (NCHW, square kernels) through cuDNN.
 *
 * cuDNN 9 still ships the descriptor API (cudnnConvolutionForward / BackwardData / BackwardFilter;
 * deprecated in favour of the graph API but complete): it is used here, with FP32 accumulation
 * (convolution compute type CUDNN_DATA_FLOAT). Math: fp32 data uses CUDNN_FMA_MATH (true fp32) unless
 * the backend's tf32 flag is set (then CUDNN_DEFAULT_MATH, which may use TF32 tensor cores); fp16/bf16
 * data uses CUDNN_TENSOR_OP_MATH.
 *
 * Plans: descriptors and the three algorithms are made once per shape key (the conv_args, the dtype,
 * tf32) and kept until destroy. Algorithms come from cudnnGet*Algorithm_v7 (heuristics; no timing
 * runs): the first one that is deterministic (CUDNN_DETERMINISTIC) and succeeded, so results reproduce
 * (a non-deterministic one, with a warning, only when cuDNN offers nothing else). Each list entry is
 * an (algorithm, math type) pair with that pair's workspace; the chosen pair's math type is set on the
 * descriptor before every call (fp32 without TF32 always runs FMA, its workspace asked again: pick).
 *
 * Dtypes (backend.h): when x, w and y (dx, w, dy) share a dtype the call runs natively in it; otherwise
 * the operands are widened to fp32 scratch (exact), computed in fp32 and rounded once into the output.
 * The weight gradient is fp32 with beta accumulation: x and dy are widened to fp32 unless already
 * fp32, which keeps the gradient exactly the CPU's computation up to summation order.
 *
 * The weight gradient of 16-bit x and dy on tensor cores. cuDNN's backward-filter configurations give
 * dw the dtype of x and dy (TRUE_HALF, PSEUDO_HALF, PSEUDO_BFLOAT16: HALF/BFLOAT16 in, the same out,
 * compute HALF or FLOAT; FLOAT_CONFIG all FLOAT): there is no 16-bit-in, fp32-out configuration. A
 * 16-bit dw is not ours to take: with a loss scale of 2^16 a weight gradient overflows fp16's 65504
 * (a spurious skip), and it would round each micro-batch's gradient to 8 or 11 bits before the FP32
 * accumulation (backend.h: parameter gradients FP32, beta accumulation; DESIGN 3: never accumulate
 * gradients in fp16/bf16). What we do instead: every fp16 and bf16 value is exactly a TF32 value
 * (TF32 keeps fp32's 8-bit exponent and 10 of its mantissa bits; fp16 has 10, bf16 7), so the fp32
 * copies of 16-bit x and dy lose nothing when a tensor core reads them as TF32, and products of two
 * TF32 values are exact in the FP32 accumulator. So for 16-bit x and dy the plan is fp32 data with
 * tensor-op math allowed (CUDNN_DEFAULT_MATH, as the TF32 plans) whatever precision.tf32 says — that
 * flag is about rounding fp32 data, and here none is rounded — restricted to the GEMM-shaped
 * algorithms (0, 1, 3: no FFT or Winograd transform, whose transformed values TF32 would round) and to
 * deterministic ones. dw is written by cuDNN in fp32 with our beta, as before. Where cuDNN offers no
 * such algorithm the plain fp32 plan (CUDNN_FMA_MATH) runs, as before this path existed. The cost
 * left is the two widening copies; an im2col + cuBLASLt GEMM (16-bit operands, fp32 C with beta)
 * would drop them at the price of a K*K-times larger im2col buffer — not done until a GPU measures
 * which is faster. The bias is
 * added by a small kernel after the convolution (so a 16-bit output is rounded twice: once by cuDNN,
 * once after the bias; the CPU rounds once — within the fp16/bf16 tolerance), and db is a per-channel
 * deterministic sum of dy (cuda_channel_sums).
 */
#include "backend_cuda_internal.h"

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "convert.h" /* cuda_convert */

struct conv_key {
    int64_t n, c_in, h_in, w_in, c_out, h_out, w_out, kernel, stride, padding;
    int32_t dt, tf32;
    int32_t exact16; /* fp32 copies of 16-bit x and dy: TF32 tensor cores read them exactly (above) */
};

struct conv_plan {
    struct conv_key key;
    cudnnTensorDescriptor_t x, y;
    cudnnFilterDescriptor_t w;
    cudnnConvolutionDescriptor_t conv;
    cudnnMathType_t math;             /* asked of the _v7 queries */
    cudnnMathType_t fwd_math, bwd_data_math, bwd_filter_math; /* what each chosen algorithm runs with */
    bool have_fwd, have_bwd_data, have_bwd_filter;
    bool refused_fwd, refused_bwd_data, refused_bwd_filter; /* a soft query found nothing: do not ask again */
    cudnnConvolutionFwdAlgo_t fwd;
    cudnnConvolutionBwdDataAlgo_t bwd_data;
    cudnnConvolutionBwdFilterAlgo_t bwd_filter;
    size_t ws_fwd, ws_bwd_data, ws_bwd_filter;
    struct conv_plan *next;
};

static cudnnDataType_t dnn_type(enum dtype dt)
{
    switch (dt) {
    case DT_FP16: return CUDNN_DATA_HALF;
    case DT_BF16: return CUDNN_DATA_BFLOAT16;
    default: return CUDNN_DATA_FLOAT;
    }
}

static void plan_destroy(struct conv_plan *p)
{
    if (p->x)
        cudnnDestroyTensorDescriptor(p->x);
    if (p->y)
        cudnnDestroyTensorDescriptor(p->y);
    if (p->w)
        cudnnDestroyFilterDescriptor(p->w);
    if (p->conv)
        cudnnDestroyConvolutionDescriptor(p->conv);
    free(p);
}

void cuda_conv_plans_free(struct cuda_backend *cb)
{
    struct conv_plan *p = cb->conv_plans;
    while (p) {
        struct conv_plan *next = p->next;
        plan_destroy(p);
        p = next;
    }
    cb->conv_plans = NULL;
}

static bool fits_int(const struct conv_args *a)
{
    return a->n <= INT_MAX && a->c_in <= INT_MAX && a->h_in <= INT_MAX && a->w_in <= INT_MAX && a->c_out <= INT_MAX &&
           a->kernel <= INT_MAX && a->stride <= INT_MAX && a->padding <= INT_MAX;
}

/* The plan for the shape, data dtype dt; exact16: fp32 data that are widened 16-bit values (TF32 allowed). */
static struct conv_plan *plan_get(struct cuda_backend *cb, const struct conv_args *a, enum dtype dt, bool exact16)
{
    struct conv_key key;
    memset(&key, 0, sizeof key);
    key.n = a->n;
    key.c_in = a->c_in;
    key.h_in = a->h_in;
    key.w_in = a->w_in;
    key.c_out = a->c_out;
    key.h_out = a->h_out;
    key.w_out = a->w_out;
    key.kernel = a->kernel;
    key.stride = a->stride;
    key.padding = a->padding;
    key.dt = dt;
    key.tf32 = (cb->base.allow_tf32 || exact16) && dt == DT_FP32;
    key.exact16 = exact16 && dt == DT_FP32;
    for (struct conv_plan *p = cb->conv_plans; p; p = p->next)
        if (memcmp(&p->key, &key, sizeof key) == 0)
            return p;
    if (!fits_int(a)) {
        cuda_record(cb, "use smaller convolution shapes", "conv2d: a dimension exceeds cuDNN's int range");
        return NULL;
    }
    struct conv_plan *p = static_cast<struct conv_plan *>(calloc(1, sizeof *p));
    if (!p) {
        cuda_record(cb, "free some host memory", "out of memory building a cuDNN plan");
        return NULL;
    }
    p->key = key;
    cudnnDataType_t t = dnn_type(dt);
    cudnnMathType_t math = dt != DT_FP32 ? CUDNN_TENSOR_OP_MATH : key.tf32 ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH;
    p->math = math;
    bool ok = CB_CUDNN(cb, cudnnCreateTensorDescriptor(&p->x)) && CB_CUDNN(cb, cudnnCreateTensorDescriptor(&p->y)) &&
              CB_CUDNN(cb, cudnnCreateFilterDescriptor(&p->w)) &&
              CB_CUDNN(cb, cudnnCreateConvolutionDescriptor(&p->conv)) &&
              CB_CUDNN(cb, cudnnSetTensor4dDescriptor(p->x, CUDNN_TENSOR_NCHW, t, (int)a->n, (int)a->c_in,
                                                      (int)a->h_in, (int)a->w_in)) &&
              CB_CUDNN(cb, cudnnSetTensor4dDescriptor(p->y, CUDNN_TENSOR_NCHW, t, (int)a->n, (int)a->c_out,
                                                      (int)a->h_out, (int)a->w_out)) &&
              CB_CUDNN(cb, cudnnSetFilter4dDescriptor(p->w, t, CUDNN_TENSOR_NCHW, (int)a->c_out, (int)a->c_in,
                                                      (int)a->kernel, (int)a->kernel)) &&
              CB_CUDNN(cb, cudnnSetConvolution2dDescriptor(p->conv, (int)a->padding, (int)a->padding, (int)a->stride,
                                                           (int)a->stride, 1, 1, CUDNN_CROSS_CORRELATION,
                                                           CUDNN_DATA_FLOAT)) &&
              CB_CUDNN(cb, cudnnSetConvolutionMathType(p->conv, math));
    if (!ok) {
        plan_destroy(p);
        return NULL;
    }
    p->next = cb->conv_plans;
    cb->conv_plans = p;
    return p;
}

constexpr size_t kMaxConvWorkspace = (size_t)1 << 30; /* algorithms wanting more are passed over */

/* The math type an entry of a _v7 list runs with. Each entry is an (algorithm, math type) pair and its
 * `memory` is that pair's workspace: cuDNN returns algorithms that have no tensor-op kernel "with
 * CUDNN_DEFAULT_MATH, and returned as such", so an entry runs with its own math type — except fp32
 * without TF32, which always runs with CUDNN_FMA_MATH (DEFAULT_MATH would allow TF32 on sm_80+). */
static cudnnMathType_t run_math(const struct conv_plan *p, cudnnMathType_t entry)
{
    return p->key.dt == DT_FP32 && !p->key.tf32 ? CUDNN_FMA_MATH : entry;
}

/* From a _v7 list (sorted fastest first), with workspace at most kMaxConvWorkspace: the first
 * deterministic entry whose own math type is the one it will run with; else the first deterministic
 * one, its workspace asked again for the math type it will run with (`ws_query(algo, &bytes)`, the
 * descriptor set to it); else the first working one (results may then vary in the last bits from run
 * to run, so a bit-exact resume is no longer guaranteed for this layer — said once on stderr rather
 * than refusing to train). The choice's math type goes to *math; the caller sets it on the descriptor
 * before each call. rules->exact (the exact16 plan): only `accept`ed algorithms and never a
 * non-deterministic one — the plain fp32 plan is the better fallback than either. */
struct pick_rules {
    const char *what; /* "forward", ...: for messages */
    bool soft;        /* finding nothing is no error (the caller falls back) */
    bool exact;       /* the exact16 plan: deterministic algorithms only, and only those `accept` allows */
};

template <typename Perf, typename Algo, typename WsQuery, typename Accept>
static bool pick(struct cuda_backend *cb, struct conv_plan *p, const Perf *perf, int count, Algo *algo, size_t *ws,
                 cudnnMathType_t *math, const struct pick_rules *rules, WsQuery ws_query, Accept accept)
{
    const char *what = rules->what;
    for (int pass = 0; pass < (rules->exact ? 2 : 3); pass++)
        for (int i = 0; i < count; i++) {
            const Perf &e = perf[i];
            cudnnMathType_t m = run_math(p, e.mathType);
            if ((rules->exact && !accept(e.algo)) || e.status != CUDNN_STATUS_SUCCESS || e.memory > kMaxConvWorkspace ||
                (pass < 2 && e.determinism != CUDNN_DETERMINISTIC) || (pass == 0 && m != e.mathType))
                continue;
            size_t bytes = e.memory;
            if (m != e.mathType && (cudnnSetConvolutionMathType(p->conv, m) != CUDNN_STATUS_SUCCESS ||
                                    !ws_query(e.algo, &bytes) || bytes > kMaxConvWorkspace))
                continue;
            *algo = e.algo;
            *ws = bytes;
            *math = m;
            if (pass == 2)
                fprintf(stderr, "%s: warning: cuDNN has no deterministic %s algorithm for a convolution; "
                        "using a non-deterministic one\n", cb->name, what);
            return true;
        }
    if (rules->soft)
        return false;
    cuda_record(cb, "try another precision mode or batch size; report the layer's shape",
                "cuDNN offers no %s algorithm for this convolution", what);
    return false;
}

constexpr int kMaxAlgos = 16;

/* cuDNN's answer to a query: in soft mode a refusal is "no algorithm", not a recorded error. */
static bool dnn_query(struct cuda_backend *cb, cudnnStatus_t s, bool soft, const char *what)
{
    if (s == CUDNN_STATUS_SUCCESS)
        return true;
    if (!soft)
        cudnn_ok_(cb, s, __FILE__, __LINE__, what);
    return false;
}

/* soft: a 16-bit plan that cuDNN cannot serve falls back to fp32 in the caller */
static bool ensure_fwd(struct cuda_backend *cb, struct conv_plan *p, bool soft)
{
    if (p->have_fwd)
        return true;
    if (soft && p->refused_fwd)
        return false;
    cudnnConvolutionFwdAlgoPerf_t perf[kMaxAlgos];
    int count = 0;
    struct pick_rules rules = {"forward", soft, false};
    auto ws_query = [&](cudnnConvolutionFwdAlgo_t algo, size_t *bytes) {
        return cudnnGetConvolutionForwardWorkspaceSize(cb->dnn, p->x, p->w, p->conv, p->y, algo, bytes) ==
               CUDNN_STATUS_SUCCESS;
    };
    if (!CB_CUDNN(cb, cudnnSetConvolutionMathType(p->conv, p->math)) ||
        !dnn_query(cb, cudnnGetConvolutionForwardAlgorithm_v7(cb->dnn, p->x, p->w, p->conv, p->y, kMaxAlgos, &count,
                                                              perf),
                   soft, "cudnnGetConvolutionForwardAlgorithm_v7") ||
        !pick(cb, p, perf, count, &p->fwd, &p->ws_fwd, &p->fwd_math, &rules, ws_query,
              [](cudnnConvolutionFwdAlgo_t) { return true; })) {
        p->refused_fwd = soft;
        return false;
    }
    return p->have_fwd = true;
}

static bool ensure_bwd_data(struct cuda_backend *cb, struct conv_plan *p, bool soft)
{
    if (p->have_bwd_data)
        return true;
    if (soft && p->refused_bwd_data)
        return false;
    cudnnConvolutionBwdDataAlgoPerf_t perf[kMaxAlgos];
    int count = 0;
    struct pick_rules rules = {"backward-data", soft, false};
    auto ws_query = [&](cudnnConvolutionBwdDataAlgo_t algo, size_t *bytes) {
        return cudnnGetConvolutionBackwardDataWorkspaceSize(cb->dnn, p->w, p->y, p->conv, p->x, algo, bytes) ==
               CUDNN_STATUS_SUCCESS;
    };
    if (!CB_CUDNN(cb, cudnnSetConvolutionMathType(p->conv, p->math)) ||
        !dnn_query(cb, cudnnGetConvolutionBackwardDataAlgorithm_v7(cb->dnn, p->w, p->y, p->conv, p->x, kMaxAlgos,
                                                                   &count, perf),
                   soft, "cudnnGetConvolutionBackwardDataAlgorithm_v7") ||
        !pick(cb, p, perf, count, &p->bwd_data, &p->ws_bwd_data, &p->bwd_data_math, &rules, ws_query,
              [](cudnnConvolutionBwdDataAlgo_t) { return true; })) {
        p->refused_bwd_data = soft;
        return false;
    }
    return p->have_bwd_data = true;
}

/* An algorithm that reads x and dy as they are: no FFT or Winograd transform (the exact16 plan). */
static bool gemm_shaped(cudnnConvolutionBwdFilterAlgo_t algo)
{
    return algo == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 || algo == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1 ||
           algo == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3;
}

/* soft: the exact16 plan, which falls back to the plain fp32 plan in the caller */
static bool ensure_bwd_filter(struct cuda_backend *cb, struct conv_plan *p, bool soft)
{
    if (p->have_bwd_filter)
        return true;
    if (soft && p->refused_bwd_filter)
        return false;
    cudnnConvolutionBwdFilterAlgoPerf_t perf[kMaxAlgos];
    int count = 0;
    struct pick_rules rules = {"backward-filter", soft, p->key.exact16 != 0};
    auto ws_query = [&](cudnnConvolutionBwdFilterAlgo_t algo, size_t *bytes) {
        return cudnnGetConvolutionBackwardFilterWorkspaceSize(cb->dnn, p->x, p->y, p->conv, p->w, algo, bytes) ==
               CUDNN_STATUS_SUCCESS;
    };
    if (!CB_CUDNN(cb, cudnnSetConvolutionMathType(p->conv, p->math)) ||
        !dnn_query(cb, cudnnGetConvolutionBackwardFilterAlgorithm_v7(cb->dnn, p->x, p->y, p->conv, p->w, kMaxAlgos,
                                                                     &count, perf),
                   soft, "cudnnGetConvolutionBackwardFilterAlgorithm_v7") ||
        !pick(cb, p, perf, count, &p->bwd_filter, &p->ws_bwd_filter, &p->bwd_filter_math, &rules, ws_query,
              gemm_shaped)) {
        p->refused_bwd_filter = soft;
        return false;
    }
    return p->have_bwd_filter = true;
}

/* `t` as an fp32 device buffer: its data when fp32, else a widened copy in `slot`. */
static const void *as_f32(struct cuda_backend *cb, enum cuda_scratch_slot slot, const struct tensor *t)
{
    if (t->dtype == DT_FP32)
        return t->data;
    void *p = cuda_scratch(cb, slot, t->numel * sizeof(float));
    if (p && !CB_CUDA(cb, (cudaError_t)cuda_convert(p, DT_FP32, t->data, t->dtype, t->numel, cb->stream)))
        return NULL;
    return p;
}

static void *workspace(struct cuda_backend *cb, size_t bytes)
{
    return cuda_scratch(cb, CSCR_CONV_WS, bytes ? bytes : 256);
}

void cuda_conv2d_forward(struct backend *be, const struct conv_args *a, struct tensor *y, const struct tensor *x,
                         const struct tensor *w, const struct tensor *bias)
{
    struct cuda_backend *cb = cuda_of(be);
    if (a->n <= 0)
        return;
    bool native = x->dtype == w->dtype && x->dtype == y->dtype;
    struct conv_plan *p = plan_get(cb, a, native ? y->dtype : DT_FP32, false);
    if (p && native && y->dtype != DT_FP32 && !ensure_fwd(cb, p, true)) { /* no 16-bit kernel: run in fp32 */
        native = false;
        p = plan_get(cb, a, DT_FP32, false);
    }
    enum dtype dt = native ? y->dtype : DT_FP32;
    if (!p || !ensure_fwd(cb, p, false))
        return;
    const void *xp = native ? x->data : as_f32(cb, CSCR_F32_0, x);
    const void *wp = native ? w->data : as_f32(cb, CSCR_F32_1, w);
    void *yp = native || y->dtype == DT_FP32 ? y->data : cuda_scratch(cb, CSCR_F32_2, y->numel * sizeof(float));
    void *ws = workspace(cb, p->ws_fwd);
    if (!xp || !wp || !yp || !ws)
        return;
    float one = 1.0f, zero = 0.0f;
    if (!CB_CUDNN(cb, cudnnSetConvolutionMathType(p->conv, p->fwd_math)) ||
        !CB_CUDNN(cb, cudnnConvolutionForward(cb->dnn, &one, p->x, xp, p->w, wp, p->conv, p->fwd, ws, p->ws_fwd, &zero,
                                              p->y, yp)))
        return;
    if (bias)
        cuda_add_channel_bias(cb, yp, dt, static_cast<const float *>(bias->data), a->n, a->c_out, a->h_out * a->w_out);
    if (yp != y->data)
        CB_CUDA(cb, (cudaError_t)cuda_convert(y->data, y->dtype, yp, DT_FP32, y->numel, cb->stream));
}

void cuda_conv2d_backward_data(struct backend *be, const struct conv_args *a, struct tensor *dx,
                               const struct tensor *dy, const struct tensor *w)
{
    struct cuda_backend *cb = cuda_of(be);
    if (a->n <= 0)
        return;
    bool native = dy->dtype == w->dtype && dy->dtype == dx->dtype;
    struct conv_plan *p = plan_get(cb, a, native ? dx->dtype : DT_FP32, false);
    if (p && native && dx->dtype != DT_FP32 && !ensure_bwd_data(cb, p, true)) { /* no 16-bit kernel: fp32 */
        native = false;
        p = plan_get(cb, a, DT_FP32, false);
    }
    if (!p || !ensure_bwd_data(cb, p, false))
        return;
    const void *dyp = native ? dy->data : as_f32(cb, CSCR_F32_0, dy);
    const void *wp = native ? w->data : as_f32(cb, CSCR_F32_1, w);
    void *dxp = native || dx->dtype == DT_FP32 ? dx->data : cuda_scratch(cb, CSCR_F32_2, dx->numel * sizeof(float));
    void *ws = workspace(cb, p->ws_bwd_data);
    if (!dyp || !wp || !dxp || !ws)
        return;
    float one = 1.0f, zero = 0.0f;
    if (!CB_CUDNN(cb, cudnnSetConvolutionMathType(p->conv, p->bwd_data_math)) ||
        !CB_CUDNN(cb, cudnnConvolutionBackwardData(cb->dnn, &one, p->w, wp, p->y, dyp, p->conv, p->bwd_data, ws,
                                                   p->ws_bwd_data, &zero, p->x, dxp)))
        return;
    if (dxp != dx->data)
        CB_CUDA(cb, (cudaError_t)cuda_convert(dx->data, dx->dtype, dxp, DT_FP32, dx->numel, cb->stream));
}

void cuda_conv2d_backward_filter(struct backend *be, const struct conv_args *a, struct tensor *dw, struct tensor *db,
                                 const struct tensor *dy, const struct tensor *x, float beta)
{
    struct cuda_backend *cb = cuda_of(be);
    if (a->n <= 0) { /* no samples: dw = beta * dw (db likewise) */
        if (beta != 1.0f) {
            float *d = static_cast<float *>(dw->data);
            if (beta == 0.0f) {
                CB_CUDA(cb, cudaMemsetAsync(d, 0, dw->numel * sizeof(float), cb->stream));
                if (db)
                    CB_CUDA(cb, cudaMemsetAsync(db->data, 0, db->numel * sizeof(float), cb->stream));
            } else
                cuda_record(cb, "this is a bug in the caller", "conv2d_backward_filter with n = 0 and beta %g", beta);
        }
        return;
    }
    /* 16-bit x and dy: the exact16 plan (TF32 tensor cores on exact copies) where cuDNN has one */
    bool both16 = x->dtype != DT_FP32 && dy->dtype != DT_FP32;
    struct conv_plan *p = both16 ? plan_get(cb, a, DT_FP32, true) : NULL;
    if (both16 && !p)
        return;
    if (p && !ensure_bwd_filter(cb, p, true))
        p = NULL;
    if (!p)
        p = plan_get(cb, a, DT_FP32, false);
    if (!p || !ensure_bwd_filter(cb, p, false))
        return;
    const void *xp = as_f32(cb, CSCR_F32_0, x);
    const void *dyp = as_f32(cb, CSCR_F32_1, dy);
    void *ws = workspace(cb, p->ws_bwd_filter);
    if (!xp || !dyp || !ws)
        return;
    float one = 1.0f;
    if (!CB_CUDNN(cb, cudnnSetConvolutionMathType(p->conv, p->bwd_filter_math)) ||
        !CB_CUDNN(cb, cudnnConvolutionBackwardFilter(cb->dnn, &one, p->x, xp, p->y, dyp, p->conv, p->bwd_filter, ws,
                                                     p->ws_bwd_filter, &beta, p->w, dw->data)))
        return;
    if (db)
        cuda_channel_sums(cb, static_cast<float *>(db->data), dy->data, dy->dtype, a->n, a->c_out,
                          a->h_out * a->w_out, beta);
}
