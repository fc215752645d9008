/*
 * probe_cores.c — what the machine itself gives two threads: a loop of independent AVX-512 FMAs (no memory
 * traffic, nothing shared) run by one process, then by two at once, ROUNDS times; each round prints the pair's
 * summed rate over the lone one's. Two real cores give about 2x; two hardware threads of one core, or a core the
 * host lends elsewhere meanwhile, much less. It is the ceiling for any 2-thread speed-up measured in the same
 * minutes (docs/perf.md, "Two cores that are sometimes one").
 *   gcc -O2 -mavx512f scripts/dev/probe_cores.c -o /tmp/probe_cores && /tmp/probe_cores [ROUNDS=10]
 */
#define _POSIX_C_SOURCE 200809L
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define ITERS 40000000L /* about 0.2 s on one core */

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* FMAs a second (16 lanes each) of one run of the loop: twelve independent chains in registers, more than both
 * FMA pipes of a core hold in flight, so the loop is bound by the pipes, not by an FMA's latency. */
static double fma_rate(void)
{
    const __m512 mul = _mm512_set1_ps(0.999999f), add = _mm512_set1_ps(1e-7f);
    __m512 a0 = _mm512_set1_ps(1.0f), a1 = _mm512_set1_ps(1.1f), a2 = _mm512_set1_ps(1.2f), a3 = _mm512_set1_ps(1.3f),
           a4 = _mm512_set1_ps(1.4f), a5 = _mm512_set1_ps(1.5f), a6 = _mm512_set1_ps(1.6f), a7 = _mm512_set1_ps(1.7f),
           a8 = _mm512_set1_ps(1.8f), a9 = _mm512_set1_ps(1.9f), a10 = _mm512_set1_ps(2.0f), a11 = _mm512_set1_ps(2.1f);
    double t0 = now();
    for (long it = 0; it < ITERS; it++) {
        a0 = _mm512_fmadd_ps(a0, mul, add), a1 = _mm512_fmadd_ps(a1, mul, add);
        a2 = _mm512_fmadd_ps(a2, mul, add), a3 = _mm512_fmadd_ps(a3, mul, add);
        a4 = _mm512_fmadd_ps(a4, mul, add), a5 = _mm512_fmadd_ps(a5, mul, add);
        a6 = _mm512_fmadd_ps(a6, mul, add), a7 = _mm512_fmadd_ps(a7, mul, add);
        a8 = _mm512_fmadd_ps(a8, mul, add), a9 = _mm512_fmadd_ps(a9, mul, add);
        a10 = _mm512_fmadd_ps(a10, mul, add), a11 = _mm512_fmadd_ps(a11, mul, add);
    }
    double dt = now() - t0;
    __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                               _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
    sum = _mm512_add_ps(sum, _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)));
    if (_mm512_reduce_add_ps(sum) == 12345.0f) /* keeps the loop; never true */
        puts("");
    return (double)ITERS * 12 * 16 / dt;
}

/* The loop in two processes at once: their rates summed (each child reports through a pipe). */
static double pair_rate(void)
{
    int fd[2];
    if (pipe(fd) != 0)
        exit(1);
    for (int c = 0; c < 2; c++) {
        if (fork() == 0) {
            double r = fma_rate();
            if (write(fd[1], &r, sizeof r) != sizeof r)
                _exit(1);
            _exit(0);
        }
    }
    double sum = 0.0, r;
    for (int c = 0; c < 2; c++)
        if (read(fd[0], &r, sizeof r) == sizeof r)
            sum += r;
    while (wait(NULL) > 0)
        ;
    close(fd[0]);
    close(fd[1]);
    return sum;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    int rounds = argc > 1 ? atoi(argv[1]) : 10;
    if (rounds < 1 || rounds > 1000) {
        fprintf(stderr, "usage: probe_cores [ROUNDS, 1..1000]\n");
        return 2;
    }
    double *s = malloc((size_t)rounds * sizeof *s);
    if (!s)
        return 1;
    for (int r = 0; r < rounds; r++) {
        double one = fma_rate(), two = pair_rate();
        s[r] = two / one;
        printf("round %d: one process %.2f GFMA/s, two %.2f GFMA/s together: %.2fx\n", r + 1, one / 1e9, two / 1e9,
               s[r]);
    }
    qsort(s, (size_t)rounds, sizeof *s, cmp);
    printf("two processes over one: median %.2fx, lowest %.2fx, highest %.2fx (%d rounds)\n",
           rounds % 2 ? s[rounds / 2] : (s[rounds / 2 - 1] + s[rounds / 2]) / 2, s[0], s[rounds - 1], rounds);
    free(s);
    return 0;
}
