/*
 * fuzz_tokenizer.c — libFuzzer harness for the byte-level BPE tokenizer (lib/base/tokenizer.h): its readers of the
 * files users bring (`data.tokenizer`, `ampTrain tokenize --tokenizer`) and its encoder on arbitrary text.
 *
 * Input: a mode byte, then the rest (the seeds in tests/fuzz/corpus/tokenizer: a small BPE trained on fortunes by
 * scripts/ref/bpe_reference.py in each file form, and texts; tests/fuzz/tokenizer.dict holds the formats' tokens):
 *   mode % 3 == 0   the rest is a tokenizer.json (or a vocab.json: the reader tells them apart by the content)
 *   mode % 3 == 1   the rest is a vocab.json, a NUL byte, then its merges.txt
 *   mode % 3 == 2   the rest is text, encoded with a fixed tokenizer (the 256 byte symbols, a few merges,
 *                   <|endoftext|>) built at start
 *
 * Oracles (tokenizer.h's contract): a refused file is AMP_ERR_DATA naming the file (or the merges.txt), with a
 * hint, and leaves *out NULL (AMP_ERR_INTERNAL for memory); an accepted one has a vocab size in
 * [1, TOKENIZER_MAX_ID], and encoding a sample text (and the input itself) either fails with AMP_ERR_DATA (a byte
 * without a symbol) or gives ids that all decode. With the fixed tokenizer, every text encodes, every id is below
 * the vocab size, and decode(encode(text)) is the text, byte for byte.
 */
#define _GNU_SOURCE /* nftw, mkdtemp in fuzz_common.h */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"
#include "tokenizer.h"         /* tokenizer_load_memory, tokenizer_encode, tokenizer_decode */
#include "tokenizer_testlib.h" /* byte_symbol */

#define FILE_NAME "fuzz_tokenizer.json"

static struct tokenizer *fixed;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    static char json[16384];
    size_t k = (size_t)snprintf(json, sizeof json,
                                "{\"added_tokens\": [{\"id\": 262, \"content\": \"<|endoftext|>\", \"special\": true}],"
                                " \"normalizer\": null, \"pre_tokenizer\": {\"type\": \"ByteLevel\"}, \"post_processor\": "
                                "null, \"decoder\": {\"type\": \"ByteLevel\"}, \"model\": {\"type\": \"BPE\", \"vocab\": {");
    for (int b = 0; b < 256; b++)
        k += (size_t)snprintf(json + k, sizeof json - k, "\"\\u%04X\": %d, ", byte_symbol(b), b);
    snprintf(json + k, sizeof json - k,
             "\"\\u0120t\": 256, \"he\": 257, \"\\u0120the\": 258, \"in\": 259, \"\\u00C3\\u00A9\": 260, "
             "\"\\u010A\\u010A\": 261}, \"merges\": [\"\\u0120 t\", \"h e\", \"\\u0120t he\", \"i n\", "
             "[\"\\u00C3\", \"\\u00A9\"], [\"\\u010A\", \"\\u010A\"]]}}");
    struct amp_error err = {0};
    FUZZ_REQUIRE(tokenizer_load_memory(json, strlen(json), NULL, 0, "fixed.json", &fixed, &err) == AMP_OK, "%s",
                 err.msg);
    FUZZ_REQUIRE(tokenizer_vocab_size(fixed) == 263, "vocab %d", (int)tokenizer_vocab_size(fixed));
    return 0;
}

/* Encode `text` with t: a failure is AMP_ERR_DATA naming the tokenizer (or memory); the ids decode. With
 * `exact`, encoding must succeed, every id be below the vocab size, and decoding give the text back. */
static void check_encode(const struct tokenizer *t, const char *name, const uint8_t *text, size_t len, bool exact)
{
    int32_t *ids = NULL;
    size_t n = 0;
    struct amp_error err = {0};
    enum amp_status st = tokenizer_encode(t, (const char *)text, len, &ids, &n, &err);
    if (st != AMP_OK) {
        FUZZ_ORACLE(!exact || st == AMP_ERR_INTERNAL, "the fixed tokenizer refused a text: %s", err.msg);
        FUZZ_ORACLE(st == AMP_ERR_DATA || st == AMP_ERR_INTERNAL, "encode status %d: %s", (int)st, err.msg);
        FUZZ_ORACLE(st != AMP_ERR_DATA || strstr(err.msg, name), "encode error without the file: %s", err.msg);
        FUZZ_ORACLE(ids == NULL && n == 0, "a failed encode left ids");
        return;
    }
    FUZZ_ORACLE(ids != NULL && n <= len, "%zu ids for %zu bytes", n, len);
    for (size_t i = 0; exact && i < n; i++)
        FUZZ_ORACLE(ids[i] >= 0 && ids[i] < tokenizer_vocab_size(t), "id %d of %d", (int)ids[i],
                    (int)tokenizer_vocab_size(t));
    char *back = NULL;
    size_t back_len = 0;
    st = tokenizer_decode(t, ids, n, &back, &back_len, &err);
    FUZZ_ORACLE(st == AMP_OK || st == AMP_ERR_INTERNAL, "encode gave ids decode refuses: %s", err.msg);
    if (st == AMP_OK && exact)
        FUZZ_ORACLE(back_len == len && !memcmp(back, text, len), "decode(encode(x)) != x (%zu -> %zu bytes)", len,
                    back_len);
    if (st == AMP_OK)
        FUZZ_ORACLE(back[back_len] == '\0', "decode's text is not NUL-terminated");
    free(back);
    free(ids);
}

static void check_files(const uint8_t *json, size_t json_len, const uint8_t *merges, size_t merges_len)
{
    /* NUL-terminated copies, as a file read gives them (and so a reader that runs past the end is caught) */
    char *j = malloc(json_len + 1), *m = merges ? malloc(merges_len + 1) : NULL;
    FUZZ_REQUIRE(j && (!merges || m), "malloc");
    memcpy(j, json, json_len);
    j[json_len] = '\0';
    if (m) {
        memcpy(m, merges, merges_len);
        m[merges_len] = '\0';
    }
    struct tokenizer *t = (struct tokenizer *)&t; /* not NULL: a refusal must set it */
    struct amp_error err = {0};
    enum amp_status st = tokenizer_load_memory(j, json_len, m, merges_len, FILE_NAME, &t, &err);
    if (st != AMP_OK) {
        FUZZ_NOTE("refused: %s", err.msg);
        FUZZ_ORACLE(st == AMP_ERR_DATA || st == AMP_ERR_INTERNAL, "status %d: %s", (int)st, err.msg);
        FUZZ_ORACLE(st != AMP_ERR_DATA || strstr(err.msg, FILE_NAME) || strstr(err.msg, "merges.txt"),
                    "unnamed file: %s", err.msg);
        FUZZ_ORACLE(st != AMP_ERR_DATA || err.hint[0], "no hint: %s", err.msg);
        FUZZ_ORACLE(t == NULL, "a refused file left a tokenizer");
    } else {
        FUZZ_NOTE("accepted: vocab %d", (int)tokenizer_vocab_size(t));
        FUZZ_ORACLE(tokenizer_vocab_size(t) >= 1 && tokenizer_vocab_size(t) <= TOKENIZER_MAX_ID, "vocab size %d",
                    (int)tokenizer_vocab_size(t));
        static const char sample[] = "Hello, world! It's 2024: <|endoftext|> caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac  \n\n"
                                     "x\xff\x80y   ";
        check_encode(t, FILE_NAME, (const uint8_t *)sample, sizeof sample - 1, false);
        check_encode(t, FILE_NAME, json, json_len < 4096 ? json_len : 4096, false);
        tokenizer_free(t);
    }
    free(j);
    free(m);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0)
        return 0;
    const uint8_t *rest = data + 1;
    size_t n = size - 1;
    switch (data[0] % 3) {
    case 0:
        check_files(rest, n, NULL, 0);
        break;
    case 1: {
        const uint8_t *nul = memchr(rest, 0, n);
        size_t json_len = nul ? (size_t)(nul - rest) : n;
        check_files(rest, json_len, nul ? nul + 1 : (const uint8_t *)"", nul ? n - json_len - 1 : 0);
        break;
    }
    default:
        check_encode(fixed, "fixed.json", rest, n, true);
    }
    return 0;
}
