/* attention.cuh: the attention sub-layer's three pairs (docs/DESIGN.md §3.1).
 *   attn_qkv_fwd/bwd  q, k, v [N, C] = x @ W_Q, x @ W_K, x @ W_V: one batched product (the three
 *                     weights are consecutive [C,C] blocks of the flat vector, and q, k, v
 *                     consecutive [N,C] blocks). The k_attn_qkv_fwd/bwd pair is this product.
 *   attn_fwd/bwd      causal softmax(q k^T / sqrt(hs)) v per head, hs = C / H; head h owns columns
 *                     [h*hs, (h+1)*hs) of q, k, v and out, as the CPU's attention_forward/backward.
 *                     Kernels: k_attn_fwd (k_attn_fwd_wgmma on Hopper, sm_90a builds, head
 *                     sizes 32 and 64),
 *                     and k_attn_bwd_delta + k_attn_bwd_dkv + k_attn_bwd_dq (flash path;
 *                     k_attn_bwd_dkv_wgmma on Hopper, sm_90a builds, head sizes 32 and 64);
 *                     k_attn_softmax_fwd, k_attn_probs, k_attn_softmax_bwd between products
 *                     (cuBLAS path).
 *   attn_out_fwd/bwd  out = residual + y @ W_O (the residual join after the sub-layer, in the
 *                     product's epilogue where cuBLASLt has one, matmul.cuh). The k_attn_out_fwd/bwd
 *                     pair is this product.
 *
 * Attention never keeps a T×T matrix per layer: the forward saves only the softmax statistic
 * lse = log-sum-exp of each score row ([B, H, T], fp32) and the backward recomputes probabilities
 * as exp(s - lse). It has two implementations, chosen by attn_flash_ok() from the type and shape:
 *
 *   flash  (bf16/fp16, hs 16, 32 or 64): fused tiles on tensor cores (mma.sync, fp32
 *          accumulate; Hopper's forward and dK/dV on wgmma, below), online softmax in fp32; the forward
 *          keeps nothing T×T. The backward is flash-attention-2 style but split so that no
 *          output needs atomics: a row kernel forms delta = rowsum(dO ∘ O); one kernel per key
 *          block recomputes P from lse, accumulates dK, dV and stores dS (rounded to T, as it is
 *          fed to the products) in 64×64 tiles of the causal half, in the dQ kernel's A-fragment
 *          order; one per query block then accumulates dQ = dS K from those tiles (loaded
 *          straight into registers), so S and dP are computed once, not once per side.
 *   cuBLAS (fp32, the reference mode compared tightly with the CPU engine, and other head sizes):
 *          scores of one sequence at a time, batched over heads, into fp32 [H, T, T] scratch.
 *
 * Precision: scores and their gradient are fp32; the probabilities P and dS fed to the second
 * products are rounded to T, as in flash-attention implementations. */
#ifndef MICROGPT_CUDA_ATTENTION_CUH
#define MICROGPT_CUDA_ATTENTION_CUH

#include "matmul.cuh"
#include "tma.cuh"

#define ATTN_WARPS 8 /* cuBLAS path: score rows per softmax block, one warp per row */

/* Whether attention uses the flash kernels: 16-bit types only (tensor-core inputs) and head
 * sizes that are whole 16-wide fragments and fit the shared-memory budget. A head's row is then
 * whole 16-byte vectors, so tiles load with aligned uint4 reads. */
static bool attn_flash_ok(bool half_type, int C, int H) {
    int hs = C / H;
    return half_type && C % H == 0 && (hs == 16 || hs == 32 || hs == 64);
}
template <typename T> static bool attn_flash_ok(int C, int H) { return attn_flash_ok(sizeof(T) == 2, C, H); }

template <typename T>
struct AttnScratch {
    float* S;     /* cuBLAS path: [H, T, T] scores of one sequence */
    float* dP;    /* cuBLAS path: [H, T, T] gradient of the probabilities (backward only) */
    T* P;         /* cuBLAS path: [H, T, T] probabilities (forward), then dS (backward) */
    float* delta; /* flash path: [B, H, T] rowsum(dO ∘ O) (backward only) */
    T* ds;        /* flash path: the dS tiles of the causal half (backward only), attn_ds_elems */
};

/* Elements of each of S, dP, P (0 on the flash path) and of delta and ds (0 on the cuBLAS path). */
static size_t attn_scratch_elems(bool half_type, int B, int T_, int C, int H) {
    return attn_flash_ok(half_type, C, H) ? 0 : (size_t)H * T_ * T_;
}
static size_t attn_delta_elems(bool half_type, int B, int T_, int C, int H) {
    return attn_flash_ok(half_type, C, H) ? (size_t)B * H * T_ : 0;
}
/* attn_ds_elems: with the flash kernels, below */

/* ---------------------------------------------------------------------------------------------- */
/* QKV projections */

/* qkv: [3, N, C] (q, then k, then v); w_qkv: W_Q, W_K, W_V consecutive, each [C, C]. */
template <typename T>
static void attn_qkv_fwd(T* qkv, const T* x, const T* w_qkv, int N, int C) {
    gemm(N, C, C, mat(x, C), mat(w_qkv, C, (long long)C * C), mat(qkv, C, (long long)N * C), 1.0f, 0.0f, 3);
}

/* dx = sum_i dqkv_i @ W_i^T (in the fixed order q, k, v); dw_i = / += x^T @ dqkv_i by grad_beta. */
template <typename T>
static void attn_qkv_bwd(T* dx, float* dw_qkv, const T* dqkv, const T* x, const T* w_qkv, int N, int C,
                         float grad_beta) {
    side_product(dqkv, [&] { /* as linear_dw */
        gemm(C, C, N, mat_t(x, C), mat(dqkv, C, (long long)N * C), mat(dw_qkv, C, (long long)C * C), 1.0f, grad_beta, 3);
    });
    for (int i = 0; i < 3; i++)
        linear_dx(dx, dqkv + (size_t)i * N * C, w_qkv + (size_t)i * C * C, N, C, C, i == 0 ? 0.0f : 1.0f);
}

/* ---------------------------------------------------------------------------------------------- */
/* Causal softmax on one sequence's scores. Rows are (h, i), i the query position; columns j > i are
 * masked: their probability is written as exactly 0, so every product over full rows is causal. */

/* P = softmax(S) per row; lse[row] = log sum_j<=i exp(S[row, j]). */
template <typename T>
__global__ void k_attn_softmax_fwd(T* P, float* lse, const float* S, int n_rows, int T_) {
    await_previous_kernel();
    int lane = threadIdx.x & 31;
    int row = blockIdx.x * ATTN_WARPS + (threadIdx.x >> 5);
    if (row >= n_rows) return;
    int i = row % T_;
    const float* s = S + (size_t)row * T_;
    float mx = -INFINITY;
    for (int j = lane; j <= i; j += 32) mx = fmaxf(mx, s[j]);
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int j = lane; j <= i; j += 32) sum += expf(s[j] - mx);
    float l = mx + logf(warp_sum(sum));
    T* p = P + (size_t)row * T_;
    for (int j = lane; j < T_; j += 32) p[j] = from_f<T>(j <= i ? expf(s[j] - l) : 0.0f);
    if (lane == 0) lse[row] = l;
}

/* The backward's P: the same expf(s - lse) from the same S and the saved lse, so identical bits. */
template <typename T>
__global__ void k_attn_probs(T* P, const float* lse, const float* S, int n_rows, int T_) {
    await_previous_kernel();
    int lane = threadIdx.x & 31;
    int row = blockIdx.x * ATTN_WARPS + (threadIdx.x >> 5);
    if (row >= n_rows) return;
    int i = row % T_;
    float l = lse[row];
    const float* s = S + (size_t)row * T_;
    T* p = P + (size_t)row * T_;
    for (int j = lane; j < T_; j += 32) p[j] = from_f<T>(j <= i ? expf(s[j] - l) : 0.0f);
}

/* Softmax backward in fp32: dS = P * (dP - sum_j P dP), P = exp(S - lse) recomputed in fp32.
 * Written into dS (T), which may be the P buffer: each element is read (S, dP) before it is
 * written, and P itself is never read here. */
template <typename T>
__global__ void k_attn_softmax_bwd(T* dS, const float* dP, const float* lse, const float* S, int n_rows, int T_) {
    await_previous_kernel();
    int lane = threadIdx.x & 31;
    int row = blockIdx.x * ATTN_WARPS + (threadIdx.x >> 5);
    if (row >= n_rows) return;
    int i = row % T_;
    float l = lse[row];
    const float* s = S + (size_t)row * T_;
    const float* dp = dP + (size_t)row * T_;
    float dot = 0.0f;
    for (int j = lane; j <= i; j += 32) dot += expf(s[j] - l) * dp[j];
    dot = warp_sum(dot);
    T* ds = dS + (size_t)row * T_;
    for (int j = lane; j < T_; j += 32) ds[j] = from_f<T>(j <= i ? expf(s[j] - l) * (dp[j] - dot) : 0.0f);
}

/* ---------------------------------------------------------------------------------------------- */
/* cuBLAS path of the scaled dot-product attention. Per sequence b, the products are batched over heads: head h's
 * q/k/v/out block starts at column h*hs (stride hs between heads, row stride C), its score
 * matrix at h*T*T. */

template <typename T>
static void attn_scores(float* S, const T* q, const T* k, int T_, int C, int H) {
    int hs = C / H;
    float scale = 1.0f / sqrtf((float)hs);
    /* S[h] = scale * q_h k_h^T  ([T, T] per head) */
    gemm(T_, T_, hs, mat(q, C, hs), mat_t(k, C, hs), mat(S, T_, (long long)T_ * T_), scale, 0.0f, H);
}

template <typename T>
static void attn_fwd_cublas(T* out, float* lse, const T* q, const T* k, const T* v, int B, int T_, int C, int H,
                            AttnScratch<T> sc) {
    int hs = C / H, n_rows = H * T_;
    for (int b = 0; b < B; b++) {
        size_t off = (size_t)b * T_ * C;
        attn_scores(sc.S, q + off, k + off, T_, C, H);
        launch_kernel(k_attn_softmax_fwd<T>, ceil_div(n_rows, ATTN_WARPS), 32 * ATTN_WARPS, sc.P,
                      lse + (size_t)b * n_rows, sc.S, n_rows, T_);
        /* out_h = P_h v_h */
        gemm(T_, hs, T_, mat(sc.P, T_, (long long)T_ * T_), mat(v + off, C, hs), mat(out + off, C, hs), 1.0f, 0.0f, H);
    }
}

template <typename T>
static void attn_bwd_cublas(T* dq, T* dk, T* dv, const T* dout, const float* lse, const T* q, const T* k, const T* v,
                            int B, int T_, int C, int H, AttnScratch<T> sc) {
    int hs = C / H, n_rows = H * T_;
    float scale = 1.0f / sqrtf((float)hs);
    long long tt = (long long)T_ * T_;
    unsigned grid = ceil_div(n_rows, ATTN_WARPS);
    for (int b = 0; b < B; b++) {
        size_t off = (size_t)b * T_ * C;
        const float* lse_b = lse + (size_t)b * n_rows;
        attn_scores(sc.S, q + off, k + off, T_, C, H);
        launch_kernel(k_attn_probs<T>, grid, 32 * ATTN_WARPS, sc.P, lse_b, sc.S, n_rows, T_);
        /* dP_h = dout_h v_h^T (fp32) */
        gemm(T_, T_, hs, mat(dout + off, C, hs), mat_t(v + off, C, hs), mat(sc.dP, T_, tt), 1.0f, 0.0f, H);
        /* dv_h = P_h^T dout_h */
        gemm(T_, hs, T_, mat_t(sc.P, T_, tt), mat(dout + off, C, hs), mat(dv + off, C, hs), 1.0f, 0.0f, H);
        /* dS into the P buffer (P is no longer needed) */
        launch_kernel(k_attn_softmax_bwd<T>, grid, 32 * ATTN_WARPS, sc.P, sc.dP, lse_b, sc.S, n_rows, T_);
        /* scores were scale * q k^T: dq_h = scale dS_h k_h ; dk_h = scale dS_h^T q_h */
        gemm(T_, hs, T_, mat(sc.P, T_, tt), mat(k + off, C, hs), mat(dq + off, C, hs), scale, 0.0f, H);
        gemm(T_, hs, T_, mat_t(sc.P, T_, tt), mat(q + off, C, hs), mat(dk + off, C, hs), scale, 0.0f, H);
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Flash path, on tensor cores through mma.sync.m16n8k16 (fp32 accumulate; sm_80 and later).
 *
 * A block of FA_WARPS warps owns 64 query rows (forward, dQ) or 64 keys (dK/dV), 16 per warp, and
 * walks the other side in tiles of 64 rows staged in shared memory ([64][D + 8] of T: the +8 puts
 * the 8 rows a fragment load touches on distinct banks; rows at or past T are zero). Tiles are
 * double-buffered: cp.async fetches tile i+1 while the warps multiply on tile i. B fragments come
 * from the staged tiles through ldmatrix (transposed where the tile is stored [k][n]).
 *
 * Fragments (PTX ISA, mma.m16n8k16 with 16-bit inputs), lane = 4 g + t:
 *   A 16x16 (4 regs of 2 T): {row g, cols 2t,2t+1}, {row g+8, same}, {row g, cols 2t+8,+9},
 *                            {row g+8, same}
 *   B 16x8  (2 regs of 2 T): {k 2t,2t+1; col g}, {k 2t+8,+9; col g}
 *   C 16x8  (4 fp32):        row g cols 2t,2t+1, then row g+8 cols 2t,2t+1
 * so a 16x64 block of scores lives in registers as 8 C fragments, each row held by one quad of
 * lanes (row statistics: two xor shuffles), and two neighbouring C fragments, rounded to T, are
 * exactly the A fragment of the next product (P V, dS K, ...): scores never touch shared memory.
 * Scores run in base 2: s2 = (q·k) * scale * log2(e), so 2^x (fa_exp2), the scale folded into a fused
 * multiply-add with the subtracted max or lse. */

#define FA_TILE 64 /* rows per block and per staged tile */
#define FA_WARPS 4
#define FA_THREADS (32 * FA_WARPS)

/* Blocks per multiprocessor that ptxas must fit in registers (65536 / (threads x blocks)): the
 * forward 4, 16 warps (at most 128 registers; none spilled, sm_90), the dK/dV kernel 3 (168). The
 * dQ kernel (one product per tile pair) gets no minimum (80 registers): an explicit 1 is not the
 * same to ptxas (106). Other block shapes, bounds and software pipelines were measured slower or no
 * faster (docs/BENCHMARKS.md, log #40–#49). */
#define FA_MIN_BLOCKS_FWD 4
#define FA_MIN_BLOCKS_DKV 3
/* Queries per step of the dK/dV kernel: at D = 64 a staged tile's 64 queries in two halves of 32
 * (half the score registers, the same products in the same order; at 168 registers whole tiles
 * spill 48 bytes, halves none: ptxas -v, sm_90); smaller heads fit whole tiles. */
template <int D> struct FaBwd { static constexpr int COLS = D == 64 ? FA_TILE / 2 : FA_TILE; };

/* A flash block's work: its tile index (before each kernel maps it heaviest first), its head
 * b*H + h, and the counts of both; fa_grid is the matching launch grid. The tile index is the
 * grid's slow dimension, so the heaviest tile of every head starts before any lighter one (longest
 * job first over the whole grid: the light blocks make a short tail; docs/BENCHMARKS.md log #41). */
struct FaBlock {
    int tile, bh, n_tiles, n_bh;
};
__device__ __forceinline__ FaBlock fa_block(void) {
    return {(int)blockIdx.y, (int)blockIdx.x, (int)gridDim.y, (int)gridDim.x};
}
static dim3 fa_grid(int n_tiles, int n_bh) { return dim3(n_bh, n_tiles); }
#define FA_LOG2E 1.4426950408889634f
#define FA_LN2 0.6931471805599453f

/* d += a b on one warp (T = bf16 or fp16). */
template <typename T> __device__ __forceinline__ void fa_mma(float* d, const unsigned* a, const unsigned* b);
template <> __device__ __forceinline__ void fa_mma<bf16>(float* d, const unsigned* a, const unsigned* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <> __device__ __forceinline__ void fa_mma<fp16>(float* d, const unsigned* a, const unsigned* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/* Two values rounded to T, packed into one register (the lower index in the low half). */
template <typename T> __device__ __forceinline__ unsigned fa_pack(float lo, float hi) {
    T v[2] = {from_f<T>(lo), from_f<T>(hi)};
    unsigned r;
    memcpy(&r, v, 4);
    return r;
}
/* Two consecutive T of a row (4-byte aligned). */
template <typename T> __device__ __forceinline__ unsigned fa_pair(const T* p) { return *(const unsigned*)p; }

/* ldmatrix.x4: four 8x8 matrices of 16-bit values from shared memory; lane 8i + r gives the address
 * of row r of matrix i (16-byte aligned), and register i receives matrix i in the B fragment order
 * of one 8-wide fragment: plain, lane 4g + t gets row g, columns 2t, 2t+1 (a tile stored [n][k]);
 * transposed, rows 2t, 2t+1 of column g (a tile stored [k][n]). */
__device__ __forceinline__ void fa_ldsm_x4(unsigned* r, const void* p) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
/* (transposed, by the lane's row address in the shared window: classifier_grad.cuh's TMA tiles) */
__device__ __forceinline__ void fa_ldsm_x4_trans(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void fa_ldsm_x4_trans(unsigned* r, const void* p) {
    fa_ldsm_x4_trans(r, (unsigned)__cvta_generic_to_shared(p));
}

template <int D>
struct Fa {
    static constexpr int LD = D + 8;  /* T per row of a staged tile */
    static constexpr int KD = D / 16; /* 16-wide k steps along the head dimension */
    static constexpr int ND = D / 8;  /* 8-wide output fragments along the head dimension */
};

/* The backward's dS tiles: per head, the (query tile qt, key tile kt <= qt) pairs of the causal
 * half, each 64×64 of T in the dQ kernel's A-fragment order (fa_store_ds_fragments); pairs in the order
 * (0,0), (1,0), (1,1), (2,0), ..., so a query tile's row of tiles is contiguous. */
__host__ __device__ __forceinline__ size_t fa_tile_pairs(int n_tiles) { return (size_t)n_tiles * (n_tiles + 1) / 2; }
/* First element of pair (qt, kt)'s tile of head bh (b*H + h). */
__device__ __forceinline__ size_t fa_ds_tile(int bh, int qt, int kt, int n_tiles) {
    return ((size_t)bh * fa_tile_pairs(n_tiles) + fa_tile_pairs(qt) + kt) * FA_TILE * FA_TILE;
}
static size_t attn_ds_elems(bool half_type, int B, int T_, int C, int H) {
    return attn_flash_ok(half_type, C, H) ? (size_t)B * H * fa_tile_pairs(ceil_div(T_, FA_TILE)) * FA_TILE * FA_TILE
                                          : 0;
}

/* Asynchronous 16-byte copy global -> shared (src_bytes 0: write zeros, read nothing), and its
 * group commit / wait: a tile's copies overlap the products on the previous tile. */
__device__ __forceinline__ void fa_cp_async16(void* dst, const void* src, int src_bytes) {
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void fa_cp_commit(void) { asm volatile("cp.async.commit_group;\n" ::); }
/* Waits until at most `pending` of this thread's committed groups are still in flight. */
template <int pending> __device__ __forceinline__ void fa_cp_wait(void) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(pending));
}

/* Starts copying rows [r0, r0 + 64) of one head (src: the sequence's row 0 at the head's first
 * column, row stride C) into a staged tile; rows at or past T become zero. Whole block: thread t
 * copies 16-byte chunk t % PER_ROW of rows t / PER_ROW, + ROW_STEP, ... (a pointer and a bound
 * check a chunk, not a generic loop's divisions: docs/BENCHMARKS.md #148, #153). */
template <typename T, int D>
__device__ __forceinline__ void fa_load_rows(T* dst, const T* src, int r0, int T_, int C) {
    constexpr int VEC = 16 / sizeof(T), PER_ROW = D / VEC, ROW_STEP = FA_THREADS / PER_ROW;
    static_assert(FA_THREADS % PER_ROW == 0 && FA_TILE % ROW_STEP == 0, "whole rows a pass, whole passes a tile");
    int row = (int)(threadIdx.x / PER_ROW), c = (int)(threadIdx.x % PER_ROW) * VEC;
    const T* p = src + (size_t)(r0 + row) * C + c;
    T* d = dst + row * Fa<D>::LD + c;
#pragma unroll
    for (int i = 0; i < FA_TILE / ROW_STEP; i++) {
        bool ok = r0 + row + i * ROW_STEP < T_;
        fa_cp_async16(d + i * ROW_STEP * Fa<D>::LD, ok ? p + (size_t)i * ROW_STEP * C : src, ok ? 16 : 0);
    }
}

/* Starts copying key/value tile kt (rows kt*64 ..) of one head into the staged buffers ks, vs. */
template <typename T, int D>
__device__ __forceinline__ void fa_load_kv(T* ks, T* vs, const T* k, const T* v, int kt, int T_, int C) {
    fa_load_rows<T, D>(ks, k, kt * FA_TILE, T_, C);
    fa_load_rows<T, D>(vs, v, kt * FA_TILE, T_, C);
}

/* A fragments of the 16 rows of a staged tile starting at `rows`, for every k step of D. */
template <typename T, int D>
__device__ __forceinline__ void fa_load_a(unsigned (*a)[4], const T* rows) {
    int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    for (int kk = 0; kk < Fa<D>::KD; kk++) {
        const T* p = rows + g * Fa<D>::LD + kk * 16 + 2 * t;
        a[kk][0] = fa_pair(p);
        a[kk][1] = fa_pair(p + 8 * Fa<D>::LD);
        a[kk][2] = fa_pair(p + 8);
        a[kk][3] = fa_pair(p + 8 * Fa<D>::LD + 8);
    }
}

/* s[16][64] = A[16][D] · tile[64][D]^T: 8 C fragments, fragment j = tile rows 8j .. 8j+7. One
 * ldmatrix serves fragments j, j+1 at one k step: matrices (rows 8j.., k), (8j.., k+8),
 * (8j+8.., k), (8j+8.., k+8). */
template <typename T, int D, int COLS = FA_TILE>
__device__ __forceinline__ void fa_scores(float (*s)[4], const unsigned (*a)[4], const T* tile) {
    int lane = threadIdx.x & 31, mi = lane >> 3;
    const T* p = tile + (8 * (mi >> 1) + (lane & 7)) * Fa<D>::LD + 8 * (mi & 1);
    for (int j = 0; j < COLS / 8; j += 2) {
        for (int e = 0; e < 4; e++) s[j][e] = s[j + 1][e] = 0.0f;
        for (int kk = 0; kk < Fa<D>::KD; kk++) {
            unsigned b[4];
            fa_ldsm_x4(b, p + 8 * j * Fa<D>::LD + kk * 16);
            fa_mma<T>(s[j], a[kk], b);
            fa_mma<T>(s[j + 1], a[kk], b + 2);
        }
    }
}

/* acc[16][D] += A[16][16] · tile rows [16 kk, 16 kk + 16) of [64][D], one 16-wide k step with A
 * as an A fragment. One transposed ldmatrix serves output fragments n, n+1: matrices (k.., cols
 * 8n), (k+8.., 8n), (k.., 8n+8), (k+8.., 8n+8). */
template <typename T, int D>
__device__ __forceinline__ void fa_accumulate_step(float (*acc)[4], const unsigned* a, const T* tile, int kk) {
    int lane = threadIdx.x & 31, mi = lane >> 3;
    const T* q = tile + (16 * kk + 8 * (mi & 1) + (lane & 7)) * Fa<D>::LD + 8 * (mi >> 1);
    for (int n = 0; n < Fa<D>::ND; n += 2) {
        unsigned b[4];
        fa_ldsm_x4_trans(b, q + 8 * n);
        fa_mma<T>(acc[n], a, b);
        fa_mma<T>(acc[n + 1], a, b + 2);
    }
}

/* acc[16][D] += P[16][COLS] · tile[COLS][D], P given as COLS / 8 C fragments (rounded to T here:
 * two neighbouring C fragments are one A fragment). */
template <typename T, int D, int COLS = FA_TILE>
__device__ __forceinline__ void fa_accumulate(float (*acc)[4], const float (*p)[4], const T* tile) {
    for (int kk = 0; kk < COLS / 16; kk++) {
        const float* p0 = p[2 * kk];
        const float* p1 = p[2 * kk + 1];
        unsigned a[4] = {fa_pack<T>(p0[0], p0[1]), fa_pack<T>(p0[2], p0[3]), fa_pack<T>(p1[0], p1[1]),
                         fa_pack<T>(p1[2], p1[3])};
        fa_accumulate_step<T, D>(acc, a, tile, kk);
    }
}

/* The lane-local amax bits (common.cuh) of two values as stored, with AMAX (precision fp8's fused
 * amax); without it nothing, so the kernels without the amax are the same code as before. */
template <typename T, bool AMAX> __device__ __forceinline__ unsigned fa_amax2(unsigned am, T y0, T y1) {
    if constexpr (AMAX) return max(am, max(abs_bits(to_f(y0)), abs_bits(to_f(y1))));
    return am;
}

/* lo and hi rounded to T at p and p + 1 as one 4-byte store (p 4-byte aligned: an even column of
 * a row of even length). A warp's store of C fragments then touches each of its 8 rows' 32-byte
 * sectors once, where a 2-byte store per value touched them twice (docs/BENCHMARKS.md #119).
 * Returns am with the pair's amax bits (AMAX). */
template <typename T, bool AMAX>
__device__ __forceinline__ unsigned fa_store_pair(T* p, float lo, float hi, unsigned am) {
    static_assert(sizeof(T) == 2, "the flash kernels store 16-bit pairs");
    unsigned word = fa_pack<T>(lo, hi);
    T v[2];
    memcpy(v, &word, sizeof word);
    *reinterpret_cast<unsigned*>(p) = word;
    return fa_amax2<T, AMAX>(am, v[0], v[1]);
}

/* y[row][col] = s * acc for the warp's 16 rows (y at the warp's first row and the head's first
 * column); rows from n_valid on are past T and skipped. Returns the lane's amax bits of what it
 * stored with AMAX, else 0. */
template <typename T, int D, bool AMAX>
__device__ __forceinline__ unsigned fa_store_out(T* y, const float (*acc)[4], float s, int n_valid, int C) {
    int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    unsigned am = 0;
    for (int n = 0; n < Fa<D>::ND; n++)
        for (int h = 0; h < 2; h++) {
            int r = g + 8 * h;
            if (r < n_valid)
                am = fa_store_pair<T, AMAX>(y + (size_t)r * C + 8 * n + 2 * t, s * acc[n][2 * h], s * acc[n][2 * h + 1],
                                            am);
        }
    return am;
}

/* fa_store_out through `stage`, this warp's 16 rows of Fa<D>::LD T in shared memory (no other warp's,
 * and free): fa_store_out puts the pairs there (rows Fa<D>::LD apart: free of bank conflicts), then
 * each lane stores 16-byte pieces of whole rows, so a warp writes whole 32-byte sectors where the
 * pairs wrote halves (docs/BENCHMARKS.md #120). The same values, rounded alike. */
template <typename T, int D, bool AMAX>
__device__ __forceinline__ unsigned fa_store_out_staged(T* y, T* stage, const float (*acc)[4], float s, int n_valid,
                                                        int C) {
    constexpr int PIECES = D * (int)sizeof(T) / 16; /* 16-byte pieces of a row */
    int lane = threadIdx.x & 31;
    unsigned am = fa_store_out<T, D, AMAX>(stage, acc, s, n_valid, Fa<D>::LD);
    __syncwarp();
    for (int e = lane; e < 16 * PIECES; e += 32) {
        int r = e / PIECES, c = e % PIECES * (16 / (int)sizeof(T));
        if (r < n_valid)
            *reinterpret_cast<uint4*>(y + (size_t)r * C + c) =
                *reinterpret_cast<const uint4*>(stage + r * Fa<D>::LD + c);
    }
    return am;
}

/* The dQ kernel's bound: 6 blocks per multiprocessor (at most 85 registers; unbounded, ptxas holds
 * the prefetched fragments in 136). */
#define FA_DQ_BOUNDS __launch_bounds__(FA_THREADS, 6)

/* A warp's 16 staged dS^T rows (row stride LD; keys 16 kk .. of the tile) as the dQ kernel's A
 * fragments of k step kk: for query group i (dQ warp i), transposed ldmatrix gives each lane its 4
 * registers, stored as one 16-byte packet at ((i * 4 + kk) * 32 + lane) of the 64x64 tile, so that
 * a dQ warp loads a fragment straight into registers as 512 contiguous bytes, a tile ahead, and
 * stages only K in shared memory (docs/BENCHMARKS.md log #48, #66: dQ 64.5 -> 58.1 µs a launch at
 * ANDREA-120M). */
template <typename T>
__device__ __forceinline__ void fa_store_ds_fragments(T* tile, const T* staged, int kk) {
    int lane = threadIdx.x & 31, mi = lane >> 3;
    const T* p = staged + (8 * (mi >> 1) + (lane & 7)) * Fa<FA_TILE>::LD + 8 * (mi & 1);
    for (int i = 0; i < FA_TILE / 16; i++) {
        unsigned r[4];
        fa_ldsm_x4_trans(r, p + 16 * i);
        ((uint4*)tile)[(i * (FA_TILE / 16) + kk) * 32 + lane] = make_uint4(r[0], r[1], r[2], r[3]);
    }
}

/* The causal mask of a diagonal tile pair (query tile == key tile), the only tile pair where any
 * key follows a query: scores s in the C-fragment layout above, row base_row + g + 8h, column
 * 8j + 2t + e (tile-relative), become -inf where the key index exceeds the query index. Rows are
 * queries (forward, dQ: mask column > row) or keys (dK/dV: mask column < row). Off the diagonal
 * every key precedes every query, and no mask is applied at all. */
template <bool ROWS_ARE_KEYS, int COLS = FA_TILE>
__device__ __forceinline__ void fa_mask_diagonal(float (*s)[4], int base_row, int col0 = 0) {
    int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    for (int j = 0; j < COLS / 8; j++)
        for (int h = 0; h < 2; h++)
            for (int e = 0; e < 2; e++) {
                int r = base_row + g + 8 * h, c = col0 + 8 * j + 2 * t + e;
                if (ROWS_ARE_KEYS ? c < r : c > r) s[j][2 * h + e] = -INFINITY;
            }
}

/* 2^x by the hardware's approximation (ex2.approx, ~2 ulp), results below 2^-126 flushed to zero: a
 * probability that small adds nothing to a 16-bit product (exp2f would add a denormal rescale around
 * each of the kernels' many exponentials). 2^-inf = 0. */
__device__ __forceinline__ float fa_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* Sum / max over the 4 lanes of a quad (the lanes holding one score row). */
__device__ __forceinline__ float fa_quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
__device__ __forceinline__ float fa_quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

/* o *= a on row half h (C-fragment order: entries 0, 1 on row g, 2, 3 on row g + 8). */
template <int D> __device__ __forceinline__ void fa_rescale_rows(float (*o)[4], float a, int h) {
    for (int n = 0; n < Fa<D>::ND; n++) {
        o[n][2 * h] *= a;
        o[n][2 * h + 1] *= a;
    }
}

/* The online softmax of one key tile for a warp's rows (h: row g or g + 8): the running max m and
 * sum l updated, the scores s replaced by P = 2^(s sl2 - m), and alpha[h] = 2^(m_old - m_new), the
 * factor that rescales what was accumulated under the old max; the accumulators o (C-fragment
 * order, D wide) rescaled by it here unless o is NULL. */
template <int D>
__device__ __forceinline__ void fa_softmax_tile(float (*s)[4], float* m, float* l, float* alpha, float sl2,
                                                float (*o)[4]) {
    for (int h = 0; h < 2; h++) {
        /* the max of the raw scores, scaled once: scaling by sl2 > 0 and rounding keep the order,
         * so this is the max of the scaled scores */
        float mx = -INFINITY;
        for (int j = 0; j < FA_TILE / 8; j++) mx = fmaxf(mx, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
        float m_new = fmaxf(m[h], fa_quad_max(mx) * sl2), sum = 0.0f;
        alpha[h] = fa_exp2(m[h] - m_new);
        for (int j = 0; j < FA_TILE / 8; j++)
            for (int e = 0; e < 2; e++) {
                float p = fa_exp2(fmaf(s[j][2 * h + e], sl2, -m_new));
                s[j][2 * h + e] = p;
                sum += p;
            }
        l[h] = l[h] * alpha[h] + sum;
        m[h] = m_new;
        if (o) fa_rescale_rows<D>(o, alpha[h], h);
    }
}

/* One key tile of the forward for a warp: the online softmax, then o += P V (s becomes P). */
template <typename T, int D>
__device__ __forceinline__ void fa_fwd_tile(float (*o)[4], float* m, float* l, float (*s)[4], const T* vtile,
                                            float sl2) {
    float alpha[2];
    fa_softmax_tile<D>(s, m, l, alpha, sl2, o);
    fa_accumulate<T, D>(o, s, vtile);
}

/* The forward's end for a warp's 16 rows from row0 (out's row 0 of the head at out + base, its lse
 * at lse + lse_row0): out = o / l rounded to T, lse = the natural log-sum-exp of each row's scores;
 * rows at or past T are skipped. Returns the lane's amax bits of what it stored with AMAX, else 0. */
template <typename T, int D, bool AMAX>
__device__ __forceinline__ unsigned fa_fwd_store(T* out, size_t base, float* lse, size_t lse_row0,
                                                 const float (*o)[4], const float* m, const float* l, int row0,
                                                 int T_, int C) {
    int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    unsigned am = 0;
    for (int h = 0; h < 2; h++) {
        int i = row0 + g + 8 * h;
        float lt = fa_quad_sum(l[h]), inv = 1.0f / lt;
        if (i < T_) {
            T* p = out + base + (size_t)i * C + 2 * t;
            for (int n = 0; n < Fa<D>::ND; n++)
                am = fa_store_pair<T, AMAX>(p + 8 * n, o[n][2 * h] * inv, o[n][2 * h + 1] * inv, am);
            if (t == 0) lse[lse_row0 + i] = m[h] * FA_LN2 + logf(lt);
        }
    }
    return am;
}

/* Forward: block (query tile, b*H + h); the heaviest (last) query tiles are scheduled first. Warp w
 * owns query rows q0 + 16w .. +15; each lane holds rows g and g+8 of them (index h = 0, 1). The
 * block walks the key tiles up to its own (the diagonal, masked). Key tile 0 holds a key <= every
 * row, so the running max is finite from then on. AMAX (precision fp8, whose W_O product casts
 * out): out's amax as stored into *amax_bits (common.cuh's block_amax_commit_in); without it,
 * amax_bits is unused. */
template <typename T, int D, bool AMAX>
__global__ void __launch_bounds__(FA_THREADS, FA_MIN_BLOCKS_FWD)
    k_attn_fwd(T* out, float* lse, const T* q, const T* k, const T* v, int T_, int C, int H, float sl2,
               unsigned* amax_bits) {
    await_previous_kernel();
    __shared__ __align__(16) T ks[2][FA_TILE * Fa<D>::LD]; /* double-buffered: tile kt in [kt & 1] */
    __shared__ __align__(16) T vs[2][FA_TILE * Fa<D>::LD];
    int warp = threadIdx.x >> 5;
    FaBlock blk = fa_block();
    int qt = blk.n_tiles - 1 - blk.tile, bh = blk.bh, b = bh / H, hd = bh % H;
    int q0 = qt * FA_TILE, row0 = q0 + warp * 16;
    size_t base = (size_t)b * T_ * C + (size_t)hd * D;

    unsigned qa[Fa<D>::KD][4];
    fa_load_rows<T, D>(ks[1], q + base, q0, T_, C); /* q staged through the second k buffer */
    fa_load_kv<T, D>(ks[0], vs[0], k + base, v + base, 0, T_, C);
    fa_cp_commit();
    fa_cp_wait<0>();
    __syncthreads();
    fa_load_a<T, D>(qa, ks[1] + warp * 16 * Fa<D>::LD);
    __syncthreads(); /* everyone has its q before ks[1] takes the next tile */
    float o[Fa<D>::ND][4] = {};
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}; /* running max (base 2), this lane's sum */

    for (int kt = 0; kt <= qt; kt++) {
        int cur = kt & 1;
        if (kt < qt) fa_load_kv<T, D>(ks[cur ^ 1], vs[cur ^ 1], k + base, v + base, kt + 1, T_, C);
        fa_cp_commit();
        fa_cp_wait<1>(); /* tile kt has landed (this thread's part) ... */
        __syncthreads(); /* ... and everyone's */
        float s[FA_TILE / 8][4];
        fa_scores<T, D>(s, qa, ks[cur]);
        if (kt == qt) fa_mask_diagonal<false>(s, warp * 16);
        fa_fwd_tile<T, D>(o, m, l, s, vs[cur], sl2);
        __syncthreads(); /* everyone is done with buffer cur before it takes tile kt + 2 */
    }

    unsigned am = fa_fwd_store<T, D, AMAX>(out, base, lse, (size_t)bh * T_, o, m, l, row0, T_, C);
    /* the tiles are done with (the loop's last barrier): ks lends the block's partial maxima */
    if constexpr (AMAX) block_amax_commit_in(amax_bits, am, (unsigned*)ks[0]);
}

/* ---------------------------------------------------------------------------------------------- */
/* The forward on Hopper's warpgroup products (wgmma, sm_90a; docs/DESIGN.md §9: 76.2 against
 * k_attn_fwd's 84.3 µs a launch at ANDREA-120M on an H200). Same blocks, grid order and outputs as
 * k_attn_fwd (where the image has no sm_90a code, k_attn_fwd runs: fa_fwd_wgmma_ok); the
 * block's 4 warps are one warpgroup and each product covers all 64 query rows:
 *   S = Q K^T  wgmma m64n64k16, A = the Q tile and B = the K tile from shared memory (both K-major:
 *              rows of the head dimension), D / 16 steps along the head;
 *   O += P V   wgmma m64nDk16, A = P from registers (the accumulator of S rounded to T: wgmma's
 *              accumulator and register-A fragments are, warp by warp, mma.m16n8k16's C and A
 *              fragments, so fa_softmax_tile, fa_mask_diagonal and fa_fwd_store apply unchanged),
 *              B = the V tile from shared memory read N-major (the transpose bit), 4 steps of keys.
 * The products run asynchronously: the step of key tile kt issues S_kt and P_kt-1 V_kt-1 together,
 * waits for S_kt alone, and runs its softmax while P V is still in the tensor cores
 * (FlashAttention-3's overlap inside one warpgroup); O is rescaled and P_kt rounded once that
 * product is done. The other blocks on the multiprocessor (4, as k_attn_fwd) fill the rest.
 *
 * Shared memory: the Q tile and double-buffered K and V tiles, each 64 rows of D T (2D bytes, no
 * padding) in the layout the descriptors name: 16-byte chunk c of row r stored at chunk c ^ (the
 * row's bits), i.e. byte address bits [4, 7) XOR [7, 10) ("128-byte swizzle", D = 64: 128-byte
 * rows) or [4, 6) XOR [7, 9) ("64-byte swizzle", D = 32: 64-byte rows), tiles 1024-byte aligned so
 * the pattern starts on each. The tiles come by the TMA (FaHeadMaps, whose swizzle is this layout;
 * rows at or past T read as zeros), one thread issuing a step's loads: step kt loads K_kt+1 and
 * V_kt, read by step kt + 1, into the buffers of K_kt-1 and V_kt-2, after the step's barrier (every
 * warp is done with those) and its products; a step's loads complete one of two mbarriers, taken
 * by turns. The TMA writes and wgmma reads through the async proxy: no fence between them, and no
 * thread computes a copy's addresses (docs/BENCHMARKS.md #148: copies by each thread, even with
 * their chunks fixed for the block, cost ~40 instructions a warp a step and the generic proxy's
 * fence, and a generic copy loop ~260). */
template <int D> struct FaWg {
    static_assert(D == 32 || D == 64, "the wgmma forward takes head sizes 32 and 64");
    static constexpr int ROW_BYTES = 2 * D;                          /* one row of a tile: the swizzle width */
    static constexpr int GROUP_BYTES = 8 * ROW_BYTES;                /* 8 rows: one period of the swizzle */
    static constexpr int TILE_BYTES = FA_TILE * ROW_BYTES;           /* a multiple of 1024 */
    static constexpr unsigned long long MODE = D == 64 ? 1ull : 2ull; /* descriptor bits 62-63: 128 B, 64 B */
    static constexpr int SMEM = 5 * TILE_BYTES + 1024;               /* q, k[2], v[2]; 1024 to align */
};

/* The TMA's views of q, k and v for the forward: each a [B][T][C] matrix of 16-bit values (C
 * apart a row) in boxes of one head's D columns x 64 rows of one sequence, stored with FaWg<D>'s
 * swizzle; rows at or past T read as zeros (each sequence is a plane of the map). Kernel
 * parameters (__grid_constant__), encoded by the host at each launch (once, when a graph is
 * captured). */
struct FaHeadMaps {
    CUtensorMap q, k, v;
};
template <int D> static CUtensorMap fa_head_map(const void* p, int B, int T_, int C) {
    cuuint64_t dims[3] = {(cuuint64_t)C, (cuuint64_t)T_, (cuuint64_t)B};
    cuuint64_t strides[2] = {(cuuint64_t)C * 2, (cuuint64_t)T_ * C * 2};
    cuuint32_t box[3] = {(cuuint32_t)D, FA_TILE, 1};
    return tma_encode(CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, p, dims, strides, box,
                      D == 64 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B);
}
template <int D> static FaHeadMaps fa_head_maps(const void* q, const void* k, const void* v, int B, int T_, int C) {
    return {fa_head_map<D>(q, B, T_, C), fa_head_map<D>(k, B, T_, C), fa_head_map<D>(v, B, T_, C)};
}
/* The dK/dV kernel's: q, k, v and dout. */
struct FaDkvMaps {
    FaHeadMaps qkv;
    CUtensorMap dout;
};
template <int D>
static FaDkvMaps fa_dkv_maps(const void* q, const void* k, const void* v, const void* dout, int B, int T_, int C) {
    return {fa_head_maps<D>(q, k, v, B, T_, C), fa_head_map<D>(dout, B, T_, C)};
}

/* Whether T is bf16 (else fp16): the products' input type, spelled in their instruction. */
template <typename T> struct FaWgBf16 { static constexpr bool value = false; };
template <> struct FaWgBf16<bf16> { static constexpr bool value = true; };

/* A shared-memory matrix descriptor (PTX ISA, wgmma): start address, leading and stride byte
 * offsets (each >> 4) and the swizzle mode. Rows 8 apart are one stride (SBO) apart. A K-major
 * operand (Q, K) never crosses a swizzle row within a 16-wide k step, so its leading offset is
 * unused (1 by convention). The N-major V spans exactly one swizzle width in N, so of its two
 * offsets only the one between 8-key groups matters; both are set to it. */
template <int D> __device__ __forceinline__ unsigned long long fa_wg_desc(unsigned addr, unsigned lbo) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | (unsigned long long)(lbo >> 4) << 16 |
           (unsigned long long)(FaWg<D>::GROUP_BYTES >> 4) << 32 | FaWg<D>::MODE << 62;
}
/* The descriptor of the same matrix `bytes` further on (a multiple of 16): the address field is
 * the low 14 bits (address / 16) and shared memory ends below 256 KiB, so the sum never carries
 * out of it. One add where building a descriptor takes a mask, a shift and an or: the k steps of
 * a product derive theirs from one, which keeps the instructions between products few. */
__device__ __forceinline__ unsigned long long fa_wg_desc_at(unsigned long long desc, unsigned bytes) {
    return desc + (bytes >> 4);
}

__device__ __forceinline__ void fa_wg_fence(void) { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void fa_wg_commit(void) { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
/* Waits until at most `pending` committed groups of products are still running. */
template <int pending> __device__ __forceinline__ void fa_wg_wait(void) {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(pending) : "memory");
}
/* After a wait: the compiler must not read a product's accumulators before it (it sees them
 * written when the product is issued). */
template <int N> __device__ __forceinline__ void fa_wg_hold(float (*x)[4]) {
    for (int j = 0; j < N; j++)
        for (int e = 0; e < 4; e++) asm volatile("" : "+f"(x[j][e])::"memory");
}
/* Ends the basic block once x is computed. ptxas (13.0) schedules a wgmma wait at the top of its
 * block, ahead of independent work: without this, a tile's softmax would wait for the P V product
 * it is meant to overlap (seen in the SASS). The branch is never taken (x, a sum of exponentials,
 * is never this NaN pattern) and would only sleep 0 ns. */
__device__ __forceinline__ void fa_wg_block_end(float x) {
    if (__float_as_uint(x) == 0xFFFFFFFFu) __nanosleep(0);
}

#define FA_WG_R16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define FA_WG_R32 FA_WG_R16 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
/* the accumulator operands x[j][e] with constraint F ("+f" read and written, "=f" written) */
#define FA_WG_F4(x, j, F) F(x[j][0]), F(x[j][1]), F(x[j][2]), F(x[j][3])
#define FA_WG_F16(x, F) FA_WG_F4(x, 0, F), FA_WG_F4(x, 1, F), FA_WG_F4(x, 2, F), FA_WG_F4(x, 3, F)
#define FA_WG_F32(x, F) FA_WG_F16(x, F), FA_WG_F4(x, 4, F), FA_WG_F4(x, 5, F), FA_WG_F4(x, 6, F), FA_WG_F4(x, 7, F)

/* s[64][64] = (ACC: s +) A · B^T over one 16-wide k step, A and B K-major in shared memory. The
 * first step writes s without reading it ("=f", scale-d 0): the values the softmax left in s are no
 * input of the next tile's product, which would make ptxas serialise the products (C7513). */
#define FA_WG_SS(AB, F)                                                                                  \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                            \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32" AB " {" FA_WG_R32 "}, %32, %33, p, 1, 1, 0, 0;\n}\n" \
                 : FA_WG_F32(s, F)                                                                      \
                 : "l"(a), "l"(b), "n"((int)ACC))
template <typename T, bool ACC>
__device__ __forceinline__ void fa_wg_ss(float (*s)[4], unsigned long long a, unsigned long long b) {
    constexpr bool BF16 = FaWgBf16<T>::value;
    if constexpr (BF16 && ACC) FA_WG_SS(".bf16.bf16", "+f");
    if constexpr (BF16 && !ACC) FA_WG_SS(".bf16.bf16", "=f");
    if constexpr (!BF16 && ACC) FA_WG_SS(".f16.f16", "+f");
    if constexpr (!BF16 && !ACC) FA_WG_SS(".f16.f16", "=f");
}

/* o[64][D] += A · B over one 16-wide k step, A (4 registers: an A fragment per warp) from
 * registers, B N-major in shared memory (transpose bit set). */
#define FA_WG_RS(N, AB, R, F, AB_OPERANDS)                                                                \
    asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32" AB " {" R "}, " AB_OPERANDS ", 1, 1, 1, 1;\n" \
                 : F(o, "+f")                                                                           \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b))
#define FA_WG_RS64(AB) FA_WG_RS(64, AB, FA_WG_R32, FA_WG_F32, "{%32, %33, %34, %35}, %36")
#define FA_WG_RS32(AB) FA_WG_RS(32, AB, FA_WG_R16, FA_WG_F16, "{%16, %17, %18, %19}, %20")
template <typename T, int D>
__device__ __forceinline__ void fa_wg_rs(float (*o)[4], const unsigned* a, unsigned long long b) {
    constexpr bool BF16 = FaWgBf16<T>::value;
    if constexpr (BF16 && D == 64) FA_WG_RS64(".bf16.bf16");
    if constexpr (BF16 && D == 32) FA_WG_RS32(".bf16.bf16");
    if constexpr (!BF16 && D == 64) FA_WG_RS64(".f16.f16");
    if constexpr (!BF16 && D == 32) FA_WG_RS32(".f16.f16");
}

/* S = Q K^T for the block's 64 queries and the 64 keys of a K tile (shared addresses of the
 * tiles), issued and committed as one group. */
template <typename T, int D> __device__ __forceinline__ void fa_wg_scores(float (*s)[4], unsigned qs, unsigned ks) {
    const unsigned long long qd = fa_wg_desc<D>(qs, 16), kd = fa_wg_desc<D>(ks, 16);
    fa_wg_ss<T, false>(s, qd, kd);
    for (int kk = 1; kk < D / 16; kk++) /* 16 T = 32 bytes along the swizzled rows */
        fa_wg_ss<T, true>(s, fa_wg_desc_at(qd, 32 * kk), fa_wg_desc_at(kd, 32 * kk));
    fa_wg_commit();
}

/* O += P V for the 64 keys of a V tile, P given as the A fragments of the 4 k steps; one group. */
template <typename T, int D> __device__ __forceinline__ void fa_wg_accumulate(float (*o)[4], const unsigned (*p)[4],
                                                                              unsigned vs) {
    const unsigned long long vd = fa_wg_desc<D>(vs, FaWg<D>::GROUP_BYTES);
    for (int kk = 0; kk < FA_TILE / 16; kk++) /* 16 keys = 2 groups of 8 rows */
        fa_wg_rs<T, D>(o, p[kk], fa_wg_desc_at(vd, 2 * kk * FaWg<D>::GROUP_BYTES));
    fa_wg_commit();
}

/* P (the scores after fa_softmax_tile) rounded to T as the A fragments of the P V steps: two
 * neighbouring C fragments are one A fragment. */
template <typename T> __device__ __forceinline__ void fa_wg_pack_p(unsigned (*p)[4], const float (*s)[4]) {
    for (int kk = 0; kk < FA_TILE / 16; kk++) {
        const float* p0 = s[2 * kk];
        const float* p1 = s[2 * kk + 1];
        p[kk][0] = fa_pack<T>(p0[0], p0[1]);
        p[kk][1] = fa_pack<T>(p0[2], p0[3]);
        p[kk][2] = fa_pack<T>(p1[0], p1[1]);
        p[kk][3] = fa_pack<T>(p1[2], p1[3]);
    }
}

/* What a flash kernel does with the rows it accumulated: store them in T (with AMAX their amax:
 * FaBwdPlain, the name of the backward's that came first), or (precision fp8's delayed scaling,
 * cuda/fp8.cuh's FaBwdCodes) also or instead write their FP8 codes in both layouts of a product's
 * operand: `epi` says which (the backward's kernels below, and the forward's:
 * k_attn_fwd_wgmma_fp8 writes out in T, which the backward's delta reads, and
 * its codes for W_O's product). A codes epilogue's stage() takes the warp's 16 rows into a shared
 * tile of the block's 64 rows, write() (after a barrier) the tile to memory, finish() the amax and
 * the scale. */
struct FaBwdPlain {
    static constexpr bool codes = false;
};

/* The kernel: as k_attn_fwd (block, rows, masking, outputs), on wgmma. Key tile kt's step issues
 * S_kt and P_kt-1 V_kt-1, then runs the softmax of S_kt while that product runs. Compiled for
 * sm_90a only; elsewhere the body is a trap that the host never launches (fa_fwd_wgmma_ok). */
template <typename T, int D, bool AMAX, typename Epi>
__device__ __forceinline__ void fa_fwd_wgmma_body(T* out, float* lse, const FaHeadMaps& maps, int T_, int C, int H,
                                                  float sl2, unsigned* amax_bits, Epi epi) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using W = FaWg<D>;
    __shared__ __align__(1024) unsigned char smem[W::SMEM];
    __shared__ __align__(8) unsigned long long loaded[2]; /* mbarriers: load group g completes loaded[g % 2] */
    unsigned smem_addr = (unsigned)__cvta_generic_to_shared(smem), pad = (1024 - (smem_addr & 1023)) & 1023;
    unsigned char* tiles = smem + pad; /* [q | k0 | k1 | v0 | v1], each TILE_BYTES */
    unsigned q_addr = smem_addr + pad, bar0 = (unsigned)__cvta_generic_to_shared(loaded);
    auto k_tile = [&](int kt) { return (1 + (kt & 1)) * W::TILE_BYTES; }; /* byte offsets in tiles */
    auto v_tile = [&](int kt) { return (3 + (kt & 1)) * W::TILE_BYTES; };
    int warp = threadIdx.x >> 5;
    FaBlock blk = fa_block();
    int qt = blk.n_tiles - 1 - blk.tile, bh = blk.bh, b = bh / H, hd = bh % H;
    int q0 = qt * FA_TILE, row0 = q0 + warp * 16, col0 = hd * D;
    size_t base = (size_t)b * T_ * C + (size_t)col0;

    /* load groups (thread 0 issues them): 0 = {Q, K0}, g >= 1 = {K_g (g <= qt), V_g-1}; step kt
     * (0 .. qt) reads group kt, the last P V group qt + 1; group g's mbarrier is in phase g / 2 */
    auto issue = [&](int g) {
        unsigned bar = bar0 + 8 * (g & 1);
        bool with_k = g <= qt;
        mbar_arrive_expect_bytes(bar, (1 + with_k) * W::TILE_BYTES); /* Q or V, and K */
        if (g == 0) tma_load_3d(q_addr, &maps.q, col0, q0, b, bar);
        if (with_k) tma_load_3d(q_addr + k_tile(g), &maps.k, col0, g * FA_TILE, b, bar);
        if (g > 0) tma_load_3d(q_addr + v_tile(g - 1), &maps.v, col0, (g - 1) * FA_TILE, b, bar);
    };
    auto await_group = [&](int g) { mbar_wait(bar0 + 8 * (g & 1), (g >> 1) & 1); };
    if (threadIdx.x == 0) {
        mbar_init(bar0, 1);
        mbar_init(bar0 + 8, 1);
        mbar_init_fence();
        issue(0);
        issue(1);
    }
    __syncthreads(); /* the barriers are initialised before anyone waits on them */

    float s[FA_TILE / 8][4], o[Fa<D>::ND][4] = {}, alpha[2];
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}; /* running max (base 2), this lane's sum */
    unsigned p[FA_TILE / 16][4];                                /* P of the previous tile, T pairs */
    await_group(0);
    fa_wg_fence();
    fa_wg_scores<T, D>(s, q_addr, q_addr + k_tile(0));
    fa_wg_wait<0>();
    fa_wg_hold<FA_TILE / 8>(s);
    if (qt == 0) fa_mask_diagonal<false>(s, warp * 16);
    fa_softmax_tile<D>(s, m, l, alpha, sl2, NULL); /* o is 0: nothing to rescale */
    fa_wg_pack_p<T>(p, s);

    for (int kt = 1; kt <= qt; kt++) {
        await_group(kt); /* K_kt and V_kt-1 have landed */
        __syncthreads(); /* everyone is done with S_kt-1 and P V_kt-2, whose buffers group kt + 1 takes */
        fa_wg_fence();   /* o and p were written by ordinary instructions */
        fa_wg_scores<T, D>(s, q_addr, q_addr + k_tile(kt));
        fa_wg_accumulate<T, D>(o, p, q_addr + v_tile(kt - 1));
        if (threadIdx.x == 0) issue(kt + 1); /* beside the products, into buffers neither reads */
        fa_wg_wait<1>(); /* S_kt is done; P_kt-1 V_kt-1 runs on beside the softmax */
        fa_wg_hold<FA_TILE / 8>(s);
        if (kt == qt) fa_mask_diagonal<false>(s, warp * 16);
        fa_softmax_tile<D>(s, m, l, alpha, sl2, NULL); /* o is still being accumulated */
        fa_wg_block_end(l[0]);
        fa_wg_wait<0>();
        fa_wg_hold<Fa<D>::ND>(o);
        for (int h = 0; h < 2; h++) fa_rescale_rows<D>(o, alpha[h], h);
        fa_wg_pack_p<T>(p, s); /* only now: P V_kt-1 read these registers (else ptxas serialises the
                                * products, C7513) */
    }
    await_group(qt + 1); /* V of the diagonal tile */
    fa_wg_fence();
    fa_wg_accumulate<T, D>(o, p, q_addr + v_tile(qt));
    fa_wg_wait<0>();
    fa_wg_hold<Fa<D>::ND>(o);

    unsigned am = fa_fwd_store<T, D, AMAX>(out, base, lse, (size_t)bh * T_, o, m, l, row0, T_, C);
    if constexpr (Epi::codes) { /* out's rows again, as fa_fwd_store rounds them, as codes */
        static_assert(Epi::template tile_bytes<D>() <= W::TILE_BYTES, "the codes fit the Q tile");
        for (int h = 0; h < 2; h++) {
            float inv = 1.0f / fa_quad_sum(l[h]);
            for (int n = 0; n < Fa<D>::ND; n++) o[n][2 * h] *= inv, o[n][2 * h + 1] *= inv;
        }
        __syncthreads(); /* every warp's products are done with the tiles */
        am = epi.template stage<T, D>(tiles, o, 1.0f, T_ - row0);
        __syncthreads();
        epi.template write<D, 1>(tiles, 0, b, qt, hd, T_, C);
        epi.finish(am, (unsigned*)(tiles + W::TILE_BYTES), true); /* K tile 0 lends the partial maxima */
    } else {
        /* the products are done with the tiles: the Q tile lends the block's partial maxima */
        if constexpr (AMAX) block_amax_commit_in(amax_bits, am, (unsigned*)tiles);
    }
#else
    __trap();
#endif
}

template <typename T, int D, bool AMAX>
__global__ void __launch_bounds__(FA_THREADS, FA_MIN_BLOCKS_FWD)
    k_attn_fwd_wgmma(T* out, float* lse, const __grid_constant__ FaHeadMaps maps, int T_, int C, int H, float sl2,
                     unsigned* amax_bits) {
    await_previous_kernel();
    fa_fwd_wgmma_body<T, D, AMAX>(out, lse, maps, T_, C, H, sl2, amax_bits, FaBwdPlain());
}

/* Whether this process launches k_attn_fwd_wgmma<T, D, *>: where the kernel image the CUDA runtime
 * loaded for this GPU was compiled for sm_90a. Elsewhere (an sm_80/86/89 image, or compute_90 PTX
 * compiled on load for another GPU) its body is the trap alone, with no shared memory: the loaded
 * image's static shared memory (cudaFuncGetAttributes, no launch and no stream work, so safe while
 * a CUDA graph is being captured) tells the two apart. Asked once per instantiation. */
template <typename Kernel> static bool fa_sm90a_image(Kernel kernel, size_t sm90a_static_bytes) {
    cudaFuncAttributes a;
    CUDA_CHECK(cudaFuncGetAttributes(&a, kernel));
    return a.sharedSizeBytes >= sm90a_static_bytes;
}
template <typename T, int D> static bool fa_fwd_wgmma_ok(void) {
    static int ok = -1;
    if (ok < 0) ok = fa_sm90a_image(k_attn_fwd_wgmma<T, D, false>, FaWg<D>::SMEM);
    return ok;
}

/* The dK/dV kernels' per-query values of query tile rows [q0, q0 + 64) of head bh: lse in base 2
 * and delta, staged in shared memory (ordinary stores: a barrier publishes them); 0 past T. */
__device__ __forceinline__ void fa_load_lse_delta(float* lse2s, float* dls, const float* lse, const float* delta,
                                                  int bh, int q0, int T_) {
    for (int c = threadIdx.x; c < FA_TILE; c += FA_THREADS) {
        bool ok = q0 + c < T_;
        lse2s[c] = ok ? lse[(size_t)bh * T_ + q0 + c] * FA_LOG2E : 0.0f;
        dls[c] = ok ? delta[(size_t)bh * T_ + q0 + c] : 0.0f;
    }
}

/* dK, dV: block (key tile, b*H + h); warp w owns keys kv0 + 16w .. +15 (lane: keys g, g+8) and
 * accumulates their dK, dV rows in registers over the query tiles from the diagonal on. Works on
 * transposed blocks (rows = keys, columns = queries): S^T = K Q^T, dP^T = V dO^T, then
 * dV += P^T dO, dK += dS^T Q; and stores each dS^T tile for the dQ kernel (fa_ds_tile). AMAX
 * (precision fp8, whose QKV backward casts dq, dk, dv as one tensor): the amax of the dk and dv it
 * stores into *amax_bits, as k_attn_fwd's; one register until the stores, the only work after
 * the loop, so the loop's registers are untouched. */
template <typename T, int D, bool AMAX>
__global__ void __launch_bounds__(FA_THREADS, FA_MIN_BLOCKS_DKV)
    k_attn_bwd_dkv(T* dk, T* dv, T* ds_tiles, const T* dout, const float* lse, const float* delta, const T* q,
                   const T* k, const T* v, int T_, int C, int H, float scale, float sl2, unsigned* amax_bits) {
    await_previous_kernel();
    /* double-buffered: query tile qt in [(qt - kt) & 1], with its lse (base 2) and delta */
    __shared__ __align__(16) T qs[2][FA_TILE * Fa<D>::LD];
    __shared__ __align__(16) T dos[2][FA_TILE * Fa<D>::LD];
    __shared__ float lse2s[2][FA_TILE], dls[2][FA_TILE];
    __shared__ __align__(16) T ds_stages[FA_WARPS][16 * Fa<FA_TILE>::LD]; /* per warp: its dS^T rows */
    constexpr int COLS = FaBwd<D>::COLS;
    int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    FaBlock blk = fa_block();
    int kt = blk.tile, bh = blk.bh, b = bh / H, hd = bh % H, n_tiles = (T_ + FA_TILE - 1) / FA_TILE;
    int sub = warp * 16, row0 = kt * FA_TILE + sub; /* the warp's first row within the tile, and in all */
    size_t base = (size_t)b * T_ * C + (size_t)hd * D;
    T* ds_stage = ds_stages[warp];
    /* starts loading query tile qt into buffer `buf` */
    auto load_queries = [&](int qt, int buf) {
        fa_load_rows<T, D>(qs[buf], q + base, qt * FA_TILE, T_, C);
        fa_load_rows<T, D>(dos[buf], dout + base, qt * FA_TILE, T_, C);
        fa_load_lse_delta(lse2s[buf], dls[buf], lse, delta, bh, qt * FA_TILE, T_);
    };

    unsigned ka[Fa<D>::KD][4], va[Fa<D>::KD][4];
    fa_load_kv<T, D>(qs[1], dos[1], k + base, v + base, kt, T_, C); /* k and v staged through the second buffers */
    load_queries(kt, 0);
    fa_cp_commit();
    fa_cp_wait<0>();
    __syncthreads();
    fa_load_a<T, D>(ka, qs[1] + sub * Fa<D>::LD);
    fa_load_a<T, D>(va, dos[1] + sub * Fa<D>::LD);
    __syncthreads(); /* everyone has its k, v before the second buffers take the next tile */
    float dk_acc[Fa<D>::ND][4] = {}, dv_acc[Fa<D>::ND][4] = {};

    for (int qt = kt; qt < n_tiles; qt++) {
        int cur = (qt - kt) & 1;
        if (qt + 1 < n_tiles) load_queries(qt + 1, cur ^ 1);
        fa_cp_commit();
        fa_cp_wait<1>(); /* tile qt has landed (this thread's part) ... */
        __syncthreads(); /* ... and everyone's */
        /* the tile's queries, COLS at a time: S^T and dP^T of queries c0 .. c0 + COLS - 1 ...
         * (the step's body is two lambdas because so written ptxas spills nothing at D = 64 and 168
         * registers; inline, 24 bytes with nvcc 13.0: docs/BENCHMARKS.md log #43) */
        auto scores = [&](float (*p)[4], float (*ds)[4], int c0) {
            fa_scores<T, D, COLS>(p, ka, qs[cur] + c0 * Fa<D>::LD);
            fa_scores<T, D, COLS>(ds, va, dos[cur] + c0 * Fa<D>::LD);
            if (qt == kt) fa_mask_diagonal<true, COLS>(p, sub, c0);
        };
        /* ... then P, dS and their products, and dS staged */
        auto accumulate = [&](float (*p)[4], float (*ds)[4], int c0) {
            const T* qh = qs[cur] + c0 * Fa<D>::LD;
            const T* doh = dos[cur] + c0 * Fa<D>::LD;
            const float* lse2c = lse2s[cur] + c0;
            const float* dlc = dls[cur] + c0;
            /* queries past T (a partial last tile) were loaded as zero rows of q and dout with lse
             * and delta 0: their P is 1 but their dP and dout rows are 0, so they add nothing */
            for (int j = 0; j < COLS / 8; j++)
                for (int h = 0; h < 2; h++)
                    for (int e = 0; e < 2; e++) {
                        int col = 8 * j + 2 * t + e;
                        float pr = fa_exp2(fmaf(p[j][2 * h + e], sl2, -lse2c[col]));
                        p[j][2 * h + e] = pr;
                        ds[j][2 * h + e] = pr * (ds[j][2 * h + e] - dlc[col]);
                    }
            fa_accumulate<T, D, COLS>(dv_acc, p, doh);
            fa_accumulate<T, D, COLS>(dk_acc, ds, qh);
            /* this warp's 16 key rows of the dS^T tile, rounded to T as the product above used them,
             * into its staging rows (row g + 8h; conflict-free: rows are 4 banks apart) */
            for (int j = 0; j < COLS / 8; j++)
                for (int h = 0; h < 2; h++)
                    *(unsigned*)(ds_stage + (g + 8 * h) * Fa<FA_TILE>::LD + c0 + 8 * j + 2 * t) =
                        fa_pack<T>(ds[j][2 * h], ds[j][2 * h + 1]);
        };
        for (int c0 = 0; c0 < FA_TILE; c0 += COLS) {
            float p[COLS / 8][4], ds[COLS / 8][4];
            scores(p, ds, c0);
            accumulate(p, ds, c0);
        }
        __syncwarp();
        fa_store_ds_fragments(ds_tiles + fa_ds_tile(bh, qt, kt, n_tiles), ds_stage, warp);
        __syncthreads(); /* everyone is done with buffer cur before it takes tile qt + 2 */
    }

    unsigned am = fa_store_out<T, D, AMAX>(dv + base + (size_t)row0 * C, dv_acc, 1.0f, T_ - row0, C);
    am = max(am, fa_store_out<T, D, AMAX>(dk + base + (size_t)row0 * C, dk_acc, scale, T_ - row0, C));
    /* the staged tiles are done with (the loop's last barrier): lse2s lends the partial maxima */
    if constexpr (AMAX) block_amax_commit_in(amax_bits, am, (unsigned*)lse2s[0]);
}

/* The dK/dV kernel on Hopper's warpgroup products (wgmma, sm_90a; docs/DESIGN.md §9: 117.5 against
 * k_attn_bwd_dkv's 169 µs a launch at ANDREA-120M on an H200). The same block, outputs and dS tiles
 * as k_attn_bwd_dkv (where the image has no sm_90a code, k_attn_bwd_dkv runs: fa_dkv_wgmma_ok); the
 * block's 4 warps are one warpgroup and each product covers its 64 keys, on the forward's
 * primitives (k_attn_fwd_wgmma: tiles, descriptors, wrappers):
 *   S^T = K Q^T, dP^T = V dO^T   m64n64k16, A = the K / V tile, B = the Q / dO tile, both K-major
 *                                from shared memory (fa_wg_scores, as the forward's S = Q K^T);
 *   dV += P^T dO, dK += dS^T Q   m64nDk16, A = P^T / dS^T from registers (accumulators rounded to T),
 *                                B = the dO / Q tile read N-major (fa_wg_accumulate, as P V).
 * A query tile's step issues S^T and dP^T as two groups, computes P^T while dP^T runs, issues
 * dV += P^T dO, computes dS^T while that runs, issues dK += dS^T Q and stores dS while that runs;
 * the other blocks on the multiprocessor (3, as k_attn_bwd_dkv) fill the rest. The dS tile goes to
 * memory straight from registers: each 8x8 block of a dS^T A fragment, transposed in the warp
 * (movmatrix), is the matching block of the dQ kernel's dS A fragment, so the tile holds the bits
 * fa_store_ds_fragments stores (no staging in shared memory).
 *
 * Shared memory: the K and V tiles and triple-buffered Q and dO tiles in the forward's swizzled
 * layout, 8 x 2D x 64 bytes + 1024 to align (65 KiB at D = 64: dynamic, over the static 48 KiB;
 * 3 blocks fit a multiprocessor), plus lse and delta of the three query tiles (static). One
 * barrier per step: step qt waits for tile qt's copies, issues S^T and dP^T, then starts tile
 * qt + 2's copies beside them into the buffers of tile qt - 1, whose products every thread waited
 * for at the end of step qt - 1 (copies one step ahead, into two buffers, left the warps waiting
 * for them at a ninth of Nsight Compute's samples: docs/BENCHMARKS.md #182). Nothing but
 * that barrier comes before a step's products (docs/DESIGN.md §9: 141 -> 117.5 µs a launch at
 * ANDREA-120M, docs/BENCHMARKS.md log #72), because a step that first copied the next tile held
 * the warpgroup's products for ~470 instructions and a global round trip:
 *   - lse and delta come by cp.async in the tile's copy group (fa_cp_lse_delta), not by a load,
 *     scale and store that two warps, and so the whole warpgroup, waited for; lse is kept as
 *     stored and scaled by log2(e) where used (the same rounded product);
 *   - the Q and dO tiles (and, with the first query tile, K and V) come by the TMA (thread 0
 *     issues them), as the forward's;
 *   - the diagonal tile, always the block's first, is a step of its own, so no other step carries
 *     the mask.
 * Compiled for sm_90a only; elsewhere the body is a trap that the host never launches
 * (fa_dkv_wgmma_ok). Head size 16 stays on k_attn_bwd_dkv. Issuing the next tile's S^T and dP^T a
 * step ahead (FlashAttention-3's overlap: three query buffers, a second score register set, 2
 * blocks a multiprocessor) was measured and gained nothing (docs/DESIGN.md §9), so the issue of
 * those products is not what bounds this kernel. */
template <int D> struct FaWgDkv {
    /* query tiles in flight: the one a step works on and the next two, whose copies are under way
     * (two, one step ahead, left the warps waiting for them: docs/BENCHMARKS.md #182) */
    static constexpr int STAGES = 3;
    static constexpr int DYNAMIC_SMEM = (2 + 2 * STAGES) * FaWg<D>::TILE_BYTES + 1024; /* k, v, q[], dout[] */
    static constexpr int STATIC_SMEM = STAGES * 2 * FA_TILE * (int)sizeof(float); /* lses, dls: at least the
                                                                                    * sm_90a body's static bytes */
};

/* Asynchronous 4-byte copy global -> shared (src_bytes 0: write zeros, read nothing). */
__device__ __forceinline__ void fa_cp_async4(void* dst, const void* src, int src_bytes) {
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(src_bytes));
}
/* Starts copying lse (as stored, natural log) and delta of query tile rows [q0, q0 + 64) of head bh
 * into lses, dls: one value a thread; 0 past T, as fa_load_lse_delta. */
__device__ __forceinline__ void fa_cp_lse_delta(float* lses, float* dls, const float* lse, const float* delta,
                                                int bh, int q0, int T_) {
    static_assert(FA_THREADS == 2 * FA_TILE, "one value a thread");
    int c = threadIdx.x % FA_TILE;
    bool is_lse = threadIdx.x < FA_TILE, ok = q0 + c < T_;
    const float* src = is_lse ? lse : delta;
    fa_cp_async4((is_lse ? lses : dls) + c, ok ? src + (size_t)bh * T_ + q0 + c : src, ok ? 4 : 0);
}

/* An 8x8 matrix of 16-bit values held one register per lane (lane 4g + t: row g, columns 2t,
 * 2t + 1), transposed in the same layout. */
__device__ __forceinline__ unsigned fa_transpose8x8(unsigned x) {
    unsigned y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

/* The warp's dS^T A fragments (its 16 keys = k step `warp` of the dQ kernel; fragment i: queries
 * 16i .. 16i + 15; blocks [0] keys 0-7 x queries 0-7, [1] keys 8-15 x 0-7, [2] keys 0-7 x 8-15,
 * [3] keys 8-15 x 8-15) as the dQ kernel's A fragments of query group i, stored where
 * fa_store_ds_fragments stores them: {queries 0-7 x keys 0-7, 8-15 x 0-7, 0-7 x 8-15, 8-15 x
 * 8-15}, each the transpose of one block. */
__device__ __forceinline__ void fa_wg_ds_fragments(uint4* out, const unsigned (*ds)[4]) {
    for (int i = 0; i < FA_TILE / 16; i++)
        out[i] = make_uint4(fa_transpose8x8(ds[i][0]), fa_transpose8x8(ds[i][2]), fa_transpose8x8(ds[i][1]),
                            fa_transpose8x8(ds[i][3]));
}
template <typename T> __device__ __forceinline__ void fa_wg_store_ds(T* tile, const unsigned (*ds)[4], int warp) {
    uint4 frag[FA_TILE / 16];
    fa_wg_ds_fragments(frag, ds);
    uint4* p = (uint4*)tile + warp * 32 + (threadIdx.x & 31);
    for (int i = 0; i < FA_TILE / 16; i++) p[i * (FA_TILE / 16) * 32] = frag[i];
}

/* The backward's kernels' epilogues (FaBwdPlain, FaBwdCodes: above, at fa_fwd_wgmma_body): dK, dV
 * or dQ rows stored in T, or instead their codes for the QKV backward's product. */
template <typename T, int D, bool AMAX, typename Epi>
__device__ __forceinline__ void fa_bwd_dkv_wgmma_body(T* dk, T* dv, T* ds_tiles, const FaDkvMaps& maps,
                                                      const float* lse, const float* delta, int T_, int C, int H,
                                                      float scale, float sl2, unsigned* amax_bits,
                                                      unsigned char* fa_dkv_smem, Epi epi) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using W = FaWg<D>;
    constexpr int NQ = FaWgDkv<D>::STAGES; /* query tile qt's buffers: [(qt - kt) % NQ] */
    static_assert(NQ == 3, "the steps below start the copies NQ - 1 = 2 tiles ahead");
    /* lse as stored (natural log, scaled where used) */
    __shared__ float lses[NQ][FA_TILE], dls[NQ][FA_TILE];
    __shared__ __align__(8) unsigned long long loaded[NQ]; /* mbarriers: query tile qt's loads */
    unsigned smem_addr = (unsigned)__cvta_generic_to_shared(fa_dkv_smem), pad = (1024 - (smem_addr & 1023)) & 1023;
    unsigned char* tiles = fa_dkv_smem + pad; /* [k | v | q[NQ] | dout[NQ]], each TILE_BYTES */
    unsigned k_addr = smem_addr + pad, v_addr = k_addr + W::TILE_BYTES, bar0 = (unsigned)__cvta_generic_to_shared(loaded);
    auto q_tile = [&](int buf) { return (2 + buf) * W::TILE_BYTES; }; /* byte offsets in tiles */
    auto do_tile = [&](int buf) { return (2 + NQ + buf) * W::TILE_BYTES; };
    int warp = threadIdx.x >> 5, t = threadIdx.x & 3;
    FaBlock blk = fa_block();
    int kt = blk.tile, bh = blk.bh, b = bh / H, hd = bh % H, n_tiles = blk.n_tiles;
    int sub = warp * 16, row0 = kt * FA_TILE + sub; /* the warp's first key within the tile, and in all */
    int col0 = hd * D;
    size_t base = (size_t)b * T_ * C + (size_t)col0;
    /* starts loading query tile qt (the i-th, i = qt - kt) into buffer i % NQ: its Q and dO tiles by
     * the TMA (thread 0; the first also K and V) on mbarrier loaded[i % NQ], in its phase (i / NQ) % 2,
     * and lse and delta by cp.async, one group */
    auto load_queries = [&](int qt) {
        int i = qt - kt, buf = i % NQ;
        if (threadIdx.x == 0) {
            unsigned bar = bar0 + 8 * buf;
            mbar_arrive_expect_bytes(bar, (i == 0 ? 4 : 2) * W::TILE_BYTES);
            if (i == 0) {
                tma_load_3d(k_addr, &maps.qkv.k, col0, kt * FA_TILE, b, bar);
                tma_load_3d(v_addr, &maps.qkv.v, col0, kt * FA_TILE, b, bar);
            }
            tma_load_3d(k_addr + q_tile(buf), &maps.qkv.q, col0, qt * FA_TILE, b, bar);
            tma_load_3d(k_addr + do_tile(buf), &maps.dout, col0, qt * FA_TILE, b, bar);
        }
        fa_cp_lse_delta(lses[buf], dls[buf], lse, delta, bh, qt * FA_TILE, T_);
        fa_cp_commit();
    };
    float dk_acc[Fa<D>::ND][4] = {}, dv_acc[Fa<D>::ND][4] = {};

    /* query tile qt's step (one barrier, above), s and dp its scores; diagonal: qt == kt */
    auto step = [&](float (*s)[4], float (*dp)[4], int qt, bool diagonal) {
        int i = qt - kt, cur = i % NQ, phase = (i / NQ) & 1;
        fa_cp_wait<1>();                     /* lse and delta of tile qt have landed (this thread's) ... */
        mbar_wait(bar0 + 8 * cur, phase); /* ... its tiles too (the TMA's writes and the products'
                                           * reads are both async-proxy: no fence) ... */
        __syncthreads(); /* ... and everyone's; everyone's products on tile qt - 1 are done */
        unsigned q_addr = k_addr + q_tile(cur), do_addr = k_addr + do_tile(cur);
        const float *lsec = lses[cur], *dlc = dls[cur];
        /* lse of query col in base 2 (as fa_load_lse_delta's product) */
        auto lse2 = [&](int col) { return lsec[col] * FA_LOG2E; };
        unsigned p[FA_TILE / 16][4], ds[FA_TILE / 16][4]; /* P^T, dS^T rounded to T: A fragments */
        fa_wg_fence(); /* p and ds were written by ordinary instructions */
        fa_wg_scores<T, D>(s, k_addr, q_addr); /* S^T and dP^T, issued as two groups */
        fa_wg_scores<T, D>(dp, v_addr, do_addr);
        if (qt + 2 < n_tiles) /* beside S^T, dP^T */
            load_queries(qt + 2);
        else /* an empty group, so that a step always finds the group of the tile after its own
              * committed (fa_cp_wait<1>) */
            fa_cp_commit();
        fa_wg_wait<1>(); /* S^T is done; dP^T runs on beside P^T */
        fa_wg_hold<FA_TILE / 8>(s);
        if (diagonal) fa_mask_diagonal<true>(s, sub);
        /* queries past T (a partial last tile) were loaded as zero rows of q and dout with lse and
         * delta 0: their P is 1 but their dP and dout rows are 0, so they add nothing */
        for (int j = 0; j < FA_TILE / 8; j++)
            for (int e = 0; e < 4; e++) s[j][e] = fa_exp2(fmaf(s[j][e], sl2, -lse2(8 * j + 2 * t + (e & 1))));
        fa_wg_pack_p<T>(p, s);
        fa_wg_fence();
        fa_wg_accumulate<T, D>(dv_acc, p, do_addr);
        fa_wg_wait<1>(); /* dP^T is done; dV += P^T dO runs on beside dS^T */
        fa_wg_hold<FA_TILE / 8>(dp);
        for (int j = 0; j < FA_TILE / 8; j++)
            for (int e = 0; e < 4; e++) dp[j][e] = s[j][e] * (dp[j][e] - dlc[8 * j + 2 * t + (e & 1)]);
        fa_wg_pack_p<T>(ds, dp);
        fa_wg_store_ds(ds_tiles + fa_ds_tile(bh, qt, kt, n_tiles), ds, warp); /* while dV runs */
        fa_wg_fence();
        fa_wg_accumulate<T, D>(dk_acc, ds, q_addr);
        fa_wg_wait<0>(); /* before the next step's barrier: its copies take this step's buffers */
    };

    if (threadIdx.x == 0) {
        for (int j = 0; j < NQ; j++) mbar_init(bar0 + 8 * j, 1);
        mbar_init_fence();
    }
    __syncthreads(); /* the barriers are initialised before anyone waits on them */
    load_queries(kt);
    if (kt + 1 < n_tiles) /* the second tile's, as a step's below */
        load_queries(kt + 1);
    else
        fa_cp_commit();
    float s[FA_TILE / 8][4], dp[FA_TILE / 8][4];
    step(s, dp, kt, true); /* the diagonal first, then no step tests for it */
    for (int qt = kt + 1; qt < n_tiles; qt++) step(s, dp, qt, false);
    fa_wg_hold<Fa<D>::ND>(dk_acc);
    fa_wg_hold<Fa<D>::ND>(dv_acc);

    if constexpr (Epi::codes) { /* the tiles are free once every warp's products are done */
        __syncthreads();
        unsigned char *dk_codes = tiles, *dv_codes = tiles + Epi::template tile_bytes<D>();
        unsigned am = epi.template stage<T, D>(dv_codes, dv_acc, 1.0f, T_ - row0);
        am = max(am, epi.template stage<T, D>(dk_codes, dk_acc, scale, T_ - row0));
        __syncthreads();
        epi.template write<D>(dk_codes, 1, b, kt, hd, T_, C);
        epi.template write<D>(dv_codes, 2, b, kt, hd, T_, C);
        epi.finish(am, (unsigned*)lses[0], true);
    } else {
        __syncthreads(); /* every warp's products are done with the tiles, which stage dV's and dK's rows */
        T* stage = reinterpret_cast<T*>(tiles) + sub * Fa<D>::LD;
        static_assert(2 * FA_TILE * Fa<D>::LD * sizeof(T) <= 6 * W::TILE_BYTES, "dV's and dK's rows fit the tiles");
        unsigned am = fa_store_out_staged<T, D, AMAX>(dv + base + (size_t)row0 * C, stage, dv_acc, 1.0f, T_ - row0, C);
        am = max(am, fa_store_out_staged<T, D, AMAX>(dk + base + (size_t)row0 * C, stage + FA_TILE * Fa<D>::LD, dk_acc,
                                                     scale, T_ - row0, C));
        /* lses lends the partial maxima (block_amax_commit_in's leading barrier: all are done with it) */
        if constexpr (AMAX) block_amax_commit_in(amax_bits, am, (unsigned*)lses[0]);
    }
#else
    __trap();
#endif
}

template <typename T, int D, bool AMAX>
__global__ void __launch_bounds__(FA_THREADS, FA_MIN_BLOCKS_DKV)
    k_attn_bwd_dkv_wgmma(T* dk, T* dv, T* ds_tiles, const __grid_constant__ FaDkvMaps maps, const float* lse,
                         const float* delta, int T_, int C, int H, float scale, float sl2, unsigned* amax_bits) {
    await_previous_kernel();
    /* declared in each kernel, not in the body: an extern's alignment there would align every
     * kernel's dynamic shared memory */
    extern __shared__ __align__(1024) unsigned char fa_dkv_smem[];
    fa_bwd_dkv_wgmma_body<T, D, AMAX>(dk, dv, ds_tiles, maps, lse, delta, T_, C, H, scale, sl2, amax_bits, fa_dkv_smem,
                                      FaBwdPlain());
}

/* Whether this process launches k_attn_bwd_dkv_wgmma<T, D, *> (as fa_fwd_wgmma_ok: the sm_90a body
 * alone has static shared memory, lses, dls and the mbarriers); where it does, both instantiations are allowed
 * their dynamic shared memory (over the default 48 KiB at D = 64) and asked for the largest
 * shared-memory carveout (3 blocks a multiprocessor need up to 200 KiB), once. */
template <typename T, int D> static bool fa_dkv_wgmma_ok(void) {
    static int ok = -1;
    if (ok >= 0) return ok;
    ok = fa_sm90a_image(k_attn_bwd_dkv_wgmma<T, D, false>, FaWgDkv<D>::STATIC_SMEM);
    if (!ok) return false;
    for (auto kernel : {k_attn_bwd_dkv_wgmma<T, D, false>, k_attn_bwd_dkv_wgmma<T, D, true>}) {
        CUDA_CHECK(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, FaWgDkv<D>::DYNAMIC_SMEM));
        CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        cudaSharedmemCarveoutMaxShared));
    }
    return true;
}

/* dQ: block (query tile, b*H + h); warp w owns query rows q0 + 16w .. +15 and accumulates
 * dQ = scale · dS K over the key tiles up to the diagonal, from the dS tiles the dK/dV kernel
 * stored in A-fragment order (loaded straight into registers, a tile ahead). Masked and past-T entries of those
 * tiles are 0 or meet zero rows of K, so whole tiles are used. AMAX: the amax of the dq it stores
 * into *amax_bits (the slot of k_attn_bwd_dkv's dk, dv), as k_attn_fwd's. */
template <typename T, int D, bool AMAX, typename Epi>
__device__ __forceinline__ void fa_bwd_dq_body(T* dq, const T* ds_tiles, const T* k, int T_, int C, int H, float scale,
                                               unsigned* amax_bits, Epi epi) {
    __shared__ __align__(16) T ks[2][FA_TILE * Fa<D>::LD]; /* double-buffered: tile kt in [kt & 1] */
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    /* heads in the reverse of the dK/dV kernel's order: the first blocks read the tiles written
     * last, the likeliest still in L2 */
    FaBlock blk = fa_block();
    int qt = blk.n_tiles - 1 - blk.tile, bh = blk.n_bh - 1 - blk.bh, b = bh / H, hd = bh % H;
    int row0 = qt * FA_TILE + warp * 16;
    size_t base = (size_t)b * T_ * C + (size_t)hd * D;
    const T* ds_row = ds_tiles + fa_ds_tile(bh, qt, 0, blk.n_tiles); /* tiles (qt, 0 .. qt), consecutive */
    float dq_acc[Fa<D>::ND][4] = {};
    /* this warp's A fragments of dS tile kt, one 16-byte load per lane and k step */
    auto load_fragments = [&](unsigned (*a)[4], int kt) {
        const uint4* p = (const uint4*)(ds_row + (size_t)kt * FA_TILE * FA_TILE) + warp * (FA_TILE / 16) * 32 + lane;
        for (int kk = 0; kk < FA_TILE / 16; kk++) {
            uint4 v = p[kk * 32];
            a[kk][0] = v.x, a[kk][1] = v.y, a[kk][2] = v.z, a[kk][3] = v.w;
        }
    };
    unsigned a_next[FA_TILE / 16][4];
    fa_load_rows<T, D>(ks[0], k + base, 0, T_, C);
    fa_cp_commit();
    load_fragments(a_next, 0);
    for (int kt = 0; kt <= qt; kt++) {
        int cur = kt & 1;
        unsigned a[FA_TILE / 16][4];
        memcpy(a, a_next, sizeof a);
        if (kt < qt) {
            fa_load_rows<T, D>(ks[cur ^ 1], k + base, (kt + 1) * FA_TILE, T_, C);
            load_fragments(a_next, kt + 1);
        }
        fa_cp_commit();
        fa_cp_wait<1>(); /* K tile kt has landed (this thread's part) ... */
        __syncthreads(); /* ... and everyone's */
        for (int kk = 0; kk < FA_TILE / 16; kk++) fa_accumulate_step<T, D>(dq_acc, a[kk], ks[cur], kk);
        __syncthreads(); /* everyone is done with buffer cur before it takes tile kt + 2 */
    }
    if constexpr (Epi::codes) { /* the staged tiles are done with (the loop's last barrier) */
        static_assert(Epi::template tile_bytes<D>() <= sizeof ks[0], "the codes fit a staged tile");
        unsigned char* dq_codes = (unsigned char*)ks[0];
        unsigned am = epi.template stage<T, D>(dq_codes, dq_acc, scale, T_ - row0);
        __syncthreads();
        epi.template write<D>(dq_codes, 0, b, qt, hd, T_, C);
        epi.finish(am, (unsigned*)ks[1], false);
    } else {
        /* the staged tiles are done with (the loop's last barrier): ks[0] stages each warp's rows, then
         * lends the partial maxima (block_amax_commit_in's leading barrier: every warp has stored) */
        unsigned am = fa_store_out_staged<T, D, AMAX>(dq + base + (size_t)row0 * C, ks[0] + warp * 16 * Fa<D>::LD,
                                                      dq_acc, scale, T_ - row0, C);
        if constexpr (AMAX) block_amax_commit_in(amax_bits, am, (unsigned*)ks[0]);
    }
}

template <typename T, int D, bool AMAX>
__global__ void FA_DQ_BOUNDS
    k_attn_bwd_dq(T* dq, const T* ds_tiles, const T* k, int T_, int C, int H, float scale, unsigned* amax_bits) {
    await_previous_kernel();
    fa_bwd_dq_body<T, D, AMAX>(dq, ds_tiles, k, T_, C, H, scale, amax_bits, FaBwdPlain());
}

#define FA_DELTA_WARPS 4 /* positions per block of the delta kernel */

/* delta[b, h, i] = sum over head h's columns of (dO ∘ O)[b, i]: one warp per position; lane l
 * takes the row's 16-byte packets l, l + 32, ..., and the D / PACK lanes holding one head's
 * packets add their sums (xor shuffles: a fixed order). */
template <typename T, int D>
__global__ void k_attn_bwd_delta(float* delta, const T* dout, const T* out, int N, int T_, int C, int H) {
    await_previous_kernel();
    constexpr int VEC = PACK(T), LANES_PER_HEAD = D / VEC;
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= N) return; /* the whole warp */
    int b = row / T_, i = row % T_, packets = C / VEC;
    for (int p0 = 0; p0 < packets; p0 += 32) {
        int p = p0 + lane;
        float s = 0.0f;
        if (p < packets) {
            float d[VEC], o[VEC];
            load_vec(d, dout + (size_t)row * C + p * VEC);
            load_vec(o, out + (size_t)row * C + p * VEC);
            for (int c = 0; c < VEC; c++) s += d[c] * o[c];
        }
        for (int off = 1; off < LANES_PER_HEAD; off <<= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        if (p < packets && lane % LANES_PER_HEAD == 0) delta[((size_t)b * H + p / LANES_PER_HEAD) * T_ + i] = s;
    }
}

/* The tiles' 16-byte copies and the TMA's tensor maps need 16-byte aligned tensors (the engine's
 * buffers are 256-aligned): one clear error here rather than a refused map or a misaligned copy. */
static void fa_check_aligned(const void* a, const void* b, const void* c, const void* d) {
    if (((uintptr_t)a | (uintptr_t)b | (uintptr_t)c | (uintptr_t)d) & 15) {
        fprintf(stderr, "error: flash attention needs 16-byte aligned q, k, v, out/dout\n");
        exit(1);
    }
}

/* A flash kernel over (tile, head) blocks, instantiated with precision fp8's fused amax where
 * amax_bits is not NULL and without it (the kernel's code without the amax) where it is. */
#define FA_LAUNCH_SHARED(kernel, T, D, T_, n_bh, shared_bytes, amax_bits, ...)                                \
    do {                                                                                                    \
        dim3 fa_launch_grid = fa_grid(ceil_div(T_, FA_TILE), n_bh);                                         \
        if (amax_bits)                                                                                      \
            launch_kernel_with_shared(kernel<T, D, true>, fa_launch_grid, FA_THREADS, shared_bytes,         \
                                      __VA_ARGS__, amax_bits);                                              \
        else                                                                                                \
            launch_kernel_with_shared(kernel<T, D, false>, fa_launch_grid, FA_THREADS, shared_bytes,        \
                                      __VA_ARGS__, (unsigned*)NULL);                                        \
    } while (0)
#define FA_LAUNCH(kernel, T, D, T_, n_bh, amax_bits, ...) \
    FA_LAUNCH_SHARED(kernel, T, D, T_, n_bh, 0, amax_bits, __VA_ARGS__)

/* amax_bits (precision fp8, else NULL): out's amax as stored, atomicMax'ed in (docs/DESIGN.md §18). */
template <typename T, int D>
static void attn_fwd_flash(T* out, float* lse, const T* q, const T* k, const T* v, int B, int T_, int C, int H,
                           unsigned* amax_bits = NULL) {
    float sl2 = FA_LOG2E / sqrtf((float)D);
    fa_check_aligned(out, q, k, v);
    if constexpr (D == 32 || D == 64) {
        if (fa_fwd_wgmma_ok<T, D>()) {
            FA_LAUNCH(k_attn_fwd_wgmma, T, D, T_, B * H, amax_bits, out, lse, fa_head_maps<D>(q, k, v, B, T_, C),
                      T_, C, H, sl2);
            return;
        }
    }
    FA_LAUNCH(k_attn_fwd, T, D, T_, B * H, amax_bits, out, lse, q, k, v, T_, C, H, sl2);
}

/* The backward's three launches, in order (attn_bwd_flash; bench/attn_bench.cu times each). */
template <typename T, int D>
static void attn_bwd_flash_delta(float* delta, const T* dout, const T* out, int B, int T_, int C, int H) {
    int N = B * T_;
    launch_kernel(k_attn_bwd_delta<T, D>, ceil_div(N, FA_DELTA_WARPS), 32 * FA_DELTA_WARPS, delta, dout, out, N,
                  T_, C, H);
}
/* amax_bits (precision fp8, else NULL) of these two: the amax of what they store, atomicMax'ed in. */
template <typename T, int D>
static void attn_bwd_flash_dkv(T* dk, T* dv, T* ds_tiles, const T* dout, const float* lse, const float* delta,
                               const T* q, const T* k, const T* v, int B, int T_, int C, int H,
                               unsigned* amax_bits = NULL) {
    float scale = 1.0f / sqrtf((float)D), sl2 = FA_LOG2E * scale;
    fa_check_aligned(dout, q, k, v);
    /* whole key tiles, so every row of every dS tile is written (rows past T meet zero rows of K in
     * the dQ kernel, but must be finite) */
    if constexpr (D == 32 || D == 64) {
        if (fa_dkv_wgmma_ok<T, D>()) {
            FA_LAUNCH_SHARED(k_attn_bwd_dkv_wgmma, T, D, T_, B * H, FaWgDkv<D>::DYNAMIC_SMEM, amax_bits, dk, dv,
                             ds_tiles, fa_dkv_maps<D>(q, k, v, dout, B, T_, C), lse, delta, T_, C, H, scale, sl2);
            return;
        }
    }
    FA_LAUNCH(k_attn_bwd_dkv, T, D, T_, B * H, amax_bits, dk, dv, ds_tiles, dout, lse, delta, q, k, v, T_, C, H,
              scale, sl2);
}
template <typename T, int D>
static void attn_bwd_flash_dq(T* dq, const T* ds_tiles, const T* k, int B, int T_, int C, int H,
                              unsigned* amax_bits = NULL) {
    float scale = 1.0f / sqrtf((float)D);
    FA_LAUNCH(k_attn_bwd_dq, T, D, T_, B * H, amax_bits, dq, ds_tiles, k, T_, C, H, scale);
}

/* amax_bits (precision fp8, else NULL): the amax of dq, dk and dv together (the QKV backward casts
 * them as one tensor), atomicMax'ed in. */
template <typename T, int D>
static void attn_bwd_flash(T* dq, T* dk, T* dv, const T* dout, const T* out, const float* lse, const T* q, const T* k,
                           const T* v, int B, int T_, int C, int H, float* delta, T* ds_tiles,
                           unsigned* amax_bits = NULL) {
    fa_check_aligned(dout, q, k, v);
    fa_check_aligned(dq, dk, dv, out);
    attn_bwd_flash_delta<T, D>(delta, dout, out, B, T_, C, H);
    attn_bwd_flash_dkv<T, D>(dk, dv, ds_tiles, dout, lse, delta, q, k, v, B, T_, C, H, amax_bits);
    attn_bwd_flash_dq<T, D>(dq, ds_tiles, k, B, T_, C, H, amax_bits);
}

/* ---------------------------------------------------------------------------------------------- */
/* attn_fwd / attn_bwd: the engine's entry points; pick the path (see the top of the file). */

/* 16-bit types only: the flash kernels are never instantiated for fp32. */
template <typename T> struct FaType { static constexpr bool ok = false; };
template <> struct FaType<bf16> { static constexpr bool ok = true; };
template <> struct FaType<fp16> { static constexpr bool ok = true; };

/* out [B*T, C] = attention(q, k, v); lse [B, H, T] saved for the backward. amax_bits (precision
 * fp8, else NULL): the flash path atomicMax's out's amax in (docs/DESIGN.md §18); returns whether it
 * did (the cuBLAS path leaves the amax to the cast). */
template <typename T>
static bool attn_fwd(T* out, float* lse, const T* q, const T* k, const T* v, int B, int T_, int C, int H,
                     AttnScratch<T> sc, unsigned* amax_bits = NULL) {
    if constexpr (FaType<T>::ok) {
        if (attn_flash_ok<T>(C, H)) {
            switch (C / H) {
            case 16: attn_fwd_flash<T, 16>(out, lse, q, k, v, B, T_, C, H, amax_bits); return true;
            case 32: attn_fwd_flash<T, 32>(out, lse, q, k, v, B, T_, C, H, amax_bits); return true;
            case 64: attn_fwd_flash<T, 64>(out, lse, q, k, v, B, T_, C, H, amax_bits); return true;
            }
        }
    }
    attn_fwd_cublas<T>(out, lse, q, k, v, B, T_, C, H, sc);
    return false;
}

/* dq, dk, dv = from dout (overwritten); reads the forward's out (flash path: delta), q, k, v and the saved lse.
 * amax_bits: as attn_fwd's, for dq, dk and dv together (one tensor to the QKV backward's cast). */
template <typename T>
static bool attn_bwd(T* dq, T* dk, T* dv, const T* dout, const T* out, const float* lse, const T* q, const T* k,
                     const T* v, int B, int T_, int C, int H, AttnScratch<T> sc, unsigned* amax_bits = NULL) {
    if constexpr (FaType<T>::ok) {
        if (attn_flash_ok<T>(C, H)) {
            switch (C / H) {
            case 16:
                attn_bwd_flash<T, 16>(dq, dk, dv, dout, out, lse, q, k, v, B, T_, C, H, sc.delta, sc.ds, amax_bits);
                return true;
            case 32:
                attn_bwd_flash<T, 32>(dq, dk, dv, dout, out, lse, q, k, v, B, T_, C, H, sc.delta, sc.ds, amax_bits);
                return true;
            case 64:
                attn_bwd_flash<T, 64>(dq, dk, dv, dout, out, lse, q, k, v, B, T_, C, H, sc.delta, sc.ds, amax_bits);
                return true;
            }
        }
    }
    attn_bwd_cublas<T>(dq, dk, dv, dout, lse, q, k, v, B, T_, C, H, sc);
    return false;
}

/* ---------------------------------------------------------------------------------------------- */
/* Output projection */

/* out = residual + y @ W_O; out must not alias residual. */
template <typename T>
static void attn_out_fwd(T* out, const T* y, const T* w_o, const T* residual, int N, int C) {
    linear_fwd(out, y, w_o, N, C, C, residual);
}

/* dy = ; dw_o = / += by grad_beta */
template <typename T>
static void attn_out_bwd(T* dy, float* dw_o, const T* dout, const T* y, const T* w_o, int N, int C, float grad_beta) {
    linear_bwd(dy, dw_o, dout, y, w_o, N, C, C, grad_beta);
}

#endif
