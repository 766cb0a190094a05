/* The MLP's gated activations of the decoder layers (layer_kernels.c): SiLU (Llama), squared ReLU (BitNet
 * b1.58) and tanh GELU (Gemma 3's GeGLU). SiLU and tanh GELU are also what the layers' torch path calls on
 * the fast path (engine/layers/activation.py, ``c_kernel``), because torch rounds its exponential and its
 * tanh differently from these: both paths must give the same bits. */
#include <math.h>
#include <stdint.h>

#include "decoder_layer.h"
#include "kernels.h"

/* out [M, K] = silu(gate) * up, silu(g) = g / (1 + exp(-g)); gate and up rows are `stride` apart. */
void tern_silu_mul(const float *gate, const float *up, int64_t M, int64_t K, int64_t stride, float *out) {
    for (int64_t r = 0; r < M; r++) {
        const float *g = gate + r * stride, *u = up + r * stride;
        float *o = out + r * K;
        int64_t k = 0;
#ifdef __AVX2__
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; k + 8 <= K; k += 8) {
            const __m256 gv = _mm256_loadu_ps(g + k);
            const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, exp_avx2(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(o + k, _mm256_mul_ps(silu, _mm256_loadu_ps(u + k)));
        }
#endif
        for (; k < K; k++) o[k] = g[k] / (1.0f + exp_scalar(-g[k])) * u[k];
    }
}

/* tanh GELU, 0.5 g (1 + tanh(u)) with u = sqrt(2 / pi) (g + 0.044715 g^3), computed as the equal
 * g / (1 + exp(-2u)) (no cancellation where tanh(u) nears -1); -2 sqrt(2 / pi) folded into one constant. */
#define GELU_CUBIC 0.044715f
#define GELU_MINUS_2_SQRT_2_OVER_PI -1.5957691216057308f

/* out [M, K] = gelu_tanh(gate) * up; gate and up rows are `stride` apart. The vector and scalar loops do
 * the same operations in the same order (exp_avx2 and exp_scalar agree), so an element's bits do not
 * depend on where in the row it falls. */
void tern_gelu_tanh_mul(const float *gate, const float *up, int64_t M, int64_t K, int64_t stride, float *out) {
    for (int64_t r = 0; r < M; r++) {
        const float *g = gate + r * stride, *u = up + r * stride;
        float *o = out + r * K;
        int64_t k = 0;
#ifdef __AVX2__
        const __m256 one = _mm256_set1_ps(1.0f), cubic = _mm256_set1_ps(GELU_CUBIC);
        const __m256 factor = _mm256_set1_ps(GELU_MINUS_2_SQRT_2_OVER_PI);
        for (; k + 8 <= K; k += 8) {
            const __m256 gv = _mm256_loadu_ps(g + k);
            const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(gv, gv), gv);
            const __m256 exponent = _mm256_mul_ps(factor, _mm256_add_ps(gv, _mm256_mul_ps(cubic, cube)));
            const __m256 gelu = _mm256_div_ps(gv, _mm256_add_ps(one, exp_avx2(exponent)));
            _mm256_storeu_ps(o + k, _mm256_mul_ps(gelu, _mm256_loadu_ps(u + k)));
        }
#endif
        for (; k < K; k++) {
            const float exponent = GELU_MINUS_2_SQRT_2_OVER_PI * (g[k] + GELU_CUBIC * (g[k] * g[k] * g[k]));
            o[k] = g[k] / (1.0f + exp_scalar(exponent)) * u[k];
        }
    }
}

/* out [M, I] = relu(gate)^2 * up for gate | up side by side in rows of 2I: torch's F.relu(gate).square() * up */
static void relu2_mul(const float *gate_up, int64_t M, int64_t I, float *out) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t i = 0; i < I; i++) {
            const float g = gate_up[r * 2 * I + i], relu = g > 0.0f ? g : 0.0f;
            out[r * I + i] = relu * relu * gate_up[r * 2 * I + I + i];
        }
}

void tern_gated_rows(int32_t activation, const float *gate_up, int64_t M, int64_t I, float *out) {
    if (activation == ACT_RELU2)
        relu2_mul(gate_up, M, I, out);
    else if (activation == ACT_GELU_TANH)
        tern_gelu_tanh_mul(gate_up, gate_up + I, M, I, 2 * I, out);
    else
        tern_silu_mul(gate_up, gate_up + I, M, I, 2 * I, out);
}
