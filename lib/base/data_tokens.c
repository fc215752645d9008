/*
 * data_tokens.c — token files (data.format: tokens): the train.bin / val.bin that nanoGPT's prepare scripts
 * and llm.c's dev/data scripts write, memory-mapped and never read into memory whole.
 *
 * Layouts, told apart by the first four bytes (docs/data.md):
 *   - llm.c: a header of 256 little-endian int32 (1024 bytes): header[0] the magic, header[1] the version,
 *     header[2] the number of tokens; then the tokens. Magic 20240520 with version 1 is GPT-2's uint16 ids;
 *     magic 20240801 with version 7 is llama-3's uint32 ids (llm.c's data_common.py, HEADERS_INFO).
 *   - nanoGPT: no header, raw little-endian uint16 ids (np.uint16 tofile), so an even number of bytes.
 * A file that begins with neither magic is read as nanoGPT's layout, unless the rest of an llm.c header is
 * there (a token count at offset 8 that matches the file's size): then the magic is wrong.
 *
 * Checks, each a data error naming the file and the byte offset: a header too short, an unknown version,
 * a token count that disagrees with the file size, an odd length (raw uint16), fewer tokens than one window
 * (data.seq_len + 1), and any id >= data.vocab. The id check reads the mapped file once, sequentially, at
 * load, releasing the pages it has read every 64 MB (nothing is copied, and the process's resident set does
 * not grow with the file), so a run never starts on ids its embedding does not have.
 *
 * Samples (T = data.seq_len) are windows of T + 1 tokens: the first T are the inputs, the last T the
 * targets. Sample i >= 0 of a split is the window at token i * T: consecutive windows sharing only their
 * boundary token, so a file of L tokens has (L - 1) / T of them. These are what data.sampling: sequential
 * trains on (llm.c's order) and what evaluation reads (the first data.val_windows of val_bin, all when 0).
 * data.sampling: random draws window starts uniformly in [0, L - T) instead (nanoGPT's
 * torch.randint(len(data) - block_size)): the sampler (data.c, data_sampler_init) hands those out as
 * sample ids -1 - offset (data.h, DATA_WINDOW_AT), so one data_gather serves both.
 */
#define _DEFAULT_SOURCE /* madvise */

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h> /* fstat: a token file must be a regular file to be mapped */
#include <unistd.h>

#include "data_internal.h" /* data_check_file */

#define TOKENS_MISSING_HINT \
    "make the file with nanoGPT's or llm.c's data scripts, or scripts/tools/make_tokens.py, or fix %s"
#define LLMC_HEADER_BYTES 1024
#define LLMC_MAGIC_GPT2 20240520   /* version 1: uint16 ids */
#define LLMC_MAGIC_LLAMA3 20240801 /* version 7: uint32 ids */
#define SCAN_BLOCK 65536           /* tokens per block of the id scan */
#define SCAN_RELEASE (64u << 20)   /* bytes scanned between releases of the pages from this process */

/* One token file, mapped. */
struct token_file {
    const char *path;
    const char *key;       /* the config key that named it */
    void *map;             /* the whole file, PROT_READ */
    size_t map_len;
    int64_t header_bytes;  /* 1024 (llm.c) or 0 (nanoGPT) */
    const uint8_t *tokens; /* first token (after any header) */
    int token_bytes;       /* 2 or 4 */
    int64_t ntokens;
    const char *layout;    /* for messages */
};

static uint32_t le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint32_t token_at(const uint8_t *tokens, int token_bytes, int64_t i)
{
    const uint8_t *p = tokens + i * token_bytes;
    return token_bytes == 2 ? (uint32_t)p[0] | (uint32_t)p[1] << 8 : le32(p);
}

/* Which layout the first bytes announce; the token count and size are checked against the file's size. */
static enum amp_status tokens_parse_layout(struct token_file *f, const uint8_t *head, int64_t size,
                                           struct amp_error *err)
{
    uint32_t magic = size >= 4 ? le32(head) : 0;
    if (magic != LLMC_MAGIC_GPT2 && magic != LLMC_MAGIC_LLAMA3 && size >= LLMC_HEADER_BYTES) {
        /* An llm.c header whose magic alone is wrong: its token count (offset 8) matches the file's size. Raw
         * uint16 ids that happen to do so are too unlikely to be worth reading as tokens. */
        int64_t count = (int32_t)le32(head + 8), payload = size - LLMC_HEADER_BYTES;
        if (count > 0 && (count * 2 == payload || count * 4 == payload))
            return amp_fail(err, AMP_ERR_DATA,
                            "llm.c token files begin with magic 20240520 (GPT-2, uint16) or 20240801 (llama-3, "
                            "uint32): the header is damaged, re-make the file",
                            "%s: wrong magic %u at offset 0 in what is otherwise an llm.c header (%lld tokens at "
                            "offset 8, matching the file's size) (%s)",
                            f->path, magic, (long long)count, f->key);
    }
    if (magic != LLMC_MAGIC_GPT2 && magic != LLMC_MAGIC_LLAMA3) {
        f->layout = "raw uint16 (nanoGPT)";
        f->token_bytes = 2;
        if (size % 2)
            return amp_fail(err, AMP_ERR_DATA,
                            "a nanoGPT token file is raw uint16 ids: the file is truncated or not a token file; "
                            "re-make it",
                            "%s: odd length (%lld bytes) for a file of raw uint16 tokens: the last byte, at offset "
                            "%lld, is half a token (%s)",
                            f->path, (long long)size, (long long)(size - 1), f->key);
        f->ntokens = size / 2;
        f->header_bytes = 0;
        return AMP_OK;
    }
    if (size < LLMC_HEADER_BYTES)
        return amp_fail(err, AMP_ERR_DATA, "the file is truncated: re-make it with llm.c's data scripts",
                        "%s: llm.c magic %u at offset 0, but the file holds %lld bytes, fewer than the %d-byte header "
                        "(%s)",
                        f->path, magic, (long long)size, LLMC_HEADER_BYTES, f->key);
    uint32_t version = le32(head + 4);
    int32_t count = (int32_t)le32(head + 8);
    if (magic == LLMC_MAGIC_GPT2 && version == 1) {
        f->layout = "llm.c GPT-2 (uint16)";
        f->token_bytes = 2;
    } else if (magic == LLMC_MAGIC_LLAMA3 && version == 7) {
        f->layout = "llm.c llama-3 (uint32)";
        f->token_bytes = 4;
    } else {
        return amp_fail(err, AMP_ERR_DATA,
                        "ampTrain reads llm.c token files of magic 20240520 version 1 (uint16) and magic 20240801 "
                        "version 7 (uint32): re-make the file with llm.c's dev/data scripts",
                        "%s: unknown version %u at offset 4 for llm.c magic %u (%s)", f->path, version, magic, f->key);
    }
    int64_t payload = size - LLMC_HEADER_BYTES;
    if (count <= 0 || payload % f->token_bytes != 0 || (int64_t)count != payload / f->token_bytes)
        return amp_fail(err, AMP_ERR_DATA, "the file is truncated or its header damaged: re-make it",
                        "%s: the header (offset 8) says %lld tokens (%lld bytes after the %d-byte header), the file "
                        "holds %lld bytes after it (%s)",
                        f->path, (long long)count, (long long)count * f->token_bytes, LLMC_HEADER_BYTES,
                        (long long)payload, f->key);
    f->ntokens = count;
    f->header_bytes = LLMC_HEADER_BYTES;
    return AMP_OK;
}

/* Drop the scanned pages [*released, upto) from this process's resident set (never written, so they come back
 * from the file if touched again; the page cache keeps them as it likes), so that scanning a file larger than
 * memory does not look like using that memory. */
static void tokens_release(const struct token_file *f, size_t *released, size_t upto)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE), end = upto / page * page;
    if (end > *released) {
        madvise((uint8_t *)f->map + *released, end - *released, MADV_DONTNEED);
        *released = end;
    }
}

/* The first id >= vocab, scanning in blocks (a max per block, so the loop vectorises); -1 if none. */
static int64_t tokens_first_beyond(const struct token_file *f, int64_t vocab)
{
    if (f->token_bytes == 2 && vocab >= 65536)
        return -1;
    size_t released = 0;
    for (int64_t b = 0; b < f->ntokens; b += SCAN_BLOCK) {
        size_t scanned = (size_t)(f->header_bytes + b * f->token_bytes);
        if (scanned - released >= SCAN_RELEASE)
            tokens_release(f, &released, scanned);
        int64_t end = b + SCAN_BLOCK < f->ntokens ? b + SCAN_BLOCK : f->ntokens;
        uint32_t max = 0;
        if (f->token_bytes == 2) {
            for (int64_t i = b; i < end; i++) {
                uint32_t v = (uint32_t)f->tokens[2 * i] | (uint32_t)f->tokens[2 * i + 1] << 8;
                max = v > max ? v : max;
            }
        } else {
            for (int64_t i = b; i < end; i++) {
                uint32_t v = le32(f->tokens + 4 * i);
                max = v > max ? v : max;
            }
        }
        if ((int64_t)max < vocab) {
            if (end == f->ntokens)
                tokens_release(f, &released, f->map_len);
            continue;
        }
        for (int64_t i = b; i < end; i++)
            if ((int64_t)token_at(f->tokens, f->token_bytes, i) >= vocab)
                return i;
    }
    return -1;
}

static void tokens_unmap(struct token_file *f)
{
    if (f->map)
        munmap(f->map, f->map_len);
    f->map = NULL;
}

/* Check, map and scan one file; `random_reads` tells the kernel that windows will be read at random offsets
 * (no readahead). On success and failure alike f->map (when set) is the caller's to unmap. */
static enum amp_status tokens_open(struct token_file *f, const struct data_config *cfg, bool random_reads,
                                   struct amp_error *err)
{
    char hint[CFG_STR + 128];
    snprintf(hint, sizeof hint, TOKENS_MISSING_HINT, f->key);
    int64_t size = 0;
    enum amp_status st = data_check_file(f->path, f->key, hint, &size, err);
    if (st != AMP_OK)
        return st;
    if ((uint64_t)size > SIZE_MAX)
        return amp_fail(err, AMP_ERR_DATA, "use a 64-bit machine", "%s: %lld bytes cannot be mapped here (%s)",
                        f->path, (long long)size, f->key);
    int fd = open(f->path, O_RDONLY | O_NONBLOCK); /* a FIFO put in its place since the check must not block */
    if (fd < 0)
        return amp_fail(err, AMP_ERR_DATA, "check the path and its permissions", "%s: cannot open (%s): %s", f->path,
                        f->key, strerror(errno));
    struct stat stf;
    if (fstat(fd, &stf) != 0 || !S_ISREG(stf.st_mode) || stf.st_size != size) {
        close(fd);
        return amp_fail(err, AMP_ERR_DATA, "name a token file on disk (not a device, pipe or a file being written)",
                        "%s: not a regular file of a fixed size, which a token file must be to be memory-mapped (%s)",
                        f->path, f->key);
    }
    void *map = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
    int map_errno = errno;
    close(fd);
    if (map == MAP_FAILED)
        return amp_fail(err, AMP_ERR_INTERNAL, "check that the file is a regular file on a local disk",
                        "%s: cannot memory-map %lld bytes (%s): %s", f->path, (long long)size, f->key,
                        strerror(map_errno));
    f->map = map;
    f->map_len = (size_t)size;
    const uint8_t *bytes = map;
    if ((st = tokens_parse_layout(f, bytes, size, err)) != AMP_OK)
        return st;
    f->tokens = bytes + f->header_bytes;
    const int64_t T = cfg->seq_len;
    if (f->ntokens < T + 1)
        return amp_fail(err, AMP_ERR_DATA, "use a shorter data.seq_len or a longer token file",
                        "%s: too short for one window: %lld tokens (%s, ending at byte offset %lld), one sample needs "
                        "data.seq_len + 1 = %lld (%s)",
                        f->path, (long long)f->ntokens, f->layout, (long long)size, (long long)(T + 1), f->key);
    madvise(map, (size_t)size, MADV_SEQUENTIAL);
    int64_t bad = tokens_first_beyond(f, cfg->vocab);
    madvise(map, (size_t)size, random_reads ? MADV_RANDOM : MADV_NORMAL);
    if (bad >= 0) {
        long long offset = (long long)(f->header_bytes + bad * f->token_bytes);
        return amp_fail(err, AMP_ERR_DATA,
                        "set data.vocab to the tokenizer's vocabulary size (50257 for GPT-2's BPE, 256 for "
                        "scripts/tools/make_tokens.py), and the model's embedding vocab and lm_head out to match; or "
                        "re-make the file",
                        "%s: token id %u at token %lld (byte offset %lld) is not below data.vocab %lld (%s, %s)",
                        f->path, token_at(f->tokens, f->token_bytes, bad), (long long)bad, offset,
                        (long long)cfg->vocab, f->layout, f->key);
    }
    return AMP_OK;
}

static void tokens_set_split(struct dataset *ds, enum split s, const struct token_file *f, int64_t T)
{
    struct data_split *sp = &ds->split[s];
    ds->maps[s] = f->map;
    ds->map_len[s] = f->map_len;
    sp->tokens = f->tokens;
    sp->token_bytes = f->token_bytes;
    sp->ntokens = f->ntokens;
    sp->n = (f->ntokens - 1) / T; /* consecutive windows sharing their boundary token */
}

enum amp_status data_load_tokens(struct dataset *ds, const struct data_config *cfg, unsigned splits,
                                 struct amp_error *err)
{
    const int64_t T = cfg->seq_len;
    if (T < 1)
        return amp_fail(err, AMP_ERR_CONFIG, "set data.seq_len to a positive number of tokens",
                        "data.seq_len = %lld: must be at least 1", (long long)T);
    if (cfg->vocab < 1)
        return amp_fail(err, AMP_ERR_CONFIG, "set data.vocab to the tokenizer's vocabulary size",
                        "data.format is tokens but data.vocab is not set");
    enum amp_status st = AMP_OK;
    if (splits & (1u << SPLIT_TRAIN)) {
        struct token_file train = {.path = cfg->train_bin, .key = "data.train_bin"};
        if ((st = tokens_open(&train, cfg, cfg->sampling == SAMPLING_RANDOM, err)) != AMP_OK) {
            tokens_unmap(&train);
            return st;
        }
        tokens_set_split(ds, SPLIT_TRAIN, &train, T);
        ds->split[SPLIT_TRAIN].draw_range = train.ntokens - T; /* what data.sampling: random draws from */
    }
    if ((splits & (1u << SPLIT_TEST)) && cfg->val_bin[0]) {
        struct token_file val = {.path = cfg->val_bin, .key = "data.val_bin"};
        if ((st = tokens_open(&val, cfg, false, err)) != AMP_OK) {
            tokens_unmap(&val);
            return st; /* data_load frees the training mapping */
        }
        tokens_set_split(ds, SPLIT_TEST, &val, T);
        if (cfg->val_windows > 0 && cfg->val_windows < ds->split[SPLIT_TEST].n)
            ds->split[SPLIT_TEST].n = cfg->val_windows;
    }
    ds->spec.sample_ndim = 1;
    ds->spec.sample_shape[0] = T;
    ds->spec.sample_shape[1] = ds->spec.sample_shape[2] = 1;
    ds->spec.is_tokens = true;
    ds->spec.num_classes = cfg->vocab;
    ds->sample_numel = T;
    return AMP_OK;
}

void data_gather_tokens(const struct data_split *sp, int64_t T, const int64_t *idx, int64_t n, int32_t *tokens,
                        int32_t *labels)
{
    for (int64_t i = 0; i < n; i++) {
        int64_t start = idx[i] >= 0 ? idx[i] * T : DATA_WINDOW_AT(idx[i]);
        for (int64_t t = 0; t < T; t++) {
            if (tokens)
                tokens[i * T + t] = (int32_t)token_at(sp->tokens, sp->token_bytes, start + t);
            if (labels)
                labels[i * T + t] = (int32_t)token_at(sp->tokens, sp->token_bytes, start + t + 1);
        }
    }
}
