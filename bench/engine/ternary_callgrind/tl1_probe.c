/* Probe, not part of the engine (bench/engine/ternary_callgrind/run.sh). A TL1-style lookup-table ternary GEMV (T-MAC / bitnet.cpp TL1 idea) for AVX2, exact int math, one
 * activation row: measured against the 2-bit kernel with callgrind. Not shipped. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
int tern_matmul_tq2(const float *x, int64_t M, int64_t K, const uint8_t *wq, const float *ws, const uint16_t *wd, int64_t N, float *out);
/* weights: tiles of 32 rows; per tile, per quad q of activations, 32 bytes: byte r = idx(r, 2q) | idx(r, 2q+1) << 4 */
static void pack_tl1(const int8_t *w, int64_t N, int64_t K, uint8_t *out) {
    for (int64_t t = 0; t < N / 32; t++)
        for (int64_t q = 0; q < K / 4; q++)
            for (int r = 0; r < 32; r++) {
                const int8_t *row = w + (t * 32 + r) * K + 4 * q;
                int i0 = 3 * (row[0] + 1) + (row[1] + 1), i1 = 3 * (row[2] + 1) + (row[3] + 1);
                out[(t * (K / 4) + q) * 32 + r] = (uint8_t)(i0 | i1 << 4);
            }
}
/* tables [K/2][2][16]: lo and hi bytes of a0*w0 + a1*w1 for idx = 3(w0+1) + (w1+1) */
static void build_tables(const int8_t *xq, int64_t K, uint8_t *tables) {
    for (int64_t p = 0; p < K / 2; p++) {
        uint8_t *lo = tables + p * 32, *hi = lo + 16;
        memset(lo, 0, 32);
        for (int idx = 0; idx < 9; idx++) {
            int16_t v = (int16_t)(xq[2 * p] * (idx / 3 - 1) + xq[2 * p + 1] * (idx % 3 - 1));
            lo[idx] = (uint8_t)(v & 0xFF); hi[idx] = (uint8_t)((uint16_t)v >> 8);
        }
    }
}
#define TT 4 /* row tiles sharing each table load (T-MAC's loop order) */
static void gemv_tl1(const uint8_t *w, const uint8_t *tables, int64_t N, int64_t K, int32_t *out) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int64_t t0 = 0; t0 < N / 32; t0 += TT) {
        __m256i a32[TT][4];
        for (int u = 0; u < TT; u++) for (int i = 0; i < 4; i++) a32[u][i] = _mm256_setzero_si256();
        for (int64_t q0 = 0; q0 < K / 4; q0 += 32) {
            __m256i acc_a[TT], acc_b[TT];
            for (int u = 0; u < TT; u++) acc_a[u] = acc_b[u] = _mm256_setzero_si256();
            for (int64_t q = q0; q < q0 + 32 && q < K / 4; q++) {
                for (int h = 0; h < 2; h++) {
                    const uint8_t *tb = tables + (2 * q + h) * 32;
                    const __m256i tl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)tb));
                    const __m256i th = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(tb + 16)));
                    for (int u = 0; u < TT; u++) {
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + ((t0 + u) * (K / 4) + q) * 32));
                        const __m256i idx = h ? _mm256_and_si256(_mm256_srli_epi16(v, 4), mask) : _mm256_and_si256(v, mask);
                        const __m256i lo = _mm256_shuffle_epi8(tl, idx), hi = _mm256_shuffle_epi8(th, idx);
                        acc_a[u] = _mm256_add_epi16(acc_a[u], _mm256_unpacklo_epi8(lo, hi));
                        acc_b[u] = _mm256_add_epi16(acc_b[u], _mm256_unpackhi_epi8(lo, hi));
                    }
                }
            }
            for (int u = 0; u < TT; u++) {
                a32[u][0] = _mm256_add_epi32(a32[u][0], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc_a[u])));
                a32[u][1] = _mm256_add_epi32(a32[u][1], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc_a[u], 1)));
                a32[u][2] = _mm256_add_epi32(a32[u][2], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc_b[u])));
                a32[u][3] = _mm256_add_epi32(a32[u][3], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc_b[u], 1)));
            }
        }
        for (int u = 0; u < TT; u++) {
            int32_t tmp[32];
            _mm256_storeu_si256((__m256i *)tmp, a32[u][0]); _mm256_storeu_si256((__m256i *)(tmp + 8), a32[u][2]);
            _mm256_storeu_si256((__m256i *)(tmp + 16), a32[u][1]); _mm256_storeu_si256((__m256i *)(tmp + 24), a32[u][3]);
            memcpy(out + (t0 + u) * 32, tmp, sizeof tmp);
        }
    }
}
int main(int argc, char **argv) {
    const int64_t N = 2048, K = 2048; int reps = atoi(argv[1]), mode = atoi(argv[2]); /* 0: tl1, 1: tq2 */
    int8_t *w = malloc(N * K), *xq = malloc(K); uint8_t *tl = malloc(N * K / 4), *tables = malloc(K / 2 * 32), *tq = calloc(N * K / 4, 1);
    int32_t *out = malloc(N * 4); float *xf = malloc(K * 4), *ws = malloc(N * 4), *fo = malloc(N * 4);
    srand(1);
    for (int64_t i = 0; i < N * K; i++) w[i] = (int8_t)(rand() % 3 - 1);
    for (int64_t k = 0; k < K; k++) { xq[k] = (int8_t)(rand() % 255 - 127); xf[k] = xq[k]; }
    for (int64_t n = 0; n < N; n++) ws[n] = 1.0f;
    pack_tl1(w, N, K, tl);
    for (int64_t n = 0; n < N; n++) /* TQ2_0 order */
        for (int64_t k = 0; k < K; k++) { int64_t b = k / 256, e = k % 256; tq[n * K / 4 + b * 64 + (e / 128) * 32 + e % 32] |= (uint8_t)((w[n * K + k] + 1) << (2 * ((e % 128) / 32))); }
    for (int r = 0; r < reps; r++) {
        if (mode == 0) { build_tables(xq, K, tables); gemv_tl1(tl, tables, N, K, out); }
        else tern_matmul_tq2(xf, 1, K, tq, ws, NULL, N, fo);
    }
    if (mode == 0) { /* check against plain integer math */
        for (int64_t n = 0; n < N; n++) { int32_t s = 0; for (int64_t k = 0; k < K; k++) s += w[n * K + k] * xq[k]; if (s != out[n]) { printf("mismatch %ld %d %d\n", (long)n, s, out[n]); return 1; } }
        printf("tl1 exact\n");
    }
    return 0;
}
