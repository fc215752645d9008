/*
 * fuzz_safetensors.c — libFuzzer harness for the safetensors reader (lib/safetensors.h: safetensors_parse), the
 * reader `model.init_from` will use on files users bring.
 *
 * Input: the bytes of a .safetensors file, as they are (the seeds in tests/fuzz/corpus/safetensors are small
 * exports and hand-written headers; tests/fuzz/safetensors.dict holds the format's tokens).
 *
 * Oracles (safetensors.h's contract): a refusal is AMP_ERR_CKPT with a message naming the file and a hint
 * (AMP_ERR_INTERNAL for memory) and leaves the file struct empty; an accepted file has F32/F16/BF16 tensors whose
 * byte counts are their shapes' products times the dtype size, whose data lie inside the data section and tile it
 * exactly; and it survives a round trip: safetensors_write of what was read, read back, gives the same names,
 * dtypes, shapes, bytes and metadata.
 */
#define _GNU_SOURCE /* nftw, mkdtemp in fuzz_common.h */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"
#include "safetensors.h" /* safetensors_parse, safetensors_write, safetensors_read */

#define FILE_NAME "fuzz.safetensors"

static void check_accepted(const struct safetensors_file *f)
{
    size_t total = 0;
    for (int i = 0; i < f->ntensors; i++) {
        const struct safetensor *t = &f->tensors[i];
        FUZZ_ORACLE(t->dtype == DT_FP32 || t->dtype == DT_FP16 || t->dtype == DT_BF16, "tensor %d dtype %d", i,
                    (int)t->dtype);
        FUZZ_ORACLE(t->ndim >= 0 && t->ndim <= SAFETENSORS_MAX_DIMS, "tensor '%s' ndim %d", t->name, t->ndim);
        uint64_t numel = 1;
        for (int k = 0; k < t->ndim; k++)
            numel *= (uint64_t)t->shape[k];
        FUZZ_ORACLE(numel * dtype_size(t->dtype) == t->nbytes, "tensor '%s': %zu bytes", t->name, t->nbytes);
        const unsigned char *d = t->data;
        FUZZ_ORACLE(d >= f->bytes + f->data_start && d + t->nbytes <= f->bytes + f->size, "tensor '%s' outside",
                    t->name);
        total += t->nbytes;
    }
    FUZZ_ORACLE(total == f->size - f->data_start, "tensors cover %zu of %zu data bytes", total, f->size - f->data_start);
}

static void check_round_trip(const struct safetensors_file *f)
{
    struct safetensors_meta *meta = calloc((size_t)f->nmeta + 1, sizeof *meta);
    FUZZ_REQUIRE(meta != NULL, "calloc");
    for (int i = 0; i < f->nmeta; i++)
        meta[i] = (struct safetensors_meta){f->meta_keys[i], f->meta_values[i]};
    const char *path = fuzz_path("round.safetensors");
    struct amp_error err = {0};
    enum amp_status st = safetensors_write(path, f->tensors, f->ntensors, meta, f->nmeta, &err);
    free(meta);
    FUZZ_REQUIRE(st == AMP_OK, "safetensors_write: %s", err.msg);
    struct safetensors_file g;
    st = safetensors_read(path, &g, &err);
    FUZZ_ORACLE(st == AMP_OK, "what we wrote does not read back: %s", err.msg);
    if (st != AMP_OK)
        return;
    FUZZ_ORACLE(g.ntensors == f->ntensors && g.nmeta == f->nmeta, "%d/%d tensors, %d/%d metadata", g.ntensors,
                f->ntensors, g.nmeta, f->nmeta);
    FUZZ_ORACLE(g.data_start % 8 == 0, "the data starts at %zu", g.data_start);
    for (int i = 0; i < f->ntensors && i < g.ntensors; i++) {
        const struct safetensor *a = &f->tensors[i], *b = &g.tensors[i];
        FUZZ_ORACLE(!strcmp(a->name, b->name) && a->dtype == b->dtype && a->ndim == b->ndim && a->nbytes == b->nbytes &&
                        !memcmp(a->shape, b->shape, sizeof a->shape) && !memcmp(a->data, b->data, a->nbytes),
                    "tensor %d ('%s') changed in the round trip", i, a->name);
    }
    for (int i = 0; i < f->nmeta && i < g.nmeta; i++)
        FUZZ_ORACLE(!strcmp(f->meta_keys[i], g.meta_keys[i]) && !strcmp(f->meta_values[i], g.meta_values[i]),
                    "metadata %d changed", i);
    safetensors_free(&g);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    fuzz_scratch("safetensors");
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct safetensors_file f;
    struct amp_error err = {0};
    enum amp_status st = safetensors_parse(data, size, FILE_NAME, &f, &err);
    if (st != AMP_OK) {
        FUZZ_NOTE("refused: %s", err.msg);
        FUZZ_ORACLE(st == AMP_ERR_CKPT || st == AMP_ERR_INTERNAL, "status %d: %s", (int)st, err.msg);
        FUZZ_ORACLE(strstr(err.msg, FILE_NAME) != NULL || st == AMP_ERR_INTERNAL, "unnamed file: %s", err.msg);
        FUZZ_ORACLE(st != AMP_ERR_CKPT || err.hint[0], "no hint: %s", err.msg);
        FUZZ_ORACLE(f.ntensors == 0 && f.bytes == NULL && f.nmeta == 0, "a refused file left state");
        return 0;
    }
    FUZZ_NOTE("accepted: %d tensors", f.ntensors);
    check_accepted(&f);
    check_round_trip(&f);
    safetensors_free(&f);
    return 0;
}
