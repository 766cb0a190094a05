/* The ternary kernel's activations (ternary_kernels.c): BitNet's per-token absmax int8 quantization,
 * as transformers' BitLinear and the engine's torch path compute it:
 *
 *   s = (1 / max(|x|, 1e-5)) * 127,  q = clamp(round_half_even(x * s), -128, 127)
 *
 * with each block's (256 codes) sum, for the kernel's offset of one. The vector paths do the same
 * float operations per element (one multiply, one rounding, compares) and an exact max and integer
 * sums, so they give the scalar path's bytes (tests/engine/test_ternary_cpu_kernels.py checks them
 * against the plain-torch reference, engine/cpu/ternary.py `quantize_rows_i8_ref`). One decode row
 * is quantized on one thread while the other waits: vectorized, a 1B model's step spends 0.03 ms
 * there instead of 0.3.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define QKT 256
#define ACT_MAX 127.0f
#define ACT_EPS 1e-5f
#ifdef TERN_AVX512
#define TERN_AVX512_ORDER 1
#else
#define TERN_AVX512_ORDER 0
#endif

static float absmax(const float *x, int64_t K) {
    /* compares, not fmaxf: that is a call to libm here (NaN rules); max_ps keeps its second operand
     * for a NaN, as the compare does */
    float amax = 0.0f;
    int64_t k = 0;
#if defined(TERN_AVX512)
    __m512 m = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + k)), m);
    amax = _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)), m);
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
#endif
    for (; k < K; k++) {
        const float a = fabsf(x[k]);
        amax = a > amax ? a : amax;
    }
    return amax;
}

/* Element e = 128c + 32j + m of a block goes to byte e of it, or with the AVX-512 order (group j of a
 * block: elements 32j.. then 128 + 32j.., the bit planes of TQ2_0's bytes) to 64j + 32c + m. */
static inline int64_t block_offset(int64_t e) {
    return TERN_AVX512_ORDER ? 64 * ((e % 128) / 32) + 32 * (e / 128) + e % 32 : e;
}

/* One row: codes, its scale and its blocks' sums; past K (padding to whole blocks) the codes are 0. */
static void quantize_row_i8(const float *x, int64_t K, int64_t nb, int8_t *qs, float *scale, int32_t *sums) {
    const float amax = absmax(x, K);
    /* torch computes 127 / t as reciprocal(t) * 127: two roundings, here too */
    const float s = (1.0f / (amax > ACT_EPS ? amax : ACT_EPS)) * ACT_MAX;
    for (int64_t b = 0; b < nb; b++) {
        int8_t *block = qs + b * QKT;
        int32_t sum = 0;
        int64_t e = 0;
#if defined(TERN_AVX512)
        const __m512 scale_v = _mm512_set1_ps(s), low = _mm512_set1_ps(-128.0f), high = _mm512_set1_ps(127.0f);
        __m512i total = _mm512_setzero_si512();
        for (; e < QKT; e += 16) {
            const int64_t k = b * QKT + e, left = K - k;
            const __mmask16 in = left >= 16 ? 0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
            __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(in, x + k), scale_v),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q = _mm512_min_ps(_mm512_max_ps(q, low), high);
            const __m512i codes = _mm512_cvtps_epi32(q);
            total = _mm512_add_epi32(total, codes);
            _mm_storeu_si128((__m128i *)(block + block_offset(e)), _mm512_cvtepi32_epi8(codes));
        }
        sum = _mm512_reduce_add_epi32(total);
#elif defined(__AVX2__)
        const __m256 scale_v = _mm256_set1_ps(s), low = _mm256_set1_ps(-128.0f), high = _mm256_set1_ps(127.0f);
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        __m256i total = _mm256_setzero_si256();
        for (; e + 32 <= QKT && b * QKT + e + 32 <= K; e += 32) {
            __m256i codes[4];
            for (int i = 0; i < 4; i++) {
                const __m256 q = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + b * QKT + e + 8 * i), scale_v),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                codes[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(q, low), high));
                total = _mm256_add_epi32(total, codes[i]);
            }
            /* in range already: the saturating packs are exact; they interleave 128-bit lanes, undone */
            const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(codes[0], codes[1]),
                                                     _mm256_packs_epi32(codes[2], codes[3]));
            _mm256_storeu_si256((__m256i *)(block + e), _mm256_permutevar8x32_epi32(words, order));
        }
        __m128i half = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        half = _mm_add_epi32(half, _mm_shuffle_epi32(half, _MM_SHUFFLE(1, 0, 3, 2)));
        sum = _mm_cvtsi128_si32(_mm_add_epi32(half, _mm_shuffle_epi32(half, _MM_SHUFFLE(2, 3, 0, 1))));
#endif
        for (; e < QKT; e++) { /* the scalar path, and the vector paths' tail */
            const int64_t k = b * QKT + e;
            float q = k < K ? nearbyintf(x[k] * s) : 0.0f;
            q = q < -128.0f ? -128.0f : (q > 127.0f ? 127.0f : q);
            block[block_offset(e)] = (int8_t)q;
            sum += (int8_t)q;
        }
        sums[b] = sum;
    }
    *scale = s;
}

int tern_int8_rows(const float *x, int64_t M, int64_t K, TernInt8Rows *q) {
    const int64_t nb = (K + QKT - 1) / QKT;
    q->nb = nb;
    q->qs = (int8_t *)malloc((size_t)(M * nb * QKT));
    q->scale = (float *)malloc((size_t)M * sizeof(float));
    q->sums = (int32_t *)malloc((size_t)(M * nb) * sizeof(int32_t));
    if (!q->qs || !q->scale || !q->sums) return -1;
#pragma omp parallel for schedule(static) if (M >= 4)
    for (int64_t r = 0; r < M; r++)
        quantize_row_i8(x + r * K, K, nb, q->qs + r * nb * QKT, q->scale + r, q->sums + r * nb);
    return 0;
}

void tern_free_int8_rows(TernInt8Rows *q) { free(q->qs), free(q->scale), free(q->sums); }

/* The activation quantizer alone, for the reference test: qs [M, Kp] in the kernel's order, scale, sums. */
void tern_quantize_rows_i8(const float *x, int64_t M, int64_t K, int8_t *qs, float *scale, int32_t *sums) {
    const int64_t nb = (K + QKT - 1) / QKT;
    for (int64_t r = 0; r < M; r++) quantize_row_i8(x + r * K, K, nb, qs + r * nb * QKT, scale + r, sums + r * nb);
}

/* 1 where the activation codes of a block are stored in the AVX-512 kernel's order. */
int tern_ternary_avx512_order(void) { return TERN_AVX512_ORDER; }
