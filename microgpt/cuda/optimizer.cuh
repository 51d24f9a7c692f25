/* optimizer.cuh: the update side of a step: gradient scaling, the global L2 norm (for clipping
 * and, in fp16, overflow detection), AdamW on the fp32 master weights (refreshing the 16-bit
 * weight copy in the same pass), and the fp32 -> T weight copy.
 *
 * The norm is deterministic: a fixed number of blocks (NORM_BLOCKS, not derived from the GPU) each
 * sum a fixed grid-stride subset in fp32 and write one partial; one block adds the partials in
 * double, in a fixed tree. A non-finite gradient anywhere makes the norm non-finite.
 *
 * Nothing here needs the host between the backward and the next step: the norm stays on the
 * device, and the AdamW kernel reads it, with the step's learning rate, bias corrections, gradient
 * multiplier and clip threshold (UpdateCtl), from device memory. It derives the clip factor itself
 * and, when told to, skips the update on a non-finite norm (fp16 overflow). So the whole update
 * has fixed kernel arguments and can be captured once in a CUDA graph. */
#ifndef MICROGPT_CUDA_OPTIMIZER_CUH
#define MICROGPT_CUDA_OPTIMIZER_CUH

#include "common.cuh"

#define NORM_BLOCKS 1024
#define NORM_THREADS 256

/* Per-step values of the update, in device memory (see the top of this file). */
struct UpdateCtl {
    float lr;
    float c1, c2;       /* bias corrections 1 - beta1^t, 1 - beta2^t (computed in double) */
    float unscale;      /* gradients are used times this: 1/grad_accum, and 1/loss scale in fp16 */
    float clip;         /* grad_clip; <= 0: no clipping */
    int skip_nonfinite; /* 1 (fp16): a non-finite norm leaves the weights and moments alone */
};

static UpdateCtl update_ctl(float lr, int t, float beta1, float beta2, double unscale, float clip, int skip_nonfinite) {
    UpdateCtl c;
    c.lr = lr;
    c.c1 = (float)(1.0 - pow((double)beta1, (double)t));
    c.c2 = (float)(1.0 - pow((double)beta2, (double)t));
    c.unscale = (float)unscale;
    c.clip = clip;
    c.skip_nonfinite = skip_nonfinite;
    return c;
}

/* The norm of g * unscale (unscale: nullable device float, NULL = 1), without rewriting g. T is
 * float: the type slot LAUNCH_PACKED fills, which sets the packet (VEC 4 or 1). */
template <typename T, int VEC>
__global__ void k_grad_norm_partial(float* partial, const float* __restrict__ g, size_t n, const float* unscale) {
    await_previous_kernel();
    float s = 0.0f, u = unscale ? *unscale : 1.0f;
    FOR_PACKETS(i, n) {
        float x[VEC];
        load_vec(x, g + i);
        for (int k = 0; k < VEC; k++) s += (x[k] * u) * (x[k] * u);
    }
    s = block_sum(s);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

/* One block of NORM_BLOCKS threads: out[0] = sqrt(sum of partials). */
__global__ void k_grad_norm_final(float* out, const float* partial) {
    await_previous_kernel();
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

__global__ void k_grad_scale(float* g, size_t n, float s) {
    await_previous_kernel();
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) g[i] *= s;
}

/* Words of the weight-decay mask of n parameters: bit i % 32 of word i / 32 set where parameter i
 * decays (the 2-D tensors), so one launch updates every tensor. */
static size_t adamw_decay_words(size_t n) { return (n + 31) / 32; }

/* AdamW's update of the VEC parameters at i (k_adamw's and k_adamw_amax's), leaving the new
 * weights in pv; lr, c1, c2, u: UpdateCtl's; clip: scale the gradient by clip_s. Inlined into
 * k_adamw it gives loops no longer than k_adamw's own copy of these lines did (sm_90a: the same
 * instructions element-wise, one fewer a packet), so the two kernels share it. */
template <typename T, int VEC>
__device__ __forceinline__ void adamw_packet(float (&pv)[VEC], size_t i, float* __restrict__ p,
                                             const float* __restrict__ g, float* __restrict__ m,
                                             float* __restrict__ v, T* __restrict__ p_low, float beta1, float beta2,
                                             float eps, float wd, const unsigned* __restrict__ decay_bits, float lr,
                                             float c1, float c2, float u, int clip, float clip_s) {
    float gv[VEC], mv[VEC], vv[VEC];
    load_vec(gv, g + i);
    load_vec(mv, m + i);
    load_vec(vv, v + i);
    load_vec(pv, p + i);
    unsigned bits = decay_bits[i / 32] >> (i % 32);
    for (int k = 0; k < VEC; k++) {
        float gi = gv[k] * u, wdk = (bits >> k) & 1u ? wd : 0.0f;
        if (clip) gi *= clip_s;
        mv[k] = beta1 * mv[k] + (1.0f - beta1) * gi;
        vv[k] = beta2 * vv[k] + (1.0f - beta2) * gi * gi;
        pv[k] -= lr * ((mv[k] / c1) / (sqrtf(vv[k] / c2) + eps) + wdk * pv[k]);
    }
    store_vec(m + i, mv);
    store_vec(v + i, vv);
    store_vec(p + i, pv);
    if (p_low) store_vec(p_low + i, pv);
}

/* As the CPU's adamw_update, on the gradient g * unscale, clipped to norm ctl->clip when the
 * global norm (*norm, of g * unscale) exceeds it, with weight decay wd where decay_bits has the
 * parameter's bit (else 0); p_low (nullable) receives the updated weight rounded to T for the next
 * step's products. A packet's VEC bits lie in one word (VEC divides 32, packets start at multiples
 * of VEC). */
template <typename T, int VEC>
__global__ void k_adamw(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                        float* __restrict__ v, T* __restrict__ p_low, size_t n, float beta1, float beta2,
                        float eps, float wd, const unsigned* __restrict__ decay_bits, const UpdateCtl* ctl,
                        const float* norm) {
    await_previous_kernel();
    float nrm = *norm;
    if (ctl->skip_nonfinite && !isfinite(nrm)) return;
    int clip = ctl->clip > 0.0f && nrm > ctl->clip;
    float clip_s = clip ? (float)((double)ctl->clip / (double)nrm) : 1.0f;
    float lr = ctl->lr, c1 = ctl->c1, c2 = ctl->c2, u = ctl->unscale;
    FOR_PACKETS(i, n) {
        float pv[VEC];
        adamw_packet<T, VEC>(pv, i, p, g, m, v, p_low, beta1, beta2, eps, wd, decay_bits, lr, c1, c2, u, clip, clip_s);
    }
}

/* Parameters [lo, hi) whose amax (cuda/fp8.cuh: the maximum of the fp32 bit patterns of |x|) goes
 * to *amax_bits: one fp8 weight cast's input. A list of them is sorted by lo and disjoint, and
 * every hi is at most the parameter count. keep_low: the range's 16-bit copy is still written
 * under k_adamw_amax's lazy_low, because training reads it (wte's, with the FP8 classifier's
 * logits alone in FP8: its backward is bf16's, train.fp8_classifier logits). */
struct AmaxRange {
    size_t lo, hi;
    unsigned* amax_bits;
    int keep_low;
};

/* The first range of the list that ends after parameter i (n_ranges if none). */
__device__ __forceinline__ int amax_range_after(const AmaxRange* __restrict__ ranges, int n_ranges, size_t i) {
    int lo = 0, hi = n_ranges;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (ranges[mid].hi > i) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

/* k_adamw, and the amax of the new weights of every range into its amax_bits (zeroed before): each
 * block walks its span of blockDim.x packets, and for every range the span meets, folds the amax of
 * the values its threads hold in that range and commits it once (block_amax_commit). A skipped
 * update (a non-finite norm in fp16) leaves the weights as they are and takes their amax, so the
 * cast after it finds the scales it would find after a separate amax pass. lazy_low: p_low is not
 * written where a packet lies wholly in a range without keep_low (the engine's fp8 update always;
 * kernel_check also runs 0, the p_low of k_adamw). Precision fp8's update, single-process: the cast then reads the
 * values AdamW stored, so the amax, the scale and the codes are those of a separate amax pass, one
 * read of the masters fewer (docs/BENCHMARKS.md #91, #92). Bounded to
 * 4 blocks of 256 threads a multiprocessor, k_adamw's occupancy (ptxas, sm_90a, bf16 packed: 59
 * registers, no spills; unbounded 66, which leaves 3). */
template <typename T, int VEC>
__global__ void __launch_bounds__(256, 4) k_adamw_amax(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                             float* __restrict__ v, T* __restrict__ p_low, size_t n, float beta1, float beta2,
                             float eps, float wd, const unsigned* __restrict__ decay_bits, const UpdateCtl* ctl,
                             const float* norm, const AmaxRange* __restrict__ ranges, int n_ranges,
                             int lazy_low) {
    await_previous_kernel();
    float nrm = *norm;
    bool skip = ctl->skip_nonfinite && !isfinite(nrm);
    int clip = ctl->clip > 0.0f && nrm > ctl->clip;
    float clip_s = clip ? (float)((double)ctl->clip / (double)nrm) : 1.0f;
    float lr = ctl->lr, c1 = ctl->c1, c2 = ctl->c2, u = ctl->unscale;
    size_t span = (size_t)blockDim.x * VEC;
    for (size_t base = blockIdx.x * span; base < n; base += (size_t)gridDim.x * span) {
        size_t i = base + threadIdx.x * VEC, end = base + span < n ? base + span : n;
        int first = amax_range_after(ranges, n_ranges, base); /* of the ranges the span meets */
        T* low = p_low;
        for (int r = first; lazy_low && r < n_ranges && ranges[r].lo < end; r++)
            if (!ranges[r].keep_low && ranges[r].lo <= i && i + VEC <= ranges[r].hi) low = NULL;
        float pv[VEC];
        if (i < n && skip) load_vec(pv, p + i);
        else if (i < n)
            adamw_packet<T, VEC>(pv, i, p, g, m, v, low, beta1, beta2, eps, wd, decay_bits, lr, c1, c2, u, clip, clip_s);
        for (int r = first; r < n_ranges && ranges[r].lo < end; r++) {
            size_t lo = ranges[r].lo, hi = ranges[r].hi;
            bool whole = lo <= i && i + VEC <= hi; /* the packet lies in the range (so i < n) */
            unsigned a = 0;
            for (int k = 0; k < VEC; k++)
                if (whole || (i + k >= lo && i + k < hi)) a = max(a, abs_bits(pv[k]));
            block_amax_commit(ranges[r].amax_bits, a); /* block-uniform: every thread walks the same ranges */
        }
    }
}

template <typename T>
__global__ void k_convert(T* out, const float* in, size_t n) {
    await_previous_kernel();
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        out[i] = from_f<T>(in[i]);
}

/* partial: NORM_BLOCKS floats of scratch; unscale: nullable device float (see the kernel) */
static void grad_norm_partial(float* partial, const float* g, size_t n, const float* unscale) {
    LAUNCH_PACKED(packable(n, sizeof(float), {g}), k_grad_norm_partial, float, NORM_BLOCKS, NORM_THREADS, partial,
                  g, n, unscale);
}

/* out: one device float, the L2 norm of everything grad_norm_partial summed */
static void grad_norm_final(float* out, const float* partial) {
    launch_kernel(k_grad_norm_final, 1, NORM_BLOCKS, out, partial);
}

/* g *= s. k_grad_scale is one of the clipping kernels docs/DESIGN.md §3.1 names; the engine itself
 * folds the gradient multiplier and the clip factor into the AdamW pass (one read of g instead of
 * two), so only tests/kernel_check.cu calls it. */
static void grad_scale(float* g, size_t n, float s) {
    launch_kernel(k_grad_scale, elementwise_grid(n, 256), 256, g, n, s);
}

/* ctl, norm, decay_bits: device pointers (UpdateCtl of this step; the norm from grad_norm_final;
 * adamw_decay_words(n) words of the decay mask) */
template <typename T>
static void adamw(float* p, const float* g, float* m, float* v, T* p_low, size_t n, float beta1, float beta2,
                  float eps, float wd, const unsigned* decay_bits, const UpdateCtl* ctl, const float* norm) {
    /* packets of PACK(T) elements: 16 bytes of p_low, one or two of each fp32 array (n a multiple of
     * PACK(T) makes n fp32 whole 16-byte packets too) */
    bool packed = packable(n, sizeof(T), {p, g, m, v, p_low});
    LAUNCH_PACKED_ELEMENTWISE(packed, k_adamw, T, n, p, g, m, v, p_low, n, beta1, beta2, eps, wd, decay_bits, ctl,
                              norm);
}

/* adamw, with the amax of the new weights of each of ranges[0..n_ranges) (device memory, sorted,
 * disjoint: AmaxRange) into its amax_bits, which must be 0 before; lazy_low: p_low left alone
 * where a packet lies wholly in a range without keep_low (generation refreshes it, docs/DESIGN.md
 * §18). The same grid and packets as adamw. */
template <typename T>
static void adamw_amax(float* p, const float* g, float* m, float* v, T* p_low, size_t n, float beta1, float beta2,
                       float eps, float wd, const unsigned* decay_bits, const UpdateCtl* ctl, const float* norm,
                       const AmaxRange* ranges, int n_ranges, int lazy_low) {
    bool packed = packable(n, sizeof(T), {p, g, m, v, p_low});
    LAUNCH_PACKED_ELEMENTWISE(packed, k_adamw_amax, T, n, p, g, m, v, p_low, n, beta1, beta2, eps, wd, decay_bits, ctl,
                              norm, ranges, n_ranges, lazy_low);
}

template <typename T>
static void convert(T* out, const float* in, size_t n) {
    launch_kernel(k_convert<T>, elementwise_grid(n, 256), 256, out, in, n);
}

#endif
