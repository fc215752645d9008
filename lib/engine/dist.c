/*
 * dist.c — the data-parallel collectives of a run (dist.h), on the communicator and backend tables.
 */
#define _POSIX_C_SOURCE 200809L
#include "dist.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h> /* gethostname */

#include "data.h"   /* data_fingerprint */
#include "digest.h" /* digest_bytes */
#include "model.h"  /* struct model, struct param, struct buffer */
#include "scaler.h" /* struct scaler */
#include "test_switches.h" /* test_switch_perturb */

enum amp_status dist_init(struct dist *d, struct comm *c, struct backend *be, const struct dist_config *cfg,
                          struct amp_error *err)
{
    memset(d, 0, sizeof *d);
    d->comm = c;
    d->be = be;
    enum dist_backend want = cfg->backend;
    if (want == DIST_NONE && c->world > 1)
        return amp_fail(err, AMP_ERR_CONFIG, "set dist.backend: auto (or mpi/nccl), or run without mpirun",
                        "dist.backend is none, but the job has %d ranks: each would train alone and all would write "
                        "one run directory", c->world);
    bool cuda = !be->host_memory;
    if (want == DIST_NCCL && !comm_have_nccl())
        return amp_fail(err, AMP_ERR_CONFIG, "set dist.backend: mpi (or auto), or rebuild where CUDA, MPI and NCCL "
                        "are found (ampTrain --version says what was built)",
                        "dist.backend is nccl, but this ampTrain was built without NCCL");
    if (want == DIST_NCCL && !cuda)
        return amp_fail(err, AMP_ERR_CONFIG, "set run.device: cuda, or dist.backend: mpi (or auto)",
                        "dist.backend is nccl, but the device is %s: NCCL reduces GPU memory only", be->name);
    bool nccl = cuda && comm_have_nccl() && (want == DIST_NCCL || (want == DIST_AUTO && c->world > 1));
    if (nccl) {
        enum amp_status st = comm_use_nccl(c, be, err);
        if (st != AMP_OK)
            return st;
    }
    d->active = c->world > 1 || nccl;
    /* the communicator reduces host memory but the backend's is elsewhere: stage through the host */
    d->stage = !c->device_memory && !be->host_memory;
    return AMP_OK;
}

void dist_free(struct dist *d)
{
    if (!d)
        return;
    if (d->comm)
        comm_release_nccl(d->comm);
    free(d->stage_buf);
    d->stage_buf = NULL;
}

void *dist_stage(struct dist *d, size_t bytes)
{
    if (bytes > d->stage_cap) {
        void *p = realloc(d->stage_buf, bytes);
        if (!p)
            return NULL;
        d->stage_buf = p;
        d->stage_cap = bytes;
    }
    return d->stage_buf;
}

/* buf (backend memory) reduced with `op` through a host copy: one download, the MPI all-reduce, one upload. */
static void host_reduce(struct dist *d, void *buf, size_t count, enum comm_dtype dt, enum comm_op op)
{
    size_t bytes = count * (dt == COMM_F32 ? 4 : 8);
    void *h = dist_stage(d, bytes);
    if (!h) { /* every rank must still call the collective: abort the job rather than hang it */
        fprintf(stderr, "[rank %d] ampTrain: error: out of memory staging %zu bytes for the all-reduce\n",
                d->comm->rank, bytes);
        d->comm->abort(d->comm, AMP_ERR_INTERNAL);
        return;
    }
    d->be->download(d->be, h, buf, bytes);
    d->comm->host_allreduce(d->comm, h, count, dt, op);
    d->be->upload(d->be, buf, h, bytes);
}

void dist_reduce_sum(struct dist *d, void *buf, size_t count, enum comm_dtype dt)
{
    d->reduces++;
    if (!d->active)
        return;
    if (!d->stage) {
        d->comm->reduce_sum(d->comm, buf, count, dt);
        return;
    }
    host_reduce(d, buf, count, dt, COMM_SUM);
}

void dist_reduce_max_f32(struct dist *d, float *buf, size_t count)
{
    d->reduces++;
    if (!d->active || count == 0)
        return;
    if (d->be->host_memory) {
        d->comm->host_allreduce(d->comm, buf, count, COMM_F32, COMM_MAX);
        return;
    }
    host_reduce(d, buf, count, COMM_F32, COMM_MAX);
}

/* ---- where the ranks run ------------------------------------------------------------------------ */

/* A device name's kind and index: "cuda:3" is ("cuda:", 3); "cpu" is ("cpu", -1). */
static long device_index(const char *dev, size_t *kind_len)
{
    size_t n = strlen(dev), k = n;
    while (k > 0 && dev[k - 1] >= '0' && dev[k - 1] <= '9')
        k--;
    *kind_len = k;
    return k < n ? strtol(dev + k, NULL, 10) : -1;
}

/* Rank r + 1 continues the range of rank r: the same host, the same kind of device, and the next index (or none). */
static bool continues(const struct dist_place *a, const struct dist_place *b)
{
    size_t ka, kb;
    long ia = device_index(a->device, &ka), ib = device_index(b->device, &kb);
    return strcmp(a->host, b->host) == 0 && ka == kb && strncmp(a->device, b->device, ka) == 0 &&
           (ia < 0 ? ib < 0 && strcmp(a->device, b->device) == 0 : ib == ia + 1);
}

/* Appends to buf[*used..len), keeping *used <= len; false once it is full. */
static bool append(char *buf, size_t len, size_t *used, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static bool append(char *buf, size_t len, size_t *used, const char *fmt, ...)
{
    if (*used + 1 >= len)
        return false;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf + *used, len - *used, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= len - *used) {
        *used = len;
        return false;
    }
    *used += (size_t)n;
    return true;
}

/* "ranks 0-7: cuda:0-7" or "rank 3: cpu" for the ranks a..b of all (one range). */
static bool append_range(char *buf, size_t len, size_t *used, const struct dist_place *all, int a, int b)
{
    if (a == b)
        return append(buf, len, used, "rank %d: %s", a, all[a].device);
    size_t k;
    long first = device_index(all[a].device, &k);
    if (first < 0)
        return append(buf, len, used, "ranks %d-%d: %s", a, b, all[a].device);
    return append(buf, len, used, "ranks %d-%d: %.*s%ld-%ld", a, b, (int)k, all[a].device, first,
                  first + (long)(b - a));
}

void dist_format_hosts(const struct dist_place *all, int world, char *buf, size_t len)
{
    if (len == 0)
        return;
    buf[0] = '\0';
    bool *listed = calloc((size_t)(world > 0 ? world : 1), sizeof *listed);
    if (!listed) {
        snprintf(buf, len, "hosts: (out of memory)");
        return;
    }
    size_t used = 0;
    bool room = append(buf, len, &used, "hosts:");
    for (int h = 0; h < world && room; h++) { /* each host at its first rank, with all of its ranks */
        if (listed[h])
            continue;
        room = append(buf, len, &used, "%s %s (", h ? "," : "", all[h].host);
        const char *sep = "";
        for (int r = h; r < world && room; r++) {
            if (listed[r] || strcmp(all[r].host, all[h].host) != 0)
                continue;
            int end = r;
            while (end + 1 < world && continues(&all[end], &all[end + 1]))
                end++;
            for (int q = r; q <= end; q++)
                listed[q] = true;
            room = append(buf, len, &used, "%s", sep) && append_range(buf, len, &used, all, r, end);
            sep = ", ";
        }
        room = room && append(buf, len, &used, ")");
    }
    if (!room && len > 4)
        memcpy(buf + len - 4, "...", 4);
    free(listed);
}

void dist_describe_hosts(struct comm *c, const char *device, char *buf, size_t len)
{
    struct dist_place me;
    memset(&me, 0, sizeof me);
    if (gethostname(me.host, sizeof me.host - 1) != 0)
        snprintf(me.host, sizeof me.host, "(unknown host)");
    snprintf(me.device, sizeof me.device, "%s", device);
    struct dist_place *all = calloc((size_t)c->world, sizeof *all);
    if (!all) { /* the others are in the gather below: end the job rather than leave them waiting */
        fprintf(stderr, "[rank %d] ampTrain: error: out of memory gathering the ranks' hosts\n", c->rank);
        c->abort(c, AMP_ERR_INTERNAL);
        snprintf(buf, len, "hosts: (unknown)");
        return;
    }
    c->host_allgather(c, &me, all, sizeof me);
    dist_format_hosts(all, c->world, buf, len);
    free(all);
}

/* ---- agreeing on errors and signals -------------------------------------------------------------- */

struct outcome {
    int32_t status;
    int32_t sig;
};

static enum amp_status agree(struct comm *c, enum amp_status st, int *sig, struct amp_error *err)
{
    if (c->world == 1)
        return st;
    struct outcome mine = {.status = (int32_t)st, .sig = sig ? *sig : 0};
    struct outcome *all = calloc((size_t)c->world, sizeof *all);
    if (!all) {
        fprintf(stderr, "[rank %d] ampTrain: error: out of memory agreeing on a step's outcome\n", c->rank);
        c->abort(c, AMP_ERR_INTERNAL);
        return AMP_ERR_INTERNAL;
    }
    c->host_allgather(c, &mine, all, sizeof mine);
    int failed = -1;
    for (int r = 0; r < c->world; r++) {
        if (sig && !*sig && all[r].sig)
            *sig = all[r].sig;
        if (failed < 0 && all[r].status != AMP_OK)
            failed = r;
    }
    free(all);
    if (failed < 0)
        return AMP_OK;
    struct amp_error e;
    memset(&e, 0, sizeof e);
    if (failed == c->rank) {
        e = *err;
        char msg[sizeof e.msg];
        snprintf(msg, sizeof msg, "%s", e.msg);
        if (failed != 0) /* rank 0 prints it: say whose it is */
            snprintf(e.msg, sizeof e.msg, "rank %d: %.2000s", c->rank, msg);
    }
    c->host_bcast(c, &e, sizeof e, failed);
    e.agreed = 1;
    *err = e;
    return e.code;
}

enum amp_status comm_agree(struct comm *c, enum amp_status st, struct amp_error *err)
{
    return agree(c, st, NULL, err);
}

enum amp_status comm_agree_stop(struct comm *c, enum amp_status st, int *sig, struct amp_error *err)
{
    return agree(c, st, sig, err);
}

int dist_threads(const struct comm *c, const struct run_config *run)
{
    int n = config_threads(run);
    return n > 0 ? n : c->cpus;
}

/* ---- config and replica checks ------------------------------------------------------------------- */

/* all[r * stride + idx] is rank r's value: list the ranks whose value differs from rank 0's into buf.
 * Returns whether all are equal. */
static bool same_on_all(struct comm *c, const uint64_t *all, size_t stride, size_t idx, char *buf, size_t len)
{
    bool same = true;
    size_t used = 0;
    buf[0] = '\0';
    for (int r = 1; r < c->world; r++)
        if (all[(size_t)r * stride + idx] != all[idx]) {
            same = false;
            if (used < len)
                used += (size_t)snprintf(buf + used, len - used, "%s%d", used ? ", " : "", r);
        }
    return same;
}

/* Gathers every rank's h: whether all equal rank 0's; if not, the ranks that differ listed into ranks. */
static bool same_value(struct comm *c, uint64_t h, char *ranks, size_t len)
{
    uint64_t *all = calloc((size_t)c->world, sizeof *all);
    if (!all) { /* the others wait in the allgather: end the job */
        c->abort(c, AMP_ERR_INTERNAL);
        snprintf(ranks, len, "(unknown: out of memory)");
        return false;
    }
    c->host_allgather(c, &h, all, sizeof h);
    bool same = same_on_all(c, all, 1, 0, ranks, len);
    free(all);
    return same;
}

enum amp_status dist_check_config(struct comm *c, const struct config *cfg, struct amp_error *err)
{
    char ranks[256];
    if (c->world > 1) {
        char *yaml = config_to_yaml_string(cfg);
        uint64_t h = yaml ? digest_bytes(DIGEST_INIT, yaml, strlen(yaml)) : 0;
        free(yaml);
        if (!same_value(c, h, ranks, sizeof ranks))
            return amp_fail(err, AMP_ERR_CONFIG,
                            "give every rank the same config and the same KEY=VALUE overrides (compare 'ampTrain "
                            "check' on each)",
                            "%s: the resolved config of rank%s %s differs from rank 0's: data-parallel ranks must run "
                            "one config",
                            cfg->source, strchr(ranks, ',') ? "s" : "", ranks);
    }
    comm_set_timeout(c, cfg->dist.timeout_s); /* one config: every rank has its limit (comm_watch.h) */
    return AMP_OK;
}

enum amp_status dist_check_same(struct comm *c, uint64_t h, enum amp_status code, const char *what, const char *hint,
                                struct amp_error *err)
{
    char ranks[256];
    if (c->world == 1 || same_value(c, h, ranks, sizeof ranks))
        return AMP_OK;
    bool many = strchr(ranks, ',') != NULL;
    return amp_fail(err, code, hint, "%s: rank%s %s differ%s from rank 0: data-parallel ranks must agree on it",
                    what, many ? "s" : "", ranks, many ? "" : "s");
}

enum amp_status dist_check_data(struct comm *c, const struct dataset *ds, const char *source, struct amp_error *err)
{
    if (c->world == 1)
        return AMP_OK;
    char what[CFG_STR + 128];
    snprintf(what, sizeof what, "%s: the data (rank 0 read %lld training and %lld test samples)", source,
             (long long)ds->split[SPLIT_TRAIN].n, (long long)ds->split[SPLIT_TEST].n);
    return dist_check_same(c, data_fingerprint(ds), AMP_ERR_DATA, what,
                           "give every rank the same data: each host's copy of the files must be the same, and a "
                           "relative path is read from each rank's working directory",
                           err);
}

/* What the replicas hold alike of a parameter: its master, or its copy where the master is this rank's block alone
 * (dist.zero 1; the blocks have no replica, and the copy gathered from them is whole on every rank). */
static const struct tensor *replicated(const struct param *p)
{
    return p->master_block ? &p->copy : &p->master;
}

static uint64_t hash_tensor(struct dist *d, const struct tensor *t)
{
    size_t bytes = tensor_bytes(t);
    if (d->be->host_memory)
        return digest_bytes(DIGEST_INIT, t->data, bytes);
    void *h = dist_stage(d, bytes);
    if (!h)
        return 0; /* every rank that runs out hashes 0: a difference is still reported */
    d->be->download(d->be, h, t->data, bytes);
    return digest_bytes(DIGEST_INIT, h, bytes);
}

enum amp_status dist_check_replicas(struct dist *d, const struct model *m, const struct scaler *s, int64_t step,
                                    int64_t opt_step, const char *loaded_from, struct amp_error *err)
{
    struct comm *c = d->comm;
    if (c->world == 1)
        return AMP_OK;
    size_t n = (size_t)m->nparams + 1; /* every master (or copy), then the scaler and step counters */
    uint64_t *mine = calloc(n, sizeof *mine), *all = calloc(n * (size_t)c->world, sizeof *all);
    if (!mine || !all) {
        free(mine);
        free(all);
        c->abort(c, AMP_ERR_INTERNAL);
        return AMP_ERR_INTERNAL;
    }
    for (int i = 0; i < m->nparams; i++)
        mine[i] = hash_tensor(d, replicated(m->params[i]));
    const int64_t counters[] = {step, opt_step, s->growth_tracker, s->hysteresis_left, s->consecutive_skips,
                                s->skips_total, s->last_overflow_step};
    uint64_t h = digest_bytes(DIGEST_INIT, &s->scale, sizeof s->scale);
    mine[n - 1] = digest_bytes(h, counters, sizeof counters);
    c->host_allgather(c, mine, all, n * sizeof *mine);
    enum amp_status st = AMP_OK;
    char ranks[256];
    for (size_t i = 0; i < n && st == AMP_OK; i++) {
        if (same_on_all(c, all, n, i, ranks, sizeof ranks))
            continue;
        const char *what = i + 1 < n ? m->params[i]->name : "the loss-scaler state";
        const char *s_ = strchr(ranks, ',') ? "s" : "";
        if (loaded_from)
            st = amp_fail(err, AMP_ERR_CKPT,
                          "give every rank the same file: each host's copy must be the same, and a relative path is "
                          "read from each rank's working directory",
                          "the weights loaded from %s differ between ranks: %s on rank%s %s differs from rank 0's",
                          loaded_from, what, s_, ranks);
        else
            st = amp_fail(err, AMP_ERR_UNSTABLE,
                          "this is a bug or a hardware fault: report it with the run's config; continue from the "
                          "last checkpoint with 'ampTrain resume'",
                          "replicas diverged at step %lld: %s on rank%s %s differs from rank 0's", (long long)step,
                          what, s_, ranks);
    }
    free(mine);
    free(all);
    return st;
}

void dist_broadcast_buffers(struct dist *d, struct model *m)
{
    struct comm *c = d->comm;
    if (c->world == 1)
        return;
    for (int i = 0; i < m->nbuffers; i++) {
        struct tensor *t = &m->buffers[i]->t;
        size_t bytes = tensor_bytes(t);
        void *h = d->be->host_memory ? t->data : dist_stage(d, bytes);
        if (!h) {
            c->abort(c, AMP_ERR_INTERNAL);
            return;
        }
        if (!d->be->host_memory)
            d->be->download(d->be, h, t->data, bytes);
        c->host_bcast(c, h, bytes, 0);
        if (!d->be->host_memory)
            d->be->upload(d->be, t->data, h, bytes);
    }
}

void dist_test_perturb(struct dist *d, struct model *m, int64_t step)
{
    if (m->nparams == 0 || !test_switch_perturb(d->comm->rank, step))
        return;
    struct tensor *w = (struct tensor *)replicated(m->params[0]); /* what the replica check compares */
    if (w->numel == 0)
        return;
    if (w->dtype == DT_FP32) {
        float x;
        d->be->download(d->be, &x, w->data, sizeof x);
        x += 1e-3f;
        d->be->upload(d->be, w->data, &x, sizeof x);
    } else { /* a 16-bit copy: its last bit */
        unsigned char x;
        d->be->download(d->be, &x, w->data, 1);
        x ^= 1;
        d->be->upload(d->be, w->data, &x, 1);
    }
    fprintf(stderr, "[rank %d] ampTrain: test switch AMPTRAIN_TEST_PERTURB: %s[0] perturbed after step %lld\n",
            d->comm->rank, m->params[0]->name, (long long)step);
}
