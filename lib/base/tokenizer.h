/*
 * tokenizer.h — GPT-2-style byte-level BPE, read from Hugging Face's files, encoding and decoding in C.
 *
 * Files: a `tokenizer.json` (the `tokenizers` library's one-file form), or GPT-2's pair `vocab.json` +
 * `merges.txt` (same directory), or a directory holding either (tokenizer.json preferred). JSON is read by a
 * strict reader of our own (nesting at most TOKENIZER_MAX_DEPTH, files at most TOKENIZER_MAX_FILE bytes, ids
 * below TOKENIZER_MAX_ID); an error names the file and the byte offset or the key at fault.
 *
 * Semantics, as Hugging Face's ByteLevel BPE (GPT-2's):
 *   1. Added tokens (tokenizer.json's `added_tokens`; in the vocab.json form `<|endoftext|>` where the vocab
 *      has it, as transformers' GPT2Tokenizer) are matched literally first, leftmost-longest; the text between
 *      them is encoded alone.
 *   2. GPT-2's pre-tokenizer regex splits that text:
 *      's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *      (\s: Unicode White_Space; \p{L}, \p{N}: Unicode letters and numbers). A byte that is not part of valid
 *      UTF-8 is a character of its own in the [^\s\p{L}\p{N}] class.
 *   3. Each piece's bytes become GPT-2's byte-to-unicode symbols, merged by rank (lowest first, leftmost on a
 *      tie) with the merges; each final symbol is a vocab id.
 * Decoding joins the ids' tokens and maps the byte symbols back to bytes (a token holding any character
 * outside the 256 byte symbols, such as most added tokens, gives its own UTF-8 bytes). The bytes come back as
 * they are: decode(encode(x)) == x for any bytes x, valid UTF-8 or not. (Hugging Face's decode replaces
 * invalid UTF-8 with U+FFFD; for the ids of valid text the two agree.)
 *
 * Refused at load, with AMP_ERR_DATA naming the file and the setting, rather than encoding differently: a
 * model other than BPE, a pre-tokenizer or decoder other than ByteLevel, ByteLevel's add_prefix_space or
 * use_regex: false, a normalizer, a post-processor other than ByteLevel, truncation or padding, BPE dropout,
 * continuing_subword_prefix, end_of_word_suffix, byte_fallback, fuse_unk, added tokens with lstrip, rstrip
 * or single_word, merges naming a symbol not in the vocab, duplicate ids or merges.
 *
 * A byte whose symbol is not in the vocab (a vocab trained without the full byte alphabet) becomes the model's
 * unk_token where one is set; without one, encode fails naming the byte and its offset (Hugging Face would
 * drop it silently).
 */
#ifndef AMP_TOKENIZER_H
#define AMP_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "error.h" /* enum amp_status, struct amp_error */

#define TOKENIZER_MAX_DEPTH 64                   /* JSON nesting; tokenizer.json needs 5 */
#define TOKENIZER_MAX_FILE ((size_t)1 << 30)     /* bytes of one tokenizer file */
#define TOKENIZER_MAX_ID ((int32_t)1 << 24)      /* ids are in [0, TOKENIZER_MAX_ID) */

struct tokenizer;

/* path: a tokenizer.json, or a vocab.json with merges.txt in the same directory (or the directory holding
 * either). Errors name the file: AMP_ERR_DATA for a malformed/unsupported file, AMP_ERR_CONFIG for a missing one. */
enum amp_status tokenizer_load(const char *path, struct tokenizer **out, struct amp_error *err);

/* Load from bytes in memory (the fuzz harness): `json` is a tokenizer.json or a vocab.json (a tokenizer.json is the
 * one with a model); a vocab.json's merges are `merges` (merges_len bytes; NULL: none). `name` names the JSON in
 * errors, "merges.txt" the merges. AMP_ERR_DATA for any bad content, AMP_ERR_INTERNAL for memory. */
enum amp_status tokenizer_load_memory(const char *json, size_t json_len, const char *merges, size_t merges_len,
                                      const char *name, struct tokenizer **out, struct amp_error *err);

void tokenizer_free(struct tokenizer *t); /* accepts NULL */

int32_t tokenizer_vocab_size(const struct tokenizer *t); /* largest id + 1, added tokens included */

/* Encodes len bytes of text; *ids is malloc'd (caller frees), *n its length. */
enum amp_status tokenizer_encode(const struct tokenizer *t, const char *text, size_t len, int32_t **ids, size_t *n,
                                 struct amp_error *err);

/* Decodes n ids into malloc'd bytes *text (NUL-terminated, *len without the NUL); an id out of range is an error. */
enum amp_status tokenizer_decode(const struct tokenizer *t, const int32_t *ids, size_t n, char **text, size_t *len,
                                 struct amp_error *err);

#endif
