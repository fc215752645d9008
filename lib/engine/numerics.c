/*
 * numerics.c — per-tensor range figures against fp16, bf16, E4M3 and E5M2, and the advice they give
 * (numerics.h). The classification is by thresholds derived from each format's rounding (round to nearest,
 * ties to even, with subnormals); num_round is the definition and tests/test_numerics.c checks the two
 * against each other and against the exact fp16/bf16 conversions of dtype.c.
 */
#define _POSIX_C_SOURCE 200809L
#include "numerics.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint.h" /* ckpt_load_trainer: numerics of a checkpoint */
#include "init_from.h"  /* init_from_load: numerics of a CONFIG that starts from a file */
#include "runlog.h"     /* runlog_make_dirs: the report's directory and its parents */
#include "setup.h"      /* setup_model: the FP32 shadow of the run's model */
#include "backend.h"
#include "dtype.h"    /* dtype_convert, double_to_text */

static const struct num_format_info formats[NF_COUNT] = {
    [NF_FP16] = {"fp16", 10, -14, 65504.0},
    [NF_BF16] = {"bf16", 7, -126, 3.3895313892515355e38}, /* (2 - 2^-7) * 2^127 */
    [NF_E4M3] = {"e4m3", 3, -6, 448.0},
    [NF_E5M2] = {"e5m2", 2, -14, 57344.0},
};

const struct num_format_info *num_format(enum num_format f) { return &formats[f]; }

double num_round(double x, enum num_format f)
{
    if (x == 0.0 || isnan(x) || isinf(x))
        return x;
    const struct num_format_info *fi = &formats[f];
    double a = fabs(x);
    int e = ilogb(a); /* a in [2^e, 2^(e+1)) */
    if (e < fi->emin)
        e = fi->emin; /* subnormals: the quantum of the smallest normal binade */
    double q = ldexp(1.0, e - fi->mant_bits);
    double r = nearbyint(a / q) * q; /* the default rounding mode: nearest, ties to even */
    return copysign(r > fi->max ? INFINITY : r, x);
}

/* Thresholds on |x| equivalent to num_round's outcome. */
struct thresholds {
    double over;      /* |x| > over overflows; == over too when over_tie */
    bool over_tie;
    double flush;     /* 0 < |x| <= flush rounds to zero (the tie goes to even, which is zero) */
    double sub;       /* flush < |x| < sub lands in a subnormal */
};

static struct thresholds thresholds_of(enum num_format f)
{
    const struct num_format_info *fi = &formats[f];
    double ulp_max = ldexp(1.0, ilogb(fi->max) - fi->mant_bits);
    double q_sub = ldexp(1.0, fi->emin - fi->mant_bits);
    /* the tie above max rounds up (to overflow) when max's last mantissa bit is odd */
    bool odd = fmod(fi->max / ulp_max, 2.0) == 1.0;
    return (struct thresholds){
        .over = fi->max + ulp_max / 2,
        .over_tie = odd,
        .flush = q_sub / 2,
        /* the largest subnormal's last bit is odd: the tie below the smallest normal rounds up to it */
        .sub = ldexp(1.0, fi->emin) - q_sub / 2,
    };
}

void num_stats_add(struct num_stats *s, const float *ref, const float *run, size_t n)
{
    struct thresholds th[NF_COUNT];
    for (int f = 0; f < NF_COUNT; f++)
        th[f] = thresholds_of((enum num_format)f);
    if (s->n == 0)
        s->min_nonzero = INFINITY;
    for (size_t i = 0; i < n; i++) {
        double v = ref[i], a = fabs(v);
        s->n++;
        if (run) {
            double d = (double)run[i] - v;
            s->err_sumsq += d * d;
            s->ref_sumsq += v * v;
        }
        if (!isfinite(v)) { /* the FP32 shadow itself overflowed: every format does */
            for (int f = 0; f < NF_COUNT; f++)
                s->overflow[f]++;
            s->absmax = INFINITY;
            continue;
        }
        s->sumsq += v * v;
        if (a == 0.0)
            continue;
        s->nonzero++;
        if (a > s->absmax)
            s->absmax = a;
        if (a < s->min_nonzero)
            s->min_nonzero = a;
        int e = ilogb(a);
        e = e < NUM_HIST_MIN ? NUM_HIST_MIN : e > NUM_HIST_MAX ? NUM_HIST_MAX : e;
        s->hist[e - NUM_HIST_MIN]++;
        if (a == ldexp(1.0, ilogb(a)))
            s->pow2[e - NUM_HIST_MIN]++;
        for (int f = 0; f < NF_COUNT; f++) {
            if (a > th[f].over || (a == th[f].over && th[f].over_tie))
                s->overflow[f]++;
            else if (a <= th[f].flush)
                s->flush[f]++;
            else if (a < th[f].sub)
                s->subnormal[f]++;
        }
    }
}

static void stats_merge(struct num_stats *into, const struct num_stats *s)
{
    if (into->n == 0)
        into->min_nonzero = INFINITY;
    into->n += s->n;
    into->nonzero += s->nonzero;
    into->absmax = fmax(into->absmax, s->absmax);
    into->sumsq += s->sumsq;
    if (s->nonzero)
        into->min_nonzero = fmin(into->min_nonzero, s->min_nonzero);
    for (int f = 0; f < NF_COUNT; f++) {
        into->overflow[f] += s->overflow[f];
        into->flush[f] += s->flush[f];
        into->subnormal[f] += s->subnormal[f];
    }
    for (size_t i = 0; i < sizeof s->hist / sizeof s->hist[0]; i++) {
        into->hist[i] += s->hist[i];
        into->pow2[i] += s->pow2[i];
    }
    into->err_sumsq += s->err_sumsq;
    into->ref_sumsq += s->ref_sumsq;
}

/* Nonzero elements (of figures measured at `scale`, a power of two) that flush to zero in fp16 at scale 2^k,
 * i.e. whose magnitude there is at most 2^-25 (the tie with zero): all of a binade [2^e, 2^(e+1)) at scale
 * 2^k that lies below 2^-25, and the exact power 2^-25 itself. */
static int64_t flushed_at(const struct num_stats *g, double scale, int k)
{
    int shift = (int)floor(log2(scale));
    int64_t count = 0;
    for (int e = NUM_HIST_MIN; e <= NUM_HIST_MAX; e++) {
        int at = e - shift + k; /* binade [2^at, 2^(at+1)) at scale 2^k */
        if (at <= -26)
            count += g->hist[e - NUM_HIST_MIN];
        else if (at == -25)
            count += g->pow2[e - NUM_HIST_MIN];
    }
    return count;
}

#define WINDOW_LIMIT 60 /* scales searched: 2^-60 .. 2^60 */

void num_scale_window(const struct num_stats *g, double scale, double underflow, int *lo, int *hi)
{
    if (g->nonzero == 0 || !(scale > 0)) {
        *lo = -WINDOW_LIMIT;
        *hi = WINDOW_LIMIT;
        return;
    }
    /* largest k with absmax at scale 2^k at most fp16's max */
    double unit_max = g->absmax / scale;
    *hi = isfinite(unit_max) ? (int)floor(log2(formats[NF_FP16].max / unit_max)) : -WINDOW_LIMIT;
    if (*hi > WINDOW_LIMIT)
        *hi = WINDOW_LIMIT;
    *lo = WINDOW_LIMIT + 1;
    for (int k = -WINDOW_LIMIT; k <= WINDOW_LIMIT; k++)
        if ((double)flushed_at(g, scale, k) <= underflow * (double)g->nonzero) {
            *lo = k;
            break;
        }
}

/* ---- measuring -------------------------------------------------------------------------------------- */

static const char *const kind_names[NK_COUNT] = {"activation", "act_grad", "weight_grad"};

static void add_tensor(struct numerics *nm, const char *name, enum num_kind kind, int layer, int param)
{
    struct num_tensor *t = &nm->tensors[nm->ntensors++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->kind = kind;
    t->layer = layer;
    t->param = param;
}

/* The tensors measured: each layer's output activation and the gradient reaching it, and each parameter's
 * gradient. The loss (its output is per-row losses) and flatten (a view) have none of their own (a relu is
 * fused into the batchnorm2d or linear layer before it only where no report is taken: layer_build.fuse). */
static int count_or_list(struct numerics *nm, const struct model *m, bool list)
{
    int n = 0;
    for (int i = 0; i + 1 < m->nlayers; i++) {
        const struct layer *l = &m->layers[i];
        if (l->is_view)
            continue;
        if (list)
            add_tensor(nm, l->cfg.name, NK_ACTIVATION, i, 0);
        n++;
        if (m->layers[i + 1].needs_dx) {
            if (list)
                add_tensor(nm, l->cfg.name, NK_ACT_GRAD, i, 0);
            n++;
        }
        for (int p = 0; p < l->nparams; p++) {
            if (list)
                add_tensor(nm, l->params[p].name, NK_WEIGHT_GRAD, i, p);
            n++;
        }
    }
    return n;
}

/* The tensor a measured entry refers to, in model m (the run's or the shadow). */
static const struct tensor *tensor_of(const struct model *m, const struct num_tensor *e)
{
    const struct layer *l = &m->layers[e->layer];
    switch (e->kind) {
    case NK_ACTIVATION: return &l->y;
    case NK_ACT_GRAD: return &m->layers[e->layer + 1].dx;
    default: return &l->params[e->param].grad;
    }
}

static const char *fp8_name(const struct model *m, int i)
{
    return i < m->fp8.fwd.n ? m->fp8.fwd.names[i] : m->fp8.bwd.names[i - m->fp8.fwd.n];
}

enum amp_status numerics_open(struct numerics *nm, struct trainer *t, const char *dir, const char *name, bool fresh,
                              struct amp_error *err)
{
    memset(nm, 0, sizeof *nm);
    const struct config *cfg = t->cfg;
    /* every layer's own output is measured: the run's model must keep a relu apart from the batchnorm before it
     * (model_build fuses them only where run.numerics_every is 0), as the shadow built below does */
    for (int i = 0; i < t->model.nlayers; i++)
        if (t->model.layers[i].is_view && t->model.layers[i].cfg.kind != LAYER_FLATTEN)
            return amp_fail(err, AMP_ERR_INTERNAL, "this is a bug: set run.numerics_every before trainer_setup",
                            "numerics: layer '%s' is fused into the one before it", t->model.layers[i].cfg.name);
    struct config shadow_cfg = *cfg; /* read only; fp32 masters, whatever the run keeps */
    shadow_cfg.precision.master_weights = STORE_FP32;
    enum amp_status st = setup_model(&nm->shadow, &shadow_cfg, &t->ds.spec, t->be, PREC_FP32, cfg->data.batch_size,
                                     err);
    nm->built = true; /* a failed build leaves it zeroed: model_free has nothing to do */
    if (st == AMP_ERR_INTERNAL) { /* out of memory, most likely: say what the shadow costs */
        double bytes = 0; /* FP32: weights and gradients, every layer's output and input gradient */
        for (int i = 0; i < t->model.nparams; i++)
            bytes += 8.0 * (double)t->model.params[i]->master.numel;
        for (int i = 0; i < t->model.nlayers; i++)
            bytes += 4.0 * (double)(t->model.layers[i].y.numel + t->model.layers[i].dx.numel);
        char why[sizeof err->msg];
        snprintf(why, sizeof why, "%s", err->msg);
        return amp_fail(err, AMP_ERR_INTERNAL,
                        "lower data.batch_size: the shadow's activations scale with it",
                        "numerics: the FP32 shadow of the model (a second copy of every weight, gradient and "
                        "activation, in FP32: about %.0f MiB) does not fit: %s", bytes / (1 << 20), why);
    }
    if (st != AMP_OK)
        return st;
    int n = count_or_list(nm, &t->model, false);
    nm->tensors = calloc((size_t)(n ? n : 1), sizeof *nm->tensors);
    if (!nm->tensors)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory");
    count_or_list(nm, &t->model, true);
    nm->scale = 1.0;
    if (t->model.has_fp8) {
        nm->nfp8 = t->model.fp8.fwd.n + t->model.fp8.bwd.n;
        size_t bytes = 4 * (size_t)(nm->nfp8 ? nm->nfp8 : 1) * sizeof(int64_t);
        nm->fp8_counts = t->be->alloc(t->be, bytes);
        nm->fp8_total = calloc(1, bytes);
        nm->fp8_scale = calloc((size_t)(nm->nfp8 ? nm->nfp8 : 1), sizeof(float));
        nm->fp8_names = calloc((size_t)(nm->nfp8 ? nm->nfp8 : 1), sizeof *nm->fp8_names);
        if (!nm->fp8_counts || !nm->fp8_total || !nm->fp8_scale || !nm->fp8_names)
            return amp_fail(err, AMP_ERR_INTERNAL, NULL, "numerics: out of memory for the fp8 counters");
        nm->fp8_nfwd = t->model.fp8.fwd.n;
        for (int i = 0; i < nm->nfp8; i++)
            memcpy(nm->fp8_names[i], fp8_name(&t->model, i), sizeof nm->fp8_names[i]);
    }
    if (dir) {
        char path[CFG_STR + 64];
        snprintf(path, sizeof path, "%s/%s", dir, name);
        enum amp_status made = runlog_make_dirs(dir, err); /* and its parents, as `run` makes them */
        if (made != AMP_OK)
            return made;
        fresh = fresh || access(path, F_OK) != 0;
        if (!(nm->csv = fopen(path, fresh ? "w" : "a")))
            return amp_fail(err, AMP_ERR_INTERNAL, "check the permissions of run.out_dir", "cannot write %s: %s", path,
                            strerror(errno));
        if (fresh)
            fprintf(nm->csv, "step,tensor,kind,format,numel,scale,absmax,rms,min_nonzero,overflow_frac,flush_frac,"
                             "subnormal_frac,rel_err\n");
    }
    return AMP_OK;
}

/* t's values as FP32 on the host, in nm's staging buffer `dst` (of nm->host_len floats). */
static void fetch(struct backend *be, const struct tensor *t, float *dst, void *raw)
{
    if (t->dtype == DT_FP32) {
        be->download(be, dst, t->data, t->numel * sizeof(float));
        return;
    }
    be->download(be, raw, t->data, t->numel * dtype_size(t->dtype));
    dtype_convert(dst, DT_FP32, raw, t->dtype, t->numel);
}

static void csv_num(FILE *f, double v)
{
    char text[40];
    double_to_text(v, text, sizeof text);
    fprintf(f, ",%s", text);
}

static void write_rows(FILE *f, int64_t step, const struct num_tensor *e, const struct num_stats *s, double scale)
{
    for (int fmt = 0; fmt < NF_COUNT; fmt++) {
        double n = (double)(s->n ? s->n : 1);
        fprintf(f, "%lld,%s,%s,%s,%lld", (long long)step, e->name, kind_names[e->kind], formats[fmt].name,
                (long long)s->n);
        csv_num(f, e->kind == NK_ACTIVATION ? 1.0 : scale);
        csv_num(f, s->absmax);
        csv_num(f, sqrt(s->sumsq / n));
        csv_num(f, s->nonzero ? s->min_nonzero : 0.0);
        csv_num(f, (double)s->overflow[fmt] / n);
        csv_num(f, (double)s->flush[fmt] / n);
        csv_num(f, (double)s->subnormal[fmt] / n);
        csv_num(f, s->ref_sumsq > 0 ? sqrt(s->err_sumsq / s->ref_sumsq) : 0.0);
        fputc('\n', f);
    }
}

static enum amp_status measure_pass(struct trainer *t, const struct step_ctx *ctx, const struct batch *b, void *user,
                                    struct amp_error *err)
{
    struct numerics *nm = user;
    struct model *m = &t->model, *sh = &nm->shadow;
    struct backend *be = t->be;
    for (int i = 0; i < m->nparams; i++)
        be->convert(be, &sh->params[i]->master, &m->params[i]->master);
    for (int i = 0; i < m->nbuffers; i++)
        be->convert(be, &sh->buffers[i]->t, &m->buffers[i]->t);
    struct step_state state; /* the loss scale this step runs at, from the backend's state */
    be->download(be, &state, t->dev_state, sizeof state);
    nm->scale = state.scaler.scale;
    struct step_ctx sctx = *ctx;
    sctx.policy = &sh->policy;
    sctx.zeros = NULL; /* grad_zero_frac counts the run's tensors only */
    model_forward(sh, &sctx, b);
    model_backward(sh, &sctx, b);

    size_t most = 1;
    for (int i = 0; i < nm->ntensors; i++) {
        const struct tensor *rt = tensor_of(m, &nm->tensors[i]);
        most = rt->numel > most ? rt->numel : most;
    }
    float *ref = malloc(most * sizeof *ref), *run = malloc(most * sizeof *run);
    void *raw = malloc(most * sizeof(float));
    if (!ref || !run || !raw) {
        free(ref);
        free(run);
        free(raw);
        return amp_fail(err, AMP_ERR_INTERNAL, "lower data.batch_size", "numerics: out of memory staging a tensor");
    }
    for (int i = 0; i < nm->ntensors; i++) {
        struct num_tensor *e = &nm->tensors[i];
        const struct tensor *rt = tensor_of(m, e), *st = tensor_of(sh, e);
        if (!rt->data || !st->data || rt->numel != st->numel)
            continue;
        fetch(be, st, ref, raw);
        fetch(be, rt, run, raw);
        struct num_stats s = {0};
        num_stats_add(&s, ref, run, rt->numel);
        if (nm->csv)
            write_rows(nm->csv, t->step + 1, e, &s, nm->scale);
        stats_merge(&e->total, &s);
    }
    free(ref);
    free(run);
    free(raw);
    return AMP_OK;
}

static enum amp_status measure_hook(struct trainer *t, const struct step_ctx *ctx, const struct batch *b, void *user,
                                    struct amp_error *err)
{
    struct numerics *nm = user;
    double t0 = runlog_now();
    enum amp_status st = measure_pass(t, ctx, b, nm, err);
    if (st == AMP_OK)
        st = t->be->status(t->be, err);
    nm->seconds += runlog_now() - t0;
    return st;
}

/* The run's fp8 scales (forward group, then backward) into nm->fp8_scale. */
static void fp8_scales(struct numerics *nm, const struct model *m)
{
    const struct fp8_group *g[2] = {&m->fp8.fwd, &m->fp8.bwd};
    for (int k = 0, off = 0; k < 2; off += g[k]->n, k++)
        if (g[k]->n)
            m->be->download(m->be, nm->fp8_scale + off, g[k]->scale, (size_t)g[k]->n * sizeof(float));
}

/* After a measured step: the casts' counts into the totals and numerics.csv (kind fp8_cast, the format the tensor
 * was cast to, scale = its scale; overflow_frac: saturated / all, flush_frac: flushed / nonzero). */
static void fp8_collect(struct numerics *nm, const struct trainer *t)
{
    const struct model *m = &t->model;
    size_t bytes = 4 * (size_t)nm->nfp8 * sizeof(int64_t);
    int64_t *c = malloc(bytes ? bytes : 1);
    if (!c)
        return;
    t->be->download(t->be, c, nm->fp8_counts, bytes);
    if (m->fp8.recipe == FP8_CURRENT) /* each cast computed its own: the last one's */
        fp8_scales(nm, m);
    for (int i = 0; i < nm->nfp8; i++) {
        for (int k = 0; k < 4; k++)
            nm->fp8_total[4 * i + k] += c[4 * i + k];
        if (!nm->csv || c[4 * i + 3] == 0)
            continue;
        const bool blockwise = m->fp8.recipe == FP8_BLOCKWISE; /* E4M3 throughout, a scale per tile: none here */
        fprintf(nm->csv, "%lld,%s,fp8_cast,%s,%lld", (long long)t->step, nm->fp8_names[i],
                i < m->fp8.fwd.n || blockwise ? "e4m3" : "e5m2", (long long)c[4 * i + 3]);
        if (blockwise)
            fprintf(nm->csv, ",");
        else
            csv_num(nm->csv, nm->fp8_scale[i]);
        fprintf(nm->csv, ",,,");
        csv_num(nm->csv, (double)c[4 * i] / (double)c[4 * i + 3]);
        csv_num(nm->csv, c[4 * i + 2] ? (double)c[4 * i + 1] / (double)c[4 * i + 2] : 0.0);
        fprintf(nm->csv, ",,\n");
    }
    free(c);
}

enum amp_status numerics_step(struct numerics *nm, struct trainer *t, struct amp_error *err)
{
    t->after_first_micro = measure_hook;
    t->micro_user = nm;
    if (nm->nfp8) {
        size_t bytes = 4 * (size_t)nm->nfp8 * sizeof(int64_t);
        int64_t *zeros = calloc(1, bytes);
        if (!zeros)
            return amp_fail(err, AMP_ERR_INTERNAL, NULL, "numerics: out of memory");
        t->be->upload(t->be, nm->fp8_counts, zeros, bytes);
        free(zeros);
        fp8_scales(nm, &t->model); /* delayed: the scales this step casts with */
        t->fp8_counts = nm->fp8_counts;
    }
    enum amp_status st = trainer_step(t, err);
    t->after_first_micro = NULL;
    t->micro_user = NULL;
    t->fp8_counts = NULL;
    if (st == AMP_OK && nm->nfp8)
        fp8_collect(nm, t);
    if (st == AMP_OK)
        nm->steps++;
    if (nm->csv && fflush(nm->csv) != 0 && st == AMP_OK)
        st = amp_fail(err, AMP_ERR_INTERNAL, "check free disk space", "cannot write numerics.csv");
    return st;
}

void numerics_close(struct numerics *nm)
{
    if (nm->fp8_counts && nm->built)
        nm->shadow.be->free(nm->shadow.be, nm->fp8_counts);
    free(nm->fp8_total);
    free(nm->fp8_scale);
    free(nm->fp8_names);
    if (nm->built)
        model_free(&nm->shadow);
    if (nm->csv)
        fclose(nm->csv);
    free(nm->tensors);
    memset(nm, 0, sizeof *nm);
}

static enum amp_status probe_open(struct trainer *t, void **self, struct amp_error *err)
{
    struct numerics *nm = calloc(1, sizeof *nm);
    *self = nm;
    if (!nm)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "numerics: out of memory");
    return numerics_open(nm, t, t->cfg->run.out_dir, "numerics.csv", false, err);
}

static enum amp_status probe_step(void *self, struct trainer *t, struct amp_error *err)
{
    return numerics_step(self, t, err);
}

static void probe_close(void *self, const struct config *cfg, bool report)
{
    struct numerics *nm = self;
    if (!nm)
        return;
    if (report && nm->steps > 0)
        numerics_report(nm, cfg, 0.001, stdout);
    numerics_close(nm);
    free(nm);
}

const struct train_probe numerics_probe = {.open = probe_open, .step = probe_step, .close = probe_close};

/* ---- the report ------------------------------------------------------------------------------------- */

static double headroom(double max, double absmax) { return absmax > 0 ? log2(max / absmax) : INFINITY; }

static void print_bits(FILE *out, double v)
{
    if (isinf(v))
        fprintf(out, "%8s", v > 0 ? "inf" : "-inf");
    else
        fprintf(out, "%8.1f", v);
}

/* The entry (of kind k) with the largest fraction `frac` returns, and that fraction. */
static const struct num_tensor *worst(const struct numerics *nm, enum num_kind k,
                                      double (*frac)(const struct num_stats *, const void *), const void *arg,
                                      double *out)
{
    const struct num_tensor *w = NULL;
    *out = 0;
    for (int i = 0; i < nm->ntensors; i++) {
        if (nm->tensors[i].kind != k)
            continue;
        double f = frac(&nm->tensors[i].total, arg);
        if (f > *out) {
            *out = f;
            w = &nm->tensors[i];
        }
    }
    return w;
}

static double over_frac(const struct num_stats *s, const void *arg)
{
    enum num_format f = *(const enum num_format *)arg;
    return s->n ? (double)s->overflow[f] / (double)s->n : 0;
}

struct at_scale {
    double measured;
    int k;
};

static double flush_frac_at(const struct num_stats *s, const void *arg)
{
    const struct at_scale *a = arg;
    return s->nonzero ? (double)flushed_at(s, a->measured, a->k) / (double)s->nonzero : 0;
}

static double grad_over_frac(const struct num_stats *s, const void *arg)
{
    const struct at_scale *a = arg;
    return s->absmax / a->measured * ldexp(1.0, a->k) > formats[NF_FP16].max ? 1.0 : 0.0;
}

/* precision.mode fp8: what the run's own casts did, at the scales it cast with. */
static void fp8_report(const struct numerics *nm, const struct config *cfg, FILE *out)
{
    fprintf(out, "fp8 casts of this run (recipe %s; the first micro-batch of each measured step, at the scale each "
                 "tensor was cast with; numerics.csv kind fp8_cast):\n",
            cfg->precision.fp8.recipe == FP8_RECIPE_CURRENT     ? "current"
            : cfg->precision.fp8.recipe == FP8_RECIPE_BLOCKWISE ? "blockwise, a scale per tile: none shown"
                                                                : "delayed");
    const bool blockwise = cfg->precision.fp8.recipe == FP8_RECIPE_BLOCKWISE;
    fprintf(out, "  %-28s %-6s %12s %12s %12s\n", "tensor", "format", "scale", "saturated", "flushed");
    double worst_sat = 0, worst_flush = 0;
    int ws = -1, wf = -1;
    for (int i = 0; i < nm->nfp8; i++) {
        const int64_t *c = nm->fp8_total + 4 * i;
        double sat = c[3] ? (double)c[0] / (double)c[3] : 0, fl = c[2] ? (double)c[1] / (double)c[2] : 0;
        bool fwd = i < nm->fp8_nfwd;
        if (blockwise)
            fprintf(out, "  %-28s %-6s %12s %11.3g%% %11.3g%%\n", nm->fp8_names[i], "e4m3", "-", 100 * sat, 100 * fl);
        else
            fprintf(out, "  %-28s %-6s %12.4g %11.3g%% %11.3g%%\n", nm->fp8_names[i], fwd ? "e4m3" : "e5m2",
                    (double)nm->fp8_scale[i], 100 * sat, 100 * fl);
        if (sat > worst_sat) {
            worst_sat = sat;
            ws = i;
        }
        if (fl > worst_flush) {
            worst_flush = fl;
            wf = i;
        }
    }
    fprintf(out, "  (saturated: of all elements, clamped to the format's max; flushed: of the nonzero ones, cast to 0)\n");
    fprintf(out, "verdict fp8 (scaled): ");
    if (ws < 0 && wf < 0)
        fprintf(out, "every cast kept every element in range\n");
    else {
        if (ws >= 0)
            fprintf(out, "%s saturates %.3g%% of its elements; ", nm->fp8_names[ws], 100 * worst_sat);
        if (wf >= 0)
            fprintf(out, "%s flushes %.3g%% of its nonzero elements to zero", nm->fp8_names[wf], 100 * worst_flush);
        fprintf(out, "\n");
    }
}

/* fp16-static judged per tensor: the scales 2^k at which no activation gradient overflows and none flushes more than
 * `underflow` of its nonzero elements (an interval: overflow grows with k, flushing shrinks), and the value to set,
 * the middle of that interval, which leaves the same headroom both ways. */
static void print_static_advice(const struct numerics *nm, double underflow, FILE *out)
{
    int a = WINDOW_LIMIT + 1, b = -WINDOW_LIMIT - 1;
    for (int k = -WINDOW_LIMIT; k <= WINDOW_LIMIT; k++) {
        struct at_scale at = {nm->scale, k};
        double flush = 0, over = 0;
        worst(nm, NK_ACT_GRAD, flush_frac_at, &at, &flush);
        worst(nm, NK_ACT_GRAD, grad_over_frac, &at, &over);
        if (over == 0 && flush <= underflow) {
            a = k < a ? k : a;
            b = k;
        }
    }
    if (a > b) {
        fprintf(out, "  no single scale keeps every activation gradient from overflow and under %g%% flushed: use "
                     "precision.mode: fp16-dynamic or bf16\n", 100 * underflow);
        return;
    }
    int mid = (a + b) / 2;
    fprintf(out, "  per tensor, 2^%d to 2^%d is safe: set precision.loss_scale.value: %.17g (2^%d)\n", a, b,
            ldexp(1.0, mid), mid);
}

void numerics_report(const struct numerics *nm, const struct config *cfg, double underflow, FILE *out)
{
    fprintf(out, "numerics: %lld step%s measured in %.2f s, the run in %s against an FP32 shadow; loss scale 2^%.0f "
                 "at the last (numerics.csv has every figure)\n",
            (long long)nm->steps, nm->steps == 1 ? "" : "s", nm->seconds, precision_mode_name(cfg->precision.mode),
            log2(nm->scale));
    fprintf(out, "%-28s %-11s %11s %11s %8s %8s %8s %10s %9s\n", "tensor", "kind", "absmax", "min_nonzero",
            "fp16_up", "fp16_dn", "e4m3_up", "fp16_flush", "rel_err");
    struct num_stats grads = {0};
    for (int i = 0; i < nm->ntensors; i++) {
        const struct num_tensor *e = &nm->tensors[i];
        const struct num_stats *s = &e->total;
        if (e->kind == NK_ACT_GRAD)
            stats_merge(&grads, s);
        /* headroom above (log2 max/absmax) and below (smallest nonzero against the smallest normal) */
        fprintf(out, "%-28s %-11s %11.4g %11.4g", e->name, kind_names[e->kind], s->absmax,
                s->nonzero ? s->min_nonzero : 0.0);
        print_bits(out, headroom(formats[NF_FP16].max, s->absmax));
        print_bits(out, s->nonzero ? log2(s->min_nonzero) - formats[NF_FP16].emin : INFINITY);
        print_bits(out, headroom(formats[NF_E4M3].max, s->absmax));
        fprintf(out, " %9.3f%% %9.2e\n", s->nonzero ? 100.0 * (double)s->flush[NF_FP16] / (double)s->nonzero : 0.0,
                s->ref_sumsq > 0 ? sqrt(s->err_sumsq / s->ref_sumsq) : 0.0);
    }
    fprintf(out, "(fp16_up, e4m3_up: powers of two between absmax and the format's max; fp16_dn: between the smallest "
                 "nonzero and fp16's smallest normal; fp16_flush: nonzero elements that round to zero in fp16; "
                 "gradients at the loss scale above; rel_err: the run's tensor against the shadow's, L2)\n");
    int lo = 0, hi = 0;
    num_scale_window(&grads, nm->scale, underflow, &lo, &hi);
    /* The window pools every activation gradient's elements; the verdicts judge each tensor, so a scale inside the
     * window can still flush more than `underflow` of one small tensor: say which is which. */
    if (lo <= hi)
        fprintf(out, "loss-scale window (fp16, all activation gradients pooled): [2^%d, 2^%d] (precision.loss_scale"
                     ".value %.17g to %.17g): no overflow, at most %g%% of the pooled nonzero elements flushed to zero; "
                     "the verdicts below judge each tensor apart\n", lo, hi, ldexp(1.0, lo), ldexp(1.0, hi),
                100 * underflow);
    else
        fprintf(out, "loss-scale window (fp16, all activation gradients pooled): none: overflow above 2^%d, more "
                     "than %g%% of the pooled elements flushed below 2^%d; the verdicts below judge each tensor "
                     "apart\n", hi, 100 * underflow, lo);

    enum num_format f16 = NF_FP16, fb = NF_BF16, f8 = NF_E4M3;
    double fwd_over = 0;
    const struct num_tensor *fwd = worst(nm, NK_ACTIVATION, over_frac, &f16, &fwd_over);

    /* fp16-static at its configured scale */
    double value = cfg->precision.loss_scale.value;
    int ks = (int)lround(log2(value));
    struct at_scale at = {nm->scale, ks};
    double frac = 0, gover = 0;
    const struct num_tensor *flush_l = worst(nm, NK_ACT_GRAD, flush_frac_at, &at, &frac);
    const struct num_tensor *over_l = worst(nm, NK_ACT_GRAD, grad_over_frac, &at, &gover);
    fprintf(out, "verdict fp16-static at 2^%d (precision.loss_scale.value %.17g): ", ks, ldexp(1.0, ks));
    if (fwd)
        fprintf(out, "overflows in %s (activation, %.3g%% of elements; no loss scale helps)\n", fwd->name,
                100 * fwd_over);
    else if (over_l)
        fprintf(out, "overflows in %s (activation gradient)\n", over_l->name);
    else if (flush_l && frac > underflow) {
        int many = 0, all = 0;
        for (int i = 0; i < nm->ntensors; i++)
            if (nm->tensors[i].kind == NK_ACT_GRAD) {
                all++;
                many += flush_frac_at(&nm->tensors[i].total, &at) > underflow;
            }
        fprintf(out, "underflows %.3g%% in %s (activation gradient; %d of %d activation gradients lose more than "
                     "%g%%)\n", 100 * frac, flush_l->name, many, all, 100 * underflow);
    }
    else
        fprintf(out, "safe\n");
    if (!fwd && (over_l || (flush_l && frac > underflow)))
        print_static_advice(nm, underflow, out);

    /* fp16-dynamic from its init, growing to the window's top within its clamps */
    int ki = (int)lround(log2(cfg->precision.loss_scale.init));
    double max = cfg->precision.loss_scale.max; /* may be inf */
    int kmax = isfinite(max) ? (int)floor(log2(max)) : WINDOW_LIMIT;
    int kmin = (int)ceil(log2(cfg->precision.loss_scale.min));
    int settle = hi > kmax ? kmax : hi < kmin ? kmin : hi;
    fprintf(out, "verdict fp16-dynamic: ");
    if (fwd)
        fprintf(out, "overflows in %s (activation): no loss scale helps\n", fwd->name);
    else if (lo > hi)
        fprintf(out, "starts at 2^%d; no scale both avoids overflow (above 2^%d) and keeps flushes under %g%%\n", ki,
                hi, 100 * underflow);
    else if (settle < ki)
        fprintf(out, "starts at 2^%d (precision.loss_scale.init %.17g), backs off and settles near 2^%d\n", ki,
                ldexp(1.0, ki), settle);
    else
        fprintf(out, "starts at 2^%d (precision.loss_scale.init %.17g), settles near 2^%d%s\n", ki, ldexp(1.0, ki),
                settle, settle == kmax && hi > kmax ? " (precision.loss_scale.max)" : "");

    /* bf16: fp32's exponent range; at scale 1 */
    double bover = 0;
    const struct num_tensor *bl = worst(nm, NK_ACTIVATION, over_frac, &fb, &bover);
    int64_t bflush = 0, bnonzero = 0;
    for (int i = 0; i < nm->ntensors; i++)
        if (nm->tensors[i].kind == NK_ACT_GRAD) {
            bflush += nm->tensors[i].total.flush[NF_BF16];
            bnonzero += nm->tensors[i].total.nonzero;
        }
    fprintf(out, "verdict bf16: ");
    if (bl)
        fprintf(out, "overflows in %s (activation)\n", bl->name);
    else if (bnonzero && (double)bflush > underflow * (double)bnonzero)
        fprintf(out, "underflows %.3g%% of activation-gradient elements\n", 100.0 * (double)bflush / (double)bnonzero);
    else
        fprintf(out, "safe\n");

    /* fp8 without per-tensor scaling */
    double e4 = 0;
    const struct num_tensor *e4l = worst(nm, NK_ACTIVATION, over_frac, &f8, &e4);
    fprintf(out, "verdict fp8: ");
    if (e4l)
        fprintf(out, "E4M3 saturates activations in %s (%.3g%% of elements) without per-tensor scaling\n", e4l->name,
                100 * e4);
    else
        fprintf(out, "E4M3 holds every activation unscaled; gradients need E5M2 with per-tensor scaling\n");
    if (nm->nfp8)
        fp8_report(nm, cfg, out);
}

/* ---- the command ------------------------------------------------------------------------------------ */

enum amp_status numerics_run(const struct config *cfg, const char *checkpoint, int64_t steps, double underflow,
                             struct amp_error *err)
{
    struct trainer t;
    struct config apart = *cfg; /* measured every step: the layers kept apart (model_build's fusion is off) */
    apart.run.numerics_every = 1;
    enum amp_status st = trainer_setup(&t, &apart, NULL, err);
    if (st == AMP_OK && checkpoint)
        st = ckpt_load_trainer(checkpoint, &t, false, err);
    else if (st == AMP_OK && cfg->model.init_from[0]) /* a CONFIG measures the run it starts: from init_from */
        st = init_from_load(&t.model, &cfg->model, stdout, err);
    struct numerics nm = {0};
    /* a file of its own, named by the step it starts from: never the run's numerics.csv, whose rows are steps
     * that were trained (run.numerics_every); these steps are trained in memory only */
    char name[64];
    snprintf(name, sizeof name, "numerics-from-step-%lld.csv", st == AMP_OK ? (long long)t.step : 0LL);
    if (st == AMP_OK)
        st = numerics_open(&nm, &t, cfg->run.out_dir, name, true, err);
    if (st == AMP_OK)
        printf("numerics: measuring %lld step%s from step %lld (they are trained in memory; nothing but %s/%s is "
               "written)\n", (long long)steps, steps == 1 ? "" : "s", (long long)t.step, cfg->run.out_dir, name);
    for (int64_t k = 0; k < steps && st == AMP_OK; k++) {
        st = numerics_step(&nm, &t, err);
        if (st == AMP_OK)
            st = trainer_flush(&t, err);
        if (st == AMP_OK && t.nrecs == 1) {
            const struct step_record *r = &t.recs[0];
            char scale[40];
            double_to_text(r->scale, scale, sizeof scale);
            printf("step %lld | loss %.4f | scale %s%s\n", (long long)r->step, r->loss, scale,
                   r->skipped ? " | skipped (non-finite gradients)" : "");
        }
    }
    if (st == AMP_OK)
        numerics_report(&nm, cfg, underflow, stdout);
    numerics_close(&nm);
    trainer_teardown(&t);
    return st;
}
