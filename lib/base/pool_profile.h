/*
 * pool_profile.h — where a step's time goes around the thread pool's jobs, for tuning the CPU backend.
 *
 * With AMPTRAIN_POOL_PROFILE=PATH in the environment, each pool counts its top-level parallel_for calls by (chunk
 * function, caller): calls, calls run inline (one thread or one chunk), chunks, wall time, the time the caller
 * waited for the other threads' chunks after it found none left to claim, and the time on the caller since the
 * pool's previous job ended (serial work, with the other threads idle). threadpool_free appends the table to PATH
 * as text, each function as an object file and an offset into it; scripts/dev/pool_profile.py names them. Without
 * the variable parallel_for pays one test of a NULL pointer. One process at a time per PATH.
 */
#ifndef AMP_POOL_PROFILE_H
#define AMP_POOL_PROFILE_H

#include <stdint.h>

struct pool_profile;

/* A table for one pool: NULL unless AMPTRAIN_POOL_PROFILE is set and non-empty (or if out of memory). */
struct pool_profile *pool_profile_open(void);

/* One call: started at t0, the caller's own chunks done at t_own, every chunk done at t_end (ns, one clock). */
void pool_profile_add(struct pool_profile *pp, void *fn, void *caller, int64_t chunks, int inline_run, int64_t t0,
                      int64_t t_own, int64_t t_end);

/* Append the table to AMPTRAIN_POOL_PROFILE's file (a header naming the pool's thread count first), then free it.
 * NULL is fine. */
void pool_profile_close(struct pool_profile *pp, int threads);

#endif
