/*
 * test_threads.c — the CPU backend's threads (run.threads, docs/backend.md, "Threads"): results are bit-identical for
 * any thread count.
 *
 *  - The pool (lib/base/threadpool.h): every chunk runs exactly once, on a worker id below the thread count, for
 *    chunk counts below, at and far above the thread count; a nested parallel_for runs inline; a thread done
 *    with its home range takes chunks from the others'; AMPTRAIN_POOL_PROFILE counts each call by function and caller;
 *    idle threads spin as long as AMPTRAIN_POOL_SPIN_US says, and a bad value is refused.
 *  - The threaded ops, one by one, on random inputs: the products (fp32, fp16, bf16 inputs; fp32 and 16-bit
 *    C; beta 0 and 1; bias; transposes; several k blocks, so the partial sums; more columns than one n
 *    block), the elementwise ops (every activation forward and backward, add, dropout), the optimizer
 *    updates (adamw, sgd with Nesterov momentum, bf16 weights and moments with stochastic rounding), the
 *    convolutions (forward, data and filter gradients, strided, pointwise), pooling (max, avg), batchnorm
 *    (training and eval) and the bias gradient, on shapes of several chunks and one below the threshold, at
 *    2, 3 and 7 threads against 1: every output byte-identical. Likewise attention, layernorm, the
 *    embedding, the cross-entropy and MSE losses, count_zeros and fp8_cast (at the end of the file), in
 *    fp32, fp16 and bf16, on shapes of several chunks and of one.
 *  - ampTrain end to end: fashion_mlp, fashion_cnn and text_gpt, short runs in the four precision modes
 *    fp32, fp16-dynamic, bf16 and fp8, at run.threads 1, 2, 3 and 7: scale_log.csv (samples_per_s aside)
 *    and every checkpoint tensor identical. And a resume on another thread count continues bit-exactly.
 */
#define _GNU_SOURCE /* dladdr */
#include "ckpt_testlib.h" /* amp, scratch, assert_same_tensors, assert_same_logs, SMALL */

#include <dlfcn.h>
#include <math.h>
#include <stdatomic.h>
#include <time.h>

#include "backend.h"    /* backend_cpu_create, set_threads, the op table */
#include "gemm_avx512.h" /* gemm_avx512_amx_supported */
#include "testrand.h"   /* seed, urand */
#include "threadpool.h" /* the pool under test */

/* ---- the pool ------------------------------------------------------------------------------------- */

struct count_job {
    _Atomic int *runs; /* per chunk */
    int threads;
    _Atomic int bad_worker;
    struct threadpool *pool;
    _Atomic int nested;
};

static void count_chunk(void *arg, int64_t chunk, int worker)
{
    struct count_job *j = arg;
    atomic_fetch_add(&j->runs[chunk], 1);
    if (worker < 0 || worker >= j->threads)
        atomic_store(&j->bad_worker, 1);
}

/* A chunk that takes 5 ms, longer than the pool spins: whoever finishes first goes to sleep and must be woken by
 * the one that finishes the last chunk. */
static void slow_chunk(void *arg, int64_t chunk, int worker)
{
    struct timespec pause = { 0, 5000000 };
    nanosleep(&pause, NULL);
    count_chunk(arg, chunk, worker);
}

static void nested_inner(void *arg, int64_t chunk, int worker)
{
    (void)chunk;
    struct count_job *j = arg;
    if (worker != 0) /* inline on the thread that called it: worker 0 by the contract */
        atomic_store(&j->bad_worker, 1);
    atomic_fetch_add(&j->nested, 1);
}

static void nested_outer(void *arg, int64_t chunk, int worker)
{
    struct count_job *j = arg;
    count_chunk(arg, chunk, worker);
    parallel_for(j->pool, 3, nested_inner, arg);
}

/* One call site each, whatever the compiler unrolls around them. */
static __attribute__((noinline)) void run_five(struct threadpool *p, struct count_job *j)
{
    parallel_for(p, 5, count_chunk, j);
}

static __attribute__((noinline)) void run_one(struct threadpool *p, struct count_job *j)
{
    parallel_for(p, 1, count_chunk, j);
}

/* AMPTRAIN_POOL_PROFILE (lib/base/pool_profile.h): a pool counts its calls by (function, caller), names the function by an
 * offset into its object file that dladdr agrees with, and appends the table when it is freed. */
Test(threads, a_profiled_pool_counts_each_call_by_function_and_caller)
{
    char path[] = "/tmp/amp_pool_profile_XXXXXX";
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    close(fd);
    setenv("AMPTRAIN_POOL_PROFILE", path, 1);
    struct threadpool *p = threadpool_create(2);
    unsetenv("AMPTRAIN_POOL_PROFILE");
    cr_assert_not_null(p);
    _Atomic int runs[5];
    struct count_job j = { .runs = runs, .threads = 2 };
    for (int rep = 0; rep < 3; rep++) {
        for (int i = 0; i < 5; i++)
            atomic_init(&runs[i], 0);
        run_five(p, &j);
    }
    run_one(p, &j);
    threadpool_free(p);
    Dl_info info;
    cr_assert(dladdr((void *)count_chunk, &info) && info.dli_fbase);
    const unsigned long want = (unsigned long)((const char *)(void *)count_chunk - (const char *)info.dli_fbase);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f);
    char line[9000], fo[4096], co[4096];
    int headers = 0, rows = 0, threaded = 0, inlined = 0;
    while (fgets(line, sizeof line, f)) {
        if (line[0] == '#') {
            cr_assert(strstr(line, "pool of 2 thread(s)"), "header: %s", line);
            headers++;
            continue;
        }
        unsigned long fn_off, caller_off;
        long long calls, inl, chunks, total, wait, gap;
        cr_assert_eq(sscanf(line, "%4095s %lx %4095s %lx %lld %lld %lld %lld %lld %lld", fo, &fn_off, co, &caller_off,
                            &calls, &inl, &chunks, &total, &wait, &gap), 10, "row: %s", line);
        cr_assert_eq(fn_off, want, "row: %s (count_chunk is at 0x%lx)", line, want);
        cr_assert(total > 0 && wait >= 0 && wait <= total && gap >= 0, "row: %s", line);
        if (calls == 3) {
            cr_assert(chunks == 15 && inl == 0, "row: %s", line);
            threaded++;
        } else {
            cr_assert(calls == 1 && chunks == 1 && inl == 1, "row: %s", line);
            inlined++;
        }
        rows++;
    }
    fclose(f);
    unlink(path);
    cr_assert(headers == 1 && rows == 2 && threaded == 1 && inlined == 1, "%d header(s), %d row(s)", headers, rows);
}

Test(threads, pool_runs_every_chunk_once)
{
    const int counts[] = {1, 2, 3, 7};
    const int64_t chunks[] = {0, 1, 2, 5, 1000};
    for (int t = 0; t < 4; t++) {
        struct threadpool *p = threadpool_create(counts[t]);
        cr_assert_not_null(p);
        cr_assert_eq(threadpool_threads(p), counts[t]);
        for (int rep = 0; rep < 50; rep++) {
            for (int c = 0; c < 5; c++) {
                _Atomic int runs[1000];
                for (int i = 0; i < 1000; i++)
                    atomic_init(&runs[i], 0);
                struct count_job j = { .runs = runs, .threads = counts[t] };
                parallel_for(p, chunks[c], count_chunk, &j);
                for (int64_t i = 0; i < 1000; i++)
                    cr_assert_eq(atomic_load(&runs[i]), i < chunks[c] ? 1 : 0, "threads %d, %lld chunks: chunk %lld ran %d times",
                                 counts[t], (long long)chunks[c], (long long)i, atomic_load(&runs[i]));
                cr_assert_eq(atomic_load(&j.bad_worker), 0);
            }
            /* now and then longer than the pool spins (2 ms, or 20 us when it has more threads than CPUs), so
             * the workers and the caller go to sleep and are woken (threadpool.c) */
            if (rep % 10 == 9) {
                struct timespec pause = { 0, 3000000 };
                nanosleep(&pause, NULL);
            }
        }
        for (int rep = 0; rep < 3; rep++) {
            _Atomic int slow_runs[3];
            for (int i = 0; i < 3; i++)
                atomic_init(&slow_runs[i], 0);
            struct count_job j = { .runs = slow_runs, .threads = counts[t] };
            parallel_for(p, 3, slow_chunk, &j);
            for (int i = 0; i < 3; i++)
                cr_assert_eq(atomic_load(&slow_runs[i]), 1, "threads %d: slow chunk %d ran %d times", counts[t], i,
                             atomic_load(&slow_runs[i]));
        }
        _Atomic int runs[10];
        for (int i = 0; i < 10; i++)
            atomic_init(&runs[i], 0);
        struct count_job j = { .runs = runs, .threads = counts[t], .pool = p };
        parallel_for(p, 10, nested_outer, &j);
        cr_assert_eq(atomic_load(&j.nested), 30);
        cr_assert_eq(atomic_load(&j.bad_worker), 0);
        threadpool_free(p);
    }
    cr_assert_geq(threadpool_available_cpus(), 1);
}

/* Which worker ran each chunk; the caller's (worker 0's) home chunks are slow. */
struct steal_job {
    _Atomic int ran_by[8];
    int64_t slow_below;
};

static void steal_chunk(void *arg, int64_t chunk, int worker)
{
    struct steal_job *j = arg;
    atomic_store(&j->ran_by[chunk], worker);
    if (chunk < j->slow_below) {
        struct timespec pause = { 0, 100000000 };
        nanosleep(&pause, NULL);
    }
}

/* Each thread starts on its home range (threadpool.c) and then takes what is left of the others': with the
 * caller's four chunks 100 ms each and worker 1's four instant, worker 1 takes some of the caller's while the
 * caller sleeps in its first (it would have to go unscheduled for 300 ms not to, which a loaded machine running
 * suites side by side does not do). */
Test(threads, a_thread_done_with_its_range_takes_chunks_from_the_others)
{
    struct threadpool *p = threadpool_create(2);
    cr_assert_not_null(p);
    struct steal_job j = { .slow_below = 4 };
    for (int i = 0; i < 8; i++)
        atomic_init(&j.ran_by[i], -1);
    parallel_for(p, 8, steal_chunk, &j);
    int stolen = 0;
    for (int i = 0; i < 8; i++) {
        cr_assert_geq(atomic_load(&j.ran_by[i]), 0, "chunk %d ran", i);
        stolen += i < 4 && atomic_load(&j.ran_by[i]) == 1;
    }
    cr_assert_geq(stolen, 1, "worker 1 took none of the caller's slow chunks");
    threadpool_free(p);
}

/* ---- the ops at 1, 2, 3 and 7 threads --------------------------------------------------------------- */

#define NBE 4
static const int thread_counts[NBE] = {1, 2, 3, 7};
static struct backend *bes[NBE];

static void setup(void)
{
    for (int i = 0; i < NBE; i++) {
        bes[i] = backend_cpu_create();
        cr_assert_not_null(bes[i]);
        struct amp_error err;
        cr_assert_eq(bes[i]->set_threads(bes[i], thread_counts[i], &err), AMP_OK, "%s", err.msg);
    }
}

static void teardown(void)
{
    for (int i = 0; i < NBE; i++)
        backend_close(bes[i]);
}

TestSuite(ops, .init = setup, .fini = teardown);

#define MAXT 128
static struct tensor pool_t[MAXT];
static int n_pool;

static struct tensor *tens(enum dtype dt, size_t n)
{
    cr_assert_lt(n_pool, MAXT);
    struct tensor *t = &pool_t[n_pool++];
    int64_t shape = (int64_t)n;
    struct amp_error err;
    cr_assert_eq(tensor_alloc(t, bes[0], dt, 1, &shape, "test", &err), AMP_OK);
    memset(t->data, 0xA5, tensor_bytes(t)); /* the same garbage in every copy */
    return t;
}

static void free_all(void)
{
    while (n_pool > 0)
        tensor_free(&pool_t[--n_pool]);
}

/* Random values in [lo, hi), stored in t's dtype. */
static struct tensor *trand(enum dtype dt, size_t n, float lo, float hi)
{
    struct tensor *t = tens(dt, n);
    float *h = malloc(n * sizeof *h);
    for (size_t i = 0; i < n; i++)
        h[i] = lo + (hi - lo) * (float)urand();
    tensor_from_host_f32(t, h);
    free(h);
    return t;
}

static struct tensor *tcopy(const struct tensor *src)
{
    struct tensor *t = tens(src->dtype, src->numel);
    memcpy(t->data, src->data, tensor_bytes(src));
    return t;
}

static void assert_same_bytes(const struct tensor *a, const struct tensor *b, const char *what, int threads)
{
    cr_assert_eq(tensor_bytes(a), tensor_bytes(b));
    const unsigned char *x = a->data, *y = b->data;
    for (size_t i = 0; i < tensor_bytes(a); i++)
        cr_assert_eq(x[i], y[i], "%s: %d threads differ from 1 at byte %zu", what, threads, i);
}

struct gemm_case {
    enum dtype in, out;
    bool ta, tb, bias;
    float beta;
    int64_t m, n, k;
    bool gelu; /* the GELU epilogue (C and aux of dtype `out`; beta 0, ta false) */
};

static void check_gemm(struct gemm_case c)
{
    struct tensor *a = trand(c.in, (size_t)(c.m * c.k), -1, 1), *b = trand(c.in, (size_t)(c.k * c.n), -1, 1);
    struct tensor *bias = c.bias ? trand(DT_FP32, (size_t)c.n, -1, 1) : NULL;
    struct tensor *c0 = trand(c.out, (size_t)(c.m * c.n), -1, 1), *outs[NBE], *aux[NBE] = { NULL };
    for (int i = 0; i < NBE; i++) {
        outs[i] = tcopy(c0); /* beta 1 reads it */
        if (c.gelu)
            aux[i] = tcopy(c0);
        struct gemm_args g = { .a = a, .b = b, .c = outs[i], .bias = bias, .trans_a = c.ta, .trans_b = c.tb,
                               .m = c.m, .n = c.n, .k = c.k, .alpha = 0.75f, .beta = c.beta, .batch = 1,
                               .epilogue = c.gelu ? GEMM_EPI_GELU_TANH : GEMM_EPI_NONE, .aux = aux[i] };
        bes[i]->gemm(bes[i], &g);
        cr_assert_eq(bes[i]->status(bes[i], NULL), AMP_OK);
    }
    char what[128];
    snprintf(what, sizeof what, "gemm %s->%s %c%c m %lld n %lld k %lld beta %g%s%s", dtype_name(c.in),
             dtype_name(c.out), c.ta ? 'T' : 'N', c.tb ? 'T' : 'N', (long long)c.m, (long long)c.n, (long long)c.k,
             (double)c.beta, c.bias ? " bias" : "", c.gelu ? " GELU epilogue (C)" : "");
    for (int i = 1; i < NBE; i++)
        assert_same_bytes(outs[0], outs[i], what, thread_counts[i]);
    for (int i = 1; c.gelu && i < NBE; i++)
        assert_same_bytes(aux[0], aux[i], "the GELU epilogue's aux", thread_counts[i]);
    free_all();
}

Test(ops, gemm_bit_identical_for_any_thread_count)
{
    seed(1601);
    const enum dtype ins[] = {DT_FP32, DT_FP16, DT_BF16};
    for (int d = 0; d < 3; d++) {
        enum dtype in = ins[d];
        /* rows not a multiple of 12, k over several k blocks (partial sums), both transposes; each of the three
         * ways gemm_avx512_plan shares a product out: 128-column chunks against a whole op(A) per thread (at
         * most 192 rows, or off AMX no more rows than columns: 131 x 200, 97 x 130, 260 x 300), bands of rows
         * against a whole op(B) per thread (several k blocks: 250 x 70 x 530; 260 x 300 x 530 on AMX), and bands
         * per k block against a shared op(B) (one k block: 400 x 33 x 200, and on AMX 260 x 300 x 128, a weight
         * gradient's shape; n over 2048: 40 x 2100 below) */
        check_gemm((struct gemm_case){ in, DT_FP32, false, false, false, 0.0f, 131, 200, 700, false });
        check_gemm((struct gemm_case){ in, DT_FP32, true, true, false, 1.0f, 250, 70, 530, false });
        check_gemm((struct gemm_case){ in, in, false, true, true, 0.0f, 97, 130, 300, false });
        check_gemm((struct gemm_case){ in, in, true, false, false, 1.0f, 400, 33, 200, false });
        check_gemm((struct gemm_case){ in, in, true, false, false, 0.0f, 260, 300, 530, false });
        check_gemm((struct gemm_case){ in, DT_FP32, true, false, false, 0.0f, 260, 300, 128, false });
        /* few columns over several k blocks: on the FMA kernel two column chunks of half the panels each (fp32,
         * fp16; fashion_cnn's fc1 forward is 128 x 128 x 3136), one chunk for bf16 */
        check_gemm((struct gemm_case){ in, in, false, true, true, 0.0f, 120, 128, 600, false });
        /* more columns than one n block (2048) */
        check_gemm((struct gemm_case){ in, DT_FP32, false, false, true, 0.0f, 40, 2100, 64, false });
        /* the GELU epilogue: several 64K-element row blocks of several elementwise chunks, a ragged last one */
        check_gemm((struct gemm_case){ in, in, false, false, true, 0.0f, 300, 700, 64, true });
    }
}

/* Where the CPU has AMX, bf16 products run on its tiles by default (gemm_avx512.h); the vdpbf16ps path they
 * replace there (AMPTRAIN_GEMM_AMX=0) keeps its own thread-count invariance. Elsewhere the test above covered it. */
Test(ops, gemm_bf16_without_amx_bit_identical_for_any_thread_count)
{
    if (!gemm_avx512_amx_supported())
        cr_skip_test("no AMX here: bf16 products already ran on vdpbf16ps in gemm_bit_identical_for_any_thread_count");
    teardown();
    setenv("AMPTRAIN_GEMM_AMX", "0", 1);
    setup();
    unsetenv("AMPTRAIN_GEMM_AMX");
    seed(1602);
    check_gemm((struct gemm_case){ DT_BF16, DT_FP32, false, false, false, 0.0f, 131, 200, 700, false });
    check_gemm((struct gemm_case){ DT_BF16, DT_FP32, true, true, false, 1.0f, 250, 70, 530, false });
    check_gemm((struct gemm_case){ DT_BF16, DT_BF16, true, false, false, 1.0f, 400, 33, 200, false });
}

/* Elementwise ops on a tensor of several chunks (and a ragged last one). */
#define EW_N ((size_t)16 * 1024 * 7 + 333)

Test(ops, elementwise_bit_identical_for_any_thread_count)
{
    seed(1602);
    const enum dtype dts[] = {DT_FP32, DT_FP16, DT_BF16};
    const enum act_kind kinds[] = {ACT_RELU, ACT_GELU_TANH, ACT_GELU_ERF};
    for (int d = 0; d < 3; d++) {
        struct tensor *x = trand(dts[d], EW_N, -25, 25), *dy = trand(dts[d], EW_N, -2, 2), *y[NBE];
        for (int k = 0; k < 3; k++) {
            for (int i = 0; i < NBE; i++) {
                y[i] = tens(dts[d], EW_N);
                bes[i]->act_forward(bes[i], kinds[k], y[i], x);
            }
            for (int i = 1; i < NBE; i++)
                assert_same_bytes(y[0], y[i], "act_forward", thread_counts[i]);
            for (int i = 0; i < NBE; i++)
                bes[i]->act_backward(bes[i], kinds[k], y[i], dy, x);
            for (int i = 1; i < NBE; i++)
                assert_same_bytes(y[0], y[i], "act_backward", thread_counts[i]);
        }
        for (int i = 0; i < NBE; i++)
            bes[i]->add(bes[i], y[i], x, dy);
        for (int i = 1; i < NBE; i++)
            assert_same_bytes(y[0], y[i], "add", thread_counts[i]);
        struct rng_key key = { .seed = 7, .stream = 3, .counter = 11 };
        for (int i = 0; i < NBE; i++)
            bes[i]->dropout_forward(bes[i], y[i], x, 0.3f, key);
        for (int i = 1; i < NBE; i++)
            assert_same_bytes(y[0], y[i], "dropout_forward", thread_counts[i]);
        free_all();
    }
}

/* Three parameters (the middle one of many chunks) through adamw or sgd, two steps, at each thread count. */
static void check_optim(bool adamw, enum dtype wdt, bool stochastic)
{
    const size_t sizes[3] = {1000, (size_t)16 * 1024 * 5 + 77, 16 * 1024};
    struct tensor *p[NBE][3], *m[NBE][3], *v[NBE][3], *copy[NBE][3], *g[3];
    for (int j = 0; j < 3; j++) {
        g[j] = trand(DT_FP32, sizes[j], -100, 100);
        struct tensor *p0 = trand(wdt, sizes[j], -1, 1), *m0 = trand(wdt, sizes[j], -0.1f, 0.1f);
        struct tensor *v0 = trand(wdt, sizes[j], 0, 0.01f);
        for (int i = 0; i < NBE; i++) {
            p[i][j] = tcopy(p0);
            m[i][j] = tcopy(m0);
            v[i][j] = tcopy(v0);
            copy[i][j] = tens(wdt == DT_FP32 ? DT_BF16 : DT_FP32, sizes[j]);
        }
    }
    struct step_params sp = { .beta1 = 0.9f, .beta2 = 0.999f, .weight_decay = 0.1f };
    struct step_scalars sc;
    for (int64_t step = 1; step <= 2; step++) {
        step_rule_scalars(&sc, &sp, 1e-2f, step, 1.0f / 512);
        for (int i = 0; i < NBE; i++) {
            struct optim_update_args a[3];
            for (int j = 0; j < 3; j++)
                a[j] = (struct optim_update_args){ .master = p[i][j], .grad = g[j], .m = m[i][j],
                                                   .v = adamw ? v[i][j] : NULL, .copy = copy[i][j], .sc = &sc,
                                                   .weight_decay = 0.1f, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8f,
                                                   .momentum = 0.9f, .nesterov = true, .stochastic = stochastic,
                                                   .sr_seed = 99, .sr_param = (uint32_t)j };
            if (adamw)
                bes[i]->adamw_update(bes[i], a, 3);
            else
                bes[i]->sgd_update(bes[i], a, 3);
        }
    }
    for (int i = 1; i < NBE; i++)
        for (int j = 0; j < 3; j++) {
            assert_same_bytes(p[0][j], p[i][j], adamw ? "adamw weights" : "sgd weights", thread_counts[i]);
            assert_same_bytes(m[0][j], m[i][j], adamw ? "adamw m" : "sgd momentum", thread_counts[i]);
            assert_same_bytes(copy[0][j], copy[i][j], "the weights' copy", thread_counts[i]);
            if (adamw)
                assert_same_bytes(v[0][j], v[i][j], "adamw v", thread_counts[i]);
        }
    free_all();
}

Test(ops, optimizer_bit_identical_for_any_thread_count)
{
    seed(1603);
    check_optim(true, DT_FP32, false);
    check_optim(true, DT_BF16, true);
    check_optim(false, DT_FP32, false);
    check_optim(false, DT_BF16, true);
}

/* ---- conv, pooling, batchnorm, bias_grad ---- */

/* The chunking these shapes must exceed, as kernels/cpu/ sets it (conv.c's CONV_PAR_MACS, then one
 * image a chunk; EW_CHUNK elements for pooling, batchnorm and bias_grad, whose chunks are at least that
 * big): a "big" shape below
 * is checked to give several chunks, so a race between chunks, or a chunk summing in another order, shows
 * as a difference; a "small" one runs as one chunk. */
#define T_CONV_PAR_MACS ((int64_t)1 << 20)
#define T_EW_CHUNK ((int64_t)16 * 1024)

static void assert_chunks(bool big, int64_t work, int64_t threshold, int64_t chunks, const char *what)
{
    if (big) {
        cr_assert_geq(work, threshold, "%s: the shape is below the threading threshold", what);
        cr_assert_gt(chunks, 1, "%s: the shape gives one chunk", what);
    } else {
        cr_assert_lt(work, threshold, "%s: the small shape is above the threading threshold", what);
    }
}

struct conv_case {
    int64_t n, c_in, hw_in, c_out, kernel, stride, padding;
    bool big;
};

/* conv2d forward (with bias), backward_data, backward_filter (with db, beta 0 then 1) at 1, 2, 3, 7 threads. */
static void check_conv(struct conv_case c, enum dtype dt)
{
    int64_t ho = (c.hw_in + 2 * c.padding - c.kernel) / c.stride + 1;
    struct conv_args a = { .n = c.n, .c_in = c.c_in, .h_in = c.hw_in, .w_in = c.hw_in, .c_out = c.c_out, .h_out = ho,
                           .w_out = ho, .kernel = c.kernel, .stride = c.stride, .padding = c.padding };
    int64_t ckk = c.c_in * c.kernel * c.kernel, nx = c.n * c.c_in * c.hw_in * c.hw_in, ny = c.n * c.c_out * ho * ho;
    char what[128];
    snprintf(what, sizeof what, "conv %s n %lld c_in %lld %lldx%lld c_out %lld k %lld s %lld p %lld", dtype_name(dt),
             (long long)c.n, (long long)c.c_in, (long long)c.hw_in, (long long)c.hw_in, (long long)c.c_out,
             (long long)c.kernel, (long long)c.stride, (long long)c.padding);
    assert_chunks(c.big, c.n * c.c_out * ckk * ho * ho, T_CONV_PAR_MACS, c.n, what);
    struct tensor *x = trand(dt, (size_t)nx, -1, 1), *w = trand(dt, (size_t)(c.c_out * ckk), -0.5f, 0.5f);
    struct tensor *bias = trand(DT_FP32, (size_t)c.c_out, -1, 1), *dy = trand(dt, (size_t)ny, -1, 1);
    struct tensor *dw0 = trand(DT_FP32, (size_t)(c.c_out * ckk), -1, 1);
    struct tensor *y[NBE], *dx[NBE], *dw[NBE], *db[NBE];
    for (int i = 0; i < NBE; i++) {
        y[i] = tens(dt, (size_t)ny);
        dx[i] = tens(dt, (size_t)nx);
        dw[i] = tcopy(dw0);
        db[i] = tens(DT_FP32, (size_t)c.c_out);
        bes[i]->conv2d_forward(bes[i], &a, y[i], x, w, bias);
        bes[i]->conv2d_backward_data(bes[i], &a, dx[i], dy, w);
        bes[i]->conv2d_backward_filter(bes[i], &a, dw[i], db[i], dy, x, 0.0f);
        cr_assert_eq(bes[i]->status(bes[i], NULL), AMP_OK);
    }
    for (int i = 1; i < NBE; i++) {
        assert_same_bytes(y[0], y[i], what, thread_counts[i]);
        assert_same_bytes(dx[0], dx[i], what, thread_counts[i]);
        assert_same_bytes(dw[0], dw[i], what, thread_counts[i]);
        assert_same_bytes(db[0], db[i], what, thread_counts[i]);
    }
    for (int i = 0; i < NBE; i++) /* accumulated into (a second micro-batch), without db */
        bes[i]->conv2d_backward_filter(bes[i], &a, dw[i], NULL, y[i], x, 1.0f);
    for (int i = 1; i < NBE; i++)
        assert_same_bytes(dw[0], dw[i], what, thread_counts[i]);
    free_all();
}

Test(ops, conv2d_bit_identical_for_any_thread_count)
{
    seed(1604);
    const struct conv_case cases[] = {
        { 4, 20, 10, 30, 3, 1, 1, true },
        { 5, 3, 20, 26, 3, 1, 1, true },   /* hw 400: the filter product's k over 2 blocks (partial sums) */
        { 4, 16, 15, 40, 3, 2, 1, true },  /* stride 2 */
        { 4, 130, 10, 48, 1, 1, 0, true }, /* pointwise: no im2col */
        { 20, 3, 12, 16, 3, 1, 1, true },  /* dW's images in two groups (16 at a time) */
        { 3, 32, 8, 64, 3, 1, 1, true },   /* dW of 18432 elements: added up in two chunks */
        { 2, 2, 6, 4, 3, 1, 1, false },    /* below the threshold: the calling thread */
    };
    const enum dtype dts[] = {DT_FP32, DT_BF16, DT_FP16};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++)
        for (int d = 0; d < 3; d++)
            check_conv(cases[k], dts[d]);
}

struct pool_case {
    enum pool_kind kind;
    int64_t n, c, hw_in, kernel, stride, padding;
    bool big;
};

static void check_pool(struct pool_case c, enum dtype dt)
{
    int64_t ho = (c.hw_in + 2 * c.padding - c.kernel) / c.stride + 1;
    struct pool_args a = { .kind = c.kind, .n = c.n, .c = c.c, .h_in = c.hw_in, .w_in = c.hw_in, .h_out = ho,
                           .w_out = ho, .kernel = c.kernel, .stride = c.stride, .padding = c.padding };
    int64_t nx = c.n * c.c * c.hw_in * c.hw_in, ny = c.n * c.c * ho * ho, plane = c.hw_in * c.hw_in;
    char what[128];
    snprintf(what, sizeof what, "%s pool %s n %lld c %lld %lldx%lld k %lld s %lld p %lld",
             c.kind == POOL_MAX ? "max" : "avg", dtype_name(dt), (long long)c.n, (long long)c.c, (long long)c.hw_in,
             (long long)c.hw_in, (long long)c.kernel, (long long)c.stride, (long long)c.padding);
    int64_t per_chunk = (T_EW_CHUNK + plane - 1) / plane;
    assert_chunks(c.big, nx, T_EW_CHUNK, (c.n * c.c + per_chunk - 1) / per_chunk, what);
    struct tensor *x = trand(dt, (size_t)nx, -1, 1), *dy = trand(dt, (size_t)ny, -1, 1), *y[NBE], *dx[NBE];
    for (int i = 0; i < NBE; i++) {
        y[i] = tens(dt, (size_t)ny);
        dx[i] = tens(dt, (size_t)nx);
        bes[i]->pool2d_forward(bes[i], &a, y[i], x);
        bes[i]->pool2d_backward(bes[i], &a, dx[i], dy, x, y[i]);
        cr_assert_eq(bes[i]->status(bes[i], NULL), AMP_OK);
    }
    for (int i = 1; i < NBE; i++) {
        assert_same_bytes(y[0], y[i], what, thread_counts[i]);
        assert_same_bytes(dx[0], dx[i], what, thread_counts[i]);
    }
    free_all();
}

Test(ops, pool2d_bit_identical_for_any_thread_count)
{
    seed(1605);
    const struct pool_case cases[] = {
        { POOL_MAX, 16, 16, 14, 2, 2, 0, true }, /* 256 planes, 84 a chunk: 4 chunks */
        { POOL_MAX, 8, 20, 15, 3, 2, 1, true },
        { POOL_AVG, 8, 20, 15, 3, 1, 1, true },
        { POOL_MAX, 2, 3, 8, 2, 2, 0, false },
    };
    const enum dtype dts[] = {DT_FP32, DT_BF16};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++)
        for (int d = 0; d < 2; d++)
            check_pool(cases[k], dts[d]);
}

/* batchnorm forward (training with running statistics, then eval) and backward (training with dx, dgamma and
 * dbeta, beta_acc 0 and 1; eval) at 1, 2, 3, 7 threads; relu: with a ReLU fused. */
static void check_batchnorm(int64_t n, int64_t c, int64_t hw, bool big, enum dtype dt, bool relu)
{
    struct norm_args a = { .n = n, .c = c, .hw = hw, .eps = 1e-5f, .momentum = 0.1f, .training = true,
                           .relu = relu };
    size_t nx = (size_t)(n * c * hw);
    char what[96];
    snprintf(what, sizeof what, "batchnorm%s %s n %lld c %lld hw %lld", relu ? "+relu" : "", dtype_name(dt),
             (long long)n, (long long)c, (long long)hw);
    int64_t per_chunk = (T_EW_CHUNK + n * hw - 1) / (n * hw);
    assert_chunks(big, (int64_t)nx, T_EW_CHUNK, (c + per_chunk - 1) / per_chunk, what);
    struct tensor *x = trand(dt, nx, -2, 3), *dy = trand(dt, nx, -1, 1);
    struct tensor *gamma = trand(DT_FP32, (size_t)c, 0.5f, 1.5f), *beta = trand(DT_FP32, (size_t)c, -1, 1);
    struct tensor *rm0 = trand(DT_FP32, (size_t)c, -1, 1), *rv0 = trand(DT_FP32, (size_t)c, 0.5f, 2);
    struct tensor *y[NBE], *mean[NBE], *rstd[NBE], *rm[NBE], *rv[NBE], *dx[NBE], *dg[NBE], *dbt[NBE];
    for (int i = 0; i < NBE; i++) {
        y[i] = tens(dt, nx);
        dx[i] = tens(dt, nx);
        mean[i] = tens(DT_FP32, (size_t)c);
        rstd[i] = tens(DT_FP32, (size_t)c);
        rm[i] = tcopy(rm0);
        rv[i] = tcopy(rv0);
        dg[i] = tens(DT_FP32, (size_t)c);
        dbt[i] = tens(DT_FP32, (size_t)c);
        a.training = true;
        bes[i]->batchnorm_forward(bes[i], &a, y[i], mean[i], rstd[i], rm[i], rv[i], x, gamma, beta);
        const struct tensor *mask = relu ? y[i] : NULL;
        bes[i]->batchnorm_backward(bes[i], &a, dx[i], dg[i], dbt[i], dy, x, mask, mean[i], rstd[i], gamma, 0.0f);
        bes[i]->batchnorm_backward(bes[i], &a, NULL, dg[i], dbt[i], y[i], x, mask, mean[i], rstd[i], gamma, 1.0f);
        cr_assert_eq(bes[i]->status(bes[i], NULL), AMP_OK);
    }
    for (int i = 1; i < NBE; i++) {
        assert_same_bytes(y[0], y[i], what, thread_counts[i]);
        assert_same_bytes(mean[0], mean[i], what, thread_counts[i]);
        assert_same_bytes(rstd[0], rstd[i], what, thread_counts[i]);
        assert_same_bytes(rm[0], rm[i], what, thread_counts[i]);
        assert_same_bytes(rv[0], rv[i], what, thread_counts[i]);
        assert_same_bytes(dx[0], dx[i], what, thread_counts[i]);
        assert_same_bytes(dg[0], dg[i], what, thread_counts[i]);
        assert_same_bytes(dbt[0], dbt[i], what, thread_counts[i]);
    }
    for (int i = 0; i < NBE; i++) { /* eval: the running statistics */
        a.training = false;
        bes[i]->batchnorm_forward(bes[i], &a, y[i], mean[i], rstd[i], rm[i], rv[i], x, gamma, beta);
        bes[i]->batchnorm_backward(bes[i], &a, dx[i], NULL, NULL, dy, x, relu ? y[i] : NULL, mean[i], rstd[i], gamma,
                                   0.0f);
    }
    for (int i = 1; i < NBE; i++) {
        assert_same_bytes(y[0], y[i], what, thread_counts[i]);
        assert_same_bytes(dx[0], dx[i], what, thread_counts[i]);
    }
    free_all();
}

Test(ops, batchnorm_bit_identical_for_any_thread_count)
{
    seed(1606);
    const enum dtype dts[] = {DT_FP32, DT_FP16, DT_BF16};
    for (int d = 0; d < 3; d++) {
        for (int relu = 0; relu < 2; relu++) {
            check_batchnorm(8, 24, 196, true, dts[d], relu);  /* 11 channels a chunk: 3 chunks, the last ragged */
            check_batchnorm(128, 5, 300, true, dts[d], relu); /* a channel over EW_CHUNK: one a chunk */
            check_batchnorm(2, 3, 16, false, dts[d], relu);
        }
    }
}

static void check_bias_grad(int64_t m, int64_t n, bool big, enum dtype dt)
{
    char what[64];
    snprintf(what, sizeof what, "bias_grad %s m %lld n %lld", dtype_name(dt), (long long)m, (long long)n);
    assert_chunks(big, m * n, T_EW_CHUNK, (n + 255) / 256, what);
    struct tensor *dy = trand(dt, (size_t)(m * n), -1, 1), *db0 = trand(DT_FP32, (size_t)n, -1, 1), *db[NBE];
    for (int i = 0; i < NBE; i++) {
        db[i] = tcopy(db0);
        bes[i]->bias_grad(bes[i], db[i], dy, m, n, 1.0f); /* accumulated into */
        cr_assert_eq(bes[i]->status(bes[i], NULL), AMP_OK);
    }
    for (int i = 1; i < NBE; i++)
        assert_same_bytes(db[0], db[i], what, thread_counts[i]);
    for (int i = 0; i < NBE; i++)
        bes[i]->bias_grad(bes[i], db[i], dy, m, n, 0.0f);
    for (int i = 1; i < NBE; i++)
        assert_same_bytes(db[0], db[i], what, thread_counts[i]);
    free_all();
}

Test(ops, bias_grad_bit_identical_for_any_thread_count)
{
    seed(1607);
    const enum dtype dts[] = {DT_FP32, DT_BF16, DT_FP16};
    for (int d = 0; d < 3; d++) {
        check_bias_grad(300, 700, true, dts[d]); /* 3 column chunks, the last ragged */
        check_bias_grad(5000, 600, true, dts[d]);
        check_bias_grad(10, 50, false, dts[d]);
    }
}

/* ---- ampTrain end to end ------------------------------------------------------------------------------- */

static const char *const modes[] = {"fp32", "fp16-dynamic", "bf16", "fp8"};
static const char *const run_threads[] = {"1", "2", "3", "7"};

/* `config extra` for `steps` steps at run.threads 1, 2, 3 and 7 in one precision mode: identical logs and
 * checkpoint tensors. */
/* Model `name` of tests/thread_models.txt (scripts/check/tsan.sh runs the same lines) trained in `mode` at 1, 2, 3 and
 * 7 threads: every checkpoint tensor and scale_log.csv the same bits. */
static void check_model(const char *name, const char *mode)
{
    char args[1024] = "", line[1024];
    int steps = 0;
    FILE *f = fopen(AMP_SOURCE_DIR "/tests/thread_models.txt", "r");
    cr_assert_not_null(f, "cannot read tests/thread_models.txt");
    while (!steps && fgets(line, sizeof line, f)) {
        char nm[16];
        int n = 0, off = 0;
        if (line[0] != '#' && sscanf(line, "%15s %d %n", nm, &n, &off) == 2 && off > 0 && strcmp(nm, name) == 0) {
            snprintf(args, sizeof args, "%.*s", (int)strcspn(line + off, "\n"), line + off);
            steps = n;
        }
    }
    fclose(f);
    cr_assert_gt(steps, 0, "tests/thread_models.txt has no line for '%s'", name);
    make_scratch();
    for (int i = 0; i < 4; i++) {
        /* fp8: every product in fp8, however small */
        const char *all = strcmp(mode, "fp8") == 0 ? "'precision.fp8.min_size=[0,0]'" : "";
        struct result r = amp("run %s precision.mode=%s %s run.steps=%d run.threads=%s run.out_dir=%s/t%s", args, mode,
                              all, steps, run_threads[i], scratch, run_threads[i]);
        cr_assert_eq(r.code, 0, "%s %s threads %s:\n%s", name, mode, run_threads[i], r.out);
    }
    for (int i = 1; i < 4; i++) {
        char a[512], b[512];
        snprintf(a, sizeof a, "%s/t1/ckpt-%d.h5", scratch, steps);
        snprintf(b, sizeof b, "%s/t%s/ckpt-%d.h5", scratch, run_threads[i], steps);
        int n = assert_same_tensors(a, b);
        cr_assert_geq(n, 4, "%s: only %d tensors compared", name, n);
        snprintf(a, sizeof a, "%s/t1/scale_log.csv", scratch);
        snprintf(b, sizeof b, "%s/t%s/scale_log.csv", scratch, run_threads[i]);
        assert_same_logs(a, b);
    }
    remove_scratch();
}

Test(threads, fashion_mlp_fp32, .timeout = 300) { check_model("mlp", modes[0]); }
Test(threads, fashion_mlp_fp16_dynamic, .timeout = 300) { check_model("mlp", modes[1]); }
Test(threads, fashion_mlp_bf16, .timeout = 300) { check_model("mlp", modes[2]); }
Test(threads, fashion_mlp_fp8, .timeout = 300) { check_model("mlp", modes[3]); }
Test(threads, fashion_cnn_fp32, .timeout = 300) { check_model("cnn", modes[0]); }
Test(threads, fashion_cnn_fp16_dynamic, .timeout = 300) { check_model("cnn", modes[1]); }
Test(threads, fashion_cnn_bf16, .timeout = 300) { check_model("cnn", modes[2]); }
Test(threads, fashion_cnn_fp8, .timeout = 300) { check_model("cnn", modes[3]); }
Test(threads, text_gpt_fp32, .timeout = 300) { check_model("gpt", modes[0]); }
Test(threads, text_gpt_fp16_dynamic, .timeout = 300) { check_model("gpt", modes[1]); }
Test(threads, text_gpt_bf16, .timeout = 300) { check_model("gpt", modes[2]); }
Test(threads, text_gpt_fp8, .timeout = 300) { check_model("gpt", modes[3]); }

/* Batchnorm with its ReLU fused (the default) and kept apart (a run that measures numerics: run.numerics_every)
 * give the same checkpoint tensors and the same scale_log.csv, grad_zero_frac included (the fused relu's gradient
 * is masked in place and counted on the sampled steps, every second one): fp16-dynamic and bf16. fashion_cnn's
 * relu after fc1 runs inside it too, and masks its own gradient (a dropout follows it, not a linear layer). */
/* `config` with `args` for `steps` steps, fused (the default) and apart (run.numerics_every turns fusing off): at
 * least `tensors` checkpoint tensors and scale_log.csv the same. */
static void check_fused_vs_apart(const char *config, const char *args, int steps, int tensors)
{
    make_scratch();
    struct result r = amp("run %s %s run.steps=%d run.out_dir=%s/fused", config, args, steps, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp("run %s %s run.steps=%d run.numerics_every=1000 run.out_dir=%s/apart", config, args, steps, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char a[512], b[512];
    snprintf(a, sizeof a, "%s/fused/ckpt-%d.h5", scratch, steps);
    snprintf(b, sizeof b, "%s/apart/ckpt-%d.h5", scratch, steps);
    cr_assert_geq(assert_same_tensors(a, b), tensors);
    snprintf(a, sizeof a, "%s/fused/scale_log.csv", scratch);
    snprintf(b, sizeof b, "%s/apart/scale_log.csv", scratch);
    assert_same_logs(a, b);
    remove_scratch();
}

Test(threads, batchnorm_relu_fusion_moves_no_logged_value, .timeout = 300)
{
    const char *fused_modes[] = {"fp16-dynamic", "bf16"};
    for (int i = 0; i < 2; i++) {
        char args[512];
        snprintf(args, sizeof args, "run.device=cpu run.log_every=2 data.batch_size=32 model.layers.0.out=8 "
                 "model.layers.4.out=8 model.layers.9.out=32 precision.mode=%s", fused_modes[i]);
        check_fused_vs_apart("configs/fashion_cnn.yaml", args, 3, 4);
    }
}

/* fashion_mlp's relus run inside the linear layers before them (GEMM_EPI_RELU) and their gradients' masks inside
 * the linear layers after them (GEMM_EPI_RELU_MASK): fused (the default) and apart (run.numerics_every turns
 * fusing off) give the same checkpoint tensors and the same scale_log.csv, grad_zero_frac included (on the steps
 * that count zeros, every second one here, the product gives its dx unmasked and the relu masks it). fp32 and
 * bf16 on 2 threads, fp16 with a dynamic scale and overflows on 1. (fashion_cnn's relu before a dropout, masked by
 * itself, is in the batchnorm test above.) */
Test(threads, linear_relu_fusion_moves_no_logged_value, .timeout = 300)
{
    const char *modes3[] = {"fp32", "bf16", "fp16-dynamic"};
    for (int i = 0; i < 3; i++) {
        char args[512];
        snprintf(args, sizeof args, "run.device=cpu run.log_every=2 data.batch_size=64 precision.mode=%s %s", modes3[i],
                 i == 2 ? "run.threads=1 precision.loss_scale.init=16777216" : "run.threads=2");
        check_fused_vs_apart("configs/fashion_mlp.yaml", args, 6, 6);
    }
}

/* No thread count is baked into a checkpoint: 3 steps on 3 threads, then resume on 2 threads to 6, equals 6
 * steps straight on 1 thread. */
Test(threads, resume_on_another_thread_count_is_bit_exact, .timeout = 300)
{
    make_scratch();
    const char *extra = "run.device=cpu run.log_every=1000 precision.mode=fp16-dynamic "
                        "precision.loss_scale.growth_interval=2";
    struct result r = amp("run configs/fashion_mlp.yaml %s run.steps=6 run.threads=1 run.out_dir=%s/a", extra, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp("run configs/fashion_mlp.yaml %s run.steps=3 run.threads=3 run.out_dir=%s/b", extra, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp("resume %s/b/ckpt-3.h5 run.steps=6 run.threads=2", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char a[512], b[512];
    snprintf(a, sizeof a, "%s/a/ckpt-6.h5", scratch);
    snprintf(b, sizeof b, "%s/b/ckpt-6.h5", scratch);
    assert_same_tensors(a, b);
    snprintf(a, sizeof a, "%s/a/scale_log.csv", scratch);
    snprintf(b, sizeof b, "%s/b/scale_log.csv", scratch);
    assert_same_logs(a, b);
    remove_scratch();
}

/* ---- the key ------------------------------------------------------------------------------------------ */

Test(threads, bad_counts_are_refused_naming_the_key)
{
    const char *bad[] = {"0", "-1", "1025", "2x", "auto2", "01", "1.5", "99999"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        struct result r = amp("check configs/fashion_mlp.yaml run.threads=%s", bad[i]);
        cr_assert_eq(r.code, 2, "run.threads=%s: exit %d\n%s", bad[i], r.code, r.out);
        cr_assert(strstr(r.out, "run.threads"), "run.threads=%s:\n%s", bad[i], r.out);
        cr_assert(strstr(r.out, "1 to 1024"), "run.threads=%s:\n%s", bad[i], r.out);
    }
    const char *good[] = {"auto", "1", "7", "1024"};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        struct result r = amp("check configs/fashion_mlp.yaml run.threads=%s", good[i]);
        cr_assert_eq(r.code, 0, "run.threads=%s:\n%s", good[i], r.out);
    }
    /* more than the CPUs this process may run on: allowed, with a warning naming the key */
    struct result r = amp("check configs/fashion_mlp.yaml run.threads=1024");
    if (threadpool_available_cpus() < 1024)
        cr_assert(strstr(r.out, "warning") && strstr(r.out, "run.threads is 1024"), "%s", r.out);
}

/* ---- AMPTRAIN_POOL_SPIN_US ---------------------------------------------------------------------------- */

/* CPU seconds used so far by this process's threads other than the calling one (a pool's workers). */
static double other_threads_cpu_s(void)
{
    struct timespec p, t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &p);
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)(p.tv_sec - t.tv_sec) + 1e-9 * (double)(p.tv_nsec - t.tv_nsec);
}

/* A 2-thread CPU backend made under AMPTRAIN_POOL_SPIN_US=`us` runs one job of several chunks, then has nothing
 * to do: the CPU seconds its worker uses while the caller waits up to `idle_s` (it stops waiting at 20 ms). */
static double idle_worker_cpu_s(const char *us, double idle_s)
{
    cr_assert_eq(setenv("AMPTRAIN_POOL_SPIN_US", us, 1), 0);
    struct backend *be = backend_cpu_create();
    cr_assert_not_null(be);
    struct amp_error err;
    cr_assert_eq(be->set_threads(be, 2, &err), AMP_OK, "%s", err.msg);
    struct tensor x, y;
    const int64_t n = (int64_t)EW_N;
    cr_assert_eq(tensor_alloc(&x, be, DT_FP32, 1, &n, "x", &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(tensor_alloc(&y, be, DT_FP32, 1, &n, "y", &err), AMP_OK, "%s", err.msg);
    memset(x.data, 0, tensor_bytes(&x));
    be->act_forward(be, ACT_RELU, &y, &x);
    const double start = other_threads_cpu_s();
    double used = 0;
    for (int i = 0; i < (int)(idle_s * 100) && used < 0.02; i++) {
        nanosleep(&(struct timespec){.tv_nsec = 10 * 1000 * 1000}, NULL);
        used = other_threads_cpu_s() - start;
    }
    tensor_free(&x);
    tensor_free(&y);
    backend_close(be);
    cr_assert_eq(unsetenv("AMPTRAIN_POOL_SPIN_US"), 0);
    return used;
}

/* The pool's idle threads spin as long as AMPTRAIN_POOL_SPIN_US says (the default, 2 ms, would use at most
 * that): at 1 s the idle worker burns 20 ms of CPU within a second, even on a machine busy with other work (a
 * sixth of a CPU would do); at 0 it sleeps at once. */
Test(threads, pool_threads_spin_as_long_as_amptrain_pool_spin_us_says)
{
    double spun = idle_worker_cpu_s("1000000", 2.0);
    cr_assert_geq(spun, 0.02, "spinning 1 s, the idle worker used only %.4f CPU-s", spun);
    double slept = idle_worker_cpu_s("0", 0.2);
    cr_assert_lt(slept, 0.02, "not spinning, the idle worker used %.4f CPU-s in 0.2 s", slept);
}

/* A value that is not a whole number of microseconds from 0 to 10^6 is refused naming the variable (exit 2),
 * at one thread too; an empty one is the default. */
Test(threads, a_bad_amptrain_pool_spin_us_is_refused_naming_it)
{
    make_scratch();
    const char *bad[] = {"-1", "2.5", "20us", "1000001", "99999999999999999999"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char cmd[2048];
        snprintf(cmd, sizeof cmd, "cd %s && AMPTRAIN_POOL_SPIN_US=%s %s run configs/fashion_mlp.yaml " SMALL
                 " run.steps=1 run.threads=%d run.out_dir=%s/bad%zu 2>&1", AMP_SOURCE_DIR, bad[i], amp_binary(),
                 i % 2 ? 1 : 2, scratch, i);
        struct result r = shell(cmd);
        cr_assert_eq(r.code, 2, "AMPTRAIN_POOL_SPIN_US=%s: exit %d\n%s", bad[i], r.code, r.out);
        cr_assert(strstr(r.out, "AMPTRAIN_POOL_SPIN_US is '") && strstr(r.out, bad[i]) &&
                      strstr(r.out, "0 to 1000000") && strstr(r.out, "hint: "), "%s", r.out);
    }
    const char *good[] = {"", "0"};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        char cmd[2048];
        snprintf(cmd, sizeof cmd, "cd %s && AMPTRAIN_POOL_SPIN_US=%s %s run configs/fashion_mlp.yaml " SMALL
                 " run.steps=1 run.threads=2 run.out_dir=%s/good%zu 2>&1", AMP_SOURCE_DIR, good[i], amp_binary(),
                 scratch, i);
        struct result r = shell(cmd);
        cr_assert_eq(r.code, 0, "AMPTRAIN_POOL_SPIN_US='%s':\n%s", good[i], r.out);
    }
    remove_scratch();
}

/* ---- attention, layernorm, embedding, losses, grad_stats, fp8 ---- */

/* Each op on shapes of several chunks (and one of a single chunk, which runs inline) in fp32 and the 16-bit
 * dtypes, at 2, 3 and 7 threads against 1: every output byte-identical. The chunk counts in the comments
 * are the backend's (kernels/cpu/): rows_per_chunk(cols) = 16384 / cols rows, LN_COLS = 32 columns,
 * EMB_TABLE_ELEMS = 4096 table elements, ATT_PAR_MACS = 2^20. loss_sum stays on the calling thread (its one
 * ordered double sum of a few values a sample), so it has nothing here. */

static const enum dtype dts3[3] = {DT_FP32, DT_FP16, DT_BF16};

static void same_for_all(struct tensor *const *t, const char *what)
{
    for (int i = 1; i < NBE; i++)
        assert_same_bytes(t[0], t[i], what, thread_counts[i]);
}

/* rows x cols: (700, 200) is 9 row chunks and 7 column chunks; (10, 40) one chunk of each */
static void check_layernorm(enum dtype dt, int64_t rows, int64_t cols, bool affine, float beta_acc)
{
    size_t n = (size_t)(rows * cols);
    struct tensor *x = trand(dt, n, -3, 5), *dy = trand(dt, n, -2, 2);
    struct tensor *gamma = affine ? trand(DT_FP32, (size_t)cols, 0.5f, 1.5f) : NULL;
    struct tensor *beta = affine ? trand(DT_FP32, (size_t)cols, -1, 1) : NULL;
    struct tensor *dg0 = trand(DT_FP32, (size_t)cols, -1, 1), *db0 = trand(DT_FP32, (size_t)cols, -1, 1);
    struct tensor *y[NBE], *mean[NBE], *rstd[NBE], *dx[NBE], *dg[NBE], *db[NBE];
    struct norm_args a = { .rows = rows, .cols = cols, .eps = 1e-5f };
    for (int i = 0; i < NBE; i++) {
        y[i] = tens(dt, n);
        mean[i] = tens(DT_FP32, (size_t)rows);
        rstd[i] = tens(DT_FP32, (size_t)rows);
        dx[i] = tens(dt, n);
        dg[i] = tcopy(dg0); /* beta_acc 1 adds into them */
        db[i] = tcopy(db0);
        bes[i]->layernorm_forward(bes[i], &a, y[i], mean[i], rstd[i], x, gamma, beta);
        bes[i]->layernorm_backward(bes[i], &a, dx[i], dg[i], db[i], dy, x, mean[i], rstd[i], gamma, beta_acc);
        cr_assert_eq(bes[i]->status(bes[i], NULL), AMP_OK);
    }
    same_for_all(y, "layernorm y");
    same_for_all(mean, "layernorm mean");
    same_for_all(rstd, "layernorm rstd");
    same_for_all(dx, "layernorm dx");
    same_for_all(dg, "layernorm dgamma");
    same_for_all(db, "layernorm dbeta");
    /* the parameter gradients alone (dx NULL) are the same sums */
    struct tensor *dg_only[NBE];
    for (int i = 0; i < NBE; i++) {
        dg_only[i] = tcopy(dg0);
        bes[i]->layernorm_backward(bes[i], &a, NULL, dg_only[i], NULL, dy, x, mean[i], rstd[i], gamma, beta_acc);
    }
    same_for_all(dg_only, "layernorm dgamma without dx");
    assert_same_bytes(dg[0], dg_only[0], "layernorm dgamma with and without dx", 1);
    free_all();
}

Test(ops, layernorm_bit_identical_for_any_thread_count)
{
    seed(1604);
    for (int d = 0; d < 3; d++) {
        check_layernorm(dts3[d], 700, 200, true, 0.0f);
        check_layernorm(dts3[d], 700, 200, true, 1.0f);
        check_layernorm(dts3[d], 517, 96, false, 0.0f); /* 4 row chunks of 170, 3 column chunks */
        check_layernorm(dts3[d], 10, 40, true, 1.0f);
    }
}

/* tokens (B*T) drawn from [0, vocab), so rows repeat */
static int32_t *rand_tokens(int64_t n, int64_t vocab)
{
    int32_t *t = malloc((size_t)n * sizeof *t);
    cr_assert_not_null(t);
    for (int64_t i = 0; i < n; i++)
        t[i] = (int32_t)(urand() * (double)vocab) % (int32_t)vocab;
    return t;
}

/* B=8, T=100, C=64: forward 4 row chunks of 256; backward vocab 300 in 5 wte chunks of 64 rows, max_len 128 in 2 */
static void check_embedding(enum dtype dt, int64_t B, int64_t T, int64_t C, int64_t vocab, int64_t max_len,
                            float beta)
{
    int32_t *tok = rand_tokens(B * T, vocab);
    size_t n = (size_t)(B * T * C);
    struct tensor *wte = trand(dt, (size_t)(vocab * C), -1, 1), *wpe = trand(dt, (size_t)(max_len * C), -1, 1);
    struct tensor *dy = trand(dt, n, -1, 1), *dte0 = trand(DT_FP32, (size_t)(vocab * C), -1, 1);
    struct tensor *dpe0 = trand(DT_FP32, (size_t)(max_len * C), -1, 1), *y[NBE], *dte[NBE], *dpe[NBE];
    for (int i = 0; i < NBE; i++) {
        y[i] = tens(dt, n);
        dte[i] = tcopy(dte0);
        dpe[i] = tcopy(dpe0);
        bes[i]->embedding_forward(bes[i], y[i], tok, wte, wpe, B, T, C);
        bes[i]->embedding_backward(bes[i], dte[i], dpe[i], dy, tok, B, T, C, beta);
        cr_assert_eq(bes[i]->status(bes[i], NULL), AMP_OK);
    }
    same_for_all(y, "embedding y");
    same_for_all(dte, "embedding dwte");
    same_for_all(dpe, "embedding dwpe");
    free(tok);
    free_all();
}

Test(ops, embedding_bit_identical_for_any_thread_count)
{
    seed(1605);
    for (int d = 0; d < 3; d++) {
        check_embedding(dts3[d], 8, 100, 64, 300, 128, 0.0f);
        check_embedding(dts3[d], 8, 100, 64, 300, 128, 1.0f);
        check_embedding(dts3[d], 3, 70, 100, 257, 70, 0.5f); /* forward 2 chunks of 163; backward 7 + 2 */
        check_embedding(dts3[d], 2, 5, 8, 20, 5, 1.0f);
    }
}

/* (B, H, T, C): 3*4 pairs of T 64, D 32 is 1.6M multiply-adds, on the pool; 5*4 of T 50, D 24 too (1.2M);
 * (1, 2, 8, 16) runs inline */
static void check_attention(enum dtype dt, int64_t B, int64_t H, int64_t T, int64_t C)
{
    size_t nqkv = (size_t)(B * T * 3 * C), nout = (size_t)(B * T * C), np = (size_t)(B * H * T * T);
    struct tensor *qkv = trand(dt, nqkv, -2, 2), *dout = trand(dt, nout, -1, 1);
    struct tensor *out[NBE], *probs[NBE], *dqkv[NBE];
    for (int i = 0; i < NBE; i++) {
        out[i] = tens(dt, nout);
        probs[i] = tens(dt, np);
        dqkv[i] = tens(dt, nqkv);
        bes[i]->attention_forward(bes[i], out[i], probs[i], qkv, B, T, C, H);
        bes[i]->attention_backward(bes[i], dqkv[i], dout, qkv, probs[i], B, T, C, H);
        cr_assert_eq(bes[i]->status(bes[i], NULL), AMP_OK);
    }
    same_for_all(out, "attention out");
    same_for_all(probs, "attention probs");
    same_for_all(dqkv, "attention dqkv");
    free_all();
}

Test(ops, attention_bit_identical_for_any_thread_count)
{
    seed(1606);
    for (int d = 0; d < 3; d++) {
        check_attention(dts3[d], 3, 4, 64, 128);
        check_attention(dts3[d], 5, 4, 50, 96);
        check_attention(dts3[d], 1, 2, 8, 16);
    }
}

/* xent: N 1000 of K 100 is 7 chunks of 163 rows; mse: N 700 of K 90 is 4 of 182; N 20 one */
static void check_losses(enum dtype dt, int64_t N, int64_t K)
{
    size_t n = (size_t)(N * K);
    struct tensor *x = trand(dt, n, -8, 8), *target = trand(DT_FP32, n, -1, 1);
    int32_t *labels = rand_tokens(N, K), *correct[NBE];
    struct tensor *loss[NBE], *grad[NBE], *eval_loss[NBE];
    float seed_val = 1024.0f;
    for (int i = 0; i < NBE; i++) {
        loss[i] = tens(DT_FP32, (size_t)N);
        eval_loss[i] = tens(DT_FP32, (size_t)N);
        grad[i] = tens(dt, n);
        correct[i] = calloc((size_t)N, sizeof(int32_t));
        bes[i]->xent_forward_backward(bes[i], loss[i], correct[i], grad[i], x, labels, N, K, &seed_val);
        bes[i]->xent_forward_backward(bes[i], eval_loss[i], NULL, NULL, x, labels, N, K, NULL);
        cr_assert_eq(bes[i]->status(bes[i], NULL), AMP_OK);
    }
    same_for_all(loss, "xent losses");
    same_for_all(eval_loss, "xent losses without gradient");
    same_for_all(grad, "xent dlogits");
    for (int i = 1; i < NBE; i++)
        cr_assert_eq(memcmp(correct[0], correct[i], (size_t)N * sizeof(int32_t)), 0, "xent correct: %d threads",
                     thread_counts[i]);
    assert_same_bytes(loss[0], eval_loss[0], "xent losses with and without gradient", 1);
    for (int i = 0; i < NBE; i++) {
        bes[i]->mse_forward_backward(bes[i], loss[i], grad[i], x, target, N, K, &seed_val);
        cr_assert_eq(bes[i]->status(bes[i], NULL), AMP_OK);
        free(correct[i]);
    }
    same_for_all(loss, "mse losses");
    same_for_all(grad, "mse dy");
    free(labels);
    free_all();
}

Test(ops, losses_bit_identical_for_any_thread_count)
{
    seed(1607);
    for (int d = 0; d < 3; d++) {
        check_losses(dts3[d], 1000, 100);
        check_losses(dts3[d], 700, 90);
        check_losses(dts3[d], 20, 10);
    }
}

/* upload_rows (a batch's samples): each index's row of the table lands at its place in dst, with rows of 12 bytes
 * (5,461 a chunk: 20,000 rows are 4 chunks), of fashion_mlp's 3,136 (20 a chunk: 128 rows are 7) and of 70,000
 * (one a chunk); the indices repeat and skip rows, and the CPU leaves the staging memory alone. */
Test(ops, upload_rows_puts_every_row_in_its_place_for_any_thread_count)
{
    seed(1610);
    const size_t row_bytes[3] = {12, 3136, 70000};
    const int64_t table_rows[3] = {30000, 1000, 9}, ns[3] = {20000, 128, 5};
    for (int c = 0; c < 3; c++) {
        size_t rb = row_bytes[c];
        int64_t n = ns[c];
        unsigned char *table = malloc((size_t)table_rows[c] * rb), *staged = malloc((size_t)n * rb);
        int64_t *idx = malloc((size_t)n * sizeof *idx);
        cr_assert(table && staged && idx);
        for (size_t i = 0; i < (size_t)table_rows[c] * rb; i++)
            table[i] = (unsigned char)(urand() * 256);
        for (int64_t i = 0; i < n; i++)
            idx[i] = i % 7 == 3 ? idx[i / 2] : (int64_t)(urand() * (double)table_rows[c]);
        memset(staged, 0x5A, (size_t)n * rb);
        for (int t = 0; t < NBE; t++) {
            unsigned char *dst = bes[t]->alloc(bes[t], (size_t)n * rb);
            cr_assert_not_null(dst);
            memset(dst, 0xA5, (size_t)n * rb);
            bes[t]->upload_rows(bes[t], dst, table, rb, idx, n, staged, t % BACKEND_STAGING_SLOTS);
            for (int64_t i = 0; i < n; i++)
                cr_assert(memcmp(dst + (size_t)i * rb, table + (size_t)idx[i] * rb, rb) == 0,
                          "rows of %zu bytes at %d threads: row %lld is not table row %lld", rb, thread_counts[t],
                          (long long)i, (long long)idx[i]);
            bes[t]->free(bes[t], dst);
        }
        for (size_t i = 0; i < (size_t)n * rb; i++)
            cr_assert_eq(staged[i], 0x5A, "rows of %zu bytes: the CPU wrote the staging memory at byte %zu", rb, i);
        free(table);
        free(staged);
        free(idx);
    }
}

/* EW_N elements: 8 chunks of 16 Ki, the last ragged; 1000 elements one chunk */
Test(ops, count_zeros_bit_identical_for_any_thread_count)
{
    seed(1608);
    const size_t sizes[2] = {EW_N, 1000};
    for (int d = 0; d < 3; d++)
        for (int s = 0; s < 2; s++) {
            struct tensor *t = trand(dts3[d], sizes[s], -1, 1);
            size_t esz = dtype_size(dts3[d]);
            int64_t expect = 0;
            for (size_t i = 0; i < sizes[s]; i++)
                if (i % 3 == 0 || i % 1000 == 7) { /* +0 or -0 */
                    memset((char *)t->data + i * esz, 0, esz);
                    if (i % 2)
                        ((unsigned char *)t->data)[i * esz + esz - 1] = 0x80;
                    expect++;
                }
            for (int i = 0; i < NBE; i++) {
                int64_t acc = 5;
                bes[i]->count_zeros(bes[i], t, &acc);
                cr_assert_eq(acc, 5 + expect, "count_zeros %s %zu at %d threads: %lld, want %lld", dtype_name(dts3[d]),
                             sizes[s], thread_counts[i], (long long)acc, (long long)(5 + expect));
            }
            free_all();
        }
}

/* fp8 casts of EW_N elements (8 chunks) and 1000 (one): current scaling with amax and counts, and a delayed
 * scale large enough that some elements saturate. */
static void check_fp8_cast(enum dtype src_dt, enum dtype dst_dt, size_t n, bool current)
{
    struct tensor *src = trand(src_dt, n, -300, 300), *dst[NBE];
    if (n > 100) { /* a few small values that flush and an Inf that saturates */
        for (size_t i = 0; i < n; i += 997) {
            float v = i % 2 ? 1e-9f : INFINITY;
            dtype_convert((char *)src->data + i * dtype_size(src_dt), src_dt, &v, DT_FP32, 1);
        }
    }
    float scale[NBE], scale_inv[NBE], amax[NBE];
    int64_t counts[NBE][4];
    for (int i = 0; i < NBE; i++) {
        dst[i] = tens(dst_dt, n);
        scale[i] = current ? 1.0f : 64.0f;
        scale_inv[i] = 0.0f;
        amax[i] = 0.5f;
        memset(counts[i], 0, sizeof counts[i]);
        struct fp8_cast_args a = { .dst = dst[i], .src = src, .scale = &scale[i], .scale_inv = &scale_inv[i],
                                   .amax = &amax[i], .current = current, .counts = counts[i] };
        bes[i]->fp8_cast(bes[i], &a);
        cr_assert_eq(bes[i]->status(bes[i], NULL), AMP_OK);
    }
    same_for_all(dst, "fp8_cast");
    for (int i = 1; i < NBE; i++) {
        cr_assert_eq(memcmp(&scale[0], &scale[i], sizeof(float)), 0, "fp8 scale at %d threads", thread_counts[i]);
        cr_assert_eq(memcmp(&scale_inv[0], &scale_inv[i], sizeof(float)), 0, "fp8 scale_inv at %d threads",
                     thread_counts[i]);
        cr_assert_eq(memcmp(&amax[0], &amax[i], sizeof(float)), 0, "fp8 amax at %d threads", thread_counts[i]);
        cr_assert_eq(memcmp(counts[0], counts[i], sizeof counts[0]), 0, "fp8 counts at %d threads",
                     thread_counts[i]);
    }
    cr_assert_eq(counts[0][3], (int64_t)n);
    if (n > 100)
        cr_assert_gt(counts[0][0], 0, "some elements saturate (the Inf at least)");
    free_all();
}

Test(ops, fp8_cast_bit_identical_for_any_thread_count)
{
    seed(1609);
    const enum dtype srcs[2] = {DT_FP32, DT_BF16}, dsts[2] = {DT_FP8_E4M3, DT_FP8_E5M2};
    for (int s = 0; s < 2; s++)
        for (int d = 0; d < 2; d++)
            for (int c = 0; c < 2; c++) {
                check_fp8_cast(srcs[s], dsts[d], EW_N, c == 1);
                check_fp8_cast(srcs[s], dsts[d], 1000, c == 1);
            }
}

/* grad_stats over tensors of several 16 Ki-element chunks, one of a single chunk and one of a few elements, an
 * Inf and NaNs in some chunks: every field and count byte-identical at 2, 3 and 7 threads, and the sum of
 * squares exactly the documented order (docs/backend.md): each chunk's element i into lane i % 8, the chunks'
 * lanes added lane by lane in chunk order across all tensors, then ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 +
 * l7)). Computed here in plain C from the same floats. */
static double gs_reference(const float *const *g, const size_t *n, int nt)
{
    double tot[8] = { 0 };
    for (int t = 0; t < nt; t++)
        for (size_t c0 = 0; c0 < n[t]; c0 += (size_t)T_EW_CHUNK) {
            double l[8] = { 0 };
            for (size_t i = c0; i < n[t] && i < c0 + (size_t)T_EW_CHUNK; i++) {
                double v = isfinite(g[t][i]) ? (double)g[t][i] : 0.0;
                l[(i - c0) % 8] += v * v;
            }
            for (int k = 0; k < 8; k++)
                tot[k] += l[k];
        }
    return ((tot[0] + tot[1]) + (tot[2] + tot[3])) + ((tot[4] + tot[5]) + (tot[6] + tot[7]));
}

Test(ops, grad_stats_bit_identical_for_any_thread_count)
{
    seed(2203);
    enum { NT = 5 };
    const size_t n[NT] = { (size_t)T_EW_CHUNK * 5 + 777, 3, (size_t)T_EW_CHUNK, (size_t)T_EW_CHUNK * 2 + 1, 100 };
    for (int bad = 0; bad < 2; bad++) {
        const struct tensor *g[NT];
        const float *h[NT];
        for (int t = 0; t < NT; t++) {
            struct tensor *x = trand(DT_FP32, n[t], -3, 3);
            float *f = x->data;
            for (size_t i = 0; i < n[t]; i++) /* magnitudes over 2^40, so an order change moves the bits */
                f[i] = ldexpf(f[i], (int)(i % 41));
            if (bad && t == 0) {
                f[(size_t)T_EW_CHUNK * 3 + 5] = INFINITY;
                f[10] = NAN;
            }
            if (bad && t == 3)
                f[n[t] - 1] = -NAN;
            g[t] = x;
            h[t] = f;
        }
        struct grad_check chk[NBE];
        int64_t counts[NBE][2 * NT];
        for (int i = 0; i < NBE; i++) {
            bes[i]->grad_stats(bes[i], g, NT, &chk[i], counts[i]);
            cr_assert_eq(bes[i]->status(bes[i], NULL), AMP_OK);
        }
        for (int i = 1; i < NBE; i++) {
            cr_assert_eq(memcmp(&chk[0], &chk[i], sizeof chk[0]), 0, "grad_stats at %d threads: sumsq %.17g vs %.17g",
                         thread_counts[i], chk[i].sumsq, chk[0].sumsq);
            cr_assert_eq(memcmp(counts[0], counts[i], sizeof counts[0]), 0, "grad_stats counts at %d threads",
                         thread_counts[i]);
        }
        double want = gs_reference(h, n, NT);
        cr_assert_eq(memcmp(&chk[0].sumsq, &want, sizeof want), 0, "sumsq %.17g, the documented order gives %.17g",
                     chk[0].sumsq, want);
        cr_assert_eq(chk[0].found_nonfinite, bad);
        cr_assert_eq(counts[0][0], bad, "tensor 0's Inf");
        cr_assert_eq(counts[0][NT + 0], bad, "tensor 0's NaN");
        cr_assert_eq(counts[0][NT + 3], bad, "tensor 3's NaN, in its last chunk");
        free_all();
    }
}
