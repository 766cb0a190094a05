/* Rows of activations quantized to int16 for the quantized matmuls (quant_kernels.c, kquant_kernels.c):
 * one float scale a row, 15 bits against its largest value (llama.cpp's int8 blocks lose enough to flip
 * near-tied greedy tokens). Plain-torch reference: engine/cpu/kernels.py `quantize_rows_ref`. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "quant_rows.h"

#define QMAX 32767.0f

/* x [K] -> qs [K] int16 with one scale for the row, d (the scale) and s [K/32] (d * the sum of
 * each block's codes). One scale per row, not per block: it can then be applied once, after the
 * sum over blocks, which saves a multiply per block, row and column; at 15 bits it is still finer
 * than the bf16 rounding of torch's kernels. */
static void quantize_row(const float *x, int64_t K, int16_t *qs, float *d, float *s) {
    float amax = 0.0f;
    int64_t k = 0;
#ifdef __AVX2__ /* the same values as the scalar loops below (a max is exact; cvtps rounds to even) */
    __m256 vmax = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_loadu_ps(x + k)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#endif
    for (; k < K; k++) amax = fmaxf(amax, fabsf(x[k]));
    const float scale = amax / QMAX;
    const float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    for (int64_t b = 0; b < K / QK; b++) {
        int sum = 0;
#ifdef __AVX2__
        __m256i sums = _mm256_setzero_si256();
        for (int j = 0; j < QK; j += 8) {
            const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + b * QK + j), _mm256_set1_ps(inv)));
            sums = _mm256_add_epi32(sums, q);
            const __m128i packed = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
            _mm_storeu_si128((__m128i *)(qs + b * QK + j), packed);
        }
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
        sum = _mm_cvtsi128_si32(s4);
#else
        for (int j = 0; j < QK; j++) {
            const int q = (int)nearbyintf(x[b * QK + j] * inv);
            qs[b * QK + j] = (int16_t)q;
            sum += q;
        }
#endif
        s[b] = scale * (float)sum;
    }
    *d = scale;
}

int tern_rows_quantize(const float *x, int64_t M, int64_t K, QuantizedRows *q) {
    const int64_t nb = K / QK;
    q->qs = (int16_t *)malloc((size_t)(M * K) * sizeof(int16_t));
    q->d = (float *)malloc((size_t)M * sizeof(float));
    q->s = (float *)malloc((size_t)(M * nb) * sizeof(float));
    if (!q->qs || !q->d || !q->s) return -1;
#pragma omp parallel for schedule(static) if (M >= 4)
    for (int64_t r = 0; r < M; r++) quantize_row(x + r * K, K, q->qs + r * K, q->d + r, q->s + r * nb);
    return 0;
}

void tern_rows_free(QuantizedRows *q) {
    free(q->qs);
    free(q->d);
    free(q->s);
}

void tern_quantize_rows(const float *x, int64_t M, int64_t K, int16_t *qs, float *d, float *s) {
    const int64_t nb = K / QK;
    for (int64_t r = 0; r < M; r++) quantize_row(x + r * K, K, qs + r * K, d + r, s + r * nb);
}
