/* dgelu_bench.cu: the GELU backward's product alone, dh = (dout · W_2^T) ⊙ gelu'(h), at the MLP shapes
 * of ANDREA-120M (8192 x 3072 x 768) and ANDREA-12M (4096 x 768 x 192): cuBLASLt's plain product of
 * that shape (no epilogue: the floor), cuBLASLt's DGELU epilogue (the engine's product off Hopper)
 * and k_gemm_dgelu_pingpong (microgpt/cuda/mlp.cuh, the engine's on Hopper), each the median of 50
 * launches queued back to back (bench/kernel_timer.cuh), on the same random inputs; then the largest
 * difference between the two dh, in units of the larger's bf16 ulp. A measurement tool for that
 * kernel (docs/BENCHMARKS.md #123-#124, #160), not part of the engine or the tests: build/kernel_check
 * checks its results against the CPU engine.
 *
 *   build: make build/dgelu_bench
 *   run:   build/dgelu_bench */
#include "kernel_timer.cuh"
#include "../microgpt/cuda/mlp.cuh"

/* The largest |a - b| over the output, in ulps of bf16 at max(|a|, |b|) (one ulp: 2^-7 of the
 * value's power of two); infinite where either holds a value that is not finite. */
static double max_ulps(const bf16* a, const bf16* b, size_t n) {
    std::vector<bf16> ha(n), hb(n);
    CUDA_CHECK(cudaMemcpy(ha.data(), a, n * sizeof(bf16), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(hb.data(), b, n * sizeof(bf16), cudaMemcpyDeviceToHost));
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        double x = __bfloat162float(ha[i]), y = __bfloat162float(hb[i]), big = fmax(fabs(x), fabs(y));
        if (!std::isfinite(x) || !std::isfinite(y)) return INFINITY; /* fmax would skip a NaN */
        if (big == 0.0) continue;
        double ulp = ldexp(1.0, ilogb(big) - 7);
        worst = fmax(worst, fabs(x - y) / ulp);
    }
    return worst;
}

static void bench_shape(const char* model, int M, int N, int K) {
    bf16 *dout = random_bf16((size_t)M * K, 1, 1.7f), *w = random_bf16((size_t)N * K, 2, 0.06f);
    bf16 *h = random_bf16((size_t)M * N, 3, 3.0f), *dh_lt, *dh_pp;
    CUDA_CHECK(cudaMalloc(&dh_lt, (size_t)M * N * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&dh_pp, (size_t)M * N * sizeof(bf16)));
    double flop = 2.0 * M * N * K;
    auto line = [&](const char* who, float us) {
        printf("dgelu_bench %-5s %-8s %9.1f us %8.1f TFLOP/s\n", model, who, us, flop / (us * 1e-6) / 1e12);
    };
    /* the plain product of the same shape (no epilogue): the floor a fused epilogue aims at */
    line("plain", time_median_queued_us([&] { linear_dx(dh_pp, dout, w, M, N, K, 0.0f); }, 50));
    CUDA_CHECK(cudaMemset(dh_pp, 0xFF, (size_t)M * N * sizeof(bf16))); /* NaN: a tile left unwritten shows */
    line("cublaslt", time_median_queued_us([&] {
             if (!gemm_fused(GEMM_DGELU, M, N, K, mat(dout, K), mat_t(w, K), mat(dh_lt, N), NULL, h)) {
                 fprintf(stderr, "error: cuBLASLt has no DGELU product for %d x %d x %d\n", M, N, K);
                 exit(1);
             }
         }, 50));
    line("pingpong", time_median_queued_us([&] {
             if (!dgelu_pingpong(dh_pp, dout, w, h, M, N, K)) {
                 fprintf(stderr, "error: k_gemm_dgelu_pingpong does not take %d x %d x %d on this GPU\n", M, N, K);
                 exit(1);
             }
         }, 50));
    CUDA_CHECK(cudaStreamSynchronize(g_stream));
    printf("dgelu_bench %-5s largest difference %.1f ulp\n", model, max_ulps(dh_lt, dh_pp, (size_t)M * N));
    for (void* p : {(void*)dout, (void*)w, (void*)h, (void*)dh_lt, (void*)dh_pp}) CUDA_CHECK(cudaFree(p));
}

int main(int argc, char** argv) {
    (void)argv;
    if (argc > 1) {
        fprintf(stderr, "error: dgelu_bench takes no arguments\n");
        return 2;
    }
    CUDA_CHECK(cudaStreamCreate(&g_stream));
    void* ws;
    CUDA_CHECK(cudaMalloc(&ws, CUBLAS_WORKSPACE_BYTES));
    cublas_init(ws, CUBLAS_WORKSPACE_BYTES);
    bench_shape("120M", 8192, 3072, 768);
    bench_shape("12M", 4096, 768, 192);
    return 0;
}
