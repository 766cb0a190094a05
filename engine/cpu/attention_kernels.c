/* Decode attention over the paged KV cache, and RMSNorm, for float32 CPU models.
 *
 * One query token per row attends to its row's first context_lens[r] cached keys, read in place
 * through the row's block table (no gather into a padded copy, no mask). Chunks of a row's keys,
 * for all its heads, are shared out among OpenMP threads and merged in a fixed order
 * (paged_attention.inc), so a row's output depends neither on the batch nor on the
 * thread count, and one long row still uses every thread.
 * The cache is float32 or float16 (llama.cpp's default: half the bytes a step reads, and a
 * float16 element converts to float32 in one instruction, F16C); arithmetic is float32.
 * Plain-torch references: engine/cpu/kernels.py (`*_ref`), tested in tests/engine/test_cpu_kernels.py.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* Keys per work item; a row of C keys is ceil(C / KEYS_PER_CHUNK) items. */
#define KEYS_PER_CHUNK 128
/* How many positions ahead a row's keys and values are prefetched (about a memory latency of work). */
#define PREFETCH_KEYS 8

/* CALL(n) with n = min(heads, 4) as a constant, so each head count gets its own code. */
#define BY_HEADS(heads, CALL)       \
    do {                            \
        if ((heads) >= 4)           \
            CALL(4);                \
        else if ((heads) == 3)      \
            CALL(3);                \
        else if ((heads) == 2)      \
            CALL(2);                \
        else                        \
            CALL(1);                \
    } while (0)

/* offsets[t - start] = the first element of position t of a row (block table `table`) in a cache
 * laid out [blocks, block_size, token_stride], for t in [start, end). */
static void chunk_offsets(const int32_t *table, int64_t start, int64_t end, int64_t block_size, int64_t token_stride,
                          int64_t *offsets) {
    for (int64_t t = start; t < end; t++)
        offsets[t - start] = ((int64_t)table[t / block_size] * block_size + t % block_size) * token_stride;
}

/* The first key a row of `length` keys attends to: 0, or with a sliding window (> 0) its last `window`. */
static inline int64_t window_start(int64_t length, int64_t window) {
    return window > 0 && length > window ? length - window : 0;
}

/* s [n] scores -> exp(s - max), in place, with the max and the sum of the exponentials. */
static void softmax_chunk(float *s, int64_t n, float *top_out, float *total_out) {
    float top = -INFINITY; /* a max is exact, whatever the order */
    int64_t t = 0;
#ifdef __AVX2__
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    for (; t + 8 <= n; t += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(s + t));
    __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(top8), _mm256_extractf128_ps(top8, 1));
    top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
    top = _mm_cvtss_f32(_mm_max_ss(top4, _mm_movehdup_ps(top4)));
#endif
    for (; t < n; t++) top = s[t] > top ? s[t] : top;
    float total = 0.0f;
    t = 0;
#ifdef __AVX2__
    __m256 sum8 = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(top)));
        _mm256_storeu_ps(s + t, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    total = hsum8(sum8);
#endif
    for (; t < n; t++) {
        s[t] = exp_scalar(s[t] - top);
        total += s[t];
    }
    *top_out = top;
    *total_out = total;
}

#define CAT2(a, b) a##_##b
#define CAT(a, b) CAT2(a, b)
#define FN(name) CAT(name, SUFFIX)

#define T float
#define SUFFIX f32
#define LOAD8(p) _mm256_loadu_ps(p)
#define LOAD1(p) (*(p))
#include "paged_attention.inc"
#undef T
#undef SUFFIX
#undef LOAD8
#undef LOAD1

#define T uint16_t
#define SUFFIX f16
#define LOAD8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define LOAD1(p) half_to_float(*(p))
#include "paged_attention.inc"
#undef T
#undef SUFFIX
#undef LOAD8
#undef LOAD1

/* first [B + 1]: row r's chunks are first[r] .. first[r + 1] - 1 of all rows' (a chunk is a work item).
 * Returns their count. */
int64_t tern_attention_chunks(const int32_t *context_lens, int64_t window, int64_t B, int64_t *first) {
    first[0] = 0;
    for (int64_t r = 0; r < B; r++)
        first[r + 1] = first[r] + (context_lens[r] + KEYS_PER_CHUNK - 1) / KEYS_PER_CHUNK -
                       window_start(context_lens[r], window) / KEYS_PER_CHUNK;
    return first[B];
}

/* tern_paged_decode_attention's work for the threads of the enclosing parallel region (orphaned omp for:
 * every thread of the region calls it), with its first (tern_attention_chunks) and partials
 * ([chunks, H, D + 2] floats) given: layer_kernels.c's decode stack, which runs in one region. */
void tern_paged_attention_work(const float *q, const void *k_cache, const void *v_cache, int half,
                               const int32_t *block_tables, int64_t width, const int32_t *context_lens,
                               int64_t window, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                               float scale, const int64_t *first, float *partials, float *out) {
    if (half)
        attention_work_f16(q, (const uint16_t *)k_cache, (const uint16_t *)v_cache, block_tables, width, context_lens,
                           window, B, H, KVH, D, block_size, scale, first, partials, out);
    else
        attention_work_f32(q, (const float *)k_cache, (const float *)v_cache, block_tables, width, context_lens,
                           window, B, H, KVH, D, block_size, scale, first, partials, out);
}

/* q, out [B, H, D] float32; k_cache, v_cache [num_blocks, block_size, KVH, D], float16 when `half`
 * is set, else float32; block_tables [B, width] int32; context_lens [B] int32; window > 0: each row
 * attends to its last `window` keys only (the blocks before them are never read). Returns 0, or -1
 * when out of memory. */
int tern_paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, int half,
                                const int32_t *block_tables, int64_t width, const int32_t *context_lens,
                                int64_t window, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                                float scale, float *out) {
    int64_t *first = (int64_t *)malloc((size_t)(B + 1) * sizeof(int64_t));
    if (!first) return -1;
    const int64_t chunks = tern_attention_chunks(context_lens, window, B, first);
    float *partials = (float *)malloc((size_t)(chunks * H * (D + 2) + 1) * sizeof(float));
    if (!partials) {
        free(first);
        return -1;
    }
#pragma omp parallel
    tern_paged_attention_work(q, k_cache, v_cache, half, block_tables, width, context_lens, window, B, H, KVH, D,
                              block_size, scale, first, partials, out);
    free(partials);
    free(first);
    return 0;
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
