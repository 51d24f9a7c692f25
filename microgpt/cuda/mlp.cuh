/* mlp.cuh: the MLP sub-layer out = gelu_tanh(x @ W_1) @ W_2 (no biases), and the residual join
 * that follows it in the block (out = xmid + MLP(LN2(xmid)), fused into the second product).
 * The forward saves the pre-activation h = x @ W_1 and h_gelu = gelu(h), both [N, F]: the backward
 * needs h_gelu for dW_2, and keeping it costs N·F values per layer where recomputing it costs a
 * full element-wise pass per layer and step (docs/BENCHMARKS.md has the trade measured).
 *
 * Roles (docs/DESIGN.md §3.1): mlp_fwd / mlp_bwd are the k_mlp_fwd / k_mlp_bwd pair. Their GELU
 * runs in the products' epilogues (GEMM_GELU_AUX, GEMM_DGELU, common.cuh) where cuBLASLt has
 * them, otherwise in the kernels k_gelu_fwd and k_gelu_bwd_inplace after a plain product. */
#ifndef MICROGPT_CUDA_MLP_CUH
#define MICROGPT_CUDA_MLP_CUH

#include "matmul.cuh"

#define GELU_SCALE_F 0.7978845608028654f /* sqrt(2/pi) */
#define GELU_CUBIC_F 0.044715f

/* The GELU's tanh: for precision fp8 the hardware's approximation (GELU_TANH_APPROX: one
 * tanh.approx.f32, MUFU.TANH, sm_75 and up; PTX ISA: relative error at most 2^-11; fp8.cuh's
 * FP8_GELU_TANH says why), for every other precision and for generation (decode.cuh) CUDA's
 * accurate tanhf (GELU_TANH_ACCURATE: a few ulps from the CPU engine's glibc tanhf). */
enum { GELU_TANH_ACCURATE, GELU_TANH_APPROX };

template <int TANH> __device__ __forceinline__ float gelu_tanh(float u) {
    if constexpr (TANH == GELU_TANH_APPROX) {
        float t;
        asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(u));
        return t;
    } else {
        return tanhf(u);
    }
}

template <int TANH = GELU_TANH_ACCURATE> __device__ __forceinline__ float gelu_f(float x) {
    return 0.5f * x * (1.0f + gelu_tanh<TANH>(GELU_SCALE_F * (x + GELU_CUBIC_F * x * x * x)));
}

template <int TANH = GELU_TANH_ACCURATE> __device__ __forceinline__ float gelu_grad_f(float x) {
    float th = gelu_tanh<TANH>(GELU_SCALE_F * (x + GELU_CUBIC_F * x * x * x));
    float dth = (1.0f - th * th) * GELU_SCALE_F * (1.0f + 3.0f * GELU_CUBIC_F * x * x);
    return 0.5f * (1.0f + th) + 0.5f * x * dth;
}

/* amax_bits (precision fp8's MLP, whose GELU output is an FP8 product's operand; else NULL): the
 * output's amax as stored, atomicMax'ed in (common.cuh), saving the cast a full read. TANH: the
 * GELU's tanh (gelu_tanh); the kernel of each form is below (each waits for its predecessor first). */
template <int TANH, typename T, int VEC>
__device__ __forceinline__ void gelu_fwd_packets(T* __restrict__ out, const T* __restrict__ x, size_t n,
                                                 unsigned* amax_bits) {
    unsigned am = 0;
    FOR_PACKETS(i, n) {
        float v[VEC];
        load_vec(v, x + i);
        for (int k = 0; k < VEC; k++) {
            v[k] = gelu_f<TANH>(v[k]);
            am = max(am, abs_bits(as_stored<T>(v[k])));
        }
        store_vec(out + i, v);
    }
    block_amax_commit(amax_bits, am);
}

/* In place: d = d * gelu'(x). d arrives as the gradient of the GELU output and leaves as that of
 * its input; the MLP backward owns d as scratch, so nothing needs accumulating here. amax_bits:
 * as in gelu_fwd_packets, of the new d. */
template <int TANH, typename T, int VEC>
__device__ __forceinline__ void gelu_bwd_packets(T* __restrict__ d, const T* __restrict__ x, size_t n,
                                                 unsigned* amax_bits) {
    unsigned am = 0;
    FOR_PACKETS(i, n) {
        float dv[VEC], xv[VEC];
        load_vec(dv, d + i);
        load_vec(xv, x + i);
        for (int k = 0; k < VEC; k++) {
            dv[k] *= gelu_grad_f<TANH>(xv[k]);
            am = max(am, abs_bits(as_stored<T>(dv[k])));
        }
        store_vec(d + i, dv);
    }
    block_amax_commit(amax_bits, am);
}

template <typename T, int VEC>
__global__ void k_gelu_fwd(T* __restrict__ out, const T* __restrict__ x, size_t n, unsigned* amax_bits) {
    await_previous_kernel();
    gelu_fwd_packets<GELU_TANH_ACCURATE, T, VEC>(out, x, n, amax_bits);
}

template <typename T, int VEC>
__global__ void k_gelu_bwd_inplace(T* __restrict__ d, const T* __restrict__ x, size_t n, unsigned* amax_bits) {
    await_previous_kernel();
    gelu_bwd_packets<GELU_TANH_ACCURATE, T, VEC>(d, x, n, amax_bits);
}

/* The approximate tanh's kernels (precision fp8's: FP8_GELU_TANH). */
template <typename T, int VEC>
__global__ void k_gelu_fwd_fast_tanh(T* __restrict__ out, const T* __restrict__ x, size_t n, unsigned* amax_bits) {
    await_previous_kernel();
    gelu_fwd_packets<GELU_TANH_APPROX, T, VEC>(out, x, n, amax_bits);
}

template <typename T, int VEC>
__global__ void k_gelu_bwd_inplace_fast_tanh(T* __restrict__ d, const T* __restrict__ x, size_t n,
                                             unsigned* amax_bits) {
    await_previous_kernel();
    gelu_bwd_packets<GELU_TANH_APPROX, T, VEC>(d, x, n, amax_bits);
}

/* The grid of an element-wise kernel over n values (packets when `packed`) that may end in an amax. */
template <typename T> static unsigned gelu_grid(size_t n, bool packed, const unsigned* amax_bits) {
    return amax_grid(elementwise_grid(n / (packed ? PACK(T) : 1), 256), amax_bits);
}

template <typename T, int TANH = GELU_TANH_ACCURATE>
static void gelu_fwd(T* out, const T* x, size_t n, unsigned* amax_bits = NULL) {
    bool packed = packable(n, sizeof(T), {out, x});
    unsigned grid = gelu_grid<T>(n, packed, amax_bits);
    if constexpr (TANH == GELU_TANH_APPROX) LAUNCH_PACKED(packed, k_gelu_fwd_fast_tanh, T, grid, 256, out, x, n, amax_bits);
    else LAUNCH_PACKED(packed, k_gelu_fwd, T, grid, 256, out, x, n, amax_bits);
}

template <typename T, int TANH = GELU_TANH_ACCURATE>
static void gelu_bwd_inplace(T* d, const T* x, size_t n, unsigned* amax_bits = NULL) {
    bool packed = packable(n, sizeof(T), {d, x});
    unsigned grid = gelu_grid<T>(n, packed, amax_bits);
    if constexpr (TANH == GELU_TANH_APPROX) LAUNCH_PACKED(packed, k_gelu_bwd_inplace_fast_tanh, T, grid, 256, d, x, n, amax_bits);
    else LAUNCH_PACKED(packed, k_gelu_bwd_inplace, T, grid, 256, d, x, n, amax_bits);
}

/* out [N,C] = residual + gelu(x @ w1) @ w2 (the MLP and the residual join after it); saves
 * h = x @ w1 and h_gelu = gelu(h), both [N,F], for the backward. out must not alias residual. The
 * GELU and the join run in the products' epilogues where cuBLASLt has them (common.cuh). */
template <typename T>
static void mlp_fwd(T* out, T* h, T* h_gelu, const T* x, const T* w1, const T* w2, const T* residual, int N, int C,
                    int F) {
    if (!gemm_fused(GEMM_GELU_AUX, N, F, C, mat(x, C), mat(w1, F), mat(h_gelu, F), NULL, h)) {
        linear_fwd(h, x, w1, N, C, F);
        gelu_fwd(h_gelu, h, (size_t)N * F);
    }
    linear_fwd(out, h_gelu, w2, N, F, C, residual);
}

/* dx = ; dw1, dw2 = / += by grad_beta; h and h_gelu are the forward's; dh [N,F] is scratch. */
template <typename T>
static void mlp_bwd(T* dx, float* dw1, float* dw2, const T* dout, const T* x, const T* h, const T* h_gelu,
                    const T* w1, const T* w2, T* dh, int N, int C, int F, float grad_beta) {
    linear_dw(dw2, h_gelu, dout, N, F, C, grad_beta);
    /* dh = (dout @ w2^T) * gelu'(h) */
    if (!gemm_fused(GEMM_DGELU, N, F, C, mat(dout, C), mat_t(w2, C), mat(dh, F), NULL, h)) {
        linear_dx(dh, dout, w2, N, F, C, 0.0f);
        gelu_bwd_inplace(dh, h, (size_t)N * F);
    }
    linear_bwd(dx, dw1, dh, x, w1, N, C, F, grad_beta);
}

#endif
