/* Bias-free linear layer: out[N,out] = x[N,in] @ w[in,out]; weights are [in, out] row-major. */
#ifndef MICROGPT_CPU_MATMUL_H
#define MICROGPT_CPU_MATMUL_H

#include "common.h"

/* Rows are processed four at a time so each weight row, once loaded, updates four outputs
 * (a quarter of the memory traffic). Every out[i,j] still sums k = 0..in-1 in order. */
#define MATMUL_ROWS 4 /* must stay 4: dx uses dot4_f32 */

static inline void matmul_forward(float* out, const float* x, const float* w, int N, int in, int out_dim) {
    int ntiles = (N + MATMUL_ROWS - 1) / MATMUL_ROWS;
    #pragma omp parallel for schedule(static)
    for (int tile = 0; tile < ntiles; tile++) {
        int i0 = tile * MATMUL_ROWS;
        int rows = i0 + MATMUL_ROWS <= N ? MATMUL_ROWS : N - i0;
        for (int r = 0; r < rows; r++) {
            float* o = out + (size_t)(i0 + r) * out_dim;
            for (int j = 0; j < out_dim; j++) o[j] = 0.0f;
        }
        for (int k = 0; k < in; k++) {
            const float* wk = w + (size_t)k * out_dim;
            for (int r = 0; r < rows; r++) {
                axpy_f32(out + (size_t)(i0 + r) * out_dim, x[(size_t)(i0 + r) * in + k], wk, out_dim);
            }
        }
    }
}

static inline void matmul_backward(float* dx, float* dw, const float* dout, const float* x, const float* w,
                            int N, int in, int out_dim) {
    /* dx[i,k] += dout[i,:] . w[k,:]   (rows of dx are independent; four rows share each w row) */
    int ntiles_i = (N + MATMUL_ROWS - 1) / MATMUL_ROWS;
    #pragma omp parallel for schedule(static)
    for (int tile = 0; tile < ntiles_i; tile++) {
        int i0 = tile * MATMUL_ROWS;
        int rows = i0 + MATMUL_ROWS <= N ? MATMUL_ROWS : N - i0;
        const float* g[MATMUL_ROWS];
        for (int r = 0; r < MATMUL_ROWS; r++) g[r] = dout + (size_t)(i0 + (r < rows ? r : 0)) * out_dim;
        for (int k = 0; k < in; k++) {
            float s[MATMUL_ROWS];
            dot4_f32(s, g, w + (size_t)k * out_dim, out_dim);
            for (int r = 0; r < rows; r++) dx[(size_t)(i0 + r) * in + k] += s[r];
        }
    }
    /* dw[k,:] += sum_i x[i,k] * dout[i,:]   (threads own tiles of dw rows; i runs in order) */
    int ntiles = (in + MATMUL_ROWS - 1) / MATMUL_ROWS;
    #pragma omp parallel for schedule(static)
    for (int tile = 0; tile < ntiles; tile++) {
        int k0 = tile * MATMUL_ROWS;
        int rows = k0 + MATMUL_ROWS <= in ? MATMUL_ROWS : in - k0;
        for (int i = 0; i < N; i++) {
            const float* g = dout + (size_t)i * out_dim;
            const float* xi = x + (size_t)i * in + k0;
            for (int r = 0; r < rows; r++) axpy_f32(dw + (size_t)(k0 + r) * out_dim, xi[r], g, out_dim);
        }
    }
}

#endif
