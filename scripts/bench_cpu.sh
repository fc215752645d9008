#!/usr/bin/env bash
# CPU speed of ampTrain against PyTorch (Debian's python3-torch) on the fashion_mlp model: same shapes,
# batch 128, AdamW, THREADS threads each (ampTrain run.threads=N, torch.set_num_threads(N); OpenBLAS 1),
# runs alternating in one invocation so both see the same machine load. Prints samples/s of each and the
# ratio; with several THREADS, also ampTrain's speed-up over the first count (the rounds alternate the
# counts too).
#   scripts/bench_cpu.sh [STEPS=300] [ROUNDS=3] [MODES="fp32 bf16"] [THREADS="1"]   e.g. THREADS="1 2"
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${STEPS:-300}; rounds=${ROUNDS:-3}; modes=${MODES:-fp32 bf16}; thread_counts=${THREADS:-1}
bin=${AMP_BIN:-build/ampTrain}
[ -x "$bin" ] || { echo "bench_cpu: $bin not built; run scripts/build.sh" >&2; exit 1; }
/usr/bin/python3 -c 'import torch, numpy' 2>/dev/null ||
  { echo "bench_cpu: /usr/bin/python3 cannot import torch and numpy; run scripts/install-deps.sh --test" >&2; exit 1; }
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
# Which kernels run: OpenBLAS picks its sgemm by CPU model, or by OPENBLAS_CORETYPE where that is set;
# ampTrain's fp32/bf16 products run gemm_avx512.c where the CPU has AVX-512 (docs/backend.md).
core=$(/usr/bin/python3 -c 'import ctypes; f = ctypes.CDLL("libopenblas.so.0").openblas_get_corename
f.restype = ctypes.c_char_p; print(f().decode())' 2>/dev/null || echo unknown)
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has() { case " $flags " in *" $1 "*) echo yes ;; *) echo no ;; esac; }
echo "bench_cpu: OpenBLAS core $core (OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}); CPU avx512f $(has avx512f), avx512_bf16 $(has avx512_bf16); AMP_GEMM_PORTABLE=${AMP_GEMM_PORTABLE:-unset}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

for mode in $modes; do
  declare -A amp_total=() torch_total=() ratios=()
  for r in $(seq "$rounds"); do
    for th in $thread_counts; do
      out="$tmp/run-$mode-$r-$th"
      a=$("$bin" run configs/fashion_mlp.yaml "run.steps=$steps" run.epochs=0 "precision.mode=$mode" run.device=cpu \
            "run.threads=$th" run.log_every=100000 "run.out_dir=$out" | sed -n 's/^train: .*: \([0-9.]*\) samples\/s$/\1/p')
      t=$(/usr/bin/python3 scripts/bench_mlp_torch.py "$steps" "$mode" "$th" | sed -n 's/.*: \([0-9.]*\) samples\/s.*/\1/p')
      [ -n "$a" ] && [ -n "$t" ] || { echo "bench_cpu: a run failed (ampTrain '$a', torch '$t')" >&2; exit 1; }
      ratio=$(awk -v a="$a" -v b="$t" 'BEGIN{printf "%.3f", a/b}')
      ratios[$th]="${ratios[$th]:-} $ratio"
      echo "round $r $mode, $th thread(s): ampTrain $a samples/s, torch $t samples/s, ratio $ratio"
      amp_total[$th]=$(awk -v a="${amp_total[$th]:-0}" -v b="$a" 'BEGIN{print a+b}')
      torch_total[$th]=$(awk -v a="${torch_total[$th]:-0}" -v b="$t" 'BEGIN{print a+b}')
    done
  done
  first=""
  for th in $thread_counts; do
    median=$(echo "${ratios[$th]}" | tr ' ' '\n' | sed '/^$/d' | sort -g | awk '{v[NR]=$1} END{print (NR%2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}')
    awk -v m="$mode" -v a="${amp_total[$th]}" -v t="${torch_total[$th]}" -v r="$rounds" -v s="$steps" -v med="$median" -v th="$th" 'BEGIN{
      printf "%s: ampTrain %.1f samples/s, PyTorch %.1f samples/s (means); median per-round ratio %.2fx (%d alternating rounds, %d steps, batch 128, %d thread(s))\n", m, a/r, t/r, med, r, s, th}'
    if [ -z "$first" ]; then
      first=$th
    else
      awk -v m="$mode" -v a="${amp_total[$th]}" -v b="${amp_total[$first]}" -v th="$th" -v f="$first" 'BEGIN{
        printf "%s: ampTrain at %d threads is %.2fx ampTrain at %d (means)\n", m, th, a/b, f}'
    fi
  done
  unset amp_total torch_total ratios
done
