#!/usr/bin/env bash
# Data parallel on a model whose ranks do not train bit-identically to one rank: fashion_cnn (batchnorm keeps
# per-rank batch statistics; convolution filter gradients sum per image). One epoch at np 1 with batch 128 and
# at np 2 with batch 64 per rank (the same effective batch, 128, and the same 468 steps), test accuracy of
# each and the difference (target: within 0.5 pp). docs/distributed.md quotes its output.
#   scripts/bench/dist_accuracy.sh [MODE=fp32] [KEY=VALUE overrides for both runs...]
set -euo pipefail
cd "$(dirname "$0")/../.."
bin=${AMPTRAIN_BIN:-build/ampTrain}
[ -x "$bin" ] || { echo "dist_accuracy: $bin not built; run scripts/build.sh" >&2; exit 1; }
command -v mpirun > /dev/null || { echo "dist_accuracy: no mpirun (scripts/install-deps.sh installs openmpi-bin)" >&2; exit 1; }
export OPENBLAS_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mode=${MODE:-fp32}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
common=(run.epochs=1 run.steps=0 run.device=cpu run.log_every=100 run.eval_every=0 run.ckpt_every=0 "precision.mode=$mode")
acc() { sed -n 's/.*"accuracy": *\([0-9.]*\).*/\1/p' "$1/eval.jsonl" | tail -n 1; }

start=$(date +%s)
"$bin" run configs/fashion_cnn.yaml "${common[@]}" data.batch_size=128 "run.out_dir=$tmp/np1" "$@" > "$tmp/np1.log" 2>&1 ||
  { tail -n 5 "$tmp/np1.log"; exit 1; }
t1=$(( $(date +%s) - start )); start=$(date +%s)
mpirun -np 2 --bind-to none "$bin" run configs/fashion_cnn.yaml "${common[@]}" data.batch_size=64 "run.out_dir=$tmp/np2" "$@" \
  > "$tmp/np2.log" 2>&1 || { tail -n 5 "$tmp/np2.log"; exit 1; }
t2=$(( $(date +%s) - start ))
a1=$(acc "$tmp/np1"); a2=$(acc "$tmp/np2")
s1=$(($(wc -l < "$tmp/np1/scale_log.csv") - 1)); s2=$(($(wc -l < "$tmp/np2/scale_log.csv") - 1))
awk -v a1="$a1" -v a2="$a2" -v s1="$s1" -v s2="$s2" -v t1="$t1" -v t2="$t2" -v m="$mode" 'BEGIN{
  d = 100 * (a2 - a1); if (d < 0) d = -d
  printf "fashion_cnn %s, one epoch, effective batch 128: np 1 (batch 128) accuracy %.4f in %d steps, %d s; np 2 (batch 64 per rank) accuracy %.4f in %d steps, %d s; difference %.2f pp (target <= 0.5): %s\n",
    m, a1, s1, t1, a2, s2, t2, d, d <= 0.5 ? "met" : "NOT met" }'
