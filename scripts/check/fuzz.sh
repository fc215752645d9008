#!/usr/bin/env bash
# Build the libFuzzer harnesses (tests/fuzz/, CMake option AMP_FUZZ) into build-fuzz/ with clang and run them.
#
#   SECONDS_EACH=60 scripts/check/fuzz.sh   CI mode: each harness 60 s, one after another, fixed seed (-seed=1, then 2, 3, ...
#                                     for the restarts below), the repo's corpus copied to build-fuzz/ci/HARNESS/corpus
#                                     (tests/fuzz/corpus is never written). Exit 1 on any finding in our code.
#   HOURS=1 scripts/check/fuzz.sh           long run: HOURS in all, split evenly over the harnesses, run one after another;
#                                     each harness runs JOBS (default: nproc) fuzzers in parallel on one corpus, which
#                                     grows in build-fuzz/corpus/HARNESS; random seeds.
#   CPU_HOURS=1 scripts/check/fuzz.sh       long run measured in CPU time, not wall time: each harness fuzzes until its
#                                     processes (fuzzers and the trial children they fork) have used CPU_HOURS/n
#                                     CPU-hours, however busy the machine is; then its fuzzers are interrupted.
#                                     HOURS, if given too, caps the wall time; otherwise the cap is 4x the budget
#                                     over JOBS. Every long run's table gives the CPU seconds the harness used.
#   HARNESS=fuzz_data (or data)       run one harness only (default: all of them).
#   FUZZ_ARGS="-max_len=512 ..."      more libFuzzer flags; AMPTRAIN_FUZZ_ORACLES=0 hunts crashes only (fuzz_common.h).
#   REPLAY=1 HARNESS=X scripts/check/fuzz.sh  no fuzzing: replay and classify every finding kept in build-fuzz/findings/X/
#                                     (a run triages its first TRIAGE_MAX=30 and keeps the rest unreplayed; their
#                                     count is the table's last column); a finding's report is reused unless the
#                                     harness was built after it (then it is replayed anew on this build).
#
# libFuzzer stops at a finding; this script starts it again on the same corpus until the harness's time is up, so
# one run lists every finding it meets (libFuzzer's own -fork mode would too, but restarting a job costs seconds
# here: the checkpoint harnesses train their seed at start). Every finding (crash-*, leak-*, timeout-*, oom-*) is
# kept in build-fuzz/findings/HARNESS/, replayed once (its report next to it, FILE.txt; rerun it with
# build-fuzz/HARNESS FILE, AMPTRAIN_FUZZ_VERBOSE=1 says what became of it) and summarised on one line: the sanitizer or
# oracle, where, the top frames in our code, the reproducer. Where is "ours" (lib/, models/), "libhdf5" (inside
# HDF5, on HDF5's own memory: we cannot fix it; fuzz_ckpt_resealed and the raw-HDF5 mode of fuzz_data reach HDF5's
# parser with malformed files by design, with lib/base/trial.h's child process turned off), libyaml, zlib or harness.
# Findings in libhdf5 are counted apart and fail the run only with FUZZ_FAIL_ON_HDF5=1; so do those that do not
# reproduce alone (an earlier input of the same process left state behind); any other finding fails it, and in
# fuzz_ckpt_guarded (the trial process on, as in production) every finding but a leak inside libhdf5 does, or a
# crash inside libhdf5 that the trial child met and the parent refused (exit 4): "trial child, contained", counted
# with the libhdf5 findings (the child's sanitizer report is replayed into FILE.child.txt). The
# output ends with a table for docs: harness, seconds, execs, cov and ft (libFuzzer's last status line), corpus
# size, findings (ours), libhdf5 findings, not reproducible, not replayed (over TRIAGE_MAX: REPLAY=1 does them).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
build="build-fuzz"
all_harnesses=(fuzz_config fuzz_ckpt_raw fuzz_ckpt_resealed fuzz_ckpt_guarded fuzz_ckpt_edit fuzz_ckpt_fp8 fuzz_data
               fuzz_safetensors fuzz_tokenizer)

# ---- per harness: seed corpus, dictionary, longest input -------------------------------------------
corpus_of() { case $1 in fuzz_ckpt_raw | fuzz_ckpt_resealed | fuzz_ckpt_guarded) echo ckpt_raw ;; *) echo "${1#fuzz_}" ;; esac; }
# fuzz_ckpt_fp8's corpus (ckpt_fp8) is the fp8 checkpoint the harness writes at start, plus what it finds
dict_of() {
  case $1 in
    fuzz_config) echo tests/fuzz/config.dict ;;
    fuzz_ckpt_raw | fuzz_ckpt_resealed | fuzz_ckpt_guarded | fuzz_ckpt_fp8) echo tests/fuzz/ckpt.dict ;;
    fuzz_data) echo tests/fuzz/data.dict ;;
    fuzz_safetensors) echo tests/fuzz/safetensors.dict ;;
    fuzz_tokenizer) echo tests/fuzz/tokenizer.dict ;;
  esac
}
max_len_of() {
  case $1 in
    fuzz_config) echo 8192 ;;
    fuzz_ckpt_raw | fuzz_ckpt_resealed | fuzz_ckpt_guarded | fuzz_ckpt_fp8) echo 131072 ;; # the seed checkpoint is ~80 KB
    fuzz_ckpt_edit) echo 4096 ;;
    fuzz_data) echo 16384 ;;
    fuzz_safetensors) echo 8192 ;;
    fuzz_tokenizer) echo 16384 ;; # the seed tokenizer.json is 6 KB
  esac
}

if [ -n "${HARNESS:-}" ]; then
  harnesses=("fuzz_${HARNESS#fuzz_}")
  case " ${all_harnesses[*]} " in *" ${harnesses[0]} "*) ;; *)
    echo "fuzz.sh: unknown HARNESS=$HARNESS (one of: ${all_harnesses[*]})" >&2
    exit 2
  esac
else
  harnesses=("${all_harnesses[@]}")
fi

jobs=${JOBS:-$(nproc)}
per_harness() { awk -v h="$1" -v n="${#harnesses[@]}" 'BEGIN { s = int(h * 3600 / n); print s < 1 ? 1 : s }'; }
cpu_budget=0 # CPU seconds each harness may use (CPU_HOURS); 0: none, the wall time decides
if [ -n "${CPU_HOURS:-}" ]; then
  mode=long
  cpu_budget=$(per_harness "$CPU_HOURS")
  if [ -n "${HOURS:-}" ]; then seconds=$(per_harness "$HOURS"); else seconds=$((4 * cpu_budget / jobs + 60)); fi
elif [ -n "${HOURS:-}" ]; then
  mode=long
  seconds=$(per_harness "$HOURS")
else
  mode=ci
  seconds=${SECONDS_EACH:-60}
fi
# The inputs' scratch files go to a tmpfs where there is one: fuzz_ckpt_raw writes every input to a file, and on
# this machine's disk it spent 65% of its time waiting (30 s: 207,056 executions on disk, 1,854,223 in /dev/shm).
scratch_root=${FUZZ_TMPDIR:-}
if [ -z "$scratch_root" ] && [ -d /dev/shm ] && [ -w /dev/shm ]; then scratch_root=/dev/shm; fi
[ -n "$scratch_root" ] && trap 'rm -rf "${scratch_root:?}/amp-fuzz-$$"' EXIT

# ---- build -----------------------------------------------------------------------------------------
command -v clang > /dev/null || { echo "fuzz.sh: clang is missing (scripts/install-deps.sh --test installs it)" >&2; exit 2; }
echo "== fuzz: building $build (clang, libFuzzer + ASan + UBSan, CPU only) =="
mkdir -p "$build"
cmake -S . -B "$build" -DCMAKE_C_COMPILER=clang -DAMP_FUZZ=ON -DAMP_CUDA=OFF -DAMP_MPI=OFF -DAMP_TESTS=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo > "$build/configure.log" 2>&1 || { cat "$build/configure.log" >&2; exit 1; }
cmake --build "$build" --target fuzz -j "${BUILD_JOBS:-$(nproc)}"

# The sanitizer settings of scripts/test.sh's ASan stage would do too; these are the ones libFuzzer wants.
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:halt_on_error=1:symbolize=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:symbolize=1"
export OPENBLAS_NUM_THREADS=1
if command -v llvm-symbolizer > /dev/null; then
  ASAN_SYMBOLIZER_PATH=$(command -v llvm-symbolizer)
  export ASAN_SYMBOLIZER_PATH
fi

# ---- CPU time ----------------------------------------------------------------------------------------
# children_cpu: CPU seconds (user + system) of every child of this script that has ended and been waited for
# (bash's `times`, second line), the fuzzers and what they forked included: the table's "CPU s" is its difference
# around a harness's fuzzing.
# (`times` runs in this shell, not in a command substitution's subshell, whose children are not these.)
children_cpu() { # FILE: write the figure to FILE
  times > "$1.times"
  awk 'NR == 2 { s = 0; for (i = 1; i <= 2; i++) { split($i, t, /[ms]/); s += t[1] * 60 + t[2] } print s }' \
    "$1.times" > "$1"
}
# tree_cpu ROOT: CPU seconds used so far by ROOT and every process below it, live or ended: each process's own
# user + system time and its waited-for children's (fields 14-17 of /proc/PID/stat), summed over the live tree.
tree_cpu() {
  local tck
  tck=$(getconf CLK_TCK)
  cat /proc/[0-9]*/stat 2> /dev/null | awk -v root="$1" -v tck="$tck" '
    { line = $0; pid = $1; sub(/^.*\) /, "", line); split(line, f, " ")
      ppid[pid] = f[2]; t[pid] = f[12] + f[13] + f[14] + f[15] } # fields 4, 14-17 of stat, counted after "comm"
    END { for (p in ppid) { q = p; while (q in ppid && q != root && q > 1) q = ppid[q]; if (q == root) s += t[p] }
          print s / tck }'
}
# cpu_watch ROOT BUDGET: once ROOT's tree has used BUDGET CPU seconds, mark the harness stopped and interrupt its
# fuzzers (through the `timeout` that runs each: it passes SIGINT on; libFuzzer ends with its final stats).
cpu_watch() {
  while kill -0 "$1" 2> /dev/null; do
    if awk -v u="$(tree_cpu "$1")" -v b="$2" 'BEGIN { exit !(u >= b) }'; then
      touch "$work/stop"
      pkill -INT -x timeout -P "$(pgrep -d, -P "$1")" 2> /dev/null || true
    fi
    sleep 2
  done
}

# ---- triage: replay one finding, print "KIND | WHERE | TOP FRAMES" --------------------------------------
triage() {
  local bin=$1 file=$2 log=$2.txt child=$2.child.txt
  # full stacks through libraries built without frame pointers (libhdf5), so an allocation shows who asked for it;
  # the trial process's own output (fuzz_ckpt_guarded) kept in FILE.child.txt (lib/base/trial.h: AMPTRAIN_TRIAL_LOG)
  if [ ! -f "$log" ] || [ "$bin" -nt "$log" ]; then # none yet, or made by an older build of the harness
    rm -f "$child"
    ASAN_OPTIONS="$ASAN_OPTIONS:fast_unwind_on_malloc=0:malloc_context_size=40" TMPDIR=$tmpdir \
      AMPTRAIN_TRIAL_LOG=$root/$child timeout 120 "$bin" -runs=1 -timeout=10 -rss_limit_mb=2048 "$file" > "$log" 2>&1 ||
      true
  fi
  local line
  line=$(classify "$log")
  # The trial child is a fork of the fuzzer: a sanitizer report in it makes libFuzzer's handler there write a
  # crash- file, while the parent refuses the input (exit 4) and carries on, so the replay's own output shows
  # nothing. The child's report says what it met: "trial child, contained" (a crash inside libhdf5 is what the
  # trial is for; one in our code is still ours).
  if [[ $line == "does not reproduce alone"* ]] && [ -s "$child" ] && grep -qE "ERROR: |runtime error: " "$child"; then
    line="trial child, contained: $(classify "$child")"
  fi
  # The RSS limit is checked once a second against the peak, so the report comes after the allocation that
  # crossed it and shows no stack of it (a 1.9 GB buffer inside libhdf5 reads as the harness's). Replay once
  # more with every malloc over 256 MB stopped where it is made, and name that allocation if there is one. So too a
  # malloc over the limit whose report lost its stack: the RSS limit can end the process while it prints one (its
  # report then shows both out-of-memory errors and "Broken pipe"), and classify files it as the harness's.
  if [[ $line == "out-of-memory (rss)"* || $line == "out-of-memory (malloc over the limit) | harness | -" ]]; then
    local big=$2.malloc.txt
    [ -f "$big" ] || ASAN_OPTIONS="$ASAN_OPTIONS:fast_unwind_on_malloc=0:malloc_context_size=40" TMPDIR=$tmpdir \
      timeout 120 "$bin" -runs=1 -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=256 "$file" > "$big" 2>&1 || true
    local again
    again=$(classify "$big")
    if [[ $again == "out-of-memory (malloc over the limit)"* ]]; then
      [[ $line == "out-of-memory (rss)"* ]] && again="out-of-memory (rss; a malloc over 256 MB)${again#out-of-memory (malloc over the limit)}"
      line=$again
    fi
  fi
  echo "$line"
}

# "KIND | WHERE | TOP FRAMES" of one sanitizer or libFuzzer report
classify() {
  awk -v root="$root/" '
    function frame_kind(line) {
      if (index(line, root "lib/") || index(line, root "models/")) return "ours"
      if (line ~ /libhdf5/) return "libhdf5"
      if (line ~ /libyaml/) return "libyaml"
      if (line ~ /libz\.so/) return "zlib"
      if (index(line, root "tests/fuzz/")) return "harness"
      return ""
    }
    !kind && /ORACLE FAILED/ { sub(/.*ORACLE FAILED at [^ ]* /, ""); kind = "oracle: " substr($0, 1, 110); where = "ours" }
    !kind && /ERROR: AddressSanitizer: requested allocation size/ { kind = "ASan allocation-size-too-big" }
    !kind && /ERROR: AddressSanitizer: / { match($0, /AddressSanitizer: [^ ]+/); kind = "ASan " substr($0, RSTART + 18, RLENGTH - 18) }
    !kind && /ERROR: LeakSanitizer/ { kind = "LSan leak" }
    !kind && /runtime error: / { sub(/.*runtime error: /, ""); kind = "UBSan " substr($0, 1, 90) }
    !kind && /ERROR: libFuzzer: timeout/ { kind = "timeout (>10 s)" }
    !kind && /ERROR: libFuzzer: out-of-memory/ { kind = "out-of-memory" ($0 ~ /malloc/ ? " (malloc over the limit)" : " (rss)") }
    !kind && /ERROR: libFuzzer: deadly signal/ { kind = "deadly signal" }
    # the first stack is where it broke; an "allocated by" / "located in stack of" stack says whose memory it was
    /allocated by thread|freed by thread|is located in stack of thread|Direct leak|Indirect leak/ { section = "owner" }
    /^ *#[0-9]+ 0x/ && section == "after" { next }
    /^ *#[0-9]+ 0x/ {
      k = frame_kind($0)
      if ($3 == "in") { fn = $4; loc = $5 } else { fn = "?"; loc = $3 }
      sub(/^\(/, "", loc); sub(/\)$/, "", loc); sub(/.*\//, "", loc); sub(/:[0-9]+$/, "", loc)
      if (section == "owner") {
        if (k != "" && k != "harness" && !owner) owner = k
        if (owner && k == owner && fn != "?" && fn !~ /^H5(FL|MM)_/ && !owner_at) owner_at = fn " " loc
        if (k == "ours" && !owner_ours) owner_ours = fn " " loc
        next
      }
      if (k != "" && k != "harness" && !where) where = k
      if (k == "ours" && nours < 3) ours = ours (nours++ ? " < " : "") fn " " loc
      started = 1
    }
    started && /^ *$/ && !section { section = "after" }
    END {
      if (!kind) { kind = "does not reproduce alone"; where = "unknown" }
      if (owner) where = owner
      if (!where) where = "harness"
      if (owner_ours && owner_at != owner_ours) owner_at = owner_at (owner_at ? " from " : "") owner_ours
      if (owner_at && kind !~ /leak/) ours = (ours ? ours : "-") " (memory of " owner_at ")"
      if (kind ~ /leak/) ours = "allocated in " (owner_at ? owner_at : "?")
      printf "%s | %s | %s\n", kind, where, ours ? ours : "-"
    }' "$1"
}

# ---- account for one harness's findings ----------------------------------------------------------------
# account HARNESS BIN MAX DIR FRESH: triage the findings named in DIR (their copies in build-fuzz/findings/HARNESS)
# up to MAX of them, keep the rest unreplayed; FRESH=1 replays each anew (a run: the same bytes may behave otherwise
# in this tree), else an existing report is reused where it is newer than BIN. Sets nours, nhdf5, nflaky, nskip and n, and prints the distinct
# lines and one FINDING line each.
account() {
  local h=$1 bin=$2 max=$3 dir=$4 fresh=$5 f kept line
  nours=0 nhdf5=0 nflaky=0 nskip=0 n=0
  local lines=()
  for f in "$dir"/crash-* "$dir"/leak-* "$dir"/timeout-* "$dir"/oom-*; do
    [[ -f $f && $f != *.txt ]] || continue
    n=$((n + 1))
    kept=$build/findings/$h/$(basename "$f")
    if [ $n -gt "$max" ]; then # mostly the same few bugs again: kept, not replayed (counted in the last column)
      nskip=$((nskip + 1))
      lines+=("not replayed (over TRIAGE_MAX=$max) | ? | - | $kept")
      continue
    fi
    [ "$fresh" = 1 ] && rm -f "$kept.txt"
    line=$(triage "$bin" "$kept")
    case $h:$line in
      *:"trial child, contained: "*" | libhdf5 | "*) nhdf5=$((nhdf5 + 1)) ;; # refused with exit 4, as promised
      *:"does not reproduce alone"*) nflaky=$((nflaky + 1)) ;;
      fuzz_ckpt_guarded:"LSan leak | libhdf5 | "*) nhdf5=$((nhdf5 + 1)) ;; # no crash: the trial cannot catch it
      fuzz_ckpt_guarded:*) nours=$((nours + 1)) ;; # the trial process promises that no crash reaches us
      *" | libhdf5 | "*) nhdf5=$((nhdf5 + 1)) ;;
      *) nours=$((nours + 1)) ;;
    esac
    lines+=("$line | $kept")
  done
  if [ $n -gt 0 ]; then
    echo "-- $h: $n findings; distinct (count | kind | where | top frames in our code):"
    printf '%s\n' "${lines[@]}" | sed -E 's/ \| [^|]*$//' | sort | uniq -c | sort -rn
    for line in "${lines[@]}"; do echo "FINDING $h | $line"; done
  fi
}

# ---- run ---------------------------------------------------------------------------------------------
rows=()
failed=0
mkdir -p "$build/findings"
if [ "${REPLAY:-0}" = 1 ]; then
  for h in "${harnesses[@]}"; do
    tmpdir=$build/replay/$h/tmp
    mkdir -p "$tmpdir" "$build/findings/$h"
    echo "== fuzz: replaying the findings kept in $build/findings/$h =="
    account "$h" "$build/$h" "${TRIAGE_MAX:-1000000}" "$build/findings/$h" 0
    [ $nours -gt 0 ] && failed=1
    rows+=("| $h | $n | $nours | $nhdf5 | $nflaky | $nskip |")
  done
  echo
  echo "== fuzz: replay summary (findings in $build/findings/) =="
  echo "| harness | findings kept | ours | libhdf5 | not reproducible | not replayed |"
  echo "|---|---:|---:|---:|---:|---:|"
  printf '%s\n' "${rows[@]}"
  exit $failed
fi
for h in "${harnesses[@]}"; do
  bin=$build/$h
  if [ "$mode" = ci ]; then
    work=$build/ci/$h
    rm -rf "$work"
    corpus=$work/corpus
  else
    work=$build/long/$h
    corpus=$build/corpus/$h
  fi
  tmpdir=$work/tmp
  if [ -n "$scratch_root" ]; then # on the tmpfs, under a name that says whose it is; build-fuzz/ keeps a link
    mkdir -p "$scratch_root/amp-fuzz-$$"
    tmpdir=$scratch_root/amp-fuzz-$$/$h
    mkdir -p "$tmpdir"
    rm -rf "$work/tmp" && mkdir -p "$work" && ln -sfn "$tmpdir" "$work/tmp"
  fi
  artifacts=$work/artifacts
  mkdir -p "$corpus" "$tmpdir" "$artifacts" "$build/findings/$h"
  rm -rf "${tmpdir:?}"/* "${artifacts:?}"/* "$work"/fuzz-*.log
  cp -n "tests/fuzz/corpus/$(corpus_of "$h")"/* "$corpus"/ 2> /dev/null || true
  if [ "$(corpus_of "$h")" = ckpt_raw ] || [ "$(corpus_of "$h")" = ckpt_fp8 ]; then
    # a checkpoint written by this build, besides the committed one (the harness writes it at start)
    AMPTRAIN_FUZZ_WRITE_SEED=$root/$corpus/seed-current.h5 TMPDIR=$tmpdir "$bin" -runs=0 > /dev/null 2>&1 || true
  fi
  args=(-timeout=10 -rss_limit_mb=2048 -max_len="$(max_len_of "$h")" -artifact_prefix="$artifacts/"
        -print_final_stats=1)
  dict=$(dict_of "$h")
  [ -n "$dict" ] && args+=(-dict="$dict")
  # shellcheck disable=SC2206
  args+=(${FUZZ_ARGS:-})
  echo "== fuzz: $h, $seconds s ($mode mode${HOURS:+, $jobs in parallel}) =="
  # One fuzzer, restarted after each finding until the deadline. A start whose finding came before libFuzzer
  # had loaded its corpus (no INITED line: a corpus input that fails at once) counts as a spin, and 20 spins in
  # a row end the harness's run; a start that fuzzed resets the count, so a harness that meets a finding every
  # few seconds (fuzz_ckpt_resealed meets libhdf5's) runs to its deadline. (A cap of 100 starts in all ended an
  # hour's run of fuzz_ckpt_resealed after 14 minutes.) CI: seeds 1, 2, ...; long runs: random.
  fuzz_until() { # WORKER DEADLINE
    local w=$1 deadline=$2 start=0 spins=0 left
    while left=$((deadline - $(date +%s))) && [ $left -gt 0 ] && [ $spins -lt 20 ] && [ ! -e "$work/stop" ]; do
      start=$((start + 1))
      local seed=()
      [ "$mode" = ci ] && seed=("-seed=$start")
      local before after
      before=$(find "$artifacts" -type f | wc -l)
      { TMPDIR=$tmpdir timeout $((left + 120)) "$bin" "${args[@]}" "${seed[@]}" -max_total_time=$left "$corpus" \
          > "$work/fuzz-$w-$start.log" 2>&1; } 2> /dev/null && break # (no "Aborted" line from bash per finding)
      after=$(find "$artifacts" -type f | wc -l)
      [ "$after" -gt "$before" ] || break # it failed without a finding: reported below, not retried
      if grep -q "INITED" "$work/fuzz-$w-$start.log"; then spins=0; else spins=$((spins + 1)); fi
      drop_findings_from_corpus
    done
  }
  # A corpus input that is itself a finding (a seed the code under test now fails on) would end every start
  # at once: take it out of the corpus (the repo's copy stays), so the next start fuzzes on. libFuzzer names a
  # finding by the SHA-1 of its bytes.
  drop_findings_from_corpus() {
    local hashes
    hashes=$(find "$artifacts" -type f -printf '%f\n' | sed -nE 's/^(crash|leak|timeout|oom)-([0-9a-f]{40})$/\2/p')
    [ -n "$hashes" ] || return 0
    find "$corpus" -type f -exec sha1sum {} + | { grep -F -f <(echo "$hashes") || true; } | cut -c43- | xargs -r rm -f
  }
  rm -f "$work/stop"
  children_cpu "$work/cpu-before"
  t_start=$(date +%s)
  deadline=$((t_start + seconds))
  if [ "$mode" = ci ]; then
    fuzz_until 1 "$deadline"
  else
    ( for w in $(seq "$jobs"); do fuzz_until "$w" "$deadline" & done; wait ) &
    workers=$!
    if [ "$cpu_budget" -gt 0 ]; then
      cpu_watch "$workers" "$cpu_budget" &
      watcher=$!
    fi
    wait "$workers"
    if [ "$cpu_budget" -gt 0 ]; then kill "$watcher" 2> /dev/null || true; wait "$watcher" 2> /dev/null || true; fi
  fi
  elapsed=$(($(date +%s) - t_start)) # the fuzzing's wall time (the table's seconds: less than asked if it stopped early)
  children_cpu "$work/cpu-after"
  cpu_used=$(awk -v a="$(cat "$work/cpu-before")" -v b="$(cat "$work/cpu-after")" 'BEGIN { printf "%.0f", b - a }')
  logs=("$work"/fuzz-*.log)
  # executions: every start's final stats; cov and ft: the last status line of the last start
  execs=$(cat "${logs[@]}" | sed -nE 's/^stat::number_of_executed_units: *([0-9]+).*/\1/p' | awk '{ s += $1 } END { print s + 0 }')
  status=$(grep -hE '^#[0-9]+[[:space:]].*cov: ' "$(ls -t "${logs[@]}" | head -1)" | tail -1 || true)
  cov=$(sed -nE 's/.*cov: ([0-9]+).*/\1/p' <<< "$status")
  ft=$(sed -nE 's/.*ft: ([0-9]+).*/\1/p' <<< "$status")
  starts=${#logs[@]}
  rc=0
  grep -qE '^Done [0-9]+ runs|libFuzzer: run interrupted' "${logs[@]}" || rc=1
  ncorpus=$(find "$corpus" -type f | wc -l)
  echo "$status ($starts start(s), $execs executions)"
  for f in "$artifacts"/crash-* "$artifacts"/leak-* "$artifacts"/timeout-* "$artifacts"/oom-*; do
    [ -f "$f" ] && cp "$f" "$build/findings/$h/"
  done
  account "$h" "$bin" "${TRIAGE_MAX:-30}" "$artifacts" 1
  if [ $n -eq 0 ] && [ $rc -ne 0 ]; then
    echo "fuzz.sh: $h did not finish its run and left no finding file; the end of its last log:" >&2
    tail -20 "$(ls -t "${logs[@]}" | head -1)" >&2
    nours=1
  fi
  [ $nours -gt 0 ] && failed=1
  [ $((nhdf5 + nflaky)) -gt 0 ] && [ "${FUZZ_FAIL_ON_HDF5:-0}" = 1 ] && failed=1
  rows+=("| $h | $elapsed | $cpu_used | ${execs:-?} | ${cov:-?} | ${ft:-?} | $ncorpus | $nours | $nhdf5 | $nflaky | $nskip |")
done

echo
echo "== fuzz: summary ($mode mode; findings in $build/findings/) =="
echo "| harness | seconds | CPU s | execs | cov | ft | corpus | findings | libhdf5 findings | not reproducible | not replayed |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
printf '%s\n' "${rows[@]}"
exit $failed
