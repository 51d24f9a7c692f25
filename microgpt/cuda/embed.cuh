/* embed.cuh: token + position embedding, out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:].
 * Reads the fp32 master embeddings (sums in fp32, rounds once to T).
 *
 * Backward without floating-point atomics: several positions can hold the same token, so dwte
 * rows are not independent outputs. Each distinct token gets one block, the one of its first
 * position, that adds the gradient rows of all its positions (one sum per EMBED_LIST-position
 * segment, added to the row segment by segment): every dwte row written by exactly one block, and
 * no sort or host work (so a step needs no host round trip and can be captured in a CUDA graph).
 * A token's first position comes from a table filled by integer atomicMin, whose result does not
 * depend on the order the positions arrive in. Within a segment warp w sums the listed rows w,
 * w + 8, ... and the eight warp sums are added in warp order: a fixed summation order that does not
 * make a frequent token (hundreds of positions in real text) one long chain of dependent loads.
 * dwpe[t] has one term per sequence, summed in b order.
 *
 * Kernels: k_embed_fwd; the backward (k_embed_bwd) is k_embed_first_position, then
 * k_embed_bwd_wte and k_embed_bwd_wpe. The engine calls embed_fwd / embed_bwd.
 */
#ifndef MICROGPT_CUDA_EMBED_CUH
#define MICROGPT_CUDA_EMBED_CUH

#include "common.cuh"

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
        for (int q = warp; q < n; q += EMBED_WARPS) {
            const T* src = dout + (size_t)list[q] * C + c0 + lane;
#pragma unroll
            for (int k = 0; k < EMBED_LANE_COLS; k++)
                if (c0 + lane + 32 * k < C) acc[k] += to_f(src[32 * k]);
        }
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

/* first[tokens[i]] = min over positions i holding the token (first: INT_MAX-like beforehand). */
__global__ void k_embed_first_position(int* first, const int* tokens, int N) {
    await_previous_kernel();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < N; i += gridDim.x * blockDim.x)
        atomicMin(&first[tokens[i]], i);
}

/* One block per position i (EMBED_BWD_THREADS threads). Only the first position of each token
 * works. It walks the positions from i on in segments of EMBED_LIST positions: lists, in position
 * order, those holding the token (a ballot per warp and a prefix count over the warps), then adds
 * the listed rows into the token's dwte row, which no other block writes. */
template <typename T>
__global__ void k_embed_bwd_wte(float* dwte, const T* dout, const int* tokens, const int* first, int N, int C) {
    await_previous_kernel();
    __shared__ int list[EMBED_LIST];
    __shared__ unsigned match[EMBED_WARPS];
    int i = blockIdx.x, tok = tokens[i];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (first[tok] != i) return; /* an earlier position owns this token (block-uniform) */
    float* row = dwte + (size_t)tok * C;
    for (int seg = i; seg < N; seg += EMBED_LIST) {
        int n = 0; /* listed so far in this segment; the same in every thread */
        for (int j0 = seg; j0 < seg + EMBED_LIST && j0 < N; j0 += EMBED_BWD_THREADS) {
            int j = j0 + threadIdx.x;
            bool hit = j < N && tokens[j] == tok;
            unsigned m = __ballot_sync(0xffffffffu, hit);
            if (lane == 0) match[warp] = m;
            __syncthreads();
            int before = n, total = 0;
            for (int w = 0; w < EMBED_WARPS; w++) {
                int c = __popc(match[w]);
                before += w < warp ? c : 0;
                total += c;
            }
            if (hit) list[before + __popc(m & ((1u << lane) - 1u))] = j;
            n += total;
            __syncthreads(); /* match is read and the list entries written before the next tile */
        }
        if (n == 0) continue; /* block-uniform */
        embed_add_listed_rows(row, dout, list, n, C); /* ends with a barrier: the list may be rewritten */
    }
}

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

/* dwte += (always: the classifier's product writes it first, loss.cuh) and dwpe = / += by
 * grad_beta, from dout [B*T, C]; tokens [B*T] are the batch's input tokens (device), all below V;
 * first is scratch of V ints. */
template <typename T>
static void embed_bwd(float* dwte, float* dwpe, const T* dout, const int* tokens, int* first, int V, int B, int T_,
                      int C, float grad_beta) {
    int N = B * T_;
    CUDA_CHECK(cudaMemsetAsync(first, 0x7f, (size_t)V * sizeof(int), g_stream)); /* 0x7f7f7f7f > any position */
    launch_kernel(k_embed_first_position, ceil_div(N, 256), 256, first, tokens, N);
    launch_kernel(k_embed_bwd_wte<T>, N, EMBED_BWD_THREADS, dwte, dout, tokens, first, N, C);
    size_t n = (size_t)T_ * C;
    launch_kernel(k_embed_bwd_wpe<T>, elementwise_grid(n, 256), 256, dwpe, dout, B, T_, C, grad_beta != 0.0f);
}

#endif
