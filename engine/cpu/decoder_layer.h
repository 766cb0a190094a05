/* The decoder layers' C structs (engine/models/llama_decode_kernel.py mirrors them with ctypes) and what
 * layer_kernels.c, the one-region ternary stack (ternary_stack.c) and the gated activations
 * (gated_rows.c) share. */
#ifndef TERN_DECODER_LAYER_H
#define TERN_DECODER_LAYER_H

#include <stdint.h>

typedef struct TernLinear {
    const void *qweight; /* q4_1: [N, K/2] bytes (or tile by tile: kernels.q4_1_kernel_layout); q8_0: [N, K] int8;
                            q5_0: [N, K/32, 20] bytes; Q4_K/Q5_K/Q6_K: [N, K/256] super-blocks as GGUF stores them;
                            the tiled formats: ggml_kernels.tile, q8_0_tiles.tile */
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
    FORMAT_Q5_0 = 9,
    FORMAT_Q8_0_TILED = 10,
    FORMAT_Q5_0_TILED = 11
};

/* The MLP's gated activation of gate | up (TernDecoderLayer.activation). */
enum { ACT_SILU = 0, ACT_RELU2 = 1, ACT_GELU_TANH = 2 };

typedef struct {
    TernLinear qkv, o, gate_up, down;
    const float *input_norm, *post_norm; /* before attention, before the MLP */
    float eps, scale;
    int64_t heads, kv_heads, head_dim, intermediate;
    void *k_cache, *v_cache; /* [num_blocks, block_size, kv_heads, head_dim] */
    int32_t half;            /* caches in float16 */
    int64_t block_size;
    /* BitNet b1.58 (engine/models/bitnet.py): RMSNorms before o_proj and down_proj (NULL: a Llama layer) */
    const float *attn_sub_norm, *ffn_sub_norm;
    int32_t activation;           /* ACT_*: SiLU (Llama), squared ReLU (BitNet), tanh GELU (Gemma 3) */
    const float *q_norm, *k_norm; /* Qwen3, Gemma 3: [head_dim] each, per head before rotary (NULL: none) */
    int32_t rotary;               /* rotary dims, each head's leading (fewer than D: Phi-4-mini); 0: NoPE (SmolLM3) */
    /* Gemma 3 (engine/models/gemma3.py): RMSNorms of attention's and of the MLP's output, before each is
     * added to the residual (NULL: none) */
    const float *attn_out_norm, *mlp_out_norm;
    int64_t window;     /* > 0: attends to its last `window` keys, through the step's local tables; 0: all */
    int32_t local_rope; /* rotary from the step's local tables (Gemma 3's local layers: their own base) */
} TernDecoderLayer;

/* One decode step's rows: where each row's K/V go and what it attends to, in the main pool and in the
 * sliding-window layers' own pool (the main pool's again where a model has none), and the rotary
 * tables of the global and the local layers (the same where a model has one). */
typedef struct {
    const float *cos, *sin, *local_cos, *local_sin; /* [M, rotary] each, rows table_stride apart */
    int64_t table_stride;
    const int64_t *slots, *local_slots;         /* [M] */
    const int32_t *block_tables, *local_tables; /* [M, width], [M, local_width] */
    int64_t width, local_width;
    const int32_t *context_lens; /* [M] */
} TernDecodeStep;

/* The layer's intermediate rows, allocated once per step for all layers. */
typedef struct {
    float *normed, *qkv, *q, *attended, *projected, *gate_up, *activated;
} Workspace;

static inline void add_rows(float *hidden, const float *x, int64_t count) {
    for (int64_t i = 0; i < count; i++) hidden[i] += x[i];
}

/* gated_rows.c: out [M, I] = act(gate) * up for gate | up side by side in rows of 2I. */
void tern_gated_rows(int32_t activation, const float *gate_up, int64_t M, int64_t I, float *out);

/* ternary_stack.c: whether every layer is plain ternary (its one-region stack takes it), and that stack. */
int tern_ternary_stack(const TernDecoderLayer *layers, int64_t count, int64_t E);
int tern_run_ternary_layers(const TernDecoderLayer *layers, int64_t count, float *hidden, int64_t M, int64_t E,
                            const TernDecodeStep *step, const Workspace *ws);

#endif
