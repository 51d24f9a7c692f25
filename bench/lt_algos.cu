/* lt_algos.cu: the cuBLASLt products of a training step of ANDREA-120M (B8 T1024) and ANDREA-12M
 * (B8 T512), in bf16 and in precision fp8, as the engine runs them: for each product, the engine's
 * rule's algorithm against every offer of the heuristic (up to PROBE_OFFERS), timed. A measurement
 * tool for the fixed algorithm table (microgpt/cuda/lt_table.h; bench/lt_table.py writes it from
 * this output); never part of the engine or the tests: nothing here chooses at run time.
 *
 *   build: make build/lt_algos       (with the engine's flags; it times each plan's rule, not the table's)
 *   run:   build/lt_algos > lt.txt   (both models; `build/lt_algos 12M`: one; a few minutes on an H200)
 *
 * The products are the engine's own: the probe calls the engine's layer functions (attn_qkv_fwd,
 * attn_out_fwd, mlp_fwd, mlp_bwd, attn_out_bwd, attn_qkv_bwd, loss_fwd_bwd over the engine's
 * classifier chunks) and fp8_gemm with the shapes of microgpt_cuda.cu's fp8 layer functions, and
 * learns each product's plan (descriptors, alignments, the rule's algorithm) and operands through
 * common.cuh's g_lt_watch. It times nothing on those operands: each product gets fresh random
 * operands (uniform in [-1, 1], FP8 codes of such values; zeros draw less power than real
 * operands and flattered the first probe), in enough sets that one rotation through them is
 * PROBE_ROTATE_L2 times the L2 cache (at least 2), so no launch finds its inputs left in L2 by
 * the previous one. A time is the median of PROBE_REPS launches queued back to back after
 * PROBE_WARMUP (kernel_timer.cuh's time_median_queued_us). After the sweep, the rule's algorithm
 * and the fastest offer are timed again, alternately, PROBE_ROUNDS times each; the reported times
 * are the medians of those rounds. The fastest offer is also run twice on the same inputs
 * (repeat=1: bitwise the same output) and compared with the rule's output (diff: the largest
 * |difference| over the largest |value| of the rule's output).
 *
 * Output: one line per product (the rest of the output starts with '#'):
 *   LTPROBE-ENV gpu="..." cc=9.0 sms=132 driver=... cublaslt=... cudart=... date=... workspace=...
 *   LTPROBE model=120M prec=bf16 product=mlp_fwd key=<lt_key_name> calls=<launches a step> offers=N
 *           rule_us=.. best_us=.. gain_pct=.. repeat=1 diff=.. ws=<best's workspace bytes>
 *           rule=<config> best=<config>
 * where a config is algo_id:tile:stages:splitk:reduction:swizzle:custom:inner_shape:cluster_shape
 * (cublasLtMatmulAlgoConfigGetAttribute's values; lt_table.h's fields in that order). */
#include "../microgpt/cuda/attention.cuh"
#include "../microgpt/cuda/fp8.cuh"
#include "../microgpt/cuda/loss.cuh"
#include "../microgpt/cuda/mlp.cuh"
#include "kernel_timer.cuh"

#include <string>
#include <time.h>

#define PROBE_OFFERS 64
#define PROBE_REPS 25
#define PROBE_WARMUP 5
#define PROBE_ROUNDS 3
#define PROBE_ROTATE_L2 4
#define PROBE_MAX_SETS 32

/* ---------------------------------------------------------------------------------------------- */
/* Random operands */

static size_t type_bytes(cudaDataType_t t) {
    return t == CUDA_R_32F ? 4 : (t == CUDA_R_8F_E4M3 || t == CUDA_R_8F_E5M2) ? 1 : 2;
}

/* A uniform value in [-1, 1) from (i, seed): a hash, so every buffer differs and no state is kept. */
__device__ __forceinline__ float hash_uniform(size_t i, uint32_t seed) {
    uint32_t h = (uint32_t)i * 0x9E3779B1u ^ (uint32_t)(i >> 32) * 0x85EBCA77u ^ seed * 0xC2B2AE3Du;
    h ^= h >> 15, h *= 0x2C1B3C6Du, h ^= h >> 12, h *= 0x297A2D39u, h ^= h >> 15;
    return (float)(h >> 8) * (2.0f / 16777216.0f) - 1.0f;
}

__global__ void k_fill(void* p, cudaDataType_t t, size_t n, uint32_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float v = hash_uniform(i, seed);
        if (t == CUDA_R_32F) ((float*)p)[i] = v;
        else if (t == CUDA_R_16BF) ((bf16*)p)[i] = __float2bfloat16(v);
        else if (t == CUDA_R_16F) ((fp16*)p)[i] = __float2half(v);
        else ((fp8*)p)[i] = fp8_cvt(v, t == CUDA_R_8F_E4M3 ? FP8_E4M3 : FP8_E5M2);
    }
}

static std::vector<void*> g_allocs; /* freed after each model */

static void* dev_random(cudaDataType_t t, size_t n) {
    static uint32_t seed = 1;
    void* p;
    CUDA_CHECK(cudaMalloc(&p, n * type_bytes(t) + 16));
    k_fill<<<elementwise_grid(n, 256), 256, 0, g_stream>>>(p, t, n, seed++);
    LAUNCH_CHECK();
    g_allocs.push_back(p);
    return p;
}

template <typename T> static T* dev_random(size_t n) { return (T*)dev_random(TypeInfo<T>::dtype, n); }
static fp8* dev_fp8(int fmt, size_t n) { return (fp8*)dev_random(fp8_dtype(fmt), n); }

static void free_model_buffers(void) {
    CUDA_CHECK(cudaDeviceSynchronize());
    for (void* p : g_allocs) CUDA_CHECK(cudaFree(p));
    g_allocs.clear();
}

/* ---------------------------------------------------------------------------------------------- */
/* The products, as the engine's calls made them (g_lt_watch) */

struct Product {
    LtPlan* p;
    Gemm g;
    bool has_c;  /* C is an input of its own (the residual join); else C is D */
    bool has_aux;
    std::string label;
    int calls; /* launches in the model's one-layer pass (the classifier's: in its whole step) */
};

static std::vector<Product> g_products;
static std::vector<std::string> g_names_seen; /* a product probed once, whatever model repeats it */
static const char* g_label = "";

static void watch(LtPlan* p, const Gemm& g, const void* C, const void* aux) {
    for (Product& pr : g_products) /* this model's: count every launch under the first call's label */
        if (pr.p->name == std::string(p->name)) {
            pr.calls++;
            return;
        }
    for (const std::string& n : g_names_seen)
        if (n == p->name) return;
    g_names_seen.push_back(p->name);
    Product pr = {p, g, C != g.D.p && g.beta != 0.0f, aux != NULL, g_label, 1};
    g_products.push_back(pr);
}

/* Elements a row-major operand spans: `batch` matrices of rows x cols, ld apart by row, stride
 * apart by matrix. */
static size_t span(int rows, int cols, int ld, int batch, long long stride) {
    return (size_t)(batch - 1) * (size_t)stride + (size_t)(rows - 1) * ld + cols;
}

/* One set of operands of a product, fresh and random. */
struct Operands {
    void *a, *b, *c, *d, *aux;
};

struct Sized {
    size_t a, b, d; /* elements */
};

static Sized operand_sizes(const Gemm& g) {
    Sized s;
    s.a = span(g.A.trans ? g.K : g.M, g.A.trans ? g.M : g.K, g.A.ld, g.batch, g.A.stride);
    s.b = span(g.B.trans ? g.N : g.K, g.B.trans ? g.K : g.N, g.B.ld, g.batch, g.B.stride);
    s.d = span(g.M, g.N, g.D.ld, g.batch, g.D.stride);
    return s;
}

static Operands make_operands(const Product& pr) {
    Sized s = operand_sizes(pr.g);
    Operands o;
    o.a = dev_random(pr.g.A.type, s.a);
    o.b = dev_random(pr.g.B.type, s.b);
    o.d = dev_random(pr.g.D.type, s.d);
    o.c = pr.has_c ? dev_random(pr.g.D.type, s.d) : o.d;
    o.aux = pr.has_aux ? dev_random(pr.g.A.type, s.d) : NULL;
    return o;
}

static size_t operands_bytes(const Product& pr) {
    Sized s = operand_sizes(pr.g);
    return s.a * type_bytes(pr.g.A.type) + s.b * type_bytes(pr.g.B.type) +
           s.d * type_bytes(pr.g.D.type) * (1 + pr.has_c + pr.has_aux);
}

/* One launch of the product on operand set o with `algo`, as lt_matmul / fp8_gemm launch it. */
static cublasStatus_t launch(const Product& pr, const Operands& o, const cublasLtMatmulAlgo_t* algo) {
    const LtPlan* p = pr.p;
    if (o.aux) lt_set_desc(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &o.aux, sizeof o.aux);
    return cublasLtMatmul(g_cublaslt, p->desc, &pr.g.alpha, o.b, p->a, o.a, p->b, &pr.g.beta, o.c, p->d, o.d, p->d, algo,
                          g_gemm_workspace, lt_call_workspace(p, algo), g_stream);
}

static float time_algo(const Product& pr, const std::vector<Operands>& sets, const cublasLtMatmulAlgo_t* algo) {
    size_t i = 0;
    return time_median_queued_us([&] { CUBLAS_CHECK(launch(pr, sets[i++ % sets.size()], algo)); }, PROBE_REPS,
                                 PROBE_WARMUP);
}

/* ---------------------------------------------------------------------------------------------- */
/* Configurations */

struct Config {
    int v[9]; /* lt_table.h's order: algo_id, tile, stages, splitk, reduction, swizzle, custom, inner, cluster */
};

static Config algo_config(const cublasLtMatmulAlgo_t* a) {
    static const cublasLtMatmulAlgoConfigAttributes_t attrs[9] = {
        CUBLASLT_ALGO_CONFIG_ID,           CUBLASLT_ALGO_CONFIG_TILE_ID,       CUBLASLT_ALGO_CONFIG_STAGES_ID,
        CUBLASLT_ALGO_CONFIG_SPLITK_NUM,   CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING,
        CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID};
    Config c;
    for (int i = 0; i < 9; i++) {
        size_t got;
        if (attrs[i] == CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID || attrs[i] == CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID) {
            uint16_t v = 0;
            CUBLAS_CHECK(cublasLtMatmulAlgoConfigGetAttribute(a, attrs[i], &v, sizeof v, &got));
            c.v[i] = v;
        } else {
            int32_t v = 0; /* int32_t or uint32_t per attribute: the same 4 bytes, all values small */
            CUBLAS_CHECK(cublasLtMatmulAlgoConfigGetAttribute(a, attrs[i], &v, sizeof v, &got));
            c.v[i] = v;
        }
    }
    return c;
}

static bool same_config(const Config& x, const Config& y) { return !memcmp(x.v, y.v, sizeof x.v); }

static std::string config_str(const Config& c) {
    char s[160];
    snprintf(s, sizeof s, "%d:%d:%d:%d:%d:%d:%d:%d:%d", c.v[0], c.v[1], c.v[2], c.v[3], c.v[4], c.v[5], c.v[6], c.v[7],
             c.v[8]);
    return s;
}

/* ---------------------------------------------------------------------------------------------- */
/* Checks of the fastest offer against the rule's: D after one launch on set 0 (C restored first
 * where C is D), as floats. */

static std::vector<float> output_of(const Product& pr, const Operands& o, const void* d0,
                                    const cublasLtMatmulAlgo_t* algo) {
    size_t n = operand_sizes(pr.g).d, bytes = n * type_bytes(pr.g.D.type);
    CUDA_CHECK(cudaMemcpyAsync(o.d, d0, bytes, cudaMemcpyDeviceToDevice, g_stream));
    CUBLAS_CHECK(launch(pr, o, algo));
    std::vector<float> out(n);
    if (pr.g.D.type == CUDA_R_32F) {
        CUDA_CHECK(cudaMemcpyAsync(out.data(), o.d, bytes, cudaMemcpyDeviceToHost, g_stream));
    } else {
        std::vector<bf16> h(n);
        CUDA_CHECK(cudaMemcpyAsync(h.data(), o.d, bytes, cudaMemcpyDeviceToHost, g_stream));
        CUDA_CHECK(cudaStreamSynchronize(g_stream));
        for (size_t i = 0; i < n; i++) out[i] = __bfloat162float(h[i]);
    }
    CUDA_CHECK(cudaStreamSynchronize(g_stream));
    return out;
}

/* ---------------------------------------------------------------------------------------------- */

static const char* g_model = "";
static const char* g_prec = "";
static int g_layers = 1; /* of the model: a layer's products run this many times a step */

static void probe(const Product& pr) {
    size_t l2 = 0;
    {
        int dev, v;
        CUDA_CHECK(cudaGetDevice(&dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrL2CacheSize, dev));
        l2 = (size_t)v;
    }
    size_t per_set = operands_bytes(pr);
    size_t n_sets = (PROBE_ROTATE_L2 * l2 + per_set - 1) / per_set;
    n_sets = n_sets < 2 ? 2 : n_sets > PROBE_MAX_SETS ? PROBE_MAX_SETS : n_sets;
    std::vector<Operands> sets;
    for (size_t i = 0; i < n_sets; i++) sets.push_back(make_operands(pr));

    cublasLtMatmulHeuristicResult_t res[PROBE_OFFERS];
    int found = 0;
    CUBLAS_CHECK(lt_heuristic(pr.p, PROBE_OFFERS, res, &found));
    Config rule = algo_config(&pr.p->rule);
    int best = -1;
    float best_us = 0;
    for (int i = 0; i < found; i++) {
        if (launch(pr, sets[0], &res[i].algo) != CUBLAS_STATUS_SUCCESS) {
            printf("# %s offer %d: launch refused\n", pr.p->name, i);
            continue;
        }
        float us = time_algo(pr, sets, &res[i].algo);
        printf("# %s offer %2d %s %.2f us\n", pr.p->name, i, config_str(algo_config(&res[i].algo)).c_str(), us);
        if (best < 0 || us < best_us) best = i, best_us = us;
    }
    if (best < 0) {
        printf("# %s: no offer ran\n", pr.p->name);
        return;
    }
    const cublasLtMatmulAlgo_t* fast = &res[best].algo;
    Config fast_cfg = algo_config(fast);
    /* alternate rounds: the rule's and the fastest offer's medians under the same conditions */
    std::vector<float> r_us, b_us;
    for (int r = 0; r < PROBE_ROUNDS; r++) {
        r_us.push_back(time_algo(pr, sets, &pr.p->rule));
        b_us.push_back(same_config(rule, fast_cfg) ? r_us.back() : time_algo(pr, sets, fast));
    }
    std::sort(r_us.begin(), r_us.end());
    std::sort(b_us.begin(), b_us.end());
    float rule_us = r_us[PROBE_ROUNDS / 2], fast_us = b_us[PROBE_ROUNDS / 2];

    /* repeat and difference, on set 0 from its saved D */
    size_t d_bytes = operand_sizes(pr.g).d * type_bytes(pr.g.D.type);
    void* d0;
    CUDA_CHECK(cudaMalloc(&d0, d_bytes));
    CUDA_CHECK(cudaMemcpy(d0, sets[0].d, d_bytes, cudaMemcpyDeviceToDevice));
    std::vector<float> ref = output_of(pr, sets[0], d0, &pr.p->rule), x1 = output_of(pr, sets[0], d0, fast),
                       x2 = output_of(pr, sets[0], d0, fast);
    CUDA_CHECK(cudaFree(d0));
    bool repeat = !memcmp(x1.data(), x2.data(), x1.size() * sizeof(float));
    double maxref = 0, maxdiff = 0;
    for (size_t i = 0; i < ref.size(); i++) {
        maxref = fmax(maxref, fabs(ref[i]));
        maxdiff = fmax(maxdiff, fabs((double)x1[i] - ref[i]));
    }
    int calls = pr.label == "classifier" ? pr.calls : pr.calls * g_layers;
    printf("LTPROBE model=%s prec=%s product=%s key=%s calls=%d offers=%d rule_us=%.2f best_us=%.2f gain_pct=%.1f "
           "repeat=%d diff=%.3g ws=%zu rule=%s best=%s\n",
           g_model, g_prec, pr.label.c_str(), pr.p->name, calls, found, rule_us, fast_us,
           100.0 * (rule_us - fast_us) / rule_us, repeat ? 1 : 0, maxref > 0 ? maxdiff / maxref : maxdiff,
           res[best].workspaceSize, config_str(rule).c_str(), config_str(fast_cfg).c_str());
    fflush(stdout);
}

static void probe_products(void) {
    CUDA_CHECK(cudaDeviceSynchronize());
    for (const Product& pr : g_products) probe(pr);
    g_products.clear();
    free_model_buffers();
}

/* ---------------------------------------------------------------------------------------------- */
/* A model's step, product by product (N positions, width C, MLP width F, vocabulary V padded to Vp) */

static void bf16_step(const char* model, int layers, int N, int C, int F, int V, int Vp) {
    g_model = model, g_prec = "bf16", g_layers = layers;
    bf16 *x = dev_random<bf16>((size_t)N * C), *res = dev_random<bf16>((size_t)N * C);
    bf16 *out = dev_random<bf16>((size_t)N * C), *dout = dev_random<bf16>((size_t)N * C);
    bf16 *dx = dev_random<bf16>((size_t)N * C), *qkv = dev_random<bf16>(3 * (size_t)N * C);
    bf16 *dqkv = dev_random<bf16>(3 * (size_t)N * C), *w_qkv = dev_random<bf16>(3 * (size_t)C * C);
    bf16 *w_o = dev_random<bf16>((size_t)C * C), *w1 = dev_random<bf16>((size_t)C * F), *w2 = dev_random<bf16>((size_t)F * C);
    bf16 *h = dev_random<bf16>((size_t)N * F), *h_gelu = dev_random<bf16>((size_t)N * F), *dh = dev_random<bf16>((size_t)N * F);
    float *dw_qkv = dev_random<float>(3 * (size_t)C * C), *dw_o = dev_random<float>((size_t)C * C);
    float *dw1 = dev_random<float>((size_t)C * F), *dw2 = dev_random<float>((size_t)F * C);
    int chunk = loss_chunk_rows(Vp, sizeof(bf16), N);
    bf16 *logits = dev_random<bf16>((size_t)chunk * Vp), *wte = dev_random<bf16>((size_t)Vp * C);
    float *dwte = dev_random<float>((size_t)Vp * C), *losses = dev_random<float>(N), *lse = dev_random<float>(N);
    float* dscale = dev_random<float>(1);
    int* targets;
    CUDA_CHECK(cudaMalloc(&targets, N * sizeof(int)));
    CUDA_CHECK(cudaMemset(targets, 0, N * sizeof(int)));
    g_allocs.push_back(targets);
    printf("# %s bf16: N %d, C %d, F %d, logits chunks of %d rows, Vp %d\n", model, N, C, F, chunk, Vp);

    g_label = "qkv_fwd", attn_qkv_fwd<bf16>(qkv, x, w_qkv, N, C);
    g_label = "wo_fwd", attn_out_fwd<bf16>(out, x, w_o, res, N, C);
    g_label = "mlp_fwd", mlp_fwd<bf16>(out, h, h_gelu, x, w1, w2, res, N, C, F);
    for (int r0 = 0; r0 < N; r0 += chunk) {
        int n = N - r0 < chunk ? N - r0 : chunk;
        g_label = "classifier";
        loss_fwd_bwd<bf16>(losses + r0, lse + r0, dx + (size_t)r0 * C, dwte, logits, x + (size_t)r0 * C, wte,
                           targets + r0, n, C, V, Vp, dscale, r0 == 0 ? 0.0f : 1.0f, (float*)NULL);
    }
    g_label = "mlp_bwd", mlp_bwd<bf16>(dx, dw1, dw2, dout, x, h, h_gelu, w1, w2, dh, N, C, F, 0.0f);
    g_label = "wo_bwd", attn_out_bwd<bf16>(dx, dw_o, dout, x, w_o, N, C, 0.0f);
    g_label = "qkv_bwd", attn_qkv_bwd<bf16>(dx, dw_qkv, dqkv, x, w_qkv, N, C, 0.0f);
    probe_products();
}

/* The FP8 products of precision fp8 (microgpt_cuda.cu: fp8_qkv_fwd, fp8_linear_fwd, fp8_linear_bwd),
 * layer by layer, each under its pass's accumulation (fp8_fast_accum: a key named fp8fa where it is
 * fast); the classifier's are bf16_step's (the FP8 classifier, from d_model 512 up, is not probed). */
struct Fp8Step {
    int N;
    Fp8Scale* sc; /* one scale for every cast: the products read its descale, 1 */
};

static void fp8_fwd_product(const Fp8Step& s, int in, int out_dim, bool residual) {
    int N = s.N;
    bf16 *out = dev_random<bf16>((size_t)N * out_dim), *res = residual ? dev_random<bf16>((size_t)N * out_dim) : NULL;
    fp8 *x8 = dev_fp8(FP8_E4M3, (size_t)N * in), *w8 = dev_fp8(FP8_E4M3, (size_t)in * out_dim);
    fp8_gemm<bf16>(FP8_PASS_FORWARD, N, out_dim, in, fp8_mat(x8, FP8_E4M3, s.sc), fp8_mat(w8, FP8_E4M3, s.sc), out, res,
                   residual ? 1.0f : 0.0f);
}

static void fp8_bwd_products(const Fp8Step& s, int in, int out_dim, int batch) {
    int N = s.N;
    fp8 *x8t = dev_fp8(FP8_E4M3, (size_t)in * N), *g8t = dev_fp8(FP8_GRAD_FMT, (size_t)batch * out_dim * N);
    fp8 *g8 = dev_fp8(FP8_GRAD_FMT, (size_t)batch * N * out_dim), *w8 = dev_fp8(FP8_E4M3, (size_t)batch * in * out_dim);
    float* dw = dev_random<float>((size_t)batch * in * out_dim);
    bf16* dx = dev_random<bf16>((size_t)N * in);
    fp8_gemm<float>(FP8_PASS_BACKWARD, in, out_dim, N, fp8_mat(x8t, FP8_E4M3, s.sc),
                    fp8_mat(g8t, FP8_GRAD_FMT, s.sc, (long long)out_dim * N), dw, NULL, 0.0f, batch,
                    (long long)in * out_dim);
    fp8_gemm<bf16>(FP8_PASS_INPUT_GRAD, N, in, batch * out_dim, fp8_mat(g8, FP8_GRAD_FMT, s.sc),
                   fp8_mat(w8, FP8_E4M3, s.sc), dx, NULL, 0.0f);
}

static void fp8_step(const char* model, int layers, int N, int C, int F) {
    g_model = model, g_prec = "fp8", g_layers = layers;
    Fp8Scale one = {1.0f, 1.0f, 0}, *sc;
    CUDA_CHECK(cudaMalloc(&sc, sizeof *sc)); /* 256-byte aligned: FP8_SCALE_ALIGN holds */
    CUDA_CHECK(cudaMemcpy(sc, &one, sizeof one, cudaMemcpyHostToDevice));
    g_allocs.push_back(sc);
    Fp8Step s = {N, sc};
    g_fp8_fast_input_grads = fp8_fast_input_grads_at(C); /* as the engine sets it */
    printf("# %s fp8: N %d, C %d, F %d, gradients %s\n", model, N, C, F, FP8_GRAD_FMT == FP8_E4M3 ? "e4m3" : "e5m2");
    {
        g_label = "fp8_qkv_fwd";
        fp8 *x8 = dev_fp8(FP8_E4M3, (size_t)N * C), *w8 = dev_fp8(FP8_E4M3, 3 * (size_t)C * C);
        bf16* qkv = dev_random<bf16>(3 * (size_t)N * C);
        fp8_gemm<bf16>(FP8_PASS_FORWARD, N, C, C, fp8_mat(x8, FP8_E4M3, sc), fp8_mat(w8, FP8_E4M3, sc, (long long)C * C),
                       qkv, NULL, 0.0f, 3, (long long)N * C);
    }
    g_label = "fp8_wo_fwd", fp8_fwd_product(s, C, C, true);
    g_label = "fp8_w1_fwd", fp8_fwd_product(s, C, F, false);
    g_label = "fp8_w2_fwd", fp8_fwd_product(s, F, C, true);
    g_label = "fp8_w2_bwd", fp8_bwd_products(s, F, C, 1);
    g_label = "fp8_w1_bwd", fp8_bwd_products(s, C, F, 1);
    g_label = "fp8_wo_bwd", fp8_bwd_products(s, C, C, 1);
    g_label = "fp8_qkv_bwd", fp8_bwd_products(s, C, C, 3);
    probe_products();
}

/* The NVIDIA driver's version: the first word of /proc/driver/nvidia/version's first line that is
 * digits and dots ("NVRM version: NVIDIA UNIX [Open] Kernel Module [for x86_64]  580.95.05 ..."),
 * or "unknown". */
static std::string driver_version(void) {
    char line[512] = {0};
    FILE* f = fopen("/proc/driver/nvidia/version", "r");
    if (!f) return "unknown";
    bool got = fgets(line, sizeof line, f) != NULL;
    fclose(f);
    if (!got) return "unknown";
    for (char* w = strtok(line, " \t\n"); w; w = strtok(NULL, " \t\n"))
        if (strchr(w, '.') && strspn(w, "0123456789.") == strlen(w)) return w;
    return "unknown";
}

int main(int argc, char** argv) {
    const char* only = argc > 1 ? argv[1] : NULL; /* one model: 120M or 12M */
    if (argc > 2 || (only && strcmp(only, "120M") && strcmp(only, "12M"))) {
        fprintf(stderr, "error: usage: %s [120M|12M]\n", argv[0]);
        return 2;
    }
    CUDA_CHECK(cudaStreamCreate(&g_stream));
    void* ws;
    CUDA_CHECK(cudaMalloc(&ws, CUBLAS_WORKSPACE_BYTES));
    cublas_init(ws, CUBLAS_WORKSPACE_BYTES);
    g_lt_watch = watch;

    int dev, rt;
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    CUDA_CHECK(cudaRuntimeGetVersion(&rt));
    char date[32];
    time_t now = time(NULL);
    strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
    printf("LTPROBE-ENV gpu=\"%s\" cc=%d.%d sms=%d driver=%s cublaslt=%zu cudart=%d date=%s workspace=%zu offers=%d "
           "reps=%d rounds=%d\n",
           prop.name, prop.major, prop.minor, prop.multiProcessorCount, driver_version().c_str(), cublasLtGetVersion(),
           rt, date, (size_t)CUBLAS_WORKSPACE_BYTES, PROBE_OFFERS, PROBE_REPS, PROBE_ROUNDS);
    if (!only || !strcmp(only, "120M")) {
        bf16_step("120M", 12, 8 * 1024, 768, 3072, 50259, 50304);
        fp8_step("120M", 12, 8 * 1024, 768, 3072);
    }
    if (!only || !strcmp(only, "12M")) {
        bf16_step("12M", 6, 8 * 512, 192, 768, 50259, 50304);
        fp8_step("12M", 6, 8 * 512, 192, 768);
    }
    cublas_shutdown();
    fp8_plans_clear();
    CUDA_CHECK(cudaFree(ws));
    return 0;
}
