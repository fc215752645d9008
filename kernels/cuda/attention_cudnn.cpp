/*
 * attention_cudnn.cpp — the fused causal attention (backend.h attention_fused_*): cuDNN's scaled-dot-product
 * attention (flash attention), forward and backward, through the cuDNN frontend's graph API (header-only C++,
 * cudnn_frontend.h, from PyPI's nvidia-cudnn-frontend: scripts/install-deps.sh; CMake's AMP_CUDNN_FRONTEND_DIR).
 * Built without those headers, this file gives the backend no fused attention (the table entries stay NULL) and
 * the present path (gemm_cublaslt.cu) runs everywhere.
 *
 * What it computes: for qkv (B, T, 3C) in d (bf16 or fp16), H heads of D = C/H, per (b, h): O = softmax(Q K^T *
 * 1/sqrt(D), causal: key j <= query i) V, fp32 inside (scores, the online softmax, the products' accumulators), O
 * rounded once to d. Q, K and V are read where they lie: dims {B, H, T, D} with strides {T*3C, D, 3C, 1} from qkv,
 * qkv + C and qkv + 2C; O is written into out (B, T, C) by strides {T*C, D, C, 1}; dQ, dK, dV into dqkv (B, T, 3C)
 * as Q, K, V are read (no split or merge copies, no (B, H, T, T) tensor kept between calls). The forward also writes
 * the softmax statistics, stats (B, H, T) fp32 (dims {B, H, T, 1}): per row the log-sum-exp of its scaled causal
 * scores, which is all the backward needs, with O and dO, to rebuild the probabilities tile by tile. The backward
 * runs cuDNN's deterministic algorithm (SDPA_backward_attributes::set_deterministic_algorithm): dQ is summed in a
 * fixed order, so the same inputs give the same bits on every run and resume stays bit-exact. On Hopper the frontend
 * serves that flag with its dP-workspace graph (scaled_dot_product_flash_attention.h: dQ = dS K with dS, (B, H, T, T)
 * in 16 bits, in the plan's workspace): the backward's workspace is then about B*H*T^2*2 bytes (T rounded up to 64),
 * for the call only.
 *
 * Plans: one frontend graph per (B, T, H, D, d, forward or backward), validated, lowered, checked for support,
 * built once and kept (most recently used first) until destroy, as conv_cudnn.cu keeps its convolution plans; a
 * shape cuDNN refuses is kept too, as a refusal, with one note on stderr naming it (this GPU, this cuDNN). A call
 * passes the pointers by uid. The workspace is the backend's cuDNN scratch slot (CSCR_CONV_WS), grown as needed.
 *
 * When it applies (cuda_attention_fused_supported, asked by the model at setup): d bf16 or fp16, D a multiple of 8
 * (cuDNN's limits decide the rest: head sizes 64 and 128 are its common case; 256 on newer cuDNN), both graphs built
 * for the batch size, and AMPTRAIN_CUDNN_ATTENTION not 0 (read when the backend is created: the unfused path for
 * comparisons). Elsewhere the model keeps the present path, whose probabilities it then allocates.
 *
 * Errors: every frontend and CUDA status goes to the backend's recorded error (cuda_record), with the shape; an
 * exception from the frontend (it parses JSON inside) is caught and recorded the same way.
 */
#include "backend_cuda_internal.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#ifdef AMP_HAVE_CUDNN_FRONTEND

#include <cudnn_frontend.h> /* cudnn_frontend::graph::Graph: sdpa, sdpa_backward */
#include <exception>
#include <memory>
#include <new> /* std::nothrow */
#include <string>
#include <unordered_map>

namespace fe = cudnn_frontend;

#define SDPA_STR_(x) #x
#define SDPA_STR(x) SDPA_STR_(x)
#define CUDNN_FE_VERSION_TEXT                                                                                         \
    SDPA_STR(CUDNN_FRONTEND_MAJOR_VERSION) "." SDPA_STR(CUDNN_FRONTEND_MINOR_VERSION) "." SDPA_STR(                 \
        CUDNN_FRONTEND_PATCH_VERSION)

/* The tensors of a graph, by uid (the variant pack of a call). */
enum sdpa_uid : int64_t { UID_Q = 1, UID_K, UID_V, UID_O, UID_STATS, UID_DO, UID_DQ, UID_DK, UID_DV };

struct sdpa_key {
    int64_t B, T, H, D;
    int32_t dt;       /* enum dtype: DT_BF16 or DT_FP16 */
    int32_t backward; /* 0 forward, 1 backward */
};

struct sdpa_plan {
    struct sdpa_key key;
    std::shared_ptr<fe::graph::Graph> graph; /* null: cuDNN refused the shape */
    std::string why;                         /* the refusal, for the note and the error */
    int64_t workspace = 0;                   /* bytes */
    struct sdpa_plan *next = nullptr;
};

static fe::DataType_t fe_type(enum dtype dt)
{
    return dt == DT_FP16 ? fe::DataType_t::HALF : fe::DataType_t::BFLOAT16;
}

static std::shared_ptr<fe::graph::Tensor_attributes> sdpa_tensor(fe::graph::Graph &g, const char *name, int64_t uid,
                                                                 const struct sdpa_key &k, int64_t row)
{
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(uid)
                        .set_dim({k.B, k.H, k.T, k.D})
                        .set_stride({k.T * row, k.D, row, 1}));
}

/* Mark an output (B, H, T, D) laid out with `row` elements between positions. */
static void sdpa_output(const std::shared_ptr<fe::graph::Tensor_attributes> &t, const char *name, int64_t uid,
                        const struct sdpa_key &k, int64_t row)
{
    t->set_output(true).set_name(name).set_uid(uid).set_dim({k.B, k.H, k.T, k.D}).set_stride({k.T * row, k.D, row, 1});
}

static std::shared_ptr<fe::graph::Tensor_attributes> stats_tensor(fe::graph::Graph &g, const struct sdpa_key &k)
{
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name("stats")
                        .set_uid(UID_STATS)
                        .set_dim({k.B, k.H, k.T, 1})
                        .set_stride({k.H * k.T, k.T, 1, 1})
                        .set_data_type(fe::DataType_t::FLOAT));
}

/* "" where st is good, else which step failed and the frontend's message. */
static std::string fe_why(fe::error_t st, const char *step)
{
    if (st.is_good())
        return "";
    std::string msg = st.get_message();
    return std::string(step) + ": " + (msg.empty() ? "no message" : msg);
}

/* The graph of key k (forward or backward), built for cb's handle; "" or why it cannot be. */
static std::string sdpa_build(struct cuda_backend *cb, const struct sdpa_key &k, std::shared_ptr<fe::graph::Graph> &out)
{
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(fe_type((enum dtype)k.dt))
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    int64_t C = k.H * k.D, qkv_row = 3 * C;
    float scale = 1.0f / sqrtf((float)k.D);
    auto q = sdpa_tensor(*g, "Q", UID_Q, k, qkv_row);
    auto kk = sdpa_tensor(*g, "K", UID_K, k, qkv_row);
    auto v = sdpa_tensor(*g, "V", UID_V, k, qkv_row);
    if (!k.backward) {
        auto opts = fe::graph::SDPA_attributes()
                        .set_name("causal_attention")
                        .set_generate_stats(true)
                        .set_attn_scale(scale)
                        .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                        .set_diagonal_band_right_bound(0);
        auto [o, stats] = g->sdpa(q, kk, v, opts);
        sdpa_output(o, "O", UID_O, k, C);
        if (!stats)
            return "the frontend's sdpa gave no statistics output";
        stats->set_output(true)
            .set_name("stats")
            .set_uid(UID_STATS)
            .set_data_type(fe::DataType_t::FLOAT)
            .set_dim({k.B, k.H, k.T, 1})
            .set_stride({k.H * k.T, k.T, 1, 1});
    } else {
        auto o = sdpa_tensor(*g, "O", UID_O, k, C);
        auto d_o = sdpa_tensor(*g, "dO", UID_DO, k, C);
        auto stats = stats_tensor(*g, k);
        auto opts = fe::graph::SDPA_backward_attributes()
                        .set_name("causal_attention_backward")
                        .set_attn_scale(scale)
                        .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                        .set_diagonal_band_right_bound(0)
                        .set_deterministic_algorithm(true);
        auto [dq, dk, dv] = g->sdpa_backward(q, kk, v, o, d_o, stats, opts);
        sdpa_output(dq, "dQ", UID_DQ, k, qkv_row);
        sdpa_output(dk, "dK", UID_DK, k, qkv_row);
        sdpa_output(dv, "dV", UID_DV, k, qkv_row);
    }
    std::string why = fe_why(g->validate(), "validate");
    if (why.empty())
        why = fe_why(g->build_operation_graph(cb->dnn), "build_operation_graph");
    if (why.empty())
        why = fe_why(g->create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans");
    if (why.empty())
        why = fe_why(g->check_support(cb->dnn), "check_support");
    if (why.empty())
        why = fe_why(g->build_plans(cb->dnn), "build_plans");
    if (why.empty())
        out = g;
    return why;
}

static void shape_text(char *buf, size_t len, const struct sdpa_key &k)
{
    snprintf(buf, len, "B=%lld T=%lld C=%lld H=%lld (head size %lld) %s", (long long)k.B, (long long)k.T,
             (long long)(k.H * k.D), (long long)k.H, (long long)k.D, dtype_name((enum dtype)k.dt));
}

/* The plan of key k: cached, or built now (a refusal is kept too, and noted once). NULL only when out of memory. */
static struct sdpa_plan *sdpa_plan_get(struct cuda_backend *cb, const struct sdpa_key &k)
{
    struct sdpa_plan **link = &cb->sdpa_plans;
    for (struct sdpa_plan *p = cb->sdpa_plans; p; link = &p->next, p = p->next)
        if (memcmp(&p->key, &k, sizeof k) == 0) {
            *link = p->next; /* most recently used first */
            p->next = cb->sdpa_plans;
            cb->sdpa_plans = p;
            return p;
        }
    struct sdpa_plan *p = new (std::nothrow) sdpa_plan;
    if (!p) {
        cuda_record(cb, NULL, "attention: out of host memory for a cuDNN plan");
        return NULL;
    }
    p->key = k;
    try {
        p->why = sdpa_build(cb, k, p->graph);
    } catch (const std::exception &e) {
        p->graph.reset();
        p->why = std::string("the frontend threw: ") + e.what();
    }
    if (p->graph) {
        fe::error_t st = p->graph->get_workspace_size(p->workspace);
        if (!st.is_good()) {
            p->graph.reset();
            p->why = "get_workspace_size: " + st.get_message();
        }
    }
    if (!p->graph) {
        char shape[160];
        shape_text(shape, sizeof shape, k);
        fprintf(stderr,
                "ampTrain: note: %s: cuDNN's fused attention refuses the %s of %s (%s): that attention keeps the "
                "unfused path, probabilities (B, H, T, T) included\n",
                cb->name, k.backward ? "backward" : "forward", shape, p->why.c_str());
    }
    p->next = cb->sdpa_plans;
    cb->sdpa_plans = p;
    return p;
}

static struct sdpa_key key_of(int64_t B, int64_t T, int64_t C, int64_t H, enum dtype d, bool backward)
{
    struct sdpa_key k;
    memset(&k, 0, sizeof k); /* compared with memcmp: padding zeroed */
    k.B = B;
    k.T = T;
    k.H = H;
    k.D = H > 0 ? C / H : 0;
    k.dt = d;
    k.backward = backward;
    return k;
}

static bool shape_fits(int64_t B, int64_t T, int64_t C, int64_t H, enum dtype d)
{
    return (d == DT_BF16 || d == DT_FP16) && B >= 1 && T >= 1 && H >= 1 && C % H == 0 && (C / H) % 8 == 0;
}

extern "C" bool cuda_attention_fused_supported(struct backend *be, int64_t B, int64_t T, int64_t C, int64_t H,
                                               enum dtype d)
{
    struct cuda_backend *cb = cuda_of(be);
    if (cb->sdpa_off || !shape_fits(B, T, C, H, d))
        return false;
    struct sdpa_plan *f = sdpa_plan_get(cb, key_of(B, T, C, H, d, false));
    if (!f || !f->graph)
        return false;
    struct sdpa_plan *b = sdpa_plan_get(cb, key_of(B, T, C, H, d, true));
    return b && b->graph;
}

/* The plan for a call, its workspace, and the checks every call makes; NULL (error recorded) when it cannot run. */
static struct sdpa_plan *call_plan(struct cuda_backend *cb, const struct sdpa_key &k, const void *const *ptrs, int n,
                                   void **workspace)
{
    char shape[160];
    shape_text(shape, sizeof shape, k);
    for (int i = 0; i < n; i++)
        if ((uintptr_t)ptrs[i] % 16 != 0) {
            cuda_record(cb, "keep attention tensors at 16-byte-aligned addresses (backend allocations are)",
                        "attention: a fused attention operand is not 16-byte aligned (%s)", shape);
            return NULL;
        }
    struct sdpa_plan *p = sdpa_plan_get(cb, k);
    if (!p)
        return NULL;
    if (!p->graph) {
        cuda_record(cb, "set AMPTRAIN_CUDNN_ATTENTION=0 to run the unfused attention everywhere",
                    "attention: cuDNN's fused attention refuses the %s of %s, which it accepted at setup for the "
                    "largest batch: %s", k.backward ? "backward" : "forward", shape, p->why.c_str());
        return NULL;
    }
    *workspace = NULL;
    if (p->workspace > 0 && !(*workspace = cuda_scratch(cb, CSCR_CONV_WS, (size_t)p->workspace)))
        return NULL;
    return p;
}

static void run_graph(struct cuda_backend *cb, const struct sdpa_plan *p, std::unordered_map<int64_t, void *> &pack,
                      void *workspace)
{
    std::string why;
    try {
        why = fe_why(p->graph->execute(cb->dnn, pack, workspace), "execute");
    } catch (const std::exception &e) {
        why = std::string("execute threw: ") + e.what();
    }
    if (!why.empty()) {
        char shape[160];
        shape_text(shape, sizeof shape, p->key);
        cuda_record(cb, "rerun with CUDNN_FRONTEND_LOG_INFO=1 CUDNN_FRONTEND_LOG_FILE=stderr to see why",
                    "attention: cuDNN's fused %s of %s failed: %s", p->key.backward ? "backward" : "forward", shape,
                    why.c_str());
        return;
    }
    CB_CUDA(cb, cudaGetLastError());
}

static bool same_dtype(struct cuda_backend *cb, const struct tensor *const *ts, int n, enum dtype d)
{
    for (int i = 0; i < n; i++)
        if (ts[i]->dtype != d) {
            cuda_record(cb, NULL, "attention: the fused attention's tensors must share qkv's dtype %s, got %s",
                        dtype_name(d), dtype_name(ts[i]->dtype));
            return false;
        }
    return true;
}

extern "C" void cuda_attention_fused_forward(struct backend *be, struct tensor *out, struct tensor *stats,
                                             const struct tensor *qkv, int64_t B, int64_t T, int64_t C, int64_t H)
{
    struct cuda_backend *cb = cuda_of(be);
    enum dtype d = qkv->dtype;
    const struct tensor *io[] = {out};
    if (!same_dtype(cb, io, 1, d) || stats->dtype != DT_FP32 || stats->numel < (size_t)(B * H * T) ||
        !shape_fits(B, T, C, H, d)) {
        cuda_record(cb, NULL, "attention: fused forward called outside its contract (B=%lld T=%lld C=%lld H=%lld)",
                    (long long)B, (long long)T, (long long)C, (long long)H);
        return;
    }
    char *base = static_cast<char *>(qkv->data);
    size_t cb_bytes = (size_t)C * dtype_size(d);
    void *ptrs[] = {base, base + cb_bytes, base + 2 * cb_bytes, out->data, stats->data};
    void *ws = NULL;
    struct sdpa_plan *p = call_plan(cb, key_of(B, T, C, H, d, false), ptrs, 5, &ws);
    if (!p)
        return;
    std::unordered_map<int64_t, void *> pack = {
        {UID_Q, ptrs[0]}, {UID_K, ptrs[1]}, {UID_V, ptrs[2]}, {UID_O, ptrs[3]}, {UID_STATS, ptrs[4]}};
    run_graph(cb, p, pack, ws);
}

extern "C" void cuda_attention_fused_backward(struct backend *be, struct tensor *dqkv, const struct tensor *dout,
                                              const struct tensor *qkv, const struct tensor *out,
                                              const struct tensor *stats, int64_t B, int64_t T, int64_t C, int64_t H)
{
    struct cuda_backend *cb = cuda_of(be);
    enum dtype d = qkv->dtype;
    const struct tensor *io[] = {dqkv, dout, out};
    if (!same_dtype(cb, io, 3, d) || stats->dtype != DT_FP32 || stats->numel < (size_t)(B * H * T) ||
        !shape_fits(B, T, C, H, d)) {
        cuda_record(cb, NULL, "attention: fused backward called outside its contract (B=%lld T=%lld C=%lld H=%lld)",
                    (long long)B, (long long)T, (long long)C, (long long)H);
        return;
    }
    char *base = static_cast<char *>(qkv->data), *dbase = static_cast<char *>(dqkv->data);
    size_t cb_bytes = (size_t)C * dtype_size(d);
    void *ptrs[] = {base, base + cb_bytes, base + 2 * cb_bytes, out->data, dout->data, stats->data,
                    dbase, dbase + cb_bytes, dbase + 2 * cb_bytes};
    void *ws = NULL;
    struct sdpa_plan *p = call_plan(cb, key_of(B, T, C, H, d, true), ptrs, 9, &ws);
    if (!p)
        return;
    std::unordered_map<int64_t, void *> pack = {{UID_Q, ptrs[0]},  {UID_K, ptrs[1]},  {UID_V, ptrs[2]},
                                                {UID_O, ptrs[3]},  {UID_DO, ptrs[4]}, {UID_STATS, ptrs[5]},
                                                {UID_DQ, ptrs[6]}, {UID_DK, ptrs[7]}, {UID_DV, ptrs[8]}};
    run_graph(cb, p, pack, ws);
}

void cuda_attention_fused_install(struct cuda_backend *cb)
{
    const char *env = getenv("AMPTRAIN_CUDNN_ATTENTION");
    cb->sdpa_off = env && strcmp(env, "0") == 0;
    cb->base.attention_fused_supported = cuda_attention_fused_supported;
    cb->base.attention_fused_forward = cuda_attention_fused_forward;
    cb->base.attention_fused_backward = cuda_attention_fused_backward;
}

void cuda_attention_fused_free(struct cuda_backend *cb)
{
    struct sdpa_plan *p = cb->sdpa_plans;
    while (p) {
        struct sdpa_plan *next = p->next;
        delete p;
        p = next;
    }
    cb->sdpa_plans = NULL;
}

const char *cuda_attention_fused_build(void)
{
    return "fused attention: cuDNN frontend " CUDNN_FE_VERSION_TEXT;
}

#else /* built without the cuDNN frontend's headers */

void cuda_attention_fused_install(struct cuda_backend *cb)
{
    (void)cb; /* the table's attention_fused_* stay NULL: the present path everywhere */
}

void cuda_attention_fused_free(struct cuda_backend *cb)
{
    (void)cb;
}

const char *cuda_attention_fused_build(void)
{
    return "fused attention: not built (no cuDNN frontend headers at build time)";
}

#endif
