/* LayerNorm over the last dimension: out = (x - mean) * rstd * gamma + beta,
 * rstd = 1 / sqrt(biased variance + 1e-5). mean and rstd [N] are saved for the backward pass. */
#ifndef MICROGPT_CPU_LAYERNORM_H
#define MICROGPT_CPU_LAYERNORM_H

#include "common.h"

#define LAYERNORM_EPS 1e-5

static inline void layernorm_forward(float* out, float* mean, float* rstd, const float* x,
                              const float* gamma, const float* beta, int N, int C) {
    #pragma omp parallel for
    for (int n = 0; n < N; n++) {
        const float* xr = x + (size_t)n * C;
        double s = 0.0;
        for (int c = 0; c < C; c++) s += xr[c];
        double mu = s / C;
        double s2 = 0.0; /* two-pass variance: no cancellation when |mean| >> std */
        for (int c = 0; c < C; c++) { double e = xr[c] - mu; s2 += e * e; }
        float m = (float)mu;
        float r = (float)(1.0 / sqrt(s2 / C + LAYERNORM_EPS));
        float* o = out + (size_t)n * C;
        for (int c = 0; c < C; c++) o[c] = (xr[c] - m) * r * gamma[c] + beta[c];
        mean[n] = m;
        rstd[n] = r;
    }
}

#define LAYERNORM_COL_BLOCK 64
static inline void layernorm_backward(float* dx, float* dgamma, float* dbeta, const float* dout,
                               const float* x, const float* gamma, const float* mean,
                               const float* rstd, int N, int C) {
    /* dx: rows are independent. With xhat = (x-mean)*rstd and g = dout*gamma,
     * dx = rstd * (g - mean(g) - xhat * mean(g*xhat)). */
    #pragma omp parallel for
    for (int n = 0; n < N; n++) {
        const float* xr = x + (size_t)n * C;
        const float* dr = dout + (size_t)n * C;
        float m = mean[n], r = rstd[n];
        double sg = 0.0, sgx = 0.0;
        for (int c = 0; c < C; c++) {
            float g = dr[c] * gamma[c];
            sg += g;
            sgx += (double)g * ((xr[c] - m) * r);
        }
        float mg = (float)(sg / C), mgx = (float)(sgx / C);
        float* o = dx + (size_t)n * C;
        for (int c = 0; c < C; c++) {
            float xhat = (xr[c] - m) * r;
            o[c] += r * (dr[c] * gamma[c] - mg - xhat * mgx);
        }
    }
    /* dgamma, dbeta: sums over rows. Threads own column blocks and add rows in order (double). */
    int nblocks = (C + LAYERNORM_COL_BLOCK - 1) / LAYERNORM_COL_BLOCK;
    #pragma omp parallel for
    for (int blk = 0; blk < nblocks; blk++) {
        int c0 = blk * LAYERNORM_COL_BLOCK;
        int w = c0 + LAYERNORM_COL_BLOCK < C ? LAYERNORM_COL_BLOCK : C - c0;
        double ag[LAYERNORM_COL_BLOCK], ab[LAYERNORM_COL_BLOCK];
        for (int c = 0; c < w; c++) { ag[c] = 0.0; ab[c] = 0.0; }
        for (int n = 0; n < N; n++) {
            const float* xr = x + (size_t)n * C + c0;
            const float* dr = dout + (size_t)n * C + c0;
            float m = mean[n], r = rstd[n];
            for (int c = 0; c < w; c++) {
                ag[c] += (double)dr[c] * ((xr[c] - m) * r);
                ab[c] += dr[c];
            }
        }
        for (int c = 0; c < w; c++) {
            dgamma[c0 + c] += (float)ag[c];
            dbeta[c0 + c] += (float)ab[c];
        }
    }
}

#endif
