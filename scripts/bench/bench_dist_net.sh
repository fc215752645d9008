#!/usr/bin/env bash
# Data parallel over a slow network, simulated on one machine. This machine's loopback is fast, so the gradients'
# all-reduce costs almost nothing here; between hosts it is what a step waits for. This script runs ampTrain at np 2
# over TCP (Open MPI's `--mca btl tcp,self`, no shared memory) on the loopback of a private network namespace
# (`unshare --net`: the machine's own network is not touched), whose link is limited by a token bucket
# (`tc qdisc add dev lo root tbf rate R burst 32kb latency 50ms`; netem is not available here), at each rate of
# RATES and unlimited, the loopback's MTU set to 9000 (below). For each model, rate, reduction mode and binary it
# prints the median over ROUNDS runs of:
#   step ms     the training steps' wall time a step (ampTrain's "train: ... s of training steps" / steps)
#   reduce ms   the gradients' all-reduce's wall time a step on rank 0 (ampTrain's "reduce: X ms a step" line)
#   wire ms     the least the link can take for it: each rank's fp32 gradients once over the link at the rate
#   hidden      the fraction of the reduction's time that the step does not wait for:
#               1 - (step ms - step ms unlimited) / (reduce ms without overlap), at the same rate; the unlimited
#               run is the same mode's. Without overlap it should be near 0 (a check of the method).
# Reduction modes: without overlap (the reduce after the backward) always; with overlap (the default
# dist.bucket_mb, reduced buckets while the backward runs) where the binary knows the key dist.bucket_mb, which it
# asks `ampTrain check`; otherwise it says so and runs without overlap only (dist.bucket_mb then is not passed).
# BUCKET_MB=X runs the overlapped mode with dist.bucket_mb=X instead of the default (a small model's gradients fit
# in one default bucket, which can only start once the whole backward is done).
# Target, once overlap exists: at 1 Gbit/s overlap hides >= 70% of the reduction for gpt2_tiny. Beside it the script
# prints the most the link allows: the loopback carries both ranks' traffic through its one token bucket, so a step
# takes at least 2 x wire ms, and hidden <= 1 - (2 x wire ms - step ms unlimited) / (reduce ms without overlap).
#   scripts/bench/bench_dist_net.sh [RATES="1gbit 10gbit"] [MODELS="text_gpt gpt2_tiny"] [ROUNDS=3] [STEPS=...]
# ARGS="KEY=VALUE ..." adds overrides to every run (e.g. ARGS="data.batch_size=64": a longer step beside the same
# reduction). STEPS defaults to 40 for text_gpt and 200 for gpt2_tiny. Each rank has one thread (run.threads=1,
# OPENBLAS_NUM_THREADS=1) and the ranks are not bound to cores (--bind-to none; BIND=core to bind).
# AMPTRAIN_BIN (default build/ampTrain) picks the binary; several, separated by spaces ("OLD NEW"), run beside each
# other: each round runs every binary in turn, so a change of load falls on each alike, and the table has a
# binary column (1, 2, ... in AMPTRAIN_BIN's order). Needs root (namespaces, tc), util-linux unshare,
# iproute2 (tc) with the sch_tbf module, Open MPI; for gpt2_tiny, python3 (scripts/tools/make_tokens.py makes its token
# files from the fortunes text where data/fortunes/ has none).
set -euo pipefail
cd "$(dirname "$0")/../.."
bins=()
for b in ${AMPTRAIN_BIN:-build/ampTrain}; do bins+=("$(realpath "$b")"); done
rates=${RATES:-1gbit 10gbit}; models=${MODELS:-text_gpt gpt2_tiny}; rounds=${ROUNDS:-3}; bind=${BIND:-none}
die() { echo "bench_dist_net: $*" >&2; exit 1; }

if [ "${1:-}" != --inside ]; then
  for bin in "${bins[@]}"; do [ -x "$bin" ] || die "$bin not built; run scripts/build.sh"; done
  [ "$(id -u)" = 0 ] || die "needs root (a network namespace and tc)"
  for tool in unshare ip tc mpirun; do
    command -v $tool > /dev/null || die "no $tool (util-linux, iproute2, Open MPI)"
  done
  for model in $models; do
    case $model in text_gpt | gpt2_tiny) ;; *) die "MODELS: text_gpt, gpt2_tiny, not '$model'" ;; esac
  done
  exec unshare --net "$0" --inside
fi

# MTU 9000, a cluster network's jumbo frames: tbf drops every packet larger than its burst (32 KiB), and the
# loopback's own MTU (64 KiB) would stall TCP under it
ip link set lo mtu 9000 up
tc qdisc add dev lo root tbf rate 1gbit burst 32kb latency 50ms 2> /dev/null ||
  die "tc cannot add a tbf qdisc in a network namespace here (no sch_tbf module?)"
tc qdisc del dev lo root
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# the overlapped mode where every binary knows dist.bucket_mb
modes="off on"
for bin in "${bins[@]}"; do
  if "$bin" check configs/text_gpt.yaml dist.bucket_mb=0 > "$tmp/check.log" 2>&1; then
    echo "bench_dist_net: $bin knows dist.bucket_mb: without overlap (dist.bucket_mb=0) and with" \
      "(dist.bucket_mb ${BUCKET_MB:-default})"
  elif grep -q "unknown key 'bucket_mb'" "$tmp/check.log"; then
    modes="off"
    echo "bench_dist_net: $bin has no dist.bucket_mb (no overlapped reduction): without overlap only"
  else
    cat "$tmp/check.log" >&2
    die "ampTrain check failed"
  fi
done
echo "bench_dist_net: $(getconf _NPROCESSORS_ONLN) cores, load $(cut -d' ' -f1-3 /proc/loadavg)," \
     "$(mpirun --version 2> /dev/null | head -n 1), np 2 over TCP on a private loopback"
for k in "${!bins[@]}"; do echo "bench_dist_net: binary $((k + 1)): ${bins[$k]}"; done

# gpt2_tiny's token files (its config's comment makes them the same way)
tokens=data/fortunes
if [[ " $models " == *" gpt2_tiny "* ]] && [ ! -f $tokens/train.bin ]; then
  tokens=$tmp/fortunes
  mkdir -p "$tokens"
  python3 scripts/tools/make_tokens.py --format nanogpt --val-fraction 0.1 -o "$tokens/train.bin" \
    /usr/share/games/fortunes/{cookie,computers,songs-poems,definitions,people,science,politics,work} > /dev/null ||
    die "scripts/tools/make_tokens.py failed"
fi

# run BINARY NAME MODE ARGS...: one np 2 run; prints "STEP_MS REDUCE_MS VALUES" from its summary lines
run() {
  local bin=$1 name=$2 mode=$3 log="$tmp/$2.log"
  shift 3
  local extra=()
  [ "$mode" = off ] && [ "$modes" != off ] && extra=(dist.bucket_mb=0)
  [ "$mode" = on ] && [ -n "${BUCKET_MB:-}" ] && extra=("dist.bucket_mb=$BUCKET_MB")
  if ! mpirun --allow-run-as-root -np 2 --bind-to "$bind" --mca btl tcp,self --mca btl_tcp_if_include lo \
         --mca oob_tcp_if_include lo -x OPENBLAS_NUM_THREADS -x OMP_NUM_THREADS \
         "$bin" run "$@" "${extra[@]}" "run.out_dir=$tmp/$name" > "$log" 2>&1; then
    { echo "bench_dist_net: $name failed"; tail -n 20 "$log"; } >&2
    return 1
  fi
  rm -rf "${tmp:?}/$name"
  local step reduce values
  step=$(sed -n 's/^train: \([0-9]*\) steps, .* in \([0-9.]*\) s of training steps.*/\2 \1/p' "$log" |
         awk '{printf "%.3f", 1e3 * $1 / $2}')
  reduce=$(sed -n 's/^reduce: \([0-9.]*\) ms a step.*/\1/p' "$log")
  values=$(sed -n 's/^reduce: .*all-reduce, \([0-9]*\) fp32 values.*/\1/p' "$log")
  if [ -z "$step" ] || [ -z "$reduce" ] || [ -z "$values" ]; then
    { echo "bench_dist_net: $name: no train:/reduce: line"; tail -n 20 "$log"; } >&2
    return 1
  fi
  echo "$step $reduce $values"
}
# shellcheck source=scripts/bench/median.sh
. scripts/bench/median.sh
# wire_ms VALUES RATE: the least time the link takes for one step's reduction at RATE (tc's kbit, mbit, gbit):
# with 2 ranks each sends the other its fp32 gradients' worth (half in the reduce-scatter, half in the all-gather)
wire_ms() {
  awk -v n="$1" -v r="$2" 'BEGIN{
    u = r; sub(/[0-9.]+/, "", u); x = r + 0
    x *= (u == "gbit") ? 1e9 : (u == "mbit") ? 1e6 : (u == "kbit") ? 1e3 : 1
    printf "%.3f", 1e3 * 4 * n * 8 / x }'
}

printf '%-10s %-9s %-8s %6s %10s %10s %8s %7s\n' model rate overlap binary "step ms" "reduce ms" "wire ms" hidden
for model in $models; do
  case $model in
    text_gpt) steps=${STEPS:-40}; args=(configs/text_gpt.yaml) ;;
    gpt2_tiny) steps=${STEPS:-200}
      args=(configs/gpt2_tiny.yaml "data.train_bin=$tokens/train.bin" "data.val_bin=$tokens/val.bin") ;;
  esac
  args+=("run.steps=$steps" run.epochs=0 run.device=cpu run.threads=1 run.log_every=100000 run.eval_every=0
         run.ckpt_every=0)
  read -ra more <<< "${ARGS:-}"
  args+=("${more[@]}")
  declare -A step_ms=() reduce_ms=()
  for rate in unlimited $rates; do
    tc qdisc del dev lo root 2> /dev/null || true
    [ "$rate" = unlimited ] || tc qdisc add dev lo root tbf rate "$rate" burst 32kb latency 50ms
    for mode in $modes; do
      declare -A s=() r=()
      for i in $(seq "$rounds"); do
        for k in "${!bins[@]}"; do
          out=$(run "${bins[$k]}" "$model-$rate-$mode-$i-$k" "$mode" "${args[@]}")
          read -r a b values <<< "$out"
          s[$k]="${s[$k]:-} $a"; r[$k]="${r[$k]:-} $b"
        done
      done
      for k in "${!bins[@]}"; do
        step_ms[$k/$rate/$mode]=$(echo "${s[$k]}" | median); reduce_ms[$k/$rate/$mode]=$(echo "${r[$k]}" | median)
      done
      unset s r
    done
  done
  tc qdisc del dev lo root 2> /dev/null || true
  for rate in unlimited $rates; do
    for mode in $modes; do
      for k in "${!bins[@]}"; do
        hidden=-; wire=-
        [ "$rate" = unlimited ] || wire=$(wire_ms "$values" "$rate")
        [ "$rate" = unlimited ] || hidden=$(awk -v s="${step_ms[$k/$rate/$mode]}" -v u="${step_ms[$k/unlimited/$mode]}" \
          -v r="${reduce_ms[$k/$rate/off]}" 'BEGIN{printf "%.2f", (r > 0) ? 1 - (s - u) / r : 0}')
        printf '%-10s %-9s %-8s %6s %10.3f %10.3f %8s %7s\n' "$model" "$rate" "$mode" "$((k + 1))" \
          "${step_ms[$k/$rate/$mode]}" "${reduce_ms[$k/$rate/$mode]}" "$wire" "$hidden"
      done
    done
  done
  if [[ " $modes " == *" on "* ]] && [ "$model" = gpt2_tiny ] && [[ " $rates " == *" 1gbit "* ]]; then
    for k in "${!bins[@]}"; do
      awk -v s="${step_ms[$k/1gbit/on]}" -v u="${step_ms[$k/unlimited/on]}" -v r="${reduce_ms[$k/1gbit/off]}" \
        -v w="$(wire_ms "$values" 1gbit)" -v k=$((k + 1)) 'BEGIN{ h = 1 - (s - u) / r
        c = 1 - (2 * w - u) / r; if (c > 1) c = 1
        printf "  target gpt2_tiny at 1gbit: overlap hides >= 70%%: binary %d: %.0f%%, %s (the most the link", k,
        100 * h, (h >= 0.7) ? "met" : "NOT met"
        printf " allows: %.0f%%)\n", 100 * c }'
    done
  fi
  unset step_ms reduce_ms
done
echo "bench_dist_net: $rounds rounds a figure (medians), steps: ${STEPS:-text_gpt 40, gpt2_tiny 200}," \
     "load after $(cut -d' ' -f1-3 /proc/loadavg)"
# ranks that wait for a CPU wait in the all-reduce too (the peer is not running): then that, not the link, is measured
awk -v l="$(cut -d' ' -f1 /proc/loadavg)" -v c="$(getconf _NPROCESSORS_ONLN)" 'BEGIN{ if (l > c) {
  printf "bench_dist_net: warning: load %s on %d cores: the ranks waited for CPUs, and the figures show that", l, c
  printf " more than the link\n" } }'
