/*
 * test_dist.c — data parallel (docs/distributed.md), end to end with
 * `mpirun -np N ampTrain`, and in process with a counting communicator.
 *
 * The main test: on the CPU, 2 ranks with batch B train exactly as 1 rank with batch B and accum_steps 2
 * (scale_log.csv but for samples_per_s, eval.jsonl and every checkpoint tensor byte-identical) in all
 * four modes, with overflows and skips, clipping and dropout, for fashion_mlp and text_gpt; also over
 * TCP (the path between hosts), and on two hosts simulated by network namespaces (tests/two_hosts.sh); 3 and 4
 * ranks train exactly as 1 rank with accum_steps 3 and 4 (the ranks' sums are added in rank order), ZeRO-1
 * included. Where the reduction's association differs (2 ranks with accumulation), the weights of this test's small model (MLP below) after 20 steps stay within 1e-6 of the one-rank run,
 * relative to each tensor's largest element (a bound of this model and these steps: docs/distributed.md). Then the
 * faults: replicas perturbed, configs that differ, a rank without its data, signals to all or one
 * rank, a rank killed, and resume at the same and at another world size.
 *
 * Every mpirun test skips where the build has no MPI or mpirun is missing. The GPU side (NCCL) is
 * tests/test_cuda_dist.c.
 */
#define _POSIX_C_SOURCE 200809L
#include "disttest.h" /* mpi, compare_runs, max_rel_diff, NEED_MPI; ckpt_testlib.h */

#include <math.h>
#include <signal.h>
#include <stdio_ext.h> /* __fsetlocking */
#include <time.h>
#include <unistd.h> /* gethostname */

#include "comm_watch.h" /* the collective watchdog */
#include "dist.h"  /* struct dist, comm_agree */
#include "threadpool.h" /* threadpool_available_cpus: what run.threads auto divides */
#include "train.h" /* trainer_setup, trainer_step, trainer_flush: the in-process test */
#include "zero.h"  /* zero_after_trial: the in-process test of the trial's verdict */

/* One rank with accum_steps np against np ranks, `extra` on both; `cfg` the config. The ranks' sum of each gradient
 * element is added in rank order (lib/base/comm.h), ((g0 + g1) + g2) + ..., the order in which one rank accumulates
 * its micro-batches: bit for bit at any np. */
static void check_equivalence_np(int np, const char *cfg, const char *extra, const char *mca)
{
    NEED_MPI();
    make_scratch();
    struct result r = amp("run %s %s accum_steps=%d run.out_dir=%s/one", cfg, extra, np, scratch);
    cr_assert_eq(r.code, 0, "one rank:\n%s", r.out);
    cr_assert_null(strstr(r.out, "reduce: "), "one rank reduces nothing:\n%s", r.out);
    r = mpi(np, mca, "run %s %s run.out_dir=%s/two", cfg, extra, scratch);
    cr_assert_eq(r.code, 0, "%d ranks:\n%s", np, r.out);
    char host[64] = {0}, line[160];
    snprintf(line, sizeof line, "data parallel: %d ranks on 1 host, transport mpi", np);
    cr_assert(strstr(r.out, line), "no '%s' in:\n%s", line, r.out);
    cr_assert(strstr(r.out, "effective batch"), "%s", r.out);
    cr_assert(strstr(r.out, "\nreduce: ") && strstr(r.out, " ms a step, "), "%s", r.out);
    cr_assert_eq(gethostname(host, sizeof host - 1), 0);
    snprintf(line, sizeof line, "\nhosts: %s (ranks 0-%d: cpu)\n", host, np - 1);
    cr_assert(strstr(r.out, line), "no '%s' in:\n%s", line + 1, r.out);
    compare_runs("one", "two", 20, 1000);
    remove_scratch();
}

/* One rank with accum_steps 2 against two ranks. */
static void check_equivalence(const char *cfg, const char *extra, const char *mca)
{
    check_equivalence_np(2, cfg, extra, mca);
}

#define MLP "configs/fashion_mlp.yaml " SMALL " run.steps=20 run.log_every=7 run.eval_every=10"
/* scale 2^30 overflows fp16 at once: skips, backoff, overflow attribution; clipping; dropout */
#define HARD "clip.max_norm=0.5 model.layers.2.kind=dropout"
#define OVERFLOWING "precision.loss_scale.init=1073741824 precision.loss_scale.max=1073741824"

Test(dist, two_ranks_equal_one_with_accum_fp32) { check_equivalence(MLP, "precision.mode=fp32 " HARD, NULL); }
Test(dist, two_ranks_equal_one_with_accum_bf16) { check_equivalence(MLP, "precision.mode=bf16 " HARD, NULL); }
/* the stochastic rounding bits are keyed by (run.seed, step, parameter), never by the rank: replicas round alike */
Test(dist, two_ranks_equal_one_bf16_master_weights_stochastic_rounding)
{
    check_equivalence(MLP,
                      "precision.mode=bf16 precision.master_weights=bf16 optim.state_dtype=bf16 "
                      "optim.stochastic_rounding=true " HARD,
                      NULL);
}
/* fp8 delayed: each step's amaxes are the max over micro-batches and (reduced with MAX) over ranks, so two ranks
 * keep the one rank's scales and histories; current: each micro-batch's scales come from its own tensors alike */
Test(dist, two_ranks_equal_one_fp8_delayed)
{
    check_equivalence(MLP, "precision.mode=fp8 precision.fp8.amax_history_len=4 'precision.fp8.keep_bf16=[]' "
                      "'precision.fp8.min_size=[0,0]' " HARD,
                      NULL);
}
Test(dist, two_ranks_equal_one_with_accum_fp16_static)
{
    check_equivalence(MLP, "precision.mode=fp16-static precision.loss_scale.value=1e9 " HARD, NULL);
}
Test(dist, two_ranks_equal_one_with_accum_fp16_dynamic_overflowing)
{
    check_equivalence(MLP, "precision.mode=fp16-dynamic " OVERFLOWING " precision.loss_scale.hysteresis=2 " HARD,
                      NULL);
}

/* A 0.2% validation split (87 sequences, 22 batches of 4: a few for each of up to 4 ranks): at 2% the final
 * evaluation was two thirds of a run's CPU time under ASan (1.7 of 2.5 CPU-s); eval.jsonl is still compared. */
#define GPT                                                                                                          \
    "configs/text_gpt.yaml run.steps=20 run.log_every=6 run.eval_every=0 run.ckpt_every=0 run.device=cpu "          \
    "data.batch_size=4 data.seq_len=32 clip.max_norm=0.5 data.val_fraction=0.002"
Test(dist, text_gpt_two_ranks_equal_one_fp16_dynamic)
{
    check_equivalence(GPT, "precision.mode=fp16-dynamic " OVERFLOWING, NULL);
}
Test(dist, text_gpt_two_ranks_equal_one_bf16) { check_equivalence(GPT, "precision.mode=bf16", NULL); }
Test(dist, text_gpt_two_ranks_equal_one_fp8_current)
{
    check_equivalence(GPT, "precision.mode=fp8 precision.fp8.recipe=current 'precision.fp8.min_size=[0,0]'", NULL);
}
Test(dist, text_gpt_two_ranks_equal_one_fp32) { check_equivalence(GPT, "precision.mode=fp32", NULL); }
Test(dist, text_gpt_two_ranks_equal_one_fp16_static)
{
    check_equivalence(GPT, "precision.mode=fp16-static precision.loss_scale.value=1024", NULL);
}

/* ---- ZeRO-1 (dist.zero 1): the optimizer state sharded, the bits of dist.zero 0 ------------------------ */

/* What rank 0 says of the masters under dist.zero 1 (check_zero). */
#define ALL_WHOLE_FP32 "the masters stay whole: in fp32 they are the weights the ops read"
#define SOME_WHOLE "masters stay whole, read by the ops themselves"

/* Rank 0's ZeRO-1 line in out checked: sharded over np ranks, `masters` said, and (where not ALL_WHOLE_FP32) fewer
 * master weights held than the model has; *ratio the "moments and masters" of the rank that holds most against
 * dist.zero 0's (rank 0's own is at most that). */
static void check_zero_line(const char *out, int np, const char *masters, double *ratio)
{
    char said[96], line[1024];
    snprintf(said, sizeof said, "ZeRO-1 (dist.zero 1): the optimizer state is sharded over %d ranks", np);
    const char *at = strstr(out, said);
    cr_assert(at, "%s", out);
    snprintf(line, sizeof line, "%.*s", (int)strcspn(at, "\n"), at);
    long long held, params, whole = -1;
    const char *of = strstr(line, "parameters, and ");
    cr_assert(of && sscanf(of, "parameters, and %lld of their %lld", &held, &params) == 2, "%s", line);
    const char *x = strstr(line, " whole: ");
    double own, most_mib;
    cr_assert(x && sscanf(x, " whole: %lfx; the most on one rank: %lf MiB, %lfx", &own, &most_mib, ratio) == 3, "%s",
              line);
    cr_assert_leq(own, *ratio, "%s", line);
    cr_assert(strstr(line, masters), "no '%s' in: %s", masters, line);
    if (strcmp(masters, SOME_WHOLE) != 0) {
        cr_assert_eq(held, params, "%s", line);
    } else { /* rank 0 holds its blocks of the sharded masters (on the CPU whole parts of them, maybe none: a
              * tensor smaller than a part is one rank's) and the rest whole */
        cr_assert_lt(held, params, "%s", line);
        const char *k = strstr(line, "); ");
        cr_assert(k && sscanf(k, "); %lld masters stay whole", &whole) == 1, "%s", line);
        cr_assert(whole > 0 && whole <= held, "%s", line);
    }
}

/* dist.zero 1 against dist.zero 0 on np ranks, `extra` on both: scale_log.csv but for samples_per_s, eval.jsonl and
 * every checkpoint tensor (the optimizer's moments and the sharded masters, gathered from the ranks' blocks,
 * included) byte-identical; rank 0 says how the masters are held (`masters`, check_zero_line), and *ratio (if not
 * NULL) gets its "moments and masters" against dist.zero 0's. */
static void check_zero_said(int np, const char *cfg, const char *extra, int steps, const char *masters, double *ratio)
{
    NEED_MPI();
    make_scratch();
    struct result r = mpi(np, NULL, "run %s %s run.out_dir=%s/z0", cfg, extra, scratch);
    cr_assert_eq(r.code, 0, "dist.zero 0:\n%s", r.out);
    r = mpi(np, NULL, "run %s %s dist.zero=1 run.out_dir=%s/z1", cfg, extra, scratch);
    cr_assert_eq(r.code, 0, "dist.zero 1:\n%s", r.out);
    double x;
    check_zero_line(r.out, np, masters, ratio ? ratio : &x);
    /* on the CPU the gradients are only reduce-scattered, except where rank 0's probe reads them whole */
    const char *how = strstr(masters, "numerics_every")
                          ? "all-gathered after the reduce-scatter (dist.zero 1: run.numerics_every's probe"
                          : "reduce-scattered only (dist.zero 1: no all-gather of the gradients)";
    cr_assert(strstr(r.out, how), "no '%s' in:\n%s", how, r.out);
    compare_runs("z0", "z1", steps, 1000);
    remove_scratch();
}

static void check_zero(int np, const char *cfg, const char *extra, int steps, const char *masters)
{
    check_zero_said(np, cfg, extra, steps, masters, NULL);
}

/* three ranks: fc1/weight (25,088 elements) of two parts of the CPU's statistics (16,384 and 8,704), the other tensors
 * smaller than a part, each held whole by one rank (empty blocks on the others), the second hidden layer's bias of
 * 2 elements smaller than the world */
Test(dist, zero1_equals_zero0_fp32_uneven_and_empty_blocks)
{
    check_zero(3, MLP, "precision.mode=fp32 model.layers.3.out=2 " HARD, 20, ALL_WHOLE_FP32);
}
/* four ranks, a bucket about every weight (dist.bucket_mb 0.001), each cut into four blocks at the statistics' parts:
 * fc1/weight 64 wide (50,176 elements: three parts and a short fourth) split between ranks, the other tensors smaller
 * than a part and fc2's bias (3 elements) smaller than the world, each held whole by one rank; skips, clipping and
 * dropout */
Test(dist, zero1_equals_zero0_four_ranks_tensors_smaller_than_a_part_and_the_world)
{
    check_zero(4, MLP, "precision.mode=fp16-dynamic " OVERFLOWING " model.layers.1.out=64 model.layers.3.out=3 "
               "dist.bucket_mb=0.001 " HARD, 20, SOME_WHOLE);
}
/* bf16 and fp16: the linear weights' masters sharded (the ops read their copies), the biases' whole */
Test(dist, zero1_equals_zero0_bf16) { check_zero(3, MLP, "precision.mode=bf16 " HARD, 20, SOME_WHOLE); }
/* fc2's weight of 1 x 2 elements, and the whole model (1,593 parameters) smaller than a part: one rank holds all of
 * it, the others' blocks of every sharded master are empty */
Test(dist, zero1_equals_zero0_bf16_uneven_and_empty_blocks)
{
    check_zero(3, MLP, "precision.mode=bf16 model.layers.1.out=2 model.layers.3.out=1 " HARD, 20, SOME_WHOLE);
}
/* a scale that never overflows here: every step updates (at 1e9 every step was skipped, and nothing was compared) */
Test(dist, zero1_equals_zero0_fp16_static)
{
    check_zero(3, MLP, "precision.mode=fp16-static precision.loss_scale.value=1024 " HARD, 20, SOME_WHOLE);
}
/* skips, backoff and hysteresis, clipping of the global norm, dropout, accumulation */
Test(dist, zero1_equals_zero0_fp16_dynamic_overflowing)
{
    check_zero(3, MLP, "precision.mode=fp16-dynamic " OVERFLOWING " precision.loss_scale.hysteresis=2 accum_steps=2 "
               HARD, 20, SOME_WHOLE);
}
/* bf16 masters and moments rounded stochastically: a block draws the bits the whole tensor draws there; the ops read
 * the weights' bf16 masters (whole) and the biases' fp32 copies (their bf16 masters sharded) */
Test(dist, zero1_equals_zero0_bf16_state_stochastic_rounding)
{
    check_zero(3, MLP,
               "precision.mode=bf16 precision.master_weights=bf16 optim.state_dtype=bf16 optim.stochastic_rounding=true "
               HARD, 20, SOME_WHOLE);
}
/* fc1 kept in bf16 (its master sharded), fc2 and head in fp8 (their products cast the masters: whole) */
Test(dist, zero1_equals_zero0_fp8_delayed)
{
    check_zero(2, MLP, "precision.mode=fp8 precision.fp8.amax_history_len=4 'precision.fp8.keep_bf16=[first]' "
               "'precision.fp8.min_size=[0,0]' " HARD, 20, SOME_WHOLE);
}
Test(dist, zero1_equals_zero0_sgd_nesterov)
{
    check_zero(2, MLP, "precision.mode=bf16 optim.kind=sgd optim.momentum=0.9 optim.nesterov=true " HARD, 20,
               SOME_WHOLE);
}
/* every update would store a non-finite weight: each rank's trial of its blocks, the verdict combined */
Test(dist, zero1_equals_zero0_when_the_update_would_be_non_finite)
{
    check_zero(2, MLP, "precision.mode=fp32 optim.lr=1e38", 20, ALL_WHOLE_FP32);
    check_zero(2, MLP, "precision.mode=bf16 optim.lr=1e38", 20, SOME_WHOLE); /* the trial of sharded masters */
    /* check_zero removed its runs: once more, for the log's words */
    make_scratch();
    struct result r = mpi(2, NULL, "run %s precision.mode=fp32 optim.lr=1e38 run.steps=2 dist.zero=1 run.out_dir=%s/u",
                          MLP, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char p[600];
    snprintf(p, sizeof p, "cat %s/u/scale_log.csv", scratch);
    r = shell(p);
    cr_assert(strstr(r.out, "the update of fc1/weight (non-finite)"), "%s", r.out);
    remove_scratch();
}
/* and the target of sharding: moments and masters a rank at most 0.3x of dist.zero 0's at 4 ranks */
Test(dist, zero1_equals_zero0_text_gpt_fp16_dynamic_four_ranks)
{
    double ratio;
    check_zero_said(4, GPT, "precision.mode=fp16-dynamic " OVERFLOWING, 20, SOME_WHOLE, &ratio);
    cr_assert_leq(ratio, 0.30, "%g", ratio);
}
Test(dist, zero1_equals_zero0_text_gpt_bf16) { check_zero(2, GPT, "precision.mode=bf16", 20, SOME_WHOLE); }
/* Not only the bits of dist.zero 0 (which share its reduce-scatter): those of one rank adding the four micro-batches
 * itself, with skips, backoff, clipping and dropout, and in bf16 with sharded masters; a reduce-scatter that added
 * in any other order, or lost a rank's part, fails here */
Test(dist, zero1_four_ranks_equal_one_with_accum_four)
{
    check_equivalence_np(4, MLP,
                         "dist.zero=1 precision.mode=fp16-dynamic " OVERFLOWING " precision.loss_scale.hysteresis=2 "
                         HARD,
                         NULL);
    check_equivalence_np(4, MLP, "dist.zero=1 precision.mode=bf16 " HARD, NULL);
}
Test(dist, zero1_three_ranks_text_gpt_equal_one_with_accum_three)
{
    check_equivalence_np(3, GPT, "dist.zero=1 precision.mode=bf16", NULL);
}
/* run.numerics_every: rank 0's FP32 shadow reads the masters, so they stay whole (the moments are still sharded) */
Test(dist, zero1_keeps_the_masters_whole_for_numerics_every)
{
    check_zero(2, GPT, "precision.mode=bf16 run.numerics_every=10", 20,
               "the masters stay whole: run.numerics_every's FP32 shadow reads them on rank 0");
}

/* dir (a mkdtemp template) made, and in it train.bin and val.bin from the fortunes text by
 * scripts/tools/make_tokens.py in `format` (llmc or nanogpt), a tenth held out. */
static void make_token_files(char *dir, const char *format)
{
    char cmd[1024];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(cmd, sizeof cmd,
             "cd %s && /usr/bin/python3 scripts/tools/make_tokens.py --format %s --val-fraction 0.1 -o %s/train.bin "
             "/usr/share/games/fortunes/cookie 2>&1",
             AMP_SOURCE_DIR, format, dir);
    struct result r = shell(cmd);
    cr_assert_eq(r.code, 0, "%s", r.out);
}

/* Token files (data.format: tokens, docs/data.md): their windows, random or consecutive, are split between
 * ranks as every format's samples are, and evaluation on val.bin is sharded. The files are made from the
 * fortunes text by scripts/tools/make_tokens.py (llm.c's layout). */
static void check_tokens_equivalence(const char *sampling)
{
    NEED_MPI();
    char dir[] = "/tmp/amp-dist-tokens-XXXXXX", cmd[1024], cfg[1024];
    make_token_files(dir, "llmc");
    snprintf(cfg, sizeof cfg,
             "configs/tokens_gpt.yaml run.steps=20 run.log_every=6 run.eval_every=10 run.ckpt_every=0 run.device=cpu "
             "data.batch_size=4 data.seq_len=32 data.val_windows=24 clip.max_norm=0.5 data.train_bin=%s/train.bin "
             "data.val_bin=%s/val.bin data.sampling=%s",
             dir, dir, sampling);
    check_equivalence(cfg, "precision.mode=bf16", NULL);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    cr_assert_eq(system(cmd), 0);
}
Test(dist, tokens_random_two_ranks_equal_one) { check_tokens_equivalence("random"); }
Test(dist, tokens_sequential_two_ranks_equal_one) { check_tokens_equivalence("sequential"); }

/* model.init_from (docs/checkpoint.md, "init_from"): every rank reads the file itself, and two ranks train from it
 * as one rank with accum_steps 2 does. The file is an hf-gpt2 export of a tiny GPT-2 (lm_head tied). */
Test(dist, init_from_two_ranks_equal_one)
{
    NEED_MPI();
    char dir[] = "/tmp/amp-dist-init-XXXXXX", cmd[2048], cfg[1024];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(cfg, sizeof cfg,
             "configs/gpt2_tiny.yaml run.device=cpu run.log_every=5 data.batch_size=4 data.train_bin=%s/train.bin "
             "data.val_bin=%s/val.bin", dir, dir);
    snprintf(cmd, sizeof cmd,
             "cd %s && /usr/bin/python3 scripts/tools/make_tokens.py --format nanogpt --val-fraction 0.1 -o "
             "%s/train.bin "
             "/usr/share/games/fortunes/cookie && OPENBLAS_NUM_THREADS=1 %s run %s run.steps=3 run.out_dir=%s/src && "
             "%s export %s/src %s/init.safetensors --names hf-gpt2 2>&1",
             AMP_SOURCE_DIR, dir, AMP_BINARY, cfg, dir, AMP_BINARY, dir, dir);
    struct result r = shell(cmd);
    cr_assert_eq(r.code, 0, "%s", r.out);
    snprintf(cfg + strlen(cfg), sizeof cfg - strlen(cfg),
             " run.steps=20 run.eval_every=10 model.init_from=%s/init.safetensors model.init_names=hf-gpt2", dir);
    check_equivalence(cfg, "precision.mode=fp32", NULL);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    cr_assert_eq(system(cmd), 0);
}

/* The TCP byte transfer layer, the path between hosts. */
Test(dist, equivalence_over_tcp) { check_equivalence(MLP, "precision.mode=fp16-dynamic " HARD, "--mca btl tcp,self"); }

/* ---- overlap: the gradients reduced in buckets while backward runs (dist.bucket_mb) -------------------- */

/* `np` ranks with the gradients in buckets of `mb` MiB (NULL: the default), `extra` on all, into scratch/DIR; returns
 * the number of buckets the run said it reduces a step (0: one reduce after backward). */
static int run_buckets(int np, const char *cfg, const char *extra, const char *mb, const char *dir)
{
    char key[64] = "";
    if (mb)
        snprintf(key, sizeof key, "dist.bucket_mb=%s", mb);
    struct result r = mpi(np, NULL, "run %s %s %s run.out_dir=%s/%s", cfg, extra, key, scratch, dir);
    cr_assert_eq(r.code, 0, "%d ranks, %s:\n%s", np, key, r.out);
    if (strstr(r.out, "gradient reduce: one after backward"))
        return 0;
    const char *at = strstr(r.out, "gradient reduce: ");
    cr_assert_not_null(at, "%s", r.out);
    int n = 0;
    cr_assert_eq(sscanf(at, "gradient reduce: %d buckets during backward", &n), 1, "%s", at);
    return n;
}

/* Two ranks reduce the same bits once after backward (dist.bucket_mb 0), in the default buckets (25 MiB, the first
 * 1 MiB: one bucket on these small models) and in buckets of 0.001 MiB (about one a weight, started as backward makes
 * it final): each element is a + b whatever the buckets. */
static void check_buckets_same_bits(const char *cfg, const char *extra)
{
    NEED_MPI();
    make_scratch();
    cr_assert_eq(run_buckets(2, cfg, extra, "0", "once"), 0);
    cr_assert_geq(run_buckets(2, cfg, extra, NULL, "default"), 1);
    cr_assert_geq(run_buckets(2, cfg, extra, "0.001", "tiny"), 3, "a bucket about every weight");
    compare_runs("once", "default", 20, 1000);
    compare_runs("once", "tiny", 20, 1000);
    remove_scratch();
}

Test(dist, buckets_give_the_same_bits_at_two_ranks_fp32) { check_buckets_same_bits(MLP, "precision.mode=fp32 " HARD); }
Test(dist, buckets_give_the_same_bits_at_two_ranks_bf16) { check_buckets_same_bits(MLP, "precision.mode=bf16 " HARD); }
Test(dist, buckets_give_the_same_bits_at_two_ranks_fp16_dynamic)
{
    check_buckets_same_bits(MLP, "precision.mode=fp16-dynamic " OVERFLOWING " precision.loss_scale.hysteresis=2 " HARD);
}
Test(dist, buckets_give_the_same_bits_at_two_ranks_fp8_delayed)
{
    check_buckets_same_bits(MLP,
                            "precision.mode=fp8 precision.fp8.amax_history_len=4 'precision.fp8.keep_bf16=[]' "
                            "'precision.fp8.min_size=[0,0]' " HARD);
}
Test(dist, text_gpt_buckets_give_the_same_bits_at_two_ranks_fp8_current)
{
    check_buckets_same_bits(GPT, "precision.mode=fp8 precision.fp8.recipe=current 'precision.fp8.min_size=[0,0]'");
}

/* A tied lm_head writes its part of the token table's gradient before the embedding adds its own: the table's
 * bucket must wait for the embedding (configs/gpt2_tiny.yaml, `tie: wte/wte`), with accumulation too. */
Test(dist, tied_weights_buckets_give_the_same_bits_at_two_ranks)
{
    NEED_MPI();
    char dir[] = "/tmp/amp-dist-tied-XXXXXX", cmd[1024], cfg[1024];
    make_token_files(dir, "nanogpt");
    snprintf(cfg, sizeof cfg,
             "configs/gpt2_tiny.yaml run.device=cpu run.steps=20 run.log_every=5 run.eval_every=10 data.batch_size=4 "
             "data.train_bin=%s/train.bin data.val_bin=%s/val.bin accum_steps=2",
             dir, dir);
    check_buckets_same_bits(cfg, "precision.mode=fp16-dynamic");
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    cr_assert_eq(system(cmd), 0);
}

/* Three and four ranks: a bucket's sums are the blocking reduce's (both add in rank order), so one reduce after
 * backward and a bucket about every weight give the same bits. */
static void check_buckets_same_bits_np(int np)
{
    NEED_MPI();
    make_scratch();
    cr_assert_eq(run_buckets(np, MLP, "precision.mode=fp32 " HARD, "0", "once"), 0);
    cr_assert_geq(run_buckets(np, MLP, "precision.mode=fp32 " HARD, "0.001", "tiny"), 3);
    compare_runs("once", "tiny", 20, 1000);
    remove_scratch();
}
Test(dist, three_ranks_buckets_give_the_same_bits) { check_buckets_same_bits_np(3); }
Test(dist, four_ranks_buckets_give_the_same_bits) { check_buckets_same_bits_np(4); }

/* Rank 0's hosts line (dist_format_hosts): hosts in the order of their first rank, ranges of consecutive ranks and
 * devices, others one by one, and a line too long for its buffer cut with "...". */
Test(dist, hosts_line_names_each_host_and_each_ranks_device)
{
    char buf[256];
    const struct dist_place gpus[] = {{"node1", "cuda:0"}, {"node1", "cuda:1"}, {"node1", "cuda:2"},
                                      {"node2", "cuda:0"}, {"node2", "cuda:1"}, {"node2", "cuda:2"}};
    dist_format_hosts(gpus, 6, buf, sizeof buf);
    cr_assert_str_eq(buf, "hosts: node1 (ranks 0-2: cuda:0-2), node2 (ranks 3-5: cuda:0-2)");
    const struct dist_place alternating[] = {{"a", "cpu"}, {"b", "cpu"}, {"a", "cpu"}, {"b", "cpu"}};
    dist_format_hosts(alternating, 4, buf, sizeof buf);
    cr_assert_str_eq(buf, "hosts: a (rank 0: cpu, rank 2: cpu), b (rank 1: cpu, rank 3: cpu)");
    const struct dist_place mixed[] = {{"h", "cpu"}, {"h", "cpu"}, {"h", "cuda:1"}, {"h", "cuda:0"}, {"g", "cuda:0"}};
    dist_format_hosts(mixed, 5, buf, sizeof buf);
    cr_assert_str_eq(buf, "hosts: h (ranks 0-1: cpu, rank 2: cuda:1, rank 3: cuda:0), g (rank 4: cuda:0)");
    char small[24];
    dist_format_hosts(gpus, 6, small, sizeof small);
    cr_assert_str_eq(small, "hosts: node1 (ranks ...");
    cr_assert_eq(strlen(small), sizeof small - 1);
}

/* Two hosts on one machine (tests/two_hosts.sh: two network and UTS namespaces, amphost0 and amphost1, joined by a
 * veth link; the second host's Open MPI daemon started through mpirun's rsh launcher, the ranks' messages over TCP on
 * that link): rank 0 names both hosts and each rank's device, the run is bit for bit the ordinary np 2 run on one
 * host (shared memory), and the gradients did cross the link. Skips, saying why, where the namespaces cannot be made
 * (not root, no iproute2, a container that forbids them). */
Test(dist, two_hosts_over_tcp_equal_one_host)
{
    NEED_MPI();
    make_scratch();
    const char *args = "run " MLP " precision.mode=fp16-dynamic " HARD;
    struct result r = mpi(2, NULL, "%s run.out_dir=%s/one_host", args, scratch);
    cr_assert_eq(r.code, 0, "np 2 on one host:\n%s", r.out);
    cr_assert(strstr(r.out, "hosts: "), "%s", r.out);
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "cd %s && { " MPI_ENV "timeout -s KILL 300 tests/two_hosts.sh %s %s run.out_dir=%s/two_hosts ; } 2>&1",
             AMP_SOURCE_DIR, amp_binary(), args, scratch);
    r = shell(cmd);
    if (r.code == 77) {
        remove_scratch();
        const char *why = strstr(r.out, "two_hosts: ");
        cr_skip_test("%s", why ? why : r.out);
    }
    cr_assert_eq(r.code, 0, "np 2 on two hosts:\n%s", r.out);
    cr_assert(strstr(r.out, "data parallel: 2 ranks on 2 hosts, transport mpi, device of rank 0: cpu"), "%s", r.out);
    cr_assert(strstr(r.out, "\nhosts: amphost0 (rank 0: cpu), amphost1 (rank 1: cpu)\n"), "%s", r.out);
    long long values = 0, there = 0, back = 0;
    const char *red = strstr(r.out, "\nreduce: ");
    const char *vals = red ? strstr(red, "all-reduce, ") : NULL;
    cr_assert(vals && sscanf(vals, "all-reduce, %lld fp32 values", &values) == 1, "%s", r.out);
    const char *link = strstr(r.out, "link: ");
    cr_assert(link && sscanf(link, "link: %lld bytes from amphost0 to amphost1, %lld back", &there, &back) == 2, "%s",
              r.out);
    /* each step's all-reduce sends each rank's half of the gradients at least once each way (20 steps) */
    long long least = 20 * values * 4 / 2;
    cr_assert(there >= least && back >= least, "only %lld and %lld bytes crossed the link, %lld expected:\n%s", there,
              back, least, r.out);
    compare_runs("one_host", "two_hosts", 20, 1000);
    remove_scratch();
}

/* ---- where bit identity cannot hold: a bound -------------------------------------------------------- */

static void check_bounded(int np, int accum_each, int accum_one)
{
    NEED_MPI();
    make_scratch();
    struct result r = amp("run " MLP " precision.mode=fp32 accum_steps=%d run.out_dir=%s/one", accum_one, scratch);
    cr_assert_eq(r.code, 0, "one rank:\n%s", r.out);
    r = mpi(np, NULL, "run " MLP " precision.mode=fp32 accum_steps=%d run.out_dir=%s/many", accum_each, scratch);
    cr_assert_eq(r.code, 0, "%d ranks:\n%s", np, r.out);
    char a[512], b[512], worst[256] = "";
    snprintf(a, sizeof a, "%s/one/ckpt-20.h5", scratch);
    snprintf(b, sizeof b, "%s/many/ckpt-20.h5", scratch);
    double d = max_rel_diff(a, b, worst, sizeof worst);
    cr_assert_geq(d, 0, "no tensors compared");
    cr_assert_leq(d, 1e-6, "np %d accum %d vs np 1 accum %d: %s differs by %.3e relative", np, accum_each, accum_one,
                  worst, d);
    remove_scratch();
}

/* (g0 + g2) + (g1 + g3) against ((g0 + g1) + g2) + g3: the association differs, the samples do not */
Test(dist, two_ranks_with_accumulation_within_1e6) { check_bounded(2, 2, 4); }

/* ---- three and four ranks: the rank-order sum is one rank's accumulation ------------------------------- */

/* ((g0 + g1) + g2) on three ranks, as one rank adds three micro-batches (MPI_Allreduce's own association made this a
 * bound of 1e-6 before) */
Test(dist, three_ranks_equal_one_with_accum_three_fp32)
{
    check_equivalence_np(3, MLP, "precision.mode=fp32 " HARD, NULL);
}
/* four ranks with a bucket about every weight (the non-blocking reduce: exchange, sum, gather) and skips, backoff,
 * clipping */
Test(dist, four_ranks_in_buckets_equal_one_with_accum_four_fp16_dynamic_overflowing)
{
    check_equivalence_np(4, MLP,
                         "precision.mode=fp16-dynamic " OVERFLOWING " precision.loss_scale.hysteresis=2 "
                         "dist.bucket_mb=0.001 " HARD,
                         NULL);
}

/* ---- replicas, configs, data ----------------------------------------------------------------------- */

/* Rank 1's fc1/weight perturbed by AMPTRAIN_TEST_PERTURB=PERTURB: the run stops with exit 5 at step 4 naming the
 * tensor and the rank; unperturbed, the same run (ARGS) passes its checks. */
static void check_diverged_replica(const char *perturb, const char *args)
{
    NEED_MPI();
    make_scratch();
    char opt[64];
    snprintf(opt, sizeof opt, "-x AMPTRAIN_TEST_PERTURB=%s", perturb);
    struct result r = mpi(2, opt, "run " MLP " run.log_every=2 %s run.out_dir=%s/p", args, scratch);
    cr_assert_eq(r.code, 5, "%s", r.out);
    cr_assert(strstr(r.out, "replicas diverged at step 4: fc1/weight on rank 1 differs from rank 0's"), "%s", r.out);
    cr_assert(strstr(r.out, "hint:"), "%s", r.out);
    r = mpi(2, NULL, "run " MLP " run.log_every=2 %s run.out_dir=%s/q", args, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    remove_scratch();
}

Test(dist, diverged_replica_stops_with_exit_5_naming_tensor_and_rank)
{
    check_diverged_replica("1:3", "precision.mode=fp32");
}

/* dist.zero 1 in bf16: fc1/weight's master is sharded (no replica to compare), so its bf16 copy, which every rank
 * holds whole, is compared; a flipped bit of rank 1's copy is found at the next flush */
Test(dist, zero1_diverged_copy_stops_with_exit_5_naming_tensor_and_rank)
{
    check_diverged_replica("1:4", "precision.mode=bf16 dist.zero=1");
}

Test(dist, ranks_with_different_configs_are_refused)
{
    NEED_MPI();
    make_scratch();
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "cd %s && { " MPI_ENV "timeout -s KILL 120 mpirun "
             "--oversubscribe -np 1 %s run " MLP " run.out_dir=%s/c : -np 1 %s run " MLP " run.out_dir=%s/c "
             "optim.lr=0.5 ; } 2>&1",
             AMP_SOURCE_DIR, AMP_BINARY, scratch, AMP_BINARY, scratch);
    struct result r = shell(cmd);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "the resolved config of rank 1 differs from rank 0's"), "%s", r.out);
    char dir[512];
    path_in(dir, sizeof dir, "c/scale_log.csv");
    cr_assert(!file_exists(dir), "a refused job wrote %s", dir);
    remove_scratch();
}

Test(dist, a_rank_without_its_data_stops_every_rank_with_its_error)
{
    NEED_MPI();
    make_scratch();
    /* the config names its data relative to the working directory; rank 1's has none */
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "cd %s && mkdir a b && ln -s /usr/share/datasets/fashion-mnist a/data && "
             "sed 's#/usr/share/datasets/fashion-mnist#data#' %s/configs/fashion_mlp.yaml > cfg.yaml && "
             "{ " MPI_ENV "timeout -s KILL 120 mpirun "
             "--oversubscribe -np 1 -wdir %s/a %s run %s/cfg.yaml " SMALL " run.out_dir=%s/out : -np 1 -wdir %s/b %s run "
             "%s/cfg.yaml " SMALL " run.out_dir=%s/out ; } 2>&1",
             scratch, AMP_SOURCE_DIR, scratch, AMP_BINARY, scratch, scratch, scratch, AMP_BINARY,
             scratch, scratch);
    struct result r = shell(cmd);
    cr_assert_eq(r.code, 3, "%s", r.out);
    cr_assert(strstr(r.out, "ampTrain: error: rank 1: "), "rank 0 names rank 1:\n%s", r.out);
    cr_assert(strstr(r.out, "data/train-images"), "%s", r.out);
    remove_scratch();
}

/* Ranks whose data differ (here rank 1's relative data/ holds the test files under the training files' names) are
 * refused before the first step with exit 3: before, with run.steps, rank 1 trained on its 10,000 samples as if
 * they were rank 0's 60,000 and the job exited 0; with run.epochs the ranks counted different steps and one waited
 * for the other until dist.timeout_s. The same for eval, whose sharded result would mix two datasets. */
Test(dist, ranks_with_different_data_are_refused)
{
    NEED_MPI();
    make_scratch();
    const char *fm = "/usr/share/datasets/fashion-mnist";
    char cmd[8192];
    snprintf(cmd, sizeof cmd,
             "cd %s && mkdir -p a b/data && ln -s %s a/data && "
             "ln -s %s/t10k-images-idx3-ubyte.gz b/data/train-images-idx3-ubyte.gz && "
             "ln -s %s/t10k-labels-idx1-ubyte.gz b/data/train-labels-idx1-ubyte.gz && "
             "ln -s %s/t10k-images-idx3-ubyte.gz %s/t10k-labels-idx1-ubyte.gz b/data/ && "
             "sed 's#%s#data#' %s/configs/fashion_mlp.yaml > cfg.yaml",
             scratch, fm, fm, fm, fm, fm, fm, AMP_SOURCE_DIR);
    cr_assert_eq(shell(cmd).code, 0);
    const char *refused = "the data (rank 0 read 60000 training and 10000 test samples): rank 1 differs from rank 0";
    snprintf(cmd, sizeof cmd,
             "cd %s && { " MPI_ENV "timeout -s KILL 120 mpirun --oversubscribe "
             "-np 1 -wdir %s/a %s run %s/cfg.yaml " SMALL " run.steps=20 run.out_dir=%s/out : "
             "-np 1 -wdir %s/b %s run %s/cfg.yaml " SMALL " run.steps=20 run.out_dir=%s/out ; } 2>&1",
             scratch, scratch, amp_binary(), scratch, scratch, scratch, amp_binary(), scratch, scratch);
    struct result r = shell(cmd);
    cr_assert_eq(r.code, 3, "%s", r.out);
    cr_assert(strstr(r.out, refused), "%s", r.out);
    cr_assert(!strstr(r.out, "step 1/") && !strstr(r.out, "checkpoint:"), "trained anyway:\n%s", r.out);

    /* eval: the training split's paths given relative to each rank's working directory (a run records its paths
     * absolute, and eval reads only the split it evaluates); rank 1's files are not the ones the checkpoint records */
    snprintf(cmd, sizeof cmd, "cd %s/a && %s run %s/cfg.yaml " SMALL " run.steps=2 run.out_dir=%s/one 2>&1", scratch,
             amp_binary(), scratch, scratch);
    r = shell(cmd);
    cr_assert_eq(r.code, 0, "%s", r.out);
    const char *train = "--split train data.train_images=data/train-images-idx3-ubyte.gz "
                        "data.train_labels=data/train-labels-idx1-ubyte.gz";
    snprintf(cmd, sizeof cmd,
             "cd %s && { " MPI_ENV "timeout -s KILL 120 mpirun --oversubscribe "
             "-np 1 -wdir %s/a %s eval %s/one/ckpt-2.h5 %s : -np 1 -wdir %s/b %s eval %s/one/ckpt-2.h5 %s ; } 2>&1",
             scratch, scratch, amp_binary(), scratch, train, scratch, amp_binary(), scratch, train);
    r = shell(cmd);
    cr_assert_eq(r.code, 3, "%s", r.out);
    cr_assert(strstr(r.out, "data/train-images-idx3-ubyte.gz (data.train_images): its contents differ from the file"),
              "%s", r.out);
    cr_assert(!strstr(r.out, "eval step"), "evaluated anyway:\n%s", r.out);
    remove_scratch();
}

/* model.init_from read by each rank from its own working directory, two different files under one name: refused
 * before the first step with exit 4 naming the file and the first tensor that differs. Before, the ranks trained
 * from different weights until the replica check called it a bug or a hardware fault (exit 5). */
Test(dist, ranks_with_different_init_from_files_are_refused)
{
    NEED_MPI();
    make_scratch();
    char cmd[8192];
    snprintf(cmd, sizeof cmd,
             "cd %s && mkdir -p a b && %s run %s/configs/fashion_mlp.yaml " SMALL " run.steps=2 run.out_dir=x && "
             "%s run %s/configs/fashion_mlp.yaml " SMALL " run.steps=2 run.seed=7 run.out_dir=y && "
             "%s export x a/init.safetensors && %s export y b/init.safetensors 2>&1",
             scratch, amp_binary(), AMP_SOURCE_DIR, amp_binary(), AMP_SOURCE_DIR, amp_binary(), amp_binary());
    struct result r = shell(cmd);
    cr_assert_eq(r.code, 0, "%s", r.out);
    snprintf(cmd, sizeof cmd,
             "cd %s && { " MPI_ENV "timeout -s KILL 120 mpirun --oversubscribe "
             "-np 1 -wdir %s/a %s run %s/configs/fashion_mlp.yaml " SMALL " run.steps=4 model.init_from=init.safetensors "
             "run.out_dir=%s/out : -np 1 -wdir %s/b %s run %s/configs/fashion_mlp.yaml " SMALL " run.steps=4 "
             "model.init_from=init.safetensors run.out_dir=%s/out ; } 2>&1",
             scratch, scratch, amp_binary(), AMP_SOURCE_DIR, scratch, scratch, amp_binary(), AMP_SOURCE_DIR, scratch);
    r = shell(cmd);
    cr_assert_eq(r.code, 4, "%s", r.out);
    cr_assert(strstr(r.out, "the weights loaded from init.safetensors differ between ranks: fc1/weight on rank 1 "
                            "differs from rank 0's"),
              "%s", r.out);
    cr_assert(!strstr(r.out, "checkpoint:"), "trained anyway:\n%s", r.out);
    remove_scratch();
}

/* numerics and export are one process's work: under mpirun every rank wrote the same files (numerics.csv had
 * each row twice). Refused on every rank with exit 2, nothing written. */
Test(dist, one_process_commands_under_mpirun_are_refused)
{
    NEED_MPI();
    make_scratch();
    struct result r = amp("run " MLP " run.steps=2 run.eval_every=0 run.out_dir=%s/a", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = mpi(2, NULL, "export %s/a %s/e.safetensors", scratch, scratch);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "ampTrain export is not data-parallel: launched as 2 ranks"), "%s", r.out);
    cr_assert(!strstr(r.out, "[rank 1]"), "said once, by rank 0:\n%s", r.out);
    char path[600];
    snprintf(path, sizeof path, "%s/e.safetensors", scratch);
    cr_assert(!file_exists(path), "%s was written", path);
    r = mpi(2, NULL, "numerics %s/a --steps 1", scratch);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "ampTrain numerics is not data-parallel"), "%s", r.out);
    snprintf(path, sizeof path, "%s/a/numerics-from-step-2.csv", scratch);
    cr_assert(!file_exists(path), "%s was written", path);
    remove_scratch();
}

Test(dist, bad_setups_get_clear_errors)
{
    NEED_MPI();
    make_scratch();
    /* more ranks than samples: a step needs batch x accum x world training samples */
    struct result r = mpi(2, NULL, "run " MLP " data.batch_size=40000 run.out_dir=%s/a", scratch);
    cr_assert_eq(r.code, 3, "%s", r.out);
    cr_assert(strstr(r.out, "80000"), "%s", r.out);
    r = mpi(2, NULL, "run " MLP " dist.backend=none run.out_dir=%s/b", scratch);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "dist.backend is none, but the job has 2 ranks"), "%s", r.out);
    r = mpi(2, NULL, "run " MLP " dist.backend=nccl run.out_dir=%s/c", scratch);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "dist.backend is nccl, but"), "%s", r.out);
    r = mpi(2, NULL, "run " MLP " dist.backend=bogus run.out_dir=%s/d", scratch);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "dist.backend"), "%s", r.out);
    remove_scratch();
}

/* run.threads auto divides a host's CPUs between the ranks that share them: under --bind-to none (mpi()) both
 * ranks may run on every CPU of this process, so each takes half (at least 1), where before each started a pool
 * over all of them (4 threads on 2 cores). A number stays as given, with a warning where it is more than that. */
Test(dist, auto_threads_share_the_hosts_cpus_between_ranks)
{
    NEED_MPI();
    make_scratch();
    int cpus = threadpool_available_cpus(), each = cpus / 2 > 0 ? cpus / 2 : 1;
    char want[128];
    snprintf(want, sizeof want, "threads: %d a rank (run.threads auto: the CPUs each of the 2 ranks", each);
    struct result r = mpi(2, NULL, "run " MLP " run.steps=2 run.out_dir=%s/a", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, want), "want '%s' (%d CPUs) in: %s", want, cpus, r.out);
    r = mpi(3, NULL, "run " MLP " run.steps=2 run.out_dir=%s/b", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    snprintf(want, sizeof want, "threads: %d a rank (run.threads auto: the CPUs each of the 3 ranks",
             cpus / 3 > 0 ? cpus / 3 : 1);
    cr_assert(strstr(r.out, want), "want '%s' (%d CPUs) in: %s", want, cpus, r.out);
    r = mpi(2, NULL, "run " MLP " run.steps=2 run.threads=%d run.out_dir=%s/c", each + 1, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert_null(strstr(r.out, "threads: "), "run.threads=%d is taken as given: %s", each + 1, r.out);
    snprintf(want, sizeof want, "run.threads is %d but each of the 2 ranks on this host has %d CPU(s) to itself",
             each + 1, each);
    cr_assert(strstr(r.out, want), "more threads than a rank's share: want '%s' in: %s", want, r.out);
    remove_scratch();
}

/* ---- checkpoints and resume ---------------------------------------------------------------------------- */

Test(dist, resume_at_the_same_world_size_is_bit_exact)
{
    NEED_MPI();
    make_scratch();
    const char *m = MLP " precision.mode=fp16-dynamic precision.loss_scale.growth_interval=3 " HARD;
    struct result r = mpi(2, NULL, "run %s run.out_dir=%s/a", m, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = mpi(2, NULL, "run %s run.steps=8 run.out_dir=%s/b", m, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = mpi(2, NULL, "resume %s/b/ckpt-8.h5 run.steps=20", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(!strstr(r.out, "note:"), "same world size, no note:\n%s", r.out);
    compare_runs("a", "b", 20, 1);
    r = amp("inspect %s/b/ckpt-20.h5", scratch);
    cr_assert(strstr(r.out, "world_size: 2"), "%s", r.out);
    remove_scratch();
}

/* dist.zero 1: a checkpoint holds the whole optimizer state (gathered to rank 0), and a resume at the same world
 * size gives each rank its block of it back: bit-exact, as dist.zero 0 */
Test(dist, zero1_resume_at_the_same_world_size_is_bit_exact)
{
    NEED_MPI();
    make_scratch();
    const char *m = MLP " precision.mode=fp16-dynamic precision.loss_scale.growth_interval=3 dist.zero=1 " HARD;
    struct result r = mpi(3, NULL, "run %s run.out_dir=%s/a", m, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = mpi(3, NULL, "run %s run.steps=8 run.out_dir=%s/b", m, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = mpi(3, NULL, "resume %s/b/ckpt-8.h5 run.steps=20", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    double ratio;
    check_zero_line(r.out, 3, SOME_WHOLE, &ratio); /* the loaded masters sharded again */
    compare_runs("a", "b", 20, 1);
    remove_scratch();
}

/* One checkpoint at any world size: a run written by 4 ranks with dist.zero 1 resumes on 2, then 1, then 3, and
 * every stage gives the bits of the same chain with dist.zero 0 (the world size changes the gradients' sums, so
 * the chain is compared with its dist.zero 0 twin, not with one uninterrupted run: docs/distributed.md). */
Test(dist, zero1_resumes_across_world_sizes_four_two_one_three)
{
    NEED_MPI();
    make_scratch();
    const char *m = MLP " precision.mode=bf16 run.keep_ckpts=5 " HARD;
    double ratio;
    for (int z = 0; z < 2; z++) { /* bf16: with dist.zero 1 the linear weights' masters are sharded at 4, 2 and 3 */
        struct result r = mpi(4, NULL, "run %s dist.zero=%d run.steps=6 run.out_dir=%s/c%d", m, z, scratch, z);
        cr_assert_eq(r.code, 0, "%s", r.out);
        if (z)
            check_zero_line(r.out, 4, SOME_WHOLE, &ratio);
        r = mpi(2, NULL, "resume %s/c%d/ckpt-6.h5 run.steps=10 dist.zero=%d", scratch, z, z);
        cr_assert_eq(r.code, 0, "%s", r.out);
        cr_assert(strstr(r.out, "was written by 4 ranks"), "%s", r.out);
        if (z)
            check_zero_line(r.out, 2, SOME_WHOLE, &ratio);
        r = amp("resume %s/c%d/ckpt-10.h5 run.steps=14 dist.zero=%d", scratch, z, z);
        cr_assert_eq(r.code, 0, "%s", r.out);
        r = mpi(3, NULL, "resume %s/c%d/ckpt-14.h5 run.steps=18 dist.zero=%d", scratch, z, z);
        cr_assert_eq(r.code, 0, "%s", r.out);
        cr_assert(strstr(r.out, "was written by 1 rank"), "%s", r.out);
        if (z)
            check_zero_line(r.out, 3, SOME_WHOLE, &ratio);
    }
    static const int stages[] = {6, 10, 14, 18};
    for (size_t i = 0; i < sizeof stages / sizeof stages[0]; i++) {
        char a[512], b[512];
        snprintf(a, sizeof a, "%s/c0/ckpt-%d.h5", scratch, stages[i]);
        snprintf(b, sizeof b, "%s/c1/ckpt-%d.h5", scratch, stages[i]);
        cr_assert_geq(assert_same_tensors(a, b), 6);
    }
    compare_runs("c0", "c1", 18, 1000);
    remove_scratch();
}

Test(dist, resume_two_one_two_says_how_the_batch_changes)
{
    NEED_MPI();
    make_scratch();
    const char *m = MLP " precision.mode=bf16";
    struct result r = mpi(2, NULL, "run %s run.steps=6 run.out_dir=%s/a", m, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp("resume %s/a/ckpt-6.h5 run.steps=12", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "was written by 2 ranks (accum_steps 1) and resumes on 1: a step takes 32 samples (batch "
                            "32 x accum 1 x 1 ranks), instead of 64; resume with accum_steps=2 to keep it"), "%s", r.out);
    /* with that override: the note says the batch is kept, from the checkpoint's own accum_steps (before, it
     * used the override's and advised accum_steps=0.5) */
    struct result k = amp("resume %s/a/ckpt-6.h5 run.steps=7 accum_steps=2 run.out_dir=%s/kept", scratch, scratch);
    cr_assert_eq(k.code, 0, "%s", k.out);
    cr_assert(strstr(k.out, "(accum_steps 1) and resumes on 1: a step takes 64 samples (batch 32 x accum 2 x 1 ranks), "
                            "the same as before"), "%s", k.out);
    r = amp("inspect %s/a/ckpt-12.h5", scratch);
    cr_assert(strstr(r.out, "world_size: 1"), "%s", r.out);
    /* back to two, keeping the step's batch with accum_steps: the same samples per step as one rank with 2 */
    r = mpi(2, NULL, "resume %s/a/ckpt-12.h5 run.steps=20", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "resumes on 2: a step takes 64 samples (batch 32 x accum 1 x 2 ranks), instead of 32; no "
                            "accum_steps keeps it on 2 ranks"), "%s", r.out);
    r = amp("inspect %s/a/ckpt-20.h5", scratch);
    /* 6 x 64 + 6 x 32 + 8 x 64 samples, and the global data cursor with them */
    cr_assert(strstr(r.out, "cursor: 1088  samples_seen: 1088"), "%s", r.out);
    /* a refused override at another world size: exit 2 on every rank, said once (by rank 0) */
    r = mpi(2, NULL, "resume %s/a/ckpt-20.h5 run.steps=30 data.batch_size=16", scratch);
    cr_assert_eq(r.code, 2, "%s", r.out);
    char *first = strstr(r.out, "override 'data.batch_size=16' refused");
    cr_assert(first && !strstr(first + 1, "override 'data.batch_size=16' refused"), "said once:\n%s", r.out);
    remove_scratch();
}

Test(dist, eval_sharded_over_ranks_equals_one_rank)
{
    NEED_MPI();
    make_scratch();
    struct result r = amp("run " MLP " run.steps=4 run.out_dir=%s/a", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp("eval %s/a/ckpt-4.h5", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char one[512];
    char *line = strstr(r.out, "eval step");
    cr_assert_not_null(line, "%s", r.out);
    snprintf(one, sizeof one, "%.*s", (int)strcspn(line, "\n"), line);
    r = mpi(3, NULL, "eval %s/a/ckpt-4.h5", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, one), "one rank said '%s'; three:\n%s", one, r.out);
    char cmd[700];
    snprintf(cmd, sizeof cmd, "tail -n 2 %s/a/eval.jsonl | uniq | wc -l", scratch);
    r = shell(cmd);
    cr_assert_eq(atoi(r.out), 1, "the two evaluations' JSON lines differ");
    remove_scratch();
}

/* `mpirun -np 1 ampTrain A : -np 1 ampTrain B` from the source directory: two ranks given different arguments. */
static struct result mpmd(const char *a, const char *b)
{
    char cmd[8192];
    snprintf(cmd, sizeof cmd,
             "cd %s && { " MPI_ENV "timeout -s KILL 120 mpirun --oversubscribe -np 1 %s %s : -np 1 %s %s ; } 2>&1",
             AMP_SOURCE_DIR, amp_binary(), a, amp_binary(), b);
    return shell(cmd);
}

/* Ranks that read different checkpoints (exit 4), evaluate with different options or run different commands (exit
 * 2) are refused before any work, naming the rank: before, eval mixed two models' results into one line silently, eval
 * with another --split ended in MPI_ERR_TRUNCATE, resume trained until the replica check called it a bug, and
 * eval beside inspect waited for dist.timeout_s. A copy of the same file (a host's own) is the same checkpoint. */
Test(dist, ranks_given_different_checkpoints_commands_or_eval_options_are_refused)
{
    NEED_MPI();
    make_scratch();
    struct result r = amp("run " MLP " run.steps=8 run.ckpt_every=4 run.eval_every=0 run.out_dir=%s/a", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char a4[600], a8[600], b8[600], cmd[1400];
    snprintf(a4, sizeof a4, "%s/a/ckpt-4.h5", scratch);
    snprintf(a8, sizeof a8, "%s/a/ckpt-8.h5", scratch);
    snprintf(b8, sizeof b8, "%s/b8.h5", scratch);
    snprintf(cmd, sizeof cmd, "cp %s %s", a8, b8);
    cr_assert_eq(shell(cmd).code, 0);
    const char *refused = "rank 1 differs from rank 0: data-parallel ranks must agree on it";

    snprintf(cmd, sizeof cmd, "eval %s", a4);
    char other[1400];
    snprintf(other, sizeof other, "eval %s", a8);
    r = mpmd(cmd, other);
    cr_assert_eq(r.code, 4, "%s", r.out);
    cr_assert(strstr(r.out, "the checkpoint's contents (rank 0 read") && strstr(r.out, refused), "%s", r.out);
    cr_assert(!strstr(r.out, "eval step"), "evaluated anyway:\n%s", r.out);

    snprintf(cmd, sizeof cmd, "eval %s --split train", a8);
    snprintf(other, sizeof other, "eval %s", a8);
    r = mpmd(cmd, other);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "eval's options (--split, --autocast, --dtype)") && strstr(r.out, refused), "%s", r.out);

    snprintf(cmd, sizeof cmd, "resume %s run.steps=12", a4);
    snprintf(other, sizeof other, "resume %s run.steps=12", a8);
    r = mpmd(cmd, other);
    cr_assert_eq(r.code, 4, "%s", r.out);
    cr_assert(strstr(r.out, "the checkpoint's contents") && strstr(r.out, refused), "%s", r.out);
    cr_assert(!strstr(r.out, "resumed from"), "resumed anyway:\n%s", r.out);

    snprintf(cmd, sizeof cmd, "eval %s", a8); /* another command: it hung in rank 0's collectives */
    snprintf(other, sizeof other, "inspect %s", a8);
    r = mpmd(cmd, other);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "the command (rank 0: 'eval')") && strstr(r.out, refused), "%s", r.out);

    snprintf(cmd, sizeof cmd, "eval %s", a8); /* the file and its copy: one checkpoint */
    snprintf(other, sizeof other, "eval %s", b8);
    r = mpmd(cmd, other);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "eval step 8"), "%s", r.out);
    remove_scratch();
}

/* ---- signals and a lost rank --------------------------------------------------------------------------- */

/* Start a long two-rank run in the background (its exit code goes to OUT.rc); returns once scale_log.csv
 * has a row. */
static void start_long_run_with(const char *out, const char *mpirun_options, const char *args)
{
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "cd %s && { " MPI_ENV
             "timeout -s KILL 200 mpirun -np 2 --oversubscribe --bind-to none %s %s run configs/fashion_mlp.yaml "
             SMALL " run.steps=100000 run.log_every=5 run.ckpt_every=40 run.out_dir=%s/%s %s > %s/%s.out 2>&1; echo $? > %s/%s.rc; } "
             "> /dev/null 2>&1 &",
             AMP_SOURCE_DIR, mpirun_options, AMP_BINARY, scratch, out, args, scratch, out, scratch, out);
    cr_assert_eq(system(cmd), 0);
    char csv[512];
    snprintf(csv, sizeof csv, "%s/%s/scale_log.csv", scratch, out);
    for (int i = 0; i < 600; i++) {
        struct result r = shell((snprintf(cmd, sizeof cmd, "cat %s 2>/dev/null | wc -l", csv), cmd));
        if (atoi(r.out) >= 2)
            return;
        nanosleep(&(struct timespec){.tv_nsec = 100000000}, NULL);
    }
    cr_assert_fail("the run never logged a step");
}

static void start_long_run(const char *out)
{
    start_long_run_with(out, "", "");
}

/* Wait up to `seconds` for the background job; returns mpirun's exit code, or -1 if it still runs. */
static int wait_run(const char *out, int seconds)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "for i in $(seq %d); do [ -s %s/%s.rc ] && break; sleep 0.1; done; cat %s/%s.rc",
             seconds * 10, scratch, out, scratch, out);
    struct result r = shell(cmd);
    return r.out[0] ? atoi(r.out) : -1;
}

/* Signal the ranks (the processes whose command line starts with the binary; not mpirun) of run OUT:
 * `which` is "-n" for the newest one only, "" for all. */
static void signal_ranks(const char *sig, const char *which, const char *out)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "pkill -%s %s -f '^%s run configs/fashion_mlp.yaml.*%s/%s'", sig, which, AMP_BINARY,
             scratch, out);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
}

/* The job stopped at one step: its checkpoint verifies, latest names it, and it is the log's last row. */
static void assert_stopped_with_checkpoint(const char *out, bool says_so)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "cat %s/%s.out", scratch, out);
    struct result r = shell(cmd);
    if (says_so) /* no "error:", and the hint is the command that continues it, launcher included */
        cr_assert(strstr(r.out, "ampTrain: stopped by SIGTERM after step") &&
                      strstr(r.out, "hint: continue with 'mpirun -np "), "%s", r.out);
    cr_assert(!strstr(r.out, "[rank 1]"), "rank 1 should leave the report to rank 0:\n%s", r.out);
    r = amp("inspect %s/%s", scratch, out);
    cr_assert_eq(r.code, 0, "latest of %s does not verify:\n%s", out, r.out);
    snprintf(cmd, sizeof cmd, "tail -n 1 %s/%s/scale_log.csv | cut -d, -f1; cat %s/%s/latest", scratch, out, scratch,
             out);
    r = shell(cmd);
    char want[64];
    snprintf(want, sizeof want, "ckpt-%d.h5", atoi(r.out));
    cr_assert(strstr(r.out, want), "the log's last row and latest disagree: %s", r.out);
}

/* SIGTERM to one rank only: every rank stops at the same step, rank 0 writes the checkpoint, all exit 143. */
Test(dist, sigterm_to_one_rank_stops_all_at_one_step)
{
    NEED_MPI();
    make_scratch();
    start_long_run("one");
    signal_ranks("TERM", "-n", "one");
    cr_assert_eq(wait_run("one", 60), 143);
    assert_stopped_with_checkpoint("one", true);
    remove_scratch();
}

/* SIGTERM to every rank (what a scheduler sends): the same. */
Test(dist, sigterm_to_all_ranks_stops_all_at_one_step)
{
    NEED_MPI();
    make_scratch();
    start_long_run("all");
    signal_ranks("TERM", "", "all");
    cr_assert_eq(wait_run("all", 60), 143);
    assert_stopped_with_checkpoint("all", true);
    remove_scratch();
}

/* SIGTERM to mpirun, which passes it on to the ranks: they stop and save the same way (mpirun's own exit
 * code is then Open MPI's: 1), the stop's checkpoint the log's last row. Open MPI 4.1 sends the ranks SIGCONT, then SIGTERM after
 * odls_base_sigkill_timeout (default 1 s), then SIGKILL after as long again (docs/distributed.md): the
 * ranks have that long for the step and the save, which 1 s may not cover on a loaded machine (5 here: the
 * ranks train on through the first wait, so a longer one costs the whole test run twice that in CPU time). */
Test(dist, sigterm_to_mpirun_is_forwarded)
{
    NEED_MPI();
    make_scratch();
    start_long_run_with("fw", "--mca odls_base_sigkill_timeout 5", "");
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "pkill -TERM -f '^mpirun .*%s/fw'", scratch);
    cr_assert_eq(system(cmd), 0);
    cr_assert_neq(wait_run("fw", 60), -1, "the job did not end");
    /* the ranks' stop message may not reach mpirun's output once it is ending: the checkpoint is the proof */
    assert_stopped_with_checkpoint("fw", false);
    remove_scratch();
}

/* A rank killed outright: the job ends (mpirun takes the others down), nothing hangs, latest verifies. */
Test(dist, sigkill_of_one_rank_ends_the_job)
{
    NEED_MPI();
    make_scratch();
    start_long_run("k");
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "for i in $(seq 600); do [ -s %s/k/latest ] && break; sleep 0.1; done; cat %s/k/latest",
             scratch, scratch);
    struct result r = shell(cmd);
    cr_assert(strstr(r.out, "ckpt-"), "no checkpoint before the kill: %s", r.out);
    signal_ranks("KILL", "-n", "k");
    time_t t0 = time(NULL);
    int rc = wait_run("k", 60);
    cr_assert_neq(rc, -1, "the job still runs 60 s after a rank was killed");
    cr_assert_neq(rc, 0);
    cr_assert_leq(time(NULL) - t0, 60);
    snprintf(cmd, sizeof cmd, "cat %s/k.out", scratch);
    r = shell(cmd);
    cr_assert(strstr(r.out, "signal 9") || strstr(r.out, "Killed") || strstr(r.out, "killed"), "%s", r.out);
    r = amp("inspect %s/k", scratch);
    cr_assert_eq(r.code, 0, "latest does not name a checkpoint that verifies after the kill:\n%s", r.out);
    remove_scratch();
}

/* A rank that stalls without dying (SIGSTOP: what a hung filesystem or a paused host looks like to the
 * others): rank 0 waits in the next collective, and past dist.timeout_s its watchdog ends the job with
 * exit code 1, naming the wait and the key. Without the watchdog the job waits until the test's own kill. */
Test(dist, a_stalled_rank_ends_the_job_after_dist_timeout)
{
    NEED_MPI();
    make_scratch();
    start_long_run_with("st", "", "dist.timeout_s=2");
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "for i in $(seq 600); do [ -s %s/st/latest ] && break; sleep 0.1; done; cat %s/st/latest",
             scratch, scratch);
    struct result r = shell(cmd);
    cr_assert(strstr(r.out, "ckpt-"), "no checkpoint before the stall: %s", r.out);
    time_t t0 = time(NULL);
    signal_ranks("STOP", "-n", "st");
    int rc = wait_run("st", 60);
    time_t waited = time(NULL) - t0;
    /* a stopped rank that mpirun left behind, if any */
    snprintf(cmd, sizeof cmd, "pkill -KILL -f '^%s run configs/fashion_mlp.yaml.*%s/st'", AMP_BINARY, scratch);
    (void)!system(cmd);
    cr_assert_neq(rc, -1, "the job still runs 60 s after a rank stalled, with dist.timeout_s=2");
    cr_assert_neq(rc, 0);
    cr_assert_geq(waited, 2, "the job ended %lds after the stall, before dist.timeout_s", (long)waited);
    snprintf(cmd, sizeof cmd, "cat %s/st.out", scratch);
    r = shell(cmd);
    /* the rank that waits says so (the one stopped is whichever started last) */
    cr_assert(strstr(r.out, "] ampTrain: error: waited "), "%s", r.out);
    cr_assert(strstr(r.out, "longer than dist.timeout_s (2 s)"), "%s", r.out);
    cr_assert(strstr(r.out, "hint: "), "%s", r.out);
    r = amp("inspect %s/st", scratch);
    cr_assert_eq(r.code, 0, "latest does not name a checkpoint that verifies after the stall:\n%s", r.out);
    remove_scratch();
}

/* ---- in process: the watchdog alone (comm_watch.h) ----------------------------------------------------- */

/* A wait past the limit ends the process with exit code 1 (Criterion runs each test in its own process), even
 * while the waiting thread holds stdout's and stderr's locks (as one stuck writing a progress line would). */
Test(dist, watch_ends_a_wait_past_its_limit, .exit_code = 1)
{
    struct comm_watch *w = comm_watch_new(0, 0.2);
    cr_assert_not_null(w);
    /* stdio locks as a program's does (Criterion's worker may have set them to the caller's) */
    __fsetlocking(stdout, FSETLOCKING_INTERNAL);
    __fsetlocking(stderr, FSETLOCKING_INTERNAL);
    comm_watch_begin(w, "a test's wait"); /* starts the thread: glibc's stdio locks only where there are two */
    flockfile(stdout);
    flockfile(stderr);
    nanosleep(&(struct timespec){.tv_sec = 3}, NULL);
    funlockfile(stderr);
    funlockfile(stdout);
    cr_assert_fail("still running 3 s into a wait with a limit of 0.2 s");
}

/* Waits shorter than the limit pass however many there are; time between waits does not count; a limit of 0
 * never ends a wait; the thread stops when the watch is freed. */
Test(dist, watch_lets_shorter_waits_and_idle_time_pass)
{
    /* a limit far above the 50 ms waits, so that a loaded machine (two suites side by side) cannot stretch one past
     * it; the idle time between them adds up to three limits */
    struct comm_watch *w = comm_watch_new(0, 1.0);
    cr_assert_not_null(w);
    for (int i = 0; i < 12; i++) {
        comm_watch_begin(w, "a short wait");
        nanosleep(&(struct timespec){.tv_nsec = 50000000}, NULL);
        comm_watch_end(w);
        nanosleep(&(struct timespec){.tv_nsec = 250000000}, NULL); /* 3 s idle in all, 3 limits */
    }
    comm_watch_set_timeout(w, 0);
    cr_assert_eq(comm_watch_timeout(w), 0);
    comm_watch_begin(w, "a wait without a limit");
    nanosleep(&(struct timespec){.tv_nsec = 600000000}, NULL);
    comm_watch_end(w);
    comm_watch_free(w);
    comm_watch_free(NULL);
    comm_watch_begin(NULL, "nothing"); /* no watch (out of memory at start): nothing is watched */
    comm_watch_end(NULL);
}

/* ---- in process: what a step asks of the communicator ------------------------------------------------ */

/* *t set up in process on the stand-in communicator `fake` from configs/`yaml` with the overrides ov[0..n) (into
 * *cfg, which the trainer keeps), one OpenBLAS thread. */
static void fake_trainer(struct trainer *t, struct config *cfg, struct comm *fake, const char *yaml,
                         const char *const *ov, size_t n)
{
    setenv("OPENBLAS_NUM_THREADS", "1", 1);
    struct amp_error err;
    char path[512];
    snprintf(path, sizeof path, AMP_SOURCE_DIR "/configs/%s", yaml);
    cr_assert_eq(config_load(cfg, path, &err), AMP_OK, "%s", err.msg);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(config_apply_override(cfg, ov[i], &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(config_finalize(cfg, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(trainer_setup(t, cfg, fake, &err), AMP_OK, "%s", err.msg);
}

/* A stand-in for a second rank identical to this one: a sum over two ranks doubles the buffer. */
static int64_t fake_reduces, fake_host;
static void fake_reduce_sum(struct comm *c, void *buf, size_t count, enum comm_dtype dt)
{
    (void)c;
    fake_reduces++;
    for (size_t i = 0; i < count; i++) {
        if (dt == COMM_F32)
            ((float *)buf)[i] *= 2;
        else
            ((double *)buf)[i] *= 2;
    }
}
static void fake_host_allreduce(struct comm *c, void *buf, size_t count, enum comm_dtype dt, enum comm_op op)
{
    (void)c, (void)buf, (void)count, (void)dt, (void)op;
    fake_host++;
}
static void fake_host_bcast(struct comm *c, void *buf, size_t bytes, int root)
{
    (void)c, (void)buf, (void)bytes, (void)root;
    fake_host++;
}
static void fake_host_allgather(struct comm *c, const void *send, void *recv, size_t bytes)
{
    (void)c;
    memcpy(recv, send, bytes);
    memcpy((char *)recv + bytes, send, bytes);
    fake_host++;
}
static void fake_abort(struct comm *c, int code)
{
    (void)c;
    cr_assert_fail("abort(%d)", code);
}
static void fake_close(struct comm *c) { (void)c; }

Test(dist, a_step_reduces_once_after_the_last_micro_batch)
{
    struct comm fake = {
        .rank = 0, .world = 2, .local_rank = 0, .local_world = 1, .hosts = 1, .transport = "fake",
        .device_memory = true, .reduce_sum = fake_reduce_sum, .host_allreduce = fake_host_allreduce,
        .host_bcast = fake_host_bcast, .host_allgather = fake_host_allgather, .abort = fake_abort,
        .close = fake_close,
    };
    struct config cfg;
    struct amp_error err;
    const char *ov[] = {"model.layers.1.out=16", "model.layers.3.out=16", "data.batch_size=8", "run.device=cpu",
                        "accum_steps=3", "run.log_every=4"};
    struct trainer t;
    fake_trainer(&t, &cfg, &fake, "fashion_mlp_fp16_dynamic.yaml", ov, sizeof ov / sizeof ov[0]);
    cr_assert_eq(t.params.micro_batches, 6, "3 micro-batches on each of 2 ranks");
    for (int s = 0; s < 4; s++) {
        int64_t before = fake_reduces, host_before = fake_host;
        cr_assert_eq(trainer_step(&t, &err), AMP_OK, "%s", err.msg);
        /* the flat gradient buffer and the loss, once each, whatever accum_steps; no host collective */
        cr_assert_eq(fake_reduces - before, 2, "step %d: %lld reduces", s, (long long)(fake_reduces - before));
        cr_assert_eq(fake_host - host_before, 0, "step %d made host collectives", s);
    }
    cr_assert_eq(trainer_flush(&t, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(t.nrecs, 4);
    cr_assert_eq(t.samples_seen, 4 * 8 * 3 * 2, "samples of both ranks");
    /* the step's global sample order: rank 0 read past rank 1's batch of every micro-batch slot */
    cr_assert_eq(t.sampler.cursor, 4 * 3 * 2 * 8);
    /* an identical peer doubles the gradient and the seed halves it: the loss is this rank's own mean */
    cr_assert(isfinite(t.recs[0].loss) && t.recs[0].loss > 1.0 && t.recs[0].loss < 3.5, "loss %g", t.recs[0].loss);
    trainer_teardown(&t);
    config_free(&cfg);
}

/* The non-blocking reduce of the same stand-in peer: a start doubles the bucket at once and records where it lies in
 * the flat gradient buffer and how often backward had let reduces progress by then. */
#define FAKE_MAX 64
static int64_t fake_starts, fake_waits, fake_progress;
static size_t fake_begin[FAKE_MAX], fake_count[FAKE_MAX];
static int64_t fake_progress_at[FAKE_MAX];
static const float *fake_base;
static struct comm_request *fake_reduce_start(struct comm *c, void *buf, size_t count, enum comm_dtype dt)
{
    cr_assert_eq(dt, COMM_F32);
    if (fake_starts < FAKE_MAX) {
        fake_begin[fake_starts] = (size_t)((const float *)buf - fake_base);
        fake_count[fake_starts] = count;
        fake_progress_at[fake_starts] = fake_progress;
    }
    fake_starts++;
    fake_reduce_sum(c, buf, count, dt);
    fake_reduces--; /* counted as a start, not a blocking reduce */
    return (struct comm_request *)&fake_starts; /* any request but NULL: a wait must follow */
}
static void fake_reduce_progress(struct comm *c)
{
    (void)c;
    fake_progress++;
}
static void fake_reduce_wait(struct comm *c, struct comm_request *r)
{
    (void)c;
    cr_assert_not_null(r);
    fake_waits++;
}

/* fashion_mlp (16 wide, accum 3) trained 4 steps in process with the fake peer and dist.bucket_mb `mb`; its loss
 * rows and weights into *loss and *weights (malloc'd), checking what each step asks of the communicator. */
static void train_with_buckets(const char *mb, double *loss, float **weights, size_t *nweights)
{
    struct comm fake = {
        .rank = 0, .world = 2, .local_rank = 0, .local_world = 1, .hosts = 1, .transport = "fake",
        .device_memory = true, .reduce_sum = fake_reduce_sum, .reduce_start = fake_reduce_start,
        .reduce_progress = fake_reduce_progress, .reduce_wait = fake_reduce_wait,
        .host_allreduce = fake_host_allreduce, .host_bcast = fake_host_bcast,
        .host_allgather = fake_host_allgather, .abort = fake_abort, .close = fake_close,
    };
    struct config cfg;
    struct amp_error err;
    char key[64];
    snprintf(key, sizeof key, "dist.bucket_mb=%s", mb);
    const char *ov[] = {"model.layers.1.out=16", "model.layers.3.out=16", "data.batch_size=8", "run.device=cpu",
                        "accum_steps=3", "run.log_every=4", key};
    struct trainer t;
    fake_trainer(&t, &cfg, &fake, "fashion_mlp_fp16_dynamic.yaml", ov, sizeof ov / sizeof ov[0]);
    const struct model *m = &t.model;
    fake_base = m->grad_flat;
    int nb = dist_overlap_buckets(t.overlap);
    cr_assert_eq(nb, atof(mb) > 0 ? 6 : 0, "dist.bucket_mb %s: %d buckets (one a parameter: 3 weights, 3 biases)",
                 mb, nb);
    for (int s = 0; s < 4; s++) {
        int64_t reduces = fake_reduces, starts = fake_starts, waits = fake_waits, host = fake_host;
        cr_assert_eq(trainer_step(&t, &err), AMP_OK, "%s", err.msg);
        /* the loss by reduce_sum; the gradients by it once (no buckets) or in nb buckets, on the last micro-batch
         * only, each waited for */
        cr_assert_eq(fake_reduces - reduces, nb ? 1 : 2, "step %d", s);
        cr_assert_eq(fake_starts - starts, nb, "step %d: %lld starts", s, (long long)(fake_starts - starts));
        cr_assert_eq(fake_waits - waits, nb, "step %d", s);
        cr_assert_eq(fake_host - host, 0, "step %d made host collectives", s);
        if (nb == 0)
            continue;
        /* from the end of the flat buffer to its start, each bucket where the one before began */
        size_t end = m->grad_flat_count;
        for (int64_t k = starts; k < fake_starts; k++) {
            cr_assert_eq(fake_begin[k] + fake_count[k], end, "step %d: bucket %lld", s, (long long)(k - starts));
            end = fake_begin[k];
        }
        cr_assert_eq(end, 0, "the buckets cover the flat gradient buffer");
        /* the first started while earlier layers still ran backward: reduces progressed before the last began */
        cr_assert_lt(fake_progress_at[starts], fake_progress_at[fake_starts - 1], "step %d", s);
    }
    cr_assert_eq(trainer_flush(&t, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(t.nrecs, 4);
    for (int i = 0; i < 4; i++)
        loss[i] = t.recs[i].loss;
    *nweights = 0;
    for (int i = 0; i < m->nparams; i++)
        *nweights += m->params[i]->master.numel;
    *weights = malloc(*nweights * sizeof **weights);
    cr_assert_not_null(*weights);
    size_t at = 0;
    for (int i = 0; i < m->nparams; i++) {
        const struct tensor *w = &m->params[i]->master;
        t.be->download(t.be, *weights + at, w->data, w->numel * sizeof(float));
        at += w->numel;
    }
    trainer_teardown(&t);
    config_free(&cfg);
}

Test(dist, buckets_start_during_the_last_backward_from_the_end_and_move_no_bit)
{
    double once[4], tiny[4];
    float *w_once, *w_tiny;
    size_t n_once, n_tiny;
    train_with_buckets("0", once, &w_once, &n_once);
    train_with_buckets("1e-6", tiny, &w_tiny, &n_tiny);
    cr_assert_eq(n_once, n_tiny);
    for (int i = 0; i < 4; i++)
        cr_assert(memcmp(&once[i], &tiny[i], sizeof once[i]) == 0, "step %d: loss %.17g and %.17g", i, once[i],
                  tiny[i]);
    cr_assert(memcmp(w_once, w_tiny, n_once * sizeof *w_once) == 0, "the weights differ");
    free(w_once);
    free(w_tiny);
}

/* ---- in process: ZeRO-1's blocks and the trial's verdict ------------------------------------------------ */

Test(dist, zero_blocks_cover_any_size_in_rank_order)
{
    static const struct { size_t count; int world; size_t lo[4], hi[4]; } cases[] = {
        {10, 4, {0, 3, 6, 9}, {3, 6, 9, 10}}, /* the last block shorter */
        {2, 3, {0, 1, 2}, {1, 2, 2}},         /* the last empty */
        {8, 4, {0, 2, 4, 6}, {2, 4, 6, 8}},
        {0, 2, {0, 0}, {0, 0}},
        {7, 1, {0}, {7}},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int r = 0; r < cases[c].world; r++) {
            size_t lo, hi;
            comm_shard(cases[c].count, cases[c].world, r, &lo, &hi);
            cr_assert(lo == cases[c].lo[r] && hi == cases[c].hi[r], "%zu over %d, rank %d: [%zu, %zu)", cases[c].count,
                      cases[c].world, r, lo, hi);
        }
}

/* The other rank's verdict, and a host all-reduce (min) that combines it with this rank's. */
static int64_t peer_verdict;
static void min_host_allreduce(struct comm *c, void *buf, size_t count, enum comm_dtype dt, enum comm_op op)
{
    (void)c;
    cr_assert(count == 1 && dt == COMM_I64 && op == COMM_MIN, "one int64, min");
    int64_t *x = buf, peer = peer_verdict != 0 ? peer_verdict : INT64_MAX;
    *x = peer < *x ? peer : *x;
}

/* Each rank tries its blocks; the step's verdict is the smallest parameter index any rank found, 0 where none did:
 * what one rank trying every element finds. */
Test(dist, zero_trial_verdict_is_the_smallest_over_the_ranks)
{
    struct comm fake = {.rank = 0, .world = 2, .transport = "fake", .host_allreduce = min_host_allreduce,
                        .abort = fake_abort, .close = fake_close};
    struct backend be = {.name = "host", .host_memory = true};
    struct dist d = {.comm = &fake, .be = &be, .active = true};
    struct optimizer o = {.shard_rank = 0, .shard_world = 2};
    static const int64_t cases[][3] = {{0, 0, 0}, {0, 3, 3}, {5, 3, 3}, {2, 7, 2}, {4, 0, 4}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct grad_check check = {.update_nonfinite = cases[i][0]};
        peer_verdict = cases[i][1];
        zero_after_trial(&d, &o, &check);
        cr_assert_eq(check.update_nonfinite, cases[i][2], "mine %lld, the peer's %lld: %lld", (long long)cases[i][0],
                     (long long)cases[i][1], (long long)check.update_nonfinite);
    }
    o.shard_world = 1; /* not sharded: no collective, the verdict as it is */
    struct grad_check check = {.update_nonfinite = 5};
    peer_verdict = 3;
    zero_after_trial(&d, &o, &check);
    cr_assert_eq(check.update_nonfinite, 5);
}

/* ---- in process: dist.zero 1 reduce-scatters the gradients and all-gathers only the parts' statistics ---------- */

/* A stand-in communicator of 4 ranks, this one rank 0, with the collectives on the caller's blocks: it counts what a
 * step asks of it and where the buffers it all-gathers lie. The peers' values are this rank's (a sum doubles the
 * block); what they would send back is not made up, so only the traffic is checked here, and the bits end to end. */
static int64_t zb_scatters, zb_starts, zb_parts_gathers, zb_grad_gathers, zb_weight_gathers;
static size_t zb_parts_gathered;
static const float *zb_flat;
static size_t zb_flat_count;
static void zb_double(void *buf, const size_t *bounds)
{
    float *x = buf;
    for (size_t i = bounds[0]; i < bounds[1]; i++) /* rank 0's block */
        x[i] *= 2;
}
static void zb_reduce_scatter_blocks(struct comm *c, void *buf, const size_t *bounds, enum comm_dtype dt)
{
    (void)c;
    cr_assert_eq(dt, COMM_F32);
    zb_scatters++;
    zb_double(buf, bounds);
}
static struct comm_request *zb_reduce_scatter_start(struct comm *c, void *buf, const size_t *bounds,
                                                    enum comm_dtype dt)
{
    (void)c;
    cr_assert_eq(dt, COMM_F32);
    zb_scatters++;
    zb_double(buf, bounds);
    return (struct comm_request *)&zb_scatters; /* any request but NULL: a wait must follow */
}
static struct comm_request *zb_reduce_start(struct comm *c, void *buf, size_t count, enum comm_dtype dt)
{
    zb_starts++; /* a started all-reduce: the gradients' all-gather with it */
    fake_reduce_sum(c, buf, count, dt);
    fake_reduces--;
    return (struct comm_request *)&zb_starts;
}
static void zb_all_gather_blocks(struct comm *c, void *buf, const size_t *bounds, size_t elem_bytes)
{
    (void)c;
    const float *at = buf;
    if (elem_bytes == sizeof(struct grad_part)) {
        zb_parts_gathers++;
        zb_parts_gathered = bounds[4];
    } else if (at >= zb_flat && at < zb_flat + zb_flat_count) {
        zb_grad_gathers++;
    } else {
        zb_weight_gathers++;
    }
}
static void zb_all_gather(struct comm *c, void *buf, size_t count, size_t elem_bytes)
{
    zb_all_gather_blocks(c, buf, (const size_t[]){0, count, count, count, count}, elem_bytes);
}
static void zb_host_gather_blocks(struct comm *c, const void *send, void *recv, const size_t *bounds,
                                  size_t elem_bytes, int root)
{
    (void)c, (void)send, (void)recv, (void)bounds, (void)elem_bytes, (void)root;
    cr_assert_fail("no checkpoint is gathered here");
}

/* fashion_mlp 64 wide in bf16 (fc1/weight 50,176 elements: four parts, the last short; the biases and the head far
 * smaller than a part), dist.zero 1 on the stand-in's 4 ranks with dist.bucket_mb `mb`. */
static void check_zero1_traffic(const char *mb)
{
    struct comm fake = {
        .rank = 0, .world = 4, .local_rank = 0, .local_world = 1, .hosts = 1, .transport = "fake",
        .device_memory = false, .reduce_sum = fake_reduce_sum, .reduce_start = zb_reduce_start,
        .reduce_progress = fake_reduce_progress, .reduce_wait = fake_reduce_wait, .all_gather = zb_all_gather,
        .host_allreduce = fake_host_allreduce, .host_bcast = fake_host_bcast, .host_allgather = fake_host_allgather,
        .abort = fake_abort, .close = fake_close, .reduce_scatter_blocks = zb_reduce_scatter_blocks,
        .reduce_scatter_start = zb_reduce_scatter_start, .all_gather_blocks = zb_all_gather_blocks,
        .host_gather_blocks = zb_host_gather_blocks,
    };
    struct config cfg;
    struct amp_error err;
    char key[64];
    snprintf(key, sizeof key, "dist.bucket_mb=%s", mb);
    const char *ov[] = {"model.layers.1.out=64", "model.layers.3.out=3", "data.batch_size=8", "run.device=cpu",
                        "precision.mode=bf16", "accum_steps=2", "run.log_every=4", "dist.zero=1", key};
    struct trainer t;
    fake_trainer(&t, &cfg, &fake, "fashion_mlp.yaml", ov, sizeof ov / sizeof ov[0]);
    const struct model *m = &t.model;
    const struct zero_plan *z = &t.zero;
    cr_assert(z->sharded && z->aligned && z->exact, "dist.zero 1 on the CPU: exact partial statistics");
    size_t part = t.be->grad_part_numel;
    cr_assert_eq(part, 16384, "the CPU's parts: its statistics' chunks");
    /* one partition: every parameter's blocks are in rank order, cover it, and start on its parts */
    int64_t owned[4] = {0}, small = 0;
    for (int i = 0; i < m->nparams; i++) {
        const size_t *b = z->blocks + (size_t)i * 5, numel = m->params[i]->grad.numel;
        cr_assert(b[0] == 0 && b[4] == numel, "%s", m->params[i]->name);
        int holders = 0;
        for (int q = 0; q < 4; q++) {
            cr_assert_leq(b[q], b[q + 1], "%s", m->params[i]->name);
            cr_assert(b[q] % part == 0 || b[q] == numel, "%s: rank %d starts at %zu", m->params[i]->name, q, b[q]);
            cr_assert_eq(t.opt.blocks[(size_t)i * 5 + q], b[q], "the optimizer's blocks are the plan's");
            owned[q] += (int64_t)(b[q + 1] - b[q]);
            holders += b[q + 1] > b[q];
        }
        if (numel < part) { /* a tensor smaller than a part, or than the world: one rank has all of it */
            cr_assert_eq(holders, 1, "%s", m->params[i]->name);
            small++;
        }
    }
    cr_assert_geq(small, 4, "biases and the head: smaller than a part");
    for (int q = 0; q < 4; q++)
        cr_assert_gt(owned[q], 0, "rank %d owns nothing", q);
    zb_flat = m->grad_flat;
    zb_flat_count = m->grad_flat_count;
    int nb = z->nbuckets;
    cr_assert_eq(nb, atof(mb) > 0 ? 6 : 1, "dist.bucket_mb %s: %d buckets (one a parameter)", mb, nb);
    for (int s = 0; s < 3; s++) {
        int64_t reduces = fake_reduces, scatters = zb_scatters, starts = zb_starts, waits = fake_waits;
        int64_t parts = zb_parts_gathers, grads = zb_grad_gathers, weights = zb_weight_gathers;
        cr_assert_eq(trainer_step(&t, &err), AMP_OK, "%s", err.msg);
        cr_assert_eq(zb_scatters - scatters, nb, "step %d: each bucket reduce-scattered once", s);
        cr_assert_eq(fake_waits - waits, atof(mb) > 0 ? nb : 0, "step %d: each started bucket waited for", s);
        cr_assert_eq(fake_reduces - reduces, 1, "step %d: one all-reduce, the loss's", s);
        cr_assert_eq(zb_starts - starts, 0, "step %d: no bucket all-reduced", s);
        cr_assert_eq(zb_grad_gathers - grads, 0, "step %d: nothing of the gradients all-gathered", s);
        cr_assert_eq(zb_parts_gathers - parts, 1, "step %d: the parts' statistics all-gathered once", s);
        cr_assert_eq((int64_t)zb_parts_gathered, z->first[m->nparams], "every part of every tensor");
        cr_assert_gt(zb_weight_gathers - weights, 0, "step %d: the weights' blocks all-gathered", s);
    }
    cr_assert_eq(trainer_flush(&t, &err), AMP_OK, "%s", err.msg);
    trainer_teardown(&t);
    config_free(&cfg);
}

Test(dist, zero1_reduce_scatters_the_gradients_and_gathers_only_their_statistics_one_bucket)
{
    check_zero1_traffic("0");
}
Test(dist, zero1_reduce_scatters_the_gradients_and_gathers_only_their_statistics_in_buckets)
{
    check_zero1_traffic("1e-6");
}
