#!/usr/bin/env bash
# bf16 training on the CPU with its products on AMX tiles against the same binary on AVX512-BF16 (vdpbf16ps,
# AMP_GEMM_AMX=0), alternating in one invocation so both see the same machine: samples/s of each and the ratio.
#   scripts/bench_amx.sh [MODELS="mlp cnn gpt"] [STEPS] [ROUNDS=3] [THREADS="1 2"] [MODE=bf16]
# Needs a CPU with AMX-BF16 (Sapphire Rapids or later Xeon); elsewhere both runs take vdpbf16ps and it says so.
set -euo pipefail
cd "$(dirname "$0")/.."
models=${MODELS:-mlp cnn gpt}; rounds=${ROUNDS:-3}; thread_counts=${THREADS:-1 2}; mode=${MODE:-bf16}
bin=${AMP_BIN:-build/ampTrain}
[ -x "$bin" ] || { echo "bench_amx: $bin not built; run scripts/build.sh" >&2; exit 1; }
grep -qw amx_bf16 /proc/cpuinfo || echo "bench_amx: this CPU has no AMX-BF16: both columns run vdpbf16ps" >&2
export OPENBLAS_NUM_THREADS=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
config_of() { case $1 in mlp) echo configs/fashion_mlp.yaml ;; cnn) echo configs/fashion_cnn.yaml ;; gpt) echo configs/text_gpt.yaml ;; esac; }
steps_of() { case $1 in mlp) echo 300 ;; cnn) echo 40 ;; gpt) echo 40 ;; esac; }
rate() { # AMX THREADS MODEL STEPS OUT
  AMP_GEMM_AMX=$1 "$bin" run "$(config_of "$3")" "run.steps=$4" run.epochs=0 "precision.mode=$mode" run.device=cpu \
    "run.threads=$2" run.log_every=100000 run.eval_every=0 run.ckpt_every=0 "run.out_dir=$5" |
    sed -n 's/^train: .*: \([0-9.]*\) samples\/s$/\1/p'
}
for model in $models; do
  [ -n "$(config_of "$model")" ] || { echo "bench_amx: unknown model '$model' (mlp, cnn, gpt)" >&2; exit 1; }
  steps=${STEPS:-$(steps_of "$model")}
  for th in $thread_counts; do
    sum0=0 sum1=0
    for r in $(seq "$rounds"); do
      a0=$(rate 0 "$th" "$model" "$steps" "$tmp/$model-$th-$r-0")
      a1=$(rate 1 "$th" "$model" "$steps" "$tmp/$model-$th-$r-1")
      [ -n "$a0" ] && [ -n "$a1" ] || { echo "bench_amx: a run failed" >&2; exit 1; }
      echo "round $r $model $mode, $th thread(s): vdpbf16ps $a0 samples/s, AMX $a1 samples/s"
      sum0=$(awk -v a="$sum0" -v b="$a0" 'BEGIN{print a+b}'); sum1=$(awk -v a="$sum1" -v b="$a1" 'BEGIN{print a+b}')
    done
    awk -v m="$model" -v md="$mode" -v t="$th" -v a="$sum0" -v b="$sum1" -v r="$rounds" -v s="$steps" 'BEGIN{
      printf "%s %s, %d thread(s): vdpbf16ps %.1f, AMX %.1f samples/s (means of %d alternating rounds, %d steps): AMX %.2fx\n",
             m, md, t, a/r, b/r, r, s, b/a}'
  done
done
