/*
 * pool_profile.c — the table behind AMPTRAIN_POOL_PROFILE (pool_profile.h says what it counts and why).
 *
 * An open-addressed table of SLOTS - 1 entries keyed by (fn, caller), and entry 0 for the calls of any key past
 * those (printed with fn and caller "?"). Only the thread that calls parallel_for writes it (the pool is
 * single-caller).
 */
#define _GNU_SOURCE
#include "pool_profile.h"

#include <dlfcn.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define SLOTS 1024

struct entry {
    void *fn, *caller;
    int64_t calls, inline_calls, chunks, total_ns, wait_ns, gap_ns;
};

struct pool_profile {
    char path[4096];
    int64_t last_end; /* when the previous call ended; 0 before the first */
    struct entry e[SLOTS];
};

struct pool_profile *pool_profile_open(void)
{
    const char *path = getenv("AMPTRAIN_POOL_PROFILE");
    if (!path || !*path)
        return NULL;
    struct pool_profile *pp = NULL;
    if (strlen(path) >= sizeof pp->path || !(pp = calloc(1, sizeof *pp))) {
        fprintf(stderr, "pool_profile: AMPTRAIN_POOL_PROFILE %s; no profile is written\n",
                strlen(path) >= sizeof pp->path ? "is longer than 4095 bytes" : ": out of memory");
        return NULL;
    }
    memcpy(pp->path, path, strlen(path) + 1);
    return pp;
}

static struct entry *entry_of(struct pool_profile *pp, void *fn, void *caller)
{
    uintptr_t h = ((uintptr_t)fn >> 4) * 31 + ((uintptr_t)caller >> 2);
    for (unsigned i = 0; i < SLOTS - 1; i++) {
        struct entry *e = &pp->e[1 + (h + i) % (SLOTS - 1)];
        if (e->calls == 0) {
            e->fn = fn;
            e->caller = caller;
        }
        if (e->fn == fn && e->caller == caller)
            return e;
    }
    return &pp->e[0]; /* all SLOTS - 1 keyed entries taken: the catch-all (fn and caller NULL) */
}

void pool_profile_add(struct pool_profile *pp, void *fn, void *caller, int64_t chunks, int inline_run, int64_t t0,
                      int64_t t_own, int64_t t_end)
{
    struct entry *e = entry_of(pp, fn, caller);
    e->calls++;
    e->inline_calls += inline_run != 0;
    e->chunks += chunks;
    e->total_ns += t_end - t0;
    e->wait_ns += t_end - t_own;
    if (pp->last_end)
        e->gap_ns += t0 - pp->last_end;
    pp->last_end = t_end;
}

/* `p` as an object file and an offset into it (for addr2line); "?" and the address (0x0 for the catch-all entry)
 * where dladdr knows none. */
static void print_place(FILE *f, const void *p)
{
    Dl_info info;
    if (p && dladdr(p, &info) && info.dli_fname && info.dli_fbase) {
        const char *obj = info.dli_fname;
        char self[4096];
        ssize_t n = -1;
        if (obj[0] != '/') { /* the executable itself: dladdr gives its name as run (argv[0]) */
            n = readlink("/proc/self/exe", self, sizeof self - 1);
            if (n > 0) {
                self[n] = '\0';
                obj = self;
            }
        }
        fprintf(f, "%s 0x%lx", obj, (unsigned long)((const char *)p - (const char *)info.dli_fbase));
    } else {
        fprintf(f, "? 0x%lx", (unsigned long)(uintptr_t)p);
    }
}

void pool_profile_close(struct pool_profile *pp, int threads)
{
    if (!pp)
        return;
    bool any = false; /* a pool freed before its first job (set_threads replacing it) writes nothing */
    for (int i = 0; i < SLOTS && !any; i++)
        any = pp->e[i].calls > 0;
    FILE *f = any ? fopen(pp->path, "a") : NULL;
    if (f) {
        fprintf(f, "# pool of %d thread(s); columns: fn_object fn_offset caller_object caller_offset calls "
                   "inline_calls chunks total_ns wait_ns gap_ns\n", threads);
        for (int i = 0; i < SLOTS; i++) {
            const struct entry *e = &pp->e[i];
            if (!e->calls)
                continue;
            print_place(f, e->fn);
            fputc(' ', f);
            print_place(f, e->caller);
            fprintf(f, " %lld %lld %lld %lld %lld %lld\n", (long long)e->calls, (long long)e->inline_calls,
                    (long long)e->chunks, (long long)e->total_ns, (long long)e->wait_ns, (long long)e->gap_ns);
        }
        if (fclose(f) != 0)
            fprintf(stderr, "pool_profile: could not write %s\n", pp->path);
    } else if (any) {
        fprintf(stderr, "pool_profile: cannot open %s for appending\n", pp->path);
    }
    free(pp);
}
