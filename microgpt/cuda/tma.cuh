/* tma.cuh: Hopper's asynchronous bulk copies (sm_90a; PTX ISA "cp.async.bulk.tensor" and
 * "mbarrier"): the Tensor Memory Accelerator copies a box of a matrix (or of a vector) between
 * global and shared memory while the threads do other work, and an mbarrier in shared memory says
 * when a load's bytes have landed. The primitives of the warp-specialised kernels (mlp.cuh's
 * GELU-backward product, classifier_grad.cuh's classifier backward) and of the flash attention
 * forward's and dK/dV kernel's tile loads (attention.cuh).
 *
 * An mbarrier counts arrivals (and, for TMA loads, bytes) in phases: a phase completes when its
 * expected arrivals have come and its expected bytes have landed, and the next begins. A thread
 * waits for a phase by its parity, which is sound only while the barrier is at most one phase
 * ahead of the phase waited for: a protocol must keep every waiter within that. A fresh barrier is
 * in phase 0, and a wait on parity 1 (the phase "before" it) returns at once. */
#ifndef MICROGPT_CUDA_TMA_CUH
#define MICROGPT_CUDA_TMA_CUH

#include "common.cuh"
#include <cuda.h> /* CUtensorMap */
#include <cudaTypedefs.h>

/* The mbarrier at shared address bar, expecting `count` arrivals a phase. */
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
/* After a block's barriers are initialised, before any thread or TMA uses them. */
__device__ __forceinline__ void mbar_init_fence(void) {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
/* Waits until the phase of parity `parity` of the mbarrier at bar has completed. */
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    asm volatile("{\n.reg .pred done;\nWAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
/* An arrival that also expects `bytes` more of the phase to land (the TMA loads it counts). */
__device__ __forceinline__ void mbar_arrive_expect_bytes(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

/* Starts loading the box at column x, row y of the tensor map into shared memory at dst; its bytes
 * count on the mbarrier at bar. */
__device__ __forceinline__ void tma_load(unsigned dst, const CUtensorMap* map, int x, int y, unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
            dst),
        "l"((unsigned long long)map), "r"(x), "r"(y), "r"(bar)
        : "memory");
}
/* Starts loading the box at column x, row y, plane z of the three-dimensional tensor map into
 * shared memory at dst; its bytes count on the mbarrier at bar. */
__device__ __forceinline__ void tma_load_3d(unsigned dst, const CUtensorMap* map, int x, int y, int z, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, "
                 "%4}], [%5];\n" ::"r"(dst),
                 "l"((unsigned long long)map), "r"(x), "r"(y), "r"(z), "r"(bar)
                 : "memory");
}
/* Starts loading the box at element x of the one-dimensional tensor map into shared memory at dst
 * (128-byte aligned); its bytes count on the mbarrier at bar. */
__device__ __forceinline__ void tma_load_1d(unsigned dst, const CUtensorMap* map, int x, unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2}], [%3];\n" ::"r"(
            dst),
        "l"((unsigned long long)map), "r"(x), "r"(bar)
        : "memory");
}
/* Starts storing shared memory at src into the box at column x, row y of the tensor map. The
 * thread's stores since its last tma_store_commit form one group; tma_store_wait_read waits until
 * every committed group has read its shared memory, tma_store_wait until every one has written. */
__device__ __forceinline__ void tma_store(const CUtensorMap* map, int x, int y, unsigned src) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                     (unsigned long long)map),
                 "r"(x), "r"(y), "r"(src)
                 : "memory");
}
__device__ __forceinline__ void tma_store_commit(void) { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void tma_store_wait_read(void) {
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
__device__ __forceinline__ void tma_store_wait(void) { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
/* Shared-memory writes of this thread made visible to the TMA's (and the tensor cores') reads. */
__device__ __forceinline__ void fence_shared_for_async(void) {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/* A tensor map of `rank` dimensions (dims, strides between them in bytes, box: the driver's
 * cuTensorMapEncodeTiled, found through the runtime's entry point: no libcuda link); any refusal
 * is fatal. */
static CUtensorMap tma_encode(CUtensorMapDataType type, unsigned rank, const void* p, const cuuint64_t* dims,
                              const cuuint64_t* strides, const cuuint32_t* box, CUtensorMapSwizzle swizzle) {
    static PFN_cuTensorMapEncodeTiled_v12000 encode = NULL;
    if (!encode) {
        cudaDriverEntryPointQueryResult found;
#if CUDART_VERSION >= 12050
        CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", (void**)&encode, 12000, cudaEnableDefault,
                                                    &found));
#else
        CUDA_CHECK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", (void**)&encode, cudaEnableDefault, &found));
#endif
        if (found != cudaDriverEntryPointSuccess || !encode)
            cuda_fail("cudaGetDriverEntryPoint(cuTensorMapEncodeTiled)", "not in this driver", __FILE__, __LINE__);
    }
    CUtensorMap map;
    cuuint32_t elem_strides[3] = {1, 1, 1};
    if (rank > 3) cuda_fail("tma_encode", "a map of more than three dimensions", __FILE__, __LINE__);
    CUresult r = encode(&map, type, rank, (void*)p, dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                        swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) cuda_fail("cuTensorMapEncodeTiled", "refused the tensor map", __FILE__, __LINE__);
    return map;
}

/* The TMA's view of a row-major [rows][cols] bf16 matrix in boxes of box_rows x 64 columns: 128
 * bytes a row, stored with the 128-byte swizzle, the layout the warpgroup products' descriptors
 * name (attention.cuh, fa_wg_desc<64>). The matrix's address must be 16-byte aligned and its rows
 * a multiple of 16 bytes. */
static CUtensorMap tma_map_bf16(const bf16* p, int rows, int cols, int box_rows) {
    cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows}, strides[1] = {(cuuint64_t)cols * sizeof(bf16)};
    cuuint32_t box[2] = {64, (cuuint32_t)box_rows};
    return tma_encode(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, p, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B);
}

/* The TMA's view of n 32-bit values (type: FLOAT32 or INT32) in boxes of `box` values, unswizzled.
 * The address must be 16-byte aligned. */
static CUtensorMap tma_map_words(const void* p, CUtensorMapDataType type, int n, int box) {
    cuuint64_t dims[1] = {(cuuint64_t)n}, strides[1] = {0}; /* a rank-1 map has no strides */
    cuuint32_t boxes[1] = {(cuuint32_t)box};
    return tma_encode(type, 1, p, dims, strides, boxes, CU_TENSOR_MAP_SWIZZLE_NONE);
}

#endif
