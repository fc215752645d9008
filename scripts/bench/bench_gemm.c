/*
 * bench_gemm.c — the CPU backend's matrix products at several thread counts, on the shapes a reference model's
 * step runs (its linear layers' forward, input-gradient and weight-gradient products; for the CNN its
 * convolutions' three calls), each timed alone: the best of 5 rounds of REPS calls after 50 warm-up calls (10
 * and 20 for the convolutions). Built and run by scripts/bench/bench_gemm.sh against BUILD_DIR/libamp.a.
 *
 *   bench_gemm MODEL DTYPE [THREADS...]     MODEL: mlp (fashion_mlp, batch 128), gpt (text_gpt, 32 x 64 rows)
 *                                           or cnn (fashion_cnn's two convolutions and fc1, batch 128)
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

/* fashion_cnn's fc1 (3136 -> 128, batch 128), the products its convolutions' table does not cover */
static const struct shape CNN_FC[] = {
    { "fc1 forward", 128, 128, 3136, false, true, true, true },
    { "fc1 dW", 128, 3136, 128, true, false, false, false },
    { "fc1 dx", 128, 3136, 128, false, false, true, false },
};

/* One call of a convolution layer of fashion_cnn (configs/fashion_cnn.yaml, batch 128): the forward, the data
 * gradient or the filter gradient (with the bias gradient, beta 0: one micro-batch). */
enum conv_call { CONV_FWD, CONV_DATA, CONV_FILTER };
struct conv_shape {
    const char *name;
    int64_t c_in, hw, c_out;
    enum conv_call call;
};

static const struct conv_shape CNN[] = {
    { "conv1 forward", 1, 28, 32, CONV_FWD },    { "conv1 dW", 1, 28, 32, CONV_FILTER },
    { "conv2 forward", 32, 14, 64, CONV_FWD },   { "conv2 dx", 32, 14, 64, CONV_DATA },
    { "conv2 dW", 32, 14, 64, CONV_FILTER },
};

static double best_of(struct backend *be, int reps, void (*call)(struct backend *, const void *), const void *ctx)
{
    for (int i = 0; i < (reps > 20 ? 50 : 10); i++)
        call(be, ctx);
    double best = 1e30;
    for (int r = 0; r < 5; r++) {
        double t0 = now();
        for (int i = 0; i < reps; i++)
            call(be, ctx);
        double dt = (now() - t0) / reps;
        best = dt < best ? dt : best;
    }
    return best;
}

struct conv_ctx {
    struct conv_args a;
    struct tensor *x, *w, *bias, *y, *dw, *db;
    enum conv_call call;
};

static void conv_once(struct backend *be, const void *vctx)
{
    const struct conv_ctx *c = vctx;
    if (c->call == CONV_FWD)
        be->conv2d_forward(be, &c->a, c->y, c->x, c->w, c->bias);
    else if (c->call == CONV_DATA)
        be->conv2d_backward_data(be, &c->a, c->x, c->y, c->w);
    else
        be->conv2d_backward_filter(be, &c->a, c->dw, c->db, c->y, c->x, 0.0f);
}

static void gemm_once(struct backend *be, const void *g)
{
    be->gemm(be, g);
}

static struct backend *backend_with(int threads)
{
    struct backend *be = backend_cpu_create();
    struct amp_error err;
    if (!be || be->set_threads(be, threads, &err) != AMP_OK) {
        fprintf(stderr, "bench_gemm: no CPU backend with %d threads\n", threads);
        exit(1);
    }
    return be;
}

static void check_status(struct backend *be)
{
    struct amp_error err;
    if (be->status(be, &err) != AMP_OK) {
        fprintf(stderr, "bench_gemm: %s\n", err.msg);
        exit(1);
    }
}

static void bench_cnn(enum dtype in, const int *threads, int nt, const char *dtype_name)
{
    double total[16] = { 0 };
    printf("%-16s %-24s", "call", "c_in x hw^2 -> c_out");
    for (int t = 0; t < nt; t++)
        printf(" %7d thr", threads[t]);
    printf("   (us a call, batch 128, 3x3, padding 1; %s)\n", dtype_name);
    for (size_t s = 0; s < sizeof CNN / sizeof CNN[0]; s++) {
        const struct conv_shape q = CNN[s];
        char dims[48];
        snprintf(dims, sizeof dims, "%lld x %lld^2 -> %lld", (long long)q.c_in, (long long)q.hw, (long long)q.c_out);
        printf("%-16s %-24s", q.name, dims);
        for (int t = 0; t < nt; t++) {
            struct backend *be = backend_with(threads[t]);
            struct conv_ctx c = { .a = { .n = 128, .c_in = q.c_in, .h_in = q.hw, .w_in = q.hw, .c_out = q.c_out,
                                         .h_out = q.hw, .w_out = q.hw, .kernel = 3, .stride = 1, .padding = 1 },
                                  .call = q.call };
            struct tensor x = matrix(be, in, 128 * q.c_in, q.hw * q.hw), w = matrix(be, in, q.c_out, q.c_in * 9);
            struct tensor y = matrix(be, in, 128 * q.c_out, q.hw * q.hw), bias = matrix(be, DT_FP32, 1, q.c_out);
            struct tensor dw = matrix(be, DT_FP32, q.c_out, q.c_in * 9), db = matrix(be, DT_FP32, 1, q.c_out);
            c.x = &x, c.w = &w, c.y = &y, c.bias = &bias, c.dw = &dw, c.db = &db;
            double best = best_of(be, 20, conv_once, &c);
            check_status(be);
            printf(" %11.1f", best * 1e6);
            total[t] += best;
            tensor_free(&x), tensor_free(&w), tensor_free(&y), tensor_free(&bias), tensor_free(&dw), tensor_free(&db);
            backend_close(be);
        }
        printf("\n");
    }
    printf("%-16s %-24s", "all", "");
    for (int t = 0; t < nt; t++)
        printf(" %11.1f", total[t] * 1e6);
    printf("\n");
}

/* Each product of sh at each thread count, a row each, and the total. */
static void bench_products(const struct shape *sh, int ns, enum dtype in, const int *threads, int nt,
                           const char *dtype_name)
{
    double total[16] = { 0 };
    printf("%-16s %-16s", "product", "m x n x k");
    for (int t = 0; t < nt; t++)
        printf(" %7d thr", threads[t]);
    printf("   (us a call; %s)\n", dtype_name);
    for (int s = 0; s < ns; s++) {
        char dims[48];
        snprintf(dims, sizeof dims, "%lldx%lldx%lld", (long long)sh[s].m, (long long)sh[s].n, (long long)sh[s].k);
        printf("%-16s %-16s", sh[s].name, dims);
        for (int t = 0; t < nt; t++) {
            struct backend *be = backend_with(threads[t]);
            const struct shape q = sh[s];
            struct tensor a = q.ta ? matrix(be, in, q.k, q.m) : matrix(be, in, q.m, q.k);
            struct tensor b = q.tb ? matrix(be, in, q.n, q.k) : matrix(be, in, q.k, q.n);
            struct tensor c = matrix(be, q.c16 ? in : DT_FP32, q.m, q.n), bias = matrix(be, DT_FP32, 1, q.n);
            struct gemm_args g = { .a = &a, .b = &b, .c = &c, .bias = q.bias ? &bias : NULL, .trans_a = q.ta,
                                   .trans_b = q.tb, .m = q.m, .n = q.n, .k = q.k, .alpha = 1.0f,
                                   .beta = 0.0f, .batch = 1 };
            double best = best_of(be, REPS, gemm_once, &g);
            check_status(be);
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
}

int main(int argc, char **argv)
{
    if (argc < 3 || (strcmp(argv[1], "mlp") && strcmp(argv[1], "gpt") && strcmp(argv[1], "cnn")) ||
        (strcmp(argv[2], "bf16") && strcmp(argv[2], "fp32"))) {
        fprintf(stderr, "usage: bench_gemm mlp|gpt|cnn bf16|fp32 [THREADS...]\n");
        return 2;
    }
    const enum dtype in = strcmp(argv[2], "fp32") ? DT_BF16 : DT_FP32;
    int threads[16], nt = 0;
    for (int i = 3; i < argc && nt < 16; i++)
        threads[nt++] = atoi(argv[i]);
    if (!nt)
        threads[nt++] = 1;
    if (!strcmp(argv[1], "cnn")) {
        bench_cnn(in, threads, nt, argv[2]);
        bench_products(CNN_FC, (int)(sizeof CNN_FC / sizeof CNN_FC[0]), in, threads, nt, argv[2]);
    } else if (!strcmp(argv[1], "mlp")) {
        bench_products(MLP, (int)(sizeof MLP / sizeof MLP[0]), in, threads, nt, argv[2]);
    } else {
        bench_products(GPT, (int)(sizeof GPT / sizeof GPT[0]), in, threads, nt, argv[2]);
    }
    return 0;
}
