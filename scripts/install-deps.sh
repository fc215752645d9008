#!/usr/bin/env bash
# Install the Debian packages ampTrain needs. Two sets:
#   scripts/install-deps.sh          the run set: build ampTrain without its tests (-DAMP_TESTS=OFF) and run the
#                                    reference jobs (compiler, CMake, libyaml, HDF5, zlib, OpenBLAS, OpenMPI, the
#                                    Fashion-MNIST and fortunes datasets, python3 for scripts/tools/make_tokens.py).
#                                    scripts/quickstart.sh installs this set only.
#   scripts/install-deps.sh --test   the run set plus what the tests, the fuzz harnesses and the comparison and
#                                    benchmark scripts need (Criterion, PyTorch, numpy, h5py, gnuplot, clang with
#                                    libFuzzer, llvm, iproute2 for the two-host test's network namespaces and
#                                    scripts/bench/bench_dist_net.sh's tc), and from PyPI the two references Debian does not package:
#                                    Hugging Face's `tokenizers` (the BPE tests) and `tensorboard` (the event-file
#                                    test). scripts/test.sh installs this set. PyTorch alone brings
#                                    some 150 packages on a fresh machine: that is why it is not in the run set.
# Idempotent: installs only what is missing. Needs root (or sudo) on a Debian/Ubuntu machine.
# The CUDA toolkit is not a Debian package here: where nvcc is on PATH (or /usr/local/cuda), the
# CUDA backend is built; otherwise the build is CPU-only and says so. Where nvcc is there, both sets also get
# cuDNN's frontend, the header-only C++ API of the fused attention (kernels/cuda/attention_cudnn.cpp): PyPI's
# `nvidia-cudnn-frontend` wheel (pinned below) is downloaded with pip and its include/ unpacked to
# /usr/local/cudnn-frontend/include, CMake's default AMP_CUDNN_FRONTEND_DIR (nothing of it is installed into a
# Python). Without it the CUDA build builds, without the fused attention, and says so.
set -euo pipefail

usage() { echo "usage: scripts/install-deps.sh [--test]"; }
with_test=0
for arg in "$@"; do
  case "$arg" in
    --test) with_test=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "install-deps: unknown argument '$arg'" >&2; usage >&2; exit 2 ;;
  esac
done

run_packages=(
  build-essential cmake pkg-config
  libyaml-dev libhdf5-dev zlib1g-dev libopenblas-dev
  libopenmpi-dev openmpi-bin
  dataset-fashion-mnist fortunes
  python3
)
test_packages=(
  libcriterion-dev
  python3-numpy python3-h5py python3-torch python3-pip
  gnuplot-nox
  clang libclang-rt-14-dev llvm
  iproute2
)

packages=("${run_packages[@]}")
set_name="run"
if [ "$with_test" -eq 1 ]; then
  packages+=("${test_packages[@]}")
  set_name="run + test"
fi
have_nvcc=0
{ command -v nvcc > /dev/null || [ -x /usr/local/cuda/bin/nvcc ]; } && have_nvcc=1
[ "$have_nvcc" -eq 1 ] && [ "$with_test" -eq 0 ] && packages+=(python3-pip) # pip fetches cuDNN's frontend

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages of the $set_name set present"
else
  echo "install-deps: installing (${set_name} set) ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# The test set's PyPI references, for Debian's python3 (the one the tests run). pip installs them under
# /usr/local beside Debian's packages (PEP 668's marker is overridden for these two only; Debian's numpy and
# torch are already new enough for them, so pip replaces none of Debian's packages).
if [ "$with_test" -eq 1 ]; then
  pip_missing=()
  for m in tokenizers tensorboard; do
    /usr/bin/python3 -c "import $m" 2>/dev/null || pip_missing+=("$m")
  done
  if [ ${#pip_missing[@]} -eq 0 ]; then
    echo "install-deps: the PyPI references (tokenizers, tensorboard) present"
  else
    echo "install-deps: installing from PyPI ${pip_missing[*]}"
    $SUDO /usr/bin/python3 -m pip install -q --break-system-packages "${pip_missing[@]}"
  fi
fi

# cuDNN's frontend headers, where the CUDA backend is built. The version is pinned so every machine compiles the
# same API; a different one already there is replaced.
cfe_version=1.32.0
cfe_dir=/usr/local/cudnn-frontend
if [ "$have_nvcc" -eq 1 ]; then
  if [ -f "$cfe_dir/include/cudnn_frontend.h" ] && [ "$(cat "$cfe_dir/VERSION" 2>/dev/null)" = "$cfe_version" ]; then
    echo "install-deps: cuDNN frontend $cfe_version present ($cfe_dir/include)"
  else
    echo "install-deps: installing cuDNN frontend $cfe_version from PyPI into $cfe_dir/include"
    cfe_tmp=$(mktemp -d)
    trap 'rm -rf "$cfe_tmp"' EXIT
    /usr/bin/python3 -m pip download -q --no-deps --only-binary=:all: --dest "$cfe_tmp" \
      "nvidia-cudnn-frontend==$cfe_version"
    /usr/bin/python3 - "$cfe_tmp" <<'PY'
import glob, os, sys, zipfile
tmp = sys.argv[1]
wheels = glob.glob(os.path.join(tmp, "nvidia_cudnn_frontend-*.whl"))
if len(wheels) != 1:
    sys.exit("install-deps: expected one nvidia-cudnn-frontend wheel in %s, found %d" % (tmp, len(wheels)))
with zipfile.ZipFile(wheels[0]) as z:
    names = [n for n in z.namelist() if n.startswith("include/")]
    if "include/cudnn_frontend.h" not in names:
        sys.exit("install-deps: %s has no include/cudnn_frontend.h" % wheels[0])
    z.extractall(os.path.join(tmp, "unpacked"), names)
PY
    $SUDO rm -rf "$cfe_dir"
    $SUDO mkdir -p "$cfe_dir"
    $SUDO cp -r "$cfe_tmp/unpacked/include" "$cfe_dir/include"
    echo "$cfe_version" | $SUDO tee "$cfe_dir/VERSION" > /dev/null
  fi
fi
