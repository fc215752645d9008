/*
 * comm_mpi.c — the MPI communicator (comm.h): every collective by MPI on host memory.
 *
 * Built where CMake finds MPI (AMP_HAVE_MPI). MPI_Init happens in comm_mpi_open, before the config is
 * read, so that a rank that cannot read its config can still tell the others (lib/dist.h, comm_agree).
 * Errors keep MPI's default handler, MPI_ERRORS_ARE_FATAL: a rank lost mid-collective aborts the job
 * instead of leaving the others waiting.
 *
 * Large buffers go in buckets of at most COMM_BUCKET elements (MPI counts are int, and a bounded
 * message keeps the transport's buffers bounded).
 */
#ifdef AMP_HAVE_MPI
#define _POSIX_C_SOURCE 200809L
#include "comm.h"

#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h> /* gethostname */

#define COMM_BUCKET ((size_t)1 << 22) /* elements per MPI call: 16 MiB of fp32 */

static MPI_Datatype mpi_type(enum comm_dtype dt)
{
    return dt == COMM_F32 ? MPI_FLOAT : dt == COMM_F64 ? MPI_DOUBLE : MPI_INT64_T;
}

static size_t type_size(enum comm_dtype dt)
{
    return dt == COMM_F32 ? 4 : 8;
}

static MPI_Op mpi_op(enum comm_op op)
{
    return op == COMM_SUM ? MPI_SUM : op == COMM_MAX ? MPI_MAX : MPI_MIN;
}

static void mpi_host_allreduce(struct comm *c, void *buf, size_t count, enum comm_dtype dt, enum comm_op op)
{
    (void)c;
    char *p = buf;
    for (size_t done = 0; done < count;) {
        size_t n = count - done < COMM_BUCKET ? count - done : COMM_BUCKET;
        MPI_Allreduce(MPI_IN_PLACE, p + done * type_size(dt), (int)n, mpi_type(dt), mpi_op(op), MPI_COMM_WORLD);
        done += n;
    }
}

/* The CPU backend's memory is host memory: the same call. */
static void mpi_reduce_sum(struct comm *c, void *buf, size_t count, enum comm_dtype dt)
{
    mpi_host_allreduce(c, buf, count, dt, COMM_SUM);
}

static void mpi_host_bcast(struct comm *c, void *buf, size_t bytes, int root)
{
    (void)c;
    char *p = buf;
    for (size_t done = 0; done < bytes;) {
        size_t n = bytes - done < COMM_BUCKET ? bytes - done : COMM_BUCKET;
        MPI_Bcast(p + done, (int)n, MPI_BYTE, root, MPI_COMM_WORLD);
        done += n;
    }
}

static void mpi_host_allgather(struct comm *c, const void *send, void *recv, size_t bytes)
{
    (void)c;
    MPI_Allgather(send, (int)bytes, MPI_BYTE, recv, (int)bytes, MPI_BYTE, MPI_COMM_WORLD);
}

static void mpi_abort(struct comm *c, int code)
{
    (void)c;
    fflush(stdout);
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, code);
    _Exit(code);
}

static void mpi_close(struct comm *c)
{
    int done = 0;
    MPI_Finalized(&done);
    if (!done)
        MPI_Finalize();
    free(c);
}

/* Ranks on this host, and distinct hosts, from a hash of the host name. */
static void count_hosts(struct comm *c)
{
    char name[256] = {0};
    gethostname(name, sizeof name - 1);
    uint64_t h = 1469598103934665603ull;
    for (const char *s = name; *s; s++)
        h = (h ^ (uint8_t)*s) * 1099511628211ull;
    uint64_t *all = calloc((size_t)c->world, sizeof *all);
    if (!all) { /* the others are in the gather below: end the job rather than leave them waiting */
        fprintf(stderr, "[rank %d] ampTrain: error: out of memory starting MPI\n", c->rank);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    MPI_Allgather(&h, 1, MPI_UINT64_T, all, 1, MPI_UINT64_T, MPI_COMM_WORLD);
    c->local_rank = 0;
    c->local_world = 0;
    c->hosts = 0;
    for (int r = 0; r < c->world; r++) {
        bool first = true;
        for (int q = 0; q < r; q++)
            first = first && all[q] != all[r];
        c->hosts += first;
        if (all[r] == h) {
            if (r < c->rank)
                c->local_rank++;
            c->local_world++;
        }
    }
    free(all);
}

enum amp_status comm_mpi_open(struct comm **out, int *argc, char ***argv, struct amp_error *err)
{
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited && MPI_Init(argc, argv) != MPI_SUCCESS)
        return amp_fail(err, AMP_ERR_INTERNAL, "check the mpirun command and the MPI installation",
                        "MPI_Init failed");
    struct comm *c = calloc(1, sizeof *c);
    if (!c) {
        MPI_Finalize();
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory");
    }
    *c = (struct comm){
        .transport = "mpi",
        .device_memory = false,
        .reduce_sum = mpi_reduce_sum,
        .host_allreduce = mpi_host_allreduce,
        .host_bcast = mpi_host_bcast,
        .host_allgather = mpi_host_allgather,
        .abort = mpi_abort,
        .close = mpi_close,
    };
    MPI_Comm_rank(MPI_COMM_WORLD, &c->rank);
    MPI_Comm_size(MPI_COMM_WORLD, &c->world);
    count_hosts(c);
    *out = c;
    return AMP_OK;
}

const char *comm_mpi_version(void)
{
    static char buf[MPI_MAX_LIBRARY_VERSION_STRING + 16];
    char lib[MPI_MAX_LIBRARY_VERSION_STRING] = {0};
    int len = 0;
    MPI_Get_library_version(lib, &len);
    char *nl = strpbrk(lib, ",\n");
    if (nl)
        *nl = '\0';
    snprintf(buf, sizeof buf, "MPI: built (%s)", lib);
    return buf;
}
#else
typedef int comm_mpi_unused; /* ISO C wants something in a translation unit */
#endif
