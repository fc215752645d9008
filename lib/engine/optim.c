/*
 * optim.c — optimizer state, the learning-rate schedule's parameters, and the per-parameter update
 * dispatch. See optim.h; the schedule's formula is schedule_lr in step_rule.h (it runs on the backend).
 */
#include "optim.h"

#include <stdio.h>
#include <stdlib.h>

#include "comm.h"   /* comm_shard: the sharded state's blocks */
#include "sround.h" /* sr_seed */

enum amp_status optim_create(struct optimizer *o, const struct optim_config *cfg, struct model *m,
                             int64_t total_steps, uint64_t run_seed, struct amp_error *err)
{
    return optim_create_sharded(o, cfg, m, total_steps, run_seed, 0, 1, NULL, err);
}

enum amp_status optim_create_sharded(struct optimizer *o, const struct optim_config *cfg, struct model *m,
                                     int64_t total_steps, uint64_t run_seed, int rank, int world,
                                     const size_t *blocks, struct amp_error *err)
{
    *o = (struct optimizer){.cfg = *cfg, .total_steps = total_steps, .sr_seed = sr_seed(run_seed),
                            .shard_rank = world > 1 ? rank : 0, .shard_world = world > 1 ? world : 1};
    enum dtype sdt = cfg->state_dtype == STORE_BF16 ? DT_BF16 : DT_FP32;
    o->state = calloc((size_t)(m->nparams ? m->nparams : 1), sizeof *o->state);
    o->args = calloc((size_t)(m->nparams ? m->nparams : 1), sizeof *o->args);
    size_t w1 = (size_t)o->shard_world + 1;
    if (o->shard_world > 1) {
        o->views = calloc(3 * (size_t)(m->nparams ? m->nparams : 1), sizeof *o->views);
        o->blocks = calloc((size_t)(m->nparams ? m->nparams : 1) * w1, sizeof *o->blocks);
    }
    if (!o->state || !o->args || (o->shard_world > 1 && (!o->views || !o->blocks))) {
        optim_free(o);
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory creating optimizer state");
    }
    o->nstate = m->nparams;
    bool need_m = cfg->kind == OPTIM_ADAMW || cfg->momentum > 0;
    bool need_v = cfg->kind == OPTIM_ADAMW;
    for (int i = 0; i < m->nparams; i++) {
        const struct tensor *w = &m->params[i]->master;
        char what[128];
        snprintf(what, sizeof what, "optimizer state of %s", m->params[i]->name);
        enum amp_status st = AMP_OK;
        struct optim_state *s = &o->state[i];
        if (o->shard_world == 1) {
            s->lo = 0;
            s->hi = w->numel;
        } else {
            size_t *b = o->blocks + (size_t)i * w1;
            for (int q = 0; q < o->shard_world; q++) {
                if (blocks) {
                    b[q] = blocks[(size_t)i * w1 + (size_t)q];
                    b[q + 1] = blocks[(size_t)i * w1 + (size_t)q + 1];
                } else {
                    comm_shard(w->numel, o->shard_world, q, &b[q], &b[q + 1]);
                }
            }
            s->lo = b[o->shard_rank];
            s->hi = b[o->shard_rank + 1];
        }
        int ndim = w->ndim;
        const int64_t *shape = w->shape, block[1] = {(int64_t)(s->hi - s->lo)};
        if (o->shard_world > 1) { /* this rank's block, flat */
            ndim = 1;
            shape = block;
        }
        if (need_m)
            st = tensor_zeros(&s->m, m->be, sdt, ndim, shape, what, err);
        if (st == AMP_OK && need_v)
            st = tensor_zeros(&s->v, m->be, sdt, ndim, shape, what, err);
        if (st != AMP_OK) {
            optim_free(o);
            return st;
        }
    }
    return AMP_OK;
}

struct schedule_params optim_schedule_params(const struct optimizer *o)
{
    const struct schedule_config *s = &o->cfg.schedule;
    static const int32_t kinds[] = {[SCHED_CONSTANT] = SCHEDULE_CONSTANT, [SCHED_STEP] = SCHEDULE_STEP,
                                    [SCHED_COSINE] = SCHEDULE_COSINE, [SCHED_LINEAR] = SCHEDULE_LINEAR,
                                    [SCHED_WSD] = SCHEDULE_WSD, [SCHED_INVERSE_SQRT] = SCHEDULE_INVERSE_SQRT};
    struct schedule_params p = {
        .kind = kinds[s->kind],
        .lr = o->cfg.lr,
        .gamma = s->gamma,
        .min_lr = s->min_lr,
        .warmup_steps = s->warmup_steps,
        .step_size = s->step_size,
        .total_steps = o->total_steps,
        .decay_steps = s->decay_steps,
        .decay_fraction = s->decay_fraction,
    };
    return p;
}

double optim_lr(const struct optimizer *o)
{
    struct schedule_params p = optim_schedule_params(o);
    return schedule_lr(&p, o->step);
}

/* Elements [lo, hi) of t as a flat tensor sharing its memory (never freed). */
static struct tensor view_of(const struct tensor *t, size_t lo, size_t hi)
{
    struct tensor v = *t;
    v.data = t->data ? (char *)t->data + lo * dtype_size(t->dtype) : NULL;
    v.ndim = 1;
    for (int d = 0; d < TENSOR_MAX_DIMS; d++)
        v.shape[d] = 1;
    v.shape[0] = (int64_t)(hi - lo);
    v.numel = hi - lo;
    return v;
}

void optim_step(struct optimizer *o, struct model *m, struct step_state *st, int64_t *trial)
{
    for (int i = 0; i < m->nparams; i++) {
        struct param *p = m->params[i];
        struct optim_state *s = &o->state[i];
        struct tensor *master = &p->master, *copy = p->copy.data ? &p->copy : NULL;
        const struct tensor *grad = &p->grad;
        if (o->shard_world > 1) { /* this rank's block of the weights, gradient and copy (lib/engine/zero.h) */
            struct tensor *v = &o->views[3 * i];
            /* a sharded master holds the block only (param.master_block) */
            v[0] = p->master_block ? view_of(&p->master, 0, s->hi - s->lo) : view_of(&p->master, s->lo, s->hi);
            v[1] = view_of(&p->grad, s->lo, s->hi);
            master = &v[0];
            grad = &v[1];
            if (copy) {
                v[2] = view_of(&p->copy, s->lo, s->hi);
                copy = &v[2];
            }
        }
        o->args[i] = (struct optim_update_args){
            .master = master,
            .grad = grad,
            .m = s->m.data ? &s->m : NULL,
            .v = s->v.data ? &s->v : NULL,
            .copy = copy,
            .sc = &st->sc,
            .trial = trial,
            .bound = trial ? NULL : &st->bound,
            .weight_decay = p->decay ? (float)o->cfg.weight_decay : 0.0f,
            .beta1 = o->cfg.betas[0],
            .beta2 = o->cfg.betas[1],
            .eps = (float)o->cfg.eps,
            .momentum = (float)o->cfg.momentum,
            .nesterov = o->cfg.nesterov,
            .stochastic = o->cfg.stochastic_rounding,
            .sr_seed = o->sr_seed,
            .sr_param = (uint32_t)i,
            .sr_offset = s->lo,
        };
    }
    if (o->cfg.kind == OPTIM_ADAMW)
        m->be->adamw_update(m->be, o->args, m->nparams);
    else
        m->be->sgd_update(m->be, o->args, m->nparams);
}

void optim_free(struct optimizer *o)
{
    if (!o)
        return;
    for (int i = 0; i < o->nstate; i++) {
        tensor_free(&o->state[i].m);
        tensor_free(&o->state[i].v);
    }
    free(o->state);
    free(o->args);
    free(o->views);
    free(o->blocks);
    o->blocks = NULL;
    o->state = NULL;
    o->args = NULL;
    o->views = NULL;
    o->nstate = 0;
}
