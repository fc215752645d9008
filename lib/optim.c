/*
 * optim.c — optimizer state, learning-rate schedule, and the per-parameter update dispatch. See optim.h.
 */
#include "optim.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#define AMP_PI 3.14159265358979323846

enum amp_status optim_create(struct optimizer *o, const struct optim_config *cfg, struct model *m,
                             int64_t total_steps, struct amp_error *err)
{
    *o = (struct optimizer){.cfg = *cfg, .total_steps = total_steps};
    o->state = calloc((size_t)(m->nparams ? m->nparams : 1), sizeof *o->state);
    if (!o->state)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory creating optimizer state");
    o->nstate = m->nparams;
    bool need_m = cfg->kind == OPTIM_ADAMW || cfg->momentum > 0;
    bool need_v = cfg->kind == OPTIM_ADAMW;
    for (int i = 0; i < m->nparams; i++) {
        const struct tensor *w = &m->params[i]->master;
        char what[128];
        snprintf(what, sizeof what, "optimizer state of %s", m->params[i]->name);
        enum amp_status st = AMP_OK;
        if (need_m)
            st = tensor_zeros(&o->state[i].m, m->be, DT_FP32, w->ndim, w->shape, what, err);
        if (st == AMP_OK && need_v)
            st = tensor_zeros(&o->state[i].v, m->be, DT_FP32, w->ndim, w->shape, what, err);
        if (st != AMP_OK) {
            optim_free(o);
            return st;
        }
    }
    return AMP_OK;
}

double optim_lr(const struct optimizer *o)
{
    const struct schedule_config *s = &o->cfg.schedule;
    double lr = o->cfg.lr;
    int64_t t = o->step, w = s->warmup_steps;
    if (t < w)
        return lr * (double)(t + 1) / (double)w;
    switch (s->kind) {
    case SCHED_CONSTANT: return lr;
    case SCHED_STEP: return lr * pow(s->gamma, (double)((t - w) / s->step_size));
    case SCHED_COSINE: {
        double span = (double)(o->total_steps - w);
        double frac = span > 0 ? fmin(1.0, (double)(t - w) / span) : 1.0;
        return s->min_lr + (lr - s->min_lr) * 0.5 * (1.0 + cos(AMP_PI * frac));
    }
    }
    return lr;
}

void optim_step(struct optimizer *o, struct model *m, float grad_mul)
{
    float lr = (float)optim_lr(o);
    o->step++;
    for (int i = 0; i < m->nparams; i++) {
        struct param *p = m->params[i];
        struct optim_update_args a = {
            .master = &p->master,
            .grad = &p->grad,
            .m = o->state[i].m.data ? &o->state[i].m : NULL,
            .v = o->state[i].v.data ? &o->state[i].v : NULL,
            .lowp = p->lowp.data ? &p->lowp : NULL,
            .grad_mul = grad_mul,
            .lr = lr,
            .weight_decay = p->decay ? (float)o->cfg.weight_decay : 0.0f,
            .beta1 = (float)o->cfg.betas[0],
            .beta2 = (float)o->cfg.betas[1],
            .eps = (float)o->cfg.eps,
            .step = o->step,
            .momentum = (float)o->cfg.momentum,
            .nesterov = o->cfg.nesterov,
            .first_step = o->step == 1,
        };
        if (o->cfg.kind == OPTIM_ADAMW)
            m->be->adamw_update(m->be, &a);
        else
            m->be->sgd_update(m->be, &a);
    }
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
    o->state = NULL;
    o->nstate = 0;
}
