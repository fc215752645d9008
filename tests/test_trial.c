/*
 * test_trial.c — the trial child of lib/base/trial.h: a parser that crashes, loops or trips a sanitizer ends the
 * child, and the caller learns which; one that returns passes.
 */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "trial.h"

static void returns(void *arg) { *(int *)arg = 1; /* the child's copy: the caller's stays 0 */ }
/* SIGKILL, not SIGSEGV: under ASan a SEGV becomes its report and an abort */
static void killed(void *arg) { (void)arg; raise(SIGKILL); }
static void aborts(void *arg) { (void)arg; abort(); }
static void loops(void *arg) { (void)arg; for (;;) pause(); }
static void exits_like_a_sanitizer(void *arg) { (void)arg; _exit(1); }
static void prints(void *arg) { (void)arg; printf("the child's stdout goes nowhere\n"); fflush(stdout); }

Test(trial, a_parser_that_returns_passes_and_changes_nothing_here)
{
    int touched = 0;
    struct trial_result r = trial_run(returns, &touched, 10);
    cr_assert_eq(r.outcome, TRIAL_PASSED);
    cr_assert_eq(touched, 0);
    cr_assert_eq(trial_run(prints, NULL, 10).outcome, TRIAL_PASSED);
}

Test(trial, a_crash_is_the_childs)
{
    struct trial_result r = trial_run(killed, NULL, 10);
    cr_assert_eq(r.outcome, TRIAL_CRASHED);
    cr_assert_eq(r.signal, SIGKILL);
    char text[96];
    trial_describe(&r, text, sizeof text);
    cr_assert(strstr(text, "crashed with signal 9"), "%s", text);
    r = trial_run(aborts, NULL, 10);
    cr_assert_eq(r.outcome, TRIAL_CRASHED);
    cr_assert_eq(r.signal, SIGABRT);
    r = trial_run(exits_like_a_sanitizer, NULL, 10);
    cr_assert_eq(r.outcome, TRIAL_CRASHED);
    cr_assert_eq(r.status, 1);
}

Test(trial, a_loop_runs_out_of_time)
{
    struct trial_result r = trial_run(loops, NULL, 1);
    cr_assert_eq(r.outcome, TRIAL_TIMEOUT);
    char text[96];
    trial_describe(&r, text, sizeof text);
    cr_assert_str_eq(text, "ran past 1 s");
}

Test(trial, the_environment_can_switch_it_off)
{
    setenv("AMPTRAIN_NO_TRIAL", "1", 1);
    cr_assert_eq(trial_run(killed, NULL, 10).outcome, TRIAL_PASSED, "not run at all");
    unsetenv("AMPTRAIN_NO_TRIAL");
    cr_assert_eq(trial_seconds_for(0), 60);
    cr_assert_eq(trial_seconds_for(3LL << 30), 90);
}
