/* Q6_K with AVX-512 VNNI, tile by tile, as kquant_tiled_kernels.c does Q4_K (see there for the scheme).
 *
 * The weight is rearranged at load, in place (ggml_kernels.tile_q6_k: the same 210 bytes a row and
 * super-block), for tiles of 16 rows; per tile and super-block, 3360 bytes:
 *   [0, 32)        d of the 16 columns (float16);
 *   [32, 288)      the 16 int8 scales (one per 16 elements), scale h of column c at 32 + 16 h + c;
 *   [288, 2336)    low 4 bits: sub-block j, chunk k (32 bytes at 288 + 256 j + 32 k): byte 2c + e holds
 *                  column c's element 4k + e of the sub-block in its low nibble, 4k + 2 + e in its high;
 *   [2336, 3360)   high 2 bits: sub-block j, chunks 2i and 2i + 1 (32 bytes at 2336 + 128 j + 32 i): byte
 *                  2c + e holds, from bit 0 up, those of elements 4k + e and 4k + 2 + e for k = 2i, 2i + 1.
 * Codes minus 32 meet broadcast pairs of a row's int16 codes in vpdpwssd (exact: at most 16 * 32 * 32767
 * a half sub-block), then one conversion and FMA per 16 elements by d * scale, 16 columns a vector.
 * Also here: rows of such a weight dequantized (a tied embedding's lookups).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define QK_K 256
#define TILE_N 16
#define TILE_BYTES 3360
#define LOW_OFFSET 288
#define HIGH_OFFSET 2336

#ifdef TERN_Q4_TILED
static inline int32_t code_pair(const int16_t *codes) {
    int32_t pair;
    memcpy(&pair, codes, sizeof pair);
    return pair;
}

static inline __attribute__((always_inline)) void tile(const uint8_t *w, int64_t nsb, int64_t t, const TernRows *x,
                                                       int64_t r0, int64_t N, int64_t K, float *out, const int RR) {
    __m512 acc[8];
    for (int i = 0; i < RR; i++) acc[i] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi16(0x0F), offset = _mm512_set1_epi16(32);
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *block = w + (t * nsb + s) * TILE_BYTES;
        for (int line = 0; line < TILE_BYTES; line += 64)
            _mm_prefetch((const char *)block + 2 * TILE_BYTES + line, _MM_HINT_T0);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)block));
        for (int j = 0; j < 8; j++) {
            for (int half = 0; half < 2; half++) { /* elements 16 half .. 16 half + 15: scale 2j + half */
                const __m128i sc = _mm_loadu_si128((const __m128i *)(block + 32 + 16 * (2 * j + half)));
                const __m512 scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
                __m512i dots[8];
                for (int i = 0; i < RR; i++) dots[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int k = 4 * half; k < 4 * half + 4; k++) {
                    const __m512i both = _mm512_cvtepu8_epi16(
                        _mm256_loadu_si256((const __m256i *)(block + LOW_OFFSET + 256 * j + 32 * k)));
                    __m512i top = _mm512_cvtepu8_epi16(
                        _mm256_loadu_si256((const __m256i *)(block + HIGH_OFFSET + 128 * j + 32 * (k >> 1))));
                    if (k & 1) top = _mm512_srli_epi16(top, 4);
                    const __m512i low = _mm512_sub_epi16(
                        _mm512_or_si512(_mm512_and_si512(both, low4),
                                        _mm512_slli_epi16(_mm512_and_si512(top, _mm512_set1_epi16(0x03)), 4)),
                        offset);
                    const __m512i high = _mm512_sub_epi16(
                        _mm512_or_si512(_mm512_srli_epi16(both, 4),
                                        _mm512_slli_epi16(_mm512_and_si512(top, _mm512_set1_epi16(0x0C)), 2)),
                        offset);
                    for (int i = 0; i < RR; i++) {
                        const int16_t *xs = x->qs + (r0 + i) * K + s * QK_K + 32 * j + 4 * k;
                        dots[i] = _mm512_dpwssd_epi32(dots[i], low, _mm512_set1_epi32(code_pair(xs)));
                        dots[i] = _mm512_dpwssd_epi32(dots[i], high, _mm512_set1_epi32(code_pair(xs + 2)));
                    }
                }
                for (int i = 0; i < RR; i++) acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[i]), scale, acc[i]);
            }
        }
    }
    for (int i = 0; i < RR; i++)
        _mm512_storeu_ps(out + (r0 + i) * N + t * TILE_N, _mm512_mul_ps(acc[i], _mm512_set1_ps(x->d[r0 + i])));
}

/* out [M, N] = x [M, K] @ dequant(W)^T, W Q6_K in the tile layout above; N a multiple of 16. */
int tern_matmul_q6_k_tiled(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *out) {
    if (K % QK_K || N % TILE_N) return -2;
    const int64_t nsb = K / QK_K, tiles = N / TILE_N;
    TernRows q;
    if (tern_kquant_rows(x, M, K, &q)) {
        tern_free_kquant_rows(&q);
        return -1;
    }
#pragma omp parallel for schedule(guided)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t r0 = 0;
        for (; r0 + 8 <= M; r0 += 8) tile(w, nsb, t, &q, r0, N, K, out, 8);
        switch (M - r0) {
        case 7: tile(w, nsb, t, &q, r0, N, K, out, 7); break;
        case 6: tile(w, nsb, t, &q, r0, N, K, out, 6); break;
        case 5: tile(w, nsb, t, &q, r0, N, K, out, 5); break;
        case 4: tile(w, nsb, t, &q, r0, N, K, out, 4); break;
        case 3: tile(w, nsb, t, &q, r0, N, K, out, 3); break;
        case 2: tile(w, nsb, t, &q, r0, N, K, out, 2); break;
        case 1: tile(w, nsb, t, &q, r0, N, K, out, 1); break;
        default: break;
        }
    }
    tern_free_kquant_rows(&q);
    return 0;
}
#else
int tern_matmul_q6_k_tiled(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *out) {
    (void)x, (void)M, (void)K, (void)w, (void)N, (void)out;
    return -2; /* built only with AVX-512 VNNI (kernels.q4_1_tiled()) */
}
#endif

/* Element e (0..255) of column c's super-block as its 6-bit code, from GGUF's block_q6_K bytes. */
static inline int gguf_code(const uint8_t *sb, int e) {
    const int half = e / 128, t = (e % 128) / 32, l = e % 32;
    const uint8_t *ql = sb + 64 * half + 32 * (t & 1), *qh = sb + 128 + 32 * half;
    const int low = (t >> 1) ? ql[l] >> 4 : ql[l] & 0x0F;
    return low | (((qh[l] >> (2 * t)) & 3) << 4);
}

/* GGUF's Q6_K rows [N, nsb * 210] (N a multiple of 16) -> the tile layout above, in place, a tile at a time. */
int tern_tile_q6_k(uint8_t *w, int64_t N, int64_t nsb) {
    const int64_t row = nsb * 210, tile_bytes = 16 * row;
    int failed = 0;
#pragma omp parallel for schedule(static) reduction(| : failed)
    for (int64_t t = 0; t < N / 16; t++) {
        uint8_t *rows = (uint8_t *)malloc((size_t)tile_bytes);
        if (!rows) {
            failed = 1;
            continue;
        }
        memcpy(rows, w + t * tile_bytes, (size_t)tile_bytes);
        for (int64_t s = 0; s < nsb; s++) {
            uint8_t *out = w + t * tile_bytes + s * TILE_BYTES;
            memset(out + HIGH_OFFSET, 0, TILE_BYTES - HIGH_OFFSET);
            for (int c = 0; c < 16; c++) {
                const uint8_t *sb = rows + c * row + s * 210;
                memcpy(out + 2 * c, sb + 208, 2);
                for (int h = 0; h < 16; h++) out[32 + 16 * h + c] = sb[192 + h];
                for (int j = 0; j < 8; j++)
                    for (int k = 0; k < 8; k++)
                        for (int e = 0; e < 2; e++) {
                            const int a = gguf_code(sb, 32 * j + 4 * k + e), b = gguf_code(sb, 32 * j + 4 * k + 2 + e);
                            out[LOW_OFFSET + 256 * j + 32 * k + 2 * c + e] = (uint8_t)((a & 0x0F) | (b & 0x0F) << 4);
                            out[HIGH_OFFSET + 128 * j + 32 * (k >> 1) + 2 * c + e] |=
                                (uint8_t)(((a >> 4) | (b >> 4) << 2) << (4 * (k & 1)));
                        }
            }
        }
        free(rows);
    }
    return failed ? -1 : 0;
}

/* Rows ids[0..count) of a Q6_K weight in the tile layout, dequantized: out [count, nsb * 256]. */
void tern_dequantize_q6_k_tiled(const uint8_t *w, int64_t nsb, const int64_t *ids, int64_t count, float *out) {
    for (int64_t r = 0; r < count; r++) {
        const int64_t t = ids[r] / 16, c = ids[r] % 16;
        for (int64_t s = 0; s < nsb; s++) {
            const uint8_t *block = w + (t * nsb + s) * TILE_BYTES;
            uint16_t dh;
            memcpy(&dh, block + 2 * c, 2);
            const float d = half_to_float(dh);
            for (int e = 0; e < QK_K; e++) {
                const int j = e / 32, l = e % 32, k = l / 4, in_chunk = l % 4, nib = in_chunk >> 1, pos = in_chunk & 1;
                const int low = (block[LOW_OFFSET + 256 * j + 32 * k + 2 * c + pos] >> (4 * nib)) & 0x0F;
                const int top = (block[HIGH_OFFSET + 128 * j + 32 * (k >> 1) + 2 * c + pos] >> (4 * (k & 1) + 2 * nib)) & 3;
                const int8_t scale = (int8_t)block[32 + 16 * (e / 16) + c];
                out[r * nsb * QK_K + s * QK_K + e] = d * (float)scale * (float)((low | top << 4) - 32);
            }
        }
    }
}
