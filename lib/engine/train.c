/*
 * train.c — the training loop and evaluation. See train.h for the shape of one step.
 */
#define _POSIX_C_SOURCE 200809L
#include "train.h"

#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h> /* getrusage: the peak RSS of training */
#include <unistd.h> /* access, _exit */

#include "backend.h"  /* struct grad_stats */
#include "checkpoint.h" /* ckpt_save, ckpt_load_trainer, ckpt_clean_stale */
#include "init_from.h"  /* init_from_load: model.init_from */
#include "optim.h"    /* optimizer, schedule */
#include "precision.h" /* precision_lowp_dtype, precision_is_loss_scaled */
#include "runlog.h"   /* scale_log.csv, eval.jsonl, progress */
#include "sample.h"   /* run.sample_every */
#include "setup.h"    /* setup_open: backend, threads, data, policy, model */
#include "scaler.h"   /* loss scaler */
#include "test_switches.h" /* test_switch_raise */
#include "zero.h"     /* dist.zero 1: the sharded optimizer state and masters */

static enum amp_status batch_io_init(struct batch_io *io, struct backend *be, const struct dataset *ds, int64_t max_n,
                                     struct amp_error *err)
{
    memset(io, 0, sizeof *io);
    io->max_n = max_n;
    bool text = ds->spec.is_tokens;
    io->label_count = text ? (size_t)ds->sample_numel : 1;
    size_t rows = (size_t)max_n * io->label_count;
    io->idx = malloc((size_t)max_n * sizeof *io->idx);
    io->correct_host = malloc(rows * sizeof *io->correct_host);
    io->loss_host = malloc(rows * sizeof *io->loss_host);
    io->b.labels = be->alloc(be, rows * sizeof(int32_t));
    bool ok = io->idx && io->correct_host && io->loss_host && io->b.labels;
    for (int s = 0; s < BACKEND_STAGING_SLOTS && ok; s++) {
        io->labels_stage[s] = be->host_alloc(be, rows * sizeof(int32_t));
        if (text)
            io->tokens_stage[s] = be->host_alloc(be, rows * sizeof(int32_t));
        else
            io->x_stage[s] = be->host_alloc(be, (size_t)max_n * (size_t)ds->sample_numel * sizeof(float));
        ok = io->labels_stage[s] && (text ? io->tokens_stage[s] != NULL : io->x_stage[s] != NULL);
    }
    if (ok && text) {
        io->b.tokens = be->alloc(be, rows * sizeof(int32_t));
        ok = io->b.tokens != NULL;
    } else if (ok) {
        int64_t shape[4] = {max_n, 1, 1, 1};
        for (int i = 0; i < ds->spec.sample_ndim; i++)
            shape[i + 1] = ds->spec.sample_shape[i];
        ok = tensor_alloc(&io->b.x, be, DT_FP32, 1 + ds->spec.sample_ndim, shape, "input batch", err) == AMP_OK;
    }
    if (!ok)
        return amp_fail(err, AMP_ERR_INTERNAL, "use a smaller data.batch_size", "out of memory allocating batch buffers");
    return AMP_OK;
}

static void batch_io_free(struct batch_io *io, struct backend *be)
{
    free(io->idx);
    for (int s = 0; s < BACKEND_STAGING_SLOTS; s++) {
        be->staging_wait(be, s); /* no copy may still read what is freed */
        be->host_free(be, io->x_stage[s]);
        be->host_free(be, io->tokens_stage[s]);
        be->host_free(be, io->labels_stage[s]);
    }
    free(io->correct_host);
    free(io->loss_host);
    if (io->b.labels)
        be->free(be, io->b.labels);
    if (io->b.tokens)
        be->free(be, io->b.tokens);
    tensor_free(&io->b.x);
}

/* Gather samples idx[0..n) of split s into the next staging set and queue their upload; an array's samples are
 * rows of the split's table, which the backend gathers itself (upload_rows: the CPU on its threads, straight into
 * the batch). The wait is for that set's previous copies (two batches ago), which the device finished long since
 * in a step of any size. */
static void batch_io_load(struct batch_io *io, struct backend *be, const struct dataset *ds, enum split s, int64_t n)
{
    int slot = io->slot;
    io->slot = (io->slot + 1) % BACKEND_STAGING_SLOTS;
    be->staging_wait(be, slot);
    int32_t *tokens = io->tokens_stage[slot], *labels = io->labels_stage[slot];
    data_gather(ds, s, io->idx, n, NULL, tokens, labels);
    size_t rows = (size_t)n * io->label_count;
    be->upload_staged(be, io->b.labels, labels, rows * sizeof(int32_t), slot);
    if (tokens)
        be->upload_staged(be, io->b.tokens, tokens, rows * sizeof(int32_t), slot);
    else
        be->upload_rows(be, io->b.x.data, ds->split[s].x, (size_t)ds->sample_numel * sizeof(float), io->idx, n,
                        io->x_stage[slot], slot);
    io->b.n = n;
    io->b.x.shape[0] = n;
    io->b.x.numel = (size_t)n * (size_t)ds->sample_numel;
}

/* Sum of the loss layer's per-row losses, and of correct predictions. */
static void read_losses(struct model *m, struct batch_io *io, int64_t n, double *loss_sum, int64_t *correct)
{
    struct backend *be = m->be;
    int64_t rows = model_loss_rows(m, n);
    const struct layer *loss = &m->layers[m->nlayers - 1];
    be->download(be, io->loss_host, loss->y.data, (size_t)rows * sizeof(float));
    double s = 0;
    for (int64_t i = 0; i < rows; i++)
        s += io->loss_host[i];
    *loss_sum = s;
    *correct = 0;
    if (m->correct) {
        be->download(be, io->correct_host, m->correct, (size_t)rows * sizeof(int32_t));
        for (int64_t i = 0; i < rows; i++)
            *correct += io->correct_host[i];
    }
}

enum amp_status train_evaluate(struct model *m, const struct dataset *ds, enum split s, struct comm *comm,
                               struct eval_result *out, struct amp_error *err)
{
    if (!comm)
        comm = comm_single();
    int64_t total = ds->split[s].n;
    if (total == 0) /* a loss of nothing, "null" in eval.jsonl, is no evaluation */
        return amp_fail(err, AMP_ERR_DATA,
                        s == SPLIT_TEST ? "set data.val_bin to a token file to evaluate on, or use --split train"
                                        : "check the data files",
                        "no %s samples to evaluate%s", s == SPLIT_TEST ? "test (validation)" : "training",
                        s == SPLIT_TEST && ds->spec.is_tokens ? ": data.val_bin is not set" : "");
    int64_t nb = (total + m->max_batch - 1) / m->max_batch;
    /* per batch: its loss sum, and its correct count (exact in a double) */
    double *sums = calloc((size_t)(2 * nb + 1), sizeof *sums);
    struct batch_io io;
    enum amp_status st = batch_io_init(&io, m->be, ds, m->max_batch, err);
    if (st == AMP_OK && !sums)
        st = amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory evaluating %lld batches", (long long)nb);
    struct step_ctx ctx = {.be = m->be, .policy = &m->policy, .training = false, .grad_seed = NULL};
    for (int64_t b = comm->rank; st == AMP_OK && b < nb; b += comm->world) {
        int64_t start = b * m->max_batch;
        int64_t n = total - start < m->max_batch ? total - start : m->max_batch;
        for (int64_t i = 0; i < n; i++)
            io.idx[i] = start + i;
        batch_io_load(&io, m->be, ds, s, n);
        model_forward(m, &ctx, &io.b);
        int64_t c;
        read_losses(m, &io, n, &sums[b], &c);
        sums[nb + b] = (double)c;
    }
    batch_io_free(&io, m->be);
    if (st == AMP_OK)
        st = m->be->status(m->be, err);
    st = comm_agree(comm, st, err);
    if (st == AMP_OK) /* each batch's entry has one rank's value and zeros: the sum is that value exactly */
        comm->host_allreduce(comm, sums, (size_t)(2 * nb), COMM_F64, COMM_SUM);
    double loss_sum = 0;
    int64_t correct = 0;
    for (int64_t b = 0; st == AMP_OK && b < nb; b++) {
        loss_sum += sums[b];
        correct += (int64_t)sums[nb + b];
    }
    free(sums);
    int64_t rows = model_loss_rows(m, total);
    out->samples = total;
    out->loss = rows ? loss_sum / (double)rows : NAN;
    bool classify = m->correct && !ds->spec.is_tokens;
    out->accuracy = classify && rows ? (double)correct / (double)rows : NAN;
    return st;
}

/* The layer closest to the loss whose parameter gradients went non-finite, as "NAME (inf|nan, N elements)",
 * from one step's counts (grad_stats: Inf counts of every parameter, then NaN counts). */
static void attribute_overflow(const struct model *m, const int64_t *counts, char *buf, size_t len)
{
    buf[0] = '\0';
    const int64_t *n_inf = counts, *n_nan = counts + m->nparams;
    for (int i = m->nparams - 1; i >= 0; i--) {
        if (n_inf[i] == 0 && n_nan[i] == 0)
            continue;
        int layer = m->params[i]->layer;
        int64_t inf = 0, nan = 0;
        for (int j = 0; j < m->nparams; j++)
            if (m->params[j]->layer == layer) {
                inf += n_inf[j];
                nan += n_nan[j];
            }
        const char *kind = inf && nan ? "inf+nan" : inf ? "inf" : "nan";
        snprintf(buf, len, "%s (%s, %lld elements)", m->layers[layer].cfg.name, kind, (long long)(inf + nan));
        return;
    }
}

double eval_metric_value(const struct eval_result *r, enum eval_metric metric)
{
    switch (metric) {
    case METRIC_LOSS:
        return r->loss;
    case METRIC_ACCURACY:
        return r->accuracy;
    case METRIC_PERPLEXITY:
        return exp(r->loss);
    default:
        return NAN;
    }
}

bool eval_watch_update(struct eval_watch *w, double v, int64_t step, double min_delta)
{
    double gain = eval_metric_higher_is_better(w->metric) ? v - w->best : w->best - v;
    bool improved = !isnan(v) && (w->best_step < 0 || gain > min_delta);
    if (improved) {
        w->best = v;
        w->best_step = step;
        w->since = 0;
    } else {
        w->since++;
    }
    return improved;
}

/* Evaluate on the test split (every rank, sharded; each gets the same result in *r); rank 0 writes eval.jsonl and the event file's eval/ scalars.
 * *done: there was data to evaluate on. */
static enum amp_status run_eval(struct trainer *t, int64_t step, struct eval_result *r, bool *done,
                                struct amp_error *err)
{
    struct model *m = &t->model;
    const struct config *cfg = t->cfg;
    const struct dataset *ds = &t->ds;
    *done = false;
    if (ds->split[SPLIT_TEST].n == 0) { /* a token run without data.val_bin: nothing to record */
        if (t->rank == 0 && step == t->total_steps)
            printf("eval: none (no validation data: data.val_bin is not set)\n");
        return AMP_OK;
    }
    if (t->rank == 0 && cfg->precision.mode == PREC_FP8 && !t->fp8_eval_noted) {
        printf("eval: note: an fp8 run evaluates under bf16 autocast (docs/precision.md, \"fp8\")\n");
        t->fp8_eval_noted = true;
    }
    dist_broadcast_buffers(&t->dist, m);
    enum amp_status st = train_evaluate(m, ds, SPLIT_TEST, t->dist.comm, r, err);
    *done = st == AMP_OK;
    if (st != AMP_OK || t->rank != 0)
        return st;
    struct eval_record rec = {
        .step = step,
        .split = "test",
        .autocast = m->policy.enabled,
        .dtype = dtype_name(m->policy.enabled ? m->policy.lowp : DT_FP32),
        .loss = r->loss,
        .accuracy = r->accuracy,
        .perplexity = ds->spec.is_tokens ? exp(r->loss) : NAN,
        .samples = r->samples,
    };
    st = runlog_eval(cfg->run.out_dir, stdout, &rec, err);
    return st == AMP_OK ? runlog_eval_tboard(&t->log, &rec, err) : st;
}

/* An evaluation at the current step that also feeds run.keep_best and run.early_stop. Every rank gets the one
 * evaluation's bits (train_evaluate), so every rank updates its watches alike and all decide together. *best: a new
 * best for keep_best (its checkpoint is to be written at this step); *stop: early_stop's patience ran out. */
static enum amp_status evaluate_and_watch(struct trainer *t, bool *best, bool *stop, struct amp_error *err)
{
    struct eval_result r;
    bool done = false;
    *best = *stop = false;
    enum amp_status st = comm_agree(t->dist.comm, run_eval(t, t->step, &r, &done, err), err);
    if (st != AMP_OK || !done)
        return st;
    const struct run_config *run = &t->cfg->run;
    if (t->best.metric != METRIC_NONE)
        *best = eval_watch_update(&t->best, eval_metric_value(&r, t->best.metric), t->step, 0);
    if (t->stop.metric != METRIC_NONE) {
        eval_watch_update(&t->stop, eval_metric_value(&r, t->stop.metric), t->step, run->early_stop.min_delta);
        *stop = t->stop.since >= run->early_stop.patience;
    }
    return AMP_OK;
}

static size_t align256(size_t n)
{
    return (n + 255) & ~(size_t)255;
}

/* The step rule's parameters, its state, check and window rows in one backend allocation, and their
 * host copies. */
static enum amp_status step_buffers_init(struct trainer *t, struct amp_error *err)
{
    const struct config *cfg = t->cfg;
    t->params = (struct step_params){
        .micro_batches = cfg->accum_steps * t->world,
        .max_norm = cfg->clip.max_norm,
        .inf_norm = cfg->clip.norm_type == INFINITY,
        .beta1 = cfg->optim.betas[0],
        .beta2 = cfg->optim.betas[1],
        .weight_decay = (float)cfg->optim.weight_decay,
        .sgd = cfg->optim.kind == OPTIM_SGD,
        .eps = (float)cfg->optim.eps,
        .momentum = (float)cfg->optim.momentum,
        .nesterov = cfg->optim.nesterov,
        .schedule = optim_schedule_params(&t->opt),
    };
    /* the state's magnitudes are not known before a step has stored them: the first step runs its trial */
    t->bound = (struct state_bound){INFINITY, INFINITY, INFINITY};
    t->window = cfg->run.log_every < TRAIN_MAX_WINDOW ? cfg->run.log_every : TRAIN_MAX_WINDOW;
    size_t w = (size_t)t->window, nc = 2 * (size_t)(t->model.nparams ? t->model.nparams : 1);
    size_t off_check = align256(sizeof(struct step_state));
    size_t off_row = off_check + align256(sizeof(struct grad_check));
    size_t off_row_counts = off_row + align256(sizeof(struct step_row));
    size_t off_rows = off_row_counts + align256(nc * sizeof(int64_t));
    size_t off_counts = off_rows + align256(w * sizeof(struct step_row));
    size_t bytes = off_counts + w * nc * sizeof(int64_t);
    t->dev = t->be->alloc(t->be, bytes);
    t->host = calloc(1, bytes);
    t->pend_epoch = calloc(w, sizeof *t->pend_epoch);
    t->pend_zero_total = calloc(w, sizeof *t->pend_zero_total);
    t->pend_zero_pad = calloc(w, sizeof *t->pend_zero_pad);
    t->recs = calloc(w, sizeof *t->recs);
    if (!t->dev || !t->host || !t->pend_epoch || !t->pend_zero_total || !t->pend_zero_pad || !t->recs)
        return amp_fail(err, AMP_ERR_INTERNAL, "lower run.log_every", "out of memory allocating the step log window");
    t->ncounts = (int64_t)nc;
    t->counts_off = off_counts;
    char *base = t->dev, *host = t->host;
    t->dev_state = (struct step_state *)base;
    t->dev_check = (struct grad_check *)(base + off_check);
    t->dev_row = (struct step_row *)(base + off_row);
    t->dev_row_counts = (int64_t *)(base + off_row_counts);
    t->dev_rows = (struct step_row *)(base + off_rows);
    t->dev_counts = (int64_t *)(base + off_counts);
    t->rows_host = (struct step_row *)(host + off_rows);
    t->counts_host = (int64_t *)(host + off_counts);
    return AMP_OK;
}

enum amp_status trainer_setup(struct trainer *t, const struct config *cfg, struct comm *comm, struct amp_error *err)
{
    memset(t, 0, sizeof *t);
    t->cfg = cfg;
    if (!comm)
        comm = comm_single();
    t->dist.comm = comm;
    t->rank = comm->rank;
    t->world = comm->world;
    /* backend, threads, the communicator on it, every split of the data, the policy and the model for one
     * micro-batch (lib/engine/setup.h), into the trainer, whose teardown frees them */
    struct setup s = {.ds = &t->ds, .model = &t->model};
    enum amp_status st = setup_open(&s, cfg,
                                    &(struct setup_opts){.comm = comm, .announce = true, .tf32 = true,
                                                         .dist = &t->dist, .data = SETUP_DATA_TRAIN,
                                                         .mode = cfg->precision.mode,
                                                         .max_batch = cfg->data.batch_size},
                                    err);
    t->be = s.be;
    if (st != AMP_OK)
        return st;
    int64_t micro = cfg->data.batch_size, per_step = config_global_batch(micro, cfg->accum_steps, t->world);
    if ((st = model_init(&t->model, cfg, cfg->run.seed, err)) != AMP_OK)
        return st;
    model_refresh_copies(&t->model);
    if ((st = dist_overlap_new(&t->overlap, &t->dist, &t->model, cfg->dist.bucket_mb, err)) != AMP_OK)
        return st;

    if ((st = data_sampler_init(&t->sampler, &t->ds, &cfg->data, cfg->run.seed, err)) != AMP_OK)
        return st;
    int64_t per_epoch = sampler_batches_per_epoch(&t->sampler, micro) / (cfg->accum_steps * t->world);
    int64_t samples = 0;
    bool too_many = cfg->run.steps > 0 ? false : __builtin_mul_overflow(cfg->run.epochs, per_epoch, &t->total_steps);
    if (cfg->run.steps > 0)
        t->total_steps = cfg->run.steps;
    if (too_many || __builtin_mul_overflow(t->total_steps, per_step, &samples) || samples > INT64_C(1) << 62)
        return amp_fail(err, AMP_ERR_CONFIG, "lower run.steps or run.epochs",
                        "%s: %s steps of %lld samples (data.batch_size x accum_steps x ranks) are more than 2^62 "
                        "samples", cfg->source, too_many ? "the run's" : "its", (long long)per_step);
    /* dist.zero 1: each rank holds its block of the optimizer state (lib/engine/zero.h) */
    int shards = cfg->dist.zero == 1 ? t->world : 1;
    bool whole_gradient = cfg->run.numerics_every > 0; /* rank 0's probe reads it (and the masters) whole */
    if ((st = zero_plan_init(&t->zero, &t->dist, &t->model, t->overlap, cfg->dist.zero, whole_gradient,
                             cfg->precision.mode != PREC_FP32 && !whole_gradient, err)) != AMP_OK)
        return st;
    if ((st = optim_create_sharded(&t->opt, &cfg->optim, &t->model, t->total_steps, cfg->run.seed, t->rank, shards,
                                   t->zero.sharded ? t->zero.blocks : NULL, err)) != AMP_OK)
        return st;
    scaler_init(&t->scaler, &cfg->precision);
    t->best = (struct eval_watch){.metric = cfg->run.keep_best, .best = NAN, .best_step = -1};
    t->stop = (struct eval_watch){.metric = cfg->run.early_stop.metric, .best = NAN, .best_step = -1};
    if ((t->best.metric != METRIC_NONE || t->stop.metric != METRIC_NONE) && t->ds.split[SPLIT_TEST].n == 0)
        return amp_fail(err, AMP_ERR_CONFIG, "give the run test data (data.test_images and data.test_labels for idx)",
                        "%s: %s watches the evaluation, but the data has no test split to evaluate on", cfg->source,
                        t->best.metric != METRIC_NONE ? "run.keep_best" : "run.early_stop.metric");
    if ((st = batch_io_init(&t->io, t->be, &t->ds, micro, err)) != AMP_OK)
        return st;
    if (!(t->idx_skip = malloc((size_t)micro * sizeof *t->idx_skip)))
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory");

    int n = t->model.nparams;
    t->grads = calloc((size_t)(n ? n : 1), sizeof *t->grads);
    if (!t->grads)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory");
    for (int i = 0; i < n; i++)
        t->grads[i] = &t->model.params[i]->grad;
    if ((st = step_buffers_init(t, err)) != AMP_OK)
        return st;

    int64_t nweights = 0; /* a tied table is one parameter, counted once */
    for (int i = 0; i < n; i++)
        nweights += (int64_t)param_numel(t->model.params[i]);
    printf("model: %d layers, %d parameter tensors (%lld parameters); data: %lld train / %lld test samples; %lld steps "
           "(batch %lld x accum %lld), precision %s\n",
           t->model.nlayers, n, (long long)nweights, (long long)t->ds.split[SPLIT_TRAIN].n,
           (long long)t->ds.split[SPLIT_TEST].n,
           (long long)t->total_steps, (long long)micro, (long long)cfg->accum_steps,
           precision_mode_name(cfg->precision.mode));
    if (t->world > 1)
        printf("data parallel: %d ranks on %d host%s, transport %s, device of rank 0: %s; micro-batch %lld per rank, "
               "effective batch %lld (batch %lld x accum %lld x %d ranks)\n",
               t->world, comm->hosts, comm->hosts == 1 ? "" : "s", comm->transport, t->be->name, (long long)micro,
               (long long)per_step, (long long)micro, (long long)cfg->accum_steps,
               t->world);
    /* how the step's gradients travel (dist.bucket_mb; dist.zero 1's exact statistics need no all-gather) */
    const char *scatter = t->zero.exact ? ", reduce-scattered only (dist.zero 1: no all-gather of the gradients)"
                          : t->zero.aligned ? ", all-gathered after the reduce-scatter (dist.zero 1: run.numerics_every's "
                                              "probe reads the whole reduced gradient on rank 0)"
                          : t->zero.sharded ? ", all-reduced (dist.zero 1: this backend reports no partial gradient "
                                              "statistics)"
                                            : "";
    if (t->world > 1 && t->overlap)
        printf("gradient reduce: %d buckets during backward (dist.bucket_mb %g)%s\n", dist_overlap_buckets(t->overlap),
               cfg->dist.bucket_mb, scatter);
    else if (t->world > 1)
        printf("gradient reduce: one after backward%s\n", scatter);
    return AMP_OK;
}

/* dist.zero 1, once the masters are sharded: what rank 0 holds of the optimizer state and the masters, and the most
 * any rank holds, against dist.zero 0's whole ones. A collective (the maximum over the ranks); rank 0 prints.
 * `why_whole`: why no master is sharded, or NULL. */
static void say_zero(const struct trainer *t, const char *why_whole)
{
    const struct model *m = &t->model;
    int64_t params = 0, mine = 0, masters = 0, kept_whole = 0;
    double bytes = 0, whole = 0;
    for (int i = 0; i < m->nparams; i++) {
        const struct optim_state *s = &t->opt.state[i];
        const struct param *p = m->params[i];
        size_t numel = param_numel(p), es = dtype_size(p->master.dtype);
        params += (int64_t)numel;
        mine += (int64_t)(s->hi - s->lo);
        masters += (int64_t)p->master.numel;
        kept_whole += p->master_block ? 0 : (int64_t)numel;
        bytes += (double)tensor_bytes(&p->master);
        whole += (double)(numel * es);
        for (const struct tensor *k = &s->m; k <= &s->v; k++)
            if (k->data) {
                bytes += (double)tensor_bytes(k);
                whole += (double)(numel * dtype_size(k->dtype));
            }
    }
    double most = bytes;
    t->dist.comm->host_allreduce(t->dist.comm, &most, 1, COMM_F64, COMM_MAX);
    if (t->rank != 0)
        return;
    const char *mdt = m->nparams ? dtype_name(m->params[0]->master.dtype) : "fp32";
    printf("ZeRO-1 (dist.zero 1): the optimizer state is sharded over %d ranks; rank 0 holds it for %lld of the %lld "
           "parameters, and %lld of their %lld %s master weights (%.2f MiB of moments and masters, of %.2f MiB whole: "
           "%.2fx; the most on one rank: %.2f MiB, %.2fx); ", t->opt.shard_world, (long long)mine, (long long)params,
           (long long)masters, (long long)params, mdt, bytes / 1048576.0, whole / 1048576.0,
           whole > 0 ? bytes / whole : 1.0, most / 1048576.0, whole > 0 ? most / whole : 1.0);
    if (why_whole)
        printf("the masters stay whole: %s\n", why_whole);
    else if (kept_whole == 0)
        printf("every master is sharded\n");
    else
        printf("%lld masters stay whole, read by the ops themselves (fp32 biases, norm gains and embedding tables; fp8 "
               "and tied weights)\n", (long long)kept_whole);
}

void trainer_teardown(struct trainer *t)
{
    runlog_close(&t->log);
    if (t->be)
        batch_io_free(&t->io, t->be);
    free(t->grads);
    free(t->idx_skip);
    dist_overlap_free(t->overlap);
    zero_plan_free(&t->zero);
    dist_free(&t->dist);
    if (t->dev)
        t->be->free(t->be, t->dev);
    free(t->pend_epoch);
    free(t->pend_zero_total);
    free(t->pend_zero_pad);
    free(t->host);
    free(t->recs);
    optim_free(&t->opt);
    sampler_free(&t->sampler);
    model_free(&t->model);
    data_free(&t->ds);
    backend_close(t->be);
}

/* The host mirror into backend memory, at the start of a window (it is current then: set up, loaded
 * from a checkpoint, or read back by the last flush). */
static void push_state(struct trainer *t)
{
    struct step_state st = {
        .scaler = t->scaler,
        .step = t->step,
        .opt_step = t->opt.step,
        .seed = step_rule_seed(&t->scaler, t->params.micro_batches),
        .bound = t->bound,
    };
    t->be->upload(t->be, t->dev_state, &st, sizeof st); /* window_slot 0 */
    /* the step's row starts at zero: count_zeros adds into it (grad_zeros); window_store zeroes it after each step */
    memset(t->rows_host, 0, sizeof *t->rows_host);
    t->be->upload(t->be, t->dev_row, t->rows_host, sizeof *t->rows_host);
}

/* Why a run's steps are not recorded as CUDA graphs, or NULL when they may be. The backend has graphs (and
 * AMPTRAIN_CUDA_GRAPHS is not 0): these are the steps whose ops depend on the host between them, or on host values
 * that change from step to step. */
static const char *graphs_refused(const struct trainer *t)
{
    const struct config *cfg = t->cfg;
    if (t->dist.active)
        return "data parallel: the gradients' reduce is made between the ops by the communicator";
    if (cfg->accum_steps >= BACKEND_GRAPHS)
        return "accum_steps is 64 or more: one graph a micro-batch";
    return NULL;
}

/* One micro-batch of the step (forward, backward, loss sum) and, after the last, the step's tail: check, trial,
 * update, scale and the log row into the window. Every value these ops take that changes from step to step is read
 * from backend memory (the step, the window's slot, the loss seed), so the same calls serve every step. */
static enum amp_status run_micro(struct trainer *t, int64_t micro, struct step_ctx *ctx, struct fp8_pass *fp8,
                                 struct amp_error *err)
{
    struct model *m = &t->model;
    struct backend *be = t->be;
    int64_t accum = t->cfg->accum_steps, n = t->cfg->data.batch_size;
    const struct layer *loss = &m->layers[m->nlayers - 1];
    model_forward(m, ctx, &t->io.b);
    /* the last micro-batch's gradients are reduced in buckets while its backward runs (dist.bucket_mb) */
    bool last = micro == accum - 1;
    ctx->hook = last ? dist_overlap_hook(t->overlap) : NULL;
    model_backward(m, ctx, &t->io.b);
    ctx->hook = NULL;
    double wait0 = runlog_now(); /* the buckets still in flight: the part of the reduce the step waits for */
    bool grads_reduced = last && dist_overlap_finish(t->overlap);
    if (grads_reduced)
        t->reduce_seconds += runlog_now() - wait0;
    if (micro == 0 && t->after_first_micro) {
        enum amp_status st = t->after_first_micro(t, ctx, &t->io.b, t->micro_user, err);
        if (st != AMP_OK)
            return st;
    }
    be->loss_sum(be, &t->dev_state->loss_acc, &loss->y, model_loss_rows(m, n), micro > 0);
    if (!last)
        return AMP_OK;

    /* reduce: once per step, after the last micro-batch (or in buckets during its backward, above); then every
     * rank checks identical gradients, or (dist.zero 1 on the CPU) the statistics of its reduce-scattered blocks
     * combined with the other ranks' in one order (zero.h) */
    if (t->dist.active) {
        double t0 = runlog_now();
        if (!grads_reduced)
            zero_reduce_gradients(&t->zero, &t->dist, m);
        dist_reduce_sum(&t->dist, &t->dev_state->loss_acc, 1, COMM_F64);
        t->reduce_seconds += runlog_now() - t0;
    }
    if (t->test_hook.after_backward)
        t->test_hook.after_backward(t, t->test_hook.user);
    if (m->has_fp8) {
        /* the delayed recipe's scales from amaxes every rank agrees on (TE reduces them too): the max over the
         * ranks of this step's amaxes, so replicas keep one fp8 state and a checkpoint holds it. The update reads
         * the step from backend memory, before step_finish advances it; nothing of the step rule reads the scales */
        if (t->dist.active && fp8->amax_fwd)
            dist_reduce_max_f32(&t->dist, fp8->amax_fwd, (size_t)m->fp8.fwd.n);
        if (t->dist.active && fp8->amax_bwd)
            dist_reduce_max_f32(&t->dist, fp8->amax_bwd, (size_t)m->fp8.bwd.n);
        fp8_step_end(&m->fp8, t->step, &t->dev_state->step);
    }
    zero_grad_stats(&t->zero, &t->dist, t->grads, m->nparams, t->dev_check, t->dev_row_counts);
    /* an update that would store a non-finite weight or moment is never applied: its trial first */
    be->step_propose(be, &t->params, t->dev_state, t->dev_check);
    optim_step(&t->opt, m, t->dev_state, &t->dev_check->update_nonfinite);
    zero_after_trial(&t->dist, &t->opt, t->dev_check); /* dist.zero 1: the ranks' blocks' verdicts combined */
    be->step_finish(be, &t->params, t->dev_state, t->dev_check, t->dev_row);
    optim_step(&t->opt, m, t->dev_state, NULL);
    zero_after_update(&t->dist, &t->opt, m, &t->dev_state->bound); /* dist.zero 1: every rank's block to all */
    be->window_store(be, &(struct window_store_args){.row = t->dev_row, .counts = t->dev_row_counts,
                                                     .rows = t->dev_rows, .window_counts = t->dev_counts,
                                                     .ncounts = t->ncounts, .slot = &t->dev_state->window_slot});
    return AMP_OK;
}

/* Micro-batch `micro`'s piece of the step as a CUDA graph: replayed where one is kept, else recorded where its
 * piece has run plainly once (so the recording allocates nothing), else run plainly. *ran: the piece's ops are
 * queued (false: the caller runs them). A recording that fails turns graphs off for the run, said once. */
static enum amp_status graph_piece(struct trainer *t, int key, int64_t micro, struct step_ctx *ctx,
                                   struct fp8_pass *fp8, struct grad_zeros *zeros, bool *ran, struct amp_error *err)
{
    struct train_graphs *g = &t->graphs;
    struct backend *be = t->be;
    *ran = false;
    if (g->kept[key] && be->graph_launch(be, key)) {
        g->replayed++;
        if (ctx->zeros) { /* what the recorded count_zeros calls added on the host */
            zeros->total = g->zero_total;
            zeros->padding = g->zero_pad;
        }
        *ran = true;
        return AMP_OK;
    }
    g->kept[key] = false; /* stale (the backend replaced a buffer it names): recorded again */
    if (!g->seen[key]) {
        g->seen[key] = true;
        return AMP_OK;
    }
    if (!be->graph_begin(be)) {
        g->off = true;
        return AMP_OK;
    }
    enum amp_status st = run_micro(t, micro, ctx, fp8, err);
    bool kept = be->graph_end(be, key);
    if (st != AMP_OK)
        return st;
    if (kept && be->graph_launch(be, key)) {
        g->kept[key] = true;
        g->recorded++;
        if (ctx->zeros) {
            g->zero_total = zeros->total;
            g->zero_pad = zeros->padding;
        }
        *ran = true;
        return AMP_OK;
    }
    /* nothing recorded ran: the caller runs the piece plainly, its fp8 weights cast anew (the layers noted the
     * recorded cast as done) and its zero counts from nothing */
    g->off = true;
    if (fp8->weights)
        fp8->weights = ++t->model.fp8.weights;
    zeros->total = zeros->padding = 0;
    return AMP_OK;
}

/* One optimizer step: accum_steps micro-batches, check, step or skip, scale update; queued. */
enum amp_status trainer_step(struct trainer *t, struct amp_error *err)
{
    int64_t step = t->step;
    const struct config *cfg = t->cfg;
    struct model *m = &t->model;
    struct backend *be = t->be;
    if (t->pending >= t->window)
        return amp_fail(err, AMP_ERR_INTERNAL, "this is a bug: flush the trainer every log window",
                        "trainer_step: %lld steps queued, the window holds %lld", (long long)t->pending,
                        (long long)t->window);
    if (t->pending == 0)
        push_state(t);
    int64_t accum = cfg->accum_steps, n = cfg->data.batch_size;
    bool sample_zeros = (step + 1) % cfg->run.log_every == 0; /* log_every >= 1 (config) */
    struct grad_zeros zeros = {.zeros = &t->dev_row->grad_zeros, .total = 0};

    int64_t world = t->world;
    /* fp8: every micro-batch raises this step's pending amaxes (recipe delayed) */
    struct fp8_pass fp8 = m->has_fp8 ? fp8_pass_of(&m->fp8, step, true) : (struct fp8_pass){ 0 };
    struct fp8_pass fp8_first = fp8; /* ampTrain numerics counts the first micro-batch's casts */
    if (t->fp8_counts) {
        fp8_first.counts_fwd = t->fp8_counts;
        fp8_first.counts_bwd = t->fp8_counts + 4 * (size_t)m->fp8.fwd.n;
    }
    /* CUDA graphs: where the backend has them, for steps whose every op the same calls serve; a step measured or
     * hooked (numerics, tests) runs plainly */
    struct train_graphs *g = &t->graphs;
    if (!g->off && !be->graph_begin)
        g->off = true;
    const char *refused = g->off ? NULL : graphs_refused(t);
    if (refused && t->rank == 0)
        fprintf(stderr, "note: CUDA graphs off for this run: %s; the step's ops are queued one by one\n", refused);
    if (refused)
        g->off = true;
    bool graphs = !g->off && !t->after_first_micro && !t->test_hook.after_backward && !t->fp8_counts;
    for (int64_t micro = 0; micro < accum; micro++) {
        /* The global order gives each micro-batch slot `world` consecutive batches, one per rank: so world
         * ranks see per step the samples one rank sees with world x the accumulation, and the dropout
         * counter is that one rank's micro-batch index (step * accum * world + micro * world + rank, the step
         * read from backend memory when the masks are drawn). */
        for (int r = 0; r < world; r++)
            sampler_next(&t->sampler, n, r == t->rank ? t->io.idx : t->idx_skip);
        batch_io_load(&t->io, be, &t->ds, SPLIT_TRAIN, n);
        bool last = micro == accum - 1;
        struct step_ctx ctx = {
            .be = be,
            .policy = &m->policy,
            .training = true,
            .key = {.seed = cfg->run.seed, .counter = (uint64_t)(micro * world + t->rank),
                    .step = &t->dev_state->step, .per_step = (uint64_t)(accum * world)},
            .grad_seed = &t->dev_state->seed,
            .accumulate = micro > 0,
            .loss_in_backward = true, /* model_backward follows below */
            .fp8 = m->has_fp8 ? (micro == 0 && t->fp8_counts ? &fp8_first : &fp8) : NULL,
            /* sampled on the step's last micro-batch: with several ranks, the last rank's (trainer_flush
             * gives its counts to every rank) */
            .zeros = sample_zeros && last && t->rank == world - 1 ? &zeros : NULL,
        };
        bool ran = false;
        enum amp_status st = AMP_OK;
        if (graphs)
            st = graph_piece(t, ctx.zeros ? (int)accum : (int)micro, micro, &ctx, &fp8, &zeros, &ran, err);
        if (st == AMP_OK && !ran)
            st = run_micro(t, micro, &ctx, &fp8, err);
        if (st != AMP_OK)
            return st;
    }

    t->pend_epoch[t->pending] = t->sampler.epoch;
    /* fraction of the last micro-batch's low-precision activation-gradient elements that are zero */
    t->pend_zero_total[t->pending] = zeros.total;
    t->pend_zero_pad[t->pending] = zeros.padding;
    t->pending++;
    t->step++;
    t->samples_seen += config_global_batch(n, accum, world);
    return be->status(be, err);
}

/* grad_zero_frac samples the step's last micro-batch, which is the last rank's: its counts of the n
 * rows to every rank (a collective, made whatever the flush's status). */
static void share_zero_counts(struct trainer *t, int64_t n)
{
    struct comm *c = t->dist.comm;
    if (c->world == 1)
        return;
    int64_t *z = calloc((size_t)(2 * n), sizeof *z);
    if (!z) {
        c->abort(c, AMP_ERR_INTERNAL);
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        z[i] = t->rows_host[i].grad_zeros;
        z[n + i] = t->pend_zero_total[i];
    }
    c->host_bcast(c, z, (size_t)(2 * n) * sizeof *z, c->world - 1);
    for (int64_t i = 0; i < n; i++) {
        t->rows_host[i].grad_zeros = z[i];
        t->pend_zero_total[i] = z[n + i];
    }
    free(z);
}

enum amp_status trainer_flush(struct trainer *t, struct amp_error *err)
{
    struct backend *be = t->be;
    int64_t n = t->pending, nc = t->ncounts;
    t->nrecs = 0;
    if (n == 0)
        return AMP_OK;
    /* one download, one wait: the state, the check, the window's rows and the first n rows' counts */
    be->download(be, t->host, t->dev, t->counts_off + (size_t)(n * nc) * sizeof(int64_t));
    enum amp_status status = be->status(be, err);
    for (int64_t i = 0; i < n; i++) /* the padded vocabulary's zeros off, before the last rank's are shared */
        t->rows_host[i].grad_zeros -= t->pend_zero_pad[i];
    share_zero_counts(t, n);
    if (status != AMP_OK)
        return status;
    struct step_state st;
    memcpy(&st, t->host, sizeof st);
    t->scaler = st.scaler;
    t->opt.step = st.opt_step;
    t->bound = st.bound;
    for (int64_t i = 0; i < n; i++) {
        const struct step_row *r = &t->rows_host[i];
        struct step_record *rec = &t->recs[i];
        memset(rec, 0, sizeof *rec);
        rec->step = r->step;
        rec->epoch = t->pend_epoch[i];
        rec->loss = r->loss;
        rec->scale = r->scale;
        rec->found_inf = r->found_inf != 0;
        rec->skipped = r->skipped != 0;
        rec->skips_total = r->skips_total;
        rec->grad_norm = r->grad_norm;
        rec->clip_coef = r->clip_coef;
        rec->lr = r->lr;
        if (r->found_inf)
            attribute_overflow(&t->model, t->counts_host + i * nc, rec->overflow_layer, sizeof rec->overflow_layer);
        else if (r->update_nonfinite > 0 && r->update_nonfinite <= t->model.nparams)
            snprintf(rec->overflow_layer, sizeof rec->overflow_layer, "the update of %s (non-finite)",
                     t->model.params[r->update_nonfinite - 1]->name);
        rec->grad_zero_frac = t->pend_zero_total[i] ? (double)r->grad_zeros / (double)t->pend_zero_total[i] : NAN;
        rec->consecutive_skips = r->consecutive_skips;
        rec->scale_next = r->scale_next;
    }
    t->nrecs = n;
    t->pending = 0;
    return AMP_OK;
}

/* Fail-fast checks after a step (docs/precision.md, "Failing fast"). */
enum amp_status trainer_check_stability(const struct trainer *t, const struct step_record *rec, struct amp_error *err)
{
    const struct config *cfg = t->cfg;
    if (!rec->skipped)
        return AMP_OK;
    const char *where = rec->overflow_layer[0] ? rec->overflow_layer : "a layer's gradients";
    if (!precision_is_loss_scaled(&cfg->precision) && cfg->stability.on_nonfinite == NONFINITE_STOP)
        return amp_fail(err, AMP_ERR_UNSTABLE,
                        "lower optim.lr, set clip.max_norm, or check the data",
                        "step %lld: %s %s and stability.on_nonfinite is stop", (long long)rec->step,
                        rec->found_inf ? "non-finite gradients in" : "skipped:", where);
    int64_t max = cfg->stability.max_consecutive_skips;
    if (max > 0 && rec->consecutive_skips >= max)
        return amp_fail(err, AMP_ERR_UNSTABLE,
                        "lower optim.lr, set clip.max_norm, or try precision.mode=bf16",
                        "step %lld: %lld skipped steps in a row (stability.max_consecutive_skips = %lld); last "
                        "overflow in %s",
                        (long long)rec->step, (long long)rec->consecutive_skips, (long long)max, where);
    if (t->scaler.dynamic && rec->scale <= t->scaler.min_scale)
        return amp_fail(err, AMP_ERR_UNSTABLE,
                        "lower optim.lr or try precision.mode=bf16",
                        "step %lld: gradients overflow in %s even at the minimum loss scale (%g)",
                        (long long)rec->step, where, rec->scale_next);
    return AMP_OK;
}

/* ---- stopping on SIGINT / SIGTERM ----------------------------------------------------------------- */

static volatile sig_atomic_t stop_signal; /* the first SIGINT/SIGTERM seen, 0 when none */

static void on_stop_signal(int sig)
{
    /* The first signal lets the current step (and a save in progress) finish, then the loop writes a
     * checkpoint and stops. A second one stops at once, even during that save: its .tmp file is
     * abandoned, the previous checkpoint and `latest` are untouched, and the next run cleans the .tmp. */
    if (stop_signal)
        _exit(128 + sig);
    stop_signal = sig;
}

static void install_signals(bool on)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on ? on_stop_signal : SIG_DFL;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    /* A file-size limit (ulimit -f) must fail the write with EFBIG, not kill us mid-checkpoint. */
    signal(SIGXFSZ, on ? SIG_IGN : SIG_DFL);
    if (on)
        stop_signal = 0;
}

static enum amp_status save_checkpoint(struct trainer *t, int64_t protect, char *path, size_t len,
                                       struct amp_error *err)
{
    enum amp_status st = ckpt_save(t, t->cfg->run.out_dir, t->cfg->run.keep_ckpts, protect, path, len, err);
    if (st == AMP_OK)
        printf("checkpoint: %s\n", path);
    return st;
}

/* Append to a fail-fast error's hint where training can continue from. */
static void name_last_good_checkpoint(struct amp_error *err, const char *ckpt)
{
    size_t len = strlen(err->hint);
    if (ckpt)
        snprintf(err->hint + len, sizeof err->hint - len,
                 "; the last good checkpoint is %s: continue from it with 'ampTrain resume %s KEY=VALUE' "
                 "(e.g. precision.mode=bf16)",
                 ckpt, ckpt);
    else
        snprintf(err->hint + len, sizeof err->hint - len, "; no checkpoint was written before this step");
}

/* What run_loop keeps across log windows. */
struct loop_marks {
    const char *resume;         /* the checkpoint the run started from, or NULL */
    double t_window;            /* when the current window's first step was queued */
    double train_seconds;       /* in trainer_step and waiting for the steps (trainer_flush) */
    int64_t steps_done;
    char saved[CFG_STR + 64], good[CFG_STR + 64]; /* the last checkpoint written; the last after a clean step */
    int64_t saved_step, good_step;
    bool last_skipped;          /* the last step logged was skipped */
    int64_t checked_step;       /* the step of the last replica comparison */
    long train_peak_kb;         /* this process's peak RSS before its first checkpoint (whose in-memory image,
                                 * 12 bytes a parameter, is the peak of most runs); 0 until then */
    int64_t eval_step;          /* the step of the last evaluation; -1: none yet */
    bool stopped_early;         /* run.early_stop's patience ran out */
};

/* The process's peak resident set so far, in KiB (Linux's ru_maxrss). */
static long peak_rss_kb(void)
{
    struct rusage ru;
    return getrusage(RUSAGE_SELF, &ru) == 0 ? ru.ru_maxrss : 0;
}

/* Wait for the queued steps, then log each (scale_log.csv, progress) and apply the fail-fast checks in
 * step order: a run that must stop stops at its first failing step's row, and its hint names the last
 * good checkpoint. Every row of a window gets the window's throughput. */
static enum amp_status drain(struct trainer *t, struct loop_marks *lm, struct amp_error *err)
{
    double t0 = runlog_now();
    enum amp_status st = trainer_flush(t, err);
    double now = runlog_now();
    lm->train_seconds += now - t0;
    st = comm_agree(t->dist.comm, st, err);
    if (st != AMP_OK)
        return st;
    /* replicas compared every dist.check_every steps (0: every flush), in the same flushes on every rank */
    int64_t every = t->cfg->dist.check_every;
    if (t->world > 1 && (every == 0 || t->step - lm->checked_step >= every)) {
        lm->checked_step = t->step;
        st = dist_check_replicas(&t->dist, &t->model, &t->scaler, t->step, t->opt.step, NULL, err);
        if (st != AMP_OK)
            return comm_agree(t->dist.comm, st, err);
    }
    const struct config *cfg = t->cfg;
    double samples = (double)(t->nrecs * config_global_batch(cfg->data.batch_size, cfg->accum_steps, t->world));
    double rate = now > lm->t_window ? samples / (now - lm->t_window) : 0;
    lm->t_window = now;
    for (int64_t i = 0; i < t->nrecs; i++) {
        struct step_record *rec = &t->recs[i];
        rec->samples_per_s = rate;
        if (t->rank == 0 && (st = runlog_step(&t->log, rec, err)) != AMP_OK)
            break;
        if ((st = trainer_check_stability(t, rec, err)) != AMP_OK) {
            name_last_good_checkpoint(err, lm->good[0] ? lm->good : lm->resume);
            break;
        }
        lm->last_skipped = rec->skipped;
    }
    if (st == AMP_OK && t->rank == 0)
        st = runlog_flush(&t->log, err);
    return comm_agree(t->dist.comm, st, err);
}

/* Rank 0 writes the checkpoint; every rank learns how that went, and its path. */
static enum amp_status checkpoint_now(struct trainer *t, struct loop_marks *lm, struct amp_error *err)
{
    struct zero_swap sw; /* dist.zero 1: rank 0 saves the whole optimizer state, gathered from every rank's block */
    enum amp_status st = zero_gather_begin(&t->dist, &t->opt, &t->model, &sw, err);
    if (st == AMP_OK && t->rank == 0)
        st = save_checkpoint(t, lm->good_step, lm->saved, sizeof lm->saved, err);
    zero_gather_end(&t->opt, &sw);
    st = comm_agree(t->dist.comm, st, err);
    t->dist.comm->host_bcast(t->dist.comm, lm->saved, sizeof lm->saved, 0);
    lm->saved_step = t->step;
    if (st == AMP_OK && !lm->last_skipped) { /* after a clean step: a point to continue from */
        snprintf(lm->good, sizeof lm->good, "%s", lm->saved);
        lm->good_step = t->step;
    }
    lm->t_window = runlog_now();
    return st;
}

/* Rank 0 names the new best checkpoint (run.keep_best). */
static void say_best(const struct trainer *t, const struct loop_marks *lm)
{
    if (t->rank != 0)
        return;
    printf("best: %s (%s %.6g at step %lld; run.keep_best)\n", lm->saved, eval_metric_name(t->best.metric),
           t->best.best, (long long)t->best.best_step);
}

/* Rank 0 says why run.early_stop ended the run (or, on resume, had ended it). */
static void say_early_stop(const struct trainer *t, const struct loop_marks *lm)
{
    if (t->rank != 0)
        return;
    const struct early_stop_config *es = &t->cfg->run.early_stop;
    printf("early stop at step %lld: %s did not improve on its best %.6g (step %lld) for %lld evaluation%s "
           "(run.early_stop.patience %lld%s); checkpoint: %s\n",
           (long long)t->step, eval_metric_name(t->stop.metric), t->stop.best, (long long)t->stop.best_step,
           (long long)t->stop.since, t->stop.since == 1 ? "" : "s", (long long)es->patience,
           es->min_delta > 0 ? ", by more than run.early_stop.min_delta" : "",
           lm->saved[0] ? lm->saved : lm->resume ? lm->resume : "(none)");
}

/* A resume on another number of ranks: the step's batch then, now, and the accum_steps that keeps it, from the
 * checkpoint's own accum_steps (a resume override may have changed cfg's). */
static void note_world_change(const struct trainer *t, const char *resume)
{
    const struct config *cfg = t->cfg;
    int64_t b = cfg->data.batch_size, old_accum = t->ckpt_accum > 0 ? t->ckpt_accum : cfg->accum_steps;
    int64_t before = config_global_batch(b, old_accum, t->ckpt_world);
    int64_t now = config_global_batch(b, cfg->accum_steps, t->world);
    char advice[160];
    if (now == before)
        snprintf(advice, sizeof advice, "the same as before");
    else if ((old_accum * t->ckpt_world) % t->world == 0)
        snprintf(advice, sizeof advice, "instead of %lld; resume with accum_steps=%lld to keep it", (long long)before,
                 (long long)(old_accum * t->ckpt_world / t->world));
    else
        snprintf(advice, sizeof advice, "instead of %lld; no accum_steps keeps it on %d ranks", (long long)before,
                 t->world);
    printf("note: %s was written by %lld rank%s (accum_steps %lld%s) and resumes on %d: a step takes %lld samples "
           "(batch %lld x accum %lld x %d ranks), %s\n",
           resume, (long long)t->ckpt_world, t->ckpt_world == 1 ? "" : "s", (long long)old_accum,
           t->ckpt_accum > 0 ? "" : ", as resumed: the file does not record its own", t->world, (long long)now,
           (long long)b, (long long)cfg->accum_steps, t->world, advice);
}

/* Train from scratch (resume == NULL) or from the checkpoint `resume`. */
static enum amp_status run_loop(const struct config *cfg, const char *resume, bool fresh_scaler, struct comm *comm,
                                const struct train_probe *probe, struct amp_error *err)
{
    if (!comm)
        comm = comm_single();
    /* From here to the end a first SIGINT/SIGTERM is a request, answered with a message: before the first
     * step (data loading can take long) and after the last (the final evaluation) as well as between steps. */
    install_signals(true);
    test_switch_raise("setup");
    struct trainer t;
    enum amp_status st = trainer_setup(&t, cfg, comm, err);
    /* Fine-tuning starts from the file's weights; a resumed run has its own (the checkpoint's) and never reads it. */
    if (st == AMP_OK && !resume && cfg->model.init_from[0])
        st = init_from_load(&t.model, &cfg->model, comm->rank == 0 ? stdout : NULL, err);
    if (st == AMP_OK && resume) {
        struct zero_swap sw; /* dist.zero 1: the whole state is read, and each rank keeps its block */
        st = zero_load_begin(&t.opt, &t.model, &sw, err);
        if (st == AMP_OK)
            st = ckpt_load_trainer(resume, &t, fresh_scaler, err);
        enum amp_status taken = zero_load_end(&t.opt, &sw, st == AMP_OK, err);
        if (st == AMP_OK)
            st = taken;
        if (st == AMP_OK && t.step > t.total_steps)
            st = amp_fail(err, AMP_ERR_CONFIG,
                          "give run.steps beyond the checkpoint's step (run.steps counts from the run's start)",
                          "resume: %s is at step %lld, past the run's %lld steps (run.steps or run.epochs): nothing "
                          "to train", resume, (long long)t.step, (long long)t.total_steps);
        if (st == AMP_OK)
            printf("resumed from %s at step %lld (epoch %lld)%s\n", resume, (long long)t.step,
                   (long long)t.sampler.epoch,
                   t.step == t.total_steps ? "; it is the run's last step: nothing to train, only the final "
                                             "evaluation (raise run.steps to train further)" : "");
        if (st == AMP_OK && t.ckpt_world != t.world)
            note_world_change(&t, resume);
    }
    st = comm_agree(comm, st, err);
    if (st == AMP_OK && t.world > 1) { /* a collective: here, after the agreement, every rank makes it */
        char hosts[2048];
        dist_describe_hosts(comm, t.be->name, hosts, sizeof hosts);
        printf("%s\n", hosts);
    }
    if (st == AMP_OK) /* every rank's samples from the same data */
        st = comm_agree(comm, dist_check_data(comm, &t.ds, cfg->source, err), err);
    if (st == AMP_OK && !resume && cfg->model.init_from[0]) /* and its weights from the same file */
        st = comm_agree(
            comm, dist_check_replicas(&t.dist, &t.model, &t.scaler, t.step, t.opt.step, cfg->model.init_from, err),
            err);
    /* dist.zero 1: now that the weights are set, each rank keeps its block of the masters only the optimizer reads,
     * except where rank 0's FP32 shadow (run.numerics_every) reads them whole */
    if (st == AMP_OK && t.opt.shard_world > 1) {
        const char *why_whole = cfg->precision.mode == PREC_FP32 ? "in fp32 they are the weights the ops read"
                                : cfg->run.numerics_every > 0     ? "run.numerics_every's FP32 shadow reads them on rank 0"
                                                                  : NULL;
        if (!why_whole)
            st = comm_agree(comm, zero_shard_masters(&t.opt, &t.model, err), err);
        if (st == AMP_OK)
            say_zero(&t, why_whole);
    }
    int sig = stop_signal; /* a stop signal any rank saw, agreed by all after each step */
    st = comm_agree_stop(comm, st, &sig, err);
    if (st == AMP_OK && sig) {
        st = amp_fail(err, sig == SIGINT ? AMP_EXIT_SIGINT : AMP_EXIT_SIGTERM, "run the same command again",
                      "stopped by %s before the first step (while loading the data and building the model): "
                      "nothing was trained or written", sig == SIGINT ? "SIGINT" : "SIGTERM");
        err->agreed = t.world > 1;
    }
    if (st == AMP_OK && comm->rank == 0) {
        /* Resuming into a new directory (run.out_dir changed) starts a fresh log with a header. */
        st = runlog_open(&t.log, cfg, t.total_steps, t.step, resume, err);
        if (comm->world > 1) /* mpirun gives ranks a pty whatever its own output is: plain lines */
            t.log.tty = false;
    }
    if (st == AMP_OK && comm->rank == 0 && ckpt_clean_stale(cfg->run.out_dir) > 0)
        printf("removed stale checkpoint .tmp files in %s (left by an interrupted save)\n", cfg->run.out_dir);
    st = comm_agree(comm, st, err);
    struct loop_marks lm = {.resume = resume, .t_window = runlog_now(), .saved_step = -1, .good_step = -1,
                            .checked_step = t.step, .eval_step = -1};
    /* run.keep_best, run.early_stop: an evaluation comes before its step's checkpoint, which records its outcome */
    bool watching = cfg->run.keep_best != METRIC_NONE || cfg->run.early_stop.metric != METRIC_NONE;
    if (st == AMP_OK && resume && t.stop.metric != METRIC_NONE && t.stop.since >= cfg->run.early_stop.patience) {
        lm.stopped_early = true; /* the checkpoint's run had stopped early: it stays stopped, its step evaluated */
        lm.eval_step = t.step;
    }
    /* run.numerics_every: rank 0 measures its first micro-batch of every such step (the probe: lib/engine/numerics.h) */
    void *measured = NULL;
    int64_t measure_every = cfg->run.numerics_every;
    if (st == AMP_OK && measure_every > 0 && !probe)
        st = amp_fail(err, AMP_ERR_INTERNAL, "this is a bug: pass numerics_probe to train_run",
                      "run.numerics_every is %lld but the run has no probe to measure with", (long long)measure_every);
    if (st == AMP_OK && measure_every > 0 && comm->rank == 0)
        st = probe->open(&t, &measured, err);
    /* run.sample_every: rank 0 generates from the model between steps (lib/engine/sample.h); it reads the weights and writes
     * only activations the next forward writes again, and draws from its own random stream */
    struct run_sampler sampler = {0};
    int64_t sample_every = cfg->run.sample_every;
    if (st == AMP_OK && sample_every > 0 && comm->rank == 0)
        st = run_sampler_open(&sampler, &t.model, cfg, err);
    st = comm_agree(comm, st, err);
    while (st == AMP_OK && t.step < t.total_steps && !sig && !lm.stopped_early) {
        double t0 = runlog_now();
        bool measure = measure_every > 0 && t.step % measure_every == 0 && comm->rank == 0;
        st = measure ? probe->step(measured, &t, err) : trainer_step(&t, err);
        lm.train_seconds += runlog_now() - t0;
        dist_test_perturb(&t.dist, &t.model, t.step);
        sig = stop_signal;
        st = comm_agree_stop(comm, st, &sig, err);
        if (st != AMP_OK)
            break;
        lm.steps_done++;
        bool last = t.step == t.total_steps;
        bool ckpt = last || (cfg->run.ckpt_every > 0 && t.step % cfg->run.ckpt_every == 0);
        bool eval = cfg->run.eval_every > 0 && t.step % cfg->run.eval_every == 0 && !last;
        bool eval_first = watching && (eval || last) && !sig; /* the final evaluation too */
        if (t.pending == t.window || t.step % cfg->run.log_every == 0 || last || ckpt || eval || sig)
            st = drain(&t, &lm, err);
        bool best = false;
        if (st == AMP_OK && eval_first) {
            st = evaluate_and_watch(&t, &best, &lm.stopped_early, err);
            lm.eval_step = t.step;
            lm.t_window = runlog_now();
        }
        if (st == AMP_OK && (ckpt || best || lm.stopped_early)) {
            if (!lm.train_peak_kb)
                lm.train_peak_kb = peak_rss_kb();
            st = checkpoint_now(&t, &lm, err);
        }
        if (st == AMP_OK && best)
            say_best(&t, &lm);
        if (st == AMP_OK && eval && !eval_first && !sig) {
            bool done;
            struct eval_result r;
            st = comm_agree(comm, run_eval(&t, t.step, &r, &done, err), err);
            lm.t_window = runlog_now();
        }
        if (st == AMP_OK && sample_every > 0 && t.step % sample_every == 0 && !sig) {
            st = comm_agree(comm, comm->rank == 0 ? run_sampler_sample(&sampler, &t.model, &t.log, cfg, t.step, err) : AMP_OK,
                            err);
            lm.t_window = runlog_now();
        }
    }
    run_sampler_free(&sampler);
    if (st == AMP_OK && !sig) { /* a signal that landed after the last step */
        sig = stop_signal;
        st = comm_agree_stop(comm, st, &sig, err);
    }
    if (st == AMP_OK && sig) {
        st = drain(&t, &lm, err); /* a signal that landed after the last flush check */
        if (st == AMP_OK && lm.saved_step != t.step)
            st = checkpoint_now(&t, &lm, err);
        char again[CFG_STR + 160], launcher[32] = "";
        if (t.world > 1) /* the same world continues it exactly (docs/distributed.md) */
            snprintf(launcher, sizeof launcher, "mpirun -np %d ", t.world);
        snprintf(again, sizeof again, "continue with '%sampTrain resume %s'", launcher, lm.saved);
        if (st == AMP_OK)
            st = amp_fail(err, sig == SIGINT ? AMP_EXIT_SIGINT : AMP_EXIT_SIGTERM, again,
                          "stopped by %s after step %lld; checkpoint written: %s", sig == SIGINT ? "SIGINT" : "SIGTERM",
                          (long long)t.step, lm.saved);
        err->agreed = t.world > 1; /* every rank stops here alike: rank 0 says so */
    } else if (st == AMP_OK) {
        int64_t per_step = config_global_batch(cfg->data.batch_size, cfg->accum_steps, t.world);
        double samples = (double)(lm.steps_done * per_step);
        printf("train: %lld steps, %.0f samples in %.2f s of training steps: %.1f samples/s\n",
               (long long)lm.steps_done, samples, lm.train_seconds,
               lm.train_seconds > 0 ? samples / lm.train_seconds : 0.0);
        /* the reduce's own time where the host waits for it: MPI on the CPU backend (on a GPU the reduce is queued,
         * or staged through a download that waits for the backward too) */
        if (t.world > 1 && t.be->host_memory && !comm->device_memory && lm.steps_done > 0)
            printf("reduce: %.3f ms a step, %.1f%% of the training steps' time (the gradients' %s, %lld fp32 "
                   "values; rank 0's wall time in it)\n",
                   1e3 * t.reduce_seconds / (double)lm.steps_done,
                   lm.train_seconds > 0 ? 100.0 * t.reduce_seconds / lm.train_seconds : 0.0,
                   t.zero.exact ? "reduce-scatter" : "all-reduce",
                   (long long)t.model.grad_flat_count);
        if (t.graphs.recorded > 0) /* CUDA graphs (docs/backend.md): how the steps were queued */
            printf("cuda graphs: %lld step pieces recorded, %lld replayed\n", (long long)t.graphs.recorded,
                   (long long)t.graphs.replayed);
        if (lm.train_peak_kb) /* host memory: on a GPU the device's is what counts (AMPTRAIN_CUDA_MEMLOG=1) */
            printf("memory: peak RSS %.1f MiB training (before the first checkpoint), %.1f MiB so far\n",
                   (double)lm.train_peak_kb / 1024.0, (double)peak_rss_kb() / 1024.0);
        test_switch_raise("final_eval");
        if (lm.eval_step != t.step) { /* not evaluated at this step yet (watching: resumed at the run's last step) */
            bool best = false, stop = false;
            st = evaluate_and_watch(&t, &best, &stop, err);
            if (st == AMP_OK && best && lm.saved_step != t.step)
                st = checkpoint_now(&t, &lm, err);
            if (st == AMP_OK && best)
                say_best(&t, &lm);
        }
        if (st == AMP_OK && lm.stopped_early)
            say_early_stop(&t, &lm);
        sig = stop_signal;
        st = comm_agree_stop(comm, st, &sig, err);
        if (st == AMP_OK && sig) {
            st = amp_fail(err, sig == SIGINT ? AMP_EXIT_SIGINT : AMP_EXIT_SIGTERM,
                          "the run is complete: evaluate its checkpoint again with 'ampTrain eval CHECKPOINT.h5'",
                          "%s arrived during the final evaluation; training had finished and its last checkpoint "
                          "is written: %s", sig == SIGINT ? "SIGINT" : "SIGTERM", lm.saved[0] ? lm.saved : "(none)");
            err->agreed = t.world > 1;
        }
    }
    if (measured)
        probe->close(measured, cfg, st == AMP_OK);
    install_signals(false);
    trainer_teardown(&t);
    return st;
}

enum amp_status train_run(const struct config *cfg, struct comm *comm, const struct train_probe *probe,
                          struct amp_error *err)
{
    return run_loop(cfg, NULL, false, comm, probe, err);
}

enum amp_status train_resume(const struct config *cfg, const char *checkpoint, bool fresh_scaler, struct comm *comm,
                             const struct train_probe *probe, struct amp_error *err)
{
    return run_loop(cfg, checkpoint, fresh_scaler, comm, probe, err);
}
