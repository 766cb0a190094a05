/* Q8_0 output heads tile by tile on int16 activations: the int8 tiles' weight layout (q8_0_rows.c,
 * tern_tile_q8_0: one in-place tiling at load, and a tied head's embedding rows read from the same
 * tiles), against the row-by-row tiles' int16 rows (quant_rows.c, tern_rows_quantize: one scale a row,
 * 15 bits against the row's largest value). A head's near-ties are its token choices: on llama.cpp's
 * int8 blocks the default model's tied head flipped a greedy answer (ggml_linear.HEADS_ON_INT16_ROWS);
 * these are the same activation codes as the row path's, so its precision, at the tiles' speed.
 *
 * A tile block's region k holds, in each column's 32-bit lane, its four codes of elements 4k .. 4k + 3,
 * stored as w + 128 (unsigned, 1..255 for Q8_0's -127..127; -128 too). Read as int16 words, that lane is
 * split into two int16 pairs with no sign extension: and 0x00FF gives (u0, u2), a shift right by 8
 * gives (u1, u3). The rows' codes are stored reordered to match (x0 x2 x1 x3 in each group of 4), so
 * each pair's activations are one 32-bit broadcast, and one vpdpwssd (AVX-512 VNNI; vpmaddwd + vpaddd
 * on AVX2) multiplies 16 columns' pairs, 32 products. The offset comes off exactly in integers: a
 * block's dot starts at -128 * (the row's block sum of codes). Every partial sum stays in int32
 * (|start| <= 128 * 32 * 32767 < 2^27, the unsigned products add at most 32 * 255 * 32767 < 2^28), and
 * the block's dot, sum(w * qx) <= 32 * 128 * 32767 = 134,213,632 < 2^31, is exact. Then per block
 *   acc = fma((float)dot, d_w, acc)      and at the end   out = acc * d_x
 * (d_x the row's scale: one multiply a row, not one a block). The conversion rounds at 2^-24 where the
 * dot passes 2^24, as the row path's float sums of exact pair products do: its precision, not less.
 * The same integers and the same float operations in the same order on AVX-512 and AVX2, so the same
 * bits, in any batch and on any thread (each element one accumulator over the blocks in order).
 *
 * Instructions a multiply-add at 1 / 16 / 64 rows, K 1,152, N 2,048 (at 4a03d70; docs/engine.md, "Q8_0
 * heads tile by tile on int16 rows"), against the row tiles on the same int16 rows (quant_kernels.c):
 *   AVX2 (callgrind, KERNELS="q8_0 q8_0_head" bash bench/engine/kquant_callgrind/run.sh 1152 2048):
 *     0.348 / 0.242 / 0.241, the row tiles 0.488 / 0.293 / 0.291 (the int8 tiles 0.284 / 0.230 / 0.230);
 *   AVX-512 VNNI (the block loops' machine code, bench/engine/kquant_callgrind/block_loops.py):
 *     0.135 / 0.083 / 0.083, the row tiles 0.344 / 0.141 / 0.141 (the int8 tiles 0.096 / 0.064 / 0.064).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "quant_rows.h"

#ifdef TERN_KQ_TILED
#define BLOCK_BYTES 34

/* The rows as the head tiles read them: quant_rows.c's int16 codes [M, K] reordered x0 x2 x1 x3 in
 * each group of 4, its scale a row d [M], and each block's offset term, -128 * its code sum [M, K / 32]
 * (a block's dot starts at it: one broadcast from memory). */
typedef struct {
    const int16_t *qs;
    const float *d;
    const int32_t *offsets;
} HeadRows;

static inline int32_t pair(const int16_t *codes) {
    int32_t two;
    memcpy(&two, codes, sizeof two);
    return two;
}

#ifdef TERN_Q4_TILED
/* RR rows from r0 against one tile (16 columns from n0, those in `columns` stored). Up to 4 rows the
 * odd pairs go to a second chain (integer sums: the same result), so a decode step's one row is not
 * held up by the latency of one chain of 16. */
static inline __attribute__((always_inline)) void tile(const uint8_t *w, int64_t nb, const HeadRows *q, int64_t r0,
                                                       int64_t K, int64_t n0, __mmask16 columns, int64_t N,
                                                       float *out, const int RR) {
    __m512 acc[8];
    for (int i = 0; i < RR; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *block = w + b * TILE_N * BLOCK_BYTES;
        for (int line = 0; line < TILE_N * BLOCK_BYTES; line += 64)
            _mm_prefetch((const char *)block + 2 * TILE_N * BLOCK_BYTES + line, _MM_HINT_T0);
        __m512i dots[8], odds[4];
        for (int i = 0; i < RR; i++) dots[i] = _mm512_set1_epi32(q->offsets[(r0 + i) * nb + b]);
        for (int i = 0; i < RR && RR <= 4; i++) odds[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            const __m512i v = _mm512_loadu_si512((const void *)(block + 32 + 64 * k));
            const __m512i even = _mm512_and_si512(v, _mm512_set1_epi16(0x00FF)), odd = _mm512_srli_epi16(v, 8);
            for (int i = 0; i < RR; i++) {
                const int16_t *xs = q->qs + (r0 + i) * K + b * QK + 4 * k;
                dots[i] = _mm512_dpwssd_epi32(dots[i], even, _mm512_set1_epi32(pair(xs)));
                if (RR <= 4)
                    odds[i & 3] = _mm512_dpwssd_epi32(odds[i & 3], odd, _mm512_set1_epi32(pair(xs + 2)));
                else
                    dots[i] = _mm512_dpwssd_epi32(dots[i], odd, _mm512_set1_epi32(pair(xs + 2)));
            }
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)block));
        for (int i = 0; i < RR; i++) {
            const __m512i dot = RR <= 4 ? _mm512_add_epi32(dots[i], odds[i & 3]) : dots[i];
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), dw, acc[i]);
        }
    }
    for (int i = 0; i < RR; i++)
        _mm512_mask_storeu_ps(out + (r0 + i) * N + n0, columns, _mm512_mul_ps(acc[i], _mm512_set1_ps(q->d[r0 + i])));
}

static void tile_rows(const uint8_t *w, int64_t nb, const HeadRows *q, int64_t M, int64_t n0, int64_t C, int64_t N,
                      float *out) {
    const int64_t K = nb * QK;
    const __mmask16 columns = (__mmask16)((1u << C) - 1);
    int64_t r0 = 0;
    for (; r0 + 8 <= M; r0 += 8) tile(w, nb, q, r0, K, n0, columns, N, out, 8);
    switch (M - r0) {
    case 7: tile(w, nb, q, r0, K, n0, columns, N, out, 7); break;
    case 6: tile(w, nb, q, r0, K, n0, columns, N, out, 6); break;
    case 5: tile(w, nb, q, r0, K, n0, columns, N, out, 5); break;
    case 4: tile(w, nb, q, r0, K, n0, columns, N, out, 4); break;
    case 3: tile(w, nb, q, r0, K, n0, columns, N, out, 3); break;
    case 2: tile(w, nb, q, r0, K, n0, columns, N, out, 2); break;
    case 1: tile(w, nb, q, r0, K, n0, columns, N, out, 1); break;
    default: break;
    }
}
#else
/* 256 bits: a tile as two halves of 8 columns (each region's bytes 0..31, then 32..63), each against up
 * to 4 rows; vpdpwssd where the CPU has 256-bit VNNI, else vpmaddwd + vpaddd (each pair's products are
 * at most 2 * 255 * 32767 < 2^31: no saturation), the same integers either way. */
#if defined(__AVXVNNI__)
#define DPWSSD256(acc, a, b) _mm256_dpwssd_avx_epi32(acc, a, b)
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPWSSD256(acc, a, b) _mm256_dpwssd_epi32(acc, a, b)
#else
#define DPWSSD256(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#endif

/* RR rows from r0 against halves H0 .. H0 + NH of one tile (columns n0 + 8 H .., the first C - 8 H stored);
 * one row takes both halves in one pass over the tile's blocks (NH 2), so the tile is read once (as
 * q8_0_tiled_avx2.c's one row), the same integers and float operations a half. */
static inline __attribute__((always_inline)) void tile(const uint8_t *w, int64_t nb, const HeadRows *q, int64_t r0,
                                                       int64_t K, int64_t n0, int64_t C, int64_t N, float *out,
                                                       const int RR, const int H0, const int NH) {
    __m256 acc[2][4];
    for (int h = 0; h < NH; h++)
        for (int i = 0; i < RR; i++) acc[h][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *block = w + b * TILE_N * BLOCK_BYTES;
        for (int line = 0; line < TILE_N * BLOCK_BYTES && H0 == 0; line += 64) /* the first half streams it */
            _mm_prefetch((const char *)block + 2 * TILE_N * BLOCK_BYTES + line, _MM_HINT_T0);
        for (int h = 0; h < NH; h++) {
            __m256i dots[4];
            for (int i = 0; i < RR; i++) dots[i] = _mm256_set1_epi32(q->offsets[(r0 + i) * nb + b]);
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(block + 32 + 64 * k + 32 * (H0 + h)));
                const __m256i even = _mm256_and_si256(v, _mm256_set1_epi16(0x00FF)), odd = _mm256_srli_epi16(v, 8);
                for (int i = 0; i < RR; i++) {
                    const int16_t *xs = q->qs + (r0 + i) * K + b * QK + 4 * k;
                    dots[i] = DPWSSD256(dots[i], even, _mm256_set1_epi32(pair(xs)));
                    dots[i] = DPWSSD256(dots[i], odd, _mm256_set1_epi32(pair(xs + 2)));
                    __asm__("" : "+x"(dots[i])); /* no reassociation into a tree of 64 live sums (GCC 12) */
                }
            }
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 16 * (H0 + h))));
            for (int i = 0; i < RR; i++) acc[h][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[i]), dw, acc[h][i]);
        }
    }
    for (int h = 0; h < NH; h++) {
        const int64_t stored = C - 8 * (H0 + h) < 8 ? C - 8 * (H0 + h) : 8;
        if (stored <= 0) return;
        const __m256i lanes =
            _mm256_cmpgt_epi32(_mm256_set1_epi32((int)stored), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        for (int i = 0; i < RR; i++) {
            const __m256 row = _mm256_mul_ps(acc[h][i], _mm256_set1_ps(q->d[r0 + i]));
            _mm256_maskstore_ps(out + (r0 + i) * N + n0 + 8 * (H0 + h), lanes, row);
        }
    }
}

/* Both halves of the tile against rows r0 .. r0 + RR (the rows' codes stay in cache between them). */
#define HALVES(RR)                                     \
    do {                                               \
        tile(w, nb, q, r0, K, n0, C, N, out, RR, 0, 1); \
        tile(w, nb, q, r0, K, n0, C, N, out, RR, 1, 1); \
    } while (0)

static void tile_rows(const uint8_t *w, int64_t nb, const HeadRows *q, int64_t M, int64_t n0, int64_t C, int64_t N,
                      float *out) {
    const int64_t K = nb * QK;
    int64_t r0 = 0;
    for (; r0 + 4 <= M; r0 += 4) HALVES(4);
    switch (M - r0) {
    case 3: HALVES(3); break;
    case 2: HALVES(2); break;
    case 1: tile(w, nb, q, r0, K, n0, C, N, out, 1, 0, 2); break;
    default: break;
    }
}
#endif

/* Row r's codes from tern_rows_quantize reordered in place (x0 x2 x1 x3 a group of 4), with each
 * block's offset term. */
static void reorder_row(int16_t *qs, int64_t nb, int32_t *offsets) {
    for (int64_t b = 0; b < nb; b++) {
        int32_t sum = 0;
        for (int e = 0; e < QK; e++) sum += qs[b * QK + e];
        for (int g = 0; g < QK; g += 4) {
            const int16_t second = qs[b * QK + g + 1];
            qs[b * QK + g + 1] = qs[b * QK + g + 2], qs[b * QK + g + 2] = second;
        }
        offsets[b] = -128 * sum;
    }
}

/* out [M, N] = x [M, K] @ dequant(W)^T, W Q8_0 from tern_tile_q8_0, x on int16 rows. 0, -1 (out of
 * memory) or -2 (shapes). */
int tern_matmul_q8_0_head_tiled(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *out) {
    if (K % QK || N <= 0) return -2;
    const int64_t nb = K / QK, whole = N / TILE_N, tail = N % TILE_N, tile_bytes = TILE_N * nb * BLOCK_BYTES;
    QuantizedRows rows;
    int32_t *offsets = (int32_t *)malloc((size_t)(M * nb) * sizeof(int32_t));
    uint8_t *padded = tail ? (uint8_t *)malloc((size_t)tile_bytes) : NULL;
    int status = -1;
    if (tern_rows_quantize(x, M, K, &rows) == 0 && offsets && (!tail || padded)) {
        if (tail) tern_q8_0_pad_tile(0, w + whole * tile_bytes, nb, tail, padded);
        for (int64_t r = 0; r < M; r++) reorder_row(rows.qs + r * K, nb, offsets + r * nb);
        const HeadRows q = {rows.qs, rows.d, offsets};
#pragma omp parallel for schedule(guided)
        for (int64_t t = 0; t < whole + (tail > 0); t++)
            tile_rows(t < whole ? w + t * tile_bytes : padded, nb, &q, M, t * TILE_N, t < whole ? TILE_N : tail, N,
                      out);
        status = 0;
    }
    tern_rows_free(&rows);
    free(offsets), free(padded);
    return status;
}
#else
int tern_matmul_q8_0_head_tiled(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *out) {
    (void)x, (void)M, (void)K, (void)w, (void)N, (void)out;
    return -2; /* built with AVX2 and up only (ggml_kernels.tiled_isa()) */
}
#endif
