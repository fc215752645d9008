/*
 * dist_overlap.c — the gradient buckets of a data-parallel step and the backward hook that starts them
 * (dist_overlap.h).
 */
#include "dist_overlap.h"

#include <stdint.h> /* SIZE_MAX */
#include <stdlib.h>

struct bucket {
    size_t begin, end; /* floats of grad_flat: [begin, end) */
    int ready;         /* the layer after whose backward every gradient in it is final: its lowest */
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

static void layer_done(void *user, int layer)
{
    struct dist_overlap *o = user;
    while (o->next < o->n && o->b[o->next].ready >= layer)
        start(o, o->next++);
    if (o->next > 0) /* MPI moves started reduces only inside its calls: here, between layers */
        o->d->comm->reduce_progress(o->d->comm);
}

/* The first float of each layer's gradients in grad_flat (SIZE_MAX: the layer has no parameters); false where the
 * parameters are not laid out in layer order (then nothing overlaps). */
static bool layer_starts(const struct model *m, size_t *first)
{
    for (int i = 0; i < m->nlayers; i++)
        first[i] = SIZE_MAX;
    size_t prev = 0;
    for (int k = 0; k < m->nparams; k++) {
        const struct param *p = m->params[k];
        size_t off = (size_t)((const float *)p->grad.data - m->grad_flat);
        if (p->layer < 0 || p->layer >= m->nlayers || off < prev || off >= m->grad_flat_count)
            return false;
        if (first[p->layer] == SIZE_MAX)
            first[p->layer] = off;
        prev = off;
    }
    return m->nparams > 0 && first[m->params[0]->layer] == 0;
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
    size_t *first = calloc((size_t)m->nlayers, sizeof *first);
    if (o) {
        o->b = calloc((size_t)m->nlayers, sizeof *o->b);
        o->req = calloc((size_t)m->nlayers, sizeof *o->req);
    }
    if (!o || !first || !o->b || !o->req) {
        free(first);
        dist_overlap_free(o);
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory planning the gradient buckets");
    }
    if (!layer_starts(m, first)) {
        free(first);
        dist_overlap_free(o);
        return AMP_OK;
    }
    double first_mb = bucket_mb < DIST_FIRST_BUCKET_MB ? bucket_mb : DIST_FIRST_BUCKET_MB;
    size_t want = floats_of_mb(first_mb), end = m->grad_flat_count;
    for (int i = m->nlayers - 1; i >= 0; i--) {
        size_t begin = first[i];
        if (begin == SIZE_MAX || (end - begin < want && begin > 0))
            continue;
        o->b[o->n++] = (struct bucket){.begin = begin, .end = end, .ready = i};
        end = begin;
        want = floats_of_mb(bucket_mb);
    }
    free(first);
    o->d = d;
    o->grad_flat = m->grad_flat;
    o->hook = (struct backward_hook){.layer_done = layer_done, .user = o};
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
    while (o->next < o->n) /* a backward that did not tell every layer: the rest now, in the same order */
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
