/* common.cuh: what every CUDA layer header needs: error checks, the activation types, warp/block
 * reductions and the one row-major GEMM wrapper over cuBLAS.
 *
 * Naming used in microgpt/cuda/: `k_<op>_fwd` / `k_<op>_bwd` are the host-side launchers the engine
 * calls (SPEC §3 names; some launch one __global__ kernel, some a cuBLAS product plus a kernel);
 * `<op>_kernel` are the __global__ kernels themselves. All work runs in order on one stream,
 * g_stream (every launch passes it, and cuBLAS is bound to it), so there is no cross-stream
 * synchronisation to get wrong. The engine creates g_stream so that it can capture a whole step in
 * a CUDA graph (the legacy default stream cannot be captured); left 0, as kernel_check leaves it,
 * it is the legacy default stream.
 *
 * Activation type T is float (fp32), __nv_bfloat16 (bf16) or __half (fp16). Whatever T is, every
 * kernel computes in fp32 and rounds once on store; parameter gradients are always fp32.
 *
 * Determinism: no kernel uses floating-point atomics; every reduction has a fixed shape that
 * depends only on the problem size (never on the GPU), and cuBLAS is given one fixed workspace. */
#ifndef MICROGPT_CUDA_COMMON_CUH
#define MICROGPT_CUDA_COMMON_CUH

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <initializer_list>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

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

static inline unsigned ceil_div(size_t a, size_t b) { return (unsigned)((a + b - 1) / b); }

/* Grid size for element-wise kernels over n elements with grid-stride loops: enough blocks to fill
 * any current GPU, never so many that the count overflows. */
static inline unsigned elementwise_grid(size_t n, int block) {
    size_t g = (n + (size_t)block - 1) / (size_t)block;
    if (g > 65535u * 8u) g = 65535u * 8u;
    return (unsigned)(g ? g : 1);
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

template <int VEC, typename T>
__device__ __forceinline__ void load_vec(float (&f)[VEC], const T* p) {
    if constexpr (VEC % PACK(T) == 0) {
#pragma unroll
        for (int q = 0; q < VEC / PACK(T); q++) {
            int4 raw = reinterpret_cast<const int4*>(p)[q];
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
    do {                                                                                   \
        if (packed) kernel<T, PACK(T)><<<(grid), (block), 0, g_stream>>>(__VA_ARGS__);     \
        else kernel<T, 1><<<(grid), (block), 0, g_stream>>>(__VA_ARGS__);                  \
        LAUNCH_CHECK();                                                                    \
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

/* ---------------------------------------------------------------------------------------------- */
/* cuBLAS: one handle, one explicit workspace (so the library never allocates behind our back and
 * picks the same kernels every run), fp32 accumulation everywhere and no TF32: with
 * CUBLAS_COMPUTE_32F and the default math mode, fp32 inputs are multiplied in full fp32, and
 * bf16/fp16 inputs use tensor cores with fp32 accumulation. */

#define CUBLAS_WORKSPACE_BYTES ((size_t)32 << 20)

static cublasHandle_t g_cublas = NULL;
static cudaStream_t g_stream = 0; /* the one stream of all work; see the top of this file */

static void cublas_init(void* workspace, size_t bytes) {
    if (!g_cublas) CUBLAS_CHECK(cublasCreate(&g_cublas));
    CUBLAS_CHECK(cublasSetMathMode(g_cublas, CUBLAS_DEFAULT_MATH));
    CUBLAS_CHECK(cublasSetStream(g_cublas, g_stream));
    CUBLAS_CHECK(cublasSetWorkspace(g_cublas, workspace, bytes));
}

static void cublas_shutdown(void) {
    if (g_cublas) CUBLAS_CHECK(cublasDestroy(g_cublas));
    g_cublas = NULL;
}

/* Row-major product, batched with strides (batch 1: plain product):
 *     C[M,N] = alpha * op(A)[M,K] * op(B)[K,N] + beta * C
 * A is stored [M,K] (ld lda) or, with ta, [K,M]; B is stored [K,N] or, with tb, [N,K].
 * cuBLAS is column-major, and a row-major matrix is its column-major transpose, so we ask cuBLAS
 * for C^T = op(B)^T op(A)^T: the operands swap places and keep their own transpose flags.
 * ab_type is the type of A and B, c_type that of C (fp32 for parameter gradients and for scores /
 * logits that a softmax reads). */
static void gemm_rm(bool ta, bool tb, int M, int N, int K, float alpha,
                    const void* A, int lda, long long stride_a,
                    const void* B, int ldb, long long stride_b, float beta,
                    void* C, int ldc, long long stride_c, int batch,
                    cudaDataType_t ab_type, cudaDataType_t c_type) {
    CUBLAS_CHECK(cublasGemmStridedBatchedEx(g_cublas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                                            N, M, K, &alpha, B, ab_type, ldb, stride_b, A, ab_type, lda, stride_a,
                                            &beta, C, c_type, ldc, stride_c, batch, CUBLAS_COMPUTE_32F,
                                            CUBLAS_GEMM_DEFAULT));
    if (sync_launches()) CUDA_CHECK(cudaDeviceSynchronize());
}

#endif
