#!/usr/bin/env bash
# Instructions per multiply-add of the K-quant kernels built for AVX2 only (-march=znver3, as on a Zen 3
# CPU; -mno-avx512f, as TERN_CPU_AVX512=0 builds), one thread, under callgrind (counts instructions, not
# time: what a loaded machine does not change): the tiles (kquant_tiled_avx2.c, q6_k_tiled_avx2.c) against
# the row-by-row kernels (kquant_kernels.c) and Q8_0's (what a conversion would run); Q8_0's and Q5_0's
# row tiles on int16 rows (q8_0, q5_0) against their int8 tiles (q8_0_tiled, q5_0_tiled, q8_0_tiled_avx2.c)
# and Q8_0's tiles on int16 rows, an output head's (q8_0_head, q8_0_head_tiles.c;
# AVX-512's, which valgrind cannot run, are counted statically by block_loops.py). From the project root:
#   bash bench/engine/kquant_callgrind/run.sh [K N]     (needs cc and valgrind; docs/engine.md, "GGUF types")
# ROWS="1 16 64" and KERNELS="q4_k q4_k_tiled ... tq2 tq2_rows" (the environment) pick what runs; the
# ternary kernel (ternary_kernels.c): KERNELS="tq2 tq2_rows" ROWS=1 bash .../run.sh 2048 8192
set -eu
HERE="$(cd "$(dirname "$0")" && pwd)"; CPU="$HERE/../../../engine/cpu"; OUT="$(mktemp -d)"
K="${1:-2048}"; N="${2:-2048}"
SOURCES="quant_rows.c quant_kernels.c q4_1_tiled_kernels.c kquant_kernels.c q8k_rows.c kquant_tiled_kernels.c
kquant_tiled_avx2.c q6_k_tiled_kernels.c q6_k_tiled_avx2.c q8_0_rows.c q8_0_tiled_kernels.c q8_0_tiled_avx2.c
q8_0_head_tiles.c ternary_kernels.c ternary_activations.c ternary_row_avx2.c"
# ISA=avx512 builds for this CPU instead (-march=native: AVX-512 VNNI on a Zen 4), to compare
FLAGS="-march=znver3 -mno-avx512f -DTERN_NO_AVX512"; [ "${ISA:-avx2}" = avx512 ] && FLAGS="-march=native"
cc -O3 $FLAGS -fopenmp -std=c11 -I"$CPU" "$HERE/probe.c" \
  $(for s in $SOURCES; do echo "$CPU/$s"; done) -o "$OUT/probe" -lm
entry() {  # the kernel's entry point (exactly: its OpenMP body, NAME._omp_fn.0, would toggle collection off)
  case "$1" in q8_0) echo tern_matmul_q8_0;; q5_0) echo tern_matmul_q5_0;; q[58]_0_tiled) echo tern_matmul_q8_0_tiled;; q8_0_head) echo tern_matmul_q8_0_head_tiled;; tq2*) echo tern_matmul_tq2;; q6_k_tiled) echo tern_matmul_q6_k_tiled;; *_tiled) echo tern_matmul_k_tiled;;
  *) echo tern_matmul_kquant;; esac
}
count() {
  OMP_NUM_THREADS=1 valgrind --tool=callgrind --callgrind-out-file=/dev/null --toggle-collect="$(entry "$1")" \
    "$OUT/probe" "$@" 2>&1 | awk '/Collected/{print $4}'
}
for rows in ${ROWS:-1 16 64}; do
  for kernel in ${KERNELS:-q4_k q4_k_tiled q5_k q5_k_tiled q6_k q6_k_tiled q8_0}; do
    n=$(count $kernel $rows "$K" "$N")
    echo "{\"kernel\": \"$kernel\", \"rows\": $rows, \"K\": $K, \"N\": $N, \"instructions\": $n, \"per_mac\": $(python3 -c "print(round($n / ($rows * $K * $N), 4))")}"
  done
done
rm -rf "$OUT"
