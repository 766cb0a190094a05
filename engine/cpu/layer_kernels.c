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
 * layer: a per-head RMSNorm on q and k before rotary; a SmolLM3 NoPE layer: no rotary; a Gemma 3 layer:
 * an RMSNorm of attention's and of the MLP's output before each residual add, tanh GELU, and on its
 * local layers a sliding window over their own pool and their own rotary tables),
 * with the same kernels and the same float32 arithmetic as the torch path of the layer
 * (engine/models/llama.py with ``c_kernel`` set), so a row comes out bit for bit the same either
 * way, and the engine may take this path for pure decode steps and the other for mixed ones
 * (tests/engine/test_cpu_kernels.py and tests/engine/test_families_fast_path.py check both against each
 * other). The structs are decoder_layer.h's; the gated activations gated_rows.c's; a stack of ternary
 * layers runs in one parallel region (ternary_stack.c).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decoder_layer.h"
#include "kernels.h"
#include "layer_rows.h"

/* -- the layer --------------------------------------------------------------------------------- */

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
    case FORMAT_Q8_0_TILED: return tern_matmul_q8_0_tiled(0, x, M, K, (const uint8_t *)w->qweight, N, out);
    case FORMAT_Q5_0_TILED: return tern_matmul_q8_0_tiled(1, x, M, K, (const uint8_t *)w->qweight, N, out);
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

/* The layer L's attention, in place on hidden [M, E]: row r is a token at the position whose (cos,
 * sin) rows the step gives (its local ones on a local-rope layer), its K/V go to its slot, and it attends
 * to the first context_lens[r] cached tokens of its block table (with a window, the last `window` of them,
 * through the step's local slots and tables). 0 or a kernel's status. */
static int attention(const TernDecoderLayer *L, float *hidden, int64_t M, int64_t E, const TernDecodeStep *s,
                     const Workspace *ws) {
    const int64_t H = L->heads, KVH = L->kv_heads, D = L->head_dim;
    const int64_t qkv_width = (H + 2 * KVH) * D;
    const float *cos = L->local_rope ? s->local_cos : s->cos, *sin = L->local_rope ? s->local_sin : s->sin;
    const int64_t *slots = L->window ? s->local_slots : s->slots;
    const int32_t *tables = L->window ? s->local_tables : s->block_tables;
    int status;
    tern_rms_norm(hidden, L->input_norm, M, E, L->eps, ws->normed);
    if ((status = linear(&L->qkv, ws->normed, M, ws->qkv))) return status;
    if (L->q_norm) tern_head_norms(ws->qkv, M, qkv_width, H, KVH, D, L->q_norm, L->k_norm, L->eps);
    if (L->rotary) tern_rotary(ws->qkv, M, qkv_width, H + KVH, D, L->rotary, cos, sin, s->table_stride); /* q, k */
    tern_store_rows(ws->qkv + H * D, M, qkv_width, KVH * D, slots, L->k_cache, L->half);
    tern_store_rows(ws->qkv + (H + KVH) * D, M, qkv_width, KVH * D, slots, L->v_cache, L->half);
    for (int64_t r = 0; r < M; r++) memcpy(ws->q + r * H * D, ws->qkv + r * qkv_width, (size_t)(H * D) * sizeof(float));
    status = tern_paged_decode_attention(ws->q, L->k_cache, L->v_cache, L->half, tables,
                                         L->window ? s->local_width : s->width, s->context_lens, L->window, M, H,
                                         KVH, D, L->block_size, L->scale, ws->attended);
    if (status == 0 && L->attn_sub_norm) tern_rms_norm(ws->attended, L->attn_sub_norm, M, H * D, L->eps, ws->attended);
    if (status || (status = linear(&L->o, ws->attended, M, ws->projected))) return status;
    if (L->attn_out_norm) tern_rms_norm(ws->projected, L->attn_out_norm, M, E, L->eps, ws->projected);
    add_rows(hidden, ws->projected, M * E);
    return 0;
}

/* The layer L applied in place to hidden [M, E], one decode row each (attention above, then the MLP).
 * 0, -2 (a linear not of the layer's shapes) or a kernel's status. */
static int decoder_layer(const TernDecoderLayer *L, float *hidden, int64_t M, int64_t E, const TernDecodeStep *s,
                         const Workspace *ws) {
    const int64_t H = L->heads, KVH = L->kv_heads, D = L->head_dim, I = L->intermediate;
    if (stacked_features(&L->qkv) != (H + 2 * KVH) * D || stacked_features(&L->gate_up) != 2 * I ||
        stacked_features(&L->o) != E || stacked_features(&L->down) != E)
        return -2;
    int status;
    if ((status = attention(L, hidden, M, E, s, ws))) return status;
    tern_rms_norm(hidden, L->post_norm, M, E, L->eps, ws->normed);
    if ((status = linear(&L->gate_up, ws->normed, M, ws->gate_up))) return status;
    tern_gated_rows(L->activation, ws->gate_up, M, I, ws->activated);
    if (L->ffn_sub_norm) tern_rms_norm(ws->activated, L->ffn_sub_norm, M, I, L->eps, ws->activated);
    if ((status = linear(&L->down, ws->activated, M, ws->projected))) return status;
    if (L->mlp_out_norm) tern_rms_norm(ws->projected, L->mlp_out_norm, M, E, L->eps, ws->projected);
    add_rows(hidden, ws->projected, M * E);
    return 0;
}

/* out [M, E] = layers[count - 1](... layers[0](hidden)), decode rows as decoder_layer takes them, the
 * step's rows as decoder_layer.h's TernDecodeStep holds them: the whole stack in one call, because the
 * Python between one call per layer cost a tenth of a one-stream step; a stack of plain ternary linears in
 * one parallel region (ternary_stack.c). 0, -1 (out of memory), -2 (layers of different shapes) or a
 * kernel's status. */
int tern_decoder_layers(const TernDecoderLayer *layers, int64_t count, const float *hidden, int64_t M, int64_t E,
                        const TernDecodeStep *step, float *out) {
    for (int64_t i = 1; i < count; i++)
        if (!same_shapes(&layers[0], &layers[i])) return -2;
    memcpy(out, hidden, (size_t)(M * E) * sizeof(float));
    if (count == 0) return 0;
    Workspace ws;
    int status = alloc_workspace(&ws, &layers[0], M, E);
    if (status == 0 && tern_ternary_stack(layers, count, E))
        status = tern_run_ternary_layers(layers, count, out, M, E, step, &ws);
    else
        for (int64_t i = 0; i < count && status == 0; i++) status = decoder_layer(&layers[i], out, M, E, step, &ws);
    free_workspace(&ws);
    return status;
}
