/*
 * ckpt_testlib.h — helpers shared by the suites that run and check checkpoints (test_checkpoint.c, test_resume.c,
 * test_hostile.c, test_portable.c and others): run the ampTrain binary on a small Fashion-MNIST MLP in a scratch directory, compare
 * checkpoints tensor by tensor, compare scale_log.csv rows, re-seal a checkpoint edited through HDF5 (so a test can
 * plant a fault that the whole-file checksum does not catch first), and hold an override refusal's hint against
 * docs/checkpoint.md's list of the keys resume or eval accept.
 */
#ifndef CKPT_TESTLIB_H
#define CKPT_TESTLIB_H

#include <criterion/criterion.h>
#include <fcntl.h>
#include <hdf5.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include "h5compat.h" /* amp_h5l_info: HDF5 1.10 and 1.12+ alike */
#include "testrun.h" /* struct result, amp: run the binary */

static char scratch[256];

/* A small, fast model: 784 -> 32 -> 32 -> 10, batch 32, CPU, one BLAS thread. */
#define SMALL "model.layers.1.out=32 model.layers.3.out=32 data.batch_size=32 run.device=cpu run.log_every=1000"

static void make_scratch(void)
{
    snprintf(scratch, sizeof scratch, "/tmp/amp-ckpt-XXXXXX");
    cr_assert_not_null(mkdtemp(scratch));
    setenv("OPENBLAS_NUM_THREADS", "1", 1);
}

static void remove_scratch(void)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "chmod -R u+w %s 2>/dev/null; rm -rf %s", scratch, scratch);
    cr_assert_eq(system(cmd), 0);
}


static inline void path_in(char *buf, size_t len, const char *sub)
{
    snprintf(buf, len, "%s/%s", scratch, sub);
}

static inline bool file_exists(const char *path) { return access(path, F_OK) == 0; }

static inline void copy_file(const char *from, const char *to)
{
    char cmd[2200];
    snprintf(cmd, sizeof cmd, "cp '%s' '%s'", from, to);
    cr_assert_eq(system(cmd), 0);
}

/* ---- comparing checkpoints ----------------------------------------------------------------------- */

/* Each float dataset of one checkpoint (but /config) with its counterpart in another: fn gets the name, the
 * values of both, and the count; `b` is NULL where the other file lacks the dataset or its size differs. */
typedef void (*tensor_pair_fn)(const char *name, const float *a, const float *b, size_t n, void *user);

struct pair_visit {
    hid_t other;
    tensor_pair_fn fn;
    void *user;
};

static herr_t pair_cb(hid_t g, const char *name, const amp_h5l_info *info, void *data)
{
    (void)info;
    struct pair_visit *v = data;
    hid_t o = H5Oopen(g, name, H5P_DEFAULT);
    if (o >= 0 && H5Iget_type(o) == H5I_DATASET && strcmp(name, "config") != 0) {
        hid_t s1 = H5Dget_space(o);
        size_t n = (size_t)H5Sget_simple_extent_npoints(s1);
        H5Sclose(s1);
        float *a = malloc((n ? n : 1) * sizeof *a), *b = NULL;
        H5Dread(o, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, a);
        hid_t d2 = H5Dopen2(v->other, name, H5P_DEFAULT);
        if (d2 >= 0) {
            hid_t s2 = H5Dget_space(d2);
            if ((size_t)H5Sget_simple_extent_npoints(s2) == n) {
                b = malloc((n ? n : 1) * sizeof *b);
                H5Dread(d2, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, b);
            }
            H5Sclose(s2);
            H5Dclose(d2);
        }
        v->fn(name, a, b, n, v->user);
        free(a);
        free(b);
    }
    if (o >= 0)
        H5Oclose(o);
    return 0;
}

static inline void visit_tensor_pairs(const char *a, const char *b, tensor_pair_fn fn, void *user)
{
    hid_t fa = H5Fopen(a, H5F_ACC_RDONLY, H5P_DEFAULT), fb = H5Fopen(b, H5F_ACC_RDONLY, H5P_DEFAULT);
    cr_assert(fa >= 0 && fb >= 0, "cannot open %s or %s", a, b);
    struct pair_visit v = {.other = fb, .fn = fn, .user = user};
    H5Lvisit(fa, H5_INDEX_NAME, H5_ITER_INC, pair_cb, &v);
    H5Fclose(fa);
    H5Fclose(fb);
}

struct cmp_ctx {
    int compared;
    int differ;
    char first_diff[256];
};

static void cmp_pair(const char *name, const float *a, const float *b, size_t n, void *user)
{
    struct cmp_ctx *c = user;
    bool same = b && memcmp(a, b, n * sizeof *a) == 0;
    c->compared++;
    if (!same && c->differ++ == 0)
        snprintf(c->first_diff, sizeof c->first_diff, "%s", name);
}

/* Assert that every tensor of checkpoint a is byte-identical in b; returns how many were compared. */
static inline int assert_same_tensors(const char *a, const char *b)
{
    struct cmp_ctx c = {0};
    visit_tensor_pairs(a, b, cmp_pair, &c);
    cr_assert(c.compared > 0, "no tensors in %s", a);
    cr_assert_eq(c.differ, 0, "%d of %d tensors differ between %s and %s, first /%s", c.differ, c.compared, a, b,
                 c.first_diff);
    return c.compared;
}

/* scale_log.csv without the samples_per_s column (the only one that depends on timing). */
static inline char *log_without_speed(const char *path)
{
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "cannot open %s", path);
    size_t cap = 1 << 20, len = 0;
    char *out = malloc(cap), line[4096];
    out[0] = '\0';
    while (fgets(line, sizeof line, f)) {
        char *comma = strrchr(line, ',');
        if (comma)
            *comma = '\0';
        len += (size_t)snprintf(out + len, cap - len, "%s\n", line);
        cr_assert(len < cap);
    }
    fclose(f);
    return out;
}

static inline void assert_same_logs(const char *a, const char *b)
{
    char *la = log_without_speed(a), *lb = log_without_speed(b);
    cr_assert(strchr(la, '\n') != strrchr(la, '\n'), "%s has no rows", a);
    cr_assert_str_eq(la, lb, "scale_log.csv differ: %s vs %s", a, b);
    free(la);
    free(lb);
}

/* ---- planting faults --------------------------------------------------------------------------------- */

/* Recompute the user block's length and CRC after an HDF5 edit (the layout of lib/engine/checkpoint.c). */
static inline void reseal(const char *path)
{
    int fd = open(path, O_RDWR);
    cr_assert(fd >= 0);
    struct stat sb;
    cr_assert_eq(fstat(fd, &sb), 0);
    unsigned char *buf = malloc((size_t)sb.st_size);
    cr_assert_eq(pread(fd, buf, (size_t)sb.st_size, 0), sb.st_size);
    uLong crc = crc32(crc32(0L, Z_NULL, 0), buf + 512, (uInt)(sb.st_size - 512));
    for (int i = 0; i < 8; i++)
        buf[16 + i] = (unsigned char)((uint64_t)sb.st_size >> (8 * i));
    for (int i = 0; i < 4; i++)
        buf[24 + i] = (unsigned char)(crc >> (8 * i));
    cr_assert_eq(pwrite(fd, buf, 32, 0), 32);
    close(fd);
    free(buf);
}

/* Copy checkpoint `from` to `to` with /model/NAME replaced by a float32 tensor of `ndim` dims (0.01 * index, finite),
 * or added where it was not there, or (ndim 0) removed; re-sealed, so only the check of names and shapes can
 * tell. */
static inline void craft_tensor(const char *from, const char *to, const char *name, int ndim, const hsize_t *dims)
{
    copy_file(from, to);
    char path[300];
    snprintf(path, sizeof path, "model/%s", name);
    hid_t f = H5Fopen(to, H5F_ACC_RDWR, H5P_DEFAULT);
    cr_assert(f >= 0, "cannot open %s", to);
    if (H5Lexists(f, path, H5P_DEFAULT) > 0)
        cr_assert(H5Ldelete(f, path, H5P_DEFAULT) >= 0);
    if (ndim > 0) {
        size_t n = 1;
        for (int i = 0; i < ndim; i++)
            n *= (size_t)dims[i];
        float *v = malloc((n ? n : 1) * sizeof *v);
        for (size_t i = 0; i < n; i++)
            v[i] = 0.01f * (float)(i % 100);
        hid_t lcpl = H5Pcreate(H5P_LINK_CREATE);
        H5Pset_create_intermediate_group(lcpl, 1);
        hid_t sp = H5Screate_simple(ndim, dims, NULL);
        hid_t d = H5Dcreate2(f, path, H5T_IEEE_F32LE, sp, lcpl, H5P_DEFAULT, H5P_DEFAULT);
        cr_assert(d >= 0, "cannot create %s in %s", path, to);
        cr_assert(H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v) >= 0);
        H5Dclose(d);
        H5Sclose(sp);
        H5Pclose(lcpl);
        free(v);
    }
    H5Fclose(f);
    reseal(to);
}

static inline void flip_bit(const char *path, long offset, int bit)
{
    int fd = open(path, O_RDWR);
    cr_assert(fd >= 0);
    unsigned char c;
    cr_assert_eq(pread(fd, &c, 1, offset), 1);
    c ^= (unsigned char)(1u << bit);
    cr_assert_eq(pwrite(fd, &c, 1, offset), 1);
    close(fd);
}

static inline long file_size(const char *path)
{
    struct stat sb;
    cr_assert_eq(stat(path, &sb), 0, "%s missing", path);
    return (long)sb.st_size;
}

/* ---- override lists: the code's table (a refusal's hint) against docs/checkpoint.md's ---- */

#define HINT_KEYS_MAX 64

/* The keys of an override refusal's hint in `out` ("hint: COMMAND accepts K1, K2, ...; ..."), into `keys` (at most
 * HINT_KEYS_MAX); each must stand in backquotes in the paragraph of docs/checkpoint.md that begins with `paragraph`
 * (up to its blank line), the documented list. Returns how many keys the hint lists. */
static inline int hint_keys_documented(const char *out, const char *command, const char *paragraph, char keys[][64])
{
    char prefix[64];
    snprintf(prefix, sizeof prefix, "hint: %s accepts ", command);
    const char *h = strstr(out, prefix);
    cr_assert_not_null(h, "%s", out);
    char list[1024];
    snprintf(list, sizeof list, "%s", h + strlen(prefix));
    list[strcspn(list, ";")] = '\0';
    FILE *f = fopen(AMP_SOURCE_DIR "/docs/checkpoint.md", "r");
    cr_assert_not_null(f);
    static char doc[1 << 20];
    size_t n = fread(doc, 1, sizeof doc - 1, f);
    doc[n] = '\0';
    fclose(f);
    char *para = strstr(doc, paragraph);
    cr_assert_not_null(para, "docs/checkpoint.md has no paragraph \"%s\"", paragraph);
    char *end = strstr(para, "\n\n");
    if (end)
        *end = '\0';
    int count = 0;
    for (char *k = strtok(list, ", "); k; k = strtok(NULL, ", ")) {
        cr_assert_lt(count, HINT_KEYS_MAX, "more than %d keys in the hint", HINT_KEYS_MAX);
        char quoted[96];
        snprintf(quoted, sizeof quoted, "`%s`", k);
        cr_assert(strstr(para, quoted), "docs/checkpoint.md's %s list lacks %s", command, k);
        snprintf(keys[count++], 64, "%s", k);
    }
    return count;
}

#endif
