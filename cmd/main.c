/*
 * main.c — the ampTrain command line: argument parsing and the subcommands, nothing else.
 *
 * Every subcommand returns an `enum amp_status`; main turns it into the process exit code of
 * DESIGN.md section 1 and prints the error with its hint.
 */
#include <stdio.h>
#include <string.h>

#include "autocast.h" /* autocast_from_config, autocast_print */
#include "config.h"   /* config_load, config_apply_override, config_print_yaml */
#include "error.h"    /* enum amp_status, struct amp_error */
#include "train.h"    /* train_run */

#ifndef AMP_VERSION
#define AMP_VERSION "0.0.0"
#endif

struct command {
    const char *name;
    const char *usage;
    const char *help;
    enum amp_status (*fn)(int argc, char **argv, struct amp_error *err);
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

/* Load CONFIG and apply KEY=VALUE overrides argv[first..]. */
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
    return st;
}

static enum amp_status need_config_arg(int argc, char **argv, const char *cmd, struct amp_error *err)
{
    if (argc < 2 || argv[1][0] == '-' || strchr(argv[1], '='))
        return amp_fail(err, AMP_ERR_CONFIG, "run 'ampTrain help %s' for usage", "%s: missing CONFIG.yaml argument",
                        cmd);
    return AMP_OK;
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
    }
    config_free(&cfg);
    return st;
}

static enum amp_status cmd_run(int argc, char **argv, struct amp_error *err)
{
    enum amp_status st = need_config_arg(argc, argv, "run", err);
    if (st != AMP_OK)
        return st;
    struct config cfg;
    if ((st = load_with_overrides(&cfg, argv[1], argc, argv, 2, err)) != AMP_OK)
        return st;
    printf("ampTrain %s: run '%s' from %s -> %s\n", AMP_VERSION, cfg.run.name, argv[1], cfg.run.out_dir);
    st = train_run(&cfg, err);
    config_free(&cfg);
    return st;
}

static enum amp_status cmd_not_yet(const char *what, struct amp_error *err)
{
    return amp_fail(err, AMP_ERR_CONFIG, "train with 'ampTrain run CONFIG.yaml'; see README.md for what is built",
                    "'ampTrain %s' is not implemented in this version yet", what);
}

static enum amp_status cmd_resume(int argc, char **argv, struct amp_error *err)
{
    (void)argc, (void)argv;
    return cmd_not_yet("resume", err);
}

static enum amp_status cmd_eval(int argc, char **argv, struct amp_error *err)
{
    (void)argc, (void)argv;
    return cmd_not_yet("eval", err);
}

static enum amp_status cmd_inspect(int argc, char **argv, struct amp_error *err)
{
    (void)argc, (void)argv;
    return cmd_not_yet("inspect", err);
}

static enum amp_status cmd_help(int argc, char **argv, struct amp_error *err);

static const struct command commands[] = {
    {"run", "ampTrain run CONFIG.yaml [KEY=VALUE ...]",
     "Train the model CONFIG.yaml describes. KEY=VALUE overrides a config key by its dotted path\n"
     "(optim.lr=3e-4, precision.mode=bf16, model.layers.1.out=256); overrides go through the same checks\n"
     "as the file. Writes config.yaml, scale_log.csv and eval.jsonl into run.out_dir.",
     cmd_run},
    {"resume", "ampTrain resume CHECKPOINT.h5 [KEY=VALUE ...]", "Continue a run exactly where it stopped.", cmd_resume},
    {"eval", "ampTrain eval CHECKPOINT.h5 [--autocast on|off] [--dtype fp16|bf16] [--split test|train]",
     "Evaluate a checkpoint.", cmd_eval},
    {"inspect", "ampTrain inspect CHECKPOINT.h5", "Show step, precision, scaler state and tensors of a checkpoint.",
     cmd_inspect},
    {"check", "ampTrain check CONFIG.yaml [KEY=VALUE ...]",
     "Validate a config and its overrides; print the resolved config as YAML (it parses back to the\n"
     "same config) and the autocast policy table.",
     cmd_check},
    {"help", "ampTrain help COMMAND", "Show the usage of COMMAND.", cmd_help},
};
#define NCOMMANDS (int)(sizeof commands / sizeof commands[0])

static void print_usage(FILE *out)
{
    fprintf(out, "ampTrain %s — mixed-precision training driver (fp32, fp16-static, fp16-dynamic, bf16)\n\n"
                 "usage:\n", AMP_VERSION);
    for (int i = 0; i < NCOMMANDS; i++)
        fprintf(out, "  %s\n", commands[i].usage);
    fprintf(out, "  ampTrain --help | --version\n\n%s\nSee README.md and docs/ for the config schema.\n", exit_codes);
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
    return amp_fail(err, AMP_ERR_CONFIG, "commands: run, resume, eval, inspect, check, help",
                    "help: unknown command '%s'", argv[1]);
}

static void print_version(void)
{
#ifdef AMP_HAVE_CUDA
    const char *cuda = "CUDA backend: built";
#else
    const char *cuda = "CUDA backend: not built (CPU-only)";
#endif
    printf("ampTrain %s\n%s\n", AMP_VERSION, cuda);
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
    for (int i = 0; i < NCOMMANDS; i++) {
        if (strcmp(argv[1], commands[i].name) != 0)
            continue;
        enum amp_status st = commands[i].fn(argc - 1, argv + 1, &err);
        fflush(stdout);
        if (st != AMP_OK)
            amp_error_print(&err, stderr);
        return (int)st;
    }
    amp_fail(&err, AMP_ERR_CONFIG, "run 'ampTrain --help' for the commands", "unknown command '%s'", argv[1]);
    amp_error_print(&err, stderr);
    return AMP_ERR_CONFIG;
}
