/*
 * fp8.c — the model's fp8 state: slots registered while the model is built, their scales and amax histories
 * in backend memory, and the delayed recipe's update after a step. See fp8.h.
 */
#include "fp8.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h" /* struct backend, fp8_update_args */

enum amp_status fp8_add_slot(struct fp8_state *st, bool backward, const char *name, struct fp8_slot *out,
                             struct amp_error *err)
{
    struct fp8_group *g = backward ? &st->bwd : &st->fwd;
    char (*names)[96] = realloc(g->names, (size_t)(g->n + 1) * sizeof *names);
    if (!names)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory registering fp8 tensor %s", name);
    g->names = names;
    snprintf(g->names[g->n], sizeof g->names[g->n], "%s", name);
    g->dt = backward && st->recipe != FP8_BLOCKWISE ? DT_FP8_E5M2 : DT_FP8_E4M3; /* blockwise: E4M3 throughout */
    *out = (struct fp8_slot){ .g = g, .index = g->n };
    g->n++;
    return AMP_OK;
}

enum amp_status fp8_add_product(struct fp8_state *st, const char *name, int64_t k, int64_t n, bool fp8,
                                struct amp_error *err)
{
    struct fp8_product *p = realloc(st->products, (size_t)(st->nproducts + 1) * sizeof *p);
    if (!p)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory registering fp8 product %s", name);
    st->products = p;
    p += st->nproducts++;
    snprintf(p->name, sizeof p->name, "%s", name);
    p->k = k;
    p->n = n;
    p->fp8 = fp8;
    return AMP_OK;
}

float fp8_group_max(const struct fp8_group *g)
{
    return fp8_max(g->dt == DT_FP8_E5M2 ? FP8_E5M2 : FP8_E4M3);
}

static enum amp_status group_alloc(struct fp8_group *g, const struct fp8_state *st, struct backend *be,
                                   struct amp_error *err)
{
    if (g->n == 0)
        return AMP_OK;
    size_t n = (size_t)g->n, rows = st->recipe == FP8_DELAYED ? (size_t)st->len : 0;
    g->scale = be->alloc(be, n * sizeof(float));
    g->scale_inv = be->alloc(be, n * sizeof(float));
    g->history = rows ? be->alloc(be, rows * n * sizeof(float)) : NULL;
    g->pending = rows ? be->alloc(be, n * sizeof(float)) : NULL;
    float *ones = malloc(n * sizeof(float));
    if (!g->scale || !g->scale_inv || (rows && (!g->history || !g->pending)) || !ones) {
        free(ones);
        return amp_fail(err, AMP_ERR_INTERNAL, "lower precision.fp8.amax_history_len",
                        "out of memory allocating the fp8 scales and amax histories (%zu tensors, %zu rows)", n, rows);
    }
    for (size_t i = 0; i < n; i++)
        ones[i] = 1.0f;
    be->upload(be, g->scale, ones, n * sizeof(float));
    be->upload(be, g->scale_inv, ones, n * sizeof(float));
    free(ones);
    if (rows) {
        int64_t count = (int64_t)(rows * n);
        struct tensor h = { .data = g->history, .dtype = DT_FP32, .ndim = 1, .shape = {count, 1, 1, 1},
                            .numel = (size_t)count, .be = be };
        be->zero(be, &h);
        struct tensor p = { .data = g->pending, .dtype = DT_FP32, .ndim = 1, .shape = {g->n, 1, 1, 1},
                            .numel = n, .be = be };
        be->zero(be, &p);
    }
    return AMP_OK;
}

enum amp_status fp8_alloc(struct fp8_state *st, struct backend *be, struct amp_error *err)
{
    st->be = be;
    enum amp_status s = group_alloc(&st->fwd, st, be, err);
    if (s == AMP_OK)
        s = group_alloc(&st->bwd, st, be, err);
    return s;
}

static void group_free(struct fp8_group *g, struct backend *be)
{
    if (be) {
        if (g->scale)
            be->free(be, g->scale);
        if (g->scale_inv)
            be->free(be, g->scale_inv);
        if (g->history)
            be->free(be, g->history);
        if (g->pending)
            be->free(be, g->pending);
    }
    free(g->names);
    *g = (struct fp8_group){ 0 };
}

void fp8_free(struct fp8_state *st)
{
    group_free(&st->fwd, st->be);
    group_free(&st->bwd, st->be);
    free(st->products);
    st->products = NULL;
    st->nproducts = 0;
}

static int row_of(const struct fp8_state *st, int64_t step)
{
    return (int)(step % st->len);
}

struct fp8_pass fp8_pass_of(struct fp8_state *st, int64_t step, bool training)
{
    struct fp8_pass p = { 0 };
    if (training) {
        st->weights++;
        p.weights = st->recast_weights ? 0 : st->weights;
    }
    (void)step; /* the casts raise the pending amaxes, the same place every step: fp8_step_end files them */
    if (training && st->recipe == FP8_DELAYED && st->len > 0) {
        p.amax_fwd = st->fwd.pending;
        p.amax_bwd = st->bwd.pending;
    }
    return p;
}

/* The group's part of the update, appended to a (a group with no tensors or no history has none). */
static void group_add_to_update(const struct fp8_group *g, struct fp8_update_args *a)
{
    if (g->n == 0 || !g->history)
        return;
    a->groups[a->ngroups++] = (struct fp8_update_group){
        .scale = g->scale, .scale_inv = g->scale_inv, .history = g->history, .pending = g->pending, .n = g->n,
        .fmax = fp8_group_max(g),
    };
}

void fp8_step_end(const struct fp8_state *st, int64_t step, const int64_t *dev_step)
{
    if (st->recipe != FP8_DELAYED || st->len < 1)
        return;
    struct fp8_update_args a = {
        .len = st->len, .row = row_of(st, step), .most_recent = st->most_recent, .margin = st->margin,
        .step = dev_step,
    };
    group_add_to_update(&st->fwd, &a);
    group_add_to_update(&st->bwd, &a);
    if (a.ngroups > 0) /* one call for every group: one launch on a GPU */
        st->be->fp8_update(st->be, &a);
}
