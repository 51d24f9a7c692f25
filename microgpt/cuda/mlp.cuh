/* mlp.cuh: the MLP sub-layer out = gelu_tanh(x @ W_1) @ W_2 (no biases), and the residual join
 * that follows it in the block (out = xmid + MLP(LN2(xmid)), fused into the second product).
 * The forward saves the pre-activation h = x @ W_1 and h_gelu = gelu(h), both [N, F]: the backward
 * needs h_gelu for dW_2, and keeping it costs N·F values per layer where recomputing it costs a
 * full element-wise pass per layer and step (docs/BENCHMARKS.md has the trade measured).
 *
 * Roles (docs/DESIGN.md §3.1): mlp_fwd / mlp_bwd are the k_mlp_fwd / k_mlp_bwd pair. Their GELU
 * runs in the products' epilogues: the backward's on Hopper in our own product
 * (k_gemm_dgelu_pingpong, below), elsewhere in cuBLASLt's (GEMM_GELU_AUX, GEMM_DGELU, common.cuh)
 * where it has them, otherwise in the kernels k_gelu_fwd and k_gelu_bwd_inplace after a plain
 * product. */
#ifndef MICROGPT_CUDA_MLP_CUH
#define MICROGPT_CUDA_MLP_CUH

#include "attention.cuh" /* the warpgroup products' primitives (fa_wg_*) */
#include "matmul.cuh"
#include "tma.cuh"

#define GELU_SCALE_F 0.7978845608028654f /* sqrt(2/pi) */
#define GELU_CUBIC_F 0.044715f

/* The GELU's tanh: for precision fp8 the hardware's approximation (GELU_TANH_APPROX: one
 * tanh.approx.f32, MUFU.TANH, sm_75 and up; PTX ISA: relative error at most 2^-11; fp8.cuh's
 * FP8_GELU_TANH says why) and for bf16's GELU-backward product on Hopper (k_gemm_dgelu_pingpong,
 * below: the accurate tanhf would lengthen the epilogue that bounds it), for every other precision
 * and for generation (decode.cuh) CUDA's accurate tanhf (GELU_TANH_ACCURATE: a few ulps from the
 * CPU engine's glibc tanhf). */
enum { GELU_TANH_ACCURATE, GELU_TANH_APPROX };

template <int TANH> __device__ __forceinline__ float gelu_tanh(float u) {
    if constexpr (TANH == GELU_TANH_APPROX) {
        float t;
        asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(u));
        return t;
    } else {
        return tanhf(u);
    }
}

template <int TANH = GELU_TANH_ACCURATE> __device__ __forceinline__ float gelu_f(float x) {
    return 0.5f * x * (1.0f + gelu_tanh<TANH>(GELU_SCALE_F * (x + GELU_CUBIC_F * x * x * x)));
}

template <int TANH = GELU_TANH_ACCURATE> __device__ __forceinline__ float gelu_grad_f(float x) {
    /* Factored on u = x²: tanh's argument x (S + SC u), its slope S + 3SC u, and
     * 0.5 (1 + t) + 0.5 x (1 - t²) (S + 3SC u) as fused multiply-adds, 5 FMUL, 5 FFMA and the tanh an
     * element of the GELU-backward product's epilogue (with its product by dh) where the unfactored
     * form took 9 FMUL, 4 FFMA and an FADD: that epilogue bounds the product (docs/BENCHMARKS.md
     * #167: -2 µs a launch at ANDREA-120M's shape). Its float32 error from the float64 derivative
     * is the unfactored form's (the tanh's). */
    float u = x * x;
    float t = gelu_tanh<TANH>(x * fmaf(GELU_SCALE_F * GELU_CUBIC_F, u, GELU_SCALE_F));
    float half_x_slope = 0.5f * x * fmaf(3.0f * GELU_SCALE_F * GELU_CUBIC_F, u, GELU_SCALE_F);
    return fmaf(0.5f, t, fmaf(half_x_slope, fmaf(-t, t, 1.0f), 0.5f));
}

/* amax_bits (precision fp8's MLP, whose GELU output is an FP8 product's operand; else NULL): the
 * output's amax as stored, atomicMax'ed in (common.cuh), saving the cast a full read. TANH: the
 * GELU's tanh (gelu_tanh); the kernel of each form is below (each waits for its predecessor first). */
template <int TANH, typename T, int VEC>
__device__ __forceinline__ void gelu_fwd_packets(T* __restrict__ out, const T* __restrict__ x, size_t n,
                                                 unsigned* amax_bits) {
    unsigned am = 0;
    FOR_PACKETS(i, n) {
        float v[VEC];
        load_vec(v, x + i);
        for (int k = 0; k < VEC; k++) {
            v[k] = gelu_f<TANH>(v[k]);
            am = max(am, abs_bits(as_stored<T>(v[k])));
        }
        store_vec(out + i, v);
    }
    block_amax_commit(amax_bits, am);
}

/* In place: d = d * gelu'(x). d arrives as the gradient of the GELU output and leaves as that of
 * its input; the MLP backward owns d as scratch, so nothing needs accumulating here. amax_bits:
 * as in gelu_fwd_packets, of the new d. */
template <int TANH, typename T, int VEC>
__device__ __forceinline__ void gelu_bwd_packets(T* __restrict__ d, const T* __restrict__ x, size_t n,
                                                 unsigned* amax_bits) {
    unsigned am = 0;
    FOR_PACKETS(i, n) {
        float dv[VEC], xv[VEC];
        load_vec(dv, d + i);
        load_vec(xv, x + i);
        for (int k = 0; k < VEC; k++) {
            dv[k] *= gelu_grad_f<TANH>(xv[k]);
            am = max(am, abs_bits(as_stored<T>(dv[k])));
        }
        store_vec(d + i, dv);
    }
    block_amax_commit(amax_bits, am);
}

template <typename T, int VEC>
__global__ void k_gelu_fwd(T* __restrict__ out, const T* __restrict__ x, size_t n, unsigned* amax_bits) {
    await_previous_kernel();
    gelu_fwd_packets<GELU_TANH_ACCURATE, T, VEC>(out, x, n, amax_bits);
}

template <typename T, int VEC>
__global__ void k_gelu_bwd_inplace(T* __restrict__ d, const T* __restrict__ x, size_t n, unsigned* amax_bits) {
    await_previous_kernel();
    gelu_bwd_packets<GELU_TANH_ACCURATE, T, VEC>(d, x, n, amax_bits);
}

/* The approximate tanh's kernels (precision fp8's: FP8_GELU_TANH). */
template <typename T, int VEC>
__global__ void k_gelu_fwd_fast_tanh(T* __restrict__ out, const T* __restrict__ x, size_t n, unsigned* amax_bits) {
    await_previous_kernel();
    gelu_fwd_packets<GELU_TANH_APPROX, T, VEC>(out, x, n, amax_bits);
}

template <typename T, int VEC>
__global__ void k_gelu_bwd_inplace_fast_tanh(T* __restrict__ d, const T* __restrict__ x, size_t n,
                                             unsigned* amax_bits) {
    await_previous_kernel();
    gelu_bwd_packets<GELU_TANH_APPROX, T, VEC>(d, x, n, amax_bits);
}

/* The grid of an element-wise kernel over n values (packets when `packed`) that may end in an amax. */
template <typename T> static unsigned gelu_grid(size_t n, bool packed, const unsigned* amax_bits) {
    return amax_grid(elementwise_grid(n / (packed ? PACK(T) : 1), 256), amax_bits);
}

template <typename T, int TANH = GELU_TANH_ACCURATE>
static void gelu_fwd(T* out, const T* x, size_t n, unsigned* amax_bits = NULL) {
    bool packed = packable(n, sizeof(T), {out, x});
    unsigned grid = gelu_grid<T>(n, packed, amax_bits);
    if constexpr (TANH == GELU_TANH_APPROX) LAUNCH_PACKED(packed, k_gelu_fwd_fast_tanh, T, grid, 256, out, x, n, amax_bits);
    else LAUNCH_PACKED(packed, k_gelu_fwd, T, grid, 256, out, x, n, amax_bits);
}

template <typename T, int TANH = GELU_TANH_ACCURATE>
static void gelu_bwd_inplace(T* d, const T* x, size_t n, unsigned* amax_bits = NULL) {
    bool packed = packable(n, sizeof(T), {d, x});
    unsigned grid = gelu_grid<T>(n, packed, amax_bits);
    if constexpr (TANH == GELU_TANH_APPROX) LAUNCH_PACKED(packed, k_gelu_bwd_inplace_fast_tanh, T, grid, 256, d, x, n, amax_bits);
    else LAUNCH_PACKED(packed, k_gelu_bwd_inplace, T, grid, 256, d, x, n, amax_bits);
}

/* The GELU backward's product, dh [M, N] = (dout [M, K] @ w [N, K]^T) * gelu'(h), on Hopper
 * (sm_90a, bf16; docs/BENCHMARKS.md #123-#124): cuBLASLt's one DGELU kernel for it runs at ~420
 * TFLOP/s in a step, behind a memset of its own, and this product is the step's largest.
 *
 * Persistent and warp-specialised, one block a multiprocessor, 384 threads in three warpgroups:
 *   - the producer: one thread loads, by TMA, each k step's A (128 rows of dout x 64) and B (128
 *     rows of w x 64) into a ring of DGP_STAGES stages, for every tile of the block in turn, and
 *     each tile's h into its consumer's buffer;
 *   - two consumers "pingpong": they take the block's 128 x 128 tiles alternately, so while one runs
 *     its tile's products (two m64n128k16 a 16-wide k step, 128 fp32 accumulators a thread) the
 *     other runs its epilogue, and the tensor cores wait for neither. The epilogue reads h from
 *     the buffer (the 128-byte swizzle spreads a warp's reads over all 32 banks), writes dh over it
 *     in place and stores the tile by TMA.
 * Barriers (tma.cuh): full[s] / empty[s] per stage (the TMA's bytes have landed / the consumer's 4
 * warps are done with it); h_full[c] / h_empty[c] per consumer buffer (empty again once its store
 * has read it); order[c]: the other consumer's previous tile has passed all its waits on the ring.
 * A consumer waits on that before taking its own tile's stages, which keeps every ring wait within
 * one phase of its barrier: without it, a consumer could find its stage's parity completed by the
 * stage's use two phases back. The products run in a fixed order: results do not depend on timing. */
#define DGP_TILE 128
#define DGP_BK 64 /* one swizzled 128-byte row of bf16 */
#define DGP_STAGES 4
#define DGP_THREADS 384
#define DGP_STAGE_BYTES (2 * DGP_TILE * DGP_BK * 2) /* A's and B's 128 rows of 64 values */
#define DGP_H_BYTES (DGP_TILE * DGP_TILE * 2)      /* a tile of h, as two boxes of 64 columns */
#define DGP_SMEM (DGP_STAGES * DGP_STAGE_BYTES + 2 * DGP_H_BYTES + 1024 + (2 * DGP_STAGES + 6) * 8)

/* acc[64][128] += A · B^T over one 16-wide k step, both K-major in shared memory (descriptors). */
__device__ __forceinline__ void dgp_wgmma(float (*acc)[4], unsigned long long a, unsigned long long b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" FA_WG_R32
                 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, "
                 "%52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, 1, 1, 1, 0, 0;\n"
                 : FA_WG_F32(acc, "+f"), FA_WG_F4(acc, 8, "+f"), FA_WG_F4(acc, 9, "+f"), FA_WG_F4(acc, 10, "+f"),
                   FA_WG_F4(acc, 11, "+f"), FA_WG_F4(acc, 12, "+f"), FA_WG_F4(acc, 13, "+f"), FA_WG_F4(acc, 14, "+f"),
                   FA_WG_F4(acc, 15, "+f")
                 : "l"(a), "l"(b));
}

/* The epilogue of consumer c's tile: dh = acc * gelu'(h), h read from and dh written to the
 * buffer at tile_h. This lane's pairs are rows 64 mh + 16 warp + g + 8 hh, columns 8 j + 2 t, + 1;
 * column 8 j's 16-byte chunk is chunk j % 8 of box j / 8, XOR'ed with row % 8 = g. */
template <typename T>
__device__ __forceinline__ void dgp_epilogue(float (*acc)[DGP_TILE / 8][4], unsigned tile_h, int warp, int lane) {
    int g = lane >> 2, t = lane & 3;
#pragma unroll /* whole, so acc stays in registers */
    for (int mh = 0; mh < 2; mh++)
#pragma unroll
        for (int j = 0; j < DGP_TILE / 8; j++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                int r = 64 * mh + 16 * warp + g + 8 * hh;
                unsigned at = tile_h + (j >> 3) * (DGP_H_BYTES / 2) + r * 128 + (((j & 7) ^ g) << 4) + 4 * t, hw;
                asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(hw) : "r"(at));
                T x[2];
                memcpy(x, &hw, sizeof hw);
                unsigned out = fa_pack<T>(acc[mh][j][2 * hh] * gelu_grad_f<GELU_TANH_APPROX>(to_f(x[0])),
                                          acc[mh][j][2 * hh + 1] * gelu_grad_f<GELU_TANH_APPROX>(to_f(x[1])));
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(out) : "memory");
            }
}

template <typename T>
__global__ void __launch_bounds__(DGP_THREADS, 1)
    k_gemm_dgelu_pingpong(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                          const __grid_constant__ CUtensorMap h_map, const __grid_constant__ CUtensorMap dh_map, int M,
                          int N, int K) {
    await_previous_kernel();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(1024) unsigned char dgp_smem[];
    unsigned smem_addr = (unsigned)__cvta_generic_to_shared(dgp_smem), pad = (1024 - (smem_addr & 1023)) & 1023;
    unsigned ring = smem_addr + pad;                     /* stage s: A, then B */
    unsigned hbuf = ring + DGP_STAGES * DGP_STAGE_BYTES; /* consumer c's h tile at c H_BYTES */
    unsigned bars = hbuf + 2 * DGP_H_BYTES;
    auto full = [&](int s) { return bars + 8 * s; };
    auto empty = [&](int s) { return bars + 8 * (DGP_STAGES + s); };
    auto h_full = [&](int c) { return bars + 8 * (2 * DGP_STAGES + c); };
    auto h_empty = [&](int c) { return bars + 8 * (2 * DGP_STAGES + 2 + c); };
    auto order = [&](int c) { return bars + 8 * (2 * DGP_STAGES + 4 + c); };
    /* the block's tiles: i-th at tile index blockIdx.x + i gridDim.x, consumer i % 2's. The warpgroup
     * by a broadcast, which ptxas knows is the same in every lane: the stages and descriptors derived
     * from it can then live in uniform registers, where the products read their descriptors */
    int wg = __shfl_sync(0xFFFFFFFFu, threadIdx.x >> 7, 0), n_k = K / DGP_BK, tiles_n = N / DGP_TILE;
    int n_tiles = M / DGP_TILE * tiles_n;
    if (threadIdx.x == 0) {
        for (int s = 0; s < DGP_STAGES; s++) {
            mbar_init(full(s), 1);  /* the producer's arrival; the TMA's bytes complete it */
            mbar_init(empty(s), 4); /* lane 0 of each warp of the consumer whose tile it holds */
        }
        for (int c = 0; c < 2; c++) {
            mbar_init(h_full(c), 1);
            mbar_init(h_empty(c), 1); /* the consumer's storing thread */
            mbar_init(order(c), 1);   /* the other consumer's first thread */
        }
        mbar_init_fence();
    }
    __syncthreads();
    if (wg == 0) {
        if (threadIdx.x != 0) return;
        /* the producer. h's load waits for its buffer behind the tile's first stages, which the
         * buffer's consumer needs to get that far */
        int s = 0, h_step = min(DGP_STAGES - 1, n_k - 1);
        unsigned phase = 0;
        for (int i = 0, tile = blockIdx.x; tile < n_tiles; i++, tile += gridDim.x) {
            int c = i & 1, m0 = tile / tiles_n * DGP_TILE, n0 = tile % tiles_n * DGP_TILE;
            for (int kt = 0; kt < n_k; kt++) {
                mbar_wait(empty(s), phase ^ 1);
                mbar_arrive_expect_bytes(full(s), DGP_STAGE_BYTES);
                tma_load(ring + s * DGP_STAGE_BYTES, &a_map, kt * DGP_BK, m0, full(s));
                tma_load(ring + s * DGP_STAGE_BYTES + DGP_STAGE_BYTES / 2, &b_map, kt * DGP_BK, n0, full(s));
                if (++s == DGP_STAGES) s = 0, phase ^= 1;
                if (kt == h_step) { /* consumer c's (i / 2)-th tile: its buffer's (i / 2)-th fill */
                    mbar_wait(h_empty(c), ((i >> 1) & 1) ^ 1);
                    mbar_arrive_expect_bytes(h_full(c), DGP_H_BYTES);
                    for (int q = 0; q < 2; q++)
                        tma_load(hbuf + c * DGP_H_BYTES + q * DGP_H_BYTES / 2, &h_map, n0 + 64 * q, m0, h_full(c));
                }
            }
        }
        return;
    }
    /* consumer c = wg - 1: the block's tiles i = c, c + 2, ... Every product's descriptor is an offset
     * of the ring's (fa_wg_desc_at): building each anew took most of a k step's instructions, issued
     * beside the other consumer's epilogue (docs/BENCHMARKS.md #165-#166). */
    int c = wg - 1, lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
    unsigned tile_h = hbuf + c * DGP_H_BYTES;
    const unsigned long long ring_desc = fa_wg_desc<64>(ring, 16);
    for (int i = c, tile = blockIdx.x + c * gridDim.x; tile < n_tiles; i += 2, tile += 2 * gridDim.x) {
        int m0 = tile / tiles_n * DGP_TILE, n0 = tile % tiles_n * DGP_TILE;
        unsigned step = (unsigned)i * n_k, phase = (step / DGP_STAGES) & 1; /* the tile's place in the ring */
        int s = step % DGP_STAGES, prev = -1; /* prev: the stage whose products the last wait left running */
        float acc[2][DGP_TILE / 8][4] = {};   /* rows 64 mh .. 64 mh + 63 */
        if (i > 0) mbar_wait(order(c), ((i - 1) >> 1) & 1); /* the other's (i - 1) / 2-th arrival */
        for (int kt = 0; kt < n_k; kt++) {
            mbar_wait(full(s), phase);
            if (kt == n_k - 1 && (threadIdx.x & 127) == 0) mbar_arrive(order(1 - c));
            fa_wg_fence();
            unsigned long long a = fa_wg_desc_at(ring_desc, s * DGP_STAGE_BYTES);
            unsigned long long b = fa_wg_desc_at(a, DGP_STAGE_BYTES / 2);
            for (int kk = 0; kk < DGP_BK / 16; kk++) { /* 16 values = 32 bytes along the swizzled rows */
                dgp_wgmma(acc[0], fa_wg_desc_at(a, 32 * kk), fa_wg_desc_at(b, 32 * kk));
                dgp_wgmma(acc[1], fa_wg_desc_at(a, 64 * 128 + 32 * kk), fa_wg_desc_at(b, 32 * kk));
            }
            fa_wg_commit();
            fa_wg_wait<1>(); /* the previous stage's products are done: hand it back */
            if (prev >= 0 && lane == 0) mbar_arrive(empty(prev));
            prev = s;
            if (++s == DGP_STAGES) s = 0, phase ^= 1;
        }
        fa_wg_wait<0>();
        if (lane == 0) mbar_arrive(empty(prev));
        fa_wg_hold<DGP_TILE / 8>(acc[0]);
        fa_wg_hold<DGP_TILE / 8>(acc[1]);
        mbar_wait(h_full(c), (i >> 1) & 1);
        dgp_epilogue<T>(acc, tile_h, warp, lane);
        fence_shared_for_async();
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + c) : "memory"); /* the consumer's 4 warps' dh is in */
        if ((threadIdx.x & 127) == 0) {
            for (int q = 0; q < 2; q++) tma_store(&dh_map, n0 + 64 * q, m0, tile_h + q * DGP_H_BYTES / 2);
            tma_store_commit();
            tma_store_wait_read();
            mbar_arrive(h_empty(c));
        }
    }
    if ((threadIdx.x & 127) == 0) tma_store_wait();
#else
    __trap();
#endif
}

/* Launches of k_gemm_dgelu_pingpong, counted for tests/kernel_check.cu (which must see it run on
 * Hopper: a build that silently fell back to cuBLASLt fails there). */
static long g_dgelu_pingpong_runs = 0;

/* k_gemm_dgelu_pingpong's launch where it takes the product (fused products on, bf16, M and N
 * positive multiples of 128, K of 64, 16-byte aligned rows, a GPU running this image's sm_90a code: the
 * attention forward's test, the same image); false, having launched nothing, where not. One block a multiprocessor, at most
 * one a pair of tiles. */
template <typename T>
static bool dgelu_pingpong(T* dh, const T* dout, const T* w, const T* h, int M, int N, int K) {
    if constexpr (!std::is_same<T, bf16>::value) return false;
    else {
        if (!g_gemm_fuse || M <= 0 || N <= 0 || K <= 0 || M % DGP_TILE || N % DGP_TILE || K % DGP_BK || !packable((size_t)K, sizeof(T), {dh, dout, w, h}) ||
            !fa_fwd_wgmma_ok<T, 64>())
            return false;
        static int sms = 0;
        if (!sms) {
            int dev;
            CUDA_CHECK(cudaGetDevice(&dev));
            CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
            CUDA_CHECK(cudaFuncSetAttribute(k_gemm_dgelu_pingpong<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            DGP_SMEM));
        }
        g_dgelu_pingpong_runs++;
        int pairs = (M / DGP_TILE * (N / DGP_TILE) + 1) / 2;
        launch_kernel_with_shared(k_gemm_dgelu_pingpong<T>, dim3(pairs < sms ? pairs : sms), DGP_THREADS, DGP_SMEM,
                                  tma_map_bf16(dout, M, K, DGP_TILE), tma_map_bf16(w, N, K, DGP_TILE),
                                  tma_map_bf16(h, M, N, DGP_TILE), tma_map_bf16(dh, M, N, DGP_TILE), M, N, K);
        return true;
    }
}

/* out [N,C] = residual + gelu(x @ w1) @ w2 (the MLP and the residual join after it); saves
 * h = x @ w1 and h_gelu = gelu(h), both [N,F], for the backward. out must not alias residual. The
 * GELU and the join run in the products' epilogues where cuBLASLt has them (common.cuh). */
template <typename T>
static void mlp_fwd(T* out, T* h, T* h_gelu, const T* x, const T* w1, const T* w2, const T* residual, int N, int C,
                    int F) {
    if (!gemm_fused(GEMM_GELU_AUX, N, F, C, mat(x, C), mat(w1, F), mat(h_gelu, F), NULL, h)) {
        linear_fwd(h, x, w1, N, C, F);
        gelu_fwd(h_gelu, h, (size_t)N * F);
    }
    linear_fwd(out, h_gelu, w2, N, F, C, residual);
}

/* dx = ; dw1, dw2 = / += by grad_beta; h and h_gelu are the forward's; dh [N,F] is scratch. */
template <typename T>
static void mlp_bwd(T* dx, float* dw1, float* dw2, const T* dout, const T* x, const T* h, const T* h_gelu,
                    const T* w1, const T* w2, T* dh, int N, int C, int F, float grad_beta) {
    linear_dw(dw2, h_gelu, dout, N, F, C, grad_beta);
    /* dh = (dout @ w2^T) * gelu'(h) */
    if (!dgelu_pingpong(dh, dout, w2, h, N, F, C) &&
        !gemm_fused(GEMM_DGELU, N, F, C, mat(dout, C), mat_t(w2, C), mat(dh, F), NULL, h)) {
        linear_dx(dh, dout, w2, N, F, C, 0.0f);
        gelu_bwd_inplace(dh, h, (size_t)N * F);
    }
    linear_bwd(dx, dw1, dh, x, w1, N, C, F, grad_beta);
}

#endif
