/*
 * test_runlog.c — the run directory (lib/engine/runlog.h): a run writes only into a directory that holds no run, and
 * a resume only into its checkpoint's own directory or a fresh one; another run's checkpoints, `latest`,
 * config.yaml and scale_log.csv are never written over (docs/reliability.md, "No command
 * destroys a run"). End to end through the binary.
 */
#define _POSIX_C_SOURCE 200809L
#include "ckpt_testlib.h"

TestSuite(rundir, .init = make_scratch, .fini = remove_scratch);

/* The whole content of a file, for comparing before and after (a static buffer per slot). */
static const char *slurp(const char *path, int slot)
{
    static char buf[4][1 << 20];
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s", path);
    size_t n = fread(buf[slot], 1, sizeof buf[slot] - 1, f);
    buf[slot][n] = '\0';
    cr_assert(feof(f), "%s is larger than the test's buffer", path);
    fclose(f);
    return buf[slot];
}

static long long file_bytes_crc(const char *path)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s", path);
    unsigned char b[65536];
    uLong crc = crc32(0, NULL, 0);
    size_t n;
    long long total = 0;
    while ((n = fread(b, 1, sizeof b, f)) > 0) {
        crc = crc32(crc, b, (uInt)n);
        total += (long long)n;
    }
    fclose(f);
    return (long long)crc ^ (total << 32);
}

Test(rundir, resume_into_another_runs_directory_is_refused_and_changes_nothing)
{
    /* Before the fix: exit 0, B's ckpt-4.h5 replaced by A's weights, B's latest and config.yaml A's. */
    struct result r = amp("run configs/fashion_mlp.yaml " SMALL " run.steps=2 run.ckpt_every=1 run.out_dir=%s/A",
                          scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp("run configs/fashion_mlp.yaml " SMALL " run.steps=4 run.ckpt_every=1 run.seed=7 run.out_dir=%s/B",
            scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    const char *names[] = {"latest", "config.yaml", "scale_log.csv", "ckpt-3.h5", "ckpt-4.h5"};
    long long before[5];
    char p[1200];
    for (int i = 0; i < 5; i++) {
        snprintf(p, sizeof p, "%s/B/%s", scratch, names[i]);
        before[i] = file_bytes_crc(p);
    }
    r = amp("resume %s/A/ckpt-1.h5 run.steps=4 run.out_dir=%s/B", scratch, scratch);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "holds another run") && strstr(r.out, "/B'") && strstr(r.out, "hint:"), "%s", r.out);
    for (int i = 0; i < 5; i++) {
        snprintf(p, sizeof p, "%s/B/%s", scratch, names[i]);
        cr_assert_eq(file_bytes_crc(p), before[i], "B/%s changed", names[i]);
    }
    /* The same through B's own path spelled otherwise (a symlink) is still another run. */
    snprintf(p, sizeof p, "ln -s %s/B %s/B-link", scratch, scratch);
    cr_assert_eq(system(p), 0);
    r = amp("resume %s/A/ckpt-1.h5 run.steps=4 run.out_dir=%s/B-link", scratch, scratch);
    cr_assert_eq(r.code, 2, "%s", r.out);
    /* A directory that holds only a checkpoint or only `latest` holds a run too. */
    snprintf(p, sizeof p, "mkdir %s/C && cp %s/B/ckpt-4.h5 %s/C/", scratch, scratch, scratch);
    cr_assert_eq(system(p), 0);
    r = amp("resume %s/A/ckpt-1.h5 run.steps=4 run.out_dir=%s/C", scratch, scratch);
    cr_assert_eq(r.code, 2, "%s", r.out);
    r = amp("run configs/fashion_mlp.yaml " SMALL " run.steps=1 run.out_dir=%s/C", scratch);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "already holds a run") && strstr(r.out, "ckpt-4.h5"), "%s", r.out);
}

Test(rundir, resume_continues_its_own_directory_or_starts_a_fresh_one)
{
    struct result r = amp("run configs/fashion_mlp.yaml " SMALL " run.steps=2 run.ckpt_every=1 run.out_dir=%s/A",
                          scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    /* Its own directory, named through a symlink: appended to. */
    char p[1200];
    snprintf(p, sizeof p, "ln -s %s/A %s/A-link", scratch, scratch);
    cr_assert_eq(system(p), 0);
    r = amp("resume %s/A-link/ckpt-2.h5 run.steps=3 run.out_dir=%s/A", scratch, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    snprintf(p, sizeof p, "%s/A/scale_log.csv", scratch);
    const char *log = slurp(p, 0);
    cr_assert(strstr(log, "\n1,") && strstr(log, "\n2,") && strstr(log, "\n3,"), "%s", log);
    cr_assert_eq(strstr(log + 1, "step,epoch"), NULL, "a second header: %s", log);
    /* An empty directory, and one that does not exist yet: a fresh log with its header. */
    snprintf(p, sizeof p, "mkdir %s/E", scratch);
    cr_assert_eq(system(p), 0);
    const char *dirs[] = {"E", "new/deeper"};
    for (int i = 0; i < 2; i++) {
        r = amp("resume %s/A/ckpt-2.h5 run.steps=3 run.out_dir=%s/%s", scratch, scratch, dirs[i]);
        cr_assert_eq(r.code, 0, "%s: %s", dirs[i], r.out);
        snprintf(p, sizeof p, "%s/%s/scale_log.csv", scratch, dirs[i]);
        log = slurp(p, 1);
        cr_assert(strncmp(log, "step,epoch", 10) == 0 && strstr(log, "\n3,") && !strstr(log, "\n2,"), "%s", log);
    }
}
