/* The entry points of the CPU kernels (quant_kernels.c, attention_kernels.c, layer_kernels.c), which
 * build into one shared library; layer_kernels.c calls the others. */
#ifndef TERN_KERNELS_H
#define TERN_KERNELS_H

#include <stdint.h>

int tern_matmul_q4_1(const float *x, int64_t M, int64_t K, const uint8_t *wq, const float *wd, const float *wm,
                     int64_t N, float *out);
int tern_matmul_q8_0(const float *x, int64_t M, int64_t K, const int8_t *wq, const float *wd, int64_t N,
                     float *out);
int tern_paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, int half,
                                const int32_t *block_tables, int64_t width, const int32_t *context_lens,
                                int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale,
                                float *out);
void tern_rms_norm(const float *x, const float *weight, int64_t M, int64_t K, float eps, float *out);
void tern_silu_mul(const float *gate, const float *up, int64_t M, int64_t K, int64_t stride, float *out);

#endif
