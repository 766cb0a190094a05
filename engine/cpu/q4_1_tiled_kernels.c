/* q4_1 with AVX-512 VNNI, the weight tile by tile (quant_kernels.c has the row-by-row tiles and the
 * entry point, tern_matmul_q4_1, which calls this where kernels.h defines TERN_Q4_TILED). */
#include <string.h>

#include "kernels.h"
#include "quant_rows.h"

#ifdef TERN_Q4_TILED
/* q4_1 with AVX-512 VNNI (where the CPU has it; TERN_CPU_VNNI=0 turns it off, see kernels.h). The weight
 * is stored tile by tile so that one register holds a pair of codes from each of the tile's 16 columns
 * (kernels.tile_q4_1): for tile t and block b, 8 chunks of 32 bytes, chunk j's byte 2c + e holding column
 * c's element 4j + e in its low nibble and 4j + 2 + e in its high one. Widened to int16, each half of a
 * chunk then meets one pair of a row's int16 codes, broadcast: vpdpwssd multiplies and adds both products
 * into the column's int32 lane, so a block costs a row 16 instructions for 16 columns (the tiles above: a
 * multiply-add, a conversion and an FMA per column) and its dot products are exact integers (at most 32 *
 * 15 * 32767 < 2^24, so the conversion to float is exact too). Then one FMA per block applies the 16
 * columns' scales, in block order: each element the same arithmetic in any batch. */
static inline int32_t code_pair(const int16_t *codes) {
    int32_t pair;
    memcpy(&pair, codes, sizeof pair);
    return pair;
}

static inline __attribute__((always_inline)) void tiled_q4_1(const Weights *w, int64_t t, const QuantizedRows *x,
                                                             int64_t r0, int64_t N, float *out, const int RR) {
    const int64_t nb = w->nb, K = nb * QK, n0 = t * TILE_N;
    const uint8_t *codes = w->qs + t * nb * (TILE_N * QK / 2);
    const uint16_t *d = w->d + t * nb * TILE_N, *m = w->m + t * nb * TILE_N;
    __m512 acc[8], mins[8];
    for (int i = 0; i < RR; i++) acc[i] = mins[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *block = codes + b * (TILE_N * QK / 2);
        for (int line = 0; line < TILE_N * QK / 2; line += 64)
            _mm_prefetch((const char *)block + PREFETCH_BYTES + line, _MM_HINT_T0);
        /* Up to 4 rows, the high halves go to a second chain (integer sums: the same result), so that
         * a decode step's one row is not held up by the latency of one chain of 16. */
        __m512i dots[8], highs[8];
        for (int i = 0; i < RR; i++) dots[i] = _mm512_setzero_si512();
        for (int i = 0; i < RR && RR <= 4; i++) highs[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int j = 0; j < QK / 4; j++) {
            const __m512i both = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(block + 32 * j)));
            const __m512i low = _mm512_and_si512(both, _mm512_set1_epi16(0x0F)), high = _mm512_srli_epi16(both, 4);
            for (int i = 0; i < RR; i++) {
                const int16_t *xb = x->qs + (r0 + i) * K + b * QK + 4 * j;
                dots[i] = _mm512_dpwssd_epi32(dots[i], low, _mm512_set1_epi32(code_pair(xb)));
                if (RR <= 4)
                    highs[i] = _mm512_dpwssd_epi32(highs[i], high, _mm512_set1_epi32(code_pair(xb + 2)));
                else
                    dots[i] = _mm512_dpwssd_epi32(dots[i], high, _mm512_set1_epi32(code_pair(xb + 2)));
            }
        }
        for (int i = 0; i < RR && RR <= 4; i++) dots[i] = _mm512_add_epi32(dots[i], highs[i]);
        const __m512 db = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + b * TILE_N)));
        const __m512 mb = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + b * TILE_N)));
        for (int i = 0; i < RR; i++) {
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[i]), db, acc[i]);
            mins[i] = _mm512_fmadd_ps(_mm512_set1_ps(x->s[(r0 + i) * nb + b]), mb, mins[i]);
        }
    }
    const __mmask16 columns = N - n0 >= TILE_N ? 0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
    for (int i = 0; i < RR; i++)
        _mm512_mask_storeu_ps(out + (r0 + i) * N + n0, columns,
                              _mm512_fmadd_ps(acc[i], _mm512_set1_ps(x->d[r0 + i]), mins[i]));
}

/* Every tile against all rows of x: 8 rows at a time (24 of the 32 registers accumulate), then the
 * rest in one micro-kernel. */
void tern_matmul_tiled_q4_1(const Weights *w, const QuantizedRows *x, int64_t M, int64_t N, float *out) {
    const int64_t tiles = (N + TILE_N - 1) / TILE_N;
#pragma omp parallel for schedule(guided)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t r0 = 0;
        for (; r0 + 8 <= M; r0 += 8) tiled_q4_1(w, t, x, r0, N, out, 8);
        switch (M - r0) {
        case 7: tiled_q4_1(w, t, x, r0, N, out, 7); break;
        case 6: tiled_q4_1(w, t, x, r0, N, out, 6); break;
        case 5: tiled_q4_1(w, t, x, r0, N, out, 5); break;
        case 4: tiled_q4_1(w, t, x, r0, N, out, 4); break;
        case 3: tiled_q4_1(w, t, x, r0, N, out, 3); break;
        case 2: tiled_q4_1(w, t, x, r0, N, out, 2); break;
        case 1: tiled_q4_1(w, t, x, r0, N, out, 1); break;
        default: break;
        }
    }
}
#endif
