/* Q8_0 and Q5_0 tile by tile on AVX2 (TERN_KQ_TILED_256): q8_0_rows.c's layout, activations and float
 * arithmetic with 256-bit vectors, a tile of 16 columns as two halves of 8 (each region's bytes 0..31,
 * then 32..63), each against up to 4 rows. A block's exact integer dot product, per half and row:
 *   AVX-VNNI:    vpdpbusd of the unsigned codes (Q8_0: w + 128; Q5_0: q) by the row's 4 int8 activations,
 *                broadcast, on top of -offset * the row's block sum, as the AVX-512 kernel does;
 *   AVX2, Q5_0:  vpmaddubsw of the codes 0..31 into int16 pairs (at most 2 * 31 * 127), four regions
 *                summed in int16 (4 * 7874 < 2^15, no saturation), vpmaddwd by ones into int32, on top of
 *                -16 * the block sum;
 *   AVX2, Q8_0:  w + 128 against an int8 row would saturate vpmaddubsw's int16 pairs (2 * 255 * 127), so
 *                the sign moves to the activations: vpmaddubsw(|w|, sign(qx, w)) (at most 2 * 128 * 127,
 *                exact; w = -128 too: |w| is 128 read unsigned), vpmaddwd by ones each region.
 * The same integers as AVX-512 VNNI's, so the same float operations on them in the same order: the three
 * instruction sets give the same bits, and a row's result does not depend on the batch or the threads.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#ifdef TERN_KQ_TILED_256
#define QK 32
#define TILE_N 16

static inline __m256i quad(const int8_t *bytes) {
    int32_t four;
    memcpy(&four, bytes, sizeof four);
    return _mm256_set1_epi32(four);
}

/* Region k of half H of a Q5_0 tile block: its 8 columns' codes 0..31 of elements 4k .. 4k + 3. */
static inline __attribute__((always_inline)) __m256i q5_codes(const uint8_t *block, __m256i fifths, const int k,
                                                              const int H) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(block + 32 + 64 * (k >> 1) + 32 * H));
    const __m256i low = _mm256_and_si256(k & 1 ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(0x0F));
    const __m256i bit = k < 4 ? _mm256_slli_epi16(fifths, 4 - k) : _mm256_srli_epi16(fifths, k - 4);
    return _mm256_or_si256(low, _mm256_and_si256(bit, _mm256_set1_epi8(0x10)));
}

/* Block `block`'s dot products for RR rows from r0 (activations xs), half H, into dots (which hold the
 * offset's correction where the codes are unsigned). */
static inline __attribute__((always_inline)) void block_dots(const uint8_t *block, const int8_t *xs, int64_t K,
                                                             __m256i *dots, const int RR, const int H, const int Q5) {
    const __m256i fifths = Q5 ? _mm256_loadu_si256((const __m256i *)(block + 32 + 256 + 32 * H)) : _mm256_setzero_si256();
#ifdef TERN_VNNI_256
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        const __m256i v = Q5 ? q5_codes(block, fifths, k, H)
                             : _mm256_loadu_si256((const __m256i *)(block + 32 + 64 * k + 32 * H));
        for (int i = 0; i < RR; i++) dots[i] = tern_dpbusd256(dots[i], v, quad(xs + i * K + 4 * k));
    }
#else
    const __m256i ones = _mm256_set1_epi16(1);
    if (Q5) {
        for (int g = 0; g < 8; g += 4) {
            __m256i v[4];
            for (int k = 0; k < 4; k++) v[k] = q5_codes(block, fifths, g + k, H);
            for (int i = 0; i < RR; i++) {
                /* saturating adds that never saturate (the bound above): GCC keeps their order */
                __m256i pairs = _mm256_maddubs_epi16(v[0], quad(xs + i * K + 4 * g));
                for (int k = 1; k < 4; k++)
                    pairs = _mm256_adds_epi16(pairs, _mm256_maddubs_epi16(v[k], quad(xs + i * K + 4 * (g + k))));
                dots[i] = _mm256_add_epi32(dots[i], _mm256_madd_epi16(pairs, ones));
            }
        }
    } else {
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(block + 32 + 64 * k + 32 * H)),
                                               _mm256_set1_epi8((char)0x80));
            const __m256i magnitude = _mm256_abs_epi8(w);
            for (int i = 0; i < RR; i++) {
                const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(quad(xs + i * K + 4 * k), w));
                dots[i] = _mm256_add_epi32(dots[i], _mm256_madd_epi16(pairs, ones));
            }
        }
    }
#endif
}

/* RR rows of q from r0 against halves H0 .. H0 + NH of one tile (columns n0 + 8 H .., the first C - 8 H
 * stored). One row takes both halves in one pass over the tile's blocks (NH 2), the same integers and float
 * operations a half as two passes: read a half a pass, a decode step's linears ran 1.35x slower from memory
 * than the int16 row tiles before them (`tern bench ggml-linears --rows 1`, AVX2 build). */
static inline __attribute__((always_inline)) void tile(const uint8_t *w, int64_t nb, const TernQ8Rows *q, int64_t r0,
                                                       int64_t K, int64_t n0, int64_t C, int64_t N, float *out,
                                                       const int RR, const int H0, const int NH, const int Q5) {
    const int64_t BYTES = TILE_N * (Q5 ? 22 : 34);
#ifdef TERN_VNNI_256
    const int32_t offset = Q5 ? 16 : 128;
#else
    const int32_t offset = Q5 ? 16 : 0; /* AVX2's Q8_0 multiplies the signed codes */
#endif
    __m256 acc[2][4];
    for (int h = 0; h < NH; h++)
        for (int i = 0; i < RR; i++) acc[h][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *block = w + b * BYTES;
        for (int line = 0; line < BYTES && H0 == 0; line += 64) /* the first half streams the tile from memory */
            _mm_prefetch((const char *)block + 2 * BYTES + line, _MM_HINT_T0);
        for (int h = 0; h < NH; h++) {
            __m256i dots[4];
            for (int i = 0; i < RR; i++) dots[i] = _mm256_set1_epi32(-offset * q->sums[(r0 + i) * nb + b]);
            block_dots(block, q->qs + r0 * K + b * QK, K, dots, RR, H0 + h, Q5);
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 16 * (H0 + h))));
            for (int i = 0; i < RR; i++) {
                const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(q->d[(r0 + i) * nb + b]));
                acc[h][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[i]), scale, acc[h][i]);
            }
        }
    }
    for (int h = 0; h < NH; h++) {
        const int64_t stored = C - 8 * (H0 + h) < 8 ? C - 8 * (H0 + h) : 8;
        if (stored <= 0) return;
        const __m256i lanes =
            _mm256_cmpgt_epi32(_mm256_set1_epi32((int)stored), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        for (int i = 0; i < RR; i++) _mm256_maskstore_ps(out + (r0 + i) * N + n0 + 8 * (H0 + h), lanes, acc[h][i]);
    }
}

/* Both halves of the tile against rows r0 .. r0 + RR (the rows' activations stay in cache between them). */
#define HALVES(RR, Q5)                                         \
    do {                                                       \
        tile(w, nb, q, r0, K, n0, C, N, out, RR, 0, 1, Q5);    \
        tile(w, nb, q, r0, K, n0, C, N, out, RR, 1, 1, Q5);    \
    } while (0)

#define ROWS_LOOP(Q5)                               \
    do {                                            \
        int64_t r0 = 0;                             \
        for (; r0 + 4 <= M; r0 += 4) HALVES(4, Q5); \
        switch (M - r0) {                           \
        case 3: HALVES(3, Q5); break;               \
        case 2: HALVES(2, Q5); break;               \
        case 1: tile(w, nb, q, r0, K, n0, C, N, out, 1, 0, 2, Q5); break; \
        default: break;                             \
        }                                           \
    } while (0)

void tern_q8_0_tile_rows(int q5, const uint8_t *w, int64_t nb, const TernQ8Rows *q, int64_t M, int64_t n0, int64_t C,
                         int64_t N, float *out) {
    const int64_t K = nb * QK;
    if (q5)
        ROWS_LOOP(1);
    else
        ROWS_LOOP(0);
}
#endif
