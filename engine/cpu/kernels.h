/* The entry points of the CPU kernels (quant_kernels.c, attention_kernels.c, layer_kernels.c), which
 * build into one shared library; layer_kernels.c calls the others. */
#ifndef TERN_KERNELS_H
#define TERN_KERNELS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* Weight scales (and Q4_1 mins) are float16, as GGUF stores them: the bits, as uint16_t. */
int tern_matmul_q4_1(const float *x, int64_t M, int64_t K, const uint8_t *wq, const uint16_t *wd,
                     const uint16_t *wm, int64_t N, float *out);
int tern_matmul_q8_0(const float *x, int64_t M, int64_t K, const int8_t *wq, const uint16_t *wd, int64_t N,
                     float *out);
int tern_paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, int half,
                                const int32_t *block_tables, int64_t width, const int32_t *context_lens,
                                int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale,
                                float *out);
void tern_rms_norm(const float *x, const float *weight, int64_t M, int64_t K, float eps, float *out);
void tern_silu_mul(const float *gate, const float *up, int64_t M, int64_t K, int64_t stride, float *out);

/* float16 bits -> float32 (exact). */
static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        int shift = 0;
        uint32_t m = mantissa;
        while (!(m & 0x400)) {
            m <<= 1;
            shift++;
        }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((m & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* float32 -> float16 bits, rounding to nearest even (torch's .to(torch.float16)). */
static inline uint16_t float_to_half(float f) {
#ifdef __F16C__
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t magnitude = x & 0x7FFFFFFFu;
    if (magnitude >= 0x7F800000u) /* inf or nan */
        return (uint16_t)(sign | 0x7C00u | (magnitude > 0x7F800000u ? 0x200u : 0u));
    if (magnitude >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* rounds past 65504 */
    if (magnitude < 0x38800000u) { /* a float16 subnormal or zero */
        float value;
        memcpy(&value, &magnitude, sizeof value);
        return (uint16_t)(sign | (uint32_t)nearbyintf(value * 16777216.0f)); /* units of 2^-24 */
    }
    const uint32_t rounded = magnitude + 0xFFFu + ((magnitude >> 13) & 1u);
    return (uint16_t)(sign | ((rounded - 0x38000000u) >> 13));
#endif
}

#endif
