#!/usr/bin/env bash
# The step tail's cost per parameter on the CPU: the AdamW update with fp32 master and moments against bf16 master
# and moments (to nearest, stochastic rounding), and the gradient check before it; 1 M parameters, 20 updates each,
# three alternating rounds. Builds scripts/bench/bench_optim.c against the engine library of BUILD_DIR (default build;
# scripts/build.sh first).
#   scripts/bench/bench_optim.sh
#   THREADS="1 2" scripts/bench/bench_optim.sh          each thread count side by side in every round (run.threads)
#   PARAMS=401408,512,262144,512,5120,10 ...      the tensors' sizes (these: configs/fashion_mlp.yaml's parameters)
#   SUBNORMAL=0.02 ...                            a fifth row: the fp32 update with 2% of the first moments decaying
#                                                 through fp32's subnormal range (bench_optim.c says why)
set -euo pipefail
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
scripts/bench/bench_cc.sh scripts/bench/bench_optim.c "$tmp/bench_optim"
# shellcheck disable=SC2086 # THREADS holds several counts
OPENBLAS_NUM_THREADS=1 "$tmp/bench_optim" ${THREADS:-1}
