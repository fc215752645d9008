/*
 * zero.c — ZeRO stage 1: the sharded optimizer's collectives (zero.h).
 *
 * Backend memory goes to the communicator as dist.c sends it: directly where the communicator takes it (MPI on
 * the CPU backend, NCCL on the CUDA backend), through a host copy otherwise (d->stage: MPI with the CUDA backend).
 * Small scalars (the trial's verdict) always go through the host: one download a step on a GPU.
 */
#include "zero.h"

#include <math.h>   /* fabs */
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

/* Every rank's block (bounds: the optimizer's blocks of its parameter) of t to every rank: the communicator's
 * all-gather of the blocks as they are, in the memory it takes (host for mpi, device for nccl), through a host copy
 * where it takes host memory and t is on a device. */
static void gather_tensor(struct dist *d, struct tensor *t, const size_t *bounds)
{
    struct comm *c = d->comm;
    size_t es = dtype_size(t->dtype), bytes = t->numel * es;
    bool blocks = c->all_gather_blocks != NULL;
    if (!d->stage) {
        if (blocks)
            c->all_gather_blocks(c, t->data, bounds, es);
        else
            c->all_gather(c, t->data, t->numel, es);
        return;
    }
    void *h = dist_stage(d, bytes);
    if (!h) {
        cannot(d, "the all-gather of the weights", bytes);
        return;
    }
    d->be->download(d->be, h, t->data, bytes);
    if (blocks)
        c->all_gather_blocks(c, h, bounds, es);
    else
        c->all_gather(c, h, t->numel, es);
    d->be->upload(d->be, t->data, h, bytes);
}

void zero_after_update(struct dist *d, const struct optimizer *o, struct model *m, struct state_bound *bound)
{
    if (!sharded(o) || !d->active)
        return;
    for (int i = 0; i < m->nparams; i++) {
        struct param *p = m->params[i];
        const size_t *bounds = o->blocks + (size_t)i * (size_t)(o->shard_world + 1);
        if (!p->master_block) /* a sharded master stays this rank's block: only the copy the ops read travels */
            gather_tensor(d, &p->master, bounds);
        if (p->copy.data)
            gather_tensor(d, &p->copy, bounds);
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
            if (c->host_gather_blocks)
                c->host_gather_blocks(c, send, recv, o->blocks + (size_t)i * (size_t)(o->shard_world + 1), es, 0);
            else
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

/* ---- the partition and the step's exact statistics ------------------------------------------------------------ */

/* A place where a block may end, and the weight of the bucket's elements before it. */
struct cut_at {
    size_t at;     /* floats of grad_flat */
    double before; /* the sum of the weights of the elements in [begin, at) */
};

static int cmp_param_off(const void *a, const void *b)
{
    size_t x = ((const size_t *)a)[0], y = ((const size_t *)b)[0];
    return x < y ? -1 : x > y;
}

/* Bucket [begin, end) of grad_flat cut into `world` blocks at part boundaries: cuts[0..world], relative to begin.
 * Where a block may end: the first element of each part of a parameter that starts in the bucket, and the bucket's
 * end. The blocks are balanced by weight (parameter i's elements weigh weight[i] each: what a rank holds for them)
 * over the buckets cut so far: held[q] is what rank q holds of them (updated here), and each cut is the place nearest
 * to where rank q would hold its share of all of them, never before the previous cut (the lower on a tie). `cand`
 * has room for every part of the model and the end, `po` for 2 x nparams. */
static void cut_bucket(const struct model *m, size_t begin, size_t end, size_t part, int world, const double *weight,
                       double *held, struct cut_at *cand, size_t *po, size_t *cuts)
{
    size_t np = 0, n = 0;
    for (int i = 0; i < m->nparams; i++) {
        size_t off = (size_t)((const float *)m->params[i]->grad.data - m->grad_flat);
        if (off >= begin && off < end) {
            po[2 * np] = off;
            po[2 * np + 1] = (size_t)i;
            np++;
        }
    }
    qsort(po, np, 2 * sizeof *po, cmp_param_off);
    double acc = 0;
    for (size_t k = 0; k < np; k++) {
        const struct param *p = m->params[po[2 * k + 1]];
        double wt = weight[po[2 * k + 1]];
        for (size_t e = 0; e < p->grad.numel; e += part)
            cand[n++] = (struct cut_at){.at = po[2 * k] + e, .before = acc + wt * (double)e};
        acc += wt * (double)p->grad.numel;
    }
    cand[n++] = (struct cut_at){.at = end, .before = acc};
    double all = acc;
    for (int q = 0; q < world; q++)
        all += held[q];
    size_t prev = 0; /* index into cand */
    double target = 0;
    cuts[0] = 0;
    for (int q = 1; q < world; q++) {
        double share = all / world - held[q - 1]; /* what rank q - 1 still lacks of its share */
        target += share > 0 ? share : 0;
        size_t best = prev;
        for (size_t j = prev; j < n; j++)
            if (fabs(cand[j].before - target) < fabs(cand[best].before - target))
                best = j;
        held[q - 1] += cand[best].before - cand[prev].before;
        prev = best;
        target = cand[best].before;
        cuts[q] = cand[best].at - begin;
    }
    held[world - 1] += acc - cand[prev].before;
    cuts[world] = end - begin;
}

/* Parameter p's blocks from the bucket cuts (relative to `begin`) that hold it: false where it does not lie in one
 * bucket (then the plan is not aligned). */
static bool param_blocks(const struct model *m, const struct param *p, const struct zero_plan *z, size_t *b)
{
    size_t off = (size_t)((const float *)p->grad.data - m->grad_flat), numel = p->grad.numel;
    for (int k = 0; k < z->nbuckets; k++) {
        const size_t *cuts = z->buckets + (size_t)k * (size_t)(z->world + 1);
        size_t begin = z->bucket_at[k], end = begin + cuts[z->world];
        if (off < begin || off >= end)
            continue;
        if (off + numel > end)
            return false;
        for (int q = 0; q <= z->world; q++) {
            size_t at = begin + cuts[q];
            b[q] = at <= off ? 0 : at - off < numel ? at - off : numel;
        }
        return true;
    }
    return numel == 0;
}

static bool grads_in_flat(const struct model *m)
{
    if (!m->grad_flat)
        return false;
    for (int i = 0; i < m->nparams; i++) {
        const struct tensor *g = &m->params[i]->grad;
        const float *at = g->data;
        if (g->dtype != DT_FP32 || at < m->grad_flat || at + g->numel > m->grad_flat + m->grad_flat_count)
            return false;
    }
    return true;
}

/* The exact step's tables: each parameter's parts, where each part lies in the all-gather's buffer (rank by rank,
 * each rank's parts in parameter and part order), that buffer in backend memory (and its host copy where the
 * communicator takes host memory and the backend's is a device's), and this rank's views of its gradient blocks. */
static enum amp_status plan_parts(struct zero_plan *z, const struct dist *d, const struct model *m, size_t part,
                                  struct amp_error *err)
{
    int n = m->nparams, w = z->world;
    size_t w1 = (size_t)w + 1, nn = (size_t)(n ? n : 1);
    z->first = calloc(nn + 1, sizeof *z->first);
    z->part_bounds = calloc(w1, sizeof *z->part_bounds);
    z->views = calloc(nn, sizeof *z->views);
    z->view_ptrs = calloc(nn, sizeof *z->view_ptrs);
    if (!z->first || !z->part_bounds || !z->views || !z->view_ptrs)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory planning the gradient statistics (dist.zero 1)");
    for (int i = 0; i < n; i++)
        z->first[i + 1] = z->first[i] + (int64_t)((m->params[i]->grad.numel + part - 1) / part);
    size_t total = (size_t)z->first[n], bytes = (total ? total : 1) * sizeof(struct grad_part);
    struct backend *be = d->be;
    z->be = be;
    z->gathered = be->host_memory ? calloc(1, bytes) : be->alloc(be, bytes);
    z->staged = d->stage ? calloc(1, bytes) : NULL;
    z->at = calloc(total ? total : 1, sizeof *z->at);
    if (!z->gathered || (d->stage && !z->staged) || !z->at)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory planning the gradient statistics (dist.zero 1)");
    size_t k = 0;
    for (int q = 0; q < w; q++) {
        z->part_bounds[q] = k;
        for (int i = 0; i < n; i++) {
            const size_t *b = z->blocks + (size_t)i * w1;
            if (b[q + 1] > b[q])
                for (size_t c = b[q] / part; c < (b[q + 1] + part - 1) / part; c++, k++)
                    if (k < total) /* more would be a bug of the partition, reported below */
                        z->at[z->first[i] + (int64_t)c] = (int64_t)k;
        }
    }
    z->part_bounds[w] = k;
    if (k != total) /* the blocks do not fall on parts: a bug of the partition */
        return amp_fail(err, AMP_ERR_INTERNAL, "this is a bug: report it with the model's config",
                        "dist.zero 1: the ranks' blocks cover %zu of the gradients' %zu parts", k, total);
    for (int i = 0; i < n; i++) {
        const struct tensor *g = &m->params[i]->grad;
        const size_t *b = z->blocks + (size_t)i * w1;
        struct tensor *v = &z->views[i];
        *v = *g; /* this rank's block, flat: starts at a part boundary of the parameter */
        v->data = (float *)g->data + b[z->rank];
        v->ndim = 1;
        for (int dd = 0; dd < TENSOR_MAX_DIMS; dd++)
            v->shape[dd] = 1;
        v->numel = b[z->rank + 1] - b[z->rank];
        v->shape[0] = (int64_t)v->numel;
        z->view_ptrs[i] = v;
    }
    return AMP_OK;
}

enum amp_status zero_plan_init(struct zero_plan *z, struct dist *d, const struct model *m, struct dist_overlap *o,
                               int zero, bool whole_gradient, bool masters_sharded, struct amp_error *err)
{
    *z = (struct zero_plan){0};
    struct comm *c = d->comm;
    struct backend *be = d->be;
    if (zero != 1 || c->world < 2)
        return AMP_OK;
    int n = m->nparams, w = c->world;
    size_t w1 = (size_t)w + 1, part = be->grad_part_numel;
    *z = (struct zero_plan){.sharded = true, .world = w, .rank = c->rank, .nparams = n};
    z->blocks = calloc((size_t)(n ? n : 1) * w1, sizeof *z->blocks);
    if (!z->blocks)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory planning the optimizer's shards (dist.zero 1)");
    /* the communicator's collectives on blocks take the memory its reduce_sum takes (comm.h): the backend's where it
     * reduces it directly (mpi on the CPU, nccl on CUDA), a host copy of it otherwise (d->stage: mpi on CUDA) */
    z->aligned = part > 0 && be->grad_stats_parts && be->grad_stats_combine && d->active &&
                 (d->stage || be->host_memory || c->device_memory) && c->reduce_scatter_blocks &&
                 c->reduce_scatter_start && c->all_gather_blocks && c->host_gather_blocks && grads_in_flat(m) &&
                 m->grad_flat_count > 0;
    if (z->aligned) {
        z->nbuckets = o ? dist_overlap_buckets(o) : 1;
        size_t parts = 1;
        for (int i = 0; i < n; i++)
            parts += (m->params[i]->grad.numel + part - 1) / part;
        struct cut_at *cand = malloc(parts * sizeof *cand);
        size_t *po = malloc(2 * (size_t)(n ? n : 1) * sizeof *po);
        double *weight = malloc((size_t)(n ? n : 1) * sizeof *weight), *held = calloc((size_t)w, sizeof *held);
        z->bucket_at = calloc((size_t)z->nbuckets, sizeof *z->bucket_at);
        z->buckets = calloc((size_t)z->nbuckets * w1, sizeof *z->buckets);
        if (!cand || !po || !weight || !held || !z->bucket_at || !z->buckets) {
            free(cand);
            free(po);
            free(weight);
            free(held);
            return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory planning the gradients' blocks (dist.zero 1)");
        }
        /* what a rank holds for an element it owns: its moments (two, AdamW's), and its master where that is
         * sharded (zero_shard_masters) rather than whole on every rank */
        for (int i = 0; i < n; i++)
            weight[i] = 2.0 + (masters_sharded && param_master_private(m->params[i]) ? 1.0 : 0.0);
        for (int k = 0; k < z->nbuckets; k++) {
            size_t begin = 0, end = m->grad_flat_count;
            if (o)
                dist_overlap_bucket(o, k, &begin, &end);
            z->bucket_at[k] = begin;
            cut_bucket(m, begin, end, part, w, weight, held, cand, po, z->buckets + (size_t)k * w1);
        }
        free(cand);
        free(po);
        free(weight);
        free(held);
        for (int i = 0; i < n && z->aligned; i++)
            z->aligned = param_blocks(m, m->params[i], z, z->blocks + (size_t)i * w1);
    }
    if (!z->aligned) /* comm_shard's blocks, the gradients all-reduced */
        for (int i = 0; i < n; i++)
            for (int q = 0; q < w; q++)
                comm_shard(m->params[i]->grad.numel, w, q, &z->blocks[(size_t)i * w1 + q],
                           &z->blocks[(size_t)i * w1 + q + 1]);
    z->exact = z->aligned && !whole_gradient;
    if (!z->exact)
        return AMP_OK;
    enum amp_status st = plan_parts(z, d, m, part, err);
    if (st == AMP_OK && o)
        dist_overlap_scatter_only(o, z->buckets, w);
    return st;
}

void zero_plan_free(struct zero_plan *z)
{
    if (!z)
        return;
    free(z->bucket_at);
    free(z->buckets);
    free(z->blocks);
    free(z->first);
    if (z->be && !z->be->host_memory)
        z->be->free(z->be, z->gathered);
    else
        free(z->gathered);
    free(z->staged);
    free(z->part_bounds);
    free(z->at);
    free(z->views);
    free(z->view_ptrs);
    *z = (struct zero_plan){0};
}

/* Bucket k's reduce-scatter onto the plan's blocks; through a host copy on a device with mpi (the bucket down, this
 * rank's block of it up again: the other blocks are not read). */
static void scatter_bucket(struct zero_plan *z, struct dist *d, float *bucket, int k)
{
    struct comm *c = d->comm;
    const size_t *cuts = z->buckets + (size_t)k * (size_t)(z->world + 1);
    if (!d->stage) {
        c->reduce_scatter_blocks(c, bucket, cuts, COMM_F32);
        return;
    }
    size_t bytes = cuts[z->world] * sizeof(float), lo = cuts[z->rank], hi = cuts[z->rank + 1];
    float *h = dist_stage(d, bytes);
    if (!h) {
        cannot(d, "the reduce-scatter of the gradients", bytes);
        return;
    }
    d->be->download(d->be, h, bucket, bytes);
    c->reduce_scatter_blocks(c, h, cuts, COMM_F32);
    if (hi > lo)
        d->be->upload(d->be, bucket + lo, h + lo, (hi - lo) * sizeof(float));
}

void zero_reduce_gradients(struct zero_plan *z, struct dist *d, struct model *m)
{
    if (!z->exact) {
        dist_reduce_sum(d, m->grad_flat, m->grad_flat_count, COMM_F32);
        return;
    }
    d->reduces++;
    for (int k = 0; k < z->nbuckets; k++)
        scatter_bucket(z, d, m->grad_flat + z->bucket_at[k], k);
}

/* Every rank's parts in `gathered` to every rank: directly in the memory the communicator takes, else (mpi on a
 * device) this rank's down, the all-gather on the host, all of them up. */
static void gather_parts(struct zero_plan *z, struct dist *d)
{
    struct comm *c = d->comm;
    const size_t es = sizeof *z->gathered;
    if (!d->stage) {
        c->all_gather_blocks(c, z->gathered, z->part_bounds, es);
        return;
    }
    size_t lo = z->part_bounds[z->rank], hi = z->part_bounds[z->rank + 1], total = z->part_bounds[z->world];
    if (hi > lo)
        d->be->download(d->be, z->staged + lo, z->gathered + lo, (hi - lo) * es);
    c->all_gather_blocks(c, z->staged, z->part_bounds, es);
    if (total)
        d->be->upload(d->be, z->gathered, z->staged, total * es);
}

void zero_grad_stats(struct zero_plan *z, struct dist *d, const struct tensor *const *grads, int n,
                     struct grad_check *out, int64_t *counts)
{
    struct backend *be = d->be;
    if (!z->exact) {
        be->grad_stats(be, grads, n, out, counts);
        return;
    }
    (void)grads; /* the same tensors as the plan's views of this rank's blocks */
    (void)n;
    /* this rank's parts straight into its place of the all-gather's buffer; the combine reads each part where the
     * all-gather left it (z->at) */
    be->grad_stats_parts(be, z->view_ptrs, z->nparams, z->gathered + z->part_bounds[z->rank]);
    gather_parts(z, d);
    be->grad_stats_combine(be, z->gathered, z->first, z->at, z->nparams, out, counts);
}
