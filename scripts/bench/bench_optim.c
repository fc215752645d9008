/*
 * bench_optim.c — the CPU backend's step tail per parameter, side by side in alternating rounds: the AdamW update
 * with fp32 master and moments (with the bf16 copy mixed bf16 keeps), with bf16 master and moments rounded to
 * nearest or stochastically, and the gradient check (grad_stats) that precedes every update. Built and
 * run by scripts/bench/bench_optim.sh against BUILD_DIR/libamp.a.
 *
 *   bench_optim [THREADS...]     environment: PARAMS, the tensors' sizes (default 1048576: one tensor of 1 M);
 *                                SUBNORMAL, a fraction (default 0: no row): a fifth row, the fp32 update again with
 *                                that fraction of the parameters (spread evenly) at a zero gradient and a first
 *                                moment of 1e-38, which the updates decay through fp32's subnormal range (below
 *                                2^-126, about 1.18e-38): where a weight's gradient stays 0 (fashion_mlp's fc1 weights of
 *                                pixels that are 0 in every image of the batch) its moment does that after ~800 steps
 *
 * Each thread count gets its own rows (run.threads: the backend's pool), so a row's ratio to the 1-thread row says
 * how the step tail scales on this machine.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "sround.h"
#include "step_rule.h"

#define MAX_TENSORS 64
#define UPDATES 20

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

struct param {
    struct tensor p32, p16, g, m32, v32, m16, v16, c16;
    struct tensor gs, ms;  /* SUBNORMAL's row: the gradient with zeros, the moment it decays */
};

static void zeros(struct tensor *t, struct backend *be, enum dtype dt, int64_t n)
{
    struct amp_error err;
    int64_t shape[1] = {n};
    if (tensor_zeros(t, be, dt, 1, shape, "t", &err) != AMP_OK) {
        fprintf(stderr, "bench_optim: %s\n", err.msg);
        exit(1);
    }
}

int main(int argc, char **argv)
{
    struct backend *be = backend_cpu_create();
    int64_t sizes[MAX_TENSORS];
    int nt = 0;
    char spec[1024];
    snprintf(spec, sizeof spec, "%s", getenv("PARAMS") && *getenv("PARAMS") ? getenv("PARAMS") : "1048576");
    for (char *s = strtok(spec, ", "); s && nt < MAX_TENSORS; s = strtok(NULL, ", "))
        sizes[nt++] = atoll(s);
    static struct param ps[MAX_TENSORS];
    const struct tensor *grads[MAX_TENSORS];
    int64_t total = 0;
    const double sub = getenv("SUBNORMAL") ? atof(getenv("SUBNORMAL")) : 0.0;
    const int64_t every = sub > 0.0 ? (int64_t)(1.0 / sub + 0.5) : 0; /* one parameter in `every` */
    for (int t = 0; t < nt; t++) {
        struct param *q = &ps[t];
        zeros(&q->p32, be, DT_FP32, sizes[t]), zeros(&q->p16, be, DT_BF16, sizes[t]);
        zeros(&q->g, be, DT_FP32, sizes[t]);
        zeros(&q->m32, be, DT_FP32, sizes[t]), zeros(&q->v32, be, DT_FP32, sizes[t]);
        zeros(&q->m16, be, DT_BF16, sizes[t]), zeros(&q->v16, be, DT_BF16, sizes[t]);
        zeros(&q->c16, be, DT_BF16, sizes[t]);
        float *gf = q->g.data;
        for (int64_t i = 0; i < sizes[t]; i++)
            gf[i] = (float)(((uint64_t)(total + i) * 2654435761u) % 1000) / 1000.0f - 0.5f;
        grads[t] = &q->g;
        zeros(&q->gs, be, DT_FP32, sizes[t]), zeros(&q->ms, be, DT_FP32, sizes[t]);
        memcpy(q->gs.data, gf, (size_t)sizes[t] * sizeof(float));
        for (int64_t i = 0; every && i < sizes[t]; i++)
            if ((total + i) % every == 0)
                ((float *)q->gs.data)[i] = 0.0f;
        total += sizes[t];
    }
    struct step_params sp = {.beta1 = 0.9, .beta2 = 0.999, .weight_decay = 0.01f};
    struct step_scalars sc;
    step_rule_scalars(&sc, &sp, 1e-3f, 5, 1.0f);
    static struct optim_update_args args[MAX_TENSORS];
    const char *names[] = {"AdamW fp32 master+state, bf16 copy", "AdamW bf16 master+state, nearest",
                           "AdamW bf16 master+state, stochastic", "gradient check (grad_stats)",
                           "AdamW fp32, some moments subnormal"};
    int threads[16], nthreads = 0;
    for (int i = 1; i < argc && nthreads < 16; i++)
        threads[nthreads++] = atoi(argv[i]);
    if (!nthreads)
        threads[nthreads++] = 1;
    printf("bench_optim: %d tensor(s), %lld parameters, %d updates a row\n", nt, (long long)total, UPDATES);
    for (int round = 0; round < 3; round++)
        for (int ti = 0; ti < nthreads; ti++) {
            struct amp_error err;
            if (backend_set_threads(be, threads[ti], &err) != AMP_OK) {
                fprintf(stderr, "bench_optim: %s\n", err.msg);
                return 1;
            }
            for (int k = 0; k < (every ? 5 : 4); k++) {
                for (int t = 0; t < nt; t++) {
                    struct param *q = &ps[t];
                    args[t] = (struct optim_update_args){.grad = &q->g, .sc = &sc, .weight_decay = 0.01f, .beta1 = 0.9,
                                                         .beta2 = 0.999, .eps = 1e-8f, .sr_seed = sr_seed(1)};
                    if (k == 0)
                        args[t].master = &q->p32, args[t].m = &q->m32, args[t].v = &q->v32, args[t].copy = &q->c16;
                    else if (k == 4) { /* the moments restart at 1e-38 where the gradient is 0, 0.1 elsewhere */
                        args[t].master = &q->p32, args[t].m = &q->ms, args[t].v = &q->v32, args[t].copy = &q->c16;
                        args[t].grad = &q->gs;
                        float *ms = q->ms.data;
                        const float *gz = q->gs.data;
                        for (int64_t i = 0; i < sizes[t]; i++)
                            ms[i] = gz[i] == 0.0f ? 1e-38f : 0.1f;
                    } else
                        args[t].master = &q->p16, args[t].m = &q->m16, args[t].v = &q->v16, args[t].stochastic = k == 2;
                }
                struct grad_check gc;
                int64_t counts[2 * MAX_TENSORS];
                double t0 = now();
                for (int it = 0; it < UPDATES; it++) {
                    if (k != 3)
                        be->adamw_update(be, args, nt);
                    else
                        be->grad_stats(be, grads, nt, &gc, counts);
                }
                double dt = (now() - t0) / UPDATES;
                printf("round %d, %d thread(s): %-36s %7.3f ms a step (%.2f ns/param)\n", round, threads[ti],
                       names[k], dt * 1e3, dt * 1e9 / (double)total);
            }
        }
    return 0;
}
