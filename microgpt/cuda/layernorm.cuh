/* layernorm.cuh: LayerNorm over the last dimension (eps 1e-5, biased variance), as the CPU's
 * layernorm_forward / layernorm_backward. gamma/beta are the fp32 master parameters; mean and rstd
 * [N] (fp32) are saved by the forward for the backward.
 *
 * Forward and dx: one warp per row. dgamma/dbeta are sums over rows, done without atomics in two
 * fixed-shape steps: each block owns a slab of columns and a chunk of rows and writes its partial
 * sums, then one thread per column adds the chunk partials in chunk order. The chunking depends
 * only on N, so the result does not depend on the GPU. */
#ifndef MICROGPT_CUDA_LAYERNORM_CUH
#define MICROGPT_CUDA_LAYERNORM_CUH

#include "common.cuh"

#define LN_EPS 1e-5f
#define LN_WARPS 8         /* rows per block in the row kernels */
#define LN_MAX_CHUNKS 128  /* row chunks for dgamma/dbeta partials */
#define LN_COL_THREADS 128 /* columns per block in the partials kernel */

/* Scratch floats k_layernorm_bwd needs for width C. */
static size_t layernorm_scratch_floats(int C) { return (size_t)2 * LN_MAX_CHUNKS * C; }

static int ln_rows_per_chunk(int N) { return (int)ceil_div((size_t)N, N < LN_MAX_CHUNKS ? (size_t)N : LN_MAX_CHUNKS); }

template <typename T>
__global__ void layernorm_fwd_kernel(T* out, float* mean, float* rstd, const T* x, const float* gamma,
                                     const float* beta, int N, int C) {
    int lane = threadIdx.x & 31;
    int row = blockIdx.x * LN_WARPS + (threadIdx.x >> 5);
    if (row >= N) return; /* whole warps leave together: no block barriers below */
    const T* xr = x + (size_t)row * C;
    float s = 0.0f;
    for (int c = lane; c < C; c += 32) s += to_f(xr[c]);
    float m = warp_sum(s) / C;
    float s2 = 0.0f; /* two-pass variance: no cancellation when |mean| >> std */
    for (int c = lane; c < C; c += 32) {
        float e = to_f(xr[c]) - m;
        s2 += e * e;
    }
    float r = 1.0f / sqrtf(warp_sum(s2) / C + LN_EPS);
    T* o = out + (size_t)row * C;
    for (int c = lane; c < C; c += 32) o[c] = from_f<T>((to_f(xr[c]) - m) * r * gamma[c] + beta[c]);
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

/* dx += rstd * (g - mean(g) - xhat * mean(g * xhat)),  g = dout * gamma, xhat = (x - mean) * rstd */
template <typename T>
__global__ void layernorm_bwd_dx_kernel(T* dx, const T* dout, const T* x, const float* gamma, const float* mean,
                                        const float* rstd, int N, int C) {
    int lane = threadIdx.x & 31;
    int row = blockIdx.x * LN_WARPS + (threadIdx.x >> 5);
    if (row >= N) return;
    const T* xr = x + (size_t)row * C;
    const T* dr = dout + (size_t)row * C;
    float m = mean[row], r = rstd[row];
    float sg = 0.0f, sgx = 0.0f;
    for (int c = lane; c < C; c += 32) {
        float g = to_f(dr[c]) * gamma[c];
        sg += g;
        sgx += g * ((to_f(xr[c]) - m) * r);
    }
    float mg = warp_sum(sg) / C, mgx = warp_sum(sgx) / C;
    T* o = dx + (size_t)row * C;
    for (int c = lane; c < C; c += 32) {
        float xhat = (to_f(xr[c]) - m) * r;
        float g = to_f(dr[c]) * gamma[c];
        o[c] = from_f<T>(to_f(o[c]) + r * (g - mg - xhat * mgx));
    }
}

/* grid (column slabs, row chunks): partial[chunk][c] = sum over the chunk's rows of dout*xhat,
 * partial[n_chunks + chunk][c] = sum of dout. */
template <typename T>
__global__ void layernorm_bwd_partial_kernel(float* partial, const T* dout, const T* x, const float* mean,
                                             const float* rstd, int N, int C, int rows_per_chunk, int n_chunks) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    int chunk = blockIdx.y;
    if (c >= C) return;
    int r0 = chunk * rows_per_chunk, r1 = min(N, r0 + rows_per_chunk);
    float ag = 0.0f, ab = 0.0f;
    for (int r = r0; r < r1; r++) {
        float d = to_f(dout[(size_t)r * C + c]);
        ag += d * ((to_f(x[(size_t)r * C + c]) - mean[r]) * rstd[r]);
        ab += d;
    }
    partial[(size_t)chunk * C + c] = ag;
    partial[(size_t)(n_chunks + chunk) * C + c] = ab;
}

__global__ void layernorm_bwd_final_kernel(float* dgamma, float* dbeta, const float* partial, int C, int n_chunks) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float sg = 0.0f, sb = 0.0f;
    for (int k = 0; k < n_chunks; k++) {
        sg += partial[(size_t)k * C + c];
        sb += partial[(size_t)(n_chunks + k) * C + c];
    }
    dgamma[c] += sg;
    dbeta[c] += sb;
}

template <typename T>
static void k_layernorm_fwd(T* out, float* mean, float* rstd, const T* x, const float* gamma, const float* beta,
                            int N, int C) {
    unsigned blocks = ceil_div(N, LN_WARPS);
    layernorm_fwd_kernel<T><<<blocks, 32 * LN_WARPS, 0, g_stream>>>(out, mean, rstd, x, gamma, beta, N, C);
    LAUNCH_CHECK();
}

/* dx, dgamma, dbeta += ; scratch holds layernorm_scratch_floats(C) floats. */
template <typename T>
static void k_layernorm_bwd(T* dx, float* dgamma, float* dbeta, const T* dout, const T* x, const float* gamma,
                            const float* mean, const float* rstd, int N, int C, float* scratch) {
    unsigned blocks = ceil_div(N, LN_WARPS);
    layernorm_bwd_dx_kernel<T><<<blocks, 32 * LN_WARPS, 0, g_stream>>>(dx, dout, x, gamma, mean, rstd, N, C);
    LAUNCH_CHECK();
    int rows_per_chunk = ln_rows_per_chunk(N);
    int n_chunks = (int)ceil_div(N, rows_per_chunk);
    dim3 grid(ceil_div(C, LN_COL_THREADS), n_chunks);
    layernorm_bwd_partial_kernel<T><<<grid, LN_COL_THREADS, 0, g_stream>>>(scratch, dout, x, mean, rstd, N, C,
                                                                           rows_per_chunk, n_chunks);
    LAUNCH_CHECK();
    layernorm_bwd_final_kernel<<<ceil_div(C, 128), 128, 0, g_stream>>>(dgamma, dbeta, scratch, C, n_chunks);
    LAUNCH_CHECK();
}

#endif
