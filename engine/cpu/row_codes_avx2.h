/* What the AVX2 int8 row quantizers share (q8k_rows.c: Q8_K, a scale a block of 256; q8_0_rows.c: Q8_0, a
 * scale a block of 32), both llama.cpp's absmax / 127 with round half to even:
 *   d = amax / 127,  q = clamp(round_half_even(x * (127 / amax)), -127, 127)  (0 where amax is 0).
 * A max is exact, cvtps rounds to even, and the int16 clamp and packs give the int32 clamp's values
 * (|q| <= 127 after it), so both keep the bytes of their plain references. */
#pragma once

#include <immintrin.h>
#include <stdint.h>

#ifdef __AVX2__

/* A block of n floats (n a multiple of 8): stores d = amax / 127, returns 127 / amax in every lane. */
static inline __m256 block_scale_avx2(const float *xb, int n, float *d) {
    __m256 amax = _mm256_setzero_ps();
    for (int e = 0; e < n; e += 8)
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_loadu_ps(xb + e)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    *d = m / 127.0f;
    return _mm256_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
}

/* 16 floats at x times inv: their codes stored as bytes at qs, returned as int16 lanes in order. */
static inline __m256i codes16_avx2(const float *x, __m256 inv, int8_t *qs) {
    const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), inv));
    const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), inv));
    /* packs interleaves the 128-bit lanes: 0xD8 puts the 16 codes back in order */
    __m256i q = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8);
    q = _mm256_min_epi16(_mm256_max_epi16(q, _mm256_set1_epi16(-127)), _mm256_set1_epi16(127));
    _mm_storeu_si128((__m128i *)qs, _mm_packs_epi16(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)));
    return q;
}

/* The sum of a vector's 8 int32 lanes. */
static inline int32_t sum8_epi32(__m256i v) {
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s4);
}
#endif
