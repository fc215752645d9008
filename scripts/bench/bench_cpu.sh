#!/usr/bin/env bash
# CPU speed of ampTrain against PyTorch (Debian's python3-torch) on the reference models: the same model, data,
# batch and optimizer (scripts/bench/bench_torch_models.py builds each as its config does), THREADS threads each
# (ampTrain run.threads=N, torch.set_num_threads(N); OpenBLAS 1), runs alternating in one invocation so both
# see the same machine load. Prints samples/s of each and the ratio; with several THREADS, also ampTrain's
# speed-up over the first count (the rounds alternate the counts too): the ratio of the means, and the median of
# the rounds' own ratios, which a round where the machine's host took a core away (docs/perf.md, "Two cores that
# are sometimes one") moves less.
#   scripts/bench/bench_cpu.sh [MODELS="mlp cnn gpt"] [STEPS] [ROUNDS=3] [MODES="fp32 bf16"] [THREADS="1"]
#     MODELS: mlp (configs/fashion_mlp.yaml), cnn (configs/fashion_cnn.yaml), gpt (configs/text_gpt.yaml)
#     STEPS: per model by default (mlp 300, cnn 40, gpt 60); a value applies to every model
#     TORCH_OPENBLAS_CORETYPE: the OpenBLAS kernel PyTorch's fp32 products run (below); "keep" leaves the
#     environment's OPENBLAS_CORETYPE as it is
#     TORCH_OPENBLAS_THREADS=1: OPENBLAS_NUM_THREADS of the PyTorch runs ("threads": THREADS'). One by default: with
#     2 on 2 cores OpenBLAS's own pool fought torch's OpenMP threads and PyTorch's fp32 ran slower (docs/perf.md,
#     "PyTorch's OpenBLAS kernel and threads").
#     PROBE=1 (with several THREADS, on an AVX-512 CPU): before and after each round's runs, one round of
#     scripts/dev/probe_cores.c (what the machine gives a second process); the summary then gives ampTrain's median
#     speed-up also over the rounds where both probes read >= PROBE_MIN (1.9): where the machine had two cores.
#     PYTHON: the interpreter that runs the PyTorch side (/usr/bin/python3, Debian's python3-torch; e.g. python3 on
#     the lent GPU machine, whose pip PyTorch runs its fp32 products on MKL/oneDNN, not OpenBLAS)
#   e.g. MODELS=mlp THREADS="1 2" scripts/bench/bench_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
models=${MODELS:-mlp cnn gpt}; rounds=${ROUNDS:-3}; modes=${MODES:-fp32 bf16}; thread_counts=${THREADS:-1}
bin=${AMPTRAIN_BIN:-build/ampTrain}; py=${PYTHON:-/usr/bin/python3}
[ -x "$bin" ] || { echo "bench_cpu: $bin not built; run scripts/build.sh" >&2; exit 1; }
"$py" -c 'import torch, numpy' 2>/dev/null ||
  { echo "bench_cpu: $py cannot import torch and numpy; run scripts/install-deps.sh --test" >&2; exit 1; }
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
# Which kernels run: OpenBLAS picks its sgemm by CPU model, or by OPENBLAS_CORETYPE where that is set;
# ampTrain's fp32/bf16 products run gemm_avx512.c where the CPU has AVX-512, bf16 on AMX tiles where it has
# AMX-BF16 and AMPTRAIN_GEMM_AMX is not 0 (docs/backend.md).
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has() { case " $flags " in *" $1 "*) echo yes ;; *) echo no ;; esac; }
# PyTorch gets OpenBLAS's AVX-512 sgemm where the CPU has AVX-512: Debian's OpenBLAS 0.3.21 picks a generic kernel
# on CPUs newer than it ("Prescott" on a Sapphire Rapids Xeon), and a machine may set OPENBLAS_CORETYPE to an
# AVX2 one (Haswell), either of which slows PyTorch's fp32 1.5-5x and flatters ampTrain.
torch_core=${TORCH_OPENBLAS_CORETYPE:-}
if [ -z "$torch_core" ]; then
  if [ "$(has avx512_bf16)" = yes ]; then torch_core=Cooperlake
  elif [ "$(has avx512f)" = yes ]; then torch_core=SkylakeX
  else torch_core=keep; fi
fi
torch_env=(env)
[ "$torch_core" = keep ] || torch_env=(env "OPENBLAS_CORETYPE=$torch_core")
core=$("${torch_env[@]}" "$py" -c 'import ctypes; f = ctypes.CDLL("libopenblas.so.0").openblas_get_corename
f.restype = ctypes.c_char_p; print(f().decode())' 2>/dev/null || echo unknown)
echo "bench_cpu: PyTorch's OpenBLAS core $core (TORCH_OPENBLAS_CORETYPE=${TORCH_OPENBLAS_CORETYPE:-unset}, OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}); CPU avx512f $(has avx512f), avx512_bf16 $(has avx512_bf16), amx_bf16 $(has amx_bf16); AMPTRAIN_GEMM_PORTABLE=${AMPTRAIN_GEMM_PORTABLE:-unset}, AMPTRAIN_GEMM_AMX=${AMPTRAIN_GEMM_AMX:-unset}; $(getconf _NPROCESSORS_ONLN) CPUs online"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
probe=${PROBE:-0}; probe_min=${PROBE_MIN:-1.9}
if [ "$probe" = 1 ]; then
  if [ "$(has avx512f)" != yes ]; then
    echo "bench_cpu: PROBE=1 needs AVX-512 (scripts/dev/probe_cores.c); going on without it" >&2; probe=0
  elif [ "$(echo "$thread_counts" | wc -w)" -lt 2 ]; then
    echo "bench_cpu: PROBE=1 needs several THREADS; going on without it" >&2; probe=0
  else
    gcc -O2 -mavx512f scripts/dev/probe_cores.c -o "$tmp/probe_cores"
  fi
fi
# One probe round: the machine's two-process rate over its one-process rate.
probe_ratio() { "$tmp/probe_cores" 1 | sed -n 's/^round 1: .*: \([0-9.]*\)x$/\1/p'; }

config_of() { case $1 in mlp) echo configs/fashion_mlp.yaml ;; cnn) echo configs/fashion_cnn.yaml ;; gpt) echo configs/text_gpt.yaml ;; esac; }
steps_of() { case $1 in mlp) echo 300 ;; cnn) echo 40 ;; gpt) echo 60 ;; esac; }
batch_of() { case $1 in gpt) echo 32 ;; *) echo 128 ;; esac; }

# shellcheck source=scripts/bench/median.sh
. scripts/bench/median.sh
median_of() { echo "$1" | median; }

for model in $models; do
  cfg=$(config_of "$model")
  [ -n "$cfg" ] || { echo "bench_cpu: unknown model '$model' (mlp, cnn, gpt)" >&2; exit 1; }
  steps=${STEPS:-$(steps_of "$model")}
  for mode in $modes; do
    declare -A amp_total=() torch_total=() ratios=() amp_round=() torch_round=() amp_up=() torch_up=() amp_up2=()
    for r in $(seq "$rounds"); do
      [ "$probe" = 1 ] && probe_before=$(probe_ratio)
      for th in $thread_counts; do
        out="$tmp/run-$model-$mode-$r-$th"
        a=$("$bin" run "$cfg" "run.steps=$steps" run.epochs=0 "precision.mode=$mode" run.device=cpu \
              "run.threads=$th" run.log_every=100000 run.eval_every=0 run.ckpt_every=0 "run.out_dir=$out" |
            sed -n 's/^train: .*: \([0-9.]*\) samples\/s$/\1/p')
        tb=${TORCH_OPENBLAS_THREADS:-1}; [ "$tb" = threads ] && tb=$th
        t=$("${torch_env[@]}" OPENBLAS_NUM_THREADS="$tb" "$py" scripts/bench/bench_torch_models.py "$model" "$steps" "$mode" "$th" |
            sed -n 's/.*: \([0-9.]*\) samples\/s.*/\1/p')
        [ -n "$a" ] && [ -n "$t" ] || { echo "bench_cpu: a run failed (ampTrain '$a', torch '$t')" >&2; exit 1; }
        ratio=$(awk -v a="$a" -v b="$t" 'BEGIN{printf "%.3f", a/b}')
        ratios[$th]="${ratios[$th]:-} $ratio"
        amp_round[$th]=$a torch_round[$th]=$t
        echo "round $r $model $mode, $th thread(s): ampTrain $a samples/s, torch $t samples/s, ratio $ratio"
        amp_total[$th]=$(awk -v a="${amp_total[$th]:-0}" -v b="$a" 'BEGIN{print a+b}')
        torch_total[$th]=$(awk -v a="${torch_total[$th]:-0}" -v b="$t" 'BEGIN{print a+b}')
      done
      base=${thread_counts%% *} # this round's speed-ups over the first count
      two_cores=no
      if [ "$probe" = 1 ]; then
        probe_after=$(probe_ratio)
        two_cores=$(awk -v a="$probe_before" -v b="$probe_after" -v m="$probe_min" 'BEGIN{print (a >= m && b >= m) ? "yes" : "no"}')
        echo "round $r $model $mode: the machine's two processes over one ${probe_before}x before, ${probe_after}x after (two cores: $two_cores)"
      fi
      for th in $thread_counts; do
        up=$(awk -v a="${amp_round[$th]}" -v b="${amp_round[$base]}" 'BEGIN{print a/b}')
        amp_up[$th]="${amp_up[$th]:-} $up"
        [ "$two_cores" = yes ] && amp_up2[$th]="${amp_up2[$th]:-} $up"
        torch_up[$th]="${torch_up[$th]:-} $(awk -v a="${torch_round[$th]}" -v b="${torch_round[$base]}" 'BEGIN{print a/b}')"
      done
    done
    first=""
    for th in $thread_counts; do
      median=$(median_of "${ratios[$th]}")
      awk -v md="$model" -v m="$mode" -v a="${amp_total[$th]}" -v t="${torch_total[$th]}" -v r="$rounds" -v s="$steps" \
          -v med="$median" -v th="$th" -v b="$(batch_of "$model")" 'BEGIN{
        printf "%s %s: ampTrain %.1f samples/s, PyTorch %.1f samples/s (means); median per-round ratio %.2fx (%d alternating rounds, %d steps, batch %d, %d thread(s))\n", md, m, a/r, t/r, med, r, s, b, th}'
      if [ -z "$first" ]; then
        first=$th
      else
        awk -v md="$model" -v m="$mode" -v a="${amp_total[$th]}" -v b="${amp_total[$first]}" -v th="$th" -v f="$first" \
            -v ta="${torch_total[$th]}" -v tb="${torch_total[$first]}" -v am="$(median_of "${amp_up[$th]}")" \
            -v tm="$(median_of "${torch_up[$th]}")" 'BEGIN{
          printf "%s %s: ampTrain at %d threads is %.2fx ampTrain at %d; PyTorch %.2fx (means); median per-round speed-up ampTrain %.2fx, PyTorch %.2fx\n", md, m, th, a/b, f, ta/tb, am, tm}'
        if [ "$probe" = 1 ]; then
          n2=$(echo "${amp_up2[$th]:-}" | wc -w)
          if [ "$n2" -gt 0 ]; then
            echo "$model $mode: ampTrain's median speed-up at $th threads over $first in the $n2 of $rounds round(s) where the machine had two cores (probes >= ${probe_min}x): $(median_of "${amp_up2[$th]}" | awk '{printf "%.2f", $1}')x"
          else
            echo "$model $mode: no round where the machine had two cores (probes >= ${probe_min}x before and after)"
          fi
        fi
      fi
    done
    unset amp_total torch_total ratios amp_round torch_round amp_up torch_up amp_up2
  done
done
