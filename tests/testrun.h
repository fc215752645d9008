/*
 * testrun.h — running the ampTrain binary (AMP_BINARY) from the source directory, for the suites that
 * test the program end to end, and whether /usr/bin/python3 has torch (have_torch) for those that hold it against
 * PyTorch. Needs _POSIX_C_SOURCE (popen) defined before the first include.
 */
#ifndef AMP_TESTRUN_H
#define AMP_TESTRUN_H

#include <criterion/criterion.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h> /* getenv */
#include <string.h>
#include <sys/wait.h>

struct result {
    int code;
    char out[65536];
};

/* Run the shell command `cmd` and take its stdout (the first 64 KiB) and exit code. Returns a static buffer. */
static struct result shell(const char *cmd) __attribute__((unused));
static struct result shell(const char *cmd)
{
    static struct result r;
    memset(&r, 0, sizeof r);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    size_t n = fread(r.out, 1, sizeof r.out - 1, p);
    r.out[n] = '\0';
    int status = pclose(p);
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    return r;
}

/* The binary under test: $AMPTRAIN_BIN where set (scripts/gpu/gpu-check.sh sets it to the bundle's, which is
 * unpacked away from the build directory compiled in here), else AMP_BINARY. */
static const char *amp_binary(void) __attribute__((unused));
static const char *amp_binary(void)
{
    const char *env = getenv("AMPTRAIN_BIN");
    return env && *env ? env : AMP_BINARY;
}

/* Run `ampTrain ARGS` (ARGS may go on with more shell commands after a ';') from the source directory
 * with one BLAS thread, stderr merged into stdout. Returns a static buffer. */
static struct result amp(const char *fmt, ...) __attribute__((format(printf, 1, 2), unused));
static struct result amp(const char *fmt, ...)
{
    char args[3000], cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof cmd, "cd %s && { OPENBLAS_NUM_THREADS=1 %s %s ; } 2>&1", AMP_SOURCE_DIR, amp_binary(), args);
    return shell(cmd);
}

/* Whether /usr/bin/python3 can import torch (the suites that hold ampTrain against PyTorch skip without it). */
static bool have_torch(void) __attribute__((unused));
static bool have_torch(void)
{
    return shell("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1").code == 0;
}

#endif
