#!/usr/bin/env bash
# Build one of the benchmark programs of scripts/bench/ (bench_optim.c, bench_gemm.c) against the engine library of
# BUILD_DIR (default build; scripts/build.sh first) into OUT. Used by the bench_*.sh scripts that time the
# backend's ops alone.
#   scripts/bench/bench_cc.sh scripts/bench/bench_gemm.c OUT
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: scripts/bench/bench_cc.sh SOURCE.c OUT" >&2; exit 2; }
src=$1 out=$2
cd "$(dirname "$0")/../.."
build=${BUILD_DIR:-build}
[ -f "$build/libamp.a" ] || { echo "$(basename "$src" .c): $build/libamp.a not built; run scripts/build.sh" >&2; exit 1; }
hdf5=$(pkg-config --libs hdf5 2> /dev/null || echo -lhdf5_serial)
# shellcheck disable=SC2086 # hdf5 holds several flags
cc -O2 -std=c11 -Ilib -Imodels "$src" "$build/libamp.a" -lopenblas $hdf5 -lyaml -lz -lm -lpthread -o "$out"
