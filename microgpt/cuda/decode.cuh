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

#define DECODE_K_WARPS 16    /* warps of a product block */
#define DECODE_K_GROUPS (8 * DECODE_K_WARPS) /* a block's K slices: 8 per warp, 4 column lanes each */
/* weight rows a product thread loads before using them: fewer when many rows' sums need registers */
#define DECODE_K_UNROLL(rows) ((rows) <= 2 ? 8 : 4)
#define DECODE_ROWS 8        /* the most rows (sequences) one product or classifier block handles */
#define DECODE_ATT_THREADS 256
#define DECODE_LOGIT_WARPS 8 /* classifier rows (vocabulary entries) per block, one per warp */
#define DECODE_LOGIT_UNROLL(rows) ((rows) <= 4 ? 4 : 2) /* packets of its row a classifier lane loads before use */

enum { DECODE_PLAIN, DECODE_GELU, DECODE_RESIDUAL };

/* out [n, C] = wte[tokens[i]] + wpe[positions[i]] from the fp32 masters, as k_embed_fwd. */
template <typename T>
__global__ void k_decode_embed(T* out, const int* tokens, const int* positions, const float* wte,
                                    const float* wpe, int n, int C) {
    await_previous_kernel();
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < (size_t)n * C;
         e += (size_t)gridDim.x * blockDim.x) {
        int i = (int)(e / C), c = (int)(e % C);
        out[e] = from_f<T>(wte[(size_t)tokens[i] * C + c] + wpe[(size_t)positions[i] * C + c]);
    }
}

/* VEC elements as stored (one 16-byte load when VEC = PACK(T)): a load kept in flight costs half
 * the registers of its fp32 conversion in 16-bit types. */
template <int VEC, typename T>
__device__ __forceinline__ void load_stored(T (&dst)[VEC], const T* p) {
    if constexpr (VEC == PACK(T)) *reinterpret_cast<int4*>(dst) = *reinterpret_cast<const int4*>(p);
    else
#pragma unroll
        for (int c = 0; c < VEC; c++) dst[c] = p[c];
}

/* out[z] [n, out_dim] = x [n, in] @ w[z] [in, out_dim] for the blockIdx.z-th of consecutive weight
 * matrices, then by `epilogue`: as is, gelu, or + residual [n, out_dim]. A pass over the weights,
 * so it is shaped for bandwidth: a block owns 4 * VEC columns (each thread VEC of them, one 16-byte
 * load per weight row when VEC = PACK(T)) and splits K over DECODE_K_GROUPS interleaved slices
 * (slice g: rows g, g + DECODE_K_GROUPS, ...), 8 slices per warp; every loaded weight serves all
 * ROWS rows (blockIdx.y picks them). Each output sums its slice in row order, the 8 slices of a
 * warp by the butterfly shuffles, then the warps in warp order: a split fixed by `in` alone, so a
 * row gets the same bits whatever n or ROWS is. */
template <typename T, int VEC, int ROWS>
__global__ void __launch_bounds__(32 * DECODE_K_WARPS)
k_decode_matmul(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ residual,
                int n, int in, int out_dim, int epilogue) {
    await_previous_kernel();
    constexpr int BC = 4 * VEC; /* the block's columns */
    __shared__ float part[DECODE_K_WARPS][ROWS][BC];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, col_lane = lane & 3;
    int group = warp * 8 + (lane >> 2), j0 = blockIdx.x * BC + col_lane * VEC, r0 = blockIdx.y * ROWS;
    int rows = n - r0 < ROWS ? n - r0 : ROWS;
    float acc[ROWS][VEC];
    w += (size_t)blockIdx.z * in * out_dim;
    out += (size_t)blockIdx.z * n * out_dim;
    x += (size_t)r0 * in;
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int c = 0; c < VEC; c++) acc[r][c] = 0.0f;
    if (j0 < out_dim) /* out_dim is a multiple of VEC: a thread's columns are all in or all out */
        for (int k0 = group; k0 < in; k0 += DECODE_K_UNROLL(ROWS) * DECODE_K_GROUPS) {
            /* all the chunk's loads in flight before any use, held as loaded (T) to spare registers */
            alignas(16) T wk[DECODE_K_UNROLL(ROWS)][VEC];
#pragma unroll
            for (int u = 0; u < DECODE_K_UNROLL(ROWS); u++) {
                int k = k0 + u * DECODE_K_GROUPS;
                if (k >= in) break;
                load_stored<VEC>(wk[u], w + (size_t)k * out_dim + j0);
            }
#pragma unroll
            for (int u = 0; u < DECODE_K_UNROLL(ROWS); u++) {
                int k = k0 + u * DECODE_K_GROUPS;
                if (k >= in) break;
#pragma unroll
                for (int r = 0; r < ROWS; r++) {
                    float xr = r < rows ? to_f(x[(size_t)r * in + k]) : 0.0f;
#pragma unroll
                    for (int c = 0; c < VEC; c++) acc[r][c] += xr * to_f(wk[u][c]);
                }
            }
        }
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int c = 0; c < VEC; c++) {
            float a = acc[r][c];
            for (int o = 4; o < 32; o <<= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
            if (lane < 4) part[warp][r][col_lane * VEC + c] = a;
        }
    __syncthreads();
    if (threadIdx.x >= ROWS * BC) return;
    int r = threadIdx.x / BC, j = blockIdx.x * BC + threadIdx.x % BC;
    if (r >= rows || j >= out_dim) return;
    float s = 0.0f;
    for (int q = 0; q < DECODE_K_WARPS; q++) s += part[q][r][threadIdx.x % BC];
    size_t o = (size_t)(r0 + r) * out_dim + j;
    if (epilogue == DECODE_GELU) s = gelu_f(s);
    else if (epilogue == DECODE_RESIDUAL) s += to_f(residual[o]);
    out[o] = from_f<T>(s);
}

/* The ROWS instantiation for n rows: the fewest registers that hold them (the sums are the same). */
#define DECODE_BY_ROWS(n, launch) \
    do {                          \
        if ((n) <= 1) launch(1);  \
        else if ((n) <= 2) launch(2); \
        else if ((n) <= 4) launch(4); \
        else launch(DECODE_ROWS); \
    } while (0)

/* n_mats consecutive products (see k_decode_matmul); residual only with DECODE_RESIDUAL. */
template <typename T>
static void decode_matmul(T* out, const T* x, const T* w, const T* residual, int n, int in, int out_dim,
                            int epilogue, int n_mats = 1) {
    bool packed = packable(out_dim, sizeof(T), {w});
#define DECODE_MATMUL(R)                                                                                     \
    do {                                                                                                     \
        dim3 grid(ceil_div(out_dim, 4 * (packed ? PACK(T) : 1)), ceil_div(n, R), n_mats);                    \
        if (packed)                                                                                          \
            launch_kernel(k_decode_matmul<T, PACK(T), R>, grid, 32 * DECODE_K_WARPS, out, x, w, residual, n, \
                          in, out_dim, epilogue);                                                            \
        else                                                                                                 \
            launch_kernel(k_decode_matmul<T, 1, R>, grid, 32 * DECODE_K_WARPS, out, x, w, residual, n, in,   \
                          out_dim, epilogue);                                                                \
    } while (0)
    DECODE_BY_ROWS(n, DECODE_MATMUL);
#undef DECODE_MATMUL
}

/* The new keys and values k, v [n, C] into row positions[i] of slot slots[i] of one layer's caches. */
template <typename T>
__global__ void k_decode_kv_append(T* kcache, T* vcache, const T* k, const T* v, const int* slots,
                                        const int* positions, int n, int T_, int C) {
    await_previous_kernel();
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
    launch_kernel(k_decode_kv_append<T>, elementwise_grid(total, 256), 256, kcache, vcache, k, v, slots, positions,
                  n, T_, C);
}

/* One block per (sequence i, head h): the query q[i] (head h's columns) against the cached keys of
 * positions 0..positions[i] of its slot, softmax (scores and probabilities in fp32 in
 * scores[i, h, :], scratch of T_ floats per pair), then the probability-weighted sum of the cached
 * values into out[i] (head h's columns). Scale 1/sqrt(hs), as the training kernels. A thread
 * scores whole positions (the key row read in VEC-element packets, its dot product in column
 * order). The values' sum gives each thread VEC columns and splits the positions over
 * G = DECODE_ATT_THREADS / (hs / VEC) interleaved groups (one when the head is wider), whose sums
 * are added in group order. */
template <typename T, int VEC>
__global__ void __launch_bounds__(DECODE_ATT_THREADS)
k_decode_attention(T* __restrict__ out, float* __restrict__ scores, const T* __restrict__ q,
                   const T* __restrict__ kcache, const T* __restrict__ vcache, const int* slots, const int* positions,
                   int T_, int C, int H) {
    await_previous_kernel();
    __shared__ float part[DECODE_ATT_THREADS * VEC];
    int i = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, hs = C / H, pos = positions[i];
    float scale = 1.0f / sqrtf((float)hs), m = -INFINITY, sum = 0.0f;
    const T* qi = q + (size_t)i * C + (size_t)h * hs;
    const T* kb = kcache + (size_t)slots[i] * T_ * C + (size_t)h * hs;
    const T* vb = vcache + (size_t)slots[i] * T_ * C + (size_t)h * hs;
    float* s = scores + ((size_t)i * H + h) * T_;
    for (int t = tid; t <= pos; t += blockDim.x) {
        const T* kt = kb + (size_t)t * C;
        float dot = 0.0f;
#pragma unroll 8 /* the row's packets in flight together (a 64-wide bf16 head is 8) */
        for (int d = 0; d < hs; d += VEC) {
            float kv[VEC], qv[VEC];
            load_vec<VEC>(kv, kt + d);
            load_vec<VEC>(qv, qi + d);
#pragma unroll
            for (int c = 0; c < VEC; c++) dot += qv[c] * kv[c];
        }
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
    int packets = hs / VEC, G = packets < DECODE_ATT_THREADS ? DECODE_ATT_THREADS / packets : 1;
    for (int e = tid; e < G * packets; e += blockDim.x) { /* one pass when G > 1 */
        int d = (e % packets) * VEC, g = e / packets;
        const T* vd = vb + d;
        float acc[VEC] = {};
#pragma unroll(sizeof(T) == 4 ? 4 : 8) /* fp32: 4 spare the registers */
        for (int t = g; t <= pos; t += G) {
            float vv[VEC], p = s[t] * inv;
            load_vec<VEC>(vv, vd + (size_t)t * C);
#pragma unroll
            for (int c = 0; c < VEC; c++) acc[c] += p * vv[c];
        }
        if (G == 1) {
            store_vec<VEC>(o + d, acc);
            continue;
        }
#pragma unroll
        for (int c = 0; c < VEC; c++) part[g * hs + d + c] = acc[c];
    }
    if (G == 1) return;
    __syncthreads();
    for (int d = tid; d < hs; d += blockDim.x) {
        float acc = 0.0f;
        for (int g = 0; g < G; g++) acc += part[g * hs + d];
        o[d] = from_f<T>(acc);
    }
}

/* scores: [n, H, T_] fp32 scratch. */
template <typename T>
static void decode_attention(T* out, float* scores, const T* q, const T* kcache, const T* vcache, const int* slots,
                               const int* positions, int n, int T_, int C, int H) {
    bool packed = packable(C / H, sizeof(T), {q, kcache, vcache, out}) && packable(C, sizeof(T), {});
    LAUNCH_PACKED(packed, k_decode_attention, T, dim3(n, H), DECODE_ATT_THREADS, out, scores, q, kcache, vcache, slots,
                  positions, T_, C, H);
}

/* logits [n, V] (fp32, real vocabulary) = x [n, C] @ wte[0:V]^T: one warp per vocabulary entry, its
 * row read in VEC-element packets, lane l taking packets l, l + 32, ... (each summed in column
 * order; up to DECODE_LOGIT_UNROLL loaded before use), the lanes' sums by the butterfly warp_sum;
 * every loaded packet serves all ROWS rows. */
template <typename T, int VEC, int ROWS>
__global__ void __launch_bounds__(32 * DECODE_LOGIT_WARPS)
k_decode_logits(float* __restrict__ logits, const T* __restrict__ x, const T* __restrict__ wte, int n, int C, int V) {
    await_previous_kernel();
    int lane = threadIdx.x & 31, v = blockIdx.x * DECODE_LOGIT_WARPS + (threadIdx.x >> 5);
    int r0 = blockIdx.y * ROWS, rows = n - r0 < ROWS ? n - r0 : ROWS;
    float acc[ROWS];
    if (v >= V) return; /* whole warps leave together */
    x += (size_t)r0 * C;
#pragma unroll
    for (int r = 0; r < ROWS; r++) acc[r] = 0.0f;
    for (int c0 = lane * VEC; c0 < C; c0 += DECODE_LOGIT_UNROLL(ROWS) * 32 * VEC) {
        alignas(16) T wc[DECODE_LOGIT_UNROLL(ROWS)][VEC]; /* the chunk's packets in flight together */
#pragma unroll
        for (int u = 0; u < DECODE_LOGIT_UNROLL(ROWS); u++) {
            int c = c0 + u * 32 * VEC;
            if (c >= C) break;
            load_stored<VEC>(wc[u], wte + (size_t)v * C + c);
        }
#pragma unroll
        for (int u = 0; u < DECODE_LOGIT_UNROLL(ROWS); u++) {
            int c = c0 + u * 32 * VEC;
            if (c >= C) break;
#pragma unroll
            for (int r = 0; r < ROWS; r++)
                if (r < rows) {
                    float xr[VEC];
                    load_vec<VEC>(xr, x + (size_t)r * C + c);
#pragma unroll
                    for (int e = 0; e < VEC; e++) acc[r] += xr[e] * to_f(wc[u][e]);
                }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        float s = warp_sum(acc[r]);
        if (lane == 0 && r < rows) logits[(size_t)(r0 + r) * V + v] = s;
    }
}

template <typename T>
static void decode_logits(float* logits, const T* x, const T* wte, int n, int C, int V) {
    bool packed = packable(C, sizeof(T), {x, wte});
#define DECODE_LOGITS(R)                                                                                           \
    do {                                                                                                           \
        dim3 grid(ceil_div(V, DECODE_LOGIT_WARPS), ceil_div(n, R));                                                \
        if (packed)                                                                                                \
            launch_kernel(k_decode_logits<T, PACK(T), R>, grid, 32 * DECODE_LOGIT_WARPS, logits, x, wte, n, C, V); \
        else                                                                                                       \
            launch_kernel(k_decode_logits<T, 1, R>, grid, 32 * DECODE_LOGIT_WARPS, logits, x, wte, n, C, V);       \
    } while (0)
    DECODE_BY_ROWS(n, DECODE_LOGITS);
#undef DECODE_LOGITS
}

template <typename T>
static void decode_embed(T* out, const int* tokens, const int* positions, const float* wte, const float* wpe,
                           int n, int C) {
    size_t total = (size_t)n * C;
    launch_kernel(k_decode_embed<T>, elementwise_grid(total, 256), 256, out, tokens, positions, wte, wpe, n, C);
}

#endif
