#!/usr/bin/env bash
# What run.recompute saves and costs on the CPU: the byte GPT (configs/text_gpt.yaml: two blocks of width 128, four
# heads) at a longer context, where the attention probabilities (N, H, T, T) and the MLP's (N, T, 4C) activations
# dominate, trained a few steps with each recompute mode. Prints each run's peak RSS before its first checkpoint (the
# run's own "memory:" line) and its training samples/s, with both as ratios to none; and checks that every mode
# logged the same scale_log.csv as none (the same bits: tests/test_recompute.c is the test).
# A measurement, not a test: exits 0 whatever the figures; 1 only when a run failed.
#   scripts/bench/bench_recompute.sh        AMPTRAIN_BIN (default build/ampTrain), SEQ=512, BATCH=16, STEPS=4, MODE=bf16
set -euo pipefail
cd "$(dirname "$0")/../.."
bin=${AMPTRAIN_BIN:-build/ampTrain}
seq=${SEQ:-512}; batch=${BATCH:-16}; steps=${STEPS:-4}; mode=${MODE:-bf16}
export OPENBLAS_NUM_THREADS=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf '%-10s %14s %8s %12s %8s %s\n' recompute "peak RSS MiB" ratio samples/s ratio "log vs none"
base_mem=""; base_rate=""
for r in none gelu attention block; do
  "$bin" run configs/text_gpt.yaml run.device=cpu run.threads=1 precision.mode="$mode" data.seq_len="$seq" \
    data.batch_size="$batch" run.steps="$steps" run.log_every=1 run.eval_every=0 run.recompute="$r" \
    run.out_dir="$tmp/$r" > "$tmp/$r.out" 2>&1 || { echo "bench_recompute: $r failed:"; tail -n 5 "$tmp/$r.out"; exit 1; }
  mem=$(sed -n 's/^memory: peak RSS \([0-9.]*\) MiB training.*/\1/p' "$tmp/$r.out")
  rate=$(sed -n 's/^train: .* \([0-9.]*\) samples\/s$/\1/p' "$tmp/$r.out")
  [ -n "$base_mem" ] || { base_mem=$mem; base_rate=$rate; }
  same=SAME
  cmp -s <(cut -d, -f1-12 "$tmp/none/scale_log.csv") <(cut -d, -f1-12 "$tmp/$r/scale_log.csv") || same=DIFF
  awk -v r="$r" -v m="$mem" -v bm="$base_mem" -v s="$rate" -v bs="$base_rate" -v same="$same" \
    'BEGIN { printf "%-10s %14s %8.3f %12s %8.3f %s\n", r, m, m / bm, s, s / bs, same }'
done
