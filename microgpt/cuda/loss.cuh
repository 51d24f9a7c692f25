/* loss.cuh: the tied classifier and cross-entropy, as the CPU's classifier_forward/backward:
 * logits = x @ wte^T over all Vp (padded) rows of wte, softmax and loss over the first V (real)
 * columns only; padded columns get zero gradient, so padded wte rows never change by gradient.
 * Roles (docs/DESIGN.md §3.1): loss_fwd (evaluation) and loss_fwd_bwd (training) run the
 * classifier products around one kernel, k_loss_rows, which is the k_loss_fwd / k_loss_bwd pair
 * in one pass (the backward half runs when it is given dscale); k_loss_mean forms the mean.
 *
 * The engine runs these on chunks of rows so that the logits of a whole batch need not exist at
 * once. Logits are stored in T, the activation type (fp32, or bf16/fp16 rounded from the fp32
 * accumulation, as under PyTorch's autocast and in llm.c): the logits pass is the biggest memory
 * stream of a step (N × Vp values written, read and overwritten with their gradient), and fp32
 * logits would double its bytes. The softmax, its log-sum-exp and the loss are computed in fp32
 * from them; rounding a logit costs at most half a T ulp of it in that row's loss (documented with
 * the tolerances in tests/kernel_check.cu and tests/test_gpu.py).
 *
 * One kernel does a row's softmax, loss and (when training) its gradient: a first pass over the
 * row keeps a running max and a sum rescaled to it (online softmax, once per 16-byte packet),
 * giving the log-sum-exp (exponentials by the hardware's __expf, ~2 ulp); a second pass overwrites
 * the logits with their gradient dlogits = (softmax - onehot) * dscale, ready for the two products.
 * A block of LOSS_THREADS per row keeps the rows in flight small enough (2 blocks per
 * multiprocessor) that the second pass reads from L2. dscale is read from device memory (it carries
 * the fp16 loss scale) so a captured graph of the step stays fixed. */
#ifndef MICROGPT_CUDA_LOSS_CUH
#define MICROGPT_CUDA_LOSS_CUH

#include "matmul.cuh"

#define LOSS_THREADS 1024

/* logits [n, Vp] = x [n, C] @ wte^T, wte [Vp, C]; L is T (training, evaluation) or float (the
 * sampler's logits of one position). */
template <typename T, typename L>
static void classifier_logits(L* logits, const T* x, const T* wte, int n, int C, int Vp) {
    gemm(n, Vp, C, mat(x, C), mat_t(wte, C), mat(logits, Vp));
}

/* One block per row: lse over the real columns, loss = lse - logit[target]; with dscale (device
 * float, nullable), also overwrites the row with dlogits = (exp(logit - lse) - [j == target]) *
 * dscale on real columns and 0 on padded ones. Rows are whole packets when VEC > 1. */
template <typename T, int VEC>
__global__ void __launch_bounds__(LOSS_THREADS)
k_loss_rows(float* __restrict__ losses, float* __restrict__ lse, T* __restrict__ logits,
            const int* __restrict__ targets, int V, int Vp, const float* __restrict__ dscale) {
    await_previous_kernel();
    int row = blockIdx.x, target = targets[row];
    T* l = logits + (size_t)row * Vp;
    float target_logit = threadIdx.x == 0 ? to_f(l[target]) : 0.0f; /* read before the row is overwritten */
    float mx = -INFINITY, s = 0.0f, v[VEC];
    for (int j = threadIdx.x * VEC; j < V; j += LOSS_THREADS * VEC) {
        load_vec(v, l + j);
        if (j + VEC > V) /* the one packet that reaches into the padding */
            for (int k = 0; k < VEC; k++)
                if (j + k >= V) v[k] = -INFINITY;
        float pm = v[0];
        for (int k = 1; k < VEC; k++) pm = fmaxf(pm, v[k]);
        if (pm > mx) { /* rescale the sum to the new max (first packet: 0 * exp(-inf) = 0) */
            s *= __expf(mx - pm);
            mx = pm;
        }
        for (int k = 0; k < VEC; k++) s += __expf(v[k] - mx);
    }
    float row_mx = block_max(mx);
    s = block_sum(mx == -INFINITY ? 0.0f : s * __expf(mx - row_mx)); /* ends with every read of l done */
    float row_lse = row_mx + logf(s);
    if (threadIdx.x == 0) {
        lse[row] = row_lse;
        losses[row] = row_lse - target_logit;
    }
    if (!dscale) return;
    float ds = *dscale;
    for (int j = threadIdx.x * VEC; j < Vp; j += LOSS_THREADS * VEC) {
        load_vec(v, l + j);
        for (int k = 0; k < VEC; k++) v[k] = (__expf(v[k] - row_lse) - (j + k == target ? 1.0f : 0.0f)) * ds;
        if (j + VEC > V) /* padded columns */
            for (int k = 0; k < VEC; k++)
                if (j + k >= V) v[k] = 0.0f;
        store_vec(l + j, v);
    }
}

template <typename T>
static void loss_rows(float* losses, float* lse, T* logits, const int* targets, int n, int V, int Vp,
                      const float* dscale) {
    LAUNCH_PACKED(packable(Vp, sizeof(T), {logits}), k_loss_rows, T, n, LOSS_THREADS, losses, lse, logits,
                  targets, V, Vp, dscale);
}

/* Evaluation: per-row losses [n] and lse [n] of rows x [n, C]; logits [n, Vp] is scratch. */
template <typename T>
static void loss_fwd(float* losses, float* lse, T* logits, const T* x, const T* wte, const int* targets, int n,
                     int C, int V, int Vp) {
    classifier_logits(logits, x, wte, n, C, Vp);
    loss_rows(losses, lse, logits, targets, n, V, Vp, (const float*)NULL);
}

/* Training: as loss_fwd; dx [n, C] = and dwte [Vp, C] (fp32) = / += (by grad_beta) the gradient
 * of these n rows, each row's loss weighted by *dscale (device float: 1/rows-in-the-whole-batch for
 * a mean, times the loss scale for fp16). logits [n, Vp] is scratch and ends holding dlogits. */
template <typename T>
static void loss_fwd_bwd(float* losses, float* lse, T* dx, float* dwte, T* logits, const T* x, const T* wte,
                         const int* targets, int n, int C, int V, int Vp, const float* dscale, float grad_beta) {
    classifier_logits(logits, x, wte, n, C, Vp);
    loss_rows(losses, lse, logits, targets, n, V, Vp, dscale);
    /* dx = dlogits @ wte */
    gemm(n, C, Vp, mat(logits, Vp), mat(wte, C), mat(dx, C));
    /* dwte = dlogits^T @ x + grad_beta * dwte */
    gemm(Vp, C, n, mat_t(logits, Vp), mat(x, C), mat(dwte, C), 1.0f, grad_beta);
}

/* One block of LOSS_MEAN_THREADS: out[0] = the mean of losses [n], summed in double in a fixed
 * order (the step's loss, formed on the device so only one float comes back). */
#define LOSS_MEAN_THREADS 1024
__global__ void k_loss_mean(float* out, const float* losses, int n) {
    await_previous_kernel();
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

static void loss_mean(float* out, const float* losses, int n) {
    launch_kernel(k_loss_mean, 1, LOSS_MEAN_THREADS, out, losses, n);
}

#endif
