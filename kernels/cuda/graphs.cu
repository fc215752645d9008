/*
 * graphs.cu — CUDA Graphs for the training step (backend.h graph_begin / graph_end / graph_launch), and the op that
 * ends every step, window_store.
 *
 * A small model's step is a few hundred short kernels (fashion_mlp: ~0.2 ms a step on an H200), so the host's
 * launches, not the GPU, set its pace. The trainer records each piece of a step once (lib/engine/train.c,
 * graph_piece: one piece per micro-batch, the last with the step's tail) by stream capture on the backend's one
 * stream, and replays it with one cudaGraphLaunch a step. A replay runs the recorded kernels with the recorded
 * arguments, so every value that changes from step to step lives in device memory (the step for the dropout masks,
 * the log window's slot, the loss seed) and the same launches serve every step.
 *
 * Capture mode is cudaStreamCaptureModeThreadLocal: a call from this thread that may not be recorded (a cudaMalloc,
 * a synchronisation) fails instead of running. While recording, cuda_record (backend_cuda.cu) keeps a failure in
 * capture_why instead of the backend's status; cuda_scratch refuses to grow a slot and device_table_commit to upload
 * a changed table (a graph would own the new buffer, or read the pageable copy at replay). graph_end then drops the
 * recording and says why once; the trainer runs the piece plainly, where any error is recorded as usual.
 *
 * A graph names the scratch buffers it was recorded with, and reads the tensor tables in them as they are when it
 * runs. cuda_scratch raises scratch_gen whenever it replaces one (an evaluation with a larger batch, say), and
 * device_table_commit whenever it uploads a table with other entries; graph_launch refuses a graph recorded at an
 * older generation: the trainer records it again.
 */
#include "backend_cuda_internal.h"
#include <cstdio>
#include <cstdlib>
#include <cstring>

/* Say once a backend why a recording failed (stderr), the reason kept by cuda_record or the capture's own error. */
static void note_failure(struct cuda_backend *cb, const char *why)
{
    if (cb->graph_noted)
        return;
    cb->graph_noted = true;
    fprintf(stderr, "%s: note: CUDA graphs off for this run: a step could not be recorded (%s); its ops are queued one "
            "by one (set AMPTRAIN_CUDA_GRAPHS=0 to skip the attempt)\n", cb->name, why);
}

static bool cu_graph_begin(struct backend *be)
{
    struct cuda_backend *cb = cuda_of(be);
    if (cb->status != AMP_OK || cb->capturing)
        return false;
    cudaError_t e = cudaStreamBeginCapture(cb->stream, cudaStreamCaptureModeThreadLocal);
    if (e != cudaSuccess) {
        cudaGetLastError(); /* not sticky: the step runs plainly */
        char why[160];
        snprintf(why, sizeof why, "cudaStreamBeginCapture: %s", cudaGetErrorName(e));
        note_failure(cb, why);
        return false;
    }
    cb->capturing = true;
    cb->capture_failed = false;
    cb->capture_why[0] = '\0';
    return true;
}

static void drop_graph(struct cuda_backend *cb, int key)
{
    if (cb->graph_exec[key])
        CB_CUDA(cb, cudaGraphExecDestroy(cb->graph_exec[key]));
    cb->graph_exec[key] = nullptr;
}

static bool cu_graph_end(struct backend *be, int key)
{
    struct cuda_backend *cb = cuda_of(be);
    if (!cb->capturing)
        return false;
    uint64_t gen = cb->scratch_gen;
    cudaGraph_t graph = nullptr;
    cudaError_t e = cudaStreamEndCapture(cb->stream, &graph); /* whatever the key: the stream leaves capture */
    cb->capturing = false;
    char why[sizeof cb->capture_why + 64];
    why[0] = '\0';
    if (key < 0 || key >= BACKEND_GRAPHS)
        snprintf(why, sizeof why, "graph key %d is not in [0, %d): a bug in the caller", key, BACKEND_GRAPHS);
    else if (cb->capture_failed)
        snprintf(why, sizeof why, "%s", cb->capture_why);
    else if (e != cudaSuccess)
        snprintf(why, sizeof why, "cudaStreamEndCapture: %s (%s)", cudaGetErrorName(e), cudaGetErrorString(e));
    cudaGraphExec_t exec = nullptr;
    if (!why[0]) {
        e = cudaGraphInstantiate(&exec, graph, 0);
        if (e != cudaSuccess) {
            exec = nullptr;
            snprintf(why, sizeof why, "cudaGraphInstantiate: %s (%s)", cudaGetErrorName(e), cudaGetErrorString(e));
        }
    }
    if (graph && cudaGraphDestroy(graph) != cudaSuccess && !why[0]) /* the instantiated copy stays */
        snprintf(why, sizeof why, "cudaGraphDestroy failed");
    cudaGetLastError(); /* a failed capture is not the run's error: the trainer runs the ops plainly */
    if (why[0]) {
        if (exec)
            cudaGraphExecDestroy(exec);
        cudaGetLastError();
        note_failure(cb, why);
        return false;
    }
    drop_graph(cb, key);
    cb->graph_exec[key] = exec;
    cb->graph_gen[key] = gen;
    return cb->status == AMP_OK;
}

static bool cu_graph_launch(struct backend *be, int key)
{
    struct cuda_backend *cb = cuda_of(be);
    if (key < 0 || key >= BACKEND_GRAPHS || !cb->graph_exec[key] || cb->capturing)
        return false;
    if (cb->graph_gen[key] != cb->scratch_gen) { /* it names a scratch buffer that has been replaced */
        drop_graph(cb, key);
        return false;
    }
    return CB_CUDA(cb, cudaGraphLaunch(cb->graph_exec[key], cb->stream));
}

void cuda_graphs_install(struct cuda_backend *cb)
{
    const char *env = getenv("AMPTRAIN_CUDA_GRAPHS"); /* 0 or 1, checked by backend_open */
    if (env && strcmp(env, "0") == 0)
        return;
    cb->base.graph_begin = cu_graph_begin;
    cb->base.graph_end = cu_graph_end;
    cb->base.graph_launch = cu_graph_launch;
}

void cuda_graphs_free(struct cuda_backend *cb)
{
    for (int k = 0; k < BACKEND_GRAPHS; k++)
        if (cb->graph_exec[k]) {
            cudaGraphExecDestroy(cb->graph_exec[k]);
            cb->graph_exec[k] = nullptr;
        }
}

/* ---- window_store ------------------------------------------------------------------------------------------ */

/* One block: the row by thread 0 (a struct copy), the counts grid-strided over the block, then, after every thread
 * has read the row, its zeroing and the slot's advance by thread 0. */
__global__ void window_store_kernel(struct step_row *row, const int64_t *counts, struct step_row *rows,
                                    int64_t *window_counts, int64_t ncounts, int64_t *slot)
{
    int64_t s = *slot;
    if (threadIdx.x == 0)
        rows[s] = *row;
    for (int64_t i = threadIdx.x; i < ncounts; i += blockDim.x)
        window_counts[s * ncounts + i] = counts[i];
    __syncthreads(); /* every thread read *slot and thread 0 the row before either changes */
    if (threadIdx.x == 0) {
        memset(row, 0, sizeof *row);
        *slot = s + 1;
    }
}

void cuda_window_store(struct backend *be, const struct window_store_args *a)
{
    struct cuda_backend *cb = cuda_of(be);
    window_store_kernel<<<1, kThreads, 0, cb->stream>>>(a->row, a->counts, a->rows, a->window_counts, a->ncounts,
                                                        a->slot);
    CB_LAUNCHED(cb, "window_store_kernel");
}
