/*
 * test_tokens.c — token files (data.format: tokens, lib/base/data_tokens.c; docs/data.md, "Tokens"): nanoGPT's raw
 * uint16 and llm.c's headered layouts read back the ids written, windows of seq_len + 1 tokens with shifted
 * targets, random and sequential sampling from run.seed, the sampler's resume and per-rank split, a file
 * larger than 2^31 tokens without per-window memory, every bad input (exit 3 naming the file and the
 * offset), scripts/tools/make_tokens.py's two layouts, and bit-exact resume of `ampTrain run` on token files.
 *
 * Fixtures are written by the tests into a fresh scratch directory, with ids drawn from a seeded generator,
 * so each test knows the exact ids the reader must produce.
 */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* mkdtemp, ftruncate */

#include "ckpt_testlib.h" /* scratch, make_scratch, amp(), assert_same_tensors, assert_same_logs */

#include <stdint.h>
#include <sys/resource.h> /* getrusage: no per-window memory */

#include "data.h" /* data_load, data_gather, data_sampler_init, DATA_WINDOW_AT */
#include "rng.h"  /* rng_bits: seeded fixtures */

#define assert_contains(s, sub) cr_assert(strstr((s), (sub)) != NULL, "expected \"%s\" in \"%s\"", (sub), (s))

#define MAGIC_GPT2 20240520
#define MAGIC_LLAMA3 20240801

/* ---- fixtures ------------------------------------------------------------------------------------- */

static const char *fx(const char *name)
{
    static char bufs[16][512];
    static int next;
    char *b = bufs[next++ % 16];
    snprintf(b, 512, "%s/%s", scratch, name);
    return b;
}

static void write_file(const char *path, const void *data, size_t len)
{
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "cannot write %s", path);
    if (len)
        cr_assert_eq(fwrite(data, 1, len, f), len);
    cr_assert_eq(fclose(f), 0);
}

/* n ids below vocab, from (seed). */
static uint32_t *random_ids(int64_t n, uint32_t vocab, uint64_t seed)
{
    uint32_t *ids = malloc((size_t)n * sizeof *ids);
    for (int64_t i = 0; i < n; i++)
        ids[i] = (uint32_t)(rng_bits(seed, 15, (uint64_t)i) % vocab);
    return ids;
}

/* ids as little-endian uint16 or uint32, after an optional llm.c header (magic, version, count). */
static size_t encode(uint8_t **out, const uint32_t *ids, int64_t n, int token_bytes, bool header, int32_t magic,
                     int32_t version, int32_t count)
{
    size_t hb = header ? 1024 : 0, len = hb + (size_t)n * (size_t)token_bytes;
    uint8_t *b = calloc(len ? len : 1, 1);
    if (header) {
        int32_t h[3] = {magic, version, count};
        for (int k = 0; k < 3; k++)
            for (int j = 0; j < 4; j++)
                b[4 * k + j] = (uint8_t)((uint32_t)h[k] >> (8 * j));
    }
    for (int64_t i = 0; i < n; i++)
        for (int j = 0; j < token_bytes; j++)
            b[hb + (size_t)i * (size_t)token_bytes + (size_t)j] = (uint8_t)(ids[i] >> (8 * j));
    *out = b;
    return len;
}

static const char *write_raw16(const char *name, const uint32_t *ids, int64_t n)
{
    uint8_t *b;
    size_t len = encode(&b, ids, n, 2, false, 0, 0, 0);
    const char *p = fx(name);
    write_file(p, b, len);
    free(b);
    return p;
}

static const char *write_llmc(const char *name, const uint32_t *ids, int64_t n, int32_t magic, int32_t version,
                              int32_t count)
{
    uint8_t *b;
    size_t len = encode(&b, ids, n, magic == MAGIC_LLAMA3 ? 4 : 2, true, magic, version, count);
    const char *p = fx(name);
    write_file(p, b, len);
    free(b);
    return p;
}

static struct data_config tokens_config(const char *train, const char *val, int64_t T, int64_t vocab,
                                        enum data_sampling sampling)
{
    struct data_config c;
    memset(&c, 0, sizeof c);
    c.format = DATA_TOKENS;
    c.std = 1.0;
    c.val_fraction = 0.1; /* not used by tokens */
    c.batch_size = 1;
    c.shuffle = true;     /* not used by tokens: data.sampling is */
    c.seq_len = T;
    c.vocab = vocab;
    c.sampling = sampling;
    snprintf(c.train_bin, sizeof c.train_bin, "%s", train);
    if (val)
        snprintf(c.val_bin, sizeof c.val_bin, "%s", val);
    return c;
}

static void load_ok(struct dataset *ds, const struct data_config *c)
{
    struct amp_error err = {0};
    enum amp_status st = data_load(ds, c, 1, &err);
    cr_assert_eq(st, AMP_OK, "data_load: %s (hint: %s)", err.msg, err.hint);
}

/* A refused load: a data error with a hint, nothing left mapped. */
static struct amp_error load_fails(const struct data_config *c)
{
    struct dataset ds;
    struct amp_error err = {0};
    enum amp_status st = data_load(&ds, c, 1, &err);
    cr_assert_eq(st, AMP_ERR_DATA, "expected a data error, got %d: %s", (int)st, err.msg);
    cr_assert(err.hint[0] != '\0', "every error carries a hint (%s)", err.msg);
    cr_assert(!ds.maps[0] && !ds.maps[1] && !ds.split[0].tokens, "a refused load left a mapping");
    return err;
}

/* Window `id` (data.h sample ids) of a split read back against the ids written. */
static void assert_window(const struct dataset *ds, enum split s, int64_t id, const uint32_t *ids)
{
    const int64_t T = ds->sample_numel;
    int32_t *tok = malloc((size_t)T * sizeof *tok), *lab = malloc((size_t)T * sizeof *lab);
    data_gather(ds, s, &id, 1, NULL, tok, lab);
    int64_t start = id >= 0 ? id * T : DATA_WINDOW_AT(id);
    for (int64_t t = 0; t < T; t++) {
        cr_assert_eq((uint32_t)tok[t], ids[start + t], "window %lld, input %lld: %d, expected %u", (long long)id,
                     (long long)t, tok[t], ids[start + t]);
        cr_assert_eq((uint32_t)lab[t], ids[start + t + 1], "window %lld, target %lld: %d, expected %u",
                     (long long)id, (long long)t, lab[t], ids[start + t + 1]);
    }
    free(tok);
    free(lab);
}

/* ---- reading both layouts ------------------------------------------------------------------------- */

TestSuite(tokens_read, .init = make_scratch, .fini = remove_scratch);

Test(tokens_read, nanogpt_raw_uint16_ids_windows_and_shifted_targets)
{
    const int64_t L = 1000, T = 16;
    uint32_t *ids = random_ids(L, 50257, 1);
    const char *p = write_raw16("train.bin", ids, L);
    struct data_config c = tokens_config(p, NULL, T, 50257, SAMPLING_SEQUENTIAL);
    struct dataset ds;
    load_ok(&ds, &c);
    cr_assert(ds.spec.is_tokens);
    cr_assert_eq(ds.spec.num_classes, 50257);
    cr_assert_eq(ds.sample_numel, T);
    cr_assert_eq(ds.spec.sample_shape[0], T);
    cr_assert_eq(ds.split[SPLIT_TRAIN].ntokens, L);
    cr_assert_eq(ds.split[SPLIT_TRAIN].token_bytes, 2);
    cr_assert_eq(ds.split[SPLIT_TRAIN].n, (L - 1) / T);
    cr_assert_eq(ds.split[SPLIT_TEST].n, 0, "no data.val_bin: no test split");
    /* memory-mapped, not copied */
    cr_assert_null(ds.text_buf);
    cr_assert_eq((const void *)ds.split[SPLIT_TRAIN].tokens, ds.maps[0]);
    cr_assert_eq(ds.map_len[0], (size_t)(2 * L));
    for (int64_t id = 0; id < ds.split[SPLIT_TRAIN].n; id++)
        assert_window(&ds, SPLIT_TRAIN, id, ids);
    /* a window at any offset, as random sampling draws them; the last one ends on the last token */
    assert_window(&ds, SPLIT_TRAIN, DATA_WINDOW_AT(7), ids);
    assert_window(&ds, SPLIT_TRAIN, DATA_WINDOW_AT(L - T - 1), ids);
    data_free(&ds);
    cr_assert_null(ds.maps[0]);
    free(ids);
}

Test(tokens_read, llmc_gpt2_header_and_val_windows)
{
    const int64_t L = 777, LV = 500, T = 8;
    uint32_t *ids = random_ids(L, 50257, 2), *vids = random_ids(LV, 50257, 3);
    const char *p = write_llmc("train.bin", ids, L, MAGIC_GPT2, 1, (int32_t)L);
    const char *v = write_llmc("val.bin", vids, LV, MAGIC_GPT2, 1, (int32_t)LV);
    struct data_config c = tokens_config(p, v, T, 50257, SAMPLING_RANDOM);
    struct dataset ds;
    load_ok(&ds, &c);
    cr_assert_eq(ds.split[SPLIT_TRAIN].tokens, (const uint8_t *)ds.maps[0] + 1024, "tokens after the 1024-byte header");
    cr_assert_eq(ds.split[SPLIT_TRAIN].ntokens, L);
    cr_assert_eq(ds.split[SPLIT_TRAIN].draw_range, L - T, "random: window starts in [0, L - T)");
    cr_assert_eq(ds.split[SPLIT_TEST].n, (LV - 1) / T, "val_windows 0: every window of val.bin");
    for (int64_t id = 0; id < ds.split[SPLIT_TRAIN].n; id += 5)
        assert_window(&ds, SPLIT_TRAIN, id, ids);
    for (int64_t id = 0; id < ds.split[SPLIT_TEST].n; id++)
        assert_window(&ds, SPLIT_TEST, id, vids);
    data_free(&ds);
    c.val_windows = 10; /* the first 10 consecutive windows */
    load_ok(&ds, &c);
    cr_assert_eq(ds.split[SPLIT_TEST].n, 10);
    assert_window(&ds, SPLIT_TEST, 9, vids);
    data_free(&ds);
    c.val_windows = 100000; /* more than there are: all */
    load_ok(&ds, &c);
    cr_assert_eq(ds.split[SPLIT_TEST].n, (LV - 1) / T);
    data_free(&ds);
    free(ids);
    free(vids);
}

Test(tokens_read, llmc_llama3_uint32_ids_beyond_65535)
{
    const int64_t L = 600, T = 32;
    uint32_t *ids = random_ids(L, 128256, 4);
    bool big = false;
    for (int64_t i = 0; i < L; i++)
        big = big || ids[i] > 65535;
    cr_assert(big, "the fixture must hold ids that need 32 bits");
    const char *p = write_llmc("train.bin", ids, L, MAGIC_LLAMA3, 7, (int32_t)L);
    struct data_config c = tokens_config(p, NULL, T, 128256, SAMPLING_SEQUENTIAL);
    struct dataset ds;
    load_ok(&ds, &c);
    cr_assert_eq(ds.split[SPLIT_TRAIN].token_bytes, 4);
    cr_assert_eq(ds.spec.num_classes, 128256);
    for (int64_t id = 0; id < ds.split[SPLIT_TRAIN].n; id++)
        assert_window(&ds, SPLIT_TRAIN, id, ids);
    assert_window(&ds, SPLIT_TRAIN, DATA_WINDOW_AT(L - T - 1), ids);
    data_free(&ds);
    free(ids);
}

Test(tokens_read, shortest_file_is_one_window)
{
    const int64_t T = 16;
    uint32_t *ids = random_ids(T + 1, 256, 5);
    struct data_config c = tokens_config(write_raw16("train.bin", ids, T + 1), NULL, T, 256, SAMPLING_RANDOM);
    struct dataset ds;
    load_ok(&ds, &c);
    cr_assert_eq(ds.split[SPLIT_TRAIN].n, 1);
    cr_assert_eq(ds.split[SPLIT_TRAIN].draw_range, 1, "one window: offset 0 only");
    assert_window(&ds, SPLIT_TRAIN, DATA_WINDOW_AT(0), ids);
    data_free(&ds);
    free(ids);
}

/* ids equal to vocab - 1 are fine; the scan is over the whole file, ids of the last block included. */
Test(tokens_read, ids_up_to_vocab_minus_one_are_accepted)
{
    const int64_t L = 70000; /* more than one scan block of 65536 */
    uint32_t *ids = random_ids(L, 300, 6);
    ids[L - 1] = 299;
    ids[0] = 299;
    struct data_config c = tokens_config(write_raw16("train.bin", ids, L), NULL, 64, 300, SAMPLING_RANDOM);
    struct dataset ds;
    load_ok(&ds, &c);
    data_free(&ds);
    free(ids);
}

/* ---- scripts/tools/make_tokens.py ----------------------------------------------------------------------- */

static void check_make_tokens(const char *layout)
{
    if (access("/usr/bin/python3", X_OK) != 0)
        cr_skip_test("no /usr/bin/python3 (scripts/install-deps.sh installs it)");
    static const char text[] = "Fortune favours the bold.\nA byte, \xc3\xa9, is two tokens here.\n0123456789";
    const int64_t len = (int64_t)sizeof text - 1;
    const char *in = fx("in.txt");
    write_file(in, text, (size_t)len);
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "cd %s && /usr/bin/python3 scripts/tools/make_tokens.py --format %s --val-fraction "
                              "0.25 -o %s %s 2>&1",
             AMP_SOURCE_DIR, layout, fx("train.bin"), in);
    struct result r = shell(cmd);
    cr_assert_eq(r.code, 0, "%s", r.out);
    int64_t nval = (int64_t)((double)len * 0.25), ntrain = len - nval;
    uint32_t ids[128];
    for (int64_t i = 0; i < len; i++)
        ids[i] = (uint8_t)text[i];
    struct data_config c = tokens_config(fx("train.bin"), fx("val.bin"), 4, 256, SAMPLING_SEQUENTIAL);
    struct dataset ds;
    load_ok(&ds, &c);
    cr_assert_eq(ds.split[SPLIT_TRAIN].ntokens, ntrain);
    cr_assert_eq(ds.split[SPLIT_TEST].ntokens, nval);
    bool llmc = !strcmp(layout, "llmc");
    cr_assert_eq(ds.map_len[0], (size_t)((llmc ? 1024 : 0) + 2 * ntrain), "%s layout's size", layout);
    if (llmc) {
        const uint8_t *h = ds.maps[0];
        cr_assert_eq((uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 | (uint32_t)h[3] << 24,
                     (uint32_t)MAGIC_GPT2);
    }
    for (int64_t id = 0; id < ds.split[SPLIT_TRAIN].n; id++)
        assert_window(&ds, SPLIT_TRAIN, id, ids);
    for (int64_t id = 0; id < ds.split[SPLIT_TEST].n; id++)
        assert_window(&ds, SPLIT_TEST, id, ids + ntrain);
    data_free(&ds);
}

Test(tokens_read, make_tokens_py_nanogpt_layout) { check_make_tokens("nanogpt"); }
Test(tokens_read, make_tokens_py_llmc_layout) { check_make_tokens("llmc"); }

/* ---- sampling -------------------------------------------------------------------------------------- */

TestSuite(tokens_sampling, .init = make_scratch, .fini = remove_scratch);

static void sampler_for(struct sampler *s, const struct dataset *ds, const struct data_config *c, uint64_t seed)
{
    struct amp_error err = {0};
    cr_assert_eq(data_sampler_init(s, ds, c, seed, &err), AMP_OK, "%s", err.msg);
}

Test(tokens_sampling, sequential_is_consecutive_windows_wrapping_at_the_end)
{
    const int64_t L = 1000, T = 16, B = 8; /* 62 windows: 7 batches per epoch, the last 6 windows dropped */
    uint32_t *ids = random_ids(L, 256, 7);
    struct data_config c = tokens_config(write_raw16("train.bin", ids, L), NULL, T, 256, SAMPLING_SEQUENTIAL);
    struct dataset ds;
    load_ok(&ds, &c);
    struct sampler s;
    sampler_for(&s, &ds, &c, 1234);
    cr_assert_null(s.order, "no order stored for consecutive windows");
    cr_assert_eq(sampler_batches_per_epoch(&s, B), 7);
    int64_t idx[8];
    for (int64_t e = 0; e < 3; e++)
        for (int64_t b = 0; b < 7; b++) {
            sampler_next(&s, B, idx);
            cr_assert_eq(s.epoch, e);
            for (int64_t k = 0; k < B; k++)
                cr_assert_eq(idx[k], b * B + k, "epoch %lld batch %lld: window %lld", (long long)e, (long long)b,
                             (long long)idx[k]);
        }
    assert_window(&ds, SPLIT_TRAIN, idx[B - 1], ids);
    sampler_free(&s);
    data_free(&ds);
    free(ids);
}

Test(tokens_sampling, random_offsets_are_uniform_from_the_seed)
{
    const int64_t L = 1000, T = 16, range = L - T; /* offsets 0..983, as nanoGPT's randint(len - T) */
    uint32_t *ids = random_ids(L, 256, 8);
    struct data_config c = tokens_config(write_raw16("train.bin", ids, L), NULL, T, 256, SAMPLING_RANDOM);
    struct dataset ds;
    load_ok(&ds, &c);
    struct sampler a, b, other;
    sampler_for(&a, &ds, &c, 1234);
    sampler_for(&b, &ds, &c, 1234);
    sampler_for(&other, &ds, &c, 99);
    cr_assert_null(a.order);
    enum { DRAWS = 31 * 1000 }; /* 31 batches of 2 per epoch (62 windows), 500 epochs */
    int64_t *count = calloc((size_t)range, sizeof *count);
    int64_t x[2], y[2], z[2], same_other = 0, not_multiple_of_T = 0;
    for (int64_t i = 0; i < DRAWS; i++) {
        sampler_next(&a, 2, x);
        sampler_next(&b, 2, y);
        sampler_next(&other, 2, z);
        for (int k = 0; k < 2; k++) {
            cr_assert(x[k] < 0, "random windows have ids DATA_WINDOW_AT(offset) < 0: %lld", (long long)x[k]);
            int64_t off = DATA_WINDOW_AT(x[k]);
            cr_assert(off >= 0 && off < range, "offset %lld outside [0, %lld)", (long long)off, (long long)range);
            count[off]++;
            cr_assert_eq(x[k], y[k], "same seed, same draws");
            same_other += x[k] == z[k];
            not_multiple_of_T += off % T != 0;
        }
    }
    cr_assert_eq(a.epoch, 999, "31 batches of 2 per epoch: draw 31000 batches in 1000 epochs");
    cr_assert_lt(same_other, DRAWS / 100, "another seed draws other offsets (%lld equal)", (long long)same_other);
    cr_assert_gt(not_multiple_of_T, DRAWS, "offsets are not tied to multiples of seq_len");
    /* 62000 draws over 984 offsets: about 63 each; every offset, both ends included, is drawn */
    for (int64_t o = 0; o < range; o++)
        cr_assert(count[o] >= 20 && count[o] <= 120, "offset %lld drawn %lld times", (long long)o,
                  (long long)count[o]);
    assert_window(&ds, SPLIT_TRAIN, x[0], ids);
    /* epoch e's draws are a pure function of (seed, e) */
    int64_t e0[8], e0again[8], e1[8];
    sampler_seek(&a, 0, 0);
    sampler_next(&a, 8, e0);
    sampler_seek(&a, 1, 0);
    sampler_next(&a, 8, e1);
    sampler_seek(&a, 0, 0);
    sampler_next(&a, 8, e0again);
    cr_assert_eq(memcmp(e0, e0again, sizeof e0), 0);
    cr_assert_neq(memcmp(e0, e1, sizeof e0), 0, "epoch 1 draws other windows");
    free(count);
    sampler_free(&a);
    sampler_free(&b);
    sampler_free(&other);
    data_free(&ds);
    free(ids);
}

/* What a checkpoint stores, (epoch, cursor), continues the same windows in a fresh sampler, across epochs. */
static void check_sampler_resume(enum data_sampling sampling)
{
    const int64_t L = 500, T = 8, B = 4; /* 62 windows: 15 batches per epoch */
    uint32_t *ids = random_ids(L, 256, 9);
    struct data_config c = tokens_config(write_raw16("train.bin", ids, L), NULL, T, 256, sampling);
    struct dataset ds;
    load_ok(&ds, &c);
    for (int k = 0; k < 50; k += 7) {
        struct sampler a, r;
        sampler_for(&a, &ds, &c, 77);
        int64_t idx[4], want[4];
        for (int b = 0; b < k; b++)
            sampler_next(&a, B, idx);
        sampler_for(&r, &ds, &c, 77); /* a fresh run, resumed from a's checkpoint */
        sampler_seek(&r, a.epoch, a.cursor);
        for (int b = 0; b < 40; b++) {
            sampler_next(&a, B, want);
            sampler_next(&r, B, idx);
            cr_assert_eq(memcmp(idx, want, sizeof idx), 0, "k=%d, batch %d after resume", k, b);
        }
        cr_assert_gt(a.epoch, 1, "the test crosses epochs");
        sampler_free(&a);
        sampler_free(&r);
    }
    data_free(&ds);
    free(ids);
}

Test(tokens_sampling, resume_from_epoch_and_cursor_random) { check_sampler_resume(SAMPLING_RANDOM); }
Test(tokens_sampling, resume_from_epoch_and_cursor_sequential) { check_sampler_resume(SAMPLING_SEQUENTIAL); }

/* train.c's split between ranks (docs/distributed.md, step 1): per micro-batch every rank draws `world` batches
 * from the one global order and keeps its own, so rank r's batches are global batches world * m + r. */
static void check_rank_split(enum data_sampling sampling)
{
    const int64_t L = 2000, T = 8, B = 3, world = 2;
    uint32_t *ids = random_ids(L, 256, 10);
    struct data_config c = tokens_config(write_raw16("train.bin", ids, L), NULL, T, 256, sampling);
    struct dataset ds;
    load_ok(&ds, &c);
    struct sampler one, ranks[2];
    sampler_for(&one, &ds, &c, 5);
    for (int r = 0; r < world; r++)
        sampler_for(&ranks[r], &ds, &c, 5);
    int64_t mine[2][3], skip[3], global[3];
    for (int m = 0; m < 200; m++) {
        for (int r = 0; r < world; r++)
            for (int q = 0; q < world; q++)
                sampler_next(&ranks[r], B, q == r ? mine[r] : skip);
        for (int r = 0; r < world; r++) {
            sampler_next(&one, B, global);
            cr_assert_eq(memcmp(mine[r], global, sizeof global), 0, "micro-batch %d, rank %d", m, r);
        }
    }
    cr_assert_neq(memcmp(mine[0], mine[1], sizeof mine[0]), 0, "the ranks train on different windows");
    sampler_free(&one);
    for (int r = 0; r < world; r++)
        sampler_free(&ranks[r]);
    data_free(&ds);
    free(ids);
}

Test(tokens_sampling, ranks_split_one_global_order_random) { check_rank_split(SAMPLING_RANDOM); }
Test(tokens_sampling, ranks_split_one_global_order_sequential) { check_rank_split(SAMPLING_SEQUENTIAL); }

/* A file of more than 2^31 tokens (a sparse 5 GB file: no disk space): mapped, never read whole, no memory
 * per window in either sampling mode, windows at its end read right. */
Test(tokens_sampling, file_beyond_2_pow_31_tokens_needs_no_memory_per_window)
{
    const int64_t L = (INT64_C(5) << 30) / 2, T = 64;
    const char *p = fx("huge.bin");
    int fd = open(p, O_CREAT | O_WRONLY | O_TRUNC, 0644);
    cr_assert(fd >= 0);
    cr_assert_eq(ftruncate(fd, L * 2), 0);
    uint32_t tail[T + 1];
    uint8_t b[2 * (T + 1)];
    for (int64_t t = 0; t <= T; t++) {
        tail[t] = (uint32_t)(1000 + 7 * t);
        b[2 * t] = (uint8_t)tail[t];
        b[2 * t + 1] = (uint8_t)(tail[t] >> 8);
    }
    cr_assert_eq(pwrite(fd, b, sizeof b, (off_t)(2 * (L - T - 1))), (ssize_t)sizeof b);
    cr_assert_eq(close(fd), 0);
    struct rusage before, after;
    getrusage(RUSAGE_SELF, &before);
    struct data_config c = tokens_config(p, NULL, T, 65536, SAMPLING_SEQUENTIAL); /* ids < 65536: no scan */
    struct dataset ds;
    load_ok(&ds, &c);
    cr_assert_eq(ds.split[SPLIT_TRAIN].ntokens, L);
    cr_assert_gt(ds.split[SPLIT_TRAIN].n, INT64_C(1) << 25);
    struct sampler s;
    sampler_for(&s, &ds, &c, 1);
    int64_t idx[4];
    sampler_seek(&s, 0, s.n - 4);
    sampler_next(&s, 4, idx);
    cr_assert_eq(idx[3], s.n - 1);
    sampler_free(&s);
    c.sampling = SAMPLING_RANDOM;
    sampler_for(&s, &ds, &c, 1);
    sampler_next(&s, 4, idx);
    sampler_free(&s);
    int32_t tok[T], lab[T];
    int64_t last = DATA_WINDOW_AT(L - T - 1);
    data_gather(&ds, SPLIT_TRAIN, &last, 1, NULL, tok, lab);
    for (int64_t t = 0; t < T; t++) {
        cr_assert_eq((uint32_t)tok[t], tail[t]);
        cr_assert_eq((uint32_t)lab[t], tail[t + 1]);
    }
    getrusage(RUSAGE_SELF, &after);
    /* ru_maxrss in KB: an order over the 84M windows alone would be 671 MB */
    cr_assert_lt(after.ru_maxrss - before.ru_maxrss, 64 * 1024, "max RSS grew by %ld KB", after.ru_maxrss - before.ru_maxrss);
    data_free(&ds);
}

/* The id scan at load reads every id of a 512 MB file without the process's resident set growing with it,
 * and still finds an id beyond the vocabulary at its very end. */
Test(tokens_sampling, id_scan_of_a_large_file_keeps_memory_flat)
{
    const int64_t L = (INT64_C(512) << 20) / 2;
    const char *p = fx("large.bin");
    int fd = open(p, O_CREAT | O_WRONLY | O_TRUNC, 0644);
    cr_assert(fd >= 0);
    cr_assert_eq(ftruncate(fd, L * 2), 0);
    cr_assert_eq(close(fd), 0);
    struct rusage before, after;
    getrusage(RUSAGE_SELF, &before);
    struct data_config c = tokens_config(p, NULL, 64, 256, SAMPLING_RANDOM); /* ids 0 < 256: a full scan */
    struct dataset ds;
    load_ok(&ds, &c);
    data_free(&ds);
    getrusage(RUSAGE_SELF, &after);
    cr_assert_lt(after.ru_maxrss - before.ru_maxrss, 160 * 1024, "max RSS grew by %ld KB scanning 512 MB",
                 after.ru_maxrss - before.ru_maxrss);
    fd = open(p, O_WRONLY);
    cr_assert_eq(pwrite(fd, "\x00\x01", 2, (off_t)(2 * (L - 1))), 2); /* id 256 at the last token */
    cr_assert_eq(close(fd), 0);
    struct amp_error e = load_fails(&c);
    char want[128];
    snprintf(want, sizeof want, "token id 256 at token %lld (byte offset %lld)", (long long)(L - 1),
             (long long)(2 * (L - 1)));
    assert_contains(e.msg, want);
}

/* ---- bad input: a data error naming the file and the offset ------------------------------------- */

TestSuite(tokens_errors, .init = make_scratch, .fini = remove_scratch);

Test(tokens_errors, odd_length_raw_file)
{
    uint8_t b[2001] = {0};
    const char *p = fx("odd.bin");
    write_file(p, b, sizeof b);
    struct data_config c = tokens_config(p, NULL, 16, 256, SAMPLING_RANDOM);
    struct amp_error e = load_fails(&c);
    assert_contains(e.msg, p);
    assert_contains(e.msg, "odd length (2001 bytes)");
    assert_contains(e.msg, "offset 2000");
    assert_contains(e.msg, "data.train_bin");
}

static void check_beyond_vocab(bool llmc)
{
    const int64_t L = 3000;
    uint32_t *ids = random_ids(L, 256, 11);
    ids[2777] = 300;
    ids[2900] = 65535;
    const char *p = llmc ? write_llmc("train.bin", ids, L, MAGIC_GPT2, 1, (int32_t)L) : write_raw16("train.bin", ids, L);
    struct data_config c = tokens_config(p, NULL, 16, 256, SAMPLING_RANDOM);
    struct amp_error e = load_fails(&c);
    assert_contains(e.msg, p);
    char want[160];
    snprintf(want, sizeof want, "token id 300 at token 2777 (byte offset %d) is not below data.vocab 256",
             (llmc ? 1024 : 0) + 2 * 2777);
    assert_contains(e.msg, want);
    assert_contains(e.hint, "data.vocab");
    c.vocab = 65535; /* 300 fits now; 65535 does not */
    e = load_fails(&c);
    assert_contains(e.msg, "token id 65535 at token 2900");
    c.vocab = 65536;
    struct dataset ds;
    load_ok(&ds, &c);
    data_free(&ds);
    /* the validation file is checked too, and named */
    const char *good = write_raw16("good.bin", (uint32_t[64]){0}, 64);
    c = tokens_config(good, p, 16, 256, SAMPLING_RANDOM);
    e = load_fails(&c);
    assert_contains(e.msg, p);
    assert_contains(e.msg, "data.val_bin");
    free(ids);
}

Test(tokens_errors, id_beyond_vocab_raw) { check_beyond_vocab(false); }
Test(tokens_errors, id_beyond_vocab_llmc) { check_beyond_vocab(true); }

Test(tokens_errors, id_beyond_vocab_llama3_uint32)
{
    const int64_t L = 100;
    uint32_t *ids = random_ids(L, 128000, 12);
    ids[50] = 128256;
    const char *p = write_llmc("train.bin", ids, L, MAGIC_LLAMA3, 7, (int32_t)L);
    struct data_config c = tokens_config(p, NULL, 16, 128256, SAMPLING_RANDOM);
    struct amp_error e = load_fails(&c);
    assert_contains(e.msg, "token id 128256 at token 50 (byte offset 1224)");
    free(ids);
}

Test(tokens_errors, unknown_llmc_version)
{
    uint32_t ids[100] = {0};
    const char *p = write_llmc("v2.bin", ids, 100, MAGIC_GPT2, 2, 100);
    struct data_config c = tokens_config(p, NULL, 16, 256, SAMPLING_RANDOM);
    struct amp_error e = load_fails(&c);
    assert_contains(e.msg, p);
    assert_contains(e.msg, "unknown version 2 at offset 4 for llm.c magic 20240520");
    p = write_llmc("v1.bin", ids, 100, MAGIC_LLAMA3, 1, 100); /* llama-3's magic takes version 7 */
    c = tokens_config(p, NULL, 16, 256, SAMPLING_RANDOM);
    e = load_fails(&c);
    assert_contains(e.msg, "unknown version 1 at offset 4 for llm.c magic 20240801");
}

Test(tokens_errors, wrong_magic_in_an_llmc_header)
{
    uint32_t ids[100] = {0};
    const char *p = write_llmc("magic.bin", ids, 100, MAGIC_GPT2 + 1, 1, 100);
    struct data_config c = tokens_config(p, NULL, 16, 50257, SAMPLING_RANDOM);
    struct amp_error e = load_fails(&c);
    assert_contains(e.msg, p);
    assert_contains(e.msg, "wrong magic 20240521 at offset 0");
}

Test(tokens_errors, token_count_disagrees_with_file_size)
{
    uint32_t ids[100] = {0};
    struct {
        int32_t magic, count;
        int64_t written;
        const char *want;
    } cases[] = {
        {MAGIC_GPT2, 99, 100, "says 99 tokens (198 bytes after the 1024-byte header), the file holds 200 bytes"},
        {MAGIC_GPT2, 101, 100, "says 101 tokens"},
        {MAGIC_GPT2, -5, 100, "says -5 tokens"},
        {MAGIC_GPT2, 0, 100, "says 0 tokens"},
        {MAGIC_LLAMA3, 50, 100, "says 50 tokens (200 bytes after the 1024-byte header), the file holds 400 bytes"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const char *p = write_llmc("count.bin", ids, cases[k].written, cases[k].magic,
                                   cases[k].magic == MAGIC_GPT2 ? 1 : 7, cases[k].count);
        struct data_config c = tokens_config(p, NULL, 16, 256, SAMPLING_RANDOM);
        struct amp_error e = load_fails(&c);
        assert_contains(e.msg, p);
        assert_contains(e.msg, "offset 8");
        assert_contains(e.msg, cases[k].want);
    }
    /* a llama-3 file cut inside a token: the payload is not whole uint32s */
    uint8_t *b;
    size_t len = encode(&b, ids, 100, 4, true, MAGIC_LLAMA3, 7, 100);
    const char *p = fx("cut.bin");
    write_file(p, b, len - 1);
    free(b);
    struct data_config c = tokens_config(p, NULL, 16, 256, SAMPLING_RANDOM);
    struct amp_error e = load_fails(&c);
    assert_contains(e.msg, "the file holds 399 bytes after it");
}

Test(tokens_errors, header_cut_short)
{
    uint8_t *b;
    uint32_t ids[4] = {0};
    size_t len = encode(&b, ids, 4, 2, true, MAGIC_GPT2, 1, 4);
    const char *p = fx("short.bin");
    write_file(p, b, 600);
    free(b);
    (void)len;
    struct data_config c = tokens_config(p, NULL, 2, 256, SAMPLING_RANDOM);
    struct amp_error e = load_fails(&c);
    assert_contains(e.msg, p);
    assert_contains(e.msg, "the file holds 600 bytes, fewer than the 1024-byte header");
}

Test(tokens_errors, shorter_than_one_window)
{
    uint32_t ids[16] = {0};
    const char *p = write_raw16("short.bin", ids, 16);
    struct data_config c = tokens_config(p, NULL, 16, 256, SAMPLING_SEQUENTIAL);
    struct amp_error e = load_fails(&c);
    assert_contains(e.msg, p);
    assert_contains(e.msg, "too short for one window: 16 tokens");
    assert_contains(e.msg, "byte offset 32");
    assert_contains(e.msg, "data.seq_len + 1 = 17");
    /* the same for llm.c's layout, and for the validation file */
    p = write_llmc("short_llmc.bin", ids, 16, MAGIC_GPT2, 1, 16);
    const char *good = write_raw16("good.bin", (uint32_t[17]){0}, 17);
    c = tokens_config(good, p, 16, 256, SAMPLING_SEQUENTIAL);
    e = load_fails(&c);
    assert_contains(e.msg, p);
    assert_contains(e.msg, "byte offset 1056");
    assert_contains(e.msg, "data.val_bin");
}

Test(tokens_errors, fewer_windows_than_one_step)
{
    uint32_t ids[65] = {0};
    const char *p = write_raw16("train.bin", ids, 65); /* 4 windows of 16 */
    struct data_config c = tokens_config(p, NULL, 16, 256, SAMPLING_RANDOM);
    struct dataset ds;
    struct amp_error err = {0};
    cr_assert_eq(data_load(&ds, &c, 5, &err), AMP_ERR_DATA);
    assert_contains(err.msg, p);
    assert_contains(err.msg, "the training split has 4 windows, fewer than one optimizer step needs");
}

Test(tokens_errors, missing_empty_and_directory)
{
    struct data_config c = tokens_config(fx("nope.bin"), NULL, 16, 256, SAMPLING_RANDOM);
    struct amp_error e = load_fails(&c);
    assert_contains(e.msg, "nope.bin: no such file (data.train_bin)");
    assert_contains(e.hint, "scripts/tools/make_tokens.py");
    const char *empty = fx("empty.bin");
    write_file(empty, "", 0);
    c = tokens_config(empty, NULL, 16, 256, SAMPLING_RANDOM);
    e = load_fails(&c);
    assert_contains(e.msg, "empty file (0 bytes) (data.train_bin)");
    c = tokens_config(scratch, NULL, 16, 256, SAMPLING_RANDOM);
    e = load_fails(&c);
    assert_contains(e.msg, "is a directory");
    c = tokens_config("/dev/zero", NULL, 16, 256, SAMPLING_RANDOM); /* endless: must not be read or mapped */
    e = load_fails(&c);
    assert_contains(e.msg, "/dev/zero: not a regular file");
}

/* Through the program: exit 3 (data error) and the file in the message; a missing key is exit 2. */
Test(tokens_errors, cli_exit_codes)
{
    uint8_t odd[1001] = {0};
    write_file(fx("odd.bin"), odd, sizeof odd);
    uint32_t *ids = random_ids(2000, 256, 13);
    ids[1500] = 256;
    write_raw16("big_id.bin", ids, 2000);
    const char *bad[] = {"odd.bin", "big_id.bin", "missing.bin"};
    for (int k = 0; k < 3; k++) {
        struct result r = amp("run configs/tokens_gpt.yaml run.device=cpu run.steps=1 run.out_dir=%s/run%d "
                              "data.train_bin=%s data.val_bin='\"\"'",
                              scratch, k, fx(bad[k]));
        cr_assert_eq(r.code, 3, "%s: exit %d:\n%s", bad[k], r.code, r.out);
        assert_contains(r.out, fx(bad[k]));
        assert_contains(r.out, "hint:");
    }
    struct result r = amp("check configs/tokens_gpt.yaml data.vocab=0");
    cr_assert_eq(r.code, 2, "%s", r.out);
    assert_contains(r.out, "data.format is tokens but data.vocab is not set");
    r = amp("check configs/tokens_gpt.yaml data.train_bin='\"\"'");
    cr_assert_eq(r.code, 2, "%s", r.out);
    assert_contains(r.out, "data.train_bin is not set");
    r = amp("check configs/tokens_gpt.yaml data.sampling=shuffled");
    cr_assert_eq(r.code, 2, "%s", r.out);
    assert_contains(r.out, "data.sampling");
    free(ids);
}

/* A token run without data.val_bin recorded a 0-sample evaluation (loss null) and `eval` exited 0;
 * now the run records none (and says so), `eval` of its test split is a data error naming data.val_bin, the train
 * split still evaluates; a key the format does not read (data.shuffle, data.mean under tokens) draws a warning. */
Test(tokens_errors, a_run_without_val_bin_records_no_evaluation, .timeout = 300)
{
    uint32_t *ids = random_ids(4000, 256, 17);
    write_raw16("train.bin", ids, 4000);
    struct result r = amp("run configs/tokens_gpt.yaml run.device=cpu run.steps=2 run.eval_every=1 "
                          "run.out_dir=%s/noval data.train_bin=%s data.val_bin='\"\"'; ls %s/noval",
                          scratch, fx("train.bin"), scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    assert_contains(r.out, "eval: none (no validation data: data.val_bin is not set)");
    cr_assert_null(strstr(r.out, "eval.jsonl"), "no evaluation recorded:\n%s", r.out);
    r = amp("eval %s/noval", scratch);
    cr_assert_eq(r.code, 3, "%s", r.out);
    assert_contains(r.out, "no test (validation) samples to evaluate: data.val_bin is not set");
    assert_contains(r.out, "hint:");
    r = amp("eval %s/noval --split train", scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    assert_contains(r.out, "| train |");
    r = amp("check configs/tokens_gpt.yaml data.shuffle=false data.mean=0.5 > /dev/null");
    cr_assert_eq(r.code, 0, "%s", r.out);
    assert_contains(r.out, "warning: configs/tokens_gpt.yaml: data.shuffle is set but data.format tokens does not read "
                           "it (data.sampling");
    assert_contains(r.out, "data.mean is set but data.format tokens does not read it");
    r = amp("check configs/fashion_mlp.yaml data.seq_len=128 > /dev/null");
    assert_contains(r.out, "data.seq_len is set but data.format idx does not read it");
    free(ids);
}

/* ---- resume through the program --------------------------------------------------------------------- */

TestSuite(tokens_resume, .init = make_scratch, .fini = remove_scratch);

#define N_STEPS 12
/* A small GPT on 400 tokens: 24 windows of 16, 6 batches of 4 per epoch, so 12 steps cross two epochs. */
#define TINY                                                                                                         \
    "run.device=cpu run.log_every=1000 run.eval_every=0 run.ckpt_every=0 data.seq_len=16 data.batch_size=4 "       \
    "model.layers.0.dim=32 model.layers.1.heads=2 model.layers.2.heads=2 optim.schedule.kind=constant "            \
    "optim.schedule.warmup_steps=0"

/* N steps straight, and k steps then `ampTrain resume` for the rest: identical tensors and log rows. */
static void check_resume(const char *sampling, const char *extra, int k)
{
    uint32_t *ids = random_ids(400, 256, 14), *vids = random_ids(200, 256, 15);
    const char *train = write_raw16("train.bin", ids, 400), *val = write_llmc("val.bin", vids, 200, MAGIC_GPT2, 1, 200);
    struct result r = amp("run configs/tokens_gpt.yaml " TINY " %s data.sampling=%s data.train_bin=%s data.val_bin=%s "
                          "run.steps=%d run.out_dir=%s/a",
                          extra, sampling, train, val, N_STEPS, scratch);
    cr_assert_eq(r.code, 0, "%s straight run:\n%s", sampling, r.out);
    r = amp("run configs/tokens_gpt.yaml " TINY " %s data.sampling=%s data.train_bin=%s data.val_bin=%s run.steps=%d "
            "run.out_dir=%s/b",
            extra, sampling, train, val, k, scratch);
    cr_assert_eq(r.code, 0, "%s first part:\n%s", sampling, r.out);
    r = amp("resume %s/b/ckpt-%d.h5 run.steps=%d", scratch, k, N_STEPS);
    cr_assert_eq(r.code, 0, "%s resume:\n%s", sampling, r.out);
    assert_contains(r.out, "resumed from");
    char a[512], b[512];
    snprintf(a, sizeof a, "%s/a/ckpt-%d.h5", scratch, N_STEPS);
    snprintf(b, sizeof b, "%s/b/ckpt-%d.h5", scratch, N_STEPS);
    int n = assert_same_tensors(a, b);
    cr_assert_geq(n, 20, "%s: only %d tensors compared", sampling, n);
    snprintf(a, sizeof a, "%s/a/scale_log.csv", scratch);
    snprintf(b, sizeof b, "%s/b/scale_log.csv", scratch);
    assert_same_logs(a, b);
    free(ids);
    free(vids);
}

Test(tokens_resume, bit_exact_random_mid_epoch) { check_resume("random", "precision.mode=fp32", 5); }
Test(tokens_resume, bit_exact_random_second_epoch_bf16) { check_resume("random", "precision.mode=bf16", 8); }
Test(tokens_resume, bit_exact_sequential_at_the_epoch_boundary) { check_resume("sequential", "precision.mode=fp32", 6); }
Test(tokens_resume, bit_exact_sequential_with_accumulation)
{
    check_resume("sequential", "precision.mode=fp16-dynamic accum_steps=2", 7);
}

/* The comparison above can fail: other windows (random against sequential) train other weights. */
Test(tokens_resume, another_order_gives_other_weights)
{
    uint32_t *ids = random_ids(400, 256, 14);
    const char *train = write_raw16("train.bin", ids, 400);
    struct result r = amp("run configs/tokens_gpt.yaml " TINY " data.train_bin=%s data.val_bin='\"\"' run.steps=4 "
                          "run.out_dir=%s/a",
                          train, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    r = amp("run configs/tokens_gpt.yaml " TINY " data.train_bin=%s data.val_bin='\"\"' run.steps=4 "
            "run.out_dir=%s/b data.sampling=sequential",
            train, scratch);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char a[512], b[512];
    snprintf(a, sizeof a, "%s/a/ckpt-4.h5", scratch);
    snprintf(b, sizeof b, "%s/b/ckpt-4.h5", scratch);
    struct cmp_ctx cc = {0};
    visit_tensor_pairs(a, b, cmp_pair, &cc);
    cr_assert_gt(cc.differ, 0, "random and sequential windows must train different weights");
    free(ids);
}

/* ---- the data.* keys of token files (lib/base/config.c) -------------------------------------------------- */

#define TOKENS_MODEL                                                                                                 \
    "model:\n"                                                                                                         \
    "  layers:\n"                                                                                                      \
    "    - kind: embedding\n"                                                                                          \
    "      dim: 8\n"                                                                                                   \
    "    - kind: linear\n"                                                                                             \
    "      out: 256\n"                                                                                                 \
    "    - kind: cross_entropy\n"

static struct amp_error parse(const char *yaml, struct config *cfg)
{
    struct amp_error err = {0};
    config_parse_string(cfg, yaml, strlen(yaml), "t.yaml", &err);
    return err;
}

Test(tokens_config, keys_defaults_and_round_trip)
{
    struct config c;
    struct amp_error e = parse("data:\n  format: tokens\n  train_bin: a.bin\n  vocab: 256\n" TOKENS_MODEL, &c);
    cr_assert_eq(e.code, AMP_OK, "%s", e.msg);
    cr_assert_eq(c.data.format, DATA_TOKENS);
    cr_assert_str_eq(c.data.train_bin, "a.bin");
    cr_assert_str_eq(c.data.val_bin, "", "no val_bin: no evaluation");
    cr_assert_eq(c.data.vocab, 256);
    cr_assert_eq(c.data.sampling, SAMPLING_RANDOM, "random (nanoGPT) by default");
    cr_assert_eq(c.data.val_windows, 0);
    struct amp_error oe = {0};
    cr_assert_eq(config_apply_override(&c, "data.sampling=sequential", &oe), AMP_OK, "%s", oe.msg);
    cr_assert_eq(config_apply_override(&c, "data.val_windows=12", &oe), AMP_OK, "%s", oe.msg);
    cr_assert_eq(c.data.sampling, SAMPLING_SEQUENTIAL);
    char *text = config_to_yaml_string(&c);
    assert_contains(text, "sampling: sequential");
    assert_contains(text, "val_windows: 12");
    struct config back;
    e = parse(text, &back);
    cr_assert_eq(e.code, AMP_OK, "%s", e.msg);
    cr_assert(config_equal(&c, &back), "the printed config parses back equal");
    free(text);
    config_free(&back);
    config_free(&c);
}

Test(tokens_config, bad_values_name_the_key_and_position)
{
    struct config c;
    struct amp_error e = parse("data:\n  format: tokens\n  train_bin: a.bin\n  vocab: 256\n  sampling: shuffle\n"
                               TOKENS_MODEL, &c);
    cr_assert_eq(e.code, AMP_ERR_CONFIG);
    assert_contains(e.msg, "t.yaml:5:13");
    assert_contains(e.hint, "random");
    assert_contains(e.hint, "sequential");
    e = parse("data:\n  format: tokens\n  train_bin: a.bin\n  vocab: -1\n" TOKENS_MODEL, &c);
    cr_assert_eq(e.code, AMP_ERR_CONFIG);
    assert_contains(e.msg, "t.yaml:4:10");
    e = parse("data:\n  format: tokens\n  train_bin: a.bin\n  vocab: 256\n  val_windows: -3\n" TOKENS_MODEL, &c);
    cr_assert_eq(e.code, AMP_ERR_CONFIG);
    assert_contains(e.msg, "t.yaml:5:16");
    e = parse("data:\n  format: tokens\n  vocab: 256\n" TOKENS_MODEL, &c);
    cr_assert_eq(e.code, AMP_ERR_CONFIG);
    assert_contains(e.msg, "data.format is tokens but data.train_bin is not set");
    e = parse("data:\n  format: tokens\n  train_bin: a.bin\n" TOKENS_MODEL, &c);
    cr_assert_eq(e.code, AMP_ERR_CONFIG);
    assert_contains(e.msg, "t.yaml:2:3: data.format is tokens but data.vocab is not set");
    assert_contains(e.hint, "50257");
}
