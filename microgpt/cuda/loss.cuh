/* loss.cuh: the tied classifier and cross-entropy, as the CPU's classifier_forward/backward:
 * logits = x @ wte^T over all Vp (padded) rows of wte, softmax and loss over the first V (real)
 * columns only; padded columns get zero gradient, so padded wte rows never change by gradient.
 * Roles (docs/DESIGN.md §3.1): loss_fwd (evaluation) and loss_fwd_bwd (training) run the
 * classifier products around one kernel, k_loss_rows, which is the k_loss_fwd / k_loss_bwd pair
 * in one pass (the backward half runs when it is given dscale); k_loss_mean forms the mean.
 * Where classifier_grad.cuh applies (Hopper, bf16, d_model up to 192), training's backward is
 * instead its two products with the softmax folded in, and the logits stay as they are.
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
 * dscale is read from device memory (it carries the fp16 loss scale) so a captured graph of the
 * step stays fixed. A block of LOSS_THREADS takes a row, two blocks per multiprocessor where they fit:
 *   k_loss_rows_shared  first copies its row into dynamic shared memory (cp.async, 16-byte packets,
 *                       no registers in between; 98 KiB for a bf16 row of 50304), then runs both
 *                       passes from there: memory sees one read and one write of the logits, the
 *                       second pass never waits on L2, and each thread has its whole share of the
 *                       row in flight at once. 462 against 505 µs a step at ANDREA-120M, 234
 *                       against 253 at ANDREA-12M (H200, bench/rowk_bench.cu; docs/BENCHMARKS.md
 *                       log #64).
 *   k_loss_rows         both passes over the row in memory (the second from L2): for rows whose
 *                       copy does not fit two blocks a multiprocessor (an fp32 row of 50304; any
 *                       row on compute capability 8.6, 8.7 or 8.9, whose multiprocessors hold
 *                       1536 threads, not two blocks of 1024).
 * Both run the same loss_row body in the same order on the same values: the same bits
 * (tests/kernel_check.cu compares them). */
#ifndef MICROGPT_CUDA_LOSS_CUH
#define MICROGPT_CUDA_LOSS_CUH

#include "classifier_grad.cuh"
#include "matmul.cuh"

#define LOSS_THREADS 1024
/* Budget for one chunk of logits (then their gradient): 1 GiB holds ANDREA-120M's 8192 rows of
 * bf16 logits in one chunk (docs/BENCHMARKS.md #158: fp8 −0.13 ms a step against two chunks of
 * 512 MiB). A test build sets a small one (tests/test_gpu.py: a tiny model's loss in several chunks). */
#ifndef LOGITS_CHUNK_BYTES
#define LOGITS_CHUNK_BYTES ((size_t)1 << 30)
#endif

/* Logits rows per chunk of the N positions, rows of Vp elements of elem_bytes each: as many as
 * LOGITS_CHUNK_BYTES holds, whole GEMM_TILE-row tiles for the products, at most N. */
static int loss_chunk_rows(int Vp, size_t elem_bytes, int N) {
    size_t rows = LOGITS_CHUNK_BYTES / ((size_t)Vp * elem_bytes);
    if (rows > GEMM_TILE) rows -= rows % GEMM_TILE;
    return (int)(rows < 1 ? 1 : rows > (size_t)N ? (size_t)N : rows);
}

#include <cuda_pipeline.h>

/* logits [n, Vp] = x [n, C] @ wte^T, wte [Vp, C]; L is T (training, evaluation) or float (the
 * sampler's logits of one position). */
template <typename T, typename L>
static void classifier_logits(L* logits, const T* x, const T* wte, int n, int C, int Vp) {
    gemm(n, Vp, C, mat(x, C), mat_t(wte, C), mat(logits, Vp));
}

#include <type_traits>
/* What a store's store() takes for ds, derived once a row (`row`, the block's): ds itself, unless
 * the store's type has its own overload (cuda/fp8.cuh's LossStoreFp8: the codes' scale and the row's
 * random key). */
template <typename Store> __device__ __forceinline__ float loss_store_row_arg(const Store&, float ds, int row) {
    (void)row;
    return ds;
}
/* Whether a store takes loss_grad_lean's gradient: no, unless specialised (LossStoreFp8). */
template <typename Store> struct LossStoreLean : std::false_type {};

/* What a row's second pass does with its gradient's packets (v: the VEC values from column j of
 * row `row`; ds: loss_store_row_arg(st, *dscale, row)): by default
 * overwrites the logits l with them in T. The FP8 classifier stores their FP8 codes elsewhere
 * instead (cuda/fp8.cuh's LossStoreFp8). */
struct LossStoreInPlace {
    template <typename T, int VEC>
    __device__ __forceinline__ void store(T* l, int row, int j, const float (&v)[VEC], float ds) const {
        (void)row, (void)ds;
        store_vec(l + j, v);
    }
};

/* exp(x) as __expf computes it (ex2.approx of x times log2 e rounded to fp32), but with results below
 * 2^-126 flushed to 0 (ex2.approx.ftz): the same bits for every other x, two to three instructions fewer. */
__device__ __forceinline__ float exp_ftz(float x) { return fa_exp2(x * FA_LOG2E); }

/* The running max of a row's first pass (LOSS_ROWS_MAX_FIRST): bf16 packets of 8 as packed pairs,
 * their maxima taken pairwise without conversion (the values are exact in bf16, so the pairs' max
 * is the floats'; a NaN is passed over either way, as by fmaxf), and every other packet in fp32. */
template <typename T, int VEC> struct LossRowMax {
    static constexpr bool packed = std::is_same<T, bf16>::value && VEC == 8;
    float mx = -INFINITY;
    __nv_bfloat162 m2 = __floats2bfloat162_rn(-INFINITY, -INFINITY);
    __device__ __forceinline__ void add_packet(const T* p) {
        if constexpr (packed) {
            int4 raw = *reinterpret_cast<const int4*>(p);
            __nv_bfloat162 w[4];
            memcpy(w, &raw, sizeof raw);
            m2 = __hmax2(m2, __hmax2(__hmax2(w[0], w[1]), __hmax2(w[2], w[3])));
        } else {
            float v[VEC];
            load_vec(v, p);
            for (int k = 0; k < VEC; k++) mx = fmaxf(mx, v[k]);
        }
    }
    __device__ __forceinline__ void add(float x) { mx = fmaxf(mx, x); }
    __device__ __forceinline__ float value(void) const {
        return packed ? fmaxf(mx, fmaxf(__low2float(m2), __high2float(m2))) : mx;
    }
};

/* The lean second pass's gradient of a packet v (column j), for LossStoreFp8's codes (in fewer
 * instructions, docs/BENCHMARKS.md #84): as
 * loss_row's (exp(v - lse) - [j == target]) * ds, with
 *  - exp_ftz for __expf: an exponential below 2^-126 becomes 0, whose code is that of the value it
 *    replaces: both are ±0 after the scale (|ds| * fp8_dlogits_scale(ds) is at most the format's largest
 *    finite value, < 2^16, so the value is below 2^-110, which the stochastic rounding's fp32 sum
 *    with the smallest normal, 2^-6 in E4M3 and 2^-14 in E5M2, loses whatever the random bits:
 *    cpu/fp8.h's fp8_round_stochastic; 0 * ds keeps ds's sign, as the tiny product does), and the
 *    target's exp - 1 stays -1 (1 - 2^-126 rounds to 1); for every finite ds (at ±infinity, 0 * ds
 *    is NaN where the tiny value gives ±infinity: the engine's ds is 1/N);
 *  - the one-hot subtracted only in the packet that holds the target, elsewhere nothing: exp - 0
 *    is exp (exp is +0 or more, or NaN, which both forms carry). */
template <int VEC> __device__ __forceinline__ void loss_grad_lean(float (&v)[VEC], int j, int target, float row_lse,
                                                                  float ds) {
    for (int k = 0; k < VEC; k++) v[k] = exp_ftz(v[k] - row_lse);
    if ((unsigned)(target - j) < (unsigned)VEC)
        for (int k = 0; k < VEC; k++)
            if (j + k == target) v[k] -= 1.0f;
    for (int k = 0; k < VEC; k++) v[k] *= ds;
}

/* A candidate, off until the H200 measures it (docs/BENCHMARKS.md #172; on an H100, whose rows are
 * bound by its slower memory, it gained nothing): -DLOSS_LEAN_ROWS=1 gives every store the lean
 * second pass (loss_grad_lean), not only the FP8 classifier's, and the first pass's exponentials
 * exp_ftz. By the sm_90a SASS (nvcc 13) that takes the bf16 rows' loop from 118 to 89 instructions
 * a packet in the first pass and from 138 to 110 in the second; on the H200 the rows are bound by
 * instructions more than by bytes (#83). The bits it may change: the first pass's sum never
 * (a flushed exponential or rescale factor is below 2^-110, and every partial sum it could reach is
 * absorbed whole once the row maximum's term, 1, is added: the sum of a packet is at least 1); the
 * second pass's only where exp(logit - lse) is below 2^-126, whose gradient times dscale is then 0
 * in place of a denormal: 0 in fp16 for any dscale, and in bf16 for dscale <= 2^-8 (a mean over 256
 * positions or more), so in practice a different value only among fp32's logits. */
#ifndef LOSS_LEAN_ROWS
#define LOSS_LEAN_ROWS 0
#endif
/* A candidate, off (docs/BENCHMARKS.md #179): the first pass split in two, the row's max alone
 * (LossRowMax), then the sum of exp_ftz(logit - max) at that max, in place of the online max and
 * sum, whose every packet compares, rescales and exponentiates; every store's gradient is #172's
 * (loss_grad_lean). The row is in shared memory, so the extra pass costs no memory traffic there
 * (an L2 read in k_loss_rows). Other low bits of the sum than the online form's. */
#ifndef LOSS_ROWS_MAX_FIRST
#define LOSS_ROWS_MAX_FIRST 0
#endif

#if LOSS_LEAN_ROWS
#define LOSS_EXP exp_ftz
#else
#define LOSS_EXP __expf
#endif

/* One row's softmax, loss and gradient (the block's threads, VEC-element packets): lse over the
 * real columns of `src`, losses[row] = lse - target_logit (thread 0's, read from l before the row
 * is overwritten); with dscale (device float, nullable), also stores dlogits = (exp(logit - lse)
 * - [j == target]) * dscale on real columns and 0 on padded ones by `st` (over l). src is l
 * itself (k_loss_rows) or the row's copy in shared memory (k_loss_rows_shared). Each thread reads only
 * the packets j = threadIdx.x * VEC + i * LOSS_THREADS * VEC (loss_row_copy copies the same ones).
 * Rows are whole packets when VEC > 1. */
template <typename T, int VEC, typename Store>
__device__ __forceinline__ void loss_row(float* __restrict__ losses, float* __restrict__ lse, T* l, const T* src,
                                         int row, int target, float target_logit, int V, int Vp,
                                         const float* __restrict__ dscale, const Store& st) {
    float mx = -INFINITY, s = 0.0f, v[VEC];
#if LOSS_ROWS_MAX_FIRST
    LossRowMax<T, VEC> rm;
    for (int j = threadIdx.x * VEC; j < V; j += LOSS_THREADS * VEC) {
        if (j + VEC <= V) {
            rm.add_packet(src + j);
            continue;
        }
        load_vec(v, src + j); /* the one packet that reaches into the padding */
        for (int k = 0; k < VEC; k++)
            if (j + k < V) rm.add(v[k]);
    }
    mx = rm.value(); /* this thread's */
    float row_mx = block_max(mx);
    for (int j = threadIdx.x * VEC; row_mx != -INFINITY && j < V; j += LOSS_THREADS * VEC) {
        load_vec(v, src + j);
        if (j + VEC > V)
            for (int k = 0; k < VEC; k++)
                if (j + k >= V) v[k] = -INFINITY;
        for (int k = 0; k < VEC; k++) s += exp_ftz(v[k] - row_mx);
    }
    s = block_sum(s); /* ends with every read of l done */
#else
    for (int j = threadIdx.x * VEC; j < V; j += LOSS_THREADS * VEC) {
        load_vec(v, src + j);
        if (j + VEC > V) /* the one packet that reaches into the padding */
            for (int k = 0; k < VEC; k++)
                if (j + k >= V) v[k] = -INFINITY;
        float pm = v[0];
        for (int k = 1; k < VEC; k++) pm = fmaxf(pm, v[k]);
        if (pm > mx) { /* rescale the sum to the new max (first packet: 0 * exp(-inf) = 0) */
            s *= LOSS_EXP(mx - pm);
            mx = pm;
        }
        for (int k = 0; k < VEC; k++) s += LOSS_EXP(v[k] - mx);
    }
    float row_mx = block_max(mx);
    s = block_sum(mx == -INFINITY ? 0.0f : s * LOSS_EXP(mx - row_mx)); /* ends with every read of l done */
#endif
    float row_lse = row_mx + logf(s);
    if (threadIdx.x == 0) {
        lse[row] = row_lse;
        losses[row] = row_lse - target_logit;
    }
    if (!dscale) return;
    float ds = *dscale;
    const auto st_arg = loss_store_row_arg(st, ds, row);
    for (int j = threadIdx.x * VEC; j < Vp; j += LOSS_THREADS * VEC) {
        load_vec(v, src + j);
        if constexpr (LOSS_ROWS_MAX_FIRST || LOSS_LEAN_ROWS || LossStoreLean<Store>::value)
            loss_grad_lean(v, j, target, row_lse, ds);
        else
        for (int k = 0; k < VEC; k++) v[k] = (__expf(v[k] - row_lse) - (j + k == target ? 1.0f : 0.0f)) * ds;
        if (j + VEC > V) /* padded columns */
            for (int k = 0; k < VEC; k++)
                if (j + k >= V) v[k] = 0.0f;
        st.template store<T, VEC>(l, row, j, v, st_arg);
    }
}

/* One block per row, both passes over the row in memory (the second from L2). */
template <typename T, int VEC, typename Store>
__global__ void __launch_bounds__(LOSS_THREADS)
k_loss_rows(float* __restrict__ losses, float* __restrict__ lse, T* __restrict__ logits,
            const int* __restrict__ targets, int V, int Vp, const float* __restrict__ dscale, Store st) {
    await_previous_kernel();
    int row = blockIdx.x, target = targets[row];
    T* l = logits + (size_t)row * Vp;
    float target_logit = threadIdx.x == 0 ? to_f(l[target]) : 0.0f; /* read before the row is overwritten */
    loss_row<T, VEC>(losses, lse, l, l, row, target, target_logit, V, Vp, dscale, st);
}

template <typename T, typename Store = LossStoreInPlace>
static void loss_rows_from_memory(float* losses, float* lse, T* logits, const int* targets, int n, int V, int Vp,
                                  const float* dscale, Store st = Store()) {
    if (packable(Vp, sizeof(T), {logits}))
        launch_kernel(k_loss_rows<T, PACK(T), Store>, n, LOSS_THREADS, losses, lse, logits, targets, V, Vp, dscale, st);
    else launch_kernel(k_loss_rows<T, 1, Store>, n, LOSS_THREADS, losses, lse, logits, targets, V, Vp, dscale, st);
}

/* This thread's packets of a row of Vp (the ones loss_row reads) into shared memory by cp.async,
 * VEC-element packets of 16 bytes, else element by element; then one commit (the thread's copy
 * group: each thread waits only for its own copies, and reads only them). */
template <typename T, int VEC>
__device__ __forceinline__ void loss_row_copy(T* row_s, const T* l, int Vp) {
    for (int j = threadIdx.x * VEC; j < Vp; j += LOSS_THREADS * VEC) {
        if constexpr (VEC * sizeof(T) == 16) __pipeline_memcpy_async(row_s + j, l + j, 16);
        else row_s[j] = l[j];
    }
    __pipeline_commit();
}

#define LOSS_ROWS_SHARED_PER_SM 2 /* blocks of k_loss_rows_shared a multiprocessor must hold */
/* Two blocks of LOSS_THREADS fit a multiprocessor of compute capability 8.0 or 9.0 (2048 threads),
 * not one of 8.6, 8.7 or 8.9 (1536): there the kernel's bound asks for one (ptxas would ignore two,
 * with a warning), loss_rows_shared_fits finds that two do not fit, and the rows run from memory. */
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 870 || __CUDA_ARCH__ == 890)
#define LOSS_ROWS_SHARED_BOUND 1
#else
#define LOSS_ROWS_SHARED_BOUND LOSS_ROWS_SHARED_PER_SM
#endif
/* A block per row, its row in Vp elements of dynamic shared memory. */
template <typename T, int VEC, typename Store>
__global__ void __launch_bounds__(LOSS_THREADS, LOSS_ROWS_SHARED_BOUND)
k_loss_rows_shared(float* __restrict__ losses, float* __restrict__ lse, T* __restrict__ logits,
                   const int* __restrict__ targets, int V, int Vp, const float* __restrict__ dscale, Store st) {
    await_previous_kernel();
    extern __shared__ __align__(16) unsigned char loss_row_bytes[];
    T* row_s = reinterpret_cast<T*>(loss_row_bytes);
    int row = blockIdx.x, target = targets[row];
    T* l = logits + (size_t)row * Vp;
    float target_logit = threadIdx.x == 0 ? to_f(l[target]) : 0.0f;
    loss_row_copy<T, VEC>(row_s, l, Vp);
    __pipeline_wait_prior(0);
    loss_row<T, VEC>(losses, lse, l, row_s, row, target, target_logit, V, Vp, dscale, st);
}
/* Whether k_loss_rows_shared<T, VEC, Store> can run rows of `bytes` here: its dynamic shared memory (the
 * row) plus its static shared memory (block_reduce's partials) within a block's opt-in limit (the
 * sum of the two may not exceed it: asking for the whole limit as dynamic memory fails), and
 * LOSS_ROWS_SHARED_PER_SM blocks of it (registers and shared memory, by the occupancy calculator)
 * on one multiprocessor. Raises the kernel's dynamic limit to exactly the row's bytes on the way. */
template <typename T, int VEC, typename Store>
static bool loss_rows_shared_fits(size_t bytes) {
    static size_t checked_bytes = 0;
    static bool fits = false;
    if (bytes == checked_bytes) return fits;
    int dev, optin;
    cudaFuncAttributes fa;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    CUDA_CHECK(cudaFuncGetAttributes(&fa, k_loss_rows_shared<T, VEC, Store>));
    int blocks = 0;
    fits = bytes + fa.sharedSizeBytes <= (size_t)optin;
    if (fits) {
        CUDA_CHECK(cudaFuncSetAttribute(k_loss_rows_shared<T, VEC, Store>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)bytes));
        CUDA_CHECK(cudaFuncSetAttribute(k_loss_rows_shared<T, VEC, Store>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        cudaSharedmemCarveoutMaxShared));
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, k_loss_rows_shared<T, VEC, Store>, LOSS_THREADS,
                                                                 bytes));
        fits = blocks >= LOSS_ROWS_SHARED_PER_SM;
    }
    checked_bytes = bytes;
    return fits;
}

/* Launches k_loss_rows_shared<T, VEC, Store> if it fits (loss_rows_shared_fits); returns false, having
 * launched nothing, if not. */
template <typename T, int VEC, typename Store>
static bool loss_rows_shared(float* losses, float* lse, T* logits, const int* targets, int n, int V, int Vp,
                             const float* dscale, Store st) {
    size_t bytes = (size_t)Vp * sizeof(T);
    if (!loss_rows_shared_fits<T, VEC, Store>(bytes)) return false;
    launch_kernel_with_shared(k_loss_rows_shared<T, VEC, Store>, n, LOSS_THREADS, bytes, losses, lse, logits, targets,
                              V, Vp, dscale, st);
    return true;
}

/* k_loss_rows_shared, in packets where the rows allow; false, having launched nothing, where it
 * does not fit (tests/kernel_check.cu checks that it ran at the models' vocabulary in 16 bits). */
template <typename T, typename Store = LossStoreInPlace>
static bool loss_rows_from_shared(float* losses, float* lse, T* logits, const int* targets, int n, int V, int Vp,
                                  const float* dscale, Store st = Store()) {
    return packable(Vp, sizeof(T), {logits})
               ? loss_rows_shared<T, PACK(T), Store>(losses, lse, logits, targets, n, V, Vp, dscale, st)
               : loss_rows_shared<T, 1, Store>(losses, lse, logits, targets, n, V, Vp, dscale, st);
}

/* The loss rows of n rows: from shared memory where the row fits, else from memory; the same bits
 * either way. */
template <typename T, typename Store = LossStoreInPlace>
static void loss_rows(float* losses, float* lse, T* logits, const int* targets, int n, int V, int Vp,
                      const float* dscale, Store st = Store()) {
    if (loss_rows_from_shared(losses, lse, logits, targets, n, V, Vp, dscale, st)) return;
    loss_rows_from_memory(losses, lse, logits, targets, n, V, Vp, dscale, st);
}

/* Evaluation: per-row losses [n] and lse [n] of rows x [n, C]; logits [n, Vp] is scratch. */
template <typename T>
static void loss_fwd(float* losses, float* lse, T* logits, const T* x, const T* wte, const int* targets, int n,
                     int C, int V, int Vp) {
    classifier_logits(logits, x, wte, n, C, Vp);
    loss_rows(losses, lse, logits, targets, n, V, Vp, (const float*)NULL);
}

/* loss_fwd_bwd (below) once the logits are in `logits` (also after the FP8 classifier's logits
 * product with train.fp8_classifier logits, cuda/fp8.cuh): where it applies, the fused backward of
 * classifier_grad.cuh (scratch: its partials, or NULL), which leaves the logits as they are; else the
 * loss rows, which leave dlogits there, then the classifier's two backward products. */
template <typename T>
static void loss_bwd_from_logits(float* losses, float* lse, T* dx, float* dwte, T* logits, const T* x, const T* wte,
                                 const int* targets, int n, int C, int V, int Vp, const float* dscale,
                                 float grad_beta, float* scratch) {
    if (classifier_grad_fused(losses, lse, dx, dwte, logits, x, wte, targets, n, C, V, Vp, dscale, grad_beta, scratch))
        return;
    loss_rows(losses, lse, logits, targets, n, V, Vp, dscale);
    /* dwte = dlogits^T @ x + grad_beta * dwte, as linear_dw (the next chunk's logits wait for it);
     * issued first, so that on the side stream it runs beside dx */
    side_product(logits, [&] { gemm(Vp, C, n, mat_t(logits, Vp), mat(x, C), mat(dwte, C), 1.0f, grad_beta); });
    /* dx = dlogits @ wte */
    gemm(n, C, Vp, mat(logits, Vp), mat(wte, C), mat(dx, C));
}

/* Training: as loss_fwd; dx [n, C] = and dwte [Vp, C] (fp32) = / += (by grad_beta) the gradient
 * of these n rows, each row's loss weighted by *dscale (device float: 1/rows-in-the-whole-batch for
 * a mean, times the loss scale for fp16). logits [n, Vp] is scratch (it ends holding dlogits, or the
 * logits after the fused backward); scratch: the fused backward's (classifier_grad.cuh), or NULL. */
template <typename T>
static void loss_fwd_bwd(float* losses, float* lse, T* dx, float* dwte, T* logits, const T* x, const T* wte,
                         const int* targets, int n, int C, int V, int Vp, const float* dscale, float grad_beta,
                         float* scratch) {
    classifier_logits(logits, x, wte, n, C, Vp);
    loss_bwd_from_logits(losses, lse, dx, dwte, logits, x, wte, targets, n, C, V, Vp, dscale, grad_beta, scratch);
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
