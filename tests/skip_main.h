/*
 * skip_main.h — a main for Criterion suites whose tests skip where the hardware is missing (the GPU
 * suites): it exits 77 when tests were skipped and none failed, which CTest (SKIP_RETURN_CODE 77)
 * reports as Skipped instead of Passed. Include it in exactly one file of the suite.
 */
#ifndef AMP_SKIP_MAIN_H
#define AMP_SKIP_MAIN_H

#include <criterion/criterion.h>
#include <criterion/hooks.h>

static size_t skip_main_skipped, skip_main_failed;

ReportHook(POST_ALL)(struct criterion_global_stats *stats)
{
    skip_main_skipped = stats->tests_skipped;
    skip_main_failed = stats->tests_failed + stats->tests_crashed;
}

int main(int argc, char *argv[])
{
    struct criterion_test_set *tests = criterion_initialize();
    int status = 0;
    if (criterion_handle_args(argc, argv, true))
        status = !criterion_run_all_tests(tests);
    criterion_finalize(tests);
    if (status == 0 && skip_main_failed == 0 && skip_main_skipped > 0)
        return 77;
    return status;
}

#endif
