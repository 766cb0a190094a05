/* Decode attention over the paged KV cache, and RMSNorm, for float32 CPU models.
 *
 * One query token per row attends to its row's first context_lens[r] cached keys, read in place
 * through the row's block table (no gather into a padded copy, no mask). Rows and KV heads are
 * shared out among OpenMP threads; each (row, query head) is computed by one thread in a fixed
 * order, so a row's output does not depend on the batch or the thread count.
 * Plain-torch references: engine/cpu/kernels.py (`*_ref`), tested in tests/engine/test_cpu_kernels.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline float dot(const float *a, const float *b, int64_t n) {
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < n; i++) total += a[i] * b[i];
    return total;
}

/* q, out [B, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D]; block_tables [B, width]
 * int32; context_lens [B] int32. Returns 0, or -1 when out of memory. */
int tern_paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                                const int32_t *block_tables, int64_t width, const int32_t *context_lens,
                                int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale,
                                float *out) {
    const int64_t group = H / KVH;
    const int64_t token_stride = KVH * D;
    int status = 0;
#pragma omp parallel
    {
        int64_t capacity = 0;
        float *scores = NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < B * KVH; item++) {
            const int64_t r = item / KVH, kvh = item % KVH;
            const int64_t length = context_lens[r];
            if (length > capacity) {
                free(scores);
                capacity = length;
                scores = (float *)malloc((size_t)(group * capacity) * sizeof(float));
                if (!scores) {
                    capacity = 0;
                    status = -1;
                    continue;
                }
            }
            const int32_t *table = block_tables + r * width;
            for (int64_t g = 0; g < group; g++) {
                const int64_t h = kvh * group + g;
                const float *qh = q + (r * H + h) * D;
                float *row_scores = scores + g * capacity;
                float top = -INFINITY;
                for (int64_t t = 0; t < length; t++) {
                    const float *key = k_cache + ((int64_t)table[t / block_size] * block_size + t % block_size) * token_stride + kvh * D;
                    row_scores[t] = dot(qh, key, D) * scale;
                    top = fmaxf(top, row_scores[t]);
                }
                float total = 0.0f;
                for (int64_t t = 0; t < length; t++) {
                    row_scores[t] = expf(row_scores[t] - top);
                    total += row_scores[t];
                }
                float *oh = out + (r * H + h) * D;
                for (int64_t i = 0; i < D; i++) oh[i] = 0.0f;
                for (int64_t t = 0; t < length; t++) {
                    const float *value = v_cache + ((int64_t)table[t / block_size] * block_size + t % block_size) * token_stride + kvh * D;
                    const float p = row_scores[t];
#pragma omp simd
                    for (int64_t i = 0; i < D; i++) oh[i] += p * value[i];
                }
                const float inv = 1.0f / total;
#pragma omp simd
                for (int64_t i = 0; i < D; i++) oh[i] *= inv;
            }
        }
        free(scores);
    }
    return status;
}

/* out [M, K] = x / sqrt(mean(x^2) + eps) * weight, row by row (float32 throughout). */
void tern_rms_norm(const float *x, const float *weight, int64_t M, int64_t K, float eps, float *out) {
    for (int64_t r = 0; r < M; r++) {
        const float *xr = x + r * K;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t k = 0; k < K; k++) total += xr[k] * xr[k];
        const float inv = 1.0f / sqrtf(total / (float)K + eps);
        float *o = out + r * K;
#pragma omp simd
        for (int64_t k = 0; k < K; k++) o[k] = xr[k] * inv * weight[k];
    }
}
