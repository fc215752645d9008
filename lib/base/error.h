/*
 * error.h — the one error type of ampTrain and the exit-code table of README.md's "Commands".
 *
 * Functions that can fail return an `enum amp_status` and fill a `struct amp_error` supplied by the
 * caller. Only cmd/ turns a status into a process exit code. Every message names the file, key or
 * tensor at fault; every error carries a hint saying what to do, printed as a `hint:` line.
 */
#ifndef AMP_ERROR_H
#define AMP_ERROR_H

#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

enum amp_status {
    AMP_OK = 0,
    AMP_ERR_INTERNAL = 1,  /* internal or system error: out of memory, CUDA error, I/O error */
    AMP_ERR_CONFIG = 2,    /* usage or configuration error: bad YAML, unknown key, bad value, bad override */
    AMP_ERR_DATA = 3,      /* data error: missing or malformed dataset, labels out of range, non-finite inputs */
    AMP_ERR_CKPT = 4,      /* checkpoint error: missing, corrupt, wrong format version, shape mismatch */
    AMP_ERR_UNSTABLE = 5,  /* training became numerically unstable (fail-fast policy tripped) */
    AMP_EXIT_SIGINT = 130, /* stopped by SIGINT after a checkpoint was written */
    AMP_EXIT_SIGTERM = 143 /* stopped by SIGTERM after a checkpoint was written */
};

struct amp_error {
    enum amp_status code;
    char msg[2048];  /* what is wrong, naming the file / key / tensor; e.g. "a.yaml:3:5: unknown key ..." */
    char hint[1024]; /* what to do about it; printed after "hint: " */
    int agreed;      /* data parallel: every rank holds this error (lib/engine/dist.h, comm_agree), so rank 0 alone
                      * prints it */
};

/* Fill `err` (which may be NULL) and return `code`. `hint` may be NULL for "no specific advice". */
enum amp_status amp_fail(struct amp_error *err, enum amp_status code, const char *hint, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* A sticky error handed on (the backends' status op): `err` (which may be NULL) gets `held` where `status` is a
 * failure, and is cleared (AMP_OK, empty message and hint) where it is not. Returns `status`. */
enum amp_status amp_error_report(enum amp_status status, const struct amp_error *held, struct amp_error *err);

/* Print "ampTrain: error: MSG\nhint: HINT\n" to `out`. */
void amp_error_print(const struct amp_error *err, FILE *out);

/* Short name of a status for logs and help ("config error", ...). */
const char *amp_status_name(enum amp_status code);

#ifdef __cplusplus
}
#endif

#endif
