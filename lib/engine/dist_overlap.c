/*
 * dist_overlap.c — the gradient buckets of a data-parallel step and the backward hook that starts them
 * (dist_overlap.h).
 */
#include "dist_overlap.h"

#include <stdlib.h>

struct bucket {
    size_t begin, end; /* floats of grad_flat: [begin, end), from a parameter's first float */
};

struct dist_overlap {
    struct dist *d;
    float *grad_flat;
    struct bucket *b; /* in the order they start: from the end of grad_flat to its start */
    int n;
    int next;                   /* buckets started in this step's backward */
    struct comm_request **req;  /* req[i]: bucket i's reduce, while started */
    const size_t *scatter;      /* else NULL: bucket i reduce-scattered onto scatter[i (world + 1) ..] only */
    int world;
    struct backward_hook hook;
};

/* MiB of fp32 as a number of floats, at least one. */
static size_t floats_of_mb(double mb)
{
    double n = mb * (1024.0 * 1024.0 / sizeof(float));
    return n < 1.0 ? 1 : (size_t)n;
}

static void start(struct dist_overlap *o, int i)
{
    struct comm *c = o->d->comm;
    o->d->reduces++;
    float *at = o->grad_flat + o->b[i].begin;
    o->req[i] = o->scatter ? c->reduce_scatter_start(c, at, o->scatter + (size_t)i * (size_t)(o->world + 1), COMM_F32)
                           : c->reduce_start(c, at, o->b[i].end - o->b[i].begin, COMM_F32);
}

/* The hook: the gradients from `first`'s to grad_flat's end are final, so every bucket that lies there starts. */
static void grads_final_hook(void *user, const struct param *first)
{
    struct dist_overlap *o = user;
    size_t from = (size_t)((const float *)first->grad.data - o->grad_flat);
    while (o->next < o->n && o->b[o->next].begin >= from)
        start(o, o->next++);
    if (o->next > 0) /* MPI moves started reduces only inside its calls (without the progress thread: here) */
        o->d->comm->reduce_progress(o->d->comm);
}

/* Whether the parameters' gradients lie in grad_flat in the model's order, the first at its start (else nothing
 * overlaps: the hook's "this parameter and every one after it" would not be a range of grad_flat). */
static bool grads_in_order(const struct model *m)
{
    size_t prev = 0;
    for (int k = 0; k < m->nparams; k++) {
        size_t off = (size_t)((const float *)m->params[k]->grad.data - m->grad_flat);
        if ((k == 0 && off != 0) || off < prev || off >= m->grad_flat_count)
            return false;
        prev = off;
    }
    return m->nparams > 0;
}

enum amp_status dist_overlap_new(struct dist_overlap **out, struct dist *d, const struct model *m, double bucket_mb,
                                 struct amp_error *err)
{
    *out = NULL;
    struct comm *c = d->comm;
    if (bucket_mb <= 0 || !d->active || d->stage || !c->reduce_start || !c->reduce_progress || !c->reduce_wait ||
        !m->grad_flat || m->grad_flat_count == 0)
        return AMP_OK;
    struct dist_overlap *o = calloc(1, sizeof *o);
    if (o) {
        o->b = calloc((size_t)m->nparams, sizeof *o->b);
        o->req = calloc((size_t)m->nparams, sizeof *o->req);
    }
    if (!o || !o->b || !o->req) {
        dist_overlap_free(o);
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory planning the gradient buckets");
    }
    if (!grads_in_order(m)) {
        dist_overlap_free(o);
        return AMP_OK;
    }
    double first_mb = bucket_mb < DIST_FIRST_BUCKET_MB ? bucket_mb : DIST_FIRST_BUCKET_MB;
    size_t want = floats_of_mb(first_mb), end = m->grad_flat_count;
    for (int k = m->nparams - 1; k >= 0; k--) {
        size_t begin = (size_t)((const float *)m->params[k]->grad.data - m->grad_flat);
        if (end - begin < want && begin > 0)
            continue;
        o->b[o->n++] = (struct bucket){.begin = begin, .end = end};
        end = begin;
        want = floats_of_mb(bucket_mb);
    }
    o->d = d;
    o->grad_flat = m->grad_flat;
    o->hook = (struct backward_hook){.grads_final = grads_final_hook, .user = o};
    *out = o;
    return AMP_OK;
}

void dist_overlap_free(struct dist_overlap *o)
{
    if (!o)
        return;
    free(o->b);
    free(o->req);
    free(o);
}

const struct backward_hook *dist_overlap_hook(struct dist_overlap *o)
{
    return o ? &o->hook : NULL;
}

bool dist_overlap_finish(struct dist_overlap *o)
{
    if (!o)
        return false;
    while (o->next < o->n) /* a backward that did not tell every parameter: the rest now, in the same order */
        start(o, o->next++);
    struct comm *c = o->d->comm;
    for (int i = 0; i < o->n; i++) {
        c->reduce_wait(c, o->req[i]);
        o->req[i] = NULL;
    }
    o->next = 0;
    return true;
}

void dist_overlap_scatter_only(struct dist_overlap *o, const size_t *bounds, int world)
{
    o->scatter = bounds;
    o->world = world;
}

int dist_overlap_buckets(const struct dist_overlap *o)
{
    return o ? o->n : 0;
}

void dist_overlap_bucket(const struct dist_overlap *o, int i, size_t *begin, size_t *end)
{
    *begin = o->b[i].begin;
    *end = o->b[i].end;
}
