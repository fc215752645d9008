/*
 * test_best.c — run.keep_best and run.early_stop (issue 43, item 5), end to end on the small Fashion-MNIST MLP:
 * the `best` file names the checkpoint of the best evaluation in eval.jsonl (lowest loss, highest accuracy), that
 * checkpoint outlives the rotation, and the watch survives a resume (the same best as a straight run); an early
 * stop comes at the evaluation eval.jsonl's figures say, exits 0 with its reason, and a resumed run stops at the
 * same step; under mpirun every rank stops there together; a stale best.tmp is cleaned like latest.tmp; bad values
 * are exit 2 naming the key.
 *
 * The learning rate is high so that the evaluations go up and down within a few steps.
 */
#define _POSIX_C_SOURCE 200809L
#include "disttest.h" /* mpi, NEED_MPI; ckpt_testlib.h: scratch, amp, assert_same_tensors */

#include "checkpoint.h" /* ckpt_verify */

#define RUN "run configs/fashion_mlp.yaml " SMALL " run.threads=1 optim.lr=0.05 run.eval_every=5"

/* The steps and one figure of every evaluation in DIR/eval.jsonl; returns how many. */
static int read_evals(const char *dir, const char *figure, int64_t *steps, double *values, int max)
{
    char p[700], line[1024], key[64];
    snprintf(p, sizeof p, "%s/eval.jsonl", dir);
    snprintf(key, sizeof key, "\"%s\": ", figure);
    FILE *f = fopen(p, "r");
    cr_assert_not_null(f, "%s is missing", p);
    int n = 0;
    while (n < max && fgets(line, sizeof line, f)) {
        const char *s = strstr(line, "\"step\": "), *v = strstr(line, key);
        cr_assert(s && v, "%s: %s", p, line);
        steps[n] = strtoll(s + 8, NULL, 10);
        values[n] = strtod(v + strlen(key), NULL);
        n++;
    }
    fclose(f);
    return n;
}

/* The one-line file DIR/NAME (latest, best) without its newline. */
static void read_pointer(const char *dir, const char *name, char *out, size_t len)
{
    char p[700];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "r");
    cr_assert_not_null(f, "%s is missing", p);
    cr_assert_not_null(fgets(out, (int)len, f));
    fclose(f);
    out[strcspn(out, "\n")] = '\0';
}

static int count_checkpoints(const char *dir, int max_step)
{
    int n = 0;
    for (int s = 1; s <= max_step; s++) {
        char p[700];
        snprintf(p, sizeof p, "%s/ckpt-%d.h5", dir, s);
        n += file_exists(p);
    }
    return n;
}

static int64_t state_i64(const char *path, const char *name)
{
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    cr_assert_geq(f, 0, "%s", path);
    hid_t g = H5Gopen2(f, "state", H5P_DEFAULT);
    hid_t a = H5Aopen(g, name, H5P_DEFAULT);
    cr_assert_geq(a, 0, "%s: /state/%s is missing", path, name);
    int64_t v = -2;
    cr_assert_geq(H5Aread(a, H5T_NATIVE_INT64, &v), 0);
    H5Aclose(a);
    H5Gclose(g);
    H5Fclose(f);
    return v;
}

/* keep_best's best: the step of the lowest (or, higher_better, highest) figure; the first one on a tie. */
static int64_t best_step_of(const int64_t *steps, const double *v, int n, bool higher_better)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (higher_better ? v[i] > v[b] : v[i] < v[b])
            b = i;
    return steps[b];
}

/* A checkpoint every 5 steps, one kept: the best, three or more evaluations before the end, survives the rotation
 * only as the best (the newest and the one before it are kept anyway). */
static void check_keep_best(const char *metric, bool higher_better, int steps_total)
{
    make_scratch();
    struct result r = amp(RUN " run.steps=%d run.ckpt_every=5 run.keep_best=%s run.keep_ckpts=1 run.out_dir=%s/a",
                          steps_total, metric, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char dir[600], name[128], p[800];
    path_in(dir, sizeof dir, "a");
    int64_t steps[64];
    double v[64];
    int n = read_evals(dir, metric, steps, v, 64);
    cr_assert_eq(n, steps_total / 5, "one evaluation every 5 steps, the last the final one");
    int64_t best = best_step_of(steps, v, n, higher_better);
    cr_assert_leq(best, steps_total - 15, "the test needs a best that the rotation would remove (it is at %lld)",
                  (long long)best);
    read_pointer(dir, "best", name, sizeof name);
    char want[400];
    snprintf(want, sizeof want, "ckpt-%lld.h5", (long long)best);
    cr_assert_str_eq(name, want, "best names %s; eval.jsonl's best %s is at step %lld", name, metric, (long long)best);
    snprintf(p, sizeof p, "%s/%s", dir, name);
    struct ckpt_info info;
    struct amp_error err;
    cr_assert_eq(ckpt_verify(p, &info, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(info.step, best);
    cr_assert_eq(state_i64(p, "keep_best_step"), best);
    read_pointer(dir, "latest", name, sizeof name);
    snprintf(want, sizeof want, "ckpt-%d.h5", steps_total);
    cr_assert_str_eq(name, want);
    /* keep_ckpts 1: the newest, the one before it (the last after a clean step, for a fail-fast hint), the best */
    cr_assert_eq(count_checkpoints(dir, steps_total), 3, "the rotation kept another number:\n%s", r.out);
    snprintf(want, sizeof want, "best: %s/a/ckpt-%lld.h5", scratch, (long long)best);
    cr_assert(strstr(r.out, want), "no '%s' line:\n%s", want, r.out);
    remove_scratch();
}

Test(best, keep_best_loss_names_the_lowest_loss) { check_keep_best("loss", false, 70); }
Test(best, keep_best_accuracy_names_the_highest_accuracy) { check_keep_best("accuracy", true, 50); }

/* A run stopped at step 35 and resumed to 45 ends with the same best as the straight run, the evaluation at step 35,
 * which the resumed part alone (evaluations at 40 and 45) would not pick: the watch is in the checkpoint. */
Test(best, keep_best_survives_resume)
{
    make_scratch();
    struct result r = amp(RUN " run.steps=45 run.keep_best=accuracy run.keep_ckpts=1 run.out_dir=%s/a", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp(RUN " run.steps=35 run.keep_best=accuracy run.keep_ckpts=1 run.out_dir=%s/b", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp("resume %s/b/ckpt-35.h5 run.steps=45", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char a[600], b[600], best_a[128], best_b[128];
    path_in(a, sizeof a, "a");
    path_in(b, sizeof b, "b");
    read_pointer(a, "best", best_a, sizeof best_a);
    read_pointer(b, "best", best_b, sizeof best_b);
    cr_assert_str_eq(best_b, best_a);
    int64_t steps[64];
    double v[64];
    int n = read_evals(b, "accuracy", steps, v, 64);
    cr_assert_eq(n, 9);
    int64_t best = best_step_of(steps, v, n, true);
    cr_assert_leq(best, 35, "the test needs the run's best before the resume (it is at step %lld)", (long long)best);
    char want[64];
    snprintf(want, sizeof want, "ckpt-%lld.h5", (long long)best);
    cr_assert_str_eq(best_b, want);
    snprintf(a, sizeof a, "%s/b/%s", scratch, want);
    cr_assert(file_exists(a), "the best checkpoint was pruned after the resume");
    snprintf(a, sizeof a, "%s/a/ckpt-45.h5", scratch);
    snprintf(b, sizeof b, "%s/b/ckpt-45.h5", scratch);
    cr_assert_eq(state_i64(b, "keep_best_step"), state_i64(a, "keep_best_step"));
    remove_scratch();
}

/* Whatever `best` names is never pruned: a resume that watches nothing (or another metric, until its first best)
 * leaves the file and the checkpoint it names alone (before, the rotation removed it and `best` named a missing
 * file). */
Test(best, the_checkpoint_best_names_outlives_a_resume_that_watches_nothing)
{
    make_scratch();
    struct result r = amp(RUN " run.steps=50 run.ckpt_every=5 run.keep_best=accuracy run.keep_ckpts=1 "
                          "run.out_dir=%s/a", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char dir[600], before[128], after[128], p[800];
    path_in(dir, sizeof dir, "a");
    read_pointer(dir, "best", before, sizeof before);
    cr_assert_str_neq(before, "ckpt-50.h5");
    cr_assert_str_neq(before, "ckpt-45.h5");
    r = amp("resume %s/a run.steps=70 run.keep_best=none", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    read_pointer(dir, "best", after, sizeof after);
    cr_assert_str_eq(after, before);
    snprintf(p, sizeof p, "%s/%s", dir, after);
    cr_assert(file_exists(p), "best names %s, which the rotation removed", after);
    r = amp("resume %s/a run.steps=80 'run.keep_best=loss'", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    read_pointer(dir, "best", after, sizeof after);
    snprintf(p, sizeof p, "%s/%s", dir, after);
    cr_assert(file_exists(p), "best names %s, which the rotation removed", after);
    remove_scratch();
}

/* The step run.early_stop stops at, from eval.jsonl's figures: the first evaluation after which `patience` in a
 * row did not improve on the best by more than min_delta. -1: none. */
static int64_t expected_stop(const int64_t *steps, const double *v, int n, bool higher_better, int patience)
{
    double best = v[0];
    int since = 0;
    for (int i = 1; i < n; i++) {
        if (higher_better ? v[i] > best : v[i] < best) {
            best = v[i];
            since = 0;
        } else if (++since >= patience) {
            return steps[i];
        }
    }
    return -1;
}

#define EARLY "run.steps=200 'run.early_stop={metric: accuracy, patience: 2}'"

Test(best, early_stop_exits_0_at_the_right_evaluation_and_resumes_alike)
{
    make_scratch();
    struct result r = amp(RUN " " EARLY " run.out_dir=%s/a", scratch);
    cr_assert_eq(r.code, 0, "an early stop is a planned end:\n%s", r.out);
    char a[600], name[128], want[256];
    path_in(a, sizeof a, "a");
    int64_t steps[64];
    double v[64];
    int n = read_evals(a, "accuracy", steps, v, 64);
    int64_t stop = expected_stop(steps, v, n, true, 2);
    cr_assert_gt(stop, 0, "the run's accuracy never stalled: the test needs it to");
    cr_assert_eq(steps[n - 1], stop, "evaluated past the stop at step %lld", (long long)stop);
    snprintf(want, sizeof want, "early stop at step %lld: accuracy did not improve on its best", (long long)stop);
    cr_assert(strstr(r.out, want), "no '%s':\n%s", want, r.out);
    cr_assert(strstr(r.out, "for 2 evaluations (run.early_stop.patience 2)"), "%s", r.out);
    read_pointer(a, "latest", name, sizeof name);
    snprintf(want, sizeof want, "ckpt-%lld.h5", (long long)stop);
    cr_assert_str_eq(name, want, "the stop writes its step's checkpoint");

    /* stopped before the early stop, then resumed: it stops at the same step, with the same weights */
    int64_t split = stop - 10;
    cr_assert_gt(split, 0);
    r = amp(RUN " " EARLY " run.steps=%lld run.out_dir=%s/b", (long long)split, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp("resume %s/b/ckpt-%lld.h5 run.steps=200", scratch, (long long)split);
    cr_assert_eq(r.code, 0, "%s", r.out);
    snprintf(want, sizeof want, "early stop at step %lld:", (long long)stop);
    cr_assert(strstr(r.out, want), "the resumed run did not stop where the straight one did:\n%s", r.out);
    char pa[800], pb[800];
    snprintf(pa, sizeof pa, "%s/a/ckpt-%lld.h5", scratch, (long long)stop);
    snprintf(pb, sizeof pb, "%s/b/ckpt-%lld.h5", scratch, (long long)stop);
    assert_same_tensors(pa, pb);
    cr_assert_eq(state_i64(pb, "early_stop_since"), 2);

    /* the stopped run's checkpoint stays stopped: resuming it trains nothing and says why */
    r = amp("resume %s run.steps=200", pa);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "early stop at step"), "%s", r.out);
    cr_assert(strstr(r.out, "train: 0 steps"), "%s", r.out);
    /* unless the patience is raised: then it trains on */
    r = amp("resume %s run.steps=%lld run.early_stop.patience=100", pa, (long long)stop + 5);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert_null(strstr(r.out, "early stop"), "%s", r.out);
    cr_assert(strstr(r.out, "train: 5 steps"), "%s", r.out);
    remove_scratch();
}

/* Data parallel: every rank gets the one evaluation's bits, so all stop at the same evaluation; exit 0, said once
 * by rank 0, and rank 0's `best` and checkpoint as in one process. */
Test(best, under_mpirun_every_rank_stops_at_the_same_evaluation)
{
    NEED_MPI();
    make_scratch();
    struct result r = mpi(2, NULL, RUN " " EARLY " run.keep_best=loss run.out_dir=%s/a", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char a[600], name[128], want[256];
    path_in(a, sizeof a, "a");
    int64_t steps[64];
    double v[64];
    int n = read_evals(a, "accuracy", steps, v, 64);
    int64_t stop = expected_stop(steps, v, n, true, 2);
    cr_assert_gt(stop, 0, "the run's accuracy never stalled: the test needs it to");
    cr_assert_eq(steps[n - 1], stop);
    snprintf(want, sizeof want, "early stop at step %lld: accuracy", (long long)stop);
    const char *said = strstr(r.out, want);
    cr_assert(said && !strstr(said + 1, want), "said %s:\n%s", said ? "twice" : "never", r.out);
    cr_assert_null(strstr(r.out, "[rank 1]"), "%s", r.out);
    read_pointer(a, "latest", name, sizeof name);
    snprintf(want, sizeof want, "ckpt-%lld.h5", (long long)stop);
    cr_assert_str_eq(name, want);
    int64_t ls[64];
    double lv[64];
    n = read_evals(a, "loss", ls, lv, 64);
    read_pointer(a, "best", name, sizeof name);
    snprintf(want, sizeof want, "ckpt-%lld.h5", (long long)best_step_of(ls, lv, n, false));
    cr_assert_str_eq(name, want);
    remove_scratch();
}

/* `best` is written as `latest` is (best.tmp, fsync, rename): a best.tmp left by a crash is removed at the next
 * start, and `best` keeps naming a checkpoint that verifies. */
Test(best, stale_best_tmp_is_cleaned)
{
    make_scratch();
    struct result r = amp(RUN " run.steps=10 run.keep_best=loss run.out_dir=%s/a", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char p[600], dir[600], name[128];
    snprintf(p, sizeof p, "%s/a/best.tmp", scratch);
    FILE *f = fopen(p, "w");
    fputs("ckpt-9", f);
    fclose(f);
    /* a resume that watches nothing writes no `best` (whose own best.tmp would replace the stale one) */
    r = amp("resume %s/a run.steps=15 run.keep_best=none", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(!file_exists(p), "stale best.tmp left behind");
    cr_assert(strstr(r.out, "removed stale"), "%s", r.out);
    path_in(dir, sizeof dir, "a");
    read_pointer(dir, "best", name, sizeof name);
    snprintf(p, sizeof p, "%s/a/%s", scratch, name);
    struct ckpt_info info;
    struct amp_error err;
    cr_assert_eq(ckpt_verify(p, &info, &err), AMP_OK, "%s", err.msg);
    remove_scratch();
}

/* A directory with a `best` holds a run: `run` refuses it, as with `latest`. */
Test(best, a_directory_with_best_holds_a_run)
{
    make_scratch();
    char p[600];
    snprintf(p, sizeof p, "%s/a", scratch);
    cr_assert_eq(mkdir(p, 0755), 0);
    snprintf(p, sizeof p, "%s/a/best", scratch);
    FILE *f = fopen(p, "w");
    fputs("ckpt-5.h5\n", f);
    fclose(f);
    struct result r = amp(RUN " run.steps=5 run.out_dir=%s/a", scratch);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "best"), "%s", r.out);
    remove_scratch();
}

static void expect_config_error(const char *override, const char *a, const char *b)
{
    struct result r = amp("check configs/fashion_mlp.yaml %s", override);
    cr_assert_eq(r.code, 2, "%s: %s", override, r.out);
    cr_assert(strstr(r.out, a) && strstr(r.out, b), "%s: %s", override, r.out);
}

Test(best, bad_values_are_config_errors)
{
    expect_config_error("run.keep_best=los", "did you mean 'loss'?", "none, loss, accuracy, perplexity");
    expect_config_error("run.keep_best=perplexity", "run.keep_best is perplexity", "text and tokens");
    expect_config_error("run.early_stop.metric=acuracy", "did you mean 'accuracy'?", "run.early_stop.metric");
    expect_config_error("run.early_stop.metric=loss", "run.early_stop.patience is not set", "hint:");
    expect_config_error("run.early_stop.patience=3", "run.early_stop.metric is not", "hint:");
    expect_config_error("run.early_stop.min_delta=-1", "run.early_stop.min_delta", ">= 0");
    expect_config_error("'run.early_stop={metric: loss, patience: 0}'", "patience is not set", "hint:");
    struct result r = amp("check configs/text_gpt.yaml run.keep_best=accuracy");
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "run.keep_best is accuracy") && strstr(r.out, "loss or perplexity"), "%s", r.out);
    r = amp("check configs/fashion_mlp.yaml run.keep_best=accuracy 'run.early_stop={metric: loss, patience: 3}'");
    cr_assert_eq(r.code, 0, "%s", r.out);
}
