/* Weight-only quantized matmuls for CPUs, the way llama.cpp runs GGUF models.
 *
 *   out[M, N] = x[M, K] @ W[N, K]^T, x float32, W quantized in blocks of 32 along K.
 *
 * These are the row-by-row tiles on int16 rows. A GGUF file's own Q8_0 and Q5_0 linears run them only
 * where the CPU has no AVX2: elsewhere they are tiled at load and run on int8 rows, llama.cpp's Q8_0
 * activation blocks, with vpdpbusd (q8_0_rows.c, q8_0_tiled_kernels.c, q8_0_tiled_avx2.c; callgrind at
 * 2048 x 2048 on AVX2: Q8_0 0.475 -> 0.280 instructions a multiply-add at 1 row, 0.287 -> 0.229 at 16;
 * Q5_0 0.865 -> 0.337 and 0.318 -> 0.196; docs/engine.md, "The K-quant tiles by instruction set"). What
 * stays here: q4_1 (the default model's, where the CPU has no AVX-512 VNNI), q8_0 for float weights
 * requantized at load (Q8CpuLinear: F16/BF16 linears and the types with no kernel of their own), and Q5_0
 * output heads (the default model's tied Q8_0 head: int8 rows flipped a greedy answer,
 * ggml_linear.HEADS_ON_INT16_ROWS; Q8_0 heads run these int16 rows on the int8 tiles' layout instead,
 * q8_0_head_tiles.c).
 *
 * Each row of x is quantized on the fly to int16 with one float scale dx (15 bits against the row's
 * largest value; llama.cpp's int8 blocks lose enough to flip near-tied greedy tokens), and each
 * block product is an integer dot product (vpmaddwd: a block a 512-bit register with AVX-512, two
 * 256-bit halves with AVX2), scaled once per block:
 *
 *   q4_1 weights (GGUF Q4_1): w = code * d + m, code 0..15, two codes a byte (byte j holds elements
 *        j and j + 16 of its block);  x . w = dx * sum_blocks(dw * sum(code * qx)) + sum_blocks(m * dx * sum(qx)).
 *   q8_0 weights (GGUF Q8_0): w = q * d, q int8;  x . w = dx * sum_blocks(dw * sum(q * qx)).
 *   q5_0 weights (GGUF Q5_0): w = (q - 16) * d, q 5 bits: a block's four bytes of fifth bits (bit j:
 *        element j), then its low nibbles as q4_1's; unpacked to q - 16 in int16 lanes, the rest is
 *        q8_0's arithmetic, so a Q5_0 weight gives bit for bit what its exact Q8_0 conversion gives.
 *
 * d and m are float16, as GGUF stores them (a fifth of a Q4_1 block's bytes; float32 would add a
 * sixth to the bytes a decode step streams from memory).
 *
 * Every output element is computed by one thread, in the same order whatever the number of rows or
 * threads, so a row's result does not depend on the batch it is in (the engine's batch independence).
 * The weight is read once per tile of output rows for all rows of x (a GEMM, not one GEMV per row).
 * Plain-torch references: engine/cpu/kernels.py (`*_ref`), tested in tests/engine/test_cpu_kernels.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "quant_rows.h"

/* The weight formats of the row-by-row tiles (a constant at each use of the micro-kernels). */
#define FMT_Q8_0 0
#define FMT_Q4_1 1
#define FMT_Q5_0 2
/* Bytes of codes a block: q5_0's fifth bits (4 bytes) and nibbles (16), its scale apart as q8_0's. */
#define CODE_BYTES(F) ((F) == FMT_Q8_0 ? QK : (F) == FMT_Q4_1 ? 16 : 20)

/* Micro-kernels: RR rows of x against CC weight rows, every output element one float accumulator
 * over the blocks in order, then its horizontal sum (q4_1's min term is added per tile): the same arithmetic
 * for an element whichever micro-kernel computes it, so the result does not depend on the batch.
 * Several elements at once hide the latency of each accumulator's chain of FMAs. */

/* float16 -> float32, count of them (8 at a time where the CPU has F16C). */
static void halves_to_floats(const uint16_t *h, int64_t count, float *out) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < count; i++) out[i] = half_to_float(h[i]);
}

/* q4_1's min term, sum over blocks of m[n, b] * s[r, b], for a whole tile: its mins are stored tile by
 * tile, block by block ([N / TILE_N, nb, TILE_N], zero past N: kernels.tile_blocks), so each row takes 8
 * columns a vector, one FMA chain per element in block order. Per output element (a horizontal sum
 * and a scalar tail each) it had cost a quarter of a 16-row GEMM at K = 576. */
static void tile_mins(const Weights *w, int64_t tile, float *mins) {
    halves_to_floats(w->m + tile * w->nb * TILE_N, w->nb * TILE_N, mins);
}

static void add_min_terms(const float *mins, const QuantizedRows *x, int64_t M, int64_t nb, int64_t n0, int64_t n1,
                          int64_t N, float *out) {
    for (int64_t r = 0; r < M; r++) {
        const float *s = x->s + r * nb;
        float sums[TILE_N];
#ifdef __AVX2__
        __m256 acc[TILE_N / 8];
        for (int v = 0; v < TILE_N / 8; v++) acc[v] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++)
            for (int v = 0; v < TILE_N / 8; v++)
                acc[v] = _mm256_fmadd_ps(_mm256_set1_ps(s[b]), _mm256_loadu_ps(mins + b * TILE_N + v * 8), acc[v]);
        for (int v = 0; v < TILE_N / 8; v++) _mm256_storeu_ps(sums + v * 8, acc[v]);
#else
        for (int j = 0; j < TILE_N; j++) sums[j] = 0.0f;
        for (int64_t b = 0; b < nb; b++)
            for (int j = 0; j < TILE_N; j++) sums[j] = fmaf(s[b], mins[b * TILE_N + j], sums[j]);
#endif
        for (int64_t n = n0; n < n1; n++) out[r * N + n] += sums[n - n0];
    }
}

/* The scales of weight rows [n0, n1) as float32, [n1 - n0, nb]: converted once per tile, so that in
 * the inner loops each block's scale reaches the multiply as a broadcast from memory. */
static void tile_scales(const Weights *w, int64_t n0, int64_t n1, float *out) {
    halves_to_floats(w->d + n0 * w->nb, (n1 - n0) * w->nb, out);
}

#ifdef __AVX2__
/* A q5_0 block's 32 codes q - 16 in int8, in element order, from its 20 bytes (wb: fifth bits, then
 * nibbles): the 16 bytes' low nibbles (elements 0..15), then their high ones (16..31), less 16 where
 * fifth bit j is clear. With AVX-512 (VL) that is one masked subtract by the bits; with AVX2, byte j of
 * the bits' broadcast, or'ed with every bit but bit j % 8, is 0xFF where bit j is set. */
static inline __attribute__((always_inline)) __m256i q5_0_bytes(const uint8_t *wb) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)(wb + 4));
    const __m256i both = _mm256_and_si256(
        _mm256_inserti128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1), _mm256_set1_epi8(0x0F));
    uint32_t high;
    memcpy(&high, wb, sizeof high);
#if defined(TERN_AVX512) && defined(__AVX512VL__)
    return _mm256_mask_sub_epi8(both, (__mmask32)~high, both, _mm256_set1_epi8(16));
#else
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)high),
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                 0x0101010101010101, 0x0000000000000000));
    const __m256i set =
        _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
    return _mm256_sub_epi8(both, _mm256_andnot_si256(set, _mm256_set1_epi8(16)));
#endif
}
#endif

/* The micro-kernel: RR rows of x from r0 against CC weight rows from n0, whose float scales start at
 * dw (dw[j * nb + b]: weight row n0 + j, block b). Q4 (FMT_*, a constant at each use) picks the weight
 * format, which only changes how a block's codes are unpacked. */
#if defined(TERN_AVX512)
/* Block b of weight row n as 32 int16 codes, in the order of the row's activations. */
static inline __attribute__((always_inline)) __m512i block_codes(const Weights *w, int64_t n, int64_t b, const int Q4) {
    const uint8_t *wb = w->qs + ((n - w->row0) * w->nb + b) * CODE_BYTES(Q4);
    _mm_prefetch((const char *)wb + PREFETCH_BYTES, _MM_HINT_T0);
    if (Q4 == FMT_Q8_0) return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)wb));
    if (Q4 == FMT_Q5_0) return _mm512_cvtepi8_epi16(q5_0_bytes(wb)); /* in bytes, then widened as q8_0's */
    /* the block's 16 bytes in both halves: lanes 0..15 keep the low nibbles (elements 0..15), lanes
     * 16..31 are shifted to the high ones (elements 16..31) */
    const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)wb)));
    return _mm512_and_si512(_mm512_srlv_epi16(bytes, shifts), _mm512_set1_epi16(0x0F));
}

/* One block a register: one vpmaddwd, one conversion and one FMA per block, row and column. */
static inline __attribute__((always_inline)) void tile(const Weights *w, const float *dw, const QuantizedRows *x,
                                                       int64_t r0, int64_t n0, int64_t N, float *out, const int RR,
                                                       const int CC, const int Q4) {
    const int64_t nb = w->nb;
    __m512 acc[4][4];
    for (int i = 0; i < RR; i++)
        for (int j = 0; j < CC; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i codes[4];
        for (int j = 0; j < CC; j++) codes[j] = block_codes(w, n0 + j, b, Q4);
        for (int i = 0; i < RR; i++) {
            const __m512i xq = _mm512_loadu_si512((const void *)(x->qs + ((r0 + i) * nb + b) * QK));
            for (int j = 0; j < CC; j++)
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(codes[j], xq)),
                                            _mm512_set1_ps(dw[j * nb + b]), acc[i][j]);
        }
    }
    for (int i = 0; i < RR; i++)
        for (int j = 0; j < CC; j++) out[(r0 + i) * N + n0 + j] = _mm512_reduce_add_ps(acc[i][j]) * x->d[r0 + i];
}
#elif defined(__AVX2__)
/* Block b of weight row n as int16 codes: elements 0..15 into *first, 16..31 into *second. */
static inline __attribute__((always_inline)) void block_codes(const Weights *w, int64_t n, int64_t b, const int Q4,
                                                              __m256i *first, __m256i *second) {
    const uint8_t *wb = w->qs + ((n - w->row0) * w->nb + b) * CODE_BYTES(Q4);
    _mm_prefetch((const char *)wb + PREFETCH_BYTES, _MM_HINT_T0);
    if (Q4 == FMT_Q5_0) { /* in bytes, then widened as q8_0's */
        const __m256i codes = q5_0_bytes(wb);
        *first = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(codes));
        *second = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(codes, 1));
    } else if (Q4 == FMT_Q4_1) { /* each byte widened to int16 once, then split: low nibbles (elements 0..15), high (16..31) */
        const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)wb));
        *first = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F));
        *second = _mm256_srli_epi16(bytes, 4);
    } else {
        *first = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)wb));
        *second = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wb + 16)));
    }
}

static inline __attribute__((always_inline)) void tile(const Weights *w, const float *dw, const QuantizedRows *x,
                                                       int64_t r0, int64_t n0, int64_t N, float *out, const int RR,
                                                       const int CC, const int Q4) {
    const int64_t nb = w->nb;
    __m256 acc[4][4];
    for (int i = 0; i < RR; i++)
        for (int j = 0; j < CC; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i first[4], second[4];
        for (int j = 0; j < CC; j++) block_codes(w, n0 + j, b, Q4, &first[j], &second[j]);
        for (int i = 0; i < RR; i++) {
            const int16_t *xb = x->qs + ((r0 + i) * nb + b) * QK;
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)xb);
            const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xb + 16));
            for (int j = 0; j < CC; j++) {
                const __m256i prod = _mm256_add_epi32(_mm256_madd_epi16(first[j], x0), _mm256_madd_epi16(second[j], x1));
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(prod), _mm256_set1_ps(dw[j * nb + b]), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < RR; i++)
        for (int j = 0; j < CC; j++) out[(r0 + i) * N + n0 + j] = hsum8(acc[i][j]) * x->d[r0 + i];
}
#else
/* Portable version: the same per-element arithmetic without vectors. */
static inline int block_dot(const Weights *w, int64_t n, int64_t b, const int16_t *qx, const int Q4) {
    int sum = 0;
    if (Q4 == FMT_Q4_1) {
        const uint8_t *wq = w->qs + ((n - w->row0) * w->nb + b) * 16;
        for (int k = 0; k < 16; k++) sum += (wq[k] & 0x0F) * qx[k] + (wq[k] >> 4) * qx[k + 16];
    } else if (Q4 == FMT_Q5_0) {
        const uint8_t *wq = w->qs + ((n - w->row0) * w->nb + b) * 20;
        const uint32_t high = (uint32_t)wq[0] | (uint32_t)wq[1] << 8 | (uint32_t)wq[2] << 16 | (uint32_t)wq[3] << 24;
        for (int k = 0; k < 16; k++)
            sum += ((int)((wq[4 + k] & 0x0F) | ((high >> k) & 1) << 4) - 16) * qx[k] +
                   ((int)((wq[4 + k] >> 4) | ((high >> (k + 16)) & 1) << 4) - 16) * qx[k + 16];
    } else {
        const int8_t *wq = (const int8_t *)w->qs + ((n - w->row0) * w->nb + b) * QK;
        for (int k = 0; k < QK; k++) sum += wq[k] * qx[k];
    }
    return sum;
}

static inline void tile(const Weights *w, const float *dw, const QuantizedRows *x, int64_t r0, int64_t n0, int64_t N,
                        float *out, const int RR, const int CC, const int Q4) {
    const int64_t nb = w->nb;
    for (int i = 0; i < RR; i++)
        for (int j = 0; j < CC; j++) {
            const int64_t r = r0 + i, n = n0 + j;
            float total = 0.0f;
            for (int64_t b = 0; b < nb; b++)
                total += dw[j * nb + b] * (float)block_dot(w, n, b, x->qs + (r * nb + b) * QK, Q4);
            out[r * N + n] = total * x->d[r];
        }
}
#endif

/* q5_0 weight rows [n0, n1) as q8_0's int8 codes q - 16, [n1 - n0, nb, 32]. A call of more than one group
 * of 4 rows unpacks each block of a tile once for all of them, not once a group, then runs the q8_0
 * micro-kernels on it: the same int16 codes and the same arithmetic for each element, so a row's result
 * is the one the q5_0 micro-kernels give it in a smaller batch. */
static void unpack_q5_0(const Weights *w, int64_t n0, int64_t n1, int8_t *codes) {
    for (int64_t n = n0; n < n1; n++)
        for (int64_t b = 0; b < w->nb; b++) {
            const uint8_t *wb = w->qs + (n * w->nb + b) * 20;
            int8_t *dst = codes + ((n - n0) * w->nb + b) * QK;
#ifdef __AVX2__
            _mm256_storeu_si256((__m256i *)dst, q5_0_bytes(wb));
#else
            uint32_t high;
            memcpy(&high, wb, sizeof high);
            for (int k = 0; k < 16; k++) {
                dst[k] = (int8_t)((int)((wb[4 + k] & 0x0F) | ((high >> k) & 1) << 4) - 16);
                dst[k + 16] = (int8_t)((int)((wb[4 + k] >> 4) | ((high >> (k + 16)) & 1) << 4) - 16);
            }
#endif
        }
}

/* Weight rows per micro-kernel (at most 4). 2 keeps AVX2's 16 registers from spilling at 4 rows of x;
 * 4 measured slower with AVX-512 too (docs/engine.md, "On an Intel Xeon with AMX"). */
#define TILE_COLUMNS 2

/* One tile of TILE_N weight rows against RR rows of x from r0: TILE_COLUMNS weight rows at a time, the
 * last ones alone; q8_0 under 4 rows of x one weight row at a time (one stream through memory, not two:
 * 15 GB/s a core against 10 at one row; an element's arithmetic is the same either way). RR and Q4 are constants at each use, so each micro-kernel is compiled for its shape
 * and format. */
#define COLUMNS(Q4, RR)                                                                                 \
    do {                                                                                                \
        int64_t n = n_begin;                                                                            \
        for (; (Q4 != FMT_Q8_0 || RR == 4) && n + TILE_COLUMNS <= n_end; n += TILE_COLUMNS)             \
            tile(w, scales + (n - n_begin) * w->nb, &q, r0, n, N, out, RR, TILE_COLUMNS, Q4);           \
        for (; n < n_end; n++) tile(w, scales + (n - n_begin) * w->nb, &q, r0, n, N, out, RR, 1, Q4);   \
    } while (0)

/* One tile against all rows of x: 4 rows at a time, then a tail of 3, 2 or 1 (a verification
 * step's drafts) in one micro-kernel, so the weights are unpacked once for it. */
#define TILE_LOOP(Q4)                                                                             \
    do {                                                                                          \
        int64_t r0 = 0;                                                                           \
        for (; r0 + 4 <= M; r0 += 4) COLUMNS(Q4, 4);                                              \
        if (M - r0 == 3)                                                                          \
            COLUMNS(Q4, 3);                                                                       \
        else if (M - r0 == 2)                                                                     \
            COLUMNS(Q4, 2);                                                                       \
        else if (M - r0 == 1)                                                                     \
            COLUMNS(Q4, 1);                                                                       \
    } while (0)

static int matmul(const float *x, int64_t M, int64_t K, const Weights *w, int64_t N, float *out, int format) {
    const int q4 = format == FMT_Q4_1;
    if (K % QK) return -2;
    QuantizedRows q;
    if (tern_rows_quantize(x, M, K, &q)) {
        tern_rows_free(&q);
        return -1;
    }
#ifdef TERN_Q4_TILED
    if (q4) {
        tern_matmul_tiled_q4_1(w, &q, M, N, out);
        tern_rows_free(&q);
        return 0;
    }
#endif
    const int64_t tiles = (N + TILE_N - 1) / TILE_N;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        /* this thread's tile's scales, then (q4_1) its mins; (q5_0, more than 4 rows) its codes unpacked */
        const int unpack = format == FMT_Q5_0 && M > 4;
        float *scales = (float *)malloc((size_t)(TILE_N * w->nb * (q4 ? 2 : 1)) * sizeof(float));
        int8_t *unpacked = unpack ? (int8_t *)malloc((size_t)(TILE_N * w->nb * QK)) : NULL;
        failed = scales == NULL || (unpack && unpacked == NULL);
        /* Guided: each thread first takes a long run of consecutive tiles (one stream through the
         * weight, which the prefetchers follow: twice as fast as tiles handed out one by one), then
         * shorter runs, so that when the OS preempts one thread (the server's event loop and a client
         * share the cores) the other takes over the tail instead of waiting for it. */
#pragma omp for schedule(guided)
        for (int64_t t = 0; t < tiles; t++) {
            if (failed) continue;
            const int64_t n_begin = t * TILE_N;
            const int64_t n_end = n_begin + TILE_N < N ? n_begin + TILE_N : N;
            tile_scales(w, n_begin, n_end, scales);
            if (q4) {
                float *mins = scales + TILE_N * w->nb;
                tile_mins(w, t, mins);
                TILE_LOOP(FMT_Q4_1);
                add_min_terms(mins, &q, M, w->nb, n_begin, n_end, N, out);
            } else if (unpack) {
                unpack_q5_0(w, n_begin, n_end, unpacked);
                const Weights codes = {(const uint8_t *)unpacked, w->d, NULL, w->nb, n_begin};
                {
                    const Weights *w = &codes; /* the q8_0 micro-kernels on this tile's codes */
                    TILE_LOOP(FMT_Q8_0);
                }
            } else if (format == FMT_Q5_0) {
                TILE_LOOP(FMT_Q5_0);
            } else {
                TILE_LOOP(FMT_Q8_0);
            }
        }
        free(scales);
        free(unpacked);
    }
    tern_rows_free(&q);
    return failed ? -1 : 0;
}

/* out [M, N] = x [M, K] @ dequant(W)^T; W as q4_1: qs [N, K/2] bytes, d [N, K/32] float16, m the mins
 * tile by tile [N/16 rounded up, K/32, 16] float16 (zero past N); where tern_q4_1_tiled() says so, qs
 * and d are tile by tile too (kernels.q4_1_kernel_layout). 0 on success. */
int tern_matmul_q4_1(const float *x, int64_t M, int64_t K, const uint8_t *wq, const uint16_t *wd,
                     const uint16_t *wm, int64_t N, float *out) {
    const Weights w = {wq, wd, wm, K / QK};
    return matmul(x, M, K, &w, N, out, FMT_Q4_1);
}

/* out [M, N] = x [M, K] @ dequant(W)^T; W as q8_0: qs [N, K] int8, d [N, K/32] float16. 0 on success. */
int tern_matmul_q8_0(const float *x, int64_t M, int64_t K, const int8_t *wq, const uint16_t *wd, int64_t N,
                     float *out) {
    const Weights w = {(const uint8_t *)wq, wd, NULL, K / QK};
    return matmul(x, M, K, &w, N, out, FMT_Q8_0);
}

/* out [M, N] = x [M, K] @ dequant(W)^T; W as q5_0: qs [N, K/32, 20] bytes (each GGUF block's fifth bits and
 * nibbles), d [N, K/32] float16 (ggml_kernels.q5_0_from_blocks: the file's bytes split in place). 0 on success. */
int tern_matmul_q5_0(const float *x, int64_t M, int64_t K, const uint8_t *wq, const uint16_t *wd, int64_t N,
                     float *out) {
    const Weights w = {wq, wd, NULL, K / QK};
    return matmul(x, M, K, &w, N, out, FMT_Q5_0);
}

/* The activation quantizer alone, for the reference test: qs [M, K], d and s [M, K/32]. */

/* 1 where this build reads q4_1 codes and scales tile by tile (the VNNI kernel), 0 where row by row. */
int tern_q4_1_tiled(void) {
#ifdef TERN_Q4_TILED
    return 1;
#else
    return 0;
#endif
}
