/*
 * threadpool.c — the persistent pthread pool behind parallel_for (threadpool.h says the contract and
 * why pthreads rather than OpenMP).
 *
 * The workers sleep on a condition variable between jobs. A job is (fn, arg, n_chunks) plus one atomic
 * claim word: every participant, the caller included, takes the next chunk index from it until none is
 * left, and the caller waits until every chunk is finished. A generation number tells a woken worker
 * that a new job is there (so spurious wake-ups do nothing) and tags the claim word (run_chunks). Chunks are claimed dynamically,
 * which balances uneven chunks; the results cannot depend on who ran what, since callers make chunks
 * independent (threadpool.h).
 */
#define _GNU_SOURCE
#include "threadpool.h"

#include <assert.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>

struct worker_arg {
    struct threadpool *pool;
    int id;
};

/* The claim word: the job's generation in the high 24 bits, the next chunk to hand out in the low 40. A
 * worker that wakes late still holding an old job's generation can claim nothing from a newer job (unless
 * it slept through 2^24 jobs between reading the job and its first claim, which a scheduler does not do). */
#define CHUNK_BITS 40
#define CHUNK_MASK ((UINT64_C(1) << CHUNK_BITS) - 1)

struct threadpool {
    int threads;
    pthread_t *tids;             /* threads - 1 */
    struct worker_arg *args;     /* threads - 1 */
    pthread_mutex_t mu;
    pthread_cond_t wake, done;
    _Atomic uint64_t generation; /* bumped for each job, under mu (read without it while spinning) */
    _Atomic bool stop;
    int sleepers;                /* workers blocked on `wake`, under mu */
    /* the current job: written under mu together with the generation */
    parallel_fn fn;
    void *arg;
    int64_t n_chunks;
    _Atomic uint64_t claim;      /* generation << CHUNK_BITS | next chunk */
    _Atomic int64_t finished;    /* chunks of the current job done */
};

/* Set while a thread runs chunks: a nested parallel_for then runs inline. */
static _Thread_local bool in_chunk;

/* Between jobs a worker spins this many times (each a pause, ~10-150 cycles; in all well under a
 * millisecond) watching for the next job before it sleeps on the condition variable, and the caller spins
 * as long for the last chunk before it does: a training step issues dozens of short jobs, and waking a
 * sleeping thread costs several microseconds each time. Spinning only decides when a thread looks, never
 * which chunks it runs, so it changes no result. */
#define SPIN_ROUNDS 4000

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Claim and run chunks of job `gen` until none is left. The caller of parallel_for returns once all are
 * finished, not when every worker has woken: on a busy machine a worker that is not scheduled in time
 * simply finds nothing left to do, and never delays the caller. */
static void run_chunks(struct threadpool *p, uint64_t gen, parallel_fn fn, void *arg, int64_t n_chunks, int worker)
{
    in_chunk = true;
    uint64_t tag = (gen << CHUNK_BITS) & ~CHUNK_MASK;
    uint64_t v = atomic_load(&p->claim);
    for (;;) {
        if ((v & ~CHUNK_MASK) != tag || (int64_t)(v & CHUNK_MASK) >= n_chunks)
            break;
        if (!atomic_compare_exchange_weak(&p->claim, &v, v + 1))
            continue; /* v now holds the current word */
        fn(arg, (int64_t)(v & CHUNK_MASK), worker);
        if (atomic_fetch_add(&p->finished, 1) + 1 == n_chunks) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
        v = atomic_load(&p->claim);
    }
    in_chunk = false;
}

static void *worker_main(void *wa)
{
    struct threadpool *p = ((struct worker_arg *)wa)->pool;
    int id = ((struct worker_arg *)wa)->id;
    uint64_t seen = 0;
    for (;;) {
        for (int i = 0; i < SPIN_ROUNDS && atomic_load(&p->generation) == seen && !atomic_load(&p->stop); i++)
            cpu_relax();
        pthread_mutex_lock(&p->mu);
        while (!atomic_load(&p->stop) && atomic_load(&p->generation) == seen) {
            p->sleepers++;
            pthread_cond_wait(&p->wake, &p->mu);
            p->sleepers--;
        }
        if (atomic_load(&p->stop)) {
            pthread_mutex_unlock(&p->mu);
            break;
        }
        seen = atomic_load(&p->generation);
        parallel_fn fn = p->fn;
        void *arg = p->arg;
        int64_t n = p->n_chunks;
        pthread_mutex_unlock(&p->mu);
        run_chunks(p, seen, fn, arg, n, id);
    }
    return NULL;
}

struct threadpool *threadpool_create(int threads)
{
    if (threads < 1)
        return NULL;
    struct threadpool *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    p->threads = 1;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done, NULL);
    atomic_init(&p->claim, 0);
    atomic_init(&p->finished, 0);
    atomic_init(&p->generation, 0);
    atomic_init(&p->stop, false);
    if (threads > 1) {
        p->tids = calloc((size_t)threads - 1, sizeof *p->tids);
        p->args = calloc((size_t)threads - 1, sizeof *p->args);
        if (!p->tids || !p->args) {
            threadpool_free(p);
            return NULL;
        }
        for (int i = 0; i < threads - 1; i++) {
            p->args[i] = (struct worker_arg){ p, i + 1 };
            if (pthread_create(&p->tids[i], NULL, worker_main, &p->args[i]) != 0) {
                threadpool_free(p);
                return NULL;
            }
            p->threads++; /* counts the started ones, so free joins exactly those */
        }
    }
    return p;
}

void threadpool_free(struct threadpool *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, true);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->threads - 1; i++)
        pthread_join(p->tids[i], NULL);
    pthread_cond_destroy(&p->wake);
    pthread_cond_destroy(&p->done);
    pthread_mutex_destroy(&p->mu);
    free(p->tids);
    free(p->args);
    free(p);
}

int threadpool_threads(const struct threadpool *p)
{
    return p ? p->threads : 1;
}

void parallel_for(struct threadpool *p, int64_t n_chunks, parallel_fn fn, void *arg)
{
    if (n_chunks <= 0)
        return;
    assert(n_chunks <= (int64_t)CHUNK_MASK);
    if (!p || p->threads == 1 || n_chunks == 1 || in_chunk) {
        for (int64_t c = 0; c < n_chunks; c++)
            fn(arg, c, 0);
        return;
    }
    pthread_mutex_lock(&p->mu);
    uint64_t gen = atomic_load(&p->generation) + 1;
    p->fn = fn;
    p->arg = arg;
    p->n_chunks = n_chunks;
    atomic_store(&p->finished, 0);
    atomic_store(&p->claim, (gen << CHUNK_BITS) & ~CHUNK_MASK);
    atomic_store(&p->generation, gen); /* last: a spinning worker that sees it finds the job complete */
    if (p->sleepers > 0)
        pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    run_chunks(p, gen, fn, arg, n_chunks, 0);
    for (int i = 0; i < SPIN_ROUNDS && atomic_load(&p->finished) < n_chunks; i++)
        cpu_relax();
    if (atomic_load(&p->finished) < n_chunks) {
        pthread_mutex_lock(&p->mu);
        while (atomic_load(&p->finished) < n_chunks)
            pthread_cond_wait(&p->done, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
}

int threadpool_available_cpus(void)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) != 0)
        return 1;
    int n = CPU_COUNT(&set);
    return n > 0 ? n : 1;
}
