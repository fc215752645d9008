#!/usr/bin/env bash
# Configure and build ampTrain into a build directory (default: build/). Extra arguments go to cmake.
#   scripts/build.sh                      release build, CUDA backend where nvcc is found
#   BUILD_DIR=build-asan scripts/build.sh -DAMP_SANITIZE=ON -DAMP_CUDA=OFF
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${BUILD_DIR:-build}
[ -d /usr/local/cuda/bin ] && export PATH="$PATH:/usr/local/cuda/bin"
cmake -S . -B "$build_dir" "$@"
cmake --build "$build_dir" -j "$(nproc)"
