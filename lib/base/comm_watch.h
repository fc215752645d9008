/*
 * comm_watch.h — the collective watchdog of a data-parallel job (dist.timeout_s, docs/distributed.md).
 *
 * A rank that dies ends the job (mpirun sees it go). A rank that stalls instead — a hung filesystem or
 * device, a stopped process, a paused host — leaves the others waiting inside a collective for ever: MPI's
 * blocking calls have no time limit. PyTorch's answer is a watchdog thread that ends the job once a
 * collective has waited past the process group's timeout; this is the same for ampTrain's communicator.
 *
 * The communicator marks each wait for the other ranks (comm_watch_begin / comm_watch_end around a
 * blocking collective, or around making the NCCL communicator). One thread per process, started at the
 * first wait of a watch with a limit, wakes every tenth of the limit (at most 1 s, at least 10 ms) and, when
 * the current wait has lasted longer than the limit, prints which wait and how long, naming the key, then
 * ends this process with exit code 1; mpirun then ends the other ranks. The thread never calls MPI (so no call
 * stuck inside MPI, the main thread's or comm_mpi.c's progress thread's, holds it up): a rank that leaves without
 * MPI_Finalize is what makes mpirun end the job.
 *
 * The waits cost one uncontended mutex each; the collectives themselves are the same calls as without it,
 * so no result changes.
 */
#ifndef AMP_COMM_WATCH_H
#define AMP_COMM_WATCH_H

#include <stddef.h>

struct comm_watch;

/* A watch for rank `rank` with limit `timeout_s` (0: none); NULL when out of memory (then nothing is
 * watched: every function below takes NULL). No thread yet. */
struct comm_watch *comm_watch_new(int rank, double timeout_s);
/* The limit from now on (dist.timeout_s once the config is read; 0: none). */
void comm_watch_set_timeout(struct comm_watch *w, double timeout_s);
double comm_watch_timeout(const struct comm_watch *w);
/* This rank starts waiting for the others in `what` (a phrase: "an all-reduce of 4096 fp32 values"; copied). */
void comm_watch_begin(struct comm_watch *w, const char *what);
/* ... and no longer waits. */
void comm_watch_end(struct comm_watch *w);
/* Stops and joins the thread. */
void comm_watch_free(struct comm_watch *w);

#endif
