/*
 * test_data.c — the data module (lib/base/data.h): IDX, HDF5 and text loading, their error messages,
 * data_gather, and the deterministic, resumable sampler.
 *
 * Every fixture is written by the test itself into a fresh temporary directory (IDX files by hand,
 * gzipped through zlib; HDF5 through the HDF5 C API), so each test knows the exact values the loader
 * must produce. The real Fashion-MNIST is checked too where the dataset-fashion-mnist package is
 * installed (skipped otherwise).
 */
#define _DEFAULT_SOURCE
#define _XOPEN_SOURCE 700

#include <criterion/criterion.h>
#include <dirent.h>
#include <hdf5.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#include "data.h" /* data_load, data_gather, sampler_* */
#include "rng.h"  /* rng_bits: seeded random fixtures */

#define FASHION_DIR "/usr/share/datasets/fashion-mnist"

#define assert_contains(s, sub) cr_assert(strstr((s), (sub)) != NULL, "expected \"%s\" in \"%s\"", (sub), (s))

/* ---- fixture directory ------------------------------------------------------------------------ */

static char g_dir[64];

static void dir_setup(void)
{
    snprintf(g_dir, sizeof g_dir, "/tmp/amp_test_data_XXXXXX");
    cr_assert(mkdtemp(g_dir) != NULL);
}

static void dir_teardown(void)
{
    DIR *d = opendir(g_dir);
    if (!d)
        return;
    struct dirent *e;
    char p[512];
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        snprintf(p, sizeof p, "%s/%s", g_dir, e->d_name);
        if (unlink(p) != 0)
            rmdir(p);
    }
    closedir(d);
    rmdir(g_dir);
}

static const char *fx(const char *name)
{
    static char bufs[32][256];
    static int next;
    char *b = bufs[next++ % 32];
    snprintf(b, 256, "%s/%s", g_dir, name);
    return b;
}

static void write_bytes(const char *path, const void *data, size_t len, bool gz)
{
    if (gz) {
        gzFile f = gzopen(path, "wb");
        cr_assert(f != NULL);
        if (len)
            cr_assert_eq(gzwrite(f, data, (unsigned)len), (int)len);
        cr_assert_eq(gzclose(f), Z_OK);
    } else {
        FILE *f = fopen(path, "wb");
        cr_assert(f != NULL);
        if (len)
            cr_assert_eq(fwrite(data, 1, len, f), len);
        cr_assert_eq(fclose(f), 0);
    }
}

static long file_size(const char *path)
{
    FILE *f = fopen(path, "rb");
    cr_assert(f != NULL);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fclose(f);
    return n;
}

/* ---- IDX fixtures ----------------------------------------------------------------------------- */

/* IDX bytes: magic, big-endian dims, payload. Returns the length; *out is malloc'd. */
static size_t idx_bytes(uint8_t **out, uint32_t magic, const uint32_t *dims, int ndim, const uint8_t *payload,
                        size_t plen)
{
    size_t len = 4 + 4 * (size_t)ndim + plen;
    uint8_t *b = malloc(len);
    cr_assert(b != NULL);
    for (int k = 0; k < 4; k++)
        b[k] = (uint8_t)(magic >> (24 - 8 * k));
    for (int d = 0; d < ndim; d++)
        for (int k = 0; k < 4; k++)
            b[4 + 4 * d + k] = (uint8_t)(dims[d] >> (24 - 8 * k));
    if (plen)
        memcpy(b + 4 + 4 * ndim, payload, plen);
    *out = b;
    return len;
}

/* Write an IDX file; `cut` >= 0 keeps only the first cut bytes of the uncompressed content. */
static void write_idx(const char *path, uint32_t magic, const uint32_t *dims, int ndim, const uint8_t *payload,
                      size_t plen, bool gz, long cut)
{
    uint8_t *b;
    size_t len = idx_bytes(&b, magic, dims, ndim, payload, plen);
    if (cut >= 0 && (size_t)cut < len)
        len = (size_t)cut;
    write_bytes(path, b, len, gz);
    free(b);
}

/* Train: 5 images 2x3, labels 0..4 mixed; test: 3 images 2x3, labels < 5. */
#define TR_N 5
#define TE_N 3
#define IMG_H 2
#define IMG_W 3
static const uint8_t TR_PIX[TR_N * IMG_H * IMG_W] = {0,   255, 51,  128, 1,   254, 10,  20,  30,  40,
                                                     50,  60,  200, 100, 0,   0,   100, 200, 255, 255,
                                                     255, 0,   0,   0,   7,   77,  177, 17,  27,  37};
static const uint8_t TR_LAB[TR_N] = {3, 0, 4, 1, 2};
static const uint8_t TE_PIX[TE_N * IMG_H * IMG_W] = {9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 255, 128, 64, 32, 16, 8, 4, 2};
static const uint8_t TE_LAB[TE_N] = {4, 4, 0};

struct idx_set {
    const char *tri, *trl, *tei, *tel;
};

static struct idx_set write_idx_set(bool gz)
{
    struct idx_set s = {fx(gz ? "tri.gz" : "tri"), fx(gz ? "trl.gz" : "trl"), fx(gz ? "tei.gz" : "tei"),
                        fx(gz ? "tel.gz" : "tel")};
    uint32_t trd[3] = {TR_N, IMG_H, IMG_W}, ted[3] = {TE_N, IMG_H, IMG_W}, trn = TR_N, ten = TE_N;
    write_idx(s.tri, 0x803, trd, 3, TR_PIX, sizeof TR_PIX, gz, -1);
    write_idx(s.trl, 0x801, &trn, 1, TR_LAB, sizeof TR_LAB, gz, -1);
    write_idx(s.tei, 0x803, ted, 3, TE_PIX, sizeof TE_PIX, gz, -1);
    write_idx(s.tel, 0x801, &ten, 1, TE_LAB, sizeof TE_LAB, gz, -1);
    return s;
}

static struct data_config base_config(enum data_format fmt)
{
    struct data_config c;
    memset(&c, 0, sizeof c);
    c.format = fmt;
    c.mean = 0.0;
    c.std = 1.0;
    c.val_fraction = 0.1;
    c.batch_size = 1;
    c.shuffle = true;
    c.seq_len = 4;
    snprintf(c.x_key, sizeof c.x_key, "x");
    snprintf(c.y_key, sizeof c.y_key, "y");
    return c;
}

static struct data_config idx_config(struct idx_set s)
{
    struct data_config c = base_config(DATA_IDX);
    snprintf(c.train_images, sizeof c.train_images, "%s", s.tri);
    snprintf(c.train_labels, sizeof c.train_labels, "%s", s.trl);
    snprintf(c.test_images, sizeof c.test_images, "%s", s.tei);
    snprintf(c.test_labels, sizeof c.test_labels, "%s", s.tel);
    return c;
}

/* Load expecting a data error; returns the error for message checks. */
static struct amp_error load_fails(const struct data_config *c, int64_t min_samples)
{
    struct dataset ds;
    struct amp_error err;
    memset(&err, 0, sizeof err);
    enum amp_status st = data_load(&ds, c, min_samples, &err);
    cr_assert_eq(st, AMP_ERR_DATA, "expected a data error, got %d: %s", (int)st, err.msg);
    cr_assert_eq(err.code, AMP_ERR_DATA);
    cr_assert(err.hint[0] != '\0', "every error carries a hint (%s)", err.msg);
    cr_assert_null(ds.split[0].x);
    cr_assert_null(ds.text_buf);
    return err;
}

static float idx_norm(uint8_t v, double mean, double std)
{
    return (float)(((double)v / 255.0 - mean) / std);
}

static void check_idx_values(bool gz)
{
    struct idx_set s = write_idx_set(gz);
    struct data_config c = idx_config(s);
    c.mean = 0.2860;
    c.std = 0.3530;
    struct dataset ds;
    struct amp_error err;
    cr_assert_eq(data_load(&ds, &c, TR_N, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(ds.spec.sample_ndim, 3);
    cr_assert_eq(ds.spec.sample_shape[0], 1);
    cr_assert_eq(ds.spec.sample_shape[1], IMG_H);
    cr_assert_eq(ds.spec.sample_shape[2], IMG_W);
    cr_assert_not(ds.spec.is_tokens);
    cr_assert_eq(ds.spec.num_classes, 5);
    cr_assert_eq(ds.sample_numel, IMG_H * IMG_W);
    cr_assert_eq(ds.split[SPLIT_TRAIN].n, TR_N);
    cr_assert_eq(ds.split[SPLIT_TEST].n, TE_N);
    for (size_t i = 0; i < sizeof TR_PIX; i++)
        cr_assert_eq(ds.split[SPLIT_TRAIN].x[i], idx_norm(TR_PIX[i], c.mean, c.std), "train pixel %zu", i);
    for (size_t i = 0; i < sizeof TE_PIX; i++)
        cr_assert_eq(ds.split[SPLIT_TEST].x[i], idx_norm(TE_PIX[i], c.mean, c.std), "test pixel %zu", i);
    for (int i = 0; i < TR_N; i++)
        cr_assert_eq(ds.split[SPLIT_TRAIN].y[i], TR_LAB[i]);
    for (int i = 0; i < TE_N; i++)
        cr_assert_eq(ds.split[SPLIT_TEST].y[i], TE_LAB[i]);
    data_free(&ds);
    cr_assert_null(ds.split[0].x);
}

/* ---- IDX: values ------------------------------------------------------------------------------ */

TestSuite(data_idx, .init = dir_setup, .fini = dir_teardown);

Test(data_idx, plain_values_labels_shapes) { check_idx_values(false); }

Test(data_idx, gzip_values_labels_shapes) { check_idx_values(true); }

Test(data_idx, default_normalisation_is_x_over_255)
{
    struct data_config c = idx_config(write_idx_set(false));
    struct dataset ds;
    struct amp_error err;
    cr_assert_eq(data_load(&ds, &c, 1, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(ds.split[0].x[0], 0.0f);
    cr_assert_eq(ds.split[0].x[1], 1.0f);
    cr_assert_eq(ds.split[0].x[2], (float)(51.0 / 255.0));
    data_free(&ds);
}

Test(data_idx, gzip_and_plain_mixed)
{
    struct idx_set g = write_idx_set(true), p = write_idx_set(false);
    struct data_config c = idx_config((struct idx_set){g.tri, p.trl, p.tei, g.tel});
    struct dataset ds;
    struct amp_error err;
    cr_assert_eq(data_load(&ds, &c, 1, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(ds.split[0].x[3], (float)(128.0 / 255.0));
    cr_assert_eq(ds.split[1].y[2], 0);
    data_free(&ds);
}

Test(data_idx, gather_copies_rows_and_labels)
{
    struct data_config c = idx_config(write_idx_set(false));
    struct dataset ds;
    struct amp_error err;
    cr_assert_eq(data_load(&ds, &c, 1, &err), AMP_OK, "%s", err.msg);
    int64_t idx[3] = {4, 0, 4};
    float x[3 * 6];
    int32_t y[3];
    data_gather(&ds, SPLIT_TRAIN, idx, 3, x, NULL, y);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(y[i], TR_LAB[idx[i]]);
        for (int e = 0; e < 6; e++)
            cr_assert_eq(x[i * 6 + e], (float)(TR_PIX[idx[i] * 6 + e] / 255.0));
    }
    int64_t tidx[1] = {1};
    data_gather(&ds, SPLIT_TEST, tidx, 1, x, NULL, y);
    cr_assert_eq(y[0], TE_LAB[1]);
    cr_assert_eq(x[5], (float)(TE_PIX[11] / 255.0));
    data_free(&ds);
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* data_fingerprint (what dist_check_data compares across ranks): the same files give the same digest on every
 * load; a value or a label of a sample it reads (the first and the last of each split among them), a split's size,
 * or the normalisation change it. */
Test(data_idx, fingerprint_follows_the_samples)
{
    struct idx_set s = write_idx_set(false);
    struct data_config c = idx_config(s);
    struct dataset a, b;
    struct amp_error err;
    cr_assert_eq(data_load(&a, &c, 1, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(data_load(&b, &c, 1, &err), AMP_OK, "%s", err.msg);
    const uint64_t fp = data_fingerprint(&a);
    cr_assert_eq(data_fingerprint(&b), fp, "two loads of one set of files");
    float *x = &b.split[SPLIT_TRAIN].x[0];
    *x += 1.0f;
    cr_assert_neq(data_fingerprint(&b), fp, "the first training sample's value");
    *x -= 1.0f;
    int32_t *y = &b.split[SPLIT_TEST].y[TE_N - 1];
    *y ^= 1;
    cr_assert_neq(data_fingerprint(&b), fp, "the last test label");
    *y ^= 1;
    b.split[SPLIT_TEST].n--;
    cr_assert_neq(data_fingerprint(&b), fp, "the test split's size");
    b.split[SPLIT_TEST].n++;
    cr_assert_eq(data_fingerprint(&b), fp, "restored");
    data_free(&b);
    c.mean = 0.5;
    cr_assert_eq(data_load(&b, &c, 1, &err), AMP_OK, "%s", err.msg);
    cr_assert_neq(data_fingerprint(&b), fp, "another normalisation");
    data_free(&b);
    data_free(&a);
}

Test(data_idx, real_fashion_mnist)
{
    const char *tri = FASHION_DIR "/train-images-idx3-ubyte.gz", *trl = FASHION_DIR "/train-labels-idx1-ubyte.gz";
    if (access(tri, R_OK) != 0)
        cr_skip_test("Fashion-MNIST not installed (package dataset-fashion-mnist)");
    struct data_config c = idx_config((struct idx_set){tri, trl, FASHION_DIR "/t10k-images-idx3-ubyte.gz",
                                                       FASHION_DIR "/t10k-labels-idx1-ubyte.gz"});
    c.mean = 0.2860;
    c.std = 0.3530;
    /* our own reading of the first training image and the labels */
    gzFile g = gzopen(tri, "rb");
    uint8_t head[16 + 784];
    cr_assert_eq(gzread(g, head, sizeof head), (int)sizeof head);
    gzclose(g);
    g = gzopen(trl, "rb");
    uint8_t *lab = malloc(8 + 60000);
    cr_assert_eq(gzread(g, lab, 8 + 60000), 8 + 60000);
    gzclose(g);

    struct dataset ds;
    struct amp_error err;
    double t0 = now_s();
    cr_assert_eq(data_load(&ds, &c, 64, &err), AMP_OK, "%s", err.msg);
    double dt = now_s() - t0;
    cr_log_info("Fashion-MNIST loaded in %.3f s", dt);
    fprintf(stderr, "test_data: Fashion-MNIST loaded in %.3f s\n", dt);
    cr_assert_eq(ds.split[SPLIT_TRAIN].n, 60000);
    cr_assert_eq(ds.split[SPLIT_TEST].n, 10000);
    cr_assert_eq(ds.spec.sample_shape[0], 1);
    cr_assert_eq(ds.spec.sample_shape[1], 28);
    cr_assert_eq(ds.spec.sample_shape[2], 28);
    cr_assert_eq(ds.sample_numel, 784);
    cr_assert_eq(ds.spec.num_classes, 10);
    cr_assert_eq(lab[8], 9, "the first Fashion-MNIST training label is 9 (ankle boot)");
    cr_assert_eq(ds.split[SPLIT_TRAIN].y[0], 9);
    int64_t per_class[2][10] = {{0}};
    for (int s = 0; s < 2; s++)
        for (int64_t i = 0; i < ds.split[s].n; i++) {
            int32_t y = ds.split[s].y[i];
            cr_assert(y >= 0 && y < 10);
            per_class[s][y]++;
        }
    for (int k = 0; k < 10; k++) {
        cr_assert_eq(per_class[0][k], 6000);
        cr_assert_eq(per_class[1][k], 1000);
    }
    for (int64_t i = 0; i < 60000; i++)
        cr_assert_eq(ds.split[SPLIT_TRAIN].y[i], lab[8 + i]);
    for (int e = 0; e < 784; e++)
        cr_assert_eq(ds.split[SPLIT_TRAIN].x[e], idx_norm(head[16 + e], c.mean, c.std));
    free(lab);
    data_free(&ds);
}

/* ---- IDX: errors ------------------------------------------------------------------------------ */

Test(data_idx, missing_file_names_path_key_and_package)
{
    struct idx_set s = write_idx_set(false);
    s.tri = fx("nope-images.gz");
    struct data_config c = idx_config(s);
    struct amp_error e = load_fails(&c, 1);
    assert_contains(e.msg, s.tri);
    assert_contains(e.msg, "no such file");
    assert_contains(e.msg, "data.train_images");
    assert_contains(e.hint, "dataset-fashion-mnist");
    assert_contains(e.hint, "data.train_images");

    s = write_idx_set(false);
    s.tel = fx("nope-test-labels");
    c = idx_config(s);
    e = load_fails(&c, 1);
    assert_contains(e.msg, s.tel);
    assert_contains(e.hint, "data.test_labels");
}

Test(data_idx, directory_is_an_error)
{
    struct idx_set s = write_idx_set(false);
    s.trl = g_dir;
    struct data_config c = idx_config(s);
    struct amp_error e = load_fails(&c, 1);
    assert_contains(e.msg, g_dir);
    assert_contains(e.msg, "directory");
}

Test(data_idx, wrong_magic_says_found_and_expected)
{
    struct idx_set s = write_idx_set(false);
    struct data_config c = idx_config((struct idx_set){s.trl, s.tri, s.tei, s.tel}); /* swapped */
    struct amp_error e = load_fails(&c, 1);
    assert_contains(e.msg, s.trl);
    assert_contains(e.msg, "wrong magic");
    assert_contains(e.msg, "0x00000801");
    assert_contains(e.msg, "expected 0x00000803");
    assert_contains(e.hint, "swapped");

    const char *junk = fx("junk.gz");
    write_bytes(junk, "GIF89a this is not an idx file at all", 37, true);
    c = idx_config((struct idx_set){s.tri, s.trl, junk, s.tel});
    e = load_fails(&c, 1);
    assert_contains(e.msg, junk);
    assert_contains(e.msg, "0x47494638 (not an IDX file)");
    assert_contains(e.msg, "data.test_images");

    const char *f32 = fx("float.idx");
    uint32_t d[3] = {1, 1, 1};
    uint8_t pay[4] = {0};
    write_idx(f32, 0x00000D03, d, 3, pay, 4, false, -1);
    c = idx_config((struct idx_set){f32, s.trl, s.tei, s.tel});
    e = load_fails(&c, 1);
    assert_contains(e.msg, "IDX file of float32 with 3 dims");
}

/* Cut a file's uncompressed content at `cut` bytes and expect a truncation error. */
static void check_truncated(bool images, bool gz, long cut, long full)
{
    struct idx_set s = write_idx_set(gz);
    const char *path = images ? s.tri : s.trl;
    uint32_t d[3] = {TR_N, IMG_H, IMG_W};
    if (images)
        write_idx(path, 0x803, d, 3, TR_PIX, sizeof TR_PIX, gz, cut);
    else
        write_idx(path, 0x801, d, 1, TR_LAB, sizeof TR_LAB, gz, cut);
    struct data_config c = idx_config(s);
    struct amp_error e = load_fails(&c, 1);
    assert_contains(e.msg, path);
    if (cut == 0) {
        assert_contains(e.msg, "empty file");
        return;
    }
    assert_contains(e.msg, "truncated");
    long header = images ? 16 : 8;
    char want[128];
    if (cut < header)
        snprintf(want, sizeof want, "the header needs %ld bytes, the file holds %ld", header, cut);
    else
        snprintf(want, sizeof want, "needs %ld bytes, the file holds %ld", full - header, cut - header);
    assert_contains(e.msg, want);
}

Test(data_idx, truncated_images_at_many_offsets)
{
    const long full = 16 + TR_N * IMG_H * IMG_W;
    const long cuts[] = {0, 1, 3, 4, 7, 15, 16, 17, 16 + 15, full - 1};
    for (size_t k = 0; k < sizeof cuts / sizeof cuts[0]; k++) {
        check_truncated(true, false, cuts[k], full);
        check_truncated(true, true, cuts[k], full);
    }
}

Test(data_idx, truncated_labels)
{
    const long full = 8 + TR_N;
    const long cuts[] = {0, 2, 5, 8, 9, full - 1};
    for (size_t k = 0; k < sizeof cuts / sizeof cuts[0]; k++) {
        check_truncated(false, false, cuts[k], full);
        check_truncated(false, true, cuts[k], full);
    }
}

Test(data_idx, truncated_gzip_stream)
{
    /* a big enough image file that the compressed stream can be cut in the middle */
    enum { N = 200 };
    uint8_t *pix = malloc(N * 28 * 28);
    for (int i = 0; i < N * 28 * 28; i++)
        pix[i] = (uint8_t)(rng_bits(7, 0, (uint64_t)i) & 0xff);
    uint8_t labs[N] = {0};
    uint32_t d[3] = {N, 28, 28}, n = N;
    struct idx_set s = write_idx_set(true);
    write_idx(s.tri, 0x803, d, 3, pix, N * 28 * 28, true, -1);
    write_idx(s.trl, 0x801, &n, 1, labs, N, true, -1);
    long size = file_size(s.tri);
    cr_assert_eq(truncate(s.tri, size / 2), 0);
    struct data_config c = idx_config(s);
    struct amp_error e = load_fails(&c, 1);
    assert_contains(e.msg, s.tri);
    assert_contains(e.msg, "truncated (the gzip stream ends early)");
    assert_contains(e.msg, "the pixel data needs 156800 bytes");
    free(pix);
}

/* A gzip file cut inside its 8-byte trailer (CRC-32 and length) still holds all the data: zlib only
 * checks the trailer when a read reaches the stream's end. Before, it was accepted. */
Test(data_idx, gzip_without_its_trailer_is_refused)
{
    for (int cut = 1; cut <= 8; cut += 7) {
        struct idx_set s = write_idx_set(true);
        long size = file_size(s.trl);
        cr_assert_eq(truncate(s.trl, size - cut), 0);
        struct data_config c = idx_config(s);
        struct amp_error e = load_fails(&c, 1);
        assert_contains(e.msg, s.trl);
        assert_contains(e.msg, "the gzip stream does not end properly after the label data (data.train_labels)");
    }
    /* A flipped bit in the stored CRC-32: the data inflates, the check fails (where zlib checks it depends
     * on how much of the file its buffer held). */
    struct idx_set s = write_idx_set(true);
    long size = file_size(s.tri);
    FILE *f = fopen(s.tri, "r+b");
    cr_assert_not_null(f);
    cr_assert_eq(fseek(f, size - 8, SEEK_SET), 0);
    int byte = fgetc(f);
    cr_assert_eq(fseek(f, size - 8, SEEK_SET), 0);
    fputc(byte ^ 1, f);
    fclose(f);
    struct data_config c = idx_config(s);
    struct amp_error e = load_fails(&c, 1);
    assert_contains(e.msg, s.tri);
    assert_contains(e.msg, "incorrect data check");
}

/* A file copied in pieces, cut `cut` bytes short of its end. */
static void copy_cut(const char *from, const char *to, long cut)
{
    FILE *in = fopen(from, "rb"), *out = fopen(to, "wb");
    cr_assert(in && out);
    char buf[1 << 16];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, in)) > 0)
        cr_assert_eq(fwrite(buf, 1, n, out), n);
    fclose(in);
    cr_assert_eq(fclose(out), 0);
    cr_assert_eq(truncate(to, file_size(to) - cut), 0);
}

/* Over about 1 MB the payload's last read ends exactly where the data does: zlib had taken the cut trailer's bytes
 * and reached the end of the file inside that read, so the one-byte read after it saw end-of-file without an
 * error, and both real Fashion-MNIST image files were accepted cut. The payload is random, so
 * that the gzip file is as large as the data. */
Test(data_idx, a_large_gzip_without_its_trailer_is_refused)
{
    enum { N = 1 << 18 }; /* 2x3 images: 1.5 MB of pixels */
    uint8_t *pix = malloc((size_t)N * IMG_H * IMG_W), *lab = malloc(N);
    cr_assert(pix && lab);
    for (size_t i = 0; i < (size_t)N * IMG_H * IMG_W; i++)
        pix[i] = (uint8_t)rng_bits(41, 11, i);
    for (int i = 0; i < N; i++)
        lab[i] = (uint8_t)(i % TR_N);
    struct idx_set s = write_idx_set(true);
    const char *whole = fx("big.gz");
    uint32_t dims[3] = {N, IMG_H, IMG_W}, n = N;
    write_idx(whole, 0x803, dims, 3, pix, (size_t)N * IMG_H * IMG_W, true, -1);
    write_idx(s.trl, 0x801, &n, 1, lab, N, true, -1);
    cr_assert_gt(file_size(whole), 1 << 20, "the gzip file holds the random payload");
    struct data_config c = idx_config(s);
    snprintf(c.train_images, sizeof c.train_images, "%s", whole);
    struct dataset ds;
    struct amp_error err = {0};
    cr_assert_eq(data_load(&ds, &c, 1, &err), AMP_OK, "the whole file loads: %s", err.msg);
    cr_assert_eq(ds.split[SPLIT_TRAIN].n, N);
    cr_assert_eq(ds.split[SPLIT_TRAIN].x[N * IMG_H * IMG_W - 1], idx_norm(pix[N * IMG_H * IMG_W - 1], 0.0, 1.0));
    data_free(&ds);
    snprintf(c.train_images, sizeof c.train_images, "%s", s.tri);
    for (long cut = 1; cut <= 8; cut++) {
        copy_cut(whole, s.tri, cut);
        struct amp_error e = load_fails(&c, 1);
        assert_contains(e.msg, s.tri);
        assert_contains(e.msg, "the gzip stream does not end properly after the pixel data (data.train_images)");
    }
    free(pix);
    free(lab);
    const char *real = FASHION_DIR "/train-images-idx3-ubyte.gz";
    if (access(real, R_OK) != 0)
        return;
    copy_cut(real, s.tri, 4);
    c = idx_config((struct idx_set){s.tri, FASHION_DIR "/train-labels-idx1-ubyte.gz",
                                    FASHION_DIR "/t10k-images-idx3-ubyte.gz", FASHION_DIR "/t10k-labels-idx1-ubyte.gz"});
    struct amp_error e = load_fails(&c, 1);
    assert_contains(e.msg, "the gzip stream does not end properly after the pixel data (data.train_images)");
}

Test(data_idx, corrupt_gzip)
{
    struct idx_set s = write_idx_set(true);
    const uint8_t bad[] = {0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
    write_bytes(s.trl, bad, sizeof bad, false);
    struct data_config c = idx_config(s);
    struct amp_error e = load_fails(&c, 1);
    assert_contains(e.msg, s.trl);
    assert_contains(e.msg, "corrupt gzip data (data.train_labels): invalid block type");
}

Test(data_idx, empty_files)
{
    struct idx_set s = write_idx_set(false);
    write_bytes(s.tei, "", 0, false);
    struct data_config c = idx_config(s);
    struct amp_error e = load_fails(&c, 1);
    assert_contains(e.msg, s.tei);
    assert_contains(e.msg, "empty file");

    s = write_idx_set(true); /* a valid gzip file of nothing */
    write_bytes(s.tel, "", 0, true);
    cr_assert_gt(file_size(s.tel), 0);
    c = idx_config(s);
    e = load_fails(&c, 1);
    assert_contains(e.msg, s.tel);
    assert_contains(e.msg, "empty file");
}

Test(data_idx, zero_samples_in_header)
{
    struct idx_set s = write_idx_set(false);
    uint32_t d[3] = {0, IMG_H, IMG_W};
    write_idx(s.tri, 0x803, d, 3, NULL, 0, false, -1);
    struct data_config c = idx_config(s);
    struct amp_error e = load_fails(&c, 1);
    assert_contains(e.msg, s.tri);
    assert_contains(e.msg, "no samples");
}

Test(data_idx, huge_header_dims_are_truncation_not_a_crash)
{
    struct idx_set s = write_idx_set(true);
    uint32_t d[3] = {0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu};
    write_idx(s.tri, 0x803, d, 3, TR_PIX, sizeof TR_PIX, true, -1);
    struct data_config c = idx_config(s);
    struct amp_error e = load_fails(&c, 1);
    assert_contains(e.msg, s.tri);
    assert_contains(e.msg, "overflow");

    uint32_t d2[3] = {0xFFFFFFu, 0xFFFFu, 0xFFu};
    write_idx(s.tri, 0x803, d2, 3, TR_PIX, sizeof TR_PIX, true, -1);
    e = load_fails(&c, 1);
    assert_contains(e.msg, "truncated");
}

Test(data_idx, count_mismatch)
{
    struct idx_set s = write_idx_set(false);
    uint32_t n = TR_N - 1;
    write_idx(s.trl, 0x801, &n, 1, TR_LAB, TR_N - 1, false, -1);
    struct data_config c = idx_config(s);
    struct amp_error e = load_fails(&c, 1);
    assert_contains(e.msg, s.tri);
    assert_contains(e.msg, s.trl);
    assert_contains(e.msg, "5 images");
    assert_contains(e.msg, "4 labels");
}

Test(data_idx, test_image_size_mismatch)
{
    struct idx_set s = write_idx_set(false);
    uint32_t d[3] = {TE_N, IMG_W, IMG_H};
    write_idx(s.tei, 0x803, d, 3, TE_PIX, sizeof TE_PIX, false, -1);
    struct data_config c = idx_config(s);
    struct amp_error e = load_fails(&c, 1);
    assert_contains(e.msg, s.tei);
    assert_contains(e.msg, "3x2");
}

/* num_classes comes from the training labels (max + 1); a test label beyond it has no output unit. */
Test(data_idx, test_label_out_of_range)
{
    struct idx_set s = write_idx_set(false);
    uint8_t lab[TE_N] = {1, 200, 0};
    uint32_t n = TE_N;
    write_idx(s.tel, 0x801, &n, 1, lab, TE_N, false, -1);
    struct data_config c = idx_config(s);
    struct amp_error e = load_fails(&c, 1);
    assert_contains(e.msg, s.tel);
    assert_contains(e.msg, "label 200 at index 1 is out of range");
    assert_contains(e.msg, "0..4");
}

Test(data_idx, fewer_samples_than_min_samples)
{
    struct data_config c = idx_config(write_idx_set(false));
    c.batch_size = 4;
    struct amp_error e = load_fails(&c, 8);
    assert_contains(e.msg, c.train_images);
    assert_contains(e.msg, "has 5 samples");
    assert_contains(e.msg, "data.batch_size 4 x accum_steps 2 = 8");
    struct dataset ds;
    cr_assert_eq(data_load(&ds, &c, 5, &e), AMP_OK, "%s", e.msg);
    data_free(&ds);
}

/* Every prefix of a valid file, plain and gzipped, and random byte damage: an error or success, never
 * a crash (run under AddressSanitizer in CI). */
Test(data_idx, every_truncation_and_random_damage_never_crashes)
{
    uint8_t *b;
    uint32_t d[3] = {TR_N, IMG_H, IMG_W};
    size_t len = idx_bytes(&b, 0x803, d, 3, TR_PIX, sizeof TR_PIX);
    for (int gz = 0; gz < 2; gz++)
        for (size_t cut = 0; cut < len; cut++) {
            struct idx_set s = write_idx_set(false);
            write_bytes(s.tri, b, cut, gz);
            struct data_config c = idx_config(s);
            load_fails(&c, 1);
        }
    for (uint64_t trial = 0; trial < 300; trial++) {
        uint8_t *m = malloc(len);
        memcpy(m, b, len);
        int flips = 1 + (int)(rng_bits(42, trial, 0) % 4);
        for (int k = 0; k < flips; k++) {
            uint64_t r = rng_bits(42, trial, (uint64_t)k + 1);
            m[(r >> 8) % 16] = (uint8_t)r; /* damage the header */
        }
        struct idx_set s = write_idx_set(trial % 2 == 0);
        write_bytes(s.tri, m, len, trial % 2 == 0);
        struct data_config c = idx_config(s);
        struct dataset ds;
        struct amp_error err;
        enum amp_status st = data_load(&ds, &c, 1, &err);
        cr_assert(st == AMP_OK || st == AMP_ERR_DATA, "trial %llu: status %d (%s)", (unsigned long long)trial,
                  (int)st, err.msg);
        if (st == AMP_OK)
            data_free(&ds);
        free(m);
    }
    free(b);
}

Test(data_idx, bad_normalisation_is_a_config_error)
{
    struct data_config c = idx_config(write_idx_set(false));
    c.std = 0;
    struct dataset ds;
    struct amp_error err;
    cr_assert_eq(data_load(&ds, &c, 1, &err), AMP_ERR_CONFIG);
    assert_contains(err.msg, "data.std");
}

/* ---- HDF5 ------------------------------------------------------------------------------------- */

TestSuite(data_hdf5, .init = dir_setup, .fini = dir_teardown);

static void h5_write(hid_t file, const char *name, hid_t type, int rank, const hsize_t *dims, const void *data)
{
    hid_t space = H5Screate_simple(rank, dims, NULL);
    hid_t d = H5Dcreate2(file, name, type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    cr_assert(d >= 0, "create %s", name);
    cr_assert(H5Dwrite(d, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) >= 0);
    H5Dclose(d);
    H5Sclose(space);
}

/* x (10, 4) float32 = i*10 + j - 20, y (10) int32 = i % 3 (sample 9 has label 0). */
static const char *write_h5_vectors(const char *name, float poison, int poison_at, int32_t bad_label)
{
    const char *path = fx(name);
    hid_t f = H5Fcreate(path, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    cr_assert(f >= 0);
    float x[10][4];
    int32_t y[10];
    for (int i = 0; i < 10; i++) {
        for (int j = 0; j < 4; j++)
            x[i][j] = (float)(i * 10 + j - 20);
        y[i] = i % 3;
    }
    if (poison_at >= 0)
        x[poison_at / 4][poison_at % 4] = poison;
    if (bad_label != 0)
        y[6] = bad_label;
    hsize_t dx[2] = {10, 4}, dy[1] = {10};
    h5_write(f, "x", H5T_NATIVE_FLOAT, 2, dx, x);
    h5_write(f, "y", H5T_NATIVE_INT32, 1, dy, y);
    H5Fclose(f);
    return path;
}

static struct data_config h5_config(const char *path)
{
    struct data_config c = base_config(DATA_HDF5);
    snprintf(c.path, sizeof c.path, "%s", path);
    return c;
}

Test(data_hdf5, vectors_values_and_split)
{
    struct data_config c = h5_config(write_h5_vectors("v.h5", 0, -1, 0));
    c.val_fraction = 0.25; /* floor(2.5) = 2 held out */
    c.mean = 1.5;
    c.std = 4.0;
    struct dataset ds;
    struct amp_error err;
    cr_assert_eq(data_load(&ds, &c, 8, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(ds.spec.sample_ndim, 1);
    cr_assert_eq(ds.spec.sample_shape[0], 4);
    cr_assert_eq(ds.sample_numel, 4);
    cr_assert_eq(ds.spec.num_classes, 3);
    cr_assert_eq(ds.split[SPLIT_TRAIN].n, 8);
    cr_assert_eq(ds.split[SPLIT_TEST].n, 2);
    for (int i = 0; i < 10; i++) {
        const struct data_split *sp = &ds.split[i < 8 ? 0 : 1];
        int r = i < 8 ? i : i - 8;
        cr_assert_eq(sp->y[r], i % 3);
        for (int j = 0; j < 4; j++)
            cr_assert_eq(sp->x[r * 4 + j], (float)(((double)(i * 10 + j - 20) - 1.5) / 4.0), "x[%d][%d]", i, j);
    }
    int64_t idx[2] = {1, 0};
    float x[8];
    int32_t y[2];
    data_gather(&ds, SPLIT_TEST, idx, 2, x, NULL, y);
    cr_assert_eq(y[0], 0);
    cr_assert_eq(y[1], 2);
    cr_assert_eq(x[0], (float)((90.0 - 20 - 1.5) / 4.0));
    data_free(&ds);
}

Test(data_hdf5, images_float64_rank3_and_uint8_rank4_custom_keys)
{
    const char *path = fx("img.h5");
    hid_t f = H5Fcreate(path, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    double x3[4][2][3];
    uint8_t x4[4][2][2][3];
    int64_t y[4] = {1, 0, 1, 1};
    for (int i = 0; i < 4; i++)
        for (int a = 0; a < 2; a++)
            for (int b = 0; b < 3; b++) {
                x3[i][a][b] = 0.125 * (i * 6 + a * 3 + b);
                x4[i][0][a][b] = (uint8_t)(i * 6 + a * 3 + b);
                x4[i][1][a][b] = (uint8_t)(200 + i);
            }
    hsize_t d3[3] = {4, 2, 3}, d4[4] = {4, 2, 2, 3}, dy[2] = {4, 1};
    h5_write(f, "x3", H5T_NATIVE_DOUBLE, 3, d3, x3);
    hid_t g = H5Gcreate2(f, "grp", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Gclose(g);
    h5_write(f, "grp/x4", H5T_NATIVE_UINT8, 4, d4, x4);
    h5_write(f, "labels", H5T_NATIVE_INT64, 2, dy, y); /* (N, 1) is accepted */
    H5Fclose(f);

    struct data_config c = h5_config(path);
    c.val_fraction = 0.25;
    snprintf(c.x_key, sizeof c.x_key, "x3");
    snprintf(c.y_key, sizeof c.y_key, "labels");
    struct dataset ds;
    struct amp_error err;
    cr_assert_eq(data_load(&ds, &c, 3, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(ds.spec.sample_ndim, 3);
    cr_assert_eq(ds.spec.sample_shape[0], 1);
    cr_assert_eq(ds.spec.sample_shape[1], 2);
    cr_assert_eq(ds.spec.sample_shape[2], 3);
    cr_assert_eq(ds.spec.num_classes, 2);
    cr_assert_eq(ds.split[0].n, 3);
    cr_assert_eq(ds.split[1].n, 1);
    cr_assert_eq(ds.split[0].x[7], (float)(0.125 * 7));
    cr_assert_eq(ds.split[1].x[5], (float)(0.125 * 23));
    cr_assert_eq(ds.split[1].y[0], 1);
    data_free(&ds);

    snprintf(c.x_key, sizeof c.x_key, "grp/x4");
    c.mean = 100;
    c.std = 50;
    cr_assert_eq(data_load(&ds, &c, 3, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(ds.spec.sample_ndim, 3);
    cr_assert_eq(ds.spec.sample_shape[0], 2);
    cr_assert_eq(ds.spec.sample_shape[1], 2);
    cr_assert_eq(ds.spec.sample_shape[2], 3);
    cr_assert_eq(ds.sample_numel, 12);
    cr_assert_eq(ds.split[0].x[12 + 4], (float)((10.0 - 100) / 50));
    cr_assert_eq(ds.split[0].x[12 + 6], (float)((201.0 - 100) / 50));
    data_free(&ds);
}

Test(data_hdf5, val_fraction_zero_keeps_everything)
{
    struct data_config c = h5_config(write_h5_vectors("v.h5", 0, -1, 0));
    c.val_fraction = 0;
    struct dataset ds;
    struct amp_error err;
    cr_assert_eq(data_load(&ds, &c, 10, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(ds.split[0].n, 10);
    cr_assert_eq(ds.split[1].n, 0);
    data_free(&ds);
}

Test(data_hdf5, val_fraction_too_small_for_one_sample)
{
    struct data_config c = h5_config(write_h5_vectors("v.h5", 0, -1, 0));
    c.val_fraction = 0.05;
    struct amp_error e = load_fails(&c, 1);
    assert_contains(e.msg, "holds out no sample");
}

Test(data_hdf5, nan_and_inf_name_dataset_and_index)
{
    struct data_config c = h5_config(write_h5_vectors("nan.h5", NAN, 5 * 4 + 2, 0));
    struct amp_error e = load_fails(&c, 1);
    assert_contains(e.msg, c.path);
    assert_contains(e.msg, "dataset 'x'");
    assert_contains(e.msg, "non-finite");
    assert_contains(e.msg, "sample 5, element 2");

    c = h5_config(write_h5_vectors("inf.h5", -INFINITY, 9 * 4, 0)); /* in the test split */
    e = load_fails(&c, 1);
    assert_contains(e.msg, "sample 9, element 0");
}

Test(data_hdf5, negative_label)
{
    struct data_config c = h5_config(write_h5_vectors("neg.h5", 0, -1, -3));
    struct amp_error e = load_fails(&c, 1);
    assert_contains(e.msg, c.path);
    assert_contains(e.msg, "dataset 'y'");
    assert_contains(e.msg, "label -3 at index 6");
}

Test(data_hdf5, test_label_beyond_training_classes)
{
    const char *path = fx("t.h5");
    hid_t f = H5Fcreate(path, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    float x[10] = {0};
    int32_t y[10] = {0, 1, 0, 1, 0, 1, 0, 1, 0, 7};
    hsize_t d = 10;
    h5_write(f, "x", H5T_NATIVE_FLOAT, 1, &d, x);
    h5_write(f, "y", H5T_NATIVE_INT32, 1, &d, y);
    H5Fclose(f);
    struct data_config c = h5_config(path);
    struct amp_error e = load_fails(&c, 1);
    assert_contains(e.msg, "label 7 at index 9 (test split)");
    assert_contains(e.msg, "0..1");
}

Test(data_hdf5, missing_dataset_names_it_and_lists_the_file)
{
    struct data_config c = h5_config(write_h5_vectors("v.h5", 0, -1, 0));
    snprintf(c.y_key, sizeof c.y_key, "targets");
    struct amp_error e = load_fails(&c, 1);
    assert_contains(e.msg, c.path);
    assert_contains(e.msg, "no dataset 'targets'");
    assert_contains(e.msg, "data.y_key");
    assert_contains(e.hint, "'x', 'y'");

    snprintf(c.x_key, sizeof c.x_key, "a/b/c");
    e = load_fails(&c, 1);
    assert_contains(e.msg, "no dataset 'a/b/c'");
}

Test(data_hdf5, count_mismatch_and_bad_types)
{
    const char *path = fx("bad.h5");
    hid_t f = H5Fcreate(path, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    float x[6] = {0};
    int32_t y[5] = {0};
    float yf[6] = {0};
    hsize_t d6 = 6, d5 = 5, d2[2] = {3, 2};
    h5_write(f, "x", H5T_NATIVE_FLOAT, 1, &d6, x);
    h5_write(f, "y5", H5T_NATIVE_INT32, 1, &d5, y);
    h5_write(f, "yf", H5T_NATIVE_FLOAT, 1, &d6, yf);
    h5_write(f, "y2d", H5T_NATIVE_INT32, 2, d2, yf);
    H5Gclose(H5Gcreate2(f, "grp", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
    H5Fclose(f);
    struct data_config c = h5_config(path);
    snprintf(c.y_key, sizeof c.y_key, "y5");
    struct amp_error e = load_fails(&c, 1);
    assert_contains(e.msg, "'x' holds 6 samples but 'y5' holds 5 labels");
    snprintf(c.y_key, sizeof c.y_key, "yf");
    e = load_fails(&c, 1);
    assert_contains(e.msg, "'yf' does not hold integers");
    snprintf(c.y_key, sizeof c.y_key, "y2d");
    e = load_fails(&c, 1);
    assert_contains(e.msg, "'y2d' has 2 dimensions");
    snprintf(c.y_key, sizeof c.y_key, "grp");
    e = load_fails(&c, 1);
    assert_contains(e.msg, "'grp' is not a dataset");
}

Test(data_hdf5, not_hdf5_missing_and_empty)
{
    const char *txt = fx("not.h5");
    write_bytes(txt, "hello, world\n", 13, false);
    struct data_config c = h5_config(txt);
    struct amp_error e = load_fails(&c, 1);
    assert_contains(e.msg, txt);
    assert_contains(e.msg, "not an HDF5 file");

    c = h5_config(fx("missing.h5"));
    e = load_fails(&c, 1);
    assert_contains(e.msg, "missing.h5: no such file (data.path)");

    const char *empty = fx("empty.h5");
    write_bytes(empty, "", 0, false);
    c = h5_config(empty);
    e = load_fails(&c, 1);
    assert_contains(e.msg, "empty file");
}

Test(data_hdf5, truncated_file_never_crashes)
{
    const char *path = write_h5_vectors("v.h5", 0, -1, 0);
    long size = file_size(path);
    for (long cut = 1; cut < size; cut += size / 23 + 1) {
        write_h5_vectors("v.h5", 0, -1, 0);
        cr_assert_eq(truncate(path, cut), 0);
        struct data_config c = h5_config(path);
        struct amp_error e = load_fails(&c, 1);
        assert_contains(e.msg, path);
    }
}

Test(data_hdf5, fewer_samples_than_min_samples)
{
    struct data_config c = h5_config(write_h5_vectors("v.h5", 0, -1, 0));
    c.batch_size = 3;
    struct amp_error e = load_fails(&c, 12); /* 9 training samples after holding out 1 */
    assert_contains(e.msg, c.path);
    assert_contains(e.msg, "has 9 samples");
    assert_contains(e.msg, "data.batch_size 3 x accum_steps 4 = 12");
}

/* ---- text ------------------------------------------------------------------------------------- */

TestSuite(data_text, .init = dir_setup, .fini = dir_teardown);

static struct data_config text_config(int nfiles, const char *const *paths, int64_t seq_len, double vf)
{
    struct data_config c = base_config(DATA_TEXT);
    c.nfiles = nfiles;
    for (int k = 0; k < nfiles; k++)
        snprintf(c.files[k], sizeof c.files[k], "%s", paths[k]);
    c.seq_len = seq_len;
    c.val_fraction = vf;
    return c;
}

Test(data_text, concatenated_bytes_windows_and_shifted_labels)
{
    const char *a = "Hello, \xff world!\n", *b = "The quick brown fox jumps.";
    const char *paths[2] = {fx("a.txt"), fx("b.txt")};
    write_bytes(paths[0], a, strlen(a), false);
    write_bytes(paths[1], b, strlen(b), false);
    char all[128];
    snprintf(all, sizeof all, "%s%s", a, b);
    const int64_t L = (int64_t)strlen(all); /* 16 + 26 = 42 */
    cr_assert_eq(L, 42);
    struct data_config c = text_config(2, paths, 4, 0.25);
    struct dataset ds;
    struct amp_error err;
    cr_assert_eq(data_load(&ds, &c, 7, &err), AMP_OK, "%s", err.msg);
    const int64_t test_len = 10, train_len = 32; /* floor(42 * 0.25) = 10 */
    cr_assert(ds.spec.is_tokens);
    cr_assert_eq(ds.spec.sample_ndim, 1);
    cr_assert_eq(ds.spec.sample_shape[0], 4);
    cr_assert_eq(ds.spec.num_classes, 256);
    cr_assert_eq(ds.sample_numel, 4);
    cr_assert_null(ds.split[0].x);
    cr_assert_eq(ds.split[SPLIT_TRAIN].text_len, train_len);
    cr_assert_eq(ds.split[SPLIT_TEST].text_len, test_len);
    cr_assert_eq(ds.split[SPLIT_TRAIN].n, (train_len - 1) / 4); /* 7 */
    cr_assert_eq(ds.split[SPLIT_TEST].n, (test_len - 1) / 4);   /* 2 */
    cr_assert_eq(memcmp(ds.split[SPLIT_TRAIN].text, all, (size_t)train_len), 0);
    cr_assert_eq(memcmp(ds.split[SPLIT_TEST].text, all + train_len, (size_t)test_len), 0);

    int64_t idx[3] = {6, 0, 3};
    int32_t tok[12], lab[12];
    data_gather(&ds, SPLIT_TRAIN, idx, 3, NULL, tok, lab);
    for (int i = 0; i < 3; i++)
        for (int t = 0; t < 4; t++) {
            cr_assert_eq(tok[i * 4 + t], (uint8_t)all[idx[i] * 4 + t], "window %lld token %d", (long long)idx[i], t);
            cr_assert_eq(lab[i * 4 + t], (uint8_t)all[idx[i] * 4 + t + 1]);
        }
    cr_assert_eq(tok[4 + 0], 'H'); /* window 0: "Hell" -> "ello" */
    cr_assert_eq(lab[4 + 3], 'o');
    cr_assert_eq(lab[3], (uint8_t)all[28]); /* window 6's last label is byte 28 */
    int64_t w1[1] = {1};
    data_gather(&ds, SPLIT_TRAIN, w1, 1, NULL, tok, lab); /* bytes 4..8: "o, \xff " */
    cr_assert_eq(tok[3], 0xff, "bytes above 127 stay 0..255");
    cr_assert_eq(lab[2], 0xff);

    int64_t tidx[1] = {1};
    data_gather(&ds, SPLIT_TEST, tidx, 1, NULL, tok, lab);
    for (int t = 0; t < 4; t++) {
        cr_assert_eq(tok[t], (uint8_t)all[train_len + 4 + t]);
        cr_assert_eq(lab[t], (uint8_t)all[train_len + 5 + t]);
    }
    data_free(&ds);
}

Test(data_text, val_fraction_zero)
{
    const char *p[1] = {fx("a.txt")};
    write_bytes(p[0], "abcdefghij", 10, false);
    struct data_config c = text_config(1, p, 3, 0);
    struct dataset ds;
    struct amp_error err;
    cr_assert_eq(data_load(&ds, &c, 3, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(ds.split[0].n, 3); /* (10 - 1) / 3 */
    cr_assert_eq(ds.split[1].n, 0);
    int64_t idx[1] = {2};
    int32_t tok[3], lab[3];
    data_gather(&ds, SPLIT_TRAIN, idx, 1, NULL, tok, lab);
    cr_assert_eq(tok[0], 'g');
    cr_assert_eq(lab[2], 'j');
    data_free(&ds);
}

Test(data_text, too_short_for_one_window)
{
    const char *p[1] = {fx("short.txt")};
    write_bytes(p[0], "abcd", 4, false);
    struct data_config c = text_config(1, p, 4, 0);
    struct amp_error e = load_fails(&c, 1);
    assert_contains(e.msg, p[0]);
    assert_contains(e.msg, "too short for one window");
    assert_contains(e.msg, "has 4 bytes");
    assert_contains(e.msg, "data.seq_len + 1 = 5");

    write_bytes(p[0], "abcdefghijklmnopqrst", 20, false); /* 20 bytes: 2 held out, too few */
    c = text_config(1, p, 4, 0.1);
    e = load_fails(&c, 1);
    assert_contains(e.msg, "too short for one test window");
}

Test(data_text, missing_and_empty_files)
{
    const char *p[2] = {fx("a.txt"), fx("gone.txt")};
    write_bytes(p[0], "some text here", 14, false);
    struct data_config c = text_config(2, p, 4, 0);
    struct amp_error e = load_fails(&c, 1);
    assert_contains(e.msg, p[1]);
    assert_contains(e.msg, "no such file (data.files)");
    assert_contains(e.hint, "fortunes");

    write_bytes(p[1], "", 0, false);
    e = load_fails(&c, 1);
    assert_contains(e.msg, p[1]);
    assert_contains(e.msg, "empty file");
}

Test(data_text, fewer_windows_than_min_samples)
{
    const char *p[1] = {fx("a.txt")};
    write_bytes(p[0], "abcdefghij", 10, false);
    struct data_config c = text_config(1, p, 3, 0);
    c.batch_size = 2;
    struct amp_error e = load_fails(&c, 4);
    assert_contains(e.msg, p[0]);
    assert_contains(e.msg, "has 3 windows");
    assert_contains(e.hint, "seq_len");
}

Test(data_text, large_file_reads_whole)
{
    const char *p[1] = {fx("big.txt")};
    enum { N = 3 * 1000 * 1000 + 17 };
    uint8_t *b = malloc(N);
    for (int i = 0; i < N; i++)
        b[i] = (uint8_t)rng_bits(3, 1, (uint64_t)i);
    write_bytes(p[0], b, N, false);
    struct data_config c = text_config(1, p, 64, 0.1);
    struct dataset ds;
    struct amp_error err;
    cr_assert_eq(data_load(&ds, &c, 64, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(ds.split[0].text_len + ds.split[1].text_len, N);
    cr_assert_eq(ds.split[1].text_len, 300001);
    cr_assert_eq(memcmp(ds.text_buf, b, N), 0);
    data_free(&ds);
    free(b);
}

/* ---- sampler ---------------------------------------------------------------------------------- */

static void assert_permutation(const int64_t *o, int64_t n)
{
    char *seen = calloc((size_t)n + 1, 1);
    for (int64_t i = 0; i < n; i++) {
        cr_assert(o[i] >= 0 && o[i] < n, "order[%lld] = %lld", (long long)i, (long long)o[i]);
        cr_assert_not(seen[o[i]], "%lld appears twice", (long long)o[i]);
        seen[o[i]] = 1;
    }
    free(seen);
}

static struct sampler make_sampler(int64_t n, uint64_t seed, bool shuffle)
{
    struct sampler s;
    struct amp_error err;
    cr_assert_eq(sampler_init(&s, n, seed, shuffle, &err), AMP_OK);
    return s;
}

Test(data_sampler, each_epoch_is_a_permutation)
{
    const int64_t ns[] = {1, 2, 7, 1000};
    for (size_t k = 0; k < 4; k++) {
        struct sampler s = make_sampler(ns[k], 1234, true);
        for (int64_t e = 0; e < 5; e++) {
            sampler_seek(&s, e, 0);
            assert_permutation(s.order, ns[k]);
        }
        sampler_free(&s);
    }
}

Test(data_sampler, pure_function_of_seed_and_epoch)
{
    struct sampler a = make_sampler(1000, 1234, true), b = make_sampler(1000, 1234, true),
                   c = make_sampler(1000, 99, true);
    cr_assert_eq(memcmp(a.order, b.order, 1000 * sizeof(int64_t)), 0, "same seed, same order");
    cr_assert_neq(memcmp(a.order, c.order, 1000 * sizeof(int64_t)), 0, "another seed, another order");
    int64_t *e0 = malloc(1000 * sizeof *e0);
    memcpy(e0, a.order, 1000 * sizeof *e0);
    sampler_seek(&a, 1, 0);
    cr_assert_neq(memcmp(a.order, e0, 1000 * sizeof(int64_t)), 0, "epoch 1 differs from epoch 0");
    assert_permutation(a.order, 1000);
    sampler_seek(&a, 0, 0);
    cr_assert_eq(memcmp(a.order, e0, 1000 * sizeof(int64_t)), 0, "epoch 0 again is the same");
    free(e0);
    sampler_free(&a);
    sampler_free(&b);
    sampler_free(&c);
}

Test(data_sampler, shuffle_off_is_identity)
{
    struct sampler s = make_sampler(10, 1234, false);
    int64_t idx[3];
    for (int64_t e = 0; e < 3; e++)
        for (int64_t b = 0; b < 3; b++) {
            sampler_next(&s, 3, idx);
            cr_assert_eq(s.epoch, e);
            for (int k = 0; k < 3; k++)
                cr_assert_eq(idx[k], b * 3 + k);
        }
    sampler_free(&s);
}

Test(data_sampler, drop_last_across_epoch_boundary)
{
    struct sampler s = make_sampler(10, 5, true);
    cr_assert_eq(sampler_batches_per_epoch(&s, 3), 3);
    cr_assert_eq(sampler_batches_per_epoch(&s, 10), 1);
    cr_assert_eq(sampler_batches_per_epoch(&s, 11), 0);
    int64_t e0[10], e1[10];
    memcpy(e0, s.order, sizeof e0);
    int64_t idx[3];
    for (int b = 0; b < 3; b++) {
        sampler_next(&s, 3, idx);
        cr_assert_eq(s.epoch, 0);
        cr_assert_eq(memcmp(idx, e0 + 3 * b, sizeof idx), 0);
    }
    cr_assert_eq(s.cursor, 9);
    sampler_next(&s, 3, idx); /* one sample left: dropped, epoch 1 starts */
    cr_assert_eq(s.epoch, 1);
    cr_assert_eq(s.cursor, 3);
    memcpy(e1, s.order, sizeof e1);
    cr_assert_eq(memcmp(idx, e1, sizeof idx), 0);
    struct sampler t = make_sampler(10, 5, true);
    sampler_seek(&t, 1, 0);
    cr_assert_eq(memcmp(t.order, e1, sizeof e1), 0);
    sampler_free(&s);
    sampler_free(&t);
}

Test(data_sampler, resume_from_epoch_and_cursor)
{
    const int64_t n = 103, batch = 8;
    for (int k = 0; k < 40; k += 7) {
        struct sampler a = make_sampler(n, 77, true);
        int64_t idx[8], want[8];
        for (int b = 0; b < k; b++)
            sampler_next(&a, batch, idx);
        struct sampler r = make_sampler(n, 77, true); /* a fresh run, resumed from a's checkpoint */
        sampler_seek(&r, a.epoch, a.cursor);
        for (int b = 0; b < 30; b++) {
            sampler_next(&a, batch, want);
            sampler_next(&r, batch, idx);
            cr_assert_eq(memcmp(idx, want, sizeof idx), 0, "k=%d, batch %d after resume", k, b);
            cr_assert_eq(r.epoch, a.epoch);
            cr_assert_eq(r.cursor, a.cursor);
        }
        sampler_free(&a);
        sampler_free(&r);
    }
}

/* Fisher-Yates with an unbiased rng_below puts every element at every position equally often. */
Test(data_sampler, positions_are_uniform)
{
    enum { N = 5, EPOCHS = 20000 };
    int64_t count[N][N] = {{0}};
    struct sampler s = make_sampler(N, 2024, true);
    for (int64_t e = 0; e < EPOCHS; e++) {
        sampler_seek(&s, e, 0);
        for (int p = 0; p < N; p++)
            count[s.order[p]][p]++;
    }
    for (int i = 0; i < N; i++)
        for (int p = 0; p < N; p++)
            cr_assert(llabs(count[i][p] - EPOCHS / N) < 300, "element %d at position %d: %lld times", i, p,
                      (long long)count[i][p]);
    sampler_free(&s);
}

Test(data_sampler, free_accepts_null)
{
    sampler_free(NULL);
    data_free(NULL);
    struct sampler s = make_sampler(0, 1, true);
    cr_assert_eq(sampler_batches_per_epoch(&s, 4), 0);
    sampler_free(&s);
    sampler_free(&s);
}
