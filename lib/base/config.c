/*
 * config.c — the strict YAML reader, override applier, checker and printer of `struct config`.
 *
 * One descriptor table per YAML mapping (`struct section`, one `struct field` per key: type, offset
 * into the section's struct, range, default, enum names) drives everything:
 *   - parsing walks a libyaml document (document API, so every node keeps its line:column) against
 *     the tables: apply_section -> apply_field;
 *   - an override KEY=VALUE parses VALUE as a one-node YAML document, resolves KEY through the same
 *     tables and calls the same apply_field, so it gets the same type and range checks;
 *   - defaults, printing (config_print_yaml) and equality walk the same tables.
 * model.layers uses one more table whose rows carry a bit mask of the layer kinds they belong to.
 *
 * Rules spanning several keys and derived defaults (out_dir from run.name, epochs when steps is 0,
 * weight_decay per optimizer, layer names kind_N, pool stride = kernel, embedding max_len =
 * data.seq_len) live in finalize(). A derived default is derived only while its key has not been
 * written: `explicit_keys` records which were, so finalize can run again after overrides.
 *
 * Errors: AMP_ERR_CONFIG with msg "FILE:LINE:COL: ..." (1-based, libyaml's marks) or
 * "override 'KEY=VALUE': ...", and a hint naming what the key takes. Checks in finalize locate
 * their key in the document when there is one. No global mutable state: a `struct ctx` carries
 * the source name, the document and the error through the recursion.
 */
#define _POSIX_C_SOURCE 200809L /* stat */
#include "config.h"

#include "weight_names.h" /* weight_names_check: model.init_names against the layers */

#include <errno.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h> /* stat: a config is a regular file */
#include <unistd.h>   /* getcwd: config_resolve_paths */

#include <yaml.h>

#include "comm.h"  /* COMM_TIMEOUT_DEFAULT_S: dist.timeout_s's default */
#include "dtype.h" /* double_to_text */
#include "threadpool.h" /* threadpool_available_cpus: run.threads beyond the CPUs warns */

#define ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))
#define MAX_CONFIG_BYTES ((size_t)16 << 20) /* a config larger than this is surely not a config */
#define MAX_EXACT_INT 9007199254740992.0    /* 2^53: integers written as 1e3 must be exact doubles */

/* ---- names ------------------------------------------------------------------------------------ */

static const char *const layer_kind_names[] = {
    "linear",      "conv2d", "maxpool2d", "avgpool2d", "flatten",   "batchnorm2d",       "layernorm",     "relu",
    "gelu",        "dropout", "embedding", "attention", "transformer_block", "cross_entropy", "mse", NULL};
static const char *const data_format_names[] = {"idx", "hdf5", "text", "tokens", NULL};
static const char *const data_sampling_names[] = {"random", "sequential", NULL};
static const char *const optim_kind_names[] = {"sgd", "adamw", NULL};
static const char *const sched_kind_names[] = {"constant", "step", "cosine", "linear", "wsd", "inverse_sqrt", NULL};
static const char *const fp8_recipe_names[] = {"delayed", "current", "blockwise", NULL};
static const char *const fp8_amax_compute_names[] = {"max", "most_recent", NULL};
static const char *const fp8_loss_scale_names[] = {"none", "static", "dynamic", NULL};
static const char *const store_dtype_names[] = {"fp32", "bf16", NULL};
static const char *const on_nonfinite_names[] = {"skip", "stop", NULL};
static const char *const init_scheme_names[] = {"pytorch", "gpt2", NULL};
const char *const weight_names_names[] = {"ampTrain", "pytorch", "hf-gpt2", NULL};
static const char *const gelu_approx_names[] = {"tanh", "none", NULL};
static const char *const dist_backend_names[] = {"auto", "none", "mpi", "nccl", NULL};
static const char *const eval_metric_names[] = {"none", "loss", "accuracy", "perplexity", NULL};
static const char *const recompute_names[] = {"none", "gelu", "attention", "block", NULL};
static const char *const resume_policy_names[] = {"never", "auto", NULL};
/* Op kinds that precision.autocast lists may name (the autocast policy table's rows). */
static const char *const op_kind_names[] = {
    "linear",      "conv2d", "attention_matmul", "softmax",   "log_softmax", "layernorm",    "batchnorm2d", "cross_entropy",
    "mse",         "gelu",   "relu",             "dropout",   "maxpool2d",   "avgpool2d",    "residual_add", "embedding",
    NULL};

_Static_assert(ARRAY_LEN(layer_kind_names) == LAYER_KIND_COUNT + 1, "one name per layer kind");
_Static_assert(ARRAY_LEN(data_format_names) == DATA_TOKENS + 2, "one name per data format");
_Static_assert(ARRAY_LEN(data_sampling_names) == SAMPLING_SEQUENTIAL + 2, "one name per sampling");
/* Enum fields are read and written as int through the tables. */
_Static_assert(sizeof(enum layer_kind) == sizeof(int) && sizeof(enum data_format) == sizeof(int) &&
                   sizeof(enum optim_kind) == sizeof(int) && sizeof(enum sched_kind) == sizeof(int) &&
                   sizeof(enum precision_mode) == sizeof(int) && sizeof(enum on_nonfinite) == sizeof(int) &&
                   sizeof(enum init_scheme) == sizeof(int) && sizeof(enum gelu_approx) == sizeof(int) &&
                   sizeof(enum dist_backend) == sizeof(int) && sizeof(enum data_sampling) == sizeof(int) &&
                   sizeof(enum weight_names) == sizeof(int) && sizeof(enum eval_metric) == sizeof(int) &&
                   sizeof(enum resume_policy) == sizeof(int),
               "enums are int-sized");

static const char *name_or(const char *const *names, size_t count, int i)
{
    return i >= 0 && (size_t)i < count - 1 ? names[i] : "?";
}
const char *layer_kind_name(enum layer_kind k) { return name_or(layer_kind_names, ARRAY_LEN(layer_kind_names), (int)k); }
const char *data_format_name(enum data_format f) { return name_or(data_format_names, ARRAY_LEN(data_format_names), (int)f); }
const char *dist_backend_name(enum dist_backend b) { return name_or(dist_backend_names, ARRAY_LEN(dist_backend_names), (int)b); }
const char *eval_metric_name(enum eval_metric m) { return name_or(eval_metric_names, ARRAY_LEN(eval_metric_names), (int)m); }
bool eval_metric_higher_is_better(enum eval_metric m) { return m == METRIC_ACCURACY; }

int64_t config_global_batch(int64_t batch, int64_t accum, int64_t world)
{
    int64_t per_rank = 0, global = 0;
    if (batch < 0 || accum < 0 || world < 0 || __builtin_mul_overflow(batch, accum, &per_rank) ||
        __builtin_mul_overflow(per_rank, world, &global) || global > INT64_C(1) << 62)
        return -1;
    return global;
}

/* ---- descriptor tables ------------------------------------------------------------------------ */

enum ftype {
    FT_SECTION, /* a nested mapping described by .sub */
    FT_LAYERS,  /* struct layer_config * at .off, int count at .count_off */
    FT_INT,     /* int64_t */
    FT_U64,     /* uint64_t */
    FT_DOUBLE,  /* double */
    FT_BOOL,    /* bool: only true / false */
    FT_STRING,  /* char[.size] */
    FT_ENUM,    /* int-sized enum; value i is .names[i] */
    FT_PAIR,    /* double[2] */
    FT_STRLIST, /* char[.max_count][.size], int count at .count_off; items from .names when set */
};

enum {
    F_MIN = 1u << 0,      /* value >= lo (> lo with F_MIN_OPEN) */
    F_MIN_OPEN = 1u << 1,
    F_MAX = 1u << 2,      /* value <= hi (< hi with F_MAX_OPEN) */
    F_MAX_OPEN = 1u << 3,
    F_INF_OK = 1u << 4,   /* a double that may be inf (.inf) */
    F_NONEMPTY = 1u << 5, /* a string that may not be "" */
};

/* Bits of config.explicit_keys and layer_config.explicit_keys (keys with derived defaults). */
enum {
    X_OUT_DIR = 1u << 0,
    X_EPOCHS = 1u << 1,
    X_WEIGHT_DECAY = 1u << 2,
    X_STEPS_OVERRIDDEN = 1u << 3, /* run.steps / run.epochs were set by an override (see config_apply_override) */
    X_EPOCHS_OVERRIDDEN = 1u << 4,
    X_FP8_MIN_SIZE = 1u << 5,     /* precision.fp8.min_size written (config_fp8_min_size_written) */
};
enum { XL_NAME = 1u << 0, XL_STRIDE = 1u << 1, XL_MAX_LEN = 1u << 2 };

struct section;

struct field {
    const char *key;
    enum ftype type;
    size_t off;                /* offset in the section's struct */
    size_t size;               /* FT_STRING: capacity; FT_STRLIST: capacity of one item */
    size_t count_off;          /* FT_STRLIST, FT_LAYERS: offset of the int count */
    int max_count;             /* FT_STRLIST */
    unsigned flags;            /* F_* */
    double lo, hi;             /* range, as the flags say */
    double def, def2;          /* default of numbers, bools, enums (index); def2: second of a pair */
    const char *def_str;       /* default of strings */
    const char *def_text;      /* how to describe a derived default in hints and docs */
    const char *what;          /* what the key takes, where the type alone does not say it */
    const char *const *names;  /* FT_ENUM: the values; FT_STRLIST: the allowed items (NULL: any) */
    const struct section *sub; /* FT_SECTION */
    unsigned kinds;            /* layer keys: bit (1 << kind) for each kind that has the key */
    unsigned formats;          /* data keys: bit (1 << format) for each data.format that reads the key (0: all);
                                * set to another value than its default under another format: a warning */
    unsigned required;         /* layer keys: kinds for which the key must be set (> 0) */
    unsigned explicit_bit;     /* recorded in explicit_keys when written */
    const char *(*check_str)(const char *s); /* NULL, or why the string is not acceptable */
    const char *(*check_num)(double v);      /* NULL, or why the number is not acceptable */
};

struct section {
    const char *path; /* dotted path of the mapping; "" for the top level */
    const struct field *fields;
    size_t nfields;
};

#define FIELD(S, m, t) .key = #m, .type = (t), .off = offsetof(S, m)
#define INT_(S, m, d, ...) {FIELD(S, m, FT_INT), .def = (d), __VA_ARGS__}
#define U64_(S, m, d, ...) {FIELD(S, m, FT_U64), .def = (d), __VA_ARGS__}
#define DBL_(S, m, d, ...) {FIELD(S, m, FT_DOUBLE), .def = (d), __VA_ARGS__}
#define BOOL_(S, m, d, ...) {FIELD(S, m, FT_BOOL), .def = (d), __VA_ARGS__}
#define STR_(S, m, d, ...) {FIELD(S, m, FT_STRING), .size = sizeof(((S *)0)->m), .def_str = (d), __VA_ARGS__}
#define ENUM_(S, m, nm, d, ...) {FIELD(S, m, FT_ENUM), .names = (nm), .def = (d), __VA_ARGS__}
#define PAIR_(S, m, d0, d1, ...) {FIELD(S, m, FT_PAIR), .def = (d0), .def2 = (d1), __VA_ARGS__}
#define LIST_(S, m, n, nm, ...)                                                                                        \
    {FIELD(S, m, FT_STRLIST), .size = sizeof(((S *)0)->m[0]), .count_off = offsetof(S, n),                          \
     .max_count = (int)(sizeof(((S *)0)->m) / sizeof(((S *)0)->m[0])), .names = (nm), __VA_ARGS__}
#define SECT_(S, m, sec) {FIELD(S, m, FT_SECTION), .sub = &(sec)}

#define GE(x) .flags = F_MIN, .lo = (x)
#define GT(x) .flags = F_MIN | F_MIN_OPEN, .lo = (x)
#define IN_CO(a, b) .flags = F_MIN | F_MAX | F_MAX_OPEN, .lo = (a), .hi = (b)
#define IN_OO(a, b) .flags = F_MIN | F_MIN_OPEN | F_MAX | F_MAX_OPEN, .lo = (a), .hi = (b)
#define IN_OC(a, b) .flags = F_MIN | F_MIN_OPEN | F_MAX, .lo = (a), .hi = (b)
#define IN_CC(a, b) .flags = F_MIN | F_MAX, .lo = (a), .hi = (b)

static const char *check_device(const char *s);
static const char *check_threads(const char *s);
static const char *check_layer_name(const char *s);
static const char *check_tie(const char *s);
static const char *check_norm_type(double v);
static const char *check_size(double v);

#define S struct early_stop_config
static const struct field early_stop_fields[] = {
    ENUM_(S, metric, eval_metric_names, METRIC_NONE, .def_text = "none: off"),
    INT_(S, patience, 0, IN_CC(0, CFG_MAX_STEPS), .def_text = "none: required with a metric"),
    DBL_(S, min_delta, 0, GE(0)),
};
#undef S
static const struct section early_stop_section = {"run.early_stop", early_stop_fields, ARRAY_LEN(early_stop_fields)};

#define S struct run_config
static const struct field run_fields[] = {
    STR_(S, name, "run", .flags = F_NONEMPTY),
    STR_(S, out_dir, "", .flags = F_NONEMPTY, .explicit_bit = X_OUT_DIR, .def_text = "runs/<name>"),
    U64_(S, seed, 1234),
    STR_(S, device, "auto", .check_str = check_device, .what = "auto, cpu, cuda or cuda:N"),
    STR_(S, threads, "auto", .check_str = check_threads, .what = "auto or a number of threads, 1 to 1024"),
    INT_(S, steps, 0, IN_CC(0, CFG_MAX_STEPS), .def_text = "0: train for run.epochs"),
    INT_(S, epochs, 0, IN_CC(0, CFG_MAX_EPOCHS), .explicit_bit = X_EPOCHS, .def_text = "1 when run.steps is 0"),
    INT_(S, log_every, 50, GE(1)),
    INT_(S, eval_every, 0, GE(0), .def_text = "0: only at the end"),
    INT_(S, ckpt_every, 0, GE(0), .def_text = "0: only at the end"),
    INT_(S, keep_ckpts, 3, GE(1)),
    ENUM_(S, keep_best, eval_metric_names, METRIC_NONE, .def_text = "none: off"),
    SECT_(S, early_stop, early_stop_section),
    INT_(S, numerics_every, 0, GE(0), .def_text = "0: off"),
    INT_(S, sample_every, 0, GE(0), .def_text = "0: off"),
    STR_(S, sample_prompt, ""),
    ENUM_(S, recompute, recompute_names, RECOMPUTE_NONE),
    BOOL_(S, tensorboard, true),
    ENUM_(S, resume, resume_policy_names, RESUME_NEVER, .def_text = "never: refuse a directory that holds a run"),
};
#undef S
static const struct section run_section = {"run", run_fields, ARRAY_LEN(run_fields)};

#define S struct data_config
#define IDX (1u << DATA_IDX)
#define HDF5 (1u << DATA_HDF5)
#define TEXT (1u << DATA_TEXT)
#define TOKENS (1u << DATA_TOKENS)
static const struct field data_fields[] = {
    ENUM_(S, format, data_format_names, DATA_IDX),
    STR_(S, train_images, "", .formats = IDX),
    STR_(S, train_labels, "", .formats = IDX),
    STR_(S, test_images, "", .formats = IDX),
    STR_(S, test_labels, "", .formats = IDX),
    STR_(S, path, "", .formats = HDF5),
    STR_(S, x_key, "x", .flags = F_NONEMPTY, .formats = HDF5),
    STR_(S, y_key, "y", .flags = F_NONEMPTY, .formats = HDF5),
    LIST_(S, files, nfiles, NULL, .formats = TEXT),
    STR_(S, train_bin, "", .formats = TOKENS),
    STR_(S, val_bin, "", .def_text = "none: no evaluation", .formats = TOKENS),
    INT_(S, vocab, 0, IN_CC(0, CFG_MAX_SIZE), .def_text = "none: required for tokens", .formats = TOKENS),
    STR_(S, tokenizer, "", .def_text = "none: ids only", .formats = TOKENS),
    ENUM_(S, sampling, data_sampling_names, SAMPLING_RANDOM, .formats = TOKENS),
    INT_(S, val_windows, 0, IN_CC(0, CFG_MAX_STEPS), .def_text = "0: every window of data.val_bin", .formats = TOKENS),
    INT_(S, seq_len, 64, IN_CC(1, CFG_MAX_SIZE), .formats = TEXT | TOKENS),
    DBL_(S, val_fraction, 0.1, IN_CO(0, 1), .formats = HDF5 | TEXT),
    INT_(S, batch_size, 64, IN_CC(1, CFG_MAX_SIZE)),
    BOOL_(S, shuffle, true, .formats = IDX | HDF5 | TEXT), /* tokens: data.sampling decides the order */
    DBL_(S, mean, 0, .formats = IDX | HDF5),
    DBL_(S, std, 1, GT(0), .formats = IDX | HDF5),
};
#undef IDX
#undef HDF5
#undef TEXT
#undef TOKENS
#undef S
static const struct section data_section = {"data", data_fields, ARRAY_LEN(data_fields)};

#define K(k) (1u << (k))
#define POOLS (K(LAYER_MAXPOOL2D) | K(LAYER_AVGPOOL2D))
#define ALL_KINDS ((1u << LAYER_KIND_COUNT) - 1)
#define S struct layer_config
static const struct field layer_fields[] = {
    ENUM_(S, kind, layer_kind_names, LAYER_LINEAR, .kinds = ALL_KINDS),
    STR_(S, name, "", .flags = F_NONEMPTY, .kinds = ALL_KINDS, .explicit_bit = XL_NAME, .check_str = check_layer_name,
         .def_text = "kind_N, N its position"),
    INT_(S, out, 0, IN_CC(1, CFG_MAX_SIZE), .kinds = K(LAYER_LINEAR) | K(LAYER_CONV2D), .required = K(LAYER_LINEAR) | K(LAYER_CONV2D)),
    INT_(S, kernel, 0, IN_CC(1, CFG_MAX_WINDOW), .kinds = K(LAYER_CONV2D) | POOLS, .required = K(LAYER_CONV2D) | POOLS),
    INT_(S, stride, 1, IN_CC(1, CFG_MAX_WINDOW), .kinds = K(LAYER_CONV2D) | POOLS, .explicit_bit = XL_STRIDE,
         .def_text = "1 for conv2d, kernel for pools"),
    INT_(S, padding, 0, IN_CC(0, CFG_MAX_WINDOW), .kinds = K(LAYER_CONV2D) | POOLS),
    BOOL_(S, bias, true, .kinds = K(LAYER_LINEAR) | K(LAYER_CONV2D)),
    DBL_(S, eps, 1e-5, GT(0), .kinds = K(LAYER_BATCHNORM2D) | K(LAYER_LAYERNORM)),
    DBL_(S, momentum, 0.1, IN_CC(0, 1), .kinds = K(LAYER_BATCHNORM2D)),
    DBL_(S, p, 0.1, IN_CO(0, 1), .kinds = K(LAYER_DROPOUT)),
    INT_(S, vocab, 256, IN_CC(1, CFG_MAX_SIZE), .kinds = K(LAYER_EMBEDDING)),
    INT_(S, dim, 0, IN_CC(0, CFG_MAX_SIZE), .kinds = K(LAYER_EMBEDDING) | K(LAYER_ATTENTION) | K(LAYER_TRANSFORMER_BLOCK),
         .required = K(LAYER_EMBEDDING), .def_text = "0: inferred from the input"),
    INT_(S, max_len, 0, IN_CC(1, CFG_MAX_SIZE), .kinds = K(LAYER_EMBEDDING), .explicit_bit = XL_MAX_LEN, .def_text = "data.seq_len"),
    INT_(S, heads, 0, IN_CC(1, CFG_MAX_WINDOW), .kinds = K(LAYER_ATTENTION) | K(LAYER_TRANSFORMER_BLOCK),
         .required = K(LAYER_ATTENTION) | K(LAYER_TRANSFORMER_BLOCK)),
    INT_(S, mlp_ratio, 4, IN_CC(1, CFG_MAX_WINDOW), .kinds = K(LAYER_TRANSFORMER_BLOCK)),
    ENUM_(S, approximate, gelu_approx_names, GELU_TANH, .kinds = K(LAYER_GELU) | K(LAYER_TRANSFORMER_BLOCK)),
    STR_(S, tie, "", .kinds = K(LAYER_LINEAR), .check_str = check_tie, .what = "LAYER/wte of an earlier embedding",
         .def_text = "none: the layer's own weight"),
};
#undef S
static const struct section layer_section = {"model.layers.N", layer_fields, ARRAY_LEN(layer_fields)};

#define S struct model_config
static const struct field model_fields[] = {
    ENUM_(S, init, init_scheme_names, INIT_PYTORCH),
    STR_(S, init_from, "", .def_text = "none: start from model.init"),
    ENUM_(S, init_names, weight_names_names, NAMES_AMPTRAIN),
    BOOL_(S, init_strict, true),
    {FIELD(S, layers, FT_LAYERS), .count_off = offsetof(S, nlayers)},
};
#undef S
static const struct section model_section = {"model", model_fields, ARRAY_LEN(model_fields)};

#define S struct schedule_config
static const struct field schedule_fields[] = {
    ENUM_(S, kind, sched_kind_names, SCHED_CONSTANT),
    INT_(S, warmup_steps, 0, GE(0)),
    INT_(S, step_size, 1000, GE(1)),
    DBL_(S, gamma, 0.1, IN_OC(0, 1)),
    DBL_(S, min_lr, 0, GE(0)),
    INT_(S, decay_steps, 0, IN_CC(0, CFG_MAX_STEPS), .def_text = "0: run.steps"),
    DBL_(S, decay_fraction, 0.2, IN_OC(0, 1)),
};
#undef S
static const struct section schedule_section = {"optim.schedule", schedule_fields, ARRAY_LEN(schedule_fields)};

#define S struct optim_config
static const struct field optim_fields[] = {
    ENUM_(S, kind, optim_kind_names, OPTIM_ADAMW),
    DBL_(S, lr, 1e-3, GT(0)),
    PAIR_(S, betas, 0.9, 0.999, IN_CO(0, 1)),
    DBL_(S, eps, 1e-8, GT(0)),
    DBL_(S, weight_decay, 0.01, GE(0), .explicit_bit = X_WEIGHT_DECAY, .def_text = "0.01 for adamw, 0 for sgd"),
    DBL_(S, momentum, 0, IN_CO(0, 1)),
    BOOL_(S, nesterov, false),
    ENUM_(S, state_dtype, store_dtype_names, STORE_FP32),
    BOOL_(S, stochastic_rounding, false),
    SECT_(S, schedule, schedule_section),
};
#undef S
static const struct section optim_section = {"optim", optim_fields, ARRAY_LEN(optim_fields)};

#define S struct loss_scale_config
static const struct field loss_scale_fields[] = {
    DBL_(S, init, 65536, GT(0)),
    DBL_(S, growth_factor, 2, GT(1)),
    DBL_(S, backoff_factor, 0.5, IN_OO(0, 1)),
    INT_(S, growth_interval, 2000, GE(1)),
    INT_(S, hysteresis, 1, GE(1)),
    DBL_(S, min, 1, GT(0)),
    DBL_(S, max, 16777216, .flags = F_MIN | F_MIN_OPEN | F_INF_OK, .lo = 0),
    DBL_(S, value, 65536, GT(0)),
};
#undef S
static const struct section loss_scale_section = {"precision.loss_scale", loss_scale_fields, ARRAY_LEN(loss_scale_fields)};

#define S struct autocast_config
static const struct field autocast_fields[] = {
    LIST_(S, lowp_ops, nlowp, op_kind_names),
    LIST_(S, fp32_ops, nfp32, op_kind_names),
    LIST_(S, promote_ops, npromote, op_kind_names),
};
#undef S
static const struct section autocast_section = {"precision.autocast", autocast_fields, ARRAY_LEN(autocast_fields)};

#define S struct fp8_config
static const struct field fp8_fields[] = {
    ENUM_(S, recipe, fp8_recipe_names, FP8_RECIPE_DELAYED),
    INT_(S, amax_history_len, 1024, IN_CC(1, CFG_MAX_AMAX_HISTORY)),
    ENUM_(S, amax_compute, fp8_amax_compute_names, FP8_AMAX_MAX),
    INT_(S, margin, 0, IN_CC(0, 64)),
    ENUM_(S, loss_scale, fp8_loss_scale_names, FP8_LS_NONE),
    LIST_(S, keep_bf16, nkeep_bf16, NULL),
    PAIR_(S, min_size, 4096, 1024, GE(0), .check_num = check_size, .what = "[K, N], whole numbers >= 0",
          .explicit_bit = X_FP8_MIN_SIZE),
};
#undef S
static const struct section fp8_section = {"precision.fp8", fp8_fields, ARRAY_LEN(fp8_fields)};

#define S struct precision_config
static const struct field precision_fields[] = {
    ENUM_(S, mode, precision_mode_names, PREC_FP32),
    SECT_(S, fp8, fp8_section),
    SECT_(S, loss_scale, loss_scale_section),
    SECT_(S, autocast, autocast_section),
    BOOL_(S, tf32, false),
    ENUM_(S, master_weights, store_dtype_names, STORE_FP32),
};
#undef S
static const struct section precision_section = {"precision", precision_fields, ARRAY_LEN(precision_fields)};

#define S struct clip_config
static const struct field clip_fields[] = {
    DBL_(S, max_norm, 0, GE(0), .def_text = "0: no clipping"),
    DBL_(S, norm_type, 2, .flags = F_INF_OK, .check_num = check_norm_type, .what = "2 or inf"),
};
#undef S
static const struct section clip_section = {"clip", clip_fields, ARRAY_LEN(clip_fields)};

#define S struct stability_config
static const struct field stability_fields[] = {
    ENUM_(S, on_nonfinite, on_nonfinite_names, NONFINITE_SKIP),
    INT_(S, max_consecutive_skips, 100, GE(0), .def_text = "100; 0: never stop"),
};
#undef S
static const struct section stability_section = {"stability", stability_fields, ARRAY_LEN(stability_fields)};

#define S struct dist_config
static const struct field dist_fields[] = {
    ENUM_(S, backend, dist_backend_names, DIST_AUTO),
    INT_(S, check_every, 0, GE(0), .def_text = "0: at every log flush"),
    DBL_(S, timeout_s, COMM_TIMEOUT_DEFAULT_S, GE(0), .def_text = "1800 s; 0: wait for ever"),
    DBL_(S, bucket_mb, 25, IN_CC(0, 1048576)),
    INT_(S, zero, 0, IN_CC(0, 1), .def_text = "0: every rank holds the whole optimizer state"),
};
#undef S
static const struct section dist_section = {"dist", dist_fields, ARRAY_LEN(dist_fields)};

#define S struct config
static const struct field root_fields[] = {
    SECT_(S, run, run_section),
    SECT_(S, data, data_section),
    SECT_(S, model, model_section),
    SECT_(S, optim, optim_section),
    SECT_(S, precision, precision_section),
    INT_(S, accum_steps, 1, IN_CC(1, CFG_MAX_ACCUM)),
    SECT_(S, clip, clip_section),
    SECT_(S, stability, stability_section),
    SECT_(S, dist, dist_section),
};
#undef S
static const struct section root_section = {"", root_fields, ARRAY_LEN(root_fields)};

static const char *check_device(const char *s)
{
    if (!strcmp(s, "auto") || !strcmp(s, "cpu") || !strcmp(s, "cuda"))
        return NULL;
    if (!strncmp(s, "cuda:", 5) && s[5]) {
        size_t n = strspn(s + 5, "0123456789");
        if (s[5 + n] == '\0' && n <= 4)
            return NULL;
    }
    return "must be auto, cpu, cuda or cuda:N (N the GPU index)";
}

/* A tie names a parameter "LAYER/PARAM"; models/linear.c checks what it names. */
static const char *check_tie(const char *s)
{
    const char *slash = strchr(s, '/');
    if (s[0] && (!slash || slash == s || !slash[1] || strchr(slash + 1, '/')))
        return "must name a parameter as LAYER/PARAM (e.g. emb/wte)";
    return NULL;
}

/* run.threads: "auto" or a decimal count in [1, CFG_MAX_THREADS] (no sign, no leading zero). */
static const char *check_threads(const char *s)
{
    if (!strcmp(s, "auto"))
        return NULL;
    size_t n = strspn(s, "0123456789");
    if (n > 0 && n <= 4 && s[n] == '\0' && s[0] != '0' && atoi(s) <= CFG_MAX_THREADS)
        return NULL;
    return "must be auto or a number of threads from 1 to 1024";
}

bool config_fp8_min_size_written(const struct config *cfg)
{
    return (cfg->explicit_keys & X_FP8_MIN_SIZE) != 0;
}

int config_threads(const struct run_config *run)
{
    return strcmp(run->threads, "auto") == 0 ? 0 : atoi(run->threads);
}

static const char *check_layer_name(const char *s)
{
    /* Layer names become HDF5 group names (/model/NAME/...) and appear in logs. */
    if (s[0] == '.')
        return "must not start with '.'";
    if (s[strspn(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")] != '\0')
        return "may only contain letters, digits, '_', '-' and '.'";
    return NULL;
}

static const char *check_norm_type(double v)
{
    return v == 2.0 || v == INFINITY ? NULL : "must be 2 or inf";
}

/* a size (precision.fp8.min_size): a whole number from 0 to 2^53, read exactly from a double */
static const char *check_size(double v)
{
    return v >= 0 && v <= 9007199254740992.0 && v == floor(v) ? NULL : "must be a whole number >= 0";
}

/* ---- small helpers ---------------------------------------------------------------------------- */

static void *at(void *base, size_t off) { return (char *)base + off; }
static const void *cat(const void *base, size_t off) { return (const char *)base + off; }

static int get_enum(const void *base, const struct field *f)
{
    int v;
    memcpy(&v, cat(base, f->off), sizeof v);
    return v;
}
static void set_enum(void *base, const struct field *f, int v) { memcpy(at(base, f->off), &v, sizeof v); }
static int64_t get_i64(const void *base, const struct field *f) { return *(const int64_t *)cat(base, f->off); }
static int get_count(const void *base, const struct field *f) { return *(const int *)cat(base, f->count_off); }

static size_t count_names(const char *const *names)
{
    size_t n = 0;
    while (names[n])
        n++;
    return n;
}

static int find_name(const char *const *names, const char *s)
{
    for (int i = 0; names[i]; i++)
        if (!strcmp(names[i], s))
            return i;
    return -1;
}

static const struct field *find_field(const struct section *s, const char *key)
{
    for (size_t i = 0; i < s->nfields; i++)
        if (!strcmp(s->fields[i].key, key))
            return &s->fields[i];
    return NULL;
}

/* Append to a fixed buffer, truncating quietly. */
static void cat_text(char *buf, size_t size, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void cat_text(char *buf, size_t size, const char *fmt, ...)
{
    size_t len = strlen(buf);
    if (len + 1 >= size)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + len, size - len, fmt, ap);
    va_end(ap);
}

/* The shortest text that reads back to the same double (double_to_text); "inf" for infinity. */
static void format_double(double v, char *buf, size_t size) { double_to_text(v, buf, size); }

/* A scalar's text for a message: at most ~60 bytes, control characters shown as '?'. */
static const char *show(const char *s, char *buf, size_t size)
{
    size_t n = strlen(s), max = size < 64 ? size - 4 : 60;
    bool cut = n > max;
    if (cut) {
        n = max;
        while (n > 0 && ((unsigned char)s[n] & 0xC0) == 0x80)
            n--; /* do not split a UTF-8 sequence */
    }
    for (size_t i = 0; i < n; i++)
        buf[i] = (unsigned char)s[i] < 0x20 || s[i] == 0x7f ? '?' : s[i];
    snprintf(buf + n, size - n, "%s", cut ? "..." : "");
    return buf;
}

/* Optimal-string-alignment distance, case-insensitive; large for long words. */
static int edit_distance(const char *a, const char *b)
{
    enum { MAXW = 48 };
    size_t n = strlen(a), m = strlen(b);
    if (n > MAXW || m > MAXW)
        return 1000;
    int d[MAXW + 1][MAXW + 1];
    for (size_t i = 0; i <= n; i++)
        d[i][0] = (int)i;
    for (size_t j = 0; j <= m; j++)
        d[0][j] = (int)j;
    for (size_t i = 1; i <= n; i++) {
        for (size_t j = 1; j <= m; j++) {
            char x = (char)(a[i - 1] >= 'A' && a[i - 1] <= 'Z' ? a[i - 1] + 32 : a[i - 1]);
            char y = (char)(b[j - 1] >= 'A' && b[j - 1] <= 'Z' ? b[j - 1] + 32 : b[j - 1]);
            int best = d[i - 1][j - 1] + (x != y);
            if (d[i - 1][j] + 1 < best)
                best = d[i - 1][j] + 1;
            if (d[i][j - 1] + 1 < best)
                best = d[i][j - 1] + 1;
            if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] && d[i - 2][j - 2] + 1 < best)
                best = d[i - 2][j - 2] + 1;
            d[i][j] = best;
        }
    }
    return d[n][m];
}

/* The candidate closest to `word` (or to `word` without surrounding spaces), if it is close enough
 * to be a likely typo: distance 1 for names up to 4 letters, 2 up to 8, 3 beyond. */
static const char *suggest(const char *word, const char *const *cands, size_t ncands)
{
    char trimmed[64];
    size_t start = strspn(word, " \t"), len = strlen(word + start);
    while (len > 0 && (word[start + len - 1] == ' ' || word[start + len - 1] == '\t'))
        len--;
    snprintf(trimmed, sizeof trimmed, "%.*s", (int)(len < 63 ? len : 63), word + start);

    const char *best = NULL;
    int best_d = 1000;
    for (size_t i = 0; i < ncands; i++) {
        int d = edit_distance(word, cands[i]), dt = edit_distance(trimmed, cands[i]);
        if (dt < d)
            d = dt;
        size_t cl = strlen(cands[i]);
        int limit = cl <= 4 ? 1 : cl <= 8 ? 2 : 3;
        if (d <= limit && d < best_d) {
            best = cands[i];
            best_d = d;
        }
    }
    return best;
}

/* The keys of a section (of one layer kind when kind >= 0) as a candidate list. */
static size_t collect_keys(const struct section *s, int kind, const char **out, size_t max)
{
    size_t n = 0;
    for (size_t i = 0; i < s->nfields && n < max; i++)
        if (kind < 0 || (s->fields[i].kinds & (1u << kind)))
            out[n++] = s->fields[i].key;
    return n;
}

static void list_keys(const struct section *s, int kind, char *buf, size_t size)
{
    const char *keys[64];
    size_t n = collect_keys(s, kind, keys, ARRAY_LEN(keys));
    for (size_t i = 0; i < n; i++) {
        const struct field *f = find_field(s, keys[i]);
        bool req = kind >= 0 && (f->required & (1u << kind));
        cat_text(buf, size, "%s%s%s", i ? ", " : "", keys[i], req ? " (required)" : "");
    }
}

static void list_names(const char *const *names, char *buf, size_t size)
{
    for (size_t i = 0; names[i]; i++)
        cat_text(buf, size, "%s%s", i ? ", " : "", names[i]);
}

static void join_path(char *buf, size_t size, const char *prefix, const char *key)
{
    snprintf(buf, size, "%s%s%s", prefix, prefix[0] ? "." : "", key);
}

/* "in optim", "at the top level" */
static void section_place(const struct section *s, char *buf, size_t size)
{
    if (s->path[0])
        snprintf(buf, size, "in %s", s->path);
    else
        snprintf(buf, size, "at the top level");
}

/* ---- range and hint text ---------------------------------------------------------------------- */

static bool in_range(const struct field *f, double v)
{
    if (f->flags & F_MIN) {
        if (f->flags & F_MIN_OPEN ? !(v > f->lo) : !(v >= f->lo))
            return false;
    }
    if (f->flags & F_MAX) {
        if (f->flags & F_MAX_OPEN ? !(v < f->hi) : !(v <= f->hi))
            return false;
    }
    return true;
}

static void range_text(const struct field *f, char *buf, size_t size)
{
    char lo[40], hi[40];
    if (f->type == FT_INT) { /* bounds of integers read as integers: 1000000000000, not 1e+12 */
        snprintf(lo, sizeof lo, "%.0f", f->lo);
        snprintf(hi, sizeof hi, "%.0f", f->hi);
    } else {
        format_double(f->lo, lo, sizeof lo);
        format_double(f->hi, hi, sizeof hi);
    }
    buf[0] = '\0';
    if ((f->flags & F_MIN) && (f->flags & F_MAX))
        snprintf(buf, size, "in %c%s, %s%c", f->flags & F_MIN_OPEN ? '(' : '[', lo, hi, f->flags & F_MAX_OPEN ? ')' : ']');
    else if (f->flags & F_MIN)
        snprintf(buf, size, "%s %s", f->flags & F_MIN_OPEN ? ">" : ">=", lo);
    else if (f->flags & F_MAX)
        snprintf(buf, size, "%s %s", f->flags & F_MAX_OPEN ? "<" : "<=", hi);
}

static void default_text(const struct field *f, char *buf, size_t size)
{
    char a[40], b[40];
    if (f->def_text) {
        snprintf(buf, size, "%s", f->def_text);
        return;
    }
    switch (f->type) {
    case FT_INT:
    case FT_U64:
    case FT_DOUBLE:
        format_double(f->def, buf, size);
        break;
    case FT_BOOL:
        snprintf(buf, size, "%s", f->def != 0 ? "true" : "false");
        break;
    case FT_ENUM:
        snprintf(buf, size, "%s", f->names[(int)f->def]);
        break;
    case FT_STRING:
        if (f->def_str && f->def_str[0])
            snprintf(buf, size, "\"%s\"", f->def_str);
        else
            buf[0] = '\0';
        break;
    case FT_PAIR:
        format_double(f->def, a, sizeof a);
        format_double(f->def2, b, sizeof b);
        snprintf(buf, size, "[%s, %s]", a, b);
        break;
    case FT_STRLIST:
        snprintf(buf, size, "[]");
        break;
    default:
        buf[0] = '\0';
    }
}

static const char *expected_what(const struct field *f)
{
    if (f->what)
        return f->what;
    switch (f->type) {
    case FT_SECTION: return "a mapping of keys";
    case FT_LAYERS: return "a list of layers";
    case FT_INT: return "an integer";
    case FT_U64: return "a non-negative integer";
    case FT_DOUBLE: return "a number";
    case FT_BOOL: return "true or false";
    case FT_STRING: return "a string";
    case FT_ENUM: return "a name";
    case FT_PAIR: return "a list of two numbers";
    case FT_STRLIST: return f->names ? "a list of op kinds" : "a list of strings";
    }
    return "a value";
}

/* What a key takes, for hints: "optim.lr takes a number > 0 (default 0.001)". */
static const char *field_hint(const struct field *f, const char *path, int kind, char *buf, size_t size)
{
    char range[96], def[128];
    range_text(f, range, sizeof range);
    default_text(f, def, sizeof def);
    if (kind >= 0 && (f->required & (1u << kind)))
        snprintf(def, sizeof def, "required");
    snprintf(buf, size, "%s takes %s", path, expected_what(f));
    switch (f->type) {
    case FT_SECTION:
        cat_text(buf, size, ": ");
        list_keys(f->sub, -1, buf, size);
        return buf;
    case FT_LAYERS:
        cat_text(buf, size, ", each a mapping with a kind (");
        list_names(layer_kind_names, buf, size);
        cat_text(buf, size, ") and that kind's keys (see docs/config.md)");
        return buf;
    case FT_ENUM:
        snprintf(buf, size, "%s takes one of: ", path);
        list_names(f->names, buf, size);
        break;
    case FT_STRLIST:
        if (f->names) {
            cat_text(buf, size, " from: ");
            list_names(f->names, buf, size);
        } else {
            cat_text(buf, size, ", e.g. [a.txt, b.txt]");
        }
        break;
    case FT_PAIR:
        cat_text(buf, size, ", each %s", range);
        break;
    default:
        if (range[0])
            cat_text(buf, size, " %s", range);
        if (f->flags & F_INF_OK && f->type == FT_DOUBLE && !f->what)
            cat_text(buf, size, " or inf");
    }
    if (def[0])
        cat_text(buf, size, " (%s%s)", strcmp(def, "required") ? "default " : "", def);
    return buf;
}

/* ---- error context ---------------------------------------------------------------------------- */

struct ctx {
    const char *file;         /* the source's name in messages */
    const char *override;     /* the whole KEY=VALUE while applying an override, else NULL */
    const char *override_key; /* its KEY */
    yaml_document_t *doc;     /* the document the nodes belong to; NULL in a bare config_finalize */
    const char *text;         /* its source text (len bytes): where a node's marks point */
    size_t len;
    unsigned *explicit_keys;  /* where writes to keys with derived defaults are recorded */
    struct amp_error *err;
};

static enum amp_status vfail(const struct ctx *c, const yaml_mark_t *mark, const char *path, const char *hint,
                             const char *fmt, va_list ap)
{
    char body[1536];
    vsnprintf(body, sizeof body, fmt, ap);
    if (c->override) {
        if (path && (!c->override_key || strcmp(path, c->override_key)))
            return amp_fail(c->err, AMP_ERR_CONFIG, hint, "override '%s': %s: %s", c->override, path, body);
        return amp_fail(c->err, AMP_ERR_CONFIG, hint, "override '%s': %s", c->override, body);
    }
    const char *file = c->file && c->file[0] ? c->file : "config";
    if (mark && path)
        return amp_fail(c->err, AMP_ERR_CONFIG, hint, "%s:%zu:%zu: %s: %s", file, mark->line + 1, mark->column + 1,
                        path, body);
    if (mark)
        return amp_fail(c->err, AMP_ERR_CONFIG, hint, "%s:%zu:%zu: %s", file, mark->line + 1, mark->column + 1, body);
    if (path)
        return amp_fail(c->err, AMP_ERR_CONFIG, hint, "%s: %s: %s", file, path, body);
    return amp_fail(c->err, AMP_ERR_CONFIG, hint, "%s: %s", file, body);
}

/* An error at a position: "FILE:LINE:COL: body". */
static enum amp_status fail_at(const struct ctx *c, const yaml_mark_t *mark, const char *hint, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static enum amp_status fail_at(const struct ctx *c, const yaml_mark_t *mark, const char *hint, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    enum amp_status st = vfail(c, mark, NULL, hint, fmt, ap);
    va_end(ap);
    return st;
}

/* An error about the value of key `path`: "FILE:LINE:COL: path: body" (the override names the key). */
static enum amp_status fail_value(const struct ctx *c, const yaml_node_t *node, const char *path, const char *hint,
                                  const char *fmt, ...) __attribute__((format(printf, 5, 6)));
static enum amp_status fail_value(const struct ctx *c, const yaml_node_t *node, const char *path, const char *hint,
                                  const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    enum amp_status st = vfail(c, node ? &node->start_mark : NULL, path, hint, fmt, ap);
    va_end(ap);
    return st;
}

static enum amp_status out_of_memory(struct amp_error *err)
{
    return amp_fail(err, AMP_ERR_INTERNAL, "free some memory and try again", "out of memory while reading the config");
}

/* ---- YAML node helpers ------------------------------------------------------------------------ */

static yaml_node_t *node_at(const struct ctx *c, yaml_node_item_t i) { return yaml_document_get_node(c->doc, i); }
static const char *stext(const yaml_node_t *n) { return (const char *)n->data.scalar.value; }
static bool is_plain(const yaml_node_t *n) { return n->data.scalar.style == YAML_PLAIN_SCALAR_STYLE; }

static bool is_null(const yaml_node_t *n)
{
    if (n->type != YAML_SCALAR_NODE || !is_plain(n))
        return false;
    const char *s = stext(n);
    return !s[0] || !strcmp(s, "~") || !strcmp(s, "null") || !strcmp(s, "Null") || !strcmp(s, "NULL");
}

static bool has_nul(const yaml_node_t *n) { return strlen(stext(n)) != n->data.scalar.length; }

static const char *describe(const yaml_node_t *n, char *buf, size_t size)
{
    char shown[64];
    if (n->type == YAML_MAPPING_NODE)
        return "a mapping";
    if (n->type == YAML_SEQUENCE_NODE)
        return "a list";
    if (is_null(n))
        return "nothing (null)";
    show(stext(n), shown, sizeof shown);
    if (is_plain(n))
        snprintf(buf, size, "'%s'", shown);
    else
        snprintf(buf, size, "the quoted string \"%s\"", shown);
    return buf;
}

/* [-+]? (digits [. digits?] | . digits) ([eE] [-+]? digits)? — YAML 1.2's float syntax, no hex. */
static bool number_syntax(const char *s)
{
    size_t digits = 0;
    if (*s == '+' || *s == '-')
        s++;
    while (*s >= '0' && *s <= '9')
        s++, digits++;
    if (*s == '.') {
        s++;
        while (*s >= '0' && *s <= '9')
            s++, digits++;
    }
    if (!digits)
        return false;
    if (*s == 'e' || *s == 'E') {
        s++;
        if (*s == '+' || *s == '-')
            s++;
        if (!(*s >= '0' && *s <= '9'))
            return false;
        while (*s >= '0' && *s <= '9')
            s++;
    }
    return *s == '\0';
}

static bool integer_syntax(const char *s)
{
    if (*s == '+' || *s == '-')
        s++;
    return *s && s[strspn(s, "0123456789")] == '\0';
}

static bool is_inf_word(const char *s)
{
    if (*s == '+')
        s++;
    return !strcmp(s, "inf") || !strcmp(s, "Inf") || !strcmp(s, ".inf") || !strcmp(s, ".Inf") || !strcmp(s, ".INF");
}

/* ---- reading scalar values -------------------------------------------------------------------- */

/* A scalar with an explicit tag (!!str 1e-3, !!float 1): libyaml's document gives every scalar a tag, so
 * the source text tells, at the node's start (after an &anchor). */
static bool tagged(const struct ctx *c, const yaml_node_t *n)
{
    size_t i = n->start_mark.index;
    if (!c->text || i >= c->len)
        return false;
    if (c->text[i] == '&') {
        while (i < c->len && !strchr(" \t\r\n", c->text[i]))
            i++;
        while (i < c->len && strchr(" \t\r\n", c->text[i]))
            i++;
    }
    return i < c->len && c->text[i] == '!';
}

/* Numbers and booleans are written bare: plain style, no tag. */
static bool bare(const struct ctx *c, const yaml_node_t *n) { return is_plain(n) && !tagged(c, n); }

static enum amp_status reject_quoted_number(const struct ctx *c, const yaml_node_t *n, const char *path,
                                            const char *kind)
{
    char shown[96];
    show(stext(n), shown, sizeof shown);
    if (tagged(c, n))
        return fail_value(c, n, path, "remove the tag: numbers are written bare, e.g. lr: 1e-4",
                          "expected %s, got a tagged (!!...) value \"%s\"", kind, shown);
    return fail_value(c, n, path, "remove the quotes: numbers are written bare, e.g. lr: 1e-4",
                      "expected %s, got the quoted string \"%s\"", kind, shown);
}

static enum amp_status read_double(const struct ctx *c, const struct field *f, const yaml_node_t *n, const char *path,
                                   const char *hint, double *out)
{
    const char *s = stext(n);
    char shown[96];
    if (!bare(c, n) && (number_syntax(s) || is_inf_word(s)))
        return reject_quoted_number(c, n, path, "a number");
    if (bare(c, n) && is_inf_word(s)) {
        if (f->flags & F_INF_OK) {
            *out = INFINITY;
            return AMP_OK;
        }
        return fail_value(c, n, path, hint, "expected a finite number, got '%s'",
                          show(s, shown, sizeof shown));
    }
    if (!bare(c, n) || !number_syntax(s))
        return fail_value(c, n, path, hint, "expected a number, got %s",
                          describe(n, shown, sizeof shown));
    double v = strtod(s, NULL);
    if (isinf(v))
        return fail_value(c, n, path, hint, "the number '%s' is too large",
                          show(s, shown, sizeof shown));
    *out = v;
    return AMP_OK;
}

/* Integers: decimal digits, or a number in float syntax whose value is whole and exact (1e3, 2.0). */
static enum amp_status read_integer(const struct ctx *c, const yaml_node_t *n, const char *path, const char *hint,
                                    bool is_unsigned, int64_t *out_i, uint64_t *out_u)
{
    const char *s = stext(n);
    char shown[96];
    const char *what = is_unsigned ? "a non-negative integer" : "an integer";
    if (!bare(c, n) && number_syntax(s))
        return reject_quoted_number(c, n, path, what);
    if (!bare(c, n) || !number_syntax(s))
        return fail_value(c, n, path, hint, "expected %s, got %s", what,
                          describe(n, shown, sizeof shown));
    if (is_unsigned && s[0] == '-')
        return fail_value(c, n, path, hint, "expected %s, got '%s'", what,
                          show(s, shown, sizeof shown));
    errno = 0;
    if (integer_syntax(s)) {
        if (is_unsigned)
            *out_u = strtoull(s, NULL, 10);
        else
            *out_i = strtoll(s, NULL, 10);
        if (errno == ERANGE)
            return fail_value(c, n, path, hint, "the integer '%s' is too large",
                              show(s, shown, sizeof shown));
        return AMP_OK;
    }
    double v = strtod(s, NULL);
    if (v != floor(v) || fabs(v) > MAX_EXACT_INT)
        return fail_value(c, n, path, "write a whole number, e.g. 1000 or 1e3", "expected %s, got '%s'", what,
                          show(s, shown, sizeof shown));
    if (is_unsigned)
        *out_u = (uint64_t)v;
    else
        *out_i = (int64_t)v;
    return AMP_OK;
}

static enum amp_status read_bool(const struct ctx *c, const yaml_node_t *n, const char *path, bool *out)
{
    const char *s = stext(n);
    char shown[96];
    if (bare(c, n) && (!strcmp(s, "true") || !strcmp(s, "false"))) {
        *out = s[0] == 't';
        return AMP_OK;
    }
    if (!bare(c, n) && (!strcmp(s, "true") || !strcmp(s, "false")))
        return fail_value(c, n, path, "remove the quotes or tag: write true or false bare",
                          "expected true or false, got the %s \"%s\"", tagged(c, n) ? "tagged value" : "quoted string",
                          s);
    return fail_value(c, n, path, "write true or false (YAML 1.1 words such as yes, no, on, off are not booleans here)",
                      "expected true or false, got %s", describe(n, shown, sizeof shown));
}

/* A string into buf[size]: any scalar style, not null, no NUL byte, fits. */
static enum amp_status read_string(const struct ctx *c, const struct field *f, const yaml_node_t *n, const char *path,
                                   char *buf, size_t size)
{
    const char *s = stext(n);
    char hint[1024];
    if (has_nul(n))
        return fail_value(c, n, path, field_hint(f, path, -1, hint, sizeof hint), "the string contains a NUL character");
    if (n->data.scalar.length >= size)
        return fail_value(c, n, path, field_hint(f, path, -1, hint, sizeof hint),
                          "the string is too long (%zu bytes, at most %zu)", n->data.scalar.length, size - 1);
    if ((f->flags & F_NONEMPTY) && !s[0])
        return fail_value(c, n, path, field_hint(f, path, -1, hint, sizeof hint), "must not be empty");
    const char *why = f->check_str ? f->check_str(s) : NULL;
    if (why) {
        char shown[96];
        return fail_value(c, n, path, field_hint(f, path, -1, hint, sizeof hint), "'%s' %s", show(s, shown, sizeof shown),
                          why);
    }
    memcpy(buf, s, n->data.scalar.length + 1);
    return AMP_OK;
}

static enum amp_status read_name(const struct ctx *c, const yaml_node_t *n, const char *path, const char *const *names,
                                 const char *hint, int *out)
{
    char shown[96], dym[96] = "";
    const char *s = stext(n);
    int i = has_nul(n) ? -1 : find_name(names, s);
    if (i >= 0) {
        *out = i;
        return AMP_OK;
    }
    const char *close = suggest(s, names, count_names(names));
    if (close)
        snprintf(dym, sizeof dym, " (did you mean '%s'?)", close);
    for (int k = 0; !close && *s && names[k]; k++) /* a prefix of some names: fp16 for fp16-static, fp16-dynamic */
        if (!strncmp(names[k], s, strlen(s)))
            snprintf(dym + strlen(dym), sizeof dym - strlen(dym), "%s'%s'", dym[0] ? " or " : " (did you mean ",
                     names[k]);
    if (!close && dym[0])
        snprintf(dym + strlen(dym), sizeof dym - strlen(dym), "?)");
    return fail_value(c, n, path, hint, "unknown value '%s'%s", show(s, shown, sizeof shown), dym);
}

static enum amp_status check_range(const struct ctx *c, const struct field *f, const yaml_node_t *n, const char *path,
                                   const char *hint, double v)
{
    char range[96], shown[96];
    const char *why = f->check_num ? f->check_num(v) : NULL;
    if (!why && in_range(f, v))
        return AMP_OK;
    range_text(f, range, sizeof range);
    if (why)
        return fail_at(c, &n->start_mark, hint, "%s %s, got %s", path, why, show(stext(n), shown, sizeof shown));
    return fail_at(c, &n->start_mark, hint, "%s must be %s, got %s", path, range, show(stext(n), shown, sizeof shown));
}

/* ---- applying nodes to fields ----------------------------------------------------------------- */

static enum amp_status apply_section(struct ctx *c, const struct section *s, void *base, yaml_node_t *node);
static enum amp_status apply_layers(struct ctx *c, const struct field *f, void *base, yaml_node_t *node);

static void layer_defaults(struct layer_config *l, enum layer_kind kind);

/* A key given twice in one mapping. Linear: only keys of section `s` can be duplicates that matter (any
 * other key is refused as unknown), so each pair looks up its field and remembers where it was first seen. */
static enum amp_status check_duplicate_keys(const struct ctx *c, const struct section *s, const yaml_node_t *map,
                                            const char *place)
{
    const yaml_node_t *first[64] = {0};
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top; p++) {
        yaml_node_t *k = node_at(c, p->key);
        if (!k || k->type != YAML_SCALAR_NODE || has_nul(k))
            continue;
        const struct field *f = find_field(s, stext(k));
        if (!f)
            continue;
        size_t i = (size_t)(f - s->fields);
        if (i >= ARRAY_LEN(first))
            continue;
        if (first[i]) {
            char shown[96];
            return fail_at(c, &k->start_mark, "remove one of them: a YAML mapping takes each key once",
                           "duplicate key '%s' %s: first at line %zu, again at line %zu",
                           show(stext(k), shown, sizeof shown), place, first[i]->start_mark.line + 1,
                           k->start_mark.line + 1);
        }
        first[i] = k;
    }
    return AMP_OK;
}

static enum amp_status key_text(const struct ctx *c, const yaml_node_t *k, const char *place, const char **out)
{
    if (!k || k->type != YAML_SCALAR_NODE || has_nul(k) || is_null(k))
        return fail_at(c, k ? &k->start_mark : NULL, "write keys as plain names, e.g. lr: 1e-3",
                       "a key %s is not a name", place);
    *out = stext(k);
    return AMP_OK;
}

static enum amp_status apply_pair(struct ctx *c, const struct field *f, void *base, yaml_node_t *node, const char *path)
{
    char hint[1024], item_path[160], shown[96];
    if (node->type != YAML_SEQUENCE_NODE || node->data.sequence.items.top - node->data.sequence.items.start != 2) {
        field_hint(f, path, -1, hint, sizeof hint);
        if (node->type == YAML_SEQUENCE_NODE)
            return fail_value(c, node, path, hint, "expected a list of two numbers, got %d items",
                              (int)(node->data.sequence.items.top - node->data.sequence.items.start));
        return fail_value(c, node, path, hint, "expected a list of two numbers, got %s", describe(node, shown, sizeof shown));
    }
    double v[2];
    for (int i = 0; i < 2; i++) {
        yaml_node_t *item = node_at(c, node->data.sequence.items.start[i]);
        snprintf(item_path, sizeof item_path, "%s[%d]", path, i);
        if (!item || item->type != YAML_SCALAR_NODE || is_null(item))
            return fail_value(c, item ? item : node, item_path, field_hint(f, path, -1, hint, sizeof hint),
                              "expected a number, got %s", item ? describe(item, shown, sizeof shown) : "nothing");
        field_hint(f, path, -1, hint, sizeof hint);
        enum amp_status st = read_double(c, f, item, item_path, hint, &v[i]);
        if (st == AMP_OK)
            st = check_range(c, f, item, item_path, hint, v[i]);
        if (st != AMP_OK)
            return st;
    }
    memcpy(at(base, f->off), v, sizeof v);
    return AMP_OK;
}

static enum amp_status apply_strlist(struct ctx *c, const struct field *f, void *base, yaml_node_t *node,
                                     const char *path)
{
    char hint[1024], item_path[160], shown[96];
    if (node->type != YAML_SEQUENCE_NODE)
        return fail_value(c, node, path, field_hint(f, path, -1, hint, sizeof hint), "expected %s, got %s",
                          expected_what(f), describe(node, shown, sizeof shown));
    yaml_node_item_t *items = node->data.sequence.items.start;
    int n = (int)(node->data.sequence.items.top - items);
    if (n > f->max_count)
        return fail_value(c, node, path, field_hint(f, path, -1, hint, sizeof hint),
                          "too many entries (%d, at most %d)", n, f->max_count);
    char *dst = at(base, f->off);
    for (int i = 0; i < n; i++) {
        yaml_node_t *item = node_at(c, items[i]);
        snprintf(item_path, sizeof item_path, "%s[%d]", path, i);
        if (!item || item->type != YAML_SCALAR_NODE || is_null(item))
            return fail_value(c, item ? item : node, item_path, field_hint(f, path, -1, hint, sizeof hint),
                              "expected a string, got %s", item ? describe(item, shown, sizeof shown) : "nothing");
        char *slot = dst + (size_t)i * f->size;
        if (f->names) {
            int which;
            hint[0] = '\0';
            cat_text(hint, sizeof hint, "op kinds: ");
            list_names(f->names, hint, sizeof hint);
            enum amp_status st = read_name(c, item, item_path, f->names, hint, &which);
            if (st != AMP_OK)
                return st;
            snprintf(slot, f->size, "%s", f->names[which]);
        } else {
            const struct field one = {.key = f->key, .type = FT_STRING, .flags = F_NONEMPTY};
            enum amp_status st = read_string(c, &one, item, item_path, slot, f->size);
            if (st != AMP_OK)
                return st;
        }
        for (int j = 0; j < i; j++)
            if (!strcmp(dst + (size_t)j * f->size, slot))
                return fail_value(c, item, path, "list each entry once", "'%s' is listed twice",
                                  show(slot, shown, sizeof shown));
    }
    *(int *)at(base, f->count_off) = n;
    return AMP_OK;
}

/* Apply one YAML node to one field; `path` is the key's dotted path; `kind` the layer kind or -1. */
static enum amp_status apply_field_kind(struct ctx *c, const struct field *f, void *base, yaml_node_t *node,
                                        const char *path, int kind)
{
    char hint[1024], shown[96];
    enum amp_status st = AMP_OK;
    switch (f->type) {
    case FT_SECTION:
        return apply_section(c, f->sub, at(base, f->off), node);
    case FT_LAYERS:
        return apply_layers(c, f, base, node);
    case FT_PAIR:
        st = apply_pair(c, f, base, node, path);
        break;
    case FT_STRLIST:
        st = apply_strlist(c, f, base, node, path);
        break;
    default:
        if (node->type != YAML_SCALAR_NODE)
            return fail_value(c, node, path, field_hint(f, path, kind, hint, sizeof hint), "expected %s, got %s",
                              expected_what(f), describe(node, shown, sizeof shown));
        if (is_null(node))
            return fail_value(c, node, path, field_hint(f, path, kind, hint, sizeof hint),
                              "missing value (write a value or remove the key)");
        break;
    }
    if (st != AMP_OK)
        return st;

    field_hint(f, path, kind, hint, sizeof hint);
    switch (f->type) {
    case FT_INT: {
        int64_t v = 0;
        st = read_integer(c, node, path, hint, false, &v, NULL);
        if (st == AMP_OK)
            st = check_range(c, f, node, path, hint, (double)v);
        if (st == AMP_OK)
            *(int64_t *)at(base, f->off) = v;
        break;
    }
    case FT_U64: {
        uint64_t v = 0;
        st = read_integer(c, node, path, hint, true, NULL, &v);
        if (st == AMP_OK)
            *(uint64_t *)at(base, f->off) = v;
        break;
    }
    case FT_DOUBLE: {
        double v = 0;
        st = read_double(c, f, node, path, hint, &v);
        if (st == AMP_OK)
            st = check_range(c, f, node, path, hint, v);
        if (st == AMP_OK)
            *(double *)at(base, f->off) = v;
        break;
    }
    case FT_BOOL:
        st = read_bool(c, node, path, (bool *)at(base, f->off));
        break;
    case FT_STRING:
        st = read_string(c, f, node, path, at(base, f->off), f->size);
        break;
    case FT_ENUM: {
        int v = 0;
        st = read_name(c, node, path, f->names, hint, &v);
        if (st == AMP_OK)
            set_enum(base, f, v);
        break;
    }
    default:
        break;
    }
    if (st == AMP_OK && f->explicit_bit && c->explicit_keys)
        *c->explicit_keys |= f->explicit_bit;
    return st;
}

static enum amp_status apply_field(struct ctx *c, const struct field *f, void *base, yaml_node_t *node,
                                   const char *path)
{
    return apply_field_kind(c, f, base, node, path, -1);
}

/* The dotted path of a key named `key` in section s or below it (batch_size: data.batch_size), for a did-you-mean
 * across sections; layers' keys are left out (they need an index). */
static bool key_elsewhere(const struct section *s, const char *key, char *out, size_t len)
{
    for (size_t i = 0; i < s->nfields; i++) {
        const struct field *f = &s->fields[i];
        if (f->type == FT_SECTION ? key_elsewhere(f->sub, key, out, len) : strcmp(f->key, key) == 0) {
            if (f->type != FT_SECTION)
                snprintf(out, len, "%s%s%s", s->path, s->path[0] ? "." : "", key);
            return true;
        }
    }
    return false;
}

static enum amp_status unknown_key(const struct ctx *c, const yaml_mark_t *mark, const struct section *s,
                                   const char *key)
{
    const char *keys[64];
    char hint[1024], place[128], shown[96], dym[200] = "", there[160];
    size_t n = collect_keys(s, -1, keys, ARRAY_LEN(keys));
    const char *close = suggest(key, keys, n);
    if (close)
        snprintf(dym, sizeof dym, " (did you mean '%s'?)", close);
    else if (key_elsewhere(&root_section, key, there, sizeof there))
        snprintf(dym, sizeof dym, " (did you mean '%s'?)", there);
    section_place(s, place, sizeof place);
    snprintf(hint, sizeof hint, "valid keys %s: ", place);
    list_keys(s, -1, hint, sizeof hint);
    return fail_at(c, mark, hint, "unknown key '%s' %s%s", show(key, shown, sizeof shown), place, dym);
}

static enum amp_status apply_section(struct ctx *c, const struct section *s, void *base, yaml_node_t *node)
{
    char place[128], path[160], hint[1024], shown[96];
    section_place(s, place, sizeof place);
    if (is_null(node) && c->override) /* optim=~ would change nothing: surely a mistake */
        return fail_value(c, node, s->path, "write the keys to change, e.g. optim={lr: 3e-4}",
                          "missing value (a mapping of keys)");
    if (is_null(node))
        return AMP_OK; /* "optim:" with nothing under it in a file: all defaults */
    if (node->type != YAML_MAPPING_NODE) {
        if (s->path[0])
            snprintf(hint, sizeof hint, "write the keys of %s one per line, indented below it: ", s->path);
        else
            snprintf(hint, sizeof hint, "write the config as a mapping of sections (KEY: VALUE lines): ");
        list_keys(s, -1, hint, sizeof hint);
        if (!s->path[0])
            return fail_at(c, &node->start_mark, hint, "the top level must be a mapping of sections, got %s",
                           describe(node, shown, sizeof shown));
        return fail_value(c, node, s->path, hint, "expected a mapping of keys, got %s", describe(node, shown, sizeof shown));
    }
    enum amp_status st = check_duplicate_keys(c, s, node, place);
    for (yaml_node_pair_t *p = node->data.mapping.pairs.start; st == AMP_OK && p < node->data.mapping.pairs.top; p++) {
        yaml_node_t *k = node_at(c, p->key), *v = node_at(c, p->value);
        const char *key = NULL;
        st = key_text(c, k, place, &key);
        if (st != AMP_OK)
            break;
        const struct field *f = find_field(s, key);
        if (!f)
            return unknown_key(c, &k->start_mark, s, key);
        join_path(path, sizeof path, s->path, key);
        st = apply_field(c, f, base, v, path);
    }
    return st;
}

/* ---- layers ----------------------------------------------------------------------------------- */

static void layer_defaults(struct layer_config *l, enum layer_kind kind)
{
    memset(l, 0, sizeof *l);
    for (size_t i = 0; i < layer_section.nfields; i++) {
        const struct field *f = &layer_fields[i];
        switch (f->type) {
        case FT_INT: *(int64_t *)at(l, f->off) = (int64_t)f->def; break;
        case FT_DOUBLE: *(double *)at(l, f->off) = f->def; break;
        case FT_BOOL: *(bool *)at(l, f->off) = f->def != 0; break;
        case FT_ENUM: set_enum(l, f, (int)f->def); break;
        default: break;
        }
    }
    l->kind = kind;
}

/* One key of layer `index`; "kind" changes the kind and resets the other keys (the name stays if given). */
static enum amp_status apply_layer_key(struct ctx *c, struct layer_config *l, int index, const yaml_node_t *keynode,
                                       const char *key, yaml_node_t *value)
{
    char path[160], hint[1024], shown[96], dym[96] = "";
    snprintf(path, sizeof path, "model.layers.%d.%s", index, key);
    if (!strcmp(key, "kind")) {
        int kind = 0;
        char kinds[512] = "layer kinds: ";
        list_names(layer_kind_names, kinds, sizeof kinds);
        if (value->type != YAML_SCALAR_NODE || is_null(value))
            return fail_value(c, value, path, kinds, "expected a layer kind, got %s", describe(value, shown, sizeof shown));
        enum amp_status st = read_name(c, value, path, layer_kind_names, kinds, &kind);
        if (st != AMP_OK)
            return st;
        if (kind != (int)l->kind) {
            struct layer_config old = *l;
            layer_defaults(l, (enum layer_kind)kind);
            if (old.explicit_keys & XL_NAME) {
                memcpy(l->name, old.name, sizeof l->name);
                l->explicit_keys = XL_NAME;
            }
        }
        return AMP_OK;
    }
    int kind = (int)l->kind;
    const struct field *f = find_field(&layer_section, key);
    if (!f || !(f->kinds & (1u << kind))) {
        const char *keys[64];
        size_t n = collect_keys(&layer_section, kind, keys, ARRAY_LEN(keys));
        snprintf(hint, sizeof hint, "keys of a %s layer: ", layer_kind_names[kind]);
        list_keys(&layer_section, kind, hint, sizeof hint);
        const char *close = suggest(key, keys, n);
        if (close)
            snprintf(dym, sizeof dym, " (did you mean '%s'?)", close);
        if (f)
            return fail_at(c, &keynode->start_mark, hint, "key '%s' does not apply to a %s layer (model.layers.%d)", key,
                           layer_kind_names[kind], index);
        return fail_at(c, &keynode->start_mark, hint, "unknown key '%s' in model.layers.%d (%s)%s",
                       show(key, shown, sizeof shown), index, layer_kind_names[kind], dym);
    }
    unsigned *saved = c->explicit_keys;
    c->explicit_keys = &l->explicit_keys;
    enum amp_status st = apply_field_kind(c, f, l, value, path, kind);
    c->explicit_keys = saved;
    return st;
}

/* A layer mapping onto `l`. `fresh`: `l` is new, so the mapping must give a kind. */
static enum amp_status apply_layer(struct ctx *c, struct layer_config *l, int index, yaml_node_t *node, bool fresh)
{
    char place[64], hint[1024], shown[96];
    snprintf(place, sizeof place, "in model.layers.%d", index);
    snprintf(hint, sizeof hint, "write each layer as a mapping with a kind, e.g. - kind: linear; layer kinds: ");
    list_names(layer_kind_names, hint, sizeof hint);
    if (node->type != YAML_MAPPING_NODE) {
        char path[64];
        snprintf(path, sizeof path, "model.layers.%d", index);
        return fail_value(c, node, path, hint, "expected a mapping with a kind, got %s", describe(node, shown, sizeof shown));
    }
    enum amp_status st = check_duplicate_keys(c, &layer_section, node, place);
    if (st != AMP_OK)
        return st;
    yaml_node_pair_t *kind_pair = NULL;
    for (yaml_node_pair_t *p = node->data.mapping.pairs.start; p < node->data.mapping.pairs.top; p++) {
        yaml_node_t *k = node_at(c, p->key);
        if (k && k->type == YAML_SCALAR_NODE && !strcmp(stext(k), "kind") && k->data.scalar.length == 4)
            kind_pair = p;
    }
    if (fresh) {
        if (!kind_pair)
            return fail_at(c, &node->start_mark, hint, "model.layers.%d has no 'kind'", index);
        layer_defaults(l, LAYER_LINEAR);
        l->kind = LAYER_KIND_COUNT; /* no kind yet: apply_layer_key sees a change of kind */
    }
    if (kind_pair) {
        st = apply_layer_key(c, l, index, node_at(c, kind_pair->key), "kind", node_at(c, kind_pair->value));
        if (st != AMP_OK)
            return st;
    }
    for (yaml_node_pair_t *p = node->data.mapping.pairs.start; p < node->data.mapping.pairs.top; p++) {
        if (p == kind_pair)
            continue;
        yaml_node_t *k = node_at(c, p->key);
        const char *key = NULL;
        st = key_text(c, k, place, &key);
        if (st == AMP_OK)
            st = apply_layer_key(c, l, index, k, key, node_at(c, p->value));
        if (st != AMP_OK)
            return st;
    }
    return AMP_OK;
}

static enum amp_status apply_layers(struct ctx *c, const struct field *f, void *base, yaml_node_t *node)
{
    char hint[1024], shown[96];
    if (node->type != YAML_SEQUENCE_NODE)
        return fail_value(c, node, "model.layers", field_hint(f, "model.layers", -1, hint, sizeof hint),
                          "expected a list of layers, got %s", describe(node, shown, sizeof shown));
    yaml_node_item_t *items = node->data.sequence.items.start;
    ptrdiff_t count = node->data.sequence.items.top - items;
    if (count > CFG_MAX_LAYERS)
        return fail_value(c, node, "model.layers", "split the model or raise CFG_MAX_LAYERS in lib/base/config.h",
                          "%td layers; ampTrain builds at most %d", count, CFG_MAX_LAYERS);
    int n = (int)count;
    struct layer_config *layers = calloc(n > 0 ? (size_t)n : 1, sizeof *layers);
    if (!layers)
        return out_of_memory(c->err);
    for (int i = 0; i < n; i++) {
        yaml_node_t *item = node_at(c, items[i]);
        enum amp_status st = item ? apply_layer(c, &layers[i], i, item, true) : out_of_memory(c->err);
        if (st != AMP_OK) {
            free(layers);
            return st;
        }
    }
    struct layer_config **slot = at(base, f->off);
    free(*slot);
    *slot = layers;
    *(int *)at(base, f->count_off) = n;
    return AMP_OK;
}

/* ---- defaults ------------------------------------------------------------------------------------ */

static void section_defaults(const struct section *s, void *base)
{
    for (size_t i = 0; i < s->nfields; i++) {
        const struct field *f = &s->fields[i];
        switch (f->type) {
        case FT_SECTION: section_defaults(f->sub, at(base, f->off)); break;
        case FT_LAYERS:
            *(struct layer_config **)at(base, f->off) = NULL;
            *(int *)at(base, f->count_off) = 0;
            break;
        case FT_INT: *(int64_t *)at(base, f->off) = (int64_t)f->def; break;
        case FT_U64: *(uint64_t *)at(base, f->off) = (uint64_t)f->def; break;
        case FT_DOUBLE: *(double *)at(base, f->off) = f->def; break;
        case FT_BOOL: *(bool *)at(base, f->off) = f->def != 0; break;
        case FT_STRING: snprintf(at(base, f->off), f->size, "%s", f->def_str ? f->def_str : ""); break;
        case FT_ENUM: set_enum(base, f, (int)f->def); break;
        case FT_PAIR: {
            double v[2] = {f->def, f->def2};
            memcpy(at(base, f->off), v, sizeof v);
            break;
        }
        case FT_STRLIST:
            memset(at(base, f->off), 0, f->size * (size_t)f->max_count);
            *(int *)at(base, f->count_off) = 0;
            break;
        }
    }
}

/* Fill the defaults that depend on other keys, for the keys not written explicitly. */
static void derive_defaults(struct config *cfg)
{
    if (!(cfg->explicit_keys & X_OUT_DIR))
        snprintf(cfg->run.out_dir, sizeof cfg->run.out_dir, "runs/%s", cfg->run.name);
    if (!(cfg->explicit_keys & X_EPOCHS))
        cfg->run.epochs = cfg->run.steps > 0 ? 0 : 1;
    else if (cfg->run.steps == 0 && cfg->run.epochs == 0)
        cfg->run.epochs = 1;
    if (!(cfg->explicit_keys & X_WEIGHT_DECAY))
        cfg->optim.weight_decay = cfg->optim.kind == OPTIM_ADAMW ? 0.01 : 0.0;
    for (int i = 0; i < cfg->model.nlayers; i++) {
        struct layer_config *l = &cfg->model.layers[i];
        if (!(l->explicit_keys & XL_NAME))
            snprintf(l->name, sizeof l->name, "%s_%d", layer_kind_name(l->kind), i);
        if ((l->kind == LAYER_MAXPOOL2D || l->kind == LAYER_AVGPOOL2D) && !(l->explicit_keys & XL_STRIDE))
            l->stride = l->kernel > 0 ? l->kernel : 1;
        if (l->kind == LAYER_EMBEDDING && !(l->explicit_keys & XL_MAX_LEN))
            l->max_len = cfg->data.seq_len;
    }
}

void config_defaults(struct config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    section_defaults(&root_section, cfg);
    snprintf(cfg->precision.fp8.keep_bf16[0], sizeof cfg->precision.fp8.keep_bf16[0], "first");
    snprintf(cfg->precision.fp8.keep_bf16[1], sizeof cfg->precision.fp8.keep_bf16[1], "last");
    cfg->precision.fp8.nkeep_bf16 = 2;
    snprintf(cfg->source, sizeof cfg->source, "<defaults>");
    derive_defaults(cfg);
}

/* ---- checks across keys (finalize) ------------------------------------------------------------- */

/* Where key `path` ("model.layers.3", "run.steps") is in the document: its key's mark, or that of the
 * closest enclosing key found; NULL without a document. */
static const yaml_mark_t *locate(const struct ctx *c, const char *path)
{
    if (!c->doc)
        return NULL;
    yaml_node_t *node = yaml_document_get_root_node(c->doc);
    if (!node)
        return NULL;
    const yaml_mark_t *best = &node->start_mark;
    const char *p = path;
    while (*p && node) {
        size_t len = strcspn(p, ".");
        yaml_node_t *next = NULL;
        if (node->type == YAML_MAPPING_NODE) {
            for (yaml_node_pair_t *q = node->data.mapping.pairs.start; q < node->data.mapping.pairs.top; q++) {
                yaml_node_t *k = node_at(c, q->key);
                if (k && k->type == YAML_SCALAR_NODE && k->data.scalar.length == len && !memcmp(stext(k), p, len)) {
                    best = &k->start_mark;
                    next = node_at(c, q->value);
                    break;
                }
            }
        } else if (node->type == YAML_SEQUENCE_NODE) {
            long i = strtol(p, NULL, 10);
            if (i >= 0 && i < node->data.sequence.items.top - node->data.sequence.items.start) {
                next = node_at(c, node->data.sequence.items.start[i]);
                if (next)
                    best = &next->start_mark;
            }
        }
        if (!next)
            break;
        node = next;
        p += len;
        if (*p == '.')
            p++;
    }
    return best;
}

static enum amp_status fail_key(const struct ctx *c, const char *path, const char *hint, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static enum amp_status fail_key(const struct ctx *c, const char *path, const char *hint, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    enum amp_status st = vfail(c, locate(c, path), NULL, hint, fmt, ap);
    va_end(ap);
    return st;
}

static bool is_loss(enum layer_kind k) { return k == LAYER_CROSS_ENTROPY || k == LAYER_MSE; }

static enum amp_status check_data(const struct ctx *c, const struct data_config *d)
{
    char hint[256];
    if (d->format == DATA_IDX) {
        const char *keys[] = {"train_images", "train_labels", "test_images", "test_labels"};
        const char *vals[] = {d->train_images, d->train_labels, d->test_images, d->test_labels};
        for (int i = 0; i < 4; i++) {
            if (!vals[i][0]) {
                snprintf(hint, sizeof hint, "add data.%s: PATH (an IDX file, gzip or not)", keys[i]);
                return fail_key(c, "data.format", hint, "data.format is idx but data.%s is not set", keys[i]);
            }
        }
    } else if (d->format == DATA_HDF5 && !d->path[0]) {
        return fail_key(c, "data.format", "add data.path: FILE.h5 (datasets data.x_key and data.y_key)",
                        "data.format is hdf5 but data.path is not set");
    } else if (d->format == DATA_TEXT && d->nfiles == 0) {
        return fail_key(c, "data.format", "add data.files: [a.txt, b.txt]", "data.format is text but data.files is empty");
    } else if (d->format == DATA_TOKENS && !d->train_bin[0]) {
        return fail_key(c, "data.format", "add data.train_bin: train.bin (nanoGPT's or llm.c's token file, docs/data.md)",
                        "data.format is tokens but data.train_bin is not set");
    } else if (d->format == DATA_TOKENS && d->vocab == 0) {
        return fail_key(c, "data.format",
                        "add data.vocab: the tokenizer's vocabulary size (50257 for GPT-2's BPE, 256 for the bytes of "
                        "scripts/tools/make_tokens.py); every id must be below it",
                        "data.format is tokens but data.vocab is not set");
    }
    return AMP_OK;
}

static enum amp_status check_model(const struct ctx *c, const struct model_config *m)
{
    char path[64], hint[1024];
    if (m->nlayers == 0)
        return fail_key(c, "model.layers", "list the layers under model.layers, ending with a loss (cross_entropy or mse)",
                        "model.layers is missing or empty");
    for (int i = 0; i < m->nlayers; i++) {
        const struct layer_config *l = &m->layers[i];
        const char *kind = layer_kind_name(l->kind);
        snprintf(path, sizeof path, "model.layers.%d", i);
        snprintf(hint, sizeof hint, "keys of a %s layer: ", kind);
        list_keys(&layer_section, (int)l->kind, hint, sizeof hint);
        for (size_t j = 0; j < layer_section.nfields; j++) {
            const struct field *f = &layer_fields[j];
            if ((f->required & (1u << l->kind)) && get_i64(l, f) <= 0)
                return fail_key(c, path, hint, "layer '%s' (model.layers.%d, %s) needs '%s'", l->name, i, kind, f->key);
        }
        if ((l->kind == LAYER_ATTENTION || l->kind == LAYER_TRANSFORMER_BLOCK) && l->dim > 0 && l->dim % l->heads)
            return fail_key(c, path, "choose heads dividing dim (each head has dim/heads channels)",
                            "layer '%s' (model.layers.%d): dim %" PRId64 " is not divisible by heads %" PRId64, l->name,
                            i, l->dim, l->heads);
        if ((l->kind == LAYER_MAXPOOL2D || l->kind == LAYER_AVGPOOL2D) && 2 * l->padding > l->kernel)
            return fail_key(c, path, "use padding <= kernel/2, as PyTorch requires",
                            "layer '%s' (model.layers.%d): padding %" PRId64 " is more than half the kernel %" PRId64,
                            l->name, i, l->padding, l->kernel);
        if (is_loss(l->kind) && i != m->nlayers - 1)
            return fail_key(c, path, "put the loss (cross_entropy or mse) last, once",
                            "model: layer '%s' (model.layers.%d) is a loss but is not the last layer", l->name, i);
        for (int j = 0; j < i; j++)
            if (!strcmp(m->layers[j].name, l->name))
                return fail_key(c, path, "give each layer its own name (or leave name out for kind_N)",
                                "model: layers %d and %d are both named '%s'", j, i, l->name);
    }
    const struct layer_config *last = &m->layers[m->nlayers - 1];
    if (!is_loss(last->kind)) {
        snprintf(path, sizeof path, "model.layers.%d", m->nlayers - 1);
        return fail_key(c, path, "end model.layers with - kind: cross_entropy (classification) or - kind: mse (regression)",
                        "model: the last layer must be a loss (cross_entropy or mse), but model.layers.%d '%s' is %s",
                        m->nlayers - 1, last->name, layer_kind_name(last->kind));
    }
    struct amp_error names = {0}; /* hf-gpt2 names fit a GPT-2 only: say so at check time, not after the data loads */
    if (m->init_from[0] && weight_names_check(m, m->init_names, "model.init_names", &names) != AMP_OK)
        return fail_key(c, "model.init_names", names.hint, "%s", names.msg);
    return AMP_OK;
}

static enum amp_status check_precision(const struct ctx *c, const struct precision_config *p)
{
    const struct loss_scale_config *s = &p->loss_scale;
    char a[40], b[40], hint[256];
    if (s->min > s->init || s->init > s->max) {
        bool low = s->min > s->init;
        format_double(low ? s->min : s->init, a, sizeof a);
        format_double(low ? s->init : s->max, b, sizeof b);
        snprintf(hint, sizeof hint, "choose 0 < min <= init <= max (defaults 1, 65536, 16777216)");
        return fail_key(c, low ? "precision.loss_scale.min" : "precision.loss_scale.max", hint,
                        "precision.loss_scale: %s (%s) is larger than %s (%s)", low ? "min" : "init", a,
                        low ? "init" : "max", b);
    }
    /* inv = 1/scale in fp32 (lib/base/scaler.h): below fp32's smallest normal number it is Inf, and the update
     * grad * inv would write NaN into every weight; a scale never goes below min, so min bounds it. */
    const double scales[3] = {s->init, s->min, s->value};
    const char *const scale_keys[3] = {"precision.loss_scale.init", "precision.loss_scale.min",
                                       "precision.loss_scale.value"};
    for (int i = 0; i < 3; i++)
        if (scales[i] < FLT_MIN) {
            format_double(scales[i], a, sizeof a);
            return fail_key(c, scale_keys[i], "choose a loss scale of at least 1.1754944e-38 (1 is the usual minimum)",
                            "%s (%s) is below fp32's smallest normal number (1.1754944e-38): 1/scale would be Inf "
                            "in fp32 and every update non-finite", scale_keys[i], a);
        }
    const struct autocast_config *ac = &p->autocast;
    const char(*lists[3])[32] = {ac->lowp_ops, ac->fp32_ops, ac->promote_ops};
    const int counts[3] = {ac->nlowp, ac->nfp32, ac->npromote};
    const char *names[3] = {"lowp_ops", "fp32_ops", "promote_ops"};
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < i; j++)
            for (int x = 0; x < counts[i]; x++)
                for (int y = 0; y < counts[j]; y++)
                    if (!strcmp(lists[i][x], lists[j][y])) {
                        char path[64];
                        snprintf(path, sizeof path, "precision.autocast.%s", names[i]);
                        return fail_key(c, path, "put each op kind in one list only",
                                        "precision.autocast: '%s' is in both %s and %s", lists[i][x], names[j], names[i]);
                    }
    return AMP_OK;
}

/* precision.fp8.keep_bf16 names `first`, `last` or layers whose products could run in fp8. */
static bool has_linear(enum layer_kind k)
{
    return k == LAYER_LINEAR || k == LAYER_ATTENTION || k == LAYER_TRANSFORMER_BLOCK;
}

static enum amp_status check_keep_bf16(const struct ctx *c, const struct config *cfg)
{
    const struct fp8_config *f = &cfg->precision.fp8;
    const struct model_config *m = &cfg->model;
    for (int i = 0; i < f->nkeep_bf16; i++) {
        const char *name = f->keep_bf16[i];
        if (!strcmp(name, "first") || !strcmp(name, "last"))
            continue;
        int found = -1;
        for (int j = 0; j < m->nlayers && found < 0; j++)
            if (!strcmp(m->layers[j].name, name))
                found = j;
        if (found >= 0 && has_linear(m->layers[found].kind))
            continue;
        char hint[512] = "name `first`, `last`, or layers with matrix products:";
        for (int j = 0; j < m->nlayers; j++)
            if (has_linear(m->layers[j].kind) && strlen(hint) + strlen(m->layers[j].name) + 3 < sizeof hint) {
                strcat(hint, " ");
                strcat(hint, m->layers[j].name);
            }
        return fail_key(c, "precision.fp8.keep_bf16", hint, "precision.fp8.keep_bf16: %s '%s'",
                        found < 0 ? "no layer is named" : "there is no matrix product to keep in layer", name);
    }
    return AMP_OK;
}

/* run.keep_best and run.early_stop.metric watch a figure the run's evaluation measures: accuracy for a
 * classifier (idx, hdf5 with cross_entropy), perplexity for text and tokens, loss always; and there must be
 * held-out data to evaluate on. */
static enum amp_status check_metric(const struct ctx *c, const struct config *cfg, const char *key,
                                    enum eval_metric metric)
{
    if (metric == METRIC_NONE)
        return AMP_OK;
    const struct data_config *d = &cfg->data;
    bool text = d->format == DATA_TEXT || d->format == DATA_TOKENS;
    const struct model_config *m = &cfg->model;
    bool xent = m->nlayers > 0 && m->layers[m->nlayers - 1].kind == LAYER_CROSS_ENTROPY;
    const char *why = NULL;
    if (metric == METRIC_ACCURACY && text)
        why = "accuracy is not measured for text and tokens data (their evaluation gives loss and perplexity)";
    else if (metric == METRIC_ACCURACY && !xent)
        why = "accuracy is measured only with a cross_entropy loss layer";
    else if (metric == METRIC_PERPLEXITY && !text)
        why = "perplexity is measured only for text and tokens data";
    if (why)
        return fail_key(c, key, text ? "watch loss or perplexity" : xent ? "watch loss or accuracy" : "watch loss",
                        "%s is %s, but %s", key, eval_metric_name(metric), why);
    if ((d->format == DATA_TOKENS && !d->val_bin[0]) ||
        ((d->format == DATA_HDF5 || d->format == DATA_TEXT) && d->val_fraction == 0))
        return fail_key(c, key,
                        d->format == DATA_TOKENS ? "set data.val_bin to a token file to evaluate on"
                                                 : "set data.val_fraction above 0 to hold out data to evaluate on",
                        "%s: %s watches the evaluation, but the run has no held-out data to evaluate on", key,
                        eval_metric_name(metric));
    return AMP_OK;
}

static enum amp_status check_watches(const struct ctx *c, const struct config *cfg)
{
    const struct early_stop_config *es = &cfg->run.early_stop;
    enum amp_status st = check_metric(c, cfg, "run.keep_best", cfg->run.keep_best);
    if (st == AMP_OK)
        st = check_metric(c, cfg, "run.early_stop.metric", es->metric);
    if (st != AMP_OK)
        return st;
    if (es->metric != METRIC_NONE && es->patience == 0)
        return fail_key(c, "run.early_stop.metric", "set run.early_stop.patience: the evaluations without improvement "
                        "that end the run (e.g. 3)", "run.early_stop.metric is %s but run.early_stop.patience is not set",
                        eval_metric_name(es->metric));
    if (es->metric == METRIC_NONE && (es->patience > 0 || es->min_delta > 0))
        return fail_key(c, es->patience > 0 ? "run.early_stop.patience" : "run.early_stop.min_delta",
                        "set run.early_stop.metric (loss, accuracy or perplexity), or remove run.early_stop",
                        "run.early_stop.%s is set but run.early_stop.metric is not: nothing is watched",
                        es->patience > 0 ? "patience" : "min_delta");
    return AMP_OK;
}

static enum amp_status finalize(struct ctx *c, struct config *cfg)
{
    enum amp_status st;
    if (cfg->run.steps > 0 && cfg->run.epochs > 0 && (cfg->explicit_keys & X_EPOCHS))
        return fail_key(c, "run.steps", "set only one: run.epochs=0 to train for run.steps optimizer steps, or run.steps=0",
                        "run.steps (%" PRId64 ") and run.epochs (%" PRId64 ") are both set", cfg->run.steps,
                        cfg->run.epochs);
    derive_defaults(cfg);
    if ((st = check_data(c, &cfg->data)) != AMP_OK || (st = check_model(c, &cfg->model)) != AMP_OK)
        return st;
    if (cfg->optim.nesterov && cfg->optim.momentum <= 0)
        return fail_key(c, "optim.nesterov", "set optim.momentum > 0 (e.g. 0.9) or nesterov: false",
                        "optim.nesterov needs optim.momentum > 0 (momentum is %g)", cfg->optim.momentum);
    const struct schedule_config *sc = &cfg->optim.schedule;
    bool decays = sc->kind == SCHED_COSINE || sc->kind == SCHED_LINEAR || sc->kind == SCHED_WSD;
    if (decays && sc->decay_steps > 0 && sc->decay_steps <= sc->warmup_steps)
        return fail_key(c, "optim.schedule.decay_steps", "choose decay_steps beyond warmup_steps (0: run.steps)",
                        "optim.schedule.decay_steps (%lld) ends the decay before the warmup (%lld steps) ends",
                        (long long)sc->decay_steps, (long long)sc->warmup_steps);
    if (decays && cfg->optim.schedule.min_lr > cfg->optim.lr)
        return fail_key(c, "optim.schedule.min_lr", "choose min_lr <= lr",
                        "optim.schedule.min_lr (%g) is larger than optim.lr (%g)", cfg->optim.schedule.min_lr,
                        cfg->optim.lr);
    if (cfg->precision.master_weights == STORE_BF16 && cfg->precision.mode != PREC_BF16)
        return fail_key(c, "precision.master_weights",
                        "set precision.mode: bf16 (the weights are then their own bf16 copy), or master_weights: fp32",
                        "precision.master_weights: bf16 needs precision.mode: bf16 (mode is %s)",
                        precision_mode_name(cfg->precision.mode));
    if (cfg->optim.stochastic_rounding && cfg->precision.master_weights == STORE_FP32 &&
        cfg->optim.state_dtype == STORE_FP32)
        return fail_key(c, "optim.stochastic_rounding",
                        "set precision.master_weights: bf16 and/or optim.state_dtype: bf16, or stochastic_rounding: false",
                        "optim.stochastic_rounding rounds bf16 stores, but the weights and the optimizer state are fp32 "
                        "(nothing to round)");
    if ((st = check_keep_bf16(c, cfg)) != AMP_OK || (st = check_watches(c, cfg)) != AMP_OK)
        return st;
    return check_precision(c, &cfg->precision);
}

/* One path made absolute against `cwd`; a leading "./" is dropped. */
static enum amp_status resolve_path(char *path, const char *key, const char *cwd, struct amp_error *err)
{
    if (!path[0] || path[0] == '/')
        return AMP_OK;
    const char *rel = path;
    while (rel[0] == '.' && rel[1] == '/') {
        rel += 2;
        while (*rel == '/')
            rel++;
    }
    char abs[2 * CFG_STR + 8];
    int n = snprintf(abs, sizeof abs, "%s%s%s", cwd, strcmp(cwd, "/") == 0 ? "" : "/", rel);
    if (n < 0 || n >= CFG_STR)
        return amp_fail(err, AMP_ERR_CONFIG, "give the path from a shorter directory, or move the data closer to /",
                        "%s: '%s' is %d bytes long from %s; a path holds at most %d", key, path, n, cwd, CFG_STR - 1);
    memcpy(path, abs, (size_t)n + 1);
    return AMP_OK;
}

enum amp_status config_resolve_paths(struct config *cfg, struct amp_error *err)
{
    char cwd[4096];
    if (!getcwd(cwd, sizeof cwd))
        return amp_fail(err, AMP_ERR_INTERNAL, "run from a directory that exists and can be read",
                        "cannot read the current directory to resolve relative paths: %s", strerror(errno));
    struct data_config *d = &cfg->data;
    struct {
        char *path;
        const char *key;
    } paths[] = {
        {d->train_images, "data.train_images"}, {d->train_labels, "data.train_labels"},
        {d->test_images, "data.test_images"},   {d->test_labels, "data.test_labels"},
        {d->path, "data.path"},                 {d->train_bin, "data.train_bin"},
        {d->val_bin, "data.val_bin"},           {d->tokenizer, "data.tokenizer"},
    };
    enum amp_status st = AMP_OK;
    for (size_t i = 0; i < ARRAY_LEN(paths) && st == AMP_OK; i++)
        st = resolve_path(paths[i].path, paths[i].key, cwd, err);
    for (int i = 0; i < d->nfiles && st == AMP_OK; i++) {
        char key[32];
        snprintf(key, sizeof key, "data.files.%d", i);
        st = resolve_path(d->files[i], key, cwd, err);
    }
    return st;
}

enum amp_status config_finalize(struct config *cfg, struct amp_error *err)
{
    struct ctx c = {.file = cfg->source, .explicit_keys = &cfg->explicit_keys, .err = err};
    return finalize(&c, cfg);
}

/* ---- reading documents ------------------------------------------------------------------------- */

/* YAML forbids tabs in indentation; we reject every tab, found in the raw text before parsing. */
static enum amp_status check_tabs(const struct ctx *c, const char *text, size_t len)
{
    size_t line = 1, col = 1;
    for (size_t i = 0; i < len; i++) {
        unsigned char ch = (unsigned char)text[i];
        /* a control byte YAML never holds: a binary file (a checkpoint, an image, a tensor file), not a config */
        if (ch < 0x20 && ch != '\t' && ch != '\n' && ch != '\r')
            return amp_fail(c->err, AMP_ERR_CONFIG, "give the YAML config file (configs/ has examples)",
                            "%s is not a YAML text file: byte %zu is 0x%02x, a binary file's", c->file, i, ch);
        if (ch == '\t') {
            yaml_mark_t m = {.index = i, .line = line - 1, .column = col - 1};
            return fail_at(c, &m, "YAML forbids tabs for indentation; use spaces", "tab character (YAML forbids tabs)");
        }
        if (ch == '\n') {
            line++;
            col = 1;
        } else if ((ch & 0xC0) != 0x80) {
            col++; /* columns count characters, as libyaml's marks do */
        }
    }
    return AMP_OK;
}

static void offset_mark(const char *text, size_t len, size_t offset, yaml_mark_t *m)
{
    memset(m, 0, sizeof *m);
    for (size_t i = 0; i < offset && i < len; i++) {
        if (text[i] == '\n') {
            m->line++;
            m->column = 0;
        } else if (((unsigned char)text[i] & 0xC0) != 0x80) {
            m->column++;
        }
    }
}

static enum amp_status syntax_error(const struct ctx *c, const yaml_parser_t *p, const char *text, size_t len)
{
    char hint[256] = "check the brackets, quotes, colons and indentation at this position";
    const char *problem = p->problem ? p->problem : "unknown problem";
    if (p->error == YAML_MEMORY_ERROR)
        return out_of_memory(c->err);
    if (strstr(problem, "',' or ']'"))
        snprintf(hint, sizeof hint, "a '[' is not closed: add the missing ']' (or the missing ',' between items)");
    else if (strstr(problem, "',' or '}'"))
        snprintf(hint, sizeof hint, "a '{' is not closed: add the missing '}' (or the missing ',' between entries)");
    if (c->override)
        return amp_fail(c->err, AMP_ERR_CONFIG, "quote the value or check its brackets, e.g. data.files=[a.txt, b.txt]",
                        "override '%s': cannot read the value as YAML: %s", c->override, problem);
    if (p->error == YAML_READER_ERROR) {
        yaml_mark_t m;
        offset_mark(text, len, p->problem_offset, &m);
        return fail_at(c, &m, "save the file as UTF-8 text without control characters", "cannot read the text: %s",
                       problem);
    }
    yaml_mark_t at_mark = p->problem_mark;
    if (at_mark.index >= len) /* at the end of the input: point at its last character, not past it */
        offset_mark(text, len, len > 0 && text[len - 1] == '\n' ? len - 1 : len, &at_mark);
    if (p->context)
        return fail_at(c, &at_mark, hint, "YAML syntax error: %s (%s at line %zu, column %zu)", problem,
                       p->context, p->context_mark.line + 1, p->context_mark.column + 1);
    return fail_at(c, &at_mark, hint, "YAML syntax error: %s", problem);
}

/* Parse exactly one YAML document from text into *doc. *empty: the text holds no document. */
/* libyaml's scanner does work proportional to the flow nesting depth on every token, so deep nesting is
 * quadratic (8 s for 40000 levels). A first pass over the events refuses more than CFG_MAX_DEPTH levels
 * before the document is built; it stops within a few tokens of the limit, so it is linear. A syntax
 * error ends the pass quietly: the load that follows reports it. */
static enum amp_status check_depth(const struct ctx *c, const char *text, size_t len)
{
    yaml_parser_t parser;
    if (!yaml_parser_initialize(&parser))
        return out_of_memory(c->err);
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
    enum amp_status st = AMP_OK;
    int depth = 0;
    for (bool done = false; !done && st == AMP_OK;) {
        yaml_event_t e;
        if (!yaml_parser_parse(&parser, &e))
            break;
        if (e.type == YAML_SEQUENCE_START_EVENT || e.type == YAML_MAPPING_START_EVENT)
            depth++;
        else if (e.type == YAML_SEQUENCE_END_EVENT || e.type == YAML_MAPPING_END_EVENT)
            depth--;
        done = e.type == YAML_STREAM_END_EVENT;
        if (depth > CFG_MAX_DEPTH)
            st = fail_at(c, &e.start_mark, "a config nests at most 4 levels (model: layers: - kind: ...)",
                         "the YAML nests more than %d lists or mappings deep here", CFG_MAX_DEPTH);
        yaml_event_delete(&e);
    }
    yaml_parser_delete(&parser);
    return st;
}

static enum amp_status load_document(const struct ctx *c, const char *text, size_t len, yaml_document_t *doc,
                                     bool *empty)
{
    enum amp_status st = check_depth(c, text, len);
    if (st != AMP_OK)
        return st;
    yaml_parser_t parser;
    if (!yaml_parser_initialize(&parser))
        return out_of_memory(c->err);
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
    if (!yaml_parser_load(&parser, doc)) {
        st = syntax_error(c, &parser, text, len);
        yaml_parser_delete(&parser);
        return st;
    }
    *empty = yaml_document_get_root_node(doc) == NULL;
    if (!*empty) {
        yaml_document_t next;
        if (!yaml_parser_load(&parser, &next)) {
            st = syntax_error(c, &parser, text, len);
        } else {
            yaml_node_t *root = yaml_document_get_root_node(&next);
            if (root)
                st = fail_at(c, &root->start_mark, "keep the whole config in one YAML document (remove the '---')",
                             "a second YAML document starts here");
            yaml_document_delete(&next);
        }
        if (st != AMP_OK)
            yaml_document_delete(doc);
    } else {
        yaml_document_delete(doc);
    }
    yaml_parser_delete(&parser);
    return st;
}

enum amp_status config_parse_string(struct config *cfg, const char *yaml, size_t len, const char *name,
                                    struct amp_error *err)
{
    config_defaults(cfg);
    name = name ? name : "<string>";
    snprintf(cfg->source, sizeof cfg->source, "%s", name);
    struct ctx c = {.file = name, .explicit_keys = &cfg->explicit_keys, .err = err, .text = yaml, .len = len};
    if (!yaml && len)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "%s: no text to parse", name);
    enum amp_status st = check_tabs(&c, yaml ? yaml : "", len);
    if (st != AMP_OK)
        return st;
    yaml_document_t doc;
    bool empty = true;
    st = load_document(&c, yaml ? yaml : "", len, &doc, &empty);
    if (st != AMP_OK)
        return st;
    if (empty)
        return amp_fail(err, AMP_ERR_CONFIG, "start from one of the configs in configs/, e.g. configs/fashion_mlp.yaml",
                        "%s:1:1: the config is empty (no YAML document, only comments or blank lines)", name);
    c.doc = &doc;
    yaml_node_t *root = yaml_document_get_root_node(&doc);
    if (is_null(root)) /* "---" or "~" alone */
        st = fail_at(&c, &root->start_mark, "start from one of the configs in configs/, e.g. configs/fashion_mlp.yaml",
                     "the config is empty");
    else
        st = apply_section(&c, &root_section, cfg, root);
    if (st == AMP_OK)
        st = finalize(&c, cfg);
    yaml_document_delete(&doc);
    if (st != AMP_OK)
        config_free(cfg);
    return st;
}

enum amp_status config_load(struct config *cfg, const char *path, struct amp_error *err)
{
    config_defaults(cfg);
    struct stat sb;
    if (stat(path, &sb) == 0 && !S_ISREG(sb.st_mode)) /* a FIFO or device would block or never end */
        return amp_fail(err, AMP_ERR_CONFIG, "give the path of a YAML file", "%s: not a regular file", path);
    FILE *f = fopen(path, "rb");
    if (!f)
        return amp_fail(err, AMP_ERR_CONFIG, "check the path; configs/ holds ready-made configs",
                        "%s: cannot open the config file: %s", path, strerror(errno));
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    enum amp_status st = buf ? AMP_OK : out_of_memory(err);
    while (st == AMP_OK) {
        if (len == cap) {
            char *bigger = cap < MAX_CONFIG_BYTES ? realloc(buf, cap * 2) : NULL;
            if (!bigger) {
                st = cap < MAX_CONFIG_BYTES ? out_of_memory(err)
                                            : amp_fail(err, AMP_ERR_CONFIG, "is this the right file?",
                                                       "%s: larger than %zu bytes; not a config", path, MAX_CONFIG_BYTES);
                break;
            }
            buf = bigger;
            cap *= 2;
        }
        size_t got = fread(buf + len, 1, cap - len, f);
        len += got;
        if (got == 0) {
            if (ferror(f))
                st = amp_fail(err, AMP_ERR_CONFIG, "check that the path is a readable file",
                              "%s: cannot read the config file: %s", path, strerror(errno));
            break;
        }
    }
    fclose(f);
    if (st == AMP_OK)
        st = config_parse_string(cfg, buf, len, path, err);
    free(buf);
    return st;
}

/* ---- overrides --------------------------------------------------------------------------------- */

/* Resolve KEY through the tables and apply the value node; `work` is a scratch copy of the config. */
static enum amp_status apply_override_path(struct ctx *c, struct config *work, const char *key, yaml_node_t *value)
{
    const struct section *s = &root_section;
    void *base = work;
    char path[256] = "", comp[128];
    const char *p = key;
    for (;;) {
        size_t len = strcspn(p, ".");
        if (len == 0 || len >= sizeof comp)
            return amp_fail(c->err, AMP_ERR_CONFIG, "write the key as dotted names, e.g. optim.lr=3e-4",
                            "override '%s': '%s' is not a valid key", c->override, key);
        memcpy(comp, p, len);
        comp[len] = '\0';
        p += len;
        const struct field *f = find_field(s, comp);
        if (!f)
            return unknown_key(c, NULL, s, comp);
        join_path(path, sizeof path, s->path, comp);
        if (!*p)
            return apply_field(c, f, base, value, path);
        p++; /* the '.' */
        if (f->type == FT_SECTION) {
            s = f->sub;
            base = at(base, f->off);
            continue;
        }
        if (f->type != FT_LAYERS)
            return amp_fail(c->err, AMP_ERR_CONFIG, "write the key as dotted names, e.g. optim.lr=3e-4",
                            "override '%s': %s is a value, not a section; it has no key '%s'", c->override, path, p);
        /* model.layers.N[.key] */
        size_t ilen = strcspn(p, ".");
        char *end = NULL;
        long index = strtol(p, &end, 10);
        int n = *(int *)at(base, f->count_off);
        if (ilen == 0 || strspn(p, "0123456789") != ilen || end != p + ilen)
            return amp_fail(c->err, AMP_ERR_CONFIG, "address a layer by its index, e.g. model.layers.0.out=256",
                            "override '%s': '%.*s' is not a layer index", c->override, (int)ilen, p);
        if (index >= n)
            return amp_fail(c->err, AMP_ERR_CONFIG, "layer indices start at 0",
                            "override '%s': model.layers has %d layers (indices 0 to %d), no layer %ld", c->override, n,
                            n - 1, index);
        struct layer_config *l = &(*(struct layer_config **)at(base, f->off))[index];
        p += ilen;
        if (!*p)
            return apply_layer(c, l, (int)index, value, false);
        p++;
        if (strchr(p, '.') || !*p)
            return amp_fail(c->err, AMP_ERR_CONFIG, "write model.layers.N.KEY=VALUE, e.g. model.layers.0.out=256",
                            "override '%s': layer keys have no sub-keys", c->override);
        yaml_mark_t none = {0};
        return apply_layer_key(c, l, (int)index, &(yaml_node_t){.start_mark = none}, p, value);
    }
}

/* run.steps and run.epochs are alternatives. An override of one (> 0) replaces the choice the file made,
 * so `run.steps=100` works on a config that trains for epochs; overriding both is still an error. */
static void choose_steps_or_epochs(struct config *cfg, const char *key)
{
    if (!strcmp(key, "run.steps") && cfg->run.steps > 0) {
        cfg->explicit_keys |= X_STEPS_OVERRIDDEN;
        if (!(cfg->explicit_keys & X_EPOCHS_OVERRIDDEN))
            cfg->explicit_keys &= ~(unsigned)X_EPOCHS; /* finalize derives epochs = 0 */
    } else if (!strcmp(key, "run.epochs") && cfg->run.epochs > 0) {
        cfg->explicit_keys |= X_EPOCHS_OVERRIDDEN;
        if (!(cfg->explicit_keys & X_STEPS_OVERRIDDEN))
            cfg->run.steps = 0;
    }
}

enum amp_status config_apply_override(struct config *cfg, const char *override, struct amp_error *err)
{
    const char *eq = strchr(override, '=');
    if (!eq)
        return amp_fail(err, AMP_ERR_CONFIG, "write KEY=VALUE, e.g. optim.lr=3e-4 or precision.mode=bf16",
                        "override '%s' has no '=': write KEY=VALUE", override);
    size_t klen = (size_t)(eq - override);
    if (klen == 0 || klen >= 256)
        return amp_fail(err, AMP_ERR_CONFIG, "write KEY=VALUE, e.g. optim.lr=3e-4",
                        "override '%s': %s", override, klen ? "the key is too long" : "no key before '='");
    char key[256];
    memcpy(key, override, klen);
    key[klen] = '\0';
    const char *value = eq + 1;

    struct ctx c = {.file = cfg->source, .override = override, .override_key = key, .err = err, .text = value,
                    .len = strlen(value)};
    yaml_document_t doc;
    bool empty = true;
    enum amp_status st = load_document(&c, value, strlen(value), &doc, &empty);
    if (st != AMP_OK)
        return st;
    if (empty)
        return amp_fail(err, AMP_ERR_CONFIG, "write a value after '=', e.g. optim.lr=3e-4",
                        "override '%s': missing value after '='", override);
    c.doc = &doc;

    /* Work on a copy so that a failed override leaves `cfg` as it was. */
    struct config *work = malloc(sizeof *work);
    if (!work) {
        yaml_document_delete(&doc);
        return out_of_memory(err);
    }
    st = config_copy(work, cfg, err);
    if (st == AMP_OK) {
        c.explicit_keys = &work->explicit_keys;
        st = apply_override_path(&c, work, key, yaml_document_get_root_node(&doc));
        if (st == AMP_OK)
            choose_steps_or_epochs(work, key);
        if (st == AMP_OK) {
            config_free(cfg);
            *cfg = *work;
        } else {
            config_free(work);
        }
    }
    free(work);
    yaml_document_delete(&doc);
    return st;
}

/* ---- printing ---------------------------------------------------------------------------------- */

struct sink {
    FILE *file;      /* print here, or */
    char *buf;       /* into this growing buffer */
    size_t len, cap;
    bool failed;     /* out of memory */
};

static void put(struct sink *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(struct sink *o, const char *fmt, ...)
{
    va_list ap;
    if (o->failed)
        return;
    if (o->file) {
        va_start(ap, fmt);
        vfprintf(o->file, fmt, ap);
        va_end(ap);
        return;
    }
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) {
        o->failed = true;
        return;
    }
    if (o->len + (size_t)n + 1 > o->cap) {
        size_t cap = o->cap ? o->cap : 1024;
        while (cap < o->len + (size_t)n + 1)
            cap *= 2;
        char *bigger = realloc(o->buf, cap);
        if (!bigger) {
            o->failed = true;
            return;
        }
        o->buf = bigger;
        o->cap = cap;
    }
    va_start(ap, fmt);
    vsnprintf(o->buf + o->len, o->cap - o->len, fmt, ap);
    va_end(ap);
    o->len += (size_t)n;
}

/* Decode one UTF-8 sequence at s; returns its length (1 for a stray byte, *cp = the byte | 0x110000). */
static size_t utf8_decode(const unsigned char *s, uint32_t *cp)
{
    size_t n = s[0] < 0x80 ? 1 : (s[0] & 0xE0) == 0xC0 ? 2 : (s[0] & 0xF0) == 0xE0 ? 3 : (s[0] & 0xF8) == 0xF0 ? 4 : 0;
    if (n == 0) {
        *cp = 0x110000u | s[0];
        return 1;
    }
    uint32_t v = n == 1 ? s[0] : s[0] & (0x7Fu >> n);
    for (size_t i = 1; i < n; i++) {
        if ((s[i] & 0xC0) != 0x80) {
            *cp = 0x110000u | s[0];
            return 1;
        }
        v = (v << 6) | (s[i] & 0x3Fu);
    }
    *cp = v;
    return n;
}

/* A double-quoted YAML string that libyaml reads back byte for byte: escapes for quotes, backslashes,
 * control characters, line breaks (NEL, LS, PS) and the code points libyaml's reader refuses. */
static void put_quoted(struct sink *o, const char *s)
{
    put(o, "\"");
    const unsigned char *p = (const unsigned char *)s;
    while (*p) {
        uint32_t cp;
        size_t n = utf8_decode(p, &cp);
        if (cp == '"' || cp == '\\')
            put(o, "\\%c", (char)cp);
        else if (cp < 0x20 || cp == 0x7F || (cp >= 0x80 && cp < 0xA0))
            put(o, "\\x%02X", (unsigned)cp);
        else if (cp == 0x2028 || cp == 0x2029 || cp == 0xFEFF || cp == 0xFFFE || cp == 0xFFFF)
            put(o, "\\u%04X", (unsigned)cp);
        else if (cp > 0x10FFFF)
            put(o, "\\x%02X", (unsigned)(cp & 0xFF)); /* not UTF-8: cannot occur in a string read by libyaml */
        else
            put(o, "%.*s", (int)n, (const char *)p);
        p += n;
    }
    put(o, "\"");
}

static void put_double(struct sink *o, double v)
{
    char buf[40];
    format_double(v, buf, sizeof buf);
    put(o, "%s", buf);
}

static void print_value(struct sink *o, const struct field *f, const void *base)
{
    switch (f->type) {
    case FT_INT: put(o, "%" PRId64, get_i64(base, f)); break;
    case FT_U64: put(o, "%" PRIu64, *(const uint64_t *)cat(base, f->off)); break;
    case FT_DOUBLE: put_double(o, *(const double *)cat(base, f->off)); break;
    case FT_BOOL: put(o, "%s", *(const bool *)cat(base, f->off) ? "true" : "false"); break;
    case FT_STRING: put_quoted(o, cat(base, f->off)); break;
    case FT_ENUM: put(o, "%s", name_or(f->names, count_names(f->names) + 1, get_enum(base, f))); break;
    case FT_PAIR: {
        const double *v = cat(base, f->off);
        put(o, "[");
        put_double(o, v[0]);
        put(o, ", ");
        put_double(o, v[1]);
        put(o, "]");
        break;
    }
    case FT_STRLIST: {
        int n = get_count(base, f);
        put(o, "[");
        for (int i = 0; i < n; i++) {
            put(o, "%s", i ? ", " : "");
            put_quoted(o, (const char *)cat(base, f->off) + (size_t)i * f->size);
        }
        put(o, "]");
        break;
    }
    default: break;
    }
}

static void print_section(struct sink *o, const struct section *s, const void *base, int indent)
{
    for (size_t i = 0; i < s->nfields; i++) {
        const struct field *f = &s->fields[i];
        if (f->type == FT_SECTION) {
            put(o, "%*s%s:\n", indent, "", f->key);
            print_section(o, f->sub, cat(base, f->off), indent + 2);
        } else if (f->type == FT_LAYERS) {
            int n = get_count(base, f);
            const struct layer_config *layers = *(struct layer_config *const *)cat(base, f->off);
            put(o, "%*s%s:%s\n", indent, "", f->key, n ? "" : " []");
            for (int l = 0; l < n; l++) {
                put(o, "%*s- kind: %s\n", indent + 2, "", layer_kind_name(layers[l].kind));
                for (size_t j = 1; j < layer_section.nfields; j++) {
                    const struct field *lf = &layer_fields[j];
                    if (!(lf->kinds & (1u << layers[l].kind)))
                        continue;
                    put(o, "%*s%s: ", indent + 4, "", lf->key);
                    print_value(o, lf, &layers[l]);
                    put(o, "\n");
                }
            }
        } else {
            put(o, "%*s%s: ", indent, "", f->key);
            print_value(o, f, base);
            put(o, "\n");
        }
    }
}

void config_print_yaml(const struct config *cfg, FILE *out)
{
    struct sink o = {.file = out};
    print_section(&o, &root_section, cfg, 0);
}

char *config_to_yaml_string(const struct config *cfg)
{
    struct sink o = {0};
    print_section(&o, &root_section, cfg, 0);
    if (o.failed || !o.buf) {
        free(o.buf);
        return NULL;
    }
    return o.buf;
}

/* ---- equality, copy, free ---------------------------------------------------------------------- */

static bool section_equal(const struct section *s, const void *a, const void *b, int kind);

static bool field_equal(const struct field *f, const void *a, const void *b)
{
    switch (f->type) {
    case FT_SECTION: return section_equal(f->sub, cat(a, f->off), cat(b, f->off), -1);
    case FT_LAYERS: {
        int n = get_count(a, f);
        if (n != get_count(b, f))
            return false;
        const struct layer_config *la = *(struct layer_config *const *)cat(a, f->off);
        const struct layer_config *lb = *(struct layer_config *const *)cat(b, f->off);
        for (int i = 0; i < n; i++)
            if (la[i].kind != lb[i].kind || !section_equal(&layer_section, &la[i], &lb[i], (int)la[i].kind))
                return false;
        return true;
    }
    case FT_INT: return get_i64(a, f) == get_i64(b, f);
    case FT_U64: return *(const uint64_t *)cat(a, f->off) == *(const uint64_t *)cat(b, f->off);
    case FT_DOUBLE: return *(const double *)cat(a, f->off) == *(const double *)cat(b, f->off);
    case FT_BOOL: return *(const bool *)cat(a, f->off) == *(const bool *)cat(b, f->off);
    case FT_STRING: return !strcmp(cat(a, f->off), cat(b, f->off));
    case FT_ENUM: return get_enum(a, f) == get_enum(b, f);
    case FT_PAIR: {
        const double *x = cat(a, f->off), *y = cat(b, f->off);
        return x[0] == y[0] && x[1] == y[1];
    }
    case FT_STRLIST: {
        int n = get_count(a, f);
        if (n != get_count(b, f))
            return false;
        for (int i = 0; i < n; i++)
            if (strcmp((const char *)cat(a, f->off) + (size_t)i * f->size, (const char *)cat(b, f->off) + (size_t)i * f->size))
                return false;
        return true;
    }
    }
    return false;
}

/* kind >= 0: a layer; only the keys of that kind count. */
static bool section_equal(const struct section *s, const void *a, const void *b, int kind)
{
    for (size_t i = 0; i < s->nfields; i++)
        if ((kind < 0 || (s->fields[i].kinds & (1u << kind))) && !field_equal(&s->fields[i], a, b))
            return false;
    return true;
}

/* config_diff's walk: the dotted key so far, and where to report. */
struct diff_walk {
    config_diff_fn fn;
    void *user;
    int n;
    bool stopped, failed;
};

static char *value_text(const struct field *f, const void *base)
{
    struct sink o = {0};
    print_value(&o, f, base);
    if (o.failed) {
        free(o.buf);
        return NULL;
    }
    return o.buf ? o.buf : calloc(1, 1);
}

static void diff_report(struct diff_walk *w, const char *key, const char *va, const char *vb)
{
    w->n++;
    w->stopped = !w->fn(key, va, vb, w->user);
}

static void diff_section(struct diff_walk *w, const struct section *s, const char *prefix, const void *a,
                         const void *b, int kind);

static void diff_layers(struct diff_walk *w, const struct field *f, const char *key, const void *a, const void *b)
{
    int na = get_count(a, f), nb = get_count(b, f);
    if (na != nb) {
        char va[32], vb[32];
        snprintf(va, sizeof va, "%d layers", na);
        snprintf(vb, sizeof vb, "%d layers", nb);
        diff_report(w, key, va, vb);
        return;
    }
    const struct layer_config *la = *(struct layer_config *const *)cat(a, f->off);
    const struct layer_config *lb = *(struct layer_config *const *)cat(b, f->off);
    for (int i = 0; i < na && !w->stopped && !w->failed; i++) {
        char lkey[256];
        if (snprintf(lkey, sizeof lkey, "%s.%d", key, i) >= (int)sizeof lkey) {
            w->failed = true; /* keys are short: the table's names and a layer index */
            break;
        }
        /* another kind: its keys are another set, so the kind is the difference */
        diff_section(w, &layer_section, lkey, &la[i], &lb[i], la[i].kind == lb[i].kind ? (int)la[i].kind : -2);
    }
}

/* kind >= 0: a layer, only its kind's keys; -2: layers of two kinds, only `kind` itself. */
static void diff_section(struct diff_walk *w, const struct section *s, const char *prefix, const void *a,
                         const void *b, int kind)
{
    for (size_t i = 0; i < s->nfields && !w->stopped && !w->failed; i++) {
        const struct field *f = &s->fields[i];
        if ((kind >= 0 && !(f->kinds & (1u << kind))) || (kind == -2 && i > 0))
            continue;
        char key[256];
        if (snprintf(key, sizeof key, "%s%s%s", prefix, prefix[0] ? "." : "", f->key) >= (int)sizeof key) {
            w->failed = true;
            break;
        }
        if (f->type == FT_SECTION) {
            diff_section(w, f->sub, key, cat(a, f->off), cat(b, f->off), -1);
        } else if (f->type == FT_LAYERS) {
            diff_layers(w, f, key, a, b);
        } else if (!field_equal(f, a, b)) {
            char *va = value_text(f, a), *vb = value_text(f, b);
            if (va && vb)
                diff_report(w, key, va, vb);
            else
                w->failed = true;
            free(va);
            free(vb);
        }
    }
}

int config_diff(const struct config *a, const struct config *b, config_diff_fn fn, void *user)
{
    struct diff_walk w = {.fn = fn, .user = user};
    diff_section(&w, &root_section, "", a, b, -1);
    return w.failed ? -1 : w.n;
}

bool config_equal(const struct config *a, const struct config *b)
{
    return section_equal(&root_section, a, b, -1);
}

enum amp_status config_copy(struct config *dst, const struct config *src, struct amp_error *err)
{
    *dst = *src;
    dst->model.layers = NULL;
    dst->model.nlayers = 0;
    if (src->model.nlayers > 0) {
        size_t bytes = (size_t)src->model.nlayers * sizeof *src->model.layers;
        dst->model.layers = malloc(bytes);
        if (!dst->model.layers)
            return amp_fail(err, AMP_ERR_INTERNAL, "free some memory and try again", "out of memory copying the config");
        memcpy(dst->model.layers, src->model.layers, bytes);
        dst->model.nlayers = src->model.nlayers;
    }
    return AMP_OK;
}

void config_free(struct config *cfg)
{
    if (!cfg)
        return;
    free(cfg->model.layers);
    cfg->model.layers = NULL;
    cfg->model.nlayers = 0;
}

/* ---- warnings ---------------------------------------------------------------------------------- */

int config_print_warnings(const struct config *cfg, FILE *out)
{
    struct config d;
    config_defaults(&d);
    const struct loss_scale_config *ls = &cfg->precision.loss_scale, *dl = &d.precision.loss_scale;
    bool dynamic_keys = ls->init != dl->init || ls->growth_factor != dl->growth_factor ||
                        ls->backoff_factor != dl->backoff_factor || ls->growth_interval != dl->growth_interval ||
                        ls->hysteresis != dl->hysteresis || ls->min != dl->min || ls->max != dl->max;
    bool static_key = ls->value != dl->value;
    const char *mode = precision_mode_name(cfg->precision.mode);
    int n = 0;
    int threads = config_threads(&cfg->run), cpus = threadpool_available_cpus();
    if (threads > cpus) {
        fprintf(out, "ampTrain: warning: %s: run.threads is %d but this process may run on %d CPUs; the threads will "
                "share them (results are the same, only slower)\n", cfg->source, threads, cpus);
        n++;
    }
    for (size_t i = 0; i < ARRAY_LEN(data_fields); i++) { /* a data key the chosen format does not read */
        const struct field *f = &data_fields[i];
        if (f->formats && !(f->formats & (1u << cfg->data.format)) && !field_equal(f, &cfg->data, &d.data)) {
            fprintf(out, "ampTrain: warning: %s: data.%s is set but data.format %s does not read it%s\n", cfg->source,
                    f->key, data_format_names[cfg->data.format],
                    cfg->data.format == DATA_TOKENS && !strcmp(f->key, "shuffle")
                        ? " (data.sampling: random | sequential sets a token run's order)" : "");
            n++;
        }
    }
    switch (precision_loss_scaling(&cfg->precision)) {
    case LOSS_SCALE_NONE:
        if ((dynamic_keys || static_key) && cfg->precision.mode == PREC_FP8) {
            fprintf(out, "ampTrain: warning: %s: precision.loss_scale is set but fp8 is not loss-scaled unless "
                         "precision.fp8.loss_scale is static or dynamic\n", cfg->source);
            n++;
        } else if (dynamic_keys || static_key) {
            fprintf(out, "ampTrain: warning: %s: precision.loss_scale is set but %s is not loss-scaled (scale 1); "
                         "it applies to fp16-static and fp16-dynamic\n", cfg->source, mode);
            n++;
        }
        break;
    case LOSS_SCALE_STATIC: /* fp8's loss scale behaves as the fp16 mode it names */
        if (dynamic_keys) {
            fprintf(out, "ampTrain: warning: %s: precision.loss_scale.{init, growth_factor, backoff_factor, "
                         "growth_interval, hysteresis, min, max} only apply to fp16-dynamic; fp16-static uses "
                         "precision.loss_scale.value (%g)\n", cfg->source, ls->value);
            n++;
        }
        break;
    case LOSS_SCALE_DYNAMIC:
        if (static_key) {
            fprintf(out, "ampTrain: warning: %s: precision.loss_scale.value only applies to fp16-static; "
                         "fp16-dynamic starts at precision.loss_scale.init (%g)\n", cfg->source, ls->init);
            n++;
        }
        break;
    }
    const struct fp8_config *f8 = &cfg->precision.fp8, *df8 = &d.precision.fp8;
    bool fp8_keys = f8->recipe != df8->recipe || f8->amax_history_len != df8->amax_history_len ||
                    f8->amax_compute != df8->amax_compute || f8->margin != df8->margin ||
                    f8->loss_scale != df8->loss_scale || f8->nkeep_bf16 != df8->nkeep_bf16 ||
                    f8->min_size[0] != df8->min_size[0] || f8->min_size[1] != df8->min_size[1];
    for (int i = 0; !fp8_keys && i < f8->nkeep_bf16; i++)
        fp8_keys = strcmp(f8->keep_bf16[i], df8->keep_bf16[i]) != 0;
    if (fp8_keys && cfg->precision.mode != PREC_FP8) {
        fprintf(out, "ampTrain: warning: %s: precision.fp8 is set but precision.mode is %s; it applies to fp8\n",
                cfg->source, mode);
        n++;
    } else if (cfg->precision.mode == PREC_FP8 && f8->recipe == FP8_RECIPE_CURRENT &&
               (f8->amax_history_len != df8->amax_history_len || f8->amax_compute != df8->amax_compute)) {
        fprintf(out, "ampTrain: warning: %s: precision.fp8.amax_history_len and amax_compute apply to recipe delayed; "
                     "recipe current scales each tensor by its amax at the cast\n", cfg->source);
        n++;
    } else if (cfg->precision.mode == PREC_FP8 && f8->recipe == FP8_RECIPE_BLOCKWISE &&
               (f8->amax_history_len != df8->amax_history_len || f8->amax_compute != df8->amax_compute ||
                f8->margin != df8->margin)) {
        fprintf(out, "ampTrain: warning: %s: precision.fp8.amax_history_len, amax_compute and margin do not apply to "
                     "recipe blockwise, which scales each 1x128 tile or 128x128 block by a power of two from its "
                     "amax at the cast\n", cfg->source);
        n++;
    }
    if (precision_is_loss_scaled(&cfg->precision) && cfg->stability.on_nonfinite == NONFINITE_STOP) {
        fprintf(out, "ampTrain: warning: %s: stability.on_nonfinite applies to bf16 and fp32; %s skips overflowing "
                     "steps (use stability.max_consecutive_skips to stop)\n", cfg->source, mode);
        n++;
    }
    config_free(&d);
    return n;
}
