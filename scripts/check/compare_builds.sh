#!/usr/bin/env bash
# Do two ampTrain binaries train the same, bit for bit, on the CPU? For changes meant to move no result
# (docs/backend.md quotes its output): each config below runs with both binaries, and scale_log.csv (every
# column but samples_per_s) and eval.jsonl are compared. SAME, or DIFF with the last row's loss of each.
#   scripts/check/compare_builds.sh OLD/ampTrain NEW/ampTrain          (build the old one from a worktree)
# The configs cover all four modes with overflows (a 2^24 start), hysteresis, clipping (L2 and inf),
# accumulation, cosine and step schedules, SGD with momentum/Nesterov and AdamW, the CNN (fp32, fp16, bf16) and the
# GPT; two of the runs on 2 threads.
set -uo pipefail
[ $# -eq 2 ] || { echo "usage: scripts/check/compare_builds.sh OLD_BINARY NEW_BINARY" >&2; exit 2; }
old=$(realpath "$1"); new=$(realpath "$2")
cd "$(dirname "$0")/../.."
work=$(mktemp -d /tmp/amp_compare.XXXXXX)
trap 'rm -rf "$work"' EXIT
export OPENBLAS_NUM_THREADS=1
status=0
i=0
while read -r cfg args; do
  i=$((i + 1))
  for side in old new; do
    bin=$old; [ $side = new ] && bin=$new
    # shellcheck disable=SC2086 # args holds several KEY=VALUE words
    "$bin" run "$cfg" run.device=cpu "run.out_dir=$work/$side$i" $args > "$work/$side$i.out" 2>&1 ||
      { echo "FAIL $side $cfg $args"; tail -n 3 "$work/$side$i.out"; status=1; }
  done
  rows() { cut -d, -f1-12 "$work/$1$i/scale_log.csv"; }
  if cmp -s <(rows old) <(rows new) && cmp -s "$work/old$i/eval.jsonl" "$work/new$i/eval.jsonl"; then
    echo "SAME $cfg $args ($(($(wc -l < "$work/new$i/scale_log.csv") - 1)) rows)"
  else
    echo "DIFF $cfg $args: last loss $(tail -n 1 "$work/old$i/scale_log.csv" | cut -d, -f3) (old)" \
         "$(tail -n 1 "$work/new$i/scale_log.csv" | cut -d, -f3) (new)"
    status=1
  fi
done << 'LIST'
configs/fashion_mlp_fp16_dynamic.yaml run.steps=60 run.log_every=7 precision.loss_scale.init=16777216 clip.max_norm=0.5 accum_steps=2 optim.schedule.kind=cosine optim.schedule.warmup_steps=5 precision.loss_scale.growth_interval=9 run.eval_every=25
configs/fashion_mlp_fp16_static.yaml run.steps=40 run.log_every=50 precision.loss_scale.value=1e9 clip.max_norm=1 clip.norm_type=inf
configs/fashion_mlp_bf16.yaml run.steps=40 run.log_every=3 optim.kind=sgd optim.momentum=0.9 optim.nesterov=true optim.weight_decay=0.001 optim.schedule.kind=step optim.schedule.step_size=10 optim.schedule.gamma=0.5 optim.lr=0.05
configs/fashion_mlp.yaml run.steps=30 run.log_every=4 optim.kind=sgd optim.momentum=0.9 optim.lr=0.05
configs/fashion_cnn_fp16_dynamic.yaml run.steps=12 run.log_every=5 precision.loss_scale.hysteresis=2 precision.loss_scale.init=16777216
configs/fashion_cnn_bf16.yaml run.steps=12 run.log_every=5 run.threads=2
configs/fashion_cnn.yaml run.steps=8 run.log_every=4 run.threads=2
configs/text_gpt.yaml run.steps=20 run.log_every=5
configs/text_gpt_bf16.yaml run.steps=20 run.log_every=5 accum_steps=2
LIST
exit $status
