/* embed.cuh: token + position embedding, out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:].
 * Reads the fp32 master embeddings (sums in fp32, rounds once to T).
 *
 * Backward without atomics: several positions can hold the same token, so dwte rows are not
 * independent outputs. The host groups the positions by token (embed_buckets: a sort by
 * (token, position), cheap next to the step), and the kernel gives each distinct token one block
 * that adds its positions' gradient rows in position order: a fixed summation order, and every
 * dwte row written by exactly one block. dwpe[t] has one term per sequence, summed in b order. */
#ifndef MICROGPT_CUDA_EMBED_CUH
#define MICROGPT_CUDA_EMBED_CUH

#include "common.cuh"

static int cmp_u64(const void* a, const void* b) {
    unsigned long long x = *(const unsigned long long*)a, y = *(const unsigned long long*)b;
    return (x > y) - (x < y);
}

/* Token buckets for one batch of N positions (host memory):
 *   order[0..N)         positions sorted by (token, position)
 *   start[0..n_buckets] bucket k is order[start[k] .. start[k+1])
 *   token[0..n_buckets) the token of bucket k
 * Returns n_buckets. `keys` is scratch of N entries. */
static int embed_buckets(const int* tokens, int N, unsigned long long* keys, int* order, int* start, int* token) {
    int i, n_buckets = 0;
    for (i = 0; i < N; i++) keys[i] = ((unsigned long long)(unsigned)tokens[i] << 32) | (unsigned)i;
    qsort(keys, (size_t)N, sizeof *keys, cmp_u64);
    for (i = 0; i < N; i++) {
        int tok = (int)(keys[i] >> 32);
        order[i] = (int)(keys[i] & 0xffffffffu);
        if (i == 0 || tok != token[n_buckets - 1]) {
            token[n_buckets] = tok;
            start[n_buckets] = i;
            n_buckets++;
        }
    }
    start[n_buckets] = N;
    return n_buckets;
}

template <typename T>
__global__ void embed_fwd_kernel(T* out, const int* tokens, const float* wte, const float* wpe, int N, int T_, int C) {
    size_t n_total = (size_t)N * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n_total; i += (size_t)gridDim.x * blockDim.x) {
        int n = (int)(i / C), c = (int)(i % C);
        out[i] = from_f<T>(wte[(size_t)tokens[n] * C + c] + wpe[(size_t)(n % T_) * C + c]);
    }
}

/* One block per distinct token; threads stride over the columns. */
template <typename T>
__global__ void embed_bwd_wte_kernel(float* dwte, const T* dout, const int* order, const int* start,
                                     const int* token, int C) {
    int k = blockIdx.x;
    int s0 = start[k], s1 = start[k + 1];
    float* row = dwte + (size_t)token[k] * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float s = 0.0f;
        for (int j = s0; j < s1; j++) s += to_f(dout[(size_t)order[j] * C + c]);
        row[c] += s;
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
    embed_fwd_kernel<T><<<elementwise_grid(n, 256), 256>>>(out, tokens, wte, wpe, B * T_, T_, C);
    LAUNCH_CHECK();
}

/* dwte, dwpe += from dout [B*T, C]. order/start/token are the device copies of embed_buckets'
 * output for this batch's tokens. */
template <typename T>
static void k_embed_bwd(float* dwte, float* dwpe, const T* dout, const int* order, const int* start, const int* token,
                        int n_buckets, int B, int T_, int C) {
    embed_bwd_wte_kernel<T><<<n_buckets, 128>>>(dwte, dout, order, start, token, C);
    LAUNCH_CHECK();
    size_t n = (size_t)T_ * C;
    embed_bwd_wpe_kernel<T><<<elementwise_grid(n, 256), 256>>>(dwpe, dout, B, T_, C);
    LAUNCH_CHECK();
}

#endif
