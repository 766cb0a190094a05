/* The row operations of a decoder layer between its qkv projection and attention (layer_rows.c). */
#ifndef TERN_LAYER_ROWS_H
#define TERN_LAYER_ROWS_H

#include <stdint.h>

void tern_head_norms(float *qkv, int64_t M, int64_t stride, int64_t H, int64_t KVH, int64_t D,
                     const float *q_norm, const float *k_norm, float eps);
void tern_rotary(float *x, int64_t M, int64_t stride, int64_t heads, int64_t D, int64_t rot, const float *cos,
                 const float *sin, int64_t table_stride);
void tern_store_rows(const float *x, int64_t M, int64_t stride, int64_t width, const int64_t *slots,
                     void *cache, int half);

#endif
