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
#endif

TestSuite(comm_mpi, .init = make_scratch, .fini = remove_scratch); /* the ranks run in scratch */

Test(comm_mpi, a_started_reduce_completes_while_the_main_thread_makes_no_mpi_call)
{
    NEED_MPI();
    char self[1024], cmd[2048];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    cr_assert_gt(n, 0);
    self[n] = '\0';
    /* BXFI_MAP (Criterion's sandbox) would make the ranks Criterion workers: they run the probe instead */
    snprintf(cmd, sizeof cmd,
             "cd %s && { unset BXFI_MAP; " MPI_ENV "AMP_COMM_MPI_PROBE=1 timeout -s KILL 120 mpirun -np 2 --oversubscribe --bind-to none "
             "-x AMP_COMM_MPI_PROBE %s ; } 2>&1",
             scratch, self);
    struct result r = shell(cmd);
    cr_assert_eq(r.code, 0, "%s", r.out);
    for (int rank = 0; rank < 2; rank++) {
        char want[128];
        snprintf(want, sizeof want,
                 "rank %d: thread before 0 after 1, complete before the wait 1, wrong sums 0", rank);
        cr_assert(strstr(r.out, want), "no '%s' in:\n%s", want, r.out);
    }
}

int main(int argc, char *argv[])
{
#ifdef AMP_HAVE_MPI
    if (getenv("AMP_COMM_MPI_PROBE"))
        return probe(&argc, &argv);
#endif
    struct criterion_test_set *tests = criterion_initialize();
    int status = 0;
    if (criterion_handle_args(argc, argv, true))
        status = !criterion_run_all_tests(tests);
    criterion_finalize(tests);
    return status;
}
