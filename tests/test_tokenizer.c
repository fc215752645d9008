/*
 * test_tokenizer.c — the byte-level BPE tokenizer (lib/base/tokenizer.h) and `ampTrain tokenize`.
 *
 * Against Hugging Face's `tokenizers` (scripts/ref/bpe_reference.py, /usr/bin/python3): a BPE trained on every
 * fortune, in its three file forms, must encode every fortune (and the script's extra cases: Unicode, added
 * tokens, whitespace) to the library's ids and decode them to the text and to the library's decode. Then unit
 * tests on a tiny hand-built tokenizer (the 256 byte symbols as ids 0..255, a few merges): merge order, empty
 * text, invalid UTF-8, unknown ids, added tokens; and hostile files, each with its exact message and status.
 */
#define _GNU_SOURCE /* popen, mkdtemp, memmem */
#include <criterion/criterion.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "testrun.h"           /* amp, shell */
#include "tokenizer.h"         /* tokenizer_load, tokenizer_encode, tokenizer_decode */
#include "tokenizer_testlib.h" /* byte_symbol */

#define FORTUNES "/usr/share/games/fortunes"

/* A fresh scratch directory (removed by the next test run's system's tmp cleaning; small). */
static const char *scratch(void)
{
    static char dir[64];
    snprintf(dir, sizeof dir, "/tmp/amp_tok_XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    return dir;
}

static void write_file(const char *dir, const char *name, const char *data, size_t n)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "%s", path);
    cr_assert_eq(fwrite(data, 1, n, f), n);
    cr_assert_eq(fclose(f), 0);
}

static char *read_all(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s", path);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)size + 1);
    cr_assert_not_null(buf);
    cr_assert_eq(fread(buf, 1, (size_t)size, f), (size_t)size);
    buf[size] = '\0';
    fclose(f);
    *n = (size_t)size;
    return buf;
}

/* ---- against Hugging Face's tokenizers on the fortunes ------------------------------------------------ */

/* Train the reference BPE on every fortune file into a scratch directory (skips without the test set). */
static const char *reference_dir(void)
{
    if (access("/usr/bin/python3", X_OK) != 0)
        cr_skip_test("no /usr/bin/python3 (scripts/install-deps.sh --test installs it)");
    if (shell("/usr/bin/python3 -c 'import tokenizers' 2>&1").code != 0)
        cr_skip_test("no Python tokenizers package (scripts/install-deps.sh --test installs it)");
    if (access(FORTUNES "/cookie", R_OK) != 0)
        cr_skip_test("no fortunes (Debian's fortunes package)");
    const char *dir = scratch();
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "cd %s && /usr/bin/python3 scripts/ref/bpe_reference.py --vocab 1500 %s "
             "$(ls " FORTUNES "/* | grep -v '\\.dat$' | grep -v '\\.u8$') 2>&1",
             AMP_SOURCE_DIR, dir);
    struct result r = shell(cmd);
    cr_assert_eq(r.code, 0, "bpe_reference.py: %s", r.out);
    return dir;
}

/* Every case of DIR/cases.txt encoded with the tokenizer at `path` gives the library's ids, and decodes to the
 * text and to the library's decode. Returns the number of cases. */
static int check_cases(const char *dir, const char *path)
{
    struct tokenizer *t = NULL;
    struct amp_error err = {0};
    cr_assert_eq(tokenizer_load(path, &t, &err), AMP_OK, "%s", err.msg);
    cr_assert_eq(tokenizer_vocab_size(t), 1500);
    char cases[512];
    snprintf(cases, sizeof cases, "%s/cases.txt", dir);
    size_t size;
    char *all = read_all(cases, &size), *p = all;
    int ncases = 0, with_eot = 0;
    while (p < all + size) {
        size_t nbytes, nids, ndec;
        cr_assert_eq(sscanf(p, "%zu %zu %zu", &nbytes, &nids, &ndec), 3, "case %d header", ncases);
        const char *text = (const char *)memchr(p, '\n', (size_t)(all + size - p)) + 1; /* (a text may start with
                                                                                        * whitespace: not %n) */
        char *q = (char *)text + nbytes + 1;
        int32_t *want = malloc((nids + 1) * sizeof *want);
        cr_assert_not_null(want);
        for (size_t i = 0; i < nids; i++)
            want[i] = (int32_t)strtol(q, &q, 10);
        const char *dec = q + 1;
        p = (char *)dec + ndec + 1;

        int32_t *ids = NULL;
        size_t n = 0;
        cr_assert_eq(tokenizer_encode(t, text, nbytes, &ids, &n, &err), AMP_OK, "case %d: %s", ncases, err.msg);
        cr_assert_eq(n, nids, "case %d ('%.60s'): %zu ids, the library gives %zu", ncases, text, n, nids);
        for (size_t i = 0; i < n; i++)
            cr_assert_eq(ids[i], want[i], "case %d ('%.60s'): id %zu is %d, the library's %d", ncases, text, i,
                         (int)ids[i], (int)want[i]);
        char *back = NULL;
        size_t back_len = 0;
        cr_assert_eq(tokenizer_decode(t, ids, n, &back, &back_len, &err), AMP_OK, "%s", err.msg);
        cr_assert(back_len == nbytes && !memcmp(back, text, nbytes), "case %d: decode(encode(x)) != x", ncases);
        cr_assert(back_len == ndec && !memcmp(back, dec, ndec), "case %d: decode differs from the library's", ncases);
        with_eot += memmem(text, nbytes, "<|endoftext|>", 13) != NULL;
        free(back);
        free(ids);
        free(want);
        ncases++;
    }
    cr_assert_gt(with_eot, 0, "no case holds <|endoftext|>");
    free(all);
    tokenizer_free(t);
    return ncases;
}

Test(tokenizer, matches_hugging_face_on_every_fortune)
{
    const char *dir = reference_dir();
    char path[512];
    const char *forms[] = {"tokenizer.json", "tokenizer_strings.json", "vocab.json"};
    int counts[3];
    for (int f = 0; f < 3; f++) {
        snprintf(path, sizeof path, "%s/%s", dir, forms[f]);
        counts[f] = check_cases(dir, path);
    }
    cr_assert_gt(counts[0], 15000, "only %d fortunes", counts[0]); /* Debian's fortunes: ~15 thousand */
    cr_assert(counts[1] == counts[0] && counts[2] == counts[0]);
    check_cases(dir, dir); /* the directory: its tokenizer.json */
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    cr_assert_eq(system(cmd), 0);
}

/* `ampTrain tokenize` gives the ids the library gives, and --decode gives the text back. */
Test(tokenizer, command_round_trip)
{
    const char *dir = reference_dir();
    struct result r = amp("tokenize --tokenizer %s/tokenizer.json < " FORTUNES "/cookie > %s/ids.txt; echo rc=$?; "
                          "/usr/bin/python3 -c \"import tokenizers,sys; t=tokenizers.Tokenizer.from_file('%s/tokenizer.json');"
                          "ids=[int(x) for x in open('%s/ids.txt').read().split()];"
                          "want=t.encode(open('" FORTUNES "/cookie', encoding='utf-8').read()).ids;"
                          "print('same' if ids==want else 'differ', len(ids))\"; "
                          "%s tokenize --decode --tokenizer %s < %s/ids.txt | cmp - " FORTUNES "/cookie && echo back",
                          dir, dir, dir, dir, amp_binary(), dir, dir);
    cr_assert(strstr(r.out, "rc=0"), "%s", r.out);
    cr_assert(strstr(r.out, "same "), "%s", r.out);
    cr_assert(strstr(r.out, "\nback"), "%s", r.out);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    cr_assert_eq(system(cmd), 0);
}

/* ---- a tiny hand-built tokenizer --------------------------------------------------------------------- */

/* A tokenizer.json: the 256 byte symbols as ids 0..255, then `vocab_extra` (",\"ab\": 256", ...), `merges`,
 * `added` (the added_tokens array's items) and `model` (the model's type). */
static char *tiny_json(const char *model, const char *vocab_extra, const char *merges, const char *added)
{
    static char buf[65536];
    char vocab[16384];
    size_t k = 0;
    for (int b = 0; b < 256; b++)
        k += (size_t)snprintf(vocab + k, sizeof vocab - k, "%s\"\\u%04X\": %d", b ? ", " : "", byte_symbol(b), b);
    snprintf(buf, sizeof buf,
             "{\"version\": \"1.0\", \"truncation\": null, \"padding\": null, \"added_tokens\": [%s],\n"
             " \"normalizer\": null,\n"
             " \"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, "
             "\"use_regex\": true},\n"
             " \"post_processor\": null, \"decoder\": {\"type\": \"ByteLevel\"},\n"
             " \"model\": {\"type\": \"%s\", \"dropout\": null, \"unk_token\": null, \"vocab\": {%s%s},\n"
             "  \"merges\": [%s]}}\n",
             added, model, vocab, vocab_extra, merges);
    return buf;
}

static struct tokenizer *tiny(const char *vocab_extra, const char *merges, const char *added)
{
    const char *json = tiny_json("BPE", vocab_extra, merges, added);
    struct tokenizer *t = NULL;
    struct amp_error err = {0};
    cr_assert_eq(tokenizer_load_memory(json, strlen(json), NULL, 0, "tiny.json", &t, &err), AMP_OK, "%s", err.msg);
    return t;
}

static void expect_ids(const struct tokenizer *t, const char *text, size_t len, const int32_t *want, size_t nwant)
{
    int32_t *ids = NULL;
    size_t n = 99;
    struct amp_error err = {0};
    cr_assert_eq(tokenizer_encode(t, text, len, &ids, &n, &err), AMP_OK, "%s", err.msg);
    cr_assert_not_null(ids);
    cr_assert_eq(n, nwant, "'%s': %zu ids, want %zu", text, n, nwant);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(ids[i], want[i], "'%s': id %zu is %d, want %d", text, i, (int)ids[i], (int)want[i]);
    char *back = NULL;
    size_t back_len = 99;
    cr_assert_eq(tokenizer_decode(t, ids, n, &back, &back_len, &err), AMP_OK, "%s", err.msg);
    cr_assert(back_len == len && !memcmp(back, text, len) && back[len] == '\0', "'%s' does not decode back", text);
    free(back);
    free(ids);
}

Test(tokenizer, merges_apply_by_rank)
{
    struct tokenizer *t = tiny(", \"ab\": 256, \"bc\": 257", "[\"a\", \"b\"], [\"b\", \"c\"]", "");
    cr_assert_eq(tokenizer_vocab_size(t), 258);
    expect_ids(t, "abc", 3, (int32_t[]){256, 'c'}, 2);
    tokenizer_free(t);
    t = tiny(", \"ab\": 256, \"bc\": 257", "\"b c\", \"a b\"", ""); /* the other order, as "a b" strings */
    expect_ids(t, "abc", 3, (int32_t[]){'a', 257}, 2);
    expect_ids(t, "abcabc", 6, (int32_t[]){'a', 257, 'a', 257}, 4); /* one word: \p{L}+ */
    tokenizer_free(t);
    /* "a a a": the leftmost pair merges first, as GPT-2's and Hugging Face's BPE do */
    t = tiny(", \"aa\": 256", "\"a a\"", "");
    expect_ids(t, "aaa", 3, (int32_t[]){256, 'a'}, 2);
    tokenizer_free(t);
}

Test(tokenizer, pre_tokenizer_splits_as_gpt2)
{
    /* merges that would join across GPT-2's pieces if the split were wrong: "Ġ" + "b" ("Ġ" is byte 0x20's symbol) */
    struct tokenizer *t = tiny(", \"\\u0120b\": 256, \"'s\": 257", "[\"\\u0120\", \"b\"], [\"'\", \"s\"]", "");
    /* " b" is one piece (a space and letters); "'s" a contraction; "  b": the whitespace run gives back its last space */
    expect_ids(t, "a b's", 5, (int32_t[]){'a', 256, 257}, 3);
    expect_ids(t, "a  b", 4, (int32_t[]){'a', ' ', 256}, 3);
    expect_ids(t, "a\n b", 4, (int32_t[]){'a', '\n', 256}, 3);
    expect_ids(t, "b\n", 2, (int32_t[]){'b', '\n'}, 2);
    tokenizer_free(t);
}

Test(tokenizer, empty_text)
{
    struct tokenizer *t = tiny("", "", "");
    expect_ids(t, "", 0, NULL, 0);
    char *text = NULL;
    size_t len = 99;
    struct amp_error err = {0};
    cr_assert_eq(tokenizer_decode(t, NULL, 0, &text, &len, &err), AMP_OK);
    cr_assert(text && len == 0 && text[0] == '\0');
    free(text);
    tokenizer_free(t);
}

Test(tokenizer, invalid_utf8_bytes_round_trip)
{
    /* "b" + byte 0xff's symbol (U+00FF) merges before "a b": only if 0xff joined the letters' piece */
    struct tokenizer *t = tiny(", \"ab\": 256, \"b\\u00FF\": 257", "\"b \\u00FF\", \"a b\"", "");
    /* an invalid byte is a character of the [^\s\p{L}\p{N}] class: a piece of its own, after "ab" */
    expect_ids(t, "ab\xff", 3, (int32_t[]){256, 0xff}, 2);
    expect_ids(t, "ab\xff" "ab", 5, (int32_t[]){256, 0xff, 256}, 3);
    expect_ids(t, "\xc3", 1, (int32_t[]){0xc3}, 1);                  /* a cut-short sequence */
    expect_ids(t, "\xed\xa0\x80", 3, (int32_t[]){0xed, 0xa0, 0x80}, 3); /* an encoded surrogate */
    expect_ids(t, "\xc3\xa9t\xc3\xa9", 5, (int32_t[]){0xc3, 0xa9, 't', 0xc3, 0xa9}, 5); /* "été": one piece */
    tokenizer_free(t);
}

Test(tokenizer, unknown_ids_are_refused)
{
    struct tokenizer *t = tiny("", "", "{\"id\": 300, \"content\": \"<|endoftext|>\", \"special\": true}");
    cr_assert_eq(tokenizer_vocab_size(t), 301);
    const int32_t cases[][2] = {{301, 0}, {-1, 0}, {280, 1}}; /* past the end, negative, a hole */
    const char *msgs[] = {"tiny.json: id 301 (position 0) is not a token of this tokenizer (ids are below 301)",
                          "tiny.json: id -1 (position 0) is not a token of this tokenizer (ids are below 301)",
                          "tiny.json: id 280 (position 1) is not a token of this tokenizer (no token has that id)"};
    for (int i = 0; i < 3; i++) {
        int32_t ids[2] = {'a', cases[i][0]};
        const int32_t *p = cases[i][1] ? ids : ids + 1;
        char *text = (char *)1;
        size_t len = 7;
        struct amp_error err = {0};
        cr_assert_eq(tokenizer_decode(t, p, (size_t)1 + (size_t)cases[i][1], &text, &len, &err), AMP_ERR_DATA);
        cr_assert_str_eq(err.msg, msgs[i]);
        cr_assert_null(text);
    }
    tokenizer_free(t);
}

Test(tokenizer, special_tokens_match_first)
{
    struct tokenizer *t = tiny(", \"ab\": 256", "\"a b\"",
                               "{\"id\": 257, \"content\": \"<|endoftext|>\", \"special\": true}, "
                               "{\"id\": 258, \"content\": \"<|end\", \"special\": true}");
    /* leftmost-longest; the text on each side is encoded alone (no merge across a special token) */
    expect_ids(t, "a<|endoftext|>b", 15, (int32_t[]){'a', 257, 'b'}, 3);
    expect_ids(t, "<|endoftext|><|end", 18, (int32_t[]){257, 258}, 2);
    expect_ids(t, "ab<|endoftext|", 14, (int32_t[]){256, 258, 'o', 'f', 't', 'e', 'x', 't', '|'}, 9);
    tokenizer_free(t);
}

/* ---- hostile files ---------------------------------------------------------------------------------- */

static void expect_refusal(const char *json, const char *name, enum amp_status want, const char *msg)
{
    struct tokenizer *t = (struct tokenizer *)1;
    struct amp_error err = {0};
    cr_assert_eq(tokenizer_load_memory(json, strlen(json), NULL, 0, name, &t, &err), want, "%s", err.msg);
    cr_assert_str_eq(err.msg, msg);
    cr_assert(err.hint[0], "no hint for: %s", err.msg);
    cr_assert_null(t);
}

Test(tokenizer, truncated_json)
{
    const char *json = tiny_json("BPE", "", "", "");
    char cut[65536];
    size_t n = strlen(json) / 2;
    memcpy(cut, json, n);
    cut[n] = '\0';
    char msg[256];
    snprintf(msg, sizeof msg, "t.json: byte %zu: the file ends inside an object", n);
    expect_refusal(cut, "t.json", AMP_ERR_DATA, msg);
    /* every cut is refused, at a byte offset within the file */
    for (size_t k = 0; k + 1 < strlen(json); k++) { /* (the last byte is a newline) */
        struct tokenizer *t = NULL;
        struct amp_error err = {0};
        cr_assert_eq(tokenizer_load_memory(json, k, NULL, 0, "t.json", &t, &err), AMP_ERR_DATA, "cut at %zu: %s", k, err.msg);
        size_t at = (size_t)-1;
        cr_assert(sscanf(err.msg, "t.json: byte %zu: ", &at) == 1 && at <= k, "cut at %zu: %s", k, err.msg);
        cr_assert_null(t);
    }
    expect_refusal("{\"model\": \"BP", "t.json", AMP_ERR_DATA,
                   "t.json: byte 10: a string that never ends (the file is cut short?)");
    expect_refusal("", "t.json", AMP_ERR_DATA, "t.json: byte 0: the file ends where a value should be");
}

Test(tokenizer, deep_nesting)
{
    static char deep[200000];
    size_t k = (size_t)sprintf(deep, "{\"model\": ");
    for (int i = 0; i < 100000; i++)
        deep[k++] = '[';
    deep[k] = '\0';
    expect_refusal(deep, "deep.json", AMP_ERR_DATA, "deep.json: byte 74: values nested deeper than 64 levels");
}

Test(tokenizer, huge_numbers)
{
    expect_refusal(tiny_json("BPE", ", \"ab\": 99999999999999999999999", "", ""), "t.json", AMP_ERR_DATA,
                   "t.json: model.vocab: 'ab': the id is out of range, not an integer in [0, 16777216)");
    expect_refusal(tiny_json("BPE", ", \"ab\": 16777216", "", ""), "t.json", AMP_ERR_DATA,
                   "t.json: model.vocab: 'ab': the id is out of range, not an integer in [0, 16777216)");
    expect_refusal(tiny_json("BPE", ", \"ab\": 2.5", "", ""), "t.json", AMP_ERR_DATA,
                   "t.json: model.vocab: 'ab': the id is out of range, not an integer in [0, 16777216)");
    expect_refusal(tiny_json("BPE", ", \"ab\": \"256\"", "", ""), "t.json", AMP_ERR_DATA,
                   "t.json: model.vocab: 'ab': the id is a string, not an integer in [0, 16777216)");
    expect_refusal(tiny_json("BPE", "", "", "{\"id\": 1e300, \"content\": \"<s>\"}"), "t.json", AMP_ERR_DATA,
                   "t.json: added_tokens[0].id: the id is out of range, not an integer in [0, 16777216)");
}

Test(tokenizer, duplicate_ids_and_tokens)
{
    expect_refusal(tiny_json("BPE", ", \"ab\": 97", "", ""), "t.json", AMP_ERR_DATA,
                   "t.json: model.vocab: id 97 is given twice, to 'a' and 'ab'");
    expect_refusal(tiny_json("BPE", ", \"a\": 300", "", ""), "t.json", AMP_ERR_DATA,
                   "t.json: model.vocab: 'a': the token appears twice");
    expect_refusal(tiny_json("BPE", "", "", "{\"id\": 98, \"content\": \"<s>\"}"), "t.json", AMP_ERR_DATA,
                   "t.json: added_tokens[0].id: id 98 is given twice, to 'b' and '<s>'");
    expect_refusal(tiny_json("BPE", ", \"ab\": 256", "\"a b\", [\"a\", \"b\"]", ""), "t.json", AMP_ERR_DATA,
                   "t.json: model.merges[1]: the merge 'a b' is given twice (first at rank 0)");
}

Test(tokenizer, merges_naming_unknown_symbols)
{
    expect_refusal(tiny_json("BPE", ", \"ab\": 256", "\"a xyz\"", ""), "t.json", AMP_ERR_DATA,
                   "t.json: model.merges[0]: the merge 'a xyz' names 'xyz', which is not in the vocab");
    expect_refusal(tiny_json("BPE", "", "\"a b\"", ""), "t.json", AMP_ERR_DATA,
                   "t.json: model.merges[0]: the merge 'a b' makes 'ab', which is not in the vocab");
    expect_refusal(tiny_json("BPE", "", "\"ab\"", ""), "t.json", AMP_ERR_DATA,
                   "t.json: model.merges[0]: 'ab' is not two symbols separated by one space");
}

Test(tokenizer, not_byte_level_bpe)
{
    expect_refusal(tiny_json("WordPiece", "", "", ""), "t.json", AMP_ERR_DATA,
                   "t.json: model is of type WordPiece, not BPE");
    char json[65536];
    snprintf(json, sizeof json, "%s", tiny_json("BPE", "", "", ""));
    char *p = strstr(json, "\"add_prefix_space\": false");
    memcpy(p, "\"add_prefix_space\": true ", 25);
    expect_refusal(json, "t.json", AMP_ERR_DATA,
                   "t.json: pre_tokenizer.add_prefix_space is true; ampTrain encodes as GPT-2 does, with "
                   "pre_tokenizer.add_prefix_space: false");
    snprintf(json, sizeof json, "%s", tiny_json("BPE", "", "", ""));
    p = strstr(json, "\"decoder\": {\"type\": \"ByteLevel\"}");
    memcpy(p, "\"decoder\": {\"type\": \"WordPiece\"}", 32);
    expect_refusal(json, "t.json", AMP_ERR_DATA, "t.json: decoder is of type WordPiece, not ByteLevel");
    snprintf(json, sizeof json, "%s", tiny_json("BPE", "", "", ""));
    p = strstr(json, "\"normalizer\": null");
    memcpy(p, "\"normalizer\": {}  ", 18);
    expect_refusal(json, "t.json", AMP_ERR_DATA,
                   "t.json: normalizer is set (an object); ampTrain encodes as GPT-2 does, without one");
}

/* The files: a missing one is a config error (2), a malformed one a data error (3); the command says so. */
Test(tokenizer, files_and_exit_codes)
{
    const char *dir = scratch();
    char path[512];
    struct tokenizer *t = NULL;
    struct amp_error err = {0};
    snprintf(path, sizeof path, "%s/none.json", dir);
    cr_assert_eq(tokenizer_load(path, &t, &err), AMP_ERR_CONFIG);
    char msg[1024];
    snprintf(msg, sizeof msg, "tokenizer %s: no such file or directory", path);
    cr_assert_str_eq(err.msg, msg);
    /* a vocab.json without merges.txt: the merges file is named */
    write_file(dir, "vocab.json", "{\"a\": 0, \"b\": 1}", 16);
    cr_assert_eq(tokenizer_load(dir, &t, &err), AMP_ERR_CONFIG);
    snprintf(msg, sizeof msg, "%s/merges.txt: cannot open: No such file or directory", dir);
    cr_assert_str_eq(err.msg, msg);
    write_file(dir, "merges.txt", "#version: 0.2\na b\n", 18);
    cr_assert_eq(tokenizer_load(dir, &t, &err), AMP_ERR_DATA);
    snprintf(msg, sizeof msg, "%s/merges.txt: line 2: the merge 'a b' makes 'ab', which is not in the vocab", dir);
    cr_assert_str_eq(err.msg, msg);
    cr_assert_null(t);

    struct result r = amp("tokenize --tokenizer %s/none.json < /dev/null", dir);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "none.json: no such file or directory\nhint: "), "%s", r.out);
    r = amp("tokenize --tokenizer %s < /dev/null", dir);
    cr_assert_eq(r.code, 3, "%s", r.out);
    cr_assert(strstr(r.out, "merges.txt: line 2: the merge 'a b' makes 'ab', which is not in the vocab\nhint: "), "%s",
              r.out);
    write_file(dir, "merges.txt", "#version: 0.2\n", 14);
    write_file(dir, "bad.txt", "1 0 7", 5);
    write_file(dir, "x.txt", "1 x0", 4);
    write_file(dir, "ok.txt", "1 0 1\n", 6);
    r = amp("tokenize --tokenizer %s/vocab.json --decode < %s/bad.txt", dir, dir);
    cr_assert_eq(r.code, 3, "%s", r.out);
    cr_assert(strstr(r.out, "vocab.json: id 7 (position 2) is not a token of this tokenizer (ids are below 2)"), "%s",
              r.out);
    r = amp("tokenize --tokenizer %s/vocab.json --decode < %s/x.txt", dir, dir);
    cr_assert_eq(r.code, 3, "%s", r.out);
    cr_assert(strstr(r.out, "tokenize --decode: stdin: 'x0' (byte 2, id 2) is not an id"), "%s", r.out);
    r = amp("tokenize --tokenizer %s/vocab.json --decode < %s/ok.txt", dir, dir);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "bab"), "%s", r.out);
    r = amp("tokenize < /dev/null");
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "tokenize: missing --tokenizer FILE"), "%s", r.out);
    r = amp("tokenize --tokenizer < /dev/null");
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "ampTrain: error: tokenize: --tokenizer needs a FILE\nhint: "), "%s", r.out);
    r = amp("tokenize --tokenizer %s/vocab.json --encode < /dev/null", dir);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "ampTrain: error: tokenize: unexpected argument '--encode'\nhint: "), "%s", r.out);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    cr_assert_eq(system(cmd), 0);
}

/* data.tokenizer: a path in the config schema (tokens format), printed by check; another format warns it is unused. */
Test(tokenizer, config_key)
{
    struct result r = amp("check configs/tokens_gpt.yaml data.tokenizer=tok/tokenizer.json");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "  tokenizer: \"tok/tokenizer.json\"\n"), "%s", r.out);
    r = amp("check configs/tokens_gpt.yaml data.format=text data.files=[a.txt] data.tokenizer=t.json");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "data.tokenizer is set but data.format text does not read it"), "%s", r.out);
    r = amp("check configs/tokens_gpt.yaml data.tokenizer=[a]");
    cr_assert_eq(r.code, 2, "%s", r.out);
}

/* make_tokens.py --tokenizer: the token files hold the library's ids of the text (through `ampTrain tokenize`). */
Test(tokenizer, make_tokens_with_a_tokenizer)
{
    const char *dir = reference_dir();
    char cmd[3000];
    const char *layouts[] = {"nanogpt", "llmc"};
    for (int l = 0; l < 2; l++) {
        snprintf(cmd, sizeof cmd,
                 "cd %s && /usr/bin/python3 scripts/tools/make_tokens.py --tokenizer %s/vocab.json --amptrain %s "
                 "--format %s "
                 "--val-fraction 0.25 -o %s/train.bin " FORTUNES "/cookie " FORTUNES "/computers 2>&1 && "
                 "/usr/bin/python3 -c \"import tokenizers, numpy as np; t=tokenizers.Tokenizer.from_file('%s/tokenizer.json');"
                 "text=open('" FORTUNES "/cookie', encoding='utf-8').read()+open('" FORTUNES "/computers', encoding='utf-8').read();"
                 "want=t.encode(text).ids; skip=%d;"
                 "got=np.concatenate([np.fromfile('%s/train.bin', dtype='<u2')[skip:], np.fromfile('%s/val.bin', dtype='<u2')[skip:]]);"
                 "print('same' if got.tolist()==want else 'differ', len(want))\"",
                 AMP_SOURCE_DIR, dir, amp_binary(), layouts[l], dir, dir, l == 1 ? 512 : 0, dir, dir);
        struct result r = shell(cmd);
        cr_assert_eq(r.code, 0, "%s", r.out);
        cr_assert(strstr(r.out, "make_tokens: set data.vocab: 1500 and data.tokenizer: "), "%s", r.out);
        cr_assert(strstr(r.out, "\nsame "), "%s", r.out);
    }
    snprintf(cmd, sizeof cmd,
             "cd %s && /usr/bin/python3 scripts/tools/make_tokens.py --tokenizer %s/none.json --amptrain %s -o "
             "%s/t.bin "
             FORTUNES "/cookie 2>&1; echo rc=$?; ls %s/t.bin 2>&1",
             AMP_SOURCE_DIR, dir, amp_binary(), dir, dir);
    struct result r = shell(cmd);
    cr_assert(strstr(r.out, "none.json: no such file or directory\nhint: "), "%s", r.out);
    cr_assert(strstr(r.out, "rc=2\n"), "%s", r.out);
    cr_assert(strstr(r.out, "No such file"), "a token file was written: %s", r.out);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    cr_assert_eq(system(cmd), 0);
}
