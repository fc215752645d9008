#!/usr/bin/env bash
# A checkpoint of a sharded optimizer state (dist.zero: 1) written two ways, side by side: gathered through rank 0
# (what ampTrain does: MPI_Gatherv of each tensor's blocks, rank 0 writes with HDF5's default driver) against a
# collective write with parallel HDF5 (MPI-IO: H5Pset_fapl_mpio, H5FD_MPIO_COLLECTIVE), each followed by the fsync
# and rename a save makes and checked value by value (scripts/bench/bench_ckpt_write.c says what is timed).
# For each size of SIZES and rank count of NPS it alternates the two ways for ROUNDS rounds and prints each round's
# seconds and their median.
#   scripts/bench/bench_ckpt_write.sh [NPS="2 4"] [SIZES="text_gpt gpt2_124m"] [ROUNDS=3] [DIR=/tmp/bench_ckpt_write]
# The sizes are a model's fp32 masters and AdamW's two moments (3 floats a parameter) in equal tensors:
#   text_gpt   470,784 parameters   -> 1,412,352 floats in 120 tensors (5.6 MB)
#   gpt2_124m  124,439,808 parameters -> 373,319,424 floats in 444 tensors (1.5 GB)
# Needs Open MPI and parallel HDF5's compiler wrapper h5pcc (Debian: apt-get install libhdf5-openmpi-dev; ampTrain
# itself builds with the serial HDF5, and this script does not change that). DIR must have room for two files of
# the largest size.
set -euo pipefail
cd "$(dirname "$0")/../.."
nps=${NPS:-2 4}; sizes=${SIZES:-text_gpt gpt2_124m}; rounds=${ROUNDS:-3}; dir=${DIR:-/tmp/bench_ckpt_write}
die() { echo "bench_ckpt_write: $*" >&2; exit 1; }
command -v mpirun > /dev/null || die "no mpirun (Open MPI)"
command -v h5pcc > /dev/null || die "no h5pcc: parallel HDF5 is not installed (Debian: apt-get install libhdf5-openmpi-dev)"
. scripts/bench/median.sh

mkdir -p build-bench "$dir"
h5pcc -O2 -Wall -Wextra -Werror -o build-bench/bench_ckpt_write scripts/bench/bench_ckpt_write.c
mpirun_=(mpirun --oversubscribe --bind-to none)
[ "$(id -u)" != 0 ] || mpirun_+=(--allow-run-as-root)

echo "size np way: seconds of each round | median"
for size in $sizes; do
  case $size in
    text_gpt) floats=1412352 tensors=120 ;;
    gpt2_124m) floats=373319424 tensors=444 ;;
    *) die "SIZES: text_gpt, gpt2_124m, not '$size'" ;;
  esac
  for np in $nps; do
    declare -A secs=([gather]="" [mpio]="")
    for r in $(seq "$rounds"); do
      for way in gather mpio; do
        line=$("${mpirun_[@]}" -np "$np" build-bench/bench_ckpt_write $way $floats $tensors "$dir/$way.h5")
        s=$(sed -n 's/.* seconds=\([0-9.]*\) .*/\1/p' <<< "$line")
        [ -n "$s" ] || die "no time in: $line"
        secs[$way]+="$s "
        rm -f "$dir/$way.h5"
      done
    done
    for way in gather mpio; do
      echo "$size np=$np $way: ${secs[$way]}| $(median <<< "${secs[$way]}")"
    done
  done
done
