/* matmul.cuh: the bias-free linear layer out[N,out] = x[N,in] @ w[in,out] (weights [in,out]
 * row-major, SPEC §2) on cuBLAS, the building block of k_attn_qkv, k_attn_out, k_mlp and k_loss.
 * Activations and weights are T; weight gradients are fp32 (cuBLAS writes fp32 C from T inputs). */
#ifndef MICROGPT_CUDA_MATMUL_CUH
#define MICROGPT_CUDA_MATMUL_CUH

#include "common.cuh"

/* out = x @ w (overwrites out) */
template <typename T>
static void linear_fwd(T* out, const T* x, const T* w, int N, int in, int out_dim) {
    cudaDataType_t t = TypeInfo<T>::dtype;
    gemm_rm(false, false, N, out_dim, in, 1.0f, x, in, 0, w, out_dim, 0, 0.0f, out, out_dim, 0, 1, t, t);
}

/* dx = dout @ w^T + beta * dx   (beta 1: accumulate, the backward contract; 0: overwrite scratch) */
template <typename T>
static void linear_dx(T* dx, const T* dout, const T* w, int N, int in, int out_dim, float beta) {
    cudaDataType_t t = TypeInfo<T>::dtype;
    gemm_rm(false, true, N, in, out_dim, 1.0f, dout, out_dim, 0, w, out_dim, 0, beta, dx, in, 0, 1, t, t);
}

/* dw += x^T @ dout   (fp32 gradient) */
template <typename T>
static void linear_dw(float* dw, const T* x, const T* dout, int N, int in, int out_dim) {
    gemm_rm(true, false, in, out_dim, N, 1.0f, x, in, 0, dout, out_dim, 0, 1.0f, dw, out_dim, 0, 1,
            TypeInfo<T>::dtype, CUDA_R_32F);
}

/* The pair as the CPU's matmul_forward / matmul_backward: both gradients accumulate. */
template <typename T>
static void linear_bwd(T* dx, float* dw, const T* dout, const T* x, const T* w, int N, int in, int out_dim) {
    linear_dw(dw, x, dout, N, in, out_dim);
    linear_dx(dx, dout, w, N, in, out_dim, 1.0f);
}

#endif
