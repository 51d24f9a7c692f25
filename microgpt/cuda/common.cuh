/* common.cuh: what every CUDA layer header needs: error checks, the activation types, warp/block
 * reductions and the row-major products over cuBLAS and cuBLASLt.
 *
 * Naming in microgpt/cuda/ (docs/DESIGN.md §3.1, §11): a `k_` name is always a __global__ kernel
 * (`k_<op>_fwd`, `k_<op>_bwd`, and `k_<op>_<part>` where an operation takes several kernels); the
 * host function the engine calls for a layer is `<op>_fwd` / `<op>_bwd`, and launches kernels,
 * products (gemm, below) or both. Each layer header says which plays each named role.
 *
 * All work runs in order on one stream, g_stream (every launch passes it, and cuBLAS is bound to
 * it), so there is no cross-stream synchronisation to get wrong. The engine creates g_stream so
 * that it can capture a whole step in a CUDA graph (the legacy default stream cannot be captured);
 * left 0 it is the legacy default stream. (The one exception: where the layers' products are small,
 * the backward's weight gradients run on a second stream, ordered by events; side_stream.cuh.)
 *
 * Activation type T is float (fp32), __nv_bfloat16 (bf16) or __half (fp16). Whatever T is, every
 * kernel computes in fp32 and rounds once on store; parameter gradients are always fp32.
 *
 * Determinism: no kernel uses floating-point atomics; every reduction has a fixed shape that
 * depends only on the problem size (never on the GPU), each cuBLAS handle has one fixed workspace,
 * and cuBLASLt's algorithm follows a fixed rule over its heuristic's offers or the fixed table
 * (below; never picked by timing). */
#ifndef MICROGPT_CUDA_COMMON_CUH
#define MICROGPT_CUDA_COMMON_CUH

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <initializer_list>
#include <type_traits> /* std::is_same: as_stored2 */
#include <utility>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------- */
/* Error checks: every CUDA/cuBLAS status goes through one of these; a failure is one line with the
 * call, file:line and the library's own error string, then exit 1 (the machine failed, not the
 * input). */

static void cuda_fail(const char* what, const char* err, const char* file, int line) {
    fflush(stdout);
    fprintf(stderr, "error: CUDA failure '%s' in %s at %s:%d\n", err, what, file, line);
    fflush(stderr);
    exit(1);
}

#define CUDA_CHECK(call)                                                                   \
    do {                                                                                   \
        cudaError_t cuda_check_err_ = (call);                                              \
        if (cuda_check_err_ != cudaSuccess)                                                \
            cuda_fail(#call, cudaGetErrorString(cuda_check_err_), __FILE__, __LINE__);     \
    } while (0)

#define CUBLAS_CHECK(call)                                                                 \
    do {                                                                                   \
        cublasStatus_t cublas_check_st_ = (call);                                          \
        if (cublas_check_st_ != CUBLAS_STATUS_SUCCESS)                                     \
            cuda_fail(#call, cublasGetStatusString(cublas_check_st_), __FILE__, __LINE__); \
    } while (0)

/* Set ANDREA_CUDA_SYNC=1 to synchronise after every launch, so an asynchronous fault is reported at
 * the launch that caused it rather than at the next synchronising call. */
static int g_sync_launches = -1;
static int sync_launches(void) {
    if (g_sync_launches < 0) {
        const char* s = getenv("ANDREA_CUDA_SYNC");
        g_sync_launches = (s && s[0] == '1') ? 1 : 0;
    }
    return g_sync_launches;
}

/* After every <<<>>> launch: catches bad launch configurations at once (and faults, in sync mode). */
#define LAUNCH_CHECK()                                                 \
    do {                                                               \
        CUDA_CHECK(cudaGetLastError());                                \
        if (sync_launches()) CUDA_CHECK(cudaDeviceSynchronize());      \
    } while (0)

static cudaStream_t g_stream = 0; /* the stream of all work (but the side stream's); see the top of this file */

/* ---------------------------------------------------------------------------------------------- */
/* Launches. Every engine kernel goes through launch_kernel (launch_kernel_with_shared where it has
 * dynamic shared memory), on g_stream, its status checked.
 *
 * Programmatic dependent launch (compute capability 9.0+, kernels compiled for it; docs/DESIGN.md
 * §9): the launch carries cudaLaunchAttributeProgrammaticStreamSerialization, so the kernel's
 * blocks may be scheduled while the kernel before it on the stream is still finishing (stream
 * capture turns this into a programmatic edge of the graph). What makes that safe is
 * await_previous_kernel, the first statement of every engine kernel: griddepcontrol.wait returns
 * once the previous kernel has completed and its writes are visible, so no kernel touches global
 * memory before its predecessor is done, whatever it reads or writes. (No kernel has a prologue
 * worth running before the wait: index math and shared-memory declarations cost nanoseconds, while
 * "first statement" is a rule tests/test_cuda_launches.py checks by reading.) Every kernel launched this
 * way must wait (one that did not could complete before its predecessor, and then its successor's
 * wait would not cover the predecessor's writes); the kernels launched with <<<>>> outside the
 * engine (kernel_check's and bench's own) are ordinary launches and need not.
 *
 * Right after its wait a kernel lets its dependents launch (griddepcontrol.launch_dependents): the
 * next kernel's blocks then take the SM slots this kernel's last wave frees, instead of waiting for
 * every block to exit. It cannot slow this kernel: the trigger counts only once every block of this
 * grid has run it, so all of this grid's blocks are already resident, and the next kernel's blocks
 * park in their own wait. Nor can it run ahead further: the next kernel's trigger comes after its
 * wait, so at most one kernel is early.
 *
 * Below 9.0 the launch has no attribute and the wait is compiled out: the launches are those of
 * <<<>>>. cuBLAS and cuBLASLt launch their own kernels without the attribute (cuBLASLt 13.0 has
 * no setting for it), so a product starts only when the kernel before it has completed; a kernel
 * after a product waits for it as after any kernel. */
__device__ __forceinline__ void await_previous_kernel(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* Never launched: the code the device runs for it was compiled for the architecture every kernel's
 * was (one set of -gencode options), which pdl_enabled reads. */
__global__ void k_pdl_probe(void) {
    await_previous_kernel();
}

/* Whether launches carry the programmatic attribute (asked once): on a 9.0+ device, running code
 * compiled for 9.0+. The last is not implied by the device: PTX of an older architecture,
 * JIT-compiled for this one, has no wait in its kernels, and launched programmatically they would
 * race. */
static bool pdl_enabled(void) {
    static int on = -1;
    if (on < 0) {
        int dev, major = 0;
        cudaFuncAttributes probe;
        CUDA_CHECK(cudaGetDevice(&dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
        CUDA_CHECK(cudaFuncGetAttributes(&probe, k_pdl_probe));
        on = major >= 9 && probe.ptxVersion >= 90;
    }
    return on;
}

/* kernel<<<grid, block, shared_bytes, g_stream>>>(args...), programmatic where pdl_enabled(), checked. */
template <typename... Params, typename... Args>
static void launch_kernel_with_shared(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                                      Args&&... args) {
    cudaLaunchAttribute programmatic;
    programmatic.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    programmatic.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = shared_bytes;
    cfg.stream = g_stream;
    cfg.attrs = &programmatic;
    cfg.numAttrs = pdl_enabled() ? 1 : 0;
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
    if (sync_launches()) CUDA_CHECK(cudaDeviceSynchronize());
}

/* The same without dynamic shared memory: every kernel but one variant's. */
template <typename... Params, typename... Args>
static void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, Args&&... args) {
    launch_kernel_with_shared(kernel, grid, block, 0, std::forward<Args>(args)...);
}

static inline __host__ __device__ unsigned ceil_div(size_t a, size_t b) { return (unsigned)((a + b - 1) / b); }

/* bytes rounded up to a multiple of 256: the alignment of every device buffer the engine carves out
 * (microgpt_cuda.cu's memory plan) and of the arrays inside a scratch buffer (embed.cuh). */
static inline size_t align_256(size_t bytes) { return (bytes + 255) & ~(size_t)255; }

/* Grid size for element-wise kernels over n elements with grid-stride loops: enough blocks to fill
 * any current GPU, never so many that the count overflows. */
static inline unsigned elementwise_grid(size_t n, int block) {
    size_t g = (n + (size_t)block - 1) / (size_t)block;
    if (g > 65535u * 8u) g = 65535u * 8u;
    return (unsigned)(g ? g : 1);
}

/* dst[i] = src[i] for n 32-bit words, where either side may be pinned host memory (cudaMallocHost's,
 * which kernels address directly through the unified address space): what the engine's graphs
 * upload and hand back on each replay, as a kernel rather than a copy-engine node, so that a step
 * never waits for another engine between its kernels (docs/BENCHMARKS.md #130). */
__global__ void k_copy_words(unsigned* dst, const unsigned* src, int n) {
    await_previous_kernel();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) dst[i] = src[i];
}

/* `bytes` (a multiple of 4) from src to dst by k_copy_words, on g_stream. */
static void copy_words(void* dst, const void* src, size_t bytes) {
    if (bytes % 4) cuda_fail("copy_words", "not a whole number of 32-bit words", __FILE__, __LINE__);
    int n = (int)(bytes / 4);
    launch_kernel(k_copy_words, elementwise_grid(n, 256), 256, (unsigned*)dst, (const unsigned*)src, n);
}

/* ---------------------------------------------------------------------------------------------- */
/* Activation types */

typedef __nv_bfloat16 bf16;
typedef __half fp16;

__host__ __device__ __forceinline__ float to_f(float x) { return x; }
__host__ __device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
__host__ __device__ __forceinline__ float to_f(fp16 x) { return __half2float(x); }

/* Round-to-nearest-even conversion from fp32. */
template <typename T> __host__ __device__ __forceinline__ T from_f(float x);
template <> __host__ __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __host__ __device__ __forceinline__ bf16 from_f<bf16>(float x) { return __float2bfloat16(x); }
template <> __host__ __device__ __forceinline__ fp16 from_f<fp16>(float x) { return __float2half(x); }

template <typename T> struct TypeInfo;
template <> struct TypeInfo<float> { static constexpr cudaDataType_t dtype = CUDA_R_32F; static const char* name() { return "fp32"; } };
template <> struct TypeInfo<bf16> { static constexpr cudaDataType_t dtype = CUDA_R_16BF; static const char* name() { return "bf16"; } };
template <> struct TypeInfo<fp16> { static constexpr cudaDataType_t dtype = CUDA_R_16F; static const char* name() { return "fp16"; } };

/* ---------------------------------------------------------------------------------------------- */
/* Packed access. The element-wise and row kernels move VEC consecutive elements per thread:
 * VEC = PACK<T> (16 bytes: 8 bf16/fp16 or 4 fp32) as one 128-bit load or store where the row
 * length and the pointers allow it, VEC = 1 (element by element) otherwise. The launchers pick
 * with packable(); both forms are instantiated and checked (tests/kernel_check.cu has shapes of
 * each kind). Values are converted to fp32 on load and rounded once on store, as everywhere. */

template <typename T> struct Pack { static constexpr int n = 16 / (int)sizeof(T); };
#define PACK(T) (Pack<T>::n)

/* A candidate, off (docs/BENCHMARKS.md #180): load_vec unpacks a bf16 packet by a shift or a mask a
 * value, where CUDA's conversion of each extracted half takes a PRMT and a shift for every upper
 * half; the same floats, fewer instructions in every kernel that loads bf16 packets. */
#ifndef BF16_UNPACK_SHIFT
#define BF16_UNPACK_SHIFT 0
#endif

template <int VEC, typename T>
__device__ __forceinline__ void load_vec(float (&f)[VEC], const T* p) {
    if constexpr (VEC % PACK(T) == 0) {
#pragma unroll
        for (int q = 0; q < VEC / PACK(T); q++) {
            int4 raw = reinterpret_cast<const int4*>(p)[q];
#if BF16_UNPACK_SHIFT
            if constexpr (std::is_same<T, bf16>::value) {
                /* a bf16 is the upper half of its fp32: one shift or one mask a value (the
                 * conversion's PRMT and shift took three instructions a pair; the same bits) */
                unsigned w[PACK(T) / 2];
                memcpy(w, &raw, sizeof raw);
#pragma unroll
                for (int k = 0; k < PACK(T) / 2; k++) {
                    f[q * PACK(T) + 2 * k] = __uint_as_float(w[k] << 16);
                    f[q * PACK(T) + 2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
                }
                continue;
            }
#endif
            const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
            for (int k = 0; k < PACK(T); k++) f[q * PACK(T) + k] = to_f(e[k]);
        }
    } else {
#pragma unroll
        for (int k = 0; k < VEC; k++) f[k] = to_f(p[k]);
    }
}

template <int VEC, typename T>
__device__ __forceinline__ void store_vec(T* p, const float (&f)[VEC]) {
    if constexpr (VEC % PACK(T) == 0) {
#pragma unroll
        for (int q = 0; q < VEC / PACK(T); q++) {
            int4 raw;
            T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
            for (int k = 0; k < PACK(T); k++) e[k] = from_f<T>(f[q * PACK(T) + k]);
            reinterpret_cast<int4*>(p)[q] = raw;
        }
    } else {
#pragma unroll
        for (int k = 0; k < VEC; k++) p[k] = from_f<T>(f[k]);
    }
}

/* Whether rows of `len` elements of width `elem` bytes at these pointers can be read in 16-byte
 * packets: every row starts 16-byte aligned. */
static inline bool packable(size_t len, size_t elem, std::initializer_list<const void*> ptrs) {
    if ((len * elem) % 16) return false;
    for (const void* p : ptrs)
        if ((uintptr_t)p % 16) return false;
    return true;
}

/* Grid-stride loop over the VEC-element packets of n elements (n a multiple of VEC). */
#define FOR_PACKETS(i, n)                                                                   \
    for (size_t i = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) * VEC; i < (n);        \
         i += (size_t)gridDim.x * blockDim.x * VEC)

/* Launches kernel<T, PACK(T)> when `packed` holds, else kernel<T, 1>, on g_stream, and checks it. */
#define LAUNCH_PACKED(packed, kernel, T, grid, block, ...)                                  \
    do {                                                                                    \
        if (packed) launch_kernel(kernel<T, PACK(T)>, (grid), (block), __VA_ARGS__);        \
        else launch_kernel(kernel<T, 1>, (grid), (block), __VA_ARGS__);                     \
    } while (0)

/* The same for an element-wise kernel over n elements, FOR_PACKETS inside: 256-thread blocks. */
#define LAUNCH_PACKED_ELEMENTWISE(packed, kernel, T, n, ...) \
    LAUNCH_PACKED(packed, kernel, T, elementwise_grid((n) / ((packed) ? PACK(T) : 1), 256), 256, __VA_ARGS__)

/* ---------------------------------------------------------------------------------------------- */
/* Reductions. Butterfly (xor) shuffles: every lane ends with the same bits, because each step adds
 * the same two values in either order, and fp addition is commutative. */

__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

__device__ __forceinline__ double warp_sum_d(double x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

__device__ __forceinline__ float warp_max(float x) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

/* Reduction over the whole block (blockDim.x a multiple of 32, at most 1024) with the warp
 * reduction `warp_op` and its identity; every thread gets the result. The leading barrier lets a
 * kernel call it several times with the one shared array. */
template <float (*warp_op)(float)>
__device__ __forceinline__ float block_reduce(float x, float identity) {
    __shared__ float partial[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    x = warp_op(x);
    __syncthreads();
    if (lane == 0) partial[warp] = x;
    __syncthreads();
    return warp_op(lane < n_warps ? partial[lane] : identity);
}
__device__ __forceinline__ float block_sum(float x) { return block_reduce<warp_sum>(x, 0.0f); }
__device__ __forceinline__ float block_max(float x) { return block_reduce<warp_max>(x, -INFINITY); }

/* Precision fp8's amax (docs/DESIGN.md §18), fused into kernels that produce an FP8 product's
 * operand. The amax is the maximum of the fp32 bit patterns of |x| over the values as stored (in
 * the activation type: as_stored): for non-negative floats the order of the patterns is the order
 * of the values, and a NaN's pattern is above infinity's. */
template <typename T> __device__ __forceinline__ float as_stored(float x) { return to_f(from_f<T>(x)); }
__device__ __forceinline__ unsigned abs_bits(float x) { return __float_as_uint(x) & 0x7FFFFFFFu; }
/* x and y as stored in T (as_stored of each), the pair in one conversion instruction. */
template <typename T> __device__ __forceinline__ float2 as_stored2(float x, float y) {
    if constexpr (std::is_same<T, bf16>::value) return __bfloat1622float2(__floats2bfloat162_rn(x, y));
    else if constexpr (std::is_same<T, fp16>::value) return __half22float2(__floats2half2_rn(x, y));
    else return make_float2(x, y);
}

/* Blocks of a kernel that ends in block_amax_commit: enough to fill the GPU, few enough that the
 * atomics on the one address stay cheap. */
#define AMAX_MAX_BLOCKS 1024u
static inline unsigned amax_grid(unsigned grid, const unsigned* amax_bits) {
    return amax_bits && grid > AMAX_MAX_BLOCKS ? AMAX_MAX_BLOCKS : grid;
}

/* The block's maximum of every thread's m into *amax_bits: one integer atomicMax per block. The
 * maximum does not depend on the order, so the result is deterministic. Every thread of the block
 * calls it (blockDim.x a multiple of 32); amax_bits NULL: nothing. `partial`: 32 unsigned of
 * shared memory (a kernel whose shared memory is full lends some; the leading barrier makes that
 * safe). */
__device__ __forceinline__ void block_amax_commit_in(unsigned* amax_bits, unsigned m, unsigned* partial) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    if (!amax_bits) return;
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    __syncthreads();
    if (lane == 0) partial[warp] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < n_warps; w++) m = max(m, partial[w]);
        if (m) atomicMax(amax_bits, m); /* 0 changes nothing */
    }
}

__device__ __forceinline__ void block_amax_commit(unsigned* amax_bits, unsigned m) {
    __shared__ unsigned partial[32];
    block_amax_commit_in(amax_bits, m, partial);
}

/* ---------------------------------------------------------------------------------------------- */
/* cuBLAS: one handle, one explicit workspace (so the library never allocates behind our back and
 * picks the same kernels every run), fp32 accumulation everywhere. The compute type is fp32
 * (bf16/fp16 inputs use tensor cores with fp32 accumulation; fp32 inputs are multiplied in full
 * fp32) unless gemm_set_tf32 turns on TF32 tensor-core math for fp32 inputs (precision tf32). */

#define CUBLAS_WORKSPACE_BYTES ((size_t)32 << 20)

static cublasHandle_t g_cublas = NULL;
static cublasLtHandle_t g_cublaslt = NULL;
static void* g_gemm_workspace = NULL; /* shared by both libraries on g_stream (the side stream has its own) */
static size_t g_gemm_workspace_bytes = 0;
static cublasComputeType_t g_lt_compute = CUBLAS_COMPUTE_32F;

static void cublas_init(void* workspace, size_t bytes) {
    if (!g_cublas) CUBLAS_CHECK(cublasCreate(&g_cublas));
    if (!g_cublaslt) CUBLAS_CHECK(cublasLtCreate(&g_cublaslt));
    CUBLAS_CHECK(cublasSetMathMode(g_cublas, CUBLAS_DEFAULT_MATH));
    CUBLAS_CHECK(cublasSetStream(g_cublas, g_stream));
    CUBLAS_CHECK(cublasSetWorkspace(g_cublas, workspace, bytes));
    g_gemm_workspace = workspace;
    g_gemm_workspace_bytes = bytes;
    g_lt_compute = CUBLAS_COMPUTE_32F;
}

/* Precision tf32: fp32 inputs multiplied on tensor cores in TF32, in both libraries. */
static void gemm_set_tf32(void) {
    CUBLAS_CHECK(cublasSetMathMode(g_cublas, CUBLAS_TF32_TENSOR_OP_MATH));
    g_lt_compute = CUBLAS_COMPUTE_32F_FAST_TF32;
}

static void lt_plans_clear(void);

static void cublas_shutdown(void) {
    lt_plans_clear();
    if (g_cublaslt) CUBLAS_CHECK(cublasLtDestroy(g_cublaslt));
    if (g_cublas) CUBLAS_CHECK(cublasDestroy(g_cublas));
    g_cublaslt = NULL;
    g_cublas = NULL;
}

/* ---------------------------------------------------------------------------------------------- */
/* Products. Row-major, batched with strides (batch 1: one product):
 *     D[M,N] = epilogue(alpha * op(A)[M,K] * op(B)[K,N] + beta * C)
 * Each operand is a Mat: where it is, its type, its leading dimension, the distance between the
 * matrices of a batch, and whether the product uses it transposed (A is stored [M,K], or [K,M]
 * when transposed; B [K,N], or [N,K]). A call site then reads as the formula it computes:
 *     gemm(N, C, C, mat(x, C), mat_t(w, C), mat(y, C))            y[N,C] = x[N,C] @ w[C,C]^T
 * Both libraries are column-major, and a row-major matrix is its column-major transpose, so they
 * are asked for D^T = op(B)^T op(A)^T: the operands swap places and keep their own transposes.
 *
 * 16-bit inputs go through cuBLASLt (below), fp32 inputs (precisions fp32 and tf32) through cuBLAS.
 * cuBLASLt also runs what follows a linear layer's product in the product's epilogue, so the
 * result is written once instead of being written, read back and rewritten by a separate kernel
 * (gemm_fused):
 *   GEMM_RESIDUAL  D = A B + R             R: an input of D's shape (the residual join), not D itself
 *   GEMM_GELU_AUX  D = gelu(A B), AUX = A B  (the MLP's first product; AUX: the saved pre-activation)
 *   GEMM_DGELU     D = (A B) * gelu'(AUX)  (the MLP backward through its GELU)
 * AUX has D's shape and leading dimension. cuBLASLt's GELU is the tanh form, the one
 * microgpt/cpu/gelu.h computes (tests/kernel_check.cu compares them). Not every type, shape and
 * alignment has a fused kernel (AUX's rows must be a multiple of 8 elements, for one): gemm_fused
 * then returns false and the caller runs the unfused product and kernel.
 *
 * The algorithm is a fixed rule over the heuristic's first LT_CANDIDATES offers, never a choice by
 * timing, so every step and every run of a problem takes the same kernel: the first offer, except
 * that a 16-bit output big enough for LT_FILL_WAVES waves of 128×128 tiles on this GPU takes the
 * first 128×128 offer: for the large 16-bit products the heuristic's first offer is often a tile
 * shape that runs slower than its 128×128 one. The offers and their speeds were probed with
 * bench/lt_algos.cu; the figures are in docs/BENCHMARKS.md.
 *
 * A product named in the fixed table (lt_table.h, lt_table_sm90.h: measured offline by
 * bench/lt_algos.cu on an H200) runs the table's configuration instead, on a GPU of compute
 * capability 9.0 with the table's device name, multiprocessor count and cuBLASLt version, when
 * cuBLASLt accepts it for the problem (cublasLtMatmulAlgoCheck), its workspace fits the engine's
 * and the operands' alignments meet its minimums; anything else keeps the rule. The table is data
 * fixed at build time, so the choice is still the same on every run (docs/DESIGN.md §3.5). */

enum GemmEpilogue { GEMM_RESIDUAL, GEMM_GELU_AUX, GEMM_DGELU, GEMM_PLAIN };
#define GEMM_N_FUSED GEMM_PLAIN /* the fused epilogues come first */

#define LT_CANDIDATES 8
#define LT_FILL_WAVES 2
/* The side of the output tile a large product runs in (CUBLASLT_MATMUL_TILE_128x128, the rule
 * above): what lt_choose, side_stream_pays and the loss's chunks count in. */
#define GEMM_TILE 128

#ifndef LT_TABLE_HEADER /* another table: -DLT_TABLE_HEADER='"path.h"' -Imicrogpt/cuda (for its lt_table.h) */
#define LT_TABLE_HEADER "lt_table_sm90.h"
#endif
#include LT_TABLE_HEADER

/* One operand of a product, as it lies in memory: row-major, `ld` elements from one row to the
 * next, `stride` elements from one matrix of a batch to the next (0: the same matrix for every
 * batch entry); `trans`: the product reads its transpose. A and B share a type; D's may differ
 * (fp32 for parameter gradients and for the scores and logits a softmax reads). The product
 * writes D through `p`. */
struct Mat {
    const void* p;
    cudaDataType_t type;
    int ld;
    long long stride;
    bool trans;
};

template <typename T> static Mat mat(const T* p, int ld, long long stride = 0) {
    Mat m = {p, TypeInfo<T>::dtype, ld, stride, false};
    return m;
}

/* The same matrix, used transposed. */
template <typename T> static Mat mat_t(const T* p, int ld, long long stride = 0) {
    Mat m = mat(p, ld, stride);
    m.trans = true;
    return m;
}

/* One product: D = alpha op(A) op(B) + beta C, `batch` times. */
struct Gemm {
    int M, N, K, batch;
    Mat A, B, D;
    float alpha, beta;
};

/* Off: gemm_fused always declines (tests/kernel_check.cu checks the unfused path this way). */
static bool g_gemm_fuse = true;
/* Fused products run so far, per epilogue (kernel_check checks that the fused path was taken). */
static long g_gemm_fused_runs[GEMM_N_FUSED] = {};

/* Everything cuBLASLt's choice of algorithm depends on; memcmp-able (built from a zeroed struct). */
struct LtKey {
    int ta, tb, M, N, K, lda, ldb, ldd, batch, epilogue, ab_type, d_type, compute;
    int sm_target; /* the multiprocessors it is planned for (g_lt_sm_target); 0: all */
    long long stride_a, stride_b, stride_d;
    unsigned align_a, align_b, align_c, align_d, align_aux;
};

#define LT_NAME_MAX 128

/* A problem's descriptors and algorithm, made once (descriptor creation and the heuristic cost
 * microseconds of host time; the captured step does not pay them, uncaptured calls would). */
struct LtPlan {
    LtKey key;
    bool ok; /* an algorithm exists */
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, d;
    unsigned align[4];           /* of cuBLASLt's A, B, C, D (our B, A, C, D), in bytes */
    char name[LT_NAME_MAX];      /* lt_key_name: the fixed table's key */
    cublasLtMatmulAlgo_t rule;   /* the rule's choice */
    cublasLtMatmulAlgo_t algo;   /* what runs: the fixed table's where it applies, else the rule's */
    size_t workspace;            /* the workspace bytes each call passes: lt_call_workspace of algo */
};

#define LT_MAX_PLANS 256
static LtPlan g_lt_plans[LT_MAX_PLANS];
static int g_lt_n_plans = 0;

static void lt_plan_destroy(LtPlan* p) {
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p->a));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p->b));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p->d));
    CUBLAS_CHECK(cublasLtMatmulDescDestroy(p->desc));
}

static void lt_plans_clear(void) {
    for (int i = 0; i < g_lt_n_plans; i++) lt_plan_destroy(&g_lt_plans[i]);
    g_lt_n_plans = 0;
}

/* The multiprocessors cuBLASLt's heuristic is told a product may have
 * (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET), 0 for all: side_stream.cuh sets it for the weight
 * gradients it runs beside the input gradients where the fixed table does not apply (docs/DESIGN.md
 * §9), so that their kernels are planned for part of the GPU instead of all of it. Part of every
 * plan's key: a product gets its own plan on each stream. */
static int g_lt_sm_target = 0;

/* Gives a plan's descriptor its key's multiprocessor count, where one is set. */
static void lt_desc_sm_target(cublasLtMatmulDesc_t desc, int sm_target) {
    int32_t n = sm_target;
    if (n) CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &n, sizeof n));
}

/* The largest power of two up to 256 that divides the address (cuBLASLt's alignment classes). */
static unsigned lt_alignment(const void* p) {
    unsigned a = 256;
    while (a > 1 && (uintptr_t)p % a) a >>= 1;
    return a;
}

/* A row-major [rows, cols] matrix (leading dimension ld) as cuBLASLt sees it: column-major
 * [cols, rows]; with batch > 1, batch of them `stride` elements apart. */
static cublasLtMatrixLayout_t lt_layout(cudaDataType_t type, int rows, int cols, int ld, int batch = 1,
                                        long long stride = 0) {
    cublasLtMatrixLayout_t l;
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, type, (uint64_t)cols, (uint64_t)rows, ld));
    if (batch > 1) {
        int32_t n = batch;
        int64_t s = stride;
        CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &n, sizeof n));
        CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &s, sizeof s));
    }
    return l;
}

static void lt_set_desc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const void* v, size_t n) {
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attr, v, n));
}

static void lt_set_pref(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr, uint32_t v) {
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &v, sizeof v));
}

/* Multiprocessors of the current device (asked once). */
static int lt_sm_count(void) {
    static int n = 0;
    if (!n) {
        int dev;
        CUDA_CHECK(cudaGetDevice(&dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    }
    return n;
}

/* The rule at the top of this section, over the heuristic's offers res[0 .. n). */
static int lt_choose(const LtKey* key, const cublasLtMatmulHeuristicResult_t* res, int n) {
    bool out16 = key->d_type == CUDA_R_16BF || key->d_type == CUDA_R_16F;
    long long tiles = (long long)((key->M + GEMM_TILE - 1) / GEMM_TILE) * ((key->N + GEMM_TILE - 1) / GEMM_TILE) *
                      key->batch;
    if (!out16 || tiles < (long long)LT_FILL_WAVES * lt_sm_count()) return 0;
    for (int i = 0; i < n; i++) {
        int tile = 0;
        size_t got;
        CUBLAS_CHECK(cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile,
                                                          sizeof tile, &got));
        if (tile == CUBLASLT_MATMUL_TILE_128x128) return i;
    }
    return 0;
}

/* The heuristic's first offers (up to n, *found of them) for the descriptors of p, with the fixed
 * workspace and the operands' alignments p->align. */
static cublasStatus_t lt_heuristic(const LtPlan* p, int n, cublasLtMatmulHeuristicResult_t* res, int* found) {
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t ws = g_gemm_workspace_bytes;
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    lt_set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, p->align[0]);
    lt_set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, p->align[1]);
    lt_set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, p->align[2]);
    lt_set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, p->align[3]);
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(g_cublaslt, p->desc, p->a, p->b, p->d, p->d, pref, n, res, found);
    CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
    return st;
}

static const char* lt_type_name(cudaDataType_t t) {
    switch (t) {
    case CUDA_R_32F: return "fp32";
    case CUDA_R_16BF: return "bf16";
    case CUDA_R_16F: return "fp16";
    case CUDA_R_8F_E4M3: return "e4m3";
    case CUDA_R_8F_E5M2: return "e5m2";
    default: return "type?";
    }
}

static const char* const g_gemm_epilogue_names[GEMM_PLAIN + 1] = {"residual", "gelu_aux", "dgelu", "plain"};

/* The name of a product in the fixed table (lt_table.h), one token: the types of A, B and D, the
 * epilogue, whether A and B are transposed, M x N x K, the leading dimensions of A, B, D, and, for
 * a batch, its size and the three strides. For example bf16.bf16.bf16.gelu_aux.nn.8192x3072x768.ld768.3072.3072 */
static void lt_key_name(char* out, cudaDataType_t a, cudaDataType_t b, cudaDataType_t d, const char* epilogue, bool ta,
                        bool tb, int M, int N, int K, int lda, int ldb, int ldd, int batch, long long sa, long long sb,
                        long long sd) {
    int n = snprintf(out, LT_NAME_MAX, "%s.%s.%s.%s.%c%c.%dx%dx%d.ld%d.%d.%d", lt_type_name(a), lt_type_name(b),
                     lt_type_name(d), epilogue, ta ? 't' : 'n', tb ? 't' : 'n', M, N, K, lda, ldb, ldd);
    if (batch > 1 && n > 0 && n < LT_NAME_MAX)
        snprintf(out + n, LT_NAME_MAX - n, ".b%d.s%lld.%lld.%lld", batch, sa, sb, sd);
}

/* Whether the fixed table was measured on a GPU of this model, with this cuBLASLt (asked once). */
static bool lt_table_applies(void) {
    static int applies = -1;
    if (applies < 0) {
        int dev;
        cudaDeviceProp prop;
        CUDA_CHECK(cudaGetDevice(&dev));
        CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
        applies = prop.major == 9 && prop.minor == 0 && strcmp(prop.name, LT_TABLE_GPU_NAME) == 0 &&
                  lt_sm_count() == LT_TABLE_SM_COUNT && cublasLtGetVersion() == (size_t)LT_TABLE_CUBLASLT_VERSION;
    }
    return applies == 1;
}

static bool lt_config_set(cublasLtMatmulAlgo_t* algo, cublasLtMatmulAlgoConfigAttributes_t attr, const void* v,
                          size_t n) {
    return cublasLtMatmulAlgoConfigSetAttribute(algo, attr, v, n) == CUBLAS_STATUS_SUCCESS;
}

/* The table's algorithm for p (by its name) rebuilt into *algo: true when the table has one that
 * cuBLASLt accepts for p's descriptors, with a workspace that fits the engine's and alignment
 * minimums that p's operands meet; false leaves *algo alone. */
static bool lt_fixed_algo(const LtPlan* p, cublasLtMatmulAlgo_t* algo) {
    if (!lt_table_applies()) return false;
    const LtTableEntry* e = lt_table_find(g_lt_table, p->name);
    if (!e) return false;
    cublasComputeType_t compute;
    cudaDataType_t scale, type[4]; /* cuBLASLt's A, B, C (= D's layout), D */
    size_t got;
    CUBLAS_CHECK(cublasLtMatmulDescGetAttribute(p->desc, CUBLASLT_MATMUL_DESC_COMPUTE_TYPE, &compute, sizeof compute, &got));
    CUBLAS_CHECK(cublasLtMatmulDescGetAttribute(p->desc, CUBLASLT_MATMUL_DESC_SCALE_TYPE, &scale, sizeof scale, &got));
    const cublasLtMatrixLayout_t layouts[4] = {p->a, p->b, p->d, p->d};
    for (int i = 0; i < 4; i++)
        CUBLAS_CHECK(cublasLtMatrixLayoutGetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_TYPE, &type[i], sizeof type[i], &got));
    cublasLtMatmulAlgo_t a;
    if (cublasLtMatmulAlgoInit(g_cublaslt, compute, scale, type[0], type[1], type[2], type[3], e->algo_id, &a) !=
        CUBLAS_STATUS_SUCCESS)
        return false;
    uint32_t tile = e->tile, stages = e->stages, reduction = e->reduction, swizzle = e->swizzle, custom = e->custom;
    int32_t splitk = e->splitk;
    uint16_t inner = (uint16_t)e->inner_shape, cluster = (uint16_t)e->cluster_shape;
    if (!lt_config_set(&a, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile) ||
        !lt_config_set(&a, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof stages) ||
        !lt_config_set(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof splitk) ||
        !lt_config_set(&a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &reduction, sizeof reduction) ||
        !lt_config_set(&a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swizzle, sizeof swizzle) ||
        !lt_config_set(&a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &custom, sizeof custom) ||
        !lt_config_set(&a, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, &inner, sizeof inner) ||
        !lt_config_set(&a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof cluster))
        return false;
    cublasLtMatmulHeuristicResult_t check;
    if (cublasLtMatmulAlgoCheck(g_cublaslt, p->desc, p->a, p->b, p->d, p->d, &a, &check) != CUBLAS_STATUS_SUCCESS ||
        check.workspaceSize > g_gemm_workspace_bytes)
        return false;
    static const cublasLtMatmulAlgoCapAttributes_t min_align[4] = {
        CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_A_BYTES, CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_C_BYTES, CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4; i++) {
        uint32_t need = 0;
        if (cublasLtMatmulAlgoCapGetAttribute(&a, min_align[i], &need, sizeof need, &got) != CUBLAS_STATUS_SUCCESS ||
            p->align[i] < need)
            return false;
    }
    *algo = a;
    return true;
}

/* A workspace request this small is the tile counter of cuBLASLt's persistent Hopper kernels (4
 * bytes), which it zeroes with a memset before every launch: in the captured step a memset node
 * between two kernels, ~1.5 us in which nothing runs (docs/BENCHMARKS.md #114: ~110 a step at
 * ANDREA-120M bf16, 80 in fp8). Given no workspace, cuBLASLt runs the same tiles statically
 * scheduled (the kernels named "ssched"), each tile's sums as before, without the memset. */
#define LT_TILE_COUNTER_BYTES 16

/* Whether products run beside other work: set by side_stream_init. Then every product keeps the
 * counter and its dynamic scheduler: at ANDREA-12M, the shape that runs a side stream (and whose
 * one product with the counter is the logits'), statically scheduled it measured 4-24 us a step
 * slower, where ANDREA-120M, on one stream, gained 0.15-0.24 ms (#114). */
static bool g_lt_products_share_gpu = false;

/* The workspace bytes a product of plan p passes with `algo`: none where the algorithm asks for no
 * more than the tile counter and products do not share the GPU, else the fixed workspace
 * (split-K's partial sums, or the counter). */
static size_t lt_call_workspace(const LtPlan* p, const cublasLtMatmulAlgo_t* algo) {
    cublasLtMatmulHeuristicResult_t check;
    if (g_lt_products_share_gpu ||
        cublasLtMatmulAlgoCheck(g_cublaslt, p->desc, p->a, p->b, p->d, p->d, algo, &check) != CUBLAS_STATUS_SUCCESS)
        return g_gemm_workspace_bytes;
    return check.workspaceSize <= LT_TILE_COUNTER_BYTES ? 0 : g_gemm_workspace_bytes;
}

/* p's algorithm from its descriptors: the rule (lt_choose over the heuristic's first LT_CANDIDATES
 * offers; rule_key NULL: the heuristic's first offer, asked for alone), then the fixed table where
 * it applies, and the workspace its calls pass. Returns the heuristic's status; p->ok says
 * whether an algorithm exists. */
static cublasStatus_t lt_plan_algo(LtPlan* p, const LtKey* rule_key) {
    cublasLtMatmulHeuristicResult_t res[LT_CANDIDATES];
    int found = 0;
    cublasStatus_t st = lt_heuristic(p, rule_key ? LT_CANDIDATES : 1, res, &found);
    p->ok = st == CUBLAS_STATUS_SUCCESS && found > 0;
    if (!p->ok) return st;
    p->rule = res[rule_key ? lt_choose(rule_key, res, found) : 0].algo;
    p->algo = p->rule;
    lt_fixed_algo(p, &p->algo); /* leaves the rule's where the table does not apply */
    p->workspace = lt_call_workspace(p, &p->algo);
    return st;
}

/* Builds the plan of `key` into p: cuBLASLt computes D^T = op(B)^T op(A)^T, so B is its first
 * operand and A its second. C, when read (beta != 0), has D's layout. */
static void lt_plan_make(LtPlan* p, const LtKey* key, const void* aux) {
    static const cublasLtEpilogue_t epilogues[4] = {CUBLASLT_EPILOGUE_DEFAULT, CUBLASLT_EPILOGUE_GELU_AUX,
                                                    CUBLASLT_EPILOGUE_DGELU, CUBLASLT_EPILOGUE_DEFAULT};
    cudaDataType_t ab = (cudaDataType_t)key->ab_type, dt = (cudaDataType_t)key->d_type;
    cublasOperation_t op_b = key->tb ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = key->ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasLtEpilogue_t epi = epilogues[key->epilogue];
    p->key = *key;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, (cublasComputeType_t)key->compute, CUDA_R_32F));
    lt_set_desc(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_b, sizeof op_b);
    lt_set_desc(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_a, sizeof op_a);
    lt_set_desc(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi);
    lt_desc_sm_target(p->desc, key->sm_target);
    if (aux) {
        int64_t ld_aux = key->ldd;
        lt_set_desc(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux);
        lt_set_desc(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld_aux, sizeof ld_aux);
    }
    p->a = lt_layout(ab, key->tb ? key->N : key->K, key->tb ? key->K : key->N, key->ldb, key->batch, key->stride_b);
    p->b = lt_layout(ab, key->ta ? key->K : key->M, key->ta ? key->M : key->K, key->lda, key->batch, key->stride_a);
    p->d = lt_layout(dt, key->M, key->N, key->ldd, key->batch, key->stride_d);
    p->align[0] = key->align_b, p->align[1] = key->align_a, p->align[2] = key->align_c, p->align[3] = key->align_d;
    lt_key_name(p->name, ab, ab, dt, g_gemm_epilogue_names[key->epilogue], key->ta, key->tb, key->M, key->N, key->K,
                key->lda, key->ldb, key->ldd, key->batch, key->stride_a, key->stride_b, key->stride_d);
    cublasStatus_t st = lt_plan_algo(p, key);
    if (st != CUBLAS_STATUS_NOT_SUPPORTED) CUBLAS_CHECK(st);
}

static LtPlan* lt_plan(const LtKey* key, const void* aux) {
    for (int i = 0; i < g_lt_n_plans; i++)
        if (!memcmp(&g_lt_plans[i].key, key, sizeof *key)) return &g_lt_plans[i];
    if (g_lt_n_plans == LT_MAX_PLANS) lt_plans_clear(); /* only kernel_check's many shapes get here */
    LtPlan* p = &g_lt_plans[g_lt_n_plans++];
    lt_plan_make(p, key, aux);
    return p;
}

/* Called, when set, with every cuBLASLt product before it runs (its plan, operands and C): how
 * bench/lt_algos.cu learns the engine's products from the engine's own calls. NULL in the engine. */
static void (*g_lt_watch)(LtPlan* p, const Gemm& g, const void* C, const void* aux) = NULL;

/* D = epilogue(alpha op(A) op(B) + beta C) through cuBLASLt, as at the top of this section (C, when
 * beta != 0, has D's layout; it may be D itself). Returns false, having done nothing, when
 * cuBLASLt has no algorithm for the problem. */
static bool lt_matmul(const Gemm& g, GemmEpilogue epilogue, const void* C, const void* aux) {
    LtKey key;
    memset(&key, 0, sizeof key);
    key.ta = g.A.trans, key.tb = g.B.trans, key.M = g.M, key.N = g.N, key.K = g.K;
    key.lda = g.A.ld, key.ldb = g.B.ld, key.ldd = g.D.ld;
    key.batch = g.batch, key.stride_a = g.A.stride, key.stride_b = g.B.stride, key.stride_d = g.D.stride;
    key.epilogue = epilogue, key.ab_type = g.A.type, key.d_type = g.D.type, key.compute = g_lt_compute;
    key.sm_target = g_lt_sm_target;
    key.align_a = lt_alignment(g.A.p), key.align_b = lt_alignment(g.B.p), key.align_d = lt_alignment(g.D.p);
    key.align_c = lt_alignment(C), key.align_aux = aux ? lt_alignment(aux) : 0;
    LtPlan* p = lt_plan(&key, aux);
    if (!p->ok) return false;
    if (g_lt_watch) g_lt_watch(p, g, C, aux);
    if (aux) lt_set_desc(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux);
    CUBLAS_CHECK(cublasLtMatmul(g_cublaslt, p->desc, &g.alpha, g.B.p, p->a, g.A.p, p->b, &g.beta, C, p->d,
                                (void*)g.D.p, p->d, &p->algo, g_gemm_workspace, p->workspace, g_stream));
    if (sync_launches()) CUDA_CHECK(cudaDeviceSynchronize());
    return true;
}

/* The plain product D = alpha op(A) op(B) + beta D, batched: cuBLASLt for 16-bit inputs where it
 * has an algorithm, else cuBLAS. */
static void gemm(int M, int N, int K, Mat A, Mat B, Mat D, float alpha = 1.0f, float beta = 0.0f, int batch = 1) {
    Gemm g = {M, N, K, batch, A, B, D, alpha, beta};
    if (A.type != CUDA_R_32F && lt_matmul(g, GEMM_PLAIN, D.p, NULL)) return;
    CUBLAS_CHECK(cublasGemmStridedBatchedEx(g_cublas, B.trans ? CUBLAS_OP_T : CUBLAS_OP_N,
                                            A.trans ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha, B.p, B.type, B.ld,
                                            B.stride, A.p, A.type, A.ld, A.stride, &beta, (void*)D.p, D.type, D.ld,
                                            D.stride, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    if (sync_launches()) CUDA_CHECK(cudaDeviceSynchronize());
}

/* D = epilogue(A B) (+ R, of D's layout, for GEMM_RESIDUAL; aux, of D's layout: the GELU
 * pre-activation, written by GEMM_GELU_AUX, read by GEMM_DGELU), one product, alpha 1. Returns
 * false, having done nothing, when no fused kernel exists for the problem or fusing is off. */
static bool gemm_fused(GemmEpilogue epilogue, int M, int N, int K, Mat A, Mat B, Mat D, const void* R,
                       const void* aux) {
    if (!g_gemm_fuse) return false;
    Gemm g = {M, N, K, 1, A, B, D, 1.0f, R ? 1.0f : 0.0f};
    if (!lt_matmul(g, epilogue, R ? R : D.p, aux)) return false;
    g_gemm_fused_runs[epilogue]++;
    return true;
}

#endif
