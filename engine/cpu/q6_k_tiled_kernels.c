/* Q6_K with AVX-512 VNNI, tile by tile, as kquant_tiled_kernels.c does Q4_K (see there for the scheme).
 *
 * The weight is rearranged at load, in place (ggml_kernels.tile: the same 210 bytes a row and
 * super-block), for tiles of 16 rows; per tile and super-block, 3360 bytes:
 *   [0, 32)        d of the 16 columns (float16);
 *   [32, 288)      the 16 int8 scales (one per 16 elements), scale h of column c at 32 + 16 h + c;
 *   [288, 2336)    low 4 bits: group g of 8 elements (64 bytes at 288 + 64 g): byte 4c + e holds column
 *                  c's element 8g + e in its low nibble, 8g + 4 + e in its high one;
 *   [2336, 3360)   high 2 bits: the 16 elements of scale h (64 bytes at 2336 + 64 h): byte 4c + e holds,
 *                  from bit 0 up, those of elements 16h + e, 16h + 4 + e, 16h + 8 + e, 16h + 12 + e.
 * So a 64-byte vector of a scale's codes is 16 columns x 4 consecutive elements, as vpdpbusd takes them:
 * the 6-bit codes q are merged in bytes (four ands, shifts and ors a 256 codes) and never widened.
 * vpdpbusd multiplies unsigned by signed bytes: q (0..63) against the row's int8 Q8_K activations
 * (q8k_rows.c, tern_q8k_rows: a scale a block of 256), exactly (at most 16 * 63 * 127), then
 * one conversion and FMA by d * scale a 16 elements; the -32 of q - 32 comes off once a super-block, in
 * integers, 32 sum_h sc_h (the row's 16-sum h) (the columns' scales in pairs against the row's sums,
 * vpdpwssd), by one FMA with 32 d, and one FMA by the row's block scale, 16 columns a vector: every
 * element the same operations in the same order in any batch or thread count. One row (a decode step;
 * `row`) runs the same integers and float operations two scales a pass, the row's 4-byte broadcasts
 * folded into vpdpbusd ({1to16}): 30.5 instructions a scale of 256 products in the loop against 40
 * (static count, block_loops.py: 0.156 -> 0.119 a multiply-add; docs/engine.md).
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
static inline __m512i quad(const int8_t *bytes) {
    int32_t four;
    memcpy(&four, bytes, sizeof four);
    return _mm512_set1_epi32(four);
}

static inline __attribute__((always_inline)) void tile(const uint8_t *w, int64_t nsb, int64_t t,
                                                       const TernQ8KRows *x, int64_t r0, int64_t N, int64_t K,
                                                       float *out, const int RR) {
    __m512 acc[8];
    for (int i = 0; i < RR; i++) acc[i] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0F), top2 = _mm512_set1_epi8(0x30);
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *block = w + (t * nsb + s) * TILE_BYTES;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)block));
        /* the -32 comes off once a super-block, in integers: 32 sum_h sc_h (row's 16-sum h), the 16 columns'
         * sc_h of two scales paired in a lane against the row's two sums (vpdpwssd) */
        __m512i scales[8];
        for (int p = 0; p < 8; p++) {
            const __m128i a = _mm_loadu_si128((const __m128i *)(block + 32 + 32 * p));
            const __m128i b = _mm_loadu_si128((const __m128i *)(block + 48 + 32 * p));
            scales[p] = _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b)));
        }
        __m512 part[8]; /* the super-block's sum in units of the row's block scale */
        for (int i = 0; i < RR; i++) part[i] = _mm512_setzero_ps();
#pragma GCC unroll 2
        for (int h = 0; h < 16; h++) { /* elements 16h .. 16h + 15: scale h */
            /* two super-blocks ahead, a sixteenth of one at a time: prefetches issued all at once at a
             * super-block's start stall the loads behind them (20 GB/s a core against 14, 1 row) */
            for (int line = 0; line < 256; line += 64)
                _mm_prefetch((const char *)block + 2 * TILE_BYTES + 210 * h + line, _MM_HINT_T0);
            const __m128i sc = _mm_loadu_si128((const __m128i *)(block + 32 + 16 * h));
            const __m512 scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
            const __m512i l0 = _mm512_loadu_si512((const void *)(block + LOW_OFFSET + 128 * h));
            const __m512i l1 = _mm512_loadu_si512((const void *)(block + LOW_OFFSET + 128 * h + 64));
            const __m512i hi = _mm512_loadu_si512((const void *)(block + HIGH_OFFSET + 64 * h));
            const __m512i q0 = _mm512_or_si512(_mm512_and_si512(l0, low4), _mm512_and_si512(_mm512_slli_epi16(hi, 4), top2));
            const __m512i q1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), low4),
                                               _mm512_and_si512(_mm512_slli_epi16(hi, 2), top2));
            const __m512i q2 = _mm512_or_si512(_mm512_and_si512(l1, low4), _mm512_and_si512(hi, top2));
            const __m512i q3 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), low4),
                                               _mm512_and_si512(_mm512_srli_epi16(hi, 2), top2));
            for (int i = 0; i < RR; i++) {
                const int8_t *xs = x->qs + (r0 + i) * K + s * QK_K + 16 * h;
                __m512i dot;
                if (RR <= 4) { /* two chains: a decode step's one row is not held up by one chain's latency */
                    __m512i even = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q0, quad(xs));
                    __m512i odd = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q1, quad(xs + 4));
                    even = _mm512_dpbusd_epi32(even, q2, quad(xs + 8));
                    odd = _mm512_dpbusd_epi32(odd, q3, quad(xs + 12));
                    dot = _mm512_add_epi32(even, odd);
                } else {
                    dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q0, quad(xs));
                    dot = _mm512_dpbusd_epi32(dot, q1, quad(xs + 4));
                    dot = _mm512_dpbusd_epi32(dot, q2, quad(xs + 8));
                    dot = _mm512_dpbusd_epi32(dot, q3, quad(xs + 12));
                }
                part[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, part[i]);
            }
        }
        const __m512 d32 = _mm512_mul_ps(d, _mm512_set1_ps(32.0f));
        for (int i = 0; i < RR; i++) {
            const int16_t *sums = x->sums + (r0 + i) * (K / 16) + s * 16;
            __m512i offset = _mm512_dpwssd_epi32(_mm512_setzero_si512(), scales[0], quad((const int8_t *)sums));
            for (int p = 1; p < 8; p++) offset = _mm512_dpwssd_epi32(offset, scales[p], quad((const int8_t *)(sums + 2 * p)));
            part[i] = _mm512_fnmadd_ps(d32, _mm512_cvtepi32_ps(offset), part[i]);
            acc[i] = _mm512_fmadd_ps(part[i], _mm512_set1_ps(x->d[(r0 + i) * (K / QK_K) + s]), acc[i]);
        }
    }
    for (int i = 0; i < RR; i++) _mm512_storeu_ps(out + (r0 + i) * N + t * TILE_N, acc[i]);
}

/* Scale h's 16 columns' codes against a row's 16 activations xs (each 4 broadcast to vpdpbusd, folded
 * into it: GCC does not fold _mm512_set1_epi32's load itself): the exact integer dot product, one chain
 * (row's two scales a pass are two chains). */
static inline __attribute__((always_inline)) __m512i scale_dot(const uint8_t *block, int h, const int8_t *xs) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), top2 = _mm512_set1_epi8(0x30);
    const __m512i l0 = _mm512_loadu_si512((const void *)(block + LOW_OFFSET + 128 * h));
    const __m512i l1 = _mm512_loadu_si512((const void *)(block + LOW_OFFSET + 128 * h + 64));
    const __m512i hi = _mm512_loadu_si512((const void *)(block + HIGH_OFFSET + 64 * h));
    const __m512i q[4] = {
        _mm512_or_si512(_mm512_and_si512(l0, low4), _mm512_and_si512(_mm512_slli_epi16(hi, 4), top2)),
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), low4), _mm512_and_si512(_mm512_slli_epi16(hi, 2), top2)),
        _mm512_or_si512(_mm512_and_si512(l1, low4), _mm512_and_si512(hi, top2)),
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), low4), _mm512_and_si512(_mm512_srli_epi16(hi, 2), top2))};
    __m512i dot = _mm512_setzero_si512();
    for (int p = 0; p < 4; p++) /* dot += q[p] (unsigned) x the 4 bytes at xs + 4p (signed), {1to16}: m32bcst */
        __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(dot) : "v"(q[p]), "m"(*(const int32_t(*)[1])(xs + 4 * p)));
    return dot;
}

/* Row r of x against tile t (a decode step's one row): tile()'s integers and float operations in its
 * order (the same bits), two scales a pass (7 prefetches a 420 bytes, not 8; one dot-product chain a
 * scale, two in flight). Static count, the loop's instructions: docs/engine.md, "GGUF types". */
static inline __attribute__((always_inline)) void row(const uint8_t *w, int64_t nsb, int64_t t, const TernQ8KRows *x,
                                                      int64_t r, int64_t N, int64_t K, float *out) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *block = w + (t * nsb + s) * TILE_BYTES;
        const int8_t *xs = x->qs + r * K + s * QK_K;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)block));
        __m512 part = _mm512_setzero_ps();
        for (int h = 0; h < 16; h += 2) {
            for (int line = 0; line < 448; line += 64)
                _mm_prefetch((const char *)block + 2 * TILE_BYTES + 210 * h + line, _MM_HINT_T0);
            const __m512i even = scale_dot(block, h, xs + 16 * h), odd = scale_dot(block, h + 1, xs + 16 * h + 16);
            for (int g = 0; g < 2; g++) {
                const __m128i sc = _mm_loadu_si128((const __m128i *)(block + 32 + 16 * (h + g)));
                const __m512 scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
                part = _mm512_fmadd_ps(_mm512_cvtepi32_ps(g ? odd : even), scale, part);
            }
        }
        const int16_t *sums = x->sums + r * (K / 16) + s * 16;
        __m512i offset = _mm512_setzero_si512();
        for (int p = 0; p < 8; p++) {
            const __m128i a = _mm_loadu_si128((const __m128i *)(block + 32 + 32 * p));
            const __m128i b = _mm_loadu_si128((const __m128i *)(block + 48 + 32 * p));
            const __m512i scales = _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b)));
            offset = _mm512_dpwssd_epi32(offset, scales, quad((const int8_t *)(sums + 2 * p)));
        }
        part = _mm512_fnmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(32.0f)), _mm512_cvtepi32_ps(offset), part);
        acc = _mm512_fmadd_ps(part, _mm512_set1_ps(x->d[r * (K / QK_K) + s]), acc);
    }
    _mm512_storeu_ps(out + r * N + t * TILE_N, acc);
}

/* out [M, N] = x [M, K] @ dequant(W)^T, W Q6_K in the tile layout above; N a multiple of 16. */
int tern_matmul_q6_k_tiled(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *out) {
    if (K % QK_K || N % TILE_N) return -2;
    const int64_t nsb = K / QK_K, tiles = N / TILE_N;
    TernQ8KRows q;
    if (tern_q8k_rows(x, M, K, &q)) {
        tern_free_q8k_rows(&q);
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
        case 1: row(w, nsb, t, &q, r0, N, K, out); break;
        default: break;
        }
    }
    tern_free_q8k_rows(&q);
    return 0;
}
#elif !defined(TERN_KQ_TILED)
int tern_matmul_q6_k_tiled(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *out) {
    (void)x, (void)M, (void)K, (void)w, (void)N, (void)out;
    return -2; /* built with AVX2 and up only (kquant_tiled_avx2.c; ggml_kernels.tiled_isa()) */
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
            memset(out + LOW_OFFSET, 0, TILE_BYTES - LOW_OFFSET);
            for (int c = 0; c < 16; c++) {
                const uint8_t *sb = rows + c * row + s * 210;
                memcpy(out + 2 * c, sb + 208, 2);
                for (int h = 0; h < 16; h++) out[32 + 16 * h + c] = sb[192 + h];
                for (int h = 0; h < 16; h++)
                    for (int part = 0; part < 4; part++) /* elements 16h + 4 part + e */
                        for (int e = 0; e < 4; e++) {
                            const int code = gguf_code(sb, 16 * h + 4 * part + e);
                            out[LOW_OFFSET + 128 * h + 64 * (part >> 1) + 4 * c + e] |= (uint8_t)((code & 0x0F) << (4 * (part & 1)));
                            out[HIGH_OFFSET + 64 * h + 4 * c + e] |= (uint8_t)((code >> 4) << (2 * part));
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
                const int h = e / 16, part = (e % 16) / 4, at = 4 * (int)c + e % 4;
                const int low = (block[LOW_OFFSET + 128 * h + 64 * (part >> 1) + at] >> (4 * (part & 1))) & 0x0F;
                const int top = (block[HIGH_OFFSET + 64 * h + at] >> (2 * part)) & 3;
                const int8_t scale = (int8_t)block[32 + 16 * (e / 16) + c];
                out[r * nsb * QK_K + s * QK_K + e] = d * (float)scale * (float)((low | top << 4) - 32);
            }
        }
    }
}
