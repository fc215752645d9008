/*
 * test_setup.c — lib/engine/setup.h: what each setup_data reads, the mode's policy, and a failed setup that is still safe
 * to close. The commands built on it (run, eval, sample, export, numerics) are tested end to end in their own suites.
 */
#include <criterion/criterion.h>

#include <string.h>

#include "config.h"
#include "error.h"
#include "setup.h"

/* configs/NAME with `n` overrides, finalized. */
static void load(struct config *cfg, const char *name, const char *const *ov, size_t n)
{
    char path[512];
    struct amp_error err = {0};
    snprintf(path, sizeof path, "%s/configs/%s", AMP_SOURCE_DIR, name);
    cr_assert_eq(config_load(cfg, path, &err), AMP_OK, "%s", err.msg);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(config_apply_override(cfg, ov[i], &err), AMP_OK, "%s: %s", ov[i], err.msg);
    cr_assert_eq(config_finalize(cfg, &err), AMP_OK, "%s", err.msg);
}

/* A text model's input is the config's (seq_len bytes): SETUP_DATA_SPEC reads none of its files, which here do not
 * exist; SETUP_DATA_TRAIN reads them and names the missing one. */
Test(setup, spec_reads_no_data_train_does)
{
    static const char *const ov[] = {"run.device=cpu", "data.files=[/nonexistent/setup-test.txt]"};
    struct config cfg;
    load(&cfg, "text_gpt.yaml", ov, sizeof ov / sizeof ov[0]);
    struct amp_error err = {0};
    struct dataset ds;
    struct model m;
    struct setup s = {.model = &m}; /* no dataset: SETUP_DATA_SPEC keeps none */
    enum amp_status st = setup_open(
        &s, &cfg, &(struct setup_opts){.data = SETUP_DATA_SPEC, .mode = PREC_FP32, .max_batch = 1}, &err);
    cr_assert_eq(st, AMP_OK, "%s", err.msg);
    cr_expect_eq(m.max_batch, 1);
    cr_expect_eq(m.nlayers, cfg.model.nlayers);
    setup_close(&s);
    cr_expect_null(s.be);

    s = (struct setup){.ds = &ds, .model = &m};
    st = setup_open(&s, &cfg,
                    &(struct setup_opts){.data = SETUP_DATA_TRAIN, .mode = PREC_FP32, .max_batch = 2}, &err);
    cr_expect_eq(st, AMP_ERR_DATA, "status %d: %s", (int)st, err.msg);
    cr_expect(strstr(err.msg, "/nonexistent/setup-test.txt") != NULL, "%s", err.msg);
    cr_expect_eq(m.nlayers, 0, "a model built after the data failed");
    setup_close(&s);
    config_free(&cfg);
}

/* An idx model's sample shape is its files': without a checkpoint's /data, SETUP_DATA_SPEC loads the data for it
 * (and frees it once the model is built: no dataset is given to keep it in). */
Test(setup, spec_takes_an_idx_shape_from_the_data)
{
    static const char *const ov[] = {"run.device=cpu"};
    struct config cfg;
    load(&cfg, "fashion_mlp.yaml", ov, 1);
    struct amp_error err = {0};
    struct model m;
    struct setup s = {.model = &m};
    enum amp_status st = setup_open(
        &s, &cfg, &(struct setup_opts){.data = SETUP_DATA_SPEC, .mode = PREC_FP32, .max_batch = 1}, &err);
    cr_assert_eq(st, AMP_OK, "%s", err.msg);
    cr_assert_gt(m.nparams, 0);
    cr_expect_eq(m.params[0]->master.shape[1], 784, "first weight (%lld, %lld): not built for 28x28 images",
                 (long long)m.params[0]->master.shape[0], (long long)m.params[0]->master.shape[1]);
    setup_close(&s);
    config_free(&cfg);
}

/* The policy is opts.mode's, not the config's: eval's --dtype and sample's run precision go through it. */
Test(setup, mode_gives_the_policy)
{
    static const char *const ov[] = {"run.device=cpu"};
    struct config cfg;
    load(&cfg, "text_gpt.yaml", ov, 1);
    cr_assert_eq(cfg.precision.mode, PREC_FP32);
    struct amp_error err = {0};
    struct model m;
    struct setup s = {.model = &m};
    cr_assert_eq(setup_open(&s, &cfg, &(struct setup_opts){.data = SETUP_DATA_SPEC, .mode = PREC_BF16, .max_batch = 1},
                            &err),
                 AMP_OK, "%s", err.msg);
    cr_expect(m.policy.enabled);
    cr_expect_eq(m.policy.lowp, DT_BF16);
    setup_close(&s);
    cr_assert_eq(setup_open(&s, &cfg, &(struct setup_opts){.data = SETUP_DATA_SPEC, .mode = PREC_FP32, .max_batch = 1},
                            &err),
                 AMP_OK, "%s", err.msg);
    cr_expect(!m.policy.enabled);
    setup_close(&s);
    config_free(&cfg);
}

/* A device that cannot be opened stops the setup at its first step with the backend's own error; what setup_open
 * leaves is safe to close. */
Test(setup, bad_device_fails_first_and_closes)
{
    static const char *const ov[] = {"run.device=cpu"};
    struct config cfg;
    load(&cfg, "text_gpt.yaml", ov, 1);
    struct amp_error err = {0};
    struct dataset ds;
    struct model m;
    struct setup s = {.ds = &ds, .model = &m};
    enum amp_status st = setup_open(
        &s, &cfg,
        &(struct setup_opts){.device = "tpu", .data = SETUP_DATA_TRAIN, .mode = PREC_FP32, .max_batch = 2}, &err);
    cr_expect_eq(st, AMP_ERR_CONFIG, "status %d: %s", (int)st, err.msg);
    cr_expect(strstr(err.msg, "run.device is 'tpu'") != NULL, "%s", err.msg);
    cr_expect_null(s.be);
    cr_expect_eq(ds.nfiles, 0, "data read after the backend failed");
    cr_expect_eq(m.nlayers, 0);
    setup_close(&s);
    config_free(&cfg);
}
