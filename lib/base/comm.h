/*
 * comm.h — the one seam between ranks: the communicator of data-parallel training (docs/distributed.md).
 *
 * ampTrain runs as N ranks launched by MPI (`mpirun -np N ampTrain run ...`), one per device. The engine
 * (lib/engine/train.c, lib/engine/dist.c) talks to the other ranks only through this table; it never calls MPI or
 * NCCL itself, and the implementations never look inside the engine's structures.
 *
 * Implementations:
 *  - none (comm_open without a launcher): one rank; every collective returns its input unchanged.
 *  - mpi (lib/base/comm_mpi.c, built where CMake finds MPI): every collective by MPI on host memory. The
 *    gradient reduce works on backend memory only where that is host memory (the CPU backend); the
 *    trainer stages through the host otherwise.
 *  - nccl (kernels/cuda/comm_nccl.cu, built where CUDA and NCCL are found): the mpi communicator whose
 *    `reduce_sum` is ncclAllReduce and `reduce_scatter` ncclReduceScatter (grouped ncclReduce where the blocks
 *    are unequal) on the CUDA backend's stream, on device memory; the NCCL unique id goes to every rank by
 *    MPI_Bcast. Host collectives stay MPI's.
 *
 * The non-blocking reduce (reduce_start, reduce_progress, reduce_wait) lets the trainer reduce a step's
 * gradients in buckets while backward still runs (lib/engine/dist_overlap.h): none finishes it at once, mpi starts
 * the exchange of a reduce-scatter (MPI_Ialltoallv) and a progress thread moves it on with MPI_Test while backward
 * computes, adds the blocks and starts their all-gather (MPI_Iallgatherv) (MPI progresses a non-blocking
 * collective only inside MPI calls; comm_mpi.c), nccl queues ncclAllReduce on a second CUDA stream
 * that waits, by an event, for the backend's stream to reach the point of the start, and the backend's stream
 * waits, by another, for the reduce at its wait.
 *
 * Rules every implementation keeps:
 *  - Every rank calls the same collectives in the same order with the same sizes. A rank that would
 *    skip one (an error, a signal) first tells the others through comm_agree (lib/engine/dist.h), so that no
 *    rank ever waits for a collective another rank will not make.
 *  - reduce_sum gives every rank the same bits. It may run asynchronously on the backend's queue (NCCL): the
 *    result is ready for the backend's next operation, not for the host.
 *  - The association of a sum over the ranks (mpi): every element is added in rank order, ((x0 + x1) + x2) + ...,
 *    each addition rounded to the dtype, by reduce_scatter, reduce_sum and a started reduce alike. reduce_scatter
 *    is an exchange of the blocks (MPI_Alltoallv: each rank gets every rank's values of its block of comm_shard)
 *    and the owner's sum of the N contributions; reduce_sum and a started reduce are that reduce-scatter followed
 *    by an all-gather of the blocks, in pieces of at most 2^22 elements. An element's sum does not depend on which
 *    rank adds it nor on how a buffer is cut into buckets or pieces, so a bucketed step gives the bits of one
 *    reduce after backward at any world size; with two ranks it is a + b, the bits of MPI_Allreduce and of one
 *    rank adding two micro-batches, and with N ranks it is one rank's accumulation of N micro-batches in order.
 *    MPI's own reduction algorithms choose an association by message size and world size; this one is fixed.
 *    nccl: NCCL's association (its ring or tree, fixed for a given topology and NCCL version, not rank order),
 *    the same on every run; ncclAllReduce and ncclReduceScatter need not associate alike. none: the identity.
 *    host_allreduce keeps MPI's own association (it sums values that are exact in any order: counts, and
 *    sums of one nonzero term a rank).
 *  - A started reduce is the communicator's until its wait: nothing reads or writes its buffer meanwhile. Every
 *    rank starts the same reduces in the same order, and waits for each.
 *  - Host collectives (host_*) are synchronous and take host memory.
 *  - A lost rank ends the job: MPI's default error handler aborts every rank (mpirun kills them).
 *    A stalled one ends it too: every wait of this rank for the others (each blocking collective, making
 *    the NCCL communicator, MPI_Finalize) is watched (lib/base/comm_watch.h), and one longer than the limit
 *    (dist.timeout_s, COMM_TIMEOUT_DEFAULT_S until the config is read) ends the job with exit code 1.
 *    Nothing waits for ever, except where the limit is 0, and except a GPU hung inside NCCL's all-reduce
 *    (the host waits for that in the CUDA backend's synchronisation, not here).
 */
#ifndef AMP_COMM_H
#define AMP_COMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "error.h" /* enum amp_status, struct amp_error */

/* The longest a rank waits for the others in one collective before it ends the job (dist.timeout_s's
 * default): 30 minutes, PyTorch's default process-group timeout. */
#define COMM_TIMEOUT_DEFAULT_S 1800.0

struct comm_watch;

enum comm_dtype { COMM_F32, COMM_F64, COMM_I64 };
enum comm_op { COMM_SUM, COMM_MAX, COMM_MIN };

struct comm_request; /* one started non-blocking reduce: the implementation's */

struct comm {
    int rank, world;          /* this rank, and the number of ranks */
    int local_rank, local_world; /* on this host (GPUs are chosen by local_rank) */
    int hosts;                /* distinct hosts */
    int cpus;                 /* the CPUs this rank has to itself: each CPU it may run on (sched_getaffinity)
                               * counted 1/k where k ranks of its host may run on it, the sum rounded down, at
                               * least 1; run.threads auto takes this many (dist_threads). 0 where not known
                               * (one rank without MPI, or no affinity to read): auto takes all it may run on */
    const char *transport;    /* "none", "mpi" or "nccl" */
    bool device_memory;       /* reduce_sum takes backend (device) memory; false: host memory */

    /* buf[0..count) = its sum over all ranks, in place, f32 or f64; device or host memory as above */
    void (*reduce_sum)(struct comm *c, void *buf, size_t count, enum comm_dtype dt);
    /* this rank's block [lo, hi) of buf (comm_shard of count) = the sum over all ranks of their buf[lo, hi), in
     * place, f32 or f64; the rest of buf is left as it was (mpi, none) or undefined (nccl). Memory as reduce_sum.
     * Per rank it sends (N-1)/N of buf and keeps 1/N summed: half of an all-reduce's traffic. */
    void (*reduce_scatter)(struct comm *c, void *buf, size_t count, enum comm_dtype dt);
    /* reduce_sum without waiting: starts it and returns its request, or NULL where the sum is done already
     * (one rank; no memory for a request: reduced at once). The buffer is the communicator's until reduce_wait. */
    struct comm_request *(*reduce_start)(struct comm *c, void *buf, size_t count, enum comm_dtype dt);
    /* moves every started reduce on, never waits (called each time backward finishes gradients) */
    void (*reduce_progress)(struct comm *c);
    /* ends r and frees it (NULL: nothing to do): its sum is then ready for the backend's next operation, as
     * reduce_sum's is; on the host this is a watched wait for the other ranks */
    void (*reduce_wait)(struct comm *c, struct comm_request *r);
    /* buf: `count` elements of `elem_bytes` each, split into the ranks' blocks by comm_shard; every rank's block
     * of buf goes to every rank, in place (an all-gather of uneven blocks: the last ones may be shorter or
     * empty, so any count works). Device or host memory as reduce_sum. Moves bytes: no arithmetic. */
    void (*all_gather)(struct comm *c, void *buf, size_t count, size_t elem_bytes);
    /* host memory, synchronous */
    void (*host_allreduce)(struct comm *c, void *buf, size_t count, enum comm_dtype dt, enum comm_op op);
    void (*host_bcast)(struct comm *c, void *buf, size_t bytes, int root);
    /* recv[r * bytes ..] = rank r's send[0..bytes) */
    void (*host_allgather)(struct comm *c, const void *send, void *recv, size_t bytes);
    /* On `root`, recv[0..count) (elements of elem_bytes) gets each rank r's send, its block of comm_shard; send holds
     * this rank's block only; recv is read on root alone (NULL elsewhere). Host memory. */
    void (*host_gather)(struct comm *c, const void *send, void *recv, size_t count, size_t elem_bytes, int root);
    /* end every rank now with `code` (after a rank's error that the others cannot hear about) */
    void (*abort)(struct comm *c, int code);
    void (*close)(struct comm *c);
    void *impl;
    struct comm_watch *watch; /* the waits for other ranks (comm_watch.h); NULL for one rank */

    /* The same collectives on blocks the caller gives rather than comm_shard's (dist.zero 1's partition of the
     * gradients, lib/engine/zero.h): bounds[0..world] non-decreasing from bounds[0] = 0, rank q's block
     * [bounds[q], bounds[q + 1]) of buf, bounds[world] its count. The memory reduce_sum takes: host memory (mpi,
     * none), device memory (nccl: one ncclReduce or ncclBroadcast a block, grouped; host_gather_blocks stays mpi's,
     * on host memory), with the association of the others (mpi: every element added in rank order; nccl: NCCL's).
     * reduce_scatter_blocks: this rank's block = the sum over the ranks, the rest of buf left as it was (mpi: in
     * pieces of at most 2^22 elements); reduce_scatter_start: the same started, ended by reduce_wait, with no
     * all-gather after it; all_gather_blocks and host_gather_blocks: all_gather's and host_gather's (send holds this
     * rank's block). */
    void (*reduce_scatter_blocks)(struct comm *c, void *buf, const size_t *bounds, enum comm_dtype dt);
    struct comm_request *(*reduce_scatter_start)(struct comm *c, void *buf, const size_t *bounds, enum comm_dtype dt);
    void (*all_gather_blocks)(struct comm *c, void *buf, const size_t *bounds, size_t elem_bytes);
    void (*host_gather_blocks)(struct comm *c, const void *send, void *recv, const size_t *bounds, size_t elem_bytes,
                               int root);
};

/* Rank r's block [*lo, *hi) of `count` elements split over `world` ranks: blocks of ceil(count / world), the last
 * ones shorter or empty (the sharded optimizer's split, lib/engine/zero.h; the blocks of all_gather and host_gather). */
static inline void comm_shard(size_t count, int world, int r, size_t *lo, size_t *hi)
{
    size_t block = world > 0 ? (count + (size_t)world - 1) / (size_t)world : count;
    size_t a = (size_t)r * block, b = a + block;
    *lo = a < count ? a : count;
    *hi = b < count ? b : count;
}

/* The communicator of this process. Launched by mpirun/srun (their environment says so) and built with
 * MPI: the MPI communicator over all ranks (MPI_Init here). Otherwise one rank. Launched with more
 * than one rank but built without MPI: AMP_ERR_CONFIG (N copies would each train alone). */
enum amp_status comm_open(struct comm **out, int *argc, char ***argv, struct amp_error *err);
/* The single-rank communicator (also for tests). */
struct comm *comm_single(void);
/* The longest this rank waits for the others in one collective from now on (dist.timeout_s; 0: no limit). */
void comm_set_timeout(struct comm *c, double seconds);
/* Ends MPI where it was started; NULL-safe. */
void comm_close(struct comm *c);

/* What the build has: "MPI: built (Open MPI 4.1.4)" / "MPI: not built"; the same for NCCL. */
const char *comm_mpi_version(void);
const char *comm_nccl_version(void);
bool comm_have_nccl(void);

/* The number of ranks the launcher says this job has; 0 when not started by a launcher. */
int comm_launched_world(void);

#ifdef AMP_HAVE_MPI
enum amp_status comm_mpi_open(struct comm **out, int *argc, char ***argv, struct amp_error *err);
/* For tests of the MPI communicator c: whether every MPI request of the started reduce r has been seen complete
 * (by the progress thread, or by reduce_progress; no MPI call here), and whether c's progress thread runs. */
bool comm_mpi_reduce_complete(struct comm *c, const struct comm_request *r);
bool comm_mpi_progress_thread(struct comm *c);
#endif

struct backend;
/* Switch c's gradient reduce to NCCL on the CUDA backend be's stream (dist.backend nccl). Returns
 * AMP_ERR_CONFIG where NCCL is not built or be is not a CUDA backend. */
enum amp_status comm_use_nccl(struct comm *c, struct backend *be, struct amp_error *err);
/* Back to the communicator comm_use_nccl found, before the backend closes; a no-op where NCCL is not in use. */
void comm_release_nccl(struct comm *c);

#endif
