#!/usr/bin/env bash
# Install what is missing, build, and run the main job: the Fashion-MNIST MLP in bf16, on the GPU if
# there is one (run.device: auto), else the CPU. Installs the run set of scripts/install-deps.sh only (no
# Criterion, PyTorch or clang) and builds without the test suites (-DAMP_TESTS=OFF); scripts/test.sh installs
# and builds the rest. Extra arguments are config overrides, e.g.
#   scripts/quickstart.sh run.epochs=1
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
BUILD_DIR=build scripts/build.sh -DCMAKE_BUILD_TYPE=Release -DAMP_TESTS=OFF >/dev/null
echo "quickstart: built build/ampTrain ($(build/ampTrain --version | sed -n 2p))"

out="runs/quickstart-$(date +%Y%m%d-%H%M%S)"
build/ampTrain check configs/fashion_mlp_bf16.yaml run.device=auto "run.out_dir=$out" "$@" >/dev/null
build/ampTrain run configs/fashion_mlp_bf16.yaml run.device=auto "run.out_dir=$out" "$@"
echo "quickstart: done. Logs in $out (scale_log.csv, eval.jsonl, config.yaml)"
