/*
 * test_switches.c — the test-only switches read from the environment. See test_switches.h.
 */
#define _POSIX_C_SOURCE 200809L
#include "test_switches.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void test_switch_raise(const char *where)
{
    const char *v = getenv("AMPTRAIN_TEST_RAISE");
    if (v && strcmp(v, where) == 0)
        raise(SIGTERM);
}

bool test_switch_perturb(int rank, int64_t step)
{
    const char *v = getenv("AMPTRAIN_TEST_PERTURB");
    int r;
    long long at;
    return v && sscanf(v, "%d:%lld", &r, &at) == 2 && r == rank && at == step;
}

bool test_switch_vocab_align(int otherwise, int *align)
{
    const char *v = getenv("AMPTRAIN_TEST_VOCAB_ALIGN");
    *align = otherwise;
    if (!v)
        return true;
    char *end;
    long a = strtol(v, &end, 10);
    if (end == v || *end || a < 1 || a > 4096)
        return false;
    *align = (int)a;
    return true;
}
