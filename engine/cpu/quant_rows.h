/* What quant_kernels.c shares with quant_rows.c and q4_1_tiled_kernels.c: the block and tile sizes, a batch of rows
 * quantized to int16 (QuantizedRows) and a quantized weight as the kernels read it (Weights). */
#ifndef TERN_QUANT_ROWS_H
#define TERN_QUANT_ROWS_H

#include <stdint.h>

#define QK 32       /* elements per block */
#define TILE_N 16   /* output columns (weight rows) per tile */

/* How far ahead of the block being read the weight stream is prefetched. A decode step streams
 * every weight from memory once; without it the 2 cores read them at 7 GB/s, with it at about 12
 * (tern bench cpu-linears; the hardware prefetcher loses the stream at each tile's start). */
#define PREFETCH_BYTES 1024

/* Rows of x quantized to int16, one scale a row: qs [M, K], d [M], s [M, K / QK] (d * each block's sum). */
typedef struct {
    int16_t *qs;
    float *d;
    float *s;
} QuantizedRows;

/* A quantized weight as the kernels read it. */
typedef struct {
    const uint8_t *qs; /* q4_1: [N, nb, 16] bytes (TERN_Q4_TILED: see tiled_q4_1); q8_0: [N, nb, 32] int8;
                          q5_0: [N, nb, 20] bytes, a block's fifth bits then nibbles as GGUF stores them */
    const uint16_t *d; /* [N, nb] float16 (TERN_Q4_TILED, q4_1: like m) */
    const uint16_t *m; /* q4_1 only: [N / TILE_N rounded up, nb, TILE_N] float16 (see kernels.tile_blocks) */
    int64_t nb;
    int64_t row0; /* the weight row qs starts at (a tile's codes unpacked apart: unpack_q5_0), else 0 */
} Weights;

/* x [M, K] -> q (allocated here; 0, or -1 when out of memory: free it either way), in parallel from 4 rows
 * (quant_rows.c). */
__attribute__((visibility("hidden"))) int tern_rows_quantize(const float *x, int64_t M, int64_t K, QuantizedRows *q);
__attribute__((visibility("hidden"))) void tern_rows_free(QuantizedRows *q);

/* q4_1 tile by tile with AVX-512 VNNI (q4_1_tiled_kernels.c), where kernels.h defines TERN_Q4_TILED. */
__attribute__((visibility("hidden"))) void tern_matmul_tiled_q4_1(const Weights *w, const QuantizedRows *x,
                                                                  int64_t M, int64_t N, float *out);

#endif
