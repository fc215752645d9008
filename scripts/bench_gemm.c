/*
 * bench_gemm.c — the CPU backend's matrix products at several thread counts, on the shapes a reference model's
 * step runs (its linear layers' forward, input-gradient and weight-gradient products), each timed alone: the best
 * of 5 rounds of REPS calls after 50 warm-up calls. Built and run by scripts/bench_gemm.sh against
 * BUILD_DIR/libamp.a.
 *
 *   bench_gemm MODEL DTYPE [THREADS...]     MODEL: mlp (fashion_mlp, batch 128) or gpt (text_gpt, 32 x 64 rows)
 *
 * A shape's time at 1 thread against its time at 2 says how that product scales on this machine; the inputs
 * are zeros (a product's time does not depend on its values).
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"

#define REPS 100

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static struct tensor matrix(struct backend *be, enum dtype dt, int64_t rows, int64_t cols)
{
    struct tensor t;
    struct amp_error err;
    int64_t shape[2] = { rows, cols };
    if (tensor_zeros(&t, be, dt, 2, shape, "m", &err) != AMP_OK) {
        fprintf(stderr, "bench_gemm: %s\n", err.msg);
        exit(1);
    }
    return t;
}

/* One product of a linear layer (out x in weight, `rows` rows): C = op(A) op(B). c16: C in the inputs' dtype
 * (the forward's and the input gradient's), else fp32 (the weight gradient of a step of one micro-batch: beta 0). */
struct shape {
    const char *name;
    int64_t m, n, k;
    bool ta, tb, c16, bias;
};

static const struct shape MLP[] = {
    { "fc1 forward", 128, 512, 784, false, true, true, true },
    { "fc2 forward", 128, 512, 512, false, true, true, true },
    { "head forward", 128, 10, 512, false, true, true, true },
    { "head dW", 10, 512, 128, true, false, false, false },
    { "head dx", 128, 512, 10, false, false, true, false },
    { "fc2 dW", 512, 512, 128, true, false, false, false },
    { "fc2 dx", 128, 512, 512, false, false, true, false },
    { "fc1 dW", 512, 784, 128, true, false, false, false },
};

static const struct shape GPT[] = {
    { "qkv forward", 2048, 384, 128, false, true, true, true },
    { "proj forward", 2048, 128, 128, false, true, true, true },
    { "fc forward", 2048, 512, 128, false, true, true, true },
    { "fc2 forward", 2048, 128, 512, false, true, true, true },
    { "lm_head forward", 2048, 256, 128, false, true, true, true },
    { "qkv dx", 2048, 128, 384, false, false, true, false },
    { "fc dx", 2048, 128, 512, false, false, true, false },
    { "fc2 dx", 2048, 512, 128, false, false, true, false },
    { "qkv dW", 384, 128, 2048, true, false, false, false },
    { "fc dW", 512, 128, 2048, true, false, false, false },
    { "fc2 dW", 128, 512, 2048, true, false, false, false },
    { "lm_head dW", 256, 128, 2048, true, false, false, false },
};

int main(int argc, char **argv)
{
    if (argc < 3 || (strcmp(argv[1], "mlp") && strcmp(argv[1], "gpt")) ||
        (strcmp(argv[2], "bf16") && strcmp(argv[2], "fp32"))) {
        fprintf(stderr, "usage: bench_gemm mlp|gpt bf16|fp32 [THREADS...]\n");
        return 2;
    }
    const struct shape *sh = strcmp(argv[1], "mlp") ? GPT : MLP;
    const int ns = strcmp(argv[1], "mlp") ? (int)(sizeof GPT / sizeof GPT[0]) : (int)(sizeof MLP / sizeof MLP[0]);
    const enum dtype in = strcmp(argv[2], "fp32") ? DT_BF16 : DT_FP32;
    int threads[16], nt = 0;
    for (int i = 3; i < argc && nt < 16; i++)
        threads[nt++] = atoi(argv[i]);
    if (!nt)
        threads[nt++] = 1;
    double total[16] = { 0 };
    printf("%-16s %-16s", "product", "m x n x k");
    for (int t = 0; t < nt; t++)
        printf(" %7d thr", threads[t]);
    printf("   (us a call; %s)\n", argv[2]);
    for (int s = 0; s < ns; s++) {
        char dims[48];
        snprintf(dims, sizeof dims, "%lldx%lldx%lld", (long long)sh[s].m, (long long)sh[s].n, (long long)sh[s].k);
        printf("%-16s %-16s", sh[s].name, dims);
        for (int t = 0; t < nt; t++) {
            struct backend *be = backend_cpu_create();
            struct amp_error err;
            if (!be || be->set_threads(be, threads[t], &err) != AMP_OK) {
                fprintf(stderr, "bench_gemm: no CPU backend with %d threads\n", threads[t]);
                return 1;
            }
            const struct shape q = sh[s];
            struct tensor a = q.ta ? matrix(be, in, q.k, q.m) : matrix(be, in, q.m, q.k);
            struct tensor b = q.tb ? matrix(be, in, q.n, q.k) : matrix(be, in, q.k, q.n);
            struct tensor c = matrix(be, q.c16 ? in : DT_FP32, q.m, q.n), bias = matrix(be, DT_FP32, 1, q.n);
            struct gemm_args g = { .a = &a, .b = &b, .c = &c, .bias = q.bias ? &bias : NULL, .trans_a = q.ta,
                                   .trans_b = q.tb, .m = q.m, .n = q.n, .k = q.k, .alpha = 1.0f,
                                   .beta = 0.0f, .batch = 1 };
            for (int i = 0; i < 50; i++)
                be->gemm(be, &g);
            double best = 1e30;
            for (int r = 0; r < 5; r++) {
                double t0 = now();
                for (int i = 0; i < REPS; i++)
                    be->gemm(be, &g);
                double dt = (now() - t0) / REPS;
                best = dt < best ? dt : best;
            }
            if (be->status(be, &err) != AMP_OK) {
                fprintf(stderr, "bench_gemm: %s\n", err.msg);
                return 1;
            }
            printf(" %11.1f", best * 1e6);
            total[t] += best;
            tensor_free(&a);
            tensor_free(&b);
            tensor_free(&c);
            tensor_free(&bias);
            backend_close(be);
        }
        printf("\n");
    }
    printf("%-16s %-16s", "all", "");
    for (int t = 0; t < nt; t++)
        printf(" %11.1f", total[t] * 1e6);
    printf("\n");
    return 0;
}
