/* Q8_0 and Q5_0 tile by tile on int8 activations: what the AVX-512 VNNI kernel (q8_0_tiled_kernels.c)
 * and the AVX2 / AVX-VNNI one (q8_0_tiled_avx2.c) share. The row-by-row tiles of quant_kernels.c ran these
 * types on int16 rows (vpmaddwd: half the products an instruction of vpdpbusd on bytes); these run them
 * as the K-quant tiles run Q4_K, on llama.cpp's Q8_0 activation blocks:
 *
 *   per block of 32:  d = amax / 127,  q = clamp(round_half_even(x * (127 / amax)), -127, 127)  (0 where amax is 0)
 *
 * with each block's exact code sum (ggml_kernels.quantize_rows_q8_0_ref is the same in torch, bit for bit).
 *
 * The weight is rearranged at load, in place (tern_tile_q8_0: the same bytes a row, ggml_kernels.tile), a
 * tile of 16 rows (columns of the output) at a time; per tile and block of 32, C columns (16, fewer in the
 * last tile where N is not a multiple of 16), 34 C bytes (Q8_0) or 22 C (Q5_0):
 *   [0, 2C)                  the columns' float16 scales d;
 *   Q8_0: 8 regions of 4C    region k: byte 4c + e = column c's code of element 4k + e, plus 128 (unsigned);
 *   Q5_0: 4 regions of 4C    region p: byte 4c + e = column c's low 4 bits of element 8p + e (low nibble)
 *                            and of 8p + 4 + e (high nibble);
 *         then 4C            byte 4c + e: bit k = the fifth bit of column c's element 4k + e.
 * So with C = 16 a region is one 512-bit register, and one 64-byte chunk holds each column's four
 * consecutive codes in its int32 lane: vpdpbusd multiplies them (unsigned) by a row's 4 int8 activations
 * (broadcast). The unsigned codes are the signed ones plus an offset (Q8_0: w + 128 in 1..255; Q5_0: q,
 * which is the code q - 16 plus 16), which comes off exactly in integers: a block's dot starts at
 * -offset * (the row's block sum). Either way the block's integer dot product sum((code) * qx) is exact
 * (at most 32 * 128 * 127 < 2^24, so its conversion to float is exact too), and then per block
 *   acc = fma((float)dot, d_w * d_x, acc)
 * in block order: the same float operations for every element on every instruction set (AVX2 reaches
 * the same integer another way: q8_0_tiled_avx2.c), in any batch and on any thread.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "row_codes_avx2.h"

#define QK 32
#define TILE_N 16
#define BLOCK_BYTES(q5) ((q5) ? 22 : 34)

#ifdef TERN_KQ_TILED
/* One row's blocks, 8 floats a vector: q8k_rows.c's quantizer at a block of 32 (row_codes_avx2.h). */
static void q8_0_row(const float *x, int64_t K, int8_t *qs, float *d, int32_t *sums) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        const __m256 inv = block_scale_avx2(xb, QK, d + b);
        __m256i total = _mm256_setzero_si256();
        for (int e = 0; e < QK; e += 16) {
            const __m256i q = codes16_avx2(xb + e, inv, qs + b * QK + e);
            total = _mm256_add_epi32(total, _mm256_madd_epi16(q, _mm256_set1_epi16(1)));
        }
        sums[b] = sum8_epi32(total);
    }
}

/* The quantizer alone, for the reference test: qs [M, K], d and sums [M, K/32]. */
void tern_quantize_rows_q8_0(const float *x, int64_t M, int64_t K, int8_t *qs, float *d, int32_t *sums) {
    for (int64_t r = 0; r < M; r++) q8_0_row(x + r * K, K, qs + r * K, d + r * (K / QK), sums + r * (K / QK));
}

/* The last tile's C < 16 columns spread into a whole tile's layout (zeros after them: scale 0), so the
 * one micro-kernel runs it; out is nb * 16 block bytes (the head tiles' too, q8_0_head_tiles.c). */
void tern_q8_0_pad_tile(int q5, const uint8_t *tile, int64_t nb, int64_t C, uint8_t *out) {
    const int64_t bytes = BLOCK_BYTES(q5), regions = q5 ? 5 : 8;
    memset(out, 0, (size_t)(nb * TILE_N * bytes));
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *src = tile + b * C * bytes;
        uint8_t *dst = out + b * TILE_N * bytes;
        memcpy(dst, src, (size_t)(2 * C));
        for (int64_t r = 0; r < regions; r++) memcpy(dst + 32 + 64 * r, src + 2 * C + 4 * C * r, (size_t)(4 * C));
    }
}

/* out [M, N] = x [M, K] @ dequant(W)^T, W Q8_0 (q5 0) or Q5_0 (q5 1) from tern_tile_q8_0. 0, -1 (out of
 * memory) or -2 (shapes). */
int tern_matmul_q8_0_tiled(int q5, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *out) {
    if (K % QK || N <= 0) return -2;
    const int64_t nb = K / QK, whole = N / TILE_N, tail = N % TILE_N, tile_bytes = TILE_N * nb * BLOCK_BYTES(q5);
    TernQ8Rows q = {(int8_t *)malloc((size_t)(M * K)), (float *)malloc((size_t)(M * nb) * sizeof(float)),
                    (int32_t *)malloc((size_t)(M * nb) * sizeof(int32_t))};
    uint8_t *padded = tail ? (uint8_t *)malloc((size_t)tile_bytes) : NULL;
    int status = -1;
    if (q.qs && q.d && q.sums && (!tail || padded)) {
        if (tail) tern_q8_0_pad_tile(q5, w + whole * tile_bytes, nb, tail, padded);
#pragma omp parallel for schedule(static) if (M >= 4)
        for (int64_t r = 0; r < M; r++) q8_0_row(x + r * K, K, q.qs + r * K, q.d + r * nb, q.sums + r * nb);
#pragma omp parallel for schedule(guided)
        for (int64_t t = 0; t < whole + (tail > 0); t++)
            tern_q8_0_tile_rows(q5, t < whole ? w + t * tile_bytes : padded, nb, &q, M, t * TILE_N,
                                t < whole ? TILE_N : tail, N, out);
        status = 0;
    }
    free(q.qs), free(q.d), free(q.sums), free(padded);
    return status;
}
#else
void tern_quantize_rows_q8_0(const float *x, int64_t M, int64_t K, int8_t *qs, float *d, int32_t *sums) {
    (void)x, (void)M, (void)K, (void)qs, (void)d, (void)sums; /* the tiles' quantizer: AVX2 builds and up only */
}

int tern_matmul_q8_0_tiled(int q5, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *out) {
    (void)q5, (void)x, (void)M, (void)K, (void)w, (void)N, (void)out;
    return -2; /* built with AVX2 and up only (ggml_kernels.tiled_isa()) */
}
#endif

/* Element j (0..31) of a GGUF Q5_0 block's 5-bit codes q (the value is (q - 16) * d). */
static inline int q5_0_code(const uint8_t *block, int j) {
    const uint32_t high = (uint32_t)block[2] | (uint32_t)block[3] << 8 | (uint32_t)block[4] << 16 | (uint32_t)block[5] << 24;
    const int low = j < 16 ? block[6 + j] & 0x0F : block[6 + j - 16] >> 4;
    return low | (int)((high >> j) & 1) << 4;
}

/* GGUF's Q8_0 (q5 0) or Q5_0 (q5 1) rows of blocks [N, K/32 * 34 or 22] -> the tile layout above, in
 * place, a tile at a time (each through a copy of its own rows). 0 or -1 (out of memory). */
int tern_tile_q8_0(int q5, uint8_t *w, int64_t N, int64_t nb) {
    const int64_t bytes = BLOCK_BYTES(q5), row = nb * bytes;
    int failed = 0;
#pragma omp parallel for schedule(static) reduction(| : failed)
    for (int64_t t = 0; t < (N + TILE_N - 1) / TILE_N; t++) {
        const int64_t C = N - t * TILE_N < TILE_N ? N - t * TILE_N : TILE_N;
        uint8_t *rows = (uint8_t *)malloc((size_t)(C * row));
        if (!rows) {
            failed = 1;
            continue;
        }
        memcpy(rows, w + t * TILE_N * row, (size_t)(C * row));
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *dst = w + t * TILE_N * row + b * C * bytes, *codes = dst + 2 * C;
            for (int64_t c = 0; c < C; c++) {
                const uint8_t *block = rows + c * row + b * bytes;
                memcpy(dst + 2 * c, block, 2);
                for (int j = 0; j < QK && !q5; j++) codes[4 * C * (j / 4) + 4 * c + j % 4] = block[2 + j] ^ 0x80;
                for (int j = 0; j < QK && q5; j++) {
                    const int k = j / 4, e = j % 4, code = q5_0_code(block, j);
                    uint8_t *nibble = codes + 4 * C * (k / 2) + 4 * c + e, *fifth = codes + 16 * C + 4 * c + e;
                    *nibble = (uint8_t)(k & 1 ? (*nibble & 0x0F) | (code & 0x0F) << 4 : code & 0x0F);
                    *fifth = (uint8_t)(k == 0 ? 0 : *fifth) | (uint8_t)((code >> 4) << k);
                }
            }
        }
        free(rows);
    }
    return failed ? -1 : 0;
}

/* Rows ids[count] of a weight from tern_tile_q8_0, dequantized: out [count, K] float32 (a tied head's
 * embedding lookups; w * d as gguf dequantizes, exact in float32). */
void tern_dequantize_q8_0_tiled(int q5, const uint8_t *w, int64_t N, int64_t nb, const int64_t *ids, int64_t count,
                                float *out) {
    const int64_t bytes = BLOCK_BYTES(q5);
    for (int64_t i = 0; i < count; i++) {
        const int64_t t = ids[i] / TILE_N, c = ids[i] % TILE_N, C = N - t * TILE_N < TILE_N ? N - t * TILE_N : TILE_N;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *block = w + t * TILE_N * nb * bytes + b * C * bytes, *codes = block + 2 * C;
            uint16_t half;
            memcpy(&half, block + 2 * c, sizeof half);
            const float d = half_to_float(half);
            for (int j = 0; j < QK; j++) {
                const int k = j / 4, e = j % 4;
                int code;
                if (q5) {
                    const uint8_t nibbles = codes[4 * C * (k / 2) + 4 * c + e];
                    code = ((k & 1 ? nibbles >> 4 : nibbles & 0x0F) | ((codes[16 * C + 4 * c + e] >> k) & 1) << 4) - 16;
                } else {
                    code = (int8_t)(codes[4 * C * k + 4 * c + e] ^ 0x80);
                }
                out[i * nb * QK + b * QK + j] = (float)code * d;
            }
        }
    }
}
