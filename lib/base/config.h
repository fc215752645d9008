/*
 * config.h — the typed configuration of a run (docs/config.md) and its strict YAML reader.
 *
 * The whole schema lives here as plain structs; config.c holds one descriptor table per section
 * that maps YAML keys onto these fields with their type, range and default. That table drives
 * everything: parsing a file, applying `KEY=VALUE` overrides, filling defaults, and printing the
 * resolved config as YAML that parses back to the same struct. docs/config.md documents each key.
 *
 * Strings are fixed-size arrays so a `struct config` can be copied and compared with memcmp-free
 * field comparisons and needs no freeing except the layer list.
 */
#ifndef AMP_CONFIG_H
#define AMP_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "error.h"     /* struct amp_error, enum amp_status */
#include "precision.h" /* enum precision_mode, precision_mode_name */

#define CFG_STR 256      /* longest string value (paths included) */
#define CFG_MAX_FILES 16 /* most files in data.files */
#define CFG_MAX_OPS 32   /* most op kinds in one autocast override list */
#define CFG_MAX_LAYERS 4096 /* most entries in model.layers (a check of names is quadratic in it) */
/* Bounds of the counts that the training loop multiplies (docs/config.md): with them, steps x accum x
 * ranks and batch x accum x ranks fit in int64; config_global_batch checks the whole product once more. */
#define CFG_MAX_STEPS 1000000000000.0 /* run.steps: 1e12 */
#define CFG_MAX_THREADS 1024            /* run.threads */
#define CFG_MAX_EPOCHS 1000000.0      /* run.epochs */
#define CFG_MAX_ACCUM 65536.0         /* accum_steps */
#define CFG_MAX_SIZE 16777216.0       /* data.batch_size, data.seq_len, layer widths, vocab, max_len: 2^24 */
#define CFG_MAX_WINDOW 65536.0        /* kernel, stride, padding, heads, mlp_ratio */
#define CFG_MAX_DEPTH 32    /* most nested lists and mappings in a YAML config (a config needs 4) */

enum data_format { DATA_IDX, DATA_HDF5, DATA_TEXT, DATA_TOKENS };
enum data_sampling { SAMPLING_RANDOM, SAMPLING_SEQUENTIAL }; /* tokens: windows at random offsets | consecutive */
enum optim_kind { OPTIM_SGD, OPTIM_ADAMW };
enum sched_kind { SCHED_CONSTANT, SCHED_STEP, SCHED_COSINE, SCHED_LINEAR, SCHED_WSD, SCHED_INVERSE_SQRT };
enum fp8_recipe_kind { FP8_RECIPE_DELAYED, FP8_RECIPE_CURRENT, FP8_RECIPE_BLOCKWISE };
enum fp8_amax_compute { FP8_AMAX_MAX, FP8_AMAX_MOST_RECENT };
enum fp8_loss_scale { FP8_LS_NONE, FP8_LS_STATIC, FP8_LS_DYNAMIC };
/* How master weights or optimizer moments are stored (precision.master_weights, optim.state_dtype). */
enum store_dtype { STORE_FP32, STORE_BF16 };
/* run.recompute: what a transformer block recomputes in backward instead of keeping from its forward */
enum recompute { RECOMPUTE_NONE, RECOMPUTE_GELU, RECOMPUTE_ATTENTION, RECOMPUTE_BLOCK };
/* run.resume: what `run` does with a run.out_dir that already holds a run (docs/checkpoint.md, "Restarts") */
enum resume_policy { RESUME_NEVER, RESUME_AUTO };
enum on_nonfinite { NONFINITE_SKIP, NONFINITE_STOP };
enum init_scheme { INIT_PYTORCH, INIT_GPT2 };
/* How tensors are named outside ampTrain (export --names, model.init_names; lib/base/weight_names.h). */
enum weight_names { NAMES_AMPTRAIN, NAMES_PYTORCH, NAMES_HF_GPT2 };
enum gelu_approx { GELU_TANH, GELU_ERF };
enum dist_backend { DIST_AUTO, DIST_NONE, DIST_MPI, DIST_NCCL };
/* What run.keep_best and run.early_stop watch: an evaluation's figure (eval.jsonl). loss and perplexity are
 * better lower, accuracy higher (eval_metric_higher_is_better). */
enum eval_metric { METRIC_NONE, METRIC_LOSS, METRIC_ACCURACY, METRIC_PERPLEXITY };

enum layer_kind {
    LAYER_LINEAR,
    LAYER_CONV2D,
    LAYER_MAXPOOL2D,
    LAYER_AVGPOOL2D,
    LAYER_FLATTEN,
    LAYER_BATCHNORM2D,
    LAYER_LAYERNORM,
    LAYER_RELU,
    LAYER_GELU,
    LAYER_DROPOUT,
    LAYER_EMBEDDING,       /* token + learned position embedding */
    LAYER_ATTENTION,       /* causal multi-head self-attention (key: "attention") */
    LAYER_TRANSFORMER_BLOCK, /* pre-LN: LN, attention, residual, LN, MLP, residual */
    LAYER_CROSS_ENTROPY,   /* fused softmax + NLL in FP32 */
    LAYER_MSE,
    LAYER_KIND_COUNT
};

/* One entry of model.layers. Only the keys that belong to `kind` may be set in YAML (docs/config.md
 * lists them per kind); the others keep their defaults and are not printed. */
struct layer_config {
    enum layer_kind kind;
    char name[64];        /* given, or "kind_N" with N the 0-based position in the list */
    int64_t out;          /* linear: out_features; conv2d: out_channels */
    int64_t kernel;       /* conv2d, pools: square kernel size */
    int64_t stride;       /* conv2d (default 1), pools (default = kernel) */
    int64_t padding;      /* conv2d, pools (default 0) */
    bool bias;            /* linear, conv2d (default true) */
    double eps;           /* batchnorm2d, layernorm (default 1e-5) */
    double momentum;      /* batchnorm2d running-stat momentum (default 0.1, PyTorch's) */
    double p;             /* dropout probability, [0, 1) (default 0.1) */
    int64_t vocab;        /* embedding: vocabulary size (default 256, bytes) */
    int64_t dim;          /* embedding, attention, transformer_block: model width */
    int64_t max_len;      /* embedding: number of positions (default data.seq_len) */
    int64_t heads;        /* attention, transformer_block */
    int64_t mlp_ratio;    /* transformer_block: hidden = mlp_ratio * dim (default 4) */
    enum gelu_approx approximate; /* gelu, transformer_block: "tanh" (default, GPT-2's) or "none" (erf) */
    char tie[96];         /* linear: "LAYER/wte", an earlier embedding's table used as this layer's weight
                             (GPT-2's lm_head); "" (default): its own weight */
    unsigned explicit_keys; /* private to config.c: which keys with derived defaults (name, stride,
                               max_len) were written explicitly; not compared by config_equal */
};

/* run.early_stop: stop after `patience` evaluations in a row that do not improve `metric` by more than
 * `min_delta` (docs/config.md). metric none: off. */
struct early_stop_config {
    enum eval_metric metric; /* none (default) | loss | accuracy | perplexity */
    int64_t patience;        /* evaluations without improvement that stop the run; required (>= 1) with a metric */
    double min_delta;        /* an improvement is a change beyond this (default 0), >= 0 */
};

struct run_config {
    char name[64];        /* default "run" */
    char out_dir[CFG_STR];/* default "runs/<name>" */
    uint64_t seed;        /* default 1234 */
    char device[32];      /* "auto" (default) | "cpu" | "cuda" | "cuda:N" */
    char threads[16];     /* "auto" (default: the CPUs this process may run on) | "1" .. "1024": the CPU backend's
                           * threads (config_threads); results do not depend on it */
    int64_t steps;        /* optimizer steps; 0 = use epochs. Exactly one of steps/epochs is > 0 */
    int64_t epochs;       /* default 1 when steps is 0 */
    int64_t log_every;    /* default 50 */
    int64_t eval_every;   /* optimizer steps between evaluations; 0 = only at the end (default 0) */
    int64_t ckpt_every;   /* optimizer steps between checkpoints; 0 = only at the end (default 0) */
    int64_t keep_ckpts;   /* checkpoints kept (default 3, >= 1) */
    enum eval_metric keep_best; /* none (default) | loss | accuracy | perplexity: the best evaluation's checkpoint
                                 * is kept beside the newest keep_ckpts and named by DIR/best */
    struct early_stop_config early_stop;
    int64_t numerics_every; /* steps between numerics measurements (lib/engine/numerics.h); 0 = off (default) */
    int64_t sample_every; /* steps between text samples (lib/engine/sample.h) into samples.jsonl; 0 = off (default) */
    char sample_prompt[CFG_STR]; /* their prompt; default "" (a newline) */
    enum recompute recompute; /* none (default) | gelu | attention | block: activations recomputed in backward
                               * (models/attention.c); the results are the same bits */
    bool tensorboard;     /* rank 0 writes a TensorBoard event file into out_dir (default true; lib/engine/tboard.h) */
    enum resume_policy resume; /* never (default: such a directory is refused) | auto: continue from its newest
                                * verified checkpoint when the config is the same */
};

struct data_config {
    enum data_format format;
    /* idx: four IDX files, gzip or not */
    char train_images[CFG_STR], train_labels[CFG_STR], test_images[CFG_STR], test_labels[CFG_STR];
    /* hdf5: one file with datasets x_key (N, ...) float and y_key (N) integer labels */
    char path[CFG_STR];
    char x_key[64];       /* default "x" */
    char y_key[64];       /* default "y" */
    /* text: byte-level tokens from these files, concatenated */
    char files[CFG_MAX_FILES][CFG_STR];
    int nfiles;
    /* tokens: nanoGPT's raw uint16 or llm.c's headered token files (docs/data.md), memory-mapped */
    char train_bin[CFG_STR], val_bin[CFG_STR]; /* val_bin "" = no test split */
    int64_t vocab;        /* tokens: ids must be < vocab (required for tokens; 0 = not set) */
    char tokenizer[CFG_STR]; /* tokens: the byte-level BPE that made the ids (lib/base/tokenizer.h: a tokenizer.json, a
                              * vocab.json with merges.txt, or their directory); "" = none (default) */
    enum data_sampling sampling; /* tokens: random (default, nanoGPT) | sequential (llm.c) */
    int64_t val_windows;  /* tokens: evaluate on the first N windows of val_bin; 0 (default) = all */
    int64_t seq_len;      /* text, tokens: tokens per sample (default 64) */
    double val_fraction;  /* hdf5, text: held-out fraction, [0, 1) (default 0.1) */
    int64_t batch_size;   /* samples per micro-batch (default 64) */
    bool shuffle;         /* default true */
    double mean, std;     /* input normalisation x' = (x/255 - mean)/std for idx; (x - mean)/std for hdf5. default 0, 1 */
};

struct model_config {
    enum init_scheme init;       /* "pytorch" (default) | "gpt2" */
    char init_from[CFG_STR];     /* a .safetensors file or a checkpoint to start from; "" (default): none */
    enum weight_names init_names; /* how init_from names its tensors: ampTrain (default) | pytorch | hf-gpt2 */
    bool init_strict;            /* missing, unexpected or mis-shaped tensors are an error (default true) */
    struct layer_config *layers; /* owned; freed by config_free */
    int nlayers;
};

struct schedule_config {
    enum sched_kind kind;   /* default constant */
    int64_t warmup_steps;   /* linear warmup from 0 (default 0) */
    int64_t step_size;      /* step: decay every step_size steps (default 1000) */
    double gamma;           /* step: factor (default 0.1) */
    double min_lr;          /* cosine, linear, wsd: floor (default 0) */
    int64_t decay_steps;    /* cosine, linear, wsd: the step the decay ends at (0: run.steps, the default) */
    double decay_fraction;  /* wsd: the share of the steps after warmup spent decaying (default 0.2) */
};

struct optim_config {
    enum optim_kind kind;   /* default adamw */
    double lr;              /* default 1e-3, > 0 */
    double betas[2];        /* default [0.9, 0.999], each in [0, 1) */
    double eps;             /* default 1e-8 */
    double weight_decay;    /* default 0.01 for adamw, 0 for sgd */
    double momentum;        /* sgd (default 0) */
    bool nesterov;          /* sgd (default false; needs momentum > 0) */
    enum store_dtype state_dtype; /* the moments (adamw m, v; sgd's momentum buffer): fp32 (default) | bf16 */
    bool stochastic_rounding;     /* bf16 stores of weights and moments round stochastically (default false;
                                   * needs a bf16 master or bf16 state) */
    struct schedule_config schedule;
};

struct loss_scale_config {
    double init;            /* 65536 */
    double growth_factor;   /* 2, > 1 */
    double backoff_factor;  /* 0.5, in (0, 1) */
    int64_t growth_interval;/* 2000, >= 1 */
    int64_t hysteresis;     /* 1, >= 1 */
    double min;             /* 1 */
    double max;             /* 16777216 */
    double value;           /* fp16-static scale (default 65536), > 0 */
};

struct autocast_config {
    /* op-kind names ("linear", "gelu", ...) moved to each class, overriding the built-in table */
    char lowp_ops[CFG_MAX_OPS][32];    int nlowp;
    char fp32_ops[CFG_MAX_OPS][32];    int nfp32;
    char promote_ops[CFG_MAX_OPS][32]; int npromote;
};

#define CFG_MAX_KEEP 32       /* most names in precision.fp8.keep_bf16 */
#define CFG_MAX_AMAX_HISTORY 65536 /* precision.fp8.amax_history_len */

/* precision.mode fp8 (docs/precision.md "fp8"; lib/base/fp8.h). */
struct fp8_config {
    enum fp8_recipe_kind recipe;       /* delayed (default) | current | blockwise */
    int64_t amax_history_len;          /* delayed: steps of amax kept (default 1024), 1..CFG_MAX_AMAX_HISTORY */
    enum fp8_amax_compute amax_compute;/* delayed: max (default) | most_recent */
    int64_t margin;                    /* scale = (fmax / amax) / 2^margin (default 0), 0..64 */
    enum fp8_loss_scale loss_scale;    /* none (default) | static (precision.loss_scale.value) | dynamic
                                        * (precision.loss_scale.init and the rest, as fp16-dynamic) */
    char keep_bf16[CFG_MAX_KEEP][64];  /* layers whose products stay bf16: names, or `first` / `last` (the first
                                        * and last layers that hold parameters); default [first, last] */
    int nkeep_bf16;
    double min_size[2];                /* [K, N]: a product of weight (N out, K in) runs in fp8 when K > min_size[0]
                                        * or N > min_size[1], else it stays bf16; whole numbers >= 0, default
                                        * torchao's tensorwise rule [4096, 1024]; [0, 0]: every product */
};

struct precision_config {
    enum precision_mode mode; /* default fp32 */
    struct fp8_config fp8;
    struct loss_scale_config loss_scale;
    struct autocast_config autocast;
    bool tf32;                /* default false */
    enum store_dtype master_weights; /* fp32 (default) | bf16 (needs mode bf16: the weights are then their own
                                      * bf16 copy) */
};

struct clip_config {
    double max_norm;        /* 0 = no clipping (default) */
    double norm_type;       /* 2 (default) or INFINITY (YAML: inf) */
};

struct stability_config {
    enum on_nonfinite on_nonfinite; /* bf16 and fp32: skip (default) | stop */
    int64_t max_consecutive_skips;  /* default 100; 0 = never stop */
};

/* Data parallel (docs/distributed.md). */
struct dist_config {
    enum dist_backend backend; /* auto (default: nccl on CUDA where built, else mpi) | none | mpi | nccl */
    int64_t check_every;       /* steps between replica checksum comparisons; 0 (default): every log flush */
    double timeout_s;          /* the longest a rank waits for the others in one collective before it ends the
                                * job (lib/base/comm_watch.h); 0: no limit */
    double bucket_mb;          /* MiB of fp32 gradients a bucket reduced while backward runs (lib/engine/dist_overlap.h;
                                * default 25, PyTorch DDP's); 0: one reduce of every gradient after backward */
    int64_t zero;              /* 1: ZeRO stage 1, each rank holds and updates its shard of every parameter's
                                * optimizer moments (lib/engine/zero.h); 0 (default): every rank holds all of them */
};

struct config {
    char source[CFG_STR];   /* the file it was read from ("<string>" for config_parse_string) */
    struct run_config run;
    struct data_config data;
    struct model_config model;
    struct optim_config optim;
    struct precision_config precision;
    int64_t accum_steps;    /* default 1, >= 1 */
    struct clip_config clip;
    struct stability_config stability;
    struct dist_config dist;
    unsigned explicit_keys; /* private to config.c: which keys with derived defaults (run.out_dir,
                               run.epochs, optim.weight_decay) were written explicitly, so that
                               config_finalize re-derives only the others; not compared by config_equal */
};

/* Fill `cfg` with every default (and no layers). Like config_load, config_parse_string and config_copy, it
 * overwrites *cfg without freeing it: call config_free first on a config that holds layers. */
void config_defaults(struct config *cfg);

/* Read and check a YAML file. On failure returns AMP_ERR_CONFIG with err->msg "FILE:LINE:COL: ..." and
 * a hint; `cfg` is then left freed (config_free need not be called, but may be). */
enum amp_status config_load(struct config *cfg, const char *path, struct amp_error *err);

/* The same from a string in memory; `name` stands for the file in messages. */
enum amp_status config_parse_string(struct config *cfg, const char *yaml, size_t len, const char *name,
                                    struct amp_error *err);

/* Apply one "dotted.key=VALUE" override (VALUE is YAML: 3e-4, bf16, [a, b], true). Layer keys are
 * addressed as model.layers.N.key. Errors name the override. */
enum amp_status config_apply_override(struct config *cfg, const char *override, struct amp_error *err);

/* Checks that span several keys (steps vs epochs, nesterov needs momentum, data files per format, ...),
 * and fills derived defaults (out_dir from name, layer names). Called by config_load after parsing and
 * again after overrides. */
enum amp_status config_finalize(struct config *cfg, struct amp_error *err);

/* Make the data paths (data.train_images .. data.val_bin, data.files, data.tokenizer) absolute against the current directory, which
 * is what a relative one names: what `run` and `resume` do once, when the run starts, so that the config they record
 * (config.yaml, every checkpoint's /config) names the same files from any directory. model.init_from is left as
 * given: it is read once, at the start, and its messages name it as the user wrote it. AMP_ERR_CONFIG naming the key
 * when a result exceeds CFG_STR - 1 bytes. */
enum amp_status config_resolve_paths(struct config *cfg, struct amp_error *err);

/* Settings that are valid but do nothing in this config (loss-scale keys in bf16, the dynamic keys in
 * fp16-static, ...): one "ampTrain: warning: ..." line each to `out`. Returns how many. */
int config_print_warnings(const struct config *cfg, FILE *out);

/* Whether precision.fp8.min_size was written (in the file or an override), not left at its default: a checkpoint's
 * config without it was written before the key, when every product of an fp8 layer ran in fp8 (lib/engine/checkpoint.c
 * then reads it as [0, 0]). */
bool config_fp8_min_size_written(const struct config *cfg);

/* run.threads as a number: 0 for auto (the caller resolves it: threadpool_available_cpus), else 1 .. 1024. */
int config_threads(const struct run_config *run);

/* Print the resolved config as YAML that config_parse_string reads back to an equal config. */
void config_print_yaml(const struct config *cfg, FILE *out);

/* Same into a malloc'd string (for embedding in checkpoints); NULL on out of memory. */
char *config_to_yaml_string(const struct config *cfg);

/* Field-by-field equality (layers included, each with its kind's keys only); `source` is not compared. */
bool config_equal(const struct config *a, const struct config *b);

/* Each key where a and b differ, in table order (layers' keys as model.layers.N.KEY, a different number of layers
 * as model.layers): fn gets the dotted key and both values as YAML text that config_apply_override reads back;
 * the walk stops where fn returns false. Returns the number of differences seen; -1 on out of memory. */
typedef bool (*config_diff_fn)(const char *key, const char *value_a, const char *value_b, void *user);
int config_diff(const struct config *a, const struct config *b, config_diff_fn fn, void *user);

/* Deep copy (layers). */
enum amp_status config_copy(struct config *dst, const struct config *src, struct amp_error *err);

void config_free(struct config *cfg);

/* Names for printing and parsing. */
const char *layer_kind_name(enum layer_kind k);
/* "ampTrain", "pytorch", "hf-gpt2" (NULL-terminated, indexed by enum weight_names). */
extern const char *const weight_names_names[];
/* The samples of one optimizer step, the global batch: `batch` per rank per micro-batch (data.batch_size) x `accum`
 * micro-batches (accum_steps) x `world` ranks. -1 where the product passes 2^62: the trainer refuses such a run at
 * setup, so that the counts built on it (steps x samples per step) fit in int64. */
int64_t config_global_batch(int64_t batch, int64_t accum, int64_t world);

const char *data_format_name(enum data_format f);
const char *dist_backend_name(enum dist_backend b);
const char *eval_metric_name(enum eval_metric m);
bool eval_metric_higher_is_better(enum eval_metric m); /* accuracy; loss and perplexity are better lower */

#endif
