/*
 * test_cli.c — end-to-end tests of the ampTrain program: help, version, exit codes, `check`.
 *
 * Runs the built binary (AMP_BINARY) through /bin/sh and asserts on exit codes and output.
 */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "testrun.h" /* amp: run the binary */

/* Run `ampTrain ARGS` (and any shell commands after it) from the source directory, stderr merged. */
static struct result run(const char *args)
{
    return amp("%s", args);
}

Test(cli, version_says_whether_cuda_was_built)
{
    struct result r = run("--version");
    cr_assert_eq(r.code, 0);
    cr_assert(strstr(r.out, "ampTrain 0.1.0"), "%s", r.out);
#ifdef AMP_HAVE_CUDA
    cr_assert(strstr(r.out, "CUDA backend: built"), "%s", r.out);
    cr_assert(strstr(r.out, "CUDA loaded: driver "), "the libraries actually loaded:\n%s", r.out);
#else
    cr_assert(strstr(r.out, "CUDA backend: not built"), "%s", r.out);
#endif
#ifdef AMP_HAVE_MPI
    cr_assert(strstr(r.out, "MPI: built ("), "%s", r.out);
#else
    cr_assert(strstr(r.out, "MPI: not built"), "%s", r.out);
#endif
    cr_assert(strstr(r.out, "NCCL: "), "%s", r.out);
}

/* Hostile inputs: each of these hung, crashed, lost data or printed a raw '%s'. */
Test(cli, a_fifo_given_as_config_or_checkpoint_is_refused_not_waited_on) /* each call under timeout 20 */
{
    struct result r = shell("f=/tmp/amp_cli_fifo_$$; mkfifo $f && { timeout 20 " AMP_BINARY " check $f; echo \"check $?\"; "
              "timeout 20 " AMP_BINARY " inspect $f; echo \"inspect $?\"; timeout 20 " AMP_BINARY
              " resume $f; echo \"resume $?\"; } 2>&1; rm -f $f");
    cr_assert(strstr(r.out, "check 2"), "a FIFO config: exit 2, not a hang (124):\n%s", r.out);
    cr_assert(strstr(r.out, "inspect 4") && strstr(r.out, "resume 4"), "a FIFO checkpoint: exit 4:\n%s", r.out);
    cr_assert(strstr(r.out, "not a regular file"), "%s", r.out);
}

/* A FIFO as any data file or as model.init_from waited for a writer for ever (and SIGTERM then ended the wait as
 * exit 3, "Interrupted system call"): each is refused at once, naming the file and its key. */
Test(cli, a_fifo_as_data_or_init_from_is_refused_not_waited_on) /* each run under timeout 60: a loaded machine */
{
    static const struct {
        const char *args, *key;
        int code;
    } cases[] = {
        {"configs/fashion_mlp.yaml data.train_images=$f", "(data.train_images)", 3},
        {"configs/fashion_mlp.yaml data.format=hdf5 data.path=$f", "(data.path)", 3},
        {"configs/text_gpt.yaml data.files=[$f]", "(data.files)", 3},
        {"configs/tokens_gpt.yaml data.train_bin=$f", "(data.train_bin)", 3},
        {"configs/fashion_mlp.yaml model.init_from=$f", "model.init_from: ", 4},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char cmd[1024];
        snprintf(cmd, sizeof cmd, "cd %s && f=/tmp/amp_cli_fifo_$$ && mkfifo $f && { timeout 60 %s run %s run.device=cpu "
                 "run.steps=1 run.out_dir=$f.out; echo \"rc $?\"; } 2>&1; rm -rf $f $f.out", AMP_SOURCE_DIR,
                 amp_binary(), cases[i].args);
        struct result r = shell(cmd);
        char want[16];
        snprintf(want, sizeof want, "rc %d\n", cases[i].code);
        cr_assert(strstr(r.out, want), "%s: exit %d, not a hang (124):\n%s", cases[i].args, cases[i].code, r.out);
        cr_assert(strstr(r.out, "/tmp/amp_cli_fifo_") && strstr(r.out, "not a regular file"), "%s", r.out);
        cr_assert(strstr(r.out, cases[i].key), "%s", r.out);
        cr_assert(strstr(r.out, "hint: "), "%s", r.out);
    }
}

Test(cli, a_missing_argument_hint_names_the_command)
{
    struct result r = run("run");
    cr_assert_eq(r.code, 2);
    cr_assert(strstr(r.out, "hint: run 'ampTrain help run' for usage"), "%s", r.out);
    r = run("inspect");
    cr_assert(strstr(r.out, "hint: run 'ampTrain help inspect' for usage"), "%s", r.out);
    cr_assert_null(strstr(r.out, "%s"), "%s", r.out);
}

/* run.keep_ckpts of 2^32 + 1 was narrowed to int (1) when pruning: every checkpoint but the newest deleted. */
Test(cli, keep_ckpts_beyond_int_keeps_every_checkpoint)
{
    struct result r = run("run configs/fashion_mlp.yaml model.layers.1.out=16 model.layers.3.out=16 data.batch_size=16 "
                          "run.device=cpu run.steps=5 run.ckpt_every=1 run.keep_ckpts=4294967297 "
                          "run.out_dir=/tmp/amp_cli_keep_$$ > /dev/null; echo \"rc $?\"; ls /tmp/amp_cli_keep_$$ | "
                          "grep -c '^ckpt-.*h5$'; rm -rf /tmp/amp_cli_keep_$$");
    cr_assert(strstr(r.out, "rc 0\n5\n"), "all 5 checkpoints kept:\n%s", r.out);
}

Test(cli, help_lists_commands_and_exit_codes)
{
    struct result r = run("--help");
    cr_assert_eq(r.code, 0);
    const char *want[] = {"ampTrain run CONFIG.yaml", "ampTrain resume CHECKPOINT.h5", "ampTrain eval CHECKPOINT.h5",
                          "ampTrain inspect", "ampTrain check", "143  stopped by SIGTERM"};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        cr_assert(strstr(r.out, want[i]), "missing '%s' in:\n%s", want[i], r.out);
}

Test(cli, help_command)
{
    struct result r = run("help check");
    cr_assert_eq(r.code, 0);
    cr_assert(strstr(r.out, "usage: ampTrain check CONFIG.yaml [KEY=VALUE ...]"), "%s", r.out);
    r = run("help frobnicate");
    cr_assert_eq(r.code, 2);
    cr_assert(strstr(r.out, "unknown command 'frobnicate'"), "%s", r.out);
    cr_assert(strstr(r.out, "hint: "), "%s", r.out);
}

Test(cli, no_arguments_and_unknown_command_are_usage_errors)
{
    cr_assert_eq(run("").code, 2);
    struct result r = run("trian configs/fashion_mlp.yaml");
    cr_assert_eq(r.code, 2);
    cr_assert(strstr(r.out, "unknown command 'trian'"), "%s", r.out);
}

Test(cli, check_accepts_every_shipped_config)
{
    struct result r = run("check configs/fashion_mlp.yaml > /dev/null && n=0 && for f in configs/*.yaml; do "
                          AMP_BINARY " check \"$f\" > /dev/null || { echo \"REJECTED $f\"; exit 1; }; "
                          "n=$((n+1)); done; echo \"checked $n\"");
    cr_assert_eq(r.code, 0, "%s", r.out);
    int n = 0;
    cr_assert(sscanf(strstr(r.out, "checked ") ? strstr(r.out, "checked ") : "", "checked %d", &n) == 1, "%s", r.out);
    cr_assert(n >= 13, "every reference model in every mode plus the underflow demo: %d configs", n);
    r = run("check configs/text_gpt_bf16.yaml");
    cr_assert(strstr(r.out, "autocast policy (bf16)"), "%s", r.out);
    cr_assert(strstr(r.out, "linear             lowp     bf16"), "%s", r.out);
    cr_assert(strstr(r.out, "layernorm          fp32     fp32"), "%s", r.out);
}

Test(cli, check_prints_how_weights_and_moments_are_stored)
{
    struct result r = run("check configs/fashion_mlp_bf16.yaml");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "weights: fp32 master and a bf16 copy of each weight a bf16 op reads"), "%s", r.out);
    cr_assert(strstr(r.out, "optimizer state: fp32"), "%s", r.out);
    r = run("check configs/fashion_mlp_bf16.yaml precision.master_weights=bf16 optim.state_dtype=bf16 "
            "optim.stochastic_rounding=true");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "weights: bf16 master (read directly by bf16 ops"), "%s", r.out);
    cr_assert(strstr(r.out, "optimizer state: bf16"), "%s", r.out);
    cr_assert(strstr(r.out, "bf16 stores of the update: stochastic rounding"), "%s", r.out);
    r = run("check configs/fashion_mlp_bf16.yaml precision.master_weights=bf16");
    cr_assert(strstr(r.out, "round to nearest even (updates below half a bf16 ulp are lost"), "%s", r.out);
}

Test(cli, check_prints_yaml_that_checks_again_identically)
{
    struct result r = run("check configs/fashion_mlp.yaml optim.lr=3e-4 precision.mode=bf16 > /tmp/amp_cli_a.txt; "
                          "sed -n '/^autocast policy/q;p' /tmp/amp_cli_a.txt | tail -n +2 > /tmp/amp_cli_rt.yaml; "
                          "cd " AMP_SOURCE_DIR " && " AMP_BINARY " check /tmp/amp_cli_rt.yaml > /tmp/amp_cli_b.txt; "
                          "tail -n +2 /tmp/amp_cli_a.txt > /tmp/amp_cli_a2.txt; tail -n +2 /tmp/amp_cli_b.txt > "
                          "/tmp/amp_cli_b2.txt; cmp /tmp/amp_cli_a2.txt /tmp/amp_cli_b2.txt && echo SAME");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "SAME"), "%s", r.out);
}

Test(cli, check_reports_position_and_exit_code_2)
{
    struct result r = run("check /tmp/amp_cli_missing_config.yaml");
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "/tmp/amp_cli_missing_config.yaml"), "%s", r.out);

    FILE *f = fopen("/tmp/amp_cli_bad.yaml", "w");
    cr_assert_not_null(f);
    fputs("run:\n  steps: 10\noptim:\n  lr : 0.1\n  lrr: 0.1\n", f);
    fclose(f);
    r = run("check /tmp/amp_cli_bad.yaml");
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "/tmp/amp_cli_bad.yaml:5:3: unknown key 'lrr' in optim"), "%s", r.out);
    cr_assert(strstr(r.out, "hint: "), "%s", r.out);
}

Test(cli, bad_override_is_exit_2_naming_it)
{
    struct result r = run("check configs/fashion_mlp.yaml optim.lr=abc");
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "optim.lr=abc"), "%s", r.out);
    r = run("check configs/fashion_mlp.yaml optim.lr");
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "optim.lr"), "%s", r.out);
    r = run("check configs/fashion_mlp.yaml optim.lrr=0.1");
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "did you mean 'lr'"), "%s", r.out);
}

Test(cli, fail_fast_exits_5_and_names_the_last_good_checkpoint, .timeout = 300)
{
    /* SGD at lr 1e4 blows the weights up after a few clean steps; then every step is non-finite. The
     * checkpoints written after skipped steps must not prune the last one written after a clean step. */
    struct result r = run("run configs/fashion_mlp.yaml run.device=cpu model.layers.1.out=32 model.layers.3.out=16 "
                          "data.batch_size=32 run.steps=20 run.epochs=0 optim.kind=sgd optim.lr=1e4 run.ckpt_every=1 "
                          "run.keep_ckpts=2 stability.max_consecutive_skips=5 run.log_every=1 "
                          "run.out_dir=/tmp/amp_cli_failfast_$$ 2>&1 > /dev/null; echo \"code $?\"; "
                          "ls /tmp/amp_cli_failfast_$$; rm -rf /tmp/amp_cli_failfast_$$");
    cr_assert(strstr(r.out, "code 5"), "%s", r.out);
    cr_assert(strstr(r.out, "5 skipped steps in a row (stability.max_consecutive_skips = 5)"), "%s", r.out);
    cr_assert(strstr(r.out, "last overflow in head (nan"), "%s", r.out);
    const char *good = strstr(r.out, "the last good checkpoint is /tmp/amp_cli_failfast_");
    cr_assert(good, "%s", r.out);
    char name[64];
    cr_assert_eq(sscanf(strstr(good, "/ckpt-") + 1, "%63[^:]", name), 1, "%s", r.out);
    char listed[80];
    snprintf(listed, sizeof listed, "\n%s\n", name);
    cr_assert(strstr(r.out, listed), "%s was pruned:\n%s", name, r.out);
}

Test(cli, fail_fast_before_any_checkpoint_says_there_is_none, .timeout = 300)
{
    /* All 20 steps are queued in one log window (log_every 50): the failure is found when the window is
     * read back, and reported at the step where it happened, with the log ending there. */
    struct result r = run("run configs/fashion_mlp.yaml run.device=cpu model.layers.1.out=32 model.layers.3.out=16 "
                          "data.batch_size=32 run.steps=20 run.epochs=0 precision.mode=fp16-static "
                          "precision.loss_scale.value=1e30 stability.max_consecutive_skips=3 "
                          "run.out_dir=/tmp/amp_cli_failfast2_$$ 2>&1 > /dev/null; echo \"code $?\"; "
                          "echo \"csv lines $(wc -l < /tmp/amp_cli_failfast2_$$/scale_log.csv)\"; "
                          "rm -rf /tmp/amp_cli_failfast2_$$");
    cr_assert(strstr(r.out, "code 5"), "%s", r.out);
    cr_assert(strstr(r.out, "step 3: 3 skipped steps in a row"), "%s", r.out);
    cr_assert(strstr(r.out, "no checkpoint was written before this step"), "%s", r.out);
    cr_assert(strstr(r.out, "csv lines 4\n"), "the header and steps 1-3: %s", r.out);
}

Test(cli, missing_dataset_is_a_data_error_with_code_3)
{
    struct result r = run("run configs/fashion_mlp.yaml run.device=cpu data.train_images=/nonexistent/train-images.gz "
                          "run.out_dir=/tmp/amp_cli_nodata_$$; echo \"code $?\"; rm -rf /tmp/amp_cli_nodata_$$");
    cr_assert(strstr(r.out, "code 3"), "%s", r.out);
    cr_assert(strstr(r.out, "/nonexistent/train-images.gz"), "%s", r.out);
    cr_assert(strstr(r.out, "hint: "), "%s", r.out);
}

Test(cli, sigint_finishes_the_step_writes_a_checkpoint_and_exits_130, .timeout = 300)
{
    /* wait for the third logged step, so the signal lands inside the training loop; only the output's
     * tail is kept (this small model logs hundreds of steps before the signal lands, more than r.out holds) */
    struct result r = run("run configs/fashion_mlp.yaml run.device=cpu model.layers.1.out=32 model.layers.3.out=16 "
                          "data.batch_size=32 run.steps=1000000 run.epochs=0 run.log_every=1 "
                          "run.out_dir=/tmp/amp_cli_sigint_$$ > /tmp/amp_cli_sigint_$$.out 2>&1 & pid=$!; "
                          "for i in $(seq 600); do grep -q 'step 3/' /tmp/amp_cli_sigint_$$.out && break; sleep 0.1; done; "
                          "kill -INT $pid; wait $pid; echo \"code $?\"; tail -n 20 /tmp/amp_cli_sigint_$$.out; "
                          "echo \"latest: $(cat /tmp/amp_cli_sigint_$$/latest)\"; "
                          "rm -rf /tmp/amp_cli_sigint_$$ /tmp/amp_cli_sigint_$$.out");
    cr_assert(strstr(r.out, "code 130"), "%s", r.out);
    /* a stop the user asked for is no error, and its hint is the command to continue (before, it said
     * "error:" and showed a placeholder) */
    cr_assert(strstr(r.out, "ampTrain: stopped by SIGINT after step"), "%s", r.out);
    cr_assert(strstr(r.out, "hint: continue with 'ampTrain resume /tmp/amp_cli_sigint_") &&
                  strstr(r.out, "/ckpt-"), "%s", r.out);
    cr_assert(strstr(r.out, "latest: ckpt-"), "%s", r.out);
}

Test(cli, settings_that_do_nothing_are_warned_about)
{
    struct result r = run("check configs/fashion_mlp_bf16.yaml precision.loss_scale.init=1024 > /dev/null");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "warning: configs/fashion_mlp_bf16.yaml: precision.loss_scale is set but bf16 is not "
                            "loss-scaled"), "%s", r.out);
    r = run("check configs/fashion_mlp_fp16_static.yaml precision.loss_scale.growth_interval=100 > /dev/null");
    cr_assert(strstr(r.out, "only apply to fp16-dynamic; fp16-static uses precision.loss_scale.value (1024)"), "%s",
              r.out);
    r = run("check configs/fashion_mlp_fp16_dynamic.yaml stability.on_nonfinite=stop > /dev/null");
    cr_assert(strstr(r.out, "stability.on_nonfinite applies to bf16 and fp32"), "%s", r.out);
    r = run("check configs/fashion_mlp_fp16_dynamic.yaml > /dev/null");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert_null(strstr(r.out, "warning"), "the shipped config is clean:\n%s", r.out);
}

Test(cli, a_second_signal_stops_at_once_and_the_previous_checkpoint_still_loads, .timeout = 300)
{
    struct result r = run("run configs/fashion_mlp.yaml run.device=cpu data.batch_size=256 run.steps=1000000 "
                          "run.epochs=0 run.log_every=1 run.ckpt_every=3 run.out_dir=/tmp/amp_cli_sig2_$$ "
                          "> /tmp/amp_cli_sig2_$$.out 2>&1 & pid=$!; "
                          "for i in $(seq 600); do grep -q 'checkpoint: ' /tmp/amp_cli_sig2_$$.out && break; sleep 0.1; "
                          "done; kill -INT $pid; kill -TERM $pid; wait $pid; echo \"code $?\"; "
                          "echo \"graceful $(grep -c 'stopped by SIG' /tmp/amp_cli_sig2_$$.out)\"; "
                          "cd " AMP_SOURCE_DIR " && " AMP_BINARY " inspect /tmp/amp_cli_sig2_$$ > /dev/null; "
                          "echo \"inspect $?\"; rm -rf /tmp/amp_cli_sig2_$$ /tmp/amp_cli_sig2_$$.out");
    /* two different signals, so both are delivered (a second SIGTERM pending beside the first would merge) */
    cr_assert(strstr(r.out, "code 143") || strstr(r.out, "code 130"), "%s", r.out);
    cr_assert(strstr(r.out, "graceful 0"), "the second signal did not wait for the step and the save:\n%s", r.out);
    cr_assert(strstr(r.out, "inspect 0"), "latest names a checkpoint that verifies:\n%s", r.out);
}

/* The build directory: AMP_BINARY's folder (gpu-check's BUILD_DIR). */
static void binary_dir(char *buf, size_t len)
{
    snprintf(buf, len, "%s", AMP_BINARY);
    char *slash = strrchr(buf, '/');
    cr_assert_not_null(slash);
    *slash = '\0';
}

/* scripts/gpu/gpu-check.sh is run only where a GPU is lent, rarely: its DRY mode (everything on the CPU, a
 * few steps a run) checks here that it still parses ampTrain's and PyTorch's output and fills every row
 * of its table. Needs /usr/bin/python3 with torch (scripts/install-deps.sh --test installs python3-torch). */
Test(cli, gpu_check_dry_run_fills_its_table, .timeout = 1100)
{
#if defined(__SANITIZE_ADDRESS__)
    cr_skip_test("checked in the build without sanitizers: under ASan the script's 27 runs take over 5 minutes");
#endif
    if (system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0)
        cr_skip_test("/usr/bin/python3 lacks torch (Debian: python3-torch)");
    char build[1024];
    binary_dir(build, sizeof build);
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "cd %s && out=$(mktemp -d /tmp/amp_gpucheck.XXXXXX) && DRY=1 PYTHON=/usr/bin/python3 STEPS=2 "
             "WIDE_STEPS=1 PHASES='gpt2 bench' RUN_TIMEOUT=300 BUILD_DIR=%s OPENBLAS_NUM_THREADS=1 "
             "scripts/gpu/gpu-check.sh \"$out\" >/dev/null 2>&1; echo \"rc $?\"; cat \"$out/table.md\" \"$out/summary.log\"; echo '=== gpt2.md'; cat \"$out/gpt2.md\"; "
             "rm -rf \"$out\"",
             AMP_SOURCE_DIR, build);
    static struct result r;
    r = shell(cmd);
    char *gpt2 = strstr(r.out, "=== gpt2.md");
    cr_assert_not_null(gpt2, "%s", r.out);
    *gpt2++ = '\0'; /* the gpu-check table and summary before, gpt2.md after */
    const char *out = r.out;
    cr_assert(strstr(out, "rc 0\n"), "%s", out);
    cr_assert_null(strstr(out, "FAIL"), "%s", out);
    /* 16 rows: 3 models x 4 modes, text_gpt768 x 3 and text_gpt768 in fp8; every one with an ampTrain figure, and
     * the 12 with a PyTorch counterpart with one too ("-" marks a missing figure; fp16-static and fp8 have none) */
    int rows = 0, torch_rows = 0;
    for (const char *l = strstr(out, "\n| "); l; l = strstr(l + 1, "\n| ")) {
        char model[32], mode[32], amp_sps[64], torch_sps[64];
        if (sscanf(l, "\n| %31s | %31s | %63[^|]| %63[^|]|", model, mode, amp_sps, torch_sps) != 4 ||
            strcmp(model, "model") == 0 || model[0] == '-')
            continue;
        rows++;
        cr_assert(amp_sps[0] >= '1' && amp_sps[0] <= '9', "%s %s: ampTrain figure '%s'\n%s", model, mode, amp_sps,
                  out);
        if (strcmp(mode, "fp16-static") != 0 && strcmp(mode, "fp8") != 0) {
            torch_rows++;
            cr_assert(torch_sps[0] >= '1' && torch_sps[0] <= '9', "%s %s: PyTorch figure '%s'\n%s", model, mode,
                      torch_sps, out);
        }
    }
    cr_assert_eq(rows, 16, "%s", out);
    cr_assert_eq(torch_rows, 12, "%s", out);
    cr_assert(strstr(out, "| text_gpt768 | fp8 | "), "%s", out);
    cr_assert(strstr(out, "Targets (text_gpt width 768): bf16 / fp32 = "), "%s", out);
    cr_assert(strstr(out, "fp8 / bf16 = "), "%s", out);
    /* CUDA graphs off and on, side by side (on the CPU there are none: the two runs must still log the same bits) */
    const char *graph_models[] = {"fashion_mlp", "fashion_cnn", "text_gpt"};
    for (size_t i = 0; i < 3; i++) {
        char want[128];
        snprintf(want, sizeof want, "gpu-check: graphs: %s bf16 on / off ", graph_models[i]);
        const char *note = strstr(out, want);
        cr_assert_not_null(note, "no graphs note for %s\n%s", graph_models[i], out);
        const char *eol = strchr(note, '\n'), *same = strstr(note, "same log: yes");
        cr_assert(same && (!eol || same < eol), "%s: the logs with and without graphs differ\n%s", graph_models[i],
                  out);
    }
    /* the gpt2 phase (scripts/gpu/bench_gpt2.sh): a row for each of ampTrain's three modes and PyTorch, each with a
     * figure, and the loss agreement checked (on the CPU, bf16 emulated against PyTorch's bf16 autocast) */
    const char *gpt2_rows[] = {"| 2 | amp-bf16 | ", "| 2 | amp-fp16-dynamic | ", "| 2 | amp-fp8 | ", "| 2 | torch | "};
    for (size_t i = 0; i < sizeof gpt2_rows / sizeof gpt2_rows[0]; i++) {
        const char *row = strstr(gpt2, gpt2_rows[i]);
        cr_assert_not_null(row, "no gpt2 row '%s'\n%s", gpt2_rows[i], gpt2);
        char c = row[strlen(gpt2_rows[i])];
        cr_assert(c >= '1' && c <= '9', "gpt2 row '%s' without a figure\n%s", gpt2_rows[i], gpt2);
    }
    cr_assert(strstr(out, "gpu-check: gpt2: ok"), "%s", out);
    cr_assert(strstr(gpt2, "Loss agreement (ampTrain bf16 against PyTorch") && strstr(gpt2, ": PASS"), "%s", gpt2);
}

/* gpu-check's gpt2 phase where torch.compile fails (a GPU machine without Triton or a C compiler): the PyTorch run goes
 * on eager and the table says so, and the loss agreement is still measured (it was a failed run and no agreement).
 * Here PYTHON is a wrapper that asks bench_gpt2.py for --compile (DRY leaves it out) under a torch.compile whose model
 * raises at its first call, as Inductor does. */
Test(cli, bench_gpt2_goes_on_eager_where_torch_compile_fails)
{
    if (system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0)
        cr_skip_test("/usr/bin/python3 lacks torch (Debian: python3-torch)");
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "cd %s && d=$(mktemp -d /tmp/amp_gpt2eager.XXXXXX) && "
             "printf '%%s\\n' 'import runpy, sys, torch' 'def compiled(m):' '    def call(*a, **k):' "
             "'        raise RuntimeError(\"Cannot find a working triton installation\")' '    return call' "
             "'torch.compile = compiled' 'sys.argv = sys.argv[1:]' 'runpy.run_path(sys.argv[0], run_name=\"__main__\")' "
             "> $d/fake.py && "
             "printf '%%s\\n' '#!/bin/sh' 'case \"$1\" in *bench_gpt2.py) exec /usr/bin/python3 '$d'/fake.py \"$@\" "
             "--compile ;; esac' 'exec /usr/bin/python3 \"$@\"' > $d/py && chmod +x $d/py && "
             "DRY=1 PYTHON=$d/py AMPTRAIN_BIN=%s OPENBLAS_NUM_THREADS=1 scripts/gpu/bench_gpt2.sh $d/out >/dev/null 2>&1; "
             "echo \"rc $?\"; cat $d/out/gpt2.md $d/out/gpt2-torch-torch-2.log; rm -rf $d",
             AMP_SOURCE_DIR, amp_binary());
    struct result r = shell(cmd);
    cr_assert(strstr(r.out, "rc 0\n"), "%s", r.out);
    cr_assert(strstr(r.out, "torch.compile failed at step 1 (Cannot find a working triton installation)"), "%s", r.out);
    cr_assert(strstr(r.out, "(PyTorch ran eager: torch.compile failed"), "%s", r.out);
    const char *row = strstr(r.out, "| 2 | torch | ");
    cr_assert(row && row[strlen("| 2 | torch | ")] >= '1' && row[strlen("| 2 | torch | ")] <= '9', "%s", r.out);
    cr_assert(strstr(r.out, "Loss agreement (ampTrain bf16 against PyTorch") && strstr(r.out, ": PASS"), "%s", r.out);
}

/* `run` or `check` given a checkpoint or a run directory names it as such (it said "tab
 * character (YAML forbids tabs)"); any other binary file is "not a YAML text file". Exit 2, nothing trained. */
Test(cli, a_checkpoint_or_binary_file_given_as_config_is_named)
{
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "cd %s && A=%s && d=/tmp/amp_cli_ckcfg_$$ && { $A run configs/fashion_mlp.yaml run.device=cpu run.steps=1 "
             "model.layers.1.out=16 run.out_dir=$d > /dev/null; echo \"rc $?\"; for c in check run; do for p in "
             "$d/ckpt-1.h5 $d; do echo \"== $c $p\"; $A $c $p; echo \"rc $?\"; done; done; head -c 3000 "
             "/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz > $d.yaml; $A check $d.yaml; "
             "echo \"rc $?\"; } 2>&1; rm -rf $d $d.yaml",
             AMP_SOURCE_DIR, amp_binary());
    struct result r = shell(cmd);
    cr_assert(strstr(r.out, "rc 0\n== check"), "%s", r.out);
    const char *want[] = {"check: /tmp/amp_cli_ckcfg_", "ckpt-1.h5 is an ampTrain checkpoint, not a config",
                          "is a run directory, not a config", "run: /tmp/amp_cli_ckcfg_",
                          "hint: 'ampTrain resume /tmp/amp_cli_ckcfg_", "is not a YAML text file: byte 0 is 0x1f"};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        cr_assert(strstr(r.out, want[i]), "missing '%s':\n%s", want[i], r.out);
    cr_assert_null(strstr(r.out, "tab character"), "%s", r.out);
    int twos = 0;
    for (const char *p = r.out; (p = strstr(p, "rc 2\n")); p++)
        twos++;
    cr_assert_eq(twos, 5, "four checkpoint arguments and one binary file, each exit 2:\n%s", r.out);
}

/* optim.schedule's decay keys (docs/config.md, `optim`): a decay that ends before the warmup, a wsd fraction of 0. */
Test(cli, schedule_decay_keys_are_checked)
{
    struct result r = run("check configs/fashion_mlp.yaml optim.schedule.kind=wsd optim.schedule.warmup_steps=100 "
                          "optim.schedule.decay_steps=50");
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "optim.schedule.decay_steps (50) ends the decay before the warmup (100 steps) ends") &&
                  strstr(r.out, "hint:"), "%s", r.out);
    r = run("check configs/fashion_mlp.yaml optim.schedule.kind=wsd optim.schedule.decay_fraction=0");
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "decay_fraction"), "%s", r.out);
    r = run("check configs/fashion_mlp.yaml optim.schedule.kind=linear optim.schedule.decay_steps=300 > /dev/null");
    cr_assert_eq(r.code, 0, "%s", r.out);
}

/* The run says how many parameters the model has (a tied table once): fashion_mlp's 784-512-512-10
 * is 784*512+512 + 512*512+512 + 512*10+10. */
Test(cli, run_prints_the_parameter_count)
{
    struct result r = run("run configs/fashion_mlp.yaml run.device=cpu run.steps=1 run.out_dir=/tmp/amp_cli_params_$$; "
                          "rm -rf /tmp/amp_cli_params_$$");
    char want[64];
    snprintf(want, sizeof want, "6 parameter tensors (%d parameters)", 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10);
    cr_assert(strstr(r.out, want), "want '%s':\n%s", want, r.out);
}

/* A did-you-mean across sections and for a value that is the start of several, the words other
 * trainers use for our commands, and `ampTrain COMMAND --help` (it was an error). */
Test(cli, suggestions_reach_across_sections_and_commands)
{
    static const struct {
        const char *args, *want;
    } cases[] = {
        {"check configs/fashion_mlp.yaml batch_size=64", "unknown key 'batch_size' at the top level (did you mean 'data.batch_size'?)"},
        {"check configs/fashion_mlp.yaml lr=1e-3", "(did you mean 'optim.lr'?)"},
        {"check configs/fashion_mlp.yaml run.lr=1e-3", "unknown key 'lr' in run (did you mean 'optim.lr'?)"},
        {"check configs/fashion_mlp.yaml precision.mode=fp16", "unknown value 'fp16' (did you mean 'fp16-static' or 'fp16-dynamic'?)"},
        {"train configs/fashion_mlp.yaml", "unknown command 'train' (did you mean 'run'?)"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct result r = run(cases[i].args);
        cr_assert_eq(r.code, 2, "%s: %s", cases[i].args, r.out);
        cr_assert(strstr(r.out, cases[i].want), "%s: want '%s':\n%s", cases[i].args, cases[i].want, r.out);
    }
    struct result r = run("run --help");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "usage: ampTrain run CONFIG.yaml"), "%s", r.out);
    r = run("export ckpt.h5 out.safetensors -h");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "usage: ampTrain export"), "%s", r.out);
}

/* One numbering of epochs, from 0: the progress line said "epoch 1" where scale_log.csv and resume
 * said 0. */
Test(cli, epochs_count_from_zero_everywhere)
{
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "cd %s && A=%s && d=/tmp/amp_cli_epoch_$$ && { OPENBLAS_NUM_THREADS=1 $A run configs/fashion_mlp.yaml "
             "run.device=cpu model.layers.1.out=16 model.layers.3.out=16 run.steps=2 run.log_every=1 run.out_dir=$d; "
             "echo \"csv epoch $(sed -n 2p $d/scale_log.csv | cut -d, -f2)\"; OPENBLAS_NUM_THREADS=1 $A resume $d "
             "run.steps=3; } 2>&1; rm -rf $d",
             AMP_SOURCE_DIR, amp_binary());
    struct result r = shell(cmd);
    cr_assert(strstr(r.out, "epoch 0 | step 1/2 |"), "%s", r.out);
    cr_assert(strstr(r.out, "csv epoch 0\n"), "%s", r.out);
    cr_assert(strstr(r.out, "at step 2 (epoch 0)"), "%s", r.out);
    cr_assert_null(strstr(r.out, "epoch 1 |"), "%s", r.out);
}

/* Each shipped config's "# Run:" line names the config itself (the precision variants named their
 * base config). */
Test(cli, every_config_says_how_to_run_itself)
{
    struct result r = shell("cd " AMP_SOURCE_DIR " && for f in configs/*.yaml; do l=$(grep '^# Run: ' \"$f\" | head -1); "
                            "[ -z \"$l\" ] || case $l in *\" $f\"*) ;; *) echo \"MISMATCH $f: $l\";; esac; done; echo done");
    cr_assert(strstr(r.out, "done") && !strstr(r.out, "MISMATCH"), "%s", r.out);
}

/* --help names fp8 among the modes, and check's policy heading says fp8 runs the linear products. */
Test(cli, fp8_is_named_in_help_and_check)
{
    struct result r = run("--help");
    cr_assert(strstr(r.out, "fp16-dynamic, bf16, fp8)"), "%s", r.out);
    r = run("check configs/fashion_mlp.yaml precision.mode=fp8");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "autocast policy (bf16; linear products in fp8, see below):"), "%s", r.out);
}

/* Issue 43, item 6: an fp8 run's checkpoint evaluates under bf16 autocast, and says so once, in training and in
 * `eval`; `eval --dtype fp8` is refused with the reason (it was evaluated in bf16 silently, and --dtype fp8 read as a
 * bad option). */
Test(cli, fp8_checkpoints_evaluate_in_bf16_and_say_so)
{
    struct result r = shell("mktemp -d /tmp/amp-cli-fp8-XXXXXX");
    char dir[256];
    snprintf(dir, sizeof dir, "%.*s", (int)strcspn(r.out, "\n"), r.out);
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "run configs/fashion_mlp.yaml model.layers.1.out=32 model.layers.3.out=32 data.batch_size=32 "
             "run.device=cpu run.threads=1 precision.mode=fp8 'precision.fp8.keep_bf16=[]' "
             "'precision.fp8.min_size=[0,0]' run.steps=4 "
             "run.eval_every=2 run.out_dir=%s/run",
             dir);
    r = run(cmd);
    cr_assert_eq(r.code, 0, "%s", r.out);
    const char *note = "eval: note: an fp8 run evaluates under bf16 autocast";
    const char *first = strstr(r.out, note);
    cr_assert(first && !strstr(first + 1, note), "the note once, not %s:\n%s", first ? "twice" : "never", r.out);
    cr_assert(strstr(r.out, "eval step 4 | test | autocast on (bf16)"), "%s", r.out);
    snprintf(cmd, sizeof cmd, "eval %s/run/ckpt-4.h5", dir);
    r = run(cmd);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "is an fp8 run's checkpoint; it evaluates under bf16 autocast"), "%s", r.out);
    snprintf(cmd, sizeof cmd, "eval %s/run/ckpt-4.h5 --dtype fp8", dir);
    r = run(cmd);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "eval: --dtype fp8 is not offered: evaluation runs fp8 runs under bf16 autocast"), "%s",
              r.out);
    cr_assert(strstr(r.out, "hint: "), "%s", r.out);
    r = run("help eval");
    cr_assert(strstr(r.out, "under bf16 autocast"), "%s", r.out);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    shell(cmd);
}

/* gpu-check's fp8 phase (scripts/gpu/bench_fp8.sh) in DRY mode: a row for bf16 and for each recipe on both models,
 * each with a figure, the gpt2 rows with their loss against bf16's, and the phase's summary line. */
Test(cli, gpu_check_fp8_phase_dry_run_fills_its_table)
{
    char build[1024];
    binary_dir(build, sizeof build);
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "cd %s && out=$(mktemp -d /tmp/amp_gpucheck.XXXXXX) && DRY=1 PHASES='fp8' BUILD_DIR=%s "
             "OPENBLAS_NUM_THREADS=1 scripts/gpu/gpu-check.sh \"$out\" >/dev/null 2>&1; echo \"rc $?\"; "
             "cat \"$out/summary.log\" \"$out/fp8.md\"; rm -rf \"$out\"",
             AMP_SOURCE_DIR, build);
    static struct result r;
    r = shell(cmd);
    const char *out = r.out;
    cr_assert(strstr(out, "rc 0\n"), "%s", out);
    cr_assert_null(strstr(out, "FAIL"), "%s", out);
    cr_assert(strstr(out, "gpu-check: fp8: ok"), "%s", out);
    const char *rows[] = {"| wide | bf16 | ", "| wide | fp8 delayed | ", "| wide | fp8 current | ",
                          "| gpt2 | bf16 | ", "| gpt2 | fp8 delayed | ", "| gpt2 | fp8 current | "};
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        const char *row = strstr(out, rows[i]);
        cr_assert_not_null(row, "no row '%s'\n%s", rows[i], out);
        char c = row[strlen(rows[i])];
        cr_assert(c >= '1' && c <= '9', "row '%s' without tokens/s\n%s", rows[i], out);
        if (strncmp(rows[i], "| gpt2 | fp8", 12) == 0) { /* tokens/s | / bf16 | eval loss | against bf16 | */
            const char *p = row + strlen(rows[i]);
            for (int bar = 0; bar < 2; bar++)
                p = strchr(p, '|') + 2;
            cr_assert(p[0] >= '0' && p[0] <= '9', "row '%s' without a loss\n%s", rows[i], out);
            cr_assert(strstr(p, "%"), "row '%s' without its loss against bf16's\n%s", rows[i], out);
        }
    }
}
