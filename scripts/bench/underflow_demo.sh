#!/usr/bin/env bash
# The problem loss scaling solves: configs/fashion_underflow.yaml (a deep, narrow MLP) trained in fp32,
# fp16-static at scale 1 (no loss scaling), fp16-dynamic and bf16, side by side. Prints, per mode, the
# final training loss, the test accuracy and the mean grad_zero_frac (fraction of low-precision
# activation-gradient elements that are exactly zero).
#   scripts/bench/underflow_demo.sh [KEY=VALUE overrides...]
set -euo pipefail
cd "$(dirname "$0")/../.."
bin=${AMPTRAIN_BIN:-build/ampTrain}
export OPENBLAS_NUM_THREADS=${THREADS:-1}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf "%-22s %10s %10s %15s\n" mode final_loss test_acc grad_zero_frac
for m in fp32 "fp16-static precision.loss_scale.value=1" fp16-dynamic bf16; do
  out="$tmp/$(echo "$m" | cut -d' ' -f1)"
  # shellcheck disable=SC2086
  "$bin" run configs/fashion_underflow.yaml precision.mode=$m run.device=cpu "run.out_dir=$out" "$@" > "$out.log" 2>&1 \
    || { echo "run $m failed:"; tail -n 5 "$out.log"; exit 1; }
  acc=$(/usr/bin/python3 -c "import json,sys; print(json.loads(open(sys.argv[1]).readlines()[-1])['accuracy'])" "$out/eval.jsonl")
  awk -F, -v m="$(echo "$m" | sed 's/ precision.loss_scale.value=/ scale /')" -v acc="$acc" '
    NR > 1 { loss = $3; if ($12 != "") { z += $12; nz++ } }
    END { printf "%-22s %10.4f %10.4f %15s\n", m, loss, acc, nz ? sprintf("%.4f", z / nz) : "n/a (fp32)" }' "$out/scale_log.csv"
done
