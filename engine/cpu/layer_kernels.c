/* Every Llama decoder layer of a model for decode rows (one new token per row), in one call.
 *
 * A decode step at one stream spent as long in Python and in the few hundred small torch ops
 * between the kernels (views, rotary, the KV store, SiLU, residual adds, each kernel's wrapper) as
 * in the kernels themselves. This runs each layer's kernels back to back instead:
 *
 *   hidden += o_proj(attention(rotary(qkv_proj(rms_norm(hidden)))))    (K/V stored in the cache)
 *   hidden += down_proj(silu(gate) * up), gate | up = gate_up_proj(rms_norm(hidden))
 *
 * (a BitNet b1.58 layer: an RMSNorm before o_proj and before down_proj, squared ReLU or SiLU; a Qwen3
 * layer: a per-head RMSNorm on q and k before rotary; a SmolLM3 NoPE layer: no rotary),
 * with the same kernels and the same float32 arithmetic as the torch path of the layer
 * (engine/models/llama.py with ``c_kernel`` set), so a row comes out bit for bit the same either
 * way, and the engine may take this path for pure decode steps and the other for mixed ones
 * (tests/engine/test_cpu_kernels.py checks both against each other). Also here: SiLU-and-mul,
 * which both paths call, because torch's SiLU rounds its exponential differently.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "layer_rows.h"

/* -- SiLU and mul ------------------------------------------------------------------------------ */

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

/* -- the layer --------------------------------------------------------------------------------- */

typedef struct TernLinear {
    const void *qweight; /* q4_1: [N, K/2] bytes (or tile by tile: kernels.q4_1_kernel_layout); q8_0: [N, K] int8;
                            q5_0: [N, K/32, 20] bytes; Q4_K/Q5_K/Q6_K: [N, K/256] super-blocks as GGUF stores them */
    const uint16_t *scales; /* [N, K/32] float16 (q4_1, q8_0, q5_0; q4_1 as its codes; none for the K-quants) */
    const uint16_t *mins;   /* [N/16 rounded up, K/32, 16] float16, q4_1 only (kernels.tile_blocks) */
    const float *bias;   /* [N] or NULL */
    int64_t out_features, in_features;
    int32_t format; /* FORMAT_* below: engine/cpu/ggml_kernels.py, KERNEL_TYPES */
    const struct TernLinear *next; /* parts of different formats stacked (q/k/v, gate/up): next's columns follow */
    const float *row_scales; /* ternary: [N] float32, or NULL where `scales` holds its [N, K/256] block scales */
} TernLinear;

enum {
    FORMAT_Q8_0 = 0,
    FORMAT_Q4_1 = 1,
    FORMAT_Q4_K = 2,
    FORMAT_Q5_K = 3,
    FORMAT_Q6_K = 4,
    FORMAT_TQ2_0 = 5,
    FORMAT_Q4_K_TILED = 6,
    FORMAT_Q6_K_TILED = 7,
    FORMAT_Q5_K_TILED = 8,
    FORMAT_Q5_0 = 9
};

typedef struct {
    TernLinear qkv, o, gate_up, down;
    const float *input_norm, *post_norm;
    float eps, scale;
    int64_t heads, kv_heads, head_dim, intermediate;
    void *k_cache, *v_cache; /* [num_blocks, block_size, kv_heads, head_dim] */
    int32_t half;            /* caches in float16 */
    int64_t block_size;
    /* BitNet b1.58 (engine/models/bitnet.py): RMSNorms before o_proj and down_proj (NULL: a Llama layer),
     * and squared ReLU for SiLU where relu2 */
    const float *attn_sub_norm, *ffn_sub_norm;
    int32_t relu2;
    const float *q_norm, *k_norm; /* Qwen3: [head_dim] each, per head before rotary (NULL: none) */
    int32_t rotary;               /* rotary dims, each head's leading (fewer than D: Phi-4-mini); 0: NoPE (SmolLM3) */
} TernDecoderLayer;

/* One part's kernel: the one place in C that maps a format to its matmul. */
static int part(const TernLinear *w, const float *x, int64_t M, float *out) {
    const int64_t N = w->out_features, K = w->in_features;
    switch (w->format) {
    case FORMAT_Q8_0: return tern_matmul_q8_0(x, M, K, (const int8_t *)w->qweight, w->scales, N, out);
    case FORMAT_Q5_0: return tern_matmul_q5_0(x, M, K, (const uint8_t *)w->qweight, w->scales, N, out);
    case FORMAT_Q4_1: return tern_matmul_q4_1(x, M, K, (const uint8_t *)w->qweight, w->scales, w->mins, N, out);
    case FORMAT_Q4_K: case FORMAT_Q5_K: case FORMAT_Q6_K:
        return tern_matmul_kquant(w->format - FORMAT_Q4_K, x, M, K, (const uint8_t *)w->qweight, N, out);
    case FORMAT_TQ2_0:
        return tern_matmul_tq2(x, M, K, (const uint8_t *)w->qweight, w->row_scales, w->row_scales ? NULL : w->scales,
                               N, out);
    case FORMAT_Q4_K_TILED: return tern_matmul_k_tiled(0, x, M, K, (const uint8_t *)w->qweight, N, out);
    case FORMAT_Q5_K_TILED: return tern_matmul_k_tiled(1, x, M, K, (const uint8_t *)w->qweight, N, out);
    case FORMAT_Q6_K_TILED: return tern_matmul_q6_k_tiled(x, M, K, (const uint8_t *)w->qweight, N, out);
    default: return -2;
    }
}

/* The columns of a linear and of the parts stacked after it. */
static int64_t stacked_features(const TernLinear *w) {
    int64_t n = 0;
    for (; w; w = w->next) n += w->out_features;
    return n;
}

static int part_with_bias(const TernLinear *w, const float *x, int64_t M, float *out) {
    const int status = part(w, x, M, out);
    if (status == 0 && w->bias)
        for (int64_t r = 0; r < M; r++)
            for (int64_t n = 0; n < w->out_features; n++) out[r * w->out_features + n] += w->bias[n];
    return status;
}

static int linear(const TernLinear *w, const float *x, int64_t M, float *out) {
    if (!w->next) return part_with_bias(w, x, M, out);
    /* each part into its own rows, then into its columns of out */
    const int64_t N = stacked_features(w);
    int64_t column = 0;
    int status = 0;
    for (const TernLinear *p = w; p && status == 0; p = p->next) {
        float *rows = malloc((size_t)(M * p->out_features) * sizeof(float));
        status = rows ? part_with_bias(p, x, M, rows) : -1;
        for (int64_t r = 0; r < M && status == 0; r++)
            memcpy(out + r * N + column, rows + r * p->out_features, (size_t)p->out_features * sizeof(float));
        free(rows);
        column += p->out_features;
    }
    return status;
}

/* out [M, I] = relu(gate)^2 * up for gate | up side by side in rows of 2I: torch's F.relu(gate).square() * up */
static void relu2_mul(const float *gate_up, int64_t M, int64_t I, float *out) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t i = 0; i < I; i++) {
            const float g = gate_up[r * 2 * I + i], relu = g > 0.0f ? g : 0.0f;
            out[r * I + i] = relu * relu * gate_up[r * 2 * I + I + i];
        }
}

static void add_rows(float *hidden, const float *x, int64_t count) {
    for (int64_t i = 0; i < count; i++) hidden[i] += x[i];
}

/* The layer's intermediate rows, allocated once per step for all layers. */
typedef struct {
    float *normed, *qkv, *q, *attended, *projected, *gate_up, *activated;
} Workspace;

static void free_workspace(Workspace *ws) {
    free(ws->normed);
    free(ws->qkv);
    free(ws->q);
    free(ws->attended);
    free(ws->projected);
    free(ws->gate_up);
    free(ws->activated);
}

/* Buffers for M rows of the layer L (every layer of a stack has the same shapes). 0 or -1. */
static int alloc_workspace(Workspace *ws, const TernDecoderLayer *L, int64_t M, int64_t E) {
    const int64_t H = L->heads, KVH = L->kv_heads, D = L->head_dim, I = L->intermediate;
    ws->normed = malloc((size_t)(M * E) * sizeof(float));
    ws->qkv = malloc((size_t)(M * (H + 2 * KVH) * D) * sizeof(float));
    ws->q = malloc((size_t)(M * H * D) * sizeof(float));
    ws->attended = malloc((size_t)(M * H * D) * sizeof(float));
    ws->projected = malloc((size_t)(M * E) * sizeof(float));
    ws->gate_up = malloc((size_t)(M * 2 * I) * sizeof(float));
    ws->activated = malloc((size_t)(M * I) * sizeof(float));
    return ws->normed && ws->qkv && ws->q && ws->attended && ws->projected && ws->gate_up && ws->activated ? 0 : -1;
}

static int same_shapes(const TernDecoderLayer *a, const TernDecoderLayer *b) {
    return a->heads == b->heads && a->kv_heads == b->kv_heads && a->head_dim == b->head_dim &&
           a->intermediate == b->intermediate;
}

/* The layer L applied in place to hidden [M, E], one decode row each: row r is a token at the
 * position whose (cos, sin) rows are given, its K/V go to slots[r], and it attends to the first
 * context_lens[r] cached tokens of its block table (rows `width` apart). 0 or a kernel's status. */
static int decoder_layer(const TernDecoderLayer *L, float *hidden, int64_t M, int64_t E, const float *cos,
                         const float *sin, int64_t table_stride, const int64_t *slots, const int32_t *block_tables,
                         int64_t width, const int32_t *context_lens, const Workspace *ws) {
    const int64_t H = L->heads, KVH = L->kv_heads, D = L->head_dim, I = L->intermediate;
    const int64_t qkv_width = (H + 2 * KVH) * D;
    if (stacked_features(&L->qkv) != qkv_width || stacked_features(&L->gate_up) != 2 * I ||
        stacked_features(&L->o) != E || stacked_features(&L->down) != E)
        return -2;
    int status;
    tern_rms_norm(hidden, L->input_norm, M, E, L->eps, ws->normed);
    if ((status = linear(&L->qkv, ws->normed, M, ws->qkv))) return status;
    if (L->q_norm) tern_head_norms(ws->qkv, M, qkv_width, H, KVH, D, L->q_norm, L->k_norm, L->eps);
    if (L->rotary) tern_rotary(ws->qkv, M, qkv_width, H + KVH, D, L->rotary, cos, sin, table_stride); /* q, k together */
    tern_store_rows(ws->qkv + H * D, M, qkv_width, KVH * D, slots, L->k_cache, L->half);
    tern_store_rows(ws->qkv + (H + KVH) * D, M, qkv_width, KVH * D, slots, L->v_cache, L->half);
    for (int64_t r = 0; r < M; r++) memcpy(ws->q + r * H * D, ws->qkv + r * qkv_width, (size_t)(H * D) * sizeof(float));
    status = tern_paged_decode_attention(ws->q, L->k_cache, L->v_cache, L->half, block_tables, width, context_lens, 0,
                                         M, H, KVH, D, L->block_size, L->scale, ws->attended);
    if (status == 0 && L->attn_sub_norm) tern_rms_norm(ws->attended, L->attn_sub_norm, M, H * D, L->eps, ws->attended);
    if (status || (status = linear(&L->o, ws->attended, M, ws->projected))) return status;
    add_rows(hidden, ws->projected, M * E);

    tern_rms_norm(hidden, L->post_norm, M, E, L->eps, ws->normed);
    if ((status = linear(&L->gate_up, ws->normed, M, ws->gate_up))) return status;
    if (L->relu2)
        relu2_mul(ws->gate_up, M, I, ws->activated);
    else
        tern_silu_mul(ws->gate_up, ws->gate_up + I, M, I, 2 * I, ws->activated);
    if (L->ffn_sub_norm) tern_rms_norm(ws->activated, L->ffn_sub_norm, M, I, L->eps, ws->activated);
    if ((status = linear(&L->down, ws->activated, M, ws->projected))) return status;
    add_rows(hidden, ws->projected, M * E);
    return 0;
}

/* -- a ternary stack in one parallel region ------------------------------------------------------ */
#ifndef TERN_NO_ONE_REGION

/* Whether every linear of the stack is one TQ2_0 part without bias, of its layer's shape: what the
 * one-region stack below takes (else decoder_layer serves, or says -2). */
static int plain_ternary(const TernLinear *w) { return w->format == FORMAT_TQ2_0 && !w->next && !w->bias; }
static int ternary_stack(const TernDecoderLayer *layers, int64_t count, int64_t E) {
    for (int64_t i = 0; i < count; i++) {
        const TernDecoderLayer *L = &layers[i];
        const int64_t HD = L->heads * L->head_dim, I = L->intermediate;
        if (!plain_ternary(&L->qkv) || L->q_norm || !L->rotary || !plain_ternary(&L->o) || !plain_ternary(&L->gate_up) || !plain_ternary(&L->down) ||
            L->qkv.in_features != E || L->qkv.out_features != HD + 2 * L->kv_heads * L->head_dim ||
            L->o.in_features != HD || L->o.out_features != E || L->gate_up.in_features != E ||
            L->gate_up.out_features != 2 * I || L->down.in_features != I || L->down.out_features != E)
            return 0;
    }
    return 1;
}

/* Row r of x [M, K] quantized into act (tern_int8_rows' layout for K). */
static void quantize_row(const float *x, int64_t r, int64_t K, TernInt8Rows *act) {
    const int64_t nb = (K + 255) / 256;
    tern_quantize_rows_i8(x + r * K, 1, K, act->qs + r * nb * 256, act->scale + r, act->sums + r * nb);
}

static void ternary_linear(const TernLinear *w, TernInt8Rows *act, int64_t M, float *out) {
    act->nb = (w->in_features + 255) / 256;
    tern_tq2_tiles(act, M, (const uint8_t *)w->qweight, w->row_scales, w->row_scales ? NULL : w->scales,
                   w->out_features, out);
}

/* decoder_layer's work for every layer of a stack whose linears are all TQ2_0 (ternary_stack), in one
 * parallel region: one stream's step opened 80 regions (5 a layer), each started and joined by the whole
 * team; here the threads meet only at the 11 barriers a layer that the data needs. Row by row work
 * (norms, the activations' quantization, rotary, the KV store, SiLU, residual adds) is shared out by
 * rows, the linears and the attention by their tiles and chunks; each phase ends in its worksharing
 * loop's barrier. Every element is the same operations as decoder_layer's, so the two agree bit for
 * bit. act holds M rows of the widest linear input; first and partials are the attention's. */
static void ternary_layers(const TernDecoderLayer *layers, int64_t count, float *hidden, int64_t M, int64_t E,
                           const float *cos, const float *sin, int64_t table_stride, const int64_t *slots,
                           const int32_t *block_tables, int64_t width, const int32_t *context_lens,
                           const Workspace *ws, TernInt8Rows act, const int64_t *first, float *partials) {
#pragma omp parallel firstprivate(act)
    for (int64_t i = 0; i < count; i++) {
        const TernDecoderLayer *L = &layers[i];
        const int64_t H = L->heads, KVH = L->kv_heads, D = L->head_dim, I = L->intermediate;
        const int64_t qkv_width = (H + 2 * KVH) * D;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) {
            if (i > 0) add_rows(hidden + r * E, ws->projected + r * E, E); /* the layer before's down_proj */
            tern_rms_norm(hidden + r * E, L->input_norm, 1, E, L->eps, ws->normed + r * E);
            quantize_row(ws->normed, r, E, &act);
        }
        ternary_linear(&L->qkv, &act, M, ws->qkv);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) {
            float *row = ws->qkv + r * qkv_width;
            tern_rotary(row, 1, qkv_width, H + KVH, D, D, cos + r * table_stride, sin + r * table_stride, table_stride);
            tern_store_rows(row + H * D, 1, qkv_width, KVH * D, slots + r, L->k_cache, L->half);
            tern_store_rows(row + (H + KVH) * D, 1, qkv_width, KVH * D, slots + r, L->v_cache, L->half);
            memcpy(ws->q + r * H * D, row, (size_t)(H * D) * sizeof(float));
        }
        tern_paged_attention_work(ws->q, L->k_cache, L->v_cache, L->half, block_tables, width, context_lens, 0, M,
                                  H, KVH, D, L->block_size, L->scale, first, partials, ws->attended);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) {
            float *row = ws->attended + r * H * D;
            if (L->attn_sub_norm) tern_rms_norm(row, L->attn_sub_norm, 1, H * D, L->eps, row);
            quantize_row(ws->attended, r, H * D, &act);
        }
        ternary_linear(&L->o, &act, M, ws->projected);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) {
            add_rows(hidden + r * E, ws->projected + r * E, E);
            tern_rms_norm(hidden + r * E, L->post_norm, 1, E, L->eps, ws->normed + r * E);
            quantize_row(ws->normed, r, E, &act);
        }
        ternary_linear(&L->gate_up, &act, M, ws->gate_up);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) {
            float *row = ws->activated + r * I;
            if (L->relu2)
                relu2_mul(ws->gate_up + r * 2 * I, 1, I, row);
            else
                tern_silu_mul(ws->gate_up + r * 2 * I, ws->gate_up + r * 2 * I + I, 1, I, 2 * I, row);
            if (L->ffn_sub_norm) tern_rms_norm(row, L->ffn_sub_norm, 1, I, L->eps, row);
            quantize_row(ws->activated, r, I, &act);
        }
        ternary_linear(&L->down, &act, M, ws->projected);
        if (i == count - 1) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; r++) add_rows(hidden + r * E, ws->projected + r * E, E);
        }
    }
}

/* The one-region stack's buffers, then the stack: 0 or -1 (out of memory). */
static int run_ternary_layers(const TernDecoderLayer *layers, int64_t count, float *hidden, int64_t M, int64_t E,
                              const float *cos, const float *sin, int64_t table_stride, const int64_t *slots,
                              const int32_t *block_tables, int64_t width, const int32_t *context_lens,
                              const Workspace *ws) {
    const TernDecoderLayer *L = &layers[0];
    int64_t widest = E > L->heads * L->head_dim ? E : L->heads * L->head_dim;
    widest = widest > L->intermediate ? widest : L->intermediate;
    const int64_t nb = (widest + 255) / 256;
    TernInt8Rows act = {malloc((size_t)(M * nb * 256)), malloc((size_t)M * sizeof(float)),
                        malloc((size_t)(M * nb) * sizeof(int32_t)), nb};
    int64_t *first = malloc((size_t)(M + 1) * sizeof(int64_t));
    float *partials = NULL;
    if (first) {
        const int64_t chunks = tern_attention_chunks(context_lens, 0, M, first);
        partials = malloc((size_t)(chunks * L->heads * (L->head_dim + 2) + 1) * sizeof(float));
    }
    const int status = act.qs && act.scale && act.sums && partials ? 0 : -1;
    if (status == 0)
        ternary_layers(layers, count, hidden, M, E, cos, sin, table_stride, slots, block_tables, width, context_lens,
                       ws, act, first, partials);
    tern_free_int8_rows(&act);
    free(first);
    free(partials);
    return status;
}
#endif

/* out [M, E] = layers[count - 1](... layers[0](hidden)), decode rows as decoder_layer takes them:
 * the whole stack in one call, because the Python between one call per layer cost a tenth of a
 * one-stream step; a stack of plain ternary linears in one parallel region (ternary_layers). 0, -1 (out
 * of memory), -2 (layers of different shapes) or a kernel's status. */
int tern_decoder_layers(const TernDecoderLayer *layers, int64_t count, const float *hidden, int64_t M, int64_t E,
                        const float *cos, const float *sin, int64_t table_stride, const int64_t *slots,
                        const int32_t *block_tables, int64_t width, const int32_t *context_lens, float *out) {
    for (int64_t i = 1; i < count; i++)
        if (!same_shapes(&layers[0], &layers[i])) return -2;
    memcpy(out, hidden, (size_t)(M * E) * sizeof(float));
    if (count == 0) return 0;
    Workspace ws;
    int status = alloc_workspace(&ws, &layers[0], M, E);
#ifndef TERN_NO_ONE_REGION
    if (status == 0 && ternary_stack(layers, count, E))
        status = run_ternary_layers(layers, count, out, M, E, cos, sin, table_stride, slots, block_tables, width,
                                    context_lens, &ws);
    else
#endif
        for (int64_t i = 0; i < count && status == 0; i++)
            status = decoder_layer(&layers[i], out, M, E, cos, sin, table_stride, slots, block_tables, width,
                                   context_lens, &ws);
    free_workspace(&ws);
    return status;
}
