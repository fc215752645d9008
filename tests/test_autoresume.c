/*
 * test_autoresume.c — `run.resume: auto` (docs/checkpoint.md, "Restarts"): the same `ampTrain run` command, run
 * again after the job was killed, continues from the newest checkpoint that verifies and ends bit for bit where an
 * uninterrupted run ends, on one rank and under mpirun with a rank killed; a changed key is refused naming it,
 * with nothing written; a corrupt `latest` target is passed over, saying so; a fresh directory starts; a complete
 * run trains nothing.
 */
#define _POSIX_C_SOURCE 200809L
#include "disttest.h" /* mpi, NEED_MPI, MPI_ENV; and ckpt_testlib.h: scratch, amp, assert_same_tensors */

#include <time.h>

/* Long enough that a kill after the first checkpoint lands mid-run (280 steps and 14 checkpoints after it, over
 * half a second even in the release build), short enough for a test. */
#define LONG_RUN                                                                                                     \
    "configs/fashion_mlp.yaml model.layers.1.out=256 model.layers.3.out=256 data.batch_size=64 run.device=cpu "     \
    "run.log_every=10 run.steps=300 run.ckpt_every=20 run.resume=auto"
#define LAST "ckpt-300.h5"

#define AUTO SMALL " run.steps=12 run.ckpt_every=4 run.resume=auto"

/* The file DIR/latest names ("" when none). */
static void read_latest(const char *dir, char *name, size_t len)
{
    char path[600];
    snprintf(path, sizeof path, "%s/latest", dir);
    name[0] = '\0';
    FILE *f = fopen(path, "r");
    if (f) {
        if (!fgets(name, (int)len, f))
            name[0] = '\0';
        fclose(f);
    }
    name[strcspn(name, "\n")] = '\0';
}

/* Start `launcher ampTrain run LONG_RUN run.out_dir=scratch/b` in the background, wait for its first checkpoint,
 * SIGKILL the newest rank process (the only one without a launcher), and wait for the job to end. */
static void kill_mid_run(const char *launcher)
{
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "cd %s && { " MPI_ENV "timeout -s KILL 200 %s %s run " LONG_RUN " run.out_dir=%s/b > %s/b.out 2>&1; "
             "echo $? > %s/b.rc; } > /dev/null 2>&1 &",
             AMP_SOURCE_DIR, launcher, amp_binary(), scratch, scratch, scratch);
    cr_assert_eq(system(cmd), 0);
    char dir[512], name[128] = "";
    snprintf(dir, sizeof dir, "%s/b", scratch);
    for (int i = 0; i < 3000 && !name[0]; i++) {
        read_latest(dir, name, sizeof name);
        if (!name[0])
            nanosleep(&(struct timespec){.tv_nsec = 10 * 1000 * 1000}, NULL);
    }
    cr_assert(name[0], "no checkpoint within 30 s");
    snprintf(cmd, sizeof cmd, "pkill -KILL -n -f '^%s run configs/fashion_mlp.yaml.*%s/b'", amp_binary(), scratch);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    snprintf(cmd, sizeof cmd, "for i in $(seq 600); do [ -s %s/b.rc ] && break; sleep 0.1; done; cat %s/b.rc",
             scratch, scratch);
    struct result r = shell(cmd);
    cr_assert(r.out[0], "the job still runs 60 s after a rank was killed");
    cr_assert_neq(atoi(r.out), 0, "the killed job exited 0");
    snprintf(cmd, sizeof cmd, "%s/b/" LAST, scratch);
    cr_assert(!file_exists(cmd), "the kill came after the end; make the run longer");
}

/* The killed run's command again, then an uninterrupted one into scratch/a: the final checkpoints are the same. */
static void rerun_and_compare(const char *launcher, int np)
{
    struct result r = np > 1 ? mpi(np, "", "run " LONG_RUN " run.out_dir=%s/b", scratch)
                             : amp("run " LONG_RUN " run.out_dir=%s/b", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "run.resume auto: continuing the run in") && strstr(r.out, "resumed from"), "%s", r.out);
    r = np > 1 ? mpi(np, "", "run " LONG_RUN " run.out_dir=%s/a", scratch)
               : amp("run " LONG_RUN " run.out_dir=%s/a", scratch);
    cr_assert_eq(r.code, 0, "%s%s", launcher, r.out);
    char a[512], b[512];
    snprintf(a, sizeof a, "%s/a/" LAST, scratch);
    snprintf(b, sizeof b, "%s/b/" LAST, scratch);
    int n = assert_same_tensors(a, b);
    cr_assert_geq(n, 6, "only %d tensors compared", n);
}

Test(autoresume, sigkill_then_the_same_command_equals_an_uninterrupted_run)
{
    make_scratch();
    kill_mid_run("");
    rerun_and_compare("", 1);
    remove_scratch();
}

Test(autoresume, a_rank_killed_under_mpirun_then_the_same_command_equals_an_uninterrupted_run)
{
    NEED_MPI();
    make_scratch();
    kill_mid_run("mpirun -np 2 --oversubscribe --bind-to none");
    rerun_and_compare("mpirun -np 2: ", 2);
    remove_scratch();
}

/* A key resume may not change: exit 2 naming it and both values, and the directory as it was. */
Test(autoresume, a_changed_key_is_refused_naming_it_and_nothing_is_written)
{
    make_scratch();
    struct result r = amp("run configs/fashion_mlp.yaml " AUTO " run.out_dir=%s/c", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char before[1024];
    snprintf(before, sizeof before, "cd %s/c && ls -l --time-style=+%%s.%%N && cat latest scale_log.csv | md5sum",
             scratch);
    struct result listing = shell(before);
    char *was = strdup(listing.out);
    r = amp("run configs/fashion_mlp.yaml " AUTO " optim.lr=0.5 run.steps=16 run.out_dir=%s/c", scratch);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "optim.lr is 0.001 in") && strstr(r.out, "ckpt-12.h5 but 0.5 here"), "%s", r.out);
    cr_assert(strstr(r.out, "nothing was written"), "%s", r.out);
    listing = shell(before);
    cr_assert_str_eq(listing.out, was, "the directory changed");
    free(was);
    /* a key resume may change is no difference: the run continues with it */
    r = amp("run configs/fashion_mlp.yaml " AUTO " run.steps=16 run.out_dir=%s/c", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "resumed from") && strstr(r.out, "ckpt-16.h5"), "%s", r.out);
    remove_scratch();
}

/* `latest` names a damaged file: the previous checkpoint that verifies is continued from, the warning names the
 * one passed over, and the run still ends where an undamaged one does. */
Test(autoresume, a_corrupt_latest_target_falls_back_to_the_previous_checkpoint)
{
    make_scratch();
    struct result r = amp("run configs/fashion_mlp.yaml " AUTO " run.steps=8 run.out_dir=%s/d", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char path[512];
    snprintf(path, sizeof path, "%s/d/ckpt-8.h5", scratch);
    flip_bit(path, file_size(path) / 2, 3);
    r = amp("run configs/fashion_mlp.yaml " AUTO " run.out_dir=%s/d", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "skipping") && strstr(r.out, "ckpt-8.h5"), "%s", r.out);
    cr_assert(strstr(r.out, "resumed from") && strstr(r.out, "ckpt-4.h5 at step 4"), "%s", r.out);
    r = amp("run configs/fashion_mlp.yaml " AUTO " run.out_dir=%s/a", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char a[512], b[512];
    snprintf(a, sizeof a, "%s/a/ckpt-12.h5", scratch);
    snprintf(b, sizeof b, "%s/d/ckpt-12.h5", scratch);
    cr_assert_geq(assert_same_tensors(a, b), 6);
    remove_scratch();
}

/* No checkpoint verifies: exit 4 naming each, nothing trained. */
Test(autoresume, no_verified_checkpoint_is_exit_4_naming_each)
{
    make_scratch();
    struct result r = amp("run configs/fashion_mlp.yaml " AUTO " run.steps=8 run.out_dir=%s/v", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char path[512];
    for (int step = 4; step <= 8; step += 4) {
        snprintf(path, sizeof path, "%s/v/ckpt-%d.h5", scratch, step);
        flip_bit(path, file_size(path) / 2, 3);
    }
    r = amp("run configs/fashion_mlp.yaml " AUTO " run.steps=8 run.out_dir=%s/v", scratch);
    cr_assert_eq(r.code, 4, "%s", r.out);
    cr_assert(strstr(r.out, "skipping") && strstr(r.out, "ckpt-8.h5") && strstr(r.out, "ckpt-4.h5"), "%s", r.out);
    cr_assert(strstr(r.out, "no checkpoint in") && !strstr(r.out, "resumed from"), "%s", r.out);
    remove_scratch();
}

Test(autoresume, auto_on_a_fresh_directory_starts)
{
    make_scratch();
    char empty[512];
    snprintf(empty, sizeof empty, "%s/e", scratch);
    cr_assert_eq(mkdir(empty, 0755), 0);
    struct result r = amp("run configs/fashion_mlp.yaml " AUTO " run.out_dir=%s/e", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(!strstr(r.out, "resumed from") && strstr(r.out, "checkpoint: ") && strstr(r.out, "ckpt-12.h5"), "%s",
              r.out);
    r = amp("run configs/fashion_mlp.yaml " AUTO " run.out_dir=%s/absent/f", scratch); /* absent: made */
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "ckpt-12.h5") && !strstr(r.out, "resumed from"), "%s", r.out);
    remove_scratch();
}

Test(autoresume, a_complete_run_says_so_and_trains_nothing)
{
    make_scratch();
    struct result r = amp("run configs/fashion_mlp.yaml " AUTO " run.out_dir=%s/g", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char before[1024];
    snprintf(before, sizeof before, "cd %s/g && ls -l --time-style=+%%s.%%N && cat * | md5sum", scratch);
    struct result listing = shell(before);
    char *was = strdup(listing.out);
    r = amp("run configs/fashion_mlp.yaml " AUTO " run.out_dir=%s/g", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "is complete") && strstr(r.out, "ckpt-12.h5 is at step 12"), "%s", r.out);
    cr_assert(!strstr(r.out, "train:") && !strstr(r.out, "eval step"), "%s", r.out);
    listing = shell(before);
    cr_assert_str_eq(listing.out, was, "the directory changed");
    free(was);
    remove_scratch();
}

/* Killed before its first checkpoint: nothing to continue, and starting again would replace its logs. */
Test(autoresume, a_run_without_a_checkpoint_is_refused_not_replaced)
{
    make_scratch();
    char dir[512], log[600];
    snprintf(dir, sizeof dir, "%s/h", scratch);
    cr_assert_eq(mkdir(dir, 0755), 0);
    snprintf(log, sizeof log, "%s/scale_log.csv", dir);
    FILE *f = fopen(log, "w");
    cr_assert_not_null(f);
    fputs("step\n1\n", f);
    fclose(f);
    struct result r = amp("run configs/fashion_mlp.yaml " AUTO " run.out_dir=%s", dir);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "holds a run but no checkpoint") && strstr(r.out, dir), "%s", r.out);
    cr_assert_eq(file_size(log), 7, "the log was replaced");
    remove_scratch();
}

/* run.resume never (the default) keeps refusing a directory that holds a run. */
Test(autoresume, never_refuses_a_directory_that_holds_a_run)
{
    make_scratch();
    struct result r = amp("run configs/fashion_mlp.yaml " SMALL " run.steps=4 run.out_dir=%s/n", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp("run configs/fashion_mlp.yaml " SMALL " run.steps=4 run.out_dir=%s/n", scratch);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(!strstr(r.out, "resumed from"), "%s", r.out);
    remove_scratch();
}
