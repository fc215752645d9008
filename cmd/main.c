/*
 * main.c — the ampTrain command line: argument parsing and the subcommands, nothing else. The work is lib/'s: what
 * a command opens before it computes (backend, threads, data, policy, model) is lib/engine/setup.h's setup_open, the
 * training lib/engine/train.h, an export lib/engine/export.h.
 *
 * Every subcommand returns an `enum amp_status`; main turns it into the process exit code of
 * README.md's "Commands" and prints the error with its hint.
 */
#define _POSIX_C_SOURCE 200809L /* O_CLOEXEC, fstat: sample's look at --prompt-file */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "autocast.h" /* autocast_from_config, autocast_print */
#include "backend.h"    /* backend_describe_build: --version */
#include "checkpoint.h" /* ckpt_resolve, ckpt_read_config, ckpt_verify, ckpt_inspect */
#include "data.h"       /* enum split: eval --split */
#include "runlog.h"     /* runlog_eval, runlog_is_run_file */
#include "comm.h"     /* comm_open, comm_close: the ranks of a data-parallel job */
#include "config.h"   /* config_load, config_apply_override, config_print_yaml */
#include "digest.h"   /* digest_str: the command line every rank compares */
#include "dist.h"     /* comm_agree, dist_check_config, dist_check_same */
#include "error.h"    /* enum amp_status, struct amp_error */
#include "export.h"   /* export_check_out, export_checkpoint: ampTrain export */
#include "train.h"    /* train_run */
#include "model.h"    /* model_layer_in_fp8, model_build: `check` lists the fp8 layers and products */
#include "numerics.h" /* numerics_run, numerics_probe: run.numerics_every */
#include "overrides.h" /* resume_rules, eval_rules: the keys resume and eval may change */
#include "precision.h" /* precision_lowp_dtype: the storage lines of `check` */
#include "restart.h"   /* restart_decide: run.resume auto */
#include "sample.h"   /* sample_generate: ampTrain sample */
#include "setup.h"    /* setup_open: backend, threads, data, policy and model of eval, sample, export */
#include "tokenizer.h"   /* tokenizer_load, tokenizer_encode, tokenizer_decode: tokenize and sample */
#include "weight_names.h" /* weight_names_names: export --names */

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef AMP_VERSION
#define AMP_VERSION "0.0.0"
#endif

/* The ranks of this job (mpirun -np N; one rank without a launcher). Rank 0 alone prints progress. */
static struct comm *ranks;

struct command {
    const char *name;
    const char *usage;
    const char *help;
    enum amp_status (*fn)(int argc, char **argv, struct amp_error *err);
    bool one_process; /* not data-parallel, and it writes files: under mpirun every rank would write them */
};

static const char exit_codes[] =
    "exit codes:\n"
    "  0    success\n"
    "  1    internal or system error (out of memory, CUDA error, I/O error)\n"
    "  2    usage or configuration error (bad YAML, unknown key, bad value, bad override)\n"
    "  3    data error (missing or malformed dataset, labels out of range, non-finite inputs)\n"
    "  4    checkpoint error (missing, corrupt, wrong format version, shape mismatch)\n"
    "  5    training became numerically unstable (fail-fast policy tripped)\n"
    "  130  stopped by SIGINT after a checkpoint was written\n"
    "  143  stopped by SIGTERM after a checkpoint was written\n";

/* Load CONFIG and apply KEY=VALUE overrides argv[first..]; warn about settings that do nothing. */
static enum amp_status load_with_overrides(struct config *cfg, const char *path, int argc, char **argv, int first,
                                           struct amp_error *err)
{
    enum amp_status st = config_load(cfg, path, err);
    if (st != AMP_OK)
        return st;
    for (int i = first; i < argc && st == AMP_OK; i++)
        st = config_apply_override(cfg, argv[i], err);
    if (st == AMP_OK)
        st = config_finalize(cfg, err);
    if (st != AMP_OK)
        config_free(cfg);
    else if (ranks->rank == 0)
        config_print_warnings(cfg, stderr);
    return st;
}

/* Every rank has its config (or the first failure), and all configs are one. */
static enum amp_status agree_on_config(enum amp_status st, const struct config *cfg, struct amp_error *err)
{
    st = comm_agree(ranks, st, err);
    if (st == AMP_OK)
        st = comm_agree(ranks, dist_check_config(ranks, cfg, err), err);
    return st;
}

/* Every rank was given the same checkpoint, by contents (a copy on each host will do), already read. */
static enum amp_status agree_on_checkpoint(const char *path, struct amp_error *err)
{
    uint64_t fp = 0;
    enum amp_status st = comm_agree(ranks, ckpt_fingerprint(path, &fp, err), err);
    char what[CFG_STR + 64];
    snprintf(what, sizeof what, "the checkpoint's contents (rank 0 read %s)", path);
    if (st == AMP_OK)
        st = comm_agree(ranks,
                        dist_check_same(ranks, fp, AMP_ERR_CKPT, what,
                                        "give every rank the same checkpoint (its path, or a copy of the file on each "
                                        "host)",
                                        err),
                        err);
    return st;
}

/* Relative data paths made absolute (config_resolve_paths), after the ranks agreed on the config as given: each rank
 * names the files from its own working directory, and the data's and init_from's own checks compare what they hold. */
static enum amp_status resolve_paths(struct config *cfg, struct amp_error *err)
{
    return comm_agree(ranks, config_resolve_paths(cfg, err), err);
}

/* A missing FILE argument of `cmd` (what: CONFIG.yaml or CHECKPOINT.h5). */
static enum amp_status missing_arg(const char *cmd, const char *what, struct amp_error *err)
{
    char hint[96];
    snprintf(hint, sizeof hint, "run 'ampTrain help %s' for usage", cmd);
    return amp_fail(err, AMP_ERR_CONFIG, hint, "%s: missing %s argument", cmd, what);
}

static enum amp_status need_config_arg(int argc, char **argv, const char *cmd, struct amp_error *err)
{
    if (argc < 2 || argv[1][0] == '-' || strchr(argv[1], '='))
        return missing_arg(cmd, "CONFIG.yaml", err);
    if (!ckpt_sniff(argv[1]))
        return AMP_OK;
    /* the config reader would only see binary bytes */
    struct stat sb;
    char hint[2 * CFG_STR];
    snprintf(hint, sizeof hint, "'ampTrain resume %s' continues its run; 'ampTrain inspect %s' prints its config",
             argv[1], argv[1]);
    return amp_fail(err, AMP_ERR_CONFIG, hint, "%s: %s is %s, not a config", cmd, argv[1],
                    stat(argv[1], &sb) == 0 && S_ISDIR(sb.st_mode) ? "a run directory" : "an ampTrain checkpoint");
}

/* How the parameters and the optimizer state are stored (docs/precision.md, "bf16 master weights"). */
static void print_storage(const struct config *cfg, FILE *out)
{
    bool bf16_master = cfg->precision.master_weights == STORE_BF16, bf16_state = cfg->optim.state_dtype == STORE_BF16;
    const char *lowp = dtype_name(precision_lowp_dtype(cfg->precision.mode));
    fprintf(out, "\nstorage:\n  weights: %s master", bf16_master ? "bf16" : "fp32");
    if (bf16_master)
        fprintf(out, " (read directly by bf16 ops; an fp32 copy of each weight read in fp32: biases, norms, embeddings)");
    else if (cfg->precision.mode != PREC_FP32)
        fprintf(out, " and a %s copy of each weight a %s op reads", lowp, lowp);
    fprintf(out, "\n  gradients: fp32\n  optimizer state: %s\n", bf16_state ? "bf16" : "fp32");
    if (bf16_master || bf16_state)
        fprintf(out, "  bf16 stores of the update: %s\n",
                cfg->optim.stochastic_rounding ? "stochastic rounding (keyed by run.seed, step, parameter)"
                                               : "round to nearest even (updates below half a bf16 ulp are lost: "
                                                 "consider optim.stochastic_rounding: true)");
}

/* The model's products that may run in fp8 and which do (precision.fp8.min_size): the model built on the CPU for
 * one sample, its input shape from the config (text, tokens) or the data files (idx, hdf5). Returns how many run in
 * fp8, or -1 where the model cannot be built (said on `out`). */
static int print_fp8_products(const struct config *cfg, const struct autocast_policy *policy, FILE *out)
{
    const struct fp8_config *f = &cfg->precision.fp8;
    struct amp_error err = {0};
    struct dataset ds;
    struct data_spec spec;
    struct model m;
    memset(&ds, 0, sizeof ds);
    memset(&m, 0, sizeof m);
    enum amp_status st = AMP_OK;
    if (!data_spec_from_config(&cfg->data, &spec)) {
        st = data_load(&ds, &cfg->data, 1, &err);
        spec = ds.spec;
    }
    struct backend *be = st == AMP_OK ? backend_cpu_create() : NULL;
    if (st == AMP_OK && !be)
        st = amp_fail(&err, AMP_ERR_INTERNAL, NULL, "cannot open the CPU backend");
    if (st == AMP_OK && (st = model_build(&m, cfg, &spec, be, policy, 1, &err)) != AMP_OK)
        memset(&m, 0, sizeof m);
    int n = -1;
    if (st != AMP_OK) {
        fprintf(out, "  products: their sizes are not known without the model (%s)\n", err.msg);
    } else {
        char rule[96];
        snprintf(rule, sizeof rule, "K > %lld or N > %lld", (long long)m.fp8.min_k, (long long)m.fp8.min_n);
        for (int pass = 0; pass < 2; pass++) {
            bool fp8 = pass == 0;
            if (fp8)
                fprintf(out, "  products in fp8 (weight N x K with %s, precision.fp8.min_size [%.17g, %.17g]):", rule,
                        f->min_size[0], f->min_size[1]);
            else
                fprintf(out, "  products kept in bf16 (smaller):");
            int count = 0;
            for (int i = 0; i < m.fp8.nproducts; i++) {
                const struct fp8_product *p = &m.fp8.products[i];
                if (p->fp8 != fp8)
                    continue;
                fprintf(out, " %s (K %lld, N %lld)", p->name, (long long)p->k, (long long)p->n);
                count++;
            }
            fprintf(out, "%s\n", count ? "" : " none");
            if (fp8)
                n = count;
        }
    }
    model_free(&m);
    if (be)
        backend_close(be);
    data_free(&ds);
    return n;
}

/* precision.mode fp8: which layers' linear products read fp8 operands, and the recipe (docs/precision.md, "fp8"). */
static void print_fp8(const struct config *cfg, const struct autocast_policy *policy, FILE *out)
{
    if (cfg->precision.mode != PREC_FP8)
        return;
    const struct fp8_config *f = &cfg->precision.fp8;
    if (f->recipe == FP8_RECIPE_DELAYED)
        fprintf(out, "\nfp8: recipe delayed (amax history of %lld steps, amax %s, margin %lld)", (long long)f->amax_history_len,
                f->amax_compute == FP8_AMAX_MAX ? "max" : "most_recent", (long long)f->margin);
    else if (f->recipe == FP8_RECIPE_CURRENT)
        fprintf(out, "\nfp8: recipe current (each tensor's amax at its cast, margin %lld)", (long long)f->margin);
    else
        fprintf(out, "\nfp8: recipe blockwise (a power-of-two scale per 1x128 tile of inputs and output gradients and "
                     "per 128x128 block of weights, from its amax at the cast)");
    fprintf(out, "; %s, bf16 results\n  layers in fp8:", f->recipe == FP8_RECIPE_BLOCKWISE
                                                             ? "E4M3 inputs, weights and output gradients"
                                                             : "E4M3 inputs and weights, E5M2 output gradients");
    int n = 0;
    bool linear_lowp = policy->cls[OP_LINEAR] == OPC_LOWP;
    for (int i = 0; i < cfg->model.nlayers; i++)
        if (linear_lowp && model_layer_in_fp8(cfg, i)) {
            fprintf(out, " %s", cfg->model.layers[i].name);
            n++;
        }
    fprintf(out, "%s\n  kept in bf16 (precision.fp8.keep_bf16):", n ? "" : " none");
    int kept = 0;
    for (int i = 0; i < cfg->model.nlayers; i++) {
        enum layer_kind k = cfg->model.layers[i].kind;
        if ((k == LAYER_LINEAR || k == LAYER_ATTENTION || k == LAYER_TRANSFORMER_BLOCK) &&
            !(linear_lowp && model_layer_in_fp8(cfg, i))) {
            fprintf(out, " %s", cfg->model.layers[i].name);
            kept++;
        }
    }
    fprintf(out, "%s\n", kept ? "" : " none");
    int products = n ? print_fp8_products(cfg, policy, out) : 0;
    if (!n || products == 0)
        fprintf(stderr, "ampTrain: warning: %s: precision.mode is fp8 but no product runs in fp8 (see "
                        "precision.fp8.keep_bf16 and precision.fp8.min_size); the run is bf16\n", cfg->source);
}

static enum amp_status cmd_check(int argc, char **argv, struct amp_error *err)
{
    enum amp_status st = need_config_arg(argc, argv, "check", err);
    if (st != AMP_OK)
        return st;
    struct config cfg;
    if ((st = load_with_overrides(&cfg, argv[1], argc, argv, 2, err)) != AMP_OK)
        return st;
    struct autocast_policy policy;
    st = autocast_from_config(&policy, cfg.precision.mode, &cfg.precision.autocast, err);
    if (st == AMP_OK) {
        printf("# %s: valid. Resolved config:\n", argv[1]);
        config_print_yaml(&cfg, stdout);
        printf("\n");
        autocast_print(&policy, stdout);
        print_fp8(&cfg, &policy, stdout);
        print_storage(&cfg, stdout);
    }
    config_free(&cfg);
    return st;
}

/* New data paths for a checkpoint that records no digests of its data (written before it did): they are used
 * unchecked, and the user is told so. */
static void warn_unchecked_data(const char *ckpt)
{
    fprintf(stderr, "ampTrain: warning: %s records no digests of its data (it was written before ampTrain recorded "
                    "them): the data paths given are used without checking that they hold the run's data\n", ckpt);
}

/* Resume converts the checkpoint's FP32 values to the storage a resume override asks for, once, at load. */
static void warn_storage_change(const char *key, const char *what, enum store_dtype from, enum store_dtype to)
{
    if (from == to)
        return;
    if (to == STORE_FP32)
        fprintf(stderr, "ampTrain: note: %s changes from bf16 to fp32 on resume: the %s carry over exactly (every "
                        "bf16 value is an fp32 value) and are kept in fp32 from here on\n", key, what);
    else
        fprintf(stderr, "ampTrain: warning: %s changes from fp32 to bf16 on resume: the checkpoint's fp32 %s are "
                        "rounded to nearest bf16 once at load, and the run is no longer bit-identical to one that kept "
                        "fp32\n", key, what);
}

/* Check the CHECKPOINT argument and resolve a run directory to the checkpoint its `latest` names
 * (argv[1] is replaced by the file's path). */
static enum amp_status need_ckpt_arg(int argc, char **argv, const char *cmd, struct amp_error *err)
{
    static char resolved[CFG_STR + 64];
    if (argc < 2 || argv[1][0] == '-' || strchr(argv[1], '='))
        return missing_arg(cmd, "CHECKPOINT.h5", err);
    enum amp_status st = ckpt_resolve(argv[1], resolved, sizeof resolved, err);
    if (st == AMP_OK)
        argv[1] = resolved;
    return st;
}

/* Continue the run of checkpoint `ckpt` with `nov` KEY=VALUE overrides of resume_allowed's keys: `resume`, and
 * `run` with run.resume: auto when its run.out_dir holds the run. */
static enum amp_status resume_checkpoint(const char *ckpt, int nov, char *const *ov, struct amp_error *err)
{
    struct config cfg;
    enum amp_status read = ckpt_read_config(ckpt, &cfg, err);
    enum amp_status st = comm_agree(ranks, read, err);
    if (st == AMP_OK) /* one state to continue from, not a divergence found steps later */
        st = agree_on_checkpoint(ckpt, err);
    if (st != AMP_OK) {
        if (read == AMP_OK)
            config_free(&cfg);
        return st;
    }
    enum precision_mode old_mode = cfg.precision.mode;
    enum store_dtype old_master = cfg.precision.master_weights, old_state = cfg.optim.state_dtype;
    bool new_data = false;
    for (int i = 0; i < nov && st == AMP_OK; i++) {
        st = override_apply(&resume_rules, &cfg, ov[i], err);
        new_data = new_data || override_sets_data_path(ov[i]);
    }
    bool mode_changed = cfg.precision.mode != old_mode;
    if (st == AMP_OK)
        st = config_finalize(&cfg, err);
    struct ckpt_info info;
    if (st == AMP_OK && new_data && (st = ckpt_verify(ckpt, &info, err)) == AMP_OK && info.ndata_files == 0 &&
        ranks->rank == 0)
        warn_unchecked_data(ckpt);
    st = agree_on_config(st, &cfg, err);
    if (st == AMP_OK) /* the resumed run records absolute paths, as a run does */
        st = resolve_paths(&cfg, err);
    if (st == AMP_OK && mode_changed && ranks->rank == 0)
        fprintf(stderr,
                "ampTrain: warning: precision.mode changes from %s to %s on resume: the FP32 weights and optimizer "
                "state carry over, the loss scaler starts from its init, and the run is no longer bit-identical to "
                "one that kept %s\n",
                precision_mode_name(old_mode), precision_mode_name(cfg.precision.mode), precision_mode_name(old_mode));
    if (st == AMP_OK && ranks->rank == 0)
        warn_storage_change("precision.master_weights", "weights", old_master, cfg.precision.master_weights);
    if (st == AMP_OK && ranks->rank == 0)
        warn_storage_change("optim.state_dtype", "optimizer moments", old_state, cfg.optim.state_dtype);
    if (st == AMP_OK) {
        printf("ampTrain %s: resume '%s' from %s -> %s\n", AMP_VERSION, cfg.run.name, ckpt, cfg.run.out_dir);
        st = train_resume(&cfg, ckpt, mode_changed, ranks, &numerics_probe, err);
    }
    config_free(&cfg);
    return st;
}

static enum amp_status cmd_resume(int argc, char **argv, struct amp_error *err)
{
    enum amp_status st = comm_agree(ranks, need_ckpt_arg(argc, argv, "resume", err), err);
    if (st != AMP_OK)
        return st;
    return resume_checkpoint(argv[1], argc - 2, argv + 2, err);
}

/* ---- run.resume: auto (docs/checkpoint.md, "Restarts") ---------------------------------------------------------- */

static enum amp_status run_or_restart(const struct config *cfg, const char *source, struct amp_error *err)
{
    struct restart r = {0};
    enum amp_status st = AMP_OK;
    if (cfg->run.resume == RESUME_AUTO)
        st = restart_decide(cfg, ranks, &r, err);
    if (st == AMP_OK && r.action == RESTART_COMPLETE)
        printf("ampTrain %s: run '%s' is complete: %s is at step %lld, its last (run.steps): nothing to train (raise "
               "run.steps to train further)\n", AMP_VERSION, cfg->run.name, r.ckpt, (long long)r.info.step);
    else if (st == AMP_OK && r.action == RESTART_CONTINUE) {
        printf("ampTrain %s: run.resume auto: continuing the run in %s from %s (step %lld)\n", AMP_VERSION,
               cfg->run.out_dir, r.ckpt, (long long)r.info.step);
        st = resume_checkpoint(r.ckpt, r.nov, r.ov, err);
    } else if (st == AMP_OK) {
        printf("ampTrain %s: run '%s' from %s -> %s\n", AMP_VERSION, cfg->run.name, source, cfg->run.out_dir);
        st = train_run(cfg, ranks, &numerics_probe, err);
    }
    restart_free(&r);
    return st;
}

static enum amp_status cmd_run(int argc, char **argv, struct amp_error *err)
{
    enum amp_status st = comm_agree(ranks, need_config_arg(argc, argv, "run", err), err);
    if (st != AMP_OK)
        return st;
    struct config cfg;
    st = load_with_overrides(&cfg, argv[1], argc, argv, 2, err);
    enum amp_status loaded = st;
    st = agree_on_config(st, &cfg, err);
    if (st == AMP_OK) /* config.yaml and the checkpoints name the data from any directory */
        st = resolve_paths(&cfg, err);
    if (st == AMP_OK)
        st = run_or_restart(&cfg, argv[1], err);
    if (loaded == AMP_OK)
        config_free(&cfg);
    return st;
}

struct eval_args {
    const char *ckpt;
    int autocast;      /* -1: the run's own precision, 0 off, 1 on */
    const char *dtype; /* NULL: the run's */
    enum split split;
};

/* A KEY=VALUE argument among eval's options. */
static bool is_override_arg(const char *arg)
{
    return arg[0] != '-' && strchr(arg, '=') != NULL;
}

/* eval's KEY=VALUE arguments, by eval_allowed; *new_data: one of them moves a data path. */
static enum amp_status eval_overrides(struct config *cfg, int argc, char **argv, bool *new_data, struct amp_error *err)
{
    enum amp_status st = AMP_OK;
    bool any = false;
    *new_data = false;
    for (int i = 2; i < argc && st == AMP_OK; i++) {
        if (!is_override_arg(argv[i]))
            continue; /* an option or its value (parse_eval_args) */
        any = true;
        *new_data = *new_data || override_sets_data_path(argv[i]);
        st = override_apply(&eval_rules, cfg, argv[i], err);
    }
    if (st == AMP_OK && any)
        st = config_finalize(cfg, err);
    return st;
}

static enum amp_status parse_eval_args(int argc, char **argv, struct eval_args *a, struct amp_error *err)
{
    *a = (struct eval_args){.ckpt = argv[1], .autocast = -1, .split = SPLIT_TEST};
    for (int i = 2; i < argc; i++) {
        if (is_override_arg(argv[i]))
            continue; /* KEY=VALUE: applied to the checkpoint's config (eval_overrides) */
        const char *opt = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        bool ok = val != NULL;
        if (ok && strcmp(opt, "--autocast") == 0) {
            ok = strcmp(val, "on") == 0 || strcmp(val, "off") == 0;
            a->autocast = strcmp(val, "on") == 0;
        } else if (ok && strcmp(opt, "--dtype") == 0) {
            if (strcmp(val, "fp8") == 0)
                return amp_fail(err, AMP_ERR_CONFIG,
                                "leave --dtype out (an fp8 run's checkpoint evaluates in bf16), or give --dtype bf16",
                                "eval: --dtype fp8 is not offered: evaluation runs fp8 runs under bf16 autocast (fp8's "
                                "delayed scales follow training steps' amaxes, which an evaluation does not take; see "
                                "docs/precision.md, \"fp8\")");
            ok = strcmp(val, "fp16") == 0 || strcmp(val, "bf16") == 0;
            a->dtype = val;
        } else if (ok && strcmp(opt, "--split") == 0) {
            ok = strcmp(val, "test") == 0 || strcmp(val, "train") == 0;
            a->split = strcmp(val, "train") == 0 ? SPLIT_TRAIN : SPLIT_TEST;
        } else {
            ok = false;
        }
        if (!ok)
            return amp_fail(err, AMP_ERR_CONFIG, "run 'ampTrain help eval' for usage",
                            "eval: bad option '%s%s%s' (expected --autocast on|off, --dtype fp16|bf16, "
                            "--split test|train)",
                            opt, val ? " " : "", val ? val : "");
        i++;
    }
    return AMP_OK;
}

/* The precision mode whose autocast policy the evaluation uses. */
static enum amp_status eval_mode(const struct eval_args *a, enum precision_mode run_mode, enum precision_mode *out,
                                 struct amp_error *err)
{
    bool on = a->autocast == 1 || (a->autocast == -1 && (run_mode != PREC_FP32 || a->dtype));
    if (!on && a->dtype)
        return amp_fail(err, AMP_ERR_CONFIG, "drop --dtype, or evaluate with --autocast on",
                        "eval: --dtype %s has no effect with --autocast off (the model evaluates in fp32)", a->dtype);
    if (!on) {
        *out = PREC_FP32;
        return AMP_OK;
    }
    if (a->dtype)
        *out = strcmp(a->dtype, "bf16") == 0 ? PREC_BF16 : PREC_FP16_DYNAMIC;
    else if (run_mode == PREC_FP32)
        return amp_fail(err, AMP_ERR_CONFIG, "add --dtype fp16 or --dtype bf16",
                        "eval: --autocast on, but the run was fp32 and has no low-precision dtype");
    else
        *out = run_mode;
    return AMP_OK;
}

static enum amp_status cmd_eval(int argc, char **argv, struct amp_error *err)
{
    enum amp_status st = need_ckpt_arg(argc, argv, "eval", err);
    struct eval_args a = {0};
    if (st == AMP_OK)
        st = parse_eval_args(argc, argv, &a, err);
    if ((st = comm_agree(ranks, st, err)) != AMP_OK)
        return st;
    struct config cfg;
    enum amp_status read = ckpt_read_config(a.ckpt, &cfg, err);
    st = comm_agree(ranks, read, err);
    if (st == AMP_OK) /* sharded, the ranks evaluate one model one way: the same file and options */
        st = agree_on_checkpoint(a.ckpt, err);
    if (st == AMP_OK) {
        uint64_t opts = (uint64_t)(a.autocast + 1) | (uint64_t)a.split << 4 |
                        (uint64_t)(a.dtype ? 1 + (strcmp(a.dtype, "bf16") == 0) : 0) << 8;
        st = comm_agree(ranks,
                        dist_check_same(ranks, opts, AMP_ERR_CONFIG, "eval's options (--split, --autocast, --dtype)",
                                        "give every rank the same eval options", err),
                        err);
    }
    bool new_data = false;
    if (st == AMP_OK)
        st = eval_overrides(&cfg, argc, argv, &new_data, err);
    st = agree_on_config(st, &cfg, err); /* one config (the file's), and the communicator's timeout from it */
    if (st != AMP_OK) {
        if (read == AMP_OK)
            config_free(&cfg);
        return st;
    }
    struct ckpt_info info;
    struct dataset ds;
    struct model m;
    memset(&ds, 0, sizeof ds);
    memset(&m, 0, sizeof m);
    struct setup s = {.ds = &ds, .model = &m};
    enum precision_mode mode = PREC_FP32;
    st = ckpt_verify(a.ckpt, &info, err);
    if (st == AMP_OK)
        st = eval_mode(&a, cfg.precision.mode, &mode, err);
    if (st == AMP_OK) /* only the split evaluated: its files may be all that was copied with the checkpoint */
        st = setup_open(&s, &cfg,
                        &(struct setup_opts){.comm = ranks, .data = SETUP_DATA_SPLIT, .split = a.split, .ckpt = a.ckpt,
                                             .info = &info, .mode = mode, .max_batch = cfg.data.batch_size},
                        err);
    if (s.data_unchecked && new_data && ranks->rank == 0)
        warn_unchecked_data(a.ckpt);
    struct eval_result r;
    st = comm_agree(ranks, st, err);
    if (st == AMP_OK) /* one dataset, as the checkpoint and the options */
        st = comm_agree(ranks, dist_check_data(ranks, &ds, a.ckpt, err), err);
    if (st == AMP_OK && ranks->rank == 0 && mode == PREC_FP8)
        printf("eval: note: %s is an fp8 run's checkpoint; it evaluates under bf16 autocast (docs/precision.md, "
               "\"fp8\")\n", a.ckpt);
    if (st == AMP_OK) /* sharded over the ranks; every rank gets the one-rank result */
        st = train_evaluate(&m, &ds, a.split, ranks, &r, err);
    if (st == AMP_OK && ranks->rank == 0) {
        /* eval.jsonl goes beside the checkpoint: its run directory. */
        char dir[CFG_STR + 64];
        snprintf(dir, sizeof dir, "%s", a.ckpt);
        char *slash = strrchr(dir, '/');
        if (slash)
            *slash = '\0';
        else
            snprintf(dir, sizeof dir, ".");
        struct eval_record rec = {
            .step = info.step,
            .split = a.split == SPLIT_TRAIN ? "train" : "test",
            .autocast = m.policy.enabled,
            .dtype = dtype_name(m.policy.enabled ? m.policy.lowp : DT_FP32),
            .loss = r.loss,
            .accuracy = r.accuracy,
            .perplexity = ds.spec.is_tokens ? exp(r.loss) : NAN,
            .samples = r.samples,
        };
        st = runlog_eval(dir, stdout, &rec, err);
    }
    st = comm_agree(ranks, st, err);
    setup_close(&s);
    config_free(&cfg);
    return st;
}

/* ---- sample ---------------------------------------------------------------------------------------- */

#define SAMPLE_PROMPT_MAX (1 << 20) /* bytes of a --prompt-file: far beyond any model's context */

struct sample_args {
    const char *ckpt;
    const char *prompt;      /* --prompt TEXT, or NULL */
    const char *prompt_file; /* --prompt-file F, or NULL */
    const char *tokenizer;   /* --tokenizer FILE, or NULL */
    const char *device;      /* --device cpu|cuda, or NULL: the checkpoint's run.device */
    struct sample_opts o;
};

/* A whole number in [lo, hi] or a finite real in [lo, hi] from an option's value; false when it is not. */
static bool parse_count(const char *v, int64_t lo, int64_t hi, int64_t *out)
{
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi)
        return false;
    *out = x;
    return true;
}

static bool parse_real(const char *v, double lo, double hi, bool lo_open, double *out)
{
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (errno || end == v || *end || !isfinite(x) || x < lo || x > hi || (lo_open && x == lo))
        return false;
    *out = x;
    return true;
}

static enum amp_status parse_sample_args(int argc, char **argv, struct sample_args *a, struct amp_error *err)
{
    *a = (struct sample_args){.ckpt = argv[1], .o = {.tokens = 256, .temperature = 1.0, .top_p = 1.0}};
    for (int i = 2; i < argc; i++) {
        const char *opt = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        const char *expect = NULL; /* what the value should have been */
        int64_t n = 0;
        if (!val) {
            expect = "a value after it";
        } else if (!strcmp(opt, "--prompt") || !strcmp(opt, "--prompt-file")) {
            if (a->prompt || a->prompt_file)
                return amp_fail(err, AMP_ERR_CONFIG, "give the prompt once, as text or as a file",
                                "sample: --prompt and --prompt-file given together, or one of them twice");
            *(opt[8] ? &a->prompt_file : &a->prompt) = val;
        } else if (!strcmp(opt, "--tokens")) {
            expect = parse_count(val, 0, 1 << 20, &a->o.tokens) ? NULL : "a whole number from 0 to 1048576";
        } else if (!strcmp(opt, "--temperature")) {
            expect = parse_real(val, 0.0, 1e6, false, &a->o.temperature) ? NULL : "a number >= 0 (0: greedy)";
        } else if (!strcmp(opt, "--top-k")) {
            expect = parse_count(val, 0, INT32_MAX, &a->o.top_k) ? NULL : "a whole number >= 0 (0: every token)";
        } else if (!strcmp(opt, "--top-p")) {
            expect = parse_real(val, 0.0, 1.0, true, &a->o.top_p) ? NULL : "a number in (0, 1] (1: every token)";
        } else if (!strcmp(opt, "--seed")) {
            expect = parse_count(val, 0, INT64_MAX, &n) ? NULL : "a whole number >= 0";
            a->o.seed = (uint64_t)n;
        } else if (!strcmp(opt, "--tokenizer")) {
            a->tokenizer = val;
        } else if (!strcmp(opt, "--device")) {
            expect = !strcmp(val, "cpu") || !strcmp(val, "cuda") ? NULL : "cpu or cuda";
            a->device = val;
        } else {
            return amp_fail(err, AMP_ERR_CONFIG, "run 'ampTrain help sample' for usage",
                            "sample: unknown option '%s' (expected --prompt, --prompt-file, --tokens, --temperature, "
                            "--top-k, --top-p, --seed, --tokenizer, --device)", opt);
        }
        if (expect)
            return amp_fail(err, AMP_ERR_CONFIG, "run 'ampTrain help sample' for usage",
                            "sample: bad value for %s: '%s' (expected %s)", opt, val ? val : "", expect);
        i++;
    }
    return AMP_OK;
}

/* The bytes of a --prompt-file (malloc'd, *len of them): a regular file of at most SAMPLE_PROMPT_MAX bytes, opened
 * without blocking (a FIFO or a device is refused before anything is read). AMP_ERR_CONFIG naming the file. */
static enum amp_status read_prompt_file(const char *path, char **out, size_t *len, struct amp_error *err)
{
    const char *hint = "--prompt-file names a text file of at most 1 MiB";
    *out = NULL;
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    struct stat sb;
    if (fd < 0 || fstat(fd, &sb) != 0) {
        int e = errno;
        if (fd >= 0)
            close(fd);
        return amp_fail(err, AMP_ERR_CONFIG, hint, "sample: cannot open --prompt-file '%s': %s", path, strerror(e));
    }
    const char *kind = S_ISDIR(sb.st_mode) ? "a directory" : !S_ISREG(sb.st_mode) ? "not a regular file" : NULL;
    if (kind || sb.st_size > SAMPLE_PROMPT_MAX) {
        close(fd);
        if (kind)
            return amp_fail(err, AMP_ERR_CONFIG, hint, "sample: --prompt-file '%s' is %s", path, kind);
        return amp_fail(err, AMP_ERR_CONFIG, hint, "sample: --prompt-file '%s' has %lld bytes, more than %d", path,
                        (long long)sb.st_size, SAMPLE_PROMPT_MAX);
    }
    char *buf = malloc((size_t)sb.st_size + 1);
    size_t got = 0;
    ssize_t r = 1;
    while (buf && r > 0 && got <= (size_t)sb.st_size) { /* reads one byte past st_size: a file that grew is seen */
        r = read(fd, buf + got, (size_t)sb.st_size + 1 - got);
        got += r > 0 ? (size_t)r : 0;
        if (r < 0 && errno == EINTR)
            r = 1;
    }
    int e = errno;
    close(fd);
    if (!buf || r < 0 || got > (size_t)sb.st_size) {
        free(buf);
        if (!buf)
            return amp_fail(err, AMP_ERR_INTERNAL, NULL, "sample: out of memory reading '%s'", path);
        if (r < 0)
            return amp_fail(err, AMP_ERR_CONFIG, hint, "sample: cannot read --prompt-file '%s': %s", path,
                            strerror(e));
        return amp_fail(err, AMP_ERR_CONFIG, hint, "sample: --prompt-file '%s' grew while it was read", path);
    }
    *out = buf;
    *len = got;
    return AMP_OK;
}

static enum amp_status cmd_sample(int argc, char **argv, struct amp_error *err)
{
    enum amp_status st = need_ckpt_arg(argc, argv, "sample", err);
    struct sample_args a;
    if (st == AMP_OK)
        st = parse_sample_args(argc, argv, &a, err);
    if (st != AMP_OK)
        return st;
    char *file_text = NULL;
    size_t file_len = 0;
    if (a.prompt_file && (st = read_prompt_file(a.prompt_file, &file_text, &file_len, err)) != AMP_OK)
        return st;
    struct config cfg;
    if ((st = ckpt_read_config(a.ckpt, &cfg, err)) != AMP_OK) {
        free(file_text);
        return st;
    }
    struct ckpt_info info;
    struct model m;
    memset(&m, 0, sizeof m);
    struct setup s = {.model = &m};
    enum precision_mode mode = PREC_FP32;
    struct eval_args as_eval = {.ckpt = a.ckpt, .autocast = -1};
    int64_t context = 0, n_prompt = 0;
    int32_t *prompt = NULL;
    struct sample_result r = {0};
    struct sample_codec codec = {0};
    char *out_text = NULL;
    size_t out_len = 0;
    st = ckpt_verify(a.ckpt, &info, err);
    if (st == AMP_OK) /* the model runs as eval runs it: the run's own precision */
        st = eval_mode(&as_eval, cfg.precision.mode, &mode, err);
    if (st == AMP_OK) /* one sequence at a time, on --device or the run's; only the model's input shape is read */
        st = setup_open(&s, &cfg,
                        &(struct setup_opts){.device = a.device, .data = SETUP_DATA_SPEC, .ckpt = a.ckpt,
                                             .info = &info, .mode = mode, .max_batch = 1},
                        err);
    if (st == AMP_OK)
        st = model_decode_begin(&m, &context, err);
    if (st == AMP_OK) {
        const struct layer *head = &m.layers[m.nlayers - 2];
        const char *text = a.prompt_file ? file_text : a.prompt ? a.prompt : "";
        size_t len = a.prompt_file ? file_len : strlen(text);
        /* --tokenizer, else the run's own data.tokenizer, else bytes */
        st = sample_codec_open(&codec, a.tokenizer ? a.tokenizer : cfg.data.tokenizer,
                               layer_out_cols(head), "sample", err);
        if (st == AMP_OK)
            st = sample_codec_encode(&codec, text, len, "sample", &prompt, &n_prompt, err);
    }
    a.o.draw_below = sample_codec_draw_below(&codec);
    if (st == AMP_OK)
        st = sample_generate(&m, context, prompt, n_prompt, &a.o, &r, err);
    if (st == AMP_OK)
        st = sample_codec_decode(&codec, r.tokens, r.n, &out_text, &out_len, err);
    if (st == AMP_OK) {
        fwrite(out_text, 1, out_len, stdout);
        fputc('\n', stdout);
        if (r.stopped_at_context)
            fprintf(stderr, "ampTrain: sample: stopped at the model's context of %lld positions (data.seq_len): "
                            "%lld of %lld tokens generated\n",
                    (long long)context, (long long)(r.n - r.n_prompt), (long long)a.o.tokens);
    }
    sample_result_free(&r);
    free(out_text);
    sample_codec_free(&codec);
    free(prompt);
    setup_close(&s);
    config_free(&cfg);
    free(file_text);
    return st;
}

static enum amp_status cmd_inspect(int argc, char **argv, struct amp_error *err)
{
    enum amp_status st = need_ckpt_arg(argc, argv, "inspect", err);
    if (st != AMP_OK)
        return st;
    return ckpt_inspect(argv[1], stdout, err);
}

/* numerics CONFIG.yaml|CHECKPOINT.h5 [--steps K] [--underflow F] [KEY=VALUE ...]: a checkpoint (a .h5 file or
 * a run directory) measures from its state, a config from a fresh initialisation. */
static enum amp_status cmd_numerics(int argc, char **argv, struct amp_error *err)
{
    if (argc < 2 || argv[1][0] == '-' || strchr(argv[1], '='))
        return missing_arg("numerics", "CONFIG.yaml or CHECKPOINT.h5", err);
    struct stat sb;
    size_t len = strlen(argv[1]);
    bool is_ckpt = (stat(argv[1], &sb) == 0 && S_ISDIR(sb.st_mode)) || (len > 3 && !strcmp(argv[1] + len - 3, ".h5"));
    static char resolved[CFG_STR + 64];
    enum amp_status st = AMP_OK;
    if (is_ckpt && (st = ckpt_resolve(argv[1], resolved, sizeof resolved, err)) != AMP_OK)
        return st;
    int64_t steps = 5;
    double underflow = 0.001;
    char *ov_argv[258] = {0}, **overrides = ov_argv + 2; /* load_with_overrides reads argv[2..] */
    int nov = 0;
    for (int i = 2; i < argc; i++) {
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        char *end = NULL;
        if (!strcmp(argv[i], "--steps") && val) {
            errno = 0;
            long long k = strtoll(val, &end, 10);
            if (errno || *end || k <= 0 || k > 100000)
                return amp_fail(err, AMP_ERR_CONFIG, "give the number of steps to measure, e.g. --steps 5",
                                "numerics: --steps '%s' is not an integer in [1, 100000]", val);
            steps = k;
            i++;
        } else if (!strcmp(argv[i], "--underflow") && val) {
            double u = strtod(val, &end);
            if (*end || !(u >= 0 && u < 1))
                return amp_fail(err, AMP_ERR_CONFIG, "give a fraction, e.g. --underflow 0.001 (0.1%)",
                                "numerics: --underflow '%s' is not a fraction in [0, 1)", val);
            underflow = u;
            i++;
        } else if (strchr(argv[i], '=') && argv[i][0] != '-' && nov < 256) {
            overrides[nov++] = argv[i];
        } else {
            return amp_fail(err, AMP_ERR_CONFIG, "run 'ampTrain help numerics' for usage",
                            "numerics: bad argument '%s' (expected --steps K, --underflow F or KEY=VALUE)", argv[i]);
        }
    }
    struct config cfg;
    if (is_ckpt) {
        if ((st = ckpt_read_config(resolved, &cfg, err)) != AMP_OK)
            return st;
        /* One rule with eval: a command given a checkpoint writes beside it (its directory, not the out_dir its
         * config names, which may be another machine's or gone); run.out_dir=DIR still sends it elsewhere. */
        char *dir = cfg.run.out_dir, *slash = strrchr(resolved, '/');
        size_t len = slash ? (slash == resolved ? 1 : (size_t)(slash - resolved)) : 1;
        if (len >= sizeof cfg.run.out_dir) {
            config_free(&cfg);
            return amp_fail(err, AMP_ERR_CONFIG, "give a shorter path to the checkpoint",
                            "numerics: the directory of %s is longer than %zu bytes", resolved,
                            sizeof cfg.run.out_dir - 1);
        }
        memcpy(dir, slash ? resolved : ".", len);
        dir[len] = '\0';
        for (int i = 0; i < nov && st == AMP_OK; i++)
            st = config_apply_override(&cfg, overrides[i], err);
        if (st == AMP_OK)
            st = config_finalize(&cfg, err);
        if (st != AMP_OK) {
            config_free(&cfg);
            return st;
        }
    } else if ((st = load_with_overrides(&cfg, argv[1], nov + 2, ov_argv, 2, err)) != AMP_OK) {
        return st;
    }
    st = numerics_run(&cfg, is_ckpt ? resolved : NULL, steps, underflow, err);
    config_free(&cfg);
    return st;
}

/* export CHECKPOINT.h5 OUT.safetensors [--dtype fp32|bf16|fp16] [--names ampTrain|pytorch|hf-gpt2] */
static enum amp_status parse_export_args(int argc, char **argv, struct export_opts *a, struct amp_error *err)
{
    *a = (struct export_opts){.ckpt = argv[1], .dtype = DT_FP32, .names = NAMES_AMPTRAIN};
    if (argc < 3 || argv[2][0] == '-')
        return missing_arg("export", "OUT.safetensors", err);
    a->out = argv[2];
    for (int i = 3; i < argc; i++) {
        const char *opt = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        bool ok = val != NULL;
        if (ok && strcmp(opt, "--dtype") == 0) {
            ok = !strcmp(val, "fp32") || !strcmp(val, "bf16") || !strcmp(val, "fp16");
            a->dtype = !strcmp(val, "bf16") ? DT_BF16 : !strcmp(val, "fp16") ? DT_FP16 : DT_FP32;
        } else if (ok && strcmp(opt, "--names") == 0) {
            ok = false;
            for (int n = 0; weight_names_names[n]; n++)
                if (!strcmp(val, weight_names_names[n])) {
                    a->names = (enum weight_names)n;
                    ok = true;
                }
        } else {
            ok = false;
        }
        if (!ok)
            return amp_fail(err, AMP_ERR_CONFIG, "run 'ampTrain help export' for usage",
                            "export: bad option '%s%s%s' (expected --dtype fp32|bf16|fp16, --names "
                            "ampTrain|pytorch|hf-gpt2)", opt, val ? " " : "", val ? val : "");
        i++;
    }
    return AMP_OK;
}

static enum amp_status cmd_export(int argc, char **argv, struct amp_error *err)
{
    enum amp_status st = need_ckpt_arg(argc, argv, "export", err);
    struct export_opts a;
    if (st == AMP_OK)
        st = parse_export_args(argc, argv, &a, err);
    if (st == AMP_OK)
        st = export_check_out(a.out, a.ckpt, err);
    struct export_result r;
    if (st == AMP_OK)
        st = export_checkpoint(&a, &r, err);
    if (st == AMP_OK)
        printf("exported %d tensors (%zu bytes of %s, %s names) from %s (step %lld) to %s\n", r.ntensors, r.bytes,
               dtype_name(a.dtype), weight_names_names[a.names], a.ckpt, (long long)r.step, a.out);
    return st;
}

/* All of stdin, for tokenize (malloc'd, NUL-terminated). */
static enum amp_status read_stdin(char **out, size_t *n, struct amp_error *err)
{
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap + 1);
    while (buf) {
        len += fread(buf + len, 1, cap - len, stdin);
        if (len < cap)
            break;
        char *more = realloc(buf, 2 * cap + 1);
        if (!more)
            free(buf);
        buf = more;
        cap *= 2;
    }
    if (!buf)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "tokenize: out of memory reading stdin");
    if (ferror(stdin)) {
        free(buf);
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "tokenize: reading stdin: %s", strerror(errno));
    }
    buf[len] = '\0';
    *out = buf;
    *n = len;
    return AMP_OK;
}

static bool is_sep(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

/* tokenize --decode: ids separated by whitespace (at most `len` of them in `text`) into *ids. */
static enum amp_status parse_ids(const char *text, size_t len, int32_t **ids, size_t *n, struct amp_error *err)
{
    *n = 0;
    *ids = malloc((len / 2 + 1) * sizeof **ids); /* an id takes a digit and a separator */
    if (!*ids)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "tokenize: out of memory");
    for (size_t pos = 0; pos < len;) {
        if (is_sep(text[pos])) {
            pos++;
            continue;
        }
        size_t end = pos;
        long long v = 0;
        while (end < len && text[end] >= '0' && text[end] <= '9' && end - pos < 10)
            v = v * 10 + (text[end++] - '0');
        if (end == pos || (end < len && !is_sep(text[end])) || v > INT32_MAX) {
            size_t show = 0;
            while (pos + show < len && show < 40 && !is_sep(text[pos + show]))
                show++;
            free(*ids);
            *ids = NULL;
            return amp_fail(err, AMP_ERR_DATA, "give --decode ids (non-negative integers) separated by spaces or newlines",
                            "tokenize --decode: stdin: '%.*s' (byte %zu, id %zu) is not an id", (int)show, text + pos,
                            pos, *n + 1);
        }
        (*ids)[(*n)++] = (int32_t)v;
        pos = end;
    }
    return AMP_OK;
}

static enum amp_status write_stdout(const void *data, size_t n, struct amp_error *err)
{
    if (fwrite(data, 1, n, stdout) != n || fflush(stdout) != 0)
        return amp_fail(err, AMP_ERR_INTERNAL, NULL, "tokenize: writing stdout: %s", strerror(errno));
    return AMP_OK;
}

static enum amp_status cmd_tokenize(int argc, char **argv, struct amp_error *err)
{
    const char *path = NULL;
    bool decode = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tokenizer") && i + 1 < argc)
            path = argv[++i];
        else if (!strcmp(argv[i], "--decode"))
            decode = true;
        else if (!strcmp(argv[i], "--tokenizer"))
            return amp_fail(err, AMP_ERR_CONFIG, "run 'ampTrain help tokenize' for usage",
                            "tokenize: --tokenizer needs a FILE");
        else
            return amp_fail(err, AMP_ERR_CONFIG, "run 'ampTrain help tokenize' for usage",
                            "tokenize: unexpected argument '%s'", argv[i]);
    }
    if (!path)
        return amp_fail(err, AMP_ERR_CONFIG, "run 'ampTrain help tokenize' for usage",
                        "tokenize: missing --tokenizer FILE (a tokenizer.json, a vocab.json or their directory)");
    struct tokenizer *tok = NULL;
    enum amp_status st = tokenizer_load(path, &tok, err);
    char *in = NULL, *text = NULL;
    size_t in_len = 0, text_len = 0, n = 0;
    int32_t *ids = NULL;
    if (st == AMP_OK)
        st = read_stdin(&in, &in_len, err);
    if (st == AMP_OK && decode) {
        st = parse_ids(in, in_len, &ids, &n, err);
        if (st == AMP_OK)
            st = tokenizer_decode(tok, ids, n, &text, &text_len, err);
        if (st == AMP_OK)
            st = write_stdout(text, text_len, err);
    } else if (st == AMP_OK) {
        st = tokenizer_encode(tok, in, in_len, &ids, &n, err);
        for (size_t i = 0; i < n && st == AMP_OK; i++)
            if (printf("%d\n", (int)ids[i]) < 0)
                st = amp_fail(err, AMP_ERR_INTERNAL, NULL, "tokenize: writing stdout: %s", strerror(errno));
        if (st == AMP_OK)
            st = write_stdout("", 0, err);
    }
    if (st == AMP_OK)
        fprintf(stderr, "tokenize: %s: %zu %s -> %zu %s (vocab %d)\n", path, decode ? n : in_len,
                decode ? "ids" : "bytes", decode ? text_len : n, decode ? "bytes" : "ids",
                (int)tokenizer_vocab_size(tok));
    free(in);
    free(text);
    free(ids);
    tokenizer_free(tok);
    return st;
}

static enum amp_status cmd_help(int argc, char **argv, struct amp_error *err);

static const struct command commands[] = {
    {"run", "ampTrain run CONFIG.yaml [KEY=VALUE ...]",
     "Train the model CONFIG.yaml describes. KEY=VALUE overrides a config key by its dotted path\n"
     "(optim.lr=3e-4, precision.mode=bf16, model.layers.1.out=256); overrides go through the same checks\n"
     "as the file. Writes config.yaml, scale_log.csv and eval.jsonl into run.out_dir.\n"
     "A run.out_dir that already holds a run is refused (exit 2), unless run.resume=auto: then the same\n"
     "command continues it from its newest checkpoint that verifies, as 'resume' would (the config must be\n"
     "the same but for the keys resume may change; exit 2 naming the first other difference), and says a\n"
     "finished run is complete (exit 0). For restarts by a scheduler or a retry loop: docs/checkpoint.md,\n"
     "\"Restarts\".",
     cmd_run, false},
    {"resume", "ampTrain resume CHECKPOINT.h5 [KEY=VALUE ...]",
     "Continue a run exactly where it stopped, from the checkpoint alone (its config is inside it).\n"
     "Overrides allowed: how long and how it logs and saves (run.steps, run.epochs, run.log_every,\n"
     "run.eval_every, run.ckpt_every, run.keep_ckpts, run.numerics_every, run.sample_every,\n"
     "run.sample_prompt, run.out_dir, run.resume), what the evaluations are watched for (run.keep_best,\n"
     "run.early_stop, run.early_stop.metric, run.early_stop.patience, run.early_stop.min_delta), where and how\n"
     "it runs (run.device, run.threads, run.recompute, dist.*), stability.*, accum_steps (to keep the\n"
     "step's batch on another number of ranks), how weights and moments are stored\n"
     "(precision.master_weights, optim.state_dtype, optim.stochastic_rounding) and precision.mode\n"
     "(with a warning: the FP32 state carries over, the loss scaler starts from its init), and the\n"
     "data's paths (data.train_bin, data.val_bin, data.files, data.path, data.train_images,\n"
     "data.train_labels, data.test_images, data.test_labels: the files must hold the data the checkpoint\n"
     "records, exit 3 naming the file when not). Anything else is refused (exit 2), and the refusal\n"
     "lists them.\n"
     "Appends to the run's scale_log.csv. See docs/checkpoint.md.",
     cmd_resume, false},
    {"eval", "ampTrain eval CHECKPOINT.h5 [--autocast on|off] [--dtype fp16|bf16] [--split test|train] [KEY=VALUE ...]",
     "Evaluate a checkpoint: loss and accuracy (perplexity for text), printed and appended to eval.jsonl\n"
     "beside the checkpoint. --autocast defaults to the run's precision; with autocast on the run's\n"
     "low-precision dtype is used unless --dtype says otherwise. An fp8 run's checkpoint evaluates\n"
     "under bf16 autocast (fp8's scales are training state; --dtype fp8 is refused), and says so.\n"
     "Reads only the split it evaluates.\n"
     "Overrides allowed: run.device, run.threads, data.batch_size, data.val_windows and the data's\n"
     "paths (data.train_bin, data.val_bin, data.files, data.path, data.train_images, data.train_labels,\n"
     "data.test_images, data.test_labels): data elsewhere is accepted when its contents are the ones\n"
     "the checkpoint records (exit 3 naming the file when not). See docs/checkpoint.md.",
     cmd_eval, false},
    {"sample", "ampTrain sample CHECKPOINT.h5 [--prompt TEXT | --prompt-file F] [--tokens N] [--temperature T] "
               "[--top-k K] [--top-p P] [--seed S] [--tokenizer FILE] [--device cpu|cuda]",
     "Generate text from a checkpoint of a text model: prints the prompt and its continuation of N tokens\n"
     "(default 256) to stdout. A byte-level model (vocabulary 256) reads and writes bytes as they are; another\n"
     "vocabulary needs its tokenizer: --tokenizer FILE (a Hugging Face tokenizer.json, or vocab.json with\n"
     "merges.txt), else the run's data.tokenizer. The prompt runs through the model once, then each new token alone, with\n"
     "the attention's keys and values kept on the device; the model runs in the run's precision, on --device\n"
     "(default: the checkpoint's run.device). Generation stops at the model's context (data.seq_len), saying\n"
     "so on stderr. An empty or absent prompt starts from a newline. --temperature (default 1; 0 is greedy),\n"
     "--top-k (default 0: every token), --top-p (default 1) shape the draw; --seed (default 0) fixes it: the\n"
     "same checkpoint, prompt and options give the same text. --prompt-file: a regular file of at most\n"
     "1 MiB. Bad options, prompt files and prompts longer than the context are exit 2. See docs/model.md,\n"
     "\"Sampling\".",
     cmd_sample, true},
    {"inspect", "ampTrain inspect CHECKPOINT.h5", "Show step, precision, scaler state and tensors of a checkpoint.",
     cmd_inspect, false},
    {"check", "ampTrain check CONFIG.yaml [KEY=VALUE ...]",
     "Validate a config and its overrides; print the resolved config as YAML (it parses back to the\n"
     "same config) and the autocast policy table.",
     cmd_check, false},
    {"numerics", "ampTrain numerics CONFIG.yaml|CHECKPOINT.h5 [--steps K] [--underflow F] [KEY=VALUE ...]",
     "What fp16, bf16 and fp8 do to this model: K steps (default 5) run in the configured precision and as\n"
     "an FP32 shadow of the same step; for every activation, activation gradient and weight gradient the\n"
     "fractions that would overflow, flush to zero or go subnormal in fp16, bf16, E4M3 and E5M2 go to\n"
     "numerics-from-step-N.csv (N: the step measured from) in run.out_dir, or for a checkpoint beside it,\n"
     "where eval writes its eval.jsonl (run.out_dir=DIR overrides). Prints headroom per tensor, the\n"
     "fp16 loss-scale window (at most F of the nonzero gradient elements flushed, default 0.001) and a\n"
     "verdict per precision mode. The K steps are trained in memory only; the run's own numerics.csv\n"
     "(run.numerics_every) is never written. See docs/precision.md.",
     cmd_numerics, true},
    {"export", "ampTrain export CHECKPOINT.h5 OUT.safetensors [--dtype fp32|bf16|fp16] [--names ampTrain|pytorch|hf-gpt2]",
     "Write the checkpoint's model weights and batchnorm running statistics to OUT in the safetensors\n"
     "format (for PyTorch's safetensors.torch.load_file and friends). --dtype (default fp32) converts with\n"
     "round to nearest even; --names ampTrain (default) keeps our LAYER/PARAM names, --names pytorch gives\n"
     "the state_dict names of the equivalent torch.nn model (LAYER.PARAM; layouts already match; a tied\n"
     "table under both of its names), --names hf-gpt2 the keys and layouts of Hugging Face's GPT2LMHeadModel\n"
     "(a GPT-2 shaped model only: else exit 2). The file is written atomically: on any failure nothing is\n"
     "left at OUT. OUT must not exist or be an earlier export (a safetensors file); anything else (the\n"
     "checkpoint, a run directory's files, a directory, a device, a FIFO, a symbolic link) is refused with\n"
     "exit 2 before any work. The checkpoint's tensors must be exactly its config's model's, names and\n"
     "shapes, as eval checks them (the model built from the config and the checkpoint's sample shape). A corrupt or\n"
     "mismatched checkpoint is exit 4, a failed write exit 1; SIGINT or SIGTERM during the write removes\n"
     "the temporary file and exits 130 / 143. See docs/checkpoint.md, \"export\".",
     cmd_export, true},
    {"tokenize", "ampTrain tokenize --tokenizer FILE [--decode] < IN > OUT",
     "Encode stdin's bytes with a Hugging Face byte-level BPE (GPT-2's: a tokenizer.json, a vocab.json with\n"
     "merges.txt beside it, or their directory) and write the ids to stdout, one per line; with --decode,\n"
     "read ids (separated by spaces or newlines) and write the bytes they stand for. A summary goes to\n"
     "stderr. A missing tokenizer is exit 2; a malformed or unsupported one (not byte-level BPE), an id\n"
     "that is not the tokenizer's, or input that is not ids is exit 3. See docs/data.md, \"Tokenizers\".",
     cmd_tokenize, false},
    {"help", "ampTrain help COMMAND", "Show the usage of COMMAND.", cmd_help, false},
};
#define NCOMMANDS (int)(sizeof commands / sizeof commands[0])

static void print_usage(FILE *out)
{
    fprintf(out, "ampTrain %s — mixed-precision training driver (fp32, fp16-static, fp16-dynamic, bf16, fp8)\n\n"
                 "usage:\n", AMP_VERSION);
    for (int i = 0; i < NCOMMANDS; i++)
        fprintf(out, "  %s\n", commands[i].usage);
    fprintf(out, "  ampTrain --help | --version\n"
                 "  mpirun -np N ampTrain run|resume|eval ...   data parallel over N ranks (docs/distributed.md)\n\n"
                 "%s\nSee README.md and docs/ for the config schema.\n", exit_codes);
}

static enum amp_status cmd_help(int argc, char **argv, struct amp_error *err)
{
    if (argc < 2) {
        print_usage(stdout);
        return AMP_OK;
    }
    for (int i = 0; i < NCOMMANDS; i++)
        if (strcmp(argv[1], commands[i].name) == 0) {
            printf("usage: %s\n\n%s\n\n%s", commands[i].usage, commands[i].help, exit_codes);
            return AMP_OK;
        }
    return amp_fail(err, AMP_ERR_CONFIG,
                    "commands: run, resume, eval, sample, inspect, check, numerics, export, tokenize, help",
                    "help: unknown command '%s'", argv[1]);
}

/* The words other trainers use for ours (and near misses), for a did-you-mean. */
static enum amp_status unknown_command(const char *cmd, struct amp_error *err)
{
    static const char *const alias[][2] = {{"train", "run"}, {"fit", "run"}, {"start", "run"}, {"continue", "resume"},
                                           {"restart", "resume"}, {"evaluate", "eval"}, {"test", "eval"},
                                           {"validate", "check"}, {"show", "inspect"}, {"info", "inspect"},
                                           {"convert", "export"}, {"save", "export"}, {"numeric", "numerics"},
                                           {"generate", "sample"}};
    const char *close = NULL;
    for (size_t i = 0; i < sizeof alias / sizeof alias[0] && !close; i++)
        if (strcmp(cmd, alias[i][0]) == 0)
            close = alias[i][1];
    char dym[64] = "";
    if (close)
        snprintf(dym, sizeof dym, " (did you mean '%s'?)", close);
    return amp_fail(err, AMP_ERR_CONFIG, "run 'ampTrain --help' for the commands", "unknown command '%s'%s", cmd, dym);
}

static void print_version(void)
{
#ifdef AMP_HAVE_CUDA
    const char *cuda = "CUDA backend: built";
#else
    const char *cuda = "CUDA backend: not built (CPU-only)";
#endif
    char loaded[512];
    backend_describe_build(loaded, sizeof loaded);
    printf("ampTrain %s\n%s\n%s\n%s\n%s\n", AMP_VERSION, cuda, loaded, comm_mpi_version(), comm_nccl_version());
}

/* Rank 0 prints every error (its own, and the others' that comm_agree brought it); another rank prints
 * only what rank 0 has not heard of, prefixed with its rank. */
static void print_error(const struct amp_error *err)
{
    if (ranks->rank == 0) {
        amp_error_print(err, stderr);
    } else if (!err->agreed) {
        fprintf(stderr, "[rank %d] ampTrain: error: %s\n", ranks->rank, err->msg);
        if (err->hint[0])
            fprintf(stderr, "[rank %d] hint: %s\n", ranks->rank, err->hint);
    }
}

int main(int argc, char **argv)
{
    struct amp_error err = {0};
    if (argc < 2) {
        print_usage(stderr);
        return AMP_ERR_CONFIG;
    }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        print_usage(stdout);
        return AMP_OK;
    }
    if (strcmp(argv[1], "--version") == 0) {
        print_version();
        return AMP_OK;
    }
    /* `ampTrain COMMAND --help` is `ampTrain help COMMAND` */
    for (int i = 2; i < argc; i++)
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            enum amp_status hs = cmd_help(2, (char *[]){"help", argv[1], NULL}, &err);
            if (hs != AMP_OK)
                amp_error_print(&err, stderr);
            return (int)hs;
        }
    enum amp_status st = comm_open(&ranks, &argc, &argv, &err);
    if (st != AMP_OK) {
        amp_error_print(&err, stderr);
        return (int)st;
    }
    if (ranks->rank != 0 && !freopen("/dev/null", "w", stdout)) /* rank 0 alone reports progress */
        fclose(stdout);
    /* every rank runs one command: a rank in another would wait in collectives the others never make */
    char what[96];
    snprintf(what, sizeof what, "the command (rank 0: '%.40s')", argv[1]);
    st = comm_agree(ranks,
                    dist_check_same(ranks, digest_str(DIGEST_INIT, argv[1]), AMP_ERR_CONFIG, what,
                                    "launch every rank with the same ampTrain command", &err),
                    &err);
    if (st == AMP_OK) {
        st = unknown_command(argv[1], &err);
        for (int i = 0; i < NCOMMANDS; i++)
            if (strcmp(argv[1], commands[i].name) != 0)
                continue;
            else if (commands[i].one_process && ranks->world > 1) /* every rank here: said once, by rank 0 */
                st = comm_agree(ranks,
                                amp_fail(&err, AMP_ERR_CONFIG, "run it as one process, without mpirun",
                                         "ampTrain %s is not data-parallel: launched as %d ranks, each would write "
                                         "its files",
                                         argv[1], ranks->world),
                                &err);
            else
                st = commands[i].fn(argc - 1, argv + 1, &err);
    }
    fflush(stdout);
    if (st != AMP_OK)
        print_error(&err);
    comm_close(ranks);
    return (int)st;
}
