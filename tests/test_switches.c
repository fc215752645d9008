/*
 * test_switches.c — the test-only switches (lib/base/test_switches.h) read their variables as documented, and do
 * nothing when the variable is unset or names another point.
 */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <signal.h>
#include <stdlib.h>

#include "test_switches.h"

Test(switches, perturb_fires_on_its_rank_after_its_step_only)
{
    unsetenv("AMPTRAIN_TEST_PERTURB");
    cr_assert_not(test_switch_perturb(1, 3), "unset: off");
    setenv("AMPTRAIN_TEST_PERTURB", "1:3", 1);
    cr_assert(test_switch_perturb(1, 3));
    cr_assert_not(test_switch_perturb(0, 3), "another rank");
    cr_assert_not(test_switch_perturb(1, 4), "another step");
    setenv("AMPTRAIN_TEST_PERTURB", "1", 1);
    cr_assert_not(test_switch_perturb(1, 3), "no step given: off");
    unsetenv("AMPTRAIN_TEST_PERTURB");
}

static volatile sig_atomic_t got;
static void on_term(int sig) { got = sig; }

Test(switches, raise_sends_sigterm_at_the_named_point_only)
{
    signal(SIGTERM, on_term);
    got = 0;
    unsetenv("AMPTRAIN_TEST_RAISE");
    test_switch_raise("setup");
    cr_assert_eq(got, 0, "unset: off");
    setenv("AMPTRAIN_TEST_RAISE", "final_eval", 1);
    test_switch_raise("setup");
    cr_assert_eq(got, 0, "another point");
    test_switch_raise("final_eval");
    cr_assert_eq(got, SIGTERM);
    unsetenv("AMPTRAIN_TEST_RAISE");
    signal(SIGTERM, SIG_DFL);
}

Test(switches, vocab_align_reads_an_integer_from_1_to_4096_or_refuses)
{
    int a = -1;
    unsetenv("AMPTRAIN_TEST_VOCAB_ALIGN");
    cr_assert(test_switch_vocab_align(1, &a));
    cr_assert_eq(a, 1, "unset: the backend's own");
    setenv("AMPTRAIN_TEST_VOCAB_ALIGN", "64", 1);
    cr_assert(test_switch_vocab_align(1, &a));
    cr_assert_eq(a, 64);
    setenv("AMPTRAIN_TEST_VOCAB_ALIGN", "4096", 1);
    cr_assert(test_switch_vocab_align(1, &a) && a == 4096);
    static const char *const bad[] = {"", "x", "64x", "0", "-64", "4097", "99999999999999999999"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        setenv("AMPTRAIN_TEST_VOCAB_ALIGN", bad[i], 1);
        cr_assert_not(test_switch_vocab_align(1, &a), "'%s' is refused", bad[i]);
    }
    unsetenv("AMPTRAIN_TEST_VOCAB_ALIGN");
}
