/*
 * fuzz_config.c — libFuzzer harness for the config reader with overrides (lib/base/config.h).
 *
 * Input: YAML text, a NUL byte, then `KEY=VALUE` overrides, one per line (no NUL: YAML only). YAML text that
 * starts with byte 0x01 is a recipe for a large document, so that small inputs reach the sizes where a
 * parser's cost per node shows (deep nesting, long lists): 0x01, bytes c and e giving a count R = c << (e % 16)
 * (the document is capped at MAX_DOC bytes), then up to four pieces separated by 0x01, P A B S, standing for
 * P + A x R + B x R + S (e.g. "run: ", "[", "]", ""). The YAML is
 * parsed with config_parse_string (when it is refused, the overrides go onto config_defaults instead, so
 * they are exercised whatever the YAML); every override is applied (a refused one must leave the config as
 * it was, so the next still applies); config_finalize runs; the result is printed (config_print_yaml,
 * config_print_warnings) to /dev/null, copied, and freed.
 *
 * Oracles (config.h's contract): a refusal carries AMP_ERR_CONFIG and a message; a finalized config
 * printed by config_to_yaml_string parses back to an equal config (config_equal); config_copy is equal.
 */
#define _DEFAULT_SOURCE
#define _XOPEN_SOURCE 700

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "config.h" /* config_parse_string, config_apply_override, config_finalize, config_print_yaml, ... */
#include "fuzz_common.h"

#define MAX_OVERRIDES 16
#define MAX_OVERRIDE_LEN 4096
#define MAX_DOC ((size_t)256 << 10) /* bytes an expanded recipe may reach: deep enough for a quadratic parse to time out */

static void check_refusal(enum amp_status st, const struct amp_error *err, const char *what)
{
    FUZZ_ORACLE(st == AMP_ERR_CONFIG || st == AMP_ERR_INTERNAL, "%s returned %d", what, (int)st);
    FUZZ_ORACLE(err->msg[0] != '\0', "%s refused without a message", what);
}

/* The printed YAML of a finalized config reads back to an equal config. */
static void check_round_trip(const struct config *cfg)
{
    char *yaml = config_to_yaml_string(cfg);
    FUZZ_ORACLE(yaml != NULL, "config_to_yaml_string returned NULL");
    if (!yaml)
        return;
    struct config back;
    struct amp_error err = {0};
    enum amp_status st = config_parse_string(&back, yaml, strlen(yaml), "<printed>", &err);
    FUZZ_ORACLE(st == AMP_OK, "the printed config does not parse back: %s\n--- printed:\n%s", err.msg, yaml);
    if (st == AMP_OK) {
        FUZZ_ORACLE(config_equal(cfg, &back), "the printed config parses back to a different config\n--- printed:\n%s",
                    yaml);
        config_free(&back);
    }
    free(yaml);

    struct config copy;
    st = config_copy(&copy, cfg, &err);
    FUZZ_ORACLE(st == AMP_OK, "config_copy failed: %s", err.msg);
    if (st == AMP_OK) {
        FUZZ_ORACLE(config_equal(cfg, &copy), "config_copy is not equal to its source");
        config_free(&copy);
    }
}

/* The YAML text of the input (malloc'd, NUL-terminated; *len its length): as it is, or expanded from a
 * 0x01 recipe. */
static char *yaml_text(const uint8_t *p, size_t n, size_t *len)
{
    if (n < 3 || p[0] != 0x01) {
        char *y = malloc(n + 1);
        if (y) {
            memcpy(y, p, n);
            y[n] = '\0';
        }
        *len = n;
        return y;
    }
    size_t reps = (size_t)p[1] << (p[2] % 16);
    const uint8_t *piece[4] = {p + 3, p + n, p + n, p + n};
    size_t plen[4] = {n - 3, 0, 0, 0};
    for (int k = 0; k < 3; k++) { /* split at 0x01 */
        const uint8_t *sep = memchr(piece[k], 0x01, plen[k]);
        if (!sep)
            break;
        plen[k + 1] = plen[k] - (size_t)(sep + 1 - piece[k]);
        piece[k + 1] = sep + 1;
        plen[k] = (size_t)(sep - piece[k]);
    }
    if (plen[1] + plen[2] == 0)
        reps = 0;
    else if (reps > MAX_DOC / (plen[1] + plen[2]))
        reps = MAX_DOC / (plen[1] + plen[2]);
    size_t total = plen[0] + reps * (plen[1] + plen[2]) + plen[3];
    char *y = malloc(total + 1), *w = y;
    if (!y)
        return NULL;
    memcpy(w, piece[0], plen[0]);
    w += plen[0];
    for (int k = 1; k <= 2; k++) { /* one copy, then doubling: a few large copies, not R small ones */
        size_t want = reps * plen[k], have = want ? plen[k] : 0;
        if (have)
            memcpy(w, piece[k], have);
        for (; have < want; have *= 2)
            memcpy(w + have, w, have < want - have ? have : want - have);
        w += want;
    }
    memcpy(w, piece[3], plen[3]);
    y[total] = '\0';
    *len = total;
    return y;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *nul = memchr(data, 0, size);
    size_t raw = nul ? (size_t)(nul - data) : size, ylen;
    char *yaml = yaml_text(data, raw, &ylen);
    if (!yaml)
        return 0;

    struct config cfg;
    struct amp_error err = {0};
    enum amp_status st = config_parse_string(&cfg, yaml, ylen, "fuzz.yaml", &err);
    free(yaml);
    FUZZ_NOTE("config_parse_string: %s", st == AMP_OK ? "accepted" : err.msg);
    if (st != AMP_OK) {
        check_refusal(st, &err, "config_parse_string");
        config_free(&cfg); /* "left freed", and config_free may be called again */
        config_defaults(&cfg);
    }

    /* Overrides: the rest, split at newlines (and NULs). */
    size_t pos = nul ? raw + 1 : size;
    char line[MAX_OVERRIDE_LEN + 1];
    for (int k = 0; k < MAX_OVERRIDES && pos < size; k++) {
        size_t end = pos;
        while (end < size && data[end] != '\n' && data[end] != '\0')
            end++;
        size_t len = end - pos < MAX_OVERRIDE_LEN ? end - pos : MAX_OVERRIDE_LEN;
        memcpy(line, data + pos, len);
        line[len] = '\0';
        pos = end + 1;
        memset(&err, 0, sizeof err);
        st = config_apply_override(&cfg, line, &err);
        FUZZ_NOTE("config_apply_override '%s': %s", line, st == AMP_OK ? "accepted" : err.msg);
        if (st != AMP_OK)
            check_refusal(st, &err, "config_apply_override");
    }

    memset(&err, 0, sizeof err);
    st = config_finalize(&cfg, &err);
    FUZZ_NOTE("config_finalize: %s", st == AMP_OK ? "accepted" : err.msg);
    if (st == AMP_OK) {
        FILE *out = fuzz_devnull();
        config_print_yaml(&cfg, out);
        config_print_warnings(&cfg, out);
        check_round_trip(&cfg);
    } else {
        check_refusal(st, &err, "config_finalize");
    }
    config_free(&cfg);
    return 0;
}
