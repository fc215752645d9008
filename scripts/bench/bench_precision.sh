#!/usr/bin/env bash
# Test accuracy (text_gpt: validation loss) of each reference model in every precision mode against fp32 (issue target: every mode
# within 0.5 percentage points of fp32). Full-length runs of configs/MODEL{,_fp16_static,_fp16_dynamic,_bf16}.yaml,
# repeated over SEEDS (run.seed): a single seed's accuracy moves by a few tenths of a point between seeds,
# so the comparison is of means over the same seeds.
#   SEEDS="1234 1 2" MODELS="fashion_mlp fashion_cnn" scripts/bench/bench_precision.sh [KEY=VALUE overrides...]
# MASTER=1 adds bf16 master weights (configs/MODEL_bf16.yaml with precision.master_weights=bf16 and
# optim.state_dtype=bf16): "bf16-master-sr" rounds the update stochastically, "bf16-master-rn" to nearest.
# FP8=1 adds precision.mode fp8 (configs/MODEL_bf16.yaml with precision.mode=fp8): "fp8-delayed" (Transformer Engine's
# delayed scaling, the default recipe) and "fp8-current" (torchao's current scaling); "fp8-all" is fp8-delayed with
# precision.fp8.keep_bf16=[] (the first and last layers in fp8 too). Each puts every product in fp8 however small
# (precision.fp8.min_size=[0,0]): these models' products are all below the default size rule, and the point here is
# how well fp8 trains.
# MODES="fp32 bf16 bf16-master-sr" runs only those (names as printed).
set -euo pipefail
cd "$(dirname "$0")/../.."
bin=${AMPTRAIN_BIN:-build/ampTrain}
[ -x "$bin" ] || { echo "bench_precision: $bin not built; run scripts/build.sh" >&2; exit 1; }
export OPENBLAS_NUM_THREADS=${THREADS:-2}
models=${MODELS:-fashion_mlp fashion_cnn}
seeds=${SEEDS:-1234}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
acc() { /usr/bin/python3 -c "import json,sys; a = json.loads(open(sys.argv[1]).readlines()[-1]).get('accuracy'); print('nan' if a is None else a)" "$1"; }
loss() { /usr/bin/python3 -c "import json,sys; print(json.loads(open(sys.argv[1]).readlines()[-1])['loss'])" "$1"; }
# name, config suffix (- for none), overrides
variants=("fp32 -" "fp16-static _fp16_static" "fp16-dynamic _fp16_dynamic" "bf16 _bf16")
pure="precision.master_weights=bf16 optim.state_dtype=bf16"
[ "${MASTER:-0}" = 1 ] && variants+=("bf16-master-sr _bf16 $pure optim.stochastic_rounding=true"
                                     "bf16-master-rn _bf16 $pure optim.stochastic_rounding=false")
all8="precision.mode=fp8 precision.fp8.min_size=[0,0]"
[ "${FP8:-0}" = 1 ] && variants+=("fp8-delayed _bf16 $all8"
                                  "fp8-current _bf16 $all8 precision.fp8.recipe=current"
                                  "fp8-all _bf16 $all8 precision.fp8.keep_bf16=[]")
for m in $models; do
  : > "$tmp/$m.tsv"
  for seed in $seeds; do
    for variant in "${variants[@]}"; do
      read -r mode suffix extra <<< "$variant"
      case " ${MODES:-$mode} " in *" $mode "*) ;; *) continue ;; esac
      [ "$suffix" = - ] && suffix=""
      out="$tmp/$m$suffix-$mode-$seed"
      start=$(date +%s)
      # shellcheck disable=SC2086 # extra holds several KEY=VALUE words
      "$bin" run "configs/$m$suffix.yaml" run.device=cpu "run.seed=$seed" "run.out_dir=$out" run.log_every=100000 \
        $extra "$@" > "$out.log" 2>&1 ||
        { echo "configs/$m$suffix.yaml $extra seed $seed: run failed"; tail -n 5 "$out.log"; exit 1; }
      a=$(acc "$out/eval.jsonl")
      skips=$(tail -n 1 "$out/scale_log.csv" | cut -d, -f7)
      l=$(loss "$out/eval.jsonl")
      printf "%s\t%s\t%s\t%s\t%s\n" "$mode" "$seed" "$a" "$skips" "$l" >> "$tmp/$m.tsv"
      printf "%-14s %-15s seed %-5s test accuracy %-6s  loss %.4f  skipped steps %s  %d s\n" "$m" "$mode" "$seed" \
        "$(printf '%.4f' "$a" 2> /dev/null || echo -)" "$l" "$skips" "$(( $(date +%s) - start ))"
    done
  done
  awk -F'\t' -v m="$m" '
    { if ($3 == "nan") lm[$1] = 1; else sum[$1] += $3; ls[$1] += $5; n[$1]++; if (!($1 in order)) { order[$1] = ++k; name[k] = $1 } }
    END {
      r = ("fp32" in n) ? "fp32" : name[1] # without fp32 (MODES), against the first mode run
      ref = sum[r] / n[r]; lref = ls[r] / n[r]
      printf "%s, mean over %d seed(s):\n", m, n[r]
      for (i = 1; i <= k; i++) { a = sum[name[i]] / n[name[i]]; d = 100 * (a - ref); l = ls[name[i]] / n[name[i]]
        if (!(name[i] in lm)) # accuracy (classification)
          printf "  %-15s %.4f  %+.2f pp vs %s  %s   loss %.4f\n", name[i], a, d, r,
                 (d >= -0.5 && d <= 0.5) ? "within 0.5 pp" : "OUTSIDE 0.5 pp", l
        else # language model: the loss
          printf "  %-15s loss %.4f  %+.2f%% vs %s\n", name[i], l, 100 * (l - lref) / lref, r } }' "$tmp/$m.tsv"
done
