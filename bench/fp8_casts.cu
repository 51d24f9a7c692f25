/* fp8_casts.cu: the time of precision fp8's casts and of the kernels with the amax fused
 * (docs/DESIGN.md §18) at the activation shapes of ANDREA-120M (B·T = 8192, d 768, d_ff 3072) and
 * ANDREA-12M (B·T = 4096, d 192, d_ff 768), bf16, on this GPU: median µs of 20 launches
 * (kernel_timer.cuh) and the bytes each moves over that time, against the GPU's memory bandwidth.
 * Also the FP8 classifier's passes at the vocabulary (bench_classifier). A measurement tool, not
 * part of the engine or the tests.
 *
 *   build: nvcc -O3 -std=c++17 -arch=native -o build/fp8_casts bench/fp8_casts.cu -lcublas -lcublasLt
 *   run:   build/fp8_casts        (one line per kernel: model, kernel, shape, µs, GB/s)
 *
 * The inputs are a constant bf16 pattern: the kernels' times do not depend on the values. */
#include "../microgpt/cuda/fp8.cuh"
#include "../microgpt/cuda/layernorm.cuh"
#include "../microgpt/cuda/mlp.cuh"
#include "kernel_timer.cuh"

static std::vector<void*> g_buffers; /* freed after each model */

static void* dmalloc(size_t bytes) {
    void* p;
    CUDA_CHECK(cudaMalloc(&p, bytes));
    CUDA_CHECK(cudaMemset(p, 0x3C, bytes)); /* bf16 0x3C3C ~ 0.0115, fp32 0x3C3C3C3C ~ 0.0115 */
    g_buffers.push_back(p);
    return p;
}

static void row(const char* model, const char* kernel, const char* shape, float us, double bytes) {
    printf("%-5s %-34s %-18s %9.1f us %8.0f GB/s\n", model, kernel, shape, us, bytes / (us * 1e3));
}

/* The FP8 classifier's extra passes (docs/DESIGN.md §18) at the models' vocabulary, one logits chunk
 * as the engine sizes it: wte's cast (once a step) and LNf output's (once a forward); the loss rows
 * writing dlogits' codes and their transpose, beside the bf16 classifier's loss rows. At both
 * models' shapes, though the engines run it from d_model 512 only (fp8_classifier_pays): the
 * passes over the logits cost the same at either d_model, the products' saving grows with it. */
static void bench_classifier(const char* model, int N, int C) {
    const int V = 50257, Vp = 50304, n = loss_chunk_rows(Vp, sizeof(bf16), N);
    size_t nv = (size_t)n * Vp, wc = (size_t)Vp * C, nc = (size_t)N * C;
    bf16 *logits = (bf16*)dmalloc(nv * 2), *lnf = (bf16*)dmalloc(nc * 2);
    float *w = (float*)dmalloc(wc * 4), *losses = (float*)dmalloc(n * 4), *lse = (float*)dmalloc(n * 4);
    float* dscale = (float*)dmalloc(4);
    int* targets = (int*)dmalloc((size_t)n * 4);
    unsigned* salt = (unsigned*)dmalloc(4);
    fp8 *q_n = (fp8*)dmalloc(nv > wc ? nv : wc), *q_t = (fp8*)dmalloc(nv > wc ? nv : wc);
    Fp8Scale* sc = (Fp8Scale*)dmalloc(sizeof(Fp8Scale));
    float ds = 1.0f / N;
    CUDA_CHECK(cudaMemset(targets, 0, (size_t)n * 4));
    CUDA_CHECK(cudaMemset(salt, 0, 4));
    CUDA_CHECK(cudaMemcpy(dscale, &ds, 4, cudaMemcpyHostToDevice));
    char sh_v[32], sh_w[32], sh_x[32];
    snprintf(sh_v, sizeof sh_v, "%dx%d", n, Vp);
    snprintf(sh_w, sizeof sh_w, "%dx%d", Vp, C);
    snprintf(sh_x, sizeof sh_x, "%dx%d", N, C);
    row(model, "cls: wte amax + cast e4m3 n+t", sh_w, time_median_us([&] {
            fp8_reduce_amax(sc, w, wc);
            fp8_cast(q_n, q_t, sc, (const float*)w, 1, Vp, C, FP8_E4M3);
        }), 10.0 * wc);
    row(model, "cls: LNf out cast n+t (chunked)", sh_x,
        time_median_us([&] { fp8_cast_classifier_input(q_n, q_t, sc, (const bf16*)lnf, N, C, n); }), 4.0 * nc);
    row(model, "bf16 loss_rows (bf16 dlogits)", sh_v,
        time_median_us([&] { loss_rows(losses, lse, logits, targets, n, V, Vp, dscale); }), 4.0 * nv);
    row(model, "cls: loss_rows writing codes", sh_v, time_median_us([&] {
            loss_rows(losses, lse, logits, targets, n, V, Vp, dscale, LossStoreFp8{q_n, sc, Vp, salt, 0});
        }), 3.0 * nv);
    row(model, "cls: fp8_transpose dlogits", sh_v, time_median_us([&] { fp8_transpose(q_t, q_n, n, Vp); }),
        2.0 * nv);
}

static void bench(const char* model, int N, int C, int F, int L) {
    size_t nc = (size_t)N * C, nf = (size_t)N * F;
    bf16 *x = (bf16*)dmalloc(3 * nc * 2), *out = (bf16*)dmalloc(3 * nc * 2), *h = (bf16*)dmalloc(nf * 2);
    bf16* hg = (bf16*)dmalloc(nf * 2);
    float *gamma = (float*)dmalloc(C * 4), *beta = (float*)dmalloc(C * 4), *mean = (float*)dmalloc(N * 4);
    float *rstd = (float*)dmalloc(N * 4), *dg = (float*)dmalloc(C * 4), *db = (float*)dmalloc(C * 4);
    float* scratch = (float*)dmalloc(layernorm_scratch_floats(C) * 4);
    fp8 *q_n = (fp8*)dmalloc(nf > 3 * nc ? nf : 3 * nc), *q_t = (fp8*)dmalloc(nf > 3 * nc ? nf : 3 * nc);
    Fp8Scale* sc = (Fp8Scale*)dmalloc(4 * L * sizeof(Fp8Scale));
    char sh_nc[32], sh_nf[32], sh_3nc[32];
    snprintf(sh_nc, sizeof sh_nc, "%dx%d", N, C);
    snprintf(sh_nf, sizeof sh_nf, "%dx%d", N, F);
    snprintf(sh_3nc, sizeof sh_3nc, "3x%dx%d", N, C);
    unsigned* amax = &sc->amax_bits;

    row(model, "layernorm_fwd", sh_nc, time_median_us([&] { layernorm_fwd(out, mean, rstd, x, gamma, beta, N, C); }),
        4.0 * nc);
    row(model, "layernorm_fwd + amax", sh_nc,
        time_median_us([&] { layernorm_fwd(out, mean, rstd, x, gamma, beta, N, C, amax); }), 4.0 * nc);
    row(model, "layernorm_bwd", sh_nc,
        time_median_us([&] { layernorm_bwd(out, dg, db, x + nc, x, gamma, mean, rstd, N, C, scratch, 0.0f); }),
        8.0 * nc);
    row(model, "layernorm_bwd + amax", sh_nc, time_median_us([&] {
            layernorm_bwd(out, dg, db, x + nc, x, gamma, mean, rstd, N, C, scratch, 0.0f, amax);
        }), 8.0 * nc);
    row(model, "gelu_fwd", sh_nf, time_median_us([&] { gelu_fwd(hg, h, nf); }), 4.0 * nf);
    row(model, "gelu_fwd + amax", sh_nf, time_median_us([&] { gelu_fwd<bf16, FP8_GELU_TANH>(hg, h, nf, amax); }), 4.0 * nf);
    row(model, "gelu_bwd_inplace", sh_nf, time_median_us([&] { gelu_bwd_inplace(hg, h, nf); }), 6.0 * nf);
    row(model, "gelu_bwd_inplace + amax", sh_nf, time_median_us([&] {
        gelu_bwd_inplace<bf16, FP8_GELU_TANH>(hg, h, nf, amax);
    }),
        6.0 * nf);
    row(model, "fp8_reduce_amax", sh_nc, time_median_us([&] { fp8_reduce_amax(sc, x, nc); }), 2.0 * nc);
    row(model, "fp8_reduce_amax", sh_3nc, time_median_us([&] { fp8_reduce_amax(sc, x, 3 * nc); }), 6.0 * nc);
    row(model, "fp8_cast e4m3 n+t", sh_nc,
        time_median_us([&] { fp8_cast(q_n, q_t, sc, x, 1, N, C, FP8_E4M3); }), 4.0 * nc);
    row(model, "fp8_cast e4m3 n+t", sh_nf,
        time_median_us([&] { fp8_cast(q_n, q_t, sc, hg, 1, N, F, FP8_E4M3); }), 4.0 * nf);
    row(model, "fp8_cast grad n+t", sh_3nc,
        time_median_us([&] { fp8_cast(q_n, q_t, sc, x, 3, N, C, FP8_GRAD_FMT); }), 12.0 * nc);
    /* delayed scaling's fused producers, at a history's scale (2^10: values ~0.0115 stay in range) */
    Fp8History hist_host = {{10}, 1};
    Fp8History* hist = (Fp8History*)dmalloc(sizeof hist_host);
    CUDA_CHECK(cudaMemcpy(hist, &hist_host, sizeof hist_host, cudaMemcpyHostToDevice));
    row(model, "fp8_cast_gelu n+t (delayed)", sh_nf,
        time_median_us([&] { fp8_cast_gelu(q_n, q_t, sc, h, N, F, hist); }), 4.0 * nf);
    row(model, "fp8_cast_dgelu n+t (delayed)", sh_nf,
        time_median_us([&] { fp8_cast_dgelu(q_n, q_t, sc, hg, h, N, F, FP8_GRAD_FMT, hist); }), 6.0 * nf);
    row(model, "layernorm_fwd_fp8 n+t (delayed)", sh_nc, time_median_us([&] {
            layernorm_fwd_fp8(q_n, q_t, sc, hist, mean, rstd, x, gamma, beta, N, C);
        }), 3.0 * nc);
    row(model, "layernorm_bwd_fp8 n+t (delayed)", sh_nc, time_median_us([&] {
            layernorm_bwd_fp8(q_n, q_t, sc, hist, FP8_GRAD_FMT, out, dg, db, x + nc, x, gamma, mean, rstd, N, C,
                              scratch, 0.0f);
        }), 10.0 * nc);
    row(model, "zero_scales (one memset)", "", time_median_us([&] { fp8_zero_scales(sc, 4 * L); }), 0.0);

    /* the weights of L layers (fp32 masters) as the engine lists them: amax, then both layouts */
    size_t per_layer = 4 * (size_t)C * C + 2 * (size_t)C * F;
    float* w = (float*)dmalloc(per_layer * L * 4);
    fp8 *w_dx = (fp8*)dmalloc(per_layer * L), *w_fwd = (fp8*)dmalloc(per_layer * L);
    std::vector<Fp8CastJob<float>> jobs;
    for (int l = 0; l < L; l++) {
        size_t o = per_layer * l;
        const int batch[4] = {3, 1, 1, 1}, rows[4] = {C, C, C, F}, cols[4] = {C, C, F, C};
        for (int k = 0; k < 4; k++) {
            Fp8CastJob<float> j = {w + o, w_dx + o, w_fwd + o, sc + 4 * l + k, batch[k], rows[k], cols[k], FP8_E4M3, 0};
            jobs.push_back(j);
            o += (size_t)batch[k] * rows[k] * cols[k];
        }
    }
    Fp8CastJob<float>* dev = (Fp8CastJob<float>*)dmalloc(jobs.size() * sizeof(Fp8CastJob<float>));
    Fp8CastJobs<float> js = fp8_jobs_upload(jobs.data(), (int)jobs.size(), dev);
    char sh_w[32];
    snprintf(sh_w, sizeof sh_w, "%d layers", L);
    row(model, "fp8_quantize_jobs (weights)", sh_w, time_median_us([&] { fp8_quantize_jobs(js); }),
        (4.0 + 4.0 + 2.0) * per_layer * L);
    bench_classifier(model, N, C);
    CUDA_CHECK(cudaDeviceSynchronize());
    for (void* b : g_buffers) CUDA_CHECK(cudaFree(b));
    g_buffers.clear();
}

int main(void) {
    cudaDeviceProp p;
    CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
    printf("%s: bytes moved / median time; the GPU's memory bandwidth is the bound\n", p.name);
    bench("120M", 8192, 768, 3072, 12);
    bench("12M", 4096, 192, 768, 6);
    return 0;
}
