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
 * The inputs are a constant bf16 pattern: the kernels' times do not depend on the values.
 *
 * Built with -DFP8_CAST_WIDE=1 (the wide cast kernels, fp8.cuh), the casts above take the wide
 * kernels, and a last section times the present packed kernels (k_fp8_cast, k_fp8_cast_jobs) and
 * the wide ones side by side, queued back to back as in a captured step, on random inputs, and
 * checks that both write the same bytes (codes of both layouts, amax, scale, descale):
 *
 *   nvcc -O3 -std=c++17 -arch=native -DFP8_CAST_WIDE=1 -o build/fp8_casts_cw bench/fp8_casts.cu -lcublas -lcublasLt
 *
 * Built with -DFP8_LN_WIDE=1 (the wide fused LayerNorm kernels, fp8.cuh), a section times the
 * present fused LayerNorm forward and backward (k_layernorm_fwd_fp8, k_layernorm_bwd_fp8, without
 * the final dgamma/dbeta sum, which is the same kernel in both) against the wide ones at both models'
 * shapes, queued, on random inputs, and checks that both write the same bytes (codes of both
 * layouts, amax, scale, descale, mean and rstd; dx and the chunk partials); exit 1 if any differ:
 *
 *   nvcc -O3 -std=c++17 -arch=native -DFP8_LN_WIDE=1 -o build/fp8_casts_lw bench/fp8_casts.cu -lcublas -lcublasLt
 *
 * Built with -DFP8_TRANSPOSE_WIDE=1 (the wide transpose, fp8.cuh), fp8_transpose takes
 * k_fp8_transpose_wide, and a last section times the present k_fp8_transpose and the wide one
 * (its tiles down the columns of tiles, as fp8_transpose launches it, and across the rows, as
 * k_fp8_transpose) side by side, queued, on random codes at the FP8 classifier's dlogits shapes,
 * and checks that all write the same bytes; the exit status is 1 if any differ:
 *
 *   nvcc -O3 -std=c++17 -arch=native -DFP8_TRANSPOSE_WIDE=1 -o build/fp8_casts_tw bench/fp8_casts.cu -lcublas -lcublasLt
 *
 * Built with -DFP8_LOSS_PACKED=1 (the FP8 classifier's loss rows with the packed store, loss.cuh and
 * fp8.cuh), a last section times the loss rows with the present store (LossStoreFp8) and the packed
 * one (LossStoreFp8Packed) side by side, queued, on random logits at the logits chunks' shapes, and
 * checks that both write the same bytes (codes, scale, row losses, lse); exit 1 if any differ:
 *
 *   nvcc -O3 -std=c++17 -arch=native -DFP8_LOSS_PACKED=1 -o build/fp8_casts_lp bench/fp8_casts.cu -lcublas -lcublasLt */
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
    fp8 *q_n = (fp8*)dmalloc(nv > wc ? nv : wc), *q_t = (fp8*)dmalloc(nv > wc ? nv : wc);
    Fp8Scale* sc = (Fp8Scale*)dmalloc(sizeof(Fp8Scale));
    float ds = 1.0f / N;
    CUDA_CHECK(cudaMemset(targets, 0, (size_t)n * 4));
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
            loss_rows(losses, lse, logits, targets, n, V, Vp, dscale, LossStoreFp8{q_n, sc, Vp});
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
    row(model, "gelu_fwd + amax", sh_nf, time_median_us([&] { gelu_fwd(hg, h, nf, amax); }), 4.0 * nf);
    row(model, "gelu_bwd_inplace", sh_nf, time_median_us([&] { gelu_bwd_inplace(hg, h, nf); }), 6.0 * nf);
    row(model, "gelu_bwd_inplace + amax", sh_nf, time_median_us([&] { gelu_bwd_inplace(hg, h, nf, amax); }),
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

#if FP8_CAST_WIDE || FP8_TRANSPOSE_WIDE || FP8_LN_WIDE || FP8_LOSS_PACKED
/* Random values of mixed magnitudes (2^-6 to 2^5) and signs: the byte comparison sees every code. */
template <typename T> __global__ void k_fill_random(T* x, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned u = (unsigned)i * 2654435761u ^ seed;
        u ^= u >> 15, u *= 2246822519u, u ^= u >> 13, u *= 3266489917u, u ^= u >> 16;
        float v = ((float)(u & 0xFFFF) / 32768.0f - 1.0f) * exp2f((float)((int)(u >> 16) % 12 - 6));
        x[i] = from_f<T>(v);
    }
}

template <typename T> static T* random_buffer(size_t n, unsigned seed) {
    T* x = (T*)dmalloc(n * sizeof(T));
    k_fill_random<T><<<1024, 256, 0, g_stream>>>(x, n, seed);
    CUDA_CHECK(cudaGetLastError());
    return x;
}
#endif

#if FP8_CAST_WIDE || FP8_LN_WIDE || FP8_LOSS_PACKED
/* Whether `bytes` bytes at a and at b (device memory) are the same, after all queued work. */
static bool same_device_bytes(const void* a, const void* b, size_t bytes) {
    std::vector<unsigned char> ha(bytes), hb(bytes);
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(ha.data(), a, bytes, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(hb.data(), b, bytes, cudaMemcpyDeviceToHost));
    return !memcmp(ha.data(), hb.data(), bytes);
}
#endif

#if FP8_CAST_WIDE
/* One cast's outputs: the codes of both layouts and its scale. */
struct CastOut {
    fp8 *n, *t;
    Fp8Scale* sc;
    size_t bytes;
};

static CastOut cast_out(size_t bytes) {
    CastOut o = {(fp8*)dmalloc(bytes), (fp8*)dmalloc(bytes), (Fp8Scale*)dmalloc(64 * sizeof(Fp8Scale)), bytes};
    return o;
}

/* Poisoned codes, the scales' amax as `amax` holds it (a plain cast reads it; an epilogue's starts at 0). */
static void cast_out_reset(const CastOut& o, const Fp8Scale* amax, int scales) {
    CUDA_CHECK(cudaMemsetAsync(o.n, 0xAB, o.bytes, g_stream));
    CUDA_CHECK(cudaMemsetAsync(o.t, 0xAB, o.bytes, g_stream));
    CUDA_CHECK(cudaMemcpyAsync(o.sc, amax, scales * sizeof(Fp8Scale), cudaMemcpyDeviceToDevice, g_stream));
}

static bool same_bytes(const CastOut& a, const CastOut& b, int scales) {
    return same_device_bytes(a.n, b.n, a.bytes) && same_device_bytes(a.t, b.t, a.bytes) &&
           same_device_bytes(a.sc, b.sc, scales * sizeof(Fp8Scale));
}

static int g_wide_differs = 0;

/* The present packed kernel (k_fp8_cast) and the wide one (fp8_cast_launch) on job j: the byte
 * check, then both times and the speed-up. `amax` holds the scales' amax the cast starts from. */
template <typename T, int EPI>
static void compare_cast(const char* model, const char* kernel, const char* shape, Fp8CastJob<T> j,
                         const Fp8Scale* amax, double bytes) {
    size_t codes = (size_t)j.batch * j.R * j.Cc;
    CastOut present = cast_out(codes), wide = cast_out(codes);
    auto launch_present = [&](const CastOut& o) {
        Fp8CastJob<T> k = j;
        k.out_n = o.n, k.out_t = o.t, k.sc = o.sc;
        launch_kernel(k_fp8_cast<T, true, EPI>, fp8_cast_tiles(k.batch, k.R, k.Cc), FP8_CAST_THREADS, k);
    };
    auto launch_wide = [&](const CastOut& o) {
        Fp8CastJob<T> k = j;
        k.out_n = o.n, k.out_t = o.t, k.sc = o.sc;
        fp8_cast_launch<T, EPI>(k);
    };
    if (!fp8_cast_packable(j)) {
        fprintf(stderr, "error: %s %s is not packable\n", kernel, shape);
        exit(1);
    }
    cast_out_reset(present, amax, 1);
    cast_out_reset(wide, amax, 1);
    launch_present(present);
    launch_wide(wide);
    bool same = same_bytes(present, wide, 1);
    g_wide_differs += !same;
    float t0 = time_median_queued_us([&] { launch_present(present); });
    float t1 = time_median_queued_us([&] { launch_wide(wide); });
    printf("%-5s %-28s %-14s present %7.1f us %5.0f GB/s  wide %7.1f us %5.0f GB/s  x%.2f  %s\n", model, kernel,
           shape, t0, bytes / (t0 * 1e3), t1, bytes / (t1 * 1e3), t0 / t1, same ? "same bytes" : "BYTES DIFFER");
}

/* The weights' list (as bench's) on the present k_fp8_cast_jobs and the wide one (fp8_quantize_jobs). */
static void compare_jobs(const char* model, int C, int F, int L, const Fp8Scale* amax) {
    size_t per_layer = 4 * (size_t)C * C + 2 * (size_t)C * F;
    float* w = random_buffer<float>(per_layer * L, 7);
    CastOut present = cast_out(per_layer * L), wide = cast_out(per_layer * L);
    std::vector<Fp8CastJob<float>> jp, jw;
    for (int l = 0; l < L; l++) {
        size_t o = per_layer * l;
        const int batch[4] = {3, 1, 1, 1}, rows[4] = {C, C, C, F}, cols[4] = {C, C, F, C};
        for (int k = 0; k < 4; k++) {
            Fp8CastJob<float> j = {w + o, present.n + o, present.t + o, present.sc + 4 * l + k, batch[k], rows[k],
                                   cols[k], FP8_E4M3, 0};
            jp.push_back(j);
            j.out_n = wide.n + o, j.out_t = wide.t + o, j.sc = wide.sc + 4 * l + k;
            jw.push_back(j);
            o += (size_t)batch[k] * rows[k] * cols[k];
        }
    }
    unsigned tiles = 0;
    for (Fp8CastJob<float>& j : jp) { /* the present kernel's tiles */
        j.first_tile = tiles;
        tiles += fp8_cast_tiles(j.batch, j.R, j.Cc);
    }
    Fp8CastJob<float>* dev_p = (Fp8CastJob<float>*)dmalloc(jp.size() * sizeof(Fp8CastJob<float>));
    Fp8CastJob<float>* dev_w = (Fp8CastJob<float>*)dmalloc(jw.size() * sizeof(Fp8CastJob<float>));
    CUDA_CHECK(cudaMemcpy(dev_p, jp.data(), jp.size() * sizeof(Fp8CastJob<float>), cudaMemcpyHostToDevice));
    Fp8CastJobs<float> js = fp8_jobs_upload(jw.data(), (int)jw.size(), dev_w);
    int n_jobs = (int)jp.size();
    auto launch_present = [&] { launch_kernel(k_fp8_cast_jobs<float, true>, tiles, FP8_CAST_THREADS, dev_p, n_jobs); };
    auto launch_wide = [&] { launch_kernel(k_fp8_cast_jobs_wide<float>, js.tiles, FP8_CAST_THREADS, dev_w, n_jobs); };
    cast_out_reset(present, amax, 4 * L);
    cast_out_reset(wide, amax, 4 * L);
    launch_present();
    launch_wide();
    bool same = js.packed && same_bytes(present, wide, 4 * L);
    g_wide_differs += !same;
    float t0 = time_median_queued_us(launch_present), t1 = time_median_queued_us(launch_wide);
    double bytes = (4.0 + 2.0) * per_layer * L;
    char sh[32];
    snprintf(sh, sizeof sh, "%d layers", L);
    printf("%-5s %-28s %-14s present %7.1f us %5.0f GB/s  wide %7.1f us %5.0f GB/s  x%.2f  %s\n", model,
           "cast jobs (weights, no amax)", sh, t0, bytes / (t0 * 1e3), t1, bytes / (t1 * 1e3), t0 / t1,
           same ? "same bytes" : "BYTES DIFFER");
}

/* The present and the wide packed casts side by side at the model's shapes, and at one shape of
 * partial wide tiles (R = 1008 = 15.75 x 64, Cc = 776 = 6.06 x 128). */
static void compare_wide(const char* model, int N, int C, int F, int L) {
    size_t nf = (size_t)N * F, nc3 = 3 * (size_t)N * C;
    bf16 *x = random_buffer<bf16>(nf > nc3 ? nf : nc3, 1), *h = random_buffer<bf16>(nf, 2);
    /* a plain cast's amax: 2^5 bounds the inputs; the epilogues' start at 0 */
    Fp8Scale amax_host[64] = {};
    for (Fp8Scale& a : amax_host) a.amax_bits = fp8_float_bits(32.0f);
    Fp8Scale *amax = (Fp8Scale*)dmalloc(sizeof amax_host), *zero = (Fp8Scale*)dmalloc(sizeof amax_host);
    CUDA_CHECK(cudaMemcpy(amax, amax_host, sizeof amax_host, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(zero, 0, sizeof amax_host));
    Fp8History hist_host = {{3, 4, 2}, 3};
    Fp8History* hist = (Fp8History*)dmalloc(sizeof hist_host);
    CUDA_CHECK(cudaMemcpy(hist, &hist_host, sizeof hist_host, cudaMemcpyHostToDevice));
    const int shapes[][3] = {{1, N, F}, {1, N, C}, {3, N, C}, {1, 1008, 776}};
    for (const auto& s : shapes) {
        char sh[32];
        size_t n = (size_t)s[0] * s[1] * s[2];
        if (s[0] > 1) snprintf(sh, sizeof sh, "%dx%dx%d", s[0], s[1], s[2]);
        else snprintf(sh, sizeof sh, "%dx%d", s[1], s[2]);
        Fp8CastJob<bf16> j = {x, NULL, NULL, NULL, s[0], s[1], s[2], FP8_E4M3, 0, NULL, NULL};
        compare_cast<bf16, FP8_EPI_NONE>(model, "fp8_cast e4m3 n+t", sh, j, amax, 3.0 * n);
        if (s[0] > 1) {
            j.fmt = FP8_GRAD_FMT, j.hist = hist;
            compare_cast<bf16, FP8_EPI_NONE>(model, "fp8_cast grad n+t (delayed)", sh, j, amax, 3.0 * n);
            continue;
        }
        j.hist = hist;
        compare_cast<bf16, FP8_EPI_GELU>(model, "fp8_cast_gelu n+t", sh, j, zero, 3.0 * n);
        j.in = x, j.aux = h, j.fmt = FP8_GRAD_FMT;
        compare_cast<bf16, FP8_EPI_DGELU>(model, "fp8_cast_dgelu n+t", sh, j, zero, 5.0 * n);
    }
    compare_jobs(model, C, F, L, amax);
    CUDA_CHECK(cudaDeviceSynchronize());
    for (void* b : g_buffers) CUDA_CHECK(cudaFree(b));
    g_buffers.clear();
}
#endif

#if FP8_LN_WIDE
static int g_ln_differs = 0;

/* A fused LayerNorm's outputs, poisoned by ln_out_reset: codes of both layouts, the scale (amax
 * from 0), and `f` floats (mean and rstd, or the chunk partials) and `t` bytes of T (the
 * backward's dx, reset to `t_init`). */
struct LnOut {
    fp8 *n, *t;
    Fp8Scale* sc;
    float* f;
    void* dx;
    size_t codes, floats, dx_bytes;
};

static LnOut ln_out(size_t codes, size_t floats, size_t dx_bytes) {
    LnOut o = {(fp8*)dmalloc(codes), (fp8*)dmalloc(codes), (Fp8Scale*)dmalloc(sizeof(Fp8Scale)),
               (float*)dmalloc(floats * 4), dx_bytes ? dmalloc(dx_bytes) : NULL, codes, floats, dx_bytes};
    return o;
}

static void ln_out_reset(const LnOut& o, const void* dx_init) {
    CUDA_CHECK(cudaMemsetAsync(o.n, 0xAB, o.codes, g_stream));
    CUDA_CHECK(cudaMemsetAsync(o.t, 0xAB, o.codes, g_stream));
    CUDA_CHECK(cudaMemsetAsync(o.sc, 0, sizeof(Fp8Scale), g_stream));
    CUDA_CHECK(cudaMemsetAsync(o.f, 0xFF, o.floats * 4, g_stream));
    if (o.dx) CUDA_CHECK(cudaMemcpyAsync(o.dx, dx_init, o.dx_bytes, cudaMemcpyDeviceToDevice, g_stream));
}

static bool ln_same(const LnOut& a, const LnOut& b) {
    return same_device_bytes(a.n, b.n, a.codes) && same_device_bytes(a.t, b.t, a.codes) &&
           same_device_bytes(a.sc, b.sc, sizeof(Fp8Scale)) && same_device_bytes(a.f, b.f, a.floats * 4) &&
           (!a.dx || same_device_bytes(a.dx, b.dx, a.dx_bytes));
}

/* Present (launch(o, false)) against wide (launch(o, true)): the bytes once from poisoned outputs,
 * then both times queued and the speed-up. */
template <typename F>
static void compare_ln_kernel(const char* model, const char* kernel, const char* shape, const LnOut& present,
                              const LnOut& wide, const void* dx_init, double bytes, F launch) {
    ln_out_reset(present, dx_init);
    ln_out_reset(wide, dx_init);
    launch(present, false);
    launch(wide, true);
    bool same = ln_same(present, wide);
    g_ln_differs += !same;
    float t0 = time_median_queued_us([&] { launch(present, false); });
    float t1 = time_median_queued_us([&] { launch(wide, true); });
    printf("%-5s %-28s %-14s present %7.1f us %5.0f GB/s  wide %7.1f us %5.0f GB/s  x%.2f  %s\n", model, kernel,
           shape, t0, bytes / (t0 * 1e3), t1, bytes / (t1 * 1e3), t0 / t1, same ? "same bytes" : "BYTES DIFFER");
}

/* The fused LayerNorm forward and backward (delayed scaling) of N rows of C, present and wide
 * (FP8_LN_WIDE), on random bf16 rows, gamma, beta and gradients; mean and rstd from the forward. */
static void compare_ln(const char* model, int N, int C) {
    size_t nc = (size_t)N * C;
    bf16 *x = random_buffer<bf16>(nc, 11), *dout = random_buffer<bf16>(nc, 12), *dres = random_buffer<bf16>(nc, 13);
    float *gamma = random_buffer<float>(C, 14), *beta = random_buffer<float>(C, 15);
    Fp8History hist_host = {{1, 2, 0}, 3};
    Fp8History* hist = (Fp8History*)dmalloc(sizeof hist_host);
    CUDA_CHECK(cudaMemcpy(hist, &hist_host, sizeof hist_host, cudaMemcpyHostToDevice));
    char sh[32];
    snprintf(sh, sizeof sh, "%dx%d", N, C);
    if (!layernorm_fwd_fp8_wide_packets<bf16>(N, C, true)) {
        fprintf(stderr, "error: layernorm_fwd_fp8 %s is not the wide kernel's\n", sh);
        exit(1);
    }
    LnOut fp = ln_out(nc, 2 * (size_t)N, 0), fw = ln_out(nc, 2 * (size_t)N, 0);
    compare_ln_kernel(model, "layernorm_fwd_fp8", sh, fp, fw, NULL, 4.0 * nc + 8.0 * N, [&](const LnOut& o, bool w) {
        if (w) layernorm_fwd_fp8<bf16>(o.n, o.t, o.sc, hist, o.f, o.f + N, x, gamma, beta, N, C);
        else
            launch_kernel_with_shared(k_layernorm_fwd_fp8<bf16, PACK(bf16)>, N / LN_FP8_ROWS, 32 * LN_WARPS,
                                      (size_t)LN_FP8_ROWS * (C + 16), o.n, o.t, o.sc, hist, o.f, o.f + N, x, gamma,
                                      beta, N, C);
    });
    const float *mean = fp.f, *rstd = fp.f + N; /* the present forward's, as the engine saves them */
    LnBwdRegs rp = ln_bwd_regs_plan(dres, dout, x, gamma, N, C);
    if (!layernorm_bwd_fp8_fits(dres, dout, x, gamma, N, C) || !rp.packed) {
        fprintf(stderr, "error: layernorm_bwd_fp8 %s is not the packed fused kernel's\n", sh);
        exit(1);
    }
    size_t partials = 2 * (size_t)rp.n_chunks * C;
    LnOut bp = ln_out(nc, partials, nc * sizeof(bf16)), bw = ln_out(nc, partials, nc * sizeof(bf16));
    compare_ln_kernel(model, "layernorm_bwd_fp8 (no final)", sh, bp, bw, dres, 10.0 * nc + 4.0 * partials,
                      [&](const LnOut& o, bool w) {
                          LnBwdCodes codes = {o.n, o.t, o.sc, hist, FP8_GRAD_FMT, 0.0f};
                          LnBwdCodesWide wide = {codes};
                          if (w)
                              LN_LAUNCH_PACKETS(true, rp.packets, k_layernorm_bwd_fp8_wide, bf16, rp.n_chunks,
                                                32 * LN_WARPS, (bf16*)o.dx, o.f, dout, x, gamma, mean, rstd, N, C,
                                                rp.rows_per_chunk, wide);
                          else
                              LN_LAUNCH_PACKETS(true, rp.packets, k_layernorm_bwd_fp8, bf16, rp.n_chunks,
                                                32 * LN_WARPS, (bf16*)o.dx, o.f, dout, x, gamma, mean, rstd, N, C,
                                                rp.rows_per_chunk, codes);
                      });
    CUDA_CHECK(cudaDeviceSynchronize());
    for (void* b : g_buffers) CUDA_CHECK(cudaFree(b));
    g_buffers.clear();
}
#endif

#if FP8_TRANSPOSE_WIDE
/* Whether the transpose `launch` writes into out (poisoned before) the bytes of `want`. */
template <typename F> static bool transpose_same(F launch, fp8* out, const std::vector<unsigned char>& want) {
    std::vector<unsigned char> got(want.size());
    CUDA_CHECK(cudaMemsetAsync(out, 0xAB, want.size(), g_stream));
    launch();
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(got.data(), out, got.size(), cudaMemcpyDeviceToHost));
    return got == want;
}

/* The present k_fp8_transpose and the wide one, tiles down (fp8_transpose's) and across, on random
 * codes [R, Cc] (the bytes of random floats): times, GB/s moved (read and write), and the byte
 * check against the present kernel's output. Returns how many of the two differ. */
static int compare_transpose(const char* model, int R, int Cc) {
    size_t n = (size_t)R * Cc;
    const fp8* in = (const fp8*)random_buffer<float>(n / 4, 11);
    fp8 *present = (fp8*)dmalloc(n), *wide = (fp8*)dmalloc(n);
    auto launch_present = [&] {
        launch_kernel(k_fp8_transpose, fp8_cast_tiles(1, R, Cc), FP8_CAST_THREADS, present, in, R, Cc);
    };
    auto launch_down = [&] {
        launch_kernel(k_fp8_transpose_wide<true>, fp8_transpose_wide_tiles(R, Cc), FP8_CAST_THREADS, wide, in, R, Cc);
    };
    auto launch_across = [&] {
        launch_kernel(k_fp8_transpose_wide<false>, fp8_transpose_wide_tiles(R, Cc), FP8_CAST_THREADS, wide, in, R, Cc);
    };
    std::vector<unsigned char> want(n);
    CUDA_CHECK(cudaMemsetAsync(present, 0xAB, n, g_stream));
    launch_present();
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(want.data(), present, n, cudaMemcpyDeviceToHost));
    bool same[2] = {transpose_same(launch_down, wide, want), transpose_same(launch_across, wide, want)};
    float t0 = time_median_queued_us(launch_present);
    float t[2] = {time_median_queued_us(launch_down), time_median_queued_us(launch_across)};
    const char* order[2] = {"wide, tiles down (engine)", "wide, tiles across"};
    char sh[32];
    snprintf(sh, sizeof sh, "%dx%d", R, Cc);
    for (int k = 0; k < 2; k++)
        printf("%-5s %-26s %-12s present %7.1f us %5.0f GB/s  wide %7.1f us %5.0f GB/s  x%.2f  %s\n", model, order[k],
               sh, t0, 2.0 * n / (t0 * 1e3), t[k], 2.0 * n / (t[k] * 1e3), t0 / t[k],
               same[k] ? "same bytes" : "BYTES DIFFER");
    CUDA_CHECK(cudaDeviceSynchronize());
    for (void* b : g_buffers) CUDA_CHECK(cudaFree(b));
    g_buffers.clear();
    return !same[0] + !same[1];
}
#endif

#if FP8_LOSS_PACKED
/* The FP8 classifier's loss rows with the present store (LossStoreFp8) and the packed one
 * (LossStoreFp8Packed) on n random logits rows of the padded vocabulary: times, GB/s moved (the
 * bf16 logits read, the codes written), and whether both write the same codes, scale, losses and
 * lse. Returns 1 if they differ. */
static int compare_loss_store(const char* model, int n) {
    const int V = 50257, Vp = 50304;
    size_t nv = (size_t)n * Vp;
    bf16* logits = random_buffer<bf16>(nv, 13);
    float ds = 1.0f / 8192.0f, *dscale = (float*)dmalloc(4);
    std::vector<int> t(n);
    for (int i = 0; i < n; i++) t[i] = (int)((unsigned)i * 7919u % V);
    int* targets = (int*)dmalloc((size_t)n * 4);
    CUDA_CHECK(cudaMemcpy(targets, t.data(), (size_t)n * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(dscale, &ds, 4, cudaMemcpyHostToDevice));
    fp8 *codes_p = (fp8*)dmalloc(nv), *codes_k = (fp8*)dmalloc(nv);
    float *out_p = (float*)dmalloc(2 * (size_t)n * 4), *out_k = (float*)dmalloc(2 * (size_t)n * 4);
    Fp8Scale *sc_p = (Fp8Scale*)dmalloc(sizeof(Fp8Scale)), *sc_k = (Fp8Scale*)dmalloc(sizeof(Fp8Scale));
    auto launch_present = [&] {
        loss_rows(out_p, out_p + n, logits, targets, n, V, Vp, dscale, LossStoreFp8{codes_p, sc_p, Vp});
    };
    auto launch_packed = [&] {
        loss_rows(out_k, out_k + n, logits, targets, n, V, Vp, dscale, LossStoreFp8Packed{codes_k, sc_k, Vp});
    };
    launch_present();
    launch_packed();
    bool same = same_device_bytes(codes_p, codes_k, nv) && same_device_bytes(out_p, out_k, 2 * (size_t)n * 4) &&
                same_device_bytes(sc_p, sc_k, 2 * sizeof(float)); /* descale and scale */
    float t0 = time_median_queued_us(launch_present), t1 = time_median_queued_us(launch_packed);
    char sh[32];
    snprintf(sh, sizeof sh, "%dx%d", n, Vp);
    printf("%-5s %-12s present %7.1f us %5.0f GB/s  packed %7.1f us %5.0f GB/s  x%.2f  %s\n", model, sh, t0,
           3.0 * nv / (t0 * 1e3), t1, 3.0 * nv / (t1 * 1e3), t0 / t1, same ? "same bytes" : "BYTES DIFFER");
    CUDA_CHECK(cudaDeviceSynchronize());
    for (void* b : g_buffers) CUDA_CHECK(cudaFree(b));
    g_buffers.clear();
    return !same;
}
#endif

int main(void) {
    cudaDeviceProp p;
    CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
    printf("%s: bytes moved / median time; the GPU's memory bandwidth is the bound\n", p.name);
    bench("120M", 8192, 768, 3072, 12);
    bench("12M", 4096, 192, 768, 6);
    int differs = 0;
#if FP8_CAST_WIDE
    printf("\npresent packed cast kernels and the wide ones (FP8_CAST_WIDE), queued: median us, GB/s moved\n");
    compare_wide("120M", 8192, 768, 3072, 12);
    compare_wide("12M", 4096, 192, 768, 6);
    printf("%s\n", g_wide_differs ? "error: the wide kernels' bytes DIFFER from the present ones" : "all bytes the same");
    differs += g_wide_differs;
#endif
#if FP8_LN_WIDE
    printf("\npresent fused LayerNorm kernels and the wide ones (FP8_LN_WIDE), queued: median us, GB/s moved\n");
    compare_ln("120M", 8192, 768);
    compare_ln("12M", 4096, 192);
    printf("%s\n", g_ln_differs ? "error: the wide LayerNorm kernels' bytes DIFFER from the present ones"
                                 : "all LayerNorm bytes the same");
    differs += g_ln_differs;
#endif
#if FP8_TRANSPOSE_WIDE
    /* the dlogits codes of a logits chunk: ANDREA-120M's (B·T 8192: two chunks of 4096 rows) and
     * -12M's (one of 4096); all 8192 rows in one; 1040 rows: a last tile row of 16 */
    printf("\npresent fp8_transpose and the wide one (FP8_TRANSPOSE_WIDE), queued: median us, GB/s moved\n");
    int t_differs = compare_transpose("120M", 4096, 50304) + compare_transpose("120M", 8192, 50304) +
                    compare_transpose("12M", 4096, 50304) + compare_transpose("odd", 1040, 50304);
    printf("%s\n", t_differs ? "error: the wide transpose's bytes DIFFER from the present one's" : "all bytes the same");
    differs += t_differs;
#endif
#if FP8_LOSS_PACKED
    /* a logits chunk's rows as loss_chunk_rows sizes them: ANDREA-120M's two (5248 and 2944 of
     * B·T 8192), -12M's one (4096; its engine runs the FP8 classifier from d_model 512 only) */
    printf("\nthe FP8 classifier's loss rows, present store and packed (FP8_LOSS_PACKED), queued: median us, "
           "GB/s moved\n");
    int l_differs = compare_loss_store("120M", loss_chunk_rows(50304, sizeof(bf16), 8192)) +
                    compare_loss_store("120M", 8192 - loss_chunk_rows(50304, sizeof(bf16), 8192)) +
                    compare_loss_store("12M", loss_chunk_rows(50304, sizeof(bf16), 4096));
    printf("%s\n", l_differs ? "error: the packed store's bytes DIFFER from the present one's" : "all bytes the same");
    differs += l_differs;
#endif
    return differs ? 1 : 0;
}
