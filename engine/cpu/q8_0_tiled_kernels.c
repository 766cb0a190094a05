/* Q8_0 and Q5_0 tile by tile with AVX-512 VNNI (TERN_Q4_TILED): the layout, the activations and the
 * arithmetic are q8_0_rows.c's. A block's region of 64 bytes is one register holding four consecutive
 * unsigned codes of each of the 16 columns; vpdpbusd multiplies it by a row's 4 int8 activations
 * (broadcast from memory) into the columns' int32 lanes, 64 products an instruction, a block's 8 regions
 * on top of -offset * (the row's block sum), exact. Q5_0 is unpacked on the fly, a region at a time: its
 * nibbles (an and, and a shift for the high ones) or'ed with its fifth bits (a shift of the block's
 * plane and one vpternlogd), 5.5 bits a weight read, not the 8.5 of a conversion to Q8_0.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#ifdef TERN_Q4_TILED
#define QK 32
#define TILE_N 16

static inline __m512i quad(const int8_t *bytes) {
    int32_t four;
    memcpy(&four, bytes, sizeof four);
    return _mm512_set1_epi32(four);
}

/* Region k of a Q5_0 tile block: the 16 columns' codes 0..31 of elements 4k .. 4k + 3 in bytes. */
static inline __attribute__((always_inline)) __m512i q5_codes(const uint8_t *block, __m512i fifths, const int k) {
    const __m512i raw = _mm512_loadu_si512((const void *)(block + 32 + 64 * (k >> 1)));
    const __m512i low = _mm512_and_si512(k & 1 ? _mm512_srli_epi16(raw, 4) : raw, _mm512_set1_epi8(0x0F));
    const __m512i bit = k < 4 ? _mm512_slli_epi16(fifths, 4 - k) : _mm512_srli_epi16(fifths, k - 4);
    return _mm512_ternarylogic_epi32(low, bit, _mm512_set1_epi8(0x10), 0xF8); /* A | (B & C) */
}

/* RR rows of q from r0 against one tile (16 columns from n0, those in `columns` stored). */
static inline __attribute__((always_inline)) void tile(const uint8_t *w, int64_t nb, const TernQ8Rows *q, int64_t r0,
                                                       int64_t K, int64_t n0, __mmask16 columns, int64_t N,
                                                       float *out, const int RR, const int Q5) {
    const int64_t BYTES = TILE_N * (Q5 ? 22 : 34);
    const int32_t offset = Q5 ? 16 : 128;
    __m512 acc[8];
    for (int i = 0; i < RR; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *block = w + b * BYTES;
        for (int line = 0; line < BYTES; line += 64)
            _mm_prefetch((const char *)block + 2 * BYTES + line, _MM_HINT_T0);
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)block));
        const __m512i fifths = Q5 ? _mm512_loadu_si512((const void *)(block + 32 + 256)) : _mm512_setzero_si512();
        /* up to 4 rows, odd regions go to a second chain (integer sums: the same result), so that a
         * decode step's one row is not held up by the latency of one chain of 8 */
        __m512i dots[8], odds[4];
        for (int i = 0; i < RR; i++) dots[i] = _mm512_set1_epi32(-offset * q->sums[(r0 + i) * nb + b]);
        for (int i = 0; i < RR && RR <= 4; i++) odds[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            const __m512i v = Q5 ? q5_codes(block, fifths, k) : _mm512_loadu_si512((const void *)(block + 32 + 64 * k));
            for (int i = 0; i < RR; i++) {
                const __m512i xs = quad(q->qs + (r0 + i) * K + b * QK + 4 * k);
                if (RR <= 4 && (k & 1))
                    odds[i & 3] = _mm512_dpbusd_epi32(odds[i & 3], v, xs);
                else
                    dots[i] = _mm512_dpbusd_epi32(dots[i], v, xs);
            }
        }
        for (int i = 0; i < RR; i++) {
            const __m512i dot = RR <= 4 ? _mm512_add_epi32(dots[i], odds[i & 3]) : dots[i];
            const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(q->d[(r0 + i) * nb + b]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[i]);
        }
    }
    for (int i = 0; i < RR; i++) _mm512_mask_storeu_ps(out + (r0 + i) * N + n0, columns, acc[i]);
}

#define ROWS_LOOP(Q5)                                                                      \
    do {                                                                                   \
        int64_t r0 = 0;                                                                    \
        for (; r0 + 8 <= M; r0 += 8) tile(w, nb, q, r0, K, n0, columns, N, out, 8, Q5);    \
        switch (M - r0) {                                                                  \
        case 7: tile(w, nb, q, r0, K, n0, columns, N, out, 7, Q5); break;                  \
        case 6: tile(w, nb, q, r0, K, n0, columns, N, out, 6, Q5); break;                  \
        case 5: tile(w, nb, q, r0, K, n0, columns, N, out, 5, Q5); break;                  \
        case 4: tile(w, nb, q, r0, K, n0, columns, N, out, 4, Q5); break;                  \
        case 3: tile(w, nb, q, r0, K, n0, columns, N, out, 3, Q5); break;                  \
        case 2: tile(w, nb, q, r0, K, n0, columns, N, out, 2, Q5); break;                  \
        case 1: tile(w, nb, q, r0, K, n0, columns, N, out, 1, Q5); break;                  \
        default: break;                                                                    \
        }                                                                                  \
    } while (0)

void tern_q8_0_tile_rows(int q5, const uint8_t *w, int64_t nb, const TernQ8Rows *q, int64_t M, int64_t n0, int64_t C,
                         int64_t N, float *out) {
    const int64_t K = nb * QK;
    const __mmask16 columns = (__mmask16)((1u << C) - 1);
    if (q5)
        ROWS_LOOP(1);
    else
        ROWS_LOOP(0);
}
#endif
