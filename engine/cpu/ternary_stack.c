/* A stack of ternary decoder layers (BitNet b1.58, every linear one TQ2_0 part) for decode rows in one
 * OpenMP parallel region: layer_kernels.c's decoder_layer, the same operations on every element, with the
 * threads meeting only at the barriers the data needs. Built unless TERN_NO_ONE_REGION (build.py,
 * TERN_CPU_ONE_REGION=0), when tern_decoder_layers takes such a stack layer by layer instead. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decoder_layer.h"
#include "kernels.h"
#include "layer_rows.h"

#ifndef TERN_NO_ONE_REGION

/* Whether every linear of the stack is one TQ2_0 part without bias, of its layer's shape, and the layers
 * plain ternary Llama layers (no q/k norm, no NoPE, none of Gemma 3's parts): what the one-region stack
 * below takes (else decoder_layer serves, or says -2). */
static int plain_ternary(const TernLinear *w) { return w->format == FORMAT_TQ2_0 && !w->next && !w->bias; }
static int plain_layer(const TernDecoderLayer *L) {
    return !L->q_norm && L->rotary == L->head_dim && !L->attn_out_norm && !L->mlp_out_norm && !L->window &&
           !L->local_rope && L->activation != ACT_GELU_TANH;
}
int tern_ternary_stack(const TernDecoderLayer *layers, int64_t count, int64_t E) {
    for (int64_t i = 0; i < count; i++) {
        const TernDecoderLayer *L = &layers[i];
        const int64_t HD = L->heads * L->head_dim, I = L->intermediate;
        if (!plain_ternary(&L->qkv) || !plain_layer(L) || !plain_ternary(&L->o) || !plain_ternary(&L->gate_up) ||
            !plain_ternary(&L->down) || L->qkv.in_features != E ||
            L->qkv.out_features != HD + 2 * L->kv_heads * L->head_dim || L->o.in_features != HD ||
            L->o.out_features != E || L->gate_up.in_features != E || L->gate_up.out_features != 2 * I ||
            L->down.in_features != I || L->down.out_features != E)
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

/* decoder_layer's work for every layer of a stack whose linears are all TQ2_0 (tern_ternary_stack), in one
 * parallel region: one stream's step opened 80 regions (5 a layer), each started and joined by the whole
 * team; here the threads meet only at the 11 barriers a layer that the data needs. Row by row work
 * (norms, the activations' quantization, rotary, the KV store, SiLU, residual adds) is shared out by
 * rows, the linears and the attention by their tiles and chunks; each phase ends in its worksharing
 * loop's barrier. Every element is the same operations as decoder_layer's, so the two agree bit for
 * bit. act holds M rows of the widest linear input; first and partials are the attention's. */
static void ternary_layers(const TernDecoderLayer *layers, int64_t count, float *hidden, int64_t M, int64_t E,
                           const TernDecodeStep *s, const Workspace *ws, TernInt8Rows act, const int64_t *first,
                           float *partials) {
    const int64_t table_stride = s->table_stride;
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
            tern_rotary(row, 1, qkv_width, H + KVH, D, D, s->cos + r * table_stride, s->sin + r * table_stride,
                        table_stride);
            tern_store_rows(row + H * D, 1, qkv_width, KVH * D, s->slots + r, L->k_cache, L->half);
            tern_store_rows(row + (H + KVH) * D, 1, qkv_width, KVH * D, s->slots + r, L->v_cache, L->half);
            memcpy(ws->q + r * H * D, row, (size_t)(H * D) * sizeof(float));
        }
        tern_paged_attention_work(ws->q, L->k_cache, L->v_cache, L->half, s->block_tables, s->width,
                                  s->context_lens, 0, M, H, KVH, D, L->block_size, L->scale, first, partials,
                                  ws->attended);
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
            tern_gated_rows(L->activation, ws->gate_up + r * 2 * I, 1, I, row);
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
int tern_run_ternary_layers(const TernDecoderLayer *layers, int64_t count, float *hidden, int64_t M, int64_t E,
                            const TernDecodeStep *step, const Workspace *ws) {
    const TernDecoderLayer *L = &layers[0];
    int64_t widest = E > L->heads * L->head_dim ? E : L->heads * L->head_dim;
    widest = widest > L->intermediate ? widest : L->intermediate;
    const int64_t nb = (widest + 255) / 256;
    TernInt8Rows act = {malloc((size_t)(M * nb * 256)), malloc((size_t)M * sizeof(float)),
                        malloc((size_t)(M * nb) * sizeof(int32_t)), nb};
    int64_t *first = malloc((size_t)(M + 1) * sizeof(int64_t));
    float *partials = NULL;
    if (first) {
        const int64_t chunks = tern_attention_chunks(step->context_lens, 0, M, first);
        partials = malloc((size_t)(chunks * L->heads * (L->head_dim + 2) + 1) * sizeof(float));
    }
    const int status = act.qs && act.scale && act.sums && partials ? 0 : -1;
    if (status == 0) ternary_layers(layers, count, hidden, M, E, step, ws, act, first, partials);
    tern_free_int8_rows(&act);
    free(first);
    free(partials);
    return status;
}

#else

int tern_ternary_stack(const TernDecoderLayer *layers, int64_t count, int64_t E) {
    (void)layers, (void)count, (void)E;
    return 0;
}

int tern_run_ternary_layers(const TernDecoderLayer *layers, int64_t count, float *hidden, int64_t M, int64_t E,
                            const TernDecodeStep *step, const Workspace *ws) {
    (void)layers, (void)count, (void)hidden, (void)M, (void)E, (void)step, (void)ws;
    return -2;
}

#endif
