/* Probe, not part of the engine (bench/engine/ternary_callgrind/run.sh): M rows x 2048 through the ternary kernel. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
int tern_matmul_tq2(const float *x, int64_t M, int64_t K, const uint8_t *wq, const float *ws, const uint16_t *wd, int64_t N, float *out);
int main(int argc, char **argv) {
    int64_t M = atoi(argv[1]), N = 2048, K = 2048; int reps = argc > 2 ? atoi(argv[2]) : 1; int blocked = argc > 3 ? atoi(argv[3]) : 0;
    float *x = malloc(M * K * 4), *ws = malloc(N * 4), *out = malloc(M * N * 4);
    uint8_t *wq = malloc(N * K / 4); uint16_t *wd = malloc(N * K / 256 * 2);
    srand(1);
    for (int64_t i = 0; i < M * K; i++) x[i] = (rand() % 2000 - 1000) / 1000.0f;
    for (int64_t i = 0; i < N * K / 4; i++) wq[i] = rand() & 0xFF;  /* codes 3 appear: fine for counting */
    for (int64_t i = 0; i < N; i++) ws[i] = 0.01f;
    for (int64_t i = 0; i < N * K / 256; i++) wd[i] = 0x2000;
    for (int r = 0; r < reps; r++) tern_matmul_tq2(x, M, K, wq, blocked ? NULL : ws, blocked ? wd : NULL, N, out);
    printf("%f\n", out[0]);
    return 0;
}
