#!/usr/bin/env bash
# GPT-2 124M (configs/gpt2_124m.yaml, T = 1024) on one GPU, side by side in one call: ampTrain in bf16, fp16-dynamic
# and fp8 at micro-batches 16 and 32, PyTorch (scripts/gpu/bench_gpt2.py: the same model, initial weights and token
# windows, F.scaled_dot_product_attention, fused AdamW, bf16 autocast, torch.compile) and, where given, llm.c's
# train_gpt2cu. Writes OUTDIR/gpt2.md (one table) and a log per run.
#
#   scripts/gpu/bench_gpt2.sh OUTDIR   env: AMPTRAIN_BIN (build/ampTrain), PYTHON (python3: the one with PyTorch),
#                                  GPT2_BATCHES ("16 32"), GPT2_MODES ("bf16 fp16-dynamic fp8"), GPT2_STEPS (70: the
#                                  first 10 are warm-up), GPT2_AGREE (50: the steps whose losses must agree),
#                                  LLMC (a built train_gpt2cu, or its source directory to build with make; none:
#                                  no llm.c row), RUN_TIMEOUT (240 s a run), DRY=1 (the same script on the CPU with
#                                  configs/gpt2_tiny.yaml's shape at T = 32, a few steps: checks the script,
#                                  measures nothing)
#
# Tokens: every fortune file (/usr/share/games/fortunes, Debian's fortunes package) as bytes (scripts/tools/make_tokens.py:
# ids below 256, valid ids of GPT-2's vocabulary), about 2.7 M tokens, nanoGPT's layout for ampTrain and PyTorch and
# llm.c's for llm.c. Initial weights: scripts/ref/gpt2_torch.py init (nanoGPT's init, seed 1) read by ampTrain through
# model.init_from (hf-gpt2 names) and by PyTorch; llm.c starts from its own random weights (-e d12). Both read the
# windows in order: ampTrain with data.sampling sequential, PyTorch the same windows (bench_gpt2.py).
#
# Throughput: tokens/s of the steps after the warm-up (ampTrain: the median of its 10-step log windows after the
# first; PyTorch and llm.c: their timed steps). MFU in the PaLM / nanoGPT convention: 6N + 12 L d T FLOPs a token
# (N the matrix weights, the tied head once: 854.4 MFLOP for GPT-2 124M at T = 1024) over 989.4 TFLOP/s, the
# H100/H200's dense bf16 rate. Memory: ampTrain's peak device memory in use (AMPTRAIN_CUDA_MEMLOG), PyTorch's tensors'
# peak and device memory in use.
# Loss agreement (ampTrain bf16 against PyTorch at the first batch size): step 1 within 1e-3 relative, steps 6 to AGREE
# within 1% each.
set -uo pipefail
[ $# -eq 1 ] || { echo "usage: scripts/gpu/bench_gpt2.sh OUTDIR" >&2; exit 2; }
cd "$(dirname "$0")/../.." || exit 2
out=$(mkdir -p "$1" && cd "$1" && pwd)
dry=${DRY:-0}; python=${PYTHON:-python3}; bin=${AMPTRAIN_BIN:-build/ampTrain}
batches=${GPT2_BATCHES:-16 32}; modes=${GPT2_MODES:-bf16 fp16-dynamic fp8}; steps=${GPT2_STEPS:-70}
agree=${GPT2_AGREE:-50}
run_timeout=${RUN_TIMEOUT:-240}; warm=10
layers=12; heads=12; embd=768; vocab=50257; seq=1024; device=cuda; compile=--compile; cfg=configs/gpt2_124m.yaml
if [ "$dry" = 1 ]; then
  layers=2; heads=2; embd=32; vocab=320; seq=32; device=cpu; compile=""; cfg=configs/gpt2_tiny.yaml
  batches=${GPT2_BATCHES:-2}; steps=${GPT2_STEPS:-8}; agree=${GPT2_AGREE:-8}; warm=2
fi
status=0
note() { echo "bench_gpt2: $*" | tee -a "$out/gpt2-summary.log"; }
fail() { note "FAIL: $*"; status=1; }
# FLOPs a token (PaLM / nanoGPT): 6 N + 12 L d T, N = L * 12 d^2 + vocab * d (the matrix weights, tied head once)
flops=$(awk -v L=$layers -v d=$embd -v V=$vocab -v T=$seq 'BEGIN { printf "%.0f", 6 * (L * 12 * d * d + V * d) + 12 * L * d * T }')
mfu() { awk -v t="$1" -v f="$flops" 'BEGIN { if (t == "") print "-"; else printf "%.1f%%", 100 * t * f / 989.4e12 }'; }
runs=$(mktemp -d /tmp/bench-gpt2.XXXXXX)
trap 'rm -rf "$runs"' EXIT
export OPENBLAS_NUM_THREADS=1

# ---- inputs ----
t0=$(date +%s)
mapfile -t texts < <(find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' | sort)
[ ${#texts[@]} -gt 0 ] || { fail "no fortune files in /usr/share/games/fortunes (Debian's fortunes package)"; exit 1; }
"$python" scripts/tools/make_tokens.py --format nanogpt -o "$runs/train.bin" "${texts[@]}" > "$out/gpt2-inputs.log" 2>&1 &&
  "$python" scripts/tools/make_tokens.py --format llmc -o "$runs/train_llmc.bin" "${texts[@]}" >> "$out/gpt2-inputs.log" 2>&1 &&
  "$python" scripts/ref/gpt2_torch.py init "$runs/init.safetensors" --layers $layers --heads $heads --embd $embd \
    --vocab $vocab --block $seq --seed 1 >> "$out/gpt2-inputs.log" 2>&1 ||
  { fail "inputs (see gpt2-inputs.log)"; exit 1; }
note "inputs: $(( $(stat -c %s "$runs/train.bin") / 2 )) tokens, initial weights of a $layers-layer GPT of width $embd" \
     "($(( $(date +%s) - t0 )) s); $flops FLOPs a token"

# the optimizer of configs/gpt2_124m.yaml, set for both (DRY's gpt2_tiny.yaml has another), the cosine over the run
optim=(optim.kind=adamw optim.lr=6e-4 'optim.betas=[0.9,0.95]' optim.eps=1e-8 optim.weight_decay=0.1
       optim.schedule.kind=cosine optim.schedule.warmup_steps=200 optim.schedule.min_lr=6e-5 clip.max_norm=1.0)
declare -A tps mem
# ampTrain: tokens/s from scale_log.csv's samples_per_s (the median of the windows after the first), peak device memory
run_amp() { # key mode batch
  local key=$1 mode=$2 b=$3 log="$out/gpt2-amp-$1.log"
  AMPTRAIN_CUDA_MEMLOG=1 timeout "$run_timeout" "$bin" run "$cfg" run.device=$device run.steps=$steps run.log_every=$warm \
    run.eval_every=0 run.ckpt_every=0 run.keep_ckpts=1 "run.out_dir=$runs/$key" precision.mode=$mode \
    data.batch_size=$b data.seq_len=$seq data.train_bin="$runs/train.bin" 'data.val_bin=""' data.sampling=sequential \
    model.init_from="$runs/init.safetensors" model.init_names=hf-gpt2 "${optim[@]}" > "$log" 2>&1
  local rc=$?
  cp "$runs/$key/scale_log.csv" "$out/gpt2-amp-$key.scale_log.csv" 2>/dev/null; rm -rf "${runs:?}/$key"
  tps[$key]=$(awk -F, -v w=$warm -v T=$seq 'NR > 1 && $1 > w && $1 % w == 0 { print $NF * T }' \
                "$out/gpt2-amp-$key.scale_log.csv" 2>/dev/null | sort -g | awk '{ v[NR] = $1 } END { if (NR) print v[int((NR + 1) / 2)] }')
  mem[$key]=$(sed -n 's/.*peak device memory in use \([0-9.]*\) MiB.*/\1/p' "$log" | tail -1)
  grep -q "device: $device" "$log" || fail "ampTrain $key did not run on $device (see gpt2-amp-$key.log)"
  [ $rc -eq 0 ] && [ -n "${tps[$key]}" ] || fail "ampTrain $key: rc $rc (see gpt2-amp-$key.log)"
}

run_torch() { # key batch
  local key=$1 b=$2 log="$out/gpt2-torch-$1.log"
  timeout "$run_timeout" "$python" scripts/gpu/bench_gpt2.py "$runs/init.safetensors" --tokens-file "$runs/train.bin" \
    --heads $heads --batch "$b" --seq $seq --steps $steps --warmup $warm --device $device $compile \
    --lr 6e-4 --min-lr 6e-5 --warmup-steps 200 --total-steps $steps > "$log" 2>&1
  local rc=$?
  tps[$key]=$(sed -n 's/^bench_gpt2: .*: \([0-9.]*\) tokens\/s.*/\1/p' "$log")
  # torch.compile failing (no Triton or C compiler there) leaves the run eager: said in the table, not silent
  grep -q "^bench_gpt2: torch.compile failed\|^bench_gpt2: torch.compile unavailable" "$log" &&
    { torch_eager="eager: torch.compile failed (gpt2-torch-$key.log)"; note "torch $key ran $torch_eager"; }
  mem[$key]="$(sed -n 's/.*device in use \([0-9.]*\) MiB.*/\1/p' "$log") ($(sed -n 's/.*peak \([0-9.]*\) MiB.*/\1/p' "$log") tensors)"
  [ $rc -eq 0 ] && [ -n "${tps[$key]}" ] || fail "torch $key: rc $rc (see gpt2-torch-$key.log)"
}

# llm.c's train_gpt2cu: its own random GPT-2 124M (-e d12), the same bytes in its layout, no evaluation, sampling or
# checkpoints; "tok/s" of its step lines after the warm-up
llmc_bin=""
if [ -n "${LLMC:-}" ] && [ "$dry" != 1 ]; then
  if [ -x "$LLMC" ]; then llmc_bin=$LLMC
  elif [ -d "$LLMC" ] && make -C "$LLMC" train_gpt2cu GPU_COMPUTE_CAPABILITY=90 NO_MULTI_GPU=1 NO_USE_MPI=1 USE_CUDNN=0 \
         > "$out/gpt2-llmc-build.log" 2>&1; then llmc_bin=$LLMC/train_gpt2cu
  else fail "llm.c: $LLMC is neither train_gpt2cu nor a source directory that builds (see gpt2-llmc-build.log)"; fi
fi
# the bundle's llmc/CUDNN says how gpu-bundle.sh built it; a checkout built here is without cuDNN
llmc_attn="attention without cuDNN (USE_CUDNN=0)"
[ -n "$llmc_bin" ] && [ "$(cat "$(dirname "$llmc_bin")/CUDNN" 2>/dev/null)" = 1 ] &&
  llmc_attn="cuDNN flash attention (USE_CUDNN=1)"
run_llmc() { # key batch
  local key=$1 b=$2 log="$out/gpt2-llmc-$1.log"
  (cd "$runs" && timeout "$run_timeout" "$llmc_bin" -i train_llmc.bin -j train_llmc.bin -e d12 -b "$b" -t $seq \
     -x $steps -v 100000 -m 1 -s 0 -n 0 -l 6e-4 -u 200 -c 0.1 -z 0 -r 0) > "$log" 2>&1
  local rc=$?
  tps[$key]=$(sed -n 's/^step *\([0-9]*\)\/.* \([0-9.]*\) tok\/s.*/\1 \2/p' "$log" | awk -v w=$warm '$1 > w { print $2 }' |
                sort -g | awk '{ v[NR] = $1 } END { if (NR) print v[int((NR + 1) / 2)] }')
  mem[$key]=-
  [ $rc -eq 0 ] && [ -n "${tps[$key]}" ] || fail "llm.c $key: rc $rc (see gpt2-llmc-$key.log)"
}

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "" || b == "" || b == 0) print "-"; else printf "%.2f", a / b }'; }
write_table() {
  local b mode k
  {
    if [ "$dry" = 1 ]; then echo "DRY run of bench_gpt2 on the CPU, $(date -u +%Y-%m-%d): checks the script; these figures measure nothing"
    else echo "GPT-2 124M, T = $seq, on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $(date -u +%Y-%m-%d), commit $(git rev-parse --short HEAD 2>/dev/null)"; fi
    echo "($steps steps a run, the first $warm warm-up; MFU: 6N + 12LdT = $flops FLOPs a token over 989.4 TFLOP/s dense bf16)"
    [ -n "$llmc_bin" ] && echo "(llm.c: $llmc_attn)"
    [ -n "$torch_eager" ] && echo "(PyTorch ran $torch_eager)"
    echo
    echo "| micro-batch | run | tokens/s | MFU | / PyTorch | device MiB |"
    echo "|---|---|---|---|---|---|"
    for b in $batches; do
      for k in $(for mode in $modes; do echo "amp-$mode-$b"; done) "torch-$b" "llmc-$b"; do
        [ -n "${tps[$k]+x}" ] || continue
        echo "| $b | ${k%-$b} | ${tps[$k]:--} | $(mfu "${tps[$k]:-}") | $(ratio "${tps[$k]:-}" "${tps[torch-$b]:-}") | ${mem[$k]:--} |"
      done
    done
    echo
    echo "Loss agreement (ampTrain bf16 against PyTorch, micro-batch ${batches%% *}): ${agreement:-not measured}"
  } > "$out/gpt2.md"
}

# loss agreement: the first batch size's bf16 runs, step by step; measured as soon as both have run, so a phase cut
# short by its caller's time limit (the device machine's) still reports it
loss_agreement() {
local b=${batches%% *} amp_csv torch_log
amp_csv="$out/gpt2-amp-amp-bf16-$b.scale_log.csv"; torch_log="$out/gpt2-torch-torch-$b.log"
if [ -s "$amp_csv" ] && [ -s "$torch_log" ]; then
  agreement=$(awk -F, -v n="$agree" '
    FNR == NR { if (FNR > 1) amp[$1] = $3; next }
    /^step [0-9]+ loss / { torch[$2] = $4 }
    END {
      worst = 0; at = 0; first = -1; ok = 1
      for (s = 1; s <= n; s++) {
        if (!(s in amp) || !(s in torch)) { printf "step %d missing in a log; ", s; ok = 0; continue }
        rel = amp[s] > torch[s] ? (amp[s] - torch[s]) / torch[s] : (torch[s] - amp[s]) / torch[s]
        if (s == 1) { first = rel; if (rel > 1e-3) ok = 0 }
        else if (s > 5 && rel > worst) { worst = rel; at = s }
      }
      if (worst > 0.01) ok = 0
      printf "step 1 %.2e relative (target <= 1e-3), steps 6-%d at most %.2e (step %d; target <= 1e-2): %s", first, n, worst, at, ok ? "PASS" : "FAIL"
    }' "$amp_csv" FS=" " "$torch_log")
  note "loss agreement: $agreement"
  case $agreement in *PASS) ;; *) [ "$dry" = 1 ] || fail "loss agreement: $agreement" ;; esac
fi
}

agreement=""; torch_eager=""
for b in $batches; do
  for mode in $modes; do run_amp "amp-$mode-$b" "$mode" "$b"; write_table; done
  run_torch "torch-$b" "$b"
  [ "$b" = "${batches%% *}" ] && loss_agreement
  write_table
  [ -n "$llmc_bin" ] && { run_llmc "llmc-$b" "$b"; write_table; }
done
write_table
cat "$out/gpt2.md"
note "done in $(( $(date +%s) - t0 )) s, status $status"
exit $status
