/*
 * export.c — a checkpoint's weights as a safetensors file (ampTrain export). See export.h.
 *
 * The checkpoint's tensors are read as they are stored (FP32), checked against the model its config builds, named
 * for the outside (lib/base/weight_names.h), converted to the asked dtype with round to nearest even (transposed where the
 * outside layout is (in, out)), and written atomically by lib/base/safetensors.c.
 */
#define _POSIX_C_SOURCE 200809L /* lstat, pread, O_NOFOLLOW: the look at OUT */
#include "export.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint.h"   /* ckpt_read_config, ckpt_read_weights, CKPT_MAGIC */
#include "runlog.h"       /* runlog_is_run_file: OUT may not be a run directory's file */
#include "safetensors.h"  /* safetensors_write, safetensors_sniff */
#include "setup.h"        /* setup_open: the model the checkpoint's tensors must be */
#include "weight_names.h" /* weight_name_outside, weight_names_aliases, weight_names_check */

#ifndef AMP_VERSION
#define AMP_VERSION "0.0.0"
#endif

/* Entry `s` named `name` holding t's values converted to `dt`, transposed where the outside layout is (in, out). */
static enum amp_status export_one(struct safetensor *s, const char *name, const struct ckpt_tensor *t, enum dtype dt,
                                  bool transpose, struct amp_error *err)
{
    size_t len = strlen(name) + 1;
    s->name = malloc(len);
    void *data = malloc(t->numel ? t->numel * dtype_size(dt) : 1);
    float *tr = transpose ? malloc(t->numel ? t->numel * sizeof *tr : 1) : NULL;
    s->data = data;
    if (!s->name || !data || (transpose && !tr)) {
        free(tr);
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "export: out of memory converting %s", t->name);
    }
    memcpy(s->name, name, len);
    s->dtype = dt;
    s->ndim = t->ndim;
    memcpy(s->shape, t->shape, sizeof s->shape);
    const float *from = t->data;
    if (transpose) { /* (out, in) -> (in, out) */
        int64_t r = t->shape[0], c = t->shape[1];
        for (int64_t i = 0; i < r; i++)
            for (int64_t j = 0; j < c; j++)
                tr[j * r + i] = t->data[i * c + j];
        s->shape[0] = c;
        s->shape[1] = r;
        from = tr;
    }
    dtype_convert(data, dt, from, DT_FP32, t->numel);
    s->nbytes = t->numel * dtype_size(dt);
    free(tr);
    return AMP_OK;
}

/* One tensor of the file before conversion: its outside name and the checkpoint tensor it holds; `alias` for a
 * tied table written again under its tying layer's state_dict name. */
struct export_entry {
    struct outside_name o;
    const struct ckpt_tensor *t;
    bool alias;
};

static int by_outside_name(const void *a, const void *b)
{
    return strcmp(((const struct export_entry *)a)->o.name, ((const struct export_entry *)b)->o.name);
}

/* Every tensor's name for the file (docs/checkpoint.md, "export"), and with --names pytorch each tied table again
 * under its tying layer's state_dict name; in name order. `e` holds w->n + 8 entries. */
static enum amp_status export_plan(const struct ckpt_weights *w, const struct model_config *mc,
                                   const struct export_opts *a, struct export_entry *e, int *n, struct amp_error *err)
{
    *n = 0;
    for (int i = 0; i < w->n; i++) {
        if (!weight_name_outside(mc, a->names, w->tensors[i].name, &e[*n].o))
            return amp_fail(err, AMP_ERR_CKPT, "the checkpoint's tensors do not belong to its config's model",
                            "export: %s: tensor /model/%s has no %s name", a->ckpt, w->tensors[i].name,
                            weight_names_names[a->names]);
        e[*n].t = &w->tensors[i];
        e[(*n)++].alias = false;
    }
    struct weight_alias al[8];
    int na = a->names == NAMES_PYTORCH ? weight_names_aliases(mc, a->names, al, 8) : 0;
    for (int k = 0; k < na && k < 8; k++)
        for (int i = 0; i < w->n; i++)
            if (!strcmp(w->tensors[i].name, al[k].target)) {
                e[*n] = (struct export_entry){.t = &w->tensors[i], .alias = true};
                _Static_assert(sizeof e->o.name == sizeof al[k].alias, "one name length");
                memcpy(e[(*n)++].o.name, al[k].alias, sizeof al[k].alias);
                break;
            }
    qsort(e, (size_t)*n, sizeof *e, by_outside_name);
    return AMP_OK;
}

/* An entry as a message names it: "/model/NAME (layer 'LAYER')", or the tied copy of a table. */
static void export_entry_describe(const struct export_entry *e, char *buf, size_t len)
{
    if (e->alias)
        snprintf(buf, len, "the tied copy of /model/%s", e->t->name);
    else
        snprintf(buf, len, "/model/%s (layer '%.*s')", e->t->name, (int)strcspn(e->t->name, "/"), e->t->name);
}

/* Two tensors under one name would make a file with a duplicate key, which readers (ours too) refuse: dotted
 * layer names (allowed) can meet nested ones when --names pytorch turns '/' into '.'. */
static enum amp_status export_check_unique(const struct export_entry *e, int n, const struct export_opts *a,
                                           struct amp_error *err)
{
    for (int i = 1; i < n; i++) {
        if (strcmp(e[i - 1].o.name, e[i].o.name) != 0)
            continue;
        char x[400], y[400];
        export_entry_describe(&e[i - 1], x, sizeof x);
        export_entry_describe(&e[i], y, sizeof y);
        return amp_fail(err, AMP_ERR_CONFIG,
                        "export with --names ampTrain (the checkpoint's own names, always unique); in later configs "
                        "give layers names without dots",
                        "export --names %s: %s and %s both become '%s': a safetensors file cannot hold two tensors "
                        "under one name", weight_names_names[a->names], x, y, e[i].o.name);
    }
    return AMP_OK;
}

/* The planned entries converted to `dt` into out[0..n). */
static enum amp_status export_tensors(const struct export_entry *e, int n, enum dtype dt, struct safetensor *out,
                                      size_t *bytes, struct amp_error *err)
{
    *bytes = 0;
    enum amp_status st = AMP_OK;
    for (int i = 0; i < n && st == AMP_OK; i++) {
        st = export_one(&out[i], e[i].o.name, e[i].t, dt, e[i].o.transpose, err);
        *bytes += out[i].nbytes;
    }
    return st;
}

/* A tensor of the checkpoint that the built model does not have (eval would ignore it, but export would write it as
 * if it were the model's): AMP_ERR_CKPT naming it. ckpt_load_model has found every tensor of the model. */
static enum amp_status export_check_no_extra(const char *ckpt, const struct model *m, const struct ckpt_weights *w,
                                             struct amp_error *err)
{
    for (int i = 0; i < w->n; i++) {
        bool known = false;
        for (int k = 0; k < m->nparams && !known; k++)
            known = !strcmp(w->tensors[i].name, m->params[k]->name);
        for (int k = 0; k < m->nbuffers && !known; k++)
            known = !strcmp(w->tensors[i].name, m->buffers[k]->name);
        if (!known)
            return amp_fail(err, AMP_ERR_CKPT,
                            "the checkpoint was edited or damaged after it was written: export an unedited one",
                            "export: %s: tensor /model/%s is not a tensor of the model its config describes", ckpt,
                            w->tensors[i].name);
    }
    return AMP_OK;
}

/* The checkpoint's tensors must be exactly the model's its config builds (names and shapes), as eval requires, or
 * a crafted shape would be written as the model's (a 3-D qkv weight exported uninitialised heap under hf-gpt2).
 * The model is built for one sample on the CPU backend and loaded with ckpt_load_model, the one check eval and
 * resume make (a missing tensor or another shape is AMP_ERR_CKPT naming it and both shapes); then no tensor may be
 * left over. A text or token model's input comes from the config; an idx or hdf5 model's sample shape and classes
 * from the checkpoint's /data (written since 2026-12-05), else from its data set, loaded as eval loads it. */
static enum amp_status export_check_model(const char *ckpt, const struct config *cfg, const struct ckpt_weights *w,
                                          struct amp_error *err)
{
    struct model m;
    struct setup s = {.model = &m}; /* shapes do not depend on the precision; nothing is computed: one thread */
    enum amp_status st = setup_open(&s, cfg,
                                    &(struct setup_opts){.device = "cpu", .keep_threads = true, .data = SETUP_DATA_SPEC,
                                                         .ckpt = ckpt, .info = &w->info, .mode = PREC_FP32,
                                                         .max_batch = 1},
                                    err);
    if (st == AMP_OK)
        st = export_check_no_extra(ckpt, &m, w, err);
    setup_close(&s);
    return st;
}

/* What `out` is, as a noun phrase for "OUT '...' is ..." (empty when export may write there: absent, or an earlier
 * export). lstat, so a symbolic link is itself refused (rename would replace the link, not what it names); a FIFO
 * or a device is never opened, and a regular file is opened without blocking or following a link. */
static void export_out_kind(const char *out, const struct stat *input, char *what, size_t len)
{
    struct stat sb;
    what[0] = '\0';
    if (lstat(out, &sb) != 0)
        return; /* absent (or unreachable: the write names the error) */
    const char *kind = S_ISDIR(sb.st_mode)    ? "a directory"
                       : S_ISCHR(sb.st_mode)  ? "a character device"
                       : S_ISBLK(sb.st_mode)  ? "a block device"
                       : S_ISFIFO(sb.st_mode) ? "a FIFO"
                       : S_ISSOCK(sb.st_mode) ? "a socket"
                       : S_ISLNK(sb.st_mode)  ? "a symbolic link"
                       : NULL;
    if (kind) {
        snprintf(what, len, "%s", kind);
        return;
    }
    if (sb.st_dev == input->st_dev && sb.st_ino == input->st_ino) {
        snprintf(what, len, "the checkpoint being exported");
        return;
    }
    unsigned char head[9] = {0};
    int fd = open(out, O_RDONLY | O_NOFOLLOW | O_NONBLOCK);
    ssize_t got = fd >= 0 ? pread(fd, head, sizeof head, 0) : -1;
    if (fd >= 0)
        close(fd);
    if (got == (ssize_t)sizeof head && safetensors_sniff(head, (size_t)sb.st_size))
        return;
    const char *base = strrchr(out, '/') ? strrchr(out, '/') + 1 : out;
    if (runlog_is_run_file(base)) {
        snprintf(what, len, "a run directory's %s", base);
        return;
    }
    if (got >= 8 && !memcmp(head, CKPT_MAGIC, 8))
        snprintf(what, len, "an ampTrain checkpoint");
    else
        snprintf(what, len, "a regular file that is not a safetensors file");
}

/* OUT must be absent or an earlier export: export replaces nothing else (docs/checkpoint.md, "export"). Checked
 * before any work, so a mistyped argument costs nothing. */
enum amp_status export_check_out(const char *out, const char *ckpt, struct amp_error *err)
{
    struct stat input = {0};
    if (stat(ckpt, &input) != 0)
        input.st_ino = (ino_t)-1;
    char what[96];
    export_out_kind(out, &input, what, sizeof what);
    if (!what[0])
        return AMP_OK;
    return amp_fail(err, AMP_ERR_CONFIG,
                    "give OUT a new file name (e.g. model.safetensors); export replaces only a file that is already a "
                    "safetensors file, an earlier export",
                    "export: OUT '%s' is %s; export writes a new file or over an earlier export, nothing else", out,
                    what);
}

enum amp_status export_checkpoint(const struct export_opts *o, struct export_result *r, struct amp_error *err)
{
    enum amp_status st;
    struct config cfg; /* the model's layers give the names */
    if ((st = ckpt_read_config(o->ckpt, &cfg, err)) != AMP_OK)
        return st;
    if ((st = weight_names_check(&cfg.model, o->names, "export --names hf-gpt2", err)) != AMP_OK) {
        config_free(&cfg);
        return st;
    }
    struct ckpt_weights w;
    if ((st = ckpt_read_weights(o->ckpt, &w, err)) != AMP_OK) {
        config_free(&cfg);
        return st;
    }
    if ((st = export_check_model(o->ckpt, &cfg, &w, err)) != AMP_OK) {
        ckpt_weights_free(&w);
        config_free(&cfg);
        return st;
    }
    struct safetensor *tensors = calloc((size_t)w.n + 8, sizeof *tensors);
    struct export_entry *plan = calloc((size_t)w.n + 8, sizeof *plan);
    size_t bytes = 0;
    int n = 0;
    st = tensors && plan ? export_plan(&w, &cfg.model, o, plan, &n, err)
                         : amp_fail(err, AMP_ERR_INTERNAL, NULL, "export: out of memory");
    if (st == AMP_OK)
        st = export_check_unique(plan, n, o, err);
    if (st == AMP_OK)
        st = export_tensors(plan, n, o->dtype, tensors, &bytes, err);
    const char *names = weight_names_names[o->names];
    if (st == AMP_OK) {
        const char *base = strrchr(o->ckpt, '/') ? strrchr(o->ckpt, '/') + 1 : o->ckpt;
        char step[32];
        snprintf(step, sizeof step, "%lld", (long long)w.info.step);
        const struct safetensors_meta meta[] = {
            {"format", "pt"},
            {"producer", "ampTrain " AMP_VERSION},
            {"checkpoint", base},
            {"step", step},
            {"names", names},
            {"dtype", dtype_name(o->dtype)},
        };
        st = safetensors_write(o->out, tensors, n, meta, (int)(sizeof meta / sizeof meta[0]), err);
    }
    if (st == AMP_OK)
        *r = (struct export_result){.ntensors = n, .bytes = bytes, .step = w.info.step};
    for (int i = 0; tensors && i < n; i++) {
        free(tensors[i].name);
        free((void *)tensors[i].data);
    }
    free(tensors);
    free(plan);
    ckpt_weights_free(&w);
    config_free(&cfg);
    return st;
}

