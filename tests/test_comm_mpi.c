/*
 * test_comm_mpi.c — the MPI communicator's progress thread (lib/base/comm_mpi.c): a started reduce completes
 * while the main thread makes no MPI call at all, and a job that starts none has no thread.
 *
 * MPI needs ranks, so each test runs this binary under `mpirun -np 2` with AMP_COMM_MPI_PROBE set; main then
 * runs the probe below (two ranks, in process) instead of Criterion, and the test reads what each rank prints.
 * The probe starts a reduce of 4 MiB of fp32 (beyond any eager limit: it needs many rounds of MPI progress), then
 * only sleeps and reads the request's state, which nothing but the progress thread can change while the main
 * thread makes no MPI call (comm_mpi_reduce_complete reads a count under the communicator's mutex). Without the
 * thread the request stays incomplete until the wait, whatever the timing: the test cannot pass by accident.
 *
 * The second probe (AMP_COMM_MPI_PROBE=order, at 3 and 4 ranks) holds the communicator's sums to comm.h's
 * association: every element added in rank order, ((x0 + x1) + x2) + ..., rounded to fp32 (or fp64) at each step.
 * Each rank draws every rank's values from one seeded formula, so it computes that sum itself and compares bit for
 * bit: reduce_scatter (its block summed, the rest untouched), reduce_sum, and two reduces started together and waited
 * for, at sizes that leave blocks uneven or empty and one over 2^22 elements (the communicator's pieces). The values
 * are chosen so that other associations give other bits for many elements (the probe counts them), so a sum in MPI's
 * order, or in reverse rank order, fails. The same for the collectives on the caller's blocks (dist.zero 1's
 * partition): reduce_scatter_blocks and a started reduce_scatter_start sum this rank's block and leave the rest,
 * all_gather_blocks then gives every rank every sum, and host_gather_blocks gives rank 0 each rank's block, on
 * blocks that are uneven, with rank 0's empty.
 */
#define _POSIX_C_SOURCE 200809L
#include "disttest.h" /* shell, NEED_MPI, MPI_ENV; and ckpt_testlib.h: scratch */

#include <time.h>

#include "comm.h" /* comm_open, reduce_start, comm_mpi_reduce_complete, comm_mpi_progress_thread */

#define PROBE_FLOATS ((size_t)1 << 20) /* 4 MiB of fp32 */
#define PROBE_LOOKS 2000               /* 10 ms apart: 20 s at most */

#ifdef AMP_HAVE_MPI
/* One rank of the probe: prints "rank R: thread before A after B, complete before the wait C, wrong sums N". */
static int probe(int *argc, char ***argv)
{
    struct comm *c = NULL;
    struct amp_error err;
    if (comm_open(&c, argc, argv, &err) != AMP_OK || strcmp(c->transport, "mpi") != 0 || c->world != 2) {
        fprintf(stderr, "probe: not two MPI ranks\n");
        return 1;
    }
    float *buf = malloc(PROBE_FLOATS * sizeof *buf);
    if (!buf)
        c->abort(c, 1);
    for (size_t i = 0; i < PROBE_FLOATS; i++)
        buf[i] = (float)(c->rank + 1) * (float)(i % 1000);
    double one = 1.0; /* a blocking collective first: it starts no thread */
    c->host_allreduce(c, &one, 1, COMM_F64, COMM_SUM);
    bool before = comm_mpi_progress_thread(c);

    struct comm_request *r = c->reduce_start(c, buf, PROBE_FLOATS, COMM_F32);
    bool after = comm_mpi_progress_thread(c);
    /* no MPI call from this thread until the wait: it sleeps and reads the request's count of complete parts */
    const struct timespec look = {.tv_sec = 0, .tv_nsec = 10 * 1000 * 1000};
    bool complete = false;
    for (int k = 0; k < PROBE_LOOKS && !(complete = comm_mpi_reduce_complete(c, r)); k++)
        nanosleep(&look, NULL);
    c->reduce_wait(c, r);

    size_t wrong = 0; /* rank 0's (1 x) plus rank 1's (2 x): 3 x, exact in fp32 */
    for (size_t i = 0; i < PROBE_FLOATS; i++)
        wrong += buf[i] != 3.0f * (float)(i % 1000);
    printf("rank %d: thread before %d after %d, complete before the wait %d, wrong sums %zu\n", c->rank, before, after,
           complete, wrong);
    fflush(stdout);
    free(buf);
    comm_close(c);
    return 0;
}

/* Rank q's value at element i: a fraction of 24 random bits times 2^e, e in [-12, 12], either sign (splitmix64). */
static double order_value(int q, size_t i)
{
    uint64_t z = ((uint64_t)q << 40) ^ (uint64_t)i;
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    double frac = (double)(z & 0xFFFFFF) / 16777216.0;
    int e = (int)((z >> 24) % 25) - 12;
    return ((z >> 60) & 1 ? -1.0 : 1.0) * ldexp(1.0 + frac, e);
}

/* The sum over `world` ranks of element i in rank order, in fp32; *other: whether reverse rank order differs. */
static float rank_order_f32(int world, size_t i, bool *other)
{
    float a = (float)order_value(0, i), b = (float)order_value(world - 1, i);
    for (int q = 1; q < world; q++)
        a += (float)order_value(q, i);
    for (int q = world - 2; q >= 0; q--)
        b += (float)order_value(q, i);
    *other = a != b;
    return a;
}

/* Rank q's fp64 value at element i: order_value with 30 more random bits below its 24, so that sums round. */
static double order_value_f64(int q, size_t i)
{
    return order_value(q, i) + ldexp(order_value(q, i + ((size_t)1 << 39)), -30);
}

static double rank_order_f64(int world, size_t i)
{
    double a = order_value_f64(0, i);
    for (int q = 1; q < world; q++)
        a += order_value_f64(q, i);
    return a;
}

static void fill_f32(float *x, size_t n, int rank)
{
    for (size_t i = 0; i < n; i++)
        x[i] = (float)order_value(rank, i);
}

/* Elements of x[0..n) that are not the rank-order sum (bits); *sensitive += those whose sum another order changes. */
static size_t wrong_sums(const float *x, size_t n, int world, size_t *sensitive)
{
    size_t wrong = 0;
    for (size_t i = 0; i < n; i++) {
        bool other;
        float want = rank_order_f32(world, i, &other);
        wrong += memcmp(&x[i], &want, sizeof want) != 0;
        *sensitive += other;
    }
    return wrong;
}

/* Blocks for the collectives that take them: rank 0's empty, the others growing with q (q^2 / world^2 of n). */
static void uneven_bounds(size_t n, int world, size_t *b)
{
    b[0] = b[1] = 0;
    for (int q = 2; q < world; q++)
        b[q] = (size_t)((double)n * q * q / ((double)world * world));
    b[world] = n;
}

/* Elements of x[0..n) wrong after a reduce-scatter onto bounds b: this rank's block the rank-order sum, the rest
 * this rank's own values. */
static size_t scatter_wrong(const float *x, size_t n, const size_t *b, int rank, int world)
{
    size_t wrong = 0;
    for (size_t i = 0; i < n; i++) {
        bool other;
        float want = i >= b[rank] && i < b[rank + 1] ? rank_order_f32(world, i, &other) : (float)order_value(rank, i);
        wrong += memcmp(&x[i], &want, sizeof want) != 0;
    }
    return wrong;
}

/* The collectives on the caller's blocks (comm.h) for n elements: the elements they get wrong. */
static size_t blocks_wrong(struct comm *c, size_t n)
{
    size_t *b = malloc(((size_t)c->world + 1) * sizeof *b), wrong = 0, ignored = 0;
    float *x = malloc(n * sizeof *x), *all = c->rank == 0 ? malloc(n * sizeof *all) : NULL;
    if (!b || !x || (c->rank == 0 && !all))
        c->abort(c, 1);
    uneven_bounds(n, c->world, b);
    fill_f32(x, n, c->rank);
    c->reduce_scatter_blocks(c, x, b, COMM_F32);
    wrong += scatter_wrong(x, n, b, c->rank, c->world);
    /* rank 0 gathers each rank's summed block */
    c->host_gather_blocks(c, x + b[c->rank], all, b, sizeof *x, 0);
    if (c->rank == 0)
        wrong += wrong_sums(all, n, c->world, &ignored);
    c->all_gather_blocks(c, x, b, sizeof *x);
    wrong += wrong_sums(x, n, c->world, &ignored);
    /* started: the first third and the rest, each onto its own blocks, waited for in order */
    fill_f32(x, n, c->rank);
    size_t third = n / 3, *b2 = malloc(((size_t)c->world + 1) * sizeof *b2);
    if (!b2)
        c->abort(c, 1);
    uneven_bounds(third, c->world, b);
    uneven_bounds(n - third, c->world, b2);
    struct comm_request *r1 = c->reduce_scatter_start(c, x, b, COMM_F32);
    struct comm_request *r2 = c->reduce_scatter_start(c, x + third, b2, COMM_F32);
    c->reduce_wait(c, r1);
    c->reduce_wait(c, r2);
    for (int q = 0; q <= c->world; q++)
        b2[q] += third; /* the second reduce's blocks as elements of x */
    for (size_t i = 0; i < n; i++) {
        bool other;
        const size_t *bb = i < third ? b : b2;
        float want = i >= bb[c->rank] && i < bb[c->rank + 1] ? rank_order_f32(c->world, i, &other)
                                                             : (float)order_value(c->rank, i);
        wrong += memcmp(&x[i], &want, sizeof want) != 0;
    }
    free(b);
    free(b2);
    free(x);
    free(all);
    return wrong;
}

/* One rank of the order probe: prints "rank R of W: reduce_scatter wrong A, reduce_sum wrong B, started wrong C,
 * fp64 wrong D, blocks wrong E, association-sensitive K". */
static int probe_order(int *argc, char ***argv)
{
    struct comm *c = NULL;
    struct amp_error err;
    if (comm_open(&c, argc, argv, &err) != AMP_OK || strcmp(c->transport, "mpi") != 0 || c->world < 3) {
        fprintf(stderr, "probe: not three or more MPI ranks\n");
        return 1;
    }
    const size_t sizes[] = {1, (size_t)c->world - 1, 1000, 4097, ((size_t)1 << 22) + 1001};
    size_t rs_wrong = 0, sum_wrong = 0, started_wrong = 0, f64_wrong = 0, sensitive = 0, blk_wrong = 0;
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        size_t n = sizes[k], lo, hi;
        float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y);
        double *d = malloc(n * sizeof *d);
        if (!x || !y || !d)
            c->abort(c, 1);
        /* reduce_scatter: this rank's block summed, every other element still its own value */
        fill_f32(x, n, c->rank);
        c->reduce_scatter(c, x, n, COMM_F32);
        comm_shard(n, c->world, c->rank, &lo, &hi);
        fill_f32(y, n, c->rank);
        size_t ignored = 0;
        for (size_t i = 0; i < n; i++) {
            bool other;
            float want = i >= lo && i < hi ? rank_order_f32(c->world, i, &other) : y[i];
            rs_wrong += memcmp(&x[i], &want, sizeof want) != 0;
        }
        /* reduce_sum */
        fill_f32(x, n, c->rank);
        c->reduce_sum(c, x, n, COMM_F32);
        sum_wrong += wrong_sums(x, n, c->world, &sensitive);
        /* two reduces of x's first third and the rest in flight at once, waited for in order: elementwise, so the
         * same sums as one reduce of x (the blocks differ, the bits must not) */
        fill_f32(x, n, c->rank);
        size_t third = n / 3;
        struct comm_request *a = c->reduce_start(c, x, third, COMM_F32);
        struct comm_request *b = c->reduce_start(c, x + third, n - third, COMM_F32);
        c->reduce_wait(c, a);
        c->reduce_wait(c, b);
        started_wrong += wrong_sums(x, n, c->world, &ignored);
        /* fp64 */
        for (size_t i = 0; i < n; i++)
            d[i] = order_value_f64(c->rank, i);
        c->reduce_sum(c, d, n, COMM_F64);
        for (size_t i = 0; i < n; i++) {
            double want = rank_order_f64(c->world, i);
            f64_wrong += memcmp(&d[i], &want, sizeof want) != 0;
        }
        free(x);
        free(y);
        free(d);
        blk_wrong += blocks_wrong(c, n);
    }
    printf("rank %d of %d: reduce_scatter wrong %zu, reduce_sum wrong %zu, started wrong %zu, fp64 wrong %zu, "
           "blocks wrong %zu, association-sensitive %zu\n", c->rank, c->world, rs_wrong, sum_wrong, started_wrong,
           f64_wrong, blk_wrong, sensitive);
    fflush(stdout);
    comm_close(c);
    return 0;
}
#endif

TestSuite(comm_mpi, .init = make_scratch, .fini = remove_scratch); /* the ranks run in scratch */

/* This test binary run as `np` MPI ranks in scratch, each running probe `probe` (AMP_COMM_MPI_PROBE) */
static struct result run_probe(const char *probe, int np)
{
    char self[1024], cmd[2048];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    cr_assert_gt(n, 0);
    self[n] = '\0';
    /* BXFI_MAP (Criterion's sandbox) would make the ranks Criterion workers: they run the probe instead */
    snprintf(cmd, sizeof cmd,
             "cd %s && { unset BXFI_MAP; " MPI_ENV "AMP_COMM_MPI_PROBE=%s timeout -s KILL 120 mpirun -np %d "
             "--oversubscribe --bind-to none -x AMP_COMM_MPI_PROBE %s ; } 2>&1",
             scratch, probe, np, self);
    return shell(cmd);
}

Test(comm_mpi, a_started_reduce_completes_while_the_main_thread_makes_no_mpi_call)
{
    NEED_MPI();
    struct result r = run_probe("1", 2);
    cr_assert_eq(r.code, 0, "%s", r.out);
    for (int rank = 0; rank < 2; rank++) {
        char want[128];
        snprintf(want, sizeof want,
                 "rank %d: thread before 0 after 1, complete before the wait 1, wrong sums 0", rank);
        cr_assert(strstr(r.out, want), "no '%s' in:\n%s", want, r.out);
    }
}

/* The order probe on np ranks: every rank's sums are the rank-order ones, bit for bit, and the values are such that
 * another order gives other bits for many elements. */
static void check_rank_order(int np)
{
    NEED_MPI();
    struct result r = run_probe("order", np);
    cr_assert_eq(r.code, 0, "%s", r.out);
    for (int rank = 0; rank < np; rank++) {
        char want[160];
        snprintf(want, sizeof want,
                 "rank %d of %d: reduce_scatter wrong 0, reduce_sum wrong 0, started wrong 0, fp64 wrong 0, "
                 "blocks wrong 0, association-sensitive ", rank, np);
        const char *at = strstr(r.out, want);
        cr_assert(at, "no '%s' in:\n%s", want, r.out);
        long long sensitive = 0;
        cr_assert_eq(sscanf(at + strlen(want), "%lld", &sensitive), 1, "%s", r.out);
        /* a sum in reverse rank order differs from the rank-order one for many of the elements */
        cr_assert_gt(sensitive, 1000, "%s", r.out);
    }
}

Test(comm_mpi, three_ranks_sum_in_rank_order) { check_rank_order(3); }
Test(comm_mpi, four_ranks_sum_in_rank_order) { check_rank_order(4); }

int main(int argc, char *argv[])
{
#ifdef AMP_HAVE_MPI
    const char *which = getenv("AMP_COMM_MPI_PROBE");
    if (which)
        return strcmp(which, "order") == 0 ? probe_order(&argc, &argv) : probe(&argc, &argv);
#endif
    struct criterion_test_set *tests = criterion_initialize();
    int status = 0;
    if (criterion_handle_args(argc, argv, true))
        status = !criterion_run_all_tests(tests);
    criterion_finalize(tests);
    return status;
}
