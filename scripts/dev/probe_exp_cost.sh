#!/usr/bin/env bash
# What glibc's exp costs inside an ampTrain run, and whether the vector registers' upper halves were in use when
# it was called (the state that makes every legacy-SSE instruction of the baseline-compiled engine slow; docs/backend.md,
# "Clean upper halves on return"). An LD_PRELOAD wrapper times each exp call with rdtsc and reads XINUSE
# (xgetbv 1, bits 2 and 6). The loss's softmax is where the engine calls exp.
#   scripts/dev/probe_exp_cost.sh [BINARY=build/ampTrain] [CONFIG=configs/fashion_mlp_bf16.yaml] [STEPS=200] [THREADS=1]
# x86-64 only. Prints: exp calls, cycles each (the wrapper's rdtsc pair included), and calls with the upper halves in use.
set -euo pipefail
cd "$(dirname "$0")/../.."
bin=${1:-${BINARY:-build/ampTrain}}
cfg=${CONFIG:-configs/fashion_mlp_bf16.yaml}
[ -x "$bin" ] || { echo "probe_exp_cost: $bin is not an executable (run scripts/build.sh)" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat > "$tmp/wrap.c" << 'C'
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <x86intrin.h>
static long calls, dirty;
static unsigned long long cycles;
static double (*real_exp)(double);
double exp(double x)
{
    if (!real_exp)
        real_exp = (double (*)(double))dlsym(RTLD_NEXT, "exp");
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(1));
    dirty += (lo & ((1u << 2) | (1u << 6))) != 0;
    unsigned long long t0 = __rdtsc();
    double r = real_exp(x);
    cycles += __rdtsc() - t0;
    calls++;
    return r;
}
__attribute__((destructor)) static void report(void)
{
    if (calls)
        fprintf(stderr, "probe_exp_cost: %ld exp calls, %.1f cycles each, %ld with the upper halves in use\n", calls,
                (double)cycles / (double)calls, dirty);
}
C
gcc -O2 -shared -fPIC -o "$tmp/wrap.so" "$tmp/wrap.c" -ldl
LD_PRELOAD=$tmp/wrap.so OPENBLAS_NUM_THREADS=1 "$bin" run "$cfg" "run.steps=${STEPS:-200}" run.epochs=0 run.device=cpu \
  "run.threads=${THREADS:-1}" run.log_every=100000 run.eval_every=0 run.ckpt_every=0 "run.out_dir=$tmp/run" 2>&1 |
  grep -E '^train:|^probe_exp_cost:'
