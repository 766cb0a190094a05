#!/usr/bin/env bash
# Instructions per multiply-add of the ternary kernel (tq2_probe.c, the AVX2 build as on a Zen 3 CPU)
# and of a TL1-style lookup-table GEMV (tl1_probe.c, T-MAC's loop order), under callgrind, one thread:
# (count at 5 calls - count at 1 call) / 4 / multiply-adds. From the project root:
#   bash bench/engine/ternary_callgrind/run.sh      (needs cc and valgrind; docs/quantization.md)
set -eu
HERE="$(cd "$(dirname "$0")" && pwd)"; CPU="$HERE/../../../engine/cpu"; OUT="$(mktemp -d)"
FLAGS="-O3 -march=znver3 -fopenmp -std=c11 -I$CPU"
cc $FLAGS "$HERE/tq2_probe.c" "$CPU/ternary_kernels.c" "$CPU/ternary_activations.c" -o "$OUT/tq2" -lm
cc $FLAGS "$HERE/tl1_probe.c" "$CPU/ternary_kernels.c" "$CPU/ternary_activations.c" -o "$OUT/tl1" -lm
count() { OMP_NUM_THREADS=1 valgrind --tool=callgrind --callgrind-out-file=/dev/null "$@" 2>&1 | awk '/Collected/{print $4}'; }
per_mac() { python3 -c "print(round(($2 - $1) / 4 / $3, 4))"; }
"$OUT/tl1" 1 0 >/dev/null  # checks the lookup-table result against plain integer math
for rows in 1 16; do
  for scales in 0 1; do
    a=$(count "$OUT/tq2" $rows 1 $scales); b=$(count "$OUT/tq2" $rows 5 $scales)
    echo "{\"kernel\": \"tq2\", \"rows\": $rows, \"block_scales\": $scales, \"instructions_per_mac\": $(per_mac $a $b $((rows * 2048 * 2048)))}"
  done
done
a=$(count "$OUT/tl1" 1 0); b=$(count "$OUT/tl1" 5 0)
echo "{\"kernel\": \"tl1_lookup\", \"rows\": 1, \"instructions_per_mac\": $(per_mac $a $b $((2048 * 2048)))}"
rm -rf "$OUT"
