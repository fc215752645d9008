/*
 * test_resume.c — bit-exact resume (docs/checkpoint.md, "Resume"): N steps straight, and k steps
 * then `ampTrain resume` for the remaining N-k, give byte-identical tensors in the final checkpoints and
 * identical scale_log.csv rows (samples_per_s aside), in every precision mode, with accum_steps > 1, and
 * from a checkpoint taken right after a skipped step. Also SIGTERM mid-training, then resume.
 */
#define _POSIX_C_SOURCE 200809L
#include "ckpt_testlib.h"

#include <signal.h>
#include <time.h>

#define N_STEPS 12

/* Run `extra` for N_STEPS straight in A, and k steps + resume in B; compare. */
static void check_resume(const char *name, const char *extra, int k)
{
    make_scratch();
    struct result r = amp("run configs/fashion_mlp.yaml " SMALL " %s run.steps=%d run.out_dir=%s/a", extra, N_STEPS,
                          scratch);
    cr_assert_eq(r.code, 0, "%s straight run:\n%s", name, r.out);
    r = amp("run configs/fashion_mlp.yaml " SMALL " %s run.steps=%d run.out_dir=%s/b", extra, k, scratch);
    cr_assert_eq(r.code, 0, "%s first part:\n%s", name, r.out);
    r = amp("resume %s/b/ckpt-%d.h5 run.steps=%d", scratch, k, N_STEPS);
    cr_assert_eq(r.code, 0, "%s resume:\n%s", name, r.out);
    cr_assert(strstr(r.out, "resumed from"), "%s", r.out);
    char a[512], b[512];
    snprintf(a, sizeof a, "%s/a/ckpt-%d.h5", scratch, N_STEPS);
    snprintf(b, sizeof b, "%s/b/ckpt-%d.h5", scratch, N_STEPS);
    int n = assert_same_tensors(a, b);
    cr_assert_geq(n, 6, "%s: only %d tensors compared", name, n);
    snprintf(a, sizeof a, "%s/a/scale_log.csv", scratch);
    snprintf(b, sizeof b, "%s/b/scale_log.csv", scratch);
    assert_same_logs(a, b);
    remove_scratch();
}

Test(resume, bit_exact_fp32) { check_resume("fp32", "precision.mode=fp32", 5); }
Test(resume, bit_exact_bf16) { check_resume("bf16", "precision.mode=bf16", 5); }
Test(resume, bit_exact_fp16_static) { check_resume("fp16-static", "precision.mode=fp16-static", 5); }
Test(resume, bit_exact_fp16_dynamic_with_growth)
{
    /* growth_interval 3 so the scale grows and the tracker is mid-count at the checkpoint. */
    check_resume("fp16-dynamic", "precision.mode=fp16-dynamic precision.loss_scale.growth_interval=3", 5);
}
Test(resume, bit_exact_with_accumulation_and_sgd_momentum)
{
    check_resume("accum", "precision.mode=fp16-dynamic accum_steps=2 optim.kind=sgd optim.momentum=0.9 optim.lr=0.05",
                 5);
}
Test(resume, bit_exact_with_dropout_and_warmup)
{
    /* The first part is a k-step run, so the schedule must not depend on run length (cosine does: it is
     * covered by the SIGTERM test, whose first part is planned for the full length). */
    check_resume("dropout", "precision.mode=bf16 model.layers.2.kind=dropout optim.schedule.warmup_steps=8", 5);
}

Test(resume, bit_exact_bf16_master_weights_with_stochastic_rounding)
{
    /* the rounding bits are keyed by (run.seed, step, parameter): the resumed run draws what the straight one did */
    check_resume("bf16-master", "precision.mode=bf16 precision.master_weights=bf16 optim.state_dtype=bf16 "
                                "optim.stochastic_rounding=true", 5);
}
Test(resume, bit_exact_bf16_master_weights_sgd_momentum)
{
    check_resume("bf16-master-sgd", "precision.mode=bf16 precision.master_weights=bf16 optim.state_dtype=bf16 "
                                    "optim.stochastic_rounding=true optim.kind=sgd optim.momentum=0.9 optim.lr=0.05", 5);
}

Test(resume, bit_exact_fp8_delayed_with_a_wrapping_history)
{
    /* history of 4 steps over 12: the ring wraps, and the checkpoint at step 5 holds a mid-ring position; every
     * linear layer in fp8 and two micro-batches a step (the amax rows are raised twice) */
    check_resume("fp8-delayed", "precision.mode=fp8 precision.fp8.amax_history_len=4 'precision.fp8.keep_bf16=[]' "
                                "'precision.fp8.min_size=[0,0]' accum_steps=2", 5);
}
Test(resume, bit_exact_fp8_current) { check_resume("fp8-current", "precision.mode=fp8 precision.fp8.recipe=current 'precision.fp8.min_size=[0,0]'", 5); }

/* Scale 2^30 overflows fp16 at once; backoff 1/16 reaches a workable 2^18 after three skipped steps. */
#define OVERFLOWING                                                                                                  \
    "precision.mode=fp16-dynamic precision.loss_scale.init=1073741824 precision.loss_scale.max=1073741824 "         \
    "precision.loss_scale.backoff_factor=0.0625"

Test(resume, bit_exact_from_a_checkpoint_right_after_a_skipped_step)
{
    make_scratch();
    struct result r = amp("run configs/fashion_mlp.yaml " SMALL " " OVERFLOWING " run.steps=2 run.out_dir=%s/probe",
                          scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char log[512];
    snprintf(log, sizeof log, "%s/probe/scale_log.csv", scratch);
    char *rows = log_without_speed(log);
    cr_assert(strstr(rows, "\n2,0,"), "%s", rows);
    cr_assert(strstr(strstr(rows, "\n2,0,"), ",1,1,2,"), "step 2 must be skipped (found_inf, skipped, skips 2):\n%s",
              rows);
    free(rows);
    remove_scratch();
    check_resume("after skip", OVERFLOWING, 2);
}

/* SIGTERM mid-training: exit 143 after a checkpoint; resuming it ends identical to an uninterrupted run. */
Test(resume, sigterm_then_resume_equals_uninterrupted)
{
    make_scratch();
    const char *model = "model.layers.1.out=256 model.layers.3.out=256 data.batch_size=64 run.device=cpu "
                        "run.log_every=10 run.steps=150 optim.schedule.kind=cosine";
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "cd %s && exec %s run configs/fashion_mlp.yaml %s run.out_dir=%s/b >%s/b.out 2>&1",
             AMP_SOURCE_DIR, AMP_BINARY, model, scratch, scratch);
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    /* Wait until training has started (a few log rows: they are written every log_every = 10 steps; up to 60 s
     * on a loaded machine), then SIGTERM. */
    char csv[512];
    snprintf(csv, sizeof csv, "%s/b/scale_log.csv", scratch);
    for (int i = 0; i < 6000 && (!file_exists(csv) || file_size(csv) < 200); i++)
        nanosleep(&(struct timespec){.tv_nsec = 10 * 1000 * 1000}, NULL);
    kill(pid, SIGTERM);
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    char outp[512];
    snprintf(outp, sizeof outp, "%s/b.out", scratch);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 143, "exit status %d", status);
    char latest[512], name[128] = "";
    snprintf(latest, sizeof latest, "%s/b/latest", scratch);
    FILE *f = fopen(latest, "r");
    cr_assert_not_null(f, "no latest after SIGTERM");
    cr_assert_eq(fscanf(f, "%127s", name), 1);
    fclose(f);
    cr_assert_str_neq(name, "ckpt-150.h5", "SIGTERM came after the end; make the run longer");
    struct result r = amp("resume %s/b/%s", scratch, name);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp("run configs/fashion_mlp.yaml %s run.out_dir=%s/a", model, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char a[512], b[512];
    snprintf(a, sizeof a, "%s/a/ckpt-150.h5", scratch);
    snprintf(b, sizeof b, "%s/b/ckpt-150.h5", scratch);
    assert_same_tensors(a, b);
    snprintf(a, sizeof a, "%s/a/scale_log.csv", scratch);
    assert_same_logs(a, csv);
    remove_scratch();
}
