/*
 * optim.h — the optimizer (SGD with momentum/Nesterov, AdamW) and the learning-rate schedule.
 *
 * State per parameter (AdamW: m, v; SGD: momentum buffer) is FP32, or bf16 with optim.state_dtype: bf16, and
 * lives on the backend. bf16 stores (state, and bf16 master weights) round to nearest even, or stochastically
 * with optim.stochastic_rounding (lib/base/sround.h: keyed by run.seed, the step and the parameter's index). The step
 * count `step` counts optimizer steps actually taken: a skipped step (non-finite gradients) moves
 * neither the weights, the moments, the step count nor the schedule.
 *
 * Schedule, with t = optimizer steps taken so far (0-based) and W = warmup_steps:
 *   t < W:     lr * (t + 1) / W                                (linear warmup)
 *   constant:  lr
 *   step:      lr * gamma ^ floor((t - W) / step_size)
 *   cosine:    min_lr + (lr - min_lr) * (1 + cos(pi * min(1, (t - W) / (total - W)))) / 2
 */
#ifndef AMP_OPTIM_H
#define AMP_OPTIM_H

#include <stdint.h>

#include "config.h" /* struct optim_config */
#include "model.h"  /* struct model, struct param */
#include "step_rule.h" /* struct schedule_params, struct step_scalars */

struct optim_state {
    struct tensor m, v;   /* fp32 (or bf16), shape of the parameter; v empty for SGD, both empty for SGD without
                           * momentum. Sharded (dist.zero 1): the elements [lo, hi) of the parameter only, 1-D */
    size_t lo, hi;        /* the parameter's elements this rank updates: all of them ([0, numel)) unless sharded */
};

struct optimizer {
    struct optim_config cfg;
    int64_t total_steps;  /* for the cosine schedule */
    int64_t step;         /* optimizer steps taken */
    struct optim_state *state; /* one per model parameter */
    int nstate;
    struct optim_update_args *args; /* one per parameter: the update call's table, filled each step */
    uint64_t sr_seed;     /* sr_seed(run.seed): the stochastic rounding streams */
    int shard_rank, shard_world; /* sharded over shard_world ranks (lib/engine/zero.h): this rank holds and updates block
                                  * shard_rank of every parameter; 0 and 1 when not sharded */
    size_t *blocks;       /* sharded: nstate x (shard_world + 1), parameter i's rank q block [blocks[i (w + 1) + q], ..
                           * + 1) (comm.h's bounds); NULL when not sharded */
    struct tensor *views; /* sharded: 3 per parameter, the master's, gradient's and copy's views of [lo, hi) */
};

/* `run_seed` keys stochastic rounding (never the rank: every replica rounds alike). */
enum amp_status optim_create(struct optimizer *o, const struct optim_config *cfg, struct model *m,
                             int64_t total_steps, uint64_t run_seed, struct amp_error *err);

/* The same with the state sharded over `world` ranks (dist.zero 1, lib/engine/zero.h): this rank's moments hold only its
 * block `rank` of each parameter's elements, and optim_step updates only that block of the weights (and their
 * copies), which the caller then gathers from the other ranks. `blocks`: every rank's block of every parameter
 * (struct optimizer's layout; copied), or NULL: comm_shard's. world 1: optim_create. */
enum amp_status optim_create_sharded(struct optimizer *o, const struct optim_config *cfg, struct model *m,
                                     int64_t total_steps, uint64_t run_seed, int rank, int world,
                                     const size_t *blocks, struct amp_error *err);

/* The schedule as plain data, for the step rule (lib/base/step_rule.h). */
struct schedule_params optim_schedule_params(const struct optimizer *o);

/* Learning rate for the next step (from o->step). */
double optim_lr(const struct optimizer *o);

/* Queue one step's update of every parameter, refreshing the low-precision copies in the same pass.
 * The scalars (gradient factor = unscale * clip, learning rate, step count, skip) are read by the
 * backend from st->sc in backend memory (written by step_finish), and the update raises st->bound to the
 * magnitudes it stores; o->step is the host's mirror of the count and is not touched here. With `trial`
 * (backend memory; step_propose's scalars), the same arithmetic stores nothing and reports whether any
 * weight or moment would be stored non-finite (struct optim_update_args.trial), where st->sc.check asks. */
void optim_step(struct optimizer *o, struct model *m, struct step_state *st, int64_t *trial);

void optim_free(struct optimizer *o);

#endif
