/*
 * fuzz_safetensors.c — libFuzzer harness for the safetensors reader (lib/base/safetensors.h: safetensors_parse), the
 * reader `model.init_from` will use on files users bring.
 *
 * Input: the bytes of a .safetensors file, as they are (the seeds in tests/fuzz/corpus/safetensors are small
 * exports and hand-written headers; tests/fuzz/safetensors.dict holds the format's tokens).
 *
 * Every accepted file is then given to model.init_from (lib/engine/init_from.h) of a tiny GPT-2 (lm_head tied), with the
 * names (ampTrain, pytorch, hf-gpt2) and strictness drawn from the input's length: init_from_load must accept it
 * or refuse it with AMP_ERR_CKPT naming the file (AMP_ERR_INTERNAL for memory), and after an accepted load every
 * weight is finite. The seed hf_gpt2_tiny is that model's own hf-gpt2 export, so the fuzzer starts from a match.
 *
 * Oracles (safetensors.h's contract): a refusal is AMP_ERR_CKPT with a message naming the file and a hint
 * (AMP_ERR_INTERNAL for memory) and leaves the file struct empty; an accepted file has F32/F16/BF16 tensors whose
 * byte counts are their shapes' products times the dtype size, whose data lie inside the data section and tile it
 * exactly; and it survives a round trip: safetensors_write of what was read, read back, gives the same names,
 * dtypes, shapes, bytes and metadata.
 */
#define _GNU_SOURCE /* nftw, mkdtemp in fuzz_common.h */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"
#include "autocast.h"    /* autocast_default */
#include "backend.h"     /* backend_cpu_create */
#include "config.h"      /* config_parse_string: the tiny GPT-2 */
#include "init_from.h"   /* init_from_load */
#include "model.h"       /* model_build, model_init */
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

/* The model init_from loads into: embedding (vocab 16, dim 8, 4 positions), one block of 2 heads, ln_f, a tied
 * head. Built once; each accepted input is loaded into it. */
static const char tiny_gpt2[] =
    "data: {format: tokens, train_bin: unused.bin, vocab: 16, seq_len: 4}\n"
    "model:\n"
    "  layers:\n"
    "    - {kind: embedding, name: wte, vocab: 16, dim: 8, max_len: 4}\n"
    "    - {kind: transformer_block, name: h0, heads: 2}\n"
    "    - {kind: layernorm, name: ln_f}\n"
    "    - {kind: linear, name: lm_head, out: 16, bias: false, tie: wte/wte}\n"
    "    - {kind: cross_entropy}\n";
static struct config tiny_cfg;
static struct model tiny;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    fuzz_scratch("safetensors");
    struct amp_error err = {0};
    FUZZ_REQUIRE(config_parse_string(&tiny_cfg, tiny_gpt2, sizeof tiny_gpt2 - 1, "tiny_gpt2", &err) == AMP_OK, "%s",
                 err.msg);
    struct backend *be = backend_cpu_create();
    struct autocast_policy pol;
    autocast_default(&pol, DT_FP32);
    struct data_spec spec = {.sample_ndim = 1, .sample_shape = {4}, .is_tokens = true, .num_classes = 16};
    FUZZ_REQUIRE(model_build(&tiny, &tiny_cfg, &spec, be, &pol, 1, &err) == AMP_OK, "%s", err.msg);
    FUZZ_REQUIRE(model_init(&tiny, &tiny_cfg, 1, &err) == AMP_OK, "%s", err.msg);
    return 0;
}

static void check_init_from(const uint8_t *data, size_t size)
{
    const char *path = fuzz_path(FILE_NAME);
    fuzz_write(path, data, size);
    snprintf(tiny_cfg.model.init_from, sizeof tiny_cfg.model.init_from, "%s", path);
    tiny_cfg.model.init_names = (enum weight_names)(size % 3);
    tiny_cfg.model.init_strict = (size / 3) % 2 == 0;
    struct amp_error err = {0};
    enum amp_status st = init_from_load(&tiny, &tiny_cfg.model, NULL, &err);
    FUZZ_NOTE("init_from (%s names, %s): %s", weight_names_names[tiny_cfg.model.init_names],
              tiny_cfg.model.init_strict ? "strict" : "not strict", st == AMP_OK ? "loaded" : err.msg);
    if (st != AMP_OK) {
        FUZZ_ORACLE(st == AMP_ERR_CKPT || st == AMP_ERR_INTERNAL, "init_from status %d: %s", (int)st, err.msg);
        FUZZ_ORACLE(strstr(err.msg, FILE_NAME) != NULL || st == AMP_ERR_INTERNAL, "unnamed file: %s", err.msg);
        return;
    }
    for (int i = 0; i < tiny.nparams; i++) {
        const struct tensor *t = &tiny.params[i]->master;
        const float *v = t->data; /* CPU backend: host memory */
        for (size_t k = 0; k < t->numel; k++)
            FUZZ_ORACLE(isfinite(v[k]), "%s[%zu] = %g after an accepted init_from", tiny.params[i]->name, k,
                        (double)v[k]);
    }
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
    check_init_from(data, size);
    return 0;
}
