/*
 * test_switches.h — every switch that exists only for tests, in one place.
 *
 * A test sometimes needs the program to do what no input can make it do at a chosen moment: receive a signal
 * at a fixed point, hold a replica that differs from the others, see a fault between backward and the
 * non-finite check. Those switches are declared here and nowhere else, each with the test that uses it, so a
 * reader sees at once what production code does only for tests. They cost a getenv or a NULL check when off.
 * (Other AMPTRAIN_ variables are settings for users and are documented where they are read: AMPTRAIN_NO_TRIAL and
 * AMPTRAIN_TRIAL_LOG in lib/base/trial.h, AMPTRAIN_GEMM_* and AMPTRAIN_POOL_PROFILE in docs/backend.md.)
 */
#ifndef AMP_TEST_SWITCHES_H
#define AMP_TEST_SWITCHES_H

#include <stdbool.h>
#include <stdint.h>

struct trainer;

/* AMPTRAIN_TEST_RAISE=WHERE: test_switch_raise(WHERE) sends this process SIGTERM, so a test places a signal where
 * no timing could. The points: "setup" and "final_eval" in the run loop (lib/engine/train.c; tests/test_hostile.c
 * stop_signal tests), "export_write" after the first tensor's bytes (lib/base/safetensors.c; tests/test_export.c). */
void test_switch_raise(const char *where);

/* AMPTRAIN_TEST_PERTURB=R:S: true on rank R after optimizer step S, where lib/engine/dist.c dist_test_perturb adds 1e-3
 * to the first weight, so that the replica check has something to find (tests/test_dist.c, mpirun -x). */
bool test_switch_perturb(int rank, int64_t step);

/* AMPTRAIN_TEST_VOCAB_ALIGN=A: the CPU backend's vocab_align (backend.h) is A instead of 1, so that the CPU pads the
 * vocabulary as CUDA does and tests/test_vocabpad.c proves padded and unpadded runs give the same bits. Returns
 * `otherwise` where the variable is unset; a value that is not an integer in [1, 4096] is refused (false). */
bool test_switch_vocab_align(int otherwise, int *align);

/* fp8_state.recast_weights (lib/base/fp8.h): when set, every training pass casts each fp8 layer's weight again instead of
 * reusing the codes of the step's first micro-batch; tests/test_fp8.c's weights_are_cast_once_per_optimizer_step
 * runs it as the reference the kept codes must match bit for bit. */

/* The trainer's test hook (struct trainer's test_hook, lib/engine/train.h): when set, called after the last
 * micro-batch's backward and the reduce, before the non-finite check; tests/test_precision.c injects Inf and NaN
 * gradients there. */
struct trainer_test_hook {
    void (*after_backward)(struct trainer *t, void *user);
    void *user;
};

#endif
