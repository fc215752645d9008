# shellcheck shell=bash
# Sourced by the benchmark scripts (bench_cpu.sh, bench_builds.sh, bench_dist.sh): `median` prints the median of
# the numbers on its standard input (separated by spaces or newlines; the mean of the middle two for an even
# count), the per-round figure those scripts print beside the means.
median() { tr ' ' '\n' | sed '/^$/d' | sort -g | awk '{v[NR]=$1} END{print (NR%2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'; }
