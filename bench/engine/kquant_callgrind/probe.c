/* Probe, not part of the engine (bench/engine/kquant_callgrind/run.sh): one call of a GGUF block kernel,
 * rows x K against N random weight rows, whose instructions callgrind counts (--toggle-collect on the
 * kernel's entry point: the weight's tiling at load and the setup are left out).
 *   probe KERNEL ROWS K N    KERNEL: q4_k q5_k q6_k (row by row), q4_k_tiled q5_k_tiled q6_k_tiled, q8_0 q5_0
 *                            (row by row, int16 rows), q8_0_tiled q5_0_tiled (int8 rows), q8_0_head (the
 *                            Q8_0 tiles on int16 rows, an output head's), tq2 (ternary, block
 *                            scales as llama-quantize writes TQ2_0), tq2_rows (row scales) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

int tern_tile_q6_k(uint8_t *w, int64_t N, int64_t nsb);

static uint64_t state = 0x9E3779B97F4A7C15ull;
static uint32_t next(void) { /* xorshift64*: the same bytes on every run */
    state ^= state >> 12, state ^= state << 25, state ^= state >> 27;
    return (uint32_t)((state * 0x2545F4914F6CDD1Dull) >> 32);
}

int main(int argc, char **argv) {
    if (argc != 5) return fprintf(stderr, "usage: probe KERNEL ROWS K N\n"), 2;
    const char *kernel = argv[1];
    const int64_t M = atoll(argv[2]), K = atoll(argv[3]), N = atoll(argv[4]), nsb = K / 256;
    const int type = strncmp(kernel, "q4_k", 4) == 0 ? 0 : strncmp(kernel, "q5_k", 4) == 0 ? 1 : 2;
    const int64_t sb_bytes = type == 0 ? 144 : type == 1 ? 176 : 210;
    float *x = malloc(sizeof(float) * M * K), *out = malloc(sizeof(float) * M * N);
    uint8_t *w = malloc(N * K * 2); /* room for every format */
    uint16_t *d = malloc(sizeof(uint16_t) * N * (K / 32));
    for (int64_t i = 0; i < M * K; i++) x[i] = (float)(int32_t)(next() % 2001 - 1000) / 500.0f;
    for (int64_t i = 0; i < N * K * 2; i++) w[i] = (uint8_t)next();
    for (int64_t i = 0; i < N * (K / 32); i++) d[i] = float_to_half(0.001f);
    for (int64_t sb = 0; sb < N * nsb && strchr(kernel, 'k'); sb++) { /* each super-block's d (and dmin) */
        const uint16_t h = float_to_half(0.001f);
        memcpy(w + sb * sb_bytes + (type == 2 ? 208 : 0), &h, 2);
        if (type != 2) memcpy(w + sb * sb_bytes + 2, &h, 2);
    }
    int rc;
    if (strncmp(kernel, "tq2", 3) == 0) {
        for (int64_t i = 0; i < N * K / 4; i++) { /* codes 0..2 (T + 1), four a byte */
            uint8_t byte = 0;
            for (int j = 0; j < 4; j++) byte |= (uint8_t)((next() % 3) << (2 * j));
            w[i] = byte;
        }
        float *ws = malloc(sizeof(float) * N);
        for (int64_t i = 0; i < N; i++) ws[i] = 0.001f;
        const int rows = strcmp(kernel, "tq2_rows") == 0;
        rc = tern_matmul_tq2(x, M, K, w, rows ? ws : NULL, rows ? NULL : d, N, out);
    } else if (strcmp(kernel, "q8_0") == 0) {
        rc = tern_matmul_q8_0(x, M, K, (const int8_t *)w, d, N, out);
    } else if (strcmp(kernel, "q5_0") == 0) {
        rc = tern_matmul_q5_0(x, M, K, w, d, N, out);
    } else if (strcmp(kernel, "q8_0_tiled") == 0 || strcmp(kernel, "q5_0_tiled") == 0 ||
               strcmp(kernel, "q8_0_head") == 0) {
        const int q5 = kernel[1] == '5';
        const int64_t bytes = q5 ? 22 : 34; /* GGUF blocks, each block's scale a sane float16 */
        for (int64_t b = 0; b < N * (K / 32); b++) memcpy(w + b * bytes, &d[0], 2);
        tern_tile_q8_0(q5, w, N, K / 32);
        rc = strcmp(kernel, "q8_0_head") == 0 ? tern_matmul_q8_0_head_tiled(x, M, K, w, N, out)
                                              : tern_matmul_q8_0_tiled(q5, x, M, K, w, N, out);
    } else if (strstr(kernel, "_tiled")) {
        if (type == 2) tern_tile_q6_k(w, N, nsb);
        else tern_tile_k(type, w, N, nsb);
        rc = type == 2 ? tern_matmul_q6_k_tiled(x, M, K, w, N, out) : tern_matmul_k_tiled(type, x, M, K, w, N, out);
    } else {
        rc = tern_matmul_kquant(type, x, M, K, w, N, out);
    }
    printf("%s rows %lld: rc %d, out[0] %g\n", kernel, (long long)M, rc, out[0]);
    return rc != 0;
}
