/* loss.cuh: the tied classifier and cross-entropy, as the CPU's classifier_forward/backward:
 * logits = x @ wte^T over all Vp (padded) rows of wte, softmax and loss over the first V (real)
 * columns only; padded columns get zero gradient, so padded wte rows never change by gradient.
 *
 * The engine runs these on chunks of rows so the fp32 logits of a whole batch (N × Vp) never
 * exist at once. Logits are fp32 even when T is 16-bit (cuBLAS writes fp32 C from T inputs): the
 * softmax over 50k entries is where 16-bit rounding would cost most. The forward saves each row's
 * log-sum-exp; the backward forms dlogits = (softmax - onehot) * dscale from it. */
#ifndef MICROGPT_CUDA_LOSS_CUH
#define MICROGPT_CUDA_LOSS_CUH

#include "matmul.cuh"

#define LOSS_THREADS 256

/* logits [n, Vp] (fp32) = x [n, C] @ wte^T, wte [Vp, C] */
template <typename T>
static void classifier_logits(float* logits, const T* x, const T* wte, int n, int C, int Vp) {
    gemm_rm(false, true, n, Vp, C, 1.0f, x, C, 0, wte, C, 0, 0.0f, logits, Vp, 0, 1, TypeInfo<T>::dtype, CUDA_R_32F);
}

/* One block per row: lse over the real columns (max first, so no overflow), loss = lse - logit[target]. */
__global__ void loss_rows_kernel(float* losses, float* lse, const float* logits, const int* targets, int V, int Vp) {
    int row = blockIdx.x;
    const float* l = logits + (size_t)row * Vp;
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, l[j]);
    mx = block_max(mx);
    float s = 0.0f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) s += expf(l[j] - mx);
    s = block_sum(s);
    if (threadIdx.x == 0) {
        float row_lse = mx + logf(s);
        lse[row] = row_lse;
        losses[row] = row_lse - l[targets[row]];
    }
}

/* dlogits = (exp(logit - lse) - [j == target]) * dscale on real columns, 0 on padded ones.
 * Grid (column blocks, rows; rows strided past gridDim.y). dlogits may be the logits buffer itself
 * (fp32): each element is read and then written by the same thread. */
template <typename T>
__global__ void dlogits_kernel(T* dlogits, const float* logits, const float* lse, const int* targets, int n, int V,
                               int Vp, float dscale) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= Vp) return;
    for (int row = blockIdx.y; row < n; row += gridDim.y) {
        size_t i = (size_t)row * Vp + j;
        float g = 0.0f;
        if (j < V) g = (expf(logits[i] - lse[row]) - (j == targets[row] ? 1.0f : 0.0f)) * dscale;
        dlogits[i] = from_f<T>(g);
    }
}

/* Per-row losses [n] and lse [n] of rows x [n, C]; logits [n, Vp] fp32 scratch, kept for k_loss_bwd. */
template <typename T>
static void k_loss_fwd(float* losses, float* lse, float* logits, const T* x, const T* wte, const int* targets,
                       int n, int C, int V, int Vp) {
    classifier_logits(logits, x, wte, n, C, Vp);
    loss_rows_kernel<<<n, LOSS_THREADS>>>(losses, lse, logits, targets, V, Vp);
    LAUNCH_CHECK();
}

/* dx [n, C] and dwte [Vp, C] (fp32) += for these n rows, where each row's loss is weighted by
 * dscale (1/rows-in-the-whole-batch for a mean, times the loss scale for fp16). dlogits [n, Vp]
 * is T scratch (may alias logits when T is float). */
template <typename T>
static void k_loss_bwd(T* dx, float* dwte, T* dlogits, const float* logits, const float* lse, const T* x,
                       const T* wte, const int* targets, int n, int C, int V, int Vp, float dscale) {
    dim3 grid(ceil_div(Vp, 256), n < 65535 ? n : 65535);
    dlogits_kernel<T><<<grid, 256>>>(dlogits, logits, lse, targets, n, V, Vp, dscale);
    LAUNCH_CHECK();
    cudaDataType_t t = TypeInfo<T>::dtype;
    /* dx += dlogits @ wte */
    gemm_rm(false, false, n, C, Vp, 1.0f, dlogits, Vp, 0, wte, C, 0, 1.0f, dx, C, 0, 1, t, t);
    /* dwte += dlogits^T @ x */
    gemm_rm(true, false, Vp, C, n, 1.0f, dlogits, Vp, 0, x, C, 0, 1.0f, dwte, C, 0, 1, t, CUDA_R_32F);
}

#endif
