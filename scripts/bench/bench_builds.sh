#!/usr/bin/env bash
# Training speed of two ampTrain binaries on the CPU, alternating in one invocation so both see the same machine:
# samples/s of each (the `train:` line: training steps only, not the final evaluation) and the ratio NEW / OLD.
# The speed counterpart of scripts/check/compare_builds.sh (which says whether they train the same bits).
#   scripts/bench/bench_builds.sh OLD/ampTrain NEW/ampTrain [MODELS="mlp cnn gpt"] [MODES=bf16] [THREADS="1 2"] [ROUNDS=3] [STEPS]
#   [LABELS="old new"] (the two columns' names; scripts/bench/bench_amx.sh runs one binary two ways through it)
#   [LAUNCH="mpirun -np 2 --bind-to none"] (each run under that launcher; with THREADS=auto, data parallel's share)
#   [CLOCK=cpu] samples per CPU second of the whole process (user + system time: start-up, data loading and the final
#   evaluation included, so it understates the steps' own change), in place of the train line's samples per second
#   of wall time: on a host that takes a core away now and then, the CPU time moves less (docs/perf.md, "Two cores
#   that are sometimes one"). Meant for 1 thread: at more, waiting workers spin and count.
#   (build the old one from a worktree: git worktree add --detach /tmp/old REV; cmake -S /tmp/old -B /tmp/old/b
#    -DAMP_CUDA=OFF -DAMP_TESTS=OFF -DCMAKE_BUILD_TYPE=Release; cmake --build /tmp/old/b)
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/bench/median.sh
. scripts/bench/median.sh
[ $# -eq 2 ] || { echo "usage: scripts/bench/bench_builds.sh OLD/ampTrain NEW/ampTrain" >&2; exit 2; }
old=$1 new=$2
for b in "$old" "$new"; do [ -x "$b" ] || { echo "bench_builds: $b is not an executable" >&2; exit 2; }; done
models=${MODELS:-mlp cnn gpt}; modes=${MODES:-bf16}; thread_counts=${THREADS:-1 2}; rounds=${ROUNDS:-3}
read -r l0 l1 <<< "${LABELS:-old new}"
export OPENBLAS_NUM_THREADS=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
config_of() { case $1 in mlp) echo configs/fashion_mlp.yaml ;; cnn) echo configs/fashion_cnn.yaml ;; gpt) echo configs/text_gpt.yaml ;; esac; }
steps_of() { case $1 in mlp) echo 300 ;; cnn) echo 40 ;; gpt) echo 60 ;; esac; }
# LAUNCH: a launcher before each binary, e.g. "mpirun -np 2 --bind-to none" (THREADS=auto: each rank's share)
read -r -a launch <<< "${LAUNCH:-}"
clock=${CLOCK:-wall}
[ "$clock" = wall ] || [ "$clock" = cpu ] || { echo "bench_builds: CLOCK is wall or cpu, not '$clock'" >&2; exit 2; }
rate() { # BIN MODEL MODE THREADS STEPS OUT
  local line cpu TIMEFORMAT='%U %S'
  local cmd=("${launch[@]}" "$1" run "$(config_of "$2")" "run.steps=$5" run.epochs=0 "precision.mode=$3" run.device=cpu
             "run.threads=$4" run.log_every=100000 run.eval_every=0 run.ckpt_every=0 "run.out_dir=$6")
  if [ "$clock" = cpu ]; then
    # bash's time of the whole command: user and system seconds; samples = steps x the model's batch
    cpu=$({ time "${cmd[@]}" > "$6.log" 2>&1; } 2>&1)
    line=$(sed -n 's/^train: \([0-9]*\) steps, \([0-9]*\) samples .*/\2/p' "$6.log")
    [ -n "$line" ] || return 0
    echo "$cpu" | awk -v n="$line" '{printf "%.1f\n", n / ($1 + $2)}'
    return 0
  fi
  "${cmd[@]}" |
    sed -n 's/^train: .*: \([0-9.]*\) samples\/s$/\1/p'
}
for model in $models; do
  [ -n "$(config_of "$model")" ] || { echo "bench_builds: unknown model '$model' (mlp, cnn, gpt)" >&2; exit 2; }
  steps=${STEPS:-$(steps_of "$model")}
  for mode in $modes; do
    for th in $thread_counts; do
      sum0=0 sum1=0 ratios=""
      for r in $(seq "$rounds"); do
        a0=$(rate "$old" "$model" "$mode" "$th" "$steps" "$tmp/$model-$mode-$th-$r-old")
        a1=$(rate "$new" "$model" "$mode" "$th" "$steps" "$tmp/$model-$mode-$th-$r-new")
        [ -n "$a0" ] && [ -n "$a1" ] || { echo "bench_builds: a run failed" >&2; exit 1; }
        echo "round $r $model $mode, $th thread(s): $l0 $a0 samples/s, $l1 $a1 samples/s ($clock)"
        sum0=$(awk -v a="$sum0" -v b="$a0" 'BEGIN{print a+b}'); sum1=$(awk -v a="$sum1" -v b="$a1" 'BEGIN{print a+b}')
        ratios="$ratios $(awk -v a="$a0" -v b="$a1" 'BEGIN{print b/a}')"
      done
      # the median of the rounds' own ratios: a round's two runs are adjacent, so a slow minute of the machine
      # moves it less than it moves the means
      median=$(echo "$ratios" | median)
      awk -v m="$model" -v md="$mode" -v t="$th" -v a="$sum0" -v b="$sum1" -v r="$rounds" -v s="$steps" \
          -v l0="$l0" -v l1="$l1" -v med="$median" -v c="$clock" 'BEGIN{
        printf "%s %s, %s thread(s): %s %.1f, %s %.1f samples/s (%s; means of %d alternating rounds, %d steps): %s %.2fx; median per-round %.3fx\n",
               m, md, t, l0, a/r, l1, b/r, c, r, s, l1, b/a, med}'
    done
  done
done
