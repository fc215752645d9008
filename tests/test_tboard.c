/*
 * test_tboard.c — TensorBoard event files (lib/engine/tboard.h, run.tensorboard): CRC-32C against its standard check
 * values, records read back by a small reader here (framing, CRCs, the Event fields), a full disk cut back to
 * whole records, and end to end: the event files of real runs read with the `tensorboard` package by
 * scripts/ref/tb_check.py, whose every scalar must equal scale_log.csv's and eval.jsonl's (a plain run, fp16 with
 * skipped steps, a token model's tokens_per_s, a run killed with kill -9, resumes), run.tensorboard: false,
 * and the event file counted as a run file.
 */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <math.h>
#include <signal.h>
#include <sys/resource.h>
#include <time.h>

#include "ckpt_testlib.h" /* scratch, SMALL, amp */
#include "tboard.h"       /* the writer under test */

/* ---- a reader: TFRecord framing and the Event fields the writer uses ---------------------------- */

struct event {
    double wall_time;
    int64_t step;
    char file_version[32];
    int session_status;  /* SessionLog.status (1: START), 0 when none */
    char tag[64];
    bool has_value;
    float value;
    char plugin[16];     /* metadata.plugin_data.plugin_name */
    int dtype;           /* the tensor's dtype (7: DT_STRING) */
    char text[256];      /* the tensor's string_val */
};

struct cursor {
    const uint8_t *p, *end;
    bool bad;
};

static uint64_t get_varint(struct cursor *c)
{
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (c->p >= c->end) {
            c->bad = true;
            return 0;
        }
        uint8_t b = *c->p++;
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80))
            return v;
    }
    c->bad = true;
    return 0;
}

static uint64_t get_le(struct cursor *c, int n)
{
    uint64_t v = 0;
    if (c->end - c->p < n) {
        c->bad = true;
        return 0;
    }
    for (int i = 0; i < n; i++)
        v |= (uint64_t)c->p[i] << (8 * i);
    c->p += n;
    return v;
}

/* The next field: its number, and for a length-delimited one a cursor over its bytes. */
static unsigned next_field(struct cursor *c, struct cursor *sub, uint64_t *scalar)
{
    uint64_t key = get_varint(c);
    unsigned wt = key & 7;
    if (wt == 0)
        *scalar = get_varint(c);
    else if (wt == 1)
        *scalar = get_le(c, 8);
    else if (wt == 5)
        *scalar = get_le(c, 4);
    else if (wt == 2) {
        uint64_t n = get_varint(c);
        if ((uint64_t)(c->end - c->p) < n)
            c->bad = true;
        else {
            *sub = (struct cursor){c->p, c->p + n, false};
            c->p += n;
        }
    } else
        c->bad = true;
    return (unsigned)(key >> 3);
}

static void copy_text(char *dst, size_t len, const struct cursor *s)
{
    size_t n = (size_t)(s->end - s->p) < len - 1 ? (size_t)(s->end - s->p) : len - 1;
    memcpy(dst, s->p, n);
    dst[n] = '\0';
}

static void parse_value(struct cursor c, struct event *e)
{
    while (c.p < c.end && !c.bad) {
        struct cursor s = {0};
        uint64_t v = 0;
        unsigned f = next_field(&c, &s, &v);
        if (f == 1)
            copy_text(e->tag, sizeof e->tag, &s);
        if (f == 2) {
            uint32_t bits = (uint32_t)v;
            memcpy(&e->value, &bits, sizeof bits);
            e->has_value = true;
        }
        while (f == 8 && s.p < s.end && !s.bad) { /* TensorProto */
            struct cursor t = {0};
            uint64_t w = 0;
            unsigned g = next_field(&s, &t, &w);
            if (g == 1)
                e->dtype = (int)w;
            if (g == 8)
                copy_text(e->text, sizeof e->text, &t);
        }
        if (f == 9) { /* SummaryMetadata { plugin_data { plugin_name } } */
            struct cursor pd = {0}, name = {0};
            uint64_t w = 0;
            if (next_field(&s, &pd, &w) == 1 && next_field(&pd, &name, &w) == 1)
                copy_text(e->plugin, sizeof e->plugin, &name);
        }
    }
}

static bool parse_event(const uint8_t *p, size_t n, struct event *e)
{
    memset(e, 0, sizeof *e);
    struct cursor c = {p, p + n, false};
    while (c.p < c.end && !c.bad) {
        struct cursor s = {0};
        uint64_t v = 0;
        unsigned f = next_field(&c, &s, &v);
        if (f == 1)
            memcpy(&e->wall_time, &v, sizeof v);
        else if (f == 2)
            e->step = (int64_t)v;
        else if (f == 3)
            copy_text(e->file_version, sizeof e->file_version, &s);
        else if (f == 5) { /* Summary { Value value = 1 } */
            struct cursor val = {0};
            uint64_t w = 0;
            if (next_field(&s, &val, &w) == 1)
                parse_value(val, e);
        } else if (f == 7) {
            struct cursor none;
            uint64_t w = 0;
            if (next_field(&s, &none, &w) == 1)
                e->session_status = (int)w;
        }
    }
    return !c.bad;
}

/* Read every whole record of `path` into ev (at most max); *trailing gets the bytes after the last whole one.
 * Each record's length and data CRCs must hold. */
static int read_events(const char *path, struct event *ev, int max, size_t *trailing)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s", path);
    static uint8_t buf[1 << 20];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    size_t at = 0;
    int count = 0;
    while (at + 12 <= n) {
        uint64_t len = 0;
        for (int i = 0; i < 8; i++)
            len |= (uint64_t)buf[at + i] << (8 * i);
        uint32_t len_crc = (uint32_t)buf[at + 8] | (uint32_t)buf[at + 9] << 8 | (uint32_t)buf[at + 10] << 16 |
                           (uint32_t)buf[at + 11] << 24;
        cr_assert_eq(len_crc, tboard_mask_crc(tboard_crc32c(buf + at, 8)), "%s: record %d: length CRC", path, count);
        if (at + 16 + len > n)
            break;
        const uint8_t *d = buf + at + 12, *t = d + len;
        uint32_t data_crc = (uint32_t)t[0] | (uint32_t)t[1] << 8 | (uint32_t)t[2] << 16 | (uint32_t)t[3] << 24;
        cr_assert_eq(data_crc, tboard_mask_crc(tboard_crc32c(d, len)), "%s: record %d: data CRC", path, count);
        cr_assert_lt(count, max);
        cr_assert(parse_event(d, len, &ev[count]), "%s: record %d is not an Event", path, count);
        count++;
        at += 16 + len;
    }
    *trailing = n - at;
    return count;
}

/* The event files in `dir`, sorted by name; returns how many (at most 8). */
static int event_files(const char *dir, char names[8][512])
{
    DIR *d = opendir(dir);
    cr_assert_not_null(d, "%s", dir);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (!strncmp(e->d_name, TBOARD_PREFIX, strlen(TBOARD_PREFIX)) && n < 8)
            snprintf(names[n++], 512, "%s/%s", dir, e->d_name);
    closedir(d);
    qsort(names, (size_t)n, 512, (int (*)(const void *, const void *))strcmp);
    return n;
}

/* ---- the writer ---------------------------------------------------------------------------------- */

TestSuite(tboard, .init = make_scratch, .fini = remove_scratch);

Test(tboard, crc32c_matches_its_check_values_and_the_tfrecord_mask)
{
    cr_assert_eq(tboard_crc32c("123456789", 9), 0xe3069283u);
    cr_assert_eq(tboard_crc32c("", 0), 0u);
    uint8_t zeros[32] = {0}, ones[32];
    memset(ones, 0xff, sizeof ones);
    cr_assert_eq(tboard_crc32c(zeros, 32), 0x8a9136aau); /* RFC 3720, B.4 */
    cr_assert_eq(tboard_crc32c(ones, 32), 0x62a8ab43u);
    cr_assert_eq(tboard_mask_crc(0xe3069283u), 0xc78ab0e5u); /* ((c >> 15) | (c << 17)) + 0xa282ead8 */
    cr_assert_eq(tboard_mask_crc(0), 0xa282ead8u);
}

Test(tboard, records_read_back_whole_with_every_field)
{
    struct tboard *w;
    struct amp_error err = {0};
    cr_assert_eq(tboard_open(&w, scratch, 7, &err), AMP_OK, "%s", err.msg);
    char path[4096];
    snprintf(path, sizeof path, "%s", tboard_path(w));
    const char *base = strrchr(path, '/') + 1;
    char host[256] = "";
    gethostname(host, sizeof host);
    char want[600];
    snprintf(want, sizeof want, ".%s.%ld", host, (long)getpid());
    cr_assert(!strncmp(base, "events.out.tfevents.", 20) && strtoll(base + 20, NULL, 10) > 1700000000 &&
                  strstr(base, want), "%s", base);
    double values[] = {2.3495155349373817, 65536, 1e-45, -0.0, INFINITY, NAN, 1e300};
    for (int i = 0; i < 7; i++)
        tboard_scalar(w, 7 + i, i % 2 ? "train/loss" : "eval/accuracy", values[i]);
    tboard_text(w, 13, "samples", "once upon a time\n\xc3\xbc");
    double t0 = (double)time(NULL);
    cr_assert_eq(tboard_close(w, &err), AMP_OK, "%s", err.msg);

    struct event ev[16];
    size_t trailing;
    int n = read_events(path, ev, 16, &trailing);
    cr_assert_eq(n, 10, "file_version, SessionLog START, 7 scalars, 1 text: %d", n);
    cr_assert_eq(trailing, 0u);
    cr_assert_str_eq(ev[0].file_version, "brain.Event:2");
    cr_assert_eq(ev[1].session_status, 1);
    cr_assert_eq(ev[1].step, 7);
    for (int i = 0; i < 7; i++) {
        struct event *e = &ev[2 + i];
        cr_assert_eq(e->step, 7 + i);
        cr_assert_str_eq(e->tag, i % 2 ? "train/loss" : "eval/accuracy");
        cr_assert(e->has_value);
        float f = (float)values[i];
        cr_assert(memcmp(&e->value, &f, sizeof f) == 0 || (isnan(f) && isnan(e->value)), "value %d: %g", i,
                  (double)e->value);
        cr_assert(fabs(e->wall_time - t0) < 5, "wall_time %f", e->wall_time);
    }
    cr_assert_str_eq(ev[9].tag, "samples");
    cr_assert_str_eq(ev[9].plugin, "text");
    cr_assert_eq(ev[9].dtype, 7);
    cr_assert_str_eq(ev[9].text, "once upon a time\n\xc3\xbc");
    cr_assert_not(ev[9].has_value);
}

Test(tboard, a_second_writer_gets_a_new_file_that_sorts_after_the_first)
{
    struct tboard *a, *b;
    struct amp_error err = {0};
    cr_assert_eq(tboard_open(&a, scratch, 0, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(tboard_open(&b, scratch, 0, &err), AMP_OK, "%s", err.msg);
    cr_assert_str_neq(tboard_path(a), tboard_path(b));
    cr_assert_lt(strcmp(tboard_path(a), tboard_path(b)), 0, "%s then %s", tboard_path(a), tboard_path(b));
    cr_assert_eq(tboard_close(a, &err), AMP_OK);
    cr_assert_eq(tboard_close(b, &err), AMP_OK);
    char names[8][512];
    cr_assert_eq(event_files(scratch, names), 2);
}

Test(tboard, nothing_reaches_the_file_before_a_flush_and_all_of_it_after)
{
    struct tboard *w;
    struct amp_error err = {0};
    cr_assert_eq(tboard_open(&w, scratch, 0, &err), AMP_OK, "%s", err.msg);
    struct event ev[64];
    size_t trailing;
    for (int i = 1; i <= 40; i++)
        tboard_scalar(w, i, "train/loss", i);
    cr_assert_eq(read_events(tboard_path(w), ev, 64, &trailing), 2, "only the header events before the flush");
    cr_assert_eq(tboard_flush(w, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(read_events(tboard_path(w), ev, 64, &trailing), 42);
    cr_assert_eq(trailing, 0u);
    cr_assert_eq(ev[41].step, 40);
    cr_assert_eq(tboard_close(w, &err), AMP_OK);
}

/* A full disk (a file-size limit in a forked child, SIGXFSZ ignored): the flush fails naming the file, and the
 * file holds only whole records; later flushes fail too. Exit codes of the child say which check failed. */
Test(tboard, a_full_disk_is_an_error_naming_the_file_and_leaves_whole_records)
{
    char limit_path[600];
    snprintf(limit_path, sizeof limit_path, "%s/path", scratch);
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        signal(SIGXFSZ, SIG_IGN);
        struct rlimit rl = {.rlim_cur = 1000, .rlim_max = 1000};
        struct tboard *w;
        struct amp_error err = {0};
        if (setrlimit(RLIMIT_FSIZE, &rl) != 0 || tboard_open(&w, scratch, 0, &err) != AMP_OK)
            _exit(10);
        FILE *f = fopen(limit_path, "w"); /* under the limit: a few bytes */
        fprintf(f, "%s", tboard_path(w));
        fclose(f);
        for (int i = 1; i <= 100; i++)
            tboard_scalar(w, i, "train/loss", i);
        if (tboard_flush(w, &err) != AMP_ERR_INTERNAL)
            _exit(11);
        if (!strstr(err.msg, tboard_path(w)) || !strstr(err.msg, "File too large") || !strstr(err.hint, "disk"))
            _exit(12);
        tboard_scalar(w, 101, "train/loss", 101);
        if (tboard_flush(w, &err) != AMP_ERR_INTERNAL || tboard_close(w, &err) != AMP_ERR_INTERNAL)
            _exit(13);
        _exit(0);
    }
    int status;
    waitpid(pid, &status, 0);
    cr_assert(WIFEXITED(status), "the child crashed");
    cr_assert_eq(WEXITSTATUS(status), 0, "child check %d failed", WEXITSTATUS(status));
    char path[4096] = "";
    FILE *f = fopen(limit_path, "r");
    cr_assert_not_null(f);
    cr_assert_not_null(fgets(path, sizeof path, f));
    fclose(f);
    struct event ev[128];
    size_t trailing;
    int n = read_events(path, ev, 128, &trailing);
    cr_assert_eq(trailing, 0u, "a partial record was left at the end");
    cr_assert(n > 2 && n < 102, "%d records", n);
    cr_assert_eq(ev[n - 1].step, n - 2, "the records are the first steps, in order");
}

/* The text plugin's form as tensorboard's own reader takes it: tensorboard's EventAccumulator gives the bytes. */
Test(tboard, text_summaries_read_back_with_the_tensorboard_package)
{
    if (system("/usr/bin/python3 -c 'import tensorboard' >/dev/null 2>&1") != 0)
        cr_skip_test("/usr/bin/python3 lacks tensorboard (scripts/install-deps.sh --test)");
    struct tboard *w;
    struct amp_error err = {0};
    cr_assert_eq(tboard_open(&w, scratch, 0, &err), AMP_OK, "%s", err.msg);
    tboard_text(w, 5, "samples", "The fox \xc3\xbc");
    tboard_scalar(w, 5, "train/loss", 1.5);
    tboard_text(w, 10, "samples", "two\nlines, \"quoted\"");
    cr_assert_eq(tboard_close(w, &err), AMP_OK, "%s", err.msg);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/scripts/ref/tb_check.py --text %s samples", AMP_SOURCE_DIR, scratch);
    struct result r = shell(cmd);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert_str_eq(r.out, "[[5, \"The fox \xc3\xbc\"], [10, \"two\\nlines, \\\"quoted\\\"\"]]\n");
}

/* ---- runs ---------------------------------------------------------------------------------------- */

TestSuite(tboard_run, .init = make_scratch, .fini = remove_scratch);

static void need_tensorboard(void)
{
    if (system("/usr/bin/python3 -c 'import tensorboard, yaml' >/dev/null 2>&1") != 0)
        cr_skip_test("/usr/bin/python3 lacks tensorboard or yaml (scripts/install-deps.sh --test)");
}

/* scripts/ref/tb_check.py DIR ARGS: exit code and output. */
static struct result tb_check(const char *dir, const char *args)
{
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/scripts/ref/tb_check.py %s %s 2>&1", AMP_SOURCE_DIR, dir, args);
    return shell(cmd);
}

Test(tboard_run, every_scalar_equals_scale_log_csv_and_eval_jsonl)
{
    need_tensorboard();
    struct result r = amp("run configs/fashion_mlp.yaml " SMALL " run.steps=30 run.log_every=7 run.eval_every=10 "
                          "run.out_dir=%s/a", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char dir[600];
    snprintf(dir, sizeof dir, "%s/a", scratch);
    r = tb_check(dir, "--files 1");
    cr_assert_eq(r.code, 0, "%s", r.out);
    /* 30 steps x 10 train scalars + eval loss and accuracy at steps 10, 20, 30 */
    cr_assert(strstr(r.out, "306 scalars in 1 event file(s)"), "%s", r.out);
}

/* fp16 with a loss scale that overflows: skipped steps (found_inf, lr 0, a falling scale), grad_zero_frac on the
 * sampled steps. */
Test(tboard_run, skipped_steps_and_grad_zero_frac_equal_the_csv)
{
    need_tensorboard();
    struct result r = amp("run configs/fashion_mlp_fp16_dynamic.yaml " SMALL " run.steps=20 run.log_every=4 "
                          "precision.loss_scale.init=1073741824 precision.loss_scale.max=1073741824 "
                          "run.out_dir=%s/f", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "skipped"), "the run skipped no step:\n%s", r.out);
    char dir[600];
    snprintf(dir, sizeof dir, "%s/f", scratch);
    r = tb_check(dir, "");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "207 scalars"), "20 x 10 + 5 grad_zero_frac + eval loss, accuracy:\n%s", r.out);
}

Test(tboard_run, a_token_model_logs_tokens_per_s_and_perplexity)
{
    need_tensorboard();
    struct result r = amp("run configs/text_gpt.yaml run.device=cpu run.steps=4 run.log_every=2 run.eval_every=0 "
                          "data.val_fraction=0.02 run.out_dir=%s/t", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char dir[600];
    snprintf(dir, sizeof dir, "%s/t", scratch);
    r = tb_check(dir, "");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "46 scalars"), "4 x (10 + tokens_per_s) + eval loss, perplexity:\n%s", r.out);
}

/* kill -9 mid-run (no evaluation, whose writes would flush too): the event file reads, every record whole, each
 * scalar equal to its CSV row, and it lacks at most the last log window's steps (3), which the CSV may have
 * reached the disk with just before the kill. */
Test(tboard_run, a_run_killed_with_kill_9_leaves_a_readable_file)
{
    need_tensorboard();
    char dir[600], cmd[2048];
    snprintf(dir, sizeof dir, "%s/k", scratch);
    snprintf(cmd, sizeof cmd,
             "cd %s && exec %s run configs/fashion_mlp.yaml " SMALL " run.steps=1000000 run.log_every=3 "
             "run.out_dir=%s >/dev/null 2>&1", AMP_SOURCE_DIR, amp_binary(), dir);
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    char csv[700];
    snprintf(csv, sizeof csv, "%s/scale_log.csv", dir);
    struct stat sb = {0};
    for (int i = 0; i < 3000 && (stat(csv, &sb) != 0 || sb.st_size < 20000); i++)
        nanosleep(&(struct timespec){.tv_nsec = 10 * 1000 * 1000}, NULL);
    nanosleep(&(struct timespec){.tv_nsec = 7 * 1000 * 1000}, NULL);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    cr_assert_geq(sb.st_size, 20000, "fewer than about 250 steps in 30 s");
    char names[8][512];
    cr_assert_eq(event_files(dir, names), 1);
    struct result r = tb_check(dir, "--killed");
    cr_assert_eq(r.code, 0, "%s", r.out);
    long long scalars = 0, unflushed = -1;
    const char *at = strstr(r.out, "/k: ");
    cr_assert(at && sscanf(at + 4, "%lld scalars in 1 event file(s) equal the run's logs; %lld steps", &scalars,
                           &unflushed) == 2, "%s", r.out);
    cr_assert_gt(scalars, 2000, "the killed run's scalars up to its last flush:\n%s", r.out);
    cr_assert_leq(unflushed, 3, "%s", r.out);
}

/* A resume writes a second event file; its steps continue the first's. Resumed from a middle checkpoint of a
 * finished run, the steps it trains again replace the first file's in TensorBoard (SessionLog START). */
Test(tboard_run, a_resume_adds_an_event_file_and_its_steps_continue)
{
    need_tensorboard();
    struct result r = amp("run configs/fashion_mlp.yaml " SMALL " run.steps=20 run.log_every=5 run.ckpt_every=10 "
                          "run.keep_ckpts=5 run.out_dir=%s/r", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp("resume %s/r/ckpt-20.h5 run.steps=30", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char dir[600];
    snprintf(dir, sizeof dir, "%s/r", scratch);
    r = tb_check(dir, "--files 2");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "304 scalars in 2 event file(s)"), "30 x 10 + eval at 20 and 30:\n%s", r.out);
    char names[8][512];
    cr_assert_eq(event_files(dir, names), 2);
    struct event ev[512];
    size_t trailing;
    int n = read_events(names[1], ev, 512, &trailing);
    cr_assert_eq(ev[1].session_status, 1);
    cr_assert_eq(ev[1].step, 21, "the second file starts where the checkpoint ends");
    cr_assert_eq(ev[2].step, 21);
    cr_assert_eq(ev[n - 1].step, 30);

    r = amp("resume %s/r/ckpt-10.h5 run.steps=30", scratch); /* trains 11..30 again */
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = tb_check(dir, "--files 3");
    cr_assert_eq(r.code, 0, "steps 11 and on appear once, the last run's:\n%s", r.out);
}

Test(tboard_run, tensorboard_false_writes_no_event_file)
{
    struct result r = amp("run configs/fashion_mlp.yaml " SMALL " run.steps=3 run.tensorboard=false "
                          "run.out_dir=%s/n", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char dir[600], names[8][512];
    snprintf(dir, sizeof dir, "%s/n", scratch);
    cr_assert_eq(event_files(dir, names), 0);
    path_in(dir, sizeof dir, "n/scale_log.csv");
    cr_assert(file_exists(dir));
}

/* The event file is a run file: a directory holding only one is a run's, and export will not write over it. */
Test(tboard_run, the_event_file_is_a_run_file)
{
    struct result r = amp("run configs/fashion_mlp.yaml " SMALL " run.steps=2 run.out_dir=%s/e", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char dir[600], names[8][512];
    snprintf(dir, sizeof dir, "%s/e", scratch);
    cr_assert_eq(event_files(dir, names), 1);
    const char *base = strrchr(names[0], '/') + 1;
    r = amp("export %s/e/ckpt-2.h5 %s", scratch, names[0]);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "a run directory's events.out.tfevents."), "%s", r.out);
    char cmd[2400];
    snprintf(cmd, sizeof cmd, "mkdir %s/only && cp '%s' %s/only/", scratch, names[0], scratch);
    cr_assert_eq(system(cmd), 0);
    r = amp("run configs/fashion_mlp.yaml " SMALL " run.steps=2 run.out_dir=%s/only", scratch);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "already holds a run") && strstr(r.out, base), "%s", r.out);
}
