/* matmul.cuh: the bias-free linear layer out[N,out] = x[N,in] @ w[in,out] (weights [in,out]
 * row-major, docs/DESIGN.md §2) on the products of common.cuh (cuBLASLt for 16-bit inputs, cuBLAS
 * for fp32), the building block of attn_qkv, attn_out, mlp and loss. Activations and weights are T;
 * weight gradients are fp32 (the products write fp32 D from T inputs).
 *
 * Gradient contract of the whole engine: parameter gradients are written by the first micro-batch
 * after an update (grad_beta 0: overwritten, so they are never zeroed and stale or non-finite
 * values from before cannot leak in) and accumulated by the later ones (grad_beta 1: +=); each
 * parameter element has exactly one writer per micro-batch that honours grad_beta (the tied wte's
 * is the classifier's first chunk: the later chunks and the embedding backward add to it).
 * Activation gradients a sub-layer's backward produces for the layer below are overwritten (=),
 * except the residual stream's, which LayerNorm's backward adds into. */
#ifndef MICROGPT_CUDA_MATMUL_CUH
#define MICROGPT_CUDA_MATMUL_CUH

#include "common.cuh"
#include "side_stream.cuh"

/* out = x @ w, or with `residual`, out = residual + x @ w (the residual join in the product's
 * epilogue; out must not alias residual). Overwrites out. */
template <typename T>
static void linear_fwd(T* out, const T* x, const T* w, int N, int in, int out_dim, const T* residual = NULL) {
    if (residual) {
        if (gemm_fused(GEMM_RESIDUAL, N, out_dim, in, mat(x, in), mat(w, out_dim), mat(out, out_dim), residual, NULL))
            return;
        /* unfused: the same sum, fp32 accumulator + residual rounded once, through beta = 1 */
        CUDA_CHECK(cudaMemcpyAsync(out, residual, (size_t)N * out_dim * sizeof(T), cudaMemcpyDeviceToDevice, g_stream));
    }
    gemm(N, out_dim, in, mat(x, in), mat(w, out_dim), mat(out, out_dim), 1.0f, residual ? 1.0f : 0.0f);
}

/* dx = dout @ w^T + beta * dx   (beta 0: overwrite, the activation-gradient contract; 1: add) */
template <typename T>
static void linear_dx(T* dx, const T* dout, const T* w, int N, int in, int out_dim, float beta) {
    gemm(N, in, out_dim, mat(dout, out_dim), mat_t(w, out_dim), mat(dx, in), 1.0f, beta);
}

/* dw = x^T @ dout + grad_beta * dw   (fp32 gradient; grad_beta 0 or 1, see the contract above); on
 * the side stream where there is one (side_stream.cuh: the caller waits for it before it next
 * overwrites dout). */
template <typename T>
static void linear_dw(float* dw, const T* x, const T* dout, int N, int in, int out_dim, float grad_beta) {
    side_product(dout, [&] { gemm(in, out_dim, N, mat_t(x, in), mat(dout, out_dim), mat(dw, out_dim), 1.0f, grad_beta); });
}

/* The pair's backward: dw = / += by grad_beta (parameter gradients accumulate over micro-batches,
 * docs/DESIGN.md §3); dx = (an activation gradient is written whole, so its buffer needs no zeroing first). */
template <typename T>
static void linear_bwd(T* dx, float* dw, const T* dout, const T* x, const T* w, int N, int in, int out_dim,
                       float grad_beta) {
    linear_dw(dw, x, dout, N, in, out_dim, grad_beta);
    linear_dx(dx, dout, w, N, in, out_dim, 0.0f);
}

#endif
