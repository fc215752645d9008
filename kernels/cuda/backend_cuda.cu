/*
 * backend_cuda.cu — the CUDA backend's lifetime, memory, error recording and op table.
 *
 * cuda_backend_create opens one device: a non-blocking stream that every op is queued on, in call
 * order (so ops never need host synchronisation between them), a cuBLASLt handle with its 32 MB
 * workspace, and a cuDNN handle bound to the same stream. The ops live in the other files of kernels/
 * (see backend_cuda_internal.h for the map). upload is asynchronous (a pageable source is staged
 * before cudaMemcpyAsync returns, so the caller may reuse it at once); download waits for the stream.
 * A training step (losses, loss_sum, grad_stats, step_finish, the optimizer updates) never waits: its
 * scalars stay in device memory, so the host only synchronises when it downloads a window's log rows.
 *
 * Errors are sticky: the first CUDA/cuBLAS/cuDNN failure is kept with file, line and the call, and
 * status() returns it (also catching asynchronous kernel faults without blocking: cudaStreamQuery).
 */
#include "backend_cuda_internal.h"

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "backend_cuda.h" /* backend_cuda_peak_bytes */
#include "convert.h"      /* cuda_convert */
#include "cuda_check.h"   /* amp_cuda_hint, amp_cublas_hint, amp_cudnn_hint */

/* ---- error recording --------------------------------------------------------------------------- */

void cuda_record(struct cuda_backend *cb, const char *hint, const char *fmt, ...)
{
    if (cb->status != AMP_OK || (cb->capturing && cb->capture_failed))
        return;
    char msg[sizeof cb->err.msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (cb->capturing) { /* a failed recording: graphs.cu says why, and the caller runs the ops plainly */
        cb->capture_failed = true;
        snprintf(cb->capture_why, sizeof cb->capture_why, "%.300s", msg);
        return;
    }
    cb->status = amp_fail(&cb->err, AMP_ERR_INTERNAL, hint, "%s: %s", cb->name, msg);
}

bool cuda_ok_(struct cuda_backend *cb, cudaError_t e, const char *file, int line, const char *what)
{
    if (e == cudaSuccess)
        return true;
    cuda_record(cb, amp_cuda_hint(e), "%s:%d: CUDA error %s (%s) in %s", file, line, cudaGetErrorName(e),
                cudaGetErrorString(e), what);
    return false;
}

bool cublas_ok_(struct cuda_backend *cb, cublasStatus_t s, const char *file, int line, const char *what)
{
    if (s == CUBLAS_STATUS_SUCCESS)
        return true;
    cuda_record(cb, amp_cublas_hint(s), "%s:%d: cuBLAS error %s (%s) in %s", file, line, cublasGetStatusName(s),
                cublasGetStatusString(s), what);
    return false;
}

bool cudnn_ok_(struct cuda_backend *cb, cudnnStatus_t s, const char *file, int line, const char *what)
{
    if (s == CUDNN_STATUS_SUCCESS)
        return true;
    cuda_record(cb, amp_cudnn_hint(s), "%s:%d: cuDNN error %d (%s) in %s", file, line, (int)s,
                cudnnGetErrorString(s), what);
    return false;
}

/* ---- memory ------------------------------------------------------------------------------------ */

static void note_usage(struct cuda_backend *cb)
{
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess && total_b - free_b > cb->peak_used)
        cb->peak_used = total_b - free_b;
}

/* Free a scratch slot's buffer once the kernels queued before have used it: in stream order where the
 * device has memory pools, else after waiting for the stream (a slot grows rarely: a few times a run). */
static void scratch_release(struct cuda_backend *cb, void *p)
{
    if (cb->pools) {
        CB_CUDA(cb, cudaFreeAsync(p, cb->stream));
    } else {
        CB_CUDA(cb, cudaStreamSynchronize(cb->stream));
        CB_CUDA(cb, cudaFree(p));
    }
}

void *cuda_scratch(struct cuda_backend *cb, enum cuda_scratch_slot slot, size_t bytes)
{
    struct device_scratch *s = &cb->scr[slot];
    if (s->p && bytes <= s->cap)
        return s->p;
    if (cb->capturing) { /* a graph must not own the buffer: the ops run plainly, and grow it then */
        cuda_record(cb, NULL, "scratch slot %d grew to %zu bytes during the recording", (int)slot, bytes);
        return NULL;
    }
    size_t cap = ((bytes ? bytes : 1) + bytes / 4 + 255) & ~(size_t)255;
    cb->scratch_gen++; /* every graph naming the slot's old buffer is stale */
    if (s->p) {
        scratch_release(cb, s->p);
        s->p = NULL;
        s->cap = 0;
    }
    void *p = NULL;
    if (!CB_CUDA(cb, cb->pools ? cudaMallocAsync(&p, cap, cb->stream) : cudaMalloc(&p, cap)))
        return NULL;
    s->p = p;
    s->cap = cap;
    note_usage(cb);
    return p;
}

void *device_table_begin(struct cuda_backend *cb, struct device_table *t, size_t bytes, const char *what)
{
    if (bytes > t->cap) {
        void *b = malloc(bytes), *s = malloc(bytes);
        if (!b || !s) {
            free(b);
            free(s);
            cuda_record(cb, "free some host memory and try again", "%s: out of host memory for a %zu-byte table",
                        what, bytes);
            return NULL;
        }
        if (t->sent_bytes)
            memcpy(s, t->sent, t->sent_bytes);
        free(t->build);
        free(t->sent);
        t->build = b;
        t->sent = s;
        t->cap = bytes;
    }
    memset(t->build, 0, bytes);
    return t->build;
}

const void *device_table_commit(struct cuda_backend *cb, struct device_table *t, enum cuda_scratch_slot slot,
                                size_t bytes)
{
    const struct device_scratch *s = &cb->scr[slot];
    if (!s->p || bytes > s->cap)
        t->sent_bytes = 0; /* cuda_scratch replaces the buffer: what was uploaded is gone */
    void *dev = cuda_scratch(cb, slot, bytes);
    if (!dev) {
        t->sent_bytes = 0;
        return NULL;
    }
    if (t->sent_bytes == bytes && memcmp(t->sent, t->build, bytes) == 0)
        return dev;
    if (cb->capturing) { /* a graph would read the pageable copy when replayed: the ops run plainly instead */
        cuda_record(cb, NULL, "a %zu-byte tensor table changed during the recording", bytes);
        return NULL;
    }
    memcpy(t->sent, t->build, bytes);
    t->sent_bytes = 0;
    cb->scratch_gen++; /* a graph recorded with the old entries would read these: it is stale */
    if (!CB_CUDA(cb, cudaMemcpyAsync(dev, t->sent, bytes, cudaMemcpyHostToDevice, cb->stream)))
        return NULL;
    t->sent_bytes = bytes;
    return dev;
}

void device_table_free(struct device_table *t)
{
    free(t->build);
    free(t->sent);
    *t = (struct device_table){};
}

static void *cu_alloc(struct backend *be, size_t bytes)
{
    struct cuda_backend *cb = cuda_of(be);
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1); /* 256-byte aligned */
    if (e != cudaSuccess) {
        cudaGetLastError(); /* out of memory is not sticky: the caller reports it (tensor_alloc) */
        return NULL;
    }
    note_usage(cb);
    return p;
}

static void cu_free(struct backend *be, void *p)
{
    if (p)
        CB_CUDA(cuda_of(be), cudaFree(p));
}

static void cu_upload(struct backend *be, void *dst, const void *host_src, size_t bytes)
{
    struct cuda_backend *cb = cuda_of(be);
    if (bytes)
        CB_CUDA(cb, cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, cb->stream));
}

/* Staging from pinned memory: the copy is queued and the host goes on; an event per slot marks the
 * slot's last copy, and staging_wait waits for it before the host rewrites that memory. */
static void *cu_host_alloc(struct backend *be, size_t bytes)
{
    void *p = NULL;
    if (cudaMallocHost(&p, bytes ? bytes : 1) != cudaSuccess) {
        cudaGetLastError();
        (void)be;
        return NULL;
    }
    return p;
}

static void cu_host_free(struct backend *be, void *p)
{
    if (p)
        CB_CUDA(cuda_of(be), cudaFreeHost(p));
}

static void cu_upload_staged(struct backend *be, void *dst, const void *src, size_t bytes, int slot)
{
    struct cuda_backend *cb = cuda_of(be);
    if (bytes && CB_CUDA(cb, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, cb->stream)))
        cb->staged[slot] = CB_CUDA(cb, cudaEventRecord(cb->stage_done[slot], cb->stream));
}

/* The host gathers the rows into the pinned staging set (the caller waited for its last copy) and queues one copy. */
static void cu_upload_rows(struct backend *be, void *dst, const void *table, size_t row_bytes, const int64_t *idx,
                           int64_t n, void *staged, int slot)
{
    for (int64_t i = 0; i < n; i++)
        memcpy((char *)staged + (size_t)i * row_bytes, (const char *)table + (size_t)idx[i] * row_bytes, row_bytes);
    cu_upload_staged(be, dst, staged, (size_t)(n > 0 ? n : 0) * row_bytes, slot);
}

static void cu_staging_wait(struct backend *be, int slot)
{
    struct cuda_backend *cb = cuda_of(be);
    if (cb->staged[slot]) {
        CB_CUDA(cb, cudaEventSynchronize(cb->stage_done[slot]));
        cb->staged[slot] = false;
    }
}

static void cu_download(struct backend *be, void *host_dst, const void *src, size_t bytes)
{
    struct cuda_backend *cb = cuda_of(be);
    if (!bytes)
        return;
    CB_CUDA(cb, cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, cb->stream));
    CB_CUDA(cb, cudaStreamSynchronize(cb->stream));
}

static void cu_zero(struct backend *be, struct tensor *t)
{
    struct cuda_backend *cb = cuda_of(be);
    if (t->data && t->numel)
        CB_CUDA(cb, cudaMemsetAsync(t->data, 0, tensor_bytes(t), cb->stream));
}

static void cu_synchronize(struct backend *be)
{
    struct cuda_backend *cb = cuda_of(be);
    CB_CUDA(cb, cudaStreamSynchronize(cb->stream));
}

static void cu_convert(struct backend *be, struct tensor *dst, const struct tensor *src)
{
    struct cuda_backend *cb = cuda_of(be);
    if (dst->numel != src->numel) {
        cuda_record(cb, "this is a bug in the caller", "convert: %zu elements into %zu", src->numel, dst->numel);
        return;
    }
    if (src->dtype != dst->dtype && (dtype_is_fp8(src->dtype) || dtype_is_fp8(dst->dtype))) {
        /* the CPU's dtype_convert has the unscaled fp8 casts; nothing in a run asks the GPU for them (fp8 tensors
         * are made by fp8_cast, with their scales, and widened inside the products) */
        cuda_record(cb, "this is a bug in the caller: cast to fp8 with fp8_cast",
                    "convert: %s to %s is not implemented on the GPU", dtype_name(src->dtype), dtype_name(dst->dtype));
        return;
    }
    CB_CUDA(cb, (cudaError_t)cuda_convert(dst->data, dst->dtype, src->data, src->dtype, src->numel, cb->stream));
}

/* ---- status and lifetime ----------------------------------------------------------------------- */

static enum amp_status cu_status(struct backend *be, struct amp_error *err)
{
    struct cuda_backend *cb = cuda_of(be);
    cudaError_t e = cudaStreamQuery(cb->stream); /* a fault of a finished kernel shows here; never blocks */
    if (e != cudaSuccess && e != cudaErrorNotReady)
        CB_CUDA(cb, e);
    return amp_error_report(cb->status, &cb->err, err);
}

static void cu_destroy(struct backend *be)
{
    struct cuda_backend *cb = cuda_of(be);
    if (!cb)
        return;
    if (cb->stream)
        cudaStreamSynchronize(cb->stream);
    const char *memlog = getenv("AMPTRAIN_CUDA_MEMLOG");
    if (memlog && memlog[0] == '1')
        fprintf(stderr, "%s: peak device memory in use %.1f MiB\n", cb->name, (double)cb->peak_used / 1048576.0);
    cuda_gemm_plans_free(cb);
    cuda_conv_plans_free(cb);
    cuda_attention_fused_free(cb);
    cuda_graphs_free(cb);
    for (int i = 0; i < CSCR_COUNT; i++)
        if (cb->scr[i].p)
            scratch_release(cb, cb->scr[i].p);
    if (cb->stream)
        cudaStreamSynchronize(cb->stream);
    device_table_free(&cb->gs_table);
    device_table_free(&cb->gc_table);
    device_table_free(&cb->opt_table);
    for (int i = 0; i < BACKEND_STAGING_SLOTS; i++)
        if (cb->stage_done[i])
            cudaEventDestroy(cb->stage_done[i]);
    if (cb->lt_workspace)
        cudaFree(cb->lt_workspace);
    if (cb->lt)
        cublasLtDestroy(cb->lt);
    if (cb->dnn)
        cudnnDestroy(cb->dnn);
    if (cb->stream)
        cudaStreamDestroy(cb->stream);
    free(cb);
}

extern "C" size_t backend_cuda_peak_bytes(struct backend *be)
{
    if (!be || strncmp(be->name, "cuda", 4) != 0)
        return 0;
    return cuda_of(be)->peak_used;
}

extern "C" int cuda_device_count(void)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        cudaGetLastError(); /* no driver / no device: not an error for the caller, just none */
        return 0;
    }
    return count;
}

static void fill_table(struct backend *be)
{
    be->alloc = cu_alloc;
    be->free = cu_free;
    be->upload = cu_upload;
    be->download = cu_download;
    be->host_alloc = cu_host_alloc;
    be->host_free = cu_host_free;
    be->upload_staged = cu_upload_staged;
    be->staging_wait = cu_staging_wait;
    be->upload_rows = cu_upload_rows;
    be->zero = cu_zero;
    be->synchronize = cu_synchronize;
    be->convert = cu_convert;
    be->gemm = cuda_gemm;
    be->bias_grad = cuda_bias_grad;
    be->act_forward = cuda_act_forward;
    be->act_backward = cuda_act_backward;
    be->add = cuda_add;
    be->dropout_forward = cuda_dropout_forward;
    be->dropout_backward = cuda_dropout_backward;
    be->conv2d_forward = cuda_conv2d_forward;
    be->conv2d_backward_data = cuda_conv2d_backward_data;
    be->conv2d_backward_filter = cuda_conv2d_backward_filter;
    be->pool2d_forward = cuda_pool2d_forward;
    be->pool2d_backward = cuda_pool2d_backward;
    be->layernorm_forward = cuda_layernorm_forward;
    be->layernorm_backward = cuda_layernorm_backward;
    be->batchnorm_forward = cuda_batchnorm_forward;
    be->batchnorm_backward = cuda_batchnorm_backward;
    be->embedding_forward = cuda_embedding_forward;
    be->embedding_backward = cuda_embedding_backward;
    be->attention_forward = cuda_attention_forward;
    be->attention_backward = cuda_attention_backward;
    be->attention_decode = cuda_attention_decode;
    be->xent_forward_backward = cuda_xent_forward_backward;
    be->mse_forward_backward = cuda_mse_forward_backward;
    be->loss_sum = cuda_loss_sum;
    be->grad_stats = cuda_grad_stats;
    be->grad_part_numel = kGradPart;
    be->grad_stats_parts = cuda_grad_stats_parts;
    be->grad_stats_combine = cuda_grad_stats_combine;
    be->step_propose = cuda_step_propose;
    be->step_finish = cuda_step_finish;
    be->count_zeros = cuda_count_zeros;
    be->fp8_cast = cuda_fp8_cast;
    be->fp8_update = cuda_fp8_update;
    be->fp8_block_cast = cuda_fp8_block_cast;
    be->adamw_update = cuda_adamw_update;
    be->sgd_update = cuda_sgd_update;
    be->window_store = cuda_window_store;
    be->status = cu_status;
    be->destroy = cu_destroy;
    cuda_attention_fused_install(cuda_of(be)); /* where built with cuDNN's frontend */
    /* checked to be 0 or 1 by backend_open (lib/base/backend.c) */
    const char *fp8_epilogue = getenv("AMPTRAIN_FP8_CUBLASLT_EPILOGUE");
    cuda_of(be)->fp8_epilogue_off = fp8_epilogue && strcmp(fp8_epilogue, "0") == 0;
    const char *fp8_block = getenv("AMPTRAIN_FP8_BLOCK_CUBLASLT");
    cuda_of(be)->fp8_block_lt_off = fp8_block && strcmp(fp8_block, "0") == 0;
    cuda_graphs_install(cuda_of(be));          /* unless AMPTRAIN_CUDA_GRAPHS=0 */
}

extern "C" enum amp_status cuda_backend_create(struct backend **out, int device_index, struct amp_error *err)
{
    *out = NULL;
    int count = cuda_device_count();
    if (device_index < 0 || device_index >= count)
        return amp_fail(err, AMP_ERR_CONFIG, "set run.device: auto or cpu, or cuda:N with N below the device count "
                        "(see nvidia-smi and CUDA_VISIBLE_DEVICES)",
                        "CUDA device %d requested but %d device%s found", device_index, count, count == 1 ? " is" : "s are");
    struct cuda_backend *cb = static_cast<struct cuda_backend *>(calloc(1, sizeof *cb));
    if (!cb)
        return amp_fail(err, AMP_ERR_INTERNAL, "free some memory and try again", "out of memory creating the CUDA backend");
    snprintf(cb->name, sizeof cb->name, "cuda:%d", device_index);
    cb->base.name = cb->name;
    cb->device = device_index;
    fill_table(&cb->base);
    cb->base.vocab_align = 64; /* the token head's N: 50257 -> 50304, a size cuBLASLt runs at full speed */
    enum amp_status s = AMP_OK;
    do {
        if (!CB_CUDA(cb, cudaSetDevice(device_index)))
            break;
        if (!CB_CUDA(cb, cudaStreamCreateWithFlags(&cb->stream, cudaStreamNonBlocking)))
            break;
        /* stream-ordered allocation needs memory pools, which some devices and virtualised GPUs lack */
        int pools = 0;
        if (!CB_CUDA(cb, cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device_index)))
            break;
        cb->pools = pools != 0;
        int major = 0, minor = 0;
        if (!CB_CUDA(cb, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_index)) ||
            !CB_CUDA(cb, cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device_index)))
            break;
        cb->cc = major * 10 + minor;
        for (int i = 0; i < BACKEND_STAGING_SLOTS; i++)
            if (!CB_CUDA(cb, cudaEventCreateWithFlags(&cb->stage_done[i], cudaEventDisableTiming)))
                break;
        if (cb->status != AMP_OK)
            break;
        if (!CB_CUBLAS(cb, cublasLtCreate(&cb->lt)))
            break;
        if (!CB_CUDA(cb, cudaMalloc(&cb->lt_workspace, kLtWorkspaceBytes)))
            break;
        if (!CB_CUDNN(cb, cudnnCreate(&cb->dnn)))
            break;
        if (!CB_CUDNN(cb, cudnnSetStream(cb->dnn, cb->stream)))
            break;
        note_usage(cb);
    } while (0);
    if (cb->status != AMP_OK) {
        s = cb->status;
        if (err)
            *err = cb->err;
        cu_destroy(&cb->base);
        return s;
    }
    *out = &cb->base;
    return AMP_OK;
}

/* What was loaded, for `ampTrain --version` and gpu-check's summary: a version mismatch between the
 * libraries built against and those found at run time must never pass for a code bug. */
extern "C" void cuda_versions(char *buf, size_t len)
{
    int driver = 0, runtime = 0, count = 0;
    cudaDriverGetVersion(&driver);
    cudaRuntimeGetVersion(&runtime);
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        cudaGetLastError();
        count = 0;
    }
    size_t lt = cublasLtGetVersion(), dnn = cudnnGetVersion();
    int n = snprintf(buf, len, "CUDA loaded: driver %d.%d, runtime %d.%d, cuBLASLt %zu, cuDNN %zu.%zu.%zu (%s); ",
                     driver / 1000, driver % 1000 / 10, runtime / 1000, runtime % 1000 / 10, lt, dnn / 10000,
                     dnn / 100 % 100, dnn % 100, cuda_attention_fused_build());
    cudaDeviceProp prop;
    if (n > 0 && (size_t)n < len) {
        if (count > 0 && cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
            snprintf(buf + n, len - (size_t)n, "%d GPU%s, GPU 0: %s, compute capability %d.%d", count,
                     count == 1 ? "" : "s", prop.name, prop.major, prop.minor);
        else
            snprintf(buf + n, len - (size_t)n, "no GPU found");
    }
    cudaGetLastError();
}

/* For lib/base/backend.c (through the module table) and its "device: cuda:0 (NVIDIA H200, sm_90)" line. */
extern "C" int cuda_describe(int device_index, char *buf, size_t len)
{
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, device_index) != cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    snprintf(buf, len, "%s, sm_%d%d", prop.name, prop.major, prop.minor);
    return 0;
}
