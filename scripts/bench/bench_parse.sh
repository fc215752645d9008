#!/usr/bin/env bash
# Time `ampTrain check` on the configs that were quadratic (docs/reliability.md): deep flow nesting, many layers,
# many keys in one mapping (clip:), each at N items (default 40000 and 400000; the 16 MiB cap allows about that).
#   scripts/bench/bench_parse.sh                       # build/ampTrain
#   BASE=/path/to/old/ampTrain scripts/bench/bench_parse.sh   # the same inputs through an older binary, side by side
# Prints one row per input and binary: seconds (wall) and the exit code; every input must be refused (exit 2).
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-build/ampTrain}
SIZES=${SIZES:-"40000 400000"}
LIMIT=${LIMIT:-60}   # seconds before a run counts as hung (timeout's exit 124)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

python3 - "$tmp" $SIZES <<'EOF'
import sys
d = sys.argv[1]
base = open('configs/fashion_mlp.yaml').read().split('model:')[0]
for n in map(int, sys.argv[2:]):
    open(f'{d}/nest_{n}.yaml', 'w').write('run: ' + '[' * n + ']' * n + '\n')
    open(f'{d}/layers_{n}.yaml', 'w').write(base + 'model:\n  layers:\n' + '  - {kind: relu}\n' * n)
    open(f'{d}/keys_{n}.yaml', 'w').write(base + 'clip:\n' + ''.join(f'  k{i}: 1\n' for i in range(n)))
EOF

printf '%-22s %-10s %9s %5s\n' input binary seconds exit
for n in $SIZES; do
  for kind in nest layers keys; do
    f=$tmp/${kind}_$n.yaml
    for pair in "current:$BIN" ${BASE:+"base:$BASE"}; do
      name=${pair%%:*} bin=${pair#*:}
      t0=$EPOCHREALTIME
      set +e
      timeout "$LIMIT" "$bin" check "$f" >/dev/null 2>&1
      rc=$?
      set -e
      t1=$EPOCHREALTIME
      printf '%-22s %-10s %9.2f %5d\n' "${kind}_$n ($(( $(stat -c %s "$f") / 1024 )) KiB)" "$name" \
        "$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }')" "$rc"
    done
  done
done
