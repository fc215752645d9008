#!/usr/bin/env bash
# fp8 against bf16 on one GPU, side by side in one call: tokens/s of every fp8 recipe and of bf16 on a GPT of width
# 2048, 24 blocks, T = 1024 (1.3 B parameters: a 1.3B-class model that trains with AdamW in one H200), and on GPT-2
# 124M (configs/gpt2_124m.yaml), and on GPT-2 124M the evaluation loss after FP8_LOSS_STEPS steps of each recipe on
# the same tokens against bf16's. Writes OUTDIR/fp8.md (one table, with the targets) and a log per run.
#
#   scripts/gpu/bench_fp8.sh OUTDIR   env: AMPTRAIN_BIN (build/ampTrain), FP8_RECIPES ("delayed current"; a recipe
#                                 the binary does not know is left out, and the summary says so; blockwise is not
#                                 a default while its GPU products are plain kernels without tensor cores,
#                                 docs/precision.md: at width 2048 it would spend the phase's time),
#                                 FP8_WIDE_STEPS (30), FP8_WIDE_BATCH (8), FP8_LOSS_STEPS (300), FP8_GPT2_BATCH (16),
#                                 RUN_TIMEOUT (240 s a run), DRY=1 (the same script on the CPU, tiny shapes and a few
#                                 steps: checks the script, measures nothing)
#
# Tokens: every fortune file (/usr/share/games/fortunes, Debian's fortunes package) as bytes
# (scripts/tools/make_tokens.py, nanoGPT's layout), 1% held out for the evaluation. Every run of a model starts from
# the same seed and reads the windows in order (data.sampling sequential), so the runs differ only in precision.
# Throughput: tokens/s, the median of scale_log.csv's 10-step windows after the first (the warm-up). Loss: the
# evaluation loss on the held-out tokens (data.val_windows of them) at the last step, from eval.jsonl.
# Targets (docs/perf.md): width 2048, the best fp8 recipe >= 1.25x bf16's tokens/s; GPT-2 124M, fp8 >= 1.0x; every
# recipe's loss within 0.5% of bf16's.
set -uo pipefail
[ $# -eq 1 ] || { echo "usage: scripts/gpu/bench_fp8.sh OUTDIR" >&2; exit 2; }
cd "$(dirname "$0")/../.." || exit 2
out=$(mkdir -p "$1" && cd "$1" && pwd)
dry=${DRY:-0}; bin=${AMPTRAIN_BIN:-build/ampTrain}; python=/usr/bin/python3
[ -x "$python" ] || python=python3
recipes=${FP8_RECIPES:-delayed current}
wide_steps=${FP8_WIDE_STEPS:-30}; wide_batch=${FP8_WIDE_BATCH:-8}
loss_steps=${FP8_LOSS_STEPS:-300}; gpt2_batch=${FP8_GPT2_BATCH:-16}
run_timeout=${RUN_TIMEOUT:-240}; warm=10; device=cuda
wide_layers=24; wide_embd=2048; wide_heads=16; vocab=50257; seq=1024; val_windows=64; gpt2_desc="GPT-2 124M"
if [ "$dry" = 1 ]; then
  # a width of 128 keeps some products above precision.fp8.min_size's default with these overrides
  wide_steps=${FP8_WIDE_STEPS:-4}; wide_batch=${FP8_WIDE_BATCH:-2}; loss_steps=${FP8_LOSS_STEPS:-4}
  gpt2_batch=${FP8_GPT2_BATCH:-2}; warm=2; device=cpu
  wide_layers=2; wide_embd=128; wide_heads=2; vocab=320; seq=32; val_windows=2; gpt2_desc="2 blocks of width 64"
fi
status=0
note() { echo "bench_fp8: $*" | tee -a "$out/fp8-summary.log"; }
fail() { note "FAIL: $*"; status=1; }
runs=$(mktemp -d /tmp/bench-fp8.XXXXXX)
trap 'rm -rf "$runs"' EXIT
export OPENBLAS_NUM_THREADS=1
t0=$(date +%s)

# ---- inputs: the tokens, and the two models' configs ----
mapfile -t texts < <(find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' | sort)
[ ${#texts[@]} -gt 0 ] || { fail "no fortune files in /usr/share/games/fortunes (Debian's fortunes package)"; exit 1; }
"$python" scripts/tools/make_tokens.py --format nanogpt --val-fraction 0.01 -o "$runs/train.bin" "${texts[@]}" \
  > "$out/fp8-inputs.log" 2>&1 || { fail "tokens (see fp8-inputs.log)"; exit 1; }
gpt_yaml() { # file layers width heads: a GPT-2-shaped model (configs/gpt2_124m.yaml's layers) of that size
  local f=$1 layers=$2 embd=$3 heads=$4 i
  {
    printf 'run:\n  name: %s\n  seed: 1234\n' "$(basename "$f" .yaml)"
    printf 'data:\n  format: tokens\n  train_bin: %s\n  val_bin: %s\n  vocab: %d\n  seq_len: %d\n' \
      "$runs/train.bin" "$runs/val.bin" $vocab $seq
    printf 'model:\n  init: gpt2\n  layers:\n'
    printf '    - {kind: embedding, name: wte, vocab: %d, dim: %d, max_len: %d}\n' $vocab "$embd" $seq
    for i in $(seq 0 $((layers - 1))); do printf '    - {kind: transformer_block, name: h%d, heads: %d}\n' "$i" "$heads"; done
    printf '    - {kind: layernorm, name: ln_f}\n'
    printf '    - {kind: linear, name: lm_head, out: %d, bias: false, tie: wte/wte}\n' $vocab
    printf '    - {kind: cross_entropy}\n'
    printf 'optim:\n  kind: adamw\n  lr: 6e-4\n  betas: [0.9, 0.95]\n  weight_decay: 0.1\n'
    printf '  schedule: {kind: cosine, warmup_steps: 100, min_lr: 6e-5}\n'
    printf 'precision:\n  mode: bf16\nclip:\n  max_norm: 1.0\n'
  } > "$f"
}
gpt_yaml "$runs/wide.yaml" $wide_layers $wide_embd $wide_heads
if [ "$dry" = 1 ]; then gpt_yaml "$runs/gpt2.yaml" 2 64 2; else cp configs/gpt2_124m.yaml "$runs/gpt2.yaml"; fi
cp "$runs/wide.yaml" "$out/fp8-wide.yaml"

# the recipes this binary knows (`check` refuses an unknown one with exit 2)
known=()
for r in $recipes; do
  if "$bin" check "$runs/wide.yaml" precision.mode=fp8 precision.fp8.recipe="$r" > "$out/fp8-check-$r.log" 2>&1; then
    known+=("$r")
  else note "recipe $r: not known to this binary, left out (fp8-check-$r.log)"; fi
done
note "inputs: $(( $(stat -c %s "$runs/train.bin") / 2 )) tokens; recipes ${known[*]:-none} ($(( $(date +%s) - t0 )) s)"

declare -A tps loss
run_one() { # key model steps batch mode [recipe]
  local key=$1 model=$2 steps=$3 b=$4 mode=$5 recipe=${6:-} log="$out/fp8-$1.log"
  local extra=()
  [ -n "$recipe" ] && extra=(precision.fp8.recipe="$recipe")
  timeout "$run_timeout" "$bin" run "$runs/$model.yaml" run.device=$device run.steps="$steps" run.log_every=$warm \
    run.eval_every=0 run.ckpt_every=0 run.keep_ckpts=1 "run.out_dir=$runs/$key" precision.mode="$mode" "${extra[@]}" \
    data.batch_size="$b" data.train_bin="$runs/train.bin" data.val_bin="$runs/val.bin" data.val_windows=$val_windows \
    data.sampling=sequential > "$log" 2>&1
  local rc=$?
  cp "$runs/$key/scale_log.csv" "$out/fp8-$key.scale_log.csv" 2>/dev/null
  tps[$key]=$(awk -F, -v w=$warm -v T=$seq 'NR > 1 && $1 > w && $1 % w == 0 { print $NF * T }' \
                "$out/fp8-$key.scale_log.csv" 2>/dev/null | sort -g | awk '{ v[NR] = $1 } END { if (NR) print v[int((NR + 1) / 2)] }')
  loss[$key]=$(tail -1 "$runs/$key/eval.jsonl" 2>/dev/null | sed -n 's/.*"loss": *\([0-9.eE+-]*\).*/\1/p')
  rm -rf "${runs:?}/$key"
  grep -q "device: $device" "$log" || fail "$key did not run on $device (see fp8-$key.log)"
  [ $rc -eq 0 ] && [ -n "${tps[$key]}" ] || fail "$key: rc $rc (see fp8-$key.log)"
}

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "" || b == "" || b == 0) print "-"; else printf "%.2f", a / b }'; }
rel() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "" || b == "" || b == 0) print "-"; else printf "%+.2f%%", 100 * (a - b) / b }'; }
write_table() {
  local k r
  {
    if [ "$dry" = 1 ]; then echo "DRY run of bench_fp8 on the CPU, $(date -u +%Y-%m-%d): checks the script; these figures measure nothing"
    else echo "fp8 against bf16 on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $(date -u +%Y-%m-%d), commit $(git rev-parse --short HEAD 2>/dev/null)"; fi
    echo "(wide: $wide_layers blocks of width $wide_embd, T = $seq, micro-batch $wide_batch, $wide_steps steps;" \
         "gpt2: $gpt2_desc, micro-batch $gpt2_batch, $loss_steps steps; the first $warm steps warm-up;" \
         "loss: evaluation on $val_windows held-out windows after the last step)"
    echo
    echo "| model | run | tokens/s | / bf16 | eval loss | against bf16 |"
    echo "|---|---|---|---|---|---|"
    for k in wide gpt2; do
      for r in bf16 "${known[@]}"; do
        local key=$k-$r
        [ -n "${tps[$key]+x}" ] || continue
        echo "| $k | $([ "$r" = bf16 ] && echo bf16 || echo "fp8 $r") | ${tps[$key]:--} | $(ratio "${tps[$key]:-}" "${tps[$k-bf16]:-}") |" \
             "$([ "$k" = gpt2 ] && echo "${loss[$key]:--}" || echo -) | $([ "$k" = gpt2 ] && [ "$r" != bf16 ] && rel "${loss[$key]:-}" "${loss[gpt2-bf16]:-}" || echo -) |"
      done
    done
    echo
    echo "Targets: wide, best fp8 >= 1.25x bf16; gpt2 fp8 >= 1.0x bf16; every recipe's loss within 0.5% of bf16's."
  } > "$out/fp8.md"
}

# the wide model: throughput only; then GPT-2 124M, whose runs are long enough to compare losses
run_one wide-bf16 wide "$wide_steps" "$wide_batch" bf16; write_table
for r in "${known[@]}"; do run_one "wide-$r" wide "$wide_steps" "$wide_batch" fp8 "$r"; write_table; done
run_one gpt2-bf16 gpt2 "$loss_steps" "$gpt2_batch" bf16; write_table
for r in "${known[@]}"; do run_one "gpt2-$r" gpt2 "$loss_steps" "$gpt2_batch" fp8 "$r"; write_table; done
for r in "${known[@]}"; do
  d=$(rel "${loss[gpt2-$r]:-}" "${loss[gpt2-bf16]:-}")
  ok=$(awk -v a="${loss[gpt2-$r]:-}" -v b="${loss[gpt2-bf16]:-}" 'BEGIN { if (a == "" || b == "") print "?"; else print ((a - b) / b <= 0.005 && (b - a) / b <= 0.005) ? "within" : "outside" }')
  note "gpt2 $r: loss $d against bf16 ($ok 0.5%), tokens/s $(ratio "${tps[gpt2-$r]:-}" "${tps[gpt2-bf16]:-}")x bf16; wide $(ratio "${tps[wide-$r]:-}" "${tps[wide-bf16]:-}")x"
done
write_table
cat "$out/fp8.md"
note "done in $(( $(date +%s) - t0 )) s, status $status"
exit $status
