/* attention.cuh: the attention sub-layer's three kernel pairs.
 *   k_attn_qkv  q, k, v [N, C] = x @ W_Q, x @ W_K, x @ W_V   (one batched product: the three weights
 *               are consecutive [C,C] blocks of the flat vector, and q, k, v consecutive [N,C] blocks)
 *   k_attn      causal softmax(q k^T / sqrt(hs)) v per head, hs = C / H; head h owns columns
 *               [h*hs, (h+1)*hs) of q, k, v and out, as the CPU's attention_forward/backward
 *   k_attn_out  out = y @ W_O
 *
 * k_attn computes the score matrix of one sequence at a time with cuBLAS (batched over heads) into
 * fp32 scratch, so no T×T matrix is kept per layer: the forward saves only the softmax statistic
 * lse = log-sum-exp of each score row ([B, H, T], fp32), and the backward recomputes the scores with
 * the same product and the probabilities as exp(s - lse). Both passes run the same code on the same
 * inputs, so the backward sees bit-identical probabilities to the forward's.
 *
 * Precision: scores and their gradient are fp32 (scratch); the probabilities P and dS fed to the
 * second products are T, as in flash-attention implementations.
 *
 * Scratch per call (one sequence): S and dP fp32 [H, T, T], P (T) [H, T, T]. */
#ifndef MICROGPT_CUDA_ATTENTION_CUH
#define MICROGPT_CUDA_ATTENTION_CUH

#include "matmul.cuh"

#define ATTN_WARPS 8 /* score rows per block: one warp per row */

template <typename T>
struct AttnScratch {
    float* S;  /* [H, T, T] scores, later reused by nothing else */
    float* dP; /* [H, T, T] gradient of the probabilities (backward only) */
    T* P;      /* [H, T, T] probabilities (forward), then dS (backward) */
};

static size_t attn_scratch_elems(int H, int T_) { return (size_t)H * T_ * T_; }

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
/* Scaled dot-product attention. Per sequence b, the products are batched over heads: head h's
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

/* out [B*T, C] = attention(q, k, v); lse [B, H, T] saved for the backward. */
template <typename T>
static void k_attn_fwd(T* out, float* lse, const T* q, const T* k, const T* v, int B, int T_, int C, int H,
                       AttnScratch<T> sc) {
    int hs = C / H, n_rows = H * T_;
    cudaDataType_t t = TypeInfo<T>::dtype;
    for (int b = 0; b < B; b++) {
        size_t off = (size_t)b * T_ * C;
        attn_scores(sc.S, q + off, k + off, T_, C, H);
        attn_softmax_fwd_kernel<T><<<ceil_div(n_rows, ATTN_WARPS), 32 * ATTN_WARPS>>>(sc.P, lse + (size_t)b * n_rows,
                                                                                      sc.S, n_rows, T_);
        LAUNCH_CHECK();
        /* out_h = P_h v_h */
        gemm_rm(false, false, T_, hs, T_, 1.0f, sc.P, T_, (long long)T_ * T_, v + off, C, hs, 0.0f, out + off, C, hs,
                H, t, t);
    }
}

/* dq, dk, dv += from dout; reads q, k, v and the saved lse. */
template <typename T>
static void k_attn_bwd(T* dq, T* dk, T* dv, const T* dout, const float* lse, const T* q, const T* k, const T* v,
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
        attn_probs_kernel<T><<<grid, 32 * ATTN_WARPS>>>(sc.P, lse_b, sc.S, n_rows, T_);
        LAUNCH_CHECK();
        /* dP_h = dout_h v_h^T (fp32) */
        gemm_rm(false, true, T_, T_, hs, 1.0f, dout + off, C, hs, v + off, C, hs, 0.0f, sc.dP, T_, tt, H, t, CUDA_R_32F);
        /* dv_h += P_h^T dout_h */
        gemm_rm(true, false, T_, hs, T_, 1.0f, sc.P, T_, tt, dout + off, C, hs, 1.0f, dv + off, C, hs, H, t, t);
        /* dS into the P buffer (P is no longer needed) */
        attn_softmax_bwd_kernel<T><<<grid, 32 * ATTN_WARPS>>>(sc.P, sc.dP, lse_b, sc.S, n_rows, T_);
        LAUNCH_CHECK();
        /* scores were scale * q k^T: dq_h += scale dS_h k_h ; dk_h += scale dS_h^T q_h */
        gemm_rm(false, false, T_, hs, T_, scale, sc.P, T_, tt, k + off, C, hs, 1.0f, dq + off, C, hs, H, t, t);
        gemm_rm(true, false, T_, hs, T_, scale, sc.P, T_, tt, q + off, C, hs, 1.0f, dk + off, C, hs, H, t, t);
    }
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
