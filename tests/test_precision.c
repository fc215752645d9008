/*
 * test_precision.c — mixed precision end to end through the trainer (lib/engine/train.h): skipped steps,
 * overflow attribution, accumulation, clipping under loss scaling, the underflow that loss scaling
 * prevents, fail-fast, and the four modes against fp32.
 *
 * Faults are injected through the trainer's after_backward hook, the slot between backward and the
 * non-finite check. Runs use Fashion-MNIST (Debian package dataset-fashion-mnist) with small models
 * so the suite stays fast, and OPENBLAS_NUM_THREADS=1 so results repeat exactly.
 */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "train.h"

#define FASHION "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"

static void need_data(void)
{
    setenv("OPENBLAS_NUM_THREADS", "1", 1);
    if (access(FASHION, R_OK) != 0)
        cr_skip_test("Fashion-MNIST not installed (Debian package dataset-fashion-mnist)");
}

/* configs/fashion_mlp.yaml shrunk to 784-64-32-10, then the given overrides (NULL-terminated). */
static void small_mlp(struct config *cfg, const char *const *overrides)
{
    struct amp_error err = {0};
    cr_assert_eq(config_load(cfg, AMP_SOURCE_DIR "/configs/fashion_mlp.yaml", &err), AMP_OK, "%s", err.msg);
    const char *base[] = {"run.device=cpu", "model.layers.1.out=64", "model.layers.3.out=32", "data.batch_size=32",
                          "run.steps=10", NULL};
    for (int i = 0; base[i]; i++)
        cr_assert_eq(config_apply_override(cfg, base[i], &err), AMP_OK, "%s: %s", base[i], err.msg);
    for (int i = 0; overrides && overrides[i]; i++)
        cr_assert_eq(config_apply_override(cfg, overrides[i], &err), AMP_OK, "%s: %s", overrides[i], err.msg);
    cr_assert_eq(config_finalize(cfg, &err), AMP_OK, "%s", err.msg);
}

static void setup(struct trainer *t, const struct config *cfg)
{
    struct amp_error err = {0};
    cr_assert_eq(trainer_setup(t, cfg, NULL, &err), AMP_OK, "%s", err.msg);
}

/* One step, read back at once (a log window of one). */
static void step(struct trainer *t, struct step_record *rec)
{
    struct amp_error err = {0};
    cr_assert_eq(trainer_step(t, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(trainer_flush(t, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(t->nrecs, 1);
    *rec = t->recs[0];
}

static struct param *param_named(struct trainer *t, const char *name)
{
    for (int i = 0; i < t->model.nparams; i++)
        if (strcmp(t->model.params[i]->name, name) == 0)
            return t->model.params[i];
    cr_assert_fail("no parameter %s", name);
    return NULL;
}

/* Bytes of a tensor (CPU backend memory is host memory). */
static void *snapshot(const struct tensor *x)
{
    void *p = malloc(tensor_bytes(x) ? tensor_bytes(x) : 1); /* an empty copy (a bias read in fp32): nothing */
    cr_assert_not_null(p);
    if (tensor_bytes(x))
        memcpy(p, x->data, tensor_bytes(x));
    return p;
}

/* ---- fault injection through the after_backward hook ---- */
struct injection {
    int64_t at_step;        /* inject when t->step equals this (-1: every step) */
    const char *param[2];   /* parameters to poison */
    float value[2];
    int count[2];           /* elements poisoned */
};

static void inject(struct trainer *t, void *user)
{
    struct injection *inj = user;
    if (inj->at_step >= 0 && t->step != inj->at_step)
        return;
    for (int k = 0; k < 2 && inj->param[k]; k++) {
        struct param *p = param_named(t, inj->param[k]);
        float *g = p->grad.data;
        for (int i = 0; i < inj->count[k]; i++)
            g[i * 7] = inj->value[k];
    }
}

/* A small-MLP trainer with overrides `ov` and the fault `inj` wired into its after_backward hook. */
static void setup_injected(struct trainer *t, struct config *cfg, const char *const *ov, struct injection *inj)
{
    small_mlp(cfg, ov);
    setup(t, cfg);
    t->test_hook = (struct trainer_test_hook){.after_backward = inject, .user = inj};
}

Test(precision, skipped_step_leaves_weights_moments_counters_and_lr_bit_identical)
{
    need_data();
    const char *ov[] = {"precision.mode=fp16-dynamic", "optim.schedule.kind=cosine", "optim.schedule.warmup_steps=3",
                        NULL};
    struct config cfg;
    struct trainer t;
    struct injection inj = {.at_step = 2, .param = {"fc2/weight"}, .value = {INFINITY}, .count = {1}};
    setup_injected(&t, &cfg, ov, &inj);
    struct step_record rec;
    step(&t, &rec);
    step(&t, &rec);
    cr_assert_not(rec.skipped);

    int n = t.model.nparams;
    void *w[16], *lp[16], *m1[16], *v1[16];
    cr_assert(n <= 16);
    for (int i = 0; i < n; i++) {
        w[i] = snapshot(&t.model.params[i]->master);
        lp[i] = snapshot(&t.model.params[i]->copy);
        m1[i] = snapshot(&t.opt.state[i].m);
        v1[i] = snapshot(&t.opt.state[i].v);
    }
    int64_t opt_step = t.opt.step;
    double lr = optim_lr(&t.opt), scale = t.scaler.scale;

    step(&t, &rec); /* step index 2: poisoned */
    cr_assert(rec.skipped);
    cr_assert(rec.found_inf);
    cr_assert_eq(rec.lr, 0.0);
    cr_assert_eq(rec.skips_total, 1);
    cr_assert_eq(t.scaler.scale, scale * 0.5, "scale backs off: %g -> %g", scale, t.scaler.scale);
    cr_assert_eq(t.opt.step, opt_step, "the optimizer's step count does not move");
    cr_assert_eq(optim_lr(&t.opt), lr, "the LR schedule does not move");
    for (int i = 0; i < n; i++) {
        const struct param *p = t.model.params[i];
        cr_assert_eq(memcmp(w[i], p->master.data, tensor_bytes(&p->master)), 0, "%s master moved", p->name);
        if (p->copy.data) /* biases are read from the master: no copy */
            cr_assert_eq(memcmp(lp[i], p->copy.data, tensor_bytes(&p->copy)), 0, "%s copy moved", p->name);
        cr_assert_eq(memcmp(m1[i], t.opt.state[i].m.data, tensor_bytes(&t.opt.state[i].m)), 0, "%s m moved", p->name);
        cr_assert_eq(memcmp(v1[i], t.opt.state[i].v.data, tensor_bytes(&t.opt.state[i].v)), 0, "%s v moved", p->name);
        free(w[i]), free(lp[i]), free(m1[i]), free(v1[i]);
    }
    step(&t, &rec);
    cr_assert_not(rec.skipped);
    cr_assert_eq(t.opt.step, opt_step + 1);
    cr_assert_eq(rec.lr, lr, "the next real step gets the LR the skipped one would have had");
    trainer_teardown(&t);
    config_free(&cfg);
}

Test(precision, overflow_attribution_names_the_layer_closest_to_the_loss)
{
    need_data();
    const char *ov[] = {"precision.mode=fp16-dynamic", NULL};
    struct config cfg;
    struct trainer t;
    struct injection inj = {.at_step = 1, .param = {"fc1/weight", "fc2/bias"}, .value = {INFINITY, NAN},
                            .count = {5, 3}};
    setup_injected(&t, &cfg, ov, &inj);
    struct step_record rec;
    step(&t, &rec);
    cr_assert_str_empty(rec.overflow_layer);
    step(&t, &rec);
    cr_assert(rec.skipped);
    cr_assert_str_eq(rec.overflow_layer, "fc2 (nan, 3 elements)");

    inj.at_step = 2;
    inj.param[1] = "head/weight";
    inj.value[1] = INFINITY;
    step(&t, &rec);
    cr_assert_str_eq(rec.overflow_layer, "head (inf, 3 elements)");
    inj.at_step = 3;
    inj.param[1] = NULL;
    step(&t, &rec);
    cr_assert_str_eq(rec.overflow_layer, "fc1 (inf, 5 elements)");
    cr_assert_eq(t.scaler.skips_total, 3);
    cr_assert_eq(t.scaler.scale, 65536.0 / 8);
    trainer_teardown(&t);
    config_free(&cfg);
}

/* ---- the step runs on the backend: nothing read back until the window ends ---- */

/* The backend's waiting calls, counted (the trainer's backend table is patched in place). */
static struct {
    void (*download)(struct backend *, void *, const void *, size_t);
    void (*synchronize)(struct backend *);
    void (*count_zeros)(struct backend *, const struct tensor *, int64_t *);
    int downloads, syncs, zero_counts;
} waits;

static void counting_download(struct backend *be, void *dst, const void *src, size_t n)
{
    waits.downloads++;
    waits.download(be, dst, src, n);
}

static void counting_synchronize(struct backend *be)
{
    waits.syncs++;
    waits.synchronize(be);
}

static void counting_count_zeros(struct backend *be, const struct tensor *x, int64_t *acc)
{
    waits.zero_counts++;
    waits.count_zeros(be, x, acc);
}

Test(precision, a_log_window_of_steps_reads_nothing_back_until_its_flush)
{
    need_data();
    const char *ov[] = {"precision.mode=fp16-dynamic", "run.log_every=6", "accum_steps=2", "clip.max_norm=1", NULL};
    struct config cfg;
    small_mlp(&cfg, ov);
    struct trainer t;
    setup(&t, &cfg);
    cr_assert_eq(t.window, 6);
    waits.download = t.be->download;
    waits.synchronize = t.be->synchronize;
    waits.count_zeros = t.be->count_zeros;
    t.be->download = counting_download;
    t.be->synchronize = counting_synchronize;
    t.be->count_zeros = counting_count_zeros;
    struct amp_error err = {0};
    for (int i = 0; i < 5; i++)
        cr_assert_eq(trainer_step(&t, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(waits.downloads + waits.syncs, 0, "5 queued steps waited on the backend: %d downloads, %d synchronize",
                 waits.downloads, waits.syncs);
    cr_assert_eq(waits.zero_counts, 0, "steps 1-5 do not sample grad_zero_frac");
    cr_assert_eq(trainer_step(&t, &err), AMP_OK, "%s", err.msg); /* step 6 samples grad_zero_frac */
    cr_assert_eq(waits.downloads + waits.syncs, 0, "the log step's zero counts stay on the backend too");
    cr_assert_gt(waits.zero_counts, 0, "the log step counts zeros");
    cr_assert_eq(t.scaler.scale, 65536.0, "the host mirror is not read before the flush");
    cr_assert_eq(trainer_step(&t, &err), AMP_ERR_INTERNAL, "a seventh step does not fit the window");
    cr_assert_eq(trainer_flush(&t, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(waits.downloads, 1, "one flush, one download: the state, the rows and the counts together");
    cr_assert_eq(t.nrecs, 6);
    for (int i = 0; i < 6; i++)
        cr_assert_eq(t.recs[i].step, i + 1);
    for (int i = 0; i < 5; i++)
        cr_assert(isnan(t.recs[i].grad_zero_frac), "step %d was not sampled", i + 1);
    double z = t.recs[5].grad_zero_frac;
    cr_assert(z > 0 && z < 1, "step 6's grad_zero_frac %g (ReLU zeros some of the fp16 gradients)", z);
    cr_assert_eq(t.opt.step, 6 - t.recs[5].skips_total, "the mirror read back");
    t.be->download = waits.download;
    t.be->synchronize = waits.synchronize;
    t.be->count_zeros = waits.count_zeros;
    trainer_teardown(&t);
    config_free(&cfg);
}

/* Batch staging (backend.h, upload_staged / upload_rows / staging_wait): each batch goes through the other staging slot
 * than the last, the host waits for that slot's earlier copies before writing it, and only staged
 * copies carry batches (no plain upload from pageable memory in a step). Logged per call. */
static struct {
    void (*upload)(struct backend *, void *, const void *, size_t);
    void (*upload_staged)(struct backend *, void *, const void *, size_t, int);
    void (*staging_wait)(struct backend *, int);
    void (*upload_rows)(struct backend *, void *, const void *, size_t, const int64_t *, int64_t, void *, int);
    char log[4096];
    size_t len;
    int uploads;
} staging;
static void logging_upload(struct backend *be, void *dst, const void *src, size_t n)
{
    staging.uploads++;
    staging.upload(be, dst, src, n);
}
static void logging_upload_staged(struct backend *be, void *dst, const void *src, size_t n, int slot)
{
    staging.len += (size_t)snprintf(staging.log + staging.len, sizeof staging.log - staging.len, "u%d ", slot);
    staging.upload_staged(be, dst, src, n, slot);
}
static void logging_staging_wait(struct backend *be, int slot)
{
    staging.len += (size_t)snprintf(staging.log + staging.len, sizeof staging.log - staging.len, "w%d ", slot);
    staging.staging_wait(be, slot);
}
static void logging_upload_rows(struct backend *be, void *dst, const void *table, size_t row_bytes,
                                const int64_t *idx, int64_t n, void *staged, int slot)
{
    staging.len += (size_t)snprintf(staging.log + staging.len, sizeof staging.log - staging.len, "r%d ", slot);
    staging.upload_rows(be, dst, table, row_bytes, idx, n, staged, slot);
}

Test(precision, batches_alternate_staging_slots_and_wait_before_reuse)
{
    need_data();
    const char *ov[] = {"run.log_every=4", "accum_steps=2", NULL};
    struct config cfg;
    small_mlp(&cfg, ov);
    struct trainer t;
    setup(&t, &cfg);
    staging.upload = t.be->upload;
    staging.upload_staged = t.be->upload_staged;
    staging.staging_wait = t.be->staging_wait;
    staging.upload_rows = t.be->upload_rows;
    t.be->upload = logging_upload;
    t.be->upload_staged = logging_upload_staged;
    t.be->staging_wait = logging_staging_wait;
    t.be->upload_rows = logging_upload_rows;
    struct amp_error err = {0};
    for (int i = 0; i < 2; i++)
        cr_assert_eq(trainer_step(&t, &err), AMP_OK, "%s", err.msg);
    /* 2 steps x 2 micro-batches: labels, then the images' rows per batch, slots 0 1 0 1 */
    cr_assert_str_eq(staging.log, "w0 u0 r0 w1 u1 r1 w0 u0 r0 w1 u1 r1 ");
    /* the window's first step writes the step state and zeroes the rows (push_state): two plain uploads */
    cr_assert_eq(staging.uploads, 2, "%d plain uploads in two steps", staging.uploads);
    t.be->upload = staging.upload;
    t.be->upload_staged = staging.upload_staged;
    t.be->staging_wait = staging.staging_wait;
    t.be->upload_rows = staging.upload_rows;
    trainer_teardown(&t);
    config_free(&cfg);
}

/* The same run read back every step and once per window gives the same rows and weights: deferring the
 * read changes nothing, overflow attribution and scale changes included. */
Test(precision, rows_do_not_depend_on_when_the_window_is_read)
{
    need_data();
    const char *ov[] = {"precision.mode=fp16-dynamic", "run.log_every=12", "precision.loss_scale.growth_interval=3",
                        "precision.loss_scale.hysteresis=2", "clip.max_norm=0.5", "optim.schedule.kind=cosine",
                        "optim.schedule.warmup_steps=4", NULL};
    struct step_record every[12], once[12];
    float *w[2];
    size_t count[2] = {0, 0};
    for (int pass = 0; pass < 2; pass++) {
        struct config cfg;
        struct trainer t;
        struct injection inj = {.at_step = -1, .param = {"fc2/weight"}, .value = {INFINITY}, .count = {2}};
        setup_injected(&t, &cfg, ov, &inj);
        struct amp_error err = {0};
        for (int i = 0; i < 12; i++) {
            inj.at_step = i == 4 || i == 5 || i == 9 ? i : 99; /* overflows at steps 5, 6 and 10 */
            if (pass == 0) {
                step(&t, &every[i]);
            } else {
                cr_assert_eq(trainer_step(&t, &err), AMP_OK, "%s", err.msg);
            }
        }
        if (pass == 1) {
            cr_assert_eq(trainer_flush(&t, &err), AMP_OK, "%s", err.msg);
            cr_assert_eq(t.nrecs, 12);
            memcpy(once, t.recs, sizeof once);
        }
        for (int i = 0; i < t.model.nparams; i++)
            count[pass] += t.model.params[i]->master.numel;
        w[pass] = malloc(count[pass] * sizeof(float));
        size_t off = 0;
        for (int i = 0; i < t.model.nparams; i++) {
            memcpy(w[pass] + off, t.model.params[i]->master.data, tensor_bytes(&t.model.params[i]->master));
            off += t.model.params[i]->master.numel;
        }
        trainer_teardown(&t);
        config_free(&cfg);
    }
    cr_assert(every[4].skipped && every[5].skipped && every[9].skipped && !every[6].skipped);
    cr_assert_eq(every[5].scale_next, every[5].scale * 0.5, "hysteresis 2: the second overflow backs off");
    cr_assert_eq(every[11].skips_total, 3);
    for (int i = 0; i < 12; i++) {
        const struct step_record *a = &every[i], *b = &once[i];
        cr_assert(a->step == b->step && a->epoch == b->epoch && a->found_inf == b->found_inf &&
                      a->skipped == b->skipped && a->skips_total == b->skips_total &&
                      a->consecutive_skips == b->consecutive_skips,
                  "step %d: counters differ", i + 1);
        cr_assert(memcmp(&a->loss, &b->loss, sizeof(double)) == 0 && memcmp(&a->scale, &b->scale, sizeof(double)) == 0 &&
                      memcmp(&a->scale_next, &b->scale_next, sizeof(double)) == 0 &&
                      memcmp(&a->grad_norm, &b->grad_norm, sizeof(double)) == 0 &&
                      memcmp(&a->clip_coef, &b->clip_coef, sizeof(double)) == 0 &&
                      memcmp(&a->lr, &b->lr, sizeof(double)) == 0,
                  "step %d: values differ (loss %.17g vs %.17g)", i + 1, a->loss, b->loss);
        cr_assert_str_eq(a->overflow_layer, b->overflow_layer, "step %d", i + 1);
    }
    cr_assert_str_eq(once[9].overflow_layer, "fc2 (inf, 2 elements)");
    cr_assert_eq(count[0], count[1]);
    cr_assert_eq(memcmp(w[0], w[1], count[0] * sizeof(float)), 0, "weights after 12 steps");
    free(w[0]), free(w[1]);
}

/* Run `steps` optimizer steps and copy out all master weights (fp32, concatenated). */
static float *train_and_collect(const char *const *ov, int steps, size_t *count, double *last_loss)
{
    struct config cfg;
    small_mlp(&cfg, ov);
    struct trainer t;
    setup(&t, &cfg);
    struct step_record rec;
    double loss = 0;
    for (int i = 0; i < steps; i++) {
        step(&t, &rec);
        loss = rec.loss;
    }
    size_t total = 0;
    for (int i = 0; i < t.model.nparams; i++)
        total += t.model.params[i]->master.numel;
    float *out = malloc(total * sizeof *out);
    cr_assert_not_null(out);
    size_t off = 0;
    for (int i = 0; i < t.model.nparams; i++) {
        const struct tensor *m = &t.model.params[i]->master;
        memcpy(out + off, m->data, m->numel * sizeof(float));
        off += m->numel;
    }
    *count = total;
    if (last_loss)
        *last_loss = loss;
    trainer_teardown(&t);
    config_free(&cfg);
    return out;
}

static double max_rel_diff(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num = fmax(num, fabs((double)a[i] - (double)b[i]));
        den = fmax(den, fabs((double)a[i]));
    }
    return num / den;
}

Test(precision, accumulation_k_at_batch_b_equals_one_step_at_batch_kb_in_fp32)
{
    need_data();
    const char *big[] = {"data.shuffle=false", "data.batch_size=64", "accum_steps=1", "optim.kind=sgd",
                         "optim.lr=0.1", "optim.momentum=0.9", NULL};
    const char *acc[] = {"data.shuffle=false", "data.batch_size=16", "accum_steps=4", "optim.kind=sgd",
                         "optim.lr=0.1", "optim.momentum=0.9", NULL};
    size_t n1, n2;
    float *a = train_and_collect(big, 5, &n1, NULL);
    float *b = train_and_collect(acc, 5, &n2, NULL);
    cr_assert_eq(n1, n2);
    double d = max_rel_diff(a, b, n1);
    cr_assert(d < 1e-5, "accumulated update differs: max relative difference %g", d);
    /* and it is not trivially equal because nothing happened */
    size_t n0;
    const char *none[] = {"data.shuffle=false", "data.batch_size=64", "optim.kind=sgd", "optim.lr=0.1",
                          "optim.momentum=0.9", NULL};
    float *c = train_and_collect(none, 1, &n0, NULL);
    cr_assert(max_rel_diff(a, c, n1) > 1e-3, "five steps moved the weights");
    free(a), free(b), free(c);
}

Test(precision, fp16_dynamic_decides_the_scale_once_per_optimizer_step)
{
    need_data();
    const char *ov[] = {"precision.mode=fp16-dynamic", "precision.loss_scale.init=1024",
                        "precision.loss_scale.growth_interval=2", "accum_steps=4", NULL};
    struct config cfg;
    small_mlp(&cfg, ov);
    struct trainer t;
    setup(&t, &cfg);
    struct step_record rec;
    double expect[] = {1024, 1024, 2048, 2048, 4096, 4096};
    for (int i = 0; i < 6; i++) {
        step(&t, &rec);
        cr_assert_eq(rec.scale, expect[i], "step %d ran with scale %g", i + 1, rec.scale);
        cr_assert_eq(rec.step, i + 1);
    }
    cr_assert_eq(t.scaler.scale, 8192.0);
    cr_assert_eq(t.sampler.cursor, 6 * 4 * 32, "24 micro-batches of 32 consumed");
    trainer_teardown(&t);
    config_free(&cfg);
}

/* Grad norm and clip coefficient of the first step, and the weights after it. */
static void first_step(const char *const *ov, double *norm, double *coef, float **w, size_t *n)
{
    struct config cfg;
    small_mlp(&cfg, ov);
    struct trainer t;
    setup(&t, &cfg);
    struct step_record rec;
    step(&t, &rec);
    cr_assert_not(rec.skipped);
    *norm = rec.grad_norm;
    *coef = rec.clip_coef;
    const struct tensor *m = &param_named(&t, "fc1/weight")->master;
    *n = m->numel;
    *w = malloc(m->numel * sizeof(float));
    memcpy(*w, m->data, m->numel * sizeof(float));
    trainer_teardown(&t);
    config_free(&cfg);
}

Test(precision, clipping_under_loss_scaling_equals_clipping_without_it)
{
    need_data();
    const char *fp32[] = {"clip.max_norm=0.1", "optim.kind=sgd", "optim.lr=0.5", NULL};
    const char *s256[] = {"clip.max_norm=0.1", "optim.kind=sgd", "optim.lr=0.5", "precision.mode=fp16-static",
                          "precision.loss_scale.value=256", NULL};
    const char *s8k[] = {"clip.max_norm=0.1", "optim.kind=sgd", "optim.lr=0.5", "precision.mode=fp16-static",
                         "precision.loss_scale.value=8192", NULL};
    double n0, c0, n1, c1, n2, c2;
    float *w0, *w1, *w2;
    size_t k;
    first_step(fp32, &n0, &c0, &w0, &k);
    first_step(s256, &n1, &c1, &w1, &k);
    first_step(s8k, &n2, &c2, &w2, &k);
    cr_assert(c0 < 0.5, "the clip engages (coef %g, norm %g)", c0, n0);
    cr_assert(fabs(n1 - n2) / n2 < 1e-3, "unscaled norms at scales 256 and 8192: %g vs %g", n1, n2);
    cr_assert(fabs(c1 - c2) / c2 < 1e-3, "clip coefficients: %g vs %g", c1, c2);
    cr_assert(fabs(n1 - n0) / n0 < 2e-2, "fp16 norm %g vs fp32 norm %g", n1, n0);
    cr_assert(fabs(c1 - c0) / c0 < 2e-2, "fp16 coef %g vs fp32 coef %g", c1, c0);
    cr_assert(max_rel_diff(w2, w1, k) < 1e-3, "weights after the clipped step agree across scales");
    cr_assert(max_rel_diff(w0, w1, k) < 2e-2, "and with fp32");
    free(w0), free(w1), free(w2);
}

/* Mean grad_zero_frac and last loss of a run of configs/fashion_underflow.yaml. */
static void underflow_run(const char *mode, const char *value, double *zero_frac, double *loss)
{
    struct amp_error err = {0};
    struct config cfg;
    cr_assert_eq(config_load(&cfg, AMP_SOURCE_DIR "/configs/fashion_underflow.yaml", &err), AMP_OK, "%s", err.msg);
    const char *ov[] = {"run.device=cpu", "run.steps=40", "run.log_every=5", mode, value, NULL};
    for (int i = 0; ov[i]; i++)
        cr_assert_eq(config_apply_override(&cfg, ov[i], &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(config_finalize(&cfg, &err), AMP_OK, "%s", err.msg);
    struct trainer t;
    setup(&t, &cfg);
    struct step_record rec;
    double z = 0, l = 0;
    int nz = 0;
    for (int i = 0; i < 40; i++) {
        step(&t, &rec);
        if (!isnan(rec.grad_zero_frac)) {
            z += rec.grad_zero_frac;
            nz++;
        }
        if (i >= 30)
            l += rec.loss / 10;
    }
    cr_assert_eq(nz, 8, "sampled every log_every = 5 steps");
    *zero_frac = z / nz;
    *loss = l;
    trainer_teardown(&t);
    config_free(&cfg);
}

Test(precision, fp16_without_loss_scaling_loses_gradients_to_underflow, .timeout = 600)
{
    need_data();
    double z_static, l_static, z_dyn, l_dyn;
    underflow_run("precision.mode=fp16-static", "precision.loss_scale.value=1", &z_static, &l_static);
    underflow_run("precision.mode=fp16-dynamic", "precision.loss_scale.init=65536", &z_dyn, &l_dyn);
    cr_assert(z_static > z_dyn + 0.25, "grad_zero_frac: static-1 %g vs dynamic %g", z_static, z_dyn);
    cr_assert(l_static > l_dyn + 0.4, "loss over the last 10 steps: static-1 %g vs dynamic %g", l_static, l_dyn);
    cr_assert(l_static > 2.2, "without scaling the deep MLP barely learns: loss %g (chance is 2.303)", l_static);
}

Test(precision, all_four_modes_train_to_within_a_margin_of_fp32, .timeout = 600)
{
    need_data();
    const char *modes[] = {"precision.mode=fp32", "precision.mode=fp16-static", "precision.mode=fp16-dynamic",
                           "precision.mode=bf16"};
    double loss[4];
    for (int m = 0; m < 4; m++) {
        const char *ov[] = {modes[m], "run.steps=150", "precision.loss_scale.value=1024", NULL};
        struct config cfg;
        small_mlp(&cfg, ov);
        struct trainer t;
        setup(&t, &cfg);
        struct step_record rec;
        double first = 0, last = 0;
        for (int i = 0; i < 150; i++) {
            step(&t, &rec);
            cr_assert_not(rec.skipped, "%s skipped step %d", modes[m], i + 1);
            if (i < 10)
                first += rec.loss / 10;
            if (i >= 120)
                last += rec.loss / 30;
        }
        loss[m] = last;
        cr_assert(last < 0.5 * first, "%s: loss %g -> %g", modes[m], first, last);
        trainer_teardown(&t);
        config_free(&cfg);
    }
    for (int m = 1; m < 4; m++)
        cr_assert(fabs(loss[m] - loss[0]) < 0.05, "%s final loss %g vs fp32 %g", modes[m], loss[m], loss[0]);
}

Test(precision, bf16_on_nonfinite_stop_fails_fast_with_code_5)
{
    need_data();
    const char *ov[] = {"precision.mode=bf16", "stability.on_nonfinite=stop", NULL};
    struct config cfg;
    struct trainer t;
    struct injection inj = {.at_step = 1, .param = {"head/bias"}, .value = {NAN}, .count = {1}};
    setup_injected(&t, &cfg, ov, &inj);
    struct step_record rec;
    struct amp_error err = {0};
    step(&t, &rec);
    cr_assert_eq(trainer_check_stability(&t, &rec, &err), AMP_OK);
    step(&t, &rec);
    cr_assert(rec.skipped);
    cr_assert_eq(rec.scale, 1.0);
    cr_assert_eq(trainer_check_stability(&t, &rec, &err), AMP_ERR_UNSTABLE);
    cr_assert(strstr(err.msg, "head (nan, 1 elements)"), "%s", err.msg);
    cr_assert(strstr(err.msg, "on_nonfinite"), "%s", err.msg);
    trainer_teardown(&t);
    config_free(&cfg);
}

Test(precision, max_consecutive_skips_stops_with_code_5)
{
    need_data();
    const char *ov[] = {"precision.mode=fp16-dynamic", "stability.max_consecutive_skips=3", NULL};
    struct config cfg;
    struct trainer t;
    struct injection inj = {.at_step = -1, .param = {"fc1/weight"}, .value = {INFINITY}, .count = {1}};
    setup_injected(&t, &cfg, ov, &inj);
    struct step_record rec;
    struct amp_error err = {0};
    for (int i = 0; i < 2; i++) {
        step(&t, &rec);
        cr_assert_eq(trainer_check_stability(&t, &rec, &err), AMP_OK);
    }
    step(&t, &rec);
    cr_assert_eq(trainer_check_stability(&t, &rec, &err), AMP_ERR_UNSTABLE);
    cr_assert(strstr(err.msg, "3 skipped steps in a row"), "%s", err.msg);
    cr_assert(strstr(err.msg, "fc1 (inf, 1 elements)"), "%s", err.msg);
    trainer_teardown(&t);
    config_free(&cfg);
}

Test(precision, floor_reached_with_continuing_overflow_stops_with_code_5)
{
    need_data();
    const char *ov[] = {"precision.mode=fp16-dynamic", "precision.loss_scale.init=4", "precision.loss_scale.min=1",
                        "stability.max_consecutive_skips=0", NULL};
    struct config cfg;
    struct trainer t;
    struct injection inj = {.at_step = -1, .param = {"fc1/weight"}, .value = {INFINITY}, .count = {1}};
    setup_injected(&t, &cfg, ov, &inj);
    struct step_record rec;
    struct amp_error err = {0};
    enum amp_status st = AMP_OK;
    int steps = 0;
    while (st == AMP_OK && steps < 10) {
        step(&t, &rec);
        steps++;
        st = trainer_check_stability(&t, &rec, &err);
    }
    cr_assert_eq(st, AMP_ERR_UNSTABLE);
    cr_assert_eq(t.scaler.scale, 1.0);
    cr_assert_eq(steps, 3, "4 -> 2 -> 1, then an overflow at the minimum: stopped after %d steps", steps);
    cr_assert(strstr(err.msg, "minimum"), "%s", err.msg);
    trainer_teardown(&t);
    config_free(&cfg);
}

/* grad_zero_frac of configs/text_gpt.yaml's third step (the blocks' inner fp16 gradients count). */
static double gpt_zero_frac(const char *mode, const char *scale)
{
    struct amp_error err = {0};
    struct config cfg;
    cr_assert_eq(config_load(&cfg, AMP_SOURCE_DIR "/configs/text_gpt.yaml", &err), AMP_OK, "%s", err.msg);
    const char *ov[] = {"run.device=cpu", "run.steps=3", "run.log_every=3", mode, scale, NULL};
    for (int i = 0; ov[i]; i++)
        cr_assert_eq(config_apply_override(&cfg, ov[i], &err), AMP_OK, "%s: %s", ov[i], err.msg);
    cr_assert_eq(config_finalize(&cfg, &err), AMP_OK, "%s", err.msg);
    struct trainer t;
    setup(&t, &cfg);
    struct step_record rec;
    step(&t, &rec);
    cr_assert(isnan(rec.grad_zero_frac), "not sampled at step 1");
    step(&t, &rec);
    step(&t, &rec);
    trainer_teardown(&t);
    config_free(&cfg);
    return rec.grad_zero_frac;
}

Test(precision, grad_zero_frac_sees_inside_transformer_blocks, .timeout = 600)
{
    if (access("/usr/share/games/fortunes/cookie", R_OK) != 0)
        cr_skip_test("the fortunes corpus is not installed (Debian package fortunes)");
    setenv("OPENBLAS_NUM_THREADS", "1", 1);
    double unscaled = gpt_zero_frac("precision.mode=fp16-static", "precision.loss_scale.value=1");
    double scaled = gpt_zero_frac("precision.mode=fp16-dynamic", "precision.loss_scale.init=65536");
    double bf16 = gpt_zero_frac("precision.mode=bf16", "precision.loss_scale.value=65536");
    cr_assert(!isnan(unscaled) && !isnan(scaled) && !isnan(bf16), "%g %g %g", unscaled, scaled, bf16);
    cr_assert(unscaled > 5 * scaled + 0.01, "fp16 at scale 1 %g vs scale 2^16 %g", unscaled, scaled);
    cr_assert(bf16 < 0.01, "bf16 keeps fp32's exponent range: %g", bf16);
}

/* Bytes held per parameter by the weights, their copies, the gradient and the optimizer state (AdamW). */
static double bytes_per_param(struct trainer *t)
{
    double bytes = 0, params = 0;
    for (int i = 0; i < t->model.nparams; i++) {
        const struct param *p = t->model.params[i];
        params += (double)p->master.numel;
        bytes += (double)(tensor_bytes(&p->master) + tensor_bytes(&p->grad) + tensor_bytes(&p->copy) +
                          tensor_bytes(&t->opt.state[i].m) + tensor_bytes(&t->opt.state[i].v));
    }
    return bytes / params;
}

/* Mixed bf16 keeps an fp32 master, fp32 m and v, an fp32 gradient and a bf16 copy of each weight read in bf16:
 * 18 bytes a weight. bf16 masters are their own bf16 copy and, with bf16 moments, hold 2 + 4 + 2 + 2 = 10
 * (biases, read in fp32, keep an fp32 copy: 14 for those few). */
Test(precision, bf16_master_weights_and_moments_hold_at_most_10_bytes_a_parameter)
{
    need_data();
    const char *mixed[] = {"precision.mode=bf16", NULL};
    const char *pure[] = {"precision.mode=bf16", "precision.master_weights=bf16", "optim.state_dtype=bf16", NULL};
    struct config cfg;
    struct trainer t;
    small_mlp(&cfg, mixed);
    setup(&t, &cfg);
    double before = bytes_per_param(&t);
    trainer_teardown(&t);
    config_free(&cfg);
    small_mlp(&cfg, pure);
    setup(&t, &cfg);
    double after = bytes_per_param(&t);
    for (int i = 0; i < t.model.nparams; i++) {
        const struct param *p = t.model.params[i];
        cr_assert_eq(p->master.dtype, DT_BF16, "%s", p->name);
        cr_assert_eq(t.opt.state[i].m.dtype, DT_BF16, "%s", p->name);
        if (strstr(p->name, "/weight"))
            cr_assert_null(p->copy.data, "%s: a bf16 linear reads the bf16 master itself", p->name);
        else
            cr_assert_eq(p->copy.dtype, DT_FP32, "%s: a bias is read in fp32", p->name);
    }
    trainer_teardown(&t);
    config_free(&cfg);
    cr_assert(before > 17.9 && before <= 18.0, "mixed bf16: %.3f bytes a parameter, want about 18", before);
    cr_assert(after <= 10.05, "bf16 masters and moments: %.3f bytes a parameter, want <= 10 (+ the biases' copies)",
              after);
}

/* ---- lib/base/precision.h: what each mode implies ------------------------------------------------------ */

Test(mode, names_round_trip_and_unknown_names_are_refused)
{
    for (int m = PREC_FP32; m <= PREC_FP8; m++) {
        enum precision_mode back = PREC_FP32;
        cr_assert(precision_mode_from_name(precision_mode_name((enum precision_mode)m), &back), "mode %d", m);
        cr_assert_eq(back, (enum precision_mode)m);
    }
    enum precision_mode out = PREC_BF16;
    cr_assert_not(precision_mode_from_name("fp16", &out));
    cr_assert_not(precision_mode_from_name("", &out));
    cr_assert_eq(out, PREC_BF16, "a refused name leaves *out untouched");
    cr_assert_str_eq(precision_mode_name((enum precision_mode)99), "?");
}

Test(mode, each_mode_gives_its_lowp_dtype_and_loss_scaling)
{
    static const struct {
        enum precision_mode mode;
        enum fp8_loss_scale fp8_ls;
        enum dtype lowp;
        enum loss_scaling scaling;
    } rows[] = {
        {PREC_FP32, FP8_LS_DYNAMIC, DT_FP32, LOSS_SCALE_NONE}, /* precision.fp8.* matters only to fp8 */
        {PREC_FP16_STATIC, FP8_LS_NONE, DT_FP16, LOSS_SCALE_STATIC},
        {PREC_FP16_DYNAMIC, FP8_LS_STATIC, DT_FP16, LOSS_SCALE_DYNAMIC},
        {PREC_BF16, FP8_LS_DYNAMIC, DT_BF16, LOSS_SCALE_NONE},
        {PREC_FP8, FP8_LS_NONE, DT_BF16, LOSS_SCALE_NONE},
        {PREC_FP8, FP8_LS_STATIC, DT_BF16, LOSS_SCALE_STATIC},
        {PREC_FP8, FP8_LS_DYNAMIC, DT_BF16, LOSS_SCALE_DYNAMIC},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        struct precision_config pc = {.mode = rows[i].mode, .fp8 = {.loss_scale = rows[i].fp8_ls}};
        cr_assert_eq(precision_lowp_dtype(pc.mode), rows[i].lowp, "row %zu", i);
        cr_assert_eq(precision_loss_scaling(&pc), rows[i].scaling, "row %zu", i);
        cr_assert_eq(precision_is_loss_scaled(&pc), rows[i].scaling != LOSS_SCALE_NONE, "row %zu", i);
    }
}
