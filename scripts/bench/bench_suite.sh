#!/usr/bin/env bash
# The test suite's wall time in two builds, side by side: ctest in BUILD_A, then in BUILD_B (the order swapped each
# round), the same tests, nothing else running. Prints each suite's seconds in both and the totals.
#   scripts/bench/bench_suite.sh BUILD_A BUILD_B [ROUNDS=1] [CTEST_ARGS="-E test_cli"]
# Made to measure what the CPU backend's threads save the suite: BUILD_A the tree as it is, BUILD_B the
# same tree with run.threads defaulting to 1 instead of auto (docs/perf.md, "The test suite and the threads").
set -euo pipefail
cd "$(dirname "$0")/../.."
[ $# -ge 2 ] || { sed -n '2,7p' "$0" >&2; exit 2; }
a=$1 b=$2 rounds=${ROUNDS:-1}
for d in "$a" "$b"; do [ -f "$d/CTestTestfile.cmake" ] || { echo "bench_suite: $d is not a build with tests" >&2; exit 2; }; done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# shellcheck disable=SC2086
run() { # BUILD OUT
  local t0 t1
  t0=$(date +%s.%N)
  (cd "$1" && ctest --timeout 1500 ${CTEST_ARGS:-}) > "$2" 2>&1 || echo "bench_suite: a test failed in $1 (see below)" >> "$2"
  t1=$(date +%s.%N)
  awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f\n", b - a }' > "$2.wall"
}
for r in $(seq "$rounds"); do
  if [ $((r % 2)) -eq 1 ]; then order="A B"; else order="B A"; fi
  for w in $order; do
    d=$a; [ "$w" = B ] && d=$b
    echo "round $r: ctest in $d ..." >&2
    run "$d" "$tmp/$w-$r"
    grep -q "bench_suite: a test failed" "$tmp/$w-$r" && grep -E "Failed|\*\*\*" "$tmp/$w-$r" >&2
  done
done
# per-suite seconds: "  n/N Test  #k: name ....   Passed    3.49 sec"
for w in A B; do
  cat "$tmp/$w"-* | sed -nE 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: ([A-Za-z0-9_]+) .* ([0-9.]+) sec$/\1 \2/p' |
    awk '{ s[$1] += $2; n[$1]++ } END { for (k in s) printf "%s %.2f\n", k, s[k] / n[k] }' | sort > "$tmp/$w.suites"
done
echo "suite                     $a (s)   $b (s)   B/A"
join "$tmp/A.suites" "$tmp/B.suites" | awk '{ printf "%-24s %10.1f %10.1f   %.2fx\n", $1, $2, $3, ($2 > 0 ? $3 / $2 : 0) }'
ta=$(cat "$tmp"/A-*.wall | awk '{ s += $1 } END { printf "%.1f", s / NR }')
tb=$(cat "$tmp"/B-*.wall | awk '{ s += $1 } END { printf "%.1f", s / NR }')
awk -v a="$ta" -v b="$tb" -v r="$rounds" -v da="$a" -v db="$b" \
  'BEGIN { printf "total ctest wall time (mean of %d): %s %.1f s, %s %.1f s: B/A %.2fx\n", r, da, a, db, b, b / a }'
