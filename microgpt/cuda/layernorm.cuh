/* layernorm.cuh: LayerNorm over the last dimension (eps 1e-5, biased variance), as the CPU's
 * layernorm_forward / layernorm_backward. gamma/beta are the fp32 master parameters; mean and rstd
 * [N] (fp32) are saved by the forward for the backward.
 *
 * Forward: one warp per row, moving 16-byte packets where the width allows (common.cuh).
 *
 * The backward is two kernels, without atomics. The first computes dx and the chunk partials of
 * dgamma/dbeta, a chunk of rows a block; the second, k_layernorm_bwd_final, adds the chunk partials
 * in a fixed order. Chunks depend only on N (and slabs only on C), so the result does not depend
 * on the GPU. The first kernel depends on the row width:
 *   - rows a warp holds in registers (C <= LN_SLAB_COLS and at most LN_REG_PACKETS packets a lane:
 *     ANDREA's models in 16 bits): k_layernorm_bwd_regs, at most LN_REGS_CHUNKS chunks. A warp
 *     loads each of its rows' x, dout and dx once (as stored) and keeps its lanes' dgamma/dbeta
 *     column sums in registers across its rows; only at the end do the warps' sums meet in shared
 *     memory, added in warp order. Against k_layernorm_bwd's shared-memory sums and 512 chunks:
 *     28.0 -> 21.4 us a launch at ANDREA-120M on an H200 (docs/BENCHMARKS.md log #52, with the
 *     ideas tried and dropped: #50, #51, #56, #58, #59);
 *   - wider rows: k_layernorm_bwd, a chunk of rows and a slab of columns (all C of them up to
 *     LN_SLAB_COLS) a block, at most LN_MAX_CHUNKS chunks: while its warps compute dx, each sums
 *     dout * xhat and dout per column over its rows in shared memory, and the block adds its
 *     warps' sums in warp order into the chunk's partial; so one kernel reads dout and x for both.
 * dx is the same either way; dgamma/dbeta are sums grouped by chunk, fixed for a shape.
 *
 * Precision fp8: the forward's output and the backward's dx are FP8 products' operands, so both
 * kernels can also take their amax (common.cuh's block_amax_commit), saving the cast a full read. */
#ifndef MICROGPT_CUDA_LAYERNORM_CUH
#define MICROGPT_CUDA_LAYERNORM_CUH

#include "common.cuh"
#include "side_stream.cuh"

#define LN_EPS 1e-5f
#define LN_WARPS 8         /* warps per block in the row kernels */
#define LN_MAX_CHUNKS 512  /* row chunks of k_layernorm_bwd (wide rows), and of the scratch */
#define LN_SLAB_COLS 768   /* widest column slab of the backward: LN_WARPS x 2 sums per column fill the
                              48 KB of shared memory a block gets without cudaFuncSetAttribute */
#define LN_FINAL_COLS 32   /* columns per block in the final sum ... */
#define LN_FINAL_GROUPS 32 /* ... and the groups of chunks each column's sum is split into */

#define LN_REGS_CHUNKS 256 /* row chunks of k_layernorm_bwd_regs: 32 rows a chunk (4 a warp) at N = 8192 */
#define LN_REG_PACKETS 4   /* packets of a row a lane holds in registers at most */

/* Scratch floats layernorm_bwd needs for width C (LN_REGS_CHUNKS <= LN_MAX_CHUNKS). */
static size_t layernorm_scratch_floats(int C) { return (size_t)2 * LN_MAX_CHUNKS * C; }

static int ln_rows_per_chunk(int N, int max_chunks) {
    return (int)ceil_div((size_t)N, N < max_chunks ? (size_t)N : max_chunks);
}

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

/* The mean and rstd of row xr (the row's warp; every lane gets both). */
template <typename T, int VEC>
__device__ __forceinline__ void ln_row_stats(float* mean, float* rstd, const T* __restrict__ xr, int C) {
    int lane = threadIdx.x & 31;
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
    *mean = m;
    *rstd = 1.0f / sqrtf(warp_sum(s2) / C + LN_EPS);
}

/* One row of the forward (the row's warp); returns the amax bits of the row's outputs as stored
 * (lane-local). */
template <typename T, int VEC>
__device__ __forceinline__ unsigned ln_fwd_row(T* __restrict__ out, float* __restrict__ mean, float* __restrict__ rstd,
                                               const T* __restrict__ x, const float* __restrict__ gamma,
                                               const float* __restrict__ beta, int row, int C) {
    int lane = threadIdx.x & 31;
    const T* xr = x + (size_t)row * C;
    float m, r, v[VEC];
    unsigned am = 0;
    ln_row_stats<T, VEC>(&m, &r, xr, C);
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
    await_previous_kernel();
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

/* After the block's barrier: its warps' column sums (col_sums[warp][dgamma, dbeta][column]) added in
 * warp order into the chunk's partial dgamma, partial[chunk][c], and dbeta, partial[n_chunks +
 * chunk][c], for the slab's columns c = c0 .. c0 + width - 1. */
__device__ __forceinline__ void ln_bwd_block_partials(float* partial, const float (*col_sums)[2][LN_SLAB_COLS],
                                                      int chunk, int n_chunks, int C, int c0, int width) {
    for (int j = threadIdx.x; j < width; j += blockDim.x) {
        float sg = 0.0f, sb = 0.0f;
        for (int w = 0; w < LN_WARPS; w++) {
            sg += col_sums[w][0][j];
            sb += col_sums[w][1][j];
        }
        partial[(size_t)chunk * C + c0 + j] = sg;
        partial[(size_t)(n_chunks + chunk) * C + c0 + j] = sb;
    }
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
    await_previous_kernel();
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
    ln_bwd_block_partials(partial, col_sums, chunk, n_chunks, C, c0, width);
    block_amax_commit_in(amax_bits, am, (unsigned*)col_sums[0][0]); /* its barrier: col_sums is read */
}

/* Packet p of a lane's part of a row starts at column ln_reg_col(p); the lane holds it where that
 * is < C. The same columns as LN_ROW_LOOP, in the same order. */
#define ln_reg_col(p) ((lane + 32 * (p)) * VEC)
#define LN_REG_LOOP(p, C) _Pragma("unroll") for (int p = 0; p < PACKETS; p++) if (ln_reg_col(p) < (C))

/* kernel<T, VEC, packets> for packets 1 .. LN_REG_PACKETS, VEC = PACK(T) when packed, else 1, on
 * g_stream, checked. */
#define LN_LAUNCH_PACKETS_VEC(VEC, packets, kernel, T, grid, block, ...)                              \
    switch (packets) {                                                                                \
    case 1: launch_kernel(kernel<T, VEC, 1>, (grid), (block), __VA_ARGS__); break;                    \
    case 2: launch_kernel(kernel<T, VEC, 2>, (grid), (block), __VA_ARGS__); break;                    \
    case 3: launch_kernel(kernel<T, VEC, 3>, (grid), (block), __VA_ARGS__); break;                    \
    default: launch_kernel(kernel<T, VEC, LN_REG_PACKETS>, (grid), (block), __VA_ARGS__); break;      \
    }
#define LN_LAUNCH_PACKETS(packed, packets, kernel, T, grid, block, ...)                              \
    do {                                                                                             \
        if (packed) LN_LAUNCH_PACKETS_VEC(PACK(T), packets, kernel, T, grid, block, __VA_ARGS__)     \
        else LN_LAUNCH_PACKETS_VEC(1, packets, kernel, T, grid, block, __VA_ARGS__)                  \
    } while (0)

/* Packets a lane holds of a row of C columns; above LN_REG_PACKETS the row is too wide. */
static int ln_reg_packets(int C, bool packed, int pack) { return (int)ceil_div(C, 32 * (packed ? pack : 1)); }

/* VEC elements at p, kept as stored (16-bit rows take half the registers of fp32 copies). */
template <int VEC, typename T>
__device__ __forceinline__ void load_raw(T (&t)[VEC], const T* p) {
    if constexpr (VEC % PACK(T) == 0) {
#pragma unroll
        for (int q = 0; q < VEC / PACK(T); q++) reinterpret_cast<int4*>(t)[q] = reinterpret_cast<const int4*>(p)[q];
    } else {
#pragma unroll
        for (int k = 0; k < VEC; k++) t[k] = p[k];
    }
}

/* What the register kernel does beside dx: nothing more (LnBwdPlain), or (precision fp8's delayed
 * scaling, cuda/fp8.cuh's LnBwdCodes) dx's FP8 codes in both layouts: `codes` says which. A codes
 * epilogue's begin() runs first in every thread, row() takes each packet of a row's dx as computed
 * (as stored in T where VEC is even; tr: the row within the block's chunk; shared: the
 * block's column-sum memory, unused while the rows run), and finish() the block's rows r0 .. r1
 * after a barrier, before the column sums take the shared memory back. */
struct LnBwdPlain {
    static constexpr bool codes = false;
};

/* k_layernorm_bwd for rows of one slab (C <= LN_SLAB_COLS) a warp holds in registers, grid
 * (n_chunks), LN_WARPS warps a block, __launch_bounds__ for two blocks per multiprocessor (at most
 * 128 registers a thread). Warp w takes rows r0 + w, r0 + w + LN_WARPS, ... of the chunk, each
 * lane loading its PACKETS packets of the row's x, dout and dx once (as stored); the lane's
 * columns' dout * xhat and dout sums over the warp's rows stay in registers (a warp without rows
 * keeps zeros). Then the warps' sums go to shared memory and the block adds them in warp order, as
 * k_layernorm_bwd does. dx's operations are k_layernorm_bwd's, in the same order: the same dx.
 * amax_bits as k_layernorm_bwd's. */
template <typename T, int VEC, int PACKETS, typename Epi>
__device__ __forceinline__ void ln_bwd_regs_body(T* __restrict__ dx, float* __restrict__ partial,
                                                 const T* __restrict__ dout, const T* __restrict__ x,
                                                 const float* __restrict__ gamma, const float* __restrict__ mean,
                                                 const float* __restrict__ rstd, int N, int C, int rows_per_chunk,
                                                 unsigned* amax_bits, Epi epi) {
    __shared__ __align__(16) float col_sums[LN_WARPS][2][LN_SLAB_COLS]; /* [warp][dgamma, dbeta][column] */
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int chunk = blockIdx.x, n_chunks = gridDim.x;
    int r0 = chunk * rows_per_chunk, r1 = min(N, r0 + rows_per_chunk);
    float dg[PACKETS][VEC] = {}, db[PACKETS][VEC] = {};
    unsigned am = 0;
    if constexpr (Epi::codes) epi.begin();
    /* With codes, converted in pairs (fp8.cuh): out rounded to T in pairs, for the amax, the store
     * (the same bits: its values are T's already) and the codes (which then take them as they are) */
    constexpr bool ln_bwd_pairs = Epi::codes && VEC % 2 == 0;
    for (int row = r0 + warp; row < r1; row += LN_WARPS) {
        __align__(16) T xv[PACKETS][VEC], dv[PACKETS][VEC], ov[PACKETS][VEC];
        const T* xr = x + (size_t)row * C;
        const T* dr = dout + (size_t)row * C;
        T* o = dx + (size_t)row * C;
        LN_REG_LOOP(p, C) {
            load_raw(xv[p], xr + ln_reg_col(p));
            load_raw(dv[p], dr + ln_reg_col(p));
            load_raw(ov[p], o + ln_reg_col(p));
        }
        float m = mean[row], r = rstd[row], sg = 0.0f, sgx = 0.0f;
        LN_REG_LOOP(p, C) {
            float gv[VEC];
            load_vec(gv, gamma + ln_reg_col(p));
            for (int k = 0; k < VEC; k++) {
                float g = to_f(dv[p][k]) * gv[k];
                sg += g;
                sgx += g * ((to_f(xv[p][k]) - m) * r);
            }
        }
        float mg = warp_sum(sg) / C, mgx = warp_sum(sgx) / C;
        LN_REG_LOOP(p, C) {
            float gv[VEC], out[VEC];
            load_vec(gv, gamma + ln_reg_col(p));
            for (int k = 0; k < VEC; k++) {
                float d = to_f(dv[p][k]), xhat = (to_f(xv[p][k]) - m) * r;
                out[k] = to_f(ov[p][k]) + r * (d * gv[k] - mg - xhat * mgx);
                dg[p][k] += d * xhat;
                db[p][k] += d;
                if constexpr (!ln_bwd_pairs) am = max(am, abs_bits(as_stored<T>(out[k])));
            }
            if constexpr (ln_bwd_pairs)
                for (int k = 0; k < VEC; k += 2) {
                    float2 y = as_stored2<T>(out[k], out[k + 1]);
                    out[k] = y.x;
                    out[k + 1] = y.y;
                    am = max(am, max(abs_bits(y.x), abs_bits(y.y)));
                }
            store_vec(o + ln_reg_col(p), out);
            if constexpr (Epi::codes) epi.template row<T, VEC>(out, row, row - r0, ln_reg_col(p), C, col_sums);
        }
    }
    if constexpr (Epi::codes) {
        __syncthreads();
        epi.finish(col_sums, r0, r1, N, C);
        __syncthreads();
    }
    LN_REG_LOOP(p, C) {
        store_vec(col_sums[warp][0] + ln_reg_col(p), dg[p]);
        store_vec(col_sums[warp][1] + ln_reg_col(p), db[p]);
    }
    __syncthreads();
    ln_bwd_block_partials(partial, col_sums, chunk, n_chunks, C, 0, C);
    block_amax_commit_in(amax_bits, am, (unsigned*)col_sums[0][0]); /* its barrier: col_sums is read */
}

template <typename T, int VEC, int PACKETS>
__global__ void __launch_bounds__(32 * LN_WARPS, 2)
k_layernorm_bwd_regs(T* __restrict__ dx, float* __restrict__ partial, const T* __restrict__ dout,
                     const T* __restrict__ x, const float* __restrict__ gamma, const float* __restrict__ mean,
                     const float* __restrict__ rstd, int N, int C, int rows_per_chunk, unsigned* amax_bits) {
    await_previous_kernel();
    ln_bwd_regs_body<T, VEC, PACKETS>(dx, partial, dout, x, gamma, mean, rstd, N, C, rows_per_chunk, amax_bits,
                                      LnBwdPlain());
}

/* Block (LN_FINAL_COLS columns) x (LN_FINAL_GROUPS groups): group k of a column sums chunks k,
 * k + LN_FINAL_GROUPS, ... in order, then group 0 adds the group sums in group order and writes
 * (add 0: whatever dgamma/dbeta held is not read) or adds (add 1) the result. */
__global__ void k_layernorm_bwd_final(float* dgamma, float* dbeta, const float* partial, int C, int n_chunks,
                                      int add) {
    await_previous_kernel();
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

/* dgamma, dbeta = / += (add) the sums of the n_chunks chunk partials in scratch */
static void layernorm_bwd_final(float* dgamma, float* dbeta, const float* scratch, int C, int n_chunks, bool add) {
    launch_kernel(k_layernorm_bwd_final, ceil_div(C, LN_FINAL_COLS), LN_FINAL_COLS * LN_FINAL_GROUPS, dgamma, dbeta,
                  scratch, C, n_chunks, add);
}

/* A backward's final sums, which only the update reads: on the side stream behind the next weight
 * gradient where there is one (side_stream.cuh's side_after_next_product, docs/BENCHMARKS.md #90),
 * else at once; the next backward waits for them before it writes scratch again
 * (layernorm_bwd_scratch_free). */
static void layernorm_bwd_final_issue(float* dgamma, float* dbeta, const float* scratch, int C, int n_chunks,
                                      bool add) {
    side_after_next_product(scratch, [=] { layernorm_bwd_final(dgamma, dbeta, scratch, C, n_chunks, add); });
}

static void layernorm_bwd_scratch_free(const float* scratch) { side_wait(scratch); }

/* The register kernel's launch for these operands: packed or not, the packets a lane holds (0: the
 * rows do not fit, the slab kernel takes them), rows a chunk, chunks. */
struct LnBwdRegs {
    bool packed;
    int packets, rows_per_chunk, n_chunks;
};
template <typename T>
static LnBwdRegs ln_bwd_regs_plan(const T* dx, const T* dout, const T* x, const float* gamma, int N, int C) {
    LnBwdRegs p;
    p.packed = packable(C, sizeof(T), {dx, dout, x}) && packable(C, sizeof(float), {gamma});
    p.packets = ln_reg_packets(C, p.packed, PACK(T));
    if (C > LN_SLAB_COLS || p.packets > LN_REG_PACKETS) p.packets = 0;
    p.rows_per_chunk = ln_rows_per_chunk(N, LN_REGS_CHUNKS);
    p.n_chunks = (int)ceil_div(N, p.rows_per_chunk);
    return p;
}

/* dx += ; dgamma, dbeta = / += by grad_beta (0 or 1); scratch holds layernorm_scratch_floats(C) floats.
 * amax_bits: precision fp8's amax of dx (after the addition) is atomicMax'ed in; NULL: none. */
template <typename T>
static void layernorm_bwd(T* dx, float* dgamma, float* dbeta, const T* dout, const T* x, const float* gamma,
                          const float* mean, const float* rstd, int N, int C, float* scratch, float grad_beta,
                          unsigned* amax_bits = NULL) {
    LnBwdRegs rp = ln_bwd_regs_plan(dx, dout, x, gamma, N, C);
    layernorm_bwd_scratch_free(scratch);
    if (rp.packets) { /* the row in registers */
        LN_LAUNCH_PACKETS(rp.packed, rp.packets, k_layernorm_bwd_regs, T, rp.n_chunks, 32 * LN_WARPS, dx, scratch,
                          dout, x, gamma, mean, rstd, N, C, rp.rows_per_chunk, amax_bits);
        layernorm_bwd_final_issue(dgamma, dbeta, scratch, C, rp.n_chunks, grad_beta != 0.0f);
        return;
    }
    int rows_per_chunk = ln_rows_per_chunk(N, LN_MAX_CHUNKS);
    int n_chunks = (int)ceil_div(N, rows_per_chunk);
    int slab_cols = ln_slab_cols(C);
    dim3 grid(ceil_div(C, slab_cols), n_chunks);
    LAUNCH_PACKED(rp.packed, k_layernorm_bwd, T, grid, 32 * LN_WARPS, dx, scratch, dout, x, gamma, mean, rstd, N, C,
                  rows_per_chunk, slab_cols, amax_bits);
    layernorm_bwd_final_issue(dgamma, dbeta, scratch, C, n_chunks, grad_beta != 0.0f);
}

#endif
