/* embed.cuh: token + position embedding, out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:].
 * Reads the fp32 master embeddings (sums in fp32, rounds once to T).
 *
 * Backward without floating-point atomics: several positions can hold the same token, so dwte
 * rows are not independent outputs. A stable radix sort of (token, position) pairs (CUB's,
 * deterministic) gives each token's positions in one ascending run; one block per run, the one at
 * its start (the token's first position), adds the gradient rows of all its positions: every dwte
 * row written by exactly one block, and no host work (so a step needs no host round trip and can
 * be captured in a CUDA graph). It cuts the run into segments of EMBED_LIST positions counted from
 * the token's first position and adds one sum per segment to the row, segment by segment. Within
 * a segment warp w sums the listed rows w, w + 8, ... and the eight warp sums are added in warp
 * order: a fixed summation order that does not make a frequent token (hundreds of positions in
 * real text) one long chain of dependent loads. (Before the sort, each token's first position
 * listed its segments by scanning every later position, O(positions x distinct tokens), with the
 * same segments and the same additions: the sort gave the same bits, faster, docs/BENCHMARKS.md
 * #93.) dwpe[t] has one term per sequence, summed in b order.
 *
 * Kernels: k_embed_fwd; the backward (k_embed_bwd) is k_embed_positions, the sort,
 * k_embed_bwd_wte_sorted and k_embed_bwd_wpe. The engine calls embed_fwd / embed_bwd, with
 * embed_bwd_scratch_bytes of scratch.
 */
#ifndef MICROGPT_CUDA_EMBED_CUH
#define MICROGPT_CUDA_EMBED_CUH

#include "common.cuh"

#include <cub/device/device_radix_sort.cuh>

#define EMBED_BWD_THREADS 256
#define EMBED_LIST 2048 /* positions per segment of the backward's match list (a multiple of the block) */
#define EMBED_WARPS (EMBED_BWD_THREADS / 32)
#define EMBED_LANE_COLS 8 /* columns per lane in the backward's sum: 256-column slabs */
#define EMBED_SLAB (32 * EMBED_LANE_COLS)

template <typename T>
__global__ void k_embed_fwd(T* out, const int* tokens, const float* wte, const float* wpe, int N, int T_, int C) {
    await_previous_kernel();
    size_t n_total = (size_t)N * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n_total; i += (size_t)gridDim.x * blockDim.x) {
        int n = (int)(i / C), c = (int)(i % C);
        out[i] = from_f<T>(wte[(size_t)tokens[n] * C + c] + wpe[(size_t)(n % T_) * C + c]);
    }
}

/* EMBED_ROWS_IN_FLIGHT (docs/BENCHMARKS.md #98): the listed rows a warp loads before it adds the
 * first of them. dout is in the L2, so a warp's sum is a chain of L2 round trips, one a row; in real
 * text a frequent token (a space: a quarter of the positions of the benchmark's text) has hundreds
 * of rows a warp, and its one block is the kernel's tail. Loading the next rows ahead keeps the
 * additions and their order, so the bits. 1: a row at a time. */
#ifndef EMBED_ROWS_IN_FLIGHT
#define EMBED_ROWS_IN_FLIGHT 1
#endif

/* row[c] += sum of the n listed rows of dout at column c, for every column (whole block, n the
 * same in every thread). Per 256-column slab, lane l of warp w adds columns l, l + 32, ... of
 * rows list[w], list[w + 8], ... (each row read as eight coalesced runs), then thread c adds the
 * eight warp sums of column c in warp order. */
template <typename T>
__device__ void embed_add_listed_rows(float* row, const T* dout, const int* list, int n, int C) {
    __shared__ float warp_sums[EMBED_WARPS][EMBED_SLAB];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int c0 = 0; c0 < C; c0 += EMBED_SLAB) {
        float acc[EMBED_LANE_COLS] = {};
#if EMBED_ROWS_IN_FLIGHT > 1
        for (int q0 = warp; q0 < n; q0 += EMBED_WARPS * EMBED_ROWS_IN_FLIGHT) {
            float v[EMBED_ROWS_IN_FLIGHT][EMBED_LANE_COLS];
#pragma unroll
            for (int r = 0; r < EMBED_ROWS_IN_FLIGHT; r++) {
                int q = q0 + r * EMBED_WARPS;
                const T* src = dout + (size_t)list[q < n ? q : q0] * C + c0 + lane;
#pragma unroll
                for (int k = 0; k < EMBED_LANE_COLS; k++)
                    v[r][k] = q < n && c0 + lane + 32 * k < C ? to_f(src[32 * k]) : 0.0f;
            }
#pragma unroll
            for (int r = 0; r < EMBED_ROWS_IN_FLIGHT; r++) /* rows q0, q0 + 8, ...: the order of one at a time */
#pragma unroll
                for (int k = 0; k < EMBED_LANE_COLS; k++)
                    if (q0 + r * EMBED_WARPS < n && c0 + lane + 32 * k < C) acc[k] += v[r][k];
        }
#else
        for (int q = warp; q < n; q += EMBED_WARPS) {
            const T* src = dout + (size_t)list[q] * C + c0 + lane;
#pragma unroll
            for (int k = 0; k < EMBED_LANE_COLS; k++)
                if (c0 + lane + 32 * k < C) acc[k] += to_f(src[32 * k]);
        }
#endif
#pragma unroll
        for (int k = 0; k < EMBED_LANE_COLS; k++) warp_sums[warp][lane + 32 * k] = acc[k];
        __syncthreads();
        for (int c = threadIdx.x; c < EMBED_SLAB && c0 + c < C; c += EMBED_BWD_THREADS) {
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

/* One block per sorted entry s (EMBED_BWD_THREADS threads); sorted_tok ascending, sorted_pos
 * ascending within each token's run. Only the block at a run's start works: its token's first
 * position i = sorted_pos[s]. It takes the run's positions in segments [i + k EMBED_LIST,
 * i + (k + 1) EMBED_LIST), each non-empty segment's list straight from the run (its positions in
 * ascending order), and adds the listed rows into the token's dwte row. */
template <typename T>
__global__ void k_embed_bwd_wte_sorted(float* dwte, const T* dout, const int* sorted_tok, const int* sorted_pos, int N,
                                       int C) {
    await_previous_kernel();
    int s = blockIdx.x, tok = sorted_tok[s], i = sorted_pos[s];
    if (s > 0 && sorted_tok[s - 1] == tok) return; /* not the run's start (block-uniform) */
    float* row = dwte + (size_t)tok * C;
    bool more = true;
    for (int q = s, seg = i; more;) {
        int n = embed_count_segment(sorted_tok, sorted_pos, q, N, tok, seg + EMBED_LIST, &more); /* >= 1 */
        embed_add_listed_rows(row, dout, sorted_pos + q, n, C); /* ends with a barrier */
        q += n;
        if (more) seg = i + (sorted_pos[q] - i) / EMBED_LIST * EMBED_LIST; /* the segment holding entry q */
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
    launch_kernel(k_embed_fwd<T>, elementwise_grid(n, 256), 256, out, tokens, wte, wpe, B * T_, T_, C);
}

/* dwte += the token rows' sums by k_embed_bwd_wte_sorted; scratch holds
 * embed_bwd_scratch_bytes(V, N) bytes (256-byte aligned). Every call is a stream operation (CUB's
 * sort included), so a CUDA graph can capture it. */
template <typename T>
static void embed_bwd_wte_sorted(float* dwte, const T* dout, const int* tokens, void* scratch, int V, int N, int C) {
    char* at = (char*)scratch;
    int* pos = (int*)at;
    int* sorted_tok = (int*)(at + embed_ints_bytes(N));
    int* sorted_pos = (int*)(at + 2 * embed_ints_bytes(N));
    size_t cub_bytes = embed_sort_bytes(V, N);
    launch_kernel(k_embed_positions, ceil_div(N, 256), 256, pos, N);
    /* stable: each token's positions stay ascending; tokens compared as unsigned (all >= 0) */
    CUDA_CHECK(cub::DeviceRadixSort::SortPairs(at + 3 * embed_ints_bytes(N), cub_bytes, (const unsigned*)tokens,
                                               (unsigned*)sorted_tok, pos, sorted_pos, N, 0, embed_token_bits(V),
                                               g_stream));
    if (sync_launches()) CUDA_CHECK(cudaDeviceSynchronize()); /* as launch_kernel does for its own */
    launch_kernel(k_embed_bwd_wte_sorted<T>, N, EMBED_BWD_THREADS, dwte, dout, sorted_tok, sorted_pos, N, C);
}

/* dwte += (always: the classifier's product writes it first, loss.cuh) and dwpe = / += by
 * grad_beta, from dout [B*T, C]; tokens [B*T] are the batch's input tokens (device), all below V;
 * scratch holds embed_bwd_scratch_bytes(V, B*T) bytes (256-byte aligned). */
template <typename T>
static void embed_bwd(float* dwte, float* dwpe, const T* dout, const int* tokens, void* scratch, int V, int B, int T_,
                      int C, float grad_beta) {
    int N = B * T_;
    embed_bwd_wte_sorted<T>(dwte, dout, tokens, scratch, V, N, C);
    size_t n = (size_t)T_ * C;
    launch_kernel(k_embed_bwd_wpe<T>, elementwise_grid(n, 256), 256, dwpe, dout, B, T_, C, grad_beta != 0.0f);
}

#endif
