/*
 * comm.c — the single-rank communicator, launcher detection, and what the build has (comm.h).
 *
 * Without a launcher every collective is the identity: one rank's sum, max, broadcast and gather of
 * itself. So the trainer calls the same collectives whether it runs alone or in a job of N ranks, and a
 * one-rank run is exactly today's.
 */
#define _POSIX_C_SOURCE 200809L
#include "comm.h"

#include <stdlib.h>
#include <string.h>

#include "comm_watch.h"    /* the waits for other ranks */
#include "device_module.h" /* the NCCL communicator, in the CUDA backend module */

static void single_reduce_sum(struct comm *c, void *buf, size_t count, enum comm_dtype dt)
{
    (void)c, (void)buf, (void)count, (void)dt;
}

static void single_reduce_scatter(struct comm *c, void *buf, size_t count, enum comm_dtype dt)
{
    (void)c, (void)buf, (void)count, (void)dt;
}

static struct comm_request *single_reduce_start(struct comm *c, void *buf, size_t count, enum comm_dtype dt)
{
    (void)c, (void)buf, (void)count, (void)dt;
    return NULL; /* one rank's sum is its buffer: done */
}

static void single_reduce_progress(struct comm *c)
{
    (void)c;
}

static void single_reduce_wait(struct comm *c, struct comm_request *r)
{
    (void)c, (void)r;
}

static void single_all_gather(struct comm *c, void *buf, size_t count, size_t elem_bytes)
{
    (void)c, (void)buf, (void)count, (void)elem_bytes;
}

static void single_host_gather(struct comm *c, const void *send, void *recv, size_t count, size_t elem_bytes, int root)
{
    (void)c, (void)root;
    if (recv && recv != send)
        memmove(recv, send, count * elem_bytes);
}

static void single_reduce_scatter_blocks(struct comm *c, void *buf, const size_t *bounds, enum comm_dtype dt)
{
    (void)c, (void)buf, (void)bounds, (void)dt;
}

static struct comm_request *single_reduce_scatter_start(struct comm *c, void *buf, const size_t *bounds,
                                                        enum comm_dtype dt)
{
    (void)c, (void)buf, (void)bounds, (void)dt;
    return NULL;
}

static void single_all_gather_blocks(struct comm *c, void *buf, const size_t *bounds, size_t elem_bytes)
{
    (void)c, (void)buf, (void)bounds, (void)elem_bytes;
}

static void single_host_gather_blocks(struct comm *c, const void *send, void *recv, const size_t *bounds,
                                      size_t elem_bytes, int root)
{
    single_host_gather(c, send, recv, bounds[1], elem_bytes, root);
}

static void single_host_allreduce(struct comm *c, void *buf, size_t count, enum comm_dtype dt, enum comm_op op)
{
    (void)c, (void)buf, (void)count, (void)dt, (void)op;
}

static void single_host_bcast(struct comm *c, void *buf, size_t bytes, int root)
{
    (void)c, (void)buf, (void)bytes, (void)root;
}

static void single_host_allgather(struct comm *c, const void *send, void *recv, size_t bytes)
{
    (void)c;
    if (recv != send)
        memmove(recv, send, bytes);
}

static void single_abort(struct comm *c, int code)
{
    (void)c;
    _Exit(code);
}

static void single_close(struct comm *c)
{
    (void)c;
}

struct comm *comm_single(void)
{
    static struct comm single = {
        .rank = 0, .world = 1, .local_rank = 0, .local_world = 1, .hosts = 1,
        .transport = "none",
        .device_memory = true, /* the identity works on any memory */
        .reduce_sum = single_reduce_sum,
        .reduce_scatter = single_reduce_scatter,
        .reduce_start = single_reduce_start,
        .reduce_progress = single_reduce_progress,
        .reduce_wait = single_reduce_wait,
        .all_gather = single_all_gather,
        .host_allreduce = single_host_allreduce,
        .host_bcast = single_host_bcast,
        .host_allgather = single_host_allgather,
        .host_gather = single_host_gather,
        .abort = single_abort,
        .close = single_close,
        .reduce_scatter_blocks = single_reduce_scatter_blocks,
        .reduce_scatter_start = single_reduce_scatter_start,
        .all_gather_blocks = single_all_gather_blocks,
        .host_gather_blocks = single_host_gather_blocks,
    };
    return &single;
}

/* The world size a launcher announces (Open MPI's mpirun, PMI/PMIx: MPICH, Slurm's srun); 0 when this
 * process was not started by one. */
int comm_launched_world(void)
{
    static const char *const sizes[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        const char *v = getenv(sizes[i]);
        long n = v && *v ? strtol(v, NULL, 10) : 0;
        if (n >= 1 && n <= 1 << 20)
            return (int)n;
    }
    /* a PMIx launcher that sets a rank but no size: launched, size unknown until MPI_Init */
    return getenv("PMIX_RANK") || getenv("PMI_RANK") ? 1 : 0;
}

enum amp_status comm_open(struct comm **out, int *argc, char ***argv, struct amp_error *err)
{
    *out = comm_single();
    int world = comm_launched_world();
#ifdef AMP_HAVE_MPI
    if (world > 0)
        return comm_mpi_open(out, argc, argv, err);
    return AMP_OK;
#else
    (void)argc, (void)argv;
    if (world > 1)
        return amp_fail(err, AMP_ERR_CONFIG,
                        "install libopenmpi-dev and rebuild (scripts/build.sh), or run without mpirun",
                        "launched as %d ranks, but this ampTrain was built without MPI (ampTrain --version)", world);
    return AMP_OK;
#endif
}

void comm_set_timeout(struct comm *c, double seconds)
{
    comm_watch_set_timeout(c->watch, seconds);
}

void comm_close(struct comm *c)
{
    if (c)
        c->close(c);
}

#ifndef AMP_HAVE_MPI
const char *comm_mpi_version(void)
{
    return "MPI: not built (install libopenmpi-dev and rebuild for mpirun -np N)";
}
#endif

/* NCCL lives in the CUDA backend's module (lib/base/device_module.h, kernels/cuda/comm_nccl.cu): these reach it
 * through the module's table once backend_open has loaded it for a CUDA device. */
const char *comm_nccl_version(void)
{
    const struct device_module *m = device_module_cuda_loaded();
    if (m && m->nccl_version)
        return m->nccl_version();
#ifdef AMP_HAVE_NCCL
    return "NCCL: built (in the CUDA backend module, not loaded)";
#else
    return "NCCL: not built (needs the CUDA backend, MPI and nccl.h)";
#endif
}

bool comm_have_nccl(void)
{
    const struct device_module *m = device_module_cuda_loaded();
#ifdef AMP_HAVE_NCCL
    return !m || m->use_nccl; /* built with it; a loaded module answers for itself */
#else
    return m && m->use_nccl;
#endif
}

void comm_release_nccl(struct comm *c)
{
    const struct device_module *m = device_module_cuda_loaded();
    if (m && m->release_nccl)
        m->release_nccl(c);
}

enum amp_status comm_use_nccl(struct comm *c, struct backend *be, struct amp_error *err)
{
    const struct device_module *m = device_module_cuda_loaded();
    if (m && m->use_nccl) {
        /* the NCCL id's broadcast and ncclCommInitRank wait for every rank: watched as a collective */
        comm_watch_begin(c->watch, "making the NCCL communicator (ncclCommInitRank)");
        enum amp_status st = m->use_nccl(c, be, err);
        comm_watch_end(c->watch);
        return st;
    }
    return amp_fail(err, AMP_ERR_CONFIG, "set dist.backend: mpi (or auto), or rebuild where CUDA, MPI and NCCL are found",
                    "dist.backend is nccl, but this ampTrain was built without NCCL (ampTrain --version)");
}
