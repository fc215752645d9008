#!/usr/bin/env bash
# bf16 training on the CPU with its products on AMX tiles against the same binary on AVX512-BF16 (vdpbf16ps,
# AMPTRAIN_GEMM_AMX=0), alternating in one invocation so both see the same machine: samples/s of each and the ratio.
#   scripts/bench/bench_amx.sh [MODELS="mlp cnn gpt"] [STEPS] [ROUNDS=3] [THREADS="1 2"] [MODE=bf16]
# Needs a CPU with AMX-BF16 (Sapphire Rapids or later Xeon); elsewhere both runs take vdpbf16ps and it says so.
# The alternation is scripts/bench/bench_builds.sh's, given the binary twice (each side a wrapper setting AMPTRAIN_GEMM_AMX).
set -euo pipefail
cd "$(dirname "$0")/../.."
bin=${AMPTRAIN_BIN:-build/ampTrain}
[ -x "$bin" ] || { echo "bench_amx: $bin not built; run scripts/build.sh" >&2; exit 1; }
grep -qw amx_bf16 /proc/cpuinfo || echo "bench_amx: this CPU has no AMX-BF16: both columns run vdpbf16ps" >&2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for amx in 0 1; do
  printf '#!/bin/sh\nAMP_GEMM_AMX=%s exec "%s" "$@"\n' "$amx" "$(realpath "$bin")" > "$tmp/amx$amx"
  chmod +x "$tmp/amx$amx"
done
MODES=${MODE:-bf16} LABELS="vdpbf16ps AMX" scripts/bench/bench_builds.sh "$tmp/amx0" "$tmp/amx1"
