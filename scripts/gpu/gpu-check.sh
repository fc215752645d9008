#!/usr/bin/env bash
# The GPU check, in one go (on an H200, 2026-12-04: tests 32 s, bench about 150 s; the build phase not yet timed
# there): build for sm_90, run the GPU tests, train every reference model in every precision mode on the GPU
# for a few hundred steps, benchmark ampTrain against PyTorch eager AMP (scripts/gpu/bench_gpu_torch.py) on the
# same models, batches and optimizer, and write
#   OUTDIR/table.md   one markdown table (samples/s, tokens/s, peak GPU memory, ratios) for docs/perf.md
#   OUTDIR/*.log      every build, test, training and benchmark log
#   scripts/gpu/gpu-check.sh OUTDIR        env: STEPS (default 300), WIDE_STEPS (100), JOBS (nproc),
#                                      PYTHON (python3: the one with PyTorch), BUILD_DIR (build-gpu),
#                                      PHASES ("build gpt2 tests bench"; gpt2: scripts/gpu/bench_gpt2.sh, GPT-2 124M at
#                                      T = 1024 against PyTorch and llm.c, first after the build, table in
#                                      OUTDIR/gpt2.md, about 5 minutes; and when asked "sanitize": compute-sanitizer
#                                      memcheck over the op tests, "cpu": the host's CPU against PyTorch's,
#                                      scripts/bench/bench_cpu.sh, fashion_mlp fp32 at 1 and all threads, "fp8":
#                                      scripts/gpu/bench_fp8.sh, every fp8 recipe against bf16, table in
#                                      OUTDIR/fp8.md, under 4 minutes); the bench phase also runs the small models
#                                      in bf16 with CUDA graphs off and on, side by side (OUTDIR/graphs.md),
#                                      TEST_TIMEOUT (120 s a test binary: the H200 ran each in 1-29 s),
#                                      RUN_TIMEOUT (90 s a training run; 300 s with DRY=1, where
#                                      width-768 GPT runs on two CPU cores have passed 90 s: PyTorch
#                                      fp32, ampTrain fp8 with its evaluation)
# The build goes to BUILD_DIR in the checkout, not OUTDIR, so OUTDIR holds only logs and the table, and a
# later call with PHASES="tests" or "bench" reuses it (on the device machine: while it stays warm).
# BUNDLE=.gpu-bundle/bundle.tar.gz uses what scripts/gpu/gpu-bundle.sh built on the development machine
# (binaries, the shared libraries the GPU machine lacks, the datasets) instead of building: the lent H200
# has CUDA, cuDNN (PyTorch's), CMake and PyTorch but none of our Debian packages or datasets, and can fetch
# nothing. It unpacks the bundle to /tmp, installs the datasets where the configs expect them, links the
# checkout to the path the tests were built in, and finds cuDNN; the build phase is then skipped.
# The build phase compiles the fused attention with cuDNN's frontend headers from CUDNN_FRONTEND_DIR when set (a
# machine without PyPI: the bundle's cudnn-frontend/include, `tar -xzf bundle.tar.gz ./cudnn-frontend`), else from
# CMake's default (scripts/install-deps.sh's); the summary's versions line says whether the binary has it.
# DRY=1 checks the script itself on a machine without a GPU: the same runs on the CPU (ampTrain
# run.device=cpu, PyTorch on the CPU), a few steps each, GPU tests and the nvidia-smi check left out, so
# that the logs' parsing and the table can be seen to work before a GPU's limited time is spent. The text_gpt
# runs then hold out 1% of the text for their final evaluation, not 10%: at width 768 on two cores that
# evaluation was nearly all of a run's time (on a busy machine, 13 s of training, then an evaluation that
# was still going when RUN_TIMEOUT's 300 s ended it). The width-768 rows then run at width 128 (2 heads of 64;
# WIDE_WIDTH, a multiple of 64, sets it), under the same row names: a DRY run checks the script, not the model.
set -uo pipefail
[ $# -eq 1 ] || { echo "usage: scripts/gpu/gpu-check.sh OUTDIR" >&2; exit 2; }
cd "$(dirname "$0")/../.." || exit 2
out=$(mkdir -p "$1" && cd "$1" && pwd)
dry=${DRY:-0}; python=${PYTHON:-python3}
[ -d /usr/local/cuda/bin ] && export PATH="$PATH:/usr/local/cuda/bin"
steps=${STEPS:-300}; wide_steps=${WIDE_STEPS:-100}; jobs=${JOBS:-$(nproc)}
run_timeout=${RUN_TIMEOUT:-90}
[ "$dry" = 1 ] && { steps=${STEPS:-3}; wide_steps=${WIDE_STEPS:-2}; run_timeout=${RUN_TIMEOUT:-300}; }
device=cuda; torch_device=cuda
[ "$dry" = 1 ] && { device=cpu; torch_device=cpu; }
# the width-768 rows' width (DRY: 128 unless WIDE_WIDTH), heads of 64
width=${WIDE_WIDTH:-768}
[ "$dry" = 1 ] && width=${WIDE_WIDTH:-128}
case $width in *[!0-9]* | '') width=0 ;; esac
[ $((width % 64)) = 0 ] && [ "$width" -gt 0 ] ||
  { echo "gpu-check: WIDE_WIDTH: a positive multiple of 64, not '${WIDE_WIDTH:-}'" >&2; exit 2; }
heads=$((width / 64))
build=${BUILD_DIR:-build-gpu}; phases=" ${PHASES:-build gpt2 tests bench} "
has_phase() { case $phases in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
status=0
note() { echo "gpu-check: $*" | tee -a "$out/summary.log"; }
fail() { note "FAIL: $*"; status=1; }
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
# the directory of PyTorch's pip CUDA 13 libraries (cuBLAS, the runtime, NVRTC: nvidia/cu13/lib), or nothing
pip_cu13_lib() {
  "$python" -c 'import os, nvidia; print(":".join(d for d in (os.path.join(p, "cu13", "lib") for p in nvidia.__path__) if os.path.isdir(d)))' 2>/dev/null
}

# ---- the bundle: binaries and libraries from the development machine ----
if [ -n "${BUNDLE:-}" ]; then
  root=/tmp/amp-bundle
  rm -rf "$root" && mkdir -p "$root" && tar -C "$root" -xzf "$BUNDLE" ||
    { fail "cannot unpack $BUNDLE"; exit 1; }
  commit="$(head -c 9 "$root/COMMIT")$(grep -q dirty "$root/COMMIT" && echo ' (dirty)') (bundle)"
  for d in datasets/fashion-mnist games/fortunes; do
    [ -e "/usr/share/$d" ] || { mkdir -p "$(dirname "/usr/share/$d")" && cp -r "$root/data/${d#*/}" "/usr/share/$d"; } ||
      fail "cannot install /usr/share/$d (needs root)"
  done
  src=$(cat "$root/SOURCE_DIR")
  if [ "$(cd "$src" 2>/dev/null && pwd -P)" != "$(pwd -P)" ]; then
    [ -e "$src" ] && { fail "the tests were built in $src, which exists here and is not this checkout"; exit 1; }
    mkdir -p "$(dirname "$src")" && ln -s "$(pwd -P)" "$src" || { fail "cannot link $src to this checkout"; exit 1; }
  fi
  cudnn=$("$python" -c 'import nvidia.cudnn as m; print(m.__path__[0] + "/lib")' 2>/dev/null)
  [ -e "$cudnn/libcudnn.so.9" ] ||
    cudnn=$(dirname "$(find /usr/local /usr/lib /opt -name libcudnn.so.9 2>/dev/null | head -1)" 2>/dev/null)
  [ -e "$cudnn/libcudnn.so.9" ] || { fail "no libcudnn.so.9 on this machine"; exit 1; }
  cuda_lib=$(dirname "$(find /usr/local/cuda/ /usr/local/cuda-13*/ -name 'libcublasLt.so.13' 2>/dev/null | head -1)" 2>/dev/null)
  # PyTorch's pip copies of cuBLAS, the CUDA runtime and NVRTC (which cuDNN's runtime-compiled engines load), for a
  # machine whose toolkit lacks them: CUDA 13's wheels put them all in nvidia/cu13/lib (CUDA 12's nvidia/cublas/lib
  # and the like hold the .so.12 libraries, which the bundle's binaries do not load)
  pip_cuda=$(pip_cu13_lib)
  # NCCL (not in the bundle: 218 MB): the toolkit's, else PyTorch's pip copy
  nccl_lib=$(dirname "$(find /usr/local/cuda/ /usr/local/cuda-13*/ /usr/lib -name 'libnccl.so.2' 2>/dev/null | head -1)" 2>/dev/null)
  [ -n "$nccl_lib" ] || nccl_lib=$("$python" -c 'import nvidia.nccl as n; print(n.__path__[0] + "/lib")' 2>/dev/null)
  pip_cuda="${pip_cuda}${nccl_lib:+:$nccl_lib}"
  export LD_LIBRARY_PATH="$root/lib:$cuda_lib:$cudnn${pip_cuda:+:$pip_cuda}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  note "bundle: commit $commit, cuDNN from $cudnn, CUDA libraries from ${cuda_lib:-the default search path}"
  ldd "$root/bin/test_cuda_backend" "$root/bin/libamp_cuda.so" | grep "not found" && { fail "libraries missing (ldd above)"; exit 1; }
  build="$root/bin"
  phases=${phases/ build / }
  export AMPTRAIN_BIN="$root/bin/ampTrain" # the tests' compiled path is the bundle's build directory, absent here
fi

if [ "$dry" = 1 ]; then note "DRY run: everything on the CPU, no GPU tests (checks this script, measures nothing)"
else nvidia-smi > "$out/nvidia-smi.log" 2>&1 || fail "nvidia-smi did not run (no GPU?)"; fi
note "commit $commit$(git diff --quiet 2>/dev/null || echo ' (checkout dirty)'), $(date -u +%Y-%m-%dT%H:%MZ)"
note "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
# the host's CPU (a Zen 4 is AMD family 25, models 0x10-0x1f, 0x60-0x7f, 0xa0-0xaf)
cpu_line() { lscpu 2>/dev/null | sed -n "s/^$1: *//p" | head -1; }
note "host CPU: $(cpu_line 'Model name'), $(cpu_line 'Vendor ID') family $(cpu_line 'CPU family') model $(cpu_line 'Model'), $(nproc) CPUs"

# ---- build (sm_90 only: the H200; the default build also makes sm_80 and PTX) ----
t0=$(date +%s)
if ! has_phase build; then
  [ -x "$build/ampTrain" ] || { fail "no $build/ampTrain: run the build phase first"; exit 1; }
  note "build: skipped (PHASES), using $build"
elif cmake -S . -B "$build" -DAMP_CUDA_ARCHITECTURES=90 -DAMP_WERROR=ON -DCMAKE_BUILD_TYPE=Release \
     ${CUDNN_FRONTEND_DIR:+-DAMP_CUDNN_FRONTEND_DIR="$CUDNN_FRONTEND_DIR"} > "$out/build.log" 2>&1 &&
   cmake --build "$build" -j "$jobs" >> "$out/build.log" 2>&1; then
  note "build: ok ($(( $(date +%s) - t0 )) s)"
else
  fail "build (see build.log)"; exit 1
fi
has_phase build && ! grep -q "CUDA backend ON" "$out/build.log" && [ "$dry" != 1 ] &&
  { fail "the build has no CUDA backend (see build.log)"; exit 1; }
bin="$build/ampTrain"
# what actually loads here (the bundle was built against cuDNN 9.19; this machine may load another 9.x)
note "versions: $("$bin" --version 2>&1 | tr '\n' ';' | sed 's/;$//')"
# the CUDA backend is a module the binary loads (lib/base/device_module.h): say at once if it cannot be
"$bin" --version 2>&1 | grep -q "CUDA: not loaded" && [ "$dry" != 1 ] &&
  { fail "the CUDA backend module did not load: $("$bin" --version 2>&1 | grep 'CUDA: not loaded')"; exit 1; }

# ---- GPT-2 124M against PyTorch and llm.c (scripts/gpu/bench_gpt2.sh; the bundle's train_gpt2cu where it has one):
# first, so that a call cut short still has it ----
if has_phase gpt2; then
  t1=$(date +%s)
  llmc=""
  [ -n "${BUNDLE:-}" ] && [ -x "$root/llmc/train_gpt2cu" ] && llmc="$root/llmc/train_gpt2cu"
  DRY=$dry PYTHON="$python" AMPTRAIN_BIN="$bin" LLMC="${LLMC:-$llmc}" timeout "${GPT2_TIMEOUT:-420}" scripts/gpu/bench_gpt2.sh "$out" \
    > "$out/gpt2.log" 2>&1
  rc=$?
  agreement=$(sed -n 's/^bench_gpt2: loss agreement: //p' "$out/gpt2.log")
  if [ $rc = 0 ]; then note "gpt2: ok ($(( $(date +%s) - t1 )) s, gpt2.md): loss agreement ${agreement:-?}"
  else fail "gpt2: rc $rc ($(( $(date +%s) - t1 )) s; gpt2.log, gpt2.md)"; fi
fi

# ---- optional (PHASES="... fp8"): fp8 against bf16 (scripts/gpu/bench_fp8.sh): every recipe's tokens/s on a GPT of
# width 2048 and on GPT-2 124M, and its loss after 300 steps against bf16's; table in OUTDIR/fp8.md, under 4 minutes ----
if has_phase fp8; then
  t1=$(date +%s)
  DRY=$dry AMPTRAIN_BIN="$bin" timeout "${FP8_TIMEOUT:-240}" scripts/gpu/bench_fp8.sh "$out" > "$out/fp8.log" 2>&1
  rc=$?
  if [ $rc = 0 ]; then note "fp8: ok ($(( $(date +%s) - t1 )) s, fp8.md): $(grep '^bench_fp8: gpt2 ' "$out/fp8.log" | sed 's/^bench_fp8: //' | paste -sd ';' | sed 's/;/; /g')"
  else fail "fp8: rc $rc ($(( $(date +%s) - t1 )) s; fp8.log, fp8.md)"; fi
fi

# ---- GPU tests: on a GPU machine a skip is a failure ----
export OPENBLAS_NUM_THREADS=1
# NCCL (the one-rank communicator of test_cuda_dist and the bench's NCCL run) on one machine: its warnings in the
# logs, so a refusal (gVisor's /sys and sockets are limited: KINDS.md) says why; the loopback interface, so its
# socket setup does not search the machine's network
export NCCL_DEBUG=${NCCL_DEBUG:-WARN} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
# The end-to-end GPU tests run $AMPTRAIN_BIN where set (the bundle's binary). Prove it with a wrapper that
# leaves a mark (no GPU needed, so the DRY run checks it too).
if has_phase tests; then
  wrapper="$out/amptrain-wrapper.sh"
  printf '#!/bin/sh\necho called >> "%s.calls"\nexec "%s" "$@"\n' "$wrapper" "$(cd "$(dirname "$bin")" && pwd)/ampTrain" > "$wrapper"
  chmod +x "$wrapper"
  (cd "$build" && AMPTRAIN_BIN="$wrapper" timeout 60 ./test_cuda_backend --filter 'cuda_backend/end_to_end_tests_run*') \
    > "$out/amptrain-bin.log" 2>&1
  if [ -s "$wrapper.calls" ]; then note "tests run the binary AMPTRAIN_BIN names: yes"
  else fail "the tests did not run the binary AMPTRAIN_BIN names (see amptrain-bin.log)"; fi
  rm -f "$wrapper" "$wrapper.calls"
fi
# The end-to-end GPU tests train models (in process or through the ampTrain binary): test_cuda_backend runs its op
# tests first and these after them, each part under its own TEST_TIMEOUT, so that slow trainings cannot cost the op
# tests' results; memcheck leaves them out (below)
e2e='fashion_mlp*|resume*|recompute_is*|residual_adds_in*|gpt_trains_with*|the_padded_head*|fp8_gpt_trains*|graphs_replay*'
# run_tests BINARY LABEL [FILTER]: one run, its log appended to OUTDIR/BINARY.log, its verdict noted
run_tests() {
  local t=$1 label=$2 t1 rc skips
  t1=$(date +%s)
  (cd "$build" && timeout "${TEST_TIMEOUT:-120}" "./$t" --verbose --jobs=1 ${3:+--filter="$3"}) >> "$out/$t.log" 2>&1
  rc=$?
  # a filter's left-out tests count as skipped, so skip_main.h exits 77 where every test that ran passed
  if [ -n "${3:-}" ] && [ $rc = 77 ] && grep 'Synthesis:' "$out/$t.log" | tail -1 |
       grep -qE "Tested: ([0-9]+) \| Passing: \1 \| Failing: 0 \| Crashing: 0"; then
    rc=0
  fi
  # test_cuda_dist's two-rank NCCL test needs two GPUs and mpirun: with one GPU it alone may skip
  skips=$(grep -c '\[SKIP\]' "$out/$t.log")
  if [ $rc = 77 ] && [ "$t" = test_cuda_dist ] && [ "$skips" = 1 ] && grep -q '\[SKIP\].*nccl_two_ranks' "$out/$t.log"; then
    note "$label: passed, but for its two-GPU test (skipped: $(grep -o 'fewer than two CUDA devices\|built without MPI, or no mpirun on PATH' "$out/$t.log" | head -1))"
    return
  fi
  case $rc in
    0) note "$label: passed ($(( $(date +%s) - t1 )) s)" ;;
    77) fail "$label: skipped on a GPU machine (see $t.log)" ;;
    124) fail "$label: timed out after ${TEST_TIMEOUT:-120} s (see $t.log)" ;;
    *) fail "$label: failed, rc $rc (see $t.log)" ;;
  esac
}
if [ "$dry" != 1 ] && has_phase tests; then
  rm -f "$out/test_cuda_convert.log" "$out/test_cuda_backend.log" "$out/test_cuda_dist.log"
  run_tests test_cuda_convert test_cuda_convert
  run_tests test_cuda_backend "test_cuda_backend (op tests)" "cuda_backend/!($e2e)"
  run_tests test_cuda_backend "test_cuda_backend (end-to-end tests)" "cuda_backend/@($e2e)"
  run_tests test_cuda_dist test_cuda_dist
fi

# ---- optional: the op tests under compute-sanitizer memcheck (PHASES="... sanitize"; Firecracker
# machines only: on gVisor it cannot attach, /work/.library/device/KINDS.md). Not the end-to-end tests, which train
# models in-process or through the ampTrain binary: memcheck follows child processes too, and would run those
# trainings instrumented, past the time limit ----
if has_phase sanitize && [ "$dry" != 1 ]; then
  t1=$(date +%s)
  (cd "$build" && timeout "${TEST_TIMEOUT:-120}" compute-sanitizer --tool memcheck --error-exitcode 9 \
     ./test_cuda_backend --jobs=1 --filter="cuda_backend/!($e2e)") > "$out/sanitize.log" 2>&1
  rc=$?
  # the filter's left-out tests count as skipped, so skip_main.h exits 77 where every test that ran passed
  # (the first H200 run); clean is: memcheck found nothing and the synthesis has every test it ran passing
  if [ $rc = 77 ] && grep -q "ERROR SUMMARY: 0 errors" "$out/sanitize.log" &&
     grep -qE "Synthesis: Tested: ([0-9]+) \| Passing: \1 \| Failing: 0 \| Crashing: 0" "$out/sanitize.log"; then
    rc=0
  fi
  case $rc in
    0) note "compute-sanitizer memcheck: clean, $(sed -n 's/.*Synthesis: Tested: \([0-9]*\).*/\1/p' "$out/sanitize.log") tests ($(( $(date +%s) - t1 )) s)" ;;
    9) fail "compute-sanitizer memcheck found errors (see sanitize.log)" ;;
    *) fail "compute-sanitizer run: rc $rc (see sanitize.log; on gVisor it cannot run)" ;;
  esac
fi

# ---- optional: the host's CPU against PyTorch on the CPU (PHASES="... cpu"): fashion_mlp fp32 at 1 thread (the aim:
# 1.6x PyTorch on every CPU kind) and at every CPU, against the PyTorch here (a pip one runs its products on MKL/oneDNN,
# stronger than the Debian PyTorch on OpenBLAS of docs/perf.md's CPU figures) ----
if has_phase cpu; then
  t1=$(date +%s)
  torch_v=$("$python" -c 'import torch; print(torch.__version__)' 2>/dev/null)
  PYTHON="$python" AMPTRAIN_BIN="$bin" MODELS=mlp MODES=fp32 THREADS="1 $(nproc)" ROUNDS="${CPU_ROUNDS:-3}" \
    timeout "${CPU_TIMEOUT:-150}" scripts/bench/bench_cpu.sh > "$out/cpu-bench.log" 2>&1
  rc=$?
  ratios=$(sed -n 's/^mlp fp32: .*median per-round ratio \([0-9.]*x\) .*, \([0-9]*\) thread(s))$/\1 at \2 thread(s)/p' \
           "$out/cpu-bench.log" | paste -sd ';' | sed 's/;/; /g')
  if [ $rc = 0 ] && [ -n "$ratios" ]; then
    note "cpu: fashion_mlp fp32, ampTrain / PyTorch ${torch_v:-?} on this host's CPU: $ratios ($(( $(date +%s) - t1 )) s, cpu-bench.log)"
  else
    fail "cpu: bench_cpu.sh rc $rc (see cpu-bench.log)"
  fi
fi

if ! has_phase bench; then
  note "done in $(( $(date +%s) - t0 )) s, status $status (PHASES without bench: no table)"
  exit $status
fi

# ---- the table: rewritten after every run, so a call cut short by its time limit keeps what it measured
# (the device tool returns what OUTDIR holds even after a timeout) ----
ratio() { awk -v a="$1" -v b="$2" 'BEGIN{ if (a == "" || b == "" || b == 0) print "-"; else printf "%.2f", a/b }'; }
fmt() { awk -v a="$1" -v t="$2" 'BEGIN{ if (a == "") print "-"; else if (t > 0) printf "%.0f (%.0f tok/s)", a, a*t; else printf "%.0f", a }'; }
write_table() {
  local m mode k tk # the callers loop over m and mode too
  {
  if [ "$dry" = 1 ]; then echo "DRY run of gpu-check on the CPU, $(date -u +%Y-%m-%d): checks the script; these figures measure nothing"
  else echo "GPU check of $commit on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $(date -u +%Y-%m-%d)"; fi
  echo "($steps steps per run, $wide_steps for width 768; ampTrain: the median samples/s of its 50-step log windows after the first, PyTorch: the steps after 10 warm-up steps)"
  echo
  echo "(memory: the device's memory in use, cudaMemGetInfo, context and libraries included: ampTrain's peak over the run,"
  echo "PyTorch's at the end of its run, its caching allocator's reserve included; in brackets PyTorch's tensors' peak)"
  echo
  echo "| model | mode | ampTrain samples/s | PyTorch eager AMP samples/s | ampTrain / PyTorch | ampTrain device MiB | PyTorch device MiB (tensors) |"
  echo "|---|---|---|---|---|---|---|"
  for m in $models text_gpt768; do
    for mode in $modes fp16-static fp8; do
      k="$m-$mode"
      [ -n "${amp_sps[$k]+x}" ] || continue
      tk=$(tokens_of "$m")
      echo "| $m | $mode | $(fmt "${amp_sps[$k]}" "$tk") | $(fmt "${torch_sps[$k]:-}" "$tk") | $(ratio "${amp_sps[$k]}" "${torch_sps[$k]:-}") | ${amp_mem[$k]:--} | $(if [ -n "${torch_dev[$k]:-}" ]; then echo "${torch_dev[$k]} (${torch_mem[$k]:--})"; else echo -; fi) |"
    done
  done
  echo
  echo "Targets (text_gpt width 768): bf16 / fp32 = $(ratio "${amp_sps[text_gpt768-bf16]:-}" "${amp_sps[text_gpt768-fp32]:-}") (target >= 2),"\
       "fp16-dynamic / bf16 = $(ratio "${amp_sps[text_gpt768-fp16-dynamic]:-}" "${amp_sps[text_gpt768-bf16]:-}") (target >= 0.95),"\
       "ampTrain / PyTorch bf16 = $(ratio "${amp_sps[text_gpt768-bf16]:-}" "${torch_sps[text_gpt768-bf16]:-}") (target >= 1.0),"\
       "fp8 / bf16 = $(ratio "${amp_sps[text_gpt768-fp8]:-}" "${amp_sps[text_gpt768-bf16]:-}") (no target: cuBLASLt FP8 with our transposes)"
} > "$out/table.md"; }

# ---- training and benchmarks ----
declare -A amp_sps amp_mem torch_sps torch_mem torch_dev
runs=$(mktemp -d /tmp/gpu-check-runs.XXXXXX)
models="fashion_mlp fashion_cnn text_gpt"
modes="fp32 fp16-dynamic bf16"
tokens_of() { case $1 in text_gpt*) echo 64 ;; *) echo 0 ;; esac; }

# ampTrain: "train: ...: X samples/s" on stdout; peak memory from AMPTRAIN_CUDA_MEMLOG=1 on stderr
run_amp() { # key config steps overrides...
  local key=$1 cfg=$2 n=$3; shift 3
  local log="$out/amp-$key.log"
  [ "$dry" = 1 ] && [ "$cfg" = text_gpt ] && set -- "$@" data.val_fraction=0.01 # DRY: a short final evaluation
  AMPTRAIN_CUDA_MEMLOG=1 timeout "$run_timeout" "$bin" run "configs/$cfg.yaml" "run.steps=$n" run.epochs=0 "run.device=$device" \
    run.log_every=50 run.eval_every=0 run.ckpt_every=0 "run.out_dir=$runs/$key" "$@" > "$log" 2>&1
  local rc=$?
  # keep the step log; the run's checkpoint (up to ~200 MB at width 768) stays out of OUTDIR
  cp "$runs/$key/scale_log.csv" "$out/amp-$key.scale_log.csv" 2>/dev/null; rm -rf "${runs:?}/$key"
  # steady throughput: the median of the log windows' samples/s after the first window (its 50 steps hold
  # the cuBLASLt plans' and cuDNN algorithms' first calls), like PyTorch's timing after its warm-up;
  # samples_per_s is the row's last field, the same for every row of a window
  amp_sps[$key]=$(awk -F, 'NR > 1 && $1 > 50 && ($1 % 50 == 0 || $1 == n) {print $NF}' n="$n" \
                    "$out/amp-$key.scale_log.csv" 2>/dev/null | sort -g | awk '{v[NR] = $1} END {if (NR) print v[int((NR + 1) / 2)]}')
  [ -n "${amp_sps[$key]}" ] || amp_sps[$key]=$(sed -n 's/^train: .*: \([0-9.]*\) samples\/s$/\1/p' "$log" | tail -1)
  amp_mem[$key]=$(sed -n 's/.*peak device memory in use \([0-9.]*\) MiB.*/\1/p' "$log" | tail -1)
  grep -q "device: $device" "$log" || fail "ampTrain $key did not run on $device (see amp-$key.log)"
  [ $rc -eq 0 ] && [ -n "${amp_sps[$key]}" ] || fail "ampTrain $key: rc $rc (see amp-$key.log)"
}

run_torch() { # key model mode steps extra...
  local key=$1 model=$2 mode=$3 n=$4; shift 4
  local log="$out/torch-$key.log"
  timeout "$run_timeout" "$python" scripts/gpu/bench_gpu_torch.py "$model" "$mode" "$n" --device "$torch_device" "$@" > "$log" 2>&1
  local rc=$?
  torch_sps[$key]=$(sed -n 's/.*: \([0-9.]*\) samples\/s.*/\1/p' "$log" | tail -1)
  torch_mem[$key]=$(sed -n 's/.*peak \([0-9.]*\) MiB.*/\1/p' "$log" | tail -1)
  torch_dev[$key]=$(sed -n 's/.*device in use \([0-9.]*\) MiB.*/\1/p' "$log" | tail -1)
  [ $rc -eq 0 ] && [ -n "${torch_sps[$key]}" ] || fail "torch $key: rc $rc (see torch-$key.log)"
}

# first (a few seconds, so a bench cut short by its limit still has it): which native fp8 products this
# cuBLASLt accepts (scripts/gpu/fp8_probe.cu: our call and variants of it, every algorithm the heuristic offers),
# again with PyTorch's pip cuBLAS first on the loader path where there is one, and whether PyTorch's own fp8
# product (torch._scaled_mm) gives an fp32 or a bf16 result here
if [ "$dry" != 1 ] && [ -x "$build/fp8_probe" ]; then
  timeout 60 "$build/fp8_probe" > "$out/fp8-probe.log" 2>&1
  pip_cublas=$(pip_cu13_lib)
  [ -d "$pip_cublas" ] && LD_LIBRARY_PATH="$pip_cublas:$LD_LIBRARY_PATH" timeout 60 "$build/fp8_probe" >> "$out/fp8-probe.log" 2>&1
  timeout 120 "$python" - > "$out/fp8-torch.log" 2>&1 << 'PY'
import torch
a = torch.ones(256, 512, device="cuda").to(torch.float8_e4m3fn)
b = torch.ones(384, 512, device="cuda").to(torch.float8_e4m3fn).t()
s = torch.ones((), device="cuda")
for dt in (torch.float32, torch.bfloat16):
    try:
        d = torch._scaled_mm(a, b, scale_a=s, scale_b=s, out_dtype=dt)
        print("torch._scaled_mm to", dt, "ran, D[0, 0] =", float(d[0, 0]), "(512 is right)")
    except Exception as e:
        print("torch._scaled_mm to", dt, "failed:", str(e).splitlines()[0])
PY
  note "fp8 probe: $(grep '^fp8_probe: ours' "$out/fp8-probe.log" | tr '\n' ';')" \
       "variants accepted $(grep -c ' accepted: ' "$out/fp8-probe.log") (fp8-probe.log); $(tr '\n' ';' < "$out/fp8-torch.log")"
fi
# CUDA graphs (docs/backend.md, "CUDA Graphs"): the small models are host-bound, so the steps recorded once and
# replayed (AMPTRAIN_CUDA_GRAPHS=1, the default) against every op queued one by one (=0), side by side in this call,
# each pair's logs compared (they must be the same bits); table in OUTDIR/graphs.md
{ echo "CUDA graphs on and off, $commit, $(date -u +%Y-%m-%d) ($steps steps per run, bf16; samples/s as in table.md)"
  echo
  echo "| model | graphs off samples/s | graphs on samples/s | on / off | same log | pieces recorded, replayed |"
  echo "|---|---|---|---|---|---|"; } > "$out/graphs.md"
for m in $models; do
  AMPTRAIN_CUDA_GRAPHS=0 run_amp "$m-bf16-graphs0" "$m" "$steps" precision.mode=bf16
  AMPTRAIN_CUDA_GRAPHS=1 run_amp "$m-bf16-graphs1" "$m" "$steps" precision.mode=bf16
  same=no
  cmp -s <(cut -d, -f1-12 "$out/amp-$m-bf16-graphs0.scale_log.csv") \
         <(cut -d, -f1-12 "$out/amp-$m-bf16-graphs1.scale_log.csv") && same=yes
  [ $same = yes ] || fail "graphs: $m's log with CUDA graphs differs from the one without (amp-$m-bf16-graphs*.log)"
  pieces=$(sed -n 's/^cuda graphs: \([0-9]*\) step pieces recorded, \([0-9]*\) replayed$/\1, \2/p' \
             "$out/amp-$m-bf16-graphs1.log" | tail -1)
  grep -q "CUDA graphs off" "$out/amp-$m-bf16-graphs1.log" &&
    pieces="none: $(grep -o 'CUDA graphs off for this run: [^;]*' "$out/amp-$m-bf16-graphs1.log" | head -1)"
  echo "| $m | ${amp_sps[$m-bf16-graphs0]:--} | ${amp_sps[$m-bf16-graphs1]:--} |" \
       "$(ratio "${amp_sps[$m-bf16-graphs1]:-}" "${amp_sps[$m-bf16-graphs0]:-}") | $same | ${pieces:--} |" >> "$out/graphs.md"
  note "graphs: $m bf16 on / off $(ratio "${amp_sps[$m-bf16-graphs1]:-}" "${amp_sps[$m-bf16-graphs0]:-}"), same log: $same, pieces recorded, replayed: ${pieces:--}"
done

for m in $models; do
  for mode in $modes fp16-static; do
    run_amp "$m-$mode" "$m" "$steps" "precision.mode=$mode"
    [ "$mode" = fp16-static ] || run_torch "$m-$mode" "$m" "$mode" "$steps"
    write_table
  done
done
# the targets' model: text_gpt at width 768 (12 heads, head size 64; DRY: width 128 unless WIDE_WIDTH)
wide=("model.layers.0.dim=$width" "model.layers.1.heads=$heads" "model.layers.2.heads=$heads")
for mode in $modes; do
  run_amp "text_gpt768-$mode" text_gpt "$wide_steps" "precision.mode=$mode" "${wide[@]}"
  run_torch "text_gpt768-$mode" text_gpt "$mode" "$wide_steps" --width "$width" --heads "$heads"
  write_table
done

# fp8 (docs/precision.md "fp8"): text_gpt at width 768 in precision.mode fp8 (delayed scaling, lm_head kept bf16),
# against its bf16 row; no PyTorch counterpart (Transformer Engine is not installed there)
# (cuBLASLt's errors, hints and information in its log, CUBLASLT_LOG_MASK 1+4+8 without the per-call traces: the
# first H200 runs' native fp8 products were refused with no error logged, so the backend now emulates them in bf16
# after one warning, and this says so)
CUBLASLT_LOG_MASK=13 run_amp "text_gpt768-fp8" text_gpt "$wide_steps" precision.mode=fp8 "${wide[@]}"
if grep -q "refused a native fp8 product" "$out/amp-text_gpt768-fp8.log"; then
  note "fp8: cuBLASLt refused the native fp8 products; they ran emulated in bf16 (see amp-text_gpt768-fp8.log)"
elif grep -q "has no fp8 matrix products" "$out/amp-text_gpt768-fp8.log"; then
  note "fp8: this GPU has no fp8 products (below sm_89); they ran emulated in bf16 (see amp-text_gpt768-fp8.log)"
elif [ "$dry" != 1 ]; then
  note "fp8: native fp8 products (no refusal in amp-text_gpt768-fp8.log)"
fi
write_table

# data parallel's NCCL path on one GPU (docs/distributed.md): a one-rank NCCL communicator reduces every
# step's gradients and loss (a sum over one rank), so the log must equal the plain bf16 run's
if [ "$dry" = 1 ]; then
  note "nccl one-rank run: skipped (DRY: NCCL needs a GPU)"
else
  run_amp "fashion_mlp-bf16-nccl" fashion_mlp "$steps" precision.mode=bf16 dist.backend=nccl
  if cmp -s <(cut -d, -f1-12 "$out/amp-fashion_mlp-bf16.scale_log.csv") <(cut -d, -f1-12 "$out/amp-fashion_mlp-bf16-nccl.scale_log.csv"); then
    note "nccl one-rank run: SAME log as without NCCL, ${amp_sps[fashion_mlp-bf16-nccl]:-?} samples/s against ${amp_sps[fashion_mlp-bf16]:-?}"
  else
    fail "nccl one-rank run: its log differs from the plain bf16 run's (see amp-fashion_mlp-bf16-nccl.log)"
  fi
fi

rmdir "$runs" 2>/dev/null

write_table
cat "$out/table.md"
note "done in $(( $(date +%s) - t0 )) s, status $status; table in $out/table.md"
exit $status
