/* Q4_K and Q5_K tile by tile on AVX2 (TERN_KQ_TILED_256, kernels.h): the AVX-512 VNNI tiles' weight
 * layout and arithmetic (kquant_tiled_kernels.c, where the layout is described) with 256-bit vectors,
 * for CPUs without AVX-512 VNNI (AMD Zen 2 and 3, Intel client parts): without them every row ran the
 * row-by-row kernel (kquant_kernels.c, int16 rows, half the products an instruction and each column's
 * codes and scales unpacked on their own), slower than llama.cpp on those CPUs (issue 54).
 *
 * A tile of 16 columns runs as two halves of 8 (a 32-byte chunk's bytes 0..15, then 16..31), each
 * against up to 4 rows of the int8 Q8_K activations (q8k_rows.c). A chunk's 16 bytes are widened to one
 * 16-bit pair a lane and unpacked to a column's elements 4k .. 4k + 3 in bytes, as there; then per row
 *   AVX-VNNI:  vpdpbusd (unsigned codes x the row's 4 int8 activations, broadcast) into int32 lanes;
 *   AVX2:      vpmaddubsw into int16 pairs (at most 2 * 31 * 127, no saturation), summed in int16 over
 *              a sub-block's 8 chunks (Q4_K: 8 * 2 * 15 * 127 < 2^15) or 4 (Q5_K: 4 * 2 * 31 * 127),
 *              then vpmaddwd by ones into int32.
 * Both are the sub-block's exact integer dot product, so every float operation after it (scale d * sc_j
 * and one FMA a sub-block, the mins in integers once a super-block, one FMA by dmin and one by the row's
 * block scale) is the AVX-512 kernel's, in its order: the three ISAs give the same bits, and a row's
 * result does not depend on the batch or the thread count.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#ifdef TERN_KQ_TILED_256
#define QK_K 256
#define TILE_N 16
#define HALF_N 8
#define Q4_TILE_BYTES 2304
#define Q5_TILE_BYTES 2816

static inline __m256i quad(const int8_t *bytes) {
    int32_t four;
    memcpy(&four, bytes, sizeof four);
    return _mm256_set1_epi32(four);
}

/* The 16 columns' scale (sc) and min (m) of sub-block j from the byte-major packed bytes (ggml's
 * get_scale_min_k4, 16 columns at a time; kquant_tiled_kernels.c's), loaded where they are needed: the
 * 12 vectors kept in registers left too few for the products (the one-row kernel spilled its sums). */
static inline __attribute__((always_inline)) void scale_min(const uint8_t *packed, int j, __m128i *sc, __m128i *m) {
    const __m128i low6 = _mm_set1_epi8(0x3F), low4 = _mm_set1_epi8(0x0F), low2 = _mm_set1_epi8(0x03);
#define PACKED(b) _mm_loadu_si128((const __m128i *)(packed + 16 * (b)))
    if (j < 4) {
        *sc = _mm_and_si128(PACKED(j), low6);
        *m = _mm_and_si128(PACKED(j + 4), low6);
    } else {
        const __m128i top_sc = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(PACKED(j - 4), 6), low2), 4);
        const __m128i top_m = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(PACKED(j), 6), low2), 4);
        *sc = _mm_or_si128(_mm_and_si128(PACKED(j + 4), low4), top_sc);
        *m = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(PACKED(j + 4), 4), low4), top_m);
    }
#undef PACKED
}

#ifdef TERN_VNNI_256
#define TERN_VNNI_GROUP(group) ((void)(group), 8) /* vpdpbusd sums in int32: a sub-block's 8 chunks at once */
#else
#define TERN_VNNI_GROUP(group) (group)
#endif

/* The 8 bytes of half H of 16 columns' bytes, widened to int32. */
static inline __m256i half_bytes(__m128i bytes, const int H) { return _mm256_cvtepu8_epi32(H ? _mm_srli_si128(bytes, 8) : bytes); }

/* Chunk k of sub-block j of half H: its 8 columns' elements 4k .. 4k + 3 in bytes (Q5: with the fifth bits). */
static inline __attribute__((always_inline)) __m256i chunk_codes(const uint8_t *block, int j, int k, const int H, const int Q5) {
    const __m256i pair = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(block + 256 + 256 * j + 32 * k + 16 * H)));
    __m256i v = _mm256_and_si256(_mm256_or_si256(pair, _mm256_slli_epi32(pair, 12)), _mm256_set1_epi8(0x0F));
    if (Q5) {
        const __m256i bits = _mm256_cvtepu16_epi32(
            _mm_loadu_si128((const __m128i *)(block + Q4_TILE_BYTES + 64 * j + 32 * (k >> 2) + 16 * H)));
        const __m256i lowers = _mm256_srli_epi32(_mm256_slli_epi32(bits, 4), 2 * (k & 3));
        const __m256i uppers = _mm256_slli_epi32(bits, 19 - 2 * (k & 3));
        v = _mm256_or_si256(v, _mm256_and_si256(_mm256_or_si256(lowers, uppers), _mm256_set1_epi8(0x10)));
    }
    return v;
}

/* RR rows of x from r0 against half H of tile t (columns 16 t + 8 H ..): kquant_tiled_kernels.c's tile. */
static inline __attribute__((always_inline)) void tile(const uint8_t *w, int64_t nsb, int64_t t, const TernQ8KRows *x,
                                                       int64_t r0, int64_t N, int64_t K, float *out, const int RR,
                                                       const int H, const int Q5) {
    const int64_t TILE_BYTES = Q5 ? Q5_TILE_BYTES : Q4_TILE_BYTES;
    __m256 acc[4];
    for (int i = 0; i < RR; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *block = w + (t * nsb + s) * TILE_BYTES;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 16 * H)));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 32 + 16 * H)));
        const uint8_t *q = block + 64; /* the packed scales and mins */
        __m256i mins[4]; /* the 8 columns' m_j of two sub-blocks paired in a lane, for vpmaddwd */
        for (int p = 0; p < 4; p++) {
            __m128i sc, m0, m1;
            scale_min(q, 2 * p, &sc, &m0);
            scale_min(q, 2 * p + 1, &sc, &m1);
            mins[p] = _mm256_or_si256(half_bytes(m0, H), _mm256_slli_epi32(half_bytes(m1, H), 16));
        }
        __m256 part[4];
        for (int i = 0; i < RR; i++) part[i] = _mm256_setzero_ps();
        for (int j = 0; j < 8; j++) {
            /* the first half's pass streams the tile from memory (the second reads it from cache) */
            for (int line = 0; line < TILE_BYTES / 8 + 64 && H == 0; line += 64)
                _mm_prefetch((const char *)block + 2 * TILE_BYTES + TILE_BYTES / 8 * j + line, _MM_HINT_T0);
            __m128i sc, m;
            scale_min(q, j, &sc, &m);
            const __m256 scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(half_bytes(sc, H)));
            /* a group's codes first, then each row's products against them: one row's sums live at a
             * time, not every row's (AVX2's 16 registers) */
            const int group = TERN_VNNI_GROUP(Q5 ? 4 : 8); /* chunks whose int16 pair sums cannot overflow */
            __m256i dots[4];
            for (int g = 0; g < 8; g += group) {
                __m256i v[8];
                for (int k = 0; k < group && RR > 1; k++) v[k] = chunk_codes(block, j, g + k, H, Q5);
                for (int k = 0; k < group && RR == 1; k++) {
                    /* one row: each chunk's codes in a register as unpacked; unconstrained, GCC schedules
                     * the group's unpacking apart from its products and spills (callgrind at 1 x 2048 x
                     * 2048: 0.406 instructions a multiply-add against 0.387, Q4_K) */
                    v[k] = chunk_codes(block, j, g + k, H, Q5);
                    __asm__ volatile("" : "+x"(v[k]));
                }
                for (int i = 0; i < RR; i++) {
                    const int8_t *xs = x->qs + (r0 + i) * K + s * QK_K + 32 * j + 4 * g;
#ifdef TERN_VNNI_256
                    __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256(); /* two chains */
                    for (int k = 0; k < 8; k += 2) {
                        even = tern_dpbusd256(even, v[k], quad(xs + 4 * k));
                        odd = tern_dpbusd256(odd, v[k + 1], quad(xs + 4 * k + 4));
                    }
                    dots[i] = _mm256_add_epi32(even, odd);
#else
                    __m256i pairs = _mm256_maddubs_epi16(v[0], quad(xs));
                    for (int k = 1; k < group; k++) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(v[k], quad(xs + 4 * k)));
                    const __m256i wide = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
                    dots[i] = g == 0 ? wide : _mm256_add_epi32(dots[i], wide);
#endif
                }
            }
            for (int i = 0; i < RR; i++) part[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[i]), scale, part[i]);
        }
        for (int i = 0; i < RR; i++) {
            const int16_t *sums = x->sums32 + (r0 + i) * (K / 32) + s * 8;
            __m256i min = _mm256_madd_epi16(mins[0], quad((const int8_t *)sums));
            for (int p = 1; p < 4; p++) min = _mm256_add_epi32(min, _mm256_madd_epi16(mins[p], quad((const int8_t *)(sums + 2 * p))));
            part[i] = _mm256_fnmadd_ps(dmin, _mm256_cvtepi32_ps(min), part[i]);
            acc[i] = _mm256_fmadd_ps(part[i], _mm256_set1_ps(x->d[(r0 + i) * (K / QK_K) + s]), acc[i]);
        }
    }
    for (int i = 0; i < RR; i++) _mm256_storeu_ps(out + (r0 + i) * N + t * TILE_N + HALF_N * H, acc[i]);
}

#ifndef TERN_VNNI_256
/* One row (a decode step: every weight read once, for one row's products) takes all 16 columns of a
 * tile in one pass, a column's int16 lane holding a chunk's byte pair as it is stored (elements 4k,
 * 4k + 1 in the low nibbles, 4k + 2, 4k + 3 in the high): no widening, one and and one shift a 64 codes
 * (not two halves' widen, shift, or, and a 32), the row's pair broadcast once for 16 columns, and the
 * tile read once (not once a half). The low and the high nibbles' products sum in two int16 vectors
 * (Q4_K: 8 chunks, 8 * 2 * 15 * 127 < 2^15; Q5_K: 4, 4 * 2 * 31 * 127), interleaved and widened by
 * vpmaddwd against ones: the same exact integer a sub-block and column as the tile above, so the same
 * float operations in the same order, in lanes ordered A = columns 0-3, 8-11 and B = 4-7, 12-15 (what
 * the interleave gives). callgrind at 1 x 2048 x 2048: docs/engine.md, "GGUF types". */
static inline __m256i pair(const int8_t *bytes) {
    int16_t two;
    memcpy(&two, bytes, sizeof two);
    return _mm256_set1_epi16(two);
}

/* A register's bit `from` of each byte moved to bit 4 (the fifth bit of a Q5_K code), the rest cleared. */
static inline __attribute__((always_inline)) __m256i fifth_bit(__m256i bits, const int from) {
    const __m256i v = from < 4 ? _mm256_slli_epi16(bits, 4 - from) : _mm256_srli_epi16(bits, from - 4);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

/* The 16 columns' bytes picked by `order` (A or B lanes) from 16 bytes, as int32: vpshufb's index of
 * byte b in an int32 lane's low byte, its other three bytes cleared (an index's top bit set). */
#define BYTE(b) ((int)(0xFFFFFF00u | (b)))
static inline __m256i lanes(__m128i bytes, __m256i order) {
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(bytes), order);
}

/* Sub-block j of the tile's super-block `block` against the row's 32 activations xs: the exact dot
 * products of the 16 columns, in A and B lanes. */
static inline __attribute__((always_inline)) void subblock16(const uint8_t *block, int j, const int8_t *xs,
                                                             __m256i *dot_a, __m256i *dot_b, const int Q5) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const int group = Q5 ? 4 : 8;
    *dot_a = *dot_b = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int g = 0; g < 8; g += group) {
        __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
        const __m256i bits = Q5 ? _mm256_loadu_si256((const __m256i *)(block + Q4_TILE_BYTES + 64 * j + 32 * (g >> 2)))
                                : _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int k = g; k < g + group; k++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(block + 256 + 256 * j + 32 * k));
            __m256i cl = _mm256_and_si256(raw, low4), ch = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            if (Q5) {
                cl = _mm256_or_si256(cl, fifth_bit(bits, 2 * (k & 3)));
                ch = _mm256_or_si256(ch, fifth_bit(bits, 2 * (k & 3) + 1));
            }
            /* saturating adds that never saturate (the bounds above): GCC does not reassociate them, where it
             * made a tree of a group's plain adds and spilled the products waiting for it */
            lo = _mm256_adds_epi16(lo, _mm256_maddubs_epi16(cl, pair(xs + 4 * k)));
            hi = _mm256_adds_epi16(hi, _mm256_maddubs_epi16(ch, pair(xs + 4 * k + 2)));
        }
        *dot_a = _mm256_add_epi32(*dot_a, _mm256_madd_epi16(_mm256_unpacklo_epi16(lo, hi), ones));
        *dot_b = _mm256_add_epi32(*dot_b, _mm256_madd_epi16(_mm256_unpackhi_epi16(lo, hi), ones));
    }
}

/* The 16 columns' mins of sub-blocks 2p and 2p + 1 paired in an int32 lane (A or B order), for vpmaddwd. */
static inline __attribute__((always_inline)) void mins16(const uint8_t *q, int p, __m256i *a, __m256i *b) {
    __m128i sc, m0, m1;
    scale_min(q, 2 * p, &sc, &m0);
    scale_min(q, 2 * p + 1, &sc, &m1);
    const __m256i first = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m0, m1)); /* columns 0-7 */
    const __m256i second = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(m0, m1)); /* 8-15 */
    *a = _mm256_permute2x128_si256(first, second, 0x20);
    *b = _mm256_permute2x128_si256(first, second, 0x31);
}

/* Row r of x against the 16 columns of tile t. */
static inline __attribute__((always_inline)) void row16(const uint8_t *w, int64_t nsb, int64_t t, const TernQ8KRows *x,
                                                        int64_t r, int64_t N, int64_t K, float *out, const int Q5) {
    const int64_t TILE_BYTES = Q5 ? Q5_TILE_BYTES : Q4_TILE_BYTES;
    const __m256i order_a = _mm256_setr_epi32(BYTE(0), BYTE(1), BYTE(2), BYTE(3), BYTE(8), BYTE(9), BYTE(10), BYTE(11));
    const __m256i order_b = _mm256_setr_epi32(BYTE(4), BYTE(5), BYTE(6), BYTE(7), BYTE(12), BYTE(13), BYTE(14), BYTE(15));
    __m256 acc_a = _mm256_setzero_ps(), acc_b = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *block = w + (t * nsb + s) * TILE_BYTES;
        const int8_t *xs = x->qs + r * K + s * QK_K;
        const __m128i d0 = _mm_loadu_si128((const __m128i *)block), d1 = _mm_loadu_si128((const __m128i *)(block + 16));
        const __m256 d_a = _mm256_cvtph_ps(_mm_unpacklo_epi64(d0, d1)), d_b = _mm256_cvtph_ps(_mm_unpackhi_epi64(d0, d1));
        const uint8_t *q = block + 64; /* the packed scales and mins */
        __m256 part_a = _mm256_setzero_ps(), part_b = _mm256_setzero_ps();
        for (int j = 0; j < 8; j++) {
            for (int line = 0; line < TILE_BYTES / 8; line += 64) /* an eighth of a tile: 4.5 (5.5) lines */
                _mm_prefetch((const char *)block + 2 * TILE_BYTES + TILE_BYTES / 8 * j + line, _MM_HINT_T0);
            __m256i dot_a, dot_b;
            subblock16(block, j, xs + 32 * j, &dot_a, &dot_b, Q5);
            __m128i sc, m;
            scale_min(q, j, &sc, &m);
            const __m256 scale_a = _mm256_mul_ps(d_a, _mm256_cvtepi32_ps(lanes(sc, order_a)));
            const __m256 scale_b = _mm256_mul_ps(d_b, _mm256_cvtepi32_ps(lanes(sc, order_b)));
            part_a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_a), scale_a, part_a);
            part_b = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_b), scale_b, part_b);
        }
        const int16_t *sums = x->sums32 + r * (K / 32) + s * 8;
        __m256i min_a = _mm256_setzero_si256(), min_b = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) {
            __m256i mins_a, mins_b;
            mins16(q, p, &mins_a, &mins_b);
            min_a = _mm256_add_epi32(min_a, _mm256_madd_epi16(mins_a, quad((const int8_t *)(sums + 2 * p))));
            min_b = _mm256_add_epi32(min_b, _mm256_madd_epi16(mins_b, quad((const int8_t *)(sums + 2 * p))));
        }
        const __m128i m0 = _mm_loadu_si128((const __m128i *)(block + 32)), m1 = _mm_loadu_si128((const __m128i *)(block + 48));
        const __m256 xd = _mm256_set1_ps(x->d[r * (K / QK_K) + s]);
        part_a = _mm256_fnmadd_ps(_mm256_cvtph_ps(_mm_unpacklo_epi64(m0, m1)), _mm256_cvtepi32_ps(min_a), part_a);
        part_b = _mm256_fnmadd_ps(_mm256_cvtph_ps(_mm_unpackhi_epi64(m0, m1)), _mm256_cvtepi32_ps(min_b), part_b);
        acc_a = _mm256_fmadd_ps(part_a, xd, acc_a);
        acc_b = _mm256_fmadd_ps(part_b, xd, acc_b);
    }
    _mm256_storeu_ps(out + r * N + t * TILE_N, _mm256_permute2f128_ps(acc_a, acc_b, 0x20));
    _mm256_storeu_ps(out + r * N + t * TILE_N + HALF_N, _mm256_permute2f128_ps(acc_a, acc_b, 0x31));
}
#define ONE_ROW(Q5) row16(w, nsb, t, &q, r0, N, K, out, Q5)
#else
#define ONE_ROW(Q5) HALVES(1, Q5) /* vpdpbusd sums a column's 4 bytes: the halves' layout */
#endif

/* Both halves of tile t against rows r0 .. r0 + RR (the rows' activations stay in cache between them). */
#define HALVES(RR, Q5)                                  \
    do {                                                \
        tile(w, nsb, t, &q, r0, N, K, out, RR, 0, Q5);  \
        tile(w, nsb, t, &q, r0, N, K, out, RR, 1, Q5);  \
    } while (0)

#define ROWS_LOOP(Q5)                                          \
    do {                                                       \
        int64_t r0 = 0;                                        \
        for (; r0 + 4 <= M; r0 += 4) HALVES(4, Q5);            \
        switch (M - r0) {                                      \
        case 3: HALVES(3, Q5); break;                          \
        case 2: HALVES(2, Q5); break;                          \
        case 1: ONE_ROW(Q5); break;                            \
        default: break;                                        \
        }                                                      \
    } while (0)

/* out [M, N] = x [M, K] @ dequant(W)^T, W Q4_K (q5 0) or Q5_K (q5 1) in kquant_tiled_kernels.c's tile
 * layout (ggml_kernels.tile); N a multiple of 16. 0, -1 (out of memory) or -2 (shapes). */
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
