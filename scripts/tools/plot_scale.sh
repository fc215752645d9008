#!/usr/bin/env bash
# Plot a run's loss and log2(loss scale) against step, skipped steps marked, from RUN_DIR/scale_log.csv.
#   scripts/tools/plot_scale.sh RUN_DIR [OUT.png]        (default OUT: RUN_DIR/scale.png; needs gnuplot-nox)
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: scripts/tools/plot_scale.sh RUN_DIR [OUT.png]" >&2; exit 2; }
dir=$1
out=${2:-$dir/scale.png}
csv=$dir/scale_log.csv
[ -f "$csv" ] || { echo "plot_scale: $csv not found" >&2; echo "hint: pass the run.out_dir of a run" >&2; exit 2; }
command -v gnuplot >/dev/null || { echo "plot_scale: gnuplot not found" >&2; echo "hint: apt-get install gnuplot-nox (or scripts/install-deps.sh --test)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# step, loss, log2(scale), skipped — overflow_layer may hold quoted commas, so keep the first 6 fields only
awk -F, 'NR > 1 { printf "%s %s %.6f %s\n", $1, $3, log($4)/log(2), $6 }' "$csv" > "$tmp/d"
awk '$4 == 1' "$tmp/d" > "$tmp/skips"
[ -s "$tmp/skips" ] || echo "nan nan nan 1" > "$tmp/skips"
title=$(basename "$dir")
gnuplot <<GP
set terminal pngcairo size 1000,560 noenhanced font ",11"
set output "$out"
set title "$title: loss and loss scale"
set xlabel "optimizer step"
set ylabel "loss"
set y2label "log2(scale)"
set ytics nomirror
set y2tics
set key top right
set grid
plot "$tmp/d" using 1:2 with lines lw 1.5 lc rgb "#1f77b4" title "loss", \
     "$tmp/d" using 1:3 axes x1y2 with steps lw 2 lc rgb "#ff7f0e" title "log2(scale)", \
     "$tmp/skips" using 1:3 axes x1y2 with points pt 7 ps 0.8 lc rgb "#d62728" title "skipped step"
GP
echo "plot_scale: wrote $out"
