/* The entry points of the CPU kernels (quant_kernels.c, attention_kernels.c, layer_kernels.c), which
 * build into one shared library; layer_kernels.c calls the others. */
#ifndef TERN_KERNELS_H
#define TERN_KERNELS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* AVX-512 with its byte and word instructions (Intel since Skylake-SP, AMD since Zen 4): the matmul
 * tiles hold one quantization block a register. -DTERN_NO_AVX512 builds the AVX2 tiles instead (to
 * compare the two on one machine). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__) && !defined(TERN_NO_AVX512)
#define TERN_AVX512 1
#endif

/* q4_1 with VNNI's vpdpwssd and the weight stored tile by tile (q4_1_tiled_kernels.c, tiled_q4_1) wherever the
 * CPU has AVX-512 VNNI: on a Xeon 1.1-2x the tiles above at one row, 2-3x at 16 and 128 (docs/engine.md,
 * "The VNNI q4_1 kernel"). -DTERN_NO_Q4_VNNI (TERN_CPU_VNNI=0, engine/cpu/kernels.py) builds the tiles'
 * q4_1 instead. */
#if defined(TERN_AVX512) && defined(__AVX512VNNI__) && !defined(TERN_NO_Q4_VNNI)
#define TERN_Q4_TILED 1
#endif

/* The K-quant tiles (Q4_K, Q5_K, Q6_K tile by tile against int8 Q8_K rows): AVX-512 VNNI's where
 * TERN_Q4_TILED (kquant_tiled_kernels.c, q6_k_tiled_kernels.c), else 8 columns a 256-bit vector
 * wherever the CPU has AVX2 (TERN_KQ_TILED_256, kquant_tiled_avx2.c and q6_k_tiled_avx2.c), with
 * vpdpbusd where it has 256-bit VNNI (TERN_VNNI_256: AVX-VNNI, Intel since Alder Lake), vpmaddubsw +
 * vpmaddwd otherwise: the same integers, so the same bits in all three (docs/engine.md, "GGUF types"). */
#if defined(TERN_Q4_TILED) || (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__))
#define TERN_KQ_TILED 1
#endif
#if defined(TERN_KQ_TILED) && !defined(TERN_Q4_TILED)
#define TERN_KQ_TILED_256 1
#endif
#if defined(__AVXVNNI__)
#define TERN_VNNI_256 1
#define tern_dpbusd256 _mm256_dpbusd_avx_epi32 /* VEX-encoded: AVX-VNNI */
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TERN_VNNI_256 1
#define tern_dpbusd256 _mm256_dpbusd_epi32 /* EVEX-encoded: AVX-512 VNNI's 256-bit form */
#endif

/* Weight scales (and Q4_1 mins) are float16, as GGUF stores them: the bits, as uint16_t. */
int tern_matmul_q4_1(const float *x, int64_t M, int64_t K, const uint8_t *wq, const uint16_t *wd,
                     const uint16_t *wm, int64_t N, float *out);
int tern_q4_1_tiled(void);
int tern_matmul_q8_0(const float *x, int64_t M, int64_t K, const int8_t *wq, const uint16_t *wd, int64_t N,
                     float *out);
int tern_matmul_q5_0(const float *x, int64_t M, int64_t K, const uint8_t *wq, const uint16_t *wd, int64_t N,
                     float *out);
/* Rows of x for the K-quant kernels: int16 codes [M, K] with one scale a row (d [M]), and the exact
 * sums of each 32-block's codes, unscaled ([M, K/32]). */
typedef struct {
    int16_t *qs;
    float *d;
    float *sums;
} TernRows;
void tern_quantize_rows(const float *x, int64_t M, int64_t K, int16_t *qs, float *d, float *s);
int tern_kquant_rows(const float *x, int64_t M, int64_t K, TernRows *q);
void tern_free_kquant_rows(TernRows *q);
/* Rows of x for the K-quant tiles (q8k_rows.c, where TERN_KQ_TILED): llama.cpp's Q8_K,
 * int8 codes [M, K] with a scale a block of 256 (d [M, K/256]) and the exact sums of each 16 and each
 * 32 codes. */
typedef struct {
    int8_t *qs;
    float *d;
    int16_t *sums;   /* each 16 codes' sum ([M, K/16], at most 16 * 127: Q6_K's -32, paired for vpdpwssd) */
    int16_t *sums32; /* each 32 codes' sum ([M, K/32]; Q4_K's and Q5_K's mins, paired for vpdpwssd) */
} TernQ8KRows;
int tern_q8k_rows(const float *x, int64_t M, int64_t K, TernQ8KRows *q);
void tern_free_q8k_rows(TernQ8KRows *q);
/* Q4_K (q5 0) and Q5_K (q5 1) tile by tile (kquant_tiled_kernels.c or kquant_tiled_avx2.c, where
 * TERN_KQ_TILED; tern_kquant_tiles() says which): w from ggml_kernels.tile. */
int tern_kquant_tiles(void);
int tern_matmul_k_tiled(int q5, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *out);
int tern_tile_k(int q5, uint8_t *w, int64_t N, int64_t nsb);
/* Q8_0 (q5 0) and Q5_0 (q5 1) tile by tile on int8 rows, llama.cpp's Q8_0 activation blocks (q8_0_rows.c,
 * where TERN_KQ_TILED): int8 codes [M, K], a scale a block of 32 (d [M, K/32]) and each block's code sum. */
typedef struct {
    int8_t *qs;
    float *d;
    int32_t *sums;
} TernQ8Rows;
int tern_matmul_q8_0_tiled(int q5, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *out);
int tern_tile_q8_0(int q5, uint8_t *w, int64_t N, int64_t nb);
void tern_dequantize_q8_0_tiled(int q5, const uint8_t *w, int64_t N, int64_t nb, const int64_t *ids, int64_t count,
                                float *out);
void tern_quantize_rows_q8_0(const float *x, int64_t M, int64_t K, int8_t *qs, float *d, int32_t *sums);
/* One tile (16 columns' blocks from n0, the first C of them real) against all M rows of q, into out [M, N]:
 * q8_0_tiled_kernels.c (AVX-512 VNNI) or q8_0_tiled_avx2.c (AVX-VNNI, AVX2). */
__attribute__((visibility("hidden"))) void tern_q8_0_tile_rows(int q5, const uint8_t *tile, int64_t nb,
                                                               const TernQ8Rows *q, int64_t M, int64_t n0,
                                                               int64_t C, int64_t N, float *out);
/* The last tile's C < 16 columns padded to a whole tile (q8_0_rows.c). */
__attribute__((visibility("hidden"))) void tern_q8_0_pad_tile(int q5, const uint8_t *tile, int64_t nb, int64_t C,
                                                              uint8_t *out);
/* Q8_0 output heads on the same tiles against int16 rows, quant_rows.c's (q8_0_head_tiles.c). */
int tern_matmul_q8_0_head_tiled(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *out);
/* Q6_K tile by tile (q6_k_tiled_kernels.c), the same way. */
int tern_matmul_q6_k_tiled(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *out);
int tern_tile_q6_k(uint8_t *w, int64_t N, int64_t nsb);
void tern_dequantize_q6_k_tiled(const uint8_t *w, int64_t nsb, const int64_t *ids, int64_t count, float *out);
/* type 0 Q4_K, 1 Q5_K, 2 Q6_K; w [N, K/256] super-blocks as GGUF stores them (kquant_kernels.c). */
int tern_matmul_tq2(const float *x, int64_t M, int64_t K, const uint8_t *wq, const float *ws, const uint16_t *wd,
                    int64_t N, float *out);
/* Rows of x for the ternary kernel (ternary_activations.c): int8 codes [M, nb * 256] (blocks of 256,
 * padded with zeros), one scale a row (127 / absmax, [M]) and each block's code sum ([M, nb]). */
typedef struct {
    int8_t *qs;
    float *scale;
    int32_t *sums;
    int64_t nb;
} TernInt8Rows;
int tern_int8_rows(const float *x, int64_t M, int64_t K, TernInt8Rows *q);
void tern_free_int8_rows(TernInt8Rows *q);
void tern_quantize_rows_i8(const float *x, int64_t M, int64_t K, int8_t *qs, float *scale, int32_t *sums);
/* tern_matmul_tq2's tiles for rows already quantized, shared among the threads of the enclosing parallel
 * region (orphaned omp for), and the same for the decode attention (attention_kernels.c): the one-region
 * decode stack of layer_kernels.c. */
void tern_tq2_tiles(const TernInt8Rows *q, int64_t M, const uint8_t *wq, const float *ws, const uint16_t *wd,
                    int64_t N, float *out);
/* The one-row step of those tiles on AVX2 (ternary_row_avx2.c): four weight rows a pass, from n_begin (a
 * multiple of 4) while whole groups fit below n_end; returns the first weight row it did not do. */
#if defined(__AVX2__) && defined(__F16C__) && !defined(TERN_AVX512)
#define TERN_TQ2_ROW_AVX2 1
#endif
int64_t tern_tq2_row_avx2(const TernInt8Rows *x, int64_t r, const uint8_t *qs, const float *ws, const uint16_t *wd,
                          int64_t n_begin, int64_t n_end, int64_t N, float *out);
int64_t tern_attention_chunks(const int32_t *context_lens, int64_t window, int64_t B, int64_t *first);
void tern_paged_attention_work(const float *q, const void *k_cache, const void *v_cache, int half,
                               const int32_t *block_tables, int64_t width, const int32_t *context_lens,
                               int64_t window, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                               float scale, const int64_t *first, float *partials, float *out);
int tern_matmul_kquant(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *out);
int tern_paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, int half,
                                const int32_t *block_tables, int64_t width, const int32_t *context_lens,
                                int64_t window, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                                float scale, float *out);
void tern_rms_norm(const float *x, const float *weight, int64_t M, int64_t K, float eps, float *out);
void tern_silu_mul(const float *gate, const float *up, int64_t M, int64_t K, int64_t stride, float *out);
void tern_gelu_tanh_mul(const float *gate, const float *up, int64_t M, int64_t K, int64_t stride, float *out);

/* float16 bits -> float32 (exact). */
static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        int shift = 0;
        uint32_t m = mantissa;
        while (!(m & 0x400)) {
            m <<= 1;
            shift++;
        }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((m & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* float32 -> float16 bits, rounding to nearest even (torch's .to(torch.float16)). */
static inline uint16_t float_to_half(float f) {
#ifdef __F16C__
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t magnitude = x & 0x7FFFFFFFu;
    if (magnitude >= 0x7F800000u) /* inf or nan */
        return (uint16_t)(sign | 0x7C00u | (magnitude > 0x7F800000u ? 0x200u : 0u));
    if (magnitude >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* rounds past 65504 */
    if (magnitude < 0x38800000u) { /* a float16 subnormal or zero */
        float value;
        memcpy(&value, &magnitude, sizeof value);
        return (uint16_t)(sign | (uint32_t)nearbyintf(value * 16777216.0f)); /* units of 2^-24 */
    }
    const uint32_t rounded = magnitude + 0xFFFu + ((magnitude >> 13) & 1u);
    return (uint16_t)(sign | ((rounded - 0x38000000u) >> 13));
#endif
}

/* exp(x) for x in [-87, 88] (inputs are clamped there): Cephes' polynomial, within 2 ulp. The
 * vector and scalar versions do the same operations in the same order, so every element gets the
 * same result whichever of them computes it. */
#define EXP_LO -87.0f
#define EXP_HI 88.0f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
static const float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                  4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

static inline float exp_scalar(float x) {
    x = fminf(fmaxf(x, EXP_LO), EXP_HI);
    const float n = floorf(x * LOG2E + 0.5f);
    float r = x - n * LN2_HI;
    r = r - n * LN2_LO;
    float p = EXP_POLY[0];
    for (int i = 1; i < 6; i++) p = p * r + EXP_POLY[i];
    const float y = p * (r * r) + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

#ifdef __AVX2__
/* The sum of a vector's eight floats (in a fixed order). */
static inline float hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static inline __m256 exp_avx2(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    const __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(LN2_HI)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(LN2_LO)));
    __m256 p = _mm256_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 6; i++) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(EXP_POLY[i]));
    const __m256 y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}
#endif

#endif
