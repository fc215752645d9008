#!/usr/bin/env bash
# Accuracy targets of the reference models (issue: CPU engine), measured by training them in full:
#   fashion_mlp fp32 >= 0.885 test accuracy within 10 epochs; fashion_cnn >= 0.91;
#   text_gpt validation loss at least 25% below the corpus's unigram entropy (both printed, in nats).
#   scripts/bench/bench_accuracy.sh [MODELS="fashion_mlp fashion_cnn text_gpt"] [KEY=VALUE overrides for every run...]
# Uses OPENBLAS_NUM_THREADS=${THREADS:-2}. Runs go to runs/bench-accuracy-MODEL-DATE.
set -euo pipefail
cd "$(dirname "$0")/../.."
bin=${AMPTRAIN_BIN:-build/ampTrain}
[ -x "$bin" ] || { echo "bench_accuracy: $bin not built; run scripts/build.sh" >&2; exit 1; }
export OPENBLAS_NUM_THREADS=${THREADS:-2}
models=${MODELS:-fashion_mlp fashion_cnn text_gpt}
stamp=$(date +%Y%m%d-%H%M%S)
mkdir -p runs

last_eval() { tail -n 1 "$1/eval.jsonl"; }
field() { /usr/bin/python3 -c "import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])" "$1" "$2"; }

for m in $models; do
  out="runs/bench-accuracy-$m-$stamp"
  start=$(date +%s)
  "$bin" run "configs/$m.yaml" "run.out_dir=$out" run.log_every=500 "$@" > "$out.log" 2>&1 || {
    echo "$m: run failed, see $out.log"; tail -n 5 "$out.log"; exit 1; }
  secs=$(( $(date +%s) - start ))
  ev=$(last_eval "$out")
  case $m in
    text_gpt)
      ent=$(/usr/bin/python3 scripts/bench/unigram_entropy.py "$out/config.yaml")
      loss=$(field "$ev" loss)
      awk -v m="$m" -v l="$loss" -v e="$ent" -v s="$secs" 'BEGIN{printf "%s: validation loss %.4f nats, unigram entropy %.4f nats, %.1f%% below (target >= 25%%), %d s\n", m, l, e, 100*(1-l/e), s}'
      ;;
    *)
      acc=$(field "$ev" accuracy)
      echo "$m: test accuracy $acc after $(( $(wc -l < "$out/scale_log.csv") - 1 )) steps, ${secs} s"
      ;;
  esac
done
