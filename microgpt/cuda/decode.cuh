/* decode.cuh: the KV-cache decode step of generation (docs/DESIGN.md §5a): n sequences, one new
 * position each, through the model: embedding, LayerNorm (layernorm.cuh's kernel), products,
 * attention over the cached keys and values, and the tied classifier, with fp32 logits out.
 *
 * The products are written here rather than run by cuBLAS: with n rows of a few, a product is a
 * pass over the weights (memory-bound), and a fixed kernel keeps each row's arithmetic the same
 * whatever n is: every output sums its K terms in a fixed split and order that depend only on the
 * shapes. So a sequence decodes to the same bits alone or batched, in every precision.
 *
 * Layouts: activations [n, C] rows in the activation type T (fp32 accumulation everywhere); the
 * weights [in, out] row-major (T); the KV cache of one layer [slots, T_, C] (T); the sequences'
 * slots, tokens and positions are device ints [n].
 *
 * Roles: decode_embed (k_decode_embed) the embedding, decode_matmul (k_decode_matmul) every
 * product with its epilogue (the QKV projections as three consecutive matrices, W_O and W_2 with
 * the residual join, W_1 with GELU), decode_kv_append (k_decode_kv_append) the new keys and values
 * into the cache, decode_attention (k_decode_attention) the attention of one query over the cache,
 * decode_logits (k_decode_logits) the tied classifier; LayerNorm is layernorm.cuh's layernorm_fwd. */
#ifndef MICROGPT_CUDA_DECODE_CUH
#define MICROGPT_CUDA_DECODE_CUH

#include "common.cuh"
#include "mlp.cuh" /* gelu_f */

#define DECODE_K_WARPS 16   /* warps of a product block; each sums its slice of the K terms */
#define DECODE_ROWS 8       /* rows (sequences) a product or classifier block handles */
#define DECODE_ATT_THREADS 256
#define DECODE_LOGIT_WARPS 8 /* classifier rows (vocabulary entries) per block, one per warp */

enum { DECODE_PLAIN, DECODE_GELU, DECODE_RESIDUAL };

/* out [n, C] = wte[tokens[i]] + wpe[positions[i]] from the fp32 masters, as k_embed_fwd. */
template <typename T>
__global__ void k_decode_embed(T* out, const int* tokens, const int* positions, const float* wte,
                                    const float* wpe, int n, int C) {
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < (size_t)n * C;
         e += (size_t)gridDim.x * blockDim.x) {
        int i = (int)(e / C), c = (int)(e % C);
        out[e] = from_f<T>(wte[(size_t)tokens[i] * C + c] + wpe[(size_t)positions[i] * C + c]);
    }
}

/* out[z] [n, out_dim] = x [n, in] @ w[z] [in, out_dim] for the blockIdx.z-th of consecutive weight
 * matrices, then by `epilogue`: as is, gelu, or + residual [n, out_dim]. Block: 32 columns (one per
 * lane) x DECODE_K_WARPS warps, each warp a fixed slice of K; the slices' sums are added in warp
 * order. blockIdx.y picks DECODE_ROWS rows. */
template <typename T>
__global__ void __launch_bounds__(32 * DECODE_K_WARPS)
k_decode_matmul(T* out, const T* x, const T* w, const T* residual, int n, int in, int out_dim, int epilogue) {
    __shared__ float part[DECODE_K_WARPS][DECODE_ROWS][32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int j = blockIdx.x * 32 + lane, r0 = blockIdx.y * DECODE_ROWS;
    int rows = n - r0 < DECODE_ROWS ? n - r0 : DECODE_ROWS;
    int slice = (in + DECODE_K_WARPS - 1) / DECODE_K_WARPS, k0 = warp * slice, k1 = k0 + slice < in ? k0 + slice : in;
    float acc[DECODE_ROWS];
    w += (size_t)blockIdx.z * in * out_dim;
    out += (size_t)blockIdx.z * n * out_dim;
#pragma unroll
    for (int r = 0; r < DECODE_ROWS; r++) acc[r] = 0.0f;
    if (j < out_dim)
#pragma unroll 4
        for (int k = k0; k < k1; k++) {
            float wk = to_f(w[(size_t)k * out_dim + j]);
#pragma unroll
            for (int r = 0; r < DECODE_ROWS; r++)
                if (r < rows) acc[r] += to_f(x[(size_t)(r0 + r) * in + k]) * wk;
        }
#pragma unroll
    for (int r = 0; r < DECODE_ROWS; r++) part[warp][r][lane] = acc[r];
    __syncthreads();
    if (warp != 0 || j >= out_dim) return;
    for (int r = 0; r < rows; r++) {
        float s = 0.0f;
        for (int q = 0; q < DECODE_K_WARPS; q++) s += part[q][r][lane];
        size_t o = (size_t)(r0 + r) * out_dim + j;
        if (epilogue == DECODE_GELU) s = gelu_f(s);
        else if (epilogue == DECODE_RESIDUAL) s += to_f(residual[o]);
        out[o] = from_f<T>(s);
    }
}

/* n_mats consecutive products (see k_decode_matmul); residual only with DECODE_RESIDUAL. */
template <typename T>
static void decode_matmul(T* out, const T* x, const T* w, const T* residual, int n, int in, int out_dim,
                            int epilogue, int n_mats = 1) {
    dim3 grid(ceil_div(out_dim, 32), ceil_div(n, DECODE_ROWS), n_mats);
    k_decode_matmul<T><<<grid, 32 * DECODE_K_WARPS, 0, g_stream>>>(out, x, w, residual, n, in, out_dim,
                                                                          epilogue);
    LAUNCH_CHECK();
}

/* The new keys and values k, v [n, C] into row positions[i] of slot slots[i] of one layer's caches. */
template <typename T>
__global__ void k_decode_kv_append(T* kcache, T* vcache, const T* k, const T* v, const int* slots,
                                        const int* positions, int n, int T_, int C) {
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < (size_t)n * C;
         e += (size_t)gridDim.x * blockDim.x) {
        int i = (int)(e / C), c = (int)(e % C);
        size_t row = ((size_t)slots[i] * T_ + positions[i]) * C + c;
        kcache[row] = k[e];
        vcache[row] = v[e];
    }
}

template <typename T>
static void decode_kv_append(T* kcache, T* vcache, const T* k, const T* v, const int* slots, const int* positions,
                               int n, int T_, int C) {
    size_t total = (size_t)n * C;
    k_decode_kv_append<T><<<elementwise_grid(total, 256), 256, 0, g_stream>>>(kcache, vcache, k, v, slots,
                                                                                    positions, n, T_, C);
    LAUNCH_CHECK();
}

/* One block per (sequence i, head h): the query q[i] (head h's columns) against the cached keys of
 * positions 0..positions[i] of its slot, softmax (scores and probabilities in fp32 in
 * scores[i, h, :], scratch of T_ floats per pair), then the probability-weighted sum of the cached
 * values into out[i] (head h's columns). Scale 1/sqrt(hs), as the training kernels. The values' sum
 * splits the positions over G = DECODE_ATT_THREADS / hs groups (one when hs is larger) whose sums
 * are added in group order. */
template <typename T>
__global__ void __launch_bounds__(DECODE_ATT_THREADS)
k_decode_attention(T* out, float* scores, const T* q, const T* kcache, const T* vcache, const int* slots,
                        const int* positions, int T_, int C, int H) {
    __shared__ float part[DECODE_ATT_THREADS];
    int i = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, hs = C / H, pos = positions[i];
    float scale = 1.0f / sqrtf((float)hs), m = -INFINITY, sum = 0.0f;
    const T* qi = q + (size_t)i * C + (size_t)h * hs;
    const T* kb = kcache + (size_t)slots[i] * T_ * C + (size_t)h * hs;
    const T* vb = vcache + (size_t)slots[i] * T_ * C + (size_t)h * hs;
    float* s = scores + ((size_t)i * H + h) * T_;
    for (int t = tid; t <= pos; t += blockDim.x) {
        const T* kt = kb + (size_t)t * C;
        float dot = 0.0f;
        for (int d = 0; d < hs; d++) dot += to_f(qi[d]) * to_f(kt[d]);
        s[t] = dot * scale;
        m = fmaxf(m, s[t]);
    }
    m = block_max(m);
    for (int t = tid; t <= pos; t += blockDim.x) {
        s[t] = expf(s[t] - m);
        sum += s[t];
    }
    sum = block_sum(sum); /* its barriers also make every s[t] visible to the whole block */
    float inv = 1.0f / sum;
    T* o = out + (size_t)i * C + (size_t)h * hs;
    int G = hs < DECODE_ATT_THREADS ? DECODE_ATT_THREADS / hs : 1;
    if (G == 1) {
        for (int d = tid; d < hs; d += blockDim.x) {
            float acc = 0.0f;
            for (int t = 0; t <= pos; t++) acc += (s[t] * inv) * to_f(vb[(size_t)t * C + d]);
            o[d] = from_f<T>(acc);
        }
        return;
    }
    if (tid < G * hs) {
        int d = tid % hs, g = tid / hs;
        float acc = 0.0f;
        for (int t = g; t <= pos; t += G) acc += (s[t] * inv) * to_f(vb[(size_t)t * C + d]);
        part[tid] = acc;
    }
    __syncthreads();
    if (tid < hs) {
        float acc = 0.0f;
        for (int g = 0; g < G; g++) acc += part[g * hs + tid];
        o[tid] = from_f<T>(acc);
    }
}

/* scores: [n, H, T_] fp32 scratch. */
template <typename T>
static void decode_attention(T* out, float* scores, const T* q, const T* kcache, const T* vcache, const int* slots,
                               const int* positions, int n, int T_, int C, int H) {
    k_decode_attention<T><<<dim3(n, H), DECODE_ATT_THREADS, 0, g_stream>>>(out, scores, q, kcache, vcache, slots,
                                                                                positions, T_, C, H);
    LAUNCH_CHECK();
}

/* logits [n, V] (fp32, real vocabulary) = x [n, C] @ wte[0:V]^T: one warp per vocabulary entry,
 * lanes over C in a fixed stride, the lanes' sums by the butterfly warp_sum. */
template <typename T>
__global__ void __launch_bounds__(32 * DECODE_LOGIT_WARPS)
k_decode_logits(float* logits, const T* x, const T* wte, int n, int C, int V) {
    int lane = threadIdx.x & 31, v = blockIdx.x * DECODE_LOGIT_WARPS + (threadIdx.x >> 5);
    int r0 = blockIdx.y * DECODE_ROWS, rows = n - r0 < DECODE_ROWS ? n - r0 : DECODE_ROWS;
    float acc[DECODE_ROWS];
    if (v >= V) return; /* whole warps leave together */
#pragma unroll
    for (int r = 0; r < DECODE_ROWS; r++) acc[r] = 0.0f;
    for (int c = lane; c < C; c += 32) {
        float wc = to_f(wte[(size_t)v * C + c]);
#pragma unroll
        for (int r = 0; r < DECODE_ROWS; r++)
            if (r < rows) acc[r] += to_f(x[(size_t)(r0 + r) * C + c]) * wc;
    }
#pragma unroll
    for (int r = 0; r < DECODE_ROWS; r++) {
        float s = warp_sum(acc[r]);
        if (lane == 0 && r < rows) logits[(size_t)(r0 + r) * V + v] = s;
    }
}

template <typename T>
static void decode_logits(float* logits, const T* x, const T* wte, int n, int C, int V) {
    dim3 grid(ceil_div(V, DECODE_LOGIT_WARPS), ceil_div(n, DECODE_ROWS));
    k_decode_logits<T><<<grid, 32 * DECODE_LOGIT_WARPS, 0, g_stream>>>(logits, x, wte, n, C, V);
    LAUNCH_CHECK();
}

template <typename T>
static void decode_embed(T* out, const int* tokens, const int* positions, const float* wte, const float* wpe,
                           int n, int C) {
    size_t total = (size_t)n * C;
    k_decode_embed<T><<<elementwise_grid(total, 256), 256, 0, g_stream>>>(out, tokens, positions, wte, wpe, n,
                                                                                C);
    LAUNCH_CHECK();
}

#endif
