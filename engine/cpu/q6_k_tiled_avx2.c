/* Q6_K tile by tile on AVX2 (TERN_KQ_TILED_256, kernels.h): q6_k_tiled_kernels.c's layout and
 * arithmetic (described there) with 256-bit vectors, as kquant_tiled_avx2.c does Q4_K: a tile of 16
 * columns as two halves of 8, the 64 bytes of a scale's low or high bits in the layout being 16 columns x
 * 4 bytes, so a half's are its 32 bytes 32 H .. 32 H + 31, loaded as they are. Per row and scale (16
 * elements), the 6-bit codes q (0..63, unsigned) against the row's int8 Q8_K activations:
 *   AVX-VNNI:  four vpdpbusd into int32 lanes;
 *   AVX2:      four vpmaddubsw into int16 pairs (at most 2 * 63 * 127), two summed in int16 (32004 <
 *              2^15), each sum widened by vpmaddwd against ones.
 * Both are the exact integer dot product, so the float operations after it are the AVX-512 kernel's, in
 * its order (and the -32 comes off once a super-block in integers, the columns' scales in pairs against
 * the row's 16-sums, vpmaddwd as vpdpwssd there): the same bits, independent of the batch and threads.
 * One row (row16, a decode step) takes both halves a pass, two scales a pass: the same integers and
 * float operations, with each code's product taken as it is unpacked and the scale rows read once for
 * both halves' -32; callgrind at 1 x 2048 x 8192, AVX2 (bench/engine/kquant_callgrind/run.sh): 0.358
 * -> 0.340 instructions a multiply-add, 79 a scale of 256 products in the loop (docs/engine.md).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#ifdef TERN_KQ_TILED_256
#define QK_K 256
#define TILE_N 16
#define HALF_N 8
#define TILE_BYTES 3360
#define LOW_OFFSET 288
#define HIGH_OFFSET 2336

static inline __m256i quad(const int8_t *bytes) {
    int32_t four;
    memcpy(&four, bytes, sizeof four);
    return _mm256_set1_epi32(four);
}

/* The integer dot product of a scale's 16 elements of 8 columns (q[p]: elements 4p .. 4p + 3) with a
 * row's 16 activations, each 4 of them broadcast (xq[p]). */
static inline __attribute__((always_inline)) __m256i dot16(const __m256i *q, const __m256i *xq) {
#ifdef TERN_VNNI_256
    __m256i even = tern_dpbusd256(_mm256_setzero_si256(), q[0], xq[0]);
    __m256i odd = tern_dpbusd256(_mm256_setzero_si256(), q[1], xq[1]);
    even = tern_dpbusd256(even, q[2], xq[2]);
    odd = tern_dpbusd256(odd, q[3], xq[3]);
    return _mm256_add_epi32(even, odd);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i first = _mm256_add_epi16(_mm256_maddubs_epi16(q[0], xq[0]), _mm256_maddubs_epi16(q[1], xq[1]));
    const __m256i second = _mm256_add_epi16(_mm256_maddubs_epi16(q[2], xq[2]), _mm256_maddubs_epi16(q[3], xq[3]));
    return _mm256_add_epi32(_mm256_madd_epi16(first, ones), _mm256_madd_epi16(second, ones));
#endif
}

/* A row's 16 activations from xs, each 4 broadcast. */
static inline __attribute__((always_inline)) void broadcast16(const int8_t *xs, __m256i *xq) {
    for (int p = 0; p < 4; p++) xq[p] = quad(xs + 4 * p);
}

/* The 6-bit codes of scale h (elements 16h .. 16h + 15) of half H's 8 columns: q[p] elements 4p .. 4p + 3. */
static inline __attribute__((always_inline)) void codes(const uint8_t *block, int h, const int H, __m256i *q) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)(block + LOW_OFFSET + 128 * h + 32 * H));
    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(block + LOW_OFFSET + 128 * h + 64 + 32 * H));
    const __m256i hi = _mm256_loadu_si256((const __m256i *)(block + HIGH_OFFSET + 64 * h + 32 * H));
    q[0] = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_and_si256(_mm256_slli_epi16(hi, 4), top2));
    q[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(_mm256_slli_epi16(hi, 2), top2));
    q[2] = _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_and_si256(hi, top2));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4), _mm256_and_si256(_mm256_srli_epi16(hi, 2), top2));
}

/* Scale h of half H's 8 columns, d * sc_h, as floats. */
static inline __attribute__((always_inline)) __m256 scale(const uint8_t *block, __m256 d, int h, const int H) {
    const __m128i sc = _mm_loadl_epi64((const __m128i *)(block + 32 + 16 * h + HALF_N * H));
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
}

/* Half H's 8 columns' scales 2p and 2p + 1 paired in a lane (p = 0 .. 7), for vpmaddwd. */
static inline __attribute__((always_inline)) void paired_scales(const uint8_t *block, const int H, __m256i *paired) {
    for (int p = 0; p < 8; p++) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(block + 32 + 32 * p));
        const __m128i b = _mm_loadu_si128((const __m128i *)(block + 48 + 32 * p));
        paired[p] = _mm256_cvtepi8_epi16(H ? _mm_unpackhi_epi8(a, b) : _mm_unpacklo_epi8(a, b));
    }
}

/* A super-block's end for a row: the -32 off, once, in integers (the columns' paired scales against the
 * row's 16-sums, vpmaddwd as vpdpwssd there), then the row's scale. */
static inline __attribute__((always_inline)) __m256 close_block(const __m256i *paired, __m256 d, const int16_t *sums,
                                                                float xd, __m256 part, __m256 acc) {
    __m256i offset = _mm256_madd_epi16(paired[0], quad((const int8_t *)sums));
    for (int p = 1; p < 8; p++) offset = _mm256_add_epi32(offset, _mm256_madd_epi16(paired[p], quad((const int8_t *)(sums + 2 * p))));
    part = _mm256_fnmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(32.0f)), _mm256_cvtepi32_ps(offset), part);
    return _mm256_fmadd_ps(part, _mm256_set1_ps(xd), acc);
}

/* RR rows of x from r0 against half H of tile t (columns 16 t + 8 H ..): q6_k_tiled_kernels.c's tile. */
static inline __attribute__((always_inline)) void tile(const uint8_t *w, int64_t nsb, int64_t t, const TernQ8KRows *x,
                                                       int64_t r0, int64_t N, int64_t K, float *out, const int RR,
                                                       const int H) {
    __m256 acc[4];
    for (int i = 0; i < RR; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *block = w + (t * nsb + s) * TILE_BYTES;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 16 * H)));
        __m256 part[4];
        for (int i = 0; i < RR; i++) part[i] = _mm256_setzero_ps();
#pragma GCC unroll 2
        for (int h = 0; h < 16; h++) { /* elements 16h .. 16h + 15: scale h */
            for (int line = 0; line < 256 && H == 0; line += 64) /* the first half's pass streams the tile */
                _mm_prefetch((const char *)block + 2 * TILE_BYTES + 210 * h + line, _MM_HINT_T0);
            const __m256 sc = scale(block, d, h, H);
            __m256i q[4], xq[4];
            codes(block, h, H, q);
            for (int i = 0; i < RR; i++) {
                broadcast16(x->qs + (r0 + i) * K + s * QK_K + 16 * h, xq);
                part[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot16(q, xq)), sc, part[i]);
            }
        }
        __m256i paired[8];
        paired_scales(block, H, paired);
        for (int i = 0; i < RR; i++)
            acc[i] = close_block(paired, d, x->sums + (r0 + i) * (K / 16) + s * 16, x->d[(r0 + i) * (K / QK_K) + s],
                                 part[i], acc[i]);
    }
    for (int i = 0; i < RR; i++) _mm256_storeu_ps(out + (r0 + i) * N + t * TILE_N + HALF_N * H, acc[i]);
}

/* Half H of scale h's codes (8 columns x 16 elements) against the row's broadcast activations xq: the
 * exact integer dot product, dot16's; without VNNI each code's product taken as soon as it is unpacked
 * and the high bits loaded once (unconstrained, GCC reloaded them for each use: 83 instructions a
 * scale against 79, callgrind's loop). */
static inline __attribute__((always_inline)) __m256i half_dot(const uint8_t *block, int h, const int H, const __m256i *xq) {
#ifdef TERN_VNNI_256
    __m256i q[4];
    codes(block, h, H, q);
    return dot16(q, xq);
#else
    const __m256i low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
    const uint8_t *low = block + LOW_OFFSET + 128 * h + 32 * H;
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)low), l1 = _mm256_loadu_si256((const __m256i *)(low + 64));
    __m256i hi = _mm256_loadu_si256((const __m256i *)(block + HIGH_OFFSET + 64 * h + 32 * H));
    __asm__("" : "+x"(hi));
    /* two codes' products summed in int16 (at most 2 * 2 * 63 * 127 = 32004 < 2^15), as dot16 */
    const __m256i q0 = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_and_si256(_mm256_slli_epi16(hi, 4), top2));
    const __m256i q1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(_mm256_slli_epi16(hi, 2), top2));
    const __m256i first = _mm256_add_epi16(_mm256_maddubs_epi16(q0, xq[0]), _mm256_maddubs_epi16(q1, xq[1]));
    const __m256i q2 = _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_and_si256(hi, top2));
    const __m256i q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4), _mm256_and_si256(_mm256_srli_epi16(hi, 2), top2));
    const __m256i second = _mm256_add_epi16(_mm256_maddubs_epi16(q2, xq[2]), _mm256_maddubs_epi16(q3, xq[3]));
    const __m256i ones = _mm256_set1_epi16(1);
    return _mm256_add_epi32(_mm256_madd_epi16(first, ones), _mm256_madd_epi16(second, ones));
#endif
}

/* Both halves' -32 at a super-block's end for a row (close_block's, in its order): each pair of scale
 * rows read once for the two halves, the row's pair of 16-sums broadcast once. */
static inline __attribute__((always_inline)) void close_both(const uint8_t *block, __m256 d0, __m256 d1, const int16_t *sums,
                                                             float xd, __m256 *part0, __m256 *part1, __m256 *acc0,
                                                             __m256 *acc1) {
    __m256i offset0 = _mm256_setzero_si256(), offset1 = _mm256_setzero_si256();
    for (int p = 0; p < 8; p++) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(block + 32 + 32 * p));
        const __m128i b = _mm_loadu_si128((const __m128i *)(block + 48 + 32 * p));
        const __m256i pair = quad((const int8_t *)(sums + 2 * p));
        offset0 = _mm256_add_epi32(offset0, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, b)), pair));
        offset1 = _mm256_add_epi32(offset1, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_unpackhi_epi8(a, b)), pair));
    }
    const __m256 thirty_two = _mm256_set1_ps(32.0f), x = _mm256_set1_ps(xd);
    *part0 = _mm256_fnmadd_ps(_mm256_mul_ps(d0, thirty_two), _mm256_cvtepi32_ps(offset0), *part0);
    *part1 = _mm256_fnmadd_ps(_mm256_mul_ps(d1, thirty_two), _mm256_cvtepi32_ps(offset1), *part1);
    *acc0 = _mm256_fmadd_ps(*part0, x, *acc0);
    *acc1 = _mm256_fmadd_ps(*part1, x, *acc1);
}

/* Row r of x against both halves of tile t in one pass (a decode step's one row): the row's
 * activations broadcast once for 16 columns, the tile read once, the loop run once, two scales a pass
 * (7 prefetches a 420 bytes, not 8); each half's integer dot products are the tile's above, exact, and
 * its float operations the tile's, in its order (callgrind: docs/engine.md, "GGUF types"). */
static inline __attribute__((always_inline)) void row16(const uint8_t *w, int64_t nsb, int64_t t, const TernQ8KRows *x,
                                                        int64_t r, int64_t N, int64_t K, float *out) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *block = w + (t * nsb + s) * TILE_BYTES;
        const int8_t *xs = x->qs + r * K + s * QK_K;
        const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)block));
        const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 16)));
        __m256 part0 = _mm256_setzero_ps(), part1 = _mm256_setzero_ps();
        for (int h = 0; h < 16; h += 2) { /* two scales a pass: their 420 bytes, two super-blocks ahead */
            for (int line = 0; line < 448; line += 64)
                _mm_prefetch((const char *)block + 2 * TILE_BYTES + 210 * h + line, _MM_HINT_T0);
            for (int g = h; g < h + 2; g++) {
                __m256i xq[4];
                broadcast16(xs + 16 * g, xq);
                part0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(half_dot(block, g, 0, xq)), scale(block, d0, g, 0), part0);
                part1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(half_dot(block, g, 1, xq)), scale(block, d1, g, 1), part1);
            }
        }
        close_both(block, d0, d1, x->sums + r * (K / 16) + s * 16, x->d[r * (K / QK_K) + s], &part0, &part1, &acc0, &acc1);
    }
    _mm256_storeu_ps(out + r * N + t * TILE_N, acc0);
    _mm256_storeu_ps(out + r * N + t * TILE_N + HALF_N, acc1);
}

#define HALVES(RR)                                  \
    do {                                            \
        tile(w, nsb, t, &q, r0, N, K, out, RR, 0);  \
        tile(w, nsb, t, &q, r0, N, K, out, RR, 1);  \
    } while (0)

/* out [M, N] = x [M, K] @ dequant(W)^T, W Q6_K in q6_k_tiled_kernels.c's tile layout; N a multiple of 16. */
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
        for (; r0 + 4 <= M; r0 += 4) HALVES(4);
        switch (M - r0) {
        case 3: HALVES(3); break;
        case 2: HALVES(2); break;
        case 1: row16(w, nsb, t, &q, r0, N, K, out); break;
        default: break;
        }
    }
    tern_free_q8k_rows(&q);
    return 0;
}
#endif
