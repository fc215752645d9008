/*
 * testmem.h — bookkeeping for suites that allocate many host buffers and tensors: everything taken
 * through talloc / tracked_tensor is freed by tracked_free_to (a mark) or tracked_free_all (the
 * suite's fini), so a failing assertion leaks nothing into the next test.
 */
#ifndef AMP_TESTMEM_H
#define AMP_TESTMEM_H

#include <criterion/criterion.h>
#include <stdlib.h>

#include "backend.h" /* struct backend */
#include "tensor.h"  /* tensor_alloc, tensor_free */

#define TRACKED_MAX 512

static void *tracked_mem[TRACKED_MAX] __attribute__((unused));
static int n_mem __attribute__((unused));
static struct tensor tracked_t[TRACKED_MAX] __attribute__((unused));
static int n_t __attribute__((unused));

/* Zeroed host memory of `bytes` (at least 1). */
static inline void *talloc(size_t bytes)
{
    cr_assert_lt(n_mem, TRACKED_MAX);
    void *p = calloc(1, bytes ? bytes : 1);
    cr_assert_not_null(p);
    tracked_mem[n_mem++] = p;
    return p;
}

/* A 1-D tensor of n elements of dt on be (contents undefined). */
static inline struct tensor *tracked_tensor(struct backend *be, enum dtype dt, size_t n)
{
    cr_assert_lt(n_t, TRACKED_MAX);
    struct tensor *t = &tracked_t[n_t++];
    int64_t shape = (int64_t)n;
    struct amp_error err;
    cr_assert_eq(tensor_alloc(t, be, dt, 1, &shape, "test", &err), AMP_OK, "%s", err.msg);
    return t;
}

/* Free what was taken after the marks (n_t, n_mem as they were then). */
static inline void tracked_free_to(int t_mark, int mem_mark)
{
    while (n_t > t_mark)
        tensor_free(&tracked_t[--n_t]);
    while (n_mem > mem_mark)
        free(tracked_mem[--n_mem]);
}

static inline void tracked_free_all(void)
{
    tracked_free_to(0, 0);
}

#endif
