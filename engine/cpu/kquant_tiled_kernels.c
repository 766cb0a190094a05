/* Q4_K and Q5_K with AVX-512 VNNI, tile by tile: the q4_1 VNNI kernel's scheme (quant_kernels.c, tiled_q4_1) for
 * GGUF's Q4_K super-blocks, where the row-by-row kernel (kquant_kernels.c) spends most of a one-row
 * step unpacking each column's codes and scales on its own.
 *
 * The weight is rearranged at load, in place (ggml_kernels.tile_q4_k: the same 144 bytes a row and
 * super-block), for tiles of 16 rows; per tile t and super-block s, 2304 bytes:
 *   [0, 32)      d of the 16 columns (float16), [32, 64) their dmin;
 *   [64, 256)    the 12 bytes of 6-bit scales and mins, byte b of column c at 64 + 16 b + c;
 *   [256, 2304)  codes: sub-block j, chunk k (32 bytes at 256 + 256 j + 32 k): byte 2c + e holds column
 *                c's element 4k + e of the sub-block in its low nibble, 4k + 2 + e in its high one.
 * Q5_K (ggml_kernels.tile: 176 bytes a row and super-block) adds [2304, 2816): the fifth bits, sub-block
 * j, chunks 4g .. 4g + 3 (32 bytes at 2304 + 64 j + 32 g): byte 2c + e holds at bit 2 (k - 4g) that of
 * element 4k + e, at bit 2 (k - 4g) + 1 that of element 4k + 2 + e.
 * Activations are llama.cpp's Q8_K (tern_q8k_rows, q8k_rows.c: int8, one scale a row's 256 elements, the
 * super-block's), so vpdpbusd multiplies 64 codes (unsigned) by a row's 4 int8 activations (broadcast)
 * into the 16 columns' int32 lanes: a chunk's 32 bytes widened to one 16-bit pair a lane and unpacked in
 * two instructions to that column's elements 4k .. 4k + 3 in bytes; exact (a sub-block at most 32 * 31
 * * 127). Per sub-block the 16 columns' scales d * sc_j and mins dmin * m_j are unpacked once for all
 * rows (16 columns a vector) and one FMA applies the scale; the mins come off once a super-block in
 * integers (the 16 columns' m_j in pairs against the row's 32-block sums, vpdpwssd: 4 instructions, not
 * 8 FMAs; +17% at 256 rows), then one FMA by dmin and one by the row's block scale: every element the same operations in the same
 * order in any batch or thread count. (Before, int16 activations, one scale a row, and vpdpwssd: half
 * the products an instruction; the prompt path is compute-bound, docs/engine.md.)
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#ifdef TERN_Q4_TILED
#define QK_K 256
#define TILE_N 16
#define Q4_TILE_BYTES 2304
#define Q5_TILE_BYTES 2816

static inline __m512i quad(const int8_t *bytes) {
    int32_t four;
    memcpy(&four, bytes, sizeof four);
    return _mm512_set1_epi32(four);
}

/* The 16 columns' scale (sc) and min (m) of sub-block j from the byte-major packed bytes q[12]
 * (ggml's get_scale_min_k4, 16 columns at a time). */
static inline __attribute__((always_inline)) void scale_min(const __m128i *q, int j, __m128i *sc, __m128i *m) {
    const __m128i low6 = _mm_set1_epi8(0x3F), low4 = _mm_set1_epi8(0x0F), low2 = _mm_set1_epi8(0x03);
    if (j < 4) {
        *sc = _mm_and_si128(q[j], low6);
        *m = _mm_and_si128(q[j + 4], low6);
    } else {
        const __m128i top_sc = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(q[j - 4], 6), low2), 4);
        const __m128i top_m = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(q[j], 6), low2), 4);
        *sc = _mm_or_si128(_mm_and_si128(q[j + 4], low4), top_sc);
        *m = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(q[j + 4], 4), low4), top_m);
    }
}

static inline __m512 bytes_to_floats(__m128i bytes) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)); }

static inline __attribute__((always_inline)) void tile(const uint8_t *w, int64_t nsb, int64_t t,
                                                       const TernQ8KRows *x, int64_t r0, int64_t N, int64_t K,
                                                       float *out, const int RR, const int Q5) {
    const int64_t TILE_BYTES = Q5 ? Q5_TILE_BYTES : Q4_TILE_BYTES;
    const __m512i nibbles = _mm512_set1_epi8(0x0F), fifths = _mm512_set1_epi8(0x10);
    __m512 acc[8];
    for (int i = 0; i < RR; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *block = w + (t * nsb + s) * TILE_BYTES;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)block));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + 32)));
        __m128i q[12];
        for (int b = 0; b < 12; b++) q[b] = _mm_loadu_si128((const __m128i *)(block + 64 + 16 * b));
        /* the mins come off once a super-block, in integers: sum_j m_j * (row's 32-block sum j), the 16
         * columns' m_j of two sub-blocks paired in a lane against the row's two sums (vpdpwssd) */
        __m512i mins[4];
        for (int p = 0; p < 4; p++) {
            __m128i sc, m0, m1;
            scale_min(q, 2 * p, &sc, &m0);
            scale_min(q, 2 * p + 1, &sc, &m1);
            mins[p] = _mm512_or_si512(_mm512_cvtepu8_epi32(m0), _mm512_slli_epi32(_mm512_cvtepu8_epi32(m1), 16));
        }
        __m512 part[8]; /* the super-block's sum in units of the row's block scale */
        for (int i = 0; i < RR; i++) part[i] = _mm512_setzero_ps();
        for (int j = 0; j < 8; j++) {
            /* two super-blocks ahead, an eighth of one at a time: prefetches issued all at once at a
             * super-block's start stall the loads behind them (21 GB/s a core against 16, 1 row) */
            for (int line = 0; line < TILE_BYTES / 8 + 64; line += 64)
                _mm_prefetch((const char *)block + 2 * TILE_BYTES + TILE_BYTES / 8 * j + line, _MM_HINT_T0);
            __m128i sc, m;
            scale_min(q, j, &sc, &m);
            const __m512 scale = _mm512_mul_ps(d, bytes_to_floats(sc));
            const uint8_t *codes = block + 256 + 256 * j;
            /* up to 4 rows, odd chunks go to a second chain (integer sums: the same result), so a decode
             * step's one row is not held up by the latency of one chain of 8 */
            __m512i dots[8], odds[4];
            for (int i = 0; i < RR; i++) dots[i] = _mm512_setzero_si512();
            for (int i = 0; i < RR && RR <= 4; i++) odds[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                /* column c's bytes 2c, 2c + 1 (a, b) widened into its lane, a | b << 8, then to
                 * lo(a) | lo(b) << 8 | hi(a) << 16 | hi(b) << 24: its elements 4k .. 4k + 3 in order */
                const __m512i pair = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(codes + 32 * k)));
                __m512i v = _mm512_ternarylogic_epi32(pair, _mm512_slli_epi32(pair, 12), nibbles, 0xA8); /* (A|B)&C */
                if (Q5) { /* bit 2 (k % 4) of bytes 2c, 2c + 1 and bit 2 (k % 4) + 1 of them, to bit 4 of each byte */
                    const __m512i bits = _mm512_cvtepu16_epi32(
                        _mm256_loadu_si256((const __m256i *)(block + Q4_TILE_BYTES + 64 * j + 32 * (k >> 2))));
                    const __m512i lowers = _mm512_srli_epi32(_mm512_slli_epi32(bits, 4), 2 * (k & 3));
                    const __m512i uppers = _mm512_slli_epi32(bits, 19 - 2 * (k & 3));
                    v = _mm512_or_si512(v, _mm512_ternarylogic_epi32(lowers, uppers, fifths, 0xA8));
                }
                for (int i = 0; i < RR; i++) {
                    const __m512i xs = quad(x->qs + (r0 + i) * K + s * QK_K + 32 * j + 4 * k);
                    if (RR <= 4 && (k & 1))
                        odds[i & 3] = _mm512_dpbusd_epi32(odds[i & 3], v, xs);
                    else
                        dots[i] = _mm512_dpbusd_epi32(dots[i], v, xs);
                }
            }
            for (int i = 0; i < RR; i++) {
                const __m512i dot = RR <= 4 ? _mm512_add_epi32(dots[i], odds[i & 3]) : dots[i];
                part[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, part[i]);
            }
        }
        for (int i = 0; i < RR; i++) {
            const int16_t *sums = x->sums32 + (r0 + i) * (K / 32) + s * 8;
            __m512i min = _mm512_dpwssd_epi32(_mm512_setzero_si512(), mins[0], quad((const int8_t *)sums));
            for (int p = 1; p < 4; p++) min = _mm512_dpwssd_epi32(min, mins[p], quad((const int8_t *)(sums + 2 * p)));
            part[i] = _mm512_fnmadd_ps(dmin, _mm512_cvtepi32_ps(min), part[i]);
            acc[i] = _mm512_fmadd_ps(part[i], _mm512_set1_ps(x->d[(r0 + i) * (K / QK_K) + s]), acc[i]);
        }
    }
    for (int i = 0; i < RR; i++) _mm512_storeu_ps(out + (r0 + i) * N + t * TILE_N, acc[i]);
}

#define ROWS_LOOP(Q5)                                                                                      \
    do {                                                                                                   \
        int64_t r0 = 0;                                                                                    \
        for (; r0 + 8 <= M; r0 += 8) tile(w, nsb, t, &q, r0, N, K, out, 8, Q5);                           \
        switch (M - r0) {                                                                                  \
        case 7: tile(w, nsb, t, &q, r0, N, K, out, 7, Q5); break;                                          \
        case 6: tile(w, nsb, t, &q, r0, N, K, out, 6, Q5); break;                                          \
        case 5: tile(w, nsb, t, &q, r0, N, K, out, 5, Q5); break;                                          \
        case 4: tile(w, nsb, t, &q, r0, N, K, out, 4, Q5); break;                                          \
        case 3: tile(w, nsb, t, &q, r0, N, K, out, 3, Q5); break;                                          \
        case 2: tile(w, nsb, t, &q, r0, N, K, out, 2, Q5); break;                                          \
        case 1: tile(w, nsb, t, &q, r0, N, K, out, 1, Q5); break;                                          \
        default: break;                                                                                    \
        }                                                                                                  \
    } while (0)

/* out [M, N] = x [M, K] @ dequant(W)^T, W Q4_K (q5 0) or Q5_K (q5 1) in the tile layout above; N a multiple
 * of 16. 0, -1 (out of memory) or -2 (shapes). */
int tern_matmul_k_tiled(int q5, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *out) {
    if (K % QK_K || N % TILE_N) return -2;
    const int64_t nsb = K / QK_K, tiles = N / TILE_N;
    TernQ8KRows q;
    if (tern_q8k_rows(x, M, K, &q)) {
        tern_free_q8k_rows(&q);
        return -1;
    }
#pragma omp parallel for schedule(guided)
    for (int64_t t = 0; t < tiles; t++) {
        if (q5)
            ROWS_LOOP(1);
        else
            ROWS_LOOP(0);
    }
    tern_free_q8k_rows(&q);
    return 0;
}
#endif

/* GGUF's Q4_K (q5 0) or Q5_K (q5 1) rows [N, nsb * 144 or 176] (N a multiple of 16) -> the tile layout
 * above, in place, a tile of 16 rows at a time (each through a copy of its own rows). 0 or -1. */
int tern_tile_k(int q5, uint8_t *w, int64_t N, int64_t nsb) {
    const int64_t sb_bytes = q5 ? 176 : 144, row = nsb * sb_bytes, tile_bytes = 16 * row;
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
            uint8_t *out = w + t * tile_bytes + s * 16 * sb_bytes;
            if (q5) memset(out + 2304, 0, 512);
            for (int c = 0; c < 16; c++) {
                const uint8_t *sb = rows + c * row + s * sb_bytes;
                memcpy(out + 2 * c, sb, 2);            /* d */
                memcpy(out + 32 + 2 * c, sb + 2, 2);   /* dmin */
                for (int b = 0; b < 12; b++) out[64 + 16 * b + c] = sb[4 + b];
                for (int j = 0; j < 8; j++) {          /* sub-block j: qs bytes 32 (j / 2), low or high nibble */
                    const uint8_t *qs = sb + (q5 ? 48 : 16) + 32 * (j / 2), *qh = sb + 16;
                    for (int k = 0; k < 8; k++)
                        for (int e = 0; e < 2; e++) {
                            const int low = (qs[4 * k + e] >> (4 * (j & 1))) & 0x0F;
                            const int high = (qs[4 * k + 2 + e] >> (4 * (j & 1))) & 0x0F;
                            out[256 + 256 * j + 32 * k + 2 * c + e] = (uint8_t)(low | high << 4);
                            if (q5) /* qh[l] bit j: element l of sub-block j's fifth bit */
                                out[2304 + 64 * j + 32 * (k >> 2) + 2 * c + e] |=
                                    (uint8_t)((((qh[4 * k + e] >> j) & 1) | ((qh[4 * k + 2 + e] >> j) & 1) << 1)
                                              << (2 * (k & 3)));
                        }
                }
            }
        }
        free(rows);
    }
    return failed ? -1 : 0;
}

#ifndef TERN_KQ_TILED
int tern_matmul_k_tiled(int q5, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *out) {
    (void)q5, (void)x, (void)M, (void)K, (void)w, (void)N, (void)out;
    return -2; /* built with AVX2 and up only (kquant_tiled_avx2.c; ggml_kernels.tiled_isa()) */
}
#endif
