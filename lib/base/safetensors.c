/*
 * safetensors.c — writing and reading the safetensors format (safetensors.h has the layout and the rules).
 *
 * The writer builds the header text in memory, then streams header and tensors into a temporary file beside
 * the output (mkstemp), fsyncs, renames and fsyncs the directory, as lib/engine/checkpoint.c does for checkpoints.
 *
 * The reader checks the 8-byte header length (against a cap and the file) before it reads the header, and the
 * header before it reads the data, so that a large file of another kind is refused without being read. It holds
 * the whole file in memory and parses the header with a small strict JSON parser that knows this format's shape
 * only: a top-level object whose values are tensor entries (objects with exactly the keys dtype, shape and
 * data_offsets) or the __metadata__ object of strings. It has no recursion beyond that fixed
 * depth, so no input can exhaust the stack. After parsing, the entries are checked against each other: unique
 * names, byte counts that match dtype and shape, offsets that tile the data section exactly.
 */
#define _POSIX_C_SOURCE 200809L
#include "safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "test_switches.h" /* test_switch_raise: AMPTRAIN_TEST_RAISE=export_write */

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors.c writes host-order data as the format's little-endian: build on a little-endian host"
#endif

#define HINT_BAD "the file is not a valid safetensors file: export it again, or check the tool that wrote it"
#define HINT_WRITE "check free disk space, quotas (ulimit -f) and permissions of the output's directory"

const char *safetensors_dtype_name(enum dtype dt)
{
    switch (dt) {
    case DT_FP32: return "F32";
    case DT_FP16: return "F16";
    case DT_BF16: return "BF16";
    case DT_FP8_E4M3: return "F8_E4M3";
    case DT_FP8_E5M2: return "F8_E5M2";
    default: return "?";
    }
}

/* ---- writing ------------------------------------------------------------------------------------------ */

struct text {
    char *buf;
    size_t len, cap;
    bool oom;
};

static void text_put(struct text *t, const char *s, size_t n)
{
    if (t->oom)
        return;
    if (t->len + n + 1 > t->cap) {
        size_t cap = t->cap ? t->cap : 4096;
        while (cap < t->len + n + 1)
            cap *= 2;
        char *p = realloc(t->buf, cap);
        if (!p) {
            t->oom = true;
            return;
        }
        t->buf = p;
        t->cap = cap;
    }
    memcpy(t->buf + t->len, s, n);
    t->len += n;
    t->buf[t->len] = '\0';
}

static void text_uint(struct text *t, const char *before, unsigned long long v)
{
    char tmp[64];
    int n = snprintf(tmp, sizeof tmp, "%s%llu", before, v);
    text_put(t, tmp, (size_t)n);
}

/* A JSON string: quotes, backslashes and control characters escaped; other bytes as they are (UTF-8). */
static void text_json_string(struct text *t, const char *s)
{
    text_put(t, "\"", 1);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        char esc[8];
        if (*p == '"' || *p == '\\') {
            esc[0] = '\\';
            esc[1] = (char)*p;
            text_put(t, esc, 2);
        } else if (*p < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", *p);
            text_put(t, esc, 6);
        } else {
            text_put(t, (const char *)p, 1);
        }
    }
    text_put(t, "\"", 1);
}

static size_t numel_of(const struct safetensor *t)
{
    size_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= (size_t)t->shape[i];
    return n;
}

/* The header: tensors in the given order with contiguous offsets, then __metadata__, padded with spaces to a
 * multiple of 8 bytes. */
static char *build_header(const struct safetensor *tensors, int n, const struct safetensors_meta *meta, int nmeta,
                          size_t *len)
{
    struct text t = {0};
    uint64_t off = 0;
    text_put(&t, "{", 1);
    for (int i = 0; i < n; i++) {
        const struct safetensor *x = &tensors[i];
        uint64_t bytes = (uint64_t)numel_of(x) * dtype_size(x->dtype);
        text_put(&t, i ? ",\n" : "\n", i ? 2 : 1);
        text_json_string(&t, x->name);
        text_put(&t, ": {\"dtype\": \"", 13);
        text_put(&t, safetensors_dtype_name(x->dtype), strlen(safetensors_dtype_name(x->dtype)));
        text_put(&t, "\", \"shape\": [", 13);
        for (int d = 0; d < x->ndim; d++)
            text_uint(&t, d ? ", " : "", (unsigned long long)x->shape[d]);
        text_uint(&t, "], \"data_offsets\": [", (unsigned long long)off);
        text_uint(&t, ", ", (unsigned long long)(off + bytes));
        text_put(&t, "]}", 2);
        off += bytes;
    }
    text_put(&t, n ? ",\n\"__metadata__\": {" : "\n\"__metadata__\": {", n ? 19 : 18);
    for (int i = 0; i < nmeta; i++) {
        if (i)
            text_put(&t, ", ", 2);
        text_json_string(&t, meta[i].key);
        text_put(&t, ": ", 2);
        text_json_string(&t, meta[i].value);
    }
    text_put(&t, "}\n}", 3);
    while (!t.oom && t.len % 8 != 0)
        text_put(&t, " ", 1);
    if (t.oom) {
        free(t.buf);
        return NULL;
    }
    *len = t.len;
    return t.buf;
}

static bool write_all(int fd, const void *buf, size_t n)
{
    const unsigned char *p = buf;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return false;
        p += w;
        n -= (size_t)w;
    }
    return true;
}

static void dir_of(const char *path, char *dir, size_t len)
{
    snprintf(dir, len, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash == dir)
        dir[1] = '\0';
    else if (slash)
        *slash = '\0';
    else
        snprintf(dir, len, ".");
}

/* SIGINT and SIGTERM are blocked while the temporary file exists and looked for between chunks of the write: a
 * pending one ends the write, the temporary file is removed, and the status names the signal (cmd/ exits 130 or
 * 143). Killed by the default action instead, the process would leave the file behind, with nothing to remove
 * it. SIGXFSZ is ignored meanwhile: a file-size limit (ulimit -f) is then a write error naming OUT. */
struct write_guard {
    sigset_t stop, old_mask;
    struct sigaction old_xfsz;
};

static void guard_begin(struct write_guard *g)
{
    struct sigaction ignore = {.sa_handler = SIG_IGN};
    sigemptyset(&ignore.sa_mask);
    sigaction(SIGXFSZ, &ignore, &g->old_xfsz);
    sigemptyset(&g->stop);
    sigaddset(&g->stop, SIGINT);
    sigaddset(&g->stop, SIGTERM);
    sigprocmask(SIG_BLOCK, &g->stop, &g->old_mask);
}

/* The stop signal waiting to be delivered, or 0. */
static int guard_pending(void)
{
    sigset_t p;
    if (sigpending(&p) != 0)
        return 0;
    return sigismember(&p, SIGINT) == 1 ? SIGINT : sigismember(&p, SIGTERM) == 1 ? SIGTERM : 0;
}

/* Restore the mask; a signal the write reported is taken off first (the caller exits with its status), one that
 * came after the rename is delivered as usual (OUT is complete). */
static void guard_end(struct write_guard *g, bool consume)
{
    struct timespec now = {0};
    while (consume && sigtimedwait(&g->stop, NULL, &now) > 0)
        ;
    sigprocmask(SIG_SETMASK, &g->old_mask, NULL);
    sigaction(SIGXFSZ, &g->old_xfsz, NULL);
}

#define WRITE_CHUNK ((size_t)8 << 20) /* bytes between looks for a signal: a few ms of disk */

/* n bytes in chunks; false on a write error or (with *sig set) a pending stop signal. */
static bool write_chunks(int fd, const void *buf, size_t n, int *sig)
{
    const unsigned char *p = buf;
    size_t off = 0;
    do {
        if ((*sig = guard_pending()) != 0)
            return false;
        size_t len = n - off < WRITE_CHUNK ? n - off : WRITE_CHUNK;
        if (len && !write_all(fd, p + off, len))
            return false;
        off += len;
    } while (off < n);
    return true;
}

/* The file's bytes into fd (the length, the header, each tensor) and fsync. */
static bool write_contents(int fd, const char *header, size_t hlen, const struct safetensor *tensors, int n, int *sig)
{
    unsigned char len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
    bool ok = write_chunks(fd, len8, 8, sig) && write_chunks(fd, header, hlen, sig);
    for (int i = 0; ok && i < n; i++) {
        ok = write_chunks(fd, tensors[i].data, numel_of(&tensors[i]) * dtype_size(tensors[i].dtype), sig);
        if (i == 0)
            test_switch_raise("export_write"); /* after the first tensor's bytes */
    }
    return ok && fsync(fd) == 0 && (*sig = guard_pending()) == 0;
}

/* A temporary name beside `path` of fixed length, so that any valid OUT name (up to NAME_MAX) has one. */
static char *temp_name_beside(const char *path)
{
    const char *slash = strrchr(path, '/');
    size_t dir_len = slash ? (size_t)(slash - path) + 1 : 0;
    static const char pattern[] = ".ampTrain-export-XXXXXX";
    char *tmp = malloc(dir_len + sizeof pattern);
    if (tmp) {
        memcpy(tmp, path, dir_len);
        memcpy(tmp + dir_len, pattern, sizeof pattern);
    }
    return tmp;
}

/* The mode open(O_CREAT, 0666) would give: mkstemp makes 0600, and the umask can only be read by setting it
 * (export is one thread at this point). */
static mode_t created_mode(void)
{
    mode_t mask = umask(0);
    umask(mask);
    return 0666 & ~mask;
}

enum amp_status safetensors_write(const char *path, const struct safetensor *tensors, int n,
                                  const struct safetensors_meta *meta, int nmeta, struct amp_error *err)
{
    for (int i = 0; i < n; i++)
        if (tensors[i].ndim < 0 || tensors[i].ndim > SAFETENSORS_MAX_DIMS || tensors[i].dtype >= DT_COUNT)
            return amp_fail(err, AMP_ERR_INTERNAL, NULL, "cannot write %s: tensor '%s' has %d dimensions", path,
                            tensors[i].name, tensors[i].ndim);
    size_t hlen = 0;
    char *header = build_header(tensors, n, meta, nmeta, &hlen);
    char *tmp = header ? temp_name_beside(path) : NULL;
    if (!tmp) {
        free(header);
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "cannot write %s: out of memory for its header", path);
    }
    struct write_guard g;
    guard_begin(&g);
    int fd = mkstemp(tmp), sig = 0;
    bool ok = fd >= 0, made = ok;
    int e = errno;
    ok = ok && fchmod(fd, created_mode()) == 0 && write_contents(fd, header, hlen, tensors, n, &sig);
    if (!ok)
        e = errno;
    if (fd >= 0 && close(fd) != 0 && ok) {
        e = errno;
        ok = false;
    }
    if (ok && rename(tmp, path) != 0) {
        e = errno;
        ok = false;
    }
    if (!ok && made)
        unlink(tmp);
    guard_end(&g, sig != 0);
    free(tmp);
    free(header);
    if (sig)
        return amp_fail(err, sig == SIGINT ? AMP_EXIT_SIGINT : AMP_EXIT_SIGTERM, "run the export again to write it",
                        "stopped by %s while writing %s: its temporary file was removed and nothing new was written "
                        "there", sig == SIGINT ? "SIGINT" : "SIGTERM", path);
    char dir[4096];
    dir_of(path, dir, sizeof dir);
    if (!ok && (e == ENOENT || e == ENOTDIR)) /* not a full disk: say what is missing */
        return amp_fail(err, AMP_ERR_INTERNAL, "create the directory first, or give OUT in one that exists",
                        "cannot write %s: the directory %s does not exist (nothing was written there)", path, dir);
    if (!ok)
        return amp_fail(err, AMP_ERR_INTERNAL, e == EACCES || e == EPERM || e == EROFS ?
                        "check the permissions of the output's directory" : HINT_WRITE,
                        "cannot write %s: %s (nothing was written there)", path, strerror(e ? e : EIO));
    int dfd = open(dir, O_RDONLY | O_DIRECTORY);
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
    return AMP_OK;
}

bool safetensors_sniff(const unsigned char *head, size_t size)
{
    if (size < 9)
        return false;
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = n << 8 | head[i];
    return n <= size - 8 && head[8] == '{';
}

/* ---- reading: a strict parser of this format's JSON ------------------------------------------------ */

struct parser {
    const unsigned char *p, *end;
    const unsigned char *start;
    const char *file;
    const char *tensor; /* the entry being parsed, for messages (NULL outside one) */
    struct amp_error *err;
    bool failed;
};

/* Record the first syntax error; returns false so that callers can `return bad(...)`. */
static bool bad(struct parser *ps, const char *what)
{
    if (!ps->failed)
        amp_fail(ps->err, AMP_ERR_CKPT, HINT_BAD, "%s: malformed safetensors header at byte %zu of the JSON%s%s%s: %s",
                 ps->file, (size_t)(ps->p - ps->start), ps->tensor ? " (the entry of tensor '" : "",
                 ps->tensor ? ps->tensor : "", ps->tensor ? "')" : "", what);
    ps->failed = true;
    return false;
}

static void skip_ws(struct parser *ps)
{
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r'))
        ps->p++;
}

static bool expect(struct parser *ps, char c)
{
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == (unsigned char)c) {
        ps->p++;
        return true;
    }
    char what[48];
    if (ps->p >= ps->end)
        snprintf(what, sizeof what, "'%c' expected, the header ends", c);
    else
        snprintf(what, sizeof what, "'%c' expected, found '%c'", c, *ps->p >= 0x20 && *ps->p < 0x7f ? *ps->p : '?');
    return bad(ps, what);
}

static int hex4(const unsigned char *p)
{
    int v = 0;
    for (int i = 0; i < 4; i++) {
        int c = p[i], d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                                        : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0)
            return -1;
        v = v * 16 + d;
    }
    return v;
}

static size_t put_utf8(unsigned char *o, unsigned long cp)
{
    if (cp < 0x80) {
        o[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (unsigned char)(0xC0 | cp >> 6);
        o[1] = (unsigned char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (unsigned char)(0xE0 | cp >> 12);
        o[1] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
        o[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (unsigned char)(0xF0 | cp >> 18);
    o[1] = (unsigned char)(0x80 | (cp >> 12 & 0x3F));
    o[2] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
    o[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

/* A JSON string, unescaped into a new NUL-terminated buffer (NULL after bad()). \u0000 is refused: names are
 * C strings. */
static char *parse_string(struct parser *ps)
{
    if (!expect(ps, '"'))
        return NULL;
    const unsigned char *q = ps->p;
    while (q < ps->end && *q != '"')
        q += *q == '\\' && q + 1 < ps->end ? 2 : 1;
    if (q >= ps->end) {
        bad(ps, "unterminated string");
        return NULL;
    }
    unsigned char *out = malloc((size_t)(q - ps->p) + 1), *o = out; /* unescaping never lengthens */
    if (!out) {
        bad(ps, "out of memory");
        return NULL;
    }
    while (*ps->p != '"') {
        unsigned char c = *ps->p++;
        if (c < 0x20) {
            ps->p--;
            bad(ps, "a control character in a string");
            free(out);
            return NULL;
        }
        if (c != '\\') {
            *o++ = c;
            continue;
        }
        c = *ps->p++;
        const char *simple = strchr("\"\\/bfnrt", c);
        if (c && simple) {
            static const char to[] = "\"\\/\b\f\n\r\t";
            *o++ = (unsigned char)to[simple - "\"\\/bfnrt"];
            continue;
        }
        long cp = c == 'u' && ps->end - ps->p >= 4 ? hex4(ps->p) : -1;
        if (cp >= 0)
            ps->p += 4;
        if (cp >= 0xD800 && cp < 0xDC00) { /* a surrogate pair */
            long lo = ps->end - ps->p >= 6 && ps->p[0] == '\\' && ps->p[1] == 'u' ? hex4(ps->p + 2) : -1;
            if (lo >= 0xDC00 && lo < 0xE000) {
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                ps->p += 6;
            } else {
                cp = -1;
            }
        } else if (cp >= 0xDC00 && cp < 0xE000) {
            cp = -1;
        }
        if (cp <= 0) {
            bad(ps, cp == 0 ? "\\u0000 in a string" : "a bad escape in a string");
            free(out);
            return NULL;
        }
        o += put_utf8(o, (unsigned long)cp);
    }
    ps->p++;
    *o = '\0';
    return (char *)out;
}

/* A non-negative integer without sign, fraction or exponent, at most 2^63 - 1. */
static bool parse_uint(struct parser *ps, uint64_t *v)
{
    skip_ws(ps);
    if (ps->p >= ps->end || *ps->p < '0' || *ps->p > '9')
        return bad(ps, "a non-negative integer expected");
    if (*ps->p == '0' && ps->p + 1 < ps->end && ps->p[1] >= '0' && ps->p[1] <= '9')
        return bad(ps, "an integer with a leading zero");
    uint64_t x = 0;
    while (ps->p < ps->end && *ps->p >= '0' && *ps->p <= '9') {
        unsigned d = (unsigned)(*ps->p - '0');
        if (x > ((uint64_t)INT64_MAX - d) / 10)
            return bad(ps, "an integer beyond 2^63 - 1");
        x = x * 10 + d;
        ps->p++;
    }
    if (ps->p < ps->end && (*ps->p == '.' || *ps->p == 'e' || *ps->p == 'E'))
        return bad(ps, "a fraction or exponent where an integer belongs");
    *v = x;
    return true;
}

/* [u, u, ...] into v (at most max values; *n receives the count). */
static bool parse_uint_array(struct parser *ps, uint64_t *v, int max, int *n, const char *what)
{
    *n = 0;
    if (!expect(ps, '['))
        return false;
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == ']') {
        ps->p++;
        return true;
    }
    for (;;) {
        if (*n == max)
            return bad(ps, what);
        if (!parse_uint(ps, &v[(*n)++]))
            return false;
        skip_ws(ps);
        if (ps->p < ps->end && *ps->p == ',') {
            ps->p++;
            continue;
        }
        return expect(ps, ']');
    }
}

/* The parsed form of one entry, before the checks across entries. */
struct entry {
    char *name;
    char *dtype;
    uint64_t shape[SAFETENSORS_MAX_DIMS];
    int ndim;
    uint64_t off[2];
    int noff;
};

/* {"dtype": "...", "shape": [...], "data_offsets": [b, e]}, each key exactly once, nothing else. */
static bool parse_entry(struct parser *ps, struct entry *e)
{
    ps->tensor = e->name;
    if (!expect(ps, '{'))
        return false;
    bool seen[3] = {false, false, false};
    for (;;) {
        char *key = parse_string(ps);
        if (!key)
            return false;
        int k = !strcmp(key, "dtype") ? 0 : !strcmp(key, "shape") ? 1 : !strcmp(key, "data_offsets") ? 2 : -1;
        if (k < 0 || seen[k]) {
            free(key);
            return bad(ps, k < 0 ? "an unknown key (an entry has dtype, shape and data_offsets)" : "a repeated key");
        }
        free(key);
        seen[k] = true;
        if (!expect(ps, ':'))
            return false;
        bool ok = k == 0 ? (e->dtype = parse_string(ps)) != NULL
                : k == 1 ? parse_uint_array(ps, e->shape, SAFETENSORS_MAX_DIMS, &e->ndim, "a shape has more than 8 dimensions")
                         : parse_uint_array(ps, e->off, 2, &e->noff, "data_offsets has more than 2 values");
        if (!ok)
            return false;
        skip_ws(ps);
        if (ps->p < ps->end && *ps->p == ',') {
            ps->p++;
            continue;
        }
        if (!expect(ps, '}'))
            return false;
        break;
    }
    if (!seen[0] || !seen[1] || !seen[2])
        return bad(ps, !seen[0] ? "no dtype" : !seen[1] ? "no shape" : "no data_offsets");
    if (e->noff != 2)
        return bad(ps, "data_offsets must be [begin, end]");
    ps->tensor = NULL;
    return true;
}

/* Room for one more metadata entry. The arrays double: growing them by one entry at a time copied them at each
 * entry wherever realloc cannot grow a block in place (under ASan always), quadratic in the number of entries. */
static bool metadata_reserve(struct safetensors_file *f, int *cap)
{
    if (f->nmeta < *cap)
        return true;
    if (*cap > INT32_MAX / 2)
        return false;
    int ncap = *cap ? 2 * *cap : 16;
    char **k = realloc(f->meta_keys, (size_t)ncap * sizeof *k);
    if (k)
        f->meta_keys = k;
    char **v = k ? realloc(f->meta_values, (size_t)ncap * sizeof *v) : NULL;
    if (v)
        f->meta_values = v;
    if (!k || !v)
        return false;
    *cap = ncap;
    return true;
}

/* {"key": "value", ...} into f's metadata. */
static bool parse_metadata(struct parser *ps, struct safetensors_file *f)
{
    if (!expect(ps, '{'))
        return false;
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == '}') {
        ps->p++;
        return true;
    }
    int cap = f->nmeta;
    for (;;) {
        char *key = parse_string(ps), *value = NULL;
        if (key && expect(ps, ':')) {
            skip_ws(ps);
            if (ps->p < ps->end && *ps->p != '"')
                bad(ps, "__metadata__ values must be strings");
            else
                value = parse_string(ps);
        }
        if (!value) {
            free(key);
            return false;
        }
        if (!metadata_reserve(f, &cap)) {
            free(key);
            free(value);
            return bad(ps, "out of memory");
        }
        f->meta_keys[f->nmeta] = key;
        f->meta_values[f->nmeta++] = value;
        skip_ws(ps);
        if (ps->p < ps->end && *ps->p == ',') {
            ps->p++;
            continue;
        }
        return expect(ps, '}');
    }
}

static void entries_free(struct entry *e, int n)
{
    for (int i = 0; i < n; i++) {
        free(e[i].name);
        free(e[i].dtype);
    }
    free(e);
}

/* The whole header: entries (names owned) and metadata. */
static bool parse_header(struct parser *ps, struct safetensors_file *f, struct entry **out, int *nout)
{
    struct entry *es = NULL;
    int n = 0, cap = 0;
    bool ok = expect(ps, '{'), meta_seen = false;
    skip_ws(ps);
    if (ok && ps->p < ps->end && *ps->p == '}') {
        ps->p++;
    } else {
        while (ok) {
            char *name = parse_string(ps);
            ok = name && expect(ps, ':');
            if (ok && !strcmp(name, "__metadata__")) {
                if (meta_seen)
                    ok = bad(ps, "__metadata__ appears twice");
                meta_seen = true;
                ok = ok && parse_metadata(ps, f);
                free(name);
                name = NULL;
            } else if (ok) {
                if (n == cap) {
                    cap = cap ? 2 * cap : 64;
                    struct entry *g = realloc(es, (size_t)cap * sizeof *g);
                    if (!g) {
                        free(name);
                        ok = bad(ps, "out of memory");
                        break;
                    }
                    es = g;
                }
                es[n] = (struct entry){.name = name};
                name = NULL;
                ok = parse_entry(ps, &es[n++]);
            }
            free(name);
            if (!ok)
                break;
            skip_ws(ps);
            if (ps->p < ps->end && *ps->p == ',') {
                ps->p++;
                continue;
            }
            ok = expect(ps, '}');
            break;
        }
    }
    skip_ws(ps);
    if (ok && ps->p != ps->end)
        ok = bad(ps, "text after the header's object (only spaces may pad it)");
    if (!ok) {
        entries_free(es, n);
        return false;
    }
    *out = es;
    *nout = n;
    return true;
}

/* ---- reading: the checks across entries ------------------------------------------------------------- */

static bool dtype_from_name(const char *s, enum dtype *dt)
{
    static const struct {
        const char *name;
        enum dtype dt;
    } taken[] = {{"F32", DT_FP32}, {"F16", DT_FP16}, {"BF16", DT_BF16}};
    for (size_t i = 0; i < sizeof taken / sizeof taken[0]; i++)
        if (!strcmp(s, taken[i].name)) {
            *dt = taken[i].dt;
            return true;
        }
    return false;
}

static bool known_dtype(const char *s)
{
    static const char *const all[] = {"BOOL", "U8",  "I8",  "F8_E5M2", "F8_E4M3", "I16", "U16",
                                      "I32",  "U32", "I64", "U64",     "F64",     "F4",  "F6_E2M3",
                                      "F6_E3M2", "F8_E8M0", "E8M0", "C64"};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (!strcmp(s, all[i]))
            return true;
    return false;
}

static int cmp_name(const void *a, const void *b)
{
    return strcmp((*(const struct entry *const *)a)->name, (*(const struct entry *const *)b)->name);
}

static int cmp_begin(const void *a, const void *b)
{
    const struct entry *x = *(const struct entry *const *)a, *y = *(const struct entry *const *)b;
    return x->off[0] < y->off[0] ? -1 : x->off[0] > y->off[0] ? 1 : x->off[1] < y->off[1] ? -1 : x->off[1] > y->off[1];
}

/* Each entry alone: dtype, begin <= end, inside the data, bytes = numel * dtype size. */
static enum amp_status check_entry(const struct entry *e, uint64_t data_len, const char *file, struct safetensor *t,
                                   struct amp_error *err)
{
    if (!dtype_from_name(e->dtype, &t->dtype))
        return amp_fail(err, AMP_ERR_CKPT, "ampTrain takes F32, F16 and BF16 tensors: convert the file to one of them",
                        "%s: tensor '%s' has dtype '%s'%s", file, e->name, e->dtype,
                        known_dtype(e->dtype) ? ", which ampTrain does not take" : ", which safetensors does not define");
    if (e->off[0] > e->off[1])
        return amp_fail(err, AMP_ERR_CKPT, HINT_BAD, "%s: tensor '%s' has data_offsets [%llu, %llu]: begin after end",
                        file, e->name, (unsigned long long)e->off[0], (unsigned long long)e->off[1]);
    if (e->off[1] > data_len)
        return amp_fail(err, AMP_ERR_CKPT, HINT_BAD,
                        "%s: tensor '%s' has data_offsets [%llu, %llu], past the end of the data (%llu bytes; the file "
                        "is truncated?)",
                        file, e->name, (unsigned long long)e->off[0], (unsigned long long)e->off[1],
                        (unsigned long long)data_len);
    uint64_t numel = 1;
    bool overflow = false;
    for (int i = 0; i < e->ndim; i++) {
        if (e->shape[i] && numel > UINT64_MAX / e->shape[i])
            overflow = true;
        numel *= e->shape[i];
        t->shape[i] = (int64_t)e->shape[i];
    }
    uint64_t want = numel * dtype_size(t->dtype);
    if (overflow || want / dtype_size(t->dtype) != numel || want != e->off[1] - e->off[0])
        return amp_fail(err, AMP_ERR_CKPT, HINT_BAD,
                        "%s: tensor '%s': its shape and dtype %s make %s%llu bytes, but data_offsets [%llu, %llu] hold "
                        "%llu",
                        file, e->name, e->dtype, overflow || want / dtype_size(t->dtype) != numel ? "more than 2^64: " : "",
                        (unsigned long long)want, (unsigned long long)e->off[0], (unsigned long long)e->off[1],
                        (unsigned long long)(e->off[1] - e->off[0]));
    t->ndim = e->ndim;
    t->nbytes = (size_t)want;
    return AMP_OK;
}

/* Names unique; the ranges back to back from 0 to the end of the data. */
static enum amp_status check_entries(struct entry *es, int n, uint64_t data_len, const char *file, struct amp_error *err)
{
    struct entry **by = malloc((size_t)(n ? n : 1) * sizeof *by);
    if (!by)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory reading %s", file);
    for (int i = 0; i < n; i++)
        by[i] = &es[i];
    enum amp_status st = AMP_OK;
    qsort(by, (size_t)n, sizeof *by, cmp_name);
    for (int i = 1; i < n && st == AMP_OK; i++)
        if (!strcmp(by[i - 1]->name, by[i]->name))
            st = amp_fail(err, AMP_ERR_CKPT, HINT_BAD, "%s: tensor '%s' appears twice in the header", file, by[i]->name);
    qsort(by, (size_t)n, sizeof *by, cmp_begin);
    uint64_t pos = 0;
    for (int i = 0; i < n && st == AMP_OK; i++) {
        const struct entry *e = by[i];
        if (e->off[0] < pos)
            st = amp_fail(err, AMP_ERR_CKPT, HINT_BAD,
                          "%s: tensor '%s' (data_offsets [%llu, %llu]) overlaps tensor '%s' (which ends at %llu)", file,
                          e->name, (unsigned long long)e->off[0], (unsigned long long)e->off[1], by[i - 1]->name,
                          (unsigned long long)pos);
        else if (e->off[0] > pos)
            st = amp_fail(err, AMP_ERR_CKPT, HINT_BAD,
                          "%s: tensor '%s' begins at %llu, leaving %llu bytes before it that no tensor covers", file,
                          e->name, (unsigned long long)e->off[0], (unsigned long long)(e->off[0] - pos));
        pos = e->off[1];
    }
    if (st == AMP_OK && pos != data_len)
        st = amp_fail(err, AMP_ERR_CKPT, HINT_BAD,
                      "%s: the tensors cover %llu bytes of data but the file holds %llu after the header: the data "
                      "section must be covered exactly",
                      file, (unsigned long long)pos, (unsigned long long)data_len);
    free(by);
    return st;
}

/* ---- reading: naming a file of another format --------------------------------------------------------- */

/* A file being read, in memory (bytes) or open (fd), for looking at a few bytes anywhere in it. */
struct peek {
    const unsigned char *bytes;
    int fd;
    size_t size;
};

static bool peek_at(const struct peek *p, size_t off, void *buf, size_t n)
{
    if (off > p->size || n > p->size - off)
        return false;
    if (p->bytes) {
        memcpy(buf, p->bytes + off, n);
        return true;
    }
    return pread(p->fd, buf, n, (off_t)off) == (ssize_t)n;
}

#define HINT_TORCH "convert it in Python: safetensors.torch.save_file(torch.load(PATH, map_location='cpu'), " \
                   "'model.safetensors') (a state_dict; for a whole model, its .state_dict())"

/* Formats people hand to model.init_from instead of safetensors, by their magic bytes at offset 0. A pickle's
 * two bytes are followed by an opcode, never 0: the bytes 80 02 00 of a (truncated) safetensors file whose header
 * is 640 bytes long are not a pickle. */
static const struct foreign {
    const char *magic;
    size_t len;
    const char *what, *hint;
} foreign_formats[] = {
    {"AMPTCKPT", 8, "an ampTrain checkpoint",
     "model.init_from reads checkpoints as they are; to make a safetensors file: ampTrain export CKPT OUT.safetensors"},
    {"PK\x03\x04", 4, "a ZIP archive (PyTorch's torch.save format: .bin, .pt, .pth)", HINT_TORCH},
    {"\x80\x02", 2, "a Python pickle, protocol 2 (PyTorch's legacy torch.save format: .bin, .pt)", HINT_TORCH},
    {"\x80\x03", 2, "a Python pickle, protocol 3 (PyTorch's legacy torch.save format: .bin, .pt)", HINT_TORCH},
    {"\x80\x04", 2, "a Python pickle, protocol 4 (PyTorch's legacy torch.save format: .bin, .pt)", HINT_TORCH},
    {"\x80\x05", 2, "a Python pickle, protocol 5 (PyTorch's legacy torch.save format: .bin, .pt)", HINT_TORCH},
    {"GGUF", 4, "a GGUF file (llama.cpp)",
     "convert it to safetensors first (the gguf Python package reads it; safetensors.numpy.save_file writes)"},
};

#define HDF5_MAGIC "\x89HDF\r\n\x1a\n"

/* HDF5 puts its signature at 0, or after a user block at 512, 1024, 2048, ... bytes. */
static bool looks_hdf5(const struct peek *p)
{
    unsigned char sig[8];
    for (size_t off = 0; off <= p->size - sizeof sig && off < ((size_t)1 << 62); off = off ? 2 * off : 512)
        if (peek_at(p, off, sig, sizeof sig) && !memcmp(sig, HDF5_MAGIC, sizeof sig))
            return true;
    return false;
}

/* Replace a refusal of the file's first bytes by the format they show, where one is recognised. */
static void name_foreign_format(const struct peek *p, const char *name, struct amp_error *err)
{
    unsigned char head[8] = {0};
    size_t n = p->size < sizeof head ? p->size : sizeof head;
    if (!peek_at(p, 0, head, n))
        return;
    for (size_t i = 0; i < sizeof foreign_formats / sizeof foreign_formats[0]; i++) {
        const struct foreign *f = &foreign_formats[i];
        bool pickle = f->magic[0] == '\x80';
        if (n >= f->len + pickle && !memcmp(head, f->magic, f->len) && (!pickle || head[2] != 0)) {
            amp_fail(err, AMP_ERR_CKPT, f->hint, "%s is %s, not a safetensors file", name, f->what);
            return;
        }
    }
    if (p->size >= 8 && looks_hdf5(p))
        amp_fail(err, AMP_ERR_CKPT,
                 "convert the weights in Python: safetensors.numpy.save_file({name: array, ...}, 'model.safetensors') "
                 "(Keras: model.load_weights, then each layer's get_weights())",
                 "%s is an HDF5 file (Keras .h5, h5py), not a safetensors file", name);
}

/* The first 9 bytes of a file of `size` (fewer when the file is shorter): the header length, against the cap and
 * the file, and the header's '{'. Enough to refuse a file that is not safetensors before reading the rest. */
static enum amp_status check_prefix(const unsigned char *head, size_t size, const char *name, uint64_t *len,
                                    struct amp_error *err)
{
    uint64_t n = 0;
    for (int i = 7; size >= 8 && i >= 0; i--)
        n = n << 8 | head[i];
    *len = n;
    if (size < 8)
        return amp_fail(err, AMP_ERR_CKPT, HINT_BAD, "%s: %zu bytes, too short for a safetensors file (8-byte header "
                                                     "length)", name, size);
    if (n > SAFETENSORS_MAX_HEADER)
        return amp_fail(err, AMP_ERR_CKPT, HINT_BAD, "%s: the header length is %llu bytes, beyond the %u-byte limit",
                        name, (unsigned long long)n, SAFETENSORS_MAX_HEADER);
    if (n > size - 8)
        return amp_fail(err, AMP_ERR_CKPT, HINT_BAD,
                        "%s: the header length is %llu bytes but the file has only %zu after it (truncated, or not a "
                        "safetensors file)", name, (unsigned long long)n, size - 8);
    if (n == 0 || head[8] != '{')
        return amp_fail(err, AMP_ERR_CKPT, HINT_BAD, "%s: the header does not start with '{' (not a safetensors file)",
                        name);
    return AMP_OK;
}

/* check_prefix on the file's first bytes; a refusal names the file's format where its magic bytes show one. */
static enum amp_status check_start(const struct peek *p, const char *name, uint64_t *len, struct amp_error *err)
{
    unsigned char head[9] = {0};
    size_t n = p->size < sizeof head ? p->size : sizeof head;
    if (!peek_at(p, 0, head, n))
        return amp_fail(err, AMP_ERR_CKPT, "check the disk and the file, and retry", "cannot read %s: %s", name,
                        strerror(errno ? errno : EIO));
    enum amp_status st = check_prefix(head, p->size, name, len, err);
    if (st != AMP_OK)
        name_foreign_format(p, name, err);
    return st;
}

/* Validate the file's bytes, taking ownership of `bytes` (freed on failure). */
static enum amp_status parse_owned(unsigned char *bytes, size_t size, const char *name, struct safetensors_file *f,
                                   struct amp_error *err)
{
    memset(f, 0, sizeof *f);
    f->bytes = bytes;
    f->size = size;
    uint64_t n = 0;
    enum amp_status st = check_start(&(struct peek){.bytes = bytes, .fd = -1, .size = size}, name, &n, err);
    if (st != AMP_OK) {
        safetensors_free(f);
        return st;
    }
    f->data_start = 8 + (size_t)n;
    struct parser ps = {.p = f->bytes + 8, .end = f->bytes + 8 + n, .start = f->bytes + 8, .file = name, .err = err};
    struct entry *es = NULL;
    int ne = 0;
    if (!parse_header(&ps, f, &es, &ne)) {
        safetensors_free(f);
        return AMP_ERR_CKPT;
    }
    uint64_t data_len = size - f->data_start;
    f->tensors = calloc((size_t)(ne ? ne : 1), sizeof *f->tensors);
    if (!f->tensors)
        st = amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory reading %s", name);
    for (int i = 0; i < ne && st == AMP_OK; i++)
        st = check_entry(&es[i], data_len, name, &f->tensors[i], err);
    if (st == AMP_OK)
        st = check_entries(es, ne, data_len, name, err);
    if (st == AMP_OK) {
        for (int i = 0; i < ne; i++) {
            f->tensors[i].name = es[i].name;
            es[i].name = NULL;
            f->tensors[i].data = f->bytes + f->data_start + es[i].off[0];
        }
        f->ntensors = ne;
    }
    entries_free(es, ne);
    if (st != AMP_OK)
        safetensors_free(f);
    return st;
}

enum amp_status safetensors_parse(const unsigned char *bytes, size_t size, const char *name, struct safetensors_file *f,
                                  struct amp_error *err)
{
    memset(f, 0, sizeof *f);
    unsigned char *copy = malloc(size ? size : 1);
    if (!copy)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory reading %s (%zu bytes)", name, size);
    if (size)
        memcpy(copy, bytes, size);
    return parse_owned(copy, size, name, f, err);
}

/* Exactly n bytes at off; false with errno set (EIO for a file that ends early). */
static bool read_at(int fd, unsigned char *buf, size_t n, size_t off)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = pread(fd, buf + got, n - got, (off_t)(off + got));
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            if (r == 0)
                errno = EIO;
            return false;
        }
        got += (size_t)r;
    }
    return true;
}

static enum amp_status read_failed(const char *path, int e, struct amp_error *err)
{
    return amp_fail(err, AMP_ERR_CKPT, "check the disk and the file, and retry", "cannot read %s: %s", path,
                    strerror(e ? e : EIO));
}

/* The file in three reads, each only once the one before has passed its checks: the 9 bytes of check_prefix, the
 * header (parsed and checked against the file's size), then the data. A large file that is not safetensors is
 * refused after reading 9 bytes, not all of it. */
static enum amp_status read_checked(int fd, size_t size, const char *path, struct safetensors_file *f,
                                    struct amp_error *err)
{
    uint64_t n = 0;
    enum amp_status st = check_start(&(struct peek){.fd = fd, .size = size}, path, &n, err);
    if (st != AMP_OK)
        return st;
    unsigned char *buf = malloc(size); /* pages of the data are touched only once the header has passed */
    if (!buf)
        return amp_fail(err, AMP_ERR_INTERNAL, "free some memory and retry", "out of memory reading %s (%zu bytes)",
                        path, size);
    if (!read_at(fd, buf, 8 + (size_t)n, 0)) {
        int e = errno;
        free(buf);
        return read_failed(path, e, err);
    }
    if ((st = parse_owned(buf, size, path, f, err)) != AMP_OK)
        return st;
    if (!read_at(fd, f->bytes + f->data_start, size - f->data_start, f->data_start)) {
        int e = errno;
        safetensors_free(f);
        return read_failed(path, e, err);
    }
    return AMP_OK;
}

enum amp_status safetensors_read(const char *path, struct safetensors_file *f, struct amp_error *err)
{
    memset(f, 0, sizeof *f);
    int fd = open(path, O_RDONLY | O_NONBLOCK);
    if (fd < 0)
        return amp_fail(err, AMP_ERR_CKPT, "give the path of a .safetensors file", "cannot open %s: %s", path,
                        strerror(errno));
    struct stat sb;
    enum amp_status st;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode))
        st = amp_fail(err, AMP_ERR_CKPT, "give the path of a .safetensors file", "%s is not a regular file", path);
    else
        st = read_checked(fd, (size_t)sb.st_size, path, f, err);
    close(fd);
    return st;
}

const struct safetensor *safetensors_find(const struct safetensors_file *f, const char *name)
{
    for (int i = 0; i < f->ntensors; i++)
        if (!strcmp(f->tensors[i].name, name))
            return &f->tensors[i];
    return NULL;
}

void safetensors_free(struct safetensors_file *f)
{
    if (!f)
        return;
    for (int i = 0; i < f->ntensors; i++)
        free(f->tensors[i].name);
    free(f->tensors);
    for (int i = 0; i < f->nmeta; i++) {
        free(f->meta_keys[i]);
        free(f->meta_values[i]);
    }
    free(f->meta_keys);
    free(f->meta_values);
    free(f->bytes);
    memset(f, 0, sizeof *f);
}
