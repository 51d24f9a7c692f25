/* mlp.cuh: the MLP sub-layer out = gelu_tanh(x @ W_1) @ W_2 (no biases).
 * The forward saves the pre-activation h = x @ W_1 [N, F]; the backward recomputes gelu(h) into
 * scratch rather than keeping it per layer (one element-wise pass instead of N·F saved values per
 * layer). */
#ifndef MICROGPT_CUDA_MLP_CUH
#define MICROGPT_CUDA_MLP_CUH

#include "matmul.cuh"

#define GELU_SCALE_F 0.7978845608028654f /* sqrt(2/pi) */
#define GELU_CUBIC_F 0.044715f

__device__ __forceinline__ float gelu_f(float x) {
    return 0.5f * x * (1.0f + tanhf(GELU_SCALE_F * (x + GELU_CUBIC_F * x * x * x)));
}

__device__ __forceinline__ float gelu_grad_f(float x) {
    float th = tanhf(GELU_SCALE_F * (x + GELU_CUBIC_F * x * x * x));
    float dth = (1.0f - th * th) * GELU_SCALE_F * (1.0f + 3.0f * GELU_CUBIC_F * x * x);
    return 0.5f * (1.0f + th) + 0.5f * x * dth;
}

template <typename T>
__global__ void gelu_fwd_kernel(T* out, const T* x, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        out[i] = from_f<T>(gelu_f(to_f(x[i])));
}

/* In place: d = d * gelu'(x). d arrives as the gradient of the GELU output and leaves as that of
 * its input; the MLP backward owns d as scratch, so nothing needs accumulating here. */
template <typename T>
__global__ void gelu_bwd_inplace_kernel(T* d, const T* x, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        d[i] = from_f<T>(to_f(d[i]) * gelu_grad_f(to_f(x[i])));
}

template <typename T>
static void gelu_fwd(T* out, const T* x, size_t n) {
    gelu_fwd_kernel<T><<<elementwise_grid(n, 256), 256, 0, g_stream>>>(out, x, n);
    LAUNCH_CHECK();
}

template <typename T>
static void gelu_bwd_inplace(T* d, const T* x, size_t n) {
    gelu_bwd_inplace_kernel<T><<<elementwise_grid(n, 256), 256, 0, g_stream>>>(d, x, n);
    LAUNCH_CHECK();
}

/* out [N,C] = gelu(x @ w1) @ w2; saves h [N,F]; g [N,F] is scratch (holds gelu(h)). */
template <typename T>
static void k_mlp_fwd(T* out, T* h, T* g, const T* x, const T* w1, const T* w2, int N, int C, int F) {
    linear_fwd(h, x, w1, N, C, F);
    gelu_fwd(g, h, (size_t)N * F);
    linear_fwd(out, g, w2, N, F, C);
}

/* dx, dw1, dw2 += ; g and dh [N,F] are scratch. */
template <typename T>
static void k_mlp_bwd(T* dx, float* dw1, float* dw2, const T* dout, const T* x, const T* h, const T* w1,
                      const T* w2, T* g, T* dh, int N, int C, int F) {
    gelu_fwd(g, h, (size_t)N * F);
    linear_dw(dw2, g, dout, N, F, C);
    linear_dx(dh, dout, w2, N, F, C, 0.0f);
    gelu_bwd_inplace(dh, h, (size_t)N * F);
    linear_dw(dw1, x, dh, N, C, F);
    linear_dx(dx, dh, w1, N, C, F, 1.0f);
}

#endif
