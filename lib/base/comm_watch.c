/*
 * comm_watch.c — the collective watchdog (comm_watch.h).
 */
#define _POSIX_C_SOURCE 200809L
#include "comm_watch.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h> /* _exit */

#include "error.h"

struct comm_watch {
    pthread_mutex_t mu;
    pthread_cond_t wake;   /* comm_watch_free and a new limit wake the thread */
    pthread_t thread;
    bool started, stop;
    int rank;
    double timeout_s;      /* 0: no limit */
    bool waiting;          /* inside a wait for the other ranks */
    struct timespec since; /* ... since then (CLOCK_MONOTONIC) */
    char what[160];
};

static double seconds_between(struct timespec a, struct timespec b)
{
    return (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) * 1e-9;
}

static struct timespec after(struct timespec t, double s)
{
    long long ns = (long long)t.tv_nsec + (long long)(s * 1e9);
    t.tv_sec += (time_t)(ns / 1000000000);
    t.tv_nsec = (long)(ns % 1000000000);
    return t;
}

/* The limit passed: say so and end this process (mpirun ends the others). Called with w->mu held. */
static void expire(struct comm_watch *w, double waited)
{
    struct amp_error err;
    amp_fail(&err, AMP_ERR_INTERNAL,
             "find the rank that is not in this collective (its log, 'py-spy dump' or 'gdb -p' on its process); "
             "if a rank can legitimately take longer between collectives (a large checkpoint, a slow data "
             "load), raise dist.timeout_s (0: wait for ever)",
             "waited %.*f s for the other ranks in %s, longer than dist.timeout_s (%g s): a rank has stalled (a "
             "hung filesystem or device, a stopped process, a paused host) or is far slower than this one; "
             "ending the job",
             waited < 10 ? 2 : 0, waited, w->what, w->timeout_s);
    /* written with one write(2), not through stderr's FILE: the main thread may be stuck holding a stdio
     * lock (a progress line to a pipe nobody reads), and this must end the process whatever it holds */
    char text[sizeof err.msg + sizeof err.hint + 64];
    size_t len = 0;
    FILE *f = fmemopen(text, sizeof text, "w");
    if (f) {
        fprintf(f, "[rank %d] ", w->rank);
        amp_error_print(&err, f);
        len = (size_t)ftell(f);
        fclose(f);
    }
    for (size_t done = 0; done < len;) {
        ssize_t n = write(STDERR_FILENO, text + done, len - done);
        if (n <= 0)
            break;
        done += (size_t)n;
    }
    _exit(AMP_ERR_INTERNAL);
}

static void *watch_main(void *arg)
{
    struct comm_watch *w = arg;
    pthread_mutex_lock(&w->mu);
    while (!w->stop) {
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (w->timeout_s > 0 && w->waiting) {
            double waited = seconds_between(w->since, now);
            if (waited > w->timeout_s)
                expire(w, waited);
        }
        /* a tenth of the limit between looks, so a wait ends the job at most 10% after it (10 ms to 1 s) */
        double tick = w->timeout_s > 0 ? w->timeout_s / 10 : 1.0;
        tick = tick < 0.01 ? 0.01 : tick > 1.0 ? 1.0 : tick;
        struct timespec until = after(now, tick);
        pthread_cond_timedwait(&w->wake, &w->mu, &until);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

struct comm_watch *comm_watch_new(int rank, double timeout_s)
{
    struct comm_watch *w = calloc(1, sizeof *w);
    if (!w)
        return NULL;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* timedwait's deadline on the clock `since` is read from */
    pthread_cond_init(&w->wake, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&w->mu, NULL);
    w->rank = rank;
    w->timeout_s = timeout_s > 0 ? timeout_s : 0;
    return w;
}

void comm_watch_set_timeout(struct comm_watch *w, double timeout_s)
{
    if (!w)
        return;
    pthread_mutex_lock(&w->mu);
    w->timeout_s = timeout_s > 0 ? timeout_s : 0;
    pthread_cond_signal(&w->wake); /* look again with the new tick */
    pthread_mutex_unlock(&w->mu);
}

double comm_watch_timeout(const struct comm_watch *w)
{
    return w ? w->timeout_s : 0;
}

void comm_watch_begin(struct comm_watch *w, const char *what)
{
    if (!w)
        return;
    pthread_mutex_lock(&w->mu);
    /* the thread starts with the first wait that has a limit: a process that never waits has none */
    if (!w->started && w->timeout_s > 0)
        w->started = pthread_create(&w->thread, NULL, watch_main, w) == 0;
    snprintf(w->what, sizeof w->what, "%s", what);
    clock_gettime(CLOCK_MONOTONIC, &w->since);
    w->waiting = true;
    pthread_mutex_unlock(&w->mu);
}

void comm_watch_end(struct comm_watch *w)
{
    if (!w)
        return;
    pthread_mutex_lock(&w->mu);
    w->waiting = false;
    pthread_mutex_unlock(&w->mu);
}

void comm_watch_free(struct comm_watch *w)
{
    if (!w)
        return;
    pthread_mutex_lock(&w->mu);
    w->stop = true;
    pthread_cond_signal(&w->wake);
    bool started = w->started;
    pthread_mutex_unlock(&w->mu);
    if (started)
        pthread_join(w->thread, NULL);
    pthread_cond_destroy(&w->wake);
    pthread_mutex_destroy(&w->mu);
    free(w);
}
