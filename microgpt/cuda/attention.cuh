/* attention.cuh: the attention sub-layer's three kernel pairs.
 *   k_attn_qkv  q, k, v [N, C] = x @ W_Q, x @ W_K, x @ W_V   (one batched product: the three weights
 *               are consecutive [C,C] blocks of the flat vector, and q, k, v consecutive [N,C] blocks)
 *   k_attn      causal softmax(q k^T / sqrt(hs)) v per head, hs = C / H; head h owns columns
 *               [h*hs, (h+1)*hs) of q, k, v and out, as the CPU's attention_forward/backward
 *   k_attn_out  out = y @ W_O
 *
 * k_attn never keeps a T×T matrix per layer: the forward saves only the softmax statistic
 * lse = log-sum-exp of each score row ([B, H, T], fp32) and the backward recomputes probabilities
 * as exp(s - lse). It has two implementations, chosen by attn_flash_ok() from the type and shape:
 *
 *   flash  (bf16/fp16, hs 16, 32 or 64): fused tiles on tensor cores (nvcuda::wmma, fp32
 *          accumulate), online softmax in fp32, nothing T×T in global memory. The backward is
 *          flash-attention-2 style but split in two kernels so that no output needs atomics:
 *          one per key block accumulates dK, dV; one per query block accumulates dQ; both
 *          recompute P from lse and use delta = rowsum(dO ∘ O) from a small first kernel.
 *   cuBLAS (fp32, the reference mode compared tightly with the CPU engine, and other head sizes):
 *          scores of one sequence at a time, batched over heads, into fp32 [H, T, T] scratch.
 *
 * Precision: scores and their gradient are fp32; the probabilities P and dS fed to the second
 * products are rounded to T, as in flash-attention implementations. */
#ifndef MICROGPT_CUDA_ATTENTION_CUH
#define MICROGPT_CUDA_ATTENTION_CUH

#include <mma.h>

#include "matmul.cuh"

#define ATTN_WARPS 8 /* cuBLAS path: score rows per softmax block, one warp per row */

/* The flash path's tiles: a block of FA_WARPS warps owns FA_TILE query rows (forward, dQ) or
 * FA_TILE keys (dK/dV), 16 per warp, and walks the other side in tiles of FA_TILE. */
#define FA_TILE 64
#define FA_WARPS 4
#define FA_THREADS (32 * FA_WARPS)

/* Whether k_attn uses the flash kernels: 16-bit types only (wmma has no fp32 inputs), head sizes
 * a multiple of the 16-wide fragment that fit the shared-memory budget, and rows of whole 16-byte
 * vectors (C % 8) so tiles load with aligned uint4 reads. */
static bool attn_flash_ok(bool half_type, int C, int H) {
    int hs = C / H;
    return half_type && C % 8 == 0 && (hs == 16 || hs == 32 || hs == 64);
}
template <typename T> static bool attn_flash_ok(int C, int H) { return attn_flash_ok(sizeof(T) == 2, C, H); }

template <typename T>
struct AttnScratch {
    float* S;     /* cuBLAS path: [H, T, T] scores of one sequence */
    float* dP;    /* cuBLAS path: [H, T, T] gradient of the probabilities (backward only) */
    T* P;         /* cuBLAS path: [H, T, T] probabilities (forward), then dS (backward) */
    float* delta; /* flash path: [B, H, T] rowsum(dO ∘ O) (backward only) */
};

/* Elements of each of S, dP, P (0 on the flash path) and of delta (0 on the cuBLAS path). */
static size_t attn_scratch_elems(bool half_type, int B, int T_, int C, int H) {
    return attn_flash_ok(half_type, C, H) ? 0 : (size_t)H * T_ * T_;
}
static size_t attn_delta_elems(bool half_type, int B, int T_, int C, int H) {
    return attn_flash_ok(half_type, C, H) ? (size_t)B * H * T_ : 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* QKV projections */

/* qkv: [3, N, C] (q, then k, then v); w_qkv: W_Q, W_K, W_V consecutive, each [C, C]. */
template <typename T>
static void k_attn_qkv_fwd(T* qkv, const T* x, const T* w_qkv, int N, int C) {
    cudaDataType_t t = TypeInfo<T>::dtype;
    gemm_rm(false, false, N, C, C, 1.0f, x, C, 0, w_qkv, C, (long long)C * C, 0.0f, qkv, C, (long long)N * C, 3, t, t);
}

/* dx += sum_i dqkv_i @ W_i^T (in the fixed order q, k, v); dw_i += x^T @ dqkv_i. */
template <typename T>
static void k_attn_qkv_bwd(T* dx, float* dw_qkv, const T* dqkv, const T* x, const T* w_qkv, int N, int C) {
    gemm_rm(true, false, C, C, N, 1.0f, x, C, 0, dqkv, C, (long long)N * C, 1.0f, dw_qkv, C, (long long)C * C, 3,
            TypeInfo<T>::dtype, CUDA_R_32F);
    for (int i = 0; i < 3; i++) linear_dx(dx, dqkv + (size_t)i * N * C, w_qkv + (size_t)i * C * C, N, C, C, 1.0f);
}

/* ---------------------------------------------------------------------------------------------- */
/* Causal softmax on one sequence's scores. Rows are (h, i), i the query position; columns j > i are
 * masked: their probability is written as exactly 0, so every product over full rows is causal. */

/* P = softmax(S) per row; lse[row] = log sum_j<=i exp(S[row, j]). */
template <typename T>
__global__ void attn_softmax_fwd_kernel(T* P, float* lse, const float* S, int n_rows, int T_) {
    int lane = threadIdx.x & 31;
    int row = blockIdx.x * ATTN_WARPS + (threadIdx.x >> 5);
    if (row >= n_rows) return;
    int i = row % T_;
    const float* s = S + (size_t)row * T_;
    float mx = -INFINITY;
    for (int j = lane; j <= i; j += 32) mx = fmaxf(mx, s[j]);
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int j = lane; j <= i; j += 32) sum += expf(s[j] - mx);
    float l = mx + logf(warp_sum(sum));
    T* p = P + (size_t)row * T_;
    for (int j = lane; j < T_; j += 32) p[j] = from_f<T>(j <= i ? expf(s[j] - l) : 0.0f);
    if (lane == 0) lse[row] = l;
}

/* The backward's P: the same expf(s - lse) from the same S and the saved lse, so identical bits. */
template <typename T>
__global__ void attn_probs_kernel(T* P, const float* lse, const float* S, int n_rows, int T_) {
    int lane = threadIdx.x & 31;
    int row = blockIdx.x * ATTN_WARPS + (threadIdx.x >> 5);
    if (row >= n_rows) return;
    int i = row % T_;
    float l = lse[row];
    const float* s = S + (size_t)row * T_;
    T* p = P + (size_t)row * T_;
    for (int j = lane; j < T_; j += 32) p[j] = from_f<T>(j <= i ? expf(s[j] - l) : 0.0f);
}

/* Softmax backward in fp32: dS = P * (dP - sum_j P dP), P = exp(S - lse) recomputed in fp32.
 * Written into dS (T), which may be the P buffer: each element is read (S, dP) before it is
 * written, and P itself is never read here. */
template <typename T>
__global__ void attn_softmax_bwd_kernel(T* dS, const float* dP, const float* lse, const float* S, int n_rows, int T_) {
    int lane = threadIdx.x & 31;
    int row = blockIdx.x * ATTN_WARPS + (threadIdx.x >> 5);
    if (row >= n_rows) return;
    int i = row % T_;
    float l = lse[row];
    const float* s = S + (size_t)row * T_;
    const float* dp = dP + (size_t)row * T_;
    float dot = 0.0f;
    for (int j = lane; j <= i; j += 32) dot += expf(s[j] - l) * dp[j];
    dot = warp_sum(dot);
    T* ds = dS + (size_t)row * T_;
    for (int j = lane; j < T_; j += 32) ds[j] = from_f<T>(j <= i ? expf(s[j] - l) * (dp[j] - dot) : 0.0f);
}

/* ---------------------------------------------------------------------------------------------- */
/* cuBLAS path of the scaled dot-product attention. Per sequence b, the products are batched over heads: head h's
 * q/k/v/out block starts at column h*hs (stride hs between heads, row stride C), its score
 * matrix at h*T*T. */

template <typename T>
static void attn_scores(float* S, const T* q, const T* k, int T_, int C, int H) {
    int hs = C / H;
    float scale = 1.0f / sqrtf((float)hs);
    /* S[h] = scale * q_h k_h^T  ([T, T] per head) */
    gemm_rm(false, true, T_, T_, hs, scale, q, C, hs, k, C, hs, 0.0f, S, T_, (long long)T_ * T_, H,
            TypeInfo<T>::dtype, CUDA_R_32F);
}

template <typename T>
static void attn_fwd_cublas(T* out, float* lse, const T* q, const T* k, const T* v, int B, int T_, int C, int H,
                            AttnScratch<T> sc) {
    int hs = C / H, n_rows = H * T_;
    cudaDataType_t t = TypeInfo<T>::dtype;
    for (int b = 0; b < B; b++) {
        size_t off = (size_t)b * T_ * C;
        attn_scores(sc.S, q + off, k + off, T_, C, H);
        attn_softmax_fwd_kernel<T><<<ceil_div(n_rows, ATTN_WARPS), 32 * ATTN_WARPS, 0, g_stream>>>(sc.P, lse + (size_t)b * n_rows,
                                                                                      sc.S, n_rows, T_);
        LAUNCH_CHECK();
        /* out_h = P_h v_h */
        gemm_rm(false, false, T_, hs, T_, 1.0f, sc.P, T_, (long long)T_ * T_, v + off, C, hs, 0.0f, out + off, C, hs,
                H, t, t);
    }
}

template <typename T>
static void attn_bwd_cublas(T* dq, T* dk, T* dv, const T* dout, const float* lse, const T* q, const T* k, const T* v,
                            int B, int T_, int C, int H, AttnScratch<T> sc) {
    int hs = C / H, n_rows = H * T_;
    float scale = 1.0f / sqrtf((float)hs);
    long long tt = (long long)T_ * T_;
    cudaDataType_t t = TypeInfo<T>::dtype;
    unsigned grid = ceil_div(n_rows, ATTN_WARPS);
    for (int b = 0; b < B; b++) {
        size_t off = (size_t)b * T_ * C;
        const float* lse_b = lse + (size_t)b * n_rows;
        attn_scores(sc.S, q + off, k + off, T_, C, H);
        attn_probs_kernel<T><<<grid, 32 * ATTN_WARPS, 0, g_stream>>>(sc.P, lse_b, sc.S, n_rows, T_);
        LAUNCH_CHECK();
        /* dP_h = dout_h v_h^T (fp32) */
        gemm_rm(false, true, T_, T_, hs, 1.0f, dout + off, C, hs, v + off, C, hs, 0.0f, sc.dP, T_, tt, H, t, CUDA_R_32F);
        /* dv_h += P_h^T dout_h */
        gemm_rm(true, false, T_, hs, T_, 1.0f, sc.P, T_, tt, dout + off, C, hs, 1.0f, dv + off, C, hs, H, t, t);
        /* dS into the P buffer (P is no longer needed) */
        attn_softmax_bwd_kernel<T><<<grid, 32 * ATTN_WARPS, 0, g_stream>>>(sc.P, sc.dP, lse_b, sc.S, n_rows, T_);
        LAUNCH_CHECK();
        /* scores were scale * q k^T: dq_h += scale dS_h k_h ; dk_h += scale dS_h^T q_h */
        gemm_rm(false, false, T_, hs, T_, scale, sc.P, T_, tt, k + off, C, hs, 1.0f, dq + off, C, hs, H, t, t);
        gemm_rm(true, false, T_, hs, T_, scale, sc.P, T_, tt, q + off, C, hs, 1.0f, dk + off, C, hs, H, t, t);
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Flash path. Shared-memory tiles, per block (hs = D, a template parameter):
 *   a "row tile"  [FA_TILE][D + 8] of T: 64 rows of one head's q, k, v or dout (the +8 pads rows
 *                 off a common bank; zero rows past T, so padded positions contribute nothing);
 *   a "warp tile" [16][FA_TILE + 4] fp32 per warp: one warp's score (or dP) block, later reused in
 *                 place for the same block rounded to T (row stride doubled, same bytes per row);
 *   an "out tile" [16][D + 4] fp32 per warp: the forward's running output.
 * Every wmma pointer is 32-byte aligned: tile sizes are multiples of 32 bytes and fragments start
 * at multiples of 16 elements. Scores run in base 2: s2 = (q·k) * scale * log2(e), so exp2f. */

#define FA_LOG2E 1.4426950408889634f
#define FA_LN2 0.6931471805599453f

namespace wmma = nvcuda::wmma;

template <typename T, int D>
struct Fa {
    static constexpr int LD = D + 8;           /* T per row of a row tile */
    static constexpr int SLD = FA_TILE + 4;    /* fp32 per row of a warp tile */
    static constexpr int PLD = 2 * SLD;        /* T per row of a warp tile viewed as T */
    static constexpr int OLD = D + 4;          /* fp32 per row of an out tile */
    static constexpr int KD = D / 16;          /* fragments along the head dimension */
    static constexpr size_t ROW_TILE = (size_t)FA_TILE * LD * sizeof(T);
    static constexpr size_t WARP_TILES = (size_t)FA_WARPS * 16 * SLD * sizeof(float);
    static constexpr size_t OUT_TILES = (size_t)FA_WARPS * 16 * OLD * sizeof(float);
    static constexpr size_t FWD_SMEM = 2 * ROW_TILE + WARP_TILES + OUT_TILES;
    static constexpr size_t DKV_SMEM = 2 * ROW_TILE + 2 * WARP_TILES + 2 * FA_TILE * sizeof(float);
    static constexpr size_t DQ_SMEM = 2 * ROW_TILE + 2 * WARP_TILES;
    typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> FragA;
    typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> FragB;   /* B[k][n] stored [k][n] */
    typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> FragBt;  /* B[k][n] stored [n][k] */
    typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> Acc;
};

/* Rows [r0, r0 + 64) of one head (src: the sequence's row 0 at the head's first column, row stride
 * C) into a row tile; rows at or past T are zero. Whole block, 16-byte vectors. */
template <typename T, int D>
__device__ __forceinline__ void fa_load_rows(T* dst, const T* src, int r0, int T_, int C) {
    constexpr int VEC = 16 / sizeof(T), PER_ROW = D / VEC;
    for (int e = threadIdx.x; e < FA_TILE * PER_ROW; e += FA_THREADS) {
        int r = e / PER_ROW, c = (e % PER_ROW) * VEC;
        uint4 val = make_uint4(0u, 0u, 0u, 0u);
        if (r0 + r < T_) val = *(const uint4*)(src + (size_t)(r0 + r) * C + c);
        *(uint4*)(dst + r * Fa<T, D>::LD + c) = val;
    }
}

/* One warp: out[16][64] (fp32, ld SLD) = A[16][D] · Bs[64][D]^T, A given as fragments, Bs a row tile. */
template <typename T, int D>
__device__ __forceinline__ void fa_scores(float* out, const typename Fa<T, D>::FragA* a, const T* bs) {
    typename Fa<T, D>::FragBt b;
    typename Fa<T, D>::Acc acc;
    for (int n = 0; n < FA_TILE / 16; n++) {
        wmma::fill_fragment(acc, 0.0f);
        for (int kk = 0; kk < Fa<T, D>::KD; kk++) {
            wmma::load_matrix_sync(b, bs + n * 16 * Fa<T, D>::LD + kk * 16, Fa<T, D>::LD);
            wmma::mma_sync(acc, a[kk], b, acc);
        }
        wmma::store_matrix_sync(out + n * 16, acc, Fa<T, D>::SLD, wmma::mem_row_major);
    }
}

/* One warp: acc[n] += P[16][64] · Bs[64][D] (P a warp tile viewed as T, Bs a row tile). */
template <typename T, int D>
__device__ __forceinline__ void fa_accumulate(typename Fa<T, D>::Acc* acc, const T* p, const T* bs) {
    typename Fa<T, D>::FragA a;
    typename Fa<T, D>::FragB b;
    for (int kk = 0; kk < FA_TILE / 16; kk++) {
        wmma::load_matrix_sync(a, p + kk * 16, Fa<T, D>::PLD);
        for (int n = 0; n < Fa<T, D>::KD; n++) {
            wmma::load_matrix_sync(b, bs + kk * 16 * Fa<T, D>::LD + n * 16, Fa<T, D>::LD);
            wmma::mma_sync(acc[n], a, b, acc[n]);
        }
    }
}

/* One warp: the 16 rows of a row tile starting at `rows` as A fragments. */
template <typename T, int D>
__device__ __forceinline__ void fa_load_a(typename Fa<T, D>::FragA* a, const T* rows) {
    for (int kk = 0; kk < Fa<T, D>::KD; kk++) wmma::load_matrix_sync(a[kk], rows + kk * 16, Fa<T, D>::LD);
}

/* One warp: y[row][col] (+)= s * acc for the warp's 16 rows, through its fp32 warp tile `stage`;
 * rows at or past T are skipped. y points at the warp's first row, head's first column. */
template <typename T, int D>
__device__ __forceinline__ void fa_add_out(T* y, const typename Fa<T, D>::Acc* acc, float* stage, float s,
                                           int n_valid, int C) {
    int lane = threadIdx.x & 31;
    for (int n = 0; n < Fa<T, D>::KD; n++) wmma::store_matrix_sync(stage + n * 16, acc[n], Fa<T, D>::SLD, wmma::mem_row_major);
    __syncwarp();
    for (int e = lane; e < 16 * D; e += 32) {
        int r = e / D, c = e % D;
        if (r < n_valid) {
            T* p = y + (size_t)r * C + c;
            *p = from_f<T>(to_f(*p) + s * stage[r * Fa<T, D>::SLD + c]);
        }
    }
}

/* Forward: block (query tile, b*H + h); the heaviest (last) query tiles are scheduled first.
 * Warp w owns query rows q0 + 16w .. +15; in the softmax, lane pair (2r, 2r+1) owns row r, the even
 * lane the even key columns. Every processed key tile holds a key <= each of the tile's query rows
 * (tiles run up to the diagonal), so the running max is finite after the first tile. */
template <typename T, int D>
__global__ void __launch_bounds__(FA_THREADS) attn_flash_fwd_kernel(T* out, float* lse, const T* q, const T* k,
                                                                    const T* v, int T_, int C, int H, float sl2) {
    typedef Fa<T, D> F;
    extern __shared__ __align__(128) unsigned char fa_smem[];
    T* ks = (T*)fa_smem;
    T* vs = (T*)(fa_smem + F::ROW_TILE);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = lane >> 1, hf = lane & 1;
    float* sw = (float*)(fa_smem + 2 * F::ROW_TILE) + warp * 16 * F::SLD;
    T* pw = (T*)sw;
    float* ow = (float*)(fa_smem + 2 * F::ROW_TILE + F::WARP_TILES) + warp * 16 * F::OLD;
    int qt = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;
    int q0 = qt * FA_TILE, i = q0 + warp * 16 + r;
    size_t base = (size_t)b * T_ * C + (size_t)h * D;

    typename F::FragA qf[F::KD];
    fa_load_rows<T, D>(ks, q + base, q0, T_, C); /* q staged through the k tile */
    __syncthreads();
    fa_load_a<T, D>(qf, ks + warp * 16 * F::LD);
    for (int e = lane; e < 16 * F::OLD; e += 32) ow[e] = 0.0f;
    float m = -INFINITY, l = 0.0f; /* running max (base 2) and this lane's share of the sum */

    for (int kt = 0; kt <= qt; kt++) {
        int kv0 = kt * FA_TILE;
        __syncthreads(); /* everyone is done reading the previous k, v (or the staged q) */
        fa_load_rows<T, D>(ks, k + base, kv0, T_, C);
        fa_load_rows<T, D>(vs, v + base, kv0, T_, C);
        __syncthreads();
        fa_scores<T, D>(sw, qf, ks);
        __syncwarp();
        float x[FA_TILE / 2], mx = -INFINITY;
        for (int c = 0; c < FA_TILE / 2; c++) {
            int col = hf + 2 * c;
            x[c] = kv0 + col <= i ? sw[r * F::SLD + col] * sl2 : -INFINITY;
            mx = fmaxf(mx, x[c]);
        }
        float m_new = fmaxf(m, fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1)));
        float alpha = exp2f(m - m_new), sum = 0.0f;
        for (int c = 0; c < FA_TILE / 2; c++) {
            x[c] = exp2f(x[c] - m_new);
            sum += x[c];
        }
        l = l * alpha + sum;
        m = m_new;
        __syncwarp(); /* all scores read: overwrite them with P in T */
        for (int c = 0; c < FA_TILE / 2; c++) pw[r * F::PLD + hf + 2 * c] = from_f<T>(x[c]);
        for (int c = hf; c < D; c += 2) ow[r * F::OLD + c] *= alpha;
        __syncwarp();
        typename F::Acc acc[F::KD];
        for (int n = 0; n < F::KD; n++) wmma::load_matrix_sync(acc[n], ow + n * 16, F::OLD, wmma::mem_row_major);
        fa_accumulate<T, D>(acc, pw, vs);
        for (int n = 0; n < F::KD; n++) wmma::store_matrix_sync(ow + n * 16, acc[n], F::OLD, wmma::mem_row_major);
    }

    l += __shfl_xor_sync(0xffffffffu, l, 1);
    __syncwarp();
    if (hf == 0) sw[r] = 1.0f / l; /* per-row 1/l through the (now free) warp tile */
    if (hf == 0 && i < T_) lse[(size_t)bh * T_ + i] = m * FA_LN2 + logf(l);
    __syncwarp();
    int row0 = q0 + warp * 16;
    for (int e = lane; e < 16 * D; e += 32) {
        int rr = e / D, c = e % D;
        if (row0 + rr < T_) out[base + (size_t)(row0 + rr) * C + c] = from_f<T>(ow[rr * F::OLD + c] * sw[rr]);
    }
}

/* delta[b, h, t] = sum over the head's columns of dout * out: one warp per (row, head). */
template <typename T>
__global__ void attn_delta_kernel(float* delta, const T* dout, const T* out, int N, int T_, int C, int H) {
    int lane = threadIdx.x & 31, gw = blockIdx.x * ATTN_WARPS + (threadIdx.x >> 5);
    if (gw >= N * H) return;
    int n = gw / H, h = gw % H, hs = C / H;
    const T* a = dout + (size_t)n * C + h * hs;
    const T* o = out + (size_t)n * C + h * hs;
    float s = 0.0f;
    for (int c = lane; c < hs; c += 32) s += to_f(a[c]) * to_f(o[c]);
    s = warp_sum(s);
    if (lane == 0) delta[((size_t)(n / T_) * H + h) * T_ + n % T_] = s;
}

/* dK, dV: block (key tile, b*H + h); warp w owns keys kv0 + 16w .. +15 and accumulates their dK, dV
 * rows in registers over the query tiles from the diagonal on. Works on transposed blocks
 * (rows = keys, columns = queries): S^T = K Q^T, dP^T = V dO^T, then dV += P^T dO, dK += dS^T Q. */
template <typename T, int D>
__global__ void __launch_bounds__(FA_THREADS) attn_flash_dkv_kernel(T* dk, T* dv, const T* dout, const float* lse,
                                                                    const float* delta, const T* q, const T* k,
                                                                    const T* v, int T_, int C, int H, float scale,
                                                                    float sl2) {
    typedef Fa<T, D> F;
    extern __shared__ __align__(128) unsigned char fa_smem[];
    T* qs = (T*)fa_smem;
    T* dos = (T*)(fa_smem + F::ROW_TILE);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = lane >> 1, hf = lane & 1;
    float* sw = (float*)(fa_smem + 2 * F::ROW_TILE) + warp * 16 * F::SLD;
    float* dpw = (float*)(fa_smem + 2 * F::ROW_TILE + F::WARP_TILES) + warp * 16 * F::SLD;
    float* lse2s = (float*)(fa_smem + 2 * F::ROW_TILE + 2 * F::WARP_TILES);
    float* dls = lse2s + FA_TILE;
    int kt = blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H, n_tiles = gridDim.x;
    int kv0 = kt * FA_TILE, j = kv0 + warp * 16 + r;
    size_t base = (size_t)b * T_ * C + (size_t)h * D;

    fa_load_rows<T, D>(qs, k + base, kv0, T_, C); /* k and v staged through the q, dout tiles */
    fa_load_rows<T, D>(dos, v + base, kv0, T_, C);
    typename F::FragA kf[F::KD], vf[F::KD];
    typename F::Acc dk_acc[F::KD], dv_acc[F::KD];
    for (int n = 0; n < F::KD; n++) {
        wmma::fill_fragment(dk_acc[n], 0.0f);
        wmma::fill_fragment(dv_acc[n], 0.0f);
    }
    __syncthreads();
    fa_load_a<T, D>(kf, qs + warp * 16 * F::LD);
    fa_load_a<T, D>(vf, dos + warp * 16 * F::LD);

    for (int qt = kt; qt < n_tiles; qt++) {
        int q0 = qt * FA_TILE;
        __syncthreads(); /* everyone is done with the previous q, dout tiles */
        fa_load_rows<T, D>(qs, q + base, q0, T_, C);
        fa_load_rows<T, D>(dos, dout + base, q0, T_, C);
        for (int t = threadIdx.x; t < FA_TILE; t += FA_THREADS) {
            bool ok = q0 + t < T_;
            lse2s[t] = ok ? lse[(size_t)bh * T_ + q0 + t] * FA_LOG2E : 0.0f;
            dls[t] = ok ? delta[(size_t)bh * T_ + q0 + t] : 0.0f;
        }
        __syncthreads();
        fa_scores<T, D>(sw, kf, qs);
        fa_scores<T, D>(dpw, vf, dos);
        /* Overwrite S^T with P^T and dP^T with dS^T, in T, in two halves of the columns (fewer live
         * registers): the T values of columns [0, 32) take the bytes of fp32 columns [0, 16), read
         * in the first half; those of [32, 64) take fp32 columns [16, 32), also read already. */
        T* pw = (T*)sw;
        T* dsw = (T*)dpw;
        for (int c0 = 0; c0 < FA_TILE; c0 += FA_TILE / 2) {
            float p[FA_TILE / 4], ds[FA_TILE / 4];
            __syncwarp();
            for (int c = 0; c < FA_TILE / 4; c++) {
                int col = c0 + hf + 2 * c, i = q0 + col;
                p[c] = j <= i && i < T_ ? exp2f(sw[r * F::SLD + col] * sl2 - lse2s[col]) : 0.0f;
                ds[c] = p[c] * (dpw[r * F::SLD + col] - dls[col]);
            }
            __syncwarp();
            for (int c = 0; c < FA_TILE / 4; c++) {
                pw[r * F::PLD + c0 + hf + 2 * c] = from_f<T>(p[c]);
                dsw[r * F::PLD + c0 + hf + 2 * c] = from_f<T>(ds[c]);
            }
        }
        __syncwarp();
        fa_accumulate<T, D>(dv_acc, pw, dos);
        fa_accumulate<T, D>(dk_acc, dsw, qs);
    }

    __syncwarp();
    int row0 = kv0 + warp * 16;
    fa_add_out<T, D>(dv + base + (size_t)row0 * C, dv_acc, sw, 1.0f, T_ - row0, C);
    fa_add_out<T, D>(dk + base + (size_t)row0 * C, dk_acc, dpw, scale, T_ - row0, C);
}

/* dQ: block (query tile, b*H + h); warp w owns query rows q0 + 16w .. +15 and accumulates their dQ
 * over the key tiles up to the diagonal: S = Q K^T, dP = dO V^T, dQ += dS K. */
template <typename T, int D>
__global__ void __launch_bounds__(FA_THREADS) attn_flash_dq_kernel(T* dq, const T* dout, const float* lse,
                                                                   const float* delta, const T* q, const T* k,
                                                                   const T* v, int T_, int C, int H, float scale,
                                                                   float sl2) {
    typedef Fa<T, D> F;
    extern __shared__ __align__(128) unsigned char fa_smem[];
    T* ks = (T*)fa_smem;
    T* vs = (T*)(fa_smem + F::ROW_TILE);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = lane >> 1, hf = lane & 1;
    float* sw = (float*)(fa_smem + 2 * F::ROW_TILE) + warp * 16 * F::SLD;
    float* dpw = (float*)(fa_smem + 2 * F::ROW_TILE + F::WARP_TILES) + warp * 16 * F::SLD;
    int qt = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;
    int q0 = qt * FA_TILE, i = q0 + warp * 16 + r;
    size_t base = (size_t)b * T_ * C + (size_t)h * D;
    float lse2 = i < T_ ? lse[(size_t)bh * T_ + i] * FA_LOG2E : 0.0f;
    float dl = i < T_ ? delta[(size_t)bh * T_ + i] : 0.0f;

    fa_load_rows<T, D>(ks, q + base, q0, T_, C); /* q and dout staged through the k, v tiles */
    fa_load_rows<T, D>(vs, dout + base, q0, T_, C);
    __syncthreads();
    typename F::FragA qf[F::KD], dof[F::KD];
    typename F::Acc dq_acc[F::KD];
    fa_load_a<T, D>(qf, ks + warp * 16 * F::LD);
    fa_load_a<T, D>(dof, vs + warp * 16 * F::LD);
    for (int n = 0; n < F::KD; n++) wmma::fill_fragment(dq_acc[n], 0.0f);

    for (int kt = 0; kt <= qt; kt++) {
        int kv0 = kt * FA_TILE;
        __syncthreads();
        fa_load_rows<T, D>(ks, k + base, kv0, T_, C);
        fa_load_rows<T, D>(vs, v + base, kv0, T_, C);
        __syncthreads();
        fa_scores<T, D>(sw, qf, ks);
        fa_scores<T, D>(dpw, dof, vs);
        __syncwarp();
        float ds[FA_TILE / 2];
        for (int c = 0; c < FA_TILE / 2; c++) {
            int col = hf + 2 * c;
            float p = kv0 + col <= i && i < T_ ? exp2f(sw[r * F::SLD + col] * sl2 - lse2) : 0.0f;
            ds[c] = p * (dpw[r * F::SLD + col] - dl);
        }
        __syncwarp(); /* all read: overwrite dP with dS in T */
        T* dsw = (T*)dpw;
        for (int c = 0; c < FA_TILE / 2; c++) dsw[r * F::PLD + hf + 2 * c] = from_f<T>(ds[c]);
        __syncwarp();
        fa_accumulate<T, D>(dq_acc, dsw, ks);
    }

    __syncwarp();
    int row0 = q0 + warp * 16;
    fa_add_out<T, D>(dq + base + (size_t)row0 * C, dq_acc, sw, scale, T_ - row0, C);
}

/* Launch helpers: dynamic shared memory above the 48 KiB default needs the per-kernel opt-in. */
template <typename K>
static void fa_allow_smem(K kernel, size_t bytes) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
}

template <typename T, int D>
static void attn_fwd_flash(T* out, float* lse, const T* q, const T* k, const T* v, int B, int T_, int C, int H) {
    typedef Fa<T, D> F;
    float sl2 = FA_LOG2E / sqrtf((float)D);
    dim3 grid(ceil_div(T_, FA_TILE), B * H);
    fa_allow_smem(attn_flash_fwd_kernel<T, D>, F::FWD_SMEM);
    attn_flash_fwd_kernel<T, D><<<grid, FA_THREADS, F::FWD_SMEM, g_stream>>>(out, lse, q, k, v, T_, C, H, sl2);
    LAUNCH_CHECK();
}

template <typename T, int D>
static void attn_bwd_flash(T* dq, T* dk, T* dv, const T* dout, const T* out, const float* lse, const T* q, const T* k,
                           const T* v, int B, int T_, int C, int H, float* delta) {
    typedef Fa<T, D> F;
    int N = B * T_;
    float scale = 1.0f / sqrtf((float)D), sl2 = FA_LOG2E * scale;
    attn_delta_kernel<T><<<ceil_div((size_t)N * H, ATTN_WARPS), 32 * ATTN_WARPS, 0, g_stream>>>(delta, dout, out, N, T_, C, H);
    LAUNCH_CHECK();
    dim3 grid(ceil_div(T_, FA_TILE), B * H);
    fa_allow_smem(attn_flash_dkv_kernel<T, D>, F::DKV_SMEM);
    attn_flash_dkv_kernel<T, D><<<grid, FA_THREADS, F::DKV_SMEM, g_stream>>>(dk, dv, dout, lse, delta, q, k, v, T_, C, H, scale,
                                                                   sl2);
    LAUNCH_CHECK();
    fa_allow_smem(attn_flash_dq_kernel<T, D>, F::DQ_SMEM);
    attn_flash_dq_kernel<T, D><<<grid, FA_THREADS, F::DQ_SMEM, g_stream>>>(dq, dout, lse, delta, q, k, v, T_, C, H, scale, sl2);
    LAUNCH_CHECK();
}

/* ---------------------------------------------------------------------------------------------- */
/* k_attn: the engine's entry points; pick the path (see the top of the file). */

/* 16-bit types only: the flash kernels are never instantiated for fp32. */
template <typename T> struct FaType { static constexpr bool ok = false; };
template <> struct FaType<bf16> { static constexpr bool ok = true; };
template <> struct FaType<fp16> { static constexpr bool ok = true; };

/* out [B*T, C] = attention(q, k, v); lse [B, H, T] saved for the backward. */
template <typename T>
static void k_attn_fwd(T* out, float* lse, const T* q, const T* k, const T* v, int B, int T_, int C, int H,
                       AttnScratch<T> sc) {
    if constexpr (FaType<T>::ok) {
        if (attn_flash_ok<T>(C, H)) {
            switch (C / H) {
            case 16: attn_fwd_flash<T, 16>(out, lse, q, k, v, B, T_, C, H); return;
            case 32: attn_fwd_flash<T, 32>(out, lse, q, k, v, B, T_, C, H); return;
            case 64: attn_fwd_flash<T, 64>(out, lse, q, k, v, B, T_, C, H); return;
            }
        }
    }
    attn_fwd_cublas<T>(out, lse, q, k, v, B, T_, C, H, sc);
}

/* dq, dk, dv += from dout; reads the forward's out (flash path: delta), q, k, v and the saved lse. */
template <typename T>
static void k_attn_bwd(T* dq, T* dk, T* dv, const T* dout, const T* out, const float* lse, const T* q, const T* k,
                       const T* v, int B, int T_, int C, int H, AttnScratch<T> sc) {
    if constexpr (FaType<T>::ok) {
        if (attn_flash_ok<T>(C, H)) {
            switch (C / H) {
            case 16: attn_bwd_flash<T, 16>(dq, dk, dv, dout, out, lse, q, k, v, B, T_, C, H, sc.delta); return;
            case 32: attn_bwd_flash<T, 32>(dq, dk, dv, dout, out, lse, q, k, v, B, T_, C, H, sc.delta); return;
            case 64: attn_bwd_flash<T, 64>(dq, dk, dv, dout, out, lse, q, k, v, B, T_, C, H, sc.delta); return;
            }
        }
    }
    attn_bwd_cublas<T>(dq, dk, dv, dout, lse, q, k, v, B, T_, C, H, sc);
}

/* ---------------------------------------------------------------------------------------------- */
/* Output projection */

template <typename T>
static void k_attn_out_fwd(T* out, const T* y, const T* w_o, int N, int C) {
    linear_fwd(out, y, w_o, N, C, C);
}

/* dy, dw_o += */
template <typename T>
static void k_attn_out_bwd(T* dy, float* dw_o, const T* dout, const T* y, const T* w_o, int N, int C) {
    linear_bwd(dy, dw_o, dout, y, w_o, N, C, C);
}

#endif
