/*
 * test_numerics.c — `ampTrain numerics` (docs/precision.md): the format arithmetic against the exact conversions,
 * exact fractions at each format's boundaries, the loss-scale window, the verdicts on real models, and
 * that measuring leaves the run bit-identical.
 */
#define _POSIX_C_SOURCE 200809L
#include "ckpt_testlib.h" /* amp, scratch, assert_same_tensors, assert_same_logs */

#include <math.h>

#include "dtype.h"    /* dtype_round: the exact fp16 / bf16 rounding */
#include "numerics.h" /* the module under test */

/* num_round is the generic definition; for fp16 and bf16 it must be dtype.c's exact conversion. */
Test(numerics, rounding_matches_the_exact_fp16_and_bf16_conversions)
{
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (int i = 0; i < 2000000; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        uint32_t bits = (uint32_t)x;
        float f;
        memcpy(&f, &bits, sizeof f);
        if (!isfinite(f))
            continue;
        cr_assert_eq(num_round(f, NF_FP16), (double)dtype_round(f, DT_FP16), "fp16 %a", (double)f);
        cr_assert_eq(num_round(f, NF_BF16), (double)dtype_round(f, DT_BF16), "bf16 %a", (double)f);
    }
    /* fp8's largest values and the ties above them */
    cr_assert_eq(num_round(448, NF_E4M3), 448);
    cr_assert_eq(num_round(464, NF_E4M3), 448, "the tie goes to 448 (even)");
    cr_assert(isinf(num_round(465, NF_E4M3)));
    cr_assert_eq(num_round(57344, NF_E5M2), 57344);
    cr_assert(isinf(num_round(61440, NF_E5M2)), "the tie goes up: 57344's last bit is odd");
    cr_assert_eq(num_round(ldexp(1, -9), NF_E4M3), ldexp(1, -9), "E4M3's smallest subnormal");
    cr_assert_eq(num_round(ldexp(1, -10), NF_E4M3), 0, "half of it is a tie: to zero");
    cr_assert_eq(num_round(ldexp(1, -16), NF_E5M2), ldexp(1, -16), "E5M2's smallest subnormal");
}

/* The classification by thresholds agrees with num_round on every kind of value. */
Test(numerics, thresholds_agree_with_rounding)
{
    uint64_t x = 12345;
    for (int i = 0; i < 200000; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        /* magnitudes from 2^-30 to 2^20, around every format's edges */
        float v = (float)ldexp(1.0 + (double)(x & 0xFFFFFF) / 0x1000000, (int)((x >> 32) % 51) - 30);
        struct num_stats s = {0};
        num_stats_add(&s, &v, NULL, 1);
        for (int f = 0; f < NF_COUNT; f++) {
            double r = num_round(v, (enum num_format)f);
            bool over = isinf(r), flush = r == 0, sub = !over && !flush && r < ldexp(1, num_format(f)->emin);
            cr_assert_eq(s.overflow[f], over, "%s overflow of %a", num_format(f)->name, (double)v);
            cr_assert_eq(s.flush[f], flush, "%s flush of %a", num_format(f)->name, (double)v);
            cr_assert_eq(s.subnormal[f], sub, "%s subnormal of %a", num_format(f)->name, (double)v);
        }
    }
}

Test(numerics, boundary_values_give_exact_fractions)
{
    float v[] = {65504, 65520, 0x1p-24f, 0x1p-25f, 448, 464, 465, 57344, 61440, 0};
    struct num_stats s = {0};
    num_stats_add(&s, v, NULL, sizeof v / sizeof v[0]);
    cr_assert_eq(s.n, 10);
    cr_assert_eq(s.nonzero, 9);
    /* fp16: 65520 rounds to Inf (65504's last bit is odd); 2^-25 ties to zero; 2^-24 is its smallest subnormal */
    cr_assert_eq(s.overflow[NF_FP16], 1);
    cr_assert_eq(s.flush[NF_FP16], 1);
    cr_assert_eq(s.subnormal[NF_FP16], 1);
    /* bf16 holds them all as normals */
    cr_assert_eq(s.overflow[NF_BF16] + s.flush[NF_BF16] + s.subnormal[NF_BF16], 0);
    /* E4M3: 464 is a tie to 448; 465 and above overflow (5); 2^-24 and 2^-25 flush (below 2^-10) */
    cr_assert_eq(s.overflow[NF_E4M3], 5);
    cr_assert_eq(s.flush[NF_E4M3], 2);
    /* E5M2: 61440 and above overflow (3); the two tiny ones flush (below 2^-17) */
    cr_assert_eq(s.overflow[NF_E5M2], 3);
    cr_assert_eq(s.flush[NF_E5M2], 2);
    cr_assert_eq(s.absmax, 65520);
    cr_assert_eq(s.min_nonzero, 0x1p-25);
    /* bf16's largest finite value and the tie above it */
    float big[] = {0x1.fep127f, 0x1.ff0000p127f};
    struct num_stats b = {0};
    num_stats_add(&b, big, NULL, 2);
    cr_assert_eq(b.overflow[NF_BF16], 1);
}

Test(numerics, scale_window_from_a_gradient_histogram)
{
    /* gradients measured at scale 2^4: 1000 values of 2^-20 (2^-24 at scale 1) and one of 2^-2 */
    float g[1001];
    for (int i = 0; i < 1000; i++)
        g[i] = 0x1p-20f;
    g[1000] = 0x1p-2f;
    struct num_stats s = {0};
    num_stats_add(&s, g, NULL, 1001);
    int lo = 0, hi = 0;
    num_scale_window(&s, 16.0, 0.001, &lo, &hi);
    /* at scale 2^k the big one is 2^(k-6): at most 65504 up to k = 21 */
    cr_assert_eq(hi, 21);
    /* the small ones (2^-24 at scale 1) flush while 2^(k-24) <= 2^-25: from k = 0 they are kept */
    cr_assert_eq(lo, 0);
    /* a window that cannot exist */
    num_scale_window(&s, 16.0, 0.0, &lo, &hi);
    cr_assert_leq(lo, hi);
}

#define SMALL_MLP "model.layers.1.out=32 model.layers.3.out=32 data.batch_size=64 run.device=cpu"

Test(numerics, fashion_mlp_in_bf16_is_safe)
{
    struct result r = amp("numerics configs/fashion_mlp.yaml precision.mode=bf16 " SMALL_MLP
                          " run.out_dir=/tmp/amp_numerics_$$ --steps 2; rm -rf /tmp/amp_numerics_$$");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "verdict bf16: safe"), "%s", r.out);
    cr_assert(strstr(r.out, "verdict fp16-static at 2^16 (precision.loss_scale.value 65536): safe"), "%s", r.out);
    cr_assert(strstr(r.out, "loss-scale window (fp16, all activation gradients pooled): [2^"), "%s", r.out);
}

/* configs/fashion_underflow.yaml without loss scaling: the gradients near the input flush to zero in fp16;
 * the window holds the scale that fixes it (2^16, fp16-dynamic's init). */
Test(numerics, the_underflow_config_shows_where_it_underflows_and_the_scale_that_fixes_it)
{
    struct result r = amp("numerics configs/fashion_underflow.yaml precision.mode=fp16-static "
                          "precision.loss_scale.value=1 run.device=cpu run.out_dir=/tmp/amp_numerics_u_$$ --steps 1; "
                          "head -1 /tmp/amp_numerics_u_$$/numerics-from-step-0.csv; grep -c ',fc1,act_grad,fp16,' "
                          "/tmp/amp_numerics_u_$$/numerics-from-step-0.csv; rm -rf /tmp/amp_numerics_u_$$");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "verdict fp16-static at 2^0 (precision.loss_scale.value 1): underflows"), "%s", r.out);
    cr_assert(strstr(r.out, "% in fc1 (activation gradient;"), "the first layer, nearest the input:\n%s", r.out);
    const char *w = strstr(r.out, "loss-scale window (fp16, all activation gradients pooled): [2^");
    cr_assert_not_null(w, "%s", r.out);
    int lo = 0, hi = 0;
    cr_assert_eq(sscanf(w, "loss-scale window (fp16, all activation gradients pooled): [2^%d, 2^%d]", &lo, &hi), 2, "%s", w);
    cr_assert(lo <= 16 && 16 <= hi, "window [2^%d, 2^%d] should hold 2^16", lo, hi);
    cr_assert(strstr(r.out, "step,tensor,kind,format,numel,scale,absmax,rms,min_nonzero,overflow_frac,flush_frac,"
                            "subnormal_frac,rel_err\n1\n"),
              "the csv header and one fp16 row of fc1's gradient:\n%s", r.out);
}

/* Issue 43, item 6: the window pools every activation gradient while the verdict judges each tensor; it printed
 * [2^16, 2^26] and then an fp16-static scale inside it could still underflow one tensor, with no value to set. The
 * report says which is which, and the static verdict names the config value, which then is safe. */
Test(numerics, the_window_is_pooled_and_the_verdict_names_the_value_to_set)
{
    struct result r = amp("numerics configs/fashion_underflow.yaml precision.mode=fp16-static "
                          "precision.loss_scale.value=1 run.device=cpu run.out_dir=/tmp/amp_numerics_v_$$ --steps 1; "
                          "rm -rf /tmp/amp_numerics_v_$$");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "all activation gradients pooled") && strstr(r.out, "the verdicts below judge each tensor "
                                                                                 "apart"), "%s", r.out);
    const char *w = strstr(r.out, "loss-scale window (fp16, all activation gradients pooled): [2^");
    cr_assert_not_null(w, "%s", r.out);
    int lo = 0, hi = 0;
    double vlo = 0, vhi = 0;
    cr_assert_eq(sscanf(w, "loss-scale window (fp16, all activation gradients pooled): [2^%d, 2^%d] "
                           "(precision.loss_scale.value %lf to %lf)", &lo, &hi, &vlo, &vhi), 4, "%s", w);
    cr_assert(vlo == ldexp(1.0, lo) && vhi == ldexp(1.0, hi), "%s", w);
    const char *a = strstr(r.out, "  per tensor, 2^");
    cr_assert_not_null(a, "no per-tensor advice:\n%s", r.out);
    int from = 0, to = 0, k = 0;
    double value = 0;
    cr_assert_eq(sscanf(a, "  per tensor, 2^%d to 2^%d is safe: set precision.loss_scale.value: %lf (2^%d)", &from,
                        &to, &value, &k), 4, "%s", a);
    cr_assert(from <= k && k <= to && value == ldexp(1.0, k), "%s", a);
    /* per tensor the range starts above the pooled window's bottom: the pooled one would have misled */
    cr_assert_gt(from, lo, "pooled [2^%d, 2^%d], per tensor from 2^%d", lo, hi, from);
    char want[160];
    snprintf(want, sizeof want, "verdict fp16-static at 2^%d (precision.loss_scale.value %.17g): safe", k, value);
    r = amp("numerics configs/fashion_underflow.yaml precision.mode=fp16-static precision.loss_scale.value=%.17g "
            "run.device=cpu run.out_dir=/tmp/amp_numerics_v_$$ --steps 1; rm -rf /tmp/amp_numerics_v_$$", value);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, want), "the advised value is not safe (no '%s'):\n%s", want, r.out);
    cr_assert_null(strstr(r.out, "  per tensor, 2^"), "advice for a safe scale:\n%s", r.out);
}

/* Issue 43, item 6: one rule for what a command given a checkpoint writes: beside the checkpoint. `eval` wrote its
 * eval.jsonl there while `numerics` wrote into the run.out_dir of the checkpoint's embedded config (here the run's
 * first directory, which the copy left behind). */
Test(numerics, a_checkpoint_is_measured_beside_itself_as_eval_writes)
{
    struct result r = amp("run configs/fashion_mlp.yaml " SMALL_MLP " run.steps=2 run.out_dir=/tmp/amp_numerics_d_$$/a "
                          "> /dev/null && mkdir /tmp/amp_numerics_d_$$/b && cp /tmp/amp_numerics_d_$$/a/ckpt-2.h5 "
                          "/tmp/amp_numerics_d_$$/b/ && " AMP_BINARY " numerics /tmp/amp_numerics_d_$$/b/ckpt-2.h5 "
                          "--steps 1 > /dev/null && " AMP_BINARY " eval /tmp/amp_numerics_d_$$/b/ckpt-2.h5 > /dev/null;"
                          " echo \"rc $?\"; echo a: $(ls /tmp/amp_numerics_d_$$/a); echo b: $(ls /tmp/amp_numerics_d_$$/b);"
                          " rm -rf /tmp/amp_numerics_d_$$");
    cr_assert(strstr(r.out, "rc 0"), "%s", r.out);
    cr_assert(strstr(r.out, "b: ckpt-2.h5 eval.jsonl numerics-from-step-2.csv"), "both beside the checkpoint:\n%s",
              r.out);
    const char *a = strstr(r.out, "a: "), *b = strstr(r.out, "b: ");
    cr_assert(a && b && a < b, "%s", r.out);
    const char *in_a = strstr(a, "numerics-from-step");
    cr_assert(in_a == NULL || in_a > b, "written into the embedded out_dir too:\n%s", r.out);
}

/* Inputs scaled up 10^5 (data.std tiny) put the first layer's outputs beyond 65504: fp16 overflows in the
 * forward pass whatever the loss scale, bf16 holds them. */
Test(numerics, an_activation_beyond_fp16_is_flagged_for_fp16_not_bf16)
{
    struct result r = amp("numerics configs/fashion_mlp.yaml precision.mode=bf16 data.std=0.00001 " SMALL_MLP
                          " run.out_dir=/tmp/amp_numerics_o_$$ --steps 1; rm -rf /tmp/amp_numerics_o_$$");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "verdict fp16-static at 2^16 (precision.loss_scale.value 65536): overflows in fc1 (activation"), "%s", r.out);
    cr_assert(strstr(r.out, "verdict bf16: safe"), "%s", r.out);
    cr_assert(strstr(r.out, "E4M3 saturates activations in"), "%s", r.out);
}

Test(numerics, bad_arguments_are_usage_errors)
{
    struct result r = amp("numerics configs/fashion_mlp.yaml --steps 0");
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "--steps '0' is not an integer in [1, 100000]"), "%s", r.out);
    r = amp("numerics configs/fashion_mlp.yaml --underflow 2");
    cr_assert_eq(r.code, 2, "%s", r.out);
    r = amp("numerics");
    cr_assert_eq(r.code, 2, "%s", r.out);
    r = amp("numerics /nonexistent/ckpt-5.h5");
    cr_assert_eq(r.code, 4, "%s", r.out);
}

/* Measuring never changes the run: K steps with a measurement before each give the same bits as K without. The
 * measured run keeps its layers apart (run.numerics_every), the other runs batchnorm with the ReLU after it fused
 * (layer_build.fuse), so this is also that fusion's check. */
static void train_steps(int steps, bool measure, float **out, size_t *n)
{
    struct config cfg;
    struct amp_error err = {0};
    cr_assert_eq(config_load(&cfg, AMP_SOURCE_DIR "/configs/fashion_cnn.yaml", &err), AMP_OK, "%s", err.msg);
    const char *ov[] = {"precision.mode=fp16-dynamic", "data.batch_size=16", "run.device=cpu", "run.steps=3",
                        "model.layers.0.out=4", "model.layers.4.out=4", "model.layers.9.out=16"};
    for (size_t i = 0; i < sizeof ov / sizeof ov[0]; i++)
        cr_assert_eq(config_apply_override(&cfg, ov[i], &err), AMP_OK, "%s: %s", ov[i], err.msg);
    if (measure)
        cr_assert_eq(config_apply_override(&cfg, "run.numerics_every=1", &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(config_finalize(&cfg, &err), AMP_OK, "%s", err.msg);
    struct trainer t;
    cr_assert_eq(trainer_setup(&t, &cfg, NULL, &err), AMP_OK, "%s", err.msg);
    struct numerics nm;
    if (measure)
        cr_assert_eq(numerics_open(&nm, &t, NULL, NULL, false, &err), AMP_OK, "%s", err.msg);
    for (int k = 0; k < steps; k++) {
        if (measure)
            cr_assert_eq(numerics_step(&nm, &t, &err), AMP_OK, "%s", err.msg);
        else
            cr_assert_eq(trainer_step(&t, &err), AMP_OK, "%s", err.msg);
        cr_assert_eq(trainer_flush(&t, &err), AMP_OK, "%s", err.msg);
    }
    *n = 0;
    for (int i = 0; i < t.model.nparams; i++)
        *n += t.model.params[i]->master.numel;
    for (int i = 0; i < t.model.nbuffers; i++)
        *n += t.model.buffers[i]->t.numel;
    *out = malloc(*n * sizeof **out);
    size_t off = 0;
    for (int i = 0; i < t.model.nparams; i++) {
        memcpy(*out + off, t.model.params[i]->master.data, t.model.params[i]->master.numel * sizeof(float));
        off += t.model.params[i]->master.numel;
    }
    for (int i = 0; i < t.model.nbuffers; i++) {
        memcpy(*out + off, t.model.buffers[i]->t.data, t.model.buffers[i]->t.numel * sizeof(float));
        off += t.model.buffers[i]->t.numel;
    }
    if (measure) {
        cr_assert_eq(nm.steps, steps);
        numerics_close(&nm);
    }
    trainer_teardown(&t);
    config_free(&cfg);
}

Test(numerics, measuring_leaves_the_run_bit_identical)
{
    float *a, *b;
    size_t na, nb;
    train_steps(3, false, &a, &na);
    train_steps(3, true, &b, &nb);
    cr_assert_eq(na, nb);
    cr_assert_eq(memcmp(a, b, na * sizeof *a), 0, "weights and batchnorm statistics must be bit-identical");
    free(a);
    free(b);
}

/* A checkpoint (here its run directory) is measured from its state. The measured steps are trained in memory only,
 * so their rows go to a file of the command's own, never into the run's numerics.csv, whose rows are steps that
 * were trained (before, `numerics RUN_DIR` appended a step 4 the run never trained to it). */
Test(numerics, a_checkpoint_is_measured_from_its_state)
{
    struct result r = amp("run configs/fashion_mlp.yaml precision.mode=fp16-dynamic " SMALL_MLP
                          " run.steps=3 run.numerics_every=2 run.out_dir=/tmp/amp_numerics_c_$$ > /dev/null && "
                          "cp /tmp/amp_numerics_c_$$/numerics.csv /tmp/amp_numerics_c_$$.before && numerics_out=$("
                          AMP_BINARY " numerics /tmp/amp_numerics_c_$$ --steps 1 2>&1); echo \"rc $?\"; "
                          "echo \"$numerics_out\"; ls /tmp/amp_numerics_c_$$; cmp /tmp/amp_numerics_c_$$.before "
                          "/tmp/amp_numerics_c_$$/numerics.csv && echo 'run csv unchanged'; cut -d, -f1 "
                          "/tmp/amp_numerics_c_$$/numerics-from-step-3.csv | sort -u | tr '\\n' ' '; "
                          "rm -rf /tmp/amp_numerics_c_$$ /tmp/amp_numerics_c_$$.before");
    cr_assert(strstr(r.out, "rc 0"), "%s", r.out);
    cr_assert(strstr(r.out, "measuring 1 step from step 3"), "%s", r.out);
    cr_assert(strstr(r.out, "step 4 | loss"), "%s", r.out);
    cr_assert(strstr(r.out, "nothing but /tmp/amp_numerics_c_") && strstr(r.out, "/numerics-from-step-3.csv is written"),
              "%s", r.out);
    cr_assert(!strstr(r.out, "ckpt-4.h5"), "nothing but the measurement's file is written:\n%s", r.out);
    cr_assert(strstr(r.out, "run csv unchanged"), "the run's numerics.csv (steps 1 and 3) is untouched:\n%s", r.out);
    cr_assert(strstr(r.out, "4 step "), "the measurement's file holds step 4 and its header:\n%s", r.out);
}

/* run.numerics_every during a run: scale_log.csv and every checkpoint tensor as without it. */
Test(numerics, a_run_that_measures_is_bit_identical_to_one_that_does_not)
{
    make_scratch();
    const char *common = "run configs/fashion_mlp.yaml precision.mode=fp16-dynamic precision.loss_scale.init=1e9 "
                         "precision.loss_scale.max=inf " SMALL_MLP " run.steps=6 run.log_every=4 run.ckpt_every=3";
    struct result r = amp("%s run.out_dir=%s/plain", common, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp("%s run.numerics_every=2 run.out_dir=%s/measured", common, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "numerics: 3 steps measured in "), "steps 1, 3, 5:\n%s", r.out);
    char a[600], b[600];
    const char *files[] = {"ckpt-3.h5", "ckpt-6.h5"};
    for (int i = 0; i < 2; i++) {
        snprintf(a, sizeof a, "%s/plain/%s", scratch, files[i]);
        snprintf(b, sizeof b, "%s/measured/%s", scratch, files[i]);
        assert_same_tensors(a, b);
    }
    snprintf(a, sizeof a, "%s/plain/scale_log.csv", scratch);
    snprintf(b, sizeof b, "%s/measured/scale_log.csv", scratch);
    assert_same_logs(a, b);
    snprintf(b, sizeof b, "%s/measured/numerics.csv", scratch);
    cr_assert(file_exists(b));
    remove_scratch();
}

/* `numerics` made run.out_dir without its parents (exit 1 where `run` creates them), so the example in
 * docs/precision.md failed in a fresh checkout. */
Test(numerics, run_out_dir_is_made_with_its_parents)
{
    struct result r = amp("numerics configs/fashion_mlp.yaml " SMALL_MLP " run.out_dir=/tmp/amp_numerics_p_$$/a/b "
                          "--steps 1 > /dev/null; echo \"rc $?\"; ls /tmp/amp_numerics_p_$$/a/b; "
                          "rm -rf /tmp/amp_numerics_p_$$");
    cr_assert(strstr(r.out, "rc 0\nnumerics-from-step-0.csv"), "%s", r.out);
}
