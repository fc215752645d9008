/*
 * data_text.c — byte-level text: data.files concatenated into one byte stream; tokens are bytes
 * (vocabulary 256).
 *
 * The last floor(len * val_fraction) bytes are the test split, the rest the training split. Within a
 * split, sample i is the window of bytes [i*T, i*T + T] (T = data.seq_len, so T + 1 bytes): the first
 * T are the inputs, the last T the next-byte targets. Windows do not overlap except in that one shared
 * byte, so a split of L bytes has (L - 1) / T samples.
 */
#define _DEFAULT_SOURCE

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data_internal.h" /* data_check_file, data_alloc */

#define TEXT_MISSING_HINT \
    "install the fortunes package (text under /usr/share/games/fortunes/) or fix data.files"

/* Append the whole of `path` to buf (len used, cap allocated), growing it as needed. */
static enum amp_status text_append(const char *path, int64_t size_hint, uint8_t **buf, int64_t *len, int64_t *cap,
                                   struct amp_error *err)
{
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return amp_fail(err, AMP_ERR_DATA, "check the path and its permissions", "%s: cannot open (data.files): %s",
                        path, strerror(errno));
    enum amp_status st = AMP_OK;
    int64_t want = *len + size_hint + 1;
    for (;;) {
        if (want > *cap) {
            int64_t ncap = *cap * 2 > want ? *cap * 2 : want;
            uint8_t *p = data_alloc((uint64_t)ncap, 1, path, "the text", err);
            if (!p) {
                st = err ? err->code : AMP_ERR_INTERNAL;
                break;
            }
            if (*len)
                memcpy(p, *buf, (size_t)*len);
            free(*buf);
            *buf = p;
            *cap = ncap;
        }
        size_t r = fread(*buf + *len, 1, (size_t)(*cap - *len), fp);
        *len += (int64_t)r;
        if (r == 0 || *len < *cap) { /* end of file (or an error) before the buffer filled */
            if (ferror(fp))
                st = amp_fail(err, AMP_ERR_INTERNAL, "check the disk and retry", "%s: read error (data.files): %s",
                              path, strerror(errno));
            break;
        }
        want = *cap + 1; /* the file grew past its size: read on */
    }
    fclose(fp);
    return st;
}

enum amp_status data_load_text(struct dataset *ds, const struct data_config *cfg, struct amp_error *err)
{
    const int64_t T = cfg->seq_len;
    if (T < 1)
        return amp_fail(err, AMP_ERR_CONFIG, "set data.seq_len to a positive number of tokens",
                        "data.seq_len = %lld: must be at least 1", (long long)T);
    if (cfg->nfiles < 1 || cfg->nfiles > CFG_MAX_FILES)
        return amp_fail(err, AMP_ERR_CONFIG, "list the text files under data.files",
                        "data.files lists %d files (1 to %d allowed)", cfg->nfiles, CFG_MAX_FILES);
    int64_t len = 0, cap = 0;
    enum amp_status st = AMP_OK;
    for (int k = 0; k < cfg->nfiles && st == AMP_OK; k++) {
        int64_t size = 0;
        st = data_check_file(cfg->files[k], "data.files", TEXT_MISSING_HINT, &size, err);
        if (st == AMP_OK)
            st = text_append(cfg->files[k], size, &ds->text_buf, &len, &cap, err);
    }
    if (st != AMP_OK)
        return st;

    const char *what = cfg->nfiles == 1 ? cfg->files[0] : "data.files";
    int64_t test_len = (int64_t)floor((double)len * cfg->val_fraction);
    if (test_len > len)
        test_len = len;
    int64_t train_len = len - test_len;
    if (train_len < T + 1)
        return amp_fail(err, AMP_ERR_DATA, "use a shorter data.seq_len, a smaller data.val_fraction, or more text",
                        "%s: too short for one window: the training split has %lld bytes (of %lld, after holding out "
                        "data.val_fraction %g), one sample needs data.seq_len + 1 = %lld",
                        what, (long long)train_len, (long long)len, cfg->val_fraction, (long long)(T + 1));
    if (cfg->val_fraction > 0 && test_len < T + 1)
        return amp_fail(err, AMP_ERR_DATA,
                        "raise data.val_fraction, use a shorter data.seq_len or more text, or set data.val_fraction: 0",
                        "%s: too short for one test window: data.val_fraction %g of %lld bytes holds out %lld bytes, "
                        "one sample needs data.seq_len + 1 = %lld",
                        what, cfg->val_fraction, (long long)len, (long long)test_len, (long long)(T + 1));

    ds->split[SPLIT_TRAIN].text = ds->text_buf;
    ds->split[SPLIT_TRAIN].text_len = train_len;
    ds->split[SPLIT_TRAIN].n = (train_len - 1) / T;
    ds->split[SPLIT_TEST].text = ds->text_buf + train_len;
    ds->split[SPLIT_TEST].text_len = test_len;
    ds->split[SPLIT_TEST].n = test_len >= T + 1 ? (test_len - 1) / T : 0;
    ds->spec.sample_ndim = 1;
    ds->spec.sample_shape[0] = T;
    ds->spec.sample_shape[1] = ds->spec.sample_shape[2] = 1;
    ds->spec.is_tokens = true;
    ds->spec.num_classes = 256;
    ds->sample_numel = T;
    return AMP_OK;
}
