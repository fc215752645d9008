#!/usr/bin/env bash
# Accuracy of each reference model in every precision mode against its fp32 run (issue target: every
# mode within 0.5 percentage points of fp32's test accuracy). Full-length runs of configs/MODEL*.yaml.
#   scripts/bench_precision.sh [MODELS="fashion_mlp fashion_cnn"] [KEY=VALUE overrides for every run...]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${AMP_BIN:-build/ampTrain}
[ -x "$bin" ] || { echo "bench_precision: $bin not built; run scripts/build.sh" >&2; exit 1; }
export OPENBLAS_NUM_THREADS=${THREADS:-2}
models=${MODELS:-fashion_mlp fashion_cnn}
stamp=$(date +%Y%m%d-%H%M%S)
acc() { /usr/bin/python3 -c "import json,sys; print(json.loads(open(sys.argv[1]).readlines()[-1])['accuracy'])" "$1"; }
for m in $models; do
  ref=""
  for suffix in "" _fp16_static _fp16_dynamic _bf16; do
    cfg="configs/$m$suffix.yaml"
    out="runs/bench-precision-$m$suffix-$stamp"
    start=$(date +%s)
    "$bin" run "$cfg" run.device=cpu "run.out_dir=$out" run.log_every=1000 "$@" > "$out.log" 2>&1 || {
      echo "$cfg: run failed, see $out.log"; tail -n 5 "$out.log"; exit 1; }
    a=$(acc "$out/eval.jsonl")
    skips=$(tail -n 1 "$out/scale_log.csv" | cut -d, -f7)
    [ -n "$ref" ] || ref=$a
    awk -v c="$cfg" -v a="$a" -v r="$ref" -v s="$skips" -v t="$(( $(date +%s) - start ))" 'BEGIN{
      d = 100 * (a - r); printf "%-36s test accuracy %.4f  (%+.2f pp vs fp32, %s)  skipped steps %s  %d s\n", c, a, d,
      (d >= -0.5 && d <= 0.5) ? "within 0.5 pp" : "OUTSIDE 0.5 pp", s, t}'
  done
done
