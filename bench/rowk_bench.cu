/* rowk_bench.cu: the row and element-wise kernels of a training step at the shapes of ANDREA-120M
 * and ANDREA-12M (bf16), on random inputs, each timed alone as the engine launches it: LayerNorm
 * forward, LayerNorm backward (dx and the dgamma/dbeta partials, then their final sum), both also
 * as precision fp8 runs them (taking their output's amax), the loss rows of a step (softmax, loss
 * and dlogits in place, chunk by chunk as the engine's logits chunks), AdamW over every
 * parameter, the gradient norm (partials and final sum), and the embedding backward (on uniform
 * and on text-like tokens). A measurement tool for changes to microgpt/cuda/layernorm.cuh,
 * loss.cuh, optimizer.cuh and embed.cuh; not part of the engine or the tests
 * (tests/kernel_check.cu checks the kernels' values).
 *
 *   build:   make rowk-bench       (build/rowk_bench, with the engine's flags)
 *   run:     build/rowk_bench > after.log
 *   compare: python3 bench/rowk_summary.py before=before.log after=after.log   (a run per build,
 *            e.g. one per commit: the table of each kernel's change, bench/rowk_summary.py)
 *   a variant: make -B VARIANT_SUFFIX=_NAME KERNEL_VARIANTS="-DMACRO=1" build/rowk_bench_NAME, one
 *            build and run each, compared as above
 *
 * One line per kernel and model: the median time of 20 launches (kernel_timer), the bytes a launch must move at least (each input read once, each output written once; the
 * dgamma/dbeta and norm partials are not counted) over that time, a hash of the outputs of one
 * launch from the same inputs, so that the runs of two builds show whether their results are
 * the same bits, and the time it takes in one micro-batch's step (25 LayerNorm launches each way
 * at 120M, 13 at 12M; the norm and AdamW once per update). Inputs come from a fixed counter-based
 * hash, the same in every build. */
#include "../microgpt/cuda/embed.cuh"
#include "../microgpt/cuda/layernorm.cuh"
#include "../microgpt/cuda/loss.cuh"
#include "../microgpt/cuda/optimizer.cuh"
#include "kernel_timer.cuh"

#define REPS 20

struct Model {
    const char* name;
    int N, C, L, T, F, V, Vp;
};

/* Parameters of the layout (docs/DESIGN.md §2: tied embedding, position embedding, per layer
 * W_Q, W_K, W_V, W_O, W_1, W_2 and two LayerNorms; the final LayerNorm). */
static size_t n_params(const Model& m) {
    size_t C = m.C, layer = 4 * C * C + 2 * C * m.F + 4 * C;
    return (size_t)m.Vp * C + (size_t)m.T * C + m.L * layer + 2 * C;
}

/* x[i] = offset + scale * u, u uniform in [-1, 1) from a hash of (seed, i). */
template <typename T>
__global__ void k_fill(T* x, size_t n, uint64_t seed, float scale, float offset) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t z = seed * 0x9E3779B97F4A7C15ull + i;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        x[i] = from_f<T>(offset + scale * ((float)(z >> 40) * (2.0f / 16777216.0f) - 1.0f));
    }
}

static uint64_t g_seed = 1;

template <typename T> static T* random_buffer(size_t n, float scale, float offset = 0.0f) {
    T* p;
    CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
    k_fill<T><<<elementwise_grid(n, 256), 256, 0, g_stream>>>(p, n, g_seed++, scale, offset);
    LAUNCH_CHECK();
    return p;
}

template <typename T> static T* device_buffer(size_t n) {
    T* p;
    CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
    return p;
}

/* FNV-1a over the bytes of device buffers, folded in the order given. */
struct Hash {
    uint64_t h = 1469598103934665603ull;
    void add(const void* dev, size_t bytes) {
        std::vector<unsigned char> b(bytes);
        CUDA_CHECK(cudaDeviceSynchronize());
        CUDA_CHECK(cudaMemcpy(b.data(), dev, bytes, cudaMemcpyDeviceToHost));
        for (unsigned char c : b) h = (h ^ c) * 1099511628211ull;
    }
};

/* One line: the time of one launch (sequence), its rate, its bits, and its time in a training step,
 * where it runs `per_step` times (the step of one micro-batch). */
static void report(const Model& m, const char* kernel, float us, double bytes, const Hash& bits, int per_step) {
    printf("rowk  %-5s %-14s %9.1f us %8.0f GB/s  bits %016llx  step %9.1f us\n", m.name, kernel, us,
           bytes / (us * 1e-6) / 1e9, (unsigned long long)bits.h, us * per_step);
    fflush(stdout);
}

/* LayerNorm launches a step: two a layer and the final one, each way */
template <typename T> static void bench_layernorm(const Model& m) {
    int per_step = 2 * m.L + 1;
    size_t nc = (size_t)m.N * m.C, es = sizeof(T);
    T *x = random_buffer<T>(nc, 2.0f, 0.3f), *out = device_buffer<T>(nc), *dout = random_buffer<T>(nc, 1.0f);
    T* dx = device_buffer<T>(nc);
    float *gamma = random_buffer<float>(m.C, 0.2f, 1.0f), *beta = random_buffer<float>(m.C, 0.2f);
    float *mean = device_buffer<float>(m.N), *rstd = device_buffer<float>(m.N);
    float *dgamma = device_buffer<float>(m.C), *dbeta = device_buffer<float>(m.C);
    float* scratch = device_buffer<float>(layernorm_scratch_floats(m.C));
    unsigned* amax = device_buffer<unsigned>(1);

    auto fwd = [&]() { layernorm_fwd<T>(out, mean, rstd, x, gamma, beta, m.N, m.C); };
    fwd();
    Hash hf;
    hf.add(out, nc * es);
    hf.add(mean, m.N * 4);
    hf.add(rstd, m.N * 4);
    report(m, "ln_fwd", time_median_us(fwd, REPS), 2.0 * nc * es + 8.0 * m.N, hf, per_step);
    /* precision fp8's form: the same launch also takes the outputs' amax */
    CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(unsigned), g_stream));
    auto fwd_amax = [&]() { layernorm_fwd<T>(out, mean, rstd, x, gamma, beta, m.N, m.C, amax); };
    fwd_amax();
    Hash hfa;
    hfa.add(amax, sizeof(unsigned));
    report(m, "ln_fwd_amax", time_median_us(fwd_amax, REPS), 2.0 * nc * es + 8.0 * m.N, hfa, per_step);

    /* dx accumulates (+=) from zero for the hash; later launches keep adding, which costs the same */
    CUDA_CHECK(cudaMemsetAsync(dx, 0, nc * es, g_stream));
    auto bwd = [&]() { layernorm_bwd<T>(dx, dgamma, dbeta, dout, x, gamma, mean, rstd, m.N, m.C, scratch, 0.0f); };
    bwd();
    Hash hdx, hdg;
    hdx.add(dx, nc * es);
    hdg.add(dgamma, m.C * 4);
    hdg.add(dbeta, m.C * 4);
    float us = time_median_us(bwd, REPS);
    double bytes = 4.0 * nc * es + 8.0 * m.N;
    report(m, "ln_bwd", us, bytes, hdx, per_step);
    report(m, "ln_bwd_dgamma", us, bytes, hdg, 0); /* the same launches; their dgamma/dbeta bits */
    CUDA_CHECK(cudaMemsetAsync(dx, 0, nc * es, g_stream));
    CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(unsigned), g_stream));
    auto bwd_amax = [&]() {
        layernorm_bwd<T>(dx, dgamma, dbeta, dout, x, gamma, mean, rstd, m.N, m.C, scratch, 0.0f, amax);
    };
    bwd_amax();
    Hash hba;
    hba.add(amax, sizeof(unsigned));
    report(m, "ln_bwd_amax", time_median_us(bwd_amax, REPS), bytes, hba, per_step);
    for (void* p : {(void*)x, (void*)out, (void*)dout, (void*)dx, (void*)gamma, (void*)beta, (void*)mean,
                    (void*)rstd, (void*)dgamma, (void*)dbeta, (void*)scratch, (void*)amax})
        CUDA_CHECK(cudaFree(p));
}

/* The loss rows of a whole step: the N rows in the engine's chunks (loss.cuh's loss_chunk_rows),
 * each chunk's logits overwritten by their gradient, as in the engine's training step (which runs
 * the classifier products between the chunks; here one buffer serves every chunk). Later launches
 * run on the gradients the previous one left: the same work, whatever the values. */
template <typename T> static void bench_loss(const Model& m) {
    int chunk = loss_chunk_rows(m.Vp, sizeof(T), m.N);
    size_t rows = (size_t)chunk * m.Vp;
    T* logits = random_buffer<T>(rows, 4.0f);
    int* targets = device_buffer<int>(m.N);
    std::vector<int> t(m.N);
    for (int i = 0; i < m.N; i++) t[i] = (int)((i * 2654435761u) % (unsigned)m.V);
    CUDA_CHECK(cudaMemcpy(targets, t.data(), m.N * sizeof(int), cudaMemcpyHostToDevice));
    float *losses = device_buffer<float>(m.N), *lse = device_buffer<float>(m.N), *dscale = device_buffer<float>(1);
    float ds = 1.0f / m.N;
    CUDA_CHECK(cudaMemcpy(dscale, &ds, sizeof ds, cudaMemcpyHostToDevice));
    auto step = [&]() {
        for (int r0 = 0; r0 < m.N; r0 += chunk) {
            int n = m.N - r0 < chunk ? m.N - r0 : chunk;
            loss_rows<T>(losses + r0, lse + r0, logits, targets + r0, n, m.V, m.Vp, dscale);
        }
    };
    step();
    Hash h;
    h.add(losses, m.N * 4);
    h.add(lse, m.N * 4);
    h.add(logits, rows * sizeof(T)); /* the last chunk's dlogits (over the first chunk's, beyond its rows) */
    report(m, "loss_rows", time_median_us(step, REPS), 2.0 * m.N * m.Vp * sizeof(T), h, 1);
    for (void* p : {(void*)logits, (void*)targets, (void*)losses, (void*)lse, (void*)dscale})
        CUDA_CHECK(cudaFree(p));
}

/* The embedding backward (dwte += and dwpe =) of a step after its sort, on tokens drawn uniformly
 * from the vocabulary (zipf 0: the timing runs' random shards) or log-uniformly (zipf 1: P(token k)
 * ~ 1/(k+1), as word frequencies in text go: a few tokens hold hundreds of positions; zipf 2: and a
 * quarter of the positions one token, as a space is a quarter of the benchmark's text); and the sort
 * alone, which the engine runs beside the forward. Bytes: dout read once, each touched dwte row read
 * and written, dwpe written. Later launches keep adding into dwte: the same work. */
template <typename T> static void bench_embed_bwd(const Model& m, int zipf) {
    std::vector<int> t(m.N);
    std::vector<char> seen(m.V, 0);
    size_t distinct = 0;
    for (int i = 0; i < m.N; i++) {
        uint64_t z = (uint64_t)(i + 1) * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 31)) * 0xBF58476D1CE4E5B9ull;
        double u = (double)(z >> 11) / 9007199254740992.0; /* [0, 1) */
        t[i] = zipf ? (int)(exp(u * log((double)m.V))) - 1 : (int)(u * m.V);
        if (zipf == 2 && (z & 3) == 0) t[i] = 220; /* a quarter of the positions one token, as a space in text */
        distinct += !seen[t[i]];
        seen[t[i]] = 1;
    }
    int* tokens = device_buffer<int>(m.N);
    CUDA_CHECK(cudaMemcpy(tokens, t.data(), m.N * sizeof(int), cudaMemcpyHostToDevice));
    size_t nc = (size_t)m.N * m.C;
    T* dout = random_buffer<T>(nc, 1.0f);
    float *dwte = device_buffer<float>((size_t)m.Vp * m.C), *dwpe = device_buffer<float>((size_t)m.T * m.C);
    CUDA_CHECK(cudaMemsetAsync(dwte, 0, (size_t)m.Vp * m.C * 4, g_stream));
    char* scratch = device_buffer<char>(embed_bwd_scratch_bytes(m.V, m.N, m.C));
    int B = m.N / m.T;
    auto sort = [&]() { embed_bwd_sort(scratch, tokens, m.V, m.N, m.C); };
    auto bwd = [&]() { embed_bwd_sorted<T>(dwte, dwpe, dout, scratch, B, m.T, m.C, 0.0f); };
    sort();
    Hash hs;
    EmbedScratch sorted = embed_scratch(scratch, m.N, m.C);
    hs.add(sorted.sorted_tok, (size_t)m.N * sizeof(int));
    hs.add(sorted.sorted_pos, (size_t)m.N * sizeof(int));
    bwd();
    Hash h;
    h.add(dwte, (size_t)m.Vp * m.C * 4);
    h.add(dwpe, (size_t)m.T * m.C * 4);
    double bytes = (double)nc * sizeof(T) + 8.0 * distinct * m.C + 4.0 * m.T * m.C;
    if (!zipf) report(m, "embed_sort", time_median_us(sort, REPS), 8.0 * m.N, hs, 1);
    report(m, zipf == 2 ? "embed_bwd_text" : zipf ? "embed_bwd_zipf" : "embed_bwd", time_median_us(bwd, REPS), bytes, h, 1);
    for (void* p : {(void*)tokens, (void*)dout, (void*)dwte, (void*)dwpe, (void*)scratch}) CUDA_CHECK(cudaFree(p));
}

/* The update over every parameter: the norm (partials, final), then AdamW with the 16-bit copy. */
template <typename T> static void bench_update(const Model& m) {
    size_t P = n_params(m);
    float *p = random_buffer<float>(P, 0.05f), *g = random_buffer<float>(P, 1e-3f);
    float *mo = random_buffer<float>(P, 1e-4f), *v = random_buffer<float>(P, 1e-8f, 1e-8f);
    T* low = device_buffer<T>(P);
    unsigned* bits = device_buffer<unsigned>(adamw_decay_words(P));
    CUDA_CHECK(cudaMemset(bits, 0x55, adamw_decay_words(P) * sizeof(unsigned)));
    float *partial = device_buffer<float>(NORM_BLOCKS), *norm = device_buffer<float>(1);
    float* unscale = device_buffer<float>(1);
    float one = 1.0f;
    CUDA_CHECK(cudaMemcpy(unscale, &one, sizeof one, cudaMemcpyHostToDevice));
    UpdateCtl ctl = update_ctl(1e-4f, 10, 0.9f, 0.95f, 1.0, 1.0f, 0), *d_ctl = device_buffer<UpdateCtl>(1);
    CUDA_CHECK(cudaMemcpy(d_ctl, &ctl, sizeof ctl, cudaMemcpyHostToDevice));

    auto norm_launches = [&]() {
        grad_norm_partial(partial, g, P, unscale);
        grad_norm_final(norm, partial);
    };
    norm_launches();
    Hash hn;
    hn.add(norm, 4);
    report(m, "grad_norm", time_median_us(norm_launches, REPS), 4.0 * P, hn, 1);

    /* the moments move a little every launch; the work does not depend on their values */
    auto update = [&]() { adamw<T>(p, g, mo, v, low, P, 0.9f, 0.95f, 1e-8f, 0.1f, bits, d_ctl, norm); };
    update();
    Hash ha;
    ha.add(p, P * 4);
    ha.add(low, P * sizeof(T));
    report(m, "adamw", time_median_us(update, REPS), (4.0 + 3 * 8.0 + sizeof(T)) * P, ha, 1);
    for (void* q : {(void*)p, (void*)g, (void*)mo, (void*)v, (void*)low, (void*)bits, (void*)partial, (void*)norm,
                    (void*)unscale, (void*)d_ctl})
        CUDA_CHECK(cudaFree(q));
}

int main() {
    CUDA_CHECK(cudaStreamCreate(&g_stream));
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    printf("rowk_bench: %s, median of %d launches\n", prop.name, REPS);
    const Model models[] = {
        {"120M", 8192, 768, 12, 1024, 3072, 50259, 50304},
        {"12M", 4096, 192, 6, 512, 768, 50259, 50304},
    };
    for (const Model& m : models) {
        bench_layernorm<bf16>(m);
        bench_loss<bf16>(m);
        bench_update<bf16>(m);
        bench_embed_bwd<bf16>(m, 0);
        bench_embed_bwd<bf16>(m, 1);
        bench_embed_bwd<bf16>(m, 2);
    }
    CUDA_CHECK(cudaStreamDestroy(g_stream));
    return 0;
}
