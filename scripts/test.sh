#!/usr/bin/env bash
# Install what is missing, build, and run every test — twice — then the race check and the fuzz harnesses:
#   1. the normal build (CUDA backend compiled where nvcc is present; GPU tests skip without a GPU),
#   2. a CPU-only build with AddressSanitizer + UndefinedBehaviorSanitizer; any report fails,
#   3. scripts/check/tsan.sh: the CPU backend's threads under ThreadSanitizer, and beside it
#   4. tests/fuzz/ (clang, libFuzzer, ASan + UBSan), each harness FUZZ_SECONDS (default 5) with a fixed seed: a
#      smoke test that the harnesses run and find nothing in our code (docs/reliability.md); campaigns are
#      scripts/check/fuzz.sh's long modes, which is where fuzzing finds things.
# Each ctest runs CTEST_PARALLEL_LEVEL (default 2) suites side by side, each suite two tests at a time: a suite
# alone leaves a CPU idle while its ranks wait under mpirun, its Python references load and its last long test
# runs. The race check and the fuzz smoke run side by side (a fuzzer is one process; the TSan runs leave room).
# Warnings are errors in the first two. Exit status is non-zero if anything fails. The time of each stage is
# printed at the end (and where a stage fails, the times so far); stages run side by side are listed under one.
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
side_pid=""
on_exit() {
  # a side job still running (this script stopped early): its whole process group
  [ -z "$side_pid" ] || kill -TERM -- "-$side_pid" 2> /dev/null || true
  stage_times
}
trap on_exit EXIT
stage "dependencies"

# The run set and the test set: Criterion, PyTorch, h5py, clang/libFuzzer (scripts/install-deps.sh).
scripts/install-deps.sh --test

# Criterion's own parallelism times OpenBLAS threads oversubscribes 2-core machines.
export OPENBLAS_NUM_THREADS=1
# Suites side by side in each ctest (CMakeLists.txt gives the long ones a COST, so they start first).
export CTEST_PARALLEL_LEVEL=${CTEST_PARALLEL_LEVEL:-2}

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

fuzz_seconds=${FUZZ_SECONDS:-5}
stage "races and fuzz, side by side"
# scripts/check/tsan.sh (build-tsan/, clang + ThreadSanitizer) in the background, in a process group of its own,
# its output kept for after the fuzz stage's; the libFuzzer harnesses of tests/fuzz/ (build-fuzz/, clang, ASan +
# UBSan + leak detection) meanwhile: scripts/check/fuzz.sh sets the sanitizer options libFuzzer needs itself and
# exits non-zero on any finding in our code.
mkdir -p build-tsan
tsan_log=build-tsan/tsan-console.log
rm -f "$tsan_log.rc"
side_start=$SECONDS
# shellcheck disable=SC2016 # expanded by the inner bash
setsid bash -c 'start=$SECONDS; rc=0; scripts/check/tsan.sh > "$1" 2>&1 || rc=$?; echo "$rc $((SECONDS - start))" >> "$1.rc"' \
  tsan "$tsan_log" &
side_pid=$!
echo "== races: the CPU backend's threads under ThreadSanitizer (scripts/check/tsan.sh, in the background) =="
echo "== fuzz: each harness $fuzz_seconds s, fixed seed =="
fuzz_rc=0
SECONDS_EACH=$fuzz_seconds scripts/check/fuzz.sh || fuzz_rc=$?
fuzz_secs=$((SECONDS - side_start))
tsan_rc=0
wait "$side_pid" || tsan_rc=$?
side_pid=""
echo "== races: scripts/check/tsan.sh's output =="
cat "$tsan_log"
read -r tsan_rc tsan_secs < "$tsan_log.rc" || { tsan_rc=1; tsan_secs=$((SECONDS - side_start)); }
stage ""
stage_names+=("  races: the CPU backend's threads under ThreadSanitizer (its build included)" "  fuzz: each harness $fuzz_seconds s, fixed seed (its build included)")
stage_secs+=("$tsan_secs" "$fuzz_secs")
[ "$tsan_rc" -eq 0 ] || { echo "test.sh: ThreadSanitizer reported a race or a run failed (above; exit $tsan_rc)" >&2; exit 1; }
[ "$fuzz_rc" -eq 0 ] || { echo "test.sh: the fuzz harnesses found something in our code (above; exit $fuzz_rc)" >&2; exit 1; }

echo "test.sh: all tests passed in both builds, ThreadSanitizer saw no race, and the fuzz harnesses found nothing in our code"
