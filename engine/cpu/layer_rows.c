/* What the decoder layers (layer_kernels.c) do to the rows of q, k and v between their projection and
 * attention: per-head RMSNorm (Qwen3's q_norm/k_norm), rotary, and the KV store. */
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "layer_rows.h"

/* -- per-head RMSNorm ------------------------------------------------------------------------ */

/* The H query heads and KVH key heads of D at the start of each of the M rows of qkv (rows `stride`
 * apart) normalised in place, each over its D values: tern_rms_norm, as the torch path's RMSNorm
 * modules call it on the same values (engine/models/llama.py), so the result is the same bits. */
void tern_head_norms(float *qkv, int64_t M, int64_t stride, int64_t H, int64_t KVH, int64_t D,
                     const float *q_norm, const float *k_norm, float eps) {
    for (int64_t r = 0; r < M; r++) {
        float *row = qkv + r * stride;
        tern_rms_norm(row, q_norm, H, D, eps, row);
        tern_rms_norm(row + H * D, k_norm, KVH, D, eps, row + H * D);
    }
}

/* -- rotary and the KV store ----------------------------------------------------------------- */

/* Rotate the leading `rot` of each of `heads` heads of D at the start of each of the M rows of x (rows
 * `stride` apart) in place, rotate-half convention over those `rot` (partial rotary, Phi-4-mini: fewer
 * than D; the rest of the head is left as it is), with the engine's tables of `rot` columns: sin's first
 * half negated (engine/layers/rotary.py), cos and sin rows `table_stride` apart. Same arithmetic as
 * torch's x * cos + roll(x, rot/2) * sin. */
void tern_rotary(float *x, int64_t M, int64_t stride, int64_t heads, int64_t D, int64_t rot, const float *cos,
                 const float *sin, int64_t table_stride) {
    const int64_t half = rot / 2;
    for (int64_t r = 0; r < M; r++) {
        const float *c = cos + r * table_stride, *s = sin + r * table_stride;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + r * stride + h * D;
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] + b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* Copy M rows of `width` floats (rows `stride` apart) into the cache at slots[r]; the cache rows are
 * `width` elements, float16 when `half`. */
void tern_store_rows(const float *x, int64_t M, int64_t stride, int64_t width, const int64_t *slots,
                     void *cache, int half) {
    for (int64_t r = 0; r < M; r++) {
        const float *src = x + r * stride;
        if (half) {
            uint16_t *dst = (uint16_t *)cache + slots[r] * width;
            for (int64_t i = 0; i < width; i++) dst[i] = float_to_half(src[i]);
        } else {
            memcpy((float *)cache + slots[r] * width, src, (size_t)width * sizeof(float));
        }
    }
}

