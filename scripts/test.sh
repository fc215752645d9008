#!/usr/bin/env bash
# Install what is missing, build, and run every test — twice — then the fuzz harnesses:
#   1. the normal build (CUDA backend compiled where nvcc is present; GPU tests skip without a GPU),
#   2. a CPU-only build with AddressSanitizer + UndefinedBehaviorSanitizer; any report fails,
#   3. tests/fuzz/ (clang, libFuzzer, ASan + UBSan), each harness FUZZ_SECONDS (default 10) with a fixed seed: a
#      smoke test that the harnesses run and find nothing in our code (docs/reliability.md); campaigns are
#      scripts/check/fuzz.sh's long modes, which is where fuzzing finds things.
# Warnings are errors in the first two. Exit status is non-zero if anything fails. The time of each stage is
# printed at the end (and where a stage fails, the times so far).
set -euo pipefail
cd "$(dirname "$0")/.."

stage_names=()
stage_secs=()
stage_start=$SECONDS
stage_name=""
stage() { # stage NAME: the stage before it ends, NAME begins
  if [ -n "$stage_name" ]; then
    stage_names+=("$stage_name")
    stage_secs+=($((SECONDS - stage_start)))
  fi
  stage_name=$1
  stage_start=$SECONDS
  [ -z "$1" ] || echo "== $1 =="
}
stage_times() {
  local i
  echo "test.sh: stage times (s):"
  for i in "${!stage_names[@]}"; do printf '  %6d  %s\n' "${stage_secs[$i]}" "${stage_names[$i]}"; done
  [ -z "$stage_name" ] || printf '  %6d  %s (stopped here)\n' $((SECONDS - stage_start)) "$stage_name"
  printf '  %6d  in all\n' "$SECONDS"
}
trap stage_times EXIT
stage "dependencies"

# The run set and the test set: Criterion, PyTorch, h5py, clang/libFuzzer (scripts/install-deps.sh).
scripts/install-deps.sh --test

# Criterion's own parallelism times OpenBLAS threads oversubscribes 2-core machines.
export OPENBLAS_NUM_THREADS=1

stage "build 1/2: release (-Werror)"
BUILD_DIR=build scripts/build.sh -DAMP_WERROR=ON -DAMP_TESTS=ON -DCMAKE_BUILD_TYPE=Release
stage "tests 1/2: release"
(cd build && ctest --output-on-failure --timeout 1500)

stage "build 2/2: CPU-only with ASan + UBSan (-Werror)"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:halt_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
BUILD_DIR=build-asan scripts/build.sh -DAMP_WERROR=ON -DAMP_SANITIZE=ON -DAMP_CUDA=OFF -DAMP_TESTS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo
stage "tests 2/2: ASan + UBSan"
(cd build-asan && ctest --output-on-failure --timeout 2400)
# Criterion runs each test in a worker whose sanitizer report does not always fail the test (LeakSanitizer
# reports at worker exit): any report in the log fails the run.
if grep -nE "ERROR: (AddressSanitizer|LeakSanitizer)|runtime error:" build-asan/Testing/Temporary/LastTest.log; then
  echo "test.sh: sanitizer reports above" >&2
  exit 1
fi

stage "races: the CPU backend's threads under ThreadSanitizer"
scripts/check/tsan.sh

fuzz_seconds=${FUZZ_SECONDS:-10}
stage "fuzz: each harness $fuzz_seconds s, fixed seed"
# The libFuzzer harnesses of tests/fuzz/ (build-fuzz/, clang, ASan + UBSan + leak detection): scripts/check/fuzz.sh
# sets the sanitizer options libFuzzer needs itself and exits non-zero on any finding in our code.
SECONDS_EACH=$fuzz_seconds scripts/check/fuzz.sh
stage ""

echo "test.sh: all tests passed in both builds, ThreadSanitizer saw no race, and the fuzz harnesses found nothing in our code"
