/* Token + position embedding: out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]. */
#ifndef MICROGPT_CPU_EMBED_H
#define MICROGPT_CPU_EMBED_H

#include "common.h"

static inline void embed_forward(float* out, const int* tokens, const float* wte, const float* wpe,
                          int B, int T, int C) {
    #pragma omp parallel for
    for (int bt = 0; bt < B * T; bt++) {
        const float* we = wte + (size_t)tokens[bt] * C;
        const float* pe = wpe + (size_t)(bt % T) * C;
        float* o = out + (size_t)bt * C;
        for (int c = 0; c < C; c++) o[c] = we[c] + pe[c];
    }
}

/* Several positions can hold the same token, so dwte rows are not independent outputs. Threads
 * own column blocks instead and walk the positions in order: no races, fixed summation order. */
#define EMBED_COL_BLOCK 32
static inline void embed_backward(float* dwte, float* dwpe, const float* dout, const int* tokens,
                           int B, int T, int C) {
    int nblocks = (C + EMBED_COL_BLOCK - 1) / EMBED_COL_BLOCK;
    #pragma omp parallel for
    for (int blk = 0; blk < nblocks; blk++) {
        int c0 = blk * EMBED_COL_BLOCK;
        int c1 = c0 + EMBED_COL_BLOCK < C ? c0 + EMBED_COL_BLOCK : C;
        for (int bt = 0; bt < B * T; bt++) {
            float* dw = dwte + (size_t)tokens[bt] * C;
            const float* g = dout + (size_t)bt * C;
            for (int c = c0; c < c1; c++) dw[c] += g[c];
        }
    }
    /* dwpe[t] gets one term per batch row; each t is an independent output. */
    #pragma omp parallel for
    for (int t = 0; t < T; t++) {
        float* dp = dwpe + (size_t)t * C;
        for (int b = 0; b < B; b++) {
            const float* g = dout + ((size_t)b * T + t) * C;
            for (int c = 0; c < C; c++) dp[c] += g[c];
        }
    }
}

#endif
