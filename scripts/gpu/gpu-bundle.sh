#!/usr/bin/env bash
# Prepare what scripts/gpu/gpu-check.sh needs on a lent GPU machine that has CUDA, cuDNN (PyTorch's), CMake
# and PyTorch but none of our Debian packages and no datasets, and can fetch nothing (the device tool's
# H200 image, /work/.library/device): one file, .gpu-bundle/bundle.tar.gz (about 42 MB, under the 64 MiB a
# device call may carry; gzip, which every system's tar reads), holding
#   bin/   ampTrain, test_cuda_backend, test_cuda_convert, test_cuda_dist, fp8_probe, built here for sm_90 (-Werror, Release),
#          linked against the reference BLAS instead of OpenBLAS (0.4 MB against 36 MB), and the CUDA backend's
#          module libamp_cuda.so, which they load from their own directory (lib/base/device_module.h)
#   lib/   every shared library they load except glibc's, libstdc++/libgcc_s and CUDA's own
#          (cudart, cuBLAS, cuBLASLt, cuDNN come from the GPU machine)
#   data/  Fashion-MNIST and the fortunes corpus, for /usr/share/datasets and /usr/share/games there
#   COMMIT the commit built (gpu-check.sh warns when the checkout differs)
#   cudnn-frontend/include   cuDNN's frontend headers the build compiled the fused attention with (PyPI's
#          nvidia-cudnn-frontend, scripts/install-deps.sh): the GPU machine cannot fetch them, and a build there
#          (gpu-check.sh's build phase, CUDNN_FRONTEND_DIR) needs them for the fused attention. The bundle is refused
#          where the build here has no fused attention: it exists to measure the GPU path as users get it.
#   llmc/  with LLMC=DIR (a checkout or snapshot of karpathy/llm.c, e.g. the search tool's `fetch` mirror): its
#          train_gpt2cu built here for sm_90 in bf16 without MPI or NCCL, with its cuDNN flash attention (USE_CUDNN=1,
#          the same frontend headers; llmc/CUDNN says 1, or 0 where that build failed and it was built without), the
#          benchmark input of scripts/gpu/bench_gpt2.sh (gpu-check's gpt2 phase); its source is never part of this
#          repository. CUDA 13's cudaMemAdvise takes a cudaMemLocation where llm.c passes cudaCpuDeviceId: patched in
#          the copy. The frontend's headers reference NVRTC for engines neither program reaches; llm.c is linked with
#          the same stand-ins the module uses (kernels/cuda/frontend_nvrtc.cu) instead of the 110 MB libnvrtc.
# Run it here (the development machine), then on the GPU machine:
#   BUNDLE=.gpu-bundle/bundle.tar.gz PHASES="tests" scripts/gpu/gpu-check.sh OUT      (carry: .gpu-bundle)
# The test binaries have this checkout's path compiled in (AMP_SOURCE_DIR); gpu-check.sh links that path
# to the checkout there when they differ. Glibc is backward compatible, so binaries built on this Debian 12
# (glibc 2.36) run on a newer glibc there; if they do not, build there instead (docs/perf.md, GPU figures).
#   scripts/gpu/gpu-bundle.sh              env: BUILD_DIR (build-gpu-bundle), JOBS (nproc), LLMC (none)
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -d /usr/local/cuda/bin ] && export PATH="$PATH:/usr/local/cuda/bin"
build=${BUILD_DIR:-build-gpu-bundle}
jobs=${JOBS:-$(nproc)}
netlib=/usr/lib/x86_64-linux-gnu/blas/libblas.so.3 # Debian's reference BLAS (libblas3), CBLAS included
fashion=/usr/share/datasets/fashion-mnist
fortunes=/usr/share/games/fortunes
for need in "$netlib" "$fashion/train-images-idx3-ubyte.gz" "$fortunes"; do
  [ -e "$need" ] || { echo "gpu-bundle: $need is missing: run scripts/install-deps.sh --test (and apt-get install libblas3)" >&2; exit 1; }
done

configure=$(cmake -S . -B "$build" -DAMP_CUDA_ARCHITECTURES=90 -DAMP_WERROR=ON -DCMAKE_BUILD_TYPE=Release \
  -DAMP_BLAS_VENDOR=Generic 2>&1) || { echo "$configure" >&2; exit 1; }
grep -q "^AMP_CUDA:BOOL=ON" "$build/CMakeCache.txt" && command -v nvcc > /dev/null ||
  { echo "gpu-bundle: no CUDA toolkit here (nvcc): the bundle needs the CUDA backend" >&2; exit 1; }
grep -q "fused attention ON" <<< "$configure" ||
  { echo "gpu-bundle: the build found no cuDNN frontend headers (the fused attention): run scripts/install-deps.sh" >&2; exit 1; }
cfe_dir=$(sed -n 's/^AMP_CUDNN_FRONTEND_DIR:PATH=//p' "$build/CMakeCache.txt")
cmake --build "$build" -j "$jobs" --target ampTrain amp_cuda test_cuda_backend test_cuda_convert test_cuda_dist fp8_probe > /dev/null

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib" "$stage/data"
bins=("$build/ampTrain" "$build/libamp_cuda.so" "$build/test_cuda_backend" "$build/test_cuda_convert" "$build/test_cuda_dist"
      "$build/fp8_probe")
cp "${bins[@]}" "$stage/bin/"
# the libraries the binaries and the module load, resolved here with the reference BLAS first (the alternatives link
# libblas.so.3 may be OpenBLAS's, which would pull in libopenblas and libgfortran), less the ones the GPU
# machine must provide itself (NCCL too: 218 MB here; PyTorch's pip copy serves there)
LD_LIBRARY_PATH="$(dirname "$netlib")" ldd "${bins[@]}" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u |
  grep -v -E '^(libc|libm|libdl|libpthread|librt|libresolv|libstdc\+\+|libgcc_s|libcudart|libcublas|libcublasLt|libcudnn[a-z_]*|libnccl)\.so' |
  while read -r soname path; do
    case $soname in
      libblas.so.3) cp -L "$netlib" "$stage/lib/$soname" ;; # not OpenBLAS's libblas.so.3 (the alternatives link)
      *) cp -L "$path" "$stage/lib/$soname" ;;
    esac
  done
if [ -n "${LLMC:-}" ]; then
  mkdir -p "$stage/llmc-src" "$stage/llmc"
  if [ -d "$LLMC/.git" ] || git -C "$LLMC" rev-parse --git-dir > /dev/null 2>&1; then
    git -C "$LLMC" archive HEAD | tar -x -C "$stage/llmc-src"
    git -C "$LLMC" rev-parse HEAD > "$stage/llmc/COMMIT"
  else
    cp -r "$LLMC/." "$stage/llmc-src"
  fi
  sed -i 's/cudaMemAdviseSetPreferredLocation, cudaCpuDeviceId)/cudaMemAdviseSetPreferredLocation, cudaMemLocation{cudaMemLocationTypeHost, 0})/' \
    "$stage/llmc-src/llmc/cuda_utils.cuh"
  mkdir -p "$stage/llmc-src/cudnn-frontend"
  ln -s "$cfe_dir" "$stage/llmc-src/cudnn-frontend/include" # where llm.c's Makefile looks for the headers
  nvcc -c -DAMP_HAVE_CUDNN_FRONTEND -o "$stage/llmc-src/nvrtc_stand_ins.o" kernels/cuda/frontend_nvrtc.cu &&
    make -C "$stage/llmc-src" train_gpt2cu GPU_COMPUTE_CAPABILITY=90 NO_MULTI_GPU=1 NO_USE_MPI=1 USE_CUDNN=1 \
      PRECISION=BF16 NVCC_LDFLAGS="-lcublas -lcublasLt -lcudnn $stage/llmc-src/nvrtc_stand_ins.o" \
      > "$stage/llmc/build.log" 2>&1 && echo 1 > "$stage/llmc/CUDNN" ||
  { echo "gpu-bundle: note: llm.c did not build with cuDNN (see llmc/build.log); building it without" >&2
    make -C "$stage/llmc-src" clean > /dev/null 2>&1
    make -C "$stage/llmc-src" train_gpt2cu GPU_COMPUTE_CAPABILITY=90 NO_MULTI_GPU=1 NO_USE_MPI=1 USE_CUDNN=0 \
      PRECISION=BF16 NVCC_LDFLAGS="-lcublas -lcublasLt" >> "$stage/llmc/build.log" 2>&1 && echo 0 > "$stage/llmc/CUDNN"; } ||
    { echo "gpu-bundle: llm.c's train_gpt2cu did not build (see its build log):" >&2; tail -n 5 "$stage/llmc/build.log" >&2; exit 1; }
  cp "$stage/llmc-src/train_gpt2cu" "$stage/llmc/"
  rm -rf "$stage/llmc-src"
fi
mkdir -p "$stage/cudnn-frontend"
cp -r "$cfe_dir" "$stage/cudnn-frontend/include"
cp -r "$fashion" "$stage/data/fashion-mnist"
cp -r "$fortunes" "$stage/data/fortunes"
git rev-parse HEAD > "$stage/COMMIT"
git diff --quiet HEAD 2> /dev/null || echo "dirty" >> "$stage/COMMIT"
echo "$(pwd)" > "$stage/SOURCE_DIR" # AMP_SOURCE_DIR compiled into the tests

mkdir -p .gpu-bundle
tar -C "$stage" -czf .gpu-bundle/bundle.tar.gz .
echo "gpu-bundle: .gpu-bundle/bundle.tar.gz, $(du -h .gpu-bundle/bundle.tar.gz | cut -f1), commit $(head -c 12 "$stage/COMMIT"):" \
     "$(ls "$stage/lib" | wc -l) libraries ($(du -sh "$stage/lib" | cut -f1) unpacked), data $(du -sh "$stage/data" | cut -f1)"
