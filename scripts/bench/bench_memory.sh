#!/usr/bin/env bash
# Peak memory of a 16-bit run against fp32 on an activation-heavy config: fashion_cnn (two conv/batchnorm/
# relu/maxpool stages) at a large batch for a few steps, in fp32, bf16 and fp16-dynamic, each under
# /usr/bin/time -v. Prints each run's peak RSS ("Maximum resident set size") and its ratio to fp32, and
# PASS/FAIL against the target ratio 0.65 (16-bit activations should take half of fp32's; the
# dataset, ~220 MB in every mode, the weights, the libraries and the CPU backend's per-image scratch
# are the fixed part that keeps the ratio above 0.5).
#
# Batch 1024 (the default): the activations (~1 GB in fp32) dominate the fixed part. A CUDA build maps no
# CUDA library on the CPU (the CUDA backend is a module loaded only for a GPU, lib/base/device_module.h); the
# figures in docs/perf.md say which build measured what. BATCH=2048 makes the activations dominate further.
#
# This is a measurement, not a test: it exits 0 whether the target is met or not (read the PASS/FAIL
# line); it exits 1 only when it could not measure (binary missing, a run failed, no /usr/bin/time).
# No evaluation; run.ckpt_every=0 still writes the final checkpoint, which does not move the peak.
#   scripts/bench/bench_memory.sh                     AMPTRAIN_BIN (default build/ampTrain), BATCH=1024, STEPS=3
#   BATCH=2048 STEPS=2 scripts/bench/bench_memory.sh
#
# PARAMS=1: the parameters' side instead (bf16 master weights, docs/precision.md). A text_gpt wide enough that the
# parameters dominate (WIDTH=512, BLOCKS=8: 25.5 M parameters; BATCH=2, so that activations stay small) in bf16
# mixed precision (fp32 master, fp32 m and v, fp32 gradient, bf16 copy: 18 bytes a parameter) against
# precision.master_weights=bf16 with optim.state_dtype=bf16 (10 bytes); target: peak RSS at least 40% lower
# (TARGET_DROP=0.40). Measured: the run's own "memory: peak RSS ... training (before the first checkpoint)"
# line, since the final checkpoint's in-memory HDF5 image (fp32 master, m and v: 12 bytes a parameter) is the
# peak of a short run in either mode; /usr/bin/time's whole-run peak is printed next to it. The libraries and the activations are the fixed part that the drop is measured against.
#   PARAMS=1 scripts/bench/bench_memory.sh            WIDTH=512 BLOCKS=8 BATCH=2 STEPS=2
set -euo pipefail
cd "$(dirname "$0")/../.."
bin=${AMPTRAIN_BIN:-build/ampTrain}
batch=${BATCH:-1024}; steps=${STEPS:-3}; target=${TARGET:-0.65}
[ -x "$bin" ] || { echo "bench_memory: $bin not built; run scripts/build.sh (or set AMPTRAIN_BIN)" >&2; exit 1; }
[ -x /usr/bin/time ] || { echo "bench_memory: /usr/bin/time not found (Debian package 'time')" >&2; exit 1; }
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

peak_kb() { sed -n 's/^[[:space:]]*Maximum resident set size (kbytes): \([0-9]*\)$/\1/p' "$1"; }

if [ "${PARAMS:-0}" = 1 ]; then
  width=${WIDTH:-512}; blocks=${BLOCKS:-8}; drop_target=${TARGET_DROP:-0.40}; steps=${STEPS:-2}; batch=${BATCH:-2}
  cfg=$tmp/text_gpt_wide.yaml
  # configs/text_gpt_bf16.yaml with its model widened and deepened
  sed -n '1,/^model:/p' configs/text_gpt_bf16.yaml | sed '$d' > "$cfg"
  { echo "model:"; echo "  init: gpt2"; echo "  layers:"
    echo "    - {kind: embedding, name: embed, vocab: 256, dim: $width}"
    for ((b = 0; b < blocks; b++)); do echo "    - {kind: transformer_block, name: block$b, heads: $((width / 64)), mlp_ratio: 4}"; done
    echo "    - {kind: layernorm, name: ln_f}"; echo "    - {kind: linear, name: lm_head, out: 256}"
    echo "    - {kind: cross_entropy}"
    sed -n '/^optim:/,$p' configs/text_gpt_bf16.yaml; } >> "$cfg"
  echo "bench_memory: text_gpt width $width, $blocks blocks, batch $batch, $steps steps, device cpu, binary $bin"
  declare -A prss
  for variant in mixed bf16-master; do
    extra=""
    [ "$variant" = bf16-master ] && extra="precision.master_weights=bf16 optim.state_dtype=bf16 optim.stochastic_rounding=true"
    # shellcheck disable=SC2086 # extra holds several KEY=VALUE words
    if ! /usr/bin/time -v -o "$tmp/time-$variant" "$bin" run "$cfg" "run.steps=$steps" "data.batch_size=$batch" \
         data.val_fraction=0.001 run.device=cpu run.eval_every=0 run.ckpt_every=0 run.log_every=100000 \
         "run.out_dir=$tmp/run-$variant" $extra \
         > "$tmp/log-$variant" 2>&1; then
      echo "bench_memory: the $variant run failed:" >&2
      tail -n 20 "$tmp/log-$variant" >&2
      exit 1
    fi
    prss[$variant]=$(sed -n 's/^memory: peak RSS \([0-9.]*\) MiB training.*/\1/p' "$tmp/log-$variant")
    [ -n "${prss[$variant]}" ] || { echo "bench_memory: no 'memory:' line in the $variant run's output" >&2; exit 1; }
    printf '%-12s peak RSS %7.1f MiB training (whole run, final checkpoint included: %7.1f MiB)\n' "$variant" \
      "${prss[$variant]}" "$(awk -v k="$(peak_kb "$tmp/time-$variant")" 'BEGIN{print k/1024}')"
  done
  grep -m1 "^model:" "$tmp/log-mixed" || true
  drop=$(awk -v a="${prss[bf16-master]}" -v b="${prss[mixed]}" 'BEGIN{printf "%.3f", 1 - a/b}')
  verdict=$(awk -v d="$drop" -v t="$drop_target" 'BEGIN{print (d >= t) ? "PASS" : "FAIL"}')
  echo "bench_memory: $verdict: bf16 master weights and moments cut peak RSS by $drop (target >= $drop_target)"
  exit 0
fi

echo "bench_memory: configs/fashion_cnn.yaml, batch $batch, $steps steps, device cpu, binary $bin"
declare -A rss
for mode in fp32 bf16 fp16-dynamic; do
  if ! /usr/bin/time -v -o "$tmp/time-$mode" "$bin" run configs/fashion_cnn.yaml "run.steps=$steps" run.epochs=0 \
       "data.batch_size=$batch" "precision.mode=$mode" run.device=cpu run.eval_every=0 run.ckpt_every=0 \
       run.log_every=100000 "run.out_dir=$tmp/run-$mode" > "$tmp/log-$mode" 2>&1; then
    echo "bench_memory: the $mode run failed:" >&2
    tail -n 20 "$tmp/log-$mode" >&2
    exit 1
  fi
  kb=$(peak_kb "$tmp/time-$mode")
  [ -n "$kb" ] || { echo "bench_memory: no peak RSS in /usr/bin/time's output for $mode" >&2; exit 1; }
  rss[$mode]=$kb
done

verdict=PASS
for mode in fp32 bf16 fp16-dynamic; do
  kb=${rss[$mode]}
  ratio=$(awk -v a="$kb" -v b="${rss[fp32]}" 'BEGIN{printf "%.3f", a/b}')
  if [ "$mode" = fp32 ]; then
    printf '%-13s peak RSS %9d KB (%7.1f MiB)\n' "$mode" "$kb" "$(awk -v k="$kb" 'BEGIN{print k/1024}')"
  else
    ok=$(awk -v r="$ratio" -v t="$target" 'BEGIN{print (r <= t) ? "ok" : "over"}')
    [ "$ok" = ok ] || verdict=FAIL
    printf '%-13s peak RSS %9d KB (%7.1f MiB)  ratio to fp32 %s (target <= %s: %s)\n' "$mode" "$kb" \
      "$(awk -v k="$kb" 'BEGIN{print k/1024}')" "$ratio" "$target" "$ok"
  fi
done
echo "bench_memory: $verdict: peak RSS of bf16 and fp16-dynamic <= $target x fp32 (batch $batch)"
exit 0
