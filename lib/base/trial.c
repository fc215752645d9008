/*
 * trial.c — parse first in a child process (trial.h).
 */
#define _POSIX_C_SOURCE 200809L
#include "trial.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

int trial_seconds_for(long long bytes)
{
    long long s = 60 + 10 * (bytes >> 30);
    return s > 3600 ? 3600 : (int)s;
}

struct trial_result trial_run(void (*fn)(void *arg), void *arg, int seconds)
{
    const char *off = getenv("AMPTRAIN_NO_TRIAL");
    if (off && strcmp(off, "1") == 0)
        return (struct trial_result){.outcome = TRIAL_PASSED};
    fflush(NULL); /* nothing buffered is written twice */
    pid_t pid = fork();
    if (pid < 0)
        return (struct trial_result){.outcome = TRIAL_NO_FORK};
    if (pid == 0) {
        /* The child: no output (a sanitizer's report of a crash inside libhdf5 included: the caller reports
         * the outcome), default signals (a SIGTERM handler of the parent's would only set a flag), and _exit,
         * which runs no atexit handlers (MPI's, the leak checker's) and flushes nothing. */
        const char *log = getenv("AMPTRAIN_TRIAL_LOG"); /* debugging: where the child's output goes */
        int null = log && *log ? open(log, O_WRONLY | O_CREAT | O_APPEND, 0644) : -1;
        if (null < 0)
            null = open("/dev/null", O_WRONLY);
        if (null >= 0) {
            dup2(null, STDOUT_FILENO);
            dup2(null, STDERR_FILENO);
        }
        signal(SIGINT, SIG_DFL);
        signal(SIGTERM, SIG_DFL);
        alarm((unsigned)seconds);
        fn(arg);
        _exit(0);
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
        return (struct trial_result){.outcome = TRIAL_PASSED};
    if (WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM)
        return (struct trial_result){.outcome = TRIAL_TIMEOUT, .seconds = seconds};
    if (WIFSIGNALED(status))
        return (struct trial_result){.outcome = TRIAL_CRASHED, .signal = WTERMSIG(status)};
    return (struct trial_result){.outcome = TRIAL_CRASHED, .status = WEXITSTATUS(status)};
}

void trial_describe(const struct trial_result *r, char *buf, size_t len)
{
    switch (r->outcome) {
    case TRIAL_CRASHED:
        if (r->signal)
            snprintf(buf, len, "crashed with signal %d (%s)", r->signal, strsignal(r->signal));
        else
            snprintf(buf, len, "failed with exit status %d (a sanitizer's report)", r->status);
        break;
    case TRIAL_TIMEOUT: snprintf(buf, len, "ran past %d s", r->seconds); break;
    default: snprintf(buf, len, "passed"); break;
    }
}
