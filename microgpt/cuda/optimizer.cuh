/* optimizer.cuh: the update side of a step: gradient scaling, the global L2 norm (for clipping
 * and, in fp16, overflow detection), AdamW on the fp32 master weights (refreshing the 16-bit
 * weight copy in the same pass), and the fp32 -> T weight copy.
 *
 * The norm is deterministic: a fixed number of blocks (NORM_BLOCKS, not derived from the GPU) each
 * sum a fixed grid-stride subset in fp32 and write one partial; one block adds the partials in
 * double, in a fixed tree. A non-finite gradient anywhere makes the norm non-finite. */
#ifndef MICROGPT_CUDA_OPTIMIZER_CUH
#define MICROGPT_CUDA_OPTIMIZER_CUH

#include "common.cuh"

#define NORM_BLOCKS 1024
#define NORM_THREADS 256

__global__ void grad_norm_partial_kernel(float* partial, const float* g, size_t n) {
    float s = 0.0f;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float x = g[i];
        s += x * x;
    }
    s = block_sum(s);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

/* One block of NORM_BLOCKS threads: out[0] = sqrt(sum of partials). */
__global__ void grad_norm_final_kernel(float* out, const float* partial) {
    __shared__ double warp_part[NORM_BLOCKS / 32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    double s = warp_sum_d((double)partial[threadIdx.x]);
    if (lane == 0) warp_part[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = warp_sum_d(lane < NORM_BLOCKS / 32 ? warp_part[lane] : 0.0);
        if (lane == 0) out[0] = (float)sqrt(s);
    }
}

__global__ void grad_scale_kernel(float* g, size_t n, float s) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) g[i] *= s;
}

/* As the CPU's adamw_update (c1, c2 = bias corrections, computed on the host in double);
 * p_low (nullable) receives the updated weight rounded to T for the next step's products. */
template <typename T>
__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, T* p_low, size_t n, float lr, float beta1,
                             float beta2, float eps, float wd, float c1, float c2) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float gi = g[i];
        float mi = beta1 * m[i] + (1.0f - beta1) * gi;
        float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float pi = p[i];
        pi -= lr * ((mi / c1) / (sqrtf(vi / c2) + eps) + wd * pi);
        p[i] = pi;
        if (p_low) p_low[i] = from_f<T>(pi);
    }
}

template <typename T>
__global__ void convert_kernel(T* out, const float* in, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        out[i] = from_f<T>(in[i]);
}

/* partial: NORM_BLOCKS floats of scratch */
static void k_grad_norm_partial(float* partial, const float* g, size_t n) {
    grad_norm_partial_kernel<<<NORM_BLOCKS, NORM_THREADS>>>(partial, g, n);
    LAUNCH_CHECK();
}

/* out: one device float, the L2 norm of everything k_grad_norm_partial summed */
static void k_grad_norm_final(float* out, const float* partial) {
    grad_norm_final_kernel<<<1, NORM_BLOCKS>>>(out, partial);
    LAUNCH_CHECK();
}

static void k_grad_scale(float* g, size_t n, float s) {
    grad_scale_kernel<<<elementwise_grid(n, 256), 256>>>(g, n, s);
    LAUNCH_CHECK();
}

template <typename T>
static void k_adamw(float* p, const float* g, float* m, float* v, T* p_low, size_t n, float lr, float beta1,
                    float beta2, float eps, float wd, int t) {
    float c1 = (float)(1.0 - pow((double)beta1, (double)t));
    float c2 = (float)(1.0 - pow((double)beta2, (double)t));
    adamw_kernel<T><<<elementwise_grid(n, 256), 256>>>(p, g, m, v, p_low, n, lr, beta1, beta2, eps, wd, c1, c2);
    LAUNCH_CHECK();
}

template <typename T>
static void k_convert(T* out, const float* in, size_t n) {
    convert_kernel<T><<<elementwise_grid(n, 256), 256>>>(out, in, n);
    LAUNCH_CHECK();
}

#endif
