/*
 * tokenizer.c — GPT-2-style byte-level BPE from Hugging Face's files. See tokenizer.h for the contract.
 *
 * The file is read whole and parsed by a small strict JSON reader into a tree of nodes (one array, indices for
 * links; strings unescaped into one pool as large as the file). The loader walks the tree once: the vocab into an
 * id -> token table and a token -> id hash, the merges into a (left id, right id) -> (rank, merged id) hash, the
 * added tokens into a list matched before pre-tokenization. Encoding splits the text at added tokens, splits each
 * stretch with GPT-2's pre-tokenizer regex (written out by hand: pretoken_len), and merges each piece's byte
 * symbols by rank with a binary heap (O(m log m) for a piece of m bytes). Decoding concatenates each id's bytes,
 * computed at load.
 */
#define _POSIX_C_SOURCE 200809L /* fstat, fileno */
#include "tokenizer.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tokenizer_unicode.h" /* unicode_letters, unicode_numbers */

#define HINT_FILE "give data.tokenizer a Hugging Face tokenizer.json, or a vocab.json with merges.txt beside it"
#define HINT_BPE "ampTrain reads GPT-2-style byte-level BPE only (model BPE, ByteLevel pre-tokenizer and decoder)"

/* ---- JSON: a strict reader into a tree ------------------------------------------------------------- */

enum jtype { J_NULL, J_FALSE, J_TRUE, J_NUM, J_STR, J_ARR, J_OBJ };

struct jnode {
    enum jtype type;
    size_t off;        /* byte offset of the value in the file */
    int32_t next;      /* next item of the enclosing array or object; -1 */
    int32_t child;     /* J_ARR, J_OBJ: first item or member; -1 */
    const char *key;   /* member of an object: its key (in the pool) */
    size_t key_len;
    const char *str;   /* J_STR: the unescaped string (in the pool), NUL-terminated */
    size_t len;        /* J_STR: its length */
    bool is_int;       /* J_NUM: an integer of at most 18 digits, in ival */
    int64_t ival;
};

struct json {
    const char *name; /* the file, for errors */
    const unsigned char *p;
    size_t n, pos;
    struct jnode *nodes;
    size_t nnodes, cap;
    char *pool; /* unescaped strings: never longer than the file */
    size_t pool_used;
    struct amp_error *err;
};

static enum amp_status json_fail(struct json *j, size_t off, const char *what)
{
    return amp_fail(j->err, AMP_ERR_DATA, HINT_FILE, "%s: byte %zu: %s", j->name, off, what);
}

static void json_skip_ws(struct json *j)
{
    while (j->pos < j->n && (j->p[j->pos] == ' ' || j->p[j->pos] == '\t' || j->p[j->pos] == '\n' || j->p[j->pos] == '\r'))
        j->pos++;
}

static int32_t json_new_node(struct json *j, enum jtype type)
{
    if (j->nnodes == j->cap) {
        size_t cap = j->cap ? 2 * j->cap : 1024;
        struct jnode *nodes = realloc(j->nodes, cap * sizeof *nodes);
        if (!nodes)
            return -1;
        j->nodes = nodes;
        j->cap = cap;
    }
    j->nodes[j->nnodes] = (struct jnode){.type = type, .off = j->pos, .next = -1, .child = -1};
    return (int32_t)j->nnodes++;
}

/* Length of the valid UTF-8 sequence at s (n bytes available) and its code point; 0 if invalid. */
static size_t utf8_decode(const unsigned char *s, size_t n, uint32_t *cp)
{
    if (s[0] < 0x80) {
        *cp = s[0];
        return 1;
    }
    size_t len = s[0] >= 0xC2 && s[0] <= 0xDF ? 2 : s[0] >= 0xE0 && s[0] <= 0xEF ? 3 : s[0] >= 0xF0 && s[0] <= 0xF4 ? 4 : 0;
    if (len == 0 || len > n)
        return 0;
    uint32_t c = s[0] & (0x7F >> len);
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return 0;
        c = c << 6 | (s[i] & 0x3F);
    }
    if ((len == 3 && (c < 0x800 || (c >= 0xD800 && c <= 0xDFFF))) || (len == 4 && (c < 0x10000 || c > 0x10FFFF)))
        return 0; /* overlong, surrogate, beyond Unicode */
    *cp = c;
    return len;
}

static size_t utf8_encode(uint32_t c, char *out)
{
    if (c < 0x80) {
        out[0] = (char)c;
        return 1;
    }
    if (c < 0x800) {
        out[0] = (char)(0xC0 | c >> 6);
        out[1] = (char)(0x80 | (c & 0x3F));
        return 2;
    }
    if (c < 0x10000) {
        out[0] = (char)(0xE0 | c >> 12);
        out[1] = (char)(0x80 | (c >> 6 & 0x3F));
        out[2] = (char)(0x80 | (c & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | c >> 18);
    out[1] = (char)(0x80 | (c >> 12 & 0x3F));
    out[2] = (char)(0x80 | (c >> 6 & 0x3F));
    out[3] = (char)(0x80 | (c & 0x3F));
    return 4;
}

static int hex4(const unsigned char *s)
{
    int v = 0;
    for (int i = 0; i < 4; i++) {
        int c = s[i], d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                                          : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0)
            return -1;
        v = v * 16 + d;
    }
    return v;
}

/* A string at j->pos (on its opening quote), unescaped into the pool. */
static enum amp_status json_string(struct json *j, const char **out, size_t *out_len)
{
    size_t start = j->pos++;
    char *dst = j->pool + j->pool_used, *w = dst;
    for (;;) {
        if (j->pos >= j->n)
            return json_fail(j, start, "a string that never ends (the file is cut short?)");
        unsigned char c = j->p[j->pos];
        if (c == '"') {
            j->pos++;
            break;
        }
        if (c < 0x20)
            return json_fail(j, j->pos, "a control character inside a string (escape it)");
        if (c != '\\') {
            uint32_t cp;
            size_t k = utf8_decode(j->p + j->pos, j->n - j->pos, &cp);
            if (k == 0)
                return json_fail(j, j->pos, "a string that is not valid UTF-8");
            memcpy(w, j->p + j->pos, k);
            w += k;
            j->pos += k;
            continue;
        }
        if (j->pos + 1 >= j->n)
            return json_fail(j, start, "a string that never ends (the file is cut short?)");
        char e = (char)j->p[j->pos + 1];
        const char *simple = strchr("\"\\/bfnrt", e);
        if (e && simple) {
            static const char to[] = "\"\\/\b\f\n\r\t";
            *w++ = to[simple - "\"\\/bfnrt"];
            j->pos += 2;
            continue;
        }
        if (e != 'u')
            return json_fail(j, j->pos, "an unknown escape in a string");
        int hi = j->pos + 6 <= j->n ? hex4(j->p + j->pos + 2) : -1;
        if (hi < 0)
            return json_fail(j, j->pos, "a \\u escape without four hex digits");
        uint32_t cp = (uint32_t)hi;
        size_t esc = j->pos;
        j->pos += 6;
        if (hi >= 0xDC00 && hi <= 0xDFFF)
            return json_fail(j, esc, "a lone low surrogate escape in a string");
        if (hi >= 0xD800 && hi <= 0xDBFF) {
            int lo = j->pos + 6 <= j->n && j->p[j->pos] == '\\' && j->p[j->pos + 1] == 'u' ? hex4(j->p + j->pos + 2) : -1;
            if (lo < 0xDC00 || lo > 0xDFFF)
                return json_fail(j, esc, "a high surrogate escape not followed by a low one");
            cp = 0x10000 + (((uint32_t)hi - 0xD800) << 10) + ((uint32_t)lo - 0xDC00);
            j->pos += 6;
        }
        w += utf8_encode(cp, w);
    }
    *w = '\0';
    *out = dst;
    *out_len = (size_t)(w - dst);
    j->pool_used += (size_t)(w - dst) + 1;
    return AMP_OK;
}

static enum amp_status json_number(struct json *j, int32_t id)
{
    size_t start = j->pos, digits = 0;
    const unsigned char *p = j->p;
    bool neg = false, frac = false;
    if (j->pos < j->n && p[j->pos] == '-') {
        neg = true;
        j->pos++;
    }
    if (j->pos >= j->n || p[j->pos] < '0' || p[j->pos] > '9')
        return json_fail(j, start, "a malformed number");
    if (p[j->pos] == '0' && j->pos + 1 < j->n && p[j->pos + 1] >= '0' && p[j->pos + 1] <= '9')
        return json_fail(j, start, "a number with a leading zero");
    int64_t v = 0;
    while (j->pos < j->n && p[j->pos] >= '0' && p[j->pos] <= '9') {
        if (digits++ < 18)
            v = v * 10 + (p[j->pos] - '0');
        j->pos++;
    }
    if (j->pos < j->n && p[j->pos] == '.') {
        frac = true;
        if (++j->pos >= j->n || p[j->pos] < '0' || p[j->pos] > '9')
            return json_fail(j, start, "a malformed number (no digit after '.')");
        while (j->pos < j->n && p[j->pos] >= '0' && p[j->pos] <= '9')
            j->pos++;
    }
    if (j->pos < j->n && (p[j->pos] == 'e' || p[j->pos] == 'E')) {
        frac = true;
        j->pos++;
        if (j->pos < j->n && (p[j->pos] == '+' || p[j->pos] == '-'))
            j->pos++;
        if (j->pos >= j->n || p[j->pos] < '0' || p[j->pos] > '9')
            return json_fail(j, start, "a malformed number (no digit in the exponent)");
        while (j->pos < j->n && p[j->pos] >= '0' && p[j->pos] <= '9')
            j->pos++;
    }
    j->nodes[id].is_int = !frac && digits <= 18;
    j->nodes[id].ival = neg ? -v : v;
    return AMP_OK;
}

static enum amp_status json_value(struct json *j, int depth, int32_t *out);

/* An array or object at j->pos (on its bracket): items linked through next. */
static enum amp_status json_container(struct json *j, int depth, int32_t id, bool object)
{
    char close = object ? '}' : ']';
    j->pos++;
    json_skip_ws(j);
    if (j->pos < j->n && j->p[j->pos] == close) {
        j->pos++;
        return AMP_OK;
    }
    int32_t last = -1;
    for (;;) {
        json_skip_ws(j);
        const char *key = NULL;
        size_t key_len = 0;
        if (object) {
            if (j->pos >= j->n || j->p[j->pos] != '"')
                return json_fail(j, j->pos, j->pos >= j->n ? "the file ends inside an object" : "expected a key (a string)");
            enum amp_status st = json_string(j, &key, &key_len);
            if (st != AMP_OK)
                return st;
            json_skip_ws(j);
            if (j->pos >= j->n || j->p[j->pos] != ':')
                return json_fail(j, j->pos, "expected ':' after a key");
            j->pos++;
        }
        int32_t item;
        enum amp_status st = json_value(j, depth + 1, &item);
        if (st != AMP_OK)
            return st;
        j->nodes[item].key = key;
        j->nodes[item].key_len = key_len;
        if (last < 0)
            j->nodes[id].child = item;
        else
            j->nodes[last].next = item;
        last = item;
        json_skip_ws(j);
        if (j->pos >= j->n)
            return json_fail(j, j->pos, object ? "the file ends inside an object" : "the file ends inside an array");
        if (j->p[j->pos] == close) {
            j->pos++;
            return AMP_OK;
        }
        if (j->p[j->pos] != ',')
            return json_fail(j, j->pos, object ? "expected ',' or '}' in an object" : "expected ',' or ']' in an array");
        j->pos++;
    }
}

static enum amp_status json_value(struct json *j, int depth, int32_t *out)
{
    json_skip_ws(j);
    if (j->pos >= j->n)
        return json_fail(j, j->pos, "the file ends where a value should be");
    if (depth > TOKENIZER_MAX_DEPTH)
        return json_fail(j, j->pos, "values nested deeper than 64 levels");
    unsigned char c = j->p[j->pos];
    static const struct { const char *word; enum jtype type; } words[] = {
        {"null", J_NULL}, {"false", J_FALSE}, {"true", J_TRUE}};
    for (size_t i = 0; i < sizeof words / sizeof words[0]; i++) {
        size_t len = strlen(words[i].word);
        if (c == (unsigned char)words[i].word[0]) {
            if (j->n - j->pos < len || memcmp(j->p + j->pos, words[i].word, len))
                return json_fail(j, j->pos, "an unknown word (not null, true or false)");
            if ((*out = json_new_node(j, words[i].type)) < 0)
                return amp_fail(j->err, AMP_ERR_INTERNAL, NULL, "%s: out of memory", j->name);
            j->pos += len;
            return AMP_OK;
        }
    }
    enum jtype type = c == '"' ? J_STR : c == '[' ? J_ARR : c == '{' ? J_OBJ : c == '-' || (c >= '0' && c <= '9') ? J_NUM : J_NULL;
    if (type == J_NULL)
        return json_fail(j, j->pos, "an unexpected character where a value should be");
    int32_t id = json_new_node(j, type);
    if (id < 0)
        return amp_fail(j->err, AMP_ERR_INTERNAL, NULL, "%s: out of memory", j->name);
    *out = id;
    if (type == J_STR) {
        const char *s;
        size_t len;
        enum amp_status st = json_string(j, &s, &len);
        j->nodes[id].str = s;
        j->nodes[id].len = len;
        return st;
    }
    if (type == J_NUM)
        return json_number(j, id);
    return json_container(j, depth, id, type == J_OBJ);
}

static enum amp_status json_parse(struct json *j, const char *name, const char *text, size_t n, struct amp_error *err)
{
    *j = (struct json){.name = name, .p = (const unsigned char *)text, .n = n, .err = err};
    j->pool = malloc(n + 1);
    if (!j->pool)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "%s: out of memory (%zu bytes)", name, n);
    int32_t root;
    enum amp_status st = json_value(j, 0, &root);
    if (st == AMP_OK) {
        json_skip_ws(j);
        if (j->pos != j->n)
            st = json_fail(j, j->pos, "more bytes after the top-level value");
        else if (j->nodes[0].type != J_OBJ)
            st = json_fail(j, 0, "the top-level value is not an object");
    }
    return st;
}

static void json_free(struct json *j)
{
    free(j->nodes);
    free(j->pool);
}

static struct jnode *jnode(const struct json *j, int32_t id) { return id < 0 ? NULL : &j->nodes[id]; }

/* Member `key` of object node `obj`, or NULL. */
static struct jnode *json_get(const struct json *j, const struct jnode *obj, const char *key)
{
    for (int32_t i = obj ? obj->child : -1; i >= 0; i = j->nodes[i].next)
        if (!strcmp(j->nodes[i].key, key))
            return &j->nodes[i];
    return NULL;
}

static const char *jtype_name(enum jtype t)
{
    static const char *names[] = {"null", "false", "true", "a number", "a string", "an array", "an object"};
    return names[t];
}

/* ---- hashes: token -> id, (id, id) -> merge --------------------------------------------------------- */

static uint64_t hash_bytes(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h;
}

static uint64_t hash_pair(int32_t a, int32_t b)
{
    uint64_t h = ((uint64_t)(uint32_t)a << 32 | (uint32_t)b) * 0x9E3779B97F4A7C15ull;
    return h ^ h >> 29;
}

struct merge {
    int32_t a, b;      /* the ids merged; a = -1: empty slot */
    int32_t rank, id;  /* its line (lower merges first) and the merged symbol's id */
};

struct added {
    char *content;
    size_t len;
    int32_t id;
};

struct tokenizer {
    char name[512];     /* the file, for errors */
    int32_t nids;       /* largest id + 1 */
    char **tok;         /* (nids) each id's token (UTF-8), NULL for an unused id */
    size_t *tok_len;    /* (nids) */
    char **bytes;       /* (nids) what each id decodes to */
    size_t *bytes_len;  /* (nids) */
    int32_t *vocab;     /* (vocab_cap) the model vocab's hash: ids, -1 empty */
    size_t vocab_cap;
    struct merge *merges; /* (merge_cap) */
    size_t merge_cap, nmerges;
    struct added *added;  /* longest first */
    int nadded;
    bool added_first[256]; /* a byte that starts an added token */
    int32_t byte_id[256];  /* each byte's symbol's id; -1 none */
    int32_t unk_id;        /* -1: none */
    bool ignore_merges;
};

static int32_t vocab_find(const struct tokenizer *t, const char *s, size_t n)
{
    if (!t->vocab_cap)
        return -1;
    for (size_t i = hash_bytes(s, n) & (t->vocab_cap - 1);; i = (i + 1) & (t->vocab_cap - 1)) {
        int32_t id = t->vocab[i];
        if (id < 0)
            return -1;
        if (t->tok_len[id] == n && !memcmp(t->tok[id], s, n))
            return id;
    }
}

static const struct merge *merge_find(const struct tokenizer *t, int32_t a, int32_t b)
{
    for (size_t i = hash_pair(a, b) & (t->merge_cap - 1);; i = (i + 1) & (t->merge_cap - 1)) {
        const struct merge *m = &t->merges[i];
        if (m->a < 0)
            return NULL;
        if (m->a == a && m->b == b)
            return m;
    }
}

static size_t pow2_above(size_t n)
{
    size_t c = 16;
    while (c < 2 * n)
        c *= 2;
    return c;
}

/* ---- GPT-2's byte <-> unicode map ------------------------------------------------------------------- */

/* GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 for U+0100 on. */
static uint32_t byte_symbol(int b)
{
    if ((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF))
        return (uint32_t)b;
    int n = 0;
    for (int c = 0; c < b; c++)
        if (!((c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF)))
            n++;
    return 256u + (uint32_t)n;
}

/* ---- loading ---------------------------------------------------------------------------------------- */

static enum amp_status ids_reserve(struct tokenizer *t, int32_t nids, struct amp_error *err)
{
    t->tok = calloc((size_t)nids, sizeof *t->tok);
    t->tok_len = calloc((size_t)nids, sizeof *t->tok_len);
    t->bytes = calloc((size_t)nids, sizeof *t->bytes);
    t->bytes_len = calloc((size_t)nids, sizeof *t->bytes_len);
    if (!t->tok || !t->tok_len || !t->bytes || !t->bytes_len)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "%s: out of memory for %d ids", t->name, (int)nids);
    t->nids = nids;
    return AMP_OK;
}

/* Give `id` the token s; an id already holding another token is an error (what: where the id was read). */
static enum amp_status id_set(struct tokenizer *t, int32_t id, const char *s, size_t n, const char *what,
                              struct amp_error *err)
{
    if (t->tok[id]) {
        if (t->tok_len[id] == n && !memcmp(t->tok[id], s, n))
            return AMP_OK;
        return amp_fail(err, AMP_ERR_DATA, HINT_FILE, "%s: %s: id %d is given twice, to '%.100s' and '%.100s'", t->name,
                        what, (int)id, t->tok[id], s);
    }
    if (!(t->tok[id] = malloc(n + 1)))
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "%s: out of memory", t->name);
    memcpy(t->tok[id], s, n);
    t->tok[id][n] = '\0';
    t->tok_len[id] = n;
    return AMP_OK;
}

/* An id read at `what` ('model.vocab: "abc"'): an integer in [0, TOKENIZER_MAX_ID). */
static enum amp_status id_check(const struct tokenizer *t, const struct jnode *v, const char *what,
                                struct amp_error *err)
{
    if (!v || v->type != J_NUM || !v->is_int || v->ival < 0 || v->ival >= TOKENIZER_MAX_ID)
        return amp_fail(err, AMP_ERR_DATA, HINT_FILE, "%s: %s: the id is %s, not an integer in [0, %d)", t->name, what,
                        !v ? "missing" : v->type != J_NUM ? jtype_name(v->type) : "out of range", (int)TOKENIZER_MAX_ID);
    return AMP_OK;
}

/* The vocab object (token -> id): the id table sized to its largest id (and `more`), the hash. */
static enum amp_status load_vocab(struct tokenizer *t, const struct json *j, const struct jnode *vocab,
                                  const char *where, int32_t more, struct amp_error *err)
{
    if (!vocab || vocab->type != J_OBJ)
        return amp_fail(err, AMP_ERR_DATA, HINT_FILE, "%s: %s is %s, not an object of token: id", t->name, where,
                        vocab ? jtype_name(vocab->type) : "missing");
    int32_t nids = more, count = 0;
    char what[200];
    for (const struct jnode *v = jnode(j, vocab->child); v; v = jnode(j, v->next)) {
        snprintf(what, sizeof what, "%s: '%.100s'", where, v->key);
        enum amp_status st = id_check(t, v, what, err);
        if (st == AMP_OK && (v->key_len == 0 || strlen(v->key) != v->key_len))
            st = amp_fail(err, AMP_ERR_DATA, HINT_FILE, "%s: %s: a token is a nonempty string without NUL", t->name, what);
        if (st != AMP_OK)
            return st;
        nids = v->ival + 1 > nids ? (int32_t)v->ival + 1 : nids;
        count++;
    }
    if (count == 0)
        return amp_fail(err, AMP_ERR_DATA, HINT_FILE, "%s: %s is empty", t->name, where);
    enum amp_status st = ids_reserve(t, nids, err);
    if (st != AMP_OK)
        return st;
    t->vocab_cap = pow2_above((size_t)count);
    if (!(t->vocab = malloc(t->vocab_cap * sizeof *t->vocab)))
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "%s: out of memory", t->name);
    memset(t->vocab, 0xFF, t->vocab_cap * sizeof *t->vocab);
    for (const struct jnode *v = jnode(j, vocab->child); v; v = jnode(j, v->next)) {
        int32_t id = (int32_t)v->ival;
        size_t n = strlen(v->key);
        snprintf(what, sizeof what, "%s: '%.100s'", where, v->key);
        if (vocab_find(t, v->key, n) >= 0)
            return amp_fail(err, AMP_ERR_DATA, HINT_FILE, "%s: %s: the token appears twice", t->name, what);
        if (t->tok[id])
            return amp_fail(err, AMP_ERR_DATA, HINT_FILE, "%s: %s: id %d is given twice, to '%.100s' and '%.100s'",
                            t->name, where, (int)id, t->tok[id], v->key);
        if ((st = id_set(t, id, v->key, n, what, err)) != AMP_OK)
            return st;
        size_t i = hash_bytes(v->key, n) & (t->vocab_cap - 1);
        while (t->vocab[i] >= 0)
            i = (i + 1) & (t->vocab_cap - 1);
        t->vocab[i] = id;
    }
    return AMP_OK;
}

/* One merge (a, b) of rank `rank`; where: 'merges.txt: line 5'. */
static enum amp_status merge_add(struct tokenizer *t, const char *a, size_t an, const char *b, size_t bn, int32_t rank,
                                 const char *where, struct amp_error *err)
{
    int32_t ia = vocab_find(t, a, an), ib = vocab_find(t, b, bn);
    if (ia < 0 || ib < 0)
        return amp_fail(err, AMP_ERR_DATA, HINT_FILE, "%s: the merge '%.*s %.*s' names '%.*s', which is not in the vocab",
                        where, (int)(an < 100 ? an : 100), a, (int)(bn < 100 ? bn : 100), b,
                        (int)(ia < 0 ? (an < 100 ? an : 100) : (bn < 100 ? bn : 100)), ia < 0 ? a : b);
    char joined[4096];
    if (an + bn > sizeof joined)
        return amp_fail(err, AMP_ERR_DATA, HINT_FILE, "%s: a merged symbol of %zu bytes (at most %zu)", where, an + bn,
                        sizeof joined);
    memcpy(joined, a, an);
    memcpy(joined + an, b, bn);
    int32_t id = vocab_find(t, joined, an + bn);
    if (id < 0)
        return amp_fail(err, AMP_ERR_DATA, HINT_FILE, "%s: the merge '%.*s %.*s' makes '%.*s', which is not in the vocab",
                        where, (int)(an < 100 ? an : 100), a, (int)(bn < 100 ? bn : 100), b, (int)(an + bn < 200 ? an + bn : 200), joined);
    size_t i = hash_pair(ia, ib) & (t->merge_cap - 1);
    for (; t->merges[i].a >= 0; i = (i + 1) & (t->merge_cap - 1))
        if (t->merges[i].a == ia && t->merges[i].b == ib)
            return amp_fail(err, AMP_ERR_DATA, HINT_FILE, "%s: the merge '%.*s %.*s' is given twice (first at rank %d)",
                            where, (int)(an < 100 ? an : 100), a, (int)(bn < 100 ? bn : 100), b, (int)t->merges[i].rank);
    t->merges[i] = (struct merge){ia, ib, rank, id};
    t->nmerges++;
    return AMP_OK;
}

static enum amp_status merges_reserve(struct tokenizer *t, size_t n, struct amp_error *err)
{
    t->merge_cap = pow2_above(n);
    if (!(t->merges = malloc(t->merge_cap * sizeof *t->merges)))
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "%s: out of memory", t->name);
    for (size_t i = 0; i < t->merge_cap; i++)
        t->merges[i].a = -1;
    return AMP_OK;
}

/* tokenizer.json's model.merges: "a b" strings (older tokenizers) or ["a", "b"] pairs (newer). */
static enum amp_status load_json_merges(struct tokenizer *t, const struct json *j, const struct jnode *merges,
                                        struct amp_error *err)
{
    if (!merges || merges->type != J_ARR)
        return amp_fail(err, AMP_ERR_DATA, HINT_FILE, "%s: model.merges is %s, not an array", t->name,
                        merges ? jtype_name(merges->type) : "missing");
    size_t n = 0;
    for (const struct jnode *m = jnode(j, merges->child); m; m = jnode(j, m->next))
        n++;
    enum amp_status st = merges_reserve(t, n, err);
    int32_t rank = 0;
    for (const struct jnode *m = jnode(j, merges->child); m && st == AMP_OK; m = jnode(j, m->next), rank++) {
        char where[600];
        snprintf(where, sizeof where, "%s: model.merges[%d]", t->name, (int)rank);
        if (m->type == J_STR) {
            const char *sp = strchr(m->str, ' ');
            if (!sp || sp == m->str || !sp[1] || strchr(sp + 1, ' ') || strlen(m->str) != m->len)
                return amp_fail(err, AMP_ERR_DATA, HINT_FILE, "%s: '%.200s' is not two symbols separated by one space",
                                where, m->str);
            st = merge_add(t, m->str, (size_t)(sp - m->str), sp + 1, m->len - (size_t)(sp - m->str) - 1, rank, where, err);
        } else if (m->type == J_ARR) {
            const struct jnode *a = jnode(j, m->child), *b = a ? jnode(j, a->next) : NULL;
            if (!a || !b || b->next >= 0 || a->type != J_STR || b->type != J_STR)
                return amp_fail(err, AMP_ERR_DATA, HINT_FILE, "%s: a merge is a pair of two strings", where);
            st = merge_add(t, a->str, a->len, b->str, b->len, rank, where, err);
        } else {
            return amp_fail(err, AMP_ERR_DATA, HINT_FILE, "%s is %s, not \"a b\" or [\"a\", \"b\"]", where,
                            jtype_name(m->type));
        }
    }
    return st;
}

/* merges.txt: an optional "#version" first line, then one "a b" per line. */
static enum amp_status load_merges_txt(struct tokenizer *t, const char *name, const char *text, size_t n,
                                       struct amp_error *err)
{
    size_t lines = 0;
    for (size_t i = 0; i < n; i++)
        lines += text[i] == '\n';
    enum amp_status st = merges_reserve(t, lines + 1, err);
    int32_t rank = 0;
    size_t line = 0;
    for (size_t pos = 0; pos < n && st == AMP_OK;) {
        const char *s = text + pos, *nl = memchr(s, '\n', n - pos);
        size_t len = nl ? (size_t)(nl - s) : n - pos;
        pos += len + (nl != NULL);
        line++;
        if (len && s[len - 1] == '\r')
            len--;
        if (line == 1 && len >= 8 && !memcmp(s, "#version", 8))
            continue;
        char where[600];
        snprintf(where, sizeof where, "%s: line %zu", name, line);
        const char *sp = memchr(s, ' ', len);
        if (!sp || sp == s || sp == s + len - 1 || memchr(sp + 1, ' ', len - (size_t)(sp - s) - 1) || memchr(s, '\0', len))
            return amp_fail(err, AMP_ERR_DATA, HINT_FILE, "%s: a merge is two symbols separated by one space, not "
                            "'%.*s'", where, (int)(len < 100 ? len : 100), s);
        uint32_t cp;
        for (size_t k = 0; k < len;) {
            size_t c = utf8_decode((const unsigned char *)s + k, len - k, &cp);
            if (!c)
                return amp_fail(err, AMP_ERR_DATA, HINT_FILE, "%s: byte %zu of the line is not valid UTF-8", where, k);
            k += c;
        }
        char a[2048], b[2048];
        size_t an = (size_t)(sp - s), bn = len - an - 1;
        if (an >= sizeof a || bn >= sizeof b)
            return amp_fail(err, AMP_ERR_DATA, HINT_FILE, "%s: a symbol longer than %zu bytes", where, sizeof a - 1);
        memcpy(a, s, an);
        a[an] = '\0';
        memcpy(b, sp + 1, bn);
        b[bn] = '\0';
        st = merge_add(t, a, an, b, bn, rank++, where, err);
    }
    return st;
}

/* A boolean setting that must be as GPT-2's: absent, null, or `want`. */
static enum amp_status want_bool(const struct tokenizer *t, const struct jnode *v, const char *key, bool want,
                                 struct amp_error *err)
{
    if (!v || v->type == J_NULL || v->type == (want ? J_TRUE : J_FALSE))
        return AMP_OK;
    return amp_fail(err, AMP_ERR_DATA, HINT_BPE, "%s: %s is %s; ampTrain encodes as GPT-2 does, with %s: %s", t->name,
                    key, jtype_name(v->type), key, want ? "true" : "false");
}

static enum amp_status want_empty(const struct tokenizer *t, const struct jnode *v, const char *key,
                                  struct amp_error *err)
{
    if (!v || v->type == J_NULL || (v->type == J_STR && v->len == 0))
        return AMP_OK;
    return amp_fail(err, AMP_ERR_DATA, HINT_BPE, "%s: %s is set (%s); ampTrain's byte-level BPE has none", t->name, key,
                    v->type == J_STR ? v->str : jtype_name(v->type));
}

/* An object node of type `type` ("ByteLevel") at key (pre_tokenizer, decoder). */
static enum amp_status want_type(const struct tokenizer *t, const struct json *j, const struct jnode *v,
                                 const char *key, const char *type, struct amp_error *err)
{
    const struct jnode *ty = v && v->type == J_OBJ ? json_get(j, v, "type") : NULL;
    if (ty && ty->type == J_STR && !strcmp(ty->str, type))
        return AMP_OK;
    return amp_fail(err, AMP_ERR_DATA, HINT_BPE, "%s: %s is %s%s, not %s", t->name, key,
                    !v ? "missing" : ty && ty->type == J_STR ? "of type " : jtype_name(v->type),
                    ty && ty->type == J_STR ? ty->str : "", type);
}

/* Every member of object v is one of `known` (NULL-terminated); else the setting is refused. */
static enum amp_status known_keys(const struct tokenizer *t, const struct json *j, const struct jnode *v,
                                  const char *where, const char *const *known, struct amp_error *err)
{
    for (const struct jnode *m = jnode(j, v->child); m; m = jnode(j, m->next)) {
        bool found = false;
        for (const char *const *k = known; *k && !found; k++)
            found = !strcmp(*k, m->key);
        if (!found)
            return amp_fail(err, AMP_ERR_DATA, HINT_BPE, "%s: %s.%.100s: a setting this reader does not know", t->name,
                            where, m->key);
    }
    return AMP_OK;
}

static enum amp_status add_added(struct tokenizer *t, const char *s, size_t n, int32_t id, struct amp_error *err)
{
    struct added *a = realloc(t->added, ((size_t)t->nadded + 1) * sizeof *a);
    if (!a)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "%s: out of memory", t->name);
    t->added = a;
    if (!(a[t->nadded].content = malloc(n + 1)))
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "%s: out of memory", t->name);
    memcpy(a[t->nadded].content, s, n);
    a[t->nadded].content[n] = '\0';
    a[t->nadded].len = n;
    a[t->nadded].id = id;
    t->nadded++;
    t->added_first[(unsigned char)s[0]] = true;
    return AMP_OK;
}

static enum amp_status load_added_tokens(struct tokenizer *t, const struct json *j, const struct jnode *list,
                                         struct amp_error *err)
{
    if (!list || list->type == J_NULL)
        return AMP_OK;
    if (list->type != J_ARR)
        return amp_fail(err, AMP_ERR_DATA, HINT_FILE, "%s: added_tokens is %s, not an array", t->name,
                        jtype_name(list->type));
    int k = 0;
    for (const struct jnode *a = jnode(j, list->child); a; a = jnode(j, a->next), k++) {
        char where[64];
        snprintf(where, sizeof where, "added_tokens[%d]", k);
        if (a->type != J_OBJ)
            return amp_fail(err, AMP_ERR_DATA, HINT_FILE, "%s: %s is %s, not an object", t->name, where,
                            jtype_name(a->type));
        static const char *const known[] = {"id", "content", "single_word", "lstrip", "rstrip", "normalized",
                                            "special", NULL};
        enum amp_status st = known_keys(t, j, a, where, known, err);
        const struct jnode *id = json_get(j, a, "id"), *content = json_get(j, a, "content");
        char key[96];
        static const char *const flags[] = {"single_word", "lstrip", "rstrip"};
        for (int f = 0; f < 3 && st == AMP_OK; f++) {
            snprintf(key, sizeof key, "%s.%s", where, flags[f]);
            st = want_bool(t, json_get(j, a, flags[f]), key, false, err);
        }
        if (st == AMP_OK && (!content || content->type != J_STR || content->len == 0 || strlen(content->str) != content->len))
            return amp_fail(err, AMP_ERR_DATA, HINT_FILE, "%s: %s.content is %s, not a nonempty string", t->name, where,
                            content ? content->type == J_STR ? "empty or holds a NUL" : jtype_name(content->type)
                                    : "missing");
        snprintf(key, sizeof key, "%s.id", where);
        if (st == AMP_OK)
            st = id_check(t, id, key, err);
        if (st != AMP_OK)
            return st;
        if (id->ival >= t->nids)
            return amp_fail(err, AMP_ERR_DATA, HINT_FILE, "%s: %s.id %lld is past the vocab's ids (< %d)", t->name,
                            where, (long long)id->ival, (int)t->nids);
        for (int i = 0; i < t->nadded; i++)
            if (t->added[i].len == content->len && !memcmp(t->added[i].content, content->str, content->len))
                return amp_fail(err, AMP_ERR_DATA, HINT_FILE, "%s: %s: '%.100s' is added twice", t->name, where,
                                content->str);
        if ((st = id_set(t, (int32_t)id->ival, content->str, content->len, key, err)) != AMP_OK ||
            (st = add_added(t, content->str, content->len, (int32_t)id->ival, err)) != AMP_OK)
            return st;
    }
    return AMP_OK;
}

/* The largest id among added_tokens (they may lie past the model's vocab), -1 if none; ids checked later. */
static int32_t added_max_id(const struct json *j, const struct jnode *list)
{
    int32_t max = -1;
    for (const struct jnode *a = list && list->type == J_ARR ? jnode(j, list->child) : NULL; a; a = jnode(j, a->next)) {
        const struct jnode *id = a->type == J_OBJ ? json_get(j, a, "id") : NULL;
        if (id && id->type == J_NUM && id->is_int && id->ival >= 0 && id->ival < TOKENIZER_MAX_ID && id->ival > max)
            max = (int32_t)id->ival;
    }
    return max;
}

static enum amp_status load_tokenizer_json(struct tokenizer *t, const struct json *j, struct amp_error *err)
{
    const struct jnode *root = &j->nodes[0];
    const struct jnode *model = json_get(j, root, "model"), *pre = json_get(j, root, "pre_tokenizer"),
                       *dec = json_get(j, root, "decoder"), *post = json_get(j, root, "post_processor");
    enum amp_status st = want_type(t, j, model, "model", "BPE", err);
    if (st == AMP_OK)
        st = want_type(t, j, pre, "pre_tokenizer", "ByteLevel", err);
    if (st == AMP_OK)
        st = want_type(t, j, dec, "decoder", "ByteLevel", err);
    if (st == AMP_OK && post && post->type != J_NULL)
        st = want_type(t, j, post, "post_processor", "ByteLevel", err);
    static const char *const top_null[] = {"normalizer", "truncation", "padding"};
    for (int i = 0; i < 3 && st == AMP_OK; i++) {
        const struct jnode *v = json_get(j, root, top_null[i]);
        if (v && v->type != J_NULL)
            st = amp_fail(err, AMP_ERR_DATA, HINT_BPE, "%s: %s is set (%s); ampTrain encodes as GPT-2 does, without one",
                          t->name, top_null[i], jtype_name(v->type));
    }
    static const char *const model_keys[] = {"type", "dropout", "unk_token", "continuing_subword_prefix",
                                             "end_of_word_suffix", "fuse_unk", "byte_fallback", "ignore_merges",
                                             "vocab", "merges", NULL};
    static const char *const pre_keys[] = {"type", "add_prefix_space", "trim_offsets", "use_regex", NULL};
    if (st == AMP_OK)
        st = known_keys(t, j, model, "model", model_keys, err);
    if (st == AMP_OK)
        st = known_keys(t, j, pre, "pre_tokenizer", pre_keys, err);
    if (st == AMP_OK)
        st = want_bool(t, json_get(j, pre, "add_prefix_space"), "pre_tokenizer.add_prefix_space", false, err);
    if (st == AMP_OK)
        st = want_bool(t, json_get(j, pre, "use_regex"), "pre_tokenizer.use_regex", true, err);
    if (st == AMP_OK) {
        const struct jnode *d = json_get(j, model, "dropout");
        if (d && d->type != J_NULL)
            st = amp_fail(err, AMP_ERR_DATA, HINT_BPE, "%s: model.dropout is set; ampTrain's BPE is deterministic "
                          "(dropout: null)", t->name);
    }
    if (st == AMP_OK)
        st = want_empty(t, json_get(j, model, "continuing_subword_prefix"), "model.continuing_subword_prefix", err);
    if (st == AMP_OK)
        st = want_empty(t, json_get(j, model, "end_of_word_suffix"), "model.end_of_word_suffix", err);
    if (st == AMP_OK)
        st = want_bool(t, json_get(j, model, "fuse_unk"), "model.fuse_unk", false, err);
    if (st == AMP_OK)
        st = want_bool(t, json_get(j, model, "byte_fallback"), "model.byte_fallback", false, err);
    const struct jnode *im = json_get(j, model, "ignore_merges");
    if (st == AMP_OK && im && im->type != J_NULL && im->type != J_TRUE && im->type != J_FALSE)
        st = amp_fail(err, AMP_ERR_DATA, HINT_FILE, "%s: model.ignore_merges is %s, not true or false", t->name,
                      jtype_name(im->type));
    t->ignore_merges = im && im->type == J_TRUE;
    const struct jnode *added = json_get(j, root, "added_tokens");
    if (st == AMP_OK)
        st = load_vocab(t, j, json_get(j, model, "vocab"), "model.vocab", added_max_id(j, added) + 1, err);
    if (st == AMP_OK)
        st = load_json_merges(t, j, json_get(j, model, "merges"), err);
    if (st == AMP_OK)
        st = load_added_tokens(t, j, added, err);
    const struct jnode *unk = json_get(j, model, "unk_token");
    if (st == AMP_OK && unk && unk->type != J_NULL) {
        t->unk_id = unk->type == J_STR ? vocab_find(t, unk->str, unk->len) : -1;
        if (t->unk_id < 0)
            st = amp_fail(err, AMP_ERR_DATA, HINT_FILE, "%s: model.unk_token is %s, not a token of the vocab", t->name,
                          unk->type == J_STR ? unk->str : jtype_name(unk->type));
    }
    return st;
}

static enum amp_status load_vocab_json(struct tokenizer *t, const struct json *j, const char *merges_name,
                                       const char *merges, size_t merges_len, struct amp_error *err)
{
    enum amp_status st = load_vocab(t, j, &j->nodes[0], "vocab", 0, err);
    if (st == AMP_OK)
        st = load_merges_txt(t, merges_name, merges, merges_len, err);
    /* as transformers' GPT2Tokenizer: GPT-2's end-of-text token is special */
    static const char eot[] = "<|endoftext|>";
    int32_t id = st == AMP_OK ? vocab_find(t, eot, sizeof eot - 1) : -1;
    if (id >= 0)
        st = add_added(t, eot, sizeof eot - 1, id, err);
    return st;
}

static int added_longer_first(const void *a, const void *b)
{
    size_t la = ((const struct added *)a)->len, lb = ((const struct added *)b)->len;
    return la < lb ? 1 : la > lb ? -1 : 0;
}

/* After loading: each byte's symbol, each id's bytes, the added tokens longest first. */
static enum amp_status tokenizer_finish(struct tokenizer *t, struct amp_error *err)
{
    int symbol_byte[324]; /* the byte each symbol stands for, -1 */
    for (int i = 0; i < 324; i++)
        symbol_byte[i] = -1;
    for (int b = 0; b < 256; b++) {
        symbol_byte[byte_symbol(b)] = b;
        char s[4];
        size_t n = utf8_encode(byte_symbol(b), s);
        t->byte_id[b] = vocab_find(t, s, n);
    }
    for (int32_t id = 0; id < t->nids; id++) {
        if (!t->tok[id])
            continue;
        const unsigned char *s = (const unsigned char *)t->tok[id];
        size_t n = t->tok_len[id], out = 0;
        if (!(t->bytes[id] = malloc(n + 1)))
            return amp_fail(err, AMP_ERR_INTERNAL, NULL, "%s: out of memory", t->name);
        bool all_symbols = true;
        for (size_t k = 0; k < n && all_symbols;) {
            uint32_t cp;
            size_t c = utf8_decode(s + k, n - k, &cp);
            int byte = c && cp < 324 ? symbol_byte[cp] : -1;
            all_symbols = byte >= 0;
            if (all_symbols)
                t->bytes[id][out++] = (char)byte;
            k += c;
        }
        if (!all_symbols) { /* as Hugging Face's ByteLevel decoder: the token's own bytes */
            memcpy(t->bytes[id], s, n);
            out = n;
        }
        t->bytes_len[id] = out;
    }
    if (t->nadded > 1)
        qsort(t->added, (size_t)t->nadded, sizeof *t->added, added_longer_first);
    return AMP_OK;
}

static struct tokenizer *tokenizer_new(const char *name)
{
    struct tokenizer *t = calloc(1, sizeof *t);
    if (t) {
        snprintf(t->name, sizeof t->name, "%s", name);
        t->unk_id = -1;
    }
    return t;
}

static bool is_vocab_json(const struct json *j)
{
    return json_get(j, &j->nodes[0], "model") == NULL;
}

/* Read a whole regular file into malloc'd memory (NUL-terminated). Missing: AMP_ERR_CONFIG. */
static enum amp_status read_file(const char *path, char **out, size_t *n, struct amp_error *err)
{
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f)
        return amp_fail(err, errno == ENOENT ? AMP_ERR_CONFIG : AMP_ERR_DATA, HINT_FILE, "%s: cannot open: %s", path,
                        strerror(errno));
    struct stat sb;
    if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode)) {
        fclose(f);
        return amp_fail(err, AMP_ERR_DATA, HINT_FILE, "%s: not a regular file", path);
    }
    if ((uint64_t)sb.st_size > TOKENIZER_MAX_FILE) {
        fclose(f);
        return amp_fail(err, AMP_ERR_DATA, HINT_FILE, "%s: %lld bytes, more than a tokenizer file may hold (%zu)", path,
                        (long long)sb.st_size, TOKENIZER_MAX_FILE);
    }
    char *buf = malloc((size_t)sb.st_size + 1);
    if (!buf) {
        fclose(f);
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "%s: out of memory (%lld bytes)", path, (long long)sb.st_size);
    }
    size_t got = fread(buf, 1, (size_t)sb.st_size, f);
    bool bad_read = ferror(f) || got != (size_t)sb.st_size;
    fclose(f);
    if (bad_read) {
        free(buf);
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "%s: read error (%zu of %lld bytes)", path, got,
                        (long long)sb.st_size);
    }
    buf[got] = '\0';
    *out = buf;
    *n = got;
    return AMP_OK;
}

/* Where the merges of a vocab.json come from: bytes in memory, or a file read when the JSON turns out to be one. */
struct merges_src {
    const char *text; /* NULL: read `path` */
    size_t len;
    const char *path; /* the name in errors; the file to read when text is NULL */
};

static enum amp_status load(const char *json, size_t json_len, const char *name, const struct merges_src *m,
                            struct tokenizer **out, struct amp_error *err)
{
    *out = NULL;
    struct tokenizer *t = tokenizer_new(name);
    if (!t)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "%s: out of memory", name);
    struct json j;
    char *merges = NULL;
    size_t merges_len = m->len;
    enum amp_status st = json_parse(&j, name, json, json_len, err);
    bool vocab_form = st == AMP_OK && is_vocab_json(&j);
    if (vocab_form && m->text)
        merges = (char *)m->text;
    else if (vocab_form)
        st = read_file(m->path, &merges, &merges_len, err);
    if (st == AMP_OK)
        st = vocab_form ? load_vocab_json(t, &j, m->path, merges, merges_len, err) : load_tokenizer_json(t, &j, err);
    if (st == AMP_OK)
        st = tokenizer_finish(t, err);
    json_free(&j);
    if (merges != m->text)
        free(merges);
    if (st != AMP_OK) {
        tokenizer_free(t);
        return st;
    }
    *out = t;
    return AMP_OK;
}

enum amp_status tokenizer_load_memory(const char *json, size_t json_len, const char *merges, size_t merges_len,
                                      const char *name, struct tokenizer **out, struct amp_error *err)
{
    *out = NULL;
    const struct merges_src m = {merges ? merges : "", merges ? merges_len : 0, "merges.txt"};
    return load(json, json_len, name, &m, out, err);
}

enum amp_status tokenizer_load(const char *path, struct tokenizer **out, struct amp_error *err)
{
    *out = NULL;
    struct stat sb;
    if (!path || !path[0] || stat(path, &sb) != 0)
        return amp_fail(err, AMP_ERR_CONFIG, HINT_FILE, "tokenizer %s: no such file or directory",
                        path && path[0] ? path : "(none given)");
    char file[1100], merges[1100];
    if (S_ISDIR(sb.st_mode)) {
        snprintf(file, sizeof file, "%s/tokenizer.json", path);
        if (stat(file, &sb) != 0)
            snprintf(file, sizeof file, "%s/vocab.json", path);
        if (stat(file, &sb) != 0)
            return amp_fail(err, AMP_ERR_CONFIG, HINT_FILE,
                            "tokenizer %s: the directory holds neither tokenizer.json nor vocab.json", path);
        snprintf(merges, sizeof merges, "%s/merges.txt", path);
    } else {
        snprintf(file, sizeof file, "%s", path);
        const char *slash = strrchr(path, '/');
        if (slash)
            snprintf(merges, sizeof merges, "%.*s/merges.txt", (int)(slash - path), path);
        else
            snprintf(merges, sizeof merges, "merges.txt");
    }
    char *json = NULL;
    size_t json_len = 0;
    enum amp_status st = read_file(file, &json, &json_len, err);
    const struct merges_src m = {NULL, 0, merges};
    if (st == AMP_OK)
        st = load(json, json_len, file, &m, out, err);
    free(json);
    return st;
}

void tokenizer_free(struct tokenizer *t)
{
    if (!t)
        return;
    for (int32_t i = 0; i < t->nids; i++) {
        free(t->tok[i]);
        free(t->bytes[i]);
    }
    for (int i = 0; i < t->nadded; i++)
        free(t->added[i].content);
    free(t->tok);
    free(t->tok_len);
    free(t->bytes);
    free(t->bytes_len);
    free(t->vocab);
    free(t->merges);
    free(t->added);
    free(t);
}

int32_t tokenizer_vocab_size(const struct tokenizer *t) { return t->nids; }

/* ---- encoding ---------------------------------------------------------------------------------------- */

enum cls { C_SPACE, C_LETTER, C_NUMBER, C_OTHER };

static bool in_ranges(const uint32_t (*r)[2], size_t n, uint32_t cp)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp < r[mid][0])
            hi = mid;
        else if (cp > r[mid][1])
            lo = mid + 1;
        else
            return true;
    }
    return false;
}

static bool is_white_space(uint32_t c) /* Unicode White_Space, Oniguruma's \s */
{
    return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) ||
           c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

/* The class of the character at s (n > 0 bytes left) and its length; an invalid UTF-8 byte is one C_OTHER. */
static enum cls char_class(const unsigned char *s, size_t n, size_t *len)
{
    uint32_t cp;
    *len = utf8_decode(s, n, &cp);
    if (*len == 0) {
        *len = 1;
        return C_OTHER;
    }
    if (cp < 0x80) {
        if (is_white_space(cp))
            return C_SPACE;
        if ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z')
            return C_LETTER;
        return cp >= '0' && cp <= '9' ? C_NUMBER : C_OTHER;
    }
    if (is_white_space(cp))
        return C_SPACE;
    if (in_ranges(unicode_letters, sizeof unicode_letters / sizeof unicode_letters[0], cp))
        return C_LETTER;
    if (in_ranges(unicode_numbers, sizeof unicode_numbers / sizeof unicode_numbers[0], cp))
        return C_NUMBER;
    return C_OTHER;
}

/* Bytes from s on that are characters of class c. */
static size_t run_of(const unsigned char *s, size_t n, enum cls c)
{
    size_t pos = 0, len;
    while (pos < n && char_class(s + pos, n - pos, &len) == c)
        pos += len;
    return pos;
}

/* The length of GPT-2's pre-tokenizer match at s (n > 0 bytes), the regex
 * 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ tried in order. */
static size_t pretoken_len(const unsigned char *s, size_t n)
{
    if (s[0] == '\'' && n >= 2) {
        if (s[1] && strchr("stmd", s[1]))
            return 2;
        if (n >= 3 && ((s[1] == 'r' && s[2] == 'e') || (s[1] == 'v' && s[2] == 'e') || (s[1] == 'l' && s[2] == 'l')))
            return 3;
    }
    size_t len;
    if (s[0] == ' ' && n >= 2) {
        enum cls next = char_class(s + 1, n - 1, &len);
        if (next != C_SPACE)
            return 1 + run_of(s + 1, n - 1, next);
    }
    enum cls c = char_class(s, n, &len);
    if (c != C_SPACE)
        return run_of(s, n, c);
    /* \s+(?!\S): all the whitespace up to the end, or all but its last character before a non-space */
    size_t pos = 0, last = 0;
    while (pos < n && char_class(s + pos, n - pos, &len) == C_SPACE) {
        last = pos;
        pos += len;
    }
    if (pos == n || last == 0)
        return pos; /* to the end; or a single whitespace character before a non-space: \s+ */
    return last;
}

struct ids {
    int32_t *v;
    size_t n, cap;
};

static bool ids_push(struct ids *ids, int32_t id)
{
    if (ids->n == ids->cap) {
        size_t cap = ids->cap ? 2 * ids->cap : 256;
        int32_t *v = realloc(ids->v, cap * sizeof *v);
        if (!v)
            return false;
        ids->v = v;
        ids->cap = cap;
    }
    ids->v[ids->n++] = id;
    return true;
}

struct cand {
    int32_t rank, left, right; /* a possible merge of the symbols starting at bytes left and right */
};

static bool cand_less(const struct cand *a, const struct cand *b)
{
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

static void heap_push(struct cand *h, size_t *n, struct cand c)
{
    size_t i = (*n)++;
    while (i > 0 && cand_less(&c, &h[(i - 1) / 2])) {
        h[i] = h[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h[i] = c;
}

static struct cand heap_pop(struct cand *h, size_t *n)
{
    struct cand top = h[0], last = h[--*n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n)
            break;
        if (c + 1 < *n && cand_less(&h[c + 1], &h[c]))
            c++;
        if (!cand_less(&h[c], &last))
            break;
        h[i] = h[c];
        i = c;
    }
    if (*n)
        h[i] = last;
    return top;
}

/* Scratch for one piece of m bytes: symbols indexed by their first byte. */
struct work {
    int32_t *sym, *next, *prev; /* (m) the symbol starting at byte i (-1: inside another), its neighbours */
    struct cand *heap;          /* (3 m) */
    size_t cap;
};

static bool work_reserve(struct work *w, size_t m)
{
    if (m <= w->cap)
        return true;
    size_t cap = m < 64 ? 64 : m;
    int32_t *sym = realloc(w->sym, cap * sizeof *sym), *next = sym ? realloc(w->next, cap * sizeof *next) : NULL;
    if (sym)
        w->sym = sym;
    if (next)
        w->next = next;
    int32_t *prev = next ? realloc(w->prev, cap * sizeof *prev) : NULL;
    if (prev)
        w->prev = prev;
    struct cand *heap = prev ? realloc(w->heap, 3 * cap * sizeof *heap) : NULL;
    if (heap)
        w->heap = heap;
    if (!heap)
        return false;
    w->cap = cap;
    return true;
}

static void try_merge(const struct tokenizer *t, struct work *w, size_t *nheap, int32_t left)
{
    int32_t right = w->next[left];
    if (right < 0)
        return;
    const struct merge *m = merge_find(t, w->sym[left], w->sym[right]);
    if (m)
        heap_push(w->heap, nheap, (struct cand){m->rank, left, right});
}

/* BPE of one piece (bytes s[0..m), base: its offset in the text, for errors). */
static enum amp_status bpe_piece(const struct tokenizer *t, const unsigned char *s, size_t m, size_t base,
                                 struct work *w, struct ids *out, struct amp_error *err)
{
    if (t->ignore_merges) {
        char sym[4096];
        size_t k = 0;
        for (size_t i = 0; i < m && k + 4 <= sizeof sym; i++)
            k += utf8_encode(byte_symbol(s[i]), sym + k);
        int32_t id = k + 4 <= sizeof sym ? vocab_find(t, sym, k) : -1;
        if (id >= 0)
            return ids_push(out, id) ? AMP_OK : amp_fail(err, AMP_ERR_INTERNAL, NULL, "tokenizer: out of memory");
    }
    if (!work_reserve(w, m))
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "tokenizer: out of memory (a piece of %zu bytes)", m);
    for (size_t i = 0; i < m; i++) {
        int32_t id = t->byte_id[s[i]];
        if (id < 0 && (id = t->unk_id) < 0)
            return amp_fail(err, AMP_ERR_DATA,
                            "train the tokenizer with the full byte alphabet (ByteLevel.alphabet()), or give it an unk_token",
                            "%s: byte 0x%02X at offset %zu of the text has no token in the vocab", t->name, s[i], base + i);
        w->sym[i] = id;
        w->next[i] = i + 1 < m ? (int32_t)i + 1 : -1;
        w->prev[i] = (int32_t)i - 1;
    }
    size_t nheap = 0;
    for (size_t i = 0; i + 1 < m; i++)
        try_merge(t, w, &nheap, (int32_t)i);
    while (nheap) {
        struct cand c = heap_pop(w->heap, &nheap);
        if (w->sym[c.left] < 0 || w->next[c.left] != c.right || w->sym[c.right] < 0)
            continue; /* stale: one of the two was merged away */
        const struct merge *m2 = merge_find(t, w->sym[c.left], w->sym[c.right]);
        if (!m2 || m2->rank != c.rank)
            continue;
        w->sym[c.left] = m2->id;
        w->sym[c.right] = -1;
        w->next[c.left] = w->next[c.right];
        if (w->next[c.left] >= 0)
            w->prev[w->next[c.left]] = c.left;
        if (w->prev[c.left] >= 0)
            try_merge(t, w, &nheap, w->prev[c.left]);
        try_merge(t, w, &nheap, c.left);
    }
    for (int32_t i = 0; i >= 0; i = w->next[i])
        if (!ids_push(out, w->sym[i]))
            return amp_fail(err, AMP_ERR_INTERNAL, NULL, "tokenizer: out of memory");
    return AMP_OK;
}

/* The stretch s[0..n) between added tokens: pre-tokenize, then BPE each piece. */
static enum amp_status encode_stretch(const struct tokenizer *t, const unsigned char *s, size_t n, size_t base,
                                      struct work *w, struct ids *out, struct amp_error *err)
{
    enum amp_status st = AMP_OK;
    for (size_t pos = 0; pos < n && st == AMP_OK;) {
        size_t len = pretoken_len(s + pos, n - pos);
        st = bpe_piece(t, s + pos, len, base + pos, w, out, err);
        pos += len;
    }
    return st;
}

/* The added token at s (n bytes left), longest first; -1 if none. */
static int added_at(const struct tokenizer *t, const unsigned char *s, size_t n)
{
    if (!t->added_first[s[0]])
        return -1;
    for (int i = 0; i < t->nadded; i++)
        if (t->added[i].len <= n && !memcmp(t->added[i].content, s, t->added[i].len))
            return i;
    return -1;
}

enum amp_status tokenizer_encode(const struct tokenizer *t, const char *text, size_t len, int32_t **ids, size_t *n,
                                 struct amp_error *err)
{
    *ids = NULL;
    *n = 0;
    const unsigned char *s = (const unsigned char *)text;
    struct ids out = {0};
    struct work w = {0};
    enum amp_status st = AMP_OK;
    size_t start = 0;
    for (size_t pos = 0; pos < len && st == AMP_OK;) {
        int a = added_at(t, s + pos, len - pos);
        if (a < 0) {
            pos++;
            continue;
        }
        st = encode_stretch(t, s + start, pos - start, start, &w, &out, err);
        if (st == AMP_OK && !ids_push(&out, t->added[a].id))
            st = amp_fail(err, AMP_ERR_INTERNAL, NULL, "tokenizer: out of memory");
        pos += t->added[a].len;
        start = pos;
    }
    if (st == AMP_OK)
        st = encode_stretch(t, s + start, len - start, start, &w, &out, err);
    free(w.sym);
    free(w.next);
    free(w.prev);
    free(w.heap);
    if (st != AMP_OK) {
        free(out.v);
        return st;
    }
    if (!out.v && !(out.v = malloc(sizeof *out.v))) /* empty text: a valid (empty) array all the same */
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "tokenizer: out of memory");
    *ids = out.v;
    *n = out.n;
    return AMP_OK;
}

/* ---- decoding ---------------------------------------------------------------------------------------- */

enum amp_status tokenizer_decode(const struct tokenizer *t, const int32_t *ids, size_t n, char **text, size_t *len,
                                 struct amp_error *err)
{
    *text = NULL;
    *len = 0;
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->nids || !t->tok[ids[i]]) {
            char why[64] = "no token has that id";
            if (ids[i] < 0 || ids[i] >= t->nids)
                snprintf(why, sizeof why, "ids are below %d", (int)t->nids);
            return amp_fail(err, AMP_ERR_DATA, "ids come from this tokenizer's encode (or a model trained on its tokens)",
                            "%s: id %lld (position %zu) is not a token of this tokenizer (%s)", t->name,
                            (long long)ids[i], i, why);
        }
        total += t->bytes_len[ids[i]];
    }
    char *out = malloc(total + 1);
    if (!out)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "tokenizer: out of memory (%zu bytes)", total);
    size_t pos = 0;
    for (size_t i = 0; i < n; i++) {
        memcpy(out + pos, t->bytes[ids[i]], t->bytes_len[ids[i]]);
        pos += t->bytes_len[ids[i]];
    }
    out[pos] = '\0';
    *text = out;
    *len = pos;
    return AMP_OK;
}
