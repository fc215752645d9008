/*
 * fuzz_common.h — what the libFuzzer harnesses in tests/fuzz/ share (scripts/check/fuzz.sh builds and runs them):
 *
 *   - a byte reader (struct fuzz_in) that turns the fuzzer's input into small decisions: a structured
 *     harness reads op codes, lengths and values from it; past the end every read gives 0, so any input,
 *     even the empty one, is a complete script;
 *   - a scratch directory under $TMPDIR (scripts/check/fuzz.sh points TMPDIR into build-fuzz/), removed at exit;
 *   - file helpers that write the fuzzer's bytes as the files our readers open;
 *   - FUZZ_ORACLE: a contract of a public header checked on an accepted (or refused) input; a broken one
 *     aborts, so libFuzzer saves the input like any crash. AMPTRAIN_FUZZ_ORACLES=0 turns them off to hunt
 *     crashes only.
 *
 * Leak detection is on in every run: each harness frees everything it takes on every path.
 */
#ifndef AMP_FUZZ_COMMON_H
#define AMP_FUZZ_COMMON_H

#include <fcntl.h>
#include <ftw.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- reading decisions from the input ------------------------------------------------------------ */

struct fuzz_in {
    const uint8_t *p;
    size_t n;
};

static inline uint8_t fin_u8(struct fuzz_in *in)
{
    if (in->n == 0)
        return 0;
    in->n--;
    return *in->p++;
}

static inline uint64_t fin_u64(struct fuzz_in *in)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)fin_u8(in) << (8 * i);
    return v;
}

static inline double fin_f64_bits(struct fuzz_in *in)
{
    uint64_t b = fin_u64(in);
    double d;
    memcpy(&d, &b, sizeof d);
    return d;
}

/* Up to `max` bytes (the count is the next byte, or the next two when max > 255); *out points into the
 * input. */
static inline size_t fin_bytes(struct fuzz_in *in, size_t max, const uint8_t **out)
{
    size_t want = fin_u8(in);
    if (max > 255)
        want |= (size_t)fin_u8(in) << 8;
    if (want > max)
        want = max;
    if (want > in->n)
        want = in->n;
    *out = in->p;
    in->p += want;
    in->n -= want;
    return want;
}

/* ---- oracles ------------------------------------------------------------------------------------- */

static inline bool fuzz_oracles_on(void)
{
    const char *e = getenv("AMPTRAIN_FUZZ_ORACLES");
    return !(e && e[0] == '0');
}

#define FUZZ_ORACLE(cond, ...)                                                                                      \
    do {                                                                                                            \
        if (!(cond) && fuzz_oracles_on()) {                                                                         \
            fprintf(stderr, "ORACLE FAILED at %s:%d: %s: ", __FILE__, __LINE__, #cond);                             \
            fprintf(stderr, __VA_ARGS__);                                                                           \
            fprintf(stderr, "\n");                                                                                  \
            abort();                                                                                                \
        }                                                                                                           \
    } while (0)

/* AMPTRAIN_FUZZ_VERBOSE=1: say what became of each input (replaying one: build-fuzz/HARNESS FILE). */
static inline bool fuzz_verbose(void)
{
    static int v = -1;
    if (v < 0) {
        const char *e = getenv("AMPTRAIN_FUZZ_VERBOSE");
        v = e && e[0] == '1';
    }
    return v;
}

#define FUZZ_NOTE(...)                                                                                              \
    do {                                                                                                            \
        if (fuzz_verbose()) {                                                                                       \
            fprintf(stderr, "fuzz: " __VA_ARGS__);                                                                  \
            fprintf(stderr, "\n");                                                                                  \
        }                                                                                                           \
    } while (0)

/* Harness set-up that cannot fail on a sane machine: a failure is a broken harness, not a finding. */
#define FUZZ_REQUIRE(cond, ...)                                                                                     \
    do {                                                                                                            \
        if (!(cond)) {                                                                                              \
            fprintf(stderr, "fuzz harness set-up failed at %s:%d: %s: ", __FILE__, __LINE__, #cond);                \
            fprintf(stderr, __VA_ARGS__);                                                                           \
            fprintf(stderr, "\n");                                                                                  \
            exit(2);                                                                                                \
        }                                                                                                           \
    } while (0)

/* ---- the trial process ---------------------------------------------------------------------------------- */

/* lib/base/trial.h parses HDF5 files first in a forked child, so that a crash inside libhdf5 becomes a refusal. A
 * harness turns that off (AMPTRAIN_NO_TRIAL=1) to fuzz the parse itself: a crash in the child would hide a
 * bug of ours behind a refusal, and a fork per call costs most of an input's time. fuzz_ckpt_guarded keeps
 * it on (the production path); AMPTRAIN_FUZZ_TRIAL=1 keeps it on in any harness. */
static inline void fuzz_set_trials(bool harness_default)
{
    const char *e = getenv("AMPTRAIN_FUZZ_TRIAL");
    bool on = e && *e ? e[0] == '1' : harness_default;
    if (on)
        unsetenv("AMPTRAIN_NO_TRIAL");
    else
        setenv("AMPTRAIN_NO_TRIAL", "1", 1);
}

/* ---- scratch directory and files ---------------------------------------------------------------- */

static char fuzz_dir[512];

static int fuzz_rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(path);
}

static void fuzz_remove_dir(void)
{
    if (fuzz_dir[0])
        nftw(fuzz_dir, fuzz_rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* Make $TMPDIR/amp-fuzz-TAG-XXXXXX (removed at a normal exit; a crash leaves it for the post-mortem). */
static inline const char *fuzz_scratch(const char *tag)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(fuzz_dir, sizeof fuzz_dir, "%s/amp-fuzz-%s-XXXXXX", tmp && *tmp ? tmp : "/tmp", tag);
    FUZZ_REQUIRE(mkdtemp(fuzz_dir) != NULL, "mkdtemp %s", fuzz_dir);
    atexit(fuzz_remove_dir);
    return fuzz_dir;
}

/* DIR/NAME in a rotating static buffer (enough for the paths one input uses at a time). */
static inline const char *fuzz_path(const char *name)
{
    static char bufs[16][600];
    static int next;
    char *b = bufs[next++ % 16];
    snprintf(b, sizeof bufs[0], "%s/%s", fuzz_dir, name);
    return b;
}

static inline void fuzz_write(const char *path, const void *data, size_t len)
{
    FILE *f = fopen(path, "wb");
    FUZZ_REQUIRE(f != NULL, "cannot write %s", path);
    FUZZ_REQUIRE(len == 0 || fwrite(data, 1, len, f) == len, "short write to %s", path);
    FUZZ_REQUIRE(fclose(f) == 0, "closing %s", path);
}

/* The whole of `path`, malloc'd; NULL if it cannot be read. */
static inline uint8_t *fuzz_slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    uint8_t *buf = NULL;
    size_t cap = 0, n = 0;
    for (;;) {
        if (n == cap) {
            cap = cap ? 2 * cap : 1 << 16;
            uint8_t *p = realloc(buf, cap);
            if (!p) {
                free(buf);
                fclose(f);
                return NULL;
            }
            buf = p;
        }
        size_t r = fread(buf + n, 1, cap - n, f);
        n += r;
        if (r == 0)
            break;
    }
    fclose(f);
    *len = n;
    return buf;
}

/* A FILE that swallows what the printers write (opened once, never closed: libFuzzer exits). */
static inline FILE *fuzz_devnull(void)
{
    static FILE *f;
    if (!f)
        f = fopen("/dev/null", "w");
    FUZZ_REQUIRE(f != NULL, "cannot open /dev/null");
    return f;
}

/* The library prints progress to stdout (trainer_setup); libFuzzer reports on stderr. */
static inline void fuzz_silence_stdout(void)
{
    fflush(stdout);
    int fd = open("/dev/null", O_WRONLY);
    if (fd >= 0) {
        dup2(fd, STDOUT_FILENO);
        close(fd);
    }
}

#endif
