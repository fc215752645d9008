#!/usr/bin/env bash
# Draw RUN_DIR/numerics.csv (run.numerics_every) or a CSV file given by path (`ampTrain numerics` writes
# RUN_DIR/numerics-from-step-N.csv): each tensor's dynamic range, from its smallest
# nonzero magnitude to its absmax over the steps measured, as a bar on a log2 axis against the representable
# ranges of fp16, bf16, E4M3 and E5M2 (smallest subnormal to largest finite); and a heat map of the fractions
# that overflow or flush to zero, tensors x formats.
#   scripts/tools/plot_numerics.sh RUN_DIR|FILE.csv [OUT_PREFIX]   writes OUT_PREFIX-range.png and OUT_PREFIX-fractions.png
#                                                  (default RUN_DIR/numerics or FILE; needs gnuplot-nox)
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: scripts/tools/plot_numerics.sh RUN_DIR|FILE.csv [OUT_PREFIX]" >&2; exit 2; }
if [ -f "$1" ]; then
  csv=$1
  out=${2:-${1%.csv}}
else
  csv=$1/numerics.csv
  out=${2:-$1/numerics}
fi
[ -f "$csv" ] || { echo "plot_numerics: $csv not found" >&2; echo "hint: run 'ampTrain numerics CONFIG' first" >&2; exit 2; }
command -v gnuplot >/dev/null || { echo "plot_numerics: gnuplot not found" >&2; echo "hint: apt-get install gnuplot-nox (or scripts/install-deps.sh --test)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Per tensor (activations and activation gradients, in model order): log2 of the smallest nonzero and of the
# absmax over all steps; and the mean fractions per format. Columns of numerics.csv: step,tensor,kind,format,
# numel,scale,absmax,rms,min_nonzero,overflow_frac,flush_frac,subnormal_frac,rel_err.
awk -F, -v T="$tmp" '
NR == 1 { next }
$3 == "weight_grad" { next }
{
  key = $2 " (" ($3 == "activation" ? "act" : "grad") ")"
  if (!(key in seen)) { seen[key] = ++n; name[n] = key }
  i = seen[key]
  if ($7 + 0 > hi[i]) hi[i] = $7 + 0
  if ($9 + 0 > 0 && (lo[i] == "" || $9 + 0 < lo[i])) lo[i] = $9 + 0
  f = $4; over[i, f] += $10; flush[i, f] += $11; cnt[i, f]++
}
END {
  for (i = 1; i <= n; i++) {
    if (hi[i] > 0 && lo[i] > 0)
      printf "%d %.3f %.3f \"%s\"\n", i, log(lo[i]) / log(2), log(hi[i]) / log(2), name[i] > T "/range"
    split("fp16 bf16 e4m3 e5m2", fm, " ")
    for (k = 1; k <= 4; k++) {
      c = cnt[i, fm[k]] ? cnt[i, fm[k]] : 1
      printf "%d %d %.6f\n", 2 * k - 2, i, over[i, fm[k]] / c > T "/heat"
      printf "%d %d %.6f\n", 2 * k - 1, i, flush[i, fm[k]] / c > T "/heat"
    }
    printf "\n" > T "/heat"
    printf "%s\"%s\" %d", (i > 1 ? ", " : ""), name[i], i > T "/ytics"
  }
  print n > T "/count"
}' "$csv"
n=$(cat "$tmp/count")
[ "$n" -gt 0 ] || { echo "plot_numerics: no activation rows in $csv" >&2; exit 1; }
ytics=$(cat "$tmp/ytics")
height=$(( 160 + 22 * n ))
title=$(basename "$(dirname "$csv")")/$(basename "$csv")
gnuplot <<GP
set terminal pngcairo size 1100,$height noenhanced font ",10"
set output "$out-range.png"
set title "$title: dynamic range of each tensor (smallest nonzero to absmax) against the formats"
set xlabel "log2 |x|   (gradients at the loss scale they were measured with)"
set xrange [-45:20]
set yrange [0.3:$n + 4.7]
set ytics ($ytics, "fp16" $n + 1, "bf16" $n + 2, "e4m3" $n + 3, "e5m2" $n + 4)
set grid xtics
set key off
# formats: smallest subnormal to largest finite
set object 1 rect from -24, $n + 0.7 to log(65504)/log(2), $n + 1.3 fc rgb "#9ecae1" fs solid 0.6 noborder
set object 2 rect from -45, $n + 1.7 to 20, $n + 2.3 fc rgb "#a1d99b" fs solid 0.6 noborder
set object 3 rect from -9, $n + 2.7 to log(448)/log(2), $n + 3.3 fc rgb "#fdae6b" fs solid 0.6 noborder
set object 4 rect from -16, $n + 3.7 to log(57344)/log(2), $n + 4.3 fc rgb "#fdd0a2" fs solid 0.6 noborder
set arrow from -24, graph 0 to -24, graph 1 nohead dt 2 lc rgb "#3182bd"
set arrow from log(65504)/log(2), graph 0 to log(65504)/log(2), graph 1 nohead dt 2 lc rgb "#3182bd"
plot "$tmp/range" using ((\$2 + \$3) / 2):1:2:3:(\$1 - 0.3):(\$1 + 0.3) with boxxyerrorbars fs solid 0.8 lc rgb "#636363"
GP
gnuplot <<GP
set terminal pngcairo size 900,$height noenhanced font ",10"
set output "$out-fractions.png"
set title "$title: fraction of elements that overflow or flush to zero"
set xrange [-0.5:7.5]
set yrange [0.5:$n + 0.5]
set xtics ("fp16 over" 0, "fp16 flush" 1, "bf16 over" 2, "bf16 flush" 3, "e4m3 over" 4, "e4m3 flush" 5, "e5m2 over" 6, "e5m2 flush" 7) rotate by -30
set ytics ($ytics)
set cbrange [0:1]
set palette defined (0 "white", 0.001 "#fee0d2", 0.1 "#fc9272", 1 "#de2d26")
set view map
plot "$tmp/heat" using 1:2:3 with image notitle
GP
echo "plot_numerics: wrote $out-range.png and $out-fractions.png"
