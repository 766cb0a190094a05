/* Matmuls over GGUF's K-quant blocks as the file stores them (Q4_K, Q5_K, Q6_K):
 *
 *   out[M, N] = x[M, K] @ W[N, K]^T, x float32, W rows of super-blocks of 256 (ggml's block_q*_K).
 *
 * The rows of x are quantized to int16 with one scale per row as for the 32-blocks
 * (quant_kernels.c, tern_quantize_rows). A super-block has 8 sub-blocks of 32 with 6-bit (Q4_K, Q5_K)
 * or 8-bit (Q6_K, per 16) integer scales under one float16 d. The codes are multiplied by their
 * sub-block's integer scale as they are unpacked (|code * scale| <= 945, 1953, 4096: int16), so a
 * super-block's products sum exactly in int32 lanes, converted to float and scaled by d once per
 * super-block (AVX2's Q6_K once per half: see FLUSH). The mins of Q4_K/Q5_K (w = d * sc * q - dmin
 * * m) come off through the row's block sums: dmin * sum_j m_j * sum(x codes in sub-block j).
 *
 *   Overflow bound, per int32 lane and super-block: AVX-512 adds 16 products (8 sub-blocks x a pair),
 *   AVX2 32 (8 x two halves x a pair): Q4_K 32 * 945 * 32767 < 2^30; Q5_K 32 * 1953 * 32767 < 2^31 - 1;
 *   Q6_K 16 * 4096 * 32767 = 2^31 - 2^16 (AVX2: flushed every 4 sub-blocks, the same 16).
 *
 * As in quant_kernels.c every output element is computed by one thread in one fixed order, so a
 * row's result does not depend on the batch or the thread count; the weight is read once per tile
 * of 16 output rows for all rows of x. Reference: engine/cpu/ggml_kernels.py (gguf's dequantization,
 * then a float64 matmul), tested in tests/engine/test_ggml_kernels.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define QK_K 256
#define SUB 32
#define TILE_N 16
#define PREFETCH_BYTES 1024

enum { Q4_K = 0, Q5_K = 1, Q6_K = 2 };

/* bytes of a super-block: ggml's block_q4_K, block_q5_K, block_q6_K */
static const int64_t SB_BYTES[3] = {144, 176, 210};

/* Q4_K/Q5_K: d, dmin (float16), 12 bytes of 6-bit scales and mins, (Q5_K: qh[32]), qs[128].
 * Q6_K: ql[128], qh[64], scales[16] int8, d (float16). */
#define Q6_D_OFFSET 208
#define Q6_SCALES_OFFSET 192

/* The 8 scales and 8 mins of a Q4_K/Q5_K super-block from their 12 packed bytes (ggml's
 * get_scale_min_k4, four at a time): sc = bytes 0..7 of out, m = bytes 8..15. */
static inline void unpack_scales(const uint8_t *packed, uint8_t out[16]) {
    uint32_t u[4];
    memcpy(u, packed, 12);
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
    u[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4);
    const uint32_t mins_low = u[1] & low6;
    u[1] = (u[2] & low4) | (((u[0] >> 6) & low2) << 4);
    u[2] = mins_low;
    u[0] &= low6;
    memcpy(out, u, 16);
}

/* The rows of x as the kernels take them (kernels.h, TernRows). */
int tern_kquant_rows(const float *x, int64_t M, int64_t K, TernRows *q) {
    const int64_t nb = K / SUB;
    q->qs = (int16_t *)malloc((size_t)(M * K) * sizeof(int16_t));
    q->d = (float *)malloc((size_t)M * sizeof(float));
    q->sums = (float *)malloc((size_t)(M * nb) * sizeof(float));
    if (!q->qs || !q->d || !q->sums) return -1;
#pragma omp parallel for schedule(static) if (M >= 4)
    for (int64_t r = 0; r < M; r++) {
        tern_quantize_rows(x + r * K, 1, K, q->qs + r * K, q->d + r, q->sums + r * nb);
        for (int64_t b = 0; b < nb; b++) {
            int32_t sum = 0;
            for (int j = 0; j < SUB; j++) sum += q->qs[r * K + b * SUB + j];
            q->sums[r * nb + b] = (float)sum;
        }
    }
    return 0;
}

void tern_free_kquant_rows(TernRows *q) {
    free(q->qs);
    free(q->d);
    free(q->sums);
}

typedef TernRows Rows;

/* One super-block's header as a column of the micro-kernel needs it. */
typedef struct {
    float d, dmin;
    uint8_t scales[16]; /* Q4_K/Q5_K: 8 scales then 8 mins; Q6_K: 16 int8 scales */
} Header;

static inline __attribute__((always_inline)) void header(const uint8_t *sb, const int T, Header *h) {
    if (T == Q6_K) {
        uint16_t d;
        memcpy(&d, sb + Q6_D_OFFSET, 2);
        h->d = half_to_float(d);
        h->dmin = 0.0f;
        memcpy(h->scales, sb + Q6_SCALES_OFFSET, 16);
    } else {
        uint16_t d[2];
        memcpy(d, sb, 4);
        h->d = half_to_float(d[0]);
        h->dmin = half_to_float(d[1]);
        unpack_scales(sb + 4, h->scales);
    }
}

#if defined(TERN_AVX512)
/* Sub-blocks 2p and 2p + 1 of super-block sb as int16 codes times their scales, 32 a register. */
static inline __attribute__((always_inline)) void pair_weights(const uint8_t *sb, const Header *h, int p, const int T,
                                                               __m512i *w0, __m512i *w1) {
    const __m512i low4 = _mm512_set1_epi16(0x0F);
    if (T == Q6_K) {
        const int half = p >> 1, upper = p & 1; /* sub-blocks t = 2 * upper, 2 * upper + 1 of the half */
        const uint8_t *ql = sb + 64 * half, *qh = sb + 128 + 32 * half;
        const __m512i high = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)qh));
        const __m512i a = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)ql));
        const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(ql + 32)));
        const __m512i bits = _mm512_set1_epi16(0x30), offset = _mm512_set1_epi16(32);
        __m512i q0, q1;
        if (!upper) {
            q0 = _mm512_or_si512(_mm512_and_si512(a, low4), _mm512_and_si512(_mm512_slli_epi16(high, 4), bits));
            q1 = _mm512_or_si512(_mm512_and_si512(b, low4), _mm512_and_si512(_mm512_slli_epi16(high, 2), bits));
        } else {
            q0 = _mm512_or_si512(_mm512_srli_epi16(a, 4), _mm512_and_si512(high, bits));
            q1 = _mm512_or_si512(_mm512_srli_epi16(b, 4), _mm512_and_si512(_mm512_srli_epi16(high, 2), bits));
        }
        /* sub-block s = 2p (+1): its first 16 codes take scales[2s], the last 16 scales[2s + 1] */
        const int s0 = 2 * p;
        const __mmask32 second = 0xFFFF0000u;
        const __m512i sc0 = _mm512_mask_blend_epi16(second, _mm512_set1_epi16((int8_t)h->scales[2 * s0]),
                                                    _mm512_set1_epi16((int8_t)h->scales[2 * s0 + 1]));
        const __m512i sc1 = _mm512_mask_blend_epi16(second, _mm512_set1_epi16((int8_t)h->scales[2 * s0 + 2]),
                                                    _mm512_set1_epi16((int8_t)h->scales[2 * s0 + 3]));
        *w0 = _mm512_mullo_epi16(_mm512_sub_epi16(q0, offset), sc0);
        *w1 = _mm512_mullo_epi16(_mm512_sub_epi16(q1, offset), sc1);
        return;
    }
    const uint8_t *qs = sb + (T == Q5_K ? 48 : 16) + 32 * p;
    const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)qs));
    __m512i q0 = _mm512_and_si512(bytes, low4), q1 = _mm512_srli_epi16(bytes, 4);
    if (T == Q5_K) { /* the fifth bit: bit 2p (sub-block 2p) and 2p + 1 of qh[l], for element l */
        const __m512i qh = _mm512_slli_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(sb + 16))), 4);
        const __m512i bit = _mm512_set1_epi16(0x10);
        q0 = _mm512_or_si512(q0, _mm512_and_si512(_mm512_srl_epi16(qh, _mm_cvtsi32_si128(2 * p)), bit));
        q1 = _mm512_or_si512(q1, _mm512_and_si512(_mm512_srl_epi16(qh, _mm_cvtsi32_si128(2 * p + 1)), bit));
    }
    *w0 = _mm512_mullo_epi16(q0, _mm512_set1_epi16(h->scales[2 * p]));
    *w1 = _mm512_mullo_epi16(q1, _mm512_set1_epi16(h->scales[2 * p + 1]));
}

static inline __attribute__((always_inline)) __m512i dot_add(__m512i acc, __m512i w, __m512i x) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}

/* RR rows of x from r0 against CC weight rows from n0: per super-block, exact int32 sums, then one
 * conversion and FMA by d, and (Q4_K/Q5_K) the mins against the row's 8 block sums. */
static inline __attribute__((always_inline)) void tile(const uint8_t *w, int64_t nsb, const Rows *x, int64_t r0,
                                                       int64_t n0, int64_t N, int64_t K, float *out, const int RR,
                                                       const int CC, const int T) {
    const int64_t row_bytes = nsb * SB_BYTES[T];
    __m512 acc[4][2];
    for (int i = 0; i < RR; i++)
        for (int j = 0; j < CC; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        Header h[2];
        const uint8_t *sb[2];
        __m512i dots[4][2];
        for (int j = 0; j < CC; j++) {
            sb[j] = w + (n0 + j) * row_bytes + s * SB_BYTES[T];
            _mm_prefetch((const char *)sb[j] + PREFETCH_BYTES, _MM_HINT_T0);
            header(sb[j], T, &h[j]);
            for (int i = 0; i < RR; i++) dots[i][j] = _mm512_setzero_si512();
        }
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {
            __m512i w0[2], w1[2];
            for (int j = 0; j < CC; j++) pair_weights(sb[j], &h[j], p, T, &w0[j], &w1[j]);
            for (int i = 0; i < RR; i++) {
                const int16_t *xs = x->qs + (r0 + i) * K + s * QK_K + 64 * p;
                const __m512i x0 = _mm512_loadu_si512((const void *)xs), x1 = _mm512_loadu_si512((const void *)(xs + 32));
                for (int j = 0; j < CC; j++) dots[i][j] = dot_add(dot_add(dots[i][j], w0[j], x0), w1[j], x1);
            }
        }
        for (int j = 0; j < CC; j++) {
            const __m512 d = _mm512_set1_ps(h[j].d);
            __m512 mins = _mm512_setzero_ps();
            if (T != Q6_K) {
                const __m128i m8 = _mm_loadl_epi64((const __m128i *)(h[j].scales + 8));
                mins = _mm512_zextps256_ps512(
                    _mm256_mul_ps(_mm256_set1_ps(h[j].dmin), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m8))));
            }
            for (int i = 0; i < RR; i++) {
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[i][j]), d, acc[i][j]);
                if (T != Q6_K) {
                    const __m512 sums = _mm512_zextps256_ps512(_mm256_loadu_ps(x->sums + (r0 + i) * (K / SUB) + s * 8));
                    acc[i][j] = _mm512_fnmadd_ps(mins, sums, acc[i][j]);
                }
            }
        }
    }
    for (int i = 0; i < RR; i++)
        for (int j = 0; j < CC; j++) out[(r0 + i) * N + n0 + j] = _mm512_reduce_add_ps(acc[i][j]) * x->d[r0 + i];
}
#define TILE_COLUMNS 2
#elif defined(__AVX2__)
/* Sub-block s of super-block sb as int16 codes times their scales: elements 0..15 in *w0, 16..31 in *w1. */
static inline __attribute__((always_inline)) void sub_weights(const uint8_t *sb, const Header *h, int s, const int T,
                                                              __m256i *w0, __m256i *w1) {
    const __m256i low4 = _mm256_set1_epi16(0x0F);
    __m256i q[2];
    if (T == Q6_K) {
        const int half = s >> 2, t = s & 3; /* ql: bytes (t & 1) * 32 of the half, nibble t >> 1; qh: bits 2t */
        const uint8_t *ql = sb + 64 * half + 32 * (t & 1), *qh = sb + 128 + 32 * half;
        for (int e = 0; e < 2; e++) {
            const __m256i a = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(ql + 16 * e)));
            const __m256i high = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qh + 16 * e)));
            const __m256i codes = (t >> 1) ? _mm256_srli_epi16(a, 4) : _mm256_and_si256(a, low4);
            const __m256i top = _mm256_and_si256(_mm256_srl_epi16(_mm256_slli_epi16(high, 4), _mm_cvtsi32_si128(2 * t)),
                                                 _mm256_set1_epi16(0x30));
            q[e] = _mm256_mullo_epi16(_mm256_sub_epi16(_mm256_or_si256(codes, top), _mm256_set1_epi16(32)),
                                      _mm256_set1_epi16((int8_t)h->scales[2 * s + e]));
        }
    } else {
        const uint8_t *qs = sb + (T == Q5_K ? 48 : 16) + 32 * (s >> 1);
        for (int e = 0; e < 2; e++) {
            const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qs + 16 * e)));
            __m256i codes = (s & 1) ? _mm256_srli_epi16(bytes, 4) : _mm256_and_si256(bytes, low4);
            if (T == Q5_K) {
                const __m256i qh = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(sb + 16 + 16 * e)));
                codes = _mm256_or_si256(codes, _mm256_and_si256(_mm256_srl_epi16(_mm256_slli_epi16(qh, 4), _mm_cvtsi32_si128(s)),
                                                                _mm256_set1_epi16(0x10)));
            }
            q[e] = _mm256_mullo_epi16(codes, _mm256_set1_epi16(h->scales[s]));
        }
    }
    *w0 = q[0];
    *w1 = q[1];
}

/* AVX2's Q6_K sums in int32 for 4 sub-blocks at a time (see the overflow bound above). */
#define FLUSH(T) ((T) == Q6_K ? 4 : 8)

static inline __attribute__((always_inline)) void tile(const uint8_t *w, int64_t nsb, const Rows *x, int64_t r0,
                                                       int64_t n0, int64_t N, int64_t K, float *out, const int RR,
                                                       const int CC, const int T) {
    const int64_t row_bytes = nsb * SB_BYTES[T];
    __m256 acc[4][1];
    for (int i = 0; i < RR; i++) acc[i][0] = _mm256_setzero_ps();
    (void)CC; /* one weight row at a time: AVX2's 16 registers hold 4 rows' accumulators */
    for (int64_t s = 0; s < nsb; s++) {
        Header h;
        const uint8_t *sb = w + n0 * row_bytes + s * SB_BYTES[T];
        _mm_prefetch((const char *)sb + PREFETCH_BYTES, _MM_HINT_T0);
        header(sb, T, &h);
        const __m256 d = _mm256_set1_ps(h.d);
        for (int part = 0; part < 8; part += FLUSH(T)) {
            __m256i dots[4];
            for (int i = 0; i < RR; i++) dots[i] = _mm256_setzero_si256();
            for (int sub = part; sub < part + FLUSH(T); sub++) {
                __m256i w0, w1;
                sub_weights(sb, &h, sub, T, &w0, &w1);
                for (int i = 0; i < RR; i++) {
                    const int16_t *xs = x->qs + (r0 + i) * K + s * QK_K + SUB * sub;
                    const __m256i x0 = _mm256_loadu_si256((const __m256i *)xs);
                    const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xs + 16));
                    dots[i] = _mm256_add_epi32(dots[i], _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1)));
                }
            }
            for (int i = 0; i < RR; i++) acc[i][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[i]), d, acc[i][0]);
        }
        if (T != Q6_K) {
            const __m256 mins = _mm256_mul_ps(_mm256_set1_ps(h.dmin),
                                              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(h.scales + 8)))));
            for (int i = 0; i < RR; i++)
                acc[i][0] = _mm256_fnmadd_ps(mins, _mm256_loadu_ps(x->sums + (r0 + i) * (K / SUB) + s * 8), acc[i][0]);
        }
    }
    for (int i = 0; i < RR; i++) out[(r0 + i) * N + n0] = hsum8(acc[i][0]) * x->d[r0 + i];
}
#define TILE_COLUMNS 1
#else
/* Portable version: the element's code times its scale, summed per super-block in int64. */
static inline int code_times_scale(const uint8_t *sb, const Header *h, int e, const int T) {
    const int s = e / SUB, l = e % SUB;
    if (T == Q6_K) {
        const int half = e / 128, t = (e % 128) / 32;
        const uint8_t *ql = sb + 64 * half + 32 * (t & 1), *qh = sb + 128 + 32 * half;
        const int low = (t >> 1) ? ql[l] >> 4 : ql[l] & 0x0F;
        const int q = (low | (((qh[l] >> (2 * t)) & 3) << 4)) - 32;
        return q * (int8_t)h->scales[2 * s + l / 16];
    }
    const uint8_t *qs = sb + (T == Q5_K ? 48 : 16) + 32 * (s / 2);
    int q = (s & 1) ? qs[l] >> 4 : qs[l] & 0x0F;
    if (T == Q5_K) q |= ((sb[16 + l] >> s) & 1) << 4;
    return q * h->scales[s];
}

static inline void tile(const uint8_t *w, int64_t nsb, const Rows *x, int64_t r0, int64_t n0, int64_t N, int64_t K,
                        float *out, const int RR, const int CC, const int T) {
    const int64_t row_bytes = nsb * SB_BYTES[T];
    (void)CC;
    for (int i = 0; i < RR; i++) {
        const int64_t r = r0 + i;
        float total = 0.0f;
        for (int64_t s = 0; s < nsb; s++) {
            const uint8_t *sb = w + n0 * row_bytes + s * SB_BYTES[T];
            Header h;
            header(sb, T, &h);
            int64_t dot = 0;
            for (int e = 0; e < QK_K; e++) dot += (int64_t)code_times_scale(sb, &h, e, T) * x->qs[r * K + s * QK_K + e];
            total += (float)dot * h.d;
            if (T != Q6_K)
                for (int j = 0; j < 8; j++) total -= h.dmin * (float)h.scales[8 + j] * x->sums[r * (K / SUB) + s * 8 + j];
        }
        out[r * N + n0] = total * x->d[r];
    }
}
#define TILE_COLUMNS 1
#endif

/* One tile of output columns [n_begin, n_end) against rows [r0, r0 + RR). */
#define COLUMNS(T, RR)                                                                                     \
    do {                                                                                                   \
        int64_t n = n_begin;                                                                               \
        for (; n + TILE_COLUMNS <= n_end; n += TILE_COLUMNS) tile(w, nsb, &q, r0, n, N, K, out, RR, TILE_COLUMNS, T); \
        for (; n < n_end; n++) tile(w, nsb, &q, r0, n, N, K, out, RR, 1, T);                                 \
    } while (0)

#define TILE_LOOP(T)                                                                                       \
    do {                                                                                                   \
        int64_t r0 = 0;                                                                                    \
        for (; r0 + 4 <= M; r0 += 4) COLUMNS(T, 4);                                                        \
        if (M - r0 == 3)                                                                                   \
            COLUMNS(T, 3);                                                                                 \
        else if (M - r0 == 2)                                                                              \
            COLUMNS(T, 2);                                                                                 \
        else if (M - r0 == 1)                                                                              \
            COLUMNS(T, 1);                                                                                 \
    } while (0)

/* out [M, N] = x [M, K] @ dequant(W)^T, W [N, K / 256] super-blocks of type (0 Q4_K, 1 Q5_K, 2 Q6_K)
 * as GGUF stores them. 0, -1 (out of memory) or -2 (K not whole super-blocks, unknown type). */
int tern_matmul_kquant(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *out) {
    if (K % QK_K || type < Q4_K || type > Q6_K) return -2;
    const int64_t nsb = K / QK_K;
    Rows q;
    if (tern_kquant_rows(x, M, K, &q)) {
        tern_free_kquant_rows(&q);
        return -1;
    }
    const int64_t tiles = (N + TILE_N - 1) / TILE_N;
#pragma omp parallel for schedule(guided)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n_begin = t * TILE_N, n_end = n_begin + TILE_N < N ? n_begin + TILE_N : N;
        if (type == Q4_K)
            TILE_LOOP(Q4_K);
        else if (type == Q5_K)
            TILE_LOOP(Q5_K);
        else
            TILE_LOOP(Q6_K);
    }
    tern_free_kquant_rows(&q);
    return 0;
}
