/* The ternary kernel's one activation row on AVX2 (ternary_kernels.c, whose layout and arithmetic this
 * is): a decode step at one stream, which is all weight and no reuse, so its cost is the instructions
 * that unpack and multiply a weight byte. Four weight rows (one group of the interleaved layout, read as
 * one stream) a pass, each block:
 *
 *   - a 32-byte load of a row's codes holds four codes a byte, of elements 32j + m (j = 0..3) of a half
 *     block; one shift by four and four masks give them, the masks 3 and 12 without a shift back:
 *     p & 3 = c0, p & 12 = 4 c1, (p >> 4) & 3 = c2, (p >> 4) & 12 = 4 c3 (two shifts and four masks
 *     fewer than shifting each code down);
 *   - vpmaddubsw of each by its 32 int8 activations, summed in int16 in two sums, the codes' own and
 *     four times theirs (unit: at most 4 * 2 * 2 * 128 = 2048 a lane; fours: 4 * 2 * 8 * 128 = 8192),
 *     then unit + (fours >> 2), exact (every term of fours is a multiple of 4), widened once by
 *     vpmaddwd;
 *   - the four rows' block dots in one vector (a transposing add tree, as the AVX-512 tile's, its first
 *     two levels in int16), less the block's activation sum (the codes' offset of one), then per lane
 *     the scalar path's float operations in its order: (float)dot * d and total + part, or the
 *     integer sum for row scales.
 *
 * 14 instructions for 128 multiply-adds (a load, a shift, four masks, four vpmaddubsw, four adds) and
 * about 23 a block for the tree and the scales: 0.136 instructions a multiply-add at 2048 x 8192 where
 * the 4-row tile's one-row form (two weight rows a pass, a horizontal sum per row and block) took 0.226
 * (callgrind, bench/engine/kquant_callgrind; docs/engine.md, "Ternary on AVX2"). The integers and the
 * float operations are the other paths', so the bits are theirs.
 */
#include <stdint.h>

#include "kernels.h"

#ifdef TERN_TQ2_ROW_AVX2
#define QKT 256
#define BLOCK_BYTES 64

/* The four rows' integer dot products with the activations of one block: wb is the group's block (four
 * rows' 64 bytes side by side), xb the block's 256 activation codes in natural order. */
static inline __attribute__((always_inline)) __m128i block_dots(const uint8_t *wb, const int8_t *xb) {
    const __m256i low = _mm256_set1_epi8(0x03), high = _mm256_set1_epi8(0x0C), ones = _mm256_set1_epi16(1);
    __m256i unit[4], fours[4];
    for (int j = 0; j < 4; j++) unit[j] = fours[j] = _mm256_setzero_si256();
    for (int half = 0; half < 2; half++) {
        const int8_t *xh = xb + 128 * half;
#define X(g) _mm256_loadu_si256((const __m256i *)(xh + 32 * (g)))
        for (int j = 0; j < 4; j++) {
            const __m256i p = _mm256_loadu_si256((const __m256i *)(wb + BLOCK_BYTES * j + 32 * half));
            const __m256i q = _mm256_srli_epi16(p, 4);
            unit[j] = _mm256_add_epi16(unit[j], _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(p, low), X(0)),
                                                                 _mm256_maddubs_epi16(_mm256_and_si256(q, low), X(2))));
            fours[j] = _mm256_add_epi16(fours[j], _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(p, high), X(1)),
                                                                   _mm256_maddubs_epi16(_mm256_and_si256(q, high), X(3))));
            /* each row's sums in registers before the next row's products (as ternary_kernels.c's tile):
             * unconstrained, GCC computes all 32 products of a block first and spills them */
            __asm__ volatile("" : "+x"(unit[j]), "+x"(fours[j]));
        }
#undef X
    }
    /* a row's lane is 16 products of at most 2 * 128: within [-4096, 4064], so two levels of pairwise
     * sums (4 lanes) stay exact in int16, before vpmaddwd widens the last pair */
    __m256i rows[4];
    for (int j = 0; j < 4; j++) rows[j] = _mm256_add_epi16(unit[j], _mm256_srai_epi16(fours[j], 2));
    const __m256i quads = _mm256_hadd_epi16(_mm256_hadd_epi16(rows[0], rows[1]), _mm256_hadd_epi16(rows[2], rows[3]));
    const __m256i wide = _mm256_madd_epi16(quads, ones); /* per 128-bit lane: the four rows' sums of 8 lanes */
    return _mm_add_epi32(_mm256_castsi256_si128(wide), _mm256_extracti128_si256(wide, 1));
}

/* One group of four weight rows (its codes group, block scales wd or row scales ws at the group's first)
 * against one activation row (codes xr, block sums, scale s), into o[0..3]. */
static inline __attribute__((always_inline)) void row_group(const uint8_t *group, const uint16_t *wd, const float *ws,
                                                            const int8_t *xr, const int32_t *sums, float s, int64_t nb,
                                                            float *o, const int BLOCKED) {
    __m128 totals = _mm_setzero_ps();
    __m128i dots = _mm_setzero_si128();
    for (int64_t b = 0; b < nb; b++) {
        const __m128i sum = _mm_broadcastd_epi32(_mm_cvtsi32_si128(sums[b]));
        const __m128i block = _mm_sub_epi32(block_dots(group + 4 * BLOCK_BYTES * b, xr + QKT * b), sum);
        if (BLOCKED) {
            const __m128 d = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(wd + 4 * b)));
            totals = _mm_add_ps(totals, _mm_mul_ps(_mm_cvtepi32_ps(block), d));
        } else {
            dots = _mm_add_epi32(dots, block);
        }
    }
    if (BLOCKED)
        _mm_storeu_ps(o, _mm_div_ps(totals, _mm_set1_ps(s)));
    else
        _mm_storeu_ps(o, _mm_mul_ps(_mm_div_ps(_mm_cvtepi32_ps(dots), _mm_set1_ps(s)), _mm_loadu_ps(ws)));
}

/* Activation row r of x against the weight rows of [n_begin, n_end) four at a time, as far as whole groups
 * go (n_begin a multiple of four, as the tiles start); the weights as tern_tq2_tiles takes them. Returns
 * the first row not done, for the caller's tile to finish. */
/* without tree reassociation, as ternary_kernels.c's tiles: GCC otherwise regroups the int16 adds */
__attribute__((optimize("no-tree-reassoc"))) int64_t tern_tq2_row_avx2(const TernInt8Rows *x, int64_t r, const uint8_t *qs, const float *ws, const uint16_t *wd,
                          int64_t n_begin, int64_t n_end, int64_t N, float *out) {
    const int64_t nb = x->nb;
    const int8_t *xr = x->qs + r * nb * QKT;
    const int32_t *sums = x->sums + r * nb;
    int64_t n = n_begin;
    if (n % 4) return n;
    for (; n + 4 <= n_end; n += 4) {
        const uint8_t *group = qs + n * nb * BLOCK_BYTES;
        if (wd)
            row_group(group, wd + n * nb, NULL, xr, sums, x->scale[r], nb, out + r * N + n, 1);
        else
            row_group(group, NULL, ws + n, xr, sums, x->scale[r], nb, out + r * N + n, 0);
    }
    return n;
}
#endif
