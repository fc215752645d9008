#!/usr/bin/env bash
# Data-parallel CPU speed of ampTrain against PyTorch DistributedDataParallel (gloo, Debian's python3-torch,
# scripts/bench/bench_ddp_torch.py: the same model, optimizer, data and normalisation as the config). Each round runs,
# one after the other so all four see the same machine load: ampTrain at np 1, ampTrain at np 2 (mpirun),
# PyTorch DDP at np 1 and at np 2. Every process is single-threaded (OPENBLAS_NUM_THREADS=1, run.threads=1,
# torch.set_num_threads(1); until 2026-12-03 ampTrain's np 1 run took run.threads auto, two threads on 2 cores) and trains on a micro-batch of the config's data.batch_size, so the effective
# batch is batch x np. Prints samples/s of each (means over the rounds, samples of all ranks) and the median
# per-round ratios ampTrain np2/np1, PyTorch np2/np1 and ampTrain np2 / PyTorch np2.
# Targets: text_gpt: ampTrain np2 >= 1.8x ampTrain np1; fashion_mlp fp32: ampTrain np2 >= 1.5x PyTorch DDP np2.
# np 2 puts one process on each of 2 cores: on a machine with fewer, or with other work on it, the scaling
# ratios mean little.
#   scripts/bench/bench_dist.sh [STEPS=...] [ROUNDS=3] [MODELS="fashion_mlp text_gpt"] [MODE=fp32]
# STEPS defaults to 600 for fashion_mlp and 60 for text_gpt (fewer make the ratios noise: a 20-step text_gpt
# run lasts 2 s); a round of text_gpt then takes about 35 s on 2 idle cores. ampTrain's np 2 runs with Open
# MPI's default binding (a rank per core), as a user's would. AMPTRAIN_BIN (default build/ampTrain) picks the binary.
# MODE: fp32 | bf16.
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${ROUNDS:-3}; models=${MODELS:-fashion_mlp text_gpt}; mode=${MODE:-fp32}
bin=${AMPTRAIN_BIN:-build/ampTrain}
py=/usr/bin/python3
[ -x "$bin" ] || { echo "bench_dist: $bin not built; run scripts/build.sh" >&2; exit 1; }
command -v mpirun >/dev/null || { echo "bench_dist: no mpirun; run scripts/install-deps.sh (openmpi-bin)" >&2; exit 1; }
torch_version=$("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null) ||
  { echo "bench_dist: $py cannot import torch; run scripts/install-deps.sh --test (python3-torch)" >&2; exit 1; }
case $mode in fp32 | bf16) ;; *) echo "bench_dist: MODE must be fp32 or bf16, not '$mode'" >&2; exit 2 ;; esac
for model in $models; do
  case $model in fashion_mlp | text_gpt) ;; *) echo "bench_dist: MODELS: fashion_mlp, text_gpt, not '$model'" >&2; exit 2 ;; esac
done
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 # mpirun refuses to run as root without them
echo "bench_dist: $(getconf _NPROCESSORS_ONLN) cores, $(mpirun --version 2>/dev/null | head -n 1), torch $torch_version, $bin, mode $mode"
# PyTorch's fp32 products call OpenBLAS's sgemm, whose kernel OpenBLAS picks by CPU model (or by
# OPENBLAS_CORETYPE); ampTrain's run gemm_avx512.c where the CPU has AVX-512 (docs/backend.md). A CPU that
# Debian's OpenBLAS does not know gets its Prescott (SSE3) kernel, which makes PyTorch fp32 a weak baseline.
core=$("$py" -c 'import ctypes; f = ctypes.CDLL("libopenblas.so.0").openblas_get_corename
f.restype = ctypes.c_char_p; print(f().decode())' 2>/dev/null || echo unknown)
echo "bench_dist: OpenBLAS core $core (OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE-unset})"
# So that PyTorch is measured at its best, on such a CPU its runs get OpenBLAS's AVX-512 kernel; ampTrain's
# runs keep what OpenBLAS picks (ampTrain uses OpenBLAS only off its own GEMM's path, and measured slower on
# text_gpt with the forced kernel). Set OPENBLAS_CORETYPE yourself to choose for both.
torch_env=()
if [ "$core" = Prescott ] && grep -qw avx512f /proc/cpuinfo && [ -z "${OPENBLAS_CORETYPE+x}" ]; then
  forced=SkylakeX
  grep -qw avx512_bf16 /proc/cpuinfo && forced=Cooperlake
  torch_env=(env "OPENBLAS_CORETYPE=$forced")
  core=$("${torch_env[@]}" "$py" -c 'import ctypes; f = ctypes.CDLL("libopenblas.so.0").openblas_get_corename
f.restype = ctypes.c_char_p; print(f().decode())' 2>/dev/null || echo unknown)
  echo "bench_dist: OpenBLAS does not know this AVX-512 CPU (its SSE3 kernel would slow PyTorch fp32):" \
       "PyTorch runs with OPENBLAS_CORETYPE=$forced (core $core)"
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# rate NAME CMD...: runs CMD with its output in $tmp/NAME.log and prints the samples/s of its summary line
# (ampTrain's 'train: ... samples/s', bench_ddp_torch.py's 'torch-ddp ... samples/s'); a failed run or one
# without that line stops the benchmark with the end of its log.
rate() {
  local name=$1 log="$tmp/$1.log" x
  shift
  if ! "$@" >"$log" 2>&1; then
    { echo "bench_dist: $name failed: $*"; tail -n 20 "$log"; } >&2
    return 1
  fi
  x=$(sed -n 's/^\(train:\|torch-ddp\) .*: \([0-9.]*\) samples\/s$/\2/p' "$log" | tail -n 1)
  if [ -z "$x" ]; then
    { echo "bench_dist: $name printed no samples/s line: $*"; tail -n 20 "$log"; } >&2
    return 1
  fi
  echo "$x"
}
# shellcheck source=scripts/bench/median.sh
. scripts/bench/median.sh
div() { awk -v a="$1" -v b="$2" 'BEGIN{printf "%.3f", a/b}'; }

for model in $models; do
  case $model in fashion_mlp) steps=${STEPS:-600} ;; text_gpt) steps=${STEPS:-60} ;; esac
  batch=$(sed -n 's/^  batch_size: *\([0-9]*\).*/\1/p' "configs/$model.yaml")
  # run.threads=1: the CPU backend's pool would otherwise take both cores in the one-rank run (run.threads auto)
  amp_args=(run "configs/$model.yaml" "run.steps=$steps" run.epochs=0 "precision.mode=$mode" run.device=cpu
            run.threads=1 run.log_every=100000)
  sums="0 0 0 0"; r_amp=""; r_torch=""; r_vs=""
  for r in $(seq "$rounds"); do
    a1=$(rate "amp-np1-$model-$r" "$bin" "${amp_args[@]}" "run.out_dir=$tmp/amp-np1-$model-$r")
    a2=$(rate "amp-np2-$model-$r" mpirun -np 2 -x OPENBLAS_NUM_THREADS=1 -x OMP_NUM_THREADS=1 \
           "$bin" "${amp_args[@]}" "run.out_dir=$tmp/amp-np2-$model-$r")
    t1=$(rate "torch-np1-$model-$r" "${torch_env[@]}" "$py" scripts/bench/bench_ddp_torch.py "$model" 1 "$steps" "$mode")
    t2=$(rate "torch-np2-$model-$r" "${torch_env[@]}" "$py" scripts/bench/bench_ddp_torch.py "$model" 2 "$steps" "$mode")
    ra=$(div "$a2" "$a1"); rt=$(div "$t2" "$t1"); rv=$(div "$a2" "$t2")
    r_amp="$r_amp $ra"; r_torch="$r_torch $rt"; r_vs="$r_vs $rv"
    sums=$(echo "$sums" | awk -v a="$a1" -v b="$a2" -v c="$t1" -v d="$t2" '{print $1+a, $2+b, $3+c, $4+d}')
    echo "round $r $model $mode: ampTrain np1 $a1, np2 $a2 samples/s; PyTorch DDP np1 $t1, np2 $t2 samples/s;" \
         "ampTrain np2/np1 $ra, PyTorch np2/np1 $rt, ampTrain np2 / PyTorch np2 $rv"
  done
  m_amp=$(echo "$r_amp" | median); m_torch=$(echo "$r_torch" | median); m_vs=$(echo "$r_vs" | median)
  echo "$sums" | awk -v m="$model" -v mode="$mode" -v r="$rounds" -v s="$steps" -v b="$batch" -v ma="$m_amp" \
    -v mt="$m_torch" -v mv="$m_vs" '{
    printf "%s %s: ampTrain np1 %.1f, np2 %.1f samples/s; PyTorch DDP np1 %.1f, np2 %.1f samples/s (means); ", m, mode, $1/r, $2/r, $3/r, $4/r
    printf "median per-round ratios: ampTrain np2/np1 %.2fx, PyTorch np2/np1 %.2fx, ampTrain np2 / PyTorch np2 %.2fx ", ma, mt, mv
    printf "(%d alternating rounds, %d steps, batch %d per rank, 1 thread per process)\n", r, s, b}'
  if [ "$model" = text_gpt ]; then
    awk -v x="$m_amp" 'BEGIN{printf "  target text_gpt: ampTrain np2/np1 >= 1.8x: %.2fx, %s\n", x, (x >= 1.8) ? "met" : "NOT met"}'
  elif [ "$model" = fashion_mlp ] && [ "$mode" = fp32 ]; then
    awk -v x="$m_vs" 'BEGIN{printf "  target fashion_mlp fp32: ampTrain np2 / PyTorch DDP np2 >= 1.5x: %.2fx, %s\n", x, (x >= 1.5) ? "met" : "NOT met"}'
  fi
done
