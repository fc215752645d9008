/*
 * threadpool.h — one persistent pool of worker threads and a parallel_for over fixed chunks, for the
 * CPU backend (kernels/cpu/backend_cpu.c owns one pool, created once and joined at destroy).
 *
 * The rule that keeps results bit-identical for any thread count: a caller splits its work into
 * chunks fixed by the problem size alone, never by the number of threads. Each chunk computes its
 * own outputs, in the order one thread would, and a reduction keeps one partial per chunk, combined
 * by the caller after parallel_for returns, in chunk order. Which thread runs which chunk (and in
 * what order chunks run) then changes no bit. `worker` (0 .. threads-1) only picks per-thread scratch.
 *
 * Why pthreads and not OpenMP: the pool is the backend's own object (no process-wide runtime state,
 * OMP_NUM_THREADS or nested-region rules to reason about), its threads are created once and joined at
 * destroy (so ASan/TSan and valgrind see a clean lifetime), chunks are handed out by atomic counters
 * we control, and the build needs no -fopenmp (Clang, the CUDA host compiler, and sanitizer builds all
 * take it alike). OpenMP's static schedule would also be deterministic; we gain nothing from its runtime
 * that these ~200 lines do not give.
 *
 * Who runs what: each thread first runs a contiguous home range of the chunks (worker w of T: chunks
 * [n w / T, n (w + 1) / T)), so jobs cut alike keep a thread on the same part of the data, then takes
 * chunks left in the other ranges (stealing), so uneven chunks and late threads still balance.
 *
 * Between jobs the threads spin up to 2 ms (pause) before sleeping on a condition variable, and the caller
 * spins as long for the last chunk: a training step issues dozens of short jobs with short serial stretches
 * between them (20 us when the pool has more threads than the process has CPUs). On a machine shared with other
 * busy processes a spinning thread holds a CPU they need: AMPTRAIN_POOL_SPIN_US (the CPU backend) sets the time.
 * When a thread looks for work never decides which chunks it runs.
 *
 * A parallel_for called from inside a chunk (nested) runs its chunks inline on that thread, in order.
 * Only one thread may call parallel_for on a pool at a time (the backend is single-caller, as its
 * contract says).
 */
#ifndef AMP_THREADPOOL_H
#define AMP_THREADPOOL_H

#include <stdint.h>

struct threadpool;

/* fn(arg, chunk, worker): compute chunk `chunk` (0 .. n_chunks-1) on worker `worker` (0 .. threads-1). */
typedef void (*parallel_fn)(void *arg, int64_t chunk, int worker);

/* A pool of `threads` workers (1 .. 2^20; the calling thread is worker 0, so threads - 1 are started).
 * NULL on failure (a count out of range, out of memory, or pthread_create failed). */
struct threadpool *threadpool_create(int threads);
/* The same, with the time an idle thread spins before it sleeps (and the caller for the last chunk) given in
 * nanoseconds; negative: the default above. The CPU backend passes AMPTRAIN_POOL_SPIN_US here. */
struct threadpool *threadpool_create_spinning(int threads, int64_t spin_ns);
void threadpool_free(struct threadpool *p); /* joins the threads; NULL is fine */
int threadpool_threads(const struct threadpool *p); /* 1 for NULL */

/* Run fn on chunks 0 .. n_chunks-1, each exactly once, and return when all are done. p NULL, one
 * thread or one chunk: inline, in order, on the caller (worker 0). */
void parallel_for(struct threadpool *p, int64_t n_chunks, parallel_fn fn, void *arg);

/* The CPUs this process may run on (sched_getaffinity; 1 if that fails): what run.threads auto means. */
int threadpool_available_cpus(void);

#endif
