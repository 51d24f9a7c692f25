/* embed.cuh: token + position embedding, out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:].
 * Reads the fp32 master embeddings (sums in fp32, rounds once to T).
 *
 * Backward without floating-point atomics: several positions can hold the same token, so dwte
 * rows are not independent outputs. A stable radix sort of (token, position) pairs (CUB's,
 * deterministic: in one block where the batch's positions fit it, else device-wide) gives each
 * token's positions in one ascending run; the run's start (the token's first position) owns the
 * token's dwte row: every row written by one owner, and no host work (so a step needs no host
 * round trip and can be captured in a CUDA graph). Per column the row gets one sum per segment of
 * EMBED_LIST positions counted from the token's first position, segment by segment; within a
 * segment warp w sums the listed rows w, w + 8, ... and the eight warp sums are added in warp
 * order: a fixed summation order that does not make a frequent token (hundreds of positions in
 * real text: a space is a quarter of the benchmark's text) one long chain of dependent loads.
 * A short run (at most 8 positions: most tokens) is added by its start's warp alone, a pass per
 * segment with every row's loads in flight; a longer one by whole blocks, split by
 * columns so that the blocks of one frequent token run side by side, each warp loading
 * EMBED_ROWS_AHEAD rows before it adds them. The same additions in the same order either way
 * (docs/BENCHMARKS.md #93, #98, #100, #101, #147 measured each step of this against the one
 * before, with the same bits). dwpe[t] has one term per sequence, summed in b order.
 *
 * Kernels: k_embed_fwd; the backward is the sort (k_embed_sort_block, or k_embed_positions and
 * CUB's device-wide sort: embed_bwd_sort), then k_embed_bwd_wte_runs and k_embed_bwd_wpe
 * (embed_bwd_sorted). The engine calls embed_fwd, and embed_bwd_sort at the start of a micro-batch
 * (it needs only the tokens) and embed_bwd_sorted at the end of the backward, with
 * embed_bwd_scratch_bytes of scratch; embed_bwd is the two in turn.
 */
#ifndef MICROGPT_CUDA_EMBED_CUH
#define MICROGPT_CUDA_EMBED_CUH

#include "common.cuh"

#include <cub/block/block_radix_sort.cuh>
#include <cub/device/device_radix_sort.cuh>

#define EMBED_BWD_THREADS 256
#define EMBED_LIST 2048 /* positions per segment of a token's run in the backward's summation order */
#define EMBED_WARPS (EMBED_BWD_THREADS / 32)
#define EMBED_LANE_COLS 8 /* columns per lane in the backward's sum: 256-column slabs */
#define EMBED_SLAB (32 * EMBED_LANE_COLS)

/* VEC elements a thread (common.cuh's packets: PACK(T) where rows and pointers allow, the sum of
 * each pair of fp32 packets rounded to one packet of T; else 1), a packet never crossing a row. */
template <typename T, int VEC>
__global__ void k_embed_fwd(T* out, const int* tokens, const float* wte, const float* wpe, int N, int T_, int C) {
    await_previous_kernel();
    FOR_PACKETS(i, (size_t)N * C) {
        int n = (int)(i / C), c = (int)(i % C);
        float te[VEC], pe[VEC];
        load_vec<VEC>(te, wte + (size_t)tokens[n] * C + c);
        load_vec<VEC>(pe, wpe + (size_t)(n % T_) * C + c);
#pragma unroll
        for (int k = 0; k < VEC; k++) te[k] += pe[k];
        store_vec<VEC>(out + i, te);
    }
}

/* The listed rows a warp loads before it adds the first of them (docs/BENCHMARKS.md #98): dout is
 * in the L2, so a warp's sum is a chain of L2 round trips, one a row (the list's entry, then the
 * row) unless the next rows are on their way. */
#define EMBED_ROWS_AHEAD 8

/* row[c] += sum of the n listed rows of dout [., C] at column c, for every column c_begin <= c <
 * c_end (whole block, n the same in every thread). Per 256-column slab from c_begin, lane l of
 * warp w adds columns l, l + 32, ... of rows list[w], list[w + 8], ... (each row read as eight
 * coalesced runs, EMBED_ROWS_AHEAD rows loaded before the first is added), then thread c adds the
 * eight warp sums of column c in warp order. */
template <typename T>
__device__ void embed_add_listed_rows(float* row, const T* dout, const int* list, int n, int C, int c_begin,
                                      int c_end) {
    __shared__ float warp_sums[EMBED_WARPS][EMBED_SLAB];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int c0 = c_begin; c0 < c_end; c0 += EMBED_SLAB) {
        float acc[EMBED_LANE_COLS] = {};
        for (int q0 = warp; q0 < n; q0 += EMBED_WARPS * EMBED_ROWS_AHEAD) {
            float v[EMBED_ROWS_AHEAD][EMBED_LANE_COLS];
#pragma unroll
            for (int r = 0; r < EMBED_ROWS_AHEAD; r++) {
                int q = q0 + r * EMBED_WARPS;
                const T* src = dout + (size_t)list[q < n ? q : q0] * C + c0 + lane;
#pragma unroll
                for (int k = 0; k < EMBED_LANE_COLS; k++)
                    v[r][k] = q < n && c0 + lane + 32 * k < c_end ? to_f(src[32 * k]) : 0.0f;
            }
#pragma unroll
            for (int r = 0; r < EMBED_ROWS_AHEAD; r++) /* rows q0, q0 + 8, ...: the order of one at a time */
#pragma unroll
                for (int k = 0; k < EMBED_LANE_COLS; k++)
                    if (q0 + r * EMBED_WARPS < n && c0 + lane + 32 * k < c_end) acc[k] += v[r][k];
        }
#pragma unroll
        for (int k = 0; k < EMBED_LANE_COLS; k++) warp_sums[warp][lane + 32 * k] = acc[k];
        __syncthreads();
        for (int c = threadIdx.x; c < EMBED_SLAB && c0 + c < c_end; c += EMBED_BWD_THREADS) {
            float s = 0.0f;
            for (int w = 0; w < EMBED_WARPS; w++) s += warp_sums[w][c];
            row[c0 + c] += s;
        }
        __syncthreads(); /* the sums are read before the next slab overwrites them */
    }
}

/* pos[i] = i: the values the sort carries with the tokens. */
__global__ void k_embed_positions(int* pos, int N) {
    await_previous_kernel();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < N; i += gridDim.x * blockDim.x) pos[i] = i;
}

/* A segment's list in the sorted pairs: how many entries from q0 on hold token tok at a position
 * below bound (a prefix: tokens ascend, and each token's positions), counted EMBED_BWD_THREADS
 * entries at a time; *more: whether the entry after them holds tok too. Whole block, the same
 * results in every thread. */
__device__ int embed_count_segment(const int* sorted_tok, const int* sorted_pos, int q0, int N, int tok, int bound,
                                   bool* more) {
    int count = 0;
    for (;;) {
        int q = q0 + count + threadIdx.x;
        bool same = false, listed = false;
        if (q < N) { /* both loads in flight at once */
            int t = sorted_tok[q], position = sorted_pos[q];
            same = t == tok;
            listed = same && position < bound;
        }
        int n = __syncthreads_count(listed);
        count += n;
        if (n < EMBED_BWD_THREADS) { /* the entry after the prefix is in this tile (or past N) */
            *more = __syncthreads_or(same && !listed);
            return count;
        }
    }
}

/* The work of a block at a run's start for one column group: sorted entry s, its token tok and
 * first position i, columns c_begin .. c_end - 1 (whole block). */
template <typename T>
__device__ void embed_add_run(float* dwte, const T* dout, const int* sorted_tok, const int* sorted_pos, int N, int C,
                              int s, int tok, int i, int c_begin, int c_end) {
    float* row = dwte + (size_t)tok * C;
    bool more = true;
    for (int q = s, seg = i; more;) {
        int n = embed_count_segment(sorted_tok, sorted_pos, q, N, tok, seg + EMBED_LIST, &more); /* >= 1 */
        embed_add_listed_rows(row, dout, sorted_pos + q, n, C, c_begin, c_end); /* ends with a barrier */
        q += n;
        if (more) seg = i + (sorted_pos[q] - i) / EMBED_LIST * EMBED_LIST; /* the segment holding entry q */
    }
}

/* The token rows' sums (docs/BENCHMARKS.md #100, #147): one warp per sorted entry, 8 a block;
 * sorted_tok ascending, sorted_pos ascending within each token's run. A run of at most EMBED_WARPS
 * positions (every token on uniform data, most on text) is added by its start's warp alone, segment
 * by segment: per column the additions a block makes of a longer run, in the same order (in each
 * segment, warp w's sum is 0 + the segment's row w, or 0 past its rows; the row gets 0 + the eight
 * in warp order), in one pass over the row per EMBED_SLAB columns (every row's loads in flight
 * together) with no barrier. Longer runs (a frequent token's hundreds of rows on text) are split by
 * columns: block (x, y) adds columns y EMBED_RUN_GROUP .. (y + 1) EMBED_RUN_GROUP - 1 of the longer
 * runs starting at its entries, as embed_add_run does them (a column's additions never depend on
 * another's), so the C / EMBED_RUN_GROUP blocks of one such token run side by side. */
#define EMBED_RUN_GROUP 128 /* columns a block of a longer run adds */

/* row[c] += the sum of one segment's m rows (m <= EMBED_WARPS) of dout at every column c, added as a
 * block's warps add them (embed_add_listed_rows): lane l takes columns l, l + 32, ..., EMBED_LANE_COLS
 * a pass. The rows' positions are p in lanes first .. first + m - 1. Whole warp (first and m the
 * same in every lane). */
template <typename T>
__device__ void embed_add_short_segment(float* row, const T* dout, int p, int first, int m, int C) {
    int lane = threadIdx.x & 31;
    for (int c0 = 0; c0 < C; c0 += EMBED_SLAB) {
        float sum[EMBED_LANE_COLS];
#pragma unroll
        for (int k = 0; k < EMBED_LANE_COLS; k++) sum[k] = 0.0f;
#pragma unroll
        for (int w = 0; w < EMBED_WARPS; w++) { /* a block's warp w: the segment's row w, or none */
            const T* src = dout + (size_t)__shfl_sync(0xffffffffu, p, first + (w < m ? w : 0)) * C + c0 + lane;
#pragma unroll
            for (int k = 0; k < EMBED_LANE_COLS; k++) {
                float acc = 0.0f;
                if (w < m && c0 + lane + 32 * k < C) acc += to_f(src[32 * k]);
                sum[k] += acc;
            }
        }
#pragma unroll
        for (int k = 0; k < EMBED_LANE_COLS; k++)
            if (c0 + lane + 32 * k < C) row[c0 + lane + 32 * k] += sum[k];
    }
}

template <typename T>
__global__ void __launch_bounds__(EMBED_BWD_THREADS)
k_embed_bwd_wte_runs(float* __restrict__ dwte, const T* __restrict__ dout, const int* __restrict__ sorted_tok,
                     const int* __restrict__ sorted_pos, int N, int C) {
    await_previous_kernel();
    __shared__ int long_tok[EMBED_WARPS], long_pos[EMBED_WARPS]; /* a longer run's token and first position, or -1 */
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, s = blockIdx.x * EMBED_WARPS + warp;
    /* lane l holds entry s - 1 + l (l <= EMBED_WARPS + 1: the one before s, s, and EMBED_WARPS after) */
    int q = s - 1 + lane, t = -1, p = 0;
    if (q >= 0 && q < N && lane <= EMBED_WARPS + 1) t = sorted_tok[q], p = sorted_pos[q];
    int tok = __shfl_sync(0xffffffffu, t, 1), i = __shfl_sync(0xffffffffu, p, 1);
    bool start = s < N && __shfl_sync(0xffffffffu, t, 0) != tok;
    unsigned same = __ballot_sync(0xffffffffu, lane >= 1 && t == tok); /* t = -1 matches no token */
    int n = __ffs(~(same >> 1)) - 1;                                    /* the run's entries from s, up to 9 */
    bool short_run = start && n <= EMBED_WARPS;
    if (lane == 0) long_tok[warp] = start && !short_run ? tok : -1, long_pos[warp] = i;
    if (short_run && blockIdx.y == 0) {
        float* row = dwte + (size_t)tok * C;
        /* segment by segment (EMBED_LIST positions from i), as embed_add_run lists them: the run's
         * entries are lanes 1 .. n, their segments ascending */
        int seg = (p - i) / EMBED_LIST;
        for (int j = 1; j <= n;) {
            int m = 1, first_seg = __shfl_sync(0xffffffffu, seg, j);
            while (j + m <= n && __shfl_sync(0xffffffffu, seg, j + m) == first_seg) m++;
            embed_add_short_segment(row, dout, p, j, m, C);
            j += m;
        }
    }
    __syncthreads();
    int c_begin = blockIdx.y * EMBED_RUN_GROUP, c_end = min(C, c_begin + EMBED_RUN_GROUP);
    for (int w = 0; w < EMBED_WARPS; w++) /* block-uniform */
        if (long_tok[w] >= 0)
            embed_add_run(dwte, dout, sorted_tok, sorted_pos, N, C, blockIdx.x * EMBED_WARPS + w, long_tok[w],
                          long_pos[w], c_begin, c_end);
}

/* The sort in one block (docs/BENCHMARKS.md #101): where the N tokens fit one block's registers
 * (EMBED_SORT_THREADS x EMBED_SORT_ITEMS), CUB's block radix sort of the (token, position) pairs in
 * one launch, positions made in the kernel (no k_embed_positions), in place of the device-wide
 * sort's several launches. Both sorts are stable and the positions are distinct, so both give the
 * one stable order: the same sorted arrays, the same dwte. */
#define EMBED_SORT_THREADS 1024
#define EMBED_SORT_ITEMS 8

/* sorted_tok, sorted_pos [N] = the stable sort of (tokens[i], i) by token, tokens below 2^bits;
 * one block, N <= EMBED_SORT_THREADS * EMBED_SORT_ITEMS. Entries past N sort last (key 2^bits). */
__global__ void __launch_bounds__(EMBED_SORT_THREADS)
k_embed_sort_block(int* __restrict__ sorted_tok, int* __restrict__ sorted_pos, const int* __restrict__ tokens, int N,
                   int bits) {
    await_previous_kernel();
    using Sort = cub::BlockRadixSort<unsigned, EMBED_SORT_THREADS, EMBED_SORT_ITEMS, int>;
    __shared__ typename Sort::TempStorage temp;
    unsigned key[EMBED_SORT_ITEMS];
    int pos[EMBED_SORT_ITEMS];
    for (int k = 0; k < EMBED_SORT_ITEMS; k++) { /* blocked: thread t holds entries t * ITEMS .. + ITEMS - 1 */
        int i = threadIdx.x * EMBED_SORT_ITEMS + k;
        key[k] = i < N ? (unsigned)tokens[i] : 1u << bits;
        pos[k] = i;
    }
    Sort(temp).Sort(key, pos, 0, bits + 1);
    for (int k = 0; k < EMBED_SORT_ITEMS; k++) {
        int i = threadIdx.x * EMBED_SORT_ITEMS + k;
        if (i < N) sorted_tok[i] = (int)key[k], sorted_pos[i] = pos[k];
    }
}

/* Token keys' significant bits: tokens are below V. */
static int embed_token_bits(int V) {
    int bits = 1;
    while (bits < 31 && (1 << bits) < V) bits++;
    return bits;
}

/* The sort's layout in the scratch: positions, sorted tokens, sorted positions (N ints each, every
 * array 256-byte aligned), then CUB's temporary storage (cub_bytes). */
static size_t embed_ints_bytes(int N) { return ((size_t)N * sizeof(int) + 255) & ~(size_t)255; }

static size_t embed_sort_bytes(int V, int N) {
    size_t cub_bytes = 0;
    CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, cub_bytes, (const unsigned*)nullptr, (unsigned*)nullptr,
                                               (const int*)nullptr, (int*)nullptr, N, 0, embed_token_bits(V)));
    return cub_bytes;
}

/* The backward's scratch in bytes: the sort's arrays and storage. */
static size_t embed_bwd_scratch_bytes(int V, int N) { return 3 * embed_ints_bytes(N) + embed_sort_bytes(V, N); }

/* One thread per (t, c); writes (add 0) or adds (add 1) the sum. */
template <typename T>
__global__ void k_embed_bwd_wpe(float* dwpe, const T* dout, int B, int T_, int C, int add) {
    await_previous_kernel();
    size_t n_total = (size_t)T_ * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n_total; i += (size_t)gridDim.x * blockDim.x) {
        float s = 0.0f;
        for (int b = 0; b < B; b++) s += to_f(dout[(size_t)b * T_ * C + i]);
        dwpe[i] = add ? dwpe[i] + s : s;
    }
}

/* out [B*T, C] (T) from device tokens [B*T] and the fp32 master wte/wpe. */
template <typename T>
static void embed_fwd(T* out, const int* tokens, const float* wte, const float* wpe, int B, int T_, int C) {
    size_t n = (size_t)B * T_ * C;
    /* whole packets of T per row, and the fp32 rows in whole 16-byte packets too (PACK(T) >= 4) */
    bool packed = packable(C, sizeof(T), {out}) && packable(C, sizeof(float), {wte, wpe});
    LAUNCH_PACKED_ELEMENTWISE(packed, k_embed_fwd, T, n, out, tokens, wte, wpe, B * T_, T_, C);
}

/* sorted_tok, sorted_pos [N]: the (token, position) pairs sorted by token, stably (CUB's device-wide
 * radix sort of positions k_embed_positions writes at pos, its storage at cub_at). */
static void embed_sort_device(int* sorted_tok, int* sorted_pos, int* pos, void* cub_at, const int* tokens, int V,
                              int N) {
    size_t cub_bytes = embed_sort_bytes(V, N);
    launch_kernel(k_embed_positions, ceil_div(N, 256), 256, pos, N);
    /* stable: each token's positions stay ascending; tokens compared as unsigned (all >= 0) */
    CUDA_CHECK(cub::DeviceRadixSort::SortPairs(cub_at, cub_bytes, (const unsigned*)tokens, (unsigned*)sorted_tok, pos,
                                               sorted_pos, N, 0, embed_token_bits(V), g_stream));
    if (sync_launches()) CUDA_CHECK(cudaDeviceSynchronize()); /* as launch_kernel does for its own */
}

/* The backward's first half, which reads only the tokens (so the engine runs it beside the forward,
 * docs/DESIGN.md §9): the (token, position) pairs sorted by token into the scratch, which holds
 * embed_bwd_scratch_bytes(V, N) bytes (256-byte aligned). Every call is a stream operation (CUB's
 * sort included), so a CUDA graph can capture it. */
static void embed_bwd_sort(void* scratch, const int* tokens, int V, int N) {
    char* at = (char*)scratch;
    int* sorted_tok = (int*)(at + embed_ints_bytes(N));
    int* sorted_pos = (int*)(at + 2 * embed_ints_bytes(N));
    if (N <= EMBED_SORT_THREADS * EMBED_SORT_ITEMS)
        launch_kernel(k_embed_sort_block, 1, EMBED_SORT_THREADS, sorted_tok, sorted_pos, tokens, N, embed_token_bits(V));
    else
        embed_sort_device(sorted_tok, sorted_pos, (int*)at, at + 3 * embed_ints_bytes(N), tokens, V, N);
}

/* The second half, after embed_bwd_sort of the same tokens into the same scratch: dwte += (always:
 * the classifier's product writes it first, loss.cuh) the token rows' sums by k_embed_bwd_wte_runs,
 * and dwpe = / += by grad_beta, from dout [B*T, C]. */
template <typename T>
static void embed_bwd_sorted(float* dwte, float* dwpe, const T* dout, const void* scratch, int B, int T_, int C,
                             float grad_beta) {
    int N = B * T_;
    const char* at = (const char*)scratch;
    const int* sorted_tok = (const int*)(at + embed_ints_bytes(N));
    const int* sorted_pos = (const int*)(at + 2 * embed_ints_bytes(N));
    launch_kernel(k_embed_bwd_wte_runs<T>, dim3(ceil_div(N, EMBED_WARPS), ceil_div(C, EMBED_RUN_GROUP)),
                  EMBED_BWD_THREADS, dwte, dout, sorted_tok, sorted_pos, N, C);
    size_t n = (size_t)T_ * C;
    launch_kernel(k_embed_bwd_wpe<T>, elementwise_grid(n, 256), 256, dwpe, dout, B, T_, C, grad_beta != 0.0f);
}

/* Both halves in turn; tokens [B*T] are the batch's input tokens (device), all below V. */
template <typename T>
static void embed_bwd(float* dwte, float* dwpe, const T* dout, const int* tokens, void* scratch, int V, int B, int T_,
                      int C, float grad_beta) {
    embed_bwd_sort(scratch, tokens, V, B * T_);
    embed_bwd_sorted<T>(dwte, dwpe, dout, scratch, B, T_, C, grad_beta);
}

#endif
