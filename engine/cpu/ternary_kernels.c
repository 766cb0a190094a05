/* Ternary (BitNet b1.58) matmuls for CPUs: weights at two bits, activations int8 per token.
 *
 *   out[M, N] = x[M, K] @ W[N, K]^T, W = T * scale, T in {-1, 0, 1}
 *
 * Weights: GGUF TQ2_0's codes (T + 1 in 2 bits, four a byte) in blocks of 256 along K, 64 bytes a
 * block: byte 32c + m of a block holds elements 128c + 32j + m in bits 2j (j = 0..3), so one load
 * and a shift give 32 (AVX2) or 64 (AVX-512) codes in the order of the activations. K is padded to
 * whole blocks with code 1 (a zero weight). The scale is either one float per weight row
 * (`ws`: transformers' BitNet `weight_scale` inverted, or a TQ2_0 tensor whose blocks share one
 * scale) or one float16 per block (`wd`: TQ2_0 as llama-quantize writes it, each block's absmax).
 *
 * Layout (ternary.py, `kernel_layout`): rows in groups of four (the last the N % 4 left), a group's
 * blocks interleaved, block b of its row r at block 4g * nb + b * rows + r (the block scales too): four
 * rows at a time read one stream, not four that the prefetcher missed (one row, one Zen 4 thread:
 * 8-10 GB/s row by row, 20, the memory's speed, interleaved; docs/quantization.md).
 *
 * Activations: BitNet's per-token absmax quantization to int8, scale s a row (ternary_activations.c).
 *
 * Each block product is an integer dot product of unsigned codes (0..2) and signed activations
 * (vpdpbusd with AVX-512 VNNI, vpmaddubsw + vpmaddwd otherwise; on AVX2 one activation row, a decode
 * step at one stream, runs ternary_row_avx2.c's four weight rows a pass), exact; the codes' offset of one
 * is taken out with the sum of the block's activation codes. Then, per output element:
 *
 *   row scales:   out = (float)dot / s * ws[n]                        (the torch path's formula)
 *   block scales: out = (sum over blocks in order of (float)dot_b * wd[n, b]) / s
 *
 * so every element is one integer and the same float operations in the same order whatever the
 * batch, the tile shape or the thread count; tests/engine/test_ternary_cpu_kernels.py checks them
 * bit for bit against plain-torch references (engine/cpu/ternary.py, `*_ref`).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define QKT 256                /* elements per block (GGUF's QK_K) */
#define BLOCK_BYTES (QKT / 4)  /* 64 */
#define T_TILE_N 16            /* weight rows per tile (what one thread takes at a time) */
/* Activation rows per pass over the weights: a prompt's int8 rows (x) stay in the L2 cache while the
 * tiles of the weight stream past them once per pass, instead of every tile re-reading all the rows. */
#define CHUNK_BYTES (256 * 1024)
/* the activation rows (ternary_activations.c); AVX-512: within a block, group j is elements 32j.. then
 * 128 + 32j.. */
typedef TernInt8Rows TernaryRows;

typedef struct {
    const uint8_t *qs;  /* [N, nb, 64], rows interleaved in fours (the layout above) */
    const float *ws;    /* [N] or NULL */
    const uint16_t *wd; /* [N, nb] float16, interleaved as qs, or NULL */
    int64_t nb, n;
} TernaryWeights;

/* Where block b of weight row n is in the interleaved layout, counted in blocks. */
static inline int64_t block_index(const TernaryWeights *w, int64_t n, int64_t b) {
    const int64_t first = n & ~(int64_t)3, rows = w->n - first < 4 ? w->n - first : 4;
    return first * w->nb + b * rows + (n - first);
}


/* The micro-kernel: RR activation rows from r0 against CC weight rows from n0. BLOCKED (a constant at
 * each use) picks the block scales' arithmetic over the row scales'. */
#if defined(TERN_AVX512)
static inline __attribute__((always_inline)) __m512i dot_u8s8(__m512i acc, __m512i codes, __m512i x) {
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(acc, codes, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(codes, x), _mm512_set1_epi16(1)));
#endif
}

static inline __attribute__((always_inline)) void ternary_tile(const TernaryWeights *w, const TernaryRows *x,
                                                               int64_t r0, int64_t n0, int64_t N, float *out,
                                                               const int RR, const int CC, const int BLOCKED) {
    const int64_t nb = w->nb;
    const __m512i three = _mm512_set1_epi8(3);
    __m512i dots[4][4];
    float totals[4][4];
    for (int i = 0; i < RR; i++)
        for (int j = 0; j < CC; j++) {
            dots[i][j] = _mm512_setzero_si512();
            totals[i][j] = 0.0f;
        }
    for (int64_t b = 0; b < nb; b++) {
        __m512i packed[4];
        /* four columns: one group, its blocks side by side (the column loop takes them four-aligned) */
        const uint8_t *group = w->qs + (CC == 4 ? n0 * nb + 4 * b : 0) * BLOCK_BYTES;
        /* a prompt's tiles (compute bound) take the stream 1 KiB ahead into L1 (16 rows: 2.65 -> 2.13 ms for
         * 2048 x 8192, one thread); one row's call is faster without (0.19 -> 0.22 ms with) */
        for (int j = 0; j < 4 && CC == 4 && RR > 1; j++) _mm_prefetch((const char *)group + 1024 + 64 * j, _MM_HINT_T0);
        for (int j = 0; j < CC; j++)
            packed[j] = _mm512_loadu_si512(
                (const void *)(CC == 4 ? group + j * BLOCK_BYTES : w->qs + block_index(w, n0 + j, b) * BLOCK_BYTES));
        for (int g = 0; g < 4; g++) {
            __m512i codes[4];
            for (int j = 0; j < CC; j++) {
                codes[j] = _mm512_and_si512(packed[j], three);
                packed[j] = _mm512_srli_epi16(packed[j], 2);
            }
            for (int i = 0; i < RR; i++) {
                const __m512i xv = _mm512_loadu_si512((const void *)(x->qs + ((r0 + i) * nb + b) * QKT + 64 * g));
                for (int j = 0; j < CC; j++) dots[i][j] = dot_u8s8(dots[i][j], codes[j], xv);
            }
        }
        if (BLOCKED && CC == 4) {
            /* Four columns' block sums in one vector (a transposing add tree, a third of four separate
             * reductions), then each lane's (float)dot * d and total + part: lane j is column j's
             * operations, in the order of the scalar ones below. The four columns are one group (the
             * column loop takes them four-aligned), their block scales side by side. */
            const __m128 d = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(w->wd + block_index(w, n0, b))));
            for (int i = 0; i < RR; i++) {
                __m256i halves[4];
                for (int j = 0; j < 4; j++) {
                    halves[j] = _mm256_add_epi32(_mm512_castsi512_si256(dots[i][j]), _mm512_extracti64x4_epi64(dots[i][j], 1));
                    dots[i][j] = _mm512_setzero_si512();
                }
                const __m256i pairs = _mm256_hadd_epi32(_mm256_hadd_epi32(halves[0], halves[1]),
                                                        _mm256_hadd_epi32(halves[2], halves[3]));
                const __m128i sums4 = _mm_add_epi32(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
                const __m128i block = _mm_sub_epi32(sums4, _mm_set1_epi32(x->sums[(r0 + i) * nb + b]));
                const __m128 part = _mm_mul_ps(_mm_cvtepi32_ps(block), d);
                _mm_storeu_ps(totals[i], _mm_add_ps(_mm_loadu_ps(totals[i]), part));
            }
        } else if (BLOCKED) {
            for (int i = 0; i < RR; i++)
                for (int j = 0; j < CC; j++) {
                    const int32_t dot = _mm512_reduce_add_epi32(dots[i][j]) - x->sums[(r0 + i) * nb + b];
                    const float part = (float)dot * half_to_float(w->wd[block_index(w, n0 + j, b)]);
                    totals[i][j] = totals[i][j] + part;
                    dots[i][j] = _mm512_setzero_si512();
                }
        }
    }
    for (int i = 0; i < RR; i++) {
        int32_t row_sum = 0;
        if (!BLOCKED)
            for (int64_t b = 0; b < nb; b++) row_sum += x->sums[(r0 + i) * nb + b];
        for (int j = 0; j < CC; j++) {
            float *o = out + (r0 + i) * N + n0 + j;
            if (BLOCKED)
                *o = totals[i][j] / x->scale[r0 + i];
            else
                *o = (float)(_mm512_reduce_add_epi32(dots[i][j]) - row_sum) / x->scale[r0 + i] * w->ws[n0 + j];
        }
    }
}
#define T_ROWS 4
#define T_COLUMNS 4
#define T_ONE_ROW_COLUMNS 4
#elif defined(__AVX2__)
static inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* vpmaddubsw's int16 pairs are at most 2 * 2 * 128 = 512, eight of them a block 4096: a block sums in
 * int16, then widens once. */
static inline __attribute__((always_inline)) void ternary_tile(const TernaryWeights *w, const TernaryRows *x,
                                                               int64_t r0, int64_t n0, int64_t N, float *out,
                                                               const int RR, const int CC, const int BLOCKED) {
    const int64_t nb = w->nb;
    const __m256i three = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
    __m256i dots[4][2];
    float totals[4][2], totals4_out[4];
    __m128 totals4 = _mm_setzero_ps();
    for (int i = 0; i < RR; i++)
        for (int j = 0; j < CC; j++) {
            dots[i][j] = _mm256_setzero_si256();
            totals[i][j] = 0.0f;
        }
    for (int64_t b = 0; b < nb; b++) {
        __m256i block[4][2];
        for (int i = 0; i < RR; i++)
            for (int j = 0; j < CC; j++) block[i][j] = _mm256_setzero_si256();
        for (int half = 0; half < 2; half++) {
            __m256i packed[2];
            for (int j = 0; j < CC; j++) {
                const uint8_t *wb = w->qs + block_index(w, n0 + j, b) * BLOCK_BYTES + 32 * half;
                if (RR > 1) _mm_prefetch((const char *)wb + 1024, _MM_HINT_T0); /* as the AVX-512 tile's */
                packed[j] = _mm256_loadu_si256((const __m256i *)wb);
            }
            for (int g = 0; g < 4; g++) {
                __m256i codes[2];
                for (int j = 0; j < CC; j++) {
                    codes[j] = _mm256_and_si256(packed[j], three);
                    packed[j] = _mm256_srli_epi16(packed[j], 2);
                }
                for (int i = 0; i < RR; i++) {
                    const int8_t *xb = x->qs + ((r0 + i) * nb + b) * QKT + 128 * half + 32 * g;
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)xb);
                    for (int j = 0; j < CC; j++) block[i][j] = _mm256_add_epi16(block[i][j], _mm256_maddubs_epi16(codes[j], xv));
                }
                /* Each group's sums in registers before the next group's products: unconstrained, GCC
                 * computes all 32 products of a block first and spills them (0.17 instructions a
                 * multiply-add instead of 0.09, callgrind). */
                for (int i = 0; i < RR; i++)
                    for (int j = 0; j < CC; j++) __asm__ volatile("" : "+x"(block[i][j]));
            }
        }
        if (BLOCKED && RR == 4 && CC == 1) {
            /* Four rows' block sums in one vector (a transposing add tree), then each lane's
             * (float)dot * d and total + part: lane i is row i's operations, in the scalar order. */
            __m256i wide[4];
            for (int i = 0; i < 4; i++) wide[i] = _mm256_madd_epi16(block[i][0], ones);
            const __m256i pairs = _mm256_hadd_epi32(_mm256_hadd_epi32(wide[0], wide[1]), _mm256_hadd_epi32(wide[2], wide[3]));
            const __m128i sums4 = _mm_add_epi32(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
            const __m128i rows_sums = _mm_setr_epi32(x->sums[r0 * nb + b], x->sums[(r0 + 1) * nb + b],
                                                     x->sums[(r0 + 2) * nb + b], x->sums[(r0 + 3) * nb + b]);
            const __m128 part = _mm_mul_ps(_mm_cvtepi32_ps(_mm_sub_epi32(sums4, rows_sums)),
                                           _mm_set1_ps(half_to_float(w->wd[block_index(w, n0, b)])));
            totals4 = _mm_add_ps(totals4, part);
            continue;
        }
        for (int i = 0; i < RR; i++)
            for (int j = 0; j < CC; j++) {
                const __m256i wide = _mm256_madd_epi16(block[i][j], ones);
                if (BLOCKED) {
                    const int32_t dot = hsum_epi32(wide) - x->sums[(r0 + i) * nb + b];
                    const float part = (float)dot * half_to_float(w->wd[block_index(w, n0 + j, b)]);
                    totals[i][j] = totals[i][j] + part;
                } else {
                    dots[i][j] = _mm256_add_epi32(dots[i][j], wide);
                }
            }
    }
    if (BLOCKED && RR == 4 && CC == 1) _mm_storeu_ps(totals4_out, totals4);
    for (int i = 0; i < RR; i++) {
        int32_t row_sum = 0;
        if (!BLOCKED)
            for (int64_t b = 0; b < nb; b++) row_sum += x->sums[(r0 + i) * nb + b];
        for (int j = 0; j < CC; j++) {
            float *o = out + (r0 + i) * N + n0 + j;
            if (BLOCKED)
                *o = (RR == 4 && CC == 1 ? totals4_out[i] : totals[i][j]) / x->scale[r0 + i];
            else
                *o = (float)(hsum_epi32(dots[i][j]) - row_sum) / x->scale[r0 + i] * w->ws[n0 + j];
        }
    }
}
#define T_ROWS 4
/* One weight row at a time (the activations are vpmaddubsw's memory operand; two weight rows' int16 and
 * int32 sums spilled AVX2's 16 registers). One activation row (a one-stream step) takes a group of four
 * weight rows a pass in ternary_row_avx2.c (0.226 -> 0.136 instructions a multiply-add, callgrind), the
 * N % 4 left two and one at a time here. */
#define T_COLUMNS 1
#define T_ONE_ROW_COLUMNS 2
#else
/* Portable version: the same integers and the same float operations. */
static inline void ternary_tile(const TernaryWeights *w, const TernaryRows *x, int64_t r0, int64_t n0, int64_t N,
                                float *out, const int RR, const int CC, const int BLOCKED) {
    const int64_t nb = w->nb;
    for (int i = 0; i < RR; i++)
        for (int j = 0; j < CC; j++) {
            const int64_t r = r0 + i, n = n0 + j;
            int32_t whole = 0;
            float total = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *wb = w->qs + block_index(w, n, b) * BLOCK_BYTES;
                const int8_t *xb = x->qs + (r * nb + b) * QKT;
                int32_t dot = -x->sums[r * nb + b];
                for (int e = 0; e < QKT; e++) dot += ((wb[(e / 128) * 32 + e % 32] >> (2 * ((e % 128) / 32))) & 3) * xb[e];
                if (BLOCKED) {
                    const float part = (float)dot * half_to_float(w->wd[block_index(w, n, b)]);
                    total = total + part;
                } else {
                    whole += dot;
                }
            }
            out[r * N + n] = BLOCKED ? total / x->scale[r] : (float)whole / x->scale[r] * w->ws[n];
        }
}
#define T_ROWS 4
#define T_COLUMNS 1
#define T_ONE_ROW_COLUMNS 1
#endif

/* One activation row against whole groups of four weight rows from n, where the ISA has a one-row kernel
 * of its own (AVX2): the first weight row left. */
static inline int64_t one_row_groups(const TernaryWeights *w, const TernaryRows *x, int64_t r, int64_t n,
                                     int64_t n_end, int64_t N, float *out) {
#ifdef TERN_TQ2_ROW_AVX2
    return tern_tq2_row_avx2(x, r, w->qs, w->ws, w->wd, n, n_end, N, out);
#else
    (void)w, (void)x, (void)r, (void)n_end, (void)N, (void)out;
    return n;
#endif
}

/* One tile of weight rows [n_begin, n_end) against activation rows [r_begin, r_end): T_COLUMNS weight
 * rows at a time and the last ones alone, T_ROWS activation rows at a time and a tail of fewer. */
#define T_COLUMN_LOOP(RR, BLOCKED)                                                                      \
    do {                                                                                                \
        int64_t n = n_begin;                                                                            \
        if (RR == 1) n = one_row_groups(w, x, r, n, n_end, N, out);                                     \
        if (RR == 1)                                                                                \
            for (; n + T_ONE_ROW_COLUMNS <= n_end; n += T_ONE_ROW_COLUMNS)                                  \
                ternary_tile(w, x, r, n, N, out, RR, T_ONE_ROW_COLUMNS, BLOCKED);                          \
        for (; n + T_COLUMNS <= n_end; n += T_COLUMNS) ternary_tile(w, x, r, n, N, out, RR, T_COLUMNS, BLOCKED); \
        for (; n < n_end; n++) ternary_tile(w, x, r, n, N, out, RR, 1, BLOCKED);                         \
    } while (0)

#define T_ROW_LOOP(BLOCKED)                                                  \
    do {                                                                     \
        int64_t r = r_begin;                                                 \
        for (; r + T_ROWS <= r_end; r += T_ROWS) T_COLUMN_LOOP(T_ROWS, BLOCKED); \
        switch (r_end - r) {                                                 \
        case 3: T_COLUMN_LOOP(3, BLOCKED); break;                            \
        case 2: T_COLUMN_LOOP(2, BLOCKED); break;                            \
        case 1: T_COLUMN_LOOP(1, BLOCKED); break;                            \
        default: break;                                                      \
        }                                                                    \
    } while (0)

/* Without tree reassociation: GCC otherwise turns each row's chain of integer adds into a tree over
 * all the block's products, which it then spills (AVX2: 0.18 instructions a multiply-add instead of
 * 0.09, callgrind). */
__attribute__((optimize("no-tree-reassoc"))) static void ternary_tile_rows(const TernaryWeights *w, const TernaryRows *x, int64_t r_begin, int64_t r_end,
                              int64_t n_begin, int64_t n_end, int64_t N, float *out) {
    if (w->wd) T_ROW_LOOP(1);
    else T_ROW_LOOP(0);
}

/* out [M, N] = q @ (T * scale)^T for quantized rows q (tern_int8_rows), the weights as tern_matmul_tq2
 * takes them, shared among the threads of the enclosing parallel region (an orphaned omp for a chunk of
 * rows, each ending in a barrier; on the calling thread alone outside one): layer_kernels.c's decode
 * stack calls it inside its one region. */
void tern_tq2_tiles(const TernInt8Rows *q, int64_t M, const uint8_t *wq, const float *ws, const uint16_t *wd,
                    int64_t N, float *out) {
    const int64_t nb = q->nb;
    const TernaryWeights w = {wq, ws, wd, nb, N};
    const int64_t tiles = (N + T_TILE_N - 1) / T_TILE_N;
    int64_t chunk = CHUNK_BYTES / (nb * QKT);
    chunk = chunk < T_ROWS ? T_ROWS : chunk - chunk % T_ROWS;
    for (int64_t r0 = 0; r0 < M; r0 += chunk) {
        const int64_t r1 = r0 + chunk < M ? r0 + chunk : M;
        /* Guided, as the q4_1 kernel: long runs of consecutive tiles first (one stream through the
         * weight for the prefetchers), then shorter ones so that a preempted thread's tail is shared. */
#pragma omp for schedule(guided)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n0 = t * T_TILE_N, n1 = n0 + T_TILE_N < N ? n0 + T_TILE_N : N;
            ternary_tile_rows(&w, q, r0, r1, n0, n1, N, out);
        }
    }
}

/* out [M, N] = x [M, K] @ (T * scale)^T, T from wq [N, Kp / 4] (Kp: K rounded up to 256), the scale
 * per weight row (ws [N], wd NULL) or per block (wd [N, Kp / 256] float16, ws NULL); wq and wd in the
 * interleaved layout above. 0 on success, -1 out of memory, -2 bad arguments. */
int tern_matmul_tq2(const float *x, int64_t M, int64_t K, const uint8_t *wq, const float *ws, const uint16_t *wd,
                    int64_t N, float *out) {
    if (K <= 0 || (ws == NULL) == (wd == NULL)) return -2;
    if (M == 0 || N == 0) return 0;
    TernaryRows q;
    if (tern_int8_rows(x, M, K, &q)) return tern_free_int8_rows(&q), -1;
#pragma omp parallel
    tern_tq2_tiles(&q, M, wq, ws, wd, N, out);
    tern_free_int8_rows(&q);
    return 0;
}
