#!/usr/bin/env bash
# Install the Debian packages ampTrain needs to build, test and run its reference jobs.
# Idempotent: installs only what is missing. Needs root (or sudo) on a Debian/Ubuntu machine.
# The CUDA toolkit is not a Debian package here: where nvcc is on PATH (or /usr/local/cuda), the
# CUDA backend is built; otherwise the build is CPU-only and says so.
set -euo pipefail

packages=(
  build-essential cmake pkg-config
  libyaml-dev libhdf5-dev zlib1g-dev libopenblas-dev libcriterion-dev
  libopenmpi-dev openmpi-bin
  dataset-fashion-mnist fortunes
  python3 python3-numpy python3-h5py python3-torch
  gnuplot-nox
  clang libclang-rt-14-dev llvm
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
