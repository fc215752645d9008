/*
 * test_cuda_dist.c — data parallel on GPUs (docs/distributed.md, "GPUs: NCCL"): NCCL on one GPU (a
 * one-rank communicator: every step reduces through ncclAllReduce) and, where two GPUs exist, two ranks
 * with NCCL against one GPU with accum_steps 2. Skips without a GPU (the suite then reports Skipped).
 */
#define _POSIX_C_SOURCE 200809L
#include "disttest.h" /* amp, mpi, compare_runs, max_rel_diff */
#include "skip_main.h"

#include "backend.h" /* backend_cuda_device_count, backend_open, the op table */
#include "comm.h"    /* comm_single, comm_use_nccl: the one-rank NCCL communicator in process */

static int gpus(void)
{
#if defined(AMP_HAVE_CUDA) && defined(AMP_HAVE_NCCL)
    return backend_cuda_device_count();
#else
    return 0;
#endif
}

/* One rank on one GPU through a one-rank NCCL communicator: every step's reduce is a sum over one rank, so
 * the log and the checkpoint equal the run without it, whether the gradients go in buckets on the second stream
 * during backward (the default dist.bucket_mb, and 0.001: a bucket a layer) or once after it (0). */
Test(cuda_dist, nccl_one_rank_on_a_gpu_equals_no_nccl)
{
    if (gpus() < 1)
        cr_skip_test("no CUDA device, or built without CUDA and NCCL: the NCCL path was not run");
    make_scratch();
    const char *m = "configs/fashion_mlp.yaml run.steps=30 run.log_every=10 run.device=cuda precision.mode=bf16";
    struct result r = amp("run %s run.out_dir=%s/plain", m, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp("run %s dist.backend=nccl run.out_dir=%s/nccl", m, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    compare_runs("plain", "nccl", 30, 1000);
    r = amp("run %s dist.backend=nccl dist.bucket_mb=0.001 run.out_dir=%s/tiny", m, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    compare_runs("plain", "tiny", 30, 1000);
    r = amp("run %s dist.backend=nccl dist.bucket_mb=0 run.out_dir=%s/once", m, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    compare_runs("plain", "once", 30, 1000);
    remove_scratch();
}

/* The one-rank NCCL communicator's reduce-scatter (ncclReduceScatter, in place: this rank's block is the whole buffer),
 * all-reduce and all-gather (one grouped ncclBroadcast of bytes from rank 0, in place) in process: a sum over one rank
 * is the rank's values and a gather of one block is that block, bit for bit, and no NCCL or CUDA error is recorded.
 * The same for dist.zero 1's collectives on blocks (reduce_scatter_blocks, reduce_scatter_start on the second
 * stream, all_gather_blocks: grouped ncclReduce and ncclBroadcast). The only run of these until a machine has two
 * GPUs (their grouped branches for blocks of unequal size need two ranks). */
Test(cuda_dist, nccl_one_rank_reduce_scatter_all_reduce_and_all_gather_keep_the_values)
{
    if (gpus() < 1)
        cr_skip_test("no CUDA device, or built without CUDA and NCCL: the NCCL path was not run");
    struct backend *be = NULL;
    struct amp_error err;
    cr_assert_eq(backend_open(&be, "cuda:0", NULL, 0, &err), AMP_OK, "%s (hint: %s)", err.msg, err.hint);
    struct comm *c = comm_single();
    cr_assert_eq(comm_use_nccl(c, be, &err), AMP_OK, "%s (hint: %s)", err.msg, err.hint);
    cr_assert_str_eq(c->transport, "nccl");
    enum { N = 100003 };
    float *want = malloc(N * sizeof *want), *got = malloc(N * sizeof *got);
    cr_assert(want && got);
    for (int i = 0; i < N; i++)
        want[i] = ldexpf(1.0f + (float)(i % 977) / 977.0f, i % 41 - 20) * (i % 2 ? -1.0f : 1.0f);
    float *dev = be->alloc(be, N * sizeof *dev);
    cr_assert_not_null(dev);
    const char *ops[] = {"reduce_scatter", "reduce_sum", "all_gather"};
    for (int k = 0; k < 3; k++) {
        be->upload(be, dev, want, N * sizeof *dev);
        if (k == 0)
            c->reduce_scatter(c, dev, N, COMM_F32);
        else if (k == 1)
            c->reduce_sum(c, dev, N, COMM_F32);
        else
            c->all_gather(c, dev, N, sizeof *dev);
        be->download(be, got, dev, N * sizeof *dev);
        cr_assert_eq(be->status(be, &err), AMP_OK, "%s: %s", ops[k], err.msg);
        cr_assert_eq(memcmp(got, want, N * sizeof *got), 0, "%s changed the values of one rank", ops[k]);
    }
    /* dist.zero 1's collectives on the caller's blocks (one rank: one block, the whole buffer) */
    const size_t bounds[2] = {0, N};
    const char *block_ops[] = {"reduce_scatter_blocks", "reduce_scatter_start", "all_gather_blocks"};
    cr_assert(c->reduce_scatter_blocks && c->reduce_scatter_start && c->all_gather_blocks);
    for (int k = 0; k < 3; k++) {
        be->upload(be, dev, want, N * sizeof *dev);
        if (k == 0)
            c->reduce_scatter_blocks(c, dev, bounds, COMM_F32);
        else if (k == 1)
            c->reduce_wait(c, c->reduce_scatter_start(c, dev, bounds, COMM_F32));
        else
            c->all_gather_blocks(c, dev, bounds, sizeof *dev);
        be->download(be, got, dev, N * sizeof *dev);
        cr_assert_eq(be->status(be, &err), AMP_OK, "%s: %s", block_ops[k], err.msg);
        cr_assert_eq(memcmp(got, want, N * sizeof *got), 0, "%s changed the values of one rank", block_ops[k]);
    }
    be->free(be, dev);
    comm_release_nccl(c);
    cr_assert_str_eq(c->transport, "none");
    backend_close(be);
    free(want);
    free(got);
}

/* Two ranks on two GPUs reduce by NCCL (in the default buckets, on the second stream) and train as one GPU with
 * accum_steps 2, up to the order of the GPU's sums: within 1e-5 relative after 20 bf16 steps. */
Test(cuda_dist, nccl_two_ranks_on_two_gpus)
{
    NEED_MPI();
    if (gpus() < 2)
        cr_skip_test("fewer than two CUDA devices: two-rank NCCL was not run");
    make_scratch();
    const char *m = "configs/fashion_mlp.yaml run.steps=20 run.log_every=10 run.device=cuda precision.mode=bf16";
    struct result r = amp("run %s accum_steps=2 run.out_dir=%s/one", m, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = mpi(2, NULL, "run %s run.out_dir=%s/two", m, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "transport nccl"), "%s", r.out);
    char a[512], b[512], worst[256];
    snprintf(a, sizeof a, "%s/one/ckpt-20.h5", scratch);
    snprintf(b, sizeof b, "%s/two/ckpt-20.h5", scratch);
    double d = max_rel_diff(a, b, worst, sizeof worst);
    cr_assert(d >= 0 && d <= 1e-5, "%s differs by %.3e relative", worst, d);
    remove_scratch();
}

/* dist.zero 1 on two GPUs, with NCCL and with MPI through the host: the gradients are only reduce-scattered and the
 * statistics' parts gathered (rank 0 says so), and the run trains as dist.zero 0 does: with MPI bit for bit (a sum
 * over two ranks is one addition whichever collective makes it, and the CUDA backend's statistics from its parts are
 * grad_stats' own); with
 * NCCL within 1e-5 relative after 20 bf16 steps (grouped ncclReduce and ncclAllReduce need not associate alike). */
Test(cuda_dist, zero1_two_ranks_on_two_gpus_reduce_scatter_only)
{
    NEED_MPI();
    if (gpus() < 2)
        cr_skip_test("fewer than two CUDA devices: dist.zero 1 on GPUs was not run");
    make_scratch();
    const char *m = "configs/fashion_mlp.yaml run.steps=20 run.log_every=10 run.device=cuda precision.mode=bf16 "
                    "clip.max_norm=0.5";
    const char *backends[] = {"nccl", "mpi"};
    for (int k = 0; k < 2; k++) {
        const char *b = backends[k];
        struct result r = mpi(2, NULL, "run %s dist.backend=%s dist.zero=0 run.out_dir=%s/%s0", m, b, scratch, b);
        cr_assert_eq(r.code, 0, "%s", r.out);
        r = mpi(2, NULL, "run %s dist.backend=%s dist.zero=1 run.out_dir=%s/%s1", m, b, scratch, b);
        cr_assert_eq(r.code, 0, "%s", r.out);
        cr_assert(strstr(r.out, "reduce-scattered only"), "%s: %s", b, r.out);
        char n0[16], n1[16];
        snprintf(n0, sizeof n0, "%s0", b);
        snprintf(n1, sizeof n1, "%s1", b);
        if (k == 1) {
            compare_runs(n0, n1, 20, 1000);
            continue;
        }
        char a[512], c[512], worst[256];
        snprintf(a, sizeof a, "%s/%s/ckpt-20.h5", scratch, n0);
        snprintf(c, sizeof c, "%s/%s/ckpt-20.h5", scratch, n1);
        double d = max_rel_diff(a, c, worst, sizeof worst);
        cr_assert(d >= 0 && d <= 1e-5, "%s differs by %.3e relative", worst, d);
    }
    remove_scratch();
}
