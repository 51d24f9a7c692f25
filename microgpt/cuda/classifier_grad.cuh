/* classifier_grad.cuh: the classifier's backward with the softmax folded into its two products, on
 * Hopper (sm_90a, bf16, d_model 64, 128 or 192: ANDREA-12M's classifier, in precision bf16 and in
 * fp8, whose classifier is bf16 below d_model 512). loss.cuh's
 * loss_bwd_from_logits takes it where it applies; elsewhere the loss rows overwrite the logits with
 * dlogits = (softmax - onehot) * dscale and two cuBLAS products read them.
 *
 * Why: at d_model 192 the classifier is bound by its logits tensor [n, Vp] (412 MB a step at
 * ANDREA-12M), which the unfused path moves five times: written by the logits product, read and
 * overwritten by the loss rows, read by each backward product. Here it is written once and read
 * twice, and dlogits never exist in memory (docs/BENCHMARKS.md, log #131):
 *
 *   dx   k_classifier_grad<CG_DX>: dx = dlogits @ wte = dscale (softmax @ wte - wte[target]), with
 *        the softmax's normaliser found on the way, as a flash-attention forward finds its own: the
 *        logits are S, wte is V. Each block takes 192 rows and a share of the vocabulary (split so
 *        the blocks fill the GPU), keeps per row a running max m and a sum of exponentials l (base
 *        2) and accumulates o = sum of 2^(logit log2 e - m) wte[v] over its share; the products'
 *        A operand is that tile of exponentials, rounded to bf16 in registers. Its partials (o, m,
 *        l per row and share) go to scratch, and k_classifier_dx_combine joins the shares of a row
 *        in a fixed order: lse, the row's loss, and dx = dscale (o / l - wte[target]).
 *   dwte k_classifier_grad<CG_DWTE>: dwte = dlogits^T @ x (+ grad_beta dwte), each block 192 rows of
 *        the vocabulary over all n positions; its A operand, dlogits^T, is made in registers from
 *        the logits tile (read transposed by ldmatrix) with the lse the combine wrote:
 *        bf16(2^(logit log2 e - lse log2 e) dscale - [v == target] dscale) (one fma), 0 on padded
 *        rows, as the loss rows' dlogits.
 *
 * Both are one kernel: a producer thread loads by TMA, per k step of 64, the A tile (the logits:
 * 192 rows x 64 columns, or for dwte 64 positions x 192 vocabulary rows), NS = C / 64 slabs of B
 * (64 rows x 64 columns of wte or x, read N-major by the products: the transpose bit) and, for
 * dwte, the 64 positions' lse and targets (1-D tensor loads) into a ring of CG_STAGES stages; three
 * consumer warpgroups take 64 rows each of every stage (a block's last rows may pass n or Vp: the
 * TMA reads zeros there and nothing is written). Three rather than two, with the producer's
 * warpgroup giving its registers to them (setmaxnreg), because each warpgroup's step is a chain of
 * dependent operations that two warps a scheduler hid poorly (log #144). A consumer waits for stage
 * i, issues the products of step i - 1 (one wgmma m64n(C)k16 per 16 of k, A from registers) and
 * makes step i's operand while they run (FlashAttention-3's overlap; the other two warpgroups fill
 * the gaps), then waits for the products and hands stage i - 1 back. That overlap holds only while
 * no branch separates the products' issue from the operand's arithmetic and all of that arithmetic
 * comes before the wait: ptxas puts a wgmma wait at the top of a basic block and sinks arithmetic
 * to its first use (the SASS of 63c9004 had the exponentials wait for the products they should
 * overlap, log #138-#140). So the stage's mbarrier wait comes before the issue, the vocabulary mask
 * is in a share's last step only (its own copy of the step, where about half the exponentials still
 * follow the wait: once a share), and the operand is held (fa_wg_hold) before the wait. The shares
 * and the combine's order are fixed by the shape and the GPU's multiprocessor count: the results do
 * not depend on timing.
 *
 * Numerics against the loss rows' path: dx's A operand is the unnormalised exponentials rounded to
 * bf16 (values in [0, 1]) where that path rounds dlogits; the one-hot term is subtracted in fp32
 * after the product. Both are within tests/kernel_check.cu's classifier tolerance (tol.fused).
 * dwte zeroes a padded row by its scale (0 · exp), which holds while the exponential is finite:
 * only where a padded row's logit (its wte row is never trained) exceeded a position's lse by
 * more than ~88, far outside the logits a model produces, would 0 · inf make a NaN (the loss
 * rows' path selects 0 there unconditionally; a select here cost ~4 µs, log #142). */
#ifndef MICROGPT_CUDA_CLASSIFIER_GRAD_CUH
#define MICROGPT_CUDA_CLASSIFIER_GRAD_CUH

#include "attention.cuh" /* the warpgroup products' primitives (fa_wg_*) and online softmax */
#include "tma.cuh"

#include <type_traits>

#define CG_WG 3                       /* consumer warpgroups, 64 output rows each */
#define CG_ROWS (64 * CG_WG)          /* a block's output rows */
#define CG_ALIGN 128                  /* n and Vp are multiples of this (else the loss rows' path) */
#define CG_THREADS (128 * (CG_WG + 1)) /* the consumers, then the producer's warpgroup */
#define CG_BK 64                      /* a k step: one swizzled 128-byte row of bf16 */
#define CG_STAGES 4
#define CG_MAX_SLABS 3 /* d_model up to 192: 32 accumulators a slab and thread (four slabs leave
                        * ptxas too few registers to overlap dwte's products, C7512) */
#define CG_WG_A_BYTES (64 * CG_BK * 2) /* a consumer warpgroup's part of a stage's A tile */
#define CG_A_BYTES (CG_WG * CG_WG_A_BYTES)
#define CG_SLAB_BYTES (CG_BK * 64 * 2)

enum { CG_DX, CG_DWTE };

#define CG_ROW_VALUES_BYTES (2 * CG_BK * 4) /* dwte: a k step's lse and targets, 64 of each */

/* dwte's row values as the TMA sees them: the n positions' lse and targets in boxes of CG_BK. (As
 * tensor loads rather than plain bulk copies: compute-sanitizer's racecheck follows the mbarriers
 * that order tensor loads against the consumers' reads, not those of bulk copies, and reported
 * every reuse of a stage's row values as a hazard.) dx's launch passes them zeroed, unread. */
struct CgRowMaps {
    CUtensorMap lse, targets;
};
static CgRowMaps cg_row_maps(const float* lse, const int* targets, int n) {
    return CgRowMaps{tma_map_words(lse, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, n, CG_BK),
                     tma_map_words(targets, CU_TENSOR_MAP_DATA_TYPE_INT32, n, CG_BK)};
}

/* Registers a thread: the producer's warpgroup gives all but CG_PRODUCER_REGS of its share to the
 * consumers (setmaxnreg), which need ~160 for the accumulators (96 at C = 192), a tile's values and
 * its operand: 128 (65536 / CG_THREADS) would spill. 24 + 3 x 160 <= 4 x 128. */
#define CG_PRODUCER_REGS 24
#define CG_CONSUMER_REGS 160

template <int NS> struct Cg {
    static constexpr int STAGE_BYTES = CG_A_BYTES + NS * CG_SLAB_BYTES;
    static constexpr int SMEM = CG_STAGES * (STAGE_BYTES + CG_ROW_VALUES_BYTES) + 1024 + 2 * CG_STAGES * 8;
};

/* Two bf16 of one register as floats (the lower address in lo). */
__device__ __forceinline__ void cg_unpack(unsigned w, float& lo, float& hi) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xFFFF0000u);
}

/* dx's step: the warp's 16 rows of the stage's logits tile a (this warpgroup's 64 rows, 128-byte
 * rows, chunk c of row r at c ^ (r % 8)) in C-fragment order, columns at or past V (from the
 * tile's first column col0) at -infinity; then the online softmax (base 2) of the tile. */
template <bool MASK>
__device__ __forceinline__ void cg_dx_tile(float (*s)[4], float* m, float* l, float* alpha, unsigned a, int warp,
                                           int lane, int col0, int V) {
    int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            unsigned w;
            asm volatile("ld.shared.b32 %0, [%1];\n"
                         : "=r"(w)
                         : "r"(a + (16 * warp + g + 8 * hh) * 128 + ((j ^ g) << 4) + 4 * t));
            cg_unpack(w, s[j][2 * hh], s[j][2 * hh + 1]);
        }
    if (MASK && col0 + CG_BK > V)
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                if (col0 + 8 * j + 2 * t + (e & 1) >= V) s[j][e] = -INFINITY;
    fa_softmax_tile<64>(s, m, l, alpha, FA_LOG2E, NULL);
}

/* dwte's step: the warp's 16 vocabulary rows (v0w: its first) of dlogits^T over the tile's 64
 * positions, from the stage's logits tile a (64 positions x this warpgroup's 64 columns) and the
 * positions' lse and targets (rv: 64 floats, then 64 ints), as the A fragments of the 4 k steps in
 * the C-fragment order fa_wg_pack_p packs: register q of k step kk (ldmatrix's matrix q: rows
 * + 8 (q & 1), positions + 8 (q >> 1)) in s[2 kk + (q >> 1)][2 (q & 1) + e]. */
__device__ __forceinline__ void cg_dwte_tile(float (*s)[4], unsigned a, unsigned rv, float ds, int warp, int lane,
                                             int v0w, int V) {
    int g = lane >> 2, t = lane & 3, mi = lane >> 3, i8 = lane & 7;
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        unsigned r[4];
        int row = 16 * kk + 8 * (mi >> 1) + i8, chunk = 2 * warp + (mi & 1); /* this lane's row address */
        fa_ldsm_x4_trans(r, a + row * 128 + ((chunk ^ i8) << 4));
#pragma unroll
        for (int ph = 0; ph < 2; ph++) { /* positions 16 kk + 8 ph + 2 t, + 1 */
            unsigned at = 4 * (16 * kk + 8 * ph + 2 * t);
            float2 lse2;
            int2 tg;
            asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(lse2.x), "=f"(lse2.y) : "r"(rv + at));
            asm volatile("ld.shared.v2.s32 {%0, %1}, [%2];\n" : "=r"(tg.x), "=r"(tg.y) : "r"(rv + 4 * CG_BK + at));
            lse2.x *= FA_LOG2E, lse2.y *= FA_LOG2E;
#pragma unroll
            for (int vh = 0; vh < 2; vh++) { /* rows v, v + 8; a padded row's scale is 0 */
                int q = 2 * ph + vh, v = v0w + g + 8 * vh;
                float x[2], dsv = v < V ? ds : 0.0f;
                cg_unpack(r[q], x[0], x[1]);
                s[2 * kk + ph][2 * vh] = fmaf(fa_exp2(fmaf(x[0], FA_LOG2E, -lse2.x)), dsv, tg.x == v ? -dsv : 0.0f);
                s[2 * kk + ph][2 * vh + 1] = fmaf(fa_exp2(fmaf(x[1], FA_LOG2E, -lse2.y)), dsv, tg.y == v ? -dsv : 0.0f);
            }
        }
    }
}

/* o[64][64 NS] += A B over one 16-wide k step as one instruction (m64n64k16, m64n128k16 or
 * m64n192k16), A from registers, B N-major in shared memory: NS slabs of 64 columns, CG_SLAB_BYTES
 * apart (the descriptor's leading offset). One instruction rather than NS reads A's registers once
 * for all of B's columns. */
#define CG_R64 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define CG_R96 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define CG_WG_RS(N, R, A, ...)                                                                      \
    asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 {" R "}, " A ", 1, 1, 1, 1;\n" \
                 : __VA_ARGS__                                                                           \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b))
template <int NS> __device__ __forceinline__ void cg_wg_rs(float (*o)[4], const unsigned* a, unsigned long long b) {
    if constexpr (NS == 1) fa_wg_rs<bf16, 64>(o, a, b);
    if constexpr (NS == 2)
        CG_WG_RS(128, CG_R64, "{%64, %65, %66, %67}, %68", FA_WG_F32((o), "+f"), FA_WG_F32((o + 8), "+f"));
    if constexpr (NS == 3)
        CG_WG_RS(192, CG_R96, "{%96, %97, %98, %99}, %100", FA_WG_F32((o), "+f"), FA_WG_F32((o + 8), "+f"),
                 FA_WG_F32((o + 16), "+f"));
}

/* o[64][64 NS] += P B over one k step of 64: P as the A fragments of its 4 k steps, B the stage's
 * NS slabs (64 rows of k x 64 columns each, N-major); one group. */
template <int NS> __device__ __forceinline__ void cg_products(float (*o)[4], const unsigned (*p)[4], unsigned b) {
    const unsigned long long bd = fa_wg_desc<64>(b, NS == 1 ? FaWg<64>::GROUP_BYTES : CG_SLAB_BYTES);
#pragma unroll
    for (int kk = 0; kk < 4; kk++) cg_wg_rs<NS>(o, p[kk], fa_wg_desc_at(bd, 2 * kk * FaWg<64>::GROUP_BYTES));
    fa_wg_commit();
}

/* A block's shared memory: the ring of stages (A, then B's NS slabs), each stage's row values
 * (dwte), the stages' mbarriers; and its place in the work. */
template <int NS> struct CgBlock {
    unsigned ring, values, bars;
    int k0, n_k, row0; /* k steps [k0, k0 + n_k); the block's first output row */
    __device__ unsigned parity(int i) const { return (i / CG_STAGES) & 1; } /* of step i's phase of its stage */
    __device__ unsigned stage(int i) const { return ring + (i % CG_STAGES) * Cg<NS>::STAGE_BYTES; }
    __device__ unsigned row_values(int i) const { return values + (i % CG_STAGES) * CG_ROW_VALUES_BYTES; }
    __device__ unsigned full(int i) const { return bars + 8 * (i % CG_STAGES); }
    __device__ unsigned empty(int i) const { return bars + 8 * (CG_STAGES + i % CG_STAGES); }
};

/* The producer (one thread): step i's A tile, B's NS slabs and (dwte) the positions' lse and
 * targets into its stage, once the 4 CG_WG (12) consumer warps have handed the stage back (empty). */
template <int MODE, int NS>
__device__ __forceinline__ void cg_produce(const CgBlock<NS>& k, const CUtensorMap* a_map, const CUtensorMap* b_map,
                                           const CgRowMaps* rows) {
    for (int i = 0; i < k.n_k; i++) {
        int kt = k.k0 + i;
        unsigned a = k.stage(i), b = a + CG_A_BYTES;
        mbar_wait(k.empty(i), k.parity(i) ^ 1);
        mbar_arrive_expect_bytes(k.full(i), Cg<NS>::STAGE_BYTES + (MODE == CG_DWTE ? CG_ROW_VALUES_BYTES : 0));
        if constexpr (MODE == CG_DX) tma_load(a, a_map, CG_BK * kt, k.row0, k.full(i));
        else
            for (int h = 0; h < CG_WG; h++)
                tma_load(a + h * CG_WG_A_BYTES, a_map, k.row0 + 64 * h, CG_BK * kt, k.full(i));
        for (int q = 0; q < NS; q++) tma_load(b + q * CG_SLAB_BYTES, b_map, 64 * q, CG_BK * kt, k.full(i));
        if constexpr (MODE == CG_DWTE) {
            tma_load_1d(k.row_values(i), &rows->lse, CG_BK * kt, k.full(i));
            tma_load_1d(k.row_values(i) + CG_BK * 4, &rows->targets, CG_BK * kt, k.full(i));
        }
    }
}

/* A consumer warp hands a stage back to the producer: one arrival a warp (the barrier counts
 * 4 CG_WG), after a __syncwarp. An arrival releases only its own thread's earlier accesses (PTX
 * memory model), and every lane read the stage's A tile (and dwte's row values) with ordinary
 * loads: the __syncwarp orders those reads before lane 0's arrival, so the producer's next TMA
 * write into the stage, after its wait on that arrival, cannot pass them. */
__device__ __forceinline__ void cg_release(unsigned empty, int lane) {
    __syncwarp();
    if (lane == 0) mbar_arrive(empty);
}

/* A consumer warpgroup (c, its warp w): the products of its 64 rows over the block's k steps, then
 * its rows' results (dx: partials at share blockIdx.y; dwte: + grad_beta out). */
template <int MODE, int NS>
__device__ __forceinline__ void cg_consume(const CgBlock<NS>& k, float* __restrict__ out, float* __restrict__ part_m,
                                           float* __restrict__ part_l, const float* __restrict__ dscale, int n,
                                           int n_out, int V, float grad_beta, int c, int w, int lane) {
    constexpr int C = 64 * NS;
    int g = lane >> 2, t = lane & 3;
    float o[8 * NS][4] = {}, s[8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, alpha[2];
    unsigned p[4][4];
    float ds = MODE == CG_DWTE ? *dscale : 0.0f;
    /* step i's operand into s (dx: and alpha, the factor that rescales o to its running max) */
    auto operand = [&](int i, auto mask) {
        unsigned a = k.stage(i) + c * CG_WG_A_BYTES;
        if constexpr (MODE == CG_DX)
            cg_dx_tile<decltype(mask)::value>(s, m, l, alpha, a, w, lane, CG_BK * (k.k0 + i), V);
        else cg_dwte_tile(s, a, k.row_values(i), ds, w, lane, k.row0 + 64 * c + 16 * w, V);
    };
    /* step i - 1's products (i = 1 .. n_k) */
    auto issue = [&](int i) {
        fa_wg_fence(); /* o and p were written by ordinary instructions */
        cg_products<NS>(o, p, k.stage(i - 1) + CG_A_BYTES);
    };
    mbar_wait(k.full(0), k.parity(0));
    operand(0, std::true_type());
    fa_wg_pack_p<bf16>(p, s); /* o is 0: nothing to rescale */
    auto step = [&](int i, auto mask) {
        mbar_wait(k.full(i), k.parity(i)); /* before the products: no branch between them and operand(i) */
        issue(i);
        operand(i, mask); /* beside step i - 1's products */
        fa_wg_hold<8>(s); /* all of it: else ptxas sinks its last operations past the wait */
        fa_wg_block_end(s[0][0]);
        fa_wg_wait<0>();
        fa_wg_hold<8 * NS>(o);
        cg_release(k.empty(i - 1), lane); /* its tile was read, its products are done */
        if constexpr (MODE == CG_DX) /* where a row's max rose: rarely, once its first tiles are in */
            if (__any_sync(0xFFFFFFFFu, alpha[0] != 1.0f || alpha[1] != 1.0f))
                for (int h = 0; h < 2; h++) fa_rescale_rows<C>(o, alpha[h], h);
        fa_wg_pack_p<bf16>(p, s); /* only now: the products of step i - 1 read these registers */
    };
    for (int i = 1; i < k.n_k - 1; i++) step(i, std::false_type());
    if (k.n_k > 1) step(k.n_k - 1, std::true_type()); /* only a share's last tile can pass V */
    issue(k.n_k);
    fa_wg_wait<0>();
    fa_wg_hold<8 * NS>(o);
    cg_release(k.empty(k.n_k - 1), lane);

    for (int hh = 0; hh < 2; hh++) {
        int row = k.row0 + 64 * c + 16 * w + g + 8 * hh;
        float* dst;
        if constexpr (MODE == CG_DX) {
            float lsum = fa_quad_sum(l[hh]);
            if (row >= n) continue; /* past n in the last row block: whole warpgroups (n % CG_ALIGN == 0) */
            size_t at = (size_t)blockIdx.y * n + row;
            if (t == 0) part_m[at] = m[hh], part_l[at] = lsum;
            dst = out + at * C;
        } else {
            if (row >= n_out) continue; /* past Vp in dwte's last block */
            dst = out + (size_t)row * C;
        }
#pragma unroll
        for (int f = 0; f < 8 * NS; f++) {
            float2 r = make_float2(o[f][2 * hh], o[f][2 * hh + 1]);
            float2* d = (float2*)(dst + 8 * f + 2 * t);
            if (MODE == CG_DWTE && grad_beta != 0.0f) {
                float2 old = *d;
                r.x += grad_beta * old.x, r.y += grad_beta * old.y;
            }
            *d = r;
        }
    }
}

/* MODE CG_DX: block (row block, share) of the n rows: a_map the logits in boxes of 64 x 192 rows,
 * b_map wte in boxes of 64 x 64; writes its partials at share blockIdx.y of part_o [S][n][C],
 * part_m, part_l [S][n]. Its share: vocabulary tiles [y n_vt / S, (y + 1) n_vt / S) of n_vt =
 * ceil(V / 64).
 * MODE CG_DWTE: block v0 = 192 blockIdx.x of the Vp vocabulary rows: a_map the logits in boxes of
 * 64 x 64 rows, b_map x in boxes of 64 x 64, rows the positions' lse and targets; out = dwte
 * [Vp][C] (+ grad_beta out).
 * n_out: dwte's rows (Vp), past which a block writes nothing (dx's bound is n). */
template <int MODE, int NS>
__global__ void __launch_bounds__(CG_THREADS, 1)
    k_classifier_grad(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                      float* __restrict__ out, float* __restrict__ part_m, float* __restrict__ part_l,
                      const __grid_constant__ CgRowMaps rows,
                      const float* __restrict__ dscale, int n, int n_out, int V, int n_vt, float grad_beta) {
    await_previous_kernel();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(1024) unsigned char cg_smem[];
    unsigned smem_addr = (unsigned)__cvta_generic_to_shared(cg_smem), pad = (1024 - (smem_addr & 1023)) & 1023;
    CgBlock<NS> k;
    k.ring = smem_addr + pad;
    k.values = k.ring + CG_STAGES * Cg<NS>::STAGE_BYTES;
    k.bars = k.values + CG_STAGES * CG_ROW_VALUES_BYTES;
    k.row0 = blockIdx.x * CG_ROWS;
    if constexpr (MODE == CG_DX) {
        k.k0 = (int)((long long)blockIdx.y * n_vt / gridDim.y);
        k.n_k = (int)((long long)(blockIdx.y + 1) * n_vt / gridDim.y) - k.k0;
    } else {
        k.k0 = 0, k.n_k = n / CG_BK;
    }
    if (threadIdx.x == 0) {
        for (int s = 0; s < CG_STAGES; s++) {
            mbar_init(k.full(s), 1);  /* the producer's arrival; the TMA's bytes complete it */
            mbar_init(k.empty(s), 4 * CG_WG); /* lane 0 of each consumer warp */
        }
        mbar_init_fence();
    }
    __syncthreads();
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (warp >= 4 * CG_WG) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(CG_PRODUCER_REGS) : "memory");
        if (warp == 4 * CG_WG && lane == 0) cg_produce<MODE, NS>(k, &a_map, &b_map, &rows);
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CG_CONSUMER_REGS) : "memory");
        cg_consume<MODE, NS>(k, out, part_m, part_l, dscale, n, n_out, V, grad_beta, warp >> 2, warp & 3, lane);
    }
#else
    __trap();
#endif
}

/* One block of C threads a row: the row's shares joined in share order (a max, then sums rescaled
 * to it), its lse (natural), its loss lse - logit[target] and dx = dscale (o / l - wte[target]). */
__global__ void k_classifier_dx_combine(float* __restrict__ losses, float* __restrict__ lse, bf16* __restrict__ dx,
                                        const float* __restrict__ part_o, const float* __restrict__ part_m,
                                        const float* __restrict__ part_l, const bf16* __restrict__ logits,
                                        const bf16* __restrict__ wte, const int* __restrict__ targets,
                                        const float* __restrict__ dscale, int n, int Vp, int shares) {
    await_previous_kernel();
    int row = blockIdx.x, col = threadIdx.x, C = blockDim.x, target = targets[row];
    float mx = -INFINITY, sum = 0.0f, u = 0.0f;
    for (int s = 0; s < shares; s++) mx = fmaxf(mx, part_m[(size_t)s * n + row]);
    for (int s = 0; s < shares; s++) {
        size_t at = (size_t)s * n + row;
        float scale = fa_exp2(part_m[at] - mx);
        sum += part_l[at] * scale;
        u += part_o[at * C + col] * scale;
    }
    dx[(size_t)row * C + col] = from_f<bf16>((u / sum - to_f(wte[(size_t)target * C + col])) * *dscale);
    if (col == 0) {
        float row_lse = (mx + log2f(sum)) * FA_LN2;
        lse[row] = row_lse;
        losses[row] = row_lse - to_f(logits[(size_t)row * Vp + target]);
    }
}

/* Whether the fused backward takes a classifier of d_model C and Vp padded rows in T (before the
 * rows' count, classifier_grad_fused's last test): bf16, fused products on (g_gemm_fuse), a GPU
 * running this image's sm_90a code (the attention forward's test, the same image). */
template <typename T> static bool classifier_grad_fused_ok(int C, int Vp) {
    return std::is_same<T, bf16>::value && g_gemm_fuse && C > 0 && C % 64 == 0 && C / 64 <= CG_MAX_SLABS &&
           Vp % CG_ALIGN == 0 && fa_fwd_wgmma_ok<bf16, 64>();
}

/* dx's shares of the vocabulary for n rows: as many as fill the multiprocessors with the
 * ceil(n / CG_ROWS) row blocks, at most one a vocabulary tile. */
static int classifier_grad_shares(int n, int V) {
    int blocks = (n + CG_ROWS - 1) / CG_ROWS, n_vt = (V + CG_BK - 1) / CG_BK, shares = lt_sm_count() / blocks;
    return shares < 1 ? 1 : shares > n_vt ? n_vt : shares;
}

/* Scratch floats the fused backward needs for chunks of up to n_max rows of d_model C: dx's
 * partials, shares x rows x (C + 2) (shares x rows is at most max(multiprocessors x CG_ROWS, rows)). */
static size_t classifier_grad_scratch_floats(int n_max, int C) {
    size_t rows = (size_t)lt_sm_count() * CG_ROWS;
    return (rows > (size_t)n_max ? rows : (size_t)n_max) * (C + 2);
}

/* Launches of the fused backward, counted for tests/kernel_check.cu (which must see it taken on
 * Hopper at the shapes it applies to). */
static long g_classifier_grad_runs = 0;

template <int NS> static void classifier_grad_set_smem(void) {
    static bool done = false;
    if (done) return;
    CUDA_CHECK(cudaFuncSetAttribute(k_classifier_grad<CG_DX, NS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    Cg<NS>::SMEM));
    CUDA_CHECK(cudaFuncSetAttribute(k_classifier_grad<CG_DWTE, NS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    Cg<NS>::SMEM));
    done = true;
}

/* dx's half: its shares, then the combine (losses, lse, dx). */
template <int NS>
static void classifier_dx_launch(float* losses, float* lse, bf16* dx, const bf16* logits, const bf16* wte,
                                 const int* targets, int n, int V, int Vp, const float* dscale, float* scratch) {
    constexpr int C = 64 * NS;
    classifier_grad_set_smem<NS>();
    int shares = classifier_grad_shares(n, V), n_vt = (V + CG_BK - 1) / CG_BK;
    float *part_o = scratch, *part_m = part_o + (size_t)shares * n * C, *part_l = part_m + (size_t)shares * n;
    launch_kernel_with_shared(k_classifier_grad<CG_DX, NS>, dim3((n + CG_ROWS - 1) / CG_ROWS, shares), CG_THREADS,
                              Cg<NS>::SMEM, tma_map_bf16(logits, n, Vp, CG_ROWS), tma_map_bf16(wte, Vp, C, CG_BK),
                              part_o, part_m, part_l, CgRowMaps{}, (const float*)NULL, n, n, V, n_vt, 0.0f);
    launch_kernel(k_classifier_dx_combine, n, C, losses, lse, dx, (const float*)part_o, (const float*)part_m,
                  (const float*)part_l, logits, wte, targets, dscale, n, Vp, shares);
}

/* dwte's half (it reads the lse that dx's half wrote). */
template <int NS>
static void classifier_dwte_launch(float* dwte, const float* lse, const bf16* logits, const bf16* x, const int* targets,
                                   int n, int V, int Vp, const float* dscale, float grad_beta) {
    constexpr int C = 64 * NS;
    classifier_grad_set_smem<NS>();
    launch_kernel_with_shared(k_classifier_grad<CG_DWTE, NS>, dim3((Vp + CG_ROWS - 1) / CG_ROWS), CG_THREADS,
                              Cg<NS>::SMEM,
                              tma_map_bf16(logits, n, Vp, CG_BK), tma_map_bf16(x, n, C, CG_BK), dwte, (float*)NULL,
                              (float*)NULL, cg_row_maps(lse, targets, n), dscale, n, Vp, V, (V + CG_BK - 1) / CG_BK,
                              grad_beta);
}

template <int NS>
static void classifier_grad_launch(float* losses, float* lse, bf16* dx, float* dwte, const bf16* logits,
                                   const bf16* x, const bf16* wte, const int* targets, int n, int V, int Vp,
                                   const float* dscale, float grad_beta, float* scratch) {
    classifier_dx_launch<NS>(losses, lse, dx, logits, wte, targets, n, V, Vp, dscale, scratch);
    /* dwte on the side stream, beside the layers' backward */
    side_product(logits,
                 [&] { classifier_dwte_launch<NS>(dwte, lse, logits, x, targets, n, V, Vp, dscale, grad_beta); });
}

/* The fused classifier backward from the logits of n rows (loss.cuh's loss_bwd_from_logits, whose
 * outputs it writes: losses, lse, dx, dwte); false, having launched nothing, where it does not apply
 * (classifier_grad_fused_ok, n a multiple of CG_ALIGN, the operands the TMA reads 16-byte aligned,
 * scratch). scratch: classifier_grad_scratch_floats. */
template <typename T>
static bool classifier_grad_fused(float* losses, float* lse, T* dx, float* dwte, const T* logits, const T* x,
                                  const T* wte, const int* targets, int n, int C, int V, int Vp, const float* dscale,
                                  float grad_beta, float* scratch) {
    if constexpr (!std::is_same<T, bf16>::value) return false;
    else {
        uintptr_t bases = (uintptr_t)lse | (uintptr_t)targets | (uintptr_t)logits | (uintptr_t)x | (uintptr_t)wte;
        if (!scratch || n <= 0 || n % CG_ALIGN || bases % 16 || !classifier_grad_fused_ok<T>(C, Vp)) return false;
        g_classifier_grad_runs++;
        auto launch = C == 64    ? classifier_grad_launch<1>
                      : C == 128 ? classifier_grad_launch<2>
                                 : classifier_grad_launch<3>;
        launch(losses, lse, dx, dwte, logits, x, wte, targets, n, V, Vp, dscale, grad_beta, scratch);
        return true;
    }
}

#endif
