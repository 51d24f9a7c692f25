/* embed.cuh: token + position embedding, out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:].
 * Reads the fp32 master embeddings (sums in fp32, rounds once to T).
 *
 * Backward without floating-point atomics: several positions can hold the same token, so dwte
 * rows are not independent outputs. A stable radix sort of (token, position) pairs (CUB's,
 * deterministic: in one block where the batch's positions fit it, else device-wide) gives each
 * token's positions in one ascending run, and no host work (so a step needs no host round trip and
 * can be captured in a CUDA graph). The sorted entries are cut into chunks of EMBED_CHUNK, the
 * chunk boundaries cutting each run into pieces; a warp sums a chunk's pieces, each in entry order
 * from 0. A run that lies in one chunk (most tokens) is added to its dwte row there; one that
 * crosses chunk boundaries (a frequent token: a space is a quarter of the benchmark's text) leaves
 * its pieces' sums as partials, and a second kernel adds them in chunk order into one total, which
 * goes to the row. So every row gets one addition of a sum in a fixed order and no row has two
 * writers; the rows' loads are spread evenly over the chunks' warps whatever the tokens (a frequent
 * token's hundreds of rows are summed eight to a warp, side by side), and what stays serial is the
 * join's chain over a crossing run's partials (an eighth of its rows, already summed, loaded
 * EMBED_JOIN_AHEAD at a time). dwpe[t] has one term per sequence, summed in b order.
 *
 * Kernels: k_embed_fwd; the backward is the sort (k_embed_sort_block, or k_embed_positions and
 * CUB's device-wide sort: embed_bwd_sort), then k_embed_bwd_chunks, k_embed_bwd_join and
 * k_embed_bwd_wpe (embed_bwd_sorted). The engine calls embed_fwd, and embed_bwd_sort at the start
 * of a micro-batch (it needs only the tokens) and embed_bwd_sorted at the end of the backward, with
 * embed_bwd_scratch_bytes of scratch; embed_bwd is the two in turn.
 */
#ifndef MICROGPT_CUDA_EMBED_CUH
#define MICROGPT_CUDA_EMBED_CUH

#include "common.cuh"

#include <cub/block/block_radix_sort.cuh>
#include <cub/device/device_radix_sort.cuh>

/* The backward's chunks and loads, chosen by measurement (docs/BENCHMARKS.md #154: chunks of 8, 16
 * and 32 entries, the join 8 or 16 partials ahead, on uniform, log-uniform and text-like tokens) */
#define EMBED_CHUNK 8       /* sorted entries a chunk: one a lane (at most 32) */
#define EMBED_BWD_WARPS 8
#define EMBED_AHEAD 8       /* rows a lane of k_embed_bwd_chunks loads before it adds the first of them */
#define EMBED_JOIN_AHEAD 16 /* partials a lane of k_embed_bwd_join loads before it adds the first of them */
static_assert(EMBED_CHUNK <= 32, "a lane holds one entry of its warp's chunk");

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

/* pos[i] = i: the values the sort carries with the tokens. */
__global__ void k_embed_positions(int* pos, int N) {
    await_previous_kernel();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < N; i += gridDim.x * blockDim.x) pos[i] = i;
}

/* The warp's share of the token sums (k_embed_bwd_chunks, k_embed_bwd_join): chunk `chunk` of the
 * sorted entries (entries e0 .. e0 + n - 1, n >= 1; n <= 0: no chunk, the warp has nothing to do)
 * and VEC columns from c of a slab of 32 VEC (cols: they lie in the row). */
struct EmbedWarp {
    int chunk, e0, n, c;
    bool cols;
};
template <int VEC> __device__ __forceinline__ EmbedWarp embed_warp(int N, int C) {
    int lane = threadIdx.x & 31, n_slabs = (int)ceil_div(C, 32 * VEC);
    int w = blockIdx.x * EMBED_BWD_WARPS + (threadIdx.x >> 5);
    EmbedWarp ew;
    ew.chunk = w / n_slabs;
    ew.e0 = ew.chunk * EMBED_CHUNK;
    ew.n = min(EMBED_CHUNK, N - ew.e0);
    ew.c = (w % n_slabs) * 32 * VEC + lane * VEC;
    ew.cols = ew.c < C; /* VEC > 1 only where C is a multiple of it */
    return ew;
}

/* A partial of a run crossing chunk boundaries: chunk k's first piece where the run began in an
 * earlier chunk (its head, slot 0), else its last piece, which begins the run (its tail, slot 1). */
template <typename F> __device__ __forceinline__ F* embed_partial(F* partial, int k, int slot, int C) {
    return partial + ((size_t)k * 2 + slot) * C;
}

/* Each warp a chunk and a column slab: lane l holds entry e0 + l; the warp walks the chunk's entries
 * in order, adding each entry's dout row (EMBED_AHEAD rows loaded at once) into the piece's sum from
 * 0; at a piece's last entry it adds the sum into the token's dwte row (loaded with the rows) where
 * the piece is the whole run, or else stores it as the chunk's head or tail partial. */
template <typename T, int VEC>
__global__ void __launch_bounds__(32 * EMBED_BWD_WARPS)
k_embed_bwd_chunks(float* __restrict__ dwte, float* __restrict__ partial, const T* __restrict__ dout,
                   const int* __restrict__ sorted_tok, const int* __restrict__ sorted_pos, int N, int C) {
    await_previous_kernel();
    EmbedWarp ew = embed_warp<VEC>(N, C);
    if (ew.n <= 0) return; /* warp-uniform: no barriers below */
    int lane = threadIdx.x & 31, e_end = ew.e0 + ew.n;
    int tok = lane < ew.n ? sorted_tok[ew.e0 + lane] : -1, pos = lane < ew.n ? sorted_pos[ew.e0 + lane] : 0;
    int first_tok = __shfl_sync(0xffffffffu, tok, 0);
    bool from_prev = ew.e0 > 0 && sorted_tok[ew.e0 - 1] == first_tok; /* the chunk's first piece continues a run */
    int next_tok = e_end < N ? sorted_tok[e_end] : -1;                /* the run after the chunk's last piece */
    float acc[VEC] = {};
    for (int j0 = 0; j0 < ew.n; j0 += EMBED_AHEAD) {
        float v[EMBED_AHEAD][VEC], row[EMBED_AHEAD][VEC];
        int toks[EMBED_AHEAD];
        bool ends[EMBED_AHEAD], whole[EMBED_AHEAD]; /* entry j0 + r ends a piece; one that is its token's whole run */
#pragma unroll
        for (int r = 0; r < EMBED_AHEAD; r++) {
            int j = j0 + r, p = __shfl_sync(0xffffffffu, pos, j & 31);
            int t = __shfl_sync(0xffffffffu, tok, j & 31), t_next = __shfl_sync(0xffffffffu, tok, (j + 1) & 31);
            toks[r] = t;
            ends[r] = j < ew.n && (j + 1 == ew.n || t_next != t);
            whole[r] = ends[r] && !(t == first_tok && from_prev) && !(j + 1 == ew.n && t == next_tok);
            if (j < ew.n && ew.cols) load_vec(v[r], dout + (size_t)p * C + ew.c);
            if (whole[r] && ew.cols) load_vec(row[r], dwte + (size_t)t * C + ew.c);
        }
#pragma unroll
        for (int r = 0; r < EMBED_AHEAD; r++) {
            if (j0 + r >= ew.n) break;
            for (int k = 0; k < VEC; k++) acc[k] += v[r][k];
            if (!ends[r]) continue; /* the piece goes on */
            int t = toks[r];
            if (ew.cols) {
                if (whole[r]) {
                    for (int k = 0; k < VEC; k++) row[r][k] += acc[k];
                    store_vec(dwte + (size_t)t * C + ew.c, row[r]);
                } else {
                    store_vec(embed_partial(partial, ew.chunk, t == first_tok && from_prev ? 0 : 1, C) + ew.c, acc);
                }
            }
            for (int k = 0; k < VEC; k++) acc[k] = 0.0f;
        }
    }
}

/* After k_embed_bwd_chunks, the warps of the chunks where a crossing run begins (the chunk's last
 * piece goes on into the next chunk, and began in this one): total = that tail, then + the heads of
 * the following chunks in order up to the one where the run ends (EMBED_JOIN_AHEAD at a time; lane l
 * looks up whether the run goes on past chunk k0 + l); the token's dwte row += total. */
template <typename T, int VEC>
__global__ void __launch_bounds__(32 * EMBED_BWD_WARPS)
k_embed_bwd_join(float* __restrict__ dwte, const float* __restrict__ partial, const int* __restrict__ sorted_tok,
                 int N, int C) {
    await_previous_kernel();
    EmbedWarp ew = embed_warp<VEC>(N, C);
    int e_end = ew.e0 + ew.n;
    if (ew.n <= 0 || e_end >= N) return; /* warp-uniform */
    int tok = sorted_tok[e_end - 1];
    if (sorted_tok[e_end] != tok) return;                                     /* no run crosses into the next */
    if (ew.e0 > 0 && sorted_tok[ew.e0] == tok && sorted_tok[ew.e0 - 1] == tok) return; /* it began before */
    int lane = threadIdx.x & 31;
    float total[VEC];
    if (ew.cols) load_vec(total, embed_partial(partial, ew.chunk, 1, C) + ew.c);
    for (int k0 = ew.chunk + 1;; k0 += 32) {
        size_t next = (size_t)(k0 + lane + 1) * EMBED_CHUNK; /* lane l: does the run go on past chunk k0 + l? */
        unsigned goes_on = __ballot_sync(0xffffffffu, next < (size_t)N && sorted_tok[next] == tok);
        int heads = goes_on == 0xffffffffu ? 32 : __ffs(~goes_on); /* chunks k0 .. k0 + heads - 1 */
        for (int h0 = 0; h0 < heads; h0 += EMBED_JOIN_AHEAD) {
            float v[EMBED_JOIN_AHEAD][VEC];
#pragma unroll
            for (int r = 0; r < EMBED_JOIN_AHEAD; r++)
                if (h0 + r < heads && ew.cols) load_vec(v[r], embed_partial(partial, k0 + h0 + r, 0, C) + ew.c);
#pragma unroll
            for (int r = 0; r < EMBED_JOIN_AHEAD; r++)
                if (h0 + r < heads)
                    for (int k = 0; k < VEC; k++) total[k] += v[r][k];
        }
        if (goes_on != 0xffffffffu) break;
    }
    if (ew.cols) {
        float row[VEC];
        load_vec(row, dwte + (size_t)tok * C + ew.c);
        for (int k = 0; k < VEC; k++) row[k] += total[k];
        store_vec(dwte + (size_t)tok * C + ew.c, row);
    }
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

static size_t embed_sort_bytes(int V, int N) {
    size_t cub_bytes = 0;
    CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, cub_bytes, (const unsigned*)nullptr, (unsigned*)nullptr,
                                               (const int*)nullptr, (int*)nullptr, N, 0, embed_token_bits(V)));
    return cub_bytes;
}

/* The backward's scratch: positions, sorted tokens, sorted positions (N ints each), the chunks'
 * partials (a head and a tail of C floats a chunk), then CUB's temporary storage (embed_sort_bytes);
 * every array 256-byte aligned. */
struct EmbedScratch {
    int *pos, *sorted_tok, *sorted_pos;
    float* partial;
    void* cub;
};
static size_t embed_cub_offset(int N, int C) {
    return 3 * align_256((size_t)N * sizeof(int)) +
           align_256((size_t)ceil_div(N, EMBED_CHUNK) * 2 * C * sizeof(float));
}
static EmbedScratch embed_scratch(void* at, int N, int C) {
    char* base = (char*)at;
    size_t ints = align_256((size_t)N * sizeof(int));
    return {(int*)base, (int*)(base + ints), (int*)(base + 2 * ints), (float*)(base + 3 * ints),
            base + embed_cub_offset(N, C)};
}
static size_t embed_bwd_scratch_bytes(int V, int N, int C) { return embed_cub_offset(N, C) + embed_sort_bytes(V, N); }

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
 * radix sort of the positions k_embed_positions writes, with its storage: the scratch's). */
static void embed_sort_device(const EmbedScratch& s, const int* tokens, int V, int N) {
    size_t cub_bytes = embed_sort_bytes(V, N);
    launch_kernel(k_embed_positions, ceil_div(N, 256), 256, s.pos, N);
    /* stable: each token's positions stay ascending; tokens compared as unsigned (all >= 0) */
    CUDA_CHECK(cub::DeviceRadixSort::SortPairs(s.cub, cub_bytes, (const unsigned*)tokens, (unsigned*)s.sorted_tok,
                                               s.pos, s.sorted_pos, N, 0, embed_token_bits(V), g_stream));
    if (sync_launches()) CUDA_CHECK(cudaDeviceSynchronize()); /* as launch_kernel does for its own */
}

/* The backward's first half, which reads only the tokens (so the engine runs it beside the forward,
 * docs/DESIGN.md §9): the (token, position) pairs sorted by token into the scratch, which holds
 * embed_bwd_scratch_bytes(V, N, C) bytes (256-byte aligned). Every call is a stream operation (CUB's
 * sort included), so a CUDA graph can capture it. */
static void embed_bwd_sort(void* scratch, const int* tokens, int V, int N, int C) {
    EmbedScratch s = embed_scratch(scratch, N, C);
    if (N <= EMBED_SORT_THREADS * EMBED_SORT_ITEMS)
        launch_kernel(k_embed_sort_block, 1, EMBED_SORT_THREADS, s.sorted_tok, s.sorted_pos, tokens, N,
                      embed_token_bits(V));
    else
        embed_sort_device(s, tokens, V, N);
}

/* The second half, after embed_bwd_sort of the same tokens into the same scratch: dwte += (always:
 * the classifier's product writes it first, loss.cuh) the token rows' sums by k_embed_bwd_chunks and
 * k_embed_bwd_join, and dwpe = / += by grad_beta, from dout [B*T, C]. */
template <typename T>
static void embed_bwd_sorted(float* dwte, float* dwpe, const T* dout, void* scratch, int B, int T_, int C,
                             float grad_beta) {
    int N = B * T_;
    EmbedScratch s = embed_scratch(scratch, N, C);
    bool packed = packable(C, sizeof(T), {dout}) && packable(C, sizeof(float), {dwte, s.partial});
    unsigned warps = ceil_div(N, EMBED_CHUNK) * ceil_div(C, 32 * (packed ? PACK(T) : 1));
    unsigned blocks = ceil_div(warps, EMBED_BWD_WARPS);
    LAUNCH_PACKED(packed, k_embed_bwd_chunks, T, blocks, 32 * EMBED_BWD_WARPS, dwte, s.partial, dout, s.sorted_tok,
                  s.sorted_pos, N, C);
    LAUNCH_PACKED(packed, k_embed_bwd_join, T, blocks, 32 * EMBED_BWD_WARPS, dwte, s.partial, s.sorted_tok, N, C);
    size_t n = (size_t)T_ * C;
    launch_kernel(k_embed_bwd_wpe<T>, elementwise_grid(n, 256), 256, dwpe, dout, B, T_, C, grad_beta != 0.0f);
}

/* Both halves in turn; tokens [B*T] are the batch's input tokens (device), all below V. */
template <typename T>
static void embed_bwd(float* dwte, float* dwpe, const T* dout, const int* tokens, void* scratch, int V, int B, int T_,
                      int C, float grad_beta) {
    embed_bwd_sort(scratch, tokens, V, B * T_, C);
    embed_bwd_sorted<T>(dwte, dwpe, dout, scratch, B, T_, C, grad_beta);
}

#endif
