/*
 * test_recompute.c — run.recompute (models/attention.c): what a transformer block keeps in the shared workspace and
 * computes again in backward gives the same bits as keeping it. End to end through the binary on the CPU: the byte
 * GPT (configs/text_gpt.yaml, two blocks) in every precision mode, each recompute mode against none, with
 * accumulation (the recomputed forward must not disturb the gradients summed across micro-batches), compared by
 * scale_log.csv (every column but samples_per_s), eval.jsonl and every checkpoint tensor. tests/test_cuda_backend.c
 * holds the same comparison on a GPU.
 */
#define _POSIX_C_SOURCE 200809L
#include "ckpt_testlib.h" /* amp, scratch, assert_same_tensors, assert_same_logs */

TestSuite(recompute, .init = make_scratch, .fini = remove_scratch, .timeout = 600);

/* Micro-batches of 8 sequences (not 32) and a validation split of 0.5% (109 sequences, not 2,192): 17 runs of this
 * under ASan took a minute of two CPUs at 32 and 2%, and the size buys nothing here: a recompute that skips the
 * last sample's rows still fails every mode, the GELU recompute left out fails fp32, bf16 and fp16-dynamic (as at
 * 32; fp8 passes either way). Each run evaluates twice; the recomputed backward does not enter an evaluation, whose
 * bits follow the weights either way. */
#define GPT                                                                                                          \
    "configs/text_gpt.yaml run.device=cpu run.steps=3 run.log_every=1 run.eval_every=2 accum_steps=2 "             \
    "data.batch_size=8 data.val_fraction=0.005"

static void check_mode(const char *mode)
{
    static const char *const kinds[] = {"none", "gelu", "attention", "block"};
    for (int k = 0; k < 4; k++) {
        /* fp8: every product in fp8, however small */
        const char *all = strcmp(mode, "fp8") == 0 ? "'precision.fp8.min_size=[0,0]'" : "";
        struct result r = amp("run " GPT " precision.mode=%s %s run.recompute=%s run.out_dir=%s/%s-%s", mode, all,
                              kinds[k], scratch, mode, kinds[k]);
        cr_assert_eq(r.code, 0, "%s %s:\n%s", mode, kinds[k], r.out);
    }
    char a[700], b[700];
    for (int k = 1; k < 4; k++) {
        snprintf(a, sizeof a, "%s/%s-none/scale_log.csv", scratch, mode);
        snprintf(b, sizeof b, "%s/%s-%s/scale_log.csv", scratch, mode, kinds[k]);
        assert_same_logs(a, b);
        snprintf(a, sizeof a, "%s/%s-none/ckpt-3.h5", scratch, mode);
        snprintf(b, sizeof b, "%s/%s-%s/ckpt-3.h5", scratch, mode, kinds[k]);
        cr_assert_gt(assert_same_tensors(a, b), 20, "%s %s: the weights and moments", mode, kinds[k]);
        char cmd[1600];
        snprintf(cmd, sizeof cmd, "cmp %s/%s-none/eval.jsonl %s/%s-%s/eval.jsonl", scratch, mode, scratch, mode,
                 kinds[k]);
        cr_assert_eq(system(cmd), 0, "%s %s: eval.jsonl differs", mode, kinds[k]);
    }
}

Test(recompute, fp32_is_the_same_bits) { check_mode("fp32"); }
Test(recompute, bf16_is_the_same_bits) { check_mode("bf16"); }
Test(recompute, fp16_dynamic_is_the_same_bits) { check_mode("fp16-dynamic"); }
Test(recompute, fp8_is_the_same_bits) { check_mode("fp8"); }

/* The keys: a value outside the list is exit 2 naming them; resume may change it (the same bits either way). */
Test(recompute, the_key_and_resume)
{
    struct result r = amp("check configs/text_gpt.yaml run.recompute=everything");
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "run.recompute") && strstr(r.out, "none") && strstr(r.out, "block"), "%s", r.out);
    r = amp("run " GPT " run.out_dir=%s/a", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp("resume %s/a/ckpt-3.h5 run.steps=4 run.recompute=block", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp("run " GPT " run.steps=4 run.out_dir=%s/b", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char a[700], b[700];
    snprintf(a, sizeof a, "%s/a/ckpt-4.h5", scratch);
    snprintf(b, sizeof b, "%s/b/ckpt-4.h5", scratch);
    assert_same_tensors(a, b);
}
