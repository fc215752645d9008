/*
 * tboard.c — TensorBoard event files: TFRecord framing and the few Event, Summary, SessionLog and TensorProto
 * fields a scalar and a text need, encoded by hand. See tboard.h for the format and the durability rules.
 */
#define _POSIX_C_SOURCE 200809L /* gethostname, pwrite, ftruncate */
#include "tboard.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* A growable byte string: a protobuf message being encoded, or the records waiting for a flush. `oom` is set
 * once an append could not grow it (what it holds is then incomplete and never written). */
struct bytes {
    uint8_t *p;
    size_t n, cap;
    bool oom;
};

struct tboard {
    char path[4096];
    int fd;
    uint64_t size;      /* bytes of whole records in the file */
    struct bytes queue; /* whole records not yet written */
    char failure[512];  /* why a buffering or a write failed ("" while all is well); reported by every flush */
};

/* ---- CRC-32C ------------------------------------------------------------------------------------ */

uint32_t tboard_crc32c(const void *data, size_t n)
{
    const uint8_t *b = data;
    uint32_t crc = 0xffffffffu;
    for (size_t i = 0; i < n; i++) {
        crc ^= b[i];
        for (int k = 0; k < 8; k++)
            crc = (crc >> 1) ^ (0x82f63b78u & (0u - (crc & 1u))); /* Castagnoli, reflected */
    }
    return crc ^ 0xffffffffu;
}

uint32_t tboard_mask_crc(uint32_t crc)
{
    return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

/* ---- protobuf encoding -------------------------------------------------------------------------- */

static void bytes_put(struct bytes *b, const void *src, size_t n)
{
    if (b->oom)
        return;
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n)
            cap *= 2;
        uint8_t *p = realloc(b->p, cap);
        if (!p) {
            b->oom = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    if (n)
        memcpy(b->p + b->n, src, n);
    b->n += n;
}

static void put_le(struct bytes *b, uint64_t v, int nbytes)
{
    uint8_t le[8];
    for (int i = 0; i < nbytes; i++)
        le[i] = (uint8_t)(v >> (8 * i));
    bytes_put(b, le, (size_t)nbytes);
}

static void put_varint(struct bytes *b, uint64_t v)
{
    uint8_t out[10];
    size_t n = 0;
    do {
        out[n] = (uint8_t)(v & 0x7f);
        v >>= 7;
        out[n++] |= v ? 0x80 : 0;
    } while (v);
    bytes_put(b, out, n);
}

enum wire { WIRE_VARINT = 0, WIRE_FIXED64 = 1, WIRE_LEN = 2, WIRE_FIXED32 = 5 };

static void put_key(struct bytes *b, unsigned field, enum wire wt)
{
    put_varint(b, (uint64_t)field << 3 | (uint64_t)wt);
}

static void put_field_bytes(struct bytes *b, unsigned field, const void *data, size_t n)
{
    put_key(b, field, WIRE_LEN);
    put_varint(b, n);
    bytes_put(b, data, n);
}

static void put_field_message(struct bytes *b, unsigned field, const struct bytes *msg)
{
    b->oom = b->oom || msg->oom;
    put_field_bytes(b, field, msg->p, msg->n);
}

static void put_field_string(struct bytes *b, unsigned field, const char *s)
{
    put_field_bytes(b, field, s, strlen(s));
}

/* Field numbers of tensorflow.Event (tensorboard/compat/proto/event.proto) and the messages inside it. */
enum {
    EVENT_WALL_TIME = 1, /* double */
    EVENT_STEP = 2,      /* int64 */
    EVENT_FILE_VERSION = 3,
    EVENT_SUMMARY = 5,
    EVENT_SESSION_LOG = 7,
    SESSION_LOG_STATUS = 1, /* enum: START = 1 */
    SUMMARY_VALUE = 1,      /* repeated Summary.Value */
    VALUE_TAG = 1,
    VALUE_SIMPLE_VALUE = 2, /* float */
    VALUE_TENSOR = 8,
    VALUE_METADATA = 9,
    METADATA_PLUGIN_DATA = 1,
    PLUGIN_DATA_NAME = 1,
    TENSOR_DTYPE = 1,       /* enum: DT_STRING = 7 */
    TENSOR_SHAPE = 2,       /* empty: a scalar */
    TENSOR_STRING_VAL = 8,
};

static double wall_time(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Event { wall_time, step } without its payload: the caller appends one. */
static void event_head(struct bytes *ev, int64_t step)
{
    double t = wall_time();
    uint64_t bits;
    memcpy(&bits, &t, sizeof bits);
    put_key(ev, EVENT_WALL_TIME, WIRE_FIXED64);
    put_le(ev, bits, 8);
    if (step != 0) { /* proto3: a zero is left out */
        put_key(ev, EVENT_STEP, WIRE_VARINT);
        put_varint(ev, (uint64_t)step);
    }
}

/* ---- records ------------------------------------------------------------------------------------ */

static void fail(struct tboard *w, const char *what)
{
    if (!w->failure[0])
        snprintf(w->failure, sizeof w->failure, "%s", what);
}

/* Queue one TFRecord holding `ev` (and free it). */
static void queue_record(struct tboard *w, struct bytes *ev)
{
    if (ev->oom) {
        fail(w, "out of memory encoding an event");
    } else {
        struct bytes rec = {0};
        put_le(&rec, ev->n, 8);
        put_le(&rec, tboard_mask_crc(tboard_crc32c(rec.p, 8)), 4);
        bytes_put(&rec, ev->p, ev->n);
        put_le(&rec, tboard_mask_crc(tboard_crc32c(ev->p, ev->n)), 4);
        if (!rec.oom)
            bytes_put(&w->queue, rec.p, rec.n);
        if (rec.oom || w->queue.oom)
            fail(w, "out of memory buffering an event");
        free(rec.p);
    }
    free(ev->p);
    *ev = (struct bytes){0};
}

/* Queue an Event at `step` whose summary holds the one Summary.Value `value` (freed). */
static void queue_summary(struct tboard *w, int64_t step, struct bytes *value)
{
    struct bytes summary = {0}, ev = {0};
    put_field_message(&summary, SUMMARY_VALUE, value);
    event_head(&ev, step);
    put_field_message(&ev, EVENT_SUMMARY, &summary);
    free(summary.p);
    free(value->p);
    queue_record(w, &ev);
}

void tboard_scalar(struct tboard *w, int64_t step, const char *tag, double value)
{
    float f = (float)value;
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    struct bytes v = {0};
    put_field_string(&v, VALUE_TAG, tag);
    put_key(&v, VALUE_SIMPLE_VALUE, WIRE_FIXED32);
    put_le(&v, bits, 4);
    queue_summary(w, step, &v);
}

void tboard_text(struct tboard *w, int64_t step, const char *tag, const char *text)
{
    struct bytes plugin = {0}, meta = {0}, tensor = {0}, v = {0};
    put_field_string(&plugin, PLUGIN_DATA_NAME, "text"); /* content: an empty TextPluginData (version 0) */
    put_field_message(&meta, METADATA_PLUGIN_DATA, &plugin);
    put_key(&tensor, TENSOR_DTYPE, WIRE_VARINT);
    put_varint(&tensor, 7); /* DT_STRING */
    put_field_bytes(&tensor, TENSOR_SHAPE, NULL, 0);
    put_field_string(&tensor, TENSOR_STRING_VAL, text);
    put_field_string(&v, VALUE_TAG, tag);
    put_field_message(&v, VALUE_TENSOR, &tensor);
    put_field_message(&v, VALUE_METADATA, &meta);
    free(plugin.p);
    free(meta.p);
    free(tensor.p);
    queue_summary(w, step, &v);
}

/* Write one whole record at the end of the file; on failure cut the file back to its last whole record. */
static bool write_record(struct tboard *w, const uint8_t *rec, size_t n)
{
    size_t done = 0;
    while (done < n) {
        ssize_t k = pwrite(w->fd, rec + done, n - done, (off_t)(w->size + done));
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0) {
            char what[300];
            snprintf(what, sizeof what, "%s", k < 0 ? strerror(errno) : "no space left (a write wrote nothing)");
            if (done > 0 && ftruncate(w->fd, (off_t)w->size) != 0)
                snprintf(what + strlen(what), sizeof what - strlen(what), "; cutting it back failed: %s",
                         strerror(errno));
            fail(w, what);
            return false;
        }
        done += (size_t)k;
    }
    w->size += n;
    return true;
}

enum amp_status tboard_flush(struct tboard *w, struct amp_error *err)
{
    size_t at = 0;
    while (!w->failure[0] && at + 12 <= w->queue.n) {
        const uint8_t *r = w->queue.p + at;
        uint64_t len = 0;
        for (int i = 0; i < 8; i++)
            len |= (uint64_t)r[i] << (8 * i);
        if (!write_record(w, r, 16 + (size_t)len))
            break;
        at += 16 + (size_t)len;
    }
    w->queue.n = 0;
    if (w->failure[0])
        return amp_fail(err, AMP_ERR_INTERNAL, "check free disk space and the run directory (run.tensorboard: false "
                        "turns the event file off)", "cannot write TensorBoard event file %s: %s", w->path,
                        w->failure);
    return AMP_OK;
}

/* The seconds of the newest event file in `dir` (0 when none): a new file's name must sort after it. */
static long long newest_event_seconds(const char *dir)
{
    long long newest = 0;
    DIR *d = opendir(dir);
    if (!d)
        return 0;
    const size_t plen = strlen(TBOARD_PREFIX);
    struct dirent *e;
    while ((e = readdir(d)))
        if (!strncmp(e->d_name, TBOARD_PREFIX, plen)) {
            long long s = strtoll(e->d_name + plen, NULL, 10);
            newest = s > newest ? s : newest;
        }
    closedir(d);
    return newest;
}

/* Keep a host name to the characters a file name may safely hold. */
static void host_name(char *buf, size_t len)
{
    if (gethostname(buf, len) != 0 || !buf[0])
        snprintf(buf, len, "localhost");
    buf[len - 1] = '\0';
    for (char *p = buf; *p; p++)
        if (*p == '/' || (unsigned char)*p < 0x20)
            *p = '_';
}

enum amp_status tboard_open(struct tboard **out, const char *dir, int64_t first_step, struct amp_error *err)
{
    *out = NULL;
    struct tboard *w = calloc(1, sizeof *w);
    if (!w)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "out of memory opening a TensorBoard event file in %s", dir);
    char host[256];
    host_name(host, sizeof host);
    long long secs = (long long)time(NULL), newest = newest_event_seconds(dir);
    secs = newest >= secs ? newest + 1 : secs;
    w->fd = -1;
    for (int tries = 0; w->fd < 0 && tries < 100; tries++, secs++) {
        snprintf(w->path, sizeof w->path, "%s/" TBOARD_PREFIX "%lld.%s.%ld", dir, secs, host, (long)getpid());
        w->fd = open(w->path, O_WRONLY | O_CREAT | O_EXCL, 0666);
        if (w->fd < 0 && errno != EEXIST)
            break;
    }
    if (w->fd < 0) {
        enum amp_status st = amp_fail(err, AMP_ERR_INTERNAL, "check the run directory and its permissions",
                                      "cannot create TensorBoard event file %s: %s", w->path, strerror(errno));
        free(w);
        return st;
    }
    struct bytes ev = {0};
    event_head(&ev, 0);
    put_field_string(&ev, EVENT_FILE_VERSION, "brain.Event:2");
    queue_record(w, &ev);
    struct bytes log = {0};
    put_key(&log, SESSION_LOG_STATUS, WIRE_VARINT);
    put_varint(&log, 1); /* START */
    event_head(&ev, first_step);
    put_field_message(&ev, EVENT_SESSION_LOG, &log);
    free(log.p);
    queue_record(w, &ev);
    enum amp_status st = tboard_flush(w, err);
    if (st != AMP_OK) { /* no half-made event file left behind to count as a run's file */
        unlink(w->path);
        tboard_close(w, NULL);
        return st;
    }
    *out = w;
    return AMP_OK;
}

enum amp_status tboard_close(struct tboard *w, struct amp_error *err)
{
    if (!w)
        return AMP_OK;
    enum amp_status st = tboard_flush(w, err);
    if (close(w->fd) != 0 && st == AMP_OK)
        st = amp_fail(err, AMP_ERR_INTERNAL, "check free disk space", "cannot write TensorBoard event file %s: %s",
                      w->path, strerror(errno));
    free(w->queue.p);
    free(w);
    return st;
}

const char *tboard_path(const struct tboard *w)
{
    return w->path;
}
