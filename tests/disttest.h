/*
 * disttest.h — running ampTrain under mpirun from the data-parallel suites (test_dist.c, test_cuda_dist.c),
 * and comparing their runs and checkpoints. Needs _POSIX_C_SOURCE before the first include.
 */
#ifndef AMP_DISTTEST_H
#define AMP_DISTTEST_H

#include "ckpt_testlib.h" /* scratch, amp, shell, assert_same_logs, assert_same_tensors */

#include <math.h>

/* The ranks' environment. Under ASan (scripts/test.sh's second build) LeakSanitizer is off in the ranks:
 * Open MPI's components are unloaded at MPI_Finalize, so its own leftovers cannot even be attributed
 * (frames in "<unknown module>"), let alone suppressed by library. Address and UB checks stay on, and the
 * same engine code is leak-checked in the one-rank suites and in this suite's in-process test.
 * A rank that waits for another yields its CPU (mpi_yield_when_idle): Open MPI otherwise polls at full speed,
 * and with Criterion's two workers the ranks of two jobs share two cores, so a waiting rank's polling is taken
 * from the rank it waits for (a two-rank fashion_mlp run of 200 steps used 6.2 CPU-s polling, 2.1 yielding).
 * How a rank waits changes no result. */
/* Under AddressSanitizer the ranks read checkpoints without the trial process (AMPTRAIN_NO_TRIAL=1,
 * lib/base/trial.h): ASan's allocator is not fork-safe with other threads, and a rank's Open MPI threads allocating
 * at the fork left the trial child waiting for ever on an allocator lock ("ran past 60 s" in
 * resume_at_the_same_world_size_is_bit_exact, CI 2026-12-05, two suites side by side). glibc's allocator is
 * fork-safe: the release build runs these tests with the trial, and tests/test_hostile.c tests the trial itself in
 * both builds. */
#if defined(__SANITIZE_ADDRESS__)
#define MPI_NO_TRIAL "AMPTRAIN_NO_TRIAL=1 "
#else
#define MPI_NO_TRIAL ""
#endif

#define MPI_ENV                                                                                                      \
    "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1 "                     \
    "OPENBLAS_NUM_THREADS=1 ASAN_OPTIONS=\"${ASAN_OPTIONS:-}:detect_leaks=0\" " MPI_NO_TRIAL

static inline bool have_mpi(void)
{
#ifdef AMP_HAVE_MPI
    return system("command -v mpirun > /dev/null 2>&1") == 0;
#else
    return false;
#endif
}

#define NEED_MPI()                                                                                                   \
    do {                                                                                                             \
        if (!have_mpi())                                                                                             \
            cr_skip_test("built without MPI, or no mpirun on PATH");                                                 \
    } while (0)

/* `mpirun -np NP [MCA] ampTrain ARGS` from the source directory, one BLAS thread a rank, as root where we
 * are root, stderr merged. Returns a static buffer. */
static struct result mpi(int np, const char *mca, const char *fmt, ...) __attribute__((format(printf, 3, 4), unused));
static struct result mpi(int np, const char *mca, const char *fmt, ...)
{
    char args[3000], cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof cmd,
             "cd %s && { " MPI_ENV
             "timeout -s KILL 300 mpirun -np %d --oversubscribe --bind-to none %s %s %s ; } 2>&1",
             AMP_SOURCE_DIR, np, mca ? mca : "", amp_binary(), args);
    return shell(cmd);
}

/* scale_log.csv, the last eval_lines of eval.jsonl (a resumed run has one more: its first part's end) and
 * every tensor of the checkpoints at `steps`, of runs scratch/A and scratch/B. */
static inline void compare_runs(const char *a, const char *b, int steps, int eval_lines)
{
    char pa[512], pb[512];
    snprintf(pa, sizeof pa, "%s/%s/scale_log.csv", scratch, a);
    snprintf(pb, sizeof pb, "%s/%s/scale_log.csv", scratch, b);
    assert_same_logs(pa, pb);
    snprintf(pa, sizeof pa, "%s/%s/eval.jsonl", scratch, a);
    snprintf(pb, sizeof pb, "%s/%s/eval.jsonl", scratch, b);
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "[ \"$(tail -n %d %s)\" = \"$(tail -n %d %s)\" ] && echo SAME", eval_lines, pa,
             eval_lines, pb);
    struct result r = shell(cmd);
    cr_assert(strstr(r.out, "SAME"), "eval.jsonl differ: %s", r.out);
    snprintf(pa, sizeof pa, "%s/%s/ckpt-%d.h5", scratch, a, steps);
    snprintf(pb, sizeof pb, "%s/%s/ckpt-%d.h5", scratch, b, steps);
    int n = assert_same_tensors(pa, pb);
    cr_assert_geq(n, 6, "only %d tensors compared", n);
}

/* Largest |a - b| / max|a| over each tensor under /model of two checkpoints (relative error in max norm). */
struct rel_ctx {
    double worst;
    char name[256];
};

static void rel_pair(const char *name, const float *a, const float *b, size_t n, void *user)
{
    struct rel_ctx *c = user;
    if (strncmp(name, "model/", 6) != 0)
        return;
    cr_assert_not_null(b, "%s missing in the other checkpoint, or of another size", name);
    double dmax = 0, amax = 0;
    for (size_t i = 0; i < n; i++) {
        dmax = fmax(dmax, fabs((double)a[i] - (double)b[i]));
        amax = fmax(amax, fabs((double)a[i]));
    }
    double rel = amax > 0 ? dmax / amax : dmax;
    if (rel > c->worst || c->name[0] == '\0') {
        c->worst = rel;
        snprintf(c->name, sizeof c->name, "%s", name);
    }
}

static inline double max_rel_diff(const char *a, const char *b, char *worst, size_t len)
{
    struct rel_ctx c = {.worst = -1};
    visit_tensor_pairs(a, b, rel_pair, &c);
    snprintf(worst, len, "%s", c.name);
    return c.worst;
}

#endif
