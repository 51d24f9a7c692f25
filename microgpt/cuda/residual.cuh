/* residual.cuh: the residual connection out = a + b; its gradient flows unchanged into both
 * branches (da += dout, db += dout), as the CPU's residual_forward / residual_backward.
 *
 * The engine launches neither kernel: both residual joins of a layer are fused into the product
 * that ends the branch (attn_out_fwd, mlp_fwd: out = residual + x @ W, matmul.cuh), and the
 * backward keeps one residual-gradient buffer that is the gradient of the stream at every depth
 * (each branch's input gradient is accumulated into it in place), which is residual_add_bwd
 * with da aliased to dout. The pair is kept, and checked against the CPU in tests/kernel_check.cu,
 * as the reference form of what the fused products compute (docs/DESIGN.md §3 names it). */
#ifndef MICROGPT_CUDA_RESIDUAL_CUH
#define MICROGPT_CUDA_RESIDUAL_CUH

#include "common.cuh"

template <typename T, int VEC>
__global__ void k_residual_add(T* __restrict__ out, const T* __restrict__ a, const T* __restrict__ b, size_t n) {
    await_previous_kernel();
    FOR_PACKETS(i, n) {
        float av[VEC], bv[VEC];
        load_vec(av, a + i);
        load_vec(bv, b + i);
        for (int k = 0; k < VEC; k++) av[k] += bv[k];
        store_vec(out + i, av);
    }
}

template <typename T>
__global__ void k_residual_add_bwd(T* da, T* db, const T* dout, size_t n) {
    await_previous_kernel();
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float g = to_f(dout[i]);
        da[i] = from_f<T>(to_f(da[i]) + g);
        db[i] = from_f<T>(to_f(db[i]) + g);
    }
}

/* out = a + b; out may not alias a or b. */
template <typename T>
static void residual_add(T* out, const T* a, const T* b, size_t n) {
    bool packed = packable(n, sizeof(T), {out, a, b});
    LAUNCH_PACKED_ELEMENTWISE(packed, k_residual_add, T, n, out, a, b, n);
}

/* da, db += dout; neither may alias dout. */
template <typename T>
static void residual_add_bwd(T* da, T* db, const T* dout, size_t n) {
    launch_kernel(k_residual_add_bwd<T>, elementwise_grid(n, 256), 256, da, db, dout, n);
}

#endif
