/* Rows of x as the K-quant tiles take them (kernels.h, TernQ8KRows): llama.cpp's Q8_K, int8 codes with
 * one scale a block of 256 (a super-block's elements), absmax / 127:
 *   d = amax / 127,  q = clamp(round_half_even(x * (127 / amax)), -127, 127)  (0 where amax is 0)
 * with each 16 and each 32 codes' exact sums. One multiply and one rounding an element, an exact max and
 * integer sums: the bytes of the plain reference (ggml_kernels.quantize_rows_q8k_ref) with AVX-512
 * (kquant_tiled_kernels.c, q6_k_tiled_kernels.c) and with AVX2 (kquant_tiled_avx2.c) alike.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "row_codes_avx2.h"

#define QK_K 256

#if defined(TERN_Q4_TILED)
static void q8k_row(const float *x, int64_t K, int8_t *qs, float *d, int16_t *sums, int16_t *sums32) {
    for (int64_t b = 0; b < K / QK_K; b++) {
        const float *xb = x + b * QK_K;
        __m512 amax = _mm512_setzero_ps();
        for (int e = 0; e < QK_K; e += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(xb + e)));
        const float m = _mm512_reduce_max_ps(amax);
        d[b] = m / 127.0f;
        const __m512 inv = _mm512_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
        for (int e = 0; e < QK_K; e += 16) {
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + e), inv));
            q = _mm512_min_epi32(_mm512_max_epi32(q, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
            _mm_storeu_si128((__m128i *)(qs + b * QK_K + e), _mm512_cvtepi32_epi8(q));
            sums[(b * QK_K + e) / 16] = (int16_t)_mm512_reduce_add_epi32(q);
        }
        for (int g = 0; g < QK_K / 32; g++) sums32[b * 8 + g] = (int16_t)(sums[b * 16 + 2 * g] + sums[b * 16 + 2 * g + 1]);
    }
}
#elif defined(TERN_KQ_TILED)
/* The same with 8 floats a vector (row_codes_avx2.h). */
static void q8k_row(const float *x, int64_t K, int8_t *qs, float *d, int16_t *sums, int16_t *sums32) {
    for (int64_t b = 0; b < K / QK_K; b++) {
        const float *xb = x + b * QK_K;
        const __m256 inv = block_scale_avx2(xb, QK_K, d + b);
        for (int e = 0; e < QK_K; e += 16) {
            const __m256i q = codes16_avx2(xb + e, inv, qs + b * QK_K + e);
            sums[(b * QK_K + e) / 16] = (int16_t)sum8_epi32(_mm256_madd_epi16(q, _mm256_set1_epi16(1)));
        }
        for (int g = 0; g < QK_K / 32; g++) sums32[b * 8 + g] = (int16_t)(sums[b * 16 + 2 * g] + sums[b * 16 + 2 * g + 1]);
    }
}
#endif

#ifdef TERN_KQ_TILED
int tern_q8k_rows(const float *x, int64_t M, int64_t K, TernQ8KRows *q) {
    q->qs = (int8_t *)malloc((size_t)(M * K));
    q->d = (float *)malloc((size_t)(M * (K / QK_K)) * sizeof(float));
    q->sums = (int16_t *)malloc((size_t)(M * (K / 16)) * sizeof(int16_t));
    q->sums32 = (int16_t *)malloc((size_t)(M * (K / 32)) * sizeof(int16_t));
    if (!q->qs || !q->d || !q->sums || !q->sums32) return -1;
#pragma omp parallel for schedule(static) if (M >= 4)
    for (int64_t r = 0; r < M; r++)
        q8k_row(x + r * K, K, q->qs + r * K, q->d + r * (K / QK_K), q->sums + r * (K / 16), q->sums32 + r * (K / 32));
    return 0;
}

void tern_free_q8k_rows(TernQ8KRows *q) { free(q->qs), free(q->d), free(q->sums), free(q->sums32); }

/* The quantizer alone, for the reference test: qs [M, K], d [M, K/256], sums [M, K/16]. */
void tern_quantize_rows_q8k(const float *x, int64_t M, int64_t K, int8_t *qs, float *d, int16_t *sums) {
    for (int64_t r = 0; r < M; r++) {
        int16_t sums32[K / 32 > 0 ? K / 32 : 1];
        q8k_row(x + r * K, K, qs + r * K, d + r * (K / QK_K), sums + r * (K / 16), sums32);
    }
}
#else
void tern_quantize_rows_q8k(const float *x, int64_t M, int64_t K, int8_t *qs, float *d, int16_t *sums) {
    (void)x, (void)M, (void)K, (void)qs, (void)d, (void)sums; /* the tiles' quantizer: AVX2 builds and up only */
}
#endif

/* Which K-quant tiles this build runs (ggml_kernels.tiled_isa): 0 none (the row-by-row kernels,
 * kquant_kernels.c), 1 AVX2 (vpmaddubsw + vpmaddwd), 2 256-bit VNNI (AVX-VNNI's vpdpbusd), 3 AVX-512 VNNI. */
int tern_kquant_tiles(void) {
#if defined(TERN_Q4_TILED)
    return 3;
#elif defined(TERN_KQ_TILED) && defined(TERN_VNNI_256)
    return 2;
#elif defined(TERN_KQ_TILED)
    return 1;
#else
    return 0;
#endif
}
