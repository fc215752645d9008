#!/usr/bin/env bash
# The cost of measuring numerics (docs/perf.md): STEPS steps of CONFIG (default 10 of configs/text_gpt.yaml, bf16)
# plain, then the same with run.numerics_every=1 (every step measured against its FP32 shadow), alternating
# ROUNDS times. Prints each round's training seconds (the run's own "train: ... in X s" line, which includes the
# measuring: it happens inside the steps), the part of it spent measuring (the numerics report's "measured in
# X s"), and the ratio measured-run / plain run; target <= 3.
#   scripts/bench/bench_numerics.sh            # CPU; DEVICE=cuda on a GPU
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-build/ampTrain}
CONFIG=${CONFIG:-configs/text_gpt.yaml}
STEPS=${STEPS:-10}
ROUNDS=${ROUNDS:-3}
DEVICE=${DEVICE:-cpu}
MODE=${MODE:-bf16}
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
common=("$CONFIG" "run.steps=$STEPS" "run.device=$DEVICE" "precision.mode=$MODE" "run.log_every=$STEPS")
printf '%-6s %10s %10s %14s %7s\n' round plain_s measured_s of_it_measure ratio
for r in $(seq "$ROUNDS"); do
  "$BIN" run "${common[@]}" "run.out_dir=$tmp/plain$r" > "$tmp/plain.out" 2>&1
  "$BIN" run "${common[@]}" run.numerics_every=1 "run.out_dir=$tmp/num$r" > "$tmp/num.out" 2>&1
  plain=$(sed -n 's/^train: .* in \([0-9.]*\) s of training steps.*/\1/p' "$tmp/plain.out")
  train=$(sed -n 's/^train: .* in \([0-9.]*\) s of training steps.*/\1/p' "$tmp/num.out")
  measure=$(sed -n 's/^numerics: .* measured in \([0-9.]*\) s.*/\1/p' "$tmp/num.out")
  awk -v r="$r" -v p="$plain" -v t="$train" -v m="$measure" \
    'BEGIN { printf "%-6s %10.2f %10.2f %14.2f %7.2f\n", r, p, t, m, t / p }'
done
