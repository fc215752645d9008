/*
 * threadpool.c — the persistent pthread pool behind parallel_for (threadpool.h says the contract and
 * why pthreads rather than OpenMP).
 *
 * A job is (fn, arg, n_chunks) in one of two slots plus one atomic claim word per thread. The chunks are cut
 * into contiguous home ranges, one a thread (worker w's: [n w / T, n (w + 1) / T), as OpenMP's static
 * schedule), each with its claim word: every participant, the caller included, takes the next chunk of its own
 * range from its word until none is left, then the next chunks of the other threads' ranges from theirs
 * (stealing), and the caller waits until every chunk is finished. A generation number publishes the job (so
 * spurious wake-ups do nothing) and tags the claim words (run_chunks). Nothing is handed out under the mutex: it
 * and the two condition variables serve only threads that sleep, after spinning a while (SPIN_NS_*).
 *
 * Why home ranges: consecutive jobs of a step mostly cut their data the same way (the optimizer's chunks, the
 * gradient check's, a product's bands or columns, the elementwise ops'), so a thread that wrote the first
 * half of a tensor in one job tends to read it in the next, from its own core's cache rather than the other
 * core's. On fashion_mlp bf16 at 2 threads that ran 1.07x faster than one shared claim word
 * (`git show 99ca90b:docs/perf.md`, "Home ranges").
 * Stealing keeps what the shared word gave: uneven chunks still balance, and a thread that is not scheduled in
 * time delays nobody (the others take its range). The results cannot depend on who ran what, since callers make
 * chunks independent (threadpool.h).
 */
#define _GNU_SOURCE
#include "threadpool.h"

#include "pool_profile.h" /* AMPTRAIN_POOL_PROFILE: the per-job timings */

#include <assert.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <time.h>

struct worker_arg {
    struct threadpool *pool;
    int id;
};

/* A claim word: the job's generation in the high 24 bits, the next chunk of its home range to hand out in the low
 * 40. A worker that wakes late still holding an old job's generation can claim nothing from a newer job (unless
 * it slept through 2^24 jobs between reading the job and its first claim, which a scheduler does not do). */
#define CHUNK_BITS 40
#define CHUNK_MASK ((UINT64_C(1) << CHUNK_BITS) - 1)

/* One job, in slot generation & 1. Its fields are written (release) before the generation is published
 * and read (acquire) after it; a worker that reads a slot late, while the caller refills it for the job
 * after next, may see a mixture, but that refill comes after the claim word moved on to the next job, so
 * the mixture's claims all fail (run_chunks) and it runs nothing. */
struct job {
    _Atomic(parallel_fn) fn;
    _Atomic(void *) arg;
    _Atomic int64_t n_chunks;
};

/* One thread's home range's claim word, on a cache line of its own: the owner claims from it at every chunk. */
struct claim {
    _Alignas(64) _Atomic uint64_t word;
};

struct threadpool {
    int threads;
    pthread_t *tids;             /* threads - 1 */
    struct worker_arg *args;     /* threads - 1 */
    int64_t spin_ns;             /* how long a thread watches for work (or the last chunk) before it sleeps */
    pthread_mutex_t mu;          /* only for sleeping and waking: no job is handed out under it */
    pthread_cond_t wake, done;
    struct job jobs[2];
    _Atomic int sleepers;        /* workers asleep on `wake` or about to be */
    _Atomic int caller_waiting;  /* the caller asleep on `done` or about to be */
    _Atomic bool stop;
    /* the words every thread reads while it waits, apart from the ones every chunk writes */
    _Alignas(64) _Atomic uint64_t generation; /* bumped for each job, by the caller */
    _Alignas(64) _Atomic int64_t finished;    /* chunks of the current job done */
    struct claim *claims;                     /* per thread: generation << CHUNK_BITS | next chunk of its range */
    struct pool_profile *profile;             /* NULL unless AMPTRAIN_POOL_PROFILE is set (pool_profile.h) */
};

/* The end of worker w's home range of n chunks among t threads (its start is the end of w - 1's). */
static int64_t home_end(int64_t n, int t, int w)
{
    return n * (w + 1) / t; /* n < 2^40 and t <= 2^20 (threadpool_create): no overflow */
}

/* Set while a thread runs chunks: a nested parallel_for then runs inline. */
static _Thread_local bool in_chunk;

/* How long an idle thread spins (pause) watching for the next job before it sleeps on the condition
 * variable, and the caller for the last chunk before it does. A training step issues dozens of short jobs
 * with short serial stretches between them; waking a sleeping thread costs a system call and, in a virtual
 * machine, tens of microseconds before the thread runs. A time, not a count of pauses (a pause takes ~10
 * cycles on some CPUs and ~140 on others). When the pool has more threads than the process has CPUs, a
 * spinning thread would hold a CPU another of ours needs, so it sleeps almost at once. Spinning only
 * decides when a thread looks, never which chunks it runs, so it changes no result. */
#define SPIN_NS_OWN_CPUS 2000000 /* 2 ms: longer than the serial stretches of a step */
#define SPIN_NS_OVERSUBSCRIBED 20000

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Spin until done(p, x) or spin_ns have passed; whether it is done. The clock is read every 64 pauses,
 * and not at all when the wait is shorter than that. */
static bool spin_until(const struct threadpool *p, bool (*done)(const struct threadpool *, uint64_t), uint64_t x)
{
    int64_t deadline = 0;
    for (unsigned i = 1;; i++) {
        if (done(p, x))
            return true;
        cpu_relax();
        if (i % 64 == 0) {
            int64_t t = now_ns();
            if (!deadline)
                deadline = t + p->spin_ns;
            else if (t >= deadline)
                return done(p, x);
        }
    }
}

static bool job_posted(const struct threadpool *p, uint64_t seen)
{
    return atomic_load(&p->generation) != seen || atomic_load(&p->stop);
}

static bool job_finished(const struct threadpool *p, uint64_t n_chunks)
{
    return atomic_load(&p->finished) >= (int64_t)n_chunks;
}

/* Claim and run chunks of job `gen` until none is left: this worker's home range first, then the others' in turn
 * (worker + 1, worker + 2, ...). The caller of parallel_for returns once all are finished, not when every worker
 * has woken: on a busy machine a worker that is not scheduled in time finds its range taken by the others and
 * never delays the caller. */
static void run_chunks(struct threadpool *p, uint64_t gen, parallel_fn fn, void *arg, int64_t n_chunks, int worker)
{
    in_chunk = true;
    const uint64_t tag = (gen << CHUNK_BITS) & ~CHUNK_MASK;
    const int t = p->threads;
    for (int i = 0; i < t; i++) {
        const int owner = (worker + i) % t;
        const int64_t end = home_end(n_chunks, t, owner);
        _Atomic uint64_t *w = &p->claims[owner].word;
        uint64_t v = atomic_load(w);
        for (;;) {
            if ((v & ~CHUNK_MASK) != tag || (int64_t)(v & CHUNK_MASK) >= end)
                break;
            if (!atomic_compare_exchange_weak(w, &v, v + 1))
                continue; /* v now holds the current word */
            fn(arg, (int64_t)(v & CHUNK_MASK), worker);
            /* The last chunk wakes the caller if it went to sleep: it sets caller_waiting before it looks at
             * `finished` a last time, and this looks at caller_waiting after adding to it (both sequentially
             * consistent), so one of the two sees the other. */
            if (atomic_fetch_add(&p->finished, 1) + 1 == n_chunks && atomic_load(&p->caller_waiting)) {
                pthread_mutex_lock(&p->mu);
                pthread_cond_signal(&p->done);
                pthread_mutex_unlock(&p->mu);
            }
            v = atomic_load(w);
        }
    }
    in_chunk = false;
}

static void *worker_main(void *wa)
{
    struct threadpool *p = ((struct worker_arg *)wa)->pool;
    int id = ((struct worker_arg *)wa)->id;
    uint64_t seen = 0;
    for (;;) {
        if (!spin_until(p, job_posted, seen)) {
            /* Asleep: sleepers is raised before the generation is looked at again, and the caller looks at
             * sleepers after it publishes a generation, so either this sees the job or the caller wakes it
             * (under mu, which this holds until cond_wait lets go of it). */
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->sleepers, 1);
            while (!job_posted(p, seen))
                pthread_cond_wait(&p->wake, &p->mu);
            atomic_fetch_sub(&p->sleepers, 1);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->stop))
            break;
        seen = atomic_load(&p->generation);
        struct job *j = &p->jobs[seen & 1];
        parallel_fn fn = atomic_load_explicit(&j->fn, memory_order_acquire);
        void *arg = atomic_load_explicit(&j->arg, memory_order_acquire);
        int64_t n = atomic_load_explicit(&j->n_chunks, memory_order_acquire);
        run_chunks(p, seen, fn, arg, n, id);
    }
    return NULL;
}

struct threadpool *threadpool_create(int threads)
{
    return threadpool_create_spinning(threads, -1);
}

struct threadpool *threadpool_create_spinning(int threads, int64_t spin_ns)
{
    if (threads < 1 || threads > (1 << 20)) /* run.threads allows 1024 */
        return NULL;
    struct threadpool *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    p->threads = 1;
    if (spin_ns < 0)
        spin_ns = threads > threadpool_available_cpus() ? SPIN_NS_OVERSUBSCRIBED : SPIN_NS_OWN_CPUS;
    p->spin_ns = spin_ns;
    p->profile = pool_profile_open();
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done, NULL);
    for (int s = 0; s < 2; s++) {
        atomic_init(&p->jobs[s].fn, NULL);
        atomic_init(&p->jobs[s].arg, NULL);
        atomic_init(&p->jobs[s].n_chunks, 0);
    }
    atomic_init(&p->sleepers, 0);
    atomic_init(&p->caller_waiting, 0);
    atomic_init(&p->finished, 0);
    atomic_init(&p->generation, 0);
    atomic_init(&p->stop, false);
    p->claims = aligned_alloc(_Alignof(struct claim), (size_t)threads * sizeof *p->claims);
    if (!p->claims) {
        threadpool_free(p);
        return NULL;
    }
    for (int i = 0; i < threads; i++)
        atomic_init(&p->claims[i].word, 0);
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
    pool_profile_close(p->profile, p->threads);
    free(p->tids);
    free(p->args);
    free(p->claims);
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
    struct pool_profile *prof = p && !in_chunk ? p->profile : NULL;
    const int64_t t0 = prof ? now_ns() : 0;
    if (!p || p->threads == 1 || n_chunks == 1 || in_chunk) {
        for (int64_t c = 0; c < n_chunks; c++)
            fn(arg, c, 0);
        if (prof) {
            const int64_t t = now_ns();
            pool_profile_add(prof, (void *)fn, __builtin_return_address(0), n_chunks, 1, t0, t, t);
        }
        return;
    }
    /* The previous job is finished, so no worker can claim from it; its slot is the other one. */
    uint64_t gen = atomic_load(&p->generation) + 1;
    struct job *j = &p->jobs[gen & 1];
    atomic_store_explicit(&j->fn, fn, memory_order_release);
    atomic_store_explicit(&j->arg, arg, memory_order_release);
    atomic_store_explicit(&j->n_chunks, n_chunks, memory_order_release);
    atomic_store(&p->finished, 0);
    const uint64_t tag = (gen << CHUNK_BITS) & ~CHUNK_MASK;
    for (int w = 0; w < p->threads; w++) /* each range starts where the one before it ends */
        atomic_store(&p->claims[w].word, tag | (uint64_t)(w ? home_end(n_chunks, p->threads, w - 1) : 0));
    atomic_store(&p->generation, gen);
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->mu);
    }
    run_chunks(p, gen, fn, arg, n_chunks, 0);
    const int64_t t_own = prof ? now_ns() : 0;
    if (!spin_until(p, job_finished, (uint64_t)n_chunks)) {
        pthread_mutex_lock(&p->mu);
        atomic_store(&p->caller_waiting, 1);
        while (!job_finished(p, (uint64_t)n_chunks))
            pthread_cond_wait(&p->done, &p->mu);
        atomic_store(&p->caller_waiting, 0);
        pthread_mutex_unlock(&p->mu);
    }
    if (prof)
        pool_profile_add(prof, (void *)fn, __builtin_return_address(0), n_chunks, 0, t0, t_own, now_ns());
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
