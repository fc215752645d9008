/*
 * zero.c — ZeRO stage 1: the sharded optimizer's collectives (zero.h).
 *
 * Backend memory goes to the communicator as dist.c sends it: directly where the communicator takes it (MPI on
 * the CPU backend, NCCL on the CUDA backend), through a host copy otherwise (d->stage: MPI with the CUDA backend).
 * Small scalars (the trial's verdict) always go through the host: one download a step on a GPU.
 */
#include "zero.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

_Static_assert(offsetof(struct state_bound, mmax) == offsetof(struct state_bound, pmax) + sizeof(float) &&
                   offsetof(struct state_bound, vmax) == offsetof(struct state_bound, pmax) + 2 * sizeof(float),
               "zero_after_update reduces struct state_bound as three consecutive floats");

static bool sharded(const struct optimizer *o)
{
    return o->shard_world > 1;
}

/* A rank that cannot make a collective the others are in ends the job (lib/engine/dist.c's rule). */
static void cannot(struct dist *d, const char *what, size_t bytes)
{
    fprintf(stderr, "[rank %d] ampTrain: error: out of memory (%zu bytes) for %s of the sharded optimizer state "
                    "(dist.zero 1)\n", d->comm->rank, bytes, what);
    d->comm->abort(d->comm, AMP_ERR_INTERNAL);
}

void zero_after_trial(struct dist *d, const struct optimizer *o, struct grad_check *check)
{
    if (!sharded(o) || !d->active)
        return;
    struct backend *be = d->be;
    int64_t v;
    if (be->host_memory)
        v = check->update_nonfinite;
    else
        be->download(be, &v, &check->update_nonfinite, sizeof v);
    int64_t x = v != 0 ? v : INT64_MAX; /* 0: none; else 1 + an index, and the smallest wins */
    d->comm->host_allreduce(d->comm, &x, 1, COMM_I64, COMM_MIN);
    v = x == INT64_MAX ? 0 : x;
    if (be->host_memory)
        check->update_nonfinite = v;
    else
        be->upload(be, &check->update_nonfinite, &v, sizeof v);
}

/* Every rank's block of t to every rank. */
static void gather_tensor(struct dist *d, struct tensor *t)
{
    size_t es = dtype_size(t->dtype), bytes = t->numel * es;
    if (!d->stage) {
        d->comm->all_gather(d->comm, t->data, t->numel, es);
        return;
    }
    void *h = dist_stage(d, bytes);
    if (!h) {
        cannot(d, "the all-gather of the weights", bytes);
        return;
    }
    d->be->download(d->be, h, t->data, bytes);
    d->comm->all_gather(d->comm, h, t->numel, es);
    d->be->upload(d->be, t->data, h, bytes);
}

void zero_after_update(struct dist *d, const struct optimizer *o, struct model *m, struct state_bound *bound)
{
    if (!sharded(o) || !d->active)
        return;
    for (int i = 0; i < m->nparams; i++) {
        struct param *p = m->params[i];
        if (!p->master_block) /* a sharded master stays this rank's block: only the copy the ops read travels */
            gather_tensor(d, &p->master);
        if (p->copy.data)
            gather_tensor(d, &p->copy);
    }
    dist_reduce_max_f32(d, &bound->pmax, 3);
}

/* t: a whole-size tensor of p's shape in `like`'s dtype and backend, zeroed or not; `what` names it in errors. */
static enum amp_status alloc_whole(struct tensor *t, const struct tensor *like, const struct param *p, bool zeroed,
                                   const char *what, struct amp_error *err)
{
    const struct tensor *shape = p->master_block ? &p->copy : &p->master; /* the copy is whole */
    char name[160];
    snprintf(name, sizeof name, "%s of %s (whole, dist.zero 1)", what, p->name);
    return (zeroed ? tensor_zeros : tensor_alloc)(t, like->be, like->dtype, shape->ndim, shape->shape, name, err);
}

static void free_whole(struct optim_state *whole, int n)
{
    for (int i = 0; whole && i < n; i++) {
        tensor_free(&whole[i].m);
        tensor_free(&whole[i].v);
    }
    free(whole);
}

enum amp_status zero_gather_begin(struct dist *d, struct optimizer *o, struct model *m, struct zero_swap *sw,
                                  struct amp_error *err)
{
    *sw = (struct zero_swap){0};
    if (!sharded(o))
        return AMP_OK;
    struct comm *c = d->comm;
    struct backend *be = d->be;
    bool root = c->rank == 0;
    enum amp_status st = AMP_OK;
    int n = m->nparams;
    struct optim_state *whole = NULL;
    struct tensor *masters = NULL; /* rank 0: the whole masters of the sharded ones */
    if (root && (!(whole = calloc((size_t)(n ? n : 1), sizeof *whole)) ||
                 !(masters = calloc((size_t)(n ? n : 1), sizeof *masters))))
        st = amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory gathering the optimizer state (dist.zero 1)");
    for (int i = 0; i < n; i++) {
        const struct param *p = m->params[i];
        /* the moments that exist (AdamW: m and v; SGD: m where it has momentum) and a sharded master, alike on every
         * rank */
        struct tensor *mine[3] = {&o->state[i].m, &o->state[i].v, p->master_block ? &m->params[i]->master : NULL};
        struct tensor *full[3] = {whole ? &whole[i].m : NULL, whole ? &whole[i].v : NULL,
                                  masters ? &masters[i] : NULL};
        static const char *const what[3] = {"optimizer state", "optimizer state", "master weights"};
        for (int j = 0; j < 3; j++) {
            if (!mine[j] || (j < 2 && !mine[j]->data))
                continue;
            size_t es = dtype_size(mine[j]->dtype), numel = param_numel(p);
            size_t send_bytes = mine[j]->numel * es, recv_bytes = numel * es;
            if (root && st == AMP_OK)
                st = alloc_whole(full[j], mine[j], p, false, what[j], err);
            bool direct = be->host_memory && root && st == AMP_OK;
            /* host memory: this rank's block to send, then (root) the whole tensor to receive */
            size_t stage_bytes = (be->host_memory ? 0 : send_bytes) + (root && !direct ? recv_bytes : 0);
            char *h = stage_bytes ? dist_stage(d, stage_bytes) : NULL;
            if (stage_bytes && !h) {
                cannot(d, "the gather of the optimizer state to rank 0", stage_bytes);
                return AMP_ERR_INTERNAL;
            }
            const void *send = mine[j]->data;
            if (!be->host_memory) {
                be->download(be, h, mine[j]->data, send_bytes);
                send = h;
            }
            void *recv = NULL;
            if (root)
                recv = direct ? full[j]->data : h + (be->host_memory ? 0 : send_bytes);
            c->host_gather(c, send, recv, numel, es, 0);
            if (root && !direct && st == AMP_OK)
                be->upload(be, full[j]->data, recv, recv_bytes);
        }
    }
    if (!root)
        return AMP_OK;
    if (st == AMP_OK && !(sw->shards = calloc((size_t)(n ? n : 1), sizeof *sw->shards)))
        st = amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory gathering the optimizer state (dist.zero 1)");
    if (st != AMP_OK) {
        free_whole(whole, n);
        for (int i = 0; masters && i < n; i++)
            tensor_free(&masters[i]);
        free(masters);
        return st;
    }
    sw->n = n;
    sw->model = m;
    sw->masters = masters;
    for (int i = 0; i < n; i++) {
        sw->shards[i] = o->state[i];
        o->state[i].m = whole[i].m;
        o->state[i].v = whole[i].v;
        struct param *p = m->params[i];
        if (p->master_block) { /* whole for the save; the block waits in sw->masters */
            struct tensor block = p->master;
            p->master = masters[i];
            masters[i] = block;
            p->master_block = false;
        }
    }
    free(whole);
    return AMP_OK;
}

/* The whole tensors freed, the blocks back. */
static void restore(struct optimizer *o, struct zero_swap *sw)
{
    for (int i = 0; i < sw->n; i++) {
        tensor_free(&o->state[i].m);
        tensor_free(&o->state[i].v);
        o->state[i] = sw->shards[i];
        if (sw->masters && sw->masters[i].data) {
            struct param *p = sw->model->params[i];
            tensor_free(&p->master);
            p->master = sw->masters[i];
            p->master_block = true;
        }
    }
    free(sw->shards);
    free(sw->masters);
    *sw = (struct zero_swap){0};
}

void zero_gather_end(struct optimizer *o, struct zero_swap *sw)
{
    if (sw->shards)
        restore(o, sw);
}

enum amp_status zero_load_begin(struct optimizer *o, struct model *m, struct zero_swap *sw, struct amp_error *err)
{
    *sw = (struct zero_swap){0};
    if (!sharded(o))
        return AMP_OK;
    int n = m->nparams;
    if (!(sw->shards = calloc((size_t)(n ? n : 1), sizeof *sw->shards)))
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory loading the optimizer state (dist.zero 1)");
    sw->n = n;
    enum amp_status st = AMP_OK;
    for (int i = 0; i < n; i++) {
        sw->shards[i] = o->state[i];
        struct optim_state *s = &o->state[i], *b = &sw->shards[i];
        s->m = s->v = (struct tensor){0};
        if (st == AMP_OK && b->m.data)
            st = alloc_whole(&s->m, &b->m, m->params[i], true, "optimizer state", err);
        if (st == AMP_OK && b->v.data)
            st = alloc_whole(&s->v, &b->v, m->params[i], true, "optimizer state", err);
    }
    if (st != AMP_OK)
        restore(o, sw);
    return st;
}

/* whole's elements [lo, lo + shard->numel) into shard (backend memory both). */
static enum amp_status take_block(struct tensor *shard, const struct tensor *whole, size_t lo)
{
    struct backend *be = shard->be;
    size_t es = dtype_size(shard->dtype), bytes = shard->numel * es;
    const char *src = (const char *)whole->data + lo * es;
    if (bytes == 0)
        return AMP_OK;
    if (be->host_memory) {
        memcpy(shard->data, src, bytes);
        return AMP_OK;
    }
    void *h = malloc(bytes);
    if (!h)
        return AMP_ERR_INTERNAL;
    be->download(be, h, src, bytes);
    be->upload(be, shard->data, h, bytes);
    free(h);
    return AMP_OK;
}

enum amp_status zero_load_end(struct optimizer *o, struct zero_swap *sw, bool ok, struct amp_error *err)
{
    if (!sw->shards)
        return AMP_OK;
    enum amp_status st = AMP_OK;
    for (int i = 0; ok && st == AMP_OK && i < sw->n; i++) {
        struct optim_state *s = &o->state[i], *b = &sw->shards[i];
        if (b->m.data)
            st = take_block(&b->m, &s->m, b->lo);
        if (st == AMP_OK && b->v.data)
            st = take_block(&b->v, &s->v, b->lo);
    }
    restore(o, sw);
    if (st != AMP_OK)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL,
                        "out of memory taking this rank's block of the loaded optimizer state (dist.zero 1)");
    return AMP_OK;
}

enum amp_status zero_shard_masters(struct optimizer *o, struct model *m, struct amp_error *err)
{
    if (!sharded(o))
        return AMP_OK;
    for (int i = 0; i < m->nparams; i++) {
        struct param *p = m->params[i];
        if (p->master_block || !param_master_private(p))
            continue;
        const struct optim_state *s = &o->state[i];
        const int64_t shape[1] = {(int64_t)(s->hi - s->lo)};
        char what[160];
        snprintf(what, sizeof what, "master weights of %s (this rank's block, dist.zero 1)", p->name);
        struct tensor block;
        enum amp_status st = tensor_alloc(&block, p->master.be, p->master.dtype, 1, shape, what, err);
        if (st == AMP_OK && take_block(&block, &p->master, s->lo) != AMP_OK) {
            tensor_free(&block);
            st = amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory taking this rank's block of %s (dist.zero 1)",
                          p->name);
        }
        if (st != AMP_OK)
            return st; /* the parameters before stay sharded, the rest whole: both are consistent */
        tensor_free(&p->master);
        p->master = block;
        p->master_block = true;
    }
    return AMP_OK;
}
