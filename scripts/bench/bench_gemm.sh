#!/usr/bin/env bash
# The CPU backend's matrix products alone, on the shapes of fashion_mlp's or text_gpt's step (MODEL=cnn: fashion_cnn's
# convolution calls and fc1's products), at several thread
# counts (microseconds a call, the best of 5 rounds): how each product scales. Builds scripts/bench/bench_gemm.c against
# the engine library of BUILD_DIR (default build; scripts/build.sh first).
#   scripts/bench/bench_gemm.sh                                 fashion_mlp's products, bf16, 1 and 2 threads
#   MODEL=gpt DTYPE=fp32 THREADS="1 2 4" scripts/bench/bench_gemm.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
scripts/bench/bench_cc.sh scripts/bench/bench_gemm.c "$tmp/bench_gemm"
# shellcheck disable=SC2086 # THREADS holds several counts
OPENBLAS_NUM_THREADS=1 "$tmp/bench_gemm" "${MODEL:-mlp}" "${DTYPE:-bf16}" ${THREADS:-1 2}
