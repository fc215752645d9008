/*
 * trial.h — run a parser first in a child process, so that a crash inside a library we cannot fix ends
 * the child, not ampTrain.
 *
 * HDF5 1.10 trusts a file's metadata: a crafted file (a checkpoint whose checksum was recomputed after
 * editing, or an HDF5 dataset) can overflow a heap buffer, ask for exabytes or loop inside libhdf5
 * (tests/fuzz found all three; docs/reliability.md). The readers of checkpoint.c and data_hdf5.c therefore
 * make the same HDF5 calls once in a forked child, with everything that touches a device left out; only
 * when the child returns normally does the process itself parse the file. The child's memory is its own
 * copy: it changes nothing here.
 */
#ifndef AMP_TRIAL_H
#define AMP_TRIAL_H

#include <stdbool.h>
#include <stddef.h>

enum trial_outcome {
    TRIAL_PASSED,   /* the child returned: the parse is safe to make here (it may still refuse the file) */
    TRIAL_CRASHED,  /* the child died of a signal or a sanitizer report */
    TRIAL_TIMEOUT,  /* the child ran past its time */
    TRIAL_NO_FORK,  /* fork failed: the caller parses without a trial */
};

struct trial_result {
    enum trial_outcome outcome;
    int signal;     /* TRIAL_CRASHED: the signal, or 0 for an exit status (a sanitizer's) */
    int status;     /* TRIAL_CRASHED without a signal: the exit status */
    int seconds;    /* TRIAL_TIMEOUT: the limit */
};

/* Run fn(arg) in a child process with at most `seconds` of wall time; the child's stdout and stderr go to
 * /dev/null.
 * AMPTRAIN_NO_TRIAL=1 skips the child (TRIAL_PASSED at once); AMPTRAIN_TRIAL_LOG=FILE appends the child's output
 * (a sanitizer's report of what it met) to FILE instead of discarding it, for debugging. */
struct trial_result trial_run(void (*fn)(void *arg), void *arg, int seconds);

/* A trial's limit for reading `bytes` from disk: 60 s plus 10 s per GiB. */
int trial_seconds_for(long long bytes);

/* "crashed with signal 11 (Segmentation fault)", "ran past 60 s": for messages. */
void trial_describe(const struct trial_result *r, char *buf, size_t len);

#endif
