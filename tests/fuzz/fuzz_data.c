/*
 * fuzz_data.c — libFuzzer harness for the data readers (lib/base/data.h: data_load; lib/base/data_idx.c,
 * lib/base/data_hdf5.c, lib/base/data_text.c, lib/base/data_tokens.c), through temporary files written from the input.
 *
 * Input: byte 0 the mode, bytes 1..4 the data_config knobs (batch size, val_fraction, mean/std, seq_len,
 * each an index into a table of ordinary and extreme values), then the payload:
 *   0 idx: up to four files separated by "#--#" (train images, train labels, test images, test labels;
 *     a missing test file repeats its training one), written as they are: plain IDX, or gzip as the seeds
 *     hold them, so mutations hit the gzip stream, its header and its CRC-32/length trailer.
 *   1 idx-gz: the same files, each gzip-compressed here, so mutated IDX headers reach the reader whole.
 *   2 hdf5-raw: the payload is the HDF5 file (data.path) as is: a user's data file has no checksum, so
 *     this reaches HDF5's own parser; crashes inside libhdf5 are filed apart by scripts/check/fuzz.sh.
 *   3 hdf5: the payload is a recipe for x and y built through the HDF5 API: name, type (float, integer,
 *     big-endian, string, compound), rank 0 to 5, dims (huge ones left unallocated), layout, values (NaN,
 *     inf, huge, negative labels, ...).
 *   4 text: up to three files separated by "#--#" (data.files).
 *   5 tokens: data.train_bin, then after "#--#" data.val_bin (none without a separator), written as they are
 *     (nanoGPT's raw uint16 or llm.c's headered layout); byte 2 picks data.sampling (bit 0) and
 *     data.val_windows, byte 3 data.vocab. An accepted random-sampling dataset also gathers a batch of drawn
 *     windows.
 *
 * Oracles (data.h's contract): a refusal is AMP_ERR_DATA or AMP_ERR_CONFIG (AMP_ERR_INTERNAL for memory)
 * with a message (and a hint for data errors) and leaves the dataset empty; an accepted dataset holds at
 * least min_samples training samples, labels (and token ids) in [0, num_classes), finite inputs, and every sample can be
 * gathered (ASan checks the sizes); an accepted gzip file is a complete gzip stream whose trailer (CRC-32
 * and length) matches.
 */
#define _GNU_SOURCE /* memmem */

#include <hdf5.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "data.h" /* data_load, data_gather, data_free */
#include "fuzz_common.h"
#include "h5compat.h" /* amp_h5_is_hdf5 */

#define SEP "#--#"
#define SEP_LEN 4
#define MAX_CHUNKS 4

enum mode { MODE_IDX, MODE_IDX_GZ, MODE_HDF5_RAW, MODE_HDF5, MODE_TEXT, MODE_TOKENS, MODE_COUNT };
static const char *const MODE_NAMES[MODE_COUNT] = {"idx", "idx-gz", "hdf5-raw", "hdf5", "text", "tokens"};

static const int64_t BATCH[] = {1, 2, 3, 4, 8, 64, 1000000};
static const double VAL_FRACTION[] = {0.1, 0.0, 0.5, 0.25, 0.999, 1e-300, 0.9999999999};
static const double MEAN_STD[][2] = {{0, 1}, {0.286, 0.353}, {0, 1e-300}, {1e300, 1}, {0, 1e-40}, {-1e10, 1e-5},
                                     {0, 3.4e38}};
static const int64_t SEQ_LEN[] = {4, 1, 2, 3, 8, 16, 64, 1000, INT64_MAX / 2};
static const int64_t VOCAB[] = {256, 1, 2, 50257, 65535, 65536, 100000, 16777216};
static const int64_t VAL_WINDOWS[] = {0, 1, 2, 1000};
#define PICK(table, b) table[(b) % (sizeof table / sizeof table[0])]

/* ---- payload chunks ------------------------------------------------------------------------------ */

struct chunk {
    const uint8_t *p;
    size_t n;
};

static int split_chunks(const uint8_t *data, size_t size, struct chunk *out, int max)
{
    int k = 0;
    size_t pos = 0;
    while (k < max) {
        const uint8_t *sep = k + 1 < max ? memmem(data + pos, size - pos, SEP, SEP_LEN) : NULL;
        size_t end = sep ? (size_t)(sep - data) : size;
        out[k++] = (struct chunk){data + pos, end - pos};
        if (!sep)
            break;
        pos = end + SEP_LEN;
    }
    return k;
}

static void write_gz(const char *path, const uint8_t *p, size_t n)
{
    gzFile gz = gzopen(path, "wb");
    FUZZ_REQUIRE(gz != NULL, "gzopen %s", path);
    FUZZ_REQUIRE(n == 0 || gzwrite(gz, p, (unsigned)n) == (int)n, "gzwrite %s", path);
    FUZZ_REQUIRE(gzclose(gz) == Z_OK, "gzclose %s", path);
}

/* Does the file start a gzip stream whose every member inflates to its end with a matching trailer? */
static bool gzip_complete(const uint8_t *p, size_t n)
{
    z_stream z;
    memset(&z, 0, sizeof z);
    if (inflateInit2(&z, 16 + MAX_WBITS) != Z_OK)
        return true; /* cannot tell */
    unsigned char out[1 << 14];
    z.next_in = (Bytef *)p;
    z.avail_in = (uInt)n;
    bool ok = false;
    for (;;) {
        z.next_out = out;
        z.avail_out = sizeof out;
        int r = inflate(&z, Z_NO_FLUSH);
        if (r == Z_STREAM_END) {
            ok = true;
            /* another member follows only if the gzip magic does (zlib ignores other trailing bytes) */
            if (z.avail_in >= 2 && z.next_in[0] == 0x1f && z.next_in[1] == 0x8b) {
                inflateReset(&z);
                ok = false;
                continue;
            }
            break;
        }
        if (r != Z_OK || (z.avail_in == 0 && z.avail_out != 0))
            break; /* an error, or the input ended inside a member */
    }
    inflateEnd(&z);
    return ok;
}

/* ---- mode 3: an HDF5 data file from a recipe ------------------------------------------------------- */

static const double F64S[] = {NAN, INFINITY, -INFINITY, 1e300, -1e300, 3.5e38, 1e-320, 0.0, -0.0, 1.0, -1.0, 255.0};

/* The numeric file types x and y may have: floats, integers of each size and sign, big-endian. */
static hid_t numeric_type(uint8_t i)
{
    switch (i) {
    case 0: return H5T_IEEE_F32LE;
    case 1: return H5T_IEEE_F64LE;
    case 2: return H5T_STD_I8LE;
    case 3: return H5T_STD_U8LE;
    case 4: return H5T_STD_I16LE;
    case 5: return H5T_STD_I32LE;
    case 6: return H5T_STD_I64LE;
    case 7: return H5T_STD_U64LE;
    case 8: return H5T_IEEE_F32BE;
    default: return H5T_STD_I64BE;
    }
}

#define TOO_BIG_TO_LOAD ((hsize_t)1 << 24)   /* elements; x or y beyond would take over 64 MB */
#define SURELY_REFUSED ((hsize_t)1 << 62)    /* elements: no machine has the memory, or the product overflows */

/* Elements of an extent, saturating at SURELY_REFUSED. */
static hsize_t extent(const hsize_t *dims, int rank)
{
    hsize_t n = 1;
    for (int d = 0; d < rank; d++) {
        if (dims[d] == 0)
            return 0;
        n = n > SURELY_REFUSED / dims[d] ? SURELY_REFUSED : n * dims[d];
    }
    return n;
}

/* Whether the raw file's x or y declares an extent between what loads and what the reader must refuse (see
 * build_dataset); such an input is skipped. */
static bool declares_huge_data(const char *path)
{
    htri_t is_h5 = amp_h5_is_hdf5(path);
    hid_t f = is_h5 > 0 ? H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT) : -1;
    bool huge = false;
    for (int k = 0; f >= 0 && k < 2 && !huge; k++) {
        const char *name = k ? "y" : "x";
        hid_t d = H5Lexists(f, name, H5P_DEFAULT) > 0 ? H5Dopen2(f, name, H5P_DEFAULT) : -1;
        hid_t sp = d >= 0 ? H5Dget_space(d) : -1;
        int rank = sp >= 0 ? H5Sget_simple_extent_ndims(sp) : -1;
        hsize_t dims[H5S_MAX_RANK];
        if (rank > 0 && rank <= H5S_MAX_RANK && H5Sget_simple_extent_dims(sp, dims, NULL) >= 0) {
            hsize_t n = extent(dims, rank);
            huge = n > TOO_BIG_TO_LOAD && n < SURELY_REFUSED;
        }
        if (sp >= 0)
            H5Sclose(sp);
        if (d >= 0)
            H5Dclose(d);
    }
    if (f >= 0)
        H5Fclose(f);
    H5Eclear2(H5E_DEFAULT);
    return huge;
}

static void build_dataset(hid_t f, struct fuzz_in *in, bool labels)
{
    static const char *const OTHER_NAMES[] = {"g/x", "g/y", "x "};
    uint8_t nb = fin_u8(in) % 8;
    if (nb == 7)
        return; /* missing */
    const char *name = nb < 4 ? (labels ? "y" : "x") : OTHER_NAMES[nb - 4];
    uint8_t tb = fin_u8(in) % 13;
    if (labels && tb < 10 && (fin_u8(in) & 1))
        tb = 2 + tb % 6; /* mostly integer labels (types 2..7) */
    hid_t ftype;
    if (tb < 10)
        ftype = H5Tcopy(numeric_type(tb));
    else if (tb == 10) {
        ftype = H5Tcopy(H5T_C_S1);
        H5Tset_size(ftype, 4);
    } else if (tb == 11) {
        ftype = H5Tcreate(H5T_COMPOUND, 4);
        H5Tinsert(ftype, "v", 0, H5T_NATIVE_FLOAT);
    } else {
        hid_t lcpl = H5Pcreate(H5P_LINK_CREATE);
        H5Pset_create_intermediate_group(lcpl, 1);
        hid_t gr = H5Gcreate2(f, name, lcpl, H5P_DEFAULT, H5P_DEFAULT);
        if (gr >= 0)
            H5Gclose(gr);
        H5Pclose(lcpl);
        return;
    }
    int rank = fin_u8(in) % 6;
    hsize_t dims[5], chunk[5], numel = 1;
    bool huge = false;
    for (int d = 0; d < rank; d++) {
        uint8_t b = fin_u8(in);
        dims[d] = b < 250 ? b % 7 : b == 250 ? 1000 : b == 251 ? (hsize_t)1 << 20 : (hsize_t)1 << (28 + b % 8);
    }
    /* A huge extent left unallocated is a valid dataset of fill values: loading it takes that much memory,
     * which is no bug, just over libFuzzer's limit. Keep sizes the reader must refuse (overflowing, or beyond
     * any machine's memory) or small enough to load. */
    while (numel = extent(dims, rank), numel > TOO_BIG_TO_LOAD && numel < SURELY_REFUSED) {
        int big = 0;
        for (int d = 1; d < rank; d++)
            big = dims[d] > dims[big] ? d : big;
        dims[big] = 7;
    }
    for (int d = 0; d < rank; d++) {
        huge |= dims[d] > 4096;
        chunk[d] = dims[d] ? (dims[d] < 64 ? dims[d] : 64) : 1;
    }
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    uint8_t layout = fin_u8(in);
    if (rank > 0 && (huge || (layout & 1))) {
        H5Pset_chunk(dcpl, rank, chunk);
        if (layout & 2)
            H5Pset_deflate(dcpl, 1);
    }
    hid_t space = rank ? H5Screate_simple(rank, dims, NULL) : H5Screate(H5S_SCALAR);
    hid_t lcpl = H5Pcreate(H5P_LINK_CREATE);
    H5Pset_create_intermediate_group(lcpl, 1);
    hid_t d = H5Dcreate2(f, name, ftype, space, lcpl, dcpl, H5P_DEFAULT);
    H5Pclose(lcpl);
    if (d >= 0 && !huge && numel > 0 && numel <= 4096 && tb < 10) {
        uint8_t pattern = fin_u8(in);
        bool is_float = H5Tget_class(ftype) == H5T_FLOAT;
        void *buf = malloc(numel * 8);
        for (hsize_t i = 0; buf && i < numel; i++) {
            uint8_t b = pattern < 64 ? (uint8_t)(pattern + i) : fin_u8(in);
            if (is_float) {
                double v = pattern < 32 ? F64S[b % 12] : (double)(int8_t)b;
                memcpy((char *)buf + 8 * i, &v, 8);
            } else {
                int64_t v = pattern < 64 ? (int64_t)(b % 3) : (int64_t)(int8_t)b;
                if (b == 0x7f)
                    v = INT64_MAX;
                memcpy((char *)buf + 8 * i, &v, 8);
            }
        }
        if (buf)
            H5Dwrite(d, is_float ? H5T_NATIVE_DOUBLE : H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf);
        free(buf);
    }
    if (d >= 0)
        H5Dclose(d);
    H5Sclose(space);
    H5Pclose(dcpl);
    H5Tclose(ftype);
}

static void build_hdf5(const char *path, const uint8_t *data, size_t size)
{
    hid_t f = H5Fcreate(path, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    FUZZ_REQUIRE(f >= 0, "H5Fcreate %s", path);
    struct fuzz_in in = {data, size};
    build_dataset(f, &in, false);
    build_dataset(f, &in, true);
    FUZZ_REQUIRE(H5Fclose(f) >= 0, "H5Fclose %s", path);
}

/* ---- checking the outcome -------------------------------------------------------------------------- */

static void check_refusal(enum amp_status st, const struct amp_error *err, const struct dataset *ds)
{
    FUZZ_ORACLE(st == AMP_ERR_DATA || st == AMP_ERR_CONFIG || st == AMP_ERR_INTERNAL, "data_load returned %d: %s",
                (int)st, err->msg);
    FUZZ_ORACLE(err->msg[0] != '\0', "data_load refused without a message");
    FUZZ_ORACLE(st != AMP_ERR_DATA || err->hint[0] != '\0', "data error without a hint: %s", err->msg);
    FUZZ_ORACLE(!ds->split[0].x && !ds->split[0].y && !ds->split[1].x && !ds->split[1].y && !ds->text_buf &&
                    !ds->maps[0] && !ds->maps[1],
                "a refused load left buffers in the dataset: %s", err->msg);
}

static void check_dataset(const struct dataset *ds, int64_t min_samples)
{
    const struct data_spec *sp = &ds->spec;
    FUZZ_ORACLE(ds->split[SPLIT_TRAIN].n >= min_samples && ds->split[SPLIT_TRAIN].n > 0,
                "accepted %lld training samples, fewer than %lld", (long long)ds->split[SPLIT_TRAIN].n,
                (long long)min_samples);
    FUZZ_ORACLE(ds->split[SPLIT_TEST].n >= 0, "accepted %lld test samples", (long long)ds->split[SPLIT_TEST].n);
    FUZZ_ORACLE(sp->num_classes >= 1, "accepted num_classes %lld", (long long)sp->num_classes);
    FUZZ_ORACLE(ds->sample_numel >= 1, "accepted sample_numel %lld", (long long)ds->sample_numel);
    int64_t prod = 1;
    for (int d = 0; d < sp->sample_ndim && d < 3; d++)
        prod *= sp->sample_shape[d];
    FUZZ_ORACLE(sp->is_tokens || prod == ds->sample_numel, "sample shape holds %lld values, sample_numel %lld",
                (long long)prod, (long long)ds->sample_numel);
    /* Gather every sample (batches of up to 64) and check labels and inputs. */
    const int64_t per = 64, numel = ds->sample_numel, labels_per = sp->is_tokens ? numel : 1;
    if (numel > (1 << 20))
        return;
    int64_t *idx = malloc(per * sizeof *idx);
    float *x = sp->is_tokens ? NULL : malloc((size_t)(per * numel) * sizeof *x);
    int32_t *tok = sp->is_tokens ? malloc((size_t)(per * numel) * sizeof *tok) : NULL;
    int32_t *lab = malloc((size_t)(per * labels_per) * sizeof *lab);
    FUZZ_REQUIRE(idx && lab && (x || tok), "out of memory");
    for (int s = 0; s < 2; s++) {
        for (int64_t i0 = 0; i0 < ds->split[s].n; i0 += per) {
            int64_t n = ds->split[s].n - i0 < per ? ds->split[s].n - i0 : per;
            for (int64_t i = 0; i < n; i++)
                idx[i] = i0 + i;
            data_gather(ds, (enum split)s, idx, n, x, tok, lab);
            for (int64_t i = 0; i < n * labels_per; i++)
                FUZZ_ORACLE(lab[i] >= 0 && lab[i] < sp->num_classes, "split %d: label %d at %lld, num_classes %lld", s,
                            (int)lab[i], (long long)(i0 + i / labels_per), (long long)sp->num_classes);
            for (int64_t i = 0; tok && i < n * numel; i++)
                FUZZ_ORACLE(tok[i] >= 0 && tok[i] < sp->num_classes, "split %d: token %d at %lld, vocabulary %lld", s,
                            (int)tok[i], (long long)(i0 + i / numel), (long long)sp->num_classes);
            for (int64_t i = 0; x && i < n * numel; i++)
                FUZZ_ORACLE(isfinite(x[i]), "split %d: input %g at sample %lld", s, (double)x[i],
                            (long long)(i0 + i / numel));
        }
    }
    free(idx);
    free(x);
    free(tok);
    free(lab);
}

/* Token files with random sampling: a batch of drawn windows (ids DATA_WINDOW_AT(offset)) gathers within the
 * file, with ids below the vocabulary. */
static void check_drawn_windows(const struct dataset *ds, const struct data_config *c)
{
    const int64_t per = 16, T = ds->sample_numel;
    if (T > (1 << 16))
        return;
    struct sampler s;
    struct amp_error err = {0};
    FUZZ_ORACLE(data_sampler_init(&s, ds, c, 7, &err) == AMP_OK, "data_sampler_init refused: %s", err.msg);
    int64_t idx[16];
    int32_t *tok = malloc((size_t)(per * T) * sizeof *tok), *lab = malloc((size_t)(per * T) * sizeof *lab);
    FUZZ_REQUIRE(tok && lab, "out of memory");
    int64_t n = ds->split[SPLIT_TRAIN].n < per ? ds->split[SPLIT_TRAIN].n : per;
    sampler_next(&s, n, idx);
    for (int64_t i = 0; i < n; i++)
        FUZZ_ORACLE(idx[i] < 0 && DATA_WINDOW_AT(idx[i]) + T < ds->split[SPLIT_TRAIN].ntokens,
                    "drew window id %lld of a file of %lld tokens", (long long)idx[i],
                    (long long)ds->split[SPLIT_TRAIN].ntokens);
    data_gather(ds, SPLIT_TRAIN, idx, n, NULL, tok, lab);
    for (int64_t i = 0; i < n * T; i++)
        FUZZ_ORACLE(tok[i] >= 0 && tok[i] < ds->spec.num_classes && lab[i] >= 0 && lab[i] < ds->spec.num_classes,
                    "drawn window: token %d, label %d, vocabulary %lld", (int)tok[i], (int)lab[i],
                    (long long)ds->spec.num_classes);
    free(tok);
    free(lab);
    sampler_free(&s);
}

/* ---- entry points ---------------------------------------------------------------------------------- */

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    fuzz_scratch("data");
    fuzz_set_trials(false); /* the HDF5 reader's trial process (lib/base/trial.h) off: fuzz the parse itself */
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
    /* No HDF5 free lists (see fuzz_ckpt.c): no input looks like a leak for blocks parked in a list. */
    H5set_free_list_limits(0, 0, 0, 0, 0, 0);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 5)
        return 0;
    enum mode mode = (enum mode)(data[0] % MODE_COUNT);
    struct data_config c;
    memset(&c, 0, sizeof c);
    c.batch_size = PICK(BATCH, data[1]);
    c.val_fraction = PICK(VAL_FRACTION, data[2]);
    c.mean = MEAN_STD[data[3] % 7][0];
    c.std = MEAN_STD[data[3] % 7][1];
    c.seq_len = PICK(SEQ_LEN, data[4]);
    c.shuffle = true;
    snprintf(c.x_key, sizeof c.x_key, "x");
    snprintf(c.y_key, sizeof c.y_key, "y");
    const uint8_t *payload = data + 5;
    size_t plen = size - 5;

    struct chunk ch[MAX_CHUNKS];
    static const char *const IDX_NAMES[4] = {"train-images", "train-labels", "test-images", "test-labels"};
    switch (mode) {
    case MODE_IDX:
    case MODE_IDX_GZ: {
        c.format = DATA_IDX;
        int n = split_chunks(payload, plen, ch, 4);
        for (int k = n; k < 4; k++)
            ch[k] = k >= 2 ? ch[k - 2] : (struct chunk){payload, 0};
        char *paths[4] = {c.train_images, c.train_labels, c.test_images, c.test_labels};
        for (int k = 0; k < 4; k++) {
            snprintf(paths[k], CFG_STR, "%s", fuzz_path(IDX_NAMES[k]));
            if (mode == MODE_IDX)
                fuzz_write(paths[k], ch[k].p, ch[k].n);
            else
                write_gz(paths[k], ch[k].p, ch[k].n);
        }
        break;
    }
    case MODE_HDF5_RAW:
        c.format = DATA_HDF5;
        snprintf(c.path, sizeof c.path, "%s", fuzz_path("data.h5"));
        fuzz_write(c.path, payload, plen);
        if (declares_huge_data(c.path))
            return 0;
        break;
    case MODE_HDF5:
        c.format = DATA_HDF5;
        snprintf(c.path, sizeof c.path, "%s", fuzz_path("data.h5"));
        build_hdf5(c.path, payload, plen);
        break;
    case MODE_TOKENS: {
        c.format = DATA_TOKENS;
        c.vocab = PICK(VOCAB, data[3]);
        c.sampling = (data[2] & 1) ? SAMPLING_SEQUENTIAL : SAMPLING_RANDOM;
        c.val_windows = PICK(VAL_WINDOWS, data[2] >> 1);
        int n = split_chunks(payload, plen, ch, 2);
        snprintf(c.train_bin, sizeof c.train_bin, "%s", fuzz_path("train.bin"));
        fuzz_write(c.train_bin, ch[0].p, ch[0].n);
        if (n > 1) {
            snprintf(c.val_bin, sizeof c.val_bin, "%s", fuzz_path("val.bin"));
            fuzz_write(c.val_bin, ch[1].p, ch[1].n);
        }
        break;
    }
    default: {
        c.format = DATA_TEXT;
        c.nfiles = split_chunks(payload, plen, ch, 3);
        for (int k = 0; k < c.nfiles; k++) {
            char name[16];
            snprintf(name, sizeof name, "text%d", k);
            snprintf(c.files[k], CFG_STR, "%s", fuzz_path(name));
            fuzz_write(c.files[k], ch[k].p, ch[k].n);
        }
        break;
    }
    }

    int64_t min_samples = c.batch_size;
    struct dataset ds;
    struct amp_error err = {0};
    enum amp_status st = data_load(&ds, &c, min_samples, &err);
    FUZZ_ORACLE(H5Fget_obj_count(H5F_OBJ_ALL, H5F_OBJ_ALL) == 0, "HDF5 identifiers left open after data_load");
    FUZZ_NOTE("data_load (%s): %s%s", MODE_NAMES[mode], st == AMP_OK ? "accepted" : "refused: ", err.msg);
    H5Eclear2(H5E_DEFAULT); /* HDF5's last error stack, freed within this input (see fuzz_ckpt.c) */
    if (st != AMP_OK) {
        check_refusal(st, &err, &ds);
        return 0;
    }
    check_dataset(&ds, min_samples);
    if (mode == MODE_TOKENS && c.sampling == SAMPLING_RANDOM)
        check_drawn_windows(&ds, &c);
    if (mode == MODE_IDX)
        for (int k = 0; k < 4; k++)
            if (ch[k].n >= 2 && ch[k].p[0] == 0x1f && ch[k].p[1] == 0x8b)
                FUZZ_ORACLE(gzip_complete(ch[k].p, ch[k].n),
                            "accepted %s, a gzip file whose stream is damaged or incomplete (trailer unchecked)",
                            IDX_NAMES[k]);
    data_free(&ds);
    return 0;
}
