/*
 * setup.c — the backend, threads, data, autocast policy and model of a command, opened in one order. See setup.h.
 *
 * Each step is the call its callers made themselves before (backend_open_rank, backend_set_threads, data_load or
 * data_load_split, autocast_from_config, model_build, ckpt_load_model), in the same order and with the same
 * arguments, so that moving a command here changes none of its messages, exit codes or bits.
 */
#include "setup.h"

#include <stdio.h>
#include <string.h>

#include "autocast.h"   /* autocast_from_config */
#include "backend.h"    /* backend_open_rank, backend_set_threads, backend_close */
#include "checkpoint.h" /* ckpt_check_data, ckpt_load_model, struct ckpt_info */
#include "comm.h"       /* comm_single, struct comm */
#include "dist.h"       /* dist_init, dist_threads */

enum amp_status setup_model(struct model *m, const struct config *cfg, const struct data_spec *spec,
                            struct backend *be, enum precision_mode mode, int64_t max_batch, struct amp_error *err)
{
    struct autocast_policy policy;
    memset(m, 0, sizeof *m);
    enum amp_status st = autocast_from_config(&policy, mode, &cfg->precision.autocast, err);
    if (st == AMP_OK && (st = model_build(m, cfg, spec, be, &policy, max_batch, err)) != AMP_OK)
        memset(m, 0, sizeof *m); /* model_build freed what it built */
    return st;
}

/* Steps 1 to 3: the backend, its threads, and for training the communicator bound to it. */
static enum amp_status open_backend(struct setup *s, const struct config *cfg, const struct setup_opts *o,
                                    struct comm *comm, struct amp_error *err)
{
    char chosen[160];
    enum amp_status st = backend_open_rank(&s->be, o->device ? o->device : cfg->run.device, comm->local_rank,
                                           comm->local_world, chosen, sizeof chosen, err);
    if (st != AMP_OK)
        return st;
    if (o->announce)
        printf("%s\n", chosen);
    if (o->keep_threads)
        return AMP_OK;
    const int threads = dist_threads(comm, &cfg->run);
    if ((st = backend_set_threads(s->be, threads, err)) != AMP_OK)
        return st;
    if (o->announce && comm->rank == 0 && comm->world > 1 && s->be->set_threads) { /* CPU ranks: how they share */
        if (config_threads(&cfg->run) == 0)
            printf("threads: %d a rank (run.threads auto: the CPUs each of the %d ranks on this host has to itself)\n",
                   threads, comm->local_world);
        else if (comm->cpus > 0 && threads > comm->cpus)
            fprintf(stderr, "ampTrain: warning: %s: run.threads is %d but each of the %d ranks on this host has %d "
                    "CPU(s) to itself; their threads will share them (results are the same, only slower; auto takes "
                    "%d)\n", cfg->source, threads, comm->local_world, comm->cpus, comm->cpus);
    }
    s->be->allow_tf32 = o->tf32 && cfg->precision.tf32;
    if (o->dist)
        st = dist_init(o->dist, comm, s->be, &cfg->dist, err);
    return st;
}

/* Step 4 under SETUP_DATA_SPEC: the sample shape and classes the model is built for. A text or token model's come
 * from the config; an idx or hdf5 model's from the checkpoint's /data (written since 2026-12-05), else from its data
 * set, loaded for it into `ds` (freed once the model is built). */
static enum amp_status data_spec_only(const struct config *cfg, const struct setup_opts *o, struct dataset *ds,
                                      struct data_spec *spec, struct amp_error *err)
{
    if (data_spec_from_config(&cfg->data, spec))
        return AMP_OK;
    if (o->info && o->info->sample_ndim > 0) {
        memset(spec, 0, sizeof *spec);
        spec->sample_ndim = o->info->sample_ndim;
        memcpy(spec->sample_shape, o->info->sample_shape, sizeof spec->sample_shape);
        spec->num_classes = o->info->num_classes;
        spec->is_tokens = o->info->is_tokens;
        return AMP_OK;
    }
    enum amp_status st = data_load(ds, &cfg->data, 1, err);
    *spec = ds->spec;
    return st;
}

/* Step 4 under SETUP_DATA_TRAIN: every split, and at least one step's samples of them. */
static enum amp_status data_for_training(struct setup *s, const struct config *cfg, const struct comm *comm,
                                         struct amp_error *err)
{
    int64_t micro = cfg->data.batch_size, per_step = config_global_batch(micro, cfg->accum_steps, comm->world);
    /* docs/config.md bounds each count; the products the loop forms (samples per step, steps x samples per
     * step, (step x accum + micro) x ranks) must also fit in int64: keep them below 2^62. */
    if (per_step < 0)
        return amp_fail(err, AMP_ERR_CONFIG, "lower data.batch_size or accum_steps",
                        "%s: data.batch_size %lld x accum_steps %lld x %d ranks is more than 2^62 samples per step",
                        cfg->source, (long long)micro, (long long)cfg->accum_steps, comm->world);
    return data_load(s->ds, &cfg->data, per_step, err);
}

/* Step 4 under SETUP_DATA_SPLIT: one split, and the checkpoint's word that it is the run's data. */
static enum amp_status data_one_split(struct setup *s, const struct config *cfg, const struct setup_opts *o,
                                      struct amp_error *err)
{
    struct data_spec known = {.sample_ndim = o->info->sample_ndim, .num_classes = o->info->num_classes};
    bool checked = false;
    enum amp_status st = data_load_split(s->ds, &cfg->data, o->split, o->info->sample_ndim > 0 ? &known : NULL, err);
    if (st == AMP_OK) /* the data the run was trained on, wherever it is now */
        st = ckpt_check_data(o->ckpt, o->info, s->ds, &checked, err);
    s->data_unchecked = st == AMP_OK && !checked;
    return st;
}

enum amp_status setup_open(struct setup *s, const struct config *cfg, const struct setup_opts *o,
                           struct amp_error *err)
{
    s->be = NULL;
    s->data_unchecked = false;
    if (s->ds)
        memset(s->ds, 0, sizeof *s->ds);
    memset(s->model, 0, sizeof *s->model);
    struct comm *comm = o->comm ? o->comm : comm_single();
    enum amp_status st = open_backend(s, cfg, o, comm, err);
    struct dataset for_spec; /* SETUP_DATA_SPEC: read only for the sample shape */
    struct data_spec spec;
    memset(&for_spec, 0, sizeof for_spec);
    if (st == AMP_OK && o->data == SETUP_DATA_TRAIN)
        st = data_for_training(s, cfg, comm, err);
    else if (st == AMP_OK && o->data == SETUP_DATA_SPLIT)
        st = data_one_split(s, cfg, o, err);
    else if (st == AMP_OK)
        st = data_spec_only(cfg, o, &for_spec, &spec, err);
    if (st == AMP_OK)
        st = setup_model(s->model, cfg, o->data == SETUP_DATA_SPEC ? &spec : &s->ds->spec, s->be, o->mode,
                         o->max_batch, err);
    data_free(&for_spec);
    if (st == AMP_OK && o->ckpt)
        st = ckpt_load_model(o->ckpt, s->model, err);
    return st;
}

void setup_close(struct setup *s)
{
    if (s->model)
        model_free(s->model);
    if (s->ds)
        data_free(s->ds);
    backend_close(s->be);
    s->be = NULL;
}
