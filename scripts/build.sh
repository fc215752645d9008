#!/usr/bin/env bash
# Configure and build ampTrain into a build directory (default: build/). Extra arguments go to cmake.
#   scripts/build.sh                      release build, CUDA backend where nvcc is found
#   BUILD_DIR=build-asan scripts/build.sh -DAMP_SANITIZE=ON -DAMP_CUDA=OFF
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${BUILD_DIR:-build}
# The subject rule of CONTRIBUTING.md as the repository's commit-msg hook, where a checkout has none yet.
if hooks=$(git rev-parse --git-path hooks 2>/dev/null) && [ ! -e "$hooks/commit-msg" ]; then
  mkdir -p "$hooks" && cp scripts/commit-msg "$hooks/commit-msg" && echo "build.sh: installed scripts/commit-msg as $hooks/commit-msg"
fi
[ -d /usr/local/cuda/bin ] && export PATH="$PATH:/usr/local/cuda/bin"
cmake -S . -B "$build_dir" "$@"
cmake --build "$build_dir" -j "$(nproc)"
