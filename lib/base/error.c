/*
 * error.c — filling and printing `struct amp_error`. See error.h.
 */
#include "error.h"

#include <stdarg.h>
#include <stdbool.h>
#include <string.h>

enum amp_status amp_fail(struct amp_error *err, enum amp_status code, const char *hint, const char *fmt, ...)
{
    if (!err)
        return code;
    err->code = code;
    err->agreed = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    snprintf(err->hint, sizeof err->hint, "%s", hint ? hint : "");
    return code;
}

enum amp_status amp_error_report(enum amp_status status, const struct amp_error *held, struct amp_error *err)
{
    if (err) {
        if (status != AMP_OK) {
            *err = *held;
        } else {
            err->code = AMP_OK;
            err->msg[0] = '\0';
            err->hint[0] = '\0';
        }
    }
    return status;
}

void amp_error_print(const struct amp_error *err, FILE *out)
{
    /* a stop the user asked for (SIGINT, SIGTERM) is not an error: its message says what stopped and where */
    bool asked = err->code == AMP_EXIT_SIGINT || err->code == AMP_EXIT_SIGTERM;
    fprintf(out, "ampTrain: %s%s\n", asked ? "" : "error: ", err->msg);
    if (err->hint[0])
        fprintf(out, "hint: %s\n", err->hint);
}

const char *amp_status_name(enum amp_status code)
{
    switch (code) {
    case AMP_OK: return "success";
    case AMP_ERR_INTERNAL: return "internal or system error";
    case AMP_ERR_CONFIG: return "usage or configuration error";
    case AMP_ERR_DATA: return "data error";
    case AMP_ERR_CKPT: return "checkpoint error";
    case AMP_ERR_UNSTABLE: return "numerically unstable";
    case AMP_EXIT_SIGINT: return "stopped by SIGINT";
    case AMP_EXIT_SIGTERM: return "stopped by SIGTERM";
    }
    return "unknown";
}
