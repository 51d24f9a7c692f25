/* embed.cuh: token + position embedding, out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:].
 * Reads the fp32 master embeddings (sums in fp32, rounds once to T).
 *
 * Backward without atomics: several positions can hold the same token, so dwte rows are not
 * independent outputs. Each distinct token gets one block, the one of its first position, that
 * adds the gradient rows of all its positions in position order: a fixed summation order, every
 * dwte row written by exactly one block, and no sort or host work (so a step needs no host round
 * trip and can be captured in a CUDA graph). dwpe[t] has one term per sequence, summed in b order.
 */
#ifndef MICROGPT_CUDA_EMBED_CUH
#define MICROGPT_CUDA_EMBED_CUH

#include "common.cuh"

#define EMBED_BWD_THREADS 256

template <typename T>
__global__ void embed_fwd_kernel(T* out, const int* tokens, const float* wte, const float* wpe, int N, int T_, int C) {
    size_t n_total = (size_t)N * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n_total; i += (size_t)gridDim.x * blockDim.x) {
        int n = (int)(i / C), c = (int)(i % C);
        out[i] = from_f<T>(wte[(size_t)tokens[n] * C + c] + wpe[(size_t)(n % T_) * C + c]);
    }
}

/* One block per position i (EMBED_BWD_THREADS threads). Only the first position of each token
 * works: it scans the positions from i on a tile at a time, each warp's ballot marking those with
 * the token, and every thread (one column) adds the marked rows in position order. */
template <typename T>
__global__ void embed_bwd_wte_kernel(float* dwte, const T* dout, const int* tokens, int N, int C) {
    __shared__ unsigned match[EMBED_BWD_THREADS / 32];
    int i = blockIdx.x, tok = tokens[i];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int seen = 0;
    for (int j = threadIdx.x; j < i; j += EMBED_BWD_THREADS) seen |= tokens[j] == tok;
    if (__syncthreads_or(seen)) return; /* an earlier position owns this token */
    float* row = dwte + (size_t)tok * C;
    /* c0 loop: every thread runs the same iterations, so the barriers below are uniform */
    for (int c0 = 0; c0 < C; c0 += EMBED_BWD_THREADS) {
        int c = c0 + threadIdx.x;
        float s = 0.0f;
        for (int j0 = i; j0 < N; j0 += EMBED_BWD_THREADS) {
            int j = j0 + threadIdx.x;
            unsigned m = __ballot_sync(0xffffffffu, j < N && tokens[j] == tok);
            __syncthreads(); /* the previous tile's masks are read */
            if (lane == 0) match[warp] = m;
            __syncthreads();
            for (int w = 0; w < EMBED_BWD_THREADS / 32; w++) {
                unsigned bits = match[w];
                while (bits) {
                    /* up to 4 rows loaded before any is added: the loads overlap (a frequent token's
                     * block is the kernel's critical path), the adds keep position order */
                    int p[4], k = 0;
                    float x[4];
                    for (; k < 4 && bits; k++, bits &= bits - 1) p[k] = j0 + 32 * w + __ffs(bits) - 1;
#pragma unroll
                    for (int q = 0; q < 4; q++) x[q] = q < k && c < C ? to_f(dout[(size_t)p[q] * C + c]) : 0.0f;
#pragma unroll
                    for (int q = 0; q < 4; q++)
                        if (q < k) s += x[q];
                }
            }
        }
        if (c < C) row[c] += s;
    }
}

/* One thread per (t, c). */
template <typename T>
__global__ void embed_bwd_wpe_kernel(float* dwpe, const T* dout, int B, int T_, int C) {
    size_t n_total = (size_t)T_ * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n_total; i += (size_t)gridDim.x * blockDim.x) {
        float s = 0.0f;
        for (int b = 0; b < B; b++) s += to_f(dout[(size_t)b * T_ * C + i]);
        dwpe[i] += s;
    }
}

/* out [B*T, C] (T) from device tokens [B*T] and the fp32 master wte/wpe. */
template <typename T>
static void k_embed_fwd(T* out, const int* tokens, const float* wte, const float* wpe, int B, int T_, int C) {
    size_t n = (size_t)B * T_ * C;
    embed_fwd_kernel<T><<<elementwise_grid(n, 256), 256, 0, g_stream>>>(out, tokens, wte, wpe, B * T_, T_, C);
    LAUNCH_CHECK();
}

/* dwte, dwpe += from dout [B*T, C]; tokens [B*T] are the batch's input tokens (device). */
template <typename T>
static void k_embed_bwd(float* dwte, float* dwpe, const T* dout, const int* tokens, int B, int T_, int C) {
    embed_bwd_wte_kernel<T><<<B * T_, EMBED_BWD_THREADS, 0, g_stream>>>(dwte, dout, tokens, B * T_, C);
    LAUNCH_CHECK();
    size_t n = (size_t)T_ * C;
    embed_bwd_wpe_kernel<T><<<elementwise_grid(n, 256), 256, 0, g_stream>>>(dwpe, dout, B, T_, C);
    LAUNCH_CHECK();
}

#endif
