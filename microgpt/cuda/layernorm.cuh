/* layernorm.cuh: LayerNorm over the last dimension (eps 1e-5, biased variance), as the CPU's
 * layernorm_forward / layernorm_backward. gamma/beta are the fp32 master parameters; mean and rstd
 * [N] (fp32) are saved by the forward for the backward.
 *
 * Forward and dx: one warp per row, moving 16-byte packets where the width allows (common.cuh).
 * dgamma/dbeta are sums over rows, done without atomics in two fixed-shape steps: each block owns
 * a slab of columns and a chunk of rows and writes its partial sums, then one thread per column
 * adds the chunk partials in chunk order. The chunking depends
 * only on N, so the result does not depend on the GPU. */
#ifndef MICROGPT_CUDA_LAYERNORM_CUH
#define MICROGPT_CUDA_LAYERNORM_CUH

#include "common.cuh"

#define LN_EPS 1e-5f
#define LN_WARPS 8         /* rows per block in the row kernels */
#define LN_MAX_CHUNKS 256  /* row chunks for dgamma/dbeta partials */
#define LN_COL_THREADS 128 /* columns per block in the partials kernel */
#define LN_FINAL_COLS 32   /* columns per block in the final sum ... */
#define LN_FINAL_GROUPS 8  /* ... and the groups of chunks each column's sum is split into */

/* Scratch floats k_layernorm_bwd needs for width C. */
static size_t layernorm_scratch_floats(int C) { return (size_t)2 * LN_MAX_CHUNKS * C; }

static int ln_rows_per_chunk(int N) { return (int)ceil_div((size_t)N, N < LN_MAX_CHUNKS ? (size_t)N : LN_MAX_CHUNKS); }

/* Lane `lane` of a row's warp handles the VEC-element packets at lane*VEC, lane*VEC + 32*VEC, ... */
#define LN_ROW_LOOP(c, C) for (int c = lane * VEC; c < (C); c += 32 * VEC)

template <typename T, int VEC>
__global__ void layernorm_fwd_kernel(T* __restrict__ out, float* __restrict__ mean, float* __restrict__ rstd,
                                     const T* __restrict__ x, const float* __restrict__ gamma,
                                     const float* __restrict__ beta, int N, int C) {
    int lane = threadIdx.x & 31;
    int row = blockIdx.x * LN_WARPS + (threadIdx.x >> 5);
    if (row >= N) return; /* whole warps leave together: no block barriers below */
    const T* xr = x + (size_t)row * C;
    float s = 0.0f, v[VEC];
    LN_ROW_LOOP(c, C) {
        load_vec(v, xr + c);
        for (int k = 0; k < VEC; k++) s += v[k];
    }
    float m = warp_sum(s) / C;
    float s2 = 0.0f; /* two-pass variance: no cancellation when |mean| >> std */
    LN_ROW_LOOP(c, C) {
        load_vec(v, xr + c);
        for (int k = 0; k < VEC; k++) s2 += (v[k] - m) * (v[k] - m);
    }
    float r = 1.0f / sqrtf(warp_sum(s2) / C + LN_EPS);
    T* o = out + (size_t)row * C;
    LN_ROW_LOOP(c, C) {
        float g[VEC], b[VEC];
        load_vec(v, xr + c);
        load_vec(g, gamma + c);
        load_vec(b, beta + c);
        for (int k = 0; k < VEC; k++) v[k] = (v[k] - m) * r * g[k] + b[k];
        store_vec(o + c, v);
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

/* dx += rstd * (g - mean(g) - xhat * mean(g * xhat)),  g = dout * gamma, xhat = (x - mean) * rstd.
 * dx must not alias dout or x. */
template <typename T, int VEC>
__global__ void layernorm_bwd_dx_kernel(T* __restrict__ dx, const T* __restrict__ dout, const T* __restrict__ x,
                                        const float* __restrict__ gamma, const float* __restrict__ mean,
                                        const float* __restrict__ rstd, int N, int C) {
    int lane = threadIdx.x & 31;
    int row = blockIdx.x * LN_WARPS + (threadIdx.x >> 5);
    if (row >= N) return;
    const T* xr = x + (size_t)row * C;
    const T* dr = dout + (size_t)row * C;
    float m = mean[row], r = rstd[row];
    float sg = 0.0f, sgx = 0.0f, xv[VEC], dv[VEC], gv[VEC];
    LN_ROW_LOOP(c, C) {
        load_vec(xv, xr + c);
        load_vec(dv, dr + c);
        load_vec(gv, gamma + c);
        for (int k = 0; k < VEC; k++) {
            float g = dv[k] * gv[k];
            sg += g;
            sgx += g * ((xv[k] - m) * r);
        }
    }
    float mg = warp_sum(sg) / C, mgx = warp_sum(sgx) / C;
    T* o = dx + (size_t)row * C;
    LN_ROW_LOOP(c, C) {
        float ov[VEC];
        load_vec(xv, xr + c);
        load_vec(dv, dr + c);
        load_vec(gv, gamma + c);
        load_vec(ov, o + c);
        for (int k = 0; k < VEC; k++) ov[k] += r * (dv[k] * gv[k] - mg - (xv[k] - m) * r * mgx);
        store_vec(o + c, ov);
    }
}

/* grid (column slabs, row chunks), a thread per column (coalesced across the slab; element by
 * element, because packets would leave too few threads for the rows to stream):
 * partial[chunk][c] = sum over the chunk's rows of dout*xhat, partial[n_chunks + chunk][c] = sum
 * of dout. */
template <typename T>
__global__ void layernorm_bwd_partial_kernel(float* __restrict__ partial, const T* __restrict__ dout,
                                             const T* __restrict__ x, const float* __restrict__ mean,
                                             const float* __restrict__ rstd, int N, int C, int rows_per_chunk,
                                             int n_chunks) {
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

/* Block (LN_FINAL_COLS columns) x (LN_FINAL_GROUPS groups): group k of a column sums chunks k,
 * k + LN_FINAL_GROUPS, ... in order, then group 0 adds the group sums in group order. */
__global__ void layernorm_bwd_final_kernel(float* dgamma, float* dbeta, const float* partial, int C, int n_chunks) {
    __shared__ float sg_part[LN_FINAL_GROUPS][LN_FINAL_COLS], sb_part[LN_FINAL_GROUPS][LN_FINAL_COLS];
    int col = threadIdx.x % LN_FINAL_COLS, grp = threadIdx.x / LN_FINAL_COLS;
    int c = blockIdx.x * LN_FINAL_COLS + col;
    float sg = 0.0f, sb = 0.0f;
    if (c < C)
        for (int k = grp; k < n_chunks; k += LN_FINAL_GROUPS) {
            sg += partial[(size_t)k * C + c];
            sb += partial[(size_t)(n_chunks + k) * C + c];
        }
    sg_part[grp][col] = sg;
    sb_part[grp][col] = sb;
    __syncthreads();
    if (grp == 0 && c < C) {
        for (int k = 1; k < LN_FINAL_GROUPS; k++) {
            sg += sg_part[k][col];
            sb += sb_part[k][col];
        }
        dgamma[c] += sg;
        dbeta[c] += sb;
    }
}

template <typename T>
static void k_layernorm_fwd(T* out, float* mean, float* rstd, const T* x, const float* gamma, const float* beta,
                            int N, int C) {
    bool packed = packable(C, sizeof(T), {out, x}) && packable(C, sizeof(float), {gamma, beta});
    LAUNCH_PACKED(packed, layernorm_fwd_kernel, T, ceil_div(N, LN_WARPS), 32 * LN_WARPS, out, mean, rstd, x, gamma,
                  beta, N, C);
}

/* dx, dgamma, dbeta += ; scratch holds layernorm_scratch_floats(C) floats. */
template <typename T>
static void k_layernorm_bwd(T* dx, float* dgamma, float* dbeta, const T* dout, const T* x, const float* gamma,
                            const float* mean, const float* rstd, int N, int C, float* scratch) {
    bool packed = packable(C, sizeof(T), {dx, dout, x}) && packable(C, sizeof(float), {gamma});
    LAUNCH_PACKED(packed, layernorm_bwd_dx_kernel, T, ceil_div(N, LN_WARPS), 32 * LN_WARPS, dx, dout, x, gamma, mean,
                  rstd, N, C);
    int rows_per_chunk = ln_rows_per_chunk(N);
    int n_chunks = (int)ceil_div(N, rows_per_chunk);
    dim3 grid(ceil_div(C, LN_COL_THREADS), n_chunks);
    layernorm_bwd_partial_kernel<T><<<grid, LN_COL_THREADS, 0, g_stream>>>(scratch, dout, x, mean, rstd, N, C,
                                                                           rows_per_chunk, n_chunks);
    LAUNCH_CHECK();
    layernorm_bwd_final_kernel<<<ceil_div(C, LN_FINAL_COLS), LN_FINAL_COLS * LN_FINAL_GROUPS, 0, g_stream>>>(
        dgamma, dbeta, scratch, C, n_chunks);
    LAUNCH_CHECK();
}

#endif
