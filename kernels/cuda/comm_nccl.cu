/*
 * comm_nccl.cu — NCCL between GPUs (comm.h, dist.backend nccl): the MPI communicator whose gradient
 * reduce is ncclAllReduce on the CUDA backend's stream.
 *
 * As llm.c arranges it: MPI starts the ranks and carries the host collectives; rank 0 makes the NCCL
 * unique id and MPI_Bcast gives it to every rank; ncclCommInitRank builds the communicator over the
 * ranks' devices (one per rank, chosen from the node-local rank by backend_open). reduce_sum is
 * queued on the backend's stream, after the backward that wrote the gradients and before the check
 * that reads them, so a step still never waits for the host. FP32 sums (ncclFloat), fp64 for the loss.
 *
 * The non-blocking reduce (a gradient bucket while backward runs, lib/engine/dist_overlap.h) is ncclAllReduce on a
 * second stream, `side`: reduce_start records `ready` on the backend's stream after the kernels that wrote the
 * bucket and makes `side` wait for it; reduce_wait records `done` on `side` and makes the backend's stream wait
 * for it, so the check and the update that read the sums follow them, and the host never waits. One pair of
 * events serves every bucket: a stream's wait takes the event as last recorded. Where the stream or the events
 * cannot be made, `side` is the backend's stream itself: the same sums, in order, without the overlap.
 *
 * dist.zero 1's collectives on the optimizer's blocks (reduce_scatter_blocks, reduce_scatter_start,
 * all_gather_blocks) are grouped ncclReduce and ncclBroadcast calls, one a rank's block, on device memory too.
 *
 * Built where CUDA, MPI and NCCL are found (AMP_HAVE_NCCL); compiled in CI, run only on GPUs.
 */
#ifdef AMP_HAVE_NCCL
#include <mpi.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_cuda.h"          /* nccl_comm_use, nccl_comm_release, nccl_version_line */
#include "backend_cuda_internal.h" /* struct cuda_backend, cuda_of, cuda_record */
extern "C" {
#include "comm.h"
}

struct nccl_state {
    ncclComm_t nccl;
    struct cuda_backend *cb;
    cudaStream_t side;         /* the non-blocking reduces' stream; cb->stream where it could not be made */
    cudaEvent_t ready, done;   /* backend stream -> side at a start, side -> backend stream at a wait */
    struct comm before; /* the communicator as it was: nccl_comm_release puts it back */
};

/* What reduce_start returns: the work is queued, reduce_wait orders the backend's stream after it. */
struct comm_request {
    int queued;
};
static struct comm_request queued_on_side = {1};

/* Queued even after this rank's backend recorded an error (its sums are then garbage, as every op's after an
 * error): the other ranks have queued theirs, and a rank that skipped one would leave them waiting on the GPU
 * (comm.h: no rank skips a collective). The ranks agree to stop at the step's end. */
static void all_reduce_on(struct nccl_state *s, void *buf, size_t count, enum comm_dtype dt, cudaStream_t stream)
{
    ncclDataType_t type = dt == COMM_F32 ? ncclFloat : dt == COMM_F64 ? ncclDouble : ncclInt64;
    ncclResult_t r = ncclAllReduce(buf, buf, count, type, ncclSum, s->nccl, stream);
    if (r != ncclSuccess)
        cuda_record(s->cb, "check NCCL_DEBUG=INFO output and that every rank has its own GPU",
                    "ncclAllReduce of %zu elements failed: %s", count, ncclGetErrorString(r));
}

static void nccl_reduce_sum(struct comm *c, void *buf, size_t count, enum comm_dtype dt)
{
    struct nccl_state *s = (struct nccl_state *)c->impl;
    all_reduce_on(s, buf, count, dt, s->cb->stream);
}

/* `a` waits for the work queued on `b` so far, through `ev`. */
static void stream_after(struct nccl_state *s, cudaStream_t a, cudaStream_t b, cudaEvent_t ev)
{
    cudaError_t e = cudaEventRecord(ev, b);
    if (e == cudaSuccess)
        e = cudaStreamWaitEvent(a, ev, 0);
    if (e != cudaSuccess)
        cuda_record(s->cb, NULL, "ordering the gradient reduce's stream: %s", cudaGetErrorString(e));
}

static struct comm_request *nccl_reduce_start(struct comm *c, void *buf, size_t count, enum comm_dtype dt)
{
    struct nccl_state *s = (struct nccl_state *)c->impl;
    if (s->side != s->cb->stream)
        stream_after(s, s->side, s->cb->stream, s->ready);
    all_reduce_on(s, buf, count, dt, s->side);
    return &queued_on_side;
}

static void nccl_reduce_progress(struct comm *c)
{
    (void)c; /* NCCL's kernels run on their own */
}

static void nccl_reduce_wait(struct comm *c, struct comm_request *r)
{
    struct nccl_state *s = (struct nccl_state *)c->impl;
    if (r && s->side != s->cb->stream)
        stream_after(s, s->cb->stream, s->side, s->done);
}

/* The second stream and its events; where any cannot be made, none: the backend's stream carries the reduces. */
static void make_side_stream(struct nccl_state *s)
{
    s->side = s->cb->stream;
    cudaStream_t side;
    if (cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking) != cudaSuccess)
        goto none;
    if (cudaEventCreateWithFlags(&s->ready, cudaEventDisableTiming) != cudaSuccess) {
        cudaStreamDestroy(side);
        goto none;
    }
    if (cudaEventCreateWithFlags(&s->done, cudaEventDisableTiming) != cudaSuccess) {
        cudaEventDestroy(s->ready);
        cudaStreamDestroy(side);
        goto none;
    }
    s->side = side;
    return;
none:
    (void)cudaGetLastError(); /* not the backend's error: the reduces still run, on its stream */
}

static void free_side_stream(struct nccl_state *s)
{
    if (s->side == s->cb->stream)
        return;
    cudaEventDestroy(s->ready);
    cudaEventDestroy(s->done);
    cudaStreamDestroy(s->side); /* released once its queued work is done */
}

/* Each rank's block (comm_shard) to every rank, in place: one ncclBroadcast a block, grouped (the blocks may differ
 * in size, which ncclAllGather does not allow), bytes only, on the backend's stream. Queued after an error too, as
 * nccl_reduce_sum. */
static void nccl_all_gather(struct comm *c, void *buf, size_t count, size_t elem_bytes)
{
    struct nccl_state *s = (struct nccl_state *)c->impl;
    ncclResult_t r = ncclGroupStart();
    for (int k = 0; k < c->world && r == ncclSuccess; k++) {
        size_t lo, hi;
        comm_shard(count, c->world, k, &lo, &hi);
        char *p = (char *)buf + lo * elem_bytes;
        if (hi > lo)
            r = ncclBroadcast(p, p, (hi - lo) * elem_bytes, ncclUint8, k, s->nccl, s->cb->stream);
    }
    ncclResult_t e = ncclGroupEnd();
    if (r == ncclSuccess)
        r = e;
    if (r != ncclSuccess)
        cuda_record(s->cb, "check NCCL_DEBUG=INFO output and that every rank has its own GPU",
                    "the all-gather (ncclBroadcast) of %zu elements failed: %s", count, ncclGetErrorString(r));
}

/* This rank's block (comm_shard) = the sum over the ranks, in place, on the backend's stream: ncclReduceScatter where
 * the blocks are equal (count a multiple of the world: in place, the block at buf + rank x count / world), else one
 * ncclReduce a block to its owner, grouped. The association is NCCL's (comm.h): fixed for a topology and an NCCL
 * version, not MPI's rank order, and not necessarily ncclAllReduce's. The rest of buf is undefined afterwards.
 * Queued after an error too, as nccl_reduce_sum. */
static void nccl_reduce_scatter(struct comm *c, void *buf, size_t count, enum comm_dtype dt)
{
    struct nccl_state *s = (struct nccl_state *)c->impl;
    ncclDataType_t type = dt == COMM_F32 ? ncclFloat : dt == COMM_F64 ? ncclDouble : ncclInt64;
    size_t es = dt == COMM_F32 ? 4 : 8, w = (size_t)c->world;
    ncclResult_t r;
    if (count % w == 0) {
        size_t block = count / w;
        r = ncclReduceScatter(buf, (char *)buf + (size_t)c->rank * block * es, block, type, ncclSum, s->nccl,
                              s->cb->stream);
    } else {
        r = ncclGroupStart();
        for (int k = 0; k < c->world && r == ncclSuccess; k++) {
            size_t lo, hi;
            comm_shard(count, c->world, k, &lo, &hi);
            char *p = (char *)buf + lo * es;
            if (hi > lo)
                r = ncclReduce(p, p, hi - lo, type, ncclSum, k, s->nccl, s->cb->stream);
        }
        ncclResult_t e = ncclGroupEnd();
        if (r == ncclSuccess)
            r = e;
    }
    if (r != ncclSuccess)
        cuda_record(s->cb, "check NCCL_DEBUG=INFO output and that every rank has its own GPU",
                    "the reduce-scatter of %zu elements failed: %s", count, ncclGetErrorString(r));
}

/* The collectives on the caller's blocks (comm.h: dist.zero 1's partition, bounds[0..world]) on device memory, as
 * the two above on comm_shard's: rank q's block [bounds[q], bounds[q + 1]) of buf reduced to q by one ncclReduce
 * each, grouped (in place: ncclReduce writes the root's buffer alone, so the other blocks stay as they were), on
 * `stream`; every block broadcast from its owner, grouped, bytes only. Queued after an error too, as
 * nccl_reduce_sum. */
static void reduce_blocks_on(struct nccl_state *s, int world, void *buf, const size_t *bounds, enum comm_dtype dt,
                             cudaStream_t stream)
{
    ncclDataType_t type = dt == COMM_F32 ? ncclFloat : dt == COMM_F64 ? ncclDouble : ncclInt64;
    size_t es = dt == COMM_F32 ? 4 : 8;
    ncclResult_t r = ncclGroupStart();
    for (int k = 0; k < world && r == ncclSuccess; k++) {
        char *p = (char *)buf + bounds[k] * es;
        if (bounds[k + 1] > bounds[k])
            r = ncclReduce(p, p, bounds[k + 1] - bounds[k], type, ncclSum, k, s->nccl, stream);
    }
    ncclResult_t e = ncclGroupEnd();
    if (r == ncclSuccess)
        r = e;
    if (r != ncclSuccess)
        cuda_record(s->cb, "check NCCL_DEBUG=INFO output and that every rank has its own GPU",
                    "the reduce-scatter of %zu elements onto the optimizer's blocks failed: %s", bounds[world],
                    ncclGetErrorString(r));
}

static void nccl_reduce_scatter_blocks(struct comm *c, void *buf, const size_t *bounds, enum comm_dtype dt)
{
    struct nccl_state *s = (struct nccl_state *)c->impl;
    reduce_blocks_on(s, c->world, buf, bounds, dt, s->cb->stream);
}

/* As nccl_reduce_start: queued on `side` after the backend's stream's work so far; nccl_reduce_wait orders the
 * backend's stream after it. */
static struct comm_request *nccl_reduce_scatter_start(struct comm *c, void *buf, const size_t *bounds,
                                                      enum comm_dtype dt)
{
    struct nccl_state *s = (struct nccl_state *)c->impl;
    if (s->side != s->cb->stream)
        stream_after(s, s->side, s->cb->stream, s->ready);
    reduce_blocks_on(s, c->world, buf, bounds, dt, s->side);
    return &queued_on_side;
}

static void nccl_all_gather_blocks(struct comm *c, void *buf, const size_t *bounds, size_t elem_bytes)
{
    struct nccl_state *s = (struct nccl_state *)c->impl;
    ncclResult_t r = ncclGroupStart();
    for (int k = 0; k < c->world && r == ncclSuccess; k++) {
        char *p = (char *)buf + bounds[k] * elem_bytes;
        if (bounds[k + 1] > bounds[k])
            r = ncclBroadcast(p, p, (bounds[k + 1] - bounds[k]) * elem_bytes, ncclUint8, k, s->nccl, s->cb->stream);
    }
    ncclResult_t e = ncclGroupEnd();
    if (r == ncclSuccess)
        r = e;
    if (r != ncclSuccess)
        cuda_record(s->cb, "check NCCL_DEBUG=INFO output and that every rank has its own GPU",
                    "the all-gather (ncclBroadcast) of %zu elements in the optimizer's blocks failed: %s",
                    bounds[c->world], ncclGetErrorString(r));
}

/* Before the backend goes (the NCCL communicator uses its device and stream). */
extern "C" void nccl_comm_release(struct comm *c)
{
    if (strcmp(c->transport, "nccl") != 0)
        return;
    struct nccl_state *s = (struct nccl_state *)c->impl;
    /* after an error, abort: ncclCommDestroy waits for the communicator's unfinished work, which a failed rank
     * may never finish */
    if (s->cb->status != AMP_OK)
        ncclCommAbort(s->nccl);
    else
        ncclCommDestroy(s->nccl);
    free_side_stream(s);
    *c = s->before;
    free(s);
}

static void nccl_close(struct comm *c)
{
    nccl_comm_release(c);
    c->close(c);
}

extern "C" enum amp_status nccl_comm_use(struct comm *c, struct backend *be, struct amp_error *err)
{
    if (strncmp(be->name, "cuda", 4) != 0)
        return amp_fail(err, AMP_ERR_CONFIG, "set run.device: cuda, or dist.backend: mpi",
                        "dist.backend is nccl, but the device is %s: NCCL reduces GPU memory only", be->name);
    if (strcmp(c->transport, "mpi") != 0 && c->world > 1)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "NCCL needs the MPI communicator underneath");
    /* one rank without mpirun: a one-rank NCCL communicator over the single communicator (no id to share) */
    struct nccl_state *s = (struct nccl_state *)calloc(1, sizeof *s);
    if (!s)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory");
    ncclUniqueId id;
    ncclResult_t r = ncclSuccess;
    if (c->rank == 0)
        r = ncclGetUniqueId(&id);
    int bad = r != ncclSuccess;
    if (c->world > 1) {
        MPI_Bcast(&bad, 1, MPI_INT, 0, MPI_COMM_WORLD);
        MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
    }
    if (!bad)
        r = ncclCommInitRank(&s->nccl, c->world, id, c->rank);
    if (bad || r != ncclSuccess) {
        free(s);
        enum amp_status st =
            amp_fail(err, AMP_ERR_INTERNAL, "run with NCCL_DEBUG=INFO to see why, or set dist.backend: mpi",
                     "NCCL communicator over %d ranks could not be made: %s", c->world,
                     ncclGetErrorString(bad ? ncclInternalError : r));
        if (!bad && c->world > 1) {
            /* this rank's init failed, and the others may be waiting inside ncclCommInitRank (a collective) for
             * it: they would never reach the agreement an error otherwise goes through, so end the job now, as
             * lib/engine/dist.c does where a rank cannot make a collective */
            if (err) {
                fprintf(stderr, "[rank %d] ", c->rank);
                amp_error_print(err, stderr);
            }
            c->abort(c, AMP_ERR_INTERNAL);
        }
        return st;
    }
    s->cb = cuda_of(be);
    make_side_stream(s);
    s->before = *c;
    c->impl = s;
    c->transport = "nccl";
    c->device_memory = true;
    c->reduce_sum = nccl_reduce_sum;
    c->reduce_scatter = nccl_reduce_scatter;
    c->reduce_start = nccl_reduce_start;
    c->reduce_progress = nccl_reduce_progress;
    c->reduce_wait = nccl_reduce_wait;
    c->all_gather = nccl_all_gather;
    c->reduce_scatter_blocks = nccl_reduce_scatter_blocks; /* device memory; host_gather_blocks stays MPI's */
    c->reduce_scatter_start = nccl_reduce_scatter_start;
    c->all_gather_blocks = nccl_all_gather_blocks;
    c->close = nccl_close;
    return AMP_OK;
}

extern "C" const char *nccl_version_line(void)
{
    static char buf[64];
    int v = 0;
    ncclGetVersion(&v);
    snprintf(buf, sizeof buf, "NCCL: built (%d.%d.%d)", v / 10000, (v / 100) % 100, v % 100);
    return buf;
}
#endif
