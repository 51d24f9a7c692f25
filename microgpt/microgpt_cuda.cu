/* microgpt_cuda.cu: the GPU engine. The model of SPEC §2 (pre-LayerNorm GPT, no biases, tied
 * embeddings, padded vocabulary) assembled from the kernel pairs in cuda/ (one header per layer),
 * implementing host/engine.h; the training loop itself is host/train_loop.h, shared with the CPU
 * engine.
 *
 * Precision (train.precision):
 *   fp32  everything fp32, no TF32: the reference that is compared tightly with the CPU engine.
 *   bf16  fp32 master weights, gradients and AdamW moments; a bf16 copy of the weights (rewritten
 *         by the AdamW kernel) feeds the matrix products; activations and their gradients bf16;
 *         every product accumulates in fp32; LayerNorm/embedding read the fp32 masters; attention
 *         scores and logits are fp32.
 *   fp16  as bf16 with fp16, plus dynamic loss scaling: the loss gradient is multiplied by the
 *         scale; engine_update unscales, and when the gradient norm is not finite it skips the
 *         step, zeroes the gradients and halves the scale; every LOSS_SCALE_GROW_EVERY-th step
 *         (a pure function of the step, so resume stays exact) that is not skipped doubles it.
 *   fp8   refused with a clear message (not yet supported).
 *
 * Memory: engine_setup sizes every buffer from the config, prints the plan, checks it fits, and
 * allocates once; nothing is allocated afterwards. Activation buffers are sized for B·T positions
 * and reused by smaller calls (one sequence of len tokens when sampling).
 *
 * Determinism: no float atomics anywhere; fixed-shape reductions; one cuBLAS handle with a fixed
 * workspace on one stream. Two runs of the same config on the same GPU give identical bits.
 *
 * Build: make cuda   (nvcc -O3 -std=c++17, linked with -lcublas) */
#include "host/train_loop.h"

#include "cuda/attention.cuh"
#include "cuda/common.cuh"
#include "cuda/embed.cuh"
#include "cuda/layernorm.cuh"
#include "cuda/loss.cuh"
#include "cuda/matmul.cuh"
#include "cuda/mlp.cuh"
#include "cuda/optimizer.cuh"
#include "cuda/residual.cuh"

enum { PREC_FP32, PREC_BF16, PREC_FP16 };

#define LOSS_SCALE_DEFAULT 65536.0f  /* 2^16: fp16's usual starting scale */
#define LOSS_SCALE_MAX 16777216.0f   /* 2^24 */
#define LOSS_SCALE_GROW_EVERY 1000
#define LOGITS_CHUNK_BYTES ((size_t)256 << 20) /* budget for one chunk of logits (+ their gradient) */

/* Memory groups of the plan, in the order printed and emitted. */
enum { G_PARAMS, G_GRADS, G_ADAM, G_WEIGHTS_LOWP, G_ACTIVATIONS, G_ACT_GRADS, G_SCRATCH, G_CUBLAS, N_GROUPS };
static const char* const GROUP_NAMES[N_GROUPS] = {"params", "grads", "adam", "weights_lowp", "activations",
                                                  "activation_grads", "scratch", "cublas_workspace"};
static const char* const GROUP_HELP[N_GROUPS] = {
    "fp32 master weights", "fp32 gradients", "fp32 AdamW m and v", "16-bit weight copy for the products",
    "forward values saved for backward", "activation gradients (shared by layers)",
    "attention scores, logits chunk, reductions, tokens", "fixed cuBLAS workspace"};

static struct {
    Config cfg;
    ParamLayout layout;
    int prec;
    size_t es; /* bytes per activation element */
    int B, T, C, H, F, V, Vp, L, N; /* N = B*T, the positions the buffers are sized for */
    int chunk;                      /* logits rows per chunk */
    size_t P;                       /* parameter count */
    float loss_scale;

    /* parameters (fp32 unless noted) */
    float *params, *grads, *m, *v;
    void* wlow; /* weights in the activation type; == params when fp32 */

    /* saved activations, per layer l at offset l * (size of one layer's slice) */
    void *res;   /* [L+1][N][C] residual stream: res[l] = input of layer l, res[L] = final */
    void *x_mid; /* [L][N][C] stream after the attention branch */
    void *ln1, *ln2; /* [L][N][C] */
    void *qkv;   /* [L][3][N][C] */
    void *atty;  /* [L][N][C] attention output before W_O */
    void *h;     /* [L][N][F] MLP pre-activation */
    float *ln1_mean, *ln1_rstd, *ln2_mean, *ln2_rstd; /* [L][N] */
    float *att_lse; /* [L][B][H][T] */
    void *lnf;      /* [N][C] */
    float *lnf_mean, *lnf_rstd;

    /* activation gradients, shared by all layers; each is zeroed before a backward adds into it */
    void *dres; /* [N][C] gradient of the residual stream at the current depth */
    void *dln;  /* [N][C] gradient of a LayerNorm output */
    void *dqkv; /* [3][N][C] */
    void *datty; /* [N][C] */
    void *dh;   /* [N][F] MLP scratch gradient */

    /* scratch */
    void *branch; /* [N][C] output of a branch before the residual add */
    void *g;      /* [N][F] gelu(h) */
    float *att_S, *att_dP; void* att_P; /* [H][T][T] */
    float* logits;  /* [chunk][Vp] */
    void* dlogits;  /* [chunk][Vp] (== logits when fp32) */
    float *losses, *loss_lse; /* [N] */
    float* ln_partial;
    float* norm_partial;
    float* norm_out;
    int* tok; /* device: inputs [N] | targets [N] | order [N] | bucket start [N+1] | bucket token [N] */
    void* cublas_ws;

    /* host */
    int* tok_host; /* pinned mirror of tok */
    unsigned long long* sort_keys; /* [N] embed_buckets scratch */
    float* loss_host;              /* [N] per-row losses */
    char* group_base[N_GROUPS];
    size_t group_bytes[N_GROUPS];
} E;

static const char* engine_name(void) { return "cuda"; }
static const char* engine_compute_precision(const Config* cfg) { return cfg->train.precision; }

/* ---------------------------------------------------------------------------------------------- */
/* The memory plan. plan_buffers walks every buffer once; with bases NULL it only sums the sizes
 * per group, with real bases it hands out the pointers. One walk, so the plan and the allocation
 * cannot disagree. */

static void* carve(int group, size_t bytes, size_t* used) {
    size_t at = used[group];
    used[group] += (bytes + 255) & ~(size_t)255; /* 256-byte alignment for every buffer */
    return E.group_base[group] ? E.group_base[group] + at : NULL;
}

static void plan_buffers(size_t* used) {
    size_t es = E.es, L = (size_t)E.L, N = (size_t)E.N, C = (size_t)E.C, F = (size_t)E.F, P = E.P;
    size_t nc = N * C, tt = attn_scratch_elems(E.H, E.T);
    int g;
    for (g = 0; g < N_GROUPS; g++) used[g] = 0;
    E.params = (float*)carve(G_PARAMS, P * 4, used);
    E.grads = (float*)carve(G_GRADS, P * 4, used);
    E.m = (float*)carve(G_ADAM, P * 4, used);
    E.v = (float*)carve(G_ADAM, P * 4, used);
    E.wlow = E.prec == PREC_FP32 ? (void*)E.params : carve(G_WEIGHTS_LOWP, P * es, used);

    E.res = carve(G_ACTIVATIONS, (L + 1) * nc * es, used);
    E.x_mid = carve(G_ACTIVATIONS, L * nc * es, used);
    E.ln1 = carve(G_ACTIVATIONS, L * nc * es, used);
    E.ln2 = carve(G_ACTIVATIONS, L * nc * es, used);
    E.qkv = carve(G_ACTIVATIONS, L * 3 * nc * es, used);
    E.atty = carve(G_ACTIVATIONS, L * nc * es, used);
    E.h = carve(G_ACTIVATIONS, L * N * F * es, used);
    E.ln1_mean = (float*)carve(G_ACTIVATIONS, L * N * 4, used);
    E.ln1_rstd = (float*)carve(G_ACTIVATIONS, L * N * 4, used);
    E.ln2_mean = (float*)carve(G_ACTIVATIONS, L * N * 4, used);
    E.ln2_rstd = (float*)carve(G_ACTIVATIONS, L * N * 4, used);
    E.att_lse = (float*)carve(G_ACTIVATIONS, L * N * (size_t)E.H * 4, used);
    E.lnf = carve(G_ACTIVATIONS, nc * es, used);
    E.lnf_mean = (float*)carve(G_ACTIVATIONS, N * 4, used);
    E.lnf_rstd = (float*)carve(G_ACTIVATIONS, N * 4, used);

    E.dres = carve(G_ACT_GRADS, nc * es, used);
    E.dln = carve(G_ACT_GRADS, nc * es, used);
    E.dqkv = carve(G_ACT_GRADS, 3 * nc * es, used);
    E.datty = carve(G_ACT_GRADS, nc * es, used);
    E.dh = carve(G_ACT_GRADS, N * F * es, used);

    E.branch = carve(G_SCRATCH, nc * es, used);
    E.g = carve(G_SCRATCH, N * F * es, used);
    E.att_S = (float*)carve(G_SCRATCH, tt * 4, used);
    E.att_dP = (float*)carve(G_SCRATCH, tt * 4, used);
    E.att_P = carve(G_SCRATCH, tt * es, used);
    E.logits = (float*)carve(G_SCRATCH, (size_t)E.chunk * E.Vp * 4, used);
    E.dlogits = E.prec == PREC_FP32 ? (void*)E.logits : carve(G_SCRATCH, (size_t)E.chunk * E.Vp * es, used);
    E.losses = (float*)carve(G_SCRATCH, N * 4, used);
    E.loss_lse = (float*)carve(G_SCRATCH, N * 4, used);
    E.ln_partial = (float*)carve(G_SCRATCH, layernorm_scratch_floats(E.C) * 4, used);
    E.norm_partial = (float*)carve(G_SCRATCH, NORM_BLOCKS * 4, used);
    E.norm_out = (float*)carve(G_SCRATCH, 4, used);
    E.tok = (int*)carve(G_SCRATCH, (5 * N + 1) * 4, used);
    E.cublas_ws = carve(G_CUBLAS, CUBLAS_WORKSPACE_BYTES, used);
}

static void print_plan(const size_t* bytes) {
    size_t total = 0;
    int g;
    info("memory plan (%s, B=%d T=%d, %zu parameters, logits in chunks of %d rows):", E.cfg.train.precision, E.B, E.T,
         E.P, E.chunk);
    for (g = 0; g < N_GROUPS; g++) {
        info("  %-18s %14zu bytes %10.1f MiB   %s", GROUP_NAMES[g], bytes[g], bytes[g] / 1048576.0, GROUP_HELP[g]);
        total += bytes[g];
    }
    info("  %-18s %14zu bytes %10.1f MiB", "total", total, total / 1048576.0);
}

/* ---------------------------------------------------------------------------------------------- */
/* Typed views of the buffers */

template <typename T> static T* layer_act(void* base, int l, size_t per_layer) { return (T*)base + (size_t)l * per_layer; }

/* Weight tensor `t` of layer l in the activation type (products) / fp32 master (LayerNorm). */
template <typename T> static const T* wl(int l, int t) { return (const T*)E.wlow + layer_offset(&E.layout, l, t); }
static const float* wf(int l, int t) { return E.params + layer_offset(&E.layout, l, t); }
static float* gl(int l, int t) { return E.grads + layer_offset(&E.layout, l, t); }

/* ---------------------------------------------------------------------------------------------- */
/* Forward and backward */

template <typename T> static AttnScratch<T> attn_scratch(void) {
    AttnScratch<T> s;
    s.S = E.att_S;
    s.dP = E.att_dP;
    s.P = (T*)E.att_P;
    return s;
}

/* Forward of B sequences of Tn positions (tokens already on the device) up to LNf's output. */
template <typename T>
static void forward(int B, int Tn) {
    int C = E.C, H = E.H, F = E.F, L = E.L, N = B * Tn, l;
    size_t nc = (size_t)E.N * C, nf = (size_t)E.N * F; /* per-layer strides: the allocated size */
    k_embed_fwd<T>((T*)E.res, E.tok, E.params + E.layout.wte, E.params + E.layout.wpe, B, Tn, C);
    for (l = 0; l < L; l++) {
        T* x = layer_act<T>(E.res, l, nc);
        T* xmid = layer_act<T>(E.x_mid, l, nc);
        T* ln1 = layer_act<T>(E.ln1, l, nc);
        T* ln2 = layer_act<T>(E.ln2, l, nc);
        T* qkv = layer_act<T>(E.qkv, l, 3 * nc);
        T* atty = layer_act<T>(E.atty, l, nc);
        T* h = layer_act<T>(E.h, l, nf);
        T* branch = (T*)E.branch;
        k_layernorm_fwd<T>(ln1, E.ln1_mean + (size_t)l * E.N, E.ln1_rstd + (size_t)l * E.N, x, wf(l, T_LN1_GAMMA),
                           wf(l, T_LN1_BETA), N, C);
        k_attn_qkv_fwd<T>(qkv, ln1, wl<T>(l, T_WQ), N, C);
        k_attn_fwd<T>(atty, E.att_lse + (size_t)l * E.N * H, qkv, qkv + (size_t)N * C, qkv + 2 * (size_t)N * C, B, Tn,
                      C, H, attn_scratch<T>());
        k_attn_out_fwd<T>(branch, atty, wl<T>(l, T_WO), N, C);
        k_residual_add<T>(xmid, x, branch, (size_t)N * C);
        k_layernorm_fwd<T>(ln2, E.ln2_mean + (size_t)l * E.N, E.ln2_rstd + (size_t)l * E.N, xmid, wf(l, T_LN2_GAMMA),
                           wf(l, T_LN2_BETA), N, C);
        k_mlp_fwd<T>(branch, h, (T*)E.g, ln2, wl<T>(l, T_W1), wl<T>(l, T_W2), N, C, F);
        k_residual_add<T>(layer_act<T>(E.res, l + 1, nc), xmid, branch, (size_t)N * C);
    }
    k_layernorm_fwd<T>((T*)E.lnf, E.lnf_mean, E.lnf_rstd, layer_act<T>(E.res, L, nc), E.params + E.layout.lnf_gamma,
                       E.params + E.layout.lnf_beta, N, C);
}

/* Loss over the N positions, chunk by chunk; with `train`, also the classifier backward, which
 * adds the gradient of LNf's output into dln (zeroed here) and into dwte. */
template <typename T>
static void loss_chunks(int N, int train) {
    int C = E.C, r0;
    const T* wte = (const T*)E.wlow + E.layout.wte;
    const int* targets = E.tok + E.N;
    float dscale = (E.prec == PREC_FP16 ? E.loss_scale : 1.0f) / (float)N;
    if (train) CUDA_CHECK(cudaMemsetAsync(E.dln, 0, (size_t)N * C * E.es));
    for (r0 = 0; r0 < N; r0 += E.chunk) {
        int n = N - r0 < E.chunk ? N - r0 : E.chunk;
        const T* x = (const T*)E.lnf + (size_t)r0 * C;
        k_loss_fwd<T>(E.losses + r0, E.loss_lse + r0, E.logits, x, wte, targets + r0, n, C, E.V, E.Vp);
        if (train)
            k_loss_bwd<T>((T*)E.dln + (size_t)r0 * C, E.grads + E.layout.wte, (T*)E.dlogits, E.logits, E.loss_lse + r0,
                          x, wte, targets + r0, n, C, E.V, E.Vp, dscale);
    }
}

template <typename T>
static void backward(int n_buckets) {
    int B = E.B, Tn = E.T, C = E.C, H = E.H, F = E.F, L = E.L, N = E.N, l;
    size_t nc = (size_t)N * C, nf = (size_t)N * F, es = E.es;
    T* dres = (T*)E.dres;
    T* dln = (T*)E.dln;
    T* dqkv = (T*)E.dqkv;
    /* dln holds d(LNf output) from loss_chunks */
    CUDA_CHECK(cudaMemsetAsync(dres, 0, nc * es));
    k_layernorm_bwd<T>(dres, E.grads + E.layout.lnf_gamma, E.grads + E.layout.lnf_beta, dln, layer_act<T>(E.res, L, nc),
                       E.params + E.layout.lnf_gamma, E.lnf_mean, E.lnf_rstd, N, C, E.ln_partial);
    for (l = L - 1; l >= 0; l--) {
        T* x = layer_act<T>(E.res, l, nc);
        T* xmid = layer_act<T>(E.x_mid, l, nc);
        T* ln1 = layer_act<T>(E.ln1, l, nc);
        T* ln2 = layer_act<T>(E.ln2, l, nc);
        T* qkv = layer_act<T>(E.qkv, l, 3 * nc);
        T* atty = layer_act<T>(E.atty, l, nc);
        T* h = layer_act<T>(E.h, l, nf);
        /* MLP branch: its output gradient is the stream's, dres */
        CUDA_CHECK(cudaMemsetAsync(dln, 0, nc * es));
        k_mlp_bwd<T>(dln, gl(l, T_W1), gl(l, T_W2), dres, ln2, h, wl<T>(l, T_W1), wl<T>(l, T_W2), (T*)E.g, (T*)E.dh, N, C,
                     F);
        k_layernorm_bwd<T>(dres, gl(l, T_LN2_GAMMA), gl(l, T_LN2_BETA), dln, xmid, wf(l, T_LN2_GAMMA),
                           E.ln2_mean + (size_t)l * N, E.ln2_rstd + (size_t)l * N, N, C, E.ln_partial);
        /* attention branch: dres is now the gradient at x_mid */
        CUDA_CHECK(cudaMemsetAsync(E.datty, 0, nc * es));
        k_attn_out_bwd<T>((T*)E.datty, gl(l, T_WO), dres, atty, wl<T>(l, T_WO), N, C);
        CUDA_CHECK(cudaMemsetAsync(dqkv, 0, 3 * nc * es));
        k_attn_bwd<T>(dqkv, dqkv + nc, dqkv + 2 * nc, (T*)E.datty, E.att_lse + (size_t)l * N * H, qkv, qkv + nc,
                      qkv + 2 * nc, B, Tn, C, H, attn_scratch<T>());
        CUDA_CHECK(cudaMemsetAsync(dln, 0, nc * es));
        k_attn_qkv_bwd<T>(dln, gl(l, T_WQ), dqkv, ln1, wl<T>(l, T_WQ), N, C);
        k_layernorm_bwd<T>(dres, gl(l, T_LN1_GAMMA), gl(l, T_LN1_BETA), dln, x, wf(l, T_LN1_GAMMA),
                           E.ln1_mean + (size_t)l * N, E.ln1_rstd + (size_t)l * N, N, C, E.ln_partial);
    }
    {
        const int* order = E.tok + 2 * N;
        const int* start = E.tok + 3 * N;
        const int* token = E.tok + 4 * N + 1;
        k_embed_bwd<T>(E.grads + E.layout.wte, E.grads + E.layout.wpe, dres, order, start, token, n_buckets, B, Tn, C);
    }
}

/* Copies a batch's N inputs and N targets to the device (through the pinned staging buffer). */
static void upload_batch(const int* inputs, const int* targets) {
    memcpy(E.tok_host, inputs, (size_t)E.N * sizeof(int));
    memcpy(E.tok_host + E.N, targets, (size_t)E.N * sizeof(int));
    CUDA_CHECK(cudaMemcpyAsync(E.tok, E.tok_host, 2 * (size_t)E.N * sizeof(int), cudaMemcpyHostToDevice, 0));
}

/* Mean of the N per-row losses, summed on the host in a fixed order. */
static float mean_loss(int N) {
    double sum = 0.0;
    int i;
    CUDA_CHECK(cudaMemcpy(E.loss_host, E.losses, (size_t)N * sizeof(float), cudaMemcpyDeviceToHost));
    for (i = 0; i < N; i++) sum += E.loss_host[i];
    return (float)(sum / N);
}

template <typename T>
static float forward_backward_t(const int* inputs, const int* targets) {
    int N = E.N, n_buckets;
    upload_batch(inputs, targets);
    forward<T>(E.B, E.T);
    /* while the GPU runs the forward: group positions by token for the embedding backward */
    n_buckets = embed_buckets(inputs, N, E.sort_keys, E.tok_host + 2 * N, E.tok_host + 3 * N, E.tok_host + 4 * N + 1);
    CUDA_CHECK(cudaMemcpyAsync(E.tok + 2 * N, E.tok_host + 2 * N, (size_t)(3 * N + 1) * sizeof(int),
                               cudaMemcpyHostToDevice, 0));
    loss_chunks<T>(N, 1);
    backward<T>(n_buckets);
    return mean_loss(N);
}

template <typename T>
static float forward_loss_t(const int* inputs, const int* targets) {
    upload_batch(inputs, targets);
    forward<T>(E.B, E.T);
    loss_chunks<T>(E.N, 0);
    return mean_loss(E.N);
}

/* The sequence is padded with token 0 to the full T and run at the one shape (1, T): attention is
 * causal, so positions < len see exactly what they would without the padding, and every call runs
 * the same kernels (all of them loaded by the warm-up, see engine_setup). */
template <typename T>
static void next_logits_t(const int* tokens, int len, float* logits) {
    memcpy(E.tok_host, tokens, (size_t)len * sizeof(int));
    memset(E.tok_host + len, 0, (size_t)(E.T - len) * sizeof(int));
    CUDA_CHECK(cudaMemcpyAsync(E.tok, E.tok_host, (size_t)E.T * sizeof(int), cudaMemcpyHostToDevice, 0));
    forward<T>(1, E.T);
    classifier_logits<T>(E.logits, (const T*)E.lnf + (size_t)(len - 1) * E.C, (const T*)E.wlow + E.layout.wte, 1, E.C,
                         E.Vp);
    CUDA_CHECK(cudaMemcpy(logits, E.logits, (size_t)E.V * sizeof(float), cudaMemcpyDeviceToHost));
}

/* ---------------------------------------------------------------------------------------------- */
/* Update */

/* AdamW over runs of consecutive tensors with the same decay flag (a handful of launches). */
template <typename T>
static void adamw_all(float lr, int t, const Config* cfg) {
    int i = 0, n = E.layout.n_tensors;
    while (i < n) {
        const ParamTensor* first = &E.layout.tensors[i];
        size_t off = first->offset, size = 0;
        int decay = first->decay;
        while (i < n && E.layout.tensors[i].decay == decay) size += E.layout.tensors[i++].size;
        k_adamw<T>(E.params + off, E.grads + off, E.m + off, E.v + off,
                   E.prec == PREC_FP32 ? (T*)NULL : (T*)E.wlow + off, size, lr, cfg->train.beta1, cfg->train.beta2,
                   cfg->train.eps, decay ? cfg->train.weight_decay : 0.0f, t);
    }
}

static void refresh_lowp_weights(void) {
    if (E.prec == PREC_BF16) k_convert<bf16>((bf16*)E.wlow, E.params, E.P);
    if (E.prec == PREC_FP16) k_convert<fp16>((fp16*)E.wlow, E.params, E.P);
}

static void zero_grads(void) { CUDA_CHECK(cudaMemsetAsync(E.grads, 0, E.P * sizeof(float))); }

/* Runs every code path once on a dummy batch (all-zero weights and tokens), then clears what it
 * touched. The CUDA driver loads kernels (ours and cuBLAS's) lazily, on first use, and that takes
 * device memory; after this, the first training step already sees the memory every later step
 * sees, so device_memory at the first and the last step agree. */
static void warm_up(void) {
    int* zeros = (int*)xcalloc((size_t)E.N, sizeof(int), "warm-up tokens");
    float* logits = (float*)xmalloc((size_t)E.V * sizeof(float), "warm-up logits");
    refresh_lowp_weights();
    engine_forward_backward(zeros, zeros);
    engine_forward_loss(zeros, zeros);
    engine_next_logits(zeros, 1, logits);
    zero_grads();
    CUDA_CHECK(cudaDeviceSynchronize());
    free(zeros);
    free(logits);
}

/* ---------------------------------------------------------------------------------------------- */
/* engine.h */

static size_t engine_setup(const Config* cfg) {
    const char* prec = cfg->train.precision;
    size_t used[N_GROUPS], total = 0, free_b = 0, total_b = 0;
    int g, n_dev = 0;
    memset(&E, 0, sizeof E);
    E.cfg = *cfg;
    if (strcmp(prec, "fp8") == 0)
        die_input("train.precision fp8 is not yet supported by the CUDA engine (use fp32, bf16 or fp16)");
    E.prec = strcmp(prec, "bf16") == 0 ? PREC_BF16 : strcmp(prec, "fp16") == 0 ? PREC_FP16 : PREC_FP32;
    E.es = E.prec == PREC_FP32 ? 4 : 2;
    E.B = cfg->train.batch_size;
    E.T = cfg->model.seq_len;
    E.C = cfg->model.d_model;
    E.H = cfg->model.n_head;
    E.F = cfg->model.d_ff;
    E.V = cfg->model.vocab_size;
    E.Vp = cfg->model.padded_vocab_size;
    E.L = cfg->model.n_layer;
    if ((size_t)E.B * E.T > (size_t)INT_MAX / 4)
        die_input("train.batch_size x model.seq_len = %zu positions is too many for one micro-batch",
                  (size_t)E.B * E.T);
    E.N = E.B * E.T;
    param_layout_init(&E.layout, cfg);
    E.P = E.layout.n_params;
    /* k_attn_qkv does the three projections as one batched product over consecutive weights */
    if (layer_offset(&E.layout, 0, T_WK) != layer_offset(&E.layout, 0, T_WQ) + (size_t)E.C * E.C ||
        layer_offset(&E.layout, 0, T_WV) != layer_offset(&E.layout, 0, T_WK) + (size_t)E.C * E.C)
        die_io("internal: W_Q, W_K, W_V are not consecutive in the parameter layout");
    {
        size_t row_bytes = (size_t)E.Vp * (4 + (E.prec == PREC_FP32 ? 0 : E.es));
        size_t rows = LOGITS_CHUNK_BYTES / row_bytes;
        if (rows > 128) rows -= rows % 128; /* whole tiles for the products */
        E.chunk = (int)(rows < 1 ? 1 : rows > (size_t)E.N ? (size_t)E.N : rows);
    }
    E.loss_scale = E.prec == PREC_FP16 ? LOSS_SCALE_DEFAULT : 1.0f;

    {
        cudaError_t err = cudaGetDeviceCount(&n_dev);
        if (err != cudaSuccess || n_dev < 1)
            die_io("no usable CUDA device (%s); the CPU engine is build/microgpt_cpu",
                   err != cudaSuccess ? cudaGetErrorString(err) : "none found");
    }
    {
        cudaDeviceProp p;
        CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
        info("device 0: %s, compute capability %d.%d, %.1f GiB", p.name, p.major, p.minor, p.totalGlobalMem / 1073741824.0);
        if (E.prec == PREC_BF16 && p.major < 8) die_input("train.precision bf16 needs compute capability 8.0 or newer");
    }
    CUDA_CHECK(cudaSetDevice(0));
    CUDA_CHECK(cudaFree(0)); /* create the context now, so the free-memory figure below accounts for it */
    CUBLAS_CHECK(cublasCreate(&g_cublas));

    plan_buffers(used); /* sizes only */
    print_plan(used);
    emit_memory(GROUP_NAMES, used, N_GROUPS);
    for (g = 0; g < N_GROUPS; g++) total += used[g];
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    if (total > free_b)
        die_io("needs %zu bytes of device memory (%.2f GiB), %zu free (%.2f GiB)", total, total / 1073741824.0, free_b,
               free_b / 1073741824.0);
    for (g = 0; g < N_GROUPS; g++) {
        E.group_bytes[g] = used[g];
        if (used[g]) CUDA_CHECK(cudaMalloc((void**)&E.group_base[g], used[g]));
    }
    plan_buffers(used); /* now with the bases: the pointers */
    CUDA_CHECK(cudaMallocHost((void**)&E.tok_host, (5 * (size_t)E.N + 1) * sizeof(int)));
    E.sort_keys = (unsigned long long*)xmalloc((size_t)E.N * sizeof(unsigned long long), "token sort keys");
    E.loss_host = (float*)xmalloc((size_t)E.N * sizeof(float), "per-position losses");
    cublas_init(E.cublas_ws, CUBLAS_WORKSPACE_BYTES);
    CUDA_CHECK(cudaMemset(E.group_base[G_PARAMS], 0, used[G_PARAMS]));
    CUDA_CHECK(cudaMemset(E.group_base[G_ADAM], 0, used[G_ADAM]));
    warm_up();
    return total;
}

static void engine_set_state(const float* params, const float* m, const float* v, float loss_scale) {
    size_t bytes = E.P * sizeof(float);
    CUDA_CHECK(cudaMemcpy(E.params, params, bytes, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(E.m, m, bytes, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(E.v, v, bytes, cudaMemcpyHostToDevice));
    if (E.prec == PREC_FP16) E.loss_scale = loss_scale > 0.0f ? loss_scale : LOSS_SCALE_DEFAULT;
    else E.loss_scale = 1.0f;
    refresh_lowp_weights();
    zero_grads();
    CUDA_CHECK(cudaDeviceSynchronize());
}

static void engine_get_state(float* params, float* m, float* v, float* loss_scale) {
    size_t bytes = E.P * sizeof(float);
    CUDA_CHECK(cudaMemcpy(params, E.params, bytes, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(m, E.m, bytes, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(v, E.v, bytes, cudaMemcpyDeviceToHost));
    *loss_scale = E.loss_scale;
}

static float engine_forward_backward(const int* inputs, const int* targets) {
    if (E.prec == PREC_BF16) return forward_backward_t<bf16>(inputs, targets);
    if (E.prec == PREC_FP16) return forward_backward_t<fp16>(inputs, targets);
    return forward_backward_t<float>(inputs, targets);
}

static float engine_forward_loss(const int* inputs, const int* targets) {
    if (E.prec == PREC_BF16) return forward_loss_t<bf16>(inputs, targets);
    if (E.prec == PREC_FP16) return forward_loss_t<fp16>(inputs, targets);
    return forward_loss_t<float>(inputs, targets);
}

static void engine_next_logits(const int* tokens, int len, float* logits) {
    if (len < 1 || len > E.T) die_io("internal: engine_next_logits with len %d (1..%d)", len, E.T);
    if (E.prec == PREC_BF16) next_logits_t<bf16>(tokens, len, logits);
    else if (E.prec == PREC_FP16) next_logits_t<fp16>(tokens, len, logits);
    else next_logits_t<float>(tokens, len, logits);
}

static UpdateResult engine_update(float lr, int t, const Config* cfg) {
    UpdateResult r;
    float norm_f;
    double norm, unscale = 1.0 / cfg->train.grad_accum;
    if (E.prec == PREC_FP16) unscale /= E.loss_scale;
    if (unscale != 1.0) k_grad_scale(E.grads, E.P, (float)unscale);
    k_grad_norm_partial(E.norm_partial, E.grads, E.P);
    k_grad_norm_final(E.norm_out, E.norm_partial);
    CUDA_CHECK(cudaMemcpy(&norm_f, E.norm_out, sizeof norm_f, cudaMemcpyDeviceToHost));
    norm = norm_f;
    r.grad_norm = norm_f;
    r.skipped = 0;
    if (E.prec == PREC_FP16 && !isfinite(norm)) {
        /* overflow somewhere in the scaled backward: drop this step's gradients, retry smaller */
        zero_grads();
        if (E.loss_scale > 1.0f) E.loss_scale *= 0.5f;
        r.skipped = 1;
        r.loss_scale = E.loss_scale;
        info("step %d: fp16 gradient overflow, step skipped, loss scale now %g", t, E.loss_scale);
        return r;
    }
    if (cfg->train.grad_clip > 0.0f && norm > cfg->train.grad_clip)
        k_grad_scale(E.grads, E.P, (float)(cfg->train.grad_clip / norm));
    if (E.prec == PREC_BF16) adamw_all<bf16>(lr, t, cfg);
    else if (E.prec == PREC_FP16) adamw_all<fp16>(lr, t, cfg);
    else adamw_all<float>(lr, t, cfg);
    zero_grads();
    if (E.prec == PREC_FP16 && t % LOSS_SCALE_GROW_EVERY == 0 && E.loss_scale < LOSS_SCALE_MAX) E.loss_scale *= 2.0f;
    r.loss_scale = E.loss_scale;
    return r;
}

static void engine_get_grads(float* grads) {
    size_t i;
    CUDA_CHECK(cudaMemcpy(grads, E.grads, E.P * sizeof(float), cudaMemcpyDeviceToHost));
    if (E.prec == PREC_FP16) /* the backward ran on loss-scaled gradients */
        for (i = 0; i < E.P; i++) grads[i] /= E.loss_scale;
}

static size_t engine_device_bytes_in_use(void) {
    size_t free_b = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    return total_b - free_b;
}

static void engine_shutdown(void) {
    int g;
    CUDA_CHECK(cudaDeviceSynchronize());
    cublas_shutdown();
    for (g = 0; g < N_GROUPS; g++)
        if (E.group_base[g]) CUDA_CHECK(cudaFree(E.group_base[g]));
    if (E.tok_host) CUDA_CHECK(cudaFreeHost(E.tok_host));
    free(E.sort_keys);
    free(E.loss_host);
    param_layout_free(&E.layout);
    memset(&E, 0, sizeof E);
}

int main(int argc, char** argv) { return train_main(argc, argv); }
