/*
 * init_from.c — model.init_from (init_from.h has the contract).
 *
 * The file's tensors become a list of sources (name, dtype, shape, bytes): the safetensors reader's entries,
 * or a checkpoint's /model tensors (fp32) from ckpt_read_weights, which verifies the checkpoint as resume does.
 * Then three passes: match every model tensor to a source by its outside name (lists of missing keys and shape
 * mismatches), mark the sources nothing took (unexpected keys), and, when the lists allow it, convert every
 * matched source to fp32 on the host (transposing Conv1D weights), check its values, and only after every
 * check upload them all.
 */
#define _POSIX_C_SOURCE 200809L
#include "init_from.h"

#include <fcntl.h> /* open: O_NONBLOCK */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h> /* pread, close */

#include "checkpoint.h"   /* ckpt_resolve, ckpt_read_weights */
#include "dtype.h"        /* dtype_convert, dtype_round */
#include "safetensors.h"  /* safetensors_read */
#include "weight_names.h" /* weight_name_outside, weight_names_aliases, weight_names_check */

#define HINT_NAMES "set model.init_names to the file's naming (ampTrain, pytorch or hf-gpt2), or model.init_strict: " \
                   "false to load what matches"
#define MAX_LISTED 12 /* names listed per kind of mismatch; the rest are counted */

struct source {
    const char *name;
    enum dtype dtype;
    int ndim;
    int64_t shape[8];
    const void *data;
    size_t numel;
    bool used;
};

struct sources {
    struct source *s;
    int n;
    struct safetensors_file st;
    struct ckpt_weights ck;
    bool hf_bare;              /* hf-gpt2 keys without the "transformer." prefix (the original gpt2 upload) */
};

/* One model tensor and where it comes from. */
struct target {
    const char *ours;
    struct tensor *t;
    bool nonneg;
    struct outside_name out;
    struct source *src;
};

/* A growing list of names for the error message. */
struct listing {
    char text[4096];
    size_t len;
    int count;
};

static void listing_add(struct listing *l, const char *fmt, const char *a, const char *b)
{
    if (l->count++ >= MAX_LISTED || l->len >= sizeof l->text - 1)
        return;
    int n = snprintf(l->text + l->len, sizeof l->text - l->len, "%s", l->count > 1 ? ", " : "");
    l->len += (size_t)n < sizeof l->text - l->len ? (size_t)n : 0;
    n = snprintf(l->text + l->len, sizeof l->text - l->len, fmt, a, b);
    if (n > 0)
        l->len = l->len + (size_t)n < sizeof l->text ? l->len + (size_t)n : sizeof l->text - 1;
}

static void listing_end(struct listing *l)
{
    if (l->count > MAX_LISTED) {
        char more[48];
        snprintf(more, sizeof more, " and %d more", l->count - MAX_LISTED);
        size_t room = sizeof l->text - l->len;
        snprintf(l->text + l->len, room, "%s", more);
    }
}

/* Is `path` (or the directory's latest) an ampTrain checkpoint? Its user block starts "AMPTCKPT". Anything but a
 * directory or a regular file is refused here: opened without O_NONBLOCK, a FIFO waits for a writer for ever. A
 * path that cannot be opened is left to the safetensors reader, which names the reason. */
static enum amp_status is_checkpoint(const char *path, bool *yes, struct amp_error *err)
{
    *yes = false;
    int fd = open(path, O_RDONLY | O_NONBLOCK);
    if (fd < 0)
        return AMP_OK;
    struct stat sb;
    char magic[8] = {0};
    bool regular = fstat(fd, &sb) == 0 && S_ISREG(sb.st_mode), dir = !regular && S_ISDIR(sb.st_mode);
    *yes = dir || (regular && pread(fd, magic, sizeof magic, 0) == (ssize_t)sizeof magic &&
                   !memcmp(magic, "AMPTCKPT", 8));
    close(fd);
    if (!regular && !dir)
        return amp_fail(err, AMP_ERR_CKPT, "give the path of a .safetensors file or of an ampTrain checkpoint",
                        "model.init_from: %s is not a regular file (a FIFO, device or socket is not read)", path);
    return AMP_OK;
}

static void sources_free(struct sources *s)
{
    free(s->s);
    safetensors_free(&s->st);
    ckpt_weights_free(&s->ck);
}

/* What to do when the file does not match: where only shapes differ, the names are right and the model is not the
 * file's; where the file's metadata names its naming (an ampTrain export writes "names") and model.init_names says
 * another, set that; else the general advice. */
static void init_from_hint(const struct sources *s, const struct model_config *mc, bool shapes_only, char *hint,
                           size_t len)
{
    const char *names = NULL;
    for (int i = 0; i < s->st.nmeta; i++)
        if (!strcmp(s->st.meta_keys[i], "names"))
            names = s->st.meta_values[i];
    if (shapes_only)
        snprintf(hint, len, "the names match but the shapes do not: the file holds another model; make model.layers "
                            "the file's (widths, heads, vocabulary, max_len)");
    else if (names && strcmp(names, weight_names_names[mc->init_names]) != 0)
        snprintf(hint, len, "the file says its names are %.64s: set model.init_names=%.64s", names, names);
    else
        snprintf(hint, len, "%s", HINT_NAMES);
}

static enum amp_status sources_read(struct sources *s, const struct model_config *mc, struct amp_error *err)
{
    memset(s, 0, sizeof *s);
    const char *path = mc->init_from;
    bool checkpoint = false;
    enum amp_status st = is_checkpoint(path, &checkpoint, err);
    if (st != AMP_OK)
        return st;
    if (checkpoint) {
        if (mc->init_names != NAMES_AMPTRAIN)
            return amp_fail(err, AMP_ERR_CONFIG, "leave out model.init_names (or set it to ampTrain) for a checkpoint",
                            "model.init_from: %s is an ampTrain checkpoint, whose tensors have ampTrain names, but "
                            "model.init_names is %s", path, weight_names_names[mc->init_names]);
        char resolved[CFG_STR + 64];
        if ((st = ckpt_resolve(path, resolved, sizeof resolved, err)) != AMP_OK ||
            (st = ckpt_read_weights(resolved, &s->ck, err)) != AMP_OK)
            return st;
        s->n = s->ck.n;
    } else {
        if ((st = safetensors_read(path, &s->st, err)) != AMP_OK)
            return st;
        s->n = s->st.ntensors;
    }
    s->s = calloc((size_t)(s->n ? s->n : 1), sizeof *s->s);
    if (!s->s)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory reading %s", path);
    for (int i = 0; i < s->n; i++) {
        struct source *x = &s->s[i];
        if (s->ck.tensors) {
            const struct ckpt_tensor *c = &s->ck.tensors[i];
            *x = (struct source){.name = c->name, .dtype = DT_FP32, .ndim = c->ndim, .data = c->data, .numel = c->numel};
            memcpy(x->shape, c->shape, sizeof x->shape);
        } else {
            const struct safetensor *t = &s->st.tensors[i];
            *x = (struct source){.name = t->name, .dtype = t->dtype, .ndim = t->ndim, .data = t->data,
                                 .numel = t->nbytes / dtype_size(t->dtype)};
            memcpy(x->shape, t->shape, sizeof x->shape);
        }
    }
    if (mc->init_names == NAMES_HF_GPT2) {
        bool prefixed = false;
        for (int i = 0; i < s->n; i++)
            prefixed |= !strncmp(s->s[i].name, "transformer.", 12);
        s->hf_bare = !prefixed;
    }
    return AMP_OK;
}

static struct source *source_find(struct sources *s, const char *name)
{
    const char *bare = s->hf_bare && !strncmp(name, "transformer.", 12) ? name + 12 : name;
    for (int i = 0; i < s->n; i++)
        if (!strcmp(s->s[i].name, bare))
            return &s->s[i];
    return NULL;
}

/* The source's values as fp32, in the file's layout. */
static float *source_values(const struct source *x)
{
    float *v = malloc((x->numel ? x->numel : 1) * sizeof *v);
    if (v)
        dtype_convert(v, DT_FP32, x->data, x->dtype, x->numel);
    return v;
}

/* A (rows, cols) matrix in place as (cols, rows): Conv1D's (in, out) into our (out, in). */
static bool transpose_in_place(float *v, int64_t rows, int64_t cols)
{
    size_t n = (size_t)rows * (size_t)cols;
    float *t = malloc((n ? n : 1) * sizeof *t);
    if (!t)
        return false;
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++)
            t[j * rows + i] = v[i * cols + j];
    memcpy(v, t, n * sizeof *t);
    free(t);
    return true;
}

static bool shape_fits(const struct source *x, const struct tensor *t, bool transpose)
{
    if (x->ndim != t->ndim)
        return false;
    if (transpose && x->ndim == 2)
        return x->shape[0] == t->shape[1] && x->shape[1] == t->shape[0];
    for (int i = 0; i < x->ndim; i++)
        if (x->shape[i] != t->shape[i])
            return false;
    return true;
}

/* Every value finite (and >= 0 where nonneg), and within the master's range where it is bf16. */
static enum amp_status check_values(const char *path, const char *name, const float *v, size_t n, bool nonneg,
                                    enum dtype store, struct amp_error *err)
{
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(v[i]) || (nonneg && v[i] < 0.0f))
            return amp_fail(err, AMP_ERR_CKPT, "the file's weights are damaged: export or save them again",
                            "model.init_from: %s: tensor %s holds %g at element %zu; every value must be finite%s",
                            path, name, (double)v[i], i, nonneg ? " and >= 0" : "");
        if (store != DT_FP32 && !isfinite(dtype_round(v[i], store)))
            return amp_fail(err, AMP_ERR_CKPT, "train with precision.master_weights: fp32",
                            "model.init_from: %s: tensor %s holds %g at element %zu, beyond %s's range (this run "
                            "keeps its weights in %s)", path, name, (double)v[i], i, dtype_name(store),
                            dtype_name(store));
    }
    return AMP_OK;
}

static enum amp_status upload(struct tensor *t, const float *v, struct amp_error *err)
{
    if (t->dtype == DT_FP32) {
        tensor_from_host_f32(t, v);
        return AMP_OK;
    }
    void *narrow = malloc(tensor_bytes(t) ? tensor_bytes(t) : 1);
    if (!narrow)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory loading model.init_from");
    dtype_convert(narrow, t->dtype, v, DT_FP32, t->numel);
    t->be->upload(t->be, t->data, narrow, tensor_bytes(t));
    free(narrow);
    return AMP_OK;
}

/* The model's tensors and their outside names. */
static struct target *targets_of(struct model *m, const struct model_config *mc, int *n)
{
    *n = m->nparams + m->nbuffers;
    struct target *t = calloc((size_t)(*n ? *n : 1), sizeof *t);
    if (!t)
        return NULL;
    for (int i = 0; i < m->nparams; i++)
        t[i] = (struct target){.ours = m->params[i]->name, .t = &m->params[i]->master};
    for (int i = 0; i < m->nbuffers; i++)
        t[m->nparams + i] = (struct target){.ours = m->buffers[i]->name, .t = &m->buffers[i]->t,
                                            .nonneg = m->buffers[i]->nonneg};
    for (int i = 0; i < *n; i++)
        if (!weight_name_outside(mc, mc->init_names, t[i].ours, &t[i].out))
            snprintf(t[i].out.name, sizeof t[i].out.name, "%s", t[i].ours); /* never for a checked model */
    return t;
}

/* A tied table's alias in the file must hold the table's values. */
static bool alias_agrees(const struct source *alias, const struct target *table)
{
    if (!table->src || !shape_fits(alias, table->t, false) || alias->numel != table->src->numel)
        return false;
    float *a = source_values(alias), *b = source_values(table->src);
    bool same = a && b && (!table->out.transpose || transpose_in_place(b, table->src->shape[0], table->src->shape[1])) &&
                !memcmp(a, b, alias->numel * sizeof *a);
    free(a);
    free(b);
    return same;
}

enum amp_status init_from_load(struct model *m, const struct model_config *mc, FILE *report, struct amp_error *err)
{
    const char *path = mc->init_from;
    enum amp_status st = weight_names_check(mc, mc->init_names, "model.init_names", err);
    if (st != AMP_OK)
        return st;
    struct sources src;
    if ((st = sources_read(&src, mc, err)) != AMP_OK) {
        sources_free(&src);
        return st;
    }
    int nt = 0;
    struct target *tg = targets_of(m, mc, &nt);
    float **vals = calloc((size_t)(nt ? nt : 1), sizeof *vals);
    if (!tg || !vals) {
        free(tg);
        free(vals);
        sources_free(&src);
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory loading %s", path);
    }
    struct listing missing = {0}, unexpected = {0}, shapes = {0};
    for (int i = 0; i < nt; i++) {
        struct source *x = source_find(&src, tg[i].out.name);
        if (!x) {
            listing_add(&missing, "%s%s", tg[i].out.name, "");
            continue;
        }
        x->used = true;
        if (!shape_fits(x, tg[i].t, tg[i].out.transpose)) {
            char a[160], b[160], what[400];
            shape_str(a, sizeof a, x->ndim, x->shape);
            int64_t want[8] = {0};
            for (int d = 0; d < tg[i].t->ndim && d < TENSOR_MAX_DIMS; d++)
                want[d] = tg[i].out.transpose && tg[i].t->ndim == 2 ? tg[i].t->shape[1 - d] : tg[i].t->shape[d];
            shape_str(b, sizeof b, tg[i].t->ndim, want);
            snprintf(what, sizeof what, " %s in the file, %s in the model", a, b);
            listing_add(&shapes, "%s%s", x->name, what);
            continue;
        }
        tg[i].src = x;
    }
    struct weight_alias aliases[8];
    int na = weight_names_aliases(mc, mc->init_names, aliases, 8);
    for (int a = 0; a < na && a < 8; a++) {
        struct source *x = source_find(&src, aliases[a].alias);
        if (!x)
            continue; /* a tied alias may be left out (save_pretrained leaves lm_head.weight out) */
        x->used = true;
        const struct target *table = NULL;
        for (int i = 0; i < nt; i++)
            if (!strcmp(tg[i].ours, aliases[a].target))
                table = &tg[i];
        if (table && table->src && !alias_agrees(x, table)) {
            char what[WEIGHT_NAME_MAX + 64];
            snprintf(what, sizeof what, " holds other values than %s, and the model ties the two", table->src->name);
            listing_add(&shapes, "%s%s", x->name, what);
        }
    }
    for (int i = 0; i < src.n; i++)
        if (!src.s[i].used && !weight_name_ignorable(mc->init_names, src.s[i].name))
            listing_add(&unexpected, "%s%s", src.s[i].name, "");
    listing_end(&missing);
    listing_end(&unexpected);
    listing_end(&shapes);
    bool clean = !missing.count && !unexpected.count && !shapes.count;
    char summary[3 * sizeof missing.text + 64];
    snprintf(summary, sizeof summary, "%s%s%s%s%s%s%s%s%s", missing.count ? "missing keys: " : "", missing.text,
             missing.count && (unexpected.count || shapes.count) ? "; " : "", unexpected.count ? "unexpected keys: " : "",
             unexpected.text, unexpected.count && shapes.count ? "; " : "", shapes.count ? "mismatches: " : "",
             shapes.text, "");
    if (!clean && mc->init_strict) {
        char hint[512];
        init_from_hint(&src, mc, !missing.count && !unexpected.count, hint, sizeof hint);
        st = amp_fail(err, AMP_ERR_CKPT, hint, "model.init_from: %s does not match the model (%s names, strict): %s",
                      path, weight_names_names[mc->init_names], summary);
    }
    int loaded = 0;
    for (int i = 0; i < nt && st == AMP_OK; i++) {
        if (!tg[i].src)
            continue;
        const struct source *x = tg[i].src;
        vals[i] = source_values(x);
        if (!vals[i])
            st = amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory loading %s", path);
        else /* in the file's layout, so that the element named is the file's */
            st = check_values(path, x->name, vals[i], x->numel, tg[i].nonneg, tg[i].t->dtype, err);
        if (st == AMP_OK && tg[i].out.transpose && !transpose_in_place(vals[i], x->shape[0], x->shape[1]))
            st = amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory loading %s", path);
    }
    for (int i = 0; i < nt && st == AMP_OK; i++)
        if (vals[i] && (st = upload(tg[i].t, vals[i], err)) == AMP_OK)
            loaded++;
    if (st == AMP_OK) {
        model_refresh_copies(m);
        if (report && !clean)
            fprintf(stderr, "ampTrain: warning: model.init_from: %s does not match the model (%s names; "
                    "model.init_strict is false, so the rest keeps model.init): %s\n", path,
                    weight_names_names[mc->init_names], summary);
        if (report)
            fprintf(report, "init_from: %d of %d tensors from %s (%s names)\n", loaded, nt, path,
                    weight_names_names[mc->init_names]);
    }
    for (int i = 0; i < nt; i++)
        free(vals[i]);
    free(vals);
    free(tg);
    sources_free(&src);
    return st;
}
