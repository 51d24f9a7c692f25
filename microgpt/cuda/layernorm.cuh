/* layernorm.cuh: LayerNorm over the last dimension (eps 1e-5, biased variance), as the CPU's
 * layernorm_forward / layernorm_backward. gamma/beta are the fp32 master parameters; mean and rstd
 * [N] (fp32) are saved by the forward for the backward.
 *
 * Forward and dx: one warp per row, moving 16-byte packets where the width allows (common.cuh).
 * The backward is two kernels, without atomics. The first, k_layernorm_bwd, owns a chunk of rows
 * and a slab of columns (all C of them up to LN_SLAB_COLS): while its warps compute dx, each also
 * sums dout * xhat and dout per column over its rows in shared memory, and the block adds its
 * warps' sums in warp order into the chunk's partial dgamma/dbeta; so one kernel reads dout and x
 * for both. The second, k_layernorm_bwd_final, adds the chunk partials in a fixed order. Chunks
 * depend only on N and slabs only on C, so the result does not depend on the GPU.
 *
 * Precision fp8: the forward's output and the backward's dx are FP8 products' operands, so both
 * kernels can also take their amax (common.cuh's block_amax_commit), saving the cast a full read. */
#ifndef MICROGPT_CUDA_LAYERNORM_CUH
#define MICROGPT_CUDA_LAYERNORM_CUH

#include "common.cuh"

#define LN_EPS 1e-5f
#define LN_WARPS 8         /* warps per block in the row kernels */
#define LN_MAX_CHUNKS 512  /* row chunks for dgamma/dbeta partials: 512 blocks (4 per SM) for 120M */
#define LN_SLAB_COLS 768   /* widest column slab of the backward: LN_WARPS x 2 sums per column fill the
                              48 KB of shared memory a block gets without cudaFuncSetAttribute */
#define LN_FINAL_COLS 32   /* columns per block in the final sum ... */
#define LN_FINAL_GROUPS 32 /* ... and the groups of chunks each column's sum is split into */

/* Scratch floats layernorm_bwd needs for width C. */
static size_t layernorm_scratch_floats(int C) { return (size_t)2 * LN_MAX_CHUNKS * C; }

static int ln_rows_per_chunk(int N) { return (int)ceil_div((size_t)N, N < LN_MAX_CHUNKS ? (size_t)N : LN_MAX_CHUNKS); }

/* Columns per slab of the backward: all C if they fit, else the fewest slabs that do, of equal
 * width rounded up to the longest packet so that every slab starts on a packet boundary (the last
 * is the shorter). Each slab's blocks read whole rows for the row means, so wide rows are read
 * once per slab: the price of staying within 48 KB. */
static int ln_slab_cols(int C) {
    if (C <= LN_SLAB_COLS) return C;
    unsigned n_slabs = ceil_div(C, LN_SLAB_COLS);
    return PACK(bf16) * (int)ceil_div(ceil_div(C, n_slabs), PACK(bf16));
}

/* Lane `lane` of a row's warp handles the VEC-element packets at lane*VEC, lane*VEC + 32*VEC, ...
 * of the row (or of the slab, in the backward). */
#define LN_ROW_LOOP(c, C) for (int c = lane * VEC; c < (C); c += 32 * VEC)

/* One row of the forward (the row's warp); returns the amax bits of the row's outputs as stored
 * (lane-local). */
template <typename T, int VEC>
__device__ __forceinline__ unsigned ln_fwd_row(T* __restrict__ out, float* __restrict__ mean, float* __restrict__ rstd,
                                               const T* __restrict__ x, const float* __restrict__ gamma,
                                               const float* __restrict__ beta, int row, int C) {
    int lane = threadIdx.x & 31;
    const T* xr = x + (size_t)row * C;
    float s = 0.0f, v[VEC];
    unsigned am = 0;
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
        for (int k = 0; k < VEC; k++) {
            v[k] = (v[k] - m) * r * g[k] + b[k];
            am = max(am, abs_bits(as_stored<T>(v[k])));
        }
        store_vec(o + c, v);
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
    return am;
}

/* One warp per row; amax_bits (precision fp8, else NULL): the outputs' amax, atomicMax'ed in. */
template <typename T, int VEC>
__global__ void k_layernorm_fwd(T* __restrict__ out, float* __restrict__ mean, float* __restrict__ rstd,
                                const T* __restrict__ x, const float* __restrict__ gamma,
                                const float* __restrict__ beta, int N, int C, unsigned* amax_bits) {
    int row = blockIdx.x * LN_WARPS + (threadIdx.x >> 5);
    unsigned am = row < N ? ln_fwd_row<T, VEC>(out, mean, rstd, x, gamma, beta, row, C) : 0u; /* whole warps */
    block_amax_commit(amax_bits, am);
}

/* The means over a row of g = dout * gamma and of g * xhat (xhat = (x - mean) * rstd), which every
 * column's dx needs; every lane of the row's warp gets both. */
template <typename T, int VEC>
__device__ __forceinline__ void ln_bwd_row_means(float* mg, float* mgx, const T* xr, const T* dr,
                                                 const float* gamma, float m, float r, int C) {
    int lane = threadIdx.x & 31;
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
    *mg = warp_sum(sg) / C;
    *mgx = warp_sum(sgx) / C;
}

/* One row's `width` columns of a slab (every pointer already at the slab's first column):
 * dx += rstd * (g - mean(g) - xhat * mean(g * xhat)), and dout * xhat and dout added into the
 * warp's column sums. A lane touches the same columns in every row, so no other thread touches
 * its sums. Returns the amax bits of the row's dx as stored (lane-local). */
template <typename T, int VEC>
__device__ __forceinline__ unsigned ln_bwd_slab_row(T* o, float* dg_sum, float* db_sum, const T* xs, const T* ds,
                                                    const float* gs, float m, float r, float mg, float mgx,
                                                    int width) {
    int lane = threadIdx.x & 31;
    unsigned am = 0;
    LN_ROW_LOOP(j, width) {
        float xv[VEC], dv[VEC], gv[VEC], ov[VEC], ag[VEC], ab[VEC];
        load_vec(xv, xs + j);
        load_vec(dv, ds + j);
        load_vec(gv, gs + j);
        load_vec(ov, o + j);
        load_vec(ag, dg_sum + j);
        load_vec(ab, db_sum + j);
        for (int k = 0; k < VEC; k++) {
            float xhat = (xv[k] - m) * r;
            ov[k] += r * (dv[k] * gv[k] - mg - xhat * mgx);
            ag[k] += dv[k] * xhat;
            ab[k] += dv[k];
            am = max(am, abs_bits(as_stored<T>(ov[k])));
        }
        store_vec(o + j, ov);
        store_vec(dg_sum + j, ag);
        store_vec(db_sum + j, ab);
    }
    return am;
}

/* grid (column slabs, row chunks), LN_WARPS warps a block. Warp w takes rows r0 + w,
 * r0 + w + LN_WARPS, ... of the chunk: the row's means over all C columns, then dx over the slab's
 * columns, adding dout * xhat and dout into its own per-column sums in shared memory.
 * Then the block adds the warps' sums in warp order and writes partial[chunk][c] (dgamma) and
 * partial[n_chunks + chunk][c] (dbeta) for the slab's columns. dx must not alias dout or x.
 * amax_bits (precision fp8, else NULL): the amax of dx (after the addition), atomicMax'ed in. */
template <typename T, int VEC>
__global__ void k_layernorm_bwd(T* __restrict__ dx, float* __restrict__ partial, const T* __restrict__ dout,
                                const T* __restrict__ x, const float* __restrict__ gamma,
                                const float* __restrict__ mean, const float* __restrict__ rstd, int N, int C,
                                int rows_per_chunk, int slab_cols, unsigned* amax_bits) {
    __shared__ __align__(16) float col_sums[LN_WARPS][2][LN_SLAB_COLS]; /* [warp][dgamma, dbeta][slab column] */
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int c0 = blockIdx.x * slab_cols, width = min(slab_cols, C - c0);
    int chunk = blockIdx.y, n_chunks = gridDim.y;
    int r0 = chunk * rows_per_chunk, r1 = min(N, r0 + rows_per_chunk);
    /* each lane clears the columns it will add into, so no barrier is needed before the rows; a
     * warp with no rows (short last chunk) leaves zeros */
    const float zero[VEC] = {};
    unsigned am = 0;
    LN_ROW_LOOP(j, width) {
        store_vec(col_sums[warp][0] + j, zero);
        store_vec(col_sums[warp][1] + j, zero);
    }
    for (int row = r0 + warp; row < r1; row += LN_WARPS) {
        const T* xr = x + (size_t)row * C;
        const T* dr = dout + (size_t)row * C;
        float m = mean[row], r = rstd[row], mg, mgx;
        ln_bwd_row_means<T, VEC>(&mg, &mgx, xr, dr, gamma, m, r, C);
        am = max(am, ln_bwd_slab_row<T, VEC>(dx + (size_t)row * C + c0, col_sums[warp][0], col_sums[warp][1],
                                             xr + c0, dr + c0, gamma + c0, m, r, mg, mgx, width));
    }
    __syncthreads();
    for (int j = threadIdx.x; j < width; j += blockDim.x) {
        float sg = 0.0f, sb = 0.0f;
        for (int w = 0; w < LN_WARPS; w++) {
            sg += col_sums[w][0][j];
            sb += col_sums[w][1][j];
        }
        partial[(size_t)chunk * C + c0 + j] = sg;
        partial[(size_t)(n_chunks + chunk) * C + c0 + j] = sb;
    }
    block_amax_commit_in(amax_bits, am, (unsigned*)col_sums[0][0]); /* its barrier: col_sums is read */
}

/* Block (LN_FINAL_COLS columns) x (LN_FINAL_GROUPS groups): group k of a column sums chunks k,
 * k + LN_FINAL_GROUPS, ... in order, then group 0 adds the group sums in group order and writes
 * (add 0: whatever dgamma/dbeta held is not read) or adds (add 1) the result. */
__global__ void k_layernorm_bwd_final(float* dgamma, float* dbeta, const float* partial, int C, int n_chunks,
                                      int add) {
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
        dgamma[c] = add ? dgamma[c] + sg : sg;
        dbeta[c] = add ? dbeta[c] + sb : sb;
    }
}

/* amax_bits: precision fp8's amax of out (docs/DESIGN.md §18) is atomicMax'ed in; NULL: none. */
template <typename T>
static void layernorm_fwd(T* out, float* mean, float* rstd, const T* x, const float* gamma, const float* beta,
                          int N, int C, unsigned* amax_bits = NULL) {
    bool packed = packable(C, sizeof(T), {out, x}) && packable(C, sizeof(float), {gamma, beta});
    LAUNCH_PACKED(packed, k_layernorm_fwd, T, ceil_div(N, LN_WARPS), 32 * LN_WARPS, out, mean, rstd, x, gamma,
                  beta, N, C, amax_bits);
}

/* dx += ; dgamma, dbeta = / += by grad_beta (0 or 1); scratch holds layernorm_scratch_floats(C) floats.
 * amax_bits: precision fp8's amax of dx (after the addition) is atomicMax'ed in; NULL: none. */
template <typename T>
static void layernorm_bwd(T* dx, float* dgamma, float* dbeta, const T* dout, const T* x, const float* gamma,
                          const float* mean, const float* rstd, int N, int C, float* scratch, float grad_beta,
                          unsigned* amax_bits = NULL) {
    bool packed = packable(C, sizeof(T), {dx, dout, x}) && packable(C, sizeof(float), {gamma});
    int rows_per_chunk = ln_rows_per_chunk(N);
    int n_chunks = (int)ceil_div(N, rows_per_chunk);
    int slab_cols = ln_slab_cols(C);
    dim3 grid(ceil_div(C, slab_cols), n_chunks);
    LAUNCH_PACKED(packed, k_layernorm_bwd, T, grid, 32 * LN_WARPS, dx, scratch, dout, x, gamma, mean, rstd, N, C,
                  rows_per_chunk, slab_cols, amax_bits);
    k_layernorm_bwd_final<<<ceil_div(C, LN_FINAL_COLS), LN_FINAL_COLS * LN_FINAL_GROUPS, 0, g_stream>>>(
        dgamma, dbeta, scratch, C, n_chunks, grad_beta != 0.0f);
    LAUNCH_CHECK();
}

#endif
