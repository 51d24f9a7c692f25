/* loss.cuh: the tied classifier and cross-entropy, as the CPU's classifier_forward/backward:
 * logits = x @ wte^T over all Vp (padded) rows of wte, softmax and loss over the first V (real)
 * columns only; padded columns get zero gradient, so padded wte rows never change by gradient.
 *
 * The engine runs these on chunks of rows so the fp32 logits of a whole batch (N × Vp) never
 * exist at once. Logits are fp32 even when T is 16-bit (cuBLAS writes fp32 C from T inputs): the
 * softmax over 50k entries is where 16-bit rounding would cost most.
 *
 * One kernel does a row's softmax, loss and (when training) its gradient: a first pass over the
 * row keeps a running max and a sum rescaled to it (online softmax), giving the log-sum-exp; a
 * second pass writes dlogits = (softmax - onehot) * dscale in T, ready for the two products. Two
 * reads of the logits and one write of the gradient, in one launch. dscale is read from device
 * memory (it carries the fp16 loss scale) so a captured graph of the step stays fixed. */
#ifndef MICROGPT_CUDA_LOSS_CUH
#define MICROGPT_CUDA_LOSS_CUH

#include "matmul.cuh"

#define LOSS_THREADS 256

/* logits [n, Vp] (fp32) = x [n, C] @ wte^T, wte [Vp, C] */
template <typename T>
static void classifier_logits(float* logits, const T* x, const T* wte, int n, int C, int Vp) {
    gemm_rm(false, true, n, Vp, C, 1.0f, x, C, 0, wte, C, 0, 0.0f, logits, Vp, 0, 1, TypeInfo<T>::dtype, CUDA_R_32F);
}

/* One block per row: lse over the real columns, loss = lse - logit[target]; with dlogits (nullable;
 * may alias logits when T is float: each element is read, then written, by one thread), also
 * dlogits = (exp(logit - lse) - [j == target]) * dscale on real columns and 0 on padded ones. */
template <typename T>
__global__ void loss_rows_kernel(float* losses, float* lse, T* dlogits, const float* logits, const int* targets, int V,
                                 int Vp, const float* dscale) {
    int row = blockIdx.x, target = targets[row];
    const float* l = logits + (size_t)row * Vp;
    float mx = -INFINITY, s = 0.0f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        float x = l[j];
        if (x > mx) {
            s = s * expf(mx - x) + 1.0f; /* first element: 0 * exp(-inf) + 1 */
            mx = x;
        } else {
            s += expf(x - mx);
        }
    }
    float row_mx = block_max(mx);
    s = block_sum(mx == -INFINITY ? 0.0f : s * expf(mx - row_mx));
    float row_lse = row_mx + logf(s);
    if (threadIdx.x == 0) {
        lse[row] = row_lse;
        losses[row] = row_lse - l[target];
    }
    if (!dlogits) return;
    float ds = *dscale;
    T* d = dlogits + (size_t)row * Vp;
    __syncthreads(); /* thread 0 has read l[target] before anyone overwrites it (fp32 alias) */
    for (int j = threadIdx.x; j < Vp; j += blockDim.x) {
        float g = 0.0f;
        if (j < V) g = (expf(l[j] - row_lse) - (j == target ? 1.0f : 0.0f)) * ds;
        d[j] = from_f<T>(g);
    }
}

/* Evaluation: per-row losses [n] and lse [n] of rows x [n, C]; logits [n, Vp] fp32 scratch. */
template <typename T>
static void k_loss_fwd(float* losses, float* lse, float* logits, const T* x, const T* wte, const int* targets,
                       int n, int C, int V, int Vp) {
    classifier_logits(logits, x, wte, n, C, Vp);
    loss_rows_kernel<T><<<n, LOSS_THREADS, 0, g_stream>>>(losses, lse, (T*)NULL, logits, targets, V, Vp,
                                                          (const float*)NULL);
    LAUNCH_CHECK();
}

/* Training: as k_loss_fwd, and dx [n, C] and dwte [Vp, C] (fp32) += the gradient of these n rows,
 * each row's loss weighted by *dscale (device float: 1/rows-in-the-whole-batch for a mean, times
 * the loss scale for fp16). dlogits [n, Vp] is T scratch (may alias logits when T is float). */
template <typename T>
static void k_loss_fwd_bwd(float* losses, float* lse, T* dx, float* dwte, float* logits, T* dlogits, const T* x,
                           const T* wte, const int* targets, int n, int C, int V, int Vp, const float* dscale) {
    classifier_logits(logits, x, wte, n, C, Vp);
    loss_rows_kernel<T><<<n, LOSS_THREADS, 0, g_stream>>>(losses, lse, dlogits, logits, targets, V, Vp, dscale);
    LAUNCH_CHECK();
    cudaDataType_t t = TypeInfo<T>::dtype;
    /* dx += dlogits @ wte */
    gemm_rm(false, false, n, C, Vp, 1.0f, dlogits, Vp, 0, wte, C, 0, 1.0f, dx, C, 0, 1, t, t);
    /* dwte += dlogits^T @ x */
    gemm_rm(true, false, Vp, C, n, 1.0f, dlogits, Vp, 0, x, C, 0, 1.0f, dwte, C, 0, 1, t, CUDA_R_32F);
}

/* One block of LOSS_MEAN_THREADS: out[0] = the mean of losses [n], summed in double in a fixed
 * order (the step's loss, formed on the device so only one float comes back). */
#define LOSS_MEAN_THREADS 1024
__global__ void loss_mean_kernel(float* out, const float* losses, int n) {
    __shared__ double warp_part[LOSS_MEAN_THREADS / 32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    double s = 0.0;
    for (int i = threadIdx.x; i < n; i += LOSS_MEAN_THREADS) s += losses[i];
    s = warp_sum_d(s);
    if (lane == 0) warp_part[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = warp_sum_d(warp_part[lane]);
        if (lane == 0) out[0] = (float)(s / n);
    }
}

static void k_loss_mean(float* out, const float* losses, int n) {
    loss_mean_kernel<<<1, LOSS_MEAN_THREADS, 0, g_stream>>>(out, losses, n);
    LAUNCH_CHECK();
}

#endif
