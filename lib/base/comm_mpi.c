/*
 * comm_mpi.c — the MPI communicator (comm.h): every collective by MPI on host memory.
 *
 * Built where CMake finds MPI (AMP_HAVE_MPI). MPI_Init happens in comm_mpi_open, before the config is
 * read, so that a rank that cannot read its config can still tell the others (lib/engine/dist.h, comm_agree).
 * Errors keep MPI's default handler, MPI_ERRORS_ARE_FATAL: a rank lost mid-collective aborts the job
 * instead of leaving the others waiting. A rank that stalls is the watchdog's (comm_watch.h): every
 * blocking call here is one watched wait.
 *
 * Large buffers go in buckets of at most COMM_BUCKET elements (MPI counts are int, and a bounded
 * message keeps the transport's buffers bounded).
 *
 * The gradients' sums (reduce_sum, reduce_start, reduce_scatter) are not MPI_Allreduce's, whose association depends
 * on the message size and the world size (Open MPI's tuned module picks among recursive doubling, ring, Rabenseifner
 * and others), and not MPI_Reduce_scatter's either: each is an MPI_Alltoallv that brings the owner of each block
 * (comm_shard) every rank's values of it, the owner's sum of them in rank order, and, for an all-reduce, an
 * MPI_Allgatherv of the blocks (comm.h, "The association"). The owner holds N x its block of received values while
 * it adds (a scratch buffer for the blocking calls, the request's own memory for a started one: N x 1/N of a bucket).
 *
 * The non-blocking reduce is the same two collectives per COMM_BUCKET elements, MPI_Ialltoallv then
 * MPI_Iallgatherv: reduce_start starts the exchanges; whoever next sees one complete (the progress thread,
 * reduce_progress, reduce_wait) adds the block and starts the gather. The gathers start in the order of the
 * pieces on every rank, on a duplicate of MPI_COMM_WORLD (`gather`), so that the order of collectives on each
 * communicator is one on every rank however the threads interleave. Open MPI moves a non-blocking
 * collective only inside MPI calls (this build of it has no asynchronous progress: `ompi_info` says "OMPI
 * progress: no"), and the trainer makes none while a layer's op computes. So the first reduce_start
 * starts a progress thread that, while a started request is not complete, tests them (MPI_Test) every
 * COMM_PROGRESS_PAUSE_US microseconds, and sleeps on a condition variable otherwise: the buckets travel while
 * backward runs, not only between its ops. Two threads call MPI, never at once: MPI_Init_thread asks for
 * MPI_THREAD_SERIALIZED (Open MPI then takes none of MPI_THREAD_MULTIPLE's locks), and every MPI call of this
 * file holds the communicator's mutex `mu` (a blocking collective holds it throughout; the thread then waits,
 * which it may: the blocking call moves every request on itself). The thread calls MPI only with a request in
 * flight, so the MPI calls of other files (kernels/cuda/comm_nccl.cu's MPI_Bcast, made while none is) need no
 * mutex. Where MPI grants less than MPI_THREAD_SERIALIZED there is no thread: reduce_progress then tests the
 * requests each time backward finishes gradients, as it does where the thread cannot be started, and rank 0 says
 * so once.
 * A job that never starts a non-blocking reduce (one rank, dist.bucket_mb 0, NCCL) never starts the thread.
 * How often a request is tested changes when it completes, never its sum: the bits are the same, and the same as the
 * blocking reduce_sum's.
 *
 * The collectives on the caller's blocks (comm.h: reduce_scatter_blocks, reduce_scatter_start, all_gather_blocks,
 * host_gather_blocks; dist.zero 1's partition) are the same calls with other counts: a piece's blocks are its
 * intersections with the caller's (piece_block), and a started reduce-scatter's pieces are done once summed, with
 * no gather to start in order.
 */
#ifdef AMP_HAVE_MPI
#define _GNU_SOURCE /* sched_getaffinity, CPU_ISSET */
#include "comm.h"

#include <mpi.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h> /* pthread_sigmask: the progress thread takes no signal */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>   /* nanosleep, clock_gettime */
#include <unistd.h> /* gethostname */

#include "comm_watch.h"
#include "digest.h" /* digest_str: the host name */

#define COMM_BUCKET ((size_t)1 << 22) /* elements per MPI call: 16 MiB of fp32 */
/* The progress thread's pause between two rounds of tests while a reduce is in flight (nanosleep's timer slack, 50 us
 * by default, adds about as much). At 1 Gbit/s 100 us carry 12 KB, well within a TCP socket's buffer, so the link
 * does not idle between rounds; the thread took at most 2% of the CPU time of a rank's main thread in the runs of
 * docs/distributed.md, "Speed". */
#define COMM_PROGRESS_PAUSE_US 50

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

static const char *type_name(enum comm_dtype dt)
{
    return dt == COMM_F32 ? "fp32" : dt == COMM_F64 ? "fp64" : "int64";
}

static const char *op_name(enum comm_op op)
{
    return op == COMM_SUM ? "all-reduce (sum)" : op == COMM_MAX ? "all-reduce (max)" : "all-reduce (min)";
}

/* One piece of a sum over the ranks (at most COMM_BUCKET elements), in two collectives: the exchange
 * (MPI_Alltoallv) brings this rank every rank's values of its block of the piece (comm_shard), which it adds in rank
 * order; the gather (MPI_Allgatherv, in place) then gives every rank every block. */
enum piece_phase { PIECE_EXCHANGE, PIECE_SUM, PIECE_GATHER, PIECE_DONE };

struct piece {
    char *buf;             /* the piece's first element */
    size_t count;
    enum piece_phase phase; /* PIECE_EXCHANGE and PIECE_GATHER: req is in flight */
    MPI_Request req;
    int *t;                /* 4 world ints: the blocks' counts and offsets (sent and gathered), then what this rank
                            * receives: its block's count from each rank, and where (rank q's at q x its count) */
    void *recv;            /* world x this rank's block of received values, rank by rank */
};

/* One started reduce: its pieces, on the communicator's list of those in flight (the progress thread and
 * reduce_progress move them all on). */
struct comm_request {
    struct comm_request *next; /* started after this one */
    size_t count;
    enum comm_dtype dt;
    bool scatter_only; /* reduce_scatter_start: each piece done once its block is summed, no all-gather */
    int n;
    int left; /* pieces not yet done */
    struct piece p[];
};

struct mpi_state {
    pthread_mutex_t mu;   /* held around every MPI call of this file, and for everything below */
    pthread_cond_t work;  /* a reduce started, or the thread is to stop */
    pthread_t thread;
    bool serialized;      /* MPI granted MPI_THREAD_SERIALIZED: a progress thread may call it */
    bool running, stop;   /* the thread started; ... and is to end */
    bool said;            /* rank 0 said why there is no thread */
    int pending;          /* pieces of started reduces not yet done: the thread works while there are */
    struct comm_request *in_flight; /* started and not yet waited for, the oldest first */
    MPI_Comm gather;      /* MPI_COMM_WORLD's duplicate: the non-blocking reduces' gathers (see mpi_reduce_start) */
    void *scratch;        /* the blocking sums' received values */
    size_t scratch_bytes;
};

/* What comm_mpi_open allocates: the communicator it hands out, then its state. The functions here find the state
 * from the communicator's address, not from c->impl: comm_use_nccl (kernels/cuda/comm_nccl.cu) takes impl over
 * for its own state while the host collectives, abort and close stay these. */
struct mpi_comm {
    struct comm c; /* first */
    struct mpi_state s;
};

static struct mpi_state *state_of(struct comm *c)
{
    return &((struct mpi_comm *)c)->s;
}

static struct mpi_state *mpi_lock(struct comm *c)
{
    struct mpi_state *s = state_of(c);
    pthread_mutex_lock(&s->mu);
    return s;
}

static void mpi_unlock(struct mpi_state *s)
{
    pthread_mutex_unlock(&s->mu);
}

/* End the job now, from any rank (comm.h, abort; and where a rank cannot make a collective the others are in).
 * Called with mu not held (no function of this file aborts while it holds it). MPI_Abort runs holding mu, so
 * that the progress thread makes no MPI call beside it; the thread holds mu only for a round of MPI_Test, but
 * should one never return, the abort goes ahead after a second rather than wait for it. */
static _Noreturn void mpi_abort(struct comm *c, int code)
{
    struct mpi_state *s = state_of(c);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 1;
    pthread_mutex_timedlock(&s->mu, &until);
    s->stop = true;
    fflush(stdout);
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, code);
    _Exit(code);
}

/* This rank starts waiting for the others in a collective that fmt describes (comm_watch_begin). */
static void watch_begin(struct comm *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void watch_begin(struct comm *c, const char *fmt, ...)
{
    if (!c->watch)
        return;
    char what[128];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    comm_watch_begin(c->watch, what);
}

static void mpi_host_allreduce(struct comm *c, void *buf, size_t count, enum comm_dtype dt, enum comm_op op)
{
    struct mpi_state *s = mpi_lock(c);
    char *p = buf;
    for (size_t done = 0; done < count;) {
        size_t n = count - done < COMM_BUCKET ? count - done : COMM_BUCKET;
        watch_begin(c, "an %s of %zu %s values", op_name(op), n, type_name(dt));
        MPI_Allreduce(MPI_IN_PLACE, p + done * type_size(dt), (int)n, mpi_type(dt), mpi_op(op), MPI_COMM_WORLD);
        comm_watch_end(c->watch);
        done += n;
    }
    mpi_unlock(s);
}

/* Rank q's block [*lo, *hi) of the piece of `count` elements that starts at element `at` of a buffer whose blocks are
 * `bounds` (comm.h, the blocks version), relative to the piece; bounds NULL: the piece's own comm_shard blocks. */
static void piece_block(const struct comm *c, const size_t *bounds, size_t at, size_t count, int q, size_t *lo,
                        size_t *hi)
{
    if (!bounds) {
        comm_shard(count, c->world, q, lo, hi);
        return;
    }
    size_t a = bounds[q] > at ? bounds[q] - at : 0, b = bounds[q + 1] > at ? bounds[q + 1] - at : 0;
    *lo = a < count ? a : count;
    *hi = b < count ? b : count;
    if (*hi < *lo)
        *hi = *lo;
}

/* Piece p's tables (struct piece, t) for `count` elements at buf (element `at` of the buffer whose blocks are `bounds`,
 * or NULL: comm_shard's of the piece), receiving into recv; false where they do not fit MPI's int counts and offsets
 * (count, or world x this rank's block, over 2^31 - 1 elements). */
static bool plan_piece(struct comm *c, struct piece *p, void *buf, size_t at, size_t count, const size_t *bounds,
                       int *t, void *recv)
{
    size_t lo, hi;
    piece_block(c, bounds, at, count, c->rank, &lo, &hi);
    size_t mine = hi - lo;
    if (count > (size_t)INT32_MAX || mine * (size_t)c->world > (size_t)INT32_MAX)
        return false;
    int w = c->world;
    for (int q = 0; q < w; q++) {
        size_t qlo, qhi;
        piece_block(c, bounds, at, count, q, &qlo, &qhi);
        t[q] = (int)(qhi - qlo);
        t[w + q] = (int)qlo;
        t[2 * w + q] = (int)mine;
        t[3 * w + q] = q * (int)mine;
    }
    *p = (struct piece){.buf = buf, .count = count, .phase = PIECE_EXCHANGE, .req = MPI_REQUEST_NULL, .t = t,
                        .recv = recv};
    return true;
}

/* The bytes of received values a piece needs: world x this rank's block of it. */
static size_t piece_recv_bytes(const struct comm *c, const size_t *bounds, size_t at, size_t count,
                               enum comm_dtype dt)
{
    size_t lo, hi;
    piece_block(c, bounds, at, count, c->rank, &lo, &hi);
    return (hi - lo) * (size_t)c->world * type_size(dt);
}

/* This rank's block of the piece = the ranks' values added in rank order, ((r0 + r1) + r2) + ..., each sum rounded
 * to the dtype: what every rank's block gets whatever the pieces and buckets, and with two ranks r0 + r1, the sum
 * MPI_Allreduce gives. */
static void sum_in_rank_order(const struct comm *c, const struct piece *p, enum comm_dtype dt)
{
    size_t lo = (size_t)p->t[c->world + c->rank], b = (size_t)p->t[c->rank]; /* this rank's block (plan_piece) */
    /* out = the first rank's values, then each other rank's added, in rank order */
#define ADD_IN_RANK_ORDER(T)                                                                                  \
    do {                                                                                                      \
        T *out = (T *)(void *)p->buf + lo;                                                                    \
        const T *in = p->recv;                                                                                \
        for (size_t i = 0; i < b; i++)                                                                        \
            out[i] = in[i];                                                                                   \
        for (int q = 1; q < c->world; q++)                                                                    \
            for (size_t i = 0; i < b; i++)                                                                    \
                out[i] += in[(size_t)q * b + i];                                                              \
    } while (0)
    if (dt == COMM_F32)
        ADD_IN_RANK_ORDER(float);
    else if (dt == COMM_F64)
        ADD_IN_RANK_ORDER(double);
    else
        ADD_IN_RANK_ORDER(int64_t);
#undef ADD_IN_RANK_ORDER
}

/* The blocking sums' tables and received values for `count` elements (mu held); NULL out of memory. */
static int *blocking_scratch(struct comm *c, struct mpi_state *s, const size_t *bounds, size_t at, size_t count,
                             enum comm_dtype dt, void **recv)
{
    size_t tb = 4 * (size_t)c->world * sizeof(int), need = tb + piece_recv_bytes(c, bounds, at, count, dt) +
                                                          sizeof(double);
    if (need > s->scratch_bytes) {
        void *p = realloc(s->scratch, need);
        if (!p)
            return NULL;
        s->scratch = p;
        s->scratch_bytes = need;
    }
    *recv = (char *)s->scratch + (tb + sizeof(double) - 1) / sizeof(double) * sizeof(double);
    return s->scratch;
}

/* The blocking reduce-scatter of one piece (mu held): false where it cannot be made (no memory, over 2^31 - 1
 * elements; the caller ends the job). *p is left planned, for the gather of mpi_reduce_sum. */
static bool reduce_scatter_piece(struct comm *c, struct mpi_state *s, struct piece *p, void *buf, size_t at,
                                 size_t count, const size_t *bounds, enum comm_dtype dt)
{
    void *recv = NULL;
    int *t = blocking_scratch(c, s, bounds, at, count, dt, &recv);
    if (!t || !plan_piece(c, p, buf, at, count, bounds, t, recv))
        return false;
    int w = c->world;
    watch_begin(c, "a reduce-scatter (sum) of %zu %s values", count, type_name(dt));
    MPI_Alltoallv(buf, t, t + w, mpi_type(dt), recv, t + 2 * w, t + 3 * w, mpi_type(dt), MPI_COMM_WORLD);
    comm_watch_end(c->watch);
    sum_in_rank_order(c, p, dt);
    return true;
}

static _Noreturn void cannot_reduce(struct comm *c, struct mpi_state *s, const char *what, size_t count,
                                    enum comm_dtype dt)
{
    mpi_unlock(s);
    fprintf(stderr, "[rank %d] ampTrain: error: cannot make the %s of %zu %s values (out of memory, or over 2^31 - 1 "
            "elements for MPI's int counts)\n", c->rank, what, count, type_name(dt));
    mpi_abort(c, AMP_ERR_INTERNAL);
}

/* The reduce-scatter of comm.h: one exchange and one rank-order sum over the whole buffer. */
static void mpi_reduce_scatter(struct comm *c, void *buf, size_t count, enum comm_dtype dt)
{
    struct mpi_state *s = mpi_lock(c);
    struct piece p;
    if (!reduce_scatter_piece(c, s, &p, buf, 0, count, NULL, dt))
        cannot_reduce(c, s, "reduce-scatter", count, dt);
    mpi_unlock(s);
}

/* The reduce-scatter on the caller's blocks, in pieces of at most COMM_BUCKET elements: each piece's blocks are its
 * intersections with the buffer's, and every element is summed in rank order as in one piece. */
static void mpi_reduce_scatter_blocks(struct comm *c, void *buf, const size_t *bounds, enum comm_dtype dt)
{
    struct mpi_state *s = mpi_lock(c);
    size_t count = bounds[c->world];
    char *at = buf;
    for (size_t done = 0; done < count;) {
        size_t n = count - done < COMM_BUCKET ? count - done : COMM_BUCKET;
        struct piece p;
        if (!reduce_scatter_piece(c, s, &p, at + done * type_size(dt), done, n, bounds, dt))
            cannot_reduce(c, s, "reduce-scatter", count, dt);
        done += n;
    }
    mpi_unlock(s);
}

/* The CPU backend's memory is host memory. The sum of each piece is reduce-scattered, then gathered: every element
 * the rank-order sum of reduce_scatter, whichever rank's block it falls in. */
static void mpi_reduce_sum(struct comm *c, void *buf, size_t count, enum comm_dtype dt)
{
    struct mpi_state *s = mpi_lock(c);
    char *at = buf;
    for (size_t done = 0; done < count;) {
        size_t n = count - done < COMM_BUCKET ? count - done : COMM_BUCKET;
        struct piece p;
        if (!reduce_scatter_piece(c, s, &p, at + done * type_size(dt), 0, n, NULL, dt))
            cannot_reduce(c, s, "all-reduce", count, dt);
        watch_begin(c, "an all-gather of the summed blocks of %zu %s values", n, type_name(dt));
        MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, p.buf, p.t, p.t + c->world, mpi_type(dt),
                       MPI_COMM_WORLD);
        comm_watch_end(c->watch);
        done += n;
    }
    mpi_unlock(s);
}

/* Piece p of r has finished its collective in flight, or (scatter-only) its sum (mu held). */
static void piece_advanced(struct mpi_state *s, struct comm_request *r, struct piece *p)
{
    if (p->phase == PIECE_EXCHANGE) {
        p->phase = PIECE_SUM;
        return;
    }
    p->phase = PIECE_DONE;
    r->left--;
    s->pending--;
}

/* Sums piece p's block and starts its gather (mu held), on the duplicate communicator: the gathers start in the
 * order of the pieces on every rank (test_in_flight), but that order and the main thread's next exchanges
 * interleave differently on each rank, and MPI wants the collectives of one communicator started in one order. */
static void start_gather(struct comm *c, struct mpi_state *s, const struct comm_request *r, struct piece *p)
{
    sum_in_rank_order(c, p, r->dt);
    MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, p->buf, p->t, p->t + c->world, mpi_type(r->dt), s->gather,
                    &p->req);
    p->phase = PIECE_GATHER;
}

/* Tests every piece in flight, oldest first, and starts the gather of each summed piece whose elders have all
 * started theirs (mu held). */
static void test_in_flight(struct comm *c, struct mpi_state *s)
{
    bool in_order = true;
    for (struct comm_request *r = s->in_flight; r; r = r->next)
        for (int i = 0; i < r->n; i++) {
            struct piece *p = &r->p[i];
            if (p->phase == PIECE_EXCHANGE || p->phase == PIECE_GATHER) {
                int done = 0;
                MPI_Test(&p->req, &done, MPI_STATUS_IGNORE); /* a complete one becomes MPI_REQUEST_NULL */
                if (done)
                    piece_advanced(s, r, p);
            }
            if (p->phase == PIECE_SUM && r->scatter_only) { /* no gather to start in order: done here */
                sum_in_rank_order(c, p, r->dt);
                piece_advanced(s, r, p);
            }
            if (p->phase == PIECE_SUM && in_order)
                start_gather(c, s, r, p);
            in_order = in_order && p->phase >= PIECE_GATHER;
        }
}

/* The progress thread: tests the requests in flight every COMM_PROGRESS_PAUSE_US while one is not complete,
 * sleeps on `work` while none is. It holds mu only while it tests, so it never calls MPI beside another thread. */
static void *progress_main(void *arg)
{
    struct comm *c = arg;
    struct mpi_state *s = state_of(c);
    const struct timespec pause = {.tv_sec = 0, .tv_nsec = COMM_PROGRESS_PAUSE_US * 1000L};
    pthread_mutex_lock(&s->mu);
    while (!s->stop) {
        if (s->pending == 0) {
            pthread_cond_wait(&s->work, &s->mu);
            continue;
        }
        test_in_flight(c, s);
        pthread_mutex_unlock(&s->mu);
        nanosleep(&pause, NULL);
        pthread_mutex_lock(&s->mu);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

static const char *thread_level_name(int level)
{
    return level == MPI_THREAD_SINGLE ? "MPI_THREAD_SINGLE" : level == MPI_THREAD_FUNNELED ? "MPI_THREAD_FUNNELED"
           : level == MPI_THREAD_SERIALIZED                 ? "MPI_THREAD_SERIALIZED"
                                                            : "MPI_THREAD_MULTIPLE";
}

/* The progress thread, at the first reduce started (mu held). Signals are the main thread's (the stop signals of
 * lib/engine/train.c): the thread blocks them all. Where it cannot run, rank 0 says so once and reduce_progress
 * tests the requests each time backward finishes gradients instead. */
static void start_progress(struct comm *c, struct mpi_state *s)
{
    if (s->running || s->said)
        return;
    const char *why = NULL;
    int level = MPI_THREAD_SINGLE;
    if (!s->serialized) {
        MPI_Query_thread(&level);
        why = thread_level_name(level);
    } else {
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        s->running = pthread_create(&s->thread, NULL, progress_main, c) == 0;
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (s->running) /* its name in top -H, ps -L, gdb and /proc/PID/task */
            pthread_setname_np(s->thread, "mpi-progress");
        why = s->running ? NULL : "no thread could be started";
    }
    if (!why)
        return;
    s->said = true;
    if (c->rank == 0)
        fprintf(stderr, "ampTrain: note: no MPI progress thread (%s%s): the gradient buckets move on only between "
                "layers\n", s->serialized ? "" : "MPI grants only ", why);
}

/* Every piece's exchange is started here, by the main thread, in the order of the reduces: the same on every rank.
 * The progress thread, reduce_progress and reduce_wait then sum and gather. */
static struct comm_request *start_reduce(struct comm *c, void *buf, size_t count, const size_t *bounds,
                                         enum comm_dtype dt, bool scatter_only)
{
    size_t n = (count + COMM_BUCKET - 1) / COMM_BUCKET, tables = n * 4 * (size_t)c->world * sizeof(int), recv = 0;
    for (size_t i = 0; i < n; i++) {
        size_t k = count - i * COMM_BUCKET < COMM_BUCKET ? count - i * COMM_BUCKET : COMM_BUCKET;
        recv += piece_recv_bytes(c, bounds, i * COMM_BUCKET, k, dt);
    }
    size_t head = sizeof(struct comm_request) + n * sizeof(struct piece);
    head = (head + sizeof(double) - 1) / sizeof(double) * sizeof(double);
    struct comm_request *r = malloc(head + recv + tables);
    if (!r) { /* the others start theirs, and a blocking reduce does not match a started one: end the job */
        fprintf(stderr, "[rank %d] ampTrain: error: out of memory starting an all-reduce of %zu %s values\n", c->rank,
                count, type_name(dt));
        c->abort(c, AMP_ERR_INTERNAL);
        return NULL;
    }
    *r = (struct comm_request){.count = count, .dt = dt, .scatter_only = scatter_only, .n = (int)n, .left = (int)n};
    char *at = buf, *rv = (char *)r + head;
    int *t = (int *)(void *)(rv + recv);
    struct mpi_state *s = mpi_lock(c);
    int w = c->world;
    for (size_t i = 0; i < n; i++) {
        size_t done = i * COMM_BUCKET, k = count - done < COMM_BUCKET ? count - done : COMM_BUCKET;
        struct piece *p = &r->p[i];
        plan_piece(c, p, at + done * type_size(dt), done, k, bounds, t, rv); /* a piece's blocks fit an int */
        MPI_Ialltoallv(p->buf, t, t + w, mpi_type(dt), rv, t + 2 * w, t + 3 * w, mpi_type(dt), MPI_COMM_WORLD,
                       &p->req);
        rv += piece_recv_bytes(c, bounds, done, k, dt);
        t += 4 * w;
    }
    struct comm_request **tail = &s->in_flight;
    while (*tail)
        tail = &(*tail)->next;
    *tail = r;
    s->pending += r->left;
    start_progress(c, s);
    pthread_cond_signal(&s->work);
    mpi_unlock(s);
    return r;
}

static struct comm_request *mpi_reduce_start(struct comm *c, void *buf, size_t count, enum comm_dtype dt)
{
    return start_reduce(c, buf, count, NULL, dt, false);
}

/* The exchange and the owner's sum only, on the caller's blocks: each piece is done once its block is summed. */
static struct comm_request *mpi_reduce_scatter_start(struct comm *c, void *buf, const size_t *bounds,
                                                     enum comm_dtype dt)
{
    return start_reduce(c, buf, bounds[c->world], bounds, dt, true);
}

/* Between layers: the progress thread's work where there is none (MPI's thread level, or no thread). */
static void mpi_reduce_progress(struct comm *c)
{
    struct mpi_state *s = state_of(c);
    if (s->running)
        return;
    pthread_mutex_lock(&s->mu);
    test_in_flight(c, s);
    mpi_unlock(s);
}

/* What r's wait blocks on next (mu held, test_in_flight just made): the oldest piece, of r or of a reduce started
 * before it, whose exchange is still in flight (its gather must start before any later one), else r's oldest gather
 * in flight. Sets *owner to the piece's reduce. */
static struct piece *next_to_wait(struct mpi_state *s, struct comm_request *r, struct comm_request **owner)
{
    for (struct comm_request *q = s->in_flight; q; q = q->next) {
        for (int i = 0; i < q->n; i++)
            if (q->p[i].phase == PIECE_EXCHANGE) {
                *owner = q;
                return &q->p[i];
            }
        if (q == r)
            break;
    }
    *owner = r;
    for (int i = 0; i < r->n; i++)
        if (r->p[i].phase == PIECE_GATHER)
            return &r->p[i];
    return NULL;
}

static void mpi_reduce_wait(struct comm *c, struct comm_request *r)
{
    if (!r)
        return;
    struct mpi_state *s = mpi_lock(c);
    bool watched = false;
    for (test_in_flight(c, s); r->left > 0; test_in_flight(c, s)) {
        struct comm_request *owner;
        struct piece *p = next_to_wait(s, r, &owner);
        if (!p)
            break; /* cannot happen: a piece not done is in flight, or summed behind one that is */
        if (!watched) {
            watch_begin(c, "%s of %zu %s values (a gradient bucket)",
                        r->scatter_only ? "a reduce-scatter (sum)" : "an all-reduce (sum)", r->count, type_name(r->dt));
            watched = true;
        }
        MPI_Wait(&p->req, MPI_STATUS_IGNORE);
        piece_advanced(s, owner, p);
    }
    if (watched)
        comm_watch_end(c->watch);
    for (struct comm_request **at = &s->in_flight; *at; at = &(*at)->next)
        if (*at == r) {
            *at = r->next;
            break;
        }
    s->pending -= r->left;
    mpi_unlock(s);
    free(r);
}

bool comm_mpi_reduce_complete(struct comm *c, const struct comm_request *r)
{
    struct mpi_state *s = mpi_lock(c);
    bool done = r && r->left == 0;
    mpi_unlock(s);
    return done;
}

bool comm_mpi_progress_thread(struct comm *c)
{
    struct mpi_state *s = mpi_lock(c);
    bool running = s->running;
    mpi_unlock(s);
    return running;
}

static void mpi_host_bcast(struct comm *c, void *buf, size_t bytes, int root)
{
    struct mpi_state *s = mpi_lock(c);
    char *p = buf;
    for (size_t done = 0; done < bytes;) {
        size_t n = bytes - done < COMM_BUCKET ? bytes - done : COMM_BUCKET;
        watch_begin(c, "a broadcast of %zu bytes from rank %d", n, root);
        MPI_Bcast(p + done, (int)n, MPI_BYTE, root, MPI_COMM_WORLD);
        comm_watch_end(c->watch);
        done += n;
    }
    mpi_unlock(s);
}

static void mpi_host_allgather(struct comm *c, const void *send, void *recv, size_t bytes)
{
    struct mpi_state *s = mpi_lock(c);
    watch_begin(c, "an all-gather of %zu bytes a rank", bytes);
    MPI_Allgather(send, (int)bytes, MPI_BYTE, recv, (int)bytes, MPI_BYTE, MPI_COMM_WORLD);
    comm_watch_end(c->watch);
    mpi_unlock(s);
}

/* The ranks' blocks (comm_shard) as MPI counts and displacements in units of `unit`, a contiguous type of
 * elem_bytes; false where a block does not fit an int (the caller then ends the job: it cannot make the call). */
static bool shard_counts(struct comm *c, size_t count, int *counts, int *displs)
{
    for (int r = 0; r < c->world; r++) {
        size_t lo, hi;
        comm_shard(count, c->world, r, &lo, &hi);
        if (hi > (size_t)INT32_MAX)
            return false;
        counts[r] = (int)(hi - lo);
        displs[r] = (int)lo;
    }
    return true;
}

static MPI_Datatype elem_type(size_t elem_bytes)
{
    MPI_Datatype t;
    MPI_Type_contiguous((int)elem_bytes, MPI_BYTE, &t);
    MPI_Type_commit(&t);
    return t;
}

static int *shard_table(struct comm *c, size_t count, const char *what)
{
    int *t = malloc(2 * (size_t)c->world * sizeof *t);
    if (!t || !shard_counts(c, count, t, t + c->world)) {
        fprintf(stderr, "[rank %d] ampTrain: error: cannot make the %s of %zu elements (%s)\n", c->rank, what,
                count, t ? "a rank's block is over 2^31 elements" : "out of memory");
        free(t);
        mpi_abort(c, 1);
    }
    return t;
}

/* The caller's blocks (comm.h, the blocks version) as MPI counts and displacements; ends the job where one does not
 * fit an int. */
static int *bounds_table(struct comm *c, const size_t *bounds, const char *what)
{
    int *t = malloc(2 * (size_t)c->world * sizeof *t);
    bool fits = t && bounds[c->world] <= (size_t)INT32_MAX;
    for (int r = 0; fits && r < c->world; r++) {
        t[r] = (int)(bounds[r + 1] - bounds[r]);
        t[c->world + r] = (int)bounds[r];
    }
    if (!fits) {
        fprintf(stderr, "[rank %d] ampTrain: error: cannot make the %s of %zu elements (%s)\n", c->rank, what,
                bounds[c->world], t ? "over 2^31 elements" : "out of memory");
        free(t);
        mpi_abort(c, 1);
    }
    return t;
}

static void all_gather_table(struct comm *c, void *buf, size_t count, size_t elem_bytes, int *t)
{
    struct mpi_state *s = mpi_lock(c);
    MPI_Datatype type = elem_type(elem_bytes);
    watch_begin(c, "an all-gather of %zu elements of %zu bytes", count, elem_bytes);
    MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, t, t + c->world, type, MPI_COMM_WORLD);
    comm_watch_end(c->watch);
    MPI_Type_free(&type);
    mpi_unlock(s);
    free(t);
}

static void mpi_all_gather_blocks(struct comm *c, void *buf, const size_t *bounds, size_t elem_bytes)
{
    all_gather_table(c, buf, bounds[c->world], elem_bytes, bounds_table(c, bounds, "all-gather"));
}

static void gather_table(struct comm *c, const void *send, void *recv, size_t count, size_t elem_bytes, int root,
                         int *t)
{
    struct mpi_state *s = mpi_lock(c);
    MPI_Datatype type = elem_type(elem_bytes);
    watch_begin(c, "a gather to rank %d of %zu elements of %zu bytes", root, count, elem_bytes);
    MPI_Gatherv(send, t[c->rank], type, recv, t, t + c->world, type, root, MPI_COMM_WORLD);
    comm_watch_end(c->watch);
    MPI_Type_free(&type);
    mpi_unlock(s);
    free(t);
}

static void mpi_host_gather_blocks(struct comm *c, const void *send, void *recv, const size_t *bounds,
                                   size_t elem_bytes, int root)
{
    gather_table(c, send, recv, bounds[c->world], elem_bytes, root, bounds_table(c, bounds, "gather"));
}

/* Each rank's block of buf to every rank, in place. */
static void mpi_all_gather(struct comm *c, void *buf, size_t count, size_t elem_bytes)
{
    all_gather_table(c, buf, count, elem_bytes, shard_table(c, count, "all-gather"));
}

static void mpi_host_gather(struct comm *c, const void *send, void *recv, size_t count, size_t elem_bytes, int root)
{
    gather_table(c, send, recv, count, elem_bytes, root, shard_table(c, count, "gather"));
}

/* Ends the progress thread: it leaves its loop at its next look at `stop`, a pause at most. */
static void stop_progress(struct mpi_state *s)
{
    pthread_mutex_lock(&s->mu);
    s->stop = true;
    pthread_cond_signal(&s->work);
    bool running = s->running;
    s->running = false;
    pthread_mutex_unlock(&s->mu);
    if (running)
        pthread_join(s->thread, NULL);
}

static void mpi_close(struct comm *c)
{
    struct mpi_state *s = state_of(c);
    stop_progress(s);
    int done = 0;
    MPI_Finalized(&done);
    if (!done)
        MPI_Comm_free(&s->gather);
    if (!done) {
        comm_watch_begin(c->watch, "MPI_Finalize (the ranks' last meeting)"); /* it waits for every rank */
        MPI_Finalize();
        comm_watch_end(c->watch);
    }
    comm_watch_free(c->watch);
    free(s->scratch);
    pthread_cond_destroy(&s->work);
    pthread_mutex_destroy(&s->mu);
    free((struct mpi_comm *)c); /* the state with it */
}

/* What one rank tells the others at start: a hash of its host's name and the CPUs it may run on. */
#define MASK_WORDS (CPU_SETSIZE / 64)
struct placement {
    uint64_t host;
    uint64_t mask[MASK_WORDS];
};

static bool placement_has(const struct placement *p, int cpu)
{
    return (p->mask[cpu / 64] >> (cpu % 64)) & 1;
}

/* Ranks on this host, distinct hosts, and the CPUs this rank has to itself (comm.h, cpus): each CPU of its
 * affinity counted 1/k for the k ranks of its host that may run on it. mpirun's default binding gives each
 * rank its own core (k = 1); with --bind-to none every rank of a host may run on every CPU, and k is their
 * number, so run.threads auto does not start more threads than the host has CPUs. */
static void count_hosts(struct comm *c)
{
    char name[256] = {0};
    gethostname(name, sizeof name - 1);
    struct placement me = {.host = digest_str(DIGEST_INIT, name)};
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) == 0)
        for (int cpu = 0; cpu < CPU_SETSIZE; cpu++)
            if (CPU_ISSET(cpu, &set))
                me.mask[cpu / 64] |= (uint64_t)1 << (cpu % 64);
    struct placement *all = calloc((size_t)c->world, sizeof *all);
    if (!all) { /* the others are in the gather below: end the job rather than leave them waiting */
        fprintf(stderr, "[rank %d] ampTrain: error: out of memory starting MPI\n", c->rank);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    comm_watch_begin(c->watch, "the exchange of host names at start");
    MPI_Allgather(&me, (int)(sizeof me / sizeof(uint64_t)), MPI_UINT64_T, all, (int)(sizeof me / sizeof(uint64_t)),
                  MPI_UINT64_T, MPI_COMM_WORLD);
    comm_watch_end(c->watch);
    c->local_rank = 0;
    c->local_world = 0;
    c->hosts = 0;
    for (int r = 0; r < c->world; r++) {
        bool first = true;
        for (int q = 0; q < r; q++)
            first = first && all[q].host != all[r].host;
        c->hosts += first;
        if (all[r].host == me.host) {
            if (r < c->rank)
                c->local_rank++;
            c->local_world++;
        }
    }
    double own = 0.0;
    int mine = 0;
    for (int cpu = 0; cpu < CPU_SETSIZE; cpu++) {
        if (!placement_has(&me, cpu))
            continue;
        int k = 0;
        for (int r = 0; r < c->world; r++)
            k += all[r].host == me.host && placement_has(&all[r], cpu);
        own += 1.0 / (k > 0 ? k : 1);
        mine++;
    }
    c->cpus = mine == 0 ? 0 : own < 1.0 ? 1 : (int)(own + 1e-9);
    free(all);
}

enum amp_status comm_mpi_open(struct comm **out, int *argc, char ***argv, struct amp_error *err)
{
    int inited = 0, level = MPI_THREAD_SINGLE;
    MPI_Initialized(&inited);
    /* MPI_THREAD_SERIALIZED: the progress thread and the main thread call MPI, one at a time (mu) */
    if (!inited && MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &level) != MPI_SUCCESS)
        return amp_fail(err, AMP_ERR_INTERNAL, "check the mpirun command and the MPI installation",
                        "MPI_Init_thread failed");
    if (inited)
        MPI_Query_thread(&level);
    struct mpi_comm *mc = calloc(1, sizeof *mc);
    if (!mc) {
        MPI_Finalize();
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory");
    }
    struct comm *c = &mc->c;
    struct mpi_state *state = &mc->s;
    *c = (struct comm){
        .transport = "mpi",
        .device_memory = false,
        .reduce_sum = mpi_reduce_sum,
        .reduce_scatter = mpi_reduce_scatter,
        .reduce_start = mpi_reduce_start,
        .reduce_progress = mpi_reduce_progress,
        .reduce_wait = mpi_reduce_wait,
        .all_gather = mpi_all_gather,
        .host_allreduce = mpi_host_allreduce,
        .host_bcast = mpi_host_bcast,
        .host_allgather = mpi_host_allgather,
        .host_gather = mpi_host_gather,
        .abort = mpi_abort,
        .close = mpi_close,
        .impl = state,
        .reduce_scatter_blocks = mpi_reduce_scatter_blocks,
        .reduce_scatter_start = mpi_reduce_scatter_start,
        .all_gather_blocks = mpi_all_gather_blocks,
        .host_gather_blocks = mpi_host_gather_blocks,
    };
    pthread_mutex_init(&state->mu, NULL);
    pthread_cond_init(&state->work, NULL);
    state->serialized = level >= MPI_THREAD_SERIALIZED;
    MPI_Comm_rank(MPI_COMM_WORLD, &c->rank);
    MPI_Comm_size(MPI_COMM_WORLD, &c->world);
    MPI_Comm_dup(MPI_COMM_WORLD, &state->gather);
    /* out of memory for it: the job runs unwatched (every comm_watch call takes NULL) */
    c->watch = comm_watch_new(c->rank, COMM_TIMEOUT_DEFAULT_S);
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
