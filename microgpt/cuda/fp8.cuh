/* fp8.cuh: precision fp8 (docs/DESIGN.md §18): the per-tensor casts to FP8 and the FP8 tensor-core
 * products of the linear layers, through cuBLASLt. Nothing here runs in any other precision.
 *
 * A cast is the tensor's amax, then k_fp8_cast, which derives the scale from the amax
 * (cpu/fp8.h's fp8_scale_for_amax, a power of two), casts x * scale with the hardware's
 * round-to-nearest-even, saturating conversion, and writes the inverse scale where the product
 * reads it. The amax comes from k_fp8_amax (fp8_reduce_amax) or, where one of the engine's kernels
 * produces the operand (LayerNorm, GELU, flash attention: common.cuh's block_amax_commit), from
 * that kernel, saving a full read. Every cast has its own Fp8Scale, whose amax is zeroed before
 * (fp8_zero_scales, one memset for many). The weights' casts (all layers) run as one list: one amax launch, one cast
 * launch (fp8_quantize_jobs; after a single-process update AdamW takes the amax instead,
 * optimizer.cuh's k_adamw_amax, and only the cast is launched, fp8_cast_jobs). Current scaling:
 * such a cast uses the amax of the tensor it casts.
 * In training, the layers' activations and activation gradients are cast at a delayed scale
 * instead (Fp8CastJob's hist, k_fp8_history_push; docs/DESIGN.md §18), whose histories are
 * checkpoint state; known beforehand, the scale lets their producers write the codes (the
 * LayerNorm outputs, k_layernorm_fwd_fp8; the GELU output, the cast's GELU variant; the attention
 * output att, the flash attention forward: attn_fwd_fp8; MLP up's output gradient dh, the cast's
 * GELU-backward variant; the residual gradients, the LayerNorm backward: layernorm_bwd_fp8; QKV's
 * output gradient dqkv, the flash attention backward: attn_bwd_fp8).
 *
 * The amax is the maximum of the fp32 bit patterns of |x| (for non-negative floats the order of the
 * patterns is the order of the values), reduced per block and combined with an integer atomicMax:
 * the maximum does not depend on the order, so the result is deterministic.
 *
 * Hopper's FP8 products take both operands K-major ("TN": in row-major terms A [M,K] and B^T
 * [N,K]). So a cast writes the layouts its products need in one pass: `out_n`, the tensor as it is,
 * and `out_t`, its transpose (the weight-gradient products contract over positions, and the forward
 * reads W^T). A tensor may be `batch` [R, Cc] blocks (W_Q, W_K, W_V; dq, dk, dv): out_n is then
 * [R][batch][Cc], the blocks side by side, so that sum_i dqkv_i @ W_i^T is one product with
 * K = 3C, and out_t is [batch][Cc][R].
 *
 * Formats: weights and activations E4M3; activation gradients FP8_GRAD_FMT (cpu/fp8.h), E4M3 by
 * measurement (docs/DESIGN.md §18: per-tensor scaling leaves E5M2's extra range unused, and its
 * one mantissa bit fewer cost ANDREA-120M 1.5 % of validation loss in 2000 steps). Products
 * accumulate in fp32 (the forward's in cuBLASLt's fast-accumulation mode, the backward's without
 * it: FP8_FAST_ACCUM, below) and write bf16 activations or fp32 weight gradients. */
#ifndef MICROGPT_CUDA_FP8_CUH
#define MICROGPT_CUDA_FP8_CUH

#include <cuda_fp8.h>
#include <type_traits> /* std::integral_constant: attn_fp8_fits */

#include "../cpu/fp8.h"
#include "attention.cuh"
#include "common.cuh"
#include "layernorm.cuh"
#include "loss.cuh"
#include "mlp.cuh"
#include "side_stream.cuh"

typedef unsigned char fp8;

/* One cast's scale: its inverse, which the product multiplies by, the scale, and the amax it was
 * derived from (as fp32 bits). cuBLASLt reads `descale` through a scale pointer and refuses the
 * product (CUBLAS_STATUS_NOT_SUPPORTED, cuBLASLt 13.1 on sm_90) when that pointer sits 4 bytes past
 * an aligned address; so descale comes first and every Fp8Scale is 16-byte aligned (an array of
 * them in a 256-byte aligned buffer keeps each one so). fp8_gemm checks it. */
struct __align__(16) Fp8Scale {
    float descale;
    float scale;
    unsigned amax_bits;
};
#define FP8_SCALE_ALIGN 16

#define FP8_AMAX_BLOCK 256
#define FP8_TILE 64        /* the unpacked cast's tile: 64 x 64 elements through shared memory */
#define FP8_CAST_THREADS 256
#define FP8_ROW_PACKET 8   /* elements of a row a thread casts at once: one 16-byte load of bf16, one
                              8-byte store of codes */
#define FP8_COL_PACKET 16  /* elements of a transposed row a thread writes at once: one 16-byte store */

/* One cast: `batch` blocks [R, Cc] of `in` into out_n / out_t (layouts at the top of the file; either
 * may be NULL) in format fmt, at the scale of the amax in sc, which receives the scale. A launch
 * does one (fp8_cast) or several, listed on the device (fp8_quantize_jobs: the weights). */
template <typename T> struct Fp8CastJob {
    const T* in;
    fp8 *out_n, *out_t;
    Fp8Scale* sc;
    int batch, R, Cc, fmt;
    unsigned first_tile; /* in a list: the tiles of the jobs before it (its first block of the cast) */
    const Fp8History* hist; /* delayed scaling: the scale from this history, NULL: current */
    const T* aux;           /* FP8_EPI_DGELU only: the GELU's input h, of in's shape */
};

/* What the cast computes of each value before casting it (fp8_cast_tile): the value itself, or
 * (delayed scaling only, docs/DESIGN.md §18) as stored in T, with its amax to j.sc, gelu(in) (the
 * GELU forward, as k_gelu_fwd stores it) or in * gelu'(aux) (the GELU backward, as
 * k_gelu_bwd_inplace stores it: in the gradient of the GELU's output, aux its input h). */
enum { FP8_EPI_NONE, FP8_EPI_GELU, FP8_EPI_DGELU };

static unsigned fp8_cast_unpacked_tiles(int batch, int R, int Cc) {
    return ceil_div(Cc, FP8_TILE) * ceil_div(R, FP8_TILE) * (unsigned)batch;
}

/* Lane-local amax bits of n values (VEC-element packets, grid-stride over blockIdx.x / gridDim.x). */
template <typename T, int VEC> __device__ __forceinline__ unsigned fp8_amax_bits_of(const T* __restrict__ x, size_t n) {
    unsigned m = 0;
    FOR_PACKETS(i, n) {
        float v[VEC];
        load_vec(v, x + i);
        for (int k = 0; k < VEC; k++) m = max(m, abs_bits(v[k]));
    }
    return m;
}

/* The standalone amax, for operands no kernel of ours produces with the amax fused (the weights;
 * attention's output and dq, dk, dv on its cuBLAS path): 16-byte packets, at most AMAX_MAX_BLOCKS
 * blocks. */
template <typename T, int VEC>
__global__ void k_fp8_amax(unsigned* __restrict__ amax_bits, const T* __restrict__ x, size_t n) {
    await_previous_kernel();
    block_amax_commit(amax_bits, fp8_amax_bits_of<T, VEC>(x, n));
}

/* The amax of every job of a list: blockIdx.y is the job. */
template <typename T, int VEC> __global__ void k_fp8_amax_jobs(const Fp8CastJob<T>* __restrict__ jobs) {
    await_previous_kernel();
    const Fp8CastJob<T>& j = jobs[blockIdx.y];
    block_amax_commit(&j.sc->amax_bits, fp8_amax_bits_of<T, VEC>(j.in, (size_t)j.batch * j.R * j.Cc));
}

__device__ __forceinline__ fp8 fp8_cvt(float x, int fmt) {
    return (fp8)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, fmt == FP8_E4M3 ? __NV_E4M3 : __NV_E5M2);
}

/* fp8_cvt of lo and of hi, in one conversion instruction (lo in the low byte). */
__device__ __forceinline__ unsigned short fp8_cvt2(float lo, float hi, int fmt) {
    return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, fmt == FP8_E4M3 ? __NV_E4M3 : __NV_E5M2);
}

/* The kernels that turn a packet of values into codes (the packed cast and its GELU epilogues, the
 * fused LayerNorm forward and backward, attention's fused forward and backward, the FP8 classifier's
 * loss rows) convert them in pairs: one packed conversion to T (as_stored2: one F2FP.BF16 PACK_AB)
 * and one FP8 conversion (fp8_cvt2) a pair, whose 16-bit results fill the store with no byte
 * shuffling, where value by value each would take a scalar F2F.BF16 (the quarter-rate conversion
 * unit) and an FP8 conversion whose byte is then shuffled into place. The same rounding, so the same
 * codes, amax and scale (kernel_check), in fewer instructions: docs/BENCHMARKS.md #85 (the loss rows:
 * #83) has the counts and the times. The kernels of one value a packet (VEC 1, the unpacked cast)
 * convert one by one. */

/* Precision fp8's GELU and its gradient take their tanh from the hardware's approximation (mlp.cuh's
 * GELU_TANH_APPROX: one MUFU.TANH where tanhf is ~20 instructions, and the GELU casts are bound by
 * instructions: docs/BENCHMARKS.md #87 has the counts, the times and the quality runs), in the fused
 * casts' epilogues and in the unfused path they must equal bit for bit (gelu_fwd / gelu_bwd_inplace
 * with FP8_GELU_TANH: a run's first micro-batch). Its error moves the codes by far less than the
 * cast's own rounding does (kernel_check's "gelu fast tanh" lines measure both), so fp8 may take it
 * where the other precisions, which round only to T, keep tanhf. The CPU engine's emulation keeps
 * glibc's tanhf (the hardware's approximation is undocumented bit for bit: no exact mirror) and stays
 * within the GPU-vs-CPU fp8 tolerances (docs/DESIGN.md §18). */
constexpr int FP8_GELU_TANH = GELU_TANH_APPROX;

/* EPI (FP8_EPI_*) other than NONE: the tile cast is of the epilogue's values as stored in T, and
 * their amax goes to j.sc (block_amax_commit) for the history's next entry: the GELU (forward or
 * backward) and the cast of its output fused, at the history's scale (j.hist, not empty). */
template <int EPI> __device__ __forceinline__ float fp8_epilogue_value(float v, float aux) {
    return EPI == FP8_EPI_GELU ? gelu_f<FP8_GELU_TANH>(v) : v * gelu_grad_f<FP8_GELU_TANH>(aux);
}
template <typename T, int EPI> __device__ __forceinline__ float fp8_cast_epilogue(float v, float aux, unsigned* am) {
    if constexpr (EPI == FP8_EPI_NONE) return v;
    float y = as_stored<T>(fp8_epilogue_value<EPI>(v, aux));
    *am = max(*am, abs_bits(y));
    return y;
}
/* fp8_cast_epilogue of the pair v0, v1 (aux a0, a1), as stored in T by one conversion (as_stored2). */
template <typename T, int EPI>
__device__ __forceinline__ float2 fp8_cast_epilogue2(float v0, float v1, float a0, float a1, unsigned* am) {
    if constexpr (EPI == FP8_EPI_NONE) return make_float2(v0, v1);
    float2 y = as_stored2<T>(fp8_epilogue_value<EPI>(v0, a0), fp8_epilogue_value<EPI>(v1, a1));
    *am = max(*am, max(abs_bits(y.x), abs_bits(y.y)));
    return y;
}

/* Tile `tile_id` (Cc tiles fastest, then R tiles, then the block b of the batch) of job j, by the
 * FP8_CAST_THREADS threads of a block, element by element: the shapes and pointers the packed cast
 * (fp8_cast_tile, below) does not take (fp8_cast_packable). The tile is cast row-wise (8 threads a
 * row of 64, FP8_ROW_PACKET elements each) into out_n and shared memory, then written transposed
 * from there (64 threads a row group, one column and up to FP8_COL_PACKET rows each). */
template <typename T, int EPI = FP8_EPI_NONE>
__device__ __forceinline__ void fp8_cast_tile_unpacked(const Fp8CastJob<T>& j, unsigned tile_id) {
    __shared__ __align__(16) fp8 tile[FP8_TILE][FP8_TILE + 8]; /* rows of 72 bytes: 8-byte aligned */
    const int R = j.R, Cc = j.Cc, batch = j.batch, fmt = j.fmt;
    fp8 *out_n = j.out_n, *out_t = j.out_t;
    unsigned tiles_c = ceil_div(Cc, FP8_TILE), tiles_r = ceil_div(R, FP8_TILE);
    int c0 = (int)(tile_id % tiles_c) * FP8_TILE, r0 = (int)(tile_id / tiles_c % tiles_r) * FP8_TILE;
    int b = (int)(tile_id / tiles_c / tiles_r);
    /* an epilogue's amax is still being reduced (by every block): it reads none */
    float s = EPI != FP8_EPI_NONE ? 1.0f : fp8_scale_for_amax(__uint_as_float(j.sc->amax_bits), fmt);
    if (j.hist) { /* delayed: the history's scale; the current one while the history is empty */
        float d = fp8_history_scale(j.hist);
        if (d > 0.0f) s = d;
    }
    const T* src = j.in + (size_t)b * R * Cc;
    const T* aux = EPI == FP8_EPI_DGELU ? j.aux + (size_t)b * R * Cc : NULL;
    if (tile_id == 0 && threadIdx.x == 0) {
        j.sc->scale = s;
        j.sc->descale = 1.0f / s;
    }
    const int per_row = FP8_TILE / FP8_ROW_PACKET;
    int tc = (threadIdx.x % per_row) * FP8_ROW_PACKET, c = c0 + tc;
    unsigned am = 0; /* epilogues only */
    for (int tr = threadIdx.x / per_row; tr < FP8_TILE; tr += FP8_CAST_THREADS / per_row) {
        int r = r0 + tr;
        if (r >= R) break;
        for (int k = 0; k < FP8_ROW_PACKET && c + k < Cc; k++) {
            size_t e = (size_t)r * Cc + c + k;
            float x = fp8_cast_epilogue<T, EPI>(to_f(src[e]), EPI == FP8_EPI_DGELU ? to_f(aux[e]) : 0.0f, &am);
            fp8 q = fp8_cvt(x * s, fmt);
            if (out_n) out_n[((size_t)r * batch + b) * Cc + c + k] = q;
            tile[tr][tc + k] = q;
        }
    }
    if constexpr (EPI != FP8_EPI_NONE) block_amax_commit(&j.sc->amax_bits, am); /* every thread gets here */
    if (!out_t) return;
    __syncthreads();
    int col = threadIdx.x % FP8_TILE, tr0 = threadIdx.x / FP8_TILE * FP8_COL_PACKET;
    int cc = c0 + col, r = r0 + tr0;
    if (cc >= Cc || r >= R) return;
    fp8* dst = out_t + ((size_t)b * Cc + cc) * R + r;
    for (int k = 0; k < FP8_COL_PACKET && r + k < R; k++) dst[k] = tile[tr0 + k][col];
}

static_assert(FP8_CAST_THREADS / FP8_TILE * FP8_COL_PACKET == FP8_TILE, "the transposed pass covers the tile");

/* One unpacked cast, a block a tile. */
template <typename T, int EPI = FP8_EPI_NONE>
__global__ void __launch_bounds__(FP8_CAST_THREADS) k_fp8_cast_unpacked(Fp8CastJob<T> j) {
    await_previous_kernel();
    fp8_cast_tile_unpacked<T, EPI>(j, blockIdx.x);
}

/* The block's job in a list of casts, a block a tile: the last whose first_tile is <= blockIdx.x. */
template <typename T> __device__ __forceinline__ int fp8_job_of_block(const Fp8CastJob<T>* __restrict__ jobs, int n_jobs) {
    int lo = 0, hi = n_jobs - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (jobs[mid].first_tile <= blockIdx.x) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* A list of unpacked casts, a block a tile (fp8_job_of_block). */
template <typename T>
__global__ void __launch_bounds__(FP8_CAST_THREADS) k_fp8_cast_jobs_unpacked(const Fp8CastJob<T>* __restrict__ jobs,
                                                                            int n_jobs) {
    await_previous_kernel();
    int lo = fp8_job_of_block(jobs, n_jobs);
    fp8_cast_tile_unpacked<T>(jobs[lo], blockIdx.x - jobs[lo].first_tile);
}

/* The packed cast (Cc a multiple of FP8_ROW_PACKET, R of FP8_COL_PACKET, pointers 16-byte aligned:
 * fp8_cast_packable), in tiles of FP8_PACKED_R x FP8_PACKED_C: the same codes, amax and scale as
 * fp8_cast_tile_unpacked's. A thread issues all its FP8_PACKED_LOADS row packets (and the GELU
 * backward's aux packets) before it uses one, so a block has 16 KB (bf16) in flight (64 x 64 tiles
 * with a packet a thread between stores moved 1.3x slower, docs/BENCHMARKS.md #80); the history's
 * scale is read while they arrive. The codes go to shared memory as 4-byte words in rows
 * FP8_PACKED_PITCH bytes apart: a warp's two rows fall on disjoint banks there, and so do the two
 * row groups (16 rows apart, 16 banks apart) a warp reads back for the transposed pass, whose lanes
 * l and l + 16 write the two 16-byte halves of one column's 32-byte sector. The epilogues' amax
 * reduction supplies the barrier that publishes the tile. */
#define FP8_PACKED_R 64
#define FP8_PACKED_C 128
#define FP8_PACKED_PITCH (FP8_PACKED_C + 4)
#define FP8_PACKED_PER_ROW (FP8_PACKED_C / FP8_ROW_PACKET)        /* threads a tile row */
#define FP8_PACKED_ROW_STEP (FP8_CAST_THREADS / FP8_PACKED_PER_ROW) /* rows a pass */
#define FP8_PACKED_LOADS (FP8_PACKED_R / FP8_PACKED_ROW_STEP)     /* row packets a thread */
#define FP8_PACKED_COL_WARPS (FP8_PACKED_C / 16)                  /* transposed: 16 columns a warp */
#define FP8_PACKED_COL_UNITS (FP8_PACKED_C * FP8_PACKED_R / FP8_COL_PACKET / FP8_CAST_THREADS) /* stores a thread */
static_assert(FP8_PACKED_R % FP8_PACKED_ROW_STEP == 0, "the row passes cover the tile");
static_assert(FP8_PACKED_COL_UNITS * FP8_CAST_THREADS / 32 == FP8_PACKED_COL_WARPS * FP8_PACKED_R / (2 * FP8_COL_PACKET),
              "the transposed pass covers the tile, two row groups a warp");
static_assert(FP8_PACKED_PITCH % 4 == 0 && FP8_PACKED_PITCH * FP8_COL_PACKET / 4 % 32 == 16,
              "rows of whole words; row groups 16 banks apart");

static unsigned fp8_cast_tiles(int batch, int R, int Cc) {
    return ceil_div(Cc, FP8_PACKED_C) * ceil_div(R, FP8_PACKED_R) * (unsigned)batch;
}

/* A row packet (FP8_ROW_PACKET elements of T) as loaded: raw 16-byte words, converted at use. */
template <typename T> struct Fp8RowPacket {
    int4 raw[FP8_ROW_PACKET * sizeof(T) / 16];
};

template <typename T> __device__ __forceinline__ void fp8_packet_load(Fp8RowPacket<T>& p, const T* src) {
#pragma unroll
    for (int q = 0; q < (int)(FP8_ROW_PACKET * sizeof(T) / 16); q++) p.raw[q] = reinterpret_cast<const int4*>(src)[q];
}

template <typename T> __device__ __forceinline__ float fp8_packet_at(const Fp8RowPacket<T>& p, int k) {
    return to_f(reinterpret_cast<const T*>(p.raw)[k]);
}

/* Each pair of a packet in one conversion to T and one to codes (fp8_cvt2, above). */
template <typename T, int EPI = FP8_EPI_NONE>
__device__ __forceinline__ void fp8_cast_tile(const Fp8CastJob<T>& j, unsigned tile_id) {
    __shared__ __align__(16) fp8 tile[FP8_PACKED_R * FP8_PACKED_PITCH];
    const int R = j.R, Cc = j.Cc, batch = j.batch, fmt = j.fmt;
    unsigned tiles_c = ceil_div(Cc, FP8_PACKED_C), tiles_r = ceil_div(R, FP8_PACKED_R);
    int c0 = (int)(tile_id % tiles_c) * FP8_PACKED_C, r0 = (int)(tile_id / tiles_c % tiles_r) * FP8_PACKED_R;
    int b = (int)(tile_id / tiles_c / tiles_r);
    const T* src = j.in + (size_t)b * R * Cc;
    const T* aux = EPI == FP8_EPI_DGELU ? j.aux + (size_t)b * R * Cc : NULL;
    int tc = (threadIdx.x % FP8_PACKED_PER_ROW) * FP8_ROW_PACKET, tr0 = threadIdx.x / FP8_PACKED_PER_ROW;
    int c = c0 + tc;
    Fp8RowPacket<T> v[FP8_PACKED_LOADS] = {}, x[EPI == FP8_EPI_DGELU ? FP8_PACKED_LOADS : 1] = {};
#pragma unroll
    for (int i = 0; i < FP8_PACKED_LOADS; i++) { /* Cc a multiple of the packet: a packet is wholly in or out */
        int r = r0 + tr0 + i * FP8_PACKED_ROW_STEP;
        if (c >= Cc || r >= R) continue;
        fp8_packet_load(v[i], src + (size_t)r * Cc + c);
        if constexpr (EPI == FP8_EPI_DGELU) fp8_packet_load(x[i], aux + (size_t)r * Cc + c);
    }
    /* an epilogue's amax is still being reduced (by every block): it reads none */
    float s = EPI != FP8_EPI_NONE ? 1.0f : fp8_scale_for_amax(__uint_as_float(j.sc->amax_bits), fmt);
    if (j.hist) { /* delayed: the history's scale; the current one while the history is empty */
        float d = fp8_history_scale(j.hist);
        if (d > 0.0f) s = d;
    }
    if (tile_id == 0 && threadIdx.x == 0) {
        j.sc->scale = s;
        j.sc->descale = 1.0f / s;
    }
    unsigned am = 0; /* epilogues only */
#pragma unroll
    for (int i = 0; i < FP8_PACKED_LOADS; i++) {
        int tr = tr0 + i * FP8_PACKED_ROW_STEP, r = r0 + tr;
        if (c >= Cc || r >= R) continue;
        uint2 q;
        unsigned short qp[FP8_ROW_PACKET / 2];
#pragma unroll
        for (int k = 0; k < FP8_ROW_PACKET; k += 2) {
            const Fp8RowPacket<T>& xi = x[EPI == FP8_EPI_DGELU ? i : 0];
            float x0 = EPI == FP8_EPI_DGELU ? fp8_packet_at(xi, k) : 0.0f;
            float x1 = EPI == FP8_EPI_DGELU ? fp8_packet_at(xi, k + 1) : 0.0f;
            float2 y = fp8_cast_epilogue2<T, EPI>(fp8_packet_at(v[i], k), fp8_packet_at(v[i], k + 1), x0, x1, &am);
            qp[k / 2] = fp8_cvt2(y.x * s, y.y * s, fmt);
        }
        memcpy(&q, qp, sizeof q);
        if (j.out_n) *reinterpret_cast<uint2*>(j.out_n + ((size_t)r * batch + b) * Cc + c) = q;
        unsigned* t = reinterpret_cast<unsigned*>(tile + tr * FP8_PACKED_PITCH + tc);
        t[0] = q.x;
        t[1] = q.y;
    }
    if constexpr (EPI != FP8_EPI_NONE) block_amax_commit(&j.sc->amax_bits, am); /* its barriers publish the tile */
    if (!j.out_t) return;
    if constexpr (EPI == FP8_EPI_NONE) __syncthreads();
#pragma unroll
    for (int i = 0; i < FP8_PACKED_COL_UNITS; i++) {
        int u = threadIdx.x + i * FP8_CAST_THREADS, lane = u % 32, warp = u / 32;
        int col = warp % FP8_PACKED_COL_WARPS * 16 + lane % 16;
        int tr = (warp / FP8_PACKED_COL_WARPS * 2 + lane / 16) * FP8_COL_PACKET;
        int cc = c0 + col, r = r0 + tr;
        if (cc >= Cc || r >= R) continue; /* R a multiple of the packet: wholly in */
        uint4 q;
        fp8* qb = reinterpret_cast<fp8*>(&q);
#pragma unroll
        for (int k = 0; k < FP8_COL_PACKET; k++) qb[k] = tile[(tr + k) * FP8_PACKED_PITCH + col];
        *reinterpret_cast<uint4*>(j.out_t + ((size_t)b * Cc + cc) * R + r) = q;
    }
}

/* One packed cast, a block a tile. */
template <typename T, int EPI = FP8_EPI_NONE>
__global__ void __launch_bounds__(FP8_CAST_THREADS) k_fp8_cast(Fp8CastJob<T> j) {
    await_previous_kernel();
    fp8_cast_tile<T, EPI>(j, blockIdx.x);
}

/* A list of packed casts, a block a tile (fp8_job_of_block). */
template <typename T>
__global__ void __launch_bounds__(FP8_CAST_THREADS) k_fp8_cast_jobs(const Fp8CastJob<T>* __restrict__ jobs, int n_jobs) {
    await_previous_kernel();
    int lo = fp8_job_of_block(jobs, n_jobs);
    fp8_cast_tile<T>(jobs[lo], blockIdx.x - jobs[lo].first_tile);
}

/* Every cast's amax starts at 0: zeroes the amax (and the rest) of `count` consecutive scales. The
 * engine zeroes all of a micro-batch's at its start, and all the weights' before their casts. */
static void fp8_zero_scales(Fp8Scale* sc, size_t count) {
    CUDA_CHECK(cudaMemsetAsync(sc, 0, count * sizeof(Fp8Scale), g_stream));
}

/* The amax of n values of x into sc (atomicMax: sc's amax zeroed before, fp8_zero_scales). */
template <typename T> static void fp8_reduce_amax(Fp8Scale* sc, const T* x, size_t n) {
    bool packed = packable(n, sizeof(T), {x});
    LAUNCH_PACKED(packed, k_fp8_amax, T, amax_grid(elementwise_grid(n / (packed ? PACK(T) : 1), FP8_AMAX_BLOCK),
                                                   &sc->amax_bits),
                  FP8_AMAX_BLOCK, &sc->amax_bits, x, n);
}

template <typename T> static bool fp8_cast_packable(const Fp8CastJob<T>& j) {
    return j.Cc % FP8_ROW_PACKET == 0 && j.R % FP8_COL_PACKET == 0 && (uintptr_t)j.out_n % 16 == 0 &&
           (uintptr_t)j.out_t % 16 == 0 && (uintptr_t)j.in % 16 == 0 && (uintptr_t)j.aux % 16 == 0;
}

/* The blocks (tiles) of job j's cast on the packed kernel (`packed`) or the element-wise one. */
template <typename T> static unsigned fp8_cast_blocks(const Fp8CastJob<T>& j, bool packed) {
    return packed ? fp8_cast_tiles(j.batch, j.R, j.Cc) : fp8_cast_unpacked_tiles(j.batch, j.R, j.Cc);
}

/* One cast job in one launch, on the packed kernel where it can. */
template <typename T, int EPI = FP8_EPI_NONE> static void fp8_cast_launch(const Fp8CastJob<T>& j) {
    bool packed = fp8_cast_packable(j);
    unsigned tiles = fp8_cast_blocks(j, packed);
    if (packed) launch_kernel(k_fp8_cast<T, EPI>, tiles, FP8_CAST_THREADS, j);
    else launch_kernel(k_fp8_cast_unpacked<T, EPI>, tiles, FP8_CAST_THREADS, j);
}

/* The cast of `batch` blocks [R, Cc] of `in` (Fp8CastJob) at the scale of the amax already in sc
 * (from fp8_reduce_amax or a producer with the amax fused), or of the history `hist` (delayed). */
template <typename T>
static void fp8_cast(fp8* out_n, fp8* out_t, Fp8Scale* sc, const T* in, int batch, int R, int Cc, int fmt,
                     const Fp8History* hist = NULL) {
    Fp8CastJob<T> j = {in, out_n, out_t, sc, batch, R, Cc, fmt, 0, hist, NULL};
    fp8_cast_launch(j);
}

/* Where the amax of each delayed tensor (DELAYED_*, cpu/fp8.h) sits: scales[l * stride + at[which]]
 * for layer l. */
struct Fp8DelayedScales {
    const Fp8Scale* scales;
    int stride, at[FP8_DELAYED_PER_LAYER];
};

/* Delayed scaling: history hist[l * FP8_DELAYED_PER_LAYER + which] of every layer l < layers and
 * every tensor which takes the amax of its tensor, the activations' and the gradients' at once
 * (after the backward: docs/DESIGN.md §18); one thread a history, in the CPU engine's code
 * (cpu/fp8.h's fp8_history_push). */
__global__ void k_fp8_history_push(Fp8History* __restrict__ hist, Fp8DelayedScales where, int layers) {
    await_previous_kernel();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= layers * FP8_DELAYED_PER_LAYER) return;
    int l = i / FP8_DELAYED_PER_LAYER, which = i % FP8_DELAYED_PER_LAYER;
    const Fp8Scale* sc = where.scales + (size_t)l * where.stride + where.at[which];
    fp8_history_push(&hist[i], __uint_as_float(sc->amax_bits), fp8_delayed_fmt(which));
}

static void fp8_history_push_all(Fp8History* hist, const Fp8DelayedScales& where, int layers) {
    launch_kernel(k_fp8_history_push, ceil_div(layers * FP8_DELAYED_PER_LAYER, 128), 128, hist, where, layers);
}

/* Delayed scaling's fused LayerNorm (docs/DESIGN.md §18): the forward of N rows of x
 * [N, C] written straight as E4M3 codes at the history's scale, row-major into out_n and
 * transposed into out_t ([C][N], either may be NULL), with mean and rstd, the amax of the outputs
 * as stored in T (what the unfused path's cast would have seen, for the history's next entry) and
 * the scale in sc: bit for bit layernorm_fwd then fp8_cast with the history. A block does
 * LN_FP8_ROWS rows, a warp a row at a time as k_layernorm_fwd, keeping the codes in shared memory
 * (LN_FP8_ROWS x C) for the transposed layout: a thread a column, one 16-byte store of
 * LN_FP8_ROWS codes. Needs N a multiple of LN_FP8_ROWS (fp8's rule) and a history that is not
 * empty (the caller falls back to the unfused path for a run's first forward). */
#define LN_FP8_ROWS 16
/* Warps of its block, each taking its rows in turn: LN_WARPS, or LN_FP8_FWD_WIDE_WARPS (a row a
 * warp, as k_layernorm_fwd's) where that keeps the grid one wave (ln_fp8_fwd_warps;
 * docs/BENCHMARKS.md #88): twice the warps in flight at ANDREA-12M's 256 blocks, where each of 8
 * warps would take two rows, of two dependent DRAM round trips each, one after the other. The same
 * rows, operations and tile, so the same bits. */
#define LN_FP8_FWD_WIDE_WARPS LN_FP8_ROWS
static_assert(LN_FP8_ROWS % LN_FP8_FWD_WIDE_WARPS == 0 && LN_FP8_ROWS % LN_WARPS == 0,
              "every warp of the fused LayerNorm takes as many rows");
/* The fused LayerNorm's scale s and its inverse where the product reads them (one thread), and
 * the block's amax of its outputs as stored, am (every thread calls it; block_amax_commit). */
__device__ __forceinline__ void ln_fp8_commit_scale(Fp8Scale* sc, float s, unsigned am) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        sc->scale = s;
        sc->descale = 1.0f / s;
    }
    block_amax_commit(&sc->amax_bits, am);
}
#define LN_FP8_STATIC_SMEM 1024 /* kept for the kernel's static shared memory (block_amax_commit's 128 B) */
#define LN_FP8_MAX_C ((48 * 1024 - LN_FP8_STATIC_SMEM) / LN_FP8_ROWS - 16) /* dynamic + static within 48 KB */
template <typename T, int VEC>
__global__ void __launch_bounds__(32 * LN_FP8_FWD_WIDE_WARPS)
k_layernorm_fwd_fp8(fp8* __restrict__ out_n, fp8* __restrict__ out_t, Fp8Scale* __restrict__ sc,
                    const Fp8History* __restrict__ hist, float* __restrict__ mean, float* __restrict__ rstd,
                    const T* __restrict__ x, const float* __restrict__ gamma, const float* __restrict__ beta, int N,
                    int C) {
    await_previous_kernel();
    extern __shared__ __align__(16) fp8 ln_tile[]; /* [LN_FP8_ROWS][C + 16] */
    const int pitch = C + 16, lane = threadIdx.x & 31, r0 = blockIdx.x * LN_FP8_ROWS;
    const float s = fp8_history_scale(hist);
    const int warps = blockDim.x >> 5; /* ln_fp8_fwd_warps */
    unsigned am = 0;
    for (int tr = threadIdx.x >> 5; tr < LN_FP8_ROWS; tr += warps) {
        int row = r0 + tr;
        const T* xr = x + (size_t)row * C;
        float m, r, v[VEC], g[VEC], b[VEC];
        ln_row_stats<T, VEC>(&m, &r, xr, C);
        LN_ROW_LOOP(c, C) {
            fp8 q[VEC];
            load_vec(v, xr + c);
            load_vec(g, gamma + c);
            load_vec(b, beta + c);
            if constexpr (VEC % 2 == 0) {
                for (int k = 0; k < VEC; k += 2) {
                    float2 y = as_stored2<T>((v[k] - m) * r * g[k] + b[k], (v[k + 1] - m) * r * g[k + 1] + b[k + 1]);
                    am = max(am, max(abs_bits(y.x), abs_bits(y.y)));
                    unsigned short q2 = fp8_cvt2(y.x * s, y.y * s, FP8_E4M3);
                    memcpy(q + k, &q2, sizeof q2);
                }
            } else {
                for (int k = 0; k < VEC; k++) {
                    float y = as_stored<T>((v[k] - m) * r * g[k] + b[k]);
                    am = max(am, abs_bits(y));
                    q[k] = fp8_cvt(y * s, FP8_E4M3);
                }
            }
            if constexpr (VEC == 8) {
                uint2 w;
                memcpy(&w, q, sizeof w);
                if (out_n) *reinterpret_cast<uint2*>(out_n + (size_t)row * C + c) = w;
                *reinterpret_cast<uint2*>(ln_tile + tr * pitch + c) = w;
            } else {
                for (int k = 0; k < VEC; k++) {
                    if (out_n) out_n[(size_t)row * C + c + k] = q[k];
                    ln_tile[tr * pitch + c + k] = q[k];
                }
            }
        }
        if (lane == 0) {
            mean[row] = m;
            rstd[row] = r;
        }
    }
    ln_fp8_commit_scale(sc, s, am); /* its __syncthreads also publishes the tile */
    if (!out_t) return;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        uint4 w;
        fp8* wb = reinterpret_cast<fp8*>(&w);
        for (int k = 0; k < LN_FP8_ROWS; k++) wb[k] = ln_tile[k * pitch + c];
        *reinterpret_cast<uint4*>(out_t + (size_t)c * N + r0) = w;
    }
}
static_assert(LN_FP8_ROWS * sizeof(fp8) == sizeof(uint4), "a column of the tile is one 16-byte store");


/* Whether layernorm_fwd_fp8 takes a shape (else: layernorm_fwd, then fp8_cast with the history). */
static bool layernorm_fwd_fp8_fits(int N, int C) { return N % LN_FP8_ROWS == 0 && C <= LN_FP8_MAX_C; }

/* k_layernorm_fwd_fp8's warps a block for N rows: LN_FP8_FWD_WIDE_WARPS where its N / LN_FP8_ROWS
 * blocks are at most two a multiprocessor (ANDREA-12M's 256 on an H200's 132; at 40 registers a
 * thread three blocks of 16 warps fit one), else LN_WARPS (ANDREA-120M's 512 would need a second
 * wave). A function of the shape and the device alone. */
static int ln_fp8_fwd_warps(int N) {
    return N / LN_FP8_ROWS <= 2 * lt_sm_count() ? LN_FP8_FWD_WIDE_WARPS : LN_WARPS;
}

template <typename T>
static void layernorm_fwd_fp8(fp8* out_n, fp8* out_t, Fp8Scale* sc, const Fp8History* hist, float* mean, float* rstd,
                              const T* x, const float* gamma, const float* beta, int N, int C) {
    bool packed = PACK(T) == 8 && packable(C, sizeof(T), {x}) && packable(C, sizeof(float), {gamma, beta}) &&
                  (uintptr_t)out_n % 8 == 0;
    size_t shared = (size_t)LN_FP8_ROWS * (C + 16);
    if ((uintptr_t)out_t % 16 != 0 || !layernorm_fwd_fp8_fits(N, C)) {
        fprintf(stderr, "error: internal: layernorm_fwd_fp8 of N=%d C=%d with out_t %p\n", N, C, (void*)out_t);
        exit(1);
    }
    int threads = 32 * ln_fp8_fwd_warps(N);
    if (packed)
        launch_kernel_with_shared(k_layernorm_fwd_fp8<T, PACK(T)>, N / LN_FP8_ROWS, threads, shared, out_n, out_t,
                                  sc, hist, mean, rstd, x, gamma, beta, N, C);
    else
        launch_kernel_with_shared(k_layernorm_fwd_fp8<T, 1>, N / LN_FP8_ROWS, threads, shared, out_n, out_t, sc,
                                  hist, mean, rstd, x, gamma, beta, N, C);
}

/* Delayed scaling's fused LayerNorm backward (docs/DESIGN.md §18): layernorm_bwd's register kernel, which adds into the residual gradient dx, also
 * writes the new dx's codes (format fmt, at the history's scale, as stored in T) row-major into
 * out_n [N][C] and transposed into out_t [C][N], their amax and the scale into sc: bit for bit
 * layernorm_bwd with the amax, then fp8_cast with the history. A block keeps its chunk's codes
 * (rows_per_chunk x C, rows LN_BWD_TILE_PITCH(C) bytes apart) in the shared memory of its column
 * sums, unused until its rows are done, and writes them transposed from there: a thread a column
 * and 16 rows, one 16-byte store, where the chunk's rows come in sixteens (else byte by byte). */
#define LN_BWD_TILE_BYTES (sizeof(float) * LN_WARPS * 2 * LN_SLAB_COLS) /* the column sums' memory */
#define LN_BWD_TILE_PITCH(C) ((C) + 16)
struct LnBwdCodes {
    static constexpr bool codes = true;
    fp8 *out_n, *out_t;
    Fp8Scale* sc;
    const Fp8History* hist; /* not empty */
    int fmt;
    float s; /* the history's scale, set by begin() */

    __device__ __forceinline__ void begin() { s = fp8_history_scale(hist); }

    template <typename T, int VEC>
    __device__ __forceinline__ void row(const float (&v)[VEC], int r, int tr, int c, int C, void* shared) const {
        fp8 q[VEC];
        fp8* t = (fp8*)shared + (size_t)tr * LN_BWD_TILE_PITCH(C) + c;
        if constexpr (VEC % 2 == 0) { /* v as stored already (ln_bwd_regs_body) */
            for (int k = 0; k < VEC; k += 2) {
                unsigned short q2 = fp8_cvt2(v[k] * s, v[k + 1] * s, fmt);
                memcpy(q + k, &q2, sizeof q2);
            }
        } else {
            for (int k = 0; k < VEC; k++) q[k] = fp8_cvt(as_stored<T>(v[k]) * s, fmt);
        }
        if constexpr (VEC == 8) {
            uint2 w;
            memcpy(&w, q, sizeof w);
            *reinterpret_cast<uint2*>(out_n + (size_t)r * C + c) = w;
            *reinterpret_cast<uint2*>(t) = w;
        } else {
            for (int k = 0; k < VEC; k++) {
                out_n[(size_t)r * C + c + k] = q[k];
                t[k] = q[k];
            }
        }
    }

    __device__ __forceinline__ void finish(const void* shared, int r0, int r1, int N, int C) const {
        const fp8* tile = (const fp8*)shared;
        const int pitch = LN_BWD_TILE_PITCH(C), n = r1 - r0;
        if (blockIdx.x == 0 && threadIdx.x == 0) {
            sc->scale = s;
            sc->descale = 1.0f / s;
        }
        if ((r0 | n | N) % 16 == 0) { /* whole 16-byte stores (out_t 16-byte aligned: the host checks) */
            const int groups = n / 16; /* neighbouring threads: the same column's neighbouring groups */
            for (int i = threadIdx.x; i < groups * C; i += blockDim.x) {
                int g = i % groups, c = i / groups;
                uint4 w;
                fp8* wb = reinterpret_cast<fp8*>(&w);
                for (int k = 0; k < 16; k++) wb[k] = tile[(g * 16 + k) * pitch + c];
                *reinterpret_cast<uint4*>(out_t + (size_t)c * N + r0 + g * 16) = w;
            }
        } else {
            for (int i = threadIdx.x; i < n * C; i += blockDim.x) {
                int k = i % n, c = i / n;
                out_t[(size_t)c * N + r0 + k] = tile[k * pitch + c];
            }
        }
    }
};

template <typename T, int VEC, int PACKETS>
__global__ void __launch_bounds__(32 * LN_WARPS, 2)
k_layernorm_bwd_fp8(T* __restrict__ dx, float* __restrict__ partial, const T* __restrict__ dout,
                    const T* __restrict__ x, const float* __restrict__ gamma, const float* __restrict__ mean,
                    const float* __restrict__ rstd, int N, int C, int rows_per_chunk, LnBwdCodes codes) {
    await_previous_kernel();
    ln_bwd_regs_body<T, VEC, PACKETS>(dx, partial, dout, x, gamma, mean, rstd, N, C, rows_per_chunk,
                                      &codes.sc->amax_bits, codes);
}


/* Whether layernorm_bwd_fp8 takes these operands (else: layernorm_bwd with the amax, then fp8_cast
 * with the history): rows the register kernel holds, a chunk's codes within the tile. */
template <typename T>
static bool layernorm_bwd_fp8_fits(const T* dx, const T* dout, const T* x, const float* gamma, int N, int C) {
    LnBwdRegs rp = ln_bwd_regs_plan(dx, dout, x, gamma, N, C);
    return rp.packets > 0 && (size_t)rp.rows_per_chunk * LN_BWD_TILE_PITCH(C) <= LN_BWD_TILE_BYTES;
}

/* layernorm_bwd (dx +=, dgamma and dbeta by grad_beta) with dx's codes, as above; `hist` must not be
 * empty. */
template <typename T>
static void layernorm_bwd_fp8(fp8* out_n, fp8* out_t, Fp8Scale* sc, const Fp8History* hist, int fmt, T* dx,
                              float* dgamma, float* dbeta, const T* dout, const T* x, const float* gamma,
                              const float* mean, const float* rstd, int N, int C, float* scratch, float grad_beta) {
    LnBwdRegs rp = ln_bwd_regs_plan(dx, dout, x, gamma, N, C);
    if (!layernorm_bwd_fp8_fits(dx, dout, x, gamma, N, C) || (uintptr_t)out_n % 16 != 0 ||
        (uintptr_t)out_t % 16 != 0) {
        fprintf(stderr, "error: internal: layernorm_bwd_fp8 of N=%d C=%d with out_n %p, out_t %p\n", N, C,
                (void*)out_n, (void*)out_t);
        exit(1);
    }
    LnBwdCodes codes = {out_n, out_t, sc, hist, fmt, 0.0f};
    layernorm_bwd_scratch_free(scratch);
    LN_LAUNCH_PACKETS(rp.packed, rp.packets, k_layernorm_bwd_fp8, T, rp.n_chunks, 32 * LN_WARPS, dx, scratch, dout,
                      x, gamma, mean, rstd, N, C, rp.rows_per_chunk, codes);
    layernorm_bwd_final_issue(dgamma, dbeta, scratch, C, rp.n_chunks, grad_beta != 0.0f);
}

/* Delayed scaling's fused GELU: the codes of gelu(h) for h [R, Cc] (as k_gelu_fwd would store it,
 * then fp8_cast with the history `hist`, which must not be empty), their amax into sc; bit for bit
 * gelu_fwd with the amax, then fp8_cast. Saves writing and reading back gelu(h) in T. */
template <typename T>
static void fp8_cast_gelu(fp8* out_n, fp8* out_t, Fp8Scale* sc, const T* h, int R, int Cc, const Fp8History* hist) {
    Fp8CastJob<T> j = {h, out_n, out_t, sc, 1, R, Cc, FP8_E4M3, 0, hist, NULL};
    fp8_cast_launch<T, FP8_EPI_GELU>(j);
}

/* Delayed scaling's fused GELU backward: the codes, in format fmt,
 * of dh = dout * gelu'(h) for dout, h [R, Cc] (as k_gelu_bwd_inplace would store dh, then fp8_cast
 * with the history `hist`, which must not be empty), their amax into sc; bit for bit
 * gelu_bwd_inplace with the amax, then fp8_cast. Saves writing and reading back dh in T. */
template <typename T>
static void fp8_cast_dgelu(fp8* out_n, fp8* out_t, Fp8Scale* sc, const T* dout, const T* h, int R, int Cc, int fmt,
                           const Fp8History* hist) {
    Fp8CastJob<T> j = {dout, out_n, out_t, sc, 1, R, Cc, fmt, 0, hist, h};
    fp8_cast_launch<T, FP8_EPI_DGELU>(j);
}

/* Delayed scaling's fused flash-attention backward (docs/DESIGN.md §18): the dK/dV kernel (Hopper's, k_attn_bwd_dkv_wgmma) and the dQ kernel write,
 * instead of dq, dk, dv in T, the codes of the QKV backward's output gradient (format fmt, at the
 * history's scale, of the values as they would be stored in T) in the cast's layouts of the three
 * blocks (fp8_cast, batch 3): row-major out_n [N][3][C] and transposed out_t [3][C][N], with their
 * amax and the scale in sc: bit for bit attn_bwd with the amax, then fp8_cast with the history. A
 * block's 64 rows x D columns of codes go through a shared tile (rows pitch<D>() bytes apart):
 * out_n a 16-byte store per row chunk, out_t a thread a column and 16 rows (one 16-byte store where
 * the 16 rows are whole and aligned, else byte by byte), so a column's 64-row run is contiguous. */
struct FaBwdCodes {
    static constexpr bool codes = true;
    fp8 *out_n, *out_t;
    Fp8Scale* sc;
    const Fp8History* hist; /* not empty */
    int fmt, N;

    template <int D> __host__ __device__ static constexpr int pitch(void) { return D + 16; }
    template <int D> __host__ __device__ static constexpr int tile_bytes(void) { return FA_TILE * pitch<D>(); }

    /* The warp's 16 rows (rows 16 warp .. of the tile) of mul * acc, rounded to T as fa_store_out
     * stores them, as codes into `tile`; rows from n_valid on (past T) count for no amax. Returns
     * the lane's amax bits. */
    template <typename T, int D>
    __device__ __forceinline__ unsigned stage(unsigned char* tile, const float (*acc)[4], float mul,
                                              int n_valid) const {
        int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3, sub = (threadIdx.x >> 5) * 16;
        float s = fp8_history_scale(hist);
        unsigned am = 0;
        for (int n = 0; n < Fa<D>::ND; n++)
            for (int h = 0; h < 2; h++) {
                int r = g + 8 * h;
                float2 y = as_stored2<T>(mul * acc[n][2 * h], mul * acc[n][2 * h + 1]);
                if (r < n_valid) am = max(am, max(abs_bits(y.x), abs_bits(y.y)));
                unsigned short q = fp8_cvt2(y.x * s, y.y * s, fmt);
                memcpy(tile + (sub + r) * pitch<D>() + 8 * n + 2 * t, &q, sizeof q);
            }
        return am;
    }

    /* The block's tile of block `which` of BATCH (dqkv's 3: 0 dq, 1 dk, 2 dv; the forward's att: one):
     * rows tile * 64 .. of sequence b, head hd's columns. */
    template <int D, int BATCH = 3>
    __device__ __forceinline__ void write(const unsigned char* codes, int which, int b, int tile, int hd, int T_,
                                          int C) const {
        constexpr int CHUNKS = D / 16, GROUPS = FA_TILE / 16;
        int n_valid = min(FA_TILE, T_ - tile * FA_TILE), col0 = hd * D;
        size_t pos0 = (size_t)b * T_ + (size_t)tile * FA_TILE;
        for (int i = threadIdx.x; i < FA_TILE * CHUNKS; i += FA_THREADS) {
            int r = i / CHUNKS, c = i % CHUNKS * 16;
            if (r < n_valid)
                *reinterpret_cast<uint4*>(out_n + ((pos0 + r) * BATCH + which) * C + col0 + c) =
                    *reinterpret_cast<const uint4*>(codes + r * pitch<D>() + c);
        }
        for (int i = threadIdx.x; i < D * GROUPS; i += FA_THREADS) { /* neighbouring threads: one column */
            int r0 = i % GROUPS * 16, c = i / GROUPS;
            fp8* dst = out_t + ((size_t)which * C + col0 + c) * N + pos0 + r0;
            if (r0 + 16 <= n_valid && (uintptr_t)dst % 16 == 0) {
                uint4 w;
                fp8* wb = reinterpret_cast<fp8*>(&w);
                for (int k = 0; k < 16; k++) wb[k] = codes[(r0 + k) * pitch<D>() + c];
                *reinterpret_cast<uint4*>(dst) = w;
            } else {
                for (int k = 0; k < 16 && r0 + k < n_valid; k++) dst[k] = codes[(r0 + k) * pitch<D>() + c];
            }
        }
    }

    /* The block's amax into sc (partial: 32 unsigned of shared memory lent, as block_amax_commit_in);
     * `scale_writer`: the kernel whose first block writes the scale. */
    __device__ __forceinline__ void finish(unsigned am, unsigned* partial, bool scale_writer) const {
        if (scale_writer && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
            float s = fp8_history_scale(hist);
            sc->scale = s;
            sc->descale = 1.0f / s;
        }
        block_amax_commit_in(&sc->amax_bits, am, partial);
    }
};

template <typename T, int D>
__global__ void __launch_bounds__(FA_THREADS, FA_MIN_BLOCKS_DKV)
    k_attn_bwd_dkv_wgmma_fp8(T* ds_tiles, const __grid_constant__ FaDkvMaps maps, const float* lse, const float* delta,
                             int T_, int C, int H, float scale, float sl2, FaBwdCodes codes) {
    await_previous_kernel();
    extern __shared__ __align__(1024) unsigned char fa_dkv_smem[]; /* as k_attn_bwd_dkv_wgmma's */
    fa_bwd_dkv_wgmma_body<T, D, false>((T*)NULL, (T*)NULL, ds_tiles, maps, lse, delta, T_, C, H, scale, sl2,
                                       (unsigned*)NULL, fa_dkv_smem, codes);
}

template <typename T, int D>
__global__ void FA_DQ_BOUNDS k_attn_bwd_dq_fp8(const T* ds_tiles, const T* k, int T_, int C, int H, float scale,
                                               FaBwdCodes codes) {
    await_previous_kernel();
    fa_bwd_dq_body<T, D, false>((T*)NULL, ds_tiles, k, T_, C, H, scale, (unsigned*)NULL, codes);
}

/* Whether this process launches k_attn_bwd_dkv_wgmma_fp8<T, D> (as fa_dkv_wgmma_ok, whose
 * attributes it sets alike, once). */
template <typename T, int D> static bool fa_dkv_wgmma_fp8_ok(void) {
    static int ok = -1;
    if (ok >= 0) return ok;
    ok = fa_sm90a_image(k_attn_bwd_dkv_wgmma_fp8<T, D>, FaWgDkv<D>::STATIC_SMEM);
    if (!ok) return false;
    CUDA_CHECK(cudaFuncSetAttribute(k_attn_bwd_dkv_wgmma_fp8<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    FaWgDkv<D>::DYNAMIC_SMEM));
    CUDA_CHECK(cudaFuncSetAttribute(k_attn_bwd_dkv_wgmma_fp8<T, D>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                    cudaSharedmemCarveoutMaxShared));
    return true;
}

/* Whether a fused fp8 attention kernel takes attention of this shape: the flash path at a head size
 * of Hopper's kernels (32, 64) whose sm_90a image `image_ok(std::integral_constant<int, D>)` says
 * this GPU runs. The call sits under FaType<T>::ok, so no float instantiation of a kernel is made. */
template <typename T, typename ImageOk> static bool attn_fp8_fits(int C, int H, ImageOk image_ok) {
    if constexpr (FaType<T>::ok) {
        if (attn_flash_ok<T>(C, H)) {
            if (C / H == 32) return image_ok(std::integral_constant<int, 32>{});
            if (C / H == 64) return image_ok(std::integral_constant<int, 64>{});
        }
    }
    return false;
}

/* Whether attn_bwd_fp8 takes attention of this shape on this GPU: the flash path with Hopper's
 * dK/dV kernel (head sizes 32 and 64, an sm_90a image). Elsewhere (sm_89's k_attn_bwd_dkv, head
 * size 16, the cuBLAS path): attn_bwd with the amax, then fp8_cast with the history. */
template <typename T> static bool attn_bwd_fp8_fits(int C, int H) {
    return attn_fp8_fits<T>(C, H, [](auto d) { return fa_dkv_wgmma_fp8_ok<T, decltype(d)::value>(); });
}

template <typename T, int D>
static void attn_bwd_fp8_flash(const FaBwdCodes& codes, const T* dout, const T* out, const float* lse, const T* q,
                               const T* k, const T* v, int B, int T_, int C, int H, float* delta, T* ds_tiles) {
    float scale = 1.0f / sqrtf((float)D), sl2 = FA_LOG2E * scale;
    dim3 grid = fa_grid(ceil_div(T_, FA_TILE), B * H);
    fa_check_aligned(dout, q, k, v);
    fa_check_aligned(out, codes.out_n, codes.out_t, ds_tiles);
    attn_bwd_flash_delta<T, D>(delta, dout, out, B, T_, C, H);
    launch_kernel_with_shared(k_attn_bwd_dkv_wgmma_fp8<T, D>, grid, FA_THREADS, FaWgDkv<D>::DYNAMIC_SMEM, ds_tiles,
                              fa_dkv_maps<D>(q, k, v, dout, B, T_, C), lse, delta, T_, C, H, scale, sl2, codes);
    launch_kernel(k_attn_bwd_dq_fp8<T, D>, grid, FA_THREADS, (const T*)ds_tiles, k, T_, C, H, scale, codes);
}

/* The flash attention backward writing dqkv's codes (FaBwdCodes) where attn_bwd_fp8_fits, with
 * attn_bwd's operands (dout not overwritten); `hist` must not be empty. */
template <typename T>
static void attn_bwd_fp8(fp8* out_n, fp8* out_t, Fp8Scale* sc, const Fp8History* hist, int fmt, const T* dout,
                         const T* out, const float* lse, const T* q, const T* k, const T* v, int B, int T_, int C,
                         int H, AttnScratch<T> scratch) {
    if constexpr (FaType<T>::ok) {
        FaBwdCodes codes = {out_n, out_t, sc, hist, fmt, B * T_};
        if (attn_bwd_fp8_fits<T>(C, H)) {
            if (C / H == 32)
                return attn_bwd_fp8_flash<T, 32>(codes, dout, out, lse, q, k, v, B, T_, C, H, scratch.delta,
                                                 scratch.ds);
            return attn_bwd_fp8_flash<T, 64>(codes, dout, out, lse, q, k, v, B, T_, C, H, scratch.delta, scratch.ds);
        }
    }
    fprintf(stderr, "error: internal: attn_bwd_fp8 of C=%d H=%d\n", C, H);
    exit(1);
}

/* Delayed scaling's fused flash-attention forward (docs/DESIGN.md §18): Hopper's forward kernel (k_attn_fwd_wgmma) writes out and lse in T as
 * always (the backward's delta reads out) and besides, through FaBwdCodes with one block, the E4M3
 * codes of out as stored in T at the history's scale, row-major out_n [N][C] and transposed out_t
 * [C][N], their amax and the scale in sc: bit for bit attn_fwd with the amax, then fp8_cast with
 * the history (W_O's forward product and weight gradient read them). */
template <typename T, int D>
__global__ void __launch_bounds__(FA_THREADS, FA_MIN_BLOCKS_FWD)
    k_attn_fwd_wgmma_fp8(T* out, float* lse, const __grid_constant__ FaHeadMaps maps, int T_, int C, int H, float sl2,
                         FaBwdCodes codes) {
    await_previous_kernel();
    fa_fwd_wgmma_body<T, D, false>(out, lse, maps, T_, C, H, sl2, (unsigned*)NULL, codes);
}

/* Whether this process launches k_attn_fwd_wgmma_fp8<T, D> (as fa_fwd_wgmma_ok). */
template <typename T, int D> static bool fa_fwd_wgmma_fp8_ok(void) {
    static int ok = -1;
    if (ok < 0) ok = fa_sm90a_image(k_attn_fwd_wgmma_fp8<T, D>, FaWg<D>::SMEM);
    return ok;
}

/* Whether attn_fwd_fp8 takes attention of this shape on this GPU: the flash path with Hopper's
 * forward kernel (head sizes 32 and 64, an sm_90a image). Elsewhere (sm_89's k_attn_fwd, head size
 * 16, the cuBLAS path): attn_fwd with the amax, then fp8_cast with the history. */
template <typename T> static bool attn_fwd_fp8_fits(int C, int H) {
    return attn_fp8_fits<T>(C, H, [](auto d) { return fa_fwd_wgmma_fp8_ok<T, decltype(d)::value>(); });
}

template <typename T, int D>
static void attn_fwd_fp8_flash(const FaBwdCodes& codes, T* out, float* lse, const T* q, const T* k, const T* v, int B,
                               int T_, int C, int H) {
    float sl2 = FA_LOG2E / sqrtf((float)D); /* as attn_fwd_flash's */
    fa_check_aligned(out, q, k, v);
    fa_check_aligned(codes.out_n, codes.out_t, out, q);
    launch_kernel(k_attn_fwd_wgmma_fp8<T, D>, fa_grid(ceil_div(T_, FA_TILE), B * H), FA_THREADS, out, lse,
                  fa_head_maps<D>(q, k, v, B, T_, C), T_, C, H, sl2, codes);
}

/* The flash attention forward writing out, lse and out's E4M3 codes (FaBwdCodes) where
 * attn_fwd_fp8_fits, with attn_fwd's operands; `hist` must not be empty. */
template <typename T>
static void attn_fwd_fp8(fp8* out_n, fp8* out_t, Fp8Scale* sc, const Fp8History* hist, T* out, float* lse,
                         const T* q, const T* k, const T* v, int B, int T_, int C, int H) {
    if constexpr (FaType<T>::ok) {
        FaBwdCodes codes = {out_n, out_t, sc, hist, FP8_E4M3, B * T_};
        if (attn_fwd_fp8_fits<T>(C, H)) {
            if (C / H == 32) return attn_fwd_fp8_flash<T, 32>(codes, out, lse, q, k, v, B, T_, C, H);
            return attn_fwd_fp8_flash<T, 64>(codes, out, lse, q, k, v, B, T_, C, H);
        }
    }
    fprintf(stderr, "error: internal: attn_fwd_fp8 of C=%d H=%d\n", C, H);
    exit(1);
}

/* A list of casts done by two launches (all the amax, then all the casts): the list on the device
 * and what launching it needs. */
template <typename T> struct Fp8CastJobs {
    Fp8CastJob<T>* dev;
    int n;
    unsigned tiles;   /* the cast launch's blocks */
    size_t max_elems; /* of the largest job: sizes the amax launch */
    bool packed;      /* every job packable */
};

/* Lists the jobs host[0..n) (their first_tile filled in here) in dev (room for n, device memory). */
template <typename T>
static Fp8CastJobs<T> fp8_jobs_upload(Fp8CastJob<T>* host, int n, Fp8CastJob<T>* dev) {
    Fp8CastJobs<T> js = {dev, n, 0, 0, true};
    for (int i = 0; i < n; i++) {
        size_t elems = (size_t)host[i].batch * host[i].R * host[i].Cc;
        js.max_elems = elems > js.max_elems ? elems : js.max_elems;
        js.packed = js.packed && fp8_cast_packable(host[i]) && packable(elems, sizeof(T), {host[i].in});
    }
    for (int i = 0; i < n; i++) { /* the tiles of the kernel the list takes */
        host[i].first_tile = js.tiles;
        js.tiles += fp8_cast_blocks(host[i], js.packed);
    }
    CUDA_CHECK(cudaMemcpy(dev, host, (size_t)n * sizeof(Fp8CastJob<T>), cudaMemcpyHostToDevice));
    return js;
}

/* Every job of the list cast at the amax already in its sc (one launch). */
template <typename T> static void fp8_cast_jobs(const Fp8CastJobs<T>& js) {
    if (js.packed) launch_kernel(k_fp8_cast_jobs<T>, js.tiles, FP8_CAST_THREADS, js.dev, js.n);
    else launch_kernel(k_fp8_cast_jobs_unpacked<T>, js.tiles, FP8_CAST_THREADS, js.dev, js.n);
}

/* Every job of the list: amax (each job's sc zeroed before), then cast. */
#define FP8_JOB_AMAX_BLOCKS 128u /* per job: the weights' jobs together fill the GPU many times */
template <typename T> static void fp8_quantize_jobs(const Fp8CastJobs<T>& js) {
    unsigned per_job = elementwise_grid(js.max_elems / (js.packed ? PACK(T) : 1), FP8_AMAX_BLOCK);
    dim3 grid(per_job < FP8_JOB_AMAX_BLOCKS ? per_job : FP8_JOB_AMAX_BLOCKS, js.n);
    LAUNCH_PACKED(js.packed, k_fp8_amax_jobs, T, grid, FP8_AMAX_BLOCK, js.dev);
    fp8_cast_jobs(js);
}

/* ---------------------------------------------------------------------------------------------- */
/* The FP8 product, row-major like gemm (common.cuh):
 *     D[M,N] = descale_a descale_b (A[M,K] B[K,N]) + beta C        B given as Bt [N,K]
 * A and Bt K-major fp8 (types a_fmt, b_fmt), `batch` times with element strides; D and C (C of
 * D's layout: D itself, a residual, or ignored with beta 0) bf16 or fp32. cuBLASLt computes
 * D^T = Bt A^T column-major: its first operand is Bt (transposed), its second A. */

static cudaDataType_t fp8_dtype(int fmt) { return fmt == FP8_E4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }

/* Which pass a product belongs to, and in the backward whether it contracts as briefly as the
 * forward's (a layer's input gradient: over 3·d_model, d_model or d_ff) or over B·T positions or
 * the vocabulary (weight gradients, the classifier's dx): FP8_FAST_ACCUM (below) tells them apart. */
enum Fp8Pass { FP8_PASS_FORWARD, FP8_PASS_INPUT_GRAD, FP8_PASS_BACKWARD };

/* Fast accumulation (docs/DESIGN.md §18, docs/BENCHMARKS.md #104): Hopper's FP8 tensor cores keep a
 * tile's running sum in fewer bits than fp32, and cuBLASLt adds it into fp32 registers every few
 * steps of K unless CUBLASLT_MATMUL_DESC_FAST_ACCUM is set (instructions, registers and a
 * dependency in every tile's main loop). FP8_FAST_ACCUM 1 (the default) sets it for the forward's
 * products, which contract over d_model or d_ff (the layers' and the FP8 classifier's logits; XLA
 * and torchao's float8 training choose the same); 3 for those and the layers' input gradients,
 * which contract over 3·d_model, d_model or d_ff (docs/BENCHMARKS.md #105: 0.22 ms faster at
 * ANDREA-120M, but its 2000-step quality run ended +1.01 %, outside the 1 % budget; +0.94 % with
 * the stochastically rounded FP8 classifier, #112: at the budget's edge); 2 for every
 * product, the weight gradients too, over all B·T positions, and the classifier's dx, over the
 * vocabulary (+2.1 %); 0 for none. */
#ifndef FP8_FAST_ACCUM
#define FP8_FAST_ACCUM 1
#endif
#if FP8_FAST_ACCUM < 0 || FP8_FAST_ACCUM > 3
#error "FP8_FAST_ACCUM is 0 (none), 1 (the forward), 2 (every product) or 3 (the forward and the input gradients)"
#endif

/* Below this d_model the layers' input gradients accumulate fast too, as with FP8_FAST_ACCUM 3 (0:
 * never; docs/BENCHMARKS.md #169): their contractions are a few hundred long there (3·d_model,
 * d_model or d_ff), and ANDREA-12M's 2000-step quality run with them ended +0.17 % (#112). The
 * engine sets g_fp8_fast_input_grads from its d_model (fp8_fast_input_grads_at). */
#ifndef FP8_FAST_INPUT_GRADS_BELOW
#define FP8_FAST_INPUT_GRADS_BELOW 512
#endif
static bool g_fp8_fast_input_grads = false;
static bool fp8_fast_input_grads_at(int d_model) { return FP8_FAST_ACCUM != 0 && d_model < FP8_FAST_INPUT_GRADS_BELOW; }

/* Whether a product of pass `pass` accumulates fast (FP8_FAST_ACCUM, g_fp8_fast_input_grads). */
static bool fp8_fast_accum(Fp8Pass pass) {
    return FP8_FAST_ACCUM == 2 || (FP8_FAST_ACCUM != 0 && pass == FP8_PASS_FORWARD) ||
           (pass == FP8_PASS_INPUT_GRAD && (FP8_FAST_ACCUM == 3 || g_fp8_fast_input_grads));
}

struct Fp8GemmKey {
    int M, N, K, batch, a_fmt, b_fmt, d_type;
    int fast_accum; /* fp8_fast_accum's choice for this product's pass */
    int sm_target;  /* the multiprocessors it is planned for (g_lt_sm_target); 0: all */
    long long stride_a, stride_b, stride_d;
    unsigned align_a, align_b, align_c, align_d;
};

struct Fp8GemmPlan {
    Fp8GemmKey key;
    LtPlan lt; /* its descriptors and algorithm (its LtKey unused) */
};

#define FP8_MAX_PLANS 64
static Fp8GemmPlan g_fp8_plans[FP8_MAX_PLANS];
static int g_fp8_n_plans = 0;

static void fp8_plans_clear(void) {
    for (int i = 0; i < g_fp8_n_plans; i++) lt_plan_destroy(&g_fp8_plans[i].lt);
    g_fp8_n_plans = 0;
}

/* Descriptors and the algorithm for `key`: the heuristic's first offer, or the fixed table's
 * (common.cuh); no algorithm is an error (the shape checks of engine_setup should have refused the
 * config first). */
static void fp8_plan_make(Fp8GemmPlan* p, const Fp8GemmKey* key) {
    cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
    cudaDataType_t dt = (cudaDataType_t)key->d_type;
    LtPlan* lt = &p->lt;
    p->key = *key;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&lt->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    if (key->fast_accum) {
        int8_t on = 1;
        lt_set_desc(lt->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &on, sizeof on);
    }
    lt_set_desc(lt->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof op_t);
    lt_set_desc(lt->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof op_n);
    lt_desc_sm_target(lt->desc, key->sm_target);
    lt->a = lt_layout(fp8_dtype(key->b_fmt), key->N, key->K, key->K, key->batch, key->stride_b);
    lt->b = lt_layout(fp8_dtype(key->a_fmt), key->M, key->K, key->K, key->batch, key->stride_a);
    lt->d = lt_layout(dt, key->M, key->N, key->N, key->batch, key->stride_d);
    lt->align[0] = key->align_b, lt->align[1] = key->align_a, lt->align[2] = key->align_c, lt->align[3] = key->align_d;
    /* in gemm's terms: A [M,K] as it is, B^T [N,K] read transposed; D plain or the residual join
     * (the same descriptors: one plan serves both) */
    /* a configuration the table measured in one accumulation mode is never taken for the other */
    const char* kind = key->fast_accum ? "fp8fa" : "fp8";
    lt_key_name(lt->name, fp8_dtype(key->a_fmt), fp8_dtype(key->b_fmt), dt, kind, false, true, key->M, key->N, key->K,
                key->K, key->K, key->N, key->batch, key->stride_a, key->stride_b, key->stride_d);
    cublasStatus_t st = lt_plan_algo(lt, NULL);
    if (!lt->ok) {
        fprintf(stderr,
                "error: cuBLASLt has no FP8 algorithm for D[%d,%d] (%s) = A[%d,%d] (%s) B[%d,%d] (%s), batch %d "
                "(status %d); FP8 products need K a multiple of 16 and 16-byte aligned operands\n",
                key->M, key->N, dt == CUDA_R_32F ? "fp32" : "bf16", key->M, key->K, key->a_fmt ? "e5m2" : "e4m3",
                key->K, key->N, key->b_fmt ? "e5m2" : "e4m3", key->batch, (int)st);
        exit(1);
    }
}

static Fp8GemmPlan* fp8_plan(const Fp8GemmKey* key) {
    for (int i = 0; i < g_fp8_n_plans; i++)
        if (!memcmp(&g_fp8_plans[i].key, key, sizeof *key)) return &g_fp8_plans[i];
    if (g_fp8_n_plans == FP8_MAX_PLANS) fp8_plans_clear(); /* only kernel_check's many shapes get here */
    Fp8GemmPlan* p = &g_fp8_plans[g_fp8_n_plans++];
    fp8_plan_make(p, key);
    return p;
}

/* One FP8 operand: where, its format, the cast scale it was made with, its batch stride. */
struct Fp8Mat {
    const fp8* p;
    int fmt;
    const Fp8Scale* sc;
    long long stride;
};

static Fp8Mat fp8_mat(const fp8* p, int fmt, const Fp8Scale* sc, long long stride = 0) {
    Fp8Mat m = {p, fmt, sc, stride};
    return m;
}

/* D [M,N] (type TD: bf16 or float) = A [M,K] Bt[N,K]^T + beta C, as at the top of this section, a
 * product of pass `pass` (which sets its accumulation, FP8_FAST_ACCUM). */
template <typename TD>
static void fp8_gemm(Fp8Pass pass, int M, int N, int K, Fp8Mat A, Fp8Mat Bt, TD* D, const TD* C, float beta,
                     int batch = 1, long long stride_d = 0) {
    Fp8GemmKey key;
    memset(&key, 0, sizeof key);
    key.M = M, key.N = N, key.K = K, key.batch = batch, key.a_fmt = A.fmt, key.b_fmt = Bt.fmt;
    key.fast_accum = fp8_fast_accum(pass);
    key.sm_target = g_lt_sm_target;
    key.d_type = TypeInfo<TD>::dtype;
    key.stride_a = A.stride, key.stride_b = Bt.stride, key.stride_d = stride_d;
    key.align_a = lt_alignment(A.p), key.align_b = lt_alignment(Bt.p);
    key.align_c = lt_alignment(C ? C : D), key.align_d = lt_alignment(D);
    LtPlan* p = &fp8_plan(&key)->lt;
    const float* a_descale = &Bt.sc->descale; /* cuBLASLt's A is our Bt */
    const float* b_descale = &A.sc->descale;
    if (lt_alignment(a_descale) < FP8_SCALE_ALIGN || lt_alignment(b_descale) < FP8_SCALE_ALIGN) {
        fprintf(stderr, "error: internal: an fp8 scale is not %d-byte aligned\n", FP8_SCALE_ALIGN);
        exit(1);
    }
    lt_set_desc(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_descale, sizeof a_descale);
    lt_set_desc(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_descale, sizeof b_descale);
    float alpha = 1.0f;
    if (g_lt_watch) {
        Mat a = {A.p, fp8_dtype(A.fmt), K, A.stride, false}, b = {Bt.p, fp8_dtype(Bt.fmt), K, Bt.stride, true};
        Mat d = {D, TypeInfo<TD>::dtype, N, stride_d, false};
        Gemm g = {M, N, K, batch, a, b, d, alpha, beta};
        g_lt_watch(p, g, C ? (const void*)C : D, NULL);
    }
    CUBLAS_CHECK(cublasLtMatmul(g_cublaslt, p->desc, &alpha, Bt.p, p->a, A.p, p->b, &beta, C ? (const void*)C : D,
                                p->d, D, p->d, &p->algo, g_gemm_workspace, p->workspace, g_stream));
    if (sync_launches()) CUDA_CHECK(cudaDeviceSynchronize());
}

/* ---------------------------------------------------------------------------------------------- */
/* The FP8 classifier (docs/DESIGN.md §18; where it pays, cpu/fp8.h's fp8_classifier_pays): the
 * tied classifier's three products in FP8, around the same loss rows as loss.cuh's loss_fwd /
 * loss_fwd_bwd. Its operands for one chunk of n rows: LNf's output x [n, C] for the logits and x^T
 * [C, n] for dwte (E4M3, cast once a forward at LNf's current scale, its amax fused into the
 * LayerNorm); wte [Vp, C] for the logits and wte^T [C, Vp] for dx (E4M3, cast with the layers'
 * weights); dlogits' codes [n, Vp] for dx and [Vp, n] for dwte (FP8_DLOGITS_FMT at the static scale
 * fp8_dlogits_scale, written to g_sc: the loss rows write the row-major codes themselves,
 * loss_fwd_bwd_fp8, rounded stochastically with the micro-batch's salt, the chunk's first row
 * row0 in the micro-batch). */
struct Fp8ClassifierOps {
    Fp8Mat x, wte;          /* the logits product's operands */
    const fp8 *x_t, *wte_t; /* at x's and wte's scales */
    fp8 *g, *g_t;
    Fp8Scale* g_sc;
    const unsigned* salt; /* device: cpu/fp8.h's fp8_dlogits_salt of the micro-batch */
    int row0;
};

/* LNf's output x [N, C] cast for the FP8 classifier at the current scale of the amax in sc (the
 * LayerNorm's): row-major into out_n and, when out_t is not NULL (training), transposed chunk by
 * chunk of the logits (the `chunk` rows from r0: [C][n] at out_t + r0 * C, dwte's x_t). */
template <typename T>
static void fp8_cast_classifier_input(fp8* out_n, fp8* out_t, Fp8Scale* sc, const T* x, int N, int C, int chunk) {
    if (!out_t) chunk = N;
    for (int r0 = 0; r0 < N; r0 += chunk) {
        size_t at = (size_t)r0 * C;
        fp8_cast(out_n + at, out_t ? out_t + at : NULL, sc, x + at, 1, N - r0 < chunk ? N - r0 : chunk, C, FP8_E4M3);
    }
}

/* Where the codes go. A base of LossStoreFp8's rather than its own fields: nvcc schedules the loss
 * rows' instructions differently for the flat struct, and with this one they are, byte for byte,
 * those of the build #83 and #84 were measured with. */
struct LossStoreFp8Out {
    fp8* codes;
    Fp8Scale* sc;
    int Vp;
    const unsigned* salt; /* device: the micro-batch's (cpu/fp8.h's fp8_dlogits_salt) */
    int row0;             /* the block's row 0 in the micro-batch */
};
/* What a row's stores take: the codes' scale and the row's random key (cpu/fp8.h's fp8_sr_row_key). */
struct LossStoreFp8Row {
    float s;
    unsigned key;
};

/* The FP8 classifier's loss rows (loss.cuh's Store) write dlogits' codes [n, Vp] row-major in
 * FP8_DLOGITS_FMT instead of T over the logits: each value as it would be stored in T, at the static
 * scale s = fp8_dlogits_scale(ds) (cpu/fp8.h), which the first packet of row 0 writes to sc, rounded
 * stochastically (cpu/fp8.h's fp8_round_stochastic, with the bits of the value's row and column in
 * the micro-batch: the CPU engine's, bit for bit; tests/kernel_check.cu). In few instructions a
 * packet (docs/BENCHMARKS.md #83: the loss rows 1.2x faster): s and the row's key come once a row
 * (loss_store_row_arg; the compiler does not hoist fp8_dlogits_scale's frexpf / ldexpf out of the
 * row loop), a pair of values takes one packed T conversion (as_stored2, the same rounding as
 * as_stored) and one FP8 conversion (fp8_cvt2, as fp8_cvt's, exact on the rounded values), whose
 * 16-bit results make the 8-byte store with no byte shuffling. */
struct LossStoreFp8 : LossStoreFp8Out {
    template <typename T, int VEC>
    __device__ __forceinline__ void store(T* l, int row, int j, const float (&v)[VEC], LossStoreFp8Row a) const {
        static_assert(FP8_SR_PACKET % VEC == 0, "a packet of the loss rows lies in one packet of random bits");
        fp8* dst = codes + (size_t)row * Vp + j;
        unsigned bits = fp8_sr_packet_bits(a.key, j / FP8_SR_PACKET);
        int k0 = j % FP8_SR_PACKET;
        (void)l;
        if constexpr (VEC == 8) {
            unsigned short q[VEC / 2];
            for (int k = 0; k < VEC; k += 2) {
                float2 y = as_stored2<T>(v[k], v[k + 1]);
                q[k / 2] = fp8_cvt2(fp8_round_stochastic(y.x * a.s, fp8_sr_value_bits(bits, k), FP8_DLOGITS_FMT),
                                    fp8_round_stochastic(y.y * a.s, fp8_sr_value_bits(bits, k + 1), FP8_DLOGITS_FMT),
                                    FP8_DLOGITS_FMT);
            }
            uint2 w;
            memcpy(&w, q, sizeof w);
            *reinterpret_cast<uint2*>(dst) = w; /* Vp and j multiples of 8 (the packed kernels) */
        } else {
            for (int k = 0; k < VEC; k++)
                dst[k] = fp8_cvt(fp8_round_stochastic(as_stored<T>(v[k]) * a.s, fp8_sr_value_bits(bits, k0 + k),
                                                      FP8_DLOGITS_FMT),
                                 FP8_DLOGITS_FMT);
        }
        if (row == 0 && j == 0) {
            sc->scale = a.s;
            sc->descale = 1.0f / a.s;
        }
    }
};
/* Its store()'s row argument: the codes' scale, derived from ds, and the row's key, once a row
 * (loss.cuh's loss_row). */
__device__ __forceinline__ LossStoreFp8Row loss_store_row_arg(const LossStoreFp8& st, float ds, int row) {
    return {fp8_dlogits_scale(ds), fp8_sr_row_key(*st.salt, st.row0 + row)};
}
/* loss.cuh's loss_grad_lean: the same codes (docs/BENCHMARKS.md #84) */
template <> struct LossStoreLean<LossStoreFp8> : std::true_type {};

static_assert(FP8_COL_PACKET == 16, "a transposed packet is one 16-byte store");

/* The FP8 classifier's dlogits for dwte: out [Cc][R] = the codes in [R][Cc] transposed (R and Cc
 * multiples of 16, both pointers 16-byte aligned: fp8_transpose checks), in tiles of FP8_TP_TILE x
 * FP8_TP_TILE codes (16 KB) a block (twice the rate of 64 x 64 tiles, docs/BENCHMARKS.md #81). A thread issues its
 * FP8_TP_LOADS 16-byte row loads (a warp: 4 whole 128-byte rows) before it stores one to shared
 * memory, where 16-byte chunk q of tile row r sits at q ^ (r / 16 % 8): a quarter warp's row
 * stores and the transposed pass's word reads fall on disjoint banks. The transposed pass: a thread
 * 4 columns x 16 rows (16 word reads, a 4 x 4 byte transpose in registers per 4 rows), a warp 4
 * column groups x all 8 row groups of the tile, so each of its 4 column stores writes 4 whole
 * 128-byte lines. Consecutive blocks take the tiles down a column of tiles: they complete rows of
 * out, and read runs of rows of in, together (6 % faster than across a row of tiles). */
#define FP8_TP_TILE 128
#define FP8_TP_CHUNKS (FP8_TP_TILE / 16)                                /* 16-byte chunks a tile row */
#define FP8_TP_ROW_STEP (FP8_CAST_THREADS / FP8_TP_CHUNKS)              /* rows a load pass */
#define FP8_TP_LOADS (FP8_TP_TILE / FP8_TP_ROW_STEP)                    /* row loads a thread */
static_assert(FP8_TP_LOADS * FP8_TP_ROW_STEP == FP8_TP_TILE, "the load passes cover the tile");
static_assert(FP8_CAST_THREADS == FP8_TP_TILE / 4 * FP8_TP_CHUNKS,
              "the transposed pass: 4 columns x 16 rows a thread");
static_assert(FP8_TP_CHUNKS == 8 && FP8_CAST_THREADS / 32 * 4 == FP8_TP_TILE / 4,
              "a warp: 4 column groups x 8 row groups; the swizzle spans the 8 chunks of a row");

static unsigned fp8_transpose_tiles(int R, int Cc) {
    return ceil_div(R, FP8_TP_TILE) * ceil_div(Cc, FP8_TP_TILE);
}

/* Columns j of 4 rows' words a[0..3] (byte j of a word: column j): col[j] holds rows 0..3 of column j. */
__device__ __forceinline__ void fp8_transpose4x4(unsigned (&col)[4], const unsigned (&a)[4]) {
    unsigned t0 = __byte_perm(a[0], a[1], 0x5140), t1 = __byte_perm(a[0], a[1], 0x7362); /* rows 0,1 interleaved */
    unsigned t2 = __byte_perm(a[2], a[3], 0x5140), t3 = __byte_perm(a[2], a[3], 0x7362); /* rows 2,3 interleaved */
    col[0] = __byte_perm(t0, t2, 0x5410), col[1] = __byte_perm(t0, t2, 0x7632);
    col[2] = __byte_perm(t1, t3, 0x5410), col[3] = __byte_perm(t1, t3, 0x7632);
}

__global__ void __launch_bounds__(FP8_CAST_THREADS) k_fp8_transpose(fp8* __restrict__ out, const fp8* __restrict__ in,
                                                                    int R, int Cc) {
    await_previous_kernel();
    __shared__ uint4 tile[FP8_TP_TILE][FP8_TP_CHUNKS];
    unsigned tiles_r = ceil_div(R, FP8_TP_TILE);
    unsigned tile_r = blockIdx.x % tiles_r, tile_c = blockIdx.x / tiles_r;
    int r0 = (int)tile_r * FP8_TP_TILE, c0 = (int)tile_c * FP8_TP_TILE;
    int q = threadIdx.x % FP8_TP_CHUNKS, tr0 = threadIdx.x / FP8_TP_CHUNKS;
    uint4 v[FP8_TP_LOADS] = {}; /* rows past R: zeros, never read back */
#pragma unroll
    for (int i = 0; i < FP8_TP_LOADS; i++) { /* R and Cc multiples of 16: a chunk is wholly in or out */
        int r = r0 + tr0 + i * FP8_TP_ROW_STEP, c = c0 + q * 16;
        if (r < R && c < Cc) v[i] = *reinterpret_cast<const uint4*>(in + (size_t)r * Cc + c);
    }
#pragma unroll
    for (int i = 0; i < FP8_TP_LOADS; i++) {
        int tr = tr0 + i * FP8_TP_ROW_STEP;
        tile[tr][q ^ tr / 16 % 8] = v[i];
    }
    __syncthreads();
    /* this thread's rows 16 seg .. 16 seg + 15 and columns 4 group .. 4 group + 3 of the tile */
    int lane = threadIdx.x % 32, seg = lane % 8, group = threadIdx.x / 32 * 4 + lane / 8;
    int r = r0 + seg * 16, c = c0 + group * 4;
    if (r >= R || c >= Cc) return; /* a row group of 16 and (Cc a multiple of 16) 4 columns: wholly in or out */
    const unsigned* words = reinterpret_cast<const unsigned*>(tile);
    unsigned col[4][4]; /* column j, rows 4m .. 4m + 3 */
#pragma unroll
    for (int m = 0; m < 4; m++) {
        unsigned a[4], t[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int tr = seg * 16 + m * 4 + k; /* its chunk's swizzle is seg */
            a[k] = words[tr * FP8_TP_TILE / 4 + (group / 4 ^ seg) * 4 + group % 4];
        }
        fp8_transpose4x4(t, a);
#pragma unroll
        for (int j = 0; j < 4; j++) col[j][m] = t[j];
    }
#pragma unroll
    for (int j = 0; j < 4; j++)
        *reinterpret_cast<uint4*>(out + (size_t)(c + j) * R + r) =
            make_uint4(col[j][0], col[j][1], col[j][2], col[j][3]);
}

static void fp8_transpose(fp8* out, const fp8* in, int R, int Cc) {
    if (R % 16 || Cc % 16 || (uintptr_t)out % 16 || (uintptr_t)in % 16) {
        fprintf(stderr, "error: internal: fp8_transpose of [%d, %d] codes (multiples of 16, 16-byte aligned)\n", R, Cc);
        exit(1);
    }
    launch_kernel(k_fp8_transpose, fp8_transpose_tiles(R, Cc), FP8_CAST_THREADS, out, in, R, Cc);
}

/* Evaluation: the chunk's row losses and lse; logits [n, Vp] is scratch. */
template <typename T>
static void loss_fwd_fp8(float* losses, float* lse, T* logits, const Fp8ClassifierOps& c, const int* targets, int n,
                         int C, int V, int Vp) {
    fp8_gemm<T>(FP8_PASS_FORWARD, n, Vp, C, c.x, c.wte, logits, NULL, 0.0f);
    loss_rows(losses, lse, logits, targets, n, V, Vp, (const float*)NULL);
}

/* Training with only the logits product in FP8 (train.fp8_classifier logits): loss_fwd_fp8's
 * product, then the rest of loss.cuh's loss_fwd_bwd on LNf's output x [n, C] and wte [Vp, C] in T
 * (the casts' x_t, wte_t and dlogits' codes are not made). */
template <typename T>
static void loss_fwd_fp8_bwd(float* losses, float* lse, T* dx, float* dwte, T* logits, const Fp8ClassifierOps& c,
                             const T* x, const T* wte, const int* targets, int n, int C, int V, int Vp,
                             const float* dscale, float grad_beta) {
    fp8_gemm<T>(FP8_PASS_FORWARD, n, Vp, C, c.x, c.wte, logits, NULL, 0.0f);
    loss_bwd_from_logits(losses, lse, dx, dwte, logits, x, wte, targets, n, C, V, Vp, dscale, grad_beta,
                         (float*)NULL); /* the loss rows' path (no scratch for the fused one) */
}

/* Training: as loss_fwd_fp8, then dlogits' codes, dwte (/ += by grad_beta) = dlogits^T @ x on the
 * side stream (it reads g_t: the caller waits for it, side_wait(c.g_t), before the next chunk's
 * codes) and dx = dlogits @ wte. The loss rows write the row-major codes themselves (LossStoreFp8),
 * a transpose the other layout. */
template <typename T>
static void loss_fwd_bwd_fp8(float* losses, float* lse, T* dx, float* dwte, T* logits, const Fp8ClassifierOps& c,
                             const int* targets, int n, int C, int V, int Vp, const float* dscale, float grad_beta) {
    fp8_gemm<T>(FP8_PASS_FORWARD, n, Vp, C, c.x, c.wte, logits, NULL, 0.0f);
    loss_rows(losses, lse, logits, targets, n, V, Vp, dscale, LossStoreFp8{c.g, c.g_sc, Vp, c.salt, c.row0});
    fp8_transpose(c.g_t, c.g, n, Vp);
    side_product(c.g_t, [&] {
        fp8_gemm<float>(FP8_PASS_BACKWARD, Vp, C, n, fp8_mat(c.g_t, FP8_DLOGITS_FMT, c.g_sc),
                        fp8_mat(c.x_t, FP8_E4M3, c.x.sc), dwte, NULL, grad_beta);
    });
    fp8_gemm<T>(FP8_PASS_BACKWARD, n, C, Vp, fp8_mat(c.g, FP8_DLOGITS_FMT, c.g_sc), fp8_mat(c.wte_t, FP8_E4M3, c.wte.sc),
                dx, NULL, 0.0f);
}

#endif
